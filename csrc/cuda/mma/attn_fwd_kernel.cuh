// Fused attention forward on tensor cores (FlashAttention-2 scheme, sm_80+ mma.sync):
// out = softmax(scale * q k^T, masked) v and lse = logsumexp of the masked scaled scores.
//
// One CTA of 4 warps takes kBlockM = 128 packed query rows (primitives.cuh: rows of all query
// heads that share one KV head, so GQA decode reads each key block once per group) and streams
// the visible keys in blocks of kBlockN through double-buffered shared memory. Each warp owns
// two strips of 16 rows: S = Q K^T and O += P V run on mma.sync with fp32 accumulators, the
// online softmax keeps the row max and row sum in fp32 registers (base 2, scale folded in), and
// only key blocks that cross a mask boundary pay for per-element masking.
//
// Split-K (num_splits > 1, long keys with few query tiles): CTA z takes whole key blocks
// [z * per_split, (z + 1) * per_split) and writes its normalised partial output and lse in fp32;
// attn_fwd_combine_kernel (../common/aux_kernels.cuh) merges the partials through their lse.
#pragma once

#include "../../capabilities.h"
#include "../common/aux_kernels.cuh"  // attn_fwd_combine_kernel
#include "smem_opt_in.cuh"
#include "tile_io.cuh"

