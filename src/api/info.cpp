// info.cpp: build description; cuda_available() lives with the CUDA code (or is false here).
#include "fastweight/fastweight.h"

namespace fastweight {
const char* build_info() {
#if FW_WITH_CUDA
  return "cuda archs " FW_BUILD_ARCHS ", dtypes " FW_BUILD_DTYPES;
#else
  return "cpu only";
#endif
}
#if !FW_WITH_CUDA
bool cuda_available() { return false; }
#endif
}  // namespace fastweight
