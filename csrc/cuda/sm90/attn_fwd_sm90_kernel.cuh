// Forward attention for sm_90a (Hopper): wgmma, TMA and an mbarrier pipeline, warp-specialised.
//
// Work items: (batch b, kv head hkv, tile of kBlockM = 128 packed query rows, key split). A
// persistent grid (capabilities.h kSm90FwdPersistent) of one CTA per SM loops over them, heaviest
// first (fwd_work_block); 3 warpgroups:
//   warpgroup 0, the producer: gives up registers (setmaxnreg.dec 40); one thread streams the
//     K and V tiles of kBlockN keys (128; 80 at D 256, see FwdConfigSm90) through two rings of
//     shared-memory stages, kStagesK for K and kStagesV for V, with cp.async.bulk.tensor (4-D
//     tensor maps over (D, Lk, Hkv, B), 128-byte swizzle, one box per 64 columns of D), each
//     stage guarded by a "full" mbarrier (transaction bytes) and an "empty" one (the consumers'
//     arrivals), in the order the consumers need them: K of tile 0, then K of tile it and V of
//     tile it - 1; its warp zeroes the values of the keys past a batch element's key length
//     that a tile brings in (see the producer); its other three warps load each item's Q;
//   warpgroups 1 and 2, the consumers (setmaxnreg.inc 232): 64 query rows each. Per key tile:
//     S = Q K^T by wgmma m64n{kBlockN}k16 (Q and K from shared memory), the online softmax in fp32
//     registers (base 2, masked only on tiles that cross a row's visible limit), P converted
//     in registers into wgmma's A fragment, O += P V by wgmma m64nDk16 (V N-major from shared
//     memory). K's stage is released as soon as S has landed, V's once P V has (separate
//     pipelines: a K stage is not held through the P V that follows it). The softmax of one
//     tile runs while the previous tile's P V is in flight (intra-warpgroup overlap, see the
//     main loop).
// Q is loaded per item by the producer's warps 1-3 with plain 16-byte loads (its packed rows span
// query heads, a shape no tensor map describes) into the same swizzled layout, then
// fence.proxy.async, one consumer's half at a time, as soon as that consumer's last S of the
// previous item has landed (a full and an empty mbarrier per half). The rings and all barrier
// phases run on from item to item, so the next item's first K/V tiles load under this one's end.
//
// Semantics are those of the mma.sync family (../common/attn_params.h): bottom-right causal per batch
// element, key_lengths clamped into [0, Lk], the query heads of a GQA/MQA group packed into rows
// (r = (h - hkv * group) * Lq + i), lse in natural log, rows that see no key give 0 and -inf.
// Key tiles past every row's visible limit are never loaded (causal tiles skipped).
//
// Split-K (long keys, few query tiles): the item of split `split` of num_splits takes an equal
// share of the key tiles and writes fp32 partials (o_partial, lse_partial of ../common/attn_params.h),
// merged by the combine kernel both families share (../common/aux_kernels.cuh), which only reads them.
//
// The two consumer warpgroups take turns issuing their products (ping-pong, named barriers).
//
// Packed sequences (attn_fwd_sm90_varlen_kernel, the same body with kVarlen; ModeParams'
// cu_seqlens_q / _k): the work items are (row tile of the longest sequence's packed rows, KV
// head, sequence), seq_tile_work; each is batch element 0 of a dense call of the sequence's
// lengths whose tokens start at its first query and key token: K/V boxes at the key row k0 + n0,
// bottom-right causal per sequence (Lk_s - Lq_s), Q read, O and lse written for the sequence's
// rows only. The tile holding the sequence's end brings in the next sequence's first keys: masked
// as keys past Lk_s, their V rows zeroed as for a key length (a NaN or inf there must not reach
// P V); no tile wholly past the sequence's visible keys is loaded. Row tiles past a sequence's
// rows are skipped by every role. Unsplit; no top-left alignment (those go to mma.sync).
//
// Not done here: the other modes of docs/contract.md and the backward (the mma.sync family
// serves those). The host uses this family only where it serves the call.
//
// The parts, one purpose each (this file composes them into the two kernels):
//   fwd_config.cuh      tiles, stages, shared-memory and register plans, parameters, the
//                       diagnostic and fault switches
//   tile_scheduler.cuh  the persistent grid's work items, heaviest first, and each item's key range
//   fwd_softmax.cuh     the online softmax of a key tile and P's packing into wgmma's A fragment
//   fwd_epilogue.cuh    each row's normalisation and the stores of O and lse (or the partials)
// The pipelines (the producer's roles) and the consumers' main loop are still in the body below.
// Moved into functions of their own header, even __forceinline__ ones taking the body's state by
// reference (which kept the softmax's SASS), they compiled to different SASS: the same
// instructions in another order, which ptxas then scheduled and allocated differently. Likely
// why: their loops were the body's own (the softmax was a lambda already, a function of its own
// to the compiler), and a function's loops are optimised before it is inlined, the body's after.
#pragma once

