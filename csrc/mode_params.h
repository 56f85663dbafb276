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
  // Score modifiers (docs/contract.md, "Score modifiers"), in the order a score meets them:
  //   s = scale * q.k;  s = softcap * tanh(s / softcap) when softcap > 0;
  //   s += -slope(b, h) * |i + off - j| when alibi (off as for causal: top_left ? 0 : Lk_b - Lq);
  //   then the additive mask. The backward chains through the cap: dS_pre = dS * (1 - tanh^2),
  //   and dmask is dS (the gradient at the capped score, where the mask is added).
  float softcap = 0.f;          // 0 = off
  const float* alibi = nullptr;  // float32 slopes, slope(b, h) = alibi[b * alibi_sb + h * alibi_sh]
  int64_t alibi_sb = 0, alibi_sh = 0;  // element strides (alibi_sb 0: one slope per head)
};

// The dropout counter hash of docs/contract.md, written once for the cpu and cuda families
// (Triton and the Python reference restate it in their languages): keep(b, h, i, j) iff
// mix32(r_i + j) >= threshold, r_i = dropout_row_hash(seed, b * H + h, i), h the query head,
// all modulo 2^32. Host and device: nvcc compiles these for both, every other compiler as inline.
#if defined(__CUDACC__) && !defined(MHAKERN_CUDA_EMULATE)
#define MHK_MODES_HD __host__ __device__ __forceinline__
#else
#define MHK_MODES_HD inline
#endif

// The lowbias32 finaliser.
MHK_MODES_HD uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x21F0AAADu;
  x ^= x >> 15;
  x *= 0x735A2D97u;
  x ^= x >> 15;
  return x;
}

// r_i for query row i of the (batch element, query head) pair bh = b * H + h.
MHK_MODES_HD uint32_t dropout_row_hash(uint64_t seed, uint32_t bh, uint32_t i) {
  const uint32_t lo = static_cast<uint32_t>(seed), hi = static_cast<uint32_t>(seed >> 32);
  return mix32(mix32(lo ^ mix32(hi ^ bh)) ^ i);
}

// min(floor(p * 2^32), 2^32 - 1), computed in double exactly as the reference does.
MHK_MODES_HD uint32_t dropout_threshold(double p) {
  const double t = p * 4294967296.0;
  return t >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(t);
}

}  // namespace mhakern
