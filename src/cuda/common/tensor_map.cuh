// tensor_map.cuh: Hopper (sm_90) tensor-map bulk copies (the TMA engine's tiled mode): one
// instruction moves a whole box of a strided tensor between shared and global memory, clipping at
// the tensor's bounds. The host encodes the map (encode_bf16_tile_map, through the runtime's driver
// entry point: no link against the driver library); a kernel takes it as a __grid_constant__
// parameter. Device code only where __CUDA_ARCH__ >= 900 (FW_HAS_BULK).
#pragma once

#include <cuda.h>  // CUtensorMap and its enums (types only)

#include <cstdint>

#include "cuda/common/bulk.cuh"

namespace fastweight::detail {

// A bf16 tensor of `rank` (<= 5) dims, dims[0] contiguous, strides[d - 1] bytes between steps of dim d,
// copied in boxes of box[] elements; swizzle: 0 none, 64 the 64-byte swizzle (box[0] * 2 == 64 bytes:
// 16-byte chunk c of box row r sits at chunk c ^ ((r >> 1) & 3) in shared memory, 512-byte aligned),
// 128 the 128-byte one (box[0] * 2 == 128 bytes: chunk c of row r at c ^ (r & 7), 1024-byte aligned).
// False where the device is older than sm_90, the driver has no encoder, or the layout cannot be
// encoded (base or a stride not a multiple of 16 bytes): the caller takes another path.
bool encode_bf16_tile_map(CUtensorMap* map, const void* base, int rank, const std::uint64_t* dims,
                          const std::uint64_t* strides, const std::uint32_t* box, int swizzle);
// The same for a float32 tensor, unswizzled (box rows dense in shared memory, 128-byte aligned).
// Elements of a box past the tensor's bounds load as 0 and are not stored.
bool encode_f32_tile_map(CUtensorMap* map, const void* base, int rank, const std::uint64_t* dims,
                         const std::uint64_t* strides, const std::uint32_t* box);

#if defined(FW_HAS_BULK)
// The box at coordinates (c0 innermost, .. c3) from shared `src` to the global tensor of `map`, in this
// thread's bulk async-group (bulk_commit / bulk_wait_read / bulk_wait_all); the shared data made
// visible to the async proxy first (bulk_fence_shared by its writers, then a barrier).
__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, const void* src, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                   reinterpret_cast<std::uint64_t>(map)),
               "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}
// The box at coordinates (c0 innermost, .. c3) of the global tensor of `map` into shared `dst`,
// completing on `bar` with the box's full bytes (out-of-bounds elements filled with 0).
__device__ __forceinline__ void tma_load_4d(const CUtensorMap* map, void* dst, std::uint64_t* bar, int c0, int c1, int c2,
                                            int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(
          smem_u32(dst)),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
// The same for a 3-D map.
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, const void* src, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
                   reinterpret_cast<std::uint64_t>(map)),
               "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}
#endif

}  // namespace fastweight::detail
