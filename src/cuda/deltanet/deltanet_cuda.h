// deltanet_cuda.h: the CUDA back end of DeltaNet (host-callable, no CUDA headers).
#pragma once

#include "common/deltanet_params.h"

namespace fastweight::detail {

// The largest head dim K of the forward: the CTA's state slice (K, 64) lives in shared memory.
inline constexpr std::int64_t kDeltanetFwdMaxK = 256;

// Chunkwise forward (chunks of 64, the WY form of the reference): o and, when p.ht is set, the
// final states. With a workspace of deltanet_fwd_workspace_bytes(p) > 0 bytes (bf16, K <= 128) the
// tensor-core pipeline runs (deltanet_chunk_tc.cu); without one (null), a single kernel whose state
// lives in shared memory or registers (version 2 on tensor cores where it applies, else version 1).
std::size_t deltanet_fwd_workspace_bytes(const DeltanetParams& p);
void deltanet_fwd_cuda(const DeltanetParams& p, void* workspace, Stream stream);
// The pipeline (deltanet_chunk_tc.cu; bf16 q, k, v, K <= 128): wy + state kernels write w.S, w.X
// (and p.ht when set); the output kernel writes p.o from them.
bool deltanet_chunk_tc_applies(const DeltanetParams& p);
// phases: 1 the wy kernel, 2 the state kernel, 3 both (the backward runs them apart: see below).
void deltanet_chunk_tc_states(const DeltanetParams& p, const DnChunkBufs& w, Stream stream, int phases = 3);
void deltanet_chunk_tc_output(const DeltanetParams& p, const DnChunkBufs& w, Stream stream);
// The forward pipeline's D' hand-off (DnChunkBufs::dprime) where it applies (default on); the
// previous setting is returned. Off: X in fp32 as the backward's recompute writes it (tests, A/B).
bool set_deltanet_fwd_dprime(bool enabled);
// The backward with bf16 operands keeps X (the recompute's) and the Y region (dD0, dD, -Y) as bf16
// where the rows allow it (V % 8 == 0; DnBwdWs::xb): the prep, serial, post kernels and the chunk pass
// move half the bytes, and the chunk pass takes X, -Y as tensor-core operands straight from memory,
// the beta factors applied to its fp32 products instead. deltanet_bwd_x_bf16: where it applies; the switch (tests,
// A/B; default on) returns the previous setting.
bool deltanet_bwd_x_bf16(const DeltanetParams& p);
bool set_deltanet_bwd_x_bf16(bool enabled);
// With bf16 operands the wy kernel writes Xu = T2 diag(beta) V as bf16 (FLA's u) where the state kernel
// reads it through its tiles and V % 8 == 0 (DnChunkBufs::xu16), in the forward and the backward's
// recompute: half the bytes written and read, half the region. deltanet_xu_bf16: where it applies;
// the switch (tests, A/B; default on) returns the previous setting.
bool deltanet_xu_bf16(const DeltanetParams& p);
bool set_deltanet_xu_bf16(bool enabled);
// Tests and benchmarks only: the backward serial kernel's q / Xw tiles double-buffered (bf16 operands,
// where they fit; default on). Returns the previous setting.
bool set_deltanet_bwd_serial_db2(bool enabled);
// Tests and benchmarks only: that kernel warp-specialised where it applies (bf16 operands, 32-column
// tiles, sm_90: deltanet_bwd_state_ws_kernel; default off: no faster on the H100; the same bits).
// Returns the previous setting (fastweight_bench --dn-bwd-ws=on).
bool set_deltanet_bwd_serial_ws(bool on);
// The backward's serial kernel with dS^T in registers, a warp per 16 columns of V (deltanet_bwd_rs.cu:
// bf16 operands with bf16 dD0 / Y, K <= 128, K % 8 == 0, V % 16 == 0, aligned rows of k and dO, an
// sm_90 binary): launched by deltanet_bwd_state_tc in place of the other serial kernels, false where
// it does not apply. set_deltanet_bwd_serial_rs (tests, A/B): 0 off; 1 on (the default: its wgmma form,
// one warpgroup of chain warps, where the binary is sm_90a; otherwise the mma.sync form with 4 chain
// warps per CTA, 2 with variable lengths); 2 or 4: the mma.sync form with that many chain warps; 5 the
// wgmma form (as 1). Returns the previous setting (fastweight_bench --dn-serial-rs=off|on|2|4|5).
// deltanet_bwd_serial_rs_plan decides (before the prep kernel, which skips Q^ where the kernel reads q
// itself); deltanet_bwd_serial_rs_launch launches what it planned.
struct DnRsPlan {
  bool applies = false, qraw = false;  // qraw: reads q and rq and scales dO^T (no Q^ from prep)
  bool x1f = false;                    // the wgmma forms' X1 issued first
  bool defer = false;                  // ... and each step's stores during the next step's X1
  bool wide = false;                   // ... from one tile pair of the CTA, as whole rows
  bool tma = false;                    // ... by tensor-map stores (the launch may fall back to wide)
  int k64 = 0, form = 0, nw = 0, nbuf = 0;
  std::size_t bytes = 0;
  std::int64_t grid_x = 0, grid_y = 0;
};
DnRsPlan deltanet_bwd_serial_rs_plan(const DeltanetBwdParams& p, const DnBwdWs& w, bool vq, bool vk, bool vo);
void deltanet_bwd_serial_rs_launch(const DnRsPlan& plan, const DeltanetBwdParams& p, const DnBwdWs& w, float* ws,
                                   Stream stream);
int set_deltanet_bwd_serial_rs(int mode);
// Tests and benchmarks only: that kernel's dSe and dD stores by a storer warp (on) or by the chain warps
// themselves (the default); the same bits. Returns the previous setting (fastweight_bench --dn-rs-storer=on).
bool set_deltanet_bwd_serial_rs_storer(bool on);
// Tests and benchmarks only: the wgmma form with one transposition tile per chain warp (dSe^T stored at
// the step's top, then dD through the same tile), which leaves room for 3 operand buffers at K = 128
// (4 at K <= 64) instead of 2 (default off: not yet measured; the same bits as the wgmma form).
// Returns the previous setting (fastweight_bench --dn-rs-t1=on).
bool set_deltanet_bwd_serial_rs_t1(bool on);
// Tests and benchmarks only: that kernel reads q and the L2 factor rq and scales its dO^T fragments by
// s rq (dO^T Q^ = (dO^T diag(s rq)) q), so the prep kernel writes no Q^ (a (rows, K) bf16 matrix:
// 134 MB of writes at (1,32768,16,128); its workspace region is still reserved). Other roundings (dO s rq
// to bf16 instead of s rq q), other bits. Default on (H100, session 30: bwd 0.977-0.985x). Returns the
// previous setting (fastweight_bench --dn-rs-qraw=off).
bool set_deltanet_bwd_serial_rs_qraw(bool on);
// Tests and benchmarks only: that kernel's wgmma form loads a sequence's whole chunks of k, Q^ (or q)
// and Xw by an unrolled copy loop (warp_load_tile_sw128_unrolled) instead of the predicated one. The
// same bits. Default off (H100, session 31: 1.00x, so the copies' instructions were not the bound).
// Returns the previous setting (fastweight_bench --dn-rs-lfast=on).
bool set_deltanet_bwd_serial_rs_lfast(bool on);
// Tests and benchmarks only: that kernel's wgmma form issues the chain's product X1 = dSe^T K^T as soon
// as a chunk's operands land, and loads dO^T, dD0 (and scales dO^T with qraw) while it runs, instead of
// before it. The same bits. Default on (DEFER and WIDE stand on it; alone 1.00x, H100, session 31).
// Returns the previous setting (fastweight_bench --dn-rs-x1first=off).
bool set_deltanet_bwd_serial_rs_x1first(bool on);
// Tests and benchmarks only: that kernel's dSe / dD row stores (chain or storer warps) from the lane's
// first row and a fixed byte step, unpredicated on whole tiles, instead of a 64-bit row product and a
// branch per store, each row piece read into registers of its own before the first store. The same bits.
// Default on (with WIDE's defaults; 1.00x alone, H100, session 31). Returns the previous setting
// (fastweight_bench --dn-rs-slean=off).
bool set_deltanet_bwd_serial_rs_slean(bool on);
// Tests and benchmarks only: with x1first (the wgmma form, not T1, no storer warp), each step's dSe /
// dD tiles are stored during the next step, right after its X1 is issued, instead of at the step's end.
// The same bits. Default on (WIDE's ground; alone 1.00x, H100, session 31). Returns the previous
// setting (fastweight_bench --dn-rs-defer=off).
bool set_deltanet_bwd_serial_rs_defer(bool on);
// Benchmarks only, never in a real run: with defer at K <= 128 (Kc = 128), parts of that kernel's step
// left out (a mask, one of: 1 the dSe / dD stores, 2 the qraw scaling, 8 X1, 32 B Xw, 40 both products;
// others are refused: 0 is set),
// so that timing shows which part sets the step. THE RESULTS ARE WRONG while it is nonzero. Returns the
// previous mask (fastweight_bench --dn-rs-probe=MASK, with --timing-only).
int set_deltanet_bwd_serial_rs_probe(int mask);
// Tests and benchmarks only: with defer, the chain warps write one tile pair for the CTA and store whole
// 128-byte rows of it (4 rows an instruction) instead of each warp its own 32-byte row pieces. The same
// bits. Default on (H100, session 32: bwd 0.94-0.98x at (1,32768) and varlen 8, 0.96-0.99x at
// (2,8192), 1.00x elsewhere). Returns the previous setting (fastweight_bench --dn-rs-wide=off).
bool set_deltanet_bwd_serial_rs_wide(bool on);
// Tests and benchmarks only: with WIDE (V >= 64), the tile pair kept dense in the 128-byte swizzle and
// stored by two tensor-map stores a step (dSe^T, dD) issued by one thread, instead of the chain warps'
// 16-byte stores (a chunk shorter than 64 rows keeps them for dD). The same bits. 0 never, 1 always, 2
// (the default) with variable lengths or where the kernel's grid fills at most half the SMs (H100,
// session 33, bwd with bf16 operands, two calls: 0.967 / 0.957 at (1,32768,16,128), 32 CTAs; 0.983 /
// 0.983 at varlen 8 in 32768; 1.001 / 0.997 at (2,8192), 64 CTAs; but 1.015 / 1.012 at (4,4096), 128
// CTAs, and 0.990 / 0.999 at (8,2048,32,64), 256). Returns the previous setting
// (fastweight_bench --dn-rs-tma=on|off).
int set_deltanet_bwd_serial_rs_tma(int mode);
// Tests only: what the last launch of that kernel was (0 mma.sync, 1 wgmma, 2 wgmma T1, 3 and 4 those
// two with X1 first, 5 the wgmma form with X1 first and deferred stores, 6 that with probes, 7 that
// with whole-row stores, 16 those by tensor-map stores; + 8 with qraw), or -1 if none since the last
// call; sets it to `reset` and returns the previous value.
int deltanet_bwd_serial_rs_last_launch(int reset = -1);
// Tests and benchmarks only: the tensor-core chunk pass's grid with a (slot, head)'s K tiles as
// neighbours (K > 64; default on) instead of a grid of slots apart; the same bits. Returns the
// previous setting (fastweight_bench --dn-chunk-kfast=off).
bool set_deltanet_bwd_chunk_kfast(bool on);
// Tests and benchmarks only: the L2-norm backward fused into the tensor-core chunk pass where it
// applies (bf16 operands) instead of its own kernel, the same bits: 0 never, 1 (the default) where K
// is one 64-column tile, 2 also two K tiles as a cluster of 2 (sm_90). Returns the previous setting
// (fastweight_bench --dn-chunk-l2=off|on|pair).
int set_deltanet_bwd_chunk_l2(int mode);
// Tests and benchmarks only: the post kernel loads every V tile's dD and X with k and T2 at its start
// (bf16 operands, bf16 dD / X, V <= 128, where it costs no resident CTA) instead of tile by tile;
// default off, the same bits. Returns the previous setting (fastweight_bench --dn-post-pf=on).
bool set_deltanet_bwd_post_prefetch(bool on);
// Tests and benchmarks only: the prep kernel's bf16 dD0 staged through shared memory and stored as
// 16-byte row pieces (8 lanes a 128-byte row) instead of the fragments' 4-byte pairs. Default on
// (session 30); the same bits. Returns the previous setting (fastweight_bench --dn-prep-stage=off).
bool set_deltanet_bwd_prep_stage(bool on);
// Tests and benchmarks only: the post kernel's bf16 -Y rows (and dv, where its rows are 16-byte
// aligned) staged through shared memory and stored as 16-byte row pieces. Default on (session 30); the
// same bits. Returns the previous setting (fastweight_bench --dn-post-stage=off).
bool set_deltanet_bwd_post_stage(bool on);
// Tests and benchmarks only: the chunk pass's bf16 dq^ / dk^ workspace rows (the L2 norm's backward
// not fused: K = 128 by default) staged through shared memory and stored as 16-byte row pieces.
// Default on (session 30); the same bits. Returns the previous setting (--dn-chunk-stage=off).
bool set_deltanet_bwd_chunk_stage(bool on);
// Tests and benchmarks only: the wy kernel's v tile buffers, 1 or 2 (0: the planner's choice, two
// unless the second costs a resident CTA per SM). Returns the previous setting.
int set_deltanet_wy_vbufs(int n);
// Tests and benchmarks only: the serial kernels' V tile (the forward state kernel, the backward serial
// kernel), 64 or 32 columns (0: the planner's choice). Returns the previous setting.
int set_deltanet_state_tile(int cols);
// The serial kernels' chunk step (the forward state kernel; the backward serial kernel with bf16
// operands) with two barriers (the next chunk's loads issued after the first; default on) or three;
// the same bits. Returns the previous setting (tests; fastweight_bench
// --dn-two-sync=off).
bool set_deltanet_state_two_sync(bool on);
bool deltanet_serial_two_sync();
// The forward state kernel warp-specialised (the forward's call, not the backward's recompute; bf16
// operands, 32-column tiles, sm_90, two barriers, aligned rows, the Xu tiles, V % 8 == 0): a producer
// warp loads each chunk's operands and stores S while 8 warps compute; the same bits.
// Default on; returns the previous setting (tests; fastweight_bench --dn-state-ws=off).
bool set_deltanet_state_ws(bool on);
// Its producer warps, 1 or 2 (default 2: k, rk beta and the S store on one, Xw and Xu on the other);
// returns the previous setting (tests; fastweight_bench --dn-state-ws-warps=1).
int set_deltanet_state_ws_warps(int n);
// Tests and benchmarks only: the wy kernel's bf16 Xw (K % 8 == 0) and Xu rows staged through shared
// memory and stored as 16-byte row pieces (forward and the backward's recompute). Default on (session
// 30); the same bits. Returns the previous setting (fastweight_bench --dn-wy-stage=off).
bool set_deltanet_wy_stage(bool on);
// Tests and benchmarks only: the output kernel's grid with a (slot, head)'s V tiles as neighbours
// (V > 64; default on) instead of a grid of slots apart; the same bits. Returns the previous setting
// (fastweight_bench --dn-out-vfast=off).
bool set_deltanet_out_vfast(bool on);
// Tests and benchmarks only: the output kernel's bf16 o rows staged through shared memory and stored as
// 16-byte row pieces instead of 4-byte column pairs; the same bits. Default on (H100, session 32: fwd
// 0.96-0.99x at every benchmark shape). Returns the previous setting (fastweight_bench --dn-out-stage=off).
bool set_deltanet_out_stage(bool on);
// Tests and benchmarks only: the state kernel (bf16 operands, K = 128) stores the forward's D' rows (from
// its D tile) or the backward recompute's bf16 X rows (from an X tile) as 16-byte pieces once the tile
// is whole, instead of each thread its 4-byte pairs; the same bits. 0 never, 1 always, 2 (the default)
// where its CTAs fill at least 3/4 of the SMs (H100, session 32: fwd 0.92-0.99x there, 1.03x at
// (1,32768,16,128), 64 CTAs). Returns the previous setting (fastweight_bench --dn-state-dstage=on|off).
int set_deltanet_state_dstage(int mode);
// Tests and benchmarks only: the wy kernel's fp32 T2 rows (hi + lo) as one 16-byte store a piece instead
// of four 4-byte ones; the same bits. Default off: not yet measured. Returns the previous setting
// (fastweight_bench --dn-wy-t2v4=on).
bool set_deltanet_wy_t2v4(bool on);
// The planner's choice: 32 where 64-column CTAs (one per SM) would leave more than half the SMs idle;
// with cu_seqlens (lengths unknown on the host, the longest sets the tail) up to two such waves.
int deltanet_serial_tile(const DeltanetParams& p);
// The forced tile of set_deltanet_state_tile (0: none).
int deltanet_state_tile_forced();
// The backward's (its serial kernel's and its recompute's): the forward's, but 64 where 64-column
// tiles let the two chains run beside each other (deltanet_bwd_overlap) and 32-column ones do not.
int deltanet_bwd_serial_tile(const DeltanetBwdParams& p);
// The serial kernels (forward state, backward serial) compiled for K = 128 where the problem has it,
// else for a runtime K: on by default; returns the previous setting (tests; fastweight_bench
// --dn-fixed-k=off).
bool set_deltanet_fixed_k(bool on);
bool deltanet_fixed_k(const DeltanetParams& p);
// Version 2 on tensor cores (deltanet_fwd_tc.cu): bf16 q, k, v, o and K <= 128;
// deltanet_fwd_cuda picks it where it applies (no workspace).
bool deltanet_fwd_tc_applies(const DeltanetParams& p);
void deltanet_fwd_tc_cuda(const DeltanetParams& p, Stream stream);
// Version 1 (fp32 FMA) alone: any dtype, K <= 256; with p.save_S / p.save_X set it is the backward's
// recompute (o may be absent).
void deltanet_fwd_v1_cuda(const DeltanetParams& p, Stream stream);

// Backward (deltanet_bwd.cu): the recompute above, a reverse pass over the chunks for dS, dv and
// partial dbeta, a parallel pass per chunk for dq, dk, dbeta, and the L2-norm backward when asked.
// Workspace: deltanet_bwd_workspace_bytes(p) bytes (DnBwdWs), 256-byte aligned.
std::size_t deltanet_bwd_workspace_bytes(const DeltanetBwdParams& p);
void deltanet_bwd_cuda(const DeltanetBwdParams& p, void* workspace, Stream stream);
// The state pass on tensor cores (deltanet_bwd_tc.cu): bf16 q, k, v, do, K <= 128, after the
// tensor-core recompute (T2 in the workspace).
bool deltanet_bwd_state_tc_applies(const DeltanetBwdParams& p);
// before_serial (likewise): waited for before the serial kernel (the recompute's wy kernel, run on the
// side stream beside the prep kernel: deltanet_bwd_wy_side).
// before_post (a cudaEvent_t or null): waited for on `stream` before the post kernel, the first of
// the pass to read X (the recompute's state kernel, run beside prep + serial: deltanet_bwd_cuda).
void deltanet_bwd_state_tc(const DeltanetBwdParams& p, const DnBwdWs& w, float* ws, Stream stream,
                           void* before_post = nullptr, void* before_serial = nullptr);
// Tests and benchmarks only: the backward's recompute state kernel beside the prep + serial kernels
// on a second stream (1), after them on one stream (-1), or the planner's choice (0: beside where both
// serial grids fit on the SMs at once). The same kernels and bits either way. Returns the previous.
int set_deltanet_bwd_overlap(int mode);
// Tests and benchmarks only: with the overlap, the recompute's wy kernel on the side stream too, beside
// the state pass's prep kernel (which reads none of its outputs; the serial kernel waits for it);
// default on, the same bits. Returns the previous setting (fastweight_bench --dn-bwd-wy-side=off).
bool set_deltanet_bwd_wy_side(bool on);
// Tests and benchmarks only: the backward's recompute on the warp-specialised state kernel (where its
// paths hold, as the forward's): 0 never, 1 (the default) where the recompute does not run beside the
// state pass (deltanet_bwd_overlap), 2 always; the same bits. Returns the previous setting
// (fastweight_bench --dn-recompute-ws=0|1|2).
int set_deltanet_bwd_recompute_ws(int mode);
bool deltanet_bwd_overlap(const DeltanetBwdParams& p);
// The chunk pass on tensor cores (deltanet_bwd_tc.cu), after the state pass on tensor cores. l2_vec:
// the L2-norm backward's vec kernel would apply (deltanet_bwd_cuda); returns whether that backward
// ran fused into the pass (dq, dk written; the L2 kernel must not run).
bool deltanet_bwd_chunk_tc(const DeltanetBwdParams& p, const DnBwdWs& w, float* ws, Stream stream, bool l2_vec);

// The decoding step's own kernel (deltanet_step.cu): T = 1, no cu_seqlens, K <= kStepMaxK, fp32 state
// and new state (in place allowed). deltanet_step takes it where it applies, else the forward over
// T = 1. set_deltanet_step_kernel(false) takes the forward always (A/B: bench_decode.py
// --no-step-kernel); returns the previous setting.
inline constexpr int kStepMaxK = 256;
bool set_deltanet_step_kernel(bool on);
// The step kernel with every load issued before any use (the state tile, then q, k and the tile's beta,
// v), where by default q, k are loaded and summed first and beta, v read after the first barrier. The
// same bits; 16-byte-store instances only. Off by default: H100, session 35, level at B = 1 and 8, 1.09x
// and 1.10x the time at B = 64 and 256. FW_DELTANET_STEP_EARLY=1 in the environment turns it on at the
// start. Returns the previous setting (tests, fastweight_bench --dn-step-early=on).
bool set_deltanet_step_early(bool on);
// The step kernel as a programmatic dependent launch on sm_90 (the 16-byte-store instances without the
// early loads): it may become resident while the previous kernel in the stream ends, waits for it before
// its first load or store, and lets the next step be scheduled at once; back-to-back steps overlap each
// launch with the previous step's end (the mLSTM step's C pass does the same: set_mlstm_step_pdl_c).
// The same bits. Mode 1 (default): grids of at most one CTA per SM (B * H * ceil(V / 64) <= SMs; H200,
// session 36, bench_decode cold ms without / with: B = 1 0.0049 / 0.0041, in place 0.0051 / 0.0043;
// B = 8 0.0080 / 0.0081, in place 0.0089 / 0.0093; B = 64, 256 within 2%); 2: always (tests, A/B);
// 0: never. FW_DELTANET_STEP_PDL=0|1|2 in the environment sets the mode at the start. Returns the
// previous mode (tests, fastweight_bench --dn-step-pdl=off|on|all).
int set_deltanet_step_pdl(int mode);
bool deltanet_step_kernel_applies(const DeltanetParams& p);
void deltanet_step_cuda(const DeltanetParams& p, Stream stream);

}  // namespace fastweight::detail
