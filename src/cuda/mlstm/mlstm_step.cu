// mlstm_step.cu: one mLSTM decoding step for every (b, head). In place in two launches, so that the
// states are updated without a race between CTAs (out of place in one: the C pass writes n', m' too):
//   1. one CTA per (b * NH, DV tile of 64; cuda/common/step_grid.cuh): C' = fa C + ia k v^T for its
//      columns (each element read and written by one thread; the element kernel, the register tile
//      or the row-block kernel, see mlstm_step_cuda) and
//      h = scale q^T C' / (max(|scale q . n'|, exp(-m')) + eps), with
//      q . n' = fa (q . n) + ia (q . k) from the OLD n (kernel 2 has not run yet);
//   2. grid (B*NH): n' = fa n + ia k and m'. With set_mlstm_step_pdl on sm_90, a programmatic dependent
//      launch: every C-pass CTA signals once all of its threads have consumed n and m (step_read_done),
//      so kernel 2 may run while the C pass streams C; it waits for the C pass only at its end.
// m' = max(lf + m, i), fa = exp(lf + m - m'), ia = exp(i - m'), lf = logsigmoid(f) (MATH.md §2).
// No allocation and no host synchronisation: CUDA-graph safe.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <utility>

#include "cuda/common/bulk.cuh"
#include "cuda/common/check.cuh"
#include "cuda/common/step_grid.cuh"
#include "cuda/common/tensor_map.cuh"
#include "cuda/mlstm/mlstm_common.cuh"
#include "cuda/mlstm/mlstm_cuda.h"

namespace fastweight::detail {
namespace {

constexpr int kCols = 64;      // DV columns per CTA
constexpr int kThreads = 256;  // 4 row groups x 64 columns

struct Gates {
  double m_new;
  float fa, ia;
};
// (Each value is used before the next load: f, its logsigmoid, then i, then m; the measured kernels'
// order. step_head_early issues all three at once.)
__device__ __forceinline__ Gates step_gates(const MlstmParams& p, std::int64_t b, std::int64_t hd) {
  const double lf = mlstm_logsigmoid(double(mlstm_ld(p.f, b * p.f.s0 + hd * p.f.s1)));
  const double ig = double(mlstm_ld(p.i, b * p.i.s0 + hd * p.i.s1));
  const double m = double(mlstm_ld(p.m0, b * p.m0.s0 + hd * p.m0.s1));
  const double mn = fmax(lf + m, ig);
  return {mn, float(exp(lf + m - mn)), float(exp(ig - mn))};
}

// n' = fa n + ia k and m' of head (b, hd), by threads tid, tid + nthreads, .. of a CTA.
__device__ __forceinline__ void step_nm(const MlstmParams& p, std::int64_t b, std::int64_t hd, const Gates& gt,
                                        int tid, int nthreads) {
  const std::int64_t ko = b * p.k.s0 + hd * p.k.s1;
  const std::int64_t ni = b * p.n0.s0 + hd * p.n0.s1, no = b * p.n_last.s0 + hd * p.n_last.s1;
  for (std::int64_t r = tid; r < p.DQK; r += nthreads)
    mlstm_st(p.n_last, no + r, fmaf(gt.fa, mlstm_ld(p.n0, ni + r), gt.ia * mlstm_ld(p.k, ko + r)));
  if (tid == 0) mlstm_st(p.m_last, b * p.m_last.s0 + hd * p.m_last.s1, float(gt.m_new));
}

// The end of the h denominator: each thread's partial q . n and q . k summed over the CTA in a fixed
// order (warp butterflies, then the warps in order: deterministic), then max(|scale q . n'|, exp(-m')) + eps.
template <int kT>
__device__ __forceinline__ float step_den_sum(const MlstmParams& p, const Gates& gt, float (&s_red)[2][kT / 32], float qn,
                                              float qk) {
  const int tid = threadIdx.x;
  for (int off = 16; off > 0; off >>= 1) {
    qn += __shfl_xor_sync(0xffffffffu, qn, off);
    qk += __shfl_xor_sync(0xffffffffu, qk, off);
  }
  if ((tid & 31) == 0) s_red[0][tid >> 5] = qn, s_red[1][tid >> 5] = qk;
  __syncthreads();
  qn = qk = 0.f;
  for (int w = 0; w < kT / 32; ++w) qn += s_red[0][w], qk += s_red[1][w];
  return fmaxf(fabsf(rsqrtf(float(p.DQK)) * (gt.fa * qn + gt.ia * qk)), float(exp(-gt.m_new))) + p.eps;
}

// The h denominator max(|scale q . n'|, exp(-m')) + eps, q . n' = fa (q . n) + ia (q . k) from the old
// n, by the kT threads of a CTA: block sums in a fixed order (deterministic). s_q, s_k (DQK floats),
// where given, also keep q and k for the caller's rows.
template <int kT>
__device__ __forceinline__ float step_den(const MlstmParams& p, std::int64_t b, std::int64_t hd, const Gates& gt,
                                          float (&s_red)[2][kT / 32], float* s_q = nullptr, float* s_k = nullptr) {
  const int tid = threadIdx.x;
  const std::int64_t qo = b * p.q.s0 + hd * p.q.s1, ko = b * p.k.s0 + hd * p.k.s1, no = b * p.n0.s0 + hd * p.n0.s1;
  float qn = 0.f, qk = 0.f;
  for (std::int64_t r = tid; r < p.DQK; r += kT) {
    const float qr = mlstm_ld(p.q, qo + r), kr = mlstm_ld(p.k, ko + r);
    if (s_q) s_q[r] = qr, s_k[r] = kr;
    qn = fmaf(qr, mlstm_ld(p.n0, no + r), qn);
    qk = fmaf(qr, kr, qk);
  }
  return step_den_sum<kT>(p, gt, s_red, qn, qk);
}

// In place (no fuse_nm), after step_den: every thread of the CTA has consumed n (its loads feed
// step_den's shared sums before its barrier) and m (den depends on this thread's gates, and each thread
// stores den to shared memory before the barrier: the store issues only once the m load has returned,
// which an empty asm would not ensure past ptxas), so kernel 2, scheduled once every CTA has signalled,
// may overwrite them. Without a programmatic launch the signal does nothing.
// Each thread stores to a slot of its own (one word shared by all was a write-write race to racecheck).
template <int kT>
__device__ __forceinline__ void step_read_done(bool fuse_nm, float den) {
  if (fuse_nm) return;
  __shared__ float s_sink[kT];  // written, never read: the store is the point
  asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(&s_sink[threadIdx.x]))),
               "f"(den)
               : "memory");
  __syncthreads();
  pdl_launch_dependents();
}

