// test_mlstm_api.cpp: the public mLSTM entry points (fastweight/mlstm.h) on the CPU: results equal
// the float64 reference for every IO dtype and for strided views (rows cut from larger buffers),
// every output element is written, the step works in place, the parallel form (seed 000) equals its
// reference, and every bad input gets an ArgumentError naming the op and the argument before
// anything is written.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "api/check.h"
#include "reference/mlstm_ref.h"
#include "test_util.h"

namespace fwtest {
namespace {
using fastweight::detail::MlstmShape;

struct Seq {  // one sequence call's tensors; pad > 0 makes every view a strided cut of a buffer
  MlstmShape sh;
  HostTensor q, k, v, i, f, c0, n0, m0, h, cl, nl, ml;
  Seq(DType dt, MlstmShape s, std::int64_t pad, DType gate_dt)
      : sh(s),
        q(make_host(dt, {s.B, s.NH, s.S, s.DQK}, pad)), k(make_host(dt, {s.B, s.NH, s.S, s.DQK}, pad)),
        v(make_host(dt, {s.B, s.NH, s.S, s.DV}, pad)), i(make_host(gate_dt, {s.B, s.NH, s.S}, pad)),
        f(make_host(gate_dt, {s.B, s.NH, s.S}, pad)), c0(make_host(DType::f32, {s.B, s.NH, s.DQK, s.DV}, pad)),
        n0(make_host(DType::f32, {s.B, s.NH, s.DQK}, pad)), m0(make_host(DType::f32, {s.B, s.NH, 1})),
        h(make_host(dt, {s.B, s.NH, s.S, s.DV}, pad)), cl(make_host(DType::f32, {s.B, s.NH, s.DQK, s.DV})),
        nl(make_host(DType::f32, {s.B, s.NH, s.DQK})), ml(make_host(DType::f32, {s.B, s.NH, 1})) {
    std::mt19937_64 rng(7);
    for (HostTensor* t : {&q, &k, &v, &c0, &n0}) fill_random(*t, rng, -1.0, 1.0);
    fill_random(i, rng, -3.0, 3.0);
    fill_random(f, rng, 0.0, 5.0);
    fill_random(m0, rng, -1.0, 1.0);
    for (HostTensor* t : {&h, &cl, &nl, &ml}) fill_bytes(*t, 0xab);
  }
  MlstmFwdArgs args(std::int64_t L = 16) {
    MlstmFwdArgs a;
    a.q = q.ref(), a.k = k.ref(), a.v = v.ref(), a.i = i.ref(), a.f = f.ref();
    a.c_initial = c0.ref(), a.n_initial = n0.ref(), a.m_initial = m0.ref();
    a.h = h.ref(), a.c_last = cl.ref(), a.n_last = nl.ref(), a.m_last = ml.ref();
    a.chunk_size = L;
    return a;
  }
  bool untouched() const {
    for (const HostTensor* t : {&h, &cl, &nl, &ml})
      for (unsigned char c : t->bytes) if (c != 0xab) return false;
    return true;
  }
};

// The reference on float64 copies of the (already rounded) inputs.
void reference_fwd(Seq& s, HostTensor& h, HostTensor& cl, HostTensor& nl, HostTensor& ml) {
  HostTensor q = to_f64(s.q), k = to_f64(s.k), v = to_f64(s.v), i = to_f64(s.i), f = to_f64(s.f);
  HostTensor c0 = to_f64(s.c0), n0 = to_f64(s.n0), m0 = to_f64(s.m0);
  h = make_host(DType::f64, s.h.shape), cl = make_host(DType::f64, s.cl.shape);
  nl = make_host(DType::f64, s.nl.shape), ml = make_host(DType::f64, s.ml.shape);
  auto p = [](HostTensor& t) { return static_cast<double*>(t.base()); };
  fastweight::detail::mlstm_recurrent_fwd(s.sh, {p(q), p(k), p(v), p(i), p(f)}, 1e-6, {p(c0), p(n0), p(m0)}, p(h),
                                          {p(cl), p(nl), p(ml)});
}

TEST(MlstmApi, ForwardMatchesReferenceAllDtypesStrided) {
  for (DType dt : {DType::f64, DType::f32, DType::bf16, DType::f16})
    for (std::int64_t pad : {0, 3}) {
      Seq s(dt, {2, 3, 37, 8, 5}, pad, pad ? DType::f32 : dt);
      mlstm_fwd(s.args());
      HostTensor h, cl, nl, ml;
      reference_fwd(s, h, cl, nl, ml);
      const double tol = dt == DType::f64 ? 1e-12 : tolerance(dt);
      SCOPED_TRACE(std::string(dtype_name(dt)) + (pad ? " strided" : " contiguous"));
      EXPECT_LT(rel_err(s.h, h), tol);
      EXPECT_LT(rel_err(s.cl, cl), dt == DType::f64 ? 1e-6 : 1e-5);  // fp32 states
      EXPECT_LT(rel_err(s.nl, nl), dt == DType::f64 ? 1e-6 : 1e-5);
      EXPECT_LT(rel_err(s.ml, ml), 1e-6);
    }
}

TEST(MlstmApi, BackwardMatchesReference) {
  Seq s(DType::f64, {1, 2, 21, 4, 6}, 2, DType::f64);
  HostTensor dh = make_host(DType::f64, s.h.shape, 1), dq = make_host(DType::f64, s.q.shape, 1),
             dk = make_host(DType::f64, s.k.shape), dv = make_host(DType::f64, s.v.shape),
             di = make_host(DType::f64, s.i.shape), df = make_host(DType::f64, s.f.shape),
             dc0 = make_host(DType::f32, s.c0.shape), dn0 = make_host(DType::f32, s.n0.shape),
             dm0 = make_host(DType::f32, {1, 2});
  std::mt19937_64 rng(3);
  fill_random(dh, rng);
  for (HostTensor* t : {&dq, &dk, &dv, &di, &df, &dc0, &dn0, &dm0}) fill_bytes(*t, 0xab);
  MlstmBwdArgs a;
  a.q = s.q.ref(), a.k = s.k.ref(), a.v = s.v.ref(), a.i = s.i.ref(), a.f = s.f.ref();
  a.c_initial = s.c0.ref(), a.n_initial = s.n0.ref(), a.m_initial = s.m0.ref(), a.dh = dh.ref();
  a.dq = dq.ref(), a.dk = dk.ref(), a.dv = dv.ref(), a.di = di.ref(), a.df = df.ref();
  a.dc_initial = dc0.ref(), a.dn_initial = dn0.ref(), a.dm_initial = dm0.ref();
  a.chunk_size = 16;
  mlstm_bwd(a);
  // Reference on contiguous copies.
  HostTensor q = to_f64(s.q), k = to_f64(s.k), v = to_f64(s.v), i = to_f64(s.i), f = to_f64(s.f);
  HostTensor c0 = to_f64(s.c0), n0 = to_f64(s.n0), m0 = to_f64(s.m0), dhc = to_f64(dh);
  HostTensor rq = make_host(DType::f64, q.shape), rk = make_host(DType::f64, k.shape), rv = make_host(DType::f64, v.shape),
             ri = make_host(DType::f64, i.shape), rf = make_host(DType::f64, f.shape),
             rc = make_host(DType::f64, c0.shape), rn = make_host(DType::f64, n0.shape), rm = make_host(DType::f64, {1, 2});
  auto p = [](HostTensor& t) { return static_cast<double*>(t.base()); };
  fastweight::detail::mlstm_recurrent_bwd(s.sh, {p(q), p(k), p(v), p(i), p(f)}, 1e-6, {p(c0), p(n0), p(m0)}, p(dhc),
                                          {}, {p(rq), p(rk), p(rv), p(ri), p(rf)}, {p(rc), p(rn), p(rm)});
  EXPECT_LT(rel_err(dq, rq), 1e-13);
  EXPECT_LT(rel_err(dk, rk), 1e-13);
  EXPECT_LT(rel_err(dv, rv), 1e-13);
  EXPECT_LT(rel_err(di, ri), 1e-13);
  EXPECT_LT(rel_err(df, rf), 1e-13);
  EXPECT_LT(rel_err(dc0, rc), 1e-6);  // stored as fp32
  EXPECT_LT(rel_err(dn0, rn), 1e-6);
  EXPECT_LT(rel_err(dm0, rm), 1e-6);
}

TEST(MlstmApi, StepInPlaceEqualsOutOfPlaceAndTheSequence) {
  const MlstmShape sh{2, 2, 1, 8, 4};
  Seq s(DType::f32, {2, 2, 1, 8, 4}, 0, DType::f32);
  // Step tensors: (B, NH, D) views of the single-step sequence.
  auto squeeze = [](HostTensor t) {  // drop the S = 1 axis (dim 2)
    t.shape.erase(t.shape.begin() + 2);
    t.strides.erase(t.strides.begin() + 2);
    return t;
  };
  HostTensor q = squeeze(s.q), k = squeeze(s.k), v = squeeze(s.v), i = squeeze(s.i), f = squeeze(s.f);
  HostTensor h1 = make_host(DType::f32, {2, 2, 4}), h2 = make_host(DType::f32, {2, 2, 4});
  HostTensor c = s.c0, n = s.n0, m = s.m0;  // copies
  HostTensor cn = make_host(DType::f32, c.shape), nn = make_host(DType::f32, n.shape), mn = make_host(DType::f32, m.shape);
  MlstmStepArgs a;
  a.q = q.ref(), a.k = k.ref(), a.v = v.ref(), a.i = i.ref(), a.f = f.ref();
  a.c = c.ref(), a.n = n.ref(), a.m = m.ref(), a.h = h1.ref(), a.c_new = cn.ref(), a.n_new = nn.ref(), a.m_new = mn.ref();
  mlstm_step(a);
  a.h = h2.ref(), a.c_new = c.ref(), a.n_new = n.ref(), a.m_new = m.ref();  // in place
  mlstm_step(a);
  EXPECT_EQ(rel_err(h1, h2), 0.0);
  EXPECT_EQ(rel_err(cn, c), 0.0);
  EXPECT_EQ(rel_err(nn, n), 0.0);
  EXPECT_EQ(rel_err(mn, m), 0.0);
  mlstm_fwd(s.args());  // the same step as a sequence of length 1
  EXPECT_LT(rel_err(h1, squeeze(s.h)), 1e-6);
  EXPECT_LT(rel_err(cn, s.cl), 1e-6);
  (void)sh;
}

TEST(MlstmApi, DecayMatrixMatchesReference) {
  HostTensor i = make_host(DType::f32, {2, 3, 9}, 1), f = make_host(DType::f32, {2, 3, 9}),
             D = make_host(DType::f32, {2, 3, 9, 9}), dD = make_host(DType::f32, {2, 3, 9, 9}),
             di = make_host(DType::f32, {2, 3, 9}), df = make_host(DType::f32, {2, 3, 9});
  std::mt19937_64 rng(5);
  for (HostTensor* t : {&i, &f, &dD}) fill_random(*t, rng);
  fill_bytes(D, 0xab);
  mlstm_decay_matrix_fwd({i.ref(), f.ref(), D.ref()});
  mlstm_decay_matrix_bwd({f.ref(), dD.ref(), di.ref(), df.ref()});
  HostTensor i64 = to_f64(i), f64 = to_f64(f), dD64 = to_f64(dD), rD = make_host(DType::f64, D.shape),
             rdi = make_host(DType::f64, di.shape), rdf = make_host(DType::f64, df.shape);
  const MlstmShape sh{2, 3, 9, 0, 0};
  auto p = [](HostTensor& t) { return static_cast<double*>(t.base()); };
  fastweight::detail::mlstm_decay_matrix_fwd(sh, p(i64), p(f64), p(rD));
  fastweight::detail::mlstm_decay_matrix_bwd(sh, p(f64), p(dD64), p(rdi), p(rdf));
  // -inf above the diagonal in both: compare the finite parts and the -inf pattern.
  const auto got = D.values(), want = rD.values();
  for (std::size_t e = 0; e < got.size(); ++e) {
    if (std::isinf(want[e])) EXPECT_TRUE(std::isinf(got[e]) && got[e] < 0) << e;
    else EXPECT_NEAR(got[e], want[e], 1e-5 * (1 + std::fabs(want[e]))) << e;
  }
  EXPECT_LT(rel_err(di, rdi), 1e-6);
  EXPECT_LT(rel_err(df, rdf), 1e-6);
}

// ---- bad input ------------------------------------------------------------------------------------
template <typename F>
void expect_rejected(const Seq& s, F&& f, std::initializer_list<const char*> fragments) {
  expect_argument_error(f, fragments);
  EXPECT_TRUE(s.untouched()) << "an output was written before the error";
}

TEST(MlstmApi, RejectsBadInputBeforeWriting) {
  Seq s(DType::f32, {1, 2, 8, 4, 4}, 0, DType::f32);
  HostTensor k_bad = make_host(DType::f32, {1, 2, 8, 5}), v_f16 = make_host(DType::f16, {1, 2, 8, 4}),
             i_bad = make_host(DType::f32, {1, 2, 7}), c_bad = make_host(DType::f32, {1, 2, 4, 5}),
             n_f16 = make_host(DType::f16, {1, 2, 4}), h_bad = make_host(DType::f32, {1, 2, 8, 3}),
             q_nc = make_host(DType::f32, {1, 2, 8, 4});
  q_nc.strides[3] = 2;  // last dim not contiguous (the buffer is large enough: only validation looks)
  q_nc.bytes.resize(q_nc.bytes.size() * 2);
  auto run = [&](auto mutate) { auto a = s.args(); mutate(a); mlstm_fwd(a); };
  expect_rejected(s, [&] { run([&](MlstmFwdArgs& a) { a.k = k_bad.ref(); }); }, {"mlstm_fwd", "k", "(1, 2, 8, 4)", "(1, 2, 8, 5)"});
  expect_rejected(s, [&] { run([&](MlstmFwdArgs& a) { a.v = v_f16.ref(); }); }, {"mlstm_fwd", "v", "float16"});
  expect_rejected(s, [&] { run([&](MlstmFwdArgs& a) { a.i = i_bad.ref(); }); }, {"mlstm_fwd", "i", "(1, 2, 8)"});
  expect_rejected(s, [&] { run([&](MlstmFwdArgs& a) { a.c_initial = c_bad.ref(); }); }, {"c_initial", "(1, 2, 4, 4)"});
  expect_rejected(s, [&] { run([&](MlstmFwdArgs& a) { a.n_initial = n_f16.ref(); }); }, {"n_initial", "float32"});
  expect_rejected(s, [&] { run([&](MlstmFwdArgs& a) { a.m_initial = TensorRef{}; }); }, {"m_initial", "together"});
  expect_rejected(s, [&] { run([&](MlstmFwdArgs& a) { a.h = h_bad.ref(); }); }, {"mlstm_fwd", "h", "(1, 2, 8, 4)"});
  expect_rejected(s, [&] { run([&](MlstmFwdArgs& a) { a.q = q_nc.ref(); }); }, {"mlstm_fwd", "q", "contiguous"});
  expect_rejected(s, [&] { run([&](MlstmFwdArgs& a) { a.chunk_size = 48; }); }, {"mlstm_fwd", "chunk_size", "48"});
  expect_rejected(s, [&] { run([&](MlstmFwdArgs& a) { a.eps = -1.0; }); }, {"mlstm_fwd", "eps"});
  expect_rejected(s, [&] { run([&](MlstmFwdArgs& a) { a.v = TensorRef{}; }); }, {"mlstm_fwd", "v", "required"});
  expect_rejected(s, [&] {
    run([&](MlstmFwdArgs& a) { a.k.data = static_cast<char*>(a.k.data) + 1; });
  }, {"mlstm_fwd", "k", "misaligned"});
  expect_rejected(s, [&] {
    run([&](MlstmFwdArgs& a) { a.k.device = DeviceType::cuda; });
  }, {"mlstm_fwd", "k", "device"});
}

// Outputs that share memory with an input (or each other) other than as the very same view: refused
// before anything is written, where a CUDA kernel would race. A step's new state may be its state itself,
// and states interleaved in one packed per-head buffer (ranges that interleave) are not refused.
TEST(MlstmApi, OverlappingOutputsAreRefusedBeforeWriting) {
  Seq s(DType::f32, {1, 2, 8, 4, 4}, 0, DType::f32);
  auto run = [&](auto mutate) { auto a = s.args(); mutate(a); mlstm_fwd(a); };
  auto shifted = [](TensorRef t, std::int64_t elems) {  // the same view moved by `elems` elements
    t.data = static_cast<float*>(t.data) + elems;
    return t;
  };
  // h over q (both (1, 2, 8, 4) float32), c_last as c_initial itself, c_last half over c_initial, h = k
  expect_rejected(s, [&] {
    run([&](MlstmFwdArgs& a) { a.q = a.h; });
  }, {"mlstm_fwd", "h", "shares memory with q", "may not overlap an input"});
  HostTensor cbuf = make_host(DType::f32, {2, 1, 2, 4, 4});  // room for a shifted (1, 2, 4, 4) view
  std::mt19937_64 rng(9);
  fill_random(cbuf, rng, -1.0, 1.0);
  TensorRef c_in = cbuf.ref();
  c_in.ndim = 4;
  for (int d = 0; d < 4; ++d) c_in.shape[d] = c_in.shape[d + 1], c_in.strides[d] = c_in.strides[d + 1];
  expect_rejected(s, [&] {
    run([&](MlstmFwdArgs& a) { a.c_initial = c_in, a.c_last = c_in; });
  }, {"mlstm_fwd", "c_last", "shares memory with c_initial"});
  expect_rejected(s, [&] {
    run([&](MlstmFwdArgs& a) { a.c_initial = c_in, a.c_last = shifted(c_in, 4); });
  }, {"mlstm_fwd", "c_last", "shares memory with c_initial"});
  expect_rejected(s, [&] {
    run([&](MlstmFwdArgs& a) {  // n_last (1, 2, 4) on the first 8 floats of c_last
      a.n_last = a.c_last, a.n_last.ndim = 3, a.n_last.strides[0] = 8, a.n_last.strides[1] = 4, a.n_last.strides[2] = 1;
    });
  }, {"mlstm_fwd", "c_last", "shares memory with n_last", "each other"});

  // the step: c_new = c in place runs; c_new one row past c, or h over v, is refused (nothing written)
  const std::int64_t B = 1, NH = 2, DQK = 4, DV = 4;
  HostTensor q = make_host(DType::f32, {B, NH, DQK}), k = make_host(DType::f32, {B, NH, DQK}),
             v = make_host(DType::f32, {B, NH, DV}), i = make_host(DType::f32, {B, NH}), f = make_host(DType::f32, {B, NH}),
             h = make_host(DType::f32, {B, NH, DV}), n = make_host(DType::f32, {B, NH, DQK}), m = make_host(DType::f32, {B, NH, 1});
  for (HostTensor* t : {&q, &k, &v, &i, &f, &n, &m}) fill_random(*t, rng, -1.0, 1.0);
  fill_random(cbuf, rng, -1.0, 1.0);
  fill_bytes(h, 0xab);
  const std::vector<unsigned char> before = cbuf.bytes, n_before = n.bytes;
  MlstmStepArgs a;
  a.q = q.ref(), a.k = k.ref(), a.v = v.ref(), a.i = i.ref(), a.f = f.ref(), a.h = h.ref();
  a.c = c_in, a.n = n.ref(), a.m = m.ref(), a.c_new = shifted(c_in, DV), a.n_new = a.n, a.m_new = a.m;
  expect_argument_error([&] { mlstm_step(a); }, {"mlstm_step", "c_new", "shares memory with c", "same view"});
  a.c_new = c_in, a.h = a.v;
  expect_argument_error([&] { mlstm_step(a); }, {"mlstm_step", "h", "shares memory with v"});
  EXPECT_EQ(cbuf.bytes, before);
  EXPECT_EQ(n.bytes, n_before);
  for (unsigned char c : h.bytes) ASSERT_EQ(c, 0xab);
  a.h = h.ref();
  mlstm_step(a);  // in place
  EXPECT_NE(cbuf.bytes, before);

  // a packed per-head state buffer: c (DQK x DV) then n (DQK) then m (1) per head, updated in place:
  // the views' ranges interleave, nothing overlaps, and the step runs
  const std::int64_t X = DQK * DV + DQK + 1;
  HostTensor packed = make_host(DType::f32, {B * NH * X});
  fill_random(packed, rng, -1.0, 1.0);
  auto view = [&](std::int64_t off, std::vector<std::int64_t> shape, std::vector<std::int64_t> strides) {
    TensorRef t = packed.ref();
    t.data = static_cast<float*>(t.data) + off;
    t.ndim = int(shape.size());
    for (int d = 0; d < t.ndim; ++d) t.shape[d] = shape[std::size_t(d)], t.strides[d] = strides[std::size_t(d)];
    return t;
  };
  a.c = a.c_new = view(0, {B, NH, DQK, DV}, {NH * X, X, DV, 1});
  a.n = a.n_new = view(DQK * DV, {B, NH, DQK}, {NH * X, X, 1});
  a.m = a.m_new = view(DQK * DV + DQK, {B, NH, 1}, {NH * X, X, 1});
  EXPECT_EQ(fastweight::detail::overlap(a.c, a.n), fastweight::detail::Overlap::unknown);
  const std::vector<unsigned char> packed_before = packed.bytes;
  mlstm_step(a);
  EXPECT_NE(packed.bytes, packed_before);
}

TEST(MlstmApi, CudaTensorsWithoutWorkspaceOrKernelAreRefusedBeforeAnything) {
  Seq s(DType::f32, {1, 1, 4, 4, 4}, 0, DType::f32);
  auto a = s.args();
  for (TensorRef* t : {&a.q, &a.k, &a.v, &a.i, &a.f, &a.c_initial, &a.n_initial, &a.m_initial, &a.h, &a.c_last,
                       &a.n_last, &a.m_last})
    t->device = DeviceType::cuda;  // never dereferenced: the call is refused first
  try {  // the forward's CUDA path needs its workspace (or, in a CPU-only build, is refused)
    mlstm_fwd(a);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_TRUE(msg.find("workspace") != std::string::npos || msg.find("CUDA") != std::string::npos) << msg;
  }
  // the backward's CUDA path likewise needs its workspace
  HostTensor dh = make_host(DType::f32, {1, 1, 4, 4});
  MlstmBwdArgs b;
  b.q = a.q, b.k = a.k, b.v = a.v, b.i = a.i, b.f = a.f, b.dh = dh.ref(DeviceType::cuda);
  try {
    mlstm_bwd(b);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_TRUE(msg.find("workspace") != std::string::npos || msg.find("CUDA") != std::string::npos) << msg;
  }
  EXPECT_TRUE(s.untouched());
}

// ---- parallel form -----------------------------------------------------------------------------------
TEST(MlstmApi, ParallelForwardAndBackwardMatchReference) {
  for (DType dt : {DType::f64, DType::f32, DType::bf16})
    for (std::int64_t pad : {0, 3}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + (pad ? " strided" : " contiguous"));
      Seq s(dt, {2, 3, 29, 8, 5}, pad, pad ? DType::f32 : dt);
      const DType st = dt == DType::f64 ? DType::f64 : DType::f32;
      HostTensor n = make_host(st, {2, 3, 29}, pad), m = make_host(st, {2, 3, 29}, pad),
                 bs = make_host(st, {2, 3, 29});
      fill_bytes(n, 0xff), fill_bytes(m, 0xff), fill_bytes(bs, 0xff);  // NaN: every element must be written
      MlstmParallelFwdArgs a;
      a.q = s.q.ref(), a.k = s.k.ref(), a.v = s.v.ref(), a.i = s.i.ref(), a.f = s.f.ref();
      a.h = s.h.ref(), a.n = n.ref(), a.m = m.ref(), a.b = bs.ref();
      mlstm_parallel_fwd(a);
      HostTensor q = to_f64(s.q), k = to_f64(s.k), v = to_f64(s.v), i = to_f64(s.i), f = to_f64(s.f);
      HostTensor rh = make_host(DType::f64, s.h.shape), rn = make_host(DType::f64, n.shape),
                 rm = make_host(DType::f64, m.shape), rb = make_host(DType::f64, bs.shape);
      auto p = [](HostTensor& t) { return static_cast<double*>(t.base()); };
      fastweight::detail::mlstm_parallel_fwd(s.sh, {p(q), p(k), p(v), p(i), p(f)}, 1e-6, p(rh), p(rn), p(rm), p(rb));
      const double tol = dt == DType::f64 ? 1e-12 : tolerance(dt);
      EXPECT_LT(rel_err(s.h, rh), tol);
      EXPECT_LT(rel_err(n, rn), dt == DType::f64 ? 1e-12 : 1e-6);
      EXPECT_LT(rel_err(m, rm), dt == DType::f64 ? 1e-12 : 1e-6);
      EXPECT_LT(rel_err(bs, rb), dt == DType::f64 ? 1e-12 : 1e-6);
      for (std::size_t e = 0; e < std::size_t(n.numel()); ++e) {  // n = max(|b|, exp(-m)), b signed
        const double be = p(rb)[e], me = p(rm)[e];
        EXPECT_NEAR(p(rn)[e], std::max(std::abs(be), std::exp(-me)), 1e-12 * (1 + std::abs(be)));
      }
      // backward: every gradient against the reference's on the same (rounded) inputs
      HostTensor dh = make_host(dt, s.h.shape, pad), dq = make_host(dt, s.q.shape, pad),
                 dk = make_host(dt, s.k.shape), dv = make_host(dt, s.v.shape), di = make_host(s.i.dtype, s.i.shape),
                 df = make_host(s.f.dtype, s.f.shape, pad);
      std::mt19937_64 rng(11);
      fill_random(dh, rng);
      for (HostTensor* t : {&dq, &dk, &dv, &di, &df}) fill_bytes(*t, 0xff);
      MlstmParallelBwdArgs b;
      b.q = a.q, b.k = a.k, b.v = a.v, b.i = a.i, b.f = a.f, b.n = n.ref(), b.m = m.ref(), b.dh = dh.ref();
      b.dq = dq.ref(), b.dk = dk.ref(), b.dv = dv.ref(), b.di = di.ref(), b.df = df.ref();
      mlstm_parallel_bwd(b);
      HostTensor dhc = to_f64(dh), rq = make_host(DType::f64, q.shape), rk = make_host(DType::f64, k.shape),
                 rv = make_host(DType::f64, v.shape), ri = make_host(DType::f64, i.shape),
                 rf = make_host(DType::f64, f.shape);
      fastweight::detail::mlstm_parallel_bwd(s.sh, {p(q), p(k), p(v), p(i), p(f)}, 1e-6, p(dhc),
                                             {p(rq), p(rk), p(rv), p(ri), p(rf)});
      EXPECT_LT(rel_err(dq, rq), tol);
      EXPECT_LT(rel_err(dk, rk), tol);
      EXPECT_LT(rel_err(dv, rv), tol);
      const double gtol = s.i.dtype == DType::f64 ? 1e-12 : std::max(tol, 1e-6);  // di, df in the gates' dtype
      EXPECT_LT(rel_err(di, ri), gtol);
      EXPECT_LT(rel_err(df, rf), gtol);
    }
}

// The parallel form with the head norm: out, mean, rstd and every gradient (weight and bias included)
// against the reference composition, in float64 and float32, contiguous and strided.
TEST(MlstmApi, ParallelHeadNormMatchesReference) {
  for (DType dt : {DType::f64, DType::f32})
    for (std::int64_t pad : {0, 3}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + (pad ? " strided" : " contiguous"));
      Seq s(dt, {2, 3, 17, 8, 6}, pad, dt);
      const DType st = dt == DType::f64 ? DType::f64 : DType::f32;
      HostTensor out = make_host(dt, s.h.shape, pad), w = make_host(dt, {3, 6}, pad), b = make_host(DType::f32, {3, 6}),
                 mean = make_host(st, {2, 3, 17}), rstd = make_host(st, {2, 3, 17});
      std::mt19937_64 rng(13);
      fill_random(w, rng, -0.5, 0.5);
      fill_random(b, rng);
      for (HostTensor* t : {&out, &mean, &rstd}) fill_bytes(*t, 0xff);
      MlstmParallelFwdArgs a;
      a.q = s.q.ref(), a.k = s.k.ref(), a.v = s.v.ref(), a.i = s.i.ref(), a.f = s.f.ref(), a.h = s.h.ref();
      a.out = out.ref(), a.norm_weight = w.ref(), a.norm_bias = b.ref(), a.norm_mean = mean.ref(), a.norm_rstd = rstd.ref();
      a.norm_eps = 1e-5, a.weight_offset = 1.0;
      mlstm_parallel_fwd(a);
      HostTensor q = to_f64(s.q), k = to_f64(s.k), v = to_f64(s.v), i = to_f64(s.i), f = to_f64(s.f);
      HostTensor w64 = to_f64(w), b64 = to_f64(b), rout = make_host(DType::f64, out.shape),
                 rmean = make_host(DType::f64, mean.shape), rrstd = make_host(DType::f64, rstd.shape);
      auto p = [](HostTensor& t) { return static_cast<double*>(t.base()); };
      const fastweight::detail::MlstmHeadNorm norm{p(w64), p(b64), 1e-5, 1.0};
      const fastweight::detail::MlstmInputs in{p(q), p(k), p(v), p(i), p(f)};
      fastweight::detail::mlstm_parallel_headnorm_fwd(s.sh, in, 1e-6, norm, p(rout), p(rmean), p(rrstd));
      const double tol = dt == DType::f64 ? 1e-12 : 1e-5;
      EXPECT_LT(rel_err(out, rout), tol);
      EXPECT_LT(rel_err(mean, rmean), tol);
      EXPECT_LT(rel_err(rstd, rrstd), tol);
      HostTensor dout = make_host(dt, s.h.shape, pad), dq = make_host(dt, s.q.shape), dk = make_host(dt, s.k.shape),
                 dv = make_host(dt, s.v.shape, pad), di = make_host(dt, s.i.shape), df = make_host(dt, s.f.shape),
                 dw = make_host(dt, {3, 6}), db = make_host(DType::f32, {3, 6}, pad);
      fill_random(dout, rng);
      for (HostTensor* t : {&dq, &dk, &dv, &di, &df, &dw, &db}) fill_bytes(*t, 0xff);
      MlstmParallelBwdArgs g;
      g.q = a.q, g.k = a.k, g.v = a.v, g.i = a.i, g.f = a.f, g.dout = dout.ref();
      g.norm_weight = w.ref(), g.norm_bias = b.ref(), g.norm_eps = 1e-5, g.weight_offset = 1.0;
      g.dq = dq.ref(), g.dk = dk.ref(), g.dv = dv.ref(), g.di = di.ref(), g.df = df.ref();
      g.dnorm_weight = dw.ref(), g.dnorm_bias = db.ref();
      mlstm_parallel_bwd(g);
      HostTensor dout64 = to_f64(dout), rq = make_host(DType::f64, q.shape), rk = make_host(DType::f64, k.shape),
                 rv = make_host(DType::f64, v.shape), ri = make_host(DType::f64, i.shape),
                 rf = make_host(DType::f64, f.shape), rw = make_host(DType::f64, {3, 6}), rb = make_host(DType::f64, {3, 6});
      fastweight::detail::mlstm_parallel_headnorm_bwd(s.sh, in, 1e-6, norm, p(dout64),
                                                      {p(rq), p(rk), p(rv), p(ri), p(rf)}, {p(rw), p(rb)});
      const double gtol = dt == DType::f64 ? 1e-12 : 1e-5;
      EXPECT_LT(rel_err(dq, rq), gtol);
      EXPECT_LT(rel_err(dk, rk), gtol);
      EXPECT_LT(rel_err(dv, rv), gtol);
      EXPECT_LT(rel_err(di, ri), gtol);
      EXPECT_LT(rel_err(df, rf), gtol);
      EXPECT_LT(rel_err(dw, rw), gtol);
      EXPECT_LT(rel_err(db, rb), 1e-6);  // float32 bias
    }
}

