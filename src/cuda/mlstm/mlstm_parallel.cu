// mlstm_parallel.cu: the parallel mLSTM (seed 000; MATH.md §2) on CUDA, FlashAttention-style: the
// S x S matrices (decay, scores, their gradients) exist only as 64 x 64 tiles in shared memory, never
// in global memory. fp32 compute for every IO dtype (fp32 in true fp32: no tensor cores; bf16 with
// DQK, DV <= 256 on tensor cores, fp32 accumulators: fwd_tc and the backward's rows_tc, dq_tc,
// dkdv_tc); any strides with contiguous rows; any S, DQK, DV (tails are zero-filled in the tiles).
//
// Notation (float64 where it is a difference of cumulative gates, |g| reaching 20 S):
//   g_t = lf_0 + ... + lf_t,  a_t = i_t - g_t,  A_t = max_{s <= t} a_s (and its first arg-max s*_t)
//   so D[t,s] - m_t = a_s - A_t <= 0, m_t = g_t + A_t, e_ts = exp(a_s - A_t)
//   C_ts = scale (q_t . k_s) e_ts (s <= t),  b_t = sum_s C_ts,  n_t = max(|b_t|, exp(-m_t))
//   h_t = sum_s C_ts v_s / (n_t + eps)
// Kernels:
//   gates  per head, serial over 256-step pieces: g, a, A, s* to the workspace.
//   fwd    per (head, 64-row block, 64-column DV tile), over the key blocks up to the diagonal:
//          C in smem, num += C v, b += C 1; h = num / (n + eps); n, m, b from DV tile 0.
//   fwd_tc the same for bf16 q, k, v, h (DQK <= 256) on tensor cores (mma.sync m16n8k16, fp32
//          accumulators): 4 warps of 16 rows, C kept in registers between q k^T and C v
//          (FlashAttention-2's fragment reuse), k, v and a_s of the next key block landing by
//          cp.async while this one is multiplied.
//   The exact backward (gradient conventions: src/reference/mlstm_ref.cpp), from the saved m, b, with
//   inv = 1 / (n_t + eps), dp_ts = dh_t . v_s, dC_ts = dp_ts inv_t + db_t (docs/design/mlstm_parallel.md):
//   dq     per (head, 64-row block, DQK tile), first: the row terms from sums over the recomputed
//          tiles (never the saved h, whose IO rounding swamps the normaliser's gradient):
//          d = dh_t . h_t = inv sum_s dp_ts C_ts, dn = -d inv, db = dn w_b sign(b) (w_b: the active
//          branch of n's max, halves on a tie), dmd = -dn (1 - w_b) exp(-m) formed as
//          (1 - w_b) d / (1 + eps exp(m)) (finite for every m), r_t = sum_{s != s*_t} dC_ts C_ts;
//          dq_t = scale (inv sum_s dp e k + db sum_s e k) (db is known after the sweep).
//   dkdv   per (head, 64-key block, output slab: a DV tile of dv or a DQK tile of dk), over the query
//          blocks from the diagonal on: dv_s += C_ts inv_t dh_t,  dk_s += scale dC_ts e_ts q_t,
//          csum_s = sum_{t: s*_t != s} dC_ts C_ts.
//   post   per head: dD[t, s] = dC_ts C_ts off the arg-max and, as every row of dD sums to dmd_t,
//          dD[t, s*_t] = dmd_t - r_t on it (never the difference of two O(1) halves: with strong
//          gates each row is one dominant term and the gate gradients are tiny). di_s = csum_s + the
//          sum of (dmd_t - r_t) over the rows t with s*_t = s (a run of rows: s* only moves forward),
//          d lf_j = sum_{t >= j} (dmd_t - di_t) for j >= 1 (d lf_0 = 0: lf_0 cancels in every D),
//          df = d lf sigmoid(-f).
// Head norm (seed 000), optional: out = headnorm(h) per (b, head, t) row of DV. Forward: a per-row
// pass (one warp per row) right after the tile kernel, which splits DV over CTAs. Backward: a per-row
// pass takes dout, recomputes the row's statistics from the saved h and forms dh = rstd (g - mean(g)
// - xhat mean(g xhat)), g = dout (weight_offset + weight), into the workspace (fp32), which dq and
// dkdv then read as their dh; dweight / dbias are column sums over (b, t) (fixed order).
// Deterministic: fixed loop and reduction orders, no atomics. No allocation, no host sync: graph safe.
#include <cfloat>
#include <climits>

#include "cuda/common/check.cuh"
#include "cuda/common/mma.cuh"
#include "cuda/mlstm/mlstm_common.cuh"
#include "cuda/mlstm/mlstm_cuda.h"
#include "cuda/mlstm/mlstm_tc.cuh"

