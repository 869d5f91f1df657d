"""mLSTM ops (xLSTM's matrix LSTM; MATH.md §2): ``torch.ops.fastweight.mlstm_*`` and the functional API.

Shapes follow NX-AI's mlstm_kernels: q, k (B, NH, S, DQK), v (B, NH, S, DV), i, f (B, NH, S) gate
preactivations; states c (B, NH, DQK, DV), n (B, NH, DQK), m (B, NH, 1), float32. q is scaled by
1/sqrt(DQK) inside; eps = 1e-6.

    mlstm(q, k, v, i, f, c_initial=None, n_initial=None, m_initial=None,
          return_last_states=False, eps=1e-6, chunk_size=64) -> h | (h, (c, n, m))
    mlstm_headnorm(q, k, v, i, f, weight=None, bias=None, ..., norm_eps=1e-6, weight_offset=0.0)
    mlstm_step(q, k, v, i, f, c, n, m, eps=1e-6, inplace=False) -> (h, (c, n, m))
    mlstm_parallel(q, k, v, i, f, eps=1e-6) -> (h, n, m)   (tiled CUDA kernels)
    mlstm_parallel_headnorm(q, k, v, i, f, weight=None, bias=None, eps=1e-6, norm_eps=1e-6, weight_offset=0.0)
    mlstm_decay_matrix(i, f) -> D (B, NH, S, S)

Everything is differentiable (q, k, v, i, f and the initial states; the last states too), and the
gradient is exact: the normaliser's gradient is kept (mlstm_kernels drops it). Custom ops with fake
kernels: ``torch.compile(fullgraph=True)`` works. In plain eager mode ``mlstm`` and the parallel forms
skip the dispatcher (a torch.autograd.Function over the same _C calls: the same bits, a third of the
host time; see fastweight.ops), and the steps call _C directly. CPU tensors run the float64 reference behind the
C++ API; CUDA tensors run the CUDA kernels (forward, backward, step, decay matrix).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _C
from .ops import (_AUTOGRAD, _CUSTOM_OP, _NO_GRAD, _apply, _fast_once_differentiable, _func_fn, _last_contig, _prep_gate,
                  _register_vmap, _route_all, _spec, _stream, _under_func, head_norm)

__all__ = ["mlstm", "mlstm_headnorm", "mlstm_step", "mlstm_parallel", "mlstm_parallel_headnorm", "mlstm_decay_matrix"]

_F32 = torch.float32


def _empty(x: Tensor) -> Tensor:
    return x.new_empty(0)


def _workspace(x: Tensor, nbytes: int) -> Optional[Tensor]:
    """Scratch for a _C call from torch's caching allocator (CUDA-graph safe); None when 0 bytes.
    The caller keeps the tensor in a local variable for the call and passes _ws_spec of it."""
    return x.new_empty(nbytes, dtype=torch.uint8) if nbytes > 0 else None


def _ws_spec(ws: Optional[Tensor]):
    return (ws.data_ptr(), ws.numel()) if ws is not None else None


def _opt(t: Tensor) -> Optional[Tensor]:
    """Custom ops cannot return None: an empty tensor stands for 'not computed'."""
    return t if t.numel() > 0 or t.dim() != 1 else None


def _state_shapes(q: Tensor, v: Tensor):
    B, NH, _, DQK = q.shape
    return (B, NH, DQK, v.shape[-1]), (B, NH, DQK), (B, NH, 1)


# ---- forward / backward custom ops ----------------------------------------------------------------
def _mlstm_fwd_run(q, k, v, i, f, c_initial, n_initial, m_initial, eps, chunk_size, return_last_states):
    """The forward's _C call, shared by the custom op and the eager path: (h, c, n, m), the last
    states None unless return_last_states."""
    h = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    if return_last_states:
        cs, ns, ms = _state_shapes(q, v)
        c, n, m = q.new_empty(cs, dtype=_F32), q.new_empty(ns, dtype=_F32), q.new_empty(ms, dtype=_F32)
    else:
        c = n = m = None
    args = (_spec(q), _spec(k), _spec(v), _spec(i), _spec(f), _spec(c_initial), _spec(n_initial), _spec(m_initial),
            _spec(h), _spec(c), _spec(n), _spec(m), eps, chunk_size)
    ws = _workspace(q, _C.mlstm_fwd_workspace_size(*args))
    _C.mlstm_fwd(*args, _ws_spec(ws), _stream(q))
    return h, c, n, m


def _mlstm_bwd_run(dh, q, k, v, i, f, c_initial, n_initial, m_initial, dc_last, dn_last, dm_last, eps, chunk_size):
    """The backward's _C call, shared likewise: (dq, dk, dv, di, df, dc0, dn0, dm0), the initial
    states' gradients None without initial states."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    di, df = torch.empty_like(i), torch.empty_like(f)
    has_init = c_initial is not None
    dc0 = torch.empty_like(c_initial) if has_init else None
    dn0 = torch.empty_like(n_initial) if has_init else None
    dm0 = torch.empty_like(m_initial) if has_init else None
    args = (_spec(q), _spec(k), _spec(v), _spec(i), _spec(f), _spec(c_initial), _spec(n_initial), _spec(m_initial),
            _spec(dh), _spec(dc_last), _spec(dn_last), _spec(dm_last), _spec(dq), _spec(dk), _spec(dv), _spec(di),
            _spec(df), _spec(dc0), _spec(dn0), _spec(dm0), eps, chunk_size)
    ws = _workspace(q, _C.mlstm_bwd_workspace_size(*args))
    _C.mlstm_bwd(*args, _ws_spec(ws), _stream(q))
    return dq, dk, dv, di, df, dc0, dn0, dm0


