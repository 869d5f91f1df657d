// test_mlstm_reference.cpp: the CPU mLSTM reference (src/reference/mlstm_ref.cpp) is the definition,
// so it is checked three ways:
//  1. against tests/golden/mlstm.txt from an independent float64 PyTorch autograd script
//     (tests/golden/make_golden_mlstm.py): decay matrix fwd/bwd, parallel h, n, m and dq..df,
//     chunkwise and head-norm-fused fwd/bwd with initial states and last-state gradients;
//  2. its backwards against float64 central finite differences of its forwards (L = sum(dh * h)),
//     including strong decay / large gates (|i|, |f| = 20);
//  3. consistency of the forms: parallel == recurrent (eps = 0, zero states), recurrent over S ==
//     recurrent over S1 then S2 through the states, step x S == recurrent, chunkwise == recurrent
//     (forward and backward), head-norm fused == unfused mLSTM + a head norm written here.
// Errors are relative Frobenius norms ||a - b|| / ||b||.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "ref_util.h"
#include "reference/mlstm_ref.h"

namespace {

using namespace fastweight::detail;
using namespace fwref;

// One problem's inputs, owned.
struct Problem {
  MlstmShape sh;
  Vec q, k, v, i, f;
  MlstmInputs in() const { return {q.data(), k.data(), v.data(), i.data(), f.data()}; }
};

enum class Gates { normal, negative_i, extreme, mixed };

Problem make_problem(MlstmShape sh, std::uint64_t seed, Gates gates) {
  std::mt19937_64 rng(seed);
  Problem p{sh, {}, {}, {}, {}, {}};
  const std::size_t nqk = sh.heads() * sh.S * sh.DQK, nv = sh.heads() * sh.S * sh.DV, ng = sh.heads() * sh.S;
  p.q = randn(nqk, rng), p.k = randn(nqk, rng), p.v = randn(nv, rng);
  switch (gates) {
    case Gates::normal: p.i = randn(ng, rng, 0.0, 1.5), p.f = randn(ng, rng, 2.0, 1.5); break;
    case Gates::negative_i: p.i = randn(ng, rng, -2.0, 2.0), p.f = randn(ng, rng, 1.0, 2.0); break;
    case Gates::extreme: p.i.assign(ng, 20.0), p.f.assign(ng, -20.0); break;
    case Gates::mixed: {  // each gate N(-20, 1), N(+20, 1) or N(0, 2): strong decay next to long memory.
      // Not exactly +-20: with f = +20 (lf ~ -2e-9) two equal i = 20 would put the stabiliser's max
      // within a finite-difference step of a tie (a kink), where differences are meaningless.
      std::uniform_int_distribution<int> pick(0, 2);
      std::normal_distribution<double> nd(0.0, 2.0), jitter(0.0, 1.0);
      p.i.resize(ng), p.f.resize(ng);
      for (auto* g : {&p.i, &p.f})
        for (auto& x : *g) { const int c = pick(rng); x = c == 0 ? -20.0 + jitter(rng) : c == 1 ? 20.0 + jitter(rng) : nd(rng); }
      break;
    }
  }
  return p;
}

// ---- 1. golden file -----------------------------------------------------------------------------
const std::map<std::string, Golden>& golden() {
  static const auto g = load_golden(FW_GOLDEN_DIR "/mlstm.txt");
  return g;
}

TEST(MlstmGolden, DecayMatrixMatchesFloat64Autograd) {
  const auto& g = golden();
  const auto& i = g.at("decay.i");
  const MlstmShape sh{i.shape[0], i.shape[1], i.shape[2], 0, 0};
  Vec D(sh.heads() * sh.S * sh.S), di(i.v.size()), df(i.v.size());
  mlstm_decay_matrix_fwd(sh, i.v.data(), g.at("decay.f").v.data(), D.data());
  const Vec& Dg = g.at("decay.D").v;
  Vec Df, Dgf;  // finite entries; the -inf ones must coincide exactly
  for (std::size_t x = 0; x < D.size(); ++x) {
    ASSERT_EQ(std::isinf(D[x]), std::isinf(Dg[x])) << x;
    if (std::isinf(D[x])) { EXPECT_LT(D[x], 0); EXPECT_EQ(D[x], Dg[x]); } else { Df.push_back(D[x]); Dgf.push_back(Dg[x]); }
  }
  mlstm_decay_matrix_bwd(sh, g.at("decay.f").v.data(), g.at("decay.dD").v.data(), di.data(), df.data());
  const double eD = rel_err(Df, Dgf), ei = rel_err(di, g.at("decay.di").v), ef = rel_err(df, g.at("decay.df").v);
  RecordProperty("err_D", std::to_string(eD));
  std::printf("[golden decay] D %.3g  di %.3g  df %.3g\n", eD, ei, ef);
  EXPECT_LT(eD, 1e-14);
  EXPECT_LT(ei, 1e-14);
  EXPECT_LT(ef, 1e-13);
}

class MlstmGoldenParallel : public ::testing::TestWithParam<std::string> {};

TEST_P(MlstmGoldenParallel, MatchesFloat64Autograd) {
  const auto& g = golden();
  const std::string c = GetParam();
  const auto& q = g.at(c + ".q");
  const auto& v = g.at(c + ".v");
  const MlstmShape sh{q.shape[0], q.shape[1], q.shape[2], q.shape[3], v.shape[3]};
  const double eps = g.at(c + ".eps").v[0];
  const MlstmInputs in{q.v.data(), g.at(c + ".k").v.data(), v.v.data(), g.at(c + ".i").v.data(),
                       g.at(c + ".f").v.data()};
  const std::size_t nqk = q.v.size(), nv = v.v.size(), ng = sh.heads() * sh.S;
  Vec h(nv), n(ng), m(ng), dq(nqk), dk(nqk), dv(nv), di(ng), df(ng);
  mlstm_parallel_fwd(sh, in, eps, h.data(), n.data(), m.data());
  mlstm_parallel_bwd(sh, in, eps, g.at(c + ".dh").v.data(), {dq.data(), dk.data(), dv.data(), di.data(), df.data()});
  const double e[] = {rel_err(h, g.at(c + ".h").v),   rel_err(n, g.at(c + ".n").v),   rel_err(m, g.at(c + ".m").v),
                      rel_err(dq, g.at(c + ".dq").v), rel_err(dk, g.at(c + ".dk").v), rel_err(dv, g.at(c + ".dv").v),
                      rel_err(di, g.at(c + ".di").v), rel_err(df, g.at(c + ".df").v)};
  std::printf("[golden %s] h %.3g n %.3g m %.3g dq %.3g dk %.3g dv %.3g di %.3g df %.3g\n", c.c_str(), e[0], e[1],
              e[2], e[3], e[4], e[5], e[6], e[7]);
  for (int x = 0; x < 3; ++x) EXPECT_LT(e[x], 1e-14) << x;
  // parallel_extreme (f = -20, i = +20, eps = 1e-6): the diagonal of D dominates every row, so
  // h_t ~ q.k_t v_t / (|q.k_t| + eps) and dq, dk (~eps / (q.k)^2) come out of the cancellation of
  // O(1) terms, in torch as here: agreement ~1e-12 relative to these small values.
  const double tol_qk = c == "parallel_extreme" ? 1e-10 : 1e-12;
  for (int x = 3; x < 5; ++x) EXPECT_LT(e[x], tol_qk) << x;
  for (int x = 5; x < 8; ++x) EXPECT_LT(e[x], 1e-12) << x;
}
INSTANTIATE_TEST_SUITE_P(Mlstm, MlstmGoldenParallel,
                         ::testing::Values("parallel", "parallel_eps", "parallel_extreme"));

// ---- 2. finite differences ----------------------------------------------------------------------
TEST(MlstmFiniteDiff, DecayMatrixBackward) {
  const MlstmShape sh{2, 1, 7, 0, 0};
  Problem p = make_problem({2, 1, 7, 1, 1}, 5, Gates::normal);
  std::mt19937_64 rng(6);
  Vec dD = randn(sh.heads() * sh.S * sh.S, rng), D(dD.size()), di(p.i.size()), df(p.f.size());
  auto loss = [&] {
    mlstm_decay_matrix_fwd(sh, p.i.data(), p.f.data(), D.data());
    double l = 0.0;
    for (std::size_t x = 0; x < D.size(); ++x)
      if (std::isfinite(D[x])) l += dD[x] * D[x];
    return l;
  };
  mlstm_decay_matrix_bwd(sh, p.f.data(), dD.data(), di.data(), df.data());  // upper entries of dD ignored
  const double ei = rel_err(di, central_diff(p.i, loss)), ef = rel_err(df, central_diff(p.f, loss));
  std::printf("[fd decay] di %.3g df %.3g\n", ei, ef);
  EXPECT_LT(ei, 1e-8);
  EXPECT_LT(ef, 1e-8);
  for (std::int64_t bh = 0; bh < sh.heads(); ++bh) EXPECT_EQ(df[bh * sh.S], 0.0);  // lf_1 cancels
}

struct FdCase {
  const char* name;
  Gates gates;
  double eps;
  double tol_qkv, tol_if;
  // > 0: di, df errors are ||a - fd|| / max(||fd||, if_floor * ||(dq, dk, dv)||). Needed where the
  // gate gradients are ~exp(-20) of the rest (f = -20, i = +20: |di| ~ 2e-8 next to |dq,dk,dv| ~ 12):
  // central differences only resolve them to ~1e-16 |L| / h absolutely, so there the check is an
  // absolute one at tol_if * if_floor = 1e-9 of the gradient's size; their exact values are checked
  // against torch autograd (golden case parallel_extreme) to ~1e-16 relative.
  double if_floor = 0.0;
};
class MlstmFiniteDiffParallel : public ::testing::TestWithParam<FdCase> {};

TEST_P(MlstmFiniteDiffParallel, BackwardMatchesCentralDifferences) {
  const FdCase fc = GetParam();
  Problem p = make_problem({2, 2, 7, 5, 3}, 17 + int(fc.gates), fc.gates);
  const MlstmShape& sh = p.sh;
  std::mt19937_64 rng(99);
  const Vec dh = randn(p.v.size(), rng);
  Vec h(p.v.size()), n(p.i.size()), m(p.i.size());
  auto loss = [&] {
    mlstm_parallel_fwd(sh, p.in(), fc.eps, h.data(), nullptr, nullptr);
    return dot(dh, h);
  };
  Vec dq(p.q.size()), dk(p.k.size()), dv(p.v.size()), di(p.i.size()), df(p.f.size());
  mlstm_parallel_fwd(sh, p.in(), fc.eps, h.data(), n.data(), m.data());
  ASSERT_TRUE(all_finite(h) && all_finite(n) && all_finite(m));
  mlstm_parallel_bwd(sh, p.in(), fc.eps, dh.data(), {dq.data(), dk.data(), dv.data(), di.data(), df.data()});
  for (const Vec* g : {&dq, &dk, &dv, &di, &df}) ASSERT_TRUE(all_finite(*g));
  const Vec fdi = central_diff(p.i, loss), fdf = central_diff(p.f, loss);
  double e[] = {rel_err(dq, central_diff(p.q, loss)), rel_err(dk, central_diff(p.k, loss)),
                rel_err(dv, central_diff(p.v, loss)), rel_err(di, fdi), rel_err(df, fdf)};
  std::printf("[fd %s] dq %.3g dk %.3g dv %.3g di %.3g df %.3g", fc.name, e[0], e[1], e[2], e[3], e[4]);
  if (fc.if_floor > 0) {
    const double scale = fc.if_floor * std::sqrt(dot(dq, dq) + dot(dk, dk) + dot(dv, dv));
    const double ni = std::sqrt(dot(fdi, fdi)), nf = std::sqrt(dot(fdf, fdf));
    e[3] *= ni / std::max(ni, scale);
    e[4] *= nf / std::max(nf, scale);
    std::printf("  (floored: di %.3g df %.3g; |di| %.3g |df| %.3g |dq,dk,dv| %.3g)", e[3], e[4], ni, nf,
                scale / fc.if_floor);
  }
  std::printf("\n");
  for (int x = 0; x < 3; ++x) EXPECT_LT(e[x], fc.tol_qkv) << x;
  for (int x = 3; x < 5; ++x) EXPECT_LT(e[x], fc.tol_if) << x;
}
INSTANTIATE_TEST_SUITE_P(
    Mlstm, MlstmFiniteDiffParallel,
    ::testing::Values(FdCase{"normal", Gates::normal, 1e-6, 1e-6, 1e-6},
                      FdCase{"big_eps_negative_i", Gates::negative_i, 0.25, 1e-6, 1e-6},
                      FdCase{"mixed_pm20", Gates::mixed, 1e-6, 1e-6, 1e-6},
                      // eps = 0.25: with eps = 1e-6 and a dominant diagonal, h_t ~ sign(q.k_t) v_t and
                      // dq, dk are ~eps-sized, below what differences resolve (golden covers it)
                      FdCase{"extreme_f-20_i+20", Gates::extreme, 0.25, 1e-6, 1e-6, 1e-3}),
    [](const auto& info) {
      std::string s = info.param.name;
      for (auto& ch : s) if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
      return s;
    });

// ---- 3. forms agree -----------------------------------------------------------------------------
TEST(MlstmForms, ParallelEqualsRecurrent) {
  for (Gates gates : {Gates::normal, Gates::negative_i, Gates::mixed, Gates::extreme}) {
    const Problem p = make_problem({2, 3, 7, 5, 3}, 31 + int(gates), gates);
    Vec hp(p.v.size()), hr(p.v.size());
    mlstm_parallel_fwd(p.sh, p.in(), 0.0, hp.data(), nullptr, nullptr);
    mlstm_recurrent_fwd(p.sh, p.in(), 0.0, {}, hr.data(), {});
    const double e = rel_err(hr, hp);
    std::printf("[forms parallel==recurrent gates=%d] h %.3g\n", int(gates), e);
    EXPECT_LT(e, 1e-12) << int(gates);
  }
}

struct States {
  Vec c, n, m;
  States(const MlstmShape& sh) : c(sh.heads() * sh.DQK * sh.DV), n(sh.heads() * sh.DQK), m(sh.heads()) {}
  MlstmState out() { return {c.data(), n.data(), m.data()}; }
  MlstmConstState in() const { return {c.data(), n.data(), m.data()}; }
};

States random_states(const MlstmShape& sh, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  States s(sh);
  s.c = randn(s.c.size(), rng), s.n = randn(s.n.size(), rng), s.m = randn(s.m.size(), rng);
  return s;
}

// slice positions [t0, t0 + len) of a (B,NH,S,X) tensor
Vec slice(const Vec& x, const MlstmShape& sh, std::int64_t X, std::int64_t t0, std::int64_t len) {
  Vec out;
  for (std::int64_t bh = 0; bh < sh.heads(); ++bh)
    out.insert(out.end(), x.begin() + (bh * sh.S + t0) * X, x.begin() + (bh * sh.S + t0 + len) * X);
  return out;
}

TEST(MlstmForms, RecurrentSplitThroughStates) {
  const Problem p = make_problem({2, 2, 7, 5, 3}, 41, Gates::normal);
  const MlstmShape& sh = p.sh;
  const States init = random_states(sh, 42);
  const double eps = 1e-6;
  Vec h(p.v.size());
  States last(sh);
  mlstm_recurrent_fwd(sh, p.in(), eps, init.in(), h.data(), last.out());
  const std::int64_t S1 = 3, S2 = sh.S - S1;
  Problem a{{sh.B, sh.NH, S1, sh.DQK, sh.DV}, slice(p.q, sh, sh.DQK, 0, S1), slice(p.k, sh, sh.DQK, 0, S1),
            slice(p.v, sh, sh.DV, 0, S1), slice(p.i, sh, 1, 0, S1), slice(p.f, sh, 1, 0, S1)};
  Problem b{{sh.B, sh.NH, S2, sh.DQK, sh.DV}, slice(p.q, sh, sh.DQK, S1, S2), slice(p.k, sh, sh.DQK, S1, S2),
            slice(p.v, sh, sh.DV, S1, S2), slice(p.i, sh, 1, S1, S2), slice(p.f, sh, 1, S1, S2)};
  Vec ha(a.v.size()), hb(b.v.size());
  States mid(sh), end(sh);
  mlstm_recurrent_fwd(a.sh, a.in(), eps, init.in(), ha.data(), mid.out());
  mlstm_recurrent_fwd(b.sh, b.in(), eps, mid.in(), hb.data(), end.out());
  const double e[] = {rel_err(ha, slice(h, sh, sh.DV, 0, S1)), rel_err(hb, slice(h, sh, sh.DV, S1, S2)),
                      rel_err(end.c, last.c), rel_err(end.n, last.n), rel_err(end.m, last.m)};
  std::printf("[forms split] h1 %.3g h2 %.3g c %.3g n %.3g m %.3g\n", e[0], e[1], e[2], e[3], e[4]);
  for (double x : e) EXPECT_LT(x, 1e-15);
}

TEST(MlstmForms, StepEqualsRecurrent) {
  const Problem p = make_problem({2, 2, 7, 5, 3}, 51, Gates::mixed);
  const MlstmShape& sh = p.sh;
  const States init = random_states(sh, 52);
  const double eps = 1e-6;
  Vec h(p.v.size());
  States last(sh);
  mlstm_recurrent_fwd(sh, p.in(), eps, init.in(), h.data(), last.out());
  States st = init;
  Vec hs(p.v.size());
  for (std::int64_t t = 0; t < sh.S; ++t) {
    Vec q = slice(p.q, sh, sh.DQK, t, 1), k = slice(p.k, sh, sh.DQK, t, 1), v = slice(p.v, sh, sh.DV, t, 1);
    Vec i = slice(p.i, sh, 1, t, 1), f = slice(p.f, sh, 1, t, 1), ht(sh.heads() * sh.DV);
    mlstm_step(sh, q.data(), k.data(), v.data(), i.data(), f.data(), eps, st.out(), ht.data());
    for (std::int64_t bh = 0; bh < sh.heads(); ++bh)
      std::copy_n(ht.begin() + bh * sh.DV, sh.DV, hs.begin() + (bh * sh.S + t) * sh.DV);
  }
  const double e[] = {rel_err(hs, h), rel_err(st.c, last.c), rel_err(st.n, last.n), rel_err(st.m, last.m)};
  std::printf("[forms step] h %.3g c %.3g n %.3g m %.3g\n", e[0], e[1], e[2], e[3]);
  for (double x : e) EXPECT_EQ(x, 0.0);  // the same arithmetic, step by step
}

TEST(MlstmForms, ChunkwiseEqualsRecurrent) {
  for (Gates gates : {Gates::normal, Gates::negative_i, Gates::mixed}) {
    const Problem p = make_problem({2, 2, 11, 5, 3}, 61 + int(gates), gates);
    const MlstmShape& sh = p.sh;
    const States init = random_states(sh, 62);
    for (const bool with_init : {false, true}) {
      for (double eps : {0.0, 1e-6, 0.25}) {
        Vec hr(p.v.size());
        States lr(sh);
        const MlstmConstState is = with_init ? init.in() : MlstmConstState{};
        mlstm_recurrent_fwd(sh, p.in(), eps, is, hr.data(), lr.out());
        for (std::int64_t L : {1, 2, 3, 4, 11, 16}) {
          Vec hc(p.v.size());
          States lc(sh);
          mlstm_chunkwise_fwd(sh, p.in(), eps, L, is, hc.data(), lc.out());
          const double e[] = {rel_err(hc, hr), rel_err(lc.c, lr.c), rel_err(lc.n, lr.n), rel_err(lc.m, lr.m)};
          if (L == 4)
            std::printf("[forms chunkwise L=4 gates=%d init=%d eps=%g] h %.3g c %.3g n %.3g m %.3g\n", int(gates),
                        int(with_init), eps, e[0], e[1], e[2], e[3]);
          for (double x : e) EXPECT_LT(x, 1e-12) << "gates " << int(gates) << " L " << L << " eps " << eps;
        }
      }
    }
  }
}

// recurrent backward: L = sum(dh * h) + sum(dC * C_S) + sum(dn * n_S) + dm * m_S, against central
// differences in q, k, v, i, f and the initial states c0, n0, m0
TEST(MlstmFiniteDiff, RecurrentBackward) {
  for (Gates gates : {Gates::normal, Gates::negative_i, Gates::mixed}) {
    for (double eps : {1e-6, 0.25}) {
      Problem p = make_problem({2, 2, 7, 5, 3}, 81 + int(gates), gates);
      const MlstmShape& sh = p.sh;
      States init = random_states(sh, 82);
      std::mt19937_64 rng(83);
      const Vec dh = randn(p.v.size(), rng);
      States dlast(sh);
      dlast.c = randn(dlast.c.size(), rng), dlast.n = randn(dlast.n.size(), rng), dlast.m = randn(dlast.m.size(), rng);
      Vec h(p.v.size());
      States last(sh);
      auto loss = [&] {
        mlstm_recurrent_fwd(sh, p.in(), eps, init.in(), h.data(), last.out());
        return dot(dh, h) + dot(dlast.c, last.c) + dot(dlast.n, last.n) + dot(dlast.m, last.m);
      };
      Vec dq(p.q.size()), dk(p.k.size()), dv(p.v.size()), di(p.i.size()), df(p.f.size());
      States dinit(sh);
      mlstm_recurrent_bwd(sh, p.in(), eps, init.in(), dh.data(), dlast.in(),
                          {dq.data(), dk.data(), dv.data(), di.data(), df.data()}, dinit.out());
      for (const Vec* g : {&dq, &dk, &dv, &di, &df, &dinit.c, &dinit.n, &dinit.m}) ASSERT_TRUE(all_finite(*g));
      const double e[] = {rel_err(dq, central_diff(p.q, loss)),      rel_err(dk, central_diff(p.k, loss)),
                          rel_err(dv, central_diff(p.v, loss)),      rel_err(di, central_diff(p.i, loss)),
                          rel_err(df, central_diff(p.f, loss)),      rel_err(dinit.c, central_diff(init.c, loss)),
                          rel_err(dinit.n, central_diff(init.n, loss)), rel_err(dinit.m, central_diff(init.m, loss))};
      std::printf("[fd recurrent gates=%d eps=%g] dq %.3g dk %.3g dv %.3g di %.3g df %.3g dc0 %.3g dn0 %.3g dm0 %.3g\n",
                  int(gates), eps, e[0], e[1], e[2], e[3], e[4], e[5], e[6], e[7]);
      for (double x : e) EXPECT_LT(x, 1e-6) << "gates " << int(gates) << " eps " << eps;
    }
  }
}

// With eps = 0 and zero initial states h does not depend on the stabiliser, so the recurrent and the
// parallel form are the same function of (q, k, v, i, f) and have the same exact gradient.
TEST(MlstmForms, RecurrentBackwardEqualsParallelBackward) {
  for (Gates gates : {Gates::normal, Gates::negative_i, Gates::mixed}) {
    const Problem p = make_problem({2, 2, 9, 5, 3}, 91 + int(gates), gates);
    std::mt19937_64 rng(92);
    const Vec dh = randn(p.v.size(), rng);
    Vec gp[5] = {Vec(p.q.size()), Vec(p.k.size()), Vec(p.v.size()), Vec(p.i.size()), Vec(p.f.size())};
    Vec gr[5] = {gp[0], gp[1], gp[2], gp[3], gp[4]};
    mlstm_parallel_bwd(p.sh, p.in(), 0.0, dh.data(), {gp[0].data(), gp[1].data(), gp[2].data(), gp[3].data(), gp[4].data()});
    mlstm_recurrent_bwd(p.sh, p.in(), 0.0, {}, dh.data(), {},
                        {gr[0].data(), gr[1].data(), gr[2].data(), gr[3].data(), gr[4].data()}, {});
    double e[5];
    for (int x = 0; x < 5; ++x) e[x] = rel_err(gr[x], gp[x]);
    std::printf("[forms recurrent_bwd==parallel_bwd gates=%d] dq %.3g dk %.3g dv %.3g di %.3g df %.3g\n", int(gates),
                e[0], e[1], e[2], e[3], e[4]);
    for (double x : e) EXPECT_LT(x, 1e-11) << int(gates);
  }
}

TEST(MlstmForms, ParallelStabiliserIsDecayRowMax) {
  const Problem p = make_problem({1, 2, 7, 5, 3}, 71, Gates::normal);
  const MlstmShape& sh = p.sh;
  Vec D(sh.heads() * sh.S * sh.S), h(p.v.size()), n(p.i.size()), m(p.i.size());
  mlstm_decay_matrix_fwd(sh, p.i.data(), p.f.data(), D.data());
  mlstm_parallel_fwd(sh, p.in(), 1e-6, h.data(), n.data(), m.data());
  for (std::int64_t r = 0; r < sh.heads() * sh.S; ++r) {
    double mx = -INFINITY;
    for (std::int64_t s = 0; s < sh.S; ++s) mx = std::max(mx, D[r * sh.S + s]);
    EXPECT_EQ(m[r], mx);
  }
}

// ---- chunkwise backward -------------------------------------------------------------------------
// The gradients of the chunkwise and of the recurrent backward, in one list: dq dk dv di df dc0 dn0 dm0.
struct AllGrads {
  Vec dq, dk, dv, di, df;
  States d0;
  explicit AllGrads(const Problem& p) : dq(p.q.size()), dk(p.k.size()), dv(p.v.size()), di(p.i.size()), df(p.f.size()), d0(p.sh) {}
  MlstmGrads g() { return {dq.data(), dk.data(), dv.data(), di.data(), df.data()}; }
  std::vector<const Vec*> list() const { return {&dq, &dk, &dv, &di, &df, &d0.c, &d0.n, &d0.m}; }
};
constexpr const char* kGradNames[] = {"dq", "dk", "dv", "di", "df", "dc0", "dn0", "dm0", "dweight", "dbias"};

States random_dlast(const MlstmShape& sh, std::uint64_t seed) { return random_states(sh, seed); }

// chunkwise_bwd == recurrent_bwd for every chunk size, eps, with / without initial states and
// last-state gradients, odd S, DQK != DV; the max error of each gradient over all cases is printed.
// Error: ||a - b|| / max(||b||, 1e-3 ||all gradients||). The floor matters only for gradients that
// are exact zeros or results of cancellation, which the two backwards sum in different orders (their
// differences stay ~1e-16 of the gradients' overall size): e.g. S = 1, eps = 0: h = sign(q.k) v, so
// dq = dk = 0 and both return ~1e-16; no initial state, eps = 0: df and dm0 through the stabiliser
// are exactly 0 (h does not depend on m) and come out as ~1e-18; f = -20, i = +20: the gate and
// initial-state gradients are ~exp(-20) of the rest.
TEST(MlstmForms, ChunkwiseBackwardEqualsRecurrentBackward) {
  for (Gates gates : {Gates::normal, Gates::negative_i, Gates::mixed, Gates::extreme}) {
    double worst[8] = {};
    int cases = 0, floored = 0;
    for (std::int64_t S : {1, 7, 13, 37}) {
      const Problem p = make_problem({2, 2, S, 5, 3}, 101 + S + 7 * int(gates), gates);
      const MlstmShape& sh = p.sh;
      const States init = random_states(sh, 102 + S), dlast = random_dlast(sh, 103 + S);
      std::mt19937_64 rng(104 + S);
      const Vec dh = randn(p.v.size(), rng);
      for (const bool with_init : {false, true}) {
        for (const bool with_dlast : {false, true}) {
          const MlstmConstState is = with_init ? init.in() : MlstmConstState{};
          const MlstmConstState dl = with_dlast ? dlast.in() : MlstmConstState{};
          for (double eps : {0.0, 1e-6, 0.25}) {
            AllGrads r(p);
            mlstm_recurrent_bwd(sh, p.in(), eps, is, dh.data(), dl, r.g(), r.d0.out());
            const auto lr = r.list();
            double all = 0.0;
            for (const Vec* y : lr) all += dot(*y, *y);
            const double floor = 1e-3 * std::sqrt(all);
            for (std::int64_t L : {1, 2, 3, 4, 11, 16}) {
              AllGrads c(p);
              mlstm_chunkwise_bwd(sh, p.in(), eps, L, is, dh.data(), dl, c.g(), c.d0.out());
              const auto lc = c.list();
              for (int x = 0; x < 8; ++x) {
                ASSERT_TRUE(all_finite(*lc[x])) << kGradNames[x];
                const double nb = std::sqrt(dot(*lr[x], *lr[x]));
                const double e = rel_err(*lc[x], *lr[x]) * (nb / std::max(nb, floor));
                floored += nb < floor;
                worst[x] = std::max(worst[x], e);
                // i ~ +20 (extreme, mixed) with eps <= 1e-6: a row's own key dominates, h_t ~ q.k_t v_t /
                // (|q.k_t| + eps), and dq, dk (~eps / (q.k)^2, or ~exp(-20) with eps = 0) come out of
                // cancellations of O(1) terms. Against a long-double build of this reference, the
                // recurrent backward is then off by up to ~1e-7 relative, the chunkwise one by ~1e-9.
                const bool eps_sized = (gates == Gates::extreme || gates == Gates::mixed) && eps < 0.1 && x < 2;
                const double tol = eps_sized ? 1e-9 : 1e-12;
                EXPECT_LT(e, tol) << kGradNames[x] << " gates " << int(gates) << " S " << S << " L " << L
                                  << " eps " << eps << " init " << with_init << " dlast " << with_dlast
                                  << " |ref| " << nb << " |all grads| " << std::sqrt(all);
              }
              ++cases;
            }
          }
        }
      }
    }
    std::printf("[forms chunkwise_bwd==recurrent_bwd gates=%d, max over %d cases, %d of %d gradients floored] "
                "dq %.3g dk %.3g dv %.3g di %.3g df %.3g dc0 %.3g dn0 %.3g dm0 %.3g\n",
                int(gates), cases, floored, 8 * cases, worst[0], worst[1], worst[2], worst[3], worst[4], worst[5],
                worst[6], worst[7]);
  }
}

// Error of a gradient against central differences: ||a - fd|| / max(||fd||, floor), floor = 1e-3
// ||all gradients||, for gradients that are tiny next to the rest (gates at +-20: exp(-20)-sized
// gate and initial-state gradients; under the head norm: the normaliser's path), which differences
// only resolve to ~1e-16 |L| / h absolutely; there the check is an absolute one at 1e-9 of the
// gradient's size. floored is set when the floor was used.
double fd_err(const Vec& a, const Vec& fd, double floor, bool& floored) {
  const double nf = std::sqrt(dot(fd, fd)), scale = std::max(nf, floor);
  floored = nf < floor;
  double d = 0.0;
  for (std::size_t x = 0; x < a.size(); ++x) d += (a[x] - fd[x]) * (a[x] - fd[x]);
  return scale > 0 ? std::sqrt(d) / scale : std::sqrt(d);
}
double norm_all(const std::vector<const Vec*>& gs) {
  double s = 0.0;
  for (const Vec* g : gs) s += dot(*g, *g);
  return std::sqrt(s);
}

struct ChunkFdCase {
  const char* name;
  Gates gates;
  double eps;
  std::int64_t L;
};
void PrintTo(const ChunkFdCase& c, std::ostream* os) { *os << c.name; }  // readable CTest names
class MlstmFiniteDiffChunkwise : public ::testing::TestWithParam<ChunkFdCase> {};

// L = sum(dh * h) + sum(dC * C_S) + sum(dn * n_S) + dm * m_S of mlstm_chunkwise_fwd, against central
// differences in q, k, v, i, f and the initial states
TEST_P(MlstmFiniteDiffChunkwise, BackwardMatchesCentralDifferences) {
  const ChunkFdCase fc = GetParam();
  Problem p = make_problem({2, 2, 7, 5, 3}, 111 + int(fc.gates), fc.gates);
  const MlstmShape& sh = p.sh;
  States init = random_states(sh, 112);
  const States dlast = random_dlast(sh, 113);
  std::mt19937_64 rng(114);
  const Vec dh = randn(p.v.size(), rng);
  Vec h(p.v.size());
  States last(sh);
  auto loss = [&] {
    mlstm_chunkwise_fwd(sh, p.in(), fc.eps, fc.L, init.in(), h.data(), last.out());
    return dot(dh, h) + dot(dlast.c, last.c) + dot(dlast.n, last.n) + dot(dlast.m, last.m);
  };
  loss();
  ASSERT_TRUE(all_finite(h) && all_finite(last.c) && all_finite(last.n) && all_finite(last.m));
  AllGrads a(p);
  mlstm_chunkwise_bwd(sh, p.in(), fc.eps, fc.L, init.in(), dh.data(), dlast.in(), a.g(), a.d0.out());
  for (const Vec* g : a.list()) ASSERT_TRUE(all_finite(*g));
  Vec* xs[] = {&p.q, &p.k, &p.v, &p.i, &p.f, &init.c, &init.n, &init.m};
  const auto gl = a.list();
  const double floor = 1e-3 * norm_all(gl);
  std::printf("[fd chunkwise %s]", fc.name);
  for (int x = 0; x < 8; ++x) {
    bool floored = false;
    const double e = fd_err(*gl[x], central_diff(*xs[x], loss), floor, floored);
    std::printf(" %s %.3g%s", kGradNames[x], e, floored ? "*" : "");
    EXPECT_LT(e, 1e-6) << kGradNames[x] << " |grad| " << std::sqrt(dot(*gl[x], *gl[x])) << " floor " << floor;
  }
  std::printf("  (* floored)\n");
}
INSTANTIATE_TEST_SUITE_P(
    Mlstm, MlstmFiniteDiffChunkwise,
    ::testing::Values(ChunkFdCase{"normal_L3", Gates::normal, 1e-6, 3},
                      ChunkFdCase{"negative_i_eps025_L2", Gates::negative_i, 0.25, 2},
                      ChunkFdCase{"mixed_pm20_L4", Gates::mixed, 1e-6, 4},
                      ChunkFdCase{"normal_L1", Gates::normal, 0.25, 1},
                      ChunkFdCase{"normal_L16", Gates::normal, 1e-6, 16},
                      // eps = 0.25: see MlstmFiniteDiffParallel's extreme case
                      ChunkFdCase{"extreme_f-20_i+20_L3", Gates::extreme, 0.25, 3}),
    [](const auto& info) {
      std::string s = info.param.name;
      for (auto& ch : s) if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
      return s;
    });

// ---- head-norm fusion ---------------------------------------------------------------------------
struct NormParams {
  Vec w, b;
  MlstmHeadNorm norm;
};
NormParams random_norm(const MlstmShape& sh, std::uint64_t seed, double eps, double weight_offset, bool with_w,
                       bool with_b) {
  std::mt19937_64 rng(seed);
  NormParams n{randn(sh.NH * sh.DV, rng, 0.0, 0.5), randn(sh.NH * sh.DV, rng), {}};
  n.norm = {with_w ? n.w.data() : nullptr, with_b ? n.b.data() : nullptr, eps, weight_offset};
  return n;
}

// The head norm written out here (MATH.md §1), row by row of x (B,NH,S,DV).
Vec direct_headnorm(const MlstmShape& sh, const Vec& x, const MlstmHeadNorm& nm) {
  Vec y(x.size());
  for (std::int64_t r = 0; r < sh.heads() * sh.S; ++r) {
    const std::int64_t head = (r / sh.S) % sh.NH;
    const double* xr = x.data() + r * sh.DV;
    double mu = 0.0, var = 0.0;
    for (std::int64_t j = 0; j < sh.DV; ++j) mu += xr[j] / double(sh.DV);
    for (std::int64_t j = 0; j < sh.DV; ++j) var += (xr[j] - mu) * (xr[j] - mu) / double(sh.DV);
    for (std::int64_t j = 0; j < sh.DV; ++j) {
      const double s = nm.weight ? nm.weight_offset + nm.weight[head * sh.DV + j] : 1.0;
      y[r * sh.DV + j] = (xr[j] - mu) / std::sqrt(var + nm.eps) * s + (nm.bias ? nm.bias[head * sh.DV + j] : 0.0);
    }
  }
  return y;
}

// Its backward through the explicit Jacobian d xhat_k / d x_j = rstd (delta_kj - 1/DV - xhat_k xhat_j / DV)
// (not the folded formula of the reference), plus dweight, dbias summed over (b, t).
void direct_headnorm_bwd(const MlstmShape& sh, const Vec& x, const MlstmHeadNorm& nm, const Vec& dy, Vec& dx,
                         Vec& dw, Vec& db) {
  const std::int64_t N = sh.DV;
  dx.assign(x.size(), 0.0), dw.assign(sh.NH * N, 0.0), db.assign(sh.NH * N, 0.0);
  Vec xh(N);
  for (std::int64_t r = 0; r < sh.heads() * sh.S; ++r) {
    const std::int64_t head = (r / sh.S) % sh.NH;
    const double* xr = x.data() + r * N;
    double mu = 0.0, var = 0.0;
    for (std::int64_t j = 0; j < N; ++j) mu += xr[j] / double(N);
    for (std::int64_t j = 0; j < N; ++j) var += (xr[j] - mu) * (xr[j] - mu) / double(N);
    const double rstd = 1.0 / std::sqrt(var + nm.eps);
    for (std::int64_t j = 0; j < N; ++j) xh[j] = (xr[j] - mu) * rstd;
    for (std::int64_t kk = 0; kk < N; ++kk) {
      const double gk = dy[r * N + kk] * (nm.weight ? nm.weight_offset + nm.weight[head * N + kk] : 1.0);
      for (std::int64_t j = 0; j < N; ++j)
        dx[r * N + j] += gk * rstd * ((kk == j ? 1.0 : 0.0) - 1.0 / double(N) - xh[kk] * xh[j] / double(N));
      dw[head * N + kk] += dy[r * N + kk] * xh[kk];
      db[head * N + kk] += dy[r * N + kk];
    }
  }
}

// fused == mlstm_recurrent_fwd/bwd (unfused) + the head norm above, with and without weight / bias
TEST(MlstmHeadNorm, EqualsUnfusedComposition) {
  for (const bool with_wb : {true, false}) {
    for (double eps : {1e-6, 0.25}) {
      const Problem p = make_problem({2, 3, 13, 5, 6}, 121, Gates::mixed);
      const MlstmShape& sh = p.sh;
      const States init = random_states(sh, 122), dlast = random_dlast(sh, 123);
      const NormParams np = random_norm(sh, 124, 1e-5, 1.0, with_wb, with_wb);
      std::mt19937_64 rng(125);
      const Vec dout = randn(p.v.size(), rng);
      // fused
      Vec out(p.v.size()), mean(p.i.size()), rstd(p.i.size());
      States last(sh);
      mlstm_headnorm_fwd(sh, p.in(), eps, 4, init.in(), np.norm, out.data(), mean.data(), rstd.data(), last.out());
      AllGrads a(p);
      Vec dw(sh.NH * sh.DV), db(sh.NH * sh.DV);
      mlstm_headnorm_bwd(sh, p.in(), eps, 4, init.in(), np.norm, dout.data(), dlast.in(), a.g(), a.d0.out(),
                         {dw.data(), db.data()});
      // unfused
      Vec h(p.v.size()), dh, dw_r, db_r;
      States last_r(sh);
      mlstm_recurrent_fwd(sh, p.in(), eps, init.in(), h.data(), last_r.out());
      const Vec out_r = direct_headnorm(sh, h, np.norm);
      direct_headnorm_bwd(sh, h, np.norm, dout, dh, dw_r, db_r);
      AllGrads r(p);
      mlstm_recurrent_bwd(sh, p.in(), eps, init.in(), dh.data(), dlast.in(), r.g(), r.d0.out());
      Vec mean_r(p.i.size()), rstd_r(p.i.size());
      for (std::size_t row = 0; row < mean_r.size(); ++row) {
        double mu = 0.0, var = 0.0;
        for (std::int64_t j = 0; j < sh.DV; ++j) mu += h[row * sh.DV + j] / double(sh.DV);
        for (std::int64_t j = 0; j < sh.DV; ++j) var += std::pow(h[row * sh.DV + j] - mu, 2) / double(sh.DV);
        mean_r[row] = mu, rstd_r[row] = 1.0 / std::sqrt(var + 1e-5);
      }
      const double ef[] = {rel_err(out, out_r), rel_err(mean, mean_r), rel_err(rstd, rstd_r), rel_err(last.c, last_r.c),
                           rel_err(last.n, last_r.n), rel_err(last.m, last_r.m)};
      std::printf("[headnorm fused==unfused wb=%d eps=%g] out %.3g mean %.3g rstd %.3g cS %.3g nS %.3g mS %.3g |", int(with_wb),
                  eps, ef[0], ef[1], ef[2], ef[3], ef[4], ef[5]);
      for (double x : ef) EXPECT_LT(x, 1e-12) << "wb " << with_wb << " eps " << eps;
      // floored as in ChunkwiseBackwardEqualsRecurrentBackward: under the norm dh is nearly
      // orthogonal to h, so the normaliser's path (dn0, ~1e-5 of the rest) is a cancellation result
      const auto la = a.list(), lr = r.list();
      const double floor = 1e-3 * norm_all(lr);
      for (int x = 0; x < 8; ++x) {
        const double nb = std::sqrt(dot(*lr[x], *lr[x]));
        const double e = rel_err(*la[x], *lr[x]) * (nb / std::max(nb, floor));
        std::printf(" %s %.3g%s", kGradNames[x], e, nb < floor ? "*" : "");
        EXPECT_LT(e, 1e-12) << kGradNames[x] << " wb " << with_wb << " eps " << eps << " |ref| " << nb;
      }
      const double ew = rel_err(dw, dw_r), eb = rel_err(db, db_r);
      std::printf(" dweight %.3g dbias %.3g\n", ew, eb);
      EXPECT_LT(ew, 1e-13);
      EXPECT_LT(eb, 1e-13);
    }
  }
}

struct NormFdCase {
  const char* name;
  Gates gates;
  double eps;
  bool with_wb;
};
void PrintTo(const NormFdCase& c, std::ostream* os) { *os << c.name; }
class MlstmFiniteDiffHeadNorm : public ::testing::TestWithParam<NormFdCase> {};

// L = sum(dout * out) + sum(dC * C_S) + sum(dn * n_S) + dm * m_S of mlstm_headnorm_fwd, against
// central differences in q, k, v, i, f, the initial states, weight and bias
TEST_P(MlstmFiniteDiffHeadNorm, BackwardMatchesCentralDifferences) {
  const NormFdCase fc = GetParam();
  Problem p = make_problem({2, 2, 7, 4, 5}, 131 + int(fc.gates), fc.gates);
  const MlstmShape& sh = p.sh;
  States init = random_states(sh, 132);
  const States dlast = random_dlast(sh, 133);
  NormParams np = random_norm(sh, 134, 1e-5, 1.0, fc.with_wb, fc.with_wb);
  std::mt19937_64 rng(135);
  const Vec dout = randn(p.v.size(), rng);
  const std::int64_t L = 3;
  Vec out(p.v.size());
  States last(sh);
  auto loss = [&] {
    mlstm_headnorm_fwd(sh, p.in(), fc.eps, L, init.in(), np.norm, out.data(), nullptr, nullptr, last.out());
    return dot(dout, out) + dot(dlast.c, last.c) + dot(dlast.n, last.n) + dot(dlast.m, last.m);
  };
  loss();
  ASSERT_TRUE(all_finite(out) && all_finite(last.c) && all_finite(last.n) && all_finite(last.m));
  AllGrads a(p);
  Vec dw(sh.NH * sh.DV), db(sh.NH * sh.DV);
  mlstm_headnorm_bwd(sh, p.in(), fc.eps, L, init.in(), np.norm, dout.data(), dlast.in(), a.g(), a.d0.out(),
                     {dw.data(), db.data()});
  for (const Vec* g : a.list()) ASSERT_TRUE(all_finite(*g));
  ASSERT_TRUE(all_finite(dw) && all_finite(db));
  std::vector<Vec*> xs = {&p.q, &p.k, &p.v, &p.i, &p.f, &init.c, &init.n, &init.m};
  std::vector<const Vec*> gl = a.list();
  if (fc.with_wb) xs.push_back(&np.w), xs.push_back(&np.b), gl.push_back(&dw), gl.push_back(&db);
  const double floor = 1e-3 * norm_all(gl);
  std::printf("[fd headnorm %s]", fc.name);
  for (std::size_t x = 0; x < xs.size(); ++x) {
    bool floored = false;
    const double e = fd_err(*gl[x], central_diff(*xs[x], loss), floor, floored);
    std::printf(" %s %.3g%s", kGradNames[x], e, floored ? "*" : "");
    EXPECT_LT(e, 1e-6) << kGradNames[x] << " |grad| " << std::sqrt(dot(*gl[x], *gl[x])) << " floor " << floor;
  }
  std::printf("  (* floored)\n");
}
INSTANTIATE_TEST_SUITE_P(
    Mlstm, MlstmFiniteDiffHeadNorm,
    ::testing::Values(NormFdCase{"normal", Gates::normal, 1e-6, true},
                      NormFdCase{"negative_i_eps025", Gates::negative_i, 0.25, true},
                      NormFdCase{"mixed_pm20_no_weight_bias", Gates::mixed, 1e-6, false},
                      NormFdCase{"extreme_f-20_i+20", Gates::extreme, 0.25, true}),
    [](const auto& info) {
      std::string s = info.param.name;
      for (auto& ch : s) if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
      return s;
    });

// ---- golden: chunkwise and head-norm fused, with initial states and last-state gradients ---------
class MlstmGoldenChunk : public ::testing::TestWithParam<std::string> {};

TEST_P(MlstmGoldenChunk, MatchesFloat64Autograd) {
  const auto& g = golden();
  const std::string c = GetParam();
  auto at = [&](const char* n) -> const Vec& { return g.at(c + "." + n).v; };
  const auto& q = g.at(c + ".q");
  const auto& v = g.at(c + ".v");
  const MlstmShape sh{q.shape[0], q.shape[1], q.shape[2], q.shape[3], v.shape[3]};
  const double eps = at("eps")[0];
  const std::int64_t L = std::int64_t(at("L")[0]);
  const MlstmInputs in{q.v.data(), at("k").data(), v.v.data(), at("i").data(), at("f").data()};
  const MlstmConstState init{at("c0").data(), at("n0").data(), at("m0").data()};
  const MlstmConstState dlast{at("dcS").data(), at("dnS").data(), at("dmS").data()};
  const bool norm = g.count(c + ".weight") > 0;
  const MlstmHeadNorm nm{norm ? at("weight").data() : nullptr, norm ? at("bias").data() : nullptr,
                         norm ? at("eps_norm")[0] : 0.0, norm ? at("weight_offset")[0] : 0.0};
  Vec out(v.v.size()), dw(sh.NH * sh.DV), db(sh.NH * sh.DV);
  States last(sh);
  // the same problem three ways: chunkwise (the file's L), recurrent backward, chunk size 1
  for (int way = 0; way < 3; ++way) {
    AllGrads a(Problem{sh, q.v, at("k"), v.v, at("i"), at("f")});
    const std::int64_t Lw = way == 2 ? 1 : L;
    if (norm) {
      mlstm_headnorm_fwd(sh, in, eps, Lw, init, nm, out.data(), nullptr, nullptr, last.out());
      mlstm_headnorm_bwd(sh, in, eps, Lw, init, nm, at("dout").data(), dlast, a.g(), a.d0.out(), {dw.data(), db.data()});
      if (way == 1) continue;  // the recurrent way is checked through EqualsUnfusedComposition
    } else if (way == 1) {
      mlstm_recurrent_fwd(sh, in, eps, init, out.data(), last.out());
      mlstm_recurrent_bwd(sh, in, eps, init, at("dout").data(), dlast, a.g(), a.d0.out());
    } else {
      mlstm_chunkwise_fwd(sh, in, eps, Lw, init, out.data(), last.out());
      mlstm_chunkwise_bwd(sh, in, eps, Lw, init, at("dout").data(), dlast, a.g(), a.d0.out());
    }
    const char* way_name[] = {"chunkwise", "recurrent", "chunkwise L=1"};
    std::printf("[golden %s, %s]", c.c_str(), way_name[way]);
    const double ef[] = {rel_err(out, at("out")), rel_err(last.c, at("cS")), rel_err(last.n, at("nS")),
                         rel_err(last.m, at("mS"))};
    std::printf(" out %.3g cS %.3g nS %.3g mS %.3g", ef[0], ef[1], ef[2], ef[3]);
    for (double x : ef) EXPECT_LT(x, 1e-13) << way_name[way];
    const auto la = a.list();
    for (int x = 0; x < 8; ++x) {
      const double e = rel_err(*la[x], at(kGradNames[x]));
      std::printf(" %s %.3g", kGradNames[x], e);
      EXPECT_LT(e, 1e-12) << kGradNames[x] << " " << way_name[way];
    }
    if (norm) {
      const double ew = rel_err(dw, at("dweight")), eb = rel_err(db, at("dbias"));
      std::printf(" dweight %.3g dbias %.3g", ew, eb);
      EXPECT_LT(ew, 1e-13);
      EXPECT_LT(eb, 1e-13);
    }
    std::printf("\n");
  }
}
INSTANTIATE_TEST_SUITE_P(Mlstm, MlstmGoldenChunk, ::testing::Values("chunk", "headnorm"));

}  // namespace
