"""DeltaNet ops (the delta rule; MATH.md §3): ``torch.ops.fastweight.deltanet_*`` and ``fastweight.delta_rule``.

Layout and conventions are flash-linear-attention's (FLA), so tensors and states are interchangeable
with it: q, k (B, T, H, K), v (B, T, H, V), beta (B, T, H); states (N, H, K, V). Per (sequence, head):

    S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T,   o_t = scale * S_t^T q_t

    delta_rule(q, k, v, beta, scale=None, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, cu_seqlens=None, split_operands=True) -> (o, final_state or None)

scale defaults to K^-0.5; use_qk_l2norm_in_kernel normalises each row of q and k first
(x / sqrt(|x|^2 + 1e-6), FLA's convention). cu_seqlens (N+1 int32 or int64 offsets, B = 1) packs N
variable-length sequences, each with its own state (empty sequences allowed); without it N = B.
split_operands (CUDA, bfloat16, K <= 128): the tensor-core products whose operands come from fp32
values (states, the WY factors, their gradients) take them as bfloat16 hi + lo pairs (True: ~16 bits,
o 1.9e-3 from the float64 loop) or as bfloat16 alone (False: FLA's precision, o ~3.6e-3, fewer
products, half the state workspace); ignored elsewhere.
o has q's dtype; the final state is float32 (float64 when q is float64, a CPU-only dtype, so that
``gradcheck`` reaches the states too); initial_state is cast to that dtype. beta is used in q's dtype
or float32 (other dtypes are cast to float32).

Everything is differentiable: q, k, v, beta, initial_state, with the final state's gradient taken
into account (exact gradients). Custom ops with fake kernels: ``torch.compile(fullgraph=True)``
works; in plain eager mode ``delta_rule`` skips the dispatcher (a torch.autograd.Function over the
same _C calls: the same bits, half the host time; see fastweight.ops). CPU tensors run the float64 reference behind the C++ API. CUDA tensors run the CUDA kernels
(chunks of 64, fp32 accumulation and states; K <= 256, ValueError beyond; cu_seqlens on q's device,
checked on the host in eager mode at the cost of one synchronisation the first time a tensor is seen
and after any in-place change to it, as FLA's varlen path caches its chunk indices; trusted,
and clamped by the kernels, while a CUDA graph is captured or torch.compile traces). The forward and the backward take
their workspaces (``_C.deltanet_fwd_workspace_size`` / ``_C.deltanet_bwd_workspace_size`` bytes) from
torch's caching allocator, so training on CUDA works and stays CUDA-graph safe; ``delta_rule_step``
needs none. Where the forward's tensor-core pipeline runs (CUDA, bfloat16, K <= 128) and a gradient
will be taken, the forward also keeps its WY inverse ((B, T, H, 64), FLA's saved A; float32 with
split_operands) for the backward, which reads it instead of forming it again: the same gradient bits.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch import Tensor

from . import _C
from .mlstm_ops import _workspace, _ws_spec
from .ops import (_AUTOGRAD, _CUSTOM_OP, _NO_GRAD, _apply, _fast_once_differentiable, _func_fn, _last_contig, _nothing,
                  _or_nothing, _prep_gate, _register_vmap, _route_all, _spec, _stream, _under_func)

__all__ = ["delta_rule", "delta_rule_step"]


def _state_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _state_shape(q: Tensor, v: Tensor, cu_seqlens: Optional[Tensor]):
    B, _, H, K = q.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return (N, H, K, v.shape[-1])


# ---- forward / backward custom ops ----------------------------------------------------------------
# Custom ops cannot return None: an empty tensor (a distinct one per output: outputs must not alias)
# stands for 'not computed'.
def _wy_inverse_applies(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Where the forward's tensor-core pipeline runs (CUDA, bfloat16 q, k, v, 1 <= K <= 128): the only
    place the WY inverse exists (fastweight/deltanet.h, wy_inverse)."""
    return (q.device.type == "cuda" and q.dtype == k.dtype == v.dtype == torch.bfloat16 and 1 <= q.shape[-1] <= 128
            and q.numel() > 0)


