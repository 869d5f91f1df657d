// mlstm_fwd_tc.cu: the chunkwise mLSTM forward on tensor cores (bf16 IO; mma.sync m16n8k16, fp32
// accumulators), version 2 of mlstm_fwd.cu's two kernels plus a gate pass:
//   G  gates:   per (head, chunk): g_t (cumulative log forget within the chunk), a_t = i_t - g_t and
//               A_t = max(a_0..a_t), float64, to the workspace (once, instead of per CTA).
//   A  states:  per (head, 64 x 64 tile of C), serial over chunks: C <- d C + (w k)^T v on tensor
//               cores. w k is split into bf16 hi + lo parts (two products) so the fp32 chain keeps
//               ~16 bits of w k: the final states match the float64 reference to ~1e-5, not bf16's
//               2^-9. The state entering each chunk goes to the workspace as bf16 (what kernel B's
//               bf16 product reads anyway; half the bytes of fp32), n in fp32, m in float64.
//   B  outputs: per (head, chunk, 64-row block, 64-column tile of DV): inter q C_k and intra
//               (q k^T * D) v on tensor cores, P kept in registers between the two products
//               (FlashAttention-2's fragment reuse); q . n_k and the row sums in fp32.
// Math and notation as mlstm_fwd.cu / mlstm_common.cuh (M_t = max(m_k, A_t), D_ts = exp(a_s - M_t)).
// Deterministic: fixed reduction orders, no atomics. No allocation, no host sync: graph safe.
#include <algorithm>
#include <atomic>

#include "cuda/common/check.cuh"
#include "cuda/common/mma.cuh"
#include "cuda/mlstm/mlstm_common.cuh"
#include "cuda/mlstm/mlstm_cuda.h"
#include "cuda/mlstm/mlstm_tc.cuh"

