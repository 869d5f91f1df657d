// mlstm_bwd_ws.h: the workspace of the chunkwise mLSTM backward (mlstm_bwd.cu, mlstm_bwd_tc.cu),
// in floats: chunk states and state gradients (fp32), per-step row statistics, partial sums.
#pragma once

#include <algorithm>
#include <cstdint>

#include "common/mlstm_params.h"

namespace fastweight::detail {

struct BwdWs {  // offsets in floats into the workspace
  std::int64_t heads, NC, ns, tiles, rbs;
  std::int64_t c, n, m, dc, dn, inv_den, db, corr, ey, dgq, dgkv, dikv, R, G, gam, gates, total;
  explicit BwdWs(const MlstmParams& p) {
    heads = p.B * p.NH, NC = p.chunks(), ns = NC + 1;
    tiles = ((p.DQK + 63) / 64) * ((p.DV + 63) / 64);  // 64 x 64 tiles of C
    rbs = (p.L + 63) / 64;  // 64-row blocks of a chunk
    auto al = [](std::int64_t x) { return (x + 63) / 64 * 64; };
    std::int64_t o = 0;
    auto take = [&](std::int64_t n_) { const std::int64_t at = o; o += al(n_); return at; };
    c = take(heads * ns * p.DQK * p.DV), n = take(heads * ns * p.DQK), m = take(heads * ns);
    dc = take(heads * ns * p.DQK * p.DV), dn = take(heads * ns * p.DQK);
    inv_den = take(heads * p.S), db = take(heads * p.S), corr = take(heads * p.S), ey = take(heads * p.S);
    dgq = take(heads * p.S), dgkv = take(heads * p.S), dikv = take(heads * p.S);
    R = take(heads * ns * tiles), G = take(heads * std::max<std::int64_t>(NC, 1) * rbs);
    gam = take(heads * p.S);  // K4: routing gamma_t of each max (1 lf, 0 i, 1/2 tie)
    gates = take(6 * heads * p.S);  // K0 on tensor cores: g, a, A in float64 (2 floats each)
    total = o;
  }
};


// K3 (dq, dk, dv and the gate partials) on tensor cores where it applies (mlstm_bwd_tc.cu): bf16 q, k,
// v, dh, chunk 64, DQK and DV <= 128. Reads and writes the workspace exactly as k3_dq / k3_dkdv.
bool mlstm_bwd_k3_tc_applies(const MlstmBwdParams& b);
void mlstm_bwd_k3_tc(const MlstmBwdParams& b, float* ws, const BwdWs& L, Stream stream);
// K1 (row statistics) on tensor cores, where K3's tensor-core path applies (same conditions).
void mlstm_bwd_k1_tc(const MlstmBwdParams& b, float* ws, const BwdWs& L, Stream stream);
// K2 (the reverse scan of dC, dn) on tensor cores: bf16 q, k, v, dh, after K0 on tensor cores (it
// reads K0's gate pass from the workspace). Writes what k2_scan writes.
bool mlstm_bwd_k2_tc_applies(const MlstmBwdParams& b);
void mlstm_bwd_k2_tc(const MlstmBwdParams& b, float* ws, const BwdWs& L, Stream stream);

}  // namespace fastweight::detail
