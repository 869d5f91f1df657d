// deltanet_bwd_tc.cu: the backward's state pass on tensor cores (bf16 q, k, v, do; K <= 128), after
// the tensor-core recompute (deltanet_chunk_tc.cu) stored Xw = T2 K^ (hi + lo) per row and
// T2 = (I + Lg W)^-1 per chunk. Per chunk (deltanet_bwd.cu for the algebra; W = diag(beta), rq, rk the
// L2 factors, K^ = diag(rk) K, Lg = strict_lower(K^ K^T), M = tril(Q^ K^T)), with dSe = dL/dS leaving
// the chunk and s the scale:
//   dD = dD0 + K^ dSe with dD0 = s M^T dO,   dR = T2^T W dD,   Y = dD - Lg^T dR,   dv = dR,
//   dbeta partial = Y . X (this V tile),     dS0 = dSe + s Q^T diag(rq) dO - Xw^T W dD
// (K^T dR = (T2 K^)^T W dD: FLA's chunk_gated_delta_rule_bwd_dhu form). Only dD and dS0 are on the
// serial chain, so the pass is three kernels:
//   1. prep (grid: chunk slots x H, all in parallel): dD0 -> the Y region (fp32 rows; bf16 with xb, below), rq, rk, beta;
//   2. serial (grid: sequences*H x 64-column tiles of V, chunks in reverse; dS in fp32 registers):
//      dD = dD0 + K^ dSe -> the Y region, dS += Q^T (s diag(rq) dO) - Xw^T (W dD), dSe per chunk as
//      bf16 hi + lo (for the chunk pass), dinitial_state at the end;
//   3. post (grid: chunk slots x H x V tiles, in parallel): dR, Y (-> the Y region, in place), dv,
//      the dbeta partials.
// Products on tensor cores; where an operand comes from fp32 it is bf16 hi + lo (p.hilo; else bf16
// only, each kernel a template on it). With bf16 operands and V % 8 == 0 (DnBwdWs::xb) the Y region
// is a bf16 (rows, V) matrix throughout (dD0, dD, then -Y: FLA keeps its dv, dv2 in bf16 too) and X
// is bf16: half the bytes through the prep, serial, post kernels and the chunk pass. (Version 1 of this
// pass did all of it on the serial chain: 1.55 ms at (4,4096,16,128), ~24 us per chunk step.)
#include <atomic>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>

#include "cuda/common/check.cuh"
#include "cuda/deltanet/deltanet_common.cuh"
#include "cuda/deltanet/deltanet_cuda.h"
#include "cuda/deltanet/deltanet_tc.cuh"

namespace fastweight::detail {
namespace {

using namespace dtc;
constexpr int kThreads = kTcThreads;  // prep and post: 4 warps, warp w owns tile rows 16w..
constexpr int kLdF = kT + 4;          // fp32 row stride of staged 64 x 64 tiles: 272 B, 16-byte aligned rows

// ---- 1. prep ------------------------------------------------------------------------------------
// smem: bf16 q, k [64][ldk] | [2] dO [64][kLd] (V tiles double-buffered) | f32 rq, rk, beta [64]
struct BpLayout {
  int Kc, ldk;
  std::size_t q, k, dO, rq, rk, beta, bytes;
  __host__ __device__ explicit BpLayout(std::int64_t K) {
    Kc = k_cols(K), ldk = Kc + 8;
    q = 0, k = q + 2 * std::size_t(kT) * ldk, dO = k + 2 * std::size_t(kT) * ldk;
    rq = dO + 2 * 2 * kT * kLd, rk = rq + 4 * kT, beta = rk + 4 * kT, bytes = beta + 4 * kT;
  }
};

// STG (bf16 operands only; set_deltanet_bwd_prep_stage): dD0 staged through shared memory (below), an
// instance of its own so that the plain one keeps its registers (84 / 78; staged 126 / 96)
template <bool LO, int FK = 0, bool STG = false>  // FK: K fixed at compile time (128), as the serial kernel
__global__ void __launch_bounds__(kThreads) deltanet_bwd_prep_kernel(const DeltanetBwdParams p, const DnBwdWs w,
                                                                     float* __restrict__ ws, bool vq, bool vk,
                                                                     bool vo, bool no_qh) {
  static_assert(!(STG && LO), "the staged dD0 is bf16 (bf16 operands)");
  extern __shared__ float4 smem_raw[];
  char* base = reinterpret_cast<char*>(smem_raw);
  const std::int64_t K = FK ? FK : p.K;
  const BpLayout lay(K);
  const int Kc = lay.Kc, ldk = lay.ldk;
  bf16* sq = reinterpret_cast<bf16*>(base + lay.q);    // (64 rows, Kc) q
  bf16* sk = reinterpret_cast<bf16*>(base + lay.k);    // (64 rows, Kc) k
  bf16* sdo = reinterpret_cast<bf16*>(base + lay.dO);  // [2] (64 rows, 64) dO: V tiles v in buffer v % 2
  float* s_rq = reinterpret_cast<float*>(base + lay.rq);
  float* s_rk = reinterpret_cast<float*>(base + lay.rk);
  float* s_beta = reinterpret_cast<float*>(base + lay.beta);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const std::int64_t slot = blockIdx.x, h = blockIdx.y, V = p.V;
  DnSeq sq_;
  std::int64_t t0;
  if (!dn_slot(p, slot, sq_, t0)) return;
  const std::int64_t b = sq_.b;
  const int nr = int(lmin(kT, sq_.eos - t0));
  load_tile(sq, ldk, kT, Kc, bf_rows(p.q, b, t0, h), p.q.s1, nr, int(K), vq);
  load_tile(sk, ldk, kT, Kc, bf_rows(p.k, b, t0, h), p.k.s1, nr, int(K), vk);
  auto issue_do = [&](std::int64_t v0) {  // V tile v0 / 64 into its buffer
    load_tile(sdo + (v0 / kT % 2) * kT * kLd, kLd, kT, kT, bf_rows(p.do_, b, t0, h) + v0, p.do_.s1, nr,
              int(lmin(kT, V - v0)), vo);
    cp_async_commit();
  };
  issue_do(0);  // one group with q, k
  if (V > kT) issue_do(kT);
  // beta first (its load in flight with the tiles); the L2 factors from the tiles (dn_row_factors read
  // q and k again from global memory: 4 dependent round trips per warp in this latency-bound kernel)
  if (tid >= kT) s_beta[tid - kT] = tid - kT < nr ? mlstm_ld(p.beta, p.beta.s0 * b + p.beta.s1 * (t0 + tid - kT) + h) : 0.f;
  if (V > kT) cp_async_wait<1>();
  else cp_async_wait<0>();
  __syncthreads();
  if (tid < kT) {
    s_rq[tid] = tid < nr ? row_l2_factor(sq, ldk, Kc, tid, p.l2) : 0.f;
    s_rk[tid] = tid < nr ? row_l2_factor(sk, ldk, Kc, tid, p.l2) : 0.f;
  }
  __syncthreads();
  if (tid < nr) {  // for the serial and post kernels
    const std::int64_t row = dn_ws_row(p, b, t0 + tid, h);
    ws[w.fac + row] = s_rq[tid], ws[w.fac + w.rows + row] = s_rk[tid], ws[w.fac + 2 * w.rows + row] = s_beta[tid];
  }
  if (!LO && w.xb && !no_qh) {  // Q^ = s diag(rq) Q for the serial kernel's dS update (bf16 rows of K)
    bf16* qh = reinterpret_cast<bf16*>(ws + w.qh());
    if (K % 8 == 0) {  // 8 columns per 16-byte load and store (an element at a time it was 64 stores and
                       // row products per thread), rows 16-byte aligned (K % 8 == 0, the region's base)
      const int U = Kc / 8;
      const std::int64_t row0 = dn_ws_row(p, b, t0, h);
      for (int e = tid; e < kT * U; e += kThreads) {
        const int i = e / U, c = 8 * (e % U);
        if (i >= nr || c >= K) continue;
        const uint4 u = *reinterpret_cast<const uint4*>(sq + i * ldk + c);
        const std::uint32_t in[4] = {u.x, u.y, u.z, u.w};
        std::uint32_t out[4];
        const float f = p.scale * s_rq[i];
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&in[x]));
          const __nv_bfloat162 r = __floats2bfloat162_rn(f * v.x, f * v.y);
          out[x] = *reinterpret_cast<const std::uint32_t*>(&r);
        }
        *reinterpret_cast<uint4*>(qh + (row0 + std::int64_t(i) * p.H) * K + c) = make_uint4(out[0], out[1], out[2], out[3]);
      }
    } else {
      for (int e = tid; e < kT * Kc; e += kThreads) {
        const int i = e / Kc, c = e % Kc;
        if (i < nr && c < K)
          qh[dn_ws_row(p, b, t0 + i, h) * K + c] = __float2bfloat16_rn(p.scale * s_rq[i] * __bfloat162float(sq[i * ldk + c]));
      }
    }
  }
  // s M^T (this warp's rows c: key rows; columns i: query rows) as A fragments, hi + lo, in registers:
  // [c][i] = s rq_i rk_c (k_c . q_i) for i >= c
  std::uint32_t mh[4][4], ml[4][4];
  {
    float m[8][4] = {};
    mma_rn(m, sk, ldk, warp, sq, ldk, Kc, lane);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float x[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = 16 * warp + frow(lane, e), i = fcol(lane, j, e);
        x[e] = i >= c ? p.scale * s_rq[i] * s_rk[c] * m[j][e] : 0.f;
      }
      if constexpr (LO) pack_a_frags_split(mh, ml, j, x);
      else pack_a_frags(mh, j, x);
    }
  }
  const bool even = V % 2 == 0;
  const bool xb = !LO && w.xb;  // dD0 as bf16 (V % 8 == 0: whole pairs)
  // stage (set_deltanet_bwd_prep_stage): a V tile's bf16 dD0 goes through q's shared memory (dead once M
  // and Q^ are formed), each warp its own 16 rows (stride kLd <= ldk), then 16-byte row pieces: 8 lanes
  // write a row's 128 bytes, where the fragments' pair stores write 16 bytes of a row per 4 lanes
  const bool stage = STG && xb;  // (inline, not warp_store_rows_staged: through it the K = 128 instance took 130 registers, 3 CTAs per SM)
  bf16* stg = sq + 16 * warp * kLd;  // this warp's (16, 64) staging rows
  if (stage) __syncthreads();        // every warp is done reading q
  for (std::int64_t v0 = 0; v0 < V; v0 += kT) {
    if (v0 > 0) {  // tile v0 was issued two tiles ago (or with q, k)
      if (v0 + kT < V) cp_async_wait<1>();
      else cp_async_wait<0>();
      __syncthreads();
    }
    const bf16* dO = sdo + (v0 / kT % 2) * kT * kLd;
    float dd[8][4] = {};  // dD0 = s M^T dO: rows 16 warp.., 64 columns of V
    mma_frags_k(dd, mh, dO, kLd, 0, lane);
    if constexpr (LO) mma_frags_k(dd, ml, dO, kLd, 0, lane);
    if (stage) {
      __syncwarp();  // this warp's reads of the previous V tile's rows are done
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; e += 2)  // (stride 72 bf16: the 32 lanes' 4-byte stores hit 32 banks)
          *reinterpret_cast<__nv_bfloat162*>(stg + (frow(lane, e)) * kLd + fcol(lane, j, e)) =
              __floats2bfloat162_rn(dd[j][e], dd[j][e + 1]);
      __syncwarp();
#pragma unroll
      for (int q = 0; q < 4; ++q) {  // piece lane + 32 q: row (lane + 32 q) / 8, columns 8 (lane % 8) ..
        const int r = lane / 8 + 4 * q, col = 8 * (lane % 8), c = 16 * warp + r;
        if (c < nr && v0 + col < V)
          *reinterpret_cast<uint4*>(reinterpret_cast<bf16*>(ws + w.Y) + dn_ws_row(p, b, t0 + c, h) * V + v0 + col) =
              *reinterpret_cast<const uint4*>(stg + r * kLd + col);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
          const int c = 16 * warp + frow(lane, e);
          const std::int64_t col = v0 + fcol(lane, j, e);
          if (c < nr && col < V) {
            const std::int64_t at = dn_ws_row(p, b, t0 + c, h) * V + col;
            if (xb) *reinterpret_cast<__nv_bfloat162*>(reinterpret_cast<bf16*>(ws + w.Y) + at) = __floats2bfloat162_rn(dd[j][e], dd[j][e + 1]);
            else store_pair(ws + w.Y + at, dd[j][e], dd[j][e + 1], col + 1 < V, even);
          }
        }
    }
    if (v0 + 2 * kT < V) {
      __syncthreads();  // every warp is done with this buffer
      issue_do(v0 + 2 * kT);
    }
  }
}

