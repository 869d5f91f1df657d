// test_norm_reference.cpp: the CPU reference is the definition, so it is checked three ways:
//  1. against golden files from an independent float64 PyTorch autograd script (tests/golden);
//  2. its backward against central finite differences of its forward, in float64;
//  3. consistency of the forms: headnorm with one head = layernorm, adaLN = layernorm with the
//     batch's scale/shift, rmsnorm = layernorm of zero-mean rows.
#include <fstream>
#include <map>
#include <sstream>

#include "common/norm_params.h"
#include "norm_cases.h"

namespace fwtest {
namespace {

std::map<std::string, HostTensor> load_golden() {
  std::map<std::string, HostTensor> m;
  std::ifstream in(FW_GOLDEN_DIR "/norms.txt");
  EXPECT_TRUE(in.good()) << "cannot open " FW_GOLDEN_DIR "/norms.txt";
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream is(line);
    std::string name;
    int nd = 0;
    is >> name >> nd;
    std::vector<std::int64_t> shape(nd);
    for (auto& s : shape) is >> s;
    HostTensor t = make_host(DType::f64, shape);
    for (std::int64_t i = 0; i < t.numel(); ++i) { double v; is >> v; t.set(i, v); }
    m[name] = t;
  }
  return m;
}

HostTensor like(const HostTensor& t) { return make_host(t.dtype, t.shape); }
HostTensor stats_for(const HostTensor& x) {
  std::vector<std::int64_t> s(x.shape.begin(), x.shape.end() - 1);
  return make_host(DType::f32, s);
}

struct GoldenCase : ::testing::TestWithParam<Op> {};

TEST_P(GoldenCase, MatchesFloat64Autograd) {
  static auto g = load_golden();
  const Op op = GetParam();
  const std::string c = op_name(op);
  const bool ada = op == Op::adalayernorm;
  HostTensor x = g[c + ".x"], dy = g[c + ".dy"];
  HostTensor w = g[c + (ada ? ".scale" : ".weight")];
  HostTensor b = op == Op::rmsnorm ? HostTensor{} : g[c + (ada ? ".shift" : ".bias")];
  const double eps = g[c + ".eps"].get(0), offset = op == Op::headnorm ? 1.0 : 0.0;
  HostTensor y = like(x), dx = like(x), dw = like(w), db = op == Op::rmsnorm ? HostTensor{} : like(b);
  HostTensor mean = stats_for(x), rstd = stats_for(x);
  const bool rms = op == Op::rmsnorm;
  run_fwd(op, {x.ref(), w.ref(), rms ? TensorRef{} : b.ref(), y.ref(), rms ? TensorRef{} : mean.ref(), rstd.ref(), eps, offset});
  run_bwd(op, {dy.ref(), x.ref(), w.ref(), rms ? TensorRef{} : mean.ref(), rstd.ref(), dx.ref(), dw.ref(), rms ? TensorRef{} : db.ref(), offset}, nullptr, 0);
  // y is computed from float64 statistics; the backward uses the fp32 statistics the forward saves.
  EXPECT_LT(rel_err(y, g[c + ".y"]), 1e-13) << c;
  EXPECT_LT(rel_err(dx, g[c + ".dx"]), 2e-6) << c;
  EXPECT_LT(rel_err(dw, g[c + (ada ? ".dscale" : ".dweight")]), 2e-6) << c;
  if (!rms) EXPECT_LT(rel_err(db, g[c + (ada ? ".dshift" : ".dbias")]), 1e-13) << c;
}
INSTANTIATE_TEST_SUITE_P(Norms, GoldenCase,
                         ::testing::Values(Op::layernorm, Op::rmsnorm, Op::headnorm, Op::adalayernorm),
                         [](const auto& info) { return std::string(op_name(info.param)); });

// ---- finite differences: L = sum(dy * y); dL/dx, dL/dw, dL/db against the analytic backward -------
struct FiniteDiff : ::testing::TestWithParam<Op> {};

TEST_P(FiniteDiff, BackwardMatchesCentralDifferences) {
  const Op op = GetParam();
  std::mt19937_64 rng(7 + int(op));
  const Problem pb = make_problem(op, 4, 13);
  HostTensor x = make_host(DType::f64, pb.x_shape), dy = make_host(DType::f64, pb.x_shape);
  HostTensor w = make_host(DType::f64, pb.p_shape), b = make_host(DType::f64, pb.p_shape);
  fill_random(x, rng);
  fill_random(dy, rng);
  fill_random(w, rng, 0.5, 1.5);
  fill_random(b, rng);
  const bool rms = op == Op::rmsnorm;
  const double eps = 1e-3, offset = op == Op::headnorm ? 0.25 : 0.0;
  auto loss = [&]() {
    HostTensor y = like(x), mean = stats_for(x), rstd = stats_for(x);
    run_fwd(op, {x.ref(), w.ref(), rms ? TensorRef{} : b.ref(), y.ref(), TensorRef{}, TensorRef{}, eps, offset});
    double l = 0.0;
    for (std::int64_t i = 0; i < y.numel(); ++i) l += y.get(i) * dy.get(i);
    return l;
  };
  HostTensor y = like(x), mean = stats_for(x), rstd = stats_for(x), dx = like(x), dw = like(w), db = like(b);
  run_fwd(op, {x.ref(), w.ref(), rms ? TensorRef{} : b.ref(), y.ref(), rms ? TensorRef{} : mean.ref(), rstd.ref(), eps, offset});
  run_bwd(op, {dy.ref(), x.ref(), w.ref(), rms ? TensorRef{} : mean.ref(), rstd.ref(), dx.ref(), dw.ref(), rms ? TensorRef{} : db.ref(), offset}, nullptr, 0);
  auto fd = [&](HostTensor& t) {
    HostTensor g = like(t);
    const double h = 1e-6;
    for (std::int64_t i = 0; i < t.numel(); ++i) {
      const double v = t.get(i);
      t.set(i, v + h);
      const double lp = loss();
      t.set(i, v - h);
      const double lm = loss();
      t.set(i, v);
      g.set(i, (lp - lm) / (2 * h));
    }
    return g;
  };
  // Tolerance: the analytic backward reads the fp32 statistics saved by the forward (rel. 6e-8).
  EXPECT_LT(rel_err(dx, fd(x)), 1e-6);
  EXPECT_LT(rel_err(dw, fd(w)), 1e-6);
  if (!rms) EXPECT_LT(rel_err(db, fd(b)), 1e-8);
}
INSTANTIATE_TEST_SUITE_P(Norms, FiniteDiff,
                         ::testing::Values(Op::layernorm, Op::rmsnorm, Op::headnorm, Op::adalayernorm),
                         [](const auto& info) { return std::string(op_name(info.param)); });

// ---- consistency of the forms -------------------------------------------------------------------
TEST(NormForms, HeadNormWithOneHeadIsLayerNorm) {
  std::mt19937_64 rng(11);
  HostTensor x = make_host(DType::f64, {6, 1, 20}), w = make_host(DType::f64, {1, 20}), b = make_host(DType::f64, {1, 20});
  fill_random(x, rng); fill_random(w, rng); fill_random(b, rng);
  HostTensor y1 = like(x), y2 = make_host(DType::f64, {6, 20});
  headnorm_fwd({x.ref(), w.ref(), b.ref(), y1.ref(), {}, {}, 1e-6, 0.5});
  HostTensor x2 = x, w1 = make_host(DType::f64, {20}), b1 = make_host(DType::f64, {20});
  x2.shape = {6, 20};
  x2.strides = {20, 1};
  for (int i = 0; i < 20; ++i) { w1.set(i, w.get(i)); b1.set(i, b.get(i)); }
  layernorm_fwd({x2.ref(), w1.ref(), b1.ref(), y2.ref(), {}, {}, 1e-6, 0.5});
  EXPECT_LT(rel_err(y1, y2), 1e-15);  // same values in the same order
}

TEST(NormForms, AdaLayerNormIsLayerNormPerBatch) {
  std::mt19937_64 rng(12);
  HostTensor x = make_host(DType::f64, {3, 5, 16}), sc = make_host(DType::f64, {3, 1, 16}), sh = make_host(DType::f64, {3, 1, 16});
  fill_random(x, rng); fill_random(sc, rng); fill_random(sh, rng);
  HostTensor y = like(x);
  adalayernorm_fwd({x.ref(), sc.ref(), sh.ref(), y.ref(), {}, {}, 1e-5});
  for (int bi = 0; bi < 3; ++bi) {
    HostTensor xb = x, yb = y, wb = sc, bb = sh;  // views of batch bi
    xb.shape = {5, 16}; xb.strides = {16, 1}; xb.offset = bi * 80;
    HostTensor out = make_host(DType::f64, {5, 16});
    wb.shape = {16}; wb.strides = {1}; wb.offset = bi * 16;
    bb.shape = {16}; bb.strides = {1}; bb.offset = bi * 16;
    layernorm_fwd({xb.ref(), wb.ref(), bb.ref(), out.ref(), {}, {}, 1e-5});
    yb.shape = {5, 16}; yb.strides = {16, 1}; yb.offset = bi * 80;
    EXPECT_LT(rel_err(out, yb), 1e-15) << "batch " << bi;
  }
}

TEST(NormForms, RmsNormOfZeroMeanRowsIsLayerNorm) {
  std::mt19937_64 rng(13);
  HostTensor x = make_host(DType::f64, {7, 30}), w = make_host(DType::f64, {30});
  fill_random(x, rng); fill_random(w, rng);
  for (int r = 0; r < 7; ++r) {  // make each row's mean exactly representable zero-ish
    double m = 0;
    for (int c = 0; c < 30; ++c) m += x.get(r * 30 + c);
    for (int c = 0; c < 30; ++c) x.set(r * 30 + c, x.get(r * 30 + c) - m / 30);
  }
  HostTensor y1 = like(x), y2 = like(x);
  rmsnorm_fwd({x.ref(), w.ref(), y1.ref(), {}, 1e-6, 0.0});
  layernorm_fwd({x.ref(), w.ref(), {}, y2.ref(), {}, {}, 1e-6, 0.0});
  EXPECT_LT(rel_err(y1, y2), 1e-12);
}

// Rows whose leading dims do not merge into one stride (a gap row after each run of 4 heads): the
// reference walks them through the general row indexing and gives the bits of a contiguous copy.
TEST(NormForms, NonMergeableRowStridesGiveTheContiguousResult) {
  std::mt19937_64 rng(14);
  HostTensor xc = make_host(DType::f64, {3, 4, 16}), w = make_host(DType::f64, {4, 16}), b = make_host(DType::f64, {4, 16});
  HostTensor dyc = like(xc);
  fill_random(xc, rng); fill_random(w, rng); fill_random(b, rng); fill_random(dyc, rng);
  auto gapped = [](const HostTensor& c) {  // the same values at strides (5 * 24, 24, 1)
    HostTensor g = make_host(DType::f64, {3, 5, 24});
    g.shape = {3, 4, 16};
    const auto at = g.offsets();  // logical order
    for (std::size_t i = 0; i < at.size(); ++i) g.set(at[i], c.get(std::int64_t(i)));
    return g;
  };
  HostTensor xg = gapped(xc), dyg = gapped(dyc), yc = like(xc), yg = gapped(yc), dxc = like(xc), dxg = gapped(dxc);
  ASSERT_EQ(xg.strides, (std::vector<std::int64_t>{120, 24, 1}));
  HostTensor mc = make_host(DType::f32, {3, 4}), rc = like(mc), mg = like(mc), rg = like(mc);
  HostTensor dwc = like(w), dbc = like(w), dwg = like(w), dbg = like(w);
  headnorm_fwd({xc.ref(), w.ref(), b.ref(), yc.ref(), mc.ref(), rc.ref(), 1e-6, 1.0});
  headnorm_fwd({xg.ref(), w.ref(), b.ref(), yg.ref(), mg.ref(), rg.ref(), 1e-6, 1.0});
  headnorm_bwd({dyc.ref(), xc.ref(), w.ref(), mc.ref(), rc.ref(), dxc.ref(), dwc.ref(), dbc.ref(), 1.0}, nullptr, 0);
  headnorm_bwd({dyg.ref(), xg.ref(), w.ref(), mg.ref(), rg.ref(), dxg.ref(), dwg.ref(), dbg.ref(), 1.0}, nullptr, 0);
  const auto same = [](const HostTensor& a, const HostTensor& c) { return a.values() == c.values(); };
  EXPECT_TRUE(same(yg, yc)) << "y";
  EXPECT_TRUE(same(dxg, dxc)) << "dx";
  EXPECT_TRUE(same(mg, mc) && same(rg, rc)) << "mean / rstd";
  EXPECT_TRUE(same(dwg, dwc) && same(dbg, dbc)) << "dweight / dbias";
  EXPECT_NE(yc.values(), xc.values());  // something was computed
}

// RowIndexer::offset_lean, the CUDA backward's row offsets (one multiply for rows at one stride, 32-bit divisions for
// merged dims), gives offset's 64-bit value wherever lean(rows) admits the rows: random shapes of 1..kMaxLeadDims
// dims and strides up to 2^40 elements, every row of the small ones and random rows below 2^31 of large ones; the
// guard admits any row count at one stride and refuses merged dims from 2^31 rows on.
TEST(NormRowIndexer, LeanOffsetsMatchTheGeneralOnes) {
  using fastweight::detail::RowIndexer;
  using fastweight::detail::kMaxLeadDims;
  std::mt19937_64 rng(53);
  int checked = 0;
  for (int trial = 0; trial < 400; ++trial) {
    RowIndexer ix;
    ix.nd = 1 + int(rng() % kMaxLeadDims);
    const bool big = trial % 2 == 1;
    std::int64_t rows = 1;
    for (int d = 0; d < ix.nd; ++d) {
      ix.size[d] = big ? std::int64_t(1 + rng() % (std::uint64_t(1) << (30 / ix.nd))) : std::int64_t(1 + rng() % 9);
      ix.stride[d] = std::int64_t(rng() % (std::uint64_t(1) << 40));
      rows *= ix.size[d];
    }
    ASSERT_TRUE(ix.lean(rows)) << rows;
    const std::int64_t n = big ? 2000 : rows;
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t r = big ? std::int64_t(rng() % std::uint64_t(rows)) : i;
      ASSERT_EQ(ix.offset_lean(r), ix.offset(r)) << "nd " << ix.nd << " row " << r;
      ++checked;
    }
  }
  EXPECT_GT(checked, 100000);
  RowIndexer one;  // rows at one stride: exact for any row, 2^31 and past
  one.nd = 1, one.size[0] = std::int64_t(1) << 40, one.stride[0] = 4097;
  EXPECT_TRUE(one.lean(one.size[0]));
  for (const std::int64_t r : {std::int64_t(0), (std::int64_t(1) << 31) + 5, (std::int64_t(1) << 40) - 1})
    EXPECT_EQ(one.offset_lean(r), one.offset(r)) << r;
  RowIndexer single;  // nd 0: a single row
  EXPECT_EQ(single.offset_lean(0), 0);
  RowIndexer two;
  two.nd = 2, two.size[0] = std::int64_t(1) << 20, two.size[1] = std::int64_t(1) << 11, two.stride[0] = 1 << 12,
  two.stride[1] = 1;
  EXPECT_TRUE(two.lean((std::int64_t(1) << 31) - 1));
  EXPECT_FALSE(two.lean(std::int64_t(1) << 31));  // merged dims of 2^31 rows: the general path
}

