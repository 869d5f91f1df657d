#!/usr/bin/env python3
"""Side by side: fastweight's mLSTM against NX-AI's mlstm_kernels and causal softmax attention (torch
SDPA), forward and forward+backward, with peak memory (issue 3's benchmark; shapes from
shared/BENCHMARKS.md).

    python bench/bench_mlstm.py [--quick] [--out DIR] [--providers fastweight,limit_chunk,...]
    python bench/bench_mlstm.py --dry-cpu      # tiny shapes on the CPU: checks the script's logic

Providers (a failing one shows as n/a with its reason, the run goes on):
  fastweight      fastweight.mlstm (chunk 64; --chunk to change)
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

import argparse
import json
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SHAPES = [(2, 16, 8192, 128, 128), (1, 8, 8192, 256, 512), (8, 16, 8192, 128, 256), (4, 16, 4096, 128, 128),
          (2, 16, 1000, 128, 128), (2, 16, 4097, 128, 128)]
QUICK = [(2, 16, 8192, 128, 128), (2, 16, 1000, 128, 128)]
DRY = [(1, 2, 64, 16, 16), (1, 2, 37, 16, 8)]
PROVIDERS = ["fastweight", "xl_chunk", "limit_chunk", "parallel", "native", "sdpa"]


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def short(e: BaseException, n: int = 140) -> str:
    s = " ".join(f"{type(e).__name__}: {e}".split())
    return s if len(s) <= n else s[: n - 3] + "..."


def import_fastweight():
    try:
        import fastweight
        return fastweight
    except ImportError:
        for b in sorted((REPO / "build").glob("*/python")):
            sys.path.insert(0, str(b))
            try:
                import fastweight
                return fastweight
            except ImportError:
                sys.path.remove(str(b))
    raise ImportError("fastweight is not importable (build the Python module or set PYTHONPATH)")


def make_call(name, fw, chunk):
    """A function (q, k, v, i, f) -> h for a provider, or raises with the reason."""
    import torch
    if name == "fastweight":
        return lambda q, k, v, i, f: fw.mlstm(q, k, v, i, f, chunk_size=chunk)
    if name == "sdpa":
        return lambda q, k, v, i, f: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    from mlstm_kernels.torch import get_mlstm_kernel
    key = {"xl_chunk": "chunkwise--triton_xl_chunk", "limit_chunk": "chunkwise--triton_limit_chunk",
           "parallel": "parallel--triton_limit_headdim", "native": "chunkwise--native_custbw"}[name]
    kern = get_mlstm_kernel(key)
    if name == "parallel":
        return lambda q, k, v, i, f: kern(q, k, v, i, f)
    return lambda q, k, v, i, f: kern(q, k, v, i, f, chunk_size=chunk if name != "xl_chunk" else 128)


def timed(fn, cuda: bool, reps: int) -> float:
    import torch
    for _ in range(3):
        fn()
    if cuda:
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
    else:
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dry-cpu", action="store_true")
    ap.add_argument("--providers", default="")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=str(REPO / "bench" / "out"))
    a = ap.parse_args()
    import torch
    fw = import_fastweight()
    cuda = not a.dry_cpu
    if cuda and not torch.cuda.is_available():
        log("no CUDA device: use --dry-cpu")
        return 2
    dev = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    shapes = DRY if a.dry_cpu else QUICK if a.quick else SHAPES
    wanted = [p.strip() for p in a.providers.split(",") if p.strip()] or PROVIDERS
    rows = []
    for (B, NH, S, DQK, DV) in shapes:
        g = torch.Generator(device="cpu").manual_seed(0)
        mk = lambda *s: torch.randn(*s, generator=g).to(dev, dtype)  # noqa: E731
        q, k, v = mk(B, NH, S, DQK), mk(B, NH, S, DQK), mk(B, NH, S, DV)
        i, f = mk(B, NH, S), (mk(B, NH, S) + 3.0)
        ref_h = None
        for name in wanted:
            row = dict(shape=f"{B},{NH},{S},{DQK},{DV}", provider=name, dtype=str(dtype).replace("torch.", ""))
            try:
                call = make_call(name, fw, a.chunk)
                with torch.no_grad():
                    h = call(q, k, v, i, f)
                    row["fwd_ms"] = timed(lambda: call(q, k, v, i, f), cuda, a.reps)
                if name == "fastweight":
                    ref_h = h.float()
                elif ref_h is not None and name != "sdpa":
                    row["err"] = float((h.float() - ref_h).norm() / ref_h.norm())
                args = [t.detach().clone().requires_grad_() for t in (q, k, v, i, f)]
                dh = torch.randn_like(h)

                def fb():
                    out = call(*args)
                    torch.autograd.backward(out, dh)
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    fb()
                    torch.cuda.synchronize()
                    row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
                row["fwdbwd_ms"] = timed(fb, cuda, a.reps)
            except Exception as e:  # noqa: BLE001
                row["na"] = short(e)
            rows.append(row)
            log(row)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_mlstm.json").write_text(json.dumps(dict(device=dev, rows=rows), indent=1))
    print(f"| shape (B,NH,S,DQK,DV) | provider | fwd ms | fwd+bwd ms | peak GiB | h err vs fastweight |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "na" in r:
            print(f"| {r['shape']} | {r['provider']} | n/a ({r['na']}) | | | |")
            continue
        pk = f"{r['peak_gib']:.2f}" if "peak_gib" in r else "-"
        err = f"{r['err']:.1e}" if "err" in r else "-"
        print(f"| {r['shape']} | {r['provider']} | {r['fwd_ms']:.3f} | {r['fwdbwd_ms']:.3f} | {pk} | {err} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