def _wy_spec(wy: Optional[Tensor]):
    return _spec(wy) if wy is not None and wy.numel() > 0 else None


def _deltanet_fwd_run(q, k, v, beta, initial_state, cu_seqlens, scale, use_qk_l2norm_in_kernel, output_final_state,
                      split_operands=True, save_wy=False):
    """The forward's _C call, shared by the custom op and the eager path: (o, final state or None, WY inverse
    or None). save_wy: keep the pipeline's WY inverse (FLA's A) for the backward, where it exists."""
    o = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    ht = q.new_empty(_state_shape(q, v, cu_seqlens), dtype=_state_dtype(q)) if output_final_state else None
    wy = None
    if save_wy and _wy_inverse_applies(q, k, v):
        wy = q.new_empty((*q.shape[:3], 64), dtype=torch.float32 if split_operands else torch.bfloat16)
    args = (_spec(q), _spec(k), _spec(v), _spec(beta), _spec(initial_state), _spec(cu_seqlens), _spec(o), _spec(ht),
            scale, use_qk_l2norm_in_kernel, split_operands)
    ws = _workspace(q, _C.deltanet_fwd_workspace_size(*args))  # the tensor-core pipeline's scratch (or none)
    _C.deltanet_fwd(*args, _ws_spec(ws), _stream(q), wy_inverse=_wy_spec(wy))
    return o, ht, wy


def _deltanet_bwd_run(do, q, k, v, beta, initial_state, cu_seqlens, dfinal_state, scale, use_qk_l2norm_in_kernel,
                      split_operands=True, wy=None):
    """The backward's _C call, shared likewise: (dq, dk, dv, dbeta, dh0 or None). wy: the forward's WY
    inverse (or None: formed again)."""
    dq, dk, dv, dbeta = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(beta)
    dh0 = torch.empty_like(initial_state) if initial_state is not None else None
    args = (_spec(q), _spec(k), _spec(v), _spec(beta), _spec(initial_state), _spec(cu_seqlens), _spec(do),
            _spec(dfinal_state), _spec(dq), _spec(dk), _spec(dv), _spec(dbeta), _spec(dh0), scale,
            use_qk_l2norm_in_kernel, split_operands)
    wys = _wy_spec(wy)
    ws = _workspace(q, _C.deltanet_bwd_workspace_size(*args, wy_inverse=wys))  # caching allocator (0 B on the CPU)
    _C.deltanet_bwd(*args, _ws_spec(ws), _stream(q), wy_inverse=wys)
    return dq, dk, dv, dbeta, dh0


@torch.library.custom_op("fastweight::deltanet_fwd", mutates_args=())
def _deltanet_fwd(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, initial_state: Optional[Tensor],
                  cu_seqlens: Optional[Tensor], scale: Optional[float], use_qk_l2norm_in_kernel: bool,
                  output_final_state: bool, split_operands: bool, save_wy: bool) -> tuple[Tensor, Tensor, Tensor]:
    o, ht, wy = _deltanet_fwd_run(q, k, v, beta, initial_state, cu_seqlens, scale, use_qk_l2norm_in_kernel,
                                  output_final_state, split_operands, save_wy)
    return o, _or_nothing(ht, q), _or_nothing(wy, q)


@_deltanet_fwd.register_fake
def _(q, k, v, beta, initial_state, cu_seqlens, scale, use_qk_l2norm_in_kernel, output_final_state, split_operands,
      save_wy):
    o = q.new_empty(v.shape)
    ht = q.new_empty(_state_shape(q, v, cu_seqlens), dtype=_state_dtype(q)) if output_final_state else _nothing(q)
    wy = _nothing(q)
    if save_wy and _wy_inverse_applies(q, k, v):
        wy = q.new_empty((*q.shape[:3], 64), dtype=torch.float32 if split_operands else torch.bfloat16)
    return o, ht, wy


