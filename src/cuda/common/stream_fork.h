// stream_fork.h: one call's fork of work onto the side stream (side_stream()) and its join.
#pragma once

#include <cuda_runtime.h>

#include "cuda/common/check.cuh"

namespace fastweight::detail {

// The side stream first waits for everything before the fork on the caller's stream; done() marks
// the end of the side work (an event the caller's stream, or a later kernel's launcher, waits for).
// Events are per call (shared ones could be re-recorded by another host thread between a record and
// its wait). The destructor makes the caller's stream wait for the side work (a no-op after an
// explicit wait; the join on every path, an early return or a throw included) and releases the events.
struct StreamFork {
  const char* op;
  cudaStream_t main, side;
  cudaEvent_t e[3] = {nullptr, nullptr, nullptr};  // fork, done, mark
  StreamFork(const char* op_, cudaStream_t m) : op(op_), main(m), side(side_stream()) {
    try {
      for (auto& x : e) FW_CUDA_CHECK(op, cudaEventCreateWithFlags(&x, cudaEventDisableTiming));
      FW_CUDA_CHECK(op, cudaEventRecord(e[0], main));
      FW_CUDA_CHECK(op, cudaStreamWaitEvent(side, e[0], 0));
    } catch (...) {
      release();  // (no destructor runs for a constructor that throws; nothing was forked)
      throw;
    }
  }
  bool recorded = false;  // done() ran
  void* done() {
    FW_CUDA_CHECK(op, cudaEventRecord(e[1], side));
    recorded = true;
    return e[1];
  }
  // A point of the side work so far (one per fork), for a launcher on the caller's stream that needs
  // only that part of it
  void* mark() {
    FW_CUDA_CHECK(op, cudaEventRecord(e[2], side));
    return e[2];
  }
  void release() {
    for (auto& x : e)
      if (x) (void)cudaEventDestroy(x), x = nullptr;
  }
  ~StreamFork() {
    if (e[1]) {
      // a throw between the fork and done() (side work already queued): end the side work here, so
      // that the join still waits for it (an event never recorded is no wait at all)
      if (!recorded) (void)cudaEventRecord(e[1], side);
      (void)cudaStreamWaitEvent(main, e[1], 0);
    }
    release();
  }
  StreamFork(const StreamFork&) = delete;
  StreamFork& operator=(const StreamFork&) = delete;
};

}  // namespace fastweight::detail
