// mlstm_bwd.cu: the exact chunkwise mLSTM backward (docs/design/mlstm_backward.md), version 1:
// fp32 FMA on CUDA cores, float64 gate bookkeeping (mlstm_common.cuh). With every stabiliser m held
// as the forward chose it (TFLA's gradient, exact for it), plus the scalar correction through m:
//   K0 states   the forward's kernel A: C_k, n_k, m_k entering every chunk (workspace)
//   K1 rows     per row t: den_t, db_t, the correction c_t = eps dden_t and eY_t (the inter part's
//               d/dg_t), from the recomputed forward and dh
//   K2 scan     reverse over chunks per (head, 64x64 tile of C): dC_{k+1} and dn_{k+1} kept for every
//               chunk, <C_k, dC_{k+1}> partials, dc0/dn0
//   K3q         per (head, chunk, 64-row block, DQK tile): dq and the rows' dg (t role)
//   K3kv        per (head, chunk, 64-row block, role): dk (role 0) or dv (role 1), and the rows' di,
//               dg (s role) and the chunk's dG partial (role 0)
//   K4 gates    per head in float64: suffix sums of dg within chunks + dG, the correction scan
//               through m_t = max(lf_t + m_{t-1}, i_t) (segmented, parallel), then di, df, dm0
// The tensor-core path (mlstm_bwd_tc.cu) has no K1: its K3q forms the row statistics from the
// products it makes anyway, K2 leaves dn to a small scan after K3q (dn needs db).
// Notation per chunk k (t, s rows of the chunk, local cumulative log forget g, a_s = i_s - g_s,
// M_t = max(m_k, a_0..a_t)): e_t = exp(m_k - M_t), D_ts = exp(a_s - M_t) (s <= t),
// w_s = exp(a_s - M_L), d_k = exp(m_k - M_L); dnum_t = dh_t / den_t, X_ts = v_s . dnum_t + db_t,
// P_ts = scale (q_t . k_s) D_ts, Z_ts = P_ts X_ts.
#include <atomic>
#include <memory>
#include <vector>

#include "cuda/common/check.cuh"
#include "cuda/mlstm/mlstm_common.cuh"
#include "cuda/mlstm/mlstm_bwd_ws.h"
#include "cuda/mlstm/mlstm_cuda.h"

namespace fastweight::detail {
namespace {

constexpr int kT = 64;
constexpr int kThreads = 256;
constexpr int kMaxL = 256;

// Sum over the 16 threads of a row group (tc = tid % 16, consecutive lanes): fixed xor tree.
__device__ __forceinline__ float sum16(float v) {
  for (int off = 8; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}
// Block sum (fixed order), every thread gets it. s_red: kThreads / 32 floats.
__device__ float block_sum(float v, float* s_red) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) s_red[threadIdx.x >> 5] = v;
  __syncthreads();
  float t = 0.f;
  for (int w = 0; w < kThreads / 32; ++w) t += s_red[w];
  return t;
}

struct Tiles {  // dynamic shared memory of K1, K3q, K3kv
  float a[kT][kT + 1];
  float b[kT][kT + 1];
  float c[kT][kT + 1];
  float big[kT][kMaxL + 1];  // (64 rows, up to L columns): P, W or P^T rows of one block
  float vec[kT];
};

__device__ __forceinline__ std::int64_t off4(const StridedView& t, std::int64_t b, std::int64_t h, std::int64_t row) {
  return b * t.s0 + h * t.s1 + row * t.s2;
}

// Loads rows [row0, row0 + nrow) of a (B, NH, S, D) view, columns [col0, col0 + 64), into tile[r][c]
// (zeros outside); scale multiplies every element.
__device__ void load_rows(float (*tile)[kT + 1], const StridedView& t, std::int64_t b, std::int64_t h, std::int64_t row0,
                          int nrow, std::int64_t col0, std::int64_t D, float scale = 1.f) {
  for (int e = threadIdx.x; e < kT * kT; e += kThreads) {
    const int r = e / kT, c = e % kT;
    tile[r][c] = r < nrow && col0 + c < D ? scale * mlstm_ld(t, off4(t, b, h, row0 + r) + col0 + c) : 0.f;
  }
}

// ---- K1: row statistics ---------------------------------------------------------------------------
// grid (heads, NC, row blocks). Recomputes b_t, num_t . dh_t (split inter / intra) and writes
// inv_den, db, corr = eps dden, eY = d/dg_t of the inter part.
__global__ void __launch_bounds__(kThreads) k1_rows(const MlstmBwdParams B, const float* __restrict__ ws, float* wsw,
                                                    BwdWs L) {
  const MlstmParams& p = B.f;
  __shared__ double s_g[kMaxL], s_a[kMaxL], s_M[kMaxL];
  extern __shared__ float4 smem_raw[];
  Tiles& sm = *reinterpret_cast<Tiles*>(smem_raw);
  const int tid = threadIdx.x, tr = tid / 16, tc = tid % 16;
  const std::int64_t bh = blockIdx.x, b = bh / p.NH, hd = bh % p.NH, kc = blockIdx.y;
  const int rb = blockIdx.z;
  const std::int64_t t0 = kc * p.L;
  const int n = int(p.S - t0 < p.L ? p.S - t0 : p.L), row0 = rb * kT;
  if (row0 >= n) return;
  const int nrow = n - row0 < kT ? n - row0 : kT, rowend = row0 + nrow;
  const double mk = double(ws[L.m + bh * L.ns + kc]);
  mlstm_chunk_gates(p, b, hd, t0, rowend, mk, s_g, s_a, s_M);
  const float scale = rsqrtf(float(p.DQK));
  const float* Ck = ws + L.c + (bh * L.ns + kc) * p.DQK * p.DV;
  const float* nk = ws + L.n + (bh * L.ns + kc) * p.DQK;
  float et[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int t = row0 + 4 * tr + i;
    et[i] = t < rowend ? float(exp(mk - s_M[t])) : 0.f;
  }
  // P (rows of this block x steps 0..rowend) into sm.big, and q . n_k
  float qn[4] = {};
  for (int sb = 0; sb <= rb; ++sb) {
    const int s0 = sb * kT, nsb = rowend - s0 < kT ? rowend - s0 : kT;
    float sc[4][4] = {};
    for (std::int64_t rt = 0; rt < p.DQK; rt += kT) {
      load_rows(sm.a, p.q, b, hd, t0 + row0, nrow, rt, p.DQK);
      load_rows(sm.b, p.k, b, hd, t0 + s0, nsb, rt, p.DQK);
      if (sb == 0 && tid < kT) sm.vec[tid] = rt + tid < p.DQK ? nk[rt + tid] : 0.f;
      __syncthreads();
      for (int r = 0; r < kT; ++r) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float qv = sm.a[4 * tr + i][r];
          if (sb == 0) qn[i] = fmaf(qv, sm.vec[r], qn[i]);
#pragma unroll
          for (int j = 0; j < 4; ++j) sc[i][j] = fmaf(qv, sm.b[4 * tc + j][r], sc[i][j]);
        }
      }
      __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int tl = 4 * tr + i, sl = 4 * tc + j, t = row0 + tl, s = s0 + sl;
        const bool on = tl < nrow && sl < nsb && s <= t;
        sm.big[tl][s0 + sl] = on ? scale * sc[i][j] * float(exp(s_a[s] - s_M[t])) : 0.f;
      }
  }
  __syncthreads();
  // b_t = scale e_t (q . n_k) + sum_s P_ts
  float bsum[4] = {};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float part = 0.f;
    for (int s = tc; s < rowend; s += 16) part += sm.big[4 * tr + i][s];
    bsum[i] = sum16(part) + scale * et[i] * qn[i];
  }
  // dh . inter_num and dh . intra_num, over DV tiles
  float sint[4] = {}, sintra[4] = {};
  for (std::int64_t ct = 0; ct < p.DV; ct += kT) {
    float qc[4][4] = {};
    for (std::int64_t rt = 0; rt < p.DQK; rt += kT) {
      load_rows(sm.a, p.q, b, hd, t0 + row0, nrow, rt, p.DQK);
      for (int e = tid; e < kT * kT; e += kThreads) {
        const int r = e / kT, c = e % kT;
        sm.b[r][c] = rt + r < p.DQK && ct + c < p.DV ? Ck[(rt + r) * p.DV + ct + c] : 0.f;
      }
      __syncthreads();
      for (int r = 0; r < kT; ++r)
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) qc[i][j] = fmaf(sm.a[4 * tr + i][r], sm.b[r][4 * tc + j], qc[i][j]);
      __syncthreads();
    }
    load_rows(sm.c, B.dh, b, hd, t0 + row0, nrow, ct, p.DV);  // dh rows
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) sint[i] = fmaf(qc[i][j], sm.c[4 * tr + i][4 * tc + j], sint[i]);
    for (int sb = 0; sb <= rb; ++sb) {  // intra: sum_s P_ts (dh_t . v_s)
      const int s0 = sb * kT, nsb = rowend - s0 < kT ? rowend - s0 : kT;
      load_rows(sm.b, p.v, b, hd, t0 + s0, nsb, ct, p.DV);
      __syncthreads();
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int sl = 4 * tc + j;
          float wd = 0.f;
          for (int c = 0; c < kT; ++c) wd = fmaf(sm.c[4 * tr + i][c], sm.b[sl][c], wd);
          sintra[i] = fmaf(sm.big[4 * tr + i][s0 + sl], wd, sintra[i]);
        }
      __syncthreads();
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float si = sum16(sint[i]) * scale * et[i], sa = sum16(sintra[i]);
    const int t = row0 + 4 * tr + i;
    if (tc != 0 || t >= rowend) continue;
    const double mt = s_g[t] + s_M[t];
    const float em = float(exp(-mt)), ab = fabsf(bsum[i]);
    const float den = fmaxf(ab, em) + p.eps;
    const float hdot = (si + sa) / den;  // dh_t . h_t
    const float dden = -hdot / den;
    const float sg = bsum[i] > 0.f ? 1.f : bsum[i] < 0.f ? -1.f : 0.f;
    const float db = ab > em ? dden * sg : ab < em ? 0.f : 0.5f * dden * sg;  // torch.maximum splits ties
    const std::int64_t ri = bh * p.S + t0 + t;
    wsw[L.inv_den + ri] = 1.f / den;
    wsw[L.db + ri] = db;
    wsw[L.corr + ri] = p.eps * dden;
    wsw[L.ey + ri] = si / den + scale * et[i] * qn[i] * db;
  }
}

