// deltanet_bwd_rs.cu: the backward state pass's serial kernel with dS^T in registers (bf16 operands,
// sm_90). The same outputs as deltanet_bwd_tc.cu's serial kernels (the per-chunk dSe for the chunk
// pass, dD in the Y region for the post kernel, dinitial_state), from the same inputs (the prep
// kernel's bf16 dD0 and Q^ = s diag(rq) Q, the recompute's bf16 Xw, the factors), per chunk in reverse:
//   dD = dD0 + diag(rk) K dSe,   dS = dSe + Q^^T dO - Xw^T (W dD).
// Transposed, with V as the rows: dS^T = dSe^T + dO^T Q^ + B Xw, where B = -(W dD)^T = -(dD0^T +
// (dSe^T K^T) diag(rk)) W. A warp owns 16 columns of V and keeps their dS^T (16 x Kc, fp32) in mma
// accumulators, which are (as bf16) the A fragments of the next product (FlashAttention-2's reuse of
// P); dSe^T K^T (16 x 64) in accumulators gives B's A fragments the same way. So a step's chain is
// two products in one warp's registers, with no shared-memory round trip of dS or B and no barrier
// between warps: the other serial kernels split dS by rows over 8 warps and pass dSe and B through
// shared memory between them, two to three barriers a step, which measured 2.7 us a step at
// (1,32768,16,128) on the H100 (67% of cycles with no eligible warp) against FLA's 1.4.
// Loader warps bring each chunk's k, Q^, Xw (64 x Kc) and dO, dD0 (64 x the CTA's columns) through
// a ring of buffers (mbarriers full / empty); a chain warp writes dSe and dD through its own small
// tiles, transposed by stmatrix, as 16-byte rows (or a storer warp does: a switch, slower).
// The products in another order than the other serial kernels (different bits, the same roundings:
// dSe and W dD to bf16, dD to bf16 in the Y region).
// Measured (H100, session 28): 2.4-2.6 us a chunk step still (1348 us at (1,32768,16,128) beside the
// recompute, 586 us at varlen 8 in 32768), against ~0.95 us of tensor-pipe and issue work per step
// (mma.sync m16n8k16 measured here: 24.6 cycles dependent, 6.3 per SM sub-partition independent).
// Each warp reads its B fragments (K, Q^, Xw: 52 KB a step) by ldmatrix: 4 warps per SM are ~210 KB
// of shared-memory reads a step, 1660 cycles at 128 B a cycle; the batched shapes are bound by L2
// (ncu at (4,4096): 87% L2, 71% DRAM). The wgmma form (WG below: B read from shared memory once per
// warpgroup, dS^T still the register A operand) is the default on sm_90a since session 29; it measured
// 2.4 us a step still (1218 us at (1,32768), 615 at varlen; 0.971-0.998 of the mma.sync form's bwd
// time). ncu on it alone: the chain warps spin on the operand ring's full barrier (17.5% of executed
// instructions; 2 buffers fit beside the transposition tiles) and stall on their own dSe / dD stores
// (26% of stall samples), not on the products. T1 (one tile per warp: room for 3 buffers) measured
// no faster (session 30), so the loads' latency is not the bound; the SASS points at instruction
// counts instead: loader 0 ~12 instructions per 16-byte copy (~1400 a step), the chain's own stores
// ~18 each. lfast, slean and X1F (switches below) cut those and measured 1.00x (session 31), as did
// DEFER. Timing probes (PROBE below) then showed that its dSe / dD stores weigh on the step: without
// them the kernel ran ~30% shorter at varlen 8 (the products' probes were not conclusive). WIDE (below,
// the default since session 32: bwd 0.94-0.99x at the long shapes) stores the same bytes as whole
// 128-byte rows, as FLA's dhu kernel does.
#include <atomic>

#include "cuda/common/bulk.cuh"
#include "cuda/common/check.cuh"
#include "cuda/common/gstore.cuh"
#include "cuda/common/tensor_map.cuh"
#include "cuda/common/wgmma.cuh"
#include "cuda/deltanet/deltanet_common.cuh"
#include "cuda/deltanet/deltanet_cuda.h"
#include "cuda/deltanet/deltanet_tc.cuh"