TEST(MlstmApi, ParallelHeadNormRejectsInconsistentArguments) {
  Seq s(DType::f32, {1, 2, 8, 4, 4}, 0, DType::f32);
  HostTensor out = make_host(DType::f32, {1, 2, 8, 4}), w = make_host(DType::f32, {2, 4}),
             w_bad = make_host(DType::f32, {2, 3}), dw16 = make_host(DType::f16, {2, 4}), dh = make_host(DType::f32, {1, 2, 8, 4});
  fill_bytes(out, 0xab);
  MlstmParallelFwdArgs a;
  a.q = s.q.ref(), a.k = s.k.ref(), a.v = s.v.ref(), a.i = s.i.ref(), a.f = s.f.ref(), a.h = s.h.ref();
  const char* op = "mlstm_parallel_fwd";
  {
    auto x = a;
    x.norm_weight = w.ref();  // without out
    expect_rejected(s, [&] { mlstm_parallel_fwd(x); }, {op, "norm_weight", "out is not"});
  }
  {
    auto x = a;
    x.out = out.ref(), x.norm_weight = w_bad.ref();
    expect_rejected(s, [&] { mlstm_parallel_fwd(x); }, {op, "norm_weight", "(2, 4)"});
  }
  {
    auto x = a;
    x.out = out.ref(), x.weight_offset = INFINITY;
    expect_rejected(s, [&] { mlstm_parallel_fwd(x); }, {op, "weight_offset"});
  }
  for (unsigned char c : out.bytes) ASSERT_EQ(c, 0xab) << "out was written before the error";
  MlstmParallelBwdArgs g;
  g.q = a.q, g.k = a.k, g.v = a.v, g.i = a.i, g.f = a.f;
  const char* bop = "mlstm_parallel_bwd";
  expect_argument_error([&] { mlstm_parallel_bwd(g); }, {bop, "dh", "required"});
  g.dh = dh.ref(), g.dout = dh.ref();
  expect_argument_error([&] { mlstm_parallel_bwd(g); }, {bop, "dh", "both given"});
  g.dh = TensorRef{};
  g.dnorm_weight = w.ref();
  expect_argument_error([&] { mlstm_parallel_bwd(g); }, {bop, "dnorm_weight", "needs norm_weight"});
  g.norm_weight = w.ref(), g.dnorm_weight = dw16.ref();
  expect_argument_error([&] { mlstm_parallel_bwd(g); }, {bop, "dnorm_weight"});
  g.dout = TensorRef{}, g.dh = dh.ref(), g.dnorm_weight = TensorRef{};
  expect_argument_error([&] { mlstm_parallel_bwd(g); }, {bop, "norm_weight", "with dh"});
}

