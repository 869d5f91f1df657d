// rownorm_launch.cuh: launch planning for the LayerNorm-family kernels (rownorm_kernel.cuh), one
// template per IO dtype, instantiated in rownorm_<dtype>.cu so that build options can drop dtypes.
//
// Plan: N <= kCachedMaxN{Fwd,Bwd} -> cached engine with tpr = next_pow2(ceil(N / elems_per_thread))
// threads per row and max(tpr, 256) threads per CTA (256 keeps 8 CTAs resident for small rows);
// otherwise the streaming engine with 512 threads per row. P (CTAs per parameter group) is one
// wave of resident CTAs spread over the groups, so the weight-gradient partials stay small
// (P * G * N floats) and every CTA amortises its parameter staging over many rows.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/common/check.cuh"
#include "cuda/norm/rownorm_kernel.cuh"

namespace fastweight::detail {

struct RowPlan {
  bool cached = true;
  int threads = 256;
  std::size_t smem = 0;
  RowLaunch L;
};

inline bool rows_aligned(const void* base, const RowIndexer& ix, std::size_t elem) {
  if (reinterpret_cast<std::uintptr_t>(base) % 16 != 0) return false;
  for (int d = 0; d < ix.nd; ++d)
    if (ix.size[d] > 1 && (ix.stride[d] * std::int64_t(elem)) % 16 != 0) return false;
  return true;
}

inline int next_pow2(std::int64_t v) {
  int t = 1;
  while (t < v) t <<= 1;
  return t;
}

template <typename T>
RowPlan rownorm_plan(const RowNormParams& p, bool bwd) {
  constexpr int E = kVecElems<T>;
  RowPlan plan;
  const std::int64_t ept = bwd ? kBwdElemsPerThread : kFwdElemsPerThread;
  const std::int64_t cached_max = bwd ? kCachedMaxNBwd : kCachedMaxNFwd;
  plan.L.aligned = p.n % E == 0 && rows_aligned(p.x, p.x_rows, sizeof(T)) &&
                   (bwd ? rows_aligned(p.dy, p.dy_rows, sizeof(T)) && rows_aligned(p.dx, p.dx_rows, sizeof(T))
                        : rows_aligned(p.y, p.y_rows, sizeof(T)));
  const void* kernel;
  if (p.n <= cached_max) {
    plan.cached = true;
    plan.L.tpr = next_pow2((p.n + ept - 1) / ept);
    plan.threads = std::max(plan.L.tpr, 256);
    const int R = plan.threads / plan.L.tpr;
    const std::size_t red = plan.threads / 32 + 1;
    plan.smem = sizeof(float) * (bwd ? p.n + red + (R > 1 ? R * p.n : 0) : red);
    // Occupancy of the aligned variant stands for both (same shared memory, similar registers).
    kernel = bwd ? reinterpret_cast<const void*>(&rownorm_bwd_cached_kernel<T, kBwdElemsPerThread / E, true>)
                 : reinterpret_cast<const void*>(&rownorm_fwd_cached_kernel<T, kFwdElemsPerThread / E, true>);
  } else {
    plan.cached = false;
    plan.L.tpr = 512;
    plan.threads = 512;
    plan.smem = 0;
    kernel = bwd ? reinterpret_cast<const void*>(&rownorm_bwd_stream_kernel<T, true>)
                 : reinterpret_cast<const void*>(&rownorm_fwd_stream_kernel<T, true>);
  }
  const char* op = bwd ? "rownorm_bwd" : "rownorm_fwd";
  if (plan.smem > 48 * 1024) {  // both variants may run with this much
    FW_CUDA_CHECK(op, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(plan.smem)));
    const void* other = bwd ? reinterpret_cast<const void*>(&rownorm_bwd_cached_kernel<T, kBwdElemsPerThread / E, false>)
                            : reinterpret_cast<const void*>(&rownorm_fwd_cached_kernel<T, kFwdElemsPerThread / E, false>);
    FW_CUDA_CHECK(op, cudaFuncSetAttribute(other, cudaFuncAttributeMaxDynamicSharedMemorySize, int(plan.smem)));
  }
  int occ = 0;
  FW_CUDA_CHECK(op, cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kernel, plan.threads, plan.smem));
  occ = std::max(occ, 1);
  const std::int64_t resident = std::int64_t(occ) * sm_count();
  const std::int64_t rows_per_iter = plan.threads / plan.L.tpr;
  const std::int64_t need = std::max<std::int64_t>(1, (p.rows_per_group + rows_per_iter - 1) / rows_per_iter);
  const std::int64_t per_group = std::max<std::int64_t>(1, (resident + p.groups - 1) / p.groups);
  plan.L.P = int(std::min(need, per_group));
  return plan;
}

