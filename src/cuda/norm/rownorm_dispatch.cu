// rownorm_dispatch.cu: dtype dispatch of the LayerNorm-family kernels. A dtype left out of the
// build (FW_DTYPES) is refused with a clear error instead of a missing symbol.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>

#include "cuda/common/check.cuh"
#include "cuda/norm/norm_cuda.h"

namespace fastweight::detail {

template <typename T> void rownorm_fwd_launch(const RowNormParams&, cudaStream_t);
template <typename T> std::size_t rownorm_bwd_workspace(const RowNormParams&);
template <typename T> void rownorm_bwd_launch(const RowNormParams&, void*, cudaStream_t);

namespace {
template <typename F>
auto dispatch(const char* op, DType t, F&& f) {
  switch (t) {
#if FW_HAS_F32
    case DType::f32: return f(float{});
#endif
#if FW_HAS_F16
    case DType::f16: return f(__half{});
#endif
#if FW_HAS_BF16
    case DType::bf16: return f(__nv_bfloat16{});
#endif
    default: break;
  }
  throw ArgumentError(cat(op, ": x: dtype ", dtype_name(t), " is not compiled into this CUDA build (FW_DTYPES)"));
}
}  // namespace

namespace {
std::atomic<bool> g_fwd_bulk{true};
std::atomic<int> g_fwd_bulk_long{env_digit("FW_NORM_BULK_LONG", 1)};  // (FW_NORM_BULK_LONG=0|1|2: the mode at start)
std::atomic<bool> g_fwd_bulk_long_wide{env_digit("FW_NORM_BULK_LONG_WIDE", 0) == 1};
std::atomic<bool> g_fwd_bulk_unstaged{false};
std::atomic<int> g_fwd_bulk_hoist{env_digit("FW_NORM_BULK_HOIST", 1)};  // (0|1|2: the mode at start)
std::atomic<int> g_fwd_bulk_cap{0};
std::atomic<int> g_fwd_bulk_vecs{0};
std::atomic<bool> g_fwd_row1{true};
std::atomic<int> g_fwd_row1_vecs{0};
std::atomic<int> g_fwd_row1_capped{env_digit("FW_NORM_ROW1_CAPPED", 1)};  // (0|1|2: the mode at start)
std::atomic<bool> g_fwd_row1_long{env_digit("FW_NORM_ROW1_LONG", 1) == 1};
std::atomic<int> g_fwd_row1_prefetch{env_digit("FW_NORM_ROW1_PREFETCH", 1)};  // (0|1|2: the mode at start)
std::atomic<int> g_fwd_row1_rawx{env_digit("FW_NORM_ROW1_RAWX", 1)};          // (0|1|2: the mode at start)
std::atomic<bool> g_fwd_row1_tight{env_digit("FW_NORM_ROW1_TIGHT", 1) == 1};
std::atomic<bool> g_fwd_row1_f32par{env_digit("FW_NORM_ROW1_F32PAR", 1) == 1};
std::atomic<bool> g_bwd_ring3{env_digit("FW_NORM_BWD_RING3", 1) == 1};
std::atomic<int> g_bwd_ring_tight{env_digit("FW_NORM_BWD_RING_TIGHT", 2)};  // (0|1|2: the mode at start)
std::atomic<bool> g_bwd_ring_rms{env_digit("FW_NORM_BWD_RING_RMS", 1) == 1};
std::atomic<int> g_bwd_ring_stages{env_digit("FW_NORM_BWD_RING_STAGES", 0)};  // (0: the rule; 2, 3: forced)
std::atomic<int> g_bwd_ring_sreg{env_digit("FW_NORM_BWD_RING_SREG", 1)};  // (0|1|2: the mode at start)
std::atomic<int> g_bwd_ring_prod{env_digit("FW_NORM_BWD_RING_PROD", 0)};
std::atomic<bool> g_bwd_general{false};
std::atomic<bool> g_bwd_ring_wstat{env_digit("FW_NORM_BWD_RING_WSTAT", 1) == 1};
std::atomic<bool> g_bwd_cluster{env_digit("FW_NORM_BWD_CLUSTER", 1) == 1};
std::atomic<int> g_bwd_cluster_mult{env_digit("FW_NORM_BWD_CLUSTER_MULT", 0)};  // (0: the planner's rule)
std::atomic<int> g_fwd_cluster{env_digit("FW_NORM_FWD_CLUSTER", 2)};  // (0|1|2: the mode at start)
std::atomic<bool> g_fwd_cluster_f32{env_digit("FW_NORM_FWD_CLUSTER_F32", 1) == 1};
std::atomic<int> g_fwd_row1_cfg{0};  // tpr | vb << 16 | late << 24 | plain << 25
}  // namespace
static thread_local const char* t_fwd_last_kernel = "";
const char* rownorm_fwd_last_kernel() { return t_fwd_last_kernel; }
void note_rownorm_fwd_kernel(const char* name) { t_fwd_last_kernel = name; }
static thread_local const char* t_bwd_last_kernel = "";
const char* rownorm_bwd_last_kernel() { return t_bwd_last_kernel; }
void note_rownorm_bwd_kernel(const char* name) { t_bwd_last_kernel = name; }
static thread_local bool t_bwd_last_sreg = false;
bool rownorm_bwd_last_sreg() { return t_bwd_last_sreg; }
void note_rownorm_bwd_sreg(bool on) { t_bwd_last_sreg = on; }
bool set_rownorm_bwd_ring3(bool on) { return g_bwd_ring3.exchange(on); }
bool rownorm_bwd_ring3() { return g_bwd_ring3.load(); }
int set_rownorm_bwd_ring_tight(int mode) { return g_bwd_ring_tight.exchange(mode); }
int rownorm_bwd_ring_tight() { return g_bwd_ring_tight.load(); }
int set_rownorm_bwd_ring_stages(int stages) { return g_bwd_ring_stages.exchange(stages == 2 || stages == 3 ? stages : 0); }
int rownorm_bwd_ring_stages() { return g_bwd_ring_stages.load(); }
bool set_rownorm_bwd_ring_rms(bool on) { return g_bwd_ring_rms.exchange(on); }
bool rownorm_bwd_ring_rms() { return g_bwd_ring_rms.load(); }
int set_rownorm_bwd_ring_sreg(int mode) { return g_bwd_ring_sreg.exchange(mode); }
int rownorm_bwd_ring_sreg() { return g_bwd_ring_sreg.load(); }
int set_rownorm_bwd_ring_prod(int mode) { return g_bwd_ring_prod.exchange(mode); }
int rownorm_bwd_ring_prod() { return g_bwd_ring_prod.load(); }
static thread_local bool t_bwd_last_prod = false;
bool rownorm_bwd_last_prod() { return t_bwd_last_prod; }
void note_rownorm_bwd_prod(bool on) { t_bwd_last_prod = on; }
bool force_rownorm_bwd_general(bool on) { return g_bwd_general.exchange(on); }
bool rownorm_bwd_general() { return g_bwd_general.load(); }
bool set_rownorm_bwd_ring_wstat(bool on) { return g_bwd_ring_wstat.exchange(on); }
bool rownorm_bwd_ring_wstat() { return g_bwd_ring_wstat.load(); }
bool set_rownorm_bwd_cluster(bool on) { return g_bwd_cluster.exchange(on); }
bool rownorm_bwd_cluster() { return g_bwd_cluster.load(); }
int set_rownorm_bwd_cluster_mult(int m) { return g_bwd_cluster_mult.exchange(m); }
int rownorm_bwd_cluster_mult() { return g_bwd_cluster_mult.load(); }
int set_rownorm_fwd_cluster(int mode) { return g_fwd_cluster.exchange(mode); }
int rownorm_fwd_cluster_mode() { return g_fwd_cluster.load(); }
bool set_rownorm_fwd_cluster_f32(bool on) { return g_fwd_cluster_f32.exchange(on); }
bool rownorm_fwd_cluster_f32() { return g_fwd_cluster_f32.load(); }
bool set_rownorm_fwd_bulk(bool enabled) { return g_fwd_bulk.exchange(enabled); }
bool rownorm_fwd_bulk_enabled() { return g_fwd_bulk.load(); }
int set_rownorm_fwd_bulk_long(int mode) { return g_fwd_bulk_long.exchange(mode); }
int rownorm_fwd_bulk_long_mode() { return g_fwd_bulk_long.load(); }
bool set_rownorm_fwd_bulk_long_wide(bool on) { return g_fwd_bulk_long_wide.exchange(on); }
bool rownorm_fwd_bulk_long_wide() { return g_fwd_bulk_long_wide.load(); }
int set_rownorm_fwd_bulk_hoist(int mode) { return g_fwd_bulk_hoist.exchange(mode); }
int rownorm_fwd_bulk_hoist_mode() { return g_fwd_bulk_hoist.load(); }
bool force_rownorm_fwd_bulk_unstaged(bool on) { return g_fwd_bulk_unstaged.exchange(on); }
bool rownorm_fwd_bulk_unstaged() { return g_fwd_bulk_unstaged.load(); }
int cap_rownorm_fwd_bulk_ctas(int ctas) { return g_fwd_bulk_cap.exchange(ctas); }
int rownorm_fwd_bulk_cta_cap() { return g_fwd_bulk_cap.load(); }
int force_rownorm_fwd_bulk_vecs(int vpt) { return g_fwd_bulk_vecs.exchange(vpt); }
int rownorm_fwd_bulk_vecs() { return g_fwd_bulk_vecs.load(); }
bool set_rownorm_fwd_row1(bool enabled) { return g_fwd_row1.exchange(enabled); }
bool rownorm_fwd_row1_enabled() { return g_fwd_row1.load(); }
int force_rownorm_fwd_row1_vecs(int vpt) { return g_fwd_row1_vecs.exchange(vpt); }
int rownorm_fwd_row1_vecs() { return g_fwd_row1_vecs.load(); }
int set_rownorm_fwd_row1_capped(int mode) { return g_fwd_row1_capped.exchange(mode); }
int rownorm_fwd_row1_capped_mode() { return g_fwd_row1_capped.load(); }
bool set_rownorm_fwd_row1_long(bool on) { return g_fwd_row1_long.exchange(on); }
bool rownorm_fwd_row1_long() { return g_fwd_row1_long.load(); }
int set_rownorm_fwd_row1_prefetch(int mode) { return g_fwd_row1_prefetch.exchange(mode); }
int rownorm_fwd_row1_prefetch_mode() { return g_fwd_row1_prefetch.load(); }
int set_rownorm_fwd_row1_rawx(int mode) { return g_fwd_row1_rawx.exchange(mode); }
int rownorm_fwd_row1_rawx_mode() { return g_fwd_row1_rawx.load(); }
bool set_rownorm_fwd_row1_tight(bool on) { return g_fwd_row1_tight.exchange(on); }
bool rownorm_fwd_row1_tight() { return g_fwd_row1_tight.load(); }
bool set_rownorm_fwd_row1_f32par(bool on) { return g_fwd_row1_f32par.exchange(on); }
bool rownorm_fwd_row1_f32par() { return g_fwd_row1_f32par.load(); }
static Row1Config row1_cfg_of(int v) {
  return Row1Config{v & 0xffff, (v >> 16) & 0xff, ((v >> 24) & 1) != 0, ((v >> 25) & 1) != 0};
}
Row1Config force_rownorm_fwd_row1_config(Row1Config c) {
  return row1_cfg_of(g_fwd_row1_cfg.exchange(c.tpr > 0 ? c.tpr | c.vb << 16 | int(c.late) << 24 | int(c.plain) << 25 : 0));
}
Row1Config rownorm_fwd_row1_config() { return row1_cfg_of(g_fwd_row1_cfg.load()); }

void rownorm_fwd_cuda(const RowNormParams& p, Stream stream) {
  dispatch("rownorm_fwd", p.io, [&](auto t) { rownorm_fwd_launch<decltype(t)>(p, stream); });
}
std::size_t rownorm_bwd_workspace_bytes(const RowNormParams& p) {
  return dispatch("rownorm_bwd", p.io, [&](auto t) { return rownorm_bwd_workspace<decltype(t)>(p); });
}
void rownorm_bwd_cuda(const RowNormParams& p, void* workspace, std::size_t, Stream stream) {
  dispatch("rownorm_bwd", p.io, [&](auto t) { rownorm_bwd_launch<decltype(t)>(p, workspace, stream); });
}

}  // namespace fastweight::detail
