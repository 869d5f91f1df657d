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
Inputs are passed to ``fastweight._C`` through DLPack without copies; strided inputs work as long as
the last dimension is contiguous (the raw ops raise a ValueError otherwise, the functional API
below copies). CUDA tensors run on torch's current stream of their device, the workspace of the
backward comes from torch's caching allocator, so the ops are CUDA-graph capturable.

Functional API (differentiable, used by ``fastweight.layer_norm`` & co and ``fastweight.nn``):
``layer_norm``, ``rms_norm``, ``head_norm``, ``adaptive_layer_norm``. Python wrappers of the raw
ops that return the statistics: ``layernorm_fwd(x, weight, bias, eps, weight_offset)`` etc.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _C

__all__ = [
    "layer_norm", "rms_norm", "head_norm", "adaptive_layer_norm",
    "layernorm_fwd", "layernorm_bwd", "rmsnorm_fwd", "rmsnorm_bwd",
    "headnorm_fwd", "headnorm_bwd", "adalayernorm_fwd", "adalayernorm_bwd",
]


# ---- helpers ------------------------------------------------------------------------------------
def _d(t: Optional[Tensor]) -> Optional[Tensor]:
    # DLPack refuses tensors that require grad; the op itself is below autograd anyway.
    return None if t is None else t.detach()


def _stream(x: Tensor) -> int:
    return torch.cuda.current_stream(x.device).cuda_stream if x.device.type == "cuda" else 0


def _stats(x: Tensor) -> Tensor:
    return torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)


def _nothing(x: Tensor) -> Tensor:
    return x.new_empty(0)


def _workspace(nbytes: int, x: Tensor) -> Optional[Tensor]:
    return torch.empty(nbytes, dtype=torch.uint8, device=x.device) if nbytes > 0 else None


def _bias_grad_dtype(weight: Optional[Tensor]) -> torch.dtype:
    return weight.dtype if weight is not None else torch.float32


def _last_contig(t: Optional[Tensor]) -> Optional[Tensor]:
    """``t`` with a contiguous last dimension (copies only when it is not)."""
    if t is None or t.dim() == 0 or t.size(-1) <= 1 or t.stride(-1) == 1:
        return t
    return t.contiguous()


# ---- layernorm ----------------------------------------------------------------------------------
@torch.library.custom_op("fastweight::layernorm_fwd", mutates_args=())
def _layernorm_fwd(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                   weight_offset: float) -> tuple[Tensor, Tensor, Tensor]:
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    mean, rstd = _stats(x), _stats(x)
    _C.layernorm_fwd(_d(x), _d(weight), _d(bias), y, mean, rstd, eps, weight_offset, _stream(x))
    return y, mean, rstd


@_layernorm_fwd.register_fake
def _(x, weight, bias, eps, weight_offset):
    return x.new_empty(x.shape), _stats(x), _stats(x)


@torch.library.custom_op("fastweight::layernorm_bwd", mutates_args=())
def _layernorm_bwd(dy: Tensor, x: Tensor, weight: Optional[Tensor], mean: Tensor, rstd: Tensor,
                   weight_offset: float, has_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dweight = torch.empty_like(weight, memory_format=torch.contiguous_format) if weight is not None else None
    dbias = (torch.empty(x.shape[-1:], dtype=_bias_grad_dtype(weight), device=x.device)
             if has_bias else None)
    args = (_d(dy), _d(x), _d(weight), _d(mean), _d(rstd), dx, dweight, dbias, weight_offset)
    ws = _workspace(_C.layernorm_bwd_workspace_size(*args), x)
    _C.layernorm_bwd(*args, ws, _stream(x))
    return dx, (dweight if dweight is not None else _nothing(x)), (dbias if dbias is not None else _nothing(x))


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
                dbias.to(ctx.bias_dtype) if has_bias else None,
                None, None)
    return backward


_layernorm_fwd.register_autograd(_make_ln_backward(_layernorm_bwd), setup_context=_ln_setup)


# ---- headnorm -----------------------------------------------------------------------------------
@torch.library.custom_op("fastweight::headnorm_fwd", mutates_args=())
def _headnorm_fwd(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                  weight_offset: float) -> tuple[Tensor, Tensor, Tensor]:
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    mean, rstd = _stats(x), _stats(x)
    _C.headnorm_fwd(_d(x), _d(weight), _d(bias), y, mean, rstd, eps, weight_offset, _stream(x))
    return y, mean, rstd


@_headnorm_fwd.register_fake
def _(x, weight, bias, eps, weight_offset):
    return x.new_empty(x.shape), _stats(x), _stats(x)


