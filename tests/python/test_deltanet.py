"""Tests of the Python DeltaNet layer (fastweight.delta_rule, fastweight.compat.fla).

Every result is compared with an independent float64 PyTorch implementation of MATH.md §3 written
below (the loop form, step by step; gradients by float64 autograd of it), by relative Frobenius
error. CPU tests run the C++ reference through the binding. Where flash-linear-attention is
installed its own naive torch implementation is compared too. On CUDA tensors (tests marked `gpu`,
skipped without a GPU) the forward, the backward (autograd, with its workspace from torch's caching
allocator) and the decoding step run the CUDA kernels and are checked the same way, on fresh random
inputs, against the reference and against the CPU float64 path on the same inputs.
"""

from __future__ import annotations

import random

import pytest
import torch

import fastweight
from fastweight.compat import fla as fw_fla
from fwtest_util import rel_err, same_bits_twice_and_in_a_graph

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device")
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


# ---- the float64 reference (independent of fastweight) ------------------------------------------
def _l2(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def prepare(q, k, v, beta, scale, l2, cu_seqlens):
    """float64 inputs (L2-normalised q, k when asked), the scale, and the sequences as (b, bos, eos)."""
    q, k, v, beta = (t.double() for t in (q, k, v, beta))
    if l2:
        q, k = _l2(q), _l2(k)
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    if cu_seqlens is None:
        seqs = [(b, 0, T) for b in range(B)]
    else:
        cu = [int(x) for x in cu_seqlens]
        seqs = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    return q, k, v, beta, scale, seqs


def ref_delta_rule(q, k, v, beta, scale=None, h0=None, l2=False, cu_seqlens=None):
    """MATH.md §3, loop form, float64, differentiable: o (B, T, H, V) and the final states (N, H, K, V)."""
    q, k, v, beta, scale, seqs = prepare(q, k, v, beta, scale, l2, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    outs, finals = [], []
    for n, (b, bos, eos) in enumerate(seqs):
        S = h0[n].double() if h0 is not None else q.new_zeros(H, K, V)
        rows = []
        for t in range(bos, eos):
            qt, kt, vt, bt = q[b, t], k[b, t], v[b, t], beta[b, t]  # (H, K) (H, K) (H, V) (H)
            e = vt - torch.einsum("hkv,hk->hv", S, kt)
            S = S + bt[:, None, None] * kt[:, :, None] * e[:, None, :]
            rows.append(scale * torch.einsum("hkv,hk->hv", S, qt))
        outs.append(torch.stack(rows) if rows else q.new_zeros(0, H, V))
        finals.append(S)
    o = torch.stack(outs) if cu_seqlens is None else torch.cat(outs).unsqueeze(0)
    return o, torch.stack(finals)


def make(B=2, T=37, H=3, K=8, V=5, dtype=torch.float64, N=None, seed=0, device="cpu"):
    """q, k, v, beta in dtype and an initial state (N, H, K, V) in float32 (float64 for float64)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    q, v = r(B, T, H, K), r(B, T, H, V)
    k = r(B, T, H, K) / K ** 0.5  # |k| ~ 1: with beta in (0, 1) the recurrence stays a contraction
    beta = torch.rand(B, T, H, generator=g, dtype=torch.float64)
    h0 = r(B if N is None else N, H, K, V).to(torch.float64 if dtype == torch.float64 else torch.float32)
    return [t.to(dtype=dtype, device=device) for t in (q, k, v, beta)] + [h0.to(device)]


# ---- forward ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T", [1, 63, 100])
@pytest.mark.parametrize("states", [False, True])
def test_forward_matches_reference(dtype, T, states):
    q, k, v, beta, h0 = make(T=T, dtype=dtype)
    o, ht = fastweight.delta_rule(q, k, v, beta, initial_state=h0 if states else None, output_final_state=True)
    ro, rht = ref_delta_rule(q, k, v, beta, h0=h0 if states else None)
    assert o.dtype == dtype and o.shape == v.shape
    assert ht.dtype == (torch.float64 if dtype == torch.float64 else torch.float32) and ht.shape == (2, 3, 8, 5)
    assert rel_err(o, ro) < TOL[dtype]
    assert rel_err(ht, rht) < (1e-12 if dtype == torch.float64 else 1e-6)


def test_final_state_is_none_unless_asked_and_scale_default():
    q, k, v, beta, _ = make(T=9)
    o, ht = fastweight.delta_rule(q, k, v, beta)
    assert ht is None
    o2, _ = fastweight.delta_rule(q, k, v, beta, scale=8 ** -0.5)
    assert torch.equal(o, o2)  # scale=None is K^-0.5


def test_split_operands_is_ignored_where_no_tensor_core_kernel_runs():
    q, k, v, beta, h0 = make(T=70, dtype=torch.float32)
    args = [t.requires_grad_() for t in (q, k, v, beta)]
    o, ht = fastweight.delta_rule(*args, initial_state=h0, output_final_state=True)
    o2, ht2 = fastweight.delta_rule(*args, initial_state=h0, output_final_state=True, split_operands=False)
    assert torch.equal(o, o2) and torch.equal(ht, ht2)  # the CPU reference: float64 throughout
    g = torch.autograd.grad(o.sum(), args)
    g2 = torch.autograd.grad(o2.sum(), args)
    assert all(torch.equal(a, b) for a, b in zip(g, g2))


@pytest.mark.parametrize("K,V,T", [(100, 100, 70), (4, 16, 65), (16, 3, 63)])
def test_head_dims_and_l2norm_and_scale(K, V, T):
    q, k, v, beta, h0 = make(B=1, T=T, H=2, K=K, V=V, dtype=torch.float32)
    k = k * 3.0  # the in-kernel L2 norm brings |k| back to 1
    o, ht = fastweight.delta_rule(q, k, v, beta, 0.3, h0, True, use_qk_l2norm_in_kernel=True)
    ro, rht = ref_delta_rule(q, k, v, beta, 0.3, h0, l2=True)
    assert rel_err(o, ro) < 1e-5 and rel_err(ht, rht) < 1e-5


def test_strided_inputs_and_sequence_split():
    q, k, v, beta, h0 = make(T=40)
    big = torch.randn(2, 40, 3, 16, dtype=torch.float64)
    big[..., ::2] = q  # q as a strided view (last dim stride 2): the functional API copies it
    qv = big[..., ::2]
    wide = torch.randn(2, 40, 3, 12, dtype=torch.float64)
    wide[..., :8] = k
    kv = wide[..., :8]  # rows cut from a wider buffer: passed as is (last dim contiguous)
    assert qv.stride(-1) == 2 and kv.stride(-2) == 12
    o, ht = fastweight.delta_rule(qv, kv, v, beta, initial_state=h0, output_final_state=True)
    ro, rht = ref_delta_rule(q, k, v, beta, h0=h0)
    assert rel_err(o, ro) < 1e-12 and rel_err(ht, rht) < 1e-12
    # Two calls joined through the state == one call (context parallelism's stitching).
    o1, s1 = fastweight.delta_rule(q[:, :17], k[:, :17], v[:, :17], beta[:, :17], initial_state=h0,
                                   output_final_state=True)
    o2, s2 = fastweight.delta_rule(q[:, 17:], k[:, 17:], v[:, 17:], beta[:, 17:], initial_state=s1,
                                   output_final_state=True)
    assert rel_err(torch.cat([o1, o2], 1), o) < 1e-12 and rel_err(s2, ht) < 1e-12


# ---- variable length ------------------------------------------------------------------------------
CU = [0, 0, 17, 17, 60, 83, 83]  # empty sequences first, in the middle and last


@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
def test_varlen_matches_reference_and_separate_calls(cu_dtype):
    cu = torch.tensor(CU, dtype=cu_dtype)
    q, k, v, beta, h0 = make(B=1, T=83, N=len(CU) - 1)
    args = [t.requires_grad_() for t in (q, k, v, beta, h0)]
    o, ht = fastweight.delta_rule(*args[:4], initial_state=args[4], output_final_state=True, cu_seqlens=cu,
                                  use_qk_l2norm_in_kernel=True)
    ro, rht = ref_delta_rule(*args[:4], h0=args[4], l2=True, cu_seqlens=cu)
    assert rel_err(o, ro) < 1e-12 and rel_err(ht, rht) < 1e-12
    for n in (0, 2, 5):  # empty sequences: the final state is the initial state
        assert torch.equal(ht[n], h0[n])
    # Each sequence on its own gives the same numbers.
    for n in range(len(CU) - 1):
        a, b = CU[n], CU[n + 1]
        on, hn = fastweight.delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], beta[:, a:b], initial_state=h0[n:n + 1],
                                       output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert rel_err(on, o[:, a:b]) < 1e-12 if b > a else on.shape[1] == 0
        assert rel_err(hn[0], ht[n]) < 1e-12
    # Gradients, the final state's included.
    g = torch.Generator().manual_seed(2)
    do, dht = torch.randn(o.shape, generator=g, dtype=torch.float64), torch.randn(ht.shape, generator=g,
                                                                                    dtype=torch.float64)
    got = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), args)
    want = torch.autograd.grad((ro * do).sum() + (rht * dht).sum(), args)
    for name, a, b in zip(["q", "k", "v", "beta", "initial_state"], got, want):
        assert rel_err(a, b) < 1e-11, name


# ---- backward -----------------------------------------------------------------------------------
def test_gradcheck_float64():
    q, k, v, beta, h0 = make(B=2, T=5, H=2, K=3, V=2)
    args = [t.requires_grad_() for t in (q, k, v, beta, h0)]

    def fn(q, k, v, beta, h0):
        return fastweight.delta_rule(q, k, v, beta, initial_state=h0, output_final_state=True)
    assert torch.autograd.gradcheck(fn, args)


def test_gradcheck_float64_varlen_l2norm_no_final_state():
    cu = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    q, k, v, beta, h0 = make(B=1, T=7, H=1, K=3, V=4, N=3)
    args = [t.requires_grad_() for t in (q, k, v, beta, h0)]

    def fn(q, k, v, beta, h0):
        return fastweight.delta_rule(q, k, v, beta, 0.8, h0, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)[0]
    assert torch.autograd.gradcheck(fn, args)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_gradients_match_reference_autograd(dtype):
    q, k, v, beta, h0 = make(T=70, dtype=dtype)
    args = [t.requires_grad_() for t in (q, k, v, beta, h0)]
    o, ht = fastweight.delta_rule(*args[:4], initial_state=args[4], output_final_state=True)
    g = torch.Generator().manual_seed(1)
    do, dht = (torch.randn(t.shape, generator=g, dtype=torch.float64) for t in (o, ht))
    got = torch.autograd.grad((o.double() * do).sum() + (ht.double() * dht).sum(), args)
    ref_args = [t.detach().double().requires_grad_() for t in args]
    ro, rht = ref_delta_rule(*ref_args[:4], h0=ref_args[4])
    want = torch.autograd.grad((ro * do).sum() + (rht * dht).sum(), ref_args)
    # do and dht reach the backward rounded to o's and the state's dtype, every gradient goes out in
    # its input's dtype: the IO dtype bounds them all (float32: 1e-6, float32 rounding of 70 steps).
    tol = 1e-6 if dtype == torch.float32 else TOL[dtype]
    for name, a, b, t in zip(["q", "k", "v", "beta", "initial_state"], got, want, args):
        assert a.dtype == t.dtype
        assert rel_err(a, b) < tol, name


def test_beta_in_float32_and_other_dtypes_cast():
    q, k, v, beta, _ = make(T=20, dtype=torch.bfloat16)
    o32, _ = fastweight.delta_rule(q, k, v, beta.float())
    o64, _ = fastweight.delta_rule(q, k, v, beta.double())  # cast to float32 (not a q dtype)
    assert torch.equal(o32, o64)
    ro, _ = ref_delta_rule(q, k, v, beta.float())
    assert rel_err(o32, ro) < TOL[torch.bfloat16]


# ---- torch.compile, custom-op checks ----------------------------------------------------------------
def test_opcheck():
    cu = torch.tensor([0, 4, 9], dtype=torch.int64)
    q, k, v, beta, h0 = make(B=1, T=9, H=2, K=4, V=3, N=2)
    args = [t.requires_grad_() for t in (q, k, v, beta)]
    fwd = torch.ops.fastweight.deltanet_fwd.default
    torch.library.opcheck(fwd, (*args, h0.requires_grad_(), cu, None, True, True, True, True))
    torch.library.opcheck(fwd, (*args, None, None, 0.5, False, False, False, False))
    do = torch.randn(1, 9, 2, 3, dtype=torch.float64)
    torch.library.opcheck(torch.ops.fastweight.deltanet_bwd.default,
                          (do, *[a.detach() for a in args], h0.detach(), cu, torch.randn_like(h0), None, False, True,
                           None))


def test_compile_fullgraph():
    cu = torch.tensor([0, 5, 20], dtype=torch.int32)
    q, k, v, beta, h0 = make(B=1, T=20, H=2, K=4, V=4, N=2, dtype=torch.float32)

    def fn(q, k, v, beta, h0):
        o, ht = fastweight.delta_rule(q, k, v, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                      use_qk_l2norm_in_kernel=True)
        return o * 2.0, ht

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    args = [t.requires_grad_() for t in (q, k, v, beta, h0)]
    got, want = compiled(*args), fn(*args)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    ga = torch.autograd.grad(got[0].sum() + got[1].sum(), args)
    gb = torch.autograd.grad(want[0].sum() + want[1].sum(), args)
    for a, b in zip(ga, gb):
        assert torch.equal(a, b)


# ---- drop-in shims ----------------------------------------------------------------------------------
def test_fla_shims_equal_delta_rule():
    cu = torch.tensor([0, 7, 30], dtype=torch.int64)
    q, k, v, beta, h0 = make(B=1, T=30, N=2, dtype=torch.float32)
    want = fastweight.delta_rule(q, k, v, beta, 0.5, h0, True, True, cu)
    for fn in (fw_fla.chunk_delta_rule, fw_fla.fused_recurrent_delta_rule):
        # FLA's positional order: scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens.
        got = fn(q, k, v, beta, 0.5, h0, True, True, cu)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        got = fn(q, k, v, beta, scale=0.5, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                 use_qk_l2norm_in_kernel=True)
        assert torch.equal(got[0], want[0])
        got = fn(q, k, v, beta, 0.5, h0, True, True, offsets=cu, checkpoint_level=1)  # older FLA's names
        assert torch.equal(got[0], want[0])
        got = fn(q, k, v, beta, 0.5, h0, True, True, cu, split_operands=True)  # fastweight's keyword (CPU: no effect)
        assert torch.equal(got[0], want[0])
        if fn is fw_fla.chunk_delta_rule:  # FLA 0.6: cu_seqlens_cpu (10th positional), chunk_size
            got = fn(q, k, v, beta, 0.5, h0, True, True, cu, cu.cpu(), chunk_size=32)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            got = fn(q, k, v, beta, 0.5, h0, True, True, cu_seqlens=cu, cu_seqlens_cpu=cu.cpu())
            assert torch.equal(got[0], want[0])
        o, ht = fn(q, k, v, beta)
        assert ht is None and torch.equal(o, fastweight.delta_rule(q, k, v, beta)[0])


def test_fla_shim_head_first_and_defaults():
    q, k, v, beta, h0 = make(T=12, dtype=torch.float32)
    want, wht = fastweight.delta_rule(q, k, v, beta, initial_state=h0, output_final_state=True)
    hf = [t.transpose(1, 2).contiguous() for t in (q, k, v, beta)]  # [B, H, T, ...]
    o, ht = fw_fla.chunk_delta_rule(*hf, initial_state=h0, output_final_state=True, head_first=True)
    assert o.shape == (2, 3, 12, 5) and torch.equal(o.transpose(1, 2), want) and torch.equal(ht, wht)
    # fused_recurrent's beta=None is beta = 1.
    o1, _ = fw_fla.fused_recurrent_delta_rule(q, k, v)
    assert torch.equal(o1, fastweight.delta_rule(q, k, v, torch.ones_like(beta))[0])


def test_fla_shim_errors():
    q, k, v, beta, _ = make(T=6, dtype=torch.float32)
    with pytest.raises(TypeError, match="unexpected keyword argument 'chunk_sise'"):
        fw_fla.chunk_delta_rule(q, k, v, beta, chunk_sise=64)
    with pytest.raises(ValueError, match="head-wise beta"):
        fw_fla.fused_recurrent_delta_rule(q, k, v, beta[..., None].expand(*beta.shape, 5))
    with pytest.raises(ValueError, match="head_first"):
        fw_fla.chunk_delta_rule(q, k, v, beta, cu_seqlens=torch.tensor([0, 6]), head_first=True)
    with pytest.raises(ValueError, match="chunk_size must be 16, 32, or 64"):
        fw_fla.chunk_delta_rule(q, k, v, beta, chunk_size=128)
    with pytest.raises(TypeError, match="unexpected keyword argument 'chunk_size'"):  # not FLA's there
        fw_fla.fused_recurrent_delta_rule(q, k, v, beta, chunk_size=64)


def test_against_fla_naive_torch():
    """FLA's own naive torch implementations (head-first [B, H, T, ...], float32), where fla is installed."""
    naive = pytest.importorskip("fla.ops.delta_rule.naive")
    q, k, v, beta, h0 = make(T=64, dtype=torch.float32)
    o, ht = fw_fla.chunk_delta_rule(q, k, v, beta, initial_state=h0, output_final_state=True)
    hf = [t.transpose(1, 2).contiguous() for t in (q, k, v, beta)]
    ro, rht = naive.delta_rule_recurrence(*hf, initial_state=h0.clone(), output_final_state=True)
    assert rel_err(o, ro.transpose(1, 2)) < 1e-4 and rel_err(ht, rht) < 1e-4
    co, cht = naive.delta_rule_chunkwise(*hf, chunk_size=32)  # no initial state
    o0, ht0 = fw_fla.chunk_delta_rule(q, k, v, beta, output_final_state=True)
    assert rel_err(o0, co.transpose(1, 2)) < 1e-4 and rel_err(ht0, cht) < 1e-4


# ---- errors -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("l2", [False, True])
def test_step_equals_the_sequence_and_in_place(l2):
    q, k, v, beta, h0 = make(T=5, dtype=torch.float32)
    o_seq, ht = fastweight.delta_rule(q, k, v, beta, initial_state=h0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=l2)
    st = h0.clone()
    outs = []
    for t in range(5):
        o, st = fastweight.delta_rule_step(q[:, t], k[:, t], v[:, t], beta[:, t], st, use_qk_l2norm_in_kernel=l2)
        outs.append(o)
    assert rel_err(torch.stack(outs, 1), o_seq) < 1e-6 and rel_err(st, ht) < 1e-6
    si = h0.clone()
    for t in range(5):
        o, s2 = fastweight.delta_rule_step(q[:, t], k[:, t], v[:, t], beta[:, t], si, use_qk_l2norm_in_kernel=l2,
                                           inplace=True)
        assert s2 is si and torch.equal(o, outs[t])
    assert torch.equal(si, st)
    with pytest.raises(ValueError, match=r"deltanet_step: state: expected shape"):
        fastweight.delta_rule_step(q[:, 0], k[:, 0], v[:, 0], beta[:, 0], h0[:, :, :-1])


def test_bad_input_names_the_argument():
    q, k, v, beta, h0 = make(T=8)
    with pytest.raises(ValueError, match=r"deltanet_fwd: beta: expected shape \(2, 8, 3\)"):
        fastweight.delta_rule(q, k, v, beta[:, :7])
    with pytest.raises(ValueError, match="deltanet_fwd: k: expected dtype float64"):
        fastweight.delta_rule(q, k.float(), v, beta)
    with pytest.raises(ValueError, match=r"initial_state: expected shape \(2, 3, 8, 5\)"):
        fastweight.delta_rule(q, k, v, beta, initial_state=h0[:1])
    with pytest.raises(ValueError, match="q: dtype int32 is not supported"):
        fastweight.delta_rule(q.int(), k, v, beta)
    with pytest.raises(ValueError, match="cu_seqlens: packed sequences need batch size B = 1"):
        fastweight.delta_rule(q, k, v, beta, cu_seqlens=torch.tensor([0, 8]))
    q1, k1, v1, b1 = q[:1], k[:1], v[:1], beta[:1]
    for cu, msg in (([1, 8], "starting at 0"), ([0, 5, 3, 8], "non-decreasing"), ([0, 7], "T = 8")):
        with pytest.raises(ValueError, match=f"cu_seqlens: .*{msg}"):
            fastweight.delta_rule(q1, k1, v1, b1, cu_seqlens=torch.tensor(cu))
    with pytest.raises(ValueError, match="cu_seqlens: expected dtype int32 or int64, got float32"):
        fastweight.delta_rule(q1, k1, v1, b1, cu_seqlens=torch.tensor([0.0, 8.0]))
    with pytest.raises(TypeError, match="cu_seqlens must be a torch.Tensor .* got list"):
        fastweight.delta_rule(q1, k1, v1, b1, cu_seqlens=[0, 8])
    with pytest.raises(ValueError, match="cu_seqlens: dtype int16 is not supported"):
        fastweight.delta_rule(q1, k1, v1, b1, cu_seqlens=torch.tensor([0, 8], dtype=torch.int16))
    with pytest.raises(ValueError, match=r"initial_state: expected shape \(3, 3, 8, 5\)"):
        fastweight.delta_rule(q1, k1, v1, b1, initial_state=h0, cu_seqlens=torch.tensor([0, 2, 2, 8]))
    with pytest.raises(ValueError, match="scale: expected a finite value"):
        fastweight.delta_rule(q, k, v, beta, scale=float("inf"))


def test_integer_dtypes_stay_rejected_by_the_float_ops():
    for dt in (torch.int32, torch.int64):
        x = torch.ones(4, 8, dtype=dt)
        with pytest.raises(ValueError, match=f"layernorm_fwd: x: dtype {str(dt)[6:]} is not supported"):
            fastweight.layer_norm(x)
        with pytest.raises(ValueError, match=f"rmsnorm_fwd: weight: expected dtype float32.*got {str(dt)[6:]}"):
            fastweight.rms_norm(x.float(), torch.ones(8, dtype=dt))


# ---- CUDA: forward, backward (autograd) and decoding step run the CUDA kernels ---------------------
def _fresh_seed() -> int:
    """Fresh inputs every run (DESIGN.md), printed in every assertion message to reproduce a failure."""
    return random.SystemRandom().randrange(2 ** 31)


def _cuda(*ts):
    return [None if t is None else t.cuda() for t in ts]


@gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T", [1, 63, 300])
@pytest.mark.parametrize("l2,states", [(False, False), (True, True)])
def test_cuda_forward_matches_reference_and_cpu(dtype, T, l2, states):
    seed = _fresh_seed()
    q, k, v, beta, h0 = make(B=2, T=T, H=3, K=64, V=96, dtype=dtype, seed=seed)
    h0 = h0 if states else None
    with torch.no_grad():
        o, ht = fastweight.delta_rule(*_cuda(q, k, v, beta), initial_state=_cuda(h0)[0], output_final_state=True,
                                      use_qk_l2norm_in_kernel=l2)
    assert o.is_cuda and o.dtype == dtype and o.shape == v.shape
    assert ht.is_cuda and ht.dtype == torch.float32 and ht.shape == (2, 3, 64, 96)
    ro, rht = ref_delta_rule(q, k, v, beta, h0=h0, l2=l2)
    co, cht = fastweight.delta_rule(q, k, v, beta, initial_state=h0, output_final_state=True,
                                    use_qk_l2norm_in_kernel=l2)  # the CPU path on the same inputs
    eo, eh, ec = rel_err(o, ro), rel_err(ht, rht), rel_err(o, co)
    msg = f"seed {seed}: o {eo:.2e}, final state {eh:.2e}, o vs the CPU path {ec:.2e}"
    assert eo < TOL[dtype] and ec < TOL[dtype], msg
    assert eh < 1e-5 and rel_err(ht, cht) < 1e-5, msg  # fp32 state from fp32 accumulation


@gpu
@requires_cuda
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
def test_cuda_varlen_matches_reference(cu_dtype):
    seed = _fresh_seed()
    offs = [0, 0, 70, 70, 200, 263, 263]  # empty sequences first, in the middle and last; chunk-crossing lengths
    cu = torch.tensor(offs, dtype=cu_dtype)
    q, k, v, beta, h0 = make(B=1, T=263, H=2, K=128, V=64, N=len(offs) - 1, dtype=torch.bfloat16, seed=seed)
    o, ht = fastweight.delta_rule(*_cuda(q, k, v, beta), initial_state=h0.cuda(), output_final_state=True,
                                  cu_seqlens=cu.cuda(), use_qk_l2norm_in_kernel=True)
    ro, rht = ref_delta_rule(q, k, v, beta, h0=h0, l2=True, cu_seqlens=cu)
    eo, eh = rel_err(o, ro), rel_err(ht, rht)
    assert eo < TOL[torch.bfloat16] and eh < 1e-5, f"seed {seed}: o {eo:.2e}, final state {eh:.2e}"
    for n in (0, 2, 5):  # empty sequences: the final state is the initial state
        assert torch.equal(ht[n].cpu(), h0[n])
    # FLA's name goes the same way, with FLA's operand precision (split_operands=False) unless asked
    fo, fht = fw_fla.chunk_delta_rule(*_cuda(q, k, v, beta), initial_state=h0.cuda(), output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu.cuda(), split_operands=True)
    assert torch.equal(fo, o) and torch.equal(fht, ht)
    o1, ht1 = fastweight.delta_rule(*_cuda(q, k, v, beta), initial_state=h0.cuda(), output_final_state=True,
                                    cu_seqlens=cu.cuda(), use_qk_l2norm_in_kernel=True, split_operands=False)
    fo, fht = fw_fla.chunk_delta_rule(*_cuda(q, k, v, beta), initial_state=h0.cuda(), output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu.cuda())
    assert torch.equal(fo, o1) and torch.equal(fht, ht1)
    eo1 = rel_err(o1, ro)
    assert eo1 < TOL[torch.bfloat16] and not torch.equal(o1, o), f"seed {seed}: bf16 operands o {eo1:.2e}"


@gpu
@requires_cuda
def test_cuda_bad_offsets_are_refused_before_any_launch():
    # device offsets are checked on the host in eager mode, with the CPU path's messages
    q, k, v, beta, _ = _cuda(*make(B=1, T=8, H=2, K=4, V=3, dtype=torch.float32, seed=_fresh_seed()))
    for cu, msg in (([1, 8], "starting at 0"), ([0, 5, 3, 8], "non-decreasing"), ([0, 7], "T = 8"),
                    ([0, 9], "T = 8"), ([0, -2, 8], "non-decreasing")):
        for dt in (torch.int32, torch.int64):
            with pytest.raises(ValueError, match=f"cu_seqlens: .*{msg}"):
                fastweight.delta_rule(q, k, v, beta, cu_seqlens=torch.tensor(cu, dtype=dt, device="cuda"))
    o, _ = fastweight.delta_rule(q, k, v, beta, cu_seqlens=torch.tensor([0, 3, 8], device="cuda"))  # valid: runs
    torch.cuda.synchronize()
    assert torch.isfinite(o).all()
    # a tensor found valid is not checked again (no synchronisation) until it changes in place: a
    # write to it, or to a view of it, is caught on the next call
    cu = torch.tensor([0, 3, 8], device="cuda")
    fastweight.delta_rule(q, k, v, beta, cu_seqlens=cu)
    cu[1] = 9
    with pytest.raises(ValueError, match="cu_seqlens: .*non-decreasing"):
        fastweight.delta_rule(q, k, v, beta, cu_seqlens=cu)
    cu[1] = 3
    fastweight.delta_rule(q, k, v, beta, cu_seqlens=cu)
    cu[:2].fill_(1)
    with pytest.raises(ValueError, match="cu_seqlens: .*starting at 0"):
        fastweight.delta_rule(q, k, v, beta, cu_seqlens=cu)
    # valid for T = 8 is not valid for another T
    cu = torch.tensor([0, 3, 8], device="cuda")
    fastweight.delta_rule(q, k, v, beta, cu_seqlens=cu)
    q2, k2, v2, beta2, _ = _cuda(*make(B=1, T=9, H=2, K=4, V=3, dtype=torch.float32, seed=_fresh_seed()))
    with pytest.raises(ValueError, match="cu_seqlens: .*T = 9"):
        fastweight.delta_rule(q2, k2, v2, beta2, cu_seqlens=cu)


def test_valid_offsets_cache_follows_identity_version_and_length():
    # the cache behind the check above (no GPU needed): identity, version counter and T all count
    from fastweight import deltanet_ops as dops
    dops._VALID_OFFSETS.clear()
    a, b = torch.tensor([0, 3, 8]), torch.tensor([0, 3, 8])
    assert not dops._offsets_known_valid(a, 8)
    dops._remember_valid_offsets(a, 8)
    assert dops._offsets_known_valid(a, 8)
    assert not dops._offsets_known_valid(b, 8)  # equal values, another tensor
    assert not dops._offsets_known_valid(a, 9)
    a[1] = 4  # in place: the version counter moves
    assert not dops._offsets_known_valid(a, 8)
    dops._remember_valid_offsets(a, 8)
    a[1:].add_(0)  # through a view: the shared version counter moves too
    assert not dops._offsets_known_valid(a, 8)
    with torch.inference_mode():
        c = torch.tensor([0, 8])
    dops._remember_valid_offsets(c, 8)  # no version counter: never cached
    assert not dops._offsets_known_valid(c, 8)
    for _ in range(20):  # bounded, and dead tensors drop out
        dops._remember_valid_offsets(torch.tensor([0, 8]), 8)
    assert len(dops._VALID_OFFSETS) <= dops._VALID_OFFSETS_KEEP
    dops._VALID_OFFSETS.clear()


@gpu
@requires_cuda
def test_cuda_strided_inputs_and_sequence_split():
    seed = _fresh_seed()
    dt = torch.bfloat16
    q, k, v, beta, h0 = make(B=2, T=150, H=4, K=64, V=32, dtype=dt, seed=seed)
    # q: a head-first (B, H, T, K) buffer seen as (B, T, H, K): every stride but the last is non-standard
    qs = q.transpose(1, 2).contiguous().cuda().transpose(1, 2)
    # k, v, beta (float32 beside bfloat16 q): rows cut from wider buffers, starting inside them
    wide_k = torch.zeros(2, 150, 4, 80, dtype=dt, device="cuda")
    wide_k[..., :64] = k.cuda()
    ks = wide_k[..., :64]
    wide_v = torch.zeros(2, 150, 4, 40, dtype=dt, device="cuda")
    wide_v[..., 3:35] = v.cuda()
    vs = wide_v[..., 3:35]
    wide_b = torch.zeros(2, 150, 7, device="cuda")
    wide_b[..., 1:5] = beta.float().cuda()
    bs = wide_b[..., 1:5]
    assert not qs.is_contiguous() and qs.stride(-1) == 1 and ks.stride(-2) == 80 and vs.stride(-2) == 40
    assert bs.stride() == (1050, 7, 1) and bs.storage_offset() == 1
    o, ht = fastweight.delta_rule(qs, ks, vs, bs, initial_state=h0.cuda(), output_final_state=True)
    ro, rht = ref_delta_rule(q, k, v, beta.float(), h0=h0)
    eo, eh = rel_err(o, ro), rel_err(ht, rht)
    assert eo < TOL[dt] and eh < 1e-5, f"seed {seed}: o {eo:.2e}, final state {eh:.2e}"
    # the same numbers as contiguous inputs (strides change addresses only), and as a last-dim-strided q
    # (which the functional API copies)
    oc, htc = fastweight.delta_rule(*_cuda(q, k, v, beta.float()), initial_state=h0.cuda(), output_final_state=True)
    assert torch.equal(o, oc) and torch.equal(ht, htc)
    big = torch.zeros(2, 150, 4, 128, dtype=dt, device="cuda")
    big[..., ::2] = q.cuda()
    o2, _ = fastweight.delta_rule(big[..., ::2], ks, vs, bs, initial_state=h0.cuda())
    assert torch.equal(o2, o)
    # two calls joined through the state == one call (context parallelism's stitching)
    o1, s1 = fastweight.delta_rule(qs[:, :100], ks[:, :100], vs[:, :100], bs[:, :100], initial_state=h0.cuda(),
                                   output_final_state=True)
    o2, s2 = fastweight.delta_rule(qs[:, 100:], ks[:, 100:], vs[:, 100:], bs[:, 100:], initial_state=s1,
                                   output_final_state=True)
    assert rel_err(torch.cat([o1, o2], 1), o) < TOL[dt] and rel_err(s2, ht) < 1e-5, f"seed {seed}"


@gpu
@requires_cuda
def test_cuda_forward_deterministic_graph_capture_and_compile():
    q, k, v, beta, h0 = _cuda(*make(B=2, T=200, H=2, K=64, V=64, dtype=torch.float32, seed=_fresh_seed()))

    def fn(q, k, v, beta, h0):
        return fastweight.delta_rule(q, k, v, beta, initial_state=h0, output_final_state=True,
                                     use_qk_l2norm_in_kernel=True)
    o1, ht1 = fn(q, k, v, beta, h0)
    o2, ht2 = fn(q, k, v, beta, h0)
    assert torch.equal(o1, o2) and torch.equal(ht1, ht2)  # bit-identical
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        og, htg = fn(q, k, v, beta, h0)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(og, o1) and torch.equal(htg, ht1)
    with torch.no_grad():
        oc, htc = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v, beta, h0)
    assert torch.equal(oc, o1) and torch.equal(htc, ht1)


@gpu
@requires_cuda
@pytest.mark.parametrize("cu", [None, [0, 90, 90, 300]])
def test_cuda_backward_graph_capture(cu):
    """Forward + autograd backward captured in one CUDA graph and replayed give the eager call's bits
    (bf16 operands, L2 norm): the backward forks its recompute onto a side stream, which must join the
    capture (bench_deltanet.py --graph times the kernels this way). Varlen: the offsets, checked once
    eagerly, are trusted while capturing."""
    N = 1 if cu is None else len(cu) - 1
    q, k, v, beta, h0 = _cuda(*make(B=1, T=300, H=2, K=64, V=64, dtype=torch.bfloat16, N=N, seed=_fresh_seed()))
    cus = None if cu is None else torch.tensor(cu, dtype=torch.int32, device="cuda")
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, beta, h0)]
    g = torch.Generator(device="cuda").manual_seed(7)
    do = torch.randn(q.shape, generator=g, device="cuda").to(torch.bfloat16)
    dht = torch.randn(h0.shape, generator=g, device="cuda")

    # The captured call's leaves are fresh ones, first used on the warm-up stream: a leaf's accumulate
    # node takes the stream of its first use, and one on the default stream (the eager call's) joined to
    # the capture invalidates it (cudaErrorStreamCaptureImplicit), with .backward or autograd.grad alike
    def run(leaves):
        o, ht = fastweight.delta_rule(*leaves[:4], initial_state=leaves[4], output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, cu_seqlens=cus, split_operands=False)
        grads = torch.autograd.grad([o, ht], leaves, [do, dht])
        return o, ht, grads
    o_e, ht_e, grads_e = run(leaves)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        leaves_g = [t.detach().clone().requires_grad_() for t in leaves]
        for _ in range(2):
            run(leaves_g)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, ht_g, grads_g = run(leaves_g)
    for t in (o_g, ht_g, *grads_g):  # poison what the replay must rewrite
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o_g, o_e) and torch.equal(ht_g, ht_e)
    for name, gg, ge in zip(GRAD_NAMES, grads_g, grads_e):
        assert torch.equal(gg, ge), f"d{name} differs in the graph's replay"


