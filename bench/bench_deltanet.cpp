// bench_deltanet.cpp: verify and time the public DeltaNet ops (fastweight/deltanet.h) for
// fastweight_bench: fixed-length and variable-length (cu_seqlens) batches, the L2-norm option.
// Verification: the op's outputs vs the float64 loop form of the reference on float64 copies of the
// same (rounded) inputs; relative Frobenius error over all outputs. Timing on CPU tensors: wall
// clock, median of 5. With a GPU, deltanet_fwd and deltanet_bwd on CUDA tensors at
// shared/BENCHMARKS.md shapes, bf16: verified at B = 1, H = 2 and the same T, K, V and offsets (the
// float64 loop costs O(B H T K V) on one host core: 0.5 s at T = 8192), timed at the full shape like
// the norms (CUDA graph, L2 flushed, median of --reps). The row names both shapes.
#include <algorithm>
#include <limits>
#include <cstdio>
#include <string>

#include "bench_ops.h"
#include "bench_util.h"
#include "reference/deltanet_ref.h"

namespace {
using namespace fwbench;

std::string dims(std::int64_t B, std::int64_t T, std::int64_t H, std::int64_t K, std::int64_t V) {
  return "(" + std::to_string(B) + "," + std::to_string(T) + "," + std::to_string(H) + "," + std::to_string(K) + "," +
         std::to_string(V) + ")";
}

#if FW_WITH_CUDA
// n sequences of random lengths (empty ones possible) packed into `total` tokens: offsets (n+1).
std::vector<std::int64_t> random_offsets(std::int64_t n, std::int64_t total, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<std::int64_t> u(0, total);
  std::vector<std::int64_t> off{0};
  for (std::int64_t i = 1; i < n; ++i) off.push_back(u(rng));
  std::sort(off.begin(), off.end());
  off.push_back(total);
  return off;
}

// deltanet_fwd / deltanet_bwd on the GPU: bf16 q, k, v, beta, fp32 initial and final states, the
// in-kernel L2 norm on (as FLA's DeltaNet layers call it); cu: varlen offsets (B = 1), empty: B
// sequences of T. The backward gets random dL/do and dL/d final state and writes every gradient.
struct GpuDn {
  std::int64_t B, T, H, K, V, N;
  std::vector<std::int64_t> cu;
  bool split = true;  // split_operands (false: bf16-only tensor-core operands)
  std::mt19937_64 rng;
  HostBuf q, k, v, beta, h0, o, ht, cub, go, ght, gq, gk, gv, gb, gh0;
  DevBuf dq, dk, dv, dbeta, dh0, dout, dht, dcu, d_go, d_ght, d_gq, d_gk, d_gv, d_gb, d_gh0;
  // wy_inverse (B, T, H, 64): fp32 with split, bf16 without; with_wy: the forward writes it, the backward
  // reads it (as a training step does)
  DevZeros wy32, wy16;
  bool with_wy = false;
  GpuDn(std::int64_t b, std::int64_t t, std::int64_t h, std::int64_t kk, std::int64_t vv,
        std::vector<std::int64_t> offs)
      : B(b), T(t), H(h), K(kk), V(vv), N(offs.empty() ? b : std::int64_t(offs.size()) - 1), cu(std::move(offs)),
        rng(11), q(DType::bf16, {B, T, H, K}, &rng), k(DType::bf16, {B, T, H, K}, &rng),
        v(DType::bf16, {B, T, H, V}, &rng), beta(DType::bf16, {B, T, H}, &rng, 0.0, 1.0),
        h0(DType::f32, {N, H, K, V}, &rng, -0.1, 0.1), o(DType::bf16, {B, T, H, V}), ht(DType::f32, {N, H, K, V}),
        cub(DType::i64, {std::max<std::int64_t>(std::int64_t(cu.size()), 1)}), go(DType::bf16, {B, T, H, V}, &rng),
        ght(DType::f32, {N, H, K, V}, &rng, -0.1, 0.1), gq(DType::bf16, {B, T, H, K}), gk(DType::bf16, {B, T, H, K}),
        gv(DType::bf16, {B, T, H, V}), gb(DType::bf16, {B, T, H}), gh0(DType::f32, {N, H, K, V}), dq(q), dk(k),
        dv(v), dbeta(beta), dh0(h0), dout(o), dht(ht), dcu(upload_offsets()), d_go(go), d_ght(ght), d_gq(gq),
        d_gk(gk), d_gv(gv), d_gb(gb), d_gh0(gh0), wy32(DType::f32, {B, T, H, 64}), wy16(DType::bf16, {B, T, H, 64}) {}
  TensorRef wy() const { return with_wy ? (split ? wy32.ref() : wy16.ref()) : TensorRef{}; }
  HostBuf& upload_offsets() {  // before dcu copies cub to the device
    for (std::size_t i = 0; i < cu.size(); ++i) cub.set(std::int64_t(i), double(cu[i]));
    return cub;
  }
  DeltanetFwdArgs args() const {
    DeltanetFwdArgs a;
    a.q = dq.ref(), a.k = dk.ref(), a.v = dv.ref(), a.beta = dbeta.ref(), a.initial_state = dh0.ref();
    if (!cu.empty()) a.cu_seqlens = dcu.ref();
    a.o = dout.ref(), a.final_state = dht.ref(), a.use_qk_l2norm_in_kernel = true, a.split_operands = split;
    a.wy_inverse = wy();
    return a;
  }
  DeltanetBwdArgs bwd_args() const {
    DeltanetBwdArgs a;
    a.q = dq.ref(), a.k = dk.ref(), a.v = dv.ref(), a.beta = dbeta.ref(), a.initial_state = dh0.ref();
    if (!cu.empty()) a.cu_seqlens = dcu.ref();
    a.do_ = d_go.ref(), a.dfinal_state = d_ght.ref(), a.dq = d_gq.ref(), a.dk = d_gk.ref(), a.dv = d_gv.ref();
    a.dbeta = d_gb.ref(), a.dinitial_state = d_gh0.ref(), a.use_qk_l2norm_in_kernel = true;
    a.split_operands = split;
    a.wy_inverse = wy();
    return a;
  }
  detail::DeltanetShape ref_shape() const {
    detail::DeltanetShape sh;
    sh.B = B, sh.T = T, sh.H = H, sh.K = K, sh.V = V;
    if (!cu.empty()) sh.cu_seqlens = cu.data(), sh.N = N;
    return sh;
  }
  detail::DeltanetInputs ref_inputs() const { return {q.val.data(), k.val.data(), v.val.data(), beta.val.data()}; }
  static detail::DeltanetOptions ref_options() {
    detail::DeltanetOptions opt;
    opt.use_qk_l2norm_in_kernel = true;
    return opt;
  }
  // max over o and the final state of the relative error against the float64 loop form
  // pipeline: with the workspace (the tensor-core pipeline where it applies), else the on-chip kernel
  double verify_fwd(bool pipeline) {
    DeltanetFwdArgs a = args();
    if (!pipeline) a.wy_inverse = TensorRef{};  // written by the pipeline only
    DevScratch ws(pipeline ? deltanet_fwd_workspace_size(a) : 0);
    deltanet_fwd(a, ws.p, ws.bytes, nullptr);
    cuda_or_throw(cudaDeviceSynchronize(), "deltanet_fwd");
    Vec ro(o.val.size()), rht(ht.val.size());
    detail::deltanet_recurrent_fwd(ref_shape(), ref_inputs(), ref_options(), h0.val.data(), ro.data(), rht.data());
    Err eo, eh;
    eo.add(dout.read(), ro), eh.add(dht.read(), rht);
    return std::max(eo.value(), eh.value());
  }
  // max over dq, dk, dv, dbeta and dinitial_state of the relative error against the loop form's BPTT
  double verify_bwd() {
    if (with_wy) verify_fwd(true);  // wy_inverse from this forward
    const DeltanetBwdArgs a = bwd_args();
    DevScratch ws(deltanet_bwd_workspace_size(a));
    deltanet_bwd(a, ws.p, ws.bytes, nullptr);
    cuda_or_throw(cudaDeviceSynchronize(), "deltanet_bwd");
    Vec rq(gq.val.size()), rk(gk.val.size()), rv(gv.val.size()), rb(gb.val.size()), rh(gh0.val.size());
    detail::deltanet_recurrent_bwd(ref_shape(), ref_inputs(), ref_options(), h0.val.data(), go.val.data(),
                                   ght.val.data(), {rq.data(), rk.data(), rv.data(), rb.data()}, rh.data());
    Err eq, ek, ev, eb, eh;
    eq.add(d_gq.read(), rq), ek.add(d_gk.read(), rk), ev.add(d_gv.read(), rv), eb.add(d_gb.read(), rb);
    eh.add(d_gh0.read(), rh);
    return std::max({eq.value(), ek.value(), ev.value(), eb.value(), eh.value()});
  }
  std::string shape() const {
    return dims(B, T, H, K, V) + (cu.empty() ? "" : " varlen " + std::to_string(N) + " seqs");
  }
};

// The decoding step on the GPU (shared/BENCHMARKS.md: B in {1, 8, 64, 256}, H = 16, K = V = 128),
// bf16 q, k, v, beta, fp32 states, the L2 norm on (bench_decode.py's row); verified at B = 2 against
// the loop form over one position, timed out of place on zero-filled device tensors.
int gpu_step_rows(const FamilyBench& fb, std::vector<BenchRow>& rows) {
  const std::int64_t H = 16, K = 128, V = 128, vB = 2;
  double err = INFINITY;
  int failures = 0;
  if (fb.timing_only) {
    err = std::numeric_limits<double>::quiet_NaN();
  } else {
    try {
      std::mt19937_64 rng(13);
      HostBuf q(DType::bf16, {vB, H, K}, &rng), k(DType::bf16, {vB, H, K}, &rng), v(DType::bf16, {vB, H, V}, &rng);
      HostBuf beta(DType::bf16, {vB, H}, &rng, 0.0, 1.0), st(DType::f32, {vB, H, K, V}, &rng, -0.5, 0.5);
      HostBuf o(DType::bf16, {vB, H, V}), nst(DType::f32, {vB, H, K, V});
      DevBuf gq(q), gk(k), gv(v), gb(beta), gst(st), go(o), gnst(nst);
      deltanet_step({gq.ref(), gk.ref(), gv.ref(), gb.ref(), gst.ref(), go.ref(), gnst.ref(), kDeltanetDefaultScale, true});
      cuda_or_throw(cudaDeviceSynchronize(), "deltanet_step");
      detail::DeltanetShape sh;
      sh.B = vB, sh.T = 1, sh.H = H, sh.K = K, sh.V = V;
      detail::DeltanetOptions opt;
      opt.use_qk_l2norm_in_kernel = true;
      Vec ro(o.val.size()), rst(nst.val.size());
      detail::deltanet_recurrent_fwd(sh, {q.val.data(), k.val.data(), v.val.data(), beta.val.data()}, opt,
                                     st.val.data(), ro.data(), rst.data());
      Err e;
      e.add(go.read(), ro), e.add(gnst.read(), rst);
      err = e.value();
    } catch (const std::exception& ex) {
      std::printf("deltanet_step (cuda) verification: error: %s\n", ex.what());
    }
  }
  for (std::int64_t B : fb.quick ? std::vector<std::int64_t>{1, 64} : std::vector<std::int64_t>{1, 8, 64, 256}) {
    try {
      DevZeros q(DType::bf16, {B, H, K}), k(DType::bf16, {B, H, K}), v(DType::bf16, {B, H, V}), beta(DType::bf16, {B, H});
      DevZeros st(DType::f32, {B, H, K, V}), o(DType::bf16, {B, H, V}), nst(DType::f32, {B, H, K, V});
      const DeltanetStepArgs a{q.ref(), k.ref(), v.ref(), beta.ref(), st.ref(), o.ref(), nst.ref(), kDeltanetDefaultScale,
                               true};
      const double ms = fb.timer->time_ms([&](Stream s) { deltanet_step(a, s); }, fb.reps);
      if (!fb.timing_only && !(err <= 1e-2)) ++failures;
      const double gbs = 2.0 * double(B * H * K * V) * 4.0 / (ms * 1e6);  // the state read and written
      char shp[160];
      std::snprintf(shp, sizeof shp, "(%ld,1,%ld,%ld,%ld) l2norm; state %.0f GB/s; verified at B = %ld", long(B),
                    long(H), long(K), long(V), gbs, long(vB));
      rows.push_back({"deltanet_step", "bfloat16", shp, err, ms, "cuda"});
    } catch (const std::exception& ex) {
      std::printf("deltanet_step (cuda) timing at B = %ld: error: %s\n", long(B), ex.what());
      ++failures;
    }
  }
  return failures;
}

int gpu_rows(const FamilyBench& fb, std::vector<BenchRow>& rows) {
  int failures = 0;
  struct Case { std::int64_t B, T, H, K, seqs; };  // K = V; seqs > 0: varlen (B = 1, T tokens)
  std::vector<Case> cases = {{4, 4096, 16, 128, 0}};
  if (!fb.quick)
    cases.push_back({2, 8192, 16, 128, 0}), cases.push_back({8, 2048, 32, 64, 0}),
        cases.push_back({1, 32768, 16, 128, 0});
  cases.push_back({1, 32768, 16, 128, 8});  // 8 sequences of random lengths (BENCHMARKS.md)
  for (const Case& c : cases) {
    try {
      const std::vector<std::int64_t> cu = c.seqs > 0 ? random_offsets(c.seqs, c.T, 5) : std::vector<std::int64_t>{};
      GpuDn check(1, c.T, 2, c.K, c.K, cu);
      check.with_wy = fb.dn_wy_saved;
      const double nan = std::numeric_limits<double>::quiet_NaN();
      const bool ver = !fb.timing_only;
      if (ver) std::printf("deltanet (cuda): verifying at %s\n", check.shape().c_str());
      const double err_f = ver ? check.verify_fwd(true) : nan, err_f1 = ver ? check.verify_fwd(false) : nan,
                   err_b = ver ? check.verify_bwd() : nan;
      if (ver) failures += !(err_f <= 1e-2) + !(err_f1 <= 1e-2) + !(err_b <= 1e-2);
      GpuDn run(c.B, c.T, c.H, c.K, c.K, cu);
      run.with_wy = fb.dn_wy_saved;
      const DeltanetFwdArgs a = run.args();  // (with_wy: it leaves wy_inverse for the backward timed below)
      DevScratch wsf(deltanet_fwd_workspace_size(a));
      const double ms_f = fb.timer->time_ms([&](Stream st) { deltanet_fwd(a, wsf.p, wsf.bytes, st); }, fb.reps);
      DeltanetFwdArgs a1 = a;
      a1.wy_inverse = TensorRef{};
      const double ms_f1 = fb.timer->time_ms([&](Stream st) { deltanet_fwd(a1, st); }, fb.reps);
      const DeltanetBwdArgs ab = run.bwd_args();
      DevScratch ws(deltanet_bwd_workspace_size(ab));
      const double ms_b = fb.timer->time_ms([&](Stream st) { deltanet_bwd(ab, ws.p, ws.bytes, st); }, fb.reps);
      const std::string shp = run.shape() + (ver ? " l2norm; verified at " + check.shape() : " l2norm; not verified (--timing-only)");
      rows.push_back({"deltanet_fwd", "bfloat16", shp + "; workspace " + std::to_string(wsf.bytes >> 20) + " MiB", err_f,
                      ms_f, "cuda"});
      rows.push_back({"deltanet_fwd", "bfloat16", shp + "; no workspace (on-chip kernel)", err_f1, ms_f1, "cuda"});
      rows.push_back({"deltanet_bwd", "bfloat16", shp + "; workspace " + std::to_string(ws.bytes >> 20) + " MiB", err_b,
                      ms_b, "cuda"});
      // the same with bf16-only tensor-core operands (split_operands = false: FLA's precision)
      check.split = run.split = false;
      const double e2_f = ver ? check.verify_fwd(true) : nan, e2_b = ver ? check.verify_bwd() : nan;
      if (ver) failures += !(e2_f <= 2e-2) + !(e2_b <= 2e-2);  // the bf16 bound (hi + lo keeps 1e-2 above)
      const DeltanetFwdArgs a2 = run.args();
      DevScratch wsf2(deltanet_fwd_workspace_size(a2));
      const double ms_f2 = fb.timer->time_ms([&](Stream st) { deltanet_fwd(a2, wsf2.p, wsf2.bytes, st); }, fb.reps);
      const DeltanetBwdArgs ab2 = run.bwd_args();
      DevScratch ws2(deltanet_bwd_workspace_size(ab2));
      const double ms_b2 = fb.timer->time_ms([&](Stream st) { deltanet_bwd(ab2, ws2.p, ws2.bytes, st); }, fb.reps);
      const std::string shp2 = run.shape() + (ver ? " l2norm, bf16 operands; verified at " + check.shape() : " l2norm, bf16 operands; not verified (--timing-only)");
      rows.push_back({"deltanet_fwd", "bfloat16", shp2 + "; workspace " + std::to_string(wsf2.bytes >> 20) + " MiB",
                      e2_f, ms_f2, "cuda"});
      rows.push_back({"deltanet_bwd", "bfloat16", shp2 + "; workspace " + std::to_string(ws2.bytes >> 20) + " MiB",
                      e2_b, ms_b2, "cuda"});
    } catch (const std::exception& ex) {
      std::printf("deltanet (cuda): error: %s\n", ex.what());
      ++failures;
    }
  }
  return failures;
}
#endif

}  // namespace