@torch.library.custom_op("fastweight::headnorm_bwd", mutates_args=())
def _headnorm_bwd(dy: Tensor, x: Tensor, weight: Optional[Tensor], mean: Tensor, rstd: Tensor,
                  weight_offset: float, has_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dweight = torch.empty_like(weight, memory_format=torch.contiguous_format) if weight is not None else None
    dbias = (torch.empty(x.shape[-2:], dtype=_bias_grad_dtype(weight), device=x.device)
             if has_bias else None)
    args = (_d(dy), _d(x), _d(weight), _d(mean), _d(rstd), dx, dweight, dbias, weight_offset)
    ws = _workspace(_C.headnorm_bwd_workspace_size(*args), x)
    _C.headnorm_bwd(*args, ws, _stream(x))
    return dx, (dweight if dweight is not None else _nothing(x)), (dbias if dbias is not None else _nothing(x))


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
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = _stats(x)
    _C.rmsnorm_fwd(_d(x), _d(weight), y, rstd, eps, weight_offset, _stream(x))
    return y, rstd


@_rmsnorm_fwd.register_fake
def _(x, weight, eps, weight_offset):
    return x.new_empty(x.shape), _stats(x)


@torch.library.custom_op("fastweight::rmsnorm_bwd", mutates_args=())
def _rmsnorm_bwd(dy: Tensor, x: Tensor, weight: Optional[Tensor], rstd: Tensor,
                 weight_offset: float) -> tuple[Tensor, Tensor]:
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dweight = torch.empty_like(weight, memory_format=torch.contiguous_format) if weight is not None else None
    args = (_d(dy), _d(x), _d(weight), _d(rstd), dx, dweight, weight_offset)
    ws = _workspace(_C.rmsnorm_bwd_workspace_size(*args), x)
    _C.rmsnorm_bwd(*args, ws, _stream(x))
    return dx, (dweight if dweight is not None else _nothing(x))


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
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    mean, rstd = _stats(x), _stats(x)
    _C.adalayernorm_fwd(_d(x), _d(scale), _d(shift), y, mean, rstd, eps, _stream(x))
    return y, mean, rstd


@_adalayernorm_fwd.register_fake
def _(x, scale, shift, eps):
    return x.new_empty(x.shape), _stats(x), _stats(x)


@torch.library.custom_op("fastweight::adalayernorm_bwd", mutates_args=())
def _adalayernorm_bwd(dy: Tensor, x: Tensor, scale: Tensor, mean: Tensor, rstd: Tensor,
                      has_shift: bool) -> tuple[Tensor, Tensor, Tensor]:
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dscale = torch.empty_like(scale, memory_format=torch.contiguous_format)
    dshift = torch.empty_like(scale, memory_format=torch.contiguous_format) if has_shift else None
    args = (_d(dy), _d(x), _d(scale), _d(mean), _d(rstd), dx, dscale, dshift)
    ws = _workspace(_C.adalayernorm_bwd_workspace_size(*args), x)
    _C.adalayernorm_bwd(*args, ws, _stream(x))
    return dx, dscale, (dshift if dshift is not None else _nothing(x))


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
    return dx, dscale, (dshift.to(ctx.shift_dtype) if has_shift else None), None


_adalayernorm_fwd.register_autograd(_ada_backward, setup_context=_ada_setup)


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


# ---- functional API -----------------------------------------------------------------------------
def layer_norm(x: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
               eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last dimension (``torch.nn.functional.layer_norm(x, (N,), w, b, eps)``)."""
    return torch.ops.fastweight.layernorm_fwd(_last_contig(x), _last_contig(weight),
                                              _last_contig(bias), float(eps), 0.0)[0]


def rms_norm(x: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-6) -> Tensor:
    """RMSNorm over the last dimension: ``x / sqrt(mean(x^2) + eps) * weight``."""
    return torch.ops.fastweight.rmsnorm_fwd(_last_contig(x), _last_contig(weight), float(eps), 0.0)[0]


def head_norm(x: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
              eps: float = 1e-6, weight_offset: float = 0.0) -> Tensor:
    """Per-head LayerNorm of x (..., NH, DH): ``xhat * (weight_offset + weight) + bias``, weight/bias (NH, DH)."""
    return torch.ops.fastweight.headnorm_fwd(_last_contig(x), _last_contig(weight),
                                             _last_contig(bias), float(eps), float(weight_offset))[0]


def adaptive_layer_norm(x: Tensor, scale: Tensor, shift: Optional[Tensor], eps: float = 1e-5) -> Tensor:
    """Adaptive LayerNorm (adaLN): x (B, S, D), scale/shift (B, 1, D): ``xhat * scale[b] + shift[b]``."""
    return torch.ops.fastweight.adalayernorm_fwd(_last_contig(x), _last_contig(scale),
                                                 _last_contig(shift), float(eps))[0]
