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
  for_each_offset(t, [&](std::int64_t off, std::int64_t lin) { v[lin] = load_as_double(t.data, off, t.dtype); });
  return v;
}

void scatter_f64(const std::vector<double>& v, const TensorRef& t) {
  if (!t.defined()) return;
  for_each_offset(t, [&](std::int64_t off, std::int64_t lin) { store_from_double(t.data, off, t.dtype, v[lin]); });
}

std::vector<std::int64_t> gather_i64(const TensorRef& t) {
  std::vector<std::int64_t> v;
  if (!t.defined()) return v;
  v.resize(std::size_t(t.numel()));
  for_each_offset(t, [&](std::int64_t off, std::int64_t lin) {
    v[lin] = t.dtype == DType::i32 ? static_cast<const std::int32_t*>(t.data)[off]
                                   : static_cast<const std::int64_t*>(t.data)[off];
  });
  return v;
}

}  // namespace fastweight::detail
