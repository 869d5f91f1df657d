// mlstm_lower.h: validated mLSTM arguments (fastweight/mlstm.h) -> MlstmParams for the CUDA kernels.
// No checks here: call after the public entry point's validation (or in tests that build valid
// arguments themselves).
#pragma once

#include "common/mlstm_params.h"
#include "fastweight/mlstm.h"

namespace fastweight::detail {

MlstmParams lower_mlstm_fwd(const MlstmFwdArgs& a);
MlstmBwdParams lower_mlstm_bwd(const MlstmBwdArgs& a);
MlstmParams lower_mlstm_step(const MlstmStepArgs& a);
// The decay matrix: i, f, and S from i (B, NH, S); D / dD (lead 3) and di / df (lead 2) with view_of.
MlstmParams lower_mlstm_decay(const TensorRef& i, const TensorRef& f);
// The view of t whose first `lead` dims are indices (strides s0, s1, s2) and whose remaining dims
// (at most one, contiguous) are the element offset: q (B, NH, S, D) lead 3, gates (B, NH, S) and
// n (B, NH, DQK) lead 2, m (B, NH[, 1]) lead 2, step vectors (B, NH, D) lead 2.
StridedView view_of(const TensorRef& t, int lead);

}  // namespace fastweight::detail
