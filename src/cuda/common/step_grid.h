// step_grid.h: the decoding steps' grid order (cuda/common/step_grid.cuh), for tests and fastweight_bench
// (--step-tile-major=on|off): true (the default) a head's column tiles side by side, false heads
// fastest. Returns the previous setting. Same bits either way.
#pragma once

namespace fastweight::detail {
bool set_step_tile_major(bool on);
// The decoding steps' fp32 state rows stored as 16-byte vectors (one st.global.v4.f32 a thread and row)
// instead of the four 4-byte stores nvcc made of them (fastweight_bench --step-vec-stores=off). Default
// on (H100, session 31, step ms against the 4-byte stores: mLSTM 1.000 / 0.974 / 0.995 / 1.010 and
// DeltaNet 1.000 / 0.923 / 0.982 / 0.990 at B = 1 / 8 / 64 / 256). Same bits. Returns the previous setting.
bool set_step_vector_stores(bool on);
}  // namespace fastweight::detail
