// fastweight/norm.h: the LayerNorm family, forward (training: also fp32 mean/rstd) and backward.
//
// Every op normalises rows of length N = x.shape[-1] and is defined in shared/MATH.md §1:
//   layernorm     x (..., N),       weight/bias (N,)                  y = xhat * (offset + w) + b
//   rmsnorm       x (..., N),       weight (N,)                        y = x * rstd * (offset + w)
//   headnorm      x (..., NH, DH),  weight/bias (NH, DH)               per head, y = xhat * (offset + w) + b
//   adalayernorm  x (B, S, D),      scale/shift (B, 1, D)              y = xhat * scale[b] + shift[b]
// An absent weight means a scale of 1 (weight_offset is then ignored); an absent bias means 0.
// IO dtypes: float32, float16, bfloat16 (CUDA and CPU), float64 (CPU); weight/bias/scale/shift
// have the dtype of x or float32; statistics are float32 with one element per row (contiguous,
// e.g. shape x.shape[:-1]). Compute is fp32 on CUDA, fp64 in the CPU reference.
//
// Life cycle. Forward: `<op>_fwd(args, stream)`. Backward needs a scratch buffer for the
// deterministic weight-gradient partials: `<op>_bwd_workspace_size(args)` bytes (0 when no weight
// gradient is asked for, or on the CPU), then `<op>_bwd(args, workspace, workspace_bytes, stream)`.
// `<op>_{fwd,bwd}_can_implement(args, &why)` validates without running.
// All ops validate every argument before anything is launched or written: bad input throws
// fastweight::ArgumentError naming the op and the argument, and leaves every output untouched.
// Tensors on the CPU run the reference; tensors on a GPU run there on `stream`, on their device.
#pragma once

#include <cstddef>
#include <string>

#include "fastweight/error.h"
#include "fastweight/tensor.h"

namespace fastweight {

// Outputs (y, mean, rstd; dx and the parameter gradients) share memory with no input and no other output:
// an ArgumentError naming both, before anything is written.

// ---- layernorm ----------------------------------------------------------------------------------
struct LayerNormFwdArgs {
  TensorRef x;       // (..., N)
  TensorRef weight;  // (N,) or absent
  TensorRef bias;    // (N,) or absent
  TensorRef y;       // like x (its own strides allowed)
  TensorRef mean;    // fp32, rows elements, or absent (inference)
  TensorRef rstd;    // fp32, rows elements, or absent (inference)
  double eps = 1e-5;
  double weight_offset = 0.0;
};
struct LayerNormBwdArgs {
  TensorRef dy, x, weight;  // weight: as in forward (absent: scale 1)
  TensorRef mean, rstd;     // saved by the forward
  TensorRef dx;             // like x
  TensorRef dweight, dbias; // (N,), dtype of weight; each absent when not wanted
  double weight_offset = 0.0;
};

// ---- rmsnorm ------------------------------------------------------------------------------------
struct RMSNormFwdArgs {
  TensorRef x, weight, y, rstd;
  double eps = 1e-6;
  double weight_offset = 0.0;
};
struct RMSNormBwdArgs {
  TensorRef dy, x, weight, rstd, dx, dweight;
  double weight_offset = 0.0;
};

// ---- headnorm (x (..., NH, DH), weight/bias (NH, DH)) -------------------------------------------
struct HeadNormFwdArgs {
  TensorRef x, weight, bias, y, mean, rstd;
  double eps = 1e-6;
  double weight_offset = 0.0;
};
struct HeadNormBwdArgs {
  TensorRef dy, x, weight, mean, rstd, dx, dweight, dbias;
  double weight_offset = 0.0;
};

// ---- adalayernorm (x (B, S, D), scale/shift (B, 1, D)) ------------------------------------------
struct AdaLayerNormFwdArgs {
  TensorRef x, scale, shift, y, mean, rstd;  // shift may be absent
  double eps = 1e-5;
};
struct AdaLayerNormBwdArgs {
  TensorRef dy, x, scale, mean, rstd, dx, dscale, dshift;
};

#define FW_DECLARE_NORM_OP(op, Fwd, Bwd)                                                       \
  void op##_fwd(const Fwd& args, Stream stream = nullptr);                                      \
  bool op##_fwd_can_implement(const Fwd& args, std::string* why = nullptr);                     \
  std::size_t op##_bwd_workspace_size(const Bwd& args);                                         \
  void op##_bwd(const Bwd& args, void* workspace, std::size_t workspace_bytes,                  \
                Stream stream = nullptr);                                                       \
  bool op##_bwd_can_implement(const Bwd& args, std::string* why = nullptr);

FW_DECLARE_NORM_OP(layernorm, LayerNormFwdArgs, LayerNormBwdArgs)
FW_DECLARE_NORM_OP(rmsnorm, RMSNormFwdArgs, RMSNormBwdArgs)
FW_DECLARE_NORM_OP(headnorm, HeadNormFwdArgs, HeadNormBwdArgs)
FW_DECLARE_NORM_OP(adalayernorm, AdaLayerNormFwdArgs, AdaLayerNormBwdArgs)
#undef FW_DECLARE_NORM_OP

}  // namespace fastweight