// ---- K2: reverse scan of the state gradients ----------------------------------------------------------
__global__ void __launch_bounds__(kThreads) k2_scan(const MlstmBwdParams B, float* ws, BwdWs L) {
  const MlstmParams& p = B.f;
  __shared__ double s_g[kMaxL], s_a[kMaxL], s_M[kMaxL];
  __shared__ float s_q[kT][kT + 1], s_d[kT][kT + 1], s_e[kT], s_db[kT], s_red[kThreads / 32];
  const int tid = threadIdx.x, tr = tid / 16, tc = tid % 16;
  const std::int64_t bh = blockIdx.x, b = bh / p.NH, hd = bh % p.NH;
  const int r0 = blockIdx.y * kT, c0 = blockIdx.z * kT;
  const std::int64_t tile = std::int64_t(blockIdx.y) * gridDim.z + blockIdx.z;
  const std::int64_t DQK = p.DQK, DV = p.DV;
  float dC[4][4], dn[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const std::int64_t r = r0 + 4 * tr + i;
    dn[i] = B.dn_last.p && r < DQK ? mlstm_ld(B.dn_last, b * B.dn_last.s0 + hd * B.dn_last.s1 + r) : 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const std::int64_t c = c0 + 4 * tc + j;
      dC[i][j] = B.dc_last.p && r < DQK && c < DV
                     ? mlstm_ld(B.dc_last, b * B.dc_last.s0 + hd * B.dc_last.s1 + r * B.dc_last.s2 + c)
                     : 0.f;
    }
  }
  // <C_k, dC> (+ <n_k, dn> in the first column of tiles) for the state entering chunk k
  auto inner = [&](std::int64_t k) {
    const float* Ck = ws + L.c + (bh * L.ns + k) * DQK * DV;
    const float* nk = ws + L.n + (bh * L.ns + k) * DQK;
    float part = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const std::int64_t r = r0 + 4 * tr + i;
      if (r >= DQK) continue;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const std::int64_t c = c0 + 4 * tc + j;
        if (c < DV) part = fmaf(Ck[r * DV + c], dC[i][j], part);
      }
      if (blockIdx.z == 0 && tc == 0) part = fmaf(nk[r], dn[i], part);
    }
    return block_sum(part, s_red);
  };
  {
    const float R = inner(L.NC);  // the last state: <c_last, dc_last> + <n_last, dn_last>
    if (tid == 0) ws[L.R + (bh * L.ns + L.NC) * L.tiles + tile] = R;
  }
  const float scale = rsqrtf(float(DQK));
  for (std::int64_t kc = L.NC - 1; kc >= 0; --kc) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // keep dC_{kc+1}, dn_{kc+1} for K3
      const std::int64_t r = r0 + 4 * tr + i;
      if (r >= DQK) continue;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const std::int64_t c = c0 + 4 * tc + j;
        if (c < DV) ws[L.dc + ((bh * L.ns + kc + 1) * DQK + r) * DV + c] = dC[i][j];
      }
      if (blockIdx.z == 0 && tc == 0) ws[L.dn + (bh * L.ns + kc + 1) * DQK + r] = dn[i];
    }
    const float R = inner(kc);
    if (tid == 0) ws[L.R + (bh * L.ns + kc) * L.tiles + tile] = R;
    const std::int64_t t0 = kc * p.L;
    const int n = int(p.S - t0 < p.L ? p.S - t0 : p.L);
    const double mk = double(ws[L.m + bh * L.ns + kc]);
    mlstm_chunk_gates(p, b, hd, t0, n, mk, s_g, s_a, s_M);
    const float decay = float(exp(mk - s_M[n - 1]));
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      dn[i] *= decay;
#pragma unroll
      for (int j = 0; j < 4; ++j) dC[i][j] *= decay;
    }
    for (int sb = 0; sb < n; sb += kT) {
      const int nb = n - sb < kT ? n - sb : kT;
      for (int e = tid; e < kT * kT; e += kThreads) {
        const int t = e / kT, col = e % kT;
        const std::int64_t row = t0 + sb + t;
        s_q[t][col] = t < nb && r0 + col < DQK ? mlstm_ld(p.q, off4(p.q, b, hd, row) + r0 + col) : 0.f;
        s_d[t][col] = t < nb && c0 + col < DV
                          ? mlstm_ld(B.dh, off4(B.dh, b, hd, row) + c0 + col) * ws[L.inv_den + bh * p.S + row]
                          : 0.f;
      }
      if (tid < kT) {
        const std::int64_t row = t0 + sb + tid;
        s_e[tid] = tid < nb ? scale * float(exp(mk - s_M[sb + tid])) : 0.f;
        s_db[tid] = tid < nb ? ws[L.db + bh * p.S + row] : 0.f;
      }
      __syncthreads();
      for (int t = 0; t < nb; ++t) {
        float qe[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) qe[i] = s_e[t] * s_q[t][4 * tr + i];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          dn[i] = fmaf(qe[i], s_db[t], dn[i]);
#pragma unroll
          for (int j = 0; j < 4; ++j) dC[i][j] = fmaf(qe[i], s_d[t][4 * tc + j], dC[i][j]);
        }
      }
      __syncthreads();
    }
  }
  // dC_0, dn_0: the initial states' gradients
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const std::int64_t r = r0 + 4 * tr + i;
    if (r >= DQK) continue;
    if (B.dc0.p)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const std::int64_t c = c0 + 4 * tc + j;
        if (c < DV) mlstm_st(B.dc0, b * B.dc0.s0 + hd * B.dc0.s1 + r * B.dc0.s2 + c, dC[i][j]);
      }
    if (B.dn0.p && blockIdx.z == 0 && tc == 0) mlstm_st(B.dn0, b * B.dn0.s0 + hd * B.dn0.s1 + r, dn[i]);
  }
}

