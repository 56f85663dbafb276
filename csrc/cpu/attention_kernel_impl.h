// The fused CPU attention kernels. This header is compiled once per instruction set by
// kernels_<isa>.cpp, which defines CPU_CAPABILITY (and CPU_CAPABILITY_<ISA>) first, so ATen's
// Vectorized<float> is the AVX-512, AVX2 or portable one and everything here lands in the
// namespace mhakern::cpu::<ISA>; the host code picks one table at run time.
//
// Algorithm (exact attention, FlashAttention-2 style, fp32 accumulation whatever the input):
// * A task owns a block of query rows: either up to kRowBlock queries of one head, or, when
//   Lq is small (decode), the same queries of all the query heads that share a KV head, so each
//   key block is read once for all of them. Rows live in the columns of transposed scratch
//   tiles (Q^T: D x Rp), so the softmax statistics of a row block are plain vectors and the
//   score tile is S^T = K_blk * Q^T: K and V are read in place (no transposition, no copy for
//   fp32) as the broadcast operand of a register-blocked micro-kernel.
// * Forward: online softmax over key blocks in base 2 (scale * log2(e) folded into Q), the
//   output accumulated as O^T = V_blk^T * P^T; lse = (m + log2 l) * ln 2. Long key ranges with
//   few row blocks are split into key ranges whose normalised partials are merged by lse.
//   A short fp32 row block that would fill few of its padded row lanes (17-24 rows in 16-float
//   vectors) and sees every key of its range runs key-major tiles instead (S = Q K_blk^T, the
//   keys as lanes, O as rows; kernel/forward.h forward_key_tiles), with the same bits.
// * Backward: a task owns (batch, KV head, key range): it gathers all the query rows of the
//   heads sharing the KV head once, then for each key block recomputes P from lse and
//   accumulates dV, dK for the block (owned: no atomics) and dQ for the rows; with several
//   key ranges, dQ partials are summed in a fixed order.
// Memory: a thread's scratch is a few tiles, plus in the backward the gathered rows of one KV
// head's query heads (about 5 * rows * D floats); split partials stay within kPartialBudget.
// Nothing grows with Lk, so 2^22 keys and more run in bounded memory.
// Modes (docs/contract.md): causal alignment, windows and key lengths give each row a range of
// visible keys [lo, hi) (row_range); key blocks outside the union of a row block's ranges are
// skipped and only blocks cut by some range are masked, so the unmasked path does no per-score
// work. attn_mask (bool or additive float32, read in place through its strides) is applied to
// each score tile. Dropout multiplies the probabilities by a keep mask that is a pure hash of
// (seed, b, h, i, j), regenerated in the backward. A row that sees nothing gets out 0, lse -inf
// and zero gradients; an inf or NaN in a visible input spreads as in the plain math, and tiles
// where a hidden pair meets an inf or NaN operand are computed pair by pair so that hidden
// positions never influence anything.
// Score modifiers (docs/contract.md): softcap and ALiBi act on each score tile right after its
// product, before any mask (kernel/modes.h, apply_score_mods); the backward keeps the cap's
// derivative per pair. A call without them runs the code it ran before they existed (a template
// flag in the forward, a per-tile branch in the backward).
// Every decomposition depends on the shapes only, never on the thread count, so results are
// bitwise reproducible.
//
// The pieces, one concept a file, under kernel/ (each includes what it stands on):
//   common.h    vector type, constants, index helpers, per-thread scratch
//   vec_math.h  2^x, row conversions, loads and stores, dot, prefetch, transposes
//   gemm.h      the register-blocked fp32 GEMM every product goes through
//   plan.h      block sizes, row blocks, key-range splits (shape-only)
//   modes.h     visible key ranges, dropout, attn_mask, the pairwise fallback
//   forward.h   the forward (online softmax, split merge, task loop)
//   backward.h  the backward (gather, per key block steps, dQ, task loop)
//   dense.h     dense products outside attention (../products.cpp) on the same micro-kernel
//   flex_runtime_impl.h  mhakern.flex_attention's modifier-independent steps (../flex_runtime.h)
// This file adds the entry points of the instruction set and the table that names them.
#pragma once

#ifndef CPU_CAPABILITY
#error "define CPU_CAPABILITY (and CPU_CAPABILITY_<ISA>) before including attention_kernel_impl.h"
#endif

#include "kernel/backward.h"
#include "kernel/forward.h"
#include "kernel/dense.h"
#include "kernel/flex_runtime_impl.h"

#include <type_traits>
#include <vector>

