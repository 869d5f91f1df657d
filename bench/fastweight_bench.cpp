// fastweight_bench: verify and time every op of the library (the README's main job).
//
//   fastweight_bench                         the main suite: every op, BENCHMARKS.md shapes
//   fastweight_bench --op=layernorm_bwd --dtype=bf16 --rows=4096 --n=8192 [--reps=50]
//   fastweight_bench --quick --csv=out.csv   fewer shapes; also write CSV
//   fastweight_bench --cpu                   force the CPU reference (default when no GPU)
//   fastweight_bench --no-bulk               norm forward without the Hopper bulk-copy kernel (A/B)
//   fastweight_bench --no-dprime             DeltaNet forward with X in fp32 between its kernels (A/B)
//   fastweight_bench --bulk-vecs=4|8         the bulk forward's vectors per thread where it fits (A/B)
//   fastweight_bench --bulk-long=off|on|all  the bulk forward for rows past its reach (unstaged parameters;
//                                            on: the planner's rule, the default; all: every such row; A/B)
//   fastweight_bench --bulk-long-wide=on     those rows in 1024-thread CTAs of 4 vectors per thread (A/B)
//   fastweight_bench --bulk-hoist=off|auto|on  the unstaged bulk forward's parameter loads issued at once per row
//                                            (auto: long rows below 8 rows per SM, the default; on: every row; A/B)
//   fastweight_bench --bulk-unstaged=on      the bulk forward's unstaged form for rows within its reach too (A/B)
//   fastweight_bench --no-row1               norm forward without the one-row-per-CTA kernel (A/B)
//   fastweight_bench --params=f32|io         norm weight / bias in fp32 beside 16-bit rows (default io: the rows' dtype)
//   fastweight_bench --row1-vecs=1|2         its vectors per thread (A/B)
//   fastweight_bench --row1-capped=off|auto|on  the one-row forward's register-capped instances (auto: 4 x 256, 4 x 512)
//   fastweight_bench --row1-tight=off|on     one-row CTAs of whole warps, not powers of two, and the 4 x 129..192 / 8 x 129..448 rules (on: the default)
//   fastweight_bench --row1-f32par=off|on    its 4- and 8-vector instances for fp32 parameters too (with --params=f32)
//   fastweight_bench --bwd-ring3=off|on      norm backward's ring kernel at 3 vectors per thread where that idles fewer threads
//   fastweight_bench --bwd-ring-tight=off|on|idle  its row groups of any multiple of 32 threads where a CTA then holds
//                                            more (idle, the default: also as many, with fewer idle vector slots)
//   fastweight_bench --bwd-ring-rms=off|on   RMSNorm rows in the rings' RMSNorm instances (no mean, no bias; on: the default)
//   fastweight_bench --bwd-ring-sreg=off|auto|on  the plain ring's scale in registers (on: wherever exactly the IO dtype; auto: the default)
//   fastweight_bench --bwd-ring-prod=off|on  the plain ring fed by a producer warp (bulk copies; off: the default)
//   fastweight_bench --bwd-general=on        every norm backward on rowsum + coltile (the general path; off: the default)
//   fastweight_bench --bwd-ring-wstat=off|on the backward's row statistics copied once per warp (on: the default)
//   fastweight_bench --bwd-ring-stages=auto|2|3  its row slots per row group (auto: 3 at one row group per CTA; 3 where it fits)
//   fastweight_bench --bwd-cluster=off|on    norm backward's ring kernel in clusters for rows past its reach (else rowsum + coltile)
//   fastweight_bench --fwd-cluster=off|on|small  norm forward's one-row kernel in clusters for 16-bit rows past 32768
//                                            (small: 256-thread ranks; else the streaming kernel)
//   fastweight_bench --fwd-cluster-f32=off|on  the cluster forward for fp32 rows past 16384 too
//   fastweight_bench --bwd-cluster-mult=M    M times the backward cluster ring's CTAs per cluster (rows within its reach too; 0: the rule)
//   fastweight_bench --row1-long=off         rows of N 28680..32768 not in its capped 8 x 512 instance (on: the default)
//   fastweight_bench --row1-prefetch=off|auto|on  its 4- and 8-vector instances' parameters one vector ahead (auto: 4)
//   fastweight_bench --row1-rawx=off|auto|on  its capped instances with x packed (auto, the default: 8 vectors at 2x CTAs; on: +4)
//   fastweight_bench --row1-cfg=TPR:VB:LATE[:PLAIN]  force its shape on every aligned 16-bit row it can
//                                            take: threads per row, vector bytes (8|16), parameters after the
//                                            sums (0|1), ld.global instead of ld.global.nc (0|1)
//   fastweight_bench --dn-no-db2             DeltaNet backward serial kernel with q / Xw single-buffered (A/B)
//   fastweight_bench --dn-wy-vbufs=1|2       DeltaNet wy kernel's v tile buffers (A/B)
//   fastweight_bench --dn-state-tile=32|64   DeltaNet forward state kernel's V tile columns (A/B)
//   fastweight_bench --dn-bwd-overlap=on|off DeltaNet backward: the recompute's state kernel beside prep +
//                                            serial on a second stream, or after them (A/B; default: planner)
//   fastweight_bench --dn-fixed-k=off        DeltaNet serial kernels for a runtime K only (A/B)
//   fastweight_bench --dn-step-kernel=off    DeltaNet decoding step by the forward over T = 1 (A/B)
//   fastweight_bench --dn-step-early=on      DeltaNet decoding step: every load issued before any use (A/B)
//   fastweight_bench --dn-step-pdl=off|on|all DeltaNet decoding step: a programmatic dependent launch (on: grids of
//                                            at most one CTA per SM, the default; all: always; A/B)
//   fastweight_bench --mlstm-step-fuse=off   mLSTM decoding step out of place in two launches, as in place (A/B)
//   fastweight_bench --mlstm-step-pdl=off    mLSTM decoding step in place: its n, m kernel a programmatic dependent launch or not (A/B)
//   fastweight_bench --mlstm-step-lean=N     mLSTM decoding step: the row-block kernel's short per-row path, mode N (A/B)
//   fastweight_bench --mlstm-step-pdl-c=off  mLSTM decoding step: its C pass a programmatic dependent launch or not (A/B)
//   fastweight_bench --dn-two-sync=off       DeltaNet serial kernels with three barriers per chunk step (A/B)
//   fastweight_bench --dn-x-bf16=off         DeltaNet backward (bf16 operands) with X, Y in fp32 (A/B)
//   fastweight_bench --dn-xu-bf16=off        DeltaNet (bf16 operands) with Xu in fp32 (A/B)
//   fastweight_bench --dn-state-ws=off       DeltaNet forward state kernel without its producer warp (A/B)
//   fastweight_bench --dn-recompute-ws=0|1|2 DeltaNet backward's recompute on the warp-specialised state kernel:
//                                            never, where it is alone on the GPU (default), always (A/B)
//   fastweight_bench --dn-state-ws-warps=1|2 its producer warps (A/B)
//   fastweight_bench --dn-bwd-ws=on|off      DeltaNet backward serial kernel with its producer warpgroup (A/B; default off)
//   fastweight_bench --dn-bwd-wy-side=off    DeltaNet backward's recompute wy kernel before the fork, not beside prep (A/B)
//   fastweight_bench --dn-chunk-kfast=off    DeltaNet backward chunk pass's K tiles a grid apart (A/B)
//   fastweight_bench --dn-out-vfast=off      DeltaNet forward output kernel's V tiles a grid apart (A/B)
//   fastweight_bench --dn-out-stage=off      DeltaNet forward output kernel stores o directly (default: staged, 16-byte)
//   fastweight_bench --dn-state-dstage=on|off  DeltaNet state kernel's D' / X rows through shared memory, 16-byte
//                                            stores: always, or never (default: where its CTAs fill the GPU)
//   fastweight_bench --dn-wy-t2v4=on         DeltaNet wy kernel's fp32 T2 rows (hi + lo) as 16-byte stores (A/B)
//   fastweight_bench --dn-chunk-l2=off|pair  DeltaNet backward's L2-norm backward in its own kernel, or fused also
//                                            where K is two tiles (a cluster of 2), not only one (A/B)
//   fastweight_bench --dn-post-pf=on         DeltaNet backward post kernel's V tiles loaded at its start (A/B)
//   fastweight_bench --dn-serial-rs=off|2|4|5  DeltaNet backward serial kernel with dS in registers off, or
//                                            with 2 / 4 chain warps per CTA, or (5) its wgmma form (A/B; default
//                                            on, the planner's count)
//   fastweight_bench --dn-rs-storer=on       that kernel's stores by a storer warp (A/B)
//   fastweight_bench --dn-rs-t1=on           its wgmma form with one transposition tile, 3-4 buffers (A/B)
//   fastweight_bench --dn-rs-qraw=off        the serial kernel reads prep's Q^ (default on: it reads q, scales dO^T by s rq)
//   fastweight_bench --dn-rs-lfast=on        its wgmma form's loaders copy whole chunks by an unrolled loop (A/B)
//   fastweight_bench --dn-rs-x1first=off     its wgmma form loads dO^T, dD0 before issuing X1 = dSe^T K^T (A/B; default first)
//   fastweight_bench --dn-rs-slean=off       its dSe / dD row stores predicated (A/B; default: a fixed byte step, unpredicated)
//   fastweight_bench --dn-rs-defer=off       its stores at each step's end, not during the next step's X1 (A/B; default on)
//   fastweight_bench --dn-rs-probe=MASK      with defer and --timing-only: parts of its step left out (wrong results)
//   fastweight_bench --dn-rs-wide=off        each warp its own row pieces, not the CTA's tile pair as 128-byte rows (A/B)
//   fastweight_bench --dn-rs-tma=on|off      with wide: the tile pair (swizzled) by two tensor-map stores a step (A/B;
//                                            default: planner)
//   fastweight_bench --dn-prep-stage=off     the backward's prep stores dD0 directly (default: staged in shared memory)
//   fastweight_bench --dn-post-stage=off     its post kernel stores -Y and dv directly (default: staged)
//   fastweight_bench --dn-chunk-stage=off    its chunk pass stores the bf16 dq^, dk^ rows directly (default: staged)
//   fastweight_bench --dn-wy-stage=off       the wy kernel stores Xw, Xu directly (forward too; default: staged)
//   fastweight_bench --dn-wy-saved=off       DeltaNet backward forms the WY inverse again (no wy_inverse; A/B)
//   fastweight_bench --steps-only            the mLSTM / DeltaNet families' GPU decoding-step rows alone (A/B)
//   fastweight_bench --step-batch=N          the mLSTM step rows: N steps back to back per timed graph (default 1)
//   fastweight_bench --mlstm-step-kernel=N   mLSTM decoding step's C pass kernel (A/B; set_mlstm_step_kernel)
//   fastweight_bench --step-tile-major=off   the decoding steps' grids heads-fastest (A/B; set_step_tile_major)
//   fastweight_bench --step-vec-stores=off   the decoding steps' fp32 state rows as 4-byte stores (A/B; default 16-byte)
//   fastweight_bench --mlstm-bulk-store=off  mLSTM serial kernels' state stores element by element, not by the
//                                            TMA engine (A/B)
//   fastweight_bench --mlstm-chunk-units=off mLSTM serial kernels' chunk tiles by the generic loader (A/B)
//   fastweight_bench --mlstm-slab-overlap=on|off mLSTM backward's DV slabs on two streams or one (A/B;
//                                            default: planner)
//   fastweight_bench --mlstm-k3-fixed=off    mLSTM backward's K3 roles for runtime head dims only (A/B)
//   fastweight_bench --mlstm-dv-lo=on        mLSTM backward's dv state product with dC's lo part too (A/B)
//   fastweight_bench --mlstm-decay-chain=off mLSTM backward's chunk-decay gradients by K2's partials R_k, not K4's chain (A/B)
//   fastweight_bench --mlstm-k3-full=off     mLSTM backward's K3 roles without the full-chunk instances (A/B)
//   fastweight_bench --mlstm-dv-parts=off    mLSTM backward's K3 roles on 128 DV columns, 128-wide slabs (A/B)
//   fastweight_bench --mlstm-dv-wide=off     mLSTM backward's K3 parts: two at DQK <= 128, none above (A/B)
//   fastweight_bench --mlstm-out-tiles=1|2   mLSTM forward's output kernel: 64-column DV tiles per CTA (A/B)
//   fastweight_bench --mlstm-shapes=BxNHxSxDQKxDV[+...]  mLSTM GPU rows timed at these shapes (verified
//                                            at the default small shape, as without it)
//   fastweight_bench --timing-only           DeltaNet GPU rows and norm rows timed without their float64 check
//                                            (A/B runs after CTest; the error column reads nan)
//   fastweight_bench --op=mlstm              only the mLSTM rows (bench_mlstm.cpp: every public
//                                            mLSTM op on CPU tensors; with a GPU also mlstm_fwd and
//                                            mlstm_bwd on CUDA tensors)
//   fastweight_bench --op=norms              only the LayerNorm-family rows of the main suite
//   fastweight_bench --op=deltanet           only the DeltaNet rows (bench_deltanet.cpp), likewise
//                                            (on CUDA: deltanet_fwd, fixed length and varlen)
//
// Per row: the op's relative Frobenius error against the float64 CPU reference (on the same N and
// min(rows, 2^24 / N) rows, fresh random inputs), then its time. GPU timing (K): the op captured
// in a CUDA graph, L2 flushed (a 2x-L2 memset) before every replay, CUDA events around the replay
// only, median of --reps. GB/s uses the seed convention: fwd 2|x| bytes, bwd 3|x| bytes; "%copy"
// is that over the device-to-device copy bandwidth measured in the same run. CPU timing: the
// reference itself (wall clock, median), so the table always prints.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "bench_ops.h"
#include "bench_util.h"
#include "common/half.h"
#include "fastweight/fastweight.h"
#if FW_WITH_CUDA
#include <cuda_runtime.h>