namespace fastweight::detail {
namespace {

using namespace dtc;
constexpr int kRsLoaders = 2;  // loader warps: (k, Q^, rk, beta) and (Xw, dO, dD0); then the storer warp
constexpr int kRsAux = kRsLoaders + 1;
constexpr int kRsLdt = 24;     // stride (bf16) of a chain warp's transposition tiles: 16 columns + 8
constexpr int kRsPf = 4;       // ldmatrix results in flight ahead of their products
constexpr int kRsLdw = 72;     // WIDE: stride (bf16) of the CTA's tile pair: 64 columns + 8 (144 bytes: rows 4 banks apart)

// smem: [nbuf] { bf16 k, Q^ (or q), Xw [64][Kc + 8] | bf16 dO, dD0 [64][16 nw + 8] | f32 rk, beta, rq [64] } |
//       [nw][2] bf16 transposition tiles { dSe^T [Kc][24], dD [64][24] } (steps s % 2) |
//       u64 full [nbuf], empty [nbuf], sfull [2], sempty [2]
// WG (the wgmma form): k, Q^, Xw as wgmma's 128-byte-swizzled (64 rows, Kc) tiles (Kc / 64 blocks of
// 8 KB, no padding), each buffer 1024-byte aligned from a base the kernel aligns (+ 1024 bytes).
// T1 (with WG; `set_deltanet_bwd_serial_rs_t1`): one transposition tile per warp, (max(Kc, 64), 24),
// dSe^T then dD in turn (the warp stores dSe^T at the step's top), and the swizzled tiles of every
// buffer first: [nbuf] { k, Q^, Xw } | [nbuf] { dO, dD0, rk, beta } | [nw] tile | barriers. At Kc = 128
// that is 230 736 bytes with 3 buffers (the two-tile layout needs 208 KB for 2), so a chunk's loads
// get two steps to land instead of one.
template <int KC, bool WG = false, bool T1 = false>
struct BrLayout {
  static_assert(!T1 || WG, "the one-tile layout is the wgmma form's");
  static constexpr int LDK = KC + 8;
  int nw, ldc, nbuf;
  // k, q, xw: buffer 0's operand offsets, buffer bf's at + bf * sa; dO, y, fac likewise with sb
  std::size_t k, q, xw, dO, y, fac, sa, sb, tr, trw, bar, bytes;
  __host__ __device__ BrLayout(int nw_, int nbuf_) : nw(nw_), ldc(16 * nw_ + 8), nbuf(nbuf_) {
    const std::size_t kt = WG ? std::size_t(KC) * 128 : 2 * std::size_t(kT) * LDK, ct = 2 * std::size_t(kT) * ldc;
    if (T1) {
      k = 0, q = kt, xw = 2 * kt, sa = 3 * kt;  // 1024-byte multiples
      dO = nbuf * sa, y = dO + ct, fac = y + ct, sb = 2 * ct + 3 * 4 * kT;
      trw = std::size_t(KC > kT ? KC : kT) * kRsLdt;  // one tile: dSe^T (KC rows), then dD (64 rows)
      tr = dO + nbuf * sb, bar = tr + nw * trw * 2;
    } else {
      k = 0, q = kt, xw = 2 * kt, dO = 3 * kt, y = dO + ct, fac = y + ct, sa = fac + 3 * 4 * kT;  // 16-byte multiples
      if (WG) sa = (sa + 1023) / 1024 * 1024;
      sb = sa;
      trw = std::size_t(KC + kT) * kRsLdt;  // bf16 elements of a tile pair: dSe^T (KC rows), dD (64 rows)
      tr = nbuf * sa, bar = tr + nw * 2 * trw * 2;
    }
    bytes = bar + 8 * (2 * nbuf + 4) + (WG ? 1024 : 0);
  }
};

// Grid (N * H, column tiles of 16 nw); 32 (nw + kRsAux) threads. K % 8 == 0, K <= KC, V % 16 == 0,
// 16-byte aligned rows of k and dO, and of q with qraw (the host checks). WG: the products on wgmma (nw = 4: the chain
// warps are one warpgroup; an sm_90a binary), B read from shared memory once per warpgroup instead of
// once per warp by ldmatrix (the bound of the mma.sync form: ~210 KB of ldmatrix reads a step at 4
// warps per SM); dS^T, X1 and B's A fragments stay in registers as in that form.
// X1F (with WG; `set_deltanet_bwd_serial_rs_x1first`): X1 issued as soon as the chunk lands (a template
// parameter: as a runtime branch, ptxas fenced the in-flight accumulators at the merge, warning C7519).
// DEFER (with X1F, not T1; `set_deltanet_bwd_serial_rs_defer`): a chain warp stores step s's dSe / dD
// tiles during step s + 1, right after issuing its X1 (the tile pairs alternate, so they are still whole),
// instead of at the end of step s, where the stores sat on the chain between its last product and the
// next step's first. DEFER also keeps s % nbuf and (s / nbuf) & 1 as running counters (the 64-bit
// division per step and role was on the chain: F2I and its branch in ncu's samples).
// PROBE (DEFER's instances, K <= 128 only, one per mask of parts left out: 1 the tile stores, 2 the
// qraw scaling, 8 X1, 32 B Xw, 40 both products): timing probes only, the results are wrong
// (fastweight_bench --dn-rs-probe=MASK --timing-only): which part sets the step. H100, session 31, bwd
// ms against DEFER alone, with the mask then a runtime value: 1 -> 0.945 at varlen 8 and 0.979 at
// (4,4096,16,128); 2, 8, 32 -> 0.995-1.025. As a runtime value, ptxas serialised that instance's wgmma
// (C7515, five injected warpgroup.arrive), so the probes ran a slower schedule than DEFER: the stores'
// share is at least what probe 1 shows, and the products' probes are not conclusive. The mask is a
// template parameter now. (A probe without the wait for a chunk's operands hung: the chain then
// arrives on a buffer's empty barrier twice before the loader waits for the first phase.)
// WIDE (DEFER's, `set_deltanet_bwd_serial_rs_wide`): the chain warps write one tile pair for the CTA,
// (KC + 64) rows of its 16 nw columns (stride kRsLdw), in the per-warp tiles' place, and store it as
// whole rows: a warp's 16-byte row pieces of 8 lanes cover 4 rows of 128 bytes an instruction, where
// each warp's own 16 columns were 32 bytes of 16 rows (16 lines an instruction, 4 warps writing each
// line in turn). A named barrier of the chain warps a step guards the pair. Probe 1 (the stores left
// out) took the backward to 0.945x at varlen 8 and 0.979x at (4,4096,16,128) against DEFER (H100,
// session 31), and FLA's dhu kernel stores the same bytes as whole 128-byte rows. Measured (H100,
// session 32, against DEFER): bwd 0.94-0.97x at (1,32768) and varlen 8, 0.99-1.01x elsewhere; with
// the mask a template parameter, probe 1 took (4,4096) and varlen to 0.948 / 0.942, probes 8 (X1),
// 32 (B Xw), 40 (both) to 0.98-1.01: the stores were the step's weight, and WIDE took half of it.
// TMA (WIDE's; `set_deltanet_bwd_serial_rs_tma`): the tile pair dense (64 columns, 128-byte rows) in the
// 128-byte swizzle (16-byte chunk c of row r at c ^ (r & 7): stmatrix's rows then land in distinct bank
// groups), stored a step by two tensor-map stores issued by one thread, dSe^T (K rows: map_s over the dS
// slots) and dD (64 rows: map_y over Y's (tokens, H) rows), instead of 48 16-byte stores a chain warp. A
// chunk shorter than 64 rows keeps the chain warps' row stores for dD (the box would write the next
// sequence's rows). The same bits. Every chain thread fences its stmatrix writes to the async proxy
// before the step's barrier; thread 0 waits for its stores' reads of a pair before that barrier.
template <int KC, bool WG = false, bool T1 = false, bool X1F = false, bool DEFER = false, int PROBE = 0,
          bool WIDE = false, bool TMA = false>
__global__ void __launch_bounds__(32 * (4 + kRsAux), 1)
    deltanet_bwd_state_rs_kernel(const DeltanetBwdParams p, const DnBwdWs w, float* __restrict__ ws, int nw, int nbuf,
                                 bool storer, bool qraw, bool lfast, bool slean, const __grid_constant__ CUtensorMap map_s,
                                 const __grid_constant__ CUtensorMap map_y) {
  static_assert(!DEFER || (X1F && !T1), "DEFER: the X1-first form with its two tile pairs");
  static_assert(PROBE == 0 || DEFER, "PROBE: DEFER's instance");
  static_assert(!WIDE || (DEFER && PROBE == 0), "WIDE: DEFER's form");
  static_assert(!TMA || WIDE, "TMA: WIDE's tile pair");
  static_assert(!X1F || WG, "X1F (and DEFER, WIDE): the wgmma form's");
  constexpr auto skip = [](int part) { return (PROBE & part) != 0; };  // compile-time: no branch around wgmma
  constexpr int LDK = BrLayout<KC>::LDK, NK = KC / 8, KS = KC / 16;  // n-tiles, k-steps of dS^T's K
  extern __shared__ float4 smem_raw[];
  char* base = reinterpret_cast<char*>(smem_raw);
  const BrLayout<KC, WG, T1> lay(nw, nbuf);
  if constexpr (T1 || DEFER) storer = false;  // (T1: one tile; DEFER: the chain warps store it themselves)
  // the swizzled tiles' 1024-byte alignment (the layout holds the slack), by pointer arithmetic: a
  // round trip through an integer lost the shared window, and the reads of the tiles and factors
  // were generic LDs (15% of the stall samples on stores waiting for them; as LDS: 206-212
  // registers instead of 226-232, bwd 0.99x, within noise; H100, session 30)
  if constexpr (WG) base += (1024u - (smem_u32(base) & 1023u)) & 1023u;
  if constexpr (WIDE)
    if (nw != 4) __trap();  // the barrier's 128 threads and the row map are one warpgroup's (the host checks)
  const int LDC = lay.ldc;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const DnCta cta = dn_chain_cta(p, reinterpret_cast<int*>(base));
  const std::int64_t n = cta.n, h = cta.h, cb = cta.tile * 16 * nw, V = p.V, K = p.K;
  const DnSeq sq_ = dn_seq(p, n);
  const std::int64_t b = sq_.b;
  const std::int64_t row00 = dn_ws_row(p, b, sq_.bos, h), wrow_step = kT * p.H;
  const std::int64_t nch = (sq_.eos - sq_.bos + kT - 1) / kT;
  auto at = [&](int bf, std::size_t off) { return base + bf * lay.sa + off; };  // k, Q^, Xw
  auto atb = [&](int bf, std::size_t off) { return base + bf * lay.sb + off; };  // dO, dD0, factors
  std::uint64_t* full = reinterpret_cast<std::uint64_t*>(base + lay.bar);
  std::uint64_t* empty = full + nbuf;
  std::uint64_t* sfull = empty + nbuf;  // [2] a step's tiles written (32 nw arrivals)
  std::uint64_t* sempty = sfull + 2;    // [2] ... and stored (the storer)
  auto tile = [&](int cw_, int sb) {
    return reinterpret_cast<bf16*>(base + lay.tr) + (T1 ? cw_ : 2 * cw_ + sb) * lay.trw;
  };
  // WIDE: the CTA's tile pair sb, (KC + 64, kRsLdw) bf16, in the per-warp tiles' region (2 x 192 x 72
  // elements there against 4 x 2 x 192 x 24); dSe^T rows 0 .. KC - 1, dD rows KC ..
  // (TMA: stride 64, swizzled; each pair and its dD rows 1024-byte aligned: lay.tr is, and (KC + 64) 128
  // and KC 128 are multiples of 1024)
  constexpr int kPld = TMA ? kT : kRsLdw;
  auto tile_w = [&](int sb) { return reinterpret_cast<bf16*>(base + lay.tr) + std::size_t(sb) * (KC + kT) * kPld; };
#if !defined(FW_HAS_BULK)
  __trap();  // mbarriers and stmatrix: the host launches it only for an sm_90 binary
#else
#if !defined(FW_HAS_WGMMA)
  if constexpr (WG) __trap();  // (the host launches the wgmma form only for sm_90a binaries)
#endif
  if (tid == 0) {
    // every thread of the warps on a side arrives (each after its own accesses): lane 0 alone after a
    // __syncwarp is ordered as well, but compute-sanitizer's racecheck does not follow it (session 30:
    // 134 hazards on the loaders' copies against the chain warps' reads; 0 with every lane arriving)
    for (int i = 0; i < nbuf; ++i) mbar_init(full + i, 32 * kRsLoaders), mbar_init(empty + i, unsigned(32 * nw));
    for (int i = 0; i < 2; ++i) mbar_init(sfull + i, unsigned(32 * nw)), mbar_init(sempty + i, 32);
    mbar_init_fence();
  }
  __syncthreads();
  // step s's dSe and dD from chain warp c's tiles s % 2 to the workspace (a whole warp: 32-byte row
  // pieces, V % 16 == 0): by the storer warp (storer) or by the chain warp itself after its step
  const int hf = lane & 1;
  // parts: 1 dSe, 2 dD, 3 both (T1: the one tile holds dSe^T, then dD)
  auto store_tiles = [&](int c, std::int64_t s, int parts = 3) {
    const std::int64_t ci = nch - 1 - s;
    const int nr = int(lmin(kT, sq_.eos - (sq_.bos + ci * kT)));
    const bf16* tS = tile(c, int(s & 1));
    const bf16* tD = T1 ? tS : tS + std::size_t(KC) * kRsLdt;
    bf16* gS = state_mats<false>(ws + w.dS, sq_.base + ci, p.H, h, K, V) + cb + 16 * c + 8 * hf;
    bf16* yb = reinterpret_cast<bf16*>(ws + w.Y) + (row00 + ci * wrow_step) * V + cb + 16 * c + 8 * hf;
    if (slean) {  // the lane's first row once, then a fixed byte step, and no predicates on whole tiles
      // (per row, the 64-bit r V products and a branch took ~18 instructions a store: 247 for 24).
      // Every row piece is read into registers of its own before the first store: with one register
      // quad for all of them (nvcc's choice), each LDS waited until the previous STG had read its data
      // (ncu, H100, session 31: this block was 25% of the kernel's stall samples, mostly long scoreboard
      // on that write-after-read), and stored by st.global.v4 (gstore.cuh: nvcc made every other one
      // four 4-byte stores).
      const int r0 = lane >> 1;
      const bf16* t = tS + r0 * kRsLdt + 8 * hf;
      const bf16* td = tD + r0 * kRsLdt + 8 * hf;
      uint4 vs[KC / 16], vd[4];
      if (parts & 1) {
#pragma unroll
        for (int q = 0; q < KC / 16; ++q) vs[q] = *reinterpret_cast<const uint4*>(t + 16 * q * kRsLdt);
      }
      if (parts & 2) {
#pragma unroll
        for (int q = 0; q < 4; ++q) vd[q] = *reinterpret_cast<const uint4*>(td + 16 * q * kRsLdt);
      }
      if (parts & 1) {
        char* g = reinterpret_cast<char*>(gS + std::int64_t(r0) * V);
        const std::int64_t step = 32 * V;  // 16 rows
        if (K == KC) {
#pragma unroll
          for (int q = 0; q < KC / 16; ++q, g += step) st_global_v4u(g, vs[q]);
        } else {
#pragma unroll
          for (int q = 0; q < KC / 16; ++q, g += step)
            if (r0 + 16 * q < K) st_global_v4u(g, vs[q]);
        }
      }
      if (parts & 2) {
        char* g = reinterpret_cast<char*>(yb + std::int64_t(r0) * p.H * V);
        const std::int64_t step = 32 * p.H * V;  // 16 rows
#pragma unroll
        for (int q = 0; q < 4; ++q, g += step)
          if (nr == kT || r0 + 16 * q < nr) st_global_v4u(g, vd[q]);
      }
      return;
    }
#pragma unroll
    for (int q = 0; q < KC / 16; ++q) {
      const int r = (lane >> 1) + 16 * q;
      if ((parts & 1) && r < K)
        *reinterpret_cast<uint4*>(gS + r * V) = *reinterpret_cast<const uint4*>(tS + r * kRsLdt + 8 * hf);
    }
    if (!(parts & 2)) return;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int r = (lane >> 1) + 16 * q;
      if (r < nr) *reinterpret_cast<uint4*>(yb + std::int64_t(r) * p.H * V) = *reinterpret_cast<const uint4*>(tD + r * kRsLdt + 8 * hf);
    }
  };
  if (warp == nw + kRsLoaders) {  // the storer
    if (!storer) return;
    for (std::int64_t s = 0; s < nch; ++s) {
      const int sb = int(s & 1);
      mbar_wait(sfull + sb, unsigned(s >> 1) & 1);
      for (int c = 0; c < nw && cb + 16 * c < V; ++c) store_tiles(c, s);
      mbar_arrive(sempty + sb);
    }
    return;
  }
  if (warp >= nw) {  // the loaders: chunk nch - 1 - s into buffer s % nbuf once its last step is done
    const int lw = warp - nw, cw = 16 * nw, ncv = int(lmin(cw, V - cb));
    const bf16* xwh = reinterpret_cast<const bf16*>(ws + w.xw);
    const bf16* qhw = reinterpret_cast<const bf16*>(ws + w.qh());
    const bf16* y00 = reinterpret_cast<const bf16*>(ws + w.Y) + row00 * V + cb;
    int bf_run = 0;       // DEFER: s % nbuf
    unsigned ph_run = 1;  // DEFER: (s / nbuf - 1) & 1
    for (std::int64_t s = 0; s < nch; ++s) {
      const int bf = DEFER ? bf_run : int(s % nbuf);
      if (s >= nbuf) mbar_wait(empty + bf, DEFER ? ph_run : unsigned(s / nbuf - 1) & 1);
      if constexpr (DEFER)
        if (++bf_run == nbuf) bf_run = 0, ph_run ^= 1u;
      const std::int64_t ci = nch - 1 - s, t0 = sq_.bos + ci * kT, row0 = row00 + ci * wrow_step;
      const int nr = int(lmin(kT, sq_.eos - t0));
      // k, Q^, Xw: padded rows for ldmatrix, or wgmma's swizzled blocks
      auto ktile = [&](std::size_t off, const bf16* src, std::int64_t rs) {
        bf16* dst = reinterpret_cast<bf16*>(at(bf, off));
        if constexpr (WG) {
          if (lfast) warp_load_tile_sw128_unrolled<KC>(dst, src, rs, nr, int(K), lane);
          else warp_load_tile_sw128(dst, src, rs, KC, nr, int(K), lane);
        } else {
          warp_load_tile(dst, LDK, src, rs, KC, nr, int(K), lane);
        }
      };
      if (lw == 0) {
        ktile(lay.k, bf_rows(p.k, b, t0, h), p.k.s1);
        if (qraw) ktile(lay.q, bf_rows(p.q, b, t0, h), p.q.s1);  // q itself: the chain scales dO^T by s rq
        else ktile(lay.q, qhw + row0 * K, p.H * K);
        float* sf = reinterpret_cast<float*>(atb(bf, lay.fac));
        // rk (factor 1), beta (factor 2), with qraw rq (factor 0) after them; zero past the sequence
        if (lfast) {  // the same copies: rows lane, lane + 32 of each factor from two row offsets
          const float* f0 = ws + w.fac + row0 + std::int64_t(lane) * p.H;
          const std::int64_t h32 = 32 * p.H;
          const bool in0 = lane < nr, in1 = lane + 32 < nr;
#pragma unroll
          for (int e = 0; e < 3; ++e) {  // sf slots e kT ..: factor 1, 2, then 0
            if (e == 2 && !qraw) break;
            const float* fr = f0 + (e == 2 ? 0 : (e + 1) * w.rows);
            cp_async4_z(sf + e * kT + lane, in0 ? fr : ws, in0 ? 4 : 0);
            cp_async4_z(sf + e * kT + lane + 32, in1 ? fr + h32 : ws, in1 ? 4 : 0);
          }
        } else {
          for (int e = lane; e < (qraw ? 3 : 2) * kT; e += 32) {
            const int f = e < 2 * kT ? 1 + e / kT : 0, i = e % kT;
            cp_async4_z(sf + e, i < nr ? ws + w.fac + f * w.rows + row0 + i * p.H : ws, i < nr ? 4 : 0);
          }
        }
      } else {
        ktile(lay.xw, xwh + row0 * K, p.H * K);
        warp_load_tile(reinterpret_cast<bf16*>(atb(bf, lay.dO)), LDC, bf_rows(p.do_, b, t0, h) + cb, p.do_.s1, cw, nr,
                       ncv, lane);
        warp_load_tile(reinterpret_cast<bf16*>(atb(bf, lay.y)), LDC, y00 + ci * wrow_step * V, p.H * V, cw, nr, ncv,
                       lane);
      }
      cp_async_mbar_arrive(full + bf);
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }
  // a chain warp: columns c0 .. c0 + 15 of V (cw of the CTA's tile)
  const int g = lane >> 2, t4 = lane & 3, m8 = lane >> 3, r8 = lane & 7;
  const int cw = 16 * warp;
  const std::int64_t c0 = cb + cw;
  const bool live = c0 < V;  // V % 16 == 0: whole 16-column slices
  // stmatrix.trans lane row of an (8 j0 ..) x 16 block pair: matrix m8 = (row block m8 / 2, column half m8 % 2)
  constexpr int LDT = WIDE ? kPld : kRsLdt;  // the transposition tiles' stride
  // (TMA: the swizzled chunk; the 8-row blocks start at multiples of 8, so row & 7 = r8)
  const int st_off = TMA ? (8 * (m8 >> 1) + r8) * LDT + 8 * ((2 * warp + (m8 & 1)) ^ r8)
                         : (8 * (m8 >> 1) + r8) * LDT + 8 * (m8 & 1) + (WIDE ? cw : 0);
  // WIDE: step sp's tile pair (its rows 16 j + 4 warp + lane / 8, 16-byte piece lane % 8) to the workspace
  const int ncw = int(lmin(16 * nw, V - cb));  // the CTA's columns (V % 16 == 0: whole pieces)
  auto store_wide = [&](std::int64_t sp) {
    const std::int64_t ci = nch - 1 - sp;
    const int nr = int(lmin(kT, sq_.eos - (sq_.bos + ci * kT)));
    const int r0 = 4 * warp + (lane >> 3), pc = 8 * (lane & 7);
    const bool col = pc < ncw;
    const bf16* t = tile_w(int(sp & 1)) + r0 * kRsLdw + pc;
    constexpr int NS = KC / 16, NR = (KC + kT) / 16;  // row groups of dSe^T, of both
    uint4 v[NR];  // every piece into registers of its own first (see store_tiles)
#pragma unroll
    for (int j = 0; j < NR; ++j) v[j] = *reinterpret_cast<const uint4*>(t + 16 * j * kRsLdw);
    char* gs = reinterpret_cast<char*>(state_mats<false>(ws + w.dS, sq_.base + ci, p.H, h, K, V) + cb + r0 * V + pc);
    char* gy = reinterpret_cast<char*>(reinterpret_cast<bf16*>(ws + w.Y) + (row00 + ci * wrow_step + std::int64_t(r0) * p.H) * V + cb + pc);
    const std::int64_t ss = 32 * V, sy = 32 * p.H * V;  // bytes between 16 rows
#pragma unroll
    for (int j = 0; j < NS; ++j, gs += ss)
      if (col && r0 + 16 * j < K) st_global_v4u(gs, v[j]);
#pragma unroll
    for (int j = NS; j < NR; ++j, gy += sy)
      if (col && r0 + 16 * (j - NS) < nr) st_global_v4u(gy, v[j]);
  };
  // TMA: step sp's pair by the two tensor-map stores (thread 0, one bulk group), dD's rows by the chain
  // threads where the chunk is short (rows 16 j + 4 warp + lane / 8 < nr, 16-byte piece lane % 8, from
  // the swizzled tile; its generic reads after the barrier that ordered the writes)
  auto store_tma = [&](std::int64_t sp) {
#if defined(FW_HAS_BULK)
    const std::int64_t ci = nch - 1 - sp;
    const int nr = int(lmin(kT, sq_.eos - (sq_.bos + ci * kT)));
    const bf16* t = tile_w(int(sp & 1));
    if (tid == 0) {
      tma_store_3d(&map_s, t, int(cb), 0, int((sq_.base + ci) * p.H + h));
      if (nr == kT) tma_store_3d(&map_y, t + KC * kT, int(cb), int(h), int(b * p.T + sq_.bos + ci * kT));
      bulk_commit();
    }
    if (nr < kT) {
      const int r0 = 4 * warp + (lane >> 3), pc = 8 * (lane & 7);
      const bf16* ty = t + (KC + r0) * kT + 8 * ((pc >> 3) ^ (r0 & 7));  // rows r0 + 16 j: the same r & 7
      char* gy = reinterpret_cast<char*>(reinterpret_cast<bf16*>(ws + w.Y) + (row00 + ci * wrow_step + std::int64_t(r0) * p.H) * V + cb + pc);
#pragma unroll
      for (int j = 0; j < kT / 16; ++j, gy += 32 * p.H * V)
        if (pc < ncw && r0 + 16 * j < nr) st_global_v4u(gy, *reinterpret_cast<const uint4*>(ty + 16 * j * kT));
    }
#endif
  };
  float acc[NK][4];  // dS^T: acc[j][e] at row (V) c0 + g + 8 (e / 2), column (K) 8 j + 2 t4 + e % 2
#pragma unroll
  for (int j = 0; j < NK; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const std::int64_t kk = 8 * j + 2 * t4 + (e & 1), v = c0 + g + 8 * (e >> 1);
      acc[j][e] = p.dht.p && kk < K && v < V ? mlstm_ld(p.dht, n * p.dht.s0 + h * p.dht.s1 + kk * p.dht.s2 + v) : 0.f;
    }
  // The products' B (and G's A) fragments come through a ring of kRsPf ldmatrix results issued kRsPf
  // units (a unit: one ldmatrix.x4, two mma) ahead of their use: one warp per SM sub-partition has no
  // other warp to hide a load's latency behind. Phase A, per k-step ks of K: four units of
  // X1 = dSe^T K^T, then four of dO^T Q^; phase C: B Xw, K n-tile pairs within chunk k-steps.
  constexpr int NA = 8 * KS, NC = 4 * KS;
  std::uint32_t fb[kRsPf][4];
  const int rb_nm = ld_row_b_nmajor(lane), cb_nm = ld_col_b_nmajor(lane);
  const int rb_km = ld_row_b_kmajor(lane), cb_km = ld_col_b_kmajor(lane);
  const bf16* sk = nullptr;
  const bf16* sq = nullptr;
  const bf16* sx = nullptr;
  auto load_a = [&](int u, std::uint32_t (&r)[4]) {  // phase A's unit u
    const int ks = u / 8, x = u % 8;
    if (x < 4) {
      ldsm_x4(r, sk + (16 * x + rb_nm) * LDK + 16 * ks + cb_nm);  // K rows 16 x .. (chunk), columns 16 ks ..
    } else {
      const int gu = 4 * ks + x - 4, gs = gu / KS, np = gu % KS;  // chunk rows 16 gs .., K columns 16 np ..
      ldsm_x4_t(r, sq + (16 * gs + rb_km) * LDK + 16 * np + cb_km);
    }
  };
  auto load_c = [&](int u, std::uint32_t (&r)[4]) {  // phase C's unit u: chunk rows 16 (u / KS) .., K columns 16 (u % KS) ..
    ldsm_x4_t(r, sx + (16 * (u / KS) + rb_km) * LDK + 16 * (u % KS) + cb_km);
  };
  int bf_run = 0;       // DEFER: s % nbuf
  unsigned ph_run = 0;  // DEFER: (s / nbuf) & 1
  for (std::int64_t s = 0; s < nch; ++s) {
    const std::int64_t ci = nch - 1 - s, t0 = sq_.bos + ci * kT;
    const int bf = DEFER ? bf_run : int(s % nbuf), nr = int(lmin(kT, sq_.eos - t0));
    const unsigned fph = DEFER ? ph_run : unsigned(s / nbuf) & 1;
    if constexpr (DEFER)
      if (++bf_run == nbuf) bf_run = 0, ph_run ^= 1u;
    // a. dSe^T as bf16 A fragments (k-step ks: columns 16 ks ..), and into the warp's dSe tile
    //    (transposed; stored to the workspace at the step's end, for the chunk pass)
    std::uint32_t a[KS][4];
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      a[ks][0] = pack_bf16(acc[2 * ks][0], acc[2 * ks][1]);
      a[ks][1] = pack_bf16(acc[2 * ks][2], acc[2 * ks][3]);
      a[ks][2] = pack_bf16(acc[2 * ks + 1][0], acc[2 * ks + 1][1]);
      a[ks][3] = pack_bf16(acc[2 * ks + 1][2], acc[2 * ks + 1][3]);
    }
    // the tile pair s % 2: (KC, 24) dSe^T, (64, 24) dD, both transposed (WIDE: the CTA's pair, (KC + 64,
    // 72)); free once the storer (or this warp, or with WIDE every chain warp) is done with step s - 2
    bf16* trS = WIDE ? tile_w(int(s & 1)) : tile(warp, int(s & 1));
    bf16* trD = T1 ? trS : trS + std::size_t(KC) * LDT;
    if constexpr (WIDE) {
      // every chain warp is done with step s - 1: its writes of pair (s - 1) % 2 (read below) and its
      // reads (stores) of pair s % 2 (written below). TMA: thread 0's tensor stores of pair s % 2 (step
      // s - 1's group) have read it, and each thread's writes of pair (s - 1) % 2 are visible to the
      // async proxy (stored after the barrier)
      if constexpr (TMA) {
        if (tid == 0) bulk_wait_read();
        bulk_fence_shared();
      }
      asm volatile("bar.sync 1, %0;\n" ::"n"(32 * 4) : "memory");
    } else if (!storer) {
      __syncwarp();  // this warp's own stores of step s - 2 (T1: s - 1) have read the tiles
    } else if (s >= 2) {
      mbar_wait(sempty + (s & 1), unsigned((s >> 1) - 1) & 1);
    }
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) stsm_x4_t(trS + 16 * ks * LDT + st_off, a[ks]);
    if constexpr (T1) {  // dSe^T out now (while the chunk's loads land): the tile then takes dD
      __syncwarp();
      if (live) store_tiles(warp, s, 1);
    }
    mbar_wait(full + bf, fph);  // chunk ci's operands landed
    sk = reinterpret_cast<const bf16*>(at(bf, lay.k));
    sq = reinterpret_cast<const bf16*>(at(bf, lay.q));
    sx = reinterpret_cast<const bf16*>(at(bf, lay.xw));
    const bf16* so = reinterpret_cast<const bf16*>(atb(bf, lay.dO));
    const bf16* sy = reinterpret_cast<const bf16*>(atb(bf, lay.y));
    const float* sf = reinterpret_cast<const float*>(atb(bf, lay.fac));  // rk [64], beta [64], qraw: rq [64]
    std::uint32_t ao[4][4], y4[4][4];  // dO^T's A fragments (chunk k-steps); dD0 at X1's positions
    // b. phase A: X1 = dSe^T K^T (16 x 64; the chain), dO^T Q^ into acc between its units
    float x1[8][4] = {};
    float (&x1f)[32] = reinterpret_cast<float (&)[32]>(x1);  // the wgmma accumulator views
    float (&accf)[KC / 2] = reinterpret_cast<float (&)[KC / 2]>(acc);
    auto wg_x1 = [&] {  // X1 on wgmma, one group. K-major: block ks / 4 (4096 elements), + 16 elements per k-step
      // (X1F: one encoded descriptor, then constant offsets in 16-byte units: 8192 and 32 bytes)
      [[maybe_unused]] const std::uint64_t dk0 = X1F ? gmma_desc_sw128(sk, 16, 1024) : 0;
#pragma unroll
      for (int ks = 0; ks < KS; ++ks)
        wgmma_m64n64k16_rs<0>(x1f, a[ks],
                              X1F ? gmma_desc_add(dk0, std::uint32_t((ks / 4) * 512 + (ks % 4) * 2))
                                  : gmma_desc_sw128(sk + (ks / 4) * 4096 + (ks % 4) * 16, 16, 1024),
                              true);
      wgmma_commit();
    };
    if constexpr (WG) {
      bulk_fence_shared();  // the loaders' cp.async writes (generic proxy), seen through the
                            // mbarrier, before wgmma reads them (async proxy)
      if constexpr (X1F) {  // the chain's product first; dO^T, dD0 and the qraw scaling below while it runs
        wgmma_fence_operand(x1f);
        wgmma_fence();  // a, x1 written
        if (!skip(8)) wg_x1();
        // DEFER: the previous step's tiles (s - 1: the other pair) go out while X1 runs, instead of at
        // that step's end on the chain (the warp's __syncwarp at the step's end ordered their writes;
        // WIDE: the chain warps' barrier at this step's top, every warp's columns)
        if constexpr (TMA) {
          if (s > 0) store_tma(s - 1);
        } else if constexpr (WIDE) {
          if (s > 0) store_wide(s - 1);
        } else if constexpr (DEFER) {
          if (s > 0 && live && !skip(1)) store_tiles(warp, s - 1, 3);
        }
      }
    } else {
#pragma unroll
      for (int u = 0; u < kRsPf; ++u) load_a(u, fb[u]);
    }
#pragma unroll
    for (int gs = 0; gs < 4; ++gs) ldsm_x4_t(ao[gs], so + (16 * gs + ld_row_a_kmajor(lane)) * LDC + cw + ld_col_a_kmajor(lane));
    if (qraw && !skip(2)) {  // dO^T Q^ = (dO^T diag(s rq)) q: register r holds chunk rows 16 gs + 2 t4 + 8 (r / 2) + {0, 1}
#pragma unroll
      for (int gs = 0; gs < 4; ++gs)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const float2 rq2 = *reinterpret_cast<const float2*>(sf + 2 * kT + 16 * gs + 2 * t4 + 8 * (r >> 1));
          const float2 o = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&ao[gs][r]));
          ao[gs][r] = pack_bf16(p.scale * rq2.x * o.x, p.scale * rq2.y * o.y);
        }
    }