namespace fastweight::detail {
namespace {

using namespace mtc;
constexpr int kThreads = kTcThreads;
constexpr int kMaxL = 256;

// Workspace (each part 256-byte aligned): C states bf16 (heads, NC+1, DQK, DVp) with DVp = DV
// rounded up to 8 (16-byte rows) | n fp32 (heads, NC+1, DQK) | m f64 (heads, NC+1) | g, a, A f64
// (heads, S) each.
struct TcWs {
  std::int64_t DVp, c, n, m, g, a, A, total;  // byte offsets
  explicit TcWs(const MlstmParams& p) {
    const std::int64_t heads = p.B * p.NH, ns = p.chunks() + 1;
    DVp = round_up(p.DV, 8);
    std::int64_t o = 0;
    auto take = [&](std::int64_t bytes) { const std::int64_t at = o; o += round_up(bytes, 256); return at; };
    c = take(heads * ns * p.DQK * DVp * 2);
    n = take(heads * ns * p.DQK * 4);
    m = take(heads * ns * 8);
    g = take(heads * p.S * 8), a = take(heads * p.S * 8), A = take(heads * p.S * 8);
    total = o;
  }
};

struct TcFlags {
  bool q, k, v, h2;  // q/k/v: 16-byte rows (cp.async); h2: bf16 pairs may be stored as 32-bit words
  bool bulk;         // the states kernel (Mode 2) stores C by WarpTileTma through its map (sm_90)
  bool units;        // the states kernel loads its chunk tiles through ChunkUnits
};

std::atomic<bool> g_bulk_store{true}, g_chunk_units{true};
std::atomic<int> g_out_tiles{0};  // set_mlstm_out_tiles
}  // namespace

bool set_mlstm_bulk_store(bool on) { return g_bulk_store.exchange(on); }
bool mlstm_bulk_store_on() { return g_bulk_store.load(std::memory_order_relaxed); }
bool set_mlstm_chunk_units(bool on) { return g_chunk_units.exchange(on); }
bool mlstm_chunk_units_on() { return g_chunk_units.load(std::memory_order_relaxed); }

namespace {
// ---- G: gate bookkeeping ---------------------------------------------------------------------------
__global__ void __launch_bounds__(256) mlstm_tc_gates_kernel(const MlstmParams p, double* __restrict__ wg,
                                                             double* __restrict__ wa, double* __restrict__ wA) {
  __shared__ double s_g[kMaxL], s_a[kMaxL], s_A[kMaxL];
  const std::int64_t bh = blockIdx.x, b = bh / p.NH, hd = bh % p.NH, t0 = std::int64_t(blockIdx.y) * p.L;
  const int n = int(lmin(p.L, p.S - t0));
  mlstm_chunk_gates(p, b, hd, t0, n, -INFINITY, s_g, s_a, s_A);  // m = -inf: A_t without the entering m
  const int t = threadIdx.x;
  if (t < n) {
    const std::int64_t o = bh * p.S + t0 + t;
    wg[o] = s_g[t], wa[o] = s_a[t], wA[o] = s_A[t];
  }
}

// ---- A: chunk states -------------------------------------------------------------------------------
// A CTA owns a 64 (DQK) x 32 (DV) tile of the state and walks the chunks; warp w its rows 16w..16w+15.
// 32 columns, not 64: the scan is a chain of short dependent steps per chunk (ncu: one warp per
// scheduler, an instruction every ~4 cycles), and 32-column tiles give twice the CTAs, two per SM, to
// hide it. One 64-step tile of a chunk per iteration, two stages: the next tile (k, v, its a_s and the
// chunk's A_{n-1}, g_{n-1}) lands by cp.async while this one is multiplied; one barrier per tile. w_s
// is formed once per warp and tile (two steps per lane) into the warp's row of w; w_s k_s in registers
// on the A fragments (no shared-memory pass); n = (w k)^T 1 is one more n-tile whose B fragment is all
// ones.
constexpr int kSc = 32;  // state columns (DV) per CTA
struct StatesSmem {
  bf16 k[2][kT][kLd];    // (2 stages) (64 steps, 64 DQK columns) k
  bf16 v[2][kT][kLd];    // (2 stages) (64 steps, first 32 of 64 columns) v
  double a[2][kT];       // (2 stages) (64 steps) a_s
  double end[2][2];      // (2 stages) the chunk's A_{n-1}, g_{n-1}
  alignas(16) float w[kThreads / 32][kT];  // (warp, 64 steps) w_s = exp(a_s - M) of the current tile
  alignas(1024) bf16 stage[kThreads / 32][WarpTileTma::kElems];  // (warp) its 16 x 32 piece of C, hi / lo
};

// Mode 0: the states go out as the output kernel reads them (C bf16 (DQK, DVp) rows, m float64);
// 1: as the backward's workspace wants them (C fp32 (DQK, DV) rows, m fp32); 2: as 1, but each C
// slot holds bf16 hi (DQK, DV) then lo = bf16(C - hi) (DQK, DV), for the tensor-core K3 q-role.
// MinB = 4: at most 128 registers (no spill), four CTAs per SM where the grid has more than two per
// SM (e.g. (4,16,4096): 512 CTAs, 1.3 waves at the ~158 registers of MinB = 2).
template <int Mode, int MinB = 2>
__global__ void __launch_bounds__(kThreads, MinB) mlstm_tc_states_kernel(const MlstmParams p, const TcFlags fl,
                                                                      const __grid_constant__ CUtensorMap cmap,
                                                                      void* __restrict__ ws_cv, float* __restrict__ ws_n,
                                                                      void* __restrict__ ws_mv,
                                                                      const double* __restrict__ wg,
                                                                      const double* __restrict__ wa,
                                                                      const double* __restrict__ wA) {
  constexpr bool F32 = Mode != 0;
  extern __shared__ float4 smem_raw[];
  StatesSmem& sm = *reinterpret_cast<StatesSmem*>(smem_raw);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, t4 = lane & 3;
  const std::int64_t bh = blockIdx.x, b = bh / p.NH, hd = bh % p.NH;
  const int r0 = blockIdx.y * kT, c0 = blockIdx.z * kSc;
  const bool with_n = blockIdx.z == 0;  // one CTA per DQK tile carries n
  const std::int64_t NC = p.chunks(), ns = NC + 1, DQK = p.DQK, DV = p.DV, DVp = round_up(DV, 8), S = p.S, L = p.L;
  const int nr = int(lmin(kT, DQK - r0)), nc = int(lmin(kSc, DV - c0));
  const bf16* kb = static_cast<const bf16*>(p.k.p) + b * p.k.s0 + hd * p.k.s1 + r0;
  const bf16* vb = static_cast<const bf16*>(p.v.p) + b * p.v.s0 + hd * p.v.s1 + c0;
  const double* ga = wa + bh * S;

  // acc[j]: rows r0 + 16 warp + gq (+8), columns c0 + 8j + 2 t4 (+1) of C (fp32: the exact chain);
  // accn: n of the same rows in every column (B = ones)
  float acc[kSc / 8][4], accn[4];
#pragma unroll
  for (int j = 0; j < kSc / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const std::int64_t r = r0 + 16 * warp + gq + (e >> 1) * 8, c = c0 + 8 * j + 2 * t4 + (e & 1);
      acc[j][e] = p.c0.p && r < DQK && c < DV ? mlstm_ld(p.c0, b * p.c0.s0 + hd * p.c0.s1 + r * p.c0.s2 + c) : 0.f;
    }
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const std::int64_t r = r0 + 16 * warp + gq + (e >> 1) * 8;
    accn[e] = p.n0.p && r < DQK ? mlstm_ld(p.n0, b * p.n0.s0 + hd * p.n0.s1 + r) : 0.f;
  }
  double m = p.m0.p ? double(mlstm_ld(p.m0, b * p.m0.s0 + hd * p.m0.s1)) : 0.0;
  const std::uint32_t ones = pack_bf16(1.f, 1.f);
  // C's pieces by the TMA engine (WarpTileTma: Mode 2 on sm_90 where the host encoded cmap), else by
  // store_hilo_row where the warp's 32 columns are in bounds (full); slot kc of this head at kc * cstep
  // elements from slot 0. Mode 0 (the forward: hi alone, 8 pair stores a step) stores by row: its TMA
  // stores measured 0-4% slower (H100), where Mode 2's gave the backward -6..-12%.
#if defined(FW_HAS_BULK)
  const bool bulk = Mode == 2 && fl.bulk;
#else
  constexpr bool bulk = false;
#endif
  const std::int64_t cstep = Mode == 2 ? 2 * DQK * DV : DQK * DVp;
  const bool full = Mode == 2 ? DV % 2 == 0 && c0 + kSc <= DV : c0 + kSc <= DVp;

