// deltanet_fwd.cu: chunkwise DeltaNet forward, version 1 (fp32 FMA on CUDA cores; correctness first).
// One CTA per (sequence n, head h, 64-column tile of V) walks its sequence in chunks of 64 with its
// slice of the state S (K x 64, fp32) in shared memory. Per chunk (rows i, j of the chunk), the WY
// form of the reference (src/reference/deltanet_ref.cpp):
//   G = K K^T (strictly lower part used),  R = V - K S0
//   d_i = beta_i (R_i - sum_{j<i} G_ij d_j)            (forward substitution, row by row)
//   o_i = scale (S0^T q_i + sum_{j<=i} (q_i . k_j) d_j),   S_end = S0 + K^T D
// with q, k rows L2-normalised first when asked (x / sqrt(sum x^2 + 1e-6), FLA's convention).
#include "cuda/common/check.cuh"
#include "cuda/deltanet/deltanet_common.cuh"
#include "cuda/deltanet/deltanet_cuda.h"

namespace fastweight::detail {
namespace {

constexpr int kC = 64;         // chunk length and tile edge
constexpr int kThreads = 256;  // 16 x 16 threads, 4 x 4 outputs of a 64 x 64 tile each
constexpr int kMaxK = int(kDeltanetFwdMaxK);

struct Smem {
  float S[kMaxK][kC + 1];  // (K, 64) this CTA's columns of the state
  float a[kC][kC + 1];     // (64, 64) tiles: q or k rows
  float b[kC][kC + 1];     // (64, 64) tiles: k rows
  float G[kC][kC + 1];     // (64, 64) k_i . k_j, then (q_i . k_j) masked
  float D[kC][kC + 1];     // (64, 64 columns) R, then d
  float rq[kC], rk[kC], beta[kC];  // per row: q / k L2 factors, beta
};

__global__ void __launch_bounds__(kThreads) deltanet_fwd_kernel(const DeltanetParams p) {
  extern __shared__ float4 smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
  const int tid = threadIdx.x, tr = tid / 16, tc = tid % 16;
  const std::int64_t nh = blockIdx.x, n = nh / p.H, h = nh % p.H;
  const std::int64_t c0 = std::int64_t(blockIdx.y) * kC;
  const std::int64_t K = p.K, V = p.V;
  const DnSeq sq = dn_seq(p, n);  // the sequence's rows: (b, [bos, eos))
  const std::int64_t b = sq.b, bos = sq.bos, eos = sq.eos;
  // S0 = initial state (or 0)
  for (std::int64_t e = tid; e < K * kC; e += kThreads) {
    const std::int64_t a = e / kC, c = e % kC;
    sm.S[a][c] = p.h0.p && c0 + c < V ? mlstm_ld(p.h0, n * p.h0.s0 + h * p.h0.s1 + a * p.h0.s2 + c0 + c) : 0.f;
  }
  __syncthreads();

  for (std::int64_t t0 = bos; t0 < eos; t0 += kC) {
    const int nc = int(eos - t0 < kC ? eos - t0 : kC);
    dn_row_factors(p, b, t0, nc, h, tid, sm.rq, sm.rk, sm.beta);
    if (p.save_S) {  // the backward's recompute: the state entering this chunk
      float* dst = p.save_S + ((sq.base + (t0 - bos) / kC) * p.H + h) * K * V;
      for (std::int64_t e = tid; e < K * kC; e += kThreads) {
        const std::int64_t a = e / kC, c = e % kC;
        if (c0 + c < V) dst[a * V + c0 + c] = sm.S[a][c];
      }
    }
    __syncthreads();
    auto load = [&](float (*tile)[kC + 1], const StridedView& t, const float* r, std::int64_t col0, std::int64_t D) {
      for (int e = tid; e < kC * kC; e += kThreads) {
        const int i = e / kC, x = e % kC;
        tile[i][x] = i < nc && col0 + x < D ? r[i] * mlstm_ld(t, dn_row(t, b, t0 + i, h) + col0 + x) : 0.f;
      }
    };
    // G = K K^T and R = V - K S0 (this CTA's columns), over K tiles
    float g[4][4] = {}, ks[4][4] = {};
    for (std::int64_t xt = 0; xt < K; xt += kC) {
      load(sm.a, p.k, sm.rk, xt, K);
      __syncthreads();
      for (int x = 0; x < kC; ++x)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float ki = sm.a[4 * tr + i][x];
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            g[i][j] = fmaf(ki, sm.a[4 * tc + j][x], g[i][j]);
            ks[i][j] = xt + x < K ? fmaf(ki, sm.S[xt + x][4 * tc + j], ks[i][j]) : ks[i][j];
          }
        }
      __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int r = 4 * tr + i, c = 4 * tc + j;
        sm.G[r][c] = g[i][j];
        const float vv = r < nc && c0 + c < V ? mlstm_ld(p.v, dn_row(p.v, b, t0 + r, h) + c0 + c) : 0.f;
        sm.D[r][c] = vv - ks[i][j];  // R
      }
    __syncthreads();
    // d_i = beta_i (R_i - sum_{j<i} G_ij d_j): rows in order; 64 columns x 4 partial sums per row
    {
      const int col = tid % kC, part = tid / kC;
      __shared__ float s_part[4][kC];
      for (int i = 0; i < nc; ++i) {
        float acc = 0.f;
        for (int j = part; j < i; j += 4) acc = fmaf(sm.G[i][j], sm.D[j][col], acc);
        s_part[part][col] = acc;
        __syncthreads();
        if (part == 0) {
          const float x = sm.D[i][col] - ((s_part[0][col] + s_part[1][col]) + (s_part[2][col] + s_part[3][col]));
          if (p.save_X && c0 + col < V) p.save_X[((b * p.T + t0 + i) * p.H + h) * V + c0 + col] = x;
          sm.D[i][col] = sm.beta[i] * x;
        }
        __syncthreads();
      }
      for (int i = nc + tid / kC; i < kC; i += kThreads / kC) sm.D[i][col] = 0.f;  // rows past the end
      __syncthreads();
    }
    // o = scale (Q S0 + (Q K^T masked) D); skipped by the backward's recompute (no o)
    if (p.o.p) {
      float o[4][4] = {}, qk[4][4] = {};
      for (std::int64_t xt = 0; xt < K; xt += kC) {
        load(sm.a, p.q, sm.rq, xt, K);
        load(sm.b, p.k, sm.rk, xt, K);
        __syncthreads();
        for (int x = 0; x < kC; ++x)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float qi = sm.a[4 * tr + i][x];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              qk[i][j] = fmaf(qi, sm.b[4 * tc + j][x], qk[i][j]);
              o[i][j] = xt + x < K ? fmaf(qi, sm.S[xt + x][4 * tc + j], o[i][j]) : o[i][j];
            }
          }
        __syncthreads();
      }
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) sm.G[4 * tr + i][4 * tc + j] = 4 * tc + j <= 4 * tr + i ? qk[i][j] : 0.f;
      __syncthreads();
      for (int jj = 0; jj < kC; ++jj)
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) o[i][j] = fmaf(sm.G[4 * tr + i][jj], sm.D[jj][4 * tc + j], o[i][j]);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = 4 * tr + i;
        if (r >= nc) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const std::int64_t c = c0 + 4 * tc + j;
          if (c < V) mlstm_st(p.o, dn_row(p.o, b, t0 + r, h) + c, p.scale * o[i][j]);
        }
      }
    }
    // S += K^T D, over K tiles (rows a of S)
    for (std::int64_t xt = 0; xt < K; xt += kC) {
      load(sm.b, p.k, sm.rk, xt, K);
      __syncthreads();
      float up[4][4] = {};
      for (int i = 0; i < nc; ++i)
#pragma unroll
        for (int aa = 0; aa < 4; ++aa)
#pragma unroll
          for (int j = 0; j < 4; ++j) up[aa][j] = fmaf(sm.b[i][4 * tr + aa], sm.D[i][4 * tc + j], up[aa][j]);
#pragma unroll
      for (int aa = 0; aa < 4; ++aa)
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (xt + 4 * tr + aa < K) sm.S[xt + 4 * tr + aa][4 * tc + j] += up[aa][j];
      __syncthreads();
    }
  }
  if (p.ht.p)
    for (std::int64_t e = tid; e < K * kC; e += kThreads) {
      const std::int64_t a = e / kC, c = e % kC;
      if (c0 + c < V) mlstm_st(p.ht, n * p.ht.s0 + h * p.ht.s1 + a * p.ht.s2 + c0 + c, sm.S[a][c]);
    }
}

}  // namespace

