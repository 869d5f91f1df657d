// half.h: host-side float16 / bfloat16 <-> float conversion (round to nearest even), for the CPU
// reference and the tests. Device code uses cuda_fp16.h / cuda_bf16.h instead.
#pragma once

#include <cstdint>
#include <cstring>

#include "fastweight/tensor.h"

namespace fastweight::detail {

inline float bits_to_float(std::uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline std::uint32_t float_to_bits(float f) { std::uint32_t u; std::memcpy(&u, &f, 4); return u; }

inline float bf16_to_float(std::uint16_t h) { return bits_to_float(std::uint32_t(h) << 16); }
inline std::uint16_t float_to_bf16(float f) {
  std::uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return std::uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return std::uint16_t(u >> 16);
}

inline float f16_to_float(std::uint16_t h) {
  const std::uint32_t sign = std::uint32_t(h & 0x8000u) << 16;
  std::uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (man << 13));  // inf / nan
  if (exp == 0) {
    if (man == 0) return bits_to_float(sign);
    int e = -1;  // subnormal: normalise
    do { ++e; man <<= 1; } while ((man & 0x400u) == 0);
    return bits_to_float(sign | std::uint32_t(127 - 15 - e) << 23 | (man & 0x3ffu) << 13);
  }
  return bits_to_float(sign | (exp + 112u) << 23 | man << 13);
}
inline std::uint16_t float_to_f16(float f) {
  const std::uint32_t u = float_to_bits(f);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t au = u & 0x7fffffffu;
  if (au > 0x7f800000u) return std::uint16_t(sign | 0x7e00u);       // nan
  if (au >= 0x477ff000u) return std::uint16_t(sign | 0x7c00u);      // overflow to inf (rounded)
  if (au < 0x38800000u) {                                           // subnormal or zero in f16
    if (au < 0x33000000u) return std::uint16_t(sign);               // < half of min subnormal
    const std::uint32_t man = (au & 0x7fffffu) | 0x800000u;
    const int shift = 126 - int(au >> 23);                          // 14..24
    const std::uint32_t rem_mask = (1u << shift) - 1u, half = 1u << (shift - 1);
    std::uint32_t r = man >> shift;
    const std::uint32_t rem = man & rem_mask;
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return std::uint16_t(sign | r);
  }
  std::uint32_t r = au + 0xfffu + ((au >> 13) & 1u);  // round mantissa to 10 bits
  return std::uint16_t(sign | ((r - 0x38000000u) >> 13));
}

// Element load/store of any dtype as double (reference) or float. Integers convert by value
// (exact up to 2^53; the store truncates toward zero).
inline double load_as_double(const void* base, std::int64_t i, DType t) {
  switch (t) {
    case DType::f32: return static_cast<const float*>(base)[i];
    case DType::f64: return static_cast<const double*>(base)[i];
    case DType::f16: return f16_to_float(static_cast<const std::uint16_t*>(base)[i]);
    case DType::bf16: return bf16_to_float(static_cast<const std::uint16_t*>(base)[i]);
    case DType::i32: return double(static_cast<const std::int32_t*>(base)[i]);
    case DType::i64: return double(static_cast<const std::int64_t*>(base)[i]);
  }
  return 0.0;
}
inline void store_from_double(void* base, std::int64_t i, DType t, double v) {
  switch (t) {
    case DType::f32: static_cast<float*>(base)[i] = float(v); break;
    case DType::f64: static_cast<double*>(base)[i] = v; break;
    case DType::f16: static_cast<std::uint16_t*>(base)[i] = float_to_f16(float(v)); break;
    case DType::bf16: static_cast<std::uint16_t*>(base)[i] = float_to_bf16(float(v)); break;
    case DType::i32: static_cast<std::int32_t*>(base)[i] = std::int32_t(v); break;
    case DType::i64: static_cast<std::int64_t*>(base)[i] = std::int64_t(v); break;
  }
}

}  // namespace fastweight::detail
