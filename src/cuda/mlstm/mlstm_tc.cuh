// mlstm_tc.cuh: what the tensor-core kernels (mlstm_fwd_tc.cu, mlstm_bwd_tc.cu, and the DeltaNet ones
// through deltanet_tc.cuh) share: tile constants, the bf16 tile loader (cp.async where rows are
// 16-byte aligned, else element loads), warp-level products over 64-column tiles and fragment
// coordinates.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "common/mlstm_params.h"
#include "cuda/common/bulk.cuh"
#include "cuda/common/tensor_map.cuh"
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

// The cp.async units of a C-column tile (C / 8 16-byte chunks per row) that thread threadIdx.x takes:
// its first row and chunk, and the steps. Built once where C is a runtime value and the tile is loaded
// every step of a serial loop: its integer divisions were ~40 instructions per load_tile call (SASS
// of the DeltaNet state kernels, two or three calls per chunk step).
struct TileUnits {
  int C, U, dr, du, r0, u0;
  __device__ __forceinline__ TileUnits(int c, int nthreads)
      : C(c), U(c / 8), dr(nthreads / U), du(nthreads % U), r0(int(threadIdx.x) / U), u0(int(threadIdx.x) % U) {}
};
// load_tile's cp.async branch (vec) for a tile of m.C columns.
__device__ __forceinline__ void load_tile_vec(const TileUnits& m, bf16* sm, int ld, int R, const bf16* src,
                                              std::int64_t rs, int nr, int nc) {
  int r = m.r0, u = m.u0;
  if (m.du == 0 && nr >= R && nc >= m.C) {  // the whole tile in bounds, a fixed row step per thread
    const std::int64_t sstep = m.dr * rs;
    const bf16* s = src + r * rs + 8 * u;
    for (bf16* d = sm + r * ld + 8 * u; r < R; r += m.dr, d += m.dr * ld, s += sstep) cp_async16(d, s, 16);
    return;
  }
  for (; r < R;) {
    const int col = 8 * u, bytes = bytes16(r < nr, nc - col);
    cp_async16(sm + r * ld + col, bytes ? src + r * rs + col : src, bytes);
    r += m.dr, u += m.du;
    if (u >= m.U) u -= m.U, ++r;
  }
}
// Rows [0, nr) x columns [0, nc) of a bf16 matrix (row i at src + i * rs) into an R x C smem tile
// (stride ld; C a multiple of 8), zeros elsewhere. vec: src 16-byte aligned and rs % 8 == 0 ->
// cp.async (the caller commits and waits); else synchronous element loads.
// nthreads: the CTA's threads (kTcThreads unless the kernel says otherwise).
// Thread tid takes the units (16-byte chunks, or elements) tid, tid + nthreads, ... of the row-major
// tile, walked by row / column increments: a division per unit (C is often a runtime value) made
// the loads of a tensor-core K3 CTA ~25% of its instructions. Serial loops over a runtime C hoist
// the mapping (TileUnits, load_tile_vec).
__device__ __forceinline__ void load_tile(bf16* sm, int ld, int R, int C, const bf16* src, std::int64_t rs, int nr,
                                          int nc, bool vec, int nthreads = kTcThreads) {
  // (vec is a runtime flag: the unit width is fixed per branch, so a compile-time C gives shifts)
  if (vec) {
    load_tile_vec(TileUnits(C, nthreads), sm, ld, R, src, rs, nr, nc);
  } else {
    const int U = C, dr = nthreads / U, du = nthreads % U;  // elements per row
    int r = int(threadIdx.x) / U, u = int(threadIdx.x) % U;
    for (; r < R;) {
      sm[r * ld + u] = r < nr && u < nc ? src[r * rs + u] : __float2bfloat16_rn(0.f);
      r += dr, u += du;
      if (u >= U) u -= U, ++r;
    }
  }
}

