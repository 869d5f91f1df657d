// fastweight/mlstm.h: the mLSTM (xLSTM's matrix LSTM; "vLSTM" in the seeds), shared/MATH.md §2.
//
//   q, k (B, NH, S, DQK)   v (B, NH, S, DV)   i, f (B, NH, S): input / forget gate preactivations
//   h (B, NH, S, DV)
//   states: c (B, NH, DQK, DV)   n (B, NH, DQK)   m (B, NH) or (B, NH, 1)
// Conventions are NX-AI mlstm_kernels' (so states are interchangeable): q is scaled by 1/sqrt(DQK),
// lf = logsigmoid(f), eps = 1e-6 by default, zero initial states (m = 0) when none are given.
// The forward is computed chunk by chunk (chunk_size: a power of two in [16, 256]; any S, the last
// chunk may be short); it equals the recurrent and parallel forms (MATH.md).
// The backward is the exact gradient of the forward, the normaliser's included (mlstm_kernels drops
// it); it recomputes what it needs from the inputs.
//
// Dtypes: q, k, v, h, dh and their gradients share one IO dtype (float32, float16, bfloat16; also
// float64 on the CPU); i, f (and di, df) have that dtype or float32; states and their gradients are
// float32 (float64 on the CPU). Every tensor needs a contiguous last dimension; other strides are
// free. Optional tensors are absent TensorRefs; the three states come all together or not at all.
// Every argument is validated before anything is written: bad input throws ArgumentError naming
// the op and the argument. CPU tensors run the float64 reference (src/reference/mlstm_ref.h); CUDA
// tensors run the kernels of src/cuda/mlstm (forward, backward, step, parallel form, decay matrix).
#pragma once

#include <cstddef>
#include <cstdint>

#include "fastweight/error.h"
#include "fastweight/tensor.h"

