#!/usr/bin/env python3
"""Where the user-facing (U) backward's time goes, per op, dtype and shape: first asked for the
LayerNorm fp16 / bf16 gap (bench_norms.py, H200, session 38: 4096 x 8192 0.1222 against 0.0681 ms,
graph-replayed kernels level), then for LayerNorm against RMSNorm (session 45: (U) minus kernel time
+73 us for LayerNorm at 4096 x 5120, +12 for RMSNorm; session 50 in docs/perf/norms.md: not
LayerNorm's, the host floor of one eager backward).

For each op, dtype and shape, in one process, for fastweight's functional API and torch's: the host
time of one eager backward (torch.autograd.backward with retain_graph, grads set to None between
calls, no synchronize inside the loop), the GPU time of the same loop (CUDA events over --iters
calls), one call timed as bench_norms.py's (U) column times it (the L2 flushed by a 256 MB memset
before each call, events around the call alone; median), and a torch.profiler table of three calls
(kernels and CUDA runtime calls). No assertions: a measurement.

  PYTHONPATH=build/py/python python3 bench/probe_norm_u_dtype.py --shapes 4096x4096,4096x8192
  ... --ops layernorm,layernorm_nobias,rmsnorm --dtypes bfloat16 --shapes 4096x5120
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import import_fastweight  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096x4096,4096x8192")
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--ops", default="layernorm", help="comma-separated: layernorm, layernorm_nobias, rmsnorm")
    a = ap.parse_args()
    import torch
    import torch.nn.functional as F
    fw = import_fastweight()
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(64 * 1024 * 1024, dtype=torch.int32, device="cuda")
    for shape in a.shapes.split(","):
        M, N = (int(s) for s in shape.split("x"))
        for dname in a.dtypes.split(","):
            dt = getattr(torch, dname)
            x = torch.randn(M, N, device="cuda", dtype=dt).requires_grad_(True)
            w = torch.randn(N, device="cuda", dtype=dt).requires_grad_(True)
            b = torch.randn(N, device="cuda", dtype=dt).requires_grad_(True)
            dy = torch.randn(M, N, device="cuda", dtype=dt)
            cases = {
                "layernorm": (("fastweight", lambda: fw.layer_norm(x, w, b, 1e-5)),
                              ("torch", lambda: F.layer_norm(x, (N,), w, b, 1e-5))),
                "layernorm_nobias": (("fastweight", lambda: fw.layer_norm(x, w, None, 1e-5)),
                                     ("torch", lambda: F.layer_norm(x, (N,), w, None, 1e-5))),
                "rmsnorm": (("fastweight", lambda: fw.rms_norm(x, w, 1e-6)),
                            ("torch", lambda: F.rms_norm(x, (N,), w, 1e-6))),
            }
            for op, name, fn in ((op, n, f) for op in a.ops.split(",") for n, f in cases[op]):
                y = fn()

                def bwd():
                    x.grad = w.grad = b.grad = None
                    torch.autograd.backward(y, dy, retain_graph=True)

                for _ in range(10):
                    bwd()
                torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                e0.record()
                for _ in range(a.iters):
                    bwd()
                e1.record()
                host_us = (time.perf_counter() - t0) / a.iters * 1e6
                torch.cuda.synchronize()
                gpu_us = e0.elapsed_time(e1) / a.iters * 1e3
                flushed = []  # as bench_norms.py's (U) column: L2 flushed, events around the call alone
                for _ in range(30):
                    x.grad = w.grad = b.grad = None
                    flush.zero_()
                    e0.record()
                    torch.autograd.backward(y, dy, retain_graph=True)
                    e1.record()
                    torch.cuda.synchronize()
                    flushed.append(e0.elapsed_time(e1) * 1e3)
                flushed.sort()
                print(f"{op} {shape} {dname:9s} {name:10s} host {host_us:7.1f} us/call  gpu loop {gpu_us:7.1f} us/call  "
                      f"flushed one call {flushed[len(flushed) // 2]:7.1f} us  grads {x.grad.dtype} {w.grad.dtype} "
                      f"{None if b.grad is None else b.grad.dtype} x.grad strides {x.grad.stride()}")
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        bwd()
                    torch.cuda.synchronize()
                rows = []
                for ev in prof.key_averages():
                    dev_us = getattr(ev, "device_time_total", getattr(ev, "cuda_time_total", 0))
                    if dev_us > 0 or ev.key.startswith("cuda") or ev.key.startswith("aten::"):
                        rows.append((ev.key[:70], ev.count, ev.cpu_time_total / 3, dev_us / 3))
                rows.sort(key=lambda r: -max(r[2], r[3]))
                for k, c, cpu, dev in rows[:14]:
                    print(f"    {k:70s} x{c:3d}  cpu {cpu:8.1f} us  device {dev:8.1f} us (per call)")
            del x, w, b, dy, y
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
