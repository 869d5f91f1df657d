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
"""
import math
import pathlib

import torch

torch.manual_seed(20261122)
f64 = torch.float64
out = []


def put(case, name, t):
    t = t.detach().to(f64).contiguous()
    vals = " ".join(f"{v:.17g}" for v in t.flatten().tolist())
    out.append(f"{case}.{name} {t.dim()} {' '.join(str(s) for s in t.shape)} {vals}")


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

path = pathlib.Path(__file__).with_name("mlstm.txt")
path.write_text("\n".join(out) + "\n")
print(f"wrote {path} ({len(out)} tensors, {path.stat().st_size} bytes)")
