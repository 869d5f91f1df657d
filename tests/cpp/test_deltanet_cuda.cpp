// test_deltanet_cuda.cpp: the DeltaNet CUDA forward (src/cuda/deltanet) against the float64 loop
// form of the reference, on the GPU (label gpu; skipped, and reported so, without one). The kernel
// is called through the lowering of src/api/deltanet_lower.h with arguments built here (the public
// entry point dispatches to it once this suite has passed on a GPU).
// Checks: o and the final state for fp32 / bf16, T in {1, 63, 100, 1000}, K, V in {64, 100, 128, 256}
// (K != V), L2 norm on / off, initial state, varlen (int32 and int64 offsets, empty sequences),
// outputs poisoned before the run, bitwise determinism.
#include <gtest/gtest.h>

#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "api/deltanet_lower.h"
#include "cuda/deltanet/deltanet_cuda.h"
#include "reference/deltanet_ref.h"
#include "test_util.h"

#if FW_WITH_CUDA
namespace fwtest {
namespace {

struct DnCase {
  DType dt;
  std::int64_t B, T, H, K, V;
  bool l2, state;
  std::vector<std::int64_t> cu;  // varlen offsets (B must be 1), empty: fixed length
  DType cu_dt;
};
std::string name_of(const DnCase& c) {
  return std::string(dtype_name(c.dt)) + "_T" + std::to_string(c.T) + "_K" + std::to_string(c.K) + "V" +
         std::to_string(c.V) + (c.l2 ? "_l2" : "") + (c.state ? "_state" : "") +
         (c.cu.empty() ? "" : std::string("_varlen_") + dtype_name(c.cu_dt));
}
// gtest prints a failing case by its name, not as raw bytes
void PrintTo(const DnCase& c, std::ostream* os) { *os << name_of(c); }
double* p64(HostTensor& t) { return static_cast<double*>(t.base()); }

class DeltanetCudaFwd : public ::testing::TestWithParam<DnCase> {};

TEST_P(DeltanetCudaFwd, MatchesReferenceWritesEverythingAndIsDeterministic) {
  FW_REQUIRE_GPU();
  const DnCase c = GetParam();
  const std::int64_t N = c.cu.empty() ? c.B : std::int64_t(c.cu.size()) - 1;
  HostTensor q = make_host(c.dt, {c.B, c.T, c.H, c.K}), k = make_host(c.dt, {c.B, c.T, c.H, c.K}),
             v = make_host(c.dt, {c.B, c.T, c.H, c.V}), beta = make_host(c.dt, {c.B, c.T, c.H}),
             o = make_host(c.dt, {c.B, c.T, c.H, c.V}), h0 = make_host(DType::f32, {N, c.H, c.K, c.V}),
             ht = make_host(DType::f32, {N, c.H, c.K, c.V});
  std::mt19937_64 rng(23);
  fill_random(q, rng, -1.0, 1.0);
  const double kr = c.l2 ? 1.0 : 1.7 / std::sqrt(double(c.K));  // |k| ~ 1 without the L2 norm
  fill_random(k, rng, -kr, kr);
  fill_random(v, rng, -1.0, 1.0);
  fill_random(beta, rng, 0.0, 1.0);
  fill_random(h0, rng, -0.5, 0.5);
  fill_bytes(o, 0xff), fill_bytes(ht, 0xff);
  HostTensor cu = make_host(c.cu_dt, {std::int64_t(std::max<std::size_t>(c.cu.size(), 1))});
  for (std::size_t i = 0; i < c.cu.size(); ++i) cu.set(std::int64_t(i), double(c.cu[i]));
  DeviceMirror gq(q), gk(k), gv(v), gb(beta), go(o), gh0(h0), ght(ht), gcu(cu);
  DeltanetFwdArgs a;
  a.q = gq.ref(q), a.k = gk.ref(k), a.v = gv.ref(v), a.beta = gb.ref(beta), a.o = go.ref(o), a.final_state = ght.ref(ht);
  if (c.state) a.initial_state = gh0.ref(h0);
  if (!c.cu.empty()) a.cu_seqlens = gcu.ref(cu);
  a.use_qk_l2norm_in_kernel = c.l2;
  const auto p = fastweight::detail::lower_deltanet_fwd(a);
  fastweight::detail::deltanet_fwd_cuda(p, nullptr);
  FW_TEST_CUDA(cudaDeviceSynchronize());
  HostTensor o1 = o, ht1 = ht;
  go.download(o1), ght.download(ht1);
  fastweight::detail::deltanet_fwd_cuda(p, nullptr);
  FW_TEST_CUDA(cudaDeviceSynchronize());
  HostTensor o2 = o;
  go.download(o2);
  EXPECT_EQ(o1.bytes, o2.bytes) << "not deterministic";
  // reference (loop form) on the rounded inputs
  HostTensor rq = to_f64(q), rk = to_f64(k), rv = to_f64(v), rb = to_f64(beta), rh0 = to_f64(h0);
  HostTensor ro = make_host(DType::f64, o.shape), rht = make_host(DType::f64, ht.shape);
  fastweight::detail::DeltanetShape sh;
  sh.B = c.B, sh.T = c.T, sh.H = c.H, sh.K = c.K, sh.V = c.V;
  if (!c.cu.empty()) sh.cu_seqlens = c.cu.data(), sh.N = N;
  fastweight::detail::DeltanetOptions opt;
  opt.use_qk_l2norm_in_kernel = c.l2;
  fastweight::detail::deltanet_recurrent_fwd(sh, {p64(rq), p64(rk), p64(rv), p64(rb)}, opt,
                                             c.state ? p64(rh0) : nullptr, p64(ro), p64(rht));
  const double tol = c.dt == DType::f32 ? 1e-4 : 2e-2;
  EXPECT_LT(rel_err(o1, ro), tol) << "o";  // +inf on any NaN: every element written
  EXPECT_LT(rel_err(ht1, rht), c.dt == DType::f32 ? 1e-4 : 2e-2) << "final state";
}

std::vector<DnCase> cases() {
  std::vector<DnCase> v;
  for (DType dt : {DType::f32, DType::bf16}) {
    v.push_back({dt, 2, 100, 3, 64, 64, false, true, {}, DType::i64});
    v.push_back({dt, 1, 300, 2, 128, 256, true, true, {}, DType::i64});
  }
  for (std::int64_t T : {1, 63, 100, 1000}) v.push_back({DType::f32, 1, T, 2, 100, 100, true, T % 2 == 0, {}, DType::i64});
  v.push_back({DType::f32, 1, 200, 2, 256, 64, false, true, {}, DType::i64});
  v.push_back({DType::f32, 1, 150, 2, 64, 128, true, true, {0, 0, 70, 70, 150}, DType::i32});
  v.push_back({DType::f32, 1, 150, 2, 64, 128, false, true, {0, 33, 33, 150}, DType::i64});
  return v;
}
INSTANTIATE_TEST_SUITE_P(Cases, DeltanetCudaFwd, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return name_of(info.param); });

}  // namespace
}  // namespace fwtest
#endif
