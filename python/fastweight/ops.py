"""PyTorch ops of the LayerNorm family: ``torch.ops.fastweight.*`` plus the functional API.

Low-level ops (``torch.library.custom_op``, namespace ``fastweight``), one name everywhere:

    layernorm_fwd(Tensor x, Tensor? weight, Tensor? bias, float eps, float weight_offset)
        -> (Tensor y, Tensor mean, Tensor rstd)
    layernorm_bwd(Tensor dy, Tensor x, Tensor? weight, Tensor mean, Tensor rstd,
                  float weight_offset, bool has_bias) -> (Tensor dx, Tensor dweight, Tensor dbias)
    headnorm_fwd / headnorm_bwd          as layernorm, x (..., NH, DH), weight/bias (NH, DH)
    rmsnorm_fwd(x, weight?, eps, weight_offset) -> (y, rstd)
    rmsnorm_bwd(dy, x, weight?, rstd, weight_offset) -> (dx, dweight)
    adalayernorm_fwd(x, scale, shift?, eps) -> (y, mean, rstd)         x (B, S, D), scale/shift (B, 1, D)
    adalayernorm_bwd(dy, x, scale, mean, rstd, has_shift) -> (dx, dscale, dshift)

``y`` has x's shape and dtype and is contiguous; the statistics are float32 of shape
``x.shape[:-1]`` (as cuDNN's training forward). A backward op returns an empty tensor
(``numel() == 0``) for a gradient that is not computed (custom ops cannot return None): dweight
without weight, dbias unless has_bias. Gradient dtypes: dweight that of weight; dbias that of
weight, else float32 (the autograd formula casts it to the bias's dtype).

Each op has a fake kernel (``torch.compile(fullgraph=True)``, CUDA graphs) and the forward ops a
backward formula (``torch.library.register_autograd``); mean/rstd are not differentiable outputs.
Tensors are passed to ``fastweight._C`` without copies as tensor specs ``(data_ptr, dtype_code,
shape, strides, device_type, device_index)`` (see ``_spec``: far cheaper than DLPack); strided inputs
work as long as the last dimension is contiguous (the raw ops raise a ValueError otherwise, the
functional API below copies). CUDA tensors run on torch's current stream of their device, the
workspace of the backward comes from torch's caching allocator, so the ops are CUDA-graph capturable.

Functional API (differentiable, used by ``fastweight.layer_norm`` & co and ``fastweight.nn``):
``layer_norm``, ``rms_norm``, ``head_norm``, ``adaptive_layer_norm``. In eager mode with plain
tensors they skip the dispatcher: a ``torch.autograd.Function`` (or, when no gradient is needed, a
direct call) runs the same ``_C`` kernels as the custom ops, so the results are the same bits at a
fraction of the host time. Under ``torch.compile`` / export / tracing, with tensor subclasses
(FakeTensor ...), dispatch modes or functorch transforms they call the custom ops. Python wrappers
of the raw ops that return the statistics (always through the custom ops):
``layernorm_fwd(x, weight, bias, eps, weight_offset)`` etc.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import _C

__all__ = [
    "layer_norm", "rms_norm", "head_norm", "adaptive_layer_norm",
    "layernorm_fwd", "layernorm_bwd", "rmsnorm_fwd", "rmsnorm_bwd",
    "headnorm_fwd", "headnorm_bwd", "adalayernorm_fwd", "adalayernorm_bwd",
]


# ---- helpers ------------------------------------------------------------------------------------
# fastweight::DType; the integers serve index tensors (cu_seqlens), every float op rejects them.
_DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3, torch.int32: 4, torch.int64: 5}


def _spec(t: Optional[Tensor]):
    """``t`` as the binding's tensor spec ``(data_ptr, dtype_code, shape, strides, device_type,
    device_index)``: ~0.3 us where ``t.__dlpack__()`` alone costs several (bindings/module.cpp).
    A dtype or device that the spec cannot express goes through DLPack, whose error names it. The
    spec holds no reference: the caller keeps ``t`` alive (a local variable) during the call."""
    if t is None:
        return None
    code = _DTYPE_CODE.get(t.dtype)
    if code is not None:
        if t.is_cuda:
            return (t.data_ptr(), code, t.shape, t.stride(), 1, t.get_device())
        if t.is_cpu:
            return (t.data_ptr(), code, t.shape, t.stride(), 0, 0)
    return t.detach()  # DLPack refuses tensors that require grad


def _new_like(t: Optional[Tensor], spec):
    """``(out, spec of out)``: a new contiguous tensor with t's shape, dtype and device. When t is
    contiguous, out has t's strides, so its spec is t's ``spec`` with out's pointer (cheaper)."""
    if t is None:
        return None, None
    if type(spec) is tuple and t.is_contiguous():
        out = torch.empty_like(t)  # same strides as t
        return out, (out.data_ptr(), spec[1], spec[2], spec[3], spec[4], spec[5])
    out = torch.empty_like(t, memory_format=torch.contiguous_format)
    return out, _spec(out)


