// deltanet_lower.h: validated DeltaNet arguments (fastweight/deltanet.h) -> DeltanetParams for the
// CUDA kernels. No checks here: call after the public entry point's validation (or in tests that
// build valid arguments themselves).
#pragma once

#include "common/deltanet_params.h"
#include "fastweight/deltanet.h"

namespace fastweight::detail {

DeltanetParams lower_deltanet_fwd(const DeltanetFwdArgs& a);

}  // namespace fastweight::detail
