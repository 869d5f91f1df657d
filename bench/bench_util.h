// bench_util.h: host tensors, error and timing helpers shared by the op benches (bench_*.cpp).
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "common/half.h"
#include "fastweight/fastweight.h"

namespace fwbench {
using namespace fastweight;
using Vec = std::vector<double>;

// A contiguous host tensor of dtype dt holding the rounded values of `ref`.
struct HostBuf {
  DType dt;
  std::vector<std::int64_t> shape;
  std::vector<unsigned char> bytes;
  Vec val;  // the values as stored (after rounding), float64
  HostBuf(DType d, std::vector<std::int64_t> s, std::mt19937_64* rng = nullptr, double lo = -1, double hi = 1)
      : dt(d), shape(std::move(s)) {
    std::int64_t n = 1;
    for (auto e : shape) n *= e;
    bytes.assign(std::size_t(n) * dtype_size(dt), 0);
    val.assign(std::size_t(n), 0.0);
    std::uniform_real_distribution<double> u(lo, hi);
    for (std::int64_t e = 0; e < n; ++e) set(e, rng ? u(*rng) : 0.0);
  }
  void set(std::int64_t e, double x) {
    detail::store_from_double(bytes.data(), e, dt, x);
    val[std::size_t(e)] = get(e);  // the value as stored (rounded to dt)
  }
  double get(std::int64_t e) const { return detail::load_as_double(bytes.data(), e, dt); }
  Vec read() const {
    Vec v(val.size());
    for (std::size_t e = 0; e < v.size(); ++e) v[e] = get(std::int64_t(e));
    return v;
  }
  TensorRef ref() { return make_tensor(bytes.data(), dt, int(shape.size()), shape.data()); }
};

// sum ||a_k - b_k||^2 / sum ||b_k||^2 over pairs
struct Err {
  double num = 0, den = 0;
  void add(const Vec& a, const Vec& b) {
    for (std::size_t e = 0; e < a.size(); ++e) {
      num += std::isfinite(a[e]) ? (a[e] - b[e]) * (a[e] - b[e]) : INFINITY;
      den += b[e] * b[e];
    }
  }
  double value() const { return den > 0 ? std::sqrt(num / den) : std::sqrt(num); }
};

template <typename F>
inline double time_ms(F&& f) {
  std::vector<double> ms;
  for (int r = 0; r < 5; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[2];
}

}  // namespace fwbench
