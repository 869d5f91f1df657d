// deltanet_bwd.cu: the chunkwise DeltaNet backward, version 1 (fp32 FMA on CUDA cores; exact and
// deterministic first). Per chunk of 64 rows with the state S0 entering it (forward: deltanet_fwd.cu),
// q, k the (L2-normalised) rows, W = diag(beta), Lg = strict_lower(K K^T), M = tril(Q K^T), s = scale:
//   X = R - Lg D with R = V - K S0,  D = W X,  O = s (Q S0 + M D),  S_end = S0 + K^T D.
// Given dO and dSe = dL/dS_end (the carried state gradient), with Y = (I + W Lg)^-T dD:
//   dD  = s M^T dO + K dSe                         dV = dR = W Y        dbeta_i = Y_i . X_i
//   dS0 = dSe + s Q^T dO - K^T dR                  (carried to the previous chunk)
//   dq  = s tril(dO D^T) K + s dO S0^T
//   dk  = s tril(dO D^T)^T Q + D dSe^T - dR S0^T + (dG + dG^T) K,   dG = -strict_lower(dR D^T)
// then the L2-norm backward dx = r (dx^ - x^ (x^ . dx^)) when the kernel normalised q, k.
// (The chunk algebra is checked in float64 against autograd of the loop form in
// tests/python/test_deltanet_design.py.) Kernels, all deterministic (no atomics):
//   1. recompute: S0 of every chunk and X of every row (fp32): the tensor-core pipeline's wy and state
//      kernels (bf16, K <= 128; deltanet_chunk_tc.cu), else the forward version 1 in its saving mode;
//   2. state pass: one CTA per (sequence, head, 64 columns of V), chunks in reverse: dSe saved per
//      chunk, Y and dv per row, dbeta partial sums per column tile; dinitial_state at the end
//      (on tensor cores after the tensor-core recompute: deltanet_bwd_tc.cu);
//   3. chunk pass: one CTA per (chunk, head, 64 columns of K), chunks in parallel: dq, dk, dbeta
//      (likewise on tensor cores after the tensor-core state pass);
//   4. with the in-kernel L2 norm: a warp per row of q or k maps dq^, dk^ to dq, dk.
// On tensor cores, where the serial grids leave half the SMs idle (long sequences, few heads), 1's
// state kernel runs on a second stream beside 2's prep + serial kernels (deltanet_bwd_overlap).
#include <algorithm>
#include <atomic>
#include <mutex>
#include <optional>
#include <vector>

#include "cuda/common/check.cuh"
#include "cuda/common/stream_fork.h"
#include "cuda/common/mma.cuh"
#include "cuda/deltanet/deltanet_common.cuh"
#include "cuda/deltanet/deltanet_cuda.h"

