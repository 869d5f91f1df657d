// norm_api.cpp: the public LayerNorm-family entry points. Each validates every argument (dtype,
// shape, strides, alignment, devices, sizes) and lowers the op to one RowNormParams before anything
// is launched or written, then dispatches by device: CPU -> reference, CUDA -> kernels.
#include <cmath>
#include <cstdint>
#include <limits>

#include "api/check.h"
#include "common/norm_params.h"
#include "fastweight/fastweight.h"
#include "reference/norm_ref.h"
#if FW_WITH_CUDA
#include "cuda/norm/norm_cuda.h"
#endif

namespace fastweight {
namespace {
using detail::NormKind;
using detail::RowIndexer;
using detail::RowNormParams;
using detail::cat;

// ---- argument checks ----------------------------------------------------------------------------
struct Checker {
  const char* op;
  const TensorRef& x;  // the tensor every other one is compared with

  void common(const char* name, const TensorRef& t) const { detail::check_common(op, name, t, x, "x"); }
  void dtype_io(const char* name, const TensorRef& t) const { detail::check_io_dtype(op, name, t); }
  void last_dim_contiguous(const char* name, const TensorRef& t) const {
    detail::check_last_dim_contiguous(op, name, t);
  }
  // ref_name: whose shape it must match ("x"), or nullptr when `ref` is the required shape itself.
  void same_shape(const char* name, const TensorRef& t, const TensorRef& ref, const char* ref_name) const {
    bool same = t.ndim == ref.ndim;
    for (int d = 0; same && d < t.ndim; ++d) same = t.shape[d] == ref.shape[d];
    FW_CHECK_ARG(same, op, name, "expected shape ", ref.shape_str(), ref_name ? cat(" (that of ", ref_name, ")") : "",
                 ", got ", t.shape_str());
  }
  // A tensor of rows like x: same shape and dtype, own strides, last dim contiguous.
  RowIndexer row_tensor(const char* name, const TensorRef& t, bool is_x = false) const {
    FW_CHECK_ARG(t.defined(), op, name, "is required");
    common(name, t);
    if (is_x) {
      dtype_io(name, t);
      FW_CHECK_ARG(t.ndim >= 1, op, name, "expected at least 1 dimension, got a scalar");
    } else {
      FW_CHECK_ARG(t.dtype == x.dtype, op, name, "expected dtype ", dtype_name(x.dtype),
                   " (that of x), got ", dtype_name(t.dtype));
      same_shape(name, t, x, "x");
    }
    last_dim_contiguous(name, t);
    // Merge leading dims that are contiguous with each other (size-1 dims vanish).
    RowIndexer ix;
    for (int d = 0; d < t.ndim - 1; ++d) {
      if (t.shape[d] == 1) continue;
      if (ix.nd > 0 && ix.stride[ix.nd - 1] == t.strides[d] * t.shape[d]) {
        ix.size[ix.nd - 1] *= t.shape[d];
        ix.stride[ix.nd - 1] = t.strides[d];
      } else {
        ix.size[ix.nd] = t.shape[d];
        ix.stride[ix.nd] = t.strides[d];
        ++ix.nd;
      }
    }
    if (ix.nd == 0) { ix.nd = 1; ix.size[0] = 1; ix.stride[0] = 0; }
    // Every element offset must fit int64 (it does for any tensor that exists; guard hand-made views).
    double span = double(t.shape[t.ndim - 1]);
    for (int d = 0; d < ix.nd; ++d) span += double(ix.size[d] - 1) * std::fabs(double(ix.stride[d]));
    FW_CHECK_ARG(span < 9.0e18, op, name, "element offsets overflow int64");
    return ix;
  }
  // A parameter tensor: given shape, dtype of x or float32, last dim contiguous. Returns the stride
  // between parameter groups (dim 0), 0 when there is one group.
  std::int64_t param(const char* name, const TensorRef& t, int nd, const std::int64_t* shape,
                     DType io, bool grouped) const {
    common(name, t);
    TensorRef want;
    want.ndim = nd;
    for (int d = 0; d < nd; ++d) want.shape[d] = shape[d];
    same_shape(name, t, want, nullptr);
    FW_CHECK_ARG(t.dtype == io || t.dtype == DType::f32, op, name, "expected dtype ", dtype_name(io),
                 io == DType::f32 ? " (that of x)" : " (that of x) or float32", ", got ", dtype_name(t.dtype));
    last_dim_contiguous(name, t);
    return grouped ? t.strides[0] : 0;
  }
  void stats(const char* name, const TensorRef& t, std::int64_t rows) const {
    common(name, t);
    FW_CHECK_ARG(t.dtype == DType::f32, op, name, "expected dtype float32, got ", dtype_name(t.dtype));
    FW_CHECK_ARG(t.numel() == rows, op, name, "expected ", rows, " elements (one per row of x), got ",
                 t.numel(), " in shape ", t.shape_str());
    FW_CHECK_ARG(t.is_contiguous(), op, name, "expected a contiguous tensor");
  }
};

// The parameter grouping of each op (see norm_params.h).
struct Grouping {
  std::int64_t groups, rows_per_group, g_stride, j_stride;
  int pnd;
  std::int64_t pshape[3];
};

Grouping grouping(const char* op, NormKind kind, const TensorRef& x, std::int64_t rows) {
  const std::int64_t n = x.shape[x.ndim - 1];
  switch (kind) {
    case NormKind::layernorm:
    case NormKind::rmsnorm:
      return {1, rows, 0, 1, 1, {n, 0, 0}};
    case NormKind::headnorm: {
      FW_CHECK_ARG(x.ndim >= 2, op, "x", "expected shape (..., NH, DH), got ", x.shape_str());
      const std::int64_t nh = x.shape[x.ndim - 2];
      return {nh, nh ? rows / nh : 0, 1, nh, 2, {nh, n, 0}};
    }
    case NormKind::adalayernorm: {
      FW_CHECK_ARG(x.ndim == 3, op, "x", "expected shape (B, S, D), got ", x.shape_str());
      return {x.shape[0], x.shape[1], x.shape[1], 1, 3, {x.shape[0], 1, n}};
    }
  }
  return {};
}

struct NormNames {
  const char* w;
  const char* b;
  const char* dw;
  const char* db;
};
NormNames names(NormKind kind) {
  if (kind == NormKind::adalayernorm) return {"scale", "shift", "dscale", "dshift"};
  return {"weight", "bias", "dweight", "dbias"};
}

// Shared by forward and backward: x, the parameters and the grouping.
RowNormParams plan_common(const char* op, NormKind kind, const TensorRef& x, const TensorRef& w,
                          const TensorRef& b, double weight_offset) {
  Checker c{op, x};
  RowNormParams p;
  p.kind = kind;
  p.rms = kind == NormKind::rmsnorm;
  p.x_rows = c.row_tensor("x", x, /*is_x=*/true);
  p.x = x.data;
  p.io = x.dtype;
  p.n = x.shape[x.ndim - 1];
  FW_CHECK_ARG(p.n >= 1, op, "x", "the normalised (last) dimension is empty: shape ", x.shape_str());
  FW_CHECK_ARG(p.n <= std::numeric_limits<std::int32_t>::max() / 2, op, "x", "the last dimension ",
               p.n, " is larger than supported (2^30)");
  p.rows = x.numel() / p.n;
  const Grouping gr = grouping(op, kind, x, p.rows);
  p.groups = gr.groups;
  p.rows_per_group = gr.rows_per_group;
  p.g_stride = gr.g_stride;
  p.j_stride = gr.j_stride;
  const bool grouped = kind == NormKind::headnorm || kind == NormKind::adalayernorm;
  const NormNames nm = names(kind);
  if (kind == NormKind::adalayernorm) FW_CHECK_ARG(w.defined(), op, nm.w, "is required");
  p.param = w.defined() ? w.dtype : (b.defined() ? b.dtype : x.dtype);
  if (w.defined()) p.w_group_stride = c.param(nm.w, w, gr.pnd, gr.pshape, x.dtype, grouped);
  if (b.defined()) {
    FW_CHECK_ARG(kind != NormKind::rmsnorm, op, nm.b, "rmsnorm takes no bias");
    p.b_group_stride = c.param(nm.b, b, gr.pnd, gr.pshape, x.dtype, grouped);
    FW_CHECK_ARG(b.dtype == p.param, op, nm.b, "expected dtype ", dtype_name(p.param), " (that of ",
                 nm.w, "), got ", dtype_name(b.dtype));
  }
  p.w = w.defined() ? w.data : nullptr;
  p.b = b.defined() ? b.data : nullptr;
  FW_CHECK_ARG(std::isfinite(weight_offset), op, "weight_offset", "expected a finite value, got ", weight_offset);
  p.weight_offset = float(weight_offset);
  p.weight_offset_d = weight_offset;
  return p;
}

RowNormParams plan_fwd(const char* op, NormKind kind, const TensorRef& x, const TensorRef& w,
                       const TensorRef& b, const TensorRef& y, const TensorRef& mean,
                       const TensorRef& rstd, double eps, double weight_offset) {
  RowNormParams p = plan_common(op, kind, x, w, b, weight_offset);
  Checker c{op, x};
  FW_CHECK_ARG(std::isfinite(eps) && eps >= 0.0, op, "eps", "expected a finite value >= 0, got ", eps);
  p.eps = float(eps);
  p.eps_d = eps;
  p.y_rows = c.row_tensor("y", y);
  p.y = y.data;
  if (mean.defined()) {
    FW_CHECK_ARG(!p.rms, op, "mean", "rmsnorm has no mean statistic");
    c.stats("mean", mean, p.rows);
    p.mean = static_cast<float*>(mean.data);
  }
  if (rstd.defined()) {
    c.stats("rstd", rstd, p.rows);
    p.rstd = static_cast<float*>(rstd.data);
  }
  const NormNames nm = names(kind);
  detail::check_outputs_apart(op, {{"y", y}, {"mean", mean}, {"rstd", rstd}}, {{"x", x}, {nm.w, w}, {nm.b, b}});
  return p;
}

RowNormParams plan_bwd(const char* op, NormKind kind, const TensorRef& dy, const TensorRef& x,
                       const TensorRef& w, const TensorRef& mean, const TensorRef& rstd,
                       const TensorRef& dx, const TensorRef& dw, const TensorRef& db,
                       double weight_offset) {
  RowNormParams p = plan_common(op, kind, x, w, TensorRef{}, weight_offset);
  Checker c{op, x};
  const NormNames nm = names(kind);
  p.dy_rows = c.row_tensor("dy", dy);
  p.dy = dy.data;
  p.dx_rows = c.row_tensor("dx", dx);
  p.dx = dx.data;
  if (!p.rms) {
    FW_CHECK_ARG(mean.defined(), op, "mean", "is required (saved by the forward)");
    c.stats("mean", mean, p.rows);
    p.mean = static_cast<float*>(mean.data);
  } else {
    FW_CHECK_ARG(!mean.defined(), op, "mean", "rmsnorm has no mean statistic");
  }
  FW_CHECK_ARG(rstd.defined(), op, "rstd", "is required (saved by the forward)");
  c.stats("rstd", rstd, p.rows);
  p.rstd = static_cast<float*>(rstd.data);
  const Grouping gr = grouping(op, kind, x, p.rows);
  const bool grouped = kind == NormKind::headnorm || kind == NormKind::adalayernorm;
  if (dw.defined()) {
    FW_CHECK_ARG(w.defined(), op, nm.dw, "given, but ", nm.w, " is absent");
    p.dw_group_stride = c.param(nm.dw, dw, gr.pnd, gr.pshape, x.dtype, grouped);
    FW_CHECK_ARG(dw.dtype == w.dtype, op, nm.dw, "expected dtype ", dtype_name(w.dtype), " (that of ",
                 nm.w, "), got ", dtype_name(dw.dtype));
    p.dw = dw.data;
  }
  if (db.defined()) {
    FW_CHECK_ARG(kind != NormKind::rmsnorm, op, nm.db, "rmsnorm takes no bias");
    if (!w.defined()) p.param = db.dtype;  // no weight: the bias gradient sets the parameter dtype
    p.db_group_stride = c.param(nm.db, db, gr.pnd, gr.pshape, x.dtype, grouped);
    FW_CHECK_ARG(db.dtype == p.param, op, nm.db, "expected dtype ", dtype_name(p.param), ", got ",
                 dtype_name(db.dtype));
    p.db = db.data;
  }
  detail::check_outputs_apart(op, {{"dx", dx}, {nm.dw, dw}, {nm.db, db}},
                              {{"dy", dy}, {"x", x}, {nm.w, w}, {"mean", mean}, {"rstd", rstd}});
  return p;
}

#if !FW_WITH_CUDA
[[noreturn]] void no_cuda(const char* op) {
  throw Error(cat(op, ": the tensors are on a CUDA device but this build of fastweight has no CUDA kernels"));
}
#endif

void run_fwd([[maybe_unused]] const char* op, const RowNormParams& p, const TensorRef& x, Stream stream) {
  if (p.rows == 0) return;  // nothing to normalise (N >= 1 was checked)
  if (x.device == DeviceType::cpu) return detail::rownorm_fwd_reference(p);
#if FW_WITH_CUDA
  detail::DeviceGuard guard(x.device_index);
  detail::rownorm_fwd_cuda(p, stream);
#else
  (void)stream;
  no_cuda(op);
#endif
}

std::size_t bwd_workspace(const RowNormParams& p, const TensorRef& x) {
  if (x.device == DeviceType::cpu) return 0;
#if FW_WITH_CUDA
  detail::DeviceGuard guard(x.device_index);
  return detail::rownorm_bwd_workspace_bytes(p);
#else
  return 0;
#endif
}

void run_bwd(const char* op, const RowNormParams& p, const TensorRef& x, void* ws, std::size_t ws_bytes,
             Stream stream) {
  if (x.device == DeviceType::cpu) return detail::rownorm_bwd_reference(p);
#if FW_WITH_CUDA
  detail::DeviceGuard guard(x.device_index);
  const std::size_t need = detail::rownorm_bwd_workspace_bytes(p);
  FW_CHECK_ARG(ws_bytes >= need, op, "workspace", "expected at least ", need, " bytes (",
               op, "_workspace_size), got ", ws_bytes);
  FW_CHECK_ARG(need == 0 || (ws != nullptr && reinterpret_cast<std::uintptr_t>(ws) % 16 == 0), op,
               "workspace", "expected a 16-byte aligned device pointer");
  detail::rownorm_bwd_cuda(p, ws, ws_bytes, stream);
#else
  (void)ws; (void)ws_bytes; (void)stream;
  no_cuda(op);
#endif
}

template <typename F>
bool can_implement(F&& plan, std::string* why) {
  try {
    plan();
    return true;
  } catch (const Error& e) {
    if (why) *why = e.what();
    return false;
  }
}

}  // namespace

// ---- the four ops, each a thin lowering ---------------------------------------------------------
#define FW_NORM_OP(op, Fwd, Bwd, KIND, FWD_PLAN, BWD_PLAN)                                         \
  void op##_fwd(const Fwd& a, Stream stream) { run_fwd(#op "_fwd", FWD_PLAN, a.x, stream); }        \
  bool op##_fwd_can_implement(const Fwd& a, std::string* why) {                                    \
    return can_implement([&] { (void)FWD_PLAN; }, why);                                            \
  }                                                                                                \
  std::size_t op##_bwd_workspace_size(const Bwd& a) { return bwd_workspace(BWD_PLAN, a.x); }       \
  void op##_bwd(const Bwd& a, void* ws, std::size_t ws_bytes, Stream stream) {                     \
    run_bwd(#op "_bwd", BWD_PLAN, a.x, ws, ws_bytes, stream);                                      \
  }                                                                                                \
  bool op##_bwd_can_implement(const Bwd& a, std::string* why) {                                    \
    return can_implement([&] { (void)BWD_PLAN; }, why);                                            \
  }

