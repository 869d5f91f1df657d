// bench_mlstm.h: the mLSTM rows of fastweight_bench (bench_mlstm.cpp).
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
