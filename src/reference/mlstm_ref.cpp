// mlstm_ref.cpp: CPU reference of the mLSTM (MATH.md §2), the definition the CUDA kernels are
// checked against. float64, straight loops, one (batch, head) at a time, sequence in order.
//
//   lf_t = logsigmoid(f_t),  F_t = lf_1 + ... + lf_t,  D[t,s] = F_t - F_s + i_s (s <= t), -inf above
//   parallel:  m_t = max_s D[t,s],  C[t,s] = (q_t.k_s / sqrt(DQK)) exp(D[t,s] - m_t),
//              b_t = sum_s C[t,s],  n_t = max(|b_t|, exp(-m_t)),  h_t = sum_s C[t,s] v_s / (n_t + eps)
//   recurrent: m_t = max(lf_t + m_{t-1}, i_t), fa = exp(lf_t + m_{t-1} - m_t), ia = exp(i_t - m_t),
//              C_t = fa C_{t-1} + ia k_t v_t^T, n_t = fa n_{t-1} + ia k_t,
//              h_t = qs^T C_t / (max(|qs.n_t|, exp(-m_t)) + eps),  qs = q_t / sqrt(DQK)
//   chunkwise: the parallel form inside a chunk against the incoming state (C, n, m), whose
//              stabiliser m_t = max(F^chunk_t + m_prev, max_s D^chunk[t,s]) is exactly the recurrent
//              one unrolled; so chunkwise == recurrent in exact arithmetic for every eps. Its
//              backward runs chunk by chunk (the CUDA blueprint; recursion above mlstm_chunkwise_bwd).
//   head norm: out = layernorm of each (b, head, t) row of h (MATH.md §1), composed with the above.
//
// GRADIENT CONVENTIONS of mlstm_parallel_bwd (the exact gradient of the forward above, i.e. what
// float64 autograd of a direct torch implementation returns; checked against central differences
// and against tests/golden/make_golden_mlstm.py):
//  * The normaliser is NOT dropped: dn_t = -(dh_t . h_t) / (n_t + eps) flows into b_t (and so into
//    q, k, i, f) or into exp(-m_t), whichever branch of the max is active. (mlstm_kernels drops it;
//    that is only right when a head norm follows.)
//  * m is NOT treated as a constant. With eps > 0 the output depends on m (h = num~ / (max(|b~|, 1)
//    + eps exp(m)) with m-free num~, b~), so autograd gives it a gradient: through every
//    exp(D[t,s] - m_t), through exp(-m_t) when that branch of n_t is active, and from m_t back to D
//    through m_t = max_s D[t,s]. That last step gives all of dm_t to ONE entry, the arg-max
//    D[t,s*], as torch.max(dim=-1) does (not torch.amax, which splits ties evenly). On ties the
//    first (smallest s) index is taken, as torch's CPU max/argmax return it. Away from ties this is
//    the true derivative (D is smooth in i, f and the arg-max is locally constant), which is what
//    the finite-difference tests check; at exact ties any choice is a subgradient. With eps = 0 the
//    gradient through m cancels exactly (h does not depend on m).
//  * n_t = max(|b_t|, exp(-m_t)): on an exact tie the gradient is split in halves (torch.maximum);
//    d|b|/db = sign(b) with sign(0) = 0 (torch.abs).
//  * The -inf entries of D (s > t) are constants: they get and pass no gradient; d lf_1 = 0 exactly
//    (lf_1 cancels in every D[t,s]).
#include "reference/mlstm_ref.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace fastweight::detail {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// sigmoid(-x) = d logsigmoid(x) / dx, stable for both signs.
double sigmoid_neg(double x) {
  if (x >= 0) {
    const double e = std::exp(-x);
    return e / (1.0 + e);
  }
  return 1.0 / (1.0 + std::exp(x));
}

// Prefix sums F_t = lf_0 + ... + lf_t (0-based) of one head's forget gates.
void prefix_logf(const double* f, std::int64_t S, std::vector<double>& F) {
  F.resize(S);
  double acc = 0.0;
  for (std::int64_t t = 0; t < S; ++t) {
    acc += mlstm_logsigmoid(f[t]);
    F[t] = acc;
  }
}

// One head's parallel forward with all intermediates kept for the backward.
struct ParallelHead {
  std::int64_t S = 0, DQK = 0, DV = 0;
  std::vector<double> D, A, C, m, b, n, num, h;  // A[t,s] = qs_t.k_s; D, A, C are S x S
  std::vector<std::int64_t> argmax;              // s* with D[t,s*] = m_t (first one)

  void run(std::int64_t S_, std::int64_t DQK_, std::int64_t DV_, const double* q, const double* k,
           const double* v, const double* i, const double* f, double eps) {
    S = S_, DQK = DQK_, DV = DV_;
    const double scale = 1.0 / std::sqrt(double(DQK));
    std::vector<double> F;
    prefix_logf(f, S, F);
    D.assign(S * S, kNegInf);
    A.assign(S * S, 0.0);
    C.assign(S * S, 0.0);
    m.assign(S, 0.0), b.assign(S, 0.0), n.assign(S, 0.0);
    num.assign(S * DV, 0.0), h.assign(S * DV, 0.0);
    argmax.assign(S, 0);
    for (std::int64_t t = 0; t < S; ++t) {
      double mt = kNegInf;
      for (std::int64_t s = 0; s <= t; ++s) {
        const double d = F[t] - F[s] + i[s];
        D[t * S + s] = d;
        if (d > mt) mt = d, argmax[t] = s;  // strict: the first maximal index wins
      }
      m[t] = mt;
      double bt = 0.0;
      for (std::int64_t s = 0; s <= t; ++s) {
        double a = 0.0;
        for (std::int64_t c = 0; c < DQK; ++c) a += q[t * DQK + c] * k[s * DQK + c];
        a *= scale;
        A[t * S + s] = a;
        const double cts = a * std::exp(D[t * S + s] - mt);
        C[t * S + s] = cts;
        bt += cts;
        for (std::int64_t j = 0; j < DV; ++j) num[t * DV + j] += cts * v[s * DV + j];
      }
      b[t] = bt;
      n[t] = std::max(std::abs(bt), std::exp(-mt));
      for (std::int64_t j = 0; j < DV; ++j) h[t * DV + j] = num[t * DV + j] / (n[t] + eps);
    }
  }
};