// One thread's cp.async units of a (64 rows, m.C columns) bf16 tile that a serial kernel loads every
// chunk step from rows at a fixed stride rs: the offsets are fixed per CTA, so a whole chunk costs a
// 64-bit add and a cp.async per unit. Re-deriving each unit's address every step (the row pointer,
// per-unit 64-bit products, a runtime-trip loop) was 36% of the forward state kernel's instructions
// and 43% of the backward serial kernel's (ncu, DeltaNet (1,32768,16,128), bf16 operands).
struct ChunkUnits {
  static constexpr int kMax = 4;  // units per thread unrolled (Kc <= 128 at 256 threads)
  int n = 0;                      // units per thread; 0: not a whole number of rows per pass (generic path)
  std::int64_t g0 = 0, gs = 0;    // elements from a chunk's first row: the first unit; between units
  std::uint32_t s0 = 0, ss = 0;   // bytes from the smem tile: the first unit; between units
  ChunkUnits() = default;         // none: load_chunk_tile takes the generic path
  __device__ __forceinline__ ChunkUnits(const TileUnits& m, int ld, std::int64_t rs) {
    if (m.du != 0 || kT % m.dr != 0 || kT / m.dr > kMax) return;
    n = kT / m.dr, g0 = m.r0 * rs + 8 * m.u0, gs = m.dr * rs;
    s0 = std::uint32_t(2 * (m.r0 * ld + 8 * m.u0)), ss = std::uint32_t(2 * m.dr * ld);
  }
};
__device__ __forceinline__ void cp_async16_s(std::uint32_t s, const void* g) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(g));
}
// A chunk's (64, m.C) tile: through cu where the whole tile is in bounds (nr = 64 rows, nc >= m.C
// columns) and the rows are 16-byte aligned (vec); else load_tile_vec (aligned) or element loads.
__device__ __forceinline__ void load_chunk_tile(const ChunkUnits& cu, const TileUnits& m, bf16* sm, int ld,
                                                const bf16* src, std::int64_t rs, int nr, int nc, bool vec,
                                                int nthreads) {
  if (vec && cu.n > 0 && nr >= kT && nc >= m.C) {
    const std::uint32_t s = smem_u32(sm) + cu.s0;
    const bf16* g = src + cu.g0;
#pragma unroll
    for (int q = 0; q < ChunkUnits::kMax; ++q)
      if (q < cu.n) cp_async16_s(s + q * cu.ss, g + q * cu.gs);
    return;
  }
  if (vec) load_tile_vec(m, sm, ld, kT, src, rs, nr, nc);
  else load_tile(sm, ld, kT, m.C, src, rs, nr, nc, false, nthreads);
}

// One k-step (16 of K) of mma_rk below.
template <int J>
__device__ __forceinline__ void mma_rk_step(float (&acc)[J][4], const bf16* A, int lda, int mrow, const bf16* Bk,
                                            int ldb, int ks, int lane) {
  std::uint32_t a[4];
  ldsm_x4(a, A + (16 * mrow + ld_row_a_rowmajor(lane)) * lda + ks * 16 + ld_col_a_rowmajor(lane));
#pragma unroll
  for (int jj = 0; jj < J / 2; ++jj) {
    std::uint32_t bb[4];
    ldsm_x4_t(bb, Bk + (ks * 16 + ld_row_b_kmajor(lane)) * ldb + 16 * jj + ld_col_b_kmajor(lane));
    mma_bf16_16816(acc[2 * jj], a, bb[0], bb[1]);
    mma_bf16_16816(acc[2 * jj + 1], a, bb[2], bb[3]);
  }
}

// acc (warp's 16 rows x 8 J columns: 64 for J = 8, 32 for J = 4) += A (row major, rows 16 mrow.., K = Kp)
// B (k-major; its first J * 8 columns)
template <int J>
__device__ __forceinline__ void mma_rk(float (&acc)[J][4], const bf16* A, int lda, int mrow, const bf16* Bk, int ldb,
                                       int Kp, int lane) {
  // J = 8 (4-warp kernels): the ks loop as the compiler unrolls it; J = 4 (8-warp kernels, 128
  // registers): not unrolled, so that fragments are not hoisted across steps into spills.
  auto step = [&](int ks) { mma_rk_step<J>(acc, A, lda, mrow, Bk, ldb, ks, lane); };
  if constexpr (J == 8) {
    for (int ks = 0; ks < Kp / 16; ++ks) step(ks);
  } else if constexpr (J == 2) {
    // J = 2 (the DeltaNet serial kernels' 32-column tiles, a dependent chain each step): unrolled,
    // so that the next k-steps' ldmatrix are issued ahead of this one's mma (Kp is a multiple of 64)
#pragma unroll 4
    for (int ks = 0; ks < Kp / 16; ++ks) step(ks);
  } else {
#pragma unroll 1
    for (int ks = 0; ks < Kp / 16; ++ks) step(ks);
  }
}

