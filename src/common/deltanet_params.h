// deltanet_params.h: the plain-data description of one DeltaNet call for the CUDA kernels (lowered
// from validated TensorRefs by src/api; see fastweight/deltanet.h for the layouts).
//   q, k, v, o (B, T, H, D): element (b, t, h, d) at p + b*s0 + t*s1 + h*s2 + d
//   beta (B, T, H):          element (b, t, h)    at p + b*s0 + t*s1 + h
//   states (N, H, K, V):     element (n, h, a, j) at p + n*s0 + h*s1 + a*s2 + j
#pragma once

#include <cstdint>

#include "common/mlstm_params.h"  // StridedView

namespace fastweight::detail {

struct DeltanetParams {
  std::int64_t B = 0, T = 0, H = 0, K = 0, V = 0, N = 0;
  float scale = 1.f;
  bool l2 = false;
  StridedView q, k, v, beta, o, h0, ht;
  const void* cu_seqlens = nullptr;  // (N+1) on the device, int32 or int64; null: N = B sequences of T
  bool cu_i64 = true;
};

}  // namespace fastweight::detail