// Every C kernel's first step. Launched programmatically (set_mlstm_step_pdl_c), it may be resident before
// the previous kernel in the stream has ended, so nothing is read or written before the wait (that
// kernel's grid complete, its memory visible; without such a launch the wait does nothing). Out of place
// the CTA then lets the next programmatic launch (the next step's C pass) be scheduled: that one waits in
// turn. In place the signal is step_read_done's, for the n, m kernel.
__device__ __forceinline__ void step_pdl_begin(bool fuse_nm) {
  pdl_wait_primary();
  if (fuse_nm) pdl_launch_dependents();
}

// The row-block kernels' end: h of the CTA's kC columns from the row groups' q^T C' partial sums (a fixed
// order: deterministic), and n', m' from tile 0 where the C pass writes them (out of place).
template <int kC, int kT, int kGroups>
__device__ __forceinline__ void step_h_out(const MlstmParams& p, float (&s_part)[kGroups][kC], const float (&part)[4],
                                           int g, int cq, std::int64_t tile, std::int64_t b, std::int64_t hd,
                                           const Gates& gt, float scale, float den, bool fuse_nm) {
  const int tid = threadIdx.x;
#pragma unroll
  for (int j = 0; j < 4; ++j) s_part[g][4 * cq + j] = part[j];
  __syncthreads();
  for (int col = tid; col < kC; col += kT) {
    const std::int64_t cc = tile * kC + col;
    if (cc >= p.DV) continue;
    float hsum = 0.f;
    for (int gg = 0; gg < kGroups; ++gg) hsum += s_part[gg][col];
    mlstm_st(p.h, b * p.h.s0 + hd * p.h.s1 + cc, scale * hsum / den);
  }
  if (fuse_nm && tile == 0) step_nm(p, b, hd, gt, tid, blockDim.x);  // n', m' apart from n, m (out of place)
}

constexpr int kLeanMaxQ = 512;  // the lean kernel's rows (q, k kept in shared memory)

// The lean kernel's prologue with every small load issued at once (set_mlstm_step_lean mode 4; not yet
// measured): f, i, m, v of the thread's columns and q, k, n of its rows (DQK <= kLeanMaxQ), before any of
// them is used. step_gates and step_den load through mlstm_ld's dtype switch and use each value before the
// next load; the SASS of mode 3 has f, then the double logsigmoid, then i, then m, then q, k, n, the
// barrier, then v: five dependent trips to memory before a CTA can update its first block, which waits
// in registers. At B = 8 (one wave of 512 CTAs) that is most of a CTA's life ahead of its first store.
// The same arithmetic in the same order as step_gates + step_den: the same bits.
template <int kT>
__device__ __forceinline__ void step_head_early(const MlstmParams& p, std::int64_t b, std::int64_t hd, std::int64_t c,
                                                float (&s_red)[2][kT / 32], float* s_q, float* s_k, Gates& gt,
                                                float& den, float (&vraw)[4]) {
  constexpr int kU = kLeanMaxQ / kT;  // rows of q, k, n per thread
  const int tid = threadIdx.x;
  const float fr = mlstm_ld(p.f, b * p.f.s0 + hd * p.f.s1), ir = mlstm_ld(p.i, b * p.i.s0 + hd * p.i.s1),
              mr = mlstm_ld(p.m0, b * p.m0.s0 + hd * p.m0.s1);
  const std::int64_t vo = b * p.v.s0 + hd * p.v.s1;
#pragma unroll
  for (int j = 0; j < 4; ++j) vraw[j] = c + j < p.DV ? mlstm_ld(p.v, vo + c + j) : 0.f;
  const std::int64_t qo = b * p.q.s0 + hd * p.q.s1, ko = b * p.k.s0 + hd * p.k.s1, no = b * p.n0.s0 + hd * p.n0.s1;
  float qv[kU], kv[kU], nv[kU];  // rows tid + kT u
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const int r = tid + kT * u;
    const bool in = r < p.DQK;
    qv[u] = in ? mlstm_ld(p.q, qo + r) : 0.f;
    kv[u] = in ? mlstm_ld(p.k, ko + r) : 0.f;
    nv[u] = in ? mlstm_ld(p.n0, no + r) : 0.f;
  }
  // step_gates' formulas
  const double lf = mlstm_logsigmoid(double(fr)), ig = double(ir), m = double(mr);
  const double mn = fmax(lf + m, ig);
  gt = {mn, float(exp(lf + m - mn)), float(exp(ig - mn))};
  // step_den's sums, rows in its order
  float qn = 0.f, qk = 0.f;
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const int r = tid + kT * u;
    if (r >= p.DQK) break;
    s_q[r] = qv[u], s_k[r] = kv[u];
    qn = fmaf(qv[u], nv[u], qn);
    qk = fmaf(qv[u], kv[u], qk);
  }
  den = step_den_sum<kT>(p, gt, s_red, qn, qk);
}

// The gates, the h denominator (q, k kept in s_q, s_k), the read-done signal and ia v of the thread's
// columns c..c+3, as the register tile and the lean kernel form them before their rows: EARLY with
// step_head_early's loads (set_mlstm_step_lean mode 4), else step_gates and step_den (the measured order).
template <int kT, bool EARLY>
__device__ __forceinline__ void step_prologue(const MlstmParams& p, std::int64_t b, std::int64_t hd, std::int64_t c,
                                              std::int64_t vo, float (&s_red)[2][kT / 32], float* s_q, float* s_k,
                                              bool fuse_nm, Gates& gt, float& den, float (&vc)[4]) {
  if constexpr (EARLY) {
    float vraw[4];
    step_head_early<kT>(p, b, hd, c, s_red, s_q, s_k, gt, den, vraw);
    step_read_done<kT>(fuse_nm, den);
#pragma unroll
    for (int j = 0; j < 4; ++j) vc[j] = gt.ia * vraw[j];  // (0 past DV: ia * 0)
  } else {
    gt = step_gates(p, b, hd);
    den = step_den<kT>(p, b, hd, gt, s_red, s_q, s_k);
    step_read_done<kT>(fuse_nm, den);
#pragma unroll
    for (int j = 0; j < 4; ++j) vc[j] = c + j < p.DV ? gt.ia * mlstm_ld(p.v, vo + c + j) : 0.f;
  }
}