namespace mhakern {
namespace cuda {

// kModes: the tiles of attn_fwd_modes_kernel (attn_mask / dropout), see kBlockN.
template <int D, bool kModes = false>
struct FwdConfig {
  static_assert(D % 16 == 0 && D >= 16 && D <= 128, "head dim: multiple of 16 up to 128");
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  // Each warp owns kMTiles strips of 16 query rows: every K and V fragment it reads from shared
  // memory then feeds kMTiles mma (two strips halve the shared-memory traffic per multiply, and
  // 128-row tiles halve the K/V traffic from L2, as FlashAttention-2's 128 x 64 tile). Above
  // D = 64 the keys per step drop to 32 so that the 2 x D/2 accumulators and the score tiles fit
  // in 255 registers: D = 96 without any spill; D = 128 with one 4-byte reload from local memory
  // per key step (an L1 hit next to 64 mma per warp; tools/check_cuda_build.py allows exactly
  // that much), which costs less than halving the key block again (twice the barriers and
  // accumulator rescales per key) or giving up the second strip.
  static constexpr int kMTiles = 2;
  static constexpr int kBlockM = 16 * kMTiles * kWarps;  // packed query rows per CTA
  // The modes kernel takes half the keys per step. Its per-element attn_mask read issues the
  // loads of a strip together (see fwd_step: one round trip per strip instead of one per
  // element), which holds up to 32 more values per thread, and its dropout hash more. At the
  // full block ptxas parked loop-invariant values in local memory and reloaded them on every
  // step (even with one load at a time: sm_80 5 local-memory instructions in the loop at
  // D = 64, 7 at D = 128; sm_90 10 and 6); with the loads batched D = 32 and 96 spilled too.
  // Half the score tile keeps every head dim's loop free of local memory (209 / 245 / 220 / 249
  // registers at D = 32 / 64 / 96 / 128 on sm_80); the per-key mask and dropout work, which
  // dominates these steps, does not change with the block. tools/check_cuda_build.py fails on a
  // spill in the loop of either kernel.
  static constexpr int kBlockN = kModes ? caps::cuda_tiles(D).fwd_modes_n : caps::cuda_tiles(D).fwd_n;  // keys per step
  static_assert(kBlockM == caps::cuda_tiles(D).fwd_m, "capabilities.h: forward tile rows = 16 x strips x warps");
  static constexpr int kPitch = TilePitch<D>::kPitch;
  static constexpr int kQTile = kBlockM * kPitch;   // elements
  static constexpr int kKVTile = kBlockN * kPitch;  // elements
  // Q, then K and V with two stages each, then the first and one past the last visible key of
  // each query row (read from shared memory on masked steps only: registers saved, which keeps
  // the D = 128 loop free of spills on sm_80).
  static constexpr int kSmemBytes = (kQTile + 4 * kKVTile) * 2 + 2 * kBlockM * 4;
  // The kernel with attn_mask / dropout / the score modifiers (kModes) also stages each row's
  // mask-row offset, dropout hash, ALiBi slope and diagonal key.
  static constexpr int kModeSmemBytes = kBlockM * (8 + 4 + 4 + 4);
  // What the launcher requests (tools/check_cuda_build.py reads it too).
  static constexpr int kLaunchSmemBytes = kSmemBytes + (kModes ? kModeSmemBytes : 0);
};


// One key block for one warp's MT strips of 16 rows (from tile row q_row0): S = Q K^T, masking,
// online softmax, O += P V. A tile row sees keys [sLo[row], sLimit[row]).
// kModes: also the score modifiers (softcap, ALiBi: modified_score_log2), attn_mask (a bias added
// to the base-2 score, or -inf) and dropout on the probabilities that multiply V (the row sums
// keep the undropped ones: lse is undropped).
template <typename Elem, int D, int kBlockN, int MT, int kMask, bool kModes = false>
MHK_DEVICE void fwd_step(const Elem* sQ, int q_row0, const Elem* sK, const Elem* sV, int n0, const int* sLo,
                         const int* sLimit, float scale_log2, float (&acc)[MT][D / 8][4], float (&m_run)[MT][2], float (&l_run)[MT][2],
                         int lane, const ExtraModes* em = nullptr, ModeRows rows = {}) {
  constexpr int NT = kBlockN / 8;
  const int g = lane / 4, t = lane % 4;
  float s[MT][NT][4];
  MHK_UNROLL
  for (int mt = 0; mt < MT; ++mt) {
    MHK_UNROLL
    for (int nt = 0; nt < NT; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
  }
  mma_rows_x_rowsT_mt<Elem, D, NT, MT>(s, sQ, q_row0, sK, 0, lane);

  MHK_UNROLL
  for (int mt = 0; mt < MT; ++mt) {
    // Scale into base 2 first (a negative scale would turn a -inf mask into +inf).
    int limit[2] = {0, 0}, lo[2] = {0, 0};
    if (kMask != kMaskNone) {
      limit[0] = sLimit[q_row0 + 16 * mt + g];
      limit[1] = sLimit[q_row0 + 16 * mt + g + 8];
    }
    if (kMask == kMaskLoHi) {
      lo[0] = sLo[q_row0 + 16 * mt + g];
      lo[1] = sLo[q_row0 + 16 * mt + g + 8];
    }
    // Structurally hidden keys (they may lie past Lk) are -inf.
    auto hidden_at = [&](int col, int hh) {
      return (kMask != kMaskNone && col >= limit[hh]) || (kMask == kMaskLoHi && col < lo[hh]);
    };
    MHK_UNROLL
    for (int nt = 0; nt < NT; ++nt) {
      MHK_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int col = n0 + nt * 8 + 2 * t + (e & 1);
        float x = s[mt][nt][e] * scale_log2;
        // kModes: the score modifiers (softcap, ALiBi) instead; a hidden key's -inf overrides them.
        if constexpr (kModes)
          x = modified_score_log2(*em, cap_pass(*em, s[mt][nt][e]), scale_log2, rows, q_row0 + 16 * mt + g + 8 * (e >> 1), col);
        s[mt][nt][e] = hidden_at(col, e >> 1) ? -INFINITY : x;
      }
    }
    // attn_mask in a pass of its own behind one branch: without a branch around each element
    // the loads of the strip issue together (one round trip, not one per element). A hidden key
    // reads the row's key 0 instead, which exists here (Lk > 0), and drops it (a NaN stays out).
    if (kModes && em->mask_kind != 0) {
      MHK_UNROLL
      for (int nt = 0; nt < NT; ++nt) {
        MHK_UNROLL
        for (int e = 0; e < 4; ++e) {
          const int col = n0 + nt * 8 + 2 * t + (e & 1);
          const bool hidden = hidden_at(col, e >> 1);
          const float bias = mask_bias_log2(*em, rows.mask_row[q_row0 + 16 * mt + g + 8 * (e >> 1)], hidden ? 0 : col);
          if (!hidden) s[mt][nt][e] += bias;
        }
      }
    }

    MHK_UNROLL
    for (int hh = 0; hh < 2; ++hh) {
      float mx = m_run[mt][hh];
      MHK_UNROLL
      for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * hh], s[mt][nt][2 * hh + 1]));
      mx = quad_max(mx);
      // A row that has seen only masked keys keeps max -inf; exponentiate against 0 instead so
      // that exp2(-inf - -inf) never makes a NaN (its p and alpha are then 0).
      const float m_use = (mx == -INFINITY) ? 0.f : mx;
      const float alpha = fast_exp2(m_run[mt][hh] - m_use);
      m_run[mt][hh] = mx;
      float rs = 0.f;
      MHK_UNROLL
      for (int nt = 0; nt < NT; ++nt) {
        MHK_UNROLL
        for (int e = 0; e < 2; ++e) {
          const float pv = fast_exp2(s[mt][nt][2 * hh + e] - m_use);
          s[mt][nt][2 * hh + e] = pv;
          rs += pv;
          if (kModes && em->dropout)
            s[mt][nt][2 * hh + e] = pv * dropout_factor(*em, rows.drop[q_row0 + 16 * mt + g + 8 * hh],
                                                        n0 + nt * 8 + 2 * t + e);
        }
      }
      // Per-lane partial row sums; the four lanes of a row are added once, at the end.
      l_run[mt][hh] = l_run[mt][hh] * alpha + rs;
      MHK_UNROLL
      for (int dt = 0; dt < D / 8; ++dt) {
        acc[mt][dt][2 * hh] *= alpha;
        acc[mt][dt][2 * hh + 1] *= alpha;
      }
    }
  }

  mma_regs_x_rows_mt<Elem, D, kBlockN, MT>(acc, s, sV, 0, lane);
}

// Packed sequences (kModes only): attn_fwd_modes_kernel hands the body the call of one sequence
// s as batch element s of B = num_seqs elements whose operands start at the sequence's first
// token (batch strides 0) with Lq / Lk the sequence's lengths; these fields say what the body
// cannot read from that view: the grid's query tiles per (sequence, KV head), which cover
// max_seqlen_q (a tile past Lq_s exits), and the lse row of the sequence's first query token in
// the packed (1, H, Tq) lse, whose head stride is Tq.
struct SeqView {
  bool on = false;
  int n_mblocks = 0;
  int64_t lse_row0 = 0, lse_head_stride = 0;
};

