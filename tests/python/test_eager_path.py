"""Tests of the host fast paths of the Python layer (CPU; the paths are the same on CUDA):

* the binding's tensor specs ``(data_ptr, dtype_code, shape, strides, device_type, device_index)``
  and ``(data_ptr, nbytes)`` workspaces, next to DLPack arrays (bindings/module.cpp);
* the eager path of the functional API (fastweight.ops: a torch.autograd.Function over _C, no
  dispatcher; the norms, fastweight.mlstm and fastweight.delta_rule), which must give the bits of
  the custom ops (the path under torch.compile), forward and every gradient, and must step aside
  for tracing, subclasses, modes and functorch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fastweight
from fastweight import _C, ops

OPS = ["layernorm", "rmsnorm", "headnorm", "adalayernorm"]
EPS = {"layernorm": 1e-5, "rmsnorm": 1e-6, "headnorm": 1e-6, "adalayernorm": 1e-5}
EAGER_NODE = {"layernorm": "_LayerNormFnBackward", "rmsnorm": "_RMSNormFnBackward",
              "headnorm": "_HeadNormFnBackward", "adalayernorm": "_AdaLayerNormFnBackward"}


def _inputs(op, dtype, *, params="all", pdtype=None, layout="contig", n=24, seed=0):
    """x, p (weight / scale), q (bias / shift) for op; params: "all", "first" or "none"."""
    gen = torch.Generator().manual_seed(seed)
    pdtype = pdtype or dtype
    xs = {"layernorm": (2, 5, n), "rmsnorm": (2, 5, n), "headnorm": (2, 5, 3, n), "adalayernorm": (2, 5, n)}[op]
    ps = {"layernorm": (n,), "rmsnorm": (n,), "headnorm": (3, n), "adalayernorm": (2, 1, n)}[op]

    def r(shape, dt, scale=1.0, shift=0.0):
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale + shift).to(dt)

    if layout == "contig":
        x = r(xs, dtype, 2.0, 0.5)
    elif layout == "strided":  # rows at a larger stride, unaligned start
        x = r((*xs[:-1], n + 3), dtype, 2.0, 0.5)[..., 1:n + 1]
    else:  # "last-dim": last dimension not contiguous (the functional API copies)
        x = r((*xs, 2), dtype, 2.0, 0.5)[..., 0]
    p = r(ps, pdtype, 0.5, 1.0) if params in ("all", "first") or op == "adalayernorm" else None
    q = r(ps, pdtype, 0.5) if params == "all" and op != "rmsnorm" else None
    return x, p, q


def _functional(op, x, p, q, weight_offset=0.0):
    if op == "layernorm":
        return fastweight.layer_norm(x, p, q, EPS[op])
    if op == "rmsnorm":
        return fastweight.rms_norm(x, p, EPS[op])
    if op == "headnorm":
        return fastweight.head_norm(x, p, q, EPS[op], weight_offset)
    return fastweight.adaptive_layer_norm(x, p, q, EPS[op])


def _custom_op(op, x, p, q, weight_offset=0.0):
    """What the functional API calls under torch.compile (same argument preparation)."""
    x, p, q = ops._last_contig(x), ops._last_contig(p), ops._last_contig(q)
    lib = torch.ops.fastweight
    if op == "layernorm":
        return lib.layernorm_fwd(x, p, q, EPS[op], 0.0)[0]
    if op == "rmsnorm":
        return lib.rmsnorm_fwd(x, p, EPS[op], 0.0)[0]
    if op == "headnorm":
        return lib.headnorm_fwd(x, p, q, EPS[op], float(weight_offset))[0]
    return lib.adalayernorm_fwd(x, p, q, EPS[op])[0]


def _leaves(*ts):
    return [t.detach().requires_grad_() if t is not None else None for t in ts]


def _grads(fn, op, x, p, q, dy, weight_offset):
    x, p, q = _leaves(x, p, q)
    y = fn(op, x, p, q, weight_offset)
    leaves = [t for t in (x, p, q) if t is not None]
    if dy == "sum":  # an expanded (stride 0) dy
        grads = torch.autograd.grad(y.sum(), leaves)
    else:
        grads = torch.autograd.grad(y, leaves, dy)
    return y, list(grads)


def _cases():
    for op in OPS:
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            name = str(dtype).split(".")[-1]
            yield pytest.param(op, dtype, {}, id=f"{op}-{name}")
        yield pytest.param(op, torch.float32, {"params": "none"}, id=f"{op}-no-params")
        yield pytest.param(op, torch.float32, {"params": "first"}, id=f"{op}-first-param")
        yield pytest.param(op, torch.bfloat16, {"pdtype": torch.float32}, id=f"{op}-f32-params")
        yield pytest.param(op, torch.float32, {"layout": "strided"}, id=f"{op}-strided")
        yield pytest.param(op, torch.float16, {"layout": "last-dim"}, id=f"{op}-last-dim-copy")
        yield pytest.param(op, torch.float32, {"dy": "sum"}, id=f"{op}-sum-backward")
    yield pytest.param("headnorm", torch.bfloat16, {"weight_offset": 1.0}, id="headnorm-offset")


@pytest.mark.parametrize("op,dtype,cfg", list(_cases()))
def test_eager_path_bitwise_equals_custom_op(op, dtype, cfg):
    """The eager autograd.Function and the custom ops: the same bits, forward and every gradient."""
    cfg = dict(cfg)
    dy_kind, off = cfg.pop("dy", "random"), cfg.pop("weight_offset", 0.0)
    x, p, q = _inputs(op, dtype, **cfg)
    dy = "sum" if dy_kind == "sum" else torch.randn(x.shape, generator=torch.Generator().manual_seed(7)).to(dtype)

    ye, ge = _grads(_functional, op, x, p, q, dy, off)
    yc, gc = _grads(_custom_op, op, x, p, q, dy, off)
    assert type(ye.grad_fn).__name__ == EAGER_NODE[op]  # the eager path was taken
    assert "fastweight" in type(yc.grad_fn).__name__  # the custom op's autograd node
    assert ye.dtype == yc.dtype and ye.shape == yc.shape and ye.is_contiguous()
    assert torch.equal(ye, yc), f"{op}: y differs"
    assert len(ge) == len(gc)
    for i, (a, c) in enumerate(zip(ge, gc)):
        assert a.dtype == c.dtype and a.shape == c.shape, f"{op}: grad {i} {a.dtype}{tuple(a.shape)}"
        assert torch.equal(a, c), f"{op}: grad {i} differs"

    # Without a gradient to compute (no_grad / no input requiring grad): no statistics, same y.
    with torch.no_grad():
        yn = _functional(op, x, p, q, off)
    assert yn.grad_fn is None and not yn.requires_grad
    assert torch.equal(yn, yc.detach())
    assert torch.equal(_functional(op, x, p, q, off), yn)


@pytest.mark.parametrize("op", OPS)
def test_eager_path_double_backward_refused(op):
    x, p, q = _leaves(*_inputs(op, torch.float64))
    g = torch.autograd.grad(_functional(op, x, p, q).square().sum(), x, create_graph=True)[0]
    with pytest.raises(RuntimeError, match="differentiate twice"):
        g.sum().backward()


def _custom_op_node(y):
    """The custom op's autograd node is in y's graph (a subclass may add an alias node on top)."""
    node = y.grad_fn
    while node is not None and "fastweight" not in type(node).__name__:
        node = node.next_functions[0][0] if node.next_functions else None
    return node is not None


def _dispatched(fn):
    """The ops dispatched while fn runs under a logging TorchDispatchMode."""
    seen = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Log():
        fn()
    return seen


def test_routes_away_from_eager_path():
    """Subclasses, dispatch modes, FakeTensors and functorch transforms get the custom ops."""
    x, w, b = _leaves(*_inputs("layernorm", torch.float32))
    assert type(fastweight.layer_norm(x, w, b).grad_fn).__name__ == "_LayerNormFnBackward"
    assert isinstance(fastweight.nn.LayerNorm(24)(x).grad_fn, torch.autograd.function.BackwardCFunction)

    class Sub(torch.Tensor):
        pass

    xs = x.detach().as_subclass(Sub).requires_grad_()
    y = fastweight.layer_norm(xs, w, b)
    assert _custom_op_node(y)
    assert torch.equal(y.detach().as_subclass(torch.Tensor), fastweight.layer_norm(x, w, b).detach())

    seen = _dispatched(lambda: fastweight.rms_norm(x, w))
    assert any("fastweight.rmsnorm_fwd" in s for s in seen), seen

    from torch._subclasses.fake_tensor import FakeTensorMode
    real = x.detach().view(2, 5, 3, 8)
    with FakeTensorMode() as mode:
        fy = fastweight.head_norm(mode.from_tensor(real), None, None)
    assert fy.shape == (2, 5, 3, 8)

    yv = torch.func.vmap(lambda r: fastweight.layer_norm(r, w.detach(), b.detach()))(x.detach())
    assert torch.equal(yv, fastweight.layer_norm(x.detach(), w.detach(), b.detach()))


# ---- the binding's tensor specs -----------------------------------------------------------------
def _spec_of(t):
    return ops._spec(t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64],
                         ids=lambda d: str(d).split(".")[-1])
def test_spec_equals_dlpack(dtype):
    """The same call through specs and through DLPack arrays writes the same bits (strided x)."""
    gen = torch.Generator().manual_seed(1)
    big = torch.randn(6, 21, generator=gen).to(dtype)
    x = big[:, 2:18]  # rows at stride 21
    w, b = torch.randn(16, generator=gen).to(dtype), torch.randn(16, generator=gen).to(dtype)
    dy = torch.randn(6, 16, generator=gen).to(dtype)
    outs = []
    for conv in (lambda t: t, _spec_of):
        y, mean, rstd = torch.empty(6, 16, dtype=dtype), torch.empty(6), torch.empty(6)
        _C.layernorm_fwd(conv(x), conv(w), conv(b), conv(y), conv(mean), conv(rstd), 1e-5, 0.0, 0)
        dx, dw, db = torch.empty(6, 16, dtype=dtype), torch.empty(16, dtype=dtype), torch.empty(16, dtype=dtype)
        args = (conv(dy), conv(x), conv(w), conv(mean), conv(rstd), conv(dx), conv(dw), conv(db), 0.0)
        assert _C.layernorm_bwd_workspace_size(*args) == 0
        _C.layernorm_bwd(*args, (0, 0) if conv is _spec_of else None, 0)
        outs.append((y, mean, rstd, dx, dw, db))
    for a, c in zip(*outs):
        assert torch.equal(a, c)


def test_spec_accepts_plain_tuples_and_workspace_forms():
    x = torch.randn(3, 8)
    y1, y2 = torch.empty_like(x), torch.empty_like(x)
    spec = (x.data_ptr(), 0, tuple(x.shape), tuple(x.stride()), 0, 0)
    _C.rmsnorm_fwd(spec, None, (y1.data_ptr(), 0, (3, 8), (8, 1), 0, 0), None)
    _C.rmsnorm_fwd(x, None, y2, None)
    assert torch.equal(y1, y2)
    rstd = torch.empty(3)
    _C.rmsnorm_fwd(x, None, y1, rstd)
    dx1, dx2, dx3 = (torch.empty_like(x) for _ in range(3))
    ws = torch.empty(16, dtype=torch.uint8)
    _C.rmsnorm_bwd(_spec_of(x), _spec_of(x), None, _spec_of(rstd), _spec_of(dx1), None, 0.0, (ws.data_ptr(), 16))
    _C.rmsnorm_bwd(x, x, None, rstd, dx2, None, 0.0, ws)  # an array workspace, as before
    _C.rmsnorm_bwd(x.numpy(), x.numpy(), None, rstd.numpy(), dx3.numpy(), None)  # numpy still works
    assert torch.equal(dx1, dx2) and torch.equal(dx1, dx3)


def test_spec_errors_name_the_argument():
    x = torch.randn(2, 4)
    y = torch.empty_like(x)
    p = x.data_ptr()
    bad = [
        ((p, 7, (2, 4), (4, 1), 0, 0), r"layernorm_fwd: x: dtype code 7 is not supported"),
        ((p, 0, (2, 4), (4, 1), 2, 0), r"layernorm_fwd: x: device type 2 is not supported"),
        ((p, 0, (1,) * 9, (1,) * 9, 0, 0), r"layernorm_fwd: x: 9 dimensions, at most 8"),
        ((p, 0, (2, 4), (4,), 0, 0), r"layernorm_fwd: x: expected an array or a tensor spec"),
        (("p", 0, (2, 4), (4, 1), 0, 0), r"layernorm_fwd: x: expected an array or a tensor spec"),
        ((p, 0, [2, 4], [4, 1], 0, 0), r"layernorm_fwd: x: expected an array or a tensor spec"),
        ((p + 2, 0, (2, 4), (4, 1), 0, 0), r"layernorm_fwd: x: misaligned pointer"),  # the C++ API's checks
        ((p, 1, (2, 4), (4, 1), 0, 0), r"layernorm_fwd: y: expected dtype float16 \(that of x\)"),
    ]
    for spec, msg in bad:
        with pytest.raises(ValueError, match=msg):
            _C.layernorm_fwd(spec, None, None, y, None, None)
    with pytest.raises(ValueError, match=r"layernorm_bwd: workspace: expected an array or \(data_ptr: int, nbytes: int\)"):
        m, r = torch.zeros(2), torch.ones(2)
        _C.layernorm_bwd(x, x, None, m, r, y, None, None, 0.0, (0, "many"))
    with pytest.raises(TypeError):  # neither an array nor a spec (a tuple of another length)
        _C.layernorm_fwd((p, 0, (2, 4)), None, None, y, None, None)
    # A dtype without a spec code takes the DLPack route in ops._spec: the same message as before.
    assert isinstance(_spec_of(torch.ones(2, dtype=torch.int16)), torch.Tensor)
    with pytest.raises(ValueError, match=r"rmsnorm_fwd: x: dtype int16 is not supported"):
        fastweight.rms_norm(torch.ones(4, 16, dtype=torch.int16))
    # int32 / int64 have spec codes (for cu_seqlens); the float ops' checks reject them by name.
    assert isinstance(_spec_of(torch.ones(2, dtype=torch.int32)), tuple)
    with pytest.raises(ValueError, match=r"rmsnorm_fwd: x: dtype int32 is not supported"):
        fastweight.rms_norm(torch.ones(4, 16, dtype=torch.int32))
    np.testing.assert_array_equal(fastweight.layer_norm(np.ones((2, 4), np.float32)), np.zeros((2, 4), np.float32))


# ---- mLSTM (chunkwise) and DeltaNet -----------------------------------------------------------------
def _grads_of(leaves, outs, cots):
    """Gradients of outs (with cotangents cots) to the non-None leaves."""
    return torch.autograd.grad(outs, [t for t in leaves if t is not None], cots)


def _assert_same(node, eager, custom):
    """eager / custom: (primary output, extra outputs or None, gradients): equal bits throughout."""
    (ye, xe, ge), (yc, xc, gc) = eager, custom
    assert type(ye.grad_fn).__name__ == node  # the eager path was taken
    assert torch.equal(ye, yc)
    for a, c in zip(xe or (), xc or ()):
        assert torch.equal(a, c)
    assert len(ge) == len(gc)
    for idx, (a, c) in enumerate(zip(ge, gc)):
        assert a.dtype == c.dtype and a.shape == c.shape, f"grad {idx}"
        assert torch.equal(a, c), f"grad {idx} differs"


def _mlstm_inputs(dtype, states, seed=0, S=37):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0, shift=0.0):
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale + shift).to(dtype)
    B, NH, DQK, DV = 2, 2, 8, 12
    q, k, v = r(B, NH, S, DQK), r(B, NH, S, DQK), r(B, NH, S, DV)
    i, f = r(B, NH, S), r(B, NH, S, shift=2.0)
    st = (r(B, NH, DQK, DV).float(), r(B, NH, DQK).float(), r(B, NH, 1).float()) if states else (None, None, None)
    return (q, k, v, i, f, *st)


def _mlstm_custom_op(q, k, v, i, f, c0, n0, m0, ret, chunk):
    """What fastweight.mlstm calls under torch.compile (same argument preparation)."""
    from fastweight import mlstm_ops as mo
    c0, n0, m0 = mo._prep_states(q, c0, n0, m0)
    return torch.ops.fastweight.mlstm_fwd(ops._last_contig(q), ops._last_contig(k), ops._last_contig(v),
                                          ops._prep_gate(i, q), ops._prep_gate(f, q), c0, n0, m0, 1e-6, chunk, ret)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("states,ret", [(False, False), (True, False), (True, True), (False, True)],
                         ids=["plain", "init", "init-last", "last"])
def test_mlstm_eager_path_bitwise_equals_custom_op(dtype, states, ret):
    """fastweight.mlstm's eager autograd.Function and the custom op: the same bits, h, the last states
    and every gradient (the initial states' included)."""
    chunk = 16
    base = _mlstm_inputs(dtype, states)
    gen = torch.Generator().manual_seed(3)
    dh = torch.randn(base[2].shape, generator=gen).to(dtype)
    cot = [torch.randn(s, generator=gen) for s in ((2, 2, 8, 12), (2, 2, 8), (2, 2, 1))]

    def run(eager):
        leaves = _leaves(*base)
        if eager:
            res = fastweight.mlstm(*leaves[:5], *leaves[5:], return_last_states=ret, chunk_size=chunk)
            h, last = (res[0], res[1]) if ret else (res, None)
        else:
            h, c, n, m = _mlstm_custom_op(*leaves, ret, chunk)
            last = (c, n, m) if ret else None
        outs, cots = ([h, *last], [dh, *cot]) if ret else ([h], [dh])
        return h, last, _grads_of(leaves, outs, cots)

    custom = run(False)
    hc = custom[0]
    _assert_same("_MlstmFnBackward", run(True), custom)
    with torch.no_grad():
        hn = fastweight.mlstm(*base[:5], *base[5:], chunk_size=chunk)
    assert hn.grad_fn is None and torch.equal(hn, hc.detach())


def test_mlstm_eager_path_double_backward_refused_and_routes():
    q, k, v, i, f, *_ = _leaves(*_mlstm_inputs(torch.float64, False, S=9))
    g = torch.autograd.grad(fastweight.mlstm(q, k, v, i, f, chunk_size=16).square().sum(), q, create_graph=True)[0]
    with pytest.raises(RuntimeError, match="differentiate twice"):
        g.sum().backward()
    seen = _dispatched(lambda: fastweight.mlstm(q, k, v, i, f, chunk_size=16))  # a dispatch mode: the custom op
    assert any("fastweight.mlstm_fwd" in s for s in seen), seen


# ---- DeltaNet ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("cfg", ["plain", "init-final", "l2", "varlen"])
def test_delta_rule_eager_path_bitwise_equals_custom_op(dtype, cfg):
    """fastweight.delta_rule's eager autograd.Function and the custom op: the same bits, o, the final
    state and every gradient (the initial state's included)."""
    gen = torch.Generator().manual_seed(11)

    def r(*shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    B, T, H, K, V = (1, 23, 2, 8, 12) if cfg == "varlen" else (2, 23, 2, 8, 12)
    q, k, v = r(B, T, H, K), r(B, T, H, K) * 0.3, r(B, T, H, V)
    beta = torch.rand((B, T, H), generator=gen, dtype=torch.float64).to(dtype)
    cu = torch.tensor([0, 5, 5, 23], dtype=torch.int32) if cfg == "varlen" else None
    N = 3 if cu is not None else B
    sdt = torch.float64 if dtype == torch.float64 else torch.float32
    h0 = torch.randn((N, H, K, V), generator=gen, dtype=torch.float64).to(sdt) if cfg in ("init-final", "varlen") else None
    final = cfg in ("init-final", "varlen")
    l2 = cfg == "l2"
    do = r(B, T, H, V)
    dht = torch.randn((N, H, K, V), generator=gen, dtype=torch.float64).to(sdt)

    def run(eager):
        leaves = _leaves(q, k, v, beta, h0)
        if eager:
            o, ht = fastweight.delta_rule(*leaves[:4], initial_state=leaves[4], output_final_state=final,
                                          use_qk_l2norm_in_kernel=l2, cu_seqlens=cu)
        else:
            o, ht, _ = torch.ops.fastweight.deltanet_fwd(*[ops._last_contig(t) for t in leaves[:3]],
                                                         ops._prep_gate(leaves[3], leaves[0]), leaves[4], cu, None, l2,
                                                         final, True, True)
            ht = ht if final else None
        outs, cots = ([o, ht], [do, dht]) if final else ([o], [do])
        return o, ((ht,) if final else None), _grads_of(leaves, outs, cots)

    custom = run(False)
    oc = custom[0]
    _assert_same("_DeltaRuleFnBackward", run(True), custom)
    with torch.no_grad():
        on, _ = fastweight.delta_rule(q, k, v, beta, initial_state=h0, use_qk_l2norm_in_kernel=l2, cu_seqlens=cu)
    assert on.grad_fn is None and torch.equal(on, oc.detach())


# ---- decoding steps: plain eager mode calls _C directly ---------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).split(".")[-1])
def test_steps_eager_path_bitwise_equals_custom_ops(dtype):
    gen = torch.Generator().manual_seed(5)

    def r(*shape, dt=dtype):
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dt)
    q, k, v, i, f = r(2, 3, 8), r(2, 3, 8), r(2, 3, 12), r(2, 3), r(2, 3)
    c, n, m = r(2, 3, 8, 12, dt=torch.float32), r(2, 3, 8, dt=torch.float32), r(2, 3, 1, dt=torch.float32)
    lib = torch.ops.fastweight
    h, (c2, n2, m2) = fastweight.mlstm_step(q, k, v, i, f, c, n, m)
    want = lib.mlstm_step(q, k, v, ops._prep_gate(i, q), ops._prep_gate(f, q), c, n, m, 1e-6)
    for a, b in zip((h, c2, n2, m2), want):
        assert torch.equal(a, b)
    ci, ni, mi = c.clone(), n.clone(), m.clone()
    hi, _ = fastweight.mlstm_step(q, k, v, i, f, ci, ni, mi, inplace=True)
    assert torch.equal(hi, h) and torch.equal(ci, c2) and torch.equal(ni, n2) and torch.equal(mi, m2)

    qd, kd, vd, beta = r(2, 3, 8), r(2, 3, 8) * 0.3, r(2, 3, 12), torch.rand((2, 3), generator=gen).to(dtype)
    s0 = r(2, 3, 8, 12, dt=torch.float32)
    o, s1 = fastweight.delta_rule_step(qd, kd, vd, beta, s0, use_qk_l2norm_in_kernel=True)
    wo, ws = lib.deltanet_step(qd, kd, vd, ops._prep_gate(beta, qd), s0, None, True)
    assert torch.equal(o, wo) and torch.equal(s1, ws)
    si = s0.clone()
    oi, same = fastweight.delta_rule_step(qd, kd, vd, beta, si, use_qk_l2norm_in_kernel=True, inplace=True)
    assert same is si and torch.equal(oi, o) and torch.equal(si, s1)
    # a dispatch mode sees the custom ops
    seen = _dispatched(lambda: fastweight.delta_rule_step(qd, kd, vd, beta, s0))
    assert any("fastweight.deltanet_step" in s for s in seen), seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=lambda d: str(d).split(".")[-1])
