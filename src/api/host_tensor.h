// host_tensor.h: copy a strided CPU TensorRef of any dtype into a contiguous float64 vector and
// back, so the float64 references (src/reference) can serve every dtype and every stride.
#pragma once

#include <vector>

#include "fastweight/tensor.h"

namespace fastweight::detail {

// Row-major contiguous copy of t as double; empty when t is absent.
std::vector<double> gather_f64(const TensorRef& t);
// Writes v (row-major, t.numel() values) into t, rounding to t's dtype. No-op when t is absent.
void scatter_f64(const std::vector<double>& v, const TensorRef& t);

}  // namespace fastweight::detail
