// Plain parameter structs of the CUDA attention kernels: pointers, strides, sizes. No torch and
// no CUDA header here, so the host code (which speaks torch) and the kernels (which do not)
// share one definition, as flash-attention's Flash_fwd_params does.
//
// Tensors are logical (B, H, L, D) with unit stride on D; every other stride is given in
// elements and may be anything that keeps 16-byte alignment of each row (the host checks).
// Query head h reads KV head h / group, group = H / Hkv (GQA; Hkv = 1 is MQA).
//
// Masking (all kernels): key j is visible to query i of batch element b iff
//     j < Lk_b  and, when causal,  j <= i + Lk_b - Lq        (bottom-right aligned)
// with Lk_b = key_lengths[b] (or Lk when key_lengths is null). A query row that sees no key
// gets output 0, lse = -inf and zero gradient.
#pragma once

#include <cstdint>

namespace mhakern {
namespace cuda {

constexpr float kLog2e = 1.4426950408889634f;  // the kernels exponentiate in base 2
constexpr float kLn2 = 0.6931471805599453f;

// Strides, in elements, of a logical (B, H, L, D) tensor whose D stride is 1.
struct HeadStrides {
  int64_t batch = 0;
  int64_t head = 0;
  int64_t row = 0;
};

struct FwdParams {
  const void* q = nullptr;  // (B, H, Lq, D)
  const void* k = nullptr;  // (B, Hkv, Lk, D)
  const void* v = nullptr;  // (B, Hkv, Lk, D)
  void* o = nullptr;        // (B, H, Lq, D), input dtype
  float* lse = nullptr;     // (B, H, Lq) contiguous, natural log
  const int32_t* key_lengths = nullptr;  // (B,) or null
  HeadStrides q_stride, k_stride, v_stride, o_stride;

  int B = 0, H = 0, Hkv = 0, Lq = 0, Lk = 0, D = 0;
  int group = 1;            // H / Hkv
  float scale = 1.f;        // multiplies q.k
  float scale_log2 = 1.f;   // scale * log2(e): the kernels work in base 2
  bool causal = false;

  // Split-K: the key range is cut into num_splits chunks of whole key blocks; each chunk writes
  // its normalised partial output and lse, and a combine kernel merges them through their lse.
  int num_splits = 1;
  float* o_partial = nullptr;    // (num_splits, B, H, Lq, D) fp32, used when num_splits > 1
  float* lse_partial = nullptr;  // (num_splits, B, H, Lq) fp32, used when num_splits > 1
};

struct BwdParams {
  const void* q = nullptr;     // (B, H, Lq, D)
  const void* k = nullptr;     // (B, Hkv, Lk, D)
  const void* v = nullptr;     // (B, Hkv, Lk, D)
  const void* o = nullptr;     // (B, H, Lq, D) forward output
  const void* dout = nullptr;  // (B, H, Lq, D)
  const float* lse = nullptr;  // (B, H, Lq) contiguous, natural log (-inf for rows with no key)
  const int32_t* key_lengths = nullptr;
  void* dq = nullptr;          // (B, H, Lq, D)
  void* dk = nullptr;          // (B, Hkv, Lk, D), summed over the query heads of the group
  void* dv = nullptr;          // (B, Hkv, Lk, D)
  float* delta = nullptr;      // workspace (B, H, Lq): rowsum(dout * o)
  HeadStrides q_stride, k_stride, v_stride, o_stride, do_stride;
  HeadStrides dq_stride, dk_stride, dv_stride;

  int B = 0, H = 0, Hkv = 0, Lq = 0, Lk = 0, D = 0;
  int group = 1;
  float scale = 1.f;
  float scale_log2 = 1.f;
  bool causal = false;

  // Split-K of the dq kernel (long keys): each split writes an fp32 partial dq, and a reduce
  // kernel adds the partials in split order (deterministic).
  int num_splits = 1;
  float* dq_partial = nullptr;  // (num_splits, B, H, Lq, D) fp32, used when num_splits > 1
};

}  // namespace cuda
}  // namespace mhakern
