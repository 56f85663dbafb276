// Plain description of one attention call, shared by the host code (attention_cpu.cpp, which
// speaks torch) and the kernels (compiled once per instruction set, which do not).
//
// Tensors are logical (B, H, L, D) views with unit stride on the last dim and any other
// strides; a View carries the data pointer and the element strides of the batch, head and
// sequence dims. Query head h reads KV head h / (H / Hkv).
#pragma once

#include <cstdint>

namespace mhakern::cpu {

enum class DType : int { Float32 = 0, BFloat16 = 1, Float16 = 2 };

struct View {
  const void* ptr = nullptr;
  int64_t sb = 0, sh = 0, sl = 0;
};

struct MutView {
  void* ptr = nullptr;
  int64_t sb = 0, sh = 0, sl = 0;
};

struct AttnParams {
  DType dtype = DType::Float32;
  int64_t B = 0, H = 0, Hkv = 0, Lq = 0, Lk = 0, D = 0, Dv = 0;
  float scale = 1.f;
  // Bottom-right aligned per batch element: key j is visible to query i iff
  // j <= i + Lk_b - Lq (Lk_b: that element's key length).
  bool causal = false;
  // (B,) int32 in [0, Lk], or nullptr when every key is visible.
  const int32_t* key_lengths = nullptr;
  // Modes (docs/contract.md). Visibility: see the contract; off = top_left ? 0 : Lk_b - Lq.
  bool top_left = false;
  int64_t window_left = -1, window_right = -1;   // -1 = unbounded
  // attn_mask: nullptr or a (B, H, Lq, Lk) view with element strides (0 on broadcast dims).
  const void* mask = nullptr;
  int mask_kind = 0;            // 0 none, 1 bool (uint8/bool bytes, nonzero = visible), 2 additive float32
  int64_t mask_sb = 0, mask_sh = 0, mask_sq = 0, mask_sk = 0;
  float* dmask = nullptr;       // backward: (B, H, Lq, Lk) contiguous float32 dL/dscore, or nullptr
  float dropout_p = 0.f;
  uint64_t seed = 0;

  View q, k, v;
  // Forward: written. Backward: read (delta = rowsum(dout * out)).
  MutView out;
  // (B, H, Lq) contiguous float32, natural log; forward writes it, backward reads it.
  float* lse = nullptr;

  // Backward only.
  View dout;
  MutView dq, dk, dv;
};

// One instruction set's kernels. Both functions are deterministic: every output element is
// produced by one fixed sequence of operations whatever the thread count.
struct KernelTable {
  const char* isa;
  void (*forward)(const AttnParams&);
  void (*backward)(const AttnParams&);
};

// Defined by kernels_<isa>.cpp; the AVX variants exist only in x86-64 builds (see setup.py).
const KernelTable& kernels_DEFAULT();
#ifdef MHAKERN_CPU_AVX2
const KernelTable& kernels_AVX2();
#endif
#ifdef MHAKERN_CPU_AVX512
const KernelTable& kernels_AVX512();
#endif

}  // namespace mhakern::cpu
