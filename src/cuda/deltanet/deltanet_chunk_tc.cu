// deltanet_chunk_tc.cu: the DeltaNet chunkwise forward on tensor cores as a pipeline of three
// kernels (bf16 q, k, v; K <= 128), FLA's chunk_delta_rule split: only the state recurrence is serial.
// Per chunk of 64 rows, with rk the L2 factors of k (1 without the L2 norm), K^ = diag(rk) K,
// Lg = strict_lower(K^ K^T) and W = diag(beta):
//   X = R - Lg D with R = V - K^ S and D = W X  <=>  X = T2 R with T2 = (I + Lg W)^-1,
// so with Xw = T2 K^ and Xu = T2 V (state-free, all chunks in parallel):
//   X = Xu - Xw S,  D = W X,  S' = S + K^T diag(rk) D,  o = scale diag(rq) (Q S + tril(Q K^T) diag(rk) D).
// (D = W X for every beta, beta = 0 included; X is what the backward needs for dbeta.)
//   1. wy (grid: chunk slots x H): Lg, T2 in fp32 (blocked inverse), Xw (bf16 hi + lo) and Xu (fp32);
//   2. state (grid: sequences*H x 64-column tiles of V; serial over chunks): S in fp32 registers,
//      X = Xu - Xw S and S += K^T diag(rk beta) X with hi + lo operands (~16 bits per step), the
//      next chunk's k and Xw prefetched (cp.async); writes S (entering each chunk) and X;
//   3. output (grid: chunk slots x H x V tiles): o from q, k, S (hi + lo) and D.
// With p.hilo false every such operand is bf16 only (FLA's precision): half the products on the
// chain, no lo tiles or workspace matrices (dn_nmat). The backward's recompute runs 1 and 2
// (deltanet_bwd.cu). Dispatched by deltanet_fwd_cuda when a workspace is given (DnFwdWs); without
// one the single-kernel version 2 runs (deltanet_fwd_tc.cu).
#include <atomic>

#include "cuda/common/check.cuh"
#include "cuda/common/gstore.cuh"
#include "cuda/deltanet/deltanet_common.cuh"
#include "cuda/deltanet/deltanet_cuda.h"
#include "cuda/deltanet/deltanet_tc.cuh"

