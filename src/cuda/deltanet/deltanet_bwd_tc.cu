// deltanet_bwd_tc.cu: the backward's state pass on tensor cores (bf16 q, k, v, do; K <= 128), after
// the tensor-core recompute (deltanet_chunk_tc.cu) stored T2 = (I + Lg W)^-1 per chunk. One CTA
// (4 warps) per (sequence, head, 64 columns of V), chunks in reverse, dS in fp32 registers. Per chunk
// (deltanet_bwd.cu for the algebra; W = diag(beta), rq, rk the L2 factors, Lg = strict_lower(K^ K^T),
// M = tril(Q^ K^T)), with dSe = dL/dS leaving the chunk:
//   dD = s M^T dO + K^ dSe,   dR = W Y = T2^T W dD,   Y = dD - Lg^T dR   ((I + W Lg)^T Y = dD)
//   dv = dR,   dbeta partial = Y . X (this V tile),   dS0 = dSe + s Q^T dO - K^T dR
// Products on tensor cores; where a product feeds dS's chain (dSe, W dD, dR) its operands are bf16
// hi + lo. Writes what the chunk pass reads (deltanet_bwd.cu): dSe per chunk as bf16 hi + lo, Y per
// row, the dbeta partials; and dv, dinitial_state.
#include "cuda/common/check.cuh"
#include "cuda/deltanet/deltanet_common.cuh"
#include "cuda/deltanet/deltanet_cuda.h"
#include "cuda/deltanet/deltanet_tc.cuh"

