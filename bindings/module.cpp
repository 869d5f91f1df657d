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
#include "convert.h"

using namespace nb::literals;

namespace {
using namespace fwbind;
using fastweight::detail::cat;

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

void bind_mlstm(nb::module_& m);     // mlstm.cpp
void bind_deltanet(nb::module_& m);  // deltanet.cpp

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

  bind_mlstm(m);
  bind_deltanet(m);

  m.def("cuda_available", [] { return fastweight::cuda_available(); },
        "True when this build has CUDA kernels and a GPU is visible.");
  m.def("build_info", [] { return std::string(fastweight::build_info()); },
        "How this build was configured (CUDA archs and dtypes, or 'cpu only').");
}
