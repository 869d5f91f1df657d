// test_deltanet_cuda.cpp: the DeltaNet CUDA kernels (src/cuda/deltanet) against the float64 loop
// form of the reference, on the GPU (label gpu; skipped, and reported so, without one).
// Forward: called through the lowering of src/api/deltanet_lower.h with arguments built here, and
// through the public entry point deltanet_fwd (DeltanetCudaApi: strided views, fp16, an explicit
// scale). Checks: o and the final state for fp32 / bf16, T in {1, 63, 100, 1000, 4097}, K, V in
// {64, 100, 128, 256} (K != V), L2 norm on / off, initial state, varlen (int32 and int64 offsets,
// empty sequences, 2000 sequences of random lengths), outputs poisoned before the run, bitwise
// determinism.
// Backward (DeltanetCudaBwd): the public deltanet_bwd with a cudaMalloc'ed workspace of
// deltanet_bwd_workspace_size bytes (poisoned, so nothing may rely on its contents), on a stream of
// its own: dq, dk, dv, dbeta and dinitial_state each against the loop form's backward (relative
// Frobenius error 1e-4 fp32, 2e-2 bf16), outputs poisoned with NaN bytes before every call, bitwise
// determinism, strided views whose padding must stay untouched, a call asking only some gradients;
// fp16, T = 4097 and 2000 packed sequences too.
// Decoding step (DeltanetCudaStep): the public deltanet_step against the loop form over one
// position, out of place (state left as it was) and in place (new_state == state), L2 on / off.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <tuple>
#include <vector>

#include "api/deltanet_lower.h"
#include "cuda/common/check.cuh"
#include "cuda/common/step_grid.h"
#include "cuda/common/wgmma_probe.h"
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

// Random inputs of a case: keys of norm ~1 without the L2 norm (beta |k|^2 > 2 makes the recurrence
// blow up), beta in [0, 1), a small initial state.
void fill_inputs(std::mt19937_64& rng, bool l2, std::int64_t K, HostTensor& q, HostTensor& k, HostTensor& v,
                 HostTensor& beta, HostTensor& h0) {
  fill_random(q, rng, -1.0, 1.0);
  const double kr = l2 ? 1.0 : 1.7 / std::sqrt(double(K));
  fill_random(k, rng, -kr, kr);
  fill_random(v, rng, -1.0, 1.0);
  fill_random(beta, rng, 0.0, 1.0);
  fill_random(h0, rng, -0.5, 0.5);
}

// wy_inverse as fastweight/deltanet.h defines it, in float64 from the (rounded) k and beta: row
// (b, t, h) holds column i of its chunk's T = (I + strict_lower(K^ K^T) diag(beta))^-1, i = t's row
// in the chunk (chunks of 64 from each sequence's start), zero past the chunk's rows.
HostTensor wy_inverse_reference(const HostTensor& k, const HostTensor& beta, bool l2, const std::vector<std::int64_t>& cu) {
  const std::int64_t B = k.shape[0], T = k.shape[1], H = k.shape[2], K = k.shape[3];
  const std::vector<double> kv = k.values(), bv = beta.values();
  HostTensor out = make_host(DType::f64, {B, T, H, 64});
  std::vector<std::array<std::int64_t, 3>> seqs;  // (b, bos, eos)
  if (cu.empty())
    for (std::int64_t b = 0; b < B; ++b) seqs.push_back({b, 0, T});
  else
    for (std::size_t n = 0; n + 1 < cu.size(); ++n) seqs.push_back({0, cu[n], cu[n + 1]});
  for (const auto& [b, bos, eos] : seqs)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t c0 = bos; c0 < eos; c0 += 64) {
        const int nr = int(std::min<std::int64_t>(64, eos - c0));
        auto row = [&](std::int64_t t) { return (b * T + t) * H + h; };
        std::vector<double> kh(std::size_t(nr * K)), L(std::size_t(nr * nr), 0.0), Tm(std::size_t(nr * nr), 0.0);
        for (int i = 0; i < nr; ++i) {
          double ss = 0.0;
          for (std::int64_t d = 0; d < K; ++d) ss += kv[std::size_t(row(c0 + i) * K + d)] * kv[std::size_t(row(c0 + i) * K + d)];
          const double r = l2 ? 1.0 / std::sqrt(ss + 1e-6) : 1.0;
          for (std::int64_t d = 0; d < K; ++d) kh[std::size_t(i * K + d)] = r * kv[std::size_t(row(c0 + i) * K + d)];
        }
        for (int i = 0; i < nr; ++i)
          for (int j = 0; j < i; ++j) {
            double g = 0.0;
            for (std::int64_t d = 0; d < K; ++d) g += kh[std::size_t(i * K + d)] * kh[std::size_t(j * K + d)];
            L[std::size_t(i * nr + j)] = g * bv[std::size_t(row(c0 + j))];
          }
        for (int col = 0; col < nr; ++col)  // (I + L) T = I, column by column
          for (int r = 0; r < nr; ++r) {
            double x = r == col ? 1.0 : 0.0;
            for (int c = 0; c < r; ++c) x -= L[std::size_t(r * nr + c)] * Tm[std::size_t(c * nr + col)];
            Tm[std::size_t(r * nr + col)] = x;
          }
        for (int i = 0; i < nr; ++i)
          for (int j = 0; j < 64; ++j) out.set(row(c0 + i) * 64 + j, j < nr ? Tm[std::size_t(j * nr + i)] : 0.0);
      }
  return out;
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
  fill_inputs(rng, c.l2, c.K, q, k, v, beta, h0);
  fill_bytes(o, 0xff), fill_bytes(ht, 0xff);
  HostTensor cu = make_host(c.cu_dt, {std::int64_t(std::max<std::size_t>(c.cu.size(), 1))});
  for (std::size_t i = 0; i < c.cu.size(); ++i) cu.set(std::int64_t(i), double(c.cu[i]));
  DeviceMirror gq(q), gk(k), gv(v), gb(beta), go(o), gh0(h0), ght(ht), gcu(cu);
  DeltanetFwdArgs a;
  a.q = gq.ref(q), a.k = gk.ref(k), a.v = gv.ref(v), a.beta = gb.ref(beta), a.o = go.ref(o), a.final_state = ght.ref(ht);
  if (c.state) a.initial_state = gh0.ref(h0);
  if (!c.cu.empty()) a.cu_seqlens = gcu.ref(cu);
  a.use_qk_l2norm_in_kernel = c.l2;
  auto p = fastweight::detail::lower_deltanet_fwd(a);
  // reference (loop form) on the rounded inputs
  const auto [ro, rht] = reference(c, N, q, k, v, beta, c.state ? &h0 : nullptr, o, ht, 0.0);
  const double tol = c.dt == DType::f32 ? 1e-4 : 2e-2;
  // without a workspace (the on-chip kernel), then with one where the tensor-core pipeline applies,
  // its operands as bf16 hi + lo and as bf16 alone, with the state kernel handing D' to the output
  // kernel and (modes 3, 4) X in fp32 instead: the same roundings, so the same bits (the workspace
  // poisoned with 0xff bytes: every read of it must follow a write). Each mode runs twice, the wy
  // kernel with two v tile buffers and then with one, the state kernel on 32-column V tiles with two
  // barriers per chunk step (with bf16 operands on sm_90 warp-specialised: a producer warp loads and
  // stores; two producer warps in mode 2, one in modes 4 and 5) and then on 64-column ones with three
  // (no producer): the same bits again. Mode 5: bf16 operands with Xu in fp32 (the state kernel's
  // fp32 Xu tiles; other roundings, so checked against the reference only).
  const bool prev_xu16 = fastweight::detail::set_deltanet_xu_bf16(false);  // the larger workspace
  const std::size_t need = fastweight::detail::deltanet_fwd_workspace_bytes(p);
  fastweight::detail::set_deltanet_xu_bf16(prev_xu16);
  void* ws = nullptr;
  if (need) FW_TEST_CUDA(cudaMalloc(&ws, need));
  struct Restore {
    bool prev;
    int vbufs, tile;
    bool two, ws;
    int ws_warps;
    bool xu16, vfast, wy_stage, out_stage;
    int dstage;
    ~Restore() {
      fastweight::detail::set_deltanet_out_stage(out_stage);
      fastweight::detail::set_deltanet_state_dstage(dstage);
      fastweight::detail::set_deltanet_wy_stage(wy_stage);
      fastweight::detail::set_deltanet_fwd_dprime(prev);
      fastweight::detail::set_deltanet_wy_vbufs(vbufs);
      fastweight::detail::set_deltanet_state_tile(tile);
      fastweight::detail::set_deltanet_state_two_sync(two);
      fastweight::detail::set_deltanet_state_ws(ws);
      fastweight::detail::set_deltanet_state_ws_warps(ws_warps);
      fastweight::detail::set_deltanet_xu_bf16(xu16);
      fastweight::detail::set_deltanet_out_vfast(vfast);
    }
  } restore{fastweight::detail::set_deltanet_fwd_dprime(true), fastweight::detail::set_deltanet_wy_vbufs(0),
            fastweight::detail::set_deltanet_state_tile(0), fastweight::detail::set_deltanet_state_two_sync(true),
            fastweight::detail::set_deltanet_state_ws(true), fastweight::detail::set_deltanet_state_ws_warps(2),
            fastweight::detail::set_deltanet_xu_bf16(true), fastweight::detail::set_deltanet_out_vfast(true),
            fastweight::detail::set_deltanet_wy_stage(false), fastweight::detail::set_deltanet_out_stage(false),
            fastweight::detail::set_deltanet_state_dstage(false)};
  std::vector<HostTensor> by_mode(2 * 6);  // o, final state of each mode
  for (int m = 0; m < 6; ++m) {
    void* w = m == 0 ? nullptr : ws;
    p.hilo = m == 1 || m == 3;
    fastweight::detail::set_deltanet_fwd_dprime(m < 3 || m == 5);
    fastweight::detail::set_deltanet_xu_bf16(m != 5);
    const char* mode = m == 0   ? "on-chip (no workspace)"
                       : m == 1 ? "pipeline (hi + lo)"
                       : m == 2 ? "pipeline (bf16 operands)"
                       : m == 3 ? "pipeline (hi + lo, X in fp32)"
                       : m == 4 ? "pipeline (bf16 operands, X in fp32)"
                                : "pipeline (bf16 operands, Xu in fp32)";
    if (m == 2) EXPECT_LT(fastweight::detail::deltanet_fwd_workspace_bytes(p), need) << "bf16 operands: less workspace";
    std::vector<HostTensor> runs;
    for (int r = 0; r < 2; ++r) {
      fastweight::detail::set_deltanet_wy_vbufs(r == 0 ? 2 : 1);
      fastweight::detail::set_deltanet_state_tile(r == 0 ? 32 : 64);
      fastweight::detail::set_deltanet_state_two_sync(r == 0);
      fastweight::detail::set_deltanet_state_ws_warps(m >= 4 ? 1 : 2);
      fastweight::detail::set_deltanet_out_vfast(r == 0);  // the output kernel's V tiles neighbours, then a grid apart
      fastweight::detail::set_deltanet_wy_stage(r == 1);  // the wy kernel's staged Xw, Xu stores: the same bits
      fastweight::detail::set_deltanet_out_stage(r == 1);  // the output kernel's staged o rows: the same bits
      // the state kernel's D' rows from its D tile (K = 128): the WS form (run 0: 32 columns, 2 producers)
      // in mode 2, the plain form (run 1: 64 columns) in mode 5; bit-compared with the other run
      fastweight::detail::set_deltanet_state_dstage(m == 5 ? r == 1 : r == 0);
      FW_TEST_CUDA(cudaMemset(go.ptr, 0xff, go.nbytes));
      FW_TEST_CUDA(cudaMemset(ght.ptr, 0xff, ght.nbytes));
      if (w) FW_TEST_CUDA(cudaMemset(w, 0xff, need));
      FW_TEST_CUDA(cudaDeviceSynchronize());
      fastweight::detail::deltanet_fwd_cuda(p, w, nullptr);
      FW_TEST_CUDA(cudaDeviceSynchronize());
      runs.push_back(o), runs.push_back(ht);
      go.download(runs[2 * r]), ght.download(runs[2 * r + 1]);
    }
    EXPECT_EQ(runs[0].bytes, runs[2].bytes) << mode << ": not deterministic (or the wy buffering / state tile changed bits)";
    EXPECT_EQ(runs[1].bytes, runs[3].bytes) << mode << ": final state not deterministic";
    EXPECT_LT(rel_err(runs[0], ro), tol) << mode << ": o";  // +inf on any NaN: every element written
    EXPECT_LT(rel_err(runs[1], rht), tol) << mode << ": final state";
    if (!need) break;  // no pipeline for this case
    by_mode[2 * m] = runs[0], by_mode[2 * m + 1] = runs[1];
    if (m == 3 || m == 4) {  // the D' hand-off changes where a rounding happens, not the rounding
      EXPECT_EQ(by_mode[2 * m].bytes, by_mode[2 * (m - 2)].bytes) << mode << ": o differs from the D' version";
      EXPECT_EQ(by_mode[2 * m + 1].bytes, by_mode[2 * (m - 2) + 1].bytes) << mode << ": final state differs";
    }
  }
  p.hilo = true;
  if (ws) FW_TEST_CUDA(cudaFree(ws));
}

