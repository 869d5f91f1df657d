"""Tests of the Python mLSTM layer (fastweight.mlstm & co, fastweight.compat.mlstm_kernels).

Every result is compared with an independent float64 PyTorch implementation of MATH.md §2 written
below (the recurrent form, step by step; gradients by float64 autograd of it), by relative Frobenius
error. CPU tests run the C++ reference through the binding. CUDA tensors must raise a clear error
until the CUDA kernels land (tests marked `gpu`, skipped without a GPU).
"""

from __future__ import annotations

import math

import pytest
import torch

import fastweight
from fastweight.compat import mlstm_kernels as mk
from fwtest_util import rel_err, same_bits_twice_and_in_a_graph

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device")
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


# ---- the float64 reference (independent of fastweight) ------------------------------------------
def ref_mlstm(q, k, v, i, f, c0=None, n0=None, m0=None, eps=1e-6, detach_m=False, extras=None):
    """MATH.md §2, recurrent form, float64, differentiable: h (B, NH, S, DV), (c, n, m (B, NH, 1)).
    detach_m: the stabiliser m_t carries no gradient (what TFLA-style backwards compute); extras: a
    dict that receives the per-step m_t and den_t (B, NH, S)."""
    q, k, v, i, f = (t.double() for t in (q, k, v, i, f))
    B, NH, S, DQK = q.shape
    DV = v.shape[-1]
    c = c0.double() if c0 is not None else q.new_zeros(B, NH, DQK, DV)
    n = n0.double() if n0 is not None else q.new_zeros(B, NH, DQK)
    m = m0.double().reshape(B, NH) if m0 is not None else q.new_zeros(B, NH)
    lf = torch.nn.functional.logsigmoid(f)
    hs, ms, dens = [], [], []
    for t in range(S):
        m_new = torch.maximum(lf[:, :, t] + m, i[:, :, t])
        if detach_m:
            m_new = m_new.detach()
        fa = torch.exp(lf[:, :, t] + m - m_new)
        ia = torch.exp(i[:, :, t] - m_new)
        kt, vt = k[:, :, t], v[:, :, t]
        c = fa[..., None, None] * c + ia[..., None, None] * kt[..., :, None] * vt[..., None, :]
        n = fa[..., None] * n + ia[..., None] * kt
        qs = q[:, :, t] / math.sqrt(DQK)
        num = torch.einsum("bhd,bhde->bhe", qs, c)
        den = torch.maximum((qs * n).sum(-1).abs(), torch.exp(-m_new)) + eps
        hs.append(num / den[..., None])
        ms.append(m_new)
        dens.append(den)
        m = m_new
    if extras is not None:
        extras["m"], extras["den"] = torch.stack(ms, 2), torch.stack(dens, 2)
    return torch.stack(hs, dim=2), (c, n, m[..., None])


def make(B=2, NH=3, S=37, DQK=8, DV=5, dtype=torch.float64, states=False, seed=0, device="cpu", strong=False):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    q, k, v = r(B, NH, S, DQK), r(B, NH, S, DQK), r(B, NH, S, DV)
    i = r(B, NH, S) * (20.0 if strong else 2.0)
    f = r(B, NH, S) * 2.0 + (-20.0 if strong else 3.0)
    out = [t.to(dtype=dtype, device=device) for t in (q, k, v, i, f)]
    if states:
        out += [r(B, NH, DQK, DV).float().to(device), r(B, NH, DQK).float().to(device),
                r(B, NH, 1).float().to(device)]
    return out


# ---- forward ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("states", [False, True])
@pytest.mark.parametrize("S,chunk", [(1, 16), (37, 16), (64, 64), (100, 32)])
def test_forward_matches_reference(dtype, states, S, chunk):
    args = make(S=S, dtype=dtype, states=states)
    h, (c, n, m) = fastweight.mlstm(*args[:5], *args[5:], return_last_states=True, chunk_size=chunk)
    rh, (rc, rn, rm) = ref_mlstm(*args)
    assert h.dtype == dtype and h.shape == args[2].shape
    assert c.dtype == n.dtype == m.dtype == torch.float32 and m.shape == (2, 3, 1)
    assert rel_err(h, rh) < TOL[dtype]
    for a, b in ((c, rc), (n, rn), (m, rm)):
        assert rel_err(a, b) < 1e-5


def test_strong_gates_stay_finite():
    args = make(S=50, strong=True)
    h, (c, n, m) = fastweight.mlstm(*args, return_last_states=True, chunk_size=16)
    rh, _ = ref_mlstm(*args)
    assert rel_err(h, rh) < 1e-10  # rel_err also asserts finiteness


