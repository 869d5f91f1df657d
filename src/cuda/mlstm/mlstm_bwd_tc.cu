// mlstm_bwd_tc.cu: the chunkwise mLSTM backward (mlstm_bwd.cu, docs/design/mlstm_backward.md) on
// tensor cores, for bf16 q, k, v, dh, chunk 64, DQK <= 256 (above 128 the states in two DQK halves,
// one at a time) and DV <= 128, or DV <= 256 in two 128-column parts where DQK <= 128 (larger DV: per
// slab): K3 (two kernels, one CTA per
// (head, chunk): q-role 4 warps of 16 rows, kv-role 8 warps of 16 rows x a 64-column half), K2 and
// dn_scan. Products by mma.sync m16n8k16 (bf16 -> fp32). Order: K0, K3 q-role, K2 (dC only), dn_scan, K3 kv-role, K4.
//   q-role  (rows t): S = q k^T, WD = dh v^T, dh C_k^T; the row statistics (den, db, corr, eY: K1 of
//           the CUDA-core path) from them; X = WD / den_t + db_t, Y = D X (s <= t);
//           dq = scale (e_t (dh C_k^T / den_t + db_t n_k) + Y k);  dg_t = sum_s P X + eY_t;
//           p_k = sum_t scale e_t db_t q_t (dn's chunk term)
//   kv-role (rows s): S^T = k q^T, WD^T = v dh^T; the same X, D, P transposed;
//           dk = scale Y^T q + w_s (v dC_{k+1}^T + dn_{k+1});  dv = P^T dnum + w_s k dC_{k+1};
//           da_s = sum_t P X + w_s k_s . (dC_{k+1} v_s + dn_{k+1}), G partial = sum_s w_s (...)
// P and Y stay in registers between the products (FlashAttention-2's fragment reuse). The chunk
// states C_k and dC_{k+1} come from K0 / K2 as bf16 hi and lo = bf16(x - hi) (~16 bits; the lo part
// where they feed gate gradients); every other scaling (1/den, e_t, w_s, scale) is applied in fp32 to
// the accumulators or to P, Y. Deterministic (fixed-order sums).
#include <algorithm>
#include <atomic>
#include <type_traits>

#include "cuda/common/check.cuh"
#include "cuda/mlstm/mlstm_bwd_ws.h"
#include "cuda/mlstm/mlstm_common.cuh"
#include "cuda/mlstm/mlstm_cuda.h"
#include "cuda/mlstm/mlstm_tc.cuh"

namespace fastweight::detail {
namespace {

using namespace mtc;
constexpr int kThreads = kTcThreads;
constexpr int kMaxD = 128;   // DV columns in shared memory at once (up to mlstm_k3_dv_parts_max parts of
                             // them per CTA; larger DV: the slabs of mlstm_bwd.cu)
constexpr int kMaxDq = 256;  // DQK (above 128: the state in two DQK halves, one at a time)
constexpr int kHalf = 128;   // state rows (DQK) held in shared memory at once

struct K3Flags {
  bool q, k, v, dh;  // 16-byte rows: cp.async
  bool dv_lo = false;  // kv-role: dv's k dC product with dC's lo part too (set_mlstm_dv_lo)
};

// Dynamic smem, Dq = DQK and Dv = DV rounded up to 16, ldq = Dq + 8, ldv = Dv + 8 (bf16 elements),
// Sq = min(Dq, 128) state rows (a DQK half of it above 128):
//   bf16 q[64][ldq] | k[64][ldq] | dh[64][ldv] | v[64][ldv] | st[Sq][ldv] (C_k or dC_{k+1}) |
//   [bf16 st_lo[Sq][ldv]: st - bf16(st), split only] | f32 nv[Dq] (n_k or dn_{k+1}) | f32 inv_den[64], db[64] |
//   [f32 stash[4 warps][16 n-tiles][4][32 lanes]: the q-role's first DQK half of dh C_k^T, Dq > 128 only]
struct K3Layout {
  int Dq, Dv, ldq, ldv, Sq;
  bool split;
  std::size_t q, k, dh, v, st, lo, nv, inv, db, stash, bytes;
  __host__ __device__ K3Layout(std::int64_t DQK, std::int64_t DV, bool split_) : split(split_) {
    Dq = int(round_up(DQK, 16)), Dv = int(round_up(DV, 16)), ldq = Dq + 8, ldv = Dv + 8;
    Sq = Dq < kHalf ? Dq : kHalf;
    q = 0, k = q + 2 * std::size_t(kT) * ldq, dh = k + 2 * std::size_t(kT) * ldq;
    v = dh + 2 * std::size_t(kT) * ldv, st = v + 2 * std::size_t(kT) * ldv;
    lo = st + 2 * std::size_t(Sq) * ldv;
    nv = lo + (split ? 2 * std::size_t(Sq) * ldv : 0);
    inv = nv + 4 * std::size_t(Dq), db = inv + 4 * kT;
    stash = round_up(db + 4 * kT, 16);
    bytes = stash + (!split && Dq > kHalf ? 4 * std::size_t(kT) * kHalf : 0);
  }
};

struct K3Smem {
  bf16 *q, *k, *dh, *v, *st, *lo;
  float *nv, *inv, *db, *stash;
  const K3Layout lay;
  __device__ K3Smem(char* base, std::int64_t DQK, std::int64_t DV, bool split) : lay(DQK, DV, split) {
    q = reinterpret_cast<bf16*>(base + lay.q), k = reinterpret_cast<bf16*>(base + lay.k);
    dh = reinterpret_cast<bf16*>(base + lay.dh), v = reinterpret_cast<bf16*>(base + lay.v);
    st = reinterpret_cast<bf16*>(base + lay.st), nv = reinterpret_cast<float*>(base + lay.nv);
    lo = split ? reinterpret_cast<bf16*>(base + lay.lo) : nullptr;
    inv = reinterpret_cast<float*>(base + lay.inv), db = reinterpret_cast<float*>(base + lay.db);
    stash = reinterpret_cast<float*>(base + lay.stash);
  }
};

// The common loads of both roles, all by cp.async, in two groups the caller waits for:
//   group 0: q, k, dh, v rows of the chunk; its steps' g, a, A (float64, from K0's gate pass: the same
//            Hillis-Steele sums and maxima mlstm_chunk_gates forms, so the same bits) into s_g, s_a,
//            s_M (A_t, without m_k: k3_gates finishes it); 1/den and db of the rows (kv-role);
//   group 1: a state matrix (DQK, DV) from the workspace slot sthl, bf16 hi then lo (K0's C_k, K2's
//            dC_{k+1}; written so by them on this path: converting fp32 states here took ~10 us of a
//            ~50 us CTA), hi into st and, where the layout has it, lo (its first DQK half above
//            128: k3_state_half loads the second); its vector (DQK) into nv.
// The first products need only group 0, so the state lands under them.
// DQK, DV: the problem's (p.DQK, p.DV), passed by the kernel as compile-time values where it has them.
__device__ __forceinline__ void k3_issue(const MlstmBwdParams& B, const K3Flags& fl, const K3Smem& sm, const BwdWs& L,
                                         const float* ws, std::int64_t b, std::int64_t hd, std::int64_t t0, int n,
                                         const bf16* sthl, const float* nvf, const float* inv_den, const float* dbv,
                                         double* s_g, double* s_a, double* s_M, int DQK, int DV, int nthreads,
                                         int ldst = 0) {
  const MlstmParams& p = B.f;
  const int ldq = sm.lay.ldq, ldv = sm.lay.ldv, Dq = sm.lay.Dq, Dv = sm.lay.Dv;
  const int tid = threadIdx.x;
  auto rows = [&](const StridedView& t) {
    return static_cast<const bf16*>(t.p) + b * t.s0 + hd * t.s1 + t0 * t.s2;
  };
  load_tile(sm.q, ldq, kT, Dq, rows(p.q), p.q.s2, n, DQK, fl.q, nthreads);
  load_tile(sm.k, ldq, kT, Dq, rows(p.k), p.k.s2, n, DQK, fl.k, nthreads);
  load_tile(sm.dh, ldv, kT, Dv, rows(B.dh), B.dh.s2, n, DV, fl.dh, nthreads);
  load_tile(sm.v, ldv, kT, Dv, rows(p.v), p.v.s2, n, DV, fl.v, nthreads);
  const double* gw = reinterpret_cast<const double*>(ws + L.gates) + (b * p.NH + hd) * p.S + t0;
  const std::int64_t hs = L.heads * p.S;  // g, a, A: (heads, S) float64 each
  if (tid < n) {
    cp_async8(s_g + tid, gw + tid);
    cp_async8(s_a + tid, gw + hs + tid);
    cp_async8(s_M + tid, gw + 2 * hs + tid);
  }
  if (inv_den && tid < kT) {  // the q-role computes them (nullptr there)
    if (tid < n) {
      cp_async4(sm.inv + tid, inv_den + tid);
      cp_async4(sm.db + tid, dbv + tid);
    } else {
      sm.inv[tid] = 0.f, sm.db[tid] = 0.f;
    }
  }
  cp_async_commit();
  // 16-byte rows where DV % 8 == 0 (the workspace slot is then 16-byte aligned too)
  // ldst: the slot's row stride (the whole DV where the role walks DV in 128-column parts), else DV
  const int Sq = sm.lay.Sq, n0 = DQK < Sq ? DQK : Sq, ls = ldst ? ldst : DV;
  load_tile(sm.st, ldv, Sq, Dv, sthl, ls, n0, DV, ls % 8 == 0, nthreads);
  if (sm.lo) load_tile(sm.lo, ldv, Sq, Dv, sthl + std::int64_t(DQK) * ls, ls, n0, DV, ls % 8 == 0, nthreads);
  for (int r = tid; r < Dq; r += nthreads) {
    if (r < DQK) cp_async4(sm.nv + r, nvf + r);
    else sm.nv[r] = 0.f;
  }
  cp_async_commit();
}

// The state's DQK half hh (rows 128 hh..) into st and, where the layout has it, lo: one cp.async
// group, after every warp is done with the other half (the caller syncs before and waits after).
// ld: the slot's row stride (the problem's DV), nc: the columns loaded (a DV part's, from sthl on)
__device__ void k3_state_half(const K3Smem& sm, const bf16* sthl, int DQK, int ld, int nc, int hh, int nthreads) {
  const int r0 = kHalf * hh, nr = DQK - r0 < kHalf ? DQK - r0 : kHalf;
  const int ldv = sm.lay.ldv, Sq = sm.lay.Sq, Dv = sm.lay.Dv;
  load_tile(sm.st, ldv, Sq, Dv, sthl + std::int64_t(r0) * ld, ld, nr, nc, ld % 8 == 0, nthreads);
  if (sm.lo) load_tile(sm.lo, ldv, Sq, Dv, sthl + std::int64_t(DQK + r0) * ld, ld, nr, nc, ld % 8 == 0, nthreads);
  cp_async_commit();
}

// After group 0 has landed (every thread waited): M_t = max(m_k, A_t), as mlstm_chunk_gates; the
// gate rows are then visible to every thread.
__device__ __forceinline__ void k3_gates(int n, double mk, double* s_M) {
  __syncthreads();
  if (int(threadIdx.x) < n) s_M[threadIdx.x] = fmax(s_M[threadIdx.x], mk);
  __syncthreads();
}

// acc (16 x N, N <= 8 NJ: 128 columns for NJ = 16, 64 for 8) += A B where A is given as fragments of
// the 4 k-steps (64 rows of B: the chunk's steps) and B is stored k-major (row k, N contiguous; stride ldb).
template <int NJ>
__device__ __forceinline__ void mma_fragb(float (&acc)[NJ][4], const std::uint32_t (&af)[4][4], const bf16* Bk, int ldb,
                                          int N, int lane) {
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
#pragma unroll
    for (int jj = 0; jj < NJ / 2; ++jj) {
      if (16 * jj >= N) break;
      std::uint32_t bb[4];
      ldsm_x4_t(bb, Bk + (ks * 16 + ld_row_b_kmajor(lane)) * ldb + 16 * jj + ld_col_b_kmajor(lane));
      mma_bf16_16816(acc[2 * jj], af[ks], bb[0], bb[1]);
      mma_bf16_16816(acc[2 * jj + 1], af[ks], bb[2], bb[3]);
    }
}

// acc n-tiles J0.. (16 rows mrow.. x N columns, N <= 8 (NJ - J0)) += A B^T with A row major (stride
// lda, K = Kp) and B stored n-major (row n = output column, K contiguous; stride ldb). NJ = 16: up to
// 128 columns (4-warp roles), 8: up to 64 (the 8-warp kv-role's column halves).
template <int J0 = 0, int NJ>
__device__ __forceinline__ void mma_abt(float (&acc)[NJ][4], const bf16* A, int lda, const bf16* Bn, int ldb, int Kp,
                                        int N, int mrow, int lane) {
  for (int ks = 0; ks < Kp / 16; ++ks) {
    std::uint32_t a[4];
    ldsm_x4(a, A + (16 * mrow + ld_row_a_rowmajor(lane)) * lda + ks * 16 + ld_col_a_rowmajor(lane));
#pragma unroll
    for (int jj = 0; jj < (NJ - J0) / 2; ++jj) {
      if (16 * jj >= N) break;
      std::uint32_t bb[4];
      ldsm_x4(bb, Bn + (16 * jj + ld_row_b_nmajor(lane)) * ldb + ks * 16 + ld_col_b_nmajor(lane));
      mma_bf16_16816(acc[J0 + 2 * jj], a, bb[0], bb[1]);
      mma_bf16_16816(acc[J0 + 2 * jj + 1], a, bb[2], bb[3]);
    }
  }
}

// 64-column variant for the 8-warp kv-role (two warps per 16 rows, each a 64-column half):
// acc (16 x N, N <= 64) += A (rows 16 mrow.., K = Kp, row major) B (k-major, stride ldb)
__device__ __forceinline__ void mma_ab8(float (&acc)[8][4], const bf16* A, int lda, const bf16* Bk, int ldb, int Kp,
                                        int N, int mrow, int lane) {
  for (int ks = 0; ks < Kp / 16; ++ks) {
    std::uint32_t a[4];
    ldsm_x4(a, A + (16 * mrow + ld_row_a_rowmajor(lane)) * lda + ks * 16 + ld_col_a_rowmajor(lane));
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      if (16 * jj >= N) break;
      std::uint32_t bb[4];
      ldsm_x4_t(bb, Bk + (ks * 16 + ld_row_b_kmajor(lane)) * ldb + 16 * jj + ld_col_b_kmajor(lane));
      mma_bf16_16816(acc[2 * jj], a, bb[0], bb[1]);
      mma_bf16_16816(acc[2 * jj + 1], a, bb[2], bb[3]);
    }
  }
}

// Writes the warp's (16 rows x 8 J columns from c0) accumulator rows rA, rB (rows of the chunk) of a
// (B, NH, S, N) output, times mul; rows >= n and columns >= N are not written. bf16 outputs with
// even strides and N take the column pairs as one 4-byte store (the same roundings). add: the DV
// slabs' fp32 partial sums, (N contiguous) rows of this chunk: the value stored is add + mul acc
// (rounded as two operations, as the separate sum pass did).
template <int J>
__device__ __forceinline__ void store_rows(const StridedView& out, const float (&acc)[J][4], std::int64_t b,
                                           std::int64_t hd, std::int64_t t0, int rA, int rB, int n, int c0,
                                           std::int64_t N, float mul, const float* add) {
  const int t4 = threadIdx.x & 3;
  auto val = [&](int j, int e, const float* ar, int c) {
    const float v = __fmul_rn(mul, acc[j][e]);
    return ar ? __fadd_rn(ar[c], v) : v;
  };
  const bool pairs = out.dtype == DType::bf16 && reinterpret_cast<std::uintptr_t>(out.p) % 4 == 0 && out.s0 % 2 == 0 &&
                     out.s1 % 2 == 0 && out.s2 % 2 == 0 && N % 2 == 0;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int r = hr ? rB : rA;
    if (r >= n || !out.p) continue;
    const std::int64_t row = b * out.s0 + hd * out.s1 + (t0 + r) * out.s2;
    const float* ar = add ? add + r * N : nullptr;
    if (pairs) {
      __nv_bfloat16* o = static_cast<__nv_bfloat16*>(out.p) + row;
#pragma unroll
      for (int j = 0; j < J; ++j) {
        const int c = c0 + 8 * j + 2 * t4;  // even: c < N means c + 1 < N
        if (c < N)
          *reinterpret_cast<__nv_bfloat162*>(o + c) =
              __floats2bfloat162_rn(val(j, 2 * hr, ar, c), val(j, 2 * hr + 1, ar, c + 1));
      }
    } else {
#pragma unroll
      for (int j = 0; j < J; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = c0 + 8 * j + 2 * t4 + e;
          if (c < N) mlstm_st(out, row + c, val(j, 2 * hr + e, ar, c));
        }
    }
  }
}