// N random lengths in [0, max_len] (about a tenth of them empty), fixed seed: offsets of a packed batch
// with thousands of sequences.
std::vector<std::int64_t> many_offsets(int N, int max_len, unsigned seed) {
  std::mt19937_64 g(seed);
  std::vector<std::int64_t> off{0};
  for (int n = 0; n < N; ++n) off.push_back(off.back() + (g() % 10 == 0 ? 0 : std::int64_t(g() % max_len) + 1));
  return off;
}

std::vector<DnCase> cases() {
  std::vector<DnCase> v;
  // T = 4097 (64 chunks and a one-row tail); 2000 packed sequences of random lengths
  v.push_back({DType::bf16, 1, 4097, 2, 64, 64, true, true, {}, DType::i64});
  v.push_back({DType::f32, 1, 4097, 1, 64, 64, false, true, {}, DType::i64});
  for (DType dt : {DType::f32, DType::bf16}) {
    const std::vector<std::int64_t> off = many_offsets(2000, 9, 5);
    v.push_back({dt, 1, off.back(), 1, 32, 32, true, true, off, DType::i32});
  }
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
  v.push_back({DType::bf16, 1, 150, 2, 33, 47, true, true, {}, DType::i64});  // odd V: element paths
  v.push_back({DType::bf16, 1, 150, 2, 128, 128, true, true, {0, 0, 70, 70, 150}, DType::i32});
  // 3 and 4 whole chunks: the warp-specialised state kernel's producer fills its 4 buffers up front
  // and never waits on them being free
  v.push_back({DType::bf16, 1, 192, 2, 128, 64, true, true, {}, DType::i64});
  v.push_back({DType::bf16, 2, 256, 1, 64, 32, false, true, {}, DType::i64});
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

// ---- backward ------------------------------------------------------------------------------------
// Every byte of t's storage outside its view (padding) still holds `poison`.
::testing::AssertionResult padding_untouched(const HostTensor& t, unsigned char poison) {
  std::vector<char> in_view(t.bytes.size() / t.esize(), 0);
  for (auto e : t.offsets()) in_view[std::size_t(e)] = 1;
  for (std::size_t e = 0; e < in_view.size(); ++e)
    if (!in_view[e])
      for (std::size_t b = 0; b < t.esize(); ++b)
        if (t.bytes[e * t.esize() + b] != poison) return ::testing::AssertionFailure() << "element " << e << " written";
  return ::testing::AssertionSuccess();
}

enum : unsigned { kDq = 1, kDk = 2, kDv = 4, kDbeta = 8, kDh0 = 16, kAllGrads = 31 };

struct DnBwdCase {
  DType dt;
  std::int64_t B, T, H, K, V;
  bool l2, state, dht;           // L2 norm; initial_state given (and dinitial_state asked); dfinal_state given
  std::vector<std::int64_t> cu;  // varlen offsets (B must be 1), empty: fixed length
  DType cu_dt;
  unsigned grads;                // the gradients asked for (kDq | ...); kDh0 needs `state`
  std::int64_t pad;              // > 0: every tensor a strided view (rows padded, one element in)
  bool split = true;             // split_operands (false: bf16-only tensor-core operands)
};
std::string name_of(const DnBwdCase& c) {
  std::string n = std::string(dtype_name(c.dt)) + "_T" + std::to_string(c.T) + "_K" + std::to_string(c.K) + "V" +
                  std::to_string(c.V) + (c.l2 ? "_l2" : "") + (c.state ? "_state" : "") + (c.dht ? "_dht" : "") +
                  (c.cu.empty() ? "" : std::string("_varlen_") + dtype_name(c.cu_dt)) + (c.pad ? "_strided" : "") +
                  (c.split ? "" : "_bf16ops");
  if (c.grads != kAllGrads) {
    n += "_only";
    const char* names[] = {"dq", "dk", "dv", "dbeta", "dh0"};
    for (int b = 0; b < 5; ++b)
      if (c.grads & (1u << b)) n += std::string("_") + names[b];
  }
  return n;
}
void PrintTo(const DnBwdCase& c, std::ostream* os) { *os << name_of(c); }

class DeltanetCudaBwd : public ::testing::TestWithParam<DnBwdCase> {};

void check_bwd_case(const DnBwdCase& c);

TEST_P(DeltanetCudaBwd, PublicBackwardMatchesReferenceWritesEverythingAndIsDeterministic) {
  FW_REQUIRE_GPU();
  check_bwd_case(GetParam());
}

// With bf16 operands and V % 8 == 0 the backward keeps X and the Y region as bf16 (DnBwdWs::xb) and
// the wy kernel writes Xu as bf16 (DnChunkBufs::xu16); the fp32 X / Y / Xu paths they replaced there
// (the ones V % 8 != 0 takes) must still match with the switches off.
TEST(DeltanetCudaBwdXf32, Bf16OperandsWithFp32XYMatchReference) {
  FW_REQUIRE_GPU();
  struct Restore {
    bool prev, prev_xu;
    ~Restore() {
      fastweight::detail::set_deltanet_bwd_x_bf16(prev);
      fastweight::detail::set_deltanet_xu_bf16(prev_xu);
    }
  } restore{fastweight::detail::set_deltanet_bwd_x_bf16(false), fastweight::detail::set_deltanet_xu_bf16(false)};
  {  // the switch does select the path (K = V = 128, bf16 operands: the shape below)
    fastweight::detail::DeltanetParams p;
    p.K = 128, p.V = 128, p.hilo = false;
    EXPECT_FALSE(fastweight::detail::deltanet_bwd_x_bf16(p));
    fastweight::detail::set_deltanet_bwd_x_bf16(true);
    EXPECT_TRUE(fastweight::detail::deltanet_bwd_x_bf16(p));
    p.V = 100;  // rows of V % 8 != 0: never
    EXPECT_FALSE(fastweight::detail::deltanet_bwd_x_bf16(p));
    p.V = 128, p.hilo = true;  // hi + lo operands: never
    EXPECT_FALSE(fastweight::detail::deltanet_bwd_x_bf16(p));
    fastweight::detail::set_deltanet_bwd_x_bf16(false);
    p.hilo = false, p.q.dtype = p.k.dtype = p.v.dtype = DType::bf16;  // Xu: the tensor-core pipeline's inputs
    EXPECT_FALSE(fastweight::detail::deltanet_xu_bf16(p));
    fastweight::detail::set_deltanet_xu_bf16(true);
    EXPECT_TRUE(fastweight::detail::deltanet_xu_bf16(p));
    fastweight::detail::set_deltanet_xu_bf16(false);
  }
  check_bwd_case({DType::bf16, 1, 150, 2, 128, 128, true, true, true, {}, DType::i64, kAllGrads, 0, false});
  check_bwd_case({DType::bf16, 1, 150, 2, 64, 72, true, true, true, {0, 0, 70, 70, 150}, DType::i32, kAllGrads, 0, false});
}

// sm_80 opts in to 166912 bytes of shared memory per block: with that cap the bf16 K = 128 backward
// takes the CUDA-core state and chunk passes after the tensor-core recompute (whose state kernel
// drops its Xu tiles), the path an A100 takes, and must still match the reference.
TEST(DeltanetCudaSmemCap, Sm80SharedMemoryPathsMatchReference) {
  FW_REQUIRE_GPU();
  struct Restore {
    std::size_t prev;
    ~Restore() { fastweight::detail::cap_smem_per_block_optin(prev); }
  } restore{fastweight::detail::cap_smem_per_block_optin(166912)};
  check_bwd_case({DType::bf16, 1, 150, 2, 128, 128, true, true, true, {}, DType::i64, kAllGrads, 0});
  // bf16-only operands: the serial kernel's smaller layout fits there, so the tensor-core passes run
  check_bwd_case({DType::bf16, 1, 150, 2, 128, 128, true, true, true, {}, DType::i64, kAllGrads, 0, false});
  check_bwd_case({DType::bf16, 1, 150, 2, 100, 72, true, true, true, {0, 0, 70, 70, 150}, DType::i32, kAllGrads, 0});
}

void check_bwd_case(const DnBwdCase& c) {
  const std::int64_t N = c.cu.empty() ? c.B : std::int64_t(c.cu.size()) - 1;
  const std::int64_t lead = c.pad ? 1 : 0;
  auto host = [&](DType dt, std::vector<std::int64_t> shape) { return make_host(dt, std::move(shape), c.pad, lead); };
  HostTensor q = host(c.dt, {c.B, c.T, c.H, c.K}), k = host(c.dt, {c.B, c.T, c.H, c.K}),
             v = host(c.dt, {c.B, c.T, c.H, c.V}), beta = host(c.dt, {c.B, c.T, c.H}),
             h0 = host(DType::f32, {N, c.H, c.K, c.V}), dout = host(c.dt, {c.B, c.T, c.H, c.V}),
             dht = host(DType::f32, {N, c.H, c.K, c.V});
  // outputs; poisoned with 0xff bytes (NaN in every float dtype): each element of a view must be written
  HostTensor dq = host(c.dt, {c.B, c.T, c.H, c.K}), dk = host(c.dt, {c.B, c.T, c.H, c.K}),
             dv = host(c.dt, {c.B, c.T, c.H, c.V}), dbeta = host(c.dt, {c.B, c.T, c.H}),
             dh0 = host(DType::f32, {N, c.H, c.K, c.V});
  std::mt19937_64 rng(41);
  fill_inputs(rng, c.l2, c.K, q, k, v, beta, h0);
  fill_random(dout, rng, -1.0, 1.0);
  fill_random(dht, rng, -1.0, 1.0);
  HostTensor* outs[] = {&dq, &dk, &dv, &dbeta, &dh0};
  const char* names[] = {"dq", "dk", "dv", "dbeta", "dinitial_state"};
  for (HostTensor* t : outs) fill_bytes(*t, 0xff);
  HostTensor cu = make_host(c.cu_dt, {std::int64_t(std::max<std::size_t>(c.cu.size(), 1))});
  for (std::size_t i = 0; i < c.cu.size(); ++i) cu.set(std::int64_t(i), double(c.cu[i]));
  DeviceMirror gq(q), gk(k), gv(v), gb(beta), gh0(h0), gdo(dout), gdht(dht), gcu(cu), gdq(dq), gdk(dk), gdv(dv),
      gdb(dbeta), gdh0(dh0);
  DeviceMirror* gouts[] = {&gdq, &gdk, &gdv, &gdb, &gdh0};
  DeltanetBwdArgs a;
  a.q = gq.ref(q), a.k = gk.ref(k), a.v = gv.ref(v), a.beta = gb.ref(beta), a.do_ = gdo.ref(dout);
  if (c.state) a.initial_state = gh0.ref(h0);
  if (c.dht) a.dfinal_state = gdht.ref(dht);
  if (!c.cu.empty()) a.cu_seqlens = gcu.ref(cu);
  TensorRef* arefs[] = {&a.dq, &a.dk, &a.dv, &a.dbeta, &a.dinitial_state};
  for (int e = 0; e < 5; ++e)
    if (c.grads & (1u << e)) *arefs[e] = gouts[e]->ref(*outs[e]);
  a.use_qk_l2norm_in_kernel = c.l2;
  a.split_operands = c.split;

  const std::size_t need = deltanet_bwd_workspace_size(a);
  void* ws = nullptr;
  FW_TEST_CUDA(cudaMalloc(&ws, std::max<std::size_t>(need, 1)));
  cudaStream_t stream{};
  FW_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // Two calls, each on poisoned outputs; the workspace holds 0xff bytes before the first and zeros
  // before the second: the results may depend on neither. The second call also runs the serial
  // kernels with their other buffering (the recomputing wy kernel with one v tile buffer instead of
  // two; bf16 operands: the backward serial kernel's q / Xw single-buffered) and the recomputing state
  // kernel on 64-column V tiles instead of 32, and the recompute's state kernel after the state
  // pass's prep + serial kernels on one stream where the first call ran it beside them on a second,
  // the serial kernels' chunk steps with three barriers where the first call's had two, and the chunk
  // pass's K tiles a grid apart where the first call's were neighbours, and (bf16 operands) the backward
  // serial kernel on the DB2 path where the first call's was warp-specialised, and the L2-norm
  // backward in its own kernel where the first call's was fused into the chunk pass, and the post
  // kernel's V tiles loaded one by one where the first call's loaded them all at its start: the same bits.
  struct RestoreBuffering {
    int vbufs;
    bool db2;
    int tile, overlap;
    bool two, kfast, wy_side, serial_ws;
    int chunk_l2;
    bool post_pf;
    int recompute_ws, serial_rs;
    bool rs_storer, rs_t1, rs_qraw, rs_lfast, rs_x1first, rs_slean, rs_defer, rs_wide;
    int rs_tma;
    int dstage;
    bool t2v4, prep_stage, post_stage, chunk_stage, wy_stage;
    ~RestoreBuffering() {
      fastweight::detail::set_deltanet_wy_vbufs(vbufs);
      fastweight::detail::set_deltanet_bwd_serial_db2(db2);
      fastweight::detail::set_deltanet_state_tile(tile);
      fastweight::detail::set_deltanet_bwd_overlap(overlap);
      fastweight::detail::set_deltanet_state_two_sync(two);
      fastweight::detail::set_deltanet_bwd_chunk_kfast(kfast);
      fastweight::detail::set_deltanet_bwd_wy_side(wy_side);
      fastweight::detail::set_deltanet_bwd_serial_ws(serial_ws);
      fastweight::detail::set_deltanet_bwd_chunk_l2(chunk_l2);
      fastweight::detail::set_deltanet_bwd_post_prefetch(post_pf);
      fastweight::detail::set_deltanet_bwd_recompute_ws(recompute_ws);
      fastweight::detail::set_deltanet_bwd_serial_rs(serial_rs);
      fastweight::detail::set_deltanet_bwd_serial_rs_storer(rs_storer);
      fastweight::detail::set_deltanet_bwd_serial_rs_t1(rs_t1);
      fastweight::detail::set_deltanet_bwd_serial_rs_qraw(rs_qraw);
      fastweight::detail::set_deltanet_bwd_serial_rs_lfast(rs_lfast);
      fastweight::detail::set_deltanet_bwd_serial_rs_x1first(rs_x1first);
      fastweight::detail::set_deltanet_bwd_serial_rs_slean(rs_slean);
      fastweight::detail::set_deltanet_bwd_serial_rs_defer(rs_defer);
      fastweight::detail::set_deltanet_bwd_serial_rs_wide(rs_wide);
      fastweight::detail::set_deltanet_bwd_serial_rs_tma(rs_tma);
      fastweight::detail::set_deltanet_state_dstage(dstage);
      fastweight::detail::set_deltanet_wy_t2v4(t2v4);
      fastweight::detail::set_deltanet_bwd_prep_stage(prep_stage);
      fastweight::detail::set_deltanet_bwd_post_stage(post_stage);
      fastweight::detail::set_deltanet_bwd_chunk_stage(chunk_stage);
      fastweight::detail::set_deltanet_wy_stage(wy_stage);
    }
  } restore_buffering{fastweight::detail::set_deltanet_wy_vbufs(0), fastweight::detail::set_deltanet_bwd_serial_db2(true),
                      fastweight::detail::set_deltanet_state_tile(0), fastweight::detail::set_deltanet_bwd_overlap(0),
                      fastweight::detail::set_deltanet_state_two_sync(true),
                      fastweight::detail::set_deltanet_bwd_chunk_kfast(true),
                      fastweight::detail::set_deltanet_bwd_wy_side(true),
                      fastweight::detail::set_deltanet_bwd_serial_ws(false),
                      fastweight::detail::set_deltanet_bwd_chunk_l2(2),
                      fastweight::detail::set_deltanet_bwd_post_prefetch(true),
                      fastweight::detail::set_deltanet_bwd_recompute_ws(2),
                      fastweight::detail::set_deltanet_bwd_serial_rs(0),
                      fastweight::detail::set_deltanet_bwd_serial_rs_storer(false),
                      fastweight::detail::set_deltanet_bwd_serial_rs_t1(false),
                      fastweight::detail::set_deltanet_bwd_serial_rs_qraw(false),
                      fastweight::detail::set_deltanet_bwd_serial_rs_lfast(false),
                      fastweight::detail::set_deltanet_bwd_serial_rs_x1first(false),
                      fastweight::detail::set_deltanet_bwd_serial_rs_slean(false),
                      fastweight::detail::set_deltanet_bwd_serial_rs_defer(false),
                      fastweight::detail::set_deltanet_bwd_serial_rs_wide(false),
                      fastweight::detail::set_deltanet_bwd_serial_rs_tma(0),
                      fastweight::detail::set_deltanet_state_dstage(false),
                      fastweight::detail::set_deltanet_wy_t2v4(false),
                      fastweight::detail::set_deltanet_bwd_prep_stage(false),
                      fastweight::detail::set_deltanet_bwd_post_stage(false),
                      fastweight::detail::set_deltanet_bwd_chunk_stage(false),
                      fastweight::detail::set_deltanet_wy_stage(false)};
  // Runs 2 and 3: the serial kernel with dS in registers (deltanet_bwd_rs.cu, where it applies; other
  // products' order, so checked against the reference, and run 3 against run 2 bit for bit) with 2
  // then 4 chain warps per CTA (and run 3 with its storer warp and the lean row stores), the rest as
  // run 0, then as run 1. Runs 5, 7 and 9 below take the lean row stores too.
  // Runs 4 and 5: its wgmma form (sm_90a binaries; elsewhere the mma.sync form again), likewise (run 5,
  // with one transposition tile per warp, a deeper ring, the unrolled loads and X1 issued first, against
  // run 4 bit for bit).
  // Runs 6 and 7: the wgmma form reading q itself (no Q^ from prep; other roundings: against the
  // reference, and run 7, with T1 and the unrolled loads, against run 6 bit for bit).
  // Run 8: the mma.sync form reading q itself (4 chain warps, as run 3 without the storer): against the
  // reference (the form non-sm_90a binaries take).
  // Run 9: run 6 with X1 first and the unrolled loads: against run 6 bit for bit.
  // Run 10: run 9 with each step's stores deferred into the next step: against run 6 bit for bit.
  // Run 11: run 10 with the CTA's tile pair stored as whole rows: against run 6 bit for bit.
  // Run 12: run 11 with that pair swizzled and stored by tensor-map stores: against run 6 bit for bit.
  std::vector<HostTensor> run[13];
  int rs_launch[13];  // the serial kernel with dS in registers: its instance (+ 8 with qraw), -1: not launched
  for (int r = 0; r < 13; ++r) {
    fastweight::detail::set_deltanet_bwd_serial_rs(r == 2 ? 2 : r == 3 || r == 8 ? 4 : r >= 4 ? 5 : 0);
    fastweight::detail::set_deltanet_bwd_serial_rs_storer(r == 3);
    fastweight::detail::set_deltanet_bwd_serial_rs_t1(r == 5 || r == 7);  // one transposition tile, 3-4 buffers: the same bits
    fastweight::detail::set_deltanet_bwd_serial_rs_qraw(r >= 6);
    fastweight::detail::set_deltanet_bwd_serial_rs_lfast(r == 5 || r == 7 || r == 9 || r == 10);  // the unrolled whole-chunk loads: the same bits
    fastweight::detail::set_deltanet_bwd_serial_rs_x1first(r == 5 || r >= 9);  // X1 issued first (own instances): the same bits
    fastweight::detail::set_deltanet_bwd_serial_rs_slean(r == 3 || r == 5 || r == 7 || r == 9 || r == 10);  // the lean row stores (run 3: the storer's): the same bits
    fastweight::detail::set_deltanet_bwd_serial_rs_defer(r >= 10);  // the stores a step later (instance 5): the same bits
    fastweight::detail::set_deltanet_bwd_serial_rs_wide(r >= 11);  // whole-row stores (instance 7): the same bits
    fastweight::detail::set_deltanet_bwd_serial_rs_tma(r == 12 ? 1 : 0);  // ... by tensor-map stores (instance 8, reported 16)
    // the recompute's X rows through an X tile (K = 128): the WS form in run 0 (against run 1), the plain
    // form in run 4 (against run 5)
    fastweight::detail::set_deltanet_state_dstage(r == 0 || r == 4);
    fastweight::detail::set_deltanet_wy_t2v4(r == 1);  // hi + lo: the recompute's fp32 T2 rows as 16-byte stores (against run 0)
    fastweight::detail::set_deltanet_bwd_prep_stage(r == 0 || r == 4 || r == 6);  // prep's staged dD0: the same bits
    fastweight::detail::set_deltanet_bwd_post_stage(r == 0 || r == 4 || r == 6);  // post's staged -Y, dv: the same bits
    fastweight::detail::set_deltanet_bwd_chunk_stage(r == 0 || r == 4 || r == 6);  // the chunk pass's staged dq^, dk^ (K = 128, L2)
    fastweight::detail::set_deltanet_wy_stage(r == 0 || r == 4 || r == 6);  // the recompute's staged Xw, Xu
    if (r >= 2) {
      fastweight::detail::set_deltanet_wy_vbufs(0);
      fastweight::detail::set_deltanet_state_tile(0);
      fastweight::detail::set_deltanet_bwd_overlap(r % 2 == 0 ? 1 : -1);
      fastweight::detail::set_deltanet_bwd_chunk_l2(1);
      fastweight::detail::set_deltanet_bwd_post_prefetch(false);
      fastweight::detail::set_deltanet_bwd_recompute_ws(1);
      fastweight::detail::set_deltanet_bwd_serial_ws(false);
      fastweight::detail::set_deltanet_bwd_serial_db2(true);
      fastweight::detail::set_deltanet_state_two_sync(true);
      fastweight::detail::set_deltanet_bwd_chunk_kfast(true);
    } else {
      fastweight::detail::set_deltanet_wy_vbufs(r == 0 ? 2 : 1);
      fastweight::detail::set_deltanet_bwd_serial_db2(r == 0);
      fastweight::detail::set_deltanet_bwd_serial_ws(r == 0);  // off by default: run 0 keeps it bit-tested
      fastweight::detail::set_deltanet_state_tile(r == 0 ? 32 : 64);
      fastweight::detail::set_deltanet_bwd_overlap(r == 0 ? 1 : -1);
      fastweight::detail::set_deltanet_state_two_sync(r == 0);
      fastweight::detail::set_deltanet_bwd_chunk_kfast(r == 0);
      fastweight::detail::set_deltanet_bwd_chunk_l2(r == 0 ? 2 : 0);  // the L2-norm backward fused (pairs too), then its own kernel
      fastweight::detail::set_deltanet_bwd_post_prefetch(r == 0);  // post's V tiles at its start, then one by one
      fastweight::detail::set_deltanet_bwd_recompute_ws(r == 0 ? 2 : 0);  // the recompute warp-specialised, then not
    }
    for (DeviceMirror* g : gouts) FW_TEST_CUDA(cudaMemset(g->ptr, 0xff, g->nbytes));
    FW_TEST_CUDA(cudaMemset(ws, r % 2 == 0 ? 0xff : 0x00, need));
    FW_TEST_CUDA(cudaDeviceSynchronize());  // the memsets run on the legacy stream, not on `stream`
    (void)fastweight::detail::deltanet_bwd_serial_rs_last_launch(-1);
    deltanet_bwd(a, ws, need, reinterpret_cast<Stream>(stream));
    FW_TEST_CUDA(cudaStreamSynchronize(stream));
    rs_launch[r] = fastweight::detail::deltanet_bwd_serial_rs_last_launch(-1);
    for (int e = 0; e < 5; ++e) {
      run[r].push_back(*outs[e]);
      gouts[e]->download(run[r].back());
    }
  }
  // The runs took the kernels they asked for: none in runs 0 and 1; where runs 4 and 5 launched it,
  // run 6 the same instance with qraw (+ 8: q's rows are aligned wherever k's are); where run 4 took
  // the wgmma form (1): T1 with X1 first in run 5 (4), T1 in run 7 (2 + 8), X1 first in run 9 (3 + 8).
  // (Which runs apply at all depends on the shared memory: under the sm_80 cap 2 chain warps fit and 4
  // do not.)
  EXPECT_EQ(rs_launch[0], -1);
  EXPECT_EQ(rs_launch[1], -1);
  EXPECT_EQ(rs_launch[6] >= 0, rs_launch[4] >= 0);
  EXPECT_EQ(rs_launch[8] >= 0, rs_launch[3] >= 0);
  if (rs_launch[3] >= 0) EXPECT_EQ(rs_launch[8], rs_launch[3] + 8) << "qraw planned (mma.sync form)";
  if (rs_launch[4] >= 0) {
    EXPECT_EQ(rs_launch[6], rs_launch[4] + 8) << "qraw planned";
    if (rs_launch[4] == 1) {
      EXPECT_EQ(rs_launch[5], 4) << "T1 with X1 first where the wgmma form runs";
      EXPECT_EQ(rs_launch[7], 2 + 8) << "T1, qraw";
      EXPECT_EQ(rs_launch[9], 3 + 8) << "X1 first, qraw";
      EXPECT_EQ(rs_launch[10], 5 + 8) << "X1 first, deferred stores, qraw";
      EXPECT_EQ(rs_launch[11], 7 + 8) << "X1 first, deferred whole-row stores, qraw";
      // tensor-map stores where V fills a 64-column box, else WIDE's
      EXPECT_EQ(rs_launch[12], (c.V >= 64 ? 16 : 7) + 8) << "X1 first, deferred tensor-map stores, qraw";
    }
  }
  EXPECT_EQ(rs_launch[9] >= 0, rs_launch[4] >= 0);
  EXPECT_EQ(rs_launch[10] >= 0, rs_launch[4] >= 0);
  EXPECT_EQ(rs_launch[11] >= 0, rs_launch[4] >= 0);
  EXPECT_EQ(rs_launch[12] >= 0, rs_launch[4] >= 0);
  // Where the tensor-core pipeline runs: the forward's wy_inverse (through the public forward, with a
  // workspace) given to the backward, which then reads it instead of forming it: the same bits as
  // run 0 (same buffering; the recompute's wy kernel before the fork instead of beside prep), and a
  // workspace no larger
  std::vector<HostTensor> run_wy;
  if (c.dt == DType::bf16 && c.K <= 128) {
    HostTensor o = make_host(c.dt, {c.B, c.T, c.H, c.V});
    HostTensor wy = make_host(c.split ? DType::f32 : DType::bf16, {c.B, c.T, c.H, 64});
    fill_bytes(wy, 0xff);
    DeviceMirror go(o), gwy(wy);
    DeltanetFwdArgs f;
    f.q = a.q, f.k = a.k, f.v = a.v, f.beta = a.beta, f.initial_state = a.initial_state, f.cu_seqlens = a.cu_seqlens;
    f.o = go.ref(o), f.use_qk_l2norm_in_kernel = c.l2, f.split_operands = c.split, f.wy_inverse = gwy.ref(wy);
    const std::size_t fneed = deltanet_fwd_workspace_size(f);
    void* fws = nullptr;
    FW_TEST_CUDA(cudaMalloc(&fws, std::max<std::size_t>(fneed, 1)));
    deltanet_fwd(f, fws, fneed, reinterpret_cast<Stream>(stream));
    FW_TEST_CUDA(cudaStreamSynchronize(stream));
    FW_TEST_CUDA(cudaFree(fws));
    gwy.download(wy);
    // every element written (0xff bytes are NaN), the defined values
    EXPECT_LT(rel_err(wy, wy_inverse_reference(k, beta, c.l2, c.cu)), c.split ? 1e-4 : 1e-2) << "wy_inverse";
    {  // the forward's o does not depend on whether it writes wy_inverse
      HostTensor o2 = o;
      DeviceMirror go2(o2);
      DeltanetFwdArgs f2 = f;
      f2.o = go2.ref(o2), f2.wy_inverse = TensorRef{};
      void* fws2 = nullptr;
      const std::size_t fneed2 = deltanet_fwd_workspace_size(f2);
      FW_TEST_CUDA(cudaMalloc(&fws2, std::max<std::size_t>(fneed2, 1)));
      deltanet_fwd(f2, fws2, fneed2, reinterpret_cast<Stream>(stream));
      FW_TEST_CUDA(cudaStreamSynchronize(stream));
      FW_TEST_CUDA(cudaFree(fws2));
      go.download(o), go2.download(o2);
      EXPECT_EQ(o.bytes, o2.bytes) << "o differs with wy_inverse written";
    }
    a.wy_inverse = gwy.ref(wy);
    const std::size_t need_wy = deltanet_bwd_workspace_size(a);
    EXPECT_LE(need_wy, need) << "the given wy_inverse should not grow the workspace";
    fastweight::detail::set_deltanet_wy_vbufs(2);
    fastweight::detail::set_deltanet_bwd_serial_db2(true);
    fastweight::detail::set_deltanet_state_tile(32);
    fastweight::detail::set_deltanet_bwd_overlap(1);
    fastweight::detail::set_deltanet_state_two_sync(true);
    fastweight::detail::set_deltanet_bwd_chunk_kfast(true);
    fastweight::detail::set_deltanet_bwd_wy_side(false);  // the overlap's other schedule (restored on exit)
    fastweight::detail::set_deltanet_bwd_serial_ws(false);  // the DB2 path: run 0's WS kernel against it, bit for bit
    fastweight::detail::set_deltanet_bwd_chunk_l2(1);       // the default (K <= 64 fused, else its own kernel)
    fastweight::detail::set_deltanet_bwd_post_prefetch(true);
    fastweight::detail::set_deltanet_bwd_recompute_ws(2);
    fastweight::detail::set_deltanet_bwd_serial_rs(0);
    for (DeviceMirror* g : gouts) FW_TEST_CUDA(cudaMemset(g->ptr, 0xff, g->nbytes));
    FW_TEST_CUDA(cudaMemset(ws, 0xff, need));
    FW_TEST_CUDA(cudaDeviceSynchronize());
    deltanet_bwd(a, ws, need_wy, reinterpret_cast<Stream>(stream));
    FW_TEST_CUDA(cudaStreamSynchronize(stream));
    for (int e = 0; e < 5; ++e) {
      run_wy.push_back(*outs[e]);
      gouts[e]->download(run_wy.back());
    }
    a.wy_inverse = TensorRef{};
  }
  FW_TEST_CUDA(cudaStreamDestroy(stream));
  FW_TEST_CUDA(cudaFree(ws));

  // the loop form's backward on float64 copies of the (rounded) inputs
  HostTensor rq = to_f64(q), rk = to_f64(k), rv = to_f64(v), rb = to_f64(beta), rh0 = to_f64(h0),
             rdo = to_f64(dout), rdht = to_f64(dht);
  HostTensor ref[] = {make_host(DType::f64, q.shape), make_host(DType::f64, k.shape), make_host(DType::f64, v.shape),
                      make_host(DType::f64, beta.shape), make_host(DType::f64, h0.shape)};
  fastweight::detail::DeltanetShape sh;
  sh.B = c.B, sh.T = c.T, sh.H = c.H, sh.K = c.K, sh.V = c.V;
  if (!c.cu.empty()) sh.cu_seqlens = c.cu.data(), sh.N = N;
  fastweight::detail::DeltanetOptions opt;
  opt.use_qk_l2norm_in_kernel = c.l2;
  fastweight::detail::deltanet_recurrent_bwd(sh, {p64(rq), p64(rk), p64(rv), p64(rb)}, opt,
                                             c.state ? p64(rh0) : nullptr, p64(rdo), c.dht ? p64(rdht) : nullptr,
                                             {p64(ref[0]), p64(ref[1]), p64(ref[2]), p64(ref[3])}, p64(ref[4]));

  const double tol = c.dt == DType::f32 ? 1e-4 : 2e-2;
  std::printf("[ measured ] bwd %s:", name_of(c).c_str());
  int checked = 0;
  for (int e = 0; e < 5; ++e) {
    if (!(c.grads & (1u << e))) {
      EXPECT_EQ(run[0][e].bytes, std::vector<unsigned char>(run[0][e].bytes.size(), 0xff))
          << names[e] << " was not asked for but written";
      continue;
    }
    const double err = rel_err(run[0][e], ref[e]);  // +inf on any NaN: every element written
    const double err_rs = rel_err(run[2][e], ref[e]), err_wg = rel_err(run[4][e], ref[e]);
    const double err_q = rel_err(run[6][e], ref[e]), err_q8 = rel_err(run[8][e], ref[e]);
    EXPECT_LT(err, tol) << names[e];
    EXPECT_LT(err_rs, tol) << names[e] << " (dS in registers)";
    EXPECT_EQ(run[0][e].bytes, run[1][e].bytes) << names[e] << ": not deterministic (or differs with the other buffering)";
    EXPECT_EQ(run[2][e].bytes, run[3][e].bytes) << names[e] << ": dS in registers: not deterministic (or differs with 4 chain warps)";
    EXPECT_LT(err_wg, tol) << names[e] << " (dS in registers, wgmma)";
    EXPECT_EQ(run[4][e].bytes, run[5][e].bytes) << names[e] << ": dS in registers, wgmma: not deterministic";
    EXPECT_TRUE(padding_untouched(run[4][e], 0xff)) << names[e] << ": written outside its view (wgmma)";
    EXPECT_LT(err_q, tol) << names[e] << " (dS in registers, wgmma, q read by the serial kernel)";
    EXPECT_EQ(run[6][e].bytes, run[7][e].bytes) << names[e] << ": q read by the serial kernel: not deterministic (or T1 changed bits)";
    EXPECT_EQ(run[6][e].bytes, run[9][e].bytes) << names[e] << ": q read by the serial kernel: X1 first changed bits";
    EXPECT_EQ(run[6][e].bytes, run[10][e].bytes) << names[e] << ": q read by the serial kernel: the deferred stores changed bits";
    EXPECT_EQ(run[6][e].bytes, run[11][e].bytes) << names[e] << ": q read by the serial kernel: the whole-row stores changed bits";
    EXPECT_EQ(run[6][e].bytes, run[12][e].bytes) << names[e] << ": q read by the serial kernel: the tensor-map stores changed bits";
    EXPECT_TRUE(padding_untouched(run[6][e], 0xff)) << names[e] << ": written outside its view (q read by the serial kernel)";
    EXPECT_LT(err_q8, tol) << names[e] << " (dS in registers, mma.sync, q read by the serial kernel)";
    EXPECT_TRUE(padding_untouched(run[8][e], 0xff)) << names[e] << ": written outside its view (mma.sync, q read)";
    EXPECT_TRUE(padding_untouched(run[2][e], 0xff)) << names[e] << ": written outside its view (dS in registers)";
    if (!run_wy.empty()) EXPECT_EQ(run[0][e].bytes, run_wy[e].bytes) << names[e] << ": differs with the forward's wy_inverse";
    EXPECT_TRUE(padding_untouched(run[0][e], 0xff)) << names[e] << ": written outside its view";
    std::printf(" %s %.2e (rs %.2e, wgmma %.2e, q read %.2e / %.2e)", names[e], err, err_rs, err_wg, err_q, err_q8);
    ++checked;
  }
  std::printf("\n");
  EXPECT_EQ(checked, std::popcount(c.grads));
}

// Device offsets are trusted (reading them would need a synchronisation), so the kernels clamp them:
// out-of-range, decreasing or short offsets give wrong sequences but must never touch memory outside
// the tensors or the workspace. Checked here by the launches completing cleanly and by the views'
// padding staying untouched; gpu-check runs this test under compute-sanitizer memcheck ("varlen").
TEST(DeltanetCudaBadOffsets, Clamped_varlen_MemorySafe) {
  FW_REQUIRE_GPU();
  const std::vector<std::vector<std::int64_t>> bad = {{0, 400, -7, 90, 150}, {0, 150, 20}, {5, 3, 140}, {0, 10, 60}};
  const std::int64_t T = 150, H = 2, K = 64, V = 64;
  for (DType dt : {DType::bf16, DType::f32})
    for (const auto& off : bad) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " offsets of size " + std::to_string(off.size()));
      const std::int64_t N = std::int64_t(off.size()) - 1;
      auto host = [&](DType t, std::vector<std::int64_t> shape) { return make_host(t, std::move(shape), 3, 1); };
      HostTensor q = host(dt, {1, T, H, K}), k = host(dt, {1, T, H, K}), v = host(dt, {1, T, H, V}),
                 beta = host(dt, {1, T, H}), o = host(dt, {1, T, H, V}), h0 = host(DType::f32, {N, H, K, V}),
                 ht = host(DType::f32, {N, H, K, V}), dout = host(dt, {1, T, H, V}), dq = host(dt, {1, T, H, K}),
                 dk = host(dt, {1, T, H, K}), dv = host(dt, {1, T, H, V}), db = host(dt, {1, T, H}),
                 dh0 = host(DType::f32, {N, H, K, V});
      std::mt19937_64 rng(7);
      fill_inputs(rng, true, K, q, k, v, beta, h0);
      fill_random(dout, rng, -1.0, 1.0);
      HostTensor* outs[] = {&o, &ht, &dq, &dk, &dv, &db, &dh0};
      for (HostTensor* t : outs) fill_bytes(*t, 0xff);
      HostTensor cu = make_host(DType::i32, {std::int64_t(off.size())});
      for (std::size_t i = 0; i < off.size(); ++i) cu.set(std::int64_t(i), double(off[i]));
      DeviceMirror gq(q), gk(k), gv(v), gb(beta), go(o), gh0(h0), ght(ht), gcu(cu), gdo(dout), gdq(dq), gdk(dk),
          gdv(dv), gdb(db), gdh0(dh0);
      DeltanetFwdArgs a;
      a.q = gq.ref(q), a.k = gk.ref(k), a.v = gv.ref(v), a.beta = gb.ref(beta), a.o = go.ref(o);
      a.initial_state = gh0.ref(h0), a.final_state = ght.ref(ht), a.cu_seqlens = gcu.ref(cu);
      a.use_qk_l2norm_in_kernel = true;
      const std::size_t fneed = deltanet_fwd_workspace_size(a);
      DeltanetBwdArgs b;
      b.q = a.q, b.k = a.k, b.v = a.v, b.beta = a.beta, b.do_ = gdo.ref(dout), b.initial_state = a.initial_state;
      b.cu_seqlens = a.cu_seqlens, b.use_qk_l2norm_in_kernel = true;
      b.dq = gdq.ref(dq), b.dk = gdk.ref(dk), b.dv = gdv.ref(dv), b.dbeta = gdb.ref(db), b.dinitial_state = gdh0.ref(dh0);
      const std::size_t bneed = deltanet_bwd_workspace_size(b);
      void* ws = nullptr;
      FW_TEST_CUDA(cudaMalloc(&ws, std::max<std::size_t>({fneed, bneed, 1})));
      deltanet_fwd(a);                             // the on-chip kernel
      deltanet_fwd(a, ws, fneed, Stream{});        // the pipeline (tensor cores for bf16)
      deltanet_bwd(b, ws, bneed, Stream{});
      a.split_operands = b.split_operands = false;  // bf16-only operands: smaller workspaces, other kernels
      deltanet_fwd(a, ws, deltanet_fwd_workspace_size(a), Stream{});
      deltanet_bwd(b, ws, deltanet_bwd_workspace_size(b), Stream{});
      FW_TEST_CUDA(cudaDeviceSynchronize());
      FW_TEST_CUDA(cudaGetLastError());
      FW_TEST_CUDA(cudaFree(ws));
      DeviceMirror* gouts[] = {&go, &ght, &gdq, &gdk, &gdv, &gdb, &gdh0};
      for (int e = 0; e < 7; ++e) {
        gouts[e]->download(*outs[e]);
        EXPECT_TRUE(padding_untouched(*outs[e], 0xff)) << "output " << e << " written outside its view";
      }
    }
}

