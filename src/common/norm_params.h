// norm_params.h: the plain-data description of one row-norm call, shared by the CPU reference and
// the CUDA kernels (no CUDA, no torch). The API layer (src/api/norm_api.cpp) validates the user's
// TensorRefs and lowers every op of the family to this one form:
//
//   rows r = 0..rows-1 of length n, each in one parameter group g:
//   r = g * g_stride + j * j_stride, g in [0, groups), j in [0, rows_per_group), so that
//     layernorm/rmsnorm: groups = 1,  g_stride = 0,  j_stride = 1       (one weight vector)
//     headnorm:          groups = NH, g_stride = 1,  j_stride = NH      (rows are (..., NH))
//     adalayernorm:      groups = B,  g_stride = S,  j_stride = 1       (rows are (B, S))
//   Parameters of group g start at w + g * w_group_stride (likewise b, dw, db).
//
// Row r's first element of a row tensor is at base + RowIndexer::offset(r), where the indexer holds
// the tensor's leading dims after merging the ones that are contiguous with each other.
#pragma once

#include <cstdint>

#include "fastweight/tensor.h"

#if defined(__CUDACC__)
#define FW_HD __host__ __device__ __forceinline__
#else
#define FW_HD inline
#endif

namespace fastweight::detail {

inline constexpr int kMaxLeadDims = kMaxDims - 1;

struct RowIndexer {
  int nd = 0;                              // merged leading dims (0: a single row)
  std::int64_t size[kMaxLeadDims] = {};    // outermost first
  std::int64_t stride[kMaxLeadDims] = {};  // elements

  // Element offset of row r.
  FW_HD std::int64_t offset(std::int64_t r) const { return offset_as<std::int64_t>(r); }
  // The same for r < 2^31 (every size then fits 32 bits, being a factor of the row count): 32-bit
  // divisions (a few instructions) instead of 64-bit ones (a called routine and its registers).
  FW_HD std::int64_t offset32(std::uint32_t r) const { return offset_as<std::uint32_t>(r); }
  // The backward's form (rownorm_bwd_ring_kernel, rownorm_bwd_cached_kernel): one multiply for rows at one stride
  // (nd <= 1, any row count), 32-bit divisions for merged dims, where lean(rows) holds. The 64-bit division is a
  // called routine whose mere presence (never taken) made the 128-register kernels spill 48-136 B (session 52).
  FW_HD std::int64_t offset_lean(std::int64_t r) const {
    return nd <= 1 ? r * stride[0] : offset_as<std::uint32_t>(std::uint32_t(r));
  }
  // Whether offset_lean is exact for every row below `rows` (the planner's guard).
  FW_HD bool lean(std::int64_t rows) const { return nd <= 1 || rows < (std::int64_t(1) << 31); }
  // I: the index type of the divisions
  template <typename I>
  FW_HD std::int64_t offset_as(I r) const {
    if (nd == 1) return std::int64_t(r) * stride[0];  // the common case: rows at a fixed stride
    std::int64_t off = 0;
    for (int d = nd - 1; d >= 0; --d) {
      const I sz = I(size[d]), q = r / sz;
      off += std::int64_t(r - q * sz) * stride[d];
      r = q;
    }
    return off;
  }
};

enum class NormKind : std::uint8_t { layernorm, rmsnorm, headnorm, adalayernorm };

struct RowNormParams {
  NormKind kind = NormKind::layernorm;
  bool rms = false;  // no mean subtraction (rmsnorm)
  DType io = DType::f32;     // x, y, dy, dx
  DType param = DType::f32;  // weight, bias, dweight, dbias (io dtype or f32)

  std::int64_t rows = 0, n = 0;
  std::int64_t groups = 1, rows_per_group = 0, g_stride = 0, j_stride = 1;

  float eps = 0.f;            // the reference reads eps_d (double) instead
  double eps_d = 0.0;
  float weight_offset = 0.f;  // scale = weight_offset + w
  double weight_offset_d = 0.0;

  // forward
  const void* x = nullptr;   RowIndexer x_rows;
  void* y = nullptr;         RowIndexer y_rows;
  const void* w = nullptr;   std::int64_t w_group_stride = 0;
  const void* b = nullptr;   std::int64_t b_group_stride = 0;
  bool param_aligned = false;  // set by the CUDA launcher: w/b rows 16-byte aligned, N % E == 0
  float* mean = nullptr;     // rows, contiguous; may be null
  float* rstd = nullptr;     // rows, contiguous; may be null

  // backward (x, w, b as above; mean/rstd read-only there)
  const void* dy = nullptr;  RowIndexer dy_rows;
  void* dx = nullptr;        RowIndexer dx_rows;
  void* dw = nullptr;        std::int64_t dw_group_stride = 0;
  void* db = nullptr;        std::int64_t db_group_stride = 0;

  FW_HD std::int64_t row_of(std::int64_t g, std::int64_t j) const { return g * g_stride + j * j_stride; }
  // The parameter group of row r in memory order: headnorm rows are (..., NH), so g = r % NH; adaLN
  // rows are (B, S), so g = r / S. I: the index type of the division (std::uint32_t for r < 2^31).
  template <typename I>
  FW_HD I group_of_row(I r) const {
    return groups == 1 ? I(0) : g_stride == 1 ? r % I(groups) : r / I(g_stride);
  }
};

}  // namespace fastweight::detail
