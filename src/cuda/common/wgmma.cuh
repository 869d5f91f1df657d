// wgmma.cuh: Hopper warpgroup MMA (sm_90a wgmma.mma_async) helpers, for the kernels whose B operand
// is read from shared memory once per warpgroup instead of once per warp by ldmatrix: bf16 inputs,
// fp32 accumulators, A from registers (the mma.sync A fragment layout, per warp its 16 rows of the
// 64), B by a shared-memory descriptor in the 128-byte swizzle. Nothing below sm_90a (FW_HAS_WGMMA):
// the hosts launch such kernels only for an sm_90a binary. Checked by wgmma_probe (tests).
//
// Layouts (PTX ISA, "Asynchronous Warpgroup Level Matrix Shared Memory Layout"; CUTLASS's GMMA
// canonical layouts), 16-bit elements, 128-byte swizzle: a block of rows of 128 bytes (64 elements),
// 1024-byte aligned, the 16-byte chunk c of row r stored at chunk c ^ (r % 8) (sw128_off).
//   K-major B (stored [n][k], k contiguous): one block per 64 k; descriptor at the block + 32 bytes
//     per k-step of 16 within it, SBO = 1024 (8-row groups along n), LBO unused (16).
//   MN-major B (stored [k][n], n contiguous): one block per 64 n (LBO: the distance between those
//     blocks), SBO = 1024 (8-row groups along k); descriptor at + 2048 bytes per k-step of 16 rows.
// Accumulators: wgmma_acc: per warp w rows 16 w + g (+ 8), d[4 j + e] as mma.sync C of n-tile j.
#pragma once

#include <cstdint>

#include "cuda/common/smem.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FW_HAS_WGMMA 1
#endif

namespace fastweight::detail {

// Byte offset of element (row r, column c) of a 128-byte-swizzled block of 16-bit rows (64 columns)
__host__ __device__ inline std::uint32_t sw128_off(int r, int c) {
  return std::uint32_t(r * 128 + ((((c >> 3) ^ r) & 7) << 4) + (c & 7) * 2);
}

// A 128-byte-swizzle descriptor: the start address (shared, 16-byte units), LBO and SBO in bytes.
__device__ __forceinline__ std::uint64_t gmma_desc_sw128(const void* start, std::uint32_t lbo, std::uint32_t sbo) {
  const std::uint64_t a = (smem_u32(start) >> 4) & 0x3fff;
  return a | (std::uint64_t((lbo >> 4) & 0x3fff) << 16) | (std::uint64_t((sbo >> 4) & 0x3fff) << 32) |
         (std::uint64_t(1) << 62);
}

// desc with its start address moved by `units` of 16 bytes: the low word only (shared addresses below
// 256 KB keep start + units inside the 14-bit field: no carry into the other fields), so a loop over
// k-steps adds a constant instead of encoding each address again.
__device__ __forceinline__ std::uint64_t gmma_desc_add(std::uint64_t desc, std::uint32_t units) {
  return (desc & 0xffffffff00000000ull) | std::uint32_t(std::uint32_t(desc) + units);
}

// Before the first wgmma that reads registers written since (accumulators, A fragments)
__device__ __forceinline__ void wgmma_fence() {
#if defined(FW_HAS_WGMMA)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if defined(FW_HAS_WGMMA)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
// Until at most N committed groups are pending
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if defined(FW_HAS_WGMMA)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

// Pins registers the compiler must not read or write across an in-flight wgmma (CUTLASS's
// warpgroup_fence_operand): after wgmma_wait, before the accumulators are read.
template <int N>
__device__ __forceinline__ void wgmma_fence_operand(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// D (64 x 64, fp32; per warp as wgmma_acc) {+}= A (64 x 16, this warp's 16 rows as mma.sync A fragments) B,
// B (16 x 64) in shared memory by descriptor; TB: B MN-major (stored [k][n]), else K-major ([n][k]).
template <int TB>
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const std::uint32_t (&a)[4], std::uint64_t desc,
                                                   bool accumulate) {
#if defined(FW_HAS_WGMMA)
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %37, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, %38;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(int(accumulate)), "n"(TB));
#else
  (void)d, (void)a, (void)desc, (void)accumulate;
#endif
}

// D (64 x 128, fp32; per warp as wgmma_acc) {+}= A (64 x 16, this warp's 16 rows as mma.sync A fragments) B,
// B (16 x 128) in shared memory by descriptor; TB: B MN-major (stored [k][n]), else K-major ([n][k]).
template <int TB>
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[64], const std::uint32_t (&a)[4], std::uint64_t desc,
                                                   bool accumulate) {
#if defined(FW_HAS_WGMMA)
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %69, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, %70;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(int(accumulate)), "n"(TB));
#else
  (void)d, (void)a, (void)desc, (void)accumulate;
#endif
}

}  // namespace fastweight::detail
