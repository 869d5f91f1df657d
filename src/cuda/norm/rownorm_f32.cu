// rownorm_f32.cu: f32 instantiations of the LayerNorm-family kernels (rownorm_launch.cuh).
#include "cuda/norm/rownorm_launch.cuh"

namespace fastweight::detail {
FW_INSTANTIATE_ROWNORM(float)
}  // namespace fastweight::detail
