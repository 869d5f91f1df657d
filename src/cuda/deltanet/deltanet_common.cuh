// deltanet_common.cuh: device helpers shared by the DeltaNet CUDA kernels (deltanet_fwd.cu,
// deltanet_bwd.cu): a sequence's rows and chunk slots, strided row offsets, per-row L2 factors.
#pragma once

#include "common/deltanet_params.h"
#include "cuda/mlstm/mlstm_common.cuh"  // mlstm_ld / mlstm_st: dtype-generic StridedView access

namespace fastweight::detail {

// Sequence n: rows [bos, eos) of batch b; its chunk c is slot base + c (deltanet_slots).
struct DnSeq {
  std::int64_t b, bos, eos, base;
};
// Device offsets are not read by the host (that would need a synchronisation), so they are trusted but
// clamped: an offset outside [0, T] or a decreasing one gives wrong sequences, never an access outside
// the tensors or the workspace (every row index stays in [0, T), every state slot below
// deltanet_slots: base(n) + chunks(n) <= T / 64 + N). Python checks them on the host when eager.
__device__ __forceinline__ std::int64_t dn_cu(const DeltanetParams& p, std::int64_t n) {
  const std::int64_t v =
      p.cu_i64 ? static_cast<const std::int64_t*>(p.cu_seqlens)[n] : static_cast<const std::int32_t*>(p.cu_seqlens)[n];
  return v < 0 ? 0 : v > p.T ? p.T : v;
}
__device__ __forceinline__ DnSeq dn_seq(const DeltanetParams& p, std::int64_t n) {
  constexpr std::int64_t c = kDeltanetChunk;
  if (!p.cu_seqlens) return {n, 0, p.T, n * ((p.T + c - 1) / c)};
  const std::int64_t bos = dn_cu(p, n), eos = dn_cu(p, n + 1);
  return {0, bos, eos < bos ? bos : eos, bos / c + n};
}

// The CTA of a serial-chain kernel (grid (N * H, V tiles)): sequence n, head h, V tile. With
// variable lengths and at most kDnLptSeqs sequences, the longest sequences go to the CTAs that are
// dispatched first (lowest linear block index; every head and tile of a sequence together): their
// chains set the kernel's time, and in blockIdx order the second V tile of a long sequence waited
// for short ones to finish (2 x 128 CTAs on 132 SMs at one per SM at bench_deltanet's varlen row).
// Every thread of the CTA calls it; `scratch` (4 kDnLptSeqs bytes of shared memory, free until the
// call returns: the kernel's own dynamic shared memory) holds the lengths.
inline constexpr int kDnLptSeqs = 256;
struct DnCta {
  std::int64_t n, h, tile;
};
__device__ __forceinline__ DnCta dn_chain_cta(const DeltanetParams& p, int* scratch) {
  if (!p.cu_seqlens || p.N > kDnLptSeqs) return {blockIdx.x / p.H, blockIdx.x % p.H, blockIdx.y};
  const std::int64_t vt = gridDim.y, L = std::int64_t(blockIdx.y) * gridDim.x + blockIdx.x;
  const int N = int(p.N), r = int(L / (p.H * vt));  // this CTA's rank: 0 = the longest sequence
  __shared__ int s_n;
  for (int i = threadIdx.x; i < N; i += blockDim.x) {
    const DnSeq s = dn_seq(p, i);
    scratch[i] = int(s.eos - s.bos);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < N; i += blockDim.x) {  // rank of sequence i: longer first, ties by index
    const int li = scratch[i];
    int rank = 0;
    for (int j = 0; j < N; ++j) rank += scratch[j] > li || (scratch[j] == li && j < i);
    if (rank == r) s_n = i;  // ranks are a permutation of 0..N-1: one writer
  }
  __syncthreads();
  const DnCta c{s_n, (L / vt) % p.H, L % vt};
  __syncthreads();  // scratch is the caller's shared memory from here on
  return c;
}

// Chunk slot `slot`: its sequence and first row t0; false for a slot past its sequence's end.
__device__ __forceinline__ bool dn_slot(const DeltanetParams& p, std::int64_t slot, DnSeq& sq, std::int64_t& t0) {
  constexpr std::int64_t c = kDeltanetChunk;
  std::int64_t n = 0;
  if (p.cu_seqlens) {  // the last n with base(n) = cu[n] / 64 + n <= slot (base is increasing)
    std::int64_t lo = 0, hi = p.N - 1;
    while (lo < hi) {
      const std::int64_t mid = (lo + hi + 1) / 2;
      if (dn_cu(p, mid) / c + mid <= slot) lo = mid;
      else hi = mid - 1;
    }
    n = lo;
  } else {
    n = slot / ((p.T + c - 1) / c);
  }
  sq = dn_seq(p, n);
  t0 = sq.bos + (slot - sq.base) * c;
  return slot >= sq.base && t0 < sq.eos;  // slot < base: only for invalid (decreasing) offsets
}

// Row (b, t, h) of the (B*T*H, .) workspace regions.
__device__ __forceinline__ std::int64_t dn_ws_row(const DeltanetParams& p, std::int64_t b, std::int64_t t,
                                                  std::int64_t h) {
  return (b * p.T + t) * p.H + h;
}

// Element (b, t, h, 0) of a (B, T, H, D) view.
__device__ __forceinline__ std::int64_t dn_row(const StridedView& t, std::int64_t b, std::int64_t tt, std::int64_t h) {
  return b * t.s0 + tt * t.s1 + h * t.s2;
}

// Rows t0.. t0+nc of a chunk (64 rows): the L2 factors of q and k (x / sqrt(|x|^2 + 1e-6), FLA's
// convention; 1 without L2) and beta (0 past the end). A warp per row, lanes over the columns, so the
// reads are coalesced (a thread per row reading along it touched one 32-byte sector per element).
// Every thread of the CTA calls it (blockDim.x a multiple of 32); the caller syncs before use.
__device__ __forceinline__ void dn_row_factors(const DeltanetParams& p, std::int64_t b, std::int64_t t0, int nc,
                                               std::int64_t h, int tid, float* rq, float* rk, float* beta) {
  const int lane = tid & 31, nwarps = int(blockDim.x) / 32;
  // bf16 q, k and K <= 128 (every lane 4 columns at most): the loads of 4 rows at a time in flight
  // together, summed in the same order as below. One row at a time put ~32 dependent global round
  // trips in front of the tensor-core chunk pass (56% of its stall samples).
  if (p.l2 && p.K <= 128 && p.q.dtype == DType::bf16 && p.k.dtype == DType::bf16) {
    const __nv_bfloat16* qp = static_cast<const __nv_bfloat16*>(p.q.p);
    const __nv_bfloat16* kp = static_cast<const __nv_bfloat16*>(p.k.p);
    for (int r0 = tid / 32; r0 < int(kDeltanetChunk); r0 += 4 * nwarps) {
      float qv[4][4], kv[4][4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = r0 + i * nwarps;
        const bool on = r < nc && r < int(kDeltanetChunk);
        const std::int64_t oq = on ? dn_row(p.q, b, t0 + r, h) : 0, ok = on ? dn_row(p.k, b, t0 + r, h) : 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int x = lane + 32 * j;
          qv[i][j] = on && x < p.K ? __bfloat162float(qp[oq + x]) : 0.f;
          kv[i][j] = on && x < p.K ? __bfloat162float(kp[ok + x]) : 0.f;
        }
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = r0 + i * nwarps;
        float sq = 0.f, sk = 0.f;
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (lane + 32 * j < p.K) sq = fmaf(qv[i][j], qv[i][j], sq), sk = fmaf(kv[i][j], kv[i][j], sk);
        for (int o = 16; o > 0; o /= 2) {
          sq += __shfl_xor_sync(0xffffffffu, sq, o);
          sk += __shfl_xor_sync(0xffffffffu, sk, o);
        }
        if (lane == 0 && r < int(kDeltanetChunk)) {
          rq[r] = rsqrtf(sq + 1e-6f);
          rk[r] = rsqrtf(sk + 1e-6f);
          beta[r] = r < nc ? mlstm_ld(p.beta, p.beta.s0 * b + p.beta.s1 * (t0 + r) + h) : 0.f;
        }
      }
    }
    return;
  }
  for (int r = tid / 32; r < int(kDeltanetChunk); r += nwarps) {
    float sq = 0.f, sk = 0.f;
    if (r < nc && p.l2) {
      const std::int64_t oq = dn_row(p.q, b, t0 + r, h), ok = dn_row(p.k, b, t0 + r, h);
      for (std::int64_t x = lane; x < p.K; x += 32) {
        const float qx = mlstm_ld(p.q, oq + x), kx = mlstm_ld(p.k, ok + x);
        sq = fmaf(qx, qx, sq), sk = fmaf(kx, kx, sk);
      }
      for (int o = 16; o > 0; o /= 2) {
        sq += __shfl_xor_sync(0xffffffffu, sq, o);
        sk += __shfl_xor_sync(0xffffffffu, sk, o);
      }
    }
    if (lane == 0) {
      rq[r] = p.l2 ? rsqrtf(sq + 1e-6f) : 1.f;
      rk[r] = p.l2 ? rsqrtf(sk + 1e-6f) : 1.f;
      beta[r] = r < nc ? mlstm_ld(p.beta, p.beta.s0 * b + p.beta.s1 * (t0 + r) + h) : 0.f;
    }
  }
}

