// norm_ref.h: the CPU reference of the LayerNorm family (MATH.md §1): the definition every kernel
// is checked against. Double accumulation, any IO dtype, plain loops in row order.
#pragma once

#include "common/norm_params.h"

namespace fastweight::detail {

void rownorm_fwd_reference(const RowNormParams& p);
void rownorm_bwd_reference(const RowNormParams& p);

}  // namespace fastweight::detail
