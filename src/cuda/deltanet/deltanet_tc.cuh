// deltanet_tc.cuh: what the DeltaNet tensor-core kernels (deltanet_fwd_tc.cu, deltanet_chunk_tc.cu,
// deltanet_bwd_tc.cu) share: warp-level mma.sync products over 64-column tiles, fragment coordinates,
// the bf16 hi + lo split, the state slice in registers (load, store, rank-64 update), the chunk
// output, state tiles to and from the workspace, the blocked inverse of a unit-lower 64 x 64 matrix,
// the alignment test of cp.async rows.
#pragma once

#include <cstdint>

#include "common/mlstm_params.h"  // StridedView
#include "cuda/common/mma.cuh"
#include "cuda/deltanet/deltanet_common.cuh"  // dn_row; mlstm_ld / mlstm_st
#include "cuda/mlstm/mlstm_tc.cuh"

namespace fastweight::detail::dtc {

using namespace mtc;

// Stores x as bf16 hi + lo at (r, c) of two tiles
__device__ __forceinline__ void put_split(bf16* hi, bf16* lo, int ld, int r, int c, float x) {
  const bf16 h = __float2bfloat16_rn(x);
  hi[r * ld + c] = h;
  lo[r * ld + c] = __float2bfloat16_rn(x - __bfloat162float(h));
}
// x[0..3] (an accumulator's column tile j, as pack_a_frags takes it) as bf16 hi + lo A fragments
__device__ __forceinline__ void pack_a_frags_split(std::uint32_t (&hi)[4][4], std::uint32_t (&lo)[4][4], int j,
                                                   const float (&x)[4]) {
  float xh[4], xl[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    xh[e] = __bfloat162float(__float2bfloat16_rn(x[e]));
    xl[e] = x[e] - xh[e];
  }
  pack_a_frags(hi, j, xh);
  pack_a_frags(lo, j, xl);
}
// Columns c, c + 1 (c even, ld even: 4-byte aligned) at once: one packed conversion and one 4-byte
// store each for hi and lo, the same roundings as two put_split calls. LO = false: hi only.
template <bool LO = true>
__device__ __forceinline__ void put_split2(bf16* hi, bf16* lo, int ld, int r, int c, float x0, float x1) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
  *reinterpret_cast<__nv_bfloat162*>(hi + r * ld + c) = h;
  if constexpr (LO) {
    const float2 hf = __bfloat1622float2(h);
    *reinterpret_cast<__nv_bfloat162*>(lo + r * ld + c) = __floats2bfloat162_rn(x0 - hf.x, x1 - hf.y);
  }
}
template <bool LO>
__device__ __forceinline__ void put_split1(bf16* hi, bf16* lo, int ld, int r, int c, float x) {
  if constexpr (LO) put_split(hi, lo, ld, r, c, x);
  else hi[r * ld + c] = __float2bfloat16_rn(x);
}

// acc += A B with A, B as bf16 hi + lo tiles: Ah Bh + Ah Bl + Al Bh (the lo x lo term is ~2^-18
// relative: dropped); LO = false: Ah Bh alone (Al, Bl unused). B k-major (BK: mma_rk) or n-major (mma_rn).
template <bool LO, bool BK, int J>
__device__ __forceinline__ void mma_split(float (&acc)[J][4], const bf16* Ah, const bf16* Al, int lda, int mrow,
                                          const bf16* Bh, const bf16* Bl, int ldb, int kdim, int lane) {
  auto mma = [&](const bf16* A, const bf16* B) {
    if constexpr (BK) mma_rk(acc, A, lda, mrow, B, ldb, kdim, lane);
    else mma_rn(acc, A, lda, mrow, B, ldb, kdim, lane);
  };
  mma(Ah, Bh);
  if constexpr (LO) {
    mma(Ah, Bl);
    mma(Al, Bh);
  }
}