// ---- 2. serial ----------------------------------------------------------------------------------
// smem: [2] bf16 k [64][ldk] | [2] bf16 dO [64][TW+8] | [2] f32 dD0 [64][TW+4] (with xb bf16 [64][TW+8]) |
//       [2] f32 rq, rk, beta [64] |
//       [nb2] bf16 q, Xw hi [64][ldk] | bf16 Xw lo [64][ldk] | bf16 dSe hi, lo [Kc][TW+8] |
//       bf16 -W dD hi, lo, s diag(rq) dO hi, lo [64][TW+8] (the lo tiles with LO only). q and Xw (the
//       step's second operands): nb2 = 1, issued at the step's start and waited for in its middle;
//       nb2 = 2 (bf16 operands, where it fits: 192 KB at K = 128), issued a step ahead with the first
//       ones, so no load waits inside the step.
struct BsLayout {
  int Kc, ldk;
  std::size_t k, dO, dd, fac, q, xh, xl, Sh, Sl, Bh, Bl, Uh, Ul, bytes;
  // tw: the CTA's V columns (the dO, dSe, B, U tiles tw + 8 bf16 wide, dD0 tw + 4 fp32: kLd / kLdF at 64)
  __host__ __device__ BsLayout(std::int64_t K, bool lo, int nb2 = 1, int tw = 64) {
    Kc = k_cols(K), ldk = Kc + 8;
    const std::size_t kt = 2 * std::size_t(kT) * ldk, t64 = 2 * std::size_t(kT) * (tw + 8);
    const std::size_t st = 2 * std::size_t(Kc) * (tw + 8), tl = lo ? t64 : 0;
    k = 0, dO = k + 2 * kt, dd = dO + 2 * t64, fac = dd + 2 * 4 * std::size_t(kT) * (tw + 4);
    q = fac + 2 * 3 * 4 * kT, xh = q + nb2 * kt, xl = xh + nb2 * kt, Sh = xl + (lo ? kt : 0);
    Sl = Sh + st, Bh = Sl + (lo ? st : 0);
    Bl = Bh + t64, Uh = Bl + tl, Ul = Uh + t64, bytes = Ul + tl;
  }
};

// 8 warps as the forward's state kernel: warp w owns dS's 16-row group w and, in dD, rows 16 (w % 4)..
// and the (TW / 2)-column half w / 4. TW: the CTA's columns of V, 64 or 32 (as the forward's state
// kernel: half the products per warp and step, twice the CTAs; the same bits).
constexpr int kBsThreads = 256;
// DB2: q and Xw double-buffered (bf16 operands only: !LO). FK: K fixed at compile time (as the
// forward's state kernel), 0: runtime. two (with DB2 only): two barriers per chunk step instead of
// three, as the forward's state kernel (the previous chunk's operands issued after the first barrier,
// which also keeps the next step's B, U, dSe writes after this step's update); the same bits.
template <bool LO, bool DB2, int TW = 64, int FK = 0>
__global__ void __launch_bounds__(kBsThreads, 1) deltanet_bwd_state_tc_kernel(const DeltanetBwdParams p, const DnBwdWs w,
                                                                              float* __restrict__ ws, bool vq, bool vk,
                                                                              bool vo, bool vx, bool two) {
  static_assert(!(LO && DB2), "the hi + lo layout has no room for a second q / Xw buffer");
  static_assert(TW == 64 || TW == 32, "64- or 32-column tiles");
  constexpr int NJ = TW / 8, NJX = TW / 16;  // 8-column tiles of dS per warp, of dD per warp
  constexpr int LDT = TW + 8, LDF = TW + 4;   // strides of the dO / dSe / B / U (bf16) and dD0 (fp32) tiles
  extern __shared__ float4 smem_raw[];
  char* base = reinterpret_cast<char*>(smem_raw);
  const std::int64_t K = FK ? FK : p.K;
  two = DB2 && two;
  const BsLayout lay(K, LO, DB2 ? 2 : 1, TW);
  const int Kc = lay.Kc, ldk = lay.ldk;
  const std::size_t ktile = std::size_t(kT) * ldk, otile = std::size_t(kT) * LDT;
  bf16* sk = reinterpret_cast<bf16*>(base + lay.k);     // [2] (64 rows, Kc) k
  bf16* sdo = reinterpret_cast<bf16*>(base + lay.dO);   // [2] (64 rows, TW) dO (this CTA's columns)
  float* sdd = reinterpret_cast<float*>(base + lay.dd);  // [2] (64, LDF) dD0
  bf16* sddb = reinterpret_cast<bf16*>(base + lay.dd);   // or, with xb, [2] (64, LDT) bf16 dD0
  float* sfac = reinterpret_cast<float*>(base + lay.fac);  // [2] rq[64], rk[64], beta[64]
  bf16* sq = reinterpret_cast<bf16*>(base + lay.q);     // [DB2 ? 2 : 1] (64 rows, Kc) q
  bf16* sxh = reinterpret_cast<bf16*>(base + lay.xh);   // [DB2 ? 2 : 1] (64 rows, Kc) Xw hi
  bf16* sxl = reinterpret_cast<bf16*>(base + lay.xl);   // (64 rows, Kc) Xw lo
  bf16 *sSh = reinterpret_cast<bf16*>(base + lay.Sh), *sSl = reinterpret_cast<bf16*>(base + lay.Sl);  // (Kc, TW) dSe
  bf16 *sBh = reinterpret_cast<bf16*>(base + lay.Bh), *sBl = reinterpret_cast<bf16*>(base + lay.Bl);  // (64, TW) -W dD
  bf16 *sUh = reinterpret_cast<bf16*>(base + lay.Uh), *sUl = reinterpret_cast<bf16*>(base + lay.Ul);  // s diag(rq) dO

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int rg = warp & 3, half = warp >> 2;  // dD step: rows 16 rg.., columns (TW / 2) half..
  const DnCta cta = dn_chain_cta(p, reinterpret_cast<int*>(base));
  const std::int64_t n = cta.n, h = cta.h;
  const std::int64_t c0 = cta.tile * TW, V = p.V;
  const DnSeq sq_ = dn_seq(p, n);
  const std::int64_t b = sq_.b;
  const int ngroups = Kc / 16;
  const bool even = V % 2 == 0;
  const bool xb = !LO && w.xb;  // dD0 read, dD written as bf16 (V % 8 == 0)
  const bf16* xwh = reinterpret_cast<const bf16*>(ws + w.xw);
  const bf16* xwl = xwh + w.rows * K;

  float acc_s[1][NJ][4];  // dS (fp32), rows 16 w.., the CTA's TW columns
  state_load<8>(acc_s, p.dht, n, h, c0, K, V, warp, lane);
  const TileUnits kunits(Kc, kBsThreads), ounits(TW, kBsThreads);  // the k, q, Xw and dO tiles' cp.async units
  // ... fixed per CTA (whole chunks: ChunkUnits); chunk ci's rows are chunk 0's plus ci * 64
  const ChunkUnits kcu(kunits, ldk, p.k.s1), qcu(kunits, ldk, p.q.s1), xcu(kunits, ldk, p.H * K),
      ocu(ounits, LDT, p.do_.s1), ycu(ounits, LDT, p.H * V);
  const std::int64_t row00 = dn_ws_row(p, b, sq_.bos, h), wrow_step = kT * p.H;
  const bf16 *k00 = bf_rows(p.k, b, sq_.bos, h), *q00 = bf_rows(p.q, b, sq_.bos, h);
  const bf16* qhw = reinterpret_cast<const bf16*>(ws + w.qh());  // with xb: Q^ (rows, K), as xwh
  const bf16* o00 = bf_rows(p.do_, b, sq_.bos, h) + c0;
  bf16* y00 = reinterpret_cast<bf16*>(ws + w.Y) + row00 * V + c0;  // with xb: the bf16 Y region, row stride H V
  const int ncv = int(lmin(TW, V - c0));
  // what the step's first half needs (k, dO, dD0, factors) into buffer buf
  auto issue_first = [&](int buf, std::int64_t ci) {
    const std::int64_t t0 = sq_.bos + ci * kT, row0 = row00 + ci * wrow_step;
    const int nr = int(lmin(kT, sq_.eos - t0));
    load_chunk_tile(kcu, kunits, sk + buf * ktile, ldk, k00 + ci * kT * p.k.s1, p.k.s1, nr, int(K), vk, kBsThreads);
    load_chunk_tile(ocu, ounits, sdo + buf * otile, LDT, o00 + ci * kT * p.do_.s1, p.do_.s1, nr, ncv, vo, kBsThreads);
    if (xb)
      load_chunk_tile(ycu, ounits, sddb + buf * otile, LDT, y00 + ci * wrow_step * V, p.H * V, nr, ncv, true, kBsThreads);
    else
      stage_ws_rows<true, TW>(sdd + buf * kT * LDF, LDF, ws + w.Y, p, b, t0, h, nr, c0, kBsThreads);
    if (tid < 3 * kT) {
      const int f = tid / kT, i = tid % kT;
      if (i < nr) cp_async4(sfac + (buf * 3 + f) * kT + i, ws + w.fac + f * w.rows + row0 + i * p.H);
      else sfac[(buf * 3 + f) * kT + i] = 0.f;
    }
    cp_async_commit();
  };
  // what its second half needs (q, Xw hi + lo) into buffer buf2 (0 without DB2): without DB2 issued
  // once the previous step is done, with DB2 a step ahead, with the first operands
  auto issue_second = [&](int buf2, std::int64_t ci) {
    const std::int64_t t0 = sq_.bos + ci * kT, row0 = row00 + ci * wrow_step;
    const int nr = int(lmin(kT, sq_.eos - t0));
    if (xb)
      load_chunk_tile(xcu, kunits, sq + buf2 * ktile, ldk, qhw + row0 * K, p.H * K, nr, int(K), vx, kBsThreads);
    else
      load_chunk_tile(qcu, kunits, sq + buf2 * ktile, ldk, q00 + ci * kT * p.q.s1, p.q.s1, nr, int(K), vq, kBsThreads);
    load_chunk_tile(xcu, kunits, sxh + buf2 * ktile, ldk, xwh + row0 * K, p.H * K, nr, int(K), vx, kBsThreads);
    if constexpr (LO) load_chunk_tile(xcu, kunits, sxl, ldk, xwl + row0 * K, p.H * K, nr, int(K), vx, kBsThreads);
    cp_async_commit();
  };
  const StateStoreUnits<LO, TW> sst(K, V, c0, kBsThreads);  // dSe's pieces to the workspace, fixed per CTA
  const std::int64_t nch = (sq_.eos - sq_.bos + kT - 1) / kT;
  if (nch > 0) {
    issue_first(int((nch - 1) & 1), nch - 1);
    if constexpr (DB2) issue_second(int((nch - 1) & 1), nch - 1);
  }
  for (std::int64_t ci = nch - 1; ci >= 0; --ci) {
    const int buf = int(ci & 1);
    const std::int64_t t0 = sq_.bos + ci * kT, slot = sq_.base + ci;
    const int nr = int(lmin(kT, sq_.eos - t0));
    // a. dSe as hi + lo (the B operand of K dSe; and for the chunk pass)
    state_split<8, LO>(acc_s, sSh, sSl, ngroups, warp, lane);
    // b. without DB2: this step's second operands and the previous chunk's first ones; with DB2: the
    //    previous chunk's first and second ones (the other buffers' last readers finished before the
    //    previous step's final barrier; two: before this step's first barrier, then issued past it)
    if (two) {
      cp_async_wait<0>();  // this chunk's two groups (the only ones in flight)
      __syncthreads();
      if (ci > 0) {
        issue_first(buf ^ 1, ci - 1);
        issue_second(buf ^ 1, ci - 1);
      }
    } else if constexpr (DB2) {
      if (ci > 0) {
        issue_first(buf ^ 1, ci - 1);
        issue_second(buf ^ 1, ci - 1);
        cp_async_wait<2>();  // this chunk's two groups, issued a step ago, have landed
      } else {
        cp_async_wait<0>();
      }
    } else {
      issue_second(0, ci);
      if (ci > 0) {
        issue_first(buf ^ 1, ci - 1);
        cp_async_wait<2>();
      } else {
        cp_async_wait<1>();
      }
    }
    if (!two) __syncthreads();
    const int b2 = DB2 ? buf : 0;
    const bf16* dOt = sdo + buf * otile;
    sst.store(state_mats<LO>(ws + w.dS, slot, p.H, h, K, V), sSh, sSl, K, V, c0, kBsThreads);
    // c. dD = dD0 + diag(rk) K dSe (16 rows x TW / 2 columns per warp) -> the Y region; -W dD and
    //    (without xb) s diag(rq) dO as hi + lo
    {
      const float* dd0 = sdd + buf * kT * LDF;
      const bf16* dd0b = sddb + buf * otile;
      const float* fq = sfac + buf * 3 * kT;
      float kd[NJX][4] = {};
      if (DB2 && xb) {
        // with xb the update's first product is Q^^T dO (Q^ = s diag(rq) Q from the prep kernel, dO as
        // it landed). With DB2 both are in now: its four k-steps go between K dSe's (one block of
        // independent products for the scheduler: they fill that chain's latency) and leave the chain
        // after the second barrier. Without DB2 Q^ lands there and it runs there. The same products in
        // the same order either way.
#pragma unroll
        for (int ks = 0; ks < Kc / 16; ++ks) {
          mma_rk_step<NJX>(kd, sk + buf * ktile, ldk, rg, sSh + (TW / 2) * half, LDT, ks, lane);
          if (ks < 4 && warp < ngroups)  // 8 warps: row group `warp` of dS
            state_update_step<false, NJ>(acc_s, 0, warp, sq + b2 * ktile, ldk, dOt, nullptr, ks, lane);
        }
      } else {
        mma_rk(kd, sk + buf * ktile, ldk, rg, sSh + (TW / 2) * half, LDT, Kc, lane);
        if constexpr (LO) mma_rk(kd, sk + buf * ktile, ldk, rg, sSl + (TW / 2) * half, LDT, Kc, lane);
      }
      // this thread's dD pairs in the Y region: rows i0, i0 + 8, 8-column steps from one base
      const int i0 = 16 * rg + frow(lane, 0);
      const std::int64_t yo = (row00 + ci * wrow_step + i0 * p.H) * V + c0 + (TW / 2) * half + fcol(lane, 0, 0);
      float* yg = ws + w.Y + yo;
      bf16* ygb = reinterpret_cast<bf16*>(ws + w.Y) + yo;
      const std::int64_t hv8 = 8 * p.H * V;
#pragma unroll
      for (int j = 0; j < NJX; ++j)
#pragma unroll
        for (int e = 0; e < 4; e += 2) {  // columns c, c + 1 of row i
          const int i = 16 * rg + frow(lane, e), c = (TW / 2) * half + fcol(lane, j, e);
          const std::int64_t col = c0 + c;
          const bool in = i < nr && col < V, has1 = col + 1 < V;
          const float rk = fq[kT + i], bt = fq[2 * kT + i], rq = fq[i];
          float d0, d1;
          if (xb) {  // V % 8 == 0: whole pairs
            const float2 y = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(dd0b + i * LDT + c));
            d0 = in ? fmaf(rk, kd[j][e], y.x) : 0.f;
            d1 = in ? fmaf(rk, kd[j][e + 1], y.y) : 0.f;
            if (in) *reinterpret_cast<__nv_bfloat162*>(ygb + (e / 2) * hv8 + 8 * j) = __floats2bfloat162_rn(d0, d1);
          } else {
            d0 = in ? fmaf(rk, kd[j][e], dd0[i * LDF + c]) : 0.f;
            d1 = in && has1 ? fmaf(rk, kd[j][e + 1], dd0[i * LDF + c + 1]) : 0.f;
            if (in) store_pair(yg + (e / 2) * hv8 + 8 * j, d0, d1, has1, even);
          }
          put_split2<LO>(sBh, sBl, LDT, i, c, -bt * d0, -bt * d1);
          if (!xb) {
            const float2 o = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(dOt + i * LDT + c));
            put_split2<LO>(sUh, sUl, LDT, i, c, p.scale * rq * o.x, p.scale * rq * o.y);
          }
        }
    }
    if constexpr (!DB2) {
      if (ci > 0) cp_async_wait<1>();  // q, Xw (the previous chunk's first operands may stay in flight)
      else cp_async_wait<0>();
    }
    __syncthreads();
    // d. dS += Q^T (s diag(rq) dO) - Xw^T (W dD)   (Xw hi + lo, W dD hi + lo: three products)
    if (!xb) state_update<8, LO>(acc_s, sq + b2 * ktile, ldk, sUh, sUl, ngroups, warp, lane);
    else if (!DB2) state_update<8, false>(acc_s, sq, ldk, dOt, nullptr, ngroups, warp, lane);
    state_update<8, LO>(acc_s, sxh + b2 * ktile, ldk, sBh, sBl, ngroups, warp, lane);
    if constexpr (LO) state_update<8, false>(acc_s, sxl, ldk, sBh, nullptr, ngroups, warp, lane);
    if (!two) __syncthreads();  // the next step rewrites dSe, B, U, q, Xw and this buffer
  }
  if (p.dh0.p) state_store<8>(acc_s, p.dh0, n, h, c0, K, V, warp, lane);
}