// ---- K3q: dq and the t-role dg -----------------------------------------------------------------------
// grid (heads, NC, row blocks x DQK tiles); thread (tr, tc): rows t = 4tr + i, columns r = 4tc + j.
__global__ void __launch_bounds__(kThreads) k3_dq(const MlstmBwdParams B, float* ws, BwdWs L) {
  const MlstmParams& p = B.f;
  __shared__ double s_g[kMaxL], s_a[kMaxL], s_M[kMaxL];
  extern __shared__ float4 smem_raw[];
  Tiles& sm = *reinterpret_cast<Tiles*>(smem_raw);
  const int tid = threadIdx.x, tr = tid / 16, tc = tid % 16;
  const std::int64_t bh = blockIdx.x, b = bh / p.NH, hd = bh % p.NH, kc = blockIdx.y;
  const int rbs = int(L.rbs), rb = blockIdx.z % rbs;
  const std::int64_t r0 = std::int64_t(blockIdx.z / rbs) * kT;
  const std::int64_t t0 = kc * p.L;
  const int n = int(p.S - t0 < p.L ? p.S - t0 : p.L), row0 = rb * kT;
  if (row0 >= n) return;
  const int nrow = n - row0 < kT ? n - row0 : kT, rowend = row0 + nrow;
  const double mk = double(ws[L.m + bh * L.ns + kc]);
  mlstm_chunk_gates(p, b, hd, t0, rowend, mk, s_g, s_a, s_M);
  const float scale = rsqrtf(float(p.DQK));
  const float* Ck = ws + L.c + (bh * L.ns + kc) * p.DQK * p.DV;
  const float* nk = ws + L.n + (bh * L.ns + kc) * p.DQK;
  const float* inv_den = ws + L.inv_den + bh * p.S + t0;
  const float* dbv = ws + L.db + bh * p.S + t0;
  float dq[4][4] = {};
  // inter: e_t (C_k dnum_t + n_k db_t)
  for (std::int64_t ct = 0; ct < p.DV; ct += kT) {
    for (int e = tid; e < kT * kT; e += kThreads) {
      const int t = e / kT, c = e % kT;
      sm.a[t][c] = t < nrow && ct + c < p.DV ? mlstm_ld(B.dh, off4(B.dh, b, hd, t0 + row0 + t) + ct + c) * inv_den[row0 + t] : 0.f;
      sm.b[t][c] = r0 + t < p.DQK && ct + c < p.DV ? Ck[(r0 + t) * p.DV + ct + c] : 0.f;  // rows r
    }
    __syncthreads();
    for (int c = 0; c < kT; ++c)
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) dq[i][j] = fmaf(sm.a[4 * tr + i][c], sm.b[4 * tc + j][c], dq[i][j]);
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int t = row0 + 4 * tr + i;
    const float e = t < rowend ? float(exp(mk - s_M[t])) : 0.f, dbt = t < rowend ? dbv[t] : 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const std::int64_t r = r0 + 4 * tc + j;
      dq[i][j] = e * (dq[i][j] + (r < p.DQK ? nk[r] : 0.f) * dbt);
    }
  }
  // intra: sum_s D_ts X_ts k_s, and Z row sums for dg (first DQK tile only)
  float zs[4] = {};
  const bool scalars = r0 == 0;
  for (int sb = 0; sb <= rb; ++sb) {
    const int s0 = sb * kT, nsb = rowend - s0 < kT ? rowend - s0 : kT;
    float wd[4][4] = {}, sc[4][4] = {};
    for (std::int64_t ct = 0; ct < p.DV; ct += kT) {  // v_s . dh_t
      load_rows(sm.a, B.dh, b, hd, t0 + row0, nrow, ct, p.DV);
      load_rows(sm.b, p.v, b, hd, t0 + s0, nsb, ct, p.DV);
      __syncthreads();
      for (int c = 0; c < kT; ++c)
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) wd[i][j] = fmaf(sm.a[4 * tr + i][c], sm.b[4 * tc + j][c], wd[i][j]);
      __syncthreads();
    }
    if (scalars)
      for (std::int64_t rt = 0; rt < p.DQK; rt += kT) {  // q_t . k_s
        load_rows(sm.a, p.q, b, hd, t0 + row0, nrow, rt, p.DQK);
        load_rows(sm.b, p.k, b, hd, t0 + s0, nsb, rt, p.DQK);
        __syncthreads();
        for (int r = 0; r < kT; ++r)
#pragma unroll
          for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) sc[i][j] = fmaf(sm.a[4 * tr + i][r], sm.b[4 * tc + j][r], sc[i][j]);
        __syncthreads();
      }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int tl = 4 * tr + i, sl = 4 * tc + j, t = row0 + tl, s = s0 + sl;
        const bool on = tl < nrow && sl < nsb && s <= t;
        const float D = on ? float(exp(s_a[s] - s_M[t])) : 0.f;
        const float X = on ? wd[i][j] * inv_den[t] + dbv[t] : 0.f;
        sm.c[tl][sl] = D * X;
        zs[i] += scale * sc[i][j] * D * X;
      }
    load_rows(sm.b, p.k, b, hd, t0 + s0, nsb, r0, p.DQK);  // k_s, this DQK tile
    __syncthreads();
    for (int sl = 0; sl < kT; ++sl)
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) dq[i][j] = fmaf(sm.c[4 * tr + i][sl], sm.b[sl][4 * tc + j], dq[i][j]);
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int t = row0 + 4 * tr + i;
    if (t >= rowend) continue;
    const std::int64_t row = off4(B.dq, b, hd, t0 + t);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const std::int64_t r = r0 + 4 * tc + j;
      if (r < p.DQK && B.dq.p) mlstm_st(B.dq, row + r, scale * dq[i][j]);
    }
  }
  if (scalars)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float z = sum16(zs[i]);
      const int t = row0 + 4 * tr + i;
      if (tc == 0 && t < rowend) ws[L.dgq + bh * p.S + t0 + t] = z + ws[L.ey + bh * p.S + t0 + t];
    }
}