__global__ void __launch_bounds__(kThreads) mlstm_step_c_kernel(const MlstmParams p, const bool tile_major, const bool fuse_nm) {
  step_pdl_begin(fuse_nm);
  __shared__ float s_red[2][kThreads / 32];
  __shared__ float s_part[4][kCols];
  const int tid = threadIdx.x;
  const StepCta cta = step_cta(tile_major, (p.DV + kCols - 1) / kCols);
  const std::int64_t bh = cta.bh, b = bh / p.NH, hd = bh % p.NH;
  const Gates gt = step_gates(p, b, hd);
  const std::int64_t qo = b * p.q.s0 + hd * p.q.s1, ko = b * p.k.s0 + hd * p.k.s1, vo = b * p.v.s0 + hd * p.v.s1;
  const float den = step_den<kThreads>(p, b, hd, gt, s_red);
  step_read_done<kThreads>(fuse_nm, den);
  const float scale = rsqrtf(float(p.DQK));

  const int col = tid % kCols, rg = tid / kCols;
  const std::int64_t c = cta.tile * kCols + col;
  float part = 0.f;
  if (c < p.DV) {
    const float vc = gt.ia * mlstm_ld(p.v, vo + c);
    const std::int64_t ci = b * p.c0.s0 + hd * p.c0.s1 + c, co = b * p.c_last.s0 + hd * p.c_last.s1 + c;
    for (std::int64_t r = rg; r < p.DQK; r += 4) {
      const float cn = fmaf(gt.fa, mlstm_ld(p.c0, ci + r * p.c0.s2), mlstm_ld(p.k, ko + r) * vc);
      mlstm_st(p.c_last, co + r * p.c_last.s2, cn);  // may be the element just read (in place)
      part = fmaf(mlstm_ld(p.q, qo + r), cn, part);
    }
  }
  s_part[rg][col] = part;
  __syncthreads();
  if (rg == 0 && c < p.DV) {
    const float hsum = (s_part[0][col] + s_part[1][col]) + (s_part[2][col] + s_part[3][col]);
    mlstm_st(p.h, b * p.h.s0 + hd * p.h.s1 + c, scale * hsum / den);
  }
  if (fuse_nm && cta.tile == 0) step_nm(p, b, hd, gt, tid, blockDim.x);  // n', m' apart from n, m (out of place)
}

// The C pass for fp32 states with 16-byte aligned rows and DV % 4 == 0, DQK <= kVecMaxQ: thread
// (g, cq) holds columns 4 cq.. of rows g, g + 16, .. in registers, every load issued before any use
// (mlstm_step_c_kernel's loop read, updated and wrote one row at a time: the store may alias the next
// row's load in place, so the loads could not run ahead; ~1.2 TB/s of state traffic at B = 256 on an
// H100, bench_decode.py session 21, against mlstm_kernels' Triton step at 2.9).
constexpr int kVecQuads = kCols / 4, kVecGroups = kThreads / kVecQuads;  // 16 x 16
constexpr int kVecMaxQ = 256, kVecRows = kVecMaxQ / kVecGroups;
template <bool VST, bool EARLY = false>
__global__ void __launch_bounds__(kThreads) mlstm_step_c_vec_kernel(const MlstmParams p, const bool tile_major, const bool fuse_nm) {
  step_pdl_begin(fuse_nm);
  __shared__ float s_q[kVecMaxQ], s_k[kVecMaxQ];
  __shared__ float s_red[2][kThreads / 32];
  __shared__ float s_part[kVecGroups][kCols];  // q^T C' partial sums of each row group
  const int tid = threadIdx.x;
  const StepCta cta = step_cta(tile_major, (p.DV + kCols - 1) / kCols);
  const std::int64_t bh = cta.bh, b = bh / p.NH, hd = bh % p.NH;
  const std::int64_t vo = b * p.v.s0 + hd * p.v.s1;
  const int cq = tid % kVecQuads, g = tid / kVecQuads;
  const std::int64_t c = cta.tile * kCols + 4 * cq;
  // no __restrict__: in place, C and Co are the same memory (the loads must stay before the stores)
  const float* C = static_cast<const float*>(p.c0.p) + b * p.c0.s0 + hd * p.c0.s1;
  float* Co = static_cast<float*>(p.c_last.p) + b * p.c_last.s0 + hd * p.c_last.s1;
  float4 st[kVecRows];
#pragma unroll
  for (int i = 0; i < kVecRows; ++i) {
    const std::int64_t r = g + kVecGroups * i;
    st[i] = r < p.DQK && c < p.DV ? *reinterpret_cast<const float4*>(C + r * p.c0.s2 + c) : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  Gates gt;
  float den, vc[4];  // vc: ia v of this thread's columns
  step_prologue<kThreads, EARLY>(p, b, hd, c, vo, s_red, s_q, s_k, fuse_nm, gt, den, vc);
  const float scale = rsqrtf(float(p.DQK));
  float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int i = 0; i < kVecRows; ++i) {
    const std::int64_t r = g + kVecGroups * i;
    if (r >= p.DQK || c >= p.DV) continue;
    const float kr = s_k[r], qr = s_q[r];
    float4 x = st[i];  // C' = fa C + k (ia v)^T
    x.x = fmaf(gt.fa, x.x, kr * vc[0]), x.y = fmaf(gt.fa, x.y, kr * vc[1]);
    x.z = fmaf(gt.fa, x.z, kr * vc[2]), x.w = fmaf(gt.fa, x.w, kr * vc[3]);
    step_store4<VST>(Co + r * p.c_last.s2 + c, x);  // may be the element just read (in place)
    part[0] = fmaf(qr, x.x, part[0]), part[1] = fmaf(qr, x.y, part[1]);
    part[2] = fmaf(qr, x.z, part[2]), part[3] = fmaf(qr, x.w, part[3]);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) s_part[g][4 * cq + j] = part[j];
  __syncthreads();
  const std::int64_t cc = cta.tile * kCols + tid;
  if (tid < kCols && cc < p.DV) {
    float hsum = 0.f;
    for (int gg = 0; gg < kVecGroups; ++gg) hsum += s_part[gg][tid];
    mlstm_st(p.h, b * p.h.s0 + hd * p.h.s1 + cc, scale * hsum / den);
  }
  if (fuse_nm && cta.tile == 0) step_nm(p, b, hd, gt, tid, blockDim.x);  // n', m' apart from n, m (out of place)
}

