#!/usr/bin/env python3
"""Run one LayerNorm-family call per provider (fastweight, FLA, torch, cuDNN) for ncu to profile.

  ncu --clock-control none --kernel-name regex:'rownorm|layer_norm|norm' \\
      --section SpeedOfLight --section Occupancy --section WarpStateStats \\
      python3 bench/profile_norms.py --op layernorm --shape 4096x8192

Each provider runs forward + backward twice (warm-up: autotune, compile); profile the second
(the last iteration runs between cudaProfilerStart/Stop: ncu --profile-from-start off). No timing here: bench_norms.py times, this only feeds the profiler.
"""
import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_norms import Case, Env, make_cudnn  # noqa: E402  (fastweight / FLA / cuDNN set-up lives there)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--op", default="layernorm", choices=["layernorm", "rmsnorm"])
    ap.add_argument("--shape", default="4096x8192")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--providers", default="fastweight,fla,torch")
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--flush", choices=["none", "memset"], default="none",
                    help="memset: 256 MB memset before each provider's profiled call (do_bench's flush: the L2 left "
                         "full of dirty lines; profile with ncu --cache-control none to keep that state)")
    ap.add_argument("--fwd-only", action="store_true", help="forward calls only (no backward)")
    ap.add_argument("--fla-warps", type=int, default=0, help="restrict FLA's row kernels' autotune to this num_warps")
    a = ap.parse_args()
    env = Env(SimpleNamespace(dry_cpu=False, fastweight_path=None))
    torch = env.torch
    M, N = (int(s) for s in a.shape.split("x"))
    dt = getattr(torch, a.dtype)
    x = torch.randn(M, N, device="cuda", dtype=dt, requires_grad=True)
    w = torch.randn(N, device="cuda", dtype=dt, requires_grad=True)
    b = torch.randn(N, device="cuda", dtype=dt, requires_grad=True) if a.op == "layernorm" else None
    dy = torch.randn(M, N, device="cuda", dtype=dt)
    fw, fla = env.fw, env.fla
    if fla is not None and a.fla_warps:  # FLA autotunes num_warps per process (2..16): pin it for a like-for-like run
        import importlib
        mod = importlib.import_module(fla.layer_norm.__module__)
        for kname in ("layer_norm_fwd_kernel_row", "layer_norm_fwd_kernel"):
            tuner = getattr(mod, kname, None)
            if tuner is not None and hasattr(tuner, "configs"):
                tuner.configs = [c for c in tuner.configs if c.num_warps == a.fla_warps] or tuner.configs
    flush = torch.empty(64 * 1024 * 1024, dtype=torch.int32, device="cuda") if a.flush == "memset" else None
    calls = {
        "fastweight": (lambda: fw.layer_norm(x, w, b)) if a.op == "layernorm" else (lambda: fw.rms_norm(x, w)),
        "fla": (lambda: fla.layer_norm(x, w, b)) if a.op == "layernorm" else (lambda: fla.rms_norm(x, w, None)),
        "torch": (lambda: torch.nn.functional.layer_norm(x, (N,), w, b)) if a.op == "layernorm"
        else (lambda: torch.nn.functional.rms_norm(x, (N,), w)),
    }
    cudnn_impl = None
    if "cudnn" in a.providers.split(","):  # the graphs of bench_norms.py (fp32 scale/bias for LayerNorm)
        cudnn_impl = make_cudnn(env, Case(env, a.op, (M, N), dt))

        def run_cudnn():
            cudnn_impl.fwd()
            cudnn_impl.bwd()
    for it in range(a.iters):
        last = it == a.iters - 1
        if last:  # ncu --profile-from-start off: only this iteration (all threads, autograd's too)
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
        for name in a.providers.split(","):
            if name == "cudnn" and cudnn_impl is not None:
                run_cudnn()
            elif name in calls and (name != "fla" or fla is not None):
                if flush is not None:
                    flush.zero_()
                if a.fwd_only:
                    with torch.no_grad():
                        calls[name]()
                    continue
                y = calls[name]()
                y.backward(dy)
                x.grad = w.grad = None
                if b is not None:
                    b.grad = None
        torch.cuda.synchronize()
        if last:
            torch.cuda.profiler.stop()
    print("done", a)


if __name__ == "__main__":
    main()