// ---- K3kv: dk (role 0, with the s-role scalars) or dv (role 1) --------------------------------------------
// grid (heads, NC, row blocks x 2); thread (tr, tc): rows s = 4tr + i, columns t (or r, c) = 4tc + j.
__global__ void __launch_bounds__(kThreads) k3_dkdv(const MlstmBwdParams B, float* ws, BwdWs L) {
  const MlstmParams& p = B.f;
  __shared__ double s_g[kMaxL], s_a[kMaxL], s_M[kMaxL];
  __shared__ float s_red[kThreads / 32];
  extern __shared__ float4 smem_raw[];
  Tiles& sm = *reinterpret_cast<Tiles*>(smem_raw);
  const int tid = threadIdx.x, tr = tid / 16, tc = tid % 16;
  const std::int64_t bh = blockIdx.x, b = bh / p.NH, hd = bh % p.NH, kc = blockIdx.y;
  const int sb = blockIdx.z / 2, role = blockIdx.z % 2;
  const std::int64_t t0 = kc * p.L;
  const int n = int(p.S - t0 < p.L ? p.S - t0 : p.L), s0 = sb * kT;
  if (s0 >= n) return;
  const int nsb = n - s0 < kT ? n - s0 : kT;
  const double mk = double(ws[L.m + bh * L.ns + kc]);
  mlstm_chunk_gates(p, b, hd, t0, n, mk, s_g, s_a, s_M);
  const double ML = s_M[n - 1];
  const float scale = rsqrtf(float(p.DQK));
  const float* inv_den = ws + L.inv_den + bh * p.S + t0;
  const float* dbv = ws + L.db + bh * p.S + t0;
  const float* dC1 = ws + L.dc + (bh * L.ns + kc + 1) * p.DQK * p.DV;  // dL/dC_{k+1}
  const float* dn1 = ws + L.dn + (bh * L.ns + kc + 1) * p.DQK;
  // pairs (s in this block, t >= s in the chunk): role 0 keeps W_st = D X, role 1 keeps P
  float zs[4] = {};
  for (int tb = sb; tb * kT < n; ++tb) {
    const int t0b = tb * kT, ntb = n - t0b < kT ? n - t0b : kT;
    float sc[4][4] = {}, wd[4][4] = {};
    for (std::int64_t rt = 0; rt < p.DQK; rt += kT) {
      load_rows(sm.a, p.k, b, hd, t0 + s0, nsb, rt, p.DQK);
      load_rows(sm.b, p.q, b, hd, t0 + t0b, ntb, rt, p.DQK);
      __syncthreads();
      for (int r = 0; r < kT; ++r)
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) sc[i][j] = fmaf(sm.a[4 * tr + i][r], sm.b[4 * tc + j][r], sc[i][j]);
      __syncthreads();
    }
    if (role == 0)
      for (std::int64_t ct = 0; ct < p.DV; ct += kT) {
        load_rows(sm.a, p.v, b, hd, t0 + s0, nsb, ct, p.DV);
        load_rows(sm.b, B.dh, b, hd, t0 + t0b, ntb, ct, p.DV);
        __syncthreads();
        for (int c = 0; c < kT; ++c)
#pragma unroll
          for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) wd[i][j] = fmaf(sm.a[4 * tr + i][c], sm.b[4 * tc + j][c], wd[i][j]);
        __syncthreads();
      }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int sl = 4 * tr + i, tl = 4 * tc + j, s = s0 + sl, t = t0b + tl;
        const bool on = sl < nsb && tl < ntb && s <= t;
        const float D = on ? float(exp(s_a[s] - s_M[t])) : 0.f;
        const float P = scale * sc[i][j] * D;
        if (role == 0) {
          const float X = on ? wd[i][j] * inv_den[t] + dbv[t] : 0.f;
          sm.big[sl][t] = D * X;
          zs[i] += P * X;
        } else {
          sm.big[sl][t] = P;
        }
      }
  }
  __syncthreads();
  float w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int s = s0 + 4 * tr + i;
    w[i] = 4 * tr + i < nsb ? float(exp(s_a[s] - ML)) : 0.f;
  }
  if (role == 0) {
    float u[4] = {};
    for (std::int64_t rt = 0; rt < p.DQK; rt += kT) {
      float dk[4][4] = {}, dcv[4][4] = {};
      for (int tb = sb; tb * kT < n; ++tb) {  // sum_t W_st qs_t
        const int t0b = tb * kT, ntb = n - t0b < kT ? n - t0b : kT;
        load_rows(sm.a, p.q, b, hd, t0 + t0b, ntb, rt, p.DQK, scale);
        __syncthreads();
        for (int tl = 0; tl < ntb; ++tl)
#pragma unroll
          for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) dk[i][j] = fmaf(sm.big[4 * tr + i][t0b + tl], sm.a[tl][4 * tc + j], dk[i][j]);
        __syncthreads();
      }
      for (std::int64_t ct = 0; ct < p.DV; ct += kT) {  // (dC_{k+1} v_s)[r]
        load_rows(sm.a, p.v, b, hd, t0 + s0, nsb, ct, p.DV);
        for (int e = tid; e < kT * kT; e += kThreads) {
          const int r = e / kT, c = e % kT;
          sm.b[r][c] = rt + r < p.DQK && ct + c < p.DV ? dC1[(rt + r) * p.DV + ct + c] : 0.f;
        }
        __syncthreads();
        for (int c = 0; c < kT; ++c)
#pragma unroll
          for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) dcv[i][j] = fmaf(sm.a[4 * tr + i][c], sm.b[4 * tc + j][c], dcv[i][j]);
        __syncthreads();
      }
      load_rows(sm.a, p.k, b, hd, t0 + s0, nsb, rt, p.DQK);  // k_s for U
      __syncthreads();
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int s = s0 + 4 * tr + i;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const std::int64_t r = rt + 4 * tc + j;
          const float dnr = r < p.DQK ? dn1[r] : 0.f;
          u[i] = fmaf(sm.a[4 * tr + i][4 * tc + j], dcv[i][j] + dnr, u[i]);
          dk[i][j] = fmaf(w[i], dcv[i][j] + dnr, dk[i][j]);
          if (4 * tr + i < nsb && r < p.DQK && B.dk.p) mlstm_st(B.dk, off4(B.dk, b, hd, t0 + s) + r, dk[i][j]);
        }
      }
      __syncthreads();
    }
    float gpart = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float U = sum16(u[i]), z = sum16(zs[i]);
      const int sl = 4 * tr + i;
      const float da = z + w[i] * U;  // d/da_s = d/di_s = -d/dg_s
      if (tc == 0 && sl < nsb) {
        ws[L.dikv + bh * p.S + t0 + s0 + sl] = da;
        ws[L.dgkv + bh * p.S + t0 + s0 + sl] = -da;
        gpart += w[i] * U;
      }
    }
    const float G = block_sum(gpart, s_red);
    if (tid == 0) ws[L.G + (bh * L.NC + kc) * L.rbs + sb] = G;
  } else {
    for (std::int64_t ct = 0; ct < p.DV; ct += kT) {
      float dv[4][4] = {};
      for (int tb = sb; tb * kT < n; ++tb) {  // sum_t P_st dnum_t
        const int t0b = tb * kT, ntb = n - t0b < kT ? n - t0b : kT;
        for (int e = tid; e < kT * kT; e += kThreads) {
          const int t = e / kT, c = e % kT;
          sm.a[t][c] = t < ntb && ct + c < p.DV
                           ? mlstm_ld(B.dh, off4(B.dh, b, hd, t0 + t0b + t) + ct + c) * inv_den[t0b + t]
                           : 0.f;
        }
        __syncthreads();
        for (int tl = 0; tl < ntb; ++tl)
#pragma unroll
          for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) dv[i][j] = fmaf(sm.big[4 * tr + i][t0b + tl], sm.a[tl][4 * tc + j], dv[i][j]);
        __syncthreads();
      }
      float kdc[4][4] = {};
      for (std::int64_t rt = 0; rt < p.DQK; rt += kT) {  // (dC_{k+1}^T k_s)[c]
        load_rows(sm.a, p.k, b, hd, t0 + s0, nsb, rt, p.DQK);
        for (int e = tid; e < kT * kT; e += kThreads) {
          const int r = e / kT, c = e % kT;
          sm.b[c][r] = rt + r < p.DQK && ct + c < p.DV ? dC1[(rt + r) * p.DV + ct + c] : 0.f;  // transposed
        }
        __syncthreads();
        for (int r = 0; r < kT; ++r)
#pragma unroll
          for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) kdc[i][j] = fmaf(sm.a[4 * tr + i][r], sm.b[4 * tc + j][r], kdc[i][j]);
        __syncthreads();
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int sl = 4 * tr + i;
        if (sl >= nsb) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const std::int64_t c = ct + 4 * tc + j;
          if (c < p.DV && B.dv.p) mlstm_st(B.dv, off4(B.dv, b, hd, t0 + s0 + sl) + c, fmaf(w[i], kdc[i][j], dv[i][j]));
        }
      }
    }
  }
}

