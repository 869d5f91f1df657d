"""Tests of fastweight.compat.fla's norms: FLA's layer_norm / rms_norm / group_norm and the LayerNorm /
RMSNorm / GroupNorm modules (fla/modules/norm/layernorm.py, FLA 0.6) on fastweight's kernels.

Each result is compared with a float64 PyTorch implementation of FLA's semantics written below from
FLA's source (not from fastweight): the norm of x + residual per group of D / num_groups features,
times weight plus bias; with prenorm also residual_out = x + residual. Gradients: float64 autograd of
that formula through both outputs. CPU tests run fastweight's C++ reference; the last test compares
with FLA itself on a GPU (skipped without FLA or without a GPU).
"""

from __future__ import annotations

import pytest
import torch

from fastweight.compat import fla as fw_fla

CUDA = torch.cuda.is_available()
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float64: 1e-6}


def fla_ref(x, w, b, residual, eps, is_rms, groups):
    """(y, residual_out) in float64: FLA's forward, from its kernel's text."""
    xs = x.double() + (residual.double() if residual is not None else 0.0)
    D = xs.shape[-1]
    xg = xs.reshape(*xs.shape[:-1], groups, D // groups)
    if is_rms:
        y = xg / torch.sqrt((xg * xg).mean(-1, keepdim=True) + eps)
    else:
        mu = xg.mean(-1, keepdim=True)
        y = (xg - mu) / torch.sqrt(((xg - mu) ** 2).mean(-1, keepdim=True) + eps)
    y = y.reshape(xs.shape)
    if w is not None:
        y = y * w.double()
    if b is not None:
        y = y + b.double()
    return y, xs


def rel(out, ref) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def make(shape, dtype, scale=1.0, shift=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale + shift).to(dtype).requires_grad_(True)


CASES = [  # (function, is_rms, groups)
    ("layer_norm", False, 1), ("rms_norm", True, 1), ("group_norm", False, 4), ("group_norm", True, 4),
    ("layer_norm_rms", True, 1),  # layer_norm(..., is_rms_norm=True)
]


def call(name, x, w, b, residual, eps, prenorm, residual_in_fp32):
    if name == "layer_norm":
        return fw_fla.layer_norm(x, w, b, residual, eps, prenorm, residual_in_fp32)
    if name == "layer_norm_rms":
        return fw_fla.layer_norm(x, w, b, residual, eps, prenorm, residual_in_fp32, is_rms_norm=True)
    assert name == "rms_norm", name
    return fw_fla.rms_norm(x, w, b, residual, eps, prenorm, residual_in_fp32)


@pytest.mark.parametrize("residual", ["none", "same", "fp32"])
@pytest.mark.parametrize("params", ["wb", "w", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name,is_rms,groups", CASES,
                         ids=["layer_norm", "rms_norm", "group_norm", "group_norm_rms", "layer_norm_is_rms"])
def test_functions_match_fla_semantics(name, is_rms, groups, dtype, params, residual):
    D, eps = 96, 1e-5
    x = make((3, 5, D), dtype, 2.0, 0.5, seed=1)
    w = make((D,), dtype, 0.1, 1.0, seed=2) if params != "none" else None
    b = make((D,), dtype, 0.1, 0.0, seed=3) if params == "wb" else None
    res = None
    if residual != "none":
        res = make((3, 5, D), dtype if residual == "same" else torch.float32, 1.0, 0.0, seed=4)
    gn_rms = name == "group_norm" and is_rms
    for prenorm in (False, True):
        for residual_in_fp32 in (False, True):
            inputs = [t for t in (x, w, b, res) if t is not None]
            for t in inputs:
                t.grad = None
            if name == "group_norm":
                out = fw_fla.group_norm(x, w, b, res, eps, prenorm, residual_in_fp32, is_rms_norm=gn_rms,
                                        num_groups=groups)
            else:
                out = call(name, x, w, b, res, eps, prenorm, residual_in_fp32)
            y, r_out = out if prenorm else (out, None)
            ry, rr = fla_ref(x, w, b, res, eps, is_rms, groups)
            tag = f"prenorm={prenorm} residual_in_fp32={residual_in_fp32}"
            assert y.dtype == x.dtype, tag
            assert y.shape == x.shape, tag
            assert rel(y, ry) < TOL[dtype], tag
            if prenorm:
                want = res.dtype if res is not None else (torch.float32 if residual_in_fp32 else x.dtype)
                assert r_out.dtype == want, tag
                if res is None and not residual_in_fp32:
                    assert r_out is x, tag + ": FLA returns x itself as residual_out"
                assert rel(r_out, rr) < TOL[r_out.dtype], tag
            # gradients through both outputs against float64 autograd of the reference
            gy = make(x.shape, torch.float64, seed=5).detach()
            gr = make(x.shape, torch.float64, seed=6).detach()
            loss = (y.double() * gy).sum() + ((r_out.double() * gr).sum() if prenorm else 0.0)
            loss.backward()
            got = [t.grad for t in inputs]
            ref_in = [t.detach().double().requires_grad_(True) for t in inputs]
            it = iter(ref_in)
            rx = next(it)
            rw = next(it) if w is not None else None
            rb = next(it) if b is not None else None
            rres = next(it) if res is not None else None
            ry64, rr64 = fla_ref(rx, rw, rb, rres, eps, is_rms, groups)
            rloss = (ry64 * gy).sum() + ((rr64 * gr).sum() if prenorm else 0.0)
            want = torch.autograd.grad(rloss, ref_in)
            for i, (g, r) in enumerate(zip(got, want)):
                assert g is not None, f"{tag}: input {i} has no gradient"
                assert rel(g, r) < 2 * TOL[dtype], f"{tag}: gradient of input {i}: {rel(g, r):.2e}"


def test_group_norm_equals_per_group_layer_norm():
    x = make((4, 64), torch.float64, seed=7)
    w, b = make((64,), torch.float64, seed=8), make((64,), torch.float64, seed=9)
    y = fw_fla.group_norm(x, w, b, num_groups=4)
    per = torch.cat([torch.nn.functional.layer_norm(x[:, 16 * g:16 * g + 16], (16,), w[16 * g:16 * g + 16],
                                                    b[16 * g:16 * g + 16], 1e-5) for g in range(4)], -1)
    assert rel(y, per) < 1e-12


def test_modules_as_fla():
    ln = fw_fla.LayerNorm(32)
    assert ln.weight is not None and ln.bias is None  # FLA: bias=False by default
    assert torch.equal(ln.weight, torch.ones(32))
    assert repr(ln) == "LayerNorm(32, eps=1e-05)"
    lnb = fw_fla.LayerNorm(32, bias=True, eps=1e-6, dtype=torch.float64)
    assert lnb.bias.dtype == torch.float64 and torch.equal(lnb.bias, torch.zeros(32, dtype=torch.float64))
    assert sorted(lnb.state_dict()) == ["bias", "weight"]
    na = fw_fla.RMSNorm(32, elementwise_affine=False)
    assert na.weight is None and na.bias is None and list(na.parameters()) == []
    assert repr(na) == "RMSNorm(32, elementwise_affine=False, eps=1e-05)"
    gn = fw_fla.GroupNorm(4, 32, is_rms_norm=True)
    assert repr(gn) == "GroupNorm(4, 32, is_rms_norm=True, eps=1e-05)"
    with pytest.raises(ValueError, match="divisible"):
        fw_fla.GroupNorm(5, 32)
    x = make((2, 3, 32), torch.float32, seed=10)
    r = make((2, 3, 32), torch.float32, seed=11)
    with torch.no_grad():
        lnb.weight.uniform_(0.5, 1.5), lnb.bias.uniform_(-0.5, 0.5)
    lnb32 = lnb.float()
    y, ro = lnb32(x, r, prenorm=True)
    y2, ro2 = fw_fla.layer_norm(x, lnb32.weight, lnb32.bias, r, 1e-6, prenorm=True)
    assert torch.equal(y, y2) and torch.equal(ro, ro2)
    assert torch.equal(fw_fla.RMSNorm(32)(x), fw_fla.rms_norm(x, torch.ones(32), None))
    assert torch.equal(gn(x), fw_fla.group_norm(x, torch.ones(32), None, is_rms_norm=True, num_groups=4))


def test_bad_inputs():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="weight"):
        fw_fla.layer_norm(x, torch.ones(7), None)
    with pytest.raises(ValueError, match="residual"):
        fw_fla.rms_norm(x, None, None, residual=torch.randn(2, 7))
    with pytest.raises(ValueError, match="divisible"):
        fw_fla.group_norm(x, None, None, num_groups=3)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="no CUDA device")
