// rownorm_fwd_bulk.cuh: the LayerNorm-family forward for aligned rows on Hopper, fed by bulk copies.
//
// Why: the persistent register-double-buffered forward (rownorm_fwd_cached_kernel) spent ~6.7k warp
// instructions per 8192-element bf16 row (ncu, H100), most of them per-element conversions (raw
// vectors re-converted in each of three passes, to stay under 80 registers) and per-load addressing;
// FLA's Triton kernel needs ~3.1k and ran 12% faster. Here a row arrives in shared memory by one
// cp.async.bulk (the TMA engine: one instruction per row, no registers while in flight), each
// thread converts its vectors to fp32 once and keeps them in registers for both statistics passes
// and the output.
//
// Shape: persistent CTAs of kBulkThreads threads (one per SM, <= 128 registers), R = 512 / tpr row
// groups of tpr threads (tpr = next_pow2(N / E / VPT), VPT = 4 or 8 vectors per thread); P CTAs per
// parameter group, as the persistent kernel. Each row group owns a ring of S row slots (S - 1 rows in flight while one is
// computed), each with its own mbarrier; lane 0 of the group posts the byte count and issues the
// copy. A slot is refilled at the start of the iteration after the one that read it: every thread
// of the group has read it by then (its reductions synchronised the group).
// Shared memory, in order: fp32 scale | fp32 bias (N each, the persistent kernel's float4 layout) |
// ring (R, S, tpr * VPT) 16-byte vectors | mbarriers (R, S).
// STAGED = false (set_rownorm_fwd_bulk_long; force_rownorm_fwd_bulk_unstaged within the reach, A/B
// only): rows past kBulkMaxN up to twice it,
// where 2 N fp32 parameters would not fit beside the ring (N = 32768: 256 KB): no staged parameters,
// each output vector reads its scale and bias (IO dtype, aligned rows, or none: the planner's rule;
// the general loader spilled at 128 registers) from global memory (the L2, after the first row), and
// the ring starts the shared memory; each CTA keeps S - 1 rows of 64 KB in flight by the TMA engine.
// Measured (H200, fastweight_bench ms, streaming kernel / this): LayerNorm bf16 512 x 32768 0.0396 /
// 0.0353, 1024 x 32768 0.0707 / 0.0599, 2048 x 24576 0.0989 / 0.0836, 4096 x 32768 0.2469 / 0.1957;
// RMSNorm 512 x 32768 0.0309 / 0.0320 (slower: the planner keeps it on the streaming kernel below 8
// rows per SM), 2048 x 24576 0.0779 / 0.0756, 4096 x 32768 0.1976 / 0.1834. Within the reach the
// staged form stays: unstaged, 4096 x 8192 took 0.0545 against 0.0418, 4096 x 16384 0.1031 against
// 0.0797 (more row slots in flight did not pay for the parameters' reloads).
// HOIST (unstaged only; set_rownorm_fwd_bulk_hoist: long rows below 8 rows per SM by default, and the
// 1024-thread form): the SASS of the form above shows each vector's two parameter loads in the guarded
// block of that vector, after the previous vector's store: 8 dependent L2 trips per row (FLA's row
// kernel issues its 16 at once, after its sums). With HOIST a row's loads go out together and x is read
// again from the slot. Measured (H200, session 37): 4% faster at 512-1024 x 32768, 2-7% slower from 16
// rows per SM (more registers); the numbers are at set_rownorm_fwd_bulk_hoist (norm_cuda.h).
#pragma once

#include "cuda/common/bulk.cuh"
#include "cuda/norm/rownorm_kernel.cuh"

