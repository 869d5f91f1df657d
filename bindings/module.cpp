// module.cpp: the nanobind module fastweight._C, a thin layer over the C++ API (fastweight.h).
//
// Every tensor argument is either any DLPack-capable array (torch, numpy, JAX, CuPy ...), taken
// without a dtype/device constraint in the signature, or a "tensor spec" tuple (the fast path, see
// ArrayOrSpec below); both are converted to a fastweight::TensorRef here, and the C++ API does all
// validation (so the messages are the same from C++ and Python). Absent optional tensors (None)
// become TensorRef{}. The stream is a Python int holding a cudaStream_t (0: legacy default; the
// Python layer passes torch's current stream). The GIL is released around each C++ call.
// Errors: fastweight::ArgumentError -> ValueError, fastweight::Error -> RuntimeError, same message.
// No PyTorch header or library is used, so one build works with every torch version.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <optional>
#include <string>

#include "fastweight/fastweight.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

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
// with dtype_code a fastweight::DType (0 float32, 1 float16, 2 bfloat16, 3 float64), strides in
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

}  // namespace

namespace nanobind::detail {
// An exact tuple of N items is kept as the spec (parsed later, where errors can name the argument);
// anything else goes to the ndarray caster, so arrays behave exactly as with a plain nb::ndarray.
template <typename Array, std::size_t N>
struct type_caster<ArrayOrSpec<Array, N>> {
  using Arg = ArrayOrSpec<Array, N>;
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

namespace {

std::string dlpack_dtype_name(nb::dlpack::dtype t) {
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

DType to_dtype(nb::dlpack::dtype t, const char* op, const char* name) {
  using C = nb::dlpack::dtype_code;
  if (t.lanes == 1) {
    if (t.code == uint8_t(C::Float) && t.bits == 32) return DType::f32;
    if (t.code == uint8_t(C::Float) && t.bits == 16) return DType::f16;
    if (t.code == uint8_t(C::Bfloat) && t.bits == 16) return DType::bf16;
    if (t.code == uint8_t(C::Float) && t.bits == 64) return DType::f64;
  }
  throw fastweight::ArgumentError(cat(op, ": ", name, ": dtype ", dlpack_dtype_name(t),
                                      " is not supported (float32, float16, bfloat16, float64)"));
}

template <typename A>
TensorRef array_to_ref(const A& a, const char* op, const char* name) {
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
std::int64_t spec_int(PyObject* t, Py_ssize_t i) { return PyLong_AsLongLong(PyTuple_GET_ITEM(t, i)); }

TensorRef spec_to_ref(const nb::object& spec, const char* op, const char* name) {
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
  if (dtype < 0 || dtype > 3)
    throw fastweight::ArgumentError(cat(op, ": ", name, ": dtype code ", dtype, " is not supported ",
                                        "(0 float32, 1 float16, 2 bfloat16, 3 float64)"));
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

fastweight::Stream to_stream(std::uintptr_t s) { return reinterpret_cast<fastweight::Stream>(s); }

// The workspace: any contiguous array (normally uint8) of at least the asked number of bytes, or
// the spec (data_ptr, nbytes).
struct Workspace {
  void* data = nullptr;
  std::size_t bytes = 0;
};
Workspace to_workspace(const OptWorkspace& w, const TensorRef& x, const char* op) {
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

// ---- the ops ------------------------------------------------------------------------------------
// layernorm and headnorm take the same arguments (headnorm's weight/bias are (NH, DH)): one body
// each for fwd / bwd workspace / bwd, instantiated with the op's names, argument structs and entry
// points.
struct LayerNormOps {
  using Fwd = fastweight::LayerNormFwdArgs;
  using Bwd = fastweight::LayerNormBwdArgs;
  static constexpr const char* fwd_name = "layernorm_fwd";
  static constexpr const char* bwd_name = "layernorm_bwd";
  static void fwd(const Fwd& a, fastweight::Stream s) { fastweight::layernorm_fwd(a, s); }
  static std::size_t workspace(const Bwd& a) { return fastweight::layernorm_bwd_workspace_size(a); }
  static void bwd(const Bwd& a, void* w, std::size_t n, fastweight::Stream s) { fastweight::layernorm_bwd(a, w, n, s); }
};
struct HeadNormOps {
  using Fwd = fastweight::HeadNormFwdArgs;
  using Bwd = fastweight::HeadNormBwdArgs;
  static constexpr const char* fwd_name = "headnorm_fwd";
  static constexpr const char* bwd_name = "headnorm_bwd";
  static void fwd(const Fwd& a, fastweight::Stream s) { fastweight::headnorm_fwd(a, s); }
  static std::size_t workspace(const Bwd& a) { return fastweight::headnorm_bwd_workspace_size(a); }
  static void bwd(const Bwd& a, void* w, std::size_t n, fastweight::Stream s) { fastweight::headnorm_bwd(a, w, n, s); }
};

template <typename Ops>
void ln_fwd(const In& x, const OptIn& weight, const OptIn& bias, const Out& y, const OptOut& mean,
            const OptOut& rstd, double eps, double weight_offset, std::uintptr_t stream) {
  const char* op = Ops::fwd_name;
  typename Ops::Fwd a;
  a.x = to_ref(x, op, "x");
  a.weight = to_ref(weight, op, "weight");
  a.bias = to_ref(bias, op, "bias");
  a.y = to_ref(y, op, "y");
  a.mean = to_ref(mean, op, "mean");
  a.rstd = to_ref(rstd, op, "rstd");
  a.eps = eps;
  a.weight_offset = weight_offset;
  nb::gil_scoped_release release;
  Ops::fwd(a, to_stream(stream));
}

template <typename Ops>
typename Ops::Bwd ln_bwd_args(const In& dy, const In& x, const OptIn& weight, const In& mean,
                              const In& rstd, const Out& dx, const OptOut& dweight,
                              const OptOut& dbias, double weight_offset) {
  const char* op = Ops::bwd_name;
  typename Ops::Bwd a;
  a.dy = to_ref(dy, op, "dy");
  a.x = to_ref(x, op, "x");
  a.weight = to_ref(weight, op, "weight");
  a.mean = to_ref(mean, op, "mean");
  a.rstd = to_ref(rstd, op, "rstd");
  a.dx = to_ref(dx, op, "dx");
  a.dweight = to_ref(dweight, op, "dweight");
  a.dbias = to_ref(dbias, op, "dbias");
  a.weight_offset = weight_offset;
  return a;
}

template <typename Ops>
std::size_t ln_bwd_workspace_size(const In& dy, const In& x, const OptIn& weight, const In& mean,
                                  const In& rstd, const Out& dx, const OptOut& dweight,
                                  const OptOut& dbias, double weight_offset) {
  auto a = ln_bwd_args<Ops>(dy, x, weight, mean, rstd, dx, dweight, dbias, weight_offset);
  nb::gil_scoped_release release;
  return Ops::workspace(a);
}

template <typename Ops>
void ln_bwd(const In& dy, const In& x, const OptIn& weight, const In& mean, const In& rstd,
            const Out& dx, const OptOut& dweight, const OptOut& dbias, double weight_offset,
            const OptWorkspace& workspace, std::uintptr_t stream) {
  auto a = ln_bwd_args<Ops>(dy, x, weight, mean, rstd, dx, dweight, dbias, weight_offset);
  const Workspace ws = to_workspace(workspace, a.x, Ops::bwd_name);
  nb::gil_scoped_release release;
  Ops::bwd(a, ws.data, ws.bytes, to_stream(stream));
}

void rmsnorm_fwd(const In& x, const OptIn& weight, const Out& y, const OptOut& rstd, double eps,
                 double weight_offset, std::uintptr_t stream) {
  const char* op = "rmsnorm_fwd";
  fastweight::RMSNormFwdArgs a;
  a.x = to_ref(x, op, "x");
  a.weight = to_ref(weight, op, "weight");
  a.y = to_ref(y, op, "y");
  a.rstd = to_ref(rstd, op, "rstd");
  a.eps = eps;
  a.weight_offset = weight_offset;
  nb::gil_scoped_release release;
  fastweight::rmsnorm_fwd(a, to_stream(stream));
}

fastweight::RMSNormBwdArgs rmsnorm_bwd_args(const char* op, const In& dy, const In& x,
                                            const OptIn& weight, const In& rstd, const Out& dx,
                                            const OptOut& dweight, double weight_offset) {
  fastweight::RMSNormBwdArgs a;
  a.dy = to_ref(dy, op, "dy");
  a.x = to_ref(x, op, "x");
  a.weight = to_ref(weight, op, "weight");
  a.rstd = to_ref(rstd, op, "rstd");
  a.dx = to_ref(dx, op, "dx");
  a.dweight = to_ref(dweight, op, "dweight");
  a.weight_offset = weight_offset;
  return a;
}

std::size_t rmsnorm_bwd_workspace_size(const In& dy, const In& x, const OptIn& weight,
                                       const In& rstd, const Out& dx, const OptOut& dweight,
                                       double weight_offset) {
  auto a = rmsnorm_bwd_args("rmsnorm_bwd", dy, x, weight, rstd, dx, dweight, weight_offset);
  nb::gil_scoped_release release;
  return fastweight::rmsnorm_bwd_workspace_size(a);
}

void rmsnorm_bwd(const In& dy, const In& x, const OptIn& weight, const In& rstd, const Out& dx,
                 const OptOut& dweight, double weight_offset, const OptWorkspace& workspace,
                 std::uintptr_t stream) {
  const char* op = "rmsnorm_bwd";
  auto a = rmsnorm_bwd_args(op, dy, x, weight, rstd, dx, dweight, weight_offset);
  const Workspace ws = to_workspace(workspace, a.x, op);
  nb::gil_scoped_release release;
  fastweight::rmsnorm_bwd(a, ws.data, ws.bytes, to_stream(stream));
}

void adalayernorm_fwd(const In& x, const In& scale, const OptIn& shift, const Out& y,
                      const OptOut& mean, const OptOut& rstd, double eps, std::uintptr_t stream) {
  const char* op = "adalayernorm_fwd";
  fastweight::AdaLayerNormFwdArgs a;
  a.x = to_ref(x, op, "x");
  a.scale = to_ref(scale, op, "scale");
  a.shift = to_ref(shift, op, "shift");
  a.y = to_ref(y, op, "y");
  a.mean = to_ref(mean, op, "mean");
  a.rstd = to_ref(rstd, op, "rstd");
  a.eps = eps;
  nb::gil_scoped_release release;
  fastweight::adalayernorm_fwd(a, to_stream(stream));
}

fastweight::AdaLayerNormBwdArgs adalayernorm_bwd_args(const char* op, const In& dy, const In& x,
                                                      const In& scale, const In& mean,
                                                      const In& rstd, const Out& dx,
                                                      const OptOut& dscale, const OptOut& dshift) {
  fastweight::AdaLayerNormBwdArgs a;
  a.dy = to_ref(dy, op, "dy");
  a.x = to_ref(x, op, "x");
  a.scale = to_ref(scale, op, "scale");
  a.mean = to_ref(mean, op, "mean");
  a.rstd = to_ref(rstd, op, "rstd");
  a.dx = to_ref(dx, op, "dx");
  a.dscale = to_ref(dscale, op, "dscale");
  a.dshift = to_ref(dshift, op, "dshift");
  return a;
}

std::size_t adalayernorm_bwd_workspace_size(const In& dy, const In& x, const In& scale,
                                            const In& mean, const In& rstd, const Out& dx,
                                            const OptOut& dscale, const OptOut& dshift) {
  auto a = adalayernorm_bwd_args("adalayernorm_bwd", dy, x, scale, mean, rstd, dx, dscale, dshift);
  nb::gil_scoped_release release;
  return fastweight::adalayernorm_bwd_workspace_size(a);
}

void adalayernorm_bwd(const In& dy, const In& x, const In& scale, const In& mean, const In& rstd,
                      const Out& dx, const OptOut& dscale, const OptOut& dshift,
                      const OptWorkspace& workspace, std::uintptr_t stream) {
  const char* op = "adalayernorm_bwd";
  auto a = adalayernorm_bwd_args(op, dy, x, scale, mean, rstd, dx, dscale, dshift);
  const Workspace ws = to_workspace(workspace, a.x, op);
  nb::gil_scoped_release release;
  fastweight::adalayernorm_bwd(a, ws.data, ws.bytes, to_stream(stream));
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "fastweight._C: fused LayerNorm-family kernels over DLPack tensors or tensor specs "
            "(data_ptr, dtype_code, shape, strides, device_type, device_index) (see fastweight/norm.h)";

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const fastweight::ArgumentError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const fastweight::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });

  const auto none = nb::none();

  // layernorm / headnorm share one signature.
  m.def("layernorm_fwd", &ln_fwd<LayerNormOps>, "x"_a, "weight"_a.none(), "bias"_a.none(),
        "y"_a, "mean"_a.none() = none, "rstd"_a.none() = none, "eps"_a = 1e-5,
        "weight_offset"_a = 0.0, "stream"_a = 0,
        "y = (x - mean) * rstd * (weight_offset + weight) + bias over the last dim; writes y and,\n"
        "when given, the fp32 statistics mean/rstd (one per row).");
  m.def("layernorm_bwd_workspace_size", &ln_bwd_workspace_size<LayerNormOps>, "dy"_a, "x"_a,
        "weight"_a.none(), "mean"_a, "rstd"_a, "dx"_a, "dweight"_a.none() = none,
        "dbias"_a.none() = none, "weight_offset"_a = 0.0,
        "Bytes of workspace layernorm_bwd needs for these arguments (0 on the CPU).");
  m.def("layernorm_bwd", &ln_bwd<LayerNormOps>, "dy"_a, "x"_a, "weight"_a.none(), "mean"_a, "rstd"_a,
        "dx"_a, "dweight"_a.none() = none, "dbias"_a.none() = none, "weight_offset"_a = 0.0,
        "workspace"_a.none() = none, "stream"_a = 0,
        "Writes dx and, when given, dweight/dbias (deterministic).");

  m.def("headnorm_fwd", &ln_fwd<HeadNormOps>, "x"_a, "weight"_a.none(), "bias"_a.none(),
        "y"_a, "mean"_a.none() = none, "rstd"_a.none() = none, "eps"_a = 1e-6,
        "weight_offset"_a = 0.0, "stream"_a = 0,
        "Per-head LayerNorm of x (..., NH, DH) with weight/bias (NH, DH).");
  m.def("headnorm_bwd_workspace_size", &ln_bwd_workspace_size<HeadNormOps>, "dy"_a, "x"_a,
        "weight"_a.none(), "mean"_a, "rstd"_a, "dx"_a, "dweight"_a.none() = none,
        "dbias"_a.none() = none, "weight_offset"_a = 0.0);
  m.def("headnorm_bwd", &ln_bwd<HeadNormOps>, "dy"_a, "x"_a, "weight"_a.none(), "mean"_a, "rstd"_a,
        "dx"_a, "dweight"_a.none() = none, "dbias"_a.none() = none, "weight_offset"_a = 0.0,
        "workspace"_a.none() = none, "stream"_a = 0);

  m.def("rmsnorm_fwd", &rmsnorm_fwd, "x"_a, "weight"_a.none(), "y"_a,
        "rstd"_a.none() = none, "eps"_a = 1e-6, "weight_offset"_a = 0.0, "stream"_a = 0,
        "y = x * rstd * (weight_offset + weight) over the last dim; rstd fp32, one per row.");
  m.def("rmsnorm_bwd_workspace_size", &rmsnorm_bwd_workspace_size, "dy"_a, "x"_a,
        "weight"_a.none(), "rstd"_a, "dx"_a, "dweight"_a.none() = none, "weight_offset"_a = 0.0);
  m.def("rmsnorm_bwd", &rmsnorm_bwd, "dy"_a, "x"_a, "weight"_a.none(), "rstd"_a, "dx"_a,
        "dweight"_a.none() = none, "weight_offset"_a = 0.0, "workspace"_a.none() = none,
        "stream"_a = 0);

  m.def("adalayernorm_fwd", &adalayernorm_fwd, "x"_a, "scale"_a, "shift"_a.none(), "y"_a,
        "mean"_a.none() = none, "rstd"_a.none() = none, "eps"_a = 1e-5, "stream"_a = 0,
        "Adaptive LayerNorm: x (B, S, D), scale/shift (B, 1, D): y = xhat * scale[b] + shift[b].");
  m.def("adalayernorm_bwd_workspace_size", &adalayernorm_bwd_workspace_size, "dy"_a, "x"_a,
        "scale"_a, "mean"_a, "rstd"_a, "dx"_a, "dscale"_a.none() = none,
        "dshift"_a.none() = none);
  m.def("adalayernorm_bwd", &adalayernorm_bwd, "dy"_a, "x"_a, "scale"_a, "mean"_a, "rstd"_a,
        "dx"_a, "dscale"_a.none() = none, "dshift"_a.none() = none, "workspace"_a.none() = none,
        "stream"_a = 0);

  m.def("cuda_available", [] { return fastweight::cuda_available(); },
        "True when this build has CUDA kernels and a GPU is visible.");
  m.def("build_info", [] { return std::string(fastweight::build_info()); },
        "How this build was configured (CUDA archs and dtypes, or 'cpu only').");
}
