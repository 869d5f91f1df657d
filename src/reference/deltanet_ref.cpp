// deltanet_ref.cpp: CPU reference of DeltaNet (MATH.md §3, seed 002), the definition the CUDA kernels
// are checked against. float64, straight loops, one (sequence, head) at a time: its rows are gathered
// from the (B,T,H,·) tensors into contiguous (len, ·) arrays, computed on, and scattered back.
//
//   L2 norm (optional): x -> x r, r = 1 / sqrt(sum x^2 + 1e-6) per (b,t,h) row of q and of k, the
//     convention of FLA (fla/modules/l2norm.py: l2norm_fwd's default eps, applied to q and k by
//     fla/ops/delta_rule/chunk.py when use_qk_l2norm_in_kernel; the fused recurrent kernels use the
//     same x / sqrt(sum x^2 + 1e-6)). Its exact backward: dx = r (dy - (dy.y) y), y = x r.
//   loop:      S_t = S_{t-1} + beta_t k_t e_t^T,  e_t = v_t - S_{t-1}^T k_t,  o_t = scale S_t^T q_t
//   WY chunk:  w_i = beta_i (k_i - sum_{j<i} (k_j.k_i) w_j),  u_i = beta_i (v_i - sum_{j<i} (k_j.k_i) u_j)
//              d_j = u_j - S0^T w_j  (= the loop's beta_j e_j: both satisfy the same triangular
//              recursion d_i = beta_i (v_i - S0^T k_i - sum_{j<i} (k_j.k_i) d_j)),
//              o_i = scale (S0^T q_i + sum_{j<=i} (q_i.k_j) d_j),   S_end = S0 + sum_j k_j d_j^T
//   chunkwise: the WY chunk on chunks of L in order, each against the state the previous one left.
//
// BACKWARDS (all exact, checked against central differences and float64 torch autograd):
//   loop, step t in reverse, carrying dS = dL/dS_t (starts at dht):
//     dq_t = scale S_t do_t,  dS += scale q_t do_t^T,  de = beta_t dS^T k_t,  dbeta_t = k_t^T dS e_t,
//     dv_t = de,  dk_t = beta_t dS e_t - S_{t-1} de,  dS_{t-1} = dS - k_t de^T
//   WY chunk, given dS1 = dL/dS_end and do of the chunk:
//     dd_j = dS1^T k_j + scale sum_{i>=j} (q_i.k_j) do_i,   du_j = dd_j,   dw_j = -S0 dd_j
//     dq_i = scale (S0 do_i + sum_{j<=i} k_j (d_j.do_i)),   dk_j = dS1 d_j + scale sum_{i>=j} q_i (d_j.do_i)
//     dS0 = dS1 + scale sum_i q_i do_i^T - sum_j w_j dd_j^T
//   WY representation, row i in reverse (dw_i, du_i then hold every later row's contribution):
//     rw_i = k_i - sum_{j<i} A_ij w_j, ru_i = v_i - sum_{j<i} A_ij u_j (A_ij = k_i.k_j, recomputed)
//     dbeta_i = dw_i.rw_i + du_i.ru_i,  dk_i += beta_i dw_i,  dv_i = beta_i du_i,  and for j < i:
//     dw_j -= A_ij beta_i dw_i, du_j -= A_ij beta_i du_i, dA_ij = -beta_i (dw_i.w_j + du_i.u_j) into
//     dk_i += dA_ij k_j, dk_j += dA_ij k_i
#include "reference/deltanet_ref.h"

#include <algorithm>
#include <cmath>
#include <tuple>
#include <utility>
#include <vector>