// The state slice S (Kc rows x 8 NJ columns: 64, or 32 for the state kernel's narrow tiles) in fp32
// registers of NW warps (4 or 8): warp w owns the 16-row groups w + NW gg (Kc <= 128: groups w and
// w + 4, or group w), acc[gg][j][e] at row 16 (w + NW gg) + frow, column fcol. Loaded from (N, H, K, V)
// view st at (n, h, rows, columns c0..) (zero where absent or outside K, V); stored likewise.
template <int NW = 4, int NJ = 8>
__device__ __forceinline__ void state_load(float (&acc)[8 / NW][NJ][4], const StridedView& st, std::int64_t n,
                                           std::int64_t h, std::int64_t c0, std::int64_t K, std::int64_t V, int warp,
                                           int lane) {
#pragma unroll
  for (int gg = 0; gg < 8 / NW; ++gg)
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const std::int64_t r = 16 * (warp + NW * gg) + frow(lane, e), c = c0 + fcol(lane, j, e);
        acc[gg][j][e] = st.p && r < K && c < V ? mlstm_ld(st, n * st.s0 + h * st.s1 + r * st.s2 + c) : 0.f;
      }
}
template <int NW = 4, int NJ = 8>
__device__ __forceinline__ void state_store(const float (&acc)[8 / NW][NJ][4], const StridedView& st, std::int64_t n,
                                            std::int64_t h, std::int64_t c0, std::int64_t K, std::int64_t V, int warp,
                                            int lane) {
#pragma unroll
  for (int gg = 0; gg < 8 / NW; ++gg)
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const std::int64_t r = 16 * (warp + NW * gg) + frow(lane, e), c = c0 + fcol(lane, j, e);
        if (r < K && c < V) mlstm_st(st, n * st.s0 + h * st.s1 + r * st.s2 + c, acc[gg][j][e]);
      }
}

// The state slice as bf16 hi + lo (LO; else hi only) into smem (Kc x 8 NJ, stride 8 NJ + 8): the B operand
// of products with S. Column pairs (e, e + 1) per 4-byte store.
template <int NW = 4, bool LO = true, int NJ = 8>
__device__ __forceinline__ void state_split(const float (&acc)[8 / NW][NJ][4], bf16* sSh, bf16* sSl, int ngroups,
                                            int warp, int lane) {
  constexpr int LD = 8 * NJ + 8;  // the tile's stride: kLd at 64 columns
#pragma unroll
  for (int gg = 0; gg < 8 / NW; ++gg) {
    const int g = warp + NW * gg;
    if (g >= ngroups) continue;
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 4; e += 2)
        put_split2<LO>(sSh, sSl, LD, 16 * g + frow(lane, e), fcol(lane, j, e), acc[gg][j][e], acc[gg][j][e + 1]);
  }
}

// The (K, V) bf16 state matrix of (chunk slot, head h) in a region of such matrices (DnChunkBufs::S,
// DnBwdWs::dS): hi, then (LO) lo at + K V.
template <bool LO>
__device__ __forceinline__ bf16* state_mats(float* region, std::int64_t slot, std::int64_t H, std::int64_t h,
                                            std::int64_t K, std::int64_t V) {
  return reinterpret_cast<bf16*>(region) + (slot * H + h) * (LO ? 2 : 1) * K * V;
}

// The L2 factor 1 / sqrt(|x|^2 + 1e-6) of row r of a bf16 tile (Kc columns, zero padded), as the
// forward computes it from the rounded row (1 without the L2 norm).
// Kc and ld are multiples of 8 and the tiles 16-byte aligned (every caller's layout): 8 columns per
// 16-byte load, still summed in column order (the same bits as a column at a time, which was a
// chain of 2-byte loads: ~26% of the output kernel's stall samples).
__device__ __forceinline__ float row_l2_factor(const bf16* s, int ld, int Kc, int r, bool l2) {
  if (!l2) return 1.f;
  float ss = 0.f;
  const uint4* row = reinterpret_cast<const uint4*>(s + r * ld);
  for (int x = 0; x < Kc / 8; ++x) {
    const uint4 u = row[x];
    const std::uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[i]));
      ss = fmaf(f.x, f.x, ss);
      ss = fmaf(f.y, f.y, ss);
    }
  }
  return rsqrtf(ss + 1e-6f);
}

