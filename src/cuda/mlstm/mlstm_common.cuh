// mlstm_common.cuh: device helpers shared by the mLSTM kernels: dtype-generic loads/stores of
// StridedViews (the dtype is a runtime, warp-uniform switch) and the per-chunk gate bookkeeping.
//
// Log-space bookkeeping of one chunk [t0, t0 + n) entered with stabiliser m (MATH.md §2), kept in
// float64 because cumulative forget gates reach |g| ~ 20 * L and the kernels take differences:
//   g_t = lf_t0 + ... + lf_t (inclusive, relative to the chunk start), lf = logsigmoid(f)
//   a_t = i_t - g_t,   M_t = max(m, a_0, ..., a_t)
// Then the recurrent stabiliser is m_t = g_t + M_t, the intra-chunk decay of step s into t (s <= t) is
// exp(a_s - M_t) <= 1, the decay of the entering state into t is exp(m - M_t) <= 1, and the state
// leaving the chunk has m' = g_{n-1} + M_{n-1}.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/mlstm_params.h"

namespace fastweight::detail {

__device__ __forceinline__ float mlstm_ld(const StridedView& t, std::int64_t off) {
  switch (t.dtype) {
    case DType::f16: return __half2float(static_cast<const __half*>(t.p)[off]);
    case DType::bf16: return __bfloat162float(static_cast<const __nv_bfloat16*>(t.p)[off]);
    default: return static_cast<const float*>(t.p)[off];  // f32 (f64 never reaches the GPU)
  }
}
__device__ __forceinline__ void mlstm_st(const StridedView& t, std::int64_t off, float v) {
  switch (t.dtype) {
    case DType::f16: static_cast<__half*>(t.p)[off] = __float2half_rn(v); break;
    case DType::bf16: static_cast<__nv_bfloat16*>(t.p)[off] = __float2bfloat16_rn(v); break;
    default: static_cast<float*>(t.p)[off] = v; break;
  }
}

__device__ __forceinline__ double mlstm_logsigmoid(double x) { return fmin(x, 0.0) - log1p(exp(-fabs(x))); }

// Fills s_g, s_a, s_M (n <= blockDim.x entries each, n <= 256) for the chunk starting at t0 of head
// (b, hd), entered with stabiliser m. Every thread of the block calls it (it synchronises).
__device__ inline void mlstm_chunk_gates(const MlstmParams& p, std::int64_t b, std::int64_t hd, std::int64_t t0,
                                         int n, double m, double* s_g, double* s_a, double* s_M) {
  const int tid = threadIdx.x;
  if (tid < n) {
    const std::int64_t off_i = b * p.i.s0 + hd * p.i.s1 + t0 + tid;
    const std::int64_t off_f = b * p.f.s0 + hd * p.f.s1 + t0 + tid;
    s_g[tid] = mlstm_logsigmoid(double(mlstm_ld(p.f, off_f)));
    s_a[tid] = double(mlstm_ld(p.i, off_i));
  }
  __syncthreads();
  for (int d = 1; d < n; d <<= 1) {  // inclusive prefix sum (Hillis-Steele; fixed order: deterministic)
    const double add = tid < n && tid >= d ? s_g[tid - d] : 0.0;
    __syncthreads();
    if (tid < n) s_g[tid] += add;
    __syncthreads();
  }
  if (tid < n) {
    s_a[tid] -= s_g[tid];
    s_M[tid] = s_a[tid];
  }
  __syncthreads();
  for (int d = 1; d < n; d <<= 1) {  // inclusive prefix max
    const double other = tid < n && tid >= d ? s_M[tid - d] : -INFINITY;
    __syncthreads();
    if (tid < n) s_M[tid] = fmax(s_M[tid], other);
    __syncthreads();
  }
  if (tid < n) s_M[tid] = fmax(s_M[tid], m);
  __syncthreads();
}

}  // namespace fastweight::detail
