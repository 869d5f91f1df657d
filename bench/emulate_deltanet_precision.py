#!/usr/bin/env python3
"""What the DeltaNet tensor-core forward's operand precision costs in accuracy, on the CPU.

The forward pipeline (src/cuda/deltanet/deltanet_chunk_tc.cu) is emulated chunk by chunk in float32
torch, rounding to bfloat16 where the kernels do: A1 = T2 diag(rk) and A2 = T2 (wy), Xw = A1 K, S in
X = Xu - Xw S, D = diag(rk beta) X in S += K^T D, S in o = Q S + ..., and o itself. Each of those
operands is either bf16 hi + lo (split_operands=True) or bf16 alone (False); the variants below drop
the lo halves one at a time and all together. Errors: relative Frobenius norm of o and of the final
state against the same chunked algebra in float64 (equal to the loop form; see
tests/python/test_deltanet_design.py), on bf16 inputs with the L2 norm, beta = sigmoid(noise) and a
small initial state as bench_deltanet.py draws them.

With --backward: the tensor-core backward (deltanet_bwd_tc.cu: recompute, prep, serial, post and
chunk passes, then the L2-norm backward) emulated the same way, all hi + lo or all bf16, its
gradients against float64 autograd of the loop form (the bf16 rounding of dq, dk, dv themselves left
out: it adds ~1.7e-3 on top, as o's rounding does).

    python bench/emulate_deltanet_precision.py [T] [H]              # default T = 4096, H = 4, K = V = 128
    python bench/emulate_deltanet_precision.py --backward [T] [K]   # default T = 1000, H = 2, K = V = 100
"""
import sys

import torch


def bf(x):
    return x.to(torch.bfloat16).to(x.dtype)


def split(x):  # bf16 hi + lo, as float32 values
    h = bf(x)
    return h, bf(x - h)


def run(q, k, v, beta, h0, cfg=None):
    """o (H, T, V) and the final state (H, K, V); cfg None: float64 exact, else float32 with the roundings."""
    exact = cfg is None
    dt = torch.float64 if exact else torch.float32
    q, k, v, beta, S = (t.to(dt) for t in (q, k, v, beta, h0))
    H, T, K = q.shape
    rq = (q * q).sum(-1, keepdim=True).add(1e-6).rsqrt()
    rk = (k * k).sum(-1, keepdim=True).add(1e-6).rsqrt()
    o = torch.zeros(H, T, v.shape[-1], dtype=dt)
    scale = K ** -0.5
    for c0 in range(0, T, 64):
        c1 = min(T, c0 + 64)
        Q, Kc, Vc, bt, r, rqc = q[:, c0:c1], k[:, c0:c1], v[:, c0:c1], beta[:, c0:c1], rk[:, c0:c1], rq[:, c0:c1]
        Kh = Kc * r
        eye = torch.eye(c1 - c0, dtype=dt)
        Lg = torch.tril(Kh @ Kh.transpose(1, 2), -1) * bt[:, None, :]
        T2 = torch.linalg.solve_triangular(eye + Lg, eye.expand_as(Lg).contiguous(), upper=False, unitriangular=True)
        w = (bt * r[..., 0])[..., None]  # rk beta per row
        Kt = Kc.transpose(1, 2)
        if exact:
            X = T2 @ Vc - (T2 @ Kh) @ S
            o[:, c0:c1] = scale * rqc * (Q @ S + torch.tril(Q @ Kt) @ (w * X))
            S = S + Kt @ (w * X)
            continue
        a1h, a1l = split(T2 * r.transpose(1, 2))
        a2h, a2l = split(T2)
        Xw = a1h @ Kc + (a1l @ Kc if cfg["a1lo"] else 0)
        Xu = a2h @ Vc + (a2l @ Vc if cfg["a2lo"] else 0)
        xwh, xwl = split(Xw)
        sh, sl = split(S)
        P = xwh @ sh + (xwh @ sl if cfg["x_sl"] else 0) + (xwl @ sh if cfg["x_xl"] else 0)
        D = w * (Xu - P)
        dh, dl = split(D)
        O = Q @ sh + (Q @ sl if cfg["o_sl"] else 0) + torch.tril(Q @ Kt) @ dh
        o[:, c0:c1] = bf(scale * rqc * O)
        S = S + Kt @ dh + (Kt @ dl if cfg["u_lo"] else 0)
    return o, S


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def val(x, lo):
    """The value a tensor core sees of fp32 x: bf16 hi + lo summed, or bf16 hi."""
    h = bf(x)
    return h + bf(x - h) if lo else h


