// mlstm.cpp: the mLSTM ops of fastweight._C (fastweight/mlstm.h), same conventions as module.cpp:
// tensors as DLPack arrays or spec tuples, None for absent optionals, the stream as an int, the GIL
// released around the C++ call, validation (and its messages) in the C++ API.
#include "convert.h"

using namespace nb::literals;

namespace {
using namespace fwbind;

// q, k, v, i, f of any sequence argument struct.
template <typename Args>
void set_qkvif(Args& a, const char* op, const In& q, const In& k, const In& v, const In& i, const In& f) {
  a.q = to_ref(q, op, "q"), a.k = to_ref(k, op, "k"), a.v = to_ref(v, op, "v");
  a.i = to_ref(i, op, "i"), a.f = to_ref(f, op, "f");
}

// The sequence inputs shared by the forward and backward argument structs.
template <typename Args>
void set_sequence_inputs(Args& a, const char* op, const In& q, const In& k, const In& v, const In& i, const In& f,
                         const OptIn& c_initial, const OptIn& n_initial, const OptIn& m_initial) {
  set_qkvif(a, op, q, k, v, i, f);
  a.c_initial = to_ref(c_initial, op, "c_initial"), a.n_initial = to_ref(n_initial, op, "n_initial");
  a.m_initial = to_ref(m_initial, op, "m_initial");
}

fastweight::MlstmFwdArgs fwd_args(const In& q, const In& k, const In& v, const In& i, const In& f,
                                  const OptIn& c_initial, const OptIn& n_initial, const OptIn& m_initial, const Out& h,
                                  const OptOut& c_last, const OptOut& n_last, const OptOut& m_last, double eps,
                                  std::int64_t chunk_size) {
  const char* op = "mlstm_fwd";
  fastweight::MlstmFwdArgs a;
  set_sequence_inputs(a, op, q, k, v, i, f, c_initial, n_initial, m_initial);
  a.h = to_ref(h, op, "h");
  a.c_last = to_ref(c_last, op, "c_last"), a.n_last = to_ref(n_last, op, "n_last"), a.m_last = to_ref(m_last, op, "m_last");
  a.eps = eps;
  a.chunk_size = chunk_size;
  return a;
}

std::size_t mlstm_fwd_workspace_size(const In& q, const In& k, const In& v, const In& i, const In& f,
                                     const OptIn& c_initial, const OptIn& n_initial, const OptIn& m_initial,
                                     const Out& h, const OptOut& c_last, const OptOut& n_last, const OptOut& m_last,
                                     double eps, std::int64_t chunk_size) {
  const auto a = fwd_args(q, k, v, i, f, c_initial, n_initial, m_initial, h, c_last, n_last, m_last, eps, chunk_size);
  nb::gil_scoped_release release;
  return fastweight::mlstm_fwd_workspace_size(a);
}

void mlstm_fwd(const In& q, const In& k, const In& v, const In& i, const In& f, const OptIn& c_initial,
               const OptIn& n_initial, const OptIn& m_initial, const Out& h, const OptOut& c_last,
               const OptOut& n_last, const OptOut& m_last, double eps, std::int64_t chunk_size,
               const OptWorkspace& workspace, std::uintptr_t stream) {
  const auto a = fwd_args(q, k, v, i, f, c_initial, n_initial, m_initial, h, c_last, n_last, m_last, eps, chunk_size);
  const Workspace ws = to_workspace(workspace, a.q, "mlstm_fwd");
  nb::gil_scoped_release release;
  fastweight::mlstm_fwd(a, ws.data, ws.bytes, to_stream(stream));
}

fastweight::MlstmBwdArgs bwd_args(const In& q, const In& k, const In& v, const In& i, const In& f, const OptIn& c_initial,
               const OptIn& n_initial, const OptIn& m_initial, const In& dh, const OptIn& dc_last, const OptIn& dn_last,
               const OptIn& dm_last, const OptOut& dq, const OptOut& dk, const OptOut& dv, const OptOut& di,
               const OptOut& df, const OptOut& dc_initial, const OptOut& dn_initial, const OptOut& dm_initial,
               double eps, std::int64_t chunk_size) {
  const char* op = "mlstm_bwd";
  fastweight::MlstmBwdArgs a;
  set_sequence_inputs(a, op, q, k, v, i, f, c_initial, n_initial, m_initial);
  a.dh = to_ref(dh, op, "dh");
  a.dc_last = to_ref(dc_last, op, "dc_last"), a.dn_last = to_ref(dn_last, op, "dn_last");
  a.dm_last = to_ref(dm_last, op, "dm_last");
  a.dq = to_ref(dq, op, "dq"), a.dk = to_ref(dk, op, "dk"), a.dv = to_ref(dv, op, "dv");
  a.di = to_ref(di, op, "di"), a.df = to_ref(df, op, "df");
  a.dc_initial = to_ref(dc_initial, op, "dc_initial"), a.dn_initial = to_ref(dn_initial, op, "dn_initial");
  a.dm_initial = to_ref(dm_initial, op, "dm_initial");
  a.eps = eps;
  a.chunk_size = chunk_size;
  return a;
}

std::size_t mlstm_bwd_workspace_size(const In& q, const In& k, const In& v, const In& i, const In& f,
                                     const OptIn& c_initial, const OptIn& n_initial, const OptIn& m_initial,
                                     const In& dh, const OptIn& dc_last, const OptIn& dn_last, const OptIn& dm_last,
                                     const OptOut& dq, const OptOut& dk, const OptOut& dv, const OptOut& di,
                                     const OptOut& df, const OptOut& dc_initial, const OptOut& dn_initial,
                                     const OptOut& dm_initial, double eps, std::int64_t chunk_size) {
  const auto a = bwd_args(q, k, v, i, f, c_initial, n_initial, m_initial, dh, dc_last, dn_last, dm_last, dq, dk, dv,
                          di, df, dc_initial, dn_initial, dm_initial, eps, chunk_size);
  nb::gil_scoped_release release;
  return fastweight::mlstm_bwd_workspace_size(a);
}

void mlstm_bwd(const In& q, const In& k, const In& v, const In& i, const In& f, const OptIn& c_initial,
               const OptIn& n_initial, const OptIn& m_initial, const In& dh, const OptIn& dc_last, const OptIn& dn_last,
               const OptIn& dm_last, const OptOut& dq, const OptOut& dk, const OptOut& dv, const OptOut& di,
               const OptOut& df, const OptOut& dc_initial, const OptOut& dn_initial, const OptOut& dm_initial,
               double eps, std::int64_t chunk_size, const OptWorkspace& workspace, std::uintptr_t stream) {
  const auto a = bwd_args(q, k, v, i, f, c_initial, n_initial, m_initial, dh, dc_last, dn_last, dm_last, dq, dk, dv,
                          di, df, dc_initial, dn_initial, dm_initial, eps, chunk_size);
  const Workspace ws = to_workspace(workspace, a.q, "mlstm_bwd");
  nb::gil_scoped_release release;
  fastweight::mlstm_bwd(a, ws.data, ws.bytes, to_stream(stream));
}

void mlstm_step(const In& q, const In& k, const In& v, const In& i, const In& f, const In& c, const In& n, const In& m,
                const Out& h, const Out& c_new, const Out& n_new, const Out& m_new, double eps, std::uintptr_t stream) {
  const char* op = "mlstm_step";
  fastweight::MlstmStepArgs a;
  a.q = to_ref(q, op, "q"), a.k = to_ref(k, op, "k"), a.v = to_ref(v, op, "v");
  a.i = to_ref(i, op, "i"), a.f = to_ref(f, op, "f");
  a.c = to_ref(c, op, "c"), a.n = to_ref(n, op, "n"), a.m = to_ref(m, op, "m");
  a.h = to_ref(h, op, "h");
  a.c_new = to_ref(c_new, op, "c_new"), a.n_new = to_ref(n_new, op, "n_new"), a.m_new = to_ref(m_new, op, "m_new");
  a.eps = eps;
  nb::gil_scoped_release release;
  fastweight::mlstm_step(a, to_stream(stream));
}

// The head norm's arguments shared by the parallel form's forward and backward.
struct NormIn {
  OptIn weight, bias;
  double eps, offset;
};

fastweight::MlstmParallelFwdArgs parallel_fwd_args(const In& q, const In& k, const In& v, const In& i, const In& f,
                                                   const Out& h, const OptOut& n, const OptOut& m, const OptOut& b,
                                                   double eps, const OptOut& out, const NormIn& nrm,
                                                   const OptOut& mean, const OptOut& rstd) {
  const char* op = "mlstm_parallel_fwd";
  fastweight::MlstmParallelFwdArgs a;
  set_qkvif(a, op, q, k, v, i, f);
  a.h = to_ref(h, op, "h"), a.n = to_ref(n, op, "n"), a.m = to_ref(m, op, "m"), a.b = to_ref(b, op, "b");
  a.eps = eps;
  a.out = to_ref(out, op, "out"), a.norm_weight = to_ref(nrm.weight, op, "norm_weight");
  a.norm_bias = to_ref(nrm.bias, op, "norm_bias");
  a.norm_mean = to_ref(mean, op, "norm_mean"), a.norm_rstd = to_ref(rstd, op, "norm_rstd");
  a.norm_eps = nrm.eps, a.weight_offset = nrm.offset;
  return a;
}

std::size_t parallel_fwd_workspace_size(const In& q, const In& k, const In& v, const In& i, const In& f, const Out& h,
                                        const OptOut& n, const OptOut& m, const OptOut& b, double eps,
                                        const OptOut& out, const OptIn& norm_weight, const OptIn& norm_bias,
                                        const OptOut& norm_mean, const OptOut& norm_rstd, double norm_eps,
                                        double weight_offset) {
  const auto a = parallel_fwd_args(q, k, v, i, f, h, n, m, b, eps, out, {norm_weight, norm_bias, norm_eps, weight_offset},
                                   norm_mean, norm_rstd);
  nb::gil_scoped_release release;
  return fastweight::mlstm_parallel_fwd_workspace_size(a);
}

void parallel_fwd(const In& q, const In& k, const In& v, const In& i, const In& f, const Out& h, const OptOut& n,
                  const OptOut& m, const OptOut& b, double eps, const OptOut& out, const OptIn& norm_weight,
                  const OptIn& norm_bias, const OptOut& norm_mean, const OptOut& norm_rstd, double norm_eps,
                  double weight_offset, const OptWorkspace& workspace, std::uintptr_t stream) {
  const auto a = parallel_fwd_args(q, k, v, i, f, h, n, m, b, eps, out, {norm_weight, norm_bias, norm_eps, weight_offset},
                                   norm_mean, norm_rstd);
  const Workspace ws = to_workspace(workspace, a.q, "mlstm_parallel_fwd");
  nb::gil_scoped_release release;
  fastweight::mlstm_parallel_fwd(a, ws.data, ws.bytes, to_stream(stream));
}

fastweight::MlstmParallelBwdArgs parallel_bwd_args(const In& q, const In& k, const In& v, const In& i, const In& f,
                                                   const OptIn& h, const OptIn& n, const OptIn& m, const OptIn& b,
                                                   const OptIn& dh, const OptOut& dq, const OptOut& dk,
                                                   const OptOut& dv, const OptOut& di, const OptOut& df, double eps,
                                                   const OptIn& dout, const NormIn& nrm, const OptOut& dweight,
                                                   const OptOut& dbias) {
  const char* op = "mlstm_parallel_bwd";
  fastweight::MlstmParallelBwdArgs a;
  set_qkvif(a, op, q, k, v, i, f);
  a.h = to_ref(h, op, "h"), a.n = to_ref(n, op, "n"), a.m = to_ref(m, op, "m"), a.b = to_ref(b, op, "b");
  a.dh = to_ref(dh, op, "dh");
  a.dq = to_ref(dq, op, "dq"), a.dk = to_ref(dk, op, "dk"), a.dv = to_ref(dv, op, "dv");
  a.di = to_ref(di, op, "di"), a.df = to_ref(df, op, "df");
  a.eps = eps;
  a.dout = to_ref(dout, op, "dout"), a.norm_weight = to_ref(nrm.weight, op, "norm_weight");
  a.norm_bias = to_ref(nrm.bias, op, "norm_bias");
  a.dnorm_weight = to_ref(dweight, op, "dnorm_weight"), a.dnorm_bias = to_ref(dbias, op, "dnorm_bias");
  a.norm_eps = nrm.eps, a.weight_offset = nrm.offset;
  return a;
}

std::size_t parallel_bwd_workspace_size(const In& q, const In& k, const In& v, const In& i, const In& f,
                                        const OptIn& h, const OptIn& n, const OptIn& m, const OptIn& b, const OptIn& dh,
                                        const OptOut& dq, const OptOut& dk, const OptOut& dv, const OptOut& di,
                                        const OptOut& df, double eps, const OptIn& dout, const OptIn& norm_weight,
                                        const OptIn& norm_bias, const OptOut& dnorm_weight, const OptOut& dnorm_bias,
                                        double norm_eps, double weight_offset) {
  const auto a = parallel_bwd_args(q, k, v, i, f, h, n, m, b, dh, dq, dk, dv, di, df, eps, dout,
                                   {norm_weight, norm_bias, norm_eps, weight_offset}, dnorm_weight, dnorm_bias);
  nb::gil_scoped_release release;
  return fastweight::mlstm_parallel_bwd_workspace_size(a);
}

void parallel_bwd(const In& q, const In& k, const In& v, const In& i, const In& f, const OptIn& h, const OptIn& n,
                  const OptIn& m, const OptIn& b, const OptIn& dh, const OptOut& dq, const OptOut& dk, const OptOut& dv,
                  const OptOut& di, const OptOut& df, double eps, const OptIn& dout, const OptIn& norm_weight,
                  const OptIn& norm_bias, const OptOut& dnorm_weight, const OptOut& dnorm_bias, double norm_eps,
                  double weight_offset, const OptWorkspace& workspace, std::uintptr_t stream) {
  const auto a = parallel_bwd_args(q, k, v, i, f, h, n, m, b, dh, dq, dk, dv, di, df, eps, dout,
                                   {norm_weight, norm_bias, norm_eps, weight_offset}, dnorm_weight, dnorm_bias);
  const Workspace ws = to_workspace(workspace, a.q, "mlstm_parallel_bwd");
  nb::gil_scoped_release release;
  fastweight::mlstm_parallel_bwd(a, ws.data, ws.bytes, to_stream(stream));
}

void decay_fwd(const In& i, const In& f, const Out& D, std::uintptr_t stream) {
  const char* op = "mlstm_decay_matrix_fwd";
  fastweight::MlstmDecayMatrixFwdArgs a{to_ref(i, op, "i"), to_ref(f, op, "f"), to_ref(D, op, "D")};
  nb::gil_scoped_release release;
  fastweight::mlstm_decay_matrix_fwd(a, to_stream(stream));
}

std::size_t decay_bwd_workspace_size(const In& f, const In& dD, const OptOut& di, const OptOut& df) {
  const char* op = "mlstm_decay_matrix_bwd";
  fastweight::MlstmDecayMatrixBwdArgs a{to_ref(f, op, "f"), to_ref(dD, op, "dD"), to_ref(di, op, "di"),
                                        to_ref(df, op, "df")};
  nb::gil_scoped_release release;
  return fastweight::mlstm_decay_matrix_bwd_workspace_size(a);
}

void decay_bwd(const In& f, const In& dD, const OptOut& di, const OptOut& df, const OptWorkspace& workspace,
               std::uintptr_t stream) {
  const char* op = "mlstm_decay_matrix_bwd";
  fastweight::MlstmDecayMatrixBwdArgs a{to_ref(f, op, "f"), to_ref(dD, op, "dD"), to_ref(di, op, "di"),
                                        to_ref(df, op, "df")};
  const Workspace ws = to_workspace(workspace, a.f, op);
  nb::gil_scoped_release release;
  fastweight::mlstm_decay_matrix_bwd(a, ws.data, ws.bytes, to_stream(stream));
}

}  // namespace