namespace fastweight::detail {
namespace {

using namespace dtc;
constexpr int kThreads = kTcThreads;

// smem: bf16 q, k [64][ldk] | dO [64][kLd] | (hi, lo pairs, [64][kLd] each) s M^T, T2^T, Lg^T (upper),
//       W dD then -rk dR, dR, s rq dO | dSe hi, lo [Kc][kLd] | f32 rq, rk, beta [64] | f32 dD[64][65] |
//       f32 stg[64][64]: cp.async staging of the next chunk's T2, then of this chunk's X tile (both were
//       loaded where used, on the serial chain: 32 dependent loads per thread for T2 alone)
struct BsLayout {
  int Kc, ldk;
  std::size_t q, k, dO, MTh, MTl, Th, Tl, Lh, Ll, Bh, Bl, Rh, Rl, Uh, Ul, Sh, Sl, rq, rk, beta, dd, stg, bytes;
  __host__ __device__ explicit BsLayout(std::int64_t K) {
    Kc = k_cols(K), ldk = Kc + 8;
    const std::size_t t64 = 2 * std::size_t(kT) * kLd;  // bytes of a (64, kLd) bf16 tile
    q = 0, k = q + 2 * std::size_t(kT) * ldk, dO = k + 2 * std::size_t(kT) * ldk;
    MTh = dO + t64, MTl = MTh + t64, Th = MTl + t64, Tl = Th + t64, Lh = Tl + t64, Ll = Lh + t64;
    Bh = Ll + t64, Bl = Bh + t64, Rh = Bl + t64, Rl = Rh + t64, Uh = Rl + t64, Ul = Uh + t64;
    Sh = Ul + t64, Sl = Sh + 2 * std::size_t(Kc) * kLd;
    rq = Sl + 2 * std::size_t(Kc) * kLd, rk = rq + 4 * kT, beta = rk + 4 * kT, dd = beta + 4 * kT;
    stg = dd + 4 * 64 * 65, bytes = stg + 4 * 64 * 64;
  }
};

__global__ void __launch_bounds__(kThreads, 1) deltanet_bwd_state_tc_kernel(const DeltanetBwdParams p, const DnBwdWs w,
                                                                            float* __restrict__ ws, bool vq, bool vk,
                                                                            bool vo) {
  extern __shared__ float4 smem_raw[];
  char* base = reinterpret_cast<char*>(smem_raw);
  const BsLayout lay(p.K);
  const int Kc = lay.Kc, ldk = lay.ldk;
  auto tile = [&](std::size_t off) { return reinterpret_cast<bf16*>(base + off); };
  bf16 *sq = tile(lay.q), *sk = tile(lay.k), *sdo = tile(lay.dO);  // (64 rows, Kc) q, k; (64, 64) dO
  bf16 *sMTh = tile(lay.MTh), *sMTl = tile(lay.MTl);  // (64, 64) s M^T: [c][i] = s M_ic
  bf16 *sTh = tile(lay.Th), *sTl = tile(lay.Tl);      // (64, 64) T2^T
  bf16 *sLh = tile(lay.Lh), *sLl = tile(lay.Ll);      // (64, 64) Lg^T: [i][c] = Lg_ci (c > i)
  bf16 *sBh = tile(lay.Bh), *sBl = tile(lay.Bl);      // (64, 64) W dD, then -diag(rk) dR
  bf16 *sRh = tile(lay.Rh), *sRl = tile(lay.Rl);      // (64, 64) dR
  bf16 *sUh = tile(lay.Uh), *sUl = tile(lay.Ul);      // (64, 64) s diag(rq) dO
  bf16 *sSh = tile(lay.Sh), *sSl = tile(lay.Sl);      // (Kc, 64) dSe
  float* s_rq = reinterpret_cast<float*>(base + lay.rq);
  float* s_rk = reinterpret_cast<float*>(base + lay.rk);
  float* s_beta = reinterpret_cast<float*>(base + lay.beta);
  float(*sdd)[65] = reinterpret_cast<float(*)[65]>(base + lay.dd);  // dD (fp32): kept out of registers
  float* stg = reinterpret_cast<float*>(base + lay.stg);             // (64, 64) fp32: T2, then X

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const std::int64_t nh = blockIdx.x, n = nh / p.H, h = nh % p.H;
  const int vt = int(blockIdx.y);
  const std::int64_t c0 = std::int64_t(vt) * kT, K = p.K, V = p.V;
  const DnSeq sq_ = dn_seq(p, n);
  const std::int64_t b = sq_.b;
  const int ngroups = Kc / 16;
  const bool even = V % 2 == 0;

  float acc_s[2][8][4];  // dS (fp32), rows 16 (w + 4 gg)..
  state_load(acc_s, p.dht, n, h, c0, K, V, warp, lane);
  const std::int64_t nch = (sq_.eos - sq_.bos + kT - 1) / kT;
  auto issue_t2 = [&](std::int64_t ci) {  // T2 of chunk ci (64 x 64 fp32, 16-byte aligned) -> stg
    const float* T2w = ws + w.T2 + ((sq_.base + ci) * p.H + h) * 64 * 64;
    for (int e = tid; e < 64 * 16; e += kThreads) cp_async16(stg + 4 * e, T2w + 4 * e, 16);
    cp_async_commit();
  };
  if (nch > 0) issue_t2(nch - 1);
  for (std::int64_t ci = nch - 1; ci >= 0; --ci) {
    const std::int64_t t0 = sq_.bos + ci * kT, slot = sq_.base + ci;
    const int nr = int(lmin(kT, sq_.eos - t0));
    // a. the chunk's q, k, dO tile, beta; dSe as hi + lo; T2^T as hi + lo
    load_tile(sq, ldk, kT, Kc, bf_rows(p.q, b, t0, h), p.q.s1, nr, int(K), vq);
    load_tile(sk, ldk, kT, Kc, bf_rows(p.k, b, t0, h), p.k.s1, nr, int(K), vk);
    load_tile(sdo, kLd, kT, kT, bf_rows(p.do_, b, t0, h) + c0, p.do_.s1, nr, int(lmin(kT, V - c0)), vo);
    cp_async_commit();
    if (tid < kT) s_beta[tid] = tid < nr ? mlstm_ld(p.beta, p.beta.s0 * b + p.beta.s1 * (t0 + tid) + h) : 0.f;
    state_split(acc_s, sSh, sSl, ngroups, warp, lane);
    cp_async_wait<0>();  // the tiles, and T2 (issued a chunk ahead)
    __syncthreads();
    for (int e = tid; e < 64 * 64; e += kThreads) put_split(sTh, sTl, kLd, e % 64, e / 64, stg[e]);  // [a][j] = T2[j][a]
    // dSe for the chunk pass (hi + lo, as the recompute's S)
    store_state_split(ws + w.dS + (slot * p.H + h) * K * V, sSh, sSl, K, V, c0);
    if (tid < kT) s_rq[tid] = row_l2_factor(sq, ldk, Kc, tid, p.l2), s_rk[tid] = row_l2_factor(sk, ldk, Kc, tid, p.l2);
    __syncthreads();  // stg's T2 is read
    stage_ws_rows(stg, ws + w.X, p, b, t0, h, nr, c0, kThreads);  // X: in flight during b .. d
    cp_async_commit();
    // b. this warp's rows of K K^T and Q K^T -> Lg^T (upper) and s M^T (transposed); s diag(rq) dO
    {
      float g[8][4] = {}, m[8][4] = {};
      mma_rn(g, sk, ldk, warp, sk, ldk, Kc, lane);
      mma_rn(m, sq, ldk, warp, sk, ldk, Kc, lane);
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = 16 * warp + frow(lane, e), c = fcol(lane, j, e);
          put_split(sLh, sLl, kLd, i, c, c > i ? s_rk[i] * s_rk[c] * g[j][e] : 0.f);
          put_split(sMTh, sMTl, kLd, c, i, c <= i ? p.scale * s_rq[i] * s_rk[c] * m[j][e] : 0.f);
        }
    }
#pragma unroll 2  // (fully unrolled, the register-bound state pass spilled 16 B more)
    for (int e = tid; e < 64 * 32; e += kThreads) {  // column pairs
      const int i = e / 32, c = 2 * (e % 32);
      const float2 d = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(sdo + i * kLd + c));
      put_split2(sUh, sUl, kLd, i, c, p.scale * s_rq[i] * d.x, p.scale * s_rq[i] * d.y);
    }
    __syncthreads();
    // c. dD = s M^T dO + diag(rk) K dSe (this warp's rows) to smem (fp32); W dD as hi + lo
    {
      float dd[8][4] = {}, kd[8][4] = {};
      mma_rk(dd, sMTh, kLd, warp, sdo, kLd, 64, lane);
      mma_rk(dd, sMTl, kLd, warp, sdo, kLd, 64, lane);
      mma_rk(kd, sk, ldk, warp, sSh, kLd, Kc, lane);
      mma_rk(kd, sk, ldk, warp, sSl, kLd, Kc, lane);
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = 16 * warp + frow(lane, e), c = fcol(lane, j, e);
          dd[j][e] = fmaf(s_rk[i], kd[j][e], dd[j][e]);
          sdd[i][c] = dd[j][e];
          put_split(sBh, sBl, kLd, i, c, s_beta[i] * dd[j][e]);
        }
    }
    __syncthreads();
    // d. dR = T2^T (W dD), as hi + lo (step e reads its own elements back: hi + lo is dR to ~2^-17)
    {
      float dr[8][4] = {};
      mma_rk(dr, sTh, kLd, warp, sBh, kLd, 64, lane);
      mma_rk(dr, sTh, kLd, warp, sBl, kLd, 64, lane);
      mma_rk(dr, sTl, kLd, warp, sBh, kLd, 64, lane);
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) put_split(sRh, sRl, kLd, 16 * warp + frow(lane, e), fcol(lane, j, e), dr[j][e]);
    }
    cp_async_wait<0>();  // X
    __syncthreads();  // dR complete; W dD no longer read; X staged
    // e. Y = dD - Lg^T dR; Y, dv and the dbeta partial Y . X; -diag(rk) dR as hi + lo (for dS)
    {
      float ly[8][4] = {};
      mma_rk(ly, sLh, kLd, warp, sRh, kLd, 64, lane);
      mma_rk(ly, sLh, kLd, warp, sRl, kLd, 64, lane);
      mma_rk(ly, sLl, kLd, warp, sRh, kLd, 64, lane);
      float db[2] = {0.f, 0.f};  // rows 16w + lane/4 and + 8
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; e += 2) {  // columns c, c + 1 of row i
          const int i = 16 * warp + frow(lane, e), c = fcol(lane, j, e);
          const std::int64_t col = c0 + c;
          const float dr0 = __bfloat162float(sRh[i * kLd + c]) + __bfloat162float(sRl[i * kLd + c]);
          const float dr1 = __bfloat162float(sRh[i * kLd + c + 1]) + __bfloat162float(sRl[i * kLd + c + 1]);
          if (i < nr && col < V) {
            const bool has1 = col + 1 < V;
            const float y0 = sdd[i][c] - ly[j][e], y1 = has1 ? sdd[i][c + 1] - ly[j][e + 1] : 0.f;
            const std::int64_t at = dn_ws_row(p, b, t0 + i, h) * V + col;
            const float2 x = make_float2(stg[i * 64 + c], has1 ? stg[i * 64 + c + 1] : 0.f);
            db[e >> 1] = fmaf(y0, x.x, fmaf(y1, x.y, db[e >> 1]));
            store_pair(ws + w.Y + at, y0, y1, has1, even);
            if (p.dv.p) {
              const std::int64_t odv = dn_row(p.dv, b, t0 + i, h) + col;
              mlstm_st(p.dv, odv, dr0);
              if (has1) mlstm_st(p.dv, odv + 1, dr1);
            }
          }
          put_split(sBh, sBl, kLd, i, c, -s_rk[i] * dr0);
          put_split(sBh, sBl, kLd, i, c + 1, -s_rk[i] * dr1);
        }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        db[r] += __shfl_xor_sync(0xffffffffu, db[r], 1);
        db[r] += __shfl_xor_sync(0xffffffffu, db[r], 2);
        const int i = 16 * warp + (lane >> 2) + 8 * r;
        if ((lane & 3) == 0 && i < nr) ws[w.dbp + vt * w.rows + dn_ws_row(p, b, t0 + i, h)] = db[r];
      }
    }
    __syncthreads();  // X is read
    if (ci > 0) issue_t2(ci - 1);
    // f. dS += Q^T (s diag(rq) dO) - K^T (diag(rk) dR)
    state_update(acc_s, sq, ldk, sUh, sUl, ngroups, warp, lane);
    state_update(acc_s, sk, ldk, sBh, sBl, ngroups, warp, lane);
    __syncthreads();  // the next chunk overwrites every tile
  }
  if (p.dh0.p) state_store(acc_s, p.dh0, n, h, c0, K, V, warp, lane);
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
struct BcLayout {
  std::size_t t[9], dG, rq, rk, beta, bytes;
  __host__ __device__ BcLayout() {
    const std::size_t t64 = 2 * std::size_t(kT) * kLd;
    for (int i = 0; i < 9; ++i) t[i] = i * t64;
    dG = 9 * t64, rq = dG + 4 * 64 * 65, rk = rq + 4 * kT, beta = rk + 4 * kT, bytes = beta + 4 * kT;
  }
};

