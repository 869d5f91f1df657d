// rownorm_kernel.cuh: the CUDA kernels of the LayerNorm family (layernorm, rmsnorm, headnorm,
// adalayernorm), all lowered to RowNormParams (common/norm_params.h).
//
// Work split. A 1-D grid of P * G CTAs: CTA b serves parameter group g = b / P (one weight row for
// headnorm / adaLN, the only one for layernorm) and slice p = b % P of the group's rows. Parameters
// are read through L1 in the forward (16-byte vectors); the cached backward stages the scale
// (weight_offset + w) in shared memory once per CTA.
//
// Row engines (forward: aligned 16-bit rows of 264..2048 elements in small problems go to the
// one-row-per-CTA kernel rownorm_fwd_row1_kernel below; on Hopper, other aligned rows up to 16384
// 16-bit / 8192 fp32 elements go to the bulk-copy forward of rownorm_fwd_bulk.cuh instead of the
// cached forward below):
//  * cached (N <= kCachedMaxN): a row is split over `tpr` threads (power of two); each thread holds
//    its VPT 16-byte vectors as fp32, so x (and dy) are read from memory exactly once and the
//    variance is an exact two-pass over registers. tpr <= 32: shuffles only, several rows per CTA;
//    tpr > 32: a shared-memory step. Forward: short rows one row group per CTA, longer rows
//    persistent CTAs. Backward: persistent CTAs (P about one wave); aligned rows stream through a
//    cp.async ring per row group (the ring kernel; on Hopper past its reach in clusters of CTAs that
//    split the columns), unaligned rows through registers.
//  * one-row clusters (forward, aligned 16-bit rows past 4096 vectors, Hopper): the one-row kernel's CTAs in
//    clusters of up to 8 per row, each its share of the columns, the row statistics merged over the cluster.
//  * streaming (any N): forward: one row per CTA iteration, re-reading the row (from L2) per pass;
//    backward (unaligned rows, rows past 8 clusters' reach, devices without clusters): a row-sum pass,
//    then column tiles that keep dW/dB in registers (see below).
//
// Backward weight gradients are deterministic: each CTA accumulates dy * xhat and dy for its rows
// in fp32 registers, in row order, and writes one partial row per CTA (per column tile for long
// rows): ws[(p * G + g) * N + c]. rownorm_wgrad_finalize then sums the P
// partials of each column in a fixed order. No float atomics anywhere.
//
// Saved for the backward by the forward: mean and rstd, fp32, one per row.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#include "common/norm_params.h"
#include "cuda/common/bulk.cuh"
#include "cuda/common/cluster.cuh"
#include "cuda/common/vec.cuh"

namespace fastweight::detail {

// Per-thread work of the cached engines, in 16-byte vectors per row (the same bytes for every dtype).
// Forward, short rows (tpr <= kRowFwdMaxTpr): 2 vectors, one row group per CTA, no row loop (the
// hardware overlaps CTAs; measured faster there). Forward, longer rows: 4 vectors, persistent CTAs
// that load the next row before reducing this one (double buffer in registers); CTAs of 256
// threads are compiled for 3 per SM (80 registers), 512-thread ones for 1. Measured against it at
// 4096 x 8192 bf16 (H100, session 5): one row per CTA with 8 vectors per thread 0.064 ms, with 2
// vectors per thread and 512-thread CTAs 0.074-0.079 ms, this kernel 0.057 ms.
// Backward: persistent CTAs (the dW/dB partials stay in registers across rows); aligned rows of at
// least kRingMinTpr ring threads: the ring kernel below (4 vectors per thread, 512-thread CTAs, a
// cp.async ring per row group); shorter or unaligned rows: 2 vectors each of x and dy, CTAs of <= 256
// threads compiled for 2 per SM, 512 for 1.
inline constexpr int kRowFwdVecs = 2;
inline constexpr int kRowFwdMaxTpr = 128;
inline constexpr int kFwdVecs = 4;
inline constexpr int kBwdVecs = 2;
// Aligned short rows of the backward are staged through shared memory by cp.async, kStages rows per
// thread group deep (kStages - 1 in flight while one is computed): bytes in flight cost no registers.
inline constexpr int kStages = 4;
inline constexpr int kMaxTpr = 512;
inline constexpr int kSmallCta = 256;
template <typename T> inline constexpr std::int64_t kCachedMaxNFwd = std::int64_t(kMaxTpr) * kFwdVecs * kVecElems<T>;
template <typename T> inline constexpr std::int64_t kCachedMaxNBwd = std::int64_t(kMaxTpr) * kBwdVecs * kVecElems<T>;

struct RowLaunch {
  int tpr = 1;           // threads per row (cached engine)
  int P = 1;             // CTAs per parameter group
  bool aligned = false;  // every row start 16-byte aligned and N % E == 0
  // the backward: the slot of a row's mean / rstd a thread reads, tid & stat_mask (~0: its own; ~31: its warp's first,
  // ~(tpr - 1): its row group's first below 32 threads; set_rownorm_bwd_ring_wstat), copied by the thread it names
  int stat_mask = ~0;
};

// Sum over the `tpr` threads of a row group. Every thread of the CTA calls it (uniform control
// flow); `s_red` holds one float per warp. Deterministic and the same bits in every thread.
__device__ __forceinline__ float row_sum(float v, int tpr, float* s_red) {
  v = group_sum_warp(v, tpr);
  if (tpr <= 32) return v;
  const int warp = threadIdx.x >> 5, wpr = tpr >> 5, first = warp & ~(wpr - 1);  // wpr: a power of 2
  __syncthreads();  // the previous row_sum's readers are done with s_red
  if ((threadIdx.x & 31) == 0) s_red[warp] = v;
  __syncthreads();
  float t = 0.f;
  for (int i = 0; i < wpr; ++i) t += s_red[first + i];
  return t;
}

// row_sum of two values at once (one barrier pair instead of two). `s_red`: two floats per warp.
__device__ __forceinline__ float2 row_sum2(float2 v, int tpr, float* s_red) {
  v.x = group_sum_warp(v.x, tpr);
  v.y = group_sum_warp(v.y, tpr);
  if (tpr <= 32) return v;
  const int warp = threadIdx.x >> 5, wpr = tpr >> 5, first = warp & ~(wpr - 1);  // wpr: a power of 2
  __syncthreads();
  if ((threadIdx.x & 31) == 0) { s_red[2 * warp] = v.x; s_red[2 * warp + 1] = v.y; }
  __syncthreads();
  float2 t = make_float2(0.f, 0.f);
  for (int i = 0; i < wpr; ++i) { t.x += s_red[2 * (first + i)]; t.y += s_red[2 * (first + i) + 1]; }
  return t;
}

// Sum of N values as a balanced tree (pairs, then pairs of pairs): the same order every call, and a
// dependency chain of log2(N) adds instead of N (the forward's per-row chains were latency-bound).
template <int N>
__device__ __forceinline__ float tree_sum(const float* v) {
  if constexpr (N == 1) {
    return v[0];
  } else {
    return tree_sum<N / 2>(v) + tree_sum<N / 2>(v + N / 2);
  }
}

// ---- forward, cached ----------------------------------------------------------------------------
// Parameters are read per vector through L1 (every CTA reads the same N values, so they stay
// cached) in fp32 or the IO dtype.
template <typename T, bool ALIGNED>
__device__ __forceinline__ void load_params_vec(const RowNormParams& p, std::int64_t g, int col, int n,
                                                float (&sc)[kVecElems<T>], float (&bi)[kVecElems<T>],
                                                bool bias = true) {
  constexpr int E = kVecElems<T>;
  const bool f32 = p.param == DType::f32;
#pragma unroll
  for (int e = 0; e < E; ++e) { sc[e] = 1.f; bi[e] = 0.f; }
  if (ALIGNED && !f32) {  // parameters in the IO dtype: one 16-byte load each (rows of them aligned too)
    if (p.w) {
      const uint4 raw = load_raw<T>(static_cast<const T*>(p.w) + g * p.w_group_stride, col, n, p.param_aligned);
#pragma unroll
      for (int e = 0; e < E; ++e) sc[e] = p.weight_offset + raw_get<T>(raw, e);
    }
    if (bias && p.b) {
      const uint4 raw = load_raw<T>(static_cast<const T*>(p.b) + g * p.b_group_stride, col, n, p.param_aligned);
#pragma unroll
      for (int e = 0; e < E; ++e) bi[e] = raw_get<T>(raw, e);
    }
    return;
  }
#pragma unroll
  for (int e = 0; e < E; ++e) {
    if (col + e >= n) break;
    if (p.w) sc[e] = p.weight_offset + load_param<T>(p.w, g * p.w_group_stride + col + e, f32);
    if (bias && p.b) bi[e] = load_param<T>(p.b, g * p.b_group_stride + col + e, f32);
  }
}

template <typename T, int VPT, bool ALIGNED>
__global__ void __launch_bounds__(kSmallCta, 4) rownorm_fwd_row_kernel(const RowNormParams p, const RowLaunch L) {
  constexpr int E = kVecElems<T>;
  __shared__ float s_red[kSmallCta / 32];
  const int n = int(p.n);
  // Short rows: one row group per CTA, no loop (the hardware overlaps CTAs); rows in memory order
  // (r = blockIdx.x * R + rg over all rows, every group), each row's parameter group from r:
  // headnorm rows are (..., NH) so g = r % NH, adaLN rows are (B, S) so g = r / S. (Walking one
  // group's rows per CTA read headnorm rows 16 x 256 B apart and lost 1.4x to torch.compile.)
  const int R = blockDim.x / L.tpr, rg = threadIdx.x / L.tpr, lane = threadIdx.x % L.tpr;
  const std::int64_t rows = p.rows;
  const std::int64_t r_raw = std::int64_t(blockIdx.x) * R + rg;
  const bool valid = r_raw < rows;
  const int nv = valid ? n : 0;
  const std::int64_t r = valid ? r_raw : 0;
  const std::int64_t g = p.group_of_row<std::int64_t>(r);
  const float inv_n = 1.f / float(n);

  float xf[VPT][E];  // (VPT, E) this thread's columns (k * tpr + lane) * E + [0, E) as fp32, 0 past the end
  {
    const T* xr = static_cast<const T*>(p.x) + p.x_rows.offset(r);
    uint4 raw[VPT];
#pragma unroll
    for (int k = 0; k < VPT; ++k) raw[k] = load_raw<T>(xr, (k * L.tpr + lane) * E, nv, ALIGNED);
#pragma unroll
    for (int k = 0; k < VPT; ++k) unpack<T>(raw[k], xf[k]);
  }
  float mean = 0.f;
  if (!p.rms) {
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < VPT; ++k)
#pragma unroll
      for (int e = 0; e < E; ++e) s += xf[k][e];
    mean = row_sum(s, L.tpr, s_red) * inv_n;
  }
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int col = (k * L.tpr + lane) * E;
    const bool vin = col < nv;  // aligned: a vector is wholly inside the row or wholly past it
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const float d = (ALIGNED ? vin : col + e < nv) ? xf[k][e] - mean : 0.f;
      ss += d * d;
    }
  }
  const float rstd = rsqrtf(row_sum(ss, L.tpr, s_red) * inv_n + p.eps);
  if (!valid) return;  // after the last barrier

  T* yr = static_cast<T*>(p.y) + p.y_rows.offset(r);
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int col = (k * L.tpr + lane) * E;
    if (col >= n) continue;
    float sc[E], bi[E], out[E];
    load_params_vec<T, ALIGNED>(p, g, col, n, sc, bi);
