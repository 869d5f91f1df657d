// bench_deltanet.cpp: verify and time the public DeltaNet ops (fastweight/deltanet.h) for
// fastweight_bench: fixed-length and variable-length (cu_seqlens) batches, the L2-norm option.
// Verification: the op's outputs vs the float64 loop form of the reference on float64 copies of the
// same (rounded) inputs; relative Frobenius error over all outputs. Timing: wall clock, median of 5.
#include <string>

#include "bench_ops.h"
#include "bench_util.h"
#include "reference/deltanet_ref.h"

namespace {
using namespace fwbench;
}  // namespace

int run_deltanet_bench(bool quick, std::vector<BenchRow>& rows) {
  const std::int64_t T = quick ? 128 : 256, H = 2, K = 64, V = 64;
  int failures = 0;
  struct Case { DType dt; bool varlen, l2; };
  for (const Case c : {Case{DType::f32, false, false}, Case{DType::bf16, false, true}, Case{DType::f32, true, true}}) {
    const std::int64_t B = c.varlen ? 1 : 2;
    std::vector<std::int64_t> cu = {0, T / 3, T / 3, T};  // three sequences, one of them empty
    const std::int64_t N = c.varlen ? std::int64_t(cu.size()) - 1 : B;
    std::mt19937_64 rng(7);
    // keys of about unit norm without the in-kernel L2 norm (beta |k|^2 > 2 makes the recurrence blow up)
    const double kr = c.l2 ? 1.0 : 0.2;
    HostBuf q(c.dt, {B, T, H, K}, &rng), k(c.dt, {B, T, H, K}, &rng, -kr, kr), v(c.dt, {B, T, H, V}, &rng);
    HostBuf beta(c.dt, {B, T, H}, &rng, 0.0, 1.0), h0(DType::f32, {N, H, K, V}, &rng, -0.1, 0.1);
    HostBuf o(c.dt, {B, T, H, V}), ht(DType::f32, {N, H, K, V});
    const std::string name = std::string(c.varlen ? "varlen" : "") + (c.varlen && c.l2 ? " " : "") + (c.l2 ? "l2norm" : "");
    const std::string shp = "(" + std::to_string(B) + "," + std::to_string(T) + "," + std::to_string(H) + "," +
                            std::to_string(K) + "," + std::to_string(V) + ")" + (name.empty() ? "" : " " + name);
    TensorRef cur;
    if (c.varlen) cur = make_tensor(cu.data(), DType::i64, {std::int64_t(cu.size())});
    detail::DeltanetShape sh;
    sh.B = B, sh.T = T, sh.H = H, sh.K = K, sh.V = V;
    if (c.varlen) sh.cu_seqlens = cu.data(), sh.N = N;
    detail::DeltanetOptions opt;
    opt.use_qk_l2norm_in_kernel = c.l2;
    const detail::DeltanetInputs in{q.val.data(), k.val.data(), v.val.data(), beta.val.data()};
    const double tol = c.dt == DType::f32 ? 1e-5 : 1e-2;
    try {
      DeltanetFwdArgs a;
      a.q = q.ref(), a.k = k.ref(), a.v = v.ref(), a.beta = beta.ref(), a.initial_state = h0.ref();
      a.cu_seqlens = cur, a.o = o.ref(), a.final_state = ht.ref(), a.use_qk_l2norm_in_kernel = c.l2;
      const double ms = time_ms([&] { deltanet_fwd(a); });
      Vec ro(o.val.size()), rht(ht.val.size());
      detail::deltanet_recurrent_fwd(sh, in, opt, h0.val.data(), ro.data(), rht.data());
      Err e;
      e.add(o.read(), ro);
      if (!(e.value() <= tol)) ++failures;
      rows.push_back({"deltanet_fwd", dtype_name(c.dt), shp, e.value(), ms, "cpu"});
    } catch (const std::exception& ex) {
      std::printf("deltanet_fwd: error: %s\n", ex.what());
      ++failures;
    }
    try {
      HostBuf dout(c.dt, {B, T, H, V}, &rng), dq(c.dt, {B, T, H, K}), dk(c.dt, {B, T, H, K}), dv(c.dt, {B, T, H, V});
      HostBuf db(c.dt, {B, T, H}), dh0(DType::f32, {N, H, K, V});
      DeltanetBwdArgs a;
      a.q = q.ref(), a.k = k.ref(), a.v = v.ref(), a.beta = beta.ref(), a.initial_state = h0.ref();
      a.cu_seqlens = cur, a.do_ = dout.ref(), a.dq = dq.ref(), a.dk = dk.ref(), a.dv = dv.ref(), a.dbeta = db.ref();
      a.dinitial_state = dh0.ref(), a.use_qk_l2norm_in_kernel = c.l2;
      const double ms = time_ms([&] { deltanet_bwd(a); });
      Vec rq(dq.val.size()), rk(dk.val.size()), rv(dv.val.size()), rb(db.val.size()), rh(dh0.val.size());
      detail::deltanet_recurrent_bwd(sh, in, opt, h0.val.data(), dout.val.data(), nullptr,
                                     {rq.data(), rk.data(), rv.data(), rb.data()}, rh.data());
      Err e;
      e.add(dq.read(), rq), e.add(dk.read(), rk), e.add(dv.read(), rv), e.add(db.read(), rb);
      if (!(e.value() <= tol)) ++failures;
      rows.push_back({"deltanet_bwd", dtype_name(c.dt), shp, e.value(), ms, "cpu"});
    } catch (const std::exception& ex) {
      std::printf("deltanet_bwd: error: %s\n", ex.what());
      ++failures;
    }
  }
  return failures;
}
