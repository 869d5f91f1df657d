// check.cpp: see check.h.
#include "api/check.h"

#include <cstdint>
#include <string>

namespace fastweight::detail {

void check_common(const char* op, const char* name, const TensorRef& t, const TensorRef& ref, const char* ref_name) {
  FW_CHECK_ARG(t.ndim >= 0 && t.ndim <= kMaxDims, op, name, "ndim ", t.ndim, " outside [0, ", kMaxDims, "]");
  FW_CHECK_ARG(t.device == ref.device && t.device_index == ref.device_index, op, name, "expected device ",
               ref.device_str(), " (that of ", ref_name, "), got ", t.device_str());
  for (int d = 0; d < t.ndim; ++d) FW_CHECK_ARG(t.shape[d] >= 0, op, name, "negative size in shape ", t.shape_str());
  if (t.numel() > 0) {
    FW_CHECK_ARG(t.data != nullptr, op, name, "null data pointer for ", t.numel(), " elements");
    FW_CHECK_ARG(reinterpret_cast<std::uintptr_t>(t.data) % dtype_size(t.dtype) == 0, op, name,
                 "misaligned pointer: address is not a multiple of the ", dtype_size(t.dtype), "-byte ",
                 dtype_name(t.dtype), " element");
  }
}

void check_io_dtype(const char* op, const char* name, const TensorRef& t) {
  const bool ok = t.dtype == DType::f32 || t.dtype == DType::f16 || t.dtype == DType::bf16 ||
                  (t.dtype == DType::f64 && t.device == DeviceType::cpu);
  FW_CHECK_ARG(ok, op, name, "dtype ", dtype_name(t.dtype), " is not supported on ", t.device_str(),
               " (float32, float16, bfloat16", t.device == DeviceType::cpu ? ", float64)" : ")");
}

void check_last_dim_contiguous(const char* op, const char* name, const TensorRef& t) {
  FW_CHECK_ARG(t.ndim == 0 || t.shape[t.ndim - 1] <= 1 || t.strides[t.ndim - 1] == 1, op, name,
               "the last dimension must be contiguous (stride 1), got stride ", t.strides[t.ndim - 1]);
}

void check_shape(const char* op, const char* name, const TensorRef& t, std::initializer_list<std::int64_t> shape) {
  bool same = t.ndim == int(shape.size());
  int d = 0;
  for (auto it = shape.begin(); same && it != shape.end(); ++it, ++d) same = t.shape[d] == *it;
  if (!same) {
    std::string want = "(";
    d = 0;
    for (auto s : shape) want += (d++ ? ", " : "") + std::to_string(s);
    want += ")";  // as TensorRef::shape_str
    FW_CHECK_ARG(false, op, name, "expected shape ", want, ", got ", t.shape_str());
  }
}

namespace {
struct ByteRange {
  std::uintptr_t begin = 0, end = 0;  // [begin, end)
  bool dense = false;                 // every byte of the range is one element's, once
};
ByteRange byte_range(const TensorRef& t) {
  std::int64_t lo = 0, hi = 0;  // element offsets of the first and the last element
  for (int d = 0; d < t.ndim; ++d) {
    const std::int64_t span = (t.shape[d] - 1) * t.strides[d];
    (span < 0 ? lo : hi) += span;
  }
  const auto es = std::int64_t(dtype_size(t.dtype)), base = reinterpret_cast<std::intptr_t>(t.data);
  // dense: the range holds numel elements and no stride 0 repeats one (a sufficient test for the
  // layouts seen here: permuted contiguous views)
  bool zero = false;
  for (int d = 0; d < t.ndim; ++d) zero = zero || (t.shape[d] > 1 && t.strides[d] == 0);
  return {std::uintptr_t(base + lo * es), std::uintptr_t(base + (hi + 1) * es), !zero && hi - lo + 1 == t.numel()};
}
bool same_view(const TensorRef& a, const TensorRef& b) {
  if (a.data != b.data || a.dtype != b.dtype || a.ndim != b.ndim) return false;
  for (int d = 0; d < a.ndim; ++d)
    if (a.shape[d] != b.shape[d] || (a.shape[d] > 1 && a.strides[d] != b.strides[d])) return false;
  return true;
}
}  // namespace

Overlap overlap(const TensorRef& a, const TensorRef& b) {
  if (!a.defined() || !b.defined() || a.numel() == 0 || b.numel() == 0) return Overlap::none;
  if (same_view(a, b)) return Overlap::same;
  const ByteRange x = byte_range(a), y = byte_range(b);
  if (x.end <= y.begin || y.end <= x.begin) return Overlap::none;
  return x.dense && y.dense ? Overlap::partial : Overlap::unknown;
}

void check_outputs_apart(const char* op, std::initializer_list<NamedRef> outs, std::initializer_list<NamedRef> ins,
                         std::initializer_list<std::pair<int, int>> in_place) {
  const NamedRef* out = outs.begin();
  const NamedRef* in = ins.begin();
  for (int oi = 0; oi < int(outs.size()); ++oi) {
    for (int ii = 0; ii < int(ins.size()); ++ii) {
      bool paired = false;
      for (const auto& pr : in_place) paired = paired || (pr.first == oi && pr.second == ii);
      const Overlap ov = overlap(out[oi].t, in[ii].t);
      FW_CHECK_ARG(ov == Overlap::none || ov == Overlap::unknown || (ov == Overlap::same && paired), op, out[oi].name,
                   "shares memory with ", in[ii].name,
                   paired ? " without being the same view (in place: pass it itself)"
                          : " (an output may not overlap an input)");
    }
    for (int oj = oi + 1; oj < int(outs.size()); ++oj) {
      const Overlap ov = overlap(out[oi].t, out[oj].t);
      FW_CHECK_ARG(ov == Overlap::none || ov == Overlap::unknown, op, out[oi].name, "shares memory with ",
                   out[oj].name, " (outputs may not overlap each other)");
    }
  }
}

void check_qv_shapes(const char* op, const TensorRef& q, const TensorRef& v, const char* q_dims, const char* k_dim,
                     const char* v_dims, const char* v_dim, int ndim) {
  FW_CHECK_ARG(q.defined(), op, "q", "is required");
  FW_CHECK_ARG(q.ndim == ndim, op, "q", "expected shape ", q_dims, ", got ", q.shape_str());
  check_io_dtype(op, "q", q);
  FW_CHECK_ARG(q.shape[ndim - 1] >= 1, op, "q", k_dim, " must be at least 1, got shape ", q.shape_str());
  FW_CHECK_ARG(v.defined(), op, "v", "is required");
  FW_CHECK_ARG(v.ndim == ndim, op, "v", "expected shape ", v_dims, ", got ", v.shape_str());
  FW_CHECK_ARG(v.shape[ndim - 1] >= 1, op, "v", v_dim, " must be at least 1, got shape ", v.shape_str());
}

void SeqChecker::base(const char* name, const TensorRef& t) const {
  check_common(op, name, t, ref, ref_name);
  check_last_dim_contiguous(op, name, t);
}

void SeqChecker::io(const char* name, const TensorRef& t, std::initializer_list<std::int64_t> shape) const {
  FW_CHECK_ARG(t.defined(), op, name, "is required");
  base(name, t);
  FW_CHECK_ARG(t.dtype == ref.dtype, op, name, "expected dtype ", dtype_name(ref.dtype), " (that of ", ref_name,
               "), got ", dtype_name(t.dtype));
  check_shape(op, name, t, shape);
}

void SeqChecker::gate(const char* name, const TensorRef& t, std::initializer_list<std::int64_t> shape) const {
  FW_CHECK_ARG(t.defined(), op, name, "is required");
  base(name, t);
  FW_CHECK_ARG(t.dtype == ref.dtype || t.dtype == DType::f32, op, name, "expected dtype ", dtype_name(ref.dtype),
               " (that of ", ref_name, ") or float32, got ", dtype_name(t.dtype));
  check_shape(op, name, t, shape);
}

void SeqChecker::state(const char* name, const TensorRef& t, std::initializer_list<std::int64_t> shape) const {
  FW_CHECK_ARG(t.defined(), op, name, "is required");
  base(name, t);
  const bool ok = t.dtype == DType::f32 || (t.dtype == DType::f64 && t.device == DeviceType::cpu);
  FW_CHECK_ARG(ok, op, name, "expected dtype float32", t.device == DeviceType::cpu ? " or float64" : "",
               " (states are kept in fp32), got ", dtype_name(t.dtype));
  check_shape(op, name, t, shape);
}

void check_workspace(const char* op, void* ws, std::size_t bytes, std::size_t need) {
  FW_CHECK_ARG(bytes >= need && (need == 0 || ws != nullptr), op, "workspace", "needs ", need,
               " bytes (", op, "_workspace_size), got ", bytes, ws ? "" : " (null pointer)");
  // the kernels move it in 16-byte units (cudaMalloc and torch's allocator give 256-byte alignment)
  FW_CHECK_ARG(need == 0 || reinterpret_cast<std::uintptr_t>(ws) % 16 == 0, op, "workspace",
               "must be 16-byte aligned, got an address ", reinterpret_cast<std::uintptr_t>(ws) % 16,
               " bytes past a 16-byte boundary");
}

void no_cuda_build(const char* op) {
  throw Error(cat(op, ": the tensors are on a CUDA device but this build of fastweight has no CUDA kernels"));
}

}  // namespace fastweight::detail
