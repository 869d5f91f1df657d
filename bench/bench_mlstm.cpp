// bench_mlstm.cpp: verify and time the public mLSTM ops (fastweight/mlstm.h) for fastweight_bench.
// Verification: the op's outputs vs the float64 reference run directly on float64 copies of the same
// (rounded) inputs; relative Frobenius error over all outputs. Timing: wall clock, median of 5.
#include "bench_ops.h"
#include "bench_util.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <random>

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

}  // namespace

int run_mlstm_bench(bool quick, std::vector<BenchRow>& rows) {
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
  return failures;
}
