// test_deltanet_cuda.cpp: the DeltaNet CUDA forward (src/cuda/deltanet) against the float64 loop
// form of the reference, on the GPU (label gpu; skipped, and reported so, without one). The kernel
// is called through the lowering of src/api/deltanet_lower.h with arguments built here, and through
// the public entry point deltanet_fwd (DeltanetCudaApi: strided views, fp16, an explicit scale).
// Checks: o and the final state for fp32 / bf16, T in {1, 63, 100, 1000}, K, V in {64, 100, 128, 256}
// (K != V), L2 norm on / off, initial state, varlen (int32 and int64 offsets, empty sequences),
// outputs poisoned before the run, bitwise determinism.
#include <gtest/gtest.h>

#include <cstdio>
#include <ostream>
#include <random>
#include <string>
#include <utility>
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

// The float64 loop-form reference on the (rounded) inputs: o and the final state.
template <typename Case>  // DnCase or the API test's case: B, T, H, K, V, l2, cu
std::pair<HostTensor, HostTensor> reference(const Case& c, std::int64_t N, const HostTensor& q, const HostTensor& k,
                                            const HostTensor& v, const HostTensor& beta, const HostTensor* h0,
                                            const HostTensor& o, const HostTensor& ht, double scale) {
  HostTensor rq = to_f64(q), rk = to_f64(k), rv = to_f64(v), rb = to_f64(beta);
  HostTensor rh0 = h0 ? to_f64(*h0) : HostTensor{};
  HostTensor ro = make_host(DType::f64, o.shape), rht = make_host(DType::f64, ht.shape);
  fastweight::detail::DeltanetShape sh;
  sh.B = c.B, sh.T = c.T, sh.H = c.H, sh.K = c.K, sh.V = c.V;
  if (!c.cu.empty()) sh.cu_seqlens = c.cu.data(), sh.N = N;
  fastweight::detail::DeltanetOptions opt;
  opt.use_qk_l2norm_in_kernel = c.l2;
  if (scale > 0) opt.scale = scale;
  fastweight::detail::deltanet_recurrent_fwd(sh, {p64(rq), p64(rk), p64(rv), p64(rb)}, opt, h0 ? p64(rh0) : nullptr,
                                             p64(ro), p64(rht));
  return {ro, rht};
}

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
  const auto [ro, rht] = reference(c, N, q, k, v, beta, c.state ? &h0 : nullptr, o, ht, 0.0);
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
  // bf16, K <= 128: version 2 on tensor cores (deltanet_fwd_tc.cu): odd K, V (element loads), T = 1,
  // chunk tails, many chunks, varlen with empty sequences
  for (std::int64_t T : {1, 63, 1000}) v.push_back({DType::bf16, 1, T, 2, 100, 72, true, true, {}, DType::i64});
  v.push_back({DType::bf16, 2, 257, 3, 40, 24, false, false, {}, DType::i64});
  v.push_back({DType::bf16, 1, 150, 2, 128, 128, true, true, {0, 0, 70, 70, 150}, DType::i32});
  return v;
}
INSTANTIATE_TEST_SUITE_P(Cases, DeltanetCudaFwd, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return name_of(info.param); });