// ---- K4: gate gradients and the correction through m (float64) --------------------------------------
// 1. per chunk (k4_ends, k4_mchain, k4_chunks; every chunk in parallel but the scalar m chain):
//    dlf_u = dG + sum_{t >= u in the chunk} (dg_q + dg_kv)_t by a block suffix scan, and the routing
//    of each m_t = max(lf_t + m_{t-1}, i_t) in the chunk frame (lf wins iff M_{u-1} > a_u,
//    M_{-1} = m_k; ties split in halves as torch.maximum) as gamma_t in {1, 0, 1/2}, to the
//    workspace. The m chain m_{k+1} = g_{n-1} + max(m_k, max_t a_t) in float64, as K0's: k4_ends
//    forms each chunk's (g_{n-1}, max_t a_t), k4_mchain walks the chunks (one thread per head).
// 2. (k4_gates, per head) the reverse scan of the correction, d_in(t) = x_t + gamma_{t+1} d_in(t+1)
//    (x_t = c_t, plus the last state's terms at t = S - 1), in contiguous segments per thread: each
//    thread composes its segment's affine map, thread 0 chains the maps right to left (fixed order),
//    each thread re-walks its segment adding d to dlf (lf wins) or di (i wins).
// 3. df = dlf sigmoid(-f), di, dm0.
// The chunk decay's gradient G_k (dG above) is Gp_k + d_k R_k (Gp_k: K3 kv's partials; R_k = <C_k, dC_k+1>
// + <n_k, dn_k+1>: K2's), or with `chain` (set_mlstm_bwd_decay_chain; K2 then reads no chunk state past
// C_0 and writes R_0, R_NC alone) the same value for k > 0 by G_NC-1 = R_NC, G_k = G_k+1 + X_k+1,
// X_k = sum_(chunk k) eY_t - Gp_k: k4_ends forms X_k, k4_mchain the chain (fixed order), k4_chunks reads
// G_k. Chunk 0 keeps R_0: dm0 holds d_0 R_0, which under strong decay lies far below G_0's rounding (the
// difference G_0 - Gp_0 gave dm0 errors of 1e11 relative at the tests' strong gates).
// (Version 1 ran all of this in thread 0 from global memory: 11 ms of a 34 ms backward on the H100;
// step 1 chunk after chunk in one CTA per head took 0.56 ms at (2,16,8192,128,128).)
__device__ __forceinline__ double* k4_ends_of(float* ws, const BwdWs& L) {  // (heads, NC) x 2
  return reinterpret_cast<double*>(ws + L.k4);
}
__device__ __forceinline__ double* k4_m_of(float* ws, const BwdWs& L) {  // (heads, NC): m_k
  return reinterpret_cast<double*>(ws + L.k4) + 2 * L.heads * L.NC;
}
__device__ __forceinline__ double* k4_dm0_of(float* ws, const BwdWs& L) {  // (heads): chunk 0's dm0 terms
  return reinterpret_cast<double*>(ws + L.k4) + 3 * L.heads * L.NC;
}
__device__ __forceinline__ double* k4_chain_of(float* ws, const BwdWs& L) {  // (heads, NC): X_k, then G_k
  return reinterpret_cast<double*>(ws + L.k4) + 3 * L.heads * L.NC + L.heads;
}
// Gp_k: K3 kv's partials of the chunk (64-row blocks, fixed order)
__device__ __forceinline__ double k4_gp(const float* ws, const BwdWs& L, std::int64_t bh, std::int64_t kc, int n) {
  double G = 0.0;
  for (std::int64_t sb = 0; sb * kT < n; ++sb) G += ws[L.G + (bh * L.NC + kc) * L.rbs + sb];
  return G;
}

__global__ void __launch_bounds__(kThreads) k4_ends(const MlstmBwdParams B, float* ws, BwdWs L, bool chain) {
  const MlstmParams& p = B.f;
  __shared__ double s_g[kMaxL], s_a[kMaxL], s_M[kMaxL];
  const std::int64_t bh = blockIdx.x, b = bh / p.NH, hd = bh % p.NH, kc = blockIdx.y, t0 = kc * p.L;
  const int n = int(p.S - t0 < p.L ? p.S - t0 : p.L);
  mlstm_chunk_gates(p, b, hd, t0, n, -INFINITY, s_g, s_a, s_M);  // s_M: the prefix max of a alone
  if (threadIdx.x == 0) {
    double* e = k4_ends_of(ws, L) + 2 * (bh * L.NC + kc);
    e[0] = s_g[n - 1], e[1] = s_M[n - 1];
    if (chain) {  // X_k = sum_t eY_t - Gp_k (row order)
      double x = 0.0;
      for (int t = 0; t < n; ++t) x += ws[L.ey + bh * p.S + t0 + t];
      k4_chain_of(ws, L)[bh * L.NC + kc] = x - k4_gp(ws, L, bh, kc, n);
    }
  }
}

__global__ void __launch_bounds__(kThreads) k4_mchain(const MlstmBwdParams B, float* ws, BwdWs L, bool chain) {
  const MlstmParams& p = B.f;
  const std::int64_t bh = std::int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (bh >= L.heads) return;
  const std::int64_t b = bh / p.NH, hd = bh % p.NH;
  const double* __restrict__ e = k4_ends_of(ws, L) + 2 * bh * L.NC;
  double* __restrict__ m = k4_m_of(ws, L) + bh * L.NC;
  double mk = p.m0.p ? double(mlstm_ld(p.m0, b * p.m0.s0 + hd * p.m0.s1)) : 0.0;
#pragma unroll 8
  for (std::int64_t kc = 0; kc < L.NC; ++kc) {
    m[kc] = mk;
    mk = e[2 * kc] + fmax(e[2 * kc + 1], mk);  // = s_g[n-1] + s_M[n-1] of the chunk entered with mk
  }
  if (chain) {  // G_NC-1 = R_NC, G_k = G_k+1 + X_k+1: X_k replaced by G_k, last chunk first
    double* __restrict__ x = k4_chain_of(ws, L) + bh * L.NC;
    double G = 0.0;
    for (std::int64_t tl = 0; tl < L.tiles; ++tl) G += ws[L.R + (bh * L.ns + L.NC) * L.tiles + tl];
    for (std::int64_t kc = L.NC - 1; kc >= 0; --kc) {
      const double xk = x[kc];
      x[kc] = G;
      G += xk;
    }
  }
}

__global__ void __launch_bounds__(kThreads) k4_chunks(const MlstmBwdParams B, float* ws, BwdWs L, bool chain) {
  const MlstmParams& p = B.f;
  __shared__ double s_g[kMaxL], s_a[kMaxL], s_M[kMaxL];
  __shared__ double s_x[kMaxL];  // suffix scan of the chunk
  __shared__ double s_tot;
  const int tid = threadIdx.x;
  const std::int64_t bh = blockIdx.x, b = bh / p.NH, hd = bh % p.NH, S = p.S, kc = blockIdx.y, t0 = kc * p.L;
  const int n = int(S - t0 < p.L ? S - t0 : p.L);
  float* dlf = ws + L.dgq + bh * S;  // reused in place: dg_q -> dlf
  const float* dgkv = ws + L.dgkv + bh * S;
  float* gam = ws + L.gam + bh * S;  // (S) gamma_t
  const double mk = k4_m_of(ws, L)[bh * L.NC + kc];
  mlstm_chunk_gates(p, b, hd, t0, n, mk, s_g, s_a, s_M);
  if (tid == 0) {
    const double G = k4_gp(ws, L, bh, kc, n);
    double dkR;  // d_k R_k: the entering state's part of the chunk decay's gradient
    if (chain && kc > 0) {  // chunk 0 by its R_0: dm0's d_0 R_0 may be far below G_0's rounding
      s_tot = k4_chain_of(ws, L)[bh * L.NC + kc];
      dkR = s_tot - G;
    } else {
      double R = 0.0;
      for (std::int64_t tl = 0; tl < L.tiles; ++tl) R += ws[L.R + (bh * L.ns + kc) * L.tiles + tl];
      dkR = exp(mk - s_M[n - 1]) * R;
      s_tot = G + dkR;  // the decay of the entering state, exp(G + m_k - m_{k+1})
    }
    if (kc == 0) {
      double dm0 = dkR;
      for (int t = 0; t < n; ++t) dm0 += ws[L.ey + bh * S + t];  // e_t = exp(g_t + m_0 - m_t)
      k4_dm0_of(ws, L)[bh] = dm0;
    }
  }
  if (tid < n) {
    s_x[tid] = double(dlf[t0 + tid]) + double(dgkv[t0 + tid]);
    const double prev = tid == 0 ? mk : s_M[tid - 1], a = s_a[tid];
    gam[t0 + tid] = prev > a ? 1.f : prev < a ? 0.f : 0.5f;
  }
  __syncthreads();
  for (int d = 1; d < n; d <<= 1) {  // inclusive suffix sum (Hillis-Steele; fixed order)
    const double add = tid + d < n ? s_x[tid + d] : 0.0;
    __syncthreads();
    if (tid < n) s_x[tid] += add;
    __syncthreads();
  }
  if (tid < n) dlf[t0 + tid] = float(s_tot + s_x[tid]);
}

