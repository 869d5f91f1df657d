"""fastweight: fused kernels for linear-recurrent ("fast weight") models, starting with the
LayerNorm family.

Functional API (differentiable for torch tensors; NumPy arrays run the CPU reference, forward only):

    fastweight.layer_norm(x, weight=None, bias=None, eps=1e-5)
    fastweight.rms_norm(x, weight=None, eps=1e-6)
    fastweight.head_norm(x, weight=None, bias=None, eps=1e-6, weight_offset=0.0)
    fastweight.adaptive_layer_norm(x, scale, shift, eps=1e-5)

mLSTM (torch only; see ``fastweight.mlstm_ops``): ``mlstm``, ``mlstm_headnorm``, ``mlstm_step``, ``mlstm_parallel``,
``mlstm_parallel_headnorm``, ``mlstm_decay_matrix``; drop-in names of NX-AI's mlstm_kernels in ``fastweight.compat.mlstm_kernels``.

DeltaNet (torch only; see ``fastweight.deltanet_ops``): ``delta_rule``, ``delta_rule_step``; drop-in names of
flash-linear-attention (``chunk_delta_rule``, ``fused_recurrent_delta_rule``) in ``fastweight.compat.fla``.

Low level: ``fastweight.ops`` (``torch.ops.fastweight.*`` custom ops and wrappers that return the
statistics), ``fastweight._numpy`` (the same for NumPy arrays), ``fastweight._C`` (the binding).
Modules: ``fastweight.nn`` (LayerNorm, RMSNorm, HeadNorm, AdaptiveLayerNorm).

The package imports without PyTorch (NumPy only); ``ops`` and ``nn`` then are absent.
"""

from __future__ import annotations

import numpy as _np

from . import _C, _numpy

__version__ = "0.1.0"

try:  # torch is optional: register the custom ops when it is there
    import torch as _torch
except ImportError:  # pragma: no cover - exercised by numpy-only installs
    _torch = None

if _torch is not None:
    from . import deltanet_ops, mlstm_ops, nn, ops
    from .deltanet_ops import delta_rule, delta_rule_step
    from .mlstm_ops import (mlstm, mlstm_decay_matrix, mlstm_headnorm, mlstm_parallel, mlstm_parallel_headnorm,
                            mlstm_step)

__all__ = [
    "layer_norm", "rms_norm", "head_norm", "adaptive_layer_norm",
    "mlstm", "mlstm_headnorm", "mlstm_step", "mlstm_parallel", "mlstm_parallel_headnorm", "mlstm_decay_matrix",
    "delta_rule", "delta_rule_step",
    "cuda_available", "build_info", "__version__",
]


def cuda_available() -> bool:
    """True when this build has CUDA kernels and a GPU is visible."""
    return _C.cuda_available()


def build_info() -> str:
    """How the extension was built, e.g. ``"cuda archs 90a,80, dtypes f32,f16,bf16"`` or ``"cpu only"``."""
    return _C.build_info()


def _torch_ops(name: str, x):
    if _torch is None:
        raise TypeError(f"fastweight.{name}: expected a numpy.ndarray (PyTorch is not installed), "
                        f"got {type(x).__name__}")
    return ops


def layer_norm(x, weight=None, bias=None, eps: float = 1e-5):
    """LayerNorm over the last dimension: ``(x - mean) / sqrt(var + eps) * weight + bias``.

    weight/bias (N,) are optional. torch tensors: differentiable in x, weight and bias; numpy
    arrays: forward only, on the CPU. Returns y with x's shape and dtype.
    """
    if isinstance(x, _np.ndarray):
        return _numpy.layernorm_fwd(x, weight, bias, eps)[0]
    return _torch_ops("layer_norm", x).layer_norm(x, weight, bias, eps)


def rms_norm(x, weight=None, eps: float = 1e-6):
    """RMSNorm over the last dimension: ``x / sqrt(mean(x^2) + eps) * weight`` (weight (N,) optional)."""
    if isinstance(x, _np.ndarray):
        return _numpy.rmsnorm_fwd(x, weight, eps)[0]
    return _torch_ops("rms_norm", x).rms_norm(x, weight, eps)


def head_norm(x, weight=None, bias=None, eps: float = 1e-6, weight_offset: float = 0.0):
    """Per-head LayerNorm of x (..., NH, DH): ``xhat * (weight_offset + weight) + bias``.

    weight/bias have shape (NH, DH) (xLSTM: weight_offset=1 with weight initialised to 0).
    """
    if isinstance(x, _np.ndarray):
        return _numpy.headnorm_fwd(x, weight, bias, eps, weight_offset)[0]
    return _torch_ops("head_norm", x).head_norm(x, weight, bias, eps, weight_offset)


def adaptive_layer_norm(x, scale, shift, eps: float = 1e-5):
    """Adaptive LayerNorm (adaLN): x (B, S, D), scale/shift (B, 1, D): ``xhat * scale[b] + shift[b]``.

    shift may be None (no shift).
    """
    if isinstance(x, _np.ndarray):
        return _numpy.adalayernorm_fwd(x, scale, shift, eps)[0]
    return _torch_ops("adaptive_layer_norm", x).adaptive_layer_norm(x, scale, shift, eps)
