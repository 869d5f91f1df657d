// rownorm_bf16.cu: bf16 instantiations of the LayerNorm-family kernels (rownorm_launch.cuh).
#include "cuda/norm/rownorm_launch.cuh"

namespace fastweight::detail {
FW_INSTANTIATE_ROWNORM(__nv_bfloat16)
}  // namespace fastweight::detail
