// wgmma_probe.h: tests only. One warpgroup's wgmma products through wgmma.cuh's helpers, checked
// against a host reference before a kernel builds on them:
//   d (64 x 64)  = a (64 x 128) b^T, b (64 x 128) stored [n][k]: K-major B, two swizzle blocks along k;
//   e (64 x 128) = a2 (64 x 64) b2,  b2 (64 x 128) stored [k][n]: MN-major B, two blocks along n;
//   f (64 x 64)  = a2 b2[:, 0:64]: MN-major B at n = 64 (one block).
// Inputs bf16 bit patterns (row-major host arrays), outputs fp32. Returns false (nothing written)
// where the current device's binary has no wgmma (below sm_90a).
#pragma once

#include <cstdint>

namespace fastweight::detail {
bool wgmma_probe(const std::uint16_t* a, const std::uint16_t* b, const std::uint16_t* a2, const std::uint16_t* b2,
                 float* d, float* e, float* f);
}  // namespace fastweight::detail