#pragma unroll
    for (int jp = 0; jp < 4; ++jp) ldsm_x4_t(y4[jp], sy + (16 * jp + 8 * (m8 >> 1) + r8) * LDC + cw + 8 * (m8 & 1));
    // wgmma into dS^T: B = chunk rows 16 ks .. of Q^ or Xw ([i][K columns]: MN-major), n = KC
    // (X1F: b0's descriptor encoded once a step, dq0 / dx0, then + 2048 bytes a k-step)
    [[maybe_unused]] const std::uint64_t dq0 = X1F ? gmma_desc_sw128(sq, 8192, 1024) : 0;
    [[maybe_unused]] const std::uint64_t dx0 = X1F ? gmma_desc_sw128(sx, 8192, 1024) : 0;
    auto wg_n = [&](const std::uint32_t (&af)[4], const bf16* b0, std::uint64_t d0, int ks) {
      const std::uint64_t desc = X1F ? gmma_desc_add(d0, std::uint32_t(ks * 128))
                                     : gmma_desc_sw128(b0 + ks * 1024, 8192, 1024);  // + 16 rows of 128 bytes
      if constexpr (KC == 128) wgmma_m64n128k16_rs<1>(accf, af, desc, true);
      else wgmma_m64n64k16_rs<1>(accf, af, desc, true);
    };
    if constexpr (WG) {
      wgmma_fence_operand(accf);  // acc, (x1's zeros): written before the fence
      if constexpr (!X1F) wgmma_fence_operand(x1f);
      wgmma_fence();  // ao (a, x1) written
      if constexpr (!X1F) wg_x1();
#pragma unroll
      for (int gs = 0; gs < 4; ++gs) wg_n(ao[gs], sq, dq0, gs);
      wgmma_commit();
      wgmma_wait<1>();  // X1 (the first group); dO^T Q^ may still run
      wgmma_fence_operand(x1f);
    }
