// deltanet_api.cpp: the public DeltaNet entry points (fastweight/deltanet.h). Each validates every
// argument before anything is written, then dispatches by device: CPU -> the float64 chunkwise
// reference through contiguous float64 copies (any dtype, any strides); CUDA -> the kernels of
// src/cuda/deltanet (the decoding step is the forward over one position, the state as initial and
// final state).
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "api/check.h"
#include "api/deltanet_lower.h"
#include "api/host_tensor.h"
#include "api/mlstm_lower.h"  // view_of
#include "fastweight/deltanet.h"
#include "reference/deltanet_ref.h"
#if FW_WITH_CUDA
#include "cuda/deltanet/deltanet_cuda.h"
#include "cuda/norm/norm_cuda.h"  // DeviceGuard
#endif

namespace fastweight {
namespace {
using detail::DeltanetShape;
using detail::ptr_or_null;
using Vec = std::vector<double>;

// The reference's chunk size: the result does not depend on it (chunkwise = loop), so it is not
// exposed; 64 is FLA's and the CUDA forward's chunk.
constexpr std::int64_t kRefChunk = 64;

// (B, T, H, K, V) from q and v (checked: 4-d, IO dtype, K, V >= 1). N is set by the cu_seqlens check.
DeltanetShape deltanet_shape(const char* op, const TensorRef& q, const TensorRef& v) {
  detail::check_qv_shapes(op, q, v, "(B, T, H, K)", "K", "(B, T, H, V)", "V");
  DeltanetShape sh;
  sh.B = q.shape[0], sh.T = q.shape[1], sh.H = q.shape[2], sh.K = q.shape[3], sh.V = v.shape[3];
  return sh;
}

// The offsets of a CPU cu_seqlens (empty when absent or on a CUDA device), after checking them;
// sets sh.N. Called after q is checked, so B and T are q's.
std::vector<std::int64_t> check_cu_seqlens(const detail::SeqChecker& c, const TensorRef& cu, DeltanetShape& sh) {
  const char* op = c.op;
  if (!cu.defined()) return {};
  c.base("cu_seqlens", cu);
  FW_CHECK_ARG(cu.dtype == DType::i32 || cu.dtype == DType::i64, op, "cu_seqlens", "expected dtype int32 or int64, got ",
               dtype_name(cu.dtype));
  FW_CHECK_ARG(cu.ndim == 1 && cu.shape[0] >= 1, op, "cu_seqlens", "expected shape (N+1) with N >= 0, got ",
               cu.shape_str());
  FW_CHECK_ARG(sh.B == 1, op, "cu_seqlens", "packed sequences need batch size B = 1 (q (1, T, H, K)), got B = ",
               sh.B, " in q's shape ", c.ref.shape_str());
  sh.N = cu.shape[0] - 1;
  if (cu.device != DeviceType::cpu) {  // device memory: trusted, not read (check_cuda_fwd); its shape is checked
    FW_CHECK_ARG(sh.N > 0 || sh.T == 0, op, "cu_seqlens", "holds no sequence (shape ", cu.shape_str(),
                 ") but q has T = ", sh.T, " packed positions");
    return {};
  }
  std::vector<std::int64_t> off = detail::gather_i64(cu);
  FW_CHECK_ARG(off[0] == 0, op, "cu_seqlens", "expected offsets starting at 0, got cu_seqlens[0] = ", off[0]);
  for (std::int64_t n = 0; n < sh.N; ++n)
    FW_CHECK_ARG(off[n + 1] >= off[n], op, "cu_seqlens", "expected non-decreasing offsets, got cu_seqlens[", n + 1,
                 "] = ", off[n + 1], " < cu_seqlens[", n, "] = ", off[n]);
  FW_CHECK_ARG(off[sh.N] == sh.T, op, "cu_seqlens", "expected the last offset cu_seqlens[", sh.N,
               "] to be T = ", sh.T, " (the packed length of q), got ", off[sh.N]);
  return off;
}

// Inputs shared by forward and backward: q, k, v, beta, cu_seqlens, initial_state. Returns the
// shape (N set; cu_seqlens pointing into `offsets` for a CPU call).
DeltanetShape check_inputs(const detail::SeqChecker& c, const TensorRef& q, const TensorRef& k, const TensorRef& v,
                           const TensorRef& beta, const TensorRef& cu, const TensorRef& h0,
                           std::vector<std::int64_t>& offsets) {
  DeltanetShape sh = deltanet_shape(c.op, q, v);
  c.io("q", q, {sh.B, sh.T, sh.H, sh.K});
  c.io("k", k, {sh.B, sh.T, sh.H, sh.K});
  c.io("v", v, {sh.B, sh.T, sh.H, sh.V});
  c.gate("beta", beta, {sh.B, sh.T, sh.H});
  offsets = check_cu_seqlens(c, cu, sh);
  if (cu.defined()) sh.cu_seqlens = offsets.data();
  else sh.N = sh.B;
  if (h0.defined()) c.state("initial_state", h0, {sh.N, sh.H, sh.K, sh.V});
  return sh;
}

detail::DeltanetOptions options(const char* op, double scale, bool l2) {
  FW_CHECK_ARG(std::isnan(scale) || std::isfinite(scale), op, "scale",
               "expected a finite value (or NaN for the default K^-0.5), got ", scale);
  detail::DeltanetOptions opt;
  if (!std::isnan(scale)) opt.scale = scale;
  opt.use_qk_l2norm_in_kernel = l2;
  return opt;
}

struct Inputs {  // float64 copies of the inputs of one call
  Vec q, k, v, beta, h0;
  detail::DeltanetInputs in() const { return {q.data(), k.data(), v.data(), beta.data()}; }
};

// What forward and backward share: the checks of the inputs (q, k, v, beta, cu_seqlens,
// initial_state) and options, then the float64 copies of the inputs. Not copyable: sh.cu_seqlens
// points into offsets.
struct Call {
  detail::SeqChecker c;
  std::vector<std::int64_t> offsets;  // cu_seqlens of a CPU call
  DeltanetShape sh;
  detail::DeltanetOptions opt;

