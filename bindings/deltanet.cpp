// deltanet.cpp: the DeltaNet ops of fastweight._C (fastweight/deltanet.h), same conventions as
// module.cpp: tensors as DLPack arrays or spec tuples, None for absent optionals, the stream as an
// int, the GIL released around the C++ call, validation (and its messages) in the C++ API.
// scale: None means K^-0.5 (FLA's default).
#include "convert.h"

using namespace nb::literals;

namespace {
using namespace fwbind;

// The inputs and options shared by the forward and backward argument structs.
template <typename Args>
void set_inputs(Args& a, const char* op, const In& q, const In& k, const In& v, const In& beta,
                const OptIn& initial_state, const OptIn& cu_seqlens, std::optional<double> scale, bool l2,
                bool split_operands) {
  a.q = to_ref(q, op, "q"), a.k = to_ref(k, op, "k"), a.v = to_ref(v, op, "v"), a.beta = to_ref(beta, op, "beta");
  a.initial_state = to_ref(initial_state, op, "initial_state");
  a.cu_seqlens = to_ref(cu_seqlens, op, "cu_seqlens");
  a.scale = scale ? *scale : fastweight::kDeltanetDefaultScale;
  a.use_qk_l2norm_in_kernel = l2;
  a.split_operands = split_operands;
}

fastweight::DeltanetFwdArgs fwd_args(const In& q, const In& k, const In& v, const In& beta, const OptIn& initial_state,
                                     const OptIn& cu_seqlens, const Out& o, const OptOut& final_state,
                                     std::optional<double> scale, bool use_qk_l2norm_in_kernel, bool split_operands,
                                     const OptOut& wy_inverse) {
  const char* op = "deltanet_fwd";
  fastweight::DeltanetFwdArgs a;
  set_inputs(a, op, q, k, v, beta, initial_state, cu_seqlens, scale, use_qk_l2norm_in_kernel, split_operands);
  a.o = to_ref(o, op, "o");
  a.final_state = to_ref(final_state, op, "final_state");
  a.wy_inverse = to_ref(wy_inverse, op, "wy_inverse");
  return a;
}

std::size_t deltanet_fwd_workspace_size(const In& q, const In& k, const In& v, const In& beta,
                                        const OptIn& initial_state, const OptIn& cu_seqlens, const Out& o,
                                        const OptOut& final_state, std::optional<double> scale,
                                        bool use_qk_l2norm_in_kernel, bool split_operands, const OptOut& wy_inverse) {
  const auto a = fwd_args(q, k, v, beta, initial_state, cu_seqlens, o, final_state, scale, use_qk_l2norm_in_kernel,
                          split_operands, wy_inverse);
  nb::gil_scoped_release release;
  return fastweight::deltanet_fwd_workspace_size(a);
}

void deltanet_fwd(const In& q, const In& k, const In& v, const In& beta, const OptIn& initial_state,
                  const OptIn& cu_seqlens, const Out& o, const OptOut& final_state, std::optional<double> scale,
                  bool use_qk_l2norm_in_kernel, bool split_operands, const OptWorkspace& workspace,
                  std::uintptr_t stream, const OptOut& wy_inverse) {
  const auto a = fwd_args(q, k, v, beta, initial_state, cu_seqlens, o, final_state, scale, use_qk_l2norm_in_kernel,
                          split_operands, wy_inverse);
  const Workspace ws = to_workspace(workspace, a.q, "deltanet_fwd");
  nb::gil_scoped_release release;
  fastweight::deltanet_fwd(a, ws.data, ws.bytes, to_stream(stream));
}

fastweight::DeltanetBwdArgs bwd_args(const In& q, const In& k, const In& v, const In& beta, const OptIn& initial_state,
                                     const OptIn& cu_seqlens, const In& do_, const OptIn& dfinal_state,
                                     const OptOut& dq, const OptOut& dk, const OptOut& dv, const OptOut& dbeta,
                                     const OptOut& dinitial_state, std::optional<double> scale,
                                     bool use_qk_l2norm_in_kernel, bool split_operands, const OptIn& wy_inverse) {
  const char* op = "deltanet_bwd";
  fastweight::DeltanetBwdArgs a;
  set_inputs(a, op, q, k, v, beta, initial_state, cu_seqlens, scale, use_qk_l2norm_in_kernel, split_operands);
  a.do_ = to_ref(do_, op, "do_");
  a.dfinal_state = to_ref(dfinal_state, op, "dfinal_state");
  a.dq = to_ref(dq, op, "dq"), a.dk = to_ref(dk, op, "dk"), a.dv = to_ref(dv, op, "dv");
  a.dbeta = to_ref(dbeta, op, "dbeta");
  a.dinitial_state = to_ref(dinitial_state, op, "dinitial_state");
  a.wy_inverse = to_ref(wy_inverse, op, "wy_inverse");
  return a;
}

std::size_t deltanet_bwd_workspace_size(const In& q, const In& k, const In& v, const In& beta,
                                        const OptIn& initial_state, const OptIn& cu_seqlens, const In& do_,
                                        const OptIn& dfinal_state, const OptOut& dq, const OptOut& dk,
                                        const OptOut& dv, const OptOut& dbeta, const OptOut& dinitial_state,
                                        std::optional<double> scale, bool use_qk_l2norm_in_kernel, bool split_operands,
                                        const OptIn& wy_inverse) {
  const auto a = bwd_args(q, k, v, beta, initial_state, cu_seqlens, do_, dfinal_state, dq, dk, dv, dbeta,
                          dinitial_state, scale, use_qk_l2norm_in_kernel, split_operands, wy_inverse);
  nb::gil_scoped_release release;
  return fastweight::deltanet_bwd_workspace_size(a);
}

void deltanet_bwd(const In& q, const In& k, const In& v, const In& beta, const OptIn& initial_state,
                  const OptIn& cu_seqlens, const In& do_, const OptIn& dfinal_state, const OptOut& dq,
                  const OptOut& dk, const OptOut& dv, const OptOut& dbeta, const OptOut& dinitial_state,
                  std::optional<double> scale, bool use_qk_l2norm_in_kernel, bool split_operands,
                  const OptWorkspace& workspace, std::uintptr_t stream, const OptIn& wy_inverse) {
  const auto a = bwd_args(q, k, v, beta, initial_state, cu_seqlens, do_, dfinal_state, dq, dk, dv, dbeta,
                          dinitial_state, scale, use_qk_l2norm_in_kernel, split_operands, wy_inverse);
  const Workspace ws = to_workspace(workspace, a.q, "deltanet_bwd");
  nb::gil_scoped_release release;
  fastweight::deltanet_bwd(a, ws.data, ws.bytes, to_stream(stream));
}

void deltanet_step(const In& q, const In& k, const In& v, const In& beta, const In& state, const Out& o,
                   const Out& new_state, std::optional<double> scale, bool use_qk_l2norm_in_kernel,
                   std::uintptr_t stream) {
  const char* op = "deltanet_step";
  fastweight::DeltanetStepArgs a;
  a.q = to_ref(q, op, "q"), a.k = to_ref(k, op, "k"), a.v = to_ref(v, op, "v"), a.beta = to_ref(beta, op, "beta");
  a.state = to_ref(state, op, "state"), a.o = to_ref(o, op, "o"), a.new_state = to_ref(new_state, op, "new_state");
  a.scale = scale ? *scale : fastweight::kDeltanetDefaultScale;
  a.use_qk_l2norm_in_kernel = use_qk_l2norm_in_kernel;
  nb::gil_scoped_release release;
  fastweight::deltanet_step(a, to_stream(stream));
}

}  // namespace