#include "fwd_config.cuh"
#include "fwd_epilogue.cuh"
#include "fwd_softmax.cuh"
#include "tile_scheduler.cuh"

namespace mhakern {
namespace cuda {
namespace sm90 {

// The forward of both kernels below; kVarlen: packed sequences (seq_tile_work), a compile-time
// switch, so that the dense kernel's code is what it was without them.
template <typename Elem, int D, bool kVarlen>
MHK_DEVICE void attn_fwd_sm90_body(const FwdParamsSm90& P) {
#if MHK_SM90_ENABLED
  using Cfg = FwdConfigSm90<D>;
  using Tr = ElemTraits<Elem>;
  constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN;
  const FwdParams& p = P.p;
  MHK_DYNAMIC_SMEM(smem_raw);
  unsigned char* smem = smem_raw + (1024 - shared_u32(smem_raw) % 1024) % 1024;
  const int tid = thread_index();

  // The work items (primitives_sm90.cuh: row_tile_work) this CTA takes: item0, item0 + grid,
  // ..., fewer than n_items; every role walks the same sequence. One item per CTA when the grid
  // holds them all; a persistent grid (capabilities.h kSm90FwdPersistent) loops, its rings and
  // barrier phases running on from item to item.
  // (Computed where each role needs them: nothing of this lives across setmaxnreg.)
  // Packed sequences: the row tiles of the longest sequence, for every sequence.
  auto n_mtiles = [&] { return ceil_div(p.group * (kVarlen ? static_cast<int>(p.max_seqlen_q) : p.Lq), BM); };
  auto n_items = [&] {  // < 2^31 (the launcher checks)
    return (kVarlen ? static_cast<int>(p.num_seqs) : p.B) * p.Hkv * n_mtiles() * p.num_splits;
  };
  auto item0 = [] { return static_cast<int>(block_index()); };
  int split = 0, hkv = 0, b = 0, group_rows = 0, r0 = 0, Lk_b = 0, lim_min = 0, t0 = 0, n_tiles = 0;
  // The item's first query and key token and its query length (item_lq): a packed sequence's
  // (q0, k0, Lq_s); 0, 0, Lq in a dense call. (p.Lq itself there, not a copy: with a copy
  // ptxas scheduled the dense kernel's main loop differently, 4 instructions more per tile.)
  int q0 = 0, k0 = 0, seq_lq = 0;
  auto item_lq = [&] { return kVarlen ? seq_lq : p.Lq; };
  auto begin_item = [&](int item) {
    if constexpr (kVarlen) {
      const SeqTileWork sw = seq_tile_work<BM, BN>(p, n_mtiles(), item);
      const RowTileWork& w = sw.w;
      split = w.split, hkv = w.hkv, b = w.b, group_rows = w.group_rows, r0 = w.r0, Lk_b = w.Lk_b;
      lim_min = w.lim_min, t0 = w.t0, n_tiles = w.n_tiles;
      q0 = sw.q0, k0 = sw.k0, seq_lq = sw.Lq;
    } else {
      const RowTileWork w = row_tile_work<BM, BN>(p, fwd_work_block(p, n_mtiles(), item));
      split = w.split, hkv = w.hkv, b = w.b, group_rows = w.group_rows, r0 = w.r0, Lk_b = w.Lk_b;
      lim_min = w.lim_min, t0 = w.t0, n_tiles = w.n_tiles;
    }
  };
  // A packed sequence's row tile past its rows: the Q loaders and the consumers skip it
  // together (the producer loads nothing for it: no key tile), so that the Q halves' phases stay
  // paired. Never in a dense call.
  auto item_empty = [&] { return kVarlen && r0 >= group_rows; };

  unsigned char* sQ = smem;
  unsigned char* sK = smem + Cfg::kOffK;
  unsigned char* sV = smem + Cfg::kOffV;
  uint64_t* full_k = reinterpret_cast<uint64_t*>(smem + Cfg::kOffFullK);
  uint64_t* empty_k = reinterpret_cast<uint64_t*>(smem + Cfg::kOffEmptyK);
  uint64_t* full_v = reinterpret_cast<uint64_t*>(smem + Cfg::kOffFullV);
  uint64_t* empty_v = reinterpret_cast<uint64_t*>(smem + Cfg::kOffEmptyV);
  uint64_t* fix = reinterpret_cast<uint64_t*>(smem + Cfg::kOffFix);  // the straddling tile's V copies (see the producer)
  uint64_t* q_full = reinterpret_cast<uint64_t*>(smem + Cfg::kOffQFull);
  uint64_t* q_empty = reinterpret_cast<uint64_t*>(smem + Cfg::kOffQEmpty);

  if (tid == 0) {
    for (int s = 0; s < Cfg::kStagesK; ++s) {
      mbar_init(&full_k[s], 1);                       // the producer's arrive.expect_tx
      mbar_init(&empty_k[s], Cfg::kConsumers * 128);  // every consumer thread
    }
    for (int s = 0; s < Cfg::kStagesV; ++s) {
      mbar_init(&full_v[s], 1);
      mbar_init(&empty_v[s], Cfg::kConsumers * 128);
    }
    mbar_init(fix, 1);
    for (int c = 0; c < Cfg::kConsumers; ++c) {
      mbar_init(&q_full[c], Cfg::kQLoaders);
      mbar_init(&q_empty[c], 128);
    }
    fence_barrier_init();
  }

  block_sync();  // the barriers initialised, for every warpgroup

  const int wg = warpgroup_index();
  if (wg == 0) {
    // ---- producer ----
    setmaxnreg_dec<Cfg::kProducerRegs>();
    const uint32_t base = shared_u32(smem);
    if (tid < 32) {  // warp 0: lane 0 issues the copies, the whole warp clears a straddling tile
      // One ring's next stage: wait until the consumers released its previous use (passes at
      // once on the first round: a fresh barrier's phase of parity 1 counts as complete), then
      // copy tile `it` into it. Stage and parity advance as counters (no division), in every
      // lane (only lane 0 copies; the warp needs the straddling tile's stage); addresses are
      // shared-memory numbers (with 64-bit pointers the producer spilled at 24 registers).
      // (A ring's state is its stage and parity only: its addresses are base + constants.)
      struct Ring {
        int s = 0;
        uint32_t parity = 1;
      };
      auto load = [&](Ring& r, int n_stages, int off_full, int off_empty, int off_data, const TensorMap* map, int it,
                      bool first_round, uint32_t done) {
        if (tid == 0) {
          mbar_wait(base + off_empty + 8 * r.s, r.parity);
          const uint32_t bar = done != 0 ? done : base + off_full + 8 * r.s;
          if (MHK_SM90_FWD_DIAG_NO_LOADS && !first_round) {
            mbar_arrive(bar);  // diagnostic: the stage keeps its first tile's bytes
          } else {
            mbar_arrive_expect_tx(bar, Cfg::kTileBytes);
            for (int pn = 0; pn < Cfg::kPanels; ++pn)
              tma_load_4d(base + off_data + r.s * Cfg::kTileBytes + pn * Cfg::kPanelBytesKV, map, pn * 64,
                          k0 + (t0 + it) * BN, hkv, b, bar);
          }
        }
        if (++r.s == n_stages) {
          r.s = 0;
          r.parity ^= 1;
        }
      };
      Ring rk, rv;
      uint32_t fix_phase = 0;
      int round = 0;  // items this CTA has loaded (the diagnostic NO_LOADS copies round 0 only)
      for (int item = item0(), n = n_items(); item < n; item += P.grid, ++round) {
        begin_item(item);
        // The tile that holds this batch element's key length Lk_b < Lk: the tensor map
        // zero-fills only past Lk, so its keys [Lk_b, Lk) arrive as they are in memory, which
        // docs/contract.md lets hold anything. The consumers mask their scores by selecting -inf
        // (a NaN K there never reaches P), but O += P V multiplies P's zeros by V: an inf or NaN
        // V row would make 0 * inf = NaN in every row of the tile (seen on an H200). So this
        // tile's V copies complete on `fix` instead of full_v[s], the warp zeroes those V rows,
        // and lane 0 then arrives on full_v[s] (a plain arrival: no bytes left in flight). At
        // most one tile per item (none past Lk_b is loaded); -1 or out of [0, n_tiles) when none.
        // Packed sequences: the keys past the sequence's end are the next sequence's (k0 + Lk_b
        // < Tk), cleared the same way (and masked by the consumers as past Lk_b).
        const int it_clear = k0 + Lk_b < p.Lk ? Lk_b / BN - t0 : -1;
        int s_clear = -1;
        // In the order the consumers wait for them: K of tile 0; then K of tile it and V of
        // tile it - 1 (step it's operands); V of the last tile.
        for (int it = 0; it <= n_tiles; ++it) {
          if (it < n_tiles)
            load(rk, Cfg::kStagesK, Cfg::kOffFullK, Cfg::kOffEmptyK, Cfg::kOffK, &P.tma_k, it,
                 round == 0 && it < Cfg::kStagesK, 0);
          if (it > 0) {
            if (it - 1 == it_clear) s_clear = rv.s;
            load(rv, Cfg::kStagesV, Cfg::kOffFullV, Cfg::kOffEmptyV, Cfg::kOffV, &P.tma_v, it - 1,
                 round == 0 && it - 1 < Cfg::kStagesV, it - 1 == it_clear ? base + Cfg::kOffFix : 0);
          }
        }
        if (s_clear >= 0) {
          // It is the item's last tile loaded, so no later copy of the item waits for this, and
          // the consumers wait on full_v[s_clear] for it (the next item's copies wait for this
          // warp, which costs the next item's first load the clearing's time).
          mbar_wait(base + Cfg::kOffFix, fix_phase);  // the copies have landed
          fix_phase ^= 1;
          // Whole 128-byte rows [Lk_b - n0, BN) of each panel (contiguous: the 128B swizzle
          // permutes 16-byte chunks only within a row).
          const int lo = (Lk_b - (t0 + it_clear) * BN) * 128;
          unsigned char* sv = sV + s_clear * Cfg::kTileBytes;
          for (int pn = 0; pn < Cfg::kPanels; ++pn)
            for (int off = lo + tid * 16; off < Cfg::kPanelBytesKV; off += 32 * 16)
              *reinterpret_cast<uint4*>(sv + pn * Cfg::kPanelBytesKV + off) = make_uint4(0, 0, 0, 0);
          fence_proxy_async();  // the generic-proxy zeros, before wgmma (async proxy) reads them
          warp_sync_all();
          if (tid == 0) mbar_arrive(base + Cfg::kOffFullV + 8 * s_clear);
        }
      }
    } else {
      // Warps 1-3: each item's Q, one consumer's half (64 packed rows) at a time, as soon as
      // that consumer has released the previous item's (its last S landed), so that the load
      // runs under the previous item's last P V and epilogue. 16-byte chunks of packed rows
      // into the 128-byte swizzled panels (its packed rows span query heads, a shape no tensor
      // map describes); rows past the group are zeros (their results are never stored).
      const int lt = tid - 32;
      const Elem* q = static_cast<const Elem*>(p.q);
      const uint32_t q_sign = p.scale_log2 < 0.f ? 0x80008000u : 0u;
      constexpr int kChunks = D / 8;
      uint32_t parity = 1;
      for (int item = item0(), n = n_items(); item < n; item += P.grid, parity ^= 1) {
        begin_item(item);
        if (item_empty()) {
          parity ^= 1;  // undone by the loop's step: a skipped item uses no Q half
          continue;
        }
        for (int c = 0; c < Cfg::kConsumers; ++c) {
          mbar_wait(base + Cfg::kOffQEmpty + 8 * c, parity);
          for (int k = lt; k < 64 * kChunks; k += Cfg::kQLoaders) {
            const int row = c * 64 + k / kChunks, ch = k % kChunks;
            const int r = r0 + row;
            uint4 val = make_uint4(0, 0, 0, 0);
            if (r < group_rows) {
              val = *reinterpret_cast<const uint4*>(q + static_cast<int64_t>(q0) * p.q_stride.row +
                                                    packed_row_offset(p.q_stride, b, hkv, p.group, item_lq(), r) + ch * 8);
              // A negative scale: Q negated here (the sign bit of each 16-bit element, exact),
              // so that the softmax scales by |scale| and takes its row maxima on raw scores.
              val.x ^= q_sign;
              val.y ^= q_sign;
              val.z ^= q_sign;
              val.w ^= q_sign;
            }
            const int panel = ch / 8, cc = ch % 8;
            *reinterpret_cast<uint4*>(sQ + panel * Cfg::kPanelBytesQ + row * 128 + ((cc ^ (row % 8)) * 16)) = val;
          }
          fence_proxy_async();  // the generic-proxy stores of Q, before wgmma (async proxy) reads them
          mbar_arrive(base + Cfg::kOffQFull + 8 * c);
        }
      }
    }
    return;
  }

  // ---- consumers ----
  setmaxnreg_inc<Cfg::kConsumerRegs>();
  const int cw = wg - 1;
  const int t128 = tid % 128, warp = t128 / 32, lane = t128 % 32, g = lane / 4, t = lane % 4;
  // This thread's two rows of the item (accumulator rows g and g + 8 of its warp's 16), its
  // output and row state (set per item, below).
  int lim[2];
  int rows[2];
  float o[D / 2];
  float m[2], l[2];
  // The scale folded into the exponent (exp2(s * sl2 - m) by one FFMA per score, the row maxima
  // taken on raw scores): sl2 > 0 always, Q having been negated for a negative scale; a zero
  // scale becomes the smallest normal float, which changes no exponent by more than 2^-100
  // (|s| < 2^26 for any finite bf16/fp16 inputs of D <= 256) and keeps a hidden key's
  // -inf * sl2 = -inf (0 * -inf would be NaN).
  const float sl2 = fmaxf(fabsf(p.scale_log2), 1.17549435e-38f);

  // Intra-warpgroup overlap: each step issues S = Q K^T of tile `it` and O += P V of tile
  // it - 1 as two commit groups, waits for the first only (wait_group 1), and masks and
  // exponentiates tile `it` while the tensor cores still run the previous tile's P V. O is
  // rescaled by this tile's alpha once that P V has landed (wait_group 0), which also frees the
  // previous tile's V stage; this tile's K stage is freed as soon as S has landed (wait_group
  // 1). The last tile's P V follows the loop.
  uint32_t pa[BN / 16][4];  // P of the previous tile in wgmma's A fragment
  // O += P V of the tile in stage s: P's accumulator fragment (two n8 chunks per k16 step) is
  // the A fragment; V's rows are keys (K of this product) in 64-element panels of D (N): 8 keys
  // per 1024-byte atom (SBO), one panel to the next (LBO).
  // Descriptors built once: the start address is the low 14 bits of a descriptor, in 16-byte
  // units, and every operand address below stays under 228 KB (< 2^14 x 16 B), so the
  // descriptor of base + delta is the base's plus delta / 16 (a constant per k-step and stage).
  // (cw is warp-uniform to ptxas, warpgroup_index: these live in uniform registers.)
  const uint32_t sbase = warp_uniform(shared_u32(smem));
  const uint64_t dq0 = desc_bits(sbase + cw * 64 * 128, 16, 1024);
  const uint64_t dk0 = desc_bits(sbase + Cfg::kOffK, 16, 1024);
  const uint64_t dv0 = desc_bits(sbase + Cfg::kOffV, Cfg::kPanelBytesKV, 1024);
  auto issue_pv = [&](int s) {
    const uint64_t dv = dv0 + static_cast<uint64_t>(s * (Cfg::kTileBytes >> 4));
    MHK_UNROLL
    for (int ks = 0; ks < BN / 16; ++ks) wgmma_rs_tb<D, Elem>(o, pa[ks], dv + ((ks * 16 * 128) >> 4));
  };

  // S = Q K^T of the tile in stage s (one commit group's worth of wgmma).
  auto issue_s = [&](float (&sc)[BN / 2], int s) {
    const uint64_t dk = dk0 + static_cast<uint64_t>(s * (Cfg::kTileBytes >> 4));
    MHK_UNROLL
    for (int kk = 0; kk < D / 16; ++kk) {
      const int pn = kk / 4, off = (kk % 4) * 32;  // 16 elements of D = 32 bytes inside a 128-byte row
      wgmma_ss<BN, Elem>(sc, dq0 + ((pn * Cfg::kPanelBytesQ + off) >> 4),
                         dk + ((pn * Cfg::kPanelBytesKV + off) >> 4), kk > 0 ? 1 : 0);
    }
  };
  // The first of this CTA's tiles that crosses a row's limit: tile t0 + it needs the mask iff
  // (t0 + it + 1) BN > lim_min, i.e. it >= lim_min / BN - t0 (C++ division; lim_min < BN gives
  // every tile, as it should). One compare per tile instead of the multiply-add-compare.
  int it_mask = 0;  // per item, below
  // The softmax of tile t0 + it in place (fwd_softmax.cuh), and its P into pa.
  auto softmax = [&](float (&sc)[BN / 2], int it, float (&alpha)[2]) {
    fwd_softmax_tile<BN>(sc, it, alpha, m, l, lim, it_mask, t0, t, sl2);
  };
  auto pack_p = [&](const float (&sc)[BN / 2]) { fwd_pack_p<Elem, BN>(pa, sc); };

  // Ping-pong: the two consumer warpgroups take turns issuing their wgmma batches, so that the
  // tensor cores run one warpgroup's products while the other does its softmax. A turn is
  // taken (bar.sync on its own barrier, with the other's arrival: 256 threads) right before a
  // batch and passed (bar.arrive on the other's) right after issuing it. Both make the same
  // number of batches (n_tiles + 1); consumer 1 passes first so that consumer 0 starts.
  auto take_turn = [&] { named_bar_sync(Cfg::kBarTurn + cw, 2 * 128); };
  auto pass_turn = [&] { named_bar_arrive(Cfg::kBarTurn + (1 - cw), 2 * 128); };
  if (cw == 1) pass_turn();

  // The barriers by shared address, computed once: from pointers, ptxas rebuilt the aligned
  // base of shared memory in every iteration (~20 instructions per tile).
  const uint32_t full_k0 = sbase + Cfg::kOffFullK, empty_k0 = sbase + Cfg::kOffEmptyK;
  const uint32_t full_v0 = sbase + Cfg::kOffFullV, empty_v0 = sbase + Cfg::kOffEmptyV;
  const uint32_t q_full0 = sbase + Cfg::kOffQFull + 8 * cw, q_empty0 = sbase + Cfg::kOffQEmpty + 8 * cw;
  // The K stage of the next K tile and the V stage of the next V tile, with their full
  // barriers' parities, advanced as counters (no division), from item to item.
  int sk = 0, sv = 0;
  uint32_t phase_k = 0, phase_v = 0, phase_q = 0;
  auto next_k = [&] {
    sk = sk + 1 == Cfg::kStagesK ? 0 : sk + 1;
    phase_k ^= sk == 0 ? 1u : 0u;
  };
  for (int item = item0(), n = n_items(); item < n; item += P.grid) {
    begin_item(item);
    if (item_empty()) continue;
    MHK_UNROLL
    for (int h = 0; h < 2; ++h) {
      rows[h] = r0 + cw * 64 + warp * 16 + g + 8 * h;
      lim[h] = rows[h] < group_rows ? visible_limit(rows[h] % item_lq(), Lk_b, item_lq(), p.causal) : 0;
    }
    it_mask = lim_min / BN - t0;
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.f;
    mbar_wait(q_full0, phase_q);  // this item's Q half
    phase_q ^= 1;
    if (MHK_SM90_FWD_FAULT(3)) mbar_arrive(q_empty0);
    // The first tile on its own (O is still 0), so that the loop body has no branch around its
    // wgmma: ptxas serialises every wgmma of a loop whose pipeline it cannot follow.
    int sk_prev = sk;  // (the coupled_kv diagnostic: the previous K stage, released after P V)
    if (n_tiles > 0) {
      mbar_wait(full_k0 + 8 * sk, phase_k);
      float sc[BN / 2];
      float alpha[2];
      take_turn();
      wgmma_fence();
      issue_s(sc, sk);
      wgmma_commit();
      pass_turn();
      if (MHK_SM90_FWD_FAULT(1)) mbar_arrive(empty_k0 + 8 * sk);
      wgmma_wait<0>();
      if (!MHK_SM90_FWD_FAULT(1) && !MHK_SM90_FWD_DIAG_COUPLED_KV) mbar_arrive(empty_k0 + 8 * sk);  // S landed: K's stage is free
      softmax(sc, 0, alpha);
      pack_p(sc);
      sk_prev = sk;
      next_k();
    }
    for (int it = 1; it < n_tiles; ++it) {
      mbar_wait(full_k0 + 8 * sk, phase_k);
      mbar_wait(full_v0 + 8 * sv, phase_v);
      float sc[BN / 2];
      float alpha[2];
      take_turn();
      wgmma_fence();  // one fence for the batch: o was rescaled and pa written since the last wait
      issue_s(sc, sk);
      wgmma_commit();
      issue_pv(sv);
      wgmma_commit();
      pass_turn();
      if (MHK_SM90_FWD_FAULT(1)) mbar_arrive(empty_k0 + 8 * sk);
      wgmma_wait<1>();  // S of this tile is complete; the previous tile's P V may still run
      if (!MHK_SM90_FWD_FAULT(1) && !MHK_SM90_FWD_DIAG_COUPLED_KV) mbar_arrive(empty_k0 + 8 * sk);  // K's stage is free
      softmax(sc, it, alpha);
      // ptxas otherwise schedules the P V wait above the whole softmax (seen in the SASS: none of
      // the loop's exps ran while P V was in flight): a shared store it cannot prove dead, of a
      // value the softmax computes last, must stay before the wait (tools/check_cuda_build.py
      // counts the exps between the two waits).
      if (MHK_SM90_FWD_PIN_SOFTMAX) pin_before_wait(l[0] + l[1], p.num_splits);
      if (MHK_SM90_FWD_FAULT(2)) mbar_arrive(empty_v0 + 8 * sv);
      wgmma_wait<0>();  // the previous tile's P V has landed in o
      if (!MHK_SM90_FWD_FAULT(2)) mbar_arrive(empty_v0 + 8 * sv);  // and its V stage is free
      if (MHK_SM90_FWD_DIAG_COUPLED_KV) mbar_arrive(empty_k0 + 8 * sk_prev);  // diagnostic: K held as long as V
      sv = sv + 1 == Cfg::kStagesV ? 0 : sv + 1;
      phase_v ^= sv == 0 ? 1u : 0u;
      if (MHK_SM90_FWD_DIAG_COUPLED_KV) sk_prev = sk;
      next_k();
      MHK_UNROLL
      for (int i = 0; i < D / 2; ++i) o[i] *= alpha[(i % 4) / 2];
      pack_p(sc);
    }
    // Every S of the item has landed: its Q half may be refilled with the next item's, under the
    // last P V and the epilogue.
    if (!MHK_SM90_FWD_FAULT(3)) mbar_arrive(q_empty0);
    if (n_tiles > 0) {
      mbar_wait(full_v0 + 8 * sv, phase_v);  // V of the last tile
      take_turn();
      wgmma_fence();
      issue_pv(sv);
      wgmma_commit();
      pass_turn();
      if (MHK_SM90_FWD_FAULT(2)) mbar_arrive(empty_v0 + 8 * sv);
      wgmma_wait<0>();
      if (!MHK_SM90_FWD_FAULT(2)) mbar_arrive(empty_v0 + 8 * sv);
      if (MHK_SM90_FWD_DIAG_COUPLED_KV) mbar_arrive(empty_k0 + 8 * sk_prev);
      sv = sv + 1 == Cfg::kStagesV ? 0 : sv + 1;
      phase_v ^= sv == 0 ? 1u : 0u;
    }

    // ---- epilogue: normalise, store O and lse (or this split's fp32 partials) ----
    fwd_epilogue<Elem, D, kVarlen>(p, o, m, l, rows, group_rows, hkv, b, split, q0, seq_lq, t);
  }  // items
#endif  // MHK_SM90_ENABLED
}

template <typename Elem, int D>
__global__ void MHK_LAUNCH_BOUNDS(FwdConfigSm90<D>::kThreads, 1)
    attn_fwd_sm90_kernel(const MHK_GRID_CONSTANT FwdParamsSm90 P) {
  attn_fwd_sm90_body<Elem, D, false>(P);
}

// Packed sequences (cu_seqlens_q / _k): the same forward over seq_tile_work's items.
template <typename Elem, int D>
__global__ void MHK_LAUNCH_BOUNDS(FwdConfigSm90<D>::kThreads, 1)
    attn_fwd_sm90_varlen_kernel(const MHK_GRID_CONSTANT FwdParamsSm90 P) {
  attn_fwd_sm90_body<Elem, D, true>(P);
}

}  // namespace sm90
}  // namespace cuda
}  // namespace mhakern
