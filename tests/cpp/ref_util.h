// ref_util.h: float64 helpers of the reference suites (test_mlstm_reference, test_deltanet_reference):
// golden files written by the independent torch scripts of tests/golden, relative errors, random
// vectors, central finite differences.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace fwref {

using Vec = std::vector<double>;

// One tensor of a golden file: a line "name ndim shape... values..." (strtod reads "-inf").
struct Golden {
  std::vector<std::int64_t> shape;
  Vec v;
};

inline std::map<std::string, Golden> load_golden(const std::string& path) {
  std::map<std::string, Golden> m;
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "cannot open " << path;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream is(line);
    std::string name, tok;
    int nd = 0;
    is >> name >> nd;
    Golden g;
    g.shape.resize(nd);
    std::int64_t numel = 1;
    for (auto& s : g.shape) { is >> s; numel *= s; }
    while (is >> tok) g.v.push_back(std::strtod(tok.c_str(), nullptr));
    EXPECT_EQ(std::int64_t(g.v.size()), numel) << name;
    m[name] = std::move(g);
  }
  return m;
}

// ||a - b|| / ||b|| (||a - b|| when b is zero)
inline double rel_err(const Vec& a, const Vec& b) {
  EXPECT_EQ(a.size(), b.size());
  double num = 0.0, den = 0.0;
  for (std::size_t x = 0; x < a.size(); ++x) {
    num += (a[x] - b[x]) * (a[x] - b[x]);
    den += b[x] * b[x];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

inline double dot(const Vec& a, const Vec& b) {
  double s = 0.0;
  for (std::size_t x = 0; x < a.size(); ++x) s += a[x] * b[x];
  return s;
}

inline bool all_finite(const Vec& a) {
  for (double x : a)
    if (!std::isfinite(x)) return false;
  return true;
}

inline Vec randn(std::size_t n, std::mt19937_64& rng, double mean = 0.0, double sd = 1.0) {
  std::normal_distribution<double> d(mean, sd);
  Vec v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// central differences of loss() with respect to every entry of x
template <class F>
Vec central_diff(Vec& x, F&& loss, double h = 1e-6) {
  Vec g(x.size());
  for (std::size_t e = 0; e < x.size(); ++e) {
    const double v = x[e];
    x[e] = v + h;
    const double lp = loss();
    x[e] = v - h;
    const double lm = loss();
    x[e] = v;
    g[e] = (lp - lm) / (2 * h);
  }
  return g;
}

}  // namespace fwref
