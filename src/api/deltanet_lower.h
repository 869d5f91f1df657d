// deltanet_lower.h: validated DeltaNet arguments (fastweight/deltanet.h) -> DeltanetParams for the
// CUDA kernels. No checks here: call after the public entry point's validation (or in tests that
// build valid arguments themselves).
#pragma once

#include "common/deltanet_params.h"
#include "fastweight/deltanet.h"

namespace fastweight::detail {

DeltanetParams lower_deltanet_fwd(const DeltanetFwdArgs& a);
DeltanetBwdParams lower_deltanet_bwd(const DeltanetBwdArgs& a);
// The decoding step as the forward over T = 1 with the state as initial and final state.
DeltanetParams lower_deltanet_step(const DeltanetStepArgs& a);

}  // namespace fastweight::detail
