// deltanet_fwd_tc.cu: the DeltaNet chunkwise forward on tensor cores (bf16 q, k, v, o; K <= 128),
// version 2 of deltanet_fwd.cu, dispatched by deltanet_fwd_cuda where it applies.
// Same grid as version 1: one CTA (4 warps) per (sequence, head, 64-column tile of V), serial over
// chunks of 64, the state slice S (K x 64) in fp32 registers (warp w: rows 16w.. and 16(w+4)..).
// Per chunk, with rq, rk the L2 factors (1 without L2) and beta (docs/design/deltanet_chunk_tc.md;
// the algebra is emulated in tests/python/test_deltanet_design.py):
//   L = strict_lower(diag(beta rk) K K^T diag(rk)),  T = (I + L)^-1 (16 x 16 blocks, fp32, CUDA cores)
//   R = V - diag(rk) K S,  V' = T diag(beta) R,  o = scale (diag(rq) Q S + tril(diag(rq) Q K^T diag(rk)) V')
//   S += K^T diag(rk) V'
// Products on tensor cores; where a product feeds the state chain its operands are bf16 hi + lo
// (S, T diag(beta), R, rk V'), so the chain keeps ~16 bits per step, not bf16's 8.
#include "cuda/common/check.cuh"
#include "cuda/common/mma.cuh"
#include "cuda/deltanet/deltanet_common.cuh"
#include "cuda/deltanet/deltanet_cuda.h"
#include "cuda/deltanet/deltanet_tc.cuh"
#include "cuda/mlstm/mlstm_tc.cuh"