// The public entry point (deltanet_fwd in src/api) on CUDA tensors: strided views (rows cut from
// padded buffers, starting one element in), float16 too, beta in float32 beside 16-bit q, an
// explicit scale, varlen with int32 offsets, on a stream of its own. Every element of the views is
// written (poisoned before), nothing outside them is (the padding keeps its poison).
TEST(DeltanetCudaApi, PublicForwardOnStridedViewsMatchesReference) {
  FW_REQUIRE_GPU();
  struct ApiCase {
    DType dt, beta_dt;
    std::int64_t B, T, H, K, V;
    bool l2;
    std::vector<std::int64_t> cu;
  };
  const std::vector<ApiCase> api_cases = {
      {DType::f32, DType::f32, 2, 130, 3, 72, 100, false, {}},
      {DType::bf16, DType::f32, 2, 130, 3, 64, 128, true, {}},
      {DType::f16, DType::f16, 1, 200, 2, 128, 64, true, {0, 1, 65, 65, 200}},
  };
  for (const ApiCase& c : api_cases) {
    SCOPED_TRACE(std::string(dtype_name(c.dt)) + (c.cu.empty() ? "" : " varlen"));
    const std::int64_t N = c.cu.empty() ? c.B : std::int64_t(c.cu.size()) - 1, pad = 5, lead = 1;
    auto strided = [&](DType dt, std::vector<std::int64_t> shape) {
      return make_host(dt, std::move(shape), pad, lead);
    };
    HostTensor q = strided(c.dt, {c.B, c.T, c.H, c.K}), k = strided(c.dt, {c.B, c.T, c.H, c.K}),
               v = strided(c.dt, {c.B, c.T, c.H, c.V}), beta = strided(c.beta_dt, {c.B, c.T, c.H}),
               o = strided(c.dt, {c.B, c.T, c.H, c.V}), h0 = strided(DType::f32, {N, c.H, c.K, c.V}),
               ht = strided(DType::f32, {N, c.H, c.K, c.V}), cu = make_host(DType::i32, {std::int64_t(c.cu.size())});
    std::mt19937_64 rng(31);
    fill_random(q, rng, -1.0, 1.0);
    const double kr = c.l2 ? 1.0 : 1.7 / std::sqrt(double(c.K));
    fill_random(k, rng, -kr, kr);
    fill_random(v, rng, -1.0, 1.0);
    fill_random(beta, rng, 0.0, 1.0);
    fill_random(h0, rng, -0.5, 0.5);
    fill_bytes(o, 0xff), fill_bytes(ht, 0xff);
    for (std::size_t i = 0; i < c.cu.size(); ++i) cu.set(std::int64_t(i), double(c.cu[i]));
    DeviceMirror gq(q), gk(k), gv(v), gb(beta), go(o), gh0(h0), ght(ht), gcu(cu);
    DeltanetFwdArgs a;
    a.q = gq.ref(q), a.k = gk.ref(k), a.v = gv.ref(v), a.beta = gb.ref(beta), a.initial_state = gh0.ref(h0);
    a.o = go.ref(o), a.final_state = ght.ref(ht);
    if (!c.cu.empty()) a.cu_seqlens = gcu.ref(cu);
    a.scale = 0.6, a.use_qk_l2norm_in_kernel = c.l2;
    cudaStream_t stream{};
    FW_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    deltanet_fwd(a, reinterpret_cast<Stream>(stream));
    FW_TEST_CUDA(cudaStreamSynchronize(stream));
    FW_TEST_CUDA(cudaStreamDestroy(stream));
    HostTensor o1 = o, ht1 = ht;
    go.download(o1), ght.download(ht1);
    for (const HostTensor* t : {&o1, &ht1}) {  // the padding (outside the view) keeps its poison
      std::vector<char> in_view(t->bytes.size() / t->esize(), 0);
      for (auto e : t->offsets()) in_view[std::size_t(e)] = 1;
      for (std::size_t e = 0; e < in_view.size(); ++e)
        if (!in_view[e])
          for (std::size_t b = 0; b < t->esize(); ++b) ASSERT_EQ(t->bytes[e * t->esize() + b], 0xff) << "element " << e;
    }
    const auto [ro, rht] = reference(c, N, q, k, v, beta, &h0, o, ht, 0.6);
    const double tol = c.dt == DType::f32 ? 1e-4 : 2e-2;  // as the kernel suite above
    const double eo = rel_err(o1, ro), eh = rel_err(ht1, rht);
    EXPECT_LT(eo, tol) << "o";
    EXPECT_LT(eh, tol) << "final state";
    std::printf("[ measured ] api %-8s%s: o %.2e  final_state %.2e\n", dtype_name(c.dt), c.cu.empty() ? "" : " varlen",
                eo, eh);
  }
}

}  // namespace
}  // namespace fwtest
#endif