namespace fastweight::detail {
namespace {

constexpr int kT = 64;         // tile edge: rows, steps, DQK / DV columns
constexpr int kThreads = 256;  // thread (tr, tc) = (tid / 16, tid % 16) owns tile rows 4tr..4tr+3, columns 4tc..4tc+3
constexpr int kPiece = 256;    // steps per piece of the per-head scans (= their threads)

__host__ __device__ constexpr std::int64_t imin(std::int64_t x, std::int64_t y) { return x < y ? x : y; }

// Workspace parts, each 256-byte aligned; n = B * NH * S positions.
//   fwd and bwd: g, a, A (f64 n each), s* (i32 n)
//   bwd also:    inv, db, r, dmd, csum (f32 n each); the post kernel reuses g for the prefix sums of
//                dmd - r and a for di (both free by then)
//   bwd with the head norm also: dh (f32 n * DV), mean, rstd (f32 n each)
struct ParWs {
  std::int64_t g = 0, a = 0, A = 0, arg = 0, inv = 0, db = 0, r = 0, dmd = 0, csum = 0;
  std::int64_t dh = 0, mean = 0, rstd = 0, total = 0;
  ParWs(const MlstmParams& p, bool bwd, bool norm) {
    const std::int64_t n = p.B * p.NH * p.S;
    std::int64_t o = 0;
    auto take = [&](std::int64_t bytes) {
      const std::int64_t at = o;
      o += (bytes + 255) / 256 * 256;
      return at;
    };
    g = take(8 * n), a = take(8 * n), A = take(8 * n), arg = take(4 * n);
    if (bwd) inv = take(4 * n), db = take(4 * n), r = take(4 * n), dmd = take(4 * n), csum = take(4 * n);
    if (bwd && norm) dh = take(4 * n * p.DV), mean = take(4 * n), rstd = take(4 * n);
    total = o;
  }
};

// ---- per-head scans ---------------------------------------------------------------------------------
// Inclusive prefix sum of x over the block's kPiece threads (Hillis-Steele: fixed order); buf[kPiece - 1]
// holds the total until the next call. Every thread calls it.
__device__ double block_scan_sum(double x, double* buf) {
  const int tid = threadIdx.x;
  __syncthreads();  // earlier readers of buf are done
  buf[tid] = x;
  __syncthreads();
  for (int d = 1; d < kPiece; d <<= 1) {
    const double add = tid >= d ? buf[tid - d] : 0.0;
    __syncthreads();
    buf[tid] += add;
    __syncthreads();
  }
  return buf[tid];
}

// Inclusive prefix max of (x, arg) with the first arg-max on ties (the earlier range wins).
__device__ void block_scan_max(double& x, int& arg, double* vbuf, int* abuf) {
  const int tid = threadIdx.x;
  __syncthreads();
  vbuf[tid] = x, abuf[tid] = arg;
  __syncthreads();
  for (int d = 1; d < kPiece; d <<= 1) {
    double ov = -INFINITY;
    int oa = 0;
    const bool has = tid >= d;
    if (has) ov = vbuf[tid - d], oa = abuf[tid - d];
    __syncthreads();
    if (has && ov >= vbuf[tid]) vbuf[tid] = ov, abuf[tid] = oa;
    __syncthreads();
  }
  x = vbuf[tid], arg = abuf[tid];
}

// 1 / (n + eps), finite also for eps = 0 and n underflowing to 0 (the reference's n is then tiny but
// positive, and h = 0 * (1 / n) must stay 0, not NaN).
__device__ __forceinline__ float norm_inv(float n, float eps) { return 1.f / fmaxf(n + eps, FLT_MIN); }

__device__ __forceinline__ double sigmoid_neg(double x) {  // sigmoid(-x) = d logsigmoid(x) / dx
  if (x >= 0) {
    const double e = exp(-x);
    return e / (1.0 + e);
  }
  return 1.0 / (1.0 + exp(x));
}

// One CTA per head: g, a, A and s* of every step.
__global__ void __launch_bounds__(kPiece) mlstm_par_gates_kernel(const MlstmParams p, double* __restrict__ wg,
                                                                 double* __restrict__ wa, double* __restrict__ wA,
                                                                 int* __restrict__ warg) {
  __shared__ double sv[kPiece];
  __shared__ int sa[kPiece];
  const std::int64_t bh = blockIdx.x, b = bh / p.NH, hd = bh % p.NH, go = bh * p.S;
  const int tid = threadIdx.x;
  double G = 0.0, Am = -INFINITY;  // carries: g and max a (first arg-max Aarg) before the piece
  int Aarg = 0;
  for (std::int64_t t0 = 0; t0 < p.S; t0 += kPiece) {
    const std::int64_t t = t0 + tid;
    const bool in = t < p.S;
    const double lf = in ? mlstm_logsigmoid(double(mlstm_ld(p.f, b * p.f.s0 + hd * p.f.s1 + t))) : 0.0;
    const double g = G + block_scan_sum(lf, sv);
    const double Gnext = G + sv[kPiece - 1];
    const double a = in ? double(mlstm_ld(p.i, b * p.i.s0 + hd * p.i.s1 + t)) - g : -INFINITY;
    double A = a;
    int arg = int(t);
    block_scan_max(A, arg, sv, sa);
    const double Aend = sv[kPiece - 1];
    const int argend = sa[kPiece - 1];
    if (!(A > Am)) A = Am, arg = Aarg;  // the carry is earlier: it wins ties
    if (in) wg[go + t] = g, wa[go + t] = a, wA[go + t] = A, warg[go + t] = arg;
    if (Aend > Am) Am = Aend, Aarg = argend;
    G = Gnext;
  }
}

// ---- tiles ----------------------------------------------------------------------------------------------
struct ParSmem {
  float r[kT][kT + 1];  // (64 tile rows, 64 columns) slab of the row operand (q; k or v for dkdv; q or dh for dq)
  float x[kT][kT + 1];  // (64 tile columns, 64 columns) slab of the column operand, then the output operand
  float c[kT][kT + 1];  // (64 x 64) coefficients of the output product, 0 where masked
  double a[kT];         // (64 steps s) a_s
  double A[kT];         // (64 rows t) A_t
  float inv[kT], db[kT];  // (64 rows t) 1 / (n_t + eps), db_t
  int arg[kT];            // (64 rows t) s*_t, the first arg-max of D[t, :]
};

// acc[i][j] (tile rows 4tr+i, tile columns 4tc+j) += sum over the 64-wide slabs of R (rows) . X (columns):
// rows [r0, r0 + nr) of R, rows [x0, x0 + nx) of X, both D columns; fills sm.r, sm.x.
__device__ __forceinline__ void tile_dot(float (&acc)[4][4], ParSmem& sm, const StridedView& R, std::int64_t ro,
                                         std::int64_t r0, int nr, const StridedView& X, std::int64_t xo,
                                         std::int64_t x0, int nx, std::int64_t D) {
  const int tid = threadIdx.x, tr = tid / 16, tc = tid % 16;
  for (std::int64_t rt = 0; rt < D; rt += kT) {
    __syncthreads();  // earlier readers of r, x are done
    for (int e = tid; e < kT * kT; e += kThreads) {
      const int r = e / kT, col = e % kT;
      const bool cin = rt + col < D;
      sm.r[r][col] = r < nr && cin ? mlstm_ld(R, ro + (r0 + r) * R.s2 + rt + col) : 0.f;
      sm.x[r][col] = r < nx && cin ? mlstm_ld(X, xo + (x0 + r) * X.s2 + rt + col) : 0.f;
    }
    __syncthreads();
    for (int k = 0; k < kT; ++k) {
      float rv[4], xv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) rv[i] = sm.r[4 * tr + i][k];
#pragma unroll
      for (int j = 0; j < 4; ++j) xv[j] = sm.x[4 * tc + j][k];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(rv[i], xv[j], acc[i][j]);
    }
  }
  __syncthreads();
}

// acc[i][j] += sum_k sm.c[4tr+i][k] * X[x0 + k][c0 + 4tc + j] (X rows [x0, x0 + nx), columns < D);
// TWO: also acc2 += sm.r X (a second coefficient tile in sm.r, the same X).
template <bool TWO = false>
__device__ __forceinline__ void tile_apply(float (&acc)[4][4], ParSmem& sm, const StridedView& X, std::int64_t xo,
                                           std::int64_t x0, int nx, std::int64_t c0, std::int64_t D,
                                           float (*acc2)[4] = nullptr) {
  const int tid = threadIdx.x, tr = tid / 16, tc = tid % 16;
  for (int e = tid; e < kT * kT; e += kThreads) {
    const int r = e / kT, col = e % kT;
    sm.x[r][col] = r < nx && c0 + col < D ? mlstm_ld(X, xo + (x0 + r) * X.s2 + c0 + col) : 0.f;
  }
  __syncthreads();
  for (int k = 0; k < kT; ++k) {
    float cv[4], xv[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) cv[i] = sm.c[4 * tr + i][k];
#pragma unroll
    for (int j = 0; j < 4; ++j) xv[j] = sm.x[k][4 * tc + j];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(cv[i], xv[j], acc[i][j]);
    if constexpr (TWO) {
#pragma unroll
      for (int i = 0; i < 4; ++i) cv[i] = sm.r[4 * tr + i][k];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc2[i][j] = fmaf(cv[i], xv[j], acc2[i][j]);
    }
  }
}

// The backward's per-row terms (workspace parts), for the tile kernels.
struct RowTerms {
  const double* A;
  const float *inv, *db;
  const int* arg;
};

// Loads A, inv, db, s* of the rows [t0, t0 + nt) (threads 0..63; visible after the next barrier).
__device__ __forceinline__ void load_row_terms(ParSmem& sm, std::int64_t go, std::int64_t t0, int nt,
                                               const RowTerms& rt) {
  const int tid = threadIdx.x;
  if (tid < kT) {
    const bool in = tid < nt;
    sm.A[tid] = in ? rt.A[go + t0 + tid] : 0.0;
    sm.inv[tid] = in ? rt.inv[go + t0 + tid] : 0.f;
    sm.db[tid] = in ? rt.db[go + t0 + tid] : 0.f;
    sm.arg[tid] = in ? rt.arg[go + t0 + tid] : -1;
  }
}

// ---- forward ------------------------------------------------------------------------------------------
// Grid (heads, row blocks (longest first), DV tiles).
__global__ void __launch_bounds__(kThreads) mlstm_par_fwd_kernel(const MlstmParallelParams P,
                                                                 const double* __restrict__ wg,
                                                                 const double* __restrict__ wa,
                                                                 const double* __restrict__ wA) {
  extern __shared__ float4 smem_raw[];
  ParSmem& sm = *reinterpret_cast<ParSmem*>(smem_raw);
  const MlstmParams& p = P.f;
  const int tid = threadIdx.x, tr = tid / 16, tc = tid % 16;
  const std::int64_t bh = blockIdx.x, b = bh / p.NH, hd = bh % p.NH;
  const std::int64_t S = p.S, DQK = p.DQK, DV = p.DV, go = bh * S;
  const int rb = int(gridDim.y - 1 - blockIdx.y);
  const std::int64_t row0 = std::int64_t(rb) * kT, c0 = std::int64_t(blockIdx.z) * kT;
  const int nrow = int(imin(kT, S - row0));
  const float scale = rsqrtf(float(DQK));
  const std::int64_t qo = b * p.q.s0 + hd * p.q.s1, ko = b * p.k.s0 + hd * p.k.s1, vo = b * p.v.s0 + hd * p.v.s1;
  if (tid < kT) sm.A[tid] = tid < nrow ? wA[go + row0 + tid] : 0.0;

  float num[4][4] = {}, rs[4] = {};  // rows 4tr+i: numerator (DV columns c0+4tc+j), b over this thread's columns
  for (int sb = 0; sb <= rb; ++sb) {
    const std::int64_t s0 = std::int64_t(sb) * kT;
    const int ns = int(imin(kT, S - s0));
    // no barrier here: the previous block read these row/step terms before tile_apply's barrier, and
    // tile_dot starts with one before it overwrites the tiles
    if (tid < kT) sm.a[tid] = tid < ns ? wa[go + s0 + tid] : 0.0;
    float sc[4][4] = {};  // (rows, steps): q_t . k_s
    tile_dot(sc, sm, p.q, qo, row0, nrow, p.k, ko, s0, ns, DQK);
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int tl = 4 * tr + i, sl = 4 * tc + j;
        const bool on = tl < nrow && sl < ns && s0 + sl <= row0 + tl;
        const float C = on ? scale * sc[i][j] * expf(float(sm.a[sl] - sm.A[tl])) : 0.f;
        rs[i] += C;
        sm.c[tl][sl] = C;
      }
    tile_apply(num, sm, p.v, vo, s0, ns, c0, DV);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)  // b: the 16 threads of a row are lanes of one half-warp (fixed xor tree)
#pragma unroll
    for (int o = 8; o; o >>= 1) rs[i] += __shfl_xor_sync(0xffffffffu, rs[i], o);

  const std::int64_t ho = b * p.h.s0 + hd * p.h.s1;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int tl = 4 * tr + i;
    if (tl >= nrow) continue;
    const std::int64_t t = row0 + tl;
    const float mf = float(wg[go + t] + sm.A[tl]);  // m_t = g_t + A_t
    const float em = expf(-mf), n = fmaxf(fabsf(rs[i]), em), inv = norm_inv(n, p.eps);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const std::int64_t c = c0 + 4 * tc + j;
      if (c < DV) mlstm_st(p.h, ho + t * p.h.s2 + c, num[i][j] * inv);
    }
    if (blockIdx.z == 0 && tc == 0) {
      if (P.n.p) mlstm_st(P.n, b * P.n.s0 + hd * P.n.s1 + t, n);
      if (P.m.p) mlstm_st(P.m, b * P.m.s0 + hd * P.m.s1 + t, mf);
      if (P.b.p) mlstm_st(P.b, b * P.b.s0 + hd * P.b.s1 + t, rs[i]);
    }
  }
}

// ---- forward on tensor cores ---------------------------------------------------------------------------
struct TcFlags {
  bool q, k, v, h2;  // q/k/v: 16-byte rows (cp.async); h2: bf16 pairs may be stored as 32-bit words
};

// Dynamic smem, DQKp = DQK rounded up to 16, ldq = DQKp + 8 (bf16; ldmatrix conflict-free):
//   f64 a[2][64] | f64 A[64] | bf16 q[64][ldq] | k[2][64][ldq] | v[2][64][kLd]
struct TcLayout {
  int DQKp, ldq;
  std::size_t a, A, q, k, v, bytes;
  __host__ __device__ explicit TcLayout(std::int64_t DQK) {
    DQKp = int(mtc::round_up(DQK, 16)), ldq = DQKp + 8;
    a = 0, A = a + 8 * 2 * kT, q = A + 8 * kT;
    k = q + 2 * std::size_t(kT) * ldq;
    v = k + 2 * 2 * std::size_t(kT) * ldq;
    bytes = v + 2 * 2 * std::size_t(kT) * mtc::kLd;
  }
};

