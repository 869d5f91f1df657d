// step_grid.cuh: the decoding steps' grids (mlstm_step.cu, deltanet_step.cu): one CTA per (b * heads,
// state column tile). Tile-major (the default): blockIdx.x = bh * tiles + tile, so that a head's column
// tiles run side by side and read its state rows together (whole 2 KB rows at xLSTM 7B's DV = 512
// instead of 256-byte pieces of rows half a megabyte apart); else (blockIdx.x, blockIdx.y) = (bh, tile).
#pragma once
#include <atomic>
#include <cstdint>

#include "cuda/common/check.cuh"

namespace fastweight::detail {

inline std::atomic<bool> g_step_tile_major{true};  // set_step_tile_major (cuda/common/step_grid.h)
inline std::atomic<bool> g_step_streaming{true};   // set_step_streaming (cuda/common/step_grid.h)

// A state row's 4 floats (16-byte aligned), read once and written once per step: CS, with the
// streaming cache hint (ld.global.cs / st.global.cs: evict first; the state is far larger than L2
// at the batch sizes where the steps are memory-bound), else plain.
template <bool CS>
__device__ __forceinline__ float4 ld_state4(const float* at) {
  if constexpr (CS) return __ldcs(reinterpret_cast<const float4*>(at));
  else return *reinterpret_cast<const float4*>(at);
}
template <bool CS>
__device__ __forceinline__ void st_state4(float* at, const float4& x) {
  if constexpr (CS) __stcs(reinterpret_cast<float4*>(at), x);
  else *reinterpret_cast<float4*>(at) = x;
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
