#!/usr/bin/env python3
"""Writes the golden file of DeltaNet: an independent float64 PyTorch autograd implementation of
shared/MATH.md §3 (plain torch ops, a direct step-by-step loop, no fastweight code), on small random
inputs.

    python tests/golden/make_golden_deltanet.py    # rewrites tests/golden/deltanet.txt

File format as norms.txt and mlstm.txt, one tensor per line: `<case>.<name> <ndim> <d0> ... <v0> <v1> ...`
(values %.17g). tests/cpp/test_deltanet_reference.cpp reads it and checks every form of the CPU
reference (src/reference/deltanet_ref.cpp: loop, single chunk, chunkwise) against it.

Layout and conventions as flash-linear-attention: q, k (B,T,H,K), v (B,T,H,V), beta (B,T,H), states
(N,H,K,V); optional L2 norm of q and k rows, x / sqrt(sum x^2 + 1e-6); o_t = scale S_t^T q_t with
    S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T.
Variable length: B = 1 and cu_seqlens (N+1 offsets, written as floats) packs N sequences along T,
each with its own initial and final state (zero-length ones included).
Per case: inputs q, k, v, beta, h0 and the loss weights do, dht; outputs o, ht; the gradients
dq, dk, dv, dbeta, dh0 of sum(do * o) + sum(dht * ht); `scale` (the value used), `scale_default`
(1: the caller passes no scale and gets K^-0.5), `l2` (1: use_qk_l2norm_in_kernel).
The loop is asserted equal to the product form S_t = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
(seed 002's scan) before anything is written.
"""
import torch
from golden_io import GoldenWriter

torch.manual_seed(20261123)
f64 = torch.float64
golden = GoldenWriter()
put = golden.put


def l2norm(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def sequences(B, T, cu):
    """(batch index, first position, end position) of every sequence."""
    if cu is None:
        return [(b, 0, T) for b in range(B)]
    return [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]


def deltanet(q, k, v, beta, scale, h0, l2, cu, product_form=False):
    """o (B,T,H,V), final states (N,H,K,V); one step after the other."""
    if l2:
        q, k = l2norm(q), l2norm(k)
    B, T, H, K = q.shape
    V = v.shape[-1]
    eye = torch.eye(K, dtype=f64)
    pieces, finals = [], []
    for n, (b, bos, eos) in enumerate(sequences(B, T, cu)):
        S = h0[n]                                              # (H,K,V)
        rows = [torch.zeros(0, H, V, dtype=f64)]
        for t in range(bos, eos):
            kt, vt, qt, bt = k[b, t], v[b, t], q[b, t], beta[b, t]   # (H,K) (H,V) (H,K) (H)
            if product_form:
                A = eye - bt[:, None, None] * kt[:, :, None] * kt[:, None, :]   # (H,K,K)
                S = A @ S + bt[:, None, None] * kt[:, :, None] * vt[:, None, :]
            else:
                e = vt - torch.einsum("hkv,hk->hv", S, kt)     # (H,V): what the memory misses
                S = S + bt[:, None, None] * kt[:, :, None] * e[:, None, :]
            rows.append(scale * torch.einsum("hkv,hk->hv", S, qt)[None])
        pieces.append(torch.cat(rows, 0))                      # (len,H,V)
        finals.append(S)
    o = torch.cat(pieces, 0)[None] if cu is not None else torch.stack(pieces, 0)
    return o, torch.stack(finals, 0)


def case(name, B, T, H, K, V, l2, scale=None, cu=None, beta_range=(0.0, 1.0)):
    N = B if cu is None else len(cu) - 1
    key_sd = 1.0 if l2 else K ** -0.5                          # |k| ~ 1 keeps the loop stable
    q = torch.randn(B, T, H, K, dtype=f64).requires_grad_()
    k = (torch.randn(B, T, H, K, dtype=f64) * key_sd).requires_grad_()
    v = torch.randn(B, T, H, V, dtype=f64).requires_grad_()
    lo, hi = beta_range
    beta = (lo + (hi - lo) * torch.rand(B, T, H, dtype=f64)).requires_grad_()
    h0 = torch.randn(N, H, K, V, dtype=f64).requires_grad_()
    s = K ** -0.5 if scale is None else scale
    o, ht = deltanet(q, k, v, beta, s, h0, l2, cu)
    op, hp = deltanet(q, k, v, beta, s, h0, l2, cu, product_form=True)
    for a, r in [(o, op), (ht, hp)]:
        assert torch.allclose(a, r, rtol=1e-12, atol=1e-12), (name, (a - r).abs().max().item())
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    loss = (do * o).sum() + (dht * ht).sum()
    grads = torch.autograd.grad(loss, [q, k, v, beta, h0])
    put(name, "scale", torch.tensor([s], dtype=f64))
    put(name, "scale_default", torch.tensor([1.0 if scale is None else 0.0], dtype=f64))
    put(name, "l2", torch.tensor([1.0 if l2 else 0.0], dtype=f64))
    if cu is not None:
        put(name, "cu_seqlens", torch.tensor(cu, dtype=f64))
    for n_, t in [("q", q), ("k", k), ("v", v), ("beta", beta), ("h0", h0), ("do", do), ("dht", dht),
                  ("o", o), ("ht", ht)]:
        put(name, n_, t)
    for n_, g in zip(["dq", "dk", "dv", "dbeta", "dh0"], grads):
        put(name, n_, g)


# B = 2 equal-length sequences, K != V, default scale, no norm
case("basic", 2, 9, 2, 6, 5, l2=False)
# in-kernel L2 norm, an explicit scale, beta up to 2 (still stable with unit keys)
case("l2", 2, 11, 3, 4, 7, l2=True, scale=0.7, beta_range=(0.0, 2.0))
# variable length: 6 sequences of 4, 0, 7, 1, 0, 7 positions (zero-length ones keep their state)
case("varlen", 1, 19, 2, 5, 3, l2=True, cu=[0, 4, 4, 11, 12, 12, 19])
# longer than FLA's chunk of 64 (a tail of 6), with the norm
case("long", 1, 70, 2, 8, 6, l2=True)

golden.write(__file__, "deltanet.txt")