struct HeadPtrs {
  const double *q, *k, *v, *i, *f;
};
HeadPtrs head_ptrs(const MlstmShape& sh, const MlstmInputs& in, std::int64_t bh) {
  return {in.q + bh * sh.S * sh.DQK, in.k + bh * sh.S * sh.DQK, in.v + bh * sh.S * sh.DV, in.i + bh * sh.S,
          in.f + bh * sh.S};
}

// One recurrent step of one head on states c (DQK x DV), n (DQK), m (scalar); writes h (DV).
void step_head(std::int64_t DQK, std::int64_t DV, const double* q, const double* k, const double* v, double ig,
               double fg, double eps, double* c, double* n, double& m, double* h) {
  const double lf = mlstm_logsigmoid(fg);
  const double m_new = std::max(lf + m, ig);
  const double fa = std::exp(lf + m - m_new), ia = std::exp(ig - m_new);
  for (std::int64_t a = 0; a < DQK; ++a) {
    n[a] = fa * n[a] + ia * k[a];
    for (std::int64_t j = 0; j < DV; ++j) c[a * DV + j] = fa * c[a * DV + j] + ia * k[a] * v[j];
  }
  m = m_new;
  const double scale = 1.0 / std::sqrt(double(DQK));
  double qn = 0.0;
  for (std::int64_t a = 0; a < DQK; ++a) qn += q[a] * scale * n[a];
  const double den = std::max(std::abs(qn), std::exp(-m_new)) + eps;
  for (std::int64_t j = 0; j < DV; ++j) {
    double acc = 0.0;
    for (std::int64_t a = 0; a < DQK; ++a) acc += q[a] * scale * c[a * DV + j];
    h[j] = acc / den;
  }
}

// Per-head state buffers initialised from `init` (zero / 0 where absent).
struct HeadState {
  std::vector<double> c, n;
  double m = 0.0;
  void load(const MlstmShape& sh, const MlstmConstState& init, std::int64_t bh) {
    c.assign(sh.DQK * sh.DV, 0.0);
    n.assign(sh.DQK, 0.0);
    m = init.m ? init.m[bh] : 0.0;
    if (init.c) std::copy_n(init.c + bh * sh.DQK * sh.DV, sh.DQK * sh.DV, c.begin());
    if (init.n) std::copy_n(init.n + bh * sh.DQK, sh.DQK, n.begin());
  }
  void store(const MlstmShape& sh, const MlstmState& last, std::int64_t bh) const {
    if (last.c) std::copy(c.begin(), c.end(), last.c + bh * sh.DQK * sh.DV);
    if (last.n) std::copy(n.begin(), n.end(), last.n + bh * sh.DQK);
    if (last.m) last.m[bh] = m;
  }
};

}  // namespace

double mlstm_logsigmoid(double x) { return std::min(x, 0.0) - std::log1p(std::exp(-std::abs(x))); }

// ---- 1. decay matrix ---------------------------------------------------------------------------
void mlstm_decay_matrix_fwd(const MlstmShape& sh, const double* i, const double* f, double* D) {
  const std::int64_t S = sh.S;
  std::vector<double> F;
  for (std::int64_t bh = 0; bh < sh.heads(); ++bh) {
    prefix_logf(f + bh * S, S, F);
    double* Dh = D + bh * S * S;
    for (std::int64_t t = 0; t < S; ++t)
      for (std::int64_t s = 0; s < S; ++s) Dh[t * S + s] = s <= t ? F[t] - F[s] + i[bh * S + s] : kNegInf;
  }
}

// di_s = sum_{t >= s} dD[t,s];  d lf_j = sum_{t >= j} sum_{s < j} dD[t,s] (the entries whose
// F_t - F_s contains lf_j), computed by the O(S^2) update G_{j+1} = G_j - sum_{s<j} dD[j,s] +
// sum_{t>j} dD[t,j], G_0 = 0;  df_j = d lf_j * sigmoid(-f_j).
void mlstm_decay_matrix_bwd(const MlstmShape& sh, const double* f, const double* dD, double* di, double* df) {
  const std::int64_t S = sh.S;
  for (std::int64_t bh = 0; bh < sh.heads(); ++bh) {
    const double* g = dD + bh * S * S;
    if (di)
      for (std::int64_t s = 0; s < S; ++s) {
        double acc = 0.0;
        for (std::int64_t t = s; t < S; ++t) acc += g[t * S + s];
        di[bh * S + s] = acc;
      }
    if (df) {
      double G = 0.0;
      for (std::int64_t j = 0; j < S; ++j) {
        if (j > 0) {
          for (std::int64_t s = 0; s < j - 1; ++s) G -= g[(j - 1) * S + s];
          for (std::int64_t t = j; t < S; ++t) G += g[t * S + (j - 1)];
        }
        df[bh * S + j] = G * sigmoid_neg(f[bh * S + j]);
      }
    }
  }
}

// ---- 2. parallel form ----------------------------------------------------------------------------
void mlstm_parallel_fwd(const MlstmShape& sh, const MlstmInputs& in, double eps, double* h, double* n,
                        double* m, double* b) {
  ParallelHead ph;
  for (std::int64_t bh = 0; bh < sh.heads(); ++bh) {
    const HeadPtrs p = head_ptrs(sh, in, bh);
    ph.run(sh.S, sh.DQK, sh.DV, p.q, p.k, p.v, p.i, p.f, eps);
    std::copy(ph.h.begin(), ph.h.end(), h + bh * sh.S * sh.DV);
    if (n) std::copy(ph.n.begin(), ph.n.end(), n + bh * sh.S);
    if (m) std::copy(ph.m.begin(), ph.m.end(), m + bh * sh.S);
    if (b) std::copy(ph.b.begin(), ph.b.end(), b + bh * sh.S);
  }
}