def test_strided_inputs_and_sequence_split():
    q, k, v, i, f = make(S=40)
    big = torch.randn(2, 3, 40, 16, dtype=torch.float64)
    big[..., ::2] = q  # q as a strided view (last dim stride 2): the functional API copies it
    qv = big[..., ::2]
    assert qv.stride(-1) == 2
    h = fastweight.mlstm(qv, k, v, i, f, chunk_size=16)
    assert rel_err(h, ref_mlstm(q, k, v, i, f)[0]) < 1e-10
    # Two calls joined through the states == one call.
    h1, st = fastweight.mlstm(q[:, :, :17], k[:, :, :17], v[:, :, :17], i[:, :, :17], f[:, :, :17],
                              return_last_states=True, chunk_size=16)
    h2 = fastweight.mlstm(q[:, :, 17:], k[:, :, 17:], v[:, :, 17:], i[:, :, 17:], f[:, :, 17:], *st, chunk_size=16)
    assert rel_err(torch.cat([h1, h2], dim=2), h) < 1e-6  # states pass through float32


# ---- backward -----------------------------------------------------------------------------------
def test_gradcheck_float64():
    args = [t.requires_grad_() for t in make(B=1, NH=2, S=13, DQK=4, DV=3)]
    assert torch.autograd.gradcheck(lambda *a: fastweight.mlstm(*a, chunk_size=16), args)


def test_gradcheck_with_states_both_ways():
    q, k, v, i, f, c0, n0, m0 = make(B=1, NH=1, S=9, DQK=3, DV=2, states=True)
    c0, n0, m0 = c0.double(), n0.double(), m0.double()  # float64 states on the CPU for gradcheck
    args = [t.requires_grad_() for t in (q, k, v, i, f, c0, n0, m0)]

    def fn(*a):
        h, (c, n, m) = fastweight.mlstm(*a[:5], *a[5:], return_last_states=True, chunk_size=16)
        return h, c, n
    # The API keeps states in float32: compare against the float64 reference's autograd instead.
    h, c, n = fn(*args)
    rh, (rc, rn, _) = ref_mlstm(*args)
    g = torch.Generator().manual_seed(1)
    wh, wc, wn = (torch.randn(t.shape, generator=g, dtype=torch.float64) for t in (rh, rc, rn))
    got = torch.autograd.grad((h * wh).sum() + (c.double() * wc).sum() + (n.double() * wn).sum(), args)
    want = torch.autograd.grad((rh * wh).sum() + (rc * wc).sum() + (rn * wn).sum(), args)
    for name, a, b in zip("q k v i f c0 n0 m0".split(), got, want):
        assert rel_err(a, b) < 1e-5, name  # float32 states on the way


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_gradients_match_reference_autograd(dtype):
    args = [t.requires_grad_() for t in make(S=29, dtype=dtype)]
    h = fastweight.mlstm(*args, chunk_size=16)
    dh = torch.randn(h.shape, dtype=torch.float64)
    got = torch.autograd.grad((h.double() * dh).sum(), args)
    ref_args = [t.detach().double().requires_grad_() for t in args]
    want = torch.autograd.grad((ref_mlstm(*ref_args)[0] * dh).sum(), ref_args)
    for name, a, b in zip("qkvif", got, want):
        assert a.dtype == dtype
        assert rel_err(a, b) < max(TOL[dtype], 1e-9) * (5 if dtype == torch.bfloat16 else 1), name


def test_normaliser_gradient_is_kept():
    """mlstm_kernels drops d h / d n; fastweight must not: with a tiny DQK the normaliser is active."""
    args = [t.requires_grad_() for t in make(B=1, NH=1, S=8, DQK=2, DV=2)]
    h = fastweight.mlstm(*args, chunk_size=16)
    got = torch.autograd.grad(h.sum(), args)
    ref_args = [t.detach().requires_grad_() for t in args]
    want = torch.autograd.grad(ref_mlstm(*ref_args)[0].sum(), ref_args)
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-10