// One k-step (16 chunk rows) of state_update below: row group g of S into acc[gg].
template <bool LO, int NJ, int NG>
__device__ __forceinline__ void state_update_step(float (&acc)[NG][NJ][4], int gg, int g, const bf16* sk, int ldk,
                                                  const bf16* sUh, const bf16* sUl, int ks, int lane) {
  constexpr int LD = 8 * NJ + 8;  // U's stride: kLd at 64 columns
  std::uint32_t a[4];
  ldsm_x4_t(a, sk + (ks * 16 + ld_row_a_kmajor(lane)) * ldk + 16 * g + ld_col_a_kmajor(lane));
#pragma unroll
  for (int jj = 0; jj < NJ / 2; ++jj) {
    std::uint32_t bh[4];
    ldsm_x4_t(bh, sUh + (ks * 16 + ld_row_b_kmajor(lane)) * LD + 16 * jj + ld_col_b_kmajor(lane));
    mma_bf16_16816(acc[gg][2 * jj], a, bh[0], bh[1]);
    mma_bf16_16816(acc[gg][2 * jj + 1], a, bh[2], bh[3]);
    if constexpr (LO) {
      std::uint32_t bl[4];
      ldsm_x4_t(bl, sUl + (ks * 16 + ld_row_b_kmajor(lane)) * LD + 16 * jj + ld_col_b_kmajor(lane));
      mma_bf16_16816(acc[gg][2 * jj], a, bl[0], bl[1]);
      mma_bf16_16816(acc[gg][2 * jj + 1], a, bl[2], bl[3]);
    }
  }
}

// The same with the A fragments of the four k-steps already in registers (a[ks]: state_update_step's
// ldmatrix of them, read early by the WS kernels): acc (16 rows x 8 NJ) += A U, U's stride 8 NJ + 8.
template <int NJ>
__device__ __forceinline__ void state_update_regs(float (&acc)[NJ][4], const std::uint32_t (&a)[4][4], const bf16* sU,
                                                  int lane) {
  constexpr int LD = 8 * NJ + 8;
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
#pragma unroll
    for (int jj = 0; jj < NJ / 2; ++jj) {
      std::uint32_t bh[4];
      ldsm_x4_t(bh, sU + (ks * 16 + ld_row_b_kmajor(lane)) * LD + 16 * jj + ld_col_b_kmajor(lane));
      mma_bf16_16816(acc[2 * jj], a[ks], bh[0], bh[1]);
      mma_bf16_16816(acc[2 * jj + 1], a[ks], bh[2], bh[3]);
    }
}

// S += K^T U: A = K^T read k-major from the chunk's k tile (64 rows, stride ldk), B = U (64 x 8 NJ) as
// bf16 hi + lo (stride 8 NJ + 8; LO = false: the hi part only, sUl unused); ngroups = Kc / 16 row groups of S.
template <int NW = 4, bool LO = true, int NJ = 8>
__device__ __forceinline__ void state_update(float (&acc)[8 / NW][NJ][4], const bf16* sk, int ldk, const bf16* sUh,
                                             const bf16* sUl, int ngroups, int warp, int lane) {
#pragma unroll
  for (int gg = 0; gg < 8 / NW; ++gg) {
    const int g = warp + NW * gg;
    if (g >= ngroups) continue;
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) state_update_step<LO, NJ>(acc, gg, g, sk, ldk, sUh, sUl, ks, lane);
  }
}