// The chunk pass's outputs, shared by its two versions (deltanet_bwd.cu, deltanet_bwd_tc.cu).
// dq^, dk^ at row t, column c of K: with the in-kernel L2 norm to the workspace for the L2-norm pass,
// else straight to dq, dk (each only when asked for).
__device__ __forceinline__ void dn_store_dqk(const DeltanetBwdParams& p, const DnBwdWs& w, float* ws, std::int64_t b,
                                             std::int64_t t, std::int64_t h, std::int64_t c, float dq, float dk) {
  if (p.l2) {  // dq^, dk^ for the L2-norm backward: fp32, or bf16 (w.h16)
    const std::int64_t row = dn_ws_row(p, b, t, h);
    if (w.h16) {
      if (p.dq.p) reinterpret_cast<__nv_bfloat16*>(ws + w.dqh)[row * p.K + c] = __float2bfloat16_rn(dq);
      if (p.dk.p) reinterpret_cast<__nv_bfloat16*>(ws + w.dkh)[row * p.K + c] = __float2bfloat16_rn(dk);
    } else {
      if (p.dq.p) ws[w.dqh + row * p.K + c] = dq;
      if (p.dk.p) ws[w.dkh + row * p.K + c] = dk;
    }
  } else {
    if (p.dq.p) mlstm_st(p.dq, dn_row(p.dq, b, t, h) + c, dq);
    if (p.dk.p) mlstm_st(p.dk, dn_row(p.dk, b, t, h) + c, dk);
  }
}
// Columns c, c + 1 (c even) of row t at once where whole pairs can be stored (has1: c + 1 < K; K even
// for the workspace rows; for dq, dk bf16 with even strides and a 4-byte aligned base): one 4- or
// 8-byte store for each of dq, dk, the same roundings; else dn_store_dqk per element.
__device__ __forceinline__ void dn_store_dqk2(const DeltanetBwdParams& p, const DnBwdWs& w, float* ws, std::int64_t b,
                                              std::int64_t t, std::int64_t h, std::int64_t c, float dq0, float dq1,
                                              float dk0, float dk1, bool has1) {
  auto pair_ok = [](const StridedView& v) {
    return v.dtype == DType::bf16 && reinterpret_cast<std::uintptr_t>(v.p) % 4 == 0 && v.s0 % 2 == 0 && v.s1 % 2 == 0 &&
           v.s2 % 2 == 0;
  };
  if (has1 && p.l2 && p.K % 2 == 0) {
    const std::int64_t at = dn_ws_row(p, b, t, h) * p.K + c;
    if (w.h16) {
      if (p.dq.p) *reinterpret_cast<__nv_bfloat162*>(reinterpret_cast<__nv_bfloat16*>(ws + w.dqh) + at) = __floats2bfloat162_rn(dq0, dq1);
      if (p.dk.p) *reinterpret_cast<__nv_bfloat162*>(reinterpret_cast<__nv_bfloat16*>(ws + w.dkh) + at) = __floats2bfloat162_rn(dk0, dk1);
    } else {
      if (p.dq.p) *reinterpret_cast<float2*>(ws + w.dqh + at) = make_float2(dq0, dq1);
      if (p.dk.p) *reinterpret_cast<float2*>(ws + w.dkh + at) = make_float2(dk0, dk1);
    }
    return;
  }
  if (has1 && !p.l2 && (!p.dq.p || pair_ok(p.dq)) && (!p.dk.p || pair_ok(p.dk))) {
    if (p.dq.p)
      *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(p.dq.p) + dn_row(p.dq, b, t, h) + c) = __floats2bfloat162_rn(dq0, dq1);
    if (p.dk.p)
      *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(p.dk.p) + dn_row(p.dk, b, t, h) + c) = __floats2bfloat162_rn(dk0, dk1);
    return;
  }
  dn_store_dqk(p, w, ws, b, t, h, c, dq0, dk0);
  if (has1) dn_store_dqk(p, w, ws, b, t, h, c + 1, dq1, dk1);
}

// dbeta of the chunk's rows t0..t0+nr: the V tiles' partial sums, in order (thread tid: row tid).
__device__ __forceinline__ void dn_store_dbeta(const DeltanetBwdParams& p, const DnBwdWs& w, const float* ws,
                                               std::int64_t b, std::int64_t t0, int nr, std::int64_t h, int tid) {
  if (!p.dbeta.p || tid >= nr) return;
  const std::int64_t row = dn_ws_row(p, b, t0 + tid, h);
  float db = 0.f;
  for (std::int64_t v = 0; v < w.vt; ++v) db += ws[w.dbp + v * w.rows + row];
  mlstm_st(p.dbeta, p.dbeta.s0 * b + p.dbeta.s1 * (t0 + tid) + h, db);
}

}  // namespace fastweight::detail