void bind_deltanet(nb::module_& m) {
  const auto none = nb::none();
  m.def("deltanet_fwd", &deltanet_fwd, "q"_a, "k"_a, "v"_a, "beta"_a, "initial_state"_a.none() = none,
        "cu_seqlens"_a.none() = none, "o"_a, "final_state"_a.none() = none, "scale"_a.none() = none,
        "use_qk_l2norm_in_kernel"_a = false, "split_operands"_a = true, "workspace"_a.none() = none, "stream"_a = 0,
        "wy_inverse"_a.none() = none,
        "DeltaNet forward (FLA layout): writes o (B, T, H, V) and, when given, the final state (N, H, K, V). "
        "workspace: optional, deltanet_fwd_workspace_size bytes (the tensor-core pipeline; None: on-chip kernel). "
        "split_operands: the pipeline's fp32-sourced tensor-core operands as bf16 hi + lo (True) or bf16 only. "
        "wy_inverse: optional output (B, T, H, 64) of the pipeline (float32 with split_operands, else bfloat16), "
        "the WY inverse for the backward (fastweight/deltanet.h).");
  m.def("deltanet_fwd_workspace_size", &deltanet_fwd_workspace_size, "q"_a, "k"_a, "v"_a, "beta"_a,
        "initial_state"_a.none() = none, "cu_seqlens"_a.none() = none, "o"_a, "final_state"_a.none() = none,
        "scale"_a.none() = none, "use_qk_l2norm_in_kernel"_a = false, "split_operands"_a = true,
        "wy_inverse"_a.none() = none, "Bytes of the forward's optional workspace (0: none is used).");
  m.def("deltanet_bwd_workspace_size", &deltanet_bwd_workspace_size, "q"_a, "k"_a, "v"_a, "beta"_a,
        "initial_state"_a.none() = none, "cu_seqlens"_a.none() = none, "do_"_a, "dfinal_state"_a.none() = none,
        "dq"_a.none() = none, "dk"_a.none() = none, "dv"_a.none() = none, "dbeta"_a.none() = none,
        "dinitial_state"_a.none() = none, "scale"_a.none() = none, "use_qk_l2norm_in_kernel"_a = false,
        "split_operands"_a = true, "wy_inverse"_a.none() = none,
        "Bytes of workspace deltanet_bwd needs for these arguments (0 on the CPU).");
  m.def("deltanet_bwd", &deltanet_bwd, "q"_a, "k"_a, "v"_a, "beta"_a, "initial_state"_a.none() = none,
        "cu_seqlens"_a.none() = none, "do_"_a, "dfinal_state"_a.none() = none, "dq"_a.none() = none,
        "dk"_a.none() = none, "dv"_a.none() = none, "dbeta"_a.none() = none, "dinitial_state"_a.none() = none,
        "scale"_a.none() = none, "use_qk_l2norm_in_kernel"_a = false, "split_operands"_a = true,
        "workspace"_a.none() = none, "stream"_a = 0, "wy_inverse"_a.none() = none,
        "DeltaNet backward: the exact gradient; writes the given outputs (CUDA tensors need the workspace of "
        "deltanet_bwd_workspace_size). wy_inverse: optional, the forward's (read instead of formed again).");
  m.def("deltanet_step", &deltanet_step, "q"_a, "k"_a, "v"_a, "beta"_a, "state"_a, "o"_a, "new_state"_a,
        "scale"_a.none() = none, "use_qk_l2norm_in_kernel"_a = false, "stream"_a = 0,
        "One decoding step (q, k (B, H, K), v (B, H, V), beta (B, H)); new_state may be state (in place).");
}