// The chunk's output rows of this warp before scale and rq: o = Q S + tril(Q K^T) diag(rk) D with Q,
// K the bf16 tiles (64 rows, Kc columns, stride ldk), S as hi + lo (Kc x 64; LO = false: hi only),
// D bf16 (64 x 64); s_rk null: rk already in D. In two steps, so that a caller can form P while S and
// D are still loading: chunk_output_p (needs Q and K), then chunk_output_o.
// P = tril(Q K^T) diag(rk), this warp's 16 rows, as A fragments.
__device__ __forceinline__ void chunk_output_p(std::uint32_t (&pf)[4][4], const bf16* sq, const bf16* sk, int ldk,
                                               int Kc, const float* s_rk, int warp, int lane) {
  float pk[8][4] = {};
  mma_rn(pk, sq, ldk, warp, sk, ldk, Kc, lane);  // Q K^T
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    float x[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = 16 * warp + frow(lane, e), c = fcol(lane, j, e);
      x[e] = c <= i ? (s_rk ? s_rk[c] * pk[j][e] : pk[j][e]) : 0.f;
    }
    mtc::pack_a_frags(pf, j, x);
  }
}
// o = Q S + P D (the same order of sums as chunk_output).
template <bool LO = true>
__device__ __forceinline__ void chunk_output_o(float (&o)[8][4], const std::uint32_t (&pf)[4][4], const bf16* sq,
                                               int ldk, int Kc, const bf16* sSh, const bf16* sSl, const bf16* sD,
                                               int warp, int lane) {
  mma_rk(o, sq, ldk, warp, sSh, kLd, Kc, lane);
  if constexpr (LO) mma_rk(o, sq, ldk, warp, sSl, kLd, Kc, lane);
  mtc::mma_frags_k(o, pf, sD, kLd, 0, lane);
}
template <bool LO = true>
__device__ __forceinline__ void chunk_output(float (&o)[8][4], const bf16* sq, const bf16* sk, int ldk, int Kc,
                                             const bf16* sSh, const bf16* sSl, const bf16* sD, const float* s_rk,
                                             int warp, int lane) {
  std::uint32_t pf[4][4];
  chunk_output_p(pf, sq, sk, ldk, Kc, s_rk, warp, lane);
  chunk_output_o<LO>(o, pf, sq, ldk, Kc, sSh, sSl, sD, warp, lane);
}

// S (Kc x TW tile, TW = 64 or 32 columns, stride TW + 8, bf16 hi + lo in smem) -> the workspace's (K, V) hi then lo
// matrices at gh, columns c0.. (LO = false: the hi matrix alone), element by element: the path for
// V % 8 != 0 (StateStoreUnits stores 16-byte pieces otherwise). All nthreads threads of the CTA.
template <bool LO = true, int TW = 64>
__device__ __forceinline__ void store_state_split(bf16* gh, const bf16* sSh, const bf16* sSl, std::int64_t K,
                                                  std::int64_t V, std::int64_t c0, int nthreads = kTcThreads) {
  bf16* gl = gh + K * V;
  const int nc = int(lmin(TW, V - c0));
  constexpr int LD = TW + 8;  // the tile's stride (kLd at 64)
  for (int e = threadIdx.x; e < K * TW; e += nthreads) {
    const int r = e / TW, c = e % TW;
    if (c >= nc) continue;
    gh[r * V + c0 + c] = sSh[r * LD + c];
    if constexpr (LO) gl[r * V + c0 + c] = sSl[r * LD + c];
  }
}

