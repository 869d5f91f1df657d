// mlstm_tc.cuh: what the mLSTM tensor-core kernels (mlstm_fwd_tc.cu, mlstm_bwd_tc.cu) share: tile
// constants and the bf16 tile loader (cp.async where rows are 16-byte aligned, else element loads).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "common/mlstm_params.h"
#include "cuda/common/mma.cuh"

namespace fastweight::detail::mtc {

using bf16 = __nv_bfloat16;
constexpr int kT = 64;           // tile edge: chunk rows / steps, DQK and DV columns
constexpr int kTcThreads = 128;  // 4 warps; warp w owns tile rows 16w..16w+15
constexpr int kLd = kT + 8;      // smem row stride (bf16) of 64-column tiles: 144 B, ldmatrix conflict-free

__host__ __device__ constexpr std::int64_t round_up(std::int64_t x, std::int64_t m) { return (x + m - 1) / m * m; }
__host__ __device__ constexpr std::int64_t lmin(std::int64_t x, std::int64_t y) { return x < y ? x : y; }
__device__ __forceinline__ int bytes16(int nr_ok, int left) {  // bytes of a 16-byte chunk inside the tile
  return nr_ok ? 2 * (left < 0 ? 0 : left > 8 ? 8 : left) : 0;
}

// Rows [0, nr) x columns [0, nc) of a bf16 matrix (row i at src + i * rs) into an R x C smem tile
// (stride ld; C a multiple of 8), zeros elsewhere. vec: src 16-byte aligned and rs % 8 == 0 ->
// cp.async (the caller commits and waits); else synchronous element loads.
__device__ __forceinline__ void load_tile(bf16* sm, int ld, int R, int C, const bf16* src, std::int64_t rs, int nr,
                                          int nc, bool vec) {
  if (vec) {
    const int CH = C / 8;  // 16-byte chunks per row
    for (int e = threadIdx.x; e < R * CH; e += kTcThreads) {
      const int r = e / CH, col = (e % CH) * 8;
      const int bytes = bytes16(r < nr, nc - col);
      cp_async16(sm + r * ld + col, bytes ? src + r * rs + col : src, bytes);
    }
  } else {
    for (int e = threadIdx.x; e < R * C; e += kTcThreads) {
      const int r = e / C, col = e % C;
      sm[r * ld + col] = r < nr && col < nc ? src[r * rs + col] : __float2bfloat16_rn(0.f);
    }
  }
}

// 16-byte aligned rows at every (b, h, t): the loader may use cp.async
inline bool rows16(const StridedView& t) {
  return reinterpret_cast<std::uintptr_t>(t.p) % 16 == 0 && t.s0 % 8 == 0 && t.s1 % 8 == 0 && t.s2 % 8 == 0;
}

}  // namespace fastweight::detail::mtc
