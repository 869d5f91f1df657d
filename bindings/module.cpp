// module.cpp: the nanobind module fastweight._C, a thin layer over the C++ API (fastweight.h).
//
// Every tensor argument is any DLPack-capable array (torch, numpy, JAX, CuPy ...), taken without a
// dtype/device constraint in the signature and converted to a fastweight::TensorRef here; the C++ API
// does all validation (so the messages are the same from C++ and Python). Absent optional tensors
// (None) become TensorRef{}. The stream is a Python int holding a cudaStream_t (0: legacy default;
// the Python layer passes torch's current stream). The GIL is released around each C++ call.
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

using In = nb::ndarray<nb::ro>;   // read-only input (accepts read-only numpy arrays too)
using Out = nb::ndarray<>;        // written by the op
using OptIn = std::optional<In>;
using OptOut = std::optional<Out>;

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
TensorRef to_ref(const A& a, const char* op, const char* name) {
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

template <typename A>
TensorRef to_ref(const std::optional<A>& a, const char* op, const char* name) {
  return a ? to_ref(*a, op, name) : TensorRef{};
}

fastweight::Stream to_stream(std::uintptr_t s) { return reinterpret_cast<fastweight::Stream>(s); }

// The workspace: any contiguous array (normally uint8) of at least the asked number of bytes.
struct Workspace {
  void* data = nullptr;
  std::size_t bytes = 0;
};
Workspace to_workspace(const OptOut& w, const TensorRef& x, const char* op) {
  if (!w) return {};
  const Out& a = *w;
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
void layernorm_fwd(const In& x, const OptIn& weight, const OptIn& bias, const Out& y,
                   const OptOut& mean, const OptOut& rstd, double eps, double weight_offset,
                   std::uintptr_t stream) {
  const char* op = "layernorm_fwd";
  fastweight::LayerNormFwdArgs a;
  a.x = to_ref(x, op, "x");
  a.weight = to_ref(weight, op, "weight");
  a.bias = to_ref(bias, op, "bias");
  a.y = to_ref(y, op, "y");
  a.mean = to_ref(mean, op, "mean");
  a.rstd = to_ref(rstd, op, "rstd");
  a.eps = eps;
  a.weight_offset = weight_offset;
  nb::gil_scoped_release release;
  fastweight::layernorm_fwd(a, to_stream(stream));
}

fastweight::LayerNormBwdArgs layernorm_bwd_args(const char* op, const In& dy, const In& x,
                                                const OptIn& weight, const In& mean, const In& rstd,
                                                const Out& dx, const OptOut& dweight,
                                                const OptOut& dbias, double weight_offset) {
  fastweight::LayerNormBwdArgs a;
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

std::size_t layernorm_bwd_workspace_size(const In& dy, const In& x, const OptIn& weight,
                                         const In& mean, const In& rstd, const Out& dx,
                                         const OptOut& dweight, const OptOut& dbias,
                                         double weight_offset) {
  auto a = layernorm_bwd_args("layernorm_bwd", dy, x, weight, mean, rstd, dx, dweight, dbias,
                              weight_offset);
  nb::gil_scoped_release release;
  return fastweight::layernorm_bwd_workspace_size(a);
}

void layernorm_bwd(const In& dy, const In& x, const OptIn& weight, const In& mean, const In& rstd,
                   const Out& dx, const OptOut& dweight, const OptOut& dbias, double weight_offset,
                   const OptOut& workspace, std::uintptr_t stream) {
  const char* op = "layernorm_bwd";
  auto a = layernorm_bwd_args(op, dy, x, weight, mean, rstd, dx, dweight, dbias, weight_offset);
  const Workspace ws = to_workspace(workspace, a.x, op);
  nb::gil_scoped_release release;
  fastweight::layernorm_bwd(a, ws.data, ws.bytes, to_stream(stream));
}

void headnorm_fwd(const In& x, const OptIn& weight, const OptIn& bias, const Out& y,
                  const OptOut& mean, const OptOut& rstd, double eps, double weight_offset,
                  std::uintptr_t stream) {
  const char* op = "headnorm_fwd";
  fastweight::HeadNormFwdArgs a;
  a.x = to_ref(x, op, "x");
  a.weight = to_ref(weight, op, "weight");
  a.bias = to_ref(bias, op, "bias");
  a.y = to_ref(y, op, "y");
  a.mean = to_ref(mean, op, "mean");
  a.rstd = to_ref(rstd, op, "rstd");
  a.eps = eps;
  a.weight_offset = weight_offset;
  nb::gil_scoped_release release;
  fastweight::headnorm_fwd(a, to_stream(stream));
}

fastweight::HeadNormBwdArgs headnorm_bwd_args(const char* op, const In& dy, const In& x,
                                              const OptIn& weight, const In& mean, const In& rstd,
                                              const Out& dx, const OptOut& dweight,
                                              const OptOut& dbias, double weight_offset) {
  fastweight::HeadNormBwdArgs a;
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

std::size_t headnorm_bwd_workspace_size(const In& dy, const In& x, const OptIn& weight,
                                        const In& mean, const In& rstd, const Out& dx,
                                        const OptOut& dweight, const OptOut& dbias,
                                        double weight_offset) {
  auto a = headnorm_bwd_args("headnorm_bwd", dy, x, weight, mean, rstd, dx, dweight, dbias,
                             weight_offset);
  nb::gil_scoped_release release;
  return fastweight::headnorm_bwd_workspace_size(a);
}

void headnorm_bwd(const In& dy, const In& x, const OptIn& weight, const In& mean, const In& rstd,
                  const Out& dx, const OptOut& dweight, const OptOut& dbias, double weight_offset,
                  const OptOut& workspace, std::uintptr_t stream) {
  const char* op = "headnorm_bwd";
  auto a = headnorm_bwd_args(op, dy, x, weight, mean, rstd, dx, dweight, dbias, weight_offset);
  const Workspace ws = to_workspace(workspace, a.x, op);
  nb::gil_scoped_release release;
  fastweight::headnorm_bwd(a, ws.data, ws.bytes, to_stream(stream));
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
                 const OptOut& dweight, double weight_offset, const OptOut& workspace,
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
                      const OptOut& workspace, std::uintptr_t stream) {
  const char* op = "adalayernorm_bwd";
  auto a = adalayernorm_bwd_args(op, dy, x, scale, mean, rstd, dx, dscale, dshift);
  const Workspace ws = to_workspace(workspace, a.x, op);
  nb::gil_scoped_release release;
  fastweight::adalayernorm_bwd(a, ws.data, ws.bytes, to_stream(stream));
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "fastweight._C: fused LayerNorm-family kernels over DLPack tensors (see fastweight/norm.h)";

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
  m.def("layernorm_fwd", &layernorm_fwd, "x"_a, "weight"_a.none(), "bias"_a.none(),
        "y"_a, "mean"_a.none() = none, "rstd"_a.none() = none, "eps"_a = 1e-5,
        "weight_offset"_a = 0.0, "stream"_a = 0,
        "y = (x - mean) * rstd * (weight_offset + weight) + bias over the last dim; writes y and,\n"
        "when given, the fp32 statistics mean/rstd (one per row).");
  m.def("layernorm_bwd_workspace_size", &layernorm_bwd_workspace_size, "dy"_a, "x"_a,
        "weight"_a.none(), "mean"_a, "rstd"_a, "dx"_a, "dweight"_a.none() = none,
        "dbias"_a.none() = none, "weight_offset"_a = 0.0,
        "Bytes of workspace layernorm_bwd needs for these arguments (0 on the CPU).");
  m.def("layernorm_bwd", &layernorm_bwd, "dy"_a, "x"_a, "weight"_a.none(), "mean"_a, "rstd"_a,
        "dx"_a, "dweight"_a.none() = none, "dbias"_a.none() = none, "weight_offset"_a = 0.0,
        "workspace"_a.none() = none, "stream"_a = 0,
        "Writes dx and, when given, dweight/dbias (deterministic).");

  m.def("headnorm_fwd", &headnorm_fwd, "x"_a, "weight"_a.none(), "bias"_a.none(),
        "y"_a, "mean"_a.none() = none, "rstd"_a.none() = none, "eps"_a = 1e-6,
        "weight_offset"_a = 0.0, "stream"_a = 0,
        "Per-head LayerNorm of x (..., NH, DH) with weight/bias (NH, DH).");
  m.def("headnorm_bwd_workspace_size", &headnorm_bwd_workspace_size, "dy"_a, "x"_a,
        "weight"_a.none(), "mean"_a, "rstd"_a, "dx"_a, "dweight"_a.none() = none,
        "dbias"_a.none() = none, "weight_offset"_a = 0.0);
  m.def("headnorm_bwd", &headnorm_bwd, "dy"_a, "x"_a, "weight"_a.none(), "mean"_a, "rstd"_a,
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