# Bounds of the CUDA backward and step against the float64 CPU path on the same (rounded) inputs:
# fp32 accumulation and states; bf16 gradients are rounded to bf16 on the way out.
CUDA_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
GRAD_NAMES = ["q", "k", "v", "beta", "initial_state"]


def _cuda_vs_cpu_f64_autograd(seed, dtype, q, k, v, beta, h0, l2, cu=None, scale=None, split=True):
    """delta_rule forward + autograd on CUDA vs the CPU float64 path (fastweight's reference through the C++
    API) on the same inputs and the same upstream gradients (do, dht rounded to o's and the state's dtype, as
    the CUDA backward receives them). Asserts the bounds on o, the final state and every gradient."""
    tol = CUDA_TOL[dtype]
    dev = [t.detach().cuda().requires_grad_() for t in (q, k, v, beta)]
    dh0 = h0.detach().cuda().requires_grad_() if h0 is not None else None
    kw = dict(scale=scale, output_final_state=True, use_qk_l2norm_in_kernel=l2)
    o, ht = fastweight.delta_rule(*dev, initial_state=dh0, cu_seqlens=_cuda(cu)[0], split_operands=split, **kw)
    assert o.is_cuda and o.dtype == dtype and ht.dtype == torch.float32
    g = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(o.shape, generator=g, dtype=torch.float64).to(dtype).double()
    dht = torch.randn(ht.shape, generator=g, dtype=torch.float64).float().double()
    inputs = dev + ([dh0] if dh0 is not None else [])
    got = torch.autograd.grad((o.double() * do.cuda()).sum() + (ht.double() * dht.cuda()).sum(), inputs)
    # the CPU float64 path on the same (rounded) inputs
    ref = [t.detach().double().requires_grad_() for t in (q, k, v, beta)]
    rh0 = h0.detach().double().requires_grad_() if h0 is not None else None
    ro, rht = fastweight.delta_rule(*ref, initial_state=rh0, cu_seqlens=cu, **kw)
    want = torch.autograd.grad((ro * do).sum() + (rht * dht).sum(), ref + ([rh0] if rh0 is not None else []))
    errs = {"o": rel_err(o, ro), "final_state": rel_err(ht, rht)}
    for name, a, b, t in zip(GRAD_NAMES, got, want, inputs):
        assert a.is_cuda and a.dtype == t.dtype and a.shape == t.shape, name
        errs["d" + name] = rel_err(a, b)
    msg = f"seed {seed}, {dtype}: " + ", ".join(f"{n} {e:.2e}" for n, e in errs.items())
    assert len(errs) == 2 + len(inputs), msg  # every gradient checked
    assert all(e <= tol for e in errs.values()), msg


@gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,K,V,l2,states", [
    (1, 100, 100, True, True),      # one position
    (63, 100, 100, False, True),    # one chunk's tail
    (1000, 100, 100, True, True),   # many chunks, odd K = V
    (200, 64, 128, False, True),    # K != V
    (130, 64, 128, True, False),    # no initial state (no dinitial_state)
])
def test_cuda_autograd_matches_cpu_float64(dtype, T, K, V, l2, states):
    seed = _fresh_seed()
    q, k, v, beta, h0 = make(B=2, T=T, H=2, K=K, V=V, dtype=dtype, seed=seed)
    _cuda_vs_cpu_f64_autograd(seed, dtype, q, k, v, beta, h0 if states else None, l2)


@gpu
@requires_cuda
@pytest.mark.parametrize("dtype,cu_dtype", [(torch.float32, torch.int32), (torch.bfloat16, torch.int64)])
def test_cuda_autograd_varlen_matches_cpu_float64(dtype, cu_dtype):
    seed = _fresh_seed()
    offs = [0, 0, 70, 70, 200, 263]  # empty sequences first and in the middle; chunk-crossing lengths
    cu = torch.tensor(offs, dtype=cu_dtype)
    q, k, v, beta, h0 = make(B=1, T=263, H=2, K=64, V=128, N=len(offs) - 1, dtype=dtype, seed=seed)
    _cuda_vs_cpu_f64_autograd(seed, dtype, q, k, v, beta, h0, True, cu=cu, scale=0.3)