constexpr int kBcThreads = 256;
__global__ void __launch_bounds__(kBcThreads, 2) deltanet_bwd_chunk_tc_kernel(const DeltanetBwdParams p, const DnBwdWs w,
                                                                         float* __restrict__ ws, bool vq, bool vk,
                                                                         bool vo) {
  extern __shared__ float4 smem_raw[];
  char* base = reinterpret_cast<char*>(smem_raw);
  const BcLayout lay;
  auto T = [&](int i) { return reinterpret_cast<bf16*>(base + lay.t[i]); };
  bf16 *sdo = T(0), *sDh = T(1), *sDl = T(2), *sRh = T(3), *sRl = T(4), *sSh = T(5), *sSl = T(6), *sEh = T(7),
       *sEl = T(8);  // sR holds -dR: its products land with the right sign
  float(*sdG)[65] = reinterpret_cast<float(*)[65]>(base + lay.dG);
  float* stg = reinterpret_cast<float*>(base + lay.dG);  // (64, 64) staging of X, Y tiles in the V loop
  float* s_rq = reinterpret_cast<float*>(base + lay.rq);
  float* s_rk = reinterpret_cast<float*>(base + lay.rk);
  float* s_beta = reinterpret_cast<float*>(base + lay.beta);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int mw = warp & 3, half = warp >> 2;  // rows 16 mw.., columns 32 half.. of each 64 x 64 result
  const std::int64_t h = blockIdx.y, k0 = std::int64_t(blockIdx.z) * kT, K = p.K, V = p.V, slot = blockIdx.x;
  DnSeq sq_;
  std::int64_t t0;
  if (!dn_slot(p, slot, sq_, t0)) return;
  const std::int64_t b = sq_.b;
  const int nr = int(lmin(kT, sq_.eos - t0)), nk = int(lmin(kT, K - k0));
  dn_row_factors(p, b, t0, nr, h, tid, s_rq, s_rk, s_beta);  // of the full rows
  __syncthreads();
  const bf16* Sg = reinterpret_cast<const bf16*>(ws + w.S + (slot * p.H + h) * K * V) + k0 * V;
  const bf16* Eg = reinterpret_cast<const bf16*>(ws + w.dS + (slot * p.H + h) * K * V) + k0 * V;
  float a1[4][4] = {}, a2[4][4] = {}, dq[4][4] = {}, dk[4][4] = {};  // a2 = -dR D^T; (16 x 32) each
  for (std::int64_t v0 = 0; v0 < V; v0 += kT) {
    const int nv = int(lmin(kT, V - v0));
    load_tile(sdo, kLd, kT, kT, bf_rows(p.do_, b, t0, h) + v0, p.do_.s1, nr, nv, vo, kBcThreads);
    load_tile(sSh, kLd, kT, kT, Sg + v0, V, nk, nv, V % 8 == 0, kBcThreads);
    load_tile(sSl, kLd, kT, kT, Sg + K * V + v0, V, nk, nv, V % 8 == 0, kBcThreads);
    load_tile(sEh, kLd, kT, kT, Eg + v0, V, nk, nv, V % 8 == 0, kBcThreads);
    load_tile(sEl, kLd, kT, kT, Eg + K * V + v0, V, nk, nv, V % 8 == 0, kBcThreads);
    // D = W X, dR = W Y as hi + lo, through sdG (free until the factors) as cp.async staging: X with
    // the tiles, then Y (per-element loads here were on every V step's critical path)
    auto split_rows = [&](bf16* hi, bf16* lo, float sign) {
      for (int e = tid; e < 64 * 32; e += kBcThreads) {  // column pairs
        const int i = e / 32, c = 2 * (e % 32);
        const float bt = sign * s_beta[i];
        const float x0 = i < nr && c < nv ? stg[i * 64 + c] : 0.f, x1 = i < nr && c + 1 < nv ? stg[i * 64 + c + 1] : 0.f;
        put_split(hi, lo, kLd, i, c, bt * x0), put_split(hi, lo, kLd, i, c + 1, bt * x1);
      }
    };
    stage_ws_rows(stg, ws + w.X, p, b, t0, h, nr, v0, kBcThreads);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    split_rows(sDh, sDl, 1.f);
    __syncthreads();
    stage_ws_rows(stg, ws + w.Y, p, b, t0, h, nr, v0, kBcThreads);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    split_rows(sRh, sRl, -1.f);
    __syncthreads();
    // B operands n-major: this warp's 32 output columns are rows 32 half.. of the B tile
    const int bo = 32 * half * kLd;
    mma_rn(a1, sdo, kLd, mw, sDh + bo, kLd, 64, lane);
    mma_rn(a1, sdo, kLd, mw, sDl + bo, kLd, 64, lane);
    mma_rn(a2, sRh, kLd, mw, sDh + bo, kLd, 64, lane);
    mma_rn(a2, sRh, kLd, mw, sDl + bo, kLd, 64, lane);
    mma_rn(a2, sRl, kLd, mw, sDh + bo, kLd, 64, lane);
    mma_rn(dq, sdo, kLd, mw, sSh + bo, kLd, 64, lane);
    mma_rn(dq, sdo, kLd, mw, sSl + bo, kLd, 64, lane);
    mma_rn(dk, sDh, kLd, mw, sEh + bo, kLd, 64, lane);
    mma_rn(dk, sDh, kLd, mw, sEl + bo, kLd, 64, lane);
    mma_rn(dk, sDl, kLd, mw, sEh + bo, kLd, 64, lane);
    mma_rn(dk, sRh, kLd, mw, sSh + bo, kLd, 64, lane);
    mma_rn(dk, sRh, kLd, mw, sSl + bo, kLd, 64, lane);
    mma_rn(dk, sRl, kLd, mw, sSh + bo, kLd, 64, lane);
    __syncthreads();  // the next tile overwrites every operand
  }
  // the 64 x 64 factors: P1 = s tril(a1) diag(rk) -> T[1, 2]; P2 = (s tril(a1))^T diag(rq) -> T[3, 4];
  // dG = strict_lower(a2) (a2 = -dR D^T) -> sdG, then PE = (dG + dG^T) diag(rk) -> T[5, 6]; q, k tiles -> T[7], T[8]
  bf16 *sP1h = T(1), *sP1l = T(2), *sP2h = T(3), *sP2l = T(4), *sPEh = T(5), *sPEl = T(6), *sq = T(7), *sk = T(8);
  load_tile(sq, kLd, kT, kT, bf_rows(p.q, b, t0, h) + k0, p.q.s1, nr, nk, vq, kBcThreads);
  load_tile(sk, kLd, kT, kT, bf_rows(p.k, b, t0, h) + k0, p.k.s1, nr, nk, vk, kBcThreads);
  cp_async_commit();
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = 16 * mw + frow(lane, e), c = 32 * half + fcol(lane, j, e);
      const float m = c <= i ? p.scale * a1[j][e] : 0.f;
      put_split(sP1h, sP1l, kLd, i, c, m * s_rk[c]);
      put_split(sP2h, sP2l, kLd, c, i, m * s_rq[i]);
      sdG[i][c] = c < i ? a2[j][e] : 0.f;  // dG = -strict_lower(dR D^T)
      dq[j][e] *= p.scale;
    }
  __syncthreads();
  for (int e = tid; e < 64 * 64; e += kBcThreads) {
    const int i = e / 64, c = e % 64;
    put_split(sPEh, sPEl, kLd, i, c, (sdG[i][c] + sdG[c][i]) * s_rk[c]);
  }
  cp_async_wait<0>();
  __syncthreads();
  // B operands k-major: this warp's 32 output columns are columns 32 half.. of q, k
  mma_rk(dq, sP1h, kLd, mw, sk + 32 * half, kLd, 64, lane);
  mma_rk(dq, sP1l, kLd, mw, sk + 32 * half, kLd, 64, lane);
  mma_rk(dk, sP2h, kLd, mw, sq + 32 * half, kLd, 64, lane);
  mma_rk(dk, sP2l, kLd, mw, sq + 32 * half, kLd, 64, lane);
  mma_rk(dk, sPEh, kLd, mw, sk + 32 * half, kLd, 64, lane);
  mma_rk(dk, sPEl, kLd, mw, sk + 32 * half, kLd, 64, lane);
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = 16 * mw + frow(lane, e);
      const std::int64_t c = k0 + 32 * half + fcol(lane, j, e);
      if (i < nr && c < K) dn_store_dqk(p, w, ws, b, t0 + i, h, c, dq[j][e], dk[j][e]);
    }
  if (blockIdx.z == 0) dn_store_dbeta(p, w, ws, b, t0, nr, h, tid);
}

}  // namespace

