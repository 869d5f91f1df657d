// test_util.h: buffers of any dtype on the host or the GPU, random fills, relative Frobenius error.
// Shared by the reference, validation and CUDA suites.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "common/half.h"
#include "fastweight/fastweight.h"

#if FW_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace fwtest {
using namespace fastweight;

// Skip (reported as skipped by CTest through SKIP_REGULAR_EXPRESSION) where no GPU is present.
#define FW_REQUIRE_GPU()                                                     \
  do {                                                                       \
    if (!::fastweight::cuda_available()) GTEST_SKIP() << "no CUDA device";   \
  } while (0)

struct HostTensor;
template <typename F>
void for_each_offset_pair(const HostTensor& a, const HostTensor& b, F&& f);

// f.template operator()<D>() with D the runtime dtype as a constant: element loops written once, with the dtype's
// switch (load_as_double, store_from_double) folded out of them (the GPU suites walk tens of millions of elements
// per case on the host, which dominated their run time).
template <typename F>
decltype(auto) visit_dtype(DType t, F&& f) {
  switch (t) {
    case DType::f32: return f.template operator()<DType::f32>();
    case DType::f64: return f.template operator()<DType::f64>();
    case DType::f16: return f.template operator()<DType::f16>();
    case DType::bf16: return f.template operator()<DType::bf16>();
    case DType::i32: return f.template operator()<DType::i32>();
    case DType::i64: return f.template operator()<DType::i64>();
  }
  return f.template operator()<DType::f64>();
}
template <DType D>
inline double load_elem(const unsigned char* base, std::int64_t i) { return detail::load_as_double(base, i, D); }
template <DType D>
inline void store_elem(unsigned char* base, std::int64_t i, double v) { detail::store_from_double(base, i, D, v); }

// A tensor in host memory: `storage` elements of `dtype`, viewed with shape/strides from `offset`.
struct HostTensor {
  DType dtype = DType::f64;
  std::vector<std::int64_t> shape, strides;
  std::int64_t offset = 0;
  std::vector<unsigned char> bytes;

  std::int64_t numel() const {
    std::int64_t n = 1;
    for (auto s : shape) n *= s;
    return n;
  }
  std::size_t esize() const { return dtype_size(dtype); }
  void* base() { return bytes.data() + offset * esize(); }
  const void* base() const { return bytes.data() + offset * esize(); }
  TensorRef ref(DeviceType dev = DeviceType::cpu, void* data = nullptr) {
    TensorRef t;
    t.data = data ? data : base();
    t.dtype = dtype;
    t.ndim = int(shape.size());
    for (int d = 0; d < t.ndim; ++d) { t.shape[d] = shape[d]; t.strides[d] = strides[d]; }
    t.device = dev;
    return t;
  }
  // f(storage offset) for every element of the view, in row-major order of its shape (for_each_offset_pair's
  // walk over this view alone).
  template <typename F>
  void for_each_offset(F&& f) const {
    for_each_offset_pair(*this, *this, [&](std::int64_t o, std::int64_t) { f(o); });
  }
  // Element offsets of the view, in row-major order of its shape.
  std::vector<std::int64_t> offsets() const {
    std::vector<std::int64_t> out;
    out.reserve(std::size_t(numel()));
    for_each_offset([&](std::int64_t o) { out.push_back(o); });
    return out;
  }
  double get(std::int64_t storage_index) const { return detail::load_as_double(bytes.data(), storage_index, dtype); }
  void set(std::int64_t storage_index, double v) { detail::store_from_double(bytes.data(), storage_index, dtype, v); }
  // The view's element bytes in row-major order: bit comparisons of tensors whose buffers differ
  // outside the view (make_host's 8 elements of slack, row padding) compare only what an op writes.
  std::vector<unsigned char> elem_bytes() const;
  std::vector<double> values() const {
    std::vector<double> v;
    v.reserve(std::size_t(numel()));
    visit_dtype(dtype, [&]<DType D>() { for_each_offset([&](std::int64_t o) { v.push_back(load_elem<D>(bytes.data(), o)); }); });
    return v;
  }
};

