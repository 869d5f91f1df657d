// bench_mlstm.cpp: verify and time the public mLSTM ops (fastweight/mlstm.h) for fastweight_bench.
// Verification: the op's outputs vs the float64 reference run directly on float64 copies of the same
// (rounded) inputs; relative Frobenius error over all outputs. Timing on CPU tensors: wall clock,
// median of 5. With a GPU, mlstm_fwd and mlstm_bwd on CUDA tensors at (B,NH,S,DQK,DV) =
// (2,16,8192,128,128), bf16 (shared/BENCHMARKS.md): verified at B = 1, NH = 2, S = 2048 and the same
// DQK, DV (the float64 recurrent form costs O(B NH S DQK DV) on one host core, and its backward
// keeps every state), timed at the full shape like the norms (CUDA graph, L2 flushed, median
// of --reps). The row names both shapes. The parallel form likewise (bf16, verified at (1,2,512,128,128)
// against the float64 parallel form, timed at (2,8,2048,128,128)).
#include "bench_ops.h"
#include "bench_util.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <stdexcept>

#include "common/half.h"
#include "fastweight/fastweight.h"
#include "reference/mlstm_ref.h"

namespace {
using namespace fastweight;
using namespace fwbench;

std::string shape_str(std::int64_t B, std::int64_t NH, std::int64_t S, std::int64_t DQK, std::int64_t DV) {
  return "(" + std::to_string(B) + "," + std::to_string(NH) + "," + std::to_string(S) + "," + std::to_string(DQK) +
         "," + std::to_string(DV) + ")";
}

#if FW_WITH_CUDA
// One mLSTM problem on the GPU: bf16 q, k, v (and dh, dq, dk, dv), fp32 gates, initial and final
// states (and di, df), chunk 64; the gates as in the CPU rows (i in [-3, 3], f in [0, 5]).
struct GpuMlstm {
  std::int64_t B, NH, S, DQK, DV;
  std::mt19937_64 rng;
  HostBuf q, k, v, i, f, c0, n0, m0, h, cl, nl, ml, dh, dq, dk, dv, di, df;
  DevBuf gq, gk, gv, gi, gf, gc0, gn0, gm0, gh, gcl, gnl, gml, gdh, gdq, gdk, gdv, gdi, gdf;
  GpuMlstm(std::int64_t b, std::int64_t nh, std::int64_t s, std::int64_t dqk, std::int64_t dv_)
      : B(b), NH(nh), S(s), DQK(dqk), DV(dv_), rng(3),
        q(DType::bf16, {B, NH, S, DQK}, &rng), k(DType::bf16, {B, NH, S, DQK}, &rng),
        v(DType::bf16, {B, NH, S, DV}, &rng),
        i(DType::f32, {B, NH, S}, &rng, -3, 3), f(DType::f32, {B, NH, S}, &rng, 0, 5),
        c0(DType::f32, {B, NH, DQK, DV}, &rng), n0(DType::f32, {B, NH, DQK}, &rng), m0(DType::f32, {B, NH, 1}, &rng),
        h(DType::bf16, {B, NH, S, DV}), cl(DType::f32, {B, NH, DQK, DV}), nl(DType::f32, {B, NH, DQK}),
        ml(DType::f32, {B, NH, 1}), dh(DType::bf16, {B, NH, S, DV}, &rng), dq(DType::bf16, {B, NH, S, DQK}),
        dk(DType::bf16, {B, NH, S, DQK}), dv(DType::bf16, {B, NH, S, DV}), di(DType::f32, {B, NH, S}),
        df(DType::f32, {B, NH, S}), gq(q), gk(k), gv(v), gi(i), gf(f), gc0(c0), gn0(n0), gm0(m0), gh(h), gcl(cl),
        gnl(nl), gml(ml), gdh(dh), gdq(dq), gdk(dk), gdv(dv), gdi(di), gdf(df) {}
  MlstmFwdArgs fwd_args() const {
    return {gq.ref(), gk.ref(), gv.ref(), gi.ref(), gf.ref(), gc0.ref(), gn0.ref(), gm0.ref(),
            gh.ref(), gcl.ref(), gnl.ref(), gml.ref(), 1e-6, 64};
  }
  MlstmBwdArgs bwd_args() const {
    MlstmBwdArgs a;
    a.q = gq.ref(), a.k = gk.ref(), a.v = gv.ref(), a.i = gi.ref(), a.f = gf.ref();
    a.c_initial = gc0.ref(), a.n_initial = gn0.ref(), a.m_initial = gm0.ref(), a.dh = gdh.ref();
    a.dq = gdq.ref(), a.dk = gdk.ref(), a.dv = gdv.ref(), a.di = gdi.ref(), a.df = gdf.ref();
    a.chunk_size = 64;
    return a;
  }
  detail::MlstmShape shape() const { return {B, NH, S, DQK, DV}; }
  detail::MlstmInputs inputs() const { return {q.val.data(), k.val.data(), v.val.data(), i.val.data(), f.val.data()}; }
  detail::MlstmConstState init() const { return {c0.val.data(), n0.val.data(), m0.val.data()}; }
  // max over h and the final states of the relative error against the float64 recurrent form
  double verify_fwd() {
    const MlstmFwdArgs a = fwd_args();
    DevScratch ws(mlstm_fwd_workspace_size(a));
    mlstm_fwd(a, ws.p, ws.bytes, nullptr);
    cuda_or_throw(cudaDeviceSynchronize(), "mlstm_fwd");
    Vec rh(h.val.size()), rc(cl.val.size()), rn(nl.val.size()), rm(ml.val.size());
    detail::mlstm_recurrent_fwd(shape(), inputs(), 1e-6, init(), rh.data(), {rc.data(), rn.data(), rm.data()});
    Err eh, ec, en, em;
    eh.add(gh.read(), rh), ec.add(gcl.read(), rc), en.add(gnl.read(), rn), em.add(gml.read(), rm);
    return std::max({eh.value(), ec.value(), en.value(), em.value()});
  }
  // dq, dk, dv, di, df together, as the CPU rows
  double verify_bwd() {
    const MlstmBwdArgs a = bwd_args();
    DevScratch ws(mlstm_bwd_workspace_size(a));
    mlstm_bwd(a, ws.p, ws.bytes, nullptr);
    cuda_or_throw(cudaDeviceSynchronize(), "mlstm_bwd");
    Vec rq(dq.val.size()), rk(dk.val.size()), rv(dv.val.size()), ri(di.val.size()), rf(df.val.size());
    detail::mlstm_recurrent_bwd(shape(), inputs(), 1e-6, init(), dh.val.data(), {},
                                {rq.data(), rk.data(), rv.data(), ri.data(), rf.data()}, {});
    Err e;
    e.add(gdq.read(), rq), e.add(gdk.read(), rk), e.add(gdv.read(), rv), e.add(gdi.read(), ri), e.add(gdf.read(), rf);
    return e.value();
  }
};

// "BxNHxSxDQKxDV[+...]" -> shapes; empty: the default timed shape.
std::vector<std::array<std::int64_t, 5>> timed_shapes(const std::string& spec) {
  std::vector<std::array<std::int64_t, 5>> out;
  if (spec.empty()) return {{2, 16, 8192, 128, 128}};
  std::size_t at = 0;
  while (at <= spec.size()) {
    const std::size_t end = std::min(spec.find('+', at), spec.size());
    std::array<std::int64_t, 5> sh{};
    const std::string one = spec.substr(at, end - at);
    if (std::sscanf(one.c_str(), "%ldx%ldx%ldx%ldx%ld", &sh[0], &sh[1], &sh[2], &sh[3], &sh[4]) != 5)
      throw std::invalid_argument("--mlstm-shapes: not BxNHxSxDQKxDV: " + one);
    out.push_back(sh);
    at = end + 1;
  }
  return out;
}

int gpu_rows(const FamilyBench& fb, std::vector<BenchRow>& rows) {
  int failures = 0;
  // verified at a shorter S: the same kernels and paths (many chunks), seconds less host work
  const std::int64_t DQK = 128, DV = 128, vS = fb.quick ? 512 : 2048;
  double err[2] = {INFINITY, INFINITY};  // fwd, bwd
  try {
    std::printf("mlstm (cuda): verifying at %s\n", shape_str(1, 2, vS, DQK, DV).c_str());
    GpuMlstm check(1, 2, vS, DQK, DV);
    err[0] = check.verify_fwd();
    err[1] = check.verify_bwd();
    std::printf("mlstm (cuda): rel err fwd %.2e, bwd %.2e\n", err[0], err[1]);
  } catch (const std::exception& ex) {
    std::printf("mlstm (cuda) verification: error: %s\n", ex.what());
  }
  std::vector<std::array<std::int64_t, 5>> shapes;
  try {
    shapes = timed_shapes(fb.mlstm_shapes);
  } catch (const std::exception& ex) {
    std::printf("mlstm (cuda) timing: error: %s\n", ex.what());
    return failures + 1;
  }
  for (const auto& [B, NH, S, K, V] : shapes) {
    const std::string shp = shape_str(B, NH, S, K, V) + "; verified at " + shape_str(1, 2, vS, DQK, DV);
    int timed = 0;
    try {
      GpuMlstm run(B, NH, S, K, V);
      for (bool bwd : {false, true}) {
        double ms = 0;
        if (bwd) {
          const MlstmBwdArgs a = run.bwd_args();
          DevScratch ws(mlstm_bwd_workspace_size(a));
          ms = fb.timer->time_ms([&](Stream st) { mlstm_bwd(a, ws.p, ws.bytes, st); }, fb.reps);
        } else {
          const MlstmFwdArgs a = run.fwd_args();
          DevScratch ws(mlstm_fwd_workspace_size(a));
          ms = fb.timer->time_ms([&](Stream st) { mlstm_fwd(a, ws.p, ws.bytes, st); }, fb.reps);
        }
        if (!(err[bwd] <= 1e-2)) ++failures;
        rows.push_back({bwd ? "mlstm_bwd" : "mlstm_fwd", "bfloat16", shp, err[bwd], ms, "cuda"});
        ++timed;
      }
    } catch (const std::exception& ex) {
      std::printf("mlstm (cuda) timing at %s: error: %s\n", shape_str(B, NH, S, K, V).c_str(), ex.what());
      failures += 2 - timed;
    }
  }
  return failures;
}

// The parallel form (mlstm_parallel.cu) on the GPU: bf16 IO, fp32 gates; verified against the float64
// parallel form at (1, 2, 512, 128, 128), timed at (2, 8, 2048, 128, 128).
struct GpuParallel {
  std::mt19937_64 rng;
  HostBuf q, k, v, i, f, h, n, m, b, dh, dq, dk, dv, di, df;
  DevBuf gq, gk, gv, gi, gf, gh, gn, gm, gb, gdh, gdq, gdk, gdv, gdi, gdf;
  detail::MlstmShape sh;
  GpuParallel(std::int64_t B, std::int64_t NH, std::int64_t S, std::int64_t DQK, std::int64_t DV)
      : rng(7), q(DType::bf16, {B, NH, S, DQK}, &rng), k(DType::bf16, {B, NH, S, DQK}, &rng),
        v(DType::bf16, {B, NH, S, DV}, &rng), i(DType::f32, {B, NH, S}, &rng, -3, 3),
        f(DType::f32, {B, NH, S}, &rng, 0, 5), h(DType::bf16, {B, NH, S, DV}), n(DType::f32, {B, NH, S}),
        m(DType::f32, {B, NH, S}), b(DType::f32, {B, NH, S}), dh(DType::bf16, {B, NH, S, DV}, &rng),
        dq(DType::bf16, {B, NH, S, DQK}), dk(DType::bf16, {B, NH, S, DQK}), dv(DType::bf16, {B, NH, S, DV}),
        di(DType::f32, {B, NH, S}), df(DType::f32, {B, NH, S}), gq(q), gk(k), gv(v), gi(i), gf(f), gh(h), gn(n), gm(m),
        gb(b), gdh(dh), gdq(dq), gdk(dk), gdv(dv), gdi(di), gdf(df), sh{B, NH, S, DQK, DV} {}
  MlstmParallelFwdArgs fwd_args() const {
    MlstmParallelFwdArgs a;
    a.q = gq.ref(), a.k = gk.ref(), a.v = gv.ref(), a.i = gi.ref(), a.f = gf.ref();
    a.h = gh.ref(), a.n = gn.ref(), a.m = gm.ref(), a.b = gb.ref();
    return a;
  }
  MlstmParallelBwdArgs bwd_args() const {
    MlstmParallelBwdArgs a;
    a.q = gq.ref(), a.k = gk.ref(), a.v = gv.ref(), a.i = gi.ref(), a.f = gf.ref();
    a.h = gh.ref(), a.m = gm.ref(), a.b = gb.ref(), a.dh = gdh.ref();
    a.dq = gdq.ref(), a.dk = gdk.ref(), a.dv = gdv.ref(), a.di = gdi.ref(), a.df = gdf.ref();
    return a;
  }
  // errors of (h, n, m) and of every gradient against the float64 parallel form
  std::pair<double, double> verify() {
    const MlstmParallelFwdArgs a = fwd_args();
    DevScratch wf(mlstm_parallel_fwd_workspace_size(a));
    mlstm_parallel_fwd(a, wf.p, wf.bytes, nullptr);
    const MlstmParallelBwdArgs g = bwd_args();
    DevScratch wb(mlstm_parallel_bwd_workspace_size(g));
    mlstm_parallel_bwd(g, wb.p, wb.bytes, nullptr);
    cuda_or_throw(cudaDeviceSynchronize(), "mlstm_parallel");
    const detail::MlstmInputs in{q.val.data(), k.val.data(), v.val.data(), i.val.data(), f.val.data()};
    Vec rh(h.val.size()), rn(n.val.size()), rm(m.val.size());
    Vec rq(dq.val.size()), rk(dk.val.size()), rv(dv.val.size()), ri(di.val.size()), rf(df.val.size());
    detail::mlstm_parallel_fwd(sh, in, 1e-6, rh.data(), rn.data(), rm.data());
    detail::mlstm_parallel_bwd(sh, in, 1e-6, dh.val.data(), {rq.data(), rk.data(), rv.data(), ri.data(), rf.data()});
    Err eh, en, em, eb;
    eh.add(gh.read(), rh), en.add(gn.read(), rn), em.add(gm.read(), rm);
    eb.add(gdq.read(), rq), eb.add(gdk.read(), rk), eb.add(gdv.read(), rv), eb.add(gdi.read(), ri),
        eb.add(gdf.read(), rf);
    return {std::max({eh.value(), en.value(), em.value()}), eb.value()};
  }
};

// The decoding step on the GPU (shared/BENCHMARKS.md: B in {1, 8, 64, 256}; xLSTM 7B's heads: NH = 8,
// DQK = 256, DV = 512), bf16 q, k, v, fp32 gates and states (bench_decode.py's row); verified at
// B = 2 against the float64 step, timed out of place and in place (a second kernel for n, m) on
// zero-filled device tensors.
int gpu_step_rows(const FamilyBench& fb, std::vector<BenchRow>& rows) {
  const std::int64_t NH = 8, DQK = 256, DV = 512, vB = 2;
  double err = INFINITY;
  int failures = 0;
  if (fb.timing_only) {
    err = std::numeric_limits<double>::quiet_NaN();
  } else {
    try {
      std::mt19937_64 rng(14);
      HostBuf q(DType::bf16, {vB, NH, DQK}, &rng), k(DType::bf16, {vB, NH, DQK}, &rng), v(DType::bf16, {vB, NH, DV}, &rng);
      HostBuf i(DType::f32, {vB, NH}, &rng, -3, 3), f(DType::f32, {vB, NH}, &rng, 0, 5), h(DType::bf16, {vB, NH, DV});
      HostBuf c(DType::f32, {vB, NH, DQK, DV}, &rng), n(DType::f32, {vB, NH, DQK}, &rng), m(DType::f32, {vB, NH}, &rng);
      HostBuf c2(DType::f32, {vB, NH, DQK, DV}), n2(DType::f32, {vB, NH, DQK}), m2(DType::f32, {vB, NH});
      DevBuf gq(q), gk(k), gv(v), gi(i), gf(f), gh(h), gc(c), gn(n), gm(m), gc2(c2), gn2(n2), gm2(m2);
      mlstm_step({gq.ref(), gk.ref(), gv.ref(), gi.ref(), gf.ref(), gc.ref(), gn.ref(), gm.ref(), gh.ref(), gc2.ref(),
                  gn2.ref(), gm2.ref(), 1e-6});
      cuda_or_throw(cudaDeviceSynchronize(), "mlstm_step");
      Vec rc = c.val, rn = n.val, rm = m.val, rh(h.val.size());
      detail::mlstm_step({vB, NH, 1, DQK, DV}, q.val.data(), k.val.data(), v.val.data(), i.val.data(), f.val.data(),
                         1e-6, {rc.data(), rn.data(), rm.data()}, rh.data());
      Err e;
      e.add(gh.read(), rh), e.add(gc2.read(), rc), e.add(gn2.read(), rn), e.add(gm2.read(), rm);
      err = e.value();
    } catch (const std::exception& ex) {
      std::printf("mlstm_step (cuda) verification: error: %s\n", ex.what());
    }
  }
  for (std::int64_t B : fb.quick ? std::vector<std::int64_t>{1, 64} : std::vector<std::int64_t>{1, 8, 64, 256}) {
    try {
      DevZeros q(DType::bf16, {B, NH, DQK}), k(DType::bf16, {B, NH, DQK}), v(DType::bf16, {B, NH, DV});
      DevZeros i(DType::f32, {B, NH}), f(DType::f32, {B, NH}), h(DType::bf16, {B, NH, DV});
      DevZeros c(DType::f32, {B, NH, DQK, DV}), n(DType::f32, {B, NH, DQK}), m(DType::f32, {B, NH});
      DevZeros c2(DType::f32, {B, NH, DQK, DV}), n2(DType::f32, {B, NH, DQK}), m2(DType::f32, {B, NH});
      const MlstmStepArgs a{q.ref(), k.ref(), v.ref(), i.ref(), f.ref(), c.ref(), n.ref(), m.ref(), h.ref(), c2.ref(),
                            n2.ref(), m2.ref(), 1e-6};
      const MlstmStepArgs ip{q.ref(), k.ref(), v.ref(), i.ref(), f.ref(), c.ref(), n.ref(), m.ref(), h.ref(), c.ref(),
                             n.ref(), m.ref(), 1e-6};
      if (!fb.timing_only && !(err <= 1e-2)) ++failures;
      for (const MlstmStepArgs* x : {&a, &ip}) {
        const double ms = fb.timer->time_ms([&](Stream s) { mlstm_step(*x, s); }, fb.reps, fb.step_batch);
        const double gbs = 2.0 * double(B * NH * DQK * DV) * 4.0 / (ms * 1e6);  // C read and written
        char shp[160];
        std::snprintf(shp, sizeof shp, "(%ld,%ld,1,%ld,%ld)%s; state %.0f GB/s; verified at B = %ld", long(B), long(NH),
                      long(DQK), long(DV), x == &ip ? " in place" : "", gbs, long(vB));
        rows.push_back({"mlstm_step", "bfloat16", shp, err, ms, "cuda"});
      }
    } catch (const std::exception& ex) {
      std::printf("mlstm_step (cuda) timing at B = %ld: error: %s\n", long(B), ex.what());
      ++failures;
    }
  }
  return failures;
}

int gpu_parallel_rows(const FamilyBench& fb, std::vector<BenchRow>& rows) {
  const std::int64_t B = 2, NH = 8, S = 2048, DQK = 128, DV = 128, vS = 512;
  const std::string shp = shape_str(B, NH, S, DQK, DV) + "; verified at " + shape_str(1, 2, vS, DQK, DV);
  std::pair<double, double> err{INFINITY, INFINITY};
  try {
    GpuParallel check(1, 2, vS, DQK, DV);
    err = check.verify();
  } catch (const std::exception& ex) {
    std::printf("mlstm_parallel (cuda) verification: error: %s\n", ex.what());
  }
  int failures = 0, timed = 0;
  try {
    GpuParallel run(B, NH, S, DQK, DV);
    const MlstmParallelFwdArgs a = run.fwd_args();
    DevScratch wf(mlstm_parallel_fwd_workspace_size(a));
    const double ms_f = fb.timer->time_ms([&](Stream st) { mlstm_parallel_fwd(a, wf.p, wf.bytes, st); }, fb.reps);
    if (!(err.first <= 1e-2)) ++failures;
    rows.push_back({"mlstm_parallel_fwd", "bfloat16", shp, err.first, ms_f, "cuda"});
    ++timed;
    mlstm_parallel_fwd(a, wf.p, wf.bytes, nullptr);  // the backward's h, m, b
    const MlstmParallelBwdArgs g = run.bwd_args();
    DevScratch wb(mlstm_parallel_bwd_workspace_size(g));
    const double ms_b = fb.timer->time_ms([&](Stream st) { mlstm_parallel_bwd(g, wb.p, wb.bytes, st); }, fb.reps);
    if (!(err.second <= 2e-2)) ++failures;
    rows.push_back({"mlstm_parallel_bwd", "bfloat16", shp, err.second, ms_b, "cuda"});
    ++timed;
  } catch (const std::exception& ex) {
    std::printf("mlstm_parallel (cuda) timing: error: %s\n", ex.what());
    failures += 2 - timed;
  }
  return failures;
}
#endif

}  // namespace