// S / dSe to the workspace from a serial kernel's chunk loop with this thread's 16-byte pieces fixed
// per CTA (column piece c of rows r0, r0 + dr, ... < K; V % 8 == 0): a load and a store per piece a step.
template <bool LO = true, int TW = 64>
struct StateStoreUnits {
  int n = 0;                     // pieces of this thread (0: none, or V % 8 != 0: store_state_split)
  std::int64_t g0 = 0, gs = 0;   // elements from a (K, V) matrix: the first piece; between pieces
  int s0 = 0, ss = 0;            // elements from the smem tile (stride TW + 8): the first piece; between
  bool vec = false;
  // t: this thread's index among the nthreads that store (a warp-specialised kernel's producer lanes)
  __device__ __forceinline__ StateStoreUnits(std::int64_t K, std::int64_t V, std::int64_t c0, int nthreads,
                                             int t = int(threadIdx.x)) {
    constexpr int P = TW / 8, LD = TW + 8;
    vec = V % 8 == 0;
    const int c = (t % P) * 8, r0 = t / P, dr = nthreads / P;
    if (!vec || c >= lmin(TW, V - c0) || r0 >= K) return;
    n = int((K - r0 + dr - 1) / dr), g0 = r0 * V + c0 + c, gs = dr * V, s0 = r0 * LD + c, ss = dr * LD;
  }
  __device__ __forceinline__ void store(bf16* gh, const bf16* sSh, const bf16* sSl, std::int64_t K, std::int64_t V,
                                        std::int64_t c0, int nthreads) const {
    if (!vec) return store_state_split<LO, TW>(gh, sSh, sSl, K, V, c0, nthreads);
    bf16* gl = gh + K * V;
#pragma unroll 2
    for (int q = 0; q < n; ++q) {
      *reinterpret_cast<uint4*>(gh + g0 + q * gs) = *reinterpret_cast<const uint4*>(sSh + s0 + q * ss);
      if constexpr (LO) *reinterpret_cast<uint4*>(gl + g0 + q * gs) = *reinterpret_cast<const uint4*>(sSl + s0 + q * ss);
    }
  }
};

// Columns c, c + 1 of an fp32 row (c even): one 8-byte access when the row length is even (aligned).
__device__ __forceinline__ void store_pair(float* at, float x0, float x1, bool has1, bool even) {
  if (even) {
    *reinterpret_cast<float2*>(at) = make_float2(x0, x1);
  } else {
    at[0] = x0;
    if (has1) at[1] = x1;
  }
}
__device__ __forceinline__ float2 load_pair(const float* at, bool has1, bool even) {
  if (even) return *reinterpret_cast<const float2*>(at);
  return make_float2(at[0], has1 ? at[1] : 0.f);
}

// K columns in smem: K rounded up to 64 (whole 64-column tiles for the products), stride + 8.
__host__ __device__ inline int k_cols(std::int64_t K) { return int(round_up(K, 64)); }

__device__ __forceinline__ const bf16* bf_rows(const StridedView& t, std::int64_t b, std::int64_t t0, std::int64_t h) {
  return static_cast<const bf16*>(t.p) + dn_row(t, b, t0, h);
}

