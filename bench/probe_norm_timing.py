#!/usr/bin/env python3
"""Why do the LayerNorm forward's timings of fastweight and FLA reverse between ncu and the benchmark?

Times one CUDA-graph replay of each provider's training forward (fastweight.ops.layernorm_fwd, FLA's
layer_norm, F.layer_norm) under several L2 states, in one process, CUDA events, median of --reps:
  memset      256 MB memset before each replay (triton.testing.do_bench's flush: L2 left dirty)
  memset+wait the same, then ~0.1 ms of GPU sleep (writes in flight drained; L2 still dirty)
  read        256 MB read (a sum) before each replay: L2 full of clean lines
  hot         no flush (x hot in L2 where it fits)
  loop20      a graph of 20 back-to-back calls, time / 20 (no flush)
Then the kernels' own durations under the memset flush (torch.profiler / CUPTI), which excludes the
launch and the gaps: whether a reversal is inside the kernel or around it.

  PYTHONPATH=build/py/python:/tmp/site python3 bench/probe_norm_timing.py --shapes 4096x2048,4096x4096
"""
import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import import_fla  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096x1024,4096x2048,4096x4096,4096x8192,4096x16384")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--modes", default="memset,memset+wait,read,hot,loop20")
    a = ap.parse_args()
    import torch
    import fastweight
    import fastweight.ops as fwops
    try:
        fla = import_fla("fla.modules.layernorm")
    except Exception as e:  # noqa: BLE001
        print(f"FLA not loaded: {e}")
        fla = None
    dt = getattr(torch, a.dtype)
    stream = torch.cuda.Stream()
    torch.cuda.set_stream(stream)
    flush = torch.empty(64 * 1024 * 1024, dtype=torch.int32, device="cuda")
    flush_f = flush.view(torch.float32)
    red = torch.empty((), dtype=torch.float32, device="cuda")
    modes = a.modes.split(",")
    print(f"device {torch.cuda.get_device_name()}, fastweight {getattr(fastweight, '__version__', '?')}")
    print("ms per call (median); columns: " + ", ".join(modes) + "; last: kernel us under memset (CUPTI)")

    for shp in a.shapes.split(","):
        M, N = (int(s) for s in shp.split("x"))
        g = torch.Generator(device="cuda").manual_seed(M * 7 + N)
        x = (torch.randn(M, N, device="cuda", generator=g) * 2 + 0.5).to(dt).requires_grad_(True)
        w = (torch.randn(N, device="cuda", generator=g) * 0.1 + 1).to(dt).requires_grad_(True)
        b = (torch.randn(N, device="cuda", generator=g) * 0.1).to(dt).requires_grad_(True)
        calls = {"fastweight": lambda: fwops.layernorm_fwd(x.detach(), w.detach(), b.detach(), 1e-5, 0.0)[0],
                 "torch": lambda: torch.nn.functional.layer_norm(x, (N,), w, b, 1e-5)}
        if fla is not None:
            calls["fla"] = lambda: fla.layer_norm(x, w, b, eps=1e-5)
        for name, fn in calls.items():
            graphs = {}
            for k in (1, 20):
                for _ in range(2):
                    fn()
                torch.cuda.synchronize()
                gr = torch.cuda.CUDAGraph()
                with torch.cuda.graph(gr, stream=stream):
                    for _ in range(k):
                        fn()
                gr.replay()
                torch.cuda.synchronize()
                graphs[k] = gr
            row = []
            for mode in modes:
                gr = graphs[20 if mode == "loop20" else 1]
                ev = []
                for _ in range(a.reps):
                    if mode.startswith("memset"):
                        flush.zero_()
                        if mode == "memset+wait":
                            torch.cuda._sleep(200_000)
                    elif mode == "read":
                        torch.sum(flush_f, dim=None, out=red)
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    gr.replay()
                    e.record()
                    ev.append((s, e))
                torch.cuda.synchronize()
                ms = statistics.median(s.elapsed_time(e) for s, e in ev)
                row.append(ms / (20 if mode == "loop20" else 1))
            # the kernel's own duration under the memset flush
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(30):
                    flush.zero_()
                    graphs[1].replay()
                torch.cuda.synchronize()
            durs = {}
            for evt in prof.events():
                if evt.device_type.name == "CUDA" and "zero" not in evt.name.lower() and "fill" not in evt.name.lower():
                    durs.setdefault(evt.name[:60], []).append(evt.device_time)
            kern = "; ".join(f"{k}: {statistics.median(v):.2f} us x{len(v)}" for k, v in durs.items())
            print(f"{shp:>11} {name:>10} " + " ".join(f"{v:8.4f}" for v in row) + f"   [{kern}]", flush=True)

    if fla is not None:  # FLA autotunes its row kernels' num_warps per process: what it chose here
        import importlib
        mod = importlib.import_module(fla.layer_norm.__module__)
        for kname in ("layer_norm_fwd_kernel_row", "layer_norm_fwd_kernel"):
            tuner = getattr(mod, kname, None)
            for key, cfg in (getattr(tuner, "cache", None) or {}).items():
                print(f"FLA {kname} autotuned: key {key} -> {cfg}")


if __name__ == "__main__":
    main()