  // tile (kc, sb) -> stage: k, v rows, a_s, and at sb == 0 the chunk's end values; the cp.async units
  // of the k and v tiles fixed per CTA (ChunkUnits: re-deriving their addresses every step was ~8% of
  // the backward's K0 instructions, ncu at (2,16,8192,128,128))
  const TileUnits ku(kT, kThreads), vu(kSc, kThreads);
  const ChunkUnits kcu = fl.units ? ChunkUnits(ku, kLd, p.k.s2) : ChunkUnits(),
                   vcu = fl.units ? ChunkUnits(vu, kLd, p.v.s2) : ChunkUnits();
  auto issue = [&](std::int64_t kc, int sb, int st) {
    const std::int64_t t = kc * L + sb * kT, tend = lmin(S, (kc + 1) * L);
    const int nb = int(lmin(kT, tend - t));
    load_chunk_tile(kcu, ku, &sm.k[st][0][0], kLd, kb + t * p.k.s2, p.k.s2, nb, nr, fl.k, kThreads);
    load_chunk_tile(vcu, vu, &sm.v[st][0][0], kLd, vb + t * p.v.s2, p.v.s2, nb, nc, fl.v, kThreads);
    if (tid < nb) cp_async8(&sm.a[st][tid], ga + t + tid);
    if (tid == kT) cp_async8(&sm.end[st][0], wA + bh * S + tend - 1);
    if (tid == kT + 1) cp_async8(&sm.end[st][1], wg + bh * S + tend - 1);
    cp_async_commit();
  };
  int st = 0;
  if (NC > 0) issue(0, 0, 0);
  double M = 0.0, G = 0.0;
  for (std::int64_t kc = 0;; ++kc) {
    // The state entering chunk kc (kc == NC: the final one) to the workspace.
#if defined(FW_HAS_BULK)
    if (bulk) {
      WarpTileTma::wait_read();
      WarpTileTma::stage<true>(sm.stage[warp], acc);
      WarpTileTma::store(&cmap, sm.stage[warp], c0, int(r0 + 16 * warp), int(bh * ns + kc), r0 + 16 * warp < DQK);
    }
#endif
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const std::int64_t r = r0 + 16 * warp + gq + hr * 8;
      if (r >= DQK) continue;
      if (!bulk && Mode != 1 && full) {
        store_hilo_row<Mode == 2>(static_cast<bf16*>(ws_cv) + bh * ns * cstep + kc * cstep +
                                      r * (Mode == 2 ? DV : DVp) + c0 + 2 * t4,
                                  DQK * DV, acc, hr);
      }
#pragma unroll
      for (int j = 0; j < kSc / 8; ++j) {
        if (bulk || (Mode != 1 && full)) break;
        const std::int64_t c = c0 + 8 * j + 2 * t4;
        if constexpr (Mode == 2) {
          bf16* wh = reinterpret_cast<bf16*>(static_cast<float*>(ws_cv) + (bh * ns + kc) * DQK * DV) + r * DV;
          bf16* wl = wh + DQK * DV;
          store_hilo_pair(wh, wl, c, DV, acc[j][2 * hr], acc[j][2 * hr + 1]);
        } else if constexpr (F32) {
          float* wc = static_cast<float*>(ws_cv) + ((bh * ns + kc) * DQK + r) * DV;
          if (c < DV) wc[c] = acc[j][2 * hr];
          if (c + 1 < DV) wc[c + 1] = acc[j][2 * hr + 1];
        } else if (c < DV) {  // DVp is even and c even: the pair stays inside the padded row
          bf16* wc = static_cast<bf16*>(ws_cv) + ((bh * ns + kc) * DQK + r) * DVp;
          *reinterpret_cast<std::uint32_t*>(wc + c) = pack_bf16(acc[j][2 * hr], acc[j][2 * hr + 1]);
        }
      }
      if (with_n && t4 == 0) ws_n[(bh * ns + kc) * DQK + r] = accn[2 * hr];
    }
    if (blockIdx.y == 0 && blockIdx.z == 0 && tid == 0) {
      if constexpr (F32) static_cast<float*>(ws_mv)[bh * ns + kc] = float(m);
      else static_cast<double*>(ws_mv)[bh * ns + kc] = m;
    }
    if (kc == NC) break;

