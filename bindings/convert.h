// convert.h: argument conversion shared by the binding files (module.cpp, mlstm.cpp, deltanet.cpp):
// DLPack arrays or tensor-spec tuples to fastweight::TensorRef, stream handles, workspaces. See module.cpp's top
// comment for the spec format.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <optional>
#include <string>

#include "fastweight/fastweight.h"

namespace nb = nanobind;

namespace fwbind {

using fastweight::DeviceType;
using fastweight::DType;
using fastweight::TensorRef;
using fastweight::detail::cat;

// ---- tensor arguments: a DLPack array or a spec tuple ------------------------------------------
// Why the spec: importing a torch tensor through DLPack (tensor.__dlpack__(), then the capsule)
// costs a few microseconds per tensor, and an op takes 5-9 tensors, so it dominated the host time of
// small ops. A caller that knows its tensors (fastweight.ops) passes instead the plain tuple
//   (data_ptr: int, dtype_code: int, shape: tuple[int], strides: tuple[int], device_type: int,
//    device_index: int)
// with dtype_code a fastweight::DType (0 float32, 1 float16, 2 bfloat16, 3 float64, 4 int32, 5 int64:
// the integers for index tensors such as cu_seqlens; the float ops reject them), strides in
// elements, device_type a fastweight::DeviceType (0 cpu, 1 cuda); built from t.data_ptr(), t.shape,
// t.stride() it costs a fraction of __dlpack__. The workspace likewise takes (data_ptr, nbytes).
// The caller keeps the memory alive for the call (a spec holds no reference to it).
template <typename Array, std::size_t N>
struct ArrayOrSpec {
  Array array;     // a DLPack array was given ...
  nb::object spec;  // ... or (when valid) an N-tuple spec, parsed in to_ref / to_workspace
};

using In = ArrayOrSpec<nb::ndarray<nb::ro>, 6>;   // read-only input (accepts read-only numpy arrays)
using Out = ArrayOrSpec<nb::ndarray<>, 6>;        // written by the op
using OptIn = std::optional<In>;
using OptOut = std::optional<Out>;
using OptWorkspace = std::optional<ArrayOrSpec<nb::ndarray<>, 2>>;

}  // namespace fwbind

namespace nanobind::detail {
// An exact tuple of N items is kept as the spec (parsed later, where errors can name the argument);
// anything else goes to the ndarray caster, so arrays behave exactly as with a plain nb::ndarray.
template <typename Array, std::size_t N>
struct type_caster<fwbind::ArrayOrSpec<Array, N>> {
  using Arg = fwbind::ArrayOrSpec<Array, N>;
  NB_TYPE_CASTER(Arg, make_caster<Array>::Name + const_name(" | tuple"))

  template <typename Flags>
  bool from_python(handle src, Flags flags, cleanup_list* cleanup) noexcept {
    if (PyTuple_CheckExact(src.ptr()) && PyTuple_GET_SIZE(src.ptr()) == Py_ssize_t(N)) {
      value.spec = nanobind::borrow(src);
      return true;
    }
    make_caster<Array> array;
    if (!array.from_python(src, flags, cleanup)) return false;
    value.array = std::move(array.value);
    return true;
  }
};
}  // namespace nanobind::detail