// Grid (heads, row blocks (longest first), DV tiles); 128 threads, warp w owns block rows 16w..16w+15.
__global__ void __launch_bounds__(mtc::kTcThreads) mlstm_par_fwd_tc_kernel(const MlstmParallelParams P,
                                                                            const TcFlags fl,
                                                                            const double* __restrict__ wg,
                                                                            const double* __restrict__ wa,
                                                                            const double* __restrict__ wA) {
  using mtc::bf16;
  using mtc::kLd;
  extern __shared__ float4 smem_raw[];
  char* base = reinterpret_cast<char*>(smem_raw);
  const MlstmParams& p = P.f;
  const TcLayout lay(p.DQK);
  double* s_a = reinterpret_cast<double*>(base + lay.a);  // (2 stages, 64 steps) a_s
  double* s_A = reinterpret_cast<double*>(base + lay.A);  // (64 block rows) A_t
  bf16* sq = reinterpret_cast<bf16*>(base + lay.q);       // (64 rows t, DQKp) q
  bf16* sk = reinterpret_cast<bf16*>(base + lay.k);       // (2 stages, 64 steps s, DQKp) k
  bf16* sv = reinterpret_cast<bf16*>(base + lay.v);       // (2 stages, 64 steps s, 64 DV columns) v
  const int ldq = lay.ldq, DQKp = lay.DQKp;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, t4 = lane & 3;
  const std::int64_t bh = blockIdx.x, b = bh / p.NH, hd = bh % p.NH;
  const std::int64_t S = p.S, DQK = p.DQK, DV = p.DV, go = bh * S;
  const int rb = int(gridDim.y - 1 - blockIdx.y);
  const std::int64_t row0 = std::int64_t(rb) * kT;
  const int c0 = int(blockIdx.z) * kT;
  const int nrow = int(imin(kT, S - row0)), nc = int(imin(kT, DV - c0));

  const bf16* qb = static_cast<const bf16*>(p.q.p) + b * p.q.s0 + hd * p.q.s1;
  const bf16* kb = static_cast<const bf16*>(p.k.p) + b * p.k.s0 + hd * p.k.s1;
  const bf16* vb = static_cast<const bf16*>(p.v.p) + b * p.v.s0 + hd * p.v.s1 + c0;
  mtc::load_tile(sq, ldq, kT, DQKp, qb + row0 * p.q.s2, p.q.s2, nrow, int(DQK), fl.q);
  auto issue = [&](int sb) {  // key block sb into stage sb % 2 (one commit group with anything pending)
    const int st = sb & 1;
    const std::int64_t s0 = std::int64_t(sb) * kT;
    const int ns = int(imin(kT, S - s0));
    mtc::load_tile(sk + st * kT * ldq, ldq, kT, DQKp, kb + s0 * p.k.s2, p.k.s2, ns, int(DQK), fl.k);
    mtc::load_tile(sv + st * kT * kLd, kLd, kT, kT, vb + s0 * p.v.s2, p.v.s2, ns, nc, fl.v);
    if (tid < kT) {
      if (tid < ns) cp_async8(s_a + st * kT + tid, wa + go + s0 + tid);
      else s_a[st * kT + tid] = 0.0;
    }
    cp_async_commit();
  };
  issue(0);
  if (tid < kT) s_A[tid] = tid < nrow ? wA[go + row0 + tid] : 0.0;

  const float scale = rsqrtf(float(DQK));
  const int tlA = 16 * warp + gq, tlB = tlA + 8;  // this thread's two block rows
  float acc[8][4] = {};  // (16 rows of the warp, 64 DV columns) numerator
  float rsA = 0.f, rsB = 0.f;
  for (int sb = 0; sb <= rb; ++sb) {
    cp_async_wait<0>();
    __syncthreads();  // stage sb landed for all; everyone is done with stage (sb + 1) % 2
    if (sb < rb) issue(sb + 1);
    const int st = sb & 1;
    const std::int64_t s0 = std::int64_t(sb) * kT;
    const bf16* kt = sk + st * kT * ldq;
    const bf16* vt = sv + st * kT * kLd;
    const double* at = s_a + st * kT;
    float sacc[8][4] = {};  // (16 rows, 64 steps) q k^T
    mtc::mma_rn(sacc, sq, ldq, warp, kt, ldq, DQKp, lane);
    // C = scale (q k^T) exp(a_s - A_t) on s <= t; to bf16 A fragments (register reuse)
    std::uint32_t pa[4][4];
    const double AA = s_A[tlA], AB = s_A[tlB];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float pv[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int tl = e < 2 ? tlA : tlB, sl = 8 * j + 2 * t4 + (e & 1);
        const bool on = tl < nrow && s0 + sl <= row0 + tl;  // s <= t < S
        pv[e] = on ? scale * sacc[j][e] * __expf(float(at[sl] - (e < 2 ? AA : AB))) : 0.f;
      }
      rsA += pv[0] + pv[1], rsB += pv[2] + pv[3];
      mtc::pack_a_frags(pa, j, pv);
    }
    mtc::mma_frags_k(acc, pa, vt, kLd, 0, lane);
  }
  // the four lanes of a row hold its sum b in parts (fixed xor tree: every lane the same bits)
  rsA += __shfl_xor_sync(0xffffffffu, rsA, 1), rsB += __shfl_xor_sync(0xffffffffu, rsB, 1);
  rsA += __shfl_xor_sync(0xffffffffu, rsA, 2), rsB += __shfl_xor_sync(0xffffffffu, rsB, 2);

#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int tl = hr ? tlB : tlA;
    if (tl >= nrow) continue;
    const std::int64_t t = row0 + tl;
    const float bt = hr ? rsB : rsA;
    const float mf = float(wg[go + t] + s_A[tl]);  // m_t = g_t + A_t
    const float em = expf(-mf), n = fmaxf(fabsf(bt), em), inv = norm_inv(n, p.eps);
    bf16* hrow = static_cast<bf16*>(p.h.p) + b * p.h.s0 + hd * p.h.s1 + t * p.h.s2;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int c = c0 + 8 * j + 2 * t4;
      const float x0 = acc[j][2 * hr] * inv, x1 = acc[j][2 * hr + 1] * inv;
      if (fl.h2 && c + 1 < DV) {
        *reinterpret_cast<std::uint32_t*>(hrow + c) = pack_bf16(x0, x1);
      } else {
        if (c < DV) hrow[c] = __float2bfloat16_rn(x0);
        if (c + 1 < DV) hrow[c + 1] = __float2bfloat16_rn(x1);
      }
    }
    if (blockIdx.z == 0 && t4 == 0) {
      if (P.n.p) mlstm_st(P.n, b * P.n.s0 + hd * P.n.s1 + t, n);
      if (P.m.p) mlstm_st(P.m, b * P.m.s0 + hd * P.m.s1 + t, mf);
      if (P.b.p) mlstm_st(P.b, b * P.b.s0 + hd * P.b.s1 + t, bt);
    }
  }
}

bool par_fwd_tc_applies(const MlstmParams& p) {
  return p.q.dtype == DType::bf16 && p.k.dtype == DType::bf16 && p.v.dtype == DType::bf16 &&
         p.h.dtype == DType::bf16 && p.DQK <= 256;
}

// ---- backward -----------------------------------------------------------------------------------------
// ---- head norm -----------------------------------------------------------------------------------------
// Row statistics of x (DV values at xo of view X) over the warp: two passes (mean, then the population
// variance about it), fixed xor trees, every lane gets the same bits.
__device__ __forceinline__ void warp_row_stats(const StridedView& X, std::int64_t xo, std::int64_t DV, float eps,
                                               float& mean, float& rstd) {
  const int lane = threadIdx.x & 31;
  float s = 0.f;
  for (std::int64_t c = lane; c < DV; c += 32) s += mlstm_ld(X, xo + c);
#pragma unroll
  for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  mean = s / float(DV);
  float v = 0.f;
  for (std::int64_t c = lane; c < DV; c += 32) {
    const float d = mlstm_ld(X, xo + c) - mean;
    v = fmaf(d, d, v);
  }
#pragma unroll
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  rstd = 1.f / sqrtf(v / float(DV) + eps);
}

__device__ __forceinline__ float norm_scale(const MlstmParallelParams& P, std::int64_t hd, std::int64_t c) {
  return P.nw.p ? P.weight_offset + mlstm_ld(P.nw, hd * P.nw.s0 + c) : 1.f;
}

// Grid (heads, ceil(S / 8)); one warp per row: out = (h - mean) rstd scale + bias.
__global__ void __launch_bounds__(kThreads) mlstm_par_norm_fwd_kernel(const MlstmParallelParams P) {
  const MlstmParams& p = P.f;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const std::int64_t bh = blockIdx.x, b = bh / p.NH, hd = bh % p.NH;
  const std::int64_t t = std::int64_t(blockIdx.y) * (kThreads / 32) + warp;
  if (t >= p.S) return;  // warp-uniform
  const std::int64_t oh = b * p.h.s0 + hd * p.h.s1 + t * p.h.s2, oo = b * P.out.s0 + hd * P.out.s1 + t * P.out.s2;
  float mean, rstd;
  warp_row_stats(p.h, oh, p.DV, P.norm_eps, mean, rstd);
  for (std::int64_t c = lane; c < p.DV; c += 32) {
    float y = (mlstm_ld(p.h, oh + c) - mean) * rstd * norm_scale(P, hd, c);
    if (P.nb.p) y += mlstm_ld(P.nb, hd * P.nb.s0 + c);
    mlstm_st(P.out, oo + c, y);
  }
  if (lane == 0) {
    if (P.nmean.p) mlstm_st(P.nmean, b * P.nmean.s0 + hd * P.nmean.s1 + t, mean);
    if (P.nrstd.p) mlstm_st(P.nrstd, b * P.nrstd.s0 + hd * P.nrstd.s1 + t, rstd);
  }
}

