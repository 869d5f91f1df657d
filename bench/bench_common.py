"""bench_common.py: helpers shared by the Python side-by-side benchmarks (bench_mlstm.py,
bench_deltanet.py): finding the fastweight build, logging, timing."""

from __future__ import annotations

import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def short(e: BaseException, n: int = 140) -> str:
    s = " ".join(f"{type(e).__name__}: {e}".split())
    return s if len(s) <= n else s[: n - 3] + "..."


def import_fastweight():
    """fastweight as installed / on PYTHONPATH, else from a build tree's python/."""
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


def import_fla(module: str):
    """An FLA submodule (e.g. "fla.ops.delta_rule"). fla/__init__ also imports fla.models (hence
    transformers); when that fails, retry with a bare 'fla' package so that only the submodule loads."""
    import importlib
    import importlib.util
    import types
    try:
        return importlib.import_module(module)
    except Exception as first:  # noqa: BLE001
        for m in [k for k in sys.modules if k == "fla" or k.startswith("fla.")]:
            del sys.modules[m]
        spec = importlib.util.find_spec("fla")
        if spec is None or not spec.submodule_search_locations:
            raise first
        pkg = types.ModuleType("fla")
        pkg.__path__ = list(spec.submodule_search_locations)
        try:  # fla.utils reads fla.__version__
            import importlib.metadata
            pkg.__version__ = importlib.metadata.version("flash-linear-attention")
        except Exception:  # noqa: BLE001
            pkg.__version__ = "0"
        sys.modules["fla"] = pkg
        return importlib.import_module(module)


class Ctx:
    """What a side-by-side script needs: options, torch, device and dtype, fastweight, the shapes and
    providers of this run, and a seeded random-tensor maker."""

    def __init__(self, doc: str, shapes, quick, dry, providers, argv=None):
        import argparse
        ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
        ap.add_argument("--quick", action="store_true")
        ap.add_argument("--dry-cpu", action="store_true", help="tiny shapes on the CPU: checks the script's logic")
        ap.add_argument("--providers", default="")
        ap.add_argument("--chunk", type=int, default=64)
        ap.add_argument("--reps", type=int, default=10)
        ap.add_argument("--out", default=str(REPO / "bench" / "out"))
        ap.add_argument("--shapes", default="", help="only these shapes, e.g. '8,16,8192,128,256;2,16,8192,128,128'")
        ap.add_argument("--graph", action="store_true",
                        help="also time (K): fwd and fwd+bwd captured in a CUDA graph, replayed back to back")
        self.a = ap.parse_args(argv)
        import torch
        self.torch = torch
        self.cuda = not self.a.dry_cpu
        if self.cuda and not torch.cuda.is_available():
            log("no CUDA device: use --dry-cpu")
            sys.exit(2)
        self.dev = "cuda" if self.cuda else "cpu"
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.fw = import_fastweight()
        self.shapes = dry if self.a.dry_cpu else quick if self.a.quick else shapes
        if self.a.shapes:
            self.shapes = [tuple(int(x) for x in sh.split(",")) for sh in self.a.shapes.split(";") if sh.strip()]
        self.wanted = [p.strip() for p in self.a.providers.split(",") if p.strip()] or providers
        self.rows = []

    def maker(self):
        """(generator, mk): mk(*shape) is a fresh normal tensor in the run's device and dtype."""
        g = self.torch.Generator(device="cpu").manual_seed(0)
        return g, (lambda *s: self.torch.randn(*s, generator=g).to(self.dev, self.dtype))

    def row(self, shape: str, provider: str) -> dict:
        return dict(shape=shape, provider=provider, dtype=str(self.dtype).replace("torch.", ""))


def step(inputs, fwdbwd):
    """One training step as users run it: the inputs' .grad cleared first (optimizer.zero_grad's
    set_to_none), so a rep does not time the accumulation into .grad of the reps before it (~0.2 ms
    of read-add-write at the mLSTM / DeltaNet shapes; sessions up to 8 included it)."""
    def run():
        for t in inputs:
            t.grad = None
        fwdbwd()
    return run


REPLAYS = 20  # graph replays per timed sample


