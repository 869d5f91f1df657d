// mlstm_ref.h: the CPU reference of the mLSTM (MATH.md §2): the definition the CUDA kernels are
// checked against. float64 throughout, plain loops, one (batch, head) after the other.
//
// Layouts (contiguous, row-major, outermost first):
//   q, k (B,NH,S,DQK)   v, h, out (B,NH,S,DV)   i, f, n, m (B,NH,S)   D (B,NH,S,S)
//   states: c (B,NH,DQK,DV)   n (B,NH,DQK)   m (B,NH)
// Conventions: q is scaled by 1/sqrt(DQK) inside, lf = logsigmoid(f), eps defaults to 1e-6.
// Every backward recomputes what it needs from the inputs (the reference favours clarity).
// See mlstm_ref.cpp for the gradient conventions at the non-smooth points (max, abs).
#pragma once

#include <cstdint>

namespace fastweight::detail {

inline constexpr double kMlstmEps = 1e-6;

struct MlstmShape {
  std::int64_t B = 1, NH = 1, S = 0, DQK = 0, DV = 0;
  std::int64_t heads() const { return B * NH; }
};

struct MlstmInputs {
  const double* q = nullptr;  // (B,NH,S,DQK)
  const double* k = nullptr;  // (B,NH,S,DQK)
  const double* v = nullptr;  // (B,NH,S,DV)
  const double* i = nullptr;  // (B,NH,S) input-gate preactivations
  const double* f = nullptr;  // (B,NH,S) forget-gate preactivations
};

struct MlstmGrads {
  double* dq = nullptr;  // each optional (nullptr: not written)
  double* dk = nullptr;
  double* dv = nullptr;
  double* di = nullptr;
  double* df = nullptr;
};

// Recurrent states; any pointer may be null. As input: null means zero (c, n) or 0 (m).
struct MlstmState {
  double* c = nullptr;  // (B,NH,DQK,DV)
  double* n = nullptr;  // (B,NH,DQK)
  double* m = nullptr;  // (B,NH)
};
struct MlstmConstState {
  const double* c = nullptr;
  const double* n = nullptr;
  const double* m = nullptr;
};

// Numerically stable scalar helpers (exposed for tests and kernels' host code).
double mlstm_logsigmoid(double x);

// 1. Decay matrix: D[t,s] = F_t - F_s + i_s (s <= t), -inf (s > t), F_t = lf_1 + ... + lf_t.
//    Shape uses B, NH, S only.
void mlstm_decay_matrix_fwd(const MlstmShape& sh, const double* i, const double* f, double* D);
// dD (B,NH,S,S): entries above the diagonal are ignored (the -inf constants carry no gradient).
// f is needed for d logsigmoid(f)/df. di, df (B,NH,S); either may be null.
void mlstm_decay_matrix_bwd(const MlstmShape& sh, const double* f, const double* dD, double* di, double* df);

// 2. Parallel form (no initial state). h (B,NH,S,DV); n, m and b (the signed row sum, n =
//    max(|b|, exp(-m))) (B,NH,S) optional (nullptr).
void mlstm_parallel_fwd(const MlstmShape& sh, const MlstmInputs& in, double eps, double* h, double* n,
                        double* m, double* b = nullptr);
// The exact gradient of mlstm_parallel_fwd for loss L with dL/dh = dh (recomputes the forward).
void mlstm_parallel_bwd(const MlstmShape& sh, const MlstmInputs& in, double eps, const double* dh,
                        const MlstmGrads& g);

// 3. Recurrent form. init: optional initial states (null pointers are zero states, m0 = 0);
//    last: optional outputs for the final states (C_S, n_S, m_S). h (B,NH,S,DV).
void mlstm_recurrent_fwd(const MlstmShape& sh, const MlstmInputs& in, double eps, const MlstmConstState& init,
                         double* h, const MlstmState& last);
// One recurrent step for all (B,NH) heads. q, k (B,NH,DQK), v (B,NH,DV), i, f (B,NH); the states
// c, n, m are read and overwritten in place (all three required); h (B,NH,DV). sh.S is ignored.
void mlstm_step(const MlstmShape& sh, const double* q, const double* k, const double* v, const double* i,
                const double* f, double eps, const MlstmState& state, double* h);

// Backward of mlstm_recurrent_fwd (BPTT, the exact gradient; recomputes the forward): dh (B,NH,S,DV)
// and optional gradients dlast of the final states (null: 0); writes g (dq..df, each optional) and
// dinit (optional dc0, dn0, dm0 of the initial states). Non-smooth points as in the parallel form:
// m_t = max(lf_t + m_{t-1}, i_t) and n's max split ties in halves (torch.maximum), sign(0) = 0.
void mlstm_recurrent_bwd(const MlstmShape& sh, const MlstmInputs& in, double eps, const MlstmConstState& init,
                         const double* dh, const MlstmConstState& dlast, const MlstmGrads& g,
                         const MlstmState& dinit);

// 4. Chunkwise form (chunk size L >= 1; the last chunk may be shorter): inside a chunk the parallel
//    form against the incoming state, between chunks the recurrent form on the states. Same
//    arguments and results as mlstm_recurrent_fwd (equal to it in exact arithmetic, for any eps).
void mlstm_chunkwise_fwd(const MlstmShape& sh, const MlstmInputs& in, double eps, std::int64_t L,
                         const MlstmConstState& init, double* h, const MlstmState& last);
// Backward of mlstm_chunkwise_fwd, computed chunk by chunk (the blueprint of the CUDA chunkwise
// backward): the states at the chunk boundaries are recomputed and kept, then a reverse pass over
// the chunks carries (dC, dn, dm) from chunk to chunk and differentiates each chunk's parallel form
// against its incoming state. Arguments as mlstm_recurrent_bwd; equal to it away from ties of the
// stabiliser's max (the tie rule is documented in mlstm_ref.cpp).
void mlstm_chunkwise_bwd(const MlstmShape& sh, const MlstmInputs& in, double eps, std::int64_t L,
                         const MlstmConstState& init, const double* dh, const MlstmConstState& dlast,
                         const MlstmGrads& g, const MlstmState& dinit);

// 5. Head-norm fusion (seed 000): out = headnorm(h), h the chunkwise mLSTM output (chunk size L,
//    optional initial / last states as in mlstm_chunkwise_fwd). Each (b, head, t) row of DV is
//    normalised on its own (MATH.md §1): mean, population variance, rstd = 1/sqrt(var + eps),
//    out = (h - mean) rstd (weight_offset + weight[head]) + bias[head]; scale 1 without weight.
struct MlstmHeadNorm {
  const double* weight = nullptr;  // (NH,DV) optional
  const double* bias = nullptr;    // (NH,DV) optional
  double eps = kMlstmEps;          // of the norm (not the mLSTM's eps)
  double weight_offset = 0.0;      // xLSTM: 1 (with weight initialised to 0)
};
struct MlstmHeadNormGrads {
  double* dweight = nullptr;  // (NH,DV) optional: sum over (b, t) of dout * xhat
  double* dbias = nullptr;    // (NH,DV) optional: sum over (b, t) of dout
};
// out (B,NH,S,DV); optional mean, rstd (B,NH,S) of the norm; last as in mlstm_chunkwise_fwd.
void mlstm_headnorm_fwd(const MlstmShape& sh, const MlstmInputs& in, double eps, std::int64_t L,
                        const MlstmConstState& init, const MlstmHeadNorm& norm, double* out, double* mean,
                        double* rstd, const MlstmState& last);
// Exact gradient of mlstm_headnorm_fwd for dL/dout = dout (B,NH,S,DV) and optional dlast (null: 0):
// writes g (dq..df), dinit (dc0, dn0, dm0) and gn (dweight, dbias), each optional. The normaliser
// path is kept (the norm makes it vanish only up to the norm's eps; the reference is exact).
void mlstm_headnorm_bwd(const MlstmShape& sh, const MlstmInputs& in, double eps, std::int64_t L,
                        const MlstmConstState& init, const MlstmHeadNorm& norm, const double* dout,
                        const MlstmConstState& dlast, const MlstmGrads& g, const MlstmState& dinit,
                        const MlstmHeadNormGrads& gn);

// The head norm alone: out (B,NH,S,DV) and optional mean, rstd (B,NH,S) of h (B,NH,S,DV), row by row.
void mlstm_headnorm_rows_fwd(const MlstmShape& sh, const double* h, const MlstmHeadNorm& norm, double* out,
                             double* mean, double* rstd);
// The parallel form with the head norm: out = headnorm(h), h from mlstm_parallel_fwd; optional mean,
// rstd (B,NH,S) and the pre-norm h (B,NH,S,DV). The backward is exact (normaliser path kept).
void mlstm_parallel_headnorm_fwd(const MlstmShape& sh, const MlstmInputs& in, double eps, const MlstmHeadNorm& norm,
                                 double* out, double* mean, double* rstd, double* h = nullptr);
void mlstm_parallel_headnorm_bwd(const MlstmShape& sh, const MlstmInputs& in, double eps, const MlstmHeadNorm& norm,
                                 const double* dout, const MlstmGrads& g, const MlstmHeadNormGrads& gn);

}  // namespace fastweight::detail
