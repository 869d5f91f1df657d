// check.cuh: CUDA error checks that become fastweight::Error (never exit(), never printf).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdlib>

#include "fastweight/error.h"

#define FW_CUDA_CHECK(op, call)                                                                  \
  do {                                                                                           \
    const cudaError_t fw_err_ = (call);                                                          \
    if (fw_err_ != cudaSuccess)                                                                  \
      throw ::fastweight::Error(::fastweight::detail::cat(op, ": CUDA error ",                   \
                                                          cudaGetErrorName(fw_err_), " (",       \
                                                          cudaGetErrorString(fw_err_), ") at ",  \
                                                          #call));                               \
  } while (0)

// After a launch: configuration errors surface here (execution errors surface at the next sync).
#define FW_CUDA_CHECK_LAUNCH(op) FW_CUDA_CHECK(op, cudaGetLastError())

namespace fastweight::detail {
// The A/B switches' starting values from the environment (the Python benchmarks have no handle on the
// switches): the variable `name` as one digit 0..9, else (unset, empty, anything else) `fallback`.
inline int env_digit(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && v[0] >= '0' && v[0] <= '9' && v[1] == '\0' ? v[0] - '0' : fallback;
}

// A launch of kernel fn on stream s; programmatic where pdl (cudaLaunchAttributeProgrammaticStreamSerialization,
// sm_90: it may be scheduled before the previous kernel in the stream has ended, so fn must wait
// (pdl_wait_primary, cuda/common/bulk.cuh) before it touches that kernel's memory), else a plain launch;
// in 1-D clusters of `cluster` CTAs where cluster > 1 (sm_90; grid.x a multiple of it).
template <typename... P, typename... A>
void launch_kernel_cluster(const char* op, void (*fn)(P...), dim3 grid, dim3 block, std::size_t smem, cudaStream_t s,
                           bool pdl, unsigned cluster, A&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[2];
  unsigned na = 0;
  if (pdl) {
    attr[na].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[na++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster > 1) {
    attr[na].id = cudaLaunchAttributeClusterDimension;
    attr[na].val.clusterDim.x = cluster;
    attr[na].val.clusterDim.y = 1;
    attr[na++].val.clusterDim.z = 1;
  }
  cfg.attrs = attr;
  cfg.numAttrs = na;
  FW_CUDA_CHECK(op, cudaLaunchKernelEx(&cfg, fn, static_cast<A&&>(args)...));
}
template <typename... P, typename... A>
void launch_kernel(const char* op, void (*fn)(P...), dim3 grid, dim3 block, std::size_t smem, cudaStream_t s, bool pdl,
                   A&&... args) {
  launch_kernel_cluster(op, fn, grid, block, smem, s, pdl, 1u, static_cast<A&&>(args)...);
}

// Multiprocessor count of the current device (cached).
int sm_count();
// Compute capability (major) of the current device (cached).
int cc_major();
// One more stream of the current device for a kernel sequence's overlap (the DeltaNet backward's
// recompute, the mLSTM backward's DV slabs): created on first use and kept, non-blocking, ordered
// against the caller's stream by events alone.
cudaStream_t side_stream();
// The architecture `kernel`'s device code was compiled for, as __CUDA_ARCH__ / 10 saw it (major * 10 +
// minor: the lower of the loaded binary's and its PTX's, so a PTX-JIT build of compute_80 on a newer GPU
// reports 80 and no sm_90-only path is taken). Cached.
int kernel_binary_version(const void* kernel);
// Whether `kernel` runs as sm_90a code (wgmma, setmaxnreg): its binary is of architecture 9.0 and this
// build's architectures (FW_CUDA_ARCHS) name 90a and not plain 90, so the driver cannot have loaded a
// plain sm_90 image of it (where the sm_90a-only instructions are compiled out).
bool kernel_runs_sm90a(const void* kernel);
// Resident CTAs per SM of `kernel` at this launch shape on the current device; also raises the
// kernel's dynamic shared-memory limit to `smem` when needed. Cached (thread-safe).
int resident_ctas_per_sm(const void* kernel, int threads, std::size_t smem);
// Clusters of `cluster` CTAs of `kernel` at this launch shape that the current device holds at once (0:
// none fit); also raises the kernel's dynamic shared-memory limit as resident_ctas_per_sm. Cached.
int resident_clusters(const void* kernel, int threads, std::size_t smem, int cluster);
// The most dynamic + static shared memory a block may opt in to on the current device (cached).
std::size_t smem_per_block_optin();
// Tests only: caps what smem_per_block_optin() reports (0: no cap), so a Hopper run takes the paths
// a device with less shared memory takes (sm_80: 166912 bytes); returns the previous cap.
std::size_t cap_smem_per_block_optin(std::size_t bytes);
}  // namespace fastweight::detail