@pytest.mark.parametrize("iscale,fshift,eps", [(2.0, 3.0, 1e-6), (20.0, -20.0, 1e-6), (3.0, 0.0, 0.3), (2.0, 3.0, 0.0)])
def test_exact_gradient_is_stabiliser_free_part_plus_eps_correction(iscale, fshift, eps):
    """The design of the CUDA backward (docs/design/mlstm_backward.md): the exact gradient equals the
    gradient with every stabiliser m_t held constant (what TFLA-style backwards compute) plus the
    gradient of sum_t c_t m_t, with c_t = -eps (dh_t . h_t) / den_t and, at the last step, also
    dm_last - <dc_last, c_last> - <dn_last, n_last>: a scalar reverse scan through
    m_t = max(lf_t + m_{t-1}, i_t). Checked on this file's independent reference, with states."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 9, d, generator=g, dtype=torch.float64, requires_grad=True) for d in (4, 4, 3))
    i = (torch.randn(1, 2, 9, generator=g, dtype=torch.float64) * iscale).requires_grad_()
    f = (torch.randn(1, 2, 9, generator=g, dtype=torch.float64) + fshift).requires_grad_()
    c0, n0, m0 = (torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)
                  for s in ((1, 2, 4, 3), (1, 2, 4), (1, 2, 1)))
    dh, dc, dn, dm = (torch.randn(*s, generator=g, dtype=torch.float64)
                      for s in ((1, 2, 9, 3), (1, 2, 4, 3), (1, 2, 4), (1, 2, 1)))
    args = (q, k, v, i, f, c0, n0, m0)

    def grads(out):
        gs = torch.autograd.grad(out, args, allow_unused=True)
        return [x if x is not None else torch.zeros_like(a) for x, a in zip(gs, args)]
    h, st = ref_mlstm(*args, eps=eps)
    exact = grads((h * dh).sum() + (st[0] * dc).sum() + (st[1] * dn).sum() + (st[2] * dm).sum())
    hd, sd = ref_mlstm(*args, eps=eps, detach_m=True)
    held = grads((hd * dh).sum() + (sd[0] * dc).sum() + (sd[1] * dn).sum())  # m_last held: no dm term
    ex = {}
    h, st = ref_mlstm(*args, eps=eps, extras=ex)
    c = (-eps * (dh * h).sum(-1) / ex["den"]).detach()
    c_last = (dm[..., 0] - (dc * st[0]).sum((-1, -2)) - (dn * st[1]).sum(-1)).detach()
    corr = grads((c * ex["m"]).sum() + (c_last * ex["m"][:, :, -1]).sum())
    for a, b, cc in zip(exact, held, corr):
        assert rel_err(b + cc, a) < 1e-12


# ---- head-norm variant, step, decay matrix ----------------------------------------------------------
def test_headnorm_variant():
    q, k, v, i, f = [t.requires_grad_() for t in make(S=21)]
    w = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    out = fastweight.mlstm_headnorm(q, k, v, i, f, w, b, chunk_size=16, norm_eps=1e-5, weight_offset=1.0)
    h = ref_mlstm(q, k, v, i, f)[0]
    mu = h.mean(-1, keepdim=True)
    ref = (h - mu) / torch.sqrt(((h - mu) ** 2).mean(-1, keepdim=True) + 1e-5) * (1.0 + w[:, None, :]) + b[:, None, :]
    assert rel_err(out, ref) < 1e-10
    dout = torch.randn(out.shape, dtype=torch.float64)
    got = torch.autograd.grad((out * dout).sum(), (q, k, v, i, f, w, b))
    want = torch.autograd.grad((ref * dout).sum(), (q, k, v, i, f, w, b))
    for a, c in zip(got, want):
        assert rel_err(a, c) < 1e-6  # the head norm saves float32 statistics (as on the GPU)


def test_step_matches_sequence_and_inplace():
    q, k, v, i, f, c0, n0, m0 = make(S=6, states=True, dtype=torch.float32)
    c, n, m = c0.clone(), n0.clone(), m0.clone()
    hs = []
    for t in range(6):
        h, (c, n, m) = fastweight.mlstm_step(q[:, :, t], k[:, :, t], v[:, :, t], i[:, :, t], f[:, :, t], c, n, m)
        hs.append(h)
    rh, (rc, rn, rm) = ref_mlstm(q, k, v, i, f, c0, n0, m0)
    assert rel_err(torch.stack(hs, 2), rh) < 1e-5
    assert rel_err(c, rc) < 1e-5 and rel_err(m, rm) < 1e-6
    # In place: the same numbers, written into the given state tensors; gates (B, NH, 1) accepted.
    ci, ni, mi = c0.clone(), n0.clone(), m0.clone()
    for t in range(6):
        h, st = fastweight.mlstm_step(q[:, :, t], k[:, :, t], v[:, :, t], i[:, :, t, None], f[:, :, t, None],
                                      ci, ni, mi, inplace=True)
        assert st[0] is ci
        assert torch.equal(h, hs[t])
    assert torch.equal(ci, c) and torch.equal(ni, n) and torch.equal(mi, m)


def test_decay_matrix():
    i = torch.randn(2, 3, 11, dtype=torch.float64, requires_grad=True)
    f = torch.randn(2, 3, 11, dtype=torch.float64, requires_grad=True)
    D = fastweight.mlstm_decay_matrix(i, f)
    F = torch.cumsum(torch.nn.functional.logsigmoid(f), -1)
    ref = F[..., :, None] - F[..., None, :] + i[..., None, :]
    mask = torch.ones(11, 11, dtype=torch.bool).tril()
    assert torch.isinf(D[..., ~mask]).all() and (D[..., ~mask] < 0).all()
    assert rel_err(D[..., mask], ref[..., mask]) < 1e-12
    assert torch.autograd.gradcheck(lambda i, f: fastweight.mlstm_decay_matrix(i, f).masked_fill(~mask, 0.0), (i, f))


# ---- parallel form (seed 000) ---------------------------------------------------------------------
def ref_parallel(q, k, v, i, f, eps=1e-6):
    """Seed 000's parallel form in float64 torch: h, and the normaliser n and stabiliser m per position."""
    q, k, v, i, f = (t.double() for t in (q, k, v, i, f))
    S, DQK = q.shape[2], q.shape[3]
    F = torch.cumsum(torch.nn.functional.logsigmoid(f), -1)
    D = F[..., :, None] - F[..., None, :] + i[..., None, :]
    D = D.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
    m = D.max(-1).values
    C = (q @ k.transpose(-1, -2)) / math.sqrt(DQK) * torch.exp(D - m[..., None])
    n = torch.maximum(C.sum(-1).abs(), torch.exp(-m))
    return (C @ v) / (n + eps)[..., None], n, m


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S", [1, 37])
def test_parallel_matches_reference_and_chunkwise(dtype, S):
    args = make(S=S, dtype=dtype)
    h, n, m = fastweight.mlstm_parallel(*args)
    rh, rn, rm = ref_parallel(*args)
    assert h.dtype == dtype and n.dtype == m.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert rel_err(h, rh) < TOL[dtype] and rel_err(n, rn) < TOL[torch.float32] and rel_err(m, rm) < TOL[torch.float32]
    # the chunkwise form gives the same h with eps = 0 (with eps > 0 the stabilisers, and so eps's weight, differ)
    h0 = fastweight.mlstm_parallel(*args, eps=0.0)[0]
    assert rel_err(h0, fastweight.mlstm(*args, eps=0.0, chunk_size=16)) < TOL[dtype]