namespace fastweight::detail {
namespace {

using namespace dtc;
constexpr int kThreads = kTcThreads;
constexpr int kMaxK = 128;

// Dynamic smem: Kp = K rounded up to 16, ldk = Kp + 8 (bf16):
//   f32 L[64][65] | f32 T[64][65] | f32 rq[64], rk[64], beta[64] | f32 scratch[4][16][17] |
//   bf16 q[64][ldk] | k[64][ldk] | v[64][kLd] | Sh, Sl[Kp][kLd] | Th, Tl[64][kLd] | Rh, Rl[64][kLd] | Vp[64][kLd]
struct DnLayout {
  int Kp, ldk;
  std::size_t L, T, rq, rk, beta, scr, q, k, v, Sh, Sl, Th, Tl, Rh, Rl, Vp, bytes;
  __host__ __device__ explicit DnLayout(std::int64_t K) {
    Kp = int(round_up(K, 16)), ldk = Kp + 8;
    L = 0, T = L + 4 * 64 * 65, rq = T + 4 * 64 * 65, rk = rq + 4 * 64, beta = rk + 4 * 64, scr = beta + 4 * 64;
    q = round_up(scr + 4 * 4 * 16 * 17, 16);
    k = q + 2 * std::size_t(kT) * ldk, v = k + 2 * std::size_t(kT) * ldk;
    Sh = v + 2 * std::size_t(kT) * kLd, Sl = Sh + 2 * std::size_t(Kp) * kLd;
    Th = Sl + 2 * std::size_t(Kp) * kLd, Tl = Th + 2 * kT * kLd;
    Rh = Tl + 2 * kT * kLd, Rl = Rh + 2 * kT * kLd, Vp = Rl + 2 * kT * kLd;
    bytes = Vp + 2 * kT * kLd;
  }
};

__global__ void __launch_bounds__(kThreads, 1) deltanet_fwd_tc_kernel(const DeltanetParams p, const bool vq,
                                                                      const bool vk, const bool vv) {
  extern __shared__ float4 smem_raw[];
  char* base = reinterpret_cast<char*>(smem_raw);
  const DnLayout lay(p.K);
  float(*sL)[65] = reinterpret_cast<float(*)[65]>(base + lay.L);  // (64, 64) L, row i col j
  float(*sT)[65] = reinterpret_cast<float(*)[65]>(base + lay.T);  // (64, 64) T = (I + L)^-1
  float* s_rq = reinterpret_cast<float*>(base + lay.rq);
  float* s_rk = reinterpret_cast<float*>(base + lay.rk);
  float* s_beta = reinterpret_cast<float*>(base + lay.beta);
  float(*scr)[16][17] = reinterpret_cast<float(*)[16][17]>(base + lay.scr);  // (4 warps) 16 x 16 scratch
  bf16* sq = reinterpret_cast<bf16*>(base + lay.q);   // (64 steps, Kp) q
  bf16* sk = reinterpret_cast<bf16*>(base + lay.k);   // (64 steps, Kp) k
  bf16* sv = reinterpret_cast<bf16*>(base + lay.v);   // (64 steps, 64 V columns) v
  bf16* sSh = reinterpret_cast<bf16*>(base + lay.Sh); // (Kp, 64) S hi
  bf16* sSl = reinterpret_cast<bf16*>(base + lay.Sl); // (Kp, 64) S lo
  bf16* sTh = reinterpret_cast<bf16*>(base + lay.Th); // (64, 64) T diag(beta) hi
  bf16* sTl = reinterpret_cast<bf16*>(base + lay.Tl);
  bf16* sRh = reinterpret_cast<bf16*>(base + lay.Rh); // (64, 64) R hi, then rk V' hi
  bf16* sRl = reinterpret_cast<bf16*>(base + lay.Rl);
  bf16* sVp = reinterpret_cast<bf16*>(base + lay.Vp); // (64, 64) V' (bf16) for the output
  const int Kp = lay.Kp, ldk = lay.ldk;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const std::int64_t nh = blockIdx.x, n = nh / p.H, h = nh % p.H;
  const std::int64_t c0 = std::int64_t(blockIdx.y) * kT;
  const std::int64_t K = p.K, V = p.V;
  const int nc = int(lmin(kT, V - c0));
  const DnSeq seq = dn_seq(p, n);  // the sequence's rows: (b, [bos, eos))
  const std::int64_t b = seq.b, bos = seq.bos, eos = seq.eos;
  const int ngroups = Kp / 16;  // 16-row groups of S: warp w owns groups w and w + 4

  float acc_s[2][8][4];  // S (fp32), rows 16 (w + 4 gg)..
  state_load(acc_s, p.h0, n, h, c0, K, V, warp, lane);

  auto rows = [&](const StridedView& t, std::int64_t t0) {
    return static_cast<const bf16*>(t.p) + b * t.s0 + t0 * t.s1 + h * t.s2;
  };
  for (std::int64_t t0 = bos; t0 < eos; t0 += kT) {
    const int nr = int(lmin(kT, eos - t0));
    // a. the chunk's q, k (all K columns), v (this tile's columns), beta
    load_tile(sq, ldk, kT, Kp, rows(p.q, t0), p.q.s1, nr, int(K), vq);
    load_tile(sk, ldk, kT, Kp, rows(p.k, t0), p.k.s1, nr, int(K), vk);
    load_tile(sv, kLd, kT, kT, rows(p.v, t0) + c0, p.v.s1, nr, nc, vv);
    cp_async_commit();
    if (tid < kT) s_beta[tid] = tid < nr ? mlstm_ld(p.beta, p.beta.s0 * b + p.beta.s1 * (t0 + tid) + h) : 0.f;
    // b. S as bf16 hi + lo (the B operand of K S and Q S)
    state_split(acc_s, sSh, sSl, ngroups, warp, lane);
    cp_async_wait<0>();
    __syncthreads();
    if (tid < kT) s_rq[tid] = row_l2_factor(sq, ldk, Kp, tid, p.l2), s_rk[tid] = row_l2_factor(sk, ldk, Kp, tid, p.l2);
    __syncthreads();
    // c. L (rows of this warp) and R = V - diag(rk) K S as hi + lo
    {
      float g_acc[8][4] = {}, ks_acc[8][4] = {};
      mma_rn(g_acc, sk, ldk, warp, sk, ldk, Kp, lane);  // K K^T
      mma_rk(ks_acc, sk, ldk, warp, sSh, kLd, Kp, lane);
      mma_rk(ks_acc, sk, ldk, warp, sSl, kLd, Kp, lane);
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = 16 * warp + frow(lane, e), c = fcol(lane, j, e);
          sL[i][c] = c < i ? s_beta[i] * s_rk[i] * s_rk[c] * g_acc[j][e] : 0.f;
          const float vr = __bfloat162float(sv[i * kLd + c]);
          put_split(sRh, sRl, kLd, i, c, vr - s_rk[i] * ks_acc[j][e]);
        }
    }
    __syncthreads();
    // d. T = (I + L)^-1 (fp32, blocked)
    unit_lower_inverse(sL, sT, scr, warp, lane);
    // e. T diag(beta) as hi + lo (the A operand of V' = T diag(beta) R)
    for (int e = tid; e < 64 * 64; e += kThreads) {
      const int i = e / 64, j = e % 64;
      put_split(sTh, sTl, kLd, i, j, sT[i][j] * s_beta[j]);
    }
    __syncthreads();
    // f. V' = T diag(beta) R (rows of this warp), to smem as bf16 (for P V') and rk V' as hi + lo (for S)
    float vp[8][4] = {};
    mma_rk(vp, sTh, kLd, warp, sRh, kLd, 64, lane);
    mma_rk(vp, sTh, kLd, warp, sRl, kLd, 64, lane);
    mma_rk(vp, sTl, kLd, warp, sRh, kLd, 64, lane);
    __syncthreads();  // every warp is done reading R before it is overwritten
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = 16 * warp + frow(lane, e), c = fcol(lane, j, e);
        sVp[i * kLd + c] = __float2bfloat16_rn(vp[j][e]);
        put_split(sRh, sRl, kLd, i, c, s_rk[i] * vp[j][e]);
      }
    __syncthreads();
    // g. o = scale (diag(rq) Q S + tril(diag(rq) Q K^T diag(rk)) V')
    {
      float o[8][4] = {};
      chunk_output(o, sq, sk, ldk, Kp, sSh, sSl, sVp, s_rk, warp, lane);
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = 16 * warp + frow(lane, e);
          const std::int64_t c = c0 + fcol(lane, j, e);
          if (i < nr && c < V)
            mlstm_st(p.o, b * p.o.s0 + (t0 + i) * p.o.s1 + h * p.o.s2 + c, p.scale * s_rq[i] * o[j][e]);
        }
    }
    // h. S += K^T (rk V')
    state_update(acc_s, sk, ldk, sRh, sRl, ngroups, warp, lane);
    __syncthreads();  // the next chunk overwrites q, k, v, S hi/lo
  }
  if (p.ht.p) state_store(acc_s, p.ht, n, h, c0, K, V, warp, lane);
}

}  // namespace