// ---- q role, with the row statistics (K1 of the CUDA-core path) -------------------------------------
// Per (head, chunk), warp w rows t = 16w + gq (+8). Besides dq and dg_q it forms the rows' statistics
// from the same products: b_t = sum_s P_ts + scale e_t (q_t . n_k) (the normaliser's argument),
// sa_t = sum_s P_ts (dh_t . v_s) and si_t = scale e_t q_t . (C_k dh_t) (dh against the intra and inter
// numerators; C_k dh_t is row t of dh C_k^T, dq's inter product, with C_k as bf16 hi + lo: si feeds
// the gate gradients, where one bf16 rounding of the state was 4% off under strong gates), then as
// k1_rows: 1/den, db, corr = eps dden, eY (written for K2, K3 kv and K4). Also the chunk's dn partial
// p_k = sum_t scale e_t db_t q_t (fixed row order) for dn_scan. C_k's low part goes over v, dead once
// dh v^T is formed, 64 rows of C_k at a time.
// NH: DQK halves of 128 (1 or 2), a compile-time count so that DQK <= 128 compiles without the
// stash and the halves' loops (the runtime count cost k3q 4% there: 224 -> 232 us, session 10).
// FQ, FV: DQK and DV fixed at compile time (the launch checks them), 0: runtime. Fixed, the tile strides,
// the products' trip counts and the shared-memory offsets are constants: ncu at (2,16,8192,128,128) had
// IMAD 22% and ISETP 8% of the executed instructions against HMMA 6%.
// FULL: every chunk of the launch has 64 rows (n a constant: the row guards fold away); the launch
// takes chunks kc0 + blockIdx.y (mlstm_bwd_k3q_tc: the full chunks in one launch, a short last one in
// another).
template <int NH, int FQ = 0, int FV = 0, bool FULL = false>
__global__ void __launch_bounds__(kThreads, 2) k3q_tc(const MlstmBwdParams B, const K3Flags fl, float* ws, const BwdWs L,
                                                      const int kc0) {
  const MlstmParams& p = B.f;
  __shared__ double s_g[kT], s_a[kT], s_M[kT];
  extern __shared__ float4 smem_raw[];
  // DVt: the problem's DV; DV: the columns held in shared memory at once (<= 128). The role walks DVt
  // in parts of 128 columns (dh, v, C_k's rows reloaded per part; WD and dh C_k^T summed over them),
  // so that q k^T, the row statistics, Y k and p_k are formed once for up to four parts (512 columns).
  const int DQK = FQ ? FQ : int(p.DQK), DVt = int(p.DV), DV = FV ? FV : (DVt < kMaxD ? DVt : kMaxD);
  const int nvp = (DVt + kMaxD - 1) / kMaxD;
  const K3Smem sm(reinterpret_cast<char*>(smem_raw), DQK, DV, false);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, t4 = lane & 3;
  const std::int64_t bh = blockIdx.x, b = bh / p.NH, hd = bh % p.NH, kc = kc0 + blockIdx.y, t0 = kc * kT;
  const int n = FULL ? kT : int(lmin(kT, p.S - t0));
  const double mk = double(ws[L.m + bh * L.ns + kc]);
  const bf16* sthl = reinterpret_cast<const bf16*>(ws + L.c + (bh * L.ns + kc) * DQK * DVt);  // K0's hi, lo
  k3_issue(B, fl, sm, L, ws, b, hd, t0, n, sthl, ws + L.n + (bh * L.ns + kc) * DQK, nullptr, nullptr, s_g, s_a, s_M, DQK,
           DV, kThreads, DVt);
  cp_async_wait<1>();  // group 0: q, k, dh, v, the gates
  k3_gates(n, mk, s_M);
  const float scale = rsqrtf(float(DQK));
  const int Dq = sm.lay.Dq, Dv = sm.lay.Dv, ldq = sm.lay.ldq, ldv = sm.lay.ldv;
  const int tA = 16 * warp + gq, tB = tA + 8;  // this thread's two rows
  const double MA = s_M[tA < n ? tA : 0], MB = s_M[tB < n ? tB : 0];

  float sacc[8][4] = {}, wacc[8][4] = {};
  mma_rn(sacc, sm.q, ldq, warp, sm.k, ldq, Dq, lane);   // q k^T: (t, s)
  mma_rn(wacc, sm.dh, ldv, warp, sm.v, ldv, Dv, lane);  // dh v^T: (t, s)
  cp_async_wait<0>();                                   // group 1: C_k hi (its first DQK half), n_k
  __syncthreads();
  // dh C_k^T, 128 DQK columns (a half of C_k) at a time: (16 rows, 128 columns) per warp. Above
  // DQK = 128 the first half waits in the stash (fp32, fragment order) for the statistics, which
  // need si over both halves.
  constexpr int nh = NH;  // == (Dq + kHalf - 1) / kHalf (the launch picks it)
  float dq[16][4];
  float siA = 0.f, siB = 0.f;  // this lane's parts of q_t . (C_k dh_t)
  float* stash = sm.stash + warp * (16 * 4 * 32);
  for (int hh = 0; hh < nh; ++hh) {
    const int c0 = kHalf * hh, Nh = Dq - c0 < kHalf ? Dq - c0 : kHalf;
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) dq[j][e] = 0.f;
    // + dh lo^T, lo = C_k - bf16(C_k) (K0's): rows c0 + 64 h.. of it in v's place, (64, Dv) bf16; the
    // first 64 rows load under the hi part's products (waited for after them: ncu had the loads'
    // wait at 18% of the stall samples when each was waited for where it was issued)
    for (int i = 0; i < nvp; ++i) {  // DV parts (one where DV <= 128)
      // the second DQK half walks the parts backwards: the last part's dh is still in shared memory
      const int vp = hh == 0 ? i : nvp - 1 - i;
      const int cv = kMaxD * vp, nvc = DVt - cv < kMaxD ? DVt - cv : kMaxD;
      if (hh > 0) {  // this half's C_k hi rows of this part (and the part's dh after the first)
        __syncthreads();  // every warp is done with st and v (the previous rows of lo) and dh
        if (i > 0) {
          const std::int64_t ro = b * B.dh.s0 + hd * B.dh.s1 + t0 * B.dh.s2 + cv;
          load_tile(sm.dh, ldv, kT, Dv, static_cast<const bf16*>(B.dh.p) + ro, B.dh.s2, n, nvc, fl.dh);
        }
        k3_state_half(sm, sthl + cv, DQK, DVt, nvc, hh, kThreads);
        cp_async_wait<0>();
        __syncthreads();
      } else if (vp > 0) {  // this part's dh, v and C_k hi rows (columns cv..) into dh, v, st; WD += dh v^T
        __syncthreads();  // every warp is done with dh, v (C_k's lo rows there) and st
        const std::int64_t ro = b * B.dh.s0 + hd * B.dh.s1 + t0 * B.dh.s2 + cv;
        const std::int64_t rv = b * p.v.s0 + hd * p.v.s1 + t0 * p.v.s2 + cv;
        load_tile(sm.dh, ldv, kT, Dv, static_cast<const bf16*>(B.dh.p) + ro, B.dh.s2, n, nvc, fl.dh);
        load_tile(sm.v, ldv, kT, Dv, static_cast<const bf16*>(p.v.p) + rv, p.v.s2, n, nvc, fl.v);
        load_tile(sm.st, ldv, sm.lay.Sq, Dv, sthl + cv, DVt, DQK < sm.lay.Sq ? DQK : sm.lay.Sq, nvc, DVt % 8 == 0);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
        mma_rn(wacc, sm.dh, ldv, warp, sm.v, ldv, Dv, lane);
      }
      auto issue_lo = [&](int h) {
        __syncthreads();  // every warp is done with v (or with the previous rows); the groups before are waited for
        const int r0 = c0 + 64 * h;
        load_tile(sm.v, ldv, kT, Dv, sthl + std::int64_t(DQK + r0) * DVt + cv, DVt, max(0, DQK - r0), nvc,
                  DVt % 8 == 0);
        cp_async_commit();
      };
      auto land_lo = [&](int h) {
        cp_async_wait<0>();
        __syncthreads();
        return min(64, Nh - 64 * h);
      };
      issue_lo(0);
      mma_abt(dq, sm.dh, ldv, sm.st, ldv, Dv, Nh, warp, lane);  // the hi part
      mma_abt<0>(dq, sm.dh, ldv, sm.v, ldv, Dv, land_lo(0), warp, lane);
      if (Nh > 64) {
        issue_lo(1);
        mma_abt<8>(dq, sm.dh, ldv, sm.v, ldv, Dv, land_lo(1), warp, lane);
      }
    }
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      if (8 * j >= Nh) break;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = e < 2 ? tA : tB, c = c0 + 8 * j + 2 * t4 + (e & 1);
        (e < 2 ? siA : siB) += dq[j][e] * __bfloat162float(sm.q[t * ldq + c]);
      }
    }
    if (hh + 1 < nh)