// Grid (NH, ceil(DV / 32)); lane = column, warp w sums the rows w, w + 8, ... of the head's B * S rows
// in order, then warp 0 adds the 8 partials in order: dweight = sum dout xhat, dbias = sum dout.
__global__ void __launch_bounds__(kThreads) mlstm_par_norm_dw_kernel(const MlstmParallelParams P,
                                                                     const float* __restrict__ wmean,
                                                                     const float* __restrict__ wrstd) {
  __shared__ float sw[kThreads / 32][32], sb[kThreads / 32][32];
  const MlstmParams& p = P.f;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const std::int64_t hd = blockIdx.x, c = std::int64_t(blockIdx.y) * 32 + lane, rows = p.B * p.S;
  float dw = 0.f, db = 0.f;
  if (c < p.DV)
    for (std::int64_t r = warp; r < rows; r += kThreads / 32) {
      const std::int64_t b = r / p.S, t = r % p.S, row = (b * p.NH + hd) * p.S + t;
      const float dy = mlstm_ld(P.dout, b * P.dout.s0 + hd * P.dout.s1 + t * P.dout.s2 + c);
      const float xhat = (mlstm_ld(p.h, b * p.h.s0 + hd * p.h.s1 + t * p.h.s2 + c) - wmean[row]) * wrstd[row];
      dw = fmaf(dy, xhat, dw);
      db += dy;
    }
  sw[warp][lane] = dw, sb[warp][lane] = db;
  __syncthreads();
  if (warp != 0 || c >= p.DV) return;
  for (int w = 1; w < kThreads / 32; ++w) dw += sw[w][lane], db += sb[w][lane];
  if (P.dnw.p) mlstm_st(P.dnw, hd * P.dnw.s0 + c, dw);
  if (P.dnb.p) mlstm_st(P.dnb, hd * P.dnb.s0 + c, db);
}

// ---- backward ------------------------------------------------------------------------------------------
// Head norm only. Grid (heads, ceil(S / 8)); one warp per row: dh from dout through the head norm, into
// wdh (row-major (B * NH * S, DV): fp32, bf16 for the tensor-core backward; element o * DV + c from
// wdh.p), with the row's mean / rstd into wmean / wrstd.
__global__ void __launch_bounds__(kThreads) mlstm_par_norm_bwd_kernel(const MlstmParallelParams P,
                                                                      const StridedView wdh,
                                                                      float* __restrict__ wmean,
                                                                      float* __restrict__ wrstd) {
  const MlstmParams& p = P.f;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const std::int64_t bh = blockIdx.x, b = bh / p.NH, hd = bh % p.NH;
  const std::int64_t t = std::int64_t(blockIdx.y) * (kThreads / 32) + warp;
  if (t >= p.S) return;  // warp-uniform
  const std::int64_t oh = b * p.h.s0 + hd * p.h.s1 + t * p.h.s2, o = bh * p.S + t;
  float mean, rstd;
  warp_row_stats(p.h, oh, p.DV, P.norm_eps, mean, rstd);
  const std::int64_t od = b * P.dout.s0 + hd * P.dout.s1 + t * P.dout.s2;
  float sg = 0.f, sgx = 0.f;
  for (std::int64_t c = lane; c < p.DV; c += 32) {
    const float xhat = (mlstm_ld(p.h, oh + c) - mean) * rstd, g = mlstm_ld(P.dout, od + c) * norm_scale(P, hd, c);
    sg += g;
    sgx = fmaf(g, xhat, sgx);
  }
#pragma unroll
  for (int k = 16; k; k >>= 1) sg += __shfl_xor_sync(0xffffffffu, sg, k), sgx += __shfl_xor_sync(0xffffffffu, sgx, k);
  const float mg = sg / float(p.DV), mgx = sgx / float(p.DV);
  for (std::int64_t c = lane; c < p.DV; c += 32) {
    const float xhat = (mlstm_ld(p.h, oh + c) - mean) * rstd;
    mlstm_st(wdh, o * p.DV + c, rstd * (mlstm_ld(P.dout, od + c) * norm_scale(P, hd, c) - mg - xhat * mgx));
  }
  if (lane == 0) wmean[o] = mean, wrstd[o] = rstd;
}

// Grid (heads, key blocks, DV tiles + DQK tiles): slab o < vt computes dv's DV tile o, else dk's DQK
// tile o - vt; slab 0 also writes csum (the arg-max entries left out).
__global__ void __launch_bounds__(kThreads) mlstm_par_dkdv_kernel(const MlstmParallelParams P,
                                                                  const double* __restrict__ wa, const RowTerms rt,
                                                                  float* __restrict__ wcsum) {
  extern __shared__ float4 smem_raw[];
  ParSmem& sm = *reinterpret_cast<ParSmem*>(smem_raw);
  const MlstmParams& p = P.f;
  const int tid = threadIdx.x, tr = tid / 16, tc = tid % 16;
  const std::int64_t bh = blockIdx.x, b = bh / p.NH, hd = bh % p.NH;
  const std::int64_t S = p.S, DQK = p.DQK, DV = p.DV, go = bh * S;
  const int kb = int(blockIdx.y), nqb = int(gridDim.y);
  const std::int64_t s0 = std::int64_t(kb) * kT, vt = (DV + kT - 1) / kT;
  const bool dv_slab = blockIdx.z < vt;
  const std::int64_t c0 = (dv_slab ? std::int64_t(blockIdx.z) : std::int64_t(blockIdx.z) - vt) * kT;
  const int nk = int(imin(kT, S - s0));
  const float scale = rsqrtf(float(DQK));
  const std::int64_t qo = b * p.q.s0 + hd * p.q.s1, ko = b * p.k.s0 + hd * p.k.s1, vo = b * p.v.s0 + hd * p.v.s1,
                     dho = b * P.dh.s0 + hd * P.dh.s1;
  if (tid < kT) sm.a[tid] = tid < nk ? wa[go + s0 + tid] : 0.0;

  float acc[4][4] = {}, cs[4] = {};  // keys 4tr+i: the output slab (columns 4tc+j) and csum parts
  for (int qb = kb; qb < nqb; ++qb) {
    const std::int64_t t0 = std::int64_t(qb) * kT;
    const int nt = int(imin(kT, S - t0));
    // no barrier here: the previous block read these row/step terms before tile_apply's barrier, and
    // tile_dot starts with one before it overwrites the tiles
    load_row_terms(sm, go, t0, nt, rt);
    float sc[4][4] = {}, dp[4][4] = {};  // (keys, queries): k_s . q_t and v_s . dh_t
    tile_dot(sc, sm, p.k, ko, s0, nk, p.q, qo, t0, nt, DQK);
    tile_dot(dp, sm, p.v, vo, s0, nk, P.dh, dho, t0, nt, DV);
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int sl = 4 * tr + i, tl = 4 * tc + j;
        const bool on = sl < nk && tl < nt && s0 + sl <= t0 + tl;
        float coef = 0.f;
        if (on) {
          const float e = expf(float(sm.a[sl] - sm.A[tl]));
          const float C = scale * sc[i][j] * e, dC = fmaf(dp[i][j], sm.inv[tl], sm.db[tl]);
          if (sm.arg[tl] != s0 + sl) cs[i] = fmaf(dC, C, cs[i]);  // the arg-max entry: post (dmd - r)
          coef = dv_slab ? C * sm.inv[tl] : scale * dC * e;
        }
        sm.c[sl][tl] = coef;
      }
    tile_apply(acc, sm, dv_slab ? P.dh : p.q, dv_slab ? dho : qo, t0, nt, c0, dv_slab ? DV : DQK);
  }

  const StridedView& out = dv_slab ? P.dv : P.dk;
  const std::int64_t D = dv_slab ? DV : DQK;
  if (out.p) {
    const std::int64_t oo = b * out.s0 + hd * out.s1;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int sl = 4 * tr + i;
      if (sl >= nk) continue;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const std::int64_t c = c0 + 4 * tc + j;
        if (c < D) mlstm_st(out, oo + (s0 + sl) * out.s2 + c, acc[i][j]);
      }
    }
  }
  if (blockIdx.z == 0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // the 16 threads of a key row are lanes of one half-warp: fixed xor tree
      float v = cs[i];
#pragma unroll
      for (int o = 8; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (tc == 0 && 4 * tr + i < nk) wcsum[go + s0 + 4 * tr + i] = v;
    }
  }
}

