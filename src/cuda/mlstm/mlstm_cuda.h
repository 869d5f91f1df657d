// mlstm_cuda.h: the CUDA back end of the mLSTM (host-callable, no CUDA headers). Arguments were
// validated and lowered by src/api (MlstmParams); these plan the launches and run them on `stream`.
#pragma once

#include <cstddef>

#include "common/mlstm_params.h"

namespace fastweight::detail {

// Chunkwise forward: h and, when asked, the final states. Workspace: mlstm_fwd_workspace_bytes(p).
std::size_t mlstm_fwd_workspace_bytes(const MlstmParams& p);
void mlstm_fwd_cuda(const MlstmParams& p, void* workspace, std::size_t workspace_bytes, Stream stream);
// The tensor-core forward (mlstm_fwd_tc.cu), which mlstm_fwd_cuda picks where it applies: bf16 q,
// k, v, h and DQK <= 256.
bool mlstm_fwd_tc_applies(const MlstmParams& p);
std::size_t mlstm_fwd_tc_workspace_bytes(const MlstmParams& p);
void mlstm_fwd_tc_cuda(const MlstmParams& p, void* workspace, std::size_t workspace_bytes, Stream stream);

// Kernel A of the forward alone: the states entering every chunk (and the final one) into the
// workspace parts c, n, m of MlstmFwdWorkspace(p); also p's c_last/n_last/m_last when set.
void mlstm_states_cuda(const MlstmParams& p, float* ws_c, float* ws_n, float* ws_m, Stream stream);
// The same on tensor cores (mlstm_fwd_tc.cu) for bf16 q, k, v: C, n, m as above (fp32); `gates` is
// scratch of 3 * B * NH * S doubles. Final states are not written. hilo: each C slot holds bf16 hi
// (DQK, DV) then lo = bf16(C - hi) (DQK, DV) instead of fp32 (the tensor-core backward's K3 q-role).
bool mlstm_states_tc_applies(const MlstmParams& p);
void mlstm_states_tc_f32(const MlstmParams& p, float* ws_c, float* ws_n, float* ws_m, double* gates, Stream stream,
                         bool hilo = false);

// The backward's serial kernels' state stores (K0's C, K2's dC: bf16 hi / lo slots) by the TMA engine
// where it applies (sm_90, rows a multiple of 16 bytes), else element stores: on by default; returns
// the previous setting (tests and fastweight_bench --mlstm-bulk-store=off).
bool set_mlstm_bulk_store(bool on);
bool mlstm_bulk_store_on();
// The same kernels' chunk tiles loaded through per-CTA unit offsets (ChunkUnits), else by the generic
// loader: on by default; returns the previous setting (tests; fastweight_bench --mlstm-chunk-units=off).
bool set_mlstm_chunk_units(bool on);
bool mlstm_chunk_units_on();

// The forward's output kernel with 1 or 2 64-column DV tiles per CTA (q k^T formed once per CTA);
// 0: the planner's choice (two where DV > 64 and they fit shared memory). Returns the previous
// setting (tests; fastweight_bench --mlstm-out-tiles=1|2).
int set_mlstm_out_tiles(int nt);

// The backward's K3 roles compiled for fixed head dims where the problem (or its DV slab) has them
// (DQK 128 or 256 with DV 128), else for runtime dims: on by default; returns the previous setting
// (tests; fastweight_bench --mlstm-k3-fixed=off).
bool set_mlstm_k3_fixed(bool on);
// The K3 kv-role's dv state product with dC's bf16 lo part as well as its hi part (off by default:
// hi alone); returns the previous setting (A/B: fastweight_bench --mlstm-dv-lo=on).
bool set_mlstm_dv_lo(bool on);
// The K3 roles' full chunks (64 rows) by instances compiled for them (the row guards folded), a short
// last chunk by a second launch: on by default; returns the previous setting (tests;
// fastweight_bench --mlstm-k3-full=off).
bool set_mlstm_k3_full(bool on);
// The K3 roles over several DV parts of 128 columns per CTA (the backward's DV slabs then as wide),
// else 128 columns per CTA and 128-wide slabs: on by default; returns the previous setting (tests;
// fastweight_bench --mlstm-dv-parts=off). mlstm_bwd_workspace_bytes depends on it.
bool set_mlstm_k3_dv_parts(bool on);
// With parts on: up to 4 parts (512 columns) at any DQK <= 256 (on by default), else up to 2 at
// DQK <= 128 and 1 above (session 20's form; tests, fastweight_bench --mlstm-dv-wide=off).
bool set_mlstm_k3_dv_wide(bool on);
// The most 128-column DV parts a K3 CTA takes at this DQK under the two settings above.
int mlstm_k3_dv_parts_max(std::int64_t DQK);

// The backward's DV slabs (DV > 128) two at a time, on the caller's stream and a side stream, each
// with its own core workspace: 1 always, -1 never, 0 the planner's choice (where K2's grid per slab
// takes at most one CTA per SM). Returns the previous mode (tests, fastweight_bench
// --mlstm-slab-overlap=on|off). mlstm_bwd_workspace_bytes depends on it.
int set_mlstm_slab_overlap(int mode);

// The tensor-core backward's chunk-decay gradients G_k by the chain G_NC-1 = <C_S, dC_S> + <n_S, dn_S>,
// G_k = G_k+1 + sum_(chunk k+1) eY_t - Gp_k+1 (K4, float64; derived in docs/perf/mlstm.md, session 32,
// and checked in tests/python/test_mlstm_design.py), so that K2 reads no chunk state C_k past C_0,
// instead of the partials R_k = <C_k, dC_k+1> + <n_k, dn_k+1> (K2's C part; dn_scan still adds the n
// part, unread). Other roundings of di, df (dq, dk, dv, dc0, dn0: the same bits; dm0 by R_0 either
// way). On by default (H100, session 33: backward 3-6.5% faster at the benchmark's large shapes).
// Returns the previous setting (tests; fastweight_bench --mlstm-decay-chain=off).
bool set_mlstm_bwd_decay_chain(bool on);

// Chunkwise backward: the exact gradient (docs/design/mlstm_backward.md). Workspace:
// mlstm_bwd_workspace_bytes(b).
std::size_t mlstm_bwd_workspace_bytes(const MlstmBwdParams& b);
void mlstm_bwd_cuda(const MlstmBwdParams& b, void* workspace, std::size_t workspace_bytes, Stream stream);

// One decoding step for every (b, head). Sequence views with S = 1 (s2 unused): q, k, v, h
// (B, NH, D); gates (B, NH[, 1]) through s0/s1; states c0/n0/m0 (in) and c_last/n_last/m_last (out)
// may be the same memory (in place).
void mlstm_step_cuda(const MlstmParams& p, Stream stream);
// The step's C pass kernel where fp32 states with 16-byte aligned rows and DV % 4 == 0 allow it:
// 1 the register-tile kernel (DQK <= 256), 2 the row-block kernel (any DQK); -1 (the default) the
// planner's choice of the two (2 where its grid is 4+ waves deep); 0, or where neither applies, the
// element kernel; 3..8 other row-block shapes (columns x threads x rows: 64x128x16, 64x64x8,
// 128x128x8, 32x64x8, 64x128x4, 128x256x8; A/B sweeps); 9 the TMA kernel (sm_90, DQK <= 256: the
// CTA's whole 64-column tile loaded by tensor-map boxes at once, updated in shared memory, stored by
// tensor-map stores; elsewhere kernel 2). Returns the previous setting (tests,
// fastweight_bench --mlstm-step-kernel=N).
int set_mlstm_step_kernel(int kernel);
// Out of place (n', m' disjoint from n, m) the C pass also writes n', m' (one launch); off: the second
// kernel always, as in place. Returns the previous setting (tests, fastweight_bench --mlstm-step-fuse=off).
bool set_mlstm_step_fuse_nm(bool on);
// In place, the second kernel (n', m') as a programmatic dependent launch on sm_90: it may run once every
// C-pass CTA has read n and m, beside the C pass's state traffic, instead of after it. The same bits. On by
// default (H100, session 34: in place 0.89x at B = 1, 0.88x at B = 8, within 1% at B >= 64). Returns the
// previous setting (tests, fastweight_bench --mlstm-step-pdl=off).
bool set_mlstm_step_pdl(bool on);
// The C pass itself as a programmatic dependent launch on sm_90 (on by default; H100, session 35, 20
// chained steps: B = 8 0.97x the plain launch's time, in place 0.95x, B >= 64 within 0.5%): it may become
// resident while the previous kernel in the stream ends and waits for it before its first load or store,
// and out of place it lets the next step's C pass be scheduled at once (in place the n, m kernel does).
// A chain of steps then overlaps each launch with the previous step's end; after a kernel that signals
// nothing (most of torch's) it starts as a plain launch would. The same bits.
// FW_MLSTM_STEP_PDL_C=0 in the environment turns it off at start. Returns the previous setting (tests,
// fastweight_bench --mlstm-step-pdl-c=off).
bool set_mlstm_step_pdl_c(bool on);
// The row-block kernel (kernel 2) with a short per-row path: k, q from shared memory, no row checks in
// whole blocks, 32-bit row offsets (where 16-byte stores are on, DQK <= 512 and DQK row strides fit 31
// bits). 1: one block of 8 rows in flight, as kernel 2; 2: two blocks of 4 rows (the next loaded before
// this one's stores); 3 (H100: 0.964x mode 0's time at B = 64 and 256): two blocks of 8 rows; 4: mode 3
// with the gates', denominator's and v's loads issued together at the start, and the register tile
// (kernel 1) likewise (the same bits; H100: 0.86x mode 3's time at B = 1, 0.97x at B = 8, 0.99x at 64,
// 1.003x at 256); 5 (the default): 4 while the grid is at most 8 waves of 4 CTAs per SM, else 3; 0:
// kernel 2 as before. FW_MLSTM_STEP_LEAN=N in the environment sets the starting mode (Python benchmarks'
// A/B runs). Returns the previous setting (tests, fastweight_bench --mlstm-step-lean=N).
int set_mlstm_step_lean(int mode);

// Parallel form (mlstm_parallel.cu): forward h (and n, m, b where P has them); backward the
// gradients P asks for, from the saved h, m, b; the head norm when P.out (forward) / P.dout (backward)
// is set. Workspace: mlstm_parallel_workspace_bytes(P, bwd).
std::size_t mlstm_parallel_workspace_bytes(const MlstmParallelParams& P, bool bwd);
void mlstm_parallel_fwd_cuda(const MlstmParallelParams& P, void* workspace, std::size_t workspace_bytes,
                             Stream stream);
void mlstm_parallel_bwd_cuda(const MlstmParallelParams& P, void* workspace, std::size_t workspace_bytes,
                             Stream stream);

// Decay matrix: D[b, h, t, s] (B, NH, S, S) at D.p + b*s0 + h*s1 + t*s2 + s.
void mlstm_decay_fwd_cuda(const MlstmParams& p, const StridedView& D, Stream stream);
// Backward: di, df (B, NH, S) from dD; workspace: mlstm_decay_bwd_workspace_bytes(p).
std::size_t mlstm_decay_bwd_workspace_bytes(const MlstmParams& p);
void mlstm_decay_bwd_cuda(const MlstmParams& p, const StridedView& dD, const StridedView& di, const StridedView& df,
                          void* workspace, std::size_t workspace_bytes, Stream stream);

}  // namespace fastweight::detail