#pragma unroll
      for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) stash[(j * 4 + e) * 32 + lane] = dq[j][e];
  }

  // this lane's parts of sum_s P and sum_s P (dh . v_s); the decay matrix D kept for Y below (each
  // entry an exp and a float64 difference, formed twice before)
  float rsA = 0.f, rsB = 0.f, saA = 0.f, saB = 0.f;
  float dmat[8][4];  // D (t, s) of this lane's accumulator entries
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int t = e < 2 ? tA : tB, s = 8 * j + 2 * t4 + (e & 1);
      const bool on = t < n && s <= t;
      dmat[j][e] = on ? __expf(float(s_a[s] - (e < 2 ? MA : MB))) : 0.f;
      const float P = on ? scale * sacc[j][e] * dmat[j][e] : 0.f;
      (e < 2 ? rsA : rsB) += P;
      (e < 2 ? saA : saB) += P * wacc[j][e];
    }
  float qn;  // lanes 2r, 2r+1: q . n_k of row r of the warp (even / odd columns)
  {
    const bf16* qr = sm.q + (16 * warp + (lane >> 1)) * ldq;
    float x = 0.f;
    for (int c = lane & 1; c < Dq; c += 2) x = fmaf(__bfloat162float(qr[c]), sm.nv[c], x);
    qn = x + __shfl_xor_sync(0xffffffffu, x, 1);
  }
  const float qnA = __shfl_sync(0xffffffffu, qn, 2 * gq), qnB = __shfl_sync(0xffffffffu, qn, 2 * (gq + 8));