std::size_t deltanet_fwd_workspace_bytes(const DeltanetParams& p) {
  return deltanet_chunk_tc_applies(p) ? std::size_t(DnFwdWs(p, deltanet_xu_bf16(p)).total) * sizeof(float) : 0;
}

void deltanet_fwd_cuda(const DeltanetParams& p, void* workspace, Stream stream) {
  if (workspace && deltanet_chunk_tc_applies(p)) {  // the tensor-core pipeline
    const bool xu16 = deltanet_xu_bf16(p);
    const DnFwdWs l(p, xu16);
    float* ws = static_cast<float*>(workspace);
    DnChunkBufs w{ws + l.xw, ws + l.xu, ws + l.rk, ws + l.S, ws + l.X, static_cast<float*>(p.wy_t2)};
    w.dprime = true;  // (T2: the caller's wy_inverse, written)
    w.xu16 = xu16;
    deltanet_chunk_tc_states(p, w, stream);
    deltanet_chunk_tc_output(p, w, stream);
    return;
  }
  if (deltanet_fwd_tc_applies(p)) return deltanet_fwd_tc_cuda(p, stream);  // bf16, K <= 128: tensor cores
  deltanet_fwd_v1_cuda(p, stream);
}

void deltanet_fwd_v1_cuda(const DeltanetParams& p, Stream stream) {
  const std::int64_t seqs = p.N * p.H, vt = (p.V + kC - 1) / kC;
  if (seqs == 0) return;
  if (p.K > kMaxK) throw ArgumentError(cat("deltanet_fwd: K = ", p.K, " > ", kMaxK, " is not supported by the CUDA kernel"));
  if (seqs > 0x7fffffff || vt > 65535) throw Error(cat("deltanet_fwd: grid too large (", seqs, " sequence-heads)"));
  const std::size_t smem = sizeof(Smem);
  (void)resident_ctas_per_sm(reinterpret_cast<const void*>(&deltanet_fwd_kernel), kThreads, smem);
  deltanet_fwd_kernel<<<dim3(unsigned(seqs), unsigned(vt)), kThreads, smem, reinterpret_cast<cudaStream_t>(stream)>>>(p);
  FW_CUDA_CHECK_LAUNCH("deltanet_fwd");
}

}  // namespace fastweight::detail
