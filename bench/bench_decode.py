#!/usr/bin/env python3
"""Side by side: one decoding step (one token, fp32 states) of fastweight's mLSTM and DeltaNet against
the peers' step kernels (shared/BENCHMARKS.md: B in {1, 8, 64, 256}).

    python bench/bench_decode.py [--quick] [--out DIR] [--providers fastweight,mk_triton,...]
    python bench/bench_decode.py --dry-cpu      # tiny shapes on the CPU: checks the script's logic

Rows (--shapes 'FAMILY,B,NH,DK,DV;...', FAMILY 0 = mLSTM, 1 = DeltaNet):
  mLSTM (B, NH=8, DQK=256, DV=512): xLSTM 7B's heads; DeltaNet (B, H=16, K=V=128).
Providers (a failing one shows as n/a with its reason):
  mLSTM: fastweight (fastweight.mlstm_step, new states returned), fastweight_inplace (inplace=True),
  mk_triton (mlstm_kernels' mlstm_recurrent_step__triton), mk_native (its mlstm_recurrent_step__native);
  DeltaNet: fastweight (fastweight.delta_rule_step), fastweight_inplace, fla_recurrent
  (fla.ops.delta_rule.fused_recurrent_delta_rule with T = 1, the initial state in, the final state out);
  both: state_copy (torch's copy_ of the state matrix into a second buffer: the floor a step out of
  place cannot beat, the same bytes read and written with nothing computed).
Inputs: q, k, v bf16 (fp32 on the CPU), gates fp32 / beta = sigmoid(noise), states fp32; DeltaNet with
the in-kernel L2 norm of q and k.
Timing (median of --reps): eager ms, CUDA events around the Python call as a decoding loop runs it
(host time shows where the GPU waits for it); graph ms (hot), the same step captured in a CUDA graph
and replayed REPLAYS times back to back between two events, per step (GPU time alone, the graph's
launch latency amortised as in a decoding loop; n/a where capture fails): at B <= 8 the state then
stays in the L2 across the replays, in place fully, out of place in part. graph ms (cold: sets), the
protocol's number (shared/BENCHMARKS.md: nothing timed out of cache): one step on each of `sets` state
copies, captured back to back in one graph, as many as make twice the L2 with the new states, so each
step reads its state from HBM as a model's layers do. Session 21-22's runs timed one replay per event
pair: at B <= 8 that added 5-10 us of launch latency, run to run uneven. state GB/s: the state's bytes
read and written (2 |state|) over the graph time. err: relative difference of the output against
fastweight's.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import Ctx, graph_ms, graph_ms_steps, import_fla, report_decode, run_case, timed  # noqa: E402

MAX_SETS = 64  # state copies of the cold timing, at most

# (family: 0 mLSTM / 1 DeltaNet, B, heads, DK, DV)
SHAPES = [(0, b, 8, 256, 512) for b in (1, 8, 64, 256)] + [(1, b, 16, 128, 128) for b in (1, 8, 64, 256)]
QUICK = [(0, 8, 8, 256, 512), (1, 8, 16, 128, 128)]
DRY = [(0, 2, 2, 16, 24), (1, 2, 2, 16, 24)]
PROVIDERS = ["fastweight", "fastweight_inplace", "mk_triton", "mk_native", "fla_recurrent", "state_copy"]
MLSTM_PROVIDERS = ("fastweight", "fastweight_inplace", "mk_triton", "mk_native", "state_copy")
DELTANET_PROVIDERS = ("fastweight", "fastweight_inplace", "fla_recurrent", "state_copy")


def mlstm_call(name, fw):
    """(q, k, v, i, f, c, n, m) -> h; the states as each provider takes them (c, n, m untouched out of place)."""
    if name == "fastweight":
        return lambda q, k, v, i, f, c, n, m: fw.mlstm_step(q, k, v, i, f, c, n, m)[0]
    if name == "fastweight_inplace":
        return lambda q, k, v, i, f, c, n, m: fw.mlstm_step(q, k, v, i, f, c, n, m, inplace=True)[0]
    from mlstm_kernels.torch.recurrent import registry_step
    fn = registry_step[{"mk_triton": "triton", "mk_native": "native"}[name]]
    return lambda q, k, v, i, f, c, n, m: fn(q, k, v, i, f, c, n, m)[0]


def deltanet_call(name, fw):
    """(q, k, v, beta, state) -> o, q, k, v (B, H, D), beta (B, H), state (B, H, K, V) fp32."""
    if name in ("fastweight", "fastweight_inplace"):
        inplace = name == "fastweight_inplace"
        return lambda q, k, v, b, s: fw.delta_rule_step(q, k, v, b, s, use_qk_l2norm_in_kernel=True, inplace=inplace)[0]
    fn = import_fla("fla.ops.delta_rule").fused_recurrent_delta_rule
    return lambda q, k, v, b, s: fn(q[:, None], k[:, None], v[:, None], b[:, None], initial_state=s,
                                    output_final_state=True, use_qk_l2norm_in_kernel=True)[0][:, 0]


def main():
    c = Ctx(__doc__, SHAPES, QUICK, DRY, PROVIDERS)
    torch, dev, dtype = c.torch, c.dev, c.dtype
    for (fam, B, NH, DK, DV) in c.shapes:
        g, mk = c.maker()
        q, k, v = mk(B, NH, DK), mk(B, NH, DK), mk(B, NH, DV)
        if fam == 0:
            i, f = mk(B, NH, 1).float(), (mk(B, NH, 1).float() + 3.0)
            c0 = torch.randn(B, NH, DK, DV, generator=g).to(dev) * 0.1
            n0 = torch.randn(B, NH, DK, generator=g).to(dev) * 0.1
            m0 = torch.randn(B, NH, 1, generator=g).to(dev)
            state_bytes = 4 * (c0.numel() + n0.numel() + m0.numel())
            names, shape = [p for p in c.wanted if p in MLSTM_PROVIDERS], f"mLSTM {B},{NH},{DK},{DV}"
        else:
            beta = torch.sigmoid(mk(B, NH).float()).to(dtype)
            s0 = torch.randn(B, NH, DK, DV, generator=g).to(dev) * 0.1
            state_bytes = 4 * s0.numel()
            names, shape = [p for p in c.wanted if p in DELTANET_PROVIDERS], f"DeltaNet {B},{NH},{DK},{DV}"
        ref = {}
        for name in names:
            def body(row, name=name):
                if fam == 0:
                    call = mlstm_call(name, c.fw) if name != "state_copy" else None
                    st = [c0.clone(), n0.clone(), m0.clone()]  # in place: a decoding loop's own states
                    step = lambda s: (lambda: call(q, k, v, i, f, *s))  # noqa: E731
                    fresh = lambda: [c0.clone(), n0.clone(), m0.clone()]  # noqa: E731
                else:
                    call = deltanet_call(name, c.fw) if name != "state_copy" else None
                    st = [s0.clone()]
                    step = lambda s: (lambda: call(q, k, v, beta, *s))  # noqa: E731
                    fresh = lambda: [s0.clone()]  # noqa: E731
                if name == "state_copy":  # the state matrix into a buffer of its own per set
                    step = lambda s: (lambda d=s[0].new_empty(s[0].shape): d.copy_(s[0]))  # noqa: E731
                fn = step(st)
                with torch.no_grad():
                    for t, t0 in zip(st, (c0, n0, m0) if fam == 0 else (s0,)):
                        t.copy_(t0)
                    out = fn().float()
                    if name == "fastweight":
                        ref["o"] = out
                    elif "o" in ref and name != "state_copy":
                        row["err"] = float((out - ref["o"]).norm() / ref["o"].norm())
                    row["eager_ms"] = timed(fn, c.cuda, c.a.reps)
                    if c.cuda:
                        try:
                            row["graph_ms"] = graph_ms(torch, fn, c.a.reps)
                            row["state_gbs"] = 2 * state_bytes / (row["graph_ms"] * 1e-3) / 1e9
                            # cold: state + new state of the sets at least twice the L2
                            l2 = torch.cuda.get_device_properties(dev).L2_cache_size
                            sets = min(MAX_SETS, max(1, -(-2 * l2 // (2 * state_bytes))))
                            fns = [step(fresh()) for _ in range(sets)]
                            row["cold_ms"] = graph_ms_steps(torch, fns, c.a.reps)
                            row["cold_sets"] = sets
                            row["cold_gbs"] = 2 * state_bytes / (row["cold_ms"] * 1e-3) / 1e9
                            del fns
                        except Exception as e:  # noqa: BLE001
                            row["graph_na"] = str(e).split("\n")[0][:80]
            run_case(c.rows, c.row(shape, name), body)
    report_decode(c.rows, c.a.out, "bench_decode", c.dev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