#pragma unroll
    for (int e = 0; e < E; ++e) out[e] = (xf[k][e] - mean) * rstd * sc[e] + bi[e];
    store_vec<T>(yr, col, n, ALIGNED, out);
  }
  if (lane == 0) {
    if (p.mean) p.mean[r] = mean;
    if (p.rstd) p.rstd[r] = rstd;
  }
}

// Forward, aligned 16-bit rows of 33..256 vectors (N 264..2048) in small problems (the planner's
// rule, rownorm_launch.cuh): one row per CTA of tpr = N / E / VPT threads rounded up to a multiple of 32
// (Hopper; elsewhere to a power of two), VPT 16-byte vectors per thread (1, or 2 beyond 128 vectors; 4 and
// 8 for longer rows, below), no row loop and no shared staging: the row shape
// of FLA's and torch.compile's Triton kernels. The bulk kernel's fixed costs (parameter staging,
// mbarriers, one CTA per SM) dominated there: at 4096 x 2048 bf16 each of its row groups has ~4 rows.
// x and the parameters are loaded together (the parameters do not depend on the statistics, so their
// latency hides behind x's); each of the two sums is a warp butterfly, one float per warp in shared
// memory, one barrier, and a fixed 8-leaf tree over the warp partials (zeros past the CTA's warps):
// deterministic, the same bits in every thread.
inline constexpr int kRow1MaxTpr = 256;
// The wide instances (up to 1024 threads: FLA's row kernel runs rows of 2048..16384 bf16 with 512)
inline constexpr int kRow1WideMaxTpr = 1024;

// Sum over the CTA (tpr threads, a multiple of 32 in [32, 32 W]): `s_part` holds W floats, those of
// warps past the CTA's already zero; each s_part is used for one sum only (one barrier per sum).
// A fixed W-leaf tree: deterministic, the same bits in every thread. W = 8: every thread reads the 8
// slots (2 16-byte loads, 7 adds). The wide instances (W = 32, 512-1024 threads, FLA's row shape):
// lane l reads slot l, then an xor butterfly over the 32 lanes (a + b and b + a are the same float, so
// every lane ends with the same bits): 1 load, 5 shuffles and 5 adds per thread instead of 8 loads
// and 31 adds. (Measured, H100 session 24: the wide instances stay 9-36% behind the planner's 128-256
// threads, so this sum was not what made them slow; docs/perf/norms.md.)
template <int W = 8>
__device__ __forceinline__ float row1_cta_sum(float v, float* s_part) {
  v = group_sum_warp(v, 32);
  if ((threadIdx.x & 31) == 0) s_part[threadIdx.x >> 5] = v;
  __syncthreads();
  if constexpr (W == 32) {
    float t = s_part[threadIdx.x & 31];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
    return t;
  }
  const float4* q = reinterpret_cast<const float4*>(s_part);
  float t[W / 4];
#pragma unroll
  for (int i = 0; i < W / 4; ++i) {
    const float4 a = q[i];
    t[i] = (a.x + a.y) + (a.z + a.w);
  }
  return tree_sum<W / 4>(t);
}

// A VB-byte vector (16: uint4, 8: uint2) of a 16-bit row: load (zeros past n), unpack, pack.
template <int VB> using Row1Vec = std::conditional_t<VB == 16, uint4, uint2>;
// NC: through the non-coherent path (ld.global.nc, __ldg); else a plain ld.global (FLA's Triton
// kernel's load: the one load-path difference between the two PTX listings, session 17)
template <typename T, int VB, bool NC = true>
__device__ __forceinline__ Row1Vec<VB> row1_load(const T* row, int col, int n) {
  Row1Vec<VB> v{};
  if (col < n) {
    if constexpr (NC) v = __ldg(reinterpret_cast<const Row1Vec<VB>*>(row + col));
    else v = *reinterpret_cast<const Row1Vec<VB>*>(row + col);
  }
  return v;
}
// (fp32 rows: the cluster instances only, 16-byte vectors of 4 floats)
template <typename T, int VB>
__device__ __forceinline__ void row1_unpack(const Row1Vec<VB>& raw, float (&f)[VB / sizeof(T)]) {
  const unsigned* u = reinterpret_cast<const unsigned*>(&raw);
#pragma unroll
  for (int i = 0; i < VB / 4; ++i) {
    if constexpr (std::is_same_v<T, float>) {
      f[i] = __uint_as_float(u[i]);
    } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      f[2 * i] = __uint_as_float(u[i] << 16);
      f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
    } else {
      const float2 h = __half22float2(*reinterpret_cast<const __half2*>(u + i));
      f[2 * i] = h.x, f[2 * i + 1] = h.y;
    }
  }
}
template <typename T, int VB>
__device__ __forceinline__ void row1_store(T* row, int col, const float (&v)[VB / sizeof(T)]) {
  Row1Vec<VB> raw;
  unsigned* u = reinterpret_cast<unsigned*>(&raw);
#pragma unroll
  for (int i = 0; i < VB / 4; ++i) {
    if constexpr (std::is_same_v<T, float>) {
      u[i] = __float_as_uint(v[i]);
    } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      const __nv_bfloat162 e = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
      u[i] = *reinterpret_cast<const unsigned*>(&e);
    } else {
      const __half2 e = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
      u[i] = *reinterpret_cast<const unsigned*>(&e);
    }
  }
  *reinterpret_cast<Row1Vec<VB>*>(row + col) = raw;
}

// RAW_PAR: parameters in the IO dtype with aligned rows (or none), kept raw; else read after the sums
// through load_params_vec (fp32 or unaligned parameters; a separate instance: that path's registers would
// cost the common one 8, 32 -> 40). VPT: vectors per thread (1; 2 or 4: half or a quarter of the threads; 8
// for 8 x 512 at N 28680..32768), columns (k * tpr + tid) * EV + [0, EV). VB: the vectors' bytes (16, or 8 for twice the
// threads per row). LATE: the raw parameters loaded after the sums (FLA's order; fewer live registers
// across the barriers) instead of with x. W: warp slots of the sums (8: up to 256 threads, 16: 512, 32: 1024). NC:
// loads through ld.global.nc (else plain ld.global).
// MINB: CTAs per SM the registers must allow (__launch_bounds__'s second argument; 0: no cap, no .minnctapersm).
// PD (with LATE): 0 loads all the raw parameters after the sums; d > 0 loads the first d vectors' during the second
// sum and vector k + d's before vector k's output, so at most d + 1 vectors' parameters are live beside x
// (set_rownorm_fwd_row1_prefetch, mode 1 the 4-vector instances: 4 x 128 71 -> 62 registers at d = 1).
// RX: x kept packed (raw vectors) across the sums and unpacked at each use, instead of held as fp32: VPT * EV / 2
// registers instead of VPT * EV, so the 8-vector instances may cap at 64 (A/B, set_rownorm_fwd_row1_rawx). The
// same sums in the same order (a vector's tree, then the tree over vectors), so the same bits.
// F32P (with RAW_PAR): the parameters fp32 with 16-byte aligned rows (N % 8 == 0: a vector wholly inside the row or
// past it), loaded as 16-byte halves of a vector through the raw path's order (LATE, PD counted in halves) instead
// of load_params_vec's per-element loads (set_rownorm_fwd_row1_f32par).
// CL (Hopper): a row per cluster of C CTAs (rows past one CTA's reach, set_rownorm_fwd_cluster), rank c holding the
// cl_cols columns from c * cl_cols (the last rank may hold fewer). Each rank sums its columns and their squares about
// its own mean (the same two-pass as one CTA), sends (sum, M2) by st.async into slot c of every rank's shared memory,
// completing on that rank's mbarrier, and every rank merges the C pairs in rank order (Chan et al.: M2 = sum of M2_c +
// n_c (mean_c - mean)^2), so the statistics are the same bits in every rank: one exchange per row.
inline constexpr int kFwdMaxCluster = 8;  // portable cluster sizes
// The row's statistics from the C ranks' (sum, M2 about the rank's own mean) pairs in `slot`, rank c holding
// min(cl_cols, N - c cl_cols) columns (> 0: the planners' splits), merged in rank order (Chan et al.: M2 = sum of
// M2_c + n_c (mean_c - mean)^2; RMSNorm: the sum of squares): the same bits in every rank.
__device__ __forceinline__ void cluster_merge_stats(const float2* slot, int ncta, int cl_cols, const RowNormParams& p,
                                                    float& mean, float& rstd) {
  const int nrow = int(p.n);
  float sum = 0.f, m2 = 0.f;
  for (int c = 0; c < ncta; ++c) sum += slot[c].x;
  const float gmean = p.rms ? 0.f : sum / float(nrow);
  for (int c = 0; c < ncta; ++c) {
    const float2 t = slot[c];
    const int nc = min(cl_cols, nrow - c * cl_cols);
    const float d = p.rms ? 0.f : t.x / float(nc) - gmean;
    m2 += t.y + float(nc) * d * d;
  }
  mean = gmean;
  rstd = rsqrtf(m2 / float(nrow) + p.eps);
}
// A cluster per row, no cluster barrier at the end: a CTA leaves only after all its peers' bytes have reached it, and
// st.async reads no shared memory of the sender. (Measured, session 42, H200: an end barrier cost 2-6%; one wave of
// clusters walking the rows, with two exchange buffers, was level or up to 4% slower and spilled 416 B with fp32
// parameters.)
template <typename T, bool RAW_PAR, int VPT, int VB = 16, bool LATE = false, int W = 8, bool NC = true, int MINB = 0,
          int PD = 0, bool RX = false, bool F32P = false, bool CL = false>