@gpu
@requires_cuda
@pytest.mark.parametrize("T,K,V,cu", [(1000, 100, 100, None), (200, 64, 128, None), (263, 64, 128, [0, 0, 70, 70, 200, 263])])
def test_cuda_bf16_operands_match_cpu_float64(T, K, V, cu):
    """split_operands=False (bf16-only tensor-core operands) stays within the bf16 bounds, forward and
    every gradient, through the eager path and the custom op alike."""
    seed = _fresh_seed()
    N = None if cu is None else len(cu) - 1
    q, k, v, beta, h0 = make(B=1 if cu else 2, T=T, H=2, K=K, V=V, N=N, dtype=torch.bfloat16, seed=seed)
    cu = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    _cuda_vs_cpu_f64_autograd(seed, torch.bfloat16, q, k, v, beta, h0, True, cu=cu, split=False)
    qc, kc, vc, bc = _cuda(q, k, v, beta)
    a, _ = fastweight.delta_rule(qc, kc, vc, bc, split_operands=False, use_qk_l2norm_in_kernel=True, cu_seqlens=_cuda(cu)[0])
    b, _, _ = torch.ops.fastweight.deltanet_fwd(qc, kc, vc, bc, None, _cuda(cu)[0], None, True, False, False, False)
    assert torch.equal(a, b)


@gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_backward_deterministic_and_graph_capture(dtype):
    # bf16: the tensor-core backward, whose recompute runs on a second stream beside the state pass at
    # this size (forked and joined by events inside the call: captured as graph edges)
    q, k, v, beta, h0 = _cuda(*make(B=2, T=150, H=2, K=64, V=64, dtype=dtype, seed=_fresh_seed()))
    do, dht = torch.randn_like(v), torch.randn_like(h0)
    bwd = torch.ops.fastweight.deltanet_bwd

    same_bits_twice_and_in_a_graph(lambda: bwd(do, q, k, v, beta, h0, None, dht, None, True, True, None))


@gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K,V", [(100, 72), (128, 128)])
@pytest.mark.parametrize("l2", [False, True])
def test_cuda_step_matches_cpu_float64_and_in_place(dtype, K, V, l2):
    seed = _fresh_seed()
    q, k, v, beta, h0 = make(B=2, T=3, H=3, K=K, V=V, dtype=dtype, seed=seed)
    tol = 1e-5 if dtype == torch.float32 else CUDA_TOL[dtype]
    st = h0.cuda()
    si = h0.cuda()  # updated in place
    rst = h0.double()
    for t in range(3):  # a few steps, the state carried from one to the next
        args = (q[:, t], k[:, t], v[:, t], beta[:, t])
        o, st = fastweight.delta_rule_step(*_cuda(*args), st, use_qk_l2norm_in_kernel=l2)
        oi, s2 = fastweight.delta_rule_step(*_cuda(*args), si, use_qk_l2norm_in_kernel=l2, inplace=True)
        ro, rst = fastweight.delta_rule_step(*(a.double() for a in args), rst, use_qk_l2norm_in_kernel=l2)
        assert o.is_cuda and o.dtype == dtype and o.shape == (2, 3, V) and st.dtype == torch.float32
        assert s2 is si
        errs = [rel_err(o, ro), rel_err(st, rst), rel_err(oi, ro), rel_err(si, rst)]
        msg = f"seed {seed}, step {t}: o, new_state, in place o, in place state: " + ", ".join(f"{e:.2e}" for e in errs)
        assert all(e <= tol for e in errs), msg