#pragma unroll
    for (int u = 0; u < (WG ? 0 : NA); ++u) {
      const int ks = u / 8, x = u % 8;
      std::uint32_t (&r)[4] = fb[u % kRsPf];
      if (x < 4) {
        mma_bf16_16816(x1[2 * x], a[ks], r[0], r[1]);
        mma_bf16_16816(x1[2 * x + 1], a[ks], r[2], r[3]);
      } else {
        const int gu = 4 * ks + x - 4, gs = gu / KS, np = gu % KS;
        mma_bf16_16816(acc[2 * np], ao[gs], r[0], r[1]);
        mma_bf16_16816(acc[2 * np + 1], ao[gs], r[2], r[3]);
      }
      if (u + kRsPf < NA) load_a(u + kRsPf, r);
      else load_c(u + kRsPf - NA, r);  // phase C's first units, ahead of the epilogue
    }
    // c. dD = dD0 + diag(rk) X1^T (chunk rows i; zero past the sequence) into the warp's dD tile
    //    (transposed); B = -(W dD)^T as bf16 A fragments of the update
    std::uint32_t dpk[8][2], a2[4][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int i0 = 8 * j + 2 * t4;
      const float2 rk2 = *reinterpret_cast<const float2*>(sf + i0);
      const float2 bt2 = *reinterpret_cast<const float2*>(sf + kT + i0);
#pragma unroll
      for (int hv = 0; hv < 2; ++hv) {  // rows g, g + 8 of the warp's columns
        const float2 y = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&y4[j >> 1][2 * (j & 1) + hv]));
        const float d0 = i0 < nr ? fmaf(rk2.x, x1[j][2 * hv], y.x) : 0.f;
        const float d1 = i0 + 1 < nr ? fmaf(rk2.y, x1[j][2 * hv + 1], y.y) : 0.f;
        dpk[j][hv] = pack_bf16(d0, d1);
        a2[j >> 1][2 * (j & 1) + hv] = pack_bf16(-bt2.x * d0, -bt2.y * d1);
      }
    }
    if constexpr (T1) __syncwarp();  // every lane's reads of dSe^T from the tile are done
