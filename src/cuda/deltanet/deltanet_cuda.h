// deltanet_cuda.h: the CUDA back end of DeltaNet (host-callable, no CUDA headers).
#pragma once

#include "common/deltanet_params.h"

namespace fastweight::detail {

// The largest head dim K of the forward: the CTA's state slice (K, 64) lives in shared memory.
inline constexpr std::int64_t kDeltanetFwdMaxK = 256;

// Chunkwise forward (chunks of 64, the WY form of the reference): o and, when p.ht is set, the
// final states. No workspace: the state lives in shared memory.
void deltanet_fwd_cuda(const DeltanetParams& p, Stream stream);
// Version 2 on tensor cores (deltanet_fwd_tc.cu): bf16 q, k, v, o and K <= 128;
// deltanet_fwd_cuda picks it where it applies.
bool deltanet_fwd_tc_applies(const DeltanetParams& p);
void deltanet_fwd_tc_cuda(const DeltanetParams& p, Stream stream);
// Version 1 (fp32 FMA) alone: any dtype, K <= 256; with p.save_S / p.save_X set it is the backward's
// recompute (o may be absent).
void deltanet_fwd_v1_cuda(const DeltanetParams& p, Stream stream);

// Backward (deltanet_bwd.cu): the recompute above, a reverse pass over the chunks for dS, dv and
// partial dbeta, a parallel pass per chunk for dq, dk, dbeta, and the L2-norm backward when asked.
// Workspace: deltanet_bwd_workspace_bytes(p) bytes (DnBwdWs), 256-byte aligned.
std::size_t deltanet_bwd_workspace_bytes(const DeltanetBwdParams& p);
void deltanet_bwd_cuda(const DeltanetBwdParams& p, void* workspace, Stream stream);

}  // namespace fastweight::detail
