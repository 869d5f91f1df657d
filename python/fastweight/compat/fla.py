"""Drop-in names of flash-linear-attention's (FLA) delta-rule ops, backed by fastweight.

Swap one import::

    # from fla.ops.delta_rule import chunk_delta_rule, fused_recurrent_delta_rule
    from fastweight.compat.fla import chunk_delta_rule, fused_recurrent_delta_rule

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
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..deltanet_ops import delta_rule

__all__ = ["chunk_delta_rule", "fused_recurrent_delta_rule"]


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