#pragma unroll
    for (int jp = 0; jp < 4; ++jp) {
      const std::uint32_t r4[4] = {dpk[2 * jp][0], dpk[2 * jp][1], dpk[2 * jp + 1][0], dpk[2 * jp + 1][1]};
      stsm_x4_t(trD + 16 * jp * LDT + st_off, r4);
    }
    // d. phase C: dS^T += B Xw
    if constexpr (WG) {
      wgmma_fence_operand(accf);
      wgmma_fence();  // a2 written
      if (!skip(32)) {
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) wg_n(a2[ks], sx, dx0, ks);
      }
      wgmma_commit();
      wgmma_wait<0>();
      wgmma_fence_operand(accf);
    }
#pragma unroll
    for (int u = 0; u < (WG ? 0 : NC); ++u) {
      std::uint32_t (&r)[4] = fb[(NA + u) % kRsPf];
      const int ks = u / KS, np = u % KS;
      mma_bf16_16816(acc[2 * np], a2[ks], r[0], r[1]);
      mma_bf16_16816(acc[2 * np + 1], a2[ks], r[2], r[3]);
      if (u + kRsPf < NC) load_c(u + kRsPf, r);
    }
    __syncwarp();  // the tiles are written (the warp's own stores below read other lanes' rows)
    mbar_arrive(empty + bf);  // this lane's reads of buffer bf are done
    if (storer) mbar_arrive(sfull + (s & 1));
    if constexpr (!DEFER)
      if (!storer && live) store_tiles(warp, s, T1 ? 2 : 3);
  }
  if constexpr (TMA) {
    bulk_fence_shared();
    asm volatile("bar.sync 1, %0;\n" ::"n"(32 * 4) : "memory");  // the last pair written by every chain warp
    if (nch > 0) store_tma(nch - 1);
    if (tid == 0) bulk_wait_all();  // complete before the CTA's shared memory goes
  } else if constexpr (WIDE) {
    asm volatile("bar.sync 1, %0;\n" ::"n"(32 * 4) : "memory");  // the last pair written by every chain warp
    if (nch > 0) store_wide(nch - 1);
  } else if constexpr (DEFER) {
    if (nch > 0 && live && !skip(1)) store_tiles(warp, nch - 1, 3);  // the last step's (ordered by its __syncwarp)
  }
  if (p.dh0.p && live) {
#pragma unroll
    for (int j = 0; j < NK; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const std::int64_t kk = 8 * j + 2 * t4 + (e & 1), v = c0 + g + 8 * (e >> 1);
        if (kk < K) mlstm_st(p.dh0, n * p.dh0.s0 + h * p.dh0.s1 + kk * p.dh0.s2 + v, acc[j][e]);
      }
  }