namespace fastweight::detail {
namespace {

constexpr int kC = int(kDeltanetChunk);  // chunk length and tile edge
constexpr int kThreads = 256;            // 16 x 16 threads, 4 x 4 elements of a 64 x 64 tile each
constexpr int kMaxK = int(kDeltanetFwdMaxK);

// A (64, 64) tile of a (B, T, H, D) view: rows t0.. of the chunk (scaled by r[i]), columns col0..;
// zero past the chunk's nc rows and past D.
__device__ __forceinline__ void load_rows(float (*tile)[kC + 1], const StridedView& t, const float* r, std::int64_t b,
                                          std::int64_t t0, int nc, std::int64_t h, std::int64_t col0, std::int64_t D,
                                          int tid) {
  for (int e = tid; e < kC * kC; e += kThreads) {
    const int i = e / kC, x = e % kC;
    tile[i][x] = i < nc && col0 + x < D ? r[i] * mlstm_ld(t, dn_row(t, b, t0 + i, h) + col0 + x) : 0.f;
  }
}

// ---- 2. state pass --------------------------------------------------------------------------------
struct SmemState {
  float dS[kMaxK][kC + 1];  // (K, 64) dL/dS at the current chunk's end, this CTA's columns
  float a[kC][kC + 1];      // (64, 64) q^ tile (rows x 64 columns of K)
  float b[kC][kC + 1];      // (64, 64) k^ tile
  float G[kC][kC + 1];      // (64, 64) beta_i (k^_i . k^_j)
  float M[kC][kC + 1];      // (64, 64) q^_i . k^_j for j <= i, else 0
  float O[kC][kC + 1];      // (64, 64) dO rows x this CTA's columns
  float Y[kC][kC + 1];      // (64, 64) dD, then Y, then dR = beta Y
  float rq[kC], rk[kC], beta[kC];
  float part[4][kC];        // partial sums of the substitution
};

// (kThreads, 1): one CTA per SM (168 KB of smem) lets ptxas keep every accumulator in registers.
__global__ void __launch_bounds__(kThreads, 1) deltanet_bwd_state_kernel(const DeltanetBwdParams p, const DnBwdWs w,
                                                                         float* __restrict__ ws) {
  extern __shared__ float4 smem_raw[];
  SmemState& sm = *reinterpret_cast<SmemState*>(smem_raw);
  const int tid = threadIdx.x, tr = tid / 16, tc = tid % 16;
  const std::int64_t nh = blockIdx.x, n = nh / p.H, h = nh % p.H;
  const int vt = int(blockIdx.y);
  const std::int64_t c0 = std::int64_t(vt) * kC, K = p.K, V = p.V;
  const DnSeq sq = dn_seq(p, n);
  const std::int64_t b = sq.b;

  for (std::int64_t e = tid; e < K * kC; e += kThreads) {  // dS = dL/d final state (or 0)
    const std::int64_t a = e / kC, c = e % kC;
    sm.dS[a][c] = p.dht.p && c0 + c < V ? mlstm_ld(p.dht, n * p.dht.s0 + h * p.dht.s1 + a * p.dht.s2 + c0 + c) : 0.f;
  }
  __syncthreads();

  const std::int64_t nchunks = (sq.eos - sq.bos + kC - 1) / kC;
  for (std::int64_t ci = nchunks - 1; ci >= 0; --ci) {
    const std::int64_t t0 = sq.bos + ci * kC;
    const int nc = int(std::min<std::int64_t>(kC, sq.eos - t0));
    dn_row_factors(p, b, t0, nc, h, tid, sm.rq, sm.rk, sm.beta);
    {  // dSe of this chunk for the chunk pass
      float* dst = ws + w.dS + ((sq.base + ci) * p.H + h) * K * V;
      for (std::int64_t e = tid; e < K * kC; e += kThreads) {
        const std::int64_t a = e / kC, c = e % kC;
        if (c0 + c < V) dst[a * V + c0 + c] = sm.dS[a][c];
      }
    }
    __syncthreads();
    // G = K K^T, M = Q K^T and K dSe, over K tiles
    float g[4][4] = {}, m[4][4] = {}, kd[4][4] = {};
    for (std::int64_t xt = 0; xt < K; xt += kC) {
      load_rows(sm.a, p.q, sm.rq, b, t0, nc, h, xt, K, tid);
      load_rows(sm.b, p.k, sm.rk, b, t0, nc, h, xt, K, tid);
      __syncthreads();
      const int xn = int(std::min<std::int64_t>(kC, K - xt));
      for (int x = 0; x < xn; ++x)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float ki = sm.b[4 * tr + i][x], qi = sm.a[4 * tr + i][x];
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const float kj = sm.b[4 * tc + j][x];
            g[i][j] = fmaf(ki, kj, g[i][j]);
            m[i][j] = fmaf(qi, kj, m[i][j]);
            kd[i][j] = fmaf(ki, sm.dS[xt + x][4 * tc + j], kd[i][j]);
          }
        }
      __syncthreads();
    }
    for (int e = tid; e < kC * kC; e += kThreads) {  // dO tile
      const int i = e / kC, c = e % kC;
      sm.O[i][c] = i < nc && c0 + c < V ? mlstm_ld(p.do_, dn_row(p.do_, b, t0 + i, h) + c0 + c) : 0.f;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int r = 4 * tr + i, c = 4 * tc + j;
        sm.G[r][c] = sm.beta[r] * g[i][j];
        sm.M[r][c] = c <= r ? m[i][j] : 0.f;
      }
    __syncthreads();
    // dD = s M^T dO + K dSe (rows past nc are 0: their q^, k^, dO rows are 0)
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int r = 4 * tr + i, c = 4 * tc + j;
        float acc = 0.f;
        for (int ii = r; ii < nc; ++ii) acc = fmaf(sm.M[ii][r], sm.O[ii][c], acc);
        sm.Y[r][c] = fmaf(p.scale, acc, kd[i][j]);
      }
    __syncthreads();
    // Y_i = dD_i - sum_{j > i} beta_j G_ji Y_j: rows in reverse; 64 columns x 4 partial sums per row
    {
      const int col = tid % kC, part = tid / kC;
      for (int i = nc - 1; i >= 0; --i) {
        float acc = 0.f;
        for (int j = i + 1 + part; j < nc; j += 4) acc = fmaf(sm.G[j][i], sm.Y[j][col], acc);
        sm.part[part][col] = acc;
        __syncthreads();
        if (part == 0) sm.Y[i][col] -= (sm.part[0][col] + sm.part[1][col]) + (sm.part[2][col] + sm.part[3][col]);
        __syncthreads();
      }
    }
    // Y and dv = beta Y per row, dbeta partial Y . X over this tile; Y <- dR = beta Y
    {
      const int i = tid / 4, q4 = tid % 4;  // row i, columns 16 q4 .. 16 q4 + 15
      float db = 0.f;
      if (i < nc) {
        const std::int64_t row = dn_ws_row(p, b, t0 + i, h);
        float* yw = ws + w.Y + row * V;
        const float* xw = ws + w.X + row * V;
        const std::int64_t odv = p.dv.p ? dn_row(p.dv, b, t0 + i, h) : 0;
        for (int cc = 0; cc < 16; ++cc) {
          const int c = 16 * q4 + cc;
          if (c0 + c >= V) break;
          const float y = sm.Y[i][c], dr = sm.beta[i] * y;
          yw[c0 + c] = y;
          db = fmaf(y, xw[c0 + c], db);
          if (p.dv.p) mlstm_st(p.dv, odv + c0 + c, dr);
          sm.Y[i][c] = dr;
        }
      }
      db += __shfl_xor_sync(0xffffffffu, db, 1);
      db += __shfl_xor_sync(0xffffffffu, db, 2);
      if (q4 == 0 && i < nc) ws[w.dbp + vt * w.rows + dn_ws_row(p, b, t0 + i, h)] = db;
    }
    __syncthreads();
    // dS0 = dSe + s Q^T dO - K^T dR, over K tiles (rows a of dS)
    for (std::int64_t xt = 0; xt < K; xt += kC) {
      load_rows(sm.a, p.q, sm.rq, b, t0, nc, h, xt, K, tid);
      load_rows(sm.b, p.k, sm.rk, b, t0, nc, h, xt, K, tid);
      __syncthreads();
      float uq[4][4] = {}, uk[4][4] = {};
      for (int i = 0; i < nc; ++i)
#pragma unroll
        for (int aa = 0; aa < 4; ++aa) {
          const float qa = sm.a[i][4 * tr + aa], ka = sm.b[i][4 * tr + aa];
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            uq[aa][j] = fmaf(qa, sm.O[i][4 * tc + j], uq[aa][j]);
            uk[aa][j] = fmaf(ka, sm.Y[i][4 * tc + j], uk[aa][j]);
          }
        }
#pragma unroll
      for (int aa = 0; aa < 4; ++aa)
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (xt + 4 * tr + aa < K) sm.dS[xt + 4 * tr + aa][4 * tc + j] += fmaf(p.scale, uq[aa][j], -uk[aa][j]);
      __syncthreads();
    }
  }
  if (p.dh0.p)
    for (std::int64_t e = tid; e < K * kC; e += kThreads) {
      const std::int64_t a = e / kC, c = e % kC;
      if (c0 + c < V) mlstm_st(p.dh0, n * p.dh0.s0 + h * p.dh0.s1 + a * p.dh0.s2 + c0 + c, sm.dS[a][c]);
    }
}

