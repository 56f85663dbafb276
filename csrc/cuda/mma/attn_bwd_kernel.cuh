// Fused attention backward on tensor cores (FlashAttention-2 scheme), deterministic: no atomics.
//
// With P = softmax recomputed from the saved lse, dS = P o (dP - delta), dP = dO V^T and
// delta = rowsum(dO o O):
//   dV = P^T dO,  dK = scale * dS^T Q,  dQ = scale * dS K.
// Three kernels, in stream order:
//   attn_bwd_delta_kernel  delta for every query row (one warp per row; ../common/aux_kernels.cuh).
//   attn_bwd_dkdv_kernel   one CTA per (key block of 64, kv head, batch element); each warp owns
//                          16 keys and walks every packed query row of the group (all query
//                          heads that share the KV head) in a fixed order, so dK and dV are
//                          summed over the group in registers, without atomics.
//   attn_bwd_dq_kernel     one CTA per 64 packed query rows, walking the visible keys like the
//                          forward; with split-K (very long keys) each split writes an fp32
//                          partial and attn_bwd_dq_reduce_kernel adds them in split order.
// Both main kernels recompute S and P from q, k and lse; that costs a second S = Q K^T but
// keeps every sum in one thread's registers in one order: two runs are bit-identical.
// attn_bwd_fused_kernel.cuh has the fused alternative (5 products per tile) and the
// instantiation macro that picks between them (BwdParams::bwd_kernel).
// Packed sequences run in the *_modes kernels, one sequence per CTA as a batch element of its
// own (BwdSeqView below): the grids cover key blocks of max_seqlen_k and query tiles of
// max_seqlen_q per (sequence, KV head), and no block of one sequence addresses another's tokens.
#pragma once

#include "../../capabilities.h"
#include "../common/aux_kernels.cuh"  // attn_bwd_delta_kernel, attn_bwd_dq_reduce_kernel
#include "smem_opt_in.cuh"
#include "tile_io.cuh"

namespace mhakern {
namespace cuda {

template <int D>
struct BwdConfig {
  static_assert(D % 16 == 0 && D >= 16 && D <= 128, "head dim: multiple of 16 up to 128");
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kPitch = TilePitch<D>::kPitch;

  // dK/dV kernel: 64 keys per CTA; query rows per step shrink with D so that the two D-wide
  // fp32 accumulators (dK, dV: D registers per thread) and the two kDkvBlockM-wide score tiles
  // (S^T, dP^T) fit in the register file without spilling.
  static constexpr int kDkvBlockN = 16 * kWarps;
  static constexpr int kDkvBlockM = caps::cuda_tiles(D).dkv_m;
  static_assert(kDkvBlockN == caps::cuda_tiles(D).dkv_n, "capabilities.h: dK/dV keys per CTA = 16 x warps");
  static constexpr int kDkvKTile = kDkvBlockN * kPitch;
  static constexpr int kDkvQTile = kDkvBlockM * kPitch;
  // K, V; Q and dO with two stages each; then lse, delta, the first and one past the last
  // visible key per row, two stages.
  static constexpr int kDkvSmemBytes = (2 * kDkvKTile + 4 * kDkvQTile) * 2 + 2 * kDkvBlockM * (4 + 4 + 4 + 4);
  // kModes (attn_mask / dropout / score modifiers): each row's mask-row offset, dropout hash,
  // ALiBi slope and diagonal key, two stages.
  static constexpr int kDkvModeSmemBytes = 2 * kDkvBlockM * (8 + 4 + 4 + 4);