@gpu
@requires_cuda
def test_cuda_errors_name_the_argument():
    q, k, v, beta, h0 = _cuda(*make(B=1, T=8, H=2, K=300, V=4, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"deltanet_fwd: q: head dim K = 300 is not supported by the CUDA forward"):
        fastweight.delta_rule(q, k, v, beta)
    q, k, v, beta, h0 = _cuda(*make(B=1, T=8, H=2, K=8, V=4, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"deltanet_fwd: cu_seqlens: expected device cuda:\d"):
        fastweight.delta_rule(q, k, v, beta, cu_seqlens=torch.tensor([0, 8]))  # offsets must be on q's device
    with pytest.raises(ValueError, match=r"deltanet_fwd: cu_seqlens: holds no sequence .* T = 8"):
        fastweight.delta_rule(q, k, v, beta, cu_seqlens=torch.tensor([0], device="cuda"))  # checked by shape alone
    with pytest.raises(ValueError, match="deltanet_fwd: q: dtype float64 is not supported on cuda"):
        fastweight.delta_rule(q.double(), k.double(), v.double(), beta.double())
    # the backward's CUDA path needs its workspace: refused (naming it) before anything is written
    do, dq = torch.randn_like(v), torch.full_like(q, float("nan"))
    with pytest.raises(ValueError, match="deltanet_bwd: .*workspace"):
        fastweight._C.deltanet_bwd(q, k, v, beta, do_=do, dq=dq)
    assert torch.isnan(dq).all()


def test_wy_inverse_exists_only_in_the_cuda_pipeline():
    """The forward's WY inverse (kept for the backward) is refused, naming it, where the tensor-core
    pipeline does not run: CPU tensors here (the CUDA-side checks: test_deltanet_api.cpp)."""
    q, k, v, beta, h0 = make(T=8)
    o, wy = torch.full_like(v, float("nan")), torch.empty(2, 8, 3, 64)
    with pytest.raises(ValueError, match="deltanet_fwd: wy_inverse: exists only in the CUDA tensor-core pipeline"):
        fastweight._C.deltanet_fwd(q, k, v, beta, o=o, wy_inverse=wy)
    assert torch.isnan(o).all()
    with pytest.raises(ValueError, match="deltanet_bwd: wy_inverse: exists only in the CUDA tensor-core pipeline"):
        fastweight._C.deltanet_bwd(q, k, v, beta, do_=torch.randn_like(v), wy_inverse=wy)


@gpu
@requires_cuda
@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("cu", [None, [0, 70, 70, 150]])
def test_cuda_saved_wy_inverse_gives_the_same_bits(split, cu):
    """Where the tensor-core pipeline runs, the forward keeps its WY inverse for the backward (FLA's A),
    which then reads it instead of forming it again: the same gradient bits either way, the same o
    whether or not the forward writes it, and the autograd paths (eager Function, custom op) keep it."""
    from fastweight import deltanet_ops as dn
    from fastweight.ops import _prep_gate
    seed = _fresh_seed()
    N = None if cu is None else len(cu) - 1
    q, k, v, beta, h0 = _cuda(*make(B=1 if cu else 2, T=150, H=2, K=64, V=64, N=N, dtype=torch.bfloat16, seed=seed))
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device="cuda")
    b = _prep_gate(beta, q)
    o1, ht1, wy = dn._deltanet_fwd_run(q, k, v, b, h0, cu_t, None, True, True, split, True)
    o2, ht2, none = dn._deltanet_fwd_run(q, k, v, b, h0, cu_t, None, True, True, split, False)
    assert none is None and wy is not None
    assert wy.shape == (*q.shape[:3], 64) and wy.dtype == (torch.float32 if split else torch.bfloat16)
    assert torch.isfinite(wy).all()
    assert torch.equal(o1, o2) and torch.equal(ht1, ht2)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    do = torch.randn(v.shape, generator=gen, device="cuda").to(v.dtype)
    dht = torch.randn(h0.shape, generator=gen, device="cuda")
    g_saved = dn._deltanet_bwd_run(do, q, k, v, b, h0, cu_t, dht, None, True, split, wy)
    g_again = dn._deltanet_bwd_run(do, q, k, v, b, h0, cu_t, dht, None, True, split, None)
    for x, y in zip(g_saved, g_again):
        assert torch.equal(x, y)
    # through autograd: the eager Function and the custom op (save_wy) give the saved-WY gradients
    for custom in (False, True):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, beta, h0)]
        if custom:
            o, ht, _ = torch.ops.fastweight.deltanet_fwd(*leaves[:3], _prep_gate(leaves[3], leaves[0]), leaves[4],
                                                         cu_t, None, True, True, split, True)
        else:
            o, ht = fastweight.delta_rule(*leaves[:4], initial_state=leaves[4], output_final_state=True,
                                          use_qk_l2norm_in_kernel=True, cu_seqlens=cu_t, split_operands=split)
        torch.autograd.backward([o, ht], [do, dht])
        for leaf, want in zip(leaves, (g_saved[0], g_saved[1], g_saved[2], None, g_saved[4])):
            if want is not None:
                assert torch.equal(leaf.grad, want)