# (x.new_empty(..., dtype=) allocates on x's device at half the host time of torch.empty(..., device=).)
def _stats(x: Tensor) -> Tensor:
    return x.new_empty(x.shape[:-1], dtype=torch.float32)


def _stats_buffer(x: Tensor, n: int) -> Tensor:
    """n float32 statistics per row of x in one buffer (the eager path: one allocation)."""
    last = x.shape[-1] if x.dim() else 0
    return x.new_empty(n * (x.numel() // last) if last else 0, dtype=torch.float32)  # else _C raises on x


def _stats_specs(buf: Tensor):
    """Specs of the halves (mean, rstd) of a _stats_buffer(x, 2); the binding checks only their
    element count and contiguity. (Cheaper than _spec: buf is known to be float32 and 1-d.)"""
    rows = buf.numel() // 2
    if buf.is_cuda:
        dev, index = 1, buf.get_device()
    elif buf.is_cpu:
        dev, index = 0, 0
    else:
        return buf[:rows], buf[rows:]
    p = buf.data_ptr()
    return (p, 0, (rows,), (1,), dev, index), (p + 4 * rows, 0, (rows,), (1,), dev, index)


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream(x: Tensor) -> int:
    """torch's current stream of x's device (0 on the CPU)."""
    if not x.is_cuda:
        return 0
    if _raw_stream is not None:
        return _raw_stream(x.get_device())
    return torch.cuda.current_stream(x.device).cuda_stream


def _nothing(x: Tensor) -> Tensor:
    return x.new_empty(0)


def _bias_grad_dtype(weight: Optional[Tensor]) -> torch.dtype:
    return weight.dtype if weight is not None else torch.float32


def _last_contig(t: Optional[Tensor]) -> Optional[Tensor]:
    """``t`` with a contiguous last dimension (copies only when it is not)."""
    if t is None or t.is_contiguous() or t.dim() == 0 or t.size(-1) <= 1 or t.stride(-1) == 1:
        return t
    return t.contiguous()


def _prep_gate(g: Tensor, q: Tensor) -> Tensor:
    """Gates (mLSTM's i, f; DeltaNet's beta) in q's dtype or float32 (other dtypes are cast to
    float32), last dim contiguous."""
    return _last_contig(g if g.dtype in (q.dtype, torch.float32) else g.to(torch.float32))


def _cast(t: Optional[Tensor], dtype: Optional[torch.dtype]) -> Optional[Tensor]:
    return t if t is None or t.dtype == dtype else t.to(dtype)


# ---- the _C calls, shared by the custom ops and the eager path --------------------------------
# mean/rstd are specs (None: not computed). Each function allocates and returns the outputs; a
# gradient that is not computed is None.
def _ln_fwd(fwd, x, weight, bias, mean, rstd, eps, weight_offset) -> Tensor:
    """layernorm / headnorm forward (``fwd``: their _C function): y."""
    xs = _spec(x)
    y, ys = _new_like(x, xs)
    fwd(xs, _spec(weight), _spec(bias), ys, mean, rstd, eps, weight_offset, _stream(x))
    return y


def _ln_bwd(bwd, bwd_size, pdims, dy, x, weight, mean, rstd, weight_offset, has_bias):
    """layernorm / headnorm backward (pdims: parameter dims, 1 / 2): dx, dweight, dbias.
    dbias has the parameter shape and the dtype of weight (float32 without weight)."""
    xs, ws = _spec(x), _spec(weight)
    dx, dxs = _new_like(x, xs)
    dweight, dws = _new_like(weight, ws)
    dbias, dbs = None, None
    if has_bias and weight is not None:
        dbias, dbs = _new_like(weight, ws)
    elif has_bias:
        dbias = x.new_empty(x.shape[-pdims:], dtype=torch.float32)
        dbs = _spec(dbias)
    _run_bwd(bwd_size, bwd, x, (_spec(dy), xs, ws, mean, rstd, dxs, dws, dbs, weight_offset))
    return dx, dweight, dbias


def _rms_fwd(x, weight, rstd, eps, weight_offset) -> Tensor:
    xs = _spec(x)
    y, ys = _new_like(x, xs)
    _C.rmsnorm_fwd(xs, _spec(weight), ys, rstd, eps, weight_offset, _stream(x))
    return y


def _rms_bwd(dy, x, weight, rstd, weight_offset):
    xs, ws = _spec(x), _spec(weight)
    dx, dxs = _new_like(x, xs)
    dweight, dws = _new_like(weight, ws)
    _run_bwd(_C.rmsnorm_bwd_workspace_size, _C.rmsnorm_bwd, x,
             (_spec(dy), xs, ws, rstd, dxs, dws, weight_offset))
    return dx, dweight


def _ada_fwd(x, scale, shift, mean, rstd, eps) -> Tensor:
    xs = _spec(x)
    y, ys = _new_like(x, xs)
    _C.adalayernorm_fwd(xs, _spec(scale), _spec(shift), ys, mean, rstd, eps, _stream(x))
    return y


def _ada_bwd(dy, x, scale, mean, rstd, has_shift):
    xs, ss = _spec(x), _spec(scale)
    dx, dxs = _new_like(x, xs)
    dscale, dss = _new_like(scale, ss)
    dshift, dhs = _new_like(scale, ss) if has_shift else (None, None)
    _run_bwd(_C.adalayernorm_bwd_workspace_size, _C.adalayernorm_bwd, x,
             (_spec(dy), xs, ss, mean, rstd, dxs, dss, dhs))
    return dx, dscale, dshift


def _run_bwd(size_fn, bwd_fn, x: Tensor, args: tuple) -> None:
    """A backward of ``_C``: ``args`` are its arguments up to the workspace, which comes from torch's
    caching allocator (CUDA-graph safe) and is passed as ``(data_ptr, nbytes)``."""
    nbytes = size_fn(*args)
    ws = x.new_empty(nbytes, dtype=torch.uint8) if nbytes > 0 else None
    bwd_fn(*args, (ws.data_ptr(), nbytes) if ws is not None else None, _stream(x))


def _or_nothing(t: Optional[Tensor], x: Tensor) -> Tensor:
    return t if t is not None else _nothing(x)


# ---- layernorm ----------------------------------------------------------------------------------
@torch.library.custom_op("fastweight::layernorm_fwd", mutates_args=())
def _layernorm_fwd(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                   weight_offset: float) -> tuple[Tensor, Tensor, Tensor]:
    mean, rstd = _stats(x), _stats(x)
    y = _ln_fwd(_C.layernorm_fwd, x, weight, bias, _spec(mean), _spec(rstd), eps, weight_offset)
    return y, mean, rstd


@_layernorm_fwd.register_fake
def _(x, weight, bias, eps, weight_offset):
    return x.new_empty(x.shape), _stats(x), _stats(x)


@torch.library.custom_op("fastweight::layernorm_bwd", mutates_args=())
def _layernorm_bwd(dy: Tensor, x: Tensor, weight: Optional[Tensor], mean: Tensor, rstd: Tensor,
                   weight_offset: float, has_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    dx, dweight, dbias = _ln_bwd(_C.layernorm_bwd, _C.layernorm_bwd_workspace_size, 1, dy, x, weight,
                                 _spec(mean), _spec(rstd), weight_offset, has_bias)
    return dx, _or_nothing(dweight, x), _or_nothing(dbias, x)


@_layernorm_bwd.register_fake
def _(dy, x, weight, mean, rstd, weight_offset, has_bias):
    dx = x.new_empty(x.shape)
    dweight = weight.new_empty(weight.shape) if weight is not None else _nothing(x)
    dbias = x.new_empty(x.shape[-1:], dtype=_bias_grad_dtype(weight)) if has_bias else _nothing(x)
    return dx, dweight, dbias


def _ln_setup(ctx, inputs, output):
    x, weight, bias, _eps, weight_offset = inputs
    _y, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.weight_offset = weight_offset
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _make_ln_backward(bwd_op):
    def backward(ctx, dy, _dmean, _drstd):
        x, weight, mean, rstd = ctx.saved_tensors
        has_bias = ctx.bias_dtype is not None
        dx, dweight, dbias = bwd_op(_last_contig(dy), x, weight, mean, rstd, ctx.weight_offset, has_bias)
        return (dx,
                dweight if weight is not None else None,
                _cast(dbias, ctx.bias_dtype) if has_bias else None,
                None, None)
    return backward


_layernorm_fwd.register_autograd(_make_ln_backward(_layernorm_bwd), setup_context=_ln_setup)


# ---- headnorm -----------------------------------------------------------------------------------
@torch.library.custom_op("fastweight::headnorm_fwd", mutates_args=())
def _headnorm_fwd(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                  weight_offset: float) -> tuple[Tensor, Tensor, Tensor]:
    mean, rstd = _stats(x), _stats(x)
    y = _ln_fwd(_C.headnorm_fwd, x, weight, bias, _spec(mean), _spec(rstd), eps, weight_offset)
    return y, mean, rstd


@_headnorm_fwd.register_fake
def _(x, weight, bias, eps, weight_offset):
    return x.new_empty(x.shape), _stats(x), _stats(x)


@torch.library.custom_op("fastweight::headnorm_bwd", mutates_args=())
def _headnorm_bwd(dy: Tensor, x: Tensor, weight: Optional[Tensor], mean: Tensor, rstd: Tensor,
                  weight_offset: float, has_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    dx, dweight, dbias = _ln_bwd(_C.headnorm_bwd, _C.headnorm_bwd_workspace_size, 2, dy, x, weight,
                                 _spec(mean), _spec(rstd), weight_offset, has_bias)
    return dx, _or_nothing(dweight, x), _or_nothing(dbias, x)


@_headnorm_bwd.register_fake
def _(dy, x, weight, mean, rstd, weight_offset, has_bias):
    dx = x.new_empty(x.shape)
    dweight = weight.new_empty(weight.shape) if weight is not None else _nothing(x)
    dbias = x.new_empty(x.shape[-2:], dtype=_bias_grad_dtype(weight)) if has_bias else _nothing(x)
    return dx, dweight, dbias


_headnorm_fwd.register_autograd(_make_ln_backward(_headnorm_bwd), setup_context=_ln_setup)


# ---- rmsnorm ------------------------------------------------------------------------------------
@torch.library.custom_op("fastweight::rmsnorm_fwd", mutates_args=())
def _rmsnorm_fwd(x: Tensor, weight: Optional[Tensor], eps: float,
                 weight_offset: float) -> tuple[Tensor, Tensor]:
    rstd = _stats(x)
    return _rms_fwd(x, weight, _spec(rstd), eps, weight_offset), rstd


@_rmsnorm_fwd.register_fake
def _(x, weight, eps, weight_offset):
    return x.new_empty(x.shape), _stats(x)


@torch.library.custom_op("fastweight::rmsnorm_bwd", mutates_args=())
def _rmsnorm_bwd(dy: Tensor, x: Tensor, weight: Optional[Tensor], rstd: Tensor,
                 weight_offset: float) -> tuple[Tensor, Tensor]:
    dx, dweight = _rms_bwd(dy, x, weight, _spec(rstd), weight_offset)
    return dx, _or_nothing(dweight, x)


@_rmsnorm_bwd.register_fake
def _(dy, x, weight, rstd, weight_offset):
    return x.new_empty(x.shape), (weight.new_empty(weight.shape) if weight is not None else _nothing(x))


def _rms_setup(ctx, inputs, output):
    x, weight, _eps, weight_offset = inputs
    _y, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(x, weight, rstd)
    ctx.weight_offset = weight_offset


def _rms_backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dweight = _rmsnorm_bwd(_last_contig(dy), x, weight, rstd, ctx.weight_offset)
    return dx, (dweight if weight is not None else None), None, None


_rmsnorm_fwd.register_autograd(_rms_backward, setup_context=_rms_setup)


# ---- adalayernorm -------------------------------------------------------------------------------
@torch.library.custom_op("fastweight::adalayernorm_fwd", mutates_args=())
def _adalayernorm_fwd(x: Tensor, scale: Tensor, shift: Optional[Tensor],
                      eps: float) -> tuple[Tensor, Tensor, Tensor]:
    mean, rstd = _stats(x), _stats(x)
    return _ada_fwd(x, scale, shift, _spec(mean), _spec(rstd), eps), mean, rstd


@_adalayernorm_fwd.register_fake
def _(x, scale, shift, eps):
    return x.new_empty(x.shape), _stats(x), _stats(x)


@torch.library.custom_op("fastweight::adalayernorm_bwd", mutates_args=())
def _adalayernorm_bwd(dy: Tensor, x: Tensor, scale: Tensor, mean: Tensor, rstd: Tensor,
                      has_shift: bool) -> tuple[Tensor, Tensor, Tensor]:
    dx, dscale, dshift = _ada_bwd(dy, x, scale, _spec(mean), _spec(rstd), has_shift)
    return dx, dscale, _or_nothing(dshift, x)


@_adalayernorm_bwd.register_fake
def _(dy, x, scale, mean, rstd, has_shift):
    return (x.new_empty(x.shape), scale.new_empty(scale.shape),
            scale.new_empty(scale.shape) if has_shift else _nothing(x))


def _ada_setup(ctx, inputs, output):
    x, scale, shift, _eps = inputs
    _y, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, scale, mean, rstd)
    ctx.shift_dtype = shift.dtype if shift is not None else None


def _ada_backward(ctx, dy, _dmean, _drstd):
    x, scale, mean, rstd = ctx.saved_tensors
    has_shift = ctx.shift_dtype is not None
    dx, dscale, dshift = _adalayernorm_bwd(_last_contig(dy), x, scale, mean, rstd, has_shift)
    return dx, dscale, (_cast(dshift, ctx.shift_dtype) if has_shift else None), None


_adalayernorm_fwd.register_autograd(_ada_backward, setup_context=_ada_setup)


# ---- vmap (torch.func) --------------------------------------------------------------------------
def _register_vmap(op, rows_only: bool) -> None:
    """A batching rule for a custom op (the norms here; mlstm_ops, deltanet_ops). rows_only (the forwards of
    LayerNorm, RMSNorm, head norm): where
    only x is batched, the batch is one more leading dim of rows, so one call does it; otherwise (batched
    parameters, adaLN's per-sample scale, the backwards, whose parameter gradients are per sample) one
    call per sample, stacked. Without a rule torch falls back to the same loop, with a warning."""
    def rule(info, in_dims, *args):
        # (a batch dim that was the innermost leaves rows at a stride: contiguous copies then, as the
        # functional API makes of such views)
        batched = [i for i, d in enumerate(in_dims) if d is not None]
        if rows_only and batched == [0]:
            out = op(_last_contig(args[0].movedim(in_dims[0], 0)), *args[1:])
            return out, tuple(0 for _ in out)
        outs = [op(*(_last_contig(a.select(d, b)) if d is not None else a for a, d in zip(args, in_dims)))
                for b in range(info.batch_size)]
        return tuple(torch.stack([o[k] for o in outs]) for k in range(len(outs[0]))), tuple(0 for _ in outs[0])
    op.register_vmap(rule)


for _op, _rows_only in ((_layernorm_fwd, True), (_headnorm_fwd, True), (_rmsnorm_fwd, True),
                        (_adalayernorm_fwd, False), (_layernorm_bwd, False), (_headnorm_bwd, False),
                        (_rmsnorm_bwd, False), (_adalayernorm_bwd, False)):
    _register_vmap(_op, _rows_only)


# ---- Python wrappers of the raw ops (they return the statistics, as cuDNN's API does) -----------
def layernorm_fwd(x: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
                  eps: float = 1e-5, weight_offset: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, mean, rstd)`` of LayerNorm over the last dim; differentiable in x, weight, bias."""
    return torch.ops.fastweight.layernorm_fwd(x, weight, bias, float(eps), float(weight_offset))


def layernorm_bwd(dy: Tensor, x: Tensor, weight: Optional[Tensor], mean: Tensor, rstd: Tensor,
                  weight_offset: float = 0.0, has_bias: bool = False):
    """``(dx, dweight, dbias)``; dweight is None without weight, dbias None unless has_bias."""
    dx, dw, db = torch.ops.fastweight.layernorm_bwd(dy, x, weight, mean, rstd, float(weight_offset),
                                                    bool(has_bias))
    return dx, (dw if weight is not None else None), (db if has_bias else None)


def headnorm_fwd(x: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
                 eps: float = 1e-6, weight_offset: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, mean, rstd)`` of the per-head LayerNorm of x (..., NH, DH), weight/bias (NH, DH)."""
    return torch.ops.fastweight.headnorm_fwd(x, weight, bias, float(eps), float(weight_offset))


def headnorm_bwd(dy: Tensor, x: Tensor, weight: Optional[Tensor], mean: Tensor, rstd: Tensor,
                 weight_offset: float = 0.0, has_bias: bool = False):
    """``(dx, dweight, dbias)`` of headnorm; None for the gradients not computed."""
    dx, dw, db = torch.ops.fastweight.headnorm_bwd(dy, x, weight, mean, rstd, float(weight_offset),
                                                   bool(has_bias))
    return dx, (dw if weight is not None else None), (db if has_bias else None)


def rmsnorm_fwd(x: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-6,
                weight_offset: float = 0.0) -> tuple[Tensor, Tensor]:
    """``(y, rstd)`` of RMSNorm over the last dim; differentiable in x and weight."""
    return torch.ops.fastweight.rmsnorm_fwd(x, weight, float(eps), float(weight_offset))


def rmsnorm_bwd(dy: Tensor, x: Tensor, weight: Optional[Tensor], rstd: Tensor,
                weight_offset: float = 0.0):
    """``(dx, dweight)``; dweight is None without weight."""
    dx, dw = torch.ops.fastweight.rmsnorm_bwd(dy, x, weight, rstd, float(weight_offset))
    return dx, (dw if weight is not None else None)


def adalayernorm_fwd(x: Tensor, scale: Tensor, shift: Optional[Tensor] = None,
                     eps: float = 1e-5) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, mean, rstd)`` of adaptive LayerNorm, x (B, S, D), scale/shift (B, 1, D)."""
    return torch.ops.fastweight.adalayernorm_fwd(x, scale, shift, float(eps))


def adalayernorm_bwd(dy: Tensor, x: Tensor, scale: Tensor, mean: Tensor, rstd: Tensor,
                     has_shift: bool = True):
    """``(dx, dscale, dshift)``; dshift is None unless has_shift."""
    dx, ds, dh = torch.ops.fastweight.adalayernorm_bwd(dy, x, scale, mean, rstd, bool(has_shift))
    return dx, ds, (dh if has_shift else None)


# ---- eager path of the functional API: torch.autograd.Function over _C, no dispatcher ----------
# The same _C calls (_ln_fwd & co above) as the custom ops, so the same bits, minus torch.library's
# dispatch, which costs far more host time than the kernels of small shapes. Both statistics share
# one buffer (one allocation). Host-time critical: measure before adding to it.
_PLAIN = frozenset((Tensor, torch.nn.Parameter))
_len_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 0)
_functorch_level = torch._C._functorch.peek_interpreter_stack
_jit_tracing = torch._C._get_tracing_state
_is_compiling = torch.compiler.is_compiling
_CUSTOM_OP, _NO_GRAD, _AUTOGRAD = 0, 1, 2


def _traced() -> bool:
    """Compiling, exporting or tracing, a dispatch mode (FakeTensorMode ...) or a functorch transform:
    the custom ops, never the eager path."""
    return _is_compiling() or _len_dispatch_modes() or _functorch_level() is not None or _jit_tracing() is not None


def _route(x: Tensor, p: Optional[Tensor], q: Optional[Tensor] = None) -> int:
    """How the functional API runs on x and parameters p, q: _CUSTOM_OP unless in plain eager mode
    (not compiling, exporting or tracing; no dispatch mode such as FakeTensorMode; no functorch
    transform) with plain tensors (no subclass: FakeTensor, DTensor ...); else _AUTOGRAD when a
    gradient is needed, _NO_GRAD if not. (Unrolled: this runs on every call.)"""
    if _traced():
        return _CUSTOM_OP
    if (type(x) not in _PLAIN or (p is not None and type(p) not in _PLAIN)
            or (q is not None and type(q) not in _PLAIN)):
        return _CUSTOM_OP
    if torch.is_grad_enabled() and (x.requires_grad or (p is not None and p.requires_grad)
                                    or (q is not None and q.requires_grad)):
        return _AUTOGRAD
    return _NO_GRAD


def _route_all(ts) -> int:
    """_route for ops of many tensors (None entries skipped): the same rules."""
    if _traced():
        return _CUSTOM_OP
    grad = False
    for t in ts:
        if t is None:
            continue
        if type(t) not in _PLAIN:
            return _CUSTOM_OP
        grad = grad or t.requires_grad
    return _AUTOGRAD if grad and torch.is_grad_enabled() else _NO_GRAD


def _apply(fn):
    # Function.apply's Python wrapper only adds the functorch support that _route excludes; the C++
    # apply underneath saves a few microseconds per call.
    return super(torch.autograd.Function, fn).apply


def _fast_once_differentiable(backward):
    """once_differentiable without its cost (a no_grad context) in the usual case, where the
    backward already runs without grad mode (no create_graph)."""
    slow = once_differentiable(backward)

    def wrapper(ctx, *grads):
        return slow(ctx, *grads) if torch.is_grad_enabled() else backward(ctx, *grads)
    return wrapper


class _LayerNormFn(torch.autograd.Function):
    """layernorm; forward(cls, x, weight, bias, eps, weight_offset) -> y, cls giving the _C functions
    (the subclass _HeadNormFn: headnorm)."""
    fwd, bwd, bwd_size, pdims = _C.layernorm_fwd, _C.layernorm_bwd, _C.layernorm_bwd_workspace_size, 1

    @staticmethod
    def forward(ctx, cls, x, weight, bias, eps, weight_offset):
        stats = _stats_buffer(x, 2)
        y = _ln_fwd(cls.fwd, x, weight, bias, *_stats_specs(stats), eps, weight_offset)
        ctx.save_for_backward(x, weight, stats)
        ctx.cls, ctx.weight_offset = cls, weight_offset
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    @_fast_once_differentiable
    def backward(ctx, dy):
        x, weight, stats = ctx.saved_tensors
        cls, bias_dtype = ctx.cls, ctx.bias_dtype
        dx, dweight, dbias = _ln_bwd(cls.bwd, cls.bwd_size, cls.pdims, _last_contig(dy), x, weight,
                                     *_stats_specs(stats), ctx.weight_offset, bias_dtype is not None)
        return None, dx, dweight, _cast(dbias, bias_dtype), None, None


class _HeadNormFn(_LayerNormFn):
    fwd, bwd, bwd_size, pdims = _C.headnorm_fwd, _C.headnorm_bwd, _C.headnorm_bwd_workspace_size, 2


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, weight_offset):
        rstd = _stats_buffer(x, 1)
        y = _rms_fwd(x, weight, _spec(rstd), eps, weight_offset)
        ctx.save_for_backward(x, weight, rstd)
        ctx.weight_offset = weight_offset
        return y

    @staticmethod
    @_fast_once_differentiable
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dweight = _rms_bwd(_last_contig(dy), x, weight, _spec(rstd), ctx.weight_offset)
        return dx, dweight, None, None


class _AdaLayerNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, shift, eps):
        stats = _stats_buffer(x, 2)
        y = _ada_fwd(x, scale, shift, *_stats_specs(stats), eps)
        ctx.save_for_backward(x, scale, stats)
        ctx.shift_dtype = shift.dtype if shift is not None else None
        return y

    @staticmethod
    @_fast_once_differentiable
    def backward(ctx, dy):
        x, scale, stats = ctx.saved_tensors
        shift_dtype = ctx.shift_dtype
        dx, dscale, dshift = _ada_bwd(_last_contig(dy), x, scale, *_stats_specs(stats), shift_dtype is not None)
        return dx, dscale, _cast(dshift, shift_dtype), None


_ln_apply, _hn_apply = _apply(_LayerNormFn), _apply(_HeadNormFn)
_rms_apply, _ada_apply = _apply(_RMSNormFn), _apply(_AdaLayerNormFn)


# ---- under torch.func's transforms (grad, vjp, jacrev, vmap) -----------------------------------
# The autograd.Function that torch.library generates for a custom op has no setup_context, which those
# transforms require (pytorch/pytorch#168393, #179652: "must override the setup_context staticmethod").
# These carry the same custom ops, setup and backward with one of their own; vmap through the ops'
# batching rules (generate_vmap_rule).
def _func_fn(name, op, setup, backward):
    return type(name, (torch.autograd.Function,), {
        "generate_vmap_rule": True,
        "forward": staticmethod(lambda *args: op(*args)),
        "setup_context": staticmethod(setup),
        # no_grad inside (the custom bwd ops' generated Function is the one without setup_context);
        # differentiating the backward again raises instead of silently giving zeros
        "backward": staticmethod(once_differentiable(backward)),
    })


_FuncLN = _func_fn("_FuncLN", _layernorm_fwd, _ln_setup, _make_ln_backward(_layernorm_bwd))
_FuncHN = _func_fn("_FuncHN", _headnorm_fwd, _ln_setup, _make_ln_backward(_headnorm_bwd))
_FuncRMS = _func_fn("_FuncRMS", _rmsnorm_fwd, _rms_setup, _rms_backward)
_FuncAda = _func_fn("_FuncAda", _adalayernorm_fwd, _ada_setup, _ada_backward)


def _under_func() -> bool:
    """A torch.func transform, outside compilation (dynamo handles the transforms itself)."""
    return _functorch_level() is not None and not _is_compiling()


# ---- functional API -----------------------------------------------------------------------------
# Without a gradient to compute, the eager path skips the statistics (the kernels write y the same).
def layer_norm(x: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
               eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last dimension (``torch.nn.functional.layer_norm(x, (N,), w, b, eps)``)."""
    x, weight, bias = _last_contig(x), _last_contig(weight), _last_contig(bias)
    route = _route(x, weight, bias)
    if route == _AUTOGRAD:
        return _ln_apply(_LayerNormFn, x, weight, bias, float(eps), 0.0)
    if route == _NO_GRAD:
        return _ln_fwd(_C.layernorm_fwd, x, weight, bias, None, None, float(eps), 0.0)
    if _under_func():
        return _FuncLN.apply(x, weight, bias, float(eps), 0.0)[0]
    return torch.ops.fastweight.layernorm_fwd(x, weight, bias, float(eps), 0.0)[0]


def rms_norm(x: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-6) -> Tensor:
    """RMSNorm over the last dimension: ``x / sqrt(mean(x^2) + eps) * weight``."""
    x, weight = _last_contig(x), _last_contig(weight)
    route = _route(x, weight)
    if route == _AUTOGRAD:
        return _rms_apply(x, weight, float(eps), 0.0)
    if route == _NO_GRAD:
        return _rms_fwd(x, weight, None, float(eps), 0.0)
    if _under_func():
        return _FuncRMS.apply(x, weight, float(eps), 0.0)[0]
    return torch.ops.fastweight.rmsnorm_fwd(x, weight, float(eps), 0.0)[0]


def head_norm(x: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
              eps: float = 1e-6, weight_offset: float = 0.0) -> Tensor:
    """Per-head LayerNorm of x (..., NH, DH): ``xhat * (weight_offset + weight) + bias``, weight/bias (NH, DH)."""
    x, weight, bias = _last_contig(x), _last_contig(weight), _last_contig(bias)
    route = _route(x, weight, bias)
    if route == _AUTOGRAD:
        return _hn_apply(_HeadNormFn, x, weight, bias, float(eps), float(weight_offset))
    if route == _NO_GRAD:
        return _ln_fwd(_C.headnorm_fwd, x, weight, bias, None, None, float(eps), float(weight_offset))
    if _under_func():
        return _FuncHN.apply(x, weight, bias, float(eps), float(weight_offset))[0]
    return torch.ops.fastweight.headnorm_fwd(x, weight, bias, float(eps), float(weight_offset))[0]


def adaptive_layer_norm(x: Tensor, scale: Tensor, shift: Optional[Tensor], eps: float = 1e-5) -> Tensor:
    """Adaptive LayerNorm (adaLN): x (B, S, D), scale/shift (B, 1, D): ``xhat * scale[b] + shift[b]``."""
    x, scale, shift = _last_contig(x), _last_contig(scale), _last_contig(shift)
    route = _route(x, scale, shift)
    if route == _AUTOGRAD:
        return _ada_apply(x, scale, shift, float(eps))
    if route == _NO_GRAD:
        return _ada_fwd(x, scale, shift, None, None, float(eps))
    if _under_func():
        return _FuncAda.apply(x, scale, shift, float(eps))[0]
    return torch.ops.fastweight.adalayernorm_fwd(x, scale, shift, float(eps))[0]