def test_cuda_matches_fla_itself():
    """The shim against FLA's own Triton norms on the GPU (skipped where FLA is not installed)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from bench_common import import_fla
    try:
        L = import_fla("fla.modules.layernorm")
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"FLA not importable: {e}")
    D = 1024
    for fn, kw in (("layer_norm", {}), ("rms_norm", {}), ("group_norm", {"num_groups": 8})):
        for residual in (False, True):
            xs = [make((4, 33, D), torch.bfloat16, 2.0, 0.5, seed=1).detach().cuda() for _ in range(2)]
            ws = [make((D,), torch.bfloat16, 0.1, 1.0, seed=2).detach().cuda() for _ in range(2)]
            bs = [make((D,), torch.bfloat16, 0.1, 0.0, seed=3).detach().cuda() for _ in range(2)]
            rs = [make((4, 33, D), torch.bfloat16, seed=4).detach().cuda() for _ in range(2)] if residual else [None, None]
            for t in xs + ws + bs + [r for r in rs if r is not None]:
                t.requires_grad_(True)
            outs = []
            for impl, x, w, b, r in ((getattr(fw_fla, fn), xs[0], ws[0], bs[0], rs[0]),
                                     (getattr(L, fn), xs[1], ws[1], bs[1], rs[1])):
                y, ro = impl(x, w, b, r, 1e-5, True, False, **kw)
                g = torch.ones_like(y)
                torch.autograd.backward([y, ro], [g, torch.ones_like(ro)])
                outs.append([y, ro, x.grad, w.grad, b.grad] + ([r.grad] if r is not None else []))
            for i, (a, b_) in enumerate(zip(*outs)):
                assert rel(a.float(), b_.float()) < 2e-2, f"{fn} residual={residual}: output {i}"
