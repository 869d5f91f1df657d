// test_api_checks.cpp: the argument checks shared by every op (src/api/check.h), tested apart from any
// op. overlap() against the element addresses, enumerated: random small views of one buffer.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <set>

#include "api/check.h"
#include "test_util.h"

namespace fwtest {
namespace {
using fastweight::detail::Overlap;

// The bytes every element of t covers.
std::set<std::uintptr_t> bytes_of(const TensorRef& t) {
  std::set<std::uintptr_t> out;
  const std::int64_t n = t.numel(), es = std::int64_t(dtype_size(t.dtype));
  for (std::int64_t e = 0; e < n; ++e) {
    std::int64_t off = 0, rest = e;
    for (int d = t.ndim - 1; d >= 0; --d) off += (rest % t.shape[d]) * t.strides[d], rest /= t.shape[d];
    for (std::int64_t b = 0; b < es; ++b) out.insert(reinterpret_cast<std::uintptr_t>(t.data) + std::uintptr_t(off * es + b));
  }
  return out;
}

TensorRef random_view(std::mt19937_64& rng, unsigned char* buf) {
  TensorRef t;
  t.dtype = rng() % 3 == 0 ? DType::bf16 : DType::f32;
  t.ndim = 1 + int(rng() % 3);
  std::int64_t stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.shape[d] = 1 + std::int64_t(rng() % 4);
    switch (rng() % 4) {  // dense (row-major), padded, repeated (stride 0) or a small odd stride
      case 0: case 1: t.strides[d] = stride; break;
      case 2: t.strides[d] = stride + std::int64_t(rng() % 3); break;
      default: t.strides[d] = std::int64_t(rng() % 3); break;
    }
    stride = std::max<std::int64_t>(stride, t.strides[d] * t.shape[d]);
  }
  if (rng() % 4 == 0 && t.ndim > 1) std::swap(t.shape[0], t.shape[t.ndim - 1]), std::swap(t.strides[0], t.strides[t.ndim - 1]);
  t.data = buf + 4 * (rng() % 24);  // 4-byte aligned for both dtypes
  return t;
}

TEST(ApiChecks, OverlapAgreesWithTheElementAddresses) {
  std::mt19937_64 rng(11);
  alignas(16) static unsigned char buf[1024];
  int seen[4] = {0, 0, 0, 0};
  for (int it = 0; it < 20000; ++it) {
    TensorRef a = random_view(rng, buf), b = rng() % 8 == 0 ? a : random_view(rng, buf);
    const Overlap ov = fastweight::detail::overlap(a, b);
    ++seen[int(ov)];
    const auto x = bytes_of(a), y = bytes_of(b);
    std::vector<std::uintptr_t> both;
    std::set_intersection(x.begin(), x.end(), y.begin(), y.end(), std::back_inserter(both));
    SCOPED_TRACE("iteration " + std::to_string(it) + ": " + a.shape_str() + " and " + b.shape_str());
    if (ov == Overlap::none) ASSERT_TRUE(both.empty());
    if (ov == Overlap::partial) ASSERT_FALSE(both.empty());
    if (ov == Overlap::same) ASSERT_EQ(x, y);
  }
  for (int k = 0; k < 4; ++k) EXPECT_GT(seen[k], 100) << "outcome " << k << " barely exercised";
}

TEST(ApiChecks, OutputsApartNamesBothAndAllowsOnlyThePairedSameView) {
  alignas(16) static float buf[64];
  TensorRef a = make_tensor(buf, DType::f32, {4, 4}), b = make_tensor(buf + 16, DType::f32, {4, 4});
  TensorRef a_shift = make_tensor(buf + 2, DType::f32, {4, 4});
  using fastweight::detail::check_outputs_apart;
  EXPECT_NO_THROW(check_outputs_apart("op", {{"out", b}}, {{"in", a}}));
  EXPECT_NO_THROW(check_outputs_apart("op", {{"new", a}}, {{"old", a}}, {{0, 0}}));
  expect_argument_error([&] { check_outputs_apart("op", {{"out", a}}, {{"in", a}}); }, {"op", "out", "shares memory with in"});
  expect_argument_error([&] { check_outputs_apart("op", {{"new", a_shift}}, {{"old", a}}, {{0, 0}}); },
                        {"op", "new", "old", "same view"});
  expect_argument_error([&] { check_outputs_apart("op", {{"o1", a}, {"o2", a_shift}}, {}); }, {"op", "o1", "o2", "each other"});
  TensorRef absent{};
  EXPECT_NO_THROW(check_outputs_apart("op", {{"out", absent}}, {{"in", a}}));
}

}  // namespace
}  // namespace fwtest