#include "cuda/common/step_grid.h"
#include "cuda/deltanet/deltanet_cuda.h"
#include "cuda/mlstm/mlstm_cuda.h"
#include "cuda/norm/norm_cuda.h"
#endif

namespace {
using namespace fastweight;
using fwbench::median;
#if FW_WITH_CUDA
using fwbench::GpuTimer;
#endif

struct Options {
  std::string op;  // empty: the suite
  DType dtype = DType::bf16;
  std::int64_t rows = 4096, n = 8192;
  int reps = 30;
  bool steps_only = false;
  int step_batch = 1;
  bool dn_three_sync = false;
  bool dn_no_state_ws = false;
  int dn_recompute_ws = -1;  // -1: the library's default
  int dn_state_ws_warps = 0;
  int dn_bwd_ws = -1;  // -1: the library's default
  bool dn_no_wy_saved = false, dn_no_wy_side = false, dn_no_kfast = false;
  bool dn_no_vfast = false, dn_post_pf = false, dn_wy_t2v4 = false;
  int dn_out_stage = -1, dn_state_dstage = -1;  // -1: the default
  int dn_chunk_l2 = -1;  // -1: the library's default
  int dn_serial_rs = -1;  // -1: the library's default
  int dn_rs_storer = -1;
  int dn_rs_t1 = -1, dn_rs_qraw = -1, dn_rs_lfast = -1, dn_rs_x1first = -1, dn_rs_slean = -1, dn_rs_defer = -1, dn_rs_probe = 0, dn_rs_wide = -1, dn_rs_tma = -1;
  int dn_prep_stage = -1, dn_post_stage = -1, dn_chunk_stage = -1, dn_wy_stage = -1;
  bool dn_x_f32 = false;
  bool dn_xu_f32 = false;
  bool mlstm_step_no_fuse = false;
  int mlstm_step_pdl = -1;  // -1: the default
  int mlstm_step_lean = -1;  // -1: the default
  int mlstm_step_pdl_c = -1;  // -1: the default
  bool quick = false, timing_only = false, cpu = false, no_bulk = false, no_dprime = false, no_row1 = false;
  int bulk_vecs = 0;  // 0: the planner's choice
  int bulk_long = -1;  // -1: the default
  bool bulk_unstaged = false;
  int bulk_long_wide = -1;  // -1: the default
  int bulk_hoist = -1;      // -1: the default
  int row1_vecs = 0;      // 0: the planner's choice
  int row1_capped = -1;   // -1: the default
  int row1_long = -1;     // -1: the default
  int row1_tight = -1;    // -1: the default
  int row1_f32par = -1;   // -1: the default
  int bwd_ring3 = -1;     // -1: the default
  int bwd_ring_tight = -1;   // -1: the default
  int bwd_ring_stages = -1;  // -1: the default
  int bwd_ring_rms = -1;     // -1: the default
  int bwd_ring_sreg = -1;    // -1: the default
  int bwd_ring_wstat = -1;   // -1: the default
  int bwd_ring_prod = -1;    // -1: the default
  int bwd_general = -1;      // -1: the default (off)
  int bwd_cluster = -1;   // -1: the default
  int fwd_cluster = -1;   // -1: the default; 0 off, 1 on, 2 small
  int bwd_cluster_mult = -1;  // -1: the default
  int fwd_cluster_f32 = -1;   // -1: the default
  int row1_prefetch = -1; // -1: the default
  int row1_rawx = -1;     // -1: the default
  fastweight::detail::Row1Config row1_cfg;  // tpr 0: the planner's choice
  bool dn_no_db2 = false;
  int dn_wy_vbufs = 0;    // 0: the planner's choice
  int dn_state_tile = 0;  // 0: the planner's choice
  int dn_bwd_overlap = 0;  // 0: the planner's choice, 1 on, -1 off
  bool mlstm_no_bulk_store = false, mlstm_no_chunk_units = false, mlstm_no_k3_fixed = false;
  int mlstm_out_tiles = 0;
  bool mlstm_dv_lo = false;
  int mlstm_decay_chain = -1;
  bool mlstm_no_k3_full = false;
  bool mlstm_no_dv_parts = false;
  bool mlstm_no_dv_wide = false;
  bool dn_no_fixed_k = false;
  bool dn_no_step_kernel = false;
  int dn_step_early = -1;  // -1: the default
  int dn_step_pdl = -1;    // -1: the default
  int mlstm_step_kernel = -1;  // -1: the default
  bool step_heads_major = false;
  int step_vec_stores = -1;
  int mlstm_slab_overlap = 0;  // 0: the planner's choice, 1 on, -1 off
  std::string mlstm_shapes;
  std::string csv;
};

[[noreturn]] void usage(int code) {
  std::printf(
      "usage: fastweight_bench [--op=NAME --dtype=bf16|f16|f32 --rows=M --n=N] [--reps=R] [--quick]\n"
      "                        [--cpu] [--csv=FILE] [--no-bulk] [--no-dprime] [--bulk-vecs=4|8]\n"
      "ops: layernorm_fwd layernorm_bwd rmsnorm_fwd rmsnorm_bwd headnorm_fwd headnorm_bwd\n"
      "     adalayernorm_fwd adalayernorm_bwd   (headnorm: rows = B*S*NH with NH = 16; adaLN: B = 4)\n"
      "     norms (the family's suite only), mlstm, deltanet\n");
  std::exit(code);
}

DType parse_dtype(const std::string& s) {
  if (s == "bf16" || s == "bfloat16") return DType::bf16;
  if (s == "f16" || s == "fp16" || s == "float16") return DType::f16;
  if (s == "f32" || s == "fp32" || s == "float32") return DType::f32;
  std::fprintf(stderr, "unknown dtype %s\n", s.c_str());
  usage(2);
}

// A buffer on the device (or the host for --cpu) with a host staging copy.
struct Buf {
  DType dt;
  std::vector<std::int64_t> shape;
  std::vector<unsigned char> host;
  void* dev = nullptr;
  bool on_gpu = false;
  Buf(DType d, std::vector<std::int64_t> s, bool gpu) : dt(d), shape(std::move(s)), on_gpu(gpu) {
    std::int64_t n = 1;
    for (auto v : shape) n *= v;
    host.assign(std::size_t(n) * dtype_size(dt), 0);
#if FW_WITH_CUDA
    if (gpu && !host.empty() && cudaMalloc(&dev, host.size()) != cudaSuccess) throw Error("cudaMalloc failed");
#endif
  }
  ~Buf() {
#if FW_WITH_CUDA
    if (dev) cudaFree(dev);
#endif
  }
  std::int64_t numel() const { return std::int64_t(host.size() / dtype_size(dt)); }
  void fill(std::uint64_t seed, double lo, double hi) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<double> u(lo, hi);
    for (std::int64_t i = 0; i < numel(); ++i) detail::store_from_double(host.data(), i, dt, u(rng));
    upload();
  }
  void upload() {
#if FW_WITH_CUDA
    if (on_gpu) {  // then wait: a pageable upload's DMA may land after the call returns
      cudaMemcpy(dev, host.data(), host.size(), cudaMemcpyHostToDevice);
      cudaDeviceSynchronize();
    }
#endif
  }
  void download() {
#if FW_WITH_CUDA
    if (on_gpu) cudaMemcpy(host.data(), dev, host.size(), cudaMemcpyDeviceToHost);
#endif
  }
  TensorRef ref() {
    return make_tensor(on_gpu ? dev : host.data(), dt, int(shape.size()), shape.data(),
                       on_gpu ? DeviceType::cuda : DeviceType::cpu, 0);
  }
  double get(std::int64_t i) const { return detail::load_as_double(host.data(), i, dt); }
};