def prod(a, b, lo):
    """a b with both operands from fp32: Ah Bh + Ah Bl + Al Bh (lo), or Ah Bh."""
    ah, bh = bf(a), bf(b)
    if not lo:
        return ah @ bh
    return ah @ bh + ah @ bf(b - bh) + bf(a - ah) @ bh


def backward(q, k, v, beta, h0, do, dht, lo, scale):
    """(dq, dk, dv, dbeta, dh0) as the tensor-core backward rounds them; q, k, v, do (H, T, D)."""
    f = torch.float32
    q, k, v, beta, h0, do, dht = (t.to(f) for t in (q, k, v, beta, h0, do, dht))
    H, T, _ = q.shape
    rq = (q * q).sum(-1, keepdim=True).add(1e-6).rsqrt()
    rk = (k * k).sum(-1, keepdim=True).add(1e-6).rsqrt()
    tr = lambda x: x.transpose(1, 2)  # noqa: E731
    chunks, S = [], h0.clone()
    for c0 in range(0, T, 64):  # the recompute (wy + state kernels)
        c1 = min(T, c0 + 64)
        Kc, Vc, bt, r = k[:, c0:c1], v[:, c0:c1], beta[:, c0:c1], rk[:, c0:c1]
        eye = torch.eye(c1 - c0, dtype=f)
        Lg = torch.tril((Kc * r) @ tr(Kc * r), -1)
        T2 = torch.linalg.solve_triangular(eye + Lg * bt[:, None, :], eye.expand_as(Lg).contiguous(), upper=False,
                                           unitriangular=True)
        Xw = val(val(T2 * tr(r), lo) @ Kc, lo)  # stored as hi (+ lo)
        X = val(T2, lo) @ Vc - prod(Xw, S, lo)
        chunks.append((c0, c1, val(S, lo), Lg, T2, X, Xw))
        S = S + tr(Kc) @ val((bt * r[..., 0])[..., None] * X, lo)
    dq, dk, dv, db = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), torch.zeros_like(beta)
    dS = dht.clone()
    for c0, c1, S0, Lg, T2, X, Xw in reversed(chunks):
        Q, Kc, bt, dO, rqc, rkc = q[:, c0:c1], k[:, c0:c1], beta[:, c0:c1, None], do[:, c0:c1], rq[:, c0:c1], rk[:, c0:c1]
        E = val(dS, lo)  # dSe as stored
        dD = val(torch.triu(scale * rkc * (Kc @ tr(Q)) * tr(rqc)), lo) @ dO + rkc * (Kc @ E)  # prep + serial
        dS = dS + tr(Q) @ val(scale * rqc * dO, lo) + tr(Xw) @ val(-bt * dD, lo)
        dR = val(prod(tr(T2), bt * dD, lo), lo)  # post
        Y = dD - val(tr(Lg), lo) @ dR
        dv[:, c0:c1], db[:, c0:c1] = dR, (Y * X).sum(-1)
        D, R = val(bt * X, lo), val(-bt * Y, lo)  # the chunk pass
        m = scale * torch.tril(dO @ tr(D))
        dG = torch.tril(R @ tr(D), -1)
        dq[:, c0:c1] = scale * dO @ tr(S0) + val(m * tr(rkc), lo) @ Kc
        dk[:, c0:c1] = D @ tr(E) + R @ tr(S0) + val(tr(m) * tr(rqc), lo) @ Q + val((dG + tr(dG)) * tr(rkc), lo) @ Kc
    qh, kh = q * rq, k * rk  # the L2-norm backward
    dq = rq * (dq - qh * (qh * dq).sum(-1, keepdim=True))
    dk = rk * (dk - kh * (kh * dk).sum(-1, keepdim=True))
    return dq, dk, dv, db, dS