// The body of the forward kernels. kModes: the call has attn_mask, dropout, a score modifier or
// packed sequences (needs_modes_kernel); it is a separate kernel (attn_fwd_modes_kernel), so that
// the plain one is exactly the kernel without them.
template <typename Elem, int D, bool kModes>
MHK_DEVICE void attn_fwd_body(const FwdParams& p, const SeqView& sv = SeqView{}) {
  using Cfg = FwdConfig<D, kModes>;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kThreads = Cfg::kThreads, MT = Cfg::kMTiles;
  MHK_DYNAMIC_SMEM(smem);
  Elem* sQ = reinterpret_cast<Elem*>(smem);
  Elem* sK = sQ + Cfg::kQTile;      // stage s at sK + s * kKVTile
  Elem* sV = sK + 2 * Cfg::kKVTile;
  int* sLimit = reinterpret_cast<int*>(sV + 2 * Cfg::kKVTile);
  int* sLo = sLimit + kBlockM;
  int64_t* sMaskRow = reinterpret_cast<int64_t*>(sLo + kBlockM);  // kModes only
  uint32_t* sDrop = reinterpret_cast<uint32_t*>(sMaskRow + kBlockM);  // kModes only
  float* sAlibiSlope = reinterpret_cast<float*>(sDrop + kBlockM);     // kModes only
  int* sAlibiPos = reinterpret_cast<int*>(sAlibiSlope + kBlockM);     // kModes only

  const int tid = thread_index();
  const int warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int warp_row0 = warp * 16 * MT;  // first tile row of this warp

  // Block index: query tile fastest (CTAs sharing K/V run together and share L2), then
  // (b, kv head), then split.
  const int rows_total = p.group * p.Lq;
  const bool packed = kModes && sv.on;
  const int n_mblocks = packed ? sv.n_mblocks : ceil_div(rows_total, kBlockM);
  int64_t bid = block_index();
  int mb = static_cast<int>(bid % n_mblocks);
  bid /= n_mblocks;
  const int hkv = static_cast<int>(bid % p.Hkv);
  bid /= p.Hkv;
  const int b = static_cast<int>(bid % p.B);
  const int split = static_cast<int>(bid / p.B);
  if (p.causal) mb = n_mblocks - 1 - mb;  // causal: the rows with the most keys start first
  const int r0 = mb * kBlockM;
  if (packed && r0 >= rows_total) return;  // a tile past this sequence's rows; no barrier yet
  const int nrows = imin(kBlockM, rows_total - r0);
  const int Lk_b = key_length_of(p, b);  // clamped into [0, Lk]

  const RowBlockKeys rk = row_block_keys<kBlockN>(p, Lk_b, r0, nrows, split);
  const Visibility vis = rk.vis;
  const int kv_begin = rk.kv_begin, kv_end = rk.kv_end, kv_all_lo = rk.kv_all_lo, kv_all = rk.kv_all;
  const bool lo_masks = rk.lo_masks;

  // Published to the other warps by the first block_sync of the loop.
  for (int rr = tid; rr < kBlockM; rr += kThreads) {
    const int r = r0 + rr;
    sLimit[rr] = r < rows_total ? key_hi(vis, r % p.Lq) : 0;
    sLo[rr] = r < rows_total ? key_lo(vis, r % p.Lq) : 0;
    if (kModes) {
      const int h = hkv * p.group + (r < rows_total ? r / p.Lq : 0);
      const int i = r < rows_total ? r % p.Lq : 0;
      sMaskRow[rr] = p.mask != nullptr ? mask_row_offset(p, b, h, i) : 0;
      sDrop[rr] = dropout_row_hash(p, b, h, i);
      alibi_row(p, vis, b, h, i, sAlibiSlope[rr], sAlibiPos[rr]);
    }
  }
  const ExtraModes em = extra_modes_of(p);
  const ModeRows mode_rows{sMaskRow, sDrop, nullptr, sAlibiSlope, sAlibiPos};
  // Warps whose rows all lie past the end skip the math (decode: a group of 8 query heads
  // fills part of the first warp's strips only).
  const bool warp_active = r0 + warp_row0 < rows_total;

  const Elem* q = static_cast<const Elem*>(p.q);
  // The KV cache (kModes only, ../mode_params.h): batch element b reads K/V batch row
  // kv_batch_idx[b]; a paged cache holds key j in row j % page_size of page
  // block_table[b][j / page_size] (the page takes the batch stride's place).
  const bool paged = kModes && p.block_table != nullptr;
  const int kvb = kModes && p.kv_batch_idx != nullptr ? p.kv_batch_idx[b] : b;
  const int64_t kv_b = paged ? 0 : kvb;
  const Elem* k_head = static_cast<const Elem*>(p.k) + kv_b * p.k_stride.batch + hkv * p.k_stride.head;
  const Elem* v_head = static_cast<const Elem*>(p.v) + kv_b * p.v_stride.batch + hkv * p.v_stride.head;
  // 32-bit division (a page size fits an int; a 64-bit one is a long subroutine whose registers
  // pushed the D = 64 loop into local memory on sm_90).
  const int page_size = paged ? static_cast<int>(p.page_size) : 1;
  const int32_t* bt_row = paged ? p.block_table + b * p.block_table_stride : nullptr;
  auto key_offset = [&](int j, const HeadStrides& st) -> int64_t {
    if (!paged) return static_cast<int64_t>(j) * st.row;
    const int pg = j / page_size;
    return static_cast<int64_t>(bt_row[pg]) * st.batch + static_cast<int64_t>(j - pg * page_size) * st.row;
  };
  auto q_row = [&](int rr) -> const Elem* {
    const int r = r0 + rr;
    return r < rows_total ? q + packed_row_offset(p.q_stride, b, hkv, p.group, p.Lq, r) : nullptr;
  };
  // Keys at or past Lk_b are never read: hidden padding may hold anything, even NaN.
  auto load_kv = [&](int n0, int stage) {
    load_tile_async<Elem, kBlockN, D, kThreads>(sK + stage * Cfg::kKVTile, p.k, [&](int rr) -> const Elem* {
      const int j = n0 + rr;
      return j < Lk_b ? k_head + key_offset(j, p.k_stride) : nullptr;
    });
    load_tile_async<Elem, kBlockN, D, kThreads>(sV + stage * Cfg::kKVTile, p.v, [&](int rr) -> const Elem* {
      const int j = n0 + rr;
      return j < Lk_b ? v_head + key_offset(j, p.v_stride) : nullptr;
    });
  };

  float acc[MT][D / 8][4];
  float m_run[MT][2], l_run[MT][2];
  MHK_UNROLL
  for (int mt = 0; mt < MT; ++mt) {
    MHK_UNROLL
    for (int dt = 0; dt < D / 8; ++dt) acc[mt][dt][0] = acc[mt][dt][1] = acc[mt][dt][2] = acc[mt][dt][3] = 0.f;
    m_run[mt][0] = m_run[mt][1] = -INFINITY;
    l_run[mt][0] = l_run[mt][1] = 0.f;
  }

  if (kv_begin < kv_end) {
    const int n_steps = ceil_div(kv_end - kv_begin, kBlockN);
    load_tile_async<Elem, kBlockM, D, kThreads>(sQ, p.q, q_row);
    load_kv(kv_begin, 0);
    cp_async_commit();
    for (int j = 0; j < n_steps; ++j) {
      const int stage = j & 1;
      // Prefetch the next key block into the other stage while this one is used.
      if (j + 1 < n_steps) load_kv(kv_begin + (j + 1) * kBlockN, stage ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
      block_sync();
      const int n0 = kv_begin + j * kBlockN;
      const Elem* sKs = sK + stage * Cfg::kKVTile;
      const Elem* sVs = sV + stage * Cfg::kKVTile;
      if (warp_active) {
        if (n0 + kBlockN <= kv_all && n0 >= kv_all_lo)
          fwd_step<Elem, D, kBlockN, MT, kMaskNone, kModes>(sQ, warp_row0, sKs, sVs, n0, sLo, sLimit, p.scale_log2, acc,
                                                            m_run, l_run, lane, &em, mode_rows);
        else if (!lo_masks)
          fwd_step<Elem, D, kBlockN, MT, kMaskHi, kModes>(sQ, warp_row0, sKs, sVs, n0, sLo, sLimit, p.scale_log2, acc,
                                                          m_run, l_run, lane, &em, mode_rows);
        else
          fwd_step<Elem, D, kBlockN, MT, kMaskLoHi, kModes>(sQ, warp_row0, sKs, sVs, n0, sLo, sLimit, p.scale_log2, acc,
                                                            m_run, l_run, lane, &em, mode_rows);
      }
      // The next iteration's prefetch overwrites this stage.
      block_sync();
    }
  }
  cp_async_wait<0>();

  float inv[MT][2], lse[MT][2];
  MHK_UNROLL
  for (int mt = 0; mt < MT; ++mt) {
    MHK_UNROLL
    for (int hh = 0; hh < 2; ++hh) {
      // Only a sum of exactly 0 is a row without a visible key (0, -inf); a NaN sum (a NaN
      // score, which fmaxf kept out of the max) gives a NaN lse, as docs/contract.md asks.
      const float l = quad_sum(l_run[mt][hh]);
      inv[mt][hh] = l == 0.f ? 0.f : 1.f / l;
      lse[mt][hh] = l == 0.f ? -INFINITY : (m_run[mt][hh] + log2f(l)) * kLn2;
    }
  }

  if (p.num_splits == 1) {
    // Stage the output in the Q tile (each warp overwrites only its own rows, which only it
    // has read) and write 16-byte rows.
    MHK_UNROLL
    for (int mt = 0; mt < MT; ++mt) stage_accumulator<Elem, D>(sQ, warp_row0 + 16 * mt, acc[mt], inv[mt], lane);
    block_sync();
    Elem* o = static_cast<Elem*>(p.o);
    store_tile<Elem, kBlockM, D, kThreads>(sQ, [&](int rr) -> Elem* {
      const int r = r0 + rr;
      return r < rows_total ? o + packed_row_offset(p.o_stride, b, hkv, p.group, p.Lq, r) : nullptr;
    });
    if (t == 0) {
      MHK_UNROLL
      for (int mt = 0; mt < MT; ++mt) {
        MHK_UNROLL
        for (int hh = 0; hh < 2; ++hh) {
          const int r = r0 + warp_row0 + 16 * mt + g + 8 * hh;
          if (r < rows_total)
            p.lse[packed ? sv.lse_row0 + (hkv * p.group + r / p.Lq) * sv.lse_head_stride + r % p.Lq
                         : packed_row_linear(b, p.H, hkv, p.group, p.Lq, r)] = lse[mt][hh];
        }
      }
    }
  } else {
    const int64_t split_rows = static_cast<int64_t>(split) * p.B * p.H * p.Lq;
    MHK_UNROLL
    for (int mt = 0; mt < MT; ++mt) {
      MHK_UNROLL
      for (int hh = 0; hh < 2; ++hh) {
        const int r = r0 + warp_row0 + 16 * mt + g + 8 * hh;
        if (r >= rows_total) continue;
        const int64_t row = split_rows + packed_row_linear(b, p.H, hkv, p.group, p.Lq, r);
        float* dst = p.o_partial + row * D;
        MHK_UNROLL
        for (int dt = 0; dt < D / 8; ++dt) {
          float2 val;
          val.x = acc[mt][dt][2 * hh] * inv[mt][hh];
          val.y = acc[mt][dt][2 * hh + 1] * inv[mt][hh];
          *reinterpret_cast<float2*>(dst + dt * 8 + 2 * t) = val;
        }
        if (t == 0) p.lse_partial[row] = lse[mt][hh];
      }
    }
  }
}

template <typename Elem, int D>
__global__ void MHK_LAUNCH_BOUNDS(FwdConfig<D>::kThreads, 2) attn_fwd_kernel(const FwdParams p) {
  attn_fwd_body<Elem, D, false>(p);
}

template <typename Elem, int D>
__global__ void MHK_LAUNCH_BOUNDS(FwdConfig<D>::kThreads, 2) attn_fwd_modes_kernel(const FwdParams p) {
  if (p.cu_seqlens_q == nullptr) {
    attn_fwd_body<Elem, D, true>(p);
    return;
  }
  // Packed sequences: this CTA's sequence s (the grid: query tiles of max_seqlen_q fastest, then
  // KV heads, then sequences) as batch element s of a view that starts at its first tokens, so
  // that the body's positions, causal offset Lk_s - Lq_s, dropout hash (b = s) and ALiBi slope
  // row s are the sequence's, and no key of another sequence is ever addressed (j < Lk_s).
  SeqView sv;
  sv.on = true;
  sv.n_mblocks = ceil_div(p.group * static_cast<int>(p.max_seqlen_q), FwdConfig<D, true>::kBlockM);
  const int s = static_cast<int>(block_index() / (static_cast<int64_t>(sv.n_mblocks) * p.Hkv));
  const int q0 = p.cu_seqlens_q[s], k0 = p.cu_seqlens_k[s];
  FwdParams ps = p;
  ps.q = static_cast<const Elem*>(p.q) + static_cast<int64_t>(q0) * p.q_stride.row;
  ps.k = static_cast<const Elem*>(p.k) + static_cast<int64_t>(k0) * p.k_stride.row;
  ps.v = static_cast<const Elem*>(p.v) + static_cast<int64_t>(k0) * p.v_stride.row;
  ps.o = static_cast<Elem*>(p.o) + static_cast<int64_t>(q0) * p.o_stride.row;
  ps.q_stride.batch = ps.k_stride.batch = ps.v_stride.batch = ps.o_stride.batch = 0;
  ps.B = static_cast<int>(p.num_seqs);
  ps.Lq = p.cu_seqlens_q[s + 1] - q0;
  ps.Lk = p.cu_seqlens_k[s + 1] - k0;
  ps.key_lengths = nullptr;  // refused with packing
  sv.lse_row0 = q0;
  sv.lse_head_stride = p.Lq;  // Tq
  attn_fwd_body<Elem, D, true>(ps, sv);
}

// ---- decode: few packed rows per (batch, KV head) -------------------------------------------
// capabilities.h (cuda_decode_tiles, use_cuda_decode_fwd) argues the configuration: one m16 row
// block per CTA, each warp takes kWarpN keys of every K/V tile (not a strip of rows), kStages
// tiles in a cp.async ring, and the warps' partial softmax states merge at the end.
template <int D>
struct FwdDecodeConfig {
  static_assert(D % 16 == 0 && D >= 16 && D <= 128, "head dim: multiple of 16 up to 128");
  static constexpr int kWarps = caps::kCudaDecodeWarps;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBlockM = caps::cuda_decode_tiles(D).m;  // packed query rows per CTA
  static constexpr int kBlockN = caps::cuda_decode_tiles(D).n;  // keys per tile (all warps)
  static constexpr int kStages = caps::cuda_decode_tiles(D).stages;
  static constexpr int kWarpN = kBlockN / kWarps;  // keys of a tile per warp
  static_assert(kBlockM == 16, "one m16 row block per CTA: every warp multiplies all its rows");
  static_assert(kWarpN % 16 == 0 && kWarpN * kWarps == kBlockN, "a warp's keys: whole k16 steps of P V");
  static_assert(kStages >= 2, "at least one tile in flight while one is used");
  static constexpr int kPitch = TilePitch<D>::kPitch;
  static constexpr int kQTile = kBlockM * kPitch;   // elements
  static constexpr int kKVTile = kBlockN * kPitch;  // elements; stage s: K at 2s, V at 2s + 1
  static constexpr int kRingBytes = kStages * 2 * kKVTile * 2;
  // The merge after the loop overlays the ring: per warp its 16 x D fp32 partial output, then
  // per warp and row its running max (base 2) and sum.
  static constexpr int kMergeBytes = kWarps * kBlockM * (D + 2) * 4;
  static_assert(kMergeBytes <= kRingBytes, "the merge area fits in the K/V ring");
  // Q, the ring, the first and one past the last visible key of each row.
  static constexpr int kSmemBytes = kQTile * 2 + kRingBytes + 2 * kBlockM * 4;
  static constexpr int kLaunchSmemBytes = kSmemBytes;
};

template <typename Elem, int D>
MHK_DEVICE void attn_fwd_decode_body(const FwdParams& p) {
  using Cfg = FwdDecodeConfig<D>;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kThreads = Cfg::kThreads;
  constexpr int kStages = Cfg::kStages, kWarpN = Cfg::kWarpN, kWarps = Cfg::kWarps;
  MHK_DYNAMIC_SMEM(smem);
  Elem* sQ = reinterpret_cast<Elem*>(smem);
  Elem* sRing = sQ + Cfg::kQTile;
  int* sLimit = reinterpret_cast<int*>(sRing + 2 * kStages * Cfg::kKVTile);
  int* sLo = sLimit + kBlockM;
  float* sAcc = reinterpret_cast<float*>(sRing);  // after the loop: [warp][row][D]
  float* sMax = sAcc + kWarps * kBlockM * D;      // [warp][row]
  float* sSum = sMax + kWarps * kBlockM;          // [warp][row]

  const int tid = thread_index();
  const int warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;

  // Block index as in attn_fwd_body: row block fastest (the CTAs of one (b, kv head, split)
  // read the same tiles and run together), then (b, kv head), then split.
  const int rows_total = p.group * p.Lq;
  const int n_mblocks = ceil_div(rows_total, kBlockM);
  int64_t bid = block_index();
  const int mb = static_cast<int>(bid % n_mblocks);
  bid /= n_mblocks;
  const int hkv = static_cast<int>(bid % p.Hkv);
  bid /= p.Hkv;
  const int b = static_cast<int>(bid % p.B);
  const int split = static_cast<int>(bid / p.B);
  const int r0 = mb * kBlockM;
  const int nrows = imin(kBlockM, rows_total - r0);
  const int Lk_b = key_length_of(p, b);  // clamped into [0, Lk]
  const RowBlockKeys rk = row_block_keys<kBlockN>(p, Lk_b, r0, nrows, split);
  const Visibility vis = rk.vis;
  const int kv_begin = rk.kv_begin, kv_end = rk.kv_end, kv_all_lo = rk.kv_all_lo, kv_all = rk.kv_all;
  const bool lo_masks = rk.lo_masks;

  // Published to the other warps by the first block_sync of the loop (or the one before the merge).
  for (int rr = tid; rr < kBlockM; rr += kThreads) {
    const int r = r0 + rr;
    sLimit[rr] = r < rows_total ? key_hi(vis, r % p.Lq) : 0;
    sLo[rr] = r < rows_total ? key_lo(vis, r % p.Lq) : 0;
  }

  const Elem* q = static_cast<const Elem*>(p.q);
  const Elem* k_head = static_cast<const Elem*>(p.k) + b * p.k_stride.batch + hkv * p.k_stride.head;
  const Elem* v_head = static_cast<const Elem*>(p.v) + b * p.v_stride.batch + hkv * p.v_stride.head;
  // Keys at or past Lk_b are never read (zero-filled): hidden padding may hold anything.
  auto load_kv = [&](int n0, int slot) {
    Elem* sK = sRing + 2 * slot * Cfg::kKVTile;
    load_rows_async<Elem, kBlockN, D, kThreads>(sK, k_head, p.k_stride.row, n0, Lk_b);
    load_rows_async<Elem, kBlockN, D, kThreads>(sK + Cfg::kKVTile, v_head, p.v_stride.row, n0, Lk_b);
  };

  float acc[1][D / 8][4];
  float m_run[1][2] = {{-INFINITY, -INFINITY}}, l_run[1][2] = {{0.f, 0.f}};
  MHK_UNROLL
  for (int dt = 0; dt < D / 8; ++dt) acc[0][dt][0] = acc[0][dt][1] = acc[0][dt][2] = acc[0][dt][3] = 0.f;

  const int n_steps = kv_begin < kv_end ? ceil_div(kv_end - kv_begin, kBlockN) : 0;
  if (n_steps > 0) {
    // Q joins the first tile's group; tiles 0 .. kStages - 2 go out before the loop.
    load_tile_async<Elem, kBlockM, D, kThreads>(sQ, p.q, [&](int rr) -> const Elem* {
      const int r = r0 + rr;
      return r < rows_total ? q + packed_row_offset(p.q_stride, b, hkv, p.group, p.Lq, r) : nullptr;
    });
    MHK_UNROLL
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < n_steps) load_kv(kv_begin + s * kBlockN, s);
      cp_async_commit();  // an empty group keeps the count of the wait below
    }
    for (int j = 0; j < n_steps; ++j) {
      // This thread's copies of tile j have landed (groups after it: kStages - 2); the barrier
      // makes every thread's visible, and every warp is done with tile j - 1, whose slot the
      // load below refills.
      cp_async_wait<kStages - 2>();
      block_sync();
      const int jn = j + kStages - 1;
      if (jn < n_steps) load_kv(kv_begin + jn * kBlockN, jn % kStages);
      cp_async_commit();
      const int slot = j % kStages;
      const int n0 = kv_begin + j * kBlockN + warp * kWarpN;  // this warp's first key
      const Elem* sKs = sRing + 2 * slot * Cfg::kKVTile + warp * kWarpN * Cfg::kPitch;
      const Elem* sVs = sKs + Cfg::kKVTile;
      if (n0 < kv_end) {
        if (n0 + kWarpN <= kv_all && n0 >= kv_all_lo)
          fwd_step<Elem, D, kWarpN, 1, kMaskNone>(sQ, 0, sKs, sVs, n0, sLo, sLimit, p.scale_log2, acc, m_run, l_run, lane);
        else if (!lo_masks)
          fwd_step<Elem, D, kWarpN, 1, kMaskHi>(sQ, 0, sKs, sVs, n0, sLo, sLimit, p.scale_log2, acc, m_run, l_run, lane);
        else
          fwd_step<Elem, D, kWarpN, 1, kMaskLoHi>(sQ, 0, sKs, sVs, n0, sLo, sLimit, p.scale_log2, acc, m_run, l_run, lane);
      }
    }
  }
  cp_async_wait<0>();
  block_sync();  // every warp is done with the ring, which the merge area overlays

  // Each warp's partial state: row max, row sum (its four lanes added), unnormalised output.
  MHK_UNROLL
  for (int hh = 0; hh < 2; ++hh) {
    const float l = quad_sum(l_run[0][hh]);
    const int rr = g + 8 * hh;
    if (t == 0) {
      sMax[warp * kBlockM + rr] = m_run[0][hh];
      sSum[warp * kBlockM + rr] = l;
    }
    float* dst = sAcc + (warp * kBlockM + rr) * D;
    MHK_UNROLL
    for (int dt = 0; dt < D / 8; ++dt) {
      dst[dt * 8 + 2 * t] = acc[0][dt][2 * hh];
      dst[dt * 8 + 2 * t + 1] = acc[0][dt][2 * hh + 1];
    }
  }
  block_sync();

  // Merge, kThreads / kBlockM threads per row, each a contiguous run of kCols columns; the
  // warps are added in order 0..3 whatever the schedule (deterministic). A warp that saw no
  // visible key of the row (sum 0) adds nothing, not even 0 * its output (which 0 * NaN in P V
  // may have made NaN). A NaN score leaves its warp's max alone (fmaxf) and makes its sum NaN:
  // that warp is kept, so the row's sum, output and lse turn NaN (docs/contract.md "NaN and
  // inf"), and only a sum of exactly 0 makes a dead row (0 and -inf).
  constexpr int kPerRow = kThreads / kBlockM;
  constexpr int kCols = D / kPerRow;
  static_assert(kCols % 2 == 0 && kCols * kPerRow == D, "columns per merging thread");
  const int rr = tid / kPerRow;
  const int c0 = (tid % kPerRow) * kCols;
  const int r = r0 + rr;
  float mx = -INFINITY;
  MHK_UNROLL
  for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, sMax[w * kBlockM + rr]);
  float wgt[kWarps];
  float l = 0.f;
  MHK_UNROLL
  for (int w = 0; w < kWarps; ++w) {
    const float lw = sSum[w * kBlockM + rr];
    wgt[w] = lw == 0.f ? 0.f : fast_exp2(sMax[w * kBlockM + rr] - mx);
    l += lw == 0.f ? 0.f : wgt[w] * lw;
  }
  const float inv = l == 0.f ? 0.f : 1.f / l;
  const float lse = l == 0.f ? -INFINITY : (mx + log2f(l)) * kLn2;
  float out[kCols];
  MHK_UNROLL
  for (int c = 0; c < kCols; ++c) out[c] = 0.f;
  MHK_UNROLL
  for (int w = 0; w < kWarps; ++w) {
    if (sSum[w * kBlockM + rr] == 0.f) continue;
    const float* src = sAcc + (w * kBlockM + rr) * D + c0;
    MHK_UNROLL
    for (int c = 0; c < kCols; ++c) out[c] += wgt[w] * src[c];
  }
  if (r >= rows_total) return;  // no barrier follows
  if (p.num_splits == 1) {
    Elem* o = static_cast<Elem*>(p.o) + packed_row_offset(p.o_stride, b, hkv, p.group, p.Lq, r) + c0;
    MHK_UNROLL
    for (int c = 0; c < kCols; c += 2) {
      const uint32_t packed = ElemTraits<Elem>::pack2(out[c] * inv, out[c + 1] * inv);
      *reinterpret_cast<uint32_t*>(o + c) = packed;
    }
    if (c0 == 0) p.lse[packed_row_linear(b, p.H, hkv, p.group, p.Lq, r)] = lse;
  } else {
    const int64_t row = static_cast<int64_t>(split) * p.B * p.H * p.Lq + packed_row_linear(b, p.H, hkv, p.group, p.Lq, r);
    float* dst = p.o_partial + row * D + c0;
    MHK_UNROLL
    for (int c = 0; c < kCols; c += 2) {
      float2 val;
      val.x = out[c] * inv;
      val.y = out[c + 1] * inv;
      *reinterpret_cast<float2*>(dst + c) = val;
    }
    if (c0 == 0) p.lse_partial[row] = lse;
  }
}

