// rownorm_launch.cuh: launch planning for the LayerNorm-family kernels (rownorm_kernel.cuh), one
// template per IO dtype, instantiated in rownorm_<dtype>.cu so that build options can drop dtypes.
//
// Plan, forward: aligned 16-bit rows of 33..256 16-byte vectors (Hopper: 33..512) in small problems, and on
// Hopper with raw parameters (IO dtype, or fp32 with set_rownorm_fwd_row1_f32par) rows of 385..768 vectors,
// 769..1024 (few or many rows), 1025..3584 and 3585..4096 (any rows) -> one row per CTA of 1, 2, 4 or 8 vectors
// per thread (rownorm_fwd_row1_kernel; 4 x 256 / 512 registers capped, set_rownorm_fwd_row1_capped; 8 with x
// packed, set_rownorm_fwd_row1_rawx), threads per row in whole warps on Hopper (set_rownorm_fwd_row1_tight);
// the rules and their measurements are in rownorm_plan; other aligned rows with N <= kBulkMaxN
// on a device with bulk copies (sm_90, the kernel compiled for it) -> the bulk-copy kernel (rownorm_fwd_bulk.cuh), one 512-thread CTA per SM, P per
// group rounded down to one wave (rows up to 2 kBulkMaxN too, with parameters unstaged:
// set_rownorm_fwd_bulk_long); otherwise N <= kCachedMaxNFwd -> cached engines with tpr = next_pow2(ceil(N / elements per
// thread)) threads per row and max(tpr, 256) threads per CTA; short rows: one row group per CTA (P =
// row groups in all), longer rows: persistent, P per parameter group about one wave of resident
// CTAs; aligned 16-bit rows past 4096 vectors (N > 32768) on Hopper -> the one-row kernel in clusters of C <= 8 CTAs
// per row that split the columns (set_rownorm_fwd_cluster); beyond that the streaming kernel (512 threads per row,
// persistent).
// Backward: persistent CTAs, P per parameter group about one wave of resident CTAs spread over the
// groups, so the weight-gradient partials stay small (P * G * N floats) and every CTA sees many rows:
// aligned rows with kRingMinTpr <= ring tpr and N <= kRingMaxN -> the ring kernel (512 threads, one
// CTA per SM); aligned rows past kRingMaxN on Hopper -> the ring kernel in clusters of ceil(N / kRingMaxN) <= 8
// CTAs that split the columns (set_rownorm_bwd_cluster; P clusters per group); other rows with N <=
// kCachedMaxNBwd -> the 2-vector cached kernel (max(tpr, 256) threads); longer rows -> rowsum + coltile (P per
// column tile, likewise one wave).
//
// Backward workspace (bytes, each part 256-aligned): dW partials (P*G*N fp32) | dB partials (same)
// | row sums (rows float2, long rows only).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/common/check.cuh"
#include "cuda/norm/norm_cuda.h"
#include "cuda/norm/rownorm_fwd_bulk.cuh"
#include "cuda/norm/rownorm_kernel.cuh"