#pragma unroll
  for (int off = 1; off <= 2; off <<= 1) {
    rsA += __shfl_xor_sync(0xffffffffu, rsA, off), rsB += __shfl_xor_sync(0xffffffffu, rsB, off);
    saA += __shfl_xor_sync(0xffffffffu, saA, off), saB += __shfl_xor_sync(0xffffffffu, saB, off);
    siA += __shfl_xor_sync(0xffffffffu, siA, off), siB += __shfl_xor_sync(0xffffffffu, siB, off);
  }
  // the rows' statistics (every lane of a row's quad computes the same values)
  float inv[2] = {0.f, 0.f}, dbr[2] = {0.f, 0.f}, ey[2] = {0.f, 0.f};
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int t = hr ? tB : tA;
    if (t >= n) continue;
    const float et = float(exp(mk - s_M[t]));
    const float qnt = hr ? qnB : qnA;
    const float bsum = (hr ? rsB : rsA) + scale * et * qnt;
    const float si = (hr ? siB : siA) * scale * et, sa = hr ? saB : saA;
    const double mt = s_g[t] + s_M[t];
    const float em = float(exp(-mt)), ab = fabsf(bsum);
    const float den = fmaxf(ab, em) + p.eps;
    const float dden = -((si + sa) / den) / den;  // -(dh_t . h_t) / den
    const float sg = bsum > 0.f ? 1.f : bsum < 0.f ? -1.f : 0.f;
    inv[hr] = 1.f / den;
    dbr[hr] = ab > em ? dden * sg : ab < em ? 0.f : 0.5f * dden * sg;  // torch.maximum splits ties
    ey[hr] = si / den + scale * et * qnt * dbr[hr];
    if (t4 == 0) {
      const std::int64_t ri = bh * p.S + t0 + t;
      ws[L.inv_den + ri] = inv[hr];
      ws[L.db + ri] = dbr[hr];
      ws[L.corr + ri] = p.eps * dden;
      ws[L.ey + ri] = ey[hr];
    }
  }

  std::uint32_t yf[4][4];  // Y = D X as A fragments (k = s)
  float zA = 0.f, zB = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    float y[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float D = dmat[j][e];  // 0 off the causal triangle and past n
      const float X = wacc[j][e] * inv[e >> 1] + dbr[e >> 1];
      y[e] = D * X;
      (e < 2 ? zA : zB) += scale * sacc[j][e] * y[e];  // P X
    }
    pack_a_frags(yf, j, y);
  }
  const float eA = tA < n ? __expf(float(mk - s_M[tA])) : 0.f, eB = tB < n ? __expf(float(mk - s_M[tB])) : 0.f;
  for (int hh = nh - 1; hh >= 0; --hh) {  // the half in registers first, then the stashed one
    const int c0 = kHalf * hh, Nh = Dq - c0 < kHalf ? Dq - c0 : kHalf;
    if (hh + 1 < nh)
#pragma unroll
      for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) dq[j][e] = stash[(j * 4 + e) * 32 + lane];
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float nr = 8 * j < Nh ? sm.nv[c0 + 8 * j + 2 * t4 + (e & 1)] : 0.f;  // n-tiles past Dq stay 0
        dq[j][e] = e < 2 ? eA * (dq[j][e] * inv[0] + dbr[0] * nr) : eB * (dq[j][e] * inv[1] + dbr[1] * nr);
      }
    mma_fragb(dq, yf, sm.k + c0, ldq, Nh, lane);  // + Y k
    store_rows(B.dq, dq, b, hd, t0, tA, tB, n, c0, DQK, scale, B.dq_add ? B.dq_add + (bh * p.S + t0) * DQK : nullptr);
  }
  zA += __shfl_xor_sync(0xffffffffu, zA, 1), zB += __shfl_xor_sync(0xffffffffu, zB, 1);
  zA += __shfl_xor_sync(0xffffffffu, zA, 2), zB += __shfl_xor_sync(0xffffffffu, zB, 2);
  if (t4 == 0) {
    const std::int64_t o = bh * p.S + t0;
    if (tA < n) ws[L.dgq + o + tA] = zA + ey[0];
    if (tB < n) ws[L.dgq + o + tB] = zB + ey[1];
    sm.db[tA] = scale * eA * dbr[0], sm.db[tB] = scale * eB * dbr[1];  // 0 past n
  }
  __syncthreads();
  // p_k = sum_t (scale e_t db_t) q_t: four partial sums over rows t = u mod 4, in row order, then
  // ((0 + 1) + (2 + 3)); all 64 rows (db and the q rows past n are 0). One serial chain of n FMAs
  // with shared loads was 7% of the stall samples.
  float* pk = ws + L.pn + (bh * L.NC + kc) * DQK;
  for (int c = tid; c < DQK; c += kThreads) {
    float x[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int t = 0; t < kT; ++t) x[t & 3] = fmaf(sm.db[t], __bfloat162float(sm.q[t * ldq + c]), x[t & 3]);
    pk[c] = (x[0] + x[1]) + (x[2] + x[3]);
  }
}