__global__ void __launch_bounds__(32 * W, MINB) rownorm_fwd_row1_kernel(const RowNormParams p, const int cl_cols = 0) {
  static_assert(PD == 0 || (RAW_PAR && LATE), "parameter prefetch: raw parameters after the sums");
  constexpr int EV = VB / int(sizeof(T));
  // fp32 rows: the cluster instances (16-byte vectors of 4 floats, kept raw: RX is free there; fp32 parameters are
  // the IO dtype's, so RAW_PAR without F32P)
  static_assert((sizeof(T) == 2 || (sizeof(T) == 4 && CL && VB == 16 && RX && !F32P)) && (VB == 16 || VB == 8) &&
                    (!LATE || RAW_PAR),
                "16-bit rows (fp32: clusters), raw parameters");
  static_assert(VB == 16 || RAW_PAR, "8-byte vectors: raw parameters only");
  static_assert(!F32P || (RAW_PAR && VB == 16), "fp32 parameter vectors: the raw path's 16-byte vectors");
  static_assert(!CL || (RAW_PAR && LATE), "clusters: raw parameters (offset to the rank's columns), after the sums");
  using PT = std::conditional_t<F32P, float, T>;                   // the parameters' element type
  using PV = std::conditional_t<F32P, float4, Row1Vec<VB>>;  // a parameter slot's w or b as loaded
  __shared__ __align__(16) float s_part[2][W];  // (sum, sum of squares) x (warp partials, W)
#if !defined(FW_HAS_BULK)
  if constexpr (CL) {  // (planned on sm_90 binaries only)
    __trap();
    return;
  }
#endif
  // CL: the exchange, an mbarrier and the ranks' (sum, M2) slots (kFwdMaxCluster)
  [[maybe_unused]] __shared__ __align__(8) std::uint64_t s_xbar[1];
  [[maybe_unused]] __shared__ __align__(8) float2 s_xsum[CL ? kFwdMaxCluster : 1];
  const int rank = CL ? cluster_rank() : 0, ncta = CL ? cluster_size() : 1;
  const int c0 = rank * cl_cols;                             // CL: this rank's first column
  const int n = CL ? min(cl_cols, int(p.n) - c0) : int(p.n);  // and its column count (else the row's)
  const int tpr = int(blockDim.x);
  if constexpr (CL) {
#if defined(FW_HAS_BULK)
    if (threadIdx.x == 0) mbar_init(&s_xbar[0], 1);  // one arrival (thread 0, with the bytes it expects)
    mbar_init_fence();
#endif
    cluster_arrive();  // (waited for before the exchange: every peer's mbarrier is ready)
  }
  // rows in memory order, each row's parameter group from r (rows (x C) < 2^31: 32-bit divisions)
  const std::uint32_t r = CL ? blockIdx.x / unsigned(ncta) : blockIdx.x;
  const std::uint32_t g = p.group_of_row<std::uint32_t>(r);
  // x and (IO-dtype, aligned) parameters kept raw across the sums: 12 registers per vector instead
  // of 3 E floats (60 -> 32 registers at bf16, VPT 1: more CTAs per SM); aligned rows: a vector is
  // wholly inside the row or wholly past it (zeros)
  const T* xrow = static_cast<const T*>(p.x) + p.x_rows.offset32(r) + c0;
  const PT* wrow = RAW_PAR && p.w ? static_cast<const PT*>(p.w) + g * p.w_group_stride + c0 : nullptr;
  const PT* brow = RAW_PAR && p.b ? static_cast<const PT*>(p.b) + g * p.b_group_stride + c0 : nullptr;
  Row1Vec<VB> xr[VPT];
  // the parameters in slots: a vector each, or (F32P) half a vector each, a float4 of w and of b (the slot is
  // the prefetch unit, so PD = 1 keeps 16 registers in flight either way)
  constexpr int SPV = F32P ? 2 : 1, NS = VPT * SPV;  // slots per vector, slots
  PV wr[NS], br[NS];
  auto load_par_k = [&](int j) {  // slot j
    const int col = (j / SPV * tpr + int(threadIdx.x)) * EV;
    wr[j] = br[j] = PV{};
    if constexpr (F32P) {
      if (col < n) {
        const int c = col + 4 * (j % SPV);
        if (wrow) wr[j] = NC ? __ldg(reinterpret_cast<const float4*>(wrow + c)) : *reinterpret_cast<const float4*>(wrow + c);
        if (brow) br[j] = NC ? __ldg(reinterpret_cast<const float4*>(brow + c)) : *reinterpret_cast<const float4*>(brow + c);
      }
    } else {
      if (wrow) wr[j] = row1_load<T, VB, NC>(wrow, col, n);
      if (brow) br[j] = row1_load<T, VB, NC>(brow, col, n);
    }
  };
  auto load_par = [&] {
#pragma unroll
    for (int j = 0; j < NS; ++j) load_par_k(j);
  };
#pragma unroll
  for (int k = 0; k < VPT; ++k) xr[k] = row1_load<T, VB, NC>(xrow, (k * tpr + int(threadIdx.x)) * EV, n);
  if constexpr (RAW_PAR && !LATE) load_par();
  float xf[RX ? 1 : VPT][EV];  // (VPT, EV) fp32, 0 past the row end (RX: unpacked from xr at each use)
  if constexpr (!RX) {
#pragma unroll
    for (int k = 0; k < VPT; ++k) row1_unpack<T, VB>(xr[k], xf[k]);
  }
  // RX: the tree over a thread's VPT x EV values of value_of(k, f) (vector k): each vector's tree, then the tree
  // over vectors (tree_sum's halving order: the same bits as the other instances' one tree over all)
  auto rx_sum = [&](auto&& value_of) {
    float s[VPT];
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      float f[EV];
      value_of(k, f);
      s[k] = tree_sum<EV>(f);
    }
    return tree_sum<VPT>(s);
  };
  auto rx_x = [&](int k, float (&f)[EV]) { row1_unpack<T, VB>(xr[k], f); };
  // the slots of warps this CTA does not have stay zero (written before the first barrier, by
  // threads other than the writers of live slots)
  const int nw = tpr >> 5;
  if (int(threadIdx.x) >= nw && threadIdx.x < W) s_part[0][threadIdx.x] = s_part[1][threadIdx.x] = 0.f;
  const float inv_n = 1.f / float(n);  // (CL: this rank's columns)
  float mean = 0.f, s_cta = 0.f;
  if (!p.rms) {
    float s;
    if constexpr (RX) s = rx_sum(rx_x);
    else s = tree_sum<VPT * EV>(&xf[0][0]);
    s_cta = row1_cta_sum<W>(s, s_part[0]);
    mean = s_cta * inv_n;
  } else {
    __syncthreads();  // the zeros above before the one sum's reads
  }
  // (x - mean)^2 of vector k into f, 0 past the row end (RX: f holds vector k of x on entry; else x is xf[k])
  auto sq_of = [&](int k, float (&f)[EV]) {
    const bool in = (k * tpr + int(threadIdx.x)) * EV < n;
#pragma unroll
    for (int e = 0; e < EV; ++e) {
      const float d = (RX ? f[e] : xf[k][e]) - mean;
      f[e] = in ? d * d : 0.f;
    }
  };
  float sq[RX ? 1 : VPT][EV];  // (VPT, EV) (x - mean)^2 (RX: computed at the sum)
  if constexpr (!RX) {
#pragma unroll
    for (int k = 0; k < VPT; ++k) sq_of(k, sq[k]);
  }
  if constexpr (PD > 0) {  // the first PD slots' parameters in flight across the second sum
#pragma unroll
    for (int j = 0; j < (PD < NS ? PD : NS); ++j) load_par_k(j);
  }
  float ss;
  if constexpr (RX) {
    ss = rx_sum([&](int k, float (&f)[EV]) {
      rx_x(k, f);
      sq_of(k, f);
    });
  } else {
    ss = tree_sum<VPT * EV>(&sq[0][0]);
  }
  const float ss_cta = row1_cta_sum<W>(ss, s_part[1]);
  float rstd;
  if constexpr (CL) {
#if defined(FW_HAS_BULK)
    cluster_wait();
    // this rank's (sum, M2) into slot `rank` of every rank (thread c sends to rank c); thread 0 posts the C * 8 bytes
    // its mbarrier expects (one phase: a cluster serves one row)
    if (threadIdx.x == 0) mbar_arrive_expect_tx(&s_xbar[0], 8u * unsigned(ncta));
    if (int(threadIdx.x) < ncta) st_async_float2(&s_xsum[rank], make_float2(s_cta, ss_cta), &s_xbar[0], int(threadIdx.x));
    mbar_wait_cluster(&s_xbar[0], 0u);
    cluster_merge_stats(s_xsum, ncta, cl_cols, p, mean, rstd);
#else
    rstd = 0.f;
#endif
  } else {
    rstd = rsqrtf(ss_cta * inv_n + p.eps);
  }
  if constexpr (RAW_PAR && LATE && PD == 0) load_par();
  T* yrow = static_cast<T*>(p.y) + p.y_rows.offset32(r) + c0;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    if constexpr (PD > 0) {  // PD slots ahead: at most PD + 1 slots' parameters live
      if (k * SPV + PD < NS) load_par_k(k * SPV + PD);
    }
    const int col = (k * tpr + int(threadIdx.x)) * EV;
    if (col >= n) continue;
    float sc[EV], bi[EV], out[EV], xk[EV];
    if constexpr (RX) rx_x(k, xk);
    if constexpr (F32P) {
#pragma unroll
      for (int h = 0; h < SPV; ++h) {  // slot k * SPV + h: elements [4 h, 4 h + 4)
        const int j = k * SPV + h;
        if (h > 0 && PD > 0 && j + PD < NS) load_par_k(j + PD);
        const float4 w4 = wr[j], b4 = br[j];  // zeros without bias
        const float wv[4] = {w4.x, w4.y, w4.z, w4.w}, bv[4] = {b4.x, b4.y, b4.z, b4.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[4 * h + e] = p.w ? p.weight_offset + wv[e] : 1.f, bi[4 * h + e] = bv[e];
      }
    } else if constexpr (RAW_PAR) {
      row1_unpack<T, VB>(wr[k], sc);
      row1_unpack<T, VB>(br[k], bi);  // zeros without bias
#pragma unroll
      for (int e = 0; e < EV; ++e) sc[e] = p.w ? p.weight_offset + sc[e] : 1.f;
    } else {
      load_params_vec<T, true>(p, g, col, n, sc, bi);
    }
#pragma unroll
    for (int e = 0; e < EV; ++e) out[e] = ((RX ? xk[e] : xf[k][e]) - mean) * rstd * sc[e] + bi[e];
    row1_store<T, VB>(yrow, col, out);
  }
  if (threadIdx.x == 0 && rank == 0) {
    if (p.mean) p.mean[r] = mean;
    if (p.rstd) p.rstd[r] = rstd;
  }
}

// Persistent variant for longer rows: P CTAs per group walk their rows; raw vectors in registers,
// converted per element per pass (fp32 copies of 4 vectors would not fit the register bound).
// The group's scale and bias are staged once per CTA as fp32 in dynamic shared memory (1 and 0
// without them), so each row's output pass reads 2 x E floats per vector from shared memory instead
// of loading, converting and offsetting the parameters again (one code path: a runtime choice
// between the two spilled registers at 80 per thread). Layout, float4 units, nvec = N_pad / E vectors:
// scale quarter i of vector v at [i * nvec + v], bias at [N_pad / 4 + i * nvec + v], so a warp's
// 16-byte reads of one quarter are consecutive (no bank conflicts for E = 8). Staged by vector loads
// after the first row's x loads are issued, so those overlap the staging.
// Vector v's scale and bias (E each, fp32) into `stage` (layout above).
template <int E>
__device__ __forceinline__ void put_fwd_params(float4* stage, int nvec, int v, const float (&sc)[E], const float (&bi)[E]) {
  const int bias4 = nvec * (E / 4);
#pragma unroll
  for (int i = 0; i < E / 4; ++i) {
    stage[i * nvec + v] = make_float4(sc[4 * i], sc[4 * i + 1], sc[4 * i + 2], sc[4 * i + 3]);
    stage[bias4 + i * nvec + v] = make_float4(bi[4 * i], bi[4 * i + 1], bi[4 * i + 2], bi[4 * i + 3]);
  }
}
// The group's scale and bias into `stage` (layout above), a vector of parameters per load, spread
// over the CTA's threads: vectors first, first + blockDim.x, ... (first = threadIdx.x: all of them);
// the caller syncs before reading them.
template <typename T, bool ALIGNED, int UNROLL>
__device__ __forceinline__ void stage_fwd_params(const RowNormParams& p, std::int64_t g, int n, float4* stage,
                                                 int first = int(threadIdx.x)) {
  constexpr int E = kVecElems<T>;
  const int nvec = (n + E - 1) / E;
#pragma unroll UNROLL
  for (int v = first; v < nvec; v += blockDim.x) {
    float sc[E], bi[E];
    load_params_vec<T, ALIGNED>(p, g, v * E, n, sc, bi);
    put_fwd_params<E>(stage, nvec, v, sc, bi);
  }
}