    const int n = int(lmin(L, S - kc * L)), nsb = (n + kT - 1) / kT;
    for (int sb = 0; sb < nsb; ++sb) {
      cp_async_wait<0>();
      __syncthreads();  // this tile is visible; every warp is done with the other stage
      if (sb + 1 < nsb) issue(kc, sb + 1, st ^ 1);
      else if (kc + 1 < NC) issue(kc + 1, 0, st ^ 1);
      if (sb == 0) {  // chunk start: M = max(m, A_{n-1}); decay the state into it
        M = fmax(m, sm.end[st][0]), G = sm.end[st][1];
        const float decay = float(exp(m - M));  // <= 1
#pragma unroll
        for (int j = 0; j < kSc / 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[j][e] *= decay;
#pragma unroll
        for (int e = 0; e < 4; ++e) accn[e] *= decay;
      }
      const int nb = min(kT, n - sb * kT);
      float* ww = sm.w[warp];  // this warp's w (its reads of the last tile are behind the barrier above)
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int sidx = lane + 32 * u;
        ww[sidx] = sidx < nb ? __expf(float(sm.a[st][sidx] - M)) : 0.f;  // w_s = exp(a_s - M) <= 1
      }
      __syncwarp();
#pragma unroll
      for (int ks = 0; ks < kT / 16; ++ks) {
        const int s0 = ks * 16 + 2 * t4;  // this lane's steps: s0, s0 + 1, s0 + 8, s0 + 9
        const float2 w01 = *reinterpret_cast<const float2*>(ww + s0), w89 = *reinterpret_cast<const float2*>(ww + s0 + 8);
        std::uint32_t a[4], ah[4], al[4];
        ldsm_x4_t(a, &sm.k[st][ks * 16 + ld_row_a_kmajor(lane)][16 * warp + ld_col_a_kmajor(lane)]);
        scale_split(a, w01.x, w01.y, w89.x, w89.y, ah, al);
        mma_split_kstep(acc, ah, al, sm.v[st], ks, 0, lane);
        if (with_n) {
          mma_bf16_16816(accn, ah, ones, ones);
          mma_bf16_16816(accn, al, ones, ones);
        }
      }
      st ^= 1;
    }
    m = G + M;
  }
#if defined(FW_HAS_BULK)
  if (bulk) WarpTileTma::drain();
#endif
  // The caller's final states, from the fp32 chain.
  if (p.c_last.p)
#pragma unroll
    for (int j = 0; j < kSc / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const std::int64_t r = r0 + 16 * warp + gq + (e >> 1) * 8, c = c0 + 8 * j + 2 * t4 + (e & 1);
        if (r < DQK && c < DV) mlstm_st(p.c_last, b * p.c_last.s0 + hd * p.c_last.s1 + r * p.c_last.s2 + c, acc[j][e]);
      }
  if (p.n_last.p && with_n && t4 == 0)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const std::int64_t r = r0 + 16 * warp + gq + hr * 8;
      if (r < DQK) mlstm_st(p.n_last, b * p.n_last.s0 + hd * p.n_last.s1 + r, accn[2 * hr]);
    }
  if (p.m_last.p && blockIdx.y == 0 && blockIdx.z == 0 && tid == 0)
    mlstm_st(p.m_last, b * p.m_last.s0 + hd * p.m_last.s1, float(m));
}