// ---- 2'. serial, warp-specialised (sm_90) ----------------------------------------------------------
// The serial kernel's bf16-operand step (DB2, xb: bf16 dD0 / Y, Q^; 32-column tiles) with its loads
// and its dSe store taken off the chain, as the forward's WS state kernel (where that and the early
// reads took the state kernel from ~1098 to ~820 us at (1,32768,16,128), H100). 8 consumer warps (the
// serial kernel's roles) and 4 producer warps (ptxas: 160 registers, no spill, so no setmaxnreg
// rebalancing; a 40-register producer spilled): they load a chunk's k and rq / rk / beta (0), Q^ (1),
// Xw (2), dO and dD0 (3) into one of
// kBwWsBufs buffers, two chunks ahead, and warp 3 also stores dSe to the workspace from a second dSe
// tile. The consumers read what does not depend on dSe (the A fragments of K dSe and Xw^T (W dD), the
// epilogue's dD0, rk, beta) as soon as a chunk's operands land, before its chain. mbarriers: full[3]
// (128 producer threads through cp.async), empty[3] (256), sfull[2] (dSe written; 256), sempty[2]
// (stored; 32). The same products in the same order as the serial kernel: the same bits.
// smem: [kBwWsBufs] { bf16 k, Q^, Xw [64][ldk] | bf16 dO, dD0 [64][40] | f32 rq, rk, beta [64] } |
//       bf16 dSe [2][Kc][40] | bf16 -W dD [64][40] | u64 mbarriers [10]
constexpr int kBwWsBufs = 3;
constexpr int kBwWsThreads = kBsThreads + 128;
enum : int { kBwFull = 0, kBwEmpty = kBwWsBufs, kBwSFull = 2 * kBwWsBufs, kBwSEmpty = 2 * kBwWsBufs + 2,
             kBwBars = 2 * kBwWsBufs + 4 };
struct BwLayout {
  static constexpr int TW = 32, LDT = TW + 8;
  int Kc, ldk;
  std::size_t k, q, xw, dO, y, fac, buf, S, B, bar, bytes;  // k .. fac: offsets within a buffer of buf bytes
  __host__ __device__ explicit BwLayout(std::int64_t K) {
    Kc = k_cols(K), ldk = Kc + 8;
    const std::size_t kt = 2 * std::size_t(kT) * ldk, ot = 2 * std::size_t(kT) * LDT;
    k = 0, q = k + kt, xw = q + kt, dO = xw + kt, y = dO + ot, fac = y + ot, buf = fac + 3 * 4 * kT;
    S = kBwWsBufs * buf, B = S + 2 * 2 * std::size_t(Kc) * LDT, bar = round_up(B + ot, 16);
    bytes = bar + 8 * kBwBars;
  }
};