#define FW_CACHED_BOUNDS(BIG) __launch_bounds__((BIG) ? kMaxTpr : kSmallCta, (BIG) ? 1 : 3)
template <typename T, int VPT, bool ALIGNED, bool BIG>
__global__ void FW_CACHED_BOUNDS(BIG) rownorm_fwd_cached_kernel(const RowNormParams p, const RowLaunch L) {
  constexpr int E = kVecElems<T>;
  __shared__ float s_red[kMaxTpr / 32];
  const int n = int(p.n);
  const std::int64_t g = blockIdx.x / L.P, pi = blockIdx.x % L.P;
  const int R = blockDim.x / L.tpr, rg = threadIdx.x / L.tpr, lane = threadIdx.x % L.tpr;
  const std::int64_t J = p.rows_per_group, jstep = std::int64_t(L.P) * R;
  const float inv_n = 1.f / float(n);
  extern __shared__ float4 fwd_stage[];  // (E/4, nvec) float4 scale | (E/4, nvec) float4 bias (see above)
  const int nvec = (n + E - 1) / E, bias4 = nvec * (E / 4);

  auto load_row = [&](std::int64_t j, uint4 (&v)[VPT]) {
    const bool ok = j < J;
    const T* xr = static_cast<const T*>(p.x) + p.x_rows.offset(p.row_of(g, ok ? j : 0));
#pragma unroll
    for (int k = 0; k < VPT; ++k) v[k] = load_raw<T>(xr, (k * L.tpr + lane) * E, ok ? n : 0, ALIGNED);
  };
  uint4 xv[VPT], xnext[VPT];  // (VPT) raw vectors each: this thread's columns (k * tpr + lane) * E + [0, E)
  load_row(pi * R + rg, xv);
  stage_fwd_params<T, ALIGNED, 4>(p, g, n, fwd_stage);
  __syncthreads();
  for (std::int64_t j0 = pi * R; j0 < J; j0 += jstep) {
    const std::int64_t j = j0 + rg;
    load_row(j + jstep, xnext);  // in flight while this row is reduced and written
    const bool valid = j < J;
    const int nv = valid ? n : 0;
    float mean = 0.f;
    if (!p.rms) {
      float s = 0.f;
#pragma unroll
      for (int k = 0; k < VPT; ++k)
#pragma unroll
        for (int e = 0; e < E; ++e) s += raw_get<T>(xv[k], e);
      mean = row_sum(s, L.tpr, s_red) * inv_n;
    }
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int col = (k * L.tpr + lane) * E;
      const bool vin = col < nv;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const float d = (ALIGNED ? vin : col + e < nv) ? raw_get<T>(xv[k], e) - mean : 0.f;
        ss += d * d;
      }
    }
    const float rstd = rsqrtf(row_sum(ss, L.tpr, s_red) * inv_n + p.eps);
    if (valid) {
      const std::int64_t r = p.row_of(g, j);
      T* yr = static_cast<T*>(p.y) + p.y_rows.offset(r);
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int col = (k * L.tpr + lane) * E;
        if (col >= n) continue;
        float sc[E], bi[E], out[E];
#pragma unroll
        for (int i = 0; i < E / 4; ++i) {  // 32-bit shared addressing off the array itself
          const float4 a = fwd_stage[i * nvec + col / E], c = fwd_stage[bias4 + i * nvec + col / E];
          sc[4 * i] = a.x, sc[4 * i + 1] = a.y, sc[4 * i + 2] = a.z, sc[4 * i + 3] = a.w;
          bi[4 * i] = c.x, bi[4 * i + 1] = c.y, bi[4 * i + 2] = c.z, bi[4 * i + 3] = c.w;
        }
#pragma unroll
        for (int e = 0; e < E; ++e) out[e] = (raw_get<T>(xv[k], e) - mean) * rstd * sc[e] + bi[e];
        store_vec<T>(yr, col, n, ALIGNED, out);
      }
      if (lane == 0) {
        if (p.mean) p.mean[r] = mean;
        if (p.rstd) p.rstd[r] = rstd;
      }
    }
#pragma unroll
    for (int k = 0; k < VPT; ++k) xv[k] = xnext[k];
  }
}


// ---- backward, cached ---------------------------------------------------------------------------
// dW/dB partials in fp32 registers over the CTA's rows (each thread always owns the same columns),
// combined over the CTA's row groups in a fixed order at the end: one partial row per CTA,
// ws[(p * G + g) * N + c].
template <typename T, int VPT, bool PAD>
__device__ __forceinline__ void write_partials(float* ws, const float (&acc)[VPT][kVecElems<T>], std::int64_t slot, int n,
                                               int tpr, int R, int rg, int lane, float* s_comb) {
  constexpr int E = kVecElems<T>;
  if (R == 1) {
#pragma unroll
    for (int k = 0; k < VPT; ++k)
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const int c = (k * tpr + lane) * E + e;
        if (c < n) ws[slot + c] = acc[k][e];
      }
    return;
  }
  // s_comb: (R, ceil(n / E), E + 1) with PAD -- each vector of E columns padded to E + 1 floats, so
  // that a warp's scalar stores (lanes E words apart unpadded: 8-way bank conflicts) hit distinct
  // banks; else (R, n) (the unaligned kernels: the padded indexing spilled there)
  constexpr int EP = PAD ? E + 1 : E;
  const int group_floats = PAD ? (n + E - 1) / E * EP : n;
  __syncthreads();  // s_comb may alias buffers other row groups still read
#pragma unroll
  for (int k = 0; k < VPT; ++k)
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const int v = k * tpr + lane;
      if (v * E + e < n) s_comb[rg * group_floats + v * EP + e] = acc[k][e];
    }
  __syncthreads();
  for (int c = threadIdx.x; c < n; c += blockDim.x) {
    float t = 0.f;
    const float* src = s_comb + (PAD ? (c / E) * EP + c % E : c);
    for (int i = 0; i < R; ++i) t += src[i * group_floats];
    ws[slot + c] = t;
  }
}

// s_comb floats write_partials<..., PAD> needs for R row groups of n columns (E per vector)
inline std::size_t partials_comb_floats(int R, std::int64_t n, int elems, bool pad) {
  if (R <= 1) return 0;
  return pad ? std::size_t(R) * std::size_t((n + elems - 1) / elems) * std::size_t(elems + 1) : std::size_t(R) * std::size_t(n);
}

// The group's scale (weight_offset + w, or 1) as fp32 in shared memory, once per CTA; 0 in the padding.
// col0 / n_cols: the columns [col0, col0 + n_cols) only (a cluster's CTA; n_pad covers n_cols), -1: all.
// A vector of E parameters per load (16 bytes where they are aligned) and 4 vectors per thread in
// flight: at N = 16384 the scalar loop's 32 dependent L2 round trips per thread were 8-12% of the
// ring kernel's stall samples (ncu source counters, 4096 x 4096 / 16384 bf16).
template <typename T, bool ALIGNED>
__device__ __forceinline__ void stage_scale(const RowNormParams& p, std::int64_t g, int n_pad, float* s_scale,
                                            int col0 = 0, int n_cols = -1) {
  constexpr int E = kVecElems<T>;
  const int n = int(p.n), nvec = n_pad / E, nc = n_cols < 0 ? n : n_cols;
  float4* s4 = reinterpret_cast<float4*>(s_scale);
#pragma unroll 4
  for (int v = threadIdx.x; v < nvec; v += blockDim.x) {
    float sc[E], unused[E];
    load_params_vec<T, ALIGNED>(p, g, col0 + v * E, n, sc, unused, /*bias=*/false);
#pragma unroll
    for (int e = 0; e < E; ++e)
      if (v * E + e >= nc) sc[e] = 0.f;  // 0 past the row end (past this CTA's columns)
#pragma unroll
    for (int i = 0; i < E / 4; ++i) s4[v * (E / 4) + i] = make_float4(sc[4 * i], sc[4 * i + 1], sc[4 * i + 2], sc[4 * i + 3]);
  }
  __syncthreads();
}

