// fastweight/deltanet.h: DeltaNet (the delta rule), shared/MATH.md §3. Layout and conventions are
// flash-linear-attention's (FLA), so tensors and states are interchangeable with it:
//
//   q, k (B, T, H, K)   v (B, T, H, V)   beta (B, T, H)   o (B, T, H, V)
//   initial_state, final_state (N, H, K, V), S[a][j] = S(key a, value j)
//   cu_seqlens (N+1), int32 or int64 (optional)
// Per (sequence, head):
//   S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T,   o_t = scale S_t^T q_t,
//   S_0 = initial_state (zero when absent),   final_state = S_{length}
// with q, k replaced by x / sqrt(|x|^2 + 1e-6) per row when use_qk_l2norm_in_kernel is set.
// scale: NaN (the default) means K^-0.5, FLA's default; any finite value is used as given.
//
// Sequences: without cu_seqlens there are N = B sequences of length T. With cu_seqlens (FLA's and
// FlashAttention's variable-length batches) B must be 1 and sequence n is positions
// [cu_seqlens[n], cu_seqlens[n+1]) of the packed T axis: N = len(cu_seqlens) - 1, offsets
// non-decreasing from 0 to T (empty sequences allowed: their final state is their initial state).
// The offsets are checked on CPU tensors. On a CUDA device they are not read by the host (that would
// synchronise the stream and break CUDA-graph capture): the kernels clamp them into [0, T], so
// invalid device offsets give wrong results but never touch memory outside the tensors and the
// workspace. Python's delta_rule checks device offsets on the host in eager mode.
//
// Dtypes: q, k, v, o and dq, dk, dv, do_ share one IO dtype (float32, float16, bfloat16; also
// float64 on the CPU); beta and dbeta have that dtype or float32; states and their gradients are
// float32 (float64 on the CPU). Every tensor needs a contiguous last dimension; other strides are
// free (cu_seqlens: contiguous). Optional tensors are absent TensorRefs. dinitial_state needs
// initial_state (the gradient of an absent state is not defined); dfinal_state is optional
// (absent: 0) whether or not the forward wrote a final state.
// Every argument is validated before anything is written: bad input throws ArgumentError naming
// the op and the argument. CPU tensors run the float64 chunkwise reference (chunk size 64, not
// exposed: the result does not depend on it; src/reference/deltanet_ref.h). CUDA tensors run the
// CUDA kernels (src/cuda/deltanet: chunks of 64, fp32 accumulation, fp32 states; K <= 256,
// ArgumentError beyond). The forward takes an optional workspace of deltanet_fwd_workspace_size(args)
// bytes (bf16 with K <= 128: the fast tensor-core pipeline, which keeps the state entering every
// chunk; 0 otherwise); without one (the two-argument form) a single kernel runs with its state on
// chip. The backward needs deltanet_bwd_workspace_size(args) bytes (fp32 chunk states, their
// gradients and per-row intermediates; 0 on the CPU), passed to the four-argument deltanet_bwd. The
// decoding step needs none.
// split_operands (forward with a workspace, backward; bf16 with K <= 128 on tensor cores): the
// products whose operands come from fp32 values (states, the WY factors, their gradients) take them
// as bf16 hi + lo pairs, ~16 bits (true, the default: o 1.9e-3 from the float64 loop, final state
// 5e-6, at T = 8192 with the L2 norm), or as bf16 alone (false: FLA's precision, o 3.6e-3, final state
// 3e-3, half those products and half the state workspace). Ignored elsewhere (CPU, fp16 / fp32, K > 128,
// the workspace-free forward): those paths keep fp32 or hi + lo.
// wy_inverse (optional; CUDA tensors with bf16 q, k, v and K <= 128, the forward with a workspace:
// the tensor-core pipeline): the per-chunk inverse T = (I + strict_lower(K^ K^T) diag(beta))^-1 of the
// WY form (K^ the chunk's keys after the L2 norm), as FLA's chunk_delta_rule saves its A. An output of
// the forward, an input of the backward: given the forward's, the backward reads it instead of forming
// it again (its recompute's inverse: ~0.25 ms at (1, 32768, 16, 128)); the gradients are the same bits
// either way. Shape (B, T, H, 64), contiguous, 16-byte aligned; float32 with split_operands, else
// bfloat16 (the value the products use: rounded to bf16 there). Row (b, t, h) holds column i of the
// chunk's T, i = t's position in its 64-row chunk (chunks start at each sequence's start): entry j is
// T[j][i] (zero past the chunk's rows). It must come from a forward over the same q, k, v, beta,
// cu_seqlens and options; the backward cannot tell otherwise.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>

