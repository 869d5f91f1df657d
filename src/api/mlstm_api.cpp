// mlstm_api.cpp: the public mLSTM entry points (fastweight/mlstm.h). Each validates every argument
// before anything is written, then dispatches by device: CPU -> the float64 reference through
// contiguous float64 copies (any dtype, any strides), CUDA -> the kernels of src/cuda/mlstm (with a
// caller workspace).
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "api/check.h"
#include "api/host_tensor.h"
#include "api/mlstm_lower.h"
#include "fastweight/mlstm.h"
#include "reference/mlstm_ref.h"
#if FW_WITH_CUDA
#include "cuda/mlstm/mlstm_cuda.h"
#include "cuda/norm/norm_cuda.h"  // DeviceGuard
#endif

namespace fastweight {
namespace {
using detail::ptr_or_null;
using Vec = std::vector<double>;

// ---- argument checks ------------------------------------------------------------------------------
struct MlstmChecker : detail::SeqChecker {
  // m: (B, NH) or (B, NH, 1), as mlstm_kernels passes it.
  void state_m(const char* name, const TensorRef& t, std::int64_t B, std::int64_t NH) const {
    if (t.ndim == 3) state(name, t, {B, NH, 1});
    else state(name, t, {B, NH});
  }
  // c, n, m: all present or all absent. Returns whether present.
  bool states(const char* cn, const char* nn, const char* mn, const TensorRef& c, const TensorRef& n,
              const TensorRef& m, const detail::MlstmShape& sh) const {
    const int given = int(c.defined()) + int(n.defined()) + int(m.defined());
    const char* missing = !c.defined() ? cn : !n.defined() ? nn : mn;
    FW_CHECK_ARG(given == 0 || given == 3, op, missing, "is missing: the states ", cn, ", ", nn, ", ", mn,
                 " are given together or not at all (got ", given, " of 3)");
    if (given == 0) return false;
    state(cn, c, {sh.B, sh.NH, sh.DQK, sh.DV});
    state(nn, n, {sh.B, sh.NH, sh.DQK});
    state_m(mn, m, sh.B, sh.NH);
    return true;
  }
  void eps(double e) const {
    FW_CHECK_ARG(std::isfinite(e) && e >= 0.0, op, "eps", "expected a finite value >= 0, got ", e);
  }
  void chunk(std::int64_t L) const {
    FW_CHECK_ARG(L >= 16 && L <= 256 && (L & (L - 1)) == 0, op, "chunk_size",
                 "expected a power of two in [16, 256], got ", L);
  }
};

// The (B, NH, S, DQK, DV) of a sequence call, from q and v (checked: 4-d, IO dtype).
detail::MlstmShape sequence_shape(const char* op, const TensorRef& q, const TensorRef& v) {
  detail::check_qv_shapes(op, q, v, "(B, NH, S, DQK)", "DQK", "(B, NH, S, DV)", "DV");
  detail::MlstmShape sh;
  sh.B = q.shape[0], sh.NH = q.shape[1], sh.S = q.shape[2], sh.DQK = q.shape[3], sh.DV = v.shape[3];
  return sh;
}

void check_sequence_inputs(const MlstmChecker& c, const detail::MlstmShape& sh, const TensorRef& q,
                           const TensorRef& k, const TensorRef& v, const TensorRef& i, const TensorRef& f) {
  c.io("q", q, {sh.B, sh.NH, sh.S, sh.DQK});
  c.io("k", k, {sh.B, sh.NH, sh.S, sh.DQK});
  c.io("v", v, {sh.B, sh.NH, sh.S, sh.DV});
  c.gate("i", i, {sh.B, sh.NH, sh.S});
  c.gate("f", f, {sh.B, sh.NH, sh.S});
}

#if !FW_WITH_CUDA
using detail::no_cuda_build;  // shared with DeltaNet (check.cpp)
#endif
using detail::check_workspace;

struct SeqInputs {  // float64 copies of one sequence call's inputs
  Vec q, k, v, i, f, c0, n0, m0;
  detail::MlstmInputs in() const { return {q.data(), k.data(), v.data(), i.data(), f.data()}; }
  detail::MlstmConstState init() const {
    return {c0.empty() ? nullptr : c0.data(), n0.empty() ? nullptr : n0.data(), m0.empty() ? nullptr : m0.data()};
  }
};
SeqInputs gather_inputs(const TensorRef& q, const TensorRef& k, const TensorRef& v, const TensorRef& i,
                        const TensorRef& f, const TensorRef& c0, const TensorRef& n0, const TensorRef& m0) {
  using detail::gather_f64;
  return {gather_f64(q), gather_f64(k), gather_f64(v), gather_f64(i), gather_f64(f),
          gather_f64(c0), gather_f64(n0), gather_f64(m0)};
}

}  // namespace

// ---- lowering for the CUDA kernels (src/cuda/mlstm) -------------------------------------------------
namespace detail {
StridedView view_of(const TensorRef& t, int lead) {
  StridedView v;
  if (!t.defined()) return v;
  v.p = t.data;
  v.dtype = t.dtype;
  v.s0 = lead > 0 ? t.strides[0] : 0;
  v.s1 = lead > 1 ? t.strides[1] : 0;
  v.s2 = lead > 2 ? t.strides[2] : 0;
  return v;
}

MlstmParams lower_mlstm_fwd(const MlstmFwdArgs& a) {
  MlstmParams p;
  p.B = a.q.shape[0], p.NH = a.q.shape[1], p.S = a.q.shape[2], p.DQK = a.q.shape[3], p.DV = a.v.shape[3];
  p.L = a.chunk_size;
  p.eps = float(a.eps);
  p.q = view_of(a.q, 3), p.k = view_of(a.k, 3), p.v = view_of(a.v, 3), p.h = view_of(a.h, 3);
  p.i = view_of(a.i, 2), p.f = view_of(a.f, 2);
  p.c0 = view_of(a.c_initial, 3), p.n0 = view_of(a.n_initial, 2), p.m0 = view_of(a.m_initial, 2);
  p.c_last = view_of(a.c_last, 3), p.n_last = view_of(a.n_last, 2), p.m_last = view_of(a.m_last, 2);
  return p;
}

MlstmBwdParams lower_mlstm_bwd(const MlstmBwdArgs& a) {
  MlstmFwdArgs f;
  f.q = a.q, f.k = a.k, f.v = a.v, f.i = a.i, f.f = a.f;
  f.c_initial = a.c_initial, f.n_initial = a.n_initial, f.m_initial = a.m_initial;
  f.eps = a.eps, f.chunk_size = a.chunk_size;
  MlstmBwdParams p;
  p.f = lower_mlstm_fwd(f);
  p.dh = view_of(a.dh, 3);
  p.dc_last = view_of(a.dc_last, 3), p.dn_last = view_of(a.dn_last, 2), p.dm_last = view_of(a.dm_last, 2);
  p.dq = view_of(a.dq, 3), p.dk = view_of(a.dk, 3), p.dv = view_of(a.dv, 3);
  p.di = view_of(a.di, 2), p.df = view_of(a.df, 2);
  p.dc0 = view_of(a.dc_initial, 3), p.dn0 = view_of(a.dn_initial, 2), p.dm0 = view_of(a.dm_initial, 2);
  return p;
}

MlstmParams lower_mlstm_step(const MlstmStepArgs& a) {
  MlstmParams p;
  p.B = a.q.shape[0], p.NH = a.q.shape[1], p.S = 1, p.DQK = a.q.shape[2], p.DV = a.v.shape[2];
  p.eps = float(a.eps);
  p.q = view_of(a.q, 2), p.k = view_of(a.k, 2), p.v = view_of(a.v, 2), p.h = view_of(a.h, 2);
  p.i = view_of(a.i, 2), p.f = view_of(a.f, 2);
  p.c0 = view_of(a.c, 3), p.n0 = view_of(a.n, 2), p.m0 = view_of(a.m, 2);
  p.c_last = view_of(a.c_new, 3), p.n_last = view_of(a.n_new, 2), p.m_last = view_of(a.m_new, 2);
  return p;
}

MlstmParams lower_mlstm_decay(const TensorRef& i, const TensorRef& f) {
  MlstmParams p;
  p.B = i.shape[0], p.NH = i.shape[1], p.S = i.shape[2];
  p.i = view_of(i, 2), p.f = view_of(f, 2);
  return p;
}
}  // namespace detail

// ---- forward --------------------------------------------------------------------------------------
namespace {
// Validates a forward call; returns its shape and whether the last states are asked for.
std::pair<detail::MlstmShape, bool> validate_fwd(const MlstmFwdArgs& a) {
  const char* op = "mlstm_fwd";
  const detail::MlstmShape sh = sequence_shape(op, a.q, a.v);
  const MlstmChecker c{op, a.q, "q"};
  check_sequence_inputs(c, sh, a.q, a.k, a.v, a.i, a.f);
  c.states("c_initial", "n_initial", "m_initial", a.c_initial, a.n_initial, a.m_initial, sh);
  c.io("h", a.h, {sh.B, sh.NH, sh.S, sh.DV});
  const bool last = c.states("c_last", "n_last", "m_last", a.c_last, a.n_last, a.m_last, sh);
  c.eps(a.eps);
  c.chunk(a.chunk_size);
  detail::check_outputs_apart(op, {{"h", a.h}, {"c_last", a.c_last}, {"n_last", a.n_last}, {"m_last", a.m_last}},
                              {{"q", a.q}, {"k", a.k}, {"v", a.v}, {"i", a.i}, {"f", a.f}, {"c_initial", a.c_initial},
                               {"n_initial", a.n_initial}, {"m_initial", a.m_initial}});
  return {sh, last};
}
}  // namespace

std::size_t mlstm_fwd_workspace_size(const MlstmFwdArgs& a) {
  validate_fwd(a);
#if FW_WITH_CUDA
  if (a.q.device == DeviceType::cuda) return detail::mlstm_fwd_workspace_bytes(detail::lower_mlstm_fwd(a));
#endif
  return 0;
}

void mlstm_fwd(const MlstmFwdArgs& a, void* workspace, std::size_t workspace_bytes, Stream stream) {
  const char* op = "mlstm_fwd";
  const auto [sh, last] = validate_fwd(a);
  if (a.q.device == DeviceType::cuda) {
#if FW_WITH_CUDA
    const detail::MlstmParams p = detail::lower_mlstm_fwd(a);
    check_workspace(op, workspace, workspace_bytes, detail::mlstm_fwd_workspace_bytes(p));
    detail::DeviceGuard guard(a.q.device_index);
    detail::mlstm_fwd_cuda(p, workspace, workspace_bytes, stream);
    return;
#else
    no_cuda_build(op);
#endif
  }
  const SeqInputs x = gather_inputs(a.q, a.k, a.v, a.i, a.f, a.c_initial, a.n_initial, a.m_initial);
  Vec h(std::size_t(a.h.numel())), cl, nl, ml;
  if (last) cl.resize(std::size_t(a.c_last.numel())), nl.resize(std::size_t(a.n_last.numel())),
      ml.resize(std::size_t(a.m_last.numel()));
  detail::mlstm_chunkwise_fwd(sh, x.in(), a.eps, a.chunk_size, x.init(), h.data(),
                              {ptr_or_null(cl), ptr_or_null(nl), ptr_or_null(ml)});
  detail::scatter_f64(h, a.h);
  if (last) detail::scatter_f64(cl, a.c_last), detail::scatter_f64(nl, a.n_last), detail::scatter_f64(ml, a.m_last);
}

void mlstm_fwd(const MlstmFwdArgs& a, Stream stream) { mlstm_fwd(a, nullptr, 0, stream); }

// ---- backward -------------------------------------------------------------------------------------
namespace {
detail::MlstmShape validate_bwd(const MlstmBwdArgs& a) {
  const char* op = "mlstm_bwd";
  const detail::MlstmShape sh = sequence_shape(op, a.q, a.v);
  const MlstmChecker c{op, a.q, "q"};
  check_sequence_inputs(c, sh, a.q, a.k, a.v, a.i, a.f);
  const bool init = c.states("c_initial", "n_initial", "m_initial", a.c_initial, a.n_initial, a.m_initial, sh);
  c.io("dh", a.dh, {sh.B, sh.NH, sh.S, sh.DV});
  if (a.dc_last.defined()) c.state("dc_last", a.dc_last, {sh.B, sh.NH, sh.DQK, sh.DV});
  if (a.dn_last.defined()) c.state("dn_last", a.dn_last, {sh.B, sh.NH, sh.DQK});
  if (a.dm_last.defined()) c.state_m("dm_last", a.dm_last, sh.B, sh.NH);
  if (a.dq.defined()) c.io("dq", a.dq, {sh.B, sh.NH, sh.S, sh.DQK});
  if (a.dk.defined()) c.io("dk", a.dk, {sh.B, sh.NH, sh.S, sh.DQK});
  if (a.dv.defined()) c.io("dv", a.dv, {sh.B, sh.NH, sh.S, sh.DV});
  if (a.di.defined()) c.gate("di", a.di, {sh.B, sh.NH, sh.S});
  if (a.df.defined()) c.gate("df", a.df, {sh.B, sh.NH, sh.S});
  const bool dinit = a.dc_initial.defined() || a.dn_initial.defined() || a.dm_initial.defined();
  if (dinit) {
    FW_CHECK_ARG(init, op, a.dc_initial.defined() ? "dc_initial" : a.dn_initial.defined() ? "dn_initial" : "dm_initial",
                 "gradients of the initial states need the initial states (c_initial, n_initial, m_initial)");
    if (a.dc_initial.defined()) c.state("dc_initial", a.dc_initial, {sh.B, sh.NH, sh.DQK, sh.DV});
    if (a.dn_initial.defined()) c.state("dn_initial", a.dn_initial, {sh.B, sh.NH, sh.DQK});
    if (a.dm_initial.defined()) c.state_m("dm_initial", a.dm_initial, sh.B, sh.NH);
  }
  c.eps(a.eps);
  c.chunk(a.chunk_size);
  detail::check_outputs_apart(op, {{"dq", a.dq}, {"dk", a.dk}, {"dv", a.dv}, {"di", a.di}, {"df", a.df},
                                   {"dc_initial", a.dc_initial}, {"dn_initial", a.dn_initial}, {"dm_initial", a.dm_initial}},
                              {{"q", a.q}, {"k", a.k}, {"v", a.v}, {"i", a.i}, {"f", a.f}, {"c_initial", a.c_initial},
                               {"n_initial", a.n_initial}, {"m_initial", a.m_initial}, {"dh", a.dh},
                               {"dc_last", a.dc_last}, {"dn_last", a.dn_last}, {"dm_last", a.dm_last}});
  return sh;
}
}  // namespace

std::size_t mlstm_bwd_workspace_size(const MlstmBwdArgs& a) {
  validate_bwd(a);
#if FW_WITH_CUDA
  if (a.q.device == DeviceType::cuda) return detail::mlstm_bwd_workspace_bytes(detail::lower_mlstm_bwd(a));
#endif
  return 0;
}

void mlstm_bwd(const MlstmBwdArgs& a, void* workspace, std::size_t workspace_bytes, Stream stream) {
  const char* op = "mlstm_bwd";
  const detail::MlstmShape sh = validate_bwd(a);
  if (a.q.device == DeviceType::cuda) {
#if FW_WITH_CUDA
    const detail::MlstmBwdParams p = detail::lower_mlstm_bwd(a);
    check_workspace(op, workspace, workspace_bytes, detail::mlstm_bwd_workspace_bytes(p));
    detail::DeviceGuard guard(a.q.device_index);
    detail::mlstm_bwd_cuda(p, workspace, workspace_bytes, stream);
    return;
#else
    no_cuda_build(op);
#endif
  }
  const SeqInputs x = gather_inputs(a.q, a.k, a.v, a.i, a.f, a.c_initial, a.n_initial, a.m_initial);
  const Vec dh = detail::gather_f64(a.dh), dcl = detail::gather_f64(a.dc_last), dnl = detail::gather_f64(a.dn_last),
            dml = detail::gather_f64(a.dm_last);
  const auto out = detail::out_buffer;
  Vec dq = out(a.dq), dk = out(a.dk), dv = out(a.dv), di = out(a.di), df = out(a.df);
  Vec dc0 = out(a.dc_initial), dn0 = out(a.dn_initial), dm0 = out(a.dm_initial);
  detail::mlstm_recurrent_bwd(sh, x.in(), a.eps, x.init(), dh.data(), {ptr_or_null(dcl), ptr_or_null(dnl), ptr_or_null(dml)},
                              {ptr_or_null(dq), ptr_or_null(dk), ptr_or_null(dv), ptr_or_null(di), ptr_or_null(df)},
                              {ptr_or_null(dc0), ptr_or_null(dn0), ptr_or_null(dm0)});
  detail::scatter_f64(dq, a.dq), detail::scatter_f64(dk, a.dk), detail::scatter_f64(dv, a.dv);
  detail::scatter_f64(di, a.di), detail::scatter_f64(df, a.df);
  detail::scatter_f64(dc0, a.dc_initial), detail::scatter_f64(dn0, a.dn_initial), detail::scatter_f64(dm0, a.dm_initial);
}

void mlstm_bwd(const MlstmBwdArgs& a, Stream stream) { mlstm_bwd(a, nullptr, 0, stream); }

// ---- decoding step --------------------------------------------------------------------------------
void mlstm_step(const MlstmStepArgs& a, Stream stream) {
  const char* op = "mlstm_step";
  detail::check_qv_shapes(op, a.q, a.v, "(B, NH, DQK)", "DQK", "(B, NH, DV)", "DV", 3);
  detail::MlstmShape sh;
  sh.B = a.q.shape[0], sh.NH = a.q.shape[1], sh.S = 1, sh.DQK = a.q.shape[2], sh.DV = a.v.shape[2];
  const MlstmChecker c{op, a.q, "q"};
  c.io("q", a.q, {sh.B, sh.NH, sh.DQK});
  c.io("k", a.k, {sh.B, sh.NH, sh.DQK});
  c.io("v", a.v, {sh.B, sh.NH, sh.DV});
  auto gate = [&](const char* name, const TensorRef& t) {
    if (t.defined() && t.ndim == 3) c.gate(name, t, {sh.B, sh.NH, 1});
    else c.gate(name, t, {sh.B, sh.NH});
  };
  gate("i", a.i);
  gate("f", a.f);
  FW_CHECK_ARG(c.states("c", "n", "m", a.c, a.n, a.m, sh), op, "c", "the states c, n, m are required");
  c.io("h", a.h, {sh.B, sh.NH, sh.DV});
  FW_CHECK_ARG(c.states("c_new", "n_new", "m_new", a.c_new, a.n_new, a.m_new, sh), op, "c_new",
               "the new states c_new, n_new, m_new are required (they may be c, n, m themselves)");
  c.eps(a.eps);
  // in place means the very same views; any other sharing would race (CUDA) or depend on the order
  detail::check_outputs_apart(op, {{"h", a.h}, {"c_new", a.c_new}, {"n_new", a.n_new}, {"m_new", a.m_new}},
                              {{"q", a.q}, {"k", a.k}, {"v", a.v}, {"i", a.i}, {"f", a.f}, {"c", a.c}, {"n", a.n}, {"m", a.m}},
                              {{1, 5}, {2, 6}, {3, 7}});
  if (a.q.device == DeviceType::cuda) {
#if FW_WITH_CUDA
    detail::DeviceGuard guard(a.q.device_index);
    detail::mlstm_step_cuda(detail::lower_mlstm_step(a), stream);
    return;
#else
    no_cuda_build(op);
#endif
  }
  const Vec q = detail::gather_f64(a.q), k = detail::gather_f64(a.k), v = detail::gather_f64(a.v),
            i = detail::gather_f64(a.i), f = detail::gather_f64(a.f);
  Vec cs = detail::gather_f64(a.c), ns = detail::gather_f64(a.n), ms = detail::gather_f64(a.m);
  Vec h(std::size_t(a.h.numel()));
  detail::mlstm_step(sh, q.data(), k.data(), v.data(), i.data(), f.data(), a.eps, {cs.data(), ns.data(), ms.data()},
                     h.data());
  detail::scatter_f64(h, a.h);
  detail::scatter_f64(cs, a.c_new), detail::scatter_f64(ns, a.n_new), detail::scatter_f64(ms, a.m_new);
}

// ---- parallel form -----------------------------------------------------------------------------------
namespace {
// The head norm's weight / bias (NH, DV): IO dtype or float32; their gradients in the same dtype.
void check_norm_params(const MlstmChecker& c, const detail::MlstmShape& sh, const TensorRef& w, const TensorRef& b,
                       double norm_eps, double weight_offset) {
  if (w.defined()) c.gate("norm_weight", w, {sh.NH, sh.DV});
  if (b.defined()) c.gate("norm_bias", b, {sh.NH, sh.DV});
  FW_CHECK_ARG(std::isfinite(norm_eps) && norm_eps >= 0.0, c.op, "norm_eps", "expected a finite value >= 0, got ",
               norm_eps);
  FW_CHECK_ARG(std::isfinite(weight_offset), c.op, "weight_offset", "expected a finite value, got ", weight_offset);
}
void check_norm_grad(const MlstmChecker& c, const detail::MlstmShape& sh, const char* name, const TensorRef& g,
                     const char* pname, const TensorRef& p) {
  if (!g.defined()) return;
  FW_CHECK_ARG(p.defined(), c.op, name, "needs ", pname, " (the parameter it is the gradient of)");
  c.gate(name, g, {sh.NH, sh.DV});
  FW_CHECK_ARG(g.dtype == p.dtype, c.op, name, "expected dtype ", dtype_name(p.dtype), " (that of ", pname, "), got ",
               dtype_name(g.dtype));
}

detail::MlstmShape validate_parallel_fwd(const MlstmParallelFwdArgs& a) {
  const char* op = "mlstm_parallel_fwd";
  const detail::MlstmShape sh = sequence_shape(op, a.q, a.v);
  const MlstmChecker c{op, a.q, "q"};
  check_sequence_inputs(c, sh, a.q, a.k, a.v, a.i, a.f);
  c.io("h", a.h, {sh.B, sh.NH, sh.S, sh.DV});
  if (a.n.defined()) c.state("n", a.n, {sh.B, sh.NH, sh.S});
  if (a.m.defined()) c.state("m", a.m, {sh.B, sh.NH, sh.S});
  if (a.b.defined()) c.state("b", a.b, {sh.B, sh.NH, sh.S});
  c.eps(a.eps);
  if (!a.out.defined()) {
    for (const auto& [name, t] : {std::pair<const char*, const TensorRef&>{"norm_weight", a.norm_weight},
                                  {"norm_bias", a.norm_bias}, {"norm_mean", a.norm_mean}, {"norm_rstd", a.norm_rstd}})
      FW_CHECK_ARG(!t.defined(), op, name, "is given but out is not (the head norm writes out)");
  } else {
    c.io("out", a.out, {sh.B, sh.NH, sh.S, sh.DV});
    check_norm_params(c, sh, a.norm_weight, a.norm_bias, a.norm_eps, a.weight_offset);
    if (a.norm_mean.defined()) c.state("norm_mean", a.norm_mean, {sh.B, sh.NH, sh.S});
    if (a.norm_rstd.defined()) c.state("norm_rstd", a.norm_rstd, {sh.B, sh.NH, sh.S});
  }
  detail::check_outputs_apart(op, {{"h", a.h}, {"n", a.n}, {"m", a.m}, {"b", a.b}, {"out", a.out},
                                   {"norm_mean", a.norm_mean}, {"norm_rstd", a.norm_rstd}},
                              {{"q", a.q}, {"k", a.k}, {"v", a.v}, {"i", a.i}, {"f", a.f}, {"norm_weight", a.norm_weight},
                               {"norm_bias", a.norm_bias}});
  return sh;
}

detail::MlstmShape validate_parallel_bwd(const MlstmParallelBwdArgs& a) {
  const char* op = "mlstm_parallel_bwd";
  const detail::MlstmShape sh = sequence_shape(op, a.q, a.v);
  const MlstmChecker c{op, a.q, "q"};
  check_sequence_inputs(c, sh, a.q, a.k, a.v, a.i, a.f);
  if (a.q.device == DeviceType::cuda) {  // the tiled backward takes the forward's row terms back
    for (const auto& [name, t] : {std::pair<const char*, const TensorRef&>{"m", a.m}, {"b", a.b}})
      FW_CHECK_ARG(t.defined(), op, name,
                   "is required for CUDA tensors: pass the forward's m and b (mlstm_parallel_fwd's outputs)");
    FW_CHECK_ARG(a.h.defined() || !a.dout.defined(), op, "h",
                 "is required with the head norm on CUDA tensors: pass the forward's h (the norm's input)");
  }
  if (a.h.defined()) c.io("h", a.h, {sh.B, sh.NH, sh.S, sh.DV});
  if (a.n.defined()) c.state("n", a.n, {sh.B, sh.NH, sh.S});
  if (a.m.defined()) c.state("m", a.m, {sh.B, sh.NH, sh.S});
  if (a.b.defined()) c.state("b", a.b, {sh.B, sh.NH, sh.S});
  FW_CHECK_ARG(a.dh.defined() != a.dout.defined(), op, "dh",
               a.dh.defined() ? "and dout are both given: pass dh without the head norm, dout with it"
                              : "is required (or dout, with the head norm)");
  if (a.dh.defined()) {
    for (const auto& [name, t] :
         {std::pair<const char*, const TensorRef&>{"norm_weight", a.norm_weight}, {"norm_bias", a.norm_bias},
          {"dnorm_weight", a.dnorm_weight}, {"dnorm_bias", a.dnorm_bias}})
      FW_CHECK_ARG(!t.defined(), op, name, "is given with dh (the head norm's backward takes dout)");
    c.io("dh", a.dh, {sh.B, sh.NH, sh.S, sh.DV});
  } else {
    c.io("dout", a.dout, {sh.B, sh.NH, sh.S, sh.DV});
    check_norm_params(c, sh, a.norm_weight, a.norm_bias, a.norm_eps, a.weight_offset);
    check_norm_grad(c, sh, "dnorm_weight", a.dnorm_weight, "norm_weight", a.norm_weight);
    check_norm_grad(c, sh, "dnorm_bias", a.dnorm_bias, "norm_bias", a.norm_bias);
  }
  if (a.dq.defined()) c.io("dq", a.dq, {sh.B, sh.NH, sh.S, sh.DQK});
  if (a.dk.defined()) c.io("dk", a.dk, {sh.B, sh.NH, sh.S, sh.DQK});
  if (a.dv.defined()) c.io("dv", a.dv, {sh.B, sh.NH, sh.S, sh.DV});
  if (a.di.defined()) c.gate("di", a.di, {sh.B, sh.NH, sh.S});
  if (a.df.defined()) c.gate("df", a.df, {sh.B, sh.NH, sh.S});
  c.eps(a.eps);
  detail::check_outputs_apart(op, {{"dq", a.dq}, {"dk", a.dk}, {"dv", a.dv}, {"di", a.di}, {"df", a.df},
                                   {"dnorm_weight", a.dnorm_weight}, {"dnorm_bias", a.dnorm_bias}},
                              {{"q", a.q}, {"k", a.k}, {"v", a.v}, {"i", a.i}, {"f", a.f}, {"h", a.h}, {"n", a.n},
                               {"m", a.m}, {"b", a.b}, {"dh", a.dh}, {"dout", a.dout}, {"norm_weight", a.norm_weight},
                               {"norm_bias", a.norm_bias}});
  return sh;
}

#if FW_WITH_CUDA
detail::MlstmParallelParams lower_parallel(const TensorRef& q, const TensorRef& k, const TensorRef& v,
                                           const TensorRef& i, const TensorRef& f, const TensorRef& h, double eps) {
  MlstmFwdArgs fa;
  fa.q = q, fa.k = k, fa.v = v, fa.i = i, fa.f = f, fa.h = h, fa.eps = eps;
  detail::MlstmParallelParams P;
  P.f = detail::lower_mlstm_fwd(fa);
  return P;
}
detail::MlstmParallelParams lower_parallel_fwd(const MlstmParallelFwdArgs& a) {
  detail::MlstmParallelParams P = lower_parallel(a.q, a.k, a.v, a.i, a.f, a.h, a.eps);
  P.n = detail::view_of(a.n, 2), P.m = detail::view_of(a.m, 2), P.b = detail::view_of(a.b, 2);
  P.out = detail::view_of(a.out, 3), P.nw = detail::view_of(a.norm_weight, 1), P.nb = detail::view_of(a.norm_bias, 1);
  P.nmean = detail::view_of(a.norm_mean, 2), P.nrstd = detail::view_of(a.norm_rstd, 2);
  P.norm_eps = float(a.norm_eps), P.weight_offset = float(a.weight_offset);
  return P;
}
detail::MlstmParallelParams lower_parallel_bwd(const MlstmParallelBwdArgs& a) {
  detail::MlstmParallelParams P = lower_parallel(a.q, a.k, a.v, a.i, a.f, a.h, a.eps);
  P.n = detail::view_of(a.n, 2), P.m = detail::view_of(a.m, 2), P.b = detail::view_of(a.b, 2);
  P.dh = detail::view_of(a.dh, 3);
  P.dq = detail::view_of(a.dq, 3), P.dk = detail::view_of(a.dk, 3), P.dv = detail::view_of(a.dv, 3);
  P.di = detail::view_of(a.di, 2), P.df = detail::view_of(a.df, 2);
  P.dout = detail::view_of(a.dout, 3), P.nw = detail::view_of(a.norm_weight, 1), P.nb = detail::view_of(a.norm_bias, 1);
  P.dnw = detail::view_of(a.dnorm_weight, 1), P.dnb = detail::view_of(a.dnorm_bias, 1);
  P.norm_eps = float(a.norm_eps), P.weight_offset = float(a.weight_offset);
  return P;
}
#endif

// float64 copies of the head norm's parameters, for the reference.
struct NormInputs {
  Vec w, b;
  detail::MlstmHeadNorm norm(double eps, double offset) const {
    return {w.empty() ? nullptr : w.data(), b.empty() ? nullptr : b.data(), eps, offset};
  }
};
}  // namespace

std::size_t mlstm_parallel_fwd_workspace_size(const MlstmParallelFwdArgs& a) {
  validate_parallel_fwd(a);
#if FW_WITH_CUDA
  if (a.q.device == DeviceType::cuda) return detail::mlstm_parallel_workspace_bytes(lower_parallel_fwd(a), false);
#endif
  return 0;
}

void mlstm_parallel_fwd(const MlstmParallelFwdArgs& a, void* workspace, std::size_t workspace_bytes, Stream stream) {
  const char* op = "mlstm_parallel_fwd";
  const detail::MlstmShape sh = validate_parallel_fwd(a);
  if (a.q.device == DeviceType::cuda) {
#if FW_WITH_CUDA
    const detail::MlstmParallelParams P = lower_parallel_fwd(a);
    check_workspace(op, workspace, workspace_bytes, detail::mlstm_parallel_workspace_bytes(P, false));
    detail::DeviceGuard guard(a.q.device_index);
    detail::mlstm_parallel_fwd_cuda(P, workspace, workspace_bytes, stream);
    return;
#else
    no_cuda_build(op);
#endif
  }
  const SeqInputs x = gather_inputs(a.q, a.k, a.v, a.i, a.f, {}, {}, {});
  const auto out = detail::out_buffer;
  Vec h(std::size_t(a.h.numel())), n = out(a.n), m = out(a.m), b = out(a.b);
  detail::mlstm_parallel_fwd(sh, x.in(), a.eps, h.data(), ptr_or_null(n), ptr_or_null(m), ptr_or_null(b));
  if (a.out.defined()) {  // the head norm of h (float64 here; the GPU reads h back in the IO dtype)
    const NormInputs ni{detail::gather_f64(a.norm_weight), detail::gather_f64(a.norm_bias)};
    Vec o(std::size_t(a.out.numel())), mu = out(a.norm_mean), rs = out(a.norm_rstd);
    detail::mlstm_headnorm_rows_fwd(sh, h.data(), ni.norm(a.norm_eps, a.weight_offset), o.data(), ptr_or_null(mu),
                                    ptr_or_null(rs));
    detail::scatter_f64(o, a.out), detail::scatter_f64(mu, a.norm_mean), detail::scatter_f64(rs, a.norm_rstd);
  }
  detail::scatter_f64(h, a.h), detail::scatter_f64(n, a.n), detail::scatter_f64(m, a.m), detail::scatter_f64(b, a.b);
}

void mlstm_parallel_fwd(const MlstmParallelFwdArgs& a, Stream stream) { mlstm_parallel_fwd(a, nullptr, 0, stream); }

std::size_t mlstm_parallel_bwd_workspace_size(const MlstmParallelBwdArgs& a) {
  validate_parallel_bwd(a);
#if FW_WITH_CUDA
  if (a.q.device == DeviceType::cuda) return detail::mlstm_parallel_workspace_bytes(lower_parallel_bwd(a), true);
#endif
  return 0;
}

void mlstm_parallel_bwd(const MlstmParallelBwdArgs& a, void* workspace, std::size_t workspace_bytes, Stream stream) {
  const char* op = "mlstm_parallel_bwd";
  const detail::MlstmShape sh = validate_parallel_bwd(a);
  if (a.q.device == DeviceType::cuda) {
#if FW_WITH_CUDA
    const detail::MlstmParallelParams P = lower_parallel_bwd(a);
    check_workspace(op, workspace, workspace_bytes, detail::mlstm_parallel_workspace_bytes(P, true));
    detail::DeviceGuard guard(a.q.device_index);
    detail::mlstm_parallel_bwd_cuda(P, workspace, workspace_bytes, stream);
    return;
#else
    no_cuda_build(op);
#endif
  }
  const SeqInputs x = gather_inputs(a.q, a.k, a.v, a.i, a.f, {}, {}, {});
  const auto out = detail::out_buffer;
  Vec dq = out(a.dq), dk = out(a.dk), dv = out(a.dv), di = out(a.di), df = out(a.df);
  const detail::MlstmGrads g{ptr_or_null(dq), ptr_or_null(dk), ptr_or_null(dv), ptr_or_null(di), ptr_or_null(df)};
  if (a.dout.defined()) {  // the exact gradient through the head norm (the reference recomputes h)
    const Vec dout = detail::gather_f64(a.dout);
    const NormInputs ni{detail::gather_f64(a.norm_weight), detail::gather_f64(a.norm_bias)};
    Vec dw = out(a.dnorm_weight), dbias = out(a.dnorm_bias);
    detail::mlstm_parallel_headnorm_bwd(sh, x.in(), a.eps, ni.norm(a.norm_eps, a.weight_offset), dout.data(), g,
                                        {ptr_or_null(dw), ptr_or_null(dbias)});
    detail::scatter_f64(dw, a.dnorm_weight), detail::scatter_f64(dbias, a.dnorm_bias);
  } else {
    const Vec dh = detail::gather_f64(a.dh);
    detail::mlstm_parallel_bwd(sh, x.in(), a.eps, dh.data(), g);
  }
  detail::scatter_f64(dq, a.dq), detail::scatter_f64(dk, a.dk), detail::scatter_f64(dv, a.dv);
  detail::scatter_f64(di, a.di), detail::scatter_f64(df, a.df);
}

void mlstm_parallel_bwd(const MlstmParallelBwdArgs& a, Stream stream) { mlstm_parallel_bwd(a, nullptr, 0, stream); }

// ---- decay matrix -----------------------------------------------------------------------------------
void mlstm_decay_matrix_fwd(const MlstmDecayMatrixFwdArgs& a, Stream stream) {
  const char* op = "mlstm_decay_matrix_fwd";
  FW_CHECK_ARG(a.i.defined(), op, "i", "is required");
  FW_CHECK_ARG(a.i.ndim == 3, op, "i", "expected shape (B, NH, S), got ", a.i.shape_str());
  detail::check_io_dtype(op, "i", a.i);
  detail::MlstmShape sh;
  sh.B = a.i.shape[0], sh.NH = a.i.shape[1], sh.S = a.i.shape[2];
  const MlstmChecker c{op, a.i, "i"};
  c.io("i", a.i, {sh.B, sh.NH, sh.S});
  c.gate("f", a.f, {sh.B, sh.NH, sh.S});
  c.gate("D", a.D, {sh.B, sh.NH, sh.S, sh.S});
  detail::check_outputs_apart(op, {{"D", a.D}}, {{"i", a.i}, {"f", a.f}});
  if (a.i.device == DeviceType::cuda) {
#if FW_WITH_CUDA
    detail::DeviceGuard guard(a.i.device_index);
    detail::mlstm_decay_fwd_cuda(detail::lower_mlstm_decay(a.i, a.f), detail::view_of(a.D, 3), stream);
    return;
#else
    no_cuda_build(op);
#endif
  }
  const Vec i = detail::gather_f64(a.i), f = detail::gather_f64(a.f);
  Vec D(std::size_t(a.D.numel()));
  detail::mlstm_decay_matrix_fwd(sh, i.data(), f.data(), D.data());
  detail::scatter_f64(D, a.D);
}

namespace {
detail::MlstmShape validate_decay_bwd(const MlstmDecayMatrixBwdArgs& a) {
  const char* op = "mlstm_decay_matrix_bwd";
  FW_CHECK_ARG(a.f.defined(), op, "f", "is required");
  FW_CHECK_ARG(a.f.ndim == 3, op, "f", "expected shape (B, NH, S), got ", a.f.shape_str());
  detail::check_io_dtype(op, "f", a.f);
  detail::MlstmShape sh;
  sh.B = a.f.shape[0], sh.NH = a.f.shape[1], sh.S = a.f.shape[2];
  const MlstmChecker c{op, a.f, "f"};
  c.io("f", a.f, {sh.B, sh.NH, sh.S});
  c.gate("dD", a.dD, {sh.B, sh.NH, sh.S, sh.S});
  if (a.di.defined()) c.gate("di", a.di, {sh.B, sh.NH, sh.S});
  if (a.df.defined()) c.gate("df", a.df, {sh.B, sh.NH, sh.S});
  detail::check_outputs_apart(op, {{"di", a.di}, {"df", a.df}}, {{"f", a.f}, {"dD", a.dD}});
  return sh;
}
}  // namespace

std::size_t mlstm_decay_matrix_bwd_workspace_size(const MlstmDecayMatrixBwdArgs& a) {
  validate_decay_bwd(a);
#if FW_WITH_CUDA
  if (a.f.device == DeviceType::cuda) return detail::mlstm_decay_bwd_workspace_bytes(detail::lower_mlstm_decay(a.f, a.f));
#endif
  return 0;
}

void mlstm_decay_matrix_bwd(const MlstmDecayMatrixBwdArgs& a, void* workspace, std::size_t workspace_bytes,
                            Stream stream) {
  const char* op = "mlstm_decay_matrix_bwd";
  const detail::MlstmShape sh = validate_decay_bwd(a);
  if (a.f.device == DeviceType::cuda) {
#if FW_WITH_CUDA
    const detail::MlstmParams p = detail::lower_mlstm_decay(a.f, a.f);  // only B, NH, S and f are used
    check_workspace(op, workspace, workspace_bytes, detail::mlstm_decay_bwd_workspace_bytes(p));
    detail::DeviceGuard guard(a.f.device_index);
    detail::mlstm_decay_bwd_cuda(p, detail::view_of(a.dD, 3), detail::view_of(a.di, 2), detail::view_of(a.df, 2),
                                 workspace, workspace_bytes, stream);
    return;
#else
    no_cuda_build(op);
#endif
  }
  const Vec f = detail::gather_f64(a.f), dD = detail::gather_f64(a.dD);
  Vec di(a.di.defined() ? std::size_t(a.di.numel()) : 0), df(a.df.defined() ? std::size_t(a.df.numel()) : 0);
  detail::mlstm_decay_matrix_bwd(sh, f.data(), dD.data(), ptr_or_null(di), ptr_or_null(df));
  detail::scatter_f64(di, a.di), detail::scatter_f64(df, a.df);
}

void mlstm_decay_matrix_bwd(const MlstmDecayMatrixBwdArgs& a, Stream stream) {
  mlstm_decay_matrix_bwd(a, nullptr, 0, stream);
}

}  // namespace fastweight