// ---- B: outputs --------------------------------------------------------------------------------------
// A CTA per (head, chunk, 64-row block x NT 64-column DV tiles). NT = 2 forms q k^T, P and q . n_k once
// for 128 DV columns: with one tile per CTA they were formed again for every 64 columns, ~40% of the
// CTA's products (DQK = DV = 128: q k^T is as large as q C_k), 8x over at DV = 512.
// Dynamic smem, DQKp = DQK rounded up to 16, ldq = DQKp + 8, ldc = 64 NT + 8:
//   f64 a[kMaxL] | f64 M[64] | f64 mt[64] | f32 nk[DQKp] | bf16 q[64][ldq] | k[64][ldq] | c[DQKp][ldc] | v[64][ldc]
struct OutLayout {
  int DQKp, ldq, ldc;
  std::size_t a, M, mt, nk, q, k, c, v, bytes;
  __host__ __device__ OutLayout(std::int64_t DQK, int NT) {
    DQKp = int(round_up(DQK, 16)), ldq = DQKp + 8, ldc = kT * NT + 8;
    a = 0, M = a + 8 * kMaxL, mt = M + 8 * kT, nk = mt + 8 * kT;
    q = round_up(nk + 4 * std::size_t(DQKp), 16);
    k = q + 2 * std::size_t(kT) * ldq;
    c = k + 2 * std::size_t(kT) * ldq;
    v = c + 2 * std::size_t(DQKp) * ldc;
    bytes = v + 2 * std::size_t(kT) * ldc;
  }
};