void mlstm_parallel_bwd(const MlstmShape& sh, const MlstmInputs& in, double eps, const double* dh,
                        const MlstmGrads& g) {
  const std::int64_t S = sh.S, DQK = sh.DQK, DV = sh.DV;
  const double scale = 1.0 / std::sqrt(double(DQK));
  ParallelHead ph;
  std::vector<double> dD(S * S), dC(S * S), dqs(S * DQK), dks(S * DQK), dvs(S * DV), di(S), df(S);
  for (std::int64_t bh = 0; bh < sh.heads(); ++bh) {
    const HeadPtrs p = head_ptrs(sh, in, bh);
    ph.run(S, DQK, DV, p.q, p.k, p.v, p.i, p.f, eps);
    const double* dhh = dh + bh * S * DV;
    std::fill(dD.begin(), dD.end(), 0.0);
    std::fill(dC.begin(), dC.end(), 0.0);
    std::fill(dqs.begin(), dqs.end(), 0.0);
    std::fill(dks.begin(), dks.end(), 0.0);
    std::fill(dvs.begin(), dvs.end(), 0.0);
    for (std::int64_t t = 0; t < S; ++t) {
      const double den = ph.n[t] + eps;
      // h = num / den: dnum = dh / den, dn = -(dh . num) / den^2
      double dh_num = 0.0;
      for (std::int64_t j = 0; j < DV; ++j) dh_num += dhh[t * DV + j] * ph.num[t * DV + j];
      const double dn = -dh_num / (den * den);
      // n = max(|b|, exp(-m)): ties split in halves; d|b|/db = sign(b), sign(0) = 0
      const double ab = std::abs(ph.b[t]), em = std::exp(-ph.m[t]);
      const double w_b = ab > em ? 1.0 : (ab < em ? 0.0 : 0.5);
      const double sgn = ph.b[t] > 0 ? 1.0 : (ph.b[t] < 0 ? -1.0 : 0.0);
      const double db = dn * w_b * sgn;
      double dm = dn * (1.0 - w_b) * (-em);
      for (std::int64_t s = 0; s <= t; ++s) {
        // C[t,s] enters num (times v_s) and b
        double dc = db;
        for (std::int64_t j = 0; j < DV; ++j) {
          dc += dhh[t * DV + j] / den * p.v[s * DV + j];
          dvs[s * DV + j] += ph.C[t * S + s] * dhh[t * DV + j] / den;
        }
        dC[t * S + s] = dc;
        // C = A * exp(D - m): dA = dC exp(D - m), d(D - m) = dC * C
        const double dA = dc * std::exp(ph.D[t * S + s] - ph.m[t]);
        const double dx = dc * ph.C[t * S + s];
        dD[t * S + s] += dx;
        dm -= dx;
        for (std::int64_t c = 0; c < DQK; ++c) {
          dqs[t * DQK + c] += dA * p.k[s * DQK + c];
          dks[s * DQK + c] += dA * p.q[t * DQK + c] * scale;
        }
      }
      // m_t = max_s D[t,s]: all of dm to the arg-max entry (torch.max(dim) semantics)
      dD[t * S + ph.argmax[t]] += dm;
    }
    const MlstmShape one{1, 1, S, DQK, DV};
    mlstm_decay_matrix_bwd(one, p.f, dD.data(), di.data(), df.data());
    for (std::int64_t x = 0; x < S * DQK; ++x) {
      if (g.dq) g.dq[bh * S * DQK + x] = dqs[x] * scale;
      if (g.dk) g.dk[bh * S * DQK + x] = dks[x];
    }
    if (g.dv) std::copy(dvs.begin(), dvs.end(), g.dv + bh * S * DV);
    if (g.di) std::copy(di.begin(), di.end(), g.di + bh * S);
    if (g.df) std::copy(df.begin(), df.end(), g.df + bh * S);
  }
}

// ---- 3. recurrent form and step ------------------------------------------------------------------
void mlstm_recurrent_fwd(const MlstmShape& sh, const MlstmInputs& in, double eps, const MlstmConstState& init,
                         double* h, const MlstmState& last) {
  const std::int64_t S = sh.S, DQK = sh.DQK, DV = sh.DV;
  HeadState st;
  for (std::int64_t bh = 0; bh < sh.heads(); ++bh) {
    const HeadPtrs p = head_ptrs(sh, in, bh);
    st.load(sh, init, bh);
    for (std::int64_t t = 0; t < S; ++t)
      step_head(DQK, DV, p.q + t * DQK, p.k + t * DQK, p.v + t * DV, p.i[t], p.f[t], eps, st.c.data(),
                st.n.data(), st.m, h + (bh * S + t) * DV);
    st.store(sh, last, bh);
  }
}

void mlstm_step(const MlstmShape& sh, const double* q, const double* k, const double* v, const double* i,
                const double* f, double eps, const MlstmState& state, double* h) {
  const std::int64_t DQK = sh.DQK, DV = sh.DV;
  for (std::int64_t bh = 0; bh < sh.heads(); ++bh)
    step_head(DQK, DV, q + bh * DQK, k + bh * DQK, v + bh * DV, i[bh], f[bh], eps, state.c + bh * DQK * DV,
              state.n + bh * DQK, state.m[bh], h + bh * DV);
}

