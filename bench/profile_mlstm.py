#!/usr/bin/env python3
"""Run one mLSTM forward + backward per provider (fastweight, mlstm_kernels' limit_chunk) for ncu.

  ncu --clock-control none --profile-from-start off --kernel-name regex:'mlstm|chunk' \\
      --section SpeedOfLight python3 bench/profile_mlstm.py --shape 2,16,8192,128,128

Each provider runs twice (warm-up: Triton compile); the second runs between cudaProfilerStart/Stop.
No timing here: bench_mlstm.py times, this only feeds the profiler.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import import_fastweight, kernel_table, profile_second_run  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="2,16,8192,128,128", help="B,NH,S,DQK,DV")
    ap.add_argument("--providers", default="fastweight,limit_chunk")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--no-backward", action="store_true")
    ap.add_argument("--kernels", type=int, default=0, metavar="N",
                    help="no ncu: print each kernel's GPU time per call over N calls (torch.profiler)")
    a = ap.parse_args()
    import torch
    fw = import_fastweight()
    from bench_mlstm import make_call
    B, NH, S, DQK, DV = (int(x) for x in a.shape.split(","))
    g = torch.Generator(device="cpu").manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=g).to("cuda", torch.bfloat16)  # noqa: E731
    q, k, v, i = mk(B, NH, S, DQK), mk(B, NH, S, DQK), mk(B, NH, S, DV), mk(B, NH, S)
    f = mk(B, NH, S) + 3.0
    for name in a.providers.split(","):
        call = make_call(name, fw, a.chunk)

        def run(args, call=call):
            h = call(*args)
            if not a.no_backward:
                h.backward(torch.ones_like(h))

        def prepare():
            return [t.detach().clone().requires_grad_(not a.no_backward) for t in (q, k, v, i, f)]

        if a.kernels:
            kernel_table(name, prepare, run, a.kernels)
        else:
            profile_second_run(name, prepare, run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