def test_parallel_strong_gates_stay_finite():
    h, n, m = fastweight.mlstm_parallel(*make(S=50, dtype=torch.float32, strong=True))
    assert torch.isfinite(h).all() and torch.isfinite(n).all() and torch.isfinite(m).all()


def test_parallel_gradients():
    args = [t.requires_grad_() for t in make(B=1, NH=2, S=13, DQK=4, DV=3)]
    assert torch.autograd.gradcheck(lambda *a: fastweight.mlstm_parallel(*a)[0], args)
    # against float64 autograd of the independent formula; n and m carry no gradient
    h, n, m = fastweight.mlstm_parallel(*args)
    assert not n.requires_grad and not m.requires_grad
    dh = torch.randn_like(h)
    got = torch.autograd.grad(h, args, dh)
    want = torch.autograd.grad(ref_parallel(*args)[0], args, dh)
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-10


def test_parallel_opcheck_and_bad_input():
    args = [t.requires_grad_() for t in make(B=1, NH=2, S=9, DQK=4, DV=3)]
    torch.library.opcheck(torch.ops.fastweight.mlstm_parallel_fwd.default, (*args, 1e-6))
    q, k, v, i, f = make(S=8)
    with pytest.raises(ValueError, match=r"mlstm_parallel_fwd: f: expected shape \(2, 3, 8\)"):
        fastweight.mlstm_parallel(q, k, v, i, f[:, :, :7])
    with pytest.raises(ValueError, match="mlstm_parallel_fwd: eps: expected a finite value"):
        fastweight.mlstm_parallel(q, k, v, i, f, eps=float("nan"))


def ref_headnorm(h, weight, bias, eps=1e-6, offset=0.0):
    """Each (b, head, t) row of h (B, NH, S, DV) normalised over DV, in float64."""
    mu = h.mean(-1, keepdim=True)
    xhat = (h - mu) / torch.sqrt(h.var(-1, unbiased=False, keepdim=True) + eps)
    if weight is not None:
        xhat = xhat * (offset + weight.double()[None, :, None, :])
    return xhat + bias.double()[None, :, None, :] if bias is not None else xhat


def test_parallel_headnorm_matches_composition_with_gradients():
    q, k, v, i, f = (t.requires_grad_() for t in make(B=2, NH=3, S=13, DQK=4, DV=6))
    g = torch.Generator().manual_seed(3)
    w = (0.5 * torch.randn(3, 6, generator=g, dtype=torch.float64)).requires_grad_()
    b = torch.randn(3, 6, generator=g, dtype=torch.float64).requires_grad_()
    args = (q, k, v, i, f)
    out = fastweight.mlstm_parallel_headnorm(*args, w, b, norm_eps=1e-5, weight_offset=1.0)
    want = ref_headnorm(ref_parallel(*args)[0], w, b, 1e-5, 1.0)
    assert out.shape == v.shape and rel_err(out, want) < 1e-10
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(out, (*args, w, b), dout)
    exp = torch.autograd.grad(want, (*args, w, b), dout)
    for name, x, y in zip(["q", "k", "v", "i", "f", "weight", "bias"], got, exp):
        assert rel_err(x, y) < 1e-9, name
    small = [t.detach()[:1, :2, :7].clone().requires_grad_() for t in args[:2]] + \
        [args[2].detach()[:1, :2, :7, :3].clone().requires_grad_()] + \
        [t.detach()[:1, :2, :7].clone().requires_grad_() for t in args[3:]]
    assert torch.autograd.gradcheck(
        lambda *a: fastweight.mlstm_parallel_headnorm(*a[:5], a[5], a[6], weight_offset=1.0),
        (*small, w.detach()[:2, :3].clone().requires_grad_(), b.detach()[:2, :3].clone().requires_grad_()))
    # without weight and bias: the plain normalisation
    plain = fastweight.mlstm_parallel_headnorm(*args)
    assert rel_err(plain, ref_headnorm(ref_parallel(*args)[0], None, None)) < 1e-10