std::vector<DnBwdCase> bwd_cases() {
  std::vector<DnBwdCase> v;
  const std::vector<std::int64_t> none;
  for (DType dt : {DType::f32, DType::bf16}) {
    // T = 1 (one position), 63 (one chunk's tail), 1000 (many chunks); odd K = V
    for (std::int64_t T : {1, 63, 1000}) v.push_back({dt, 1, T, 2, 100, 100, true, true, true, none, DType::i64, kAllGrads, 0});
    // K != V, two batches, strided views
    v.push_back({dt, 2, 200, 3, 64, 128, false, true, true, none, DType::i64, kAllGrads, 3});
  }
  v.push_back({DType::f32, 1, 150, 2, 256, 64, false, true, true, none, DType::i64, kAllGrads, 0});  // the largest K
  v.push_back({DType::bf16, 1, 150, 2, 128, 256, true, true, true, none, DType::i64, kAllGrads, 0});
  // odd V and K < 64, K % 8 != 0: element paths of the tensor-core kernels (pairs, scalar tiles)
  for (DType dt : {DType::f32, DType::bf16})
    v.push_back({dt, 1, 150, 2, 33, 47, true, true, true, none, DType::i64, kAllGrads, 0});
  // varlen with empty sequences (first and in the middle), chunk-crossing lengths
  v.push_back({DType::f32, 1, 150, 2, 64, 128, true, true, true, {0, 0, 70, 70, 150}, DType::i32, kAllGrads, 0});
  v.push_back({DType::bf16, 1, 150, 2, 100, 72, true, true, true, {0, 0, 70, 70, 150}, DType::i32, kAllGrads, 0});
  v.push_back({DType::f32, 1, 150, 2, 64, 128, false, true, false, {0, 33, 33, 150}, DType::i64, kAllGrads, 0});
  // T = 4097; float16 (version 1 kernels); 2000 packed sequences of random lengths (empty ones too)
  v.push_back({DType::bf16, 1, 4097, 1, 64, 64, true, true, true, none, DType::i64, kAllGrads, 0});
  v.push_back({DType::f16, 1, 300, 2, 64, 64, true, true, true, none, DType::i64, kAllGrads, 0});
  for (DType dt : {DType::f32, DType::bf16}) {
    const std::vector<std::int64_t> off = many_offsets(2000, 9, 6);
    v.push_back({dt, 1, off.back(), 1, 32, 32, true, true, true, off, DType::i64, kAllGrads, 0});
  }
  // only some gradients asked for (no initial state, no dfinal_state)
  v.push_back({DType::f32, 2, 130, 2, 64, 64, false, false, false, none, DType::i64, kDv | kDbeta, 0});
  v.push_back({DType::bf16, 1, 100, 2, 100, 72, true, true, true, none, DType::i64, kDq | kDh0, 0});
  // without the L2 norm, unpadded: dq, dk stored straight from the chunk pass (bf16 column pairs)
  v.push_back({DType::bf16, 2, 200, 3, 128, 128, false, true, true, none, DType::i64, kAllGrads, 0});
  // bf16-only tensor-core operands (split_operands = false): the templated kernels' other half
  const std::vector<std::int64_t> off = many_offsets(2000, 9, 6);
  for (DnBwdCase c : std::vector<DnBwdCase>{
           {DType::bf16, 1, 1000, 2, 100, 100, true, true, true, none, DType::i64, kAllGrads, 0},
           {DType::bf16, 2, 200, 3, 64, 128, false, true, true, none, DType::i64, kAllGrads, 3},
           {DType::bf16, 1, 150, 2, 128, 256, true, true, true, none, DType::i64, kAllGrads, 0},
           {DType::bf16, 1, 150, 2, 33, 47, true, true, true, none, DType::i64, kAllGrads, 0},
           {DType::bf16, 1, 150, 2, 100, 72, true, true, true, {0, 0, 70, 70, 150}, DType::i32, kAllGrads, 0},
           {DType::bf16, 1, 4097, 1, 64, 64, true, true, true, none, DType::i64, kAllGrads, 0},
           {DType::bf16, 1, off.back(), 1, 32, 32, true, true, true, off, DType::i64, kAllGrads, 0},
           {DType::bf16, 1, 100, 2, 100, 72, true, true, true, none, DType::i64, kDq | kDh0, 0},
           {DType::bf16, 2, 200, 3, 128, 128, false, true, true, none, DType::i64, kAllGrads, 0},
           // K = 128 over 11 chunks: the serial kernel's 3-buffer ring (T1, run 5) wraps several times
           {DType::bf16, 1, 700, 2, 128, 128, true, true, true, none, DType::i64, kAllGrads, 0},
           // the serial kernel's tensor-map stores (run 12) over packed sequences (short last chunks,
           // slot bases), and with K < 128 rows a box and V's last tile 16 columns of 64 (clipped)
           {DType::bf16, 1, 150, 2, 64, 128, true, true, true, {0, 0, 70, 70, 150}, DType::i32, kAllGrads, 0},
           {DType::bf16, 1, 150, 2, 96, 80, true, true, true, none, DType::i64, kAllGrads, 0}}) {
    c.split = false;
    v.push_back(c);
  }
  return v;
}
INSTANTIATE_TEST_SUITE_P(Cases, DeltanetCudaBwd, ::testing::ValuesIn(bwd_cases()),
                         [](const auto& info) { return name_of(info.param); });

