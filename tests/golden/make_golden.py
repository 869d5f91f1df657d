#!/usr/bin/env python3
"""Writes the golden files of the LayerNorm family: an independent float64 PyTorch autograd
implementation of shared/MATH.md §1 (plain torch ops, no fastweight code), on small random inputs.

    python tests/golden/make_golden.py          # rewrites tests/golden/norms.txt

File format, one tensor per line: `<case>.<name> <ndim> <d0> ... <v0> <v1> ...` (values %.17g).
tests/cpp/test_norm_reference.cpp reads it and checks the CPU reference against it.
"""
import torch
from golden_io import GoldenWriter

torch.manual_seed(20261122)
f64 = torch.float64
golden = GoldenWriter()
put = golden.put


def normalize(x, eps, rms=False):
    if rms:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps), None, None
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    rstd = 1.0 / torch.sqrt(var + eps)
    return (x - mean) * rstd, mean, rstd


def case(name, x, params, fn, eps):
    x = x.to(f64).requires_grad_()
    params = {k: v.to(f64).requires_grad_() for k, v in params.items()}
    y = fn(x, params, eps)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, *params.values()], dy)
    put(name, "eps", torch.tensor([eps], dtype=f64))
    put(name, "x", x)
    for k, v in params.items():
        put(name, k, v)
    put(name, "dy", dy)
    put(name, "y", y)
    put(name, "dx", grads[0])
    for (k, _), g in zip(params.items(), grads[1:]):
        put(name, "d" + k, g)


case("layernorm", torch.randn(3, 4, 37) * 3 + 1, {"weight": torch.randn(37), "bias": torch.randn(37)},
     lambda x, p, eps: normalize(x, eps)[0] * p["weight"] + p["bias"], 1e-5)
case("rmsnorm", torch.randn(5, 29) + 0.5, {"weight": torch.randn(29)},
     lambda x, p, eps: normalize(x, eps, rms=True)[0] * p["weight"], 1e-6)
# head norm: x (B, S, NH, DH), weight/bias (NH, DH), scale = 1 + weight (xLSTM's weight_offset = 1)
case("headnorm", torch.randn(2, 3, 4, 16), {"weight": 0.1 * torch.randn(4, 16), "bias": torch.randn(4, 16)},
     lambda x, p, eps: normalize(x, eps)[0] * (1.0 + p["weight"]) + p["bias"], 1e-6)
# adaptive layer norm: x (B, S, D), scale/shift (B, 1, D)
case("adalayernorm", torch.randn(2, 6, 24) * 2, {"scale": torch.randn(2, 1, 24), "shift": torch.randn(2, 1, 24)},
     lambda x, p, eps: normalize(x, eps)[0] * p["scale"] + p["shift"], 1e-5)

golden.write(__file__, "norms.txt")
