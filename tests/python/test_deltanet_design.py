"""The formulas planned for the DeltaNet chunkwise forward on tensor cores (docs/design/deltanet_chunk_tc.md),
emulated chunk by chunk in float64 torch in the kernels' order: the WY pass (G = K K^T, T = (I +
diag(beta) strict_lower(G))^-1 by 16 x 16 blocks: diagonal blocks by forward substitution, then the
off-diagonal blocks block-row by block-row; W = T diag(beta) K, U = T diag(beta) V), the serial state
pass (V' = U - W S, S += K^T V') and the output pass (o = scale (Q S + tril(Q K^T) V')), against the
independent loop-form reference of test_deltanet.py. This checks the mathematics before the kernels
exist, on any machine; the GPU suites will check their implementation.

The second part emulates what the kernels now implement: the forward pipeline in its T2 form
(deltanet_chunk_tc.cu) and the backward's state and chunk passes (deltanet_bwd.cu, deltanet_bwd_tc.cu),
against torch autograd of the loop form: every gradient, beta = 0 rows included, varlen.
"""

from __future__ import annotations

import pytest
import torch

from test_deltanet import make, prepare, ref_delta_rule

BLOCK = 16


def unit_lower_inverse_blocked(Lm: torch.Tensor) -> torch.Tensor:
    """(I + Lm)^-1 for strictly lower Lm (n x n), as the wy kernel will: 16 x 16 diagonal blocks by
    forward substitution, then T_ij = -T_ii sum_{k=j}^{i-1} L_ik T_kj for block rows i > j."""
    n = Lm.shape[0]
    nb = (n + BLOCK - 1) // BLOCK
    T = torch.zeros_like(Lm)
    sl = [slice(b * BLOCK, min(n, (b + 1) * BLOCK)) for b in range(nb)]
    for b in range(nb):  # diagonal blocks: rows in order, x_r = e_r - sum_{c<r} L_rc x_c
        s = sl[b]
        Lb = Lm[s, s]
        m = Lb.shape[0]
        Tb = torch.eye(m, dtype=Lm.dtype)
        for r in range(m):
            Tb[r] = Tb[r] - Lb[r, :r] @ Tb[:r]
        T[s, s] = Tb
    for i in range(nb):
        for j in range(i - 1, -1, -1):
            acc = torch.zeros(T[sl[i], sl[j]].shape, dtype=Lm.dtype)
            for k in range(j, i):
                acc = acc + Lm[sl[i], sl[k]] @ T[sl[k], sl[j]]
            T[sl[i], sl[j]] = -T[sl[i], sl[i]] @ acc
    return T