@torch.library.custom_op("fastweight::deltanet_bwd", mutates_args=())
def _deltanet_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, beta: Tensor, initial_state: Optional[Tensor],
                  cu_seqlens: Optional[Tensor], dfinal_state: Optional[Tensor], scale: Optional[float],
                  use_qk_l2norm_in_kernel: bool, split_operands: bool,
                  wy_inverse: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    dq, dk, dv, dbeta, dh0 = _deltanet_bwd_run(do, q, k, v, beta, initial_state, cu_seqlens, dfinal_state, scale,
                                               use_qk_l2norm_in_kernel, split_operands, wy_inverse)
    return dq, dk, dv, dbeta, _or_nothing(dh0, q)


@_deltanet_bwd.register_fake
def _(do, q, k, v, beta, initial_state, cu_seqlens, dfinal_state, scale, use_qk_l2norm_in_kernel, split_operands,
      wy_inverse):
    dh0 = torch.empty_like(initial_state) if initial_state is not None else _nothing(q)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(beta), dh0


def _deltanet_setup(ctx, inputs, output):
    q, k, v, beta, h0, cu_seqlens, scale, l2, output_final_state, split, save_wy = inputs
    ctx.mark_non_differentiable(output[2])
    wy = output[2] if output[2].numel() > 0 else None  # the forward's WY inverse, where it saved one
    ctx.save_for_backward(q, k, v, beta, h0, cu_seqlens, wy)
    ctx.scale, ctx.l2, ctx.output_final_state, ctx.split = scale, l2, output_final_state, split


def _deltanet_backward(ctx, do, dht, dwy):
    q, k, v, beta, h0, cu_seqlens, wy = ctx.saved_tensors
    dht = _last_contig(dht) if ctx.output_final_state else None
    dq, dk, dv, dbeta, dh0 = _deltanet_bwd(_last_contig(do), q, k, v, beta, h0, cu_seqlens, dht, ctx.scale, ctx.l2,
                                           ctx.split, wy)
    return dq, dk, dv, dbeta, (dh0 if h0 is not None else None), None, None, None, None, None, None


_deltanet_fwd.register_autograd(_deltanet_backward, setup_context=_deltanet_setup)
_FuncDeltanet = _func_fn("_FuncDeltanet", _deltanet_fwd, _deltanet_setup, _deltanet_backward)  # torch.func (fastweight.ops)
for _op in (_deltanet_fwd, _deltanet_bwd):
    _register_vmap(_op, False)  # one call per sample (vmap of torch.func.grad: per-sample gradients)


# ---- eager path: torch.autograd.Function over the same _C calls (fastweight.ops: _route_all) --------
class _DeltaRuleFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, beta, h0, cu_seqlens, scale, l2, output_final_state, split):
        # this path runs only where a gradient is wanted: the WY inverse is kept for the backward
        o, ht, wy = _deltanet_fwd_run(q, k, v, beta, h0, cu_seqlens, scale, l2, output_final_state, split, True)
        ctx.save_for_backward(q, k, v, beta, h0, cu_seqlens, wy)
        ctx.scale, ctx.l2, ctx.output_final_state, ctx.split = scale, l2, output_final_state, split
        return o, ht

    @staticmethod
    @_fast_once_differentiable
    def backward(ctx, do, dht):
        q, k, v, beta, h0, cu_seqlens, wy = ctx.saved_tensors
        dht = _last_contig(dht) if ctx.output_final_state else None
        dq, dk, dv, dbeta, dh0 = _deltanet_bwd_run(_last_contig(do), q, k, v, beta, h0, cu_seqlens, dht, ctx.scale,
                                                   ctx.l2, ctx.split, wy)
        return dq, dk, dv, dbeta, dh0, None, None, None, None, None


_delta_rule_apply = _apply(_DeltaRuleFn)


# ---- functional API ---------------------------------------------------------------------------------
# The last offsets tensors found valid: (weak reference, version counter, T). A model's layers pass one
# cu_seqlens tensor to every delta_rule call of a step, and a training loop reuses it for the backward:
# checked once, not once per call (each check is a host synchronisation, after which the GPU idles
# while the host enqueues the next kernels). The version counter moves with every in-place write to
# the tensor or a view of it, so a changed tensor is checked again; writes that bypass the counter
# (through .data, DLPack or a raw pointer) are not seen: the kernels then clamp the offsets (memory
# stays safe, results do not). (FLA caches its varlen chunk indices by the tensor the same way,
# tensor_cache, without even the version check.)
_VALID_OFFSETS: list = []
_VALID_OFFSETS_KEEP = 8