__global__ void __launch_bounds__(kThreads) k4_gates(const MlstmBwdParams B, float* ws, BwdWs L) {
  const MlstmParams& p = B.f;
  __shared__ double s_fa[kThreads], s_fb[kThreads], s_d[kThreads];  // segment maps a + b D, incoming D
  __shared__ double s_tot;
  const int tid = threadIdx.x;
  const std::int64_t bh = blockIdx.x, b = bh / p.NH, hd = bh % p.NH, S = p.S;
  float* dlf = ws + L.dgq + bh * S;  // dlf after k4_chunks
  float* di = ws + L.dikv + bh * S;  // di_kv -> di
  const float* gam = ws + L.gam + bh * S;
  const double dm0 = L.NC > 0 ? k4_dm0_of(ws, L)[bh] : 0.0;
  // 2. the correction scan
  double Rl = 0.0;
  for (std::int64_t tl = 0; tl < L.tiles; ++tl) Rl += ws[L.R + (bh * L.ns + L.NC) * L.tiles + tl];
  const double dml = B.dm_last.p ? double(mlstm_ld(B.dm_last, b * B.dm_last.s0 + hd * B.dm_last.s1)) : 0.0;
  const double cS = dml - Rl;
  const std::int64_t seg = (S + kThreads - 1) / kThreads, lo = std::min<std::int64_t>(S, tid * seg),
                     hi = std::min<std::int64_t>(S, lo + seg);
  const float* corr = ws + L.corr + bh * S;
  {
    double fa = 0.0, fb = 1.0;  // d leaving the segment to the left = fa + fb * (d entering from the right)
    for (std::int64_t t = hi - 1; t >= lo; --t) {
      const double g = gam[t];
      fa = (fa + double(corr[t]) + (t == S - 1 ? cS : 0.0)) * g;
      fb *= g;
    }
    s_fa[tid] = fa, s_fb[tid] = fb;
  }
  __syncthreads();
  if (tid == 0) {
    double D = 0.0;
    for (int j = kThreads - 1; j >= 0; --j) s_d[j] = D, D = s_fa[j] + s_fb[j] * D;
    s_tot = S == 0 ? cS : D;  // d left of step 0 goes to m_initial
  }
  __syncthreads();
  {
    double d = s_d[tid];
    for (std::int64_t t = hi - 1; t >= lo; --t) {
      d += double(corr[t]) + (t == S - 1 ? cS : 0.0);
      const float g = gam[t];
      if (g == 1.f) {
        dlf[t] = float(double(dlf[t]) + d);
      } else if (g == 0.f) {
        di[t] = float(double(di[t]) + d);
        d = 0.0;
      } else {
        dlf[t] = float(double(dlf[t]) + 0.5 * d);
        di[t] = float(double(di[t]) + 0.5 * d);
        d *= 0.5;
      }
    }
  }
  // 3. outputs (each thread its own segment: written by it in step 2)
  for (std::int64_t t = lo; t < hi; ++t) {
    const double fv = double(mlstm_ld(p.f, b * p.f.s0 + hd * p.f.s1 + t));
    const double sig_neg = fv >= 0 ? exp(-fv) / (1.0 + exp(-fv)) : 1.0 / (1.0 + exp(fv));
    if (B.df.p) mlstm_st(B.df, b * B.df.s0 + hd * B.df.s1 + t, float(double(dlf[t]) * sig_neg));
    if (B.di.p) mlstm_st(B.di, b * B.di.s0 + hd * B.di.s1 + t, di[t]);
  }
  if (tid == 0 && B.dm0.p) mlstm_st(B.dm0, b * B.dm0.s0 + hd * B.dm0.s1, float(dm0 + s_tot));
}

// ---- DV above the tensor-core kernels' width (128, or 256 in two parts): the backward per DV slab ----
// The backward is linear in the output cotangents (dh, dc_last, dn_last, dm_last), and the slab
// problem (q, k, v[..., slab], i, f) has the full problem's den, m and n (none depends on v) and
// h[..., slab] as its output. So the full backward is the sum over slabs of the slab problems'
// backwards, slab j taking dh[..., slab j] and dc_last[..., slab j] (and slab 0 alone dn_last,
// dm_last): dv, dc0 are written per slab in place; dq, dk, di, df, dn0, dm0 are summed in fp32 in the
// workspace in slab order (deterministic), then stored once. Exact, not an approximation. dq and dk
// (the large ones) are summed by the tensor-core K3 roles as they store them (dq_add, dk_add: the
// last slab writes partial + its value straight to the output); a pass of their own over the fp32
// sums cost ~2.8 ms of ~19.5 at (8,16,8192,128,256).
// The slab width: the DV parts of 128 columns the tensor-core K3 roles take per CTA
// (mlstm_k3_dv_parts_max: up to 512 columns), else 128.
std::int64_t slab_dv(const MlstmBwdParams& B) { return 128 * std::int64_t(mlstm_k3_dv_parts_max(B.f.DQK)); }

MlstmBwdParams slab_problem(const MlstmBwdParams& B, std::int64_t j) {
  MlstmBwdParams s = B;
  const std::int64_t w = slab_dv(B), c0 = j * w;
  s.f.DV = std::min(w, B.f.DV - c0);
  auto shift = [&](StridedView& t) {  // columns c0.. of a view whose last dim is DV (contiguous)
    if (t.p) t.p = static_cast<char*>(t.p) + c0 * std::int64_t(dtype_size(t.dtype));
  };
  shift(s.f.v), shift(s.f.h), shift(s.f.c0), shift(s.dh), shift(s.dc_last), shift(s.dv), shift(s.dc0);
  if (j > 0) s.dn_last = s.dm_last = StridedView{};
  return s;
}

bool split_applies(const MlstmBwdParams& B) {
  return B.f.DV > slab_dv(B) && mlstm_bwd_k3_tc_applies(slab_problem(B, 0));
}

bool core_tc(const MlstmBwdParams& B);

std::atomic<int> g_slab_overlap{0};  // 0: the planner's choice, 1: always, -1: never
std::atomic<bool> g_decay_chain{true};  // set_mlstm_bwd_decay_chain (measured: bwd -3 to -6.5%, session 33)

// Slabs two at a time, on the caller's stream and a side stream (bwd_split), where the serial scans
// of one slab leave most SMs idle: K2's grid per slab (heads x DQK tiles x slab_dv / 64) at most one
// CTA per SM.
// At (1,8,8192,256,512) K2 runs 64 CTAs and K0 128 per slab, each walking 128 chunks.
bool slab_overlap(const MlstmBwdParams& B) {
  const int mode = g_slab_overlap.load();
  if (mode != 0) return mode > 0;
  const MlstmParams& p = B.f;
  try {
    return p.B * p.NH * ((p.DQK + 63) / 64) * (slab_dv(B) / 64) <= sm_count();  // K2's CTAs of one slab
  } catch (const Error&) {
    return false;  // no device to plan for (a workspace query on a machine without a GPU)
  }
}