// ---- kv role ------------------------------------------------------------------------------------------
// 8 warps: warp w owns steps s = 16 (w % 4).. and the 64-column half h = w / 4 of dk and of dv. Both
// warps of a row group form S^T, WD^T and the fragments (a sixth of the work, duplicated) so the
// output products split without exchanging fragments; u_s is summed over the halves in smem. One CTA
// per SM (140 KB): with 4 warps the kernel ran at one warp per scheduler (6.25% occupancy).
constexpr int kKvThreads = 256;
template <int FQ = 0, int FV = 0, bool FULL = false>  // DQK and DV fixed at compile time, full chunks: as k3q_tc
__global__ void __launch_bounds__(kKvThreads, 1) k3kv_tc(const MlstmBwdParams B, const K3Flags fl, float* ws,
                                                         const BwdWs L, const int kc0) {
  const MlstmParams& p = B.f;
  __shared__ double s_g[kT], s_a[kT], s_M[kT];
  __shared__ float s_red[kKvThreads / 32];
  __shared__ float s_u[2][kT];  // u_s of the two column halves
  extern __shared__ float4 smem_raw[];
  // dC_{k+1} as bf16 hi + lo: u_s and da_s are sums of large terms that cancel under strong gates
  // (i = +20, f = -20), where one bf16 rounding of dC put (di, df) 4% off (H100 run 9)
  // DVt: the problem's DV; DV: the columns held in shared memory at once (<= 128). The role walks DVt
  // in parts of 128 columns (as the q-role): S^T, the fragments and dk's epilogue once, WD^T and
  // v dC^T summed over the parts, dv per part (over the DQK halves within it). The state part loaded
  // first is the last one, whose v and dh the WD^T pass leaves in shared memory.
  const int DQK = FQ ? FQ : int(p.DQK), DVt = int(p.DV), DV = FV ? FV : (DVt < kMaxD ? DVt : kMaxD);
  const K3Smem sm(reinterpret_cast<char*>(smem_raw), DQK, DV, true);
  const int nvp = (DVt + kMaxD - 1) / kMaxD;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, t4 = lane & 3;
  const int rg = warp & 3, cg = warp >> 2;  // row group (16 steps), column half
  const std::int64_t bh = blockIdx.x, b = bh / p.NH, hd = bh % p.NH, kc = kc0 + blockIdx.y, t0 = kc * kT;
  const int n = FULL ? kT : int(lmin(kT, p.S - t0));
  const double mk = double(ws[L.m + bh * L.ns + kc]);
  const bf16* dchl = reinterpret_cast<const bf16*>(ws + L.dc + (bh * L.ns + kc + 1) * DQK * DVt);  // K2's hi, lo
  k3_issue(B, fl, sm, L, ws, b, hd, t0, n, dchl + kMaxD * (nvp - 1), ws + L.dn + (bh * L.ns + kc + 1) * DQK,
           ws + L.inv_den + bh * p.S + t0, ws + L.db + bh * p.S + t0, s_g, s_a, s_M, DQK, DV, kKvThreads, DVt);
  // DV part vp's v and dh rows (columns 128 vp..) into v, dh; with st, its dC_{k+1} hi / lo rows into st, lo
  auto load_part = [&](int vp, bool st) {
    const int cv = kMaxD * vp, nvc = DVt - cv < kMaxD ? DVt - cv : kMaxD;
    const int ldv_ = sm.lay.ldv, Dv_ = sm.lay.Dv;
    load_tile(sm.v, ldv_, kT, Dv_, static_cast<const bf16*>(p.v.p) + b * p.v.s0 + hd * p.v.s1 + t0 * p.v.s2 + cv, p.v.s2,
              n, nvc, fl.v, kKvThreads);
    load_tile(sm.dh, ldv_, kT, Dv_, static_cast<const bf16*>(B.dh.p) + b * B.dh.s0 + hd * B.dh.s1 + t0 * B.dh.s2 + cv,
              B.dh.s2, n, nvc, fl.dh, kKvThreads);
    if (st) {
      const int n0 = DQK < sm.lay.Sq ? DQK : sm.lay.Sq;
      load_tile(sm.st, ldv_, sm.lay.Sq, Dv_, dchl + cv, DVt, n0, nvc, DVt % 8 == 0, kKvThreads);
      load_tile(sm.lo, ldv_, sm.lay.Sq, Dv_, dchl + std::int64_t(DQK) * DVt + cv, DVt, n0, nvc, DVt % 8 == 0, kKvThreads);
    }
    cp_async_commit();
  };
  cp_async_wait<1>();  // group 0: q, k, dh, v, the gates, 1/den, db
  k3_gates(n, mk, s_M);
  const float scale = rsqrtf(float(p.DQK));
  const int Dq = sm.lay.Dq, Dv = sm.lay.Dv, ldq = sm.lay.ldq, ldv = sm.lay.ldv;
  const int sA = 16 * rg + gq, sB = sA + 8;  // this thread's two rows (steps s)
  const double ML = s_M[n - 1];
  const float wA = sA < n ? __expf(float(s_a[sA] - ML)) : 0.f, wB = sB < n ? __expf(float(s_a[sB] - ML)) : 0.f;

  std::uint32_t yf[4][4], pf[4][4];  // scale Y^T and P^T / den as A fragments (k = t)
  float zA = 0.f, zB = 0.f;
  {
    float sacc[8][4] = {}, wacc[8][4] = {};
    mma_rn(sacc, sm.k, ldq, rg, sm.q, ldq, Dq, lane);   // k q^T
    mma_rn(wacc, sm.v, ldv, rg, sm.dh, ldv, Dv, lane);  // v dh^T
    for (int vp = 1; vp < nvp; ++vp) {  // the other DV parts' v dh^T
      __syncthreads();  // every warp is done with v, dh
      load_part(vp, false);
      cp_async_wait<0>();
      __syncthreads();
      mma_rn(wacc, sm.v, ldv, rg, sm.dh, ldv, Dv, lane);
    }
    const double aA = s_a[sA < n ? sA : 0], aB = s_a[sB < n ? sB : 0];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float y[4], pp[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int s = e < 2 ? sA : sB, t = 8 * j + 2 * t4 + (e & 1);
        const bool on = s < n && t < n && s <= t;
        const float D = on ? __expf(float((e < 2 ? aA : aB) - s_M[t])) : 0.f;
        const float P = scale * sacc[j][e] * D;
        const float X = wacc[j][e] * sm.inv[t] + sm.db[t];
        (e < 2 ? zA : zB) += P * X;
        y[e] = scale * D * X;
        pp[e] = P * sm.inv[t];
      }
      pack_a_frags(yf, j, y);
      pack_a_frags(pf, j, pp);
    }
  }
  cp_async_wait<0>();  // group 1: dC_{k+1} hi / lo (its first DQK half), dn_{k+1}
  __syncthreads();
  // Per DQK half q0 of dC (one at a time in st / lo above DQK = 128):
  //   dk columns q0 + r0.. = w_s (v dC^T + dn) + scale Y^T q; u_s part = k_s . (dC v_s + dn) over them;
  //   dv columns c0.. += k[:, q0..] dC[q0.., c0..] (the contraction over DQK, half by half).
  float uA = 0.f, uB = 0.f;
  const int c0 = 64 * cg, nv = Dv - c0 < 64 ? Dv - c0 : 64;
  const int nh = (Dq + kHalf - 1) / kHalf;
  float dva[8][4] = {};  // dv (s, c0..)
  if (nvp > 1) {  // DV in parts: the last part is in v, dh, st, lo (its first DQK half); then the others, down to 0
    const int r0 = 64 * cg;  // dk columns q0 + r0.. of this warp in DQK half q0
    float dka[2][8][4] = {};  // v dC^T (s, q0 + r0..) per DQK half, summed over the parts
    for (int vp = nvp - 1; vp >= 0; --vp) {
      const int cv = kMaxD * vp, nvc = DVt - cv < kMaxD ? DVt - cv : kMaxD, nw = nvc - c0 < 64 ? nvc - c0 : 64;
      float dvp[8][4] = {};  // dv columns cv + c0.., summed over the DQK halves
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        if (hh >= nh) break;
        const int q0 = kHalf * hh, Nh = Dq - q0 < kHalf ? Dq - q0 : kHalf, nq = Nh - r0 < 64 ? Nh - r0 : 64;
        if (vp < nvp - 1 || hh > 0) {  // this part's v, dh (first half) and dC_{k+1} hi / lo rows of half hh
          __syncthreads();  // every warp is done with v, dh, st, lo
          if (hh == 0) load_part(vp, false);
          k3_state_half(sm, dchl + cv, DQK, DVt, nvc, hh, kKvThreads);
          cp_async_wait<0>();
          __syncthreads();
        }
        if (nq > 0) {
          mma_abt(dka[hh], sm.v, ldv, sm.st + r0 * ldv, ldv, Dv, nq, rg, lane);
          mma_abt(dka[hh], sm.v, ldv, sm.lo + r0 * ldv, ldv, Dv, nq, rg, lane);
        }
        if (nw > 0) {  // k dC from dC's hi part (see below)
          mma_ab8(dvp, sm.k + q0, ldq, sm.st + c0, ldv, Nh, nw, rg, lane);
          if (fl.dv_lo) mma_ab8(dvp, sm.k + q0, ldq, sm.lo + c0, ldv, Nh, nw, rg, lane);
        }
      }
      if (nw > 0) {  // dv columns cv + c0.. = w_s k dC + P^T dnum
#pragma unroll
        for (int j = 0; j < 8; ++j) dvp[j][0] *= wA, dvp[j][1] *= wA, dvp[j][2] *= wB, dvp[j][3] *= wB;
        mma_fragb(dvp, pf, sm.dh + c0, ldv, nw, lane);
        store_rows(B.dv, dvp, b, hd, t0, sA, sB, n, cv + c0, DVt, 1.f, nullptr);
      }
    }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {  // dk columns q0 + r0.. = w_s (v dC^T + dn) + scale Y^T q; u_s part = k_s . (dC v_s + dn)
      if (hh >= nh) break;
      const int q0 = kHalf * hh, Nh = Dq - q0 < kHalf ? Dq - q0 : kHalf, nq = Nh - r0 < 64 ? Nh - r0 : 64;
      if (nq <= 0) continue;
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (8 * j >= nq) break;
          const int r = q0 + r0 + 8 * j + 2 * t4 + (e & 1), s = e < 2 ? sA : sB;
          const float x = dka[hh][j][e] + sm.nv[r];
          (e < 2 ? uA : uB) += __bfloat162float(sm.k[s * ldq + r]) * x;
          dka[hh][j][e] = (e < 2 ? wA : wB) * x;
        }
      mma_fragb(dka[hh], yf, sm.q + q0 + r0, ldq, nq, lane);
      store_rows(B.dk, dka[hh], b, hd, t0, sA, sB, n, q0 + r0, DQK, 1.f,
                 B.dk_add ? B.dk_add + (bh * p.S + t0) * DQK : nullptr);
    }
  }
  for (int hh = 0; hh < (nvp > 1 ? 0 : nh); ++hh) {
    const int q0 = kHalf * hh, Nh = Dq - q0 < kHalf ? Dq - q0 : kHalf;
    if (hh > 0) {
      __syncthreads();  // every warp is done with the other half
      k3_state_half(sm, dchl, DQK, DV, DV, hh, kKvThreads);
      cp_async_wait<0>();
      __syncthreads();
    }
    const int r0 = 64 * cg, nq = Nh - r0 < 64 ? Nh - r0 : 64;  // nq <= 0: no dk columns in this part
    if (nq > 0) {
      float acc[8][4] = {};
      mma_abt(acc, sm.v, ldv, sm.st + r0 * ldv, ldv, Dv, nq, rg, lane);  // v dC^T: (s, r)
      mma_abt(acc, sm.v, ldv, sm.lo + r0 * ldv, ldv, Dv, nq, rg, lane);
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (8 * j >= nq) break;  // n-tiles past Dq: no columns (and no n) there
          const int r = q0 + r0 + 8 * j + 2 * t4 + (e & 1), s = e < 2 ? sA : sB;
          const float x = acc[j][e] + sm.nv[r];
          (e < 2 ? uA : uB) += __bfloat162float(sm.k[s * ldq + r]) * x;
          acc[j][e] = (e < 2 ? wA : wB) * x;
        }
      mma_fragb(acc, yf, sm.q + q0 + r0, ldq, nq, lane);
      store_rows(B.dk, acc, b, hd, t0, sA, sB, n, q0 + r0, DQK, 1.f, B.dk_add ? B.dk_add + (bh * p.S + t0) * DQK : nullptr);
    }
    if (nv > 0) {
      // k dC: (s, c), from dC's hi part alone: dv = w_s k dC + P^T dnum is a product of O(1) terms
      // (the forward's h takes C as bf16 hi alike), where the gate gradients' sums cancel; u_s, which
      // needs the lo part, comes from the v dC^T product above (hi + lo). One of the role's four
      // state products less.
      mma_ab8(dva, sm.k + q0, ldq, sm.st + c0, ldv, Nh, nv, rg, lane);
      if (fl.dv_lo) mma_ab8(dva, sm.k + q0, ldq, sm.lo + c0, ldv, Nh, nv, rg, lane);
    }
  }
  // dv columns c0.. = w_s k dC + P^T dnum (DV in one part)
  if (nvp == 1 && nv > 0) {
#pragma unroll
    for (int j = 0; j < 8; ++j) dva[j][0] *= wA, dva[j][1] *= wA, dva[j][2] *= wB, dva[j][3] *= wB;
    mma_fragb(dva, pf, sm.dh + c0, ldv, nv, lane);
    store_rows(B.dv, dva, b, hd, t0, sA, sB, n, c0, DV, 1.f, nullptr);
  }
  // the s-role scalars: da_s = d/di_s = -d/dg_s, and the chunk's dG partial sum_s w_s u_s (u_s: the
  // two halves' parts, added in order)
  uA += __shfl_xor_sync(0xffffffffu, uA, 1), uB += __shfl_xor_sync(0xffffffffu, uB, 1);
  uA += __shfl_xor_sync(0xffffffffu, uA, 2), uB += __shfl_xor_sync(0xffffffffu, uB, 2);
  zA += __shfl_xor_sync(0xffffffffu, zA, 1), zB += __shfl_xor_sync(0xffffffffu, zB, 1);
  zA += __shfl_xor_sync(0xffffffffu, zA, 2), zB += __shfl_xor_sync(0xffffffffu, zB, 2);
  if (t4 == 0) s_u[cg][sA] = uA, s_u[cg][sB] = uB;
  __syncthreads();
  float gpart = 0.f;
  if (cg == 0 && t4 == 0) {
    const std::int64_t o = bh * p.S + t0;
    const float ua = s_u[0][sA] + s_u[1][sA], ub = s_u[0][sB] + s_u[1][sB];
    if (sA < n) ws[L.dikv + o + sA] = zA + wA * ua, ws[L.dgkv + o + sA] = -(zA + wA * ua), gpart += wA * ua;
    if (sB < n) ws[L.dikv + o + sB] = zB + wB * ub, ws[L.dgkv + o + sB] = -(zB + wB * ub), gpart += wB * ub;
  }
  for (int off = 16; off > 0; off >>= 1) gpart += __shfl_xor_sync(0xffffffffu, gpart, off);
  if (lane == 0) s_red[warp] = gpart;
  __syncthreads();
  if (tid == 0) ws[L.G + (bh * L.NC + kc) * L.rbs] = (s_red[0] + s_red[1]) + (s_red[2] + s_red[3]);
}

// ---- K2 on tensor cores: the reverse scan of the state gradients -----------------------------------
// Grid (heads, DQK tiles, DV tiles) as k2_scan; 8 warps: warp w owns dC rows r0 + 16 (w % 4).. and
// columns c0 + 32 (w / 4).. in fp32 accumulators (the exact chain), walking the chunks backwards:
//   dC_k = d_k dC_{k+1} + sum_t (e_t scale / den_t) q_t dh_t^T,  dn_k = d_k dn_{k+1} + sum_t (e_t scale db_t) q_t
// with d_k = exp(m_k - M_{n-1}), e_t = exp(m_k - M_t), M_t = max(m_k, A_t) (A_t: the gate pass of
// K0). The per-step factors scale the A fragments of q^T in registers, split into bf16 hi + lo (as
// the forward's states kernel); dn is one more n-tile with B = ones (the column-half-0 warps). Writes
// dC_{k+1}, dn_{k+1} and <C_k, dC_{k+1}> + <n_k, dn_{k+1}> partials exactly as k2_scan, and dc0 / dn0.
// 8 warps, not 4: the chain is issue-bound at one warp per scheduler (ncu: 3.7 cycles per issue, 73%
// of cycles with no eligible warp), so two warps per scheduler each with half the columns.
constexpr int kScanThreads = 256;
struct ScanSmem {
  bf16 q[2][kT][kLd];   // (2 stages) (64 steps, 64 DQK columns) q
  bf16 dh[2][kT][kLd];  // (2 stages) (64 steps, 64 DV columns) dh
  double A[2][kT];      // (2 stages) A_t of the steps
  double Aend[2];       // (2 stages) A_{n-1} of the tile's chunk
  float mk[2];          // (2 stages) m_k of the tile's chunk (the workspace's fp32 value, as K1 / K3)
  float inv[2][kT], db[2][kT];
  float red[kScanThreads / 32];
  alignas(16) float fc[kScanThreads / 32][kT], fn[kScanThreads / 32][kT];  // (warp, 64 steps) the current tile's factors
  alignas(16) bf16 ch[2][kT][kLd];  // (2 stages) C_k hi, this tile's (64 DQK rows, 64 DV columns): the tensor-core path
  bf16 cl[2][kT][kLd];  // (2 stages) C_k lo
  alignas(1024) bf16 stage[kScanThreads / 32][WarpTileTma::kElems];  // (warp) its 16 x 32 piece of dC, hi / lo
};