def _offsets_known_valid(cu_seqlens: Tensor, T: int) -> bool:
    for ref, version, t in _VALID_OFFSETS:
        if ref() is cu_seqlens and version == cu_seqlens._version and t == T:
            return True
    return False


def _remember_valid_offsets(cu_seqlens: Tensor, T: int) -> None:
    if cu_seqlens.is_inference():  # no version counter: checked every time
        return
    _VALID_OFFSETS[:] = [e for e in _VALID_OFFSETS if e[0]() is not None and e[0]() is not cu_seqlens]
    _VALID_OFFSETS.append((weakref.ref(cu_seqlens), cu_seqlens._version, T))
    del _VALID_OFFSETS[:-_VALID_OFFSETS_KEEP]


def _check_device_offsets(cu_seqlens: Optional[Tensor], q: Tensor) -> None:
    """CUDA offsets are checked here, on the host, in eager mode: one synchronisation the first time a
    tensor is seen (and again after any in-place change to it; see _VALID_OFFSETS). The kernels cannot
    raise, so they only clamp offsets (memory stays safe, results do not); the C++ layer checks CPU
    offsets itself. Skipped while a CUDA graph is captured or torch.compile traces: there the offsets
    are trusted. Malformed tensors (dtype, shape, batch) are left to the C++ checks, which name them."""
    # fewer than 2 offsets (no sequence): the library refuses that by shape alone, with its own message
    if cu_seqlens is None or not cu_seqlens.is_cuda or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        return
    if cu_seqlens.dtype not in (torch.int32, torch.int64) or q.dim() != 4 or q.shape[0] != 1:
        return
    if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
        return
    T = q.shape[1]
    if _offsets_known_valid(cu_seqlens, T):
        return
    c = cu_seqlens.to(torch.int64)
    N = c.numel() - 1
    bad = (c[0] != 0) | (c[-1] != T)
    if N > 0:
        bad = bad | (c[1:] < c[:-1]).any()
    if not bool(bad):
        _remember_valid_offsets(cu_seqlens, T)
        return
    off = c.tolist()
    where = "fastweight.delta_rule: cu_seqlens: "
    if off[0] != 0:
        raise ValueError(where + f"expected offsets starting at 0, got cu_seqlens[0] = {off[0]}")
    for n in range(N):
        if off[n + 1] < off[n]:
            raise ValueError(where + f"expected non-decreasing offsets, got cu_seqlens[{n + 1}] = {off[n + 1]} "
                             f"< cu_seqlens[{n}] = {off[n]}")
    raise ValueError(where + f"expected the last offset cu_seqlens[{N}] to be T = {T} (the packed length of q), "
                     f"got {off[N]}")


def delta_rule(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, scale: Optional[float] = None,
               initial_state: Optional[Tensor] = None, output_final_state: bool = False,
               use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Optional[Tensor] = None,
               split_operands: bool = True):
    """The delta rule over a sequence (FLA layout): returns ``(o, final_state)``, o (B, T, H, V) in q's
    dtype, final_state (N, H, K, V) float32 (float64 for float64 q) when ``output_final_state``, else
    None. See the module docstring for the arguments."""
    if cu_seqlens is not None and not isinstance(cu_seqlens, Tensor):  # as FLA: offsets are a tensor
        raise TypeError("fastweight.delta_rule: cu_seqlens must be a torch.Tensor of N+1 int32/int64 offsets "
                        f"on q's device (FLA's convention), got {type(cu_seqlens).__name__}")
    _check_device_offsets(cu_seqlens, q)
    h0 = initial_state
    if h0 is not None:
        h0 = _last_contig(h0 if h0.dtype == _state_dtype(q) else h0.to(_state_dtype(q)))
    q, k, v, beta = _last_contig(q), _last_contig(k), _last_contig(v), _prep_gate(beta, q)
    cu_seqlens = _last_contig(cu_seqlens)
    args = (q, k, v, beta, h0, cu_seqlens, None if scale is None else float(scale), bool(use_qk_l2norm_in_kernel),
            bool(output_final_state), bool(split_operands))
    route = _route_all((q, k, v, beta, h0, cu_seqlens))
    if route == _AUTOGRAD:
        o, ht = _delta_rule_apply(*args)
    elif route == _NO_GRAD:
        o, ht, _ = _deltanet_fwd_run(*args)
    else:  # the custom op keeps the WY inverse only where a gradient will be taken
        save_wy = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, beta, h0))
        o, ht, _ = (_FuncDeltanet.apply if _under_func() else _deltanet_fwd)(*args, save_wy)
    return o, (ht if output_final_state else None)