namespace fastweight::detail {
namespace {

using namespace dtc;
constexpr int kThreads = kTcThreads;  // 4 warps; warp w owns tile rows 16w..16w+15
constexpr int kMaxK = 128;

// ---- 1. wy --------------------------------------------------------------------------------------
// smem: f32 T[64][65] | f32 L[64][65] | f32 scr[4][16][17] | f32 rk[64], beta[64] |
//       bf16 k[64][ldk] | v[nvb][64][kLd] | (LO) A2h, A2l [64][kLd]. The first nvb 64-column v tiles
//       load with k at the start (read after the inverse and Xw: loaded there, their latency was
//       exposed once per tile); later ones stream through the buffers. nvb = 2 unless the second
//       buffer costs a CTA per SM (at K <= 64: bf16 operands 4 -> 3, hi + lo 3 -> 2).
//       A1h and A2h (LO: A1h and A1l) [64][kLd] take L and scr's place, dead once T2 is formed: the
//       kernel is latency-bound (load, inverse, products, store per CTA), and at K = 128 with bf16
//       operands 74 KB instead of 92 KB per CTA fit 3 CTAs per SM instead of 2. L's place also stages
//       a given T2 (t2_given) before its transpose into T.
struct WyLayout {
  int Kc, ldk;
  std::size_t T, L, scr, rk, beta, k, v, A1h, A1l, A2h, A2l, bytes;
  static_assert(2 * 2 * kT * kLd <= 4 * 64 * 65 + 4 * 4 * 16 * 17, "two A tiles must fit in L and scr's place");
  __host__ __device__ WyLayout(std::int64_t K, bool lo, int nvb) {
    const std::size_t t64 = 2 * std::size_t(kT) * kLd;
    Kc = k_cols(K), ldk = Kc + 8;
    T = 0, L = T + 4 * 64 * 65, scr = L + 4 * 64 * 65, rk = scr + 4 * 4 * 16 * 17, beta = rk + 4 * 64;
    k = round_up(beta + 4 * 64, 16), v = k + 2 * std::size_t(kT) * ldk;
    const std::size_t end = v + nvb * t64;
    A1h = L, A1l = L + t64;                              // LO: A1h, A1l in L and scr's place
    A2h = lo ? end : L + t64, A2l = A2h + t64;           // bf16 operands: A1h, A2h there, no lo tiles
    bytes = lo ? A2l + t64 : end;
  }
};

// STG (bf16 operands; set_deltanet_wy_stage; an instance of its own, so the plain one keeps its
// registers): Xw (K % 8 == 0) and the bf16 Xu (w.xu16) go through T's place (dead once the A tiles are
// formed), each warp its own (16, 64) tile, then 16-byte row pieces (8 lanes a row's 128 bytes) instead
// of the fragments' 4-byte pairs (16 bytes of a row per 4 lanes). With LO (hi + lo; `set_deltanet_wy_t2v4`),
// STG stands for the fp32 T2 rows' one 16-byte store a piece (st_global_v4f) instead of the four 4-byte
// stores nvcc made of the float4 (session 30, in the SASS); not yet measured.
template <bool LO, int FK = 0, bool STG = false>  // FK: K fixed at compile time (128), as the state kernel
__global__ void __launch_bounds__(kThreads) deltanet_wy_kernel(const DeltanetParams p, const DnChunkBufs w, bool vk,
                                                               bool vv, int nvb) {
  extern __shared__ float4 smem_raw[];
  char* base = reinterpret_cast<char*>(smem_raw);
  const std::int64_t K = FK ? FK : p.K;
  const WyLayout lay(K, LO, nvb);
  float(*sL)[65] = reinterpret_cast<float(*)[65]>(base + lay.L);  // (64, 64) Lg W, row i col j
  float(*sT)[65] = reinterpret_cast<float(*)[65]>(base + lay.T);  // (64, 64) T2 = (I + Lg W)^-1
  float(*scr)[16][17] = reinterpret_cast<float(*)[16][17]>(base + lay.scr);
  float* s_rk = reinterpret_cast<float*>(base + lay.rk);
  float* s_beta = reinterpret_cast<float*>(base + lay.beta);
  bf16* sk = reinterpret_cast<bf16*>(base + lay.k);      // (64 rows, Kc) k
  bf16* sv = reinterpret_cast<bf16*>(base + lay.v);      // [nvb] (64 rows, 64 V columns) v tiles
  bf16* sA1h = reinterpret_cast<bf16*>(base + lay.A1h);  // (64, 64) T2 diag(rk) hi
  bf16* sA1l = reinterpret_cast<bf16*>(base + lay.A1l);
  bf16* sA2h = reinterpret_cast<bf16*>(base + lay.A2h);  // (64, 64) T2 hi
  bf16* sA2l = reinterpret_cast<bf16*>(base + lay.A2l);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, Kc = lay.Kc, ldk = lay.ldk;
  const std::int64_t h = blockIdx.y, V = p.V;
  DnSeq sq;
  std::int64_t t0;
  if (!dn_slot(p, blockIdx.x, sq, t0)) return;
  const std::int64_t b = sq.b;
  const int nr = int(lmin(kT, sq.eos - t0));

  load_tile(sk, ldk, kT, Kc, bf_rows(p.k, b, t0, h), p.k.s1, nr, int(K), vk);
  // T2 per row (DnChunkBufs::T2): chunk row i's 64 entries are column i of T2, [e] = T2[e % 64][e / 64]
  auto t2_row = [&](int i) { return dn_ws_row(p, b, t0 + i, h) * 64; };
  // (64, 64) the forward's T2 rows as stored (fp32 with LO, else bf16), staged in L's space (unused
  // then) with k's group: read one scalar per thread and step, their latency cost ~30 serial global
  // round trips per CTA (the backward ran ~4% slower with the saved T2 than forming it again)
  constexpr int kT2Pieces = LO ? 16 : 8;  // 16-byte pieces of a T2 row
  char* t2_stage = base + lay.L;
  if (w.t2_given)
    for (int e = tid; e < 64 * kT2Pieces; e += kThreads) {
      const int i = e / kT2Pieces, q = e % kT2Pieces;
      if (i < nr)
        cp_async16(t2_stage + 16 * e, reinterpret_cast<const char*>(w.T2) + (LO ? 4 : 2) * t2_row(i) + 16 * q, 16);
    }
  cp_async_commit();
  // v tile j (columns 64 j..) into buffer j % nvb, one commit group each (empty past V: uniform counts)
  const std::size_t vtile = std::size_t(kT) * kLd;
  auto issue_v = [&](std::int64_t j) {
    const std::int64_t v0 = 64 * j;
    if (v0 < V)
      load_tile(sv + (j % nvb) * vtile, kLd, kT, kT, bf_rows(p.v, b, t0, h) + v0, p.v.s1, nr, int(lmin(64, V - v0)),
                vv);
    cp_async_commit();
  };
  for (int j = 0; j < nvb; ++j) issue_v(j);
  if (tid < kT) s_beta[tid] = tid < nr ? mlstm_ld(p.beta, p.beta.s0 * b + p.beta.s1 * (t0 + tid) + h) : 0.f;
  if (nvb == 2) cp_async_wait<2>();  // k (the v tiles may stay in flight)
  else cp_async_wait<1>();
  __syncthreads();
  if (tid < kT) {  // the L2 factor from the bf16 row (as the single-kernel version)
    const float r = row_l2_factor(sk, ldk, Kc, tid, p.l2);
    s_rk[tid] = r;
    if (tid < nr) w.rk[dn_ws_row(p, b, t0 + tid, h)] = r * s_beta[tid];  // rk beta: all the later kernels need
  }
  __syncthreads();
  if (w.t2_given) {  // the forward's T2 (exact: it is what the forward's products used); identity past nr
    // (landed with k; consecutive threads: consecutive staged entries, shared rows 65 floats apart)
    for (int e = tid; e < 64 * 64; e += kThreads) {
      const int i = e / 64, j = e % 64;
      float x = i == j ? 1.f : 0.f;
      if (i < nr) {
        if constexpr (LO) x = reinterpret_cast<const float*>(t2_stage)[e];
        else x = __bfloat162float(reinterpret_cast<const bf16*>(t2_stage)[e]);
      }
      sT[j][i] = x;
    }
    __syncthreads();
  } else {
    {  // L = Lg W: L_ij = rk_i rk_j (k_i . k_j) beta_j for j < i
      float g[8][4] = {};
      mma_rn(g, sk, ldk, warp, sk, ldk, Kc, lane);
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = 16 * warp + frow(lane, e), c = fcol(lane, j, e);
          sL[i][c] = c < i ? s_rk[i] * s_rk[c] * s_beta[c] * g[j][e] : 0.f;
        }
    }
    __syncthreads();
    unit_lower_inverse(sL, sT, scr, warp, lane);  // (ends with a barrier)
    // bf16 operands: T2 itself is rounded to bf16 (as FLA's A) before any use of it, at each use below
    // (t2r; a pass over sT of its own was ~9% of the forward kernel's instructions)
    if (w.T2) {  // the forward's wy_inverse, or the backward's own region: rows i < nr, 16-byte pieces
      // (2-byte stores cost the forward ~60 us at (1, 32768, 16, 128); sT[j0 + q][i]: 2-way conflicts)
      constexpr int n = 16 / (LO ? 4 : 2);  // entries per piece
      for (int e = tid; e < 64 * kT2Pieces; e += kThreads) {
        const int i = e / kT2Pieces, j0 = n * (e % kT2Pieces);
        if (i >= nr) continue;
        if constexpr (LO) {
          // (nvcc makes four 4-byte stores of the float4; STG: one 16-byte store, gstore.cuh)
          const float4 t = make_float4(sT[j0][i], sT[j0 + 1][i], sT[j0 + 2][i], sT[j0 + 3][i]);
          if constexpr (STG) st_global_v4f(w.T2 + t2_row(i) + j0, t);
          else *reinterpret_cast<float4*>(w.T2 + t2_row(i) + j0) = t;
        } else {  // T2 rounded to bf16 (pack_bf16)
          uint4 x;
          x.x = pack_bf16(sT[j0][i], sT[j0 + 1][i]), x.y = pack_bf16(sT[j0 + 2][i], sT[j0 + 3][i]);
          x.z = pack_bf16(sT[j0 + 4][i], sT[j0 + 5][i]), x.w = pack_bf16(sT[j0 + 6][i], sT[j0 + 7][i]);
          *reinterpret_cast<uint4*>(reinterpret_cast<bf16*>(w.T2) + t2_row(i) + j0) = x;
        }
      }
    }
  }
  // T2's entry as used: fp32 with LO, else rounded to bf16 (a given T2 is bf16 already: the same value)
  auto t2r = [](float x) { return LO ? x : __bfloat162float(__float2bfloat16_rn(x)); };
  for (int e = tid; e < 64 * 32; e += kThreads) {  // A1 = T2 diag(rk), A2 = T2, as hi + lo (column pairs)
    const int i = e / 32, j = 2 * (e % 32);
    const float x0 = t2r(sT[i][j]), x1 = t2r(sT[i][j + 1]);
    put_split2<LO>(sA1h, sA1l, kLd, i, j, x0 * s_rk[j], x1 * s_rk[j + 1]);
    put_split2<LO>(sA2h, sA2l, kLd, i, j, x0, x1);
  }
  __syncthreads();
  // Xw = A1 K, per 64 columns of K, to bf16 hi + lo (rows of this chunk only)
  bf16* xwh = reinterpret_cast<bf16*>(w.xw);
  bf16* xwl = xwh + p.B * p.T * p.H * K;  // LO only
  // this thread's rows i0, i0 + 8 of the chunk: workspace row offsets computed once (per pair they
  // were ~10% of the kernel's instructions)
  const int i0 = 16 * warp + frow(lane, 0);
  const std::int64_t ws_row0 = dn_ws_row(p, b, t0 + i0, h), ws_8 = 8 * p.H;
  // STG: this warp's (16, 64) staging rows in T's place (dead since the barrier above), stride kLd
  bf16* stg = reinterpret_cast<bf16*>(base + lay.T) + 16 * warp * kLd;
  // acc (this warp's 16 rows, 64 columns) to rows 16 warp + r of a bf16 (rows, ld) workspace matrix dst,
  // columns c0 + .. (< n, n % 8 == 0)
  auto staged_store = [&](const float (&acc)[8][4], bf16* dst, std::int64_t ld, std::int64_t c0, std::int64_t n) {
    warp_store_rows_staged(stg, acc, lane, n - c0, [&](int r) -> bf16* {
      const int i = 16 * warp + r;
      return i < nr ? dst + dn_ws_row(p, b, t0 + i, h) * ld + c0 : nullptr;
    });
  };
  for (int kc = 0; kc < Kc; kc += 64) {
    float acc[8][4] = {};
    mma_rk(acc, sA1h, kLd, warp, sk + kc, ldk, 64, lane);
    if constexpr (LO) mma_rk(acc, sA1l, kLd, warp, sk + kc, ldk, 64, lane);
    if (STG && !LO && K % 8 == 0) {  // (the staged stores: bf16 hi only, bf16 operands)
      staged_store(acc, xwh, K, kc, K);
    } else {  // (an else, not a continue: with K fixed the rest was unreachable code, nvcc warning #128)
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; e += 2) {  // (e, e + 1): columns c, c + 1 of row i
          const int i = 16 * warp + frow(lane, e), c = kc + fcol(lane, j, e);
          if (i >= nr || c >= K) continue;
          const std::int64_t at = (ws_row0 + (e / 2) * ws_8) * K + c;  // row t0 + i
          const __nv_bfloat162 hi = __floats2bfloat162_rn(acc[j][e], acc[j][e + 1]);
          const float2 hf = __bfloat1622float2(hi);
          const __nv_bfloat162 lo = __floats2bfloat162_rn(acc[j][e] - hf.x, acc[j][e + 1] - hf.y);
          if (K % 2 == 0) {  // c even: 4-byte aligned pairs
            *reinterpret_cast<__nv_bfloat162*>(xwh + at) = hi;
            if constexpr (LO) *reinterpret_cast<__nv_bfloat162*>(xwl + at) = lo;
          } else {
            xwh[at] = hi.x;
            if constexpr (LO) xwl[at] = lo.x;
            if (c + 1 < K) {
              xwh[at + 1] = hi.y;
              if constexpr (LO) xwl[at + 1] = lo.y;
            }
          }
        }
    }
  }
  // Xu = A2 V, per 64 columns of V
  for (std::int64_t v0 = 0, j = 0; v0 < V; v0 += 64, ++j) {
    if (nvb == 2) cp_async_wait<1>();  // tile j (tile j + 1's group may stay in flight)
    else cp_async_wait<0>();
    __syncthreads();
    const bf16* svj = sv + (j % nvb) * vtile;
    float acc[8][4] = {};
    mma_rk(acc, sA2h, kLd, warp, svj, kLd, 64, lane);
    if constexpr (LO) mma_rk(acc, sA2l, kLd, warp, svj, kLd, 64, lane);
    if (STG && !LO && w.xu16) {
      staged_store(acc, reinterpret_cast<bf16*>(w.xu), V, v0, V);
    } else {
#pragma unroll
    for (int jj = 0; jj < 8; ++jj)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int i = 16 * warp + frow(lane, e);
        const std::int64_t c = v0 + fcol(lane, jj, e);
        if (i < nr && c < V) {  // row t0 + i
          const std::int64_t at = (ws_row0 + (e / 2) * ws_8) * V + c;
          if (w.xu16)  // bf16 rows (V % 8 == 0: whole pairs)
            *reinterpret_cast<__nv_bfloat162*>(reinterpret_cast<bf16*>(w.xu) + at) =
                __floats2bfloat162_rn(acc[jj][e], acc[jj][e + 1]);
          else
            store_pair(w.xu + at, acc[jj][e], acc[jj][e + 1], c + 1 < V, V % 2 == 0);
        }
      }
    }
    __syncthreads();  // buffer j % nvb is read by every warp: it may be refilled
    issue_v(j + nvb);
  }
}