FW_NORM_OP(layernorm, LayerNormFwdArgs, LayerNormBwdArgs, layernorm,
           plan_fwd("layernorm_fwd", NormKind::layernorm, a.x, a.weight, a.bias, a.y, a.mean, a.rstd, a.eps, a.weight_offset),
           plan_bwd("layernorm_bwd", NormKind::layernorm, a.dy, a.x, a.weight, a.mean, a.rstd, a.dx, a.dweight, a.dbias, a.weight_offset))
FW_NORM_OP(rmsnorm, RMSNormFwdArgs, RMSNormBwdArgs, rmsnorm,
           plan_fwd("rmsnorm_fwd", NormKind::rmsnorm, a.x, a.weight, TensorRef{}, a.y, TensorRef{}, a.rstd, a.eps, a.weight_offset),
           plan_bwd("rmsnorm_bwd", NormKind::rmsnorm, a.dy, a.x, a.weight, TensorRef{}, a.rstd, a.dx, a.dweight, TensorRef{}, a.weight_offset))
FW_NORM_OP(headnorm, HeadNormFwdArgs, HeadNormBwdArgs, headnorm,
           plan_fwd("headnorm_fwd", NormKind::headnorm, a.x, a.weight, a.bias, a.y, a.mean, a.rstd, a.eps, a.weight_offset),
           plan_bwd("headnorm_bwd", NormKind::headnorm, a.dy, a.x, a.weight, a.mean, a.rstd, a.dx, a.dweight, a.dbias, a.weight_offset))
FW_NORM_OP(adalayernorm, AdaLayerNormFwdArgs, AdaLayerNormBwdArgs, adalayernorm,
           plan_fwd("adalayernorm_fwd", NormKind::adalayernorm, a.x, a.scale, a.shift, a.y, a.mean, a.rstd, a.eps, 0.0),
           plan_bwd("adalayernorm_bwd", NormKind::adalayernorm, a.dy, a.x, a.scale, a.mean, a.rstd, a.dx, a.dscale, a.dshift, 0.0))
#undef FW_NORM_OP

}  // namespace fastweight