int run_deltanet_bench(const FamilyBench& fb, std::vector<BenchRow>& rows) {
  if (fb.steps_only) {
#if FW_WITH_CUDA
    if (fb.timer) return gpu_step_rows(fb, rows);
#endif
    return 0;
  }
  const bool quick = fb.quick;
  const std::int64_t T = quick ? 128 : 256, H = 2, K = 64, V = 64;
  int failures = 0;
  struct Case { DType dt; bool varlen, l2; };
  for (const Case c : {Case{DType::f32, false, false}, Case{DType::bf16, false, true}, Case{DType::f32, true, true}}) {
    const std::int64_t B = c.varlen ? 1 : 2;
    std::vector<std::int64_t> cu = {0, T / 3, T / 3, T};  // three sequences, one of them empty
    const std::int64_t N = c.varlen ? std::int64_t(cu.size()) - 1 : B;
    std::mt19937_64 rng(7);
    // keys of about unit norm without the in-kernel L2 norm (beta |k|^2 > 2 makes the recurrence blow up)
    const double kr = c.l2 ? 1.0 : 0.2;
    HostBuf q(c.dt, {B, T, H, K}, &rng), k(c.dt, {B, T, H, K}, &rng, -kr, kr), v(c.dt, {B, T, H, V}, &rng);
    HostBuf beta(c.dt, {B, T, H}, &rng, 0.0, 1.0), h0(DType::f32, {N, H, K, V}, &rng, -0.1, 0.1);
    HostBuf o(c.dt, {B, T, H, V}), ht(DType::f32, {N, H, K, V});
    const std::string name = std::string(c.varlen ? "varlen" : "") + (c.varlen && c.l2 ? " " : "") + (c.l2 ? "l2norm" : "");
    const std::string shp = dims(B, T, H, K, V) + (name.empty() ? "" : " " + name);
    TensorRef cur;
    if (c.varlen) cur = make_tensor(cu.data(), DType::i64, {std::int64_t(cu.size())});
    detail::DeltanetShape sh;
    sh.B = B, sh.T = T, sh.H = H, sh.K = K, sh.V = V;
    if (c.varlen) sh.cu_seqlens = cu.data(), sh.N = N;
    detail::DeltanetOptions opt;
    opt.use_qk_l2norm_in_kernel = c.l2;
    const detail::DeltanetInputs in{q.val.data(), k.val.data(), v.val.data(), beta.val.data()};
    const double tol = c.dt == DType::f32 ? 1e-5 : 1e-2;
    try {
      DeltanetFwdArgs a;
      a.q = q.ref(), a.k = k.ref(), a.v = v.ref(), a.beta = beta.ref(), a.initial_state = h0.ref();
      a.cu_seqlens = cur, a.o = o.ref(), a.final_state = ht.ref(), a.use_qk_l2norm_in_kernel = c.l2;
      const double ms = time_ms([&] { deltanet_fwd(a); });
      Vec ro(o.val.size()), rht(ht.val.size());
      detail::deltanet_recurrent_fwd(sh, in, opt, h0.val.data(), ro.data(), rht.data());
      Err e;
      e.add(o.read(), ro);
      if (!(e.value() <= tol)) ++failures;
      rows.push_back({"deltanet_fwd", dtype_name(c.dt), shp, e.value(), ms, "cpu"});
    } catch (const std::exception& ex) {
      std::printf("deltanet_fwd: error: %s\n", ex.what());
      ++failures;
    }
    try {
      HostBuf dout(c.dt, {B, T, H, V}, &rng), dq(c.dt, {B, T, H, K}), dk(c.dt, {B, T, H, K}), dv(c.dt, {B, T, H, V});
      HostBuf db(c.dt, {B, T, H}), dh0(DType::f32, {N, H, K, V});
      DeltanetBwdArgs a;
      a.q = q.ref(), a.k = k.ref(), a.v = v.ref(), a.beta = beta.ref(), a.initial_state = h0.ref();
      a.cu_seqlens = cur, a.do_ = dout.ref(), a.dq = dq.ref(), a.dk = dk.ref(), a.dv = dv.ref(), a.dbeta = db.ref();
      a.dinitial_state = dh0.ref(), a.use_qk_l2norm_in_kernel = c.l2;
      const double ms = time_ms([&] { deltanet_bwd(a); });
      Vec rq(dq.val.size()), rk(dk.val.size()), rv(dv.val.size()), rb(db.val.size()), rh(dh0.val.size());
      detail::deltanet_recurrent_bwd(sh, in, opt, h0.val.data(), dout.val.data(), nullptr,
                                     {rq.data(), rk.data(), rv.data(), rb.data()}, rh.data());
      Err e;
      e.add(dq.read(), rq), e.add(dk.read(), rk), e.add(dv.read(), rv), e.add(db.read(), rb);
      if (!(e.value() <= tol)) ++failures;
      rows.push_back({"deltanet_bwd", dtype_name(c.dt), shp, e.value(), ms, "cpu"});
    } catch (const std::exception& ex) {
      std::printf("deltanet_bwd: error: %s\n", ex.what());
      ++failures;
    }
  }
  // the decoding step (fp32, L2 norm on): the loop form over one position, (B, H, D) as (B, 1, H, D)
  try {
    const std::int64_t B = 2;
    std::mt19937_64 rng(11);
    HostBuf q(DType::f32, {B, H, K}, &rng), k(DType::f32, {B, H, K}, &rng), v(DType::f32, {B, H, V}, &rng);
    HostBuf beta(DType::f32, {B, H}, &rng, 0.0, 1.0), st(DType::f32, {B, H, K, V}, &rng, -0.5, 0.5);
    HostBuf o(DType::f32, {B, H, V}), nst(DType::f32, {B, H, K, V});
    DeltanetStepArgs a{q.ref(), k.ref(), v.ref(), beta.ref(), st.ref(), o.ref(), nst.ref(), kDeltanetDefaultScale, true};
    const double ms = time_ms([&] { deltanet_step(a); });
    detail::DeltanetShape sh;
    sh.B = B, sh.T = 1, sh.H = H, sh.K = K, sh.V = V;
    detail::DeltanetOptions opt;
    opt.use_qk_l2norm_in_kernel = true;
    Vec ro(o.val.size()), rst(nst.val.size());
    detail::deltanet_recurrent_fwd(sh, {q.val.data(), k.val.data(), v.val.data(), beta.val.data()}, opt, st.val.data(),
                                   ro.data(), rst.data());
    Err e;
    e.add(o.read(), ro), e.add(nst.read(), rst);
    if (!(e.value() <= 1e-5)) ++failures;
    rows.push_back({"deltanet_step", "float32", dims(B, 1, H, K, V) + " l2norm", e.value(), ms, "cpu"});
  } catch (const std::exception& ex) {
    std::printf("deltanet_step: error: %s\n", ex.what());
    ++failures;
  }
#if FW_WITH_CUDA
  if (fb.timer) failures += gpu_rows(fb, rows) + gpu_step_rows(fb, rows);
#endif
  return failures;
}