template <int FK = 0>
__global__ void __launch_bounds__(kBwWsThreads, 1) deltanet_bwd_state_ws_kernel(const DeltanetBwdParams p, const DnBwdWs w,
                                                                               float* __restrict__ ws) {
  constexpr int TW = BwLayout::TW, LDT = BwLayout::LDT, NJ = TW / 8, NJX = TW / 16;
  extern __shared__ float4 smem_raw[];
  char* base = reinterpret_cast<char*>(smem_raw);
  const std::int64_t K = FK ? FK : p.K;
  const BwLayout lay(K);
  const int Kc = lay.Kc, ldk = lay.ldk;
  auto at = [&](int bf, std::size_t off) { return base + bf * lay.buf + off; };
  auto sk = [&](int bf) { return reinterpret_cast<bf16*>(at(bf, lay.k)); };    // (64 rows, Kc) k
  auto sq = [&](int bf) { return reinterpret_cast<bf16*>(at(bf, lay.q)); };    // (64 rows, Kc) Q^
  auto sx = [&](int bf) { return reinterpret_cast<bf16*>(at(bf, lay.xw)); };   // (64 rows, Kc) Xw
  auto so = [&](int bf) { return reinterpret_cast<bf16*>(at(bf, lay.dO)); };   // (64 rows, TW) dO
  auto sy = [&](int bf) { return reinterpret_cast<bf16*>(at(bf, lay.y)); };    // (64 rows, TW) dD0
  auto sf = [&](int bf) { return reinterpret_cast<float*>(at(bf, lay.fac)); };  // rq, rk, beta [64]
  bf16* sS = reinterpret_cast<bf16*>(base + lay.S);  // [2] (Kc, TW) dSe
  bf16* sB = reinterpret_cast<bf16*>(base + lay.B);  // (64, TW) -W dD
  const std::size_t stile = std::size_t(Kc) * LDT;
  std::uint64_t* bars = reinterpret_cast<std::uint64_t*>(base + lay.bar);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const DnCta cta = dn_chain_cta(p, reinterpret_cast<int*>(base));
  const std::int64_t n = cta.n, h = cta.h, c0 = cta.tile * TW, V = p.V;
  const DnSeq sq_ = dn_seq(p, n);
  const std::int64_t b = sq_.b;
  const int ngroups = Kc / 16;
  const std::int64_t row00 = dn_ws_row(p, b, sq_.bos, h), wrow_step = kT * p.H;
  const std::int64_t nch = (sq_.eos - sq_.bos + kT - 1) / kT;
#if !defined(FW_HAS_BULK)
  __trap();  // no mbarriers in this build of the kernel (the host launches it only on sm_90 binaries)
#else
  if (K % 8 != 0 || V % 8 != 0) __trap();  // the producer's whole 16-byte pieces (the host checks): fail loudly
  if (tid == 0) {
    for (int i = 0; i < kBwWsBufs; ++i) mbar_init(bars + kBwFull + i, 128), mbar_init(bars + kBwEmpty + i, kBsThreads);
    for (int i = 0; i < 2; ++i) mbar_init(bars + kBwSFull + i, kBsThreads), mbar_init(bars + kBwSEmpty + i, 32);
    mbar_init_fence();
  }
  __syncthreads();
  if (warp >= kBsThreads / 32) {  // the producer warpgroup
    const int pw = warp - kBsThreads / 32;
    const int ncv = int(lmin(TW, V - c0));
    const bf16* xwh = reinterpret_cast<const bf16*>(ws + w.xw);
    const bf16* qhw = reinterpret_cast<const bf16*>(ws + w.qh());
    const bf16* y00 = reinterpret_cast<const bf16*>(ws + w.Y) + row00 * V + c0;
    auto load = [&](int bf, std::int64_t ci) {
      const std::int64_t t0 = sq_.bos + ci * kT, row0 = row00 + ci * wrow_step;
      const int nr = int(lmin(kT, sq_.eos - t0));
      if (pw == 0) {
        warp_load_tile(sk(bf), ldk, bf_rows(p.k, b, t0, h), p.k.s1, Kc, nr, int(K), lane);
        for (int e = lane; e < 3 * kT; e += 32) {
          const int f = e / kT, i = e % kT;
          cp_async4_z(sf(bf) + e, i < nr ? ws + w.fac + f * w.rows + row0 + i * p.H : ws, i < nr ? 4 : 0);
        }
      } else if (pw == 1) {
        warp_load_tile(sq(bf), ldk, qhw + row0 * K, p.H * K, Kc, nr, int(K), lane);
      } else if (pw == 2) {
        warp_load_tile(sx(bf), ldk, xwh + row0 * K, p.H * K, Kc, nr, int(K), lane);
      } else {
        warp_load_tile(so(bf), LDT, bf_rows(p.do_, b, t0, h) + c0, p.do_.s1, TW, nr, ncv, lane);
        warp_load_tile(sy(bf), LDT, y00 + ci * wrow_step * V, p.H * V, TW, nr, ncv, lane);
      }
      cp_async_mbar_arrive(bars + kBwFull + bf);
    };
    const StateStoreUnits<false, TW> sst(K, V, c0, 32, lane);
    for (int c = 0; c < kBwWsBufs && c < nch; ++c) load(c, nch - 1 - c);
    for (std::int64_t s = 0; s < nch; ++s) {  // step s: chunk nch - 1 - s (chunks in reverse)
      const int sb = int(s & 1), bf = int(s % kBwWsBufs);
      if (pw == 3) {
        ws_wait(bars + kBwSFull + sb, unsigned(s >> 1) & 1);  // dSe of step s, in dSe tile sb
        sst.store(state_mats<false>(ws + w.dS, sq_.base + nch - 1 - s, p.H, h, K, V), sS + sb * stile, nullptr, K, V,
                  c0, 32);
        ws_arrive(bars + kBwSEmpty + sb);
      }
      if (s + kBwWsBufs < nch) {
        ws_wait(bars + kBwEmpty + bf, unsigned(s / kBwWsBufs) & 1);  // the consumers are done with step s's buffer
        load(bf, nch - 1 - s - kBwWsBufs);
      }
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }
  const int rg = warp & 3, half = warp >> 2;  // dD: rows 16 rg.., columns (TW / 2) half..
  const bool upd = warp < ngroups;            // this warp's 16 rows of dS exist (Kc = 64: warps 0..3)
  const int i0 = 16 * rg + frow(lane, 0), cb = (TW / 2) * half + fcol(lane, 0, 0);
  bf16* ygb0 = reinterpret_cast<bf16*>(ws + w.Y) + (row00 + i0 * p.H) * V + c0 + cb;  // row i0 of chunk 0
  const std::int64_t hv8 = 8 * p.H * V;
  float acc_s[1][NJ][4];  // dS (fp32), rows 16 w.., the CTA's TW columns
  state_load<8>(acc_s, p.dht, n, h, c0, K, V, warp, lane);
  for (std::int64_t s = 0; s < nch; ++s) {
    const std::int64_t ci = nch - 1 - s, t0 = sq_.bos + ci * kT;
    const int sb = int(s & 1), bf = int(s % kBwWsBufs), nr = int(lmin(kT, sq_.eos - t0));
    ws_wait(bars + kBwFull + bf, unsigned(s / kBwWsBufs) & 1);  // chunk ci's operands landed
    std::uint32_t ak[8][4], ax[4][4];  // A of K dSe (k rows 16 rg..), of Xw^T (W dD) (Xw^T rows 16 warp..)
#pragma unroll
    for (int ks = 0; ks < 8; ++ks)
      if (ks < Kc / 16)
        ldsm_x4(ak[ks], sk(bf) + (16 * rg + ld_row_a_rowmajor(lane)) * ldk + ks * 16 + ld_col_a_rowmajor(lane));
    if (upd) {
#pragma unroll
      for (int ks = 0; ks < 4; ++ks)
        ldsm_x4_t(ax[ks], sx(bf) + (ks * 16 + ld_row_a_kmajor(lane)) * ldk + 16 * warp + ld_col_a_kmajor(lane));
    }
    float2 y0[NJX][2];  // dD0 at rows i0, i0 + 8, columns cb + 8 j, + 1
    float frk[2], fbt[2];
#pragma unroll
    for (int e2 = 0; e2 < 2; ++e2) {
      const int i = i0 + 8 * e2;
      frk[e2] = sf(bf)[kT + i], fbt[e2] = sf(bf)[2 * kT + i];
#pragma unroll
      for (int j = 0; j < NJX; ++j)
        y0[j][e2] = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(sy(bf) + i * LDT + cb + 8 * j));
    }
    if (s >= 2) ws_wait(bars + kBwSEmpty + sb, (unsigned(s >> 1) & 1) ^ 1);  // dSe of step s - 2 stored
    bf16* Se = sS + sb * stile;
    state_split<8, false>(acc_s, Se, nullptr, ngroups, warp, lane);  // dSe (leaving chunk ci)
    ws_arrive(bars + kBwSFull + sb);
    ws_named_sync(kBsThreads);  // every warp's dSe rows written
    // dD = dD0 + diag(rk) K dSe (16 rows x TW / 2 columns); Q^^T dO into dS between its k-steps
    float kd[NJX][4] = {};
    const bf16* Sh = Se + (TW / 2) * half;
#pragma unroll
    for (int ks = 0; ks < 8; ++ks)
      if (ks < Kc / 16) {
        std::uint32_t bb[4];
        ldsm_x4_t(bb, Sh + (ks * 16 + ld_row_b_kmajor(lane)) * LDT + ld_col_b_kmajor(lane));
        mma_bf16_16816(kd[0], ak[ks], bb[0], bb[1]);
        mma_bf16_16816(kd[1], ak[ks], bb[2], bb[3]);
        if (ks < 4 && upd) state_update_step<false, NJ>(acc_s, 0, warp, sq(bf), ldk, so(bf), nullptr, ks, lane);
      }
    bf16* ygb = ygb0 + ci * wrow_step * V;
#pragma unroll
    for (int j = 0; j < NJX; ++j)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int i = i0 + 8 * (e / 2), c = cb + 8 * j;
        const bool in = i < nr && c0 + c < V;
        const float d0 = in ? fmaf(frk[e / 2], kd[j][e], y0[j][e / 2].x) : 0.f;
        const float d1 = in ? fmaf(frk[e / 2], kd[j][e + 1], y0[j][e / 2].y) : 0.f;
        if (in) *reinterpret_cast<__nv_bfloat162*>(ygb + (e / 2) * hv8 + 8 * j) = __floats2bfloat162_rn(d0, d1);
        put_split2<false>(sB, nullptr, LDT, i, c, -fbt[e / 2] * d0, -fbt[e / 2] * d1);
      }
    ws_named_sync(kBsThreads);  // the -W dD tile written
    // dS -= Xw^T (W dD), Xw^T from registers (state_update_step's order)
    if (upd) state_update_regs<NJ>(acc_s[0], ax, sB, lane);
    ws_arrive(bars + kBwEmpty + bf);  // this warp's reads of buffer bf are done
  }
  if (p.dh0.p) state_store<8>(acc_s, p.dh0, n, h, c0, K, V, warp, lane);
#endif
}

// ---- 3. post ------------------------------------------------------------------------------------
// smem: R1: bf16 k [64][ldk], then f32 dD [64][kLdF] | R2: f32 T2 [64][64], then f32 X [64][kLdF] |
//       bf16 T2^T hi, lo [64][kLd] | bf16 W dD hi, lo, then dR hi, lo [64][kLd] | f32 rk, beta [64]
//       (the lo tiles with LO only)
// pf (bf16 operands with bf16 dD / X, V <= 128): bf16 k [64][ldk] | T2^T [64][kLd] | W dD, then dR
//       [64][kLd] | dD [2][64][kLd] | X [2][64][kLd] | f32 rk, beta [64]: every V tile's dD and X load
//       with k and T2 at the start. Loaded per tile after the previous tile's products, their latency
//       was exposed twice per CTA; 72 KB still fit the 3 CTAs per SM the registers allow (160-162).
struct BqLayout {
  int Kc, ldk;
  std::size_t r1, r2, Th, Tl, Bh, Bl, rk, beta, pd, px, bytes;
  __host__ __device__ BqLayout(std::int64_t K, bool lo, bool pf = false) {
    Kc = k_cols(K), ldk = Kc + 8;
    const std::size_t t64 = 2 * std::size_t(kT) * kLd, f64 = 4 * std::size_t(kT) * kLdF, tl = lo ? t64 : 0;
    const std::size_t kt = 2 * std::size_t(kT) * ldk;
    if (pf) {  // (!lo only; r2 and the lo tiles unused)
      r1 = 0, Th = kt, Bh = Th + t64, pd = Bh + t64, px = pd + 2 * t64, rk = px + 2 * t64;
      r2 = Tl = Bl = 0, beta = rk + 4 * kT, bytes = beta + 4 * kT;
      return;
    }
    r1 = 0, r2 = r1 + (kt > f64 ? kt : f64), Th = r2 + f64, Tl = Th + t64, Bh = Tl + tl, Bl = Bh + t64;
    rk = Bl + tl, beta = rk + 4 * kT, bytes = beta + 4 * kT, pd = px = 0;
  }
};

// One CTA per (chunk slot, head), the V tiles in turn (k, T2, Lg^T and the factors once per chunk:
// 361 -> 348 us at (4,4096,16,128) against a CTA per V tile).
// STG (bf16 operands with bf16 Y; set_deltanet_bwd_post_stage; an instance of its own, so the plain one
// keeps its registers): each thread writes its -Y pairs over its own dD elements in shared memory (no
// other thread reads them by then), and each warp stores its 16 rows of -Y, and of dv (dR's bf16 tile:
// dv exactly, where dv's rows are 16-byte aligned), as 16-byte row pieces (8 lanes a 128-byte row)
// instead of the fragments' 4-byte pairs.
template <bool LO, int FK = 0, bool STG = false>  // FK: as the prep kernel
__global__ void __launch_bounds__(kThreads, 3) deltanet_bwd_post_kernel(const DeltanetBwdParams p, const DnBwdWs w,
                                                                     float* __restrict__ ws, bool vk, bool pf) {
  static_assert(!(STG && LO), "the staged stores are bf16 (bf16 operands)");
  extern __shared__ float4 smem_raw[];
  char* base = reinterpret_cast<char*>(smem_raw);
  const std::int64_t K = FK ? FK : p.K;
  pf = !LO && pf && w.xb;  // (the host's rule too)
  const BqLayout lay(K, LO, pf);
  const int Kc = lay.Kc, ldk = lay.ldk;
  bf16* sk = reinterpret_cast<bf16*>(base + lay.r1);    // (64 rows, Kc) k
  float* sdd = reinterpret_cast<float*>(base + lay.r1);  // then (64, kLdF) dD
  bf16* sddb = reinterpret_cast<bf16*>(base + lay.r1);   // or, with w.xb, (64, kLd) bf16 dD
  float* sT2 = reinterpret_cast<float*>(base + lay.r2);  // (64, 64) T2^T (fp32: LO only)
  float* sX = reinterpret_cast<float*>(base + lay.r2);   // then (64, kLdF) X
  bf16* sXb = reinterpret_cast<bf16*>(base + lay.r2);    // or, with w.xb, (64, kLd) bf16 X
  const std::size_t otile = std::size_t(kT) * kLd;       // pf: [2] (64, kLd) bf16 dD, X (V tile vt in [vt])
  bf16* spd = reinterpret_cast<bf16*>(base + lay.pd);
  bf16* spx = reinterpret_cast<bf16*>(base + lay.px);
  bf16 *sTh = reinterpret_cast<bf16*>(base + lay.Th), *sTl = reinterpret_cast<bf16*>(base + lay.Tl);  // T2^T
  bf16 *sBh = reinterpret_cast<bf16*>(base + lay.Bh), *sBl = reinterpret_cast<bf16*>(base + lay.Bl);  // W dD, dR
  float* s_rk = reinterpret_cast<float*>(base + lay.rk);
  float* s_beta = reinterpret_cast<float*>(base + lay.beta);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const std::int64_t slot = blockIdx.x, h = blockIdx.y, V = p.V;
  DnSeq sq_;
  std::int64_t t0;
  if (!dn_slot(p, slot, sq_, t0)) return;
  const std::int64_t b = sq_.b;
  const int nr = int(lmin(kT, sq_.eos - t0));
  const bool even = V % 2 == 0;
  const bool xb = !LO && w.xb;  // X read, Y written as bf16 (DnBwdWs::xb)
  // dv as bf16 pairs: even element offsets of column pairs (col is even) and a 4-byte aligned base
  // (bf16 operands only: with hi + lo and a runtime K the kernel sits at its register cap, and the
  // pair store cost it spills)
  const bool dv2 = !LO && p.dv.p && p.dv.dtype == DType::bf16 && reinterpret_cast<std::uintptr_t>(p.dv.p) % 4 == 0 &&
                   p.dv.s0 % 2 == 0 && p.dv.s1 % 2 == 0 && p.dv.s2 % 2 == 0;
  const bool stg = STG && xb;  // -Y (and dv where dv16) staged
  const bool dv16 = stg && dv2 && reinterpret_cast<std::uintptr_t>(p.dv.p) % 16 == 0 && p.dv.s0 % 8 == 0 &&
                    p.dv.s1 % 8 == 0 && p.dv.s2 % 8 == 0;
  // a. k, T2 (16-byte aligned, 64 x 64 fp32); rk from the k tile, beta
  load_tile(sk, ldk, kT, Kc, bf_rows(p.k, b, t0, h), p.k.s1, nr, int(K), vk);
  // T2^T's rows (DnChunkBufs::T2: the forward's wy_inverse or the recompute's region), rows past nr
  // zero (their dR rows multiply zero beta: the same products as with T2's identity rows there)
  const void* T2src = p.wy_t2 ? p.wy_t2 : static_cast<const void*>(ws + w.T2);
  const std::int64_t t2r0 = dn_ws_row(p, b, t0, h) * 64, t2rs = p.H * 64;  // row 0, row stride (elements)
  if constexpr (LO) {  // fp32, split into hi + lo below: 16 16-byte pieces a row
    const float* T2w = static_cast<const float*>(T2src) + t2r0;
    for (int e = tid; e < 64 * 16; e += kThreads) {
      const int a = e / 16;
      cp_async16(sT2 + 4 * e, a < nr ? T2w + a * t2rs + 4 * (e % 16) : T2w, a < nr ? 16 : 0);
    }
  } else {  // bf16: straight into its tile, 8 16-byte pieces a row
    const bf16* T2t = static_cast<const bf16*>(T2src) + t2r0;
    for (int e = tid; e < 64 * 8; e += kThreads) {
      const int a = e / 8;
      cp_async16(sTh + a * kLd + 8 * (e % 8), a < nr ? T2t + a * t2rs + 8 * (e % 8) : T2t, a < nr ? 16 : 0);
    }
  }
  cp_async_commit();
  // pf: every V tile's dD, X now, one commit group per tile (V <= 128: at most two)
  const int nvt = int((V + kT - 1) / kT);
  if (pf) {
    for (int vt = 0; vt < nvt; ++vt) {
      const std::int64_t at = dn_ws_row(p, b, t0, h) * V + vt * kT;
      const int ncv = int(lmin(kT, V - vt * kT));
      load_tile(spd + vt * otile, kLd, kT, kT, reinterpret_cast<const bf16*>(ws + w.Y) + at, p.H * V, nr, ncv, true);
      load_tile(spx + vt * otile, kLd, kT, kT, reinterpret_cast<const bf16*>(ws + w.X) + at, p.H * V, nr, ncv, true);
      cp_async_commit();
    }
  }
  if (tid < kT) {  // the prep kernel's factors
    const std::int64_t row = dn_ws_row(p, b, t0 + tid, h);
    s_rk[tid] = tid < nr ? ws[w.fac + w.rows + row] : 0.f;
    s_beta[tid] = tid < nr ? ws[w.fac + 2 * w.rows + row] : 0.f;
  }
  if (!pf) cp_async_wait<0>();
  else if (nvt == 2) cp_async_wait<2>();  // k, T2 (the tiles' groups may stay in flight)
  else cp_async_wait<1>();
  __syncthreads();
  // b. Lg^T (this warp's rows i: [i][c] = rk_i rk_c (k_i . k_c) for c > i) as A fragments, hi + lo;
  //    T2^T as hi + lo
  std::uint32_t lh[4][4], ll[4][4];
  {
    float g[8][4] = {};
    mma_rn(g, sk, ldk, warp, sk, ldk, Kc, lane);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float x[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = 16 * warp + frow(lane, e), c = fcol(lane, j, e);
        x[e] = c > i ? s_rk[i] * s_rk[c] * g[j][e] : 0.f;
      }
      if constexpr (LO) pack_a_frags_split(lh, ll, j, x);
      else pack_a_frags(lh, j, x);
    }
  }
  if constexpr (LO)
    for (int e = tid; e < 64 * 64; e += kThreads) put_split1<LO>(sTh, sTl, kLd, e / 64, e % 64, sT2[e]);  // [a][j] = T2[j][a]