@torch.library.custom_op("fastweight::mlstm_fwd", mutates_args=())
def _mlstm_fwd(q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, c_initial: Optional[Tensor],
               n_initial: Optional[Tensor], m_initial: Optional[Tensor], eps: float, chunk_size: int,
               return_last_states: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    h, c, n, m = _mlstm_fwd_run(q, k, v, i, f, c_initial, n_initial, m_initial, eps, chunk_size, return_last_states)
    if not return_last_states:
        c, n, m = _empty(q), _empty(q), _empty(q)  # distinct: outputs must not alias
    return h, c, n, m


@_mlstm_fwd.register_fake
def _(q, k, v, i, f, c_initial, n_initial, m_initial, eps, chunk_size, return_last_states):
    h = q.new_empty(v.shape)
    if not return_last_states:
        return h, _empty(q), _empty(q), _empty(q)
    cs, ns, ms = _state_shapes(q, v)
    return h, q.new_empty(cs, dtype=_F32), q.new_empty(ns, dtype=_F32), q.new_empty(ms, dtype=_F32)


@torch.library.custom_op("fastweight::mlstm_bwd", mutates_args=())
def _mlstm_bwd(dh: Tensor, q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, c_initial: Optional[Tensor],
               n_initial: Optional[Tensor], m_initial: Optional[Tensor], dc_last: Optional[Tensor],
               dn_last: Optional[Tensor], dm_last: Optional[Tensor], eps: float,
               chunk_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    dq, dk, dv, di, df, dc0, dn0, dm0 = _mlstm_bwd_run(dh, q, k, v, i, f, c_initial, n_initial, m_initial, dc_last,
                                                      dn_last, dm_last, eps, chunk_size)
    if c_initial is None:
        dc0, dn0, dm0 = _empty(q), _empty(q), _empty(q)
    return dq, dk, dv, di, df, dc0, dn0, dm0


@_mlstm_bwd.register_fake
def _(dh, q, k, v, i, f, c_initial, n_initial, m_initial, dc_last, dn_last, dm_last, eps, chunk_size):
    init = c_initial is not None
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(i), torch.empty_like(f),
            torch.empty_like(c_initial) if init else _empty(q), torch.empty_like(n_initial) if init else _empty(q),
            torch.empty_like(m_initial) if init else _empty(q))


def _mlstm_setup(ctx, inputs, output):
    q, k, v, i, f, c0, n0, m0, eps, chunk_size, return_last = inputs
    ctx.save_for_backward(q, k, v, i, f, c0, n0, m0)
    ctx.eps, ctx.chunk_size, ctx.return_last = eps, chunk_size, return_last


def _mlstm_backward(ctx, dh, dc, dn, dm):
    q, k, v, i, f, c0, n0, m0 = ctx.saved_tensors
    if not ctx.return_last:
        dc = dn = dm = None
    dc, dn, dm = _last_contig(dc), _last_contig(dn), _last_contig(dm)
    dq, dk, dv, di, df, dc0, dn0, dm0 = _mlstm_bwd(_last_contig(dh), q, k, v, i, f, c0, n0, m0, dc, dn, dm,
                                                  ctx.eps, ctx.chunk_size)
    if c0 is None:
        dc0 = dn0 = dm0 = None
    return dq, dk, dv, di, df, dc0, dn0, dm0, None, None, None


_mlstm_fwd.register_autograd(_mlstm_backward, setup_context=_mlstm_setup)
_FuncMlstm = _func_fn("_FuncMlstm", _mlstm_fwd, _mlstm_setup, _mlstm_backward)  # torch.func (fastweight.ops)


# ---- eager path: torch.autograd.Function over the same _C calls (fastweight.ops: _route_all) --------
# torch.library's dispatch and autograd wrapper cost more host time than the whole fwd + bwd of small
# shapes (fill_defaults alone ~50 us per call on the CI machine); the bits are the custom ops'.
class _MlstmFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, i, f, c0, n0, m0, eps, chunk_size, return_last):
        h, c, n, m = _mlstm_fwd_run(q, k, v, i, f, c0, n0, m0, eps, chunk_size, return_last)
        ctx.save_for_backward(q, k, v, i, f, c0, n0, m0)
        ctx.eps, ctx.chunk_size, ctx.return_last = eps, chunk_size, return_last
        return h, c, n, m

    @staticmethod
    @_fast_once_differentiable
    def backward(ctx, dh, dc, dn, dm):
        q, k, v, i, f, c0, n0, m0 = ctx.saved_tensors
        if not ctx.return_last:
            dc = dn = dm = None
        grads = _mlstm_bwd_run(_last_contig(dh), q, k, v, i, f, c0, n0, m0, _last_contig(dc), _last_contig(dn),
                               _last_contig(dm), ctx.eps, ctx.chunk_size)
        return (*grads, None, None, None)