// BPTT through the recurrence of step_head. Per step (forward): a = lf + m_prev, m = max(a, i),
// fa = exp(a - m), ia = exp(i - m), C = fa C_prev + ia k v^T, n = fa n_prev + ia k,
// nn = max(|qs.n|, exp(-m)), h = qs^T C / (nn + eps). Gradients dC, dn, dm flow backwards in time.
void mlstm_recurrent_bwd(const MlstmShape& sh, const MlstmInputs& in, double eps, const MlstmConstState& init,
                         const double* dh, const MlstmConstState& dlast, const MlstmGrads& g,
                         const MlstmState& dinit) {
  const std::int64_t S = sh.S, DQK = sh.DQK, DV = sh.DV, CS = DQK * DV;
  const double scale = 1.0 / std::sqrt(double(DQK));
  HeadState st;
  // per step: the states before the step (C_{t-1}, n_{t-1}, m_{t-1}); the rest is recomputed
  std::vector<double> Cs, Ns, Ms, c(CS), n(DQK), dc(CS), dn(DQK), num(DV), dnum(DV);
  for (std::int64_t bh = 0; bh < sh.heads(); ++bh) {
    const HeadPtrs p = head_ptrs(sh, in, bh);
    st.load(sh, init, bh);
    Cs.resize((S + 1) * CS), Ns.resize((S + 1) * DQK), Ms.resize(S + 1);
    std::vector<double> hbuf(DV);
    for (std::int64_t t = 0; t <= S; ++t) {
      std::copy(st.c.begin(), st.c.end(), Cs.begin() + t * CS);
      std::copy(st.n.begin(), st.n.end(), Ns.begin() + t * DQK);
      Ms[t] = st.m;
      if (t < S)
        step_head(DQK, DV, p.q + t * DQK, p.k + t * DQK, p.v + t * DV, p.i[t], p.f[t], eps, st.c.data(), st.n.data(),
                  st.m, hbuf.data());
    }
    for (std::int64_t x = 0; x < CS; ++x) dc[x] = dlast.c ? dlast.c[bh * CS + x] : 0.0;
    for (std::int64_t a = 0; a < DQK; ++a) dn[a] = dlast.n ? dlast.n[bh * DQK + a] : 0.0;
    double dm = dlast.m ? dlast.m[bh] : 0.0;
    for (std::int64_t t = S - 1; t >= 0; --t) {
      const double *q = p.q + t * DQK, *k = p.k + t * DQK, *v = p.v + t * DV;
      const double* cp = Cs.data() + t * CS;
      const double* np = Ns.data() + t * DQK;
      const double mp = Ms[t];
      const double* cc = Cs.data() + (t + 1) * CS;  // C_t, n_t, m_t
      const double* nc = Ns.data() + (t + 1) * DQK;
      const double lf = mlstm_logsigmoid(p.f[t]), ig = p.i[t];
      const double a1 = lf + mp, mt = Ms[t + 1];  // == max(a1, ig)
      const double fa = std::exp(a1 - mt), ia = std::exp(ig - mt);
      // output: h = num / (nn + eps)
      double qn = 0.0;
      for (std::int64_t a = 0; a < DQK; ++a) qn += q[a] * scale * nc[a];
      const double em = std::exp(-mt), aqn = std::abs(qn);
      const double den = std::max(aqn, em) + eps;
      double dh_num = 0.0;
      for (std::int64_t j = 0; j < DV; ++j) {
        double acc = 0.0;
        for (std::int64_t a = 0; a < DQK; ++a) acc += q[a] * scale * cc[a * DV + j];
        num[j] = acc;
        dnum[j] = dh[(bh * S + t) * DV + j] / den;
        dh_num += dh[(bh * S + t) * DV + j] * acc;
      }
      const double dnn = -dh_num / (den * den);
      const double w = aqn > em ? 1.0 : (aqn < em ? 0.0 : 0.5);
      const double dqn = dnn * w * (qn > 0 ? 1.0 : (qn < 0 ? -1.0 : 0.0));
      dm += dnn * (1.0 - w) * (-em);
      for (std::int64_t a = 0; a < DQK; ++a) {
        double dqs = dqn * nc[a];
        for (std::int64_t j = 0; j < DV; ++j) {
          dqs += dnum[j] * cc[a * DV + j];
          dc[a * DV + j] += q[a] * scale * dnum[j];
        }
        dn[a] += dqn * q[a] * scale;
        if (g.dq) g.dq[(bh * S + t) * DQK + a] = dqs * scale;
      }
      // C_t = fa C_{t-1} + ia k v^T,  n_t = fa n_{t-1} + ia k
      double dfa = 0.0, dia = 0.0;
      for (std::int64_t a = 0; a < DQK; ++a) {
        double dcv = 0.0;
        for (std::int64_t j = 0; j < DV; ++j) {
          dfa += dc[a * DV + j] * cp[a * DV + j];
          dcv += dc[a * DV + j] * v[j];
        }
        dfa += dn[a] * np[a];
        dia += k[a] * (dcv + dn[a]);
        if (g.dk) g.dk[(bh * S + t) * DQK + a] = ia * (dcv + dn[a]);
      }
      if (g.dv)
        for (std::int64_t j = 0; j < DV; ++j) {
          double acc = 0.0;
          for (std::int64_t a = 0; a < DQK; ++a) acc += dc[a * DV + j] * k[a];
          g.dv[(bh * S + t) * DV + j] = ia * acc;
        }
      // fa = exp(a1 - m), ia = exp(i - m), m = max(a1, i) (ties split in halves), a1 = lf + m_prev
      const double dmt = dm - dfa * fa - dia * ia;
      const double w2 = a1 > ig ? 1.0 : (a1 < ig ? 0.0 : 0.5);
      const double da1 = dfa * fa + dmt * w2;
      if (g.di) g.di[bh * S + t] = dia * ia + dmt * (1.0 - w2);
      if (g.df) g.df[bh * S + t] = da1 * sigmoid_neg(p.f[t]);
      for (auto& x : dc) x *= fa;
      for (auto& x : dn) x *= fa;
      dm = da1;
    }
    if (dinit.c) std::copy(dc.begin(), dc.end(), dinit.c + bh * CS);
    if (dinit.n) std::copy(dn.begin(), dn.end(), dinit.n + bh * DQK);
    if (dinit.m) dinit.m[bh] = dm;
  }
}

// ---- 4. chunkwise form ---------------------------------------------------------------------------
namespace {

// One chunk of one head: the parallel form of positions t0 .. t0+Lc-1 against the incoming state
// (C0, n0, m0), every intermediate kept for the backward. u = position in the chunk, w <= u = the
// key position; Dl[u,w] = Fl[u] - Fl[w] + i_w is the chunk's own decay matrix and g[u] = Fl[u] + m0
// the log-weight of the incoming state.
struct ChunkHead {
  std::int64_t Lc = 0, DQK = 0, DV = 0;
  std::vector<double> Fl;         // (Lc)     lf_{t0} + ... + lf_{t0+u}: decay since the state
  std::vector<double> m;          // (Lc)     stabiliser max(g[u], max_w Dl[u,w])
  std::vector<std::int64_t> arg;  // (Lc)     which candidate is the max: -1 = g[u], else w
  std::vector<double> ws;         // (Lc)     exp(g[u] - m[u]), weight of the incoming state
  std::vector<double> qn;         // (Lc)     qs_u . n0
  std::vector<double> qC;         // (Lc, DV) qs_u^T C0
  std::vector<double> A;          // (Lc, Lc) qs_u . k_w        (w <= u; 0 above)
  std::vector<double> E;          // (Lc, Lc) exp(Dl[u,w] - m[u]) (w <= u; 0 above)
  std::vector<double> b;          // (Lc)     ws qn + sum_w A E
  std::vector<double> num;        // (Lc, DV) ws qC + sum_w A E v_w
  std::vector<double> den;        // (Lc)     max(|b|, exp(-m)) + eps