// ---- 3. chunk pass --------------------------------------------------------------------------------
struct SmemChunk {
  float O[kC][kC + 1];   // (64, 64) dO tile (rows x 64 columns of V); then s tril(dO D^T)
  float D[kC][kC + 1];   // (64, 64) D = beta X tile; then dG + dG^T
  float R[kC][kC + 1];   // (64, 64) dR = beta Y tile; then the q^ tile (rows x this CTA's K columns)
  float S[kC][kC + 1];   // (64, 64) S0 (this CTA's 64 rows of K x 64 columns of V); then the k^ tile
  float dS[kC][kC + 1];  // (64, 64) dSe, likewise
  float rq[kC], rk[kC], beta[kC];
};

// s_split / ds_split: the chunk states / their gradients are bf16 hi + lo (the tensor-core recompute /
// state pass), else fp32.
__global__ void __launch_bounds__(kThreads) deltanet_bwd_chunk_kernel(const DeltanetBwdParams p, const DnBwdWs w,
                                                                      float* __restrict__ ws, bool s_split,
                                                                      bool ds_split) {
  extern __shared__ float4 smem_raw[];
  SmemChunk& sm = *reinterpret_cast<SmemChunk*>(smem_raw);
  const int tid = threadIdx.x, tr = tid / 16, tc = tid % 16;
  const std::int64_t slot = blockIdx.x, h = blockIdx.y, k0 = std::int64_t(blockIdx.z) * kC, K = p.K, V = p.V;
  DnSeq sq;
  std::int64_t t0;
  if (!dn_slot(p, slot, sq, t0)) return;  // an unused slot (varlen): uniform over the CTA
  const std::int64_t b = sq.b;
  const int nc = int(std::min<std::int64_t>(kC, sq.eos - t0));
  dn_row_factors(p, b, t0, nc, h, tid, sm.rq, sm.rk, sm.beta);
  __syncthreads();

  const float* Sw = ws + w.S + (slot * p.H + h) * K * V;
  const float* dSw = ws + w.dS + (slot * p.H + h) * K * V;
  // a1 = dO D^T, a2 = dR D^T (rows 4tr+i, columns 4tc+j); dq0 = dO S0^T, dk0 = D dSe^T - dR S0^T
  // (rows 4tr+i, K columns k0 + 4tc+j), over 64-column tiles of V
  float a1[4][4] = {}, a2[4][4] = {}, dq0[4][4] = {}, dk0[4][4] = {};
  for (std::int64_t v0 = 0; v0 < V; v0 += kC) {
    for (int e = tid; e < kC * kC; e += kThreads) {
      const int i = e / kC, c = e % kC;
      const bool in = i < nc && v0 + c < V;
      const std::int64_t row = dn_ws_row(p, b, t0 + i, h);
      sm.O[i][c] = in ? mlstm_ld(p.do_, dn_row(p.do_, b, t0 + i, h) + v0 + c) : 0.f;
      sm.D[i][c] = in ? sm.beta[i] * ws[w.X + row * V + v0 + c] : 0.f;
      sm.R[i][c] = in ? sm.beta[i] * ws[w.Y + row * V + v0 + c] : 0.f;
      const bool sin = k0 + i < K && v0 + c < V;  // here i is a row of K
      const std::int64_t at = (k0 + i) * V + v0 + c;
      sm.S[i][c] = !sin ? 0.f
                   : s_split ? __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(Sw)[at]) +
                                   __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(Sw)[K * V + at])
                             : Sw[at];
      sm.dS[i][c] = !sin ? 0.f
                    : ds_split ? __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(dSw)[at]) +
                                     __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(dSw)[K * V + at])
                               : dSw[at];
    }
    __syncthreads();
    for (int x = 0; x < kC; ++x)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float oi = sm.O[4 * tr + i][x], di = sm.D[4 * tr + i][x], ri = sm.R[4 * tr + i][x];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float dj = sm.D[4 * tc + j][x], sj = sm.S[4 * tc + j][x], dsj = sm.dS[4 * tc + j][x];
          a1[i][j] = fmaf(oi, dj, a1[i][j]);
          a2[i][j] = fmaf(ri, dj, a2[i][j]);
          dq0[i][j] = fmaf(oi, sj, dq0[i][j]);
          dk0[i][j] = fmaf(di, dsj, fmaf(-ri, sj, dk0[i][j]));
        }
      }
    __syncthreads();
  }
  // O <- s tril(dO D^T); D <- dG = -strict_lower(dR D^T); R, S <- the q^, k^ tiles of this CTA's K columns
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = 4 * tr + i, c = 4 * tc + j;
      sm.O[r][c] = c <= r ? p.scale * a1[i][j] : 0.f;
      sm.D[r][c] = c < r ? -a2[i][j] : 0.f;
    }
  load_rows(sm.R, p.q, sm.rq, b, t0, nc, h, k0, K, tid);
  load_rows(sm.S, p.k, sm.rk, b, t0, nc, h, k0, K, tid);
  __syncthreads();
  // dq^ = s tril(dO D^T) K^ + s dO S0^T;  dk^ = (s tril(dO D^T))^T Q^ + (dG + dG^T) K^ + dk0
  float dq[4][4], dk[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) dq[i][j] = p.scale * dq0[i][j], dk[i][j] = dk0[i][j];
  for (int jj = 0; jj < nc; ++jj)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = 4 * tr + i;
      const float m = sm.O[r][jj], mt = sm.O[jj][r], e = sm.D[r][jj] + sm.D[jj][r];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float kj = sm.S[jj][4 * tc + j];
        dq[i][j] = fmaf(m, kj, dq[i][j]);
        dk[i][j] = fmaf(mt, sm.R[jj][4 * tc + j], fmaf(e, kj, dk[i][j]));
      }
    }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = 4 * tr + i;
    if (r >= nc) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const std::int64_t c = k0 + 4 * tc + j;
      if (c < K) dn_store_dqk(p, w, ws, b, t0 + r, h, c, dq[i][j], dk[i][j]);
    }
  }
  if (blockIdx.z == 0) dn_store_dbeta(p, w, ws, b, t0, nc, h, tid);
}