// ---- weight-gradient finalize: out[g, c] = sum_{p < P} ws[(p * G + g) * N + c], fixed order ------
// Block (32, kFinSlices): 32 x kFinCols consecutive columns (coalesced), kFinSlices strided slices of
// p, then a fixed-order sum of the slice sums in shared memory. blockIdx.y picks the gradient (dW, dB): one
// launch for both. (32 slices measured 4-9 us slower in the backward's total at 4096 x 8192/16384.)
inline constexpr int kFinSlices = 8;
inline constexpr int kFinCols = 4;  // consecutive columns per thread
struct WgradJob {
  const float* ws[2] = {nullptr, nullptr};  // (P, G, N) fp32 partials
  void* out[2] = {nullptr, nullptr};        // (G, N) at out_group_stride, fp32 or the IO dtype
  std::int64_t out_group_stride[2] = {0, 0};
};
// One block of the finalize: partials ws (P, G, N) into out_p (G, N at out_stride), the 32 x kFinCols columns from
// bx * 32 * kFinCols, by the (32, kFinSlices) threads (tx, ty) over s_part (kFinSlices, 32); every thread of the
// CTA calls it (a barrier inside), `active` false for those without a block this round.
template <typename T>
__device__ __forceinline__ void wgrad_finalize_block(const float* __restrict__ ws, void* const out_p,
                                                     const std::int64_t out_stride, std::int64_t bx, unsigned tx,
                                                     unsigned ty,
                                                     bool active, float4 (*s_part)[32], std::int64_t P, std::int64_t G,
                                                     std::int64_t n, bool out_f32) {
  const std::int64_t cols = G * n;
  const std::int64_t gc0 = (bx * 32 + tx) * kFinCols;
  float4 t = make_float4(0.f, 0.f, 0.f, 0.f);
  if (active && gc0 < cols) {
    std::int64_t q = ty;
    if (cols % 4 == 0) {
      const float4* __restrict__ w4 = reinterpret_cast<const float4*>(ws);
      const std::int64_t c4 = cols / 4, i4 = gc0 / 4;
      // 4 rows in flight, added in the same order as one at a time: each column's sum is the
      // sequence ws[q] for q = y, y + kFinSlices, ... whatever the unrolling
      for (; q + 3 * kFinSlices < P; q += 4 * kFinSlices) {
        const float4 a0 = w4[q * c4 + i4], a1 = w4[(q + kFinSlices) * c4 + i4];
        const float4 a2 = w4[(q + 2 * kFinSlices) * c4 + i4], a3 = w4[(q + 3 * kFinSlices) * c4 + i4];
        t.x += a0.x, t.y += a0.y, t.z += a0.z, t.w += a0.w;
        t.x += a1.x, t.y += a1.y, t.z += a1.z, t.w += a1.w;
        t.x += a2.x, t.y += a2.y, t.z += a2.z, t.w += a2.w;
        t.x += a3.x, t.y += a3.y, t.z += a3.z, t.w += a3.w;
      }
      for (; q < P; q += kFinSlices) {
        const float4 a = w4[q * c4 + i4];
        t.x += a.x, t.y += a.y, t.z += a.z, t.w += a.w;
      }
    } else {
      for (; q < P; q += kFinSlices) {
        const float* row = ws + q * cols + gc0;
        t.x += row[0];
        if (gc0 + 1 < cols) t.y += row[1];
        if (gc0 + 2 < cols) t.z += row[2];
        if (gc0 + 3 < cols) t.w += row[3];
      }
    }
  }
  s_part[ty][tx] = t;
  __syncthreads();
  if (active && ty == 0 && gc0 < cols) {
    float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int i = 0; i < kFinSlices; ++i) {
      const float4 v = s_part[i][tx];
      s.x += v.x, s.y += v.y, s.z += v.z, s.w += v.w;
    }
#pragma unroll
    for (int i = 0; i < kFinCols; ++i) {
      const std::int64_t gc = gc0 + i;
      if (gc < cols) {
        const std::int64_t g = gc / n, c = gc - g * n;
        const float v = i == 0 ? s.x : i == 1 ? s.y : i == 2 ? s.z : s.w;
        store_param<T>(out_p, g * out_stride + c, out_f32, v);
      }
    }
  }
}
// Aligned rows ("ring"): 512 threads, one CTA per SM, R = 512 / tpr row groups that run independently
// (a named barrier per row group), each streaming its rows through its own cp.async ring of
// kRingStages rows. 4 vectors per thread: a row of 8192 bf16 is one row group of 256 threads, so the
// per-row work (reduction, barriers, addressing) is spread over 32 elements. The row stays in shared
// memory, so the dx pass re-reads it there instead of holding xhat and g in registers (64 partials
// already take half the register budget).
// Rows past kRingMaxN (Hopper): CLU, a cluster of C CTAs (2..8) per row group, rank c holding the cl_cols
// columns from c * cl_cols of the same rows; each rank's row sums go to every rank's shared memory by st.async,
// completing on that rank's mbarrier (one per row-group slot and row parity), and every rank adds the C of
// them in rank order (the same bits everywhere). One pass over x and dy, where the long-row path (rowsum +
// coltile) reads them twice.
// smem: (S, 2, VPT, 512) 16-byte vectors (x then dy) | (S, 2, 512) floats (mean, rstd) | scale (N, or
// cl_cols, padded to E) | row sums (2 parities, 16 warps) float2 | CLU: mbarriers (2, R) u64 | the ranks' sums
// (2, R, kRingMaxCluster) float2 -- the partials (R, N / E, E + 1 floats) reuses the ring after the loop.
inline constexpr int kRingThreads = 512;
inline constexpr int kRingVecs = 4;
inline constexpr int kRingStages = 2;
// Shorter rows lose to the 2-vector kernel (H100, bf16 backward: 4096 x 1024 0.0250 vs 0.0234 ms,
// head norm 16384 x 16 x 128 0.111 vs 0.091 ms; equal at 4096 x 2048; from N = 4096 the ring wins:
// 0.0575 vs 0.0744 ms).
inline constexpr int kRingMinTpr = 64;
template <typename T> inline constexpr std::int64_t kRingMaxN = std::int64_t(kRingThreads) * kRingVecs * kVecElems<T>;

inline constexpr int kRingMaxCluster = 8;  // portable cluster sizes
// n: the CTA's columns (cl_cols in a cluster); cluster: its exchange slots for R row groups (0: none); stages: the
// ring's rows per row group (kRingStages, or 3: set_rownorm_bwd_ring_stages)
// prod_slots (the producer-warp ring): its consumer threads R tpr, the slots' stride, with (2, R, stages) mbarriers
inline std::size_t ring_smem_bytes(std::int64_t n, int elems, int vpt = kRingVecs, int cluster_groups = 0,
                                   int stages = kRingStages, int prod_slots = 0, int prod_groups = 0) {
  const std::size_t n_pad = std::size_t((n + elems - 1) / elems * elems);
  const std::size_t slots = prod_slots > 0 ? std::size_t(prod_slots) : std::size_t(kRingThreads);
  return std::size_t(stages) * slots * (2 * std::size_t(vpt) * 16 + 2 * sizeof(float)) +
         n_pad * sizeof(float) + 2 * (kRingThreads / 32) * sizeof(float2) +
         std::size_t(cluster_groups) * 2 * (sizeof(std::uint64_t) + kRingMaxCluster * sizeof(float2)) +
         std::size_t(prod_groups) * 2 * std::size_t(stages) * sizeof(std::uint64_t);
}
// The producer-warp ring's consumer threads (R tpr <= this; one warp more copies).
inline constexpr int kRingProdConsumers = kRingThreads - 32;

// E fp32 scale values at `col` (a multiple of E) from shared memory, as float4 vectors.
template <int E>
__device__ __forceinline__ void scale_vec(const float* s_scale, int col, float (&sc)[E]) {
  const float4* s4 = reinterpret_cast<const float4*>(s_scale + col);
#pragma unroll
  for (int i = 0; i < E / 4; ++i) {
    const float4 t = s4[i];
    sc[4 * i] = t.x; sc[4 * i + 1] = t.y; sc[4 * i + 2] = t.z; sc[4 * i + 3] = t.w;
  }
}

// bar.sync on barrier `id` (1..15) for `count` threads: only this row group waits.
__device__ __forceinline__ void group_barrier(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// VPT: vectors per thread, kRingVecs; 3 where that fills more of a row group's threads (set_rownorm_bwd_ring3).
// CLU: launched in clusters that split the row's columns (cl_cols per rank, a multiple of E; above).
// STAGES: rows per row group's ring (kRingStages; 3 with set_rownorm_bwd_ring_stages, one row group per CTA: two rows
// in flight while one is reduced). A CTA may hold fewer than 512 threads (R whole row groups of any multiple of 32, set_rownorm_bwd_ring_tight);
// its shared-memory layout keeps 512 threads' slots.
// RMS (set_rownorm_bwd_ring_rms; RMSNorm rows only, p.rms): the mean (0) and the row sum of g left out at compile
// time, with the bias partials (RMSNorm has none): the same bits with fewer instructions per element.
// SREG (set_rownorm_bwd_ring_sreg; not in clusters): the thread's scale values held in registers across the rows, as
// raw vectors of T (VPT x 4 registers), in place of 2 x VPT x E / 4 shared-memory loads per row (ncu, RMSNorm 4096 x
// 12288: short-scoreboard stalls, i.e. shared memory, 36% of the cycles between issues). Only where the fp32 scale is
// exactly a T (the planner's rule: fp32 rows, no weight, or a weight of the IO dtype with weight_offset 0), so the
// same bits. L.stat_mask ~31: lane 0 of each warp copies the row's mean / rstd, the warp's lanes read its slot (one
// 4-byte cp.async per warp instead of per thread); the same values.
// PROD (set_rownorm_bwd_ring_prod; Hopper, not in clusters): a producer warp after the R tpr <= 480 consumer threads
// feeds the rings, as cuDNN's ln_tma_bwd_kernel does (ncu, session 50: its 17th warp, L1 24% busy against our 74%).
// Its lane q serves row group q: per row, the statistics by cp.async (arriving on the slot's "full" mbarrier when
// they land), then x and dy by bulk copies of tpr vectors (the TMA engine, counted in bytes on the same mbarrier);
// a slot is refilled once every consumer warp of the group has arrived on its "empty" mbarrier after pass 2, so no
// consumer waits on another's reads (session 50's bulk forms put a barrier there and lost 3-8%). The slots' stride
// is R tpr, not 512. Rows past J get the statistics (zeros) and no copy: their stale slots add nothing (masked).
template <typename T, int VPT = kRingVecs, bool CLU = false, int STAGES = kRingStages, bool RMS = false,
          bool SREG = false, bool PROD = false>
__global__ void __launch_bounds__(kRingThreads, 1) rownorm_bwd_ring_kernel(const RowNormParams p, const RowLaunch L,
                                                                          float* __restrict__ ws_dw,
                                                                          float* __restrict__ ws_db, int cl_cols = 0) {
  static_assert(!(CLU && STAGES != kRingStages), "the cluster ring: kRingStages");
  static_assert(!(CLU && SREG), "scale registers: the plain ring");
  static_assert(!(CLU && PROD), "the producer warp: the plain ring");
  constexpr int E = kVecElems<T>, S = STAGES, NT = kRingThreads;
#if !defined(FW_HAS_BULK)
  if constexpr (CLU || PROD) {  // (planned on sm_90 binaries only)
    __trap();
    return;
  }
#endif
  extern __shared__ uint4 smem_v[];
  const int rank = CLU ? cluster_rank() : 0, ncta = CLU ? cluster_size() : 1;
  const int c0 = rank * cl_cols;                                 // this CTA's first column
  const int n = CLU ? min(cl_cols, int(p.n) - c0) : int(p.n);     // and its column count
  // (CLU: every rank lays out cl_cols, so that the exchange slots below sit at the same offset in each CTA, as
  // st.async addresses them; the last rank may hold fewer columns)
  const int n_pad = ((CLU ? cl_cols : n) + E - 1) / E * E;
  const int tid = threadIdx.x, tpr = L.tpr, R = (PROD ? kRingProdConsumers : NT) / tpr, rg = tid / tpr, lane = tid % tpr;
  const int ns = PROD ? R * tpr : NT;  // the slots' stride: 512 threads' (PROD: the consumers')
  uint4* s_pipe = smem_v;                                              // (S, 2, VPT, ns)
  float* s_stat = reinterpret_cast<float*>(smem_v + S * 2 * VPT * ns);  // (S, 2, ns)
  float* s_scale = s_stat + S * 2 * ns;                                // (n_pad)
  float2* s_red = reinterpret_cast<float2*>(s_scale + n_pad);          // (2, NT / 32)
  std::uint64_t* s_xbar = reinterpret_cast<std::uint64_t*>(s_red + 2 * (NT / 32));  // CLU: (2, R); PROD: (2, R, S)
  [[maybe_unused]] float2* s_xsum = reinterpret_cast<float2*>(s_xbar + 2 * R);       // CLU: (2, R, kRingMaxCluster)
  const unsigned cta = CLU ? blockIdx.x / unsigned(ncta) : blockIdx.x;  // the cluster, or the CTA (32-bit divisions)
  const std::int64_t g = cta / L.P, pi = cta % L.P;
  const float inv_n = 1.f / float(p.n);
  const std::int64_t J = p.rows_per_group, jstep = std::int64_t(L.P) * R;
  if constexpr (CLU) {
#if defined(FW_HAS_BULK)
    if (tid < 2 * R) mbar_init(&s_xbar[tid], 1);  // one arrival per phase: the row group's lane 0, with the bytes
    mbar_init_fence();
#endif
    cluster_arrive();  // (waited for below, before the first exchange: the peers' mbarriers are ready)
  }
  [[maybe_unused]] std::uint64_t* s_full = s_xbar;       // PROD: (R, S) the slot's statistics and bytes have landed
  [[maybe_unused]] std::uint64_t* s_empty = s_xbar + R * S;  // PROD: (R, S) its consumer warps are done with it
  [[maybe_unused]] const bool producer = PROD && rg >= R;   // PROD: the last warp
  if constexpr (PROD) {
#if defined(FW_HAS_BULK)
    if (!producer) {  // the vectors past the row end, which no copy writes: zeros (dy = 0 keeps the sums exact)
#pragma unroll
      for (int k = 0; k < VPT; ++k)
        if ((k * tpr + lane) * E >= n)
          for (int st = 0; st < S; ++st) s_pipe[((st * 2 + 0) * VPT + k) * ns + tid] = s_pipe[((st * 2 + 1) * VPT + k) * ns + tid] = uint4{};
    }
    // full: two arrivals per phase (the statistics' cp.async, then the copies' byte count); empty: one per consumer warp
    if (tid < R * S) mbar_init(&s_full[tid], 2);
    else if (tid < 2 * R * S) mbar_init(&s_xbar[tid], unsigned(tpr / 32));
    mbar_init_fence();  // (published by stage_scale's barrier below, before the producer's first copy)
#endif
  }
  // the slot of the row's statistics this thread reads (L.stat_mask: its own, or its warp's first, copied by lane 0)
  const int stat_tid = tid & L.stat_mask;
  auto issue_row = [&](std::int64_t j, int stage) {  // cp.async into this thread's own slots
    const bool ok_row = j < J;
    const std::int64_t r = p.row_of(g, ok_row ? j : 0);  // rows past J: zero-filled (rstd 0: no effect)
    const T* xr = static_cast<const T*>(p.x) + p.x_rows.offset_lean(r) + c0;
    const T* dyr = static_cast<const T*>(p.dy) + p.dy_rows.offset_lean(r) + c0;
    if (stat_tid == tid) {
      if constexpr (!RMS) cp_async4(&s_stat[(stage * 2 + 0) * NT + tid], p.rms ? p.rstd + r : p.mean + r, ok_row && !p.rms);
      cp_async4(&s_stat[(stage * 2 + 1) * NT + tid], p.rstd + r, ok_row);
    }
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int col = (k * tpr + lane) * E;
      const bool ok = ok_row && col < n;
      cp_async16(&s_pipe[((stage * 2 + 0) * VPT + k) * NT + tid], xr + (ok ? col : 0), ok);
      cp_async16(&s_pipe[((stage * 2 + 1) * VPT + k) * NT + tid], dyr + (ok ? col : 0), ok);
    }
  };
  float acc_dw[VPT][E] = {}, acc_db[VPT][E] = {};  // (VPT, E) fp32 partial sums over this thread's rows
  if constexpr (!PROD) {
#pragma unroll
    for (int s = 0; s < S - 1; ++s) {
      issue_row(pi * R + rg + s * jstep, s);
      cp_async_commit();
    }
  }
  stage_scale<T, true>(p, g, n_pad, s_scale, c0, n);  // while the first rows are in flight
  [[maybe_unused]] uint4 sreg[SREG ? VPT : 1];  // SREG: (VPT) this thread's scale vectors, raw T (exact: see above)
  if constexpr (SREG) {
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int col = (k * tpr + lane) * E;
      float sc[E];
      scale_vec<E>(s_scale, col < n ? col : 0, sc);  // (the column pass 1 reads)
      sreg[k] = pack<T>(sc);
    }
  }
  if constexpr (CLU) cluster_wait();
