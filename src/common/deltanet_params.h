// deltanet_params.h: the plain-data description of one DeltaNet call for the CUDA kernels (lowered
// from validated TensorRefs by src/api; see fastweight/deltanet.h for the layouts).
//   q, k, v, o (B, T, H, D): element (b, t, h, d) at p + b*s0 + t*s1 + h*s2 + d
//   beta (B, T, H):          element (b, t, h)    at p + b*s0 + t*s1 + h
//   states (N, H, K, V):     element (n, h, a, j) at p + n*s0 + h*s1 + a*s2 + j
#pragma once

#include <algorithm>
#include <cstdint>

#include "common/mlstm_params.h"  // StridedView

namespace fastweight::detail {

struct DeltanetParams {
  std::int64_t B = 0, T = 0, H = 0, K = 0, V = 0, N = 0;
  float scale = 1.f;
  bool l2 = false;
  StridedView q, k, v, beta, o, h0, ht;
  const void* cu_seqlens = nullptr;  // (N+1) on the device, int32 or int64; null: N = B sequences of T
  bool cu_i64 = true;
  // The tensor-core kernels (bf16, K <= 128): operands that come from fp32 values (states, the WY
  // factors, their gradients) as bf16 hi + lo (~16 bits, the default) or bf16 only (false: FLA's
  // precision, half the products and half the state / Xw workspace).
  bool hilo = true;
  // The backward's recompute (deltanet_bwd.cu) runs the forward with these set (fp32 workspace): the
  // state entering every chunk and X = R - Lg D of every row (D = diag(beta) X); see DnBwdWs.
  float* save_S = nullptr;
  float* save_X = nullptr;
  // The WY inverse per row (fastweight/deltanet.h, wy_inverse: (B*T*H, 64) contiguous, fp32 with hilo,
  // else bf16): the forward's pipeline writes it here (optional), the backward's recompute reads it
  // instead of forming it (optional). Row t of a chunk holds column t of T2 (see DnChunkBufs::T2).
  void* wy_t2 = nullptr;
};

// The backward: the forward's inputs (o, ht unused) plus the gradients; absent views are not written.
struct DeltanetBwdParams : DeltanetParams {
  StridedView do_, dht;                    // dL/do (B, T, H, V), dL/d final state (N, H, K, V) or absent
  StridedView dq, dk, dv, dbeta, dh0;      // outputs, each optional
};

// Chunk slots of 64 rows: sequence n's chunk c is slot base(n) + c, with base(n) = n * ceil(T / 64)
// for equal lengths and floor(bos_n / 64) + n for cu_seqlens (no prefix sum over the lengths needed:
// base(n+1) - base(n) >= ceil(len_n / 64)). Slots past a sequence's end stay unused.
inline constexpr std::int64_t kDeltanetChunk = 64;
inline std::int64_t deltanet_slots(const DeltanetParams& p) {
  const std::int64_t c = kDeltanetChunk;
  return p.cu_seqlens ? p.T / c + p.N + 1 : p.N * ((p.T + c - 1) / c);
}

// Scratch of the tensor-core chunk pipeline (deltanet_chunk_tc.cu), fp32 unless noted; rows = B*T*H:
//   xw (rows, K) bf16 hi then lo: Xw = T2 diag(rk) K per chunk, T2 = (I + Lg diag(beta))^-1
//   xu (rows, V): Xu = T2 V;  rk (rows): rk beta, rk the L2 factor of k (1 without the L2 norm)
//   S (slots, H): the state entering each chunk, a (K, V) bf16 hi then a (K, V) bf16 lo matrix
//   X (rows, V): X = Xu - Xw S (D = diag(beta) X)
// Without p.hilo the lo halves are absent: xw (rows, K) bf16, S (slots, H) one (K, V) bf16 matrix.
struct DnChunkBufs {
  float *xw = nullptr, *xu = nullptr, *rk = nullptr, *S = nullptr, *X = nullptr;
  // optional (rows, 64), a row per chunk row i: T2^T's row i (column i of T2; zero past the chunk's
  // rows), fp32 with hi + lo operands, else bf16. T2 = (I + Lg W)^-1 as the products use it: with bf16
  // operands rounded to bf16 (FLA's A), so that a T2 saved by the forward gives the backward the same
  // Xw, Xu and states. Written by the wy kernel (the forward's wy_inverse, the backward's own region),
  // or with t2_given read by it (the backward with the forward's) instead of formed; the backward's
  // post kernel reads it.
  float* T2 = nullptr;
  // The forward's pipeline (o is all that reads X): where the state kernel can (deltanet_dprime), the
  // X region holds D' = diag(rk beta) X as bf16 (rows, V) instead, the output kernel's operand.
  bool dprime = false;
  // The backward's recompute with bf16 operands (deltanet_bwd_x_bf16): X as bf16 (rows, V) in the X
  // region (its first half), as the backward's post kernel and chunk pass read it.
  bool xbf16 = false;
  // With bf16 operands (deltanet_xu_bf16): Xu as bf16 (rows, V) in the xu region (its first half), as
  // FLA keeps its u: written by the wy kernel, read by the state kernel.
  bool xu16 = false;
  // T2 is the forward's (read, not formed): see T2 (last: positional initialisers keep their meaning)
  bool t2_given = false;
  // The state kernel's V tile width, 32 or 64 (0: deltanet_serial_tile's; the backward's recompute
  // takes the backward's, deltanet_bwd_serial_tile)
  int tile = 0;
  // The backward's recompute may take the warp-specialised state kernel (where its paths hold; the
  // forward's request, dprime, always may): its epilogue stores X as bf16 (xbf16) as the other's does
  bool state_ws = false;
};

// bf16 matrices per state or Xw row (hi + lo, or hi only), and floats for n of them
inline std::int64_t dn_nmat(const DeltanetParams& p) { return p.hilo ? 2 : 1; }
inline std::int64_t dn_bf16_floats(const DeltanetParams& p, std::int64_t n) { return (n * dn_nmat(p) + 1) / 2; }

// The forward's workspace with the tensor-core pipeline (offsets in floats, 64-float aligned).
struct DnFwdWs {
  std::int64_t xw, xu, rk, S, X, total;
  // xu16: Xu as bf16 (DnChunkBufs::xu16), its region half the size
  explicit DnFwdWs(const DeltanetParams& p, bool xu16 = false) {
    const std::int64_t rows = p.B * p.T * p.H;
    std::int64_t o = 0;
    auto take = [&](std::int64_t n) { const std::int64_t at = o; o += (n + 63) / 64 * 64; return at; };
    xw = take(dn_bf16_floats(p, rows * p.K)), xu = take(xu16 ? (rows * p.V + 1) / 2 : rows * p.V), rk = take(rows);
    S = take(dn_bf16_floats(p, deltanet_slots(p) * p.H * p.K * p.V));
    X = take(rows * p.V);
    total = o;
  }
};

// The backward's workspace, offsets in floats (each region 64-float aligned):
//   S, dS (slots, H, K, V): the state entering each chunk / dL/d the state leaving it
//   X, Y (B*T*H, V): per row X = R - Lg D and Y = T^T dD (dR = diag(beta) Y)
//   dbp (ceil(V/64), B*T*H): dbeta partial sums, one per 64-column tile of V
//   dqh, dkh (B*T*H, K): dL/d of the L2-normalised q, k (only with the in-kernel L2 norm)
//   xw, xu, rk, T2: the tensor-core recompute's scratch (DnChunkBufs), when it applies (T2 per row as
//   DnChunkBufs::T2; none when the forward's p.wy_t2 is given: read from there); then S and
//   dS hold bf16 hi + lo (or hi only) matrices as DnChunkBufs::S instead of fp32, the state pass keeps dD0, then
//   dD, in Y before it writes Y there (deltanet_bwd_tc.cu), and fac (3, B*T*H) holds rq, rk, beta
// dqh and dkh share xw's and xu's memory: the chunk pass writes them after the recompute (the only
// reader of xw, xu) is done, in stream order (-268 MB at (4, 4096, 16, 128) with the L2 norm). With
// bf16 operands (FLA's precision) they are bf16 (h16), as FLA's chunk backward hands dq^, dk^ to its
// L2-norm backward: dqh then fits in xw's bf16 rows (-67 MB at (2, 8192, 16, 128)).
struct DnBwdWs {
  std::int64_t rows, vt, S, dS, X, Y, dbp, dqh, dkh, xw, xu, rk, T2, fac, total;
  bool h16 = false;  // dqh, dkh as bf16
  // With xb, the Q^ region (after fac; a function, not a member: a larger struct of kernel parameters
  // cost the chunk pass spills)
  FW_MLSTM_HD std::int64_t qh() const { return fac + (3 * rows + 63) / 64 * 64; }
  // X and the Y region (dD0, dD, then -Y) as bf16 (rows, V) matrices, each region half the size
  // (DnChunkBufs::xbf16; deltanet_bwd_tc.cu), and the serial kernel's dS update from Q^ = s diag(rq) Q
  // (the qh region) and dO itself; deltanet_bwd_cuda's choice
  bool xb = false;
  bool xu16 = false;  // Xu as bf16 (DnChunkBufs::xu16), the choice that sized the xu region
  // tc: the recompute runs the tensor-core pipeline (its xw, xu, rk regions; see DnChunkBufs); without
  // p.hilo (bf16-only operands) the whole backward is on tensor cores (deltanet_bwd_cuda sees to it)
  // xu16: Xu as bf16 (DnChunkBufs::xu16): the xu region may be half the size
  DnBwdWs(const DeltanetParams& p, bool tc, bool x_bf16 = false, bool xu_bf16 = false) : xb(x_bf16), xu16(xu_bf16) {
    rows = p.B * p.T * p.H, vt = (p.V + kDeltanetChunk - 1) / kDeltanetChunk;
    std::int64_t o = 0;
    auto take = [&](std::int64_t n) { const std::int64_t at = o; o += (n + 63) / 64 * 64; return at; };
    const std::int64_t states = deltanet_slots(p) * p.H * p.K * p.V, sf = tc ? dn_bf16_floats(p, states) : states;
    const std::int64_t xy = xb ? (rows * p.V + 1) / 2 : rows * p.V;  // X, Y: bf16 or fp32 (rows, V)
    S = take(sf), dS = take(sf), X = take(xy), Y = take(xy), dbp = take(vt * rows);
    h16 = tc && !p.hilo;
    const std::int64_t nh = p.l2 ? (h16 ? (rows * p.K + 1) / 2 : rows * p.K) : 0;
    xw = dqh = take(std::max(tc ? dn_bf16_floats(p, rows * p.K) : 0, nh));
    xu = dkh = take(std::max(tc ? (xu16 ? (rows * p.V + 1) / 2 : rows * p.V) : 0, nh));
    rk = take(tc ? rows : 0);
    T2 = take(tc && !p.wy_t2 ? rows * (p.hilo ? 64 : 32) : 0);  // T2^T rows: fp32, or bf16
    fac = take(tc ? 3 * rows : 0);
    if (xb) take((rows * p.K + 1) / 2);  // Q^ = s diag(rq) Q as bf16 (rows, K), the prep kernel's: at qh()
    total = o;
  }
};

}  // namespace fastweight::detail