#endif
}

std::atomic<int> g_serial_rs{1};  // set_deltanet_bwd_serial_rs
std::atomic<bool> g_rs_storer{false};  // set_deltanet_bwd_serial_rs_storer
std::atomic<bool> g_rs_t1{false};      // set_deltanet_bwd_serial_rs_t1
// qraw on by default (H100, session 30: bwd 0.977-0.985x alone); T1 off (0.98-1.02x: no gain from the third buffer)
std::atomic<bool> g_rs_qraw{true};     // set_deltanet_bwd_serial_rs_qraw
std::atomic<bool> g_rs_lfast{false};   // set_deltanet_bwd_serial_rs_lfast (H100, session 31: 1.00x)
// X1 first, the lean stores and DEFER on by default as the ground WIDE stands on (alone each 1.00x,
// H100, session 31). WIDE on (H100, session 32, bf16 operands, bwd ms against all four off, two calls):
// 0.999-1.002 / 0.964-0.987 / 0.998-1.010 / 0.940-0.953 / 0.972-0.976 at (4,4096,16,128) / (2,8192) /
// (8,2048,32,64) / (1,32768) / varlen 8 in 32768 (the stores left out, the probe: 0.948 / 0.942 at the
// first and the last).
std::atomic<bool> g_rs_x1first{true};  // set_deltanet_bwd_serial_rs_x1first
std::atomic<bool> g_rs_slean{true};    // set_deltanet_bwd_serial_rs_slean
std::atomic<bool> g_rs_defer{true};    // set_deltanet_bwd_serial_rs_defer
std::atomic<bool> g_rs_wide{true};     // set_deltanet_bwd_serial_rs_wide
std::atomic<int> g_rs_tma{2};          // set_deltanet_bwd_serial_rs_tma: 2 the planner's choice
std::atomic<int> g_rs_probe{0};         // set_deltanet_bwd_serial_rs_probe (timing probes: wrong results)
std::atomic<int> g_rs_last{-1};        // deltanet_bwd_serial_rs_last_launch