  // q, k (Lc, DQK), v (Lc, DV), i, f (Lc) point at the chunk's first position; c0 (DQK, DV), n0 (DQK).
  void run(std::int64_t Lc_, std::int64_t DQK_, std::int64_t DV_, const double* q, const double* k,
           const double* v, const double* i, const double* f, const double* c0, const double* n0, double m0,
           double eps) {
    Lc = Lc_, DQK = DQK_, DV = DV_;
    const double scale = 1.0 / std::sqrt(double(DQK));
    prefix_logf(f, Lc, Fl);
    m.assign(Lc, 0.0), arg.assign(Lc, -1), ws.assign(Lc, 0.0), qn.assign(Lc, 0.0), b.assign(Lc, 0.0);
    den.assign(Lc, 0.0);
    qC.assign(Lc * DV, 0.0), num.assign(Lc * DV, 0.0);
    A.assign(Lc * Lc, 0.0), E.assign(Lc * Lc, 0.0);
    for (std::int64_t u = 0; u < Lc; ++u) {
      const double* qu = q + u * DQK;
      // strict '>': on ties the state term, then the smallest w wins (the scan order)
      double mt = Fl[u] + m0;
      for (std::int64_t w = 0; w <= u; ++w) {
        const double d = Fl[u] - Fl[w] + i[w];
        if (d > mt) mt = d, arg[u] = w;
      }
      m[u] = mt;
      ws[u] = std::exp(Fl[u] + m0 - mt);
      double acc = 0.0;
      for (std::int64_t a = 0; a < DQK; ++a) acc += qu[a] * scale * n0[a];
      qn[u] = acc;
      double bt = ws[u] * acc;
      for (std::int64_t j = 0; j < DV; ++j) {
        double cj = 0.0;
        for (std::int64_t a = 0; a < DQK; ++a) cj += qu[a] * scale * c0[a * DV + j];
        qC[u * DV + j] = cj;
        num[u * DV + j] = ws[u] * cj;
      }
      for (std::int64_t w = 0; w <= u; ++w) {
        double a = 0.0;
        for (std::int64_t c = 0; c < DQK; ++c) a += qu[c] * k[w * DQK + c];
        A[u * Lc + w] = a * scale;
        E[u * Lc + w] = std::exp(Fl[u] - Fl[w] + i[w] - mt);
        const double cw = A[u * Lc + w] * E[u * Lc + w];
        bt += cw;
        for (std::int64_t j = 0; j < DV; ++j) num[u * DV + j] += cw * v[w * DV + j];
      }
      b[u] = bt;
      den[u] = std::max(std::abs(bt), std::exp(-mt)) + eps;
    }
  }

  // The state after the chunk, stabilised by m of its last position: the last row's weights,
  //   C_end = ws[Lc-1] C0 + sum_w E[Lc-1,w] k_w v_w^T,  n_end = ws[Lc-1] n0 + sum_w E[Lc-1,w] k_w.
  void end_state(const double* k, const double* v, const double* c0, const double* n0, double* c_end,
                 double* n_end, double& m_end) const {
    const std::int64_t r = Lc - 1;
    for (std::int64_t a = 0; a < DQK; ++a) {
      n_end[a] = ws[r] * n0[a];
      for (std::int64_t j = 0; j < DV; ++j) c_end[a * DV + j] = ws[r] * c0[a * DV + j];
    }
    for (std::int64_t w = 0; w < Lc; ++w) {
      const double e = E[r * Lc + w];
      for (std::int64_t a = 0; a < DQK; ++a) {
        n_end[a] += e * k[w * DQK + a];
        for (std::int64_t j = 0; j < DV; ++j) c_end[a * DV + j] += e * k[w * DQK + a] * v[w * DV + j];
      }
    }
    m_end = m[r];
  }
};

}  // namespace

void mlstm_chunkwise_fwd(const MlstmShape& sh, const MlstmInputs& in, double eps, std::int64_t L,
                         const MlstmConstState& init, double* h, const MlstmState& last) {
  const std::int64_t S = sh.S, DQK = sh.DQK, DV = sh.DV;
  HeadState st;
  ChunkHead ch;
  std::vector<double> c_new(DQK * DV), n_new(DQK);  // (DQK, DV), (DQK): the next state
  for (std::int64_t bh = 0; bh < sh.heads(); ++bh) {
    const HeadPtrs p = head_ptrs(sh, in, bh);
    st.load(sh, init, bh);
    for (std::int64_t t0 = 0; t0 < S; t0 += L) {
      const std::int64_t Lc = std::min(L, S - t0);
      const double *q = p.q + t0 * DQK, *k = p.k + t0 * DQK, *v = p.v + t0 * DV;
      ch.run(Lc, DQK, DV, q, k, v, p.i + t0, p.f + t0, st.c.data(), st.n.data(), st.m, eps);
      for (std::int64_t u = 0; u < Lc; ++u)
        for (std::int64_t j = 0; j < DV; ++j) h[(bh * S + t0 + u) * DV + j] = ch.num[u * DV + j] / ch.den[u];
      ch.end_state(k, v, st.c.data(), st.n.data(), c_new.data(), n_new.data(), st.m);
      st.c.swap(c_new);
      st.n.swap(n_new);
    }
    st.store(sh, last, bh);
  }
}

