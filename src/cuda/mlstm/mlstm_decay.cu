// mlstm_decay.cu: seed 001's log-space decay matrix, D[t, s] = F_t - F_s + i_s (s <= t), -inf above the
// diagonal, F_t = lf_0 + ... + lf_t, lf = logsigmoid(f); and its backward.
// F is accumulated in float64: |F| grows like 20 S under strong decay, and D near the diagonal is a
// difference of two such sums (a float32 F would lose ~|F| * 6e-8 absolute there).
//
// Forward: grid (B*NH, row blocks of 64 t). A CTA first sums lf over [0, row0) (its carry), then walks
// the column blocks in order, scanning 64 lf at a time, and writes its 64 rows x all S columns.
// Backward: dF_t = sum_{s < t} dD[t, s] - sum_{t' > t} dD[t', t] (the diagonal cancels), di_s =
// sum_{t >= s} dD[t, s], dlf_u = sum_{t >= u} dF_t, df = dlf * sigmoid(-f). Kernel 1 (rows) and
// kernel 2 (columns) write per-step float64 sums to the workspace; kernel 3 (one CTA per head)
// scans them. Fixed summation orders: deterministic.
#include "cuda/common/check.cuh"
#include "cuda/mlstm/mlstm_common.cuh"
#include "cuda/mlstm/mlstm_cuda.h"

