// Plain parameter structs of the CUDA attention kernels: pointers, strides, sizes. No torch and
// no CUDA header here, so the host code (which speaks torch) and the kernels (which do not)
// share one definition, as flash-attention's Flash_fwd_params does.
//
// Tensors are logical (B, H, L, D) with unit stride on D; every other stride is given in
// elements and may be anything that keeps 16-byte alignment of each row (the host checks).
// Query head h reads KV head h / group, group = H / Hkv (GQA; Hkv = 1 is MQA).
//
// Masking (all kernels): key j is visible to query i of batch element b as docs/contract.md
// ("Visibility") defines it: j < Lk_b, with Lk_b = key_lengths[b] clamped into [0, Lk] (or Lk
// when key_lengths is null), and the causal and window bounds around the diagonal i + off
// (off = 0 top-left, Lk_b - Lq bottom-right); primitives.cuh's Visibility computes each row's
// key range from these fields. A query row that sees no key gets output 0, lse = -inf and zero
// gradient. The modes the kernels implement are capabilities.h's kCudaFeatures; the host
// refuses the others by name.
//
// make_fwd_params / make_bwd_params fill the structs from plain operand descriptions; the host
// code (cuda_host.cpp, from tensors) and the CPU emulation (tests/cuda_emulator/emu_entry.cpp, from raw
// pointers) both call them, so the two cannot fill them differently.
#pragma once

#include <cstdint>

#include "../../capabilities.h"
#include "../../mode_params.h"

#if defined(__CUDACC__)
#define MHK_PARAMS_HD __host__ __device__ __forceinline__
#else
#define MHK_PARAMS_HD inline
#endif

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

struct FwdParams : ModeParams {  // the modes: ../mode_params.h
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

struct BwdParams : ModeParams {  // the modes: ../mode_params.h
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