bool deltanet_bwd_state_tc_applies(const DeltanetBwdParams& p) {
  // sm_80 opts in to 163 KB of shared memory per block, the K = 128 layout needs 209 KB: there the
  // state pass runs on CUDA cores (the fp32 path's kernel) instead of failing at launch
  return deltanet_chunk_tc_applies(p) && p.do_.dtype == DType::bf16 && BsLayout(p.K).bytes <= smem_per_block_optin();
}

void deltanet_bwd_state_tc(const DeltanetBwdParams& p, const DnBwdWs& w, float* ws, Stream stream) {
  const std::int64_t seqs = p.N * p.H, vt = (p.V + kT - 1) / kT;
  if (seqs == 0) return;
  const BsLayout lay(p.K);
  (void)resident_ctas_per_sm(reinterpret_cast<const void*>(&deltanet_bwd_state_tc_kernel), kThreads, lay.bytes);
  deltanet_bwd_state_tc_kernel<<<dim3(unsigned(seqs), unsigned(vt)), kThreads, lay.bytes,
                                 reinterpret_cast<cudaStream_t>(stream)>>>(p, w, ws, rows16_seq(p.q), rows16_seq(p.k),
                                                                           rows16_seq(p.do_));
  FW_CUDA_CHECK_LAUNCH("deltanet_bwd (state pass, tensor cores)");
}

void deltanet_bwd_chunk_tc(const DeltanetBwdParams& p, const DnBwdWs& w, float* ws, Stream stream) {
  const std::int64_t slots = deltanet_slots(p), kt = (p.K + kT - 1) / kT;
  if (slots == 0 || p.N * p.H == 0) return;
  const BcLayout lay;
  (void)resident_ctas_per_sm(reinterpret_cast<const void*>(&deltanet_bwd_chunk_tc_kernel), kBcThreads, lay.bytes);
  deltanet_bwd_chunk_tc_kernel<<<dim3(unsigned(slots), unsigned(p.H), unsigned(kt)), kBcThreads, lay.bytes,
                                 reinterpret_cast<cudaStream_t>(stream)>>>(p, w, ws, rows16_seq(p.q), rows16_seq(p.k),
                                                                           rows16_seq(p.do_));
  FW_CUDA_CHECK_LAUNCH("deltanet_bwd (chunk pass, tensor cores)");
}

}  // namespace fastweight::detail
