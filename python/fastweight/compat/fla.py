"""Drop-in names of flash-linear-attention's (FLA) delta-rule ops and norms, backed by fastweight.

Swap one import::

    # from fla.ops.delta_rule import chunk_delta_rule, fused_recurrent_delta_rule
    from fastweight.compat.fla import chunk_delta_rule, fused_recurrent_delta_rule
    # from fla.modules import LayerNorm, RMSNorm, GroupNorm
    # from fla.modules.layernorm import layer_norm, rms_norm, group_norm
    from fastweight.compat.fla import LayerNorm, RMSNorm, GroupNorm, layer_norm, rms_norm, group_norm

Names, argument order and defaults are FLA's, as in fla-org/flash-linear-attention
``fla/ops/delta_rule/chunk.py`` (``chunk_delta_rule``) and ``fla/ops/delta_rule/fused_recurrent.py``
(``fused_recurrent_delta_rule``): q, k (B, T, H, K), v (B, T, H, V), beta (B, T, H),
initial_state (N, H, K, V), cu_seqlens (N+1) with B = 1; both return ``(o, final_state)``, the final
state float32 (N, H, K, V) or None unless ``output_final_state``. The two names compute the same thing
(FLA's chunked and recurrent kernels differ only in speed), through ``fastweight.delta_rule``.

Compatibility details:
- ``head_first=True`` (the [B, H, T, ...] layout of older FLA releases, an error in current ones) is
  accepted: the inputs are transposed in and o out; it cannot be combined with cu_seqlens.
- ``offsets=`` (older FLA's name of cu_seqlens) is accepted; ``checkpoint_level=`` (a memory/speed
  knob of older releases) is accepted and ignored. Any other keyword raises TypeError rather than
  being silently dropped.
- ``chunk_delta_rule``'s ``cu_seqlens_cpu`` (FLA 0.6: a host copy of cu_seqlens that saves FLA a
  synchronisation; its 10th positional parameter, as there) is accepted and not needed: fastweight
  never reads the offsets on the host. ``chunk_size=`` (16, 32 or 64 in FLA, which changes only the
  speed) is accepted and checked as FLA checks it; fastweight's chunk is 64 either way.
- ``fused_recurrent_delta_rule`` with beta=None uses beta = 1 (as FLA); FLA's head-wise beta
  (B, T, H, V) is not supported (ValueError).
- Differences, on purpose: float32 inputs are accepted (FLA's chunk_delta_rule asserts bfloat16 or
  float16), and float64 on the CPU.

Norms (FLA 0.6's fla/modules/norm/layernorm.py): ``layer_norm(x, weight, bias, residual=None,
eps=1e-5, prenorm=False, residual_in_fp32=False, is_rms_norm=False)``, ``rms_norm`` (the same without
is_rms_norm), ``group_norm`` (plus ``num_groups``) and the modules ``LayerNorm``, ``RMSNorm``
(``hidden_size, elementwise_affine=True, bias=False, eps=1e-5, device=None, dtype=None``) and
``GroupNorm`` (``num_groups`` first, ``is_rms_norm``), whose ``forward(x, residual=None,
prenorm=False, residual_in_fp32=False)`` is FLA's:
- x (..., D); weight and bias (D,) or None. y has x's dtype.
- With a residual (x's shape), the norm is taken of x + residual: in x's dtype where the residual has
  it (the sum rounded once, as FLA's residual_out; FLA normalises the unrounded fp32 sum), else summed
  in float32. With prenorm the call returns ``(y, residual_out)``, where residual_out is that sum in
  the residual's dtype. Without a residual, residual_out is x, or x in float32 with
  residual_in_fp32. Gradients flow through both outputs.
- ``group_norm``: num_groups groups of D / num_groups features, normalised separately, with
  per-channel weight and bias: fastweight's head norm.
- **Not fused** (FLA fuses them into its kernel): the residual sum, RMSNorm's bias and group
  RMSNorm's weight and bias are torch operations around fastweight's kernels. The plain calls
  (no residual, no RMSNorm bias) are one fastweight kernel each way.
- Parameters in a dtype other than x's or float32 are cast to float32 (fastweight's kernels take
  those two).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from torch import nn

from ..deltanet_ops import delta_rule
from ..ops import head_norm as _head_norm
from ..ops import layer_norm as _layer_norm
from ..ops import rms_norm as _rms_norm

__all__ = ["chunk_delta_rule", "fused_recurrent_delta_rule", "layer_norm", "rms_norm", "group_norm", "LayerNorm",
           "RMSNorm", "GroupNorm"]


def _call(fn: str, q, k, v, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
          cu_seqlens, head_first: bool, kwargs: dict[str, Any]):
    if fn == "chunk_delta_rule" and "chunk_size" in kwargs:  # FLA 0.6: speed only, these three values
        chunk_size = kwargs.pop("chunk_size")
        if chunk_size not in (16, 32, 64):
            raise ValueError(f"{fn}: chunk_size must be 16, 32, or 64 (as FLA's), got {chunk_size!r}")
    if "offsets" in kwargs:
        offsets = kwargs.pop("offsets")
        if cu_seqlens is not None and offsets is not None:
            raise TypeError(f"{fn}(): got both cu_seqlens and offsets (older FLA's name of cu_seqlens)")
        cu_seqlens = cu_seqlens if offsets is None else offsets
    kwargs.pop("checkpoint_level", None)  # memory/speed only
    if kwargs:
        raise TypeError(f"{fn}() got an unexpected keyword argument {next(iter(kwargs))!r}")
    if beta is not None and beta.dim() == 4:
        raise ValueError(f"{fn}: beta: head-wise beta (B, T, H, V) is not supported by fastweight; "
                         f"expected (B, T, H), got {tuple(beta.shape)}")
    if head_first:
        if cu_seqlens is not None:
            raise ValueError(f"{fn}: head_first=True cannot be combined with cu_seqlens (use [B, T, H, ...])")
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        beta = beta.transpose(1, 2) if beta is not None else None
    if beta is None:  # fused_recurrent's default
        beta = torch.ones(q.shape[:-1], dtype=q.dtype, device=q.device)
    o, final_state = delta_rule(q, k, v, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                                cu_seqlens)
    return (o.transpose(1, 2) if head_first else o), final_state


# Shapes: q, k (B, T, H, K), v (B, T, H, V), beta (B, T, H), initial_state (N, H, K, V), cu_seqlens (N+1).
def chunk_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                     scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
                     output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                     cu_seqlens: Optional[torch.LongTensor] = None,
                     cu_seqlens_cpu: Optional[torch.LongTensor] = None, *, head_first: bool = False, **kwargs):
    """FLA's ``chunk_delta_rule`` (fla/ops/delta_rule/chunk.py): ``(o, final_state)``. ``cu_seqlens_cpu``
    (FLA 0.6's host copy of cu_seqlens) is accepted and not needed."""
    del cu_seqlens_cpu  # fastweight never reads the offsets on the host
    return _call("chunk_delta_rule", q, k, v, beta, scale, initial_state, output_final_state,
                 use_qk_l2norm_in_kernel, cu_seqlens, head_first, kwargs)


def fused_recurrent_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               beta: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                               initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
                               use_qk_l2norm_in_kernel: bool = False,
                               cu_seqlens: Optional[torch.LongTensor] = None, head_first: bool = False, **kwargs):
    """FLA's ``fused_recurrent_delta_rule`` (fla/ops/delta_rule/fused_recurrent.py): ``(o, final_state)``;
    beta=None means beta = 1."""
    return _call("fused_recurrent_delta_rule", q, k, v, beta, scale, initial_state, output_final_state,
                 use_qk_l2norm_in_kernel, cu_seqlens, head_first, kwargs)