#pragma unroll 1
  for (std::int64_t c0 = 0, vt = 0; c0 < V; c0 += kT, ++vt) {
    __syncthreads();  // k and T2 are read (first tile), or the previous tile's dD, X, dR
    // c. dD and X of this V tile
    if (pf) {  // loaded at the start: tile vt's group (a later tile's may stay in flight)
      sddb = spd + vt * otile, sXb = spx + vt * otile;
      if (vt + 1 < nvt) cp_async_wait<1>();
      else cp_async_wait<0>();
    } else if (xb) {  // bf16 rows (row stride H V)
      const std::int64_t at = dn_ws_row(p, b, t0, h) * V + c0;
      const int ncv = int(lmin(kT, V - c0));
      load_tile(sddb, kLd, kT, kT, reinterpret_cast<const bf16*>(ws + w.Y) + at, p.H * V, nr, ncv, true);
      load_tile(sXb, kLd, kT, kT, reinterpret_cast<const bf16*>(ws + w.X) + at, p.H * V, nr, ncv, true);
    } else {
      stage_ws_rows<true>(sdd, kLdF, ws + w.Y, p, b, t0, h, nr, c0, kThreads);
      stage_ws_rows<true>(sX, kLdF, ws + w.X, p, b, t0, h, nr, c0, kThreads);
    }
    if (!pf) {
      cp_async_commit();
      cp_async_wait<0>();
    }
    __syncthreads();
    // dD of the tile's element (i, c)
    auto dd = [&](int i, int c) { return xb ? __bfloat162float(sddb[i * kLd + c]) : sdd[i * kLdF + c]; };
    for (int e = tid; e < 64 * 32; e += kThreads) {  // W dD as hi + lo, column pairs
      const int i = e / 32, c = 2 * (e % 32);
      put_split2<LO>(sBh, sBl, kLd, i, c, s_beta[i] * dd(i, c), s_beta[i] * dd(i, c + 1));
    }
    __syncthreads();
    // d. dR = T2^T (W dD) (this warp's 16 rows x 64 columns), then as hi + lo in B's place
    {
      float dr[8][4] = {};
      mma_split<LO, true>(dr, sTh, sTl, kLd, warp, sBh, sBl, kLd, 64, lane);
      __syncthreads();  // every warp has read W dD
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; e += 2)
          put_split2<LO>(sBh, sBl, kLd, 16 * warp + frow(lane, e), fcol(lane, j, e), dr[j][e], dr[j][e + 1]);
    }
    __syncthreads();
    // e. Y = dD - Lg^T dR -> the Y region (in place: this CTA staged its tile; with xb as bf16 -Y, the
    //    chunk pass's operand); dv = dR; the dbeta partial Y . X
    float ly[8][4] = {};
    mma_frags_k(ly, lh, sBh, kLd, 0, lane);
    if constexpr (LO) {
      mma_frags_k(ly, lh, sBl, kLd, 0, lane);
      mma_frags_k(ly, ll, sBh, kLd, 0, lane);
    }
    float db[2] = {0.f, 0.f};  // rows 16w + lane/4 and + 8
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {  // columns c, c + 1 of row i
        const int i = 16 * warp + frow(lane, e), c = fcol(lane, j, e);
        const std::int64_t col = c0 + c;
        if (i < nr && col < V) {
          const bool has1 = col + 1 < V;
          const float y0 = dd(i, c) - ly[j][e], y1 = has1 ? dd(i, c + 1) - ly[j][e + 1] : 0.f;
          const std::int64_t at = dn_ws_row(p, b, t0 + i, h) * V + col;
          if (xb) {  // V % 8 == 0: whole pairs
            db[e >> 1] = fmaf(y0, __bfloat162float(sXb[i * kLd + c]),
                              fmaf(y1, __bfloat162float(sXb[i * kLd + c + 1]), db[e >> 1]));
            if (stg)  // over this thread's own dD pair (read just above), stored by rows below
              *reinterpret_cast<__nv_bfloat162*>(sddb + i * kLd + c) = __floats2bfloat162_rn(-y0, -y1);
            else
              *reinterpret_cast<__nv_bfloat162*>(reinterpret_cast<bf16*>(ws + w.Y) + at) = __floats2bfloat162_rn(-y0, -y1);
          } else {
            db[e >> 1] = fmaf(y0, sX[i * kLdF + c], fmaf(y1, has1 ? sX[i * kLdF + c + 1] : 0.f, db[e >> 1]));
            store_pair(ws + w.Y + at, y0, y1, has1, even);
          }
          if (p.dv.p && !dv16) {  // dR as its hi + lo (~2^-17 relative; dr itself is not kept alive: spills)
            auto dr = [&](int cc) {
              const float x = __bfloat162float(sBh[i * kLd + cc]);
              if constexpr (LO) return x + __bfloat162float(sBl[i * kLd + cc]);
              else return x;
            };
            const std::int64_t odv = dn_row(p.dv, b, t0 + i, h) + col;
            if (dv2 && has1) {  // a bf16 pair per 4-byte store (the same roundings)
              *reinterpret_cast<__nv_bfloat162*>(static_cast<bf16*>(p.dv.p) + odv) = __floats2bfloat162_rn(dr(c), dr(c + 1));
            } else {
              mlstm_st(p.dv, odv, dr(c));
              if (has1) mlstm_st(p.dv, odv + 1, dr(c + 1));
            }
          }
        }
      }
    if (stg) {  // this warp's 16 rows of -Y (and dv = dR's bf16 tile) as 16-byte pieces
      __syncwarp();
#pragma unroll
      for (int q = 0; q < 4; ++q) {  // piece lane + 32 q: row 16 warp + (lane + 32 q) / 8, columns 8 (lane % 8) ..
        const int i = 16 * warp + lane / 8 + 4 * q, c = 8 * (lane % 8);
        if (i < nr && c0 + c < V) {
          *reinterpret_cast<uint4*>(reinterpret_cast<bf16*>(ws + w.Y) + dn_ws_row(p, b, t0 + i, h) * V + c0 + c) =
              *reinterpret_cast<const uint4*>(sddb + i * kLd + c);
          if (dv16)
            *reinterpret_cast<uint4*>(static_cast<bf16*>(p.dv.p) + dn_row(p.dv, b, t0 + i, h) + c0 + c) =
                *reinterpret_cast<const uint4*>(sBh + i * kLd + c);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      db[r] += __shfl_xor_sync(0xffffffffu, db[r], 1);
      db[r] += __shfl_xor_sync(0xffffffffu, db[r], 2);
      const int i = 16 * warp + (lane >> 2) + 8 * r;
      if ((lane & 3) == 0 && i < nr) ws[w.dbp + vt * w.rows + dn_ws_row(p, b, t0 + i, h)] = db[r];
    }
  }
}

// ---- the chunk pass on tensor cores --------------------------------------------------------------

// One CTA per (chunk slot, head, 64 columns of K), as the version 1 chunk kernel (deltanet_bwd.cu)
// computes it, with D = W X, dR = W Y. 8 warps: warp w owns rows 16 (w % 4).. and columns 32 (w / 4)..
// of every 64 x 64 result, so 64 accumulators per thread instead of 128 and two CTAs (16 warps) per
// SM (measured with 4 warps of 16 x 64: 8 warps per SM, 255 registers, latency-bound at 4.17 ms for
// (4,4096,16,128); splitting the V loop in two instead was slower, 4.59 ms).
//   a1 = dO D^T, a2 = -dR D^T (64 x 64), dq0 = dO S0^T, dk0 = D dSe^T - dR S0^T (64 x 64 of K), over V;
//   dq^ = s dq0 + (s tril(a1)) diag(rk) K,  dk^ = dk0 + (s tril(a1))^T diag(rq) Q + E diag(rk) K,
//   E = dG + dG^T, dG = strict_lower(a2).
// Operands from fp32 (D, dR, S0, dSe, the 64 x 64 factors) are bf16 hi + lo; q, k, dO are exact.
// smem: bf16 [64][kLd] tiles: dO | D h, l | dR h, l | S0 h, l | dSe h, l (rows: K index) -- after the
// V loop: q, k (this CTA's K columns) and the factors P1 = s tril(a1) diag(rk), P2 = (s tril(a1))^T
// diag(rq), PE = E diag(rk) (h, l) | f32 dG[64][65] | f32 rq, rk, beta[64]
// Without LO five tiles: dO | D | dR | S0 | dSe, then k (dO's place) | P1 | P2 | PE | q; and a second
// (64, 64) fp32 staging buffer (Y's, so that X and Y load together: one wait per V tile instead of
// two; with LO there is no room for it at two CTAs per SM).
struct BcLayout {
  std::size_t t[9], dG, rq, rk, beta, stg2, bytes;
  __host__ __device__ explicit BcLayout(bool lo) {
    const std::size_t t64 = 2 * std::size_t(kT) * kLd;
    const int nt = lo ? 9 : 5;
    for (int i = 0; i < 9; ++i) t[i] = (i < nt ? i : 0) * t64;
    dG = nt * t64, rq = dG + 4 * 64 * 65, rk = rq + 4 * kT, beta = rk + 4 * kT, stg2 = beta + 4 * kT;
    bytes = stg2 + (lo ? 0 : 4 * 64 * 64);
  }
};