// fp32 sums after the core workspace of one slab: acc then tmp, each dq, dk (B NH S DQK), di, df
// (B NH S), dn0 (B NH DQK), dm0 (B NH); offsets in floats (part[e] into acc, tpart[e] into tmp).
// Where the tensor-core K3 roles sum dq and dk (fused), they add into acc directly and tmp holds
// di .. dm0 alone: at (8,16,8192,128,256) that is 1.07 GB less workspace. overlap (fused, two slabs
// or more, slab_overlap): a second core workspace and tmp at core2, tmp2 for the side stream's slabs.
struct SplitWs {
  std::int64_t part[6], tpart[6], len[6], acc, tmp, core2 = 0, tmp2 = 0, total;
  bool fused, overlap;
  explicit SplitWs(const MlstmBwdParams& B) {
    const MlstmParams& p = B.f;
    const std::int64_t core = BwdWs(slab_problem(B, 0).f).total, hs = p.B * p.NH;
    const std::int64_t n[6] = {hs * p.S * p.DQK, hs * p.S * p.DQK, hs * p.S, hs * p.S, hs * p.DQK, hs};
    fused = core_tc(slab_problem(B, 0));
    std::int64_t o = 0, t = 0;
    for (int e = 0; e < 6; ++e) {
      const std::int64_t al = (n[e] + 63) / 64 * 64;
      part[e] = o, len[e] = n[e], o += al;
      tpart[e] = t;
      if (!fused || e >= 2) t += al;
    }
    acc = core, tmp = core + o, total = core + o + t;
    overlap = fused && slab_overlap(B);  // (two slabs or more: bwd_split's caller checked DV > slab_dv)
    if (overlap) core2 = total, tmp2 = core2 + core, total = tmp2 + t;
  }
};

// The order across the two streams of overlapped slabs (bwd_split): slab j's K3 q-role (the dq sum)
// after slab j - 1's, its kv-role (dk) likewise, and its partial sums' add into acc after slab
// j - 1's end. Events of the call (bwd_split's), null where there is nothing to wait for or record.
struct SlabSync {
  cudaEvent_t q_wait = nullptr, q_done = nullptr, kv_wait = nullptr, kv_done = nullptr;
};
void wait_on(cudaStream_t s, cudaEvent_t e) {
  if (e) FW_CUDA_CHECK("mlstm_bwd (slab order)", cudaStreamWaitEvent(s, e, 0));
}
void record(cudaEvent_t e, cudaStream_t s) {
  if (e) FW_CUDA_CHECK("mlstm_bwd (slab order)", cudaEventRecord(e, s));
}

__global__ void split_add_kernel(float* __restrict__ acc, const float* __restrict__ tmp, std::int64_t n) {
  for (std::int64_t e = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; e < n; e += std::int64_t(gridDim.x) * blockDim.x)
    acc[e] += tmp[e];
}

// acc (B, NH, R, D) contiguous -> out element (b, h, r, c) at b s0 + h s1 + r s2 + c
__global__ void split_store_kernel(const float* __restrict__ acc, const StridedView out, std::int64_t NH,
                                   std::int64_t R, std::int64_t D, std::int64_t n) {
  for (std::int64_t e = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; e < n;
       e += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t c = e % D, r = (e / D) % R, h = (e / (D * R)) % NH, b = e / (D * R * NH);
    mlstm_st(out, b * out.s0 + h * out.s1 + r * out.s2 + c, acc[e]);
  }
}

unsigned grid_for(std::int64_t n) { return unsigned(std::min<std::int64_t>((n + 255) / 256, 4096)); }

void bwd_core(const MlstmBwdParams& B, float* ws, Stream stream, const SlabSync* sy = nullptr);

// A call's events for overlapped slabs: per slab q (after its K3 q-role), kv (after its kv-role) and
// end (after its partial sums are in acc), created and destroyed with the call (shared ones could be
// re-recorded by another host thread between a record and its wait). The destructor makes the
// caller's stream wait for the side stream's last slab: the join on every path, a throw included.
struct SlabEvents {
  std::vector<cudaEvent_t> ev;
  cudaStream_t main = nullptr, side = nullptr;
  cudaEvent_t side_end = nullptr;
  SlabEvents(std::int64_t nsl, cudaStream_t m, cudaStream_t sd) : ev(std::size_t(3 * nsl + 1), nullptr), main(m), side(sd) {
    try {
      for (auto& e : ev) FW_CUDA_CHECK("mlstm_bwd (events)", cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    } catch (...) {
      release();  // (no destructor runs for a constructor that throws)
      throw;
    }
  }
  cudaEvent_t q(std::int64_t j) const { return ev[std::size_t(3 * j)]; }
  cudaEvent_t kv(std::int64_t j) const { return ev[std::size_t(3 * j + 1)]; }
  cudaEvent_t end(std::int64_t j) const { return ev[std::size_t(3 * j + 2)]; }
  cudaEvent_t fork() const { return ev.back(); }
  void release() {
    for (auto& e : ev)
      if (e) (void)cudaEventDestroy(e), e = nullptr;
  }
  ~SlabEvents() {
    if (side_end) (void)cudaStreamWaitEvent(main, side_end, 0);
    release();
  }
  SlabEvents(const SlabEvents&) = delete;
  SlabEvents& operator=(const SlabEvents&) = delete;
};

void bwd_split(const MlstmBwdParams& B, float* ws, Stream stream) {
  const MlstmParams& p = B.f;
  const SplitWs W(B);
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  StridedView* outs[6] = {nullptr};
  MlstmBwdParams proto = B;
  StridedView* targets[6] = {&proto.dq, &proto.dk, &proto.di, &proto.df, &proto.dn0, &proto.dm0};
  const std::int64_t dims[6][2] = {{p.S, p.DQK}, {p.S, p.DQK}, {1, p.S}, {1, p.S}, {1, p.DQK}, {1, 1}};
  const std::int64_t nsl = (p.DV + slab_dv(B) - 1) / slab_dv(B);
  const bool fused = W.fused;  // dq, dk summed by K3 (e = 0, 1)
  // Overlapped: odd slabs on the side stream with the second core workspace and tmp; the side
  // stream first waits for everything before the call on the caller's stream.
  std::unique_ptr<SlabEvents> evs;
  if (W.overlap) {
    evs = std::make_unique<SlabEvents>(nsl, s, side_stream());
    record(evs->fork(), s);
    wait_on(evs->side, evs->fork());
  }
  for (std::int64_t j = 0; j < nsl; ++j) {
    const bool odd = W.overlap && j % 2 == 1;
    const cudaStream_t sj_stream = odd ? evs->side : s;
    float* const core_ws = odd ? ws + W.core2 : ws;
    const std::int64_t tmp = odd ? W.tmp2 : W.tmp;
    SlabSync sy;
    if (W.overlap) {
      sy.q_wait = j > 0 ? evs->q(j - 1) : nullptr, sy.q_done = evs->q(j);
      sy.kv_wait = j > 0 ? evs->kv(j - 1) : nullptr, sy.kv_done = evs->kv(j);
    }
    MlstmBwdParams sj = slab_problem(B, j);
    StridedView* mine[6] = {&sj.dq, &sj.dk, &sj.di, &sj.df, &sj.dn0, &sj.dm0};
    const float** mine_add[2] = {&sj.dq_add, &sj.dk_add};
    for (int e = 0; e < 6; ++e) {
      if (!targets[e]->p) continue;
      outs[e] = targets[e];
      if (fused && e < 2) {  // slab 0 starts the sum, the middle ones add to it, the last stores it
        if (j > 0) *mine_add[e] = ws + W.acc + W.part[e];
        if (j + 1 < nsl) *mine[e] = StridedView{ws + W.acc + W.part[e], DType::f32, p.NH * p.S * p.DQK, p.S * p.DQK, p.DQK};
        continue;
      }
      // the contiguous fp32 (B, NH, R, D) part as a view: s0 = NH R D, s1 = R D, s2 = D (R = 1: unused)
      const std::int64_t R = dims[e][0], D = dims[e][1];
      *mine[e] = StridedView{ws + (j == 0 ? W.acc + W.part[e] : tmp + W.tpart[e]), DType::f32, p.NH * R * D, R * D, D};
    }
    bwd_core(sj, core_ws, reinterpret_cast<Stream>(sj_stream), W.overlap ? &sy : nullptr);
    if (j > 0) {
      if (W.overlap) wait_on(sj_stream, evs->end(j - 1));  // acc's earlier sums are in (slab order)
      for (int e = 0; e < 6; ++e) {
        if (!outs[e] || W.len[e] == 0 || (fused && e < 2)) continue;
        split_add_kernel<<<grid_for(W.len[e]), 256, 0, sj_stream>>>(ws + W.acc + W.part[e], ws + tmp + W.tpart[e],
                                                                   W.len[e]);
        FW_CUDA_CHECK_LAUNCH("mlstm_bwd");
      }
    }
    if (W.overlap) {
      record(evs->end(j), sj_stream);
      if (odd) evs->side_end = evs->end(j);
    }
  }
  if (W.overlap) wait_on(s, evs->end(nsl - 1));  // the last slab's sums (and dq / dk) before the stores
  for (int e = 0; e < 6; ++e) {
    if (!outs[e] || W.len[e] == 0 || (fused && e < 2)) continue;
    split_store_kernel<<<grid_for(W.len[e]), 256, 0, s>>>(ws + W.acc + W.part[e], *outs[e], p.NH, dims[e][0],
                                                           dims[e][1], W.len[e]);
    FW_CUDA_CHECK_LAUNCH("mlstm_bwd");
  }
}

}  // namespace

