// mlstm_step.cu: one mLSTM decoding step for every (b, head), in two launches so that the states
// can be updated in place without a race between CTAs:
//   1. grid (B*NH, DV tiles of 64): C' = fa C + ia k v^T for its columns (each element read and
//      written by one thread) and h = scale q^T C' / (max(|scale q . n'|, exp(-m')) + eps), with
//      q . n' = fa (q . n) + ia (q . k) from the OLD n (kernel 2 has not run yet);
//   2. grid (B*NH): n' = fa n + ia k and m'.
// m' = max(lf + m, i), fa = exp(lf + m - m'), ia = exp(i - m'), lf = logsigmoid(f) (MATH.md §2).
// No allocation and no host synchronisation: CUDA-graph safe.
#include "cuda/common/check.cuh"
#include "cuda/mlstm/mlstm_common.cuh"
#include "cuda/mlstm/mlstm_cuda.h"

namespace fastweight::detail {
namespace {

constexpr int kCols = 64;      // DV columns per CTA
constexpr int kThreads = 256;  // 4 row groups x 64 columns

struct Gates {
  double m_new;
  float fa, ia;
};
__device__ __forceinline__ Gates step_gates(const MlstmParams& p, std::int64_t b, std::int64_t hd) {
  const double lf = mlstm_logsigmoid(double(mlstm_ld(p.f, b * p.f.s0 + hd * p.f.s1)));
  const double ig = double(mlstm_ld(p.i, b * p.i.s0 + hd * p.i.s1));
  const double m = double(mlstm_ld(p.m0, b * p.m0.s0 + hd * p.m0.s1));
  const double mn = fmax(lf + m, ig);
  return {mn, float(exp(lf + m - mn)), float(exp(ig - mn))};
}

__global__ void __launch_bounds__(kThreads) mlstm_step_c_kernel(const MlstmParams p) {
  __shared__ float s_red[2][kThreads / 32];
  __shared__ float s_part[4][kCols];
  const int tid = threadIdx.x;
  const std::int64_t bh = blockIdx.x, b = bh / p.NH, hd = bh % p.NH;
  const Gates gt = step_gates(p, b, hd);
  const std::int64_t qo = b * p.q.s0 + hd * p.q.s1, ko = b * p.k.s0 + hd * p.k.s1, vo = b * p.v.s0 + hd * p.v.s1;
  const std::int64_t no = b * p.n0.s0 + hd * p.n0.s1;
  // q . n (old) and q . k over DQK: block reduction in a fixed order (deterministic).
  float qn = 0.f, qk = 0.f;
  for (std::int64_t r = tid; r < p.DQK; r += kThreads) {
    const float qr = mlstm_ld(p.q, qo + r);
    qn = fmaf(qr, mlstm_ld(p.n0, no + r), qn);
    qk = fmaf(qr, mlstm_ld(p.k, ko + r), qk);
  }
  for (int off = 16; off > 0; off >>= 1) {
    qn += __shfl_xor_sync(0xffffffffu, qn, off);
    qk += __shfl_xor_sync(0xffffffffu, qk, off);
  }
  if ((tid & 31) == 0) { s_red[0][tid >> 5] = qn; s_red[1][tid >> 5] = qk; }
  __syncthreads();
  qn = qk = 0.f;
  for (int w = 0; w < kThreads / 32; ++w) { qn += s_red[0][w]; qk += s_red[1][w]; }
  const float scale = rsqrtf(float(p.DQK));
  const float den = fmaxf(fabsf(scale * (gt.fa * qn + gt.ia * qk)), float(exp(-gt.m_new))) + p.eps;

  const int col = tid % kCols, rg = tid / kCols;
  const std::int64_t c = std::int64_t(blockIdx.y) * kCols + col;
  float part = 0.f;
  if (c < p.DV) {
    const float vc = gt.ia * mlstm_ld(p.v, vo + c);
    const std::int64_t ci = b * p.c0.s0 + hd * p.c0.s1 + c, co = b * p.c_last.s0 + hd * p.c_last.s1 + c;
    for (std::int64_t r = rg; r < p.DQK; r += 4) {
      const float cn = fmaf(gt.fa, mlstm_ld(p.c0, ci + r * p.c0.s2), mlstm_ld(p.k, ko + r) * vc);
      mlstm_st(p.c_last, co + r * p.c_last.s2, cn);  // may be the element just read (in place)
      part = fmaf(mlstm_ld(p.q, qo + r), cn, part);
    }
  }
  s_part[rg][col] = part;
  __syncthreads();
  if (rg == 0 && c < p.DV) {
    const float hsum = (s_part[0][col] + s_part[1][col]) + (s_part[2][col] + s_part[3][col]);
    mlstm_st(p.h, b * p.h.s0 + hd * p.h.s1 + c, scale * hsum / den);
  }
}

__global__ void __launch_bounds__(kThreads) mlstm_step_n_kernel(const MlstmParams p) {
  const std::int64_t bh = blockIdx.x, b = bh / p.NH, hd = bh % p.NH;
  const Gates gt = step_gates(p, b, hd);
  __syncthreads();  // every thread has read the old m before thread 0 may overwrite it (in place)
  const std::int64_t ko = b * p.k.s0 + hd * p.k.s1;
  const std::int64_t ni = b * p.n0.s0 + hd * p.n0.s1, no = b * p.n_last.s0 + hd * p.n_last.s1;
  for (std::int64_t r = threadIdx.x; r < p.DQK; r += kThreads)
    mlstm_st(p.n_last, no + r, fmaf(gt.fa, mlstm_ld(p.n0, ni + r), gt.ia * mlstm_ld(p.k, ko + r)));
  if (threadIdx.x == 0) mlstm_st(p.m_last, b * p.m_last.s0 + hd * p.m_last.s1, float(gt.m_new));
}

}  // namespace

void mlstm_step_cuda(const MlstmParams& p, Stream stream) {
  const std::int64_t heads = p.B * p.NH, tiles = (p.DV + kCols - 1) / kCols;
  if (heads == 0) return;
  if (heads > 0x7fffffff || tiles > 65535) throw Error(cat("mlstm_step: grid too large (heads ", heads, ")"));
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  mlstm_step_c_kernel<<<dim3(unsigned(heads), unsigned(tiles)), kThreads, 0, s>>>(p);
  FW_CUDA_CHECK_LAUNCH("mlstm_step");
  mlstm_step_n_kernel<<<unsigned(heads), kThreads, 0, s>>>(p);
  FW_CUDA_CHECK_LAUNCH("mlstm_step");
}

}  // namespace fastweight::detail