namespace fastweight::detail {
namespace {

using Vec = std::vector<double>;

double dotn(const double* a, const double* b, std::int64_t n) {
  double s = 0.0;
  for (std::int64_t x = 0; x < n; ++x) s += a[x] * b[x];
  return s;
}

// Sequence n: batch index b, first position bos on the T axis, length len.
struct Seq {
  std::int64_t b, bos, len;
};
Seq seq_of(const DeltanetShape& sh, std::int64_t n) {
  if (sh.cu_seqlens) return {0, sh.cu_seqlens[n], sh.cu_seqlens[n + 1] - sh.cu_seqlens[n]};
  return {n, 0, sh.T};
}

// One (sequence, head) gathered into contiguous arrays; q and k L2-normalised when asked.
struct Head {
  std::int64_t len = 0, K = 0, V = 0;
  Vec q, k, v, beta;              // (len,K) (len,K) (len,V) (len); q, k after the L2 norm
  Vec rq, rk;                     // (len): 1 / sqrt(|x|^2 + eps) of the raw rows (L2 norm only)
  std::vector<std::int64_t> row;  // (len): index of (b, t, h) in the (B,T,H) grid

  void gather(const DeltanetShape& sh, const DeltanetInputs& in, bool l2, std::int64_t n, std::int64_t h) {
    const Seq s = seq_of(sh, n);
    len = s.len, K = sh.K, V = sh.V;
    row.resize(len);
    for (std::int64_t t = 0; t < len; ++t) row[t] = (s.b * sh.T + s.bos + t) * sh.H + h;
    auto take = [&](const double* src, std::int64_t width, Vec& dst) {
      dst.assign(len * width, 0.0);
      if (!src) return;  // q is absent for the WY representation
      for (std::int64_t t = 0; t < len; ++t) std::copy_n(src + row[t] * width, width, dst.begin() + t * width);
    };
    take(in.q, K, q), take(in.k, K, k), take(in.v, V, v), take(in.beta, 1, beta);
    rq.assign(len, 1.0), rk.assign(len, 1.0);
    if (!l2) return;
    for (auto [x, r] : {std::pair{&q, &rq}, std::pair{&k, &rk}})
      for (std::int64_t t = 0; t < len; ++t) {
        double* xt = x->data() + t * K;
        (*r)[t] = 1.0 / std::sqrt(dotn(xt, xt, K) + kDeltanetL2Eps);
        for (std::int64_t a = 0; a < K; ++a) xt[a] *= (*r)[t];
      }
  }

  // local (len, width) -> rows of a (B,T,H,width) tensor (skipped when out is null)
  void scatter(const Vec& x, std::int64_t width, double* out) const {
    if (!out) return;
    for (std::int64_t t = 0; t < len; ++t) std::copy_n(x.begin() + t * width, width, out + row[t] * width);
  }