// ---- 2. state -----------------------------------------------------------------------------------
// smem: bf16 k[2][64][ldk] | Xwh[2][64][ldk] | Xwl[2][64][ldk] | Sh, Sl[Kc][TW+8] | Dh, Dl[64][TW+8] |
//       f32 rkb[2][64] (rk beta per row) | f32 Xu[2][64][TW+4] (this CTA's TW columns, prefetched
//       with the chunk's other operands: read synchronously it exposed a global-load latency per chunk)
//       (the lo tiles with LO only) | with WS: S2h, S2l[Kc][TW+8] (S's second buffer) | u64 mbarriers[12]
//       (WS: 4 operand buffers instead of 2: k[4], Xwh[4], rkb[4], Xu[4])
struct StLayout {
  int Kc, ldk;
  std::size_t k, xh, xl, Sh, Sl, Dh, Dl, rkb, xu, S2h, S2l, bar, bytes;
  // with_xu = false: no Xu tiles (read from global instead), for devices whose shared memory per
  // block cannot hold them (sm_80: 163 KB; 195 KB are needed at K = 128). tw: the CTA's V columns
  // (the S, D and Xu tiles are tw + 8 bf16 / tw + 4 fp32 wide: 16-byte aligned rows, ldmatrix
  // conflict-free). ws: the warp-specialised form (4 operand buffers, a second S buffer, the mbarriers).
  // xtile (DST with bf16 operands): a (64, tw) bf16 X tile in Dl's place (no lo tile then).
  __host__ __device__ StLayout(std::int64_t K, bool lo, bool with_xu = true, int tw = 64, bool ws = false,
                               bool xtile = false) {
    Kc = k_cols(K), ldk = Kc + 8;
    const std::size_t ns = ws ? 4 : 2;                  // operand buffers
    const std::size_t kt = 2 * std::size_t(kT) * ldk;  // bytes of one (64, ldk) bf16 tile
    const std::size_t st = 2 * std::size_t(Kc) * (tw + 8), t64 = 2 * std::size_t(kT) * (tw + 8);
    k = 0, xh = k + ns * kt, xl = xh + ns * kt, Sh = xl + (lo ? ns * kt : 0), Sl = Sh + st;
    Dh = Sl + (lo ? st : 0), Dl = Dh + t64, rkb = Dl + (lo || xtile ? t64 : 0);
    xu = rkb + ns * 4 * kT;
    S2h = xu + (with_xu ? ns * 4 * std::size_t(kT) * (tw + 4) : 0), S2l = S2h + (ws ? st : 0);
    bar = round_up(S2l + (ws && lo ? st : 0), 16);
    bytes = bar + (ws ? 12 * 8 : 0);
  }
};

