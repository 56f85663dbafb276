// Plain description of one attention call, shared by the host code (attention_cpu.cpp, which
// speaks torch) and the kernels (compiled once per instruction set, which do not).
//
// Tensors are logical (B, H, L, D) views with unit stride on the last dim and any other
// strides; a View carries the data pointer and the element strides of the batch, head and
// sequence dims. Query head h reads KV head h / (H / Hkv).
#pragma once

#include <cstdint>

#include "../mode_params.h"

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

struct AttnParams : ModeParams {  // the modes: ../mode_params.h
  DType dtype = DType::Float32;
  int64_t B = 0, H = 0, Hkv = 0, Lq = 0, Lk = 0, D = 0, Dv = 0;
  float scale = 1.f;
  // Key j is visible to query i iff j <= i + off (off: see ModeParams::top_left; Lk_b - Lq,
  // bottom-right per batch element, by default).
  bool causal = false;
  // (B,) int32 in [0, Lk], or nullptr when every key is visible.
  const int32_t* key_lengths = nullptr;

  View q, k, v;
  // Forward: written. Backward: read (delta = rowsum(dout * out)).
  MutView out;
  // float32, natural log, row (b, h, i) at lse[(b * H + h) * lse_sh + i]: (B, H, Lq) contiguous
  // (lse_sh = Lq, set by the host) or, for one packed sequence, its rows of the (1, H, Tq) tensor.
  // Forward writes it, backward reads it.
  float* lse = nullptr;
  int64_t lse_sh = 0;
  // The batch index the dropout hash sees for batch element b is b + hash_b0: 0, or the sequence
  // number when one packed sequence runs as a batch of one (sequence_params).
  int64_t hash_b0 = 0;

  // Backward only.
  View dout;
  MutView dq, dk, dv;
  // k and v are one tensor (float32): dk receives dK + dV, each rounded as stored and then added
  // (as autograd sums the two gradients of one tensor), and dv aliases dk.
  bool kv_sum = false;
};

// A dense fp32 product outside attention (csrc/cpu/products.cpp: the memorization trainer's
// products) on the attention kernels' micro-kernel: C[m, n] = sum_k A[m, k] B[k, n], each block
// of k (see kc) one chain of fused multiply-adds from zero and the blocks' sums added in order,
// then, with a bias, plus bias[(row0 + m) % period, n] (one rounded add). Element (m, k) of A is
// A[m * ars + k * acs], of B B[k * brs + n * bcs]; C and bias rows have unit stride.
// kc = 0: one block. kc > 0: K <= kc one block, K <= 2 kc two halves (K even), else blocks of kc
// with the remainder last (how MKL's sgemm splits k on the hosts measured).
struct DenseProduct {
  int64_t M = 0, N = 0, K = 0;
  const float* A = nullptr;
  int64_t ars = 0, acs = 0;
  const float* B = nullptr;
  int64_t brs = 0, bcs = 0;
  float* C = nullptr;
  int64_t ldc = 0;
  const float* bias = nullptr;
  int64_t bias_ld = 0, period = 1, row0 = 0;
  int64_t kc = 0;
};

// One instruction set's kernels. Both functions are deterministic: every output element is
// produced by one fixed sequence of operations whatever the thread count.
struct KernelTable {
  const char* isa;
  void (*forward)(const AttnParams&);
  void (*backward)(const AttnParams&);
  // The bf16 variants: one pair dot product step (vdpbf16ps or its model) on each of n lanes,
  // acc[i] += a[i] . b[i] (n a multiple of the vector width); nullptr in the plain tables.
  void (*dot_lanes)(float* acc, const uint32_t* a, const uint32_t* b, int64_t n) = nullptr;
  // ... and their rounding of fp32 into bf16 pairs (vcvtne2ps2bf16 or its model) on n lanes:
  // out[i] = (x[i], x[n + i]), or with `runs` (x[2 i], x[2 i + 1]).
  void (*round_lanes)(const float* x, uint32_t* out, int64_t n, bool runs) = nullptr;
  // A DenseProduct (set in the plain tables only).
  void (*dense)(const DenseProduct&) = nullptr;
};

// Defined by kernels_<isa>.cpp; the AVX variants exist only in x86-64 builds (see setup.py).
// Each plain table has a bf16 twin, <ISA>_BF16MODEL, whose bf16 products run on the software
// model of vdpbf16ps (kernel/bf16_dot.h); AVX512BF16 runs them on the instruction.
const KernelTable& kernels_DEFAULT();
const KernelTable& kernels_DEFAULT_BF16MODEL();
#ifdef MHAKERN_CPU_AVX2
const KernelTable& kernels_AVX2();
const KernelTable& kernels_AVX2_BF16MODEL();
#endif
#ifdef MHAKERN_CPU_AVX512
const KernelTable& kernels_AVX512();
const KernelTable& kernels_AVX512_BF16MODEL();
#endif
#ifdef MHAKERN_CPU_AVX512BF16
const KernelTable& kernels_AVX512BF16();
#endif

// The flex runtime tables (flex_runtime.h), defined beside the plain kernels.
namespace flex_rt {
struct Runtime;
}
const flex_rt::Runtime* flex_runtime_DEFAULT();
#ifdef MHAKERN_CPU_AVX2
const flex_rt::Runtime* flex_runtime_AVX2();
#endif
#ifdef MHAKERN_CPU_AVX512
const flex_rt::Runtime* flex_runtime_AVX512();
#endif

}  // namespace mhakern::cpu