// ---- decoding step ------------------------------------------------------------------------------------
struct StepCase {
  DType dt;
  std::int64_t B, H, K, V;
  bool l2;
};
std::string name_of(const StepCase& c) {
  return std::string(dtype_name(c.dt)) + "_K" + std::to_string(c.K) + "V" + std::to_string(c.V) + (c.l2 ? "_l2" : "");
}
void PrintTo(const StepCase& c, std::ostream* os) { *os << name_of(c); }

class DeltanetCudaStep : public ::testing::TestWithParam<StepCase> {};

TEST_P(DeltanetCudaStep, MatchesReferenceOutOfPlaceAndInPlace) {
  FW_REQUIRE_GPU();
  const StepCase c = GetParam();
  HostTensor q = make_host(c.dt, {c.B, c.H, c.K}), k = make_host(c.dt, {c.B, c.H, c.K}),
             v = make_host(c.dt, {c.B, c.H, c.V}), beta = make_host(c.dt, {c.B, c.H}),
             st = make_host(DType::f32, {c.B, c.H, c.K, c.V}), o = make_host(c.dt, {c.B, c.H, c.V}),
             nst = make_host(DType::f32, {c.B, c.H, c.K, c.V});
  std::mt19937_64 rng(53);
  fill_random(q, rng, -1.0, 1.0);
  const double kr = c.l2 ? 1.0 : 1.7 / std::sqrt(double(c.K));
  fill_random(k, rng, -kr, kr);
  fill_random(v, rng, -1.0, 1.0);
  fill_random(beta, rng, 0.0, 1.0);
  fill_random(st, rng, -0.5, 0.5);
  fill_bytes(o, 0xff), fill_bytes(nst, 0xff);
  DeviceMirror gq(q), gk(k), gv(v), gb(beta), gst(st), go(o), gnst(nst);
  DeltanetStepArgs a;
  a.q = gq.ref(q), a.k = gk.ref(k), a.v = gv.ref(v), a.beta = gb.ref(beta), a.state = gst.ref(st);
  a.o = go.ref(o), a.new_state = gnst.ref(nst);
  a.use_qk_l2norm_in_kernel = c.l2;
  cudaStream_t stream{};
  FW_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const Stream s = reinterpret_cast<Stream>(stream);
  // out of place, twice (outputs poisoned again before the second call)
  deltanet_step(a, s);
  FW_TEST_CUDA(cudaStreamSynchronize(stream));
  HostTensor o1 = o, n1 = nst, st_after = st;
  go.download(o1), gnst.download(n1), gst.download(st_after);
  FW_TEST_CUDA(cudaMemset(go.ptr, 0xff, go.nbytes));
  FW_TEST_CUDA(cudaMemset(gnst.ptr, 0xff, gnst.nbytes));
  FW_TEST_CUDA(cudaDeviceSynchronize());  // the memsets run on the legacy stream, not on `stream`
  const bool tile_major = fastweight::detail::set_step_tile_major(false);  // the other grid order: same bits
  const bool early = fastweight::detail::set_deltanet_step_early(false);  // and the other load order
  fastweight::detail::set_deltanet_step_early(!early);
  deltanet_step(a, s);
  FW_TEST_CUDA(cudaStreamSynchronize(stream));
  fastweight::detail::set_deltanet_step_early(early);
  fastweight::detail::set_step_tile_major(tile_major);
  HostTensor o2 = o, n2 = nst;
  go.download(o2), gnst.download(n2);
  // in place: new_state is the state
  FW_TEST_CUDA(cudaMemset(go.ptr, 0xff, go.nbytes));
  FW_TEST_CUDA(cudaDeviceSynchronize());
  a.new_state = a.state;
  const bool vst = fastweight::detail::set_step_vector_stores(false);  // 4-byte state stores: the same bits
  deltanet_step(a, s);
  FW_TEST_CUDA(cudaStreamSynchronize(stream));
  fastweight::detail::set_step_vector_stores(vst);
  HostTensor o3 = o, n3 = st;
  go.download(o3), gst.download(n3);
  // the forward over T = 1 in place of the step kernel (set_deltanet_step_kernel), out of place
  FW_TEST_CUDA(cudaMemcpy(gst.ptr, st.bytes.data(), gst.nbytes, cudaMemcpyHostToDevice));
  FW_TEST_CUDA(cudaMemset(go.ptr, 0xff, go.nbytes));
  FW_TEST_CUDA(cudaMemset(gnst.ptr, 0xff, gnst.nbytes));
  FW_TEST_CUDA(cudaDeviceSynchronize());
  a.new_state = gnst.ref(nst);
  const bool step_kernel = fastweight::detail::set_deltanet_step_kernel(false);
  deltanet_step(a, s);
  FW_TEST_CUDA(cudaStreamSynchronize(stream));
  fastweight::detail::set_deltanet_step_kernel(step_kernel);
  FW_TEST_CUDA(cudaStreamDestroy(stream));
  HostTensor o4 = o, n4 = nst;
  go.download(o4), gnst.download(n4);

  // the loop form over one position: (B, H, D) is the contiguous (B, 1, H, D), the state (N = B, H, K, V)
  HostTensor rq = to_f64(q), rk = to_f64(k), rv = to_f64(v), rb = to_f64(beta), rst = to_f64(st);
  HostTensor ro = make_host(DType::f64, o.shape), rnst = make_host(DType::f64, st.shape);
  fastweight::detail::DeltanetShape sh;
  sh.B = c.B, sh.T = 1, sh.H = c.H, sh.K = c.K, sh.V = c.V;
  fastweight::detail::DeltanetOptions opt;
  opt.use_qk_l2norm_in_kernel = c.l2;
  fastweight::detail::deltanet_recurrent_fwd(sh, {p64(rq), p64(rk), p64(rv), p64(rb)}, opt, p64(rst), p64(ro),
                                             p64(rnst));
  const double tol = c.dt == DType::f32 ? 1e-5 : 2e-2;
  const double e_o = rel_err(o1, ro), e_n = rel_err(n1, rnst), e_oi = rel_err(o3, ro), e_ni = rel_err(n3, rnst);
  EXPECT_LT(e_o, tol) << "o";  // +inf on any NaN: every element written
  EXPECT_LT(e_n, tol) << "new_state";
  EXPECT_LT(e_oi, tol) << "o (in place)";
  EXPECT_LT(e_ni, tol) << "state (in place)";
  EXPECT_LT(rel_err(o4, ro), tol) << "o (the forward over T = 1)";
  EXPECT_LT(rel_err(n4, rnst), tol) << "new_state (the forward over T = 1)";
  EXPECT_EQ(st_after.bytes, st.bytes) << "out of place: the state was written";
  EXPECT_EQ(o1.bytes, o2.bytes) << "o: not deterministic";
  EXPECT_EQ(n1.bytes, n2.bytes) << "new_state: not deterministic";
  // the view's elements only: n1's slack past the view is the poison, n3's the state's random fill
  EXPECT_EQ(o1.elem_bytes(), o3.elem_bytes()) << "o: in place (with 4-byte state stores) differs";
  EXPECT_EQ(n1.elem_bytes(), n3.elem_bytes()) << "state: in place (with 4-byte state stores) differs";
  std::printf("[ measured ] step %s: o %.2e new_state %.2e  in place: o %.2e state %.2e\n", name_of(c).c_str(), e_o,
              e_n, e_oi, e_ni);
}

