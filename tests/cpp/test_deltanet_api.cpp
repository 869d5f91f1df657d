// test_deltanet_api.cpp: the public DeltaNet entry points (fastweight/deltanet.h) on the CPU. The API
// runs the chunkwise reference (chunk 64); results are compared with the loop (recurrent) form of
// the reference on float64 copies of the rounded inputs, for every IO dtype, strided views (rows
// cut from larger buffers), T crossing a chunk boundary, the L2 norm, an explicit scale and
// variable-length batches with int32 and int64 cu_seqlens (empty sequences included). Every bad
// input gets an ArgumentError naming the op and the argument before anything is written, CUDA
// tensors beyond the CUDA kernels get a clear error, and the CUDA backward refuses a missing or
// too small workspace before writing (on a GPU; skipped, and reported so, without one). The integer
// dtypes added for cu_seqlens stay rejected by the float ops.
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "reference/deltanet_ref.h"
#include "test_util.h"

namespace fwtest {
namespace {
using fastweight::detail::DeltanetShape;

constexpr unsigned char kPoison = 0xab;

double* f64(HostTensor& t) { return static_cast<double*>(t.base()); }

// One call's tensors. pad > 0 makes every view (the cu_seqlens excepted) a strided cut of a buffer.
// cu: the offsets of a variable-length batch (B must be 1), stored as cu_dtype.
struct Dn {
  DeltanetShape base;                 // without cu_seqlens: shape() points it at `offsets`
  std::vector<std::int64_t> offsets;  // (so that a copy of a Dn stays valid)
  HostTensor q, k, v, beta, h0, o, ht, cu;
  bool l2 = false;
  double scale = kDeltanetDefaultScale;

