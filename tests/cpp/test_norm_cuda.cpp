// test_norm_cuda.cpp: every CUDA norm op against the float64 CPU reference, on the GPU.
//  - fresh random inputs; IO dtypes fp32/fp16/bf16; N in {1, 7, 100, 1000, 4097, 8192, 16384,
//    65536, 262144} (both the register-cached and the streaming engines, vector and scalar paths);
//    and with enough rows (N in {2048, 3000, 8192, 16384}) that the persistent backward loops;
//  - rows cut from a larger buffer (padded row stride, start shifted by one element: unaligned), and
//    aligned rows at a padded stride (the Hopper bulk-copy forward, with it switched off too);
//  - outputs poisoned with NaN before the run: every element of every output must be written;
//  - relative Frobenius error of y, mean, rstd, dx, dweight, dbias within the dtype's bound;
//  - the same inputs run twice give bit-identical outputs (deterministic weight gradients);
//  - launched on a non-default stream.
// Skipped (not passed) where no GPU is present.
#include <algorithm>
#include <functional>
#include <string>
#include <tuple>

#include "cuda/common/check.cuh"
#include "cuda/norm/norm_cuda.h"
#include "norm_cases.h"

namespace fwtest {
namespace {

// strided: rows cut from a larger buffer, shifted by one element (unaligned); padded: aligned rows
// at a padded stride (x, dy: N + 8; y, dx: N + 16), the bulk-copy forward's path on Hopper; gapped:
// padded, and with 3 or more dims a gap of one row after each run of the second-to-last dim, so the
// leading dims cannot merge into one row stride (the kernels' general row indexing, RowIndexer nd 2)
enum class Layout { contiguous, strided, padded, gapped };

HostTensor make_layout(DType dt, const std::vector<std::int64_t>& shape, Layout layout, std::int64_t pad,
                       std::int64_t lead) {
  if (layout != Layout::gapped || shape.size() < 3) return make_host(dt, shape, pad, lead);
  HostTensor t;
  t.dtype = dt;
  t.shape = shape;
  t.strides.assign(shape.size(), 1);
  const int last = int(shape.size()) - 1;
  std::int64_t s = shape[last] + pad;
  t.strides[last - 1] = s;
  s *= shape[last - 1] + 1;  // the gap row
  for (int d = last - 2; d >= 0; --d) {
    t.strides[d] = s;
    s *= shape[d];
  }
  t.offset = lead;
  t.bytes.assign(std::size_t(s + lead + 8) * t.esize(), 0);
  return t;
}
enum class Params { io, f32, none };

struct Outputs {
  HostTensor y, mean, rstd, dx, dw, db;
};

HostTensor stats_like(const Problem& pb) { return make_host(DType::f32, {pb.rows}); }

// Runs fwd then bwd (with the forward's own statistics) on the device; returns the outputs.
Outputs run_device(const Problem& pb, HostTensor& x, HostTensor& w, HostTensor& b, HostTensor& dy,
                   bool has_w, bool has_b, Layout layout, double eps, double offset, cudaStream_t stream) {
  const bool rms = pb.op == Op::rmsnorm;
  const std::int64_t pad = layout == Layout::strided ? 3 : layout == Layout::contiguous ? 0 : 16;
  const std::int64_t lead = layout == Layout::strided ? 1 : 0;
  Outputs o{make_layout(x.dtype, pb.x_shape, layout, pad, lead), stats_like(pb), stats_like(pb),
            make_layout(x.dtype, pb.x_shape, layout, pad, lead), make_host(w.dtype, pb.p_shape), make_host(w.dtype, pb.p_shape)};
  for (HostTensor* t : {&o.y, &o.mean, &o.rstd, &o.dx, &o.dw, &o.db}) fill_bytes(*t, 0xff);  // NaN
  DeviceMirror dx_(x), dw_(w), db_(b), ddy(dy), dy_(o.y), dmean(o.mean), drstd(o.rstd), ddx(o.dx), ddw(o.dw), ddb(o.db);
  const TensorRef wr = has_w ? dw_.ref(w) : TensorRef{}, br = has_b ? db_.ref(b) : TensorRef{};
  run_fwd(pb.op, {dx_.ref(x), wr, br, dy_.ref(o.y), rms ? TensorRef{} : dmean.ref(o.mean), drstd.ref(o.rstd), eps, offset}, stream);
  const BwdRefs ba{ddy.ref(dy), dx_.ref(x), wr, rms ? TensorRef{} : dmean.ref(o.mean), drstd.ref(o.rstd), ddx.ref(o.dx),
                   has_w ? ddw.ref(o.dw) : TensorRef{}, has_b ? ddb.ref(o.db) : TensorRef{}, offset};
  const std::size_t wsb = bwd_ws(pb.op, ba);
  void* ws = nullptr;
  if (wsb) EXPECT_EQ(cudaMalloc(&ws, wsb), cudaSuccess);
  run_bwd(pb.op, ba, ws, wsb, stream);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  cudaFree(ws);
  dy_.download(o.y); dmean.download(o.mean); drstd.download(o.rstd);
  ddx.download(o.dx); ddw.download(o.dw); ddb.download(o.db);
  return o;
}

// The parameter group of row r: headnorm (rows / NH, NH, n): r % NH; adaLN (B, S, n): r / S.
std::int64_t group_of(const Problem& pb, std::int64_t r) {
  if (pb.op == Op::headnorm) return r % pb.p_shape[0];
  if (pb.op == Op::adalayernorm) return r / pb.x_shape[1];
  return 0;
}

// ||rstd * dy * s|| over all rows (s = weight_offset + w, or 1): the magnitude of dx's terms.
double cancel_scale(const Problem& pb, const HostTensor& x64, const HostTensor& dy64, const HostTensor& w64,
                    bool has_w, double offset, const HostTensor& rstd) {
  const std::int64_t n = pb.n;
  double ss = 0.0;
  for (std::int64_t r = 0; r < pb.rows; ++r) {
    const std::int64_t g = group_of(pb, r);
    for (std::int64_t c = 0; c < n; ++c) {
      const double s = has_w ? offset + w64.get(g * n + c) : 1.0;
      const double t = rstd.get(r) * dy64.get(r * n + c) * s;
      ss += t * t;
    }
  }
  (void)x64;
  return std::sqrt(ss);
}

// The size of the rounding in dweight's column sums, sum over rows of |dy * xhat| per parameter
// element (its Frobenius norm over the parameters): with few columns (N = 1: a single sum of 512
// random-sign terms) dweight itself can nearly cancel.
double dw_scale(const Problem& pb, const HostTensor& x64, const HostTensor& dy64, const HostTensor& mean,
                const HostTensor& rstd, bool rms) {
  const std::int64_t n = pb.n, groups = pb.p_shape.size() > 1 ? pb.p_shape[0] : 1;
  std::vector<double> acc(static_cast<std::size_t>(groups * n), 0.0);
  for (std::int64_t r = 0; r < pb.rows; ++r) {
    const std::int64_t g = group_of(pb, r);
    const double mu = rms ? 0.0 : mean.get(r);
    for (std::int64_t c = 0; c < n; ++c)
      acc[g * n + c] += std::fabs(dy64.get(r * n + c) * (x64.get(r * n + c) - mu) * rstd.get(r));
  }
  double ss = 0.0;
  for (double v : acc) ss += v * v;
  return std::sqrt(ss);
}

// The size of the rounding in dbias's column sums: the Frobenius norm over the parameters of sum over rows of |dy|.
double db_scale(const Problem& pb, const HostTensor& dy64) {
  const std::int64_t n = pb.n, groups = pb.p_shape.size() > 1 ? pb.p_shape[0] : 1;
  std::vector<double> acc(static_cast<std::size_t>(groups * n), 0.0);
  const double* dy = static_cast<const double*>(dy64.base());  // (contiguous: to_f64)
  for (std::int64_t r = 0; r < pb.rows; ++r) {
    double* a = acc.data() + group_of(pb, r) * n;
    for (std::int64_t c = 0; c < n; ++c) a[c] += std::fabs(dy[r * n + c]);
  }
  double ss = 0.0;
  for (double v : acc) ss += v * v;
  return std::sqrt(ss);
}

// ||a - b|| / max(||b||, scale), absolute where both are 0 (as rel_err: LayerNorm's N = 1 rows
// have xhat = 0, so dweight and its scale are exactly 0)
double err_vs_scale(const HostTensor& a, const HostTensor& b, double scale) {
  EXPECT_EQ(a.shape, b.shape);  // (every pair here: an output and its reference)
  if (a.shape != b.shape) return INFINITY;
  double num = 0.0, den = 0.0;
  bool finite = true;
  for_each_offset_pair(a, b, [&](std::int64_t oa, std::int64_t ob) {
    const double x = a.get(oa), y = b.get(ob);
    finite = finite && std::isfinite(x);
    num += (x - y) * (x - y);
    den += y * y;
  });
  if (!finite) return INFINITY;
  const double d = std::max(std::sqrt(den), scale);
  return std::sqrt(num) / (d > 0 ? d : 1.0);
}

bool same_view_bits(const HostTensor& a, const HostTensor& b) {
  if (a.shape != b.shape || a.dtype != b.dtype) return a.elem_bytes() == b.elem_bytes();
  const std::size_t es = a.esize();
  const unsigned char *pa = a.bytes.data(), *pb = b.bytes.data();
  bool same = true;
  for_each_row_pair(a, b, [&](std::int64_t ra, std::int64_t rb, std::int64_t cnt, std::int64_t as, std::int64_t bs) {
    if (!same) return;
    if (as == 1 && bs == 1) {  // (contiguous rows: one comparison)
      same = std::memcmp(pa + ra * es, pb + rb * es, std::size_t(cnt) * es) == 0;
      return;
    }
    for (std::int64_t i = 0; i < cnt && same; ++i) same = std::memcmp(pa + (ra + i * as) * es, pb + (rb + i * bs) * es, es) == 0;
  });
  return same;
}

// Parameter groups of the row-sweep tests' problems: head norm 4 heads, adaLN 2 samples, else 1 (rows are a multiple).
std::int64_t param_groups(Op op) { return op == Op::headnorm ? 4 : op == Op::adalayernorm ? 2 : 1; }

// Restores the forced one-row shape (force_rownorm_fwd_row1_config) at scope exit.
struct RestoreRow1Config {
  fastweight::detail::Row1Config prev = fastweight::detail::rownorm_fwd_row1_config();
  ~RestoreRow1Config() { fastweight::detail::force_rownorm_fwd_row1_config(prev); }
};

using CaseParam = std::tuple<Op, DType, std::int64_t, Layout, Params>;
struct NormCuda : ::testing::TestWithParam<CaseParam> {};

// One case: fwd + bwd of (op, dtype, rows x n) twice on the device against the float64 reference.
// expect_kernel: the forward kernel the case must have run (rownorm_fwd_last_kernel), where given.
// before_second: called between the two runs (a switch to another instance that must give the same bits).
void check_case(Op op, DType dt, std::int64_t n, std::int64_t rows, Layout layout, Params params,
                const char* expect_kernel = nullptr, const std::function<void()>& before_second = {}) {
  const Problem pb = make_problem(op, rows, n);
  const bool rms = op == Op::rmsnorm;
  const bool has_w = params != Params::none || op == Op::adalayernorm, has_b = has_w && pb.has_b;
  const DType pdt = params == Params::f32 ? DType::f32 : dt;
  const double eps = op == Op::rmsnorm || op == Op::headnorm ? 1e-6 : 1e-5;
  const double offset = op == Op::headnorm ? 1.0 : 0.0;
  std::mt19937_64 rng(std::random_device{}());  // fresh inputs every run
  const std::int64_t pad = layout == Layout::strided ? 5 : layout == Layout::contiguous ? 0 : 8;
  const std::int64_t lead = layout == Layout::strided ? 1 : 0;
  HostTensor x = make_layout(dt, pb.x_shape, layout, pad, lead), dy = make_layout(dt, pb.x_shape, layout, pad, lead);
  HostTensor w = make_host(pdt, pb.p_shape), b = make_host(pdt, pb.p_shape);
  fill_random(x, rng, -3.0, 5.0);  // non-zero mean
  fill_random(dy, rng);
  fill_random(w, rng, op == Op::headnorm ? -0.5 : 0.5, 1.5);
  fill_random(b, rng);

  // float64 reference on the same (rounded) inputs
  HostTensor x64 = to_f64(x), dy64 = to_f64(dy), w64 = to_f64(w), b64 = to_f64(b);
  HostTensor y64 = make_host(DType::f64, pb.x_shape), dx64 = make_host(DType::f64, pb.x_shape);
  HostTensor dw64 = make_host(DType::f64, pb.p_shape), db64 = make_host(DType::f64, pb.p_shape);
  HostTensor mean64 = stats_like(pb), rstd64 = stats_like(pb);
  run_fwd(op, {x64.ref(), has_w ? w64.ref() : TensorRef{}, has_b ? b64.ref() : TensorRef{}, y64.ref(),
               rms ? TensorRef{} : mean64.ref(), rstd64.ref(), eps, offset});
  run_bwd(op, {dy64.ref(), x64.ref(), has_w ? w64.ref() : TensorRef{}, rms ? TensorRef{} : mean64.ref(), rstd64.ref(),
               dx64.ref(), has_w ? dw64.ref() : TensorRef{}, has_b ? db64.ref() : TensorRef{}, offset}, nullptr, 0);

  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const Outputs o1 = run_device(pb, x, w, b, dy, has_w, has_b, layout, eps, offset, stream);
  if (before_second) before_second();
  const Outputs o2 = run_device(pb, x, w, b, dy, has_w, has_b, layout, eps, offset, stream);
  cudaStreamDestroy(stream);

  const double tol = tolerance(dt);
  const std::string what = std::string(op_name(op)) + " " + dtype_name(dt) + " rows=" + std::to_string(rows) +
                           " n=" + std::to_string(n);
  if (expect_kernel) EXPECT_STREQ(fastweight::detail::rownorm_fwd_last_kernel(), expect_kernel) << what;
  EXPECT_LE(rel_err(o1.y, y64), tol) << what << " y";
  EXPECT_LE(rel_err(o1.rstd, rstd64), 1e-5) << what << " rstd";
  if (!rms) EXPECT_LE(rel_err(o1.mean, mean64), 1e-5) << what << " mean";
  // dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) cancels almost fully in degenerate rows
  // (N = 1: dx ~ eps / (x^2 + eps)); measure its error against the size of the terms that cancel,
  // ||rstd * g||, which equals ||dx|| up to a constant whenever the cancellation is not near-total.
  EXPECT_LE(err_vs_scale(o1.dx, dx64, cancel_scale(pb, x64, dy64, w64, has_w, offset, rstd64)), tol) << what << " dx";
  // Gradients of parameters stored in fp32 are held to the fp32 bound only when x is fp32 too:
  // they sum products of 16-bit inputs, exactly as the reference does, so the IO bound applies.
  if (has_w)
    EXPECT_LE(err_vs_scale(o1.dw, dw64, dw_scale(pb, x64, dy64, mean64, rstd64, rms)), tol) << what << " dweight";
  if (has_b) {
    // dbias sums dy over rows: with few columns (N = 1: a single sum of 512 fresh random terms) the sum
    // can nearly cancel, so its error is measured against the sum of |dy| per parameter, the size of its rounding.
    EXPECT_LE(err_vs_scale(o1.db, db64, db_scale(pb, dy64)), tol) << what << " dbias";
  }

  EXPECT_TRUE(same_view_bits(o1.y, o2.y)) << what << " y differs between two runs";
  EXPECT_TRUE(same_view_bits(o1.dx, o2.dx)) << what << " dx differs between two runs";
  if (has_w) EXPECT_TRUE(same_view_bits(o1.dw, o2.dw)) << what << " dweight differs between two runs";
  if (has_b) EXPECT_TRUE(same_view_bits(o1.db, o2.db)) << what << " dbias differs between two runs";
}

TEST_P(NormCuda, MatchesReferenceWritesEverythingAndIsDeterministic) {
  FW_REQUIRE_GPU();
  const auto [op, dt, n, layout, params] = GetParam();
  check_case(op, dt, n, std::max<std::int64_t>(4, std::min<std::int64_t>(512, (std::int64_t(1) << 20) / n)), layout, params);
}

// Enough rows that the persistent backward CTAs loop several times (about 3 waves of row groups
// on a 132-SM H100): the cp.async ring's stage rotation and the double-buffered row sums only run
// from the second row of a row group on. Aligned rows with 1 to 8 row groups per CTA.
using RowsParam = std::tuple<Op, DType, std::int64_t>;
struct NormCudaManyRows : ::testing::TestWithParam<RowsParam> {};
std::string rows_case_name(const ::testing::TestParamInfo<RowsParam>& info) {
  const auto [op, dt, n] = info.param;
  return std::string(op_name(op)) + "_" + dtype_name(dt) + "_N" + std::to_string(n);
}
TEST_P(NormCudaManyRows, PersistentLoopsMatchReference) {
  FW_REQUIRE_GPU();
  const auto [op, dt, n] = GetParam();
  const std::int64_t rows = n <= 2048 ? 3000 : n <= 4096 ? 1700 : n <= 8192 ? 800 : 400;
  check_case(op, dt, n, rows, Layout::contiguous, Params::io);
}
INSTANTIATE_TEST_SUITE_P(Waves, NormCudaManyRows,
                         ::testing::Combine(::testing::Values(Op::layernorm, Op::rmsnorm, Op::headnorm),
                                            ::testing::Values(DType::f32, DType::bf16),
                                            ::testing::Values<std::int64_t>(2048, 3000, 8192, 16384)),
                         rows_case_name);

std::string case_name(const ::testing::TestParamInfo<CaseParam>& info) {
  const auto [op, dt, n, layout, params] = info.param;
  std::string s = std::string(op_name(op)) + "_" + dtype_name(dt) + "_N" + std::to_string(n);
  const char* lname[] = {"_contig", "_strided", "_padded", "_gapped"};  // Layout's order
  s += lname[int(layout)];
  s += params == Params::io ? "" : params == Params::f32 ? "_f32params" : "_noparams";
  return s;
}

const auto kOps = ::testing::Values(Op::layernorm, Op::rmsnorm, Op::headnorm, Op::adalayernorm);
const auto kDtypes = ::testing::Values(DType::f32, DType::f16, DType::bf16);

INSTANTIATE_TEST_SUITE_P(Sizes, NormCuda,
                         ::testing::Combine(kOps, kDtypes,
                                            ::testing::Values<std::int64_t>(1, 7, 100, 1000, 4097, 8192, 16384, 65536, 262144),
                                            ::testing::Values(Layout::contiguous, Layout::strided),
                                            ::testing::Values(Params::io)),
                         case_name);
INSTANTIATE_TEST_SUITE_P(ParamVariants, NormCuda,
                         ::testing::Combine(kOps, ::testing::Values(DType::bf16, DType::f16),
                                            ::testing::Values<std::int64_t>(128, 1024, 20000),
                                            ::testing::Values(Layout::contiguous),
                                            ::testing::Values(Params::f32, Params::none)),
                         case_name);

// Aligned rows at a padded stride through the Hopper bulk-copy forward (rownorm_fwd_bulk.cuh), with
// 4 and with 8 vectors per thread (each where its slots fit; tpr 1 to 512). The CTAs per parameter
// group are capped at 3, so that few rows give each row group 9-18 rows, 2-9 trips around its ring
// of 2-4 row slots (slot reuse, mbarrier phases), ending on a partial step.
using BulkParam = std::tuple<Op, DType, std::int64_t>;
struct NormCudaBulk : ::testing::TestWithParam<BulkParam> {};
TEST_P(NormCudaBulk, PaddedAlignedRowsMatchReference) {
  FW_REQUIRE_GPU();
  const auto [op, dt, n] = GetParam();
  struct Restore {
    int prev;
    ~Restore() { fastweight::detail::cap_rownorm_fwd_bulk_ctas(prev); }
  } restore{fastweight::detail::cap_rownorm_fwd_bulk_ctas(3)};
  struct RestoreRow1 {  // rows the one-row-per-CTA kernel would take go to the bulk kernel here
    bool prev;
    ~RestoreRow1() { fastweight::detail::set_rownorm_fwd_row1(prev); }
  } restore_row1{fastweight::detail::set_rownorm_fwd_row1(false)};
  const std::int64_t esz = dt == DType::f32 ? 4 : 2, vecs = std::max<std::int64_t>(1, n * esz / 16);
  std::int64_t tpr = 1;
  while (tpr * 4 < vecs) tpr *= 2;
  const std::int64_t R = 512 / tpr;  // row groups per CTA (kBulkThreads / tpr)
  // head norm's 4 and adaLN's 2 parameter groups (norm_cases.h) each get 3 CTAs
  const std::int64_t groups = param_groups(op);
  const std::int64_t rows = groups * (3 * R * 6 + std::max<std::int64_t>(1, R / 2));
  for (int vpt : {4, 8}) {
    SCOPED_TRACE("bulk vectors per thread " + std::to_string(vpt));
    struct RestoreVecs {
      int prev;
      ~RestoreVecs() { fastweight::detail::force_rownorm_fwd_bulk_vecs(prev); }
    } restore_vecs{fastweight::detail::force_rownorm_fwd_bulk_vecs(vpt)};
    // the bulk kernel must have run where the rows are within its reach (512 threads x 4 vectors)
    const bool reach = fastweight::detail::cc_major() >= 9 && n * esz <= 512 * 4 * 16;
    check_case(op, dt, n, rows, Layout::padded, Params::io, reach ? "bulk" : nullptr);
  }
}
INSTANTIATE_TEST_SUITE_P(Ring, NormCudaBulk,
                         ::testing::Combine(kOps, kDtypes, ::testing::Values<std::int64_t>(8, 128, 1000, 8192, 16384)),
                         rows_case_name);

// The bulk forward's unstaged-parameter form: aligned rows past its reach, up to twice it
// (set_rownorm_fwd_bulk_long mode 2, every such row: one row group of 512 threads x 8 vectors per CTA; N just past the reach
// leaves most of the last vectors' threads idle), and rows within it where forced
// (force_rownorm_fwd_bulk_unstaged: 1 to 64 row groups per CTA). CTAs capped at 3 per parameter group so
// that each row group goes several times around its ring of row slots; padded rows; parameters in the IO
// dtype and none (the form's rule: fp32 parameters of 16-bit rows stay on the other kernels). Rows past
// the reach again in CTAs of 1024 threads (set_rownorm_fwd_bulk_long_wide); every row again with a
// row's parameter loads issued at once (set_rownorm_fwd_bulk_hoist mode 2), and under the default mode
// 1 (these few rows: hoisted past the reach only).
struct NormCudaBulkUnstaged : ::testing::TestWithParam<BulkParam> {};
TEST_P(NormCudaBulkUnstaged, PaddedAlignedRowsMatchReference) {
  FW_REQUIRE_GPU();
  const auto [op, dt, n] = GetParam();
  const ScopedSwitch<int> cap(&fastweight::detail::cap_rownorm_fwd_bulk_ctas, 3);
  const ScopedSwitch<int> long_rows(&fastweight::detail::set_rownorm_fwd_bulk_long, 2);
  const ScopedSwitch<bool> unstaged(&fastweight::detail::force_rownorm_fwd_bulk_unstaged, true);
  const ScopedSwitch<bool> no_row1(&fastweight::detail::set_rownorm_fwd_row1, false);  // (its rows: the bulk kernel)
  const ScopedSwitch<int> no_hoist(&fastweight::detail::set_rownorm_fwd_bulk_hoist, 0);
  const std::int64_t len = dt == DType::f32 ? n / 2 : n;  // fp32: the reach is half as many elements
  const std::int64_t esz = dt == DType::f32 ? 4 : 2, vecs = std::max<std::int64_t>(1, len * esz / 16);
  std::int64_t tpr = 1;
  while (tpr * 8 < vecs) tpr *= 2;
  const std::int64_t R = 512 / tpr;  // row groups per CTA
  const std::int64_t groups = param_groups(op);
  const std::int64_t rows = groups * (3 * R * 4 + std::max<std::int64_t>(1, R / 2));
  // the path must have run: the unstaged bulk kernel on Hopper (each of these rows is within its reach)
  const char* expect = fastweight::detail::cc_major() >= 9 ? "bulk_unstaged" : nullptr;
  for (Params par : {Params::io, Params::none}) check_case(op, dt, len, rows, Layout::padded, par, expect);
  // and the staged parameters (fp32) it cannot take go to the planner's other kernels
  check_case(op, dt, len, rows, Layout::padded, Params::f32);
  // every case again with a row's parameter loads issued at once (set_rownorm_fwd_bulk_hoist), and rows
  // past the reach in 1024-thread CTAs of 4 vectors (set_rownorm_fwd_bulk_long_wide)
  const bool past_reach = len * esz > 512 * 4 * 16;
  auto with_switch = [&]<typename V>(V (*set)(V), V value, const char* kernel) {
    const ScopedSwitch<V> on(set, value);
    SCOPED_TRACE(kernel);
    const char* expect_kernel = fastweight::detail::cc_major() >= 9 ? kernel : nullptr;
    for (Params par : {Params::io, Params::none}) check_case(op, dt, len, rows, Layout::padded, par, expect_kernel);
  };
  with_switch(&fastweight::detail::set_rownorm_fwd_bulk_hoist, 2, "bulk_unstaged_hoist");
  with_switch(&fastweight::detail::set_rownorm_fwd_bulk_hoist, 1, past_reach ? "bulk_unstaged_hoist" : "bulk_unstaged");
  if (past_reach) with_switch(&fastweight::detail::set_rownorm_fwd_bulk_long_wide, true, "bulk_unstaged_1024");
}
INSTANTIATE_TEST_SUITE_P(Ring, NormCudaBulkUnstaged,
                         ::testing::Combine(kOps, kDtypes,
                                            ::testing::Values<std::int64_t>(1000, 8192, 16384, 16392, 24576, 32768)),
                         rows_case_name);

// The planner's defaults for long rows in few rows per SM: at N = 32768 the one-row kernel's capped 8 x 512
// instance (set_rownorm_fwd_row1_long); with that off (set_rownorm_fwd_bulk_long mode 1, set_rownorm_fwd_bulk_hoist
// mode 1), LayerNorm and RMSNorm take the hoisted unstaged bulk kernel; without the hoist, RMSNorm goes back to the
// streaming kernel and LayerNorm keeps the unhoisted form.
TEST(NormCudaBulkLongDefault, FewLongRowsTakeTheHoistedKernel) {
  FW_REQUIRE_GPU();
  const bool hopper = fastweight::detail::cc_major() >= 9;
  const ScopedSwitch<int> long_mode(&fastweight::detail::set_rownorm_fwd_bulk_long, 1);
  const ScopedSwitch<int> hoist_mode(&fastweight::detail::set_rownorm_fwd_bulk_hoist, 1);
  for (Op op : {Op::layernorm, Op::rmsnorm}) {
    SCOPED_TRACE(op == Op::layernorm ? "layernorm" : "rmsnorm");
    check_case(op, DType::bf16, 32768, 5, Layout::padded, Params::io, hopper ? "row1" : nullptr);
    const ScopedSwitch<bool> no_row1_long(&fastweight::detail::set_rownorm_fwd_row1_long, false);
    check_case(op, DType::bf16, 32768, 5, Layout::padded, Params::io, hopper ? "bulk_unstaged_hoist" : nullptr);
    const ScopedSwitch<int> no_hoist(&fastweight::detail::set_rownorm_fwd_bulk_hoist, 0);
    check_case(op, DType::bf16, 32768, 5, Layout::padded, Params::io,
               !hopper ? nullptr : op == Op::layernorm ? "bulk_unstaged" : "stream");
  }
}

// Aligned 16-bit rows of 33 to 256 vectors in small problems through the one-row-per-CTA forward
// (rownorm_fwd_row1_kernel), as planned (4 vectors per thread at N 3080..4096 with IO-dtype parameters; 4 x 256 threads,
// registers capped, at N 6152..8192 and 12296..16384 in capped mode 1, few rows; 8 x 256 with x packed at N
// 14344..16384 past 2 rows per SM; 8 x 512 at N 28680..32768 where set_rownorm_fwd_row1_long says so, the default, x
// packed or not; parameters one vector ahead or not, set_rownorm_fwd_row1_prefetch modes 0 and 2) and with 1 and 2
// forced (2: up to 512 vectors): every CTA size it launches (32 to 256 threads; N just past a power of two leaves
// most of the CTA's threads without a vector), padded and contiguous rows, both parameter instances (IO dtype raw, fp32
// through load_params_vec), rows in memory order over head norm's and adaLN's parameter groups; and the same rows with
// it switched off (bulk / persistent kernels).
struct NormCudaRow1 : ::testing::TestWithParam<BulkParam> {};
TEST_P(NormCudaRow1, AlignedRowsMatchReference) {
  FW_REQUIRE_GPU();
  const auto [op, dt, n] = GetParam();
  const std::int64_t groups = param_groups(op);
  for (int vpt : {0, 1, 2}) {  // 0: the planner's choice; 1, 2 forced (2 also takes N = 4096)
    SCOPED_TRACE("row1 vectors per thread (0: planner) " + std::to_string(vpt));
    struct RestoreVecs {
      int prev;
      ~RestoreVecs() { fastweight::detail::force_rownorm_fwd_row1_vecs(prev); }
    } restore_vecs{fastweight::detail::force_rownorm_fwd_row1_vecs(vpt)};
    check_case(op, dt, n, groups * 37, Layout::padded, Params::io);
    check_case(op, dt, n, groups * 5, Layout::contiguous, Params::f32);
  }
  if (n > 3 * 1024 && n <= 4096) {  // the planner's 4 x 128 instance with registers capped (mode 2)
    const ScopedSwitch<int> capped(&fastweight::detail::set_rownorm_fwd_row1_capped, 2);
    check_case(op, dt, n, groups * 37, Layout::padded, Params::io,
               fastweight::detail::cc_major() >= 9 ? "row1" : nullptr);
  }
  for (int prefetch : {0, 2}) {  // the 4- and 8-vector instances' parameters after the sums / one vector ahead
    SCOPED_TRACE(prefetch ? "parameters prefetched" : "parameters after the sums");
    const ScopedSwitch<int> pf(&fastweight::detail::set_rownorm_fwd_row1_prefetch, prefetch);
    if (prefetch && n > 3 * 1024 && n <= 4096) {  // the planner's 4 x 128 instance
      check_case(op, dt, n, groups * 37, Layout::padded, Params::io,
                 fastweight::detail::cc_major() >= 9 ? "row1" : nullptr);
    }
    // rows of 769..1024 / 1537..2048 vectors: the planner's 4 x 256 / 4 x 512, capped (these few rows)
    if (n > 6144 && n <= 16384) {
      const ScopedSwitch<int> capped(&fastweight::detail::set_rownorm_fwd_row1_capped, 1);
      check_case(op, dt, n, groups * 37, Layout::padded, Params::io,
                 fastweight::detail::cc_major() >= 9 ? "row1" : nullptr);
      check_case(op, dt, n, groups * 5, Layout::contiguous, Params::f32);  // fp32 parameters: not raw
    }
    if (n > 28672) {  // long rows: the capped 8 x 512 instance (set_rownorm_fwd_row1_long)
      const ScopedSwitch<bool> long_rows(&fastweight::detail::set_rownorm_fwd_row1_long, true);
      check_case(op, dt, n, groups * 37, Layout::padded, Params::io,
                 fastweight::detail::cc_major() >= 9 ? "row1" : nullptr);
      check_case(op, dt, n, groups * 5, Layout::contiguous, Params::f32);  // fp32 parameters: not raw
      // x kept packed, 2 CTAs per SM (set_rownorm_fwd_row1_rawx): the same bits as the instance above
      const ScopedSwitch<int> rawx(&fastweight::detail::set_rownorm_fwd_row1_rawx, 0);
      check_case(op, dt, n, groups * 37, Layout::padded, Params::io,
                 fastweight::detail::cc_major() >= 9 ? "row1" : nullptr,
                 [] { fastweight::detail::set_rownorm_fwd_row1_rawx(1); });
    }
  }
  if (n > 14336 && n <= 16384) {  // more than 2 rows per SM: the planner's 8 x 256 with x packed (rawx mode 1)
    const std::int64_t sms = fastweight::detail::sm_count();
    check_case(op, dt, n, groups * (2 * sms / groups + 3), Layout::padded, Params::io,
               fastweight::detail::cc_major() >= 9 ? "row1" : nullptr);
  }
  struct Restore {
    bool prev;
    ~Restore() { fastweight::detail::set_rownorm_fwd_row1(prev); }
  } restore{fastweight::detail::set_rownorm_fwd_row1(false)};
  check_case(op, dt, n, groups * 37, Layout::padded, Params::io);
}
INSTANTIATE_TEST_SUITE_P(Row1, NormCudaRow1,
                         ::testing::Combine(kOps, ::testing::Values(DType::f16, DType::bf16),
                                            ::testing::Values<std::int64_t>(264, 520, 1000, 2048, 4096, 6400, 8192, 16384, 32768)),
                         rows_case_name);

// The one-row-per-CTA forward in every forced shape (force_rownorm_fwd_row1_config): 64 to 1024 threads per row, 8- and
// 16-byte vectors (1 or 2 per thread as the shape implies; 4 and 8 with 16-byte vectors loaded after the sums),
// parameters loaded with x or after the sums; the 8-warp and 32-warp sum trees; plain ld.global loads; the 4- and
// 8-vector shapes again with registers capped and with their parameters one vector ahead (set_rownorm_fwd_row1_prefetch),
// and with x kept packed (set_rownorm_fwd_row1_rawx; capped: the same bits as without).
// Shapes it cannot take go to the planner's kernel (also checked). Padded rows, IO-dtype parameters (the instances' only
// kind).
struct NormCudaRow1Shapes : ::testing::TestWithParam<BulkParam> {};
TEST_P(NormCudaRow1Shapes, ForcedShapesMatchReference) {
  FW_REQUIRE_GPU();
  const auto [op, dt, n] = GetParam();
  const std::int64_t groups = param_groups(op);
  const RestoreRow1Config restore;
  for (int tpr : {64, 128, 256, 512, 1024})
    for (int vb : {8, 16})
      for (bool late : {false, true}) {
        SCOPED_TRACE("row1 shape: " + std::to_string(tpr) + " threads, " + std::to_string(vb) + "-byte vectors" +
                     (late ? ", parameters after the sums" : ""));
        fastweight::detail::force_rownorm_fwd_row1_config({tpr, vb, late, false});
        check_case(op, dt, n, groups * 9, Layout::padded, Params::io);
        if (vb == 16 && late && tpr <= 256) {  // the plain-load twin of the planner's instances
          SCOPED_TRACE("plain ld.global");
          fastweight::detail::force_rownorm_fwd_row1_config({tpr, vb, late, true});
          check_case(op, dt, n, groups * 9, Layout::padded, Params::io);
        }
        const std::int64_t vpt = (n / 8 + tpr - 1) / tpr;  // 16-byte vectors per thread
        if (vb == 16 && late && (vpt == 4 || vpt == 8)) {  // the register-capped twins (set_rownorm_fwd_row1_capped)
          for (int prefetch : {0, 2}) {  // and those with the parameters one vector ahead
            SCOPED_TRACE(prefetch ? "registers capped, parameters prefetched" : "registers capped");
            const ScopedSwitch<int> capped(&fastweight::detail::set_rownorm_fwd_row1_capped, 2);
            const ScopedSwitch<int> pf(&fastweight::detail::set_rownorm_fwd_row1_prefetch, prefetch);
            fastweight::detail::force_rownorm_fwd_row1_config({tpr, vb, late, false});
            check_case(op, dt, n, groups * 9, Layout::padded, Params::io);
          }
          {  // x kept packed (set_rownorm_fwd_row1_rawx mode 2; the 8-vector shapes at twice the CTAs per SM): the
             // same bits as the capped instance without
            SCOPED_TRACE("registers capped, x packed");
            const ScopedSwitch<int> capped(&fastweight::detail::set_rownorm_fwd_row1_capped, 2);
            const ScopedSwitch<int> rawx(&fastweight::detail::set_rownorm_fwd_row1_rawx, 0);
            fastweight::detail::force_rownorm_fwd_row1_config({tpr, vb, late, false});
            check_case(op, dt, n, groups * 9, Layout::padded, Params::io, nullptr,
                       [] { fastweight::detail::set_rownorm_fwd_row1_rawx(2); });
          }
          if (vpt == 4) {  // the uncapped 4-vector shapes x packed (48 registers at 4 x 128)
            SCOPED_TRACE("uncapped, x packed");
            const ScopedSwitch<int> uncapped(&fastweight::detail::set_rownorm_fwd_row1_capped, 0);
            const ScopedSwitch<int> rawx(&fastweight::detail::set_rownorm_fwd_row1_rawx, 2);
            fastweight::detail::force_rownorm_fwd_row1_config({tpr, vb, late, false});
            check_case(op, dt, n, groups * 9, Layout::padded, Params::io);
          }
          SCOPED_TRACE("parameters prefetched, uncapped");
          const ScopedSwitch<int> uncapped(&fastweight::detail::set_rownorm_fwd_row1_capped, 0);
          const ScopedSwitch<int> pf(&fastweight::detail::set_rownorm_fwd_row1_prefetch, 2);
          fastweight::detail::force_rownorm_fwd_row1_config({tpr, vb, late, false});
          check_case(op, dt, n, groups * 9, Layout::padded, Params::io);
        }
      }
}
INSTANTIATE_TEST_SUITE_P(Row1, NormCudaRow1Shapes,
                         ::testing::Combine(kOps, ::testing::Values(DType::f16, DType::bf16),
                                            ::testing::Values<std::int64_t>(264, 1000, 2048, 4096, 16384, 32768)),
                         rows_case_name);

// The one-row forward's CTAs need not be a power of two: any multiple of 32 threads (its sums run over whole warps and
// zero the other warp slots). Forced shapes that give every thread its vectors at hidden sizes whose rows a power of
// two would leave partly idle (N 3072 .. 28672: tpr = 16-byte vectors / VPT, a multiple of 32): the default modes,
// every capped instance (mode 2), and, for 4 and 8 vectors, x packed against the instance without (the same bits).
// Padded rows, IO-dtype parameters (the deep instances' only kind).
struct NormCudaRow1Tight : ::testing::TestWithParam<BulkParam> {};
TEST_P(NormCudaRow1Tight, WholeWarpShapesMatchReference) {
  FW_REQUIRE_GPU();
  const auto [op, dt, n] = GetParam();
  const std::int64_t groups = param_groups(op);
  const RestoreRow1Config restore;
  const std::int64_t nvec = n / 8;
  int shapes = 0;
  for (int vpt : {2, 4, 8}) {
    if (nvec % vpt != 0 || (nvec / vpt) % 32 != 0 || nvec / vpt > 1024 || nvec / vpt == 256 || nvec / vpt == 512)
      continue;  // (whole warps, not a power of two)
    const int tpr = int(nvec / vpt);
    ++shapes;
    SCOPED_TRACE("row1 shape: " + std::to_string(tpr) + " threads x " + std::to_string(vpt) + " vectors");
    fastweight::detail::force_rownorm_fwd_row1_config({tpr, 16, true, false});
    const bool deep_default = vpt <= 2 || tpr <= (vpt == 8 ? 512 : 2048 / vpt);  // taken in the default modes
    check_case(op, dt, n, groups * 9, Layout::padded, Params::io, deep_default ? "row1" : nullptr);
    {
      SCOPED_TRACE("every instance capped");
      const ScopedSwitch<int> capped(&fastweight::detail::set_rownorm_fwd_row1_capped, 2);
      check_case(op, dt, n, groups * 9, Layout::padded, Params::io, "row1");
      if (vpt >= 4) {
        SCOPED_TRACE("x packed against not");
        const ScopedSwitch<int> rawx(&fastweight::detail::set_rownorm_fwd_row1_rawx, 0);
        check_case(op, dt, n, groups * 9, Layout::padded, Params::io, "row1",
                   [] { fastweight::detail::set_rownorm_fwd_row1_rawx(2); });
      }
    }
  }
  EXPECT_GT(shapes, 0) << "no whole-warp shape at n = " << n;
}
INSTANTIATE_TEST_SUITE_P(Row1, NormCudaRow1Tight,
                         ::testing::Combine(kOps, ::testing::Values(DType::f16, DType::bf16),
                                            ::testing::Values<std::int64_t>(3072, 5120, 6144, 7168, 12288, 24576,
                                                                            28672)),
                         rows_case_name);

// The planner's whole-warp shapes (set_rownorm_fwd_row1_tight, on by default; also checked off): threads rounded
// up to a multiple of 32, so the last warp's lanes hold a part of a row's vectors (N 1544: 2 x 97 -> 128; 4104:
// 4 x 129 -> 160; 10000: 8 x 157 -> 160; 20000: 8 x 313 -> 320); on Hopper with raw parameters the 4- and
// 8-vector rules (x packed); fp32 parameters and the rows above 4 per SM of 1537..1792 vectors (8 x 224) too.
struct NormCudaRow1TightPlanned : ::testing::TestWithParam<BulkParam> {};
TEST_P(NormCudaRow1TightPlanned, PartialWarpShapesMatchReference) {
  FW_REQUIRE_GPU();
  const auto [op, dt, n] = GetParam();
  const std::int64_t groups = param_groups(op);
  const ScopedSwitch<bool> tight(&fastweight::detail::set_rownorm_fwd_row1_tight, true);
  const bool hopper = fastweight::detail::cc_major() >= 9;
  const std::int64_t nvec = n / 8;
  // row1 is planned here for every N on Hopper with these few rows (elsewhere: where the 1- and 2-vector rules say)
  check_case(op, dt, n, groups * 9, Layout::padded, Params::io, hopper ? "row1" : nullptr);
  check_case(op, dt, n, groups * 5, Layout::contiguous, Params::f32);  // fp32 parameters: not raw
  {  // switched off: the power-of-two shapes (and the bulk kernel for the 4- and 8-vector rows)
    const ScopedSwitch<bool> off(&fastweight::detail::set_rownorm_fwd_row1_tight, false);
    check_case(op, dt, n, groups * 9, Layout::padded, Params::io);
  }
  if (nvec > 1536 && nvec <= 1792) {  // more than 4 rows per SM: 8 x 224 (fewer: 4 x 416..448)
    const std::int64_t sms = fastweight::detail::sm_count();
    check_case(op, dt, n, groups * (4 * sms / groups + 3), Layout::padded, Params::io, hopper ? "row1" : nullptr);
  }
}
INSTANTIATE_TEST_SUITE_P(Row1, NormCudaRow1TightPlanned,
                         ::testing::Combine(kOps, ::testing::Values(DType::f16, DType::bf16),
                                            ::testing::Values<std::int64_t>(1544, 2600, 4104, 5000, 8200, 10000, 13000,
                                                                            16392, 20000, 28672)),
                         rows_case_name);

// fp32 parameters as vectors in the one-row kernel (set_rownorm_fwd_row1_f32par, the kernel's F32P): every planner
// rule that takes raw parameters, at these few rows (1 x 128, 2 x 128 / 192, 4 x 128 / 160 / 224 / 256 capped / 416
// / 512 capped, 8 x 160 / 320 / 512 x packed), 8 x 256 x packed past 2 rows per SM, 4 x 128 capped (mode 2).
struct NormCudaRow1F32Par : ::testing::TestWithParam<BulkParam> {};
TEST_P(NormCudaRow1F32Par, Fp32ParameterVectorsMatchReference) {
  FW_REQUIRE_GPU();
  const auto [op, dt, n] = GetParam();
  const std::int64_t groups = param_groups(op);
  const ScopedSwitch<bool> f32par(&fastweight::detail::set_rownorm_fwd_row1_f32par, true);
  const char* row1 = fastweight::detail::cc_major() >= 9 ? "row1" : nullptr;
  check_case(op, dt, n, groups * 9, Layout::padded, Params::f32, row1);
  check_case(op, dt, n, groups * 5, Layout::contiguous, Params::f32, row1);
  if (n == 4096) {  // 4 x 128 capped (mode 2)
    const ScopedSwitch<int> capped(&fastweight::detail::set_rownorm_fwd_row1_capped, 2);
    check_case(op, dt, n, groups * 9, Layout::padded, Params::f32, row1);
  }
  if (n == 16384) {  // more than 2 rows per SM: 8 x 256 x packed
    const std::int64_t sms = fastweight::detail::sm_count();
    check_case(op, dt, n, groups * (2 * sms / groups + 3), Layout::padded, Params::f32, row1);
  }
}
INSTANTIATE_TEST_SUITE_P(Row1, NormCudaRow1F32Par,
                         ::testing::Combine(kOps, ::testing::Values(DType::f16, DType::bf16),
                                            ::testing::Values<std::int64_t>(1000, 2048, 3072, 4096, 5000, 7168, 8192,
                                                                            10000, 13000, 16384, 20000, 32768)),
                         rows_case_name);

// The smallest power of two >= v (the planner's thread counts per row group, as the backward tests predict them).
std::int64_t pow2(std::int64_t v) {
  std::int64_t t = 1;
  while (t < v) t *= 2;
  return t;
}

// The backward's last kernel without the rings' RMSNorm tag "_rms" (on by default for RMSNorm rows; the shape
// tests below name the ring's shape, NormCudaBwdRingRms checks the tag).
std::string bwd_kernel_shape() {
  std::string s = fastweight::detail::rownorm_bwd_last_kernel();
  if (s.size() > 4 && s.compare(s.size() - 4, 4, "_rms") == 0) s.resize(s.size() - 4);
  return s;
}

// The backward's ring kernel at 3 vectors per thread (set_rownorm_bwd_ring3): taken where 3 vectors fill more of a
// row group's threads than 4 (bf16 N 1536, 3072, 5120, 6144, 10240, 12288; fp32 1536 .. 6144), the 4-vector ring
// elsewhere (8192; fp32 past 8192 has no ring); padded rows and contiguous ones with fp32 parameters; where it is
// taken, the 4-vector ring with the switch off too.
struct NormCudaBwdRing3 : ::testing::TestWithParam<BulkParam> {};
TEST_P(NormCudaBwdRing3, ThreeVectorRingMatchesReference) {
  FW_REQUIRE_GPU();
  const auto [op, dt, n] = GetParam();
  const std::int64_t groups = param_groups(op);
  const ScopedSwitch<bool> ring3(&fastweight::detail::set_rownorm_bwd_ring3, true);
  const ScopedSwitch<int> one_cta(&fastweight::detail::set_rownorm_bwd_cluster_mult, 1);  // (the ring, not in clusters)
  // (power-of-two row groups, 2 slots: NormCudaBwdRingTight covers the other shapes)
  const ScopedSwitch<int> pow2_groups(&fastweight::detail::set_rownorm_bwd_ring_tight, 0);
  const ScopedSwitch<int> two_slots(&fastweight::detail::set_rownorm_bwd_ring_stages, 2);
  const std::int64_t e = dt == DType::f32 ? 4 : 8, nvec = n / e;
  const std::int64_t tpr4 = pow2((nvec + 3) / 4), tpr3 = pow2((nvec + 2) / 3);
  const bool ring = tpr4 >= 64 && n <= 512 * 4 * e, expect3 = ring && tpr3 <= 512 && 3 * tpr3 < 4 * tpr4;
  for (const auto& [layout, params, rows] : {std::tuple{Layout::padded, Params::io, groups * 37},
                                             std::tuple{Layout::contiguous, Params::f32, groups * 5}}) {
    check_case(op, dt, n, rows, layout, params);
    const std::string ran = bwd_kernel_shape();
    if (!ring) EXPECT_NE(ran, "ring3");              // (fp32 past 8192: no ring)
    else if (fastweight::detail::cc_major() >= 9)    // (sm_80's shared memory may not hold the fp32 ring)
      EXPECT_EQ(ran, expect3 ? "ring3" : "ring");
  }
  if (expect3) {  // the 4-vector ring these rows took before (the switch off)
    const ScopedSwitch<bool> four(&fastweight::detail::set_rownorm_bwd_ring3, false);
    check_case(op, dt, n, groups * 37, Layout::padded, Params::io);
    if (fastweight::detail::cc_major() >= 9) EXPECT_EQ(bwd_kernel_shape(), "ring");
  }
}
INSTANTIATE_TEST_SUITE_P(Ring3, NormCudaBwdRing3,
                         ::testing::Combine(kOps, kDtypes,
                                            ::testing::Values<std::int64_t>(1536, 3072, 5120, 6144, 8192, 10240,
                                                                            12288)),
                         rows_case_name);

// The plain ring's whole-warp row groups (set_rownorm_bwd_ring_tight, modes 0..2) and 3 row slots per group
// (set_rownorm_bwd_ring_stages), forced and by the rule (the defaults: mode 2, the rule): taken where the planner's
// rules say (rederived here: groups of a multiple of 32 threads where a CTA then holds more of them, bf16 N
// 2056..3072 and 4104..5120, mode 2 also 7168, 9216, 10240, 13312; 3 slots where the shared memory fits, by the rule
// at one group per CTA), CTAs of fewer than 512 threads (5 x 96, 3 x 160, 2 x 224, 288 ...), padded rows and
// contiguous ones with fp32 parameters, and about 3 waves of row groups (each ring's slots reused many times).
struct NormCudaBwdRingTight : ::testing::TestWithParam<BulkParam> {};
TEST_P(NormCudaBwdRingTight, WholeWarpGroupsAndThreeStagesMatchReference) {
  FW_REQUIRE_GPU();
  const auto [op, dt, n] = GetParam();
  const std::int64_t groups = param_groups(op);
  const ScopedSwitch<bool> ring3(&fastweight::detail::set_rownorm_bwd_ring3, true);
  const ScopedSwitch<int> one_cta(&fastweight::detail::set_rownorm_bwd_cluster_mult, 1);  // (the plain ring)
  const std::int64_t e = dt == DType::f32 ? 4 : 8, nvec = n / e;
  const std::int64_t tpr4 = pow2((nvec + 3) / 4), tpr3 = pow2((nvec + 2) / 3);
  const bool ring = tpr4 >= 64 && n <= 512 * 4 * e, three = tpr3 <= 512 && 3 * tpr3 < 4 * tpr4;
  const bool hopper = fastweight::detail::cc_major() >= 9;
  for (const auto& [tight, stages] : {std::pair{0, 2}, std::pair{1, 2}, std::pair{0, 3}, std::pair{1, 3},
                                      std::pair{0, 0}, std::pair{1, 0}, std::pair{2, 0}, std::pair{2, 2}}) {
    SCOPED_TRACE("tight mode " + std::to_string(tight) + ", stages " + std::to_string(stages));
    const ScopedSwitch<int> t_sw(&fastweight::detail::set_rownorm_bwd_ring_tight, tight);
    const ScopedSwitch<int> s_sw(&fastweight::detail::set_rownorm_bwd_ring_stages, stages);
    // the expected shape (vectors, threads per group, groups per CTA): of the whole-warp candidates the mode admits
    // (more groups than the power-of-two shape; mode 2 also as many with fewer idle slots, or as many idle and more
    // threads), the most groups, then the fewest idle slots, then the most threads
    const std::int64_t v0 = three ? 3 : 4, t0 = three ? tpr3 : tpr4, r0 = 512 / t0, idle0 = t0 * v0 - nvec;
    std::int64_t v = v0, t = t0, r = r0;
    bool is_tight = false;
    std::tuple<std::int64_t, std::int64_t, std::int64_t> best{-1, 0, 0};  // (groups, -idle, threads)
    for (const std::int64_t cv : {3, 4}) {
      const std::int64_t ct = (nvec + 32 * cv - 1) / (32 * cv) * 32, cr = 512 / ct, idle = ct * cv - nvec;
      const bool admitted = tight >= 1 && ct >= 64 && ct <= 512 &&
                            (cr > r0 || (tight == 2 && cr == r0 && (idle < idle0 || (idle == idle0 && ct > t0))));
      if (admitted && std::tuple{cr, -idle, ct} > best) best = {cr, -idle, ct}, is_tight = true, v = cv, t = ct, r = cr;
    }
    const std::size_t smem3 = std::size_t(3 * 512 * (2 * v * 16 + 8) + (n + e - 1) / e * e * 4 + 2 * 16 * 8);
    // (the rule's exception: the RMSNorm instance's 512-thread group keeps 2 slots)
    const bool rule3 = r == 1 && !(op == Op::rmsnorm && t == 512);
    const bool s3 = (stages == 3 || (stages == 0 && rule3)) && smem3 <= fastweight::detail::smem_per_block_optin();
    const std::string expect = std::string(v == 3 ? "ring3" : "ring") + (is_tight ? "_tight" : "") + (s3 ? "_s3" : "");
    const std::int64_t many = groups * ((3 * fastweight::detail::sm_count() * r + groups - 1) / groups);
    for (const auto& [layout, params, rows] : {std::tuple{Layout::padded, Params::io, groups * 37},
                                               std::tuple{Layout::contiguous, Params::f32, groups * 5},
                                               std::tuple{Layout::padded, Params::io, many}}) {
      check_case(op, dt, n, rows, layout, params);
      const std::string ran = bwd_kernel_shape();
      if (ring && hopper) EXPECT_EQ(ran, expect) << n;
      else if (!ring) EXPECT_TRUE(ran.find("_tight") == std::string::npos && ran.find("_s3") == std::string::npos) << ran;
    }
  }
}
INSTANTIATE_TEST_SUITE_P(Ring, NormCudaBwdRingTight,
                         ::testing::Combine(kOps, kDtypes,
                                            ::testing::Values<std::int64_t>(2048, 2560, 3072, 4104, 4608, 5120, 5128,
                                                                            6144, 7168, 8192, 9216, 10240, 12288,
                                                                            13312, 16384)),
                         rows_case_name);

// The rings' RMSNorm instances (set_rownorm_bwd_ring_rms: no mean, no row sum of g, no bias partials at compile
// time), plain (whole-warp groups, 3 slots by the rule) and in clusters: the same bits as the generic instance (the
// second run of each case with the switch off), with and without a weight, few rows and about 3 waves of row groups;
// LayerNorm rows keep the generic instance.
struct NormCudaBwdRingRms : ::testing::TestWithParam<BulkParam> {};
TEST_P(NormCudaBwdRingRms, RmsInstanceGivesTheGenericBits) {
  FW_REQUIRE_GPU();
  const auto [op, dt, n] = GetParam();
  const std::int64_t groups = param_groups(op), many = groups * 3 * fastweight::detail::sm_count() * 4;
  const ScopedSwitch<bool> rms(&fastweight::detail::set_rownorm_bwd_ring_rms, true);
  const bool hopper = fastweight::detail::cc_major() >= 9;
  for (const std::int64_t rows : {groups * 37, many}) {
    if (rows == many && n > 16384) continue;  // (the float64 reference's time: few rows past the plain ring)
    check_case(op, dt, n, rows, Layout::padded, Params::io, nullptr,
               [] { fastweight::detail::set_rownorm_bwd_ring_rms(false); });  // (o2: the generic instance)
    fastweight::detail::set_rownorm_bwd_ring_rms(true);
    for (const Params params : {Params::io, Params::none}) {
      check_case(op, dt, n, rows, Layout::contiguous, params);
      const std::string ran = fastweight::detail::rownorm_bwd_last_kernel();
      const bool ring = ran.rfind("ring", 0) == 0, tagged = ran.size() > 4 && ran.compare(ran.size() - 4, 4, "_rms") == 0;
      if (op != Op::rmsnorm) EXPECT_FALSE(tagged) << ran;
      else if (ring) EXPECT_TRUE(tagged) << ran;
      // (every N here takes a ring on Hopper: the plain one, or clusters past its reach)
      if (hopper) EXPECT_TRUE(ring) << n << " " << ran;
    }
  }
}
INSTANTIATE_TEST_SUITE_P(Ring, NormCudaBwdRingRms,
                         ::testing::Combine(::testing::Values(Op::rmsnorm, Op::layernorm), kDtypes,
                                            ::testing::Values<std::int64_t>(1536, 2048, 5120, 9216, 12288, 16384, 24576,
                                                                            65536)),
                         rows_case_name);

// The general backward, rowsum + coltile (force_rownorm_bwd_general), on rows of every kind: the path of rows the
// ring and cached kernels cannot index with RowIndexer::offset_lean (merged leading dims with 2^31 rows or more,
// too many to test) and of rows past the ring clusters' reach. It must have run: contiguous, padded (unaligned
// where N is odd) and gapped rows (RowIndexer nd 2 for head norm and adaLN), from N = 1 up.
struct NormCudaBwdGeneral : ::testing::TestWithParam<BulkParam> {};
TEST_P(NormCudaBwdGeneral, RowsumColtileMatchesReference) {
  FW_REQUIRE_GPU();
  const auto [op, dt, n] = GetParam();
  const std::int64_t groups = param_groups(op);
  const ScopedSwitch<bool> general(&fastweight::detail::force_rownorm_bwd_general, true);
  for (const auto& [layout, params, rows] : {std::tuple{Layout::contiguous, Params::io, groups * 37},
                                             std::tuple{Layout::padded, Params::f32, groups * 5},
                                             std::tuple{Layout::gapped, Params::io, groups * 12}}) {
    check_case(op, dt, n, rows, layout, params);
    EXPECT_EQ(bwd_kernel_shape(), "rowsum_coltile") << n;
  }
}
INSTANTIATE_TEST_SUITE_P(General, NormCudaBwdGeneral,
                         ::testing::Combine(kOps, kDtypes, ::testing::Values<std::int64_t>(1, 7, 1000, 4097, 16384, 40000)),
                         rows_case_name);

// The plain ring's scale in registers (set_rownorm_bwd_ring_sreg) and the row statistics copied once per warp or row
// group (set_rownorm_bwd_ring_wstat: the rings and the cached kernel), the first alone and both: the same bits as
// both off (the second run of each case), over the cached kernel's aligned shapes (row groups of 8, 32 and 64
// threads), the ring's (2 and 3 row slots, 3 and 4 vectors, whole-warp groups, several row groups per CTA), the
// cluster ring past its reach, and about 3 waves of row groups. The scale registers are taken only by the plain ring
// and only where the fp32 scale is exactly the IO dtype: fp32 rows, no weight, a weight of the IO dtype without an
// offset (not head norm's weight_offset 1, not fp32 weights of 16-bit rows).
struct NormCudaBwdRingSreg : ::testing::TestWithParam<BulkParam> {};
TEST_P(NormCudaBwdRingSreg, ScaleRegistersAndWarpStatisticsGiveTheSameBits) {
  FW_REQUIRE_GPU();
  const auto [op, dt, n] = GetParam();
  const std::int64_t groups = param_groups(op), many = groups * 3 * fastweight::detail::sm_count() * 4;
  const bool hopper = fastweight::detail::cc_major() >= 9;
  const std::int64_t e = dt == DType::f32 ? 4 : 8, nvec = n / e;
  // the kernel the planner takes (one CTA per row group below the ring's reach: no cluster ring there)
  const std::string want = pow2((nvec + 3) / 4) < 64 ? "cached" : nvec <= 512 * 4 ? "plain" : hopper ? "cluster" : "rowsum_coltile";
  const ScopedSwitch<int> one_cta(&fastweight::detail::set_rownorm_bwd_cluster_mult, 1);
  std::string ran;  // the first run's kernel and its scale registers, read before the second run turns both off
  bool ran_sreg = false;
  auto both_off = [&] {
    ran = fastweight::detail::rownorm_bwd_last_kernel();
    ran_sreg = fastweight::detail::rownorm_bwd_last_sreg();
    fastweight::detail::set_rownorm_bwd_ring_sreg(0);
    fastweight::detail::set_rownorm_bwd_ring_wstat(false);
  };
  const ScopedSwitch<int> sreg(&fastweight::detail::set_rownorm_bwd_ring_sreg, 0);
  const ScopedSwitch<bool> wstat(&fastweight::detail::set_rownorm_bwd_ring_wstat, false);
  // (the statistics switch alone: in both on, and against the default where it is on)
  for (const auto& [s_on, w_on] : {std::pair{true, false}, std::pair{true, true}}) {
    for (const auto& [layout, params, rows] : {std::tuple{Layout::padded, Params::io, groups * 37},
                                               std::tuple{Layout::contiguous, Params::io, many},
                                               std::tuple{Layout::contiguous, Params::none, groups * 37},
                                               std::tuple{Layout::padded, Params::f32, groups * 37}}) {
      if (rows == many && n > 16384) continue;  // (the float64 reference's time)
      fastweight::detail::set_rownorm_bwd_ring_sreg(s_on ? 2 : 0);  // (mode 2: wherever exact)
      fastweight::detail::set_rownorm_bwd_ring_wstat(w_on);
      check_case(op, dt, n, rows, layout, params, nullptr, both_off);
      const bool has_w = params != Params::none || op == Op::adalayernorm;  // (adaLN's scale: always given)
      const bool exact = dt == DType::f32 || !has_w || (params != Params::f32 && op != Op::headnorm);
      const bool is_ring = ran.rfind("ring", 0) == 0, cluster = ran.find("cluster") != std::string::npos;
      EXPECT_EQ(want == "plain" ? is_ring && !cluster : want == "cluster" ? is_ring && cluster : ran == want, true)
          << n << " " << ran << " (expected " << want << ")";
      EXPECT_EQ(ran_sreg, s_on && exact && is_ring && !cluster) << n << " " << ran << " params " << int(params);
    }
  }
}
INSTANTIATE_TEST_SUITE_P(Ring, NormCudaBwdRingSreg,
                         ::testing::Combine(kOps, kDtypes,
                                            ::testing::Values<std::int64_t>(64, 256, 1024, 2048, 5120, 8192, 9216,
                                                                            12288, 16384, 24576)),
                         rows_case_name);

// The plain ring fed by a producer warp (set_rownorm_bwd_ring_prod: full / empty mbarriers per row slot, bulk copies
// of x and dy): against the float64 reference and bitwise the same over two runs, where it applies (Hopper, whole-warp
// row groups within 480 consumer threads: 16-bit N <= 15360, fp32 <= 7680), with one and two rows per row group (most
// groups hold only rows past J, whose slots are never copied), 37 rows and about 3 waves of row groups; padded rows
// and fp32 / absent weights. Its row groups differ from the default ring's, so its bits do too.
struct NormCudaBwdRingProd : ::testing::TestWithParam<BulkParam> {};
TEST_P(NormCudaBwdRingProd, ProducerWarpRingMatchesReference) {
  FW_REQUIRE_GPU();
  const auto [op, dt, n] = GetParam();
  const std::int64_t groups = param_groups(op), many = groups * 3 * fastweight::detail::sm_count() * 4;
  const std::int64_t e = dt == DType::f32 ? 4 : 8, nvec = n / e;
  const bool expect = fastweight::detail::cc_major() >= 9 && nvec <= 480 * 4;
  const ScopedSwitch<int> prod(&fastweight::detail::set_rownorm_bwd_ring_prod, 1);
  const ScopedSwitch<int> one_cta(&fastweight::detail::set_rownorm_bwd_cluster_mult, 1);  // (the plain ring)
  for (const auto& [layout, params, rows] : {std::tuple{Layout::padded, Params::io, groups * 1},
                                             std::tuple{Layout::contiguous, Params::io, groups * 2},
                                             std::tuple{Layout::padded, Params::io, groups * 37},
                                             std::tuple{Layout::contiguous, Params::f32, groups * 37},
                                             std::tuple{Layout::contiguous, Params::none, many}}) {
    check_case(op, dt, n, rows, layout, params);
    EXPECT_EQ(fastweight::detail::rownorm_bwd_last_prod(), expect)
        << n << " rows " << rows << " " << fastweight::detail::rownorm_bwd_last_kernel();
  }
}
INSTANTIATE_TEST_SUITE_P(Ring, NormCudaBwdRingProd,
                         ::testing::Combine(kOps, kDtypes,
                                            ::testing::Values<std::int64_t>(2048, 4096, 5120, 8192, 9216, 12288,
                                                                            16384)),
                         rows_case_name);

// Aligned rows past the ring kernel's reach (bf16 / fp16 N > 16384, fp32 N > 8192): the ring kernel in clusters of
// C = ceil(N / reach) CTAs on Hopper (set_rownorm_bwd_cluster), C 2..8, 3 vectors per thread at N 24576 (bf16), ranks
// whose last one holds fewer columns (20000, 40000), about 4 rows per cluster (the exchange slots' parities and
// mbarrier phases turn over), padded rows and contiguous ones with fp32 parameters; rows just past 8 ranks (fp32
// 98312: 13, bf16 131080: 9) keep rowsum + coltile (cbcfb7d clamped C to 8 there: ranks past 512 threads, a division
// by zero in the planner); then the same with the switch off (rowsum + coltile).
struct NormCudaBwdCluster : ::testing::TestWithParam<BulkParam> {};
TEST_P(NormCudaBwdCluster, ClusterRingMatchesReference) {
  FW_REQUIRE_GPU();
  const auto [op, dt, n] = GetParam();
  const std::int64_t groups = param_groups(op);
  const std::int64_t e = dt == DType::f32 ? 4 : 8, nvec = n / e, reach = 512 * 4;
  const std::int64_t C = (nvec + reach - 1) / reach, per = (nvec + C - 1) / C;
  const bool three = 3 * pow2((per + 2) / 3) < 4 * pow2((per + 3) / 4) && pow2((per + 2) / 3) <= 512;
  const std::int64_t rows = std::max(groups * 5, ((std::int64_t(1) << 23) / n + groups - 1) / groups * groups);
  const ScopedSwitch<int> mult(&fastweight::detail::set_rownorm_bwd_cluster_mult, 1);  // (NormCudaBwdClusterMult: m > 1)
  for (const bool on : {true, false}) {
    const ScopedSwitch<bool> cluster(&fastweight::detail::set_rownorm_bwd_cluster, on);
    for (const auto& [layout, params] : {std::pair{Layout::padded, Params::io}, std::pair{Layout::contiguous, Params::f32}}) {
      if (!on && params == Params::f32) continue;  // (the long-row path has its own cases above)
      check_case(op, dt, n, rows, layout, params);
      const std::string ran = bwd_kernel_shape();
      if (C == 1) EXPECT_EQ(ran.find("cluster"), std::string::npos) << n;  // (within the ring's reach)
      else if (on && C <= 8 && fastweight::detail::cc_major() >= 9) EXPECT_EQ(ran, three ? "ring3_cluster" : "ring_cluster") << n;
      else EXPECT_EQ(ran, "rowsum_coltile") << n;
    }
  }
}
INSTANTIATE_TEST_SUITE_P(Cluster, NormCudaBwdCluster,
                         ::testing::Combine(kOps, kDtypes,
                                            ::testing::Values<std::int64_t>(8200, 16392, 20000, 24576, 32768, 40000,
                                                                            65536, 98312, 131072, 131080)),
                         rows_case_name);

// The cluster ring with m times its CTAs per cluster (set_rownorm_bwd_cluster_mult), rows within the ring's reach
// too: several row groups per CTA in a cluster (R = 512 / tpr > 1, which the default's split never gives), C 2..8,
// 3 vectors per thread where they fit better (N 6144 bf16), padded rows and contiguous ones with fp32 parameters,
// 2 or more rows per row group (both exchange slots; the phases turn over in NormCudaBwdCluster).
struct NormCudaBwdClusterMult : ::testing::TestWithParam<BulkParam> {};
TEST_P(NormCudaBwdClusterMult, WiderClustersMatchReference) {
  FW_REQUIRE_GPU();
  const auto [op, dt, n] = GetParam();
  const std::int64_t groups = param_groups(op);
  const std::int64_t e = dt == DType::f32 ? 4 : 8, nvec = n / e, reach = 512 * 4;
  const std::int64_t rows = std::max(groups * 5, ((std::int64_t(1) << 22) / n + groups - 1) / groups * groups);
  for (const int mode : {2, 4, 0}) {
    const ScopedSwitch<int> mult(&fastweight::detail::set_rownorm_bwd_cluster_mult, mode);
    // mode 0, the planner's rule: m = 2 up to 8 rows per SM on rows past 512 vectors (all these rows are few), else 1
    const std::int64_t m = mode > 0 ? mode : rows <= 8 * std::int64_t(fastweight::detail::sm_count()) && nvec > 512 ? 2 : 1;
    const std::int64_t C = std::min<std::int64_t>(8, (nvec + reach - 1) / reach * m), per = (nvec + C - 1) / C;
    const std::int64_t t4 = pow2((per + 3) / 4), t3 = pow2((per + 2) / 3);
    const bool three = 3 * t3 < 4 * t4 && t3 <= 512;
    // (every N here is within the plain ring's limits, or past its reach; the rank's row groups need 64 threads)
    const bool taken = fastweight::detail::cc_major() >= 9 && C >= 2 && (three ? t3 : t4) >= 64;
    for (const auto& [layout, params] : {std::pair{Layout::padded, Params::io}, std::pair{Layout::contiguous, Params::f32}}) {
      check_case(op, dt, n, rows, layout, params);
      const std::string ran = bwd_kernel_shape();
      if (taken) EXPECT_EQ(ran, three ? "ring3_cluster" : "ring_cluster") << n << " m " << m;
      else if (C < 2) EXPECT_EQ(ran.find("cluster"), std::string::npos) << n << " m " << m;  // (the rule's m = 1)
    }
  }
}
INSTANTIATE_TEST_SUITE_P(Cluster, NormCudaBwdClusterMult,
                         ::testing::Combine(kOps, kDtypes,
                                            ::testing::Values<std::int64_t>(4096, 6144, 16384, 24576, 32768, 65536)),
                         rows_case_name);

// Rows past the one-row kernel's reach (4096 vectors: N > 32768 16-bit, N > 16384 fp32, the latter with
// set_rownorm_fwd_cluster_f32): that kernel in clusters of C CTAs per row on Hopper (set_rownorm_fwd_cluster; mode 1
// C = ceil(N / 4096 vectors), mode 2 ceil(N / 2048 vectors) <= 8), ranks whose last one holds fewer columns (32776
// bf16: 2049 + 2048 vectors, 98312: 3 x 3073 + 3070; fp32 20000: 3 ranks of 1667, 1667, 1666), C 2..8, padded rows
// with IO-dtype parameters, contiguous ones with fp32 parameters and without parameters; rows past 8 CTAs and
// unaligned rows keep the streaming kernel, as do all of them with the switch off (and fp32 rows with its own off).
struct NormCudaFwdCluster : ::testing::TestWithParam<BulkParam> {};
TEST_P(NormCudaFwdCluster, ClusterRowMatchesReference) {
  FW_REQUIRE_GPU();
  const auto [op, dt, n] = GetParam();
  const std::int64_t groups = param_groups(op);
  const std::int64_t e = dt == DType::f32 ? 4 : 8, nvec = n / e;
  const std::int64_t rows = std::max(groups * 3, ((std::int64_t(1) << 21) / n + groups - 1) / groups * groups);
  const ScopedSwitch<bool> f32(&fastweight::detail::set_rownorm_fwd_cluster_f32, true);
  ASSERT_GT(nvec, 4096) << "a row within one CTA's reach";
  for (const int mode : {1, 2, 0}) {
    const ScopedSwitch<int> cluster(&fastweight::detail::set_rownorm_fwd_cluster, mode);
    const std::int64_t C = mode == 0 ? 0
                           : mode == 2 && (nvec + 2047) / 2048 <= 8 ? (nvec + 2047) / 2048
                                                                    : (nvec + 4095) / 4096;
    const bool taken = mode > 0 && n % e == 0 && C >= 2 && C <= 8 && fastweight::detail::cc_major() >= 9;
    const char* expect = taken ? "row1_cluster" : "stream";
    for (const auto& [layout, params] : {std::pair{Layout::padded, Params::io}, std::pair{Layout::contiguous, Params::f32},
                                         std::pair{Layout::contiguous, Params::none}}) {
      if (mode == 0 && params != Params::io) continue;  // (the streaming kernel has its own cases)
      check_case(op, dt, n, rows, layout, params, expect);
    }
  }
  if (dt == DType::f32) {  // fp32 rows with their switch off: the streaming kernel
    const ScopedSwitch<bool> f32_off(&fastweight::detail::set_rownorm_fwd_cluster_f32, false);
    check_case(op, dt, n, rows, Layout::padded, Params::io, "stream");
  }
}
INSTANTIATE_TEST_SUITE_P(Cluster, NormCudaFwdCluster,
                         ::testing::Combine(kOps, ::testing::Values(DType::f16, DType::bf16),
                                            ::testing::Values<std::int64_t>(32776, 40000, 40001, 65536, 98312, 131072,
                                                                            262144, 262152)),
                         rows_case_name);
INSTANTIATE_TEST_SUITE_P(ClusterF32, NormCudaFwdCluster,
                         ::testing::Combine(kOps, ::testing::Values(DType::f32),
                                            ::testing::Values<std::int64_t>(16388, 20000, 20001, 32768, 65536, 98312,
                                                                            131072, 131076)),
                         rows_case_name);

// Rows whose leading dims do not merge into one stride (Layout::gapped: head norm (rows / NH, NH, N),
// adaLN (B, S, N) with a gap row after each run of NH / S rows): the general row indexing of every
// forward (one-row-per-CTA, bulk, persistent / streaming) and backward (cached, ring, long-row) kernel.
INSTANTIATE_TEST_SUITE_P(Gapped, NormCuda,
                         ::testing::Combine(::testing::Values(Op::headnorm, Op::adalayernorm), kDtypes,
                                            ::testing::Values<std::int64_t>(520, 2048, 8192, 20000),
                                            ::testing::Values(Layout::gapped), ::testing::Values(Params::io)),
                         case_name);

// The same kind of rows with the bulk forward switched off: the persistent and short-row kernels,
// the path of devices without bulk copies (sm_80), which Hopper otherwise never takes for them.
TEST(NormCudaBulkOff, PersistentPathMatchesReference) {
  FW_REQUIRE_GPU();
  struct Restore {
    bool prev;
    ~Restore() { fastweight::detail::set_rownorm_fwd_bulk(prev); }
  } restore{fastweight::detail::set_rownorm_fwd_bulk(false)};
  check_case(Op::layernorm, DType::bf16, 8192, 800, Layout::padded, Params::io);
  check_case(Op::rmsnorm, DType::f32, 1000, 3000, Layout::padded, Params::io);
  check_case(Op::headnorm, DType::f16, 128, 4096, Layout::padded, Params::io);
  check_case(Op::adalayernorm, DType::bf16, 16384, 64, Layout::contiguous, Params::f32);
}

// sm_80 opts in to 166912 bytes of shared memory per block: with that cap the backward's ring kernel
// (203 KB at bf16 N = 16384, 171 KB at fp32 N = 8192) gives way to the general path, as on an A100.
TEST(NormCudaSmemCap, Sm80SharedMemoryPathsMatchReference) {
  FW_REQUIRE_GPU();
  struct Restore {
    std::size_t prev;
    ~Restore() { fastweight::detail::cap_smem_per_block_optin(prev); }
  } restore{fastweight::detail::cap_smem_per_block_optin(166912)};
  check_case(Op::layernorm, DType::bf16, 16384, 64, Layout::contiguous, Params::io);
  check_case(Op::rmsnorm, DType::f32, 8192, 64, Layout::contiguous, Params::f32);
}

TEST(NormCudaEdge, EmptyBatchZeroesWeightGradients) {
  FW_REQUIRE_GPU();
  HostTensor x = make_host(DType::bf16, {0, 64}), w = make_host(DType::bf16, {64});
  HostTensor dw = make_host(DType::bf16, {64}), db = make_host(DType::bf16, {64});
  HostTensor mean = make_host(DType::f32, {0}), rstd = make_host(DType::f32, {0});
  fill_bytes(dw, 0xff);
  fill_bytes(db, 0xff);
  DeviceMirror dx_(x), ddy(x), ddx(x), dw_(w), ddw(dw), ddb(db), dm(mean), dr(rstd);
  const BwdRefs a{ddy.ref(x), dx_.ref(x), dw_.ref(w), dm.ref(mean), dr.ref(rstd), ddx.ref(x), ddw.ref(dw), ddb.ref(db)};
  const std::size_t wsb = bwd_ws(Op::layernorm, a);
  void* ws = nullptr;
  if (wsb) ASSERT_EQ(cudaMalloc(&ws, wsb), cudaSuccess);
  run_bwd(Op::layernorm, a, ws, wsb);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaFree(ws);
  ddw.download(dw);
  ddb.download(db);
  for (int i = 0; i < 64; ++i) { EXPECT_EQ(dw.get(i), 0.0); EXPECT_EQ(db.get(i), 0.0); }
}

TEST(NormCudaEdge, WorkspaceTooSmallIsRejected) {
  FW_REQUIRE_GPU();
  HostTensor x = make_host(DType::f32, {64, 256}), w = make_host(DType::f32, {256}), st = make_host(DType::f32, {64});
  DeviceMirror dx_(x), dw_(w), dm(st), dr(st), ddx(x), ddw(w);
  const BwdRefs a{dx_.ref(x), dx_.ref(x), dw_.ref(w), dm.ref(st), dr.ref(st), ddx.ref(x), ddw.ref(w), {}};
  const std::size_t wsb = bwd_ws(Op::layernorm, a);
  ASSERT_GT(wsb, 0u);
  void* ws = nullptr;
  ASSERT_EQ(cudaMalloc(&ws, wsb), cudaSuccess);
  EXPECT_THROW(run_bwd(Op::layernorm, a, ws, wsb - 1), ArgumentError);
  cudaFree(ws);
}

TEST(NormCudaEdge, Float64IsRejectedOnTheGpu) {
  HostTensor x = make_host(DType::f64, {2, 8});
  TensorRef xr = x.ref(DeviceType::cuda), yr = x.ref(DeviceType::cuda);
  try {
    layernorm_fwd({xr, {}, {}, yr, {}, {}, 1e-5});
    ADD_FAILURE() << "no error";
  } catch (const ArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("float64"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace fwtest