def _fla_delta_rule_module():
    """FLA's fla.ops.delta_rule (its Triton kernels), or a skip where FLA is not installed; loaded by
    the benchmarks' import_fla (bench/bench_common.py), which copes with fla/__init__'s model imports."""
    import importlib.util
    import sys
    from pathlib import Path
    if importlib.util.find_spec("fla") is None:
        pytest.skip("flash-linear-attention is not installed")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from bench_common import import_fla
    return import_fla("fla.ops.delta_rule")


@gpu
@requires_cuda
@pytest.mark.parametrize("varlen", [False, True])
def test_cuda_shims_match_fla_kernels(varlen):
    """The drop-in shim against FLA itself on the GPU: fastweight.compat.fla.chunk_delta_rule and FLA's
    chunk_delta_rule called the same way (bf16, L2 norm in the kernel, initial and final state, varlen) give the same o, final state and gradients of q, k, v, beta and the initial state, to
    within both kernels' bf16 errors; both are also checked against the float64 loop form, so a call that
    FLA reads differently from the shim (scale, state layout, offsets) fails here."""
    fla = _fla_delta_rule_module()
    seed = _fresh_seed()
    cu = torch.tensor([0, 100, 300], dtype=torch.int64) if varlen else None
    q, k, v, beta, h0 = make(B=1 if varlen else 2, T=300, H=2, K=128, V=128, N=2 if varlen else None,
                             dtype=torch.bfloat16, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(q.shape[:3] + (128,), generator=g, dtype=torch.float64)
    dht = torch.randn(h0.shape, generator=g, dtype=torch.float64)

    def run(fn, dev):
        ins = [t.detach().to(dev).requires_grad_() for t in (q, k, v, beta, h0)]
        if dev == "cpu":  # the float64 loop form
            o, ht = ref_delta_rule(*ins[:4], h0=ins[4], l2=True, cu_seqlens=cu)
        else:
            o, ht = fn(*ins[:4], initial_state=ins[4], output_final_state=True, use_qk_l2norm_in_kernel=True,
                       cu_seqlens=None if cu is None else cu.cuda())
        loss = (o.double() * do.to(o.device)).sum() + (ht.double() * dht.to(o.device)).sum()
        return [o, ht] + list(torch.autograd.grad(loss, ins))

    names = ["o", "final_state", "dq", "dk", "dv", "dbeta", "dinitial_state"]
    ours, theirs, ref = run(fw_fla.chunk_delta_rule, "cuda"), run(fla.chunk_delta_rule, "cuda"), run(None, "cpu")
    errs = {n: (rel_err(a, r), rel_err(b, r), rel_err(a, b)) for n, a, b, r in zip(names, ours, theirs, ref)}
    msg = f"seed {seed}: " + ", ".join(f"{n} ours {e[0]:.1e} FLA {e[1]:.1e} apart {e[2]:.1e}" for n, e in errs.items())
    assert len(errs) == 7, msg
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype and a.shape == b.shape, msg
    assert all(e[0] <= 1e-2 for e in errs.values()), msg   # ours against the float64 loop form
    assert all(e[1] <= 3e-2 for e in errs.values()), msg   # FLA called as the shim is (its bf16 error)
    assert all(e[2] <= 3e-2 for e in errs.values()), msg   # the shim against FLA


# ---- torch.func ----------------------------------------------------------------------------------
def test_torch_func_grad_and_per_sample_grads():
    """torch.func.grad of delta_rule (q, k, v, beta, the initial state) and per-sample gradients (vmap of
    grad) against autograd (CPU, float64)."""
    gen = torch.Generator().manual_seed(4)
    B, T, H, K, V = 2, 12, 2, 8, 6
    q, k = (torch.randn(B, T, H, K, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    h0 = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)
    fn = lambda q, k, v, b, h: fastweight.delta_rule(q, k, v, b, initial_state=h, output_final_state=True,  # noqa: E731
                                                     use_qk_l2norm_in_kernel=True)[0].sin().sum()
    args = (q, k, v, beta, h0)
    ts = [a.clone().requires_grad_() for a in args]
    fn(*ts).backward()
    for got, t in zip(torch.func.grad(fn, argnums=(0, 1, 2, 3, 4))(*args), ts):
        assert rel_err(got, t.grad) < 1e-12
    per = torch.func.vmap(torch.func.grad(lambda *a: fn(*(t[None] for t in a))))(*args)
    want = []
    for b in range(B):
        qb = q[b:b + 1].clone().requires_grad_()
        fn(qb, k[b:b + 1], v[b:b + 1], beta[b:b + 1], h0[b:b + 1]).backward()
        want.append(qb.grad[0])
    assert rel_err(per, torch.stack(want)) < 1e-12
