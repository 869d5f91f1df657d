// gstore.cuh: a 16-byte global store of 4 floats that stays one 16-byte store. nvcc compiles
// `*reinterpret_cast<float4*>(p) = v` for a float4 assembled from scalars as four 4-byte stores (PTX
// st.global.f32 at +0, +4, +8, +12; session 30 found them in the decoding steps' state rows and the
// wy kernel's fp32 T2 rows), so a warp writes each 32-byte sector in four partial pieces. A uint4
// copied from registers fares alike: the DeltaNet rs kernel's row stores alternated between one
// STG.128 and four STG.32 (session 31, in its SASS).
#pragma once

namespace fastweight::detail {

// p: 16-byte aligned global memory that the thread does not read again. No "memory" clobber: the
// compiler may move other accesses across it (a later block's loads above it), and in place the loads
// of the same elements stay before it through v, which they compute.
__device__ __forceinline__ void st_global_v4f(float* p, float4 v) {
  asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w));
}

// The same for 16 bytes of any kind (bf16 rows), as 4 words.
__device__ __forceinline__ void st_global_v4u(void* p, uint4 v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}

}  // namespace fastweight::detail