// CHUNK RECURSION of mlstm_chunkwise_bwd. Chunks c = 0 .. NC-1 of length Lc <= L (the last may be
// shorter); (C_c, n_c, m_c) is the state entering chunk c ((C_0, n_0, m_0) = init) and chunk c maps
//   (C_c, n_c, m_c), q, k, v, i, f of its positions  ->  h of its positions, (C_{c+1}, n_{c+1}, m_{c+1})
// by ChunkHead (the forward above), per position u (t = t0 + u) and key w <= u:
//   g[u] = Fl[u] + m_c,  Dl[u,w] = Fl[u] - Fl[w] + i_w,  m[u] = max(g[u], max_w Dl[u,w])
//   ws[u] = exp(g[u] - m[u]),  P[u,w] = A[u,w] E[u,w] = (qs_u.k_w) exp(Dl[u,w] - m[u])
//   b[u] = ws[u] qs_u.n_c + sum_w P[u,w],  num[u] = ws[u] qs_u^T C_c + sum_w P[u,w] v_w
//   h[u] = num[u] / (max(|b[u]|, exp(-m[u])) + eps)
//   C_{c+1} = ws[Lc-1] C_c + sum_w E[Lc-1,w] k_w v_w^T,  n_{c+1} likewise with k_w,  m_{c+1} = m[Lc-1]
// Per-chunk shapes: q, k, dq, dk (Lc, DQK); v, h, dh, dv, num (Lc, DV); i, f, Fl, g, m, ws, b, den
// and their gradients (Lc); Dl, A, E, P, dDl (Lc, Lc), lower triangle; C_c, dC (DQK, DV); n_c, dn
// (DQK); m_c, dm scalars. Kept across chunks: only the boundary states (NC+1 of each).
// Pass 1 (forward) keeps the boundary states; pass 2 runs c = NC-1 .. 0, recomputes chunk c from
// (C_c, n_c, m_c) and, given dh of its positions and (dC, dn, dm) = dL/d(C_{c+1}, n_{c+1}, m_{c+1})
// (dlast for the last chunk), produces dq..df of its positions and dL/d(C_c, n_c, m_c), which is
// carried to chunk c - 1 (and is dinit after chunk 0):
//   1. end state: dws[Lc-1] = <dC, C_c> + <dn, n_c>, dE[Lc-1,w] = k_w^T dC v_w + k_w.dn,
//      dk_w, dv_w += E[Lc-1,w] (dC v_w + dn), E[Lc-1,w] dC^T k_w,  dC_c = ws[Lc-1] dC, dn_c = ws[Lc-1] dn,
//      dm[Lc-1] += dm (m_{c+1} is m[Lc-1] itself)
//   2. each u: h = num / den (den gradient into b or exp(-m), the max's ties split in halves,
//      sign(0) = 0); num, b into ws[u], C_c, n_c, qs_u, P[u,w], v_w; P = A E into A (-> q, k) and
//      into the exponent Dl[u,w] - m[u]; ws = exp(g - m) into g[u] - m[u]
//   3. dm[u] goes whole to the arg-max candidate of m[u] (g[u] or Dl[u,w*])
//   4. dDl -> di, d lf by mlstm_decay_matrix_bwd on the chunk's Lc x Lc matrix; g[u] = Fl[u] + m_c:
//      dm_c = sum_u dg[u], d lf_x += sum_{u >= x} dg[u]; df = d lf sigmoid(-f)
// TIES: the forward's scan order decides, dm[u] goes to the first maximal candidate of
// (g[u], Dl[u,0], ..., Dl[u,u]) (torch.max's first index with the state term in front). The
// recurrent backward instead splits a tie of max(lf_t + m_{t-1}, i_t) in halves at every step, so the
// two agree everywhere except at exact ties, where each is a subgradient (the normaliser's max
// max(|b|, exp(-m)) splits ties in halves in both, as the parallel form does).
void mlstm_chunkwise_bwd(const MlstmShape& sh, const MlstmInputs& in, double eps, std::int64_t L,
                         const MlstmConstState& init, const double* dh, const MlstmConstState& dlast,
                         const MlstmGrads& g, const MlstmState& dinit) {
  const std::int64_t S = sh.S, DQK = sh.DQK, DV = sh.DV, CS = DQK * DV;
  const std::int64_t NC = (S + L - 1) / L, Lm = std::min(L, S);  // Lm: the longest chunk
  const double scale = 1.0 / std::sqrt(double(DQK));
  HeadState st;
  ChunkHead ch;
  // boundary states: index c = the state entering chunk c (NC = after the last chunk)
  std::vector<double> Cb((NC + 1) * CS);    // (NC+1, DQK, DV)
  std::vector<double> Nb((NC + 1) * DQK);   // (NC+1, DQK)
  std::vector<double> Mb(NC + 1);           // (NC+1)
  std::vector<double> dc(CS), dc0(CS);      // (DQK, DV): dL/dC of the chunk's end state, of its input state
  std::vector<double> dn(DQK), dn0(DQK);    // (DQK): the same for n
  std::vector<double> dmu(Lm), dg(Lm);      // (Lc): dL/d m[u], dL/d g[u]
  std::vector<double> dws(Lm);              // (Lc): dL/d ws[u]
  std::vector<double> dDl(Lm * Lm);         // (Lc, Lc): dL/d Dl[u,w] (0 above the diagonal)
  std::vector<double> dqs(Lm * DQK);        // (Lc, DQK): dL/d qs_u (qs = q / sqrt(DQK))
  std::vector<double> dkc(Lm * DQK);        // (Lc, DQK): dL/d k_w
  std::vector<double> dvc(Lm * DV);         // (Lc, DV): dL/d v_w
  std::vector<double> dnum(Lm * DV);        // (Lc, DV): dL/d num[u]
  std::vector<double> di_c(Lm), df_c(Lm);   // (Lc): di, df of the chunk's positions
  for (std::int64_t bh = 0; bh < sh.heads(); ++bh) {
    const HeadPtrs p = head_ptrs(sh, in, bh);
    // pass 1: the states at every chunk boundary
    st.load(sh, init, bh);
    for (std::int64_t c = 0; c <= NC; ++c) {
      std::copy(st.c.begin(), st.c.end(), Cb.begin() + c * CS);
      std::copy(st.n.begin(), st.n.end(), Nb.begin() + c * DQK);
      Mb[c] = st.m;
      if (c == NC) break;
      const std::int64_t t0 = c * L, Lc = std::min(L, S - t0);
      ch.run(Lc, DQK, DV, p.q + t0 * DQK, p.k + t0 * DQK, p.v + t0 * DV, p.i + t0, p.f + t0, st.c.data(),
             st.n.data(), st.m, eps);
      ch.end_state(p.k + t0 * DQK, p.v + t0 * DV, st.c.data(), st.n.data(), Cb.data() + (c + 1) * CS,
                   Nb.data() + (c + 1) * DQK, st.m);
      std::copy_n(Cb.begin() + (c + 1) * CS, CS, st.c.begin());
      std::copy_n(Nb.begin() + (c + 1) * DQK, DQK, st.n.begin());
    }
    // pass 2: chunks in reverse, carrying (dc, dn, dm)
    for (std::int64_t x = 0; x < CS; ++x) dc[x] = dlast.c ? dlast.c[bh * CS + x] : 0.0;
    for (std::int64_t a = 0; a < DQK; ++a) dn[a] = dlast.n ? dlast.n[bh * DQK + a] : 0.0;
    double dm = dlast.m ? dlast.m[bh] : 0.0;
    for (std::int64_t c = NC - 1; c >= 0; --c) {
      const std::int64_t t0 = c * L, Lc = std::min(L, S - t0);
      const double *q = p.q + t0 * DQK, *k = p.k + t0 * DQK, *v = p.v + t0 * DV, *ig = p.i + t0, *fg = p.f + t0;
      const double *c0 = Cb.data() + c * CS, *n0 = Nb.data() + c * DQK;
      const double m0 = Mb[c];
      ch.run(Lc, DQK, DV, q, k, v, ig, fg, c0, n0, m0, eps);
      std::fill_n(dmu.begin(), Lc, 0.0), std::fill_n(dg.begin(), Lc, 0.0), std::fill_n(dws.begin(), Lc, 0.0);
      std::fill_n(dDl.begin(), Lc * Lc, 0.0);
      std::fill_n(dqs.begin(), Lc * DQK, 0.0), std::fill_n(dkc.begin(), Lc * DQK, 0.0);
      std::fill_n(dvc.begin(), Lc * DV, 0.0);

      // 1. the end state (C_{c+1}, n_{c+1}, m_{c+1}) <- row Lc-1 of the chunk
      const std::int64_t r = Lc - 1;
      for (std::int64_t a = 0; a < DQK; ++a) {
        dws[r] += dn[a] * n0[a];
        for (std::int64_t j = 0; j < DV; ++j) dws[r] += dc[a * DV + j] * c0[a * DV + j];
      }
      for (std::int64_t w = 0; w < Lc; ++w) {
        const double e = ch.E[r * Lc + w];
        double de = 0.0;
        for (std::int64_t a = 0; a < DQK; ++a) {
          double dcv = dn[a];  // (dC v_w + dn)[a]
          for (std::int64_t j = 0; j < DV; ++j) dcv += dc[a * DV + j] * v[w * DV + j];
          de += k[w * DQK + a] * dcv;
          dkc[w * DQK + a] += e * dcv;
        }
        for (std::int64_t j = 0; j < DV; ++j) {
          double acc = 0.0;
          for (std::int64_t a = 0; a < DQK; ++a) acc += dc[a * DV + j] * k[w * DQK + a];
          dvc[w * DV + j] += e * acc;
        }
        // E = exp(Dl - m): d(exponent) = dE E
        dDl[r * Lc + w] += de * e;
        dmu[r] -= de * e;
      }
      dmu[r] += dm;
      for (std::int64_t x = 0; x < CS; ++x) dc0[x] = ch.ws[r] * dc[x];
      for (std::int64_t a = 0; a < DQK; ++a) dn0[a] = ch.ws[r] * dn[a];

      // 2. the outputs h[u] = num[u] / den[u]
      for (std::int64_t u = 0; u < Lc; ++u) {
        const double* dhu = dh + (bh * S + t0 + u) * DV;
        const double den = ch.den[u];
        double dh_num = 0.0;
        for (std::int64_t j = 0; j < DV; ++j) {
          dnum[u * DV + j] = dhu[j] / den;
          dh_num += dhu[j] * ch.num[u * DV + j];
        }
        const double dden = -dh_num / (den * den);
        // den = max(|b|, exp(-m)) + eps: ties split in halves, sign(0) = 0
        const double ab = std::abs(ch.b[u]), em = std::exp(-ch.m[u]);
        const double w_b = ab > em ? 1.0 : (ab < em ? 0.0 : 0.5);
        const double db = dden * w_b * (ch.b[u] > 0 ? 1.0 : (ch.b[u] < 0 ? -1.0 : 0.0));
        dmu[u] += dden * (1.0 - w_b) * (-em);
        // state term of num and b: ws[u] (qs_u^T C_c), ws[u] (qs_u.n_c)
        const double wsu = ch.ws[u];
        dws[u] += db * ch.qn[u];
        for (std::int64_t j = 0; j < DV; ++j) dws[u] += dnum[u * DV + j] * ch.qC[u * DV + j];
        for (std::int64_t a = 0; a < DQK; ++a) {
          const double qa = q[u * DQK + a] * scale;
          double acc = db * n0[a];
          for (std::int64_t j = 0; j < DV; ++j) {
            acc += c0[a * DV + j] * dnum[u * DV + j];
            dc0[a * DV + j] += wsu * qa * dnum[u * DV + j];
          }
          dn0[a] += wsu * db * qa;
          dqs[u * DQK + a] += wsu * acc;
        }
        // intra-chunk term: P[u,w] = A[u,w] E[u,w] enters num (times v_w) and b
        for (std::int64_t w = 0; w <= u; ++w) {
          const double P = ch.A[u * Lc + w] * ch.E[u * Lc + w];
          double dP = db;
          for (std::int64_t j = 0; j < DV; ++j) {
            dP += dnum[u * DV + j] * v[w * DV + j];
            dvc[w * DV + j] += P * dnum[u * DV + j];
          }
          const double dA = dP * ch.E[u * Lc + w];
          for (std::int64_t a = 0; a < DQK; ++a) {
            dqs[u * DQK + a] += dA * k[w * DQK + a];
            dkc[w * DQK + a] += dA * q[u * DQK + a] * scale;
          }
          dDl[u * Lc + w] += dP * P;  // d(Dl - m) = dP P
          dmu[u] -= dP * P;
        }
        // ws = exp(g - m)
        dg[u] += dws[u] * wsu;
        dmu[u] -= dws[u] * wsu;
        // 3. m[u] = max(g[u], Dl[u,:]): all of dm[u] to the arg-max
        if (ch.arg[u] < 0) dg[u] += dmu[u]; else dDl[u * Lc + ch.arg[u]] += dmu[u];
      }

      // 4. to the gates and the incoming m: Dl by the decay-matrix backward, g = Fl + m_c
      const MlstmShape one{1, 1, Lc, DQK, DV};
      mlstm_decay_matrix_bwd(one, fg, dDl.data(), di_c.data(), df_c.data());
      double dm0 = 0.0, suffix = 0.0;
      for (std::int64_t u = Lc - 1; u >= 0; --u) {
        suffix += dg[u];  // sum_{u' >= u} dg[u']: every g[u'] with u' >= u contains lf_u
        df_c[u] += suffix * sigmoid_neg(fg[u]);
      }
      for (std::int64_t u = 0; u < Lc; ++u) dm0 += dg[u];
      for (std::int64_t u = 0; u < Lc; ++u) {
        const std::int64_t t = bh * S + t0 + u;
        if (g.di) g.di[t] = di_c[u];
        if (g.df) g.df[t] = df_c[u];
        for (std::int64_t a = 0; a < DQK; ++a) {
          if (g.dq) g.dq[t * DQK + a] = dqs[u * DQK + a] * scale;
          if (g.dk) g.dk[t * DQK + a] = dkc[u * DQK + a];
        }
        if (g.dv) std::copy_n(dvc.begin() + u * DV, DV, g.dv + t * DV);
      }
      dc.swap(dc0);
      dn.swap(dn0);
      dm = dm0;
    }
    if (dinit.c) std::copy(dc.begin(), dc.end(), dinit.c + bh * CS);
    if (dinit.n) std::copy(dn.begin(), dn.end(), dinit.n + bh * DQK);
    if (dinit.m) dinit.m[bh] = dm;
  }
}