namespace fastweight::detail {

struct RowPlan {
  bool cached = true;
  bool persistent = true;  // forward, cached: persistent CTAs (else one row group per CTA)
  bool ring = false;       // backward, cached: the cp.async ring kernel (aligned rows)
  int ring_vecs = kRingVecs;  // its vectors per thread (4, or 3: set_rownorm_bwd_ring3)
  int ring_stages = kRingStages;  // its row slots per row group (2, or 3: set_rownorm_bwd_ring_stages; not in clusters)
  bool ring_rms = false;    // its RMSNorm instance (set_rownorm_bwd_ring_rms)
  bool ring_sreg = false;   // its scale in registers (set_rownorm_bwd_ring_sreg; not in clusters)
  bool ring_prod = false;   // its producer-warp form (set_rownorm_bwd_ring_prod; not in clusters)
  bool ring_tight = false;  // its row groups of a multiple of 32 threads, not a power of two (set_rownorm_bwd_ring_tight)
  int cluster = 1;         // CTAs per cluster: the backward's ring (rows past kRingMaxN: 2..8, set_rownorm_bwd_cluster),
                           // the forward's one-row kernel (rows past 4096 vectors: 2..8, set_rownorm_fwd_cluster)
  int cl_cols = 0;         // and each one's columns (a multiple of E)
  bool bulk = false;       // forward: the bulk-copy kernel (Hopper, aligned rows)
  bool row1 = false;       // forward: one row per CTA, 1, 2 or 4 (8 forced) vectors per thread (aligned 16-bit rows)
  int row1_vecs = 1;       // its vectors per thread
  int row1_vb = 16;        // its vectors' bytes (16, or 8)
  bool row1_late = false;  // its raw parameters loaded after the sums (the planner's choice)
  bool row1_plain = false; // its loads through ld.global, not ld.global.nc (forced only, A/B)
  int stages = 0;          // its row slots per row group
  int bulk_vecs = 0;       // its 16-byte vectors per thread (4 or 8)
  bool bulk_staged = true; // its parameters staged in shared memory (else read per output vector)
  bool bulk_hoist = false; // unstaged: a row's parameter loads all issued before its first store
  int threads = 256;
  std::size_t smem = 0;
  RowLaunch L;
  // long-row backward only
  int tiles = 0;     // column tiles of coltile (threads * E columns each)
  RowLaunch rs;      // rowsum launch (512 threads per row)
};

inline bool rows_aligned(const void* base, const RowIndexer& ix, std::size_t elem) {
  if (reinterpret_cast<std::uintptr_t>(base) % 16 != 0) return false;
  for (int d = 0; d < ix.nd; ++d)
    if (ix.size[d] > 1 && (ix.stride[d] * std::int64_t(elem)) % 16 != 0) return false;
  return true;
}

inline int next_pow2(std::int64_t v) {
  int t = 1;
  while (t < v) t <<= 1;
  return t;
}

// CTAs per group: one wave of resident CTAs over `units` (groups x tiles), rounded down (a ceil
// puts the remainder's CTAs in a second wave, which the persistent kernels wait for whole: head
// norm's 16 groups got 144 ring CTAs of one per SM, 9 per group), at least 1, at most `need`.
inline int ctas_per_unit(const void* kernel, int threads, std::size_t smem, std::int64_t units, std::int64_t need) {
  const std::int64_t resident = std::int64_t(std::max(resident_ctas_per_sm(kernel, threads, smem), 1)) * sm_count();
  return int(std::max<std::int64_t>(1, std::min(need, resident / units)));
}

// The persistent cached forward kernel for (dtype, alignment, CTA size).
template <typename T>
const void* fwd_cached_kernel(bool aligned, bool big) {
  using K = void (*)(const RowNormParams, const RowLaunch);
  const K k = aligned ? (big ? &rownorm_fwd_cached_kernel<T, kFwdVecs, true, true> : &rownorm_fwd_cached_kernel<T, kFwdVecs, true, false>)
                      : (big ? &rownorm_fwd_cached_kernel<T, kFwdVecs, false, true> : &rownorm_fwd_cached_kernel<T, kFwdVecs, false, false>);
  return reinterpret_cast<const void*>(k);
}

// The bulk-copy forward kernel with `vpt` vectors per thread (unstaged parameters: 8 vectors of 512
// threads, their loads hoisted or not, or 4 of 1024, hoisted).
template <typename T>
const void* bulk_fwd_kernel(int vpt, bool staged = true, int threads = kBulkThreads, bool hoist = false) {
  if (!staged && threads == 1024) return reinterpret_cast<const void*>(&rownorm_fwd_bulk_kernel<T, 4, false, 1024, true>);
  if (!staged && hoist) return reinterpret_cast<const void*>(&rownorm_fwd_bulk_kernel<T, 8, false, kBulkThreads, true>);
  if (!staged) return reinterpret_cast<const void*>(&rownorm_fwd_bulk_kernel<T, 8, false>);
  return vpt == 8 ? reinterpret_cast<const void*>(&rownorm_fwd_bulk_kernel<T, 8>)
                  : reinterpret_cast<const void*>(&rownorm_fwd_bulk_kernel<T, kBulkVecs>);
}

// The ring backward for (vectors per thread, row slots, the RMSNorm instance: set_rownorm_bwd_ring_rms, in
// clusters: kRingStages only). The planner queries the instance it launches: the occupancy query raises that
// kernel's dynamic shared-memory limit.
using RingBwdFn = void (*)(const RowNormParams, const RowLaunch, float*, float*, int);
template <typename T, bool CLU, bool RMS, bool SREG = false, bool PROD = false>
RingBwdFn ring_bwd_fn_(int vpt, int stages) {
  if constexpr (!CLU) {
    if (stages == 3)
      return vpt == 3 ? &rownorm_bwd_ring_kernel<T, 3, false, 3, RMS, SREG, PROD>
                      : &rownorm_bwd_ring_kernel<T, kRingVecs, false, 3, RMS, SREG, PROD>;
  }
  return vpt == 3 ? &rownorm_bwd_ring_kernel<T, 3, CLU, kRingStages, RMS, SREG, PROD>
                  : &rownorm_bwd_ring_kernel<T, kRingVecs, CLU, kRingStages, RMS, SREG, PROD>;
}
// (prod: the producer-warp form, without scale registers)
template <typename T>
RingBwdFn ring_bwd_fn(int vpt, int stages, bool rms, bool cluster = false, bool sreg = false, bool prod = false) {
  if (cluster) return rms ? ring_bwd_fn_<T, true, true>(vpt, stages) : ring_bwd_fn_<T, true, false>(vpt, stages);
  if (prod) return rms ? ring_bwd_fn_<T, false, true, false, true>(vpt, stages) : ring_bwd_fn_<T, false, false, false, true>(vpt, stages);
  if (sreg) return rms ? ring_bwd_fn_<T, false, true, true>(vpt, stages) : ring_bwd_fn_<T, false, false, true>(vpt, stages);
  return rms ? ring_bwd_fn_<T, false, true>(vpt, stages) : ring_bwd_fn_<T, false, false>(vpt, stages);
}
template <typename T>
const void* ring_bwd_kernel(int vpt, int stages, bool rms, bool cluster = false, bool sreg = false, bool prod = false) {
  return reinterpret_cast<const void*>(ring_bwd_fn<T>(vpt, stages, rms, cluster, sreg, prod));
}
// Whether the ring may hold the scale in registers as raw T (set_rownorm_bwd_ring_sreg): the fp32 scale
// weight_offset + w is then exactly a T, so the same bits as from shared memory.
template <typename T>
bool ring_scale_exact(const RowNormParams& p) {
  return sizeof(T) == 4 || !p.w || (p.param == p.io && p.weight_offset == 0.f);
}

// The 2-vector cached backward kernel for (dtype, alignment, CTA size).
template <typename T>
const void* cached_bwd_kernel(bool aligned, bool big) {
  using K = void (*)(const RowNormParams, const RowLaunch, float*, float*);
  const K k = aligned ? (big ? &rownorm_bwd_cached_kernel<T, kBwdVecs, true, true> : &rownorm_bwd_cached_kernel<T, kBwdVecs, true, false>)
                      : (big ? &rownorm_bwd_cached_kernel<T, kBwdVecs, false, true> : &rownorm_bwd_cached_kernel<T, kBwdVecs, false, false>);
  return reinterpret_cast<const void*>(k);
}

// The one-row forward in clusters (rows past 4096 vectors, 16-bit): 8 vectors per thread, x packed, parameters after
// the sums, the first (half) vector's ahead; 257..512 threads at 2 CTAs per SM (64 registers), else up to 256 at 4.
// fp32: fp32 parameter vectors (F32P).
using Row1ClusterFn = void (*)(const RowNormParams, const int);
template <typename T>
Row1ClusterFn row1_cluster_kernel(bool f32_par, bool wide) {
  if constexpr (sizeof(T) == 2) {
    if (f32_par) {
      return wide ? &rownorm_fwd_row1_kernel<T, true, 8, 16, true, 16, true, 2, 1, true, true, true>
                  : &rownorm_fwd_row1_kernel<T, true, 8, 16, true, 8, true, 4, 1, true, true, true>;
    }
    return wide ? &rownorm_fwd_row1_kernel<T, true, 8, 16, true, 16, true, 2, 1, true, false, true>
                : &rownorm_fwd_row1_kernel<T, true, 8, 16, true, 8, true, 4, 1, true, false, true>;
  } else {  // fp32 rows: 8 vectors of 4 floats, the parameters the IO dtype's (set_rownorm_fwd_cluster_f32)
    (void)f32_par;
    return wide ? &rownorm_fwd_row1_kernel<T, true, 8, 16, true, 16, true, 2, 1, true, false, true>
                : &rownorm_fwd_row1_kernel<T, true, 8, 16, true, 8, true, 4, 1, true, false, true>;
  }
}
// Whether the cluster forward's parameters are fp32 vectors beside 16-bit rows (else the IO dtype's, or none).
inline bool row1_cluster_f32(const RowNormParams& p) { return p.io != DType::f32 && p.param == DType::f32 && (p.w || p.b); }

template <typename T>
RowPlan rownorm_plan(const RowNormParams& p, bool bwd) {
  constexpr int E = kVecElems<T>;
  RowPlan plan;
  const std::int64_t J = p.rows_per_group;
  plan.L.aligned = p.n % E == 0 && rows_aligned(p.x, p.x_rows, sizeof(T)) &&
                   (bwd ? rows_aligned(p.dy, p.dy_rows, sizeof(T)) && rows_aligned(p.dx, p.dx_rows, sizeof(T))
                        : rows_aligned(p.y, p.y_rows, sizeof(T)));
  const bool al = plan.L.aligned;
  // The ring and cached backward kernels index rows with RowIndexer::offset_lean (one multiply, or 32-bit
  // divisions): rows it cannot index (merged leading dims with 2^31 rows or more) take rowsum + coltile, as do
  // all rows where force_rownorm_bwd_general says so (tests)
  const bool bwd_fast = !bwd || (!rownorm_bwd_general() && p.x_rows.lean(p.rows) && p.dy_rows.lean(p.rows) &&
                                 p.dx_rows.lean(p.rows));
  const int ring_tpr = next_pow2((p.n + kRingVecs * E - 1) / (kRingVecs * E));
  // the ring's smem (up to 203 KB: bf16 N = 16384) must fit the device's opt-in limit (sm_80: 163 KB)
  const bool ring = bwd && bwd_fast && al && ring_tpr >= kRingMinTpr && p.n <= kRingMaxN<T> &&
                    ring_smem_bytes(p.n, E) <= smem_per_block_optin();
  // 3 vectors per thread where that idles fewer of a row group's threads than 4 (3 tpr3 < 4 tpr: N 6144 bf16
  // fills 256 x 3 where 4 leaves a quarter of 256 x 4 idle; set_rownorm_bwd_ring3, off: compiled, not measured)
  const int ring3_tpr = next_pow2((p.n + 3 * E - 1) / (3 * E));
  const bool ring3 = ring && rownorm_bwd_ring3() && ring3_tpr <= kRingThreads && 3 * ring3_tpr < 4 * ring_tpr;
  // The bulk-copy forward (Hopper): rows within kBulkMaxN with staged parameters; rows past it up to
  // twice it (set_rownorm_fwd_bulk_long), and those within it where forced
  // (force_rownorm_fwd_bulk_unstaged), with unstaged parameters (IO dtype with aligned rows, or none)
  // and 8 vectors per thread (long rows: 4 of 1024 threads where set_rownorm_fwd_bulk_long_wide
  // says so). Fills plan and returns true where it is taken.
  const bool unstaged_par = (p.param == p.io && p.param_aligned) || (!p.w && !p.b);
  const int long_mode = rownorm_fwd_bulk_long_mode(), hoist_mode = rownorm_fwd_bulk_hoist_mode();
  const bool few_rows = p.rows < 8 * std::int64_t(sm_count());  // fewer than 8 rows per SM
  const bool long_rows = !bwd && p.n > kBulkMaxN<T> && p.n <= 2 * kBulkMaxN<T> && unstaged_par &&
                         (long_mode == 2 || (long_mode == 1 && (!p.rms || !few_rows || hoist_mode != 0)));
  auto plan_bulk = [&]() {
    const bool unstaged = long_rows || (p.n <= kBulkMaxN<T> && rownorm_fwd_bulk_unstaged() && unstaged_par);
    if (!(al && (p.n <= kBulkMaxN<T> || long_rows) && rownorm_fwd_bulk_enabled() && cc_major() >= 9 &&
          kernel_binary_version(bulk_fwd_kernel<T>(kBulkVecs)) >= 90))
      return false;
    // as many row slots (<= kBulkMaxStages) as the shared memory holds, >= 2; 8 vectors per thread
    // where rows have >= 64 such threads (twice the row groups per SM) and the slots fit, else 4
    const int nt = long_rows && rownorm_fwd_bulk_long_wide() ? 1024 : kBulkThreads;
    const std::size_t budget = smem_per_block_optin() - 8 * (nt / 32) * sizeof(float) - 1024;
    int vpt = 0, tpr = 0, stages = 0;
    auto fits = [&](int v) {
      tpr = next_pow2((p.n / E + v - 1) / v);
      if (tpr > nt) return false;
      stages = kBulkMaxStages;
      while (stages >= 2 && bulk_smem_bytes(p.n, tpr, stages, v, !unstaged, nt) > budget) --stages;
      return stages >= 2;
    };
    const int forced = rownorm_fwd_bulk_vecs();
    if (unstaged && nt == 1024) vpt = fits(4) ? 4 : 0;
    else if (unstaged) vpt = fits(8) ? 8 : 0;
    else if ((forced == 8 || (forced == 0 && p.n / E >= 8 * 64)) && fits(8)) vpt = 8;
    else if (fits(kBulkVecs)) vpt = kBulkVecs;
    if (vpt == 0) return false;
    plan.cached = true;
    plan.bulk = true;
    plan.bulk_vecs = vpt;
    plan.bulk_staged = !unstaged;
    plan.bulk_hoist = unstaged && (nt == 1024 || hoist_mode == 2 || (hoist_mode == 1 && long_rows && few_rows));
    plan.stages = stages;
    plan.L.tpr = tpr;
    plan.threads = nt;
    plan.smem = bulk_smem_bytes(p.n, tpr, stages, vpt, !unstaged, nt);
    // P per group: one wave rounded down (a second partial wave of these one-per-SM CTAs cost head
    // norm's 16 groups 30%), at most the row groups the rows need
    const int R = nt / tpr;
    plan.L.P = ctas_per_unit(bulk_fwd_kernel<T>(vpt, !unstaged, nt, plan.bulk_hoist), plan.threads, plan.smem, p.groups,
                             (J + R - 1) / R);
    if (const int cap = rownorm_fwd_bulk_cta_cap(); cap > 0) plan.L.P = std::min(plan.L.P, cap);
    return true;
  };
  // the one-row kernel's raw-parameter instances: IO-dtype parameters with aligned rows, or none; its 4- and
  // 8-vector ones (raw4) also fp32 parameters with aligned rows, as vectors (set_rownorm_fwd_row1_f32par)
  const bool raw = (p.param != DType::f32 && p.param_aligned) || (!p.w && !p.b);
  const bool f32p = p.param == DType::f32 && p.param_aligned && rownorm_fwd_row1_f32par();
  const bool raw4 = raw || f32p;
  // ... except rows of 513..2048 vectors (N 4104..16384) from 8 rows per SM, which keep the bulk kernel: there
  // F32P was level or slower (session 41, H200, LayerNorm bf16 x 4096 rows, bulk / F32P ms: N 5120 0.0300 /
  // 0.0339, 8192 0.0420 / 0.0420, 12288 0.0659 / 0.0677, 16384 0.0850 / 0.0859), where at 512 rows it won 21-33%
  const bool raw4_mid = raw || (f32p && p.rows < 8 * std::int64_t(sm_count()));
  // a forced one-row shape (force_rownorm_fwd_row1_config), long rows included; true where taken
  auto forced_row1 = [&]() {
    const Row1Config fc = rownorm_fwd_row1_config();
    if (fc.tpr > 0 && sizeof(T) == 2 && al && rownorm_fwd_row1_enabled() && p.rows <= 0x7fffffff &&
        (p.n * 2) % fc.vb == 0) {  // forced shape (tests, A/B): vectors per thread follow (1, 2, 4 or 8)
      const std::int64_t nv = p.n * 2 / fc.vb, vpt = (nv + fc.tpr - 1) / fc.tpr;
      const bool plain_ok = !fc.plain || (fc.vb == 16 && fc.late && fc.tpr <= kRow1MaxTpr);
      // 4 or 8 vectors per thread: 16-byte vectors, raw parameters after the sums (A/B, session 37)
      // (4: up to 512 threads, 8: up to 256; twice that with every instance capped (mode 2): one CTA
      // per SM at 64 / 128 registers, where the uncapped 71 / 156 would not launch; 8 with x packed (rawx
      // modes 1, 2) is always capped)
      const bool all_capped = rownorm_fwd_row1_capped_mode() == 2 || (vpt == 8 && rownorm_fwd_row1_rawx_mode() >= 1);
      const int deep_max = (all_capped ? 4096 : 2048) / int(vpt);
      const bool deep_ok = vpt <= 2 || ((vpt == 4 || vpt == 8) && fc.tpr <= deep_max && raw && fc.vb == 16 &&
                                        fc.late && !fc.plain);
      if (deep_ok && nv > fc.tpr / 2 && plain_ok &&
          (raw || (fc.vb == 16 && !fc.late && !fc.plain && fc.tpr <= kRow1MaxTpr))) {
        plan.row1 = true, plan.row1_vecs = int(vpt), plan.row1_vb = fc.vb, plan.row1_late = fc.late;
        plan.row1_plain = fc.plain;
        plan.persistent = false;
        plan.L.tpr = plan.threads = fc.tpr;
        plan.L.P = int(p.rows);
        return true;
      }
    }
    return false;
  };
  if (!bwd && forced_row1()) {
    plan.cached = true;
    return plan;
  }
  // long rows: 8 x 512 capped (set_rownorm_fwd_row1_long; at one CTA per SM 5-16% ahead of the bulk kernel at
  // N = 32768 over 256..16384 rows, level at 24584 and 28672; x packed, 2 per SM, a further 5-19%; session 39)
  // and whole-warp 8 x 257..448 with x packed for N 16392..28672 (set_rownorm_fwd_row1_tight; session 40, H200,
  // bulk -> 8 x 288..448: 4096 x 18432 0.1321 -> 0.0851, 16384 x 20480 0.5112 -> 0.3380, 256 x 28672 0.0204 -> 0.0143)
  const std::int64_t nv8 = p.n / E;
  const bool long8 = rownorm_fwd_row1_long() && nv8 > 14 * kRow1MaxTpr && nv8 <= 16 * kRow1MaxTpr;
  const bool tight8_long = rownorm_fwd_row1_tight() && rownorm_fwd_row1_rawx_mode() >= 1 && nv8 > 8 * kRow1MaxTpr &&
                           nv8 <= 14 * kRow1MaxTpr;
  if (!bwd && sizeof(T) == 2 && al && raw4 && (long8 || tight8_long) && rownorm_fwd_row1_enabled() &&
      rownorm_fwd_row1_vecs() == 0 && p.rows <= 0x7fffffff && cc_major() >= 9) {
    plan.cached = true;
    plan.row1 = true, plan.row1_vecs = 8, plan.row1_late = true;
    plan.persistent = false;
    plan.L.tpr = plan.threads = long8 ? 2 * kRow1MaxTpr : int((nv8 + 8 * 32 - 1) / (8 * 32) * 32);
    plan.L.P = int(p.rows);
    return plan;
  }
  // the forward clusters' ranks per row of nv8 vectors: mode 1 ceil(nv8 / 4096), mode 2 ceil(nv8 / 2048) where that
  // is at most 8 (vectors per rank: 8 x 512, 8 x 256)
  auto fwd_cluster_ranks = [&](int mode) {
    const std::int64_t small_v = 8 * kRow1MaxTpr, big_v = 16 * kRow1MaxTpr;
    const std::int64_t small = (nv8 + small_v - 1) / small_v;
    return mode == 2 && small <= kFwdMaxCluster ? small : (nv8 + big_v - 1) / big_v;
  };
  // Rows past the one-row kernel's reach (4096 vectors: N > 32768) on Hopper: that kernel in clusters of C CTAs per
  // row (8 vectors x ceil(N / C / 8 / 32) warps each, x packed), the row's statistics merged through the peers'
  // shared memory (set_rownorm_fwd_cluster: mode 1 C = ceil(N / 4096 vectors), 2 C = ceil(N / 2048 vectors) <= 8),
  // instead of the streaming kernel's re-reads from L2. Every rank holds at least one vector: (C - 1) ceil(nv / C)
  // < nv for C (C - 1) < nv, and nv > 4096 here.
  // fp32 rows (set_rownorm_fwd_cluster_f32): the same past 4096 vectors of 4 floats (N > 16384, where the unstaged
  // bulk kernel stops), with aligned parameters or none. Session 43, H200, LayerNorm unless said, ms, streaming /
  // cluster: 512 x 16388 0.0369 / 0.0322, x 32768 0.0727 / 0.0518; 4096 x 20000 0.2946 / 0.2411, x 32768 0.5292 /
  // 0.3410; RMSNorm 256 x 20000 0.0212 / 0.0200, 512 x 65536 0.1256 / 0.0893.
  if (const int cl_mode = rownorm_fwd_cluster_mode();
      !bwd && al && (sizeof(T) == 2 ? raw4 : rownorm_fwd_cluster_f32() && (p.param_aligned || (!p.w && !p.b))) &&
      cl_mode >= 1 && nv8 > 16 * kRow1MaxTpr && rownorm_fwd_row1_enabled() && rownorm_fwd_row1_vecs() == 0 &&
      cc_major() >= 9) {
    const std::int64_t C = fwd_cluster_ranks(cl_mode);
    const std::int64_t per = (nv8 + C - 1) / C, threads = (per + 8 * 32 - 1) / (8 * 32) * 32;
    const void* kernel = reinterpret_cast<const void*>(row1_cluster_kernel<T>(row1_cluster_f32(p), threads > kRow1MaxTpr));
    const int clusters = C <= kFwdMaxCluster && kernel_binary_version(kernel) >= 90
                             ? resident_clusters(kernel, int(threads), 0, int(C)) : 0;
    if (clusters > 0 && p.rows * C <= 0x7fffffff) {
      plan.cached = true;
      plan.row1 = true, plan.row1_vecs = 8, plan.row1_late = true;
      plan.persistent = false;
      plan.cluster = int(C);
      plan.cl_cols = int(per * E);
      plan.L.tpr = plan.threads = int(threads);
      plan.L.P = int(p.rows);  // a cluster per row
      return plan;
    }
  }
  if (long_rows && plan_bulk()) return plan;
  // Aligned rows past the ring's reach (Hopper): the ring kernel in clusters of C = ceil(N / kRingMaxN) <= 8 CTAs,
  // each the same rows' N / C columns, exchanging the row sums through shared memory (set_rownorm_bwd_cluster),
  // instead of rowsum + coltile's two reads of x and dy. 3 vectors per thread where that idles fewer threads.
  // m times those CTAs per cluster (at most 8; set_rownorm_bwd_cluster_mult), rows within the ring's reach too: each
  // CTA then holds R = 512 / tpr row groups of narrower rows, so P (the weight-gradient partial rows per column,
  // which the finalize reads back) falls by up to m for the same rows in flight (512 x 32768 bf16: 66 -> 33 partial
  // rows of 128 KB per gradient, written and read back, beside x, dy and dx's 100 MB). The rule (m = 0): 2 up to 8
  // rows per SM on rows past 512 vectors, else 1. Session 43, H200, LayerNorm bf16 unless said, ms, m = 1 / 2:
  // 256 x 32768 0.0359 / 0.0335; 512 x 16384 0.0357 / 0.0305 (RMSNorm 0.0338 / 0.0287), x 32768 0.0518 / 0.0484
  // (RMSNorm 0.0473 / 0.0452), x 65536 0.0906 / 0.0837, x 8192 0.0222 / 0.0219, fp32 x 16384 0.0415 / 0.0397, fp32
  // x 32768 0.0679 / 0.0644; 1024 x 5120 0.0255 / 0.0240, x 8192 0.0310 / 0.0289, x 16384 0.0492 / 0.0450, x 32768
  // 0.0820 / 0.0804. Not at 512 x 4096 (0.0170 / 0.0173) nor from 2048 rows (2048 x 5120 0.0341 / 0.0351, x 16384
  // 0.0749 / 0.0739, x 32768 0.1416 / 0.1425; 4096 x 5120 0.0546 / 0.0580, x 12288 0.1109 / 0.1092, x 32768 0.2586 /
  // 0.2668). m = 4 was level with 2 or slower (512 x 16384 0.0318, 4096 x 5120 0.0624).
  const int cl_mult = rownorm_bwd_cluster_mult() > 0 ? rownorm_bwd_cluster_mult()
                      : p.rows <= 8 * std::int64_t(sm_count()) && p.n / E > 512 ? 2 : 1;
  if (bwd && bwd_fast && al && cc_major() >= 9 && rownorm_bwd_cluster() && (p.n > kRingMaxN<T> ? !ring : ring && cl_mult > 1)) {
    const std::int64_t nvec = p.n / E, maxv = std::int64_t(kRingThreads) * kRingVecs;
    // C: the ranks the row needs (past kRingMaxCluster: rowsum + coltile; clamping it would leave ranks of more
    // than 512 threads' vectors, R = 0), times m up to kRingMaxCluster
    const std::int64_t C_need = (nvec + maxv - 1) / maxv;
    const std::int64_t C = C_need > kRingMaxCluster ? 0 : std::min<std::int64_t>(kRingMaxCluster, C_need * std::max(cl_mult, 1));
    const int per = int((nvec + C - 1) / std::max<std::int64_t>(C, 1));  // vectors per rank
    const int t4 = next_pow2((per + kRingVecs - 1) / kRingVecs), t3 = next_pow2((per + 2) / 3);
    const bool use3 = rownorm_bwd_ring3() && t3 <= kRingThreads && 3 * t3 < 4 * t4;
    const int vpt = use3 ? 3 : kRingVecs, tpr = use3 ? t3 : t4, R = kRingThreads / tpr;
    const bool rms_k = p.rms && !p.db && rownorm_bwd_ring_rms();
    const void* kernel = ring_bwd_kernel<T>(vpt, kRingStages, rms_k, true);
    const std::size_t smem = ring_smem_bytes(std::int64_t(per) * E, E, vpt, R);
    // (C (C - 1) < nvec: every rank holds at least one vector; tpr >= kRingMinTpr: the ring's shortest rows)
    if (C >= 2 && C <= kRingMaxCluster && tpr >= kRingMinTpr && tpr <= kRingThreads && smem <= smem_per_block_optin() &&
        kernel_binary_version(kernel) >= 90) {
      if (const int clusters = resident_clusters(kernel, kRingThreads, smem, int(C)); clusters > 0) {
        plan.cached = true;
        plan.ring = true;
        plan.cluster = int(C);
        plan.cl_cols = per * E;
        plan.ring_vecs = vpt;
        plan.ring_rms = rms_k;
        plan.L.stat_mask = rownorm_bwd_ring_wstat() ? ~31 : ~0;
        plan.L.tpr = tpr;
        plan.threads = kRingThreads;
        plan.smem = smem;
        // clusters per group: one wave of them rounded down, at most the row groups the rows need
        plan.L.P = int(std::max<std::int64_t>(1, std::min<std::int64_t>((J + R - 1) / R, clusters / p.groups)));
        return plan;
      }
    }
  }
  const std::int64_t cached_max = bwd ? kCachedMaxNBwd<T> : kCachedMaxNFwd<T>;
  if ((p.n <= cached_max || ring) && bwd_fast) {
    plan.cached = true;
    if (!bwd) {
      // aligned 16-bit rows of 33..256 vectors (N 264..2048) in small problems: one row per CTA
      // (P = rows in all), one vector per thread up to 128 vectors, two beyond (128 threads). Small:
      // at most 4 rows per row group of the 4-vector bulk kernel (4096 x 2048 bf16). Measured against
      // the bulk kernel (H200, fastweight_bench, ms, bulk / one vector / two vectors): 4096 x 512
      // 0.0097 / 0.0073, 4096 x 1024 0.0115 / 0.0096 / 0.0099, 4096 x 2048 0.0171 / 0.0158 / 0.0151,
      // 2048 x 2048 0.0120 / 0.0100 / 0.0098, (1024, 16, 512) head norm 0.0164 / 0.0161; slower with
      // more rows per group (32768 x 1024 0.0431 / 0.0457, 32768 x 2048 0.0797 / 0.0896), at N = 4096
      // (0.0243 / 0.0287 with 512 threads / 0.0267 with 256) and for fp32 (4096 x 1024 0.0157 / 0.0179).
      // Session 17 (H200, fastweight_bench, ms): the raw parameters loaded after the sums (FLA's order)
      // instead of with x: 4096 x 2048 (2 vectors, 128 threads) 0.0159 -> 0.0143, 4096 x 1024 0.0104
      // -> 0.0100 (with x, two vectors per thread took 57-59 registers); and with that, rows of up to
      // 512 vectors (2 per thread, 256 threads) on Hopper where the bulk kernel's row groups would get
      // at most 8 rows: 4096 x 4096 0.0243 (bulk) -> 0.0235; not at 32768 x 4096 (0.1439 bulk ->
      // 0.1449). 512 or 1024 threads per row (FLA's shape) and 8-byte vectors were slower everywhere
      // (4096 x 2048 with 512 threads of 8 bytes: 0.0258; 4096 x 8192: 0.0556-0.0652 against 0.0416).
      // Session 37 (H200, ms, 256 threads x 2 vectors / 128 x 4): rows of 385..512 vectors with raw
      // parameters take 4 vectors per thread: LayerNorm bf16 2048 x 4096 0.0149 / 0.0145, 4096 x 4096
      // 0.0236 / 0.0228, 8192 x 4096 (bulk) 0.0411 / 0.0389; fp16 4096 x 4096 0.0269 / 0.0237; RMSNorm
      // 4096 x 4096 0.0228 / 0.0221. Not at 64 x 4 for 4096 x 2048 (0.0144 / 0.0146); 8 per thread lost
      // (4096 x 4096 with 64 threads 0.0274, 4096 x 8192 with 128 0.0491).
      // Session 38 (H200, ms, bulk / 4 x 256 with registers capped at 64, set_rownorm_fwd_row1_capped):
      // rows of 769..1024 vectors with raw parameters in one wave of it (4 CTAs per SM) or from 24 rows
      // per SM: LayerNorm bf16 x 8192 at 512 rows 0.0124 / 0.0099, 4096 0.0418 / 0.0408 (uncapped
      // 0.0425), 8192 0.0771 / 0.0753, 16384 0.1438 / 0.1410, 32768 0.2833 / 0.2740; fp16 4096 0.0416
      // / 0.0408; RMSNorm 4096 0.0406 / 0.0399. Not between (1024 rows 0.0157 / 0.0161, 2048 0.0239 /
      // 0.0241, RMSNorm 1024 0.0144 / 0.0154), nor on shorter rows, whose CTAs idle threads (4096 x
      // 6144 0.0339 / 0.0354, x 5120 0.0298 / 0.0331); level on adaLN 4 x 1024 x 8192 (0.0426). 8 x 256
      // capped at 128 registers lost at 4096 x 16384 (0.0799 bulk / 0.0849; uncapped 0.1212). Rows of
      // 1537..2048 vectors at most 4 per SM: 4 x 512 capped at 64 registers (2 CTAs per SM): 512 x 16384
      // 0.0188 / 0.0165 (8 x 256 capped 0.0167); not at 4096 rows (0.0797 / 0.0823).
      const int nvec = int(p.n / E), forced1 = rownorm_fwd_row1_vecs();
      const bool deep1 = forced1 == 0 && raw4 && nvec > 3 * kRow1MaxTpr / 2 && nvec <= 2 * kRow1MaxTpr;
      const std::int64_t sms = sm_count();
      const bool capped_ok = forced1 == 0 && raw4_mid && rownorm_fwd_row1_capped_mode() >= 1;
      const bool deep_cap = capped_ok && ((nvec > 3 * kRow1MaxTpr && nvec <= 4 * kRow1MaxTpr &&
                                           (p.rows <= 4 * sms || p.rows >= 24 * sms)) ||
                                          (nvec > 6 * kRow1MaxTpr && nvec <= 8 * kRow1MaxTpr && p.rows <= 4 * sms));
      // rows of 1793..2048 vectors (N 14344..16384) from 2 rows per SM on: 8 x 256 with x packed, 4 CTAs per
      // SM (set_rownorm_fwd_row1_rawx; session 39, x 16384: 4096 rows 0.0798 bulk -> 0.0741, 16384 0.2828 ->
      // 0.2685, RMSNorm 4096 0.0779 -> 0.0716; 512 rows 0.0161 (4 x 512) -> 0.0148; not at 256 rows: 0.0098
      // (4 x 512) / 0.0112, whose rows keep the 4 x 512 rule above)
      const bool deep8 = capped_ok && rownorm_fwd_row1_rawx_mode() >= 1 && cc_major() >= 9 &&
                         nvec > 7 * kRow1MaxTpr && nvec <= 8 * kRow1MaxTpr && p.rows > 2 * sms;
      // whole-warp CTAs (set_rownorm_fwd_row1_tight): threads rounded up to a multiple of 32, not a power of
      // two; on Hopper 513..768 vectors (N 4104..6144) in 4 x 129..192 and 1025..2048 (N 8200..16384) in 8 x
      // 129..256 with x packed, where no rule above takes them (session 40, H200: 4096 x 2560 0.0204 ->
      // 0.0168, 4 x 160 at 4096 x 5120 0.0300 -> 0.0279, 8 x 160 at 16384 x 9216 0.1761 -> 0.1535, 8 x 224
      // at 4096 x 14336 0.0766 -> 0.0658; longer rows: above; see norm_cuda.h)
      const bool tight = forced1 == 0 && rownorm_fwd_row1_tight() && cc_major() >= 9;  // (measured on Hopper only)
      const bool tight4 = tight && raw4_mid && nvec > 2 * kRow1MaxTpr && nvec <= 3 * kRow1MaxTpr;
      const bool tight8 = tight && capped_ok && rownorm_fwd_row1_rawx_mode() >= 1 && !deep_cap &&
                          !deep8 && nvec > 4 * kRow1MaxTpr && nvec <= 8 * kRow1MaxTpr;
      const int vpt1 = deep8 || tight8                ? 8
                       : deep1 || deep_cap || tight4 ? 4
                       : forced1 == 2 || (forced1 == 0 && nvec > 128) ? 2
                                                                       : 1;
      const int per_thread = (nvec + vpt1 - 1) / vpt1;
      const int tpr1 = tight ? (per_thread + 31) / 32 * 32 : next_pow2(per_thread);
      const std::int64_t bulk_groups = sms * (kBulkThreads / next_pow2((nvec + 3) / 4));
      const bool wide_rows = nvec > kRow1MaxTpr;  // 257..512 vectors: Hopper, against the bulk kernel
      if (sizeof(T) == 2 && al && nvec > 32 &&
          nvec <= (forced1 ? vpt1 : deep_cap || deep8 || tight8 ? 8 : tight4 ? 3 : wide_rows ? 2 : 1) * kRow1MaxTpr &&
          rownorm_fwd_row1_enabled() && p.rows <= 0x7fffffff &&  // a CTA per row, 32-bit rows
          (forced1 != 0 ||
           (wide_rows ? cc_major() >= 9 && (deep_cap || deep8 || tight4 || tight8 ||
                                            p.rows <= (deep1 ? 16 : 8) * bulk_groups)
                      : p.rows <= 4 * bulk_groups))) {
        plan.row1 = true;
        plan.row1_vecs = vpt1;
        plan.row1_late = true;
        plan.persistent = false;
        plan.L.tpr = plan.threads = tpr1;
        plan.L.P = int(p.rows);
        return plan;
      }
      if (plan_bulk()) return plan;
      plan.L.tpr = next_pow2((p.n + kFwdVecs * E - 1) / (kFwdVecs * E));
      plan.threads = std::max(plan.L.tpr, kSmallCta);
      const int tpr_row = next_pow2((p.n + kRowFwdVecs * E - 1) / (kRowFwdVecs * E));
      if (tpr_row <= kRowFwdMaxTpr) {  // short rows: one row group per CTA
        plan.persistent = false;
        plan.L.tpr = tpr_row;
        plan.threads = kSmallCta;
        const int R = plan.threads / plan.L.tpr;  // rows in memory order over all groups (see the kernel)
        const std::int64_t blocks = std::max<std::int64_t>(1, (p.rows + R - 1) / R);
        if (blocks > 0x7fffffff) throw Error(cat("rownorm_fwd: grid of ", blocks, " CTAs is too large"));
        plan.L.P = int(blocks);
        return plan;
      }
      const int R = plan.threads / plan.L.tpr;
      // scale and bias staged in shared memory (at most 2 x 16384 floats, 128 KB: one CTA of kMaxTpr
      // per SM; 64 KB at most for the 256-thread CTAs, three per SM)
      plan.smem = 2 * std::size_t((p.n + E - 1) / E * E) * sizeof(float);
      plan.L.P = ctas_per_unit(fwd_cached_kernel<T>(al, plan.threads > kSmallCta), plan.threads, plan.smem, p.groups,
                               (J + R - 1) / R);
      return plan;
    }
    if (ring) {  // the ring kernel: 512 threads, 4 (or 3) vectors per thread, R row groups
      plan.ring = true;
      plan.ring_vecs = ring3 ? 3 : kRingVecs;
      plan.L.tpr = ring3 ? ring3_tpr : ring_tpr;
      if (const int tight = rownorm_bwd_ring_tight(); tight >= 1) {
        // whole-warp row groups of 4 or 3 vectors (set_rownorm_bwd_ring_tight): the most groups per CTA, then the
        // fewest idle vector slots, then the most threads; mode 1 where that is more groups than the power-of-two
        // shape's, mode 2 also as many groups with fewer idle slots
        const std::int64_t nvec = p.n / E;
        int best_r = kRingThreads / plan.L.tpr;
        std::int64_t best_idle = std::int64_t(plan.L.tpr) * plan.ring_vecs - nvec;
        for (const int v : {kRingVecs, 3}) {
          const int t = int((nvec + 32 * v - 1) / (32 * v) * 32), r = kRingThreads / std::max(t, 1);
          const std::int64_t idle = std::int64_t(t) * v - nvec;
          const bool same = r == best_r && (plan.ring_tight || tight == 2);  // (mode 1: past the power of two)
          if (t < kRingMinTpr || t > kRingThreads ||
              !(r > best_r || (same && (idle < best_idle || (idle == best_idle && t > plan.L.tpr)))))
            continue;
          plan.ring_tight = true, plan.ring_vecs = v, plan.L.tpr = t, best_r = r, best_idle = idle;
        }
      }
      const int R = kRingThreads / plan.L.tpr;
      plan.threads = R * plan.L.tpr;  // (512, or fewer whole-warp groups)
      plan.ring_rms = p.rms && !p.db && rownorm_bwd_ring_rms();
      // 3 row slots per group (set_rownorm_bwd_ring_stages): the rule, where a CTA holds one row group, but the
      // RMSNorm instance's group of 512 threads (3 vectors: bf16 / fp16 N 11528..12288, fp32 5764..6144), where 2
      // slots ran 2.1-2.7% faster (session 52, H200, RMSNorm 4096 x 12288 bf16 0.0891 / 0.0868, fp16 0.0887 /
      // 0.0868, fp32 x 6144 0.0878 / 0.0856); its 384 x 3 group (bf16 N 9216) kept 3 (2 slots: +1.6%)
      const int stages_mode = rownorm_bwd_ring_stages();
      const bool rule3 = R == 1 && !(plan.ring_rms && plan.L.tpr == kRingThreads);
      if ((stages_mode == 3 || (stages_mode == 0 && rule3)) &&
          ring_smem_bytes(p.n, E, plan.ring_vecs, 0, 3) <= smem_per_block_optin())
        plan.ring_stages = 3;
      plan.smem = ring_smem_bytes(p.n, E, plan.ring_vecs, 0, plan.ring_stages);
      // scale registers (set_rownorm_bwd_ring_sreg): mode 1, the generic 16-bit instance of 3 vectors and 3 slots
      // (one row group per CTA: bf16 N 8200..12288; 128 registers without spills, where the 4-vector ones spill
      // 68-124 bytes), mode 2 wherever exact
      const int sreg = rownorm_bwd_ring_sreg();
      plan.ring_sreg = ring_scale_exact<T>(p) &&
                       (sreg == 2 || (sreg == 1 && sizeof(T) == 2 && !plan.ring_rms && plan.ring_vecs == 3 &&
                                      plan.ring_stages == 3));
      // (the statistics once per warp, except the RMSNorm instance's 4 x 512 row groups: 3.5% slower there, twice,
      // at bf16 4096 x 16384 in session 51; the only shape measured slower)
      plan.L.stat_mask = rownorm_bwd_ring_wstat() && !(plan.ring_rms && plan.ring_vecs == 4 && plan.L.tpr == kRingThreads) ? ~31 : ~0;
      // The producer-warp form (set_rownorm_bwd_ring_prod, forced: A/B): whole-warp row groups of 4 or 3 vectors
      // within 480 consumer threads, the most groups, then the fewest idle slots, then the most threads; 3 row
      // slots where they fit (the slots' stride is the consumers' count), else 2.
      if (rownorm_bwd_ring_prod() != 0 && cc_major() >= 9 &&
          kernel_binary_version(ring_bwd_kernel<T>(kRingVecs, kRingStages, false, false, false, true)) >= 90) {
        const std::int64_t nvec = p.n / E;
        int best_v = 0, best_t = 0, best_r = 0;
        std::int64_t best_idle = 0;
        for (const int v : {kRingVecs, 3}) {
          const int t = std::max(kRingMinTpr, int((nvec + 32 * v - 1) / (32 * v) * 32)), r = kRingProdConsumers / t;
          const std::int64_t idle = std::int64_t(t) * v - nvec;
          if (t > kRingProdConsumers || r < 1) continue;
          if (r > best_r || (r == best_r && (idle < best_idle || (idle == best_idle && t > best_t))))
            best_v = v, best_t = t, best_r = r, best_idle = idle;
        }
        if (best_r >= 1) {
          const int st = ring_smem_bytes(p.n, E, best_v, 0, 3, best_r * best_t, best_r) <= smem_per_block_optin() ? 3 : 2;
          const std::size_t smem = ring_smem_bytes(p.n, E, best_v, 0, st, best_r * best_t, best_r);
          if (smem <= smem_per_block_optin()) {
            plan.ring_prod = true, plan.ring_sreg = false, plan.ring_tight = true;
            plan.ring_vecs = best_v, plan.ring_stages = st, plan.L.tpr = best_t;
            plan.threads = best_r * best_t + 32, plan.smem = smem;
            plan.L.P = ctas_per_unit(ring_bwd_kernel<T>(best_v, st, plan.ring_rms, false, false, true), plan.threads,
                                     plan.smem, p.groups, (J + best_r - 1) / best_r);
            return plan;
          }
        }
      }
      plan.L.P = ctas_per_unit(ring_bwd_kernel<T>(plan.ring_vecs, plan.ring_stages, plan.ring_rms, false, plan.ring_sreg),
                               plan.threads, plan.smem, p.groups,
                               (J + R - 1) / R);
      return plan;
    }
    plan.L.tpr = next_pow2((p.n + kBwdVecs * E - 1) / (kBwdVecs * E));
    plan.threads = std::max(plan.L.tpr, kSmallCta);
    const int R = plan.threads / plan.L.tpr;
    // scale (N, padded to whole vectors), reduction scratch, and with several rows per CTA the
    // fixed-order combine of the partials; aligned rows: the cp.async stages (x, dy, mean/rstd)
    const std::size_t red = 2 * (plan.threads / 32) + 2;
    const std::size_t n_pad = std::size_t((p.n + E - 1) / E * E);
    plan.smem = sizeof(float) * (red + n_pad + partials_comb_floats(R, p.n, E, al));
    plan.L.stat_mask = rownorm_bwd_ring_wstat() && al ? ~(std::min(plan.L.tpr, 32) - 1) : ~0;
    if (al) plan.smem += std::size_t(kStages) * plan.threads * (2 * kBwdVecs * sizeof(uint4) + 2 * sizeof(float));
    plan.L.P = ctas_per_unit(cached_bwd_kernel<T>(al, plan.threads > kSmallCta), plan.threads, plan.smem, p.groups,
                             (J + R - 1) / R);
    return plan;
  }
  plan.cached = false;
  if (!bwd) {
    plan.L.tpr = plan.threads = 512;
    const void* kernel = al ? reinterpret_cast<const void*>(&rownorm_fwd_stream_kernel<T, true>)
                            : reinterpret_cast<const void*>(&rownorm_fwd_stream_kernel<T, false>);
    plan.L.P = ctas_per_unit(kernel, plan.threads, 0, p.groups, J);
    return plan;
  }
  plan.rs.aligned = al;
  plan.rs.tpr = 512;
  const void* rs_kernel = al ? reinterpret_cast<const void*>(&rownorm_bwd_rowsum_kernel<T, true>)
                             : reinterpret_cast<const void*>(&rownorm_bwd_rowsum_kernel<T, false>);
  plan.rs.P = ctas_per_unit(rs_kernel, 512, 0, p.groups, J);
  plan.threads = 256;  // coltile: 256 threads x one 16-byte vector = 2048 (16-bit) / 1024 (fp32) columns
  plan.L.tpr = 256;
  plan.tiles = int((p.n + std::int64_t(plan.threads) * E - 1) / (std::int64_t(plan.threads) * E));
  const void* ct_kernel = al ? reinterpret_cast<const void*>(&rownorm_bwd_coltile_kernel<T, true>)
                             : reinterpret_cast<const void*>(&rownorm_bwd_coltile_kernel<T, false>);
  plan.L.P = ctas_per_unit(ct_kernel, plan.threads, 0, p.groups * plan.tiles, J);
  return plan;
}

// Parameters (w, b) can be read as 16-byte vectors when every group's row of them is aligned.
template <typename T>
RowNormParams with_param_alignment(const RowNormParams& p_in) {
  constexpr int E = kVecElems<T>;
  RowNormParams p = p_in;
  const std::int64_t psize = p.param == DType::f32 ? 4 : std::int64_t(sizeof(T));
  auto ok = [&](const void* base, std::int64_t gstride) {
    return base == nullptr || (reinterpret_cast<std::uintptr_t>(base) % 16 == 0 &&
                               (p.groups == 1 || (gstride * psize) % 16 == 0));
  };
  p.param_aligned = p.n % E == 0 && ok(p.w, p.w_group_stride) && ok(p.b, p.b_group_stride);
  return p;
}

template <int V> using IC = std::integral_constant<int, V>;  // (compile-time instance arguments)

template <typename T>
void rownorm_fwd_launch(const RowNormParams& p_in, cudaStream_t stream) {
  const RowNormParams p = with_param_alignment<T>(p_in);
  const RowPlan plan = rownorm_plan<T>(p, false);
  // the short-row kernel's grid covers all rows (P = CTAs in total), the others P per group
  const std::int64_t blocks = std::int64_t(plan.L.P) * (plan.cached && !plan.persistent ? 1 : p.groups);
  if (blocks > 0x7fffffff) throw Error(cat("rownorm_fwd: grid of ", blocks, " CTAs is too large"));
  const unsigned grid = unsigned(blocks);
  note_rownorm_fwd_kernel(plan.row1 && plan.cluster > 1 ? "row1_cluster"
                          : plan.row1                    ? "row1"
                          : plan.bulk && !plan.bulk_staged && plan.threads == 1024 ? "bulk_unstaged_1024"
                          : plan.bulk && !plan.bulk_staged && plan.bulk_hoist ? "bulk_unstaged_hoist"
                          : plan.bulk && !plan.bulk_staged ? "bulk_unstaged"
                          : plan.bulk                      ? "bulk"
                          : plan.cached && !plan.persistent ? "row"
                          : plan.cached                    ? "cached"
                                                           : "stream");
  if (plan.row1 && plan.cluster > 1) {  // a cluster of C CTAs per row
    const std::int64_t cblocks = std::int64_t(plan.L.P) * plan.cluster;
    if (cblocks > 0x7fffffff) throw Error(cat("rownorm_fwd: grid of ", cblocks, " CTAs is too large"));
    launch_kernel_cluster("rownorm_fwd", row1_cluster_kernel<T>(row1_cluster_f32(p), plan.threads > kRow1MaxTpr),
                          dim3(unsigned(cblocks)), dim3(plan.threads), 0, stream, false, unsigned(plan.cluster), p,
                          plan.cl_cols);
  } else if (plan.row1) {
    if constexpr (sizeof(T) == 2) {
      // planned for 16-bit rows only; every instance below through one launch
      auto launch1 = [&](auto kernel) { kernel<<<grid, plan.threads, 0, stream>>>(p, 0); };
      const bool raw_par = (p.param != DType::f32 && p.param_aligned) || (!p.w && !p.b);
      const bool f32_par = p.param == DType::f32 && p.param_aligned;
      const bool wide = plan.threads > kRow1MaxTpr;
      // the 4- and 8-vector instances: <VPT, warp slots, CTAs per SM (0: uncapped; else registers capped,
      // set_rownorm_fwd_row1_capped)>, their parameters all loaded after the sums or one vector ahead of
      // the output (set_rownorm_fwd_row1_prefetch: mode 1 the 4-vector instances, 2 all)
      // (and x kept packed, set_rownorm_fwd_row1_rawx: mode 2 the 4-vector instances, parameters one ahead).
      // F32P: fp32 parameters (set_rownorm_fwd_row1_f32par), always half a vector ahead, 8 vectors always x packed
      // (all at once they spill 1040 B at 64 registers; ptxas, sm_90a, bf16).
      auto deep_row1 = [&](auto f32p) {
        constexpr bool F = decltype(f32p)::value;
        const int pf_mode = rownorm_fwd_row1_prefetch_mode(), rx_mode = rownorm_fwd_row1_rawx_mode();
        auto deep = [&](auto vpt, auto w, auto minb) {
          constexpr int V = decltype(vpt)::value, Wv = decltype(w)::value, M = decltype(minb)::value;
          if constexpr (F) {
            static_assert(V == 4, "F32P: 8 vectors run x packed (rx8)");
            launch1(&rownorm_fwd_row1_kernel<T, true, V, 16, true, Wv, true, M, 1, false, true>);
            return;
          } else {
            if constexpr (V == 4) {
              if (rx_mode == 2) {
                launch1(&rownorm_fwd_row1_kernel<T, true, V, 16, true, Wv, true, M, 1, true>);
                return;
              }
            }
            if (pf_mode == 2 || (pf_mode == 1 && V == 4)) launch1(&rownorm_fwd_row1_kernel<T, true, V, 16, true, Wv, true, M, 1>);
            else launch1(&rownorm_fwd_row1_kernel<T, true, V, 16, true, Wv, true, M>);
          }
        };
        // capped: every 4- and 8-vector instance in mode 2, the planner's 4 x 256 and 4 x 512 in mode 1,
        // and 8 x 512 and 4 x 1024 always (one CTA per SM, FLA's N = 32768 shape: uncapped, their 156 /
        // 71 registers per thread would not launch)
        const int cap_mode = rownorm_fwd_row1_capped_mode();
        const bool small = plan.threads <= 128, one_per_sm = plan.threads * plan.row1_vecs > 8 * kRow1MaxTpr;
        const bool rx8_on = F || rx_mode >= 1;
        const bool auto_cap = cap_mode == 1 && ((plan.row1_vecs == 4 && (plan.threads == kRow1MaxTpr ||
                                                                         plan.threads == 2 * kRow1MaxTpr)) ||
                                                (plan.row1_vecs == 8 && rx8_on));
        const bool cap = plan.row1_vecs >= 4 && (cap_mode == 2 || one_per_sm || auto_cap);
        auto four = [&] {
          if (cap) {
            if (small) deep(IC<4>{}, IC<4>{}, IC<8>{});
            else if (plan.threads > 2 * kRow1MaxTpr) deep(IC<4>{}, IC<32>{}, IC<1>{});
            else if (wide) deep(IC<4>{}, IC<16>{}, IC<2>{});
            else deep(IC<4>{}, IC<8>{}, IC<4>{});
          } else {
            wide ? deep(IC<4>{}, IC<16>{}, IC<0>{}) : deep(IC<4>{}, IC<8>{}, IC<0>{});
          }
        };
        // the capped 8-vector instances with x packed at twice the CTAs per SM (rawx modes 1, 2): 64 registers
        auto rx8 = [&](auto w, auto minb) {
          launch1(&rownorm_fwd_row1_kernel<T, true, 8, 16, true, decltype(w)::value, true, decltype(minb)::value, 1, true, F>);
        };
        if (plan.row1_vecs == 8 && (F || (cap && rx_mode >= 1))) {
          if (small) rx8(IC<4>{}, IC<8>{});
          else if (wide) rx8(IC<16>{}, IC<2>{});
          else rx8(IC<8>{}, IC<4>{});
        } else if constexpr (!F) {
          if (cap && plan.row1_vecs == 8) {
            if (small) deep(IC<8>{}, IC<4>{}, IC<4>{});
            else if (wide) deep(IC<8>{}, IC<16>{}, IC<1>{});
            else deep(IC<8>{}, IC<8>{}, IC<2>{});
          } else if (plan.row1_vecs == 8) {
            deep(IC<8>{}, IC<8>{}, IC<0>{});  // forced only
          } else {
            four();
          }
        } else {
          four();
        }
      };
      if (raw_par && plan.row1_plain) {  // forced: 16-byte vectors, late, <= 256 threads
        if (plan.row1_vecs == 2) launch1(&rownorm_fwd_row1_kernel<T, true, 2, 16, true, 8, false>);
        else launch1(&rownorm_fwd_row1_kernel<T, true, 1, 16, true, 8, false>);
      } else if (raw_par && (plan.row1_vb != 16 || plan.row1_late || wide)) {
        // the planner's instances (16-byte vectors, parameters after the sums) and the forced shapes
        // (force_rownorm_fwd_row1_config): vector bytes, parameter order, warp slots
        auto go = [&](auto vpt, auto vb, auto late, auto w) {
          launch1(&rownorm_fwd_row1_kernel<T, true, decltype(vpt)::value, decltype(vb)::value, decltype(late)::value,
                                  decltype(w)::value>);
        };
        using L0 = std::false_type;
        using L1 = std::true_type;
        // (W: warp slots = the CTA bound / 32; 16 at 512 threads: 128 registers, W32's bound: 64)
        auto by_w = [&](auto vpt, auto vb, auto late) { wide ? go(vpt, vb, late, IC<32>{}) : go(vpt, vb, late, IC<8>{}); };
        auto by_late = [&](auto vpt, auto vb) { plan.row1_late ? by_w(vpt, vb, L1{}) : by_w(vpt, vb, L0{}); };
        auto by_vb = [&](auto vpt) { plan.row1_vb == 8 ? by_late(vpt, IC<8>{}) : by_late(vpt, IC<16>{}); };
        if (plan.row1_vecs >= 4) deep_row1(std::false_type{});
        else plan.row1_vecs == 2 ? by_vb(IC<2>{}) : by_vb(IC<1>{});
      } else if (f32_par && (plan.row1_vecs >= 4 || (rownorm_fwd_row1_f32par() && plan.row1_late && !wide))) {
        // fp32 parameters as vectors (set_rownorm_fwd_row1_f32par; the planner's 1- and 2-vector shapes take them
        // only where it is on, else, and for forced shapes with the parameters loaded with x, load_params_vec's
        // per-element loads below), half a vector ahead
        if (plan.row1_vecs >= 4) deep_row1(std::true_type{});
        else if (plan.row1_vecs == 2) launch1(&rownorm_fwd_row1_kernel<T, true, 2, 16, true, 8, true, 0, 1, false, true>);
        else launch1(&rownorm_fwd_row1_kernel<T, true, 1, 16, true, 8, true, 0, 1, false, true>);
      } else if (plan.row1_vecs > 2) {  // (the planner takes 4 and 8 with raw or fp32-vector parameters only)
        throw Error(cat("rownorm_fwd: no one-row instance of ", plan.row1_vecs, " vectors for these parameters"));
      } else if (plan.row1_vecs == 2) {
        if (raw_par) launch1(&rownorm_fwd_row1_kernel<T, true, 2>);
        else launch1(&rownorm_fwd_row1_kernel<T, false, 2>);
      } else {
        if (raw_par) launch1(&rownorm_fwd_row1_kernel<T, true, 1>);
        else launch1(&rownorm_fwd_row1_kernel<T, false, 1>);
      }
    }
  } else if (plan.bulk) {
    if (!plan.bulk_staged && plan.threads == 1024)
      rownorm_fwd_bulk_kernel<T, 4, false, 1024, true><<<grid, plan.threads, plan.smem, stream>>>(p, plan.L, plan.stages);
    else if (!plan.bulk_staged && plan.bulk_hoist)
      rownorm_fwd_bulk_kernel<T, 8, false, kBulkThreads, true><<<grid, plan.threads, plan.smem, stream>>>(p, plan.L, plan.stages);
    else if (!plan.bulk_staged) rownorm_fwd_bulk_kernel<T, 8, false><<<grid, plan.threads, plan.smem, stream>>>(p, plan.L, plan.stages);
    else if (plan.bulk_vecs == 8) rownorm_fwd_bulk_kernel<T, 8><<<grid, plan.threads, plan.smem, stream>>>(p, plan.L, plan.stages);
    else rownorm_fwd_bulk_kernel<T, kBulkVecs><<<grid, plan.threads, plan.smem, stream>>>(p, plan.L, plan.stages);
  } else if (plan.cached && !plan.persistent) {
    if (plan.L.aligned) rownorm_fwd_row_kernel<T, kRowFwdVecs, true><<<grid, plan.threads, 0, stream>>>(p, plan.L);
    else rownorm_fwd_row_kernel<T, kRowFwdVecs, false><<<grid, plan.threads, 0, stream>>>(p, plan.L);
  } else if (plan.cached) {
    const bool big = plan.threads > kSmallCta;
    const std::size_t sm = plan.smem;
    if (plan.L.aligned && big) rownorm_fwd_cached_kernel<T, kFwdVecs, true, true><<<grid, plan.threads, sm, stream>>>(p, plan.L);
    else if (plan.L.aligned) rownorm_fwd_cached_kernel<T, kFwdVecs, true, false><<<grid, plan.threads, sm, stream>>>(p, plan.L);
    else if (big) rownorm_fwd_cached_kernel<T, kFwdVecs, false, true><<<grid, plan.threads, sm, stream>>>(p, plan.L);
    else rownorm_fwd_cached_kernel<T, kFwdVecs, false, false><<<grid, plan.threads, sm, stream>>>(p, plan.L);
  } else if (plan.L.aligned) {
    rownorm_fwd_stream_kernel<T, true><<<grid, plan.threads, 0, stream>>>(p, plan.L);
  } else {
    rownorm_fwd_stream_kernel<T, false><<<grid, plan.threads, 0, stream>>>(p, plan.L);
  }
  FW_CUDA_CHECK_LAUNCH("rownorm_fwd");
}

struct BwdWorkspace {
  std::size_t partial_bytes = 0, rowsum_bytes = 0;
  std::size_t total() const { return partial_bytes * 2 + rowsum_bytes; }
};
inline std::size_t align256(std::size_t b) { return (b + 255) / 256 * 256; }

template <typename T>
BwdWorkspace rownorm_bwd_layout(const RowNormParams& p, const RowPlan& plan) {
  BwdWorkspace w;
  w.partial_bytes = align256(std::size_t(plan.L.P) * std::size_t(p.groups) * std::size_t(p.n) * sizeof(float));
  if (!p.dw && !p.db) w.partial_bytes = 0;
  if (!plan.cached) w.rowsum_bytes = align256(std::size_t(p.rows) * sizeof(float2));
  return w;
}

template <typename T>
std::size_t rownorm_bwd_workspace(const RowNormParams& p) {
  const RowPlan plan = rownorm_plan<T>(p, true);
  const BwdWorkspace w = rownorm_bwd_layout<T>(p, plan);
  return (p.dw ? w.partial_bytes : 0) + (p.db ? w.partial_bytes : 0) + w.rowsum_bytes;
}

// The ring's name for rownorm_bwd_last_kernel: "ring" / "ring3", "_tight" (whole-warp groups), "_s3" (3 stages), or
// "_cluster"; "_rms" (the RMSNorm instance).
inline const char* ring_kernel_name(bool three, bool tight, bool s3, bool cluster, bool rms) {
  static constexpr const char* names[2][8] = {
      {"ring", "ring_s3", "ring_tight", "ring_tight_s3", "ring3", "ring3_s3", "ring3_tight", "ring3_tight_s3"},
      {"ring_rms", "ring_s3_rms", "ring_tight_rms", "ring_tight_s3_rms", "ring3_rms", "ring3_s3_rms", "ring3_tight_rms",
       "ring3_tight_s3_rms"}};
  static constexpr const char* cluster_names[2][2] = {{"ring_cluster", "ring3_cluster"},
                                                      {"ring_cluster_rms", "ring3_cluster_rms"}};
  if (cluster) return cluster_names[rms ? 1 : 0][three ? 1 : 0];
  return names[rms ? 1 : 0][(three ? 4 : 0) + (tight ? 2 : 0) + (s3 ? 1 : 0)];
}

template <typename T>
void rownorm_bwd_launch(const RowNormParams& p_in, void* workspace, cudaStream_t stream) {
  const RowNormParams p = with_param_alignment<T>(p_in);
  const RowPlan plan = rownorm_plan<T>(p, true);
  const BwdWorkspace w = rownorm_bwd_layout<T>(p, plan);
  char* ws = static_cast<char*>(workspace);
  float* ws_dw = p.dw ? reinterpret_cast<float*>(ws) : nullptr;
  float* ws_db = p.db ? reinterpret_cast<float*>(ws + (p.dw ? w.partial_bytes : 0)) : nullptr;
  float2* rowsums = reinterpret_cast<float2*>(ws + (p.dw ? w.partial_bytes : 0) + (p.db ? w.partial_bytes : 0));
  const bool al = plan.L.aligned;
  note_rownorm_bwd_kernel(!plan.cached ? "rowsum_coltile"
                          : !plan.ring ? "cached"
                          : ring_kernel_name(plan.ring_vecs == 3, plan.ring_tight, plan.ring_stages == 3, plan.cluster > 1,
                                             plan.ring_rms));
  note_rownorm_bwd_sreg(plan.cached && plan.ring && plan.ring_sreg);
  note_rownorm_bwd_prod(plan.cached && plan.ring && plan.ring_prod);
  if (p.rows > 0) {
    if (plan.cluster > 1) {
      const std::int64_t blocks = std::int64_t(plan.L.P) * p.groups * plan.cluster;
      if (blocks > 0x7fffffff) throw Error(cat("rownorm_bwd: grid of ", blocks, " CTAs is too large"));
      auto go = [&](auto kernel) {
        launch_kernel_cluster("rownorm_bwd", kernel, dim3(unsigned(blocks)), dim3(plan.threads), plan.smem, stream, false,
                              unsigned(plan.cluster), p, plan.L, ws_dw, ws_db, plan.cl_cols);
      };
      go(ring_bwd_fn<T>(plan.ring_vecs, kRingStages, plan.ring_rms, true));
      FW_CUDA_CHECK_LAUNCH("rownorm_bwd");
    } else if (plan.cached) {
      const std::int64_t blocks = std::int64_t(plan.L.P) * p.groups;
      if (blocks > 0x7fffffff) throw Error(cat("rownorm_bwd: grid of ", blocks, " CTAs is too large"));
      const unsigned grid = unsigned(blocks);
      const bool big = plan.threads > kSmallCta;
      if (plan.ring)
        ring_bwd_fn<T>(plan.ring_vecs, plan.ring_stages, plan.ring_rms, false, plan.ring_sreg, plan.ring_prod)<<<grid, plan.threads, plan.smem, stream>>>(p, plan.L, ws_dw, ws_db, 0);
      else if (al && big) rownorm_bwd_cached_kernel<T, kBwdVecs, true, true><<<grid, plan.threads, plan.smem, stream>>>(p, plan.L, ws_dw, ws_db);
      else if (al) rownorm_bwd_cached_kernel<T, kBwdVecs, true, false><<<grid, plan.threads, plan.smem, stream>>>(p, plan.L, ws_dw, ws_db);
      else if (big) rownorm_bwd_cached_kernel<T, kBwdVecs, false, true><<<grid, plan.threads, plan.smem, stream>>>(p, plan.L, ws_dw, ws_db);
      else rownorm_bwd_cached_kernel<T, kBwdVecs, false, false><<<grid, plan.threads, plan.smem, stream>>>(p, plan.L, ws_dw, ws_db);
      FW_CUDA_CHECK_LAUNCH("rownorm_bwd");
    } else {
      const std::int64_t rs_blocks = std::int64_t(plan.rs.P) * p.groups;
      const std::int64_t ct_blocks = std::int64_t(plan.L.P) * p.groups * plan.tiles;
      if (ct_blocks > 0x7fffffff || rs_blocks > 0x7fffffff) throw Error(cat("rownorm_bwd: grid too large"));
      if (al) rownorm_bwd_rowsum_kernel<T, true><<<unsigned(rs_blocks), 512, 0, stream>>>(p, plan.rs, rowsums);
      else rownorm_bwd_rowsum_kernel<T, false><<<unsigned(rs_blocks), 512, 0, stream>>>(p, plan.rs, rowsums);
      FW_CUDA_CHECK_LAUNCH("rownorm_bwd");
      if (al) rownorm_bwd_coltile_kernel<T, true><<<unsigned(ct_blocks), plan.threads, 0, stream>>>(p, plan.L, plan.tiles, rowsums, ws_dw, ws_db);
      else rownorm_bwd_coltile_kernel<T, false><<<unsigned(ct_blocks), plan.threads, 0, stream>>>(p, plan.L, plan.tiles, rowsums, ws_dw, ws_db);
      FW_CUDA_CHECK_LAUNCH("rownorm_bwd");
    }
  }
  const std::int64_t P = p.rows > 0 ? plan.L.P : 0;  // no rows: the gradients are zeros
  const std::int64_t cols = p.groups * p.n;
  const dim3 fblock(32, kFinSlices);
  const unsigned fgrid = unsigned((cols + 32 * kFinCols - 1) / (32 * kFinCols));
  const bool f32 = p.param == DType::f32;
  WgradJob job;
  unsigned njobs = 0;
  if (p.dw) { job.ws[njobs] = ws_dw; job.out[njobs] = p.dw; job.out_group_stride[njobs] = p.dw_group_stride; ++njobs; }
  if (p.db) { job.ws[njobs] = ws_db; job.out[njobs] = p.db; job.out_group_stride[njobs] = p.db_group_stride; ++njobs; }
  if (njobs > 0 && fgrid > 0) {
    // On sm_90 a programmatic dependent launch: its CTAs are scheduled as the backward's finish
    // (they signal after their row loops) instead of after the launch gap, and wait in the kernel
    // for the backward's completion before reading the partials.
    launch_kernel("rownorm_bwd", rownorm_wgrad_finalize_kernel<T>, dim3(fgrid, njobs), fblock, 0, stream, cc_major() >= 9,
                  job, P, p.groups, p.n, f32);
    FW_CUDA_CHECK_LAUNCH("rownorm_bwd");
  }
}

#define FW_INSTANTIATE_ROWNORM(T)                                                         \
  template void rownorm_fwd_launch<T>(const RowNormParams&, cudaStream_t);                \
  template std::size_t rownorm_bwd_workspace<T>(const RowNormParams&);                    \
  template void rownorm_bwd_launch<T>(const RowNormParams&, void*, cudaStream_t);

}  // namespace fastweight::detail