constexpr int kBcThreads = 256;
// The L2-norm backward fused into the chunk pass's end (bf16 operands, l2f): dq = rq (g - q rq^2 (q . g))
// with g = dq^ rounded to bf16, and likewise dk, written straight to dq, dk instead of g to the
// workspace for deltanet_bwd_l2_vec_kernel (which then does not run): at (1,32768,16,128) that kernel
// was 264 us of pure HBM traffic (q, k, dq^, dk^ read, dq, dk written). The same sums in the same
// order as that kernel, so the same bits: per row, 32 partials of 4 columns (its lanes: fmaf chains),
// then its butterfly (xor 16, 8, 4, 2, 1; each step's pair sums are commutative, so every lane held
// the same value). A CTA holds one 64-column K tile: 16 of the 32 partials; with two K tiles (l2f 2)
// the pair is a cluster of 2 (the K tiles are grid neighbours, kfast) and each reads the other's
// partials from its shared memory (DSMEM); with one (K <= 64, l2f 1) the other 16 are zero, as that
// kernel's lanes past K.
// smem (the chunk pass's dead regions): gq (sdG's place) and gk (T(1), T(2)) f32 [64][65] the bf16 g
// values | part (stg2's place) f32 [q, k][dot, ss][16 partials][64 rows] (rows fastest: the row sums
// read it conflict-free) | rr (T(3)) f32 [q, k][r, r^2 dot][64]
__device__ __forceinline__ void cluster_sync_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#else
  __syncthreads();  // never launched as a cluster there (deltanet_bwd_chunk_tc)
#endif
}
// The address of `local` (this CTA's shared memory) in cluster CTA `rank`'s shared memory, read there.
__device__ __forceinline__ float ld_peer_shared(const float* local, unsigned rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  std::uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(smem_u32(local)), "r"(rank));
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(remote) : "memory");
  return v;
#else
  (void)local, (void)rank;
  return 0.f;
#endif
}
__device__ __forceinline__ void chunk_l2_epilogue(const DeltanetBwdParams& p, const float (&dq)[4][4],
                                                  const float (&dk)[4][4], float (*gq)[65], float (*gk)[65],
                                                  float* part, float* rr, const bf16* sq, const bf16* sk,
                                                  std::int64_t b, std::int64_t t0, std::int64_t h, int nr,
                                                  std::int64_t k0, int kz, int l2f, int mw, int half, int tid,
                                                  int lane) {
  const std::int64_t K = p.K;
  __syncthreads();  // every warp's last products have read T(1..3) and sdG is free
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {  // g = dq^, dk^ as the unfused pass stores them (bf16)
      const int i = 16 * mw + frow(lane, e), c = 32 * half + fcol(lane, j, e);
      gq[i][c] = __bfloat162float(__float2bfloat16_rn(dq[j][e]));
      gk[i][c] = __bfloat162float(__float2bfloat16_rn(dk[j][e]));
    }
  __syncthreads();
  // (u: q or k, row i, partial m: this tile's columns 4 m..4 m + 3), as the L2 kernel's lane 16 kz + m
  auto load4 = [&](int u, int i, int m, float (&x)[4], float (&g)[4]) {
    const int c = 4 * m;
    const bool in = k0 + c < K && (u ? p.dk.p : p.dq.p) != nullptr;
    const uint2 raw = *reinterpret_cast<const uint2*>((u ? sk : sq) + i * kLd + c);  // 8-byte aligned: kLd % 4 == 0
    const float2 x01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
    const float2 x23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
    const float xv[4] = {x01.x, x01.y, x23.x, x23.y};
    const float(*gs)[65] = u ? gk : gq;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      x[q] = in ? xv[q] : 0.f;
      g[q] = in ? gs[i][c + q] : 0.f;
    }
  };
  for (int e = tid; e < 2 * 64 * 16; e += kBcThreads) {  // rows fastest (part's layout)
    const int u = e / 1024, m = (e / 64) % 16, i = e % 64;
    float x[4], g[4];
    load4(u, i, m, x, g);
    part[((2 * u) * 16 + m) * 64 + i] = fmaf(x[3], g[3], fmaf(x[2], g[2], fmaf(x[1], g[1], x[0] * g[0])));
    part[((2 * u + 1) * 16 + m) * 64 + i] = fmaf(x[3], x[3], fmaf(x[2], x[2], fmaf(x[1], x[1], x[0] * x[0])));
  }
  if (l2f == 2) cluster_sync_all();  // the pair's partials written
  else __syncthreads();
  if (tid < 2 * 64) {  // row sums: (u, i) per thread
    const int u = tid / 64, i = tid % 64;
    float dot[16], ss[16];
    const float* pd = part + (2 * u) * 16 * 64 + i;
    const float* ps = part + (2 * u + 1) * 16 * 64 + i;
#pragma unroll
    for (int m = 0; m < 16; ++m) {  // xor 16: partial m of K tile 0 plus partial m of K tile 1
      const float od = pd[64 * m], os = ps[64 * m];
      const float rd = l2f == 2 ? ld_peer_shared(pd + 64 * m, unsigned(kz ^ 1)) : 0.f;
      const float rs = l2f == 2 ? ld_peer_shared(ps + 64 * m, unsigned(kz ^ 1)) : 0.f;
      dot[m] = od + rd, ss[m] = os + rs;  // (commutative: either tile's order gives the same bits)
    }
    auto fold = [&](auto o) {  // the butterfly's next step (o: a compile-time 8, 4, 2, 1: registers)
#pragma unroll
      for (int m = 0; m < decltype(o)::value; ++m) dot[m] = dot[m] + dot[m + o], ss[m] = ss[m] + ss[m + o];
    };
    fold(std::integral_constant<int, 8>{}), fold(std::integral_constant<int, 4>{});
    fold(std::integral_constant<int, 2>{}), fold(std::integral_constant<int, 1>{});
    const float r = rsqrtf(ss[0] + 1e-6f);
    rr[(2 * u) * 64 + i] = r;
    rr[(2 * u + 1) * 64 + i] = r * r * dot[0];
  }
  if (l2f == 2) cluster_sync_all();  // r visible; the peer is done reading this CTA's partials
  else __syncthreads();
  for (int e = tid; e < 2 * 64 * 16; e += kBcThreads) {  // 4 columns (8 bytes) per store, rows in 128-byte runs
    const int u = e / 1024, i = (e / 16) % 64, m = e % 16;
    const StridedView& out = u ? p.dk : p.dq;
    if (i >= nr || k0 + 4 * m >= K || !out.p) continue;
    float x[4], g[4];
    load4(u, i, m, x, g);
    const float r = rr[(2 * u) * 64 + i], rdot = rr[(2 * u + 1) * 64 + i];
    uint2 o;
    o.x = pack_bf16(r * (g[0] - x[0] * rdot), r * (g[1] - x[1] * rdot));
    o.y = pack_bf16(r * (g[2] - x[2] * rdot), r * (g[3] - x[3] * rdot));
    *reinterpret_cast<uint2*>(static_cast<bf16*>(out.p) + dn_row(out, b, t0 + i, h) + k0 + 4 * m) = o;
  }
}
// L2F: the fused L2-norm epilogue's K tiles (0: none, the plain stores; a template argument: compiled in,
// its code took the plain kernel from 122 to 128 registers, and the pass measured 2-4% slower at K = 128)
// STG (set_deltanet_bwd_chunk_stage; bf16 operands, no fused L2 epilogue, the L2 norm's bf16 dq^ / dk^
// workspace rows, K % 8 == 0; an instance of its own): each warp writes its (16, 32) dq^ and dk^ tiles
// into dG's and the Y staging's shared memory (both dead by then) and stores them as 16-byte row pieces
// (4 lanes a row's 64 bytes) instead of the fragments' 4-byte pairs (16 bytes of a row per 4 lanes).
template <bool LO, int L2F = 0, bool STG = false>
__global__ void __launch_bounds__(kBcThreads, 2) deltanet_bwd_chunk_tc_kernel(const DeltanetBwdParams p, const DnBwdWs w,
                                                                         float* __restrict__ ws, bool vq, bool vk,
                                                                         bool vo, int kfast) {
  static_assert(!(STG && (LO || L2F != 0)), "the staged stores: bf16 operands, the plain epilogue");
  extern __shared__ float4 smem_raw[];
  char* base = reinterpret_cast<char*>(smem_raw);
  const BcLayout lay(LO);
  auto T = [&](int i) { return reinterpret_cast<bf16*>(base + lay.t[i]); };
  // the lo tiles with LO only (unused otherwise)
  bf16 *sdo = T(0), *sDh = T(1), *sDl = T(2), *sRh = T(LO ? 3 : 2), *sRl = T(4), *sSh = T(LO ? 5 : 3), *sSl = T(6),
       *sEh = T(LO ? 7 : 4), *sEl = T(8);  // sR holds -dR: its products land with the right sign
  float(*sdG)[65] = reinterpret_cast<float(*)[65]>(base + lay.dG);
  float* stg = reinterpret_cast<float*>(base + lay.dG);  // (64, 64) staging of X (and with LO, Y) tiles
  float* stg2 = reinterpret_cast<float*>(base + lay.stg2);  // (64, 64) staging of Y tiles (without LO)
  float* s_rq = reinterpret_cast<float*>(base + lay.rq);
  float* s_rk = reinterpret_cast<float*>(base + lay.rk);
  float* s_beta = reinterpret_cast<float*>(base + lay.beta);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int mw = warp & 3, half = warp >> 2;  // rows 16 mw.., columns 32 half.. of each 64 x 64 result
  // kfast (the K tiles' count, or 0): a (slot, head)'s K tiles are neighbours in the grid (blockIdx.x =
  // slot * kfast + K tile), so that their shared dO, X, Y tiles are read from HBM once and from the L2
  // by the others; else blockIdx.z is the K tile (a whole grid of slots apart)
  const int kz = kfast ? int(blockIdx.x % unsigned(kfast)) : int(blockIdx.z);
  const std::int64_t h = blockIdx.y, k0 = std::int64_t(kz) * kT, K = p.K, V = p.V;
  const std::int64_t slot = kfast ? std::int64_t(blockIdx.x / unsigned(kfast)) : std::int64_t(blockIdx.x);
  DnSeq sq_;
  std::int64_t t0;
  if (!dn_slot(p, slot, sq_, t0)) return;
  const std::int64_t b = sq_.b;
  const int nr = int(lmin(kT, sq_.eos - t0)), nk = int(lmin(kT, K - k0));
  // rq, rk, beta of the chunk's rows (of the full rows): the prep kernel's, as the serial and post
  // kernels take them (recomputing them from q and k in global memory here, dn_row_factors, was 35%
  // of this kernel's stall samples: ncu, (4,4096,16,128), H200)
  if (tid < kT) {
    const std::int64_t row = dn_ws_row(p, b, t0 + tid, h);
    s_rq[tid] = tid < nr ? ws[w.fac + row] : 0.f;
    s_rk[tid] = tid < nr ? ws[w.fac + w.rows + row] : 0.f;
    s_beta[tid] = tid < nr ? ws[w.fac + 2 * w.rows + row] : 0.f;
  }
  __syncthreads();
  const bf16* Sg = state_mats<LO>(ws + w.S, slot, p.H, h, K, V) + k0 * V;
  const bf16* Eg = state_mats<LO>(ws + w.dS, slot, p.H, h, K, V) + k0 * V;
  // with xb the V tiles hold X and -Y instead of D = W X and -dR = -W Y: a1 = (dO X^T) W, a2 = W (-Y X^T) W
  // and dk0 = W (X dSe^T - Y S0^T), W applied after the V loop
  const bool xb = !LO && w.xb;
  const bf16* xg = reinterpret_cast<const bf16*>(ws + w.X) + dn_ws_row(p, b, t0, h) * V;  // row stride H V
  const bf16* yg = reinterpret_cast<const bf16*>(ws + w.Y) + dn_ws_row(p, b, t0, h) * V;  // row stride H V
  float a1[4][4] = {}, a2[4][4] = {}, dq[4][4] = {}, dk[4][4] = {};  // a2 = -dR D^T; (16 x 32) each
  for (std::int64_t v0 = 0; v0 < V; v0 += kT) {
    const int nv = int(lmin(kT, V - v0));
    load_tile(sdo, kLd, kT, kT, bf_rows(p.do_, b, t0, h) + v0, p.do_.s1, nr, nv, vo, kBcThreads);
    load_tile(sSh, kLd, kT, kT, Sg + v0, V, nk, nv, V % 8 == 0, kBcThreads);
    if constexpr (LO) load_tile(sSl, kLd, kT, kT, Sg + K * V + v0, V, nk, nv, V % 8 == 0, kBcThreads);
    load_tile(sEh, kLd, kT, kT, Eg + v0, V, nk, nv, V % 8 == 0, kBcThreads);
    if constexpr (LO) load_tile(sEl, kLd, kT, kT, Eg + K * V + v0, V, nk, nv, V % 8 == 0, kBcThreads);
    // D = W X, dR = W Y as hi + lo, through sdG (free until the factors) as cp.async staging: X with
    // the tiles, then Y (per-element loads here were on every V step's critical path)
    auto split_rows = [&](const float* src, bf16* hi, bf16* lo, float sign) {
      for (int e = tid; e < 64 * 32; e += kBcThreads) {  // column pairs
        const int i = e / 32, c = 2 * (e % 32);
        const float bt = sign * s_beta[i];
        const float x0 = i < nr && c < nv ? src[i * 64 + c] : 0.f, x1 = i < nr && c + 1 < nv ? src[i * 64 + c + 1] : 0.f;
        put_split1<LO>(hi, lo, kLd, i, c, bt * x0), put_split1<LO>(hi, lo, kLd, i, c + 1, bt * x1);
      }
    };
    if (xb) {  // X and -Y as bf16 (DnBwdWs::xb): the operands themselves, W applied to the products below
      load_tile(sDh, kLd, kT, kT, xg + v0, p.H * V, nr, nv, true, kBcThreads);
      load_tile(sRh, kLd, kT, kT, yg + v0, p.H * V, nr, nv, true, kBcThreads);
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();
    } else {
      stage_ws_rows<false>(stg, 64, ws + w.X, p, b, t0, h, nr, v0, kBcThreads);
      if constexpr (!LO) stage_ws_rows<false>(stg2, 64, ws + w.Y, p, b, t0, h, nr, v0, kBcThreads);
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();
      split_rows(stg, sDh, sDl, 1.f);
      if constexpr (!LO) split_rows(stg2, sRh, sRl, -1.f);
      __syncthreads();
    }
    if constexpr (LO) {  // Y through the one staging buffer
      stage_ws_rows<false>(stg, 64, ws + w.Y, p, b, t0, h, nr, v0, kBcThreads);
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();
      split_rows(stg, sRh, sRl, -1.f);
      __syncthreads();
    }
    // B operands n-major: this warp's 32 output columns are rows 32 half.. of the B tile
    const int bo = 32 * half * kLd;
    mma_rn(a1, sdo, kLd, mw, sDh + bo, kLd, 64, lane);
    if constexpr (LO) mma_rn(a1, sdo, kLd, mw, sDl + bo, kLd, 64, lane);
    mma_split<LO, false>(a2, sRh, sRl, kLd, mw, sDh + bo, sDl + bo, kLd, 64, lane);
    mma_rn(dq, sdo, kLd, mw, sSh + bo, kLd, 64, lane);
    if constexpr (LO) mma_rn(dq, sdo, kLd, mw, sSl + bo, kLd, 64, lane);
    mma_split<LO, false>(dk, sDh, sDl, kLd, mw, sEh + bo, sEl + bo, kLd, 64, lane);
    mma_split<LO, false>(dk, sRh, sRl, kLd, mw, sSh + bo, sSl + bo, kLd, 64, lane);
    __syncthreads();  // the next tile overwrites every operand
  }
  // the 64 x 64 factors: P1 = s tril(a1) diag(rk) -> T[1, 2]; P2 = (s tril(a1))^T diag(rq) -> T[3, 4];
  // dG = strict_lower(a2) (a2 = -dR D^T) -> sdG, then PE = (dG + dG^T) diag(rk) -> T[5, 6]; q, k tiles -> T[7], T[8]
  bf16 *sP1h = T(1), *sP1l = T(2), *sP2h = T(LO ? 3 : 2), *sP2l = T(4), *sPEh = T(LO ? 5 : 3), *sPEl = T(6),
       *sq = T(LO ? 7 : 4), *sk = T(LO ? 8 : 0);
  load_tile(sq, kLd, kT, kT, bf_rows(p.q, b, t0, h) + k0, p.q.s1, nr, nk, vq, kBcThreads);
  load_tile(sk, kLd, kT, kT, bf_rows(p.k, b, t0, h) + k0, p.k.s1, nr, nk, vk, kBcThreads);
  cp_async_commit();
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = 16 * mw + frow(lane, e), c = 32 * half + fcol(lane, j, e);
      const float wc = xb ? s_beta[c] : 1.f, wi = xb ? s_beta[i] : 1.f;
      const float m = c <= i ? p.scale * (a1[j][e] * wc) : 0.f;
      put_split1<LO>(sP1h, sP1l, kLd, i, c, m * s_rk[c]);
      put_split1<LO>(sP2h, sP2l, kLd, c, i, m * s_rq[i]);
      sdG[i][c] = c < i ? a2[j][e] * wi * wc : 0.f;  // dG = -strict_lower(dR D^T)
      dq[j][e] *= p.scale;
      dk[j][e] *= wi;
    }
  __syncthreads();
  for (int e = tid; e < 64 * 64; e += kBcThreads) {
    const int i = e / 64, c = e % 64;
    put_split1<LO>(sPEh, sPEl, kLd, i, c, (sdG[i][c] + sdG[c][i]) * s_rk[c]);
  }
  cp_async_wait<0>();
  __syncthreads();
  // B operands k-major: this warp's 32 output columns are columns 32 half.. of q, k
  mma_rk(dq, sP1h, kLd, mw, sk + 32 * half, kLd, 64, lane);
  if constexpr (LO) mma_rk(dq, sP1l, kLd, mw, sk + 32 * half, kLd, 64, lane);
  mma_rk(dk, sP2h, kLd, mw, sq + 32 * half, kLd, 64, lane);
  if constexpr (LO) mma_rk(dk, sP2l, kLd, mw, sq + 32 * half, kLd, 64, lane);
  mma_rk(dk, sPEh, kLd, mw, sk + 32 * half, kLd, 64, lane);
  if constexpr (LO) mma_rk(dk, sPEl, kLd, mw, sk + 32 * half, kLd, 64, lane);
  if constexpr (!LO && L2F != 0) {
    chunk_l2_epilogue(p, dq, dk, sdG, reinterpret_cast<float(*)[65]>(T(1)), stg2, reinterpret_cast<float*>(T(3)),
                      sq, sk, b, t0, h, nr, k0, kz, L2F, mw, half, tid, lane);
  } else if (STG && p.l2 && w.h16 && K % 8 == 0) {  // (the host's rule too)
    // this warp's rows 16 mw.., columns 32 half.. of dq^ (in dG's place) and dk^ (the Y staging's), bf16,
    // stride kLd (conflict-free pair writes); nothing reads dG or the staging after the last barrier
    bf16* tq = reinterpret_cast<bf16*>(sdG) + 16 * mw * kLd + 32 * half;
    bf16* tk = reinterpret_cast<bf16*>(stg2) + 16 * mw * kLd + 32 * half;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int r = frow(lane, e), c = fcol(lane, j, e);
        *reinterpret_cast<__nv_bfloat162*>(tq + r * kLd + c) = __floats2bfloat162_rn(dq[j][e], dq[j][e + 1]);
        *reinterpret_cast<__nv_bfloat162*>(tk + r * kLd + c) = __floats2bfloat162_rn(dk[j][e], dk[j][e + 1]);
      }
    __syncwarp();
