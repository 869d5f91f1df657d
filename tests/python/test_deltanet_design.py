"""The formulas planned for the DeltaNet chunkwise forward on tensor cores (docs/design/deltanet_chunk_tc.md),
emulated chunk by chunk in float64 torch in the kernels' order: the WY pass (G = K K^T, T = (I +
diag(beta) strict_lower(G))^-1 by 16 x 16 blocks: diagonal blocks by forward substitution, then the
off-diagonal blocks block-row by block-row; W = T diag(beta) K, U = T diag(beta) V), the serial state
pass (V' = U - W S, S += K^T V') and the output pass (o = scale (Q S + tril(Q K^T) V')), against the
independent loop-form reference of test_deltanet.py. This checks the mathematics before the kernels
exist, on any machine; the GPU suites will check their implementation.
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
