// cluster.cuh: Hopper (sm_90) thread-block clusters: a CTA's rank, the cluster barrier, and small
// writes into a peer CTA's shared memory (st.async) that complete on the peer's mbarrier, so that the
// peer waits for the bytes themselves instead of for a cluster-wide barrier. Device code only where
// __CUDA_ARCH__ >= 900 (FW_HAS_BULK, bulk.cuh); below it the functions are never called (the host
// plans cluster launches on sm_90 binaries only) and compile to nothing.
#pragma once

#include <cstdint>

#include "cuda/common/bulk.cuh"

namespace fastweight::detail {

// This CTA's rank in its cluster, and the cluster's CTA count (1-D clusters: rank = blockIdx.x % count).
__device__ __forceinline__ int cluster_rank() {
  unsigned r = 0;
#if defined(FW_HAS_BULK)
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
#endif
  return int(r);
}
__device__ __forceinline__ int cluster_size() {
  unsigned n = 1;
#if defined(FW_HAS_BULK)
  asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(n));
#endif
  return int(n);
}

// The cluster barrier in two halves: every thread of every CTA arrives (release: its earlier shared and
// global accesses come first), then waits (acquire) for all of them. Work between the two overlaps it.
__device__ __forceinline__ void cluster_arrive() {
#if defined(FW_HAS_BULK)
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(FW_HAS_BULK)
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}

#if defined(FW_HAS_BULK)
// The shared::cluster address of this CTA's shared `p` as seen in the CTA of rank `rank`.
__device__ __forceinline__ std::uint32_t cluster_map(const void* p, int rank) {
  std::uint32_t out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(out) : "r"(smem_u32(p)), "r"(rank));
  return out;
}
// 8 bytes into the shared memory of the CTA of rank `rank` at the place of this CTA's `dst`, counted
// on that CTA's mbarrier at the place of this CTA's `bar` (complete_tx: 8 bytes).
__device__ __forceinline__ void st_async_float2(float2* dst, float2 v, std::uint64_t* bar, int rank) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];\n" ::"r"(
                   cluster_map(dst, rank)),
               "f"(v.x), "f"(v.y), "r"(cluster_map(bar, rank))
               : "memory");
}
// Wait for the phase of parity `parity` of this CTA's `bar` (acquire at cluster scope: the peers'
// st.async bytes that completed it are visible after).
__device__ __forceinline__ void mbar_wait_cluster(std::uint64_t* bar, unsigned parity) {
  unsigned done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  } while (!done);
}
#endif

}  // namespace fastweight::detail
