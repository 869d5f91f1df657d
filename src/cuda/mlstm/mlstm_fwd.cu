// mlstm_fwd.cu: the chunkwise mLSTM forward (TFLA-style), two kernels per call:
//   A  states: one CTA per (head, 64 x 64 tile of C) walks the chunks in order and writes the state
//      entering every chunk (and the final one) to the workspace (fp32);
//   B  outputs: one CTA per (head, chunk, 64-row block of the chunk, 64-column tile of DV) computes
//      h = (inter: q C_k + intra: masked decayed (q k^T) v) / (max(|q n_k + rowsum|, exp(-m_t)) + eps).
// This version computes in fp32 FMA on CUDA cores (fp32 IO is true fp32; fp16 IO, whose states
// could overflow a 16-bit copy, also runs here); bf16 IO runs on tensor cores (mlstm_fwd_tc.cu). Log-space bookkeeping: mlstm_common.cuh.
#include <algorithm>

#include "cuda/common/check.cuh"
#include "cuda/mlstm/mlstm_common.cuh"
#include "cuda/mlstm/mlstm_cuda.h"

namespace fastweight::detail {
namespace {

constexpr int kT = 64;          // tile edge: steps of a chunk block, DQK and DV columns
constexpr int kThreads = 256;   // 16 x 16 threads, each 4 x 4 outputs of a 64 x 64 tile
constexpr int kMaxL = 256;      // largest chunk (validated by the API)

// ---- A: chunk states ------------------------------------------------------------------------------
// Grid (B*NH, DQK tiles, DV tiles). Thread (tr, tc) owns C[r0 + 4tr + i][c0 + 4tc + j] and n[r0 + 4tr + i].
__global__ void __launch_bounds__(kThreads) mlstm_fwd_states_kernel(const MlstmParams p, float* __restrict__ ws_c,
                                                                     float* __restrict__ ws_n, float* __restrict__ ws_m) {
  __shared__ double s_g[kMaxL], s_a[kMaxL], s_M[kMaxL];  // (L) gate bookkeeping of the chunk
  __shared__ float s_k[kT][kT + 1];                     // (64 steps, 64 DQK columns) k
  __shared__ float s_v[kT][kT + 1];                     // (64 steps, 64 DV columns) v
  __shared__ float s_w[kT];                             // (64 steps) exp(a_t - M): weight into the new state
  const int tid = threadIdx.x, tr = tid / 16, tc = tid % 16;
  const std::int64_t bh = blockIdx.x, b = bh / p.NH, hd = bh % p.NH;
  const int r0 = blockIdx.y * kT, c0 = blockIdx.z * kT;
  const std::int64_t NC = p.chunks(), ns = NC + 1, DQK = p.DQK, DV = p.DV;

  float acc[4][4], nacc[4];  // (4, 4) tile of C, (4) of n
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const std::int64_t r = r0 + 4 * tr + i;
    nacc[i] = p.n0.p && r < DQK ? mlstm_ld(p.n0, b * p.n0.s0 + hd * p.n0.s1 + r) : 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const std::int64_t c = c0 + 4 * tc + j;
      acc[i][j] = p.c0.p && r < DQK && c < DV ? mlstm_ld(p.c0, b * p.c0.s0 + hd * p.c0.s1 + r * p.c0.s2 + c) : 0.f;
    }
  }
  double m = p.m0.p ? double(mlstm_ld(p.m0, b * p.m0.s0 + hd * p.m0.s1)) : 0.0;
  float* wc = ws_c + bh * ns * DQK * DV;
  float* wn = ws_n + bh * ns * DQK;
  float* wm = ws_m + bh * ns;