// f(first offset in a, in b, count, step in a, in b) for every row (the last dim) of two views of the same shape,
// in row-major order, the outer index stepped once per row: the loops below run over whole rows, and the error
// measures compare two views without copying them. A 0-dim view is one row of one element.
template <typename F>
void for_each_row_pair(const HostTensor& a, const HostTensor& b, F&& f) {
  const int nd = int(a.shape.size());
  if (nd == 0) {
    f(a.offset, b.offset, std::int64_t(1), std::int64_t(1), std::int64_t(1));
    return;
  }
  const std::int64_t total = a.numel(), inner = a.shape[nd - 1], as = a.strides[nd - 1], bs = b.strides[nd - 1];
  if (total == 0) return;
  std::vector<std::int64_t> idx(std::size_t(nd - 1), 0);
  std::int64_t ra = a.offset, rb = b.offset;
  for (std::int64_t o = 0; o < total / inner; ++o) {
    f(ra, rb, inner, as, bs);
    for (int d = nd - 2; d >= 0; --d) {
      ra += a.strides[d], rb += b.strides[d];
      if (++idx[std::size_t(d)] < a.shape[d]) break;
      ra -= a.strides[d] * a.shape[d], rb -= b.strides[d] * a.shape[d];
      idx[std::size_t(d)] = 0;
    }
  }
}
// f(offset in a, offset in b) for every element of two views of the same shape, in row-major order.
template <typename F>
void for_each_offset_pair(const HostTensor& a, const HostTensor& b, F&& f) {
  for_each_row_pair(a, b, [&](std::int64_t ra, std::int64_t rb, std::int64_t cnt, std::int64_t as, std::int64_t bs) {
    for (std::int64_t i = 0; i < cnt; ++i) f(ra + i * as, rb + i * bs);
  });
}

inline std::vector<unsigned char> HostTensor::elem_bytes() const {
  const std::size_t es = esize();
  std::vector<unsigned char> out(std::size_t(numel()) * es);
  unsigned char* dst = out.data();
  for_each_row_pair(*this, *this, [&](std::int64_t r, std::int64_t, std::int64_t cnt, std::int64_t st, std::int64_t) {
    if (st == 1) {  // (a contiguous row: one copy)
      std::memcpy(dst, bytes.data() + std::size_t(r) * es, std::size_t(cnt) * es);
      dst += std::size_t(cnt) * es;
      return;
    }
    for (std::int64_t i = 0; i < cnt; ++i, dst += es) std::memcpy(dst, bytes.data() + std::size_t(r + i * st) * es, es);
  });
  return out;
}

// Contiguous tensor, or rows cut from a larger buffer: the last dim padded by `pad` elements and the
// view starting `lead` elements in (lead = 1 makes 16-bit rows unaligned for 16-byte vectors).
inline HostTensor make_host(DType dt, std::vector<std::int64_t> shape, std::int64_t pad = 0, std::int64_t lead = 0) {
  HostTensor t;
  t.dtype = dt;
  t.shape = shape;
  t.strides.assign(shape.size(), 1);
  std::int64_t s = 1;
  for (int d = int(shape.size()) - 1; d >= 0; --d) {
    t.strides[d] = s;
    s *= shape[d] + (d == int(shape.size()) - 1 ? pad : 0);
  }
  t.offset = lead;
  t.bytes.assign(std::size_t(s + lead + 8) * t.esize(), 0);
  return t;
}

