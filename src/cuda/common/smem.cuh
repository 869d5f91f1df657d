// smem.cuh: the 32-bit shared-memory address of a generic pointer, as PTX's shared-space operands
// take it (mma.cuh's ldmatrix / cp.async and bulk.cuh's bulk copies and mbarriers).
#pragma once

#include <cstdint>

namespace fastweight::detail {

__device__ __forceinline__ std::uint32_t smem_u32(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

}  // namespace fastweight::detail