namespace fastweight {

// Outputs share memory with no input and no other output (an ArgumentError naming both, before anything
// is written), except a decoding step's new states, which may be the very same views as its states.

struct MlstmFwdArgs {
  TensorRef q, k, v, i, f;
  TensorRef c_initial, n_initial, m_initial;  // optional (all or none)
  TensorRef h;                                // output
  TensorRef c_last, n_last, m_last;           // optional outputs (all or none): the final states
  double eps = 1e-6;
  std::int64_t chunk_size = 64;
};

struct MlstmBwdArgs {
  TensorRef q, k, v, i, f;
  TensorRef c_initial, n_initial, m_initial;     // as given to the forward
  TensorRef dh;                                  // (B, NH, S, DV)
  TensorRef dc_last, dn_last, dm_last;           // optional: gradients of the final states (absent: 0)
  TensorRef dq, dk, dv, di, df;                  // outputs, each optional
  TensorRef dc_initial, dn_initial, dm_initial;  // optional outputs (need the initial states)
  double eps = 1e-6;
  std::int64_t chunk_size = 64;
};

// One decoding step: q, k (B, NH, DQK), v (B, NH, DV), i, f (B, NH) or (B, NH, 1); the states
// c, n, m are read, and c_new, n_new, m_new written; they may be the same views (in place), else apart.
// h (B, NH, DV). No allocation, so it can be captured in a CUDA graph.
struct MlstmStepArgs {
  TensorRef q, k, v, i, f;
  TensorRef c, n, m;
  TensorRef h;
  TensorRef c_new, n_new, m_new;
  double eps = 1e-6;
};

// The parallel form of seed 000 (no initial states): h (B, NH, S, DV), equal to mlstm_fwd's h when
// eps = 0 (with eps > 0 the two forms' stabilisers differ, and so does eps's weight), and per position
// the normaliser n and stabiliser m (B, NH, S) of the parallel form: m_t = max_{s <= t} D[t, s] (D: the decay matrix below), b_t = sum_s C[t, s],
// n_t = max(|b_t|, exp(-m_t)), h_t = sum_s C[t, s] v_s / (n_t + eps), C = (q k^T / sqrt(DQK)) exp(D - m).
// n, m and b (the signed row sum b_t, so n_t = max(|b_t|, exp(-m_t))) are optional outputs, float32
// (float64 on the CPU). The backward takes the forward's m and b back, as FlashAttention takes its
// log-sum-exp: the CUDA backward needs them (it recomputes C tile by tile, but the exact normaliser
// gradient needs the sign and branch of b before the tiles), and h with the head norm; the CPU
// backward recomputes everything and ignores them. CUDA kernels: src/cuda/mlstm/mlstm_parallel.cu (tiled, never an S x S matrix in
// global memory; fp32 compute for every IO dtype), with a caller workspace.
//
// Head norm (seed 000's fusion), optional: with `out` given, the forward also writes out = headnorm(h),
// each (b, head, t) row of DV normalised on its own (MATH.md §1): mean, population variance, rstd =
// 1 / sqrt(var + norm_eps), out = (h - mean) rstd (weight_offset + norm_weight[head]) + norm_bias[head]
// (norm_weight, norm_bias (NH, DV) optional, IO dtype or float32; norm_mean, norm_rstd (B, NH, S)
// optional float32 outputs). The backward then takes dout instead of dh (exactly one of the two) and
// the same norm arguments, and may write dnorm_weight, dnorm_bias (NH, DV) (deterministic sums over
// b and t). On CUDA the norm's backward runs inside the backward's per-row pass; the forward's norm
// is a per-row pass right after the tile kernel (it needs whole DV rows, which the tiles split).
struct MlstmParallelFwdArgs {
  TensorRef q, k, v, i, f;
  TensorRef h;        // output
  TensorRef n, m, b;  // optional outputs (B, NH, S)
  double eps = 1e-6;
  TensorRef out, norm_weight, norm_bias, norm_mean, norm_rstd;  // head norm (out given: on)
  double norm_eps = 1e-6, weight_offset = 0.0;
};
struct MlstmParallelBwdArgs {
  TensorRef q, k, v, i, f;
  TensorRef h, n, m, b;          // the forward's outputs: CUDA needs m, b (and h with the head norm); n is implied
  TensorRef dh;                  // (B, NH, S, DV); or dout with the head norm
  TensorRef dq, dk, dv, di, df;  // outputs, each optional
  double eps = 1e-6;
  TensorRef dout, norm_weight, norm_bias, dnorm_weight, dnorm_bias;  // head norm (dout given: on)
  double norm_eps = 1e-6, weight_offset = 0.0;
};

// The log-space decay matrix of seed 001: D[t, s] = F_t - F_s + i_s for s <= t, -inf above the
// diagonal, F_t = lf_1 + ... + lf_t. i, f (B, NH, S); D (B, NH, S, S) float32 or i's dtype.
struct MlstmDecayMatrixFwdArgs {
  TensorRef i, f, D;
};
// Backward: dD (B, NH, S, S) (entries above the diagonal are ignored), f as in the forward;
// di, df (B, NH, S) optional outputs.
struct MlstmDecayMatrixBwdArgs {
  TensorRef f, dD, di, df;
};

// Ops that need scratch memory on the GPU take it from the caller (CUTLASS style):
// `<op>_workspace_size(args)` bytes (0 on the CPU), then `<op>(args, workspace, bytes, stream)`. The
// forward's workspace holds the fp32 state entering every chunk: B*NH*(S/L+1)*(DQK*DV+DQK+1) floats.
// The two-argument forms are for calls that need no workspace (CPU tensors).
std::size_t mlstm_fwd_workspace_size(const MlstmFwdArgs& args);
void mlstm_fwd(const MlstmFwdArgs& args, void* workspace, std::size_t workspace_bytes, Stream stream = nullptr);
void mlstm_fwd(const MlstmFwdArgs& args, Stream stream = nullptr);
std::size_t mlstm_bwd_workspace_size(const MlstmBwdArgs& args);
void mlstm_bwd(const MlstmBwdArgs& args, void* workspace, std::size_t workspace_bytes, Stream stream = nullptr);
void mlstm_bwd(const MlstmBwdArgs& args, Stream stream = nullptr);
void mlstm_step(const MlstmStepArgs& args, Stream stream = nullptr);
std::size_t mlstm_parallel_fwd_workspace_size(const MlstmParallelFwdArgs& args);
void mlstm_parallel_fwd(const MlstmParallelFwdArgs& args, void* workspace, std::size_t workspace_bytes,
                        Stream stream = nullptr);
void mlstm_parallel_fwd(const MlstmParallelFwdArgs& args, Stream stream = nullptr);
std::size_t mlstm_parallel_bwd_workspace_size(const MlstmParallelBwdArgs& args);
void mlstm_parallel_bwd(const MlstmParallelBwdArgs& args, void* workspace, std::size_t workspace_bytes,
                        Stream stream = nullptr);
void mlstm_parallel_bwd(const MlstmParallelBwdArgs& args, Stream stream = nullptr);
void mlstm_decay_matrix_fwd(const MlstmDecayMatrixFwdArgs& args, Stream stream = nullptr);
std::size_t mlstm_decay_matrix_bwd_workspace_size(const MlstmDecayMatrixBwdArgs& args);
void mlstm_decay_matrix_bwd(const MlstmDecayMatrixBwdArgs& args, void* workspace, std::size_t workspace_bytes,
                            Stream stream = nullptr);
void mlstm_decay_matrix_bwd(const MlstmDecayMatrixBwdArgs& args, Stream stream = nullptr);

}  // namespace fastweight