double rel_err(const Buf& a, const Buf& ref) {
  double num = 0, den = 0;
  for (std::int64_t i = 0; i < ref.numel(); ++i) {
    const double x = a.get(i), r = ref.get(i);
    if (!std::isfinite(x)) return INFINITY;
    num += (x - r) * (x - r);
    den += r * r;
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// --params=f32: the norm problems' weight and bias (and their gradients) in fp32 beside 16-bit rows (the
// planner's other instances: FLA's and Megatron's fp32 norm parameters with bf16 activations)
bool g_params_f32 = false;

// One norm problem: shapes of x and the parameters for an op family.
struct Shape {
  std::vector<std::int64_t> x, p;
};
Shape shape_for(const std::string& fam, std::int64_t rows, std::int64_t n) {
  if (fam == "headnorm") return {{rows / 16, 16, n}, {16, n}};
  if (fam == "adalayernorm") return {{4, rows / 4, n}, {4, 1, n}};
  return {{rows, n}, {n}};
}

// Runs op family `fam` (fwd or bwd) over buffers; all buffers on one device.
struct Problem {
  std::string fam;
  bool bwd;
  bool gpu;
  DType dt;
  Shape s;
  std::int64_t rows;
  Buf x, w, b, dy, y, mean, rstd, dx, dw, db;
  void* ws = nullptr;
  std::size_t wsb = 0;
  Problem(const std::string& f, bool bw, bool g, DType d, std::int64_t r, std::int64_t n)
      : fam(f), bwd(bw), gpu(g), dt(d), s(shape_for(f, r, n)), rows(r),
        x(d, s.x, g), w(pdt(d), s.p, g), b(pdt(d), s.p, g), dy(d, s.x, g), y(d, s.x, g), mean(DType::f32, {r}, g),
        rstd(DType::f32, {r}, g), dx(d, s.x, g), dw(pdt(d), s.p, g), db(pdt(d), s.p, g) {
    x.fill(1, -3.0, 5.0);
    w.fill(2, 0.5, 1.5);
    b.fill(3, -1.0, 1.0);
    dy.fill(4, -1.0, 1.0);
  }
  ~Problem() {
#if FW_WITH_CUDA
    if (ws) cudaFree(ws);
#endif
  }
  static DType pdt(DType d) { return g_params_f32 && d != DType::f64 ? DType::f32 : d; }  // the parameters' dtype
  bool rms() const { return fam == "rmsnorm"; }
  double offset() const { return fam == "headnorm" ? 1.0 : 0.0; }
  void fwd(Stream st) {
    const double eps = 1e-5;
    if (fam == "layernorm") layernorm_fwd({x.ref(), w.ref(), b.ref(), y.ref(), mean.ref(), rstd.ref(), eps}, st);
    else if (fam == "rmsnorm") rmsnorm_fwd({x.ref(), w.ref(), y.ref(), rstd.ref(), eps}, st);
    else if (fam == "headnorm") headnorm_fwd({x.ref(), w.ref(), b.ref(), y.ref(), mean.ref(), rstd.ref(), eps, 1.0}, st);
    else adalayernorm_fwd({x.ref(), w.ref(), b.ref(), y.ref(), mean.ref(), rstd.ref(), eps}, st);
  }
  void prepare_bwd() {
    std::size_t need = 0;
    if (fam == "layernorm") need = layernorm_bwd_workspace_size({dy.ref(), x.ref(), w.ref(), mean.ref(), rstd.ref(), dx.ref(), dw.ref(), db.ref()});
    else if (fam == "rmsnorm") need = rmsnorm_bwd_workspace_size({dy.ref(), x.ref(), w.ref(), rstd.ref(), dx.ref(), dw.ref()});
    else if (fam == "headnorm") need = headnorm_bwd_workspace_size({dy.ref(), x.ref(), w.ref(), mean.ref(), rstd.ref(), dx.ref(), dw.ref(), db.ref(), 1.0});
    else need = adalayernorm_bwd_workspace_size({dy.ref(), x.ref(), w.ref(), mean.ref(), rstd.ref(), dx.ref(), dw.ref(), db.ref()});
#if FW_WITH_CUDA
    if (need > wsb) {
      if (ws) cudaFree(ws);
      if (cudaMalloc(&ws, need) != cudaSuccess) throw Error("cudaMalloc(workspace) failed");
      wsb = need;
    }
#endif
  }
  void bwd_run(Stream st) {
    if (fam == "layernorm") layernorm_bwd({dy.ref(), x.ref(), w.ref(), mean.ref(), rstd.ref(), dx.ref(), dw.ref(), db.ref()}, ws, wsb, st);
    else if (fam == "rmsnorm") rmsnorm_bwd({dy.ref(), x.ref(), w.ref(), rstd.ref(), dx.ref(), dw.ref()}, ws, wsb, st);
    else if (fam == "headnorm") headnorm_bwd({dy.ref(), x.ref(), w.ref(), mean.ref(), rstd.ref(), dx.ref(), dw.ref(), db.ref(), 1.0}, ws, wsb, st);
    else adalayernorm_bwd({dy.ref(), x.ref(), w.ref(), mean.ref(), rstd.ref(), dx.ref(), dw.ref(), db.ref()}, ws, wsb, st);
  }
  void run(Stream st) { bwd ? bwd_run(st) : fwd(st); }
  double bytes() const { return double(x.host.size()) * (bwd ? 3.0 : 2.0); }
};

// Error of the op on the device against the float64 CPU reference on the same inputs.
double verify(const std::string& fam, bool bwd, DType dt, std::int64_t rows, std::int64_t n, bool gpu) {
  Problem dev(fam, bwd, gpu, dt, rows, n);
  Problem ref(fam, bwd, false, DType::f64, rows, n);
  // the reference sees exactly the device's (rounded) inputs
  for (auto [d, r] : {std::pair{&dev.x, &ref.x}, {&dev.w, &ref.w}, {&dev.b, &ref.b}, {&dev.dy, &ref.dy}})
    for (std::int64_t i = 0; i < d->numel(); ++i) detail::store_from_double(r->host.data(), i, DType::f64, d->get(i));
  dev.fwd(nullptr);
  ref.fwd(nullptr);
  if (!bwd) {
#if FW_WITH_CUDA
    if (gpu) cudaDeviceSynchronize();
#endif
    dev.y.download();
    return rel_err(dev.y, ref.y);
  }
  dev.prepare_bwd();
  dev.bwd_run(nullptr);
  ref.bwd_run(nullptr);
#if FW_WITH_CUDA
  if (gpu) cudaDeviceSynchronize();
#endif
  dev.dx.download();
  dev.dw.download();
  dev.db.download();
  double e = std::max(rel_err(dev.dx, ref.dx), rel_err(dev.dw, ref.dw));
  if (!dev.rms()) e = std::max(e, rel_err(dev.db, ref.db));
  return e;
}

double cpu_time_ms(Problem& p, int reps) {
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    p.run(nullptr);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  return median(ms);
}

struct Row {
  std::string op, dtype, shape;
  double err, ms, gbps, pct;
};

}  // namespace

int main(int argc, char** argv) {
  Options o;
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // progress lines survive a timeout or a crash
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto val = [&](const char* k) -> const char* {
      const std::size_t l = std::strlen(k);
      return a.compare(0, l, k) == 0 ? argv[i] + l : nullptr;
    };
    auto on = [](const char* v) {  // an A/B switch's value: on or off, else the usage
      if (std::strcmp(v, "on") != 0 && std::strcmp(v, "off") != 0) usage(2);
      return std::strcmp(v, "on") == 0;
    };
    if (a == "--help" || a == "-h") usage(0);
    else if (const char* v = val("--op=")) o.op = v;
    else if (const char* v = val("--dtype=")) o.dtype = parse_dtype(v);
    else if (const char* v = val("--rows=")) o.rows = std::atoll(v);
    else if (const char* v = val("--n=")) o.n = std::atoll(v);
    else if (const char* v = val("--reps=")) o.reps = std::atoi(v);
    else if (const char* v = val("--csv=")) o.csv = v;
    else if (a == "--quick") o.quick = true;
    else if (a == "--timing-only") o.timing_only = true;
    else if (a == "--steps-only") o.steps_only = true;
    else if (const char* v = val("--step-batch=")) o.step_batch = std::max(1, std::atoi(v));
    else if (const char* v = val("--dn-two-sync=")) o.dn_three_sync = !on(v);
    else if (const char* v = val("--dn-state-ws=")) o.dn_no_state_ws = !on(v);
    else if (const char* v = val("--dn-recompute-ws=")) o.dn_recompute_ws = std::atoi(v);
    else if (const char* v = val("--dn-state-ws-warps=")) o.dn_state_ws_warps = std::atoi(v);
    else if (const char* v = val("--dn-wy-saved=")) o.dn_no_wy_saved = !on(v);
    else if (const char* v = val("--dn-bwd-ws=")) o.dn_bwd_ws = on(v) ? 1 : 0;
    else if (const char* v = val("--dn-chunk-l2=")) o.dn_chunk_l2 = std::string(v) == "pair" ? 2 : on(v) ? 1 : 0;
    else if (const char* v = val("--dn-post-pf=")) o.dn_post_pf = on(v);
    else if (const char* v = val("--dn-serial-rs=")) o.dn_serial_rs = std::atoi(v) ? std::atoi(v) : on(v) ? 1 : 0;
    else if (const char* v = val("--dn-rs-storer=")) o.dn_rs_storer = on(v) ? 1 : 0;
    else if (const char* v = val("--dn-rs-t1=")) o.dn_rs_t1 = on(v) ? 1 : 0;
    else if (const char* v = val("--dn-rs-qraw=")) o.dn_rs_qraw = on(v) ? 1 : 0;
    else if (const char* v = val("--dn-rs-lfast=")) o.dn_rs_lfast = on(v) ? 1 : 0;
    else if (const char* v = val("--dn-rs-x1first=")) o.dn_rs_x1first = on(v) ? 1 : 0;
    else if (const char* v = val("--dn-rs-slean=")) o.dn_rs_slean = on(v) ? 1 : 0;
    else if (const char* v = val("--dn-rs-defer=")) o.dn_rs_defer = on(v) ? 1 : 0;
    else if (const char* v = val("--dn-rs-probe=")) o.dn_rs_probe = std::atoi(v);
    else if (const char* v = val("--dn-rs-wide=")) o.dn_rs_wide = on(v) ? 1 : 0;
    else if (const char* v = val("--dn-rs-tma=")) o.dn_rs_tma = on(v) ? 1 : 0;
    else if (const char* v = val("--dn-prep-stage=")) o.dn_prep_stage = on(v) ? 1 : 0;
    else if (const char* v = val("--dn-post-stage=")) o.dn_post_stage = on(v) ? 1 : 0;
    else if (const char* v = val("--dn-chunk-stage=")) o.dn_chunk_stage = on(v) ? 1 : 0;
    else if (const char* v = val("--dn-wy-stage=")) o.dn_wy_stage = on(v) ? 1 : 0;
    else if (const char* v = val("--dn-bwd-wy-side=")) o.dn_no_wy_side = !on(v);
    else if (const char* v = val("--dn-chunk-kfast=")) o.dn_no_kfast = !on(v);
    else if (const char* v = val("--dn-out-vfast=")) o.dn_no_vfast = !on(v);
    else if (const char* v = val("--dn-out-stage=")) o.dn_out_stage = on(v) ? 1 : 0;
    else if (const char* v = val("--dn-state-dstage=")) o.dn_state_dstage = on(v) ? 1 : 0;
    else if (const char* v = val("--dn-wy-t2v4=")) o.dn_wy_t2v4 = on(v);
    else if (const char* v = val("--dn-x-bf16=")) o.dn_x_f32 = !on(v);
    else if (const char* v = val("--dn-xu-bf16=")) o.dn_xu_f32 = !on(v);
    else if (const char* v = val("--mlstm-step-fuse=")) o.mlstm_step_no_fuse = !on(v);
    else if (const char* v = val("--mlstm-step-pdl=")) o.mlstm_step_pdl = on(v) ? 1 : 0;
    else if (const char* v = val("--mlstm-step-lean=")) o.mlstm_step_lean = std::atoi(v);
    else if (const char* v = val("--mlstm-step-pdl-c=")) o.mlstm_step_pdl_c = on(v) ? 1 : 0;
    else if (a == "--cpu") o.cpu = true;
    else if (a == "--no-bulk") o.no_bulk = true;
    else if (a == "--no-dprime") o.no_dprime = true;
    else if (const char* v = val("--bulk-vecs=")) o.bulk_vecs = std::atoi(v);
    else if (const char* v = val("--bulk-long=")) o.bulk_long = std::strcmp(v, "all") == 0 ? 2 : on(v) ? 1 : 0;
    else if (const char* v = val("--bulk-unstaged=")) o.bulk_unstaged = on(v);
    else if (const char* v = val("--bulk-long-wide=")) o.bulk_long_wide = on(v) ? 1 : 0;
    else if (const char* v = val("--bulk-hoist=")) o.bulk_hoist = std::strcmp(v, "auto") == 0 ? 1 : on(v) ? 2 : 0;
    else if (a == "--no-row1") o.no_row1 = true;
    else if (const char* v = val("--params=")) {
      if (std::strcmp(v, "f32") != 0 && std::strcmp(v, "io") != 0) usage(2);
      g_params_f32 = std::strcmp(v, "f32") == 0;
    }
    else if (const char* v = val("--row1-vecs=")) o.row1_vecs = std::atoi(v);
    else if (const char* v = val("--row1-capped=")) o.row1_capped = std::strcmp(v, "auto") == 0 ? 1 : on(v) ? 2 : 0;
    else if (const char* v = val("--row1-long=")) o.row1_long = on(v) ? 1 : 0;
    else if (const char* v = val("--row1-tight=")) o.row1_tight = on(v) ? 1 : 0;
    else if (const char* v = val("--row1-f32par=")) o.row1_f32par = on(v) ? 1 : 0;
    else if (const char* v = val("--bwd-ring3=")) o.bwd_ring3 = on(v) ? 1 : 0;
    else if (const char* v = val("--bwd-ring-tight=")) o.bwd_ring_tight = std::strcmp(v, "idle") == 0 ? 2 : on(v) ? 1 : 0;
    else if (const char* v = val("--bwd-ring-rms=")) o.bwd_ring_rms = on(v) ? 1 : 0;
    else if (const char* v = val("--bwd-ring-sreg=")) o.bwd_ring_sreg = std::strcmp(v, "auto") == 0 ? 1 : on(v) ? 2 : 0;
    else if (const char* v = val("--bwd-ring-wstat=")) o.bwd_ring_wstat = on(v) ? 1 : 0;
    else if (const char* v = val("--bwd-ring-prod=")) o.bwd_ring_prod = on(v) ? 1 : 0;
    else if (const char* v = val("--bwd-general=")) o.bwd_general = on(v) ? 1 : 0;
    else if (const char* v = val("--bwd-ring-stages=")) {
      o.bwd_ring_stages = std::strcmp(v, "auto") == 0 ? 0 : std::atoi(v);
      if (o.bwd_ring_stages != 0 && o.bwd_ring_stages != 2 && o.bwd_ring_stages != 3) usage(2);
    }
    else if (const char* v = val("--bwd-cluster=")) o.bwd_cluster = on(v) ? 1 : 0;
    else if (const char* v = val("--fwd-cluster=")) o.fwd_cluster = std::strcmp(v, "small") == 0 ? 2 : on(v) ? 1 : 0;
    else if (const char* v = val("--bwd-cluster-mult=")) o.bwd_cluster_mult = std::atoi(v);
    else if (const char* v = val("--fwd-cluster-f32=")) o.fwd_cluster_f32 = on(v) ? 1 : 0;
    else if (const char* v = val("--row1-prefetch=")) o.row1_prefetch = std::strcmp(v, "auto") == 0 ? 1 : on(v) ? 2 : 0;
    else if (const char* v = val("--row1-rawx=")) o.row1_rawx = std::strcmp(v, "auto") == 0 ? 1 : on(v) ? 2 : 0;
    else if (const char* v = val("--row1-cfg=")) {
      int late = 0, plain = 0;  // TPR:VB:LATE[:PLAIN]
      if (std::sscanf(v, "%d:%d:%d:%d", &o.row1_cfg.tpr, &o.row1_cfg.vb, &late, &plain) < 3) usage(2);
      o.row1_cfg.late = late != 0, o.row1_cfg.plain = plain != 0;
    }
    else if (a == "--dn-no-db2") o.dn_no_db2 = true;
    else if (const char* v = val("--dn-wy-vbufs=")) o.dn_wy_vbufs = std::atoi(v);
    else if (const char* v = val("--dn-state-tile=")) o.dn_state_tile = std::atoi(v);
    else if (const char* v = val("--dn-bwd-overlap=")) o.dn_bwd_overlap = on(v) ? 1 : -1;
    else if (const char* v = val("--mlstm-bulk-store=")) o.mlstm_no_bulk_store = !on(v);
    else if (const char* v = val("--mlstm-chunk-units=")) o.mlstm_no_chunk_units = !on(v);
    else if (const char* v = val("--mlstm-k3-fixed=")) o.mlstm_no_k3_fixed = !on(v);
    else if (const char* v = val("--mlstm-dv-lo=")) o.mlstm_dv_lo = on(v);
    else if (const char* v = val("--mlstm-decay-chain=")) o.mlstm_decay_chain = on(v) ? 1 : 0;
    else if (const char* v = val("--mlstm-k3-full=")) o.mlstm_no_k3_full = !on(v);
    else if (const char* v = val("--mlstm-dv-parts=")) o.mlstm_no_dv_parts = !on(v);
    else if (const char* v = val("--dn-fixed-k=")) o.dn_no_fixed_k = !on(v);
    else if (const char* v = val("--mlstm-dv-wide=")) o.mlstm_no_dv_wide = !on(v);
    else if (const char* v = val("--dn-step-kernel=")) o.dn_no_step_kernel = !on(v);
    else if (const char* v = val("--dn-step-early=")) o.dn_step_early = on(v) ? 1 : 0;
    else if (const char* v = val("--dn-step-pdl=")) o.dn_step_pdl = std::strcmp(v, "all") == 0 ? 2 : on(v) ? 1 : 0;
    else if (const char* v = val("--mlstm-step-kernel=")) o.mlstm_step_kernel = std::atoi(v);
    else if (const char* v = val("--step-tile-major=")) o.step_heads_major = !on(v);
    else if (const char* v = val("--step-vec-stores=")) o.step_vec_stores = on(v) ? 1 : 0;
    else if (const char* v = val("--mlstm-out-tiles=")) {
      o.mlstm_out_tiles = std::atoi(v);
      if (o.mlstm_out_tiles != 1 && o.mlstm_out_tiles != 2) usage(2);
    }
    else if (const char* v = val("--mlstm-shapes=")) o.mlstm_shapes = v;
    else if (const char* v = val("--mlstm-slab-overlap=")) o.mlstm_slab_overlap = on(v) ? 1 : -1;
    else { std::fprintf(stderr, "unknown argument %s\n", a.c_str()); usage(2); }
  }
  const bool gpu = !o.cpu && cuda_available();
#if FW_WITH_CUDA
  // A/B of the Hopper bulk-copy norm forward against the persistent kernel that devices without it run
  if (o.no_bulk) fastweight::detail::set_rownorm_fwd_bulk(false);
  if (o.no_dprime) fastweight::detail::set_deltanet_fwd_dprime(false);  // DeltaNet forward: X in fp32 (A/B)
  if (o.bulk_vecs) fastweight::detail::force_rownorm_fwd_bulk_vecs(o.bulk_vecs);
  if (o.bulk_long >= 0) fastweight::detail::set_rownorm_fwd_bulk_long(o.bulk_long);
  if (o.bulk_unstaged) fastweight::detail::force_rownorm_fwd_bulk_unstaged(true);
  if (o.bulk_long_wide >= 0) fastweight::detail::set_rownorm_fwd_bulk_long_wide(o.bulk_long_wide == 1);
  if (o.bulk_hoist >= 0) fastweight::detail::set_rownorm_fwd_bulk_hoist(o.bulk_hoist);
  if (o.no_row1) fastweight::detail::set_rownorm_fwd_row1(false);
  if (o.row1_vecs) fastweight::detail::force_rownorm_fwd_row1_vecs(o.row1_vecs);
  if (o.row1_capped >= 0) fastweight::detail::set_rownorm_fwd_row1_capped(o.row1_capped);
  if (o.row1_long >= 0) fastweight::detail::set_rownorm_fwd_row1_long(o.row1_long == 1);
  if (o.row1_tight >= 0) fastweight::detail::set_rownorm_fwd_row1_tight(o.row1_tight == 1);
  if (o.row1_f32par >= 0) fastweight::detail::set_rownorm_fwd_row1_f32par(o.row1_f32par == 1);
  if (o.bwd_ring3 >= 0) fastweight::detail::set_rownorm_bwd_ring3(o.bwd_ring3 == 1);
  if (o.bwd_ring_tight >= 0) fastweight::detail::set_rownorm_bwd_ring_tight(o.bwd_ring_tight);
  if (o.bwd_ring_rms >= 0) fastweight::detail::set_rownorm_bwd_ring_rms(o.bwd_ring_rms == 1);
  if (o.bwd_ring_sreg >= 0) fastweight::detail::set_rownorm_bwd_ring_sreg(o.bwd_ring_sreg);
  if (o.bwd_ring_wstat >= 0) fastweight::detail::set_rownorm_bwd_ring_wstat(o.bwd_ring_wstat == 1);
  if (o.bwd_ring_prod >= 0) fastweight::detail::set_rownorm_bwd_ring_prod(o.bwd_ring_prod);
  if (o.bwd_general >= 0) fastweight::detail::force_rownorm_bwd_general(o.bwd_general == 1);
  if (o.bwd_ring_stages >= 0) fastweight::detail::set_rownorm_bwd_ring_stages(o.bwd_ring_stages);
  if (o.bwd_cluster >= 0) fastweight::detail::set_rownorm_bwd_cluster(o.bwd_cluster == 1);
  if (o.fwd_cluster >= 0) fastweight::detail::set_rownorm_fwd_cluster(o.fwd_cluster);
  if (o.bwd_cluster_mult >= 0) fastweight::detail::set_rownorm_bwd_cluster_mult(o.bwd_cluster_mult);
  if (o.fwd_cluster_f32 >= 0) fastweight::detail::set_rownorm_fwd_cluster_f32(o.fwd_cluster_f32 == 1);
  if (o.row1_prefetch >= 0) fastweight::detail::set_rownorm_fwd_row1_prefetch(o.row1_prefetch);
  if (o.row1_rawx >= 0) fastweight::detail::set_rownorm_fwd_row1_rawx(o.row1_rawx);
  if (o.row1_cfg.tpr) fastweight::detail::force_rownorm_fwd_row1_config(o.row1_cfg);
  if (o.dn_no_db2) fastweight::detail::set_deltanet_bwd_serial_db2(false);
  if (o.dn_wy_vbufs) fastweight::detail::set_deltanet_wy_vbufs(o.dn_wy_vbufs);
  if (o.dn_state_tile) fastweight::detail::set_deltanet_state_tile(o.dn_state_tile);
  if (o.dn_bwd_overlap) fastweight::detail::set_deltanet_bwd_overlap(o.dn_bwd_overlap);
  if (o.mlstm_no_bulk_store) fastweight::detail::set_mlstm_bulk_store(false);
  if (o.mlstm_no_chunk_units) fastweight::detail::set_mlstm_chunk_units(false);
  if (o.mlstm_no_k3_fixed) fastweight::detail::set_mlstm_k3_fixed(false);
  if (o.mlstm_out_tiles) fastweight::detail::set_mlstm_out_tiles(o.mlstm_out_tiles);
  if (o.mlstm_dv_lo) fastweight::detail::set_mlstm_dv_lo(true);
  if (o.mlstm_decay_chain >= 0) fastweight::detail::set_mlstm_bwd_decay_chain(o.mlstm_decay_chain == 1);
  if (o.mlstm_no_k3_full) fastweight::detail::set_mlstm_k3_full(false);
  if (o.mlstm_no_dv_parts) fastweight::detail::set_mlstm_k3_dv_parts(false);
  if (o.mlstm_no_dv_wide) fastweight::detail::set_mlstm_k3_dv_wide(false);
  if (o.dn_no_fixed_k) fastweight::detail::set_deltanet_fixed_k(false);
  if (o.dn_no_step_kernel) fastweight::detail::set_deltanet_step_kernel(false);
  if (o.dn_step_early >= 0) fastweight::detail::set_deltanet_step_early(o.dn_step_early == 1);
  if (o.dn_step_pdl >= 0) fastweight::detail::set_deltanet_step_pdl(o.dn_step_pdl);
  if (o.mlstm_step_kernel >= 0) fastweight::detail::set_mlstm_step_kernel(o.mlstm_step_kernel);
  if (o.step_heads_major) fastweight::detail::set_step_tile_major(false);
  if (o.step_vec_stores >= 0) fastweight::detail::set_step_vector_stores(o.step_vec_stores == 1);
  if (o.dn_three_sync) fastweight::detail::set_deltanet_state_two_sync(false);
  if (o.dn_no_state_ws) fastweight::detail::set_deltanet_state_ws(false);
  if (o.dn_recompute_ws >= 0) fastweight::detail::set_deltanet_bwd_recompute_ws(o.dn_recompute_ws);
  if (o.dn_state_ws_warps) fastweight::detail::set_deltanet_state_ws_warps(o.dn_state_ws_warps);
  if (o.dn_bwd_ws >= 0) fastweight::detail::set_deltanet_bwd_serial_ws(o.dn_bwd_ws == 1);
  if (o.dn_no_wy_side) fastweight::detail::set_deltanet_bwd_wy_side(false);
  if (o.dn_no_kfast) fastweight::detail::set_deltanet_bwd_chunk_kfast(false);
  if (o.dn_no_vfast) fastweight::detail::set_deltanet_out_vfast(false);
  if (o.dn_out_stage >= 0) fastweight::detail::set_deltanet_out_stage(o.dn_out_stage == 1);
  if (o.dn_state_dstage >= 0) fastweight::detail::set_deltanet_state_dstage(o.dn_state_dstage == 1);
  if (o.dn_wy_t2v4) fastweight::detail::set_deltanet_wy_t2v4(true);
  if (o.dn_chunk_l2 >= 0) fastweight::detail::set_deltanet_bwd_chunk_l2(o.dn_chunk_l2);
  if (o.dn_post_pf) fastweight::detail::set_deltanet_bwd_post_prefetch(true);
  if (o.dn_serial_rs >= 0) fastweight::detail::set_deltanet_bwd_serial_rs(o.dn_serial_rs);
  if (o.dn_rs_storer >= 0) fastweight::detail::set_deltanet_bwd_serial_rs_storer(o.dn_rs_storer == 1);
  if (o.dn_rs_t1 >= 0) fastweight::detail::set_deltanet_bwd_serial_rs_t1(o.dn_rs_t1 == 1);
  if (o.dn_rs_qraw >= 0) fastweight::detail::set_deltanet_bwd_serial_rs_qraw(o.dn_rs_qraw == 1);
  if (o.dn_rs_lfast >= 0) fastweight::detail::set_deltanet_bwd_serial_rs_lfast(o.dn_rs_lfast == 1);
  if (o.dn_rs_x1first >= 0) fastweight::detail::set_deltanet_bwd_serial_rs_x1first(o.dn_rs_x1first == 1);
  if (o.dn_rs_slean >= 0) fastweight::detail::set_deltanet_bwd_serial_rs_slean(o.dn_rs_slean == 1);
  if (o.dn_rs_defer >= 0) fastweight::detail::set_deltanet_bwd_serial_rs_defer(o.dn_rs_defer == 1);
  if (o.dn_rs_wide >= 0) fastweight::detail::set_deltanet_bwd_serial_rs_wide(o.dn_rs_wide == 1);
  if (o.dn_rs_tma >= 0) fastweight::detail::set_deltanet_bwd_serial_rs_tma(o.dn_rs_tma);
  if (o.dn_rs_probe) {  // timing probes: the backward's results are wrong, so only with --timing-only
    fastweight::detail::set_deltanet_bwd_serial_rs_probe(o.dn_rs_probe);
    if (!o.timing_only || fastweight::detail::set_deltanet_bwd_serial_rs_probe(o.dn_rs_probe) != o.dn_rs_probe) {
      std::fprintf(stderr, "--dn-rs-probe leaves parts of a kernel out: it needs --timing-only and a mask of 1, 2, 8, 32 or 40\n");
      return 2;
    }
  }
  if (o.dn_prep_stage >= 0) fastweight::detail::set_deltanet_bwd_prep_stage(o.dn_prep_stage == 1);
  if (o.dn_post_stage >= 0) fastweight::detail::set_deltanet_bwd_post_stage(o.dn_post_stage == 1);
  if (o.dn_chunk_stage >= 0) fastweight::detail::set_deltanet_bwd_chunk_stage(o.dn_chunk_stage == 1);
  if (o.dn_wy_stage >= 0) fastweight::detail::set_deltanet_wy_stage(o.dn_wy_stage == 1);
  if (o.dn_x_f32) fastweight::detail::set_deltanet_bwd_x_bf16(false);
  if (o.dn_xu_f32) fastweight::detail::set_deltanet_xu_bf16(false);
  if (o.mlstm_step_no_fuse) fastweight::detail::set_mlstm_step_fuse_nm(false);
  if (o.mlstm_step_pdl >= 0) fastweight::detail::set_mlstm_step_pdl(o.mlstm_step_pdl == 1);
  if (o.mlstm_step_lean >= 0) fastweight::detail::set_mlstm_step_lean(o.mlstm_step_lean);
  if (o.mlstm_step_pdl_c >= 0) fastweight::detail::set_mlstm_step_pdl_c(o.mlstm_step_pdl_c == 1);
  if (o.mlstm_slab_overlap) fastweight::detail::set_mlstm_slab_overlap(o.mlstm_slab_overlap);
#endif
  std::printf("fastweight_bench: %s; running on %s\n", build_info(), gpu ? "the GPU" : "the CPU (reference)");

  struct Job { std::string fam; bool bwd; DType dt; std::int64_t rows, n; };
  std::vector<Job> jobs;
  if (!o.op.empty() && (o.op.rfind("mlstm", 0) == 0 || o.op.rfind("deltanet", 0) == 0)) {
    // mLSTM / DeltaNet ops only (below)
  } else if (!o.op.empty() && o.op != "norms") {
    const auto us = o.op.rfind('_');
    if (us == std::string::npos) usage(2);
    jobs.push_back({o.op.substr(0, us), o.op.substr(us + 1) == "bwd", o.dtype, o.rows, o.n});
  } else {
    // BENCHMARKS.md shapes (a CPU run, which times the reference, uses small ones).
    std::vector<std::pair<std::int64_t, std::int64_t>> ln;
    if (!gpu) ln = {{256, 1024}, {64, 8192}};
    else if (o.quick) ln = {{4096, 1024}, {4096, 8192}, {262144, 128}};
    else ln = {{4096, 1024}, {4096, 2048}, {4096, 4096}, {4096, 8192}, {4096, 16384}, {32768, 4096},
               {32768, 8192}, {262144, 128}, {262144, 256}, {512, 32768}, {512, 65536}};
    for (const char* fam : {"layernorm", "rmsnorm"})
      for (auto [m, n] : ln)
        for (bool bwd : {false, true}) jobs.push_back({fam, bwd, DType::bf16, m, n});
    if (gpu && !o.quick)
      for (auto [m, n] : std::vector<std::pair<std::int64_t, std::int64_t>>{{4096, 1024}, {4096, 8192}})
        for (bool bwd : {false, true}) jobs.push_back({"layernorm", bwd, DType::f16, m, n});
    // head norm: (B*S, NH=16, DH) rows of DH; adaLN (B=4, S, D)
    const std::vector<std::pair<std::int64_t, std::int64_t>> hn = gpu ? std::vector<std::pair<std::int64_t, std::int64_t>>{{2 * 8192 * 16, 128}, {8 * 8192 * 16, 256}}
                                                                        : std::vector<std::pair<std::int64_t, std::int64_t>>{{64 * 16, 128}};
    for (auto [m, n] : hn)
      for (bool bwd : {false, true}) jobs.push_back({"headnorm", bwd, DType::bf16, m, n});
    const std::vector<std::pair<std::int64_t, std::int64_t>> ad = gpu ? std::vector<std::pair<std::int64_t, std::int64_t>>{{4 * 1024, 768}, {4 * 4096, 1152}}
                                                                        : std::vector<std::pair<std::int64_t, std::int64_t>>{{4 * 64, 768}};
    for (auto [m, n] : ad)
      for (bool bwd : {false, true}) jobs.push_back({"adalayernorm", bwd, DType::f16, m, n});
  }

  double copy = 0;
#if FW_WITH_CUDA
  GpuTimer* timer = gpu ? new GpuTimer() : nullptr;
  if (gpu) {
    copy = timer->copy_gbps();
    std::printf("device-to-device copy: %.0f GB/s (read + write)\n", copy);
  }
#endif
  std::vector<Row> rows;
  int failures = 0;
  for (const Job& j : jobs) {
    const std::string op = j.fam + (j.bwd ? "_bwd" : "_fwd");
    try {
      const std::int64_t vrows = std::max<std::int64_t>(16, std::min<std::int64_t>(j.rows, (std::int64_t(1) << 24) / j.n)) / 16 * 16;
      // --timing-only: no check against the fp64 reference (A/B runs beside a CTest run of the same build:
      // the reference on the host took about half of each norm row's time)
      const bool ver = !o.timing_only;
      const double err = ver ? verify(j.fam, j.bwd, j.dt, std::min(vrows, j.rows), j.n, gpu) : std::nan("");
      const double tol = j.dt == DType::f32 ? 1e-5 : j.dt == DType::f16 ? 2e-3 : 1e-2;
      if (ver && !(err <= tol)) ++failures;
      Problem p(j.fam, j.bwd, gpu, j.dt, j.rows, j.n);
      double ms;
      if (j.bwd) { p.fwd(nullptr); p.prepare_bwd(); }
#if FW_WITH_CUDA
      if (gpu) {
        ms = timer->time_ms([&](Stream st) { p.run(st); }, o.reps);
        if (!j.bwd && jobs.size() == 1)  // one op (A/B runs): which forward kernel the planner took
          std::printf("%s: forward kernel %s\n", op.c_str(), fastweight::detail::rownorm_fwd_last_kernel());
        else if (jobs.size() == 1)  // (and the backward's)
          std::printf("%s: backward kernel %s\n", op.c_str(), fastweight::detail::rownorm_bwd_last_kernel());
      } else
#endif
        ms = cpu_time_ms(p, std::max(3, o.reps / 10));
      const double gbps = p.bytes() / (ms * 1e-3) / 1e9;
      std::string shape = "(";
      for (std::size_t d = 0; d < p.s.x.size(); ++d) shape += (d ? "," : "") + std::to_string(p.s.x[d]);
      rows.push_back({op, dtype_name(j.dt), shape + (ver ? ")" : "); not verified (--timing-only)"), err, ms, gbps,
                      copy > 0 ? 100.0 * gbps / copy : 0.0});
    } catch (const std::exception& e) {
      std::printf("%s: error: %s\n", op.c_str(), e.what());
      ++failures;
    }
  }
  std::printf("\n| op | dtype | x shape | rel err vs fp64 ref | ms | GB/s | %% of copy |\n|---|---|---|---|---|---|---|\n");
  for (const Row& r : rows)
    std::printf("| %s | %s | %s | %.2e | %.4f | %.0f | %s |\n", r.op.c_str(), r.dtype.c_str(), r.shape.c_str(), r.err,
                r.ms, r.gbps, copy > 0 ? std::to_string(int(std::lround(r.pct))).c_str() : "-");
  if (!o.csv.empty()) {
    std::ofstream f(o.csv);
    f << "op,dtype,shape,rel_err,ms,gbps,pct_copy,device\n";
    for (const Row& r : rows)
      f << r.op << ',' << r.dtype << ",\"" << r.shape << "\"," << r.err << ',' << r.ms << ',' << r.gbps << ','
        << r.pct << ',' << (gpu ? "gpu" : "cpu") << '\n';
  }
  // mLSTM (issue 3) and DeltaNet (issue 4): the public ops on CPU tensors (the reference path), and
  // with a GPU the ops dispatched to CUDA on CUDA tensors (timed as above).
  FamilyBench fb;
  fb.steps_only = o.steps_only;
  fb.step_batch = o.step_batch;
  fb.quick = o.quick, fb.timing_only = o.timing_only, fb.reps = o.reps, fb.mlstm_shapes = o.mlstm_shapes;
  fb.dn_wy_saved = !o.dn_no_wy_saved;
#if FW_WITH_CUDA
  fb.timer = timer;
#endif
  std::vector<BenchRow> mrows, drows;
  if (o.op.empty() || o.op.rfind("mlstm", 0) == 0) failures += run_mlstm_bench(fb, mrows);
  if (o.op.empty() || o.op.rfind("deltanet", 0) == 0) failures += run_deltanet_bench(fb, drows);
#if FW_WITH_CUDA
  delete timer;
#endif
  auto table = [](const char* title, const char* shape_head, const std::vector<BenchRow>& rs) {
    if (rs.empty()) return;
    std::printf("\n%s\n| op | dtype | shape %s | rel err vs fp64 ref | ms | device |\n|---|---|---|---|---|---|\n",
                title, shape_head);
    for (const BenchRow& r : rs)
      std::printf("| %s | %s | %s | %.2e | %.4f | %s |\n", r.op.c_str(), r.dtype.c_str(), r.shape.c_str(), r.err, r.ms,
                  r.device.c_str());
  };
  // device cpu: the float64 reference path on CPU tensors (wall clock); cuda: the CUDA kernels, timed as the norms
  table("mLSTM (cpu: the reference path; cuda: the CUDA kernels)", "(B,NH,S,DQK,DV)", mrows);
  table("DeltaNet (cpu: the reference path; cuda: the CUDA forward and backward)", "(B,T,H,K,V)", drows);
  mrows.insert(mrows.end(), drows.begin(), drows.end());
  if (!o.csv.empty() && !mrows.empty()) {
    std::ofstream f(o.csv, std::ios::app);
    for (const BenchRow& r : mrows)
      f << r.op << ',' << r.dtype << ",\"" << r.shape << "\"," << r.err << ',' << r.ms << ",,," << r.device << '\n';
  }
  std::printf("\n%zu ops %s, %d failed verification (bounds fp32 1e-5, fp16 2e-3, bf16 1e-2)\n",
              rows.size() + mrows.size(),
              o.timing_only ? "timed (not all verified: --timing-only)" : "verified and timed", failures);
  return failures ? 1 : 0;
}