// acc (16 x 8 J) += A B^T with A row major (rows 16 mrow..) and B stored n-major (its first 8 J rows,
// K contiguous)
template <int J>
__device__ __forceinline__ void mma_rn(float (&acc)[J][4], const bf16* A, int lda, int mrow, const bf16* Bn, int ldb,
                                       int Kp, int lane) {
  // J = 8 (4-warp kernels): the ks loop as the compiler unrolls it; J = 4 (8-warp kernels, 128
  // registers): not unrolled, so that fragments are not hoisted across steps into spills.
  auto step = [&](int ks) {
    std::uint32_t a[4];
    ldsm_x4(a, A + (16 * mrow + ld_row_a_rowmajor(lane)) * lda + ks * 16 + ld_col_a_rowmajor(lane));
#pragma unroll
    for (int jj = 0; jj < J / 2; ++jj) {
      std::uint32_t bb[4];
      ldsm_x4(bb, Bn + (16 * jj + ld_row_b_nmajor(lane)) * ldb + ks * 16 + ld_col_b_nmajor(lane));
      mma_bf16_16816(acc[2 * jj], a, bb[0], bb[1]);
      mma_bf16_16816(acc[2 * jj + 1], a, bb[2], bb[3]);
    }
  };
  if constexpr (J == 8) {
    for (int ks = 0; ks < Kp / 16; ++ks) step(ks);
  } else {
#pragma unroll 1
    for (int ks = 0; ks < Kp / 16; ++ks) step(ks);
  }
}
// An fp32 accumulator's column tile j (16 rows x 8 columns: the lane's values pv[0..3]) into bf16 A
// fragments pa over the 16 x 64 tile's four k-steps (FlashAttention-2's register reuse: a product's
// result feeds the next product as its A operand without a trip through shared memory).
__device__ __forceinline__ void pack_a_frags(std::uint32_t (&pa)[4][4], int j, const float (&pv)[4]) {
  pa[j >> 1][(j & 1) * 2] = pack_bf16(pv[0], pv[1]);
  pa[j >> 1][(j & 1) * 2 + 1] = pack_bf16(pv[2], pv[3]);
}

// acc (16 rows x 64 columns) += pa (16 x 64, A fragments) times the k-major tile Y (64 k rows;
// columns c0..c0+63, row stride ld)
__device__ __forceinline__ void mma_frags_k(float (&acc)[8][4], const std::uint32_t (&pa)[4][4], const bf16* Y, int ld,
                                            int c0, int lane) {
#pragma unroll
  for (int kp = 0; kp < 4; ++kp)
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      std::uint32_t bv[4];
      ldsm_x4_t(bv, Y + (kp * 16 + ld_row_b_kmajor(lane)) * ld + c0 + 16 * jj + ld_col_b_kmajor(lane));
      mma_bf16_16816(acc[2 * jj], pa[kp], bv[0], bv[1]);
      mma_bf16_16816(acc[2 * jj + 1], pa[kp], bv[2], bv[3]);
    }
}

// Fragment element (j, e) -> (row, column) within the warp's 16 x 64 tile
__device__ __forceinline__ int frow(int lane, int e) { return (lane >> 2) + (e >> 1) * 8; }
__device__ __forceinline__ int fcol(int lane, int j, int e) { return 8 * j + 2 * (lane & 3) + (e & 1); }

// Scales the bf16 pairs of an A fragment by (w0, w1) (registers 0, 1) and (w8, w9) (registers 2, 3)
// and splits the products into hi + lo bf16 fragments.
__device__ __forceinline__ void scale_split(const std::uint32_t (&a)[4], float w0, float w1, float w8, float w9,
                                            std::uint32_t (&hi)[4], std::uint32_t (&lo)[4]) {
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&a[r]));
    const float y0 = x.x * (r < 2 ? w0 : w8), y1 = x.y * (r < 2 ? w1 : w9);
    const __nv_bfloat162 h = __floats2bfloat162_rn(y0, y1);
    const float2 hf = __bfloat1622float2(h);
    hi[r] = *reinterpret_cast<const std::uint32_t*>(&h);
    lo[r] = pack_bf16(y0 - hf.x, y1 - hf.y);
  }
}