int run_mlstm_bench(const FamilyBench& fb, std::vector<BenchRow>& rows) {
  if (fb.steps_only) {
#if FW_WITH_CUDA
    if (fb.timer) return gpu_step_rows(fb, rows);
#endif
    return 0;
  }
  const bool quick = fb.quick;
  const std::int64_t B = 1, NH = 2, S = quick ? 128 : 256, DQK = 64, DV = 64, L = 64;
  const detail::MlstmShape sh{B, NH, S, DQK, DV};
  const std::string shp = shape_str(B, NH, S, DQK, DV);
  int failures = 0;
  auto tol = [](DType dt) { return dt == DType::f32 ? 1e-5 : dt == DType::f16 ? 2e-3 : dt == DType::bf16 ? 1e-2 : 1e-12; };
  for (DType dt : {DType::f32, DType::bf16}) {
    std::mt19937_64 rng(3);
    HostBuf q(dt, {B, NH, S, DQK}, &rng), k(dt, {B, NH, S, DQK}, &rng), v(dt, {B, NH, S, DV}, &rng);
    HostBuf i(DType::f32, {B, NH, S}, &rng, -3, 3), f(DType::f32, {B, NH, S}, &rng, 0, 5);
    HostBuf c0(DType::f32, {B, NH, DQK, DV}, &rng), n0(DType::f32, {B, NH, DQK}, &rng), m0(DType::f32, {B, NH, 1}, &rng);
    HostBuf h(dt, {B, NH, S, DV}), cl(DType::f32, {B, NH, DQK, DV}), nl(DType::f32, {B, NH, DQK}), ml(DType::f32, {B, NH, 1});
    const detail::MlstmInputs in{q.val.data(), k.val.data(), v.val.data(), i.val.data(), f.val.data()};
    const detail::MlstmConstState init{c0.val.data(), n0.val.data(), m0.val.data()};
    // forward
    try {
      MlstmFwdArgs a{q.ref(), k.ref(), v.ref(), i.ref(), f.ref(), c0.ref(), n0.ref(), m0.ref(),
                     h.ref(), cl.ref(), nl.ref(), ml.ref(), 1e-6, L};
      const double ms = time_ms([&] { mlstm_fwd(a); });
      Vec rh(h.val.size()), rc(cl.val.size()), rn(nl.val.size()), rm(ml.val.size());
      detail::mlstm_recurrent_fwd(sh, in, 1e-6, init, rh.data(), {rc.data(), rn.data(), rm.data()});
      Err e;
      e.add(h.read(), rh);
      const double err = e.value();
      if (!(err <= tol(dt))) ++failures;
      rows.push_back({"mlstm_fwd", dtype_name(dt), shp, err, ms, "cpu"});
    } catch (const std::exception& ex) {
      std::printf("mlstm_fwd: error: %s\n", ex.what());
      ++failures;
    }
    // backward (all gradients incl. the initial states')
    try {
      HostBuf dh(dt, {B, NH, S, DV}, &rng), dq(dt, {B, NH, S, DQK}), dk(dt, {B, NH, S, DQK}), dv(dt, {B, NH, S, DV});
      HostBuf di(DType::f32, {B, NH, S}), df(DType::f32, {B, NH, S});
      MlstmBwdArgs a;
      a.q = q.ref(), a.k = k.ref(), a.v = v.ref(), a.i = i.ref(), a.f = f.ref();
      a.c_initial = c0.ref(), a.n_initial = n0.ref(), a.m_initial = m0.ref(), a.dh = dh.ref();
      a.dq = dq.ref(), a.dk = dk.ref(), a.dv = dv.ref(), a.di = di.ref(), a.df = df.ref();
      a.chunk_size = L;
      const double ms = time_ms([&] { mlstm_bwd(a); });
      Vec rq(dq.val.size()), rk(dk.val.size()), rv(dv.val.size()), ri(di.val.size()), rf(df.val.size());
      detail::mlstm_recurrent_bwd(sh, in, 1e-6, init, dh.val.data(), {}, {rq.data(), rk.data(), rv.data(), ri.data(), rf.data()},
                                  {});
      Err e;
      e.add(dq.read(), rq), e.add(dk.read(), rk), e.add(dv.read(), rv), e.add(di.read(), ri), e.add(df.read(), rf);
      const double err = e.value();
      if (!(err <= tol(dt))) ++failures;
      rows.push_back({"mlstm_bwd", dtype_name(dt), shp, err, ms, "cpu"});
    } catch (const std::exception& ex) {
      std::printf("mlstm_bwd: error: %s\n", ex.what());
      ++failures;
    }
  }
  // step and decay matrix (fp32)
  try {
    std::mt19937_64 rng(4);
    HostBuf q(DType::f32, {B, NH, DQK}, &rng), k(DType::f32, {B, NH, DQK}, &rng), v(DType::f32, {B, NH, DV}, &rng);
    HostBuf i(DType::f32, {B, NH}, &rng), f(DType::f32, {B, NH}, &rng, 0, 5), h(DType::f32, {B, NH, DV});
    HostBuf c(DType::f32, {B, NH, DQK, DV}, &rng), n(DType::f32, {B, NH, DQK}, &rng), m(DType::f32, {B, NH}, &rng);
    HostBuf c2(DType::f32, {B, NH, DQK, DV}), n2(DType::f32, {B, NH, DQK}), m2(DType::f32, {B, NH});
    MlstmStepArgs a{q.ref(), k.ref(), v.ref(), i.ref(), f.ref(), c.ref(), n.ref(), m.ref(), h.ref(), c2.ref(), n2.ref(),
                    m2.ref(), 1e-6};
    const double ms = time_ms([&] { mlstm_step(a); });
    Vec rc = c.val, rn = n.val, rm = m.val, rh(h.val.size());
    detail::mlstm_step(sh, q.val.data(), k.val.data(), v.val.data(), i.val.data(), f.val.data(), 1e-6,
                       {rc.data(), rn.data(), rm.data()}, rh.data());
    Err e;
    e.add(h.read(), rh), e.add(c2.read(), rc);
    if (!(e.value() <= 1e-5)) ++failures;
    rows.push_back({"mlstm_step", "float32", shape_str(B, NH, 1, DQK, DV), e.value(), ms, "cpu"});
  } catch (const std::exception& ex) {
    std::printf("mlstm_step: error: %s\n", ex.what());
    ++failures;
  }
  // parallel form (seed 000), fp32: h, n, m, then every gradient
  try {
    std::mt19937_64 rng(6);
    HostBuf q(DType::f32, {B, NH, S, DQK}, &rng), k(DType::f32, {B, NH, S, DQK}, &rng), v(DType::f32, {B, NH, S, DV}, &rng);
    HostBuf i(DType::f32, {B, NH, S}, &rng, -3, 3), f(DType::f32, {B, NH, S}, &rng, 0, 5);
    HostBuf h(DType::f32, {B, NH, S, DV}), n(DType::f32, {B, NH, S}), m(DType::f32, {B, NH, S});
    HostBuf dh(DType::f32, {B, NH, S, DV}, &rng), dq(DType::f32, {B, NH, S, DQK}), dk(DType::f32, {B, NH, S, DQK});
    HostBuf dv(DType::f32, {B, NH, S, DV}), di(DType::f32, {B, NH, S}), df(DType::f32, {B, NH, S});
    MlstmParallelFwdArgs a;
    a.q = q.ref(), a.k = k.ref(), a.v = v.ref(), a.i = i.ref(), a.f = f.ref(), a.h = h.ref(), a.n = n.ref(), a.m = m.ref();
    MlstmParallelBwdArgs b;
    b.q = a.q, b.k = a.k, b.v = a.v, b.i = a.i, b.f = a.f, b.h = a.h, b.n = a.n, b.m = a.m, b.dh = dh.ref();
    b.dq = dq.ref(), b.dk = dk.ref(), b.dv = dv.ref(), b.di = di.ref(), b.df = df.ref();
    const double ms_f = time_ms([&] { mlstm_parallel_fwd(a); });
    const double ms_b = time_ms([&] { mlstm_parallel_bwd(b); });
    const detail::MlstmInputs in{q.val.data(), k.val.data(), v.val.data(), i.val.data(), f.val.data()};
    Vec rh(h.val.size()), rn(n.val.size()), rm(m.val.size());
    Vec rq(dq.val.size()), rk(dk.val.size()), rv(dv.val.size()), ri(di.val.size()), rf(df.val.size());
    detail::mlstm_parallel_fwd(sh, in, 1e-6, rh.data(), rn.data(), rm.data());
    detail::mlstm_parallel_bwd(sh, in, 1e-6, dh.val.data(), {rq.data(), rk.data(), rv.data(), ri.data(), rf.data()});
    Err ef, eb;
    ef.add(h.read(), rh), ef.add(n.read(), rn), ef.add(m.read(), rm);
    eb.add(dq.read(), rq), eb.add(dk.read(), rk), eb.add(dv.read(), rv), eb.add(di.read(), ri), eb.add(df.read(), rf);
    if (!(ef.value() <= 1e-5)) ++failures;
    if (!(eb.value() <= 1e-5)) ++failures;
    rows.push_back({"mlstm_parallel_fwd", "float32", shp, ef.value(), ms_f, "cpu"});
    rows.push_back({"mlstm_parallel_bwd", "float32", shp, eb.value(), ms_b, "cpu"});
  } catch (const std::exception& ex) {
    std::printf("mlstm_parallel: error: %s\n", ex.what());
    ++failures;
  }
  // parallel form with the head norm (weight_offset 1, weight and bias), fp32: out, then every gradient
  try {
    std::mt19937_64 rng(8);
    HostBuf q(DType::f32, {B, NH, S, DQK}, &rng), k(DType::f32, {B, NH, S, DQK}, &rng), v(DType::f32, {B, NH, S, DV}, &rng);
    HostBuf i(DType::f32, {B, NH, S}, &rng, -3, 3), f(DType::f32, {B, NH, S}, &rng, 0, 5);
    HostBuf w(DType::f32, {NH, DV}, &rng, -0.5, 0.5), bias(DType::f32, {NH, DV}, &rng);
    HostBuf h(DType::f32, {B, NH, S, DV}), out(DType::f32, {B, NH, S, DV}), dout(DType::f32, {B, NH, S, DV}, &rng);
    HostBuf dq(DType::f32, {B, NH, S, DQK}), dk(DType::f32, {B, NH, S, DQK}), dv(DType::f32, {B, NH, S, DV});
    HostBuf di(DType::f32, {B, NH, S}), df(DType::f32, {B, NH, S}), dw(DType::f32, {NH, DV}), db(DType::f32, {NH, DV});
    MlstmParallelFwdArgs a;
    a.q = q.ref(), a.k = k.ref(), a.v = v.ref(), a.i = i.ref(), a.f = f.ref(), a.h = h.ref(), a.out = out.ref();
    a.norm_weight = w.ref(), a.norm_bias = bias.ref(), a.weight_offset = 1.0;
    MlstmParallelBwdArgs b;
    b.q = a.q, b.k = a.k, b.v = a.v, b.i = a.i, b.f = a.f, b.dout = dout.ref();
    b.norm_weight = a.norm_weight, b.norm_bias = a.norm_bias, b.weight_offset = 1.0;
    b.dq = dq.ref(), b.dk = dk.ref(), b.dv = dv.ref(), b.di = di.ref(), b.df = df.ref();
    b.dnorm_weight = dw.ref(), b.dnorm_bias = db.ref();
    const double ms_f = time_ms([&] { mlstm_parallel_fwd(a); });
    const double ms_b = time_ms([&] { mlstm_parallel_bwd(b); });
    const detail::MlstmInputs in{q.val.data(), k.val.data(), v.val.data(), i.val.data(), f.val.data()};
    const detail::MlstmHeadNorm norm{w.val.data(), bias.val.data(), 1e-6, 1.0};
    Vec ro(out.val.size()), rq(dq.val.size()), rk(dk.val.size()), rv(dv.val.size()), ri(di.val.size()),
        rf(df.val.size()), rw(dw.val.size()), rb(db.val.size());
    detail::mlstm_parallel_headnorm_fwd(sh, in, 1e-6, norm, ro.data(), nullptr, nullptr);
    detail::mlstm_parallel_headnorm_bwd(sh, in, 1e-6, norm, dout.val.data(),
                                        {rq.data(), rk.data(), rv.data(), ri.data(), rf.data()}, {rw.data(), rb.data()});
    Err ef, eb;
    ef.add(out.read(), ro);
    eb.add(dq.read(), rq), eb.add(dk.read(), rk), eb.add(dv.read(), rv), eb.add(di.read(), ri), eb.add(df.read(), rf),
        eb.add(dw.read(), rw), eb.add(db.read(), rb);
    if (!(ef.value() <= 1e-5)) ++failures;
    if (!(eb.value() <= 1e-5)) ++failures;
    rows.push_back({"mlstm_parallel_headnorm_fwd", "float32", shp, ef.value(), ms_f, "cpu"});
    rows.push_back({"mlstm_parallel_headnorm_bwd", "float32", shp, eb.value(), ms_b, "cpu"});
  } catch (const std::exception& ex) {
    std::printf("mlstm_parallel_headnorm: error: %s\n", ex.what());
    ++failures;
  }
  try {
    std::mt19937_64 rng(5);
    HostBuf i(DType::f32, {B, NH, S}, &rng), f(DType::f32, {B, NH, S}, &rng, -5, 5), D(DType::f32, {B, NH, S, S});
    HostBuf dD(DType::f32, {B, NH, S, S}, &rng), di(DType::f32, {B, NH, S}), df(DType::f32, {B, NH, S});
    const double ms_f = time_ms([&] { mlstm_decay_matrix_fwd({i.ref(), f.ref(), D.ref()}); });
    const double ms_b = time_ms([&] { mlstm_decay_matrix_bwd({f.ref(), dD.ref(), di.ref(), df.ref()}); });
    Vec rD(D.val.size()), rdi(di.val.size()), rdf(df.val.size());
    detail::mlstm_decay_matrix_fwd(sh, i.val.data(), f.val.data(), rD.data());
    detail::mlstm_decay_matrix_bwd(sh, f.val.data(), dD.val.data(), rdi.data(), rdf.data());
    Vec got = D.read();
    for (std::size_t e = 0; e < got.size(); ++e)  // -inf above the diagonal in both: compare as 0
      if (std::isinf(rD[e]) && std::isinf(got[e])) got[e] = rD[e] = 0;
    Err ef, eb;
    ef.add(got, rD);
    eb.add(di.read(), rdi), eb.add(df.read(), rdf);
    if (!(ef.value() <= 1e-5)) ++failures;
    if (!(eb.value() <= 1e-5)) ++failures;
    const std::string ds = "(" + std::to_string(B) + "," + std::to_string(NH) + "," + std::to_string(S) + ")";
    rows.push_back({"mlstm_decay_matrix_fwd", "float32", ds, ef.value(), ms_f, "cpu"});
    rows.push_back({"mlstm_decay_matrix_bwd", "float32", ds, eb.value(), ms_b, "cpu"});
  } catch (const std::exception& ex) {
    std::printf("mlstm_decay_matrix: error: %s\n", ex.what());
    ++failures;
  }
#if FW_WITH_CUDA
  if (fb.timer) failures += gpu_rows(fb, rows) + gpu_parallel_rows(fb, rows) + gpu_step_rows(fb, rows);
#endif
  return failures;
}