// ---- 5. head-norm fusion -------------------------------------------------------------------------
// out = headnorm(h) with h from mlstm_chunkwise_fwd; the backward is the row layer-norm backward
//   g = dout * s (s = weight_offset + weight, 1 without), dh = rstd (g - mean(g) - xhat mean(g xhat))
// followed by mlstm_chunkwise_bwd with dh. Composed, not fused: the reference is the definition.
namespace {

// Per-row statistics of one (b, head, t) row x (DV): two-pass mean and population variance.
void row_stats(const double* x, std::int64_t DV, double eps, double& mean, double& rstd) {
  mean = 0.0;
  for (std::int64_t j = 0; j < DV; ++j) mean += x[j];
  mean /= double(DV);
  double var = 0.0;
  for (std::int64_t j = 0; j < DV; ++j) var += (x[j] - mean) * (x[j] - mean);
  var /= double(DV);
  rstd = 1.0 / std::sqrt(var + eps);
}

double norm_scale(const MlstmHeadNorm& norm, std::int64_t idx) {
  return norm.weight ? norm.weight_offset + norm.weight[idx] : 1.0;
}

}  // namespace

void mlstm_headnorm_rows_fwd(const MlstmShape& sh, const double* h, const MlstmHeadNorm& norm, double* out,
                             double* mean, double* rstd) {
  const std::int64_t S = sh.S, DV = sh.DV;
  for (std::int64_t bh = 0; bh < sh.heads(); ++bh) {
    const std::int64_t nh = bh % sh.NH;
    for (std::int64_t t = 0; t < S; ++t) {
      const std::int64_t r = bh * S + t;
      double mu, rs;
      row_stats(h + r * DV, DV, norm.eps, mu, rs);
      for (std::int64_t j = 0; j < DV; ++j) {
        double y = (h[r * DV + j] - mu) * rs * norm_scale(norm, nh * DV + j);
        if (norm.bias) y += norm.bias[nh * DV + j];
        out[r * DV + j] = y;
      }
      if (mean) mean[r] = mu;
      if (rstd) rstd[r] = rs;
    }
  }
}