// Fixed-order block sum over the 8 warps; every thread gets the same bits.
__device__ __forceinline__ float block_sum8(float v, float* red) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  return ((red[0] + red[1]) + (red[2] + red[3])) + ((red[4] + red[5]) + (red[6] + red[7]));
}

// MinB = 2: at most 128 registers (a little spill), so that two CTAs share an SM where the grid has
// more CTAs than SMs (e.g. (4,16,4096): 256 CTAs, two waves at one per SM).
template <int MinB>
__global__ void __launch_bounds__(kScanThreads, MinB) k2_tc(const MlstmBwdParams B, const K3Flags fl, float* ws,
                                                         const BwdWs L, const bool for_tc_k3, const bool bulk_in,
                                                         const bool units, const __grid_constant__ CUtensorMap dmap,
                                                         const bool no_r) {
  const MlstmParams& p = B.f;
  extern __shared__ float4 smem_raw[];
  ScanSmem& sm = *reinterpret_cast<ScanSmem*>(smem_raw);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, t4 = lane & 3;
  const int rg = warp & 3, cg = warp >> 2;  // row group (16 rows), column half (32 columns)
  const std::int64_t bh = blockIdx.x, b = bh / p.NH, hd = bh % p.NH;
  const int r0 = blockIdx.y * kT, c0 = blockIdx.z * kT, cw = c0 + 32 * cg;  // cw: this warp's first column
  const bool with_n = !for_tc_k3 && blockIdx.z == 0 && cg == 0;  // else dn_scan carries dn
  const std::int64_t tile = std::int64_t(blockIdx.y) * gridDim.z + blockIdx.z;
  const std::int64_t NC = L.NC, ns = L.ns, DQK = p.DQK, DV = p.DV, S = p.S, Lc = p.L;
  const int nr = int(lmin(kT, DQK - r0)), nc = int(lmin(kT, DV - c0));
  const bf16* qb = static_cast<const bf16*>(p.q.p) + b * p.q.s0 + hd * p.q.s1 + r0;
  const bf16* hb = static_cast<const bf16*>(B.dh.p) + b * B.dh.s0 + hd * B.dh.s1 + c0;
  const double* wA = reinterpret_cast<const double*>(ws + L.gates) + 2 * L.heads * S + bh * S;
  const float scale = rsqrtf(float(DQK));

  float acc[4][4], accn[4];  // dC rows r0 + 16 rg + gq (+8), columns cw + 8j + 2 t4 (+1); dn of the rows
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const std::int64_t r = r0 + 16 * rg + gq + (e >> 1) * 8, c = cw + 8 * j + 2 * t4 + (e & 1);
      acc[j][e] = B.dc_last.p && r < DQK && c < DV
                      ? mlstm_ld(B.dc_last, b * B.dc_last.s0 + hd * B.dc_last.s1 + r * B.dc_last.s2 + c)
                      : 0.f;
    }
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const std::int64_t r = r0 + 16 * rg + gq + (e >> 1) * 8;
    accn[e] = with_n && B.dn_last.p && r < DQK ? mlstm_ld(B.dn_last, b * B.dn_last.s0 + hd * B.dn_last.s1 + r) : 0.f;
  }
  const std::uint32_t ones = pack_bf16(1.f, 1.f);
  // dC's pieces by the TMA engine (WarpTileTma: the tensor-core path on sm_90 where the host encoded
  // dmap), else by store_hilo_row where the warp's 32 columns are in bounds (full)
#if defined(FW_HAS_BULK)
  const bool bulk = bulk_in;
#else
  constexpr bool bulk = false;
#endif
  const bool full = DV % 2 == 0 && cw + 32 <= DV;

  // <C_k, dC> + <n_k, dn> over this tile (n in the first column of tiles), fixed order
  // <C_k, dC> + <n_k, dn> over this tile (n in the first column of tiles), fixed order. C_k is read a
  // chunk ahead of its use (waiting on it took ~37% of the kernel's stall samples when it was loaded
  // where it is used): fp32 C_k, n_k into registers (load_c), or on the tensor-core path K0's bf16
  // hi / lo tile into shared memory with the chunk's q, dh (issue), coalesced.
  float cpf[2][4][2], npf[2];
  auto load_c = [&](std::int64_t k) {
    const float* Ck = ws + L.c + (bh * ns + k) * DQK * DV;
    const float* nk = ws + L.n + (bh * ns + k) * DQK;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const std::int64_t r = r0 + 16 * rg + gq + hr * 8;
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const std::int64_t c = cw + 8 * j + 2 * t4 + e;
          cpf[hr][j][e] = r < DQK && c < DV ? __ldg(Ck + r * DV + c) : 0.f;
        }
      npf[hr] = with_n && t4 == 0 && r < DQK ? __ldg(nk + r) : 0.f;
    }
  };
  // the cp.async units of the chunk's tiles fixed per CTA (ChunkUnits, as the states kernel)
  const TileUnits tu(kT, kScanThreads);
  const ChunkUnits qcu = units ? ChunkUnits(tu, kLd, p.q.s2) : ChunkUnits(),
                   hcu = units ? ChunkUnits(tu, kLd, B.dh.s2) : ChunkUnits(), ccu = units ? ChunkUnits(tu, kLd, DV) : ChunkUnits();
  auto issue_c = [&](std::int64_t k, int st) {  // K0's hi (DQK, DV) then lo in the slot: this tile of each
    const bf16* Ch = reinterpret_cast<const bf16*>(ws + L.c + (bh * ns + k) * DQK * DV) + r0 * DV + c0;
    load_chunk_tile(ccu, tu, &sm.ch[st][0][0], kLd, Ch, DV, nr, nc, DV % 8 == 0, kScanThreads);
    load_chunk_tile(ccu, tu, &sm.cl[st][0][0], kLd, Ch + DQK * DV, DV, nr, nc, DV % 8 == 0, kScanThreads);
  };
  auto inner = [&](int cst) {  // cst: the stage holding C_k (tensor-core path), else -1 (registers)
    float part = 0.f;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const std::int64_t r = r0 + 16 * rg + gq + hr * 8;
      if (r >= DQK) continue;
      if (cst >= 0 && full) {  // the warp's 32 columns in bounds: hi / lo as bf16 pairs, no column checks
        const int rl = 16 * rg + gq + hr * 8;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int cl = 32 * cg + 8 * j + 2 * t4;
          const float2 h = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&sm.ch[cst][rl][cl]));
          const float2 l = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&sm.cl[cst][rl][cl]));
          part = fmaf(h.x + l.x, acc[j][2 * hr], part);
          part = fmaf(h.y + l.y, acc[j][2 * hr + 1], part);
        }
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int cl = 32 * cg + 8 * j + 2 * t4 + e, rl = 16 * rg + gq + hr * 8;
            const float cv = cst < 0 ? cpf[hr][j][e]
                                     : __bfloat162float(sm.ch[cst][rl][cl]) + __bfloat162float(sm.cl[cst][rl][cl]);
            if (c0 + cl < DV) part = fmaf(cv, acc[j][2 * hr + e], part);
          }
      }
      if (with_n && t4 == 0) part = fmaf(npf[hr], accn[2 * hr], part);
    }
    return block_sum8(part, sm.red);
  };
  float R;  // the last state: <c_last, dc_last> + <n_last, dn_last>
  if (for_tc_k3) {
    issue_c(NC, 1);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    R = inner(1);
  } else {
    load_c(NC);
    R = inner(-1);
    if (NC > 0) load_c(NC - 1);
  }
  if (tid == 0) ws[L.R + (bh * ns + NC) * L.tiles + tile] = R;

  auto issue = [&](std::int64_t kc, int sb, int st) {  // q, dh rows and step scalars of chunk kc, steps sb*64..
    const std::int64_t t = kc * Lc + sb * kT, tend = lmin(S, (kc + 1) * Lc);
    const int nb = int(lmin(kT, tend - t));
    load_chunk_tile(qcu, tu, &sm.q[st][0][0], kLd, qb + t * p.q.s2, p.q.s2, nb, nr, fl.q, kScanThreads);
    load_chunk_tile(hcu, tu, &sm.dh[st][0][0], kLd, hb + t * B.dh.s2, B.dh.s2, nb, nc, fl.dh, kScanThreads);
    if (for_tc_k3 && sb == 0 && (!no_r || kc == 0)) issue_c(kc, st);  // no_r: K4's chain needs no C_k, k > 0
    if (tid < nb) {
      cp_async8(&sm.A[st][tid], wA + t + tid);
      cp_async4(&sm.inv[st][tid], ws + L.inv_den + bh * S + t + tid);
      cp_async4(&sm.db[st][tid], ws + L.db + bh * S + t + tid);
    }
    if (tid == kT) cp_async8(&sm.Aend[st], wA + tend - 1);
    if (tid == kT + 1) cp_async4(&sm.mk[st], ws + L.m + bh * ns + kc);
    cp_async_commit();
  };
  int st = 0;
  if (NC > 0) issue(NC - 1, 0, 0);
  for (std::int64_t kc = NC - 1; kc >= 0; --kc) {
    const int n = int(lmin(Lc, S - kc * Lc)), nsb = (n + kT - 1) / kT;
    // keep dC_{kc+1}, dn_{kc+1} for K3, and their inner product with the state entering chunk kc
#if defined(FW_HAS_BULK)
    if (bulk) {
      WarpTileTma::wait_read();
      WarpTileTma::stage<true>(sm.stage[warp], acc);
      WarpTileTma::store(&dmap, sm.stage[warp], cw, r0 + 16 * rg, int(bh * ns + kc + 1), r0 + 16 * rg < DQK);
    }
#endif
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const std::int64_t r = r0 + 16 * rg + gq + hr * 8;
      if (r >= DQK) continue;
      if (for_tc_k3) {  // bf16 hi (DQK, DV) then lo (DQK, DV) in the slot, as K3 kv-role loads them
        bf16* wh = reinterpret_cast<bf16*>(ws + L.dc + (bh * ns + kc + 1) * DQK * DV) + r * DV;
        bf16* wl = wh + DQK * DV;
        if (!bulk && full) {
          store_hilo_row<true>(wh + cw + 2 * t4, DQK * DV, acc, hr);
        } else if (!bulk) {
#pragma unroll
          for (int j = 0; j < 4; ++j) store_hilo_pair(wh, wl, cw + 8 * j + 2 * t4, DV, acc[j][2 * hr], acc[j][2 * hr + 1]);
        }
      } else {
        float* wd = ws + L.dc + ((bh * ns + kc + 1) * DQK + r) * DV;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const std::int64_t c = cw + 8 * j + 2 * t4;
          if (c < DV) wd[c] = acc[j][2 * hr];
          if (c + 1 < DV) wd[c + 1] = acc[j][2 * hr + 1];
        }
      }
      if (with_n && t4 == 0) ws[L.dn + (bh * ns + kc + 1) * DQK + r] = accn[2 * hr];
    }
    if (!for_tc_k3) {
      const float Rk = inner(-1);
      if (tid == 0) ws[L.R + (bh * ns + kc) * L.tiles + tile] = Rk;
      if (kc > 0) load_c(kc - 1);  // used next iteration: in flight during this chunk's products
    }
    double mk = 0.0;
    for (int sb = 0; sb < nsb; ++sb) {
      cp_async_wait<0>();
      __syncthreads();  // this tile is visible; every warp is done with the other stage
      if (for_tc_k3 && sb == 0) {  // acc is still dC_{kc+1} here
        // no_r: 0 for k > 0 (dn_scan adds its n part); R_0 in full, for dm0 = d_0 R_0 + ..., which the
        // chain's difference G_0 - Gp_0 would give only to G_0's absolute precision (no decay chain there)
        const float Rk = no_r && kc > 0 ? 0.f : inner(st);
        if (tid == 0) ws[L.R + (bh * ns + kc) * L.tiles + tile] = Rk;
      }
      if (sb + 1 < nsb) issue(kc, sb + 1, st ^ 1);
      else if (kc > 0) issue(kc - 1, 0, st ^ 1);
      if (sb == 0) {  // decay of dC_{k+1} into chunk k: exp(m_k - M_{n-1}) <= 1
        mk = double(sm.mk[st]);
        const float decay = float(exp(mk - fmax(mk, sm.Aend[st])));
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[j][e] *= decay;
#pragma unroll
        for (int e = 0; e < 4; ++e) accn[e] *= decay;
      }
      const int nb = min(kT, n - sb * kT);
      // The steps' factors, once per warp (two steps per lane) into its rows of fc / fn: every lane
      // of the fragments below needs four of them (its reads of the last tile's are behind the barrier).
      float *wc = sm.fc[warp], *wn = sm.fn[warp];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int sidx = lane + 32 * u;
        const float e = sidx < nb ? scale * __expf(float(mk - fmax(mk, sm.A[st][sidx]))) : 0.f;
        wc[sidx] = sidx < nb ? e * sm.inv[st][sidx] : 0.f;
        if (with_n) wn[sidx] = sidx < nb ? e * sm.db[st][sidx] : 0.f;
      }
      __syncwarp();
