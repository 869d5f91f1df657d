// wgmma_probe.cu: tests only (wgmma_probe.h): the wgmma helpers' layouts and descriptors on one
// warpgroup, against a host reference.
#include "cuda/common/wgmma_probe.h"

#include <cuda_bf16.h>

#include "cuda/common/bulk.cuh"
#include "cuda/common/check.cuh"
#include "cuda/common/wgmma.cuh"

namespace fastweight::detail {
namespace {

// One CTA of 128 threads (one warpgroup). ok: set to 1 where the binary has wgmma.
__global__ void __launch_bounds__(128) wgmma_probe_kernel(const __nv_bfloat16* __restrict__ a,
                                                          const __nv_bfloat16* __restrict__ b,
                                                          const __nv_bfloat16* __restrict__ a2,
                                                          const __nv_bfloat16* __restrict__ b2, float* d, float* e,
                                                          float* f, int* ok) {
  __shared__ __align__(1024) unsigned char sb[2 * 8192];   // b: two (64 n, 64 k) swizzled blocks (k 0-63, 64-127)
  __shared__ __align__(1024) unsigned char sb2[2 * 8192];  // b2: two (64 k, 64 n) swizzled blocks (n 0-63, 64-127)
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  for (int x = tid; x < 64 * 128; x += 128) {
    const int r = x / 128, c = x % 128;
    *reinterpret_cast<__nv_bfloat16*>(sb + (c / 64) * 8192 + sw128_off(r, c % 64)) = b[x];   // (n = r, k = c)
    *reinterpret_cast<__nv_bfloat16*>(sb2 + (c / 64) * 8192 + sw128_off(r, c % 64)) = b2[x]; // (k = r, n = c)
  }
#if defined(FW_HAS_BULK)
  bulk_fence_shared();  // the generic-proxy writes above, visible to wgmma's reads (async proxy)
#endif
  __syncthreads();
  // this warp's A fragments of k-step s (rows 16 warp + g (+ 8), columns 16 s + 2 t (+ 1) (+ 8))
  auto frag = [&](const __nv_bfloat16* m, int ld, int s, std::uint32_t (&r)[4]) {
    const int r0 = 16 * warp + g, c0 = 16 * s + 2 * t;
    auto pk = [&](int rr, int cc) { return *reinterpret_cast<const std::uint32_t*>(m + rr * ld + cc); };
    r[0] = pk(r0, c0), r[1] = pk(r0 + 8, c0), r[2] = pk(r0, c0 + 8), r[3] = pk(r0 + 8, c0 + 8);
  };
  std::uint32_t af[8][4], af2[4][4];
#pragma unroll
  for (int s = 0; s < 8; ++s) frag(a, 128, s, af[s]);
#pragma unroll
  for (int s = 0; s < 4; ++s) frag(a2, 64, s, af2[s]);
  float acc[32], acc2[64], acc3[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) acc[i] = 0.f, acc3[i] = 0.f;
#pragma unroll
  for (int i = 0; i < 64; ++i) acc2[i] = 0.f;
  wgmma_fence_operand(acc), wgmma_fence_operand(acc2), wgmma_fence_operand(acc3);  // the zeros before the fence
  wgmma_fence();
#pragma unroll
  for (int s = 0; s < 8; ++s)  // K-major: block s / 4, + 32 bytes per k-step within it
    wgmma_m64n64k16_rs<0>(acc, af[s], gmma_desc_sw128(sb + (s / 4) * 8192 + (s % 4) * 32, 16, 1024), s > 0);
#pragma unroll
  for (int s = 0; s < 4; ++s)  // MN-major: + 16 rows (2048 bytes) per k-step; LBO: the next 64 columns
    wgmma_m64n128k16_rs<1>(acc2, af2[s], gmma_desc_sw128(sb2 + s * 2048, 8192, 1024), s > 0);
#pragma unroll
  for (int s = 0; s < 4; ++s)  // MN-major, n = 64: the first block alone (the kernel's K <= 64 form)
    wgmma_m64n64k16_rs<1>(acc3, af2[s], gmma_desc_sw128(sb2 + s * 2048, 8192, 1024), s > 0);
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_fence_operand(acc), wgmma_fence_operand(acc2), wgmma_fence_operand(acc3);
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      const int r = 16 * warp + g + 8 * (x >> 1), c = 8 * j + 2 * t + (x & 1);
      if (j < 8) d[r * 64 + c] = acc[4 * j + x], f[r * 64 + c] = acc3[4 * j + x];
      e[r * 128 + c] = acc2[4 * j + x];
    }
#if defined(FW_HAS_WGMMA)
  if (tid == 0) *ok = 1;
#endif
}

}  // namespace

bool wgmma_probe(const std::uint16_t* a, const std::uint16_t* b, const std::uint16_t* a2, const std::uint16_t* b2,
                 float* d, float* e, float* f) {
  constexpr const char* op = "wgmma_probe";
  const std::size_t na = 64 * 128, na2 = 64 * 64, nd = 64 * 64, ne = 64 * 128;
  void* buf = nullptr;
  const std::size_t bytes = 2 * (na + na + na2 + na) + 4 * (nd + ne + nd) + 16;
  FW_CUDA_CHECK(op, cudaMalloc(&buf, bytes));
  auto* pa = static_cast<std::uint16_t*>(buf);
  std::uint16_t *pb = pa + na, *pa2 = pb + na, *pb2 = pa2 + na2;
  float* pd = reinterpret_cast<float*>(pb2 + na);
  float* pe = pd + nd;
  float* pf = pe + ne;
  int* pok = reinterpret_cast<int*>(pf + nd);
  bool ran = false;
  try {
    FW_CUDA_CHECK(op, cudaMemcpy(pa, a, 2 * na, cudaMemcpyHostToDevice));
    FW_CUDA_CHECK(op, cudaMemcpy(pb, b, 2 * na, cudaMemcpyHostToDevice));
    FW_CUDA_CHECK(op, cudaMemcpy(pa2, a2, 2 * na2, cudaMemcpyHostToDevice));
    FW_CUDA_CHECK(op, cudaMemcpy(pb2, b2, 2 * na, cudaMemcpyHostToDevice));
    FW_CUDA_CHECK(op, cudaMemset(pok, 0, 4));
    wgmma_probe_kernel<<<1, 128>>>(reinterpret_cast<const __nv_bfloat16*>(pa), reinterpret_cast<const __nv_bfloat16*>(pb),
                                   reinterpret_cast<const __nv_bfloat16*>(pa2),
                                   reinterpret_cast<const __nv_bfloat16*>(pb2), pd, pe, pf, pok);
    FW_CUDA_CHECK_LAUNCH(op);
    FW_CUDA_CHECK(op, cudaDeviceSynchronize());
    int ok = 0;
    FW_CUDA_CHECK(op, cudaMemcpy(&ok, pok, 4, cudaMemcpyDeviceToHost));
    if (ok) {
      FW_CUDA_CHECK(op, cudaMemcpy(d, pd, 4 * nd, cudaMemcpyDeviceToHost));
      FW_CUDA_CHECK(op, cudaMemcpy(e, pe, 4 * ne, cudaMemcpyDeviceToHost));
      FW_CUDA_CHECK(op, cudaMemcpy(f, pf, 4 * nd, cudaMemcpyDeviceToHost));
      ran = true;
    }
  } catch (...) {
    (void)cudaFree(buf);
    throw;
  }
  FW_CUDA_CHECK(op, cudaFree(buf));
  return ran;
}

}  // namespace fastweight::detail