  for (std::int64_t kc = 0;; ++kc) {
    // The state entering chunk kc (kc == NC: the final state).
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const std::int64_t r = r0 + 4 * tr + i;
      if (r >= DQK) continue;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const std::int64_t c = c0 + 4 * tc + j;
        if (c < DV) wc[(kc * DQK + r) * DV + c] = acc[i][j];
      }
      if (blockIdx.z == 0 && tc == 0) wn[kc * DQK + r] = nacc[i];
    }
    if (blockIdx.y == 0 && blockIdx.z == 0 && tid == 0) wm[kc] = float(m);
    if (kc == NC) break;

    const std::int64_t t0 = kc * p.L;
    const int n = int(p.S - t0 < p.L ? p.S - t0 : p.L);
    mlstm_chunk_gates(p, b, hd, t0, n, m, s_g, s_a, s_M);
    const double M = s_M[n - 1], G = s_g[n - 1];
    const float decay = float(exp(m - M));  // <= 1
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      nacc[i] *= decay;
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] *= decay;
    }
    for (int sb = 0; sb < n; sb += kT) {
      const int nb = n - sb < kT ? n - sb : kT;
      for (int e = tid; e < kT * kT; e += kThreads) {
        const int t = e / kT, col = e % kT;
        const std::int64_t row = b * p.k.s0 + hd * p.k.s1 + (t0 + sb + t) * p.k.s2;
        s_k[t][col] = t < nb && r0 + col < DQK ? mlstm_ld(p.k, row + r0 + col) : 0.f;
        const std::int64_t vrow = b * p.v.s0 + hd * p.v.s1 + (t0 + sb + t) * p.v.s2;
        s_v[t][col] = t < nb && c0 + col < DV ? mlstm_ld(p.v, vrow + c0 + col) : 0.f;
      }
      if (tid < kT) s_w[tid] = tid < nb ? float(exp(s_a[sb + tid] - M)) : 0.f;
      __syncthreads();
      for (int t = 0; t < nb; ++t) {
        const float w = s_w[t];
        float kk[4], vv[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) kk[i] = w * s_k[t][4 * tr + i];
#pragma unroll
        for (int j = 0; j < 4; ++j) vv[j] = s_v[t][4 * tc + j];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          nacc[i] += kk[i];
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(kk[i], vv[j], acc[i][j]);
        }
      }
      __syncthreads();
    }
    m = G + M;
  }
  // The caller's final states.
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const std::int64_t r = r0 + 4 * tr + i;
    if (r >= DQK) continue;
    if (p.c_last.p)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const std::int64_t c = c0 + 4 * tc + j;
        if (c < DV) mlstm_st(p.c_last, b * p.c_last.s0 + hd * p.c_last.s1 + r * p.c_last.s2 + c, acc[i][j]);
      }
    if (p.n_last.p && blockIdx.z == 0 && tc == 0) mlstm_st(p.n_last, b * p.n_last.s0 + hd * p.n_last.s1 + r, nacc[i]);
  }
  if (p.m_last.p && blockIdx.y == 0 && blockIdx.z == 0 && tid == 0)
    mlstm_st(p.m_last, b * p.m_last.s0 + hd * p.m_last.s1, float(m));
}

// ---- B: outputs -------------------------------------------------------------------------------------
// Grid (B*NH, chunks, row blocks x DV tiles). Thread (tr, tc) owns h[row0 + 4tr + i][c0 + 4tc + j].
// Dynamic smem: 4 tiles (64 x 65 floats): q rows, k rows or C rows, v rows, P = decayed scores.
struct OutSmem {
  float q[kT][kT + 1];  // (64 rows t, 64 DQK columns)
  float x[kT][kT + 1];  // (64 steps s, 64 DQK columns) k, or (64 DQK rows, 64 DV columns) C_k
  float v[kT][kT + 1];  // (64 steps s, 64 DV columns)
  float pm[kT][kT + 1]; // (64 rows t, 64 steps s) P[t, s] = scale (q_t . k_s) exp(a_s - M_t), s <= t
  float nk[kT];         // (64 DQK) n_k slice
};