// acc (16 rows of the warp x 8 J columns) += (hi + lo) B over the 16 steps of k-step ks, with B the
// (64 steps, 64 columns) k-major smem tile from column cb: the split product of the state-passing kernels.
template <int J>
__device__ __forceinline__ void mma_split_kstep(float (&acc)[J][4], const std::uint32_t (&hi)[4],
                                                const std::uint32_t (&lo)[4], const bf16 (*Bt)[kLd], int ks, int cb,
                                                int lane) {
#pragma unroll
  for (int jj = 0; jj < J / 2; ++jj) {
    std::uint32_t bv[4];
    ldsm_x4_t(bv, &Bt[ks * 16 + ld_row_b_kmajor(lane)][cb + 16 * jj + ld_col_b_kmajor(lane)]);
    mma_bf16_16816(acc[2 * jj], hi, bv[0], bv[1]);
    mma_bf16_16816(acc[2 * jj + 1], hi, bv[2], bv[3]);
    mma_bf16_16816(acc[2 * jj], lo, bv[0], bv[1]);
    mma_bf16_16816(acc[2 * jj + 1], lo, bv[2], bv[3]);
  }
}

// 16-byte aligned rows at every (b, h, t): the loader may use cp.async
inline bool rows16(const StridedView& t) {
  return reinterpret_cast<std::uintptr_t>(t.p) % 16 == 0 && t.s0 % 8 == 0 && t.s1 % 8 == 0 && t.s2 % 8 == 0;
}

// The hi / lo split of an fp32 state pair (columns c, c + 1 of a row of width W): hi = bf16(x) to
// wh, lo = bf16(x - hi) to wl (the tensor-core backward's state format); 4-byte stores where W is even.
__device__ __forceinline__ void store_hilo_pair(bf16* wh, bf16* wl, std::int64_t c, std::int64_t W, float x0,
                                                float x1) {
  const bf16 h0 = __float2bfloat16_rn(x0), h1 = __float2bfloat16_rn(x1);
  const bf16 l0 = __float2bfloat16_rn(x0 - __bfloat162float(h0));
  const bf16 l1 = __float2bfloat16_rn(x1 - __bfloat162float(h1));
  if (W % 2 == 0 && c + 1 < W) {  // c even: 4-byte aligned pairs
    *reinterpret_cast<__nv_bfloat162*>(wh + c) = __halves2bfloat162(h0, h1);
    *reinterpret_cast<__nv_bfloat162*>(wl + c) = __halves2bfloat162(l0, l1);
  } else {
    if (c < W) wh[c] = h0, wl[c] = l0;
    if (c + 1 < W) wh[c + 1] = h1, wl[c + 1] = l1;
  }
}

// Row half hr (rows gq + 8 hr) of a warp's 16 x 32 piece of a state tile (accumulators in mma
// C-fragment layout) as bf16 hi at ph + 8 j (the pair of columns 8 j + 2 t4, + 1; ph: this lane's
// j = 0 pair) and, LO, lo = bf16(x - hi) at lo_off further: the bits of store_hilo_pair, for a piece
// whose 32 columns are in bounds with an even row length (4-byte pairs). One pointer per row half
// and constant offsets: the per-pair 64-bit addresses and bounds of store_hilo_pair were ~20% of the
// states kernel's instructions (ncu, (2,16,8192,128,128)).
template <bool LO>
__device__ __forceinline__ void store_hilo_row(bf16* ph, std::int64_t lo_off, const float (&acc)[4][4], int hr) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float x0 = acc[j][2 * hr], x1 = acc[j][2 * hr + 1];
    const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
    *reinterpret_cast<__nv_bfloat162*>(ph + 8 * j) = h;
    if constexpr (LO) {
      const float2 hf = __bfloat1622float2(h);
      *reinterpret_cast<std::uint32_t*>(ph + lo_off + 8 * j) = pack_bf16(x0 - hf.x, x1 - hf.y);
    }
  }
}

