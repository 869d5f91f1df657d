#!/usr/bin/env python3
"""Side by side: fastweight's mLSTM against NX-AI's mlstm_kernels and causal softmax attention (torch
SDPA), forward and forward+backward, with peak memory (issue 3's benchmark; shapes from
shared/BENCHMARKS.md).

    python bench/bench_mlstm.py [--quick] [--out DIR] [--providers fastweight,limit_chunk,...]
    python bench/bench_mlstm.py --dry-cpu      # tiny shapes on the CPU: checks the script's logic
    python bench/bench_mlstm.py --parallel     # the parallel form: fw_parallel, parallel, sdpa at
                                               # its shapes (S <= 4096; the S x S work grows as S^2)

Providers (a failing one shows as n/a with its reason, the run goes on):
  fastweight      fastweight.mlstm (chunk 64; --chunk to change)
  fw_parallel     fastweight.mlstm_parallel (seed 000's parallel form, tiled; h of its (h, n, m))
  xl_chunk        mlstm_kernels chunkwise--triton_xl_chunk (TFLA; does not compile under Triton 3.6
                  on Hopper, BENCHMARKS.md)
  limit_chunk     mlstm_kernels chunkwise--triton_limit_chunk
  parallel        mlstm_kernels parallel--triton_limit_headdim (only small head dims)
  native          mlstm_kernels chunkwise--native_custbw (pure torch; the CPU dry run's peer)
  sdpa            torch.nn.functional.scaled_dot_product_attention(is_causal=True), same q, k, v
Timing: median of CUDA-event timed runs after warm-up (CPU: wall clock); fwd+bwd includes the
forward. Peak: torch.cuda.max_memory_allocated over one fwd+bwd, inputs included. err: relative
Frobenius difference of h against fastweight's (mlstm_kernels drops the normaliser's gradient, so
gradients are not compared here; tests/python/test_mlstm.py checks fastweight against float64).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import Ctx, measure, report, run_case, step  # noqa: E402

SHAPES = [(2, 16, 8192, 128, 128), (1, 8, 8192, 256, 512), (8, 16, 8192, 128, 256), (4, 16, 4096, 128, 128),
          (2, 16, 1000, 128, 128), (2, 16, 4097, 128, 128)]
QUICK = [(2, 16, 8192, 128, 128), (2, 16, 1000, 128, 128)]
DRY = [(1, 2, 64, 16, 16), (1, 2, 37, 16, 8)]
PROVIDERS = ["fastweight", "xl_chunk", "limit_chunk", "parallel", "native", "sdpa"]
PAR_SHAPES = [(2, 8, 2048, 64, 64), (2, 8, 2048, 128, 128), (1, 8, 4096, 128, 128), (4, 16, 1024, 256, 256)]
PAR_QUICK = [(2, 8, 2048, 128, 128)]
PAR_PROVIDERS = ["fw_parallel", "parallel", "sdpa"]


def make_call(name, fw, chunk):
    """A function (q, k, v, i, f) -> h for a provider, or raises with the reason."""
    import torch
    if name == "fastweight":
        return lambda q, k, v, i, f: fw.mlstm(q, k, v, i, f, chunk_size=chunk)
    if name == "fw_parallel":
        return lambda q, k, v, i, f: fw.mlstm_parallel(q, k, v, i, f)[0]
    if name == "sdpa":
        return lambda q, k, v, i, f: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    from mlstm_kernels.torch import get_mlstm_kernel
    key = {"xl_chunk": "chunkwise--triton_xl_chunk", "limit_chunk": "chunkwise--triton_limit_chunk",
           "parallel": "parallel--triton_limit_headdim", "native": "chunkwise--native_custbw"}[name]
    kern = get_mlstm_kernel(key)
    if name == "parallel":
        return lambda q, k, v, i, f: kern(q, k, v, i, f)
    return lambda q, k, v, i, f: kern(q, k, v, i, f, chunk_size=chunk if name != "xl_chunk" else 128)


def main():
    par = "--parallel" in sys.argv[1:]
    argv = [a for a in sys.argv[1:] if a != "--parallel"]
    if par:
        c = Ctx(__doc__, PAR_SHAPES, PAR_QUICK, DRY, PAR_PROVIDERS, argv)
    else:
        c = Ctx(__doc__, SHAPES, QUICK, DRY, PROVIDERS, argv)
    torch = c.torch
    for (B, NH, S, DQK, DV) in c.shapes:
        _, mk = c.maker()
        q, k, v = mk(B, NH, S, DQK), mk(B, NH, S, DQK), mk(B, NH, S, DV)
        i, f = mk(B, NH, S), (mk(B, NH, S) + 3.0)
        ref = {}
        for name in c.wanted:
            def body(row, name=name):
                call = make_call(name, c.fw, c.a.chunk)
                with torch.no_grad():
                    h = call(q, k, v, i, f)
                if name in ("fastweight", "fw_parallel"):
                    ref["h"] = h.float()
                elif "h" in ref and name != "sdpa":
                    row["err"] = float((h.float() - ref["h"]).norm() / ref["h"].norm())
                args = [t.detach().clone().requires_grad_() for t in (q, k, v, i, f)]
                dh = torch.randn_like(h)
                measure(row, torch, c.cuda, c.a.reps, lambda: call(q, k, v, i, f),
                        step(args, lambda: torch.autograd.backward(call(*args), dh)), c.a.graph,
                        lambda gl=[t.detach().clone().requires_grad_() for t in args]:
                            torch.autograd.grad(call(*gl), gl, dh, allow_unused=True))
            run_case(c.rows, c.row(f"{B},{NH},{S},{DQK},{DV}", name), body)
    report(c.rows, c.a.out, "bench_mlstm_parallel" if par else "bench_mlstm", c.dev, "shape (B,NH,S,DQK,DV)", "h err vs fastweight")
    return 0


if __name__ == "__main__":
    sys.exit(main())
