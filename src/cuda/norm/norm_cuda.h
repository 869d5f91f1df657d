// norm_cuda.h: the CUDA back end of the LayerNorm family (host-callable, no CUDA headers).
// Arguments were validated by src/api; these only plan the launch and run it on `stream`.
#pragma once

#include <cstddef>

#include "common/norm_params.h"

namespace fastweight::detail {

void rownorm_fwd_cuda(const RowNormParams& p, Stream stream);
// Bytes of scratch the backward needs for its fp32 weight-gradient partials (0 without dw/db).
std::size_t rownorm_bwd_workspace_bytes(const RowNormParams& p);
void rownorm_bwd_cuda(const RowNormParams& p, void* workspace, std::size_t workspace_bytes,
                      Stream stream);

// Tests only: the forward kernel the calling thread's last norm forward launched ("row1", "bulk",
// "bulk_unstaged", "bulk_unstaged_hoist", "bulk_unstaged_1024", "row", "cached", "stream"; "" before
// any), so that a test of a path can check it ran.
const char* rownorm_fwd_last_kernel();
void note_rownorm_fwd_kernel(const char* name);
// Likewise the backward's ("ring", "ring3", "ring_cluster", "ring3_cluster", "cached", "rowsum_coltile"; the plain
// ring's with "_tight" for whole-warp row groups, "_s3" for 3 stages: "ring_tight_s3" ...; the rings' RMSNorm
// instances end in "_rms").
const char* rownorm_bwd_last_kernel();
void note_rownorm_bwd_kernel(const char* name);
// The backward's ring kernel with 3 vectors per thread instead of 4 where that idles fewer of a row group's
// threads (3 tpr3 < 4 tpr, tpr3 <= 512: bf16 N 1032..1536, 2056..3072, 4104..6144, 8200..12288; 256 x 3 at
// N 6144, where 4 vectors leave a quarter of 256 x 4 idle). ptxas (sm_90a, bf16): 122 registers, no spill
// (4 vectors: 128). Session 41 (H200, LayerNorm bf16 x 4096 rows, ms, 4 / 3 vectors): N 3072 0.0361 / 0.0341,
// 5120 0.0571 / 0.0543, 6144 0.0612 / 0.0579, 10240 0.1071 / 0.1008, 12288 0.1158 / 0.1095; level where it is
// not taken (8192, 16384). On by default; FW_NORM_BWD_RING3=0 turns it off at start.
// Returns the previous setting (tests, fastweight_bench --bwd-ring3=off|on).
bool set_rownorm_bwd_ring3(bool on);
bool rownorm_bwd_ring3();
// The plain ring's row groups of any multiple of 32 threads (4 or 3 vectors each, at least kRingMinTpr threads),
// where that gives a CTA more of them than the power-of-two groups: the CTA runs R = 512 / tpr whole groups (R tpr
// threads). bf16: N 2056..3072 96 x 4 (5 groups, against 4 of 128), 4104..5120 160 x 4 (3, against 2 of 256 x 3,
// which leaves 1/6 of the vector slots idle at N 5120): more rows in flight per SM. Session 45 (H200, LayerNorm bf16
// unless said, ms, off / on): 4096 x 5120 0.0550 / 0.0479, x 4608 0.0550 / 0.0463, 16384 x 5120 0.1786 / 0.1426,
// RMSNorm 4096 x 5120 0.0498 / 0.0456, 4096 x 2560 0.0335 / 0.0327, fp32 4096 x 2560 0.0449 / 0.0443; 1024 x 5120
// level (the cluster ring there). Mode 1: that rule alone; 0 off. Mode 2, the default since session 46, also takes
// whole-warp groups where a CTA holds as many as before but fewer vector slots idle: bf16 N 7168 224 x 4 (2 groups,
// against 256 x 4 with 1/8 idle), 9216..11264 at one group per CTA (9216 384 x 3 against 512 x 3), 13312..14336
// (416 / 448 x 4); fewer threads per SM, less work on zero-filled slots. Session 46 (H200, bf16 unless said, ms,
// mode 1 / 2): LayerNorm 4096 x 9216 0.0999 / 0.0873, RMSNorm 0.0914 / 0.0808, fp16 LayerNorm 4096 x 10240
// 0.1001 / 0.0927; session 45: x 10240 0.1002 / 0.0938, x 11264 0.1045 / 0.0954, x 13312 0.1173 / 0.1133; x 7168
// and x 14336 level (0.0631 / 0.0628, 0.1179 / 0.1171). FW_NORM_BWD_RING_TIGHT=0|1|2 at start. Returns the
// previous mode (tests, fastweight_bench --bwd-ring-tight=off|on|idle).
int set_rownorm_bwd_ring_tight(int mode);
int rownorm_bwd_ring_tight();
// The plain ring's row slots per row group: 0 (the default) the rule, 3 where a CTA holds one row group (two rows in
// flight while one is reduced: bf16 N 8200..12288, fp32 4100..6144; not the RMSNorm instance's 512-thread group, bf16
// N 11528..12288, fp32 5764..6144: 2 slots 2.1-2.7% faster there, session 52) and its shared memory fits, else 2; 2 or 3
// forces that (3 where it fits). Session 45 (H200, LayerNorm bf16 unless said, ms, 2 / 3 slots): 4096 x 12288
// 0.1110 / 0.1080, x 10240 0.1032 / 0.1001, fp32 4096 x 5120 0.0835 / 0.0796; with more row groups per CTA level or
// slower: x 6144 0.0579 / 0.0580, x 4096 0.0400 / 0.0419, x 2048 0.0268 / 0.0291, whole-warp x 5120 0.0479 / 0.0502.
// FW_NORM_BWD_RING_STAGES=0|2|3 at start. Returns the previous setting (tests, fastweight_bench
// --bwd-ring-stages=auto|2|3).
int set_rownorm_bwd_ring_stages(int stages);
int rownorm_bwd_ring_stages();
// RMSNorm rows in the ring's RMSNorm instances (plain and in clusters; the kernel's RMS): the mean, the row sum of g
// and the bias partials left out at compile time (per element two adds and a subtraction fewer, and one warp-sum
// chain per row). The same bits as the generic instance: the kernel spells every rounding out with intrinsics (session
// 46's first run found ptxas contracting the two instances' dx differently). Why: the ring at one row group per CTA
// is bound by its per-thread work (mode 2 above), and cuDNN's RMSNorm backward led at 4096 x 12288 (0.0863 ms against
// 0.1003). Session 46 (H200, RMSNorm bf16, ms, off / on): 4096 x 12288 0.0991 / 0.0897, 512 x 32768 (clusters)
// 0.0450 / 0.0417, 4096 x 9216 (mode 2) 0.0808 / 0.0720, 4096 x 5120 0.0455 / 0.0461. On by default;
// FW_NORM_BWD_RING_RMS=0 turns it off at start. Returns the previous setting (tests, fastweight_bench
// --bwd-ring-rms=off|on).
bool set_rownorm_bwd_ring_rms(bool on);
bool rownorm_bwd_ring_rms();
// The plain ring's scale in registers (the kernel's SREG), as raw vectors of the IO dtype, where the fp32 scale is
// exactly one (fp32 rows, no weight, or a weight of the IO dtype with weight_offset 0; else shared memory as before):
// the same bits. Why: ncu (H200, RMSNorm bf16 4096 x 12288) put 36% of the ring's cycles between issues on
// short-scoreboard stalls (shared memory); the scale was half the bytes the two passes read there. Mode 1 (the
// default): the generic 16-bit instance of 3 vectors and 3 row slots only (bf16 N 8200..12288 at one row group per
// CTA; 128 registers, no spill); mode 2: wherever exact; 0: off. Session 51 (H200, bf16 bwd, the statistics once per
// warp, ms, off / mode 2): LayerNorm 4096 x 9216 0.0775 / 0.0728, 4096 x 12288 0.0950 / 0.0900, fp16 0.0962 /
// 0.0901; slower where the instance spills (the generic 4-vector ones, 68-124 bytes): 4096 x 5120 0.0472 / 0.0604,
// 4096 x 16384 0.1150 / 0.1620; RMSNorm level to 2% slower (4096 x 12288 0.0881 / 0.0899); fp32 level.
// FW_NORM_BWD_RING_SREG=0|1|2 at start. Returns the previous mode (tests, fastweight_bench --bwd-ring-sreg=off|auto|on).
int set_rownorm_bwd_ring_sreg(int mode);
int rownorm_bwd_ring_sreg();
// Whether the last backward launched took the scale-register instance (tests).
bool rownorm_bwd_last_sreg();
void note_rownorm_bwd_sreg(bool on);
// The backward's row statistics (mean, rstd) copied once per warp (rings) or per row group of fewer threads (the
// cached kernel's aligned rows) by its first thread, and read from that slot, instead of one 4-byte cp.async per
// thread and row: 2 VPT + 2 cp.async per thread and row become 2 VPT for LayerNorm (2 VPT + 1 for RMSNorm). The same
// values, so the same bits. Session 51 (H200, bf16 bwd, ms, off / on): LayerNorm 4096 x 12288 0.1091 / 0.0948,
// 4096 x 5120 0.0481 / 0.0470; RMSNorm 4096 x 12288 0.0924 / 0.0881, 4096 x 5120 0.0459 / 0.0457, 512 x 32768
// (clusters) 0.0424 / 0.0410; slower only at RMSNorm 4096 x 16384, 0.1116 / 0.1156 twice, so the RMSNorm ring's
// 4 x 512 row groups (bf16 N 12296..16384) keep a copy per thread. On by default; FW_NORM_BWD_RING_WSTAT=0 turns it off at start. Returns the previous
// setting (tests, fastweight_bench --bwd-ring-wstat).
// The plain ring fed by a producer warp (the kernel's PROD: full / empty mbarriers per row slot, x and dy by bulk
// copies; whole-warp row groups within 480 consumer threads, bf16 N <= 15360, fp32 <= 7680): off (0, the default) or
// forced (1) wherever it applies (Hopper). Compiled in session 51, not measured yet: the A/B is session 52's.
// FW_NORM_BWD_RING_PROD=0|1 at start. Returns the previous mode (tests, fastweight_bench --bwd-ring-prod=off|on).
int set_rownorm_bwd_ring_prod(int mode);
int rownorm_bwd_ring_prod();
// Whether the last backward launched took the producer-warp ring (tests).
bool rownorm_bwd_last_prod();
void note_rownorm_bwd_prod(bool on);
// Tests and benchmarks only: every backward on rowsum + coltile, the general path that the planner otherwise keeps
// for rows the ring and cached kernels cannot index with RowIndexer::offset_lean (merged leading dims with 2^31
// rows or more) and for rows past the cached kernel's and the ring clusters' reach. Default off. Returns the
// previous setting (fastweight_bench --bwd-general=on).
bool force_rownorm_bwd_general(bool on);
bool rownorm_bwd_general();
bool set_rownorm_bwd_ring_wstat(bool on);
bool rownorm_bwd_ring_wstat();
// Aligned rows past the ring kernel's reach (bf16 / fp16 N > 16384, fp32 N > 8192) on Hopper: the ring kernel in
// clusters of C = ceil(N / that reach) <= 8 CTAs (bf16 N <= 131072, fp32 <= 65536), each CTA the same rows' N / C
// columns, the row sums exchanged through the peers' shared memory (st.async on their mbarriers) and added in
// rank order; x and dy are read once, where rowsum + coltile (the path without it, and past 8 CTAs) reads them
// twice. Session 41 (H200, bf16 LayerNorm unless said, ms, off / on): 4096 x 20480 0.2659 / 0.2011, x 24576 0.3099 /
// 0.2144, x 32768 0.4057 / 0.2588 (3.1 TB/s); 512 x 32768 0.0725 / 0.0518, x 65536 0.1180 / 0.0900, x 131072 0.2091 /
// 0.1593; RMSNorm 4096 x 32768 0.4027 / 0.2387; fp32 4096 x 16384 0.3575 / 0.2088. Its generic instance spilled
// 48 B until the row offsets went 32-bit (RowIndexer::offset_lean, session 53: LayerNorm bf16 512 x 32768 0.0504 ->
// 0.0438, 2048 x 32768 0.1593 -> 0.1240, 256 x 131072 0.1094 -> 0.0813). On by default;
// FW_NORM_BWD_CLUSTER=0 turns it off at start. Returns the previous setting (tests, fastweight_bench --bwd-cluster=off|on).
bool set_rownorm_bwd_cluster(bool on);
bool rownorm_bwd_cluster();
// m times the cluster ring's CTAs per cluster (at most 8), and clusters of m CTAs for rows within the ring's reach
// too, where each rank then keeps at least 64 threads per row group (bf16 N >= 2048 m); fewer weight-gradient partial
// rows (rownorm_plan). 0 (the default): the planner's rule, m = 2 up to 8 rows per SM on rows past 512 vectors (bf16
// N > 4096), else 1 (session 43, H200, LayerNorm bf16: 512 x 16384 0.0357 -> 0.0305 ms, 512 x 32768 0.0518 ->
// 0.0484, 1024 x 8192 0.0310 -> 0.0289; 2048 and 4096 rows level or 1-6% slower, so not there). m >= 1 forces m.
// FW_NORM_BWD_CLUSTER_MULT=0|1|2|4 at start. Returns the previous setting (tests, fastweight_bench
// --bwd-cluster-mult=M).
int set_rownorm_bwd_cluster_mult(int m);
int rownorm_bwd_cluster_mult();
// The Hopper bulk-copy forward (rownorm_fwd_bulk.cuh) for aligned rows where it applies (default on).
// Tests and benchmarks only: off routes those rows to the persistent kernel, the path of devices
// without bulk copies. Returns the previous setting.
bool set_rownorm_fwd_bulk(bool enabled);
bool rownorm_fwd_bulk_enabled();
// The bulk forward also for aligned rows past its reach up to twice it (bf16 / fp16: 16385..32768,
// fp32: 8193..16384), the scale and bias read per output vector from global memory instead of staged
// in shared memory (rownorm_fwd_bulk.cuh, STAGED = false); else those rows take the streaming kernel.
// Mode 1 (default): LayerNorm rows always; RMSNorm rows too, except below 8 rows per SM with the
// hoisted loads below switched off (there the streaming kernel was faster than the unhoisted form: H200
// 512 x 32768 bf16 0.0309 ms against 0.0320); 2: all such rows (tests, A/B); 0: off.
// FW_NORM_BULK_LONG=0|1|2 in the environment sets the mode at start (the Python benchmarks' A/B runs).
// Returns the previous mode (tests, fastweight_bench --bulk-long=off|on|all).
int set_rownorm_fwd_bulk_long(int mode);
int rownorm_fwd_bulk_long_mode();
// The long rows above in CTAs of 1024 threads with 4 vectors each (64 registers at most) instead of
// 512 threads with 8; its parameter loads are hoisted (set_rownorm_fwd_bulk_hoist). Measured slower
// (H200, session 37, ms: 512 x 32768 bf16 LayerNorm 0.0372 against 0.0355, 4096 x 32768 0.2110 against
// 0.1949): off, for tests and A/B. FW_NORM_BULK_LONG_WIDE=1 turns it on at start. Returns the previous
// setting (tests, fastweight_bench --bulk-long-wide=on).
bool set_rownorm_fwd_bulk_long_wide(bool on);
bool rownorm_fwd_bulk_long_wide();
// The unstaged bulk forward (long rows; rows within the reach where forced) with a row's scale and
// bias loads all issued before its first store, x read again from its slot for the output. Without it
// each vector's two loads wait in turn behind the previous vector's store (SASS: 8 dependent L2 trips
// per row). It holds more registers (bf16 122): it wins where few rows per SM leave each row's latency
// exposed and loses where many rows keep the pipe full (H200, session 37, bf16 ms, without / with:
// LayerNorm 512 x 32768 0.0355 / 0.0340, 1024 x 32768 0.0595 / 0.0569, 2048 x 24576 0.0833 / 0.0849,
// 4096 x 32768 0.1949 / 0.2086; RMSNorm 512 x 32768 0.0319 / 0.0296 (streaming 0.0304), 1024 x 32768
// 0.0551 / 0.0505 (streaming 0.0540)). Mode 1 (default): long rows below 8 rows per SM; 2: every
// unstaged row (tests, A/B); 0: never. The 1024-thread form always hoists. FW_NORM_BULK_HOIST=0|1|2
// sets the mode at start. Returns the previous mode (tests, fastweight_bench --bulk-hoist=off|auto|on).
int set_rownorm_fwd_bulk_hoist(int mode);
int rownorm_fwd_bulk_hoist_mode();
// Tests and benchmarks only: the same unstaged form for the rows within the bulk forward's reach too
// (with the parameters above; 8 vectors per thread): the shared memory the staged parameters took
// becomes more row slots (4096 x 16384 bf16: 2 row groups of 3 slots against 1 of 3). Default off.
// Returns the previous setting (fastweight_bench --bulk-unstaged=on).
bool force_rownorm_fwd_bulk_unstaged(bool on);
bool rownorm_fwd_bulk_unstaged();
// Tests only: at most `ctas` CTAs per parameter group for the bulk forward (0: no cap), so that few
// rows take each row group's ring around many times. Returns the previous cap.
int cap_rownorm_fwd_bulk_ctas(int ctas);
int rownorm_fwd_bulk_cta_cap();
// Tests and benchmarks only: the bulk forward's vectors per thread, 4 or 8 where it fits (0: the
// planner's choice). Returns the previous setting.
int force_rownorm_fwd_bulk_vecs(int vpt);
int rownorm_fwd_bulk_vecs();
// Tests and benchmarks only: the one-row-per-CTA forward (rownorm_fwd_row1_kernel) where the planner
// gives it rows (default on); off routes them to the bulk / persistent kernels. Returns the previous
// setting.
bool set_rownorm_fwd_row1(bool enabled);
bool rownorm_fwd_row1_enabled();
// Tests and benchmarks only: its vectors per thread, 1 or 2 (0: the planner's choice, 4 at N 3080..4096
// with raw parameters; forced, the planner gives it aligned 16-bit rows of 33..256 x vpt vectors whatever
// the row count). Returns the previous setting.
int force_rownorm_fwd_row1_vecs(int vpt);
int rownorm_fwd_row1_vecs();
// The one-row forward's 4- and 8-vector instances with registers capped for more CTAs per SM, as FLA's
// 8-warp row kernel (63 registers at D = 8192, 126 at 16384; it led ours by 6-11% under ncu at 4096 x
// 4096 / 8192 with the same bytes and hit rates, session 37): 4 x 128 threads and 4 x 256 at 64
// registers (8 and 4 CTAs per SM; 71 uncapped), 8 x 128 and 8 x 256 at 128 (4 and 2 CTAs; 156
// uncapped). Mode 0: none; 1 (auto, the default): the 4 x 256 and 4 x 512 instances, which the planner
// then also gives aligned 16-bit rows with raw parameters on Hopper: 769..1024 vectors (N 6152..8192)
// at most 4 rows per SM or from 24, and 1537..2048 vectors (N 12296..16384) at most 4 rows per SM
// (session 38: 2-20% faster than the bulk kernel there); 2: every capped instance, forced shapes of 8 x
// 512 and 4 x 1024 (one CTA per SM) included (A/B). FW_NORM_ROW1_CAPPED=0|1|2 sets the mode at start.
// Returns the previous mode (tests, fastweight_bench --row1-capped=off|auto|on).
int set_rownorm_fwd_row1_capped(int mode);
int rownorm_fwd_row1_capped_mode();
// Long rows in the one-row kernel, 8 x 512 threads (FLA's shape), capped: 2 CTAs per SM at 64 registers
// with x packed (set_rownorm_fwd_row1_rawx, the default), else 1 at 128: aligned 16-bit rows of 3585..4096
// vectors (N 28680..32768) with raw parameters, any number of rows, on Hopper, instead of the bulk kernel
// (session 39, H200, LayerNorm bf16 x 32768, ms, bulk / 8 x 512 at 1 CTA per SM: 256 rows 0.0214 / 0.0180,
// 1024 0.0578 / 0.0516, 4096 0.1956 / 0.1789, 16384 0.7201 / 0.6863; RMSNorm 4096 0.1833 / 0.1684; level at
// N 28672 and 24584, whose threads idle vectors: those rows take whole-warp shapes now, below).
// On by default; FW_NORM_ROW1_LONG=0 turns it off at start. Returns the previous setting (tests,
// fastweight_bench --row1-long=off).
bool set_rownorm_fwd_row1_long(bool on);
bool rownorm_fwd_row1_long();
// The one-row kernel's 4- and 8-vector instances may load their raw parameters one vector ahead of
// the output (the first during the second sum) instead of all at once after the sums, so at most two
// vectors' parameters are live beside x. ptxas (sm_90a, bf16): 4 x 128 71 -> 62 registers (8 CTAs per
// SM instead of 7); capped 4 x 256 and 4 x 512 at 64 and 8 x 512 at 128 lose their 20-32 spilled
// bytes. Mode 0: none; 1 (the default): the 4-vector instances (session 39, H200, ms, after the sums /
// ahead: LayerNorm bf16 4096 x 4096 0.0229 / 0.0230, fp16 0.0237 / 0.0228, 4096 x 8192 0.0408 /
// 0.0398, 32768 x 8192 0.2757 / 0.2686, 256 x 16384 0.0102 / 0.0098; RMSNorm 512 x 16384 0.0160 /
// 0.0152); 2: the 8-vector ones too (8 x 512 lost: 512 x 32768 0.0297 / 0.0312). FW_NORM_ROW1_PREFETCH=
// 0|1|2 sets the mode at start. Returns the previous mode (tests, fastweight_bench --row1-prefetch=off|auto|on).
int set_rownorm_fwd_row1_prefetch(int mode);
int rownorm_fwd_row1_prefetch_mode();
// The one-row kernel's capped instances with x kept packed across the sums (the kernel's RX; the same bits),
// parameters one vector ahead. ptxas (sm_90a, bf16): 8 vectors x 512 / 256 / 128 threads fit 64 registers (4
// spilled bytes), so twice the CTAs per SM (2 / 4 / 8: at N = 32768 a second row per SM in flight); 4 x 128
// uncapped 62 -> 48 registers. Mode 1 (the default): the capped 8-vector instances at twice the CTAs per SM, and
// the planner gives aligned 16-bit rows of 1793..2048 vectors (N 14344..16384) with raw parameters on Hopper,
// more than 2 rows per SM, to 8 x 256. Session 39, H200, ms, before / x packed: LayerNorm bf16 512 x 32768
// 0.0295 / 0.0280, 4096 x 32768 0.1781 / 0.1447, fp16 0.1773 / 0.1406; RMSNorm 512 x 32768 0.0280 / 0.0248,
// 4096 x 32768 0.1676 / 0.1379; 4096 x 16384 0.0798 (bulk) / 0.0741, 512 x 16384 0.0161 (4 x 512) / 0.0148.
// Mode 2: also the 4-vector instances at their own caps (lost 1-3%: 4096 x 8192 0.0396 / 0.0406, 4096 x 4096
// 0.0227 / 0.0230). FW_NORM_ROW1_RAWX=0|1|2 sets the mode at start. Returns the previous mode (tests,
// fastweight_bench --row1-rawx=off|auto|on).
int set_rownorm_fwd_row1_rawx(int mode);
int rownorm_fwd_row1_rawx_mode();
// Whole-warp one-row CTAs (Hopper, where it was measured): the planner's one-row threads per row rounded up to a
// multiple of 32 instead of a power of two (N 3072: 2 x 192, not 2 x 256 with a quarter idle), and with raw parameters
// aligned 16-bit rows of 513..768 vectors (N 4104..6144) in 4 x 129..192 and of 1025..3584 vectors (N
// 8200..28672) in 8 x 129..448 with x packed (rawx mode 1), where the bulk kernel took them (the 4 x 256 / 4
// x 512 / 8 x 256 rules above keep their rows). Session 40 (H200, LayerNorm bf16, ms, off / on): 4096 x 2560
// 0.0204 / 0.0168, x 3072 0.0214 / 0.0196, x 4608 0.0292 / 0.0264, x 6144 0.0338 / 0.0320, x 9216 0.0510 /
// 0.0464, x 14336 0.0766 / 0.0658, x 18432 0.1321 / 0.0851, x 24576 0.1547 / 0.1115; 16384 x 9216 0.1761 /
// 0.1535, x 20480 0.5112 / 0.3380; 256 x 6144 0.0095 / 0.0072, x 24576 0.0188 / 0.0130; RMSNorm 4096 x 24576
// 0.1392 / 0.1054; level (within 1%) at the powers of two' neighbours 3584 and 7168 and at 16384 rows of
// N <= 3584; 256 x 1536 / x 2560 0.0051 / 0.0052, 0.0056 / 0.0058. On by default; FW_NORM_ROW1_TIGHT=0
// turns it off at start. Returns the previous setting (tests, fastweight_bench --row1-tight=off|on).
bool set_rownorm_fwd_row1_tight(bool on);
bool rownorm_fwd_row1_tight();
// fp32 parameters (16-byte aligned rows) beside 16-bit rows in the one-row kernel's vector instances, loaded as
// 16-byte halves of a vector, half a vector ahead of the output (the kernel's F32P): every 4- and 8-vector rule
// above that takes raw parameters then takes these too, where they now go to the bulk kernel past 256 vectors;
// the planner's 1- and 2-vector shapes load them so instead of one element at a time (load_params_vec).
// ptxas (sm_90a, bf16): 8 x 512 / 8 x 256 x packed 64 registers with 20 B spilled (4 B with bf16 parameters;
// whole vectors ahead: 108 B; all after the sums: 1040 B); 4 x 256 capped 63, no spill; 4 x 128 79 (62).
// Session 41 (H200, LayerNorm bf16 with fp32 parameters, ms, off / on): 512 rows x 2048 0.0079 / 0.0060, x 5120
// 0.0109 / 0.0086, x 12288 0.0198 / 0.0148, x 32768 0.0607 / 0.0317; 4096 rows x 2048 0.0275 / 0.0168, x 4096
// 0.0481 / 0.0264, x 24576 0.3132 / 0.1473, x 32768 0.4069 / 0.1872; but at 4096 rows x 5120 0.0300 / 0.0339, x
// 8192 level, x 12288 0.0659 / 0.0677, x 16384 0.0850 / 0.0859, so rows of 513..2048 vectors from 8 rows per SM
// keep the bulk kernel (rownorm_plan). On by default; FW_NORM_ROW1_F32PAR=0 turns it off at start. Returns the
// previous setting (tests, fastweight_bench --row1-f32par=off|on with --params=f32).
bool set_rownorm_fwd_row1_f32par(bool on);
bool rownorm_fwd_row1_f32par();
// Aligned 16-bit rows past the one-row kernel's reach (N > 32768: 4096 vectors) with raw or fp32-vector parameters
// (as above), on Hopper: the one-row kernel in clusters of C CTAs per row (8 vectors per thread, x packed, 64
// registers, no spill with IO-dtype parameters, 24 B with fp32 ones; ptxas, sm_90a, bf16), each its share of the
// columns, the row's (sum, M2) merged through the peers' shared memory (rownorm_fwd_row1_kernel's CL); rows up to 8
// CTAs' reach (N <= 262144), which took the streaming kernel (each row re-read from L2). Mode 2 (the default): C =
// ceil(N / 16384) <= 8, CTAs of up to 256 threads, 4 per SM (rows past 131072 as mode 1); mode 1: C = ceil(N /
// 32768), up to 512 threads, 2 per SM; 0: off. Session 42 (H200, LayerNorm bf16 unless said, ms, off / mode 1 / mode
// 2, with an end-of-kernel cluster barrier since dropped: 2-6% more): 512 x 65536 0.0763 / 0.0538 / 0.0535, 512 x
// 131072 0.1759 / 0.1034 / 0.0991, 512 x 262144 0.3405 / 0.2104 / 0.2103, 4096 x 65536 0.5658 / 0.3654 / 0.3616, 2048
// x 49152 0.1991 / 0.1485 / 0.1366, 512 x 98312 0.1304 / 0.0900 / 0.0833, 128 x 40960 0.0222 / 0.0137 / 0.0148, RMSNorm
// 512 x 65536 0.0633 / 0.0492 / 0.0494, fp32 parameters 512 x 65536 0.1159 / 0.0649 / 0.0638, fp16 1024 x 65536 0.1436
// / 0.0962 / 0.0958. FW_NORM_FWD_CLUSTER=0|1|2 sets the mode at start. Returns the previous mode (tests,
// fastweight_bench --fwd-cluster=off|on|small).
int set_rownorm_fwd_cluster(int mode);
int rownorm_fwd_cluster_mode();
// The same for aligned fp32 rows past 4096 vectors (N > 16384, where the unstaged bulk kernel stops; mode 2's CTAs
// of <= 256 threads up to N = 65536, then mode 1's up to 131072), with fp32 parameters (aligned) or none; else
// those rows take the streaming kernel. On by default (session 43, H200, LayerNorm fp32, ms, streaming / cluster:
// 512 x 32768 0.0727 / 0.0518, 4096 x 32768 0.5292 / 0.3410, 4096 x 20000 0.2946 / 0.2411; RMSNorm 512 x 65536
// 0.1256 / 0.0893). FW_NORM_FWD_CLUSTER_F32=0 turns it off at start. Returns the previous setting (tests,
// fastweight_bench --fwd-cluster-f32=off|on).
bool set_rownorm_fwd_cluster_f32(bool on);
bool rownorm_fwd_cluster_f32();
// Tests and benchmarks only: force the one-row-per-CTA forward's shape on every aligned 16-bit row it
// can take: tpr threads (a multiple of 32, 32..1024; the planner's too on Hopper, set_rownorm_fwd_row1_tight),
// vb-byte vectors (8 or 16; vectors per thread follow: 1, 2, 4 or 8), late = parameters loaded after the sums,
// plain = x and the parameters through
// ld.global instead of ld.global.nc (only with 16-byte vectors, late, up to 256 threads). tpr 0: the
// planner's choice. Returns the previous setting.
struct Row1Config { int tpr = 0, vb = 16; bool late = false, plain = false; };
Row1Config force_rownorm_fwd_row1_config(Row1Config c);
Row1Config rownorm_fwd_row1_config();

// Current-device guard and device queries (src/cuda/common/device.cu).
bool cuda_runtime_available();
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
 private:
  int prev_ = -1;
};

}  // namespace fastweight::detail