namespace fastweight::detail {

inline constexpr int kBulkThreads = 512;
inline constexpr int kBulkVecs = 4;        // 16-byte vectors per thread per row (8 for long rows)
inline constexpr int kBulkMaxStages = 4;   // row slots per row group
template <typename T> inline constexpr std::int64_t kBulkMaxN = std::int64_t(kBulkThreads) * kBulkVecs * kVecElems<T>;

// Bytes of dynamic shared memory for (N, tpr, S, vectors per thread, parameters staged).
inline std::size_t bulk_smem_bytes(std::int64_t n, int tpr, int stages, int vpt, bool staged = true,
                                   int threads = kBulkThreads) {
  const std::size_t R = std::size_t(threads / tpr);
  return (staged ? std::size_t(n) * 2 * sizeof(float) : 0) +
         R * stages * (std::size_t(tpr) * vpt * 16 + sizeof(std::uint64_t));
}

// Sum over the row group rg of tpr threads: warp butterflies, then (tpr > 32) one named barrier over
// a double-buffered scratch of one float per warp (a buffer is rewritten only after the next
// barrier, which every reader of it has passed). Fixed order: deterministic.
template <int NT = kBulkThreads>
__device__ __forceinline__ float bulk_group_sum(float v, int tpr, int rg, float* s_red, int& parity) {
  constexpr int W = NT / 32;
  v = group_sum_warp(v, tpr);
  if (tpr <= 32) return v;
  const int wpr = tpr >> 5, warp = threadIdx.x >> 5;
  float* buf = s_red + parity * W;
  if ((threadIdx.x & 31) == 0) buf[warp] = v;
  group_barrier(1 + rg, tpr);
  if constexpr (W == 32) {  // 1024 threads: lane i takes warp i's partial, a butterfly sums them (the
    // same bits in every lane; 32 partials held at once spilled at 64 registers)
    const int l = threadIdx.x & 31;
    const float u = l < wpr ? buf[rg * wpr + l] : 0.f;
    parity ^= 1;
    return group_sum_warp(u, 32);
  } else {
    float t[W];  // the group's warp partials (zeros past wpr: exact), loaded at once, summed as a tree
#pragma unroll
    for (int i = 0; i < W; ++i) t[i] = i < wpr ? buf[rg * wpr + i] : 0.f;
    parity ^= 1;
    return tree_sum<W>(t);
  }
}

template <typename T, int VPT, bool STAGED = true, int NT = kBulkThreads, bool HOIST = false>
__global__ void __launch_bounds__(NT, 1) rownorm_fwd_bulk_kernel(const RowNormParams p, const RowLaunch L, const int S) {
  static_assert(!(STAGED && HOIST), "HOIST: the unstaged parameters only");
#if defined(FW_HAS_BULK)
  constexpr int E = kVecElems<T>;
  extern __shared__ uint4 smem_bulk[];
  __shared__ float s_red[2 * NT / 32];
  const int n = int(p.n), nvec = n / E;  // aligned rows: N % E == 0
  const int tpr = L.tpr, R = NT / tpr, rg = threadIdx.x / tpr, lane = threadIdx.x % tpr;
  const int slot_vecs = tpr * VPT;
  float4* s_par = reinterpret_cast<float4*>(smem_bulk);  // (E/4, nvec) scale | (E/4, nvec) bias
  const int bias4 = nvec * (E / 4);
  uint4* ring = smem_bulk + (STAGED ? n / 2 : 0);  // after 2 N floats (if staged): (R, S, slot_vecs)
  std::uint64_t* bars = reinterpret_cast<std::uint64_t*>(ring + std::size_t(R) * S * slot_vecs);  // (R, S)
  const std::int64_t g = blockIdx.x / L.P, pi = blockIdx.x % L.P;
  const std::int64_t J = p.rows_per_group, jstep = std::int64_t(L.P) * R;
  const unsigned row_bytes = unsigned(n) * unsigned(sizeof(T));
  const float inv_n = 1.f / float(n);

  // short rows (VPT 4): this thread's first parameter vector, loaded before any row copy is issued:
  // staged after them, the loads came back behind every SM's first rows, and the CTA waited for them
  // at the barrier below (ncu, 4096 x 2048 bf16: ~20% of the stall samples on the staging line).
  // Measured (H200, A/B): 4096 x 2048 -1.7%, 4096 x 1024 -0.4%; with 8 vectors (4096 x 4096) +4%: not there.
  float sc0[E], bi0[E];
  const bool par0 = STAGED && VPT == 4 && int(threadIdx.x) < nvec;
  if (par0) load_params_vec<T, true>(p, g, int(threadIdx.x) * E, n, sc0, bi0);
  for (int i = threadIdx.x; i < R * S; i += NT) mbar_init(bars + i, 1);
  mbar_init_fence();
  __syncthreads();
  uint4* my_ring = ring + std::size_t(rg) * S * slot_vecs;
  std::uint64_t* my_bars = bars + rg * S;
  auto issue = [&](std::int64_t j, int s) {  // lane 0 of the group: row j into slot s
    const T* src = static_cast<const T*>(p.x) + p.x_rows.offset(p.row_of(g, j));
    mbar_arrive_expect_tx(my_bars + s, row_bytes);
    bulk_g2s(my_ring + s * slot_vecs, src, row_bytes, my_bars + s);
  };
  // the parameters first into L2 (one bulk prefetch each), so that the staging loads below do not
  // queue behind the rows' copies (~10% of the kernel's stall samples at 4096 x 8192 without it)
  if (threadIdx.x == 0 && p.param_aligned) {
    const std::size_t psz = p.param == DType::f32 ? 4 : sizeof(T);
    if (p.w) bulk_prefetch_l2(static_cast<const char*>(p.w) + g * p.w_group_stride * psz, unsigned(n * psz));
    if (p.b) bulk_prefetch_l2(static_cast<const char*>(p.b) + g * p.b_group_stride * psz, unsigned(n * psz));
  }
  const std::int64_t jf = pi * R + rg;  // this group's first row
  if (lane == 0)
    for (int s = 0; s < S - 1; ++s)
      if (jf + s * jstep < J) issue(jf + s * jstep, s);
  // the group's scale and bias, staged while the first rows are in flight
  if constexpr (STAGED) {
    if (par0) put_fwd_params<E>(s_par, nvec, int(threadIdx.x), sc0, bi0);
    stage_fwd_params<T, true, 2>(p, g, n, s_par, int(threadIdx.x) + (VPT == 4 ? NT : 0));
    __syncthreads();
  }

  // unstaged: this group's scale and bias rows (IO dtype, 16-byte aligned rows; null without them)
  const T* wrow = !STAGED && p.w ? static_cast<const T*>(p.w) + g * p.w_group_stride : nullptr;
  const T* brow = !STAGED && p.b ? static_cast<const T*>(p.b) + g * p.b_group_stride : nullptr;
  int stage = 0, red_parity = 0;
  unsigned phase = 0;
  for (std::int64_t j0 = pi * R; j0 < J; j0 += jstep) {  // uniform over the CTA (warp shuffles)
    const std::int64_t j = j0 + rg;
    const bool valid = j < J;
    // refill the slot the previous iteration read (its reductions synchronised the group; within a
    // warp, __syncwarp orders those reads before the copy). HOIST with groups of several warps: the
    // previous iteration's output pass read x from that slot after the group's last barrier, and
    // another warp of the group may still be in it: one more group barrier first.
    if (tpr <= 32) __syncwarp();
    else if constexpr (HOIST) group_barrier(1 + rg, tpr);
    if (lane == 0) {
      const std::int64_t jn = j + (S - 1) * jstep;
      if (jn < J) issue(jn, stage == 0 ? S - 1 : stage - 1);
    }
    float xf[VPT][E];  // (VPT, E) columns (k * tpr + lane) * E + [0, E) as fp32; 0 past the row end
    if (valid) {
      mbar_wait(my_bars + stage, phase);
      const uint4* src = my_ring + stage * slot_vecs;
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int cv = k * tpr + lane;
        unpack<T>(cv < nvec ? src[cv] : make_uint4(0u, 0u, 0u, 0u), xf[k]);
      }
    } else {
#pragma unroll
      for (int k = 0; k < VPT; ++k)
#pragma unroll
        for (int e = 0; e < E; ++e) xf[k][e] = 0.f;
    }
    float mean = 0.f;
    if (!p.rms) mean = bulk_group_sum<NT>(tree_sum<VPT * E>(&xf[0][0]), tpr, rg, s_red, red_parity) * inv_n;
    float sq[VPT][E];  // (VPT, E) (x - mean)^2, 0 past the row end
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const bool in = (k * tpr + lane) < nvec;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const float d = xf[k][e] - mean;
        sq[k][e] = in ? d * d : 0.f;
      }
    }
    const float ss = tree_sum<VPT * E>(&sq[0][0]);
    const float rstd = rsqrtf(bulk_group_sum<NT>(ss, tpr, rg, s_red, red_parity) * inv_n + p.eps);
    if (valid) {
      const std::int64_t r = p.row_of(g, j);
      T* yr = static_cast<T*>(p.y) + p.y_rows.offset(r);
      // HOIST: every vector's raw scale and bias loaded at once, before the first store (one trip to
      // the L2 per row; without it each vector's loads sit in its own guarded block after the previous
      // store: VPT dependent trips), and x read again from its slot (refilled only after the whole
      // group has passed the barrier at the next iteration's start), so that the row's values are not
      // live beside the parameters. The same values in the same arithmetic: the same bits.
      uint4 wr[HOIST ? VPT : 1], br[HOIST ? VPT : 1];
      if constexpr (HOIST) {
        const uint4* w4 = reinterpret_cast<const uint4*>(wrow);
        const uint4* b4 = reinterpret_cast<const uint4*>(brow);
#pragma unroll
        for (int k = 0; k < VPT; ++k) wr[k] = br[k] = make_uint4(0u, 0u, 0u, 0u);
        if (wrow) {
#pragma unroll
          for (int k = 0; k < VPT; ++k) wr[k] = __ldg(w4 + min(k * tpr + lane, nvec - 1));
        }
        if (brow) {
#pragma unroll
          for (int k = 0; k < VPT; ++k) br[k] = __ldg(b4 + min(k * tpr + lane, nvec - 1));
        }
      }
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int cv = k * tpr + lane;
        if (cv >= nvec) continue;
        float sc[E], bi[E], out[E];
        if constexpr (STAGED) {
#pragma unroll
          for (int i = 0; i < E / 4; ++i) {
            const float4 a = s_par[i * nvec + cv], c = s_par[bias4 + i * nvec + cv];
            sc[4 * i] = a.x, sc[4 * i + 1] = a.y, sc[4 * i + 2] = a.z, sc[4 * i + 3] = a.w;
            bi[4 * i] = c.x, bi[4 * i + 1] = c.y, bi[4 * i + 2] = c.z, bi[4 * i + 3] = c.w;
          }
        } else if constexpr (HOIST) {
#pragma unroll
          for (int e = 0; e < E; ++e) {
            sc[e] = wrow ? p.weight_offset + raw_get<T>(wr[k], e) : 1.f;
            bi[e] = brow ? raw_get<T>(br[k], e) : 0.f;
          }
        } else {  // parameters in the IO dtype with aligned rows, or none (the planner's rule)
#pragma unroll
          for (int e = 0; e < E; ++e) sc[e] = 1.f, bi[e] = 0.f;
          if (wrow) {
            const uint4 raw = __ldg(reinterpret_cast<const uint4*>(wrow) + cv);
#pragma unroll
            for (int e = 0; e < E; ++e) sc[e] = p.weight_offset + raw_get<T>(raw, e);
          }
          if (brow) {
            const uint4 raw = __ldg(reinterpret_cast<const uint4*>(brow) + cv);
#pragma unroll
            for (int e = 0; e < E; ++e) bi[e] = raw_get<T>(raw, e);
          }
        }
        if constexpr (HOIST) {
          float xo[E];
          unpack<T>(my_ring[stage * slot_vecs + cv], xo);
#pragma unroll
          for (int e = 0; e < E; ++e) out[e] = (xo[e] - mean) * rstd * sc[e] + bi[e];
        } else {
#pragma unroll
          for (int e = 0; e < E; ++e) out[e] = (xf[k][e] - mean) * rstd * sc[e] + bi[e];
        }
        store_vec<T>(yr, cv * E, n, true, out);
      }
      if (lane == 0) {
        if (p.mean) p.mean[r] = mean;
        if (p.rstd) p.rstd[r] = rstd;
      }
    }
    if (++stage == S) stage = 0, phase ^= 1u;
  }
#else
  __trap();  // planned only on devices of compute capability 9.0 and up
#endif
}

}  // namespace fastweight::detail