__global__ void __launch_bounds__(kThreads) mlstm_fwd_out_kernel(const MlstmParams p, const float* __restrict__ ws_c,
                                                                  const float* __restrict__ ws_n,
                                                                  const float* __restrict__ ws_m) {
  __shared__ double s_g[kMaxL], s_a[kMaxL], s_M[kMaxL];  // (rows up to this block's end) bookkeeping
  extern __shared__ float4 smem_raw[];
  OutSmem& sm = *reinterpret_cast<OutSmem*>(smem_raw);
  const int tid = threadIdx.x, tr = tid / 16, tc = tid % 16;
  const std::int64_t bh = blockIdx.x, b = bh / p.NH, hd = bh % p.NH, kc = blockIdx.y;
  const int row_blocks = int((p.L + kT - 1) / kT);
  const int rb = blockIdx.z % row_blocks, c0 = int(blockIdx.z / row_blocks) * kT;
  const std::int64_t NC = p.chunks(), ns = NC + 1, DQK = p.DQK, DV = p.DV;
  const std::int64_t t0 = kc * p.L;
  const int n = int(p.S - t0 < p.L ? p.S - t0 : p.L);
  const int row0 = rb * kT;
  if (row0 >= n) return;  // a short last chunk has fewer row blocks (uniform over the CTA)
  const int nrow = n - row0 < kT ? n - row0 : kT, rowend = row0 + nrow;
  const double mk = double(ws_m[bh * ns + kc]);
  mlstm_chunk_gates(p, b, hd, t0, rowend, mk, s_g, s_a, s_M);
  const float scale = rsqrtf(float(DQK));
  const float* Ck = ws_c + (bh * ns + kc) * DQK * DV;
  const float* nk = ws_n + (bh * ns + kc) * DQK;

  auto load_q = [&](int rt) {  // rows row0.. of the chunk, DQK columns rt..rt+63
    for (int e = tid; e < kT * kT; e += kThreads) {
      const int t = e / kT, col = e % kT;
      const std::int64_t row = b * p.q.s0 + hd * p.q.s1 + (t0 + row0 + t) * p.q.s2;
      sm.q[t][col] = t < nrow && rt + col < DQK ? mlstm_ld(p.q, row + rt + col) : 0.f;
    }
  };

  float num[4][4] = {}, qn[4] = {};
  // Inter-chunk part: q C_k and q . n_k.
  for (int rt = 0; rt < DQK; rt += kT) {
    load_q(rt);
    for (int e = tid; e < kT * kT; e += kThreads) {
      const int r = e / kT, col = e % kT;
      sm.x[r][col] = rt + r < DQK && c0 + col < DV ? Ck[(rt + r) * DV + c0 + col] : 0.f;
    }
    if (tid < kT) sm.nk[tid] = rt + tid < DQK ? nk[rt + tid] : 0.f;
    __syncthreads();
    for (int r = 0; r < kT; ++r) {
      float qv[4], xv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) qv[i] = sm.q[4 * tr + i][r];
#pragma unroll
      for (int j = 0; j < 4; ++j) xv[j] = sm.x[r][4 * tc + j];
      const float nr = sm.nk[r];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        qn[i] = fmaf(qv[i], nr, qn[i]);
#pragma unroll
        for (int j = 0; j < 4; ++j) num[i][j] = fmaf(qv[i], xv[j], num[i][j]);
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // decay of the entering state into row t: exp(m_k - M_t) <= 1
    const int t = row0 + 4 * tr + i;
    const float fi = t < rowend ? scale * float(exp(mk - s_M[t])) : 0.f;
    qn[i] *= fi;
#pragma unroll
    for (int j = 0; j < 4; ++j) num[i][j] *= fi;
  }

  // Intra-chunk part, one 64-step block of s at a time (s <= t only).
  float rowsum[4] = {};
  for (int sb = 0; sb <= rb; ++sb) {
    const int s0 = sb * kT, nsb = rowend - s0 < kT ? rowend - s0 : kT;
    float sc[4][4] = {};
    for (int rt = 0; rt < DQK; rt += kT) {
      load_q(rt);
      for (int e = tid; e < kT * kT; e += kThreads) {
        const int s = e / kT, col = e % kT;
        const std::int64_t row = b * p.k.s0 + hd * p.k.s1 + (t0 + s0 + s) * p.k.s2;
        sm.x[s][col] = s < nsb && rt + col < DQK ? mlstm_ld(p.k, row + rt + col) : 0.f;
      }
      __syncthreads();
      for (int r = 0; r < kT; ++r) {
        float qv[4], kv[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) qv[i] = sm.q[4 * tr + i][r];
#pragma unroll
        for (int j = 0; j < 4; ++j) kv[j] = sm.x[4 * tc + j][r];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) sc[i][j] = fmaf(qv[i], kv[j], sc[i][j]);
      }
      __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int tl = 4 * tr + i, sl = 4 * tc + j, t = row0 + tl, s = s0 + sl;
        const bool on = tl < nrow && sl < nsb && s <= t;
        sm.pm[tl][sl] = on ? scale * sc[i][j] * float(exp(s_a[s] - s_M[t])) : 0.f;
      }
    for (int e = tid; e < kT * kT; e += kThreads) {
      const int s = e / kT, col = e % kT;
      const std::int64_t row = b * p.v.s0 + hd * p.v.s1 + (t0 + s0 + s) * p.v.s2;
      sm.v[s][col] = s < nsb && c0 + col < DV ? mlstm_ld(p.v, row + c0 + col) : 0.f;
    }
    __syncthreads();
    for (int s = 0; s < kT; ++s) {
      float pv[4], vv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) pv[i] = sm.pm[4 * tr + i][s];
#pragma unroll
      for (int j = 0; j < 4; ++j) vv[j] = sm.v[s][4 * tc + j];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        rowsum[i] += pv[i];
#pragma unroll
        for (int j = 0; j < 4; ++j) num[i][j] = fmaf(pv[i], vv[j], num[i][j]);
      }
    }
    __syncthreads();
  }

  // h = num / (max(|b|, exp(-m_t)) + eps), m_t = g_t + M_t.
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int t = row0 + 4 * tr + i;
    if (t >= rowend) continue;
    const double mt = s_g[t] + s_M[t];
    const float den = fmaxf(fabsf(qn[i] + rowsum[i]), float(exp(-mt))) + p.eps;
    const std::int64_t row = b * p.h.s0 + hd * p.h.s1 + (t0 + t) * p.h.s2;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int c = c0 + 4 * tc + j;
      if (c < DV) mlstm_st(p.h, row + c, num[i][j] / den);
    }
  }
}

}  // namespace

