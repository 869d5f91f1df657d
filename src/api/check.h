// check.h: argument checks shared by the public entry points (src/api/*_api.cpp). Each throws
// ArgumentError "op: name: what was expected, what was given" and never touches data.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <utility>

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

// q and v of a sequence op: present, 4-d (q_dims, v_dims: their shapes as named in the messages,
// e.g. "(B, T, H, K)"), q in an IO dtype, head dims (the last; named k_dim, v_dim) at least 1.
void check_qv_shapes(const char* op, const TensorRef& q, const TensorRef& v, const char* q_dims, const char* k_dim,
                     const char* v_dims, const char* v_dim, int ndim = 4);

// The checks of the sequence ops (mLSTM, DeltaNet): every tensor against one reference tensor of
// the call (q), which sets the device and the IO dtype. Each check also runs check_common and
// check_last_dim_contiguous.
struct SeqChecker {
  const char* op;
  const TensorRef& ref;
  const char* ref_name;

  void base(const char* name, const TensorRef& t) const;
  // Required, in the IO dtype, with this shape.
  void io(const char* name, const TensorRef& t, std::initializer_list<std::int64_t> shape) const;
  // Required, in the IO dtype or float32 (gates, beta), with this shape.
  void gate(const char* name, const TensorRef& t, std::initializer_list<std::int64_t> shape) const;
  // Required, float32 (float64 on the CPU): recurrent states and their gradients.
  void state(const char* name, const TensorRef& t, std::initializer_list<std::int64_t> shape) const;
};

// How the memory of two views relates: none (disjoint byte ranges, or either empty or absent), same (the
// very same view: pointer, dtype, shape, strides), partial (two dense views, each covering its byte range
// exactly once, whose ranges meet), unknown (strided views whose ranges interleave, e.g. the states of a
// packed per-head buffer: not decided, as torch leaves them, and not refused).
enum class Overlap { none, same, partial, unknown };
Overlap overlap(const TensorRef& a, const TensorRef& b);

struct NamedRef {
  const char* name;
  const TensorRef& t;
};
// Outputs may share memory with no input and no other output, except that an output may be the very
// same view as the input it is paired with in `in_place` ({output index, input index}: a decoding step's
// new state and its state). Refused with the names of both before anything is written.
void check_outputs_apart(const char* op, std::initializer_list<NamedRef> outs, std::initializer_list<NamedRef> ins,
                         std::initializer_list<std::pair<int, int>> in_place = {});

// A caller's workspace for a CUDA op: at least `need` bytes, not null and 16-byte aligned when need > 0.
void check_workspace(const char* op, void* ws, std::size_t bytes, std::size_t need);
// The error of CUDA tensors given to a build without CUDA kernels (FW_ENABLE_CUDA=OFF).
[[noreturn]] void no_cuda_build(const char* op);

}  // namespace fastweight::detail