namespace mhakern::cpu {
namespace CPU_CAPABILITY {

// Packed sequences (ModeParams::cu_seqlens_q): sequence s is exactly batch element s of a dense
// call of lengths (Lq_s, Lk_s), so it runs as the dense call of one batch element over views that
// start at its first tokens: local positions, its causal offset, the dropout hash of (s, h) and
// the ALiBi slopes of row s follow, and no view reaches another sequence's tokens. Each sequence's
// decomposition is the dense one of its lengths (a function of the shapes), so the result is
// deterministic (for_each_sequence schedules them).
template <typename V>
inline V shift_rows(V x, int64_t rows, int64_t elem) {
  using Ptr = std::conditional_t<std::is_const_v<std::remove_pointer_t<decltype(x.ptr)>>, const char*, char*>;
  x.ptr = static_cast<Ptr>(x.ptr) + rows * x.sl * elem;
  return x;
}

inline AttnParams sequence_params(const AttnParams& p, int64_t s) {
  const int64_t elem = p.dtype == DType::Float32 ? 4 : 2;
  const int64_t q0 = p.cu_seqlens_q[s], k0 = p.cu_seqlens_k[s];
  AttnParams ps = p;
  ps.cu_seqlens_q = ps.cu_seqlens_k = nullptr;
  ps.num_seqs = 0;
  ps.B = 1;
  ps.Lq = p.cu_seqlens_q[s + 1] - q0;
  ps.Lk = p.cu_seqlens_k[s + 1] - k0;
  ps.q = shift_rows(p.q, q0, elem);
  ps.out = shift_rows(p.out, q0, elem);
  ps.dout = shift_rows(p.dout, q0, elem);
  ps.dq = shift_rows(p.dq, q0, elem);
  ps.k = shift_rows(p.k, k0, elem);
  ps.v = shift_rows(p.v, k0, elem);
  ps.dk = shift_rows(p.dk, k0, elem);
  ps.dv = shift_rows(p.dv, k0, elem);
  ps.lse = p.lse + q0;  // head stride stays the packed tensor's (lse_sh = Tq)
  ps.hash_b0 = s;
  if (p.alibi) ps.alibi = p.alibi + s * p.alibi_sb;
  return ps;
}

// Runs run(s) for every sequence: a sequence with at least a thread's share of the work runs
// alone over all threads; the others are spread over the threads, one sequence to a thread
// (at::parallel_for inside a parallel region runs inline). Only the scheduling depends on the
// thread count: each sequence's result is that of its own shape-only decomposition, so bitwise
// the same either way, and short sequences do not pay a fork and join each.
template <typename Run>
void for_each_sequence(const AttnParams& p, const Run& run) {
  auto work = [&](int64_t s) {
    return (p.cu_seqlens_q[s + 1] - p.cu_seqlens_q[s] + 1) * (p.cu_seqlens_k[s + 1] - p.cu_seqlens_k[s] + 1);
  };
  int64_t total = 0;
  for (int64_t s = 0; s < p.num_seqs; ++s) total += work(s);
  const int64_t threads = std::max(at::get_num_threads(), 1);
  std::vector<int64_t> small;
  for (int64_t s = 0; s < p.num_seqs; ++s) {
    if (work(s) * threads >= total)
      run(s);
    else
      small.push_back(s);
  }
  at::parallel_for(0, static_cast<int64_t>(small.size()), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) run(small[i]);
  });
}

template <typename T>
void forward_any(const AttnParams& p) {
  if (p.cu_seqlens_q == nullptr) return forward_impl<T>(p);
  for_each_sequence(p, [&](int64_t s) { forward_impl<T>(sequence_params(p, s)); });
}

template <typename T>
void backward_any(const AttnParams& p) {
  if (p.cu_seqlens_q == nullptr) return backward_impl<T>(p);
  // A sequence without queries zeroes its keys' dK, dV; without keys, its rows' dQ.
  for_each_sequence(p, [&](int64_t s) { backward_impl<T>(sequence_params(p, s)); });
}

// The forward of bf16 inputs with the pair products of bf16_dot.h (Dot: DotHw or DotModel).
template <typename Dot>
void forward_pairs(const AttnParams& p) {
  TORCH_INTERNAL_ASSERT(p.dtype == DType::BFloat16, "mhakern cpu kernel: the bf16 variant takes bf16 inputs");
  if (p.cu_seqlens_q == nullptr) return forward_impl<c10::BFloat16, Dot>(p);
  for_each_sequence(p, [&](int64_t s) { forward_impl<c10::BFloat16, Dot>(sequence_params(p, s)); });
}

template <typename Dot>
void backward_pairs(const AttnParams& p) {
  TORCH_INTERNAL_ASSERT(p.dtype == DType::BFloat16, "mhakern cpu kernel: the bf16 variant takes bf16 inputs");
  if (p.cu_seqlens_q == nullptr) return backward_impl<c10::BFloat16, Dot>(p);
  for_each_sequence(p, [&](int64_t s) { backward_impl<c10::BFloat16, Dot>(sequence_params(p, s)); });
}

// Entry points of this instruction set.
inline void forward(const AttnParams& p) {
  switch (p.dtype) {
    case DType::Float32: return forward_any<float>(p);
    case DType::BFloat16: return forward_any<c10::BFloat16>(p);
    case DType::Float16: return forward_any<c10::Half>(p);
  }
}

inline void backward(const AttnParams& p) {
  switch (p.dtype) {
    case DType::Float32: return backward_any<float>(p);
    case DType::BFloat16: return backward_any<c10::BFloat16>(p);
    case DType::Float16: return backward_any<c10::Half>(p);
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace mhakern::cpu

// Defines mhakern::cpu::kernels_<ISA>() returning this instruction set's table.
#define MHAKERN_DEFINE_KERNEL_TABLE(ISA)                                                   \
  namespace mhakern::cpu {                                                                \
  const KernelTable& kernels_##ISA() {                                                    \
    static const KernelTable table{#ISA, &ISA::forward, &ISA::backward, nullptr, nullptr, &ISA::dense_product}; \
    return table;                                                                         \
  }                                                                                       \
  }

// Defines mhakern::cpu::kernels_<NAME>(): the bf16 variant (bf16 inputs only) on pair dot
// product DOT (DotHw, or DotModel: the software model of vdpbf16ps) in instruction set ISA.
#define MHAKERN_DEFINE_BF16_TABLE(NAME, ISA, DOT)                                          \
  namespace mhakern::cpu {                                                                \
  const KernelTable& kernels_##NAME() {                                                   \
    static const KernelTable table{#NAME, &ISA::forward_pairs<ISA::DOT>, &ISA::backward_pairs<ISA::DOT>, \
                                   &ISA::dot_pairs_lanes<ISA::DOT>, &ISA::round_pairs_lanes<ISA::DOT>}; \
    return table;                                                                         \
  }                                                                                       \
  }
