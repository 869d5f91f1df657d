// mma.cuh: warp-level tensor-core helpers (sm_80+ PTX, also the fast path on sm_90 short of wgmma):
// mma.sync m16n8k16 bf16 -> fp32, ldmatrix, cp.async with zero fill.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16"; g = lane / 4, t = lane % 4):
//   A (16 x 16, row major)  a[0] = A[g][2t..2t+1]   a[1] = A[g+8][2t..]   a[2] = A[g][2t+8..]   a[3] = A[g+8][2t+8..]
//   B (16 x 8, k x n)       b[0] = B[2t..2t+1][g]   b[1] = B[2t+8..2t+9][g]
//   C (16 x 8, fp32)        c[0..1] = C[g][2t..2t+1]   c[2..3] = C[g+8][2t..2t+1]
// So the C fragments of two n-tiles (columns 16j..16j+15) are exactly the A fragment of the k-step
// 16j..16j+15 of a following product (FlashAttention-2's register reuse of P).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/common/smem.cuh"

namespace fastweight::detail {

// D += A B, bf16 inputs, fp32 accumulators.
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                               std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8 x 8 b16 matrices; lane L gives the row address of matrix L / 8, row L % 8.
__device__ __forceinline__ void ldsm_x4(std::uint32_t (&r)[4], const void* row_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(row_addr)));
}
__device__ __forceinline__ void ldsm_x4_t(std::uint32_t (&r)[4], const void* row_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(row_addr)));
}

// The inverse of ldsm_x4_t (sm_90 stmatrix; nothing below): lane L gives the address of row L % 8 of
// matrix L / 8 in memory, which receives column L % 8 of that matrix's fragment r[L / 8] (the fragment
// layout of ldsm_x4's result: thread T holds row T / 4, columns 2 (T % 4), + 1). So accumulator pairs
// along a row are stored down a column: an mma tile written transposed, for 16-byte row stores.
__device__ __forceinline__ void stsm_x4_t(void* row_addr, const std::uint32_t (&r)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(smem_u32(row_addr)),
               "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
#else
  (void)row_addr, (void)r;
#endif
}

// Lane addresses for the three ways the kernels read 16 x 16 blocks with ldsm_x4[_t]; (row, col) of
// the element this lane points at, relative to the block's corner, in the stored (row-major) tile.
//   a_rowmajor:  A stored A[m][k]            -> ldsm_x4   gives a[0..3]
//   a_kmajor:    A stored X[k][m] (X = A^T)  -> ldsm_x4_t gives a[0..3]
//   b_kmajor:    B stored Y[k][n] (two n-tiles of 8)  -> ldsm_x4_t gives {b0,b1} of n 0-7 in r[0..1], n 8-15 in r[2..3]
//   b_nmajor:    B stored Z[n][k] (Z = B^T)           -> ldsm_x4   gives the same
__device__ __forceinline__ int ld_row_a_rowmajor(int lane) { return lane & 15; }
__device__ __forceinline__ int ld_col_a_rowmajor(int lane) { return (lane >> 4) << 3; }
__device__ __forceinline__ int ld_row_a_kmajor(int lane) { return (lane & 7) + ((lane >> 4) << 3); }
__device__ __forceinline__ int ld_col_a_kmajor(int lane) { return ((lane >> 3) & 1) << 3; }
__device__ __forceinline__ int ld_row_b_kmajor(int lane) { return (lane & 7) + (((lane >> 3) & 1) << 3); }
__device__ __forceinline__ int ld_col_b_kmajor(int lane) { return (lane >> 4) << 3; }
__device__ __forceinline__ int ld_row_b_nmajor(int lane) { return (lane & 7) + ((lane >> 4) << 3); }
__device__ __forceinline__ int ld_col_b_nmajor(int lane) { return ((lane >> 3) & 1) << 3; }

__device__ __forceinline__ std::uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x = lo (lower address)
  return *reinterpret_cast<const std::uint32_t*>(&v);
}

// 16-byte global -> shared copy; src_bytes < 16 zero-fills the rest (0: all zeros, src not read).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem), "r"(src_bytes));
}
// 8- and 4-byte copies (through L1): scalars next to a tile.
__device__ __forceinline__ void cp_async8(void* smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_u32(smem)), "l"(gmem));
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_u32(smem)), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

}  // namespace fastweight::detail