#include "fastweight/error.h"
#include "fastweight/tensor.h"

namespace fastweight {

// scale = kDeltanetDefaultScale: K^-0.5.
inline constexpr double kDeltanetDefaultScale = std::numeric_limits<double>::quiet_NaN();

// Outputs share memory with no input and no other output (an ArgumentError naming both, before anything
// is written), except the step's new_state, which may be the very same view as its state.
struct DeltanetFwdArgs {
  TensorRef q, k, v, beta;
  TensorRef initial_state;  // optional (N, H, K, V)
  TensorRef cu_seqlens;     // optional (N+1), B == 1
  TensorRef o;              // output (B, T, H, V)
  TensorRef final_state;    // optional output (N, H, K, V)
  double scale = kDeltanetDefaultScale;
  bool use_qk_l2norm_in_kernel = false;
  bool split_operands = true;
  TensorRef wy_inverse;  // optional output (B, T, H, 64), see above (last: aggregate initialisers keep working)
};

struct DeltanetBwdArgs {
  TensorRef q, k, v, beta;       // as given to the forward
  TensorRef initial_state;       // as given to the forward (optional)
  TensorRef cu_seqlens;          // as given to the forward (optional)
  TensorRef do_;                 // dL/do (B, T, H, V)
  TensorRef dfinal_state;        // optional dL/d final_state (N, H, K, V) (absent: 0)
  TensorRef dq, dk, dv, dbeta;   // outputs, each optional
  TensorRef dinitial_state;      // optional output (N, H, K, V); needs initial_state
  double scale = kDeltanetDefaultScale;
  bool use_qk_l2norm_in_kernel = false;
  bool split_operands = true;
  TensorRef wy_inverse;  // optional: the forward's (B, T, H, 64), see above
};

// One decoding step for every (b, head): q, k (B, H, K), v (B, H, V), beta (B, H); the state
// (B, H, K, V) is read and new_state written (the same view: in place; else apart); o (B, H, V).
// The same function as deltanet_fwd with T = 1 and the state as initial / final state.
struct DeltanetStepArgs {
  TensorRef q, k, v, beta;
  TensorRef state;      // (B, H, K, V)
  TensorRef o;          // output (B, H, V)
  TensorRef new_state;  // output (B, H, K, V), may be `state`
  double scale = kDeltanetDefaultScale;
  bool use_qk_l2norm_in_kernel = false;
};

// The forward's optional scratch: `deltanet_fwd_workspace_size(args)` bytes (0: none is used), then
// `deltanet_fwd(args, workspace, bytes, stream)`; a null workspace means the two-argument form.
std::size_t deltanet_fwd_workspace_size(const DeltanetFwdArgs& args);
void deltanet_fwd(const DeltanetFwdArgs& args, void* workspace, std::size_t workspace_bytes, Stream stream = nullptr);
void deltanet_fwd(const DeltanetFwdArgs& args, Stream stream = nullptr);
// The backward's scratch: `deltanet_bwd_workspace_size(args)` bytes (0 for CPU tensors), then
// `deltanet_bwd(args, workspace, bytes, stream)`. The two-argument form passes no workspace: it is for
// CPU tensors (on CUDA tensors it throws ArgumentError naming the workspace).
std::size_t deltanet_bwd_workspace_size(const DeltanetBwdArgs& args);
void deltanet_bwd(const DeltanetBwdArgs& args, void* workspace, std::size_t workspace_bytes, Stream stream = nullptr);
void deltanet_bwd(const DeltanetBwdArgs& args, Stream stream = nullptr);
void deltanet_step(const DeltanetStepArgs& args, Stream stream = nullptr);

}  // namespace fastweight