std::vector<StepCase> step_cases() {
  std::vector<StepCase> v;
  for (DType dt : {DType::f32, DType::bf16})
    // the step kernel's float4 rows (V % 4 == 0) and its element path (V = 70), K up to 256
    for (auto [K, V] : {std::pair<std::int64_t, std::int64_t>{100, 72}, {128, 128}, {256, 256}, {64, 70}})
      for (bool l2 : {false, true}) v.push_back({dt, 3, 4, K, V, l2});
  return v;
}
INSTANTIATE_TEST_SUITE_P(Cases, DeltanetCudaStep, ::testing::ValuesIn(step_cases()),
                         [](const auto& info) { return name_of(info.param); });

// A chain of steps as a decoder runs them: out of place A -> B -> A -> B, then twice in place on B, on a
// stream of its own, eagerly or captured in a CUDA graph. With the step a programmatic launch
// (set_deltanet_step_pdl) a step's CTAs may be resident before the previous step has ended; a load or
// store ahead of its wait would change bits. Against the chain of plain launches: the same bits.
std::vector<HostTensor> run_deltanet_step_chain(std::int64_t B, std::int64_t H, std::int64_t K, std::int64_t V,
                                                bool pdl, bool graph) {  // (EXPECT: a function with a result)
  HostTensor q = make_host(DType::bf16, {B, H, K}), k = make_host(DType::bf16, {B, H, K}),
             v = make_host(DType::bf16, {B, H, V}), beta = make_host(DType::bf16, {B, H}),
             sa = make_host(DType::f32, {B, H, K, V}), sb = make_host(DType::f32, {B, H, K, V}),
             o = make_host(DType::bf16, {B, H, V});
  std::mt19937_64 rng(59);
  fill_random(q, rng, -1.0, 1.0);
  fill_random(k, rng, -1.0, 1.0);
  fill_random(v, rng, -1.0, 1.0);
  fill_random(beta, rng, 0.0, 1.0);
  fill_random(sa, rng, -0.5, 0.5);
  fill_bytes(sb, 0xff), fill_bytes(o, 0xff);  // B's state: NaN until the first step
  DeviceMirror gq(q), gk(k), gv(v), gb(beta), ga(sa), gsb(sb), go(o);
  cudaStream_t st = nullptr;
  EXPECT_EQ(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
  const int prev = fastweight::detail::set_deltanet_step_pdl(pdl ? 2 : 0);  // always / never
  auto step = [&](DeviceMirror& si, HostTensor& hi, DeviceMirror& so, HostTensor& ho) {
    DeltanetStepArgs a;
    a.q = gq.ref(q), a.k = gk.ref(k), a.v = gv.ref(v), a.beta = gb.ref(beta), a.o = go.ref(o);
    a.state = si.ref(hi), a.new_state = so.ref(ho);
    a.use_qk_l2norm_in_kernel = true;
    deltanet_step(a, reinterpret_cast<Stream>(st));
  };
  auto chain = [&] {
    step(ga, sa, gsb, sb);
    step(gsb, sb, ga, sa);
    step(ga, sa, gsb, sb);
    for (int r = 0; r < 2; ++r) step(gsb, sb, gsb, sb);
  };
  run_eager_or_graph(st, graph, chain);
  fastweight::detail::set_deltanet_step_pdl(prev);
  cudaStreamDestroy(st);
  go.download(o), gsb.download(sb), ga.download(sa);
  return {o, sb, sa};
}

TEST(DeltanetCudaStepChain, ProgrammaticChainSameBits) {
  FW_REQUIRE_GPU();
  // (64, 16, 128, 128): 2048 CTAs, several waves; (3, 2, 256, 72): the 16-row instance, a short last tile
  for (auto [B, H, K, V] : {std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t>{64, 16, 128, 128},
                            {3, 2, 256, 72}}) {
    SCOPED_TRACE("B " + std::to_string(B) + " H " + std::to_string(H) + " K " + std::to_string(K) + " V " +
                 std::to_string(V));
    // the output and state finite
    expect_programmatic_chain_same_bits([&](bool pdl, bool graph) { return run_deltanet_step_chain(B, H, K, V, pdl, graph); }, 2);
  }
}

}  // namespace
}  // namespace fwtest
#endif