#pragma unroll
      for (int ks = 0; ks < kT / 16; ++ks) {
        const int s0 = ks * 16 + 2 * t4;  // this lane's steps: s0, s0 + 1, s0 + 8, s0 + 9
        const float2 c01 = *reinterpret_cast<const float2*>(wc + s0), c89 = *reinterpret_cast<const float2*>(wc + s0 + 8);
        std::uint32_t a[4], ah[4], al[4];
        ldsm_x4_t(a, &sm.q[st][ks * 16 + ld_row_a_kmajor(lane)][16 * rg + ld_col_a_kmajor(lane)]);
        scale_split(a, c01.x, c01.y, c89.x, c89.y, ah, al);
        mma_split_kstep(acc, ah, al, sm.dh[st], ks, 32 * cg, lane);
        if (with_n) {
          const float2 n01 = *reinterpret_cast<const float2*>(wn + s0), n89 = *reinterpret_cast<const float2*>(wn + s0 + 8);
          scale_split(a, n01.x, n01.y, n89.x, n89.y, ah, al);
          mma_bf16_16816(accn, ah, ones, ones);
          mma_bf16_16816(accn, al, ones, ones);
        }
      }
      st ^= 1;
    }
  }
#if defined(FW_HAS_BULK)
  if (bulk) WarpTileTma::drain();
#endif
  // dC_0, dn_0: the initial states' gradients
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const std::int64_t r = r0 + 16 * rg + gq + hr * 8;
    if (r >= DQK) continue;
    if (B.dc0.p)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const std::int64_t c = cw + 8 * j + 2 * t4 + e;
          if (c < DV) mlstm_st(B.dc0, b * B.dc0.s0 + hd * B.dc0.s1 + r * B.dc0.s2 + c, acc[j][2 * hr + e]);
        }
    if (B.dn0.p && with_n && t4 == 0) mlstm_st(B.dn0, b * B.dn0.s0 + hd * B.dn0.s1 + r, accn[2 * hr]);
  }
}

// ---- dn scan (after K3 q-role and K2, where K3 q-role forms the row statistics) -----------------------
// dn_k = d_k dn_{k+1} + p_k, d_k = exp(m_k - M_{n-1}) (K2's decay), p_k from k3q_tc; grid: heads, thread
// r owns dn[r]. Writes dn_{k+1} (k = 0..NC-1; slot NC = dn_last) for K3 kv-role and dn_0, and adds the
// n part of R, <n_k, dn_{k+1}> and <n_NC, dn_last>, to the tile-0 entry K2 wrote (fixed order). Chunks
// go in blocks of kDnBlock: their decays one per thread, p_k and n_k loaded ahead of the chain, the R
// parts reduced per warp inside the chain (off its dependency) and summed per chunk after the block.
// NT = 128 threads for DQK <= 128, 256 above.
constexpr int kDnBlock = 16;
template <int NT>
__device__ __forceinline__ float dn_parts(const float (&s_part)[NT / 32][kDnBlock], int u) {  // fixed order
  float x = (s_part[0][u] + s_part[1][u]) + (s_part[2][u] + s_part[3][u]);
  if constexpr (NT == 256) x = x + ((s_part[4][u] + s_part[5][u]) + (s_part[6][u] + s_part[7][u]));
  return x;
}
template <int NT>
__global__ void __launch_bounds__(NT) dn_scan(const MlstmBwdParams B, float* ws, const BwdWs L) {
  static_assert(NT == 128 || NT == 256);
  const MlstmParams& p = B.f;
  __shared__ float s_dec[kDnBlock];
  __shared__ float s_part[NT / 32][kDnBlock];
  const int r = threadIdx.x, warp = r >> 5, lane = r & 31;
  const std::int64_t bh = blockIdx.x, b = bh / p.NH, hd = bh % p.NH, NC = L.NC, ns = L.ns, DQK = p.DQK;
  const std::int64_t S = p.S, Lc = p.L;
  const double* wA = reinterpret_cast<const double*>(ws + L.gates) + 2 * L.heads * S + bh * S;
  float* dn = ws + L.dn + bh * ns * DQK;
  const float* pn = ws + L.pn + bh * NC * DQK;
  const float* nv = ws + L.n + bh * ns * DQK;
  float* R = ws + L.R + bh * ns * L.tiles;  // tile 0 of chunk k at R[k * tiles]
  const bool on = r < DQK;
  auto warp_sum = [&](float v) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
  };
  float x = on && B.dn_last.p ? mlstm_ld(B.dn_last, b * B.dn_last.s0 + hd * B.dn_last.s1 + r) : 0.f;
  if (on) dn[NC * DQK + r] = x;
  {
    const float part = warp_sum(on ? nv[NC * DQK + r] * x : 0.f);
    if (lane == 0) s_part[warp][0] = part;
    __syncthreads();
    if (r == 0) R[NC * L.tiles] += dn_parts<NT>(s_part, 0);
  }
  for (std::int64_t k1 = NC - 1; k1 >= 0; k1 -= kDnBlock) {  // chunks k1, k1 - 1, .. (down to 0)
    __syncthreads();  // s_dec, s_part of the previous block are read
    if (r < kDnBlock) {
      const std::int64_t kc = k1 - r;
      float d = 1.f;
      if (kc >= 0) {
        const double mk = double(ws[L.m + bh * ns + kc]), Aend = wA[lmin(S, (kc + 1) * Lc) - 1];
        d = float(exp(mk - fmax(mk, Aend)));
      }
      s_dec[r] = d;
    }
    float pk[kDnBlock], nk[kDnBlock];
#pragma unroll
    for (int u = 0; u < kDnBlock; ++u) {
      const std::int64_t kc = k1 - u;
      pk[u] = kc >= 0 && on ? pn[kc * DQK + r] : 0.f;
      nk[u] = kc >= 0 && on ? nv[kc * DQK + r] : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int u = 0; u < kDnBlock; ++u) {
      const std::int64_t kc = k1 - u;
      if (kc < 0) break;
      const float part = warp_sum(nk[u] * x);  // x is dn_{kc+1} here
      if (lane == 0) s_part[warp][u] = part;
      x = x * s_dec[u] + pk[u];
      if (kc > 0 && on) dn[kc * DQK + r] = x;
    }
    __syncthreads();
    if (r < kDnBlock && k1 - r >= 0)
      R[(k1 - r) * L.tiles] += dn_parts<NT>(s_part, r);
  }
  if (B.dn0.p && on) mlstm_st(B.dn0, b * B.dn0.s0 + hd * B.dn0.s1 + r, x);
}