#if defined(FW_HAS_BULK)
  if constexpr (PROD) {
    if (producer) {  // lane q feeds row group q, the consumers' rows in their order
      const int q = tid - R * tpr, nvec = n / E;
      if (q < R) {
        unsigned itp = 0;
        for (std::int64_t j0 = pi * R; j0 < J; j0 += jstep, ++itp) {
          const int st = int(itp % unsigned(S));
          if (itp >= unsigned(S)) mbar_wait(&s_empty[q * S + st], (itp / unsigned(S) - 1) & 1u);
          const std::int64_t j = j0 + q;
          const bool ok_row = j < J;
          const std::int64_t r = p.row_of(g, ok_row ? j : 0);
          std::uint64_t* full = &s_full[q * S + st];
          if constexpr (!RMS) cp_async4(&s_stat[(st * 2 + 0) * ns + q * tpr], p.rms ? p.rstd + r : p.mean + r, ok_row && !p.rms);
          cp_async4(&s_stat[(st * 2 + 1) * ns + q * tpr], p.rstd + r, ok_row);  // (rows past J: zeros)
          cp_async_mbar_arrive(full);
          if (!ok_row) {
            mbar_arrive(full);
            continue;
          }
          mbar_arrive_expect_tx(full, 2u * unsigned(nvec) * 16u);
          const T* xr = static_cast<const T*>(p.x) + p.x_rows.offset_lean(r);
          const T* dyr = static_cast<const T*>(p.dy) + p.dy_rows.offset_lean(r);
#pragma unroll
          for (int k = 0; k < VPT; ++k) {  // chunk k: vectors k tpr .. of the row, (tpr) at k ns + q tpr
            const int v0 = k * tpr, cnt = min(tpr, nvec - v0);
            if (cnt <= 0) continue;
            bulk_g2s(&s_pipe[((st * 2 + 0) * VPT + k) * ns + q * tpr], xr + v0 * E, unsigned(cnt) * 16u, full);
            bulk_g2s(&s_pipe[((st * 2 + 1) * VPT + k) * ns + q * tpr], dyr + v0 * E, unsigned(cnt) * 16u, full);
          }
        }
        // the tail: every slot's last use consumed (no copy of this lane's outlives the consumers' reads)
        for (unsigned st = 0; st < unsigned(S) && st < itp; ++st) {
          const unsigned uses = (itp - st + unsigned(S) - 1) / unsigned(S);
          mbar_wait(&s_empty[q * S + int(st)], (uses - 1) & 1u);
        }
      }
      cp_async_wait<0>();
      return;  // (the partials below are the consumers': their barriers count R tpr threads; acc is dead here)
    }
  }
#endif
  int stage = 0, parity = 0;
  [[maybe_unused]] unsigned it = 0;  // CLU: rows so far (the exchange slot's parity and its mbarrier's phase)
  [[maybe_unused]] unsigned itc = 0;  // PROD: rows so far (the full mbarrier's phase)
  for (std::int64_t j0 = pi * R; j0 < J; j0 += jstep) {
    const std::int64_t j = j0 + rg;
    if constexpr (PROD) {
#if defined(FW_HAS_BULK)
      mbar_wait(&s_full[rg * S + stage], (itc / unsigned(S)) & 1u);
#endif
    } else {
      __syncwarp();  // (the lanes' reads of the slot lane 0 refills now, a row ago, are done)
      issue_row(j + (S - 1) * jstep, stage == 0 ? S - 1 : stage - 1);
      cp_async_commit();
      cp_async_wait<S - 1>();
      __syncwarp();  // lane 0's copy of the statistics, complete for lane 0, visible to the warp
    }
    const bool live = !PROD || j < J;  // (PROD: a row past J leaves a stale slot, which must add nothing)
    const uint4* sx = s_pipe + (stage * 2 + 0) * VPT * ns + tid;  // this thread's vectors k * ns
    const uint4* sdy = s_pipe + (stage * 2 + 1) * VPT * ns + tid;
    const int stat_at = PROD ? rg * tpr : stat_tid;  // (PROD: the row group's first slot, the producer's copy)
    const float mean = RMS ? 0.f : s_stat[(stage * 2 + 0) * ns + stat_at];
    const float rstd = s_stat[(stage * 2 + 1) * ns + stat_at];
    // pass 1: the row sums of g = dy * scale and g * xhat; the dW/dB partials
    float sg = 0.f, sgx = 0.f;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int col = (k * tpr + lane) * E;
      float xf[E], dyf[E], sc[E];  // (E) past the row end: x = dy = 0 (zero-filled), scale 0
      unpack<T>(sx[k * ns], xf);
      unpack<T>(sdy[k * ns], dyf);
      if constexpr (SREG) unpack<T>(sreg[k], sc);
      else scale_vec<E>(s_scale, col < n ? col : 0, sc);
#pragma unroll
      for (int e = 0; e < E; ++e) {
        // every rounding spelled out (intrinsics: ptxas contracts plain a * b + c at will, and differently in
        // the RMS instance, whose mean is a constant 0): the RMS and generic instances give the same bits.
        const float xh = __fmul_rn(xf[e] - mean, rstd);
        // __fmul_rn: one rounded product used in both the sums and dx (no FMA contraction), so that
        // g - mean(g) cancels exactly where it should (N = 1 gives dx = 0, not rounding noise).
        const float gg = __fmul_rn(dyf[e], sc[e]);
        if constexpr (!RMS) sg += gg;
        sgx = __fmaf_rn(gg, xh, sgx);
        if (live) {
          acc_dw[k][e] = __fmaf_rn(dyf[e], xh, acc_dw[k][e]);
          if constexpr (!RMS) acc_db[k][e] += dyf[e];
        }
      }
    }
    // the row group's sums: warp butterflies, then (tpr > 32) one named barrier over a
    // double-buffered scratch (the buffer is rewritten two rows later, after the next barrier)
    float2 sums = make_float2(RMS ? 0.f : group_sum_warp(sg, tpr), group_sum_warp(sgx, tpr));
    if (tpr > 32) {
      const int wpr = tpr >> 5, warp = tid >> 5;
      float2* buf = s_red + parity * (NT / 32);
      if ((tid & 31) == 0) buf[warp] = sums;
      group_barrier(1 + rg, tpr);
      sums = make_float2(0.f, 0.f);
      for (int i = 0; i < wpr; ++i) {
        const float2 t = buf[rg * wpr + i];
        sums.x += t.x;
        sums.y += t.y;
      }
      parity ^= 1;
    }