template <int NT>
__global__ void __launch_bounds__(kThreads) mlstm_tc_out_kernel(const MlstmParams p, const TcFlags fl,
                                                                const bf16* __restrict__ ws_c,
                                                                const float* __restrict__ ws_n,
                                                                const double* __restrict__ ws_m,
                                                                const double* __restrict__ wg,
                                                                const double* __restrict__ wa,
                                                                const double* __restrict__ wA) {
  extern __shared__ float4 smem_raw[];
  char* base = reinterpret_cast<char*>(smem_raw);
  const OutLayout lay(p.DQK, NT);
  double* s_a = reinterpret_cast<double*>(base + lay.a);   // (rows of the chunk up to this block's end) a_s
  double* s_M = reinterpret_cast<double*>(base + lay.M);   // (64 block rows) M_t
  double* s_mt = reinterpret_cast<double*>(base + lay.mt); // (64 block rows) m_t = g_t + M_t
  float* s_nk = reinterpret_cast<float*>(base + lay.nk);   // (DQKp) n_k
  bf16* sq = reinterpret_cast<bf16*>(base + lay.q);        // (64 rows t, DQKp) q
  bf16* sk = reinterpret_cast<bf16*>(base + lay.k);        // (64 steps s, DQKp) k
  bf16* sc = reinterpret_cast<bf16*>(base + lay.c);        // (DQKp, 64 NT DV columns) C_k
  bf16* sv = reinterpret_cast<bf16*>(base + lay.v);        // (64 steps s, 64 NT DV columns) v
  const int ldq = lay.ldq, DQKp = lay.DQKp, ldc = lay.ldc;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, t4 = lane & 3;
  const std::int64_t bh = blockIdx.x, b = bh / p.NH, hd = bh % p.NH, kc = blockIdx.y;
  const int row_blocks = int((p.L + kT - 1) / kT);
  const int rb = blockIdx.z % row_blocks, c0 = int(blockIdx.z / row_blocks) * kT * NT;
  const std::int64_t ns = p.chunks() + 1, DQK = p.DQK, DV = p.DV, DVp = round_up(DV, 8);
  const std::int64_t t0 = kc * p.L;
  const int n = int(lmin(p.L, p.S - t0));
  const int row0 = rb * kT;
  if (row0 >= n) return;  // a short last chunk has fewer row blocks (uniform over the CTA)
  const int nrow = min(kT, n - row0), rowend = row0 + nrow, nc = int(lmin(kT * NT, DV - c0));
  const int nt = (nc + kT - 1) / kT;  // this CTA's 64-column tiles (NT, or 1 in the last of an odd count)

  const bf16* qb = static_cast<const bf16*>(p.q.p) + b * p.q.s0 + hd * p.q.s1;
  const bf16* kb = static_cast<const bf16*>(p.k.p) + b * p.k.s0 + hd * p.k.s1;
  const bf16* vb = static_cast<const bf16*>(p.v.p) + b * p.v.s0 + hd * p.v.s1 + c0;
  load_tile(sq, ldq, kT, DQKp, qb + (t0 + row0) * p.q.s2, p.q.s2, nrow, int(DQK), fl.q);
  load_tile(sc, ldc, DQKp, kT * NT, ws_c + (bh * ns + kc) * DQK * DVp + c0, DVp, int(DQK), nc, true);
  cp_async_commit();
  auto issue_kv = [&](int sb) {
    const int s0 = sb * kT, nsb = min(kT, rowend - s0);
    load_tile(sk, ldq, kT, DQKp, kb + (t0 + s0) * p.k.s2, p.k.s2, nsb, int(DQK), fl.k);
    load_tile(sv, ldc, kT, kT * NT, vb + (t0 + s0) * p.v.s2, p.v.s2, nsb, nc, fl.v);
    cp_async_commit();
  };
  issue_kv(0);

  const double mk = ws_m[bh * ns + kc];
  const std::int64_t go = bh * p.S + t0;
  for (int s = tid; s < rowend; s += kThreads) s_a[s] = wa[go + s];
  if (tid < kT) {
    const double M = tid < nrow ? fmax(mk, wA[go + row0 + tid]) : 0.0;
    s_M[tid] = M;
    s_mt[tid] = tid < nrow ? wg[go + row0 + tid] + M : 0.0;
  }
  for (int r = tid; r < DQKp; r += kThreads) s_nk[r] = r < DQK ? ws_n[(bh * ns + kc) * DQK + r] : 0.f;
  cp_async_wait<1>();
  __syncthreads();

  const float scale = rsqrtf(float(DQK));
  const int tlA = 16 * warp + gq, tlB = tlA + 8;  // this thread's two block rows
  float acc[NT][8][4] = {};  // (tile, 16 rows of the warp, 64 DV columns) numerator
  // Inter-chunk part: q C_k on tensor cores, q . n_k in fp32.
#pragma unroll
  for (int u = 0; u < NT; ++u)
    if (u < nt) mma_rk(acc[u], sq, ldq, warp, sc + kT * u, ldc, DQKp, lane);
  float qn;  // lanes 2r, 2r+1: row r of the warp, even / odd columns
  {
    const bf16* qr = sq + (16 * warp + (lane >> 1)) * ldq;
    float s = 0.f;
    for (int c = lane & 1; c < DQKp; c += 2) s = fmaf(__bfloat162float(qr[c]), s_nk[c], s);
    qn = s + __shfl_xor_sync(0xffffffffu, s, 1);
  }
  float qnA = __shfl_sync(0xffffffffu, qn, 2 * gq), qnB = __shfl_sync(0xffffffffu, qn, 2 * (gq + 8));
  {  // decay of the entering state into row t (scale included): exp(m_k - M_t) <= 1
    const float eA = tlA < nrow ? scale * __expf(float(mk - s_M[tlA])) : 0.f;
    const float eB = tlB < nrow ? scale * __expf(float(mk - s_M[tlB])) : 0.f;
#pragma unroll
    for (int u = 0; u < NT; ++u)
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[u][j][0] *= eA, acc[u][j][1] *= eA, acc[u][j][2] *= eB, acc[u][j][3] *= eB;
    qnA *= eA, qnB *= eB;
  }

  // Intra-chunk part, one 64-step block of s at a time (s <= t only).
  float rsA = 0.f, rsB = 0.f;
  for (int sb = 0; sb <= rb; ++sb) {
    if (sb > 0) issue_kv(sb);
    cp_async_wait<0>();
    __syncthreads();
    const int s0 = sb * kT;
    float sacc[8][4] = {};  // (16 rows, 64 steps) q k^T
    for (int ks = 0; ks < DQKp / 16; ++ks) {
      std::uint32_t a[4];
      ldsm_x4(a, sq + (16 * warp + ld_row_a_rowmajor(lane)) * ldq + ks * 16 + ld_col_a_rowmajor(lane));
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        std::uint32_t bk[4];
        ldsm_x4(bk, sk + (16 * jj + ld_row_b_nmajor(lane)) * ldq + ks * 16 + ld_col_b_nmajor(lane));
        mma_bf16_16816(sacc[2 * jj], a, bk[0], bk[1]);
        mma_bf16_16816(sacc[2 * jj + 1], a, bk[2], bk[3]);
      }
    }
    // P = scale (q k^T) exp(a_s - M_t) on s <= t; to bf16 A fragments (register reuse)
    std::uint32_t pa[4][4];
    const double MA = s_M[tlA], MB = s_M[tlB];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float pv[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int tl = e < 2 ? tlA : tlB, s = s0 + 8 * j + 2 * t4 + (e & 1);
        const bool on = tl < nrow && s <= row0 + tl;  // s <= t < rowend
        pv[e] = on ? scale * sacc[j][e] * __expf(float(s_a[on ? s : 0] - (e < 2 ? MA : MB))) : 0.f;
      }
      rsA += pv[0] + pv[1], rsB += pv[2] + pv[3];
      pack_a_frags(pa, j, pv);
    }