  // Gradients wrt the (normalised) q, k, and v, beta -> g, through the L2 norm's backward when on.
  void scatter_grads(bool l2, Vec& dq, Vec& dk, const Vec& dv, const Vec& dbeta, const DeltanetGrads& g) const {
    if (l2)
      for (auto [d, y, r] : {std::tuple{&dq, &q, &rq}, std::tuple{&dk, &k, &rk}})
        for (std::int64_t t = 0; t < len; ++t) {
          double* dt = d->data() + t * K;
          const double* yt = y->data() + t * K;
          const double dy_y = dotn(dt, yt, K);
          for (std::int64_t a = 0; a < K; ++a) dt[a] = (*r)[t] * (dt[a] - dy_y * yt[a]);
        }
    scatter(dq, K, g.dq), scatter(dk, K, g.dk), scatter(dv, V, g.dv), scatter(dbeta, 1, g.dbeta);
  }
};

// The (K,V) state of sequence n, head h in an (N,H,K,V) tensor, or zero when the tensor is absent.
void load_state(const DeltanetShape& sh, const double* src, std::int64_t n, std::int64_t h, Vec& S) {
  S.assign(sh.K * sh.V, 0.0);
  if (src) std::copy_n(src + (n * sh.H + h) * sh.K * sh.V, sh.K * sh.V, S.begin());
}
void store_state(const DeltanetShape& sh, const Vec& S, std::int64_t n, std::int64_t h, double* dst) {
  if (dst) std::copy(S.begin(), S.end(), dst + (n * sh.H + h) * sh.K * sh.V);
}

// ---- loop -------------------------------------------------------------------------------------------
// One head's recurrence from S (K,V), which ends as the final state. o (len,V). Sall, when given,
// receives every state: (len+1, K, V), Sall[t] = S_t (S_0 the initial one).
void loop_head(const Head& hd, double scale, Vec& S, Vec& o, Vec* Sall) {
  const std::int64_t K = hd.K, V = hd.V;
  Vec e(V);  // (V): v_t - S_{t-1}^T k_t
  o.assign(hd.len * V, 0.0);
  if (Sall) Sall->assign((hd.len + 1) * K * V, 0.0), std::copy(S.begin(), S.end(), Sall->begin());
  for (std::int64_t t = 0; t < hd.len; ++t) {
    const double *q = &hd.q[t * K], *k = &hd.k[t * K], *v = &hd.v[t * V], b = hd.beta[t];
    for (std::int64_t j = 0; j < V; ++j) {
      e[j] = v[j];
      for (std::int64_t a = 0; a < K; ++a) e[j] -= S[a * V + j] * k[a];
    }
    for (std::int64_t a = 0; a < K; ++a)
      for (std::int64_t j = 0; j < V; ++j) S[a * V + j] += b * k[a] * e[j];
    for (std::int64_t j = 0; j < V; ++j) {
      double acc = 0.0;
      for (std::int64_t a = 0; a < K; ++a) acc += S[a * V + j] * q[a];
      o[t * V + j] = scale * acc;
    }
    if (Sall) std::copy(S.begin(), S.end(), Sall->begin() + (t + 1) * K * V);
  }
}

// ---- WY chunk ---------------------------------------------------------------------------------------
// WY representation of one chunk: k (Lc,K), v (Lc,V), beta (Lc) -> w (Lc,K), u (Lc,V).
void wy_chunk(std::int64_t Lc, std::int64_t K, std::int64_t V, const double* k, const double* v, const double* beta,
              double* w, double* u) {
  for (std::int64_t i = 0; i < Lc; ++i) {
    double *wi = w + i * K, *ui = u + i * V;
    std::copy_n(k + i * K, K, wi);
    std::copy_n(v + i * V, V, ui);
    for (std::int64_t j = 0; j < i; ++j) {
      const double A = dotn(k + i * K, k + j * K, K);
      for (std::int64_t a = 0; a < K; ++a) wi[a] -= A * w[j * K + a];
      for (std::int64_t c = 0; c < V; ++c) ui[c] -= A * u[j * V + c];
    }
    for (std::int64_t a = 0; a < K; ++a) wi[a] *= beta[i];
    for (std::int64_t c = 0; c < V; ++c) ui[c] *= beta[i];
  }
}

// Backward of wy_chunk (recursion at the top). dw (Lc,K), du (Lc,V) are consumed (overwritten);
// adds into dk (Lc,K), dv (Lc,V), dbeta (Lc).
void wy_chunk_bwd(std::int64_t Lc, std::int64_t K, std::int64_t V, const double* k, const double* v,
                  const double* beta, const double* w, const double* u, double* dw, double* du, double* dk,
                  double* dv, double* dbeta) {
  Vec rw(K), ru(V), drw(K), dru(V);  // (K), (V): the bracket of row i and its gradient
  for (std::int64_t i = Lc - 1; i >= 0; --i) {
    const double* ki = k + i * K;
    std::copy_n(ki, K, rw.begin());
    std::copy_n(v + i * V, V, ru.begin());
    for (std::int64_t j = 0; j < i; ++j) {
      const double A = dotn(ki, k + j * K, K);
      for (std::int64_t a = 0; a < K; ++a) rw[a] -= A * w[j * K + a];
      for (std::int64_t c = 0; c < V; ++c) ru[c] -= A * u[j * V + c];
    }
    dbeta[i] += dotn(dw + i * K, rw.data(), K) + dotn(du + i * V, ru.data(), V);
    for (std::int64_t a = 0; a < K; ++a) drw[a] = beta[i] * dw[i * K + a], dk[i * K + a] += drw[a];
    for (std::int64_t c = 0; c < V; ++c) dru[c] = beta[i] * du[i * V + c], dv[i * V + c] += dru[c];
    for (std::int64_t j = 0; j < i; ++j) {
      const double* kj = k + j * K;
      const double A = dotn(ki, kj, K);
      const double dA = -dotn(drw.data(), w + j * K, K) - dotn(dru.data(), u + j * V, V);
      for (std::int64_t a = 0; a < K; ++a) {
        dw[j * K + a] -= A * drw[a];
        dk[i * K + a] += dA * kj[a];
        dk[j * K + a] += dA * ki[a];
      }
      for (std::int64_t c = 0; c < V; ++c) du[j * V + c] -= A * dru[c];
    }
  }
}

// One chunk of Lc positions against the incoming state S0 (K,V): q, k (Lc,K), v (Lc,V), beta (Lc).
struct Chunk {
  std::int64_t Lc = 0, K = 0, V = 0;
  Vec w, u, d;  // (Lc,K) (Lc,V) (Lc,V): WY representation, d_j = u_j - S0^T w_j