// ---- 4. L2-norm backward: dx = r (dx^ - x^ (x^ . dx^)), x^ = r x, r = (|x|^2 + 1e-6)^-1/2 ----------
constexpr int kL2Warps = 8;

__global__ void __launch_bounds__(32 * kL2Warps) deltanet_bwd_l2_kernel(const DeltanetBwdParams p, const DnBwdWs w,
                                                                        const float* __restrict__ ws) {
  const std::int64_t g = std::int64_t(blockIdx.x) * kL2Warps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (g >= 2 * w.rows) return;
  const std::int64_t row = g / 2;
  const bool isk = g % 2;
  const StridedView& x = isk ? p.k : p.q;
  const StridedView& out = isk ? p.dk : p.dq;
  if (!out.p) return;
  const std::int64_t h = row % p.H, bt = row / p.H, t = bt % p.T, b = bt / p.T, K = p.K;
  const std::int64_t ox = dn_row(x, b, t, h), oo = dn_row(out, b, t, h);
  const float* gx = ws + (isk ? w.dkh : w.dqh) + row * K;  // fp32 rows, or bf16 (w.h16)
  const __nv_bfloat16* gx16 = reinterpret_cast<const __nv_bfloat16*>(ws + (isk ? w.dkh : w.dqh)) + row * K;
  auto dxh = [&](std::int64_t c) { return w.h16 ? __bfloat162float(gx16[c]) : gx[c]; };
  float ss = 0.f, dot = 0.f;
  for (std::int64_t c = lane; c < K; c += 32) {
    const float xc = mlstm_ld(x, ox + c);
    ss = fmaf(xc, xc, ss), dot = fmaf(xc, dxh(c), dot);
  }
  for (int o = 16; o > 0; o /= 2) {
    ss += __shfl_xor_sync(0xffffffffu, ss, o);
    dot += __shfl_xor_sync(0xffffffffu, dot, o);
  }
  const float r = rsqrtf(ss + 1e-6f), rdot = r * r * dot;  // x^ . dx^ = r (x . dx^); times x^ = r x
  for (std::int64_t c = lane; c < K; c += 32) mlstm_st(out, oo + c, r * (dxh(c) - mlstm_ld(x, ox + c) * rdot));
}

