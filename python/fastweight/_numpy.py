"""NumPy front end of the LayerNorm family (CPU reference, no torch needed).

Every function takes NumPy arrays, allocates the outputs and calls ``fastweight._C`` (the C++ CPU
reference: float64 accumulation, any of float32 / float16 / float64 IO; NumPy has no bfloat16).
The forward functions return ``(y, mean, rstd)`` (``(y, rstd)`` for rmsnorm), the statistics in
float32 with shape ``x.shape[:-1]`` as cuDNN does; the backward functions return the input
gradients, ``None`` for the ones that were not asked for.

A last dimension that is not contiguous is copied (the kernels need stride 1 there); every other
stride is used as it is, so rows cut from a larger array cost no copy.
"""

from __future__ import annotations

import numpy as np

from . import _C

__all__ = [
    "layernorm_fwd", "layernorm_bwd",
    "rmsnorm_fwd", "rmsnorm_bwd",
    "headnorm_fwd", "headnorm_bwd",
    "adalayernorm_fwd", "adalayernorm_bwd",
]


def _arr(a):
    """``a`` as an ndarray whose last dimension is contiguous (None stays None)."""
    if a is None:
        return None
    a = np.asarray(a)
    if a.ndim >= 1 and a.shape[-1] > 1 and a.strides[-1] != a.itemsize:
        a = np.ascontiguousarray(a)
    return a


def _stats(x):
    return np.empty(x.shape[:-1], dtype=np.float32)


def _grad_like(p):
    return None if p is None else np.empty(p.shape, dtype=p.dtype)


def _bias_grad(weight, has_bias, x):
    # The bias gradient has the parameter dtype: that of weight, else float32 (the caller's bias
    # may be float32 or of x's dtype; float32 loses nothing and the C++ API accepts it).
    if not has_bias:
        return None
    if weight is not None:
        return np.empty(weight.shape, dtype=weight.dtype)
    return np.empty(x.shape[-1:], dtype=np.float32)


# ---- layernorm ----------------------------------------------------------------------------------
def layernorm_fwd(x, weight=None, bias=None, eps=1e-5, weight_offset=0.0):
    """LayerNorm over the last dim: returns ``(y, mean, rstd)``."""
    x, weight, bias = _arr(x), _arr(weight), _arr(bias)
    y = np.empty(x.shape, dtype=x.dtype)
    mean, rstd = _stats(x), _stats(x)
    _C.layernorm_fwd(x, weight, bias, y, mean, rstd, float(eps), float(weight_offset), 0)
    return y, mean, rstd


def layernorm_bwd(dy, x, weight, mean, rstd, weight_offset=0.0, has_bias=False):
    """Returns ``(dx, dweight, dbias)``; dweight is None without weight, dbias None unless has_bias."""
    dy, x, weight = _arr(dy), _arr(x), _arr(weight)
    dx = np.empty(x.shape, dtype=x.dtype)
    dweight, dbias = _grad_like(weight), _bias_grad(weight, has_bias, x)
    _C.layernorm_bwd(dy, x, weight, mean, rstd, dx, dweight, dbias, float(weight_offset), None, 0)
    return dx, dweight, dbias


# ---- headnorm -----------------------------------------------------------------------------------
def headnorm_fwd(x, weight=None, bias=None, eps=1e-6, weight_offset=0.0):
    """Per-head LayerNorm of x (..., NH, DH), weight/bias (NH, DH): returns ``(y, mean, rstd)``."""
    x, weight, bias = _arr(x), _arr(weight), _arr(bias)
    y = np.empty(x.shape, dtype=x.dtype)
    mean, rstd = _stats(x), _stats(x)
    _C.headnorm_fwd(x, weight, bias, y, mean, rstd, float(eps), float(weight_offset), 0)
    return y, mean, rstd


def headnorm_bwd(dy, x, weight, mean, rstd, weight_offset=0.0, has_bias=False):
    """Returns ``(dx, dweight, dbias)`` of headnorm (dweight/dbias of shape (NH, DH) or None)."""
    dy, x, weight = _arr(dy), _arr(x), _arr(weight)
    dx = np.empty(x.shape, dtype=x.dtype)
    dweight = _grad_like(weight)
    dbias = None
    if has_bias:
        pdt = weight.dtype if weight is not None else np.float32
        dbias = np.empty(x.shape[-2:], dtype=pdt)
    _C.headnorm_bwd(dy, x, weight, mean, rstd, dx, dweight, dbias, float(weight_offset), None, 0)
    return dx, dweight, dbias


# ---- rmsnorm ------------------------------------------------------------------------------------
def rmsnorm_fwd(x, weight=None, eps=1e-6, weight_offset=0.0):
    """RMSNorm over the last dim: returns ``(y, rstd)``."""
    x, weight = _arr(x), _arr(weight)
    y = np.empty(x.shape, dtype=x.dtype)
    rstd = _stats(x)
    _C.rmsnorm_fwd(x, weight, y, rstd, float(eps), float(weight_offset), 0)
    return y, rstd


def rmsnorm_bwd(dy, x, weight, rstd, weight_offset=0.0):
    """Returns ``(dx, dweight)``; dweight is None without weight."""
    dy, x, weight = _arr(dy), _arr(x), _arr(weight)
    dx = np.empty(x.shape, dtype=x.dtype)
    dweight = _grad_like(weight)
    _C.rmsnorm_bwd(dy, x, weight, rstd, dx, dweight, float(weight_offset), None, 0)
    return dx, dweight


# ---- adalayernorm -------------------------------------------------------------------------------
def adalayernorm_fwd(x, scale, shift=None, eps=1e-5):
    """Adaptive LayerNorm, x (B, S, D), scale/shift (B, 1, D): returns ``(y, mean, rstd)``."""
    x, scale, shift = _arr(x), _arr(scale), _arr(shift)
    y = np.empty(x.shape, dtype=x.dtype)
    mean, rstd = _stats(x), _stats(x)
    _C.adalayernorm_fwd(x, scale, shift, y, mean, rstd, float(eps), 0)
    return y, mean, rstd


def adalayernorm_bwd(dy, x, scale, mean, rstd, has_shift=True):
    """Returns ``(dx, dscale, dshift)``; dshift is None unless has_shift."""
    dy, x, scale = _arr(dy), _arr(x), _arr(scale)
    dx = np.empty(x.shape, dtype=x.dtype)
    dscale = np.empty(scale.shape, dtype=scale.dtype)
    dshift = np.empty(scale.shape, dtype=scale.dtype) if has_shift else None
    _C.adalayernorm_bwd(dy, x, scale, mean, rstd, dx, dscale, dshift, None, 0)
    return dx, dscale, dshift