int set_mlstm_slab_overlap(int mode) { return g_slab_overlap.exchange(mode > 0 ? 1 : mode < 0 ? -1 : 0); }
bool set_mlstm_bwd_decay_chain(bool on) { return g_decay_chain.exchange(on); }

std::size_t mlstm_bwd_workspace_bytes(const MlstmBwdParams& b) {
  return std::size_t(split_applies(b) ? SplitWs(b).total : BwdWs(b.f).total) * 4;
}

void mlstm_bwd_cuda(const MlstmBwdParams& B, void* workspace, std::size_t workspace_bytes, Stream stream) {
  const MlstmParams& p = B.f;
  if (p.B * p.NH == 0) return;
  const std::size_t need = mlstm_bwd_workspace_bytes(B);
  if (workspace_bytes < need) throw ArgumentError(cat("mlstm_bwd: workspace: ", workspace_bytes, " bytes, need ", need));
  if (split_applies(B))
    bwd_split(B, static_cast<float*>(workspace), stream);
  else
    bwd_core(B, static_cast<float*>(workspace), stream);
}

namespace {
// Whether bwd_core runs the tensor-core K3 roles (they alone write dq and dk then).
bool core_tc(const MlstmBwdParams& B) {
  return B.f.chunks() > 0 && mlstm_bwd_k3_tc_applies(B) && mlstm_bwd_k2_tc_applies(B);
}

// The backward of one problem (DV <= 128 where the tensor-core kernels run) into workspace ws.
void bwd_core(const MlstmBwdParams& B, float* ws, Stream stream, const SlabSync* sy) {
  const MlstmParams& p = B.f;
  const BwdWs L(p);
  const std::int64_t heads = p.B * p.NH;
  if (heads == 0) return;
  const std::int64_t kt = (p.DQK + kT - 1) / kT, vt = (p.DV + kT - 1) / kT;
  if (heads > 0x7fffffff || L.NC > 65535 || L.rbs * kt > 65535 || kt > 65535 || vt > 65535)
    throw Error(cat("mlstm_bwd: grid too large (heads ", heads, ", chunks ", L.NC, ")"));
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  MlstmParams pf = p;
  pf.c_last = pf.n_last = pf.m_last = StridedView{};
  // bf16, chunk 64, head dims <= 128: tensor cores, K1's row statistics inside K3's q-role
  const bool tc = core_tc(B);
  // the chunk decays' gradients by K4's chain (K2 on tensor cores for the tensor-core K3: tc)
  const bool chain = tc && g_decay_chain.load(std::memory_order_relaxed);
  if (mlstm_states_tc_applies(pf))  // K0 (C as bf16 hi / lo for the tensor-core K3 q-role)
    mlstm_states_tc_f32(pf, ws + L.c, ws + L.n, ws + L.m, reinterpret_cast<double*>(ws + L.gates), stream, tc);
  else
    mlstm_states_cuda(pf, ws + L.c, ws + L.n, ws + L.m, stream);
  const std::size_t smem = sizeof(Tiles);
  for (const void* k : {reinterpret_cast<const void*>(&k1_rows), reinterpret_cast<const void*>(&k3_dq),
                        reinterpret_cast<const void*>(&k3_dkdv)})
    (void)resident_ctas_per_sm(k, kThreads, smem);  // raises the dynamic shared-memory limit
  const unsigned H = unsigned(heads), NC = unsigned(L.NC), RB = unsigned(L.rbs);
  if (tc) {
    if (sy) wait_on(s, sy->q_wait);
    mlstm_bwd_k3q_tc(B, ws, L, stream);
    if (sy) record(sy->q_done, s);
  } else if (NC > 0) {
    k1_rows<<<dim3(H, NC, RB), kThreads, smem, s>>>(B, ws, ws, L);
    FW_CUDA_CHECK_LAUNCH("mlstm_bwd");
  }
  if (mlstm_bwd_k2_tc_applies(B)) {
    mlstm_bwd_k2_tc(B, ws, L, tc, stream, chain);
  } else {
    k2_scan<<<dim3(H, unsigned(kt), unsigned(vt)), kThreads, 0, s>>>(B, ws, L);
    FW_CUDA_CHECK_LAUNCH("mlstm_bwd");
  }
  if (tc) {
    mlstm_bwd_dn_scan(B, ws, L, stream);
    if (sy) wait_on(s, sy->kv_wait);
    mlstm_bwd_k3kv_tc(B, ws, L, stream);
    if (sy) record(sy->kv_done, s);
  } else if (NC > 0) {
    k3_dq<<<dim3(H, NC, RB * unsigned(kt)), kThreads, smem, s>>>(B, ws, L);
    FW_CUDA_CHECK_LAUNCH("mlstm_bwd");
    k3_dkdv<<<dim3(H, NC, RB * 2), kThreads, smem, s>>>(B, ws, L);
    FW_CUDA_CHECK_LAUNCH("mlstm_bwd");
  }
  if (NC > 0) {
    k4_ends<<<dim3(H, NC), kThreads, 0, s>>>(B, ws, L, chain);
    FW_CUDA_CHECK_LAUNCH("mlstm_bwd");
    k4_mchain<<<unsigned((heads + kThreads - 1) / kThreads), kThreads, 0, s>>>(B, ws, L, chain);
    FW_CUDA_CHECK_LAUNCH("mlstm_bwd");
    k4_chunks<<<dim3(H, NC), kThreads, 0, s>>>(B, ws, L, chain);
    FW_CUDA_CHECK_LAUNCH("mlstm_bwd");
  }
  k4_gates<<<H, kThreads, 0, s>>>(B, ws, L);
  FW_CUDA_CHECK_LAUNCH("mlstm_bwd");
}
}  // namespace

}  // namespace fastweight::detail
