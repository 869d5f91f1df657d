// test_norm_validation.cpp: every bad input gets an ArgumentError that names the op and the
// argument, before anything is written (outputs poisoned beforehand must stay bit-identical).
#include "norm_cases.h"

namespace fwtest {
namespace {

struct Bufs {
  HostTensor x, w, b, y, mean, rstd;
  Bufs(DType dt = DType::f32, std::int64_t rows = 4, std::int64_t n = 16)
      : x(make_host(dt, {rows, n})), w(make_host(dt, {n})), b(make_host(dt, {n})), y(make_host(dt, {rows, n})),
        mean(make_host(DType::f32, {rows})), rstd(make_host(DType::f32, {rows})) {
    std::mt19937_64 rng(1);
    fill_random(x, rng);
    fill_random(w, rng);
    fill_random(b, rng);
    fill_bytes(y, 0xab);
    fill_bytes(mean, 0xab);
    fill_bytes(rstd, 0xab);
  }
  LayerNormFwdArgs args() { return {x.ref(), w.ref(), b.ref(), y.ref(), mean.ref(), rstd.ref(), 1e-5, 0.0}; }
  bool untouched() const {
    for (const HostTensor* t : {&y, &mean, &rstd})
      for (unsigned char c : t->bytes) if (c != 0xab) return false;
    return true;
  }
};

// Runs f, expects an ArgumentError whose message holds every fragment, and outputs untouched.
template <typename F>
void expect_rejected(Bufs& bufs, F&& f, std::initializer_list<const char*> fragments) {
  expect_argument_error(f, fragments);
  EXPECT_TRUE(bufs.untouched()) << "an output was written before the error";
}

TEST(NormValidation, WrongWeightShape) {
  Bufs b;
  HostTensor w = make_host(DType::f32, {15});
  auto a = b.args();
  a.weight = w.ref();
  expect_rejected(b, [&] { layernorm_fwd(a); }, {"layernorm_fwd", "weight", "(16)", "(15)"});
}

TEST(NormValidation, WrongOutputShapeAndDtype) {
  Bufs b;
  HostTensor y = make_host(DType::f32, {4, 17});
  auto a = b.args();
  a.y = y.ref();
  expect_rejected(b, [&] { layernorm_fwd(a); }, {"y", "(4, 16)"});
  HostTensor y16 = make_host(DType::f16, {4, 16});
  a = b.args();
  a.y = y16.ref();
  expect_rejected(b, [&] { layernorm_fwd(a); }, {"y", "float16", "float32"});
}

TEST(NormValidation, ParameterDtype) {
  Bufs b(DType::bf16);
  HostTensor w = make_host(DType::f16, {16});
  auto a = b.args();
  a.weight = w.ref();
  expect_rejected(b, [&] { layernorm_fwd(a); }, {"weight", "bfloat16", "float32", "float16"});
}

TEST(NormValidation, NonContiguousLastDim) {
  Bufs b;
  auto a = b.args();
  a.x.strides[1] = 2;
  a.x.shape[1] = 8;
  a.y.shape[1] = 8;
  expect_rejected(b, [&] { layernorm_fwd(a); }, {"x", "contiguous", "stride 2"});
}

TEST(NormValidation, MisalignedPointer) {
  Bufs b(DType::bf16);
  auto a = b.args();
  a.x.data = static_cast<char*>(a.x.data) + 1;
  expect_rejected(b, [&] { layernorm_fwd(a); }, {"x", "misaligned"});
}

TEST(NormValidation, EmptyNormalisedDim) {
  Bufs b(DType::f32, 4, 0);
  auto a = b.args();
  expect_rejected(b, [&] { layernorm_fwd(a); }, {"x", "empty"});
}

TEST(NormValidation, DevicesMustAgree) {
  Bufs b;
  auto a = b.args();
  a.weight.device = DeviceType::cuda;  // validation runs before anything touches a device
  expect_rejected(b, [&] { layernorm_fwd(a); }, {"weight", "cpu", "cuda:0"});
}

TEST(NormValidation, StatisticsMustBeFloat32PerRow) {
  Bufs b;
  HostTensor m = make_host(DType::f32, {3});
  auto a = b.args();
  a.mean = m.ref();
  expect_rejected(b, [&] { layernorm_fwd(a); }, {"mean", "4 elements"});
  HostTensor r = make_host(DType::f64, {4});
  a = b.args();
  a.rstd = r.ref();
  expect_rejected(b, [&] { layernorm_fwd(a); }, {"rstd", "float32"});
}

TEST(NormValidation, NegativeOrNonFiniteEps) {
  Bufs b;
  auto a = b.args();
  a.eps = -1.0;
  expect_rejected(b, [&] { layernorm_fwd(a); }, {"eps"});
  a.eps = INFINITY;
  expect_rejected(b, [&] { layernorm_fwd(a); }, {"eps"});
}

TEST(NormValidation, AdaLayerNormScaleBatchMismatch) {
  Bufs b;
  HostTensor x = make_host(DType::f32, {2, 2, 16}), y = make_host(DType::f32, {2, 2, 16});
  HostTensor sc = make_host(DType::f32, {3, 1, 16}), sh = make_host(DType::f32, {2, 1, 16});
  fill_bytes(y, 0xab);
  std::vector<unsigned char> before = y.bytes;
  try {
    adalayernorm_fwd({x.ref(), sc.ref(), sh.ref(), y.ref(), b.mean.ref(), b.rstd.ref(), 1e-5});
    ADD_FAILURE() << "no error";
  } catch (const ArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("scale"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("(2, 1, 16)"), std::string::npos) << e.what();
  }
  EXPECT_EQ(y.bytes, before);
  EXPECT_TRUE(b.untouched());
  // scale is required
  try {
    adalayernorm_fwd({x.ref(), {}, sh.ref(), y.ref(), {}, {}, 1e-5});
    ADD_FAILURE() << "no error";
  } catch (const ArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("scale: is required"), std::string::npos) << e.what();
  }
}

TEST(NormValidation, HeadNormNeedsHeadsAndPerHeadWeights) {
  Bufs b;
  HostTensor x = make_host(DType::f32, {3, 4, 8}), y = make_host(DType::f32, {3, 4, 8}), w = make_host(DType::f32, {8});
  try {
    headnorm_fwd({x.ref(), w.ref(), {}, y.ref(), {}, {}, 1e-6, 0.0});
    ADD_FAILURE() << "no error";
  } catch (const ArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("weight: expected shape (4, 8)"), std::string::npos) << e.what();
  }
}

