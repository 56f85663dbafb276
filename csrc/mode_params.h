// The optional attention modes of one call (docs/contract.md), as every kernel family's
// parameter struct carries them: the cpu AttnParams and the cuda FwdParams / BwdParams derive
// from this one definition, and op_common.h's fill_mode_params fills it. Plain C++: no torch
// and no CUDA header, so nvcc, the CPU kernels (compiled once per instruction set) and the host
// code all include it.
#pragma once

#include <cstdint>

namespace mhakern {

struct ModeParams {
  // Causal and window offset: off = top_left ? 0 : Lk_b - Lq (bottom-right, the default).
  bool top_left = false;
  int64_t window_left = -1, window_right = -1;  // -1 = unbounded
  // attn_mask: nullptr or a (B, H, Lq, Lk) view with element strides (0 on broadcast dims).
  const void* mask = nullptr;
  int mask_kind = 0;  // 0 none, 1 bool (uint8/bool bytes, nonzero = visible), 2 additive float32
  int64_t mask_sb = 0, mask_sh = 0, mask_sq = 0, mask_sk = 0;
  float* dmask = nullptr;  // backward: (B, H, Lq, Lk) contiguous float32 dL/dscore, or nullptr
  // double: the keep threshold floor(p * 2^32) must equal the reference's exactly.
  double dropout_p = 0.0;
  uint64_t seed = 0;
};

}  // namespace mhakern
