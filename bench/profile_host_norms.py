#!/usr/bin/env python3
"""Where the host time of the user-facing LayerNorm backward goes, piece by piece (us per call).

    python3 bench/profile_host_norms.py [--device cuda|cpu] [--shape 8x1024] [--iters 2000]

bench_norms.py's (U) backward of fastweight.layer_norm is slower than torch's at small shapes
although its kernel is faster: the difference is host time. This times, on a tiny shape (the GPU
work is negligible, so every number is host time; one synchronize per loop), the parts of the path:
torch's and fastweight's forward + backward through torch.autograd.backward, a trivial Python
autograd.Function (the floor of any Python backward), the raw backward calls without autograd, and
the pieces of fastweight's backward (allocations, the workspace-size query, the _C call).
No assertions: a measurement for docs/perf/norms.md.
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import import_fastweight  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="8x1024")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--profile", action="store_true", help="also torch.profiler tables of both paths (CUDA)")
    a = ap.parse_args()
    import torch
    import torch.nn.functional as F
    fw = import_fastweight()
    from fastweight import ops as fo
    from fastweight import _C

    dev = torch.device(a.device)
    M, N = (int(s) for s in a.shape.split("x"))
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=g).to(dev, dt)  # noqa: E731
    x, w, b, dy = mk(M, N).requires_grad_(), mk(N).requires_grad_(), mk(N).requires_grad_(), mk(M, N)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def timed(name, fn, n=a.iters):
        for _ in range(20):
            fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        us = (time.perf_counter() - t0) / n * 1e6
        print(f"| {name} | {us:.1f} |")
        return us

    class Trivial(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, b):
            ctx.save_for_backward(x, w, b)
            return x.clone()

        @staticmethod
        def backward(ctx, dy):
            ctx.saved_tensors
            return dy, None, None

    def fwbwd(f):
        def run():
            for t in (x, w, b):
                t.grad = None
            torch.autograd.backward(f(), dy)
        return run

    with torch.no_grad():
        y0, mean, rstd = torch.ops.aten.native_layer_norm(x, (N,), w, b, 1e-5)
        stats = fo._stats_buffer(x, 2)
        fo._ln_fwd(_C.layernorm_fwd, x, w, b, *fo._stats_specs(stats), 1e-5, 0.0)
    xs, ws, dys = fo._spec(x.detach()), fo._spec(w.detach()), fo._spec(dy)
    ms, rs = fo._stats_specs(stats)
    dx, dxs = fo._new_like(x.detach(), xs)
    dw, dws = fo._new_like(w.detach(), ws)
    db, dbs = fo._new_like(w.detach(), ws)
    args = (dys, xs, ws, ms, rs, dxs, dws, dbs, 0.0)
    nbytes = _C.layernorm_bwd_workspace_size(*args)
    wsp = x.new_empty(max(nbytes, 1), dtype=torch.uint8)
    stream = fo._stream(x)

    print(f"host time per call, {a.device} {dt} {M}x{N}, {a.iters} calls ({torch.__version__})")
    print("| what | us |")
    print("|---|---|")
    timed("torch: F.layer_norm forward + autograd backward", fwbwd(lambda: F.layer_norm(x, (N,), w, b)))
    timed("fastweight: layer_norm forward + autograd backward", fwbwd(lambda: fw.layer_norm(x, w, b)))
    timed("trivial Python autograd.Function (clone) forward + backward", fwbwd(lambda: Trivial.apply(x, w, b)))
    with torch.no_grad():
        timed("torch: F.layer_norm forward (no grad)", lambda: F.layer_norm(x, (N,), w, b))
        timed("fastweight: layer_norm forward (no grad)", lambda: fw.layer_norm(x, w, b))
        timed("torch: aten.native_layer_norm_backward", lambda: torch.ops.aten.native_layer_norm_backward(
            dy, x, (N,), mean, rstd, w, b, (True, True, True)))
        timed("fastweight: _ln_bwd (what the autograd backward calls)", lambda: fo._ln_bwd(
            _C.layernorm_bwd, _C.layernorm_bwd_workspace_size, 1, dy, x, w, ms, rs, 0.0, True))
        timed("  3 outputs + workspace: empty_like x 3, new_empty", lambda: (
            torch.empty_like(x), torch.empty_like(w), torch.empty_like(w), x.new_empty(nbytes, dtype=torch.uint8)))
        timed("  specs of dy, x, w", lambda: (fo._spec(dy), fo._spec(x), fo._spec(w)))
        timed("  _C.layernorm_bwd_workspace_size", lambda: _C.layernorm_bwd_workspace_size(*args))
        timed("  _C.layernorm_bwd (specs ready)", lambda: _C.layernorm_bwd(*args, (wsp.data_ptr(), nbytes), stream))
        timed("  _stream(x)", lambda: fo._stream(x))
        timed("  x.clone() (one torch op with an allocation)", lambda: x.clone())
    # the forward under autograd alone, and a trivial Function whose backward runs our raw backward
    timed("torch: F.layer_norm forward with grad (graph built, no backward)", lambda: F.layer_norm(x, (N,), w, b))
    timed("fastweight: layer_norm forward with grad (no backward)", lambda: fw.layer_norm(x, w, b))

    class TrivialLn(Trivial):  # the same forward
        @staticmethod
        def backward(ctx, dy):
            x, w, _ = ctx.saved_tensors
            return fo._ln_bwd(_C.layernorm_bwd, _C.layernorm_bwd_workspace_size, 1, dy, x, w, ms, rs, 0.0, True)

    timed("trivial Function (clone) whose backward is our _ln_bwd", fwbwd(lambda: TrivialLn.apply(x, w, b)))
    if a.profile and dev.type == "cuda":  # every thread's CPU ops and the kernels, 50 calls each
        from torch.profiler import ProfilerActivity, profile
        for name, f in (("torch", lambda: F.layer_norm(x, (N,), w, b)), ("fastweight", lambda: fw.layer_norm(x, w, b))):
            run = fwbwd(f)
            for _ in range(20):
                run()
            sync()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(50):
                    run()
                sync()
            print(f"\n### torch.profiler, {name}: forward + backward x 50 (self CPU total, top rows)")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=48))


if __name__ == "__main__":
    main()
