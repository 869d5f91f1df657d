// deltanet_ref.h: the CPU reference of DeltaNet (MATH.md §3): the definition the CUDA kernels are
// checked against. float64 throughout, plain loops, one (sequence, head) after the other.
//
// Layouts (contiguous, row-major, outermost first; FLA's [B, T, H, D], "head last"):
//   q, k, w (B,T,H,K)   v, o, u (B,T,H,V)   beta (B,T,H)
//   states: initial / final state and their gradients (N,H,K,V), S[a][j] = S(key a, value j)
//   cu_seqlens (N+1), int64
// Sequences: without cu_seqlens there are N = B sequences of length T. With cu_seqlens (FLA's
// variable-length batches, as FlashAttention's API) B must be 1 and sequence n is positions
// [cu[n], cu[n+1]) of the packed T axis, with its own initial and final state; 0 = cu[0] <= cu[1]
// <= ... <= cu[N] = T (zero-length sequences allowed: final state = initial state).
//
// Per (sequence, head), with q, k replaced by q / sqrt(|q|^2 + 1e-6), k / sqrt(|k|^2 + 1e-6) when
// use_qk_l2norm_in_kernel is set (FLA's in-kernel L2 norm; see deltanet_ref.cpp):
//   S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
//   o_t = scale S_t^T q_t,   S_0 = initial state (zero when null),   final state = S_{length}
// scale defaults to K^-0.5. Every backward is the exact gradient of its forward for the loss with
// dL/do = do and dL/d(final state) = dht (null: 0); it writes dq, dk, dv, dbeta (each optional,
// taken through the L2 norm when it is on) and dh0 = dL/d(initial state) (optional). Every backward
// recomputes what it needs from the inputs (the reference favours clarity over speed).
// Preconditions (not checked: the API layer validates): sizes >= 0, K, V >= 1, cu_seqlens as above,
// chunk size L >= 1 (a smaller L is taken as 1 rather than looping forever).
#pragma once

#include <cstdint>
#include <optional>

namespace fastweight::detail {

// FLA's l2norm eps: x / sqrt(sum x^2 + eps) (fla/modules/l2norm.py, default of l2norm_fwd).
inline constexpr double kDeltanetL2Eps = 1e-6;

struct DeltanetShape {
  std::int64_t B = 1, T = 0, H = 1, K = 0, V = 0;
  const std::int64_t* cu_seqlens = nullptr;  // (N+1) offsets into T, B == 1; null: N = B sequences
  std::int64_t N = 0;                        // number of sequences when cu_seqlens is set
  std::int64_t seqs() const { return cu_seqlens ? N : B; }
};

struct DeltanetOptions {
  std::optional<double> scale;           // of the output; none: K^-0.5 (FLA's default)
  bool use_qk_l2norm_in_kernel = false;  // normalise each (b,t,h) row of q and k first
};

struct DeltanetInputs {
  const double* q = nullptr;     // (B,T,H,K)
  const double* k = nullptr;     // (B,T,H,K)
  const double* v = nullptr;     // (B,T,H,V)
  const double* beta = nullptr;  // (B,T,H)
};

struct DeltanetGrads {
  double* dq = nullptr;     // (B,T,H,K), each optional (nullptr: not written)
  double* dk = nullptr;     // (B,T,H,K)
  double* dv = nullptr;     // (B,T,H,V)
  double* dbeta = nullptr;  // (B,T,H)
};

// The scale actually used: opt.scale or K^-0.5.
double deltanet_scale(const DeltanetShape& sh, const DeltanetOptions& opt);

// 1. Loop (recurrent) form: the recurrence above, one step after the other.
//    h0 (N,H,K,V) optional (null: zero); o (B,T,H,V) and ht (N,H,K,V) (the final states), each
//    optional (null: not written).
void deltanet_recurrent_fwd(const DeltanetShape& sh, const DeltanetInputs& in, const DeltanetOptions& opt,
                            const double* h0, double* o, double* ht);
// BPTT over the stored states. do_ (B,T,H,V); dht (N,H,K,V) optional (null: 0); dh0 (N,H,K,V) optional.
void deltanet_recurrent_bwd(const DeltanetShape& sh, const DeltanetInputs& in, const DeltanetOptions& opt,
                            const double* h0, const double* do_, const double* dht, const DeltanetGrads& g,
                            double* dh0);

// 2. WY representation (Bischof & Van Loan; Yang et al. 2024 eq. 5-6; FLA's prepare_wy_repr), the
//    building block of the chunk forms: per chunk w = A diag(beta) k, u = A diag(beta) v with
//    A = (I + diag(beta) strict_lower(k k^T))^-1, here by forward substitution. Positions are cut
//    into chunks of L (restarting at every sequence start; each sequence's last chunk may be
//    shorter); inside a chunk, in order,
//      w_i = beta_i (k_i - sum_{j<i} (k_j.k_i) w_j),   u_i = beta_i (v_i - sum_{j<i} (k_j.k_i) u_j)
//    so that, for a chunk entered with state S0, S_i = S0 + sum_{j<=i} k_j (u_j - S0^T w_j)^T.
//    k, v, beta are used as given (no L2 norm, no scale): sh, k, v, beta and L only.
//    w (B,T,H,K), u (B,T,H,V).
void deltanet_wy_repr_fwd(const DeltanetShape& sh, const DeltanetInputs& in, std::int64_t L, double* w,
                          double* u);
// Exact gradient for dL/dw = dw (B,T,H,K), dL/du = du (B,T,H,V): writes dk, dv, dbeta of g (dq unused).
void deltanet_wy_repr_bwd(const DeltanetShape& sh, const DeltanetInputs& in, std::int64_t L, const double* dw,
                          const double* du, const DeltanetGrads& g);

// 3. Single chunk (seed 002's forward_simple, with a state): each whole sequence is one chunk of the
//    WY form, o_i = scale (S0^T q_i + sum_{j<=i} (q_i.k_j) (u_j - S0^T w_j)). Same arguments and
//    results as deltanet_recurrent_fwd/bwd (equal to it in exact arithmetic).
void deltanet_single_chunk_fwd(const DeltanetShape& sh, const DeltanetInputs& in, const DeltanetOptions& opt,
                               const double* h0, double* o, double* ht);
void deltanet_single_chunk_bwd(const DeltanetShape& sh, const DeltanetInputs& in, const DeltanetOptions& opt,
                               const double* h0, const double* do_, const double* dht, const DeltanetGrads& g,
                               double* dh0);

// 4. Chunkwise (chunk size L >= 1, any length; each sequence's last chunk may be shorter): the single
//    chunk form on every chunk against the incoming state, chunk states stitched in order (seed
//    002's forward_chunkwise; FLA's chunk_delta_rule). Same arguments and results as the loop form.
//    The backward is chunk by chunk (the blueprint of the CUDA one): states at the chunk boundaries
//    are recomputed and kept, then a reverse pass carries dL/dS from chunk to chunk.
void deltanet_chunkwise_fwd(const DeltanetShape& sh, const DeltanetInputs& in, const DeltanetOptions& opt,
                            std::int64_t L, const double* h0, double* o, double* ht);
void deltanet_chunkwise_bwd(const DeltanetShape& sh, const DeltanetInputs& in, const DeltanetOptions& opt,
                            std::int64_t L, const double* h0, const double* do_, const double* dht,
                            const DeltanetGrads& g, double* dh0);

}  // namespace fastweight::detail
