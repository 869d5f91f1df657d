"""Drop-in names of NX-AI's ``mlstm_kernels`` (2.x), backed by fastweight.

Swap one import::

    # from mlstm_kernels.torch.chunkwise.triton_xl_chunk import mlstm_chunkwise__xl_chunk
    # from mlstm_kernels.torch.recurrent.triton_step import mlstm_recurrent_step__triton
    from fastweight.compat.mlstm_kernels import mlstm_chunkwise__xl_chunk, mlstm_recurrent_step__triton

The parallel kernels (``mlstm_parallel__limit_headdim``, ``mlstm_parallel__native_autograd``,
``mlstm_parallel__native_custbw``) are seed 000's parallel form (``fastweight.mlstm_parallel``); like
mlstm_kernels' they take no initial states and return no last states.

or use the registry functions (``get_mlstm_kernel("chunkwise--triton_xl_chunk")``,
``get_mlstm_step_kernel("triton")``), as xLSTM's backend module does. Signatures and return values
are mlstm_kernels': q, k (B, NH, S, DHQK), v (B, NH, S, DHHV), i, f (B, NH, S); c_initial
(B, NH, DHQK, DHHV), n_initial (B, NH, DHQK), m_initial (B, NH, 1); returns h, or (h, (c, n, m))
with float32 states and m (B, NH, 1). Tuning arguments of the Triton kernels (chunk_size_inter,
siz_b_*, num_warps_*, ...) are accepted and ignored; chunk_size must be a power of two in
[16, 256]. Differences, on purpose: any S works (no multiple-of-16 rule), and the backward is the
exact gradient (mlstm_kernels drops the normaliser's gradient, right only under a head norm).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..mlstm_ops import mlstm, mlstm_parallel, mlstm_step

__all__ = [
    "mlstm_chunkwise__xl_chunk", "mlstm_parallel__limit_headdim", "mlstm_parallel__native_autograd",
    "mlstm_parallel__native_custbw", "mlstm_recurrent_step__triton", "get_mlstm_kernel", "get_mlstm_step_kernel",
    "get_available_mlstm_kernels", "get_available_mlstm_step_kernels",
]


def mlstm_chunkwise__xl_chunk(
    q: torch.Tensor,  # (B, NH, S, DHQK)
    k: torch.Tensor,  # (B, NH, S, DHQK)
    v: torch.Tensor,  # (B, NH, S, DHHV)
    i: torch.Tensor,  # (B, NH, S)
    f: torch.Tensor,  # (B, NH, S)
    c_initial: torch.Tensor | None = None,  # (B, NH, DHQK, DHHV)
    n_initial: torch.Tensor | None = None,  # (B, NH, DHQK)
    m_initial: torch.Tensor | None = None,  # (B, NH, 1)
    return_last_states: bool = False,
    eps: float = 1e-6,
    chunk_size: int = 128,
    **tuning,  # chunk_size_inter, siz_b_L_parallel, num_warps_intra, autocast_kernel_dtype, ...
):
    """mlstm_kernels' chunkwise xl_chunk kernel: h, or (h, (c_last, n_last, m_last))."""
    return mlstm(q, k, v, i, f, c_initial, n_initial, m_initial, return_last_states, eps, chunk_size)


def _parallel_kernel(name: str) -> Callable:
    def kernel(
        q: torch.Tensor,  # (B, NH, S, DHQK)
        k: torch.Tensor,  # (B, NH, S, DHQK)
        v: torch.Tensor,  # (B, NH, S, DHHV)
        i: torch.Tensor,  # (B, NH, S)
        f: torch.Tensor,  # (B, NH, S)
        c_initial: torch.Tensor | None = None,
        n_initial: torch.Tensor | None = None,
        m_initial: torch.Tensor | None = None,
        return_last_states: bool = False,
        eps: float = 1e-6,
        **tuning,  # chunk_size, autocast_kernel_dtype, block sizes, ...: accepted and ignored
    ) -> torch.Tensor:
        if c_initial is not None or n_initial is not None or m_initial is not None:
            raise ValueError(f"{name}: the parallel form takes no initial states (use mlstm_chunkwise__xl_chunk)")
        if return_last_states:
            raise ValueError(f"{name}: the parallel form returns no last states (use mlstm_chunkwise__xl_chunk)")
        return mlstm_parallel(q, k, v, i, f, eps)[0]

    kernel.__name__ = kernel.__qualname__ = name
    kernel.__doc__ = f"mlstm_kernels' {name}: h (B, NH, S, DHHV) of seed 000's parallel form."
    return kernel


mlstm_parallel__limit_headdim = _parallel_kernel("mlstm_parallel__limit_headdim")
mlstm_parallel__native_autograd = _parallel_kernel("mlstm_parallel__native_autograd")
mlstm_parallel__native_custbw = _parallel_kernel("mlstm_parallel__native_custbw")


def mlstm_recurrent_step__triton(
    q: torch.Tensor,  # (B, NH, DHQK)
    k: torch.Tensor,  # (B, NH, DHQK)
    v: torch.Tensor,  # (B, NH, DHHV)
    i: torch.Tensor,  # (B, NH, 1)
    f: torch.Tensor,  # (B, NH, 1)
    c: torch.Tensor,  # (B, NH, DHQK, DHHV)
    n: torch.Tensor,  # (B, NH, DHQK)
    m: torch.Tensor,  # (B, NH, 1)
    eps: float = 1e-6,
    dtype_state: torch.dtype = torch.float32,
    **tuning,
):
    """mlstm_kernels' step kernel: (h, (c_new, n_new, m_new)), new state tensors (float32)."""
    if dtype_state != torch.float32:
        raise ValueError(f"mlstm_recurrent_step__triton: dtype_state: fastweight keeps states in float32, "
                         f"got {dtype_state}")
    f32 = [t if t.dtype == torch.float32 else t.float() for t in (c, n, m)]
    return mlstm_step(q, k, v, i, f, *f32, eps=eps)


_SEQUENCE_KERNELS: dict[str, Callable] = {
    "chunkwise--triton_xl_chunk": mlstm_chunkwise__xl_chunk,
    "parallel--triton_limit_headdim": mlstm_parallel__limit_headdim,
    "parallel--native_autograd": mlstm_parallel__native_autograd,
    "parallel--native_custbw": mlstm_parallel__native_custbw,
}
_STEP_KERNELS: dict[str, Callable] = {
    "triton": mlstm_recurrent_step__triton,
}


def _lookup(fn: str, table: dict[str, Callable], name: str) -> Callable:
    if name not in table:
        raise ValueError(f"{fn}: unknown kernel {name!r}; fastweight provides {list(table)}")
    return table[name]


def get_available_mlstm_kernels() -> list[str]:
    return list(_SEQUENCE_KERNELS)


def get_mlstm_kernel(name: str) -> Callable:
    """As ``mlstm_kernels.torch.get_mlstm_kernel``; fastweight serves the names of get_available_mlstm_kernels()."""
    return _lookup("get_mlstm_kernel", _SEQUENCE_KERNELS, name)


def get_available_mlstm_step_kernels() -> list[str]:
    return list(_STEP_KERNELS)


def get_mlstm_step_kernel(name: str) -> Callable:
    """As ``mlstm_kernels.torch.get_mlstm_step_kernel``; fastweight serves "triton"."""
    return _lookup("get_mlstm_step_kernel", _STEP_KERNELS, name)