TEST(NormForms, EmptyBatchGivesZeroWeightGradients) {
  HostTensor x = make_host(DType::f32, {0, 8}), dy = like(x), dx = like(x), w = make_host(DType::f32, {8});
  HostTensor dw = make_host(DType::f32, {8}), db = make_host(DType::f32, {8});
  HostTensor mean = make_host(DType::f32, {0}), rstd = make_host(DType::f32, {0});
  fill_bytes(dw, 0xff);
  fill_bytes(db, 0xff);
  layernorm_bwd({dy.ref(), x.ref(), w.ref(), mean.ref(), rstd.ref(), dx.ref(), dw.ref(), db.ref()}, nullptr, 0);
  for (int i = 0; i < 8; ++i) { EXPECT_EQ(dw.get(i), 0.0); EXPECT_EQ(db.get(i), 0.0); }
}

TEST(NormForms, LowPrecisionIoMatchesFloat64WithinRounding) {
  // The reference in a 16-bit IO dtype equals the float64 reference on the same (rounded) inputs,
  // up to the output rounding.
  for (DType dt : {DType::f16, DType::bf16, DType::f32}) {
    std::mt19937_64 rng(14);
    HostTensor x = make_host(dt, {9, 100}), w = make_host(dt, {100}), y = like(x);
    fill_random(x, rng); fill_random(w, rng);
    layernorm_fwd({x.ref(), w.ref(), {}, y.ref(), {}, {}, 1e-5});
    HostTensor x64 = to_f64(x), w64 = to_f64(w), y64 = like(x64);
    layernorm_fwd({x64.ref(), w64.ref(), {}, y64.ref(), {}, {}, 1e-5});
    EXPECT_LT(rel_err(y, y64), tolerance(dt) / 4) << dtype_name(dt);
  }
}

}  // namespace
}  // namespace fwtest