// Grid (heads, row blocks (longest first), DQK tiles); launched with one DQK tile when dq is not asked
// for. Besides dq, the row terms, from sums over the recomputed tiles (fp32, never the saved h, whose
// IO-dtype rounding would swamp the normaliser's gradient where one term dominates a row):
//   d = dh_t . h_t = inv sum_s (dh_t . v_s) C_ts,  dn = -d inv,  db = dn w_b sign(b),
//   dmd = (1 - w_b) d / (1 + eps exp(m)),  r = sum_{s != s*} dC_ts C_ts = inv sum' dp C + db sum' C,
//   dq = scale (inv sum_s dp_ts e_ts k_s + db sum_s e_ts k_s)   (two accumulators: db is known last).
// DQK tile 0 writes inv, db, dmd, r for dkdv and post.
__global__ void __launch_bounds__(kThreads) mlstm_par_dq_kernel(const MlstmParallelParams P,
                                                                const double* __restrict__ wa,
                                                                const double* __restrict__ wA,
                                                                const int* __restrict__ warg, float* __restrict__ winv,
                                                                float* __restrict__ wdb, float* __restrict__ wdmd,
                                                                float* __restrict__ wr) {
  extern __shared__ float4 smem_raw[];
  ParSmem& sm = *reinterpret_cast<ParSmem*>(smem_raw);
  const MlstmParams& p = P.f;
  const int tid = threadIdx.x, tr = tid / 16, tc = tid % 16;
  const std::int64_t bh = blockIdx.x, b = bh / p.NH, hd = bh % p.NH;
  const std::int64_t S = p.S, DQK = p.DQK, DV = p.DV, go = bh * S;
  const int rb = int(gridDim.y - 1 - blockIdx.y);
  const std::int64_t t0 = std::int64_t(rb) * kT, c0 = std::int64_t(blockIdx.z) * kT;
  const int nt = int(imin(kT, S - t0));
  const float scale = rsqrtf(float(DQK));
  const std::int64_t qo = b * p.q.s0 + hd * p.q.s1, ko = b * p.k.s0 + hd * p.k.s1, vo = b * p.v.s0 + hd * p.v.s1,
                     dho = b * P.dh.s0 + hd * P.dh.s1;
  if (tid < kT) {
    sm.A[tid] = tid < nt ? wA[go + t0 + tid] : 0.0;
    sm.arg[tid] = tid < nt ? warg[go + t0 + tid] : -1;
  }

  // rows 4tr+i: acc (scale dp e k) and acc2 (scale e k) over DQK columns c0+4tc+j; sums over this
  // thread's steps of dp C (all), dp C and C (off the arg-max)
  float acc[4][4] = {}, acc2[4][4] = {}, sdc[4] = {}, rdp[4] = {}, rcs[4] = {};
  for (int sb = 0; sb <= rb; ++sb) {
    const std::int64_t s0 = std::int64_t(sb) * kT;
    const int ns = int(imin(kT, S - s0));
    // no barrier here: the previous block read these row/step terms before tile_apply's barrier, and
    // tile_dot starts with one before it overwrites the tiles
    if (tid < kT) sm.a[tid] = tid < ns ? wa[go + s0 + tid] : 0.0;
    float sc[4][4] = {}, dp[4][4] = {};  // (rows, steps): q_t . k_s and dh_t . v_s
    tile_dot(sc, sm, p.q, qo, t0, nt, p.k, ko, s0, ns, DQK);
    tile_dot(dp, sm, P.dh, dho, t0, nt, p.v, vo, s0, ns, DV);
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int tl = 4 * tr + i, sl = 4 * tc + j;
        const bool on = tl < nt && sl < ns && s0 + sl <= t0 + tl;
        float c1 = 0.f, c2 = 0.f;
        if (on) {
          const float e = expf(float(sm.a[sl] - sm.A[tl])), C = scale * sc[i][j] * e, x = dp[i][j] * C;
          sdc[i] += x;
          if (sm.arg[tl] != s0 + sl) rdp[i] += x, rcs[i] += C;
          c1 = scale * dp[i][j] * e, c2 = scale * e;
        }
        sm.c[tl][sl] = c1, sm.r[tl][sl] = c2;
      }
    tile_apply<true>(acc, sm, p.k, ko, s0, ns, c0, DQK, acc2);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)  // the 16 threads of a row are lanes of one half-warp: fixed xor trees
#pragma unroll
    for (int o = 8; o; o >>= 1) {
      sdc[i] += __shfl_xor_sync(0xffffffffu, sdc[i], o);
      rdp[i] += __shfl_xor_sync(0xffffffffu, rdp[i], o);
      rcs[i] += __shfl_xor_sync(0xffffffffu, rcs[i], o);
    }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int tl = 4 * tr + i;
    if (tl >= nt) continue;
    const std::int64_t t = t0 + tl;
    const float m = mlstm_ld(P.m, b * P.m.s0 + hd * P.m.s1 + t), bb = mlstm_ld(P.b, b * P.b.s0 + hd * P.b.s1 + t);
    const float em = expf(-m), ab = fabsf(bb), inv = norm_inv(fmaxf(ab, em), p.eps);  // the forward's n, from b, m
    const float d = inv * sdc[i], dn = -d * inv;
    const float wb = ab > em ? 1.f : (ab < em ? 0.f : 0.5f);  // torch.maximum splits a tie in halves
    const float sg = bb > 0.f ? 1.f : (bb < 0.f ? -1.f : 0.f);
    const float db = dn * wb * sg;
    if (blockIdx.z == 0 && tc == 0) {
      // dmd = -dn (1 - w_b) exp(-m); where w_b < 1, n = exp(-m) and exp(-m) inv = 1 / (1 + eps exp(m)):
      // no inf * 0 when exp(-m) overflows (m < -88)
      const float eem = p.eps > 0.f ? p.eps * expf(m) : 0.f;  // eps = 0: no 0 * inf for m > 88
      winv[go + t] = inv, wdb[go + t] = db, wdmd[go + t] = (1.f - wb) * d / (1.f + eem);
      wr[go + t] = fmaf(inv, rdp[i], db * rcs[i]);
    }
    if (!P.dq.p) continue;
    const std::int64_t row = b * P.dq.s0 + hd * P.dq.s1 + t * P.dq.s2;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const std::int64_t c = c0 + 4 * tc + j;
      if (c < DQK) mlstm_st(P.dq, row + c, fmaf(inv, acc[i][j], db * acc2[i][j]));
    }
  }
}

// ---- backward on tensor cores ------------------------------------------------------------------------
// bf16 q, k, v and dh (DQK, DV <= 256, the tiles inside the opt-in shared memory), mma.sync m16n8k16
// with fp32 accumulators; three kernels in place of dq and dkdv (gates and post are shared):
//   rows_tc  per (head, 64-row block): S = q k^T, dP = dh v^T over the key blocks -> the row terms
//            inv, db, dmd, r, as the SIMT dq kernel forms them.
//   dq_tc    per (head, 64-row block, 64-column DQK slab): dP again, dS = scale (dP inv + db) e in
//            fp32 with db already known (where the two halves cancel, they cancel before any bf16
//            rounding), packed into bf16 A fragments in registers: dq slab += dS k.
//   dkdv_tc  per (head, 64-key block, slab z: dv's and dk's 64 columns from 64 z): S^T = k q^T and
//            dP^T = v dh^T over the query blocks from the diagonal on; dv += (C inv) dh, dk += dS q,
//            csum (slab 0).
// Warp w owns block rows 16w..16w+15 (queries in rows_tc / dq_tc, keys in dkdv_tc); the streamed
// operands land by cp.async in a 2-stage ring while the previous block is multiplied.
// Dynamic smem, DQKp / DVp = DQK / DV rounded up to 64 (the slabs read whole 64-column tiles),
// ldq = DQKp + 8, ldv = DVp + 8 (bf16; ldmatrix conflict-free):
//   f64 sA[2][64] | f32 sinv[2][64] | f32 sdb[2][64] | i32 sarg[2][64] |
//   bf16 F1[64][ldq] | F2[64][ldv] | T1[2][64][ldq] | T2[2][64][ldv]
// rows_tc, dq_tc: F1 = q, F2 = dh (the block's rows), T1 = k, T2 = v (the key blocks), sA = a_s.
// dkdv_tc: F1 = k, F2 = v (the block's keys), T1 = q, T2 = dh (the query blocks), sA = A_t and sinv,
// sdb, sarg the query blocks' row terms.
struct TcBwdLayout {
  int DQKp, DVp, ldq, ldv;
  std::size_t sA, sinv, sdb, sarg, f1, f2, t1, t2, bytes;
  __host__ __device__ TcBwdLayout(std::int64_t DQK, std::int64_t DV) {
    DQKp = int(mtc::round_up(DQK, kT)), DVp = int(mtc::round_up(DV, kT));
    ldq = DQKp + 8, ldv = DVp + 8;
    sA = 0, sinv = sA + 8 * 2 * kT, sdb = sinv + 4 * 2 * kT, sarg = sdb + 4 * 2 * kT;
    f1 = sarg + 4 * 2 * kT;
    f2 = f1 + 2 * std::size_t(kT) * ldq;
    t1 = f2 + 2 * std::size_t(kT) * ldv;
    t2 = t1 + 2 * 2 * std::size_t(kT) * ldq;
    bytes = t2 + 2 * 2 * std::size_t(kT) * ldv;
  }
};

struct TcBwdFlags {
  bool q, k, v, dh;  // 16-byte rows: cp.async
};

// Stores the warp's 16 x 64 accumulator (rows r0 + {gq, gq + 8} of the view's (b, hd) matrix, columns
// c0..) where row < nrow_ok and column < D.
__device__ __forceinline__ void store_frags(const StridedView& out, std::int64_t oo, std::int64_t r0, int rA, int rB,
                                            int nrow_ok, int c0, std::int64_t D, const float (&acc)[8][4], int t4) {
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int rl = hr ? rB : rA;
    if (rl >= nrow_ok) continue;
    const std::int64_t ro = oo + (r0 + rl) * out.s2;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const std::int64_t c = c0 + 8 * j + 2 * t4;
      if (c < D) mlstm_st(out, ro + c, acc[j][2 * hr]);
      if (c + 1 < D) mlstm_st(out, ro + c + 1, acc[j][2 * hr + 1]);
    }
  }
}

