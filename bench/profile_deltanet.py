#!/usr/bin/env python3
"""Run one DeltaNet forward + backward per provider (fastweight, FLA's chunk_delta_rule) for ncu.

  ncu --clock-control none --profile-from-start off --kernel-name regex:'deltanet|chunk' \\
      --section SpeedOfLight python3 bench/profile_deltanet.py --shape 4,4096,16,128
  ... python3 bench/profile_deltanet.py --shape 1,32768,16,128 --varlen 8    # bench_deltanet.py's varlen row

Each provider runs twice (warm-up: Triton compile); the second runs between cudaProfilerStart/Stop.
No timing here: bench_deltanet.py times, this only feeds the profiler.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import import_fastweight, kernel_table, profile_second_run  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="4,4096,16,128", help="B,T,H,K (K = V)")
    ap.add_argument("--providers", default="fastweight,fla_chunk")
    ap.add_argument("--no-backward", action="store_true")
    ap.add_argument("--kernels", type=int, default=0, metavar="N",
                    help="no ncu: print each kernel's GPU time per call over N calls (torch.profiler)")
    ap.add_argument("--varlen", type=int, default=0, help="N sequences packed into T (B = 1), cut as bench_deltanet.py cuts them")
    a = ap.parse_args()
    import torch
    fw = import_fastweight()
    from bench_deltanet import make_call
    B, T, H, D = (int(x) for x in a.shape.split(","))
    g = torch.Generator(device="cpu").manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=g).to("cuda", torch.bfloat16)  # noqa: E731
    q, k, v = mk(B, T, H, D), mk(B, T, H, D), mk(B, T, H, D)
    beta = torch.sigmoid(mk(B, T, H).float()).to(torch.bfloat16)
    cu = None
    if a.varlen:  # the same cuts as bench_deltanet.py (same generator state after q, k, v, beta)
        cuts = torch.sort(torch.randperm(T - 1, generator=g)[: a.varlen - 1] + 1).values
        cu = torch.cat([torch.tensor([0]), cuts, torch.tensor([T])]).to("cuda", torch.int32)
    h0 = torch.randn(a.varlen or B, H, D, D, generator=g).to("cuda", torch.float32) * 0.1
    for name in a.providers.split(","):
        call = make_call(name, fw)

        def run(args, call=call):
            o, ht = call(*args[:4], args[4], cu)
            if not a.no_backward:
                torch.autograd.backward([o, ht], [torch.ones_like(o), torch.ones_like(ht)])

        def prepare():
            return [t.detach().clone().requires_grad_(not a.no_backward) for t in (q, k, v, beta, h0)]

        if a.kernels:
            kernel_table(name, prepare, run, a.kernels)
        else:
            profile_second_run(name, prepare, run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