// T = (I + L)^-1 for a strictly lower L (64 x 64, fp32 smem, written and synced by the caller), in
// fp32: the diagonal 16 x 16 blocks by forward substitution (warp w: block w, lanes 0-15 one column
// each), then block rows 1..3, T_ij = -T_ii sum_{k=j}^{i-1} L_ik T_kj (warp j). Every thread of the
// CTA (4 warps) calls it; T is complete and synced on return. scr: 4 x 16 x 16 scratch.
__device__ __forceinline__ void unit_lower_inverse(const float (*sL)[65], float (*sT)[65], float (*scr)[16][17],
                                                   int warp, int lane) {
  {
    // column col of the diagonal block's inverse in registers (t[c] was read back from sT before: a
    // chain of 120 dependent shared-memory round trips; the same fmaf sequence, so the same bits)
    const int bo = 16 * warp, col = lane & 15;
    float t[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      float x = r == col ? 1.f : 0.f;
#pragma unroll
      for (int c = 0; c < r; ++c) x = fmaf(-sL[bo + r][bo + c], t[c], x);
      t[r] = x;
    }
    if (lane < 16)
#pragma unroll
      for (int r = 0; r < 16; ++r) sT[bo + r][bo + col] = t[r];
    // blocks above the diagonal are zero
    for (int e = lane; e < 16 * 64; e += 32) {
      const int r = e / 64, c = e % 64;
      if (c >= bo + 16) sT[bo + r][c] = 0.f;
    }
  }
  __syncthreads();
  for (int bi = 1; bi < 4; ++bi) {
    const int bj = warp;
    if (bj < bi) {
      // scr = sum_{k=bj}^{bi-1} L_{bi,k} T_{k,bj} (16 x 16), 8 elements per lane: rows lane / 16 +
      // 2 u of column lane % 16, 8 independent chains; the T (scr) element of a step is the same for
      // the 8, loaded once (9 shared loads per 8 FMAs instead of 16; the same fmaf order per element)
      const int r0 = lane / 16, c = lane % 16;
      float x[8] = {};
      for (int kk = 16 * bj; kk < 16 * bi; ++kk) {
        const float tv = sT[kk][16 * bj + c];
#pragma unroll
        for (int u = 0; u < 8; ++u) x[u] = fmaf(sL[16 * bi + r0 + 2 * u][kk], tv, x[u]);
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) scr[warp][r0 + 2 * u][c] = x[u];
      __syncwarp();
#pragma unroll
      for (int u = 0; u < 8; ++u) x[u] = 0.f;
#pragma unroll
      for (int kk = 0; kk < 16; ++kk) {
        const float sv = scr[warp][kk][c];
#pragma unroll
        for (int u = 0; u < 8; ++u) x[u] = fmaf(sT[16 * bi + r0 + 2 * u][16 * bi + kk], sv, x[u]);
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) sT[16 * bi + r0 + 2 * u][16 * bj + c] = -x[u];
      __syncwarp();
    }
    __syncthreads();
  }
}

// ---- warp specialisation (the serial kernels' WS forms, sm_90) -------------------------------------
// The synchronisation, no-ops where the architecture has no mbarrier waits (the hosts launch the WS
// forms only for a binary of sm_90 or later: kernel_binary_version).
__device__ __forceinline__ void ws_wait(std::uint64_t* bar, unsigned parity) {
#if defined(FW_HAS_BULK)
  mbar_wait(bar, parity);
#endif
}
__device__ __forceinline__ void ws_arrive(std::uint64_t* bar) {
#if defined(FW_HAS_BULK)
  mbar_arrive(bar);
#endif
}
// The consumer warps among themselves (hardware barrier 1)
__device__ __forceinline__ void ws_named_sync(int threads) {
#if defined(FW_HAS_BULK)
  named_barrier(1, threads);
#endif
}
// 16- and 4-byte copies to a shared address; src_bytes 0 zero-fills (src not read)
__device__ __forceinline__ void cp_async16_sz(std::uint32_t s, const void* g, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(g), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async4_z(void* s, const void* g, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(s)), "l"(g), "r"(src_bytes));
}
// A chunk's (64, C) bf16 tile by one warp (a producer's): lane's 16-byte unit u = lane % (C / 8) of
// rows lane / (C / 8) + (256 / C) q, running pointers; rows past nr and columns past nc zero. C in
// {32, 64, 128}; nc % 8 == 0 and 16-byte aligned rows (the callers check).
__device__ __forceinline__ void warp_load_tile(bf16* dst, int ld, const bf16* src, std::int64_t rs, int C, int nr, int nc,
                                               int lane) {
  const int U = C / 8, dr = 32 / U, u = lane % U, r0 = lane / U;
  const bool col = 8 * u < nc;
  std::uint32_t d = smem_u32(dst) + std::uint32_t(2 * (r0 * ld + 8 * u));
  const std::uint32_t ds = std::uint32_t(2 * dr * ld);
  const bf16* g = src + r0 * rs + 8 * u;
  const std::int64_t gs = dr * rs;
  if (col && nr >= kT) {  // a whole chunk (all but a sequence's last): no predicates
    for (int r = r0; r < kT; r += dr, d += ds, g += gs) cp_async16_s(d, g);
  } else {
    for (int r = r0; r < kT; r += dr, d += ds, g += gs) {
      const int by = col && r < nr ? 16 : 0;
      cp_async16_sz(d, by ? g : src, by);
    }
  }
}

