// host_tensor.h: copy a strided CPU TensorRef of any dtype into a contiguous float64 vector and
// back, so the float64 references (src/reference) can serve every dtype and every stride.
#pragma once

#include <cstdint>
#include <vector>

#include "fastweight/tensor.h"

namespace fastweight::detail {

// Row-major contiguous copy of t as double; empty when t is absent.
std::vector<double> gather_f64(const TensorRef& t);
// Writes v (row-major, t.numel() values) into t, rounding to t's dtype. No-op when t is absent.
void scatter_f64(const std::vector<double>& v, const TensorRef& t);
// Row-major copy of an int32 or int64 tensor (index tensors such as cu_seqlens); empty when absent.
std::vector<std::int64_t> gather_i64(const TensorRef& t);

// The data of a gathered (or output) vector for the references, which take null as 'absent'.
inline double* ptr_or_null(std::vector<double>& v) { return v.empty() ? nullptr : v.data(); }
inline const double* ptr_or_null(const std::vector<double>& v) { return v.empty() ? nullptr : v.data(); }
// An output buffer for t: t.numel() values, or empty when t is absent.
inline std::vector<double> out_buffer(const TensorRef& t) {
  return std::vector<double>(t.defined() ? std::size_t(t.numel()) : 0);
}

}  // namespace fastweight::detail
