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