#pragma unroll
    for (int q = 0; q < 2; ++q) {  // rows r, r + 4 per 8 lanes (144 words apart: all 32 banks), columns 8 (lane % 4) ..
      const int r = lane / 8 + 4 * ((lane / 4) & 1) + 8 * q, c = 8 * (lane % 4), i = 16 * mw + r;
      const std::int64_t col = k0 + 32 * half + c;
      if (i < nr && col < K) {
        const std::int64_t at = dn_ws_row(p, b, t0 + i, h) * K + col;
        if (p.dq.p) *reinterpret_cast<uint4*>(reinterpret_cast<bf16*>(ws + w.dqh) + at) = *reinterpret_cast<const uint4*>(tq + r * kLd + c);
        if (p.dk.p) *reinterpret_cast<uint4*>(reinterpret_cast<bf16*>(ws + w.dkh) + at) = *reinterpret_cast<const uint4*>(tk + r * kLd + c);
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {  // columns c, c + 1 (c even) of row i
        const int i = 16 * mw + frow(lane, e);
        const std::int64_t c = k0 + 32 * half + fcol(lane, j, e);
        if (i < nr && c < K)
          dn_store_dqk2(p, w, ws, b, t0 + i, h, c, dq[j][e], dq[j][e + 1], dk[j][e], dk[j][e + 1], c + 1 < K);
      }
  }
  if (kz == 0) dn_store_dbeta(p, w, ws, b, t0, nr, h, tid);
}

std::atomic<bool> g_serial_db2{true};
// off by default: on the H100 it measured 0.5-1.5% slower at K = V = 128 (session 27), even with no
// CTA per SM lost; kept for the A/B and bit-tested
std::atomic<bool> g_post_pf{false};  // set_deltanet_bwd_post_prefetch
// off by default: on the H100 it measured no faster than the DB2 + xb path (session 26, (1,32768,16,128)
// bf16 operands: 4.02 ms on, 3.83 off; the other rows within 2.5%); kept for the A/B and bit-tested
std::atomic<bool> g_serial_ws{false};  // set_deltanet_bwd_serial_ws
std::atomic<bool> g_chunk_kfast{true};  // set_deltanet_bwd_chunk_kfast
std::atomic<int> g_chunk_l2f{1};       // set_deltanet_bwd_chunk_l2
// on by default (H100, session 30, one binary against 163a63a: all four stagings and qraw together took the bf16-operand bwd
// 0.909-0.923x and fwd 0.962-0.980x at the five suite shapes; each alone 0.96-0.99 (wy's the most)); the direct stores stay for the A/B and are bit-tested
std::atomic<bool> g_prep_stage{true};   // set_deltanet_bwd_prep_stage
std::atomic<bool> g_post_stage{true};   // set_deltanet_bwd_post_stage
std::atomic<bool> g_chunk_stage{true};  // set_deltanet_bwd_chunk_stage
// q and Xw double-buffered in the serial kernel: bf16 operands, where the shared memory holds it
bool bwd_serial_db2(const DeltanetBwdParams& p) {
  return g_serial_db2.load() && !p.hilo && BsLayout(p.K, false, 2).bytes <= smem_per_block_optin();
}

}  // namespace

bool set_deltanet_bwd_serial_db2(bool enabled) { return g_serial_db2.exchange(enabled); }
bool set_deltanet_bwd_serial_ws(bool on) { return g_serial_ws.exchange(on); }
bool set_deltanet_bwd_chunk_kfast(bool on) { return g_chunk_kfast.exchange(on); }
int set_deltanet_bwd_chunk_l2(int mode) { return g_chunk_l2f.exchange(mode < 0 ? 0 : mode > 2 ? 2 : mode); }
bool set_deltanet_bwd_post_prefetch(bool on) { return g_post_pf.exchange(on); }
bool set_deltanet_bwd_prep_stage(bool on) { return g_prep_stage.exchange(on); }
bool set_deltanet_bwd_post_stage(bool on) { return g_post_stage.exchange(on); }
bool set_deltanet_bwd_chunk_stage(bool on) { return g_chunk_stage.exchange(on); }

bool deltanet_bwd_state_tc_applies(const DeltanetBwdParams& p) {
  // sm_80 opts in to 163 KB of shared memory per block, the serial kernel's K = 128 layout needs
  // 211 KB: there the state pass runs on CUDA cores (the fp32 path's kernel) instead of failing at launch
  return deltanet_chunk_tc_applies(p) && p.do_.dtype == DType::bf16 &&
         BsLayout(p.K, p.hilo).bytes <= smem_per_block_optin() && BqLayout(p.K, p.hilo).bytes <= smem_per_block_optin();
}