#if defined(FW_HAS_BULK)
    if constexpr (CLU) {
      // the cluster's sums: this rank's into slot `rank` of every rank (lane c sends to rank c), the row group's
      // lane 0 posting the C * 8 bytes it expects. A slot is written again two rows later, by a peer that has
      // had this CTA's next sums, which come after every thread of the row group has read this row's (its
      // barrier above); the phase is the slot's use count.
      const int xs = int(it & 1) * R + rg;
      float2* slot = s_xsum + xs * kRingMaxCluster;
      if (lane == 0) mbar_arrive_expect_tx(&s_xbar[xs], 8u * unsigned(ncta));
      if (lane < ncta) st_async_float2(slot + rank, sums, &s_xbar[xs], lane);
      mbar_wait_cluster(&s_xbar[xs], (it >> 1) & 1u);
      sums = slot[0];
      for (int c = 1; c < ncta; ++c) {
        const float2 t = slot[c];
        sums.x += t.x;
        sums.y += t.y;
      }
      ++it;
    }
#endif
    const float mg = RMS || p.rms ? 0.f : sums.x * inv_n;
    const float mgx = sums.y * inv_n;
    // pass 2: dx = rstd * (g - mean(g) - xhat * mean(g xhat)), the row re-read from shared memory
    if (j < J) {
      T* dxr = static_cast<T*>(p.dx) + p.dx_rows.offset_lean(p.row_of(g, j)) + c0;
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int col = (k * tpr + lane) * E;
        if (col >= n) continue;
        float xf[E], dyf[E], sc[E], out[E];
        unpack<T>(sx[k * ns], xf);
        unpack<T>(sdy[k * ns], dyf);
        if constexpr (SREG) unpack<T>(sreg[k], sc);
        else scale_vec<E>(s_scale, col, sc);
#pragma unroll
        for (int e = 0; e < E; ++e) {
          const float xh = __fmul_rn(xf[e] - mean, rstd);
          out[e] = rstd * __fmaf_rn(-xh, mgx, __fmul_rn(dyf[e], sc[e]) - mg);  // (RMS: g - 0 = g exactly)
        }
        store_vec<T>(dxr, col, n, true, out);
      }
    }
#if defined(FW_HAS_BULK)
    if constexpr (PROD) {  // this warp's reads of the slot are done: the producer may refill it
      __syncwarp();
      if ((tid & 31) == 0) mbar_arrive(&s_empty[rg * S + stage]);
      ++itc;
    }
#endif
    stage = stage == S - 1 ? 0 : stage + 1;
  }
  cp_async_wait<0>();
  if constexpr (CLU) cluster_arrive();  // (waited for at the end: no CTA leaves while a peer may write to it)
  pdl_launch_dependents();  // the finalize may be scheduled while the partials are written
  const std::int64_t slot = (pi * p.groups + g) * p.n + c0;
  // The partials through shared memory (the whole buffer is idle now), each row group's vectors of E
  // columns padded to E + 1 floats: scalar stores without bank conflicts (unpadded, a warp's store
  // strided E words: 8-way conflicts, ~15% of the stall samples at 4096 x 4096 with 4 row groups),
  // then the row groups' sum in a fixed order and float4 stores of 4 consecutive columns (aligned
  // rows: n % E == 0, slot * 4 bytes a multiple of 16). With one row group, stored straight from
  // registers instead, a thread's E consecutive columns made a stride-E pattern per instruction:
  // 0.198 ms against 0.170 at 4096 x 16384 bf16 (20% of the stall samples, in the tail).
  float* s_part = reinterpret_cast<float*>(smem_v);  // (R, n / E, E + 1)
  const int group_floats = n / E * (E + 1);
  // (PROD: the consumers only, on named barrier 15; their row groups use 1..R <= 7)
  auto cta_barrier = [&] {
    if constexpr (PROD) group_barrier(15, ns);
    else __syncthreads();
  };
#pragma unroll
  for (int w = 0; w < (RMS ? 1 : 2); ++w) {  // (RMS: no bias)
    float* out = w == 0 ? ws_dw : ws_db;
    if (out == nullptr) continue;
    cta_barrier();  // the previous reads of this buffer (the row loop, or the last gradient)
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int v = k * tpr + lane;  // this thread's vector of E columns
      if (v * E >= n) continue;
#pragma unroll
      for (int e = 0; e < E; ++e) s_part[rg * group_floats + v * (E + 1) + e] = w == 0 ? acc_dw[k][e] : acc_db[k][e];
    }
    cta_barrier();
    for (int c = tid * 4; c < n; c += (CLU ? NT : PROD ? ns : int(blockDim.x)) * 4) {  // (R tpr threads: 512, or fewer)
      const float* src = s_part + (c / E) * (E + 1) + c % E;
      float4 t = make_float4(src[0], src[1], src[2], src[3]);
      for (int i = 1; i < R; ++i) {
        const float* q = src + i * group_floats;
        t.x += q[0], t.y += q[1], t.z += q[2], t.w += q[3];
      }
      *reinterpret_cast<float4*>(out + slot + c) = t;
    }
  }
  if constexpr (CLU) cluster_wait();
}

// Short rows (ring tpr < kRingMinTpr) and unaligned rows: persistent CTAs of max(tpr, 256) threads,
// 2 vectors each of x and dy per thread; aligned rows come through a kStages-deep cp.async ring in
// per-thread slots, unaligned ones through a register double buffer. xhat and g stay in registers
// between the two passes.
// smem: scale (N) | reduction scratch (2 * blockDim / 32 + 2) | partial combine (R, ceil(N / E), E + 1) when R > 1
template <typename T, int VPT, bool ALIGNED, bool BIG>
__global__ void __launch_bounds__(BIG ? kMaxTpr : kSmallCta, BIG ? 1 : 2) rownorm_bwd_cached_kernel(
    const RowNormParams p, const RowLaunch L, float* __restrict__ ws_dw, float* __restrict__ ws_db) {
  constexpr int E = kVecElems<T>;
  constexpr int S = kStages;
  extern __shared__ uint4 smem_v[];
  const int n = int(p.n);
  // ALIGNED: (S, 2, VPT, blockDim) 16-byte vectors (x then dy) | (S, 2, blockDim) floats (mean,
  // rstd) | scale (N rounded up to E) | reduction scratch (2 * blockDim / 32 + 2) | partial combine
  // (R, ceil(N / E), E + 1) if R > 1
  uint4* s_pipe = smem_v;
  float* s_stat = reinterpret_cast<float*>(smem_v + (ALIGNED ? S * 2 * VPT * blockDim.x : 0));
  float* s_scale = s_stat + (ALIGNED ? S * 2 * blockDim.x : 0);
  const int n_pad = (n + E - 1) / E * E;  // the scale is read as float4 vectors, whole
  float* s_red = s_scale + n_pad;
  float* s_comb = s_red + 2 * (blockDim.x / 32) + 2;
  const std::int64_t g = blockIdx.x / L.P, pi = blockIdx.x % L.P;
  stage_scale<T, ALIGNED>(p, g, n_pad, s_scale);

  const int R = blockDim.x / L.tpr, rg = threadIdx.x / L.tpr, lane = threadIdx.x % L.tpr;
  const float inv_n = 1.f / float(n);
  float acc_dw[VPT][E] = {}, acc_db[VPT][E] = {};  // (VPT, E) fp32 partial sums over this thread's rows
  const std::int64_t J = p.rows_per_group, jstep = std::int64_t(L.P) * R;
  auto row_ptrs = [&](std::int64_t j) {
    const std::int64_t rr = p.row_of(g, j < J ? j : 0);
    return std::make_pair(static_cast<const T*>(p.x) + p.x_rows.offset_lean(rr),
                          static_cast<const T*>(p.dy) + p.dy_rows.offset_lean(rr));
  };
  auto load_row = [&](std::int64_t j, uint4 (&xs)[VPT], uint4 (&dys)[VPT], float2& st) {  // unaligned: registers
    const auto [xr, dyr] = row_ptrs(j);
    const std::int64_t rr = p.row_of(g, j < J ? j : 0);
    st = j < J ? make_float2(p.rms ? 0.f : p.mean[rr], p.rstd[rr]) : make_float2(0.f, 0.f);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      xs[k] = load_raw<T>(xr, (k * L.tpr + lane) * E, j < J ? n : 0, ALIGNED);
      dys[k] = load_raw<T>(dyr, (k * L.tpr + lane) * E, j < J ? n : 0, ALIGNED);
    }
  };
  // the slot of the row's statistics this thread reads (L.stat_mask: its own, or that of its row group's first
  // thread in its warp, which copies them: one 4-byte cp.async per warp, or per row group below 32 threads)
  const int stat_tid = int(threadIdx.x) & L.stat_mask;
  auto issue_row = [&](std::int64_t j, int stage) {  // aligned: cp.async into this thread's slots
    const auto [xr, dyr] = row_ptrs(j);
    const std::int64_t rr = p.row_of(g, j < J ? j : 0);  // statistics of rows past J: zero (rstd 0)
    if (stat_tid == int(threadIdx.x)) {
      cp_async4(&s_stat[(stage * 2 + 0) * blockDim.x + threadIdx.x], p.rms ? p.rstd + rr : p.mean + rr,
                j < J && !p.rms);
      cp_async4(&s_stat[(stage * 2 + 1) * blockDim.x + threadIdx.x], p.rstd + rr, j < J);
    }
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int col = (k * L.tpr + lane) * E;
      const bool ok = j < J && col < n;  // zero-filled otherwise: rows past J add nothing to dW/dB
      cp_async16(&s_pipe[((stage * 2 + 0) * VPT + k) * blockDim.x + threadIdx.x], xr + (ok ? col : 0), ok);
      cp_async16(&s_pipe[((stage * 2 + 1) * VPT + k) * blockDim.x + threadIdx.x], dyr + (ok ? col : 0), ok);
    }
  };
  uint4 xv[VPT], dyv[VPT], xnext[VPT], dynext[VPT];  // (VPT) raw vectors each; *next: the next row
  float2 st, stnext;  // (mean, rstd) of the row, of the next row
  if constexpr (ALIGNED) {
#pragma unroll
    for (int s = 0; s < S - 1; ++s) {
      issue_row(pi * R + rg + s * jstep, s);
      cp_async_commit();
    }
  } else {
    load_row(pi * R + rg, xv, dyv, st);
  }
  int stage = 0;
  for (std::int64_t j0 = pi * R; j0 < J; j0 += jstep) {
    const std::int64_t j = j0 + rg;
    if constexpr (ALIGNED) {
      __syncwarp();  // (the lanes' reads of the slot refilled now, rows ago, are done)
      issue_row(j + (S - 1) * jstep, stage == 0 ? S - 1 : stage - 1);
      cp_async_commit();
      cp_async_wait<S - 1>();
      __syncwarp();  // the first thread's copy of the statistics, complete for it, visible to the warp
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        xv[k] = s_pipe[((stage * 2 + 0) * VPT + k) * blockDim.x + threadIdx.x];
        dyv[k] = s_pipe[((stage * 2 + 1) * VPT + k) * blockDim.x + threadIdx.x];
      }
      st = make_float2(s_stat[(stage * 2 + 0) * blockDim.x + stat_tid], s_stat[(stage * 2 + 1) * blockDim.x + stat_tid]);
      stage = stage == S - 1 ? 0 : stage + 1;
    } else {
      load_row(j + jstep, xnext, dynext, stnext);  // in flight while this row is reduced and written
    }
    const bool valid = j < J;
    const std::int64_t r = p.row_of(g, valid ? j : 0);
    const float mean = st.x, rstd = st.y;  // rows past J: 0, 0
    float xh[VPT][E], gs[VPT][E];  // (VPT, E) xhat and g = dy * scale of this thread's columns
    float sg = 0.f, sgx = 0.f;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int col = (k * L.tpr + lane) * E;
      float xf[E], dyf[E], sc[E];  // (E) elements past the row end: x = dy = 0, scale 0 (padding)
      unpack<T>(xv[k], xf);
      unpack<T>(dyv[k], dyf);
      scale_vec<E>(s_scale, col < n ? col : 0, sc);
