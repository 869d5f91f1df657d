// tensor.cpp: TensorRef helpers.
#include "fastweight/tensor.h"

#include <sstream>

#include "fastweight/error.h"

namespace fastweight {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "float32";
    case DType::f16: return "float16";
    case DType::bf16: return "bfloat16";
    case DType::f64: return "float64";
    case DType::i32: return "int32";
    case DType::i64: return "int64";
  }
  return "?";
}

std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: case DType::i32: return 4;
    case DType::f16: case DType::bf16: return 2;
    case DType::f64: case DType::i64: return 8;
  }
  return 0;
}

std::int64_t TensorRef::numel() const {
  std::int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

bool TensorRef::is_contiguous() const {
  std::int64_t expect = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != expect) return false;
    expect *= shape[d];
  }
  return true;
}

std::string TensorRef::shape_str() const {
  std::ostringstream os;
  os << '(';
  for (int d = 0; d < ndim; ++d) os << (d ? ", " : "") << shape[d];
  os << ')';
  return os.str();
}

std::string TensorRef::device_str() const {
  return device == DeviceType::cpu ? std::string("cpu") : "cuda:" + std::to_string(device_index);
}

TensorRef make_tensor(void* data, DType dtype, int ndim, const std::int64_t* shape,
                      DeviceType device, int device_index) {
  if (ndim < 0 || ndim > kMaxDims) throw ArgumentError(detail::cat("make_tensor: ndim ", ndim, " outside [0, ", kMaxDims, "]"));
  TensorRef t;
  t.data = data;
  t.dtype = dtype;
  t.ndim = ndim;
  t.device = device;
  t.device_index = device_index;
  std::int64_t s = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    t.shape[d] = shape[d];
    t.strides[d] = s;
    s *= shape[d];
  }
  return t;
}

TensorRef make_tensor(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                      DeviceType device, int device_index) {
  return make_tensor(data, dtype, int(shape.size()), shape.begin(), device, device_index);
}

}  // namespace fastweight
