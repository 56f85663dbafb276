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
  // Packed variable-length sequences (docs/contract.md, "Packed sequences"). q, k, v are one batch
  // element (B = 1, the params' Lq / Lk are the token counts Tq / Tk); sequence s holds the query
  // tokens cu_seqlens_q[s] .. cu_seqlens_q[s + 1] - 1 and the key tokens cu_seqlens_k[s] ..
  // cu_seqlens_k[s + 1] - 1 (int32 prefix sums, num_seqs + 1 entries, first 0, last Tq / Tk, each
  // length at most max_seqlen_q / max_seqlen_k). Within a sequence everything is as for batch
  // element s of a dense call of lengths (Lq_s, Lk_s): local positions i, j, the causal offset
  // Lk_s - Lq_s (bottom-right), the dropout hash and the ALiBi slope of (s, h); lse and out rows are
  // the query tokens. nullptr: no packing.
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  int64_t num_seqs = 0, max_seqlen_q = 0, max_seqlen_k = 0;
  // KV cache addressing (forward only). kv_batch_idx: the K/V batch row that batch element b reads
  // (int32 (B,), values in [0, k.size(0))); nullptr: row b.
  const int32_t* kv_batch_idx = nullptr;
  // Paged K/V: k, v are (num_pages, Hkv, page_size, D) and key j of batch element b lives in page
  // block_table[b * block_table_stride + j / page_size], row j % page_size; the logical key length
  // (the params' Lk, set by the host: op::paged_key_len) is pages_per_seq * page_size, and
  // key_lengths (the cache's fill per batch element) hides the rest. nullptr: dense K/V.
  const int32_t* block_table = nullptr;
  int64_t block_table_stride = 0, page_size = 0;
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
