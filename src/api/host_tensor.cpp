// host_tensor.cpp: see host_tensor.h.
#include "api/host_tensor.h"

#include <cstdint>

#include "common/half.h"

namespace fastweight::detail {
namespace {

// Calls fn(element offset, linear index) for every element of t in row-major order.
template <typename Fn>
void for_each_offset(const TensorRef& t, Fn&& fn) {
  const std::int64_t n = t.numel();
  if (n == 0) return;
  std::int64_t idx[kMaxDims] = {};
  std::int64_t off = 0;
  for (std::int64_t lin = 0; lin < n; ++lin) {
    fn(off, lin);
    for (int d = t.ndim - 1; d >= 0; --d) {  // odometer increment
      if (++idx[d] < t.shape[d]) {
        off += t.strides[d];
        break;
      }
      off -= t.strides[d] * (t.shape[d] - 1);
      idx[d] = 0;
    }
  }
}

}  // namespace

std::vector<double> gather_f64(const TensorRef& t) {
  std::vector<double> v;
  if (!t.defined()) return v;
  v.resize(std::size_t(t.numel()));
  for_each_offset(t, [&](std::int64_t off, std::int64_t lin) {
    switch (t.dtype) {
      case DType::f32: v[lin] = static_cast<const float*>(t.data)[off]; break;
      case DType::f64: v[lin] = static_cast<const double*>(t.data)[off]; break;
      case DType::f16: v[lin] = f16_to_float(static_cast<const std::uint16_t*>(t.data)[off]); break;
      case DType::bf16: v[lin] = bf16_to_float(static_cast<const std::uint16_t*>(t.data)[off]); break;
    }
  });
  return v;
}

void scatter_f64(const std::vector<double>& v, const TensorRef& t) {
  if (!t.defined()) return;
  for_each_offset(t, [&](std::int64_t off, std::int64_t lin) {
    switch (t.dtype) {
      case DType::f32: static_cast<float*>(t.data)[off] = float(v[lin]); break;
      case DType::f64: static_cast<double*>(t.data)[off] = v[lin]; break;
      case DType::f16: static_cast<std::uint16_t*>(t.data)[off] = float_to_f16(float(v[lin])); break;
      case DType::bf16: static_cast<std::uint16_t*>(t.data)[off] = float_to_bf16(float(v[lin])); break;
    }
  });
}

}  // namespace fastweight::detail