def test_mlstm_parallel_eager_path_bitwise_equals_custom_op(dtype):
    """fastweight.mlstm_parallel's eager autograd.Function and the custom op: h, n, m and every gradient."""
    base = _mlstm_inputs(dtype, False, S=21)[:5]
    dh = torch.randn(base[2].shape, generator=torch.Generator().manual_seed(9)).to(dtype)

    def run(eager):
        leaves = _leaves(*base)
        if eager:
            h, n, m = fastweight.mlstm_parallel(*leaves)
        else:
            q, k, v, i, f = leaves
            h, n, m, _ = torch.ops.fastweight.mlstm_parallel_fwd(q, k, v, ops._prep_gate(i, q), ops._prep_gate(f, q),
                                                                 1e-6)
        return h, (n, m), _grads_of(leaves, [h], [dh])

    custom = run(False)
    _assert_same("_ParallelFnBackward", run(True), custom)
    with torch.no_grad():
        hn, _, _ = fastweight.mlstm_parallel(*base)
    assert hn.grad_fn is None and torch.equal(hn, custom[0].detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("params", ["both", "weight", "none"])
def test_mlstm_parallel_headnorm_eager_path_bitwise_equals_custom_op(dtype, params):
    base = _mlstm_inputs(dtype, False, S=21)[:5]
    gen = torch.Generator().manual_seed(13)
    w = torch.randn((2, 12), generator=gen).to(dtype) if params != "none" else None
    b = torch.randn((2, 12), generator=gen).to(dtype) if params == "both" else None
    dout = torch.randn(base[2].shape, generator=gen).to(dtype)

    def run(eager):
        leaves = _leaves(*base, w, b)
        if eager:
            out = fastweight.mlstm_parallel_headnorm(*leaves, weight_offset=1.0)
        else:
            q, k, v, i, f, lw, lb = leaves
            out = torch.ops.fastweight.mlstm_parallel_headnorm_fwd(q, k, v, ops._prep_gate(i, q), ops._prep_gate(f, q),
                                                                   lw, lb, 1e-6, 1e-6, 1.0)[0]
        return out, None, _grads_of(leaves, [out], [dout])

    _assert_same("_ParHeadNormFnBackward", run(True), run(False))
