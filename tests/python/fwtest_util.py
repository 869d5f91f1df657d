"""Helpers shared by the Python test files (imported by name: pytest puts tests/python on sys.path)."""

from __future__ import annotations

import torch


def rel_err(out, ref) -> float:
    """Relative Frobenius error ||out - ref|| / ||ref|| in float64 (||out - ref|| when ref is 0); asserts
    equal shapes and a finite ``out``."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all(), "non-finite values"
    den = ref.norm()
    return float((out - ref).norm() / (den if den > 0 else 1.0))


def same_bits_twice_and_in_a_graph(fn):
    """Calls fn() (a CUDA op returning a tuple of tensors) twice and asserts bit-identical results, then
    captures one call in a CUDA graph (workspaces from torch's caching allocator), replays it and
    asserts the same bits again. Returns the first call's results."""
    g1, g2 = fn(), fn()
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))  # bit-identical
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gg = fn()
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(gg, g1))
    return g1