// 8 warps: the serial chain ran at one warp per scheduler with 4 (ncu: 6.25% occupancy, 3.8 cycles per
// issue); as K2 of the mLSTM backward (1.36 -> 0.94 ms), warp w owns S's 16-row group w and, in X =
// Xu - Xw S, rows 16 (w % 4).. and the (TW / 2)-column half w / 4.
// TW: the CTA's columns of V, 64 or 32. 32 halves each warp's products per chunk step (the step is a
// latency chain: FLA's fwd_h autotunes 32- or 64-column tiles of 2-4 warps) and doubles the CTAs, for
// grids that leave SMs idle (long sequences, few heads). The same sums in the same order per element:
// the same bits as TW = 64.
constexpr int kStThreads = 256;
// WS: the warp-specialised form (sm_90): a ninth warp, the producer, issues every chunk's operand
// loads (cp.async, completing on an mbarrier per buffer) and stores S to the workspace from a second
// S buffer, while the 8 consumer warps only compute. The loads and the S store were ~35% of the
// consumers' stall samples and instructions per chunk step (ncu source counters, (1,32768,16,128),
// bf16 operands, H100: the issue line 23%, the S store 12%), all on the serial chain. mbarriers (u64):
// full[4] (a buffer's operands landed; 32 arrivals per producer warp through cp.async), empty[4] (the
// consumers are done reading a buffer; 256), sfull[2] (S entering a chunk written; 256), sempty[2]
// (the producer has stored it; 32). The same products in the same order: the same bits as WS = false.
// Four operand buffers (a chunk's loads issued three steps ahead): with two, issued one step ahead by
// one warp, the consumers waited on them for 44% of their stall samples and the kernel was 1.6x slower
// ((1,32768,16,128) bf16 operands, H100).
// NP: producer warps. With one, version 3 (running pointers) took the forward only 1.6-2.6% below the
// old form, where the consumers had lost ~35% of their instructions: the one warp's ~300 instructions
// per chunk may still set the step. With two, warp 0 takes k, rk beta and the S store, warp 1 Xw and Xu.
constexpr int kStWsBufs = 4;
enum : int { kBarFull = 0, kBarEmpty = 4, kBarSFull = 8, kBarSEmpty = 10 };
// A pair of X (columns c, c + 1 of a row, at off from the thread's base) to the workspace: with dp
// D' = r X as bf16 (the output kernel's rounding of r X: the same bits as from X; r = 1 with xbf16,
// X itself), else X in fp32. The state kernel's epilogues, both forms.
__device__ __forceinline__ void store_x_pair(float* xg, bf16* dg, std::int64_t off, float2 x, float r, bool dp) {
  if (dp) *reinterpret_cast<__nv_bfloat162*>(dg + off) = __floats2bfloat162_rn(r * x.x, r * x.y);
  else *reinterpret_cast<float2*>(xg + off) = x;
}
// The WS synchronisation: ws_wait / ws_arrive / ws_consumer_sync (deltanet_tc.cuh)
__device__ __forceinline__ void ws_consumer_sync() { ws_named_sync(kStThreads); }
// FK: K fixed at compile time (128; the launch checks it), 0: runtime. Fixed, the tiles' strides,
// trip counts and shared-memory offsets are constants (as the mLSTM backward's K3 roles: -34% of
// their executed instructions there).
// two: two barriers per chunk step instead of three. The third only kept the next step from writing
// S, D and the other operand buffer while this step's S update still read them; the next step's first
// barrier does that too, if the next chunk's loads are issued after it (its S tile write comes before
// it but S is not read by the update; D is written only after it). The same products in the same
// order: the same bits. (WS: always two; the mbarriers guard the buffers.)
// WS needs (the host checks): vk, vx, the Xu tiles with V % 8 == 0 (16-byte S pieces).
// DST (`set_deltanet_state_dstage`; dp, bf16 operands, V % 8 == 0, the Xu tiles): the consumers store
// the chunk's D' (the forward) or X (w.xbf16: the backward's recompute) rows as 16-byte pieces once
// every consumer has written them to shared memory (one a thread a step at TW = 32), instead of each
// thread its 4-byte pairs (half a sector an access). D' = diag(rk beta) X is the D tile's hi part bit
// for bit (put_split2 and the pair store round the same products); X as bf16 goes to a tile of its own
// in Dl's place. The rs kernel's stores set its step (session 31's probe); these are on this chain.
template <bool LO, int TW = 64, int FK = 0, bool WS = false, int NP = 1, bool DST = false>
__global__ void __launch_bounds__(WS ? kStThreads + 32 * NP : kStThreads, 1)
    deltanet_state_kernel(const DeltanetParams p, const DnChunkBufs w, bool vk, bool vx, bool pxu, bool dp, bool two) {
  static_assert(TW == 64 || TW == 32, "64- or 32-column tiles");
  static_assert(!(WS && LO), "WS: bf16 operands (four hi + lo operand buffers do not fit)");
  static_assert(!(DST && LO), "DST: bf16 operands");
  constexpr int NJ = TW / 8, NJX = TW / 16;  // 8-column tiles of S per warp, of X per warp
  constexpr int LDT = TW + 8, LDU = TW + 4;   // strides of the S / D (bf16) and Xu (fp32) tiles
  extern __shared__ float4 smem_raw[];
  char* base = reinterpret_cast<char*>(smem_raw);
  const std::int64_t K = FK ? FK : p.K;
  const StLayout lay(K, LO, pxu, TW, WS, DST && w.xbf16);  // (the X tile: the recompute's only)
  const int Kc = lay.Kc, ldk = lay.ldk;
  const std::size_t tile = std::size_t(kT) * ldk;  // elements of one (64, ldk) tile
  // operand buffers: [2], or with WS [kStWsBufs]
  bf16* sk = reinterpret_cast<bf16*>(base + lay.k);    // [2] (64 rows, Kc) k
  bf16* sxh = reinterpret_cast<bf16*>(base + lay.xh);  // [2] (64 rows, Kc) Xw hi
  bf16* sxl = reinterpret_cast<bf16*>(base + lay.xl);  // [2] (64 rows, Kc) Xw lo
  bf16* sSh = reinterpret_cast<bf16*>(base + lay.Sh);  // (Kc, TW) S hi (stride LDT)
  bf16* sSl = reinterpret_cast<bf16*>(base + lay.Sl);  // (Kc, TW) S lo
  bf16* sDh = reinterpret_cast<bf16*>(base + lay.Dh);  // (64, TW) diag(rk beta) X hi
  bf16* sDl = reinterpret_cast<bf16*>(base + lay.Dl);
  float* s_rkb = reinterpret_cast<float*>(base + lay.rkb);  // [2][64]
  float* s_xu = reinterpret_cast<float*>(base + lay.xu);    // [2][64][LDU]
  bf16* s_xub = reinterpret_cast<bf16*>(base + lay.xu);     // or, with w.xu16, bf16 [2][64][LDT]
  bf16* sS2h = reinterpret_cast<bf16*>(base + lay.S2h);     // WS: S's buffer 1 (Kc, TW), hi
  bf16* sS2l = reinterpret_cast<bf16*>(base + lay.S2l);     // ... lo (none: WS is bf16 operands only)
  std::uint64_t* bars = reinterpret_cast<std::uint64_t*>(base + lay.bar);  // WS: [12] (kBarFull..)

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int rg = warp & 3, half = warp >> 2;  // X step: rows 16 rg.., columns (TW / 2) half..
  const DnCta cta = dn_chain_cta(p, reinterpret_cast<int*>(base));
  const std::int64_t n = cta.n, h = cta.h;
  const std::int64_t c0 = cta.tile * TW, V = p.V, rows = p.B * p.T * p.H;
  const DnSeq sq = dn_seq(p, n);
  const std::int64_t b = sq.b;
  const int ngroups = Kc / 16;  // 16-row groups of S: warp w owns group w
  const bf16* xwh = reinterpret_cast<const bf16*>(w.xw);
  const bf16* xwl = xwh + rows * K;
  const bool vxu = pxu && V % 4 == 0;  // prefetched: room for the tiles, Xu rows 16-byte aligned
  const std::int64_t hv = p.H * V;  // floats between consecutive rows of one head in Xu and X
  // chunk ci's rows: chunk 0's plus ci * 64 (equal lengths and cu_seqlens alike)
  const std::int64_t row00 = dn_ws_row(p, b, sq.bos, h), krow_step = kT * p.k.s1, wrow_step = kT * p.H;
  const bf16* k00 = bf_rows(p.k, b, sq.bos, h);
  const bf16* xub = reinterpret_cast<const bf16*>(w.xu);
  const std::int64_t nch = (sq.eos - sq.bos + kT - 1) / kT;
  // DST: chunk ci's D' rows from the D tile (hi), or its X rows from the X tile, by the kStThreads
  // consumers: 16-byte pieces, TW / 8 a row (TW = 32: one row a thread; 64: two)
  [[maybe_unused]] auto store_dprime_rows = [&](std::int64_t ci) {
    constexpr int P = TW / 8, RP = kStThreads / P;  // pieces a row, rows a pass
    const int t = int(threadIdx.x), pc = 8 * (t % P), r0 = t / P;
    const int nr = int(lmin(kT, sq.eos - (sq.bos + ci * kT)));
    if (c0 + pc >= V) return;  // V % 8 == 0: whole pieces
    const bf16* src = (w.xbf16 ? sDl : sDh) + r0 * LDT + pc;  // X, or D' (the D tile)
    bf16* g = reinterpret_cast<bf16*>(w.X) + (row00 + ci * wrow_step + std::int64_t(r0) * p.H) * V + c0 + pc;
#pragma unroll
    for (int q = 0; q < kT / RP; ++q)
      if (r0 + q * RP < nr) st_global_v4u(g + q * RP * hv, *reinterpret_cast<const uint4*>(src + q * RP * LDT));
  };

  if constexpr (WS) {
#if !defined(FW_HAS_BULK)
    __trap();  // no mbarriers in this build of the kernel: never run it unsynchronised (the host checks)
#endif
    if (!vk || !vx || !vxu || V % 8 != 0) __trap();  // the producer's paths (the host checks): fail loudly
    if (tid == 0) {
#if defined(FW_HAS_BULK)
      for (int bb = 0; bb < kStWsBufs; ++bb) mbar_init(bars + kBarFull + bb, 32 * NP), mbar_init(bars + kBarEmpty + bb, kStThreads);
      for (int bb = 0; bb < 2; ++bb) mbar_init(bars + kBarSFull + bb, kStThreads), mbar_init(bars + kBarSEmpty + bb, 32);
      mbar_init_fence();
#endif
    }
    __syncthreads();
    if (warp >= kStThreads / 32) {  // the producer warps
      const int pw = warp - kStThreads / 32;
      const bool do_k = NP == 1 || pw == 0, do_x = NP == 1 || pw == 1;  // k, rk beta, S / Xw, Xu
      // One warp issues every chunk's copies, so its address arithmetic is the producer's time: per lane
      // the first unit of chunk 0 once, then running pointers (with per-unit 64-bit products and
      // predicates, ~2000 instructions per chunk, the producer was the bottleneck: 1.4x slower).
      // The (64, Kc) k and Xw tiles: lane's 16-byte unit column u, rows r0 + dr q (q < 64 / dr).
      const int U = Kc / 8, dr = 32 / U, u = lane % U, r0 = lane / U, nq = kT / dr;
      const bool colk = 8 * u < K;  // K % 8 == 0 (vk): whole units; zeros past K up to Kc
      const std::uint32_t su = std::uint32_t(2 * (r0 * ldk + 8 * u)), ss = std::uint32_t(2 * dr * ldk);
      const std::int64_t kq = dr * p.k.s1, xq = dr * p.H * K;  // elements between a lane's units
      const bf16* gk0 = k00 + r0 * p.k.s1 + 8 * u;             // chunk 0's first unit
      const bf16* gx0 = xwh + (row00 + r0 * p.H) * K + 8 * u;
      // Xu: lane's 16-byte piece (4 fp32 or 8 bf16 columns) of rows xi + XP q, as bytes
      const int eb = w.xu16 ? 2 : 4;  // bytes per Xu element
      const int XT = TW * eb / 16, XP = 32 / XT, xi = lane / XT, xc = (lane % XT) * (16 / eb);
      const int xbytes = V - c0 - xc >= 16 / eb ? 16 : 0;  // V % 8 == 0: whole pieces
      const char* gu0 = reinterpret_cast<const char*>(w.xu) + ((row00 + xi * p.H) * V + c0 + xc) * eb;
      const std::int64_t uq = std::int64_t(XP) * hv * eb, uc = wrow_step * V * eb;  // bytes: between pieces, chunks
      const int ldu = w.xu16 ? 2 * LDT : 4 * LDU;                                     // bytes per Xu tile row
      const std::uint32_t du0 = smem_u32(s_xu) + std::uint32_t(xi * ldu + xc * eb);
      const float* gr0 = w.rk + row00 + lane * p.H;  // rk beta of rows lane, lane + 32
      const StateStoreUnits<LO, TW> sst(K, V, c0, 32, lane);
      auto load = [&](int buf, std::int64_t ci) {
        const int nr = int(lmin(kT, sq.eos - sq.bos - ci * kT));
        std::uint32_t dk = smem_u32(sk + buf * tile) + su, dx = smem_u32(sxh + buf * tile) + su;
        const bf16* gk = gk0 + ci * krow_step;
        const bf16* gx = gx0 + ci * wrow_step * K;
        if (nr == kT && colk) {  // a whole chunk (all but a sequence's last): no predicates
          if (do_k) {
#pragma unroll 8
            for (int q = 0; q < nq; ++q, dk += ss, gk += kq) cp_async16_s(dk, gk);
          }
          if (do_x) {
#pragma unroll 8
            for (int q = 0; q < nq; ++q, dx += ss, gx += xq) cp_async16_s(dx, gx);
          }
        } else {
          for (int q = 0; q < nq; ++q, dk += ss, dx += ss, gk += kq, gx += xq) {
            const int by = colk && r0 + dr * q < nr ? 16 : 0;
            if (do_k) cp_async16_sz(dk, by ? gk : k00, by);
            if (do_x) cp_async16_sz(dx, by ? gx : xwh, by);
          }
        }
        if (do_x) {
          const char* gu = gu0 + ci * uc;
          std::uint32_t du = du0 + std::uint32_t(buf * kT * ldu);
          for (int q = 0; q < kT / XP; ++q, du += XP * ldu, gu += uq) {
            const int by = xi + XP * q < nr ? xbytes : 0;
            cp_async16_sz(du, by ? gu : gu0, by);
          }
        }
        if (do_k) {
          const float* gr = gr0 + ci * wrow_step;
          cp_async4_z(s_rkb + buf * kT + lane, lane < nr ? gr : w.rk, lane < nr ? 4 : 0);
          cp_async4_z(s_rkb + buf * kT + lane + 32, lane + 32 < nr ? gr + 32 * p.H : w.rk, lane + 32 < nr ? 4 : 0);
        }
#if defined(FW_HAS_BULK)
        cp_async_mbar_arrive(bars + kBarFull + buf);
#endif
      };
      for (int c = 0; c < kStWsBufs && c < nch; ++c) load(c, c);
      for (std::int64_t ci = 0; ci < nch; ++ci) {
        const int sb = int(ci & 1), buf = int(ci % kStWsBufs);
        if (do_k) {
          ws_wait(bars + kBarSFull + sb, unsigned(ci >> 1) & 1);  // S entering chunk ci, in S buffer sb
          sst.store(state_mats<LO>(w.S, sq.base + ci, p.H, h, K, V), sb ? sS2h : sSh, sb ? sS2l : sSl, K, V, c0, 32);
          ws_arrive(bars + kBarSEmpty + sb);
        }
        if (ci + kStWsBufs < nch) {
          ws_wait(bars + kBarEmpty + buf, unsigned(ci / kStWsBufs) & 1);  // the consumers are done with step ci's buffer
          load(buf, ci + kStWsBufs);
        }
      }
      asm volatile("cp.async.wait_all;\n" ::: "memory");
      return;
    }
  }

  float acc_s[1][NJ][4];  // S (fp32), rows 16 w.., the CTA's TW columns
  state_load<8>(acc_s, p.h0, n, h, c0, K, V, warp, lane);

  // This thread's Xu pieces: rows xu_i + XR q (q < 64 / XR) of the chunk, columns xu_c..xu_c + 3 of
  // the CTA's TW, the same every chunk (only the row base moves): the per-piece index and 64-bit address
  // arithmetic made the chunk's loads ~37% of a step's instructions (ncu, varlen row, bf16 operands).
  constexpr int XT = TW / 4, XR = kStThreads / XT;  // threads per Xu row (4 columns each), rows per pass
  const int xu_i = tid / XT, xu_c = (tid % XT) * 4;
  const int xu_bytes = 4 * int(lmin(4, V - c0 - xu_c < 0 ? 0 : V - c0 - xu_c));
  const TileUnits kunits(Kc, kStThreads);  // the k and Xw tiles' cp.async units
  const ChunkUnits kcu(kunits, ldk, p.k.s1), xcu(kunits, ldk, p.H * K);  // ... fixed per CTA (whole chunks)
  const float* xu00 = w.xu + (row00 + xu_i * p.H) * V + c0 + xu_c;  // this thread's first Xu piece, chunk 0
  // with w.xu16 (bf16 Xu, V % 8 == 0): 8 columns a piece, rows xb_i + XRb q
  constexpr int XTb = TW / 8, XRb = kStThreads / XTb;
  const int xb_i = tid / XTb, xb_c = (tid % XTb) * 8, xb_bytes = V - c0 - xb_c >= 8 ? 16 : 0;
  const bf16* xub00 = xub + (row00 + xb_i * p.H) * V + c0 + xb_c;
  // chunk ci's k, Xw (hi, lo) into buffer buf (cp.async where aligned), rk beta per row
  auto issue = [&](int buf, std::int64_t ci) {
    const int nr = int(lmin(kT, sq.eos - sq.bos - ci * kT));
    const std::int64_t row0 = row00 + ci * wrow_step;
    load_chunk_tile(kcu, kunits, sk + buf * tile, ldk, k00 + ci * krow_step, p.k.s1, nr, int(K), vk, kStThreads);
    load_chunk_tile(xcu, kunits, sxh + buf * tile, ldk, xwh + row0 * K, p.H * K, nr, int(K), vx, kStThreads);
    if constexpr (LO)
      load_chunk_tile(xcu, kunits, sxl + buf * tile, ldk, xwl + row0 * K, p.H * K, nr, int(K), vx, kStThreads);
    if (tid < kT) {
      if (tid < nr) cp_async4(s_rkb + buf * kT + tid, w.rk + row0 + tid * p.H);
      else s_rkb[buf * kT + tid] = 0.f;
    }
    // Xu rows t0.. (stride H V elements), columns c0..c0+TW-1 (this thread's pieces from row i of the
    // chunk, R rows apart): zero past nr rows and V columns; fp32 tiles (stride LDU) or with w.xu16 bf16
    // ones (stride LDT)
    auto xu_pieces = [&](auto* tile_dst, const auto* src00, int i, int R, int ld, int piece_bytes) {
      const auto* src = src00 + ci * wrow_step * V;
#pragma unroll
      for (int q = 0; q < kT / R; ++q) {
        const int bytes = i + R * q < nr ? piece_bytes : 0;
        cp_async16(tile_dst + R * q * ld, bytes ? src + R * q * hv : src00, bytes);
      }
    };
    static_assert(kStThreads % XT == 0 && kT % XR == 0 && kStThreads % XTb == 0 && kT % XRb == 0,
                  "whole rows per pass, whole passes per chunk");
    if (vxu && w.xu16) xu_pieces(s_xub + (buf * kT + xb_i) * LDT + xb_c, xub00, xb_i, XRb, LDT, xb_bytes);
    else if (vxu) xu_pieces(s_xu + (buf * kT + xu_i) * LDU + xu_c, xu00, xu_i, XR, LDU, xu_bytes);
    cp_async_commit();
  };
  const StateStoreUnits<LO, TW> sst(K, V, c0, kStThreads);  // S's pieces to the workspace, fixed per CTA
  if (!WS && nch > 0) issue(0, 0);
  for (std::int64_t ci = 0; ci < nch; ++ci) {
    const int buf = WS ? int(ci % kStWsBufs) : int(ci & 1);  // the operand buffer
    const int sb = int(ci & 1);                                // WS: the S buffer
    const std::int64_t t0 = sq.bos + ci * kT;
    const int nr = int(lmin(kT, sq.eos - t0));
    bf16* Sh = WS && sb ? sS2h : sSh;  // this step's S tile (WS: two buffers, one while the producer stores the other)
    bf16* Sl = WS && sb ? sS2l : sSl;
    if constexpr (WS) {
      // The consumers' step. Everything that does not depend on S is read from shared memory before
      // the chain needs it: the A fragments of both products (Xw rows, K^T rows) and the epilogue's
      // Xu pairs and rk beta. Read inside the chain, they queued behind the other warps' ldmatrix
      // (ncu: the X epilogue ~30% of the consumers' stall samples, short scoreboard on its LDS). The
      // same products in the same order: the same bits as the other forms.
      static_assert(NJX == 2 && !LO, "WS: 32-column tiles, bf16 operands");
      ws_wait(bars + kBarFull + buf, unsigned(ci / kStWsBufs) & 1);  // chunk ci's operands landed
      const bf16* xh = sxh + buf * tile;
      const bf16* kb = sk + buf * tile;
      const bool upd = warp < ngroups;  // this warp's 16 rows of S exist (Kc = 64: warps 0..3)
      std::uint32_t ax[8][4];  // A of Xw S: Xw rows 16 rg.., k-step ks (columns 16 ks..)
      std::uint32_t ak[4][4];  // A of K^T D: K^T rows 16 warp.., k-step ks (chunk rows 16 ks..)
#pragma unroll
      for (int ks = 0; ks < 8; ++ks)
        if (ks < Kc / 16)
          ldsm_x4(ax[ks], xh + (16 * rg + ld_row_a_rowmajor(lane)) * ldk + ks * 16 + ld_col_a_rowmajor(lane));
      if (upd) {
#pragma unroll
        for (int ks = 0; ks < 4; ++ks)
          ldsm_x4_t(ak[ks], kb + (ks * 16 + ld_row_a_kmajor(lane)) * ldk + 16 * warp + ld_col_a_kmajor(lane));
      }
      const int i0 = 16 * rg + frow(lane, 0), cb = (TW / 2) * half + fcol(lane, 0, 0);
      float2 u[NJX][2];  // Xu at rows i0, i0 + 8, columns cb + 8 j, + 1
      float r[2];        // rk beta of rows i0, i0 + 8
#pragma unroll
      for (int e2 = 0; e2 < 2; ++e2) {
        const int i = i0 + 8 * e2;
        r[e2] = s_rkb[buf * kT + i];
#pragma unroll
        for (int j = 0; j < NJX; ++j)
          u[j][e2] = w.xu16 ? __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(s_xub + (buf * kT + i) * LDT + cb + 8 * j))
                            : *reinterpret_cast<const float2*>(s_xu + (buf * kT + i) * LDU + cb + 8 * j);
      }
      if (ci >= 2) ws_wait(bars + kBarSEmpty + sb, (unsigned(ci >> 1) & 1) ^ 1);  // S of step ci - 2 stored
      state_split<8, LO>(acc_s, Sh, Sl, ngroups, warp, lane);
      ws_arrive(bars + kBarSFull + sb);
      ws_consumer_sync();  // every warp's S rows written
      // c. X = Xu - Xw S (this warp's 16 rows x 16 columns): B = S from shared memory, A from registers
      float acc[NJX][4] = {};
      const bf16* Sb = Sh + (TW / 2) * half;
#pragma unroll
      for (int ks = 0; ks < 8; ++ks)
        if (ks < Kc / 16) {
          std::uint32_t bb[4];
          ldsm_x4_t(bb, Sb + (ks * 16 + ld_row_b_kmajor(lane)) * LDT + ld_col_b_kmajor(lane));
          mma_bf16_16816(acc[0], ax[ks], bb[0], bb[1]);
          mma_bf16_16816(acc[1], ax[ks], bb[2], bb[3]);
        }
      // X (or D' with dp) to the workspace, diag(rk beta) X to the D tile (as the other forms' epilogue)
      const std::int64_t xo = (row00 + ci * wrow_step + i0 * p.H) * V + c0 + cb;
      float* xg = w.X + xo;
      bf16* dg = reinterpret_cast<bf16*>(w.X) + xo;
#pragma unroll
      for (int j = 0; j < NJX; ++j)
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
          const int i = i0 + 8 * (e / 2), c = cb + 8 * j;
          float2 x = make_float2(0.f, 0.f);
          if (i < nr && c0 + c < V) {
            x = make_float2(u[j][e / 2].x - acc[j][e], u[j][e / 2].y - acc[j][e + 1]);
            if constexpr (!DST) store_x_pair(xg, dg, (e / 2) * 8 * hv + 8 * j, x, w.xbf16 ? 1.f : r[e / 2], dp);
          }
          put_split2<LO>(sDh, sDl, LDT, i, c, r[e / 2] * x.x, r[e / 2] * x.y);
          if constexpr (DST)  // (the pair store's rounding of 1 X)
            if (w.xbf16) *reinterpret_cast<__nv_bfloat162*>(sDl + i * LDT + c) = __floats2bfloat162_rn(x.x, x.y);
        }
      ws_consumer_sync();  // the D tile written
      if constexpr (DST) store_dprime_rows(ci);
      // d. S += K^T D (this warp's 16 rows x TW columns): B = D from shared memory, A from registers
      if (upd) state_update_regs<NJ>(acc_s[0], ak, sDh, lane);
      ws_arrive(bars + kBarEmpty + buf);  // this warp's reads of buffer buf are done
      continue;
    } else {
      // a. S as hi + lo (B operand of Xw S; its last readers, the previous step's X products, finished
      //    before that step's second barrier)
      state_split<8, LO>(acc_s, Sh, Sl, ngroups, warp, lane);
      // b. the next chunk's operands into the other buffer
      if (two) {  // this chunk's landed (the only group in flight); then, past the barrier, every warp
                  // is done with the previous step's reads of buffer buf ^ 1 (its X products, S update)
        cp_async_wait<0>();
        __syncthreads();
        if (ci + 1 < nch) issue(buf ^ 1, ci + 1);
      } else {  // its last readers finished before the previous iteration's final barrier
        if (ci + 1 < nch) {
          issue(buf ^ 1, ci + 1);
          cp_async_wait<1>();
        } else {
          cp_async_wait<0>();
        }
        __syncthreads();
      }
      // S entering the chunk to the workspace as hi + lo (DnChunkBufs), copied from smem
      sst.store(state_mats<LO>(w.S, sq.base + ci, p.H, h, K, V), Sh, Sl, K, V, c0, kStThreads);
    }
    // c. X = Xu - Xw S (this warp's 16 rows x TW / 2 columns); to the workspace; diag(rk beta) X as hi + lo
    {
      float acc[NJX][4] = {};
      const bf16* xh = sxh + buf * tile;
      const bf16* xl = sxl + buf * tile;
      mma_split<LO, true>(acc, xh, xl, ldk, rg, Sh + (TW / 2) * half, Sl + (TW / 2) * half, LDT, Kc, lane);
      // vxu (V % 4 == 0: pairs whole): this thread's X pairs at one base, rows i0 and i0 + 8, 8-column
      // steps; dp (deltanet_dprime: V % 8 == 0, vxu): D' = diag(rk beta) X as bf16 in the X region,
      // or with w.xbf16 (the backward's recompute) X itself as bf16
      const int i0 = 16 * rg + frow(lane, 0), cb = (TW / 2) * half + fcol(lane, 0, 0);
      const std::int64_t xo = (row00 + ci * wrow_step + i0 * p.H) * V + c0 + cb;
      float* xg = w.X + xo;
      bf16* dg = reinterpret_cast<bf16*>(w.X) + xo;
#pragma unroll
      for (int j = 0; j < NJX; ++j)
#pragma unroll
        for (int e = 0; e < 4; e += 2) {  // columns c, c + 1 of row i
          const int i = 16 * rg + frow(lane, e), c = (TW / 2) * half + fcol(lane, j, e);
          float2 x = make_float2(0.f, 0.f);
          if (vxu) {
            if (i < nr && c0 + c < V) {
              const float2 u =
                  w.xu16 ? __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(s_xub + (buf * kT + i) * LDT + c))
                         : *reinterpret_cast<const float2*>(s_xu + (buf * kT + i) * LDU + c);
              x = make_float2(u.x - acc[j][e], u.y - acc[j][e + 1]);
              if constexpr (!DST) store_x_pair(xg, dg, (e / 2) * 8 * hv + 8 * j, x, w.xbf16 ? 1.f : s_rkb[buf * kT + i], dp);
            }
          } else if (i < nr && c0 + c < V) {
            const std::int64_t at = dn_ws_row(p, b, t0 + i, h) * V + c0 + c;
            const bool has1 = c0 + c + 1 < V, even = V % 2 == 0;
            const float2 u = load_pair(w.xu + at, has1, even);  // no Xu tiles (sm_80 cap) or V % 4 != 0
            x = make_float2(u.x - acc[j][e], has1 ? u.y - acc[j][e + 1] : 0.f);
            store_pair(w.X + at, x.x, x.y, has1, even);
          }
          const float r = s_rkb[buf * kT + i];
          put_split2<LO>(sDh, sDl, LDT, i, c, r * x.x, r * x.y);
          if constexpr (DST)  // (the pair store's rounding of 1 X)
            if (w.xbf16) *reinterpret_cast<__nv_bfloat162*>(sDl + i * LDT + c) = __floats2bfloat162_rn(x.x, x.y);
        }
    }
    __syncthreads();
    if constexpr (DST) store_dprime_rows(ci);
    // d. S += K^T (diag(rk beta) X)
    state_update<8, LO>(acc_s, sk + buf * tile, ldk, sDh, sDl, ngroups, warp, lane);
    if (!two) __syncthreads();  // the next iteration rewrites S hi/lo, D and this buffer
  }
  if (p.ht.p) state_store<8>(acc_s, p.ht, n, h, c0, K, V, warp, lane);
}