def graph_ms(torch, fn, reps: int) -> float:
    """fn captured in a CUDA graph (on a side stream, after warm-up there), replayed REPLAYS times back
    to back per sample: median ms per replay (BENCHMARKS.md's (K): the kernels alone, no host time)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()

    def replays():
        for _ in range(REPLAYS):
            g.replay()
    ms = timed(replays, True, max(5, reps // 2)) / REPLAYS
    del g
    return ms


def graph_ms_steps(torch, fns, reps: int) -> float:
    """fns (one call each, on inputs of its own) captured back to back in one CUDA graph (on a side
    stream, after warm-up there): median ms per call over the replays. With enough of them that their
    bytes exceed the L2 (bench_decode.py: twice it), each call reads its inputs from HBM: BENCHMARKS.md's
    "nothing timed out of cache", and a decoding loop's case, whose layers' states pass through the
    L2 one after the other."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in fns:
            fn()
    ms = timed(g.replay, True, max(5, reps // 2)) / len(fns)
    del g
    return ms


def measure(row: dict, torch, cuda: bool, reps: int, fwd, fwdbwd, graph: bool = False, fwdbwd_grad=None) -> None:
    """Fills row with fwd_ms (no grad), peak_gib (one fwd+bwd, GPU) and fwdbwd_ms: (U), each call timed
    alone between two events (the host's time included where the GPU waits for it). With graph (GPU):
    also fwd_graph_ms and fwdbwd_graph_ms, (K): the same calls captured in a CUDA graph and replayed back
    to back; a provider whose call cannot be captured (a host synchronisation in it) gets graph_na.
    fwdbwd_grad (the captured fwd+bwd): the same products through torch.autograd.grad on leaves of its
    own, first used in the capture's warm-up: a leaf's accumulate node takes the stream of its first
    use, and the eager reps' (the default stream) invalidate a capture that meets them
    (cudaErrorStreamCaptureImplicit)."""
    with torch.no_grad():
        row["fwd_ms"] = timed(fwd, cuda, reps)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        fwdbwd()
        torch.cuda.synchronize()
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    row["fwdbwd_ms"] = timed(fwdbwd, cuda, reps)
    if cuda and graph:
        try:
            with torch.no_grad():
                row["fwd_graph_ms"] = graph_ms(torch, fwd, reps)
            row["fwdbwd_graph_ms"] = graph_ms(torch, fwdbwd_grad or fwdbwd, reps)
        except Exception as e:  # noqa: BLE001
            row["graph_na"] = short(e)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def report(rows: list, out: str, name: str, device: str, shape_head: str, err_head: str) -> None:
    """Writes <out>/<name>.json and prints the markdown table."""
    import json
    o = Path(out)
    o.mkdir(parents=True, exist_ok=True)
    (o / f"{name}.json").write_text(json.dumps(dict(device=device, rows=rows), indent=1))
    graph = any("fwd_graph_ms" in r or "graph_na" in r for r in rows)  # (K) columns where asked
    gh, gs = (" graph fwd ms | graph fwd+bwd ms |", "---|---|") if graph else ("", "")
    print(f"| {shape_head} | provider | fwd ms | fwd+bwd ms |{gh} peak GiB | {err_head} |")
    print(f"|---|---|---|---|{gs}---|---|")
    for r in rows:
        if "na" in r:
            print(f"| {r['shape']} | {r['provider']} | n/a ({r['na']}) | |{' | |' if graph else ''} | |")
            continue
        pk = f"{r['peak_gib']:.2f}" if "peak_gib" in r else "-"
        err = f"{r['err']:.1e}" if "err" in r else "-"
        g = ""
        if graph:
            g = (f" {r['fwd_graph_ms']:.3f} | {r['fwdbwd_graph_ms']:.3f} |" if "fwdbwd_graph_ms" in r
                 else f" n/a ({r.get('graph_na', 'not timed')}) | |")
        print(f"| {r['shape']} | {r['provider']} | {r['fwd_ms']:.3f} | {r['fwdbwd_ms']:.3f} |{g} {pk} | {err} |")


def report_decode(rows: list, out: str, name: str, device: str) -> None:
    """bench_decode.py's table: writes <out>/<name>.json and prints eager / graph ms per step."""
    import json
    o = Path(out)
    o.mkdir(parents=True, exist_ok=True)
    (o / f"{name}.json").write_text(json.dumps(dict(device=device, rows=rows), indent=1))
    print("| shape (B, heads, DK, DV) | provider | eager ms | graph ms (hot) | state GB/s | graph ms (cold: sets) "
          "| state GB/s | h / o err vs fastweight |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "na" in r:
            print(f"| {r['shape']} | {r['provider']} | n/a ({r['na']}) | | | | | |")
            continue
        gm = f"{r['graph_ms']:.4f}" if "graph_ms" in r else f"n/a ({r.get('graph_na', 'CPU')})"
        gbs = f"{r['state_gbs']:.0f}" if "state_gbs" in r else "-"
        cm = f"{r['cold_ms']:.4f} ({r['cold_sets']})" if "cold_ms" in r else "-"
        cbs = f"{r['cold_gbs']:.0f}" if "cold_gbs" in r else "-"
        err = f"{r['err']:.1e}" if "err" in r else "-"
        print(f"| {r['shape']} | {r['provider']} | {r['eager_ms']:.4f} | {gm} | {gbs} | {cm} | {cbs} | {err} |")


def run_case(rows: list, row: dict, body) -> None:
    """body(row) fills row; a failure becomes row["na"] (the reason) and the run goes on."""
    try:
        body(row)
    except Exception as e:  # noqa: BLE001
        row["na"] = short(e)
    rows.append(row)
    log(row)


def profile_second_run(name: str, prepare, run) -> None:
    """For ncu --profile-from-start off: run(prepare()) twice (the first is the warm-up: Triton compiles,
    autotunes), the second between cudaProfilerStart/Stop, with fresh inputs from prepare() each time
    (made outside the profiled region)."""
    import torch
    for it in range(2):
        args = prepare()
        torch.cuda.synchronize()
        if it == 1:
            torch.cuda.cudart().cudaProfilerStart()
        run(args)
        torch.cuda.synchronize()
        if it == 1:
            torch.cuda.cudart().cudaProfilerStop()
    print(f"{name}: done", flush=True)


def kernel_table(name: str, prepare, run, iters: int = 5) -> None:
    """Without ncu: each kernel's GPU time per call of run(prepare()) (torch.profiler / CUPTI), summed by
    kernel name over `iters` calls after one warm-up, largest first, with its share of the total. Kernels
    only: the gaps between them (launch, host) are not counted."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    run(prepare())  # warm-up: Triton compiles and autotunes
    torch.cuda.synchronize()
    inputs = [prepare() for _ in range(iters)]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for args in inputs:
            run(args)
        torch.cuda.synchronize()
    tot: dict = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            t = tot.setdefault(e.name, [0.0, 0])
            t[0] += e.device_time
            t[1] += 1
    total = sum(v[0] for v in tot.values()) / iters
    # and each call's span on the GPU as the benchmarks time it (CUDA events around the call, median):
    # above the kernels' sum where the GPU waits for the host (launches, synchronisations), below it
    # where streams overlap
    walls = []
    for args in [prepare() for _ in range(iters)]:
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run(args)
        b.record()
        b.synchronize()
        walls.append(a.elapsed_time(b))
    walls.sort()
    print(f"## {name}: {total / 1e3:.3f} ms of kernels per call ({iters} calls); {walls[len(walls) // 2]:.3f} ms per "
          "call by CUDA events")
    print("| kernel | us per call | launches per call | share |\n|---|---|---|---|")
    for k, (us, n) in sorted(tot.items(), key=lambda kv: -kv[1][0]):
        print(f"| {k[:90]} | {us / iters:.1f} | {n / iters:g} | {100 * us / iters / max(total, 1e-9):.1f}% |")
    sys.stdout.flush()


def profile_or_table(name: str, prepare, run, kernels: int) -> None:
    """The profile scripts' last step: kernel_table over `kernels` calls, or (0) one profiled run for ncu."""
    if kernels:
        kernel_table(name, prepare, run, kernels)
    else:
        profile_second_run(name, prepare, run)
