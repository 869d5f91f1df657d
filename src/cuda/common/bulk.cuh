// bulk.cuh: Hopper (sm_90) bulk asynchronous copies, global -> shared, by the TMA engine without a
// tensor map (cp.async.bulk: one instruction moves a whole contiguous span), completed on an
// mbarrier that counts the bytes. Device code only where __CUDA_ARCH__ >= 900 (FW_HAS_BULK); the
// host decides by the device's compute capability (cc_major()).
#pragma once

#include <cstdint>

#include "cuda/common/smem.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define FW_HAS_BULK 1
#endif

namespace fastweight::detail {

// Programmatic dependent launch (sm_90; no-ops below): a kernel launched after this one with
// cudaLaunchAttributeProgrammaticStreamSerialization may be scheduled once every CTA of this one
// has signalled (or exited); it must wait before it reads what this one wrote, and the wait lasts
// until this grid has completed and its memory is visible (so the signal's place is a performance
// choice, never a correctness one).
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(FW_HAS_BULK)
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait_primary() {
#if defined(FW_HAS_BULK)
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

#if defined(FW_HAS_BULK)
// One arrival expected per phase (the thread that also posts the byte count).
__device__ __forceinline__ void mbar_init(std::uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
// After the inits, before the barrier that publishes them: visible to the async proxy (the copies).
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Arrive, and expect `bytes` more of transaction count in this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(std::uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}
// Wait until the phase of parity `parity` has completed (the copies' bytes have landed).
__device__ __forceinline__ void mbar_wait(std::uint64_t* bar, unsigned parity) {
  unsigned done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  } while (!done);
}
// A plain arrival (release: this thread's earlier shared-memory reads and writes come before it).
__device__ __forceinline__ void mbar_arrive(std::uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// This thread's arrival on `bar`, made once its earlier cp.async copies have landed (.noinc: the
// arrival counts against the count given to mbar_init, one per copying thread and phase).
__device__ __forceinline__ void cp_async_mbar_arrive(std::uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// A barrier of `threads` threads (a multiple of 32) on hardware barrier `id` (1..15; __syncthreads
// takes 0): a warp-specialised kernel's consumer warps among themselves.
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// `bytes` (a multiple of 16; both addresses 16-byte aligned) from global `src` to shared `dst`,
// completing on `bar`.
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, unsigned bytes, std::uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_u32(dst)),
               "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}
// The bulk stores' bookkeeping (tensor_map.cuh's tma_store_4d): shared data written by threads made
// visible to the async proxy (then a barrier), a store group committed, waited for.
__device__ __forceinline__ void bulk_fence_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Until this thread's bulk stores have read their shared sources (the staging may be written again).
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
// Until this thread's bulk stores are complete (before the CTA exits).
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
// `bytes` (a multiple of 16, `src` 16-byte aligned) of global memory into L2, without waiting.
__device__ __forceinline__ void bulk_prefetch_l2(const void* src, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(src), "r"(bytes) : "memory");
}
#endif

}  // namespace fastweight::detail