  // dQ kernel: 64 query rows per CTA, 64 keys per step (32 above D = 64: registers, and shared
  // memory under the 99 KB per block of sm_86/sm_89).
  static constexpr int kDqBlockM = 16 * kWarps;
  static constexpr int kDqBlockN = caps::cuda_tiles(D).dq_n;
  static_assert(kDqBlockM == caps::cuda_tiles(D).dq_m, "capabilities.h: dQ rows per CTA = 16 x warps");
  static constexpr int kDqQTile = kDqBlockM * kPitch;
  static constexpr int kDqKTile = kDqBlockN * kPitch;
  // Q and dO; K and V with two stages each.
  static constexpr int kDqSmemBytes = (2 * kDqQTile + 4 * kDqKTile) * 2;
  // kModes: each row's mask-row offset, dmask-row offset, dropout hash, ALiBi slope and diagonal key.
  static constexpr int kDqModeSmemBytes = kDqBlockM * (8 + 8 + 4 + 4 + 4);
};

// Packed sequences (kModes only, ../mode_params.h): a *_modes kernel hands its body the call of
// one sequence s as batch element s of B = num_seqs elements (batch strides 0) with Lq / Lk the
// sequence's lengths (bwd_seq_params), so that positions, the causal offset Lk_s - Lq_s, the
// dropout hash (b = s) and the ALiBi slope row s are the sequence's, and keys j < Lk_s are the
// only ones addressed. These fields say what the body cannot read from that view: the grid's
// blocks per (sequence, KV head) (key blocks of max_seqlen_k, or query tiles of the group's rows
// of max_seqlen_q: one past the sequence's lengths does nothing), and the sequence's first query
// and key tokens q0, k0, which the body adds to its row addresses, and to the rows of the packed
// (1, H, Tq) lse and delta (head stride Tq). The fused kernel has no packed path
// (capabilities.h cuda_bwd_kernel).
// The operand pointers stay the kernel parameters' (shifted copies, live across the loops in
// registers, pushed the D 32-96 kernels into local memory).
struct BwdSeqView {
  bool on = false;
  int n_blocks = 0;
  int q0 = 0, k0 = 0;
  int64_t head_stride = 0;
};

// Blocks per (sequence, KV head) of a packed call: key blocks of kBlockN covering max_seqlen_k,
// query tiles of kBlockM packed rows covering group * max_seqlen_q (the launchers' grids and the
// kernels' block index both read these).
template <int kBlockN>
MHK_HD int packed_key_blocks(const BwdParams& p) {
  return ceil_div(static_cast<int>(p.max_seqlen_k), kBlockN);
}
template <int kBlockM>
MHK_HD int packed_query_tiles(const BwdParams& p) {
  return ceil_div(p.group * static_cast<int>(p.max_seqlen_q), kBlockM);
}

// Sequence s's view of a packed call (see BwdSeqView), n_blocks the grid's blocks per (sequence,
// KV head).
MHK_DEVICE BwdParams bwd_seq_params(const BwdParams& p, int s, int n_blocks, BwdSeqView& sv) {
  const SeqTokens t = seq_tokens(p, s);
  BwdParams ps = p;
  ps.q_stride.batch = ps.o_stride.batch = ps.do_stride.batch = ps.dq_stride.batch = 0;
  ps.k_stride.batch = ps.v_stride.batch = ps.dk_stride.batch = ps.dv_stride.batch = 0;
  ps.B = static_cast<int>(p.num_seqs);
  ps.Lq = t.Lq;
  ps.Lk = t.Lk;
  ps.key_lengths = nullptr;  // refused with packing
  sv.on = true;
  sv.n_blocks = n_blocks;
  sv.q0 = t.q0;
  sv.k0 = t.k0;
  sv.head_stride = p.Lq;  // Tq
  return ps;
}

// Index of packed row r of (batch element b, KV head hkv) in the (B, H, Lq) lse and delta
// arrays; a packed sequence's rows sit in the (1, H, Tq) ones (BwdSeqView).
template <bool kModes>
MHK_DEVICE int64_t bwd_row_linear(const BwdParams& p, const BwdSeqView& sv, int b, int hkv, int r) {
  if (kModes && sv.on) return sv.q0 + static_cast<int64_t>(hkv * p.group + r / p.Lq) * sv.head_stride + r % p.Lq;
  return packed_row_linear(b, p.H, hkv, p.group, p.Lq, r);
}

// One step of the dK/dV kernel for one warp: its 16 keys (rows key_row0.. of sK, sV, global
// index key0..) against kBlockM query rows staged with their lse (base 2; +inf for rows without
// keys or past the end, which zeroes their P), delta and visible keys [sLo, sLimit).
// kMask: MaskKind (primitives.cuh).
// kModes: also the score modifiers (modified_score_log2; through the cap dS is multiplied by
// 1 - tanh^2), attn_mask (bias or -inf on the score) and dropout (dV takes the dropped
// probabilities; dS = P o (dP_dropped o keep / (1 - p) - delta)).
template <typename Elem, int D, int kBlockM, int kMask, bool kModes = false>
MHK_DEVICE void dkdv_step(const Elem* sK, const Elem* sV, int key_row0, const Elem* sQ, const Elem* sdO, const float* sLse2,
                          const float* sDelta, const int* sLo, const int* sLimit, int key0, float scale_log2, float (&dk)[D / 8][4],
                          float (&dv)[D / 8][4], int lane, const ExtraModes* em = nullptr, ModeRows rows = {}) {
  constexpr int NT = kBlockM / 8;
  const int g = lane / 4, t = lane % 4;
  float pt[NT][4];  // P^T: rows = this warp's keys, columns = query rows
  MHK_UNROLL
  for (int nt = 0; nt < NT; ++nt) pt[nt][0] = pt[nt][1] = pt[nt][2] = pt[nt][3] = 0.f;
  mma_rows_x_rowsT<Elem, D, NT>(pt, sK, key_row0, sQ, 0, lane);
  if constexpr (kModes) {
    if (em->softcap) {  // S^T -> tanh, in place, before dP^T is live (cap_pass)
      MHK_UNROLL
      for (int nt = 0; nt < NT; ++nt) {
        MHK_UNROLL
        for (int e = 0; e < 4; ++e) pt[nt][e] = softcap_tanh(*em, pt[nt][e]);
      }
    }
    float dst[NT][4];  // dP^T (of the dropped probabilities), then dS^T
    MHK_UNROLL
    for (int nt = 0; nt < NT; ++nt) dst[nt][0] = dst[nt][1] = dst[nt][2] = dst[nt][3] = 0.f;
    mma_rows_x_rowsT<Elem, D, NT>(dst, sV, key_row0, sdO, 0, lane);  // dP^T = V dO^T
    if (em->softcap) {
      // dS^T / P = (dP o keep / (1 - p) - delta) (1 - tanh^2) in a pass of its own, while S^T
      // still holds the tanh (in the loop below, with everything else live, the D 64 kernel
      // spilled); the loop then multiplies by P.
      MHK_UNROLL
      for (int nt = 0; nt < NT; ++nt) {
        MHK_UNROLL
        for (int e = 0; e < 4; ++e) {
          const int qc = nt * 8 + 2 * t + (e & 1);
          const float f = em->dropout ? dropout_factor(*em, rows.drop[qc], key0 + g + 8 * (e >> 1)) : 1.f;
          dst[nt][e] = (dst[nt][e] * f - sDelta[qc]) * (1.f - pt[nt][e] * pt[nt][e]);
        }
      }
    }
    MHK_UNROLL
    for (int nt = 0; nt < NT; ++nt) {
      MHK_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int qc = nt * 8 + 2 * t + (e & 1);
        const int key = key0 + g + 8 * (e >> 1);
        bool hidden = false;
        if (kMask != kMaskNone && key >= sLimit[qc]) hidden = true;
        if (kMask == kMaskLoHi && key < sLo[qc]) hidden = true;
        float x = modified_score_log2(*em, pt[nt][e], scale_log2, rows, qc, key);
        if (em->mask_kind != 0 && !hidden) x += mask_bias_log2(*em, rows.mask_row[qc], key);
        x -= sLse2[qc];
        const float prob = fast_exp2(hidden ? -INFINITY : x);
        const float f = em->dropout ? dropout_factor(*em, rows.drop[qc], key) : 1.f;
        // Through the cap: a hidden pair's factor is 0 (its raw score, so its tanh, may be NaN).
        dst[nt][e] = em->softcap ? (hidden ? 0.f : prob * dst[nt][e]) : prob * (dst[nt][e] * f - sDelta[qc]);
        pt[nt][e] = prob * f;
      }
    }
    mma_regs_x_rows<Elem, D, kBlockM>(dv, pt, sdO, 0, lane);   // dV += P_dropped^T dO
    mma_regs_x_rows<Elem, D, kBlockM>(dk, dst, sQ, 0, lane);  // dK += dS^T Q (scaled at the end)
    return;
  }
  MHK_UNROLL
  for (int nt = 0; nt < NT; ++nt) {
    MHK_UNROLL
    for (int e = 0; e < 4; ++e) {
      const int qc = nt * 8 + 2 * t + (e & 1);
      float x = pt[nt][e] * scale_log2 - sLse2[qc];
      if (kMask != kMaskNone && key0 + g + 8 * (e >> 1) >= sLimit[qc]) x = -INFINITY;
      if (kMask == kMaskLoHi && key0 + g + 8 * (e >> 1) < sLo[qc]) x = -INFINITY;
      pt[nt][e] = fast_exp2(x);
    }
  }
  mma_regs_x_rows<Elem, D, kBlockM>(dv, pt, sdO, 0, lane);  // dV += P^T dO