// Grid (heads, row blocks (longest first), DQ ? DQK slabs : 1). DQ = false: rows_tc (writes inv, db,
// dmd, r); DQ = true: dq_tc (reads inv, db).
template <bool DQ>
__global__ void __launch_bounds__(mtc::kTcThreads) mlstm_par_rows_tc_kernel(
    const MlstmParallelParams P, const TcBwdFlags fl, const double* __restrict__ wa, const double* __restrict__ wA,
    const int* __restrict__ warg, float* __restrict__ winv, float* __restrict__ wdb, float* __restrict__ wdmd,
    float* __restrict__ wr) {
  using mtc::bf16;
  extern __shared__ float4 smem_raw[];
  char* base = reinterpret_cast<char*>(smem_raw);
  const MlstmParams& p = P.f;
  const TcBwdLayout lay(p.DQK, p.DV);
  double* s_a = reinterpret_cast<double*>(base + lay.sA);  // (2 stages, 64 steps) a_s
  bf16* sq = reinterpret_cast<bf16*>(base + lay.f1);        // (64 rows t, DQKp) q (rows_tc only)
  bf16* sdh = reinterpret_cast<bf16*>(base + lay.f2);       // (64 rows t, DVp) dh
  bf16* sk = reinterpret_cast<bf16*>(base + lay.t1);        // (2 stages, 64 steps s, DQKp) k
  bf16* sv = reinterpret_cast<bf16*>(base + lay.t2);        // (2 stages, 64 steps s, DVp) v
  const int ldq = lay.ldq, ldv = lay.ldv;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, t4 = lane & 3;
  const std::int64_t bh = blockIdx.x, b = bh / p.NH, hd = bh % p.NH;
  const std::int64_t S = p.S, DQK = p.DQK, DV = p.DV, go = bh * S;
  const int rb = int(gridDim.y - 1 - blockIdx.y);
  const std::int64_t row0 = std::int64_t(rb) * kT;
  const int nrow = int(imin(kT, S - row0)), c0 = int(blockIdx.z) * kT;

  const bf16* qb = static_cast<const bf16*>(p.q.p) + b * p.q.s0 + hd * p.q.s1;
  const bf16* kb = static_cast<const bf16*>(p.k.p) + b * p.k.s0 + hd * p.k.s1;
  const bf16* vb = static_cast<const bf16*>(p.v.p) + b * p.v.s0 + hd * p.v.s1;
  const bf16* dhb = static_cast<const bf16*>(P.dh.p) + b * P.dh.s0 + hd * P.dh.s1;
  if (!DQ) mtc::load_tile(sq, ldq, kT, lay.DQKp, qb + row0 * p.q.s2, p.q.s2, nrow, int(DQK), fl.q);
  mtc::load_tile(sdh, ldv, kT, lay.DVp, dhb + row0 * P.dh.s2, P.dh.s2, nrow, int(DV), fl.dh);
  auto issue = [&](int sb) {  // key block sb into stage sb % 2 (one commit group with anything pending)
    const int st = sb & 1;
    const std::int64_t s0 = std::int64_t(sb) * kT;
    const int ns = int(imin(kT, S - s0));
    mtc::load_tile(sk + st * kT * ldq, ldq, kT, lay.DQKp, kb + s0 * p.k.s2, p.k.s2, ns, int(DQK), fl.k);
    mtc::load_tile(sv + st * kT * ldv, ldv, kT, lay.DVp, vb + s0 * p.v.s2, p.v.s2, ns, int(DV), fl.v);
    if (tid < kT) {
      if (tid < ns) cp_async8(s_a + st * kT + tid, wa + go + s0 + tid);
      else s_a[st * kT + tid] = 0.0;
    }
    cp_async_commit();
  };
  issue(0);

  const float scale = rsqrtf(float(DQK));
  const int tlA = 16 * warp + gq, tlB = tlA + 8;  // this thread's two block rows
  const bool inA = tlA < nrow, inB = tlB < nrow;
  const double AA = inA ? wA[go + row0 + tlA] : 0.0, AB = inB ? wA[go + row0 + tlB] : 0.0;
  const int argA = inA ? warg[go + row0 + tlA] : -1, argB = inB ? warg[go + row0 + tlB] : -1;
  float invA = 0.f, invB = 0.f, dbA = 0.f, dbB = 0.f;
  if (DQ) {
    if (inA) invA = winv[go + row0 + tlA], dbA = wdb[go + row0 + tlA];
    if (inB) invB = winv[go + row0 + tlB], dbB = wdb[go + row0 + tlB];
  }
  float acc[8][4] = {};                                      // dq_tc: (16 rows, 64 slab columns) dq
  float sdcA = 0.f, sdcB = 0.f, rdpA = 0.f, rdpB = 0.f, rcsA = 0.f, rcsB = 0.f;  // rows_tc: row sums
  for (int sb = 0; sb <= rb; ++sb) {
    cp_async_wait<0>();
    __syncthreads();  // stage sb landed for all; everyone is done with stage (sb + 1) % 2
    if (sb < rb) issue(sb + 1);
    const int st = sb & 1;
    const std::int64_t s0 = std::int64_t(sb) * kT;
    const bf16* kt = sk + st * kT * ldq;
    const bf16* vt = sv + st * kT * ldv;
    const double* at = s_a + st * kT;
    float pacc[8][4] = {};  // (16 rows, 64 steps) dh v^T
    mtc::mma_rn(pacc, sdh, ldv, warp, vt, ldv, lay.DVp, lane);
    if constexpr (DQ) {
      std::uint32_t pa[4][4];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        float pv[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const bool rA = e < 2;
          const int tl = rA ? tlA : tlB, sl = 8 * j + 2 * t4 + (e & 1);
          const bool on = tl < nrow && s0 + sl <= row0 + tl;
          pv[e] = on ? scale * fmaf(pacc[j][e], rA ? invA : invB, rA ? dbA : dbB) *
                           __expf(float(at[sl] - (rA ? AA : AB)))
                     : 0.f;
        }
        mtc::pack_a_frags(pa, j, pv);
      }
      mtc::mma_frags_k(acc, pa, kt, ldq, c0, lane);
    } else {
      float sacc[8][4] = {};  // (16 rows, 64 steps) q k^T
      mtc::mma_rn(sacc, sq, ldq, warp, kt, ldq, lay.DQKp, lane);
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const bool rA = e < 2;
          const int tl = rA ? tlA : tlB, sl = 8 * j + 2 * t4 + (e & 1);
          if (!(tl < nrow && s0 + sl <= row0 + tl)) continue;
          const float ee = __expf(float(at[sl] - (rA ? AA : AB)));
          const float C = scale * sacc[j][e] * ee, x = pacc[j][e] * C;
          const bool off = (rA ? argA : argB) != s0 + sl;
          if (rA) {
            sdcA += x;
            if (off) rdpA += x, rcsA += C;
          } else {
            sdcB += x;
            if (off) rdpB += x, rcsB += C;
          }
        }
    }
  }
  if constexpr (DQ) {
    if (P.dq.p)
      store_frags(P.dq, b * P.dq.s0 + hd * P.dq.s1, row0, tlA, tlB, nrow, c0, DQK, acc, t4);
  } else {
    // the four lanes of a row hold its sums in parts (fixed xor trees: every lane the same bits)
#pragma unroll
    for (int o = 1; o <= 2; o <<= 1) {
      sdcA += __shfl_xor_sync(0xffffffffu, sdcA, o), sdcB += __shfl_xor_sync(0xffffffffu, sdcB, o);
      rdpA += __shfl_xor_sync(0xffffffffu, rdpA, o), rdpB += __shfl_xor_sync(0xffffffffu, rdpB, o);
      rcsA += __shfl_xor_sync(0xffffffffu, rcsA, o), rcsB += __shfl_xor_sync(0xffffffffu, rcsB, o);
    }
    if (t4 != 0) return;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int tl = hr ? tlB : tlA;
      if (tl >= nrow) continue;
      const std::int64_t t = row0 + tl;
      const float m = mlstm_ld(P.m, b * P.m.s0 + hd * P.m.s1 + t), bb = mlstm_ld(P.b, b * P.b.s0 + hd * P.b.s1 + t);
      const float em = expf(-m), ab = fabsf(bb), inv = norm_inv(fmaxf(ab, em), p.eps);  // the forward's n
      const float d = inv * (hr ? sdcB : sdcA), dn = -d * inv;
      const float wb = ab > em ? 1.f : (ab < em ? 0.f : 0.5f);  // torch.maximum splits a tie in halves
      const float sg = bb > 0.f ? 1.f : (bb < 0.f ? -1.f : 0.f);
      const float db = dn * wb * sg;
      const float eem = p.eps > 0.f ? p.eps * expf(m) : 0.f;  // as the SIMT dq kernel: finite for every m
      winv[go + t] = inv, wdb[go + t] = db, wdmd[go + t] = (1.f - wb) * d / (1.f + eem);
      wr[go + t] = fmaf(inv, hr ? rdpB : rdpA, db * (hr ? rcsB : rcsA));
    }
  }
}