// The wgmma helpers (cuda/common/wgmma.cuh) that the serial kernel's next form builds on: one
// warpgroup's products with A from registers and B through the 128-byte swizzle, K-major (two blocks
// along k) and MN-major (two blocks along n), against a float64 host product of the same bf16 values.
// A failure here means the descriptors or the swizzle are wrong (the backward's wgmma form builds on them).
TEST(DeltanetCudaWgmma, ProbeProductsMatchReference) {
  FW_REQUIRE_GPU();
  std::mt19937_64 rng(29);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  auto bf = [&](std::vector<std::uint16_t>& bits, std::vector<double>& val, std::size_t n) {
    bits.resize(n), val.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      const float x = u(rng);
      std::uint32_t w = std::bit_cast<std::uint32_t>(x);
      w += 0x7fffu + ((w >> 16) & 1u);  // round to nearest even (finite x)
      bits[i] = std::uint16_t(w >> 16);
      val[i] = double(std::bit_cast<float>(std::uint32_t(bits[i]) << 16));
    }
  };
  std::vector<std::uint16_t> a, b, a2, b2;
  std::vector<double> va, vb, va2, vb2;
  bf(a, va, 64 * 128), bf(b, vb, 64 * 128), bf(a2, va2, 64 * 64), bf(b2, vb2, 64 * 128);
  std::vector<float> d(64 * 64, -1.f), e(64 * 128, -1.f), f(64 * 64, -1.f);
  if (!fastweight::detail::wgmma_probe(a.data(), b.data(), a2.data(), b2.data(), d.data(), e.data(), f.data()))
    GTEST_SKIP() << "no wgmma in this device's binary (sm_90a only)";
  double dd = 0, dn = 0, ed = 0, en = 0, fd = 0, fn = 0;
  for (int m = 0; m < 64; ++m) {
    for (int n = 0; n < 64; ++n) {  // d = a b^T, b stored [n][k]
      double r = 0;
      for (int k = 0; k < 128; ++k) r += va[m * 128 + k] * vb[n * 128 + k];
      dd += (d[m * 64 + n] - r) * (d[m * 64 + n] - r), dn += r * r;
    }
    for (int n = 0; n < 128; ++n) {  // e = a2 b2, b2 stored [k][n]
      double r = 0;
      for (int k = 0; k < 64; ++k) r += va2[m * 64 + k] * vb2[k * 128 + n];
      ed += (e[m * 128 + n] - r) * (e[m * 128 + n] - r), en += r * r;
      if (n < 64) fd += (f[m * 64 + n] - r) * (f[m * 64 + n] - r), fn += r * r;
    }
  }
  const double errd = std::sqrt(dd / dn), erre = std::sqrt(ed / en), errf = std::sqrt(fd / fn);  // NaN fails
  std::printf("[ measured ] wgmma probe: K-major B rel err %.2e, MN-major B rel err %.2e (n 128), %.2e (n 64)\n",
              errd, erre, errf);
  EXPECT_LT(errd, 1e-5) << "K-major B (m64n64k16, A from registers)";
  EXPECT_LT(erre, 1e-5) << "MN-major B (m64n128k16, A from registers)";
  EXPECT_LT(errf, 1e-5) << "MN-major B (m64n64k16, A from registers)";
}