bool deltanet_fwd_tc_applies(const DeltanetParams& p) {
  return p.q.dtype == DType::bf16 && p.k.dtype == DType::bf16 && p.v.dtype == DType::bf16 && p.o.dtype == DType::bf16 &&
         p.K >= 1 && p.K <= kMaxK;
}

void deltanet_fwd_tc_cuda(const DeltanetParams& p, Stream stream) {
  const std::int64_t seqs = p.N * p.H, vt = (p.V + kT - 1) / kT;
  if (seqs == 0) return;
  if (seqs > 0x7fffffff || vt > 65535) throw Error(cat("deltanet_fwd: grid too large (", seqs, " sequence-heads)"));
  const DnLayout lay(p.K);
  (void)resident_ctas_per_sm(reinterpret_cast<const void*>(&deltanet_fwd_tc_kernel), kThreads, lay.bytes);
  deltanet_fwd_tc_kernel<<<dim3(unsigned(seqs), unsigned(vt)), kThreads, lay.bytes,
                           reinterpret_cast<cudaStream_t>(stream)>>>(p, rows16_seq(p.q), rows16_seq(p.k),
                                                                     rows16_seq(p.v));
  FW_CUDA_CHECK_LAUNCH("deltanet_fwd");
}

}  // namespace fastweight::detail
