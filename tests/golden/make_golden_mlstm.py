#!/usr/bin/env python3
"""Writes the golden file of the mLSTM: an independent float64 PyTorch autograd implementation of
shared/MATH.md §2 (plain torch ops, no fastweight code), on small random inputs.

    python tests/golden/make_golden_mlstm.py    # rewrites tests/golden/mlstm.txt

File format as norms.txt, one tensor per line: `<case>.<name> <ndim> <d0> ... <v0> <v1> ...`
(values %.17g; the decay matrix holds -inf above the diagonal). tests/cpp/test_mlstm_reference.cpp
reads it and checks the CPU reference (src/reference/mlstm_ref.cpp) against it.

The forward is written the direct way: m = torch.max(D, dim=-1) (its gradient goes to the arg-max
entry), n = torch.maximum(|b|, exp(-m)), h = (C @ v) / (n + eps); nothing is detached, so the
gradients include the normaliser and the stabiliser paths.

The chunkwise form (cases `chunk`, `headnorm`) is written the same direct way, per chunk against
the incoming state (C, n, m): m_u = torch.max over [F_u + m, D_chunk[u, :]] (the state term first),
and is asserted equal to a step-by-step recurrent loop before anything is written. `headnorm`
applies the per-(b, head, t) layer norm of MATH.md §1 (population variance, weight_offset + weight,
bias) to the chunkwise output. Both carry initial states (c0, n0, m0) and gradients for the last
states (dcS, dnS, dmS); `out` is h (chunk) or headnorm(h) (headnorm), `dout` its gradient, and the
gradients are of sum(dout * out) + sum(dcS * cS) + sum(dnS * nS) + sum(dmS * mS).
"""
import math
import torch
from golden_io import GoldenWriter

torch.manual_seed(20261122)
f64 = torch.float64
golden = GoldenWriter()
put = golden.put


def decay_matrix(i, f):
    """D[t,s] = F_t - F_s + i_s for s <= t, -inf above; F = cumsum(logsigmoid(f))."""
    S = i.shape[-1]
    F = torch.cumsum(torch.nn.functional.logsigmoid(f), dim=-1)
    D = F[..., :, None] - F[..., None, :] + i[..., None, :]
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    return torch.where(causal, D, torch.full_like(D, -math.inf))


def parallel(q, k, v, i, f, eps):
    D = decay_matrix(i, f)
    m, _ = torch.max(D, dim=-1, keepdim=True)
    C = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1]) * torch.exp(D - m)
    b = C.sum(-1, keepdim=True)
    n = torch.maximum(b.abs(), torch.exp(-m))
    h = (C @ v) / (n + eps)
    return h, n.squeeze(-1), m.squeeze(-1)


def decay_case(name, B, NH, S):
    i = torch.randn(B, NH, S, dtype=f64).requires_grad_()
    f = (torch.randn(B, NH, S, dtype=f64) + 2).requires_grad_()
    D = decay_matrix(i, f)
    dD = torch.randn_like(D)
    di, df = torch.autograd.grad(D, [i, f], dD)
    dD = torch.where(torch.isinf(D), torch.zeros_like(dD), dD)  # entries without gradient: 0 in the file
    for k_, t in [("i", i), ("f", f), ("D", D), ("dD", dD), ("di", di), ("df", df)]:
        put(name, k_, t)


def parallel_case(name, B, NH, S, DQK, DV, eps, igate_shift=0.0, fgate_shift=2.0, const_gates=False):
    q = torch.randn(B, NH, S, DQK, dtype=f64).requires_grad_()
    k = torch.randn(B, NH, S, DQK, dtype=f64).requires_grad_()
    v = torch.randn(B, NH, S, DV, dtype=f64).requires_grad_()
    gs = 0.0 if const_gates else 2.0
    i = (torch.randn(B, NH, S, dtype=f64) * gs + igate_shift).requires_grad_()
    f = (torch.randn(B, NH, S, dtype=f64) * gs + fgate_shift).requires_grad_()
    h, n, m = parallel(q, k, v, i, f, eps)
    dh = torch.randn_like(h)
    grads = torch.autograd.grad(h, [q, k, v, i, f], dh)
    put(name, "eps", torch.tensor([eps], dtype=f64))
    for k_, t in [("q", q), ("k", k), ("v", v), ("i", i), ("f", f), ("dh", dh), ("h", h), ("n", n), ("m", m)]:
        put(name, k_, t)
    for k_, g in zip(["dq", "dk", "dv", "di", "df"], grads):
        put(name, k_, g)
    # how many rows use the exp(-m) branch of the normaliser (both branches should be covered)
    emb = (torch.exp(-m) >= n).sum().item()
    return emb, n.numel()