// A warp's (16, 64) fp32 accumulator tile (mma fragments: row frow, column fcol) stored as bf16 rows
// through the warp's own staging rows stg (16 x kLd bf16; stride 72: the pair writes hit 32 banks):
// 16-byte pieces, 8 lanes a row's 128 bytes, where the fragments' pair stores write 16 bytes of a row
// per 4 lanes. row_dst(r) is row r's destination (16-byte aligned; nullptr: not stored); columns < n
// (n % 8 == 0 or n >= 64). Whole warp; the caller keeps other threads off stg.
template <class RowDst>
__device__ __forceinline__ void warp_store_rows_staged(bf16* stg, const float (&acc)[8][4], int lane, std::int64_t n,
                                                       RowDst row_dst) {
  __syncwarp();  // this warp's reads of the previous tile are done
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; e += 2)
      *reinterpret_cast<__nv_bfloat162*>(stg + frow(lane, e) * kLd + fcol(lane, j, e)) =
          __floats2bfloat162_rn(acc[j][e], acc[j][e + 1]);
  __syncwarp();
#pragma unroll
  for (int q = 0; q < 4; ++q) {  // piece lane + 32 q: row lane / 8 + 4 q, columns 8 (lane % 8) ..
    const int r = lane / 8 + 4 * q, c = 8 * (lane % 8);
    bf16* d = row_dst(r);
    if (d && c < n) *reinterpret_cast<uint4*>(d + c) = *reinterpret_cast<const uint4*>(stg + r * kLd + c);
  }
}

// As warp_load_tile, into wgmma's 128-byte-swizzled layout (cuda/common/wgmma.cuh): a (64, C) bf16 tile,
// C in {64, 128}, as C / 64 blocks of 64 rows x 128 bytes, 8 KB apart; dst 1024-byte aligned.
__device__ __forceinline__ void warp_load_tile_sw128(bf16* dst, const bf16* src, std::int64_t rs, int C, int nr, int nc,
                                                     int lane) {
  const int U = C / 8, dr = 32 / U, u = lane % U, r0 = lane / U, c = u & 7;
  const bool col = 8 * u < nc;
  const std::uint32_t d0 = smem_u32(dst) + std::uint32_t((u >> 3) * 8192);
  const bf16* g = src + r0 * rs + 8 * u;
  const std::int64_t gs = dr * rs;
  for (int r = r0; r < kT; r += dr, g += gs) {
    const int by = col && r < nr ? 16 : 0;
    cp_async16_sz(d0 + std::uint32_t(r * 128 + ((c ^ (r & 7)) << 4)), by ? g : src, by);
  }
}

