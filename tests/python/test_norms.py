"""Tests of the Python layer of the LayerNorm family (fastweight.ops / nn / _numpy / _C).

Every result is compared with an independent float64 PyTorch implementation of MATH.md §1 written
below (forward by formula, gradients by float64 autograd of that formula), by relative Frobenius
error ||out - ref|| / ||ref|| with per-dtype bounds. CPU tests run the C++ reference through the
binding; tests marked `gpu` run the CUDA kernels and are skipped ("no CUDA device") without a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import fastweight
import fastweight._numpy as fnp
from fastweight import _C, ops

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device")

OPS = ["layernorm", "rmsnorm", "headnorm", "adalayernorm"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Relative Frobenius error bounds against float64 (float64 IO: the backward uses the fp32 statistics).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float64: 1e-6}
EPS = {"layernorm": 1e-5, "rmsnorm": 1e-6, "headnorm": 1e-6, "adalayernorm": 1e-5}


# ---- the float64 reference (independent of fastweight) ------------------------------------------
def ref_forward(op, x, w=None, b=None, eps=1e-5, weight_offset=0.0):
    """MATH.md §1 in float64. w/b broadcast: (N,), (NH, DH) or (B, 1, D)."""
    x = x.double()
    if op == "rmsnorm":
        y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    else:
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        y = (x - mu) / torch.sqrt(var + eps)
    if w is not None:
        y = y * (weight_offset + w.double())
    if b is not None:
        y = y + b.double()
    return y


def ref_stats(op, x, eps):
    x = x.double()
    if op == "rmsnorm":
        return None, 1.0 / torch.sqrt((x * x).mean(-1) + eps)
    mu = x.mean(-1)
    return mu, 1.0 / torch.sqrt(((x - mu[..., None]) ** 2).mean(-1) + eps)


def rel_err(out, ref) -> float:
    out = out.detach().double().cpu()
    ref = ref.detach().double().cpu()
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    den = ref.norm().item()
    num = (out - ref).norm().item()
    return num / den if den > 0 else num


def assert_rel(out, ref, tol, what):
    err = rel_err(out, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e} (|ref| = {ref.double().norm().item():.3e})"


# ---- inputs -------------------------------------------------------------------------------------
def shapes(op, n, rows=6):
    """(x shape, parameter shape) of each op for last dim n and about `rows` rows."""
    if op in ("layernorm", "rmsnorm"):
        return (2, max(1, rows // 2), n), (n,)
    if op == "headnorm":
        return (2, max(1, rows // 6), 3, n), (3, n)
    return (2, max(1, rows // 2), n), (2, 1, n)


def rand(shape, dtype, device, gen, scale=1.0, shift=0.0, layout="contig"):
    """Random normal tensor; layout "strided" cuts it from a larger buffer (rows at a larger stride,
    a 1-element offset so that the data is not 16-byte aligned), "every2" takes every second row."""
    if layout == "contig":
        t = torch.randn(shape, generator=gen, dtype=torch.float64)
        return (t * scale + shift).to(dtype=dtype, device=device)
    if layout == "strided":
        big_shape = (*shape[:-1], shape[-1] + 3)
        big = (torch.randn(big_shape, generator=gen, dtype=torch.float64) * scale + shift)
        big = big.to(dtype=dtype, device=device)
        return big[..., 1:shape[-1] + 1]
    if layout == "every2":
        big = torch.randn((shape[0] * 2, *shape[1:]), generator=gen, dtype=torch.float64) * scale + shift
        return big.to(dtype=dtype, device=device)[::2]
    raise ValueError(layout)


def make_inputs(op, n, dtype, device="cpu", *, rows=6, weight=True, bias=True, pdtype=None,
                weight_offset=0.0, layout="contig", seed=0):
    gen = torch.Generator().manual_seed(seed)
    xs, ps = shapes(op, n, rows)
    pdtype = pdtype or dtype
    x = rand(xs, dtype, device, gen, scale=2.0, shift=0.5, layout=layout)
    # The effective scale (weight_offset + w) is about 1 +- 0.5 whatever the offset.
    w = rand(ps, pdtype, device, gen, scale=0.5, shift=1.0 - weight_offset) if weight or op == "adalayernorm" else None
    b = rand(ps, pdtype, device, gen, scale=0.5) if bias else None
    return x, w, b


def fw_forward(op, x, w, b, eps, weight_offset=0.0, api="functional"):
    """y through the public Python API (differentiable)."""
    if api == "functional" and weight_offset == 0.0:
        if op == "layernorm":
            return fastweight.layer_norm(x, w, b, eps)
        if op == "rmsnorm":
            return fastweight.rms_norm(x, w, eps)
        if op == "headnorm":
            return fastweight.head_norm(x, w, b, eps)
        return fastweight.adaptive_layer_norm(x, w, b, eps)
    if op == "layernorm":
        return ops.layernorm_fwd(x, w, b, eps, weight_offset)[0]
    if op == "rmsnorm":
        return ops.rmsnorm_fwd(x, w, eps, weight_offset)[0]
    if op == "headnorm":
        return fastweight.head_norm(x, w, b, eps, weight_offset)
    return ops.adalayernorm_fwd(x, w, b, eps)[0]


def leaves_of(*ts):
    return [t for t in ts if t is not None]


def check_against_reference(op, x, w, b, *, eps=None, weight_offset=0.0, tol=None, api="functional", seed=1):
    """Forward and every gradient of the fastweight op vs the float64 reference."""
    eps = EPS[op] if eps is None else eps
    tol = TOL[x.dtype] if tol is None else tol
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (x, w, b)]
    # detach() keeps the strides of a view, so strided inputs stay strided.
    x, w, b = leaves
    y = fw_forward(op, x, w, b, eps, weight_offset, api)
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    gen = torch.Generator().manual_seed(seed)
    dy = torch.randn(y.shape, generator=gen, dtype=torch.float64).to(dtype=y.dtype, device=y.device)
    grads = torch.autograd.grad(y, leaves_of(x, w, b), dy)

    ref_leaves = [t.detach().double().cpu().requires_grad_() if t is not None else None for t in (x, w, b)]
    yr = ref_forward(op, *ref_leaves, eps=eps, weight_offset=weight_offset)
    grads_r = torch.autograd.grad(yr, leaves_of(*ref_leaves), dy.double().cpu())

    assert_rel(y, yr, tol, f"{op} y")
    for name, t, g, gr in zip(("dx", "dweight", "dbias"), leaves_of(x, w, b), grads, grads_r):
        assert g.dtype == t.dtype and g.shape == t.shape, f"{op} {name}: {g.dtype}{tuple(g.shape)}"
        assert_rel(g, gr, tol, f"{op} {name}")


# ---- CPU: forward and gradients vs float64 ------------------------------------------------------
PARAM_CONFIGS = ["weight+bias", "none", "weight", "f32-params", "offset"]


def _config_kwargs(op, config, dtype):
    if config == "weight+bias":
        return {}
    if config == "none":  # adalayernorm: scale is required, no shift
        return {"weight": False, "bias": False}
    if config == "weight":
        return {"bias": False}
    if config == "f32-params":
        return {"pdtype": torch.float32}
    if config == "offset":
        return {"weight_offset": 1.0}
    raise ValueError(config)


def _cpu_cases():
    for op in OPS:
        for dtype in DTYPES + [torch.float64]:
            for config in PARAM_CONFIGS:
                if config == "f32-params" and dtype in (torch.float32, torch.float64):
                    continue  # parameters already float32 / float64 IO takes float64 parameters
                if config == "offset" and op == "adalayernorm":
                    continue  # adalayernorm has no weight_offset
                yield pytest.param(op, dtype, config, id=f"{op}-{str(dtype).split('.')[-1]}-{config}")


@pytest.mark.parametrize("op,dtype,config", list(_cpu_cases()))
def test_cpu_vs_reference(op, dtype, config):
    kw = _config_kwargs(op, config, dtype)
    off = kw.get("weight_offset", 0.0)
    x, w, b = make_inputs(op, 37, dtype, rows=12, **kw)
    if op == "rmsnorm":
        b = None
    check_against_reference(op, x, w, b, weight_offset=off)


@pytest.mark.parametrize("op", OPS)
def test_cpu_statistics(op):
    """The saved statistics are float32, shape x.shape[:-1], and equal the float64 ones."""
    x, w, b = make_inputs(op, 19, torch.float32)
    eps = EPS[op]
    if op == "layernorm":
        y, mean, rstd = ops.layernorm_fwd(x, w, b, eps)
    elif op == "headnorm":
        y, mean, rstd = ops.headnorm_fwd(x, w, b, eps)
    elif op == "adalayernorm":
        y, mean, rstd = ops.adalayernorm_fwd(x, w, b, eps)
    else:
        (y, rstd), mean = ops.rmsnorm_fwd(x, w, eps), None
    mean_r, rstd_r = ref_stats(op, x, eps)
    for t, r in ((mean, mean_r), (rstd, rstd_r)):
        if r is None:
            continue
        assert t.dtype == torch.float32 and t.shape == x.shape[:-1] and t.is_contiguous()
        assert not t.requires_grad
        assert_rel(t, r, 1e-6, f"{op} statistic")


@pytest.mark.parametrize("op", OPS)
def test_cpu_sum_backward(op):
    """loss.sum().backward() hands the backward an expanded (stride 0) dy: still correct."""
    x, w, b = make_inputs(op, 16, torch.float32)
    if op == "rmsnorm":
        b = None
    x, w, b = [t.requires_grad_() if t is not None else None for t in (x, w, b)]
    fw_forward(op, x, w, b, EPS[op]).sum().backward()
    xr, wr, br = [t.detach().double().requires_grad_() if t is not None else None for t in (x, w, b)]
    ref_forward(op, xr, wr, br, EPS[op]).sum().backward()
    for t, r in zip(leaves_of(x, w, b), leaves_of(xr, wr, br)):
        # dx of a plain sum is ~0 (rows of xhat sum to 0): compare absolutely.
        assert (t.grad.double() - r.grad).abs().max().item() < 1e-4


# ---- gradcheck in float64 (CPU reference) -------------------------------------------------------
@pytest.mark.parametrize("params", [True, False], ids=["params", "no-params"])
@pytest.mark.parametrize("op", OPS)
def test_gradcheck(op, params):
    gen = torch.Generator().manual_seed(3)
    xs, ps = shapes(op, 5, rows=6)
    x = torch.randn(xs, generator=gen, dtype=torch.float64, requires_grad=True)
    w = (torch.randn(ps, generator=gen, dtype=torch.float64) * 0.5 + 1).requires_grad_() if params or op == "adalayernorm" else None
    b = torch.randn(ps, generator=gen, dtype=torch.float64).requires_grad_() if params and op != "rmsnorm" else None
    eps = 1e-3  # keeps the finite differences well conditioned

    if op == "headnorm":
        fn = lambda *a: fastweight.head_norm(*_fill(a, x, w, b), eps=eps, weight_offset=0.5)
    else:
        fn = lambda *a: fw_forward(op, *_fill(a, x, w, b), eps)
    assert torch.autograd.gradcheck(fn, leaves_of(x, w, b), eps=1e-6, atol=1e-5, rtol=1e-3)


def _fill(args, x, w, b):
    it = iter(args)
    return [next(it) if t is not None else None for t in (x, w, b)]


# ---- torch.library.opcheck ------------------------------------------------------------------------
def _opcheck_cases():
    cases = []
    for op in OPS:
        for params in (True, False):
            cases.append((op, params))
    return cases


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[gpu, requires_cuda])])
@pytest.mark.parametrize("op,params", _opcheck_cases(), ids=lambda v: str(v))
def test_opcheck(op, params, device):
    x, w, b = make_inputs(op, 8, torch.float32, device, weight=params, bias=params)
    x.requires_grad_()
    if w is not None:
        w.requires_grad_()
    if b is not None:
        b.requires_grad_()
    lib = torch.ops.fastweight
    if op == "layernorm":
        fwd_args = (x, w, b, 1e-5, 0.5)
        torch.library.opcheck(lib.layernorm_fwd.default, fwd_args)
        _, mean, rstd = lib.layernorm_fwd(*fwd_args)
        bwd_args = (torch.randn_like(x), x.detach(), _det(w), mean, rstd, 0.5, b is not None)
        torch.library.opcheck(lib.layernorm_bwd.default, bwd_args)
    elif op == "headnorm":
        fwd_args = (x, w, b, 1e-6, 1.0)
        torch.library.opcheck(lib.headnorm_fwd.default, fwd_args)
        _, mean, rstd = lib.headnorm_fwd(*fwd_args)
        bwd_args = (torch.randn_like(x), x.detach(), _det(w), mean, rstd, 1.0, b is not None)
        torch.library.opcheck(lib.headnorm_bwd.default, bwd_args)
    elif op == "rmsnorm":
        fwd_args = (x, w, 1e-6, 0.25)
        torch.library.opcheck(lib.rmsnorm_fwd.default, fwd_args)
        _, rstd = lib.rmsnorm_fwd(*fwd_args)
        torch.library.opcheck(lib.rmsnorm_bwd.default, (torch.randn_like(x), x.detach(), _det(w), rstd, 0.25))
    else:
        fwd_args = (x, w, b, 1e-5)
        torch.library.opcheck(lib.adalayernorm_fwd.default, fwd_args)
        _, mean, rstd = lib.adalayernorm_fwd(*fwd_args)
        bwd_args = (torch.randn_like(x), x.detach(), w.detach(), mean, rstd, b is not None)
        torch.library.opcheck(lib.adalayernorm_bwd.default, bwd_args)


def _det(t):
    return None if t is None else t.detach()


# ---- torch.compile(fullgraph=True) --------------------------------------------------------------
def _all_ops(x, w, b, h, hw, hb, a, sc, sh):
    y1 = fastweight.layer_norm(x, w, b)
    y2 = fastweight.rms_norm(y1 * 2, w)
    y3 = fastweight.head_norm(h, hw, hb, weight_offset=1.0)
    y4 = fastweight.adaptive_layer_norm(a, sc, sh)
    return y2.square().sum() + y3.square().sum() + y4.sin().sum()


def _all_ops_inputs(device, dtype=torch.float32):
    gen = torch.Generator().manual_seed(5)

    def r(*s):
        return torch.randn(s, generator=gen).to(device=device, dtype=dtype).requires_grad_()

    return (r(6, 16), r(16), r(16), r(2, 3, 4, 8), r(4, 8), r(4, 8), r(2, 5, 16), r(2, 1, 16), r(2, 1, 16))


def _check_compiled(device, backend):
    torch._dynamo.reset()
    args = _all_ops_inputs(device)
    compiled = torch.compile(_all_ops, fullgraph=True, backend=backend)
    out = compiled(*args)
    grads = torch.autograd.grad(out, args)
    out_e = _all_ops(*args)
    grads_e = torch.autograd.grad(out_e, args)
    assert_rel(out, out_e, 1e-5, "compiled loss")
    for i, (g, ge) in enumerate(zip(grads, grads_e)):
        assert_rel(g, ge, 1e-5, f"compiled grad {i}")


def test_compile_fullgraph_cpu():
    """All four ops, forward and backward, in one graph through inductor (fake kernels, autograd)."""
    _check_compiled("cpu", "inductor")


@pytest.mark.parametrize("op", OPS)
def test_compile_fullgraph_each_op(op):
    torch._dynamo.reset()
    x, w, b = make_inputs(op, 12, torch.float32, bias=op != "rmsnorm")
    x, w, b = [t.requires_grad_() if t is not None else None for t in (x, w, b)]
    f = lambda x, w, b: fw_forward(op, x, w, b, EPS[op]).square().sum()
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(x, w, b)
    g = torch.autograd.grad(out, leaves_of(x, w, b))
    out_e = f(x, w, b)
    g_e = torch.autograd.grad(out_e, leaves_of(x, w, b))
    assert torch.equal(out, out_e)
    for a, e in zip(g, g_e):
        assert torch.equal(a, e)


# ---- torch.func.vmap -----------------------------------------------------------------------------
@pytest.mark.parametrize("op", OPS)
def test_vmap(op):
    """vmap over x alone (one call: the batch is more rows; in_dims 0 and 1), over x and the parameters
    (one call per sample: adaLN's scale is per sample anyway), over the raw backward, and autograd
    through a vmapped forward: the unbatched results, and no batching-rule fallback warning."""
    import warnings
    V = 3
    xs, ws, bs = zip(*(make_inputs(op, 12, torch.float64, bias=op != "rmsnorm", seed=s) for s in range(V)))
    X = torch.stack(xs)
    w, b = ws[0], bs[0]
    f = lambda x, w, b: fw_forward(op, x, w, b, EPS[op])  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's loop fallback warns; the registered rules do not
        if op != "adalayernorm":  # (adaLN's x and scale share their batch dim B: no "x alone")
            assert torch.equal(torch.func.vmap(lambda x: f(x, w, b))(X), torch.stack([f(x, w, b) for x in xs]))
            Xt = X.movedim(0, 1).contiguous()
            assert torch.equal(torch.func.vmap(lambda x: f(x, w, b), in_dims=1)(Xt), torch.stack([f(x, w, b) for x in xs]))
            Xl = X.movedim(0, -1).contiguous()  # the batch dim innermost: rows at a stride of V
            assert torch.equal(torch.func.vmap(lambda x: f(x, w, b), in_dims=-1)(Xl), torch.stack([f(x, w, b) for x in xs]))
        W = torch.stack(ws)
        B = torch.stack(bs) if bs[0] is not None else None
        got = torch.func.vmap(f, in_dims=(0, 0, 0 if B is not None else None))(X, W, B)
        assert torch.equal(got, torch.stack([f(x, wi, bi) for x, wi, bi in zip(xs, ws, bs)]))
        if op == "layernorm":
            y, mean, rstd = torch.func.vmap(lambda x: ops.layernorm_fwd(x, w, b, EPS[op]))(X)
            dY = torch.ones_like(X)
            dx = torch.func.vmap(lambda dy, x, m, r: ops.layernorm_bwd(dy, x, w, m, r)[0])(dY, X, mean, rstd)
            want = torch.stack([ops.layernorm_bwd(dY[i], xs[i], w, mean[i], rstd[i])[0] for i in range(V)])
            assert torch.equal(dx, want)
    # autograd through a vmapped forward: over x alone with a shared weight (adaLN: x and its scale)
    Xg = X.clone().requires_grad_()
    if op != "adalayernorm":
        wg = w.clone().requires_grad_()
        torch.func.vmap(lambda x: f(x, wg, b))(Xg).square().sum().backward()
        x2, w2 = [x.clone().requires_grad_() for x in xs], w.clone().requires_grad_()
        sum(f(x, w2, b).square().sum() for x in x2).backward()
        w_got, w_want = wg.grad, w2.grad
    else:
        Wg = torch.stack(ws).requires_grad_()
        torch.func.vmap(lambda x, s: f(x, s, None))(Xg, Wg).square().sum().backward()
        x2, w2 = [x.clone().requires_grad_() for x in xs], [wi.clone().requires_grad_() for wi in ws]
        sum(f(x, wi, None).square().sum() for x, wi in zip(x2, w2)).backward()
        w_got, w_want = Wg.grad, torch.stack([wi.grad for wi in w2])
    assert_rel(Xg.grad, torch.stack([x.grad for x in x2]), 1e-12, "dx through vmap")
    assert_rel(w_got, w_want, 1e-12, "dw through vmap")


@pytest.mark.parametrize("op", OPS)
def test_torch_func_grad(op):
    """torch.func.grad (x and the parameters), per-sample gradients (vmap of grad) and jacrev equal
    autograd's; a second derivative (hessian: forward-mode) raises instead of giving zeros."""
    V = 3
    xs, ws, bs = zip(*(make_inputs(op, 12, torch.float64, bias=op != "rmsnorm", seed=s) for s in range(V)))
    X, w, b = torch.stack(xs), ws[0], bs[0]  # (adaLN: w is the (B, 1, D) scale, b the shift)
    f = lambda x, w: fw_forward(op, x, w, b, EPS[op]).sin().sum()  # noqa: E731

    def autograd_grads(x, w):
        x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
        f(x, w).backward()
        return x.grad, w.grad

    gx, gw = torch.func.grad(f, argnums=(0, 1))(xs[0], w)
    ax, aw = autograd_grads(xs[0], w)
    assert_rel(gx, ax, 1e-12, "func.grad dx")
    assert_rel(gw, aw, 1e-12, "func.grad dw")
    per = torch.func.vmap(torch.func.grad(f, argnums=1), in_dims=(0, None))(X, w)
    assert_rel(per, torch.stack([autograd_grads(x, w)[1] for x in xs]), 1e-12, "per-sample dw")
    g = lambda r: fw_forward(op, r, w, b, EPS[op])  # noqa: E731
    J, Jr = torch.func.jacrev(g)(xs[0]), torch.autograd.functional.jacobian(g, xs[0])
    assert_rel(J, Jr, 1e-12, "jacrev")
    import warnings
    with pytest.raises((NotImplementedError, RuntimeError)), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (torch.jit.script's deprecation, inside torch.func)
        torch.func.hessian(lambda r: f(r, w))(xs[0])


# ---- strided inputs -----------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["strided", "every2", "transposed"])
@pytest.mark.parametrize("op", OPS)
def test_strided_inputs(op, layout):
    """Views with a contiguous last dim run without copies and give the bits of the contiguous copy."""
    x, w, b = make_inputs(op, 24, torch.float32, layout="contig" if layout == "transposed" else layout)
    if layout == "transposed":  # leading dims in the other order in memory
        x = x.transpose(0, -2).contiguous().transpose(0, -2)
    assert not x.is_contiguous()
    if op == "rmsnorm":
        b = None
    assert ops._last_contig(x) is x  # the functional API passes it as it is
    xs = x.detach().requires_grad_()
    xc = x.detach().contiguous().requires_grad_()
    gen = torch.Generator().manual_seed(2)
    dy = torch.randn(x.shape, generator=gen)
    dy_strided = torch.randn((*x.shape[:-1], x.shape[-1] + 2), generator=gen)[..., 1:-1]
    dy_strided.copy_(dy)
    ws = [t.detach().requires_grad_() if t is not None else None for t in (w, b)]
    wc = [t.detach().requires_grad_() if t is not None else None for t in (w, b)]
    ys = fw_forward(op, xs, *ws, EPS[op])
    yc = fw_forward(op, xc, *wc, EPS[op])
    assert torch.equal(ys, yc)
    gs = torch.autograd.grad(ys, leaves_of(xs, *ws), dy_strided)
    gc = torch.autograd.grad(yc, leaves_of(xc, *wc), dy)
    for a, c in zip(gs, gc):
        assert torch.equal(a, c)


@pytest.mark.parametrize("op", OPS)
def test_strided_params(op):
    """Parameters whose leading dim is strided (headnorm/adaLN) or cut from a buffer work as views."""
    x, w, b = make_inputs(op, 10, torch.float32, bias=op != "rmsnorm")
    wv = torch.zeros((*w.shape[:-1], w.shape[-1] + 4))[..., 2:-2]
    wv.copy_(w)
    y_view = fw_forward(op, x, wv, b, EPS[op])
    y_cont = fw_forward(op, x, w, b, EPS[op])
    assert torch.equal(y_view, y_cont)


def test_raw_op_strided_no_copy_and_last_dim_error():
    gen = torch.Generator().manual_seed(0)
    big = torch.randn(8, 40, generator=gen)
    x = big[:, 3:35]  # rows at stride 40
    y, mean, rstd = torch.ops.fastweight.layernorm_fwd(x, None, None, 1e-5, 0.0)
    y2, _, _ = torch.ops.fastweight.layernorm_fwd(x.contiguous(), None, None, 1e-5, 0.0)
    assert torch.equal(y, y2)
    xt = big[:, :32:2]  # last dim stride 2
    with pytest.raises(ValueError, match=r"layernorm_fwd: x: the last dimension must be contiguous"):
        torch.ops.fastweight.layernorm_fwd(xt, None, None, 1e-5, 0.0)
    # The functional API copies such an input instead.
    assert torch.equal(fastweight.layer_norm(xt), fastweight.layer_norm(xt.contiguous()))


@pytest.mark.parametrize("op", OPS)
def test_non_contiguous_last_dim_functional(op):
    x, w, b = make_inputs(op, 12, torch.float32, bias=op != "rmsnorm")
    xt = torch.stack([x, x], dim=-1)[..., 0]  # last-dim stride 2
    assert xt.stride(-1) == 2
    assert torch.equal(fw_forward(op, xt, w, b, EPS[op]), fw_forward(op, x, w, b, EPS[op]))


# ---- NumPy path ---------------------------------------------------------------------------------
NP_FWD = {"layernorm": fnp.layernorm_fwd, "rmsnorm": fnp.rmsnorm_fwd, "headnorm": fnp.headnorm_fwd,
          "adalayernorm": fnp.adalayernorm_fwd}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("op", OPS)
def test_numpy_equals_torch(op, dtype):
    x, w, b = make_inputs(op, 21, dtype, bias=op != "rmsnorm", layout="strided")
    xn, wn = x.numpy(), w.numpy()
    bn = b.numpy() if b is not None else None
    assert not xn.flags.c_contiguous
    eps = EPS[op]
    # functional API with numpy arrays returns a numpy array, equal to the torch path bit for bit
    y_np = fw_forward(op, xn, wn, bn, eps)
    y_t = fw_forward(op, x, w, b, eps)
    assert isinstance(y_np, np.ndarray) and y_np.dtype == xn.dtype and y_np.shape == xn.shape
    np.testing.assert_array_equal(y_np, y_t.numpy())
    # low-level forward and backward
    gen = torch.Generator().manual_seed(4)
    dy = torch.randn(x.shape, generator=gen).to(dtype)
    if op == "rmsnorm":
        y1, rstd = fnp.rmsnorm_fwd(xn, wn, eps)
        dx, dw = fnp.rmsnorm_bwd(dy.numpy(), xn, wn, rstd)
        yt, rstd_t = ops.rmsnorm_fwd(x, w, eps)
        dxt, dwt = ops.rmsnorm_bwd(dy, x, w, rstd_t)
        got, want = (y1, rstd, dx, dw), (yt, rstd_t, dxt, dwt)
    else:
        fwd_np = NP_FWD[op]
        bwd_np = {"layernorm": fnp.layernorm_bwd, "headnorm": fnp.headnorm_bwd}.get(op)
        if op == "adalayernorm":
            y1, mean, rstd = fwd_np(xn, wn, bn, eps)
            dx, dw, db = fnp.adalayernorm_bwd(dy.numpy(), xn, wn, mean, rstd, has_shift=True)
            yt, mean_t, rstd_t = ops.adalayernorm_fwd(x, w, b, eps)
            dxt, dwt, dbt = ops.adalayernorm_bwd(dy, x, w, mean_t, rstd_t, has_shift=True)
        else:
            y1, mean, rstd = fwd_np(xn, wn, bn, eps)
            dx, dw, db = bwd_np(dy.numpy(), xn, wn, mean, rstd, has_bias=True)
            fwd_t = ops.layernorm_fwd if op == "layernorm" else ops.headnorm_fwd
            bwd_t = ops.layernorm_bwd if op == "layernorm" else ops.headnorm_bwd
            yt, mean_t, rstd_t = fwd_t(x, w, b, eps)
            dxt, dwt, dbt = bwd_t(dy, x, w, mean_t, rstd_t, has_bias=True)
        got, want = (y1, mean, rstd, dx, dw, db), (yt, mean_t, rstd_t, dxt, dwt, dbt)
    for g, t in zip(got, want):
        assert isinstance(g, np.ndarray)
        np.testing.assert_array_equal(g, t.numpy())


def test_numpy_read_only_and_no_weight():
    x = np.random.default_rng(0).standard_normal((5, 9)).astype(np.float32)
    x.flags.writeable = False
    y = fastweight.layer_norm(x)
    ref = ref_forward("layernorm", torch.from_numpy(x.copy()), eps=1e-5).numpy()
    assert rel_err(torch.from_numpy(y), torch.from_numpy(ref)) < 1e-6
    y = fastweight.rms_norm(x)
    ref = ref_forward("rmsnorm", torch.from_numpy(x.copy()), eps=1e-6).numpy()
    assert rel_err(torch.from_numpy(y), torch.from_numpy(ref)) < 1e-6
    # a last dimension that is not contiguous is copied
    xt = np.asfortranarray(x)
    np.testing.assert_array_equal(fastweight.layer_norm(xt), fastweight.layer_norm(x))


def test_import_without_torch():
    """The package imports and runs its NumPy path when torch cannot be imported."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import numpy as np, fastweight\n"
        "assert not hasattr(fastweight, 'ops') and 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "x = np.arange(12, dtype=np.float32).reshape(3, 4)\n"
        "y = fastweight.layer_norm(x)\n"
        "assert y.shape == (3, 4) and abs(float(y.sum())) < 1e-4\n"
        "try:\n"
        "    fastweight.layer_norm([[1.0, 2.0]])\n"
        "except TypeError as e:\n"
        "    assert 'PyTorch is not installed' in str(e)\n"
        "else:\n"
        "    raise AssertionError('no TypeError')\n"
        "print('ok')\n"
    )
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


# ---- bad input: ValueError naming the argument --------------------------------------------------
def test_bad_inputs_value_error():
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match=r"layernorm_fwd: weight: expected shape \(16\)"):
        fastweight.layer_norm(x, torch.ones(15))
    with pytest.raises(ValueError, match=r"layernorm_fwd: weight: expected dtype float32 \(that of x\), got float16"):
        fastweight.layer_norm(x, torch.ones(16, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"layernorm_fwd: bias: expected dtype"):
        fastweight.layer_norm(x.half(), torch.ones(16, dtype=torch.float16), torch.zeros(16))
    with pytest.raises(ValueError, match=r"layernorm_fwd: x: the normalised \(last\) dimension is empty"):
        fastweight.layer_norm(torch.randn(4, 0))
    with pytest.raises(ValueError, match=r"rmsnorm_fwd: x: dtype int32 is not supported"):
        fastweight.rms_norm(torch.ones(4, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"rmsnorm_fwd: weight: expected shape"):
        fastweight.rms_norm(x, torch.ones(4, 16))
    with pytest.raises(ValueError, match=r"headnorm_fwd: weight: expected shape \(3, 8\)"):
        fastweight.head_norm(torch.randn(2, 3, 8), torch.ones(8))
    with pytest.raises(ValueError, match=r"headnorm_fwd: x: expected shape \(\.\.\., NH, DH\)"):
        fastweight.head_norm(torch.randn(8))
    with pytest.raises(ValueError, match=r"adalayernorm_fwd: scale: expected shape \(2, 1, 8\)"):
        fastweight.adaptive_layer_norm(torch.randn(2, 3, 8), torch.ones(3, 1, 8), torch.zeros(3, 1, 8))
    with pytest.raises(ValueError, match=r"adalayernorm_fwd: shift: expected shape \(2, 1, 8\)"):
        fastweight.adaptive_layer_norm(torch.randn(2, 3, 8), torch.ones(2, 1, 8), torch.zeros(1, 1, 8))
    with pytest.raises(ValueError, match=r"adalayernorm_fwd: x: expected shape \(B, S, D\)"):
        fastweight.adaptive_layer_norm(torch.randn(3, 8), torch.ones(1, 1, 8), None)
    with pytest.raises(ValueError, match=r"layernorm_fwd: eps: expected a finite value"):
        fastweight.layer_norm(x, eps=float("nan"))
    # numpy path: the same messages
    with pytest.raises(ValueError, match=r"layernorm_fwd: weight: expected shape \(16\)"):
        fastweight.layer_norm(x.numpy(), np.ones(15, np.float32))
    with pytest.raises(ValueError, match=r"layernorm_fwd: x: dtype int64 is not supported"):
        fastweight.layer_norm(np.ones((2, 3), np.int64))


def test_bad_inputs_raw_binding():
    """The binding names the argument for dtypes it cannot represent; the C++ API for the rest."""
    x = np.ones((2, 4), np.float32)
    y = np.empty_like(x)
    with pytest.raises(ValueError, match=r"layernorm_fwd: y: dtype complex64 is not supported"):
        _C.layernorm_fwd(x, None, None, y.astype(np.complex64), None, None)
    with pytest.raises(ValueError, match=r"layernorm_fwd: mean: expected dtype float32, got float64"):
        _C.layernorm_fwd(x, None, None, y, np.empty(2, np.float64), None)
    with pytest.raises(ValueError, match=r"layernorm_fwd: rstd: expected 2 elements"):
        _C.layernorm_fwd(x, None, None, y, None, np.empty(3, np.float32))
    with pytest.raises(ValueError, match=r"layernorm_fwd: y: expected shape \(2, 4\)"):
        _C.layernorm_fwd(x, None, None, np.empty((2, 5), np.float32), None, None)
    mean, rstd = np.zeros(2, np.float32), np.ones(2, np.float32)
    with pytest.raises(ValueError, match=r"layernorm_bwd: dweight: given, but weight is absent"):
        _C.layernorm_bwd(x, x, None, mean, rstd, y, np.empty(4, np.float32), None)
    with pytest.raises(ValueError, match=r"rmsnorm_bwd: dx: expected dtype float32"):
        _C.rmsnorm_bwd(x, x, None, rstd, np.zeros((2, 4), np.float16))
    with pytest.raises(TypeError):
        _C.layernorm_fwd("not an array", None, None, y, None, None)
    assert _C.layernorm_bwd_workspace_size(x, x, None, mean, rstd, y) == 0  # CPU: no workspace


def test_outputs_untouched_on_error():
    x = torch.randn(3, 8)
    y = torch.full_like(x, 7.0)
    with pytest.raises(ValueError):
        _C.layernorm_fwd(x, torch.ones(8), torch.zeros(7), y, None, None)
    assert torch.all(y == 7.0)


# ---- every output element is written (poisoned outputs) -----------------------------------------
def _poison_run(op, x, w, b, device):
    """Run fwd and bwd through _C with NaN-filled outputs; return them."""
    nan = float("nan")
    f32 = dict(dtype=torch.float32, device=device)
    y = torch.full(x.shape, nan, dtype=x.dtype, device=device)
    mean = torch.full(x.shape[:-1], nan, **f32)
    rstd = torch.full(x.shape[:-1], nan, **f32)
    dy = torch.randn_like(x)
    dx = torch.full_like(y, nan)
    dw = torch.full_like(w, nan) if w is not None else None
    db = torch.full_like(b, nan) if b is not None else None
    s = torch.cuda.current_stream(device).cuda_stream if device != "cpu" else 0
    if op == "rmsnorm":
        _C.rmsnorm_fwd(x, w, y, rstd, 1e-6, 0.0, s)
        args = (dy, x, w, rstd, dx, dw, 0.0)
        n = _C.rmsnorm_bwd_workspace_size(*args)
        ws = torch.full((n,), 255, dtype=torch.uint8, device=device) if n else None
        _C.rmsnorm_bwd(*args, ws, s)
        return [y, rstd, dx] + leaves_of(dw)
    fwd = getattr(_C, f"{op}_fwd")
    if op == "adalayernorm":
        fwd(x, w, b, y, mean, rstd, 1e-5, s)
        args = (dy, x, w, mean, rstd, dx, dw, db)
    else:
        fwd(x, w, b, y, mean, rstd, 1e-5, 0.0, s)
        args = (dy, x, w, mean, rstd, dx, dw, db, 0.0)
    n = getattr(_C, f"{op}_bwd_workspace_size")(*args)
    ws = torch.full((n,), 255, dtype=torch.uint8, device=device) if n else None
    getattr(_C, f"{op}_bwd")(*args, ws, s)
    return [y, mean, rstd, dx] + leaves_of(dw, db)


@pytest.mark.parametrize("op", OPS)
def test_poisoned_outputs_cpu(op):
    x, w, b = make_inputs(op, 13, torch.float32, bias=op != "rmsnorm")
    for t in _poison_run(op, x, w, b, "cpu"):
        assert torch.isfinite(t).all()


# ---- nn modules ---------------------------------------------------------------------------------
def test_nn_modules():
    x = torch.randn(2, 5, 32)
    ln = fastweight.nn.LayerNorm(32)
    ref = torch.nn.LayerNorm(32)
    assert torch.allclose(ln(x), ref(x), atol=1e-5)
    assert set(dict(ln.named_parameters())) == {"weight", "bias"}
    assert set(ln.state_dict()) == set(ref.state_dict())
    ln.load_state_dict(ref.state_dict())
    assert fastweight.nn.LayerNorm(32, bias=False).bias is None
    nb = fastweight.nn.LayerNorm((32,), elementwise_affine=False)
    assert nb.weight is None and nb.bias is None and len(list(nb.parameters())) == 0
    assert torch.allclose(nb(x), torch.nn.functional.layer_norm(x, (32,)), atol=1e-5)
    with pytest.raises(ValueError, match="normalized_shape"):
        fastweight.nn.LayerNorm((4, 32))

    rms = fastweight.nn.RMSNorm(32, dtype=torch.float64)
    assert rms.weight.dtype == torch.float64 and torch.all(rms.weight == 1)
    y = rms(x.double())
    assert_rel(y, ref_forward("rmsnorm", x, rms.weight, eps=1e-6), 1e-12, "RMSNorm")

    hn = fastweight.nn.HeadNorm(4, 8, weight_offset=1.0)
    assert torch.all(hn.weight == 0) and torch.all(hn.bias == 0) and hn.weight.shape == (4, 8)
    assert torch.all(fastweight.nn.HeadNorm(4, 8).weight == 1)
    assert fastweight.nn.HeadNorm(4, 8, bias=False).bias is None
    xh = torch.randn(2, 3, 4, 8, requires_grad=True)
    yh = hn(xh)
    assert_rel(yh, ref_forward("headnorm", xh.detach(), eps=1e-6), 1e-6, "HeadNorm at init")
    yh.square().sum().backward()
    assert hn.weight.grad.shape == (4, 8) and hn.bias.grad.shape == (4, 8)

    ada = fastweight.nn.AdaptiveLayerNorm()
    xa, sc, sh = torch.randn(2, 3, 16), torch.randn(2, 1, 16), torch.randn(2, 1, 16)
    assert_rel(ada(xa, sc, sh), ref_forward("adalayernorm", xa, sc, sh, eps=1e-5), 1e-6, "AdaptiveLayerNorm")
    assert "eps" in repr(ada) and "weight_offset=1.0" in repr(hn)


def test_build_info():
    assert isinstance(fastweight.build_info(), str) and fastweight.build_info()
    assert fastweight.cuda_available() == _C.cuda_available()
    assert isinstance(fastweight.cuda_available(), bool)
    if not CUDA:
        assert not fastweight.cuda_available()
    assert fastweight.__version__ == "0.1.0"


# =================================================================================================
# GPU tests: the CUDA kernels against the float64 CPU reference. Skipped without a CUDA device.
# =================================================================================================
GPU_NS = [1, 7, 100, 1000, 4097, 65536]


def _gpu_rows(n):
    return max(6, min(300, (1 << 21) // n))


@gpu
@requires_cuda
@pytest.mark.parametrize("layout", ["contig", "strided"])
@pytest.mark.parametrize("n", GPU_NS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("op", OPS)
def test_cuda_vs_reference(op, dtype, n, layout):
    x, w, b = make_inputs(op, n, dtype, "cuda", rows=_gpu_rows(n), bias=op != "rmsnorm",
                          layout=layout, seed=n)
    check_against_reference(op, x, w, b)


@gpu
@requires_cuda
@pytest.mark.parametrize("op,config", [(op, c) for op in OPS for c in ("none", "f32-params", "offset")
                                       if not (c == "offset" and op == "adalayernorm")])
def test_cuda_param_configs(op, config):
    for dtype in DTYPES:
        if config == "f32-params" and dtype == torch.float32:
            continue
        kw = _config_kwargs(op, config, dtype)
        x, w, b = make_inputs(op, 1000, dtype, "cuda", rows=64, **kw)
        if op == "rmsnorm":
            b = None
        check_against_reference(op, x, w, b, weight_offset=kw.get("weight_offset", 0.0))


@gpu
@requires_cuda
@pytest.mark.parametrize("op", OPS)
def test_cuda_poisoned_outputs(op):
    for n in (7, 1000, 4097):
        for dtype in DTYPES:
            x, w, b = make_inputs(op, n, dtype, "cuda", rows=64, bias=op != "rmsnorm", layout="strided")
            for t in _poison_run(op, x, w, b, "cuda"):
                assert torch.isfinite(t).all(), f"{op} n={n} {dtype}: an output element was not written"


@gpu
@requires_cuda
@pytest.mark.parametrize("op", OPS)
def test_cuda_determinism(op):
    """Two runs give the same bits, weight gradients included (many rows: multi-block reductions)."""
    x, w, b = make_inputs(op, 1000, torch.bfloat16, "cuda", rows=8192, bias=op != "rmsnorm")
    dy = torch.randn_like(x)

    def run():
        leaves = [t.detach().requires_grad_() if t is not None else None for t in (x, w, b)]
        y = fw_forward(op, *leaves, EPS[op])
        return [y] + list(torch.autograd.grad(y, leaves_of(*leaves), dy))

    a, c = run(), run()
    for i, (u, v) in enumerate(zip(a, c)):
        assert torch.equal(u, v), f"{op}: output {i} differs between two runs"


@gpu
@requires_cuda
@pytest.mark.parametrize("op", OPS)
def test_cuda_graph_capture(op):
    """Capture fwd+bwd in a CUDA graph; replay on new data equals eager bit for bit."""
    x, w, b = make_inputs(op, 1000, torch.bfloat16, "cuda", rows=512, bias=op != "rmsnorm")
    sx = x.detach().clone().requires_grad_()
    sw = w.detach().clone().requires_grad_()
    sb = b.detach().clone().requires_grad_() if b is not None else None
    sdy = torch.randn_like(x)

    def step(x, w, b, dy):
        y = fw_forward(op, x, w, b, EPS[op])
        return [y] + list(torch.autograd.grad(y, leaves_of(x, w, b), dy))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(sx, sw, sb, sdy)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):  # the stream of the warm-up (autograd keeps it)
        static_out = step(sx, sw, sb, sdy)

    x2, w2, b2 = make_inputs(op, 1000, torch.bfloat16, "cuda", rows=512, bias=op != "rmsnorm", seed=9)
    with torch.no_grad():
        sx.copy_(x2)
        sw.copy_(w2)
        if sb is not None:
            sb.copy_(b2)
        sdy.copy_(torch.randn_like(sdy))
    graph.replay()
    torch.cuda.synchronize()
    # eager on fresh leaves (the static ones belong to the side stream's autograd nodes)
    fresh = [t.detach().clone().requires_grad_() if t is not None else None for t in (sx, sw, sb)]
    eager = step(*fresh, sdy.clone())
    for i, (g, e) in enumerate(zip(static_out, eager)):
        assert torch.equal(g, e), f"{op}: graph output {i} differs from eager"


@gpu
@requires_cuda
def test_cuda_compile_fullgraph():
    _check_compiled("cuda", "inductor")


@gpu
@requires_cuda
def test_cuda_side_stream():
    """The ops run on torch's current stream (not the legacy default stream)."""
    x, w, b = make_inputs("layernorm", 4097, torch.float32, "cuda", rows=256)
    ref = fastweight.layer_norm(x, w, b)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(1_000_000)  # keep the stream busy: a wrong-stream launch would race
        xs = x * 1.0
        y = fastweight.layer_norm(xs, w, b)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(y, ref)


@gpu
@requires_cuda
def test_cuda_bad_inputs():
    x = torch.randn(4, 16, device="cuda")
    with pytest.raises(ValueError, match=r"layernorm_fwd: weight: expected device cuda:0 \(that of x\), got cpu"):
        fastweight.layer_norm(x, torch.ones(16))
    with pytest.raises(ValueError, match=r"layernorm_fwd: x: dtype float64 is not supported on cuda:0"):
        fastweight.layer_norm(x.double())