decay_case("decay", 2, 2, 7)
print("parallel  exp(-m) rows:", parallel_case("parallel", 2, 2, 7, 5, 3, 1e-6))
# large eps and negative input gates: the stabiliser m gets a visible gradient and many rows use the
# exp(-m) branch of the normaliser
print("parallel_eps exp(-m) rows:", parallel_case("parallel_eps", 1, 2, 9, 4, 6, 0.25, igate_shift=-1.5))
# strong decay, large input gates (f = -20, i = +20 everywhere): finite values; the gate gradients
# are of size exp(-20) (the diagonal of D dominates every row)
print("parallel_extreme exp(-m) rows:",
      parallel_case("parallel_extreme", 1, 2, 7, 5, 3, 1e-6, igate_shift=20.0, fgate_shift=-20.0, const_gates=True))


def recurrent(q, k, v, i, f, eps, c, n, m):
    """Step by step (MATH.md §2 recurrent form); only used to check chunkwise() here."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    hs = []
    for t in range(q.shape[2]):
        lf = torch.nn.functional.logsigmoid(f[:, :, t])
        m_new = torch.maximum(lf + m, i[:, :, t])
        fa, ia = torch.exp(lf + m - m_new), torch.exp(i[:, :, t] - m_new)
        kt, vt, qs = k[:, :, t], v[:, :, t], q[:, :, t] * scale
        c = fa[..., None, None] * c + ia[..., None, None] * kt[..., :, None] * vt[..., None, :]
        n = fa[..., None] * n + ia[..., None] * kt
        m = m_new
        den = torch.maximum((qs * n).sum(-1).abs(), torch.exp(-m)) + eps
        hs.append((qs[..., None] * c).sum(-2) / den[..., None])
    return torch.stack(hs, dim=2), c, n, m


def chunkwise(q, k, v, i, f, eps, L, c, n, m):
    """Chunk by chunk: inside a chunk the parallel form against the incoming state (c, n, m)."""
    S, scale = q.shape[2], 1.0 / math.sqrt(q.shape[-1])
    hs = []
    for t0 in range(0, S, L):
        sl = slice(t0, min(S, t0 + L))
        qs, kc, vc, ic = q[:, :, sl] * scale, k[:, :, sl], v[:, :, sl], i[:, :, sl]
        Dl = decay_matrix(ic, f[:, :, sl])                       # (B,NH,Lc,Lc)
        Fl = torch.cumsum(torch.nn.functional.logsigmoid(f[:, :, sl]), dim=-1)
        g = Fl + m[..., None]                                    # (B,NH,Lc): log-weight of the state
        mc, _ = torch.max(torch.cat([g[..., None], Dl], dim=-1), dim=-1)
        ws = torch.exp(g - mc)
        P = (qs @ kc.transpose(-1, -2)) * torch.exp(Dl - mc[..., None])
        b = ws * (qs @ n[..., None]).squeeze(-1) + P.sum(-1)
        num = ws[..., None] * (qs @ c) + P @ vc
        den = torch.maximum(b.abs(), torch.exp(-mc)) + eps
        hs.append(num / den[..., None])
        e = torch.exp(Dl[..., -1, :] - mc[..., -1:])             # (B,NH,Lc): weights into the end state
        c = ws[..., -1, None, None] * c + (kc * e[..., None]).transpose(-1, -2) @ vc
        n = ws[..., -1, None] * n + (kc * e[..., None]).sum(-2)
        m = mc[..., -1]
    return torch.cat(hs, dim=2), c, n, m


def headnorm(h, w, b, eps, weight_offset):
    mu = h.mean(-1, keepdim=True)
    var = ((h - mu) ** 2).mean(-1, keepdim=True)
    return (h - mu) / torch.sqrt(var + eps) * (weight_offset + w[None, :, None, :]) + b[None, :, None, :]


def chunk_case(name, B, NH, S, DQK, DV, eps, L, igate_shift=0.0, norm=None):
    """norm = (eps_norm, weight_offset): the head-norm-fused variant, out = headnorm(h)."""
    q = torch.randn(B, NH, S, DQK, dtype=f64).requires_grad_()
    k = torch.randn(B, NH, S, DQK, dtype=f64).requires_grad_()
    v = torch.randn(B, NH, S, DV, dtype=f64).requires_grad_()
    i = (torch.randn(B, NH, S, dtype=f64) * 2 + igate_shift).requires_grad_()
    f = (torch.randn(B, NH, S, dtype=f64) * 2 + 2).requires_grad_()
    c0 = torch.randn(B, NH, DQK, DV, dtype=f64).requires_grad_()
    n0 = torch.randn(B, NH, DQK, dtype=f64).requires_grad_()
    m0 = torch.randn(B, NH, dtype=f64).requires_grad_()
    leaves = [q, k, v, i, f, c0, n0, m0]
    h, cS, nS, mS = chunkwise(q, k, v, i, f, eps, L, c0, n0, m0)
    hr, cr, nr, mr = recurrent(q, k, v, i, f, eps, c0, n0, m0)
    for a, r in [(h, hr), (cS, cr), (nS, nr), (mS, mr)]:
        assert torch.allclose(a, r, rtol=1e-12, atol=1e-12), (name, (a - r).abs().max().item())
    put(name, "eps", torch.tensor([eps], dtype=f64))
    put(name, "L", torch.tensor([float(L)], dtype=f64))
    out = h
    if norm is not None:
        eps_norm, weight_offset = norm
        w = (torch.randn(NH, DV, dtype=f64) * 0.5).requires_grad_()
        bias = torch.randn(NH, DV, dtype=f64).requires_grad_()
        leaves += [w, bias]
        out = headnorm(h, w, bias, eps_norm, weight_offset)
        put(name, "eps_norm", torch.tensor([eps_norm], dtype=f64))
        put(name, "weight_offset", torch.tensor([weight_offset], dtype=f64))
        put(name, "weight", w)
        put(name, "bias", bias)
    dout = torch.randn_like(out)
    dcS, dnS, dmS = torch.randn_like(cS), torch.randn_like(nS), torch.randn_like(mS)
    loss = (dout * out).sum() + (dcS * cS).sum() + (dnS * nS).sum() + (dmS * mS).sum()
    grads = torch.autograd.grad(loss, leaves)
    for k_, t in [("q", q), ("k", k), ("v", v), ("i", i), ("f", f), ("c0", c0), ("n0", n0), ("m0", m0),
                  ("dout", dout), ("dcS", dcS), ("dnS", dnS), ("dmS", dmS), ("out", out), ("cS", cS),
                  ("nS", nS), ("mS", mS)]:
        put(name, k_, t)
    names = ["dq", "dk", "dv", "di", "df", "dc0", "dn0", "dm0", "dweight", "dbias"]
    for k_, g in zip(names, grads):
        put(name, k_, g)


# chunkwise with initial and last states: S = 13 in chunks of 4 (the last one of 1), DQK != DV;
# eps = 0.1 so the stabiliser's gradient is visible
chunk_case("chunk", 2, 2, 13, 5, 3, 0.1, 4, igate_shift=-1.0)
# head-norm fused: out = headnorm(chunkwise h), weight_offset = 1 (xLSTM), chunks of 3 over S = 7
chunk_case("headnorm", 2, 2, 7, 4, 6, 1e-6, 3, norm=(1e-5, 1.0))

golden.write(__file__, "mlstm.txt")