#pragma unroll
    for (int u = 0; u < NT; ++u)
      if (u < nt) mma_frags_k(acc[u], pa, sv, ldc, kT * u, lane);
    __syncthreads();  // sk / sv are free for the next block
  }
  // the four lanes of a row hold its row sum in parts (fixed xor tree: every lane the same bits)
  rsA += __shfl_xor_sync(0xffffffffu, rsA, 1), rsB += __shfl_xor_sync(0xffffffffu, rsB, 1);
  rsA += __shfl_xor_sync(0xffffffffu, rsA, 2), rsB += __shfl_xor_sync(0xffffffffu, rsB, 2);

  // h = num / (max(|q . n|, exp(-m_t)) + eps)
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int tl = hr ? tlB : tlA;
    if (tl >= nrow) continue;
    const float den = fmaxf(fabsf((hr ? qnB + rsB : qnA + rsA)), float(exp(-s_mt[tl]))) + p.eps;
    const float inv = 1.f / den;
    bf16* hrow = static_cast<bf16*>(p.h.p) + b * p.h.s0 + hd * p.h.s1 + (t0 + row0 + tl) * p.h.s2;
#pragma unroll
    for (int u = 0; u < NT; ++u)
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int c = c0 + kT * u + 8 * j + 2 * t4;
      const float x0 = acc[u][j][2 * hr] * inv, x1 = acc[u][j][2 * hr + 1] * inv;
      if (fl.h2 && c + 1 < DV) {
        *reinterpret_cast<std::uint32_t*>(hrow + c) = pack_bf16(x0, x1);
      } else {
        if (c < DV) hrow[c] = __float2bfloat16_rn(x0);
        if (c + 1 < DV) hrow[c + 1] = __float2bfloat16_rn(x1);
      }
    }
  }
}


}  // namespace

int set_mlstm_out_tiles(int nt) { return g_out_tiles.exchange(nt == 1 || nt == 2 ? nt : 0); }

namespace {
// The output kernel's 64-column DV tiles per CTA: two where DV spans more than one tile and the
// layout fits the device's shared memory, else one (or as forced).
int mlstm_out_tiles(const MlstmParams& p) {
  const int forced = g_out_tiles.load(std::memory_order_relaxed);
  const bool two_fit = OutLayout(p.DQK, 2).bytes + 1024 <= smem_per_block_optin();
  if (forced) return forced == 2 && two_fit ? 2 : 1;
  return p.DV > kT && two_fit ? 2 : 1;
}
}  // namespace

bool mlstm_fwd_tc_applies(const MlstmParams& p) {
  return p.q.dtype == DType::bf16 && p.k.dtype == DType::bf16 && p.v.dtype == DType::bf16 && p.h.dtype == DType::bf16 &&
         p.DQK >= 1 && p.DQK <= 256 && p.DV >= 1 && p.L >= 1 && p.L <= kMaxL;
}

std::size_t mlstm_fwd_tc_workspace_bytes(const MlstmParams& p) { return std::size_t(TcWs(p).total); }