def loop_reference(q, k, v, beta, h0, scale):
    """MATH.md's loop form in float64 with the L2 norm, differentiable: o (H, T, V), final state."""
    q = q * (q * q).sum(-1, keepdim=True).add(1e-6).rsqrt()
    k = k * (k * k).sum(-1, keepdim=True).add(1e-6).rsqrt()
    S, rows = h0, []
    for t in range(q.shape[1]):
        e = v[:, t] - torch.einsum("hkv,hk->hv", S, k[:, t])
        S = S + beta[:, t, None, None] * k[:, t, :, None] * e[:, None, :]
        rows.append(scale * torch.einsum("hkv,hk->hv", S, q[:, t]))
    return torch.stack(rows, 1), S


def main_backward(T, D):
    H = 2
    g = torch.Generator().manual_seed(1)
    q, k, v, do = (bf(torch.randn(H, T, D, generator=g, dtype=torch.float64)) for _ in range(4))
    beta = bf(torch.rand(H, T, generator=g, dtype=torch.float64))
    h0 = torch.randn(H, D, D, generator=g, dtype=torch.float64).float().double() * 0.5
    dht = torch.randn(H, D, D, generator=g, dtype=torch.float64).float().double()
    scale = D ** -0.5
    ins = [t.clone().requires_grad_() for t in (q, k, v, beta, h0)]
    o, ht = loop_reference(*ins, scale)
    torch.autograd.backward([o, ht], [do, dht])
    print(f"backward, T = {T}, H = {H}, K = V = {D}, L2 norm, against float64 autograd:")
    for lo in (True, False):
        got = backward(q, k, v, beta, h0, do, dht, lo, scale)
        errs = " ".join(f"{n} {rel(a, t.grad):.2e}" for n, a, t in zip(("dq", "dk", "dv", "dbeta", "dh0"), got, ins))
        print(f"  {'hi + lo' if lo else 'bf16 only':9s} {errs}", flush=True)


def main():
    torch.set_num_threads(2)
    if len(sys.argv) > 1 and sys.argv[1] == "--backward":
        a = sys.argv[2:]
        return main_backward(int(a[0]) if a else 1000, int(a[1]) if len(a) > 1 else 100)
    T = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    H = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    D = 128
    g = torch.Generator().manual_seed(0)
    q, k, v = (bf(torch.randn(H, T, D, generator=g)) for _ in range(3))
    beta = bf(torch.sigmoid(torch.randn(H, T, generator=g)))
    h0 = torch.randn(H, D, D, generator=g) * 0.1
    ro, rS = run(q, k, v, beta, h0)
    full = dict(a1lo=1, a2lo=1, x_sl=1, x_xl=1, o_sl=1, u_lo=1)
    variants = {
        "hi + lo everywhere (split_operands=True)": full,
        "no Xw lo in X = Xu - Xw S": {**full, "x_xl": 0},
        "no S lo in X = Xu - Xw S": {**full, "x_sl": 0},
        "no D lo in S += K^T D": {**full, "u_lo": 0},
        "no S lo in o": {**full, "o_sl": 0},
        "no lo in the wy factors A1, A2": {**full, "a1lo": 0, "a2lo": 0},
        "bf16 only (split_operands=False)": {key: 0 for key in full},
    }
    print(f"T = {T}, H = {H}, K = V = {D}; o rounded to bf16 alone: {rel(bf(ro.float()), ro):.2e}")
    for name, cfg in variants.items():
        o, S = run(q, k, v, beta, h0, cfg)
        print(f"  {name:42s} o {rel(o, ro):.2e}   final state {rel(S, rS):.2e}", flush=True)


if __name__ == "__main__":
    main()