namespace fwbind {

inline std::string dlpack_dtype_name(nb::dlpack::dtype t) {
  using C = nb::dlpack::dtype_code;
  const char* base = "code";
  switch (static_cast<C>(t.code)) {
    case C::Int: base = "int"; break;
    case C::UInt: base = "uint"; break;
    case C::Float: base = "float"; break;
    case C::Bfloat: base = "bfloat"; break;
    case C::Complex: base = "complex"; break;
    case C::Bool: return "bool";
    default: return cat("dlpack dtype code ", int(t.code), " with ", int(t.bits), " bits");
  }
  std::string s = cat(base, int(t.bits));
  if (t.lanes != 1) s += cat("x", t.lanes);
  return s;
}

inline DType to_dtype(nb::dlpack::dtype t, const char* op, const char* name) {
  using C = nb::dlpack::dtype_code;
  if (t.lanes == 1) {
    if (t.code == uint8_t(C::Float) && t.bits == 32) return DType::f32;
    if (t.code == uint8_t(C::Float) && t.bits == 16) return DType::f16;
    if (t.code == uint8_t(C::Bfloat) && t.bits == 16) return DType::bf16;
    if (t.code == uint8_t(C::Float) && t.bits == 64) return DType::f64;
    if (t.code == uint8_t(C::Int) && t.bits == 32) return DType::i32;
    if (t.code == uint8_t(C::Int) && t.bits == 64) return DType::i64;
  }
  throw fastweight::ArgumentError(cat(op, ": ", name, ": dtype ", dlpack_dtype_name(t),
                                      " is not supported (float32, float16, bfloat16, float64; int32, int64 "
                                      "for index tensors)"));
}

template <typename A>
inline TensorRef array_to_ref(const A& a, const char* op, const char* name) {
  TensorRef t;
  const std::size_t nd = a.ndim();
  if (nd > std::size_t(fastweight::kMaxDims))
    throw fastweight::ArgumentError(cat(op, ": ", name, ": ", nd, " dimensions, at most ",
                                        fastweight::kMaxDims, " are supported"));
  t.dtype = to_dtype(a.dtype(), op, name);
  t.data = const_cast<void*>(static_cast<const void*>(a.data()));
  t.ndim = int(nd);
  for (std::size_t d = 0; d < nd; ++d) {
    t.shape[d] = std::int64_t(a.shape(d));
    t.strides[d] = a.stride(d);  // DLPack strides are in elements
  }
  switch (a.device_type()) {
    case nb::device::cpu::value:
      t.device = DeviceType::cpu;
      t.device_index = 0;
      break;
    case nb::device::cuda::value:
    case nb::device::cuda_managed::value:
      t.device = DeviceType::cuda;
      t.device_index = a.device_id();
      break;
    default:
      throw fastweight::ArgumentError(cat(op, ": ", name, ": DLPack device type ", a.device_type(),
                                          " is not supported (cpu, cuda)"));
  }
  return t;
}

// Item i of a spec tuple as an integer; a Python error (not an int, overflow) is left set.
inline std::int64_t spec_int(PyObject* t, Py_ssize_t i) { return PyLong_AsLongLong(PyTuple_GET_ITEM(t, i)); }

inline TensorRef spec_to_ref(const nb::object& spec, const char* op, const char* name) {
  PyObject* s = spec.ptr();
  PyObject* shape = PyTuple_GET_ITEM(s, 2);
  PyObject* strides = PyTuple_GET_ITEM(s, 3);
  const bool tuples = PyTuple_Check(shape) && PyTuple_Check(strides) &&  // torch.Size is a tuple
                      PyTuple_GET_SIZE(shape) == PyTuple_GET_SIZE(strides);
  const Py_ssize_t nd = tuples ? PyTuple_GET_SIZE(shape) : 0;
  if (nd > fastweight::kMaxDims)
    throw fastweight::ArgumentError(cat(op, ": ", name, ": ", nd, " dimensions, at most ",
                                        fastweight::kMaxDims, " are supported"));
  TensorRef t;
  t.data = PyLong_AsVoidPtr(PyTuple_GET_ITEM(s, 0));
  const std::int64_t dtype = spec_int(s, 1), device = spec_int(s, 4), index = spec_int(s, 5);
  t.ndim = int(nd);
  for (Py_ssize_t d = 0; d < nd; ++d) {
    t.shape[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, d));
    t.strides[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(strides, d));
  }
  if (!tuples || PyErr_Occurred()) {
    PyErr_Clear();
    throw fastweight::ArgumentError(
        cat(op, ": ", name, ": expected an array or a tensor spec (data_ptr: int, dtype_code: int, "
                            "shape: tuple[int], strides: tuple[int], device_type: int, device_index: int)"));
  }
  if (dtype < 0 || dtype > 5)
    throw fastweight::ArgumentError(cat(op, ": ", name, ": dtype code ", dtype, " is not supported ",
                                        "(0 float32, 1 float16, 2 bfloat16, 3 float64, 4 int32, 5 int64)"));
  t.dtype = DType(dtype);
  if (device != 0 && device != 1)
    throw fastweight::ArgumentError(cat(op, ": ", name, ": device type ", device,
                                        " is not supported (0 cpu, 1 cuda)"));
  t.device = DeviceType(device);
  t.device_index = device == 0 ? 0 : int(index);
  return t;
}

template <typename Array, std::size_t N>
TensorRef to_ref(const ArrayOrSpec<Array, N>& a, const char* op, const char* name) {
  return a.spec.is_valid() ? spec_to_ref(a.spec, op, name) : array_to_ref(a.array, op, name);
}

template <typename A>
TensorRef to_ref(const std::optional<A>& a, const char* op, const char* name) {
  return a ? to_ref(*a, op, name) : TensorRef{};
}

inline fastweight::Stream to_stream(std::uintptr_t s) { return reinterpret_cast<fastweight::Stream>(s); }

// The workspace: any contiguous array (normally uint8) of at least the asked number of bytes, or
// the spec (data_ptr, nbytes).
struct Workspace {
  void* data = nullptr;
  std::size_t bytes = 0;
};
inline Workspace to_workspace(const OptWorkspace& w, const TensorRef& x, const char* op) {
  if (!w) return {};
  if (w->spec.is_valid()) {  // (data_ptr, nbytes): assumed on x's device, contiguous
    void* data = PyLong_AsVoidPtr(PyTuple_GET_ITEM(w->spec.ptr(), 0));
    const std::size_t bytes = PyLong_AsSize_t(PyTuple_GET_ITEM(w->spec.ptr(), 1));
    if (PyErr_Occurred()) {
      PyErr_Clear();
      throw fastweight::ArgumentError(cat(op, ": workspace: expected an array or (data_ptr: int, nbytes: int)"));
    }
    return {bytes ? data : nullptr, bytes};
  }
  const auto& a = w->array;
  std::int64_t expect = 1;
  for (std::size_t d = a.ndim(); d-- > 0;) {
    if (a.shape(d) != 1 && a.stride(d) != expect)
      throw fastweight::ArgumentError(cat(op, ": workspace: expected a contiguous array"));
    expect *= std::int64_t(a.shape(d));
  }
  const bool cuda = a.device_type() == nb::device::cuda::value ||
                    a.device_type() == nb::device::cuda_managed::value;
  const DeviceType dev = cuda ? DeviceType::cuda : DeviceType::cpu;
  if (a.nbytes() > 0 && (dev != x.device || (cuda && a.device_id() != x.device_index)))
    throw fastweight::ArgumentError(cat(op, ": workspace: expected device ", x.device_str(),
                                        " (that of x)"));
  return {a.size() ? static_cast<void*>(a.data()) : nullptr, a.nbytes()};
}

}  // namespace fwbind