using Fn = void (*)(const DeltanetBwdParams, const DnBwdWs, float*, int, int, bool, bool, bool, bool, const CUtensorMap,
                    const CUtensorMap);
using Bytes = std::size_t (*)(int, int);
// [Kc 64][instance: mma.sync, wgmma, wgmma with one tile (T1), then those two with X1 first, then the
// wgmma form with X1 first and the deferred stores, that with the timing probes, and with whole rows]
constexpr Fn kRsFns[2][9] = {
    {&deltanet_bwd_state_rs_kernel<128>, &deltanet_bwd_state_rs_kernel<128, true>,
     &deltanet_bwd_state_rs_kernel<128, true, true>, &deltanet_bwd_state_rs_kernel<128, true, false, true>,
     &deltanet_bwd_state_rs_kernel<128, true, true, true>, &deltanet_bwd_state_rs_kernel<128, true, false, true, true>,
     &deltanet_bwd_state_rs_kernel<128, true, false, true, true>,  // (6: a probe; rs_probe_fn picks it)
     &deltanet_bwd_state_rs_kernel<128, true, false, true, true, 0, true>,
     &deltanet_bwd_state_rs_kernel<128, true, false, true, true, 0, true, true>},
    {&deltanet_bwd_state_rs_kernel<64>, &deltanet_bwd_state_rs_kernel<64, true>,
     &deltanet_bwd_state_rs_kernel<64, true, true>, &deltanet_bwd_state_rs_kernel<64, true, false, true>,
     &deltanet_bwd_state_rs_kernel<64, true, true, true>, &deltanet_bwd_state_rs_kernel<64, true, false, true, true>,
     &deltanet_bwd_state_rs_kernel<64, true, false, true, true>,  // (6: no probes at K <= 64)
     &deltanet_bwd_state_rs_kernel<64, true, false, true, true, 0, true>,
     &deltanet_bwd_state_rs_kernel<64, true, false, true, true, 0, true, true>}};
// The probe instances (K = 128 only): mask -> kernel, else null
Fn rs_probe_fn(int mask) {
  switch (mask) {
    case 1: return &deltanet_bwd_state_rs_kernel<128, true, false, true, true, 1>;
    case 2: return &deltanet_bwd_state_rs_kernel<128, true, false, true, true, 2>;
    case 8: return &deltanet_bwd_state_rs_kernel<128, true, false, true, true, 8>;
    case 32: return &deltanet_bwd_state_rs_kernel<128, true, false, true, true, 32>;
    case 40: return &deltanet_bwd_state_rs_kernel<128, true, false, true, true, 40>;
    default: return nullptr;
  }
}
int rs_instance(const DnRsPlan& plan) {
  if (plan.defer) return g_rs_probe.load(std::memory_order_relaxed) ? 6 : plan.wide ? (plan.tma ? 8 : 7) : 5;
  return plan.form + (plan.form > 0 && plan.x1f ? 2 : 0);
}

template <int KC, bool WG, bool T1>
std::size_t rs_bytes(int nw, int nbuf) { return BrLayout<KC, WG, T1>(nw, nbuf).bytes; }

}  // namespace

bool set_deltanet_bwd_serial_rs_storer(bool on) { return g_rs_storer.exchange(on); }
bool set_deltanet_bwd_serial_rs_t1(bool on) { return g_rs_t1.exchange(on); }
bool set_deltanet_bwd_serial_rs_qraw(bool on) { return g_rs_qraw.exchange(on); }
bool set_deltanet_bwd_serial_rs_lfast(bool on) { return g_rs_lfast.exchange(on); }
bool set_deltanet_bwd_serial_rs_x1first(bool on) { return g_rs_x1first.exchange(on); }
bool set_deltanet_bwd_serial_rs_slean(bool on) { return g_rs_slean.exchange(on); }
bool set_deltanet_bwd_serial_rs_defer(bool on) { return g_rs_defer.exchange(on); }
int set_deltanet_bwd_serial_rs_probe(int mask) { return g_rs_probe.exchange(rs_probe_fn(mask) ? mask : 0); }
bool set_deltanet_bwd_serial_rs_wide(bool on) { return g_rs_wide.exchange(on); }
int set_deltanet_bwd_serial_rs_tma(int mode) { return g_rs_tma.exchange(mode == 1 || mode == 2 ? mode : 0); }
int deltanet_bwd_serial_rs_last_launch(int reset) { return g_rs_last.exchange(reset); }

int set_deltanet_bwd_serial_rs(int mode) {
  return g_serial_rs.exchange(mode == 2 || mode == 4 || mode == 5 ? mode : mode > 0 ? 1 : 0);
}

