// vec.cuh: dtype traits, 16-byte vector loads/stores and warp/group reductions for memory-bound
// kernels. A "vector" is 16 bytes: E = 16 / sizeof(T) elements (8 for fp16/bf16, 4 for fp32).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

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

// E fp32 values as one raw 16-byte vector of T, rounded to nearest (one cvt per pair for 16-bit types).
template <typename T>
__device__ __forceinline__ uint4 pack(const float (&v)[kVecElems<T>]) {
  constexpr int E = kVecElems<T>;
  uint4 raw;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162* e2 = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < E / 2; ++i) e2[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
  } else if constexpr (std::is_same_v<T, __half>) {
    __half2* e2 = reinterpret_cast<__half2*>(&raw);
#pragma unroll
    for (int i = 0; i < E / 2; ++i) e2[i] = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
  } else {
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < E; ++i) e[i] = Num<T>::from_f(v[i]);
  }
  return raw;
}

template <typename T>
__device__ __forceinline__ void store_vec(T* row, int col, int n, bool aligned,
                                          const float (&v)[kVecElems<T>]) {
  constexpr int E = kVecElems<T>;
  if (aligned) {
    if (col < n) *reinterpret_cast<uint4*>(row + col) = pack<T>(v);
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

// All E elements of a raw vector as fp32, with the fewest instructions: bf16 is the high half of an
// fp32 (one shift or mask per element), fp16 converts in pairs.
template <typename T>
__device__ __forceinline__ void unpack(const uint4& raw, float (&f)[kVecElems<T>]) {
  const unsigned u[4] = {raw.x, raw.y, raw.z, raw.w};
  if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int i = 0; i < 4; ++i) f[i] = __uint_as_float(u[i]);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __uint_as_float(u[i] << 16);
      f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __half2 h;
      memcpy(&h, &u[i], 4);
      const float2 t = __half22float2(h);
      f[2 * i] = t.x;
      f[2 * i + 1] = t.y;
    }
  }
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

// ---- cp.async (sm_80+): 16-byte global -> shared copies that need no registers while in flight ------
// A thread that copies into shared memory and later reads back only its own slots needs no barrier:
// cp_async_wait<N>() makes this thread's older groups visible to this thread.
// pred = false zero-fills the 16 bytes without reading global memory (`src` must still be mapped).
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* src, bool pred) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(pred ? 16 : 0) : "memory");
}
// 4-byte variant (through L1: neighbouring threads copy the same per-row statistics).
__device__ __forceinline__ void cp_async4(void* smem_dst, const void* src, bool pred) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(pred ? 4 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

}  // namespace fastweight::detail
