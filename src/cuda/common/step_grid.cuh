// step_grid.cuh: the decoding steps' grids (mlstm_step.cu, deltanet_step.cu): one CTA per (b * heads,
// state column tile). Tile-major (the default): blockIdx.x = bh * tiles + tile, so that a head's column
// tiles run side by side and read its state rows together (whole 2 KB rows at xLSTM 7B's DV = 512
// instead of 256-byte pieces of rows half a megabyte apart); else (blockIdx.x, blockIdx.y) = (bh, tile).
#pragma once
#include <atomic>
#include <cstdint>

#include "cuda/common/check.cuh"
#include "cuda/common/gstore.cuh"

namespace fastweight::detail {

inline std::atomic<bool> g_step_tile_major{true};  // set_step_tile_major (cuda/common/step_grid.h)
inline std::atomic<bool> g_step_vec_stores{true};  // set_step_vector_stores (H100, session 31: 0.92-1.01x)

// 4 state floats to 16-byte aligned global memory: with VST one 16-byte store (gstore.cuh; the
// steps' PTX had no st.global.v4 at all), else what nvcc makes of a float4 store (four 4-byte ones).
// VST is a template parameter of the kernels: as a runtime branch it cost their default instances
// registers (the row-block kernel 72 -> 95).
template <bool VST>
__device__ __forceinline__ void step_store4(float* p, float4 v) {
  if constexpr (VST) st_global_v4f(p, v);
  else *reinterpret_cast<float4*>(p) = v;
}

struct StepCta {
  std::int64_t bh, tile;
};
__device__ __forceinline__ StepCta step_cta(bool tile_major, std::int64_t tiles) {
  if (tile_major) return {std::int64_t(blockIdx.x) / tiles, std::int64_t(blockIdx.x) % tiles};
  return {std::int64_t(blockIdx.x), std::int64_t(blockIdx.y)};
}

inline dim3 step_grid(const char* op, bool tile_major, std::int64_t heads, std::int64_t tiles) {
  if (tile_major ? heads * tiles > 0x7fffffff : heads > 0x7fffffff || tiles > 65535)
    throw Error(cat(op, ": grid too large (", heads, " heads x ", tiles, " column tiles)"));
  return tile_major ? dim3(unsigned(heads * tiles)) : dim3(unsigned(heads), unsigned(tiles));
}

}  // namespace fastweight::detail