void deltanet_bwd_state_tc(const DeltanetBwdParams& p, const DnBwdWs& w, float* ws, Stream stream, void* before_post,
                           void* before_serial) {
  const std::int64_t seqs = p.N * p.H, slots = deltanet_slots(p);
  if (seqs == 0 || slots == 0) return;
  if (slots > 0x7fffffff) throw Error(cat("deltanet_bwd: grid too large (", slots, " chunks)"));
  const auto st = reinterpret_cast<cudaStream_t>(stream);
  const bool vq = rows16_seq(p.q), vk = rows16_seq(p.k), vo = rows16_seq(p.do_);
  const BpLayout lp(p.K);
  auto* prep = p.hilo ? &deltanet_bwd_prep_kernel<true> : &deltanet_bwd_prep_kernel<false>;
  if (deltanet_fixed_k(p)) prep = p.hilo ? &deltanet_bwd_prep_kernel<true, 128> : &deltanet_bwd_prep_kernel<false, 128>;
  if (!p.hilo && w.xb && g_prep_stage.load(std::memory_order_relaxed))  // dD0 staged (bf16)
    prep = deltanet_fixed_k(p) ? &deltanet_bwd_prep_kernel<false, 128, true> : &deltanet_bwd_prep_kernel<false, 0, true>;
  // the serial kernel with dS in registers where it applies; with rs.qraw it reads q itself: no Q^
  const DnRsPlan rs = deltanet_bwd_serial_rs_plan(p, w, vq, vk, vo);
  (void)resident_ctas_per_sm(reinterpret_cast<const void*>(prep), kThreads, lp.bytes);
  prep<<<dim3(unsigned(slots), unsigned(p.H)), kThreads, lp.bytes, st>>>(p, w, ws, vq, vk, vo, rs.applies && rs.qraw);
  FW_CUDA_CHECK_LAUNCH("deltanet_bwd (state pass: prep)");
  if (before_serial)  // the recompute's wy kernel (Xw), run beside prep
    FW_CUDA_CHECK("deltanet_bwd (join the recompute's wy)", cudaStreamWaitEvent(st, static_cast<cudaEvent_t>(before_serial), 0));
  const bool db2 = bwd_serial_db2(p);
  const int tw = deltanet_bwd_serial_tile(p);  // 32 where 64-column CTAs would leave SMs idle
  const bool two = db2 && deltanet_serial_two_sync();
  const BsLayout ls(p.K, p.hilo, db2 ? 2 : 1, tw);
  auto* serial = p.hilo ? &deltanet_bwd_state_tc_kernel<true, false>
                        : (db2 ? &deltanet_bwd_state_tc_kernel<false, true> : &deltanet_bwd_state_tc_kernel<false, false>);
  if (tw == 32)
    serial = p.hilo ? &deltanet_bwd_state_tc_kernel<true, false, 32>
                    : (db2 ? &deltanet_bwd_state_tc_kernel<false, true, 32> : &deltanet_bwd_state_tc_kernel<false, false, 32>);
  if (deltanet_fixed_k(p)) {
    if (tw == 32)
      serial = p.hilo ? &deltanet_bwd_state_tc_kernel<true, false, 32, 128>
                      : (db2 ? &deltanet_bwd_state_tc_kernel<false, true, 32, 128>
                             : &deltanet_bwd_state_tc_kernel<false, false, 32, 128>);
    else
      serial = p.hilo ? &deltanet_bwd_state_tc_kernel<true, false, 64, 128>
                      : (db2 ? &deltanet_bwd_state_tc_kernel<false, true, 64, 128>
                             : &deltanet_bwd_state_tc_kernel<false, false, 64, 128>);
  }
  const std::int64_t vtw = (p.V + tw - 1) / tw;
  if (vtw > 65535) throw Error(cat("deltanet_bwd: grid too large (", vtw, " V tiles)"));
  // the warp-specialised form where its producer's paths hold (bf16 operands with bf16 dD0 / Y and
  // double-buffered operands, 32-column tiles, cp.async rows of k and dO, K % 8 == 0 for the Q^ and Xw
  // rows, V % 8 == 0 for the dD0 rows and whole dSe pieces) and a binary for sm_90
  auto* wsfn = deltanet_fixed_k(p) ? &deltanet_bwd_state_ws_kernel<128> : &deltanet_bwd_state_ws_kernel<0>;
  const BwLayout lw(p.K);
  const bool use_ws = g_serial_ws.load(std::memory_order_relaxed) && !p.hilo && db2 && w.xb && tw == 32 && vk && vo &&
                      p.K % 8 == 0 && p.V % 8 == 0 && lw.bytes <= smem_per_block_optin() &&
                      kernel_binary_version(reinterpret_cast<const void*>(wsfn)) >= 90;
  if (rs.applies) {
    deltanet_bwd_serial_rs_launch(rs, p, w, ws, stream);  // dS in registers (deltanet_bwd_rs.cu)
  } else if (use_ws) {
    (void)resident_ctas_per_sm(reinterpret_cast<const void*>(wsfn), kBwWsThreads, lw.bytes);
    wsfn<<<dim3(unsigned(seqs), unsigned(vtw)), kBwWsThreads, lw.bytes, st>>>(p, w, ws);
  } else {
    (void)resident_ctas_per_sm(reinterpret_cast<const void*>(serial), kBsThreads, ls.bytes);
    serial<<<dim3(unsigned(seqs), unsigned(vtw)), kBsThreads, ls.bytes, st>>>(p, w, ws, vq, vk, vo, p.K % 8 == 0, two);
  }
  FW_CUDA_CHECK_LAUNCH("deltanet_bwd (state pass: serial)");
  if (before_post)
    FW_CUDA_CHECK("deltanet_bwd (join the recompute)", cudaStreamWaitEvent(st, static_cast<cudaEvent_t>(before_post), 0));
  auto* post = p.hilo ? &deltanet_bwd_post_kernel<true> : &deltanet_bwd_post_kernel<false>;
  if (deltanet_fixed_k(p)) post = p.hilo ? &deltanet_bwd_post_kernel<true, 128> : &deltanet_bwd_post_kernel<false, 128>;
  if (!p.hilo && w.xb && g_post_stage.load(std::memory_order_relaxed))  // -Y and dv staged (bf16)
    post = deltanet_fixed_k(p) ? &deltanet_bwd_post_kernel<false, 128, true> : &deltanet_bwd_post_kernel<false, 0, true>;
  const auto post_fn = reinterpret_cast<const void*>(post);
  // pf (every V tile's dD, X loaded at the start): bf16 operands with bf16 dD / X and at most two V
  // tiles, where it fits and costs no resident CTA per SM
  const BqLayout lq0(p.K, p.hilo), lqp(p.K, false, true);
  const bool pf = g_post_pf.load(std::memory_order_relaxed) && !p.hilo && w.xb && p.V <= 2 * kT &&
                  lqp.bytes <= smem_per_block_optin() &&
                  resident_ctas_per_sm(post_fn, kThreads, lqp.bytes) >= resident_ctas_per_sm(post_fn, kThreads, lq0.bytes);
  const std::size_t qbytes = pf ? lqp.bytes : lq0.bytes;
  (void)resident_ctas_per_sm(post_fn, kThreads, qbytes);
  post<<<dim3(unsigned(slots), unsigned(p.H)), kThreads, qbytes, st>>>(p, w, ws, vk, pf);
  FW_CUDA_CHECK_LAUNCH("deltanet_bwd (state pass: post)");
}

// Whether pairs of the chunk pass's CTAs can be resident as clusters of 2 on this device (a GPU whose
// partitions, e.g. MIG slices, cannot place them would fail the launch): asked once per device and
// shared-memory size; the fused L2 epilogue falls back to the L2 kernel where not.
static bool chunk_pair_clusters_fit(const void* kernel, const cudaLaunchConfig_t& cfg) {
  static std::mutex mu;
  static std::map<std::pair<int, std::size_t>, bool> known;
  int dev = 0;
  FW_CUDA_CHECK("deltanet_bwd (chunk pass)", cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_pair(dev, cfg.dynamicSmemBytes);
  if (auto it = known.find(key); it != known.end()) return it->second;
  int clusters = 0;
  const cudaError_t e = cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg);
  if (e != cudaSuccess) (void)cudaGetLastError();  // not an error of the caller's: the unfused path runs
  return known[key] = e == cudaSuccess && clusters > 0;
}

bool deltanet_bwd_chunk_tc(const DeltanetBwdParams& p, const DnBwdWs& w, float* ws, Stream stream, bool l2_vec) {
  const std::int64_t slots = deltanet_slots(p), kt = (p.K + kT - 1) / kT;
  if (slots == 0 || p.N * p.H == 0) return false;
  const BcLayout lay(p.hilo);
  auto* chunk = p.hilo ? &deltanet_bwd_chunk_tc_kernel<true> : &deltanet_bwd_chunk_tc_kernel<false>;
  (void)resident_ctas_per_sm(reinterpret_cast<const void*>(chunk), kBcThreads, lay.bytes);
  const bool kfast = g_chunk_kfast.load(std::memory_order_relaxed) && kt > 1 && slots * kt <= 0x7fffffff;
  const dim3 grid = kfast ? dim3(unsigned(slots * kt), unsigned(p.H), 1u) : dim3(unsigned(slots), unsigned(p.H), unsigned(kt));
  // the L2-norm backward fused in (chunk_l2_epilogue): bf16 operands, where the L2 vec kernel would
  // run, one K tile, or two as a cluster (grid neighbours, an sm_90 binary)
  // (mode 1, the default: one K tile only; the pair measured 2-4% slower at K = 128, H100 session 27)
  int l2f = 0;
  const int l2mode = g_chunk_l2f.load(std::memory_order_relaxed);
  if (p.l2 && l2_vec && !p.hilo && w.h16 && (p.dq.p || p.dk.p) && l2mode > 0) {
    if (kt == 1) l2f = 1;
    else if (kt == 2 && kfast && l2mode == 2 && kernel_binary_version(reinterpret_cast<const void*>(chunk)) >= 90) l2f = 2;
  }
  const auto st = reinterpret_cast<cudaStream_t>(stream);
  const auto args = [&] { return std::make_tuple(p, w, ws, rows16_seq(p.q), rows16_seq(p.k), rows16_seq(p.do_), kfast ? int(kt) : 0); };
  if (l2f == 2) {
    auto* pair = &deltanet_bwd_chunk_tc_kernel<false, 2>;
    (void)resident_ctas_per_sm(reinterpret_cast<const void*>(pair), kBcThreads, lay.bytes);
    cudaLaunchConfig_t cfg{};
    cudaLaunchAttribute at[1];
    cfg.gridDim = grid, cfg.blockDim = dim3(kBcThreads), cfg.dynamicSmemBytes = lay.bytes, cfg.stream = st;
    at[0].id = cudaLaunchAttributeClusterDimension;
    at[0].val.clusterDim.x = 2, at[0].val.clusterDim.y = 1, at[0].val.clusterDim.z = 1;
    cfg.attrs = at, cfg.numAttrs = 1;
    if (chunk_pair_clusters_fit(reinterpret_cast<const void*>(pair), cfg)) {
      std::apply([&](auto... a) {
        FW_CUDA_CHECK("deltanet_bwd (chunk pass, tensor cores, L2 norm fused)", cudaLaunchKernelEx(&cfg, pair, a...));
      }, args());
    } else {
      l2f = 0;  // unfused instead
    }
  }
  if (l2f == 1) {
    auto* one = &deltanet_bwd_chunk_tc_kernel<false, 1>;
    (void)resident_ctas_per_sm(reinterpret_cast<const void*>(one), kBcThreads, lay.bytes);
    std::apply([&](auto... a) { one<<<grid, kBcThreads, lay.bytes, st>>>(a...); }, args());
  } else if (l2f == 0) {
    if (!p.hilo && p.l2 && w.h16 && p.K % 8 == 0 && g_chunk_stage.load(std::memory_order_relaxed)) {
      chunk = &deltanet_bwd_chunk_tc_kernel<false, 0, true>;  // dq^, dk^ staged
      (void)resident_ctas_per_sm(reinterpret_cast<const void*>(chunk), kBcThreads, lay.bytes);
    }
    std::apply([&](auto... a) { chunk<<<grid, kBcThreads, lay.bytes, st>>>(a...); }, args());
  }
  FW_CUDA_CHECK_LAUNCH("deltanet_bwd (chunk pass, tensor cores)");
  return l2f != 0;
}

}  // namespace fastweight::detail