template <typename Elem, int D>
__global__ void MHK_LAUNCH_BOUNDS(FwdDecodeConfig<D>::kThreads, 2) attn_fwd_decode_kernel(const FwdParams p) {
  attn_fwd_decode_body<Elem, D>(p);
}

template <typename Elem, int D, bool kModes>
cudaError_t launch_attn_fwd_main(const FwdParams& p, int64_t grid, cudaStream_t stream) {
  using Cfg = FwdConfig<D, kModes>;
  constexpr int kBytes = Cfg::kLaunchSmemBytes;
  auto kernel = kModes ? attn_fwd_modes_kernel<Elem, D> : attn_fwd_kernel<Elem, D>;
  cudaError_t err = opt_in_dynamic_smem<kTagFwd + (kModes ? kTagModes : 0), Elem, D>(kernel, kBytes);
  if (err != cudaSuccess) return err;
  launch_kernel(kernel, grid, Cfg::kThreads, kBytes, stream, p);
  return cudaGetLastError();
}

template <typename Elem, int D>
cudaError_t run_attn_fwd(const FwdParams& p, cudaStream_t stream) {
  using Cfg = FwdConfig<D>;
  if (p.cu_seqlens_q != nullptr) {
    // Packed sequences: the modes kernel over (query tile of max_seqlen_q, KV head, sequence);
    // no split-K (the combine kernel's rows are the dense (B, H, Lq) ones).
    if (p.num_splits != 1) return cudaErrorInvalidValue;
    const int64_t vgrid = static_cast<int64_t>(ceil_div(p.group * static_cast<int>(p.max_seqlen_q), FwdConfig<D, true>::kBlockM)) *
                          p.Hkv * p.num_seqs;
    if (vgrid == 0) return cudaSuccess;
    if (vgrid > 0x7fffffff) return cudaErrorInvalidConfiguration;
    return launch_attn_fwd_main<Elem, D, true>(p, vgrid, stream);
  }
  const int64_t n_mblocks = ceil_div(p.group * p.Lq, Cfg::kBlockM);
  const int64_t grid = n_mblocks * p.Hkv * p.B * p.num_splits;
  if (grid == 0) return cudaSuccess;
  if (grid > 0x7fffffff) return cudaErrorInvalidConfiguration;
  const bool modes = needs_modes_kernel(p);
  cudaError_t err;
  if (caps::use_cuda_decode_fwd(static_cast<int64_t>(p.group) * p.Lq, modes)) {
    using Dc = FwdDecodeConfig<D>;
    const int64_t dgrid = ceil_div(p.group * p.Lq, Dc::kBlockM) * static_cast<int64_t>(p.Hkv) * p.B * p.num_splits;
    if (dgrid > 0x7fffffff) return cudaErrorInvalidConfiguration;
    err = opt_in_dynamic_smem<kTagFwdDecode, Elem, D>(attn_fwd_decode_kernel<Elem, D>, Dc::kLaunchSmemBytes);
    if (err == cudaSuccess) {
      launch_kernel(attn_fwd_decode_kernel<Elem, D>, dgrid, Dc::kThreads, Dc::kLaunchSmemBytes, stream, p);
      err = cudaGetLastError();
    }
  } else {
    err = modes ? launch_attn_fwd_main<Elem, D, true>(p, grid, stream) : launch_attn_fwd_main<Elem, D, false>(p, grid, stream);
  }
  if (err != cudaSuccess || p.num_splits == 1) return err;
  const int64_t rows = static_cast<int64_t>(p.B) * p.H * p.Lq;
  launch_kernel(attn_fwd_combine_kernel<Elem, D>, (rows + 3) / 4, 128, 0, stream, p);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace mhakern

// The body of one generated instantiation file (tools/generate_kernels.py): the forward for
// element tag `tag` (capabilities.h: MHK_CUDA_ELEM_TYPE_<tag>) and head dim D.
#define MHK_DEFINE_ATTN_FWD(tag, D)                                                     \
  namespace mhakern {                                                                   \
  namespace cuda {                                                                      \
  cudaError_t run_attn_fwd_##tag##_d##D(const FwdParams& p, cudaStream_t s) {           \
    return run_attn_fwd<MHK_CUDA_ELEM_TYPE_##tag, D>(p, s);                             \
  }                                                                                     \
  }                                                                                     \
  }