# ---- decoding step -------------------------------------------------------------------------------------
@torch.library.custom_op("fastweight::deltanet_step", mutates_args=())
def _deltanet_step(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, state: Tensor, scale: Optional[float],
                   use_qk_l2norm_in_kernel: bool) -> tuple[Tensor, Tensor]:
    return _deltanet_step_run(q, k, v, beta, state, scale, use_qk_l2norm_in_kernel)


def _deltanet_step_run(q, k, v, beta, state, scale, use_qk_l2norm_in_kernel):
    """The step's _C call (a new state), shared by the custom op and the eager path."""
    o = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    new = torch.empty_like(state)
    _C.deltanet_step(_spec(q), _spec(k), _spec(v), _spec(beta), _spec(state), _spec(o), _spec(new), scale,
                     use_qk_l2norm_in_kernel, _stream(q))
    return o, new


def _deltanet_step_inplace_run(q, k, v, beta, state, scale, use_qk_l2norm_in_kernel):
    """The in-place step's _C call (state updated), shared likewise."""
    o = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    ss = _spec(state)
    _C.deltanet_step(_spec(q), _spec(k), _spec(v), _spec(beta), ss, _spec(o), ss, scale, use_qk_l2norm_in_kernel,
                     _stream(q))
    return o


@_deltanet_step.register_fake
def _(q, k, v, beta, state, scale, use_qk_l2norm_in_kernel):
    return q.new_empty(v.shape), torch.empty_like(state)


@torch.library.custom_op("fastweight::deltanet_step_", mutates_args=("state",))
def _deltanet_step_(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, state: Tensor, scale: Optional[float],
                    use_qk_l2norm_in_kernel: bool) -> Tensor:
    return _deltanet_step_inplace_run(q, k, v, beta, state, scale, use_qk_l2norm_in_kernel)


@_deltanet_step_.register_fake
def _(q, k, v, beta, state, scale, use_qk_l2norm_in_kernel):
    return q.new_empty(v.shape)


def delta_rule_step(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, state: Tensor, scale: Optional[float] = None,
                    use_qk_l2norm_in_kernel: bool = False, inplace: bool = False):
    """One decoding step of the delta rule: q, k (B, H, K), v (B, H, V), beta (B, H), state (B, H, K, V)
    (float32). Returns ``(o, new_state)``, o (B, H, V); ``inplace=True`` updates ``state`` itself (it must
    then be float32 with a contiguous last dimension) and returns it as new_state. No autograd (decoding)."""
    q, k, v = _last_contig(q), _last_contig(k), _last_contig(v)
    beta = _prep_gate(beta, q)
    sc = None if scale is None else float(scale)
    eager = _route_all((q, k, v, beta, state)) != _CUSTOM_OP  # plain eager: the _C call directly (host time)
    if inplace:
        step_ = _deltanet_step_inplace_run if eager else _deltanet_step_
        return step_(q, k, v, beta, state, sc, bool(use_qk_l2norm_in_kernel)), state
    st = _last_contig(state if state.dtype == _state_dtype(q) else state.to(_state_dtype(q)))
    return (_deltanet_step_run if eager else _deltanet_step)(q, k, v, beta, st, sc, bool(use_qk_l2norm_in_kernel))

