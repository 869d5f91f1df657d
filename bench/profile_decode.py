#!/usr/bin/env python3
"""Run one decoding step per provider (bench_decode.py's providers and inputs) for ncu.

  ncu --clock-control none --profile-from-start off --kernel-name regex:'mlstm_step|recurrent_step' \\
      --section SpeedOfLight --section MemoryWorkloadAnalysis python3 bench/profile_decode.py --shape 0,256,8,256,512
  scripts/gpu-profile with FW_PROFILE_SCRIPT=decode does the same with more sections.

--shape FAMILY,B,heads,DK,DV (FAMILY 0 = mLSTM, 1 = DeltaNet). Each provider runs twice (warm-up:
Triton compiles), the second between cudaProfilerStart/Stop. --kernels N (no ncu): each kernel's GPU
time per step over N steps (torch.profiler). No timing otherwise: bench_decode.py times.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import import_fastweight, profile_or_table  # noqa: E402
from bench_decode import DELTANET_PROVIDERS, MLSTM_PROVIDERS, deltanet_call, mlstm_call  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="0,256,8,256,512", help="FAMILY,B,heads,DK,DV")
    ap.add_argument("--providers", default="fastweight,fastweight_inplace,mk_triton")
    ap.add_argument("--kernels", type=int, default=0, metavar="N",
                    help="no ncu: print each kernel's GPU time per step over N steps (torch.profiler)")
    a = ap.parse_args()
    import torch
    fw = import_fastweight()
    fam, B, NH, DK, DV = (int(x) for x in a.shape.split(","))
    g = torch.Generator(device="cpu").manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=g).to("cuda", torch.bfloat16)  # noqa: E731
    q, k, v = mk(B, NH, DK), mk(B, NH, DK), mk(B, NH, DV)
    known = MLSTM_PROVIDERS if fam == 0 else DELTANET_PROVIDERS
    for name in a.providers.split(","):
        if name not in known:
            print(f"profile_decode: {name} is not a provider of family {fam} ({', '.join(known)})")
            continue
        if fam == 0:
            call = mlstm_call(name, fw)
            i, f = mk(B, NH, 1).float(), mk(B, NH, 1).float() + 3.0

            def prepare():
                c = torch.randn(B, NH, DK, DV, generator=g).to("cuda") * 0.1
                n = torch.randn(B, NH, DK, generator=g).to("cuda") * 0.1
                m = torch.randn(B, NH, 1, generator=g).to("cuda")
                return q, k, v, i, f, c, n, m
        else:
            call = deltanet_call(name, fw)
            beta = torch.sigmoid(mk(B, NH).float()).to(torch.bfloat16)

            def prepare():
                return q, k, v, beta, torch.randn(B, NH, DK, DV, generator=g).to("cuda") * 0.1

        def run(args, call=call):
            with torch.no_grad():
                call(*args)
        profile_or_table(f"{name} {a.shape}", prepare, run, a.kernels)
    return 0


if __name__ == "__main__":
    sys.exit(main())