// The same for bf16 q, k, dq, dk with K <= 128, K % 4 == 0 and 8-byte aligned rows (the common case):
// one warp per row for q and k together, lane l holds columns 4l..4l+3 of both in registers (one
// 8-byte load of x, one 16-byte load of dx^ (8-byte where it is bf16), one 8-byte store): one pass, no reload, twice the bytes
// in flight per warp. The element-wise kernel above took 0.64 ms at (4,4096,16,128): ~3x its bytes.
__global__ void __launch_bounds__(32 * kL2Warps) deltanet_bwd_l2_vec_kernel(const DeltanetBwdParams p, const DnBwdWs w,
                                                                            const float* __restrict__ ws) {
  const std::int64_t row = std::int64_t(blockIdx.x) * kL2Warps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32, c = 4 * lane;
  if (row >= w.rows) return;
  const std::int64_t h = row % p.H, bt = row / p.H, t = bt % p.T, b = bt / p.T, K = p.K;
  const bool in = c < K;
  float x[2][4] = {}, g[2][4] = {};  // (q, k) x columns c..c+3
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const StridedView& xv = u ? p.k : p.q;
    if (!in || !(u ? p.dk.p : p.dq.p)) continue;
    const uint2 raw = *reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(xv.p) + dn_row(xv, b, t, h) + c);
    const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
    const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
    x[u][0] = lo.x, x[u][1] = lo.y, x[u][2] = hi.x, x[u][3] = hi.y;
    if (w.h16) {  // dx^ as bf16: one 8-byte load
      const uint2 gr = *reinterpret_cast<const uint2*>(reinterpret_cast<const __nv_bfloat16*>(ws + (u ? w.dkh : w.dqh)) +
                                                       row * K + c);
      const float2 g0 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&gr.x));
      const float2 g1 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&gr.y));
      g[u][0] = g0.x, g[u][1] = g0.y, g[u][2] = g1.x, g[u][3] = g1.y;
    } else {
      const float4 gg = *reinterpret_cast<const float4*>(ws + (u ? w.dkh : w.dqh) + row * K + c);
      g[u][0] = gg.x, g[u][1] = gg.y, g[u][2] = gg.z, g[u][3] = gg.w;
    }
  }
  float ss[2], dot[2];
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    ss[u] = fmaf(x[u][3], x[u][3], fmaf(x[u][2], x[u][2], fmaf(x[u][1], x[u][1], x[u][0] * x[u][0])));
    dot[u] = fmaf(x[u][3], g[u][3], fmaf(x[u][2], g[u][2], fmaf(x[u][1], g[u][1], x[u][0] * g[u][0])));
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2)
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      ss[u] += __shfl_xor_sync(0xffffffffu, ss[u], o);
      dot[u] += __shfl_xor_sync(0xffffffffu, dot[u], o);
    }
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const StridedView& out = u ? p.dk : p.dq;
    if (!in || !out.p) continue;
    const float r = rsqrtf(ss[u] + 1e-6f), rdot = r * r * dot[u];
    uint2 o;
    o.x = pack_bf16(r * (g[u][0] - x[u][0] * rdot), r * (g[u][1] - x[u][1] * rdot));
    o.y = pack_bf16(r * (g[u][2] - x[u][2] * rdot), r * (g[u][3] - x[u][3] * rdot));
    *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(out.p) + dn_row(out, b, t, h) + c) = o;
  }
}

