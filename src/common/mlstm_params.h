// mlstm_params.h: the plain-data description of one mLSTM call for the CUDA kernels (no CUDA, no
// torch). The API layer validates the user's TensorRefs and lowers them to this form
// (src/api/mlstm_api.cpp: lower_mlstm_*).
//
//   sequence tensors (B, NH, S, D): element (b, h, t, d) at p + b*s0 + h*s1 + t*s2 + d
//   gates (B, NH, S):               element (b, h, t)    at p + b*s0 + h*s1 + t
//   states c (B, NH, DQK, DV):      element (b, h, r, c) at p + b*s0 + h*s1 + r*s2 + c
//          n (B, NH, DQK):          element (b, h, r)    at p + b*s0 + h*s1 + r
//          m (B, NH[, 1]):          element (b, h)       at p + b*s0 + h*s1
// (strides in elements; every last dimension is contiguous, as validated).
#pragma once

#include <cstdint>

#include "fastweight/tensor.h"

#if defined(__CUDACC__)
#define FW_MLSTM_HD __host__ __device__ __forceinline__
#else
#define FW_MLSTM_HD inline
#endif

namespace fastweight::detail {

struct StridedView {
  void* p = nullptr;  // null: absent
  DType dtype = DType::f32;
  std::int64_t s0 = 0, s1 = 0, s2 = 0;
};

struct MlstmParams {
  std::int64_t B = 0, NH = 0, S = 0, DQK = 0, DV = 0;
  std::int64_t L = 64;  // chunk size
  float eps = 1e-6f;
  StridedView q, k, v, i, f, h;             // inputs; h the output
  StridedView c0, n0, m0;                   // optional initial states (fp32)
  StridedView c_last, n_last, m_last;       // optional final states (fp32)
  FW_MLSTM_HD std::int64_t chunks() const { return (S + L - 1) / L; }
};

// The backward: the forward's inputs plus the output gradient and the gradients to write (each
// optional; dc0/dn0/dm0 need the initial states; dc_last/dn_last/dm_last absent: 0).
struct MlstmBwdParams {
  MlstmParams f;
  StridedView dh, dc_last, dn_last, dm_last;
  StridedView dq, dk, dv, di, df, dc0, dn0, dm0;
  // The DV slabs' running sums (CUDA tensor-core path): fp32 (B, NH, S, DQK) contiguous partials that
  // the kernels writing dq / dk add their values to (partial + value, in that order) before storing.
  const float* dq_add = nullptr;
  const float* dk_add = nullptr;
};

// The parallel form (seed 000, no initial states). f: q, k, v, i, f, eps and h (the forward's output,
// the backward's saved input; L unused). n, m, b (B, NH, S) fp32: the forward writes those present;
// the backward reads m and b (b: the signed row sum, n = max(|b|, exp(-m))).
// Head norm (out.p or dout.p set: on): norm weight / bias and their gradients (NH, DV), element (h, c)
// at p + h*s0 + c, each optional; mean / rstd (B, NH, S) optional forward outputs.
struct MlstmParallelParams {
  MlstmParams f;
  StridedView n, m, b;
  StridedView dh, dq, dk, dv, di, df;  // backward only; the gradients are each optional
  StridedView out, nw, nb, nmean, nrstd, dout, dnw, dnb;
  float norm_eps = 1e-6f, weight_offset = 0.f;
};

// Workspace of the chunkwise forward: the states entering every chunk and the final one, fp32,
// contiguous: c (B*NH, NC+1, DQK, DV) | n (B*NH, NC+1, DQK) | m (B*NH, NC+1), each 256-byte aligned.
struct MlstmFwdWorkspace {
  std::int64_t c_floats = 0, n_floats = 0, m_floats = 0;
  static std::int64_t align(std::int64_t floats) { return (floats + 63) / 64 * 64; }
  explicit MlstmFwdWorkspace(const MlstmParams& p) {
    const std::int64_t heads = p.B * p.NH, ns = p.chunks() + 1;
    c_floats = align(heads * ns * p.DQK * p.DV);
    n_floats = align(heads * ns * p.DQK);
    m_floats = align(heads * ns);
  }
  std::int64_t bytes() const { return 4 * (c_floats + n_floats + m_floats); }
};

}  // namespace fastweight::detail