// ---- 3. output ----------------------------------------------------------------------------------
// smem: bf16 q[64][ldk] | k[64][ldk] | Sh, Sl[Kc][kLd] | Vp[64][kLd] | f32 rq[64], rk beta[64] |
//       f32 X[64][64] (cp.async staging: per-element loads of X were ~46% of the stall samples; not
//       with dp, where the state kernel wrote D' itself: 79 -> 63 KB at K = 128, 3 CTAs per SM)
struct OutLayout {
  int Kc, ldk;
  std::size_t q, k, Sh, Sl, Vp, rq, rk, X, bytes;
  __host__ __device__ OutLayout(std::int64_t K, bool lo, bool dp) {
    Kc = k_cols(K), ldk = Kc + 8;
    q = 0, k = q + 2 * std::size_t(kT) * ldk, Sh = k + 2 * std::size_t(kT) * ldk;
    Sl = Sh + 2 * std::size_t(Kc) * kLd, Vp = Sl + (lo ? 2 * std::size_t(Kc) * kLd : 0);
    rq = Vp + 2 * kT * kLd, rk = rq + 4 * kT, X = rk + 4 * kT, bytes = X + (dp ? 0 : 4 * 64 * 64);
  }
};

// STG (`set_deltanet_out_stage`; its own instances): o through the warp's own q rows (dead once its
// products are done) as 16-byte row pieces, 8 lanes a row's 128 bytes (warp_store_rows_staged), where
// the fragments' pair stores wrote 4 bytes a lane, 16 bytes of a row per 4 lanes: half a sector an
// access (the backward's staged stores took 1-4% each, session 30). The same roundings and bits.
template <bool LO, int FK = 0, bool STG = false>  // FK: as the wy kernel
__global__ void __launch_bounds__(kThreads) deltanet_out_kernel(const DeltanetParams p, const DnChunkBufs w, bool vq,
                                                                bool vk, bool dp, int vfast) {
  extern __shared__ float4 smem_raw[];
  char* base = reinterpret_cast<char*>(smem_raw);
  const std::int64_t K = FK ? FK : p.K;
  const OutLayout lay(K, LO, dp);
  const int Kc = lay.Kc, ldk = lay.ldk;
  bf16* sq = reinterpret_cast<bf16*>(base + lay.q);    // (64 rows, Kc) q
  bf16* sk = reinterpret_cast<bf16*>(base + lay.k);    // (64 rows, Kc) k
  bf16* sSh = reinterpret_cast<bf16*>(base + lay.Sh);  // (Kc, 64) S hi
  bf16* sSl = reinterpret_cast<bf16*>(base + lay.Sl);  // (Kc, 64) S lo
  bf16* sVp = reinterpret_cast<bf16*>(base + lay.Vp);  // (64, 64) D' = diag(rk beta) X
  float* s_rq = reinterpret_cast<float*>(base + lay.rq);
  float* s_rk = reinterpret_cast<float*>(base + lay.rk);
  float* sX = reinterpret_cast<float*>(base + lay.X);  // (64, 64) X rows of the chunk, this CTA's columns
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  // vfast (the V tiles' count, or 0): a (slot, head)'s V tiles are neighbours in the grid (blockIdx.x =
  // slot * vfast + V tile), so that their shared q, k tiles are read from HBM once and from the L2 by
  // the others; else blockIdx.z is the V tile (a whole grid of slots apart)
  const int vz = vfast ? int(blockIdx.x % unsigned(vfast)) : int(blockIdx.z);
  const std::int64_t slot = vfast ? std::int64_t(blockIdx.x / unsigned(vfast)) : std::int64_t(blockIdx.x);
  const std::int64_t h = blockIdx.y, c0 = std::int64_t(vz) * kT, V = p.V;
  DnSeq sq_;
  std::int64_t t0;
  if (!dn_slot(p, slot, sq_, t0)) return;
  const std::int64_t b = sq_.b;
  const int nr = int(lmin(kT, sq_.eos - t0));

  load_tile(sq, ldk, kT, Kc, bf_rows(p.q, b, t0, h), p.q.s1, nr, int(K), vq);
  load_tile(sk, ldk, kT, Kc, bf_rows(p.k, b, t0, h), p.k.s1, nr, int(K), vk);
  cp_async_commit();  // q, k: the first group (P is formed from them while S and D' still load)
  // S entering the chunk: (K, V) hi then lo bf16 matrices of the workspace, this CTA's 64 columns
  const bf16* Sg = state_mats<LO>(w.S, slot, p.H, h, K, V) + c0;
  const int ncv = int(lmin(64, V - c0));
  load_tile(sSh, kLd, Kc, kT, Sg, V, int(K), ncv, V % 8 == 0);
  if constexpr (LO) load_tile(sSl, kLd, Kc, kT, Sg + K * V, V, int(K), ncv, V % 8 == 0);
  float o[8][4] = {};
  if (dp) {  // D' as the state kernel wrote it (bf16 rows of V, 16-byte aligned: V % 8 == 0)
    load_tile(sVp, kLd, kT, kT, reinterpret_cast<const bf16*>(w.X) + dn_ws_row(p, b, t0, h) * V + c0, p.H * V, nr,
              ncv, true);
    cp_async_commit();
    cp_async_wait<1>();  // q, k
    __syncthreads();
    if (tid < kT) s_rq[tid] = row_l2_factor(sq, ldk, Kc, tid, p.l2);  // rq from the bf16 row
    // o = scale diag(rq) (Q S + tril(Q K^T) diag(rk) D): P now, the rest once S and D' are in
    std::uint32_t pf[4][4];
    chunk_output_p(pf, sq, sk, ldk, Kc, nullptr, warp, lane);  // rk is in D'
    cp_async_wait<0>();
    __syncthreads();  // S, D' (and rq) visible
    chunk_output_o<LO>(o, pf, sq, ldk, Kc, sSh, sSl, sVp, warp, lane);
  } else {
    stage_ws_rows<false>(sX, 64, w.X, p, b, t0, h, nr, c0, kThreads);
    cp_async_commit();
    if (tid < kT) s_rk[tid] = tid < nr ? w.rk[dn_ws_row(p, b, t0 + tid, h)] : 0.f;  // rk beta
    cp_async_wait<0>();
    __syncthreads();
    for (int e = tid; e < 64 * 32; e += kThreads) {  // D' = diag(rk beta) X as bf16, column pairs
      const int i = e / 32, c = 2 * (e % 32);
      const bool on = i < nr && c0 + c < V, on1 = i < nr && c0 + c + 1 < V;
      const float x0 = on ? sX[i * 64 + c] : 0.f, x1 = on1 ? sX[i * 64 + c + 1] : 0.f;
      *reinterpret_cast<__nv_bfloat162*>(sVp + i * kLd + c) = __floats2bfloat162_rn(s_rk[i] * x0, s_rk[i] * x1);
    }
    if (tid < kT) s_rq[tid] = row_l2_factor(sq, ldk, Kc, tid, p.l2);  // rq from the bf16 row
    __syncthreads();
    // o = scale diag(rq) (Q S + tril(Q K^T) diag(rk) D)
    chunk_output<LO>(o, sq, sk, ldk, Kc, sSh, sSl, sVp, nullptr, warp, lane);  // rk is in D'
  }
  if constexpr (STG) {  // (the host checks: bf16 o, 16-byte aligned rows, V % 8 == 0)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {  // scale diag(rq) first: the products the pair stores round
      const float f = p.scale * s_rq[16 * warp + frow(lane, 2 * hr)];
#pragma unroll
      for (int j = 0; j < 8; ++j) o[j][2 * hr] *= f, o[j][2 * hr + 1] *= f;
    }
    warp_store_rows_staged(sq + 16 * warp * ldk, o, lane, V - c0, [&](int r) -> bf16* {
      const int i = 16 * warp + r;
      return i < nr ? static_cast<bf16*>(p.o.p) + dn_row(p.o, b, t0 + i, h) + c0 : nullptr;
    });
    return;
  }
  // bf16 o with even strides and V: a column pair per 4-byte store (the same roundings)
  const bool pairs = p.o.dtype == DType::bf16 && reinterpret_cast<std::uintptr_t>(p.o.p) % 4 == 0 && p.o.s0 % 2 == 0 &&
                     p.o.s1 % 2 == 0 && p.o.s2 % 2 == 0 && V % 2 == 0;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int i = 16 * warp + frow(lane, 2 * hr);
    if (i >= nr) continue;
    const float f = p.scale * s_rq[i];
    const std::int64_t row = dn_row(p.o, b, t0 + i, h);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const std::int64_t c = c0 + fcol(lane, j, 0);  // even
      if (pairs) {
        if (c < V)
          *reinterpret_cast<__nv_bfloat162*>(static_cast<bf16*>(p.o.p) + row + c) =
              __floats2bfloat162_rn(f * o[j][2 * hr], f * o[j][2 * hr + 1]);
      } else {
        if (c < V) mlstm_st(p.o, row + c, f * o[j][2 * hr]);
        if (c + 1 < V) mlstm_st(p.o, row + c + 1, f * o[j][2 * hr + 1]);
      }
    }
  }
}