DnRsPlan deltanet_bwd_serial_rs_plan(const DeltanetBwdParams& p, const DnBwdWs& w, bool vq, bool vk, bool vo) {
  DnRsPlan plan;
  const int mode = g_serial_rs.load(std::memory_order_relaxed);
  if (mode == 0 || p.hilo || !w.xb || p.K > 128 || p.K % 8 != 0 || p.V % 16 != 0 || !vk || !vo) return plan;
  const std::int64_t seqs = p.N * p.H;
  // 4 chain warps per CTA (one per SM sub-partition), 2 with variable lengths. Measured (H100, bwd
  // ms against the other serial kernels, session 28): 4 warps 0.998 / 0.959 / 0.988 / 0.948 / 0.982 at
  // (4,4096,16,128) / (2,8192) / (8,2048,32,64) / (1,32768) / varlen 8 in 32768; 2 warps 1.104 /
  // 1.104 / 1.061 / 1.015 / 0.961 (twice the CTAs loading a head's k, Q^, Xw: the batched shapes are
  // bound by L2, and (1,32768)'s chain shares it with the recompute beside it; varlen runs alone).
  // The wgmma form (one warpgroup of chain warps, B read once per warpgroup) where the binary is sm_90a:
  // measured (H100, session 29, bwd ms against the mma form's choice) 0.996 / 0.987 / 0.994 / 0.971 /
  // 0.998 at the five rows above, bits equal to nothing else (its own products' order).
  auto tiles = [&](int nw) { return (p.V + 16 * nw - 1) / (16 * nw); };
  const bool wg = (mode == 1 || mode == 5) &&
                  kernel_runs_sm90a(reinterpret_cast<const void*>(&deltanet_bwd_state_rs_kernel<128, true>));
  const int nw = wg ? 4 : mode == 1 || mode == 5 ? (p.cu_seqlens ? 2 : 4) : mode;
  const bool k64 = p.K <= 64, t1 = wg && g_rs_t1.load(std::memory_order_relaxed);
  static constexpr Bytes kBytes[2][3] = {{&rs_bytes<128, false, false>, &rs_bytes<128, true, false>, &rs_bytes<128, true, true>},
                                         {&rs_bytes<64, false, false>, &rs_bytes<64, true, false>, &rs_bytes<64, true, true>}};
  const std::size_t cap = smem_per_block_optin() - 1024;  // dn_chain_cta's static shared int beside it
  // T1 only where the plain wgmma form fits too: the same kernel family (and bits) either way
  const int form = t1 && kBytes[k64][1](nw, 2) <= cap ? 2 : wg ? 1 : 0;
  const bool x1f = form > 0 && g_rs_x1first.load(std::memory_order_relaxed);
  // DEFER: the X1-first wgmma form with two tile pairs (not T1) and no storer warp
  const bool defer = x1f && form == 1 && !g_rs_storer.load(std::memory_order_relaxed) &&
                     g_rs_defer.load(std::memory_order_relaxed);
  // WIDE: DEFER with the CTA's tile pair (4 chain warps: the wgmma form's one warpgroup)
  const bool wide = defer && nw == 4 && g_rs_wide.load(std::memory_order_relaxed);
  const Fn fn = kRsFns[k64][defer ? (wide ? 7 : 5) : form + (x1f ? 2 : 0)];
  auto bytes = [&](int nb) { return kBytes[k64][form](nw, nb); };
  // the deepest ring that fits: 3 buffers (T1: up to 4), else 2
  int nbuf = 2;
  for (int nb = form == 2 ? 4 : 3; nb > 2; --nb)
    if (bytes(nb) <= cap) {
      nbuf = nb;
      break;
    }
  if (bytes(nbuf) > cap || kernel_binary_version(reinterpret_cast<const void*>(fn)) < 90) return plan;  // (wg: sm_90a above)
  const std::int64_t nt = tiles(nw);
  if (seqs > 0x7fffffff || nt > 65535) throw Error(cat("deltanet_bwd: grid too large (", seqs, " sequence-heads)"));
  plan.applies = true, plan.k64 = k64, plan.form = form, plan.x1f = x1f, plan.defer = defer, plan.wide = wide, plan.nw = nw, plan.nbuf = nbuf;
  // TMA: WIDE's pair by tensor-map stores where V fills a box (the maps are encoded at the launch, which
  // falls back to WIDE where they cannot be); the instance's binary is the WIDE one's. Mode 2: with
  // variable lengths (the long sequences' CTAs run on alone) or where the grid leaves half the SMs idle,
  // where each CTA's chain is the critical path and one thread's two stores a step shorten it; it lost
  // 1.2-1.5% at (4,4096,16,128) (128 CTAs), for a reason not found.
  const int tmode = g_rs_tma.load(std::memory_order_relaxed);
  plan.tma = wide && p.V >= kT &&
             (tmode == 1 || (tmode == 2 && (p.cu_seqlens || 2 * seqs * nt <= std::int64_t(sm_count()))));
  plan.bytes = bytes(nbuf);
  plan.grid_x = seqs, plan.grid_y = nt;
  plan.qraw = vq && g_rs_qraw.load(std::memory_order_relaxed);  // q's rows 16-byte aligned for cp.async
  return plan;
}

void deltanet_bwd_serial_rs_launch(const DnRsPlan& plan, const DeltanetBwdParams& p, const DnBwdWs& w, float* ws,
                                   Stream stream) {
  int inst = rs_instance(plan);
  // TMA's maps: dS as (V, K, slots H) bf16 matrices in boxes of (64, K, 1); Y as (V, H, B T) rows in
  // boxes of (64, 1, 64); both in the 128-byte swizzle. Where either cannot be encoded: WIDE.
  CUtensorMap map_s{}, map_y{};
  if (inst == 8) {
    const std::uint64_t slots_h = std::uint64_t(deltanet_slots(p)) * std::uint64_t(p.H), tokens = std::uint64_t(p.B * p.T);
    const std::uint64_t V = std::uint64_t(p.V), K = std::uint64_t(p.K), H = std::uint64_t(p.H);
    const std::uint64_t ds[3] = {V, K, slots_h}, ss[2] = {2 * V, 2 * V * K};
    const std::uint64_t dy[3] = {V, H, tokens}, sy[2] = {2 * V, 2 * V * H};
    const std::uint32_t bs[3] = {std::uint32_t(kT), std::uint32_t(K), 1}, by[3] = {std::uint32_t(kT), 1, std::uint32_t(kT)};
    const bool ok = slots_h < (std::uint64_t(1) << 31) && tokens < (std::uint64_t(1) << 31) &&
                    encode_bf16_tile_map(&map_s, ws + w.dS, 3, ds, ss, bs, 128) &&
                    encode_bf16_tile_map(&map_y, ws + w.Y, 3, dy, sy, by, 128);
    if (!ok) inst = 7;
  }
  const Fn probe_fn = inst == 6 && !plan.k64 ? rs_probe_fn(g_rs_probe.load(std::memory_order_relaxed)) : nullptr;
  const Fn fn = probe_fn ? probe_fn : kRsFns[plan.k64][inst];
  const int threads = 32 * (plan.nw + kRsAux);
  (void)resident_ctas_per_sm(reinterpret_cast<const void*>(fn), threads, plan.bytes);
  fn<<<dim3(unsigned(plan.grid_x), unsigned(plan.grid_y)), threads, plan.bytes, reinterpret_cast<cudaStream_t>(stream)>>>(
      p, w, ws, plan.nw, plan.nbuf, g_rs_storer.load(std::memory_order_relaxed), plan.qraw,
      g_rs_lfast.load(std::memory_order_relaxed), g_rs_slean.load(std::memory_order_relaxed), map_s, map_y);
  FW_CUDA_CHECK_LAUNCH("deltanet_bwd (state pass: serial, dS in registers)");
  g_rs_last.store((inst == 8 ? 16 : inst) + (plan.qraw ? 8 : 0), std::memory_order_relaxed);  // (8 reported as 16)
}

}  // namespace fastweight::detail