std::size_t mlstm_fwd_workspace_bytes(const MlstmParams& p) {
  return mlstm_fwd_tc_applies(p) ? mlstm_fwd_tc_workspace_bytes(p) : std::size_t(MlstmFwdWorkspace(p).bytes());
}

void mlstm_states_cuda(const MlstmParams& p, float* ws_c, float* ws_n, float* ws_m, Stream stream) {
  const std::int64_t heads = p.B * p.NH;
  const std::int64_t kt = (p.DQK + kT - 1) / kT, vt = (p.DV + kT - 1) / kT;
  if (heads == 0) return;
  if (heads > 0x7fffffff || kt > 65535 || vt > 65535) throw Error(cat("mlstm: grid too large (heads ", heads, ")"));
  mlstm_fwd_states_kernel<<<dim3(unsigned(heads), unsigned(kt), unsigned(vt)), kThreads, 0,
                            reinterpret_cast<cudaStream_t>(stream)>>>(p, ws_c, ws_n, ws_m);
  FW_CUDA_CHECK_LAUNCH("mlstm");
}

void mlstm_fwd_cuda(const MlstmParams& p, void* workspace, std::size_t workspace_bytes, Stream stream) {
  if (mlstm_fwd_tc_applies(p)) return mlstm_fwd_tc_cuda(p, workspace, workspace_bytes, stream);  // bf16: tensor cores
  const MlstmFwdWorkspace w(p);
  if (p.B * p.NH == 0) return;
  if (workspace_bytes < std::size_t(w.bytes()))
    throw ArgumentError(cat("mlstm_fwd: workspace: ", workspace_bytes, " bytes, need ", w.bytes()));
  float* ws_c = static_cast<float*>(workspace);
  float* ws_n = ws_c + w.c_floats;
  float* ws_m = ws_n + w.n_floats;
  const std::int64_t heads = p.B * p.NH, NC = p.chunks();
  const std::int64_t kt = (p.DQK + kT - 1) / kT, vt = (p.DV + kT - 1) / kT, rbs = (p.L + kT - 1) / kT;
  if (heads > 0x7fffffff || kt > 65535 || vt > 65535 || NC > 65535 || rbs * vt > 65535)
    throw Error(cat("mlstm_fwd: grid too large (heads ", heads, ", chunks ", NC, ")"));
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  mlstm_fwd_states_kernel<<<dim3(unsigned(heads), unsigned(kt), unsigned(vt)), kThreads, 0, s>>>(p, ws_c, ws_n, ws_m);
  FW_CUDA_CHECK_LAUNCH("mlstm_fwd");
  if (NC == 0) return;
  const std::size_t smem = sizeof(OutSmem);
  (void)resident_ctas_per_sm(reinterpret_cast<const void*>(&mlstm_fwd_out_kernel), kThreads, smem);  // raises the smem limit
  mlstm_fwd_out_kernel<<<dim3(unsigned(heads), unsigned(NC), unsigned(rbs * vt)), kThreads, smem, s>>>(p, ws_c, ws_n,
                                                                                                     ws_m);
  FW_CUDA_CHECK_LAUNCH("mlstm_fwd");
}

}  // namespace fastweight::detail