std::atomic<bool> g_k3_fixed{true};  // set_mlstm_k3_fixed
std::atomic<bool> g_dv_lo{false};    // set_mlstm_dv_lo
std::atomic<bool> g_k3_full{true};   // set_mlstm_k3_full

// The chunks the K3 roles' full-chunk instances take: all but a short last one (none when off).
std::int64_t k3_full_chunks(const MlstmParams& p, const BwdWs& L) {
  if (!g_k3_full.load(std::memory_order_relaxed)) return 0;
  return p.S % kT == 0 ? L.NC : L.NC - 1;
}
std::atomic<bool> g_dv_parts{true};  // set_mlstm_k3_dv_parts
std::atomic<bool> g_dv_wide{true};   // set_mlstm_k3_dv_wide

// Whether both K3 roles take their fixed-dims instances (k3q_tc<NH, 128 | 256, 128>, k3kv_tc<..>):
// DQK 128 or 256, DV 128 or its 128-column parts (the launch's caller checked the parts apply).
bool k3_fixed_dims(const MlstmParams& p) {
  return g_k3_fixed.load(std::memory_order_relaxed) && (p.DQK == 128 || p.DQK == 256) && p.DV % kMaxD == 0 &&
         p.DV <= kMaxD * mlstm_k3_dv_parts_max(p.DQK);
}

}  // namespace

bool set_mlstm_k3_fixed(bool on) { return g_k3_fixed.exchange(on); }
bool set_mlstm_dv_lo(bool on) { return g_dv_lo.exchange(on); }
bool set_mlstm_k3_full(bool on) { return g_k3_full.exchange(on); }
bool set_mlstm_k3_dv_parts(bool on) { return g_dv_parts.exchange(on); }
bool set_mlstm_k3_dv_wide(bool on) { return g_dv_wide.exchange(on); }
int mlstm_k3_dv_parts_max(std::int64_t DQK) {
  if (!g_dv_parts.load(std::memory_order_relaxed)) return 1;
  return g_dv_wide.load(std::memory_order_relaxed) ? 4 : DQK <= kHalf ? 2 : 1;
}

bool mlstm_bwd_k3_tc_applies(const MlstmBwdParams& b) {
  const MlstmParams& p = b.f;
  return p.q.dtype == DType::bf16 && p.k.dtype == DType::bf16 && p.v.dtype == DType::bf16 &&
         b.dh.dtype == DType::bf16 && p.L == kT && p.DQK >= 1 && p.DQK <= kMaxDq && p.DV >= 1 &&
         p.DV <= kMaxD * mlstm_k3_dv_parts_max(p.DQK) &&
         // shared memory (dynamic + the roles' static ~2 KB) within the device's opt-in limit: DQK = 256
         // takes ~174 KB (Hopper: 227 KB; sm_80: 163 KB, which keeps DQK > 128 on the CUDA cores)
         std::max(K3Layout(p.DQK, std::min<std::int64_t>(p.DV, kMaxD), true).bytes,
                  K3Layout(p.DQK, std::min<std::int64_t>(p.DV, kMaxD), false).bytes) + 4096 <= smem_per_block_optin();
}

namespace {
// A K3 role over the problem's chunks: the full ones [0, k3_full_chunks) by `full` (the instance
// compiled for 64 rows), the rest (a short last chunk, or all of them with set_mlstm_k3_full off) by
// `rest`, each launch taking chunks kc0 + blockIdx.y.
using K3Kernel = void (*)(const MlstmBwdParams, const K3Flags, float*, const BwdWs, const int);
void launch_k3(K3Kernel full, K3Kernel rest, int threads, std::size_t smem, const MlstmBwdParams& B, const K3Flags& fl,
               float* ws, const BwdWs& L, Stream stream) {
  const std::int64_t nfull = k3_full_chunks(B.f, L);
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  for (int part = 0; part < 2; ++part) {
    const std::int64_t kc0 = part ? nfull : 0, nch = part ? L.NC - nfull : nfull;
    if (nch == 0) continue;
    const K3Kernel kernel = part ? rest : full;
    (void)resident_ctas_per_sm(reinterpret_cast<const void*>(kernel), threads, smem);
    kernel<<<dim3(unsigned(L.heads), unsigned(nch)), threads, smem, s>>>(B, fl, ws, L, int(kc0));
    FW_CUDA_CHECK_LAUNCH("mlstm_bwd");
  }
}
}  // namespace

void mlstm_bwd_k3q_tc(const MlstmBwdParams& B, float* ws, const BwdWs& L, Stream stream) {
  const MlstmParams& p = B.f;
  if (L.NC == 0 || L.heads == 0) return;
  const K3Flags fl{rows16(p.q), rows16(p.k), rows16(p.v), rows16(B.dh)};
  const K3Layout lq(p.DQK, std::min<std::int64_t>(p.DV, kMaxD), false);  // DV in parts of kMaxD above it
  using K = K3Kernel;
  const bool fixed = k3_fixed_dims(p);
  auto pick = [&](auto full) -> K {
    constexpr bool F = decltype(full)::value;
    if (fixed) return p.DQK == 128 ? &k3q_tc<1, 128, 128, F> : &k3q_tc<2, 256, 128, F>;
    return lq.Dq > kHalf ? &k3q_tc<2, 0, 0, F> : &k3q_tc<1, 0, 0, F>;
  };
  launch_k3(pick(std::true_type{}), pick(std::false_type{}), kThreads, lq.bytes, B, fl, ws, L, stream);
}

void mlstm_bwd_dn_scan(const MlstmBwdParams& B, float* ws, const BwdWs& L, Stream stream) {
  if (L.heads == 0) return;
  if (B.f.DQK <= 128)
    dn_scan<128><<<unsigned(L.heads), 128, 0, reinterpret_cast<cudaStream_t>(stream)>>>(B, ws, L);
  else
    dn_scan<256><<<unsigned(L.heads), 256, 0, reinterpret_cast<cudaStream_t>(stream)>>>(B, ws, L);
  FW_CUDA_CHECK_LAUNCH("mlstm_bwd");
}

void mlstm_bwd_k3kv_tc(const MlstmBwdParams& B, float* ws, const BwdWs& L, Stream stream) {
  const MlstmParams& p = B.f;
  if (L.NC == 0 || L.heads == 0) return;
  const K3Flags fl{rows16(p.q), rows16(p.k), rows16(p.v), rows16(B.dh), g_dv_lo.load(std::memory_order_relaxed)};
  const K3Layout lkv(p.DQK, std::min<std::int64_t>(p.DV, kMaxD), true);
  using K = K3Kernel;
  const bool fixed = k3_fixed_dims(p);
  auto pick = [&](auto full) -> K {
    constexpr bool F = decltype(full)::value;
    if (fixed) return p.DQK == 128 ? &k3kv_tc<128, 128, F> : &k3kv_tc<256, 128, F>;
    return &k3kv_tc<0, 0, F>;
  };
  launch_k3(pick(std::true_type{}), pick(std::false_type{}), kKvThreads, lkv.bytes, B, fl, ws, L, stream);
}

bool mlstm_bwd_k2_tc_applies(const MlstmBwdParams& b) {
  const MlstmParams& p = b.f;
  return mlstm_states_tc_applies(p) && b.dh.dtype == DType::bf16;  // the gate pass of K0 (tensor cores) ran
}

void mlstm_bwd_k2_tc(const MlstmBwdParams& B, float* ws, const BwdWs& L, bool for_tc_k3, Stream stream, bool no_r) {
  const MlstmParams& p = B.f;
  const std::int64_t kt = (p.DQK + kT - 1) / kT, vt = (p.DV + kT - 1) / kT;
  if (L.heads == 0) return;
  const K3Flags fl{rows16(p.q), false, false, rows16(B.dh)};
  const std::size_t smem = sizeof(ScanSmem);
  const bool two = L.heads * kt * vt > sm_count();  // more CTAs than SMs: two per SM, one wave
  const auto kernel = two ? &k2_tc<2> : &k2_tc<1>;
  (void)resident_ctas_per_sm(reinterpret_cast<const void*>(kernel), kScanThreads, smem);
  CUtensorMap dmap{};  // dC's slots (heads x (NC + 1)) of hi, lo (DQK, DV) bf16 for the TMA stores
  const bool bulk = for_tc_k3 && mlstm_bulk_store_on() && state_tile_map(&dmap, ws + L.dc, p.DV, p.DV, p.DQK, 2, L.heads * L.ns);
  kernel<<<dim3(unsigned(L.heads), unsigned(kt), unsigned(vt)), kScanThreads, smem,
           reinterpret_cast<cudaStream_t>(stream)>>>(B, fl, ws, L, for_tc_k3, bulk, mlstm_chunk_units_on(), dmap,
                                                      no_r && for_tc_k3);
  FW_CUDA_CHECK_LAUNCH("mlstm_bwd");
}

}  // namespace fastweight::detail
