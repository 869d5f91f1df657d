// fastweight/fastweight.h: everything public.
#pragma once
#include "fastweight/deltanet.h"
#include "fastweight/error.h"
#include "fastweight/mlstm.h"
#include "fastweight/norm.h"
#include "fastweight/tensor.h"

namespace fastweight {
// True when this build has CUDA kernels and a GPU is visible.
bool cuda_available();
// "cuda sm_90a;sm_80, dtypes f32;f16;bf16" or "cpu only".
const char* build_info();
}  // namespace fastweight
