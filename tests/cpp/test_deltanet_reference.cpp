// test_deltanet_reference.cpp: the CPU DeltaNet reference (src/reference/deltanet_ref.cpp) is the
// definition, so it is checked five ways:
//  1. the backward of every form (loop, single chunk, chunkwise, the WY representation) against
//     float64 central finite differences of its forward, L = sum(do * o) + sum(dht * h_T), in q, k,
//     v, beta and the initial state; with and without the L2 norm, variable length, K != V;
//  2. the forms against each other: loop == chunkwise (L = 1, 2, 3, 5, 16, 64) == single chunk, for
//     T = 1, 7, 63, 100, with and without the L2 norm, forward and every gradient; the WY
//     representation against the loop's state;
//  3. one call == two calls joined through the state (forward and gradients);
//  4. variable length (cu_seqlens, zero-length sequences included) == each sequence on its own, and
//     equal lengths packed == the batched layout;
//  5. tests/golden/deltanet.txt from an independent float64 PyTorch autograd loop
//     (tests/golden/make_golden_deltanet.py), every form.
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
#include "reference/deltanet_ref.h"

namespace {

using namespace fastweight::detail;
using namespace fwref;
using I64 = std::int64_t;

Vec uniform(std::size_t n, std::mt19937_64& rng, double lo, double hi) {
  std::uniform_real_distribution<double> d(lo, hi);
  Vec v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// One problem, owned: inputs, initial state, loss weights do, dht, and the options.
struct Problem {
  I64 B = 1, T = 0, H = 1, K = 0, V = 0;
  std::vector<I64> cu;   // (N+1) offsets; empty: N = B sequences of length T
  Vec q, k, v, beta;     // (B,T,H,K) (B,T,H,K) (B,T,H,V) (B,T,H)
  Vec h0, dht;           // (N,H,K,V)
  Vec dout;              // (B,T,H,V)
  DeltanetOptions opt;

  I64 N() const { return cu.empty() ? B : I64(cu.size()) - 1; }
  DeltanetShape shape() const {
    return {B, T, H, K, V, cu.empty() ? nullptr : cu.data(), cu.empty() ? 0 : N()};
  }
  DeltanetInputs in() const { return {q.data(), k.data(), v.data(), beta.data()}; }
};

// Random problem. Without the norm the keys get |k| ~ 1 (sd K^-0.5) so that I - beta k k^T with
// beta in (0, 1) keeps the state bounded over T = 100; with it they are N(0, 1) as they come.
Problem make_problem(I64 B, I64 T, I64 H, I64 K, I64 V, bool l2, std::uint64_t seed, std::vector<I64> cu = {}) {
  std::mt19937_64 rng(seed);
  Problem p;
  p.B = B, p.T = T, p.H = H, p.K = K, p.V = V, p.cu = std::move(cu);
  p.opt.use_qk_l2norm_in_kernel = l2;
  const std::size_t rows = B * T * H, states = p.N() * H * K * V;
  p.q = randn(rows * K, rng), p.k = randn(rows * K, rng, 0.0, l2 ? 1.0 : 1.0 / std::sqrt(double(K)));
  p.v = randn(rows * V, rng), p.beta = uniform(rows, rng, 0.0, 1.0);
  p.h0 = randn(states, rng), p.dht = randn(states, rng), p.dout = randn(rows * V, rng);
  return p;
}

// ---- the forms behind one interface -------------------------------------------------------------
enum class Kind { loop, single, chunk };
struct Form {
  Kind kind;
  I64 L = 0;  // chunk only
  std::string name() const {
    return kind == Kind::loop ? "loop" : kind == Kind::single ? "single_chunk" : "chunk_L" + std::to_string(L);
  }
};

struct Out {
  Vec o, ht;  // (B,T,H,V), (N,H,K,V)
};
struct Grads {
  Vec dq, dk, dv, dbeta, dh0;  // (B,T,H,K) (B,T,H,K) (B,T,H,V) (B,T,H) (N,H,K,V)
  std::vector<const Vec*> list() const { return {&dq, &dk, &dv, &dbeta, &dh0}; }
};
constexpr const char* kGradNames[] = {"dq", "dk", "dv", "dbeta", "dh0"};

Out forward(const Form& f, const Problem& p, bool with_h0 = true) {
  Out r{Vec(p.dout.size()), Vec(p.h0.size())};
  const double* h0 = with_h0 ? p.h0.data() : nullptr;
  switch (f.kind) {
    case Kind::loop: deltanet_recurrent_fwd(p.shape(), p.in(), p.opt, h0, r.o.data(), r.ht.data()); break;
    case Kind::single: deltanet_single_chunk_fwd(p.shape(), p.in(), p.opt, h0, r.o.data(), r.ht.data()); break;
    case Kind::chunk: deltanet_chunkwise_fwd(p.shape(), p.in(), p.opt, f.L, h0, r.o.data(), r.ht.data()); break;
  }
  return r;
}

Grads backward(const Form& f, const Problem& p, bool with_h0 = true, bool with_dht = true) {
  Grads g{Vec(p.q.size()), Vec(p.k.size()), Vec(p.v.size()), Vec(p.beta.size()), Vec(p.h0.size())};
  const DeltanetGrads dg{g.dq.data(), g.dk.data(), g.dv.data(), g.dbeta.data()};
  const double* h0 = with_h0 ? p.h0.data() : nullptr;
  const double* dht = with_dht ? p.dht.data() : nullptr;
  switch (f.kind) {
    case Kind::loop:
      deltanet_recurrent_bwd(p.shape(), p.in(), p.opt, h0, p.dout.data(), dht, dg, g.dh0.data());
      break;
    case Kind::single:
      deltanet_single_chunk_bwd(p.shape(), p.in(), p.opt, h0, p.dout.data(), dht, dg, g.dh0.data());
      break;
    case Kind::chunk:
      deltanet_chunkwise_bwd(p.shape(), p.in(), p.opt, f.L, h0, p.dout.data(), dht, dg, g.dh0.data());
      break;
  }
  return g;
}

double loss_of(const Form& f, const Problem& p) {
  const Out r = forward(f, p);
  return dot(p.dout, r.o) + dot(p.dht, r.ht);
}

std::string safe_name(std::string s) {
  for (auto& ch : s)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return s;
}

// ---- 1. finite differences ------------------------------------------------------------------------
struct FdCase {
  Form form;
  bool l2;
  bool varlen;
  double scale;  // <= 0: the default K^-0.5
  std::string name() const {
    return form.name() + (l2 ? "_l2" : "") + (varlen ? "_varlen" : "") + (scale > 0 ? "_scale" : "");
  }
};
void PrintTo(const FdCase& c, std::ostream* os) { *os << c.name(); }
class DeltanetFiniteDiff : public ::testing::TestWithParam<FdCase> {};

TEST_P(DeltanetFiniteDiff, BackwardMatchesCentralDifferences) {
  const FdCase fc = GetParam();
  // T = 9 over chunks of 2 and 4 leaves a tail; varlen: lengths 3, 0, 5, 1
  Problem p = fc.varlen ? make_problem(1, 9, 2, 6, 5, fc.l2, 201, {0, 3, 3, 8, 9})
                        : make_problem(2, 9, 2, 6, 5, fc.l2, 202);
  if (fc.scale > 0) p.opt.scale = fc.scale;
  auto loss = [&] { return loss_of(fc.form, p); };
  const Grads g = backward(fc.form, p);
  for (const Vec* x : g.list()) ASSERT_TRUE(all_finite(*x));
  Vec* xs[] = {&p.q, &p.k, &p.v, &p.beta, &p.h0};
  const auto gl = g.list();
  std::printf("[fd %s]", fc.name().c_str());
  for (int x = 0; x < 5; ++x) {
    const double e = rel_err(*gl[x], central_diff(*xs[x], loss));
    std::printf(" %s %.3g", kGradNames[x], e);
    EXPECT_LT(e, 1e-7) << kGradNames[x];
  }
  std::printf("\n");
}
INSTANTIATE_TEST_SUITE_P(
    Deltanet, DeltanetFiniteDiff,
    ::testing::Values(FdCase{{Kind::loop}, false, false, 0}, FdCase{{Kind::loop}, true, false, 0},
                      FdCase{{Kind::loop}, true, true, 0}, FdCase{{Kind::loop}, false, false, 0.8},
                      FdCase{{Kind::single}, false, false, 0}, FdCase{{Kind::single}, true, false, 0},
                      FdCase{{Kind::single}, true, true, 0}, FdCase{{Kind::chunk, 1}, false, false, 0},
                      FdCase{{Kind::chunk, 2}, false, false, 0}, FdCase{{Kind::chunk, 4}, true, false, 0.8},
                      FdCase{{Kind::chunk, 2}, true, true, 0}, FdCase{{Kind::chunk, 16}, true, false, 0}),
    [](const auto& info) { return safe_name(info.param.name()); });

// WY representation: L = sum(dw * w) + sum(du * u), chunks of 3 over T = 8 (a tail of 2), varlen
TEST(DeltanetFiniteDiffWy, BackwardMatchesCentralDifferences) {
  for (const bool varlen : {false, true}) {
    Problem p = varlen ? make_problem(1, 8, 2, 6, 5, false, 211, {0, 2, 2, 8}) : make_problem(2, 8, 2, 6, 5, false, 212);
    p.beta = [&] { std::mt19937_64 r(213); return uniform(p.beta.size(), r, -0.5, 1.5); }();  // any real beta
    std::mt19937_64 rng(214);
    const Vec dw = randn(p.q.size(), rng), du = randn(p.v.size(), rng);  // (B,T,H,K), (B,T,H,V)
    const I64 L = 3;
    Vec w(p.q.size()), u(p.v.size());  // (B,T,H,K), (B,T,H,V)
    auto loss = [&] {
      deltanet_wy_repr_fwd(p.shape(), p.in(), L, w.data(), u.data());
      return dot(dw, w) + dot(du, u);
    };
    Vec dk(p.k.size()), dv(p.v.size()), dbeta(p.beta.size());  // (B,T,H,K) (B,T,H,V) (B,T,H)
    deltanet_wy_repr_bwd(p.shape(), p.in(), L, dw.data(), du.data(), {nullptr, dk.data(), dv.data(), dbeta.data()});
    const double e[] = {rel_err(dk, central_diff(p.k, loss)), rel_err(dv, central_diff(p.v, loss)),
                        rel_err(dbeta, central_diff(p.beta, loss))};
    std::printf("[fd wy_repr L=3 varlen=%d] dk %.3g dv %.3g dbeta %.3g\n", int(varlen), e[0], e[1], e[2]);
    for (double x : e) EXPECT_LT(x, 1e-7);
  }
}

// ---- 2. forms agree -------------------------------------------------------------------------------
// Every form's forward and backward against the loop's, for each T, with and without the norm; the
// worst error of each quantity over all cases is printed.
TEST(DeltanetForms, ChunkwiseAndSingleChunkEqualLoop) {
  std::vector<Form> forms = {{Kind::single}};
  for (I64 L : {1, 2, 3, 5, 16, 64}) forms.push_back({Kind::chunk, L});
  for (const bool l2 : {false, true}) {
    double worst[7] = {};
    for (I64 T : {1, 7, 63, 100}) {
      const Problem p = make_problem(2, T, 2, 6, 5, l2, 300 + T + 1000 * l2);
      for (const bool with_state : {false, true}) {
        const Out ro = forward({Kind::loop}, p, with_state);
        const Grads rg = backward({Kind::loop}, p, with_state, with_state);
        ASSERT_TRUE(all_finite(ro.o) && all_finite(ro.ht));
        for (const Form& f : forms) {
          const Out fo = forward(f, p, with_state);
          const Grads fg = backward(f, p, with_state, with_state);
          const auto lf = fg.list(), lr = rg.list();
          double e[7] = {rel_err(fo.o, ro.o), rel_err(fo.ht, ro.ht)};
          for (int x = 0; x < 5; ++x) e[2 + x] = rel_err(*lf[x], *lr[x]);
          for (int x = 0; x < 7; ++x) {
            worst[x] = std::max(worst[x], e[x]);
            EXPECT_LT(e[x], 1e-12) << f.name() << " T " << T << " l2 " << l2 << " state " << with_state << " #" << x;
          }
        }
      }
    }
    std::printf("[forms (single chunk, chunk L=1,2,3,5,16,64) == loop, T=1,7,63,100, l2=%d, max] o %.3g ht %.3g "
                "dq %.3g dk %.3g dv %.3g dbeta %.3g dh0 %.3g\n",
                int(l2), worst[0], worst[1], worst[2], worst[3], worst[4], worst[5], worst[6]);
  }
}

// The WY representation of one chunk gives the loop's state: h_T = h0 + sum_j k_j (u_j - h0^T w_j)^T.
TEST(DeltanetForms, WyReprGivesLoopState) {
  const Problem p = make_problem(2, 13, 2, 6, 5, false, 401);
  const I64 K = p.K, V = p.V, H = p.H, T = p.T;
  Vec w(p.q.size()), u(p.v.size());  // (B,T,H,K), (B,T,H,V)
  deltanet_wy_repr_fwd(p.shape(), p.in(), T, w.data(), u.data());
  const Out ro = forward({Kind::loop}, p);
  Vec S = p.h0;  // (N,H,K,V)
  for (I64 b = 0; b < p.B; ++b)
    for (I64 h = 0; h < H; ++h) {
      const double* h0 = &p.h0[(b * H + h) * K * V];
      for (I64 t = 0; t < T; ++t) {
        const I64 r = (b * T + t) * H + h;
        for (I64 c = 0; c < V; ++c) {
          double d = u[r * V + c];
          for (I64 a = 0; a < K; ++a) d -= h0[a * V + c] * w[r * K + a];
          for (I64 a = 0; a < K; ++a) S[((b * H + h) * K + a) * V + c] += p.k[r * K + a] * d;
        }
      }
    }
  const double e = rel_err(S, ro.ht);
  std::printf("[forms wy_repr state == loop state] %.3g\n", e);
  EXPECT_LT(e, 1e-13);
}

// ---- 3. split through the state ---------------------------------------------------------------------
// positions [t0, t0 + len) of a (B,T,H,X) tensor, as a (B,len,H,X) one
Vec slice_t(const Vec& x, I64 B, I64 T, I64 HX, I64 t0, I64 len) {
  Vec out;
  for (I64 b = 0; b < B; ++b) out.insert(out.end(), x.begin() + (b * T + t0) * HX, x.begin() + (b * T + t0 + len) * HX);
  return out;
}
Problem slice_problem(const Problem& p, I64 t0, I64 len) {
  Problem s = p;
  s.T = len;
  s.q = slice_t(p.q, p.B, p.T, p.H * p.K, t0, len), s.k = slice_t(p.k, p.B, p.T, p.H * p.K, t0, len);
  s.v = slice_t(p.v, p.B, p.T, p.H * p.V, t0, len), s.beta = slice_t(p.beta, p.B, p.T, p.H, t0, len);
  s.dout = slice_t(p.dout, p.B, p.T, p.H * p.V, t0, len);
  return s;
}
// (B,T1,H,X) and (B,T2,H,X) joined along T
Vec join_t(const Vec& a, const Vec& b, I64 B, I64 T1, I64 T2, I64 HX) {
  Vec out;
  for (I64 x = 0; x < B; ++x) {
    out.insert(out.end(), a.begin() + x * T1 * HX, a.begin() + (x + 1) * T1 * HX);
    out.insert(out.end(), b.begin() + x * T2 * HX, b.begin() + (x + 1) * T2 * HX);
  }
  return out;
}

TEST(DeltanetForms, SplitThroughStateEqualsOneCall) {
  for (const bool l2 : {false, true}) {
    const Problem p = make_problem(2, 13, 2, 6, 5, l2, 501 + l2);
    for (const Form& f : {Form{Kind::loop}, Form{Kind::single}, Form{Kind::chunk, 4}}) {
      const Out full = forward(f, p);
      const Grads gfull = backward(f, p);
      for (I64 T1 : {0, 1, 6, 13}) {  // 6: not a multiple of L = 4; 0 and 13: one part is empty
        const I64 T2 = p.T - T1;
        Problem a = slice_problem(p, 0, T1), b = slice_problem(p, T1, T2);
        const Out oa = forward(f, a);
        b.h0 = oa.ht;  // the second call starts where the first ended
        const Out ob = forward(f, b);
        const Grads gb = backward(f, b);
        a.dht = gb.dh0;  // and hands dL/d(its initial state) back as the first call's dL/d(final state)
        const Grads ga = backward(f, a);
        const I64 HK = p.H * p.K, HV = p.H * p.V;
        const double e[] = {rel_err(join_t(oa.o, ob.o, p.B, T1, T2, HV), full.o), rel_err(ob.ht, full.ht),
                            rel_err(join_t(ga.dq, gb.dq, p.B, T1, T2, HK), gfull.dq),
                            rel_err(join_t(ga.dk, gb.dk, p.B, T1, T2, HK), gfull.dk),
                            rel_err(join_t(ga.dv, gb.dv, p.B, T1, T2, HV), gfull.dv),
                            rel_err(join_t(ga.dbeta, gb.dbeta, p.B, T1, T2, p.H), gfull.dbeta),
                            rel_err(ga.dh0, gfull.dh0)};
        std::printf("[split %s T=13 at T1=%lld l2=%d] o %.3g ht %.3g dq %.3g dk %.3g dv %.3g dbeta %.3g dh0 %.3g\n",
                    f.name().c_str(), (long long)T1, int(l2), e[0], e[1], e[2], e[3], e[4], e[5], e[6]);
        for (double x : e) EXPECT_LT(x, 1e-13) << f.name() << " T1 " << T1;
      }
    }
  }
}

// ---- 4. variable length -----------------------------------------------------------------------------
// Rows [bos, eos) of every (1,T,H,X) tensor of a packed problem, as their own B = 1 problem with the
// sequence's own initial state and final-state gradient.
Problem sequence_problem(const Problem& p, I64 n) {
  const I64 bos = p.cu[n], len = p.cu[n + 1] - bos, KV = p.K * p.V;
  Problem s = slice_problem(p, bos, len);
  s.cu.clear();
  s.h0.assign(p.h0.begin() + n * p.H * KV, p.h0.begin() + (n + 1) * p.H * KV);
  s.dht.assign(p.dht.begin() + n * p.H * KV, p.dht.begin() + (n + 1) * p.H * KV);
  return s;
}

TEST(DeltanetVarlen, EqualsSequencesOneByOne) {
  std::mt19937_64 rng(601);
  std::uniform_int_distribution<int> len_of(0, 9), zero(0, 3);
  for (int trial = 0; trial < 4; ++trial) {
    std::vector<I64> cu = {0};
    const int N = 3 + trial;
    for (int n = 0; n < N; ++n) cu.push_back(cu.back() + (zero(rng) == 0 ? 0 : len_of(rng)));  // ~1 in 4 empty
    if (trial == 0) cu = {0, 0, 5, 5, 12, 13, 13};  // empty first, middle and last sequences
    const bool l2 = trial % 2 == 1;
    const Problem p = make_problem(1, cu.back(), 2, 6, 5, l2, 602 + trial, cu);
    for (const Form& f : {Form{Kind::loop}, Form{Kind::single}, Form{Kind::chunk, 3}}) {
      const Out po = forward(f, p);
      const Grads pg = backward(f, p);
      Out so;
      Grads sg;
      for (I64 n = 0; n + 1 < I64(cu.size()); ++n) {
        const Problem s = sequence_problem(p, n);
        const Out o = forward(f, s);
        const Grads g = backward(f, s);
        so.o.insert(so.o.end(), o.o.begin(), o.o.end());
        so.ht.insert(so.ht.end(), o.ht.begin(), o.ht.end());
        auto append = [](Vec& dst, const Vec& src) { dst.insert(dst.end(), src.begin(), src.end()); };
        append(sg.dq, g.dq), append(sg.dk, g.dk), append(sg.dv, g.dv), append(sg.dbeta, g.dbeta);
        append(sg.dh0, g.dh0);
      }
      const auto lp = pg.list(), ls = sg.list();
      double e[7] = {rel_err(po.o, so.o), rel_err(po.ht, so.ht)};
      for (int x = 0; x < 5; ++x) e[2 + x] = rel_err(*lp[x], *ls[x]);
      std::printf("[varlen == one by one, %s, %d seqs, T=%lld, l2=%d] o %.3g ht %.3g dq %.3g dk %.3g dv %.3g dbeta "
                  "%.3g dh0 %.3g\n",
                  f.name().c_str(), N, (long long)p.T, int(l2), e[0], e[1], e[2], e[3], e[4], e[5], e[6]);
      // the same per-(sequence, head) arithmetic in the same order: bit-identical
      for (double x : e) EXPECT_EQ(x, 0.0) << f.name() << " trial " << trial;
    }
  }
}

// Equal lengths packed through cu_seqlens == the batched layout (the same memory, (1, B*T) vs (B, T)).
TEST(DeltanetVarlen, EqualLengthsEqualBatched) {
  const Problem batched = make_problem(3, 7, 2, 6, 5, true, 701);
  Problem packed = batched;
  packed.B = 1, packed.T = 21, packed.cu = {0, 7, 14, 21};
  for (const Form& f : {Form{Kind::loop}, Form{Kind::chunk, 4}}) {
    const Out a = forward(f, batched), b = forward(f, packed);
    const Grads ga = backward(f, batched), gb = backward(f, packed);
    EXPECT_EQ(a.o, b.o) << f.name();
    EXPECT_EQ(a.ht, b.ht) << f.name();
    for (int x = 0; x < 5; ++x) EXPECT_EQ(*ga.list()[x], *gb.list()[x]) << f.name() << " " << kGradNames[x];
    std::printf("[varlen equal lengths == batched, %s] o, ht and every gradient compared bit for bit\n",
                f.name().c_str());
  }
}

// ---- 5. golden file ---------------------------------------------------------------------------------
const std::map<std::string, Golden>& golden() {
  static const auto g = load_golden(FW_GOLDEN_DIR "/deltanet.txt");
  return g;
}

class DeltanetGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(DeltanetGolden, EveryFormMatchesFloat64Autograd) {
  const auto& g = golden();
  const std::string c = GetParam();
  auto at = [&](const char* n) -> const Vec& { return g.at(c + "." + n).v; };
  const auto& q = g.at(c + ".q");
  Problem p;
  p.B = q.shape[0], p.T = q.shape[1], p.H = q.shape[2], p.K = q.shape[3], p.V = g.at(c + ".v").shape[3];
  if (g.count(c + ".cu_seqlens"))
    for (double x : at("cu_seqlens")) p.cu.push_back(I64(x));
  p.q = q.v, p.k = at("k"), p.v = at("v"), p.beta = at("beta"), p.h0 = at("h0"), p.dht = at("dht"), p.dout = at("do");
  p.opt.use_qk_l2norm_in_kernel = at("l2")[0] != 0.0;
  if (at("scale_default")[0] == 0.0) p.opt.scale = at("scale")[0];
  else EXPECT_EQ(deltanet_scale(p.shape(), p.opt), at("scale")[0]);  // K ** -0.5, bit for bit
  const char* names[] = {"o", "ht", "dq", "dk", "dv", "dbeta", "dh0"};
  for (const Form& f : {Form{Kind::loop}, Form{Kind::single}, Form{Kind::chunk, 1}, Form{Kind::chunk, 3},
                        Form{Kind::chunk, 16}, Form{Kind::chunk, 64}}) {
    const Out o = forward(f, p);
    const Grads gr = backward(f, p);
    const Vec* mine[] = {&o.o, &o.ht, &gr.dq, &gr.dk, &gr.dv, &gr.dbeta, &gr.dh0};
    std::printf("[golden %s, %s]", c.c_str(), f.name().c_str());
    for (int x = 0; x < 7; ++x) {
      const double e = rel_err(*mine[x], at(names[x]));
      std::printf(" %s %.3g", names[x], e);
      EXPECT_LT(e, 1e-12) << names[x] << " " << f.name();
    }
    std::printf("\n");
  }
}
INSTANTIATE_TEST_SUITE_P(Deltanet, DeltanetGolden, ::testing::Values("basic", "l2", "varlen", "long"));

}  // namespace