def test_parallel_headnorm_opcheck_and_bad_input():
    q, k, v, i, f = (t.requires_grad_() for t in make(B=1, NH=2, S=9, DQK=4, DV=3))
    w = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(torch.ops.fastweight.mlstm_parallel_headnorm_fwd.default,
                          (q, k, v, i, f, w, None, 1e-6, 1e-6, 1.0))
    with pytest.raises(ValueError, match=r"mlstm_parallel_fwd: norm_weight: expected shape \(2, 3\)"):
        fastweight.mlstm_parallel_headnorm(q, k, v, i, f, w[:, :2])
    with pytest.raises(ValueError, match="mlstm_parallel_fwd: norm_eps: expected a finite value"):
        fastweight.mlstm_parallel_headnorm(q, k, v, i, f, norm_eps=-1.0)


def test_parallel_compile_fullgraph_with_backward():
    """Both parallel ops trace into one graph (fake kernels, registered autograd) and match eager."""
    args = [t.requires_grad_() for t in make(B=1, NH=2, S=12, DQK=4, DV=4, dtype=torch.float32)]
    w = torch.randn(2, 4, requires_grad=True)

    def fn(q, k, v, i, f, w):
        h, n, m = fastweight.mlstm_parallel(q, k, v, i, f)
        out = fastweight.mlstm_parallel_headnorm(q, k, v, i, f, w, weight_offset=1.0)
        return (h * out).sum() + n.sum() + m.sum()

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got = compiled(*args, w)
    want = fn(*args, w)
    assert torch.equal(got, want)
    g1 = torch.autograd.grad(got, (*args, w))
    g2 = torch.autograd.grad(want, (*args, w))
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


@gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parallel_headnorm_cuda_matches_reference_with_gradients(dtype):
    cpu = [t.requires_grad_() for t in make(B=2, NH=2, S=70, DQK=32, DV=40, seed=5)]
    g = torch.Generator().manual_seed(4)
    w = (0.3 * torch.randn(2, 40, generator=g, dtype=torch.float64)).requires_grad_()
    b = torch.randn(2, 40, generator=g, dtype=torch.float64).requires_grad_()
    dev = [t.detach().to("cuda", dtype).requires_grad_() for t in cpu]
    wd, bd = w.detach().cuda().float().requires_grad_(), b.detach().cuda().float().requires_grad_()
    out = fastweight.mlstm_parallel_headnorm(*dev, wd, bd, weight_offset=1.0)
    rounded = [t.detach().to(dtype).double().requires_grad_() for t in cpu]
    want = ref_headnorm(ref_parallel(*rounded)[0], w.float().double(), b.float().double(), 1e-6, 1.0)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype and rel_err(out, want) < tol
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(out, (*dev, wd, bd), dout.to("cuda", dtype))
    exp = torch.autograd.grad(want, (*rounded, w, b), dout.to(dtype).double())
    for name, x, y in zip(["q", "k", "v", "i", "f", "weight", "bias"], got, exp):
        assert rel_err(x, y) < tol, name


@gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("S,DQK,DV", [(1, 8, 5), (63, 64, 64), (200, 48, 80)])
def test_parallel_cuda_matches_reference_with_gradients(dtype, S, DQK, DV):
    """The tiled CUDA kernels (mlstm_parallel.cu) against the float64 formula: h, n, m and every gradient."""
    cpu = [t.requires_grad_() for t in make(B=2, NH=2, S=S, DQK=DQK, DV=DV, seed=S)]
    dev = [t.detach().to("cuda", dtype).requires_grad_() for t in cpu]
    h, n, m = fastweight.mlstm_parallel(*dev)
    rounded = [t.detach().to(dtype).double().requires_grad_() for t in cpu]  # the reference sees the same inputs
    rh, rn, rm = ref_parallel(*rounded)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert h.dtype == dtype and n.dtype == m.dtype == torch.float32
    assert rel_err(h, rh) < tol and rel_err(n, rn) < 1e-3 and rel_err(m, rm) < 1e-5
    dh = torch.randn(h.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = torch.autograd.grad(h, dev, dh.to("cuda", dtype))
    want = torch.autograd.grad(rh, rounded, dh.to(dtype).double())
    for name, g, w in zip("qkvif", got, want):
        assert g.dtype == dtype and rel_err(g, w) < tol, name
    # deterministic: the same bits twice
    again = torch.autograd.grad(fastweight.mlstm_parallel(*dev)[0], dev, dh.to("cuda", dtype))
    assert all(torch.equal(a, b) for a, b in zip(got, again))


@gpu
@requires_cuda
def test_parallel_cuda_strong_gates_and_strided_views():
    q, k, v, i, f = make(B=1, NH=2, S=150, DQK=16, DV=12, strong=True)
    wide = torch.randn(1, 2, 150, 40, dtype=torch.float64)
    wide[..., 3:19] = q
    qd = wide.to("cuda", torch.float32)[..., 3:19]  # q as a strided view: rows of 40, last dim contiguous
    assert not qd.is_contiguous()
    h, n, m = fastweight.mlstm_parallel(qd, *(t.to("cuda", torch.float32) for t in (k, v, i, f)))
    assert torch.isfinite(h).all() and torch.isfinite(n).all() and torch.isfinite(m).all()
    rh, rn, rm = ref_parallel(q, k, v, i, f)
    assert rel_err(h, rh) < 1e-4 and rel_err(m, rm) < 1e-5


# ---- torch.compile, custom-op checks ----------------------------------------------------------------
def test_opcheck():
    q, k, v, i, f, c0, n0, m0 = make(B=1, NH=2, S=9, DQK=4, DV=3, states=True)
    args = [t.requires_grad_() for t in (q, k, v, i, f)]
    torch.library.opcheck(torch.ops.fastweight.mlstm_fwd.default, (*args, c0, n0, m0, 1e-6, 16, True))
    torch.library.opcheck(torch.ops.fastweight.mlstm_fwd.default, (*args, None, None, None, 1e-6, 16, False))
    torch.library.opcheck(torch.ops.fastweight.mlstm_decay_matrix_fwd.default, (args[3], args[4]))


def test_compile_fullgraph():
    args = make(B=1, NH=2, S=20, DQK=4, DV=4, dtype=torch.float32)

    def fn(q, k, v, i, f):
        h, (c, n, m) = fastweight.mlstm(q, k, v, i, f, return_last_states=True, chunk_size=16)
        return h * 2.0, c

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for a, b in zip(compiled(*args), fn(*args)):
        assert torch.equal(a, b)


# ---- drop-in shim -----------------------------------------------------------------------------------
def test_shim_names_and_signatures():
    q, k, v, i, f, c0, n0, m0 = make(S=33, dtype=torch.float32, states=True)
    kern = mk.get_mlstm_kernel("chunkwise--triton_xl_chunk")
    h, (c, n, m) = kern(q, k, v, i, f, c_initial=c0, n_initial=n0, m_initial=m0, return_last_states=True,
                        chunk_size=16, siz_b_L_parallel=64, num_warps_intra=4)  # tuning args are accepted
    rh, (rc, _, rm) = ref_mlstm(q, k, v, i, f, c0, n0, m0)
    assert m.shape == (2, 3, 1) and rel_err(h, rh) < 1e-5 and rel_err(c, rc) < 1e-5
    step = mk.get_mlstm_step_kernel("triton")
    hs, (c1, n1, m1) = step(q[:, :, 0], k[:, :, 0], v[:, :, 0], i[:, :, :1], f[:, :, :1], c0, n0, m0)
    assert rel_err(hs, ref_mlstm(q[:, :, :1], k[:, :, :1], v[:, :, :1], i[:, :, :1], f[:, :, :1], c0, n0, m0)[0][:, :, 0]) < 1e-5
    with pytest.raises(ValueError, match="unknown kernel"):
        mk.get_mlstm_kernel("chunkwise--nope")


def test_shim_against_mlstm_kernels_native_cpu():
    """mlstm_kernels' own native (pure torch) chunkwise kernel, where the package is installed."""
    native = pytest.importorskip("mlstm_kernels.torch.chunkwise.native")
    q, k, v, i, f = make(S=64, dtype=torch.float32)
    theirs = native.mlstm_chunkwise__native_autograd(q, k, v, i, f, chunk_size=16)
    ours = mk.mlstm_chunkwise__xl_chunk(q, k, v, i, f, chunk_size=16)
    assert rel_err(ours, theirs) < 1e-4


def test_shim_parallel_kernels():
    q, k, v, i, f, c0, n0, m0 = make(S=21, dtype=torch.float32, states=True)
    want = fastweight.mlstm_parallel(q, k, v, i, f)[0]
    for name in ("parallel--triton_limit_headdim", "parallel--native_autograd", "parallel--native_custbw"):
        kern = mk.get_mlstm_kernel(name)
        assert name in mk.get_available_mlstm_kernels()
        assert torch.equal(kern(q, k, v, i, f, chunk_size=64, autocast_kernel_dtype=torch.float32), want)
        with pytest.raises(ValueError, match="no initial states"):
            kern(q, k, v, i, f, c_initial=c0, n_initial=n0, m_initial=m0)
        with pytest.raises(ValueError, match="no last states"):
            kern(q, k, v, i, f, return_last_states=True)


def test_shim_parallel_against_mlstm_kernels_native_cpu():
    """mlstm_kernels' own native parallel kernel, where the package is installed (same seed-000 formula)."""
    par = pytest.importorskip("mlstm_kernels.torch.parallel")
    q, k, v, i, f = make(S=40, dtype=torch.float32)
    theirs = par.mlstm_parallel__native_autograd(q, k, v, i, f)
    assert rel_err(mk.mlstm_parallel__native_autograd(q, k, v, i, f), theirs) < 1e-4


@gpu
@requires_cuda
@pytest.mark.parametrize("name", ["chunkwise--triton_limit_chunk", "parallel--triton_limit_headdim"])
def test_shim_against_mlstm_kernels_triton_on_gpu(name):
    """mlstm_kernels' own Triton kernels on the GPU, where the package and its kernels run."""
    mkt = pytest.importorskip("mlstm_kernels.torch")
    q, k, v, i, f = make(B=1, NH=2, S=256, DQK=64, DV=64, dtype=torch.float32, device="cuda")
    try:
        theirs = mkt.get_mlstm_kernel(name)(q, k, v, i, f, chunk_size=64, autocast_kernel_dtype=torch.float32)
    except Exception as e:  # a peer kernel that does not run with this Triton is the peer's failure, not ours
        pytest.skip(f"mlstm_kernels {name} does not run here: {type(e).__name__}: {e}")
    ours = mk.get_mlstm_kernel("chunkwise--triton_xl_chunk" if name.startswith("chunkwise") else name)(
        q, k, v, i, f, chunk_size=64)
    assert rel_err(ours, theirs.float()) < 2e-2  # their kernels run tf32 / bf16 matmuls


# ---- errors -----------------------------------------------------------------------------------------
def test_bad_input_names_the_argument():
    q, k, v, i, f = make(S=8)
    with pytest.raises(ValueError, match=r"mlstm_fwd: i: expected shape \(2, 3, 8\)"):
        fastweight.mlstm(q, k, v, i[:, :, :7], f)
    with pytest.raises(ValueError, match="chunk_size"):
        fastweight.mlstm(q, k, v, i, f, chunk_size=48)
    with pytest.raises(ValueError, match="k: expected dtype float64"):
        fastweight.mlstm(q, k.float(), v, i, f)
    with pytest.raises(ValueError, match="together"):
        fastweight.mlstm(q, k, v, i, f, c_initial=torch.zeros(2, 3, 8, 5))


# ---- CUDA -------------------------------------------------------------------------------------------
@gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("S,chunk", [(1, 64), (100, 64), (1000, 128), (257, 256)])
def test_cuda_forward_matches_reference(dtype, S, chunk):
    args = make(B=2, NH=2, S=S, DQK=64, DV=96, dtype=dtype, states=True, device="cuda")
    h, (c, n, m) = fastweight.mlstm(*args, return_last_states=True, chunk_size=chunk)
    rh, (rc, rn, rm) = ref_mlstm(*[t.cpu() for t in args])
    assert h.is_cuda and h.dtype == dtype
    assert rel_err(h, rh) < (1e-4 if dtype == torch.float32 else 2e-2)
    for a, b in ((c, rc), (n, rn), (m, rm)):
        assert rel_err(a, b) < 1e-4


@gpu
@requires_cuda
def test_cuda_forward_strong_gates_graph_capture_and_determinism():
    args = make(B=1, NH=2, S=300, DQK=64, DV=64, dtype=torch.float32, device="cuda", strong=True)
    h1 = fastweight.mlstm(*args, chunk_size=64)
    h2 = fastweight.mlstm(*args, chunk_size=64)
    assert torch.equal(h1, h2)
    assert rel_err(h1, ref_mlstm(*[t.cpu() for t in args])[0]) < 1e-4
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        hg = fastweight.mlstm(*args, chunk_size=64)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(hg, h1)


@gpu
@requires_cuda
def test_cuda_backward_dv_slabs_deterministic_graph_capture_and_reference():
    # bf16, DV = 256: the backward per 128-column DV slab, two slabs at a time on the caller's stream
    # and a side stream at this size (forked and joined by events inside the call: captured as graph
    # edges); on Hopper the serial kernels' state slots go out by TMA tensor copies
    q, k, v, i, f, c0, n0, m0 = make(B=1, NH=2, S=200, DQK=64, DV=256, dtype=torch.bfloat16, states=True,
                                     device="cuda")
    g = torch.Generator().manual_seed(3)
    dh, dc, dn, dm = (torch.randn(t.shape, generator=g).to(device="cuda", dtype=t.dtype) for t in (v, c0, n0, m0))
    bwd = torch.ops.fastweight.mlstm_bwd

    g1 = same_bits_twice_and_in_a_graph(lambda: bwd(dh, q, k, v, i, f, c0, n0, m0, dc, dn, dm, 1e-6, 64))
    ref_args = [t.detach().cpu().double().requires_grad_() for t in (q, k, v, i, f, c0, n0, m0)]
    rh, (rc, rn, rm) = ref_mlstm(*ref_args)
    loss = sum(((x * w.cpu().double()).sum() for x, w in ((rh, dh), (rc, dc), (rn, dn), (rm, dm))))
    want = torch.autograd.grad(loss, ref_args)
    for name, a, b in zip("q k v i f c0 n0 m0".split(), g1, want):
        assert rel_err(a, b) < 2e-2, name


@gpu
@requires_cuda
def test_cuda_step_and_decay():
    q, k, v, i, f, c0, n0, m0 = make(S=4, dtype=torch.float32, states=True, device="cuda")
    h, (c, n, m) = fastweight.mlstm_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], i[:, :, 0], f[:, :, 0], c0, n0, m0)
    rh, (rc, rn, rm) = ref_mlstm(*[t[:, :, :1].cpu() for t in (q, k, v, i, f)], c0.cpu(), n0.cpu(), m0.cpu())
    assert rel_err(h, rh[:, :, 0]) < 1e-5 and rel_err(c, rc) < 1e-5 and rel_err(m, rm) < 1e-6
    ci, ni, mi = c0.clone(), n0.clone(), m0.clone()
    hi, _ = fastweight.mlstm_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], i[:, :, 0], f[:, :, 0], ci, ni, mi, inplace=True)
    assert torch.equal(hi, h) and torch.equal(ci, c) and torch.equal(ni, n) and torch.equal(mi, m)
    i = torch.randn(2, 3, 70, device="cuda", requires_grad=True)
    f = torch.randn(2, 3, 70, device="cuda", requires_grad=True)
    D = fastweight.mlstm_decay_matrix(i, f)
    ic, fc = i.detach().cpu().double().requires_grad_(), f.detach().cpu().double().requires_grad_()
    Dc = fastweight.mlstm_decay_matrix(ic, fc)
    mask = torch.ones(70, 70, dtype=torch.bool).tril()
    assert rel_err(D[..., mask], Dc[..., mask]) < 1e-6
    dD = torch.randn(D.shape, device="cuda").masked_fill(~mask.cuda(), 0.0)
    gi, gf = torch.autograd.grad((D.masked_fill(~mask.cuda(), 0.0) * dD).sum(), (i, f))
    ri, rf = torch.autograd.grad((Dc.masked_fill(~mask, 0.0) * dD.cpu().double()).sum(), (ic, fc))
    assert rel_err(gi, ri) < 1e-5 and rel_err(gf, rf) < 1e-5


@gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S,chunk,strong", [(1, 64, False), (100, 64, False), (300, 128, True), (257, 256, False)])
def test_cuda_backward_matches_reference(dtype, S, chunk, strong):
    args = make(B=1, NH=2, S=S, DQK=64, DV=96, dtype=dtype, states=True, device="cuda", strong=strong)
    args = [t.requires_grad_() for t in args]
    h, (c, n, m) = fastweight.mlstm(*args, return_last_states=True, chunk_size=chunk)
    g = torch.Generator().manual_seed(2)
    dh, dc, dn, dm = (torch.randn(t.shape, generator=g, dtype=torch.float64) for t in (h, c, n, m))
    loss = sum(((x.double() * w.cuda()).sum() for x, w in ((h, dh), (c, dc), (n, dn), (m, dm))))
    got = torch.autograd.grad(loss, args)
    ref_args = [t.detach().cpu().double().requires_grad_() for t in args]
    rh, (rc, rn, rm) = ref_mlstm(*ref_args)
    want = torch.autograd.grad((rh * dh).sum() + (rc * dc).sum() + (rn * dn).sum() + (rm * dm).sum(), ref_args)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for name, a, b in zip("q k v i f c0 n0 m0".split(), got, want):
        assert rel_err(a, b) < tol, name