_mlstm_apply = _apply(_MlstmFn)


# ---- functional API ---------------------------------------------------------------------------------
def _prep_states(q: Tensor, c, n, m):
    """Initial states as float32 (B, NH, DQK, DV), (B, NH, DQK), (B, NH, 1), or Nones. The three come
    together (the C++ API names the missing one otherwise)."""
    if c is None and n is None and m is None:
        return None, None, None
    def f32(t):
        return None if t is None else _last_contig(t if t.dtype == _F32 else t.to(_F32))
    if m is not None and m.dim() == 2:
        m = m.unsqueeze(-1)
    return f32(c), f32(n), f32(m)


def mlstm(q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, c_initial: Optional[Tensor] = None,
          n_initial: Optional[Tensor] = None, m_initial: Optional[Tensor] = None, return_last_states: bool = False,
          eps: float = 1e-6, chunk_size: int = 64):
    """The mLSTM over a sequence (chunkwise form, any S): returns h (B, NH, S, DV) in q's dtype, and with
    ``return_last_states`` also the float32 final states (c, n, m), m shaped (B, NH, 1)."""
    c0, n0, m0 = _prep_states(q, c_initial, n_initial, m_initial)
    q, k, v, i, f = _last_contig(q), _last_contig(k), _last_contig(v), _prep_gate(i, q), _prep_gate(f, q)
    args = (q, k, v, i, f, c0, n0, m0, float(eps), int(chunk_size), bool(return_last_states))
    route = _route_all((q, k, v, i, f, c0, n0, m0))
    if route == _AUTOGRAD:
        h, c, n, m = _mlstm_apply(*args)
    elif route == _NO_GRAD:
        h, c, n, m = _mlstm_fwd_run(*args)
    else:
        h, c, n, m = (_FuncMlstm.apply if _under_func() else _mlstm_fwd)(*args)
    return (h, (c, n, m)) if return_last_states else h