template <typename Kernel>
void prepare(Kernel* kernel, std::size_t smem) {
  (void)resident_ctas_per_sm(reinterpret_cast<const void*>(kernel), kThreads, smem);
}

}  // namespace

namespace {
// The state kernel's Xu tiles fit its shared memory (Hopper; not sm_80 at K > 64 with hi + lo).
bool state_xu_tiles(const DeltanetParams& p) { return StLayout(p.K, p.hilo, true).bytes <= smem_per_block_optin(); }
// D' instead of X in the X region (DnChunkBufs::dprime): the forward asks, whole bf16x2 pairs and
// 16-byte rows (V % 8 == 0), the state kernel's Xu path (its epilogue writes D').
std::atomic<bool> g_dprime{true};
bool deltanet_dprime(const DeltanetParams& p, const DnChunkBufs& w) {
  return w.dprime && g_dprime.load() && p.V % 8 == 0 && state_xu_tiles(p);
}
}  // namespace

bool set_deltanet_fwd_dprime(bool enabled) { return g_dprime.exchange(enabled); }

namespace {
std::atomic<bool> g_x_bf16{true};  // set_deltanet_bwd_x_bf16
}  // namespace
bool set_deltanet_bwd_x_bf16(bool enabled) { return g_x_bf16.exchange(enabled); }
// The D' path's conditions (whole bf16x2 pairs, 16-byte rows, the state kernel's Xu tiles), bf16 operands.
bool deltanet_bwd_x_bf16(const DeltanetParams& p) {
  return g_x_bf16.load(std::memory_order_relaxed) && !p.hilo && p.V % 8 == 0 && state_xu_tiles(p);
}

