// bench_ops.h: the per-family rows of fastweight_bench beyond the norms (bench_mlstm.cpp,
// bench_deltanet.cpp).
#pragma once

#include <string>
#include <vector>

namespace fwbench {
struct GpuTimer;  // bench_util.h (CUDA builds)
}

struct BenchRow {
  std::string op, dtype, shape;
  double err, ms;
  std::string device;  // "cpu" (CPU tensors: the reference path) or "cuda" (CUDA tensors)
};

// How the family benches run: quick (fewer, smaller shapes); with a GPU timer (a GPU is present and
// --cpu was not given) also on CUDA tensors, timed like the norms (CUDA graph, L2 flushed, median
// of reps).
struct FamilyBench {
  bool quick = false;
  bool timing_only = false;  // GPU rows timed without the float64 check (A/B runs after CTest): err NaN
  int reps = 30;
  bool steps_only = false;   // the GPU decoding-step rows alone (A/B runs of the step kernels)
  int step_batch = 1;        // the step rows: steps per timed graph (GpuTimer::time_ms's batch)
  std::string mlstm_shapes;  // mLSTM GPU rows timed at these "BxNHxSxDQKxDV" shapes, '+'-separated (default: one)
  bool dn_wy_saved = true;   // DeltaNet: the timed forward writes wy_inverse and the backward reads it (training's way)
  fwbench::GpuTimer* timer = nullptr;
};

// Verifies every public mLSTM op against the float64 reference (src/reference/mlstm_ref.h) on fresh
// random inputs and times it on CPU tensors; with a GPU also mlstm_fwd and mlstm_bwd on CUDA tensors
// (bf16). Returns the number of failed verifications.
int run_mlstm_bench(const FamilyBench& fb, std::vector<BenchRow>& rows);

// The same for the public DeltaNet ops (fastweight/deltanet.h), against src/reference/deltanet_ref.h;
// on CUDA tensors deltanet_fwd (bf16, fixed length and varlen), the only DeltaNet op with a CUDA kernel.
int run_deltanet_bench(const FamilyBench& fb, std::vector<BenchRow>& rows);