// warp_load_tile_sw128 with C a constant and whole chunks unrolled (the rs kernel's loaders, switch
// `set_deltanet_bwd_serial_rs_lfast`): a lane's rows r0 + dr i keep the swizzle of row r0 + dr (i % P)
// and move 1024 bytes every P rows (dr P = 8), so each copy is one cp.async at a constant offset from
// one of P addresses, and a 64-bit step of the source. The rolled loop spent ~12 instructions a copy
// on predicates, the swizzle and two selects (session 30's profile: the loader of k and Q^ issued
// ~1400 instructions a chunk step, a third of the step's cycles).
template <int C>
__device__ __forceinline__ void warp_load_tile_sw128_unrolled(bf16* dst, const bf16* src, std::int64_t rs, int nr, int nc,
                                                              int lane) {
  static_assert(C == 64 || C == 128, "C in {64, 128}");
  constexpr int U = C / 8, dr = 32 / U, P = 8 / dr;  // lanes a row, rows a pass, passes to repeat the swizzle
  const int u = lane % U, r0 = lane / U, c = u & 7;
  if (!(8 * u < nc && nr >= kT)) {  // a sequence's last chunk, or columns past K: the predicated loop
    warp_load_tile_sw128(dst, src, rs, C, nr, nc, lane);
    return;
  }
  const std::uint32_t d0 = smem_u32(dst) + std::uint32_t((u >> 3) * 8192);
  std::uint32_t dj[P];  // row r0 + dr j: its 128-byte row, its swizzled 16-byte piece
#pragma unroll
  for (int j = 0; j < P; ++j) {
    const int r = r0 + dr * j;
    dj[j] = d0 + std::uint32_t(r * 128 + ((c ^ (r & 7)) << 4));
  }
  const bf16* g = src + r0 * rs + 8 * u;
  const std::int64_t gs = dr * rs;
#pragma unroll
  for (int i = 0; i < kT / dr; ++i, g += gs) cp_async16_s(dj[i % P] + 1024u * std::uint32_t(i / P), g);
}

// (B, T, H, D) rows 16-byte aligned at every (b, t, h): cp.async applies.
inline bool rows16_seq(const StridedView& t) {
  return reinterpret_cast<std::uintptr_t>(t.p) % 16 == 0 && t.s0 % 8 == 0 && t.s1 % 8 == 0 && t.s2 % 8 == 0;
}

// dst[i][c] (64 x 64 fp32, row stride ld, a multiple of 4) = rows t0 + i (< nr) of a (B*T*H, V) fp32
// workspace region, columns c0 + c (< V); the rest zero (ZERO) or untouched (for readers that mask
// it themselves: the zero fill cost the register-bound chunk pass a spill). cp.async 16-byte pieces
// where V % 4 == 0 (the caller commits, waits and synchronises), else plain loads. Staging these tiles
// replaced per-element loads on the critical path (a third to a half of the stall samples of the
// kernels that read X, T2 this way).
template <bool ZERO, int TW = 64>  // TW: the tile's columns (64, or 32 for the serial kernels' narrow tiles)
__device__ __forceinline__ void stage_ws_rows(float* dst, int ld, const float* region, const DeltanetParams& p,
                                              std::int64_t b, std::int64_t t0, std::int64_t h, int nr, std::int64_t c0,
                                              int nthreads) {
  const std::int64_t V = p.V;
  const int ncv = int(V - c0 < TW ? V - c0 : TW);
  constexpr int P = TW / 4;  // 16-byte pieces per row
  if (V % 4 == 0) {  // ncv % 4 == 0 too: whole 16-byte pieces
    // thread: column piece c of rows i, i + nthreads / P, ... (nthreads % P == 0): one address
    // computation, then a fixed step (per-piece index and 64-bit row arithmetic were most of the
    // instructions of this loop)
    const int c = 4 * (int(threadIdx.x) % P), di = nthreads / P;
    const bool cin = c < ncv;
    int i = int(threadIdx.x) / P;
    const std::int64_t step = std::int64_t(di) * p.H * V;
    const float* src = region + dn_ws_row(p, b, t0 + i, h) * V + c0 + c;
    for (; i < 64; i += di, src += step) {
      const bool in = i < nr && cin;
      if (ZERO || in) cp_async16(dst + i * ld + c, in ? src : region, in ? 16 : 0);  // src-size 0: zero fill
    }
  } else {
    for (int e = threadIdx.x; e < 64 * TW; e += nthreads) {
      const int i = e / TW, c = e % TW;
      const bool in = i < nr && c < ncv;
      if (ZERO || in) dst[i * ld + c] = in ? region[dn_ws_row(p, b, t0 + i, h) * V + c0 + c] : 0.f;
    }
  }
}

}  // namespace fastweight::detail::dtc