TEST(MlstmApi, ParallelRejectsBadInputAndCudaTensorsBeforeWriting) {
  Seq s(DType::f32, {1, 2, 8, 4, 4}, 0, DType::f32);
  HostTensor n = make_host(DType::f32, {1, 2, 8}), m_bad = make_host(DType::f32, {1, 2, 7}),
             n_f16 = make_host(DType::f16, {1, 2, 8}), f_bad = make_host(DType::f32, {1, 3, 8});
  fill_bytes(n, 0xab);
  auto args = [&] {
    MlstmParallelFwdArgs a;
    a.q = s.q.ref(), a.k = s.k.ref(), a.v = s.v.ref(), a.i = s.i.ref(), a.f = s.f.ref(), a.h = s.h.ref(), a.n = n.ref();
    return a;
  };
  auto run = [&](auto mutate) { auto a = args(); mutate(a); mlstm_parallel_fwd(a); };
  const char* op = "mlstm_parallel_fwd";
  expect_rejected(s, [&] { run([&](MlstmParallelFwdArgs& a) { a.f = f_bad.ref(); }); }, {op, "f", "(1, 2, 8)"});
  expect_rejected(s, [&] { run([&](MlstmParallelFwdArgs& a) { a.m = m_bad.ref(); }); }, {op, "m", "(1, 2, 8)"});
  expect_rejected(s, [&] { run([&](MlstmParallelFwdArgs& a) { a.n = n_f16.ref(); }); }, {op, "n", "float32"});
  expect_rejected(s, [&] { run([&](MlstmParallelFwdArgs& a) { a.eps = -1.0; }); }, {op, "eps"});
  expect_rejected(s, [&] { run([&](MlstmParallelFwdArgs& a) { a.b = n_f16.ref(); }); }, {op, "b", "float32"});
  expect_rejected(s, [&] { run([&](MlstmParallelFwdArgs& a) { a.m = a.n; }); }, {op, "n", "shares memory with m"});
  expect_rejected(s, [&] { run([&](MlstmParallelFwdArgs& a) { a.h = a.v; }); }, {op, "h", "shares memory with v"});
  // CUDA tensors (never read here): the tiled kernels need their workspace (a CPU-only build refuses)
  auto cuda_args = [&] {
    MlstmParallelFwdArgs a = args();
    for (TensorRef* t : {&a.q, &a.k, &a.v, &a.i, &a.f, &a.h, &a.n}) t->device = DeviceType::cuda;
    return a;
  };
  try {
    mlstm_parallel_fwd(cuda_args());
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_TRUE(msg.find("workspace") != std::string::npos || msg.find("CUDA") != std::string::npos) << msg;
  }
  for (unsigned char c : n.bytes) ASSERT_EQ(c, 0xab) << "n was written before the error";
  HostTensor dh = make_host(DType::f32, {1, 2, 8, 4}), dq = make_host(DType::f32, {1, 2, 8, 3});
  MlstmParallelBwdArgs b;
  b.q = s.q.ref(), b.k = s.k.ref(), b.v = s.v.ref(), b.i = s.i.ref(), b.f = s.f.ref(), b.dh = dh.ref(), b.dq = dq.ref();
  expect_argument_error([&] { mlstm_parallel_bwd(b); }, {"mlstm_parallel_bwd", "dq", "(1, 2, 8, 4)"});
  // the CUDA backward takes the forward's m, b (and h with the head norm) back: a missing one is named
  const MlstmParallelFwdArgs ca = cuda_args();
  MlstmParallelBwdArgs cb;
  cb.q = ca.q, cb.k = ca.k, cb.v = ca.v, cb.i = ca.i, cb.f = ca.f, cb.dh = dh.ref(DeviceType::cuda);
  expect_argument_error([&] { mlstm_parallel_bwd(cb); }, {"mlstm_parallel_bwd", "m", "forward's m and b"});
  cb.m = n.ref(DeviceType::cuda);
  expect_argument_error([&] { mlstm_parallel_bwd(cb); }, {"mlstm_parallel_bwd", "b", "required"});
  cb.b = n.ref(DeviceType::cuda), cb.dh = TensorRef{}, cb.dout = dh.ref(DeviceType::cuda);
  expect_argument_error([&] { mlstm_parallel_bwd(cb); }, {"mlstm_parallel_bwd", "h", "head norm"});
}

}  // namespace
}  // namespace fwtest