// Grid (heads, key blocks (longest first: block 0 meets every query block), slabs max(DQKp, DVp) / 64).
__global__ void __launch_bounds__(mtc::kTcThreads) mlstm_par_dkdv_tc_kernel(const MlstmParallelParams P,
                                                                             const TcBwdFlags fl,
                                                                             const double* __restrict__ wa,
                                                                             const RowTerms rt,
                                                                             float* __restrict__ wcsum) {
  using mtc::bf16;
  extern __shared__ float4 smem_raw[];
  char* base = reinterpret_cast<char*>(smem_raw);
  const MlstmParams& p = P.f;
  const TcBwdLayout lay(p.DQK, p.DV);
  double* s_A = reinterpret_cast<double*>(base + lay.sA);  // (2 stages, 64 queries) A_t
  float* s_inv = reinterpret_cast<float*>(base + lay.sinv);  // (2 stages, 64 queries) inv_t
  float* s_db = reinterpret_cast<float*>(base + lay.sdb);    // (2 stages, 64 queries) db_t
  int* s_arg = reinterpret_cast<int*>(base + lay.sarg);      // (2 stages, 64 queries) s*_t
  bf16* sk = reinterpret_cast<bf16*>(base + lay.f1);         // (64 keys s, DQKp) k
  bf16* sv = reinterpret_cast<bf16*>(base + lay.f2);         // (64 keys s, DVp) v
  bf16* sq = reinterpret_cast<bf16*>(base + lay.t1);         // (2 stages, 64 queries t, DQKp) q
  bf16* sdh = reinterpret_cast<bf16*>(base + lay.t2);        // (2 stages, 64 queries t, DVp) dh
  const int ldq = lay.ldq, ldv = lay.ldv;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, t4 = lane & 3;
  const std::int64_t bh = blockIdx.x, b = bh / p.NH, hd = bh % p.NH;
  const std::int64_t S = p.S, DQK = p.DQK, DV = p.DV, go = bh * S;
  const int kbk = int(blockIdx.y), nqb = int(gridDim.y), c0 = int(blockIdx.z) * kT;
  const std::int64_t s0 = std::int64_t(kbk) * kT;
  const int nk = int(imin(kT, S - s0));
  const bool want_dv = P.dv.p && c0 < DV, want_dk = P.dk.p && c0 < DQK;

  const bf16* qb = static_cast<const bf16*>(p.q.p) + b * p.q.s0 + hd * p.q.s1;
  const bf16* kb = static_cast<const bf16*>(p.k.p) + b * p.k.s0 + hd * p.k.s1;
  const bf16* vb = static_cast<const bf16*>(p.v.p) + b * p.v.s0 + hd * p.v.s1;
  const bf16* dhb = static_cast<const bf16*>(P.dh.p) + b * P.dh.s0 + hd * P.dh.s1;
  mtc::load_tile(sk, ldq, kT, lay.DQKp, kb + s0 * p.k.s2, p.k.s2, nk, int(DQK), fl.k);
  mtc::load_tile(sv, ldv, kT, lay.DVp, vb + s0 * p.v.s2, p.v.s2, nk, int(DV), fl.v);
  auto issue = [&](int qb_) {  // query block qb_ into stage (qb_ - kbk) % 2
    const int st = (qb_ - kbk) & 1;
    const std::int64_t t0 = std::int64_t(qb_) * kT;
    const int nt = int(imin(kT, S - t0));
    mtc::load_tile(sq + st * kT * ldq, ldq, kT, lay.DQKp, qb + t0 * p.q.s2, p.q.s2, nt, int(DQK), fl.q);
    mtc::load_tile(sdh + st * kT * ldv, ldv, kT, lay.DVp, dhb + t0 * P.dh.s2, P.dh.s2, nt, int(DV), fl.dh);
    if (tid < kT) {
      const int o = st * kT + tid;
      if (tid < nt) {
        cp_async8(s_A + o, rt.A + go + t0 + tid);
        cp_async4(s_inv + o, rt.inv + go + t0 + tid);
        cp_async4(s_db + o, rt.db + go + t0 + tid);
        cp_async4(s_arg + o, rt.arg + go + t0 + tid);
      } else {
        s_A[o] = 0.0, s_inv[o] = 0.f, s_db[o] = 0.f, s_arg[o] = -1;
      }
    }
    cp_async_commit();
  };
  issue(kbk);

  const float scale = rsqrtf(float(DQK));
  const int slA = 16 * warp + gq, slB = slA + 8;  // this thread's two keys
  const double aA = slA < nk ? wa[go + s0 + slA] : 0.0, aB = slB < nk ? wa[go + s0 + slB] : 0.0;
  float accv[8][4] = {}, acck[8][4] = {};  // (16 keys, 64 slab columns) dv and dk
  float csA = 0.f, csB = 0.f;              // csum parts of the two keys
  for (int qbi = kbk; qbi < nqb; ++qbi) {
    cp_async_wait<0>();
    __syncthreads();  // stage landed for all; everyone is done with the other stage
    if (qbi + 1 < nqb) issue(qbi + 1);
    const int st = (qbi - kbk) & 1;
    const std::int64_t t0 = std::int64_t(qbi) * kT;
    const bf16* qt = sq + st * kT * ldq;
    const bf16* dht = sdh + st * kT * ldv;
    const double* At = s_A + st * kT;
    const float* invt = s_inv + st * kT;
    const float* dbt = s_db + st * kT;
    const int* argt = s_arg + st * kT;
    float sacc[8][4] = {}, pacc[8][4] = {};  // (16 keys, 64 queries): k q^T and v dh^T
    mtc::mma_rn(sacc, sk, ldq, warp, qt, ldq, lay.DQKp, lane);
    mtc::mma_rn(pacc, sv, ldv, warp, dht, ldv, lay.DVp, lane);
    std::uint32_t pvf[4][4], pkf[4][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float cv[4], ck[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const bool rA = e < 2;
        const int sl = rA ? slA : slB, tl = 8 * j + 2 * t4 + (e & 1);
        // tl < nt: rows past S have inv = db = 0 and A = 0, but a_s - 0 may overflow exp; mask them
        const bool on = sl < nk && t0 + tl < S && s0 + sl <= t0 + tl;
        cv[e] = 0.f, ck[e] = 0.f;
        if (on) {
          const float ee = __expf(float((rA ? aA : aB) - At[tl]));
          const float C = scale * sacc[j][e] * ee, dC = fmaf(pacc[j][e], invt[tl], dbt[tl]);
          if (argt[tl] != s0 + sl) (rA ? csA : csB) += dC * C;  // the arg-max entry: post (dmd - r)
          cv[e] = C * invt[tl], ck[e] = scale * dC * ee;
        }
      }
      mtc::pack_a_frags(pvf, j, cv);
      mtc::pack_a_frags(pkf, j, ck);
    }
    if (want_dv) mtc::mma_frags_k(accv, pvf, dht, ldv, c0, lane);
    if (want_dk) mtc::mma_frags_k(acck, pkf, qt, ldq, c0, lane);
  }
  if (want_dv) store_frags(P.dv, b * P.dv.s0 + hd * P.dv.s1, s0, slA, slB, nk, c0, DV, accv, t4);
  if (want_dk) store_frags(P.dk, b * P.dk.s0 + hd * P.dk.s1, s0, slA, slB, nk, c0, DQK, acck, t4);
  if (blockIdx.z == 0) {
#pragma unroll
    for (int o = 1; o <= 2; o <<= 1)
      csA += __shfl_xor_sync(0xffffffffu, csA, o), csB += __shfl_xor_sync(0xffffffffu, csB, o);
    if (t4 == 0) {
      if (slA < nk) wcsum[go + s0 + slA] = csA;
      if (slB < nk) wcsum[go + s0 + slB] = csB;
    }
  }
}

bool par_bwd_tc_applies(const MlstmParams& p, DType dh_dtype) {
  return p.q.dtype == DType::bf16 && p.k.dtype == DType::bf16 && p.v.dtype == DType::bf16 &&
         dh_dtype == DType::bf16 && p.DQK <= 256 && p.DV <= 256 &&
         TcBwdLayout(p.DQK, p.DV).bytes <= smem_per_block_optin();
}

// One CTA per head: di and df (see the file comment). wP, wdi: the workspace's g and a parts, reused.
__global__ void __launch_bounds__(kPiece) mlstm_par_post_kernel(const MlstmParallelParams P,
                                                                const int* __restrict__ warg,
                                                                const float* __restrict__ wr,
                                                                const float* __restrict__ wdmd,
                                                                const float* __restrict__ wcsum,
                                                                double* __restrict__ wP, double* __restrict__ wdi) {
  __shared__ double sv[kPiece];
  const MlstmParams& p = P.f;
  const std::int64_t bh = blockIdx.x, b = bh / p.NH, hd = bh % p.NH, S = p.S, go = bh * S;
  const int tid = threadIdx.x;
  // prefix sums of the arg-max entries dD[t, s*_t] = dmd_t - r_t
  double G = 0.0;
  for (std::int64_t t0 = 0; t0 < S; t0 += kPiece) {
    const std::int64_t t = t0 + tid;
    const double x = t < S ? double(wdmd[go + t]) - double(wr[go + t]) : 0.0;
    const double incl = block_scan_sum(x, sv);
    if (t < S) wP[go + t] = G + incl;
    G += sv[kPiece - 1];
  }
  for (std::int64_t s = tid; s < S; s += kPiece) wdi[go + s] = double(wcsum[go + s]);
  __syncthreads();  // wP and wdi are complete (global writes of this CTA, ordered by the barrier)
  // the last row of each run with arg-max s adds the run's arg-max entries to di_s (one writer per s)
  for (std::int64_t t = tid; t < S; t += kPiece) {
    const int s = warg[go + t];
    if (t + 1 < S && warg[go + t + 1] == s) continue;
    wdi[go + s] += wP[go + t] - (s > 0 ? wP[go + s - 1] : 0.0);
  }
  __syncthreads();
  // d lf_j = sum_{t >= j} (dmd_t - di_t), pieces from the end; thread tid takes t = t0 + 255 - tid
  double Gs = 0.0;
  const std::int64_t last = (S - 1) / kPiece * kPiece;
  for (std::int64_t t0 = last; t0 >= 0; t0 -= kPiece) {
    const std::int64_t t = t0 + (kPiece - 1 - tid);
    const bool in = t < S;
    const double di = in ? wdi[go + t] : 0.0;
    const double x = in ? double(wdmd[go + t]) - di : 0.0;
    const double suffix = Gs + block_scan_sum(x, sv);
    Gs += sv[kPiece - 1];
    if (!in) continue;
    if (P.di.p) mlstm_st(P.di, b * P.di.s0 + hd * P.di.s1 + t, float(di));
    if (P.df.p) {
      const double f = double(mlstm_ld(p.f, b * p.f.s0 + hd * p.f.s1 + t));
      mlstm_st(P.df, b * P.df.s0 + hd * P.df.s1 + t, t == 0 ? 0.f : float(suffix * sigmoid_neg(f)));
    }
  }
}

// dweight / dbias when there are no rows (B * S = 0): zeros (the sums are empty).
void zero_norm_grads(const MlstmParallelParams& P, Stream stream) {
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  for (const StridedView* g : {&P.dnw, &P.dnb}) {
    if (!g->p || P.f.NH == 0) continue;  // not keyed on dout.p: an empty dout may have a null pointer
    const std::size_t width = std::size_t(P.f.DV) * dtype_size(g->dtype);
    const std::size_t pitch = P.f.NH > 1 ? std::size_t(g->s0) * dtype_size(g->dtype) : width;
    FW_CUDA_CHECK("mlstm_parallel_bwd", cudaMemset2DAsync(g->p, pitch, 0, width, std::size_t(P.f.NH), s));
  }
}

