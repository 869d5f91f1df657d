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
//              one unrolled; so chunkwise == recurrent in exact arithmetic for every eps.
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
                        double* m) {
  ParallelHead ph;
  for (std::int64_t bh = 0; bh < sh.heads(); ++bh) {
    const HeadPtrs p = head_ptrs(sh, in, bh);
    ph.run(sh.S, sh.DQK, sh.DV, p.q, p.k, p.v, p.i, p.f, eps);
    std::copy(ph.h.begin(), ph.h.end(), h + bh * sh.S * sh.DV);
    if (n) std::copy(ph.n.begin(), ph.n.end(), n + bh * sh.S);
    if (m) std::copy(ph.m.begin(), ph.m.end(), m + bh * sh.S);
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
void mlstm_chunkwise_fwd(const MlstmShape& sh, const MlstmInputs& in, double eps, std::int64_t L,
                         const MlstmConstState& init, double* h, const MlstmState& last) {
  const std::int64_t S = sh.S, DQK = sh.DQK, DV = sh.DV;
  const double scale = 1.0 / std::sqrt(double(DQK));
  HeadState st;
  std::vector<double> Fl, mloc, c_new, n_new;
  for (std::int64_t bh = 0; bh < sh.heads(); ++bh) {
    const HeadPtrs p = head_ptrs(sh, in, bh);
    st.load(sh, init, bh);
    for (std::int64_t t0 = 0; t0 < S; t0 += L) {
      const std::int64_t Lc = std::min(L, S - t0);
      prefix_logf(p.f + t0, Lc, Fl);  // Fl[u] = lf_{t0} + ... + lf_{t0+u}: decay since the state
      mloc.assign(Lc, 0.0);
      for (std::int64_t u = 0; u < Lc; ++u) {
        const std::int64_t t = t0 + u;
        const double* qt = p.q + t * DQK;
        // stabiliser: max over the state's weight and the intra-chunk decay row
        double mt = Fl[u] + st.m;
        for (std::int64_t w = 0; w <= u; ++w) mt = std::max(mt, Fl[u] - Fl[w] + p.i[t0 + w]);
        mloc[u] = mt;
        const double ws = std::exp(Fl[u] + st.m - mt);  // weight of the incoming state
        double bt = 0.0;
        for (std::int64_t a = 0; a < DQK; ++a) bt += qt[a] * scale * st.n[a];
        bt *= ws;
        double* ht = h + (bh * S + t) * DV;
        for (std::int64_t j = 0; j < DV; ++j) {
          double acc = 0.0;
          for (std::int64_t a = 0; a < DQK; ++a) acc += qt[a] * scale * st.c[a * DV + j];
          ht[j] = ws * acc;
        }
        for (std::int64_t w = 0; w <= u; ++w) {
          double a = 0.0;
          for (std::int64_t c = 0; c < DQK; ++c) a += qt[c] * p.k[(t0 + w) * DQK + c];
          const double cw = a * scale * std::exp(Fl[u] - Fl[w] + p.i[t0 + w] - mt);
          bt += cw;
          for (std::int64_t j = 0; j < DV; ++j) ht[j] += cw * p.v[(t0 + w) * DV + j];
        }
        const double den = std::max(std::abs(bt), std::exp(-mt)) + eps;
        for (std::int64_t j = 0; j < DV; ++j) ht[j] /= den;
      }
      // state at the chunk's end, stabilised by the last position's m
      const double m_end = mloc[Lc - 1];
      const double ws = std::exp(Fl[Lc - 1] + st.m - m_end);
      c_new.assign(DQK * DV, 0.0);
      n_new.assign(DQK, 0.0);
      for (std::int64_t a = 0; a < DQK; ++a) {
        n_new[a] = ws * st.n[a];
        for (std::int64_t j = 0; j < DV; ++j) c_new[a * DV + j] = ws * st.c[a * DV + j];
      }
      for (std::int64_t w = 0; w < Lc; ++w) {
        const double e = std::exp(Fl[Lc - 1] - Fl[w] + p.i[t0 + w] - m_end);
        const double* kw = p.k + (t0 + w) * DQK;
        const double* vw = p.v + (t0 + w) * DV;
        for (std::int64_t a = 0; a < DQK; ++a) {
          n_new[a] += e * kw[a];
          for (std::int64_t j = 0; j < DV; ++j) c_new[a * DV + j] += e * kw[a] * vw[j];
        }
      }
      st.c.swap(c_new);
      st.n.swap(n_new);
      st.m = m_end;
    }
    st.store(sh, last, bh);
  }
}

}  // namespace fastweight::detail
