"""nn.Modules over the fastweight ops (``torch.nn.LayerNorm``-like constructors and init)."""

from __future__ import annotations

import numbers
from typing import Optional

import torch
from torch import Tensor

from . import ops

__all__ = ["LayerNorm", "RMSNorm", "HeadNorm", "AdaptiveLayerNorm"]


def _last_dim(normalized_shape, cls: str) -> int:
    if isinstance(normalized_shape, numbers.Integral):
        return int(normalized_shape)
    shape = tuple(normalized_shape)
    if len(shape) != 1:
        raise ValueError(f"{cls}: normalized_shape: only the last dimension can be normalised, "
                         f"expected an int or a 1-tuple, got {shape}")
    return int(shape[0])


def _param(wanted: bool, shape, factory) -> Optional[torch.nn.Parameter]:
    return torch.nn.Parameter(torch.empty(shape, **factory)) if wanted else None


class LayerNorm(torch.nn.Module):
    """LayerNorm over the last dimension, as ``torch.nn.LayerNorm(normalized_shape)`` for an int."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.normalized_shape = (_last_dim(normalized_shape, "LayerNorm"),)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.register_parameter("weight", _param(elementwise_affine, self.normalized_shape, factory))
        self.register_parameter("bias", _param(elementwise_affine and bias, self.normalized_shape, factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.ones_(self.weight)
        if self.bias is not None:
            torch.nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        return ops.layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}, bias={self.bias is not None}")


class RMSNorm(torch.nn.Module):
    """RMSNorm over the last dimension: ``x / sqrt(mean(x^2) + eps) * weight``."""

    def __init__(self, normalized_shape, eps: float = 1e-6, elementwise_affine: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.normalized_shape = (_last_dim(normalized_shape, "RMSNorm"),)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        factory = {"device": device, "dtype": dtype}
        self.register_parameter("weight", _param(elementwise_affine, self.normalized_shape, factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class HeadNorm(torch.nn.Module):
    """Per-head LayerNorm of x (..., num_heads, head_dim) with weight/bias (num_heads, head_dim):
    ``y = xhat * (weight_offset + weight) + bias``.

    The weight starts at ``1 - weight_offset`` so the effective scale starts at 1: zeros for xLSTM's
    ``weight_offset=1`` (its MultiHeadLayerNorm), ones for the plain ``weight_offset=0``.
    """

    def __init__(self, num_heads: int, head_dim: int, eps: float = 1e-6, weight_offset: float = 0.0,
                 bias: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.num_heads = int(num_heads)
        self.head_dim = int(head_dim)
        self.eps = eps
        self.weight_offset = float(weight_offset)
        self.weight = torch.nn.Parameter(torch.empty(self.num_heads, self.head_dim, **factory))
        self.register_parameter("bias", _param(bias, (self.num_heads, self.head_dim), factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        torch.nn.init.constant_(self.weight, 1.0 - self.weight_offset)
        if self.bias is not None:
            torch.nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        return ops.head_norm(x, self.weight, self.bias, self.eps, self.weight_offset)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, head_dim={self.head_dim}, eps={self.eps}, "
                f"weight_offset={self.weight_offset}, bias={self.bias is not None}")


class AdaptiveLayerNorm(torch.nn.Module):
    """Adaptive LayerNorm (adaLN, DiT): ``forward(x, scale, shift)`` with x (B, S, D) and
    scale/shift (B, 1, D) computed by the caller (e.g. from a conditioning vector). No parameters."""

    def __init__(self, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: Tensor, scale: Tensor, shift: Optional[Tensor] = None) -> Tensor:
        return ops.adaptive_layer_norm(x, scale, shift, self.eps)

    def extra_repr(self) -> str:
        return f"eps={self.eps}"