// Uniform in [lo, hi): a splitmix64 stream seeded by one draw of rng (mt19937_64 per element took 7-11 ns, a third
// of a GPU case's host time at tens of millions of elements), 53 random bits per value.
inline void fill_random(HostTensor& t, std::mt19937_64& rng, double lo = -2.0, double hi = 2.0) {
  std::uint64_t state = rng();
  const double scale = (hi - lo) * 0x1.0p-53;
  auto next = [&state, lo, scale] {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return lo + double((z ^ (z >> 31)) >> 11) * scale;
  };
  visit_dtype(t.dtype, [&]<DType D>() {
    unsigned char* base = t.bytes.data();
    for_each_row_pair(t, t, [&](std::int64_t r, std::int64_t, std::int64_t cnt, std::int64_t st, std::int64_t) {
      for (std::int64_t i = 0; i < cnt; ++i) store_elem<D>(base, r + i * st, next());
    });
  });
}
inline void fill_bytes(HostTensor& t, unsigned char b) { std::fill(t.bytes.begin(), t.bytes.end(), b); }

// A float64 copy with the same shape (contiguous): the reference runs on these.
inline HostTensor to_f64(const HostTensor& t) {
  HostTensor o = make_host(DType::f64, t.shape);
  double* dst = static_cast<double*>(o.base());
  visit_dtype(t.dtype, [&]<DType D>() {
    const unsigned char* base = t.bytes.data();
    for_each_row_pair(t, t, [&](std::int64_t r, std::int64_t, std::int64_t cnt, std::int64_t st, std::int64_t) {
      for (std::int64_t i = 0; i < cnt; ++i) *dst++ = load_elem<D>(base, r + i * st);
    });
  });
  return o;
}

// ||a - b|| / scale: the error against a size chosen by the caller (where ||b|| itself is a cancellation);
// NaN anywhere gives +inf.
inline double err_over(const HostTensor& a, const HostTensor& b, double scale) {
  if (a.shape != b.shape) {  // (views of other shapes: element by element in row-major order, as copies)
    const auto va = a.values(), vb = b.values();
    EXPECT_EQ(va.size(), vb.size());
    double num = 0.0;
    for (std::size_t i = 0; i < va.size() && i < vb.size(); ++i) {
      if (!std::isfinite(va[i]) || !std::isfinite(vb[i])) return INFINITY;
      num += (va[i] - vb[i]) * (va[i] - vb[i]);
    }
    return std::sqrt(num) / scale;
  }
  double num = 0.0;
  bool finite = true;
  visit_dtype(a.dtype, [&]<DType DA>() {
    visit_dtype(b.dtype, [&]<DType DB>() {
      const unsigned char *pa = a.bytes.data(), *pb = b.bytes.data();
      for_each_row_pair(a, b, [&](std::int64_t ra, std::int64_t rb, std::int64_t cnt, std::int64_t as, std::int64_t bs) {
        for (std::int64_t i = 0; i < cnt; ++i) {
          const double x = load_elem<DA>(pa, ra + i * as), y = load_elem<DB>(pb, rb + i * bs);
          finite = finite && std::isfinite(x) && std::isfinite(y);
          num += (x - y) * (x - y);
        }
      });
    });
  });
  return finite ? std::sqrt(num) / scale : INFINITY;
}

inline double l2_norm(const HostTensor& a) {
  double s = 0.0;
  visit_dtype(a.dtype, [&]<DType D>() {
    const unsigned char* base = a.bytes.data();
    for_each_row_pair(a, a, [&](std::int64_t r, std::int64_t, std::int64_t cnt, std::int64_t st, std::int64_t) {
      for (std::int64_t i = 0; i < cnt; ++i) {
        const double x = load_elem<D>(base, r + i * st);
        s += x * x;
      }
    });
  });
  return std::sqrt(s);
}

// ||a - b|| / ||b|| over the two views (same shape; ||a - b|| where b = 0); NaN anywhere gives +inf.
inline double rel_err(const HostTensor& a, const HostTensor& b) {
  const double den = l2_norm(b);
  return err_over(a, b, den > 0 ? den : 1.0);
}

inline double tolerance(DType t) {
  switch (t) {
    case DType::f32: return 1e-5;
    case DType::f16: return 2e-3;
    case DType::bf16: return 1e-2;
    case DType::f64: return 1e-12;
    case DType::i32: case DType::i64: return 0.0;  // exact (index tensors)
  }
  return 0;
}

