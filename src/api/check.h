// check.h: argument checks shared by the public entry points (src/api/*_api.cpp). Each throws
// ArgumentError "op: name: what was expected, what was given" and never touches data.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "fastweight/error.h"
#include "fastweight/tensor.h"

namespace fastweight::detail {

// Rank, device (that of `ref`, named ref_name), non-negative sizes, data pointer and alignment.
void check_common(const char* op, const char* name, const TensorRef& t, const TensorRef& ref, const char* ref_name);
// IO dtypes: float32, float16, bfloat16, and float64 on the CPU.
void check_io_dtype(const char* op, const char* name, const TensorRef& t);
// The last dimension has stride 1 (or size <= 1).
void check_last_dim_contiguous(const char* op, const char* name, const TensorRef& t);
// t.shape == shape exactly.
void check_shape(const char* op, const char* name, const TensorRef& t, std::initializer_list<std::int64_t> shape);

}  // namespace fastweight::detail