namespace {
// dh (B,NH,S,DV) from dout through the head norm of h, and the weight / bias gradients (summed in
// (b, t) order).
void headnorm_rows_bwd(const MlstmShape& sh, const double* h, const MlstmHeadNorm& norm, const double* dout,
                       double* dh, const MlstmHeadNormGrads& gn) {
  const std::int64_t S = sh.S, NH = sh.NH, DV = sh.DV;
  std::vector<double> xhat(DV), gv(DV);                    // (DV): one row
  std::vector<double> dw(NH * DV, 0.0), db(NH * DV, 0.0);  // (NH,DV)
  for (std::int64_t bh = 0; bh < sh.heads(); ++bh) {
    const std::int64_t nh = bh % NH;
    for (std::int64_t t = 0; t < S; ++t) {
      const std::int64_t r = bh * S + t;
      double mu, rs;
      row_stats(h + r * DV, DV, norm.eps, mu, rs);
      double sum_g = 0.0, sum_gx = 0.0;
      for (std::int64_t j = 0; j < DV; ++j) {
        const double dy = dout[r * DV + j];
        xhat[j] = (h[r * DV + j] - mu) * rs;
        gv[j] = dy * norm_scale(norm, nh * DV + j);
        sum_g += gv[j];
        sum_gx += gv[j] * xhat[j];
        dw[nh * DV + j] += dy * xhat[j];
        db[nh * DV + j] += dy;
      }
      const double mg = sum_g / double(DV), mgx = sum_gx / double(DV);
      for (std::int64_t j = 0; j < DV; ++j) dh[r * DV + j] = rs * (gv[j] - mg - xhat[j] * mgx);
    }
  }
  if (gn.dweight) std::copy(dw.begin(), dw.end(), gn.dweight);
  if (gn.dbias) std::copy(db.begin(), db.end(), gn.dbias);
}

}  // namespace

void mlstm_headnorm_fwd(const MlstmShape& sh, const MlstmInputs& in, double eps, std::int64_t L,
                        const MlstmConstState& init, const MlstmHeadNorm& norm, double* out, double* mean,
                        double* rstd, const MlstmState& last) {
  std::vector<double> h(sh.heads() * sh.S * sh.DV);  // (B,NH,S,DV)
  mlstm_chunkwise_fwd(sh, in, eps, L, init, h.data(), last);
  mlstm_headnorm_rows_fwd(sh, h.data(), norm, out, mean, rstd);
}

void mlstm_headnorm_bwd(const MlstmShape& sh, const MlstmInputs& in, double eps, std::int64_t L,
                        const MlstmConstState& init, const MlstmHeadNorm& norm, const double* dout,
                        const MlstmConstState& dlast, const MlstmGrads& g, const MlstmState& dinit,
                        const MlstmHeadNormGrads& gn) {
  std::vector<double> h(sh.heads() * sh.S * sh.DV), dh(h.size());  // (B,NH,S,DV)
  mlstm_chunkwise_fwd(sh, in, eps, L, init, h.data(), {});
  headnorm_rows_bwd(sh, h.data(), norm, dout, dh.data(), gn);
  mlstm_chunkwise_bwd(sh, in, eps, L, init, dh.data(), dlast, g, dinit);
}

void mlstm_parallel_headnorm_fwd(const MlstmShape& sh, const MlstmInputs& in, double eps, const MlstmHeadNorm& norm,
                                 double* out, double* mean, double* rstd, double* h) {
  std::vector<double> hv(sh.heads() * sh.S * sh.DV);  // (B,NH,S,DV)
  mlstm_parallel_fwd(sh, in, eps, hv.data(), nullptr, nullptr);
  mlstm_headnorm_rows_fwd(sh, hv.data(), norm, out, mean, rstd);
  if (h) std::copy(hv.begin(), hv.end(), h);
}

void mlstm_parallel_headnorm_bwd(const MlstmShape& sh, const MlstmInputs& in, double eps, const MlstmHeadNorm& norm,
                                 const double* dout, const MlstmGrads& g, const MlstmHeadNormGrads& gn) {
  std::vector<double> h(sh.heads() * sh.S * sh.DV), dh(h.size());  // (B,NH,S,DV)
  mlstm_parallel_fwd(sh, in, eps, h.data(), nullptr, nullptr);
  headnorm_rows_bwd(sh, h.data(), norm, dout, dh.data(), gn);
  mlstm_parallel_bwd(sh, in, eps, dh.data(), g);
}

}  // namespace fastweight::detail