namespace fastweight::detail {
namespace {

constexpr int kB = 64;         // rows / columns per block
constexpr int kThreads = 256;

// Inclusive scan of s[0..kB) in place (double), by the whole CTA; returns nothing, synchronises.
__device__ void scan64(double* s) {
  const int tid = threadIdx.x;
  for (int d = 1; d < kB; d <<= 1) {
    const double add = tid < kB && tid >= d ? s[tid - d] : 0.0;
    __syncthreads();
    if (tid < kB) s[tid] += add;
    __syncthreads();
  }
}

__device__ double lf_at(const MlstmParams& p, std::int64_t b, std::int64_t hd, std::int64_t t) {
  return mlstm_logsigmoid(double(mlstm_ld(p.f, b * p.f.s0 + hd * p.f.s1 + t)));
}

__global__ void __launch_bounds__(kThreads) decay_fwd_kernel(const MlstmParams p, const StridedView D) {
  __shared__ double s_Fs[kB], s_Ft[kB], s_red[kThreads / 32];
  __shared__ float s_i[kB];
  const int tid = threadIdx.x;
  const std::int64_t bh = blockIdx.x, b = bh / p.NH, hd = bh % p.NH, S = p.S;
  const std::int64_t row0 = std::int64_t(blockIdx.y) * kB;
  // carry = F_{row0 - 1} = sum of lf over [0, row0), fixed-order block reduction
  double part = 0.0;
  for (std::int64_t t = tid; t < row0; t += kThreads) part += lf_at(p, b, hd, t);
  for (int off = 16; off > 0; off >>= 1) part += __shfl_xor_sync(0xffffffffu, part, off);
  if ((tid & 31) == 0) s_red[tid >> 5] = part;
  __syncthreads();
  double carry0 = 0.0;
  for (int w = 0; w < kThreads / 32; ++w) carry0 += s_red[w];
  // F_t for this CTA's rows
  if (tid < kB) s_Ft[tid] = row0 + tid < S ? lf_at(p, b, hd, row0 + tid) : 0.0;
  __syncthreads();
  scan64(s_Ft);
  if (tid < kB) s_Ft[tid] += carry0;
  __syncthreads();
  // column blocks in order
  double carry = 0.0;
  for (std::int64_t s0 = 0; s0 < S; s0 += kB) {
    const bool lower = s0 <= row0 + kB - 1;  // this block has entries with s <= t
    if (lower) {
      if (tid < kB) {
        s_Fs[tid] = s0 + tid < S ? lf_at(p, b, hd, s0 + tid) : 0.0;
        s_i[tid] = s0 + tid < S ? mlstm_ld(p.i, b * p.i.s0 + hd * p.i.s1 + s0 + tid) : 0.f;
      }
      __syncthreads();
      scan64(s_Fs);
      if (tid < kB) s_Fs[tid] += carry;
      __syncthreads();
    }
    for (int e = tid; e < kB * kB; e += kThreads) {
      const int tl = e / kB, sl = e % kB;
      const std::int64_t t = row0 + tl, s = s0 + sl;
      if (t >= S || s >= S) continue;
      const float val = s <= t ? float(s_Ft[tl] - s_Fs[sl] + double(s_i[sl])) : -INFINITY;
      mlstm_st(D, b * D.s0 + hd * D.s1 + t * D.s2 + s, val);
    }
    if (lower) carry = s_Fs[kB - 1];  // F at the block's last column (padding adds 0)
    __syncthreads();
  }
}

// Kernel 1: R_t = sum_{s < t} dD[t, s], one warp per row (lanes over s, then a fixed-order tree).
__global__ void __launch_bounds__(kThreads) decay_bwd_rows_kernel(const MlstmParams p, const StridedView dD,
                                                                  double* __restrict__ R) {
  const std::int64_t bh = blockIdx.x, b = bh / p.NH, hd = bh % p.NH;
  const std::int64_t t = std::int64_t(blockIdx.y) * (kThreads / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (t >= p.S) return;
  double acc = 0.0;
  const std::int64_t row = b * dD.s0 + hd * dD.s1 + t * dD.s2;
  for (std::int64_t s = lane; s < t; s += 32) acc += double(mlstm_ld(dD, row + s));
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane == 0) R[bh * p.S + t] = acc;
}

// Kernel 2: per column s: Cs = sum_{t > s} dD[t, s] (to the workspace) and di_s = Cs + dD[s, s].
__global__ void __launch_bounds__(kThreads) decay_bwd_cols_kernel(const MlstmParams p, const StridedView dD,
                                                                  const StridedView di, double* __restrict__ Cs) {
  const std::int64_t bh = blockIdx.x, b = bh / p.NH, hd = bh % p.NH;
  const std::int64_t s = std::int64_t(blockIdx.y) * kThreads + threadIdx.x;
  if (s >= p.S) return;
  const std::int64_t base = b * dD.s0 + hd * dD.s1 + s;
  double acc = 0.0;
  for (std::int64_t t = s + 1; t < p.S; ++t) acc += double(mlstm_ld(dD, base + t * dD.s2));
  Cs[bh * p.S + s] = acc;
  if (di.p) mlstm_st(di, b * di.s0 + hd * di.s1 + s, float(acc + double(mlstm_ld(dD, base + s * dD.s2))));
}

// Kernel 3: one CTA per head: dF = R - Cs, dlf_u = sum_{t >= u} dF_t (suffix sums by chunks of the
// CTA in reverse order), df = dlf * sigmoid(-f).
__global__ void __launch_bounds__(kThreads) decay_bwd_scan_kernel(const MlstmParams p, const double* __restrict__ R,
                                                                  const double* __restrict__ Cs, const StridedView df) {
  __shared__ double s_x[kThreads];
  const int tid = threadIdx.x;
  const std::int64_t bh = blockIdx.x, b = bh / p.NH, hd = bh % p.NH, S = p.S;
  double carry = 0.0;  // sum of dF over the steps after the current block
  for (std::int64_t end = S; end > 0; end -= kThreads) {
    const std::int64_t start = end > kThreads ? end - kThreads : 0;
    const int n = int(end - start);
    // reversed block: element j <-> step end - 1 - j, so an inclusive prefix sum is a suffix sum
    s_x[tid] = tid < n ? R[bh * S + end - 1 - tid] - Cs[bh * S + end - 1 - tid] : 0.0;
    __syncthreads();
    for (int d = 1; d < kThreads; d <<= 1) {
      const double add = tid >= d ? s_x[tid - d] : 0.0;
      __syncthreads();
      s_x[tid] += add;
      __syncthreads();
    }
    if (tid < n) {
      const std::int64_t u = end - 1 - tid;
      const double dlf = s_x[tid] + carry;
      const double f = double(mlstm_ld(p.f, b * p.f.s0 + hd * p.f.s1 + u));
      const double sig_neg = f >= 0 ? exp(-f) / (1.0 + exp(-f)) : 1.0 / (1.0 + exp(f));  // sigmoid(-f)
      mlstm_st(df, b * df.s0 + hd * df.s1 + u, float(dlf * sig_neg));
    }
    const double total = s_x[kThreads - 1];
    __syncthreads();
    carry += total;
  }
}

}  // namespace

void mlstm_decay_fwd_cuda(const MlstmParams& p, const StridedView& D, Stream stream) {
  const std::int64_t heads = p.B * p.NH, blocks = (p.S + kB - 1) / kB;
  if (heads == 0 || blocks == 0) return;
  if (heads > 0x7fffffff || blocks > 65535) throw Error(cat("mlstm_decay_matrix_fwd: grid too large"));
  decay_fwd_kernel<<<dim3(unsigned(heads), unsigned(blocks)), kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(p, D);
  FW_CUDA_CHECK_LAUNCH("mlstm_decay_matrix_fwd");
}

std::size_t mlstm_decay_bwd_workspace_bytes(const MlstmParams& p) {
  return std::size_t(2 * p.B * p.NH * p.S) * sizeof(double);
}

void mlstm_decay_bwd_cuda(const MlstmParams& p, const StridedView& dD, const StridedView& di, const StridedView& df,
                          void* workspace, std::size_t workspace_bytes, Stream stream) {
  const std::int64_t heads = p.B * p.NH;
  if (heads == 0 || p.S == 0) return;
  if (workspace_bytes < mlstm_decay_bwd_workspace_bytes(p))
    throw ArgumentError(cat("mlstm_decay_matrix_bwd: workspace: ", workspace_bytes, " bytes, need ",
                            mlstm_decay_bwd_workspace_bytes(p)));
  const std::int64_t rblocks = (p.S + kThreads / 32 - 1) / (kThreads / 32), cblocks = (p.S + kThreads - 1) / kThreads;
  if (heads > 0x7fffffff || rblocks > 65535) throw Error(cat("mlstm_decay_matrix_bwd: grid too large"));
  double* R = static_cast<double*>(workspace);
  double* Cs = R + heads * p.S;
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  decay_bwd_rows_kernel<<<dim3(unsigned(heads), unsigned(rblocks)), kThreads, 0, s>>>(p, dD, R);
  FW_CUDA_CHECK_LAUNCH("mlstm_decay_matrix_bwd");
  decay_bwd_cols_kernel<<<dim3(unsigned(heads), unsigned(cblocks)), kThreads, 0, s>>>(p, dD, di, Cs);
  FW_CUDA_CHECK_LAUNCH("mlstm_decay_matrix_bwd");
  if (df.p) {
    decay_bwd_scan_kernel<<<unsigned(heads), kThreads, 0, s>>>(p, R, Cs, df);
    FW_CUDA_CHECK_LAUNCH("mlstm_decay_matrix_bwd");
  }
}

}  // namespace fastweight::detail
