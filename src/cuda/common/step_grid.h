// step_grid.h: the decoding steps' grid order (cuda/common/step_grid.cuh), for tests and fastweight_bench
// (--step-tile-major=on|off): true (the default) a head's column tiles side by side, false heads
// fastest. Returns the previous setting. Same bits either way.
#pragma once

namespace fastweight::detail {
bool set_step_tile_major(bool on);
}  // namespace fastweight::detail
