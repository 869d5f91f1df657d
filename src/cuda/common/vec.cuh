// vec.cuh: dtype traits, 16-byte vector loads/stores and warp/group reductions for memory-bound
// kernels. A "vector" is 16 bytes: E = 16 / sizeof(T) elements (8 for fp16/bf16, 4 for fp32).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "fastweight/tensor.h"

namespace fastweight::detail {

template <typename T> struct Num;
template <> struct Num<float> {
  static constexpr DType dtype = DType::f32;
  __device__ static float to_f(float v) { return v; }
  __device__ static float from_f(float v) { return v; }
};
template <> struct Num<__half> {
  static constexpr DType dtype = DType::f16;
  __device__ static float to_f(__half v) { return __half2float(v); }
  __device__ static __half from_f(float v) { return __float2half_rn(v); }
};
template <> struct Num<__nv_bfloat16> {
  static constexpr DType dtype = DType::bf16;
  __device__ static float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 from_f(float v) { return __float2bfloat16_rn(v); }
};

template <typename T> inline constexpr int kVecElems = 16 / int(sizeof(T));

template <typename T>
__device__ __forceinline__ void store_vec(T* row, int col, int n, bool aligned,
                                          const float (&v)[kVecElems<T>]) {
  constexpr int E = kVecElems<T>;
  if (aligned) {
    if (col < n) {
      uint4 raw;
      T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
      for (int i = 0; i < E; ++i) e[i] = Num<T>::from_f(v[i]);
      *reinterpret_cast<uint4*>(row + col) = raw;
    }
  } else {
#pragma unroll
    for (int i = 0; i < E; ++i)
      if (col + i < n) row[col + i] = Num<T>::from_f(v[i]);
  }
}

// Raw 16-byte vectors kept in registers (half the registers of floats for 16-bit types).
// load_raw: elements [col, col + E) of a row; elements at or past n are zero bits (0.0).
template <typename T>
__device__ __forceinline__ uint4 load_raw(const T* row, int col, int n, bool aligned) {
  constexpr int E = kVecElems<T>;
  uint4 raw = make_uint4(0u, 0u, 0u, 0u);
  if (aligned) {
    if (col < n) raw = __ldg(reinterpret_cast<const uint4*>(row + col));
  } else {
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < E; ++i)
      if (col + i < n) e[i] = row[col + i];
  }
  return raw;
}
template <typename T>
__device__ __forceinline__ float raw_get(const uint4& raw, int i) {
  return Num<T>::to_f(reinterpret_cast<const T*>(&raw)[i]);
}

// A parameter element stored as float32 or as the IO dtype T.
template <typename T>
__device__ __forceinline__ float load_param(const void* base, std::int64_t i, bool is_f32) {
  return is_f32 ? __ldg(static_cast<const float*>(base) + i) : Num<T>::to_f(static_cast<const T*>(base)[i]);
}
template <typename T>
__device__ __forceinline__ void store_param(void* base, std::int64_t i, bool is_f32, float v) {
  if (is_f32) static_cast<float*>(base)[i] = v;
  else static_cast<T*>(base)[i] = Num<T>::from_f(v);
}

// Sum over an aligned group of `width` (power of two <= 32) lanes by xor butterfly: every lane of
// the group gets the same bits (a + b == b + a), and the order is fixed, so it is deterministic.
__device__ __forceinline__ float group_sum_warp(float v, int width) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1)
    if (off < width) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

}  // namespace fastweight::detail