namespace {
std::atomic<bool> g_xu_bf16{true};  // set_deltanet_xu_bf16
}  // namespace
bool set_deltanet_xu_bf16(bool enabled) { return g_xu_bf16.exchange(enabled); }
// bf16 operands, the tensor-core pipeline, the state kernel's Xu tiles (its only bf16 Xu path), whole
// 16-byte pieces of 8 columns (V % 8 == 0)
bool deltanet_xu_bf16(const DeltanetParams& p) {
  return g_xu_bf16.load(std::memory_order_relaxed) && deltanet_chunk_tc_applies(p) && !p.hilo && p.V % 8 == 0 &&
         state_xu_tiles(p);
}

namespace {
std::atomic<int> g_wy_vbufs{0};   // 0: the planner's choice
std::atomic<int> g_state_tile{0};  // 0: the planner's choice
std::atomic<bool> g_state_two_sync{true};  // set_deltanet_state_two_sync
std::atomic<bool> g_state_ws{true};        // set_deltanet_state_ws
std::atomic<int> g_state_ws_warps{2};      // set_deltanet_state_ws_warps
std::atomic<bool> g_wy_stage{true};        // set_deltanet_wy_stage: on (H100, session 30: fwd 0.95-0.97x)
std::atomic<bool> g_out_vfast{true};       // set_deltanet_out_vfast
std::atomic<bool> g_out_stage{true};       // set_deltanet_out_stage (H100, session 32: fwd 0.96-0.99x)
// DST (0 never, 1 always, 2 where the state kernel's CTAs fill the GPU; H100, session 32, bf16
// operands, fwd ms: 0.980-0.989 / 0.915-0.922 / 0.988-0.993 at (4,4096,16,128) / (2,8192) / varlen 8
// in 32768 (128-256 CTAs), 1.026-1.027 at (1,32768) (64 CTAs: half the SMs idle, where the extra
// barrier and shared-memory pass lengthen the chain and the stores' bytes do not bind)
std::atomic<int> g_state_dstage{2};        // set_deltanet_state_dstage
std::atomic<bool> g_wy_t2v4{false};        // set_deltanet_wy_t2v4 (not yet measured)
std::atomic<bool> g_fixed_k{true};  // set_deltanet_fixed_k
}  // namespace
bool set_deltanet_fixed_k(bool on) { return g_fixed_k.exchange(on); }
bool deltanet_fixed_k(const DeltanetParams& p) { return g_fixed_k.load(std::memory_order_relaxed) && p.K == 128; }
int set_deltanet_wy_vbufs(int n) { return g_wy_vbufs.exchange(n == 1 || n == 2 ? n : 0); }
int set_deltanet_state_tile(int cols) { return g_state_tile.exchange(cols == 32 || cols == 64 ? cols : 0); }
int deltanet_state_tile_forced() { return g_state_tile.load(); }
bool set_deltanet_state_two_sync(bool on) { return g_state_two_sync.exchange(on); }
bool set_deltanet_state_ws(bool on) { return g_state_ws.exchange(on); }
int set_deltanet_state_ws_warps(int n) { return g_state_ws_warps.exchange(n == 1 ? 1 : 2); }
bool set_deltanet_wy_stage(bool on) { return g_wy_stage.exchange(on); }
bool set_deltanet_out_vfast(bool on) { return g_out_vfast.exchange(on); }
bool set_deltanet_out_stage(bool on) { return g_out_stage.exchange(on); }
int set_deltanet_state_dstage(int mode) { return g_state_dstage.exchange(mode == 0 || mode == 1 ? mode : 2); }
bool set_deltanet_wy_t2v4(bool on) { return g_wy_t2v4.exchange(on); }
bool deltanet_serial_two_sync() { return g_state_two_sync.load(std::memory_order_relaxed); }
int deltanet_serial_tile(const DeltanetParams& p) {
  // Measured (H200, docs/perf/deltanet.md session 18): 32 columns take (2,8192,16,128) from 1.27 to
  // 1.11 ms forward (hi + lo) and lose 19% at (4,4096,16,128), where 64-column CTAs fill the SMs once;
  // 8 random lengths x 16 heads (256 such CTAs) gain 8% forward, 7% backward.
  const int forced = g_state_tile.load();
  const std::int64_t ctas64 = p.N * p.H * ((p.V + kT - 1) / kT);
  const std::int64_t limit = p.cu_seqlens ? 2 * std::int64_t(sm_count()) : sm_count() / 2;
  return forced ? forced : ctas64 <= limit ? 32 : 64;
}

bool deltanet_chunk_tc_applies(const DeltanetParams& p) {
  return p.q.dtype == DType::bf16 && p.k.dtype == DType::bf16 && p.v.dtype == DType::bf16 && p.K >= 1 &&
         p.K <= kMaxK;
}