# ---- norms (fla.modules.norm.layernorm) ------------------------------------------------------------
def _params(x: torch.Tensor, weight, bias):
    """weight and bias in a dtype fastweight's kernels take for x: x's own or float32 (both the same)."""
    dts = {t.dtype for t in (weight, bias) if t is not None}
    if dts and (len(dts) > 1 or next(iter(dts)) not in (x.dtype, torch.float32)):
        weight = weight.float() if weight is not None else None
        bias = bias.float() if bias is not None else None
    return weight, bias


def _fla_norm(fn: str, x: torch.Tensor, weight, bias, residual, eps: float, prenorm: bool,
              residual_in_fp32: bool, is_rms_norm: bool, num_groups: int = 1):
    D = x.shape[-1]
    if num_groups < 1 or D % num_groups != 0:
        raise ValueError(f"{fn}: num_channels must be divisible by num_groups (got {D} and {num_groups})")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != (D,):
            raise ValueError(f"{fn}: {name}: expected shape ({D},), got {tuple(t.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"{fn}: residual: expected x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    # the normalised input: x, or x + residual. FLA's kernel sums in fp32 registers, normalises that sum
    # and stores it rounded to the residual's dtype as residual_out (which its backward then uses).
    # Residual in x's dtype: one torch add (rounded once, as residual_out) and the norm in x's dtype,
    # ~25% more memory traffic than FLA's fused kernel; otherwise the sum in float32.
    if residual is not None and residual.dtype == x.dtype:
        xs = res_out = x + residual
    elif residual is not None:
        xs = x.float() + residual.float()
        res_out = xs if residual.dtype == torch.float32 else xs.to(residual.dtype)
    else:
        xs = x
        res_out = x.float() if residual_in_fp32 and x.dtype != torch.float32 else x
    out_dtype = x.dtype
    G = num_groups
    if G == 1 and not is_rms_norm:
        w, b = _params(xs, weight, bias)
        y = _layer_norm(xs, w, b, eps)
    elif G == 1:
        w, _ = _params(xs, weight, None)
        y = _rms_norm(xs, w, eps)
        if bias is not None:
            y = y + bias.to(y.dtype)
    else:
        xg = xs.reshape(*xs.shape[:-1], G, D // G)
        if not is_rms_norm:
            w, b = _params(xs, weight, bias)
            y = _head_norm(xg, None if w is None else w.reshape(G, D // G), None if b is None else b.reshape(G, D // G),
                           eps, 0.0)
        else:
            y = _rms_norm(xg, None, eps)
            if weight is not None:
                y = y * weight.reshape(G, D // G).to(y.dtype)
            if bias is not None:
                y = y + bias.reshape(G, D // G).to(y.dtype)
        y = y.reshape(xs.shape)
    y = y.to(out_dtype)
    return (y, res_out) if prenorm else y


def layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
               residual: Optional[torch.Tensor] = None, eps: float = 1e-5, prenorm: bool = False,
               residual_in_fp32: bool = False, is_rms_norm: bool = False):
    """FLA's ``fla.modules.layernorm.layer_norm``: LayerNorm (or RMSNorm) over the last dim of x (+ residual)."""
    return _fla_norm("layer_norm", x, weight, bias, residual, eps, prenorm, residual_in_fp32, is_rms_norm)


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
             residual: Optional[torch.Tensor] = None, eps: float = 1e-5, prenorm: bool = False,
             residual_in_fp32: bool = False):
    """FLA's ``fla.modules.layernorm.rms_norm``: x / rms(x) * weight + bias over the last dim (+ residual)."""
    return _fla_norm("rms_norm", x, weight, bias, residual, eps, prenorm, residual_in_fp32, True)


def group_norm(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
               residual: Optional[torch.Tensor] = None, eps: float = 1e-5, prenorm: bool = False,
               residual_in_fp32: bool = False, is_rms_norm: bool = False, num_groups: int = 1):
    """FLA's ``fla.modules.layernorm.group_norm``: the norm of each of num_groups feature groups."""
    return _fla_norm("group_norm", x, weight, bias, residual, eps, prenorm, residual_in_fp32, is_rms_norm,
                     num_groups)


class _FlaNorm(nn.Module):
    """FLA's norm modules' constructor: weight (ones) with elementwise_affine, bias (zeros) with bias too;
    forward through the subclass's function (_norm)."""

    def __init__(self, hidden_size: int, elementwise_affine: bool = True, bias: bool = False, eps: float = 1e-5,
                 device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.hidden_size, self.elementwise_affine, self.eps = hidden_size, elementwise_affine, eps
        self.register_parameter("weight", None)
        self.register_parameter("bias", None)
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(hidden_size, **factory))
            if bias:
                self.bias = nn.Parameter(torch.empty(hidden_size, **factory))
        self.reset_parameters()

    def reset_parameters(self):
        if self.elementwise_affine:
            nn.init.ones_(self.weight)
            if self.bias is not None:
                nn.init.zeros_(self.bias)

    def _repr_head(self) -> str:
        return f"{self.__class__.__name__}({self.hidden_size}"

    def __repr__(self) -> str:
        s = self._repr_head()
        if not self.elementwise_affine:
            s += f", elementwise_affine={self.elementwise_affine}"
        if getattr(self, "is_rms_norm", False):
            s += f", is_rms_norm={self.is_rms_norm}"
        return s + f", eps={self.eps})"

    def forward(self, x, residual=None, prenorm=False, residual_in_fp32=False):
        return type(self)._norm(x, self.weight, self.bias, residual, self.eps, prenorm, residual_in_fp32)


class LayerNorm(_FlaNorm):
    """FLA's ``fla.modules.LayerNorm(hidden_size, elementwise_affine=True, bias=False, eps=1e-5, device,
    dtype)`` (bias off by default, as there)."""
    _norm = staticmethod(layer_norm)


class RMSNorm(_FlaNorm):
    """FLA's ``fla.modules.RMSNorm`` (the same constructor; an optional bias, off by default)."""
    _norm = staticmethod(rms_norm)


class GroupNorm(_FlaNorm):
    """FLA's ``fla.modules.GroupNorm``: num_groups groups over the last dim (LayerNorm, or RMSNorm)."""

    def __init__(self, num_groups: int, hidden_size: int, elementwise_affine: bool = True, bias: bool = False,
                 eps: float = 1e-5, is_rms_norm: bool = False, device=None, dtype=None):
        if hidden_size % num_groups != 0:
            raise ValueError("num_channels must be divisible by num_groups")
        super().__init__(hidden_size, elementwise_affine, bias, eps, device, dtype)
        self.num_groups, self.is_rms_norm = num_groups, is_rms_norm

    def _repr_head(self) -> str:
        return f"{self.__class__.__name__}({self.num_groups}, {self.hidden_size}"

    def forward(self, x, residual=None, prenorm=False, residual_in_fp32=False):
        return group_norm(x, self.weight, self.bias, residual, self.eps, prenorm, residual_in_fp32,
                          self.is_rms_norm, self.num_groups)