void check_grid(const char* op, const MlstmParams& p) {
  const std::int64_t heads = p.B * p.NH, blocks = (p.S + kT - 1) / kT;
  const std::int64_t tiles = (p.DQK + kT - 1) / kT + (p.DV + kT - 1) / kT;
  if (heads > 0x7fffffff || blocks > 65535 || tiles > 65535 || p.S > INT_MAX || (p.S + 7) / 8 > 65535 ||
      (p.DV + 31) / 32 > 65535)
    throw Error(cat(op, ": problem too large for the parallel form's grid (heads ", heads, ", S ", p.S, ")"));
}

}  // namespace

std::size_t mlstm_parallel_workspace_bytes(const MlstmParallelParams& P, bool bwd) {
  return std::size_t(ParWs(P.f, bwd, P.dout.p != nullptr).total);
}

void mlstm_parallel_fwd_cuda(const MlstmParallelParams& P, void* workspace, std::size_t workspace_bytes,
                             Stream stream) {
  const char* op = "mlstm_parallel_fwd";
  const MlstmParams& p = P.f;
  const ParWs w(p, false, false);
  if (p.B * p.NH == 0 || p.S == 0 || p.DV == 0) return;  // nothing to write (DQK = 0 is refused earlier)
  if (workspace_bytes < std::size_t(w.total))
    throw ArgumentError(cat(op, ": workspace: ", workspace_bytes, " bytes, need ", w.total));
  check_grid(op, p);
  char* ws = static_cast<char*>(workspace);
  double *wg = reinterpret_cast<double*>(ws + w.g), *wa = reinterpret_cast<double*>(ws + w.a),
         *wA = reinterpret_cast<double*>(ws + w.A);
  int* warg = reinterpret_cast<int*>(ws + w.arg);
  const unsigned heads = unsigned(p.B * p.NH), blocks = unsigned((p.S + kT - 1) / kT),
                 vt = unsigned((p.DV + kT - 1) / kT);
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  mlstm_par_gates_kernel<<<heads, kPiece, 0, s>>>(p, wg, wa, wA, warg);
  FW_CUDA_CHECK_LAUNCH(op);
  if (par_fwd_tc_applies(p)) {  // bf16: tensor cores
    const TcFlags fl{mtc::rows16(p.q), mtc::rows16(p.k), mtc::rows16(p.v),
                     reinterpret_cast<std::uintptr_t>(p.h.p) % 4 == 0 && p.h.s0 % 2 == 0 && p.h.s1 % 2 == 0 &&
                         p.h.s2 % 2 == 0};
    const TcLayout lay(p.DQK);
    (void)resident_ctas_per_sm(reinterpret_cast<const void*>(&mlstm_par_fwd_tc_kernel), mtc::kTcThreads, lay.bytes);
    mlstm_par_fwd_tc_kernel<<<dim3(heads, blocks, vt), mtc::kTcThreads, lay.bytes, s>>>(P, fl, wg, wa, wA);
  } else {
    const std::size_t smem = sizeof(ParSmem);
    (void)resident_ctas_per_sm(reinterpret_cast<const void*>(&mlstm_par_fwd_kernel), kThreads, smem);
    mlstm_par_fwd_kernel<<<dim3(heads, blocks, vt), kThreads, smem, s>>>(P, wg, wa, wA);
  }
  FW_CUDA_CHECK_LAUNCH(op);
  if (P.out.p) {
    mlstm_par_norm_fwd_kernel<<<dim3(heads, unsigned((p.S + 7) / 8)), kThreads, 0, s>>>(P);
    FW_CUDA_CHECK_LAUNCH(op);
  }
}

void mlstm_parallel_bwd_cuda(const MlstmParallelParams& P, void* workspace, std::size_t workspace_bytes,
                             Stream stream) {
  const char* op = "mlstm_parallel_bwd";
  const MlstmParams& p = P.f;
  const bool norm = P.dout.p != nullptr;
  const ParWs w(p, true, norm);
  if (p.B * p.NH == 0 || p.S == 0) {
    zero_norm_grads(P, stream);  // sums over no rows
    return;
  }
  if (workspace_bytes < std::size_t(w.total))
    throw ArgumentError(cat(op, ": workspace: ", workspace_bytes, " bytes, need ", w.total));
  check_grid(op, p);
  char* ws = static_cast<char*>(workspace);
  double *wg = reinterpret_cast<double*>(ws + w.g), *wa = reinterpret_cast<double*>(ws + w.a),
         *wA = reinterpret_cast<double*>(ws + w.A);
  int* warg = reinterpret_cast<int*>(ws + w.arg);
  float *winv = reinterpret_cast<float*>(ws + w.inv), *wdb = reinterpret_cast<float*>(ws + w.db),
        *wr = reinterpret_cast<float*>(ws + w.r), *wdmd = reinterpret_cast<float*>(ws + w.dmd),
        *wcsum = reinterpret_cast<float*>(ws + w.csum);
  const unsigned heads = unsigned(p.B * p.NH), blocks = unsigned((p.S + kT - 1) / kT);
  const unsigned kt = unsigned((p.DQK + kT - 1) / kT), vt = unsigned((p.DV + kT - 1) / kT);
  const bool gates_grad = P.di.p || P.df.p;
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  mlstm_par_gates_kernel<<<heads, kPiece, 0, s>>>(p, wg, wa, wA, warg);
  FW_CUDA_CHECK_LAUNCH(op);
  float *wmean = reinterpret_cast<float*>(ws + w.mean), *wrstd = reinterpret_cast<float*>(ws + w.rstd);
  // bf16 operands: the tensor-core kernels (with the head norm, dh is written in bf16 for them)
  const bool tc = par_bwd_tc_applies(p, norm ? DType::bf16 : P.dh.dtype);
  MlstmParallelParams Q = P;  // with the head norm, the tile kernels read dh from the workspace
  if (norm) {
    Q.dh = StridedView{ws + w.dh, tc ? DType::bf16 : DType::f32, p.NH * p.S * p.DV, p.S * p.DV, p.DV};
    mlstm_par_norm_bwd_kernel<<<dim3(heads, unsigned((p.S + 7) / 8)), kThreads, 0, s>>>(P, Q.dh, wmean, wrstd);
    FW_CUDA_CHECK_LAUNCH(op);
    if (P.dnw.p || P.dnb.p) {
      mlstm_par_norm_dw_kernel<<<dim3(unsigned(p.NH), unsigned((p.DV + 31) / 32)), kThreads, 0, s>>>(P, wmean, wrstd);
      FW_CUDA_CHECK_LAUNCH(op);
    }
  }
  const std::size_t smem = sizeof(ParSmem);
  const bool kv_grad = P.dk.p || P.dv.p || gates_grad;
  if (!P.dq.p && !kv_grad) return;
  if (tc) {
    const TcBwdFlags fl{mtc::rows16(p.q), mtc::rows16(p.k), mtc::rows16(p.v), mtc::rows16(Q.dh)};
    const TcBwdLayout lay(p.DQK, p.DV);
    const int thr = mtc::kTcThreads;
    (void)resident_ctas_per_sm(reinterpret_cast<const void*>(&mlstm_par_rows_tc_kernel<false>), thr, lay.bytes);
    mlstm_par_rows_tc_kernel<false><<<dim3(heads, blocks, 1), thr, lay.bytes, s>>>(Q, fl, wa, wA, warg, winv, wdb,
                                                                                    wdmd, wr);
    FW_CUDA_CHECK_LAUNCH(op);
    if (P.dq.p) {
      (void)resident_ctas_per_sm(reinterpret_cast<const void*>(&mlstm_par_rows_tc_kernel<true>), thr, lay.bytes);
      mlstm_par_rows_tc_kernel<true><<<dim3(heads, blocks, unsigned(lay.DQKp / kT)), thr, lay.bytes, s>>>(
          Q, fl, wa, wA, warg, winv, wdb, wdmd, wr);
      FW_CUDA_CHECK_LAUNCH(op);
    }
    if (kv_grad) {
      (void)resident_ctas_per_sm(reinterpret_cast<const void*>(&mlstm_par_dkdv_tc_kernel), thr, lay.bytes);
      const unsigned slabs = unsigned(std::max(lay.DQKp, lay.DVp) / kT);
      mlstm_par_dkdv_tc_kernel<<<dim3(heads, blocks, slabs), thr, lay.bytes, s>>>(
          Q, fl, wa, RowTerms{wA, winv, wdb, warg}, wcsum);
      FW_CUDA_CHECK_LAUNCH(op);
    }
  } else {
    // dq first: it also forms the row terms (inv, db, dmd, r) that dkdv and post read
    (void)resident_ctas_per_sm(reinterpret_cast<const void*>(&mlstm_par_dq_kernel), kThreads, smem);
    mlstm_par_dq_kernel<<<dim3(heads, blocks, P.dq.p ? kt : 1u), kThreads, smem, s>>>(Q, wa, wA, warg, winv, wdb, wdmd,
                                                                                      wr);
    FW_CUDA_CHECK_LAUNCH(op);
    if (kv_grad) {
      (void)resident_ctas_per_sm(reinterpret_cast<const void*>(&mlstm_par_dkdv_kernel), kThreads, smem);
      mlstm_par_dkdv_kernel<<<dim3(heads, blocks, vt + kt), kThreads, smem, s>>>(Q, wa, RowTerms{wA, winv, wdb, warg},
                                                                                wcsum);
      FW_CUDA_CHECK_LAUNCH(op);
    }
  }
  if (gates_grad) {
    mlstm_par_post_kernel<<<heads, kPiece, 0, s>>>(P, warg, wr, wdmd, wcsum, wg, wa);
    FW_CUDA_CHECK_LAUNCH(op);
  }
}

}  // namespace fastweight::detail