void deltanet_chunk_tc_states(const DeltanetParams& p, const DnChunkBufs& w, Stream stream, int phases) {
  const std::int64_t seqs = p.N * p.H, vt = (p.V + kT - 1) / kT, slots = deltanet_slots(p);
  if (seqs == 0) return;
  if (seqs > 0x7fffffff || vt > 65535 || p.H > 65535 || slots > 0x7fffffff)
    throw Error(cat("deltanet (tensor cores): grid too large (", seqs, " sequence-heads, ", slots, " chunks)"));
  const auto st = reinterpret_cast<cudaStream_t>(stream);
  // the callers ask for X as bf16 only where deltanet_bwd_x_bf16 holds (the D' store path, without D's
  // scale), for Xu as bf16 only where deltanet_xu_bf16 does (checked before any launch)
  if (w.xbf16 && !(deltanet_bwd_x_bf16(p) && !w.dprime))
    throw Error("deltanet (tensor cores): X as bf16 asked for where it does not apply (internal)");
  if (w.xu16 && !(state_xu_tiles(p) && !p.hilo && p.V % 8 == 0))
    throw Error("deltanet (tensor cores): Xu as bf16 asked for where it does not apply (internal)");
  if (slots > 0 && (phases & 1)) {
    auto* wy = p.hilo ? &deltanet_wy_kernel<true> : &deltanet_wy_kernel<false>;
    if (deltanet_fixed_k(p)) wy = p.hilo ? &deltanet_wy_kernel<true, 128> : &deltanet_wy_kernel<false, 128>;
    if (!p.hilo && (p.K % 8 == 0 || w.xu16) && g_wy_stage.load(std::memory_order_relaxed))  // Xw, Xu staged (bf16)
      wy = deltanet_fixed_k(p) ? &deltanet_wy_kernel<false, 128, true> : &deltanet_wy_kernel<false, 0, true>;
    if (p.hilo && w.T2 && g_wy_t2v4.load(std::memory_order_relaxed))  // the fp32 T2 rows as 16-byte stores
      wy = deltanet_fixed_k(p) ? &deltanet_wy_kernel<true, 128, true> : &deltanet_wy_kernel<true, 0, true>;
    // two v buffers unless the second costs a resident CTA per SM (or does not fit)
    const auto wy_fn = reinterpret_cast<const void*>(wy);
    const WyLayout l1(p.K, p.hilo, 1), l2(p.K, p.hilo, 2);
    int nvb = g_wy_vbufs.load();
    if (nvb == 0)
      nvb = l2.bytes <= smem_per_block_optin() &&
                    resident_ctas_per_sm(wy_fn, kThreads, l2.bytes) >= resident_ctas_per_sm(wy_fn, kThreads, l1.bytes)
                ? 2
                : 1;
    if (nvb == 2 && l2.bytes > smem_per_block_optin()) nvb = 1;  // forced 2 where it does not fit
    const std::size_t bytes = nvb == 2 ? l2.bytes : l1.bytes;
    prepare(wy, bytes);
    wy<<<dim3(unsigned(slots), unsigned(p.H)), kThreads, bytes, st>>>(p, w, rows16_seq(p.k), rows16_seq(p.v), nvb);
    FW_CUDA_CHECK_LAUNCH("deltanet (wy)");
  }
  if (!(phases & 2)) return;
  const bool pxu = state_xu_tiles(p);
  const int tw = w.tile ? w.tile : deltanet_serial_tile(p);
  const bool two = deltanet_serial_two_sync();
  const bool vk = rows16_seq(p.k), vx = p.K % 8 == 0;
  using StateFn = void (*)(const DeltanetParams, const DnChunkBufs, bool, bool, bool, bool, bool);
  // [FK = 128][TW = 32][LO]
  static constexpr StateFn kStates[2][2][2] = {
      {{&deltanet_state_kernel<false, 64>, &deltanet_state_kernel<true, 64>},
       {&deltanet_state_kernel<false, 32>, &deltanet_state_kernel<true, 32>}},
      {{&deltanet_state_kernel<false, 64, 128>, &deltanet_state_kernel<true, 64, 128>},
       {&deltanet_state_kernel<false, 32, 128>, &deltanet_state_kernel<true, 32, 128>}}};
  // The warp-specialised form, 32-column tiles only: with a ninth warp a scheduler holds three, so ptxas
  // caps the registers at 168 per thread, and the 64-column tiles (186-196 without it) spilled; bf16
  // operands only (hi + lo's four operand buffers do not fit). [producer warps - 1][FK = 128]
  static constexpr StateFn kWsStates[2][2] = {
      {&deltanet_state_kernel<false, 32, 0, true, 1>, &deltanet_state_kernel<false, 32, 128, true, 1>},
      {&deltanet_state_kernel<false, 32, 0, true, 2>, &deltanet_state_kernel<false, 32, 128, true, 2>}};
  const int fk = deltanet_fixed_k(p), lo = p.hilo, np = g_state_ws_warps.load(std::memory_order_relaxed);
  const StateFn wsfn = tw == 32 && !lo ? kWsStates[np - 1][fk] : nullptr;
  // where its producer's paths hold: cp.async rows (k, Xw), the Xu tiles with whole 16-byte S pieces,
  // two barriers (the tests' three-barrier run compares bits with it), a binary for sm_90. The forward
  // (w.dprime: its request), and the backward's recompute where it asks (w.state_ws: not beside the
  // state pass's kernels, where at (1,32768,16,128) it measured 4.461 -> 4.606 ms, H100, session 24).
  const StLayout lws(p.K, p.hilo, pxu, tw, true);
  const bool ws = wsfn && (w.dprime || w.state_ws) && g_state_ws.load(std::memory_order_relaxed) && two && vk && vx && pxu &&
                  p.V % 8 == 0 &&
                  lws.bytes <= smem_per_block_optin() && kernel_binary_version(reinterpret_cast<const void*>(wsfn)) >= 90;
  StateFn state = ws ? wsfn : kStates[fk][tw == 32][lo];
  // DST: the D' (forward) or X (recompute) rows through shared memory (K = 128 instances: the benchmark
  // shapes'; 2 producers with WS), where the kernel writes D' or bf16 X (dp) in whole 16-byte pieces
  const bool dp = deltanet_dprime(p, w) || w.xbf16;
  const std::int64_t vtw = (p.V + tw - 1) / tw;
  const int dmode = g_state_dstage.load(std::memory_order_relaxed);
  const bool dst = (dmode == 1 || (dmode == 2 && 4 * seqs * vtw >= 3 * std::int64_t(sm_count()))) && dp && !lo && fk &&
                   pxu && p.V % 8 == 0 &&
                   (!ws || np == 2) && StLayout(p.K, false, pxu, tw, ws, w.xbf16).bytes <= smem_per_block_optin();
  if (dst)
    state = ws ? &deltanet_state_kernel<false, 32, 128, true, 2, true>
               : tw == 32 ? &deltanet_state_kernel<false, 32, 128, false, 1, true>
                          : &deltanet_state_kernel<false, 64, 128, false, 1, true>;
  const StLayout ls(p.K, p.hilo, pxu, tw, ws, dst && w.xbf16);
  const int threads = ws ? kStThreads + 32 * np : kStThreads;
  if (vtw > 65535) throw Error(cat("deltanet (tensor cores): grid too large (", vtw, " V tiles)"));
  (void)resident_ctas_per_sm(reinterpret_cast<const void*>(state), threads, ls.bytes);
  state<<<dim3(unsigned(seqs), unsigned(vtw)), threads, ls.bytes, st>>>(p, w, vk, vx, pxu, dp, two);
  FW_CUDA_CHECK_LAUNCH("deltanet (state)");
}

void deltanet_chunk_tc_output(const DeltanetParams& p, const DnChunkBufs& w, Stream stream) {
  const std::int64_t vt = (p.V + kT - 1) / kT, slots = deltanet_slots(p);
  if (slots == 0 || p.N * p.H == 0) return;
  const bool dp = deltanet_dprime(p, w);
  const OutLayout lo(p.K, p.hilo, dp);
  auto* out = p.hilo ? &deltanet_out_kernel<true> : &deltanet_out_kernel<false>;
  if (deltanet_fixed_k(p)) out = p.hilo ? &deltanet_out_kernel<true, 128> : &deltanet_out_kernel<false, 128>;
  // o staged (bf16 o, 16-byte aligned rows, V % 8 == 0)
  const bool stg = g_out_stage.load(std::memory_order_relaxed) && p.o.dtype == DType::bf16 &&
                   reinterpret_cast<std::uintptr_t>(p.o.p) % 16 == 0 && p.o.s0 % 8 == 0 && p.o.s1 % 8 == 0 &&
                   p.o.s2 % 8 == 0 && p.V % 8 == 0;
  if (stg) {
    if (deltanet_fixed_k(p)) out = p.hilo ? &deltanet_out_kernel<true, 128, true> : &deltanet_out_kernel<false, 128, true>;
    else out = p.hilo ? &deltanet_out_kernel<true, 0, true> : &deltanet_out_kernel<false, 0, true>;
  }
  prepare(out, lo.bytes);
  const bool vfast = g_out_vfast.load(std::memory_order_relaxed) && vt > 1 && slots * vt <= 0x7fffffff;
  const dim3 grid = vfast ? dim3(unsigned(slots * vt), unsigned(p.H), 1u) : dim3(unsigned(slots), unsigned(p.H), unsigned(vt));
  out<<<grid, kThreads, lo.bytes, reinterpret_cast<cudaStream_t>(stream)>>>(p, w, rows16_seq(p.q), rows16_seq(p.k), dp,
                                                                           vfast ? int(vt) : 0);
  FW_CUDA_CHECK_LAUNCH("deltanet (output)");
}

}  // namespace fastweight::detail