  Dn(DType dt, DeltanetShape s, std::int64_t pad, DType beta_dt, std::vector<std::int64_t> cu_off = {},
     DType cu_dt = DType::i64)
      : base(s), offsets(std::move(cu_off)) {
    const std::int64_t N = shape().seqs();
    q = make_host(dt, {s.B, s.T, s.H, s.K}, pad), k = make_host(dt, {s.B, s.T, s.H, s.K}, pad);
    v = make_host(dt, {s.B, s.T, s.H, s.V}, pad), beta = make_host(beta_dt, {s.B, s.T, s.H}, pad);
    h0 = make_host(DType::f32, {N, s.H, s.K, s.V}, pad), o = make_host(dt, {s.B, s.T, s.H, s.V}, pad);
    ht = make_host(DType::f32, {N, s.H, s.K, s.V}, pad);
    std::mt19937_64 rng(11);
    fill_random(q, rng, -1.0, 1.0);
    fill_random(k, rng, -0.5, 0.5);  // beta |k|^2 < 2 keeps I - beta k k^T a contraction
    fill_random(v, rng, -1.0, 1.0);
    fill_random(beta, rng, 0.0, 1.0);
    fill_random(h0, rng, -1.0, 1.0);
    fill_bytes(o, kPoison), fill_bytes(ht, kPoison);
    if (!offsets.empty()) {
      cu = make_host(cu_dt, {std::int64_t(offsets.size())});
      for (std::size_t n = 0; n < offsets.size(); ++n) cu.set(std::int64_t(n), double(offsets[n]));
    }
  }
  DeltanetShape shape() const {
    DeltanetShape sh = base;
    if (!offsets.empty()) sh.N = std::int64_t(offsets.size()) - 1, sh.cu_seqlens = offsets.data();
    return sh;
  }
  DeltanetFwdArgs args() {
    DeltanetFwdArgs a;
    a.q = q.ref(), a.k = k.ref(), a.v = v.ref(), a.beta = beta.ref(), a.initial_state = h0.ref();
    if (!offsets.empty()) a.cu_seqlens = cu.ref();
    a.o = o.ref(), a.final_state = ht.ref();
    a.scale = scale, a.use_qk_l2norm_in_kernel = l2;
    return a;
  }
  fastweight::detail::DeltanetOptions options() const {
    fastweight::detail::DeltanetOptions opt;
    if (!std::isnan(scale)) opt.scale = scale;
    opt.use_qk_l2norm_in_kernel = l2;
    return opt;
  }
  bool untouched() const {
    for (const HostTensor* t : {&o, &ht})
      for (unsigned char c : t->bytes) if (c != kPoison) return false;
    return true;
  }
};

// Float64 contiguous copies of the (already rounded) inputs, for the reference.
struct RefInputs {
  HostTensor q, k, v, beta, h0;
  explicit RefInputs(const Dn& s) : q(to_f64(s.q)), k(to_f64(s.k)), v(to_f64(s.v)), beta(to_f64(s.beta)), h0(to_f64(s.h0)) {}
  fastweight::detail::DeltanetInputs in() { return {f64(q), f64(k), f64(v), f64(beta)}; }
};

// The loop form of the reference: o and the final state.
void reference_fwd(const Dn& s, HostTensor& o, HostTensor& ht) {
  RefInputs r(s);
  o = make_host(DType::f64, s.o.shape), ht = make_host(DType::f64, s.ht.shape);
  fastweight::detail::deltanet_recurrent_fwd(s.shape(), r.in(), s.options(), f64(r.h0), f64(o), f64(ht));
}

double io_tol(DType dt) { return dt == DType::f64 ? 1e-12 : tolerance(dt); }

TEST(DeltanetApi, ForwardMatchesReferenceAllDtypesStrided) {
  for (DType dt : {DType::f64, DType::f32, DType::bf16, DType::f16})
    for (std::int64_t pad : {0, 3}) {
      // T = 100: two chunks of the API's chunkwise reference against the loop; K != V.
      Dn s(dt, {2, 100, 3, 8, 5}, pad, pad ? DType::f32 : dt);
      s.l2 = pad > 0, s.scale = pad ? 0.7 : kDeltanetDefaultScale;
      deltanet_fwd(s.args());
      HostTensor o, ht;
      reference_fwd(s, o, ht);
      SCOPED_TRACE(std::string(dtype_name(dt)) + (pad ? " strided, l2, scale 0.7" : " contiguous"));
      const double eo = rel_err(s.o, o), eh = rel_err(s.ht, ht);
      EXPECT_LT(eo, io_tol(dt));
      EXPECT_LT(eh, dt == DType::f64 ? 1e-6 : 1e-5);  // the final state is stored as fp32
      std::printf("[ measured ] fwd %-8s pad %lld: o %.2e  final_state %.2e\n", dtype_name(dt), (long long)pad, eo, eh);
    }
}

TEST(DeltanetApi, DefaultScaleIsKToTheMinusHalfAndStatesAreOptional) {
  Dn a(DType::f64, {1, 9, 2, 7, 4}, 0, DType::f64), b = a;
  b.scale = std::pow(7.0, -0.5);
  deltanet_fwd(a.args());
  deltanet_fwd(b.args());
  EXPECT_EQ(rel_err(a.o, b.o), 0.0);
  // Without states: zero initial state, no final state written.
  Dn c = a;
  fill_bytes(c.o, kPoison), fill_bytes(c.ht, kPoison);
  auto args = c.args();
  args.initial_state = TensorRef{}, args.final_state = TensorRef{};
  deltanet_fwd(args);
  for (unsigned char x : c.ht.bytes) ASSERT_EQ(x, kPoison);
  c.h0 = make_host(DType::f32, c.h0.shape);  // zeros
  HostTensor o, ht;
  reference_fwd(c, o, ht);
  EXPECT_LT(rel_err(c.o, o), 1e-12);
}

TEST(DeltanetApi, EmptySequencesKeepTheInitialState) {
  Dn s(DType::f32, {2, 0, 3, 4, 6}, 0, DType::f32);  // T = 0: nothing to read, the states pass through
  deltanet_fwd(s.args());
  EXPECT_EQ(rel_err(s.ht, s.h0), 0.0);
}

struct Grads {
  HostTensor dout, dht, dq, dk, dv, dbeta, dh0;
};
Grads make_grads(const Dn& s, std::int64_t pad) {
  Grads g{make_host(s.o.dtype, s.o.shape, pad), make_host(DType::f32, s.ht.shape, pad),
          make_host(s.q.dtype, s.q.shape, pad), make_host(s.k.dtype, s.k.shape, pad),
          make_host(s.v.dtype, s.v.shape, pad), make_host(s.beta.dtype, s.beta.shape, pad),
          make_host(DType::f32, s.h0.shape, pad)};
  std::mt19937_64 rng(3);
  fill_random(g.dout, rng, -1.0, 1.0);
  fill_random(g.dht, rng, -1.0, 1.0);
  for (HostTensor* t : {&g.dq, &g.dk, &g.dv, &g.dbeta, &g.dh0}) fill_bytes(*t, kPoison);
  return g;
}
DeltanetBwdArgs bwd_args(Dn& s, Grads& g) {
  DeltanetBwdArgs a;
  a.q = s.q.ref(), a.k = s.k.ref(), a.v = s.v.ref(), a.beta = s.beta.ref(), a.initial_state = s.h0.ref();
  if (!s.offsets.empty()) a.cu_seqlens = s.cu.ref();
  a.do_ = g.dout.ref(), a.dfinal_state = g.dht.ref();
  a.dq = g.dq.ref(), a.dk = g.dk.ref(), a.dv = g.dv.ref(), a.dbeta = g.dbeta.ref(), a.dinitial_state = g.dh0.ref();
  a.scale = s.scale, a.use_qk_l2norm_in_kernel = s.l2;
  return a;
}
// The loop form's backward on float64 copies: errors of dq, dk, dv, dbeta, dh0 (in that order).
std::vector<double> backward_errors(Dn& s, Grads& g) {
  RefInputs r(s);
  HostTensor dout = to_f64(g.dout), dht = to_f64(g.dht);
  HostTensor dq = make_host(DType::f64, s.q.shape), dk = make_host(DType::f64, s.k.shape),
             dv = make_host(DType::f64, s.v.shape), db = make_host(DType::f64, s.beta.shape),
             dh0 = make_host(DType::f64, s.h0.shape);
  fastweight::detail::deltanet_recurrent_bwd(s.shape(), r.in(), s.options(), f64(r.h0), f64(dout), f64(dht),
                                             {f64(dq), f64(dk), f64(dv), f64(db)}, f64(dh0));
  return {rel_err(g.dq, dq), rel_err(g.dk, dk), rel_err(g.dv, dv), rel_err(g.dbeta, db), rel_err(g.dh0, dh0)};
}

TEST(DeltanetApi, BackwardMatchesReferenceAllDtypesStrided) {
  const char* names[] = {"dq", "dk", "dv", "dbeta", "dinitial_state"};
  for (DType dt : {DType::f64, DType::f32, DType::bf16, DType::f16})
    for (std::int64_t pad : {0, 2}) {
      Dn s(dt, {2, 70, 2, 6, 9}, pad, pad ? DType::f32 : dt);
      s.l2 = pad > 0;
      Grads g = make_grads(s, pad);
      deltanet_bwd(bwd_args(s, g));
      const auto err = backward_errors(s, g);
      SCOPED_TRACE(std::string(dtype_name(dt)) + (pad ? " strided, l2" : " contiguous"));
      std::printf("[ measured ] bwd %-8s pad %lld:", dtype_name(dt), (long long)pad);
      const DType out_dt[] = {dt, dt, dt, s.beta.dtype, DType::f32};  // dbeta: beta's dtype; dh0: fp32
      for (int e = 0; e < 5; ++e) {
        const double tol = out_dt[e] == DType::f64 ? 1e-11 : out_dt[e] == DType::f32 ? 1e-6 : tolerance(out_dt[e]);
        EXPECT_LT(err[e], tol) << names[e];
        std::printf(" %s %.2e", names[e], err[e]);
      }
      std::printf("\n");
    }
}

TEST(DeltanetApi, BackwardOutputsAreOptional) {
  Dn s(DType::f64, {1, 20, 2, 4, 4}, 0, DType::f64);
  Grads g = make_grads(s, 0);
  auto a = bwd_args(s, g);
  a.dq = TensorRef{}, a.dbeta = TensorRef{}, a.dinitial_state = TensorRef{}, a.dfinal_state = TensorRef{};
  deltanet_bwd(a);
  for (const HostTensor* t : {&g.dq, &g.dbeta, &g.dh0})
    for (unsigned char c : t->bytes) ASSERT_EQ(c, kPoison);
  // dk and dv without dfinal_state equal the reference with dht = 0.
  fill_bytes(g.dht, 0);
  const auto err = backward_errors(s, g);
  EXPECT_LT(err[1], 1e-12);
  EXPECT_LT(err[2], 1e-12);
}

// CPU tensors need no workspace: the size is 0 and the four-argument form (null, 0) equals the
// two-argument one, bit for bit.
TEST(DeltanetApi, BackwardWorkspaceIsZeroOnTheCpu) {
  Dn s(DType::f32, {1, 70, 2, 6, 5}, 0, DType::f32, {0, 0, 30, 70}, DType::i32);
  Grads g = make_grads(s, 0), g2 = make_grads(s, 0);
  EXPECT_EQ(deltanet_bwd_workspace_size(bwd_args(s, g)), std::size_t(0));
  deltanet_bwd(bwd_args(s, g));
  deltanet_bwd(bwd_args(s, g2), nullptr, 0);
  for (auto [a, b] : {std::pair{&g.dq, &g2.dq}, {&g.dk, &g2.dk}, {&g.dv, &g2.dv}, {&g.dbeta, &g2.dbeta},
                      {&g.dh0, &g2.dh0}})
    EXPECT_EQ(a->bytes, b->bytes);
}

// Variable length: int32 and int64 offsets, empty sequences first, in the middle and last; T = 150
// puts a 100-long sequence across the chunk boundary.
TEST(DeltanetApi, VarlenMatchesReferenceInt32AndInt64) {
  const std::vector<std::int64_t> off = {0, 0, 17, 17, 117, 150, 150};
  for (DType cu_dt : {DType::i32, DType::i64}) {
    SCOPED_TRACE(dtype_name(cu_dt));
    Dn s(DType::f64, {1, 150, 2, 5, 3}, 1, DType::f64, off, cu_dt);
    s.l2 = true;
    deltanet_fwd(s.args());
    HostTensor o, ht;
    reference_fwd(s, o, ht);
    EXPECT_LT(rel_err(s.o, o), 1e-12);
    EXPECT_LT(rel_err(s.ht, ht), 1e-6);
    // Empty sequences: final state = initial state, exactly (fp32 in, fp32 out).
    const std::int64_t per = s.base.H * s.base.K * s.base.V;
    const auto h0 = s.h0.values(), hl = s.ht.values();
    for (std::int64_t n : {0, 2, 5})
      for (std::int64_t e = 0; e < per; ++e) ASSERT_EQ(hl[n * per + e], h0[n * per + e]) << "sequence " << n;
    Grads g = make_grads(s, 1);
    deltanet_bwd(bwd_args(s, g));
    const auto err = backward_errors(s, g);
    std::printf("[ measured ] varlen %s: o %.2e dq %.2e dk %.2e dv %.2e dbeta %.2e dh0 %.2e\n", dtype_name(cu_dt),
                rel_err(s.o, o), err[0], err[1], err[2], err[3], err[4]);
    for (int e = 0; e < 4; ++e) EXPECT_LT(err[e], 1e-11);
    EXPECT_LT(err[4], 1e-6);  // dinitial_state is stored as fp32
  }
}

// ---- bad input ------------------------------------------------------------------------------------
template <typename F>
void expect_rejected(const std::vector<const HostTensor*>& outputs, F&& f, std::initializer_list<const char*> fragments) {
  expect_argument_error(f, fragments);
  for (const HostTensor* t : outputs)
    for (unsigned char c : t->bytes) ASSERT_EQ(c, kPoison) << "an output was written before the error";
}

TEST(DeltanetApi, ForwardRejectsBadInputBeforeWriting) {
  Dn s(DType::f32, {1, 8, 2, 4, 3}, 0, DType::f32, {0, 3, 8});
  HostTensor k_bad = make_host(DType::f32, {1, 8, 2, 5}), v_f16 = make_host(DType::f16, {1, 8, 2, 3}),
             b_bad = make_host(DType::f32, {1, 8, 3}), b_f16 = make_host(DType::f16, {1, 8, 2}),
             q_i32 = make_host(DType::i32, {1, 8, 2, 4}), h0_bad = make_host(DType::f32, {1, 2, 4, 3}),
             h0_f16 = make_host(DType::f16, {2, 2, 4, 3}), o_bad = make_host(DType::f32, {1, 8, 2, 4}),
             ht_bad = make_host(DType::f32, {2, 2, 3, 4}), cu_f32 = make_host(DType::f32, {3}),
             cu_2d = make_host(DType::i64, {1, 3}), cu3 = make_host(DType::i32, {3}),
             q_nc = make_host(DType::f32, {1, 8, 2, 4}), b2q = make_host(DType::f32, {2, 4, 2, 4});
  q_nc.strides[3] = 2;  // last dim not contiguous (only validation looks at it)
  q_nc.bytes.resize(q_nc.bytes.size() * 2);
  auto set_cu = [](HostTensor& t, std::vector<double> vals) {
    for (std::size_t n = 0; n < vals.size(); ++n) t.set(std::int64_t(n), vals[n]);
  };
  HostTensor cu_start = cu3, cu_decr = make_host(DType::i64, {4}), cu_end = cu3;
  set_cu(cu_start, {1, 3, 8}), set_cu(cu_decr, {0, 5, 3, 8}), set_cu(cu_end, {0, 3, 7});
  const std::vector<const HostTensor*> outs = {&s.o, &s.ht};
  auto run = [&](auto mutate) { auto a = s.args(); mutate(a); deltanet_fwd(a); };
  using A = DeltanetFwdArgs;
  const char* op = "deltanet_fwd";
  expect_rejected(outs, [&] { run([&](A& a) { a.k = k_bad.ref(); }); }, {op, "k", "(1, 8, 2, 4)", "(1, 8, 2, 5)"});
  expect_rejected(outs, [&] { run([&](A& a) { a.v = v_f16.ref(); }); }, {op, "v", "float16", "float32"});
  expect_rejected(outs, [&] { run([&](A& a) { a.beta = b_bad.ref(); }); }, {op, "beta", "(1, 8, 2)"});
  expect_rejected(outs, [&] { run([&](A& a) { a.beta = b_f16.ref(); }); }, {op, "beta", "float16"});
  expect_rejected(outs, [&] { run([&](A& a) { a.q = q_i32.ref(); }); }, {op, "q", "int32", "not supported"});
  expect_rejected(outs, [&] { run([&](A& a) { a.initial_state = h0_bad.ref(); }); }, {op, "initial_state", "(2, 2, 4, 3)"});
  expect_rejected(outs, [&] { run([&](A& a) { a.initial_state = h0_f16.ref(); }); }, {op, "initial_state", "float32"});
  expect_rejected(outs, [&] { run([&](A& a) { a.o = o_bad.ref(); }); }, {op, "o", "(1, 8, 2, 3)"});
  expect_rejected(outs, [&] { run([&](A& a) { a.final_state = ht_bad.ref(); }); }, {op, "final_state", "(2, 2, 4, 3)"});
  expect_rejected(outs, [&] { run([&](A& a) { a.cu_seqlens = cu_f32.ref(); }); }, {op, "cu_seqlens", "int32 or int64", "float32"});
  expect_rejected(outs, [&] { run([&](A& a) { a.cu_seqlens = cu_2d.ref(); }); }, {op, "cu_seqlens", "(N+1)"});
  expect_rejected(outs, [&] { run([&](A& a) { a.cu_seqlens = cu_start.ref(); }); }, {op, "cu_seqlens", "starting at 0"});
  expect_rejected(outs, [&] {
    run([&](A& a) { a.cu_seqlens = cu_decr.ref(), a.initial_state = TensorRef{}, a.final_state = TensorRef{}; });
  }, {op, "cu_seqlens", "non-decreasing", "cu_seqlens[2] = 3"});
  expect_rejected(outs, [&] { run([&](A& a) { a.cu_seqlens = cu_end.ref(); }); }, {op, "cu_seqlens", "T = 8", "got 7"});
  expect_rejected(outs, [&] { run([&](A& a) { a.q = b2q.ref(); }); }, {op, "k", "(2, 4, 2, 4)"});
  expect_rejected(outs, [&] { run([&](A& a) { a.q = q_nc.ref(); }); }, {op, "q", "contiguous"});
  expect_rejected(outs, [&] { run([&](A& a) { a.scale = INFINITY; }); }, {op, "scale", "finite"});
  expect_rejected(outs, [&] { run([&](A& a) { a.v = TensorRef{}; }); }, {op, "v", "required"});
  expect_rejected(outs, [&] { run([&](A& a) { a.beta = TensorRef{}; }); }, {op, "beta", "required"});
  expect_rejected(outs, [&] { run([&](A& a) { a.k.data = static_cast<char*>(a.k.data) + 1; }); }, {op, "k", "misaligned"});
  expect_rejected(outs, [&] { run([&](A& a) { a.cu_seqlens.device = DeviceType::cuda; }); }, {op, "cu_seqlens", "device"});
}

TEST(DeltanetApi, BatchOfTwoWithCuSeqlensIsRejected) {
  Dn s(DType::f32, {2, 8, 2, 4, 3}, 0, DType::f32);
  HostTensor cu = make_host(DType::i64, {3});
  cu.set(1, 4), cu.set(2, 8);
  auto a = s.args();
  a.cu_seqlens = cu.ref();
  expect_rejected({&s.o, &s.ht}, [&] { deltanet_fwd(a); }, {"deltanet_fwd", "cu_seqlens", "B = 1", "got B = 2"});
}

TEST(DeltanetApi, BackwardRejectsBadInputBeforeWriting) {
  Dn s(DType::f32, {2, 8, 2, 4, 3}, 0, DType::f32);
  Grads g = make_grads(s, 0);
  HostTensor do_bad = make_host(DType::f32, {2, 8, 2, 4}), dht_bad = make_host(DType::f32, {1, 2, 4, 3}),
             db_f16 = make_host(DType::f16, {2, 8, 2}), dq_f64 = make_host(DType::f64, {2, 8, 2, 4});
  fill_bytes(db_f16, kPoison), fill_bytes(dq_f64, kPoison);
  const std::vector<const HostTensor*> outs = {&g.dq, &g.dk, &g.dv, &g.dbeta, &g.dh0, &db_f16, &dq_f64};
  auto run = [&](auto mutate) { auto a = bwd_args(s, g); mutate(a); deltanet_bwd(a); };
  using A = DeltanetBwdArgs;
  const char* op = "deltanet_bwd";
  expect_rejected(outs, [&] { run([&](A& a) { a.initial_state = TensorRef{}; }); },
                  {op, "dinitial_state", "needs the initial state"});
  expect_rejected(outs, [&] { run([&](A& a) { a.do_ = do_bad.ref(); }); }, {op, "do_", "(2, 8, 2, 3)"});
  expect_rejected(outs, [&] { run([&](A& a) { a.do_ = TensorRef{}; }); }, {op, "do_", "required"});
  expect_rejected(outs, [&] { run([&](A& a) { a.dfinal_state = dht_bad.ref(); }); }, {op, "dfinal_state", "(2, 2, 4, 3)"});
  expect_rejected(outs, [&] { run([&](A& a) { a.dbeta = db_f16.ref(); }); }, {op, "dbeta", "float16"});
  expect_rejected(outs, [&] { run([&](A& a) { a.dq = dq_f64.ref(); }); }, {op, "dq", "float64"});
}

TEST(DeltanetApi, StepEqualsAOneStepSequenceAndWorksInPlace) {
  for (bool l2 : {false, true}) {
    SCOPED_TRACE(l2 ? "l2norm" : "plain");
    Dn s(DType::f32, {2, 1, 3, 6, 5}, 0, DType::f32);  // T = 1
    s.l2 = l2;
    DeltanetFwdArgs f{s.q.ref(), s.k.ref(), s.v.ref(), s.beta.ref(), s.h0.ref(), {}, s.o.ref(), s.ht.ref(),
                      kDeltanetDefaultScale, l2};
    deltanet_fwd(f);
    auto squeeze = [](HostTensor t) {  // (B, 1, H, D) -> (B, H, D)
      t.shape.erase(t.shape.begin() + 1);
      t.strides.erase(t.strides.begin() + 1);
      return t;
    };
    HostTensor q = squeeze(s.q), k = squeeze(s.k), v = squeeze(s.v), beta = squeeze(s.beta);
    HostTensor o = make_host(DType::f32, {2, 3, 5}), st = s.h0, nst = make_host(DType::f32, {2, 3, 6, 5});
    fill_bytes(o, kPoison), fill_bytes(nst, kPoison);
    deltanet_step({q.ref(), k.ref(), v.ref(), beta.ref(), st.ref(), o.ref(), nst.ref(), kDeltanetDefaultScale, l2});
    EXPECT_LT(rel_err(o, squeeze(s.o)), 1e-6);
    EXPECT_LT(rel_err(nst, s.ht), 1e-6);
    HostTensor o2 = make_host(DType::f32, {2, 3, 5});
    deltanet_step({q.ref(), k.ref(), v.ref(), beta.ref(), st.ref(), o2.ref(), st.ref(), kDeltanetDefaultScale, l2});
    EXPECT_EQ(rel_err(o2, o), 0.0);
    EXPECT_EQ(rel_err(st, nst), 0.0);  // in place: the same bits
    HostTensor bad = make_host(DType::f32, {2, 3, 6, 4});
    fill_bytes(o2, kPoison);
    expect_rejected({&o2}, [&] {
      deltanet_step({q.ref(), k.ref(), v.ref(), beta.ref(), bad.ref(), o2.ref(), bad.ref(), kDeltanetDefaultScale, l2});
    }, {"deltanet_step", "state", "(2, 3, 6, 5)"});
    // new_state one row past state (it must be state itself or apart from it), o over v: refused, nothing written
    HostTensor sbuf = make_host(DType::f32, {2 * 3 * 6 * 5 + 5});
    fill_bytes(sbuf, kPoison);
    TensorRef st_ref = st.ref(), shifted = st.ref();
    st_ref.data = sbuf.base(), shifted.data = static_cast<float*>(sbuf.base()) + 5;
    expect_rejected({&o2, &sbuf}, [&] {
      deltanet_step({q.ref(), k.ref(), v.ref(), beta.ref(), st_ref, o2.ref(), shifted, kDeltanetDefaultScale, l2});
    }, {"deltanet_step", "new_state", "shares memory with state", "same view"});
    expect_rejected({&o2}, [&] {
      deltanet_step({q.ref(), k.ref(), v.ref(), beta.ref(), st.ref(), v.ref(), st.ref(), kDeltanetDefaultScale, l2});
    }, {"deltanet_step", "o", "shares memory with v"});
  }
}

// The forward's outputs apart from its inputs: final_state as initial_state itself (in place is a
// decoding step's feature) or o over q is refused before anything is written.
TEST(DeltanetApi, ForwardRefusesOutputsOverInputs) {
  Dn s(DType::f32, {1, 8, 2, 4, 4}, 0, DType::f32);
  const std::vector<const HostTensor*> outs = {&s.o, &s.ht};
  auto run = [&](auto mutate) { auto a = s.args(); mutate(a); deltanet_fwd(a); };
  using A = DeltanetFwdArgs;
  HostTensor h0 = s.h0;  // a copy: the poisoned outputs stay as they are
  expect_rejected(outs, [&] {
    run([&](A& a) { a.initial_state = h0.ref(), a.final_state = h0.ref(); });
  }, {"deltanet_fwd", "final_state", "shares memory with initial_state"});
  expect_rejected(outs, [&] { run([&](A& a) { a.q = a.o; }); }, {"deltanet_fwd", "o", "shares memory with q"});
}

// CUDA tensors here are host buffers flagged as CUDA: never dereferenced, as every call below is
// refused before anything is launched. The CUDA runs are in test_deltanet_cuda.cpp; here what the
// forward cannot do (K > 256, float64: ArgumentErrors naming q) and what the shape of device offsets
// tells, outputs untouched. A build without CUDA refuses the forward, the backward and the step
// with a clear Error (not an ArgumentError, not a fallback). The backward's workspace checks need
// real device memory: DeltanetApi.CudaBackwardRefusesAMissingOrShortWorkspaceBeforeWriting below.
TEST(DeltanetApi, CudaTensorsBeyondTheKernelsGetAClearErrorNotAFallback) {
  auto on_cuda = [](std::initializer_list<TensorRef*> ts) {
    for (TensorRef* t : ts) t->device = DeviceType::cuda;
  };
#if FW_WITH_CUDA
  {
    Dn wide(DType::f32, {1, 4, 1, 300, 4}, 0, DType::f32);  // K = 300: the state slice would not fit
    auto a = wide.args();
    on_cuda({&a.q, &a.k, &a.v, &a.beta, &a.initial_state, &a.o, &a.final_state});
    expect_rejected({&wide.o, &wide.ht}, [&] { deltanet_fwd(a); }, {"deltanet_fwd", "q", "K = 300", "CUDA forward"});
    Dn d64(DType::f64, {1, 4, 1, 4, 4}, 0, DType::f64);
    auto b = d64.args();
    b.initial_state = b.final_state = TensorRef{};
    on_cuda({&b.q, &b.k, &b.v, &b.beta, &b.o});
    expect_rejected({&d64.o}, [&] { deltanet_fwd(b); }, {"deltanet_fwd", "q", "float64", "not supported on cuda"});
  }
#else
  auto expect_clear = [&](auto&& call, const char* fragment) {
    try {
      call();
      ADD_FAILURE() << "no error";
    } catch (const ArgumentError& e) {
      ADD_FAILURE() << "an argument error instead of the CUDA one: " << e.what();
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(fragment), std::string::npos) << msg;
    }
  };
  {
    Dn s(DType::f32, {1, 4, 1, 4, 4}, 0, DType::f32, {0, 1, 4});
    auto a = s.args();
    on_cuda({&a.q, &a.k, &a.v, &a.beta, &a.initial_state, &a.cu_seqlens, &a.o, &a.final_state});
    expect_clear([&] { deltanet_fwd(a); }, "no CUDA kernels");
    EXPECT_TRUE(s.untouched());
  }
  {  // the backward and the decoding step: likewise refused, outputs untouched
    Dn s(DType::f32, {1, 4, 1, 4, 4}, 0, DType::f32, {0, 1, 4});
    Grads g = make_grads(s, 0);
    auto b = bwd_args(s, g);
    on_cuda({&b.q, &b.k, &b.v, &b.beta, &b.initial_state, &b.cu_seqlens, &b.do_, &b.dfinal_state, &b.dq, &b.dk,
             &b.dv, &b.dbeta, &b.dinitial_state});
    expect_clear([&] { deltanet_bwd(b); }, "no CUDA kernels");
    for (const HostTensor* t : {&g.dq, &g.dk, &g.dv, &g.dbeta, &g.dh0})
      for (unsigned char c : t->bytes) ASSERT_EQ(c, kPoison);
    // the step: (B, H, D) = (1, 1, 4) views of the sequence tensors' first position (T dim dropped)
    auto squeeze = [](TensorRef t) {
      for (int d = 1; d + 1 < t.ndim; ++d) t.shape[d] = t.shape[d + 1], t.strides[d] = t.strides[d + 1];
      --t.ndim;
      return t;
    };
    DeltanetStepArgs st;
    st.q = squeeze(s.q.ref()), st.k = squeeze(s.k.ref()), st.v = squeeze(s.v.ref()), st.beta = squeeze(s.beta.ref());
    HostTensor state = make_host(DType::f32, {1, 1, 4, 4}), o = make_host(DType::f32, {1, 1, 4});
    fill_bytes(state, kPoison), fill_bytes(o, kPoison);
    st.state = st.new_state = state.ref(), st.o = o.ref();
    on_cuda({&st.q, &st.k, &st.v, &st.beta, &st.state, &st.o, &st.new_state});
    expect_clear([&] { deltanet_step(st); }, "no CUDA kernels");
    for (const HostTensor* t : {&state, &o})
      for (unsigned char c : t->bytes) ASSERT_EQ(c, kPoison);
  }
#endif
  {  // device offsets are not read, but what their shape tells is checked: no sequence, T = 4 positions
    Dn s(DType::f32, {1, 4, 1, 4, 4}, 0, DType::f32, {0});
    auto a = s.args();
    a.initial_state = a.final_state = TensorRef{};
    on_cuda({&a.q, &a.k, &a.v, &a.beta, &a.cu_seqlens, &a.o});
    expect_rejected({&s.o}, [&] { deltanet_fwd(a); }, {"deltanet_fwd", "cu_seqlens", "no sequence", "T = 4"});
  }
}

// The CUDA backward needs deltanet_bwd_workspace_size bytes of device scratch. The two-argument form
// (no workspace) and a workspace one byte short are ArgumentErrors (naming the workspace), raised
// before anything is launched: every output, in device memory, keeps its poison. Varlen with int32
// offsets and every output requested, so that the size covers the largest case.
TEST(DeltanetApi, CudaBackwardRefusesAMissingOrShortWorkspaceBeforeWriting) {
  FW_REQUIRE_GPU();
#if FW_WITH_CUDA
  Dn s(DType::f32, {1, 70, 2, 16, 8}, 0, DType::f32, {0, 0, 30, 70}, DType::i32);
  Grads g = make_grads(s, 0);
  DeviceMirror gq(s.q), gk(s.k), gv(s.v), gb(s.beta), gh0(s.h0), gcu(s.cu), gdo(g.dout), gdht(g.dht), gdq(g.dq),
      gdk(g.dk), gdv(g.dv), gdb(g.dbeta), gdh0(g.dh0);
  DeltanetBwdArgs a;
  a.q = gq.ref(s.q), a.k = gk.ref(s.k), a.v = gv.ref(s.v), a.beta = gb.ref(s.beta), a.initial_state = gh0.ref(s.h0);
  a.cu_seqlens = gcu.ref(s.cu), a.do_ = gdo.ref(g.dout), a.dfinal_state = gdht.ref(g.dht);
  a.dq = gdq.ref(g.dq), a.dk = gdk.ref(g.dk), a.dv = gdv.ref(g.dv), a.dbeta = gdb.ref(g.dbeta);
  a.dinitial_state = gdh0.ref(g.dh0);
  const std::size_t need = deltanet_bwd_workspace_size(a);
  ASSERT_GT(need, std::size_t(0)) << "the CUDA backward reports no workspace";
  void* ws = nullptr;
  FW_TEST_CUDA(cudaMalloc(&ws, need));
  auto untouched = [&](const char* when) {
    FW_TEST_CUDA(cudaDeviceSynchronize());
    for (auto [dev, host] : {std::pair{&gdq, &g.dq}, {&gdk, &g.dk}, {&gdv, &g.dv}, {&gdb, &g.dbeta}, {&gdh0, &g.dh0}}) {
      HostTensor back = *host;
      dev->download(back);
      for (unsigned char c : back.bytes) ASSERT_EQ(c, kPoison) << "an output was written before the error: " << when;
    }
  };
  expect_argument_error([&] { deltanet_bwd(a); }, {"deltanet_bwd", "workspace"});
  untouched("no workspace");
  expect_argument_error([&] { deltanet_bwd(a, ws, need - 1); }, {"deltanet_bwd", "workspace"});
  untouched("workspace one byte short");
  expect_argument_error([&] { deltanet_bwd(a, nullptr, need); }, {"deltanet_bwd", "workspace"});
  untouched("null workspace");
  FW_TEST_CUDA(cudaFree(ws));
#endif
}

// A workspace that is not 16-byte aligned is an ArgumentError naming it, before anything runs (the
// kernels move it in 16-byte units). CUDA tensors that are never dereferenced: no GPU needed; a
// build without CUDA kernels refuses CUDA tensors instead.
TEST(DeltanetApi, CudaWorkspaceMustBe16ByteAligned) {
  Dn s(DType::bf16, {1, 70, 2, 64, 64}, 0, DType::bf16);
  DeltanetFwdArgs a = s.args();
  for (TensorRef* t : {&a.q, &a.k, &a.v, &a.beta, &a.initial_state, &a.o, &a.final_state}) t->device = DeviceType::cuda;
  std::vector<float> buf(1024);
  char* misaligned = reinterpret_cast<char*>(buf.data()) + 4;
  try {
    deltanet_fwd(a, misaligned, buf.size() * sizeof(float) - 4);  // far too small, and misaligned
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_TRUE(msg.find("workspace") != std::string::npos || msg.find("CUDA") != std::string::npos) << msg;
  }
#if FW_WITH_CUDA
  const std::size_t need = deltanet_fwd_workspace_size(a);
  ASSERT_GT(need, std::size_t(0)) << "the tensor-core pipeline reports no workspace";
  std::vector<float> big(need / sizeof(float) + 8);
  char* at = reinterpret_cast<char*>(big.data());
  at += (16 - reinterpret_cast<std::uintptr_t>(at) % 16) % 16 + 4;  // 4 bytes past a 16-byte boundary
  expect_argument_error([&] { deltanet_fwd(a, at, need); }, {"deltanet_fwd", "workspace", "16-byte aligned"});
#endif
  EXPECT_TRUE(s.untouched());
}

// wy_inverse (the forward's WY inverse, saved for the backward) exists only in the CUDA tensor-core
// pipeline: anywhere else, and with a wrong dtype, shape, layout or alignment, it is an ArgumentError
// naming it, before anything runs. CUDA tensors that are never dereferenced: no GPU needed.
TEST(DeltanetApi, WyInverseIsCheckedBeforeAnything) {
  {  // CPU tensors: no pipeline, forward and backward
    Dn s(DType::f32, {1, 8, 2, 4, 3}, 0, DType::f32);
    HostTensor wy = make_host(DType::f32, {1, 8, 2, 64});
    auto a = s.args();
    a.wy_inverse = wy.ref();
    expect_rejected({&s.o, &s.ht}, [&] { deltanet_fwd(a); }, {"deltanet_fwd", "wy_inverse", "tensor-core pipeline", "float32"});
    Grads g = make_grads(s, 0);
    auto b = bwd_args(s, g);
    b.wy_inverse = wy.ref();
    expect_rejected({&g.dq, &g.dk, &g.dv, &g.dbeta, &g.dh0}, [&] { deltanet_bwd(b); },
                    {"deltanet_bwd", "wy_inverse", "tensor-core pipeline"});
  }
  Dn s(DType::bf16, {1, 70, 2, 64, 64}, 0, DType::bf16);
  HostTensor wy32 = make_host(DType::f32, {1, 70, 2, 64}), wy16 = make_host(DType::bf16, {1, 70, 2, 64}),
             wy_short = make_host(DType::f32, {1, 70, 2, 32}), wy_big = make_host(DType::f32, {1, 70, 4, 64});
  auto cuda_args = [&](bool split) {
    DeltanetFwdArgs a = s.args();
    a.split_operands = split;
    for (TensorRef* t : {&a.q, &a.k, &a.v, &a.beta, &a.initial_state, &a.o, &a.final_state}) t->device = DeviceType::cuda;
    return a;
  };
  auto on_cuda = [](TensorRef t) {
    t.device = DeviceType::cuda;
    return t;
  };
  std::vector<float> ws(64);
  const char* op = "deltanet_fwd";
  auto expect_fwd = [&](DeltanetFwdArgs a, TensorRef wy, std::initializer_list<const char*> fragments, bool with_ws = true) {
    a.wy_inverse = wy;
    expect_argument_error([&] { with_ws ? deltanet_fwd(a, ws.data(), ws.size() * 4) : deltanet_fwd(a); }, fragments);
  };
  expect_fwd(cuda_args(true), on_cuda(wy16.ref()), {op, "wy_inverse", "float32", "split_operands = true", "bfloat16"});
  expect_fwd(cuda_args(false), on_cuda(wy32.ref()), {op, "wy_inverse", "bfloat16", "split_operands = false"});
  expect_fwd(cuda_args(true), on_cuda(wy_short.ref()), {op, "wy_inverse", "(1, 70, 2, 64)"});
  TensorRef strided = on_cuda(wy_big.ref());  // (1, 70, 2, 64) every other head of a larger buffer
  strided.shape[2] = 2, strided.strides[2] = 2 * 64;
  expect_fwd(cuda_args(true), strided, {op, "wy_inverse", "contiguous"});
  TensorRef misaligned = on_cuda(wy32.ref());
  misaligned.data = static_cast<char*>(misaligned.data) + 4;
  expect_fwd(cuda_args(true), misaligned, {op, "wy_inverse", "16-byte aligned"});
  expect_fwd(cuda_args(true), on_cuda(wy32.ref()), {op, "wy_inverse", "workspace"}, false);
  TensorRef wrong_device = on_cuda(wy32.ref());
  wrong_device.device_index = 1;
  expect_fwd(cuda_args(true), wrong_device, {op, "wy_inverse", "device"});
  {  // K = 160: beyond the pipeline (the CUDA forward itself takes K <= 256)
    Dn w(DType::bf16, {1, 8, 1, 160, 8}, 0, DType::bf16);
    DeltanetFwdArgs a = w.args();
    for (TensorRef* t : {&a.q, &a.k, &a.v, &a.beta, &a.initial_state, &a.o, &a.final_state}) t->device = DeviceType::cuda;
    HostTensor wy = make_host(DType::f32, {1, 8, 1, 64});
    expect_fwd(a, on_cuda(wy.ref()), {op, "wy_inverse", "K <= 128", "K = 160"});
  }
  EXPECT_TRUE(s.untouched());
}

// DType::i32 / i64 exist for index tensors only: the float ops keep rejecting them by name.
TEST(DeltanetApi, IntegerDtypesAreRejectedByTheFloatOps) {
  for (DType it : {DType::i32, DType::i64}) {
    SCOPED_TRACE(dtype_name(it));
    HostTensor x = make_host(it, {4, 8}), y = make_host(it, {4, 8}), w = make_host(DType::f32, {8});
    HostTensor xf = make_host(DType::f32, {4, 8}), yf = make_host(DType::f32, {4, 8}), wi = make_host(it, {8});
    fill_bytes(y, kPoison), fill_bytes(yf, kPoison);
    LayerNormFwdArgs ln;
    ln.x = x.ref(), ln.weight = w.ref(), ln.y = y.ref();
    expect_rejected({&y}, [&] { layernorm_fwd(ln); }, {"layernorm_fwd", "x", dtype_name(it), "not supported"});
    RMSNormFwdArgs rms;
    rms.x = xf.ref(), rms.weight = wi.ref(), rms.y = yf.ref();
    expect_rejected({&yf}, [&] { rmsnorm_fwd(rms); }, {"rmsnorm_fwd", "weight", dtype_name(it)});
    // mLSTM: q, k, v (B, NH, S, D) = (1, 1, 4, 4), gates (1, 1, 4).
    HostTensor qkv = make_host(DType::f32, {1, 1, 4, 4}), c0 = make_host(it, {1, 1, 4, 4});
    MlstmFwdArgs m;
    HostTensor i = make_host(DType::f32, {1, 1, 4}), i_int = make_host(it, {1, 1, 4}), f = make_host(DType::f32, {1, 1, 4}),
               h = make_host(DType::f32, {1, 1, 4, 4}), n0 = make_host(DType::f32, {1, 1, 4}),
               m0 = make_host(DType::f32, {1, 1, 1});
    fill_bytes(h, kPoison);
    m.q = m.k = m.v = qkv.ref(), m.i = i.ref(), m.f = f.ref(), m.h = h.ref();
    m.c_initial = c0.ref(), m.n_initial = n0.ref(), m.m_initial = m0.ref();
    expect_rejected({&h}, [&] { mlstm_fwd(m); }, {"mlstm_fwd", "c_initial", dtype_name(it)});
    m.c_initial = m.n_initial = m.m_initial = TensorRef{};
    m.i = i_int.ref();
    expect_rejected({&h}, [&] { mlstm_fwd(m); }, {"mlstm_fwd", "i", dtype_name(it)});
  }
}

}  // namespace
}  // namespace fwtest