template <typename T>
void rownorm_fwd_launch(const RowNormParams& p_in, cudaStream_t stream) {
  constexpr int E = kVecElems<T>;
  RowNormParams p = p_in;
  auto aligned_param = [&](const void* base, std::int64_t gstride) {
    return base == nullptr ||
           (reinterpret_cast<std::uintptr_t>(base) % 16 == 0 && (p.groups == 1 || (gstride * std::int64_t(sizeof(T))) % 16 == 0));
  };
  p.param_aligned = p.n % E == 0 && aligned_param(p.w, p.w_group_stride) && aligned_param(p.b, p.b_group_stride);
  const RowPlan plan = rownorm_plan<T>(p, false);
  const std::int64_t blocks = std::int64_t(plan.L.P) * p.groups;
  if (blocks > 0x7fffffff) throw Error(cat("rownorm_fwd: grid of ", blocks, " CTAs is too large"));
  constexpr int VPT = kFwdElemsPerThread / E;
  const unsigned grid = unsigned(blocks);
  if (plan.cached && plan.L.aligned)
    rownorm_fwd_cached_kernel<T, VPT, true><<<grid, plan.threads, plan.smem, stream>>>(p, plan.L);
  else if (plan.cached)
    rownorm_fwd_cached_kernel<T, VPT, false><<<grid, plan.threads, plan.smem, stream>>>(p, plan.L);
  else if (plan.L.aligned)
    rownorm_fwd_stream_kernel<T, true><<<grid, plan.threads, 0, stream>>>(p, plan.L);
  else
    rownorm_fwd_stream_kernel<T, false><<<grid, plan.threads, 0, stream>>>(p, plan.L);
  FW_CUDA_CHECK_LAUNCH("rownorm_fwd");
}

template <typename T>
std::size_t rownorm_bwd_workspace(const RowNormParams& p) {
  if (!p.dw && !p.db) return 0;
  const RowPlan plan = rownorm_plan<T>(p, true);
  const std::size_t per = std::size_t(plan.L.P) * std::size_t(p.groups) * std::size_t(p.n) * sizeof(float);
  const std::size_t align = 256;
  const std::size_t per_aligned = (per + align - 1) / align * align;
  return per_aligned * ((p.dw ? 1 : 0) + (p.db ? 1 : 0));
}

template <typename T>
void rownorm_bwd_launch(const RowNormParams& p, void* workspace, cudaStream_t stream) {
  constexpr int E = kVecElems<T>;
  const RowPlan plan = rownorm_plan<T>(p, true);
  const std::int64_t blocks = std::int64_t(plan.L.P) * p.groups;
  if (blocks > 0x7fffffff) throw Error(cat("rownorm_bwd: grid of ", blocks, " CTAs is too large"));
  const std::size_t per = std::size_t(plan.L.P) * std::size_t(p.groups) * std::size_t(p.n) * sizeof(float);
  const std::size_t per_aligned = (per + 255) / 256 * 256;
  float* ws_dw = p.dw ? static_cast<float*>(workspace) : nullptr;
  float* ws_db = p.db ? reinterpret_cast<float*>(static_cast<char*>(workspace) + (p.dw ? per_aligned : 0)) : nullptr;
  if (p.rows > 0 && blocks > 0) {
    constexpr int VPT = kBwdElemsPerThread / E;
    const unsigned grid = unsigned(blocks);
    if (plan.cached && plan.L.aligned)
      rownorm_bwd_cached_kernel<T, VPT, true><<<grid, plan.threads, plan.smem, stream>>>(p, plan.L, ws_dw, ws_db);
    else if (plan.cached)
      rownorm_bwd_cached_kernel<T, VPT, false><<<grid, plan.threads, plan.smem, stream>>>(p, plan.L, ws_dw, ws_db);
    else if (plan.L.aligned)
      rownorm_bwd_stream_kernel<T, true><<<grid, plan.threads, 0, stream>>>(p, plan.L, ws_dw, ws_db);
    else
      rownorm_bwd_stream_kernel<T, false><<<grid, plan.threads, 0, stream>>>(p, plan.L, ws_dw, ws_db);
    FW_CUDA_CHECK_LAUNCH("rownorm_bwd");
  }
  const std::int64_t P = p.rows > 0 ? plan.L.P : 0;  // no rows: the gradients are zeros
  const std::int64_t cols = p.groups * p.n;
  const dim3 fblock(32, 8);
  const unsigned fgrid = unsigned((cols + 31) / 32);
  const bool f32 = p.param == DType::f32;
  if (p.dw && fgrid > 0) {
    rownorm_wgrad_finalize_kernel<T><<<fgrid, fblock, 0, stream>>>(ws_dw, P, p.groups, p.n, p.dw, p.dw_group_stride, f32);
    FW_CUDA_CHECK_LAUNCH("rownorm_bwd");
  }
  if (p.db && fgrid > 0) {
    rownorm_wgrad_finalize_kernel<T><<<fgrid, fblock, 0, stream>>>(ws_db, P, p.groups, p.n, p.db, p.db_group_stride, f32);
    FW_CUDA_CHECK_LAUNCH("rownorm_bwd");
  }
}

#define FW_INSTANTIATE_ROWNORM(T)                                                         \
  template void rownorm_fwd_launch<T>(const RowNormParams&, cudaStream_t);                \
  template std::size_t rownorm_bwd_workspace<T>(const RowNormParams&);                    \
  template void rownorm_bwd_launch<T>(const RowNormParams&, void*, cudaStream_t);

}  // namespace fastweight::detail
