// bench_util.h: host tensors, error and timing helpers shared by the op benches (bench_*.cpp and
// fastweight_bench.cpp): wall-clock timing of CPU calls, and with CUDA the GPU timer (CUDA graph, L2
// flushed) and device copies of host tensors.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "common/half.h"
#include "fastweight/fastweight.h"
#if FW_WITH_CUDA
#include <cuda_runtime.h>
#endif

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

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

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

#if FW_WITH_CUDA
struct GpuTimer {
  void* flush = nullptr;
  std::size_t flush_bytes = 0;
  cudaStream_t st{};
  cudaEvent_t e0{}, e1{};
  GpuTimer() {
    int dev = 0, l2 = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev);
    flush_bytes = std::size_t(std::max(l2, 1 << 20)) * 2;
    cudaMalloc(&flush, flush_bytes);
    cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
  }
  ~GpuTimer() { cudaFree(flush); cudaStreamDestroy(st); cudaEventDestroy(e0); cudaEventDestroy(e1); }
  GpuTimer(const GpuTimer&) = delete;
  GpuTimer& operator=(const GpuTimer&) = delete;
  // Median ms of fn captured in a CUDA graph, L2 flushed before each replay. batch > 1: fn captured
  // batch times back to back in the graph, the time per call (a decoding loop's steps, as
  // bench_decode.py times them: one graph launch and one flush per batch).
  double time_ms(const std::function<void(Stream)>& fn, int reps, int batch = 1) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    fn(reinterpret_cast<Stream>(st));  // warm-up outside capture (attributes, first-launch costs)
    cudaStreamSynchronize(st);
    if (cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) != cudaSuccess) throw Error("capture failed");
    for (int b = 0; b < std::max(batch, 1); ++b) fn(reinterpret_cast<Stream>(st));
    if (cudaStreamEndCapture(st, &graph) != cudaSuccess) throw Error("capture failed");
    if (cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess) throw Error("graph instantiate failed");
    std::vector<double> ms;
    for (int i = 0; i < reps + 3; ++i) {
      cudaMemsetAsync(flush, i & 0xff, flush_bytes, st);
      cudaEventRecord(e0, st);
      cudaGraphLaunch(exec, st);
      cudaEventRecord(e1, st);
      cudaEventSynchronize(e1);
      float t = 0;
      cudaEventElapsedTime(&t, e0, e1);
      if (i >= 3) ms.push_back(t);
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) throw Error(std::string("timing: ") + cudaGetErrorString(err));
    return median(ms) / std::max(batch, 1);
  }
  // Device-to-device copy bandwidth (bytes read + written), 1 GiB.
  double copy_gbps() {
    const std::size_t bytes = std::size_t(1) << 30;
    void *a = nullptr, *b = nullptr;
    cudaMalloc(&a, bytes);
    cudaMalloc(&b, bytes);
    cudaMemsetAsync(a, 1, bytes, st);
    std::vector<double> ms;
    for (int i = 0; i < 10; ++i) {
      cudaEventRecord(e0, st);
      cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, st);
      cudaEventRecord(e1, st);
      cudaEventSynchronize(e1);
      float t = 0;
      cudaEventElapsedTime(&t, e0, e1);
      if (i >= 2) ms.push_back(t);
    }
    cudaFree(a);
    cudaFree(b);
    return 2.0 * double(bytes) / (median(ms) * 1e-3) / 1e9;
  }
};

inline void cuda_or_throw(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(std::string(what) + ": " + cudaGetErrorString(e));
}

// A device copy of a HostBuf (uploaded at construction): ref() views it as a CUDA tensor of the
// current device, read() downloads it into the HostBuf and returns the values.
struct DevBuf {
  HostBuf& h;
  void* p = nullptr;
  explicit DevBuf(HostBuf& hb) : h(hb) {
    cuda_or_throw(cudaMalloc(&p, std::max<std::size_t>(h.bytes.size(), 1)), "cudaMalloc");
    cuda_or_throw(cudaMemcpy(p, h.bytes.data(), h.bytes.size(), cudaMemcpyHostToDevice), "upload");
    // the pageable upload's DMA may still be in flight; the timer's stream is non-blocking
    cuda_or_throw(cudaDeviceSynchronize(), "upload");
  }
  ~DevBuf() { cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  TensorRef ref() const {
    int dev = 0;
    cudaGetDevice(&dev);
    return make_tensor(p, h.dt, int(h.shape.size()), h.shape.data(), DeviceType::cuda, dev);
  }
  Vec read() {
    cuda_or_throw(cudaMemcpy(h.bytes.data(), p, h.bytes.size(), cudaMemcpyDeviceToHost), "download");
    return h.read();
  }
};

// Device scratch (an op's workspace), freed at scope exit.
struct DevScratch {
  void* p = nullptr;
  std::size_t bytes = 0;
  explicit DevScratch(std::size_t n) : bytes(n) {
    if (n) cuda_or_throw(cudaMalloc(&p, n), "cudaMalloc(workspace)");
  }
  ~DevScratch() { cudaFree(p); }
  DevScratch(const DevScratch&) = delete;
  DevScratch& operator=(const DevScratch&) = delete;
};

// A zero-filled device tensor without a host copy, for timed rows whose operands reach a GB (the
// decoding steps' states at B = 256): the times do not depend on the values.
struct DevZeros {
  DType dt;
  std::vector<std::int64_t> shape;
  DevScratch mem;
  static std::size_t bytes_of(DType d, const std::vector<std::int64_t>& s) {
    std::size_t n = dtype_size(d);
    for (std::int64_t x : s) n *= std::size_t(x);
    return n;
  }
  DevZeros(DType d, std::vector<std::int64_t> s) : dt(d), shape(std::move(s)), mem(bytes_of(dt, shape)) {
    cuda_or_throw(cudaMemset(mem.p, 0, mem.bytes), "cudaMemset");
    cuda_or_throw(cudaDeviceSynchronize(), "cudaMemset");
  }
  TensorRef ref() const {
    int dev = 0;
    cudaGetDevice(&dev);
    return make_tensor(mem.p, dt, int(shape.size()), shape.data(), DeviceType::cuda, dev);
  }
};
#endif

}  // namespace fwbench