// 8-byte rows of bf16 at every (b, t, h): base 8-byte aligned, every stride a multiple of 4 elements
bool rows8_bf16(const StridedView& v) {
  return !v.p || (v.dtype == DType::bf16 && reinterpret_cast<std::uintptr_t>(v.p) % 8 == 0 && v.s0 % 4 == 0 &&
                  v.s1 % 4 == 0 && v.s2 % 4 == 0);
}

// bf16-only operands (p.hilo false) where the whole backward runs on tensor cores; elsewhere the
// recompute's workspace keeps hi + lo, which the CUDA-core passes read.
DeltanetBwdParams effective(const DeltanetBwdParams& p) {
  DeltanetBwdParams e = p;
  if (!e.hilo && !deltanet_bwd_state_tc_applies(e)) {
    e.hilo = true;
    e.wy_t2 = nullptr;  // the forward's bf16 T2 is not this recompute's (fp32): formed again
  }
  return e;
}

}  // namespace

namespace {
std::atomic<int> g_bwd_overlap{0};  // 0: the planner's choice, 1: always, -1: never
std::atomic<bool> g_bwd_wy_side{true};  // set_deltanet_bwd_wy_side
std::atomic<int> g_bwd_recompute_ws{1};  // set_deltanet_bwd_recompute_ws
}  // namespace

int set_deltanet_bwd_overlap(int mode) { return g_bwd_overlap.exchange(mode > 0 ? 1 : mode < 0 ? -1 : 0); }
bool set_deltanet_bwd_wy_side(bool on) { return g_bwd_wy_side.exchange(on); }
int set_deltanet_bwd_recompute_ws(int mode) { return g_bwd_recompute_ws.exchange(mode < 0 ? 0 : mode > 2 ? 2 : mode); }

// The recompute's state kernel (S, X: read from the post kernel on) and the state pass's prep +
// serial kernels (dD0, dS: neither reads S or X) are independent chains, each a grid of sequences x
// heads x V tiles that leaves SMs idle on long sequences: (1,32768,16,128) runs two grids of 64 CTAs
// on 132 SMs one after the other. Beside each other where both fit at once (one CTA per SM each).
bool deltanet_bwd_overlap(const DeltanetBwdParams& p) {
  const int mode = g_bwd_overlap.load();
  if (mode != 0) return mode > 0;
  const int tw = deltanet_bwd_serial_tile(p);
  return 2 * p.N * p.H * ((p.V + tw - 1) / tw) <= sm_count();
}

