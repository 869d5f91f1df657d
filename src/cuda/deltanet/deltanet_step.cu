// deltanet_step.cu: one DeltaNet decoding step (T = 1) for every (b, head), memory-bound on the fp32
// state (MATH.md §3, the loop form over one position):
//   e = v - S^T k,  S' = S + beta k e^T,  o = scale S'^T q = scale (S^T q + (q . k) beta e)
// with q, k L2-normalised first when asked. One CTA per (b * H, 64 state columns): each thread holds
// its 4 columns of K / 16 rows in registers (read once, all loads issued before any use), the two
// column sums (S^T k, S^T q) are reduced over the 16 row groups in shared memory in a fixed order, and
// the thread writes its elements of S' (read and written by the same thread: in place is safe).
// The general forward over T = 1 (deltanet_fwd_cuda) ran ~240 GB/s of state traffic at B = 256 on an
// H100 (bench_decode.py, session 21) against FLA's fused_recurrent 2.3 TB/s.
// No allocation and no host synchronisation: CUDA-graph safe.
#include <atomic>

#include "cuda/common/bulk.cuh"
#include "cuda/common/check.cuh"
#include "cuda/common/step_grid.cuh"
#include "cuda/deltanet/deltanet_common.cuh"
#include "cuda/deltanet/deltanet_cuda.h"