TEST(NormValidation, BackwardChecksGradientsAndStats) {
  Bufs b;
  HostTensor dy = make_host(DType::f32, {4, 16}), dx = make_host(DType::f32, {4, 16}), dw = make_host(DType::f32, {15});
  fill_bytes(dx, 0xab);
  const auto before = dx.bytes;
  try {
    layernorm_bwd({dy.ref(), b.x.ref(), b.w.ref(), b.mean.ref(), b.rstd.ref(), dx.ref(), dw.ref(), {}}, nullptr, 0);
    ADD_FAILURE() << "no error";
  } catch (const ArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("layernorm_bwd: dweight"), std::string::npos) << e.what();
  }
  try {
    layernorm_bwd({dy.ref(), b.x.ref(), b.w.ref(), {}, b.rstd.ref(), dx.ref(), {}, {}}, nullptr, 0);
    ADD_FAILURE() << "no error";
  } catch (const ArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("mean: is required"), std::string::npos) << e.what();
  }
  EXPECT_EQ(dx.bytes, before);
}

// Outputs over inputs (y as x itself, mean over the weight, dx over dy half a row on) or over each other
// (rstd as mean): refused before anything is written.
TEST(NormValidation, OutputsMayNotOverlapInputsOrEachOther) {
  Bufs b;
  auto a = b.args();
  HostTensor x = b.x;  // a copy: the poisoned outputs stay untouched
  a.x = x.ref(), a.y = x.ref();
  expect_rejected(b, [&] { layernorm_fwd(a); }, {"layernorm_fwd", "y", "shares memory with x"});
  a = b.args();
  HostTensor w = make_host(DType::f32, {16});
  std::mt19937_64 rng(2);
  fill_random(w, rng);
  TensorRef mean_on_w = w.ref();
  mean_on_w.shape[0] = 4;  // (4) floats, the first of the weight's 16
  a.weight = w.ref(), a.mean = mean_on_w;
  expect_rejected(b, [&] { layernorm_fwd(a); }, {"layernorm_fwd", "mean", "shares memory with weight"});
  a = b.args();
  a.rstd = a.mean;
  expect_rejected(b, [&] { layernorm_fwd(a); }, {"layernorm_fwd", "mean", "shares memory with rstd", "each other"});
  HostTensor dbuf = make_host(DType::f32, {5, 16});
  fill_bytes(dbuf, 0xab);
  TensorRef dy = dbuf.ref(), dx = dbuf.ref();
  dy.shape[0] = dx.shape[0] = 4;
  dx.data = static_cast<float*>(dbuf.base()) + 8;
  const auto before = dbuf.bytes;
  expect_argument_error([&] { layernorm_bwd({dy, b.x.ref(), b.w.ref(), b.mean.ref(), b.rstd.ref(), dx, {}, {}}, nullptr, 0); },
                        {"layernorm_bwd", "dx", "shares memory with dy"});
  EXPECT_EQ(dbuf.bytes, before);
}

TEST(NormValidation, CanImplementReportsWhy) {
  Bufs b;
  auto a = b.args();
  std::string why;
  EXPECT_TRUE(layernorm_fwd_can_implement(a, &why)) << why;
  a.bias.shape[0] = 3;
  EXPECT_FALSE(layernorm_fwd_can_implement(a, &why));
  EXPECT_NE(why.find("bias"), std::string::npos) << why;
}

TEST(NormValidation, RmsNormTakesNoMean) {
  Bufs b;
  HostTensor dy = make_host(DType::f32, {4, 16}), dx = make_host(DType::f32, {4, 16});
  EXPECT_THROW(rmsnorm_bwd({dy.ref(), b.x.ref(), b.w.ref(), {}, dx.ref(), {}}, nullptr, 0), ArgumentError);  // rstd missing
}

}  // namespace
}  // namespace fwtest