// Measured (H100, session 27, bf16 operands): (2,8192,16,128) backward 1.771 -> 1.689 ms with 64
// columns (128 CTAs: the chains overlap; 256 with 32 do not fit), while the forward keeps 32 there
// (0.63 against 0.75 ms); at (1,32768,16,128), where 32 columns overlap already, 64 lost 11%.
int deltanet_bwd_serial_tile(const DeltanetBwdParams& p) {
  const int tw = deltanet_serial_tile(p);
  if (tw != 32 || deltanet_state_tile_forced() || g_bwd_overlap.load() < 0) return tw;
  const std::int64_t sms = sm_count();
  const auto ctas = [&](std::int64_t t) { return 2 * p.N * p.H * ((p.V + t - 1) / t); };
  return ctas(32) > sms && ctas(64) <= sms ? 64 : 32;
}

namespace {
// X and Y as bf16 (DnBwdWs::xb): after the tensor-core recompute, with the tensor-core state pass
bool bwd_x_bf16(const DeltanetBwdParams& p) {
  return deltanet_chunk_tc_applies(p) && deltanet_bwd_state_tc_applies(p) && deltanet_bwd_x_bf16(p);
}
// The workspace of a call (the size query and the call make the same choices)
DnBwdWs bwd_ws(const DeltanetBwdParams& p) {
  return DnBwdWs(p, deltanet_chunk_tc_applies(p), bwd_x_bf16(p), deltanet_xu_bf16(p));
}
}  // namespace

std::size_t deltanet_bwd_workspace_bytes(const DeltanetBwdParams& p_in) {
  const DeltanetBwdParams p = effective(p_in);
  return std::size_t(bwd_ws(p).total) * sizeof(float);
}

