// fastweight/tensor.h: TensorRef, a non-owning view of a strided tensor (the caller owns memory).
//
// Strides are in elements (as in torch and DLPack), int64. Kernels need the last dimension
// contiguous (stride 1); every other stride is free, so rows cut from a larger buffer, transposed
// leading dims and broadcast (stride 0) leading dims all work. No CUDA or torch header is included.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

struct CUstream_st;

namespace fastweight {

// A CUDA stream handle (cudaStream_t); nullptr means the legacy default stream, which the Python
// layer never passes (it passes torch's current stream).
using Stream = CUstream_st*;

// Floating dtypes carry data; the integer ones exist for index tensors (DeltaNet's cu_seqlens) and
// every float-only argument check rejects them.
enum class DType : std::uint8_t { f32 = 0, f16 = 1, bf16 = 2, f64 = 3, i32 = 4, i64 = 5 };
enum class DeviceType : std::uint8_t { cpu = 0, cuda = 1 };

inline constexpr int kMaxDims = 8;

const char* dtype_name(DType t);   // "float32", "float16", "bfloat16", "float64", "int32", "int64"
std::size_t dtype_size(DType t);   // bytes per element

struct TensorRef {
  void* data = nullptr;
  DType dtype = DType::f32;
  int ndim = 0;
  std::int64_t shape[kMaxDims] = {};
  std::int64_t strides[kMaxDims] = {};  // in elements
  DeviceType device = DeviceType::cpu;
  int device_index = 0;

  // An absent optional tensor (weight=None) is a TensorRef with data == nullptr and ndim == 0.
  bool defined() const { return data != nullptr || ndim > 0; }
  std::int64_t numel() const;
  std::int64_t size(int d) const { return shape[d < 0 ? d + ndim : d]; }
  std::int64_t stride(int d) const { return strides[d < 0 ? d + ndim : d]; }
  bool is_contiguous() const;
  std::string shape_str() const;  // "(4, 1024)"
  std::string device_str() const;  // "cpu", "cuda:0"
};

// A contiguous TensorRef over caller memory (row-major strides).
TensorRef make_tensor(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                      DeviceType device = DeviceType::cpu, int device_index = 0);
TensorRef make_tensor(void* data, DType dtype, int ndim, const std::int64_t* shape,
                      DeviceType device = DeviceType::cpu, int device_index = 0);

}  // namespace fastweight