// The C pass streamed over row blocks (fp32 states, 16-byte aligned rows, DV % 4 == 0, any DQK):
// CTA (head, kC columns), kT threads; thread (g, cq) takes columns 4 cq.. of rows r0 + g + G i (i < kR)
// of each block of G kR rows (G = kT / (kC / 4)). 72 registers at (64, 128, 8): 7 CTAs per SM against
// the register tile's 2, each with less of the state in flight (mlstm_kernels' Triton step works on
// 64 x 64 tiles in a loop the same way). H100, B = 256, xLSTM 7B's heads: 0.764 ms against the
// register tile's 0.868; prefetching the next block into registers (0.839 before the grid order),
// 256 threads x 4 rows (0.784) and 32-column CTAs (0.882 before it) were slower.
template <int kC, int kT, int kR, bool VST>
__global__ void __launch_bounds__(kT) mlstm_step_c_tile_kernel(const MlstmParams p, const bool tile_major, const bool fuse_nm) {
  step_pdl_begin(fuse_nm);
  constexpr int kQuads = kC / 4, kGroups = kT / kQuads, kBlock = kGroups * kR;
  static_assert(kT % kQuads == 0 && kT % 32 == 0, "whole warps of whole rows");
  __shared__ float s_red[2][kT / 32];
  __shared__ float s_part[kGroups][kC];  // q^T C' partial sums of each row group
  const int tid = threadIdx.x, cq = tid % kQuads, g = tid / kQuads;
  const StepCta cta = step_cta(tile_major, (p.DV + kC - 1) / kC);
  const std::int64_t bh = cta.bh, b = bh / p.NH, hd = bh % p.NH;
  const std::int64_t qo = b * p.q.s0 + hd * p.q.s1, ko = b * p.k.s0 + hd * p.k.s1, vo = b * p.v.s0 + hd * p.v.s1;
  const std::int64_t c = cta.tile * kC + 4 * cq;
  const bool col_ok = c < p.DV;
  // no __restrict__: in place, C and Co are the same memory (the loads must stay before the stores)
  const float* C = static_cast<const float*>(p.c0.p) + b * p.c0.s0 + hd * p.c0.s1 + c;
  float* Co = static_cast<float*>(p.c_last.p) + b * p.c_last.s0 + hd * p.c_last.s1 + c;
  auto load = [&](float4 (&x)[kR], std::int64_t r0) {
#pragma unroll
    for (int i = 0; i < kR; ++i) {
      const std::int64_t r = r0 + g + kGroups * i;
      x[i] = r < p.DQK && col_ok ? *reinterpret_cast<const float4*>(C + r * p.c0.s2) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  };
  float4 cur[kR];  // [kR] rows of this thread's 4 columns in the current block
  load(cur, 0);
  const Gates gt = step_gates(p, b, hd);
  const float den = step_den<kT>(p, b, hd, gt, s_red);
  step_read_done<kT>(fuse_nm, den);
  const float scale = rsqrtf(float(p.DQK));
  float vc[4];  // ia v of this thread's columns
#pragma unroll
  for (int j = 0; j < 4; ++j) vc[j] = c + j < p.DV ? gt.ia * mlstm_ld(p.v, vo + c + j) : 0.f;
  float part[4] = {0.f, 0.f, 0.f, 0.f};
  for (std::int64_t r0 = 0; r0 < p.DQK; r0 += kBlock) {
#pragma unroll
    for (int i = 0; i < kR; ++i) {
      const std::int64_t r = r0 + g + kGroups * i;
      if (r >= p.DQK || !col_ok) continue;
      const float kr = mlstm_ld(p.k, ko + r), qr = mlstm_ld(p.q, qo + r);
      float4 x = cur[i];  // C' = fa C + k (ia v)^T
      x.x = fmaf(gt.fa, x.x, kr * vc[0]), x.y = fmaf(gt.fa, x.y, kr * vc[1]);
      x.z = fmaf(gt.fa, x.z, kr * vc[2]), x.w = fmaf(gt.fa, x.w, kr * vc[3]);
      step_store4<VST>(Co + r * p.c_last.s2, x);  // may be the element just read (in place)
      part[0] = fmaf(qr, x.x, part[0]), part[1] = fmaf(qr, x.y, part[1]);
      part[2] = fmaf(qr, x.z, part[2]), part[3] = fmaf(qr, x.w, part[3]);
    }
    if (r0 + kBlock < p.DQK) load(cur, r0 + kBlock);  // after this block's stores (in place: no race)
  }
  step_h_out<kC, kT, kGroups>(p, s_part, part, g, cq, cta.tile, b, hd, gt, scale, den, fuse_nm);
}

// The row-block kernel with a short per-row path (set_mlstm_step_lean; mode 3 the default). ncu of
// mlstm_step_c_tile_kernel at (64, 8, 256, 512) (H200, session 34): 2.5x the instructions of
// mlstm_kernels' Triton step (65.9M against 26.9M) and 47% of issue cycles busy against its 19%: per
// row, k and q were two global loads through mlstm_ld's dtype switch (branches, 64-bit offsets) and
// every row checked r < DQK. A block's next loads issue only after its compute and stores, so a long
// compute phase is time without that CTA's bytes in flight. Here k and q come from shared memory
// (kept by step_den), a whole block takes no row checks, and rows step by 32-bit offsets (the host
// requires DQK row strides to fit). PF: two blocks of kR rows in flight (ping-pong, no register
// copies), the next loads issued before this block's stores: different elements, so in place too.
// H100, fastweight_bench graph ms at B = 64 / 256 (xLSTM 7B's heads): kernel 2 0.199 / 0.758, lean
// 0.195 / 0.747, PF with 4 rows 0.194 / 0.744, PF with 8 rows (120 registers, 4 CTAs per SM) 0.192 /
// 0.731 = 2.93 TB/s of state (mlstm_kernels' Triton step: 2.89 in bench_decode.py).
template <int kC, int kT, int kR, bool PF, bool EARLY = false>
__global__ void __launch_bounds__(kT, !PF ? 7 : kR * kT > 512 ? 4 : 6) mlstm_step_c_lean_kernel(const MlstmParams p, const bool tile_major, const bool fuse_nm) {
  step_pdl_begin(fuse_nm);
  constexpr int kQuads = kC / 4, kGroups = kT / kQuads, kBlock = kGroups * kR;
  static_assert(kT % kQuads == 0 && kT % 32 == 0, "whole warps of whole rows");
  __shared__ float s_q[kLeanMaxQ], s_k[kLeanMaxQ];
  __shared__ float s_red[2][kT / 32];
  __shared__ float s_part[kGroups][kC];  // q^T C' partial sums of each row group
  const int tid = threadIdx.x, cq = tid % kQuads, g = tid / kQuads;
  const StepCta cta = step_cta(tile_major, (p.DV + kC - 1) / kC);
  const std::int64_t bh = cta.bh, b = bh / p.NH, hd = bh % p.NH;
  const std::int64_t vo = b * p.v.s0 + hd * p.v.s1;
  const std::int64_t c = cta.tile * kC + 4 * cq;
  const bool col_ok = c < p.DV;
  const int nq = int(p.DQK), rs = int(p.c0.s2), ros = int(p.c_last.s2);  // rows, row strides (host-checked)
  // no __restrict__: in place, C and Co are the same memory; row g of this thread's columns
  const float* C = static_cast<const float*>(p.c0.p) + b * p.c0.s0 + hd * p.c0.s1 + c + std::int64_t(g) * rs;
  float* Co = static_cast<float*>(p.c_last.p) + b * p.c_last.s0 + hd * p.c_last.s1 + c + std::int64_t(g) * ros;
  auto load = [&](float4 (&x)[kR], int r0) {  // rows r0 + g + kGroups i
    if (r0 + kBlock <= nq) {
#pragma unroll
      for (int i = 0; i < kR; ++i)
        x[i] = col_ok ? *reinterpret_cast<const float4*>(C + (r0 + kGroups * i) * rs) : make_float4(0.f, 0.f, 0.f, 0.f);
    } else {
#pragma unroll
      for (int i = 0; i < kR; ++i)
        x[i] = col_ok && r0 + g + kGroups * i < nq ? *reinterpret_cast<const float4*>(C + (r0 + kGroups * i) * rs)
                                                   : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  };
  float4 a[kR], bb[PF ? kR : 1];  // [kR] rows of this thread's 4 columns: the current block (and the next)
  load(a, 0);
  if constexpr (PF)
    if (kBlock < nq) load(bb, kBlock);
  Gates gt;
  float den, vc[4];  // vc: ia v of this thread's columns; (s_q, s_k: DQK <= kLeanMaxQ, host-checked)
  step_prologue<kT, EARLY>(p, b, hd, c, vo, s_red, s_q, s_k, fuse_nm, gt, den, vc);
  const float scale = rsqrtf(float(p.DQK));
  float part[4] = {0.f, 0.f, 0.f, 0.f};
  auto update = [&](const float4 (&x)[kR], int r0) {  // C' = fa C + k (ia v)^T of a block, stored; q^T C'
    if (!col_ok) return;
    const bool full = r0 + kBlock <= nq;
#pragma unroll
    for (int i = 0; i < kR; ++i) {
      const int r = r0 + g + kGroups * i;
      if (!full && r >= nq) break;
      const float kr = s_k[r], qr = s_q[r];
      float4 y = x[i];
      y.x = fmaf(gt.fa, y.x, kr * vc[0]), y.y = fmaf(gt.fa, y.y, kr * vc[1]);
      y.z = fmaf(gt.fa, y.z, kr * vc[2]), y.w = fmaf(gt.fa, y.w, kr * vc[3]);
      st_global_v4f(Co + (r0 + kGroups * i) * ros, y);  // may be the element just read (in place)
      part[0] = fmaf(qr, y.x, part[0]), part[1] = fmaf(qr, y.y, part[1]);
      part[2] = fmaf(qr, y.z, part[2]), part[3] = fmaf(qr, y.w, part[3]);
    }
  };
  if constexpr (PF) {
    for (int r0 = 0; r0 < nq; r0 += 2 * kBlock) {
      update(a, r0);
      if (r0 + 2 * kBlock < nq) load(a, r0 + 2 * kBlock);
      if (r0 + kBlock < nq) {
        update(bb, r0 + kBlock);
        if (r0 + 3 * kBlock < nq) load(bb, r0 + 3 * kBlock);
      }
    }
  } else {
    for (int r0 = 0; r0 < nq; r0 += kBlock) {
      update(a, r0);
      if (r0 + kBlock < nq) load(a, r0 + kBlock);  // after this block's stores, as the row-block kernel
    }
  }
  step_h_out<kC, kT, kGroups>(p, s_part, part, g, cq, cta.tile, b, hd, gt, scale, den, fuse_nm);
}

// The C pass by the TMA engine (sm_90; fp32 states with 16-byte aligned rows and strides, DQK <= 256;
// set_mlstm_step_kernel(9): not yet measured). CTA (head, 64 columns), 128 threads. Thread 0 asks for
// the CTA's whole column tile at once, DQK / 64 boxes of 64 x 64 floats (16 KB each, 64 KB at xLSTM 7B's
// heads: every byte of the CTA in flight from its start, where the row-block kernel has one 16 KB block
// in flight at a time and issues the next after its stores), each box landing on its own mbarrier
// while the CTA forms the gates and the denominator. Thread (g, cq) then updates columns 4 cq.. of rows
// g, g + 8, .. of each box in shared memory as it lands, and thread 0 stores the box back with one
// tensor-map store (no register staging, no store instructions per thread). In place, a box is stored
// only after its own load has landed, and no other CTA touches it. Past DQK or DV a box loads zeros
// and stores nothing.
constexpr int kTmaT = 128, kTmaBox = 64, kTmaMaxBoxes = 4;
constexpr unsigned kTmaBoxBytes = unsigned(kTmaBox) * kTmaBox * 4;
__global__ void __launch_bounds__(kTmaT) mlstm_step_c_tma_kernel(const MlstmParams p, const bool tile_major, const bool fuse_nm,
                                                                  const __grid_constant__ CUtensorMap mc,
                                                                  const __grid_constant__ CUtensorMap mo) {
#if defined(FW_HAS_BULK)
  step_pdl_begin(fuse_nm);
  extern __shared__ __align__(128) float4 tma_smem[];  // [boxes][64 rows][64 columns] floats, + 128 slack
  __shared__ float s_q[kTmaMaxBoxes * kTmaBox], s_k[kTmaMaxBoxes * kTmaBox];
  __shared__ float s_red[2][kTmaT / 32];
  __shared__ float s_part[kTmaT / 16][kTmaBox];  // q^T C' partial sums of each row group (8 x 64)
  __shared__ std::uint64_t bar[kTmaMaxBoxes];
  // aligned by hand: some toolchains ignore __align__ on extern __shared__ beside static shared data
  float* tile = reinterpret_cast<float*>((reinterpret_cast<std::uintptr_t>(tma_smem) + 127) & ~std::uintptr_t(127));
  const int tid = threadIdx.x, cq = tid % 16, g = tid / 16;
  const int nb = int((p.DQK + kTmaBox - 1) / kTmaBox);
  const StepCta cta = step_cta(tile_major, (p.DV + kTmaBox - 1) / kTmaBox);
  const std::int64_t bh = cta.bh, b = bh / p.NH, hd = bh % p.NH;
  const int col0 = int(cta.tile) * kTmaBox;
  if (tid == 0) {
    for (int x = 0; x < nb; ++x) mbar_init(&bar[x], 1);
    mbar_init_fence();
  }
  __syncthreads();
  if (tid == 0)
    for (int x = 0; x < nb; ++x) {
      mbar_arrive_expect_tx(&bar[x], kTmaBoxBytes);  // the whole box, zeros past the bounds included
      tma_load_4d(&mc, tile + x * kTmaBox * kTmaBox, &bar[x], col0, x * kTmaBox, int(hd), int(b));
    }
  const Gates gt = step_gates(p, b, hd);
  const float den = step_den<kTmaT>(p, b, hd, gt, s_red, s_q, s_k);
  step_read_done<kTmaT>(fuse_nm, den);
  const float scale = rsqrtf(float(p.DQK));
  const std::int64_t c = col0 + 4 * cq, vo = b * p.v.s0 + hd * p.v.s1;
  float vc[4];  // ia v of this thread's columns
#pragma unroll
  for (int j = 0; j < 4; ++j) vc[j] = c + j < p.DV ? gt.ia * mlstm_ld(p.v, vo + c + j) : 0.f;
  float part[4] = {0.f, 0.f, 0.f, 0.f};
  for (int x = 0; x < nb; ++x) {
    mbar_wait(&bar[x], 0);
#pragma unroll
    for (int i = 0; i < kTmaBox / 8; ++i) {
      const int rl = g + 8 * i, r = x * kTmaBox + rl;
      float4* px = reinterpret_cast<float4*>(tile + (x * kTmaBox + rl) * kTmaBox) + cq;
      const float kr = r < p.DQK ? s_k[r] : 0.f, qr = r < p.DQK ? s_q[r] : 0.f;
      float4 y = *px;  // C' = fa C + k (ia v)^T
      y.x = fmaf(gt.fa, y.x, kr * vc[0]), y.y = fmaf(gt.fa, y.y, kr * vc[1]);
      y.z = fmaf(gt.fa, y.z, kr * vc[2]), y.w = fmaf(gt.fa, y.w, kr * vc[3]);
      *px = y;
      part[0] = fmaf(qr, y.x, part[0]), part[1] = fmaf(qr, y.y, part[1]);
      part[2] = fmaf(qr, y.z, part[2]), part[3] = fmaf(qr, y.w, part[3]);
    }
    bulk_fence_shared();  // this thread's rows visible to the store's async proxy
    __syncthreads();
    if (tid == 0) {
      tma_store_4d(&mo, tile + x * kTmaBox * kTmaBox, col0, x * kTmaBox, int(hd), int(b));
      bulk_commit();
    }
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) s_part[g][4 * cq + j] = part[j];
  __syncthreads();
  if (tid < kTmaBox && col0 + tid < p.DV) {
    float hsum = 0.f;
    for (int gg = 0; gg < kTmaT / 16; ++gg) hsum += s_part[gg][tid];
    mlstm_st(p.h, b * p.h.s0 + hd * p.h.s1 + col0 + tid, scale * hsum / den);
  }
  if (fuse_nm && cta.tile == 0) step_nm(p, b, hd, gt, tid, blockDim.x);  // n', m' apart from n, m (out of place)
  // before the CTA exits, its stores' shared sources read (their global writes complete with the grid,
  // as CUTLASS's TMA epilogues leave them): the next CTA on this SM may start sooner
  if (tid == 0) bulk_wait_read();
#endif
}

__global__ void __launch_bounds__(kThreads) mlstm_step_n_kernel(const MlstmParams p) {
  pdl_launch_dependents();  // the next step's programmatic C pass may be scheduled (it waits for this grid)
  const std::int64_t bh = blockIdx.x, b = bh / p.NH, hd = bh % p.NH;
  const Gates gt = step_gates(p, b, hd);
  __syncthreads();  // every thread has read the old m before thread 0 may overwrite it (in place)
  step_nm(p, b, hd, gt, threadIdx.x, kThreads);
  // Launched programmatically (set_mlstm_step_pdl): it ends only after the C pass has, so that work
  // after it in the stream sees C' and h as after two plain launches. (Otherwise a no-op wait.)
  pdl_wait_primary();
}

// The bytes [begin, end) a (B, NH, D) view spans (strides >= 0). By its own element size: with 8 bytes
// for every dtype, an fp32 n' allocated within |n| bytes after n (the caching allocator's habit at
// B = 256, 2 MB each) counted as overlapping, and the out-of-place step took two launches.
std::pair<std::uintptr_t, std::uintptr_t> span(const StridedView& t, std::int64_t B, std::int64_t NH, std::int64_t D) {
  const auto begin = reinterpret_cast<std::uintptr_t>(t.p);
  const auto elems = std::uintptr_t((B - 1) * t.s0 + (NH - 1) * t.s1 + (D - 1) * t.s2 + 1);
  return {begin, begin + elems * dtype_size(t.dtype)};
}
bool disjoint(const StridedView& a, const StridedView& b, std::int64_t B, std::int64_t NH, std::int64_t D) {
  const auto x = span(a, B, NH, D), y = span(b, B, NH, D);
  return x.second <= y.first || y.second <= x.first;
}

std::atomic<bool> g_step_fuse_nm{true};  // set_mlstm_step_fuse_nm

bool aligned16(const StridedView& t) {
  return reinterpret_cast<std::uintptr_t>(t.p) % 16 == 0 && t.s0 % 4 == 0 && t.s1 % 4 == 0 && t.s2 % 4 == 0;
}

std::atomic<int> g_step_kernel{-1};  // set_mlstm_step_kernel; -1: the planner
// set_mlstm_step_pdl: H100, session 34, in place B = 1 and 8 0.89x and 0.88x, B >= 64 within 1%
std::atomic<bool> g_step_pdl{true};
// set_mlstm_step_lean: H100, session 34, mode 3 at B = 64 / 256 0.965x / 0.964x kernel 2's time (modes 1, 2:
// 0.98x); the planner takes it from B = 8 (xLSTM 7B's heads), the register tile below. Session 35, mode 4
// against 3 (graph ms, one binary): B = 1 0.857x (the register tile), 8 0.967x, 64 0.990x, 256 1.003x;
// mode 5 (the default) takes 4 up to 8 waves (B = 64 there), 3 beyond.
// (FW_MLSTM_STEP_LEAN=0..5 in the environment sets the starting mode; unset or anything else: 5)
std::atomic<int> g_step_lean{std::min(env_digit("FW_MLSTM_STEP_LEAN", 5), 5)};

constexpr int kTileThreads = 128, kTileRows = 8;  // the row-block kernel's planner instance (kCols columns)

// set_mlstm_step_pdl_c: H100, session 35, graph ms of 20 chained steps against off: B = 8 0.966x (in place
// 0.947x), B = 64 0.995x, B = 256 0.999x; bench_decode.py B = 8 cold 0.0299 ms against mlstm_kernels'
// 0.0307 (off: 0.0325 against 0.0320)
// (FW_MLSTM_STEP_PDL_C=0 in the environment turns it off at the start; unset or anything else: on)
std::atomic<bool> g_step_pdl_c{env_digit("FW_MLSTM_STEP_PDL_C", 1) != 0};

// A C-pass kernel of the common signature and its CTA shape (threads, DV columns per CTA).
struct CPass {
  void (*fn)(MlstmParams, bool, bool);
  unsigned threads;
  int cols;
};

// A row-block instance <kC columns, kT threads, kR rows per thread and block>: its own grid of DV / kC tiles.
template <int kC, int kT, int kR>
CPass row_block() {
  constexpr bool planner = kC == kCols && kT == kTileThreads && kR == kTileRows;  // (16-byte stores: its instance only)
  if constexpr (planner)
    if (g_step_vec_stores.load(std::memory_order_relaxed)) return {&mlstm_step_c_tile_kernel<kC, kT, kR, true>, kT, kC};
  return {&mlstm_step_c_tile_kernel<kC, kT, kR, false>, kT, kC};
}

// Kernel 9: the TMA C pass where it applies (sm_90 binary and device, DQK <= 256, the maps encodable:
// f4's alignment); false: the caller takes the row-block kernel.
bool launch_step_tma(const MlstmParams& p, bool tm, bool fuse, cudaStream_t s, bool pdl) {
  const void* fn = reinterpret_cast<const void*>(&mlstm_step_c_tma_kernel);
  if (p.DQK > kTmaBox * kTmaMaxBoxes || kernel_binary_version(fn) < 90) return false;
  auto map_of = [&](CUtensorMap* m, const StridedView& t) {  // (DV, DQK, NH, B) floats, boxes 64 x 64
    const std::uint64_t dims[4] = {std::uint64_t(p.DV), std::uint64_t(p.DQK), std::uint64_t(p.NH), std::uint64_t(p.B)};
    const std::uint64_t strides[3] = {std::uint64_t(t.s2) * 4, std::uint64_t(t.s1) * 4, std::uint64_t(t.s0) * 4};
    const std::uint32_t box[4] = {kTmaBox, kTmaBox, 1, 1};
    return encode_f32_tile_map(m, t.p, 4, dims, strides, box);
  };
  const std::size_t smem = std::size_t((p.DQK + kTmaBox - 1) / kTmaBox) * kTmaBoxBytes + 128;  // + alignment slack
  if (smem + 8 * 1024 > smem_per_block_optin()) return false;  // (the static shared data: ~4 KB)
  CUtensorMap mc{}, mo{};
  if (!map_of(&mc, p.c0) || !map_of(&mo, p.c_last)) return false;
  (void)resident_ctas_per_sm(fn, kTmaT, smem);  // raises the dynamic shared-memory limit past 48 KB
  const dim3 grid = step_grid("mlstm_step", tm, p.B * p.NH, (p.DV + kTmaBox - 1) / kTmaBox);
  launch_kernel("mlstm_step", mlstm_step_c_tma_kernel, grid, kTmaT, smem, s, pdl, p, tm, fuse, mc, mo);
  return true;
}

}  // namespace

int set_mlstm_step_kernel(int kernel) { return g_step_kernel.exchange(kernel); }
bool set_mlstm_step_pdl(bool on) { return g_step_pdl.exchange(on); }
bool set_mlstm_step_pdl_c(bool on) { return g_step_pdl_c.exchange(on); }
int set_mlstm_step_lean(int mode) { return g_step_lean.exchange(mode); }
bool set_mlstm_step_fuse_nm(bool on) { return g_step_fuse_nm.exchange(on); }

void mlstm_step_cuda(const MlstmParams& p, Stream stream) {
  const std::int64_t heads = p.B * p.NH, tiles = (p.DV + kCols - 1) / kCols;
  if (heads == 0) return;
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  // the planner: the row-block kernel where the grid is a few waves deep (it keeps fewer bytes in flight
  // per CTA, more CTAs per SM; its lean form by default, set_mlstm_step_lean), the register tile (all of
  // a thread's rows in flight at once) below
  int kernel = g_step_kernel.load(std::memory_order_relaxed);
  // (the lean form takes over once the register tile's grid (2 CTAs per SM) passes a wave: H100, B = 8 at
  // xLSTM 7B's heads, 512 CTAs: out of place 0.030 against 0.031 ms, in place 0.020 against 0.023; B = 1,
  // 64 CTAs: the register tile, 0.007 against 0.008)
  int lean_mode = g_step_lean.load(std::memory_order_relaxed);
  const std::int64_t ctas = heads * tiles, sms = sm_count();
  // mode 5: 4's early loads where the grid is at most 8 waves of the lean kernel's 4 CTAs per SM, else 3
  if (lean_mode == 5) lean_mode = ctas <= 32 * sms ? 4 : 3;
  const bool lean3 = lean_mode >= 3;  // (modes 3 and 4: two blocks of 8 rows)
  if (kernel < 0) kernel = p.DQK > kVecMaxQ || (lean3 ? ctas > 2 * sms : ctas >= 4 * sms) ? 2 : 1;
  const bool f4 = p.c0.dtype == DType::f32 && p.c_last.dtype == DType::f32 && p.DV % 4 == 0 && aligned16(p.c0) &&
                  aligned16(p.c_last);
  const bool tm = g_step_tile_major.load(std::memory_order_relaxed);
  // out of place (n', m' apart from n, m, which every CTA of the head reads), the C pass's tile-0 CTAs
  // write n', m' too: one launch instead of two
  const bool fuse = g_step_fuse_nm.load(std::memory_order_relaxed) && disjoint(p.n_last, p.n0, p.B, p.NH, p.DQK) &&
                    disjoint(p.m_last, p.m0, p.B, p.NH, 1);
  // (programmatic launches: sm_90 binaries only; a JIT-compiled compute_80 build would drop the kernels'
  // waits)
  const bool sm90 = cc_major() >= 9 && kernel_binary_version(reinterpret_cast<const void*>(&mlstm_step_n_kernel)) >= 90;
  const bool pdl_c = sm90 && g_step_pdl_c.load(std::memory_order_relaxed);
  // kernels 3..8: other row-block shapes, for A/B sweeps only (set_mlstm_step_kernel)
  const bool vst = g_step_vec_stores.load(std::memory_order_relaxed);
  // the lean row-block kernel (set_mlstm_step_lean): 16-byte stores, DQK <= kLeanMaxQ, 32-bit row offsets
  const auto fits32 = [&](const StridedView& t) { return t.s2 >= 0 && t.s2 * p.DQK < (std::int64_t(1) << 31); };
  const int lean = vst && p.DQK <= kLeanMaxQ && fits32(p.c0) && fits32(p.c_last) ? lean_mode : 0;
  CPass c{&mlstm_step_c_kernel, kThreads, kCols};
  if (f4 && kernel == 1 && p.DQK <= kVecMaxQ && vst && lean_mode == 4)
    c.fn = &mlstm_step_c_vec_kernel<true, true>;  // (mode 4: its prologue too)
  else if (f4 && kernel == 1 && p.DQK <= kVecMaxQ && vst) c.fn = &mlstm_step_c_vec_kernel<true>;
  else if (f4 && kernel == 1 && p.DQK <= kVecMaxQ) c.fn = &mlstm_step_c_vec_kernel<false>;
  else if (f4 && kernel == 2 && lean) {
    c = {&mlstm_step_c_lean_kernel<kCols, kTileThreads, kTileRows, true>, kTileThreads, kCols};
    if (lean == 1) c.fn = &mlstm_step_c_lean_kernel<kCols, kTileThreads, kTileRows, false>;
    else if (lean == 2) c.fn = &mlstm_step_c_lean_kernel<kCols, kTileThreads, 4, true>;
    else if (lean == 4) c.fn = &mlstm_step_c_lean_kernel<kCols, kTileThreads, kTileRows, true, true>;
  }
  else if (f4 && kernel == 2) c = row_block<kCols, kTileThreads, kTileRows>();
  else if (f4 && kernel == 3) c = row_block<64, 128, 16>();
  else if (f4 && kernel == 4) c = row_block<64, 64, 8>();
  else if (f4 && kernel == 5) c = row_block<128, 128, 8>();
  else if (f4 && kernel == 6) c = row_block<32, 64, 8>();
  else if (f4 && kernel == 7) c = row_block<64, 128, 4>();
  else if (f4 && kernel == 8) c = row_block<128, 256, 8>();
  if (!(f4 && kernel == 9 && launch_step_tma(p, tm, fuse, s, pdl_c))) {
    if (f4 && kernel == 9) c = row_block<kCols, kTileThreads, kTileRows>();
    const dim3 grid = step_grid("mlstm_step", tm, heads, (p.DV + c.cols - 1) / c.cols);
    launch_kernel("mlstm_step", c.fn, grid, c.threads, 0, s, pdl_c, p, tm, fuse);
  }
  FW_CUDA_CHECK_LAUNCH("mlstm_step");
  if (fuse) return;
  // in place: n', m' by a second kernel, programmatically dependent on sm_90 where asked (it may run
  // as soon as every C-pass CTA has consumed n and m: step_read_done)
  launch_kernel("mlstm_step", mlstm_step_n_kernel, dim3(unsigned(heads)), kThreads, 0, s,
                sm90 && g_step_pdl.load(std::memory_order_relaxed), p);
  FW_CUDA_CHECK_LAUNCH("mlstm_step");
}

}  // namespace fastweight::detail
