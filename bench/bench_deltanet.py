#!/usr/bin/env python3
"""Side by side: fastweight's DeltaNet against flash-linear-attention (FLA), forward and
forward+backward, with peak memory (issue 4's benchmark; shapes from shared/BENCHMARKS.md).

    python bench/bench_deltanet.py [--quick] [--out DIR] [--providers fastweight,fla_chunk,...]
    python bench/bench_deltanet.py --dry-cpu      # tiny shapes on the CPU: checks the script's logic

Providers (a failing one shows as n/a with its reason): fastweight (fastweight.delta_rule),
fastweight_bf16ops (the same with split_operands=False: bf16-only tensor-core operands), fla_chunk (fla.ops.delta_rule.chunk_delta_rule), fla_recurrent (fused_recurrent_delta_rule).
Inputs: q, k, v (B, T, H, D) in bf16 (fp32 on the CPU), beta = sigmoid(noise), the in-kernel L2 norm
of q and k on, an initial state, output_final_state. Varlen rows: B = 1 with cu_seqlens.
Timing: median of CUDA-event timed runs after warm-up (CPU: wall clock). Peak:
torch.cuda.max_memory_allocated over one fwd+bwd. err: relative difference of o against fastweight's.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import Ctx, import_fla, measure, report, run_case, step  # noqa: E402

# (B, T, H, K=V, varlen sequences or 0)
SHAPES = [(4, 4096, 16, 128, 0), (2, 8192, 16, 128, 0), (8, 2048, 32, 64, 0), (1, 32768, 16, 128, 0),
          (1, 32768, 16, 128, 8)]
QUICK = [(4, 4096, 16, 128, 0), (1, 32768, 16, 128, 8)]
DRY = [(2, 70, 2, 16, 0), (1, 90, 2, 16, 3)]
PROVIDERS = ["fastweight", "fastweight_bf16ops", "fla_chunk", "fla_recurrent"]


def make_call(name, fw):
    if name in ("fastweight", "fastweight_bf16ops"):  # bf16ops: split_operands=False (FLA's precision)
        split = name == "fastweight"
        return lambda q, k, v, b, h0, cu: fw.delta_rule(q, k, v, b, initial_state=h0, output_final_state=True,
                                                       use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                                                       split_operands=split)
    mod = import_fla("fla.ops.delta_rule")
    fn = {"fla_chunk": mod.chunk_delta_rule, "fla_recurrent": mod.fused_recurrent_delta_rule}[name]
    return lambda q, k, v, b, h0, cu: fn(q, k, v, b, initial_state=h0, output_final_state=True,
                                         use_qk_l2norm_in_kernel=True, cu_seqlens=cu)


def main():
    c = Ctx(__doc__, SHAPES, QUICK, DRY, PROVIDERS)
    torch, dev, dtype = c.torch, c.dev, c.dtype
    for sh in c.shapes:
        B, T, H, D, nseq = (*sh, 0)[:5]  # --shapes may leave out the varlen count (B,T,H,D)
        g, mk = c.maker()
        q, k, v = mk(B, T, H, D), mk(B, T, H, D), mk(B, T, H, D)
        beta = torch.sigmoid(mk(B, T, H).float()).to(dtype)
        cu = None
        if nseq:
            cuts = torch.sort(torch.randperm(T - 1, generator=g)[: nseq - 1] + 1).values
            cu = torch.cat([torch.tensor([0]), cuts, torch.tensor([T])]).to(dev, torch.int32)
        h0 = torch.randn(nseq or B, H, D, D, generator=g).to(dev, torch.float32) * 0.1
        shape = f"{B},{T},{H},{D}" + (f" varlen {nseq}" if nseq else "")
        ref = {}
        for name in c.wanted:
            def body(row, name=name):
                call = make_call(name, c.fw)
                with torch.no_grad():
                    o, _ = call(q, k, v, beta, h0, cu)
                if name == "fastweight":
                    ref["o"] = o.float()
                elif "o" in ref:
                    row["err"] = float((o.float() - ref["o"]).norm() / ref["o"].norm())
                args = [t.detach().clone().requires_grad_() for t in (q, k, v, beta)]
                h0g = h0.clone().requires_grad_()
                do = torch.randn_like(o)

                def fwdbwd():
                    out, ht = call(*args, h0g, cu)
                    torch.autograd.backward([out, ht], [do, torch.ones_like(ht)])
                gl = [t.detach().clone().requires_grad_() for t in args + [h0g]]  # first used in graph_ms's warm-up

                def fwdbwd_grad():
                    out, ht = call(*gl, cu)
                    torch.autograd.grad([out, ht], gl, [do, torch.ones_like(ht)], allow_unused=True)
                measure(row, torch, c.cuda, c.a.reps, lambda: call(q, k, v, beta, h0, cu), step(args + [h0g], fwdbwd),
                        c.a.graph, fwdbwd_grad)
            run_case(c.rows, c.row(shape, name), body)
    report(c.rows, c.a.out, "bench_deltanet", c.dev, "shape (B,T,H,K=V)", "o err vs fastweight")
    return 0


if __name__ == "__main__":
    sys.exit(main())