def mlstm_headnorm(q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, weight: Optional[Tensor] = None,
                   bias: Optional[Tensor] = None, c_initial: Optional[Tensor] = None,
                   n_initial: Optional[Tensor] = None, m_initial: Optional[Tensor] = None,
                   return_last_states: bool = False, eps: float = 1e-6, chunk_size: int = 64,
                   norm_eps: float = 1e-6, weight_offset: float = 0.0):
    """mLSTM followed by the per-head LayerNorm of seed 000 / xLSTM's MultiHeadLayerNorm: each
    (b, head, t) row of h is normalised over DV with weight/bias (NH, DV). Returns out (B, NH, S, DV)
    (and the last states). Today the two ops run one after the other (exact gradients, the
    normaliser's included); the fused kernel is part of issue 3's CUDA work."""
    res = mlstm(q, k, v, i, f, c_initial, n_initial, m_initial, return_last_states, eps, chunk_size)
    h = res[0] if return_last_states else res
    out = head_norm(h.transpose(1, 2), weight, bias, norm_eps, weight_offset).transpose(1, 2)
    return (out, res[1]) if return_last_states else out


# ---- decoding step -------------------------------------------------------------------------------------
@torch.library.custom_op("fastweight::mlstm_step", mutates_args=())
def _mlstm_step(q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, c: Tensor, n: Tensor, m: Tensor,
                eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _mlstm_step_run(q, k, v, i, f, c, n, m, eps)


def _mlstm_step_run(q, k, v, i, f, c, n, m, eps):
    """The step's _C call (new states), shared by the custom op and the eager path."""
    h = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    c2, n2, m2 = torch.empty_like(c), torch.empty_like(n), torch.empty_like(m)
    _C.mlstm_step(_spec(q), _spec(k), _spec(v), _spec(i), _spec(f), _spec(c), _spec(n), _spec(m), _spec(h),
                  _spec(c2), _spec(n2), _spec(m2), eps, _stream(q))
    return h, c2, n2, m2


def _mlstm_step_inplace_run(q, k, v, i, f, c, n, m, eps):
    """The in-place step's _C call (c, n, m updated), shared likewise."""
    h = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    cs, ns, ms = _spec(c), _spec(n), _spec(m)
    _C.mlstm_step(_spec(q), _spec(k), _spec(v), _spec(i), _spec(f), cs, ns, ms, _spec(h), cs, ns, ms, eps, _stream(q))
    return h


@_mlstm_step.register_fake
def _(q, k, v, i, f, c, n, m, eps):
    return q.new_empty(v.shape), torch.empty_like(c), torch.empty_like(n), torch.empty_like(m)


@torch.library.custom_op("fastweight::mlstm_step_", mutates_args=("c", "n", "m"))
def _mlstm_step_(q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, c: Tensor, n: Tensor, m: Tensor,
                 eps: float) -> Tensor:
    return _mlstm_step_inplace_run(q, k, v, i, f, c, n, m, eps)


@_mlstm_step_.register_fake
def _(q, k, v, i, f, c, n, m, eps):
    return q.new_empty(v.shape)


def mlstm_step(q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, c: Tensor, n: Tensor, m: Tensor,
               eps: float = 1e-6, inplace: bool = False):
    """One decoding step: q, k (B, NH, DQK), v (B, NH, DV), i, f (B, NH) or (B, NH, 1); states c, n, m
    (float32). Returns (h, (c, n, m)) with the new states; ``inplace=True`` writes them into c, n, m
    (which must then be float32 and contiguous in the last dim) and returns those tensors. No autograd
    (decoding)."""
    q, k, v = _last_contig(q), _last_contig(k), _last_contig(v)
    i, f = _prep_gate(i, q), _prep_gate(f, q)
    eager = _route_all((q, k, v, i, f, c, n, m)) != _CUSTOM_OP  # plain eager: the _C call directly (host time)
    if inplace:
        h = (_mlstm_step_inplace_run if eager else _mlstm_step_)(q, k, v, i, f, c, n, m, float(eps))
        return h, (c, n, m)
    h, c2, n2, m2 = (_mlstm_step_run if eager else _mlstm_step)(q, k, v, i, f, _last_contig(c), _last_contig(n),
                                                                _last_contig(m), float(eps))
    return h, (c2, n2, m2)


# ---- parallel form ------------------------------------------------------------------------------------
def _stats_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else _F32


@torch.library.custom_op("fastweight::mlstm_parallel_fwd", mutates_args=())
def _parallel_fwd(q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor,
                  eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """h, n, m and b (the signed row sum the backward needs: n = max(|b|, exp(-m)))."""
    return _parallel_fwd_run(q, k, v, i, f, eps)


def _parallel_fwd_run(q, k, v, i, f, eps):
    """The parallel forward's _C call, shared by the custom op and the eager path."""
    h = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    n, m, b = (q.new_empty(q.shape[:3], dtype=_stats_dtype(q)) for _ in range(3))
    args = (_spec(q), _spec(k), _spec(v), _spec(i), _spec(f), _spec(h), _spec(n), _spec(m), _spec(b), eps)
    ws = _workspace(q, _C.mlstm_parallel_fwd_workspace_size(*args))
    _C.mlstm_parallel_fwd(*args, workspace=_ws_spec(ws), stream=_stream(q))
    return h, n, m, b


@_parallel_fwd.register_fake
def _(q, k, v, i, f, eps):
    return (q.new_empty(v.shape),) + tuple(q.new_empty(q.shape[:3], dtype=_stats_dtype(q)) for _ in range(3))


@torch.library.custom_op("fastweight::mlstm_parallel_bwd", mutates_args=())
def _parallel_bwd(dh: Tensor, q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, h: Tensor, m: Tensor,
                  b: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _parallel_bwd_run(dh, q, k, v, i, f, h, m, b, eps)


def _parallel_bwd_run(dh, q, k, v, i, f, h, m, b, eps):
    """The parallel backward's _C call, shared likewise."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    di, df = torch.empty_like(i), torch.empty_like(f)
    args = (_spec(q), _spec(k), _spec(v), _spec(i), _spec(f), _spec(h), None, _spec(m), _spec(b), _spec(dh),
            _spec(dq), _spec(dk), _spec(dv), _spec(di), _spec(df), eps)
    ws = _workspace(q, _C.mlstm_parallel_bwd_workspace_size(*args))
    _C.mlstm_parallel_bwd(*args, workspace=_ws_spec(ws), stream=_stream(q))
    return dq, dk, dv, di, df


@_parallel_bwd.register_fake
def _(dh, q, k, v, i, f, h, m, b, eps):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(i), torch.empty_like(f)


def _parallel_setup(ctx, inputs, output):
    q, k, v, i, f, eps = inputs
    h, n, m, b = output
    ctx.save_for_backward(q, k, v, i, f, h, m, b)  # h: for the CPU path's signature; CUDA reads m, b
    ctx.eps = eps
    ctx.mark_non_differentiable(n, m, b)  # statistics, as FlashAttention's log-sum-exp: no gradient flows


def _parallel_backward(ctx, dh, dn, dm, db):
    q, k, v, i, f, h, m, b = ctx.saved_tensors
    if dh is None:
        dh = torch.zeros(v.shape, dtype=q.dtype, device=q.device)
    dq, dk, dv, di, df = _parallel_bwd(_last_contig(dh), q, k, v, i, f, h, m, b, ctx.eps)
    return dq, dk, dv, di, df, None


_parallel_fwd.register_autograd(_parallel_backward, setup_context=_parallel_setup)
_FuncParallel = _func_fn("_FuncParallel", _parallel_fwd, _parallel_setup, _parallel_backward)


class _ParallelFn(torch.autograd.Function):
    """The eager path of mlstm_parallel (fastweight.ops: _route_all): the custom op's _C calls."""
    @staticmethod
    def forward(ctx, q, k, v, i, f, eps):
        h, n, m, b = _parallel_fwd_run(q, k, v, i, f, eps)
        ctx.save_for_backward(q, k, v, i, f, h, m, b)
        ctx.eps = eps
        ctx.mark_non_differentiable(n, m)
        return h, n, m

    @staticmethod
    @_fast_once_differentiable
    def backward(ctx, dh, dn, dm):
        q, k, v, i, f, h, m, b = ctx.saved_tensors
        return (*_parallel_bwd_run(_last_contig(dh), q, k, v, i, f, h, m, b, ctx.eps), None)


_parallel_apply = _apply(_ParallelFn)


def mlstm_parallel(q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, eps: float = 1e-6):
    """Seed 000's parallel form (no initial states): returns (h, n, m), h (B, NH, S, DV) in q's dtype (the
    h of ``mlstm`` when eps = 0; with eps > 0 the forms' stabilisers, and so eps's weight, differ), n and m
    (B, NH, S) the per-position normaliser and stabiliser in float32 (float64 for float64 q). h is
    differentiable in q, k, v, i, f (exact gradient); n and m are statistics and carry no gradient. On
    CUDA the kernels are tiled (FlashAttention-style: no S x S matrix in memory) with fp32 compute."""
    q, k, v, i, f = _last_contig(q), _last_contig(k), _last_contig(v), _prep_gate(i, q), _prep_gate(f, q)
    route = _route_all((q, k, v, i, f))
    if route == _AUTOGRAD:
        return _parallel_apply(q, k, v, i, f, float(eps))
    run = _parallel_fwd_run if route == _NO_GRAD else _FuncParallel.apply if _under_func() else _parallel_fwd
    h, n, m, _ = run(q, k, v, i, f, float(eps))
    return h, n, m


# ---- parallel form with the head norm (seed 000's fusion) -----------------------------------------------
@torch.library.custom_op("fastweight::mlstm_parallel_headnorm_fwd", mutates_args=())
def _par_hn_fwd(q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, weight: Optional[Tensor],
                bias: Optional[Tensor], eps: float, norm_eps: float,
                weight_offset: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """out, and what the backward takes back: the pre-norm h, m and b."""
    return _par_hn_fwd_run(q, k, v, i, f, weight, bias, eps, norm_eps, weight_offset)


def _par_hn_fwd_run(q, k, v, i, f, weight, bias, eps, norm_eps, weight_offset):
    """The fused forward's _C call, shared by the custom op and the eager path."""
    out, h = torch.empty(v.shape, dtype=q.dtype, device=q.device), torch.empty(v.shape, dtype=q.dtype, device=q.device)
    m, b = (q.new_empty(q.shape[:3], dtype=_stats_dtype(q)) for _ in range(2))
    args = (_spec(q), _spec(k), _spec(v), _spec(i), _spec(f), _spec(h), None, _spec(m), _spec(b), eps, _spec(out),
            _spec(weight), _spec(bias), None, None, norm_eps, weight_offset)
    ws = _workspace(q, _C.mlstm_parallel_fwd_workspace_size(*args))
    _C.mlstm_parallel_fwd(*args, workspace=_ws_spec(ws), stream=_stream(q))
    return out, h, m, b


@_par_hn_fwd.register_fake
def _(q, k, v, i, f, weight, bias, eps, norm_eps, weight_offset):
    return (q.new_empty(v.shape), q.new_empty(v.shape)) + tuple(
        q.new_empty(q.shape[:3], dtype=_stats_dtype(q)) for _ in range(2))


@torch.library.custom_op("fastweight::mlstm_parallel_headnorm_bwd", mutates_args=())
def _par_hn_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, weight: Optional[Tensor],
                bias: Optional[Tensor], h: Tensor, m: Tensor, b: Tensor, eps: float, norm_eps: float,
                weight_offset: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    dq, dk, dv, di, df, dw, db = _par_hn_bwd_run(dout, q, k, v, i, f, weight, bias, h, m, b, eps, norm_eps,
                                                 weight_offset)
    return dq, dk, dv, di, df, dw if dw is not None else _empty(q), db if db is not None else _empty(q)


def _par_hn_bwd_run(dout, q, k, v, i, f, weight, bias, h, m, b, eps, norm_eps, weight_offset):
    """The fused backward's _C call, shared likewise (dw / db None without weight / bias)."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    di, df = torch.empty_like(i), torch.empty_like(f)
    dw = torch.empty_like(weight) if weight is not None else None
    db = torch.empty_like(bias) if bias is not None else None
    args = (_spec(q), _spec(k), _spec(v), _spec(i), _spec(f), _spec(h), None, _spec(m), _spec(b), None, _spec(dq),
            _spec(dk), _spec(dv), _spec(di), _spec(df), eps, _spec(dout), _spec(weight), _spec(bias), _spec(dw),
            _spec(db), norm_eps, weight_offset)
    ws = _workspace(q, _C.mlstm_parallel_bwd_workspace_size(*args))
    _C.mlstm_parallel_bwd(*args, workspace=_ws_spec(ws), stream=_stream(q))
    return dq, dk, dv, di, df, dw, db


@_par_hn_bwd.register_fake
def _(dout, q, k, v, i, f, weight, bias, h, m, b, eps, norm_eps, weight_offset):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(i), torch.empty_like(f),
            torch.empty_like(weight) if weight is not None else q.new_empty(0),
            torch.empty_like(bias) if bias is not None else q.new_empty(0))


def _par_hn_setup(ctx, inputs, output):
    q, k, v, i, f, weight, bias, eps, norm_eps, weight_offset = inputs
    _, h, m, b = output
    ctx.save_for_backward(q, k, v, i, f, weight, bias, h, m, b)
    ctx.args = (eps, norm_eps, weight_offset)
    ctx.mark_non_differentiable(h, m, b)  # what the backward takes back; the user sees out only


def _par_hn_backward(ctx, dout, dh, dm, db):
    q, k, v, i, f, weight, bias, h, m, b = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros(v.shape, dtype=q.dtype, device=q.device)
    dq, dk, dv, di, df, dw, dbias = _par_hn_bwd(_last_contig(dout), q, k, v, i, f, weight, bias, h, m, b, *ctx.args)
    return dq, dk, dv, di, df, _opt(dw), _opt(dbias), None, None, None


_par_hn_fwd.register_autograd(_par_hn_backward, setup_context=_par_hn_setup)
_FuncParHn = _func_fn("_FuncParHn", _par_hn_fwd, _par_hn_setup, _par_hn_backward)


class _ParHeadNormFn(torch.autograd.Function):
    """The eager path of mlstm_parallel_headnorm (fastweight.ops: _route_all): the custom op's _C calls."""
    @staticmethod
    def forward(ctx, q, k, v, i, f, weight, bias, eps, norm_eps, weight_offset):
        out, h, m, b = _par_hn_fwd_run(q, k, v, i, f, weight, bias, eps, norm_eps, weight_offset)
        ctx.save_for_backward(q, k, v, i, f, weight, bias, h, m, b)
        ctx.args = (eps, norm_eps, weight_offset)
        return out

    @staticmethod
    @_fast_once_differentiable
    def backward(ctx, dout):
        q, k, v, i, f, weight, bias, h, m, b = ctx.saved_tensors
        grads = _par_hn_bwd_run(_last_contig(dout), q, k, v, i, f, weight, bias, h, m, b, *ctx.args)
        return (*grads, None, None, None)


_par_hn_apply = _apply(_ParHeadNormFn)


def mlstm_parallel_headnorm(q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, weight: Optional[Tensor] = None,
                            bias: Optional[Tensor] = None, eps: float = 1e-6, norm_eps: float = 1e-6,
                            weight_offset: float = 0.0) -> Tensor:
    """Seed 000's parallel form with its head norm fused: out (B, NH, S, DV) = headnorm(h), each (b, head, t)
    row of h normalised over DV (weight / bias (NH, DV), scale weight_offset + weight; xLSTM's
    MultiHeadLayerNorm is weight_offset = 1). Exact gradients for q, k, v, i, f, weight and bias (the
    normaliser's path kept). On CUDA the norm's backward runs inside the backward's per-row pass."""
    q, k, v, i, f = _last_contig(q), _last_contig(k), _last_contig(v), _prep_gate(i, q), _prep_gate(f, q)
    args = (q, k, v, i, f, _last_contig(weight), _last_contig(bias), float(eps), float(norm_eps), float(weight_offset))
    route = _route_all(args[:7])
    if route == _AUTOGRAD:
        return _par_hn_apply(*args)
    return (_par_hn_fwd_run if route == _NO_GRAD else _FuncParHn.apply if _under_func() else _par_hn_fwd)(*args)[0]


# ---- decay matrix ------------------------------------------------------------------------------------
@torch.library.custom_op("fastweight::mlstm_decay_matrix_fwd", mutates_args=())
def _decay_fwd(i: Tensor, f: Tensor) -> Tensor:
    B, NH, S = i.shape
    D = i.new_empty((B, NH, S, S))
    _C.mlstm_decay_matrix_fwd(_spec(i), _spec(f), _spec(D), _stream(i))
    return D


@_decay_fwd.register_fake
def _(i, f):
    B, NH, S = i.shape
    return i.new_empty((B, NH, S, S))


@torch.library.custom_op("fastweight::mlstm_decay_matrix_bwd", mutates_args=())
def _decay_bwd(f: Tensor, dD: Tensor, i_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    di, df = torch.empty(f.shape, dtype=i_dtype, device=f.device), torch.empty_like(f)
    args = (_spec(f), _spec(dD), _spec(di), _spec(df))
    ws = _workspace(f, _C.mlstm_decay_matrix_bwd_workspace_size(*args))
    _C.mlstm_decay_matrix_bwd(*args, _ws_spec(ws), _stream(f))
    return di, df


@_decay_bwd.register_fake
def _(f, dD, i_dtype):
    return torch.empty(f.shape, dtype=i_dtype, device=f.device), torch.empty_like(f)


def _decay_setup(ctx, inputs, output):
    i, f = inputs
    ctx.save_for_backward(f)
    ctx.i_dtype = i.dtype


def _decay_backward(ctx, dD):
    (f,) = ctx.saved_tensors
    return _decay_bwd(f, _last_contig(dD), ctx.i_dtype)


_decay_fwd.register_autograd(_decay_backward, setup_context=_decay_setup)
_FuncDecay = _func_fn("_FuncDecay", _decay_fwd, _decay_setup, _decay_backward)
for _op in (_mlstm_fwd, _mlstm_bwd, _parallel_fwd, _parallel_bwd, _par_hn_fwd, _par_hn_bwd, _decay_fwd, _decay_bwd):
    _register_vmap(_op, False)  # one call per sample (vmap of torch.func.grad: per-sample gradients)


def mlstm_decay_matrix(i: Tensor, f: Tensor) -> Tensor:
    """Seed 001's log-space decay matrix: D[t, s] = F_t - F_s + i_s for s <= t, -inf above the
    diagonal, F_t = logsigmoid(f_1) + ... + logsigmoid(f_t). i, f (B, NH, S) -> D (B, NH, S, S) in i's
    dtype. Differentiable in i and f (the -inf entries are constants)."""
    return (_FuncDecay.apply if _under_func() else _decay_fwd)(_last_contig(i), _prep_gate(f, i))