namespace fastweight::detail {
namespace {

constexpr int kCols = 64;                    // state columns (V) per CTA
constexpr int kQuads = kCols / 4;            // 16 column quads
constexpr int kGroups = 16;                  // row groups: thread (g, c) holds rows g, g + 16, ..
constexpr int kThreads = kQuads * kGroups;   // 256

// VEC: the state rows are 16-byte aligned fp32 with V % 4 == 0 (float4 loads and stores), else one
// element at a time with column guards. kMaxRows: rows per thread, K <= 16 kMaxRows (8: K <= 128 in
// fewer registers, so more CTAs per SM; 16: K <= kStepMaxK).
// EARLY (set_deltanet_step_early; off, measured slower at B >= 64): the state tile's loads issued first, then q, k and
// the tile's beta and v, all before any use. Without it q and k are loaded and used first (their sums)
// and beta, v only after the first barrier: three dependent trips to memory before the update, where
// the decoding step at small B is latency-bound. The same arithmetic in the same order: the same bits.
// PDL (set_deltanet_step_pdl; by default where the grid is at most one CTA per SM): launched programmatically, so it may be resident before
// the previous kernel in the stream has ended: it waits for that kernel before its first load or store,
// then lets the next programmatic launch (the next step) be scheduled, which waits in turn.
template <bool VEC, int kMaxRows, bool VST = false, bool EARLY = false, bool PDL = false>
__global__ void __launch_bounds__(kThreads) deltanet_step_kernel(const DeltanetParams p, const bool tile_major) {
  if constexpr (PDL) {
    pdl_wait_primary();
    pdl_launch_dependents();
  }
  __shared__ float s_q[kStepMaxK], s_k[kStepMaxK];
  __shared__ float s_red[3][kThreads / 32];
  __shared__ float s_part[2][kGroups][kCols];  // (S^T k, S^T q) partial sums of each row group
  __shared__ float s_e[kCols];                 // beta e of the tile's columns
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const StepCta cta = step_cta(tile_major, (p.V + kCols - 1) / kCols);
  const std::int64_t bh = cta.bh, b = bh / p.H, h = bh % p.H, K = p.K, V = p.V;
  const std::int64_t c0 = cta.tile * kCols;
  // q, k (element (b, h, r) at b s0 + h s2 + r: the T stride s1 is unused); q . q, k . k, q . k
  float qq = 0.f, kk = 0.f, qk = 0.f;
  auto load_qk = [&] {
    for (std::int64_t r = tid; r < K; r += kThreads) {
      const float qr = mlstm_ld(p.q, b * p.q.s0 + h * p.q.s2 + r), kr = mlstm_ld(p.k, b * p.k.s0 + h * p.k.s2 + r);
      s_q[r] = qr, s_k[r] = kr;
      qq = fmaf(qr, qr, qq), kk = fmaf(kr, kr, kk), qk = fmaf(qr, kr, qk);
    }
  };
  if constexpr (!EARLY) load_qk();
  // the state tile into registers first: every load in flight before any use
  const int cq = tid % kQuads, g = tid / kQuads;
  const std::int64_t c = c0 + 4 * cq;  // this thread's first column
  // no __restrict__: in place, S and So are the same memory (the loads must stay before the stores)
  const float* S = static_cast<const float*>(p.h0.p) + b * p.h0.s0 + h * p.h0.s1;
  float* So = static_cast<float*>(p.ht.p) + b * p.ht.s0 + h * p.ht.s1;
  float4 st[kMaxRows];
#pragma unroll
  for (int i = 0; i < kMaxRows; ++i) {
    const std::int64_t r = g + kGroups * i;
    st[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (r >= K) continue;
    if constexpr (VEC) {
      if (c < V) st[i] = *reinterpret_cast<const float4*>(S + r * p.h0.s2 + c);
    } else {
      const float* row = S + r * p.h0.s2;
      if (c < V) st[i].x = row[c];
      if (c + 1 < V) st[i].y = row[c + 1];
      if (c + 2 < V) st[i].z = row[c + 2];
      if (c + 3 < V) st[i].w = row[c + 3];
    }
  }
  // (EARLY: beta and v of the tile's column tid, for the threads that form e and o below)
  float beta_r = 0.f, v_r = 0.f;
  if constexpr (EARLY) {
    if (tid < kCols && c0 + tid < V)
      beta_r = mlstm_ld(p.beta, b * p.beta.s0 + h), v_r = mlstm_ld(p.v, b * p.v.s0 + h * p.v.s2 + c0 + tid);
    load_qk();
  }
  // block sums in a fixed order (deterministic)
  for (int off = 16; off > 0; off >>= 1) {
    qq += __shfl_xor_sync(0xffffffffu, qq, off);
    kk += __shfl_xor_sync(0xffffffffu, kk, off);
    qk += __shfl_xor_sync(0xffffffffu, qk, off);
  }
  if (lane == 0) s_red[0][warp] = qq, s_red[1][warp] = kk, s_red[2][warp] = qk;
  __syncthreads();  // s_q, s_k, s_red
  qq = kk = qk = 0.f;
  for (int w = 0; w < kThreads / 32; ++w) qq += s_red[0][w], kk += s_red[1][w], qk += s_red[2][w];
  // the L2 factors (the reference's 1 / sqrt(x . x + 1e-6)); q and k in the sums below unscaled,
  // the factors applied to the column sums
  const float rq = p.l2 ? rsqrtf(qq + 1e-6f) : 1.f, rk = p.l2 ? rsqrtf(kk + 1e-6f) : 1.f;
  float sk[4] = {0.f, 0.f, 0.f, 0.f}, sq[4] = {0.f, 0.f, 0.f, 0.f};  // this thread's rows of S^T k, S^T q
#pragma unroll
  for (int i = 0; i < kMaxRows; ++i) {
    const std::int64_t r = g + kGroups * i;
    if (r >= K) continue;
    const float kr = s_k[r], qr = s_q[r];
    sk[0] = fmaf(kr, st[i].x, sk[0]), sk[1] = fmaf(kr, st[i].y, sk[1]);
    sk[2] = fmaf(kr, st[i].z, sk[2]), sk[3] = fmaf(kr, st[i].w, sk[3]);
    sq[0] = fmaf(qr, st[i].x, sq[0]), sq[1] = fmaf(qr, st[i].y, sq[1]);
    sq[2] = fmaf(qr, st[i].z, sq[2]), sq[3] = fmaf(qr, st[i].w, sq[3]);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) s_part[0][g][4 * cq + j] = sk[j], s_part[1][g][4 * cq + j] = sq[j];
  __syncthreads();
  if (tid < kCols && c0 + tid < V) {  // column c0 + tid: beta e and o
    float a = 0.f, d = 0.f;
    for (int gg = 0; gg < kGroups; ++gg) a += s_part[0][gg][tid], d += s_part[1][gg][tid];
    const float beta = EARLY ? beta_r : mlstm_ld(p.beta, b * p.beta.s0 + h);
    const float vv = EARLY ? v_r : mlstm_ld(p.v, b * p.v.s0 + h * p.v.s2 + c0 + tid);
    const float be = beta * (vv - rk * a);  // beta (v - S^T k^)
    const float o = p.scale * (rq * d + (rq * rk * qk) * be);  // scale (S^T q^ + (q^ . k^) beta e)
    s_e[tid] = be;
    mlstm_st(p.o, b * p.o.s0 + h * p.o.s2 + c0 + tid, o);
  }
  __syncthreads();
  // S' = S + k^ (beta e)^T
  float be[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) be[j] = 4 * cq + j < kCols ? s_e[4 * cq + j] : 0.f;
#pragma unroll
  for (int i = 0; i < kMaxRows; ++i) {
    const std::int64_t r = g + kGroups * i;
    if (r >= K) continue;
    const float kr = rk * s_k[r];
    float4 x = st[i];
    x.x = fmaf(kr, be[0], x.x), x.y = fmaf(kr, be[1], x.y), x.z = fmaf(kr, be[2], x.z), x.w = fmaf(kr, be[3], x.w);
    if constexpr (VEC) {
      if (c < V) step_store4<VST>(So + r * p.ht.s2 + c, x);
    } else {
      float* row = So + r * p.ht.s2;
      if (c < V) row[c] = x.x;
      if (c + 1 < V) row[c + 1] = x.y;
      if (c + 2 < V) row[c + 2] = x.z;
      if (c + 3 < V) row[c + 3] = x.w;
    }
  }
}

bool aligned16(const StridedView& t) {
  return reinterpret_cast<std::uintptr_t>(t.p) % 16 == 0 && t.s0 % 4 == 0 && t.s1 % 4 == 0 && t.s2 % 4 == 0;
}

std::atomic<bool> g_step_kernel{true};  // set_deltanet_step_kernel
// set_deltanet_step_early (off: H100, session 35, 1.09-1.10x the time at B >= 64, level below);
// FW_DELTANET_STEP_EARLY=1 in the environment turns it on at the start
std::atomic<bool> g_step_early{env_digit("FW_DELTANET_STEP_EARLY", 0) == 1};
// set_deltanet_step_pdl: 0 never, 1 grids of at most one CTA per SM (default), 2 always;
// FW_DELTANET_STEP_PDL=0|1|2 in the environment sets it at start
std::atomic<int> g_step_pdl{env_digit("FW_DELTANET_STEP_PDL", 1)};

}  // namespace

bool set_deltanet_step_kernel(bool on) { return g_step_kernel.exchange(on); }
bool set_deltanet_step_early(bool on) { return g_step_early.exchange(on); }
int set_deltanet_step_pdl(int mode) { return g_step_pdl.exchange(mode); }

bool deltanet_step_kernel_applies(const DeltanetParams& p) {
  return g_step_kernel.load(std::memory_order_relaxed) && p.T == 1 && !p.cu_seqlens && p.K >= 1 &&
         p.K <= kStepMaxK && p.V >= 1 && p.h0.p && p.ht.p && p.h0.dtype == DType::f32 && p.ht.dtype == DType::f32;
}

void deltanet_step_cuda(const DeltanetParams& p, Stream stream) {
  const std::int64_t heads = p.N * p.H, tiles = (p.V + kCols - 1) / kCols;
  if (heads == 0) return;
  const bool vec = p.V % 4 == 0 && aligned16(p.h0) && aligned16(p.ht), tm = g_step_tile_major.load();
  const bool vst = g_step_vec_stores.load(std::memory_order_relaxed);
  const dim3 grid = step_grid("deltanet_step", tm, heads, tiles);
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  constexpr int kHalf = kStepMaxK / kGroups / 2;
  const bool early = g_step_early.load(std::memory_order_relaxed);  // (the 16-byte-store instances)
  // programmatic: the 16-byte-store instances without EARLY, sm_90 binaries only (a JIT-compiled
  // compute_80 build would drop the kernel's wait)
  // (H200, session 36: B = 1, 32 CTAs, back to back -16%; B = 8, 256 CTAs, +1..4%; B >= 64 within 2%)
  const int pdl_mode = g_step_pdl.load(std::memory_order_relaxed);
  const bool small = std::int64_t(grid.x) * grid.y * grid.z <= sm_count();
  const bool pdl = vec && vst && !early && (pdl_mode == 2 || (pdl_mode == 1 && small)) && cc_major() >= 9 &&
                   kernel_binary_version(reinterpret_cast<const void*>(&deltanet_step_kernel<true, kHalf, true, false, true>)) >= 90;
  void (*fn)(DeltanetParams, bool) = nullptr;
  if (p.K <= kHalf * kGroups) {
    if (pdl) fn = &deltanet_step_kernel<true, kHalf, true, false, true>;
    else if (vec && vst && early) fn = &deltanet_step_kernel<true, kHalf, true, true>;
    else if (vec && vst) fn = &deltanet_step_kernel<true, kHalf, true>;
    else if (vec) fn = &deltanet_step_kernel<true, kHalf>;
    else fn = &deltanet_step_kernel<false, kHalf>;
  } else {
    if (pdl) fn = &deltanet_step_kernel<true, 2 * kHalf, true, false, true>;
    else if (vec && vst && early) fn = &deltanet_step_kernel<true, 2 * kHalf, true, true>;
    else if (vec && vst) fn = &deltanet_step_kernel<true, 2 * kHalf, true>;
    else if (vec) fn = &deltanet_step_kernel<true, 2 * kHalf>;
    else fn = &deltanet_step_kernel<false, 2 * kHalf>;
  }
  launch_kernel("deltanet_step", fn, grid, kThreads, 0, s, pdl, p, tm);
  FW_CUDA_CHECK_LAUNCH("deltanet_step");
}

}  // namespace fastweight::detail