void bind_mlstm(nb::module_& m) {
  const auto none = nb::none();
  m.def("mlstm_fwd_workspace_size", &mlstm_fwd_workspace_size, "q"_a, "k"_a, "v"_a, "i"_a, "f"_a,
        "c_initial"_a.none() = none, "n_initial"_a.none() = none, "m_initial"_a.none() = none, "h"_a,
        "c_last"_a.none() = none, "n_last"_a.none() = none, "m_last"_a.none() = none, "eps"_a = 1e-6,
        "chunk_size"_a = 64, "Bytes of workspace mlstm_fwd needs for these arguments (0 on the CPU).");
  m.def("mlstm_fwd", &mlstm_fwd, "q"_a, "k"_a, "v"_a, "i"_a, "f"_a, "c_initial"_a.none() = none,
        "n_initial"_a.none() = none, "m_initial"_a.none() = none, "h"_a, "c_last"_a.none() = none,
        "n_last"_a.none() = none, "m_last"_a.none() = none, "eps"_a = 1e-6, "chunk_size"_a = 64,
        "workspace"_a.none() = none, "stream"_a = 0,
        "mLSTM forward (chunkwise): writes h (B, NH, S, DV) and, when given, the final states.");
  m.def("mlstm_bwd_workspace_size", &mlstm_bwd_workspace_size, "q"_a, "k"_a, "v"_a, "i"_a, "f"_a,
        "c_initial"_a.none() = none, "n_initial"_a.none() = none, "m_initial"_a.none() = none, "dh"_a,
        "dc_last"_a.none() = none, "dn_last"_a.none() = none, "dm_last"_a.none() = none, "dq"_a.none() = none,
        "dk"_a.none() = none, "dv"_a.none() = none, "di"_a.none() = none, "df"_a.none() = none,
        "dc_initial"_a.none() = none, "dn_initial"_a.none() = none, "dm_initial"_a.none() = none, "eps"_a = 1e-6,
        "chunk_size"_a = 64, "Bytes of workspace mlstm_bwd needs for these arguments (0 on the CPU).");
  m.def("mlstm_bwd", &mlstm_bwd, "q"_a, "k"_a, "v"_a, "i"_a, "f"_a, "c_initial"_a.none() = none,
        "n_initial"_a.none() = none, "m_initial"_a.none() = none, "dh"_a, "dc_last"_a.none() = none,
        "dn_last"_a.none() = none, "dm_last"_a.none() = none, "dq"_a.none() = none, "dk"_a.none() = none,
        "dv"_a.none() = none, "di"_a.none() = none, "df"_a.none() = none, "dc_initial"_a.none() = none,
        "dn_initial"_a.none() = none, "dm_initial"_a.none() = none, "eps"_a = 1e-6, "chunk_size"_a = 64,
        "workspace"_a.none() = none, "stream"_a = 0,
        "mLSTM backward: the exact gradient (normaliser and stabiliser paths included); writes the given outputs.");
  m.def("mlstm_step", &mlstm_step, "q"_a, "k"_a, "v"_a, "i"_a, "f"_a, "c"_a, "n"_a, "m"_a, "h"_a, "c_new"_a,
        "n_new"_a, "m_new"_a, "eps"_a = 1e-6, "stream"_a = 0,
        "One decoding step; c_new/n_new/m_new may be c/n/m (in place).");
  m.def("mlstm_parallel_fwd_workspace_size", &parallel_fwd_workspace_size, "q"_a, "k"_a, "v"_a, "i"_a, "f"_a, "h"_a,
        "n"_a.none() = none, "m"_a.none() = none, "b"_a.none() = none, "eps"_a = 1e-6, "out"_a.none() = none,
        "norm_weight"_a.none() = none, "norm_bias"_a.none() = none, "norm_mean"_a.none() = none,
        "norm_rstd"_a.none() = none, "norm_eps"_a = 1e-6, "weight_offset"_a = 0.0,
        "Bytes of workspace mlstm_parallel_fwd needs for these arguments (0 on the CPU).");
  m.def("mlstm_parallel_fwd", &parallel_fwd, "q"_a, "k"_a, "v"_a, "i"_a, "f"_a, "h"_a, "n"_a.none() = none,
        "m"_a.none() = none, "b"_a.none() = none, "eps"_a = 1e-6, "out"_a.none() = none,
        "norm_weight"_a.none() = none, "norm_bias"_a.none() = none, "norm_mean"_a.none() = none,
        "norm_rstd"_a.none() = none, "norm_eps"_a = 1e-6, "weight_offset"_a = 0.0, "workspace"_a.none() = none,
        "stream"_a = 0,
        "The parallel form (seed 000): h, and per position the normaliser n, stabiliser m and signed row sum b; "
        "with out, also the head norm of h.");
  m.def("mlstm_parallel_bwd_workspace_size", &parallel_bwd_workspace_size, "q"_a, "k"_a, "v"_a, "i"_a, "f"_a,
        "h"_a.none() = none, "n"_a.none() = none, "m"_a.none() = none, "b"_a.none() = none, "dh"_a.none() = none,
        "dq"_a.none() = none, "dk"_a.none() = none, "dv"_a.none() = none, "di"_a.none() = none, "df"_a.none() = none,
        "eps"_a = 1e-6, "dout"_a.none() = none, "norm_weight"_a.none() = none, "norm_bias"_a.none() = none,
        "dnorm_weight"_a.none() = none, "dnorm_bias"_a.none() = none, "norm_eps"_a = 1e-6, "weight_offset"_a = 0.0,
        "Bytes of workspace mlstm_parallel_bwd needs for these arguments (0 on the CPU).");
  m.def("mlstm_parallel_bwd", &parallel_bwd, "q"_a, "k"_a, "v"_a, "i"_a, "f"_a, "h"_a.none() = none,
        "n"_a.none() = none, "m"_a.none() = none, "b"_a.none() = none, "dh"_a.none() = none, "dq"_a.none() = none,
        "dk"_a.none() = none, "dv"_a.none() = none, "di"_a.none() = none, "df"_a.none() = none, "eps"_a = 1e-6,
        "dout"_a.none() = none, "norm_weight"_a.none() = none, "norm_bias"_a.none() = none,
        "dnorm_weight"_a.none() = none, "dnorm_bias"_a.none() = none, "norm_eps"_a = 1e-6, "weight_offset"_a = 0.0,
        "workspace"_a.none() = none, "stream"_a = 0,
        "Parallel-form backward: the exact gradient (from dh, or from dout through the head norm); CUDA needs the "
        "forward's h, m and b.");
  m.def("mlstm_decay_matrix_fwd", &decay_fwd, "i"_a, "f"_a, "D"_a, "stream"_a = 0,
        "D[t, s] = F_t - F_s + i_s (s <= t), -inf above the diagonal.");
  m.def("mlstm_decay_matrix_bwd_workspace_size", &decay_bwd_workspace_size, "f"_a, "dD"_a, "di"_a.none() = none,
        "df"_a.none() = none);
  m.def("mlstm_decay_matrix_bwd", &decay_bwd, "f"_a, "dD"_a, "di"_a.none() = none, "df"_a.none() = none,
        "workspace"_a.none() = none, "stream"_a = 0);
}
