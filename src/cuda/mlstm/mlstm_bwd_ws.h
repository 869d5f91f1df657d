// mlstm_bwd_ws.h: the workspace of the chunkwise mLSTM backward (mlstm_bwd.cu, mlstm_bwd_tc.cu),
// in floats: chunk states and state gradients (fp32 slots of DQK x DV; on the tensor-core path each c
// and dc slot holds bf16 hi then lo instead), per-step row statistics, partial sums.
#pragma once

#include <algorithm>
#include <cstdint>

#include "common/mlstm_params.h"

namespace fastweight::detail {

struct BwdWs {  // offsets in floats into the workspace
  std::int64_t heads, NC, ns, tiles, rbs;
  std::int64_t c, n, m, dc, dn, inv_den, db, corr, ey, dgq, dgkv, dikv, R, G, gam, gates, pn, k4, total;
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
    pn = take(heads * NC * p.DQK);  // tensor-core path: p_k = sum_t scale e_t db_t q_t per chunk (K3 q-role)
    // K4 in float64: chunk ends (g, max a), m_k, chunk 0's dm0, then the decay chain's G_k (heads, NC)
    k4 = take(2 * (4 * heads * NC + heads));
    total = o;
  }
};


// The tensor-core path (mlstm_bwd_tc.cu): bf16 q, k, v, dh, chunk 64, DQK and DV <= 128. K3's q-role
// also forms the row statistics (K1 of the CUDA-core path) and the chunks' dn partials, so the order
// is K0, K3 q-role, K2 without dn, dn_scan, K3 kv-role, K4. Reads and writes the workspace as k3_dq,
// k1_rows / k3_dkdv do, plus pn.
bool mlstm_bwd_k3_tc_applies(const MlstmBwdParams& b);
void mlstm_bwd_k3q_tc(const MlstmBwdParams& b, float* ws, const BwdWs& L, Stream stream);
void mlstm_bwd_dn_scan(const MlstmBwdParams& b, float* ws, const BwdWs& L, Stream stream);
void mlstm_bwd_k3kv_tc(const MlstmBwdParams& b, float* ws, const BwdWs& L, Stream stream);
// K2 (the reverse scan of dC and dn) on tensor cores: bf16 q, k, v, dh, after K0 on tensor cores (it
// reads K0's gate pass from the workspace). Writes what k2_scan writes; for_tc_k3 (the tensor-core K3
// follows): without dn (dn_scan's), and dC as bf16 hi then lo in each fp32 slot (K3 kv-role's input).
bool mlstm_bwd_k2_tc_applies(const MlstmBwdParams& b);
// no_r (with for_tc_k3; set_mlstm_bwd_decay_chain): no chunk state C_k read and R_k's C part 0 for 0 < k < NC
// (dn_scan adds the n part; nothing reads them), R_NC as before: K4 forms the decays' gradients by its chain.
void mlstm_bwd_k2_tc(const MlstmBwdParams& b, float* ws, const BwdWs& L, bool for_tc_k3, Stream stream, bool no_r = false);

}  // namespace fastweight::detail