  // The mma.sync family's backward kernel (capabilities.h CudaBwdKernel) and the fused kernel's
  // zeroed workspace: dq_accum (B, H, Lq, D) fp32, dq_counters (cuda_fused_bwd_counters).
  int bwd_kernel = 0;
  float* dq_accum = nullptr;
  uint32_t* dq_counters = nullptr;
};

// Whether a call runs the kernels' kModes instantiations (attn_fwd_modes_kernel and the
// backward's *_modes kernels): attn_mask, dropout, a score modifier (softcap, ALiBi), packed
// sequences or the KV cache's addressing (forward only). Windows, top-left causal and key
// lengths are in every kernel's Visibility masking.
template <typename Params>
MHK_PARAMS_HD bool needs_modes_kernel(const Params& p) {
  return p.mask != nullptr || p.dropout_p > 0.0 || p.softcap > 0.f || p.alibi != nullptr || p.cu_seqlens_q != nullptr ||
         p.kv_batch_idx != nullptr || p.block_table != nullptr;
}

// The modes of docs/contract.md a call's parameters use, as capabilities.h feature bits: what a
// kernel family must serve (its features in capabilities.h) to be given the call.
inline unsigned mode_features_of(const ModeParams& p) {
  unsigned f = 0;
#define MHK_PARAM_FEATURE_(bit, test) \
  if (test) f |= caps::bit;
  MHK_MODE_PARAM_FEATURE_TESTS(MHK_PARAM_FEATURE_)
#undef MHK_PARAM_FEATURE_
  return f;
}

// The key length of batch element b, clamped into [0, Lk]: a length out of range (which the host
// refuses where it can read the values) must never make a kernel read outside k and v.
template <typename Params>
MHK_PARAMS_HD int key_length_of(const Params& p, int b) {
  if (p.key_lengths == nullptr) return p.Lk;
  const int n = p.key_lengths[b];
  return n < 0 ? 0 : (n > p.Lk ? p.Lk : n);
}

// The tokens of sequence s of a packed call (ModeParams::cu_seqlens_q / _k; p.Lq, p.Lk are the
// token counts Tq, Tk): queries [q0, q0 + Lq), keys [k0, k0 + Lk). Clamped so that no value of
// cu_seqlens (which the host checks only where it can read them: op_common.h
// check_packing_values) makes a kernel address a token outside q, k, v, or a row past the grid,
// which covers max_seqlen_q / max_seqlen_k per sequence.
struct SeqTokens {
  int q0, Lq, k0, Lk;
};
MHK_PARAMS_HD int clamp_int(int64_t x, int64_t lo, int64_t hi) {  // lo wins over a hi below it
  x = x > hi ? hi : x;
  return static_cast<int>(x < lo ? lo : x);
}
template <typename Params>
MHK_PARAMS_HD SeqTokens seq_tokens(const Params& p, int s) {
  SeqTokens t;
  t.q0 = clamp_int(p.cu_seqlens_q[s], 0, p.Lq);
  t.Lq = clamp_int(static_cast<int64_t>(p.cu_seqlens_q[s + 1]) - t.q0, 0,
                   p.max_seqlen_q < p.Lq - t.q0 ? p.max_seqlen_q : p.Lq - t.q0);
  t.k0 = clamp_int(p.cu_seqlens_k[s], 0, p.Lk);
  t.Lk = clamp_int(static_cast<int64_t>(p.cu_seqlens_k[s + 1]) - t.k0, 0,
                   p.max_seqlen_k < p.Lk - t.k0 ? p.max_seqlen_k : p.Lk - t.k0);
  return t;
}

// One (B, H, L, D) operand as the kernels see it: its data and its (batch, head, row) strides.
struct Operand {
  const void* ptr = nullptr;
  HeadStrides stride;
};

// The sizes of one call (checked by the caller: H a multiple of Hkv, the limits of
// capabilities.h, so every value fits an int).
struct CallSizes {
  int64_t B = 0, H = 0, Hkv = 0, Lq = 0, Lk = 0, D = 0;
};

template <typename Params>
void fill_sizes(Params& p, const CallSizes& s, float scale, bool causal, const int32_t* key_lengths, int num_splits) {
  p.B = static_cast<int>(s.B);
  p.H = static_cast<int>(s.H);
  p.Hkv = static_cast<int>(s.Hkv);
  p.Lq = static_cast<int>(s.Lq);
  p.Lk = static_cast<int>(s.Lk);
  p.D = static_cast<int>(s.D);
  p.group = static_cast<int>(s.H / s.Hkv);
  p.scale = scale;
  p.scale_log2 = scale * kLog2e;
  p.causal = causal;
  p.key_lengths = key_lengths;
  p.num_splits = num_splits;
}

// Forward: o is written, lse (B, H, Lq) contiguous. o_partial / lse_partial: the split-K
// workspaces, needed when num_splits > 1.
inline FwdParams make_fwd_params(const CallSizes& s, Operand q, Operand k, Operand v, Operand o, float* lse,
                                 const int32_t* key_lengths, float scale, bool causal, int num_splits,
                                 float* o_partial, float* lse_partial) {
  FwdParams p;
  p.q = q.ptr;
  p.k = k.ptr;
  p.v = v.ptr;
  p.o = const_cast<void*>(o.ptr);
  p.lse = lse;
  p.q_stride = q.stride;
  p.k_stride = k.stride;
  p.v_stride = v.stride;
  p.o_stride = o.stride;
  fill_sizes(p, s, scale, causal, key_lengths, num_splits);
  p.o_partial = o_partial;
  p.lse_partial = lse_partial;
  return p;
}

// Backward: dq, dk, dv are written; delta (B, H, Lq) is a workspace; dq_partial the split-K
// workspace of the dq kernel, needed when num_splits > 1.
inline BwdParams make_bwd_params(const CallSizes& s, Operand dout, Operand q, Operand k, Operand v, Operand o,
                                 const float* lse, Operand dq, Operand dk, Operand dv, float* delta,
                                 const int32_t* key_lengths, float scale, bool causal, int num_splits,
                                 float* dq_partial) {
  BwdParams p;
  p.q = q.ptr;
  p.k = k.ptr;
  p.v = v.ptr;
  p.o = o.ptr;
  p.dout = dout.ptr;
  p.lse = lse;
  p.dq = const_cast<void*>(dq.ptr);
  p.dk = const_cast<void*>(dk.ptr);
  p.dv = const_cast<void*>(dv.ptr);
  p.delta = delta;
  p.q_stride = q.stride;
  p.k_stride = k.stride;
  p.v_stride = v.stride;
  p.o_stride = o.stride;
  p.do_stride = dout.stride;
  p.dq_stride = dq.stride;
  p.dk_stride = dk.stride;
  p.dv_stride = dv.stride;
  fill_sizes(p, s, scale, causal, key_lengths, num_splits);
  p.dq_partial = dq_partial;
  return p;
}

}  // namespace cuda
}  // namespace mhakern
