#!/usr/bin/env python3
"""bench_norms.py: fastweight's LayerNorm family against its peers, side by side in ONE run.

    python bench/bench_norms.py [--quick] [--out DIR] [--ops layernorm,rmsnorm,adalayernorm,headnorm]

What is timed (shared/BENCHMARKS.md protocol), for every op x shape x dtype, forward and backward:
  fastweight  (K) the raw ops fastweight.ops.<op>_fwd / <op>_bwd (torch.ops.fastweight.*)
  torch       torch eager: F.layer_norm / F.rms_norm / the adaLN and head-norm formulas; backward
              through autograd, timed alone (retain_graph, as the Triton tutorial does)
  compile     torch.compile (default mode, one specialisation per shape) of the same eager functions
  fla         FLA's Triton norms (fla.modules.norm.layernorm: layer_norm / rms_norm / group_norm)
  cudnn       cuDNN through the cudnn Python frontend (graphs built once per shape, executed with a
              workspace); head norm runs as cuDNN's adaLN on an (NH, B*S, DH) view of x
  fastweight_U / torch_U  (U) the user-facing call (fastweight.layer_norm & co, F.layer_norm), forward
              and autograd backward, launched eagerly as PyTorch users run them
Every (K) number is a CUDA graph of one call, replayed by triton.testing.do_bench (median), which
flushes the L2 (256 MB memset) before every replay; a callable that cannot be captured is timed
eagerly (marked '*'). (U) numbers are timed eagerly, also L2-flushed; the host overhead of the (U)
calls is measured separately on a tiny shape. Inputs are random (never zeros).
GB/s follows the seed tutorial: forward 2*|x| bytes, backward 3*|x| bytes (weights/statistics not
counted); '% copy' is the share of the device-to-device copy bandwidth measured in the same run.
Before timing, each peer's outputs are compared with fastweight's (relative Frobenius error, the
max over y or over the gradients); fastweight's own error is against an fp32 torch reference.
Every peer is optional: a peer that is missing or raises gives 'n/a (reason)', never a crash.
Shapes are BENCHMARKS.md's; bf16 everywhere, fp16 too for the M=4096 LayerNorm sweep and adaLN
(--all-dtypes: fp16 for every shape). --quick: a handful of bf16 shapes. --extra-shapes MxN,... adds
rows to layernorm and rmsnorm (e.g. hidden sizes that are not powers of two).

Outputs: a markdown table on stdout (progress goes to stderr), and three files in DIR:
bench_norms.csv (one row per op/shape/dtype/direction/provider), bench_norms.json (the same, the
markdown table and the run's metadata) and layernorm_gbps.png (GB/s vs N for the LayerNorm sweep
M=4096, forward and backward, one line per provider).
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import math
import platform
import sys
import time
import traceback
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OPS = ("layernorm", "rmsnorm", "adalayernorm", "headnorm")
# Column order of the table; fastweight (K) is the baseline of every ratio.
K_PEERS = ("torch", "compile", "fla", "cudnn")
U_PROVIDERS = ("fastweight_U", "torch_U")
PROVIDERS = ("fastweight",) + K_PEERS + U_PROVIDERS
LABEL = {"fastweight": "fastweight", "torch": "torch", "compile": "torch.compile", "fla": "FLA",
         "cudnn": "cuDNN", "fastweight_U": "fastweight (U)", "torch_U": "torch (U)"}
EPS = {"layernorm": 1e-5, "rmsnorm": 1e-6, "adalayernorm": 1e-5, "headnorm": 1e-6}
HEADNORM_OFFSET = 1.0  # xLSTM's multi-head LayerNorm: y = xhat * (1 + weight) + bias


# ---------------------------------------------------------------------------------------------
# shapes (BENCHMARKS.md)
# ---------------------------------------------------------------------------------------------
def shapes_for(op: str, quick: bool, tiny: bool = False, all_dtypes: bool = False, bf16_only: bool = False):
    """[(shape, [dtype names])] for op. The default run keeps fp16 for the seed comparisons (the
    tutorial's M=4096 LayerNorm sweep, seed 004's adaLN) and is bf16 elsewhere, to stay within about
    four minutes (every new shape costs a torch.compile and an FLA autotune); --all-dtypes adds fp16
    everywhere, --bf16-only drops it."""
    both, bf = ["bfloat16", "float16"], ["bfloat16"]
    if tiny:  # CPU dry run of the script's logic only
        cases = {"layernorm": [(64, 256), (64, 512)], "rmsnorm": [(64, 256)],
                 "adalayernorm": [(2, 32, 64)], "headnorm": [(2, 16, 4, 32)]}[op]
        return [(c, ["float32"]) for c in cases]
    if quick:
        cases = {"layernorm": [(4096, 1024), (4096, 4096), (32768, 4096)],
                 "rmsnorm": [(4096, 1024), (4096, 4096)],
                 "adalayernorm": [(4, 1024, 768)],
                 "headnorm": [(2, 8192, 16, 128)]}[op]
        return [(c, bf) for c in cases]
    if op in ("layernorm", "rmsnorm"):
        sweep = [(4096, n) for n in (1024, 2048, 4096, 8192, 16384)]
        rest = [(32768, 4096), (32768, 8192), (262144, 128), (262144, 256), (512, 32768), (512, 65536)]
        out = [(s, both if op == "layernorm" else bf) for s in sweep] + [(s, bf) for s in rest]
    elif op == "adalayernorm":  # (B, S, D): seed 004, a large one, DiT-XL
        out = [(s, both) for s in [(4, 1024, 768), (8, 4096, 4096), (16, 1024, 1152)]]
    elif op == "headnorm":  # (B, S, NH, DH): the mLSTM output shapes of BENCHMARKS.md
        out = [(s, bf) for s in [(2, 8192, 16, 128), (8, 8192, 16, 256), (1, 8192, 8, 512)]]
    else:
        raise ValueError(op)
    if all_dtypes:
        out = [(s, both) for s, _ in out]
    if bf16_only:
        out = [(s, bf) for s, _ in out]
    return out


def shape_str(shape) -> str:
    return "x".join(str(s) for s in shape) if len(shape) == 2 else ",".join(str(s) for s in shape)


def short(e: BaseException | str, n: int = 160) -> str:
    s = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
    s = " ".join(str(s).split())
    return s if len(s) <= n else s[: n - 3] + "..."


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# environment: torch, fastweight, peers (all imported lazily so --help needs none of them)
# ---------------------------------------------------------------------------------------------
class Env:
    def __init__(self, args):
        import torch
        self.torch = torch
        self.args = args
        self.cpu = args.dry_cpu
        self.device = torch.device("cpu" if self.cpu else "cuda")
        self.status = {}      # provider -> None (ok) or reason
        self.versions = {"python": platform.python_version(), "torch": torch.__version__}
        self.fw = self._import_fastweight()
        self.fla = self._import_fla()
        self.cudnn = self._import_cudnn()
        self.triton_bench = None
        if not self.cpu:
            try:
                import triton
                from triton.testing import do_bench
                self.triton_bench = do_bench
                self.versions["triton"] = triton.__version__
            except Exception as e:  # noqa: BLE001
                log(f"[env] triton not importable ({short(e)}): timing with CUDA events instead")

    # fastweight: installed, or the build tree's python/ (the build copies _C next to the .py files)
    def _import_fastweight(self):
        cands = []
        if self.args.fastweight_path:
            cands.append(Path(self.args.fastweight_path))
        cands.append(None)  # as installed / PYTHONPATH
        for b in sorted((REPO / "build").glob("*/python")) if (REPO / "build").is_dir() else []:
            cands.append(b)
        cands.append(REPO / "python")
        errs = []
        for c in cands:
            for m in [k for k in sys.modules if k == "fastweight" or k.startswith("fastweight.")]:
                del sys.modules[m]
            added = False
            if c is not None:
                if not (c / "fastweight").is_dir():
                    continue
                sys.path.insert(0, str(c))
                added = True
            try:
                import importlib
                fw = importlib.import_module("fastweight")
                ops = importlib.import_module("fastweight.ops")
                fw.ops = ops
                where = Path(ops.__file__).parent
                self.versions["fastweight"] = f"{getattr(fw, '__version__', '?')} ({where})"
                log(f"[env] fastweight from {where}")
                self.status["fastweight"] = None
                return fw
            except Exception as e:  # noqa: BLE001
                errs.append(f"{c or 'sys.path'}: {short(e, 100)}")
                if added:
                    sys.path.remove(str(c))
        self.status["fastweight"] = "not importable (" + "; ".join(errs)[:300] + ")"
        log(f"[env] fastweight: {self.status['fastweight']}")
        return None

    def _import_fla(self):
        if self.cpu:
            self.status["fla"] = "needs CUDA"
            return None
        import importlib
        import importlib.util
        import types
        err = None
        # 0.6.0 keeps the norms in fla.modules.norm.layernorm (fla.modules.layernorm is an alias);
        # if fla/__init__ fails (it also imports fla.models, hence transformers), retry with a bare
        # 'fla' package so that only fla.modules is imported.
        for attempt in ("normal", "bare"):
            try:
                if attempt == "bare":
                    for m in [k for k in sys.modules if k == "fla" or k.startswith("fla.")]:
                        del sys.modules[m]
                    spec = importlib.util.find_spec("fla")
                    if spec is None or not spec.submodule_search_locations:
                        break
                    pkg = types.ModuleType("fla")
                    pkg.__path__ = list(spec.submodule_search_locations)
                    try:
                        from importlib.metadata import version
                        pkg.__version__ = version("fla-core")
                    except Exception:  # noqa: BLE001
                        pkg.__version__ = "0"
                    sys.modules["fla"] = pkg
                fla_ln = None
                for mod in ("fla.modules.norm.layernorm", "fla.modules.layernorm"):
                    try:
                        fla_ln = importlib.import_module(mod)
                        break
                    except ModuleNotFoundError as e:
                        if not (e.name or "").startswith("fla"):
                            raise
                        err = e
                if fla_ln is None:
                    raise err
                for name in ("layer_norm", "rms_norm", "group_norm"):
                    getattr(fla_ln, name)
                try:
                    from importlib.metadata import version
                    self.versions["fla"] = version("fla-core")
                except Exception:  # noqa: BLE001
                    self.versions["fla"] = getattr(sys.modules.get("fla"), "__version__", "?")
                if attempt == "bare":
                    log(f"[env] fla imported without fla/__init__ (it failed: {short(err, 120)})")
                self.status["fla"] = None
                return fla_ln
            except Exception as e:  # noqa: BLE001
                err = e
        self.status["fla"] = f"not importable ({short(err, 120)})"
        log(f"[env] fla: {self.status['fla']}")
        return None

    def _import_cudnn(self):
        if self.cpu:
            self.status["cudnn"] = "needs CUDA"
            return None
        try:
            import cudnn
            self.versions["cudnn_frontend"] = getattr(cudnn, "__version__", "?")
            try:
                self.versions["cudnn_backend"] = str(cudnn.backend_version())
            except Exception:  # noqa: BLE001
                pass
            self.cudnn_handle = cudnn.create_handle()
            self.status["cudnn"] = None
            return cudnn
        except Exception as e:  # noqa: BLE001
            self.status["cudnn"] = f"not importable ({short(e, 120)})"
            log(f"[env] cudnn: {self.status['cudnn']}")
            return None

    def sync(self):
        if not self.cpu:
            self.torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------
class Timer:
    """Median time (ms) of one call: a CUDA graph of the call replayed by do_bench (L2 flushed
    before every replay), or the call itself when it cannot be captured or graph=False."""

    def __init__(self, env: Env, warmup_ms: float, rep_ms: float):
        self.env = env
        self.torch = env.torch
        self.warmup = warmup_ms
        self.rep = rep_ms
        self.stream = None
        self.flush_buf = None
        if not env.cpu:
            # Everything runs on one side stream: an autograd backward runs on the stream of its
            # forward, and a graph capture must not touch the legacy default stream.
            self.stream = self.torch.cuda.Stream()
            self.torch.cuda.set_stream(self.stream)

    @staticmethod
    def _clear(leaves):
        if leaves:
            for t in leaves:
                t.grad = None

    def _bench(self, fn, leaves):
        torch = self.torch
        if self.env.cpu:  # dry run: wall clock
            ts = []
            for _ in range(3):
                self._clear(leaves)
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e3)
            return sorted(ts)[1]
        if self.env.triton_bench is not None:
            return float(self.env.triton_bench(fn, warmup=self.warmup, rep=self.rep, grad_to_none=leaves,
                                               return_mode="median"))
        # fallback: CUDA events, 256 MB memset before each call
        if self.flush_buf is None:
            self.flush_buf = torch.empty(64 * 1024 * 1024, dtype=torch.int32, device="cuda")
        fn()
        torch.cuda.synchronize()
        n = 0
        ts = []
        t_end = time.perf_counter() + self.rep / 1e3
        while n < 10 or (time.perf_counter() < t_end and n < 2000):
            self._clear(leaves)
            self.flush_buf.zero_()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            ts.append((s, e))
            n += 1
        torch.cuda.synchronize()
        vals = sorted(s.elapsed_time(e) for s, e in ts)
        return vals[len(vals) // 2]

    def measure(self, fn, leaves=None, graph=True):
        """-> (ms, mode, note); mode 'graph' or 'eager'."""
        torch = self.torch
        note = ""
        if graph and not self.env.cpu and not self.env.args.no_graph:
            g = None
            try:
                for _ in range(2):
                    self._clear(leaves)
                    fn()
                self._clear(leaves)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=self.stream):
                    fn()
                g.replay()
                torch.cuda.synchronize()
                ms = self._bench(g.replay, None)
                return ms, "graph", ""
            except Exception as e:  # noqa: BLE001
                note = f"graph capture failed ({short(e, 100)}): timed eagerly"
                try:
                    torch.cuda.synchronize()
                except Exception:  # noqa: BLE001
                    pass
            finally:
                del g
                self._clear(leaves)
        ms = self._bench(fn, leaves)
        self._clear(leaves)
        return ms, "eager", note


# ---------------------------------------------------------------------------------------------
# cases: inputs of one op/shape/dtype, and the fp32 reference
# ---------------------------------------------------------------------------------------------
class Case:
    def __init__(self, env: Env, op: str, shape, dtype):
        torch = env.torch
        self.env, self.op, self.shape, self.dtype = env, op, tuple(shape), dtype
        self.eps = EPS[op]
        dev = env.device
        seed = zlib.crc32(f"{op} {self.shape} {dtype}".encode()) & 0xFFFFFF
        g = torch.Generator(device=dev).manual_seed(seed)

        def rnd(*s, scale=1.0, shift=0.0):
            t = torch.randn(*s, generator=g, device=dev, dtype=torch.float32)
            return (t * scale + shift).to(dtype)

        self.x = rnd(*shape, scale=2.0, shift=0.5)  # non-zero mean: a real test of the mean/variance
        self.dy = rnd(*shape)
        if op in ("layernorm", "rmsnorm"):
            n = shape[-1]
            self.params = [rnd(n, scale=0.1, shift=1.0)] + ([rnd(n, scale=0.1)] if op == "layernorm" else [])
        elif op == "adalayernorm":
            b, _s, d = shape
            self.params = [rnd(b, 1, d, scale=0.1, shift=1.0), rnd(b, 1, d, scale=0.1)]
        elif op == "headnorm":
            nh, dh = shape[-2:]
            self.params = [rnd(nh, dh, scale=0.1), rnd(nh, dh, scale=0.1)]
        self.x_bytes = self.x.numel() * self.x.element_size()
        self._ref = None

    # canonical outputs: y of x's shape; grads [dx, dparam...] each flattened for comparison
    def reference(self):
        """fp32 torch reference (y, [dx, dparams...]) computed with autograd."""
        if self._ref is None:
            x = self.x.float().requires_grad_(True)
            ps = [p.float().requires_grad_(True) for p in self.params]
            y = eager_fn(self.op, self.eps)(x, *ps)
            y.backward(self.dy.float())
            self._ref = (y.detach(), [x.grad] + [p.grad for p in ps])
            del x, ps, y
        return self._ref

    def gbps(self, direction: str, ms: float) -> float:
        nbytes = (2 if direction == "fwd" else 3) * self.x_bytes
        return nbytes / (ms * 1e-3) / 1e9


def eager_fn(op: str, eps: float):
    """The torch eager formula of `op` (also what torch.compile compiles)."""
    import torch.nn.functional as F
    if op == "layernorm":
        def f(x, w, b):
            return F.layer_norm(x, (x.shape[-1],), w, b, eps)
    elif op == "rmsnorm":
        def f(x, w):
            return F.rms_norm(x, (x.shape[-1],), w, eps)
    elif op == "adalayernorm":
        def f(x, scale, shift):
            return F.layer_norm(x, (x.shape[-1],), None, None, eps) * scale + shift
    elif op == "headnorm":
        def f(x, w, b):
            return F.layer_norm(x, (x.shape[-1],), None, None, eps) * (HEADNORM_OFFSET + w) + b
    else:
        raise ValueError(op)
    return f


# ---------------------------------------------------------------------------------------------
# providers: each returns an Impl (fwd/bwd callables for timing, and checks for verification)
# ---------------------------------------------------------------------------------------------
class NA(Exception):
    """A provider that does not serve this case (reason in the message)."""


class Impl:
    def __init__(self, fwd, fwd_out, bwd, bwd_out, leaves=None, graph=True, note=""):
        self.fwd, self.fwd_out, self.bwd, self.bwd_out = fwd, fwd_out, bwd, bwd_out
        self.leaves = leaves
        self.graph = graph
        self.note = note
        self.keep = []  # tensors/graphs that must live as long as the Impl


def autograd_impl(env: Env, fn, case: Case, params, out_map=None, grad_map=None, graph=True):
    """Impl of a differentiable fn(x, *params): forward under autograd (training forward), backward
    alone through torch.autograd.backward(y, dy, retain_graph=True)."""
    torch = env.torch
    xl = case.x.detach().requires_grad_(True)
    pl = [p.detach().requires_grad_(True) for p in params]
    leaves = [xl] + pl
    state = {}

    def fwd():
        return fn(xl, *pl)

    def fwd_out():  # with autograd on, as timed (a no_grad call would compile another graph)
        y = fn(xl, *pl).detach()
        return out_map(y) if out_map else y

    def bwd():
        torch.autograd.backward(state["y"], case.dy, retain_graph=True)

    def bwd_out():
        for t in leaves:
            t.grad = None
        y = fn(xl, *pl)
        torch.autograd.backward(y, case.dy)
        gs = [t.grad for t in leaves]
        for t in leaves:
            t.grad = None
        return grad_map(gs) if grad_map else gs

    impl = Impl(fwd, fwd_out, bwd, bwd_out, leaves=leaves, graph=graph)

    def prep_bwd():  # the graph that the backward timing replays
        for t in leaves:
            t.grad = None
        state["y"] = fn(xl, *pl)

    impl.prep_bwd = prep_bwd
    impl.done_bwd = lambda: state.pop("y", None)
    return impl


# ---- fastweight (K): the raw ops ------------------------------------------------------------
def make_fastweight(env: Env, case: Case):
    if env.fw is None:
        raise NA(env.status["fastweight"])
    ops = env.fw.ops
    x, dy, eps, op = case.x, case.dy, case.eps, case.op
    if op == "layernorm":
        w, b = case.params
        fwd = lambda: ops.layernorm_fwd(x, w, b, eps, 0.0)  # noqa: E731
        y, mean, rstd = fwd()
        bwd = lambda: ops.layernorm_bwd(dy, x, w, mean, rstd, 0.0, True)  # noqa: E731
    elif op == "rmsnorm":
        (w,) = case.params
        fwd = lambda: ops.rmsnorm_fwd(x, w, eps, 0.0)  # noqa: E731
        y, rstd = fwd()
        bwd = lambda: ops.rmsnorm_bwd(dy, x, w, rstd, 0.0)  # noqa: E731
    elif op == "adalayernorm":
        scale, shift = case.params
        fwd = lambda: ops.adalayernorm_fwd(x, scale, shift, eps)  # noqa: E731
        y, mean, rstd = fwd()
        bwd = lambda: ops.adalayernorm_bwd(dy, x, scale, mean, rstd, True)  # noqa: E731
    elif op == "headnorm":
        w, b = case.params
        fwd = lambda: ops.headnorm_fwd(x, w, b, eps, HEADNORM_OFFSET)  # noqa: E731
        y, mean, rstd = fwd()
        bwd = lambda: ops.headnorm_bwd(dy, x, w, mean, rstd, HEADNORM_OFFSET, True)  # noqa: E731
    else:
        raise NA(op)
    return Impl(fwd, lambda: fwd()[0], bwd, lambda: [g for g in bwd() if g is not None])


# ---- fastweight (U): the functional API with autograd ----------------------------------------
def _fw_func(env, name):
    f = getattr(env.fw, name, None)
    return f if f is not None else getattr(env.fw.ops, name, None)


def make_fastweight_U(env: Env, case: Case):
    if env.fw is None:
        raise NA(env.status["fastweight"])
    op, eps = case.op, case.eps
    if op == "layernorm":
        f = _fw_func(env, "layer_norm")
        fn = lambda x, w, b: f(x, w, b, eps)  # noqa: E731
    elif op == "rmsnorm":
        f = _fw_func(env, "rms_norm")
        fn = lambda x, w: f(x, w, eps)  # noqa: E731
    elif op == "adalayernorm":
        f = _fw_func(env, "adaptive_layer_norm")
        fn = lambda x, s, h: f(x, s, h, eps)  # noqa: E731
    elif op == "headnorm":
        f = _fw_func(env, "head_norm")
        fn = lambda x, w, b: f(x, w, b, eps, HEADNORM_OFFSET)  # noqa: E731
    else:
        raise NA(op)
    if f is None:
        raise NA("no functional API for this op in fastweight")
    return autograd_impl(env, fn, case, case.params, graph=False)


# ---- torch eager, torch.compile ------------------------------------------------------------------
def make_torch(env: Env, case: Case):
    return autograd_impl(env, eager_fn(case.op, case.eps), case, case.params)


def make_torch_U(env: Env, case: Case):
    return autograd_impl(env, eager_fn(case.op, case.eps), case, case.params, graph=False)


class CompileBudget:
    def __init__(self, total_s: float):
        self.total = total_s
        self.spent = 0.0
        self.count = 0
        self.skipped = 0


def _configure_compile(torch):
    import torch._dynamo
    cfg = torch._dynamo.config
    for name, val in (("recompile_limit", 1024), ("cache_size_limit", 1024),
                      ("accumulated_recompile_limit", 1 << 16), ("accumulated_cache_size_limit", 1 << 16)):
        if hasattr(cfg, name):
            try:
                setattr(cfg, name, val)
            except Exception:  # noqa: BLE001
                pass
    try:  # donated buffers forbid backward(retain_graph=True), which the backward timing needs
        import torch._functorch.config as fc
        if hasattr(fc, "donated_buffer"):
            fc.donated_buffer = False
    except Exception:  # noqa: BLE001
        pass


def make_compile(env: Env, case: Case, budget: CompileBudget, budget_share: float):
    torch = env.torch
    if budget.total > 0 and budget.spent >= budget_share:
        budget.skipped += 1
        raise NA(f"compile budget spent ({budget.spent:.0f} s of {budget_share:.0f} s for this op; "
                 f"raise --compile-budget)")
    _configure_compile(torch)
    fn = torch.compile(eager_fn(case.op, case.eps), dynamic=False)
    impl = autograd_impl(env, fn, case, case.params)
    t0 = time.perf_counter()
    try:  # compile forward and backward now, out of every timing
        impl.prep_bwd()
        impl.bwd()
        env.sync()
    finally:
        dt = time.perf_counter() - t0
        budget.spent += dt
        budget.count += 1
        impl.done_bwd()
        for t in impl.leaves:
            t.grad = None
    impl.note = f"compiled in {dt:.1f} s"
    impl.compile_s = dt
    return impl


# ---- FLA's Triton norms ---------------------------------------------------------------------
def make_fla(env: Env, case: Case):
    if env.fla is None:
        raise NA(env.status["fla"])
    L, op, eps = env.fla, case.op, case.eps
    if op == "layernorm":
        fn = lambda x, w, b: L.layer_norm(x, w, b, eps=eps)  # noqa: E731
        return autograd_impl(env, fn, case, case.params)
    if op == "rmsnorm":
        fn = lambda x, w: L.rms_norm(x, w, None, eps=eps)  # noqa: E731
        return autograd_impl(env, fn, case, case.params)
    if op == "headnorm":
        # head norm = FLA's group norm over the flattened (NH*DH) features with NH groups and
        # per-channel weight/bias; the offset is folded into the weight (same gradient).
        B, S, NH, DH = case.shape
        w, b = case.params
        w_eff = (HEADNORM_OFFSET + w.float()).to(case.dtype).reshape(NH * DH)
        b_flat = b.reshape(NH * DH).contiguous()

        def fn(x, w_, b_):
            return L.group_norm(x.reshape(B, S, NH * DH), w_, b_, eps=eps, num_groups=NH).reshape(B, S, NH, DH)

        return autograd_impl(env, fn, case, [w_eff, b_flat])
    raise NA("FLA has no adaptive LayerNorm")


# ---- cuDNN (cudnn Python frontend graphs) --------------------------------------------------
def _contig_strides(dims):
    st, acc = [], 1
    for d in reversed(dims):
        st.append(acc)
        acc *= d
    return list(reversed(st))


def make_cudnn(env: Env, case: Case):
    if env.cudnn is None:
        raise NA(env.status["cudnn"])
    cudnn, torch = env.cudnn, env.torch
    h = env.cudnn_handle
    dev = env.device
    io = {torch.bfloat16: cudnn.data_type.BFLOAT16, torch.float16: cudnn.data_type.HALF,
          torch.float32: cudnn.data_type.FLOAT}[case.dtype]
    F32 = cudnn.data_type.FLOAT
    op, eps = case.op, case.eps

    def new_graph():
        return cudnn.pygraph(handle=h, intermediate_data_type=F32, compute_data_type=F32)

    def finish(g):
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        return torch.empty(max(int(g.get_workspace_size()), 1), dtype=torch.uint8, device=dev)

    def alloc(t, dtype, dims_fallback):
        dims = list(t.get_dim() or dims_fallback)
        st = list(t.get_stride() or [])
        if len(st) != len(dims):
            st = _contig_strides(dims)
        return torch.empty_strided(dims, st, dtype=dtype, device=dev)

    def tens(g, name, data, dtype):
        return g.tensor(name=name, dim=list(data.shape), stride=list(data.stride()), data_type=dtype)

    def runner(g, pack, ws):
        def run():
            cudnn.set_stream(handle=h, stream=torch.cuda.current_stream().cuda_stream)
            g.execute(pack, ws, handle=h)
        return run

    x, dy = case.x, case.dy
    if op in ("layernorm", "rmsnorm"):
        M, N = case.shape
        xv, dyv = x.view(M, N, 1, 1), dy.view(M, N, 1, 1)
        if op == "layernorm":  # as cudnn.ops.norm.layernorm: fp32 scale/bias, fp32 dscale/dbias
            pdt, pio = torch.float32, F32
            scale = case.params[0].to(pdt).view(1, N, 1, 1).contiguous()
            bias = case.params[1].to(pdt).view(1, N, 1, 1).contiguous()
        else:  # as cudnn.ops.norm.rmsnorm: scale in the IO dtype, no bias
            pdt, pio = case.dtype, io
            scale = case.params[0].view(1, N, 1, 1).contiguous()
            bias = None
        eps_t = torch.full((1, 1, 1, 1), eps, dtype=torch.float32)  # host, pass by value
        g = new_graph()
        tx, ts = tens(g, "X", xv, io), tens(g, "scale", scale, pio)
        tb = tens(g, "bias", bias, pio) if bias is not None else None
        te = g.tensor(name="epsilon", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=F32, is_pass_by_value=True)
        if op == "layernorm":
            ty, tm, tv = g.layernorm(name="LN", norm_forward_phase=cudnn.norm_forward_phase.TRAINING,
                                     input=tx, scale=ts, bias=tb, epsilon=te)
            tm.set_output(True).set_data_type(F32)
        else:
            ty, tv = g.rmsnorm(name="RMS", norm_forward_phase=cudnn.norm_forward_phase.TRAINING,
                               input=tx, scale=ts, bias=None, epsilon=te)
            tm = None
        ty.set_output(True).set_data_type(io)
        tv.set_output(True).set_data_type(F32)
        ws = finish(g)
        y = alloc(ty, case.dtype, [M, N, 1, 1])
        inv = alloc(tv, torch.float32, [M, 1, 1, 1])
        mean = alloc(tm, torch.float32, [M, 1, 1, 1]) if tm is not None else None
        pack = {tx: xv, ts: scale, te: eps_t, ty: y, tv: inv}
        if tb is not None:
            pack[tb] = bias
        if tm is not None:
            pack[tm] = mean
        fwd = runner(g, pack, ws)

        gb = new_graph()
        bdy, bx, bs = tens(gb, "DY", dyv, io), tens(gb, "X", xv, io), tens(gb, "scale", scale, pio)
        bv = tens(gb, "inv_var", inv, F32)
        if op == "layernorm":
            bm = tens(gb, "mean", mean, F32)
            tdx, tds, tdb = gb.layernorm_backward(name="DLN", grad=bdy, input=bx, scale=bs, mean=bm, inv_variance=bv)
            tdb.set_output(True).set_data_type(pio)
        else:
            bm = None
            tdx, tds, tdb = gb.rmsnorm_backward(name="DRMS", grad=bdy, input=bx, scale=bs, inv_variance=bv,
                                                has_dbias=False)
        tdx.set_output(True).set_data_type(io)
        tds.set_output(True).set_data_type(pio)
        wsb = finish(gb)
        dx = alloc(tdx, case.dtype, [M, N, 1, 1])
        ds = alloc(tds, pdt, [1, N, 1, 1])
        packb = {bdy: dyv, bx: xv, bs: scale, bv: inv, tdx: dx, tds: ds}
        outs = [dx, ds]
        if bm is not None:
            packb[bm] = mean
            db = alloc(tdb, pdt, [1, N, 1, 1])
            packb[tdb] = db
            outs.append(db)
        bwd = runner(gb, packb, wsb)

        def fwd_out():
            fwd()
            return y.reshape(M, N).clone()

        def bwd_out():
            fwd()
            bwd()
            return [outs[0].reshape(M, N).clone()] + [t.reshape(-1).clone() for t in outs[1:]]

        impl = Impl(fwd, fwd_out, bwd, bwd_out)
        impl.keep = [g, gb, ws, wsb, pack, packb, eps_t, scale, bias]
        return impl

    if op in ("adalayernorm", "headnorm"):
        if op == "adalayernorm":  # seed 004: x (B,S,D), scale/bias (B,1,D), IO dtype everywhere
            B, S, D = case.shape
            xv, dyv = x, dy
            scale, shift = case.params
            to_canon = lambda t: t  # noqa: E731
            note = ""
        else:  # head norm = adaLN over the (NH, B*S, DH) view: scale (NH,1,DH) varies along dim 0
            B, S, NH, DH = case.shape
            xv = x.view(B * S, NH, DH).permute(1, 0, 2)
            dyv = dy.view(B * S, NH, DH).permute(1, 0, 2)
            scale = (HEADNORM_OFFSET + case.params[0].float()).to(case.dtype).view(NH, 1, DH).contiguous()
            shift = case.params[1].view(NH, 1, DH).contiguous()
            to_canon = lambda t: t.permute(1, 0, 2).reshape(B, S, NH, DH)  # noqa: E731
            note = "adaLN on an (NH, B*S, DH) view"
        eps_t = torch.full((1, 1, 1), eps, dtype=torch.float32)
        g = new_graph()
        tx, ts, tb = tens(g, "X", xv, io), tens(g, "scale", scale, io), tens(g, "bias", shift, io)
        te = g.tensor(name="epsilon", dim=[1, 1, 1], stride=[1, 1, 1], data_type=F32, is_pass_by_value=True)
        ty, tm, tv = g.adalayernorm(name="ADALN", norm_forward_phase=cudnn.norm_forward_phase.TRAINING,
                                    input=tx, scale=ts, bias=tb, epsilon=te)
        ty.set_output(True).set_data_type(io)
        if op == "headnorm":
            ty.set_stride(list(xv.stride()))
        tm.set_output(True).set_data_type(F32)
        tv.set_output(True).set_data_type(F32)
        ws = finish(g)
        d0, d1, _d2 = xv.shape
        y = alloc(ty, case.dtype, list(xv.shape))
        mean = alloc(tm, torch.float32, [d0, d1, 1])
        inv = alloc(tv, torch.float32, [d0, d1, 1])
        pack = {tx: xv, ts: scale, tb: shift, te: eps_t, ty: y, tm: mean, tv: inv}
        fwd = runner(g, pack, ws)

        gb = new_graph()
        bdy, bx, bs = tens(gb, "DY", dyv, io), tens(gb, "X", xv, io), tens(gb, "scale", scale, io)
        bm, bv = tens(gb, "mean", mean, F32), tens(gb, "inv_var", inv, F32)
        tdx, tds, tdb = gb.adalayernorm_backward(name="DADALN", grad=bdy, input=bx, scale=bs, mean=bm,
                                                 inv_variance=bv)
        tdx.set_output(True).set_data_type(io)
        if op == "headnorm":
            tdx.set_stride(list(xv.stride()))
        tds.set_output(True).set_data_type(io)
        tdb.set_output(True).set_data_type(io)
        wsb = finish(gb)
        dx = alloc(tdx, case.dtype, list(xv.shape))
        ds = alloc(tds, case.dtype, list(scale.shape))
        db = alloc(tdb, case.dtype, list(scale.shape))
        packb = {bdy: dyv, bx: xv, bs: scale, bm: mean, bv: inv, tdx: dx, tds: ds, tdb: db}
        bwd = runner(gb, packb, wsb)

        def fwd_out():
            fwd()
            return to_canon(y).clone()

        def bwd_out():
            fwd()
            bwd()
            return [to_canon(dx).clone(), ds.reshape(-1).clone(), db.reshape(-1).clone()]

        impl = Impl(fwd, fwd_out, bwd, bwd_out, note=note)
        impl.keep = [g, gb, ws, wsb, pack, packb, eps_t, scale, shift]
        return impl
    raise NA(op)


# ---------------------------------------------------------------------------------------------
# verification
# ---------------------------------------------------------------------------------------------
def rel_err(torch, a, b) -> float:
    a = a.detach().reshape(-1).float()
    b = b.detach().reshape(-1).float()
    if a.numel() != b.numel():
        raise ValueError(f"size mismatch {a.numel()} vs {b.numel()}")
    den = torch.linalg.vector_norm(b).item()
    num = torch.linalg.vector_norm(a - b).item()
    if not math.isfinite(num):
        return float("nan")
    return num / den if den > 0 else num


def max_rel_err(torch, outs, refs) -> float:
    if len(outs) != len(refs):
        raise ValueError(f"{len(outs)} gradients vs {len(refs)} expected")
    errs = [rel_err(torch, a, b) for a, b in zip(outs, refs)]
    return float("nan") if any(math.isnan(e) for e in errs) else max(errs)


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------
def measure_copy_bw(env: Env, timer: Timer, quick: bool) -> float:
    torch = env.torch
    n = (64 if env.cpu else (512 if quick else 1024)) * 1024 * 1024  # bytes
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=env.device)
    dst = torch.empty_like(src)
    ms, _, _ = timer.measure(lambda: dst.copy_(src), graph=False)
    return 2 * n / (ms * 1e-3) / 1e9


def host_overhead(env: Env, ops, n_iter=200):
    """Host time per (U) call on a tiny shape (CPU-bound: binding and autograd overhead)."""
    torch = env.torch
    rows = []
    tiny = {"layernorm": (8, 1024), "rmsnorm": (8, 1024), "adalayernorm": (2, 4, 1024), "headnorm": (2, 4, 4, 256)}
    for op in ops:
        case = Case(env, op, tiny[op], torch.bfloat16 if not env.cpu else torch.float32)
        makers = [("fastweight_U", make_fastweight_U), ("torch_U", make_torch_U)]
        if op in ("layernorm", "rmsnorm"):  # FLA's row kernel, already autotuned for N = 1024
            makers.append(("fla", make_fla))
        for prov, maker in makers:
            r = {"op": op, "shape": shape_str(case.shape), "provider": prov}
            try:
                impl = maker(env, case)
                for _ in range(5):
                    y = impl.fwd()
                    torch.autograd.backward(y, case.dy)
                env.sync()
                t0 = time.perf_counter()
                for _ in range(n_iter):
                    impl.fwd()
                env.sync()
                r["fwd_us"] = (time.perf_counter() - t0) / n_iter * 1e6
                t0 = time.perf_counter()
                for _ in range(n_iter):
                    y = impl.fwd()
                    torch.autograd.backward(y, case.dy)
                env.sync()
                r["fwd_bwd_us"] = (time.perf_counter() - t0) / n_iter * 1e6
                r["status"] = "ok"
            except NA as e:
                r["status"] = f"n/a ({short(str(e), 120)})"
            except Exception as e:  # noqa: BLE001
                r["status"] = f"n/a ({short(e, 120)})"
            rows.append(r)
        del case
    return rows


def run(args):
    t_start = time.perf_counter()
    env = Env(args)
    torch = env.torch
    if not env.cpu and not torch.cuda.is_available():
        raise SystemExit("bench_norms.py: no CUDA device (use a GPU machine)")
    quick = args.quick
    warmup, rep = (5, 20) if quick else (5, 30)
    timer = Timer(env, warmup, rep)
    dev_name = "cpu" if env.cpu else torch.cuda.get_device_name()
    log(f"[run] device {dev_name}; versions {env.versions}")

    copy_bw = measure_copy_bw(env, timer, quick)
    log(f"[run] device-to-device copy: {copy_bw:.0f} GB/s (read + write)")

    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    for o in ops:
        if o not in OPS:
            raise SystemExit(f"unknown op {o!r}; choose from {','.join(OPS)}")
    wanted = set(PROVIDERS) if not args.providers else {p.strip() for p in args.providers.split(",")}
    if args.no_compile:
        wanted.discard("compile")
    cases = [(op, s, getattr(torch, dt)) for op in ops
             for s, dts in shapes_for(op, quick, env.cpu, args.all_dtypes, args.bf16_only) for dt in dts]
    if args.extra_shapes:  # MxN rows beside BENCHMARKS.md's, for the two row norms
        try:
            extra = [tuple(int(v) for v in e.strip().split("x")) for e in args.extra_shapes.split(",") if e.strip()]
        except ValueError:
            raise SystemExit(f"--extra-shapes: MxN shapes, comma-separated (got {args.extra_shapes!r})")
        if any(len(e) != 2 or min(e) < 1 for e in extra):
            raise SystemExit(f"--extra-shapes: MxN shapes, comma-separated (got {args.extra_shapes!r})")
        dts = ["bfloat16", "float16"] if args.all_dtypes else ["bfloat16"]
        cases += [(op, e, getattr(torch, dt)) for op in ops if op in ("layernorm", "rmsnorm")
                  for e in extra for dt in dts if (op, e, getattr(torch, dt)) not in cases]
    if args.shapes:  # keep the listed shapes only (A/B runs of one shape)
        keep = {s.strip() for s in args.shapes.split(",")}
        unmatched = keep - {shape_str(c[1]) for c in cases}
        if unmatched:  # a filter, not a new shape: say which ones are not in the op's list
            log(f"[run] --shapes: not among the benchmark shapes of {','.join(ops)}: {','.join(sorted(unmatched))}")
        cases = [c for c in cases if shape_str(c[1]) in keep]
    n_cases_op = {op: sum(1 for c in cases if c[0] == op) for op in ops}
    budget = CompileBudget(args.compile_budget if args.compile_budget is not None else (0 if quick else 150))
    log(f"[run] {len(cases)} cases; providers {sorted(wanted)}")

    results = []
    for i, (op, shape, dt) in enumerate(cases):
        elapsed = time.perf_counter() - t_start
        dname = str(dt).replace("torch.", "")
        tag = f"{op} {shape_str(shape)} {dname}"
        if args.time_budget and elapsed > args.time_budget:
            log(f"[run] time budget {args.time_budget} s spent: skipping {tag}")
            for d in ("fwd", "bwd"):
                for p in PROVIDERS:
                    results.append(dict(op=op, shape=shape_str(shape), dtype=dname, dir=d, provider=p,
                                        status="n/a (time budget spent)"))
            continue
        log(f"[{i + 1}/{len(cases)}] {tag} ({elapsed:.0f} s)")
        try:
            case = Case(env, op, shape, dt)
        except Exception as e:  # noqa: BLE001
            log(f"  inputs failed: {short(e)}")
            for d in ("fwd", "bwd"):
                for p in PROVIDERS:
                    results.append(dict(op=op, shape=shape_str(shape), dtype=dname, dir=d, provider=p,
                                        status=f"n/a (inputs: {short(e, 80)})"))
            continue
        fw_y = fw_g = None
        # compile budget: this op's share plus what earlier ops left over (spent is cumulative)
        done_before = sum(n_cases_op[o] for o in ops[: ops.index(op)])
        share = budget.total * (done_before + n_cases_op[op]) / max(1, len(cases))
        for prov in PROVIDERS:
            rows = {d: dict(op=op, shape=shape_str(shape), dtype=dname, dir=d, provider=prov,
                            label=LABEL[prov], x_bytes=case.x_bytes) for d in ("fwd", "bwd")}
            if prov not in wanted:
                for r in rows.values():
                    r["status"] = "n/a (not selected)"
                results.extend(rows.values())
                continue
            impl = None
            try:
                if prov == "fastweight":
                    impl = make_fastweight(env, case)
                elif prov == "fastweight_U":
                    impl = make_fastweight_U(env, case)
                elif prov == "torch":
                    impl = make_torch(env, case)
                elif prov == "torch_U":
                    impl = make_torch_U(env, case)
                elif prov == "compile":
                    impl = make_compile(env, case, budget, share)
                elif prov == "fla":
                    impl = make_fla(env, case)
                elif prov == "cudnn":
                    impl = make_cudnn(env, case)
            except NA as e:
                for r in rows.values():
                    r["status"] = f"n/a ({short(str(e), 200)})"
            except Exception as e:  # noqa: BLE001
                if args.verbose:
                    traceback.print_exc()
                for r in rows.values():
                    r["status"] = f"n/a ({short(e, 200)})"
            if impl is not None:
                for d in ("fwd", "bwd"):
                    r = rows[d]
                    check_note = ""
                    try:  # verify: against fastweight when it ran, else against the fp32 reference
                        if d == "fwd":
                            out = impl.fwd_out()
                            if prov == "fastweight":  # the peers' baseline only if it checks out
                                r["err"] = rel_err(torch, out, case.reference()[0])
                                r["err_vs"] = "fp32 reference"
                                fw_y = out
                            else:
                                base = fw_y if fw_y is not None else case.reference()[0]
                                r["err"] = rel_err(torch, out, base)
                                r["err_vs"] = "fastweight" if fw_y is not None else "fp32 reference"
                            del out
                        else:
                            outs = impl.bwd_out()
                            if prov == "fastweight":
                                base = case.reference()[1]
                                r["err_vs"] = "fp32 reference"
                            else:
                                base = fw_g if fw_g is not None else case.reference()[1]
                                r["err_vs"] = "fastweight" if fw_g is not None else "fp32 reference"
                            r["err"] = max_rel_err(torch, outs, base)
                            r["err_each"] = [rel_err(torch, a, b) for a, b in zip(outs, base)]
                            if prov == "fastweight":
                                fw_g = outs
                            del outs
                    except Exception as e:  # noqa: BLE001
                        if args.verbose:
                            traceback.print_exc()
                        check_note = f"check failed: {short(e, 120)}"
                        r.pop("err", None)
                        try:
                            env.sync()
                        except Exception:  # noqa: BLE001
                            pass
                    try:
                        if d == "fwd":
                            ms, mode, note = timer.measure(impl.fwd, None, impl.graph)
                        else:
                            if hasattr(impl, "prep_bwd"):
                                impl.prep_bwd()
                            try:
                                ms, mode, note = timer.measure(impl.bwd, impl.leaves, impl.graph)
                            finally:
                                if hasattr(impl, "done_bwd"):
                                    impl.done_bwd()
                        r.update(status="ok", ms=ms, mode=mode,
                                 gbps=case.gbps(d, ms), pct_copy=100.0 * case.gbps(d, ms) / copy_bw)
                        notes = [n for n in (impl.note, check_note, note) if n]
                        if notes:
                            r["note"] = "; ".join(notes)
                        if hasattr(impl, "compile_s"):
                            r["compile_s"] = impl.compile_s
                    except Exception as e:  # noqa: BLE001
                        if args.verbose:
                            traceback.print_exc()
                        r["status"] = f"n/a ({short(e, 200)})"
                        try:
                            env.sync()
                        except Exception:  # noqa: BLE001
                            pass
            results.extend(rows.values())
            del impl
        # ratios against fastweight (K), and U against fastweight (U)
        for d in ("fwd", "bwd"):
            mine = [r for r in results[-2 * len(PROVIDERS):] if r["dir"] == d]
            by = {r["provider"]: r for r in mine}
            fk, fu = by.get("fastweight", {}), by.get("fastweight_U", {})
            for r in mine:
                base = fu if r["provider"] in U_PROVIDERS else fk
                if r is not base and r.get("ms") and base.get("ms"):
                    r["ratio"] = r["ms"] / base["ms"]
            summary = "  ".join(f"{LABEL[r['provider']]} {r['ms']:.4f}" for r in mine if r.get("ms"))
            log(f"  {d}: {summary}")
        del case, fw_y, fw_g
        gc.collect()
        if not env.cpu:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    overhead = []
    if not args.no_overhead:
        try:
            overhead = host_overhead(env, ops)
        except Exception as e:  # noqa: BLE001
            log(f"[run] host overhead failed: {short(e)}")
    meta = dict(device=dev_name, versions=env.versions, copy_gbps=copy_bw, quick=quick, ops=ops,
                providers_status={k: v for k, v in env.status.items()},
                compile=dict(budget_s=budget.total, spent_s=budget.spent, compiles=budget.count,
                             skipped=budget.skipped),
                timing=("CUDA graph of one call (K) or the eager call (U), triton.testing.do_bench median, "
                        "L2 flushed (256 MB) before every call" if not env.cpu else "CPU dry run (wall clock)"),
                do_bench=dict(warmup_ms=warmup, rep_ms=rep),
                bytes="fwd 2*|x|, bwd 3*|x| (x, dy read, dx written); weights and statistics not counted",
                wall_s=time.perf_counter() - t_start,
                argv=sys.argv[1:])
    return meta, results, overhead


# ---------------------------------------------------------------------------------------------
# reports
# ---------------------------------------------------------------------------------------------
def fmt_ms(ms):
    return f"{ms:.4f}" if ms < 1 else f"{ms:.3f}"


def fmt_err(e):
    if e is None:
        return ""
    if isinstance(e, float) and math.isnan(e):
        return "e=NaN"
    return f"e={e:.1e}"


def peer_cell(r, reasons):
    if r is None:
        return ""
    if r.get("status") != "ok":
        st = r.get("status", "n/a")
        if st == "n/a (not selected)":
            return "-"
        reasons.setdefault((r["provider"], st), None)
        key = list(reasons).index((r["provider"], st)) + 1
        return f"n/a [{key}]"
    star = "*" if r.get("mode") == "eager" and r["provider"] not in U_PROVIDERS else ""
    ratio = f" {r['ratio']:.2f}x" if r.get("ratio") else ""
    return f"{fmt_ms(r['ms'])}{star}{ratio} {err_cell(r, reasons)}".strip()


def err_cell(r, reasons):
    if r.get("err") is not None:
        return fmt_err(r["err"])
    note = r.get("note", "")
    if "check failed" in note:
        st = note[note.index("check failed"):]
        reasons.setdefault((r["provider"], st), None)
        return f"e=? [{list(reasons).index((r['provider'], st)) + 1}]"
    return ""


def markdown(meta, results, overhead) -> str:
    out = []
    out.append(f"# fastweight norms vs peers ({meta['device']})")
    out.append("")
    v = meta["versions"]
    out.append("versions: " + ", ".join(f"{k} {v[k]}" for k in v))
    out.append(f"device-to-device copy: {meta['copy_gbps']:.0f} GB/s (read + write), measured in this run")
    out.append(f"timing: {meta['timing']}; bytes: {meta['bytes']}")
    out.append("cells: ms, ratio = peer time / fastweight time (>1: fastweight faster; (U) columns vs "
               "fastweight (U)), e = relative Frobenius error vs fastweight's output (fastweight's own vs an "
               "fp32 reference, as are the peers' where fastweight has no result); * = could not be captured in a CUDA graph, timed eagerly; n/a [k]: see the notes")
    reasons = {}
    cols = ["shape", "dtype", "dir", "fastweight ms", "GB/s", "% copy", "fw err"] + \
           [LABEL[p] for p in K_PEERS] + [LABEL[p] for p in U_PROVIDERS]
    ops = []
    for r in results:
        if r["op"] not in ops:
            ops.append(r["op"])
    for op in ops:
        out.append("")
        out.append(f"## {op}")
        out.append("")
        out.append("| " + " | ".join(cols) + " |")
        out.append("|" + "|".join("---" for _ in cols) + "|")
        keys = []
        for r in results:
            if r["op"] == op:
                k = (r["shape"], r["dtype"], r["dir"])
                if k not in keys:
                    keys.append(k)
        for k in keys:
            by = {r["provider"]: r for r in results if r["op"] == op and (r["shape"], r["dtype"], r["dir"]) == k}
            fw = by.get("fastweight", {})
            if fw.get("status") == "ok":
                star = "*" if fw.get("mode") == "eager" else ""
                fwc = [f"{fmt_ms(fw['ms'])}{star}", f"{fw['gbps']:.0f}", f"{fw['pct_copy']:.0f}%",
                       err_cell(fw, reasons)]
            else:
                fwc = [peer_cell(fw, reasons) if fw else "", "", "", ""]
            peers = []
            for p in K_PEERS + U_PROVIDERS:
                r = by.get(p)
                cell = peer_cell(r, reasons)
                if r is not None and r.get("status") == "ok" and (fw.get("status") != "ok" or p in U_PROVIDERS):
                    # without a fastweight time, show the peer's own bandwidth
                    cell += f" ({r['gbps']:.0f} GB/s)"
                peers.append(cell)
            out.append("| " + " | ".join(list(k) + fwc + peers) + " |")
    if reasons:
        out.append("")
        out.append("notes (n/a):")
        for i, (prov, st) in enumerate(reasons, 1):
            out.append(f"  [{i}] {LABEL.get(prov, prov)}: {st}")
    graph_notes = sorted({f"{LABEL[r['provider']]}: {r['note']}" for r in results
                          if r.get("note") and "graph capture failed" in r["note"]})
    if graph_notes:
        out.append("")
        out.append("timed eagerly (no CUDA graph):")
        out.extend(f"  {n}" for n in graph_notes[:20])
    if overhead:
        out.append("")
        out.append("## host time per call (U), tiny shapes (CPU-bound: binding + autograd overhead)")
        out.append("")
        out.append("| op | shape | provider | fwd us | fwd+bwd us |")
        out.append("|---|---|---|---|---|")
        for r in overhead:
            if r.get("status") == "ok":
                out.append(f"| {r['op']} | {r['shape']} | {LABEL[r['provider']]} | {r['fwd_us']:.1f} | "
                           f"{r['fwd_bwd_us']:.1f} |")
            else:
                out.append(f"| {r['op']} | {r['shape']} | {LABEL[r['provider']]} | {r['status']} | |")
    summ = summary(results)
    if summ:
        out.append("")
        out.append("## summary: geometric mean of peer time / fastweight time (>1: fastweight faster), cases both ran")
        out.append("")
        out.extend(summ)
    c = meta["compile"]
    out.append("")
    out.append(f"torch.compile: {c['compiles']} compiles in {c['spent_s']:.0f} s"
               + (f", {c['skipped']} skipped (budget {c['budget_s']:.0f} s)" if c["skipped"] else "")
               + f"; whole run {meta['wall_s']:.0f} s")
    return "\n".join(out) + "\n"


def summary(results):
    lines = []
    groups = {}
    for r in results:
        if r.get("ratio"):
            groups.setdefault((r["op"], r["dir"]), {}).setdefault(r["provider"], []).append(r["ratio"])
    for (op, d), byp in groups.items():
        parts = []
        for p in PROVIDERS:
            v = byp.get(p)
            if v:
                gm = math.exp(sum(math.log(x) for x in v) / len(v))
                parts.append(f"{LABEL[p]} {gm:.2f}x (n={len(v)}, min {min(v):.2f}x)")
        lines.append(f"- {op} {d}: " + "; ".join(parts))
    return lines


CSV_FIELDS = ["op", "shape", "dtype", "dir", "provider", "status", "mode", "ms", "gbps", "pct_copy",
              "ratio", "err", "err_vs", "x_bytes", "compile_s", "note"]


def write_outputs(out_dir: Path, meta, results, overhead, md: str):
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "bench_norms.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in results:
            w.writerow({k: r.get(k, "") for k in CSV_FIELDS})

    def clean(o):
        if isinstance(o, float) and not math.isfinite(o):
            return str(o)
        if isinstance(o, dict):
            return {k: clean(v) for k, v in o.items()}
        if isinstance(o, list):
            return [clean(v) for v in o]
        return o

    with open(out_dir / "bench_norms.json", "w") as f:
        json.dump(clean(dict(meta=meta, results=results, host_overhead=overhead, markdown=md)), f, indent=1)


def plot(out_dir: Path, meta, results):
    """GB/s vs N for the LayerNorm sweep (M = 4096), forward and backward, one line per provider."""
    rows = [r for r in results if r["op"] == "layernorm" and r.get("status") == "ok"
            and r["shape"].startswith("4096x")]
    if not rows:
        log("[plot] no LayerNorm M=4096 results: no plot")
        return None
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        log(f"[plot] matplotlib not importable ({short(e)}): no plot")
        return None
    dtypes = sorted({r["dtype"] for r in rows})
    fig, axes = plt.subplots(len(dtypes), 2, figsize=(12, 4.5 * len(dtypes)), squeeze=False)
    for i, dt in enumerate(dtypes):
        for j, d in enumerate(("fwd", "bwd")):
            ax = axes[i][j]
            for p in PROVIDERS:
                pts = sorted((int(r["shape"].split("x")[1]), r["gbps"]) for r in rows
                             if r["dtype"] == dt and r["dir"] == d and r["provider"] == p)
                if pts:
                    ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o",
                            linestyle="--" if p in U_PROVIDERS else "-", label=LABEL[p])
            ax.axhline(meta["copy_gbps"], color="gray", linestyle=":", label="copy bandwidth")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("N (M = 4096 rows)")
            ax.set_ylabel("GB/s (" + ("2" if d == "fwd" else "3") + "*|x| / time)")
            ax.set_title(f"LayerNorm {'forward' if d == 'fwd' else 'backward'}, {dt}")
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"fastweight vs peers, {meta['device']}")
    fig.tight_layout()
    path = out_dir / "layernorm_gbps.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="bench_norms.py",
        description="fastweight's LayerNorm family (layernorm, rmsnorm, adalayernorm, headnorm) against torch "
                    "eager, torch.compile, FLA's Triton norms and cuDNN, side by side in one run (forward and "
                    "backward, GB/s and share of the measured copy bandwidth, errors vs fastweight).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a handful of shapes, bf16 only (under a minute)")
    p.add_argument("--out", default=str(REPO / "bench" / "out"), help="folder for the CSV, JSON, markdown and PNG")
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated ops")
    p.add_argument("--shapes", default="", help="comma-separated shapes to keep, as the table writes them (e.g. 512x32768)")
    p.add_argument("--extra-shapes", default="",
                   help="comma-separated MxN shapes added to layernorm and rmsnorm (bf16; with --all-dtypes fp16 too), "
                        "e.g. the hidden sizes that are not powers of two: 4096x5120,4096x12288")
    p.add_argument("--providers", default="", help="comma-separated subset of " + ",".join(PROVIDERS) + " (default all)")
    p.add_argument("--bf16-only", action="store_true", help="skip the fp16 cases")
    p.add_argument("--all-dtypes", action="store_true",
                   help="bf16 and fp16 for every shape (default: fp16 only for the M=4096 LayerNorm sweep and adaLN)")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile (its compiles dominate the run)")
    p.add_argument("--compile-budget", type=float, default=None,
                   help="seconds of torch.compile compilation in all (shared by the ops in proportion to their "
                        "cases); later compile cells are n/a. Default 150 (0 in --quick = no limit); 0 = no limit")
    p.add_argument("--time-budget", type=float, default=420.0, help="skip the remaining cases after this many seconds (0: never)")
    p.add_argument("--no-graph", action="store_true", help="time every call eagerly (no CUDA graphs)")
    p.add_argument("--no-overhead", action="store_true", help="skip the host-overhead table")
    p.add_argument("--fastweight-path", default="", help="folder holding the fastweight package (with _C); default: "
                   "as installed, else build/*/python, else python/")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failing providers")
    p.add_argument("--dry-cpu", action="store_true", help=argparse.SUPPRESS)  # logic check without a GPU
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    meta, results, overhead = run(args)
    md = markdown(meta, results, overhead)
    out_dir = Path(args.out)
    write_outputs(out_dir, meta, results, overhead, md)
    png = plot(out_dir, meta, results)
    print(md, flush=True)
    log(f"[done] wrote {out_dir}/bench_norms.csv, bench_norms.json" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