# ---- torch.func ----------------------------------------------------------------------------------
def test_torch_func_grad_and_per_sample_grads():
    """torch.func.grad of the chunkwise form (every input), the parallel form and the decay matrix, and
    per-sample gradients (vmap of grad), against autograd (CPU, float64)."""
    gen = torch.Generator().manual_seed(3)
    B, NH, S, D = 2, 2, 20, 8
    q, k, v = (torch.randn(B, NH, S, D, generator=gen, dtype=torch.float64) for _ in range(3))
    i = torch.randn(B, NH, S, generator=gen, dtype=torch.float64)
    f = torch.randn(B, NH, S, generator=gen, dtype=torch.float64) + 2

    def autograd(fn, args, argnums):
        ts = [a.clone().requires_grad_() if n in argnums else a for n, a in enumerate(args)]
        fn(*ts).backward()
        return [ts[n].grad for n in argnums]

    chunk = lambda q, k, v, i, f: fastweight.mlstm(q, k, v, i, f, chunk_size=16).sin().sum()  # noqa: E731
    par = lambda q, k, v, i, f: fastweight.mlstm_parallel(q, k, v, i, f)[0].sin().sum()  # noqa: E731
    decay = lambda i, f: fastweight.mlstm_decay_matrix(i, f).nan_to_num(neginf=0.0).sin().sum()  # noqa: E731
    for fn, args in ((chunk, (q, k, v, i, f)), (par, (q, k, v, i, f)), (decay, (i, f))):
        nums = tuple(range(len(args)))
        for got, want in zip(torch.func.grad(fn, argnums=nums)(*args), autograd(fn, args, nums)):
            assert rel_err(got, want) < 1e-12
    per = torch.func.vmap(torch.func.grad(lambda *a: chunk(*(t[None] for t in a))))(q, k, v, i, f)
    want = torch.stack([autograd(chunk, tuple(t[b:b + 1] for t in (q, k, v, i, f)), (0,))[0][0] for b in range(B)])
    assert rel_err(per, want) < 1e-12
