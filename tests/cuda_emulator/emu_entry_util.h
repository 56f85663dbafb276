// Helpers of the emulator's C entry points (emu_entry.cpp, emu_sm90_entry.cpp): an operand from
// a raw pointer and its (batch, head, row) element strides, a call's modes, and a launcher's
// status folded with the emulator's error state (0 ok, 1 with mhk_emu_last_error()).
#pragma once

#include <cstdint>
#include <string>

#include "common/attn_params.h"
#include "cuda_emu.h"

namespace mhk_emu {

inline mhakern::cuda::Operand operand(const void* ptr, const int64_t* s) {
  mhakern::cuda::Operand o;
  o.ptr = ptr;
  o.stride.batch = s[0];
  o.stride.head = s[1];
  o.stride.row = s[2];
  return o;
}

// The mode fields of a kernel's parameters (the ModeParams base of FwdParams / BwdParams) from
// the caller's struct, filled as op_common.h's fill_mode_params fills it; null: no mode.
inline void set_modes(mhakern::ModeParams& p, const mhakern::ModeParams* modes) {
  if (modes != nullptr) p = *modes;
}

inline int finish(cudaError_t err) {
  if (err != cudaSuccess && state().error.empty()) fail("launcher returned error " + std::to_string(static_cast<int>(err)));
  return state().error.empty() ? 0 : 1;
}

}  // namespace mhk_emu