  template <typename Args>
  Call(const char* op, const Args& a)
      : c{op, a.q, "q"},
        sh(check_inputs(c, a.q, a.k, a.v, a.beta, a.cu_seqlens, a.initial_state, offsets)),
        opt(options(op, a.scale, a.use_qk_l2norm_in_kernel)) {}
  Call(const Call&) = delete;
  Call& operator=(const Call&) = delete;

  // Float64 copies of a CPU call's inputs, for the reference (once every argument is checked).
  template <typename Args>
  Inputs inputs(const Args& a) const {
    using detail::gather_f64;
    return {gather_f64(a.q), gather_f64(a.k), gather_f64(a.v), gather_f64(a.beta), gather_f64(a.initial_state)};
  }
};

#if FW_WITH_CUDA
// What the CUDA forward (version 1) needs beyond the API's checks: the state slice (K, 64) of a CTA
// in shared memory, and a grid of N*H x ceil(V/64) CTAs. Any dtype, stride and alignment the API
// accepts is supported (scalar loads, int64 offsets). cu_seqlens stays on the device unread: reading
// it here would synchronise the stream (and break CUDA-graph capture), so its offsets are trusted.
void check_cuda_fwd(const char* op, const DeltanetShape& sh, const TensorRef& q, const TensorRef& v) {
  FW_CHECK_ARG(sh.K <= detail::kDeltanetFwdMaxK, op, "q", "head dim K = ", sh.K,
               " is not supported by the CUDA forward (K <= ", detail::kDeltanetFwdMaxK, "), got shape ",
               q.shape_str());
  FW_CHECK_ARG(sh.N * sh.H <= 0x7fffffff, op, "q", "N*H = ", sh.N * sh.H,
               " sequence-heads exceed the CUDA grid (at most 2^31 - 1), got shape ", q.shape_str());
  FW_CHECK_ARG((sh.V + 63) / 64 <= 65535, op, "v", "head dim V = ", sh.V,
               " exceeds the CUDA grid (at most 65535 tiles of 64), got shape ", v.shape_str());
  FW_CHECK_ARG(sh.H <= 65535, op, "q", "H = ", sh.H, " heads exceed the CUDA grid (at most 65535), got shape ",
               q.shape_str());
}
#endif

// wy_inverse (fastweight/deltanet.h): only where the tensor-core pipeline runs (CUDA, bf16 q, k, v,
// K <= 128); (B, T, H, 64) contiguous and 16-byte aligned (the kernels move 16-byte pieces of its
// rows); float32 with split_operands, else bfloat16.
void check_wy_inverse(const Call& call, const TensorRef& q, const TensorRef& t, bool split) {
  if (!t.defined()) return;
  const char* op = call.c.op;
  const DeltanetShape& sh = call.sh;
  call.c.base("wy_inverse", t);
  FW_CHECK_ARG(q.device == DeviceType::cuda && q.dtype == DType::bf16 && sh.K <= 128, op, "wy_inverse",
               "exists only in the CUDA tensor-core pipeline (bfloat16 q, k, v with K <= 128), got q ",
               dtype_name(q.dtype), " on ", q.device_str(), " with K = ", sh.K);
  const DType want = split ? DType::f32 : DType::bf16;
  FW_CHECK_ARG(t.dtype == want, op, "wy_inverse", "expected dtype ", dtype_name(want), " (split_operands = ",
               split ? "true" : "false", "), got ", dtype_name(t.dtype));
  detail::check_shape(op, "wy_inverse", t, {sh.B, sh.T, sh.H, 64});
  FW_CHECK_ARG(t.is_contiguous(), op, "wy_inverse", "expected a contiguous tensor of shape ", t.shape_str());
  FW_CHECK_ARG(reinterpret_cast<std::uintptr_t>(t.data) % 16 == 0, op, "wy_inverse",
               "expected a 16-byte aligned data pointer");
}

}  // namespace

// ---- forward --------------------------------------------------------------------------------------
namespace {
void check_fwd(const Call& call, const DeltanetFwdArgs& a) {
  const DeltanetShape& sh = call.sh;
  call.c.io("o", a.o, {sh.B, sh.T, sh.H, sh.V});
  if (a.final_state.defined()) call.c.state("final_state", a.final_state, {sh.N, sh.H, sh.K, sh.V});
  check_wy_inverse(call, a.q, a.wy_inverse, a.split_operands);
  detail::check_outputs_apart(call.c.op, {{"o", a.o}, {"final_state", a.final_state}, {"wy_inverse", a.wy_inverse}},
                              {{"q", a.q}, {"k", a.k}, {"v", a.v}, {"beta", a.beta}, {"initial_state", a.initial_state},
                               {"cu_seqlens", a.cu_seqlens}});
#if FW_WITH_CUDA
  if (a.q.device == DeviceType::cuda) check_cuda_fwd(call.c.op, sh, a.q, a.v);
#endif
}
}  // namespace

#if FW_WITH_CUDA
namespace {
// The workspace layouts depend on the device's shared memory (bf16 X, Y, Xu where the kernels' tiles
// fit), so a size is computed on q's device, in the size queries and in the calls alike. Without a
// CUDA runtime (a machine without a GPU) no guard: a layout of hi + lo operands asks nothing of the
// device, so the size and the workspace checks still answer before the launch fails.
class SizeDevice {
 public:
  explicit SizeDevice(int device) {
    if (detail::cuda_runtime_available()) guard_.emplace(device);
  }
 private:
  std::optional<detail::DeviceGuard> guard_;
};
}  // namespace
#endif

std::size_t deltanet_fwd_workspace_size(const DeltanetFwdArgs& a) {
  const Call call("deltanet_fwd", a);
  check_fwd(call, a);
#if FW_WITH_CUDA
  if (a.q.device == DeviceType::cuda) {
    const SizeDevice on(a.q.device_index);
    return detail::deltanet_fwd_workspace_bytes(detail::lower_deltanet_fwd(a));
  }
#endif
  return 0;
}

void deltanet_fwd(const DeltanetFwdArgs& a, Stream stream) { deltanet_fwd(a, nullptr, 0, stream); }

void deltanet_fwd(const DeltanetFwdArgs& a, [[maybe_unused]] void* workspace,
                  [[maybe_unused]] std::size_t workspace_bytes, [[maybe_unused]] Stream stream) {
  const char* op = "deltanet_fwd";
  const Call call(op, a);
  check_fwd(call, a);
  const DeltanetShape& sh = call.sh;
  FW_CHECK_ARG(!a.wy_inverse.defined() || workspace, op, "wy_inverse",
               "is written by the forward with a workspace (the tensor-core pipeline); this call has none");
  if (a.q.device == DeviceType::cuda) {
#if FW_WITH_CUDA
    const detail::DeltanetParams p = detail::lower_deltanet_fwd(a);
    const SizeDevice on(a.q.device_index);  // first: the workspace layout depends on the device
    const std::size_t need = detail::deltanet_fwd_workspace_bytes(p);
    if (workspace) detail::check_workspace(op, workspace, workspace_bytes, need);  // null: the on-chip kernel
    detail::DeviceGuard guard(a.q.device_index);
    detail::deltanet_fwd_cuda(p, need ? workspace : nullptr, stream);
    return;
#else
    detail::no_cuda_build(op);
#endif
  }

  const Inputs x = call.inputs(a);
  Vec o = detail::out_buffer(a.o), ht = detail::out_buffer(a.final_state);
  detail::deltanet_chunkwise_fwd(sh, x.in(), call.opt, kRefChunk, ptr_or_null(x.h0), o.data(), ptr_or_null(ht));
  detail::scatter_f64(o, a.o);
  detail::scatter_f64(ht, a.final_state);
}

// ---- backward -------------------------------------------------------------------------------------
namespace {
// Every check of the backward's arguments; the caller's Call holds the shape.
void check_bwd(const Call& call, const DeltanetBwdArgs& a) {
  const DeltanetShape& sh = call.sh;
  const detail::SeqChecker& c = call.c;
  c.io("do_", a.do_, {sh.B, sh.T, sh.H, sh.V});
  if (a.dfinal_state.defined()) c.state("dfinal_state", a.dfinal_state, {sh.N, sh.H, sh.K, sh.V});
  if (a.dq.defined()) c.io("dq", a.dq, {sh.B, sh.T, sh.H, sh.K});
  if (a.dk.defined()) c.io("dk", a.dk, {sh.B, sh.T, sh.H, sh.K});
  if (a.dv.defined()) c.io("dv", a.dv, {sh.B, sh.T, sh.H, sh.V});
  if (a.dbeta.defined()) c.gate("dbeta", a.dbeta, {sh.B, sh.T, sh.H});
  if (a.dinitial_state.defined()) {
    FW_CHECK_ARG(a.initial_state.defined(), c.op, "dinitial_state",
                 "the gradient of the initial state needs the initial state (initial_state is absent)");
    c.state("dinitial_state", a.dinitial_state, {sh.N, sh.H, sh.K, sh.V});
  }
  check_wy_inverse(call, a.q, a.wy_inverse, a.split_operands);
  detail::check_outputs_apart(c.op, {{"dq", a.dq}, {"dk", a.dk}, {"dv", a.dv}, {"dbeta", a.dbeta}, {"dinitial_state", a.dinitial_state}},
                              {{"q", a.q}, {"k", a.k}, {"v", a.v}, {"beta", a.beta}, {"initial_state", a.initial_state},
                               {"cu_seqlens", a.cu_seqlens}, {"do_", a.do_}, {"dfinal_state", a.dfinal_state},
                               {"wy_inverse", a.wy_inverse}});
#if FW_WITH_CUDA
  if (a.q.device == DeviceType::cuda) check_cuda_fwd(c.op, sh, a.q, a.v);
#endif
}
}  // namespace

std::size_t deltanet_bwd_workspace_size(const DeltanetBwdArgs& a) {
  const Call call("deltanet_bwd", a);
  check_bwd(call, a);
#if FW_WITH_CUDA
  if (a.q.device == DeviceType::cuda) {
    const SizeDevice on(a.q.device_index);
    return detail::deltanet_bwd_workspace_bytes(detail::lower_deltanet_bwd(a));
  }
#endif
  return 0;
}

void deltanet_bwd(const DeltanetBwdArgs& a, [[maybe_unused]] void* workspace, [[maybe_unused]] std::size_t workspace_bytes,
                  [[maybe_unused]] Stream stream) {
  const Call call("deltanet_bwd", a);
  check_bwd(call, a);
  const DeltanetShape& sh = call.sh;
  if (a.q.device == DeviceType::cuda) {
#if FW_WITH_CUDA
    const detail::DeltanetBwdParams p = detail::lower_deltanet_bwd(a);
    const SizeDevice on(a.q.device_index);  // first: the workspace layout depends on the device
    detail::check_workspace(call.c.op, workspace, workspace_bytes, detail::deltanet_bwd_workspace_bytes(p));
    detail::DeviceGuard guard(a.q.device_index);
    detail::deltanet_bwd_cuda(p, workspace, stream);
    return;
#else
    detail::no_cuda_build(call.c.op);
#endif
  }

  const Inputs x = call.inputs(a);
  const Vec dout = detail::gather_f64(a.do_), dht = detail::gather_f64(a.dfinal_state);
  using detail::out_buffer;
  Vec dq = out_buffer(a.dq), dk = out_buffer(a.dk), dv = out_buffer(a.dv), dbeta = out_buffer(a.dbeta);
  Vec dh0 = out_buffer(a.dinitial_state);
  detail::deltanet_chunkwise_bwd(sh, x.in(), call.opt, kRefChunk, ptr_or_null(x.h0), dout.data(), ptr_or_null(dht),
                                 {ptr_or_null(dq), ptr_or_null(dk), ptr_or_null(dv), ptr_or_null(dbeta)},
                                 ptr_or_null(dh0));
  detail::scatter_f64(dq, a.dq), detail::scatter_f64(dk, a.dk), detail::scatter_f64(dv, a.dv);
  detail::scatter_f64(dbeta, a.dbeta), detail::scatter_f64(dh0, a.dinitial_state);
}

void deltanet_bwd(const DeltanetBwdArgs& a, Stream stream) { deltanet_bwd(a, nullptr, 0, stream); }

// ---- decoding step ----------------------------------------------------------------------------------
void deltanet_step(const DeltanetStepArgs& a, [[maybe_unused]] Stream stream) {
  const char* op = "deltanet_step";
  detail::check_qv_shapes(op, a.q, a.v, "(B, H, K)", "K", "(B, H, V)", "V", 3);
  DeltanetShape sh;  // T = 1: the step is the loop form over one position
  sh.B = a.q.shape[0], sh.T = 1, sh.H = a.q.shape[1], sh.K = a.q.shape[2], sh.V = a.v.shape[2];
  const detail::SeqChecker c{op, a.q, "q"};
  c.io("q", a.q, {sh.B, sh.H, sh.K});
  c.io("k", a.k, {sh.B, sh.H, sh.K});
  c.io("v", a.v, {sh.B, sh.H, sh.V});
  c.gate("beta", a.beta, {sh.B, sh.H});
  c.state("state", a.state, {sh.B, sh.H, sh.K, sh.V});
  c.io("o", a.o, {sh.B, sh.H, sh.V});
  c.state("new_state", a.new_state, {sh.B, sh.H, sh.K, sh.V});
  const detail::DeltanetOptions opt = options(op, a.scale, a.use_qk_l2norm_in_kernel);
  // in place means the very same view; any other sharing would race (CUDA) or depend on the order
  detail::check_outputs_apart(op, {{"o", a.o}, {"new_state", a.new_state}},
                              {{"q", a.q}, {"k", a.k}, {"v", a.v}, {"beta", a.beta}, {"state", a.state}}, {{1, 4}});
  if (a.q.device == DeviceType::cuda) {
#if FW_WITH_CUDA
    sh.N = sh.B;
    check_cuda_fwd(op, sh, a.q, a.v);
    detail::DeviceGuard guard(a.q.device_index);
    // The step kernel, else the forward over T = 1: either way every CTA reads its columns of
    // `state` before it writes them to new_state, and no two CTAs share columns, so in place is safe.
    const detail::DeltanetParams p = detail::lower_deltanet_step(a);
    if (detail::deltanet_step_kernel_applies(p)) detail::deltanet_step_cuda(p, stream);
    else detail::deltanet_fwd_cuda(p, nullptr, stream);
    return;
#else
    detail::no_cuda_build(op);
#endif
  }
  // (B, H, D) is the contiguous (B, 1, H, D) of the reference's layout; the state is (N = B, H, K, V).
  using detail::gather_f64;
  const Vec q = gather_f64(a.q), k = gather_f64(a.k), v = gather_f64(a.v), beta = gather_f64(a.beta);
  const Vec h0 = gather_f64(a.state);
  Vec o(std::size_t(a.o.numel())), ht(h0.size());
  sh.N = sh.B;
  detail::deltanet_recurrent_fwd(sh, {q.data(), k.data(), v.data(), beta.data()}, opt, h0.data(), o.data(), ht.data());
  detail::scatter_f64(o, a.o);
  detail::scatter_f64(ht, a.new_state);  // after every read of `state` (in place is safe)
}

// ---- lowering for the CUDA kernels (src/cuda/deltanet) -----------------------------------------------
namespace detail {
DeltanetParams lower_deltanet_fwd(const DeltanetFwdArgs& a) {
  DeltanetParams p;
  p.B = a.q.shape[0], p.T = a.q.shape[1], p.H = a.q.shape[2], p.K = a.q.shape[3], p.V = a.v.shape[3];
  p.N = a.cu_seqlens.defined() ? a.cu_seqlens.shape[0] - 1 : p.B;
  p.scale = float(std::isnan(a.scale) ? std::pow(double(p.K), -0.5) : a.scale);  // as the reference
  p.l2 = a.use_qk_l2norm_in_kernel;
  p.hilo = a.split_operands;
  p.q = view_of(a.q, 3), p.k = view_of(a.k, 3), p.v = view_of(a.v, 3), p.o = view_of(a.o, 3);
  p.beta = view_of(a.beta, 2);
  p.h0 = view_of(a.initial_state, 3), p.ht = view_of(a.final_state, 3);
  p.cu_seqlens = a.cu_seqlens.defined() ? a.cu_seqlens.data : nullptr;
  p.cu_i64 = !a.cu_seqlens.defined() || a.cu_seqlens.dtype == DType::i64;
  p.wy_t2 = a.wy_inverse.defined() ? a.wy_inverse.data : nullptr;
  return p;
}

DeltanetBwdParams lower_deltanet_bwd(const DeltanetBwdArgs& a) {
  DeltanetFwdArgs f;
  f.q = a.q, f.k = a.k, f.v = a.v, f.beta = a.beta, f.initial_state = a.initial_state, f.cu_seqlens = a.cu_seqlens;
  f.scale = a.scale, f.use_qk_l2norm_in_kernel = a.use_qk_l2norm_in_kernel, f.split_operands = a.split_operands;
  f.wy_inverse = a.wy_inverse;
  DeltanetBwdParams p;
  static_cast<DeltanetParams&>(p) = lower_deltanet_fwd(f);
  p.do_ = view_of(a.do_, 3), p.dht = view_of(a.dfinal_state, 3);
  p.dq = view_of(a.dq, 3), p.dk = view_of(a.dk, 3), p.dv = view_of(a.dv, 3), p.dbeta = view_of(a.dbeta, 2);
  p.dh0 = view_of(a.dinitial_state, 3);
  return p;
}

DeltanetParams lower_deltanet_step(const DeltanetStepArgs& a) {
  // (B, H, D) as (B, T = 1, H, D): the T stride is never used
  auto as_bthd = [](const TensorRef& t) {
    StridedView v = view_of(t, 2);
    v.s2 = v.s1, v.s1 = 0;
    return v;
  };
  DeltanetParams p;
  p.B = a.q.shape[0], p.T = 1, p.H = a.q.shape[1], p.K = a.q.shape[2], p.V = a.v.shape[2], p.N = p.B;
  p.scale = float(std::isnan(a.scale) ? std::pow(double(p.K), -0.5) : a.scale);
  p.l2 = a.use_qk_l2norm_in_kernel;
  p.q = as_bthd(a.q), p.k = as_bthd(a.k), p.v = as_bthd(a.v), p.o = as_bthd(a.o);
  p.beta = view_of(a.beta, 1);  // (B, H): element (b, h) at b*s0 + h
  p.h0 = view_of(a.state, 3), p.ht = view_of(a.new_state, 3);
  return p;
}
}  // namespace detail

}  // namespace fastweight