void mlstm_fwd_tc_cuda(const MlstmParams& p, void* workspace, std::size_t workspace_bytes, Stream stream) {
  const TcWs w(p);
  if (p.B * p.NH == 0) return;
  if (workspace_bytes < std::size_t(w.total))
    throw ArgumentError(cat("mlstm_fwd: workspace: ", workspace_bytes, " bytes, need ", w.total));
  char* ws = static_cast<char*>(workspace);
  bf16* ws_c = reinterpret_cast<bf16*>(ws + w.c);
  float* ws_n = reinterpret_cast<float*>(ws + w.n);
  double* ws_m = reinterpret_cast<double*>(ws + w.m);
  double *wg = reinterpret_cast<double*>(ws + w.g), *wa = reinterpret_cast<double*>(ws + w.a),
         *wA = reinterpret_cast<double*>(ws + w.A);
  const std::int64_t heads = p.B * p.NH, NC = p.chunks();
  const std::int64_t kt = (p.DQK + kT - 1) / kT, vt = (p.DV + kT - 1) / kT, rbs = (p.L + kT - 1) / kT;
  const std::int64_t st = (p.DV + kSc - 1) / kSc;  // the states kernel's column tiles
  if (heads > 0x7fffffff || kt > 65535 || st > 65535 || NC > 65535 || rbs * vt > 65535)
    throw Error(cat("mlstm_fwd: grid too large (heads ", heads, ", chunks ", NC, ")"));
  const CUtensorMap cmap{};  // Mode 0 stores element by element (the kernel's comment)
  const TcFlags fl{rows16(p.q), rows16(p.k), rows16(p.v),
                   reinterpret_cast<std::uintptr_t>(p.h.p) % 4 == 0 && p.h.s0 % 2 == 0 && p.h.s1 % 2 == 0 &&
                       p.h.s2 % 2 == 0,
                   false, mlstm_chunk_units_on()};
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  if (NC > 0) {
    mlstm_tc_gates_kernel<<<dim3(unsigned(heads), unsigned(NC)), 256, 0, s>>>(p, wg, wa, wA);
    FW_CUDA_CHECK_LAUNCH("mlstm_fwd");
  }
  const std::size_t ssm = sizeof(StatesSmem);
  const auto states = heads * kt * st > 2 * sm_count() ? &mlstm_tc_states_kernel<0, 4> : &mlstm_tc_states_kernel<0, 2>;
  (void)resident_ctas_per_sm(reinterpret_cast<const void*>(states), kThreads, ssm);
  states<<<dim3(unsigned(heads), unsigned(kt), unsigned(st)), kThreads, ssm, s>>>(
      p, fl, cmap, ws_c, ws_n, ws_m, wg, wa, wA);
  FW_CUDA_CHECK_LAUNCH("mlstm_fwd");
  if (NC == 0) return;
  const int NT = mlstm_out_tiles(p);
  const OutLayout lay(p.DQK, NT);
  const auto out = NT == 2 ? &mlstm_tc_out_kernel<2> : &mlstm_tc_out_kernel<1>;
  (void)resident_ctas_per_sm(reinterpret_cast<const void*>(out), kThreads, lay.bytes);
  out<<<dim3(unsigned(heads), unsigned(NC), unsigned(rbs * ((vt + NT - 1) / NT))), kThreads, lay.bytes, s>>>(
      p, fl, ws_c, ws_n, ws_m, wg, wa, wA);
  FW_CUDA_CHECK_LAUNCH("mlstm_fwd");
}

bool mlstm_states_tc_applies(const MlstmParams& p) {
  return p.q.dtype == DType::bf16 && p.k.dtype == DType::bf16 && p.v.dtype == DType::bf16 && p.L >= 1 && p.L <= kMaxL;
}

void mlstm_states_tc_f32(const MlstmParams& p, float* ws_c, float* ws_n, float* ws_m, double* gates, Stream stream,
                         bool hilo) {
  const std::int64_t heads = p.B * p.NH, NC = p.chunks();
  const std::int64_t kt = (p.DQK + kT - 1) / kT, vt = (p.DV + kSc - 1) / kSc;
  if (heads == 0) return;
  if (heads > 0x7fffffff || kt > 65535 || vt > 65535 || NC > 65535)
    throw Error(cat("mlstm: grid too large (heads ", heads, ", chunks ", NC, ")"));
  double *wg = gates, *wa = gates + heads * p.S, *wA = gates + 2 * heads * p.S;
  CUtensorMap cmap{};  // hilo: C's slots (heads x (NC + 1)) of hi, lo (DQK, DV) bf16 for the TMA stores
  const TcFlags fl{rows16(p.q), rows16(p.k), rows16(p.v), false,
                   hilo && mlstm_bulk_store_on() && state_tile_map(&cmap, ws_c, p.DV, p.DV, p.DQK, 2, heads * (NC + 1)),
                   mlstm_chunk_units_on()};
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  if (NC > 0) {
    mlstm_tc_gates_kernel<<<dim3(unsigned(heads), unsigned(NC)), 256, 0, s>>>(p, wg, wa, wA);
    FW_CUDA_CHECK_LAUNCH("mlstm");
  }
  const std::size_t ssm = sizeof(StatesSmem);
  const bool four = heads * kt * vt > 2 * sm_count();  // more than two CTAs per SM: four, at 128 registers
  const auto kernel = hilo ? (four ? &mlstm_tc_states_kernel<2, 4> : &mlstm_tc_states_kernel<2, 2>)
                           : (four ? &mlstm_tc_states_kernel<1, 4> : &mlstm_tc_states_kernel<1, 2>);
  (void)resident_ctas_per_sm(reinterpret_cast<const void*>(kernel), kThreads, ssm);
  kernel<<<dim3(unsigned(heads), unsigned(kt), unsigned(vt)), kThreads, ssm, s>>>(p, fl, cmap, ws_c, ws_n, ws_m, wg, wa,
                                                                                 wA);
  FW_CUDA_CHECK_LAUNCH("mlstm");
}

}  // namespace fastweight::detail