// Runs f and expects an ArgumentError whose message holds every fragment (the op, the argument,
// what was expected...).
template <typename F>
void expect_argument_error(F&& f, std::initializer_list<const char*> fragments) {
  try {
    f();
    ADD_FAILURE() << "no error for: " << *fragments.begin();
  } catch (const ArgumentError& e) {
    const std::string msg = e.what();
    for (const char* frag : fragments) EXPECT_NE(msg.find(frag), std::string::npos) << "message: " << msg;
  }
}

#if FW_WITH_CUDA
#define FW_TEST_CUDA(call) ASSERT_EQ((call), cudaSuccess) << #call
// A device mirror of a HostTensor's whole storage (same offsets/strides).
struct DeviceMirror {
  void* ptr = nullptr;
  std::size_t nbytes = 0;
  explicit DeviceMirror(const HostTensor& h) : nbytes(h.bytes.size()) {
    EXPECT_EQ(cudaMalloc(&ptr, nbytes), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(ptr, h.bytes.data(), nbytes, cudaMemcpyHostToDevice), cudaSuccess);
    // a pageable upload may return before its DMA lands, and the tests' non-blocking streams do
    // not wait for the legacy stream: without this, a kernel could read half-uploaded inputs
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  ~DeviceMirror() { cudaFree(ptr); }
  TensorRef ref(HostTensor& h) { return h.ref(DeviceType::cuda, static_cast<unsigned char*>(ptr) + h.offset * h.esize()); }
  void download(HostTensor& h) {
    EXPECT_EQ(cudaMemcpy(h.bytes.data(), ptr, nbytes, cudaMemcpyDeviceToHost), cudaSuccess);
  }
};

// A library switch (detail::set_* / force_*: each returns the previous value) set for a scope and put
// back after it.
template <typename V>
class ScopedSwitch {
 public:
  ScopedSwitch(V (*set)(V), V value) : set_(set), prev_(set(value)) {}
  ~ScopedSwitch() { set_(prev_); }
  ScopedSwitch(const ScopedSwitch&) = delete;
  ScopedSwitch& operator=(const ScopedSwitch&) = delete;

 private:
  V (*set_)(V);
  V prev_;
};

// Runs `work` (its launches on stream st) eagerly, or captured in a CUDA graph and the graph launched
// once; then waits for st. (EXPECT, not ASSERT: callers return results.)
template <typename F>
void run_eager_or_graph(cudaStream_t st, bool graph, F&& work) {
  if (graph) {
    cudaGraph_t g = nullptr;
    cudaGraphExec_t ge = nullptr;
    EXPECT_EQ(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    work();
    EXPECT_EQ(cudaStreamEndCapture(st, &g), cudaSuccess);
    EXPECT_EQ(cudaGraphInstantiate(&ge, g, 0), cudaSuccess);
    EXPECT_EQ(cudaGraphLaunch(ge, st), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(st), cudaSuccess);
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
  } else {
    work();
  }
  EXPECT_EQ(cudaStreamSynchronize(st), cudaSuccess);
}

// A chain of decoding steps with programmatic launches against plain ones: run(programmatic, graph)
// returns the chain's outputs; with programmatic launches, eagerly and in a graph, they must be the
// plain eager run's bytes, whose first `finite` outputs must be finite (the steps ran on written states).
template <typename R>
void expect_programmatic_chain_same_bits(R&& run, std::size_t finite) {
  const std::vector<HostTensor> want = run(false, false);
  for (bool graph : {false, true}) {
    SCOPED_TRACE(graph ? "graph" : "eager");
    const std::vector<HostTensor> got = run(true, graph);
    ASSERT_EQ(got.size(), want.size());
    for (std::size_t t = 0; t < want.size(); ++t) {
      SCOPED_TRACE("output " + std::to_string(t));
      EXPECT_EQ(got[t].bytes, want[t].bytes);
    }
  }
  for (std::size_t t = 0; t < finite && t < want.size(); ++t)
    for (double x : want[t].values()) ASSERT_TRUE(std::isfinite(x)) << "output " << t;
}
#endif

}  // namespace fwtest