def emulate(q, k, v, beta, scale=None, h0=None, l2=False, cu_seqlens=None, chunk=64):
    q, k, v, beta, scale, seqs = prepare(q, k, v, beta, scale, l2, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    o = torch.zeros(B, T, H, V, dtype=torch.float64)
    finals = []
    for n, (b, bos, eos) in enumerate(seqs):
        Sh = []
        for h in range(H):
            S = h0[n, h].double().clone() if h0 is not None else torch.zeros(K, V, dtype=torch.float64)
            for c0 in range(bos, eos, chunk):  # chunks never straddle sequences
                c1 = min(eos, c0 + chunk)
                Q, Kc, Vc, bt = q[b, c0:c1, h], k[b, c0:c1, h], v[b, c0:c1, h], beta[b, c0:c1, h]
                # wy pass (parallel over chunks)
                G = Kc @ Kc.T
                Lm = torch.tril(bt[:, None] * G, diagonal=-1)
                Tm = unit_lower_inverse_blocked(Lm)
                TB = Tm * bt[None, :]  # T diag(beta): the product the kernel splits into bf16 hi + lo
                W, U = TB @ Kc, TB @ Vc
                # state pass (serial) and output pass
                Vp = U - W @ S
                o[b, c0:c1, h] = scale * (Q @ S + torch.tril(Q @ Kc.T) @ Vp)
                S = S + Kc.T @ Vp
            Sh.append(S)
        finals.append(torch.stack(Sh))
    return o, torch.stack(finals)


@pytest.mark.parametrize("T,chunk", [(1, 64), (37, 16), (64, 64), (100, 64), (200, 64), (130, 32)])
@pytest.mark.parametrize("l2", [False, True])
def test_chunkwise_wy_design_matches_the_loop(T, chunk, l2):
    q, k, v, beta, h0 = make(B=2, T=T, H=2, K=24, V=20, seed=T + chunk)
    ro, rs = ref_delta_rule(q, k, v, beta, h0=h0, l2=l2)
    eo, es = emulate(q, k, v, beta, h0=h0, l2=l2, chunk=chunk)
    assert (eo - ro).norm() / ro.norm() < 1e-12
    assert (es - rs).norm() / rs.norm() < 1e-12


def test_chunkwise_wy_design_varlen_and_scale():
    cu = [0, 0, 70, 71, 200]  # an empty sequence, a one-step one, chunk tails
    q, k, v, beta, h0 = make(B=1, T=200, H=3, K=16, V=12, N=len(cu) - 1, seed=7)
    ro, rs = ref_delta_rule(q, k, v, beta, scale=0.6, h0=h0, l2=True, cu_seqlens=cu)
    eo, es = emulate(q, k, v, beta, scale=0.6, h0=h0, l2=True, cu_seqlens=cu)
    assert (eo - ro).norm() / ro.norm() < 1e-12
    assert (es - rs).norm() / rs.norm() < 1e-12


def test_blocked_inverse_is_the_inverse():
    g = torch.Generator().manual_seed(3)
    for n in (1, 15, 16, 17, 64):
        Lm = torch.tril(torch.randn(n, n, generator=g, dtype=torch.float64), diagonal=-1) * 0.3
        Tm = unit_lower_inverse_blocked(Lm)
        assert torch.allclose(Tm @ (torch.eye(n, dtype=torch.float64) + Lm), torch.eye(n, dtype=torch.float64),
                              atol=1e-12)


# ---- what the kernels implement (deltanet_chunk_tc.cu, deltanet_bwd.cu, deltanet_bwd_tc.cu) -------
def emulate_pipeline_and_backward(q, k, v, beta, do, dht, scale=None, h0=None, l2=False, cu_seqlens=None):
    """The tensor-core pipeline's forward in its T2 form and the backward passes, chunk by chunk in
    float64 in the kernels' order. Forward: T2 = (I + Lg W)^-1 (Lg = strict_lower(K^ K^T), W =
    diag(beta)), Xw = T2 K^, Xu = T2 V (wy), X = Xu - Xw S, D = W X, S += K^T D (state), o (output).
    Backward, chunks in reverse (state pass): dD = s M^T dO + K^ dSe, dR = T2^T W dD, Y = dD - Lg^T dR,
    dv = dR, dbeta = Y . X, dS0 = dSe + s Q^T dO - K^T dR; then per chunk (chunk pass) dq^, dk^ from
    a1 = dO D^T, a2 = -dR D^T, dG = strict_lower(a2), and the L2-norm backward. Returns o, final
    states and (dq, dk, dv, dbeta, dh0) for the raw inputs."""
    q, k, v, beta, scale, seqs = prepare(q, k, v, beta, scale, False, cu_seqlens)
    if l2:
        rq = (q * q).sum(-1, keepdim=True).add(1e-6).rsqrt()
        rk = (k * k).sum(-1, keepdim=True).add(1e-6).rsqrt()
    else:
        rq, rk = torch.ones_like(q[..., :1]), torch.ones_like(k[..., :1])
    qh, kh = q * rq, k * rk
    B, T, H, K = q.shape
    V = v.shape[-1]
    o = torch.zeros(B, T, H, V, dtype=torch.float64)
    dqh, dkh = torch.zeros_like(q), torch.zeros_like(k)
    dv, db = torch.zeros_like(v), torch.zeros_like(beta)
    finals, dh0 = [], []
    do, dht = do.double(), (dht.double() if dht is not None else None)
    for n, (b, bos, eos) in enumerate(seqs):
        Fh, Dh = [], []
        for h in range(H):
            S = h0[n, h].double().clone() if h0 is not None else torch.zeros(K, V, dtype=torch.float64)
            chunks = []
            for c0 in range(bos, eos, 64):
                c1 = min(eos, c0 + 64)
                Qc, Kc, Vc, bt = qh[b, c0:c1, h], kh[b, c0:c1, h], v[b, c0:c1, h], beta[b, c0:c1, h]
                Lg = torch.tril(Kc @ Kc.T, diagonal=-1)
                T2 = unit_lower_inverse_blocked(Lg * bt[None, :])
                Xw, Xu = T2 @ Kc, T2 @ Vc
                X = Xu - Xw @ S
                D = bt[:, None] * X
                o[b, c0:c1, h] = scale * (Qc @ S + torch.tril(Qc @ Kc.T) @ D)
                chunks.append((c0, c1, S.clone(), Lg, T2, X, D))
                S = S + Kc.T @ D
            Fh.append(S)
            dS = dht[n, h].clone() if dht is not None else torch.zeros(K, V, dtype=torch.float64)
            for c0, c1, S0, Lg, T2, X, D in reversed(chunks):
                Qc, Kc, bt, dO = qh[b, c0:c1, h], kh[b, c0:c1, h], beta[b, c0:c1, h], do[b, c0:c1, h]
                M = torch.tril(Qc @ Kc.T)
                dD = scale * M.T @ dO + Kc @ dS
                dR = T2.T @ (bt[:, None] * dD)
                Y = dD - Lg.T @ dR
                dv[b, c0:c1, h] = dR
                db[b, c0:c1, h] = (Y * X).sum(-1)
                a1, a2 = dO @ D.T, -dR @ D.T
                M1 = scale * torch.tril(a1)
                E = torch.tril(a2, diagonal=-1)
                E = E + E.T
                dqh[b, c0:c1, h] = M1 @ Kc + scale * dO @ S0.T
                dkh[b, c0:c1, h] = M1.T @ Qc + E @ Kc + D @ dS.T - dR @ S0.T
                dS = dS + scale * Qc.T @ dO - Kc.T @ dR
            Dh.append(dS)
        finals.append(torch.stack(Fh))
        dh0.append(torch.stack(Dh))
    if l2:  # dx = r (dx^ - x^ (x^ . dx^))
        dq = rq * (dqh - qh * (qh * dqh).sum(-1, keepdim=True))
        dk = rk * (dkh - kh * (kh * dkh).sum(-1, keepdim=True))
    else:
        dq, dk = dqh, dkh
    return o, torch.stack(finals), (dq, dk, dv, db, torch.stack(dh0))


def _autograd_reference(q, k, v, beta, do, dht, scale, h0, l2, cu):
    ins = [t.double().clone().requires_grad_() for t in (q, k, v, beta, h0)]
    o, ht = ref_delta_rule(*ins[:4], scale=scale, h0=ins[4], l2=l2, cu_seqlens=cu)
    torch.autograd.backward([o, ht], [do.double(), dht.double()])
    return o.detach(), ht.detach(), [t.grad for t in ins]


@pytest.mark.parametrize("T,l2,zero_beta", [(1, True, False), (63, False, False), (150, True, False),
                                            (150, True, True), (200, False, True)])
def test_pipeline_and_backward_algebra_match_autograd(T, l2, zero_beta):
    q, k, v, beta, h0 = make(B=2, T=T, H=2, K=20, V=12, seed=T + 5)
    if zero_beta:  # dbeta = Y . X must hold where beta = 0 (no division by beta anywhere)
        beta[:, ::7] = 0.0
    g = torch.Generator().manual_seed(T)
    do = torch.randn(v.shape, generator=g, dtype=torch.float64)
    dht = torch.randn(h0.shape, generator=g, dtype=torch.float64)
    ro, rs, rg = _autograd_reference(q, k, v, beta, do, dht, 0.7, h0, l2, None)
    eo, es, eg = emulate_pipeline_and_backward(q, k, v, beta, do, dht, scale=0.7, h0=h0, l2=l2)
    assert (eo - ro).norm() / ro.norm() < 1e-12
    assert (es - rs).norm() / rs.norm() < 1e-12
    for name, e, r in zip(("dq", "dk", "dv", "dbeta", "dh0"), eg, rg):
        assert (e - r).norm() / r.norm() < 1e-11, name


def test_pipeline_and_backward_algebra_varlen():
    cu = [0, 0, 70, 71, 200]  # an empty sequence, a one-step one, chunk tails
    q, k, v, beta, h0 = make(B=1, T=200, H=2, K=16, V=12, N=len(cu) - 1, seed=11)
    g = torch.Generator().manual_seed(1)
    do = torch.randn(v.shape, generator=g, dtype=torch.float64)
    dht = torch.randn(h0.shape, generator=g, dtype=torch.float64)
    ro, rs, rg = _autograd_reference(q, k, v, beta, do, dht, None, h0, True, cu)
    eo, es, eg = emulate_pipeline_and_backward(q, k, v, beta, do, dht, h0=h0, l2=True, cu_seqlens=cu)
    assert (eo - ro).norm() / ro.norm() < 1e-12
    for name, e, r in zip(("dq", "dk", "dv", "dbeta", "dh0"), eg, rg):
        assert (e - r).norm() / r.norm() < 1e-11, name
