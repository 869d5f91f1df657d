// rownorm_f16.cu: f16 instantiations of the LayerNorm-family kernels (rownorm_launch.cuh).
#include "cuda/norm/rownorm_launch.cuh"

namespace fastweight::detail {
FW_INSTANTIATE_ROWNORM(__half)
}  // namespace fastweight::detail
