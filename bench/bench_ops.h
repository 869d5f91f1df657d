// bench_ops.h: the per-family rows of fastweight_bench beyond the norms (bench_mlstm.cpp,
// bench_deltanet.cpp).
#pragma once

#include <string>
#include <vector>

struct BenchRow {
  std::string op, dtype, shape;
  double err, ms;
  std::string device;
};

// Verifies every public mLSTM op against the float64 reference (src/reference/mlstm_ref.h) on fresh
// random inputs and times it. Until the CUDA kernels are dispatched (issue 3) the ops run on CPU
// tensors, so this times the reference path. Returns the number of failed verifications.
int run_mlstm_bench(bool quick, std::vector<BenchRow>& rows);

// The same for the public DeltaNet ops (fastweight/deltanet.h), against src/reference/deltanet_ref.h.
int run_deltanet_bench(bool quick, std::vector<BenchRow>& rows);