  float dst[NT][4];  // dP^T, then dS^T
  MHK_UNROLL
  for (int nt = 0; nt < NT; ++nt) dst[nt][0] = dst[nt][1] = dst[nt][2] = dst[nt][3] = 0.f;
  mma_rows_x_rowsT<Elem, D, NT>(dst, sV, key_row0, sdO, 0, lane);  // dP^T = V dO^T
  MHK_UNROLL
  for (int nt = 0; nt < NT; ++nt) {
    MHK_UNROLL
    for (int e = 0; e < 4; ++e) dst[nt][e] = pt[nt][e] * (dst[nt][e] - sDelta[nt * 8 + 2 * t + (e & 1)]);
  }
  mma_regs_x_rows<Elem, D, kBlockM>(dk, dst, sQ, 0, lane);  // dK += dS^T Q (scaled at the end)
}

// The body of the dK/dV kernels. kModes: the call has attn_mask, dropout, a score modifier or
// packed sequences (sv; needs_modes_kernel; a separate kernel, attn_bwd_dkdv_modes_kernel, so
// that the plain one is exactly the kernel without them).
template <typename Elem, int D, bool kModes>
MHK_DEVICE void attn_bwd_dkdv_body(const BwdParams& p, const BwdSeqView& sv = BwdSeqView{}) {
  using Cfg = BwdConfig<D>;
  constexpr int kBlockN = Cfg::kDkvBlockN, kBlockM = Cfg::kDkvBlockM, kThreads = Cfg::kThreads;
  MHK_DYNAMIC_SMEM(smem);
  Elem* sK = reinterpret_cast<Elem*>(smem);
  Elem* sV = sK + Cfg::kDkvKTile;
  Elem* sQ = sV + Cfg::kDkvKTile;       // stage s at sQ + s * kDkvQTile
  Elem* sdO = sQ + 2 * Cfg::kDkvQTile;  // likewise
  float* sLse2 = reinterpret_cast<float*>(sdO + 2 * Cfg::kDkvQTile);  // stage s at + s * kBlockM
  float* sDelta = sLse2 + 2 * kBlockM;
  int* sLimit = reinterpret_cast<int*>(sDelta + 2 * kBlockM);
  int* sLo = sLimit + 2 * kBlockM;
  int64_t* sMaskRow = reinterpret_cast<int64_t*>(sLo + 2 * kBlockM);  // kModes only; stage s at + s * kBlockM
  uint32_t* sDrop = reinterpret_cast<uint32_t*>(sMaskRow + 2 * kBlockM);  // likewise
  float* sAlibiSlope = reinterpret_cast<float*>(sDrop + 2 * kBlockM);     // likewise
  int* sAlibiPos = reinterpret_cast<int*>(sAlibiSlope + 2 * kBlockM);     // likewise

  const int tid = thread_index();
  const int warp = tid / 32, lane = tid % 32;

  const bool packed = kModes && sv.on;
  const int n_kblocks = packed ? sv.n_blocks : ceil_div(p.Lk, kBlockN);
  int64_t bid = block_index();
  const int kb = static_cast<int>(bid % n_kblocks);
  bid /= n_kblocks;
  const int hkv = static_cast<int>(bid % p.Hkv);
  const int b = static_cast<int>(bid / p.Hkv);
  const int n0 = kb * kBlockN;
  if (packed && n0 >= p.Lk) return;  // a key block past this sequence's keys; no barrier yet
  const int Lk_b = key_length_of(p, b);  // clamped into [0, Lk]
  const Visibility vis = visibility_of(p, Lk_b);
  const int rows_total = p.group * p.Lq;
  const int n_qblocks = ceil_div(rows_total, kBlockM);

  // A query block matters when one of its rows may see a key of this block; it needs
  // per-element masks when one of its rows does not see all of them.
  auto block_visible = [&](int mq, bool& masked) -> bool {
    const int rq0 = mq * kBlockM;
    int i_lo, i_hi;
    tile_query_range(rq0, imin(kBlockM, rows_total - rq0), p.Lq, i_lo, i_hi);
    masked = key_hi(vis, i_lo) < n0 + kBlockN || key_lo(vis, i_hi) > n0;
    return key_hi(vis, i_hi) > n0 && key_lo(vis, i_lo) < n0 + kBlockN;
  };
  auto next_block = [&](int mq) -> int {
    bool masked;
    while (mq < n_qblocks && !block_visible(mq, masked)) ++mq;
    return mq;
  };

  // A packed sequence's first query and key tokens (BwdSeqView), added to the row addresses.
  const int q_tok = packed ? sv.q0 : 0, k_tok = packed ? sv.k0 : 0;
  const Elem* q = static_cast<const Elem*>(p.q) + static_cast<int64_t>(q_tok) * p.q_stride.row;
  const Elem* dout = static_cast<const Elem*>(p.dout) + static_cast<int64_t>(q_tok) * p.do_stride.row;
  auto load_qblock = [&](int mq, int stage) {
    const int rq0 = mq * kBlockM;
    load_tile_async<Elem, kBlockM, D, kThreads>(sQ + stage * Cfg::kDkvQTile, p.q, [&](int rr) -> const Elem* {
      const int r = rq0 + rr;
      return r < rows_total ? q + packed_row_offset(p.q_stride, b, hkv, p.group, p.Lq, r) : nullptr;
    });
    load_tile_async<Elem, kBlockM, D, kThreads>(sdO + stage * Cfg::kDkvQTile, p.dout, [&](int rr) -> const Elem* {
      const int r = rq0 + rr;
      return r < rows_total ? dout + packed_row_offset(p.do_stride, b, hkv, p.group, p.Lq, r) : nullptr;
    });
    if (tid < kBlockM) {
      const int r = rq0 + tid;
      float lse2 = INFINITY, delta = 0.f;
      int limit = 0, first = 0;
      if (r < rows_total) {
        const int64_t lin = bwd_row_linear<kModes>(p, sv, b, hkv, r);
        const float lse = p.lse[lin];
        lse2 = lse == -INFINITY ? INFINITY : lse * kLog2e;
        delta = p.delta[lin];
        limit = key_hi(vis, r % p.Lq);
        first = key_lo(vis, r % p.Lq);
      }
      sLse2[stage * kBlockM + tid] = lse2;
      sDelta[stage * kBlockM + tid] = delta;
      sLimit[stage * kBlockM + tid] = limit;
      sLo[stage * kBlockM + tid] = first;
      if (kModes) {
        const int h = hkv * p.group + (r < rows_total ? r / p.Lq : 0);
        const int i = r < rows_total ? r % p.Lq : 0;
        sMaskRow[stage * kBlockM + tid] = p.mask != nullptr ? mask_row_offset(p, b, h, i) : 0;
        sDrop[stage * kBlockM + tid] = dropout_row_hash(p, b, h, i);
        alibi_row(p, vis, b, h, i, sAlibiSlope[stage * kBlockM + tid], sAlibiPos[stage * kBlockM + tid]);
      }
    }
  };
  const ExtraModes em = extra_modes_of(p);

  // The first query block that sees a key of this block; none: the block's keys are hidden from
  // every row (past Lk_b, or outside every row's causal or window range) and get zero gradients
  // without being read.
  int mq = n0 < Lk_b ? next_block(0) : n_qblocks;
  const int kv_read = mq < n_qblocks ? Lk_b : 0;

  const Elem* k_head = static_cast<const Elem*>(p.k) + b * p.k_stride.batch + hkv * p.k_stride.head +
                       static_cast<int64_t>(k_tok) * p.k_stride.row;
  const Elem* v_head = static_cast<const Elem*>(p.v) + b * p.v_stride.batch + hkv * p.v_stride.head +
                       static_cast<int64_t>(k_tok) * p.v_stride.row;
  // Keys at or past Lk_b are never read (they get zero gradients).
  load_tile_async<Elem, kBlockN, D, kThreads>(sK, p.k, [&](int rr) -> const Elem* {
    const int j = n0 + rr;
    return j < kv_read ? k_head + static_cast<int64_t>(j) * p.k_stride.row : nullptr;
  });
  load_tile_async<Elem, kBlockN, D, kThreads>(sV, p.v, [&](int rr) -> const Elem* {
    const int j = n0 + rr;
    return j < kv_read ? v_head + static_cast<int64_t>(j) * p.v_stride.row : nullptr;
  });

  float dk[D / 8][4], dv[D / 8][4];
  MHK_UNROLL
  for (int dt = 0; dt < D / 8; ++dt) {
    dk[dt][0] = dk[dt][1] = dk[dt][2] = dk[dt][3] = 0.f;
    dv[dt][0] = dv[dt][1] = dv[dt][2] = dv[dt][3] = 0.f;
  }

  const bool lo_masks = vis.left >= 0;
  if (mq < n_qblocks) load_qblock(mq, 0);
  cp_async_commit();  // K, V and the first query block
  int stage = 0;
  while (mq < n_qblocks) {
    const int nxt = next_block(mq + 1);
    if (nxt < n_qblocks) load_qblock(nxt, stage ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    block_sync();
    bool masked;
    block_visible(mq, masked);
    const Elem* sQs = sQ + stage * Cfg::kDkvQTile;
    const Elem* sdOs = sdO + stage * Cfg::kDkvQTile;
    const float* lse2 = sLse2 + stage * kBlockM;
    const float* delta = sDelta + stage * kBlockM;
    const int* limit = sLimit + stage * kBlockM;
    const int* first = sLo + stage * kBlockM;
    const ModeRows rows{sMaskRow + stage * kBlockM, sDrop + stage * kBlockM, nullptr, sAlibiSlope + stage * kBlockM,
                        sAlibiPos + stage * kBlockM};
    const int key0 = n0 + warp * 16;
    if (!masked)
      dkdv_step<Elem, D, kBlockM, kMaskNone, kModes>(sK, sV, warp * 16, sQs, sdOs, lse2, delta, first, limit, key0,
                                                     p.scale_log2, dk, dv, lane, &em, rows);
    else if (!lo_masks)
      dkdv_step<Elem, D, kBlockM, kMaskHi, kModes>(sK, sV, warp * 16, sQs, sdOs, lse2, delta, first, limit, key0,
                                                   p.scale_log2, dk, dv, lane, &em, rows);
    else
      dkdv_step<Elem, D, kBlockM, kMaskLoHi, kModes>(sK, sV, warp * 16, sQs, sdOs, lse2, delta, first, limit, key0,
                                                     p.scale_log2, dk, dv, lane, &em, rows);
    // The next iteration's prefetch overwrites this stage.
    block_sync();
    mq = nxt;
    stage ^= 1;
  }
  cp_async_wait<0>();
  block_sync();  // K and V may have landed only now; staging below overwrites them

  // Stage through the K and V tiles (each warp overwrites only its own 16 rows, which only it
  // has read) and write 16-byte rows; keys past Lk_b get the zeros they accumulated.
  const float mul_k[2] = {p.scale, p.scale};
  const float mul_v[2] = {1.f, 1.f};
  stage_accumulator<Elem, D>(sK, warp * 16, dk, mul_k, lane);
  stage_accumulator<Elem, D>(sV, warp * 16, dv, mul_v, lane);
  block_sync();
  Elem* dk_head = static_cast<Elem*>(p.dk) + b * p.dk_stride.batch + hkv * p.dk_stride.head +
                 static_cast<int64_t>(k_tok) * p.dk_stride.row;
  Elem* dv_head = static_cast<Elem*>(p.dv) + b * p.dv_stride.batch + hkv * p.dv_stride.head +
                  static_cast<int64_t>(k_tok) * p.dv_stride.row;
  store_tile<Elem, kBlockN, D, kThreads>(sK, [&](int rr) -> Elem* {
    const int j = n0 + rr;
    return j < p.Lk ? dk_head + static_cast<int64_t>(j) * p.dk_stride.row : nullptr;
  });
  store_tile<Elem, kBlockN, D, kThreads>(sV, [&](int rr) -> Elem* {
    const int j = n0 + rr;
    return j < p.Lk ? dv_head + static_cast<int64_t>(j) * p.dv_stride.row : nullptr;
  });
}

template <typename Elem, int D>
__global__ void MHK_LAUNCH_BOUNDS(BwdConfig<D>::kThreads, 2) attn_bwd_dkdv_kernel(const BwdParams p) {
  attn_bwd_dkdv_body<Elem, D, false>(p);
}

template <typename Elem, int D>
__global__ void MHK_LAUNCH_BOUNDS(BwdConfig<D>::kThreads, 2) attn_bwd_dkdv_modes_kernel(const BwdParams p) {
  if (p.cu_seqlens_q == nullptr) {
    attn_bwd_dkdv_body<Elem, D, true>(p);
    return;
  }
  // Packed sequences: the grid is key blocks of max_seqlen_k fastest, then KV heads, then
  // sequences (BwdSeqView).
  const int n = packed_key_blocks<BwdConfig<D>::kDkvBlockN>(p);
  BwdSeqView sv;
  const BwdParams ps = bwd_seq_params(p, static_cast<int>(block_index() / (static_cast<int64_t>(n) * p.Hkv)), n, sv);
  attn_bwd_dkdv_body<Elem, D, true>(ps, sv);
}

// One key block of the dQ kernel for one warp's 16 query rows, which see keys [lo, limit).
// kMask: MaskKind (primitives.cuh).
// kModes: also the score modifiers, attn_mask, dropout, and the float mask's gradient dS (at the
// capped score, before the cap's chain factor) written to dmask.
template <typename Elem, int D, int kBlockN, int kMask, bool kModes = false>
MHK_DEVICE void dq_step(const Elem* sQ, const Elem* sdO, int q_row0, const Elem* sK, const Elem* sV, int n0,
                        const int (&lo)[2], const int (&limit)[2], const float (&lse2)[2], const float (&delta)[2], float scale_log2,
                        float (&dq)[D / 8][4], int lane, const ExtraModes* em = nullptr, ModeRows rows = {}) {
  constexpr int NT = kBlockN / 8;
  const int t = lane % 4;
  float ps[NT][4];
  MHK_UNROLL
  for (int nt = 0; nt < NT; ++nt) ps[nt][0] = ps[nt][1] = ps[nt][2] = ps[nt][3] = 0.f;
  mma_rows_x_rowsT<Elem, D, NT>(ps, sQ, q_row0, sK, 0, lane);  // S = Q K^T
  if constexpr (kModes) {
    const int g = lane / 4;
    if (em->softcap) {  // S -> tanh, in place, before dP is live (cap_pass)
      MHK_UNROLL
      for (int nt = 0; nt < NT; ++nt) {
        MHK_UNROLL
        for (int e = 0; e < 4; ++e) ps[nt][e] = softcap_tanh(*em, ps[nt][e]);
      }
    }
    float ds[NT][4];
    MHK_UNROLL
    for (int nt = 0; nt < NT; ++nt) ds[nt][0] = ds[nt][1] = ds[nt][2] = ds[nt][3] = 0.f;
    mma_rows_x_rowsT<Elem, D, NT>(ds, sdO, q_row0, sV, 0, lane);  // dP (of the dropped probabilities) = dO V^T
    MHK_UNROLL
    for (int nt = 0; nt < NT; ++nt) {
      MHK_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int col = n0 + nt * 8 + 2 * t + (e & 1);
        const int row = q_row0 + g + 8 * (e >> 1);
        bool hidden = false;
        if (kMask != kMaskNone && col >= limit[e >> 1]) hidden = true;
        if (kMask == kMaskLoHi && col < lo[e >> 1]) hidden = true;
        float x = modified_score_log2(*em, ps[nt][e], scale_log2, rows, row, col);
        if (em->mask_kind != 0 && !hidden) x += mask_bias_log2(*em, rows.mask_row[row], col);
        x -= lse2[e >> 1];
        const float prob = fast_exp2(hidden ? -INFINITY : x);
        const float f = em->dropout ? dropout_factor(*em, rows.drop[row], col) : 1.f;
        const float d = prob * (ds[nt][e] * f - delta[e >> 1]);
        ds[nt][e] = em->softcap ? d * cap_chain(*em, ps[nt][e], hidden) : d;  // through the cap
        // dL/dscore of the float mask; exactly 0 where hidden (prob 0), whatever dP holds there.
        if (em->dmask != nullptr && rows.dmask_row[row] >= 0 && col < em->Lk)
          em->dmask[rows.dmask_row[row] + col] = prob != 0.f ? d : 0.f;
      }
    }
    mma_regs_x_rows<Elem, D, kBlockN>(dq, ds, sK, 0, lane);  // dQ += dS K (scaled at the end)
    return;
  }
  MHK_UNROLL
  for (int nt = 0; nt < NT; ++nt) {
    MHK_UNROLL
    for (int e = 0; e < 4; ++e) {
      float x = ps[nt][e] * scale_log2 - lse2[e >> 1];
      if (kMask != kMaskNone && n0 + nt * 8 + 2 * t + (e & 1) >= limit[e >> 1]) x = -INFINITY;
      if (kMask == kMaskLoHi && n0 + nt * 8 + 2 * t + (e & 1) < lo[e >> 1]) x = -INFINITY;
      ps[nt][e] = fast_exp2(x);
    }
  }
  float ds[NT][4];
  MHK_UNROLL
  for (int nt = 0; nt < NT; ++nt) ds[nt][0] = ds[nt][1] = ds[nt][2] = ds[nt][3] = 0.f;
  mma_rows_x_rowsT<Elem, D, NT>(ds, sdO, q_row0, sV, 0, lane);  // dP = dO V^T
  MHK_UNROLL
  for (int nt = 0; nt < NT; ++nt) {
    MHK_UNROLL
    for (int e = 0; e < 4; ++e) ds[nt][e] = ps[nt][e] * (ds[nt][e] - delta[e >> 1]);
  }
  mma_regs_x_rows<Elem, D, kBlockN>(dq, ds, sK, 0, lane);  // dQ += dS K (scaled at the end)
}

// The body of the dQ kernels (kModes and sv as for the dK/dV kernels).
template <typename Elem, int D, bool kModes>
MHK_DEVICE void attn_bwd_dq_body(const BwdParams& p, const BwdSeqView& sv = BwdSeqView{}) {
  using Cfg = BwdConfig<D>;
  constexpr int kBlockM = Cfg::kDqBlockM, kBlockN = Cfg::kDqBlockN, kThreads = Cfg::kThreads;
  MHK_DYNAMIC_SMEM(smem);
  Elem* sQ = reinterpret_cast<Elem*>(smem);
  Elem* sdO = sQ + Cfg::kDqQTile;
  Elem* sK = sdO + Cfg::kDqQTile;       // stage s at sK + s * kDqKTile
  Elem* sV = sK + 2 * Cfg::kDqKTile;
  int64_t* sMaskRow = reinterpret_cast<int64_t*>(sV + 2 * Cfg::kDqKTile);  // kModes only
  int64_t* sDmaskRow = sMaskRow + kBlockM;                                 // kModes only
  uint32_t* sDrop = reinterpret_cast<uint32_t*>(sDmaskRow + kBlockM);      // kModes only
  float* sAlibiSlope = reinterpret_cast<float*>(sDrop + kBlockM);          // kModes only
  int* sAlibiPos = reinterpret_cast<int*>(sAlibiSlope + kBlockM);          // kModes only

  const int tid = thread_index();
  const int warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;

  const int rows_total = p.group * p.Lq;
  const bool packed = kModes && sv.on;
  const int n_mblocks = packed ? sv.n_blocks : ceil_div(rows_total, kBlockM);
  int64_t bid = block_index();
  int mb = static_cast<int>(bid % n_mblocks);
  bid /= n_mblocks;
  const int hkv = static_cast<int>(bid % p.Hkv);
  bid /= p.Hkv;
  const int b = static_cast<int>(bid % p.B);
  const int split = static_cast<int>(bid / p.B);
  if (p.causal) mb = n_mblocks - 1 - mb;
  const int r0 = mb * kBlockM;
  if (packed && r0 >= rows_total) return;  // a tile past this sequence's rows; no barrier yet
  const int nrows = imin(kBlockM, rows_total - r0);
  const int Lk_b = key_length_of(p, b);  // clamped into [0, Lk]

  const RowBlockKeys rk = row_block_keys<kBlockN>(p, Lk_b, r0, nrows, split);
  const Visibility vis = rk.vis;
  const int kv_begin = rk.kv_begin, kv_end = rk.kv_end, kv_all_lo = rk.kv_all_lo, kv_all = rk.kv_all;
  const bool lo_masks = rk.lo_masks;

  int limit[2], lo[2];
  float lse2[2], delta[2];
  MHK_UNROLL
  for (int hh = 0; hh < 2; ++hh) {
    const int r = r0 + warp * 16 + g + 8 * hh;
    limit[hh] = 0;
    lo[hh] = 0;
    lse2[hh] = INFINITY;  // zeroes P of rows past the end
    delta[hh] = 0.f;
    if (r < rows_total) {
      const int64_t lin = bwd_row_linear<kModes>(p, sv, b, hkv, r);
      const float lse = p.lse[lin];
      lse2[hh] = lse == -INFINITY ? INFINITY : lse * kLog2e;
      delta[hh] = p.delta[lin];
      limit[hh] = key_hi(vis, r % p.Lq);
      lo[hh] = key_lo(vis, r % p.Lq);
    }
  }
  const bool warp_active = r0 + warp * 16 < rows_total;
  // Published to the other warps by the first block_sync of the loop.
  if (kModes) {
    for (int rr = tid; rr < kBlockM; rr += kThreads) {
      const int r = r0 + rr;
      const int h = hkv * p.group + (r < rows_total ? r / p.Lq : 0);
      const int i = r < rows_total ? r % p.Lq : 0;
      sMaskRow[rr] = p.mask != nullptr ? mask_row_offset(p, b, h, i) : 0;
      sDmaskRow[rr] = r < rows_total ? ((static_cast<int64_t>(b) * p.H + h) * p.Lq + i) * p.Lk : -1;
      sDrop[rr] = dropout_row_hash(p, b, h, i);
      alibi_row(p, vis, b, h, i, sAlibiSlope[rr], sAlibiPos[rr]);
    }
  }
  const ExtraModes em = extra_modes_of(p);
  const ModeRows mode_rows{sMaskRow, sDrop, sDmaskRow, sAlibiSlope, sAlibiPos};

  // A packed sequence's first query and key tokens (BwdSeqView), added to the row addresses.
  const int q_tok = packed ? sv.q0 : 0, k_tok = packed ? sv.k0 : 0;
  const Elem* q = static_cast<const Elem*>(p.q) + static_cast<int64_t>(q_tok) * p.q_stride.row;
  const Elem* dout = static_cast<const Elem*>(p.dout) + static_cast<int64_t>(q_tok) * p.do_stride.row;
  const Elem* k_head = static_cast<const Elem*>(p.k) + b * p.k_stride.batch + hkv * p.k_stride.head +
                       static_cast<int64_t>(k_tok) * p.k_stride.row;
  const Elem* v_head = static_cast<const Elem*>(p.v) + b * p.v_stride.batch + hkv * p.v_stride.head +
                       static_cast<int64_t>(k_tok) * p.v_stride.row;
  auto load_kv = [&](int n0, int stage) {
    load_tile_async<Elem, kBlockN, D, kThreads>(sK + stage * Cfg::kDqKTile, p.k, [&](int rr) -> const Elem* {
      const int j = n0 + rr;
      return j < Lk_b ? k_head + static_cast<int64_t>(j) * p.k_stride.row : nullptr;
    });
    load_tile_async<Elem, kBlockN, D, kThreads>(sV + stage * Cfg::kDqKTile, p.v, [&](int rr) -> const Elem* {
      const int j = n0 + rr;
      return j < Lk_b ? v_head + static_cast<int64_t>(j) * p.v_stride.row : nullptr;
    });
  };

  float dq[D / 8][4];
  MHK_UNROLL
  for (int dt = 0; dt < D / 8; ++dt) dq[dt][0] = dq[dt][1] = dq[dt][2] = dq[dt][3] = 0.f;

  if (kv_begin < kv_end) {
    const int n_steps = ceil_div(kv_end - kv_begin, kBlockN);
    load_tile_async<Elem, kBlockM, D, kThreads>(sQ, p.q, [&](int rr) -> const Elem* {
      const int r = r0 + rr;
      return r < rows_total ? q + packed_row_offset(p.q_stride, b, hkv, p.group, p.Lq, r) : nullptr;
    });
    load_tile_async<Elem, kBlockM, D, kThreads>(sdO, p.dout, [&](int rr) -> const Elem* {
      const int r = r0 + rr;
      return r < rows_total ? dout + packed_row_offset(p.do_stride, b, hkv, p.group, p.Lq, r) : nullptr;
    });
    load_kv(kv_begin, 0);
    cp_async_commit();
    for (int j = 0; j < n_steps; ++j) {
      const int stage = j & 1;
      if (j + 1 < n_steps) load_kv(kv_begin + (j + 1) * kBlockN, stage ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
      block_sync();
      const int n0 = kv_begin + j * kBlockN;
      const Elem* sKs = sK + stage * Cfg::kDqKTile;
      const Elem* sVs = sV + stage * Cfg::kDqKTile;
      if (warp_active) {
        if (n0 + kBlockN <= kv_all && n0 >= kv_all_lo)
          dq_step<Elem, D, kBlockN, kMaskNone, kModes>(sQ, sdO, warp * 16, sKs, sVs, n0, lo, limit, lse2, delta,
                                                       p.scale_log2, dq, lane, &em, mode_rows);
        else if (!lo_masks)
          dq_step<Elem, D, kBlockN, kMaskHi, kModes>(sQ, sdO, warp * 16, sKs, sVs, n0, lo, limit, lse2, delta,
                                                     p.scale_log2, dq, lane, &em, mode_rows);
        else
          dq_step<Elem, D, kBlockN, kMaskLoHi, kModes>(sQ, sdO, warp * 16, sKs, sVs, n0, lo, limit, lse2, delta,
                                                       p.scale_log2, dq, lane, &em, mode_rows);
      }
      block_sync();
    }
  }
  cp_async_wait<0>();

  if (p.num_splits == 1) {
    const float mul[2] = {p.scale, p.scale};
    stage_accumulator<Elem, D>(sQ, warp * 16, dq, mul, lane);
    block_sync();
    Elem* dqp = static_cast<Elem*>(p.dq) + static_cast<int64_t>(q_tok) * p.dq_stride.row;
    store_tile<Elem, kBlockM, D, kThreads>(sQ, [&](int rr) -> Elem* {
      const int r = r0 + rr;
      return r < rows_total ? dqp + packed_row_offset(p.dq_stride, b, hkv, p.group, p.Lq, r) : nullptr;
    });
  } else {
    const int64_t split_rows = static_cast<int64_t>(split) * p.B * p.H * p.Lq;
    MHK_UNROLL
    for (int hh = 0; hh < 2; ++hh) {
      const int r = r0 + warp * 16 + g + 8 * hh;
      if (r >= rows_total) continue;
      float* dst = p.dq_partial + (split_rows + packed_row_linear(b, p.H, hkv, p.group, p.Lq, r)) * D;
      MHK_UNROLL
      for (int dt = 0; dt < D / 8; ++dt) {
        float2 val;
        val.x = dq[dt][2 * hh] * p.scale;
        val.y = dq[dt][2 * hh + 1] * p.scale;
        *reinterpret_cast<float2*>(dst + dt * 8 + 2 * t) = val;
      }
    }
  }
}

template <typename Elem, int D>
__global__ void MHK_LAUNCH_BOUNDS(BwdConfig<D>::kThreads, 2) attn_bwd_dq_kernel(const BwdParams p) {
  attn_bwd_dq_body<Elem, D, false>(p);
}

template <typename Elem, int D>
__global__ void MHK_LAUNCH_BOUNDS(BwdConfig<D>::kThreads, 2) attn_bwd_dq_modes_kernel(const BwdParams p) {
  if (p.cu_seqlens_q == nullptr) {
    attn_bwd_dq_body<Elem, D, true>(p);
    return;
  }
  // Packed sequences: the grid is query tiles of the group's rows of max_seqlen_q fastest, then
  // KV heads, then sequences (BwdSeqView); unsplit.
  const int n = packed_query_tiles<BwdConfig<D>::kDqBlockM>(p);
  BwdSeqView sv;
  const BwdParams ps = bwd_seq_params(p, static_cast<int>(block_index() / (static_cast<int64_t>(n) * p.Hkv)), n, sv);
  attn_bwd_dq_body<Elem, D, true>(ps, sv);
}

// The dK/dV and dQ kernels, plain or with attn_mask / dropout / score modifiers (kModes).
template <typename Elem, int D, bool kModes>
cudaError_t launch_attn_bwd_main(const BwdParams& p, int64_t grid_kv, int64_t grid_q, cudaStream_t stream) {
  using Cfg = BwdConfig<D>;
  constexpr int kDkvBytes = Cfg::kDkvSmemBytes + (kModes ? Cfg::kDkvModeSmemBytes : 0);
  constexpr int kDqBytes = Cfg::kDqSmemBytes + (kModes ? Cfg::kDqModeSmemBytes : 0);
  constexpr int kTag = kModes ? kTagModes : 0;
  auto dkdv = kModes ? attn_bwd_dkdv_modes_kernel<Elem, D> : attn_bwd_dkdv_kernel<Elem, D>;
  auto dq = kModes ? attn_bwd_dq_modes_kernel<Elem, D> : attn_bwd_dq_kernel<Elem, D>;
  cudaError_t err = opt_in_dynamic_smem<kTagBwdDkdv + kTag, Elem, D>(dkdv, kDkvBytes);
  if (err != cudaSuccess) return err;
  launch_kernel(dkdv, grid_kv, Cfg::kThreads, kDkvBytes, stream, p);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  err = opt_in_dynamic_smem<kTagBwdDq + kTag, Elem, D>(dq, kDqBytes);
  if (err != cudaSuccess) return err;
  launch_kernel(dq, grid_q, Cfg::kThreads, kDqBytes, stream, p);
  return cudaGetLastError();
}

template <typename Elem, int D>
cudaError_t run_attn_bwd(const BwdParams& p, cudaStream_t stream) {
  using Cfg = BwdConfig<D>;
  const int64_t rows = static_cast<int64_t>(p.B) * p.H * p.Lq;
  int64_t grid_kv = static_cast<int64_t>(ceil_div(p.Lk, Cfg::kDkvBlockN)) * p.Hkv * p.B;
  int64_t grid_q = static_cast<int64_t>(ceil_div(p.group * p.Lq, Cfg::kDqBlockM)) * p.Hkv * p.B * p.num_splits;
  if (p.cu_seqlens_q != nullptr) {
    // Packed sequences (the modes kernels, BwdSeqView): blocks of max_seqlen_k / max_seqlen_q per
    // (sequence, KV head); no split-K (the reduce kernel's rows are the dense (B, H, Lq) ones).
    if (p.num_splits != 1) return cudaErrorInvalidValue;
    grid_kv = static_cast<int64_t>(packed_key_blocks<Cfg::kDkvBlockN>(p)) * p.Hkv * p.num_seqs;
    grid_q = static_cast<int64_t>(packed_query_tiles<Cfg::kDqBlockM>(p)) * p.Hkv * p.num_seqs;
  }
  if (rows == 0 || grid_kv == 0 || grid_q == 0) return cudaSuccess;
  if (grid_kv > 0x7fffffff || grid_q > 0x7fffffff || (rows + 3) / 4 > 0x7fffffff) return cudaErrorInvalidConfiguration;

  launch_kernel(attn_bwd_delta_kernel<Elem, D>, (rows + 3) / 4, 128, 0, stream, p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;

  const bool modes = needs_modes_kernel(p);
  err = modes ? launch_attn_bwd_main<Elem, D, true>(p, grid_kv, grid_q, stream)
              : launch_attn_bwd_main<Elem, D, false>(p, grid_kv, grid_q, stream);
  if (err != cudaSuccess || p.num_splits == 1) return err;

  const int64_t pairs = rows * (D / 2);
  launch_kernel(attn_bwd_dq_reduce_kernel<Elem, D>, (pairs + 255) / 256, 256, 0, stream, p);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace mhakern