// ---- A warp's 16 x 32 piece of a state tile to global memory by the TMA engine ----------------------
// The serial kernels (the states kernel, the backward's K2) store the state entering every chunk.
// Element stores from the mma fragments cost 8-16 stores per thread and step, and the next writes of
// their data registers waited on the stores' register reads (ncu at (2,16,8192,128,128), the
// backward's states kernel: long-scoreboard stalls behind STG ~27% of the samples, the store line 20%
// of the instructions); store_hilo_row halved that. Per-lane cp.async.bulk copies of the pieces'
// rows were no better: the copy takes uniform registers, so the compiler issued the 32 lanes' copies
// one after another (a third of the kernel's instructions). Here the warp writes its piece (hi, and lo
// = bf16(x - hi): the bits of store_hilo_pair) to its staging in the tensor map's 64-byte swizzle
// (conflict-free pair stores), and lane 0 stores the whole box with one tensor copy, clipped by the
// TMA engine at the tensor's rows and columns. Against store_hilo_row (H100, one binary): backward
// -6% at (2,16,8192,128,128) and (1,8,8192,256,512), -11% at (4,16,4096,128,128) and
// (8,16,8192,128,256); the forward's hi-only states kernel gains nothing (0-4% slower), so it stores
// by row.
struct WarpTileTma {
  static constexpr int kPlane = 16 * 32;     // bf16 per plane of a warp's box (16 rows x 32 columns, dense)
  static constexpr int kElems = 2 * kPlane;  // per warp: hi plane, lo plane (1024-byte aligned staging)
  // (row, column pair) -> element offset in a plane: 16-byte chunk c of row r at chunk c ^ ((r >> 1) & 3)
  __device__ __forceinline__ static int at(int r, int c) { return r * 32 + (((c >> 3) ^ ((r >> 1) & 3)) << 3) + (c & 7); }
  template <bool LO>
  __device__ __forceinline__ static void stage(bf16* st, const float (&acc)[4][4]) {
    const int lane = int(threadIdx.x & 31), gq = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float x0 = acc[j][2 * hr], x1 = acc[j][2 * hr + 1];
        const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
        const int o = at(gq + 8 * hr, 8 * j + 2 * t4);
        *reinterpret_cast<__nv_bfloat162*>(st + o) = h;
        if constexpr (LO) {
          const float2 hf = __bfloat1622float2(h);
          *reinterpret_cast<std::uint32_t*>(st + kPlane + o) = pack_bf16(x0 - hf.x, x1 - hf.y);
        }
      }
  }
#if defined(FW_HAS_BULK)
  // Lane 0: the staged box to (column c, row r, plane 0, slot) of the map (rows r < the tensor's).
  __device__ __forceinline__ static void store(const CUtensorMap* map, const bf16* st, int c, int r, int slot,
                                               bool any_row) {
    bulk_fence_shared();
    __syncwarp();
    if ((threadIdx.x & 31) == 0 && any_row) {
      tma_store_4d(map, st, c, r, 0, slot);
      bulk_commit();
    }
  }
  // Before the staging is written again: lane 0's copy has read it, then the warp agrees.
  __device__ __forceinline__ static void wait_read() {
    if ((threadIdx.x & 31) == 0) bulk_wait_read();
    __syncwarp();
  }
  __device__ __forceinline__ static void drain() {  // before the CTA exits
    if ((threadIdx.x & 31) == 0) bulk_wait_all();
  }
#endif
};

// Host: the state slots (`slots` of them, each `planes` (rows, ld) bf16 matrices of which `cols`
// columns are stored) as WarpTileTma's 4-D map; false where it does not apply (not sm_90, or the
// strides and base are not multiples of 16 bytes): the kernels then store element by element.
inline bool state_tile_map(CUtensorMap* map, const void* base, std::int64_t cols, std::int64_t ld, std::int64_t rows,
                           int planes, std::int64_t slots) {
  const std::uint64_t dims[4] = {std::uint64_t(cols), std::uint64_t(rows), std::uint64_t(planes), std::uint64_t(slots)};
  const std::uint64_t strides[3] = {std::uint64_t(ld) * 2, std::uint64_t(rows * ld) * 2,
                                    std::uint64_t(planes * rows * ld) * 2};
  const std::uint32_t box[4] = {32, 16, std::uint32_t(planes), 1};
  return slots > 0 && slots < (std::int64_t(1) << 31) && encode_bf16_tile_map(map, base, 4, dims, strides, box, 64);
}

}  // namespace fastweight::detail::mtc