  void run(std::int64_t Lc_, std::int64_t K_, std::int64_t V_, const double* k, const double* v, const double* beta,
           const double* S0) {
    Lc = Lc_, K = K_, V = V_;
    w.assign(Lc * K, 0.0), u.assign(Lc * V, 0.0), d.assign(Lc * V, 0.0);
    wy_chunk(Lc, K, V, k, v, beta, w.data(), u.data());
    for (std::int64_t j = 0; j < Lc; ++j)
      for (std::int64_t c = 0; c < V; ++c) {
        double acc = u[j * V + c];
        for (std::int64_t a = 0; a < K; ++a) acc -= S0[a * V + c] * w[j * K + a];
        d[j * V + c] = acc;
      }
  }
  // o (Lc,V) = scale (S0^T q_i + sum_{j<=i} (q_i.k_j) d_j)
  void output(double scale, const double* q, const double* k, const double* S0, double* o) const {
    for (std::int64_t i = 0; i < Lc; ++i) {
      const double* qi = q + i * K;
      for (std::int64_t c = 0; c < V; ++c) {
        double acc = 0.0;
        for (std::int64_t a = 0; a < K; ++a) acc += S0[a * V + c] * qi[a];
        o[i * V + c] = acc;
      }
      for (std::int64_t j = 0; j <= i; ++j) {
        const double qk = dotn(qi, k + j * K, K);
        for (std::int64_t c = 0; c < V; ++c) o[i * V + c] += qk * d[j * V + c];
      }
      for (std::int64_t c = 0; c < V; ++c) o[i * V + c] *= scale;
    }
  }
  // S1 (K,V) = S0 + sum_j k_j d_j^T (S1 may alias S0)
  void end_state(const double* k, const double* S0, double* S1) const {
    for (std::int64_t a = 0; a < K; ++a)
      for (std::int64_t c = 0; c < V; ++c) {
        double acc = S0[a * V + c];
        for (std::int64_t j = 0; j < Lc; ++j) acc += k[j * K + a] * d[j * V + c];
        S1[a * V + c] = acc;
      }
  }
  // Backward (formulas at the top), after run() on the same chunk. do_ (Lc,V); dS (K,V) holds dL/dS_end
  // on entry and dL/dS0 on return. Writes dq, dk (Lc,K), dv (Lc,V), dbeta (Lc), all wrt this chunk.
  void backward(double scale, const double* q, const double* k, const double* v, const double* beta,
                const double* S0, const double* do_, Vec& dS, double* dq, double* dk, double* dv,
                double* dbeta) const {
    Vec dd(Lc * V, 0.0), dw(Lc * K, 0.0);  // (Lc,V), (Lc,K)
    Vec dS0(dS);                           // (K,V): the S0 + ... of S_end
    std::fill_n(dq, Lc * K, 0.0), std::fill_n(dk, Lc * K, 0.0);
    std::fill_n(dv, Lc * V, 0.0), std::fill_n(dbeta, Lc, 0.0);
    for (std::int64_t j = 0; j < Lc; ++j) {  // S_end = S0 + sum_j k_j d_j^T
      for (std::int64_t c = 0; c < V; ++c)
        for (std::int64_t a = 0; a < K; ++a) dd[j * V + c] += dS[a * V + c] * k[j * K + a];
      for (std::int64_t a = 0; a < K; ++a)
        for (std::int64_t c = 0; c < V; ++c) dk[j * K + a] += dS[a * V + c] * d[j * V + c];
    }
    for (std::int64_t i = 0; i < Lc; ++i) {  // o_i = scale (S0^T q_i + sum_{j<=i} (q_i.k_j) d_j)
      const double *qi = q + i * K, *doi = do_ + i * V;
      for (std::int64_t a = 0; a < K; ++a)
        for (std::int64_t c = 0; c < V; ++c) {
          dq[i * K + a] += scale * S0[a * V + c] * doi[c];
          dS0[a * V + c] += scale * qi[a] * doi[c];
        }
      for (std::int64_t j = 0; j <= i; ++j) {
        const double *kj = k + j * K, qk = dotn(qi, kj, K), ddo = dotn(d.data() + j * V, doi, V);
        for (std::int64_t a = 0; a < K; ++a) {
          dq[i * K + a] += scale * ddo * kj[a];
          dk[j * K + a] += scale * ddo * qi[a];
        }
        for (std::int64_t c = 0; c < V; ++c) dd[j * V + c] += scale * qk * doi[c];
      }
    }
    for (std::int64_t j = 0; j < Lc; ++j)  // d_j = u_j - S0^T w_j  (du = dd)
      for (std::int64_t a = 0; a < K; ++a)
        for (std::int64_t c = 0; c < V; ++c) {
          dw[j * K + a] -= S0[a * V + c] * dd[j * V + c];
          dS0[a * V + c] -= w[j * K + a] * dd[j * V + c];
        }
    wy_chunk_bwd(Lc, K, V, k, v, beta, w.data(), u.data(), dw.data(), dd.data(), dk, dv, dbeta);
    dS.swap(dS0);
  }
};

// One head, chunks of L from S (K,V), which ends as the final state; o (len,V).
void chunkwise_head(const Head& hd, double scale, std::int64_t L, Vec& S, Vec& o) {
  const std::int64_t K = hd.K, V = hd.V;
  Chunk ch;
  o.assign(hd.len * V, 0.0);
  for (std::int64_t t0 = 0; t0 < hd.len; t0 += L) {
    const std::int64_t Lc = std::min(L, hd.len - t0);
    ch.run(Lc, K, V, &hd.k[t0 * K], &hd.v[t0 * V], &hd.beta[t0], S.data());
    ch.output(scale, &hd.q[t0 * K], &hd.k[t0 * K], S.data(), &o[t0 * V]);
    ch.end_state(&hd.k[t0 * K], S.data(), S.data());
  }
}

// Its backward, chunk by chunk: pass 1 keeps the state entering every chunk, pass 2 runs the chunks
// in reverse and carries dS = dL/d(state leaving the chunk) -> dL/d(state entering it). dS (K,V):
// dL/d(final state) on entry, dL/d(initial state) on return; do_ (len,V); gradients (len, ·).
void chunkwise_head_bwd(const Head& hd, double scale, std::int64_t L, const Vec& S0, const Vec& do_, Vec& dS,
                        Vec& dq, Vec& dk, Vec& dv, Vec& dbeta) {
  const std::int64_t K = hd.K, V = hd.V, KV = K * V, NC = (hd.len + L - 1) / L;
  Vec Sb((NC + 1) * KV);  // (NC+1, K, V): Sb[c] = state entering chunk c
  std::copy(S0.begin(), S0.end(), Sb.begin());
  Chunk ch;
  for (std::int64_t c = 0; c < NC; ++c) {
    const std::int64_t t0 = c * L, Lc = std::min(L, hd.len - t0);
    ch.run(Lc, K, V, &hd.k[t0 * K], &hd.v[t0 * V], &hd.beta[t0], &Sb[c * KV]);
    ch.end_state(&hd.k[t0 * K], &Sb[c * KV], &Sb[(c + 1) * KV]);
  }
  dq.assign(hd.len * K, 0.0), dk.assign(hd.len * K, 0.0), dv.assign(hd.len * V, 0.0), dbeta.assign(hd.len, 0.0);
  for (std::int64_t c = NC - 1; c >= 0; --c) {
    const std::int64_t t0 = c * L, Lc = std::min(L, hd.len - t0);
    ch.run(Lc, K, V, &hd.k[t0 * K], &hd.v[t0 * V], &hd.beta[t0], &Sb[c * KV]);
    ch.backward(scale, &hd.q[t0 * K], &hd.k[t0 * K], &hd.v[t0 * V], &hd.beta[t0], &Sb[c * KV], &do_[t0 * V], dS,
                &dq[t0 * K], &dk[t0 * K], &dv[t0 * V], &dbeta[t0]);
  }
}

// The forward over every (sequence, head): gather the head's rows, run head(hd, S, ol) from the
// initial state, scatter o and the final state. The loop and the chunk forms differ only in `head`.
template <typename HeadFwd>
void forward_heads(const DeltanetShape& sh, const DeltanetInputs& in, const DeltanetOptions& opt, const double* h0,
                   double* o, double* ht, HeadFwd head) {
  Head hd;
  Vec S, ol;  // (K,V), (len,V)
  for (std::int64_t n = 0; n < sh.seqs(); ++n)
    for (std::int64_t h = 0; h < sh.H; ++h) {
      hd.gather(sh, in, opt.use_qk_l2norm_in_kernel, n, h);
      load_state(sh, h0, n, h, S);
      head(hd, S, ol);
      hd.scatter(ol, sh.V, o);
      store_state(sh, S, n, h, ht);
    }
}

// Forward driver shared by the chunk forms: L <= 0 means one chunk per sequence.
void chunk_forms_fwd(const DeltanetShape& sh, const DeltanetInputs& in, const DeltanetOptions& opt, std::int64_t L,
                     const double* h0, double* o, double* ht) {
  const double scale = deltanet_scale(sh, opt);
  forward_heads(sh, in, opt, h0, o, ht, [&](const Head& hd, Vec& S, Vec& ol) {
    chunkwise_head(hd, scale, L > 0 ? L : std::max<std::int64_t>(hd.len, 1), S, ol);
  });
}

void chunk_forms_bwd(const DeltanetShape& sh, const DeltanetInputs& in, const DeltanetOptions& opt, std::int64_t L,
                     const double* h0, const double* do_, const double* dht, const DeltanetGrads& g, double* dh0) {
  const double scale = deltanet_scale(sh, opt);
  Head hd;
  Vec S0, dS, dol, dq, dk, dv, dbeta;  // (K,V) (K,V) (len,V) (len,K) (len,K) (len,V) (len)
  for (std::int64_t n = 0; n < sh.seqs(); ++n)
    for (std::int64_t h = 0; h < sh.H; ++h) {
      hd.gather(sh, in, opt.use_qk_l2norm_in_kernel, n, h);
      load_state(sh, h0, n, h, S0);
      load_state(sh, dht, n, h, dS);
      dol.resize(hd.len * sh.V);
      for (std::int64_t t = 0; t < hd.len; ++t) std::copy_n(do_ + hd.row[t] * sh.V, sh.V, dol.begin() + t * sh.V);
      chunkwise_head_bwd(hd, scale, L > 0 ? L : std::max<std::int64_t>(hd.len, 1), S0, dol, dS, dq, dk, dv, dbeta);
      hd.scatter_grads(opt.use_qk_l2norm_in_kernel, dq, dk, dv, dbeta, g);
      store_state(sh, dS, n, h, dh0);
    }
}

}  // namespace

double deltanet_scale(const DeltanetShape& sh, const DeltanetOptions& opt) {
  // pow, not 1 / sqrt: FLA's default is k.shape[-1] ** -0.5, and pow gives it to the last bit
  return opt.scale ? *opt.scale : std::pow(double(sh.K), -0.5);
}

// ---- 1. loop ------------------------------------------------------------------------------------------
void deltanet_recurrent_fwd(const DeltanetShape& sh, const DeltanetInputs& in, const DeltanetOptions& opt,
                            const double* h0, double* o, double* ht) {
  const double scale = deltanet_scale(sh, opt);
  forward_heads(sh, in, opt, h0, o, ht, [&](const Head& hd, Vec& S, Vec& ol) { loop_head(hd, scale, S, ol, nullptr); });
}

void deltanet_recurrent_bwd(const DeltanetShape& sh, const DeltanetInputs& in, const DeltanetOptions& opt,
                            const double* h0, const double* do_, const double* dht, const DeltanetGrads& g,
                            double* dh0) {
  const double scale = deltanet_scale(sh, opt);
  const std::int64_t K = sh.K, V = sh.V, KV = K * V;
  Head hd;
  Vec S, dS, ol, Sall;     // (K,V) (K,V) (len,V) (len+1,K,V)
  Vec e(V), de(V);         // (V): v_t - S_{t-1}^T k_t and its gradient / beta_t
  Vec dq, dk, dv, dbeta;   // (len,K) (len,K) (len,V) (len)
  for (std::int64_t n = 0; n < sh.seqs(); ++n)
    for (std::int64_t h = 0; h < sh.H; ++h) {
      hd.gather(sh, in, opt.use_qk_l2norm_in_kernel, n, h);
      load_state(sh, h0, n, h, S);
      loop_head(hd, scale, S, ol, &Sall);
      load_state(sh, dht, n, h, dS);
      dq.assign(hd.len * K, 0.0), dk.assign(hd.len * K, 0.0), dv.assign(hd.len * V, 0.0), dbeta.assign(hd.len, 0.0);
      for (std::int64_t t = hd.len - 1; t >= 0; --t) {
        const double *q = &hd.q[t * K], *k = &hd.k[t * K], *v = &hd.v[t * V], b = hd.beta[t];
        const double *St = &Sall[(t + 1) * KV], *Sp = &Sall[t * KV];  // S_t, S_{t-1}
        const double* dot = do_ + hd.row[t] * V;
        // o_t = scale S_t^T q_t
        for (std::int64_t a = 0; a < K; ++a)
          for (std::int64_t j = 0; j < V; ++j) {
            dq[t * K + a] += scale * St[a * V + j] * dot[j];
            dS[a * V + j] += scale * q[a] * dot[j];
          }
        // S_t = S_{t-1} + b k e^T, e = v - S_{t-1}^T k
        for (std::int64_t j = 0; j < V; ++j) {
          e[j] = v[j];
          for (std::int64_t a = 0; a < K; ++a) e[j] -= Sp[a * V + j] * k[a];
        }
        for (std::int64_t j = 0; j < V; ++j) {
          double acc = 0.0;
          for (std::int64_t a = 0; a < K; ++a) acc += dS[a * V + j] * k[a];
          de[j] = b * acc;
        }
        double db = 0.0;
        for (std::int64_t a = 0; a < K; ++a) {
          double dSe = 0.0, Spde = 0.0;
          for (std::int64_t j = 0; j < V; ++j) dSe += dS[a * V + j] * e[j], Spde += Sp[a * V + j] * de[j];
          db += k[a] * dSe;
          dk[t * K + a] += b * dSe - Spde;
        }
        dbeta[t] = db;
        std::copy(de.begin(), de.end(), dv.begin() + t * V);
        for (std::int64_t a = 0; a < K; ++a)
          for (std::int64_t j = 0; j < V; ++j) dS[a * V + j] -= k[a] * de[j];
      }
      hd.scatter_grads(opt.use_qk_l2norm_in_kernel, dq, dk, dv, dbeta, g);
      store_state(sh, dS, n, h, dh0);
    }
}

// ---- 2. WY representation ------------------------------------------------------------------------------
void deltanet_wy_repr_fwd(const DeltanetShape& sh, const DeltanetInputs& in, std::int64_t L, double* w, double* u) {
  const std::int64_t K = sh.K, V = sh.V;
  const DeltanetInputs kvb{nullptr, in.k, in.v, in.beta};
  Head hd;
  Vec wl, ul;  // (len,K), (len,V)
  for (std::int64_t n = 0; n < sh.seqs(); ++n)
    for (std::int64_t h = 0; h < sh.H; ++h) {
      hd.gather(sh, kvb, false, n, h);
      wl.assign(hd.len * K, 0.0), ul.assign(hd.len * V, 0.0);
      for (std::int64_t t0 = 0; t0 < hd.len; t0 += L)
        wy_chunk(std::min(L, hd.len - t0), K, V, &hd.k[t0 * K], &hd.v[t0 * V], &hd.beta[t0], &wl[t0 * K],
                 &ul[t0 * V]);
      hd.scatter(wl, K, w), hd.scatter(ul, V, u);
    }
}

void deltanet_wy_repr_bwd(const DeltanetShape& sh, const DeltanetInputs& in, std::int64_t L, const double* dw,
                          const double* du, const DeltanetGrads& g) {
  const std::int64_t K = sh.K, V = sh.V;
  const DeltanetInputs kvb{nullptr, in.k, in.v, in.beta};
  Head hd;
  Vec wl, ul, dwl, dul, dq, dk, dv, dbeta;  // (len,K) (len,V) (len,K) (len,V) (len,K) (len,K) (len,V) (len)
  for (std::int64_t n = 0; n < sh.seqs(); ++n)
    for (std::int64_t h = 0; h < sh.H; ++h) {
      hd.gather(sh, kvb, false, n, h);
      wl.assign(hd.len * K, 0.0), ul.assign(hd.len * V, 0.0), dwl.resize(hd.len * K), dul.resize(hd.len * V);
      for (std::int64_t t = 0; t < hd.len; ++t) {
        std::copy_n(dw + hd.row[t] * K, K, dwl.begin() + t * K);
        std::copy_n(du + hd.row[t] * V, V, dul.begin() + t * V);
      }
      dq.assign(hd.len * K, 0.0), dk.assign(hd.len * K, 0.0), dv.assign(hd.len * V, 0.0), dbeta.assign(hd.len, 0.0);
      for (std::int64_t t0 = 0; t0 < hd.len; t0 += L) {
        const std::int64_t Lc = std::min(L, hd.len - t0);
        wy_chunk(Lc, K, V, &hd.k[t0 * K], &hd.v[t0 * V], &hd.beta[t0], &wl[t0 * K], &ul[t0 * V]);
        wy_chunk_bwd(Lc, K, V, &hd.k[t0 * K], &hd.v[t0 * V], &hd.beta[t0], &wl[t0 * K], &ul[t0 * V], &dwl[t0 * K],
                     &dul[t0 * V], &dk[t0 * K], &dv[t0 * V], &dbeta[t0]);
      }
      hd.scatter_grads(false, dq, dk, dv, dbeta, {nullptr, g.dk, g.dv, g.dbeta});
    }
}

// ---- 3. single chunk -------------------------------------------------------------------------------------
void deltanet_single_chunk_fwd(const DeltanetShape& sh, const DeltanetInputs& in, const DeltanetOptions& opt,
                               const double* h0, double* o, double* ht) {
  chunk_forms_fwd(sh, in, opt, 0, h0, o, ht);
}

void deltanet_single_chunk_bwd(const DeltanetShape& sh, const DeltanetInputs& in, const DeltanetOptions& opt,
                               const double* h0, const double* do_, const double* dht, const DeltanetGrads& g,
                               double* dh0) {
  chunk_forms_bwd(sh, in, opt, 0, h0, do_, dht, g, dh0);
}

// ---- 4. chunkwise ----------------------------------------------------------------------------------------
void deltanet_chunkwise_fwd(const DeltanetShape& sh, const DeltanetInputs& in, const DeltanetOptions& opt,
                            std::int64_t L, const double* h0, double* o, double* ht) {
  chunk_forms_fwd(sh, in, opt, std::max<std::int64_t>(L, 1), h0, o, ht);
}

void deltanet_chunkwise_bwd(const DeltanetShape& sh, const DeltanetInputs& in, const DeltanetOptions& opt,
                            std::int64_t L, const double* h0, const double* do_, const double* dht,
                            const DeltanetGrads& g, double* dh0) {
  chunk_forms_bwd(sh, in, opt, std::max<std::int64_t>(L, 1), h0, do_, dht, g, dh0);
}

}  // namespace fastweight::detail