#pragma unroll
      for (int e = 0; e < E; ++e) {
        xh[k][e] = (xf[e] - mean) * rstd;
        // __fmul_rn: one rounded product used in both the sums and dx (no FMA contraction), so that
        // g - mean(g) cancels exactly where it should (N = 1 gives dx = 0, not rounding noise).
        gs[k][e] = __fmul_rn(dyf[e], sc[e]);
        sg += gs[k][e];
        sgx += gs[k][e] * xh[k][e];
        acc_dw[k][e] += dyf[e] * xh[k][e];
        acc_db[k][e] += dyf[e];
      }
    }
    const float2 sums = row_sum2(make_float2(sg, sgx), L.tpr, s_red);  // one pass for both sums
    const float mg = p.rms ? 0.f : sums.x * inv_n;
    const float mgx = sums.y * inv_n;
    if (valid) {
      T* dxr = static_cast<T*>(p.dx) + p.dx_rows.offset_lean(r);
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int col = (k * L.tpr + lane) * E;
        if (col >= n) continue;
        float out[E];
#pragma unroll
        for (int e = 0; e < E; ++e) out[e] = rstd * (gs[k][e] - mg - xh[k][e] * mgx);
        store_vec<T>(dxr, col, n, ALIGNED, out);
      }
    }
    if constexpr (!ALIGNED) {
#pragma unroll
      for (int k = 0; k < VPT; ++k) { xv[k] = xnext[k]; dyv[k] = dynext[k]; }
      st = stnext;
    }
  }
  if constexpr (ALIGNED) cp_async_wait<0>();
  pdl_launch_dependents();
  if (ws_dw == nullptr && ws_db == nullptr) return;

  const std::int64_t slot = (pi * p.groups + g) * p.n;
  if (ws_dw) write_partials<T, VPT, ALIGNED>(ws_dw, acc_dw, slot, n, L.tpr, R, rg, lane, s_comb);
  if (ws_db) write_partials<T, VPT, ALIGNED>(ws_db, acc_db, slot, n, L.tpr, R, rg, lane, s_comb);
}


// ---- streaming engine (any N): one row per CTA iteration, blockDim threads over the row ----------
// smem: reduction scratch (blockDim / 32)
template <typename T, bool ALIGNED>
__global__ void __launch_bounds__(512) rownorm_fwd_stream_kernel(const RowNormParams p, const RowLaunch L) {
  constexpr int E = kVecElems<T>;
  __shared__ float s_red[32];
  const std::int64_t g = blockIdx.x / L.P, pi = blockIdx.x % L.P;
  const int n = int(p.n), step = blockDim.x * E;
  const float inv_n = 1.f / float(n);
  for (std::int64_t j = pi; j < p.rows_per_group; j += L.P) {
    const std::int64_t r = p.row_of(g, j);
    const T* xr = static_cast<const T*>(p.x) + p.x_rows.offset(r);
    float mean = 0.f;
    if (!p.rms) {
      float s = 0.f;
#pragma unroll 4
      for (int col = threadIdx.x * E; col < n; col += step) {
        const uint4 v = load_raw<T>(xr, col, n, ALIGNED);
#pragma unroll
        for (int e = 0; e < E; ++e) s += raw_get<T>(v, e);
      }
      mean = row_sum(s, blockDim.x, s_red) * inv_n;
    }
    float ss = 0.f;
#pragma unroll 4
    for (int col = threadIdx.x * E; col < n; col += step) {
      const uint4 v = load_raw<T>(xr, col, n, ALIGNED);
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const float d = col + e < n ? raw_get<T>(v, e) - mean : 0.f;
        ss += d * d;
      }
    }
    const float rstd = rsqrtf(row_sum(ss, blockDim.x, s_red) * inv_n + p.eps);
    T* yr = static_cast<T*>(p.y) + p.y_rows.offset(r);
#pragma unroll 4
    for (int col = threadIdx.x * E; col < n; col += step) {
      const uint4 v = load_raw<T>(xr, col, n, ALIGNED);
      float sc[E], bi[E], out[E];
      load_params_vec<T, ALIGNED>(p, g, col, n, sc, bi);
#pragma unroll
      for (int e = 0; e < E; ++e) out[e] = (raw_get<T>(v, e) - mean) * rstd * sc[e] + bi[e];
      store_vec<T>(yr, col, n, ALIGNED, out);
    }
    if (threadIdx.x == 0) {
      if (p.mean) p.mean[r] = mean;
      if (p.rstd) p.rstd[r] = rstd;
    }
  }
}

// ---- backward for long rows (N > the cached engine's reach): two passes, no per-row partials ------
// A (rowsum): one row per CTA iteration, stores mean(g) and mean(g * xhat) of each row (fp32).
// B (coltile): each CTA owns a tile of blockDim * E columns and a slice of the rows; a thread keeps
//   its vector's scale and dW/dB partials in registers over all its rows (no reductions in the row
//   loop, so rows pipeline freely), writes dx, and at the end its partial columns of the CTA's slot.
// Traffic: x and dy are read twice (5 tensor passes instead of 3), against the streaming design's
// per-row read-modify-write of 8 bytes of partials per element.
template <typename T, bool ALIGNED>
__global__ void __launch_bounds__(512) rownorm_bwd_rowsum_kernel(const RowNormParams p, const RowLaunch L,
                                                                 float2* __restrict__ rowsums) {
  constexpr int E = kVecElems<T>;
  __shared__ float s_red[64];
  const std::int64_t g = blockIdx.x / L.P, pi = blockIdx.x % L.P;
  const int n = int(p.n), step = blockDim.x * E;
  const float inv_n = 1.f / float(n);
  for (std::int64_t j = pi; j < p.rows_per_group; j += L.P) {
    const std::int64_t r = p.row_of(g, j);
    const T* xr = static_cast<const T*>(p.x) + p.x_rows.offset(r);
    const T* dyr = static_cast<const T*>(p.dy) + p.dy_rows.offset(r);
    const float mean = p.rms ? 0.f : p.mean[r];
    const float rstd = p.rstd[r];
    float sg = 0.f, sgx = 0.f;
#pragma unroll 4
    for (int col = threadIdx.x * E; col < n; col += step) {
      const uint4 xv = load_raw<T>(xr, col, n, ALIGNED), dyv = load_raw<T>(dyr, col, n, ALIGNED);
      float sc[E], unused[E];
      load_params_vec<T, ALIGNED>(p, g, col, n, sc, unused);
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const float gg = __fmul_rn(raw_get<T>(dyv, e), sc[e]);  // 0 past the row end
        sg += gg;
        sgx += gg * ((raw_get<T>(xv, e) - mean) * rstd);
      }
    }
    const float2 sums = row_sum2(make_float2(sg, sgx), blockDim.x, s_red);
    if (threadIdx.x == 0) rowsums[r] = make_float2(p.rms ? 0.f : sums.x * inv_n, sums.y * inv_n);
  }
}

// Grid: tiles * P * G CTAs, b = (g * P + pi) * tiles + tile.
template <typename T, bool ALIGNED>
__global__ void __launch_bounds__(256) rownorm_bwd_coltile_kernel(const RowNormParams p, const RowLaunch L, int tiles,
                                                                  const float2* __restrict__ rowsums,
                                                                  float* __restrict__ ws_dw, float* __restrict__ ws_db) {
  constexpr int E = kVecElems<T>;
  const int tile = blockIdx.x % tiles;
  const std::int64_t gp = blockIdx.x / tiles, g = gp / L.P, pi = gp % L.P;
  const int n = int(p.n), col = (tile * blockDim.x + threadIdx.x) * E;
  float sc[E], unused[E], acc_dw[E] = {}, acc_db[E] = {};  // (E) this thread's columns
  load_params_vec<T, ALIGNED>(p, g, col < n ? col : 0, col < n ? n : 0, sc, unused);
  if (col < n) {
#pragma unroll 4
    for (std::int64_t j = pi; j < p.rows_per_group; j += L.P) {
      const std::int64_t r = p.row_of(g, j);
      const uint4 xv = load_raw<T>(static_cast<const T*>(p.x) + p.x_rows.offset(r), col, n, ALIGNED);
      const uint4 dyv = load_raw<T>(static_cast<const T*>(p.dy) + p.dy_rows.offset(r), col, n, ALIGNED);
      const float mean = p.rms ? 0.f : p.mean[r];
      const float rstd = p.rstd[r];
      const float2 m = rowsums[r];  // (mean(g), mean(g * xhat))
      float out[E];
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const float dy = raw_get<T>(dyv, e), xh = (raw_get<T>(xv, e) - mean) * rstd;
        out[e] = rstd * (__fmul_rn(dy, sc[e]) - m.x - xh * m.y);
        acc_dw[e] += dy * xh;
        acc_db[e] += dy;
      }
      store_vec<T>(static_cast<T*>(p.dx) + p.dx_rows.offset(r), col, n, ALIGNED, out);
    }
  }
  pdl_launch_dependents();
  const std::int64_t slot = (pi * p.groups + g) * p.n;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    if (col + e >= n) break;
    if (ws_dw) ws_dw[slot + col + e] = acc_dw[e];
    if (ws_db) ws_db[slot + col + e] = acc_db[e];
  }
}

template <typename T>
__global__ void __launch_bounds__(32 * kFinSlices) rownorm_wgrad_finalize_kernel(const WgradJob job, std::int64_t P,
                                                                               std::int64_t G, std::int64_t n,
                                                                               bool out_f32) {
  // (kFinSlices, 32) float4: each thread sums kFinCols consecutive columns, as one 16-byte load per
  // partial row where the rows allow (G * n % 4 == 0; the workspace is 16-byte aligned). Scalar
  // 4-byte loads per warp request ran at 1.4 TB/s (12.7 us for 132 x 16384 x 2 partials, ncu).
  __shared__ float4 s_part[kFinSlices][32];
  pdl_wait_primary();  // launched programmatically after the backward kernel (sm_90): its partials
  const bool second = blockIdx.y != 0;  // selects without indexing the parameter arrays (a local copy)
  wgrad_finalize_block<T>(second ? job.ws[1] : job.ws[0], second ? job.out[1] : job.out[0],
                          second ? job.out_group_stride[1] : job.out_group_stride[0], blockIdx.x, threadIdx.x,
                          threadIdx.y, true, s_part, P, G, n, out_f32);
}

}  // namespace fastweight::detail