void deltanet_bwd_cuda(const DeltanetBwdParams& p_in, void* workspace, Stream stream) {
  const DeltanetBwdParams p = effective(p_in);
  const std::int64_t seqs = p.N * p.H, vt = (p.V + kC - 1) / kC, kt = (p.K + kC - 1) / kC;
  if (p.K > kMaxK) throw ArgumentError(cat("deltanet_bwd: K = ", p.K, " > ", kMaxK, " is not supported by the CUDA kernel"));
  if (seqs > 0x7fffffff || vt > 65535 || p.H > 65535)
    throw Error(cat("deltanet_bwd: grid too large (", seqs, " sequence-heads, H = ", p.H, ")"));
  const bool tc = deltanet_chunk_tc_applies(p);
  const bool state_tc = tc && deltanet_bwd_state_tc_applies(p);
  const DnBwdWs w = bwd_ws(p);  // X, Y (xb) and Xu as bf16 where they apply
  float* ws = static_cast<float*>(workspace);
  const auto st = reinterpret_cast<cudaStream_t>(stream);
  // 1. recompute: S0 per chunk and X per row (no o, no final state); with the overlap its state
  //    kernel runs on the side stream beside step 2's prep + serial kernels, joined before post
  DeltanetParams f = p;
  f.o = {}, f.ht = {};
  const bool overlap = state_tc && seqs > 0 && deltanet_bwd_overlap(p);
  std::optional<StreamFork> fork;
  void* recomputed = nullptr;  // with the overlap: the side work's end, waited for before post
  void* wy_done = nullptr;     // with the wy kernel on the side stream too: its end, waited for before serial
  if (tc) {
    // T2: the forward's (p.wy_t2: read, not formed) or this workspace's region (written)
    DnChunkBufs bufs{ws + w.xw, ws + w.xu, ws + w.rk, ws + w.S, ws + w.X, p.wy_t2 ? static_cast<float*>(p.wy_t2) : ws + w.T2};
    bufs.t2_given = p.wy_t2 != nullptr;
    bufs.xbf16 = w.xb;
    bufs.xu16 = w.xu16;  // the choice that sized the xu region
    bufs.tile = deltanet_bwd_serial_tile(p);
    // the warp-specialised state kernel where the recompute's chain is alone on the GPU (varlen, many
    // sequences: nothing beside it; its forward ran 399 us against the plain kernel's 503 at 8 in 32768)
    const int rws = g_bwd_recompute_ws.load(std::memory_order_relaxed);
    bufs.state_ws = rws == 2 || (rws == 1 && !overlap);
    if (overlap && g_bwd_wy_side.load(std::memory_order_relaxed)) {
      // wy on the side stream as well, beside the prep kernel (which reads none of Xw, Xu, rk, T2; it
      // forms its own rk); the serial kernel (Xw) waits for wy_done, post for the whole side chain
      fork.emplace("deltanet_bwd (fork)", st);
      const auto side = reinterpret_cast<Stream>(fork->side);
      deltanet_chunk_tc_states(f, bufs, side, 1);
      wy_done = fork->mark();
      deltanet_chunk_tc_states(f, bufs, side, 2);
      recomputed = fork->done();
    } else if (overlap) {
      deltanet_chunk_tc_states(f, bufs, stream, 1);  // wy: Xw, Xu, rk, T2 (both chains read them)
      fork.emplace("deltanet_bwd (fork)", st);
      deltanet_chunk_tc_states(f, bufs, reinterpret_cast<Stream>(fork->side), 2);
      recomputed = fork->done();
    } else {
      deltanet_chunk_tc_states(f, bufs, stream);
    }
  } else {
    f.save_S = ws + w.S, f.save_X = ws + w.X;
    deltanet_fwd_v1_cuda(f, stream);
  }
  if (seqs == 0) return;
  // 2. state pass (on tensor cores after the tensor-core recompute)
  if (state_tc) {
    deltanet_bwd_state_tc(p, w, ws, stream, recomputed, wy_done);
  } else {
    const std::size_t smem_s = sizeof(SmemState);
    (void)resident_ctas_per_sm(reinterpret_cast<const void*>(&deltanet_bwd_state_kernel), kThreads, smem_s);
    deltanet_bwd_state_kernel<<<dim3(unsigned(seqs), unsigned(vt)), kThreads, smem_s, st>>>(p, w, ws);
    FW_CUDA_CHECK_LAUNCH("deltanet_bwd (state pass)");
  }
  // 3. chunk pass (the L2-norm backward's vec kernel's conditions: it may run fused into the pass)
  const std::int64_t slots = deltanet_slots(p);
  const bool l2_vec = p.K <= 128 && p.K % 4 == 0 && rows8_bf16(p.q) && rows8_bf16(p.k) && rows8_bf16(p.dq) &&
                      rows8_bf16(p.dk);
  bool l2_done = false;
  if ((p.dq.p || p.dk.p || p.dbeta.p) && slots > 0) {
    if (slots > 0x7fffffff) throw Error(cat("deltanet_bwd: grid too large (", slots, " chunks)"));
    if (state_tc) {
      l2_done = deltanet_bwd_chunk_tc(p, w, ws, stream, l2_vec);
    } else {
      const std::size_t smem_c = sizeof(SmemChunk);
      (void)resident_ctas_per_sm(reinterpret_cast<const void*>(&deltanet_bwd_chunk_kernel), kThreads, smem_c);
      deltanet_bwd_chunk_kernel<<<dim3(unsigned(slots), unsigned(p.H), unsigned(kt)), kThreads, smem_c, st>>>(
          p, w, ws, tc, state_tc);
      FW_CUDA_CHECK_LAUNCH("deltanet_bwd (chunk pass)");
    }
  }
  // 4. L2-norm backward
  if (p.l2 && (p.dq.p || p.dk.p) && w.rows > 0 && !l2_done) {
    const bool vec = l2_vec && reinterpret_cast<std::uintptr_t>(ws + w.dqh) % 16 == 0 &&
                     reinterpret_cast<std::uintptr_t>(ws + w.dkh) % 16 == 0;
    const std::int64_t blocks = ((vec ? 1 : 2) * w.rows + kL2Warps - 1) / kL2Warps;
    if (blocks > 0x7fffffff) throw Error(cat("deltanet_bwd: grid too large (", w.rows, " rows)"));
    if (vec)
      deltanet_bwd_l2_vec_kernel<<<unsigned(blocks), 32 * kL2Warps, 0, st>>>(p, w, ws);
    else
      deltanet_bwd_l2_kernel<<<unsigned(blocks), 32 * kL2Warps, 0, st>>>(p, w, ws);
    FW_CUDA_CHECK_LAUNCH("deltanet_bwd (L2 norm)");
  }
}

}  // namespace fastweight::detail
