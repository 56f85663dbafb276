// Fused attention backward on mma.sync (FlashAttention-2's scheme): one CTA per key block
// computes that block's dK and dV and its share of every row block's dQ, with five matrix
// products per (row block, key block) tile instead of the split kernels' seven
// (attn_bwd_kernel.cuh recomputes S = Q K^T and dP = dO V^T in its dQ pass):
//   S^T = K Q^T, dP^T = V dO^T            (per warp: its 16 keys x the row block)
//   dV += P^T dO, dK += dS^T Q             (registers, summed over the whole group's rows)
//   dQ_part = dS K                         (dS through shared memory; all warps)
// and dQ_part is added into a global fp32 workspace dq_accum with red.global.add.f32
// (dq_accum.cuh); attn_bwd_fused_convert_kernel scales it and writes dQ in the element type.
//
// Order of the dQ adds: deterministic by default (capabilities.h CudaBwdKernel): the key blocks
// that see a row block add to it one after the other in key order (a counter per row block,
// dq_wait_turn / dq_pass_turn), so every element's fp32 sum is formed in one order, whatever the
// schedule: bit-identical run to run. kBwdFusedAtomic skips the turns (faster, not bit-stable).
//
// GQA: the CTA walks every packed query row of its KV head's group, so dK/dV are summed over the
// group in registers, no atomics. Masking, key lengths, causal in both alignments and windows
// are the split kernels' (Visibility, per-element masks only on boundary tiles); the modes
// (attn_mask, dropout, the float mask's gradient, softcap, ALiBi) as in their kModes kernels, dmask written
// here from dS^T (each (row, key) element by exactly one CTA).
//
// Head dim 256 (kDSplit = 2): dK and dV of 16 keys x 256 would need 256 fp32 registers per
// thread, so two warps share each 16-key strip, each owning half of D for dK, dV and the reads
// of S^T and dP^T; their partial S^T and dP^T (sums over their half of D) meet in shared memory
// and both add them in the same order (half 0 + half 1), so both hold identical P and dS.
#pragma once

#include "../../capabilities.h"
#include "attn_bwd_kernel.cuh"  // run_attn_bwd (the split kernels, MHK_DEFINE_ATTN_BWD)
#include "../common/dq_accum.cuh"
#include "smem_opt_in.cuh"
#include "tile_io.cuh"

namespace mhakern {
namespace cuda {

// opt_in_dynamic_smem tags (smem_opt_in.cuh) of the fused kernels: + 1 unordered, + kTagModes.
constexpr int kTagBwdFused = 8;

template <int D>
struct FusedBwdConfig {
  static_assert(D % 16 == 0 && D >= 16 && D <= 256, "head dim: multiple of 16 up to 256");
  static constexpr caps::CudaFusedBwdTiles kTiles = caps::cuda_fused_bwd_tiles(D);
  static constexpr int kDSplit = kTiles.d_split;  // warps per 16-key strip (each a slice of D)
  static constexpr int kBlockN = kTiles.n;        // keys per CTA
  static constexpr int kBlockM = kTiles.m;        // packed query rows per step
  static constexpr int kKeyWarps = kBlockN / 16;
  static constexpr int kWarps = kKeyWarps * kDSplit;
  static constexpr int kThreads = 32 * kWarps;
  static_assert(kWarps == caps::kCudaFusedBwdWarps, "capabilities.h: warps of the fused backward");
  static constexpr int kDW = D / kDSplit;  // the D slice of one warp
  static_assert(kDW % 16 == 0, "D slice: whole k16 steps");
  static constexpr int kPitch = TilePitch<D>::kPitch;
  static constexpr int kSPitch = kBlockN + 8;  // dS tile [query row][key], padded like the others
  static constexpr int kKTile = kBlockN * kPitch;
  static constexpr int kQTile = kBlockM * kPitch;
  static constexpr int kNT = kBlockM / 8;  // n8 tiles of a strip's S^T
  // The dQ product (kBlockM x D) over all warps: 16-row strips, each split in column slices.
  static constexpr int kDqStrips = kBlockM / 16;
  static_assert(kWarps % kDqStrips == 0, "dQ: whole warps per strip");
  static constexpr int kDqWarpsPerStrip = kWarps / kDqStrips;
  static constexpr int kDqCols = D / kDqWarpsPerStrip;
  static_assert(kDqCols % 16 == 0, "dQ: column slices of whole n16 pairs");
  // Columns per red.add round (the accumulator of one round: kDqChunk / 2 registers; each round
  // reads the dS fragments again). 16: with 32 the D 128 kernels (dK, dV: 128 registers) spilled
  // 16-28 bytes.
  static constexpr int kDqChunk = 16;
  // Shared memory: K, V; Q and dO with two stages; dS; the D halves' partial S^T and dP^T
  // (kDSplit 2 only: per warp 2 x 16 x kBlockM fp32); per row of each stage lse2, delta, first
  // and limit key, and with kModes the mask-row and dmask-row offsets, the dropout hash, the
  // ALiBi slope and diagonal key.
  static constexpr int kExchFloats = kDSplit > 1 ? kWarps * 2 * 16 * kBlockM : 0;
  static constexpr int kTileBytes = (2 * kKTile + 4 * kQTile + kBlockM * kSPitch) * 2;
  static constexpr int kSmemBytes = kTileBytes + kExchFloats * 4 + 2 * kBlockM * 16;
  static constexpr int kModeSmemBytes = 2 * kBlockM * (8 + 8 + 4 + 4 + 4);
  static_assert(kTileBytes % 16 == 0, "fp32 areas stay aligned");
  // mma.sync m16n8k16 per warp and step: S^T and dP^T (16 keys x kBlockM over kDW), dV and dK
  // (16 x kDW over kBlockM), dQ_part (16 rows x kDqCols over kBlockN): the five products, which
  // tools/check_cuda_build.py finds in the main loop's SASS (the split kernels' seven would be
  // two more S-sized products).
  static constexpr int kMmaPerStep = 2 * kNT * (kDW / 16) + 2 * (kBlockM / 16) * (kDW / 8) + (kBlockN / 16) * (kDqCols / 8);
};

// acc (16 x 8 NT) += A[a_row0 + 0..15][col0 .. col0 + KW) * B[b_row0 + 0..8 NT)[col0 .. col0 + KW)^T,
// both row-major tiles of pitch kPitch: S^T = K Q^T over one slice of D.
template <typename Elem, int kPitch, int KW, int NT>
MHK_DEVICE void mma_strip_x_rowsT(float (&acc)[NT][4], const Elem* a_tile, int a_row0, const Elem* b_tile, int col0,
                                  int lane) {
  MHK_UNROLL
  for (int kk = 0; kk < KW / 16; ++kk) {
    uint32_t a[4];
    ldsm_x4(a, a_tile + (a_row0 + rowmajor_row(lane)) * kPitch + col0 + kk * 16 + rowmajor_col(lane));
    MHK_UNROLL
    for (int nt2 = 0; nt2 < NT / 2; ++nt2) {
      uint32_t bf[4];
      ldsm_x4(bf, b_tile + (nt2 * 16 + nk_row(lane)) * kPitch + col0 + kk * 16 + nk_col(lane));
      mma_16816<Elem>(acc[2 * nt2], a, bf[0], bf[1]);
      mma_16816<Elem>(acc[2 * nt2 + 1], a, bf[2], bf[3]);
    }
  }
}

// acc (16 x NW) += P (16 x KP in registers, C layout) * B[0 .. KP)[col0 .. col0 + NW) of a
// row-major tile of pitch kPitch: dV += P^T dO, dK += dS^T Q over one slice of D.
template <typename Elem, int kPitch, int KP, int NW>
MHK_DEVICE void mma_regs_x_cols(float (&acc)[NW / 8][4], const float (&pr)[KP / 8][4], const Elem* b_tile, int col0,
                                int lane) {
  MHK_UNROLL
  for (int kk = 0; kk < KP / 16; ++kk) {
    uint32_t a[4];
    accum_to_a<Elem>(a, pr[2 * kk], pr[2 * kk + 1]);
    MHK_UNROLL
    for (int dt2 = 0; dt2 < NW / 16; ++dt2) {
      uint32_t bf[4];
      ldsm_x4_trans(bf, b_tile + (kk * 16 + rowmajor_row(lane)) * kPitch + col0 + dt2 * 16 + rowmajor_col(lane));
      mma_16816<Elem>(acc[2 * dt2], a, bf[0], bf[1]);
      mma_16816<Elem>(acc[2 * dt2 + 1], a, bf[2], bf[3]);
    }
  }
}

// acc (16 x NW) += A[a_row0 + 0..15][0 .. KA) (row-major, pitch kAPitch) * B[0 .. KA)[col0 .. col0 + NW)
// (row-major, pitch kBPitch): dQ_part = dS K.
template <typename Elem, int kAPitch, int kBPitch, int KA, int NW>
MHK_DEVICE void mma_smem_x_cols(float (&acc)[NW / 8][4], const Elem* a_tile, int a_row0, const Elem* b_tile, int col0,
                                int lane) {
  MHK_UNROLL
  for (int kk = 0; kk < KA / 16; ++kk) {
    uint32_t a[4];
    ldsm_x4(a, a_tile + (a_row0 + rowmajor_row(lane)) * kAPitch + kk * 16 + rowmajor_col(lane));
    MHK_UNROLL
    for (int dt2 = 0; dt2 < NW / 16; ++dt2) {
      uint32_t bf[4];
      ldsm_x4_trans(bf, b_tile + (kk * 16 + rowmajor_row(lane)) * kBPitch + col0 + dt2 * 16 + rowmajor_col(lane));
      mma_16816<Elem>(acc[2 * dt2], a, bf[0], bf[1]);
      mma_16816<Elem>(acc[2 * dt2 + 1], a, bf[2], bf[3]);
    }
  }
}

// Stages a warp's 16 x NW accumulator (C layout) times mul into columns [col0, col0 + NW) of
// rows row0.. of a tile (pitch kPitch) in the element type.
template <typename Elem, int kPitch, int NW>
MHK_DEVICE void stage_cols(Elem* tile, int row0, int col0, const float (&acc)[NW / 8][4], float mul, int lane) {
  const int g = lane / 4, t = lane % 4;
  MHK_UNROLL
  for (int dt = 0; dt < NW / 8; ++dt) {
    MHK_UNROLL
    for (int hh = 0; hh < 2; ++hh) {
      const uint32_t packed = ElemTraits<Elem>::pack2(acc[dt][2 * hh] * mul, acc[dt][2 * hh + 1] * mul);
      *reinterpret_cast<uint32_t*>(tile + (row0 + g + 8 * hh) * kPitch + col0 + dt * 8 + 2 * t) = packed;
    }
  }
}

// The first key block that sees any row of row block mq (the fixed order of the dQ adds starts
// there: key block kb takes turn kb - first). Must match block_visible in the body.
template <int kBlockN>
MHK_DEVICE int first_key_block(const Visibility& vis, int rq0, int nrows, int Lq) {
  int i_lo, i_hi;
  tile_query_range(rq0, nrows, Lq, i_lo, i_hi);
  return key_lo(vis, i_lo) / kBlockN;
}

template <typename Elem, int D, bool kModes, bool kOrdered>
MHK_DEVICE void attn_bwd_fused_body(const BwdParams& p) {
  using Cfg = FusedBwdConfig<D>;
  constexpr int kBlockN = Cfg::kBlockN, kBlockM = Cfg::kBlockM, kThreads = Cfg::kThreads, kPitch = Cfg::kPitch;
  constexpr int NT = Cfg::kNT, kDW = Cfg::kDW;
  MHK_DYNAMIC_SMEM(smem);
  Elem* sK = reinterpret_cast<Elem*>(smem);
  Elem* sV = sK + Cfg::kKTile;
  Elem* sQ = sV + Cfg::kKTile;         // stage s at sQ + s * kQTile
  Elem* sdO = sQ + 2 * Cfg::kQTile;    // likewise
  Elem* sdS = sdO + 2 * Cfg::kQTile;   // [kBlockM][kSPitch]
  float* sExch = reinterpret_cast<float*>(smem + Cfg::kTileBytes);
  float* sLse2 = sExch + Cfg::kExchFloats;  // stage s at + s * kBlockM
  float* sDelta = sLse2 + 2 * kBlockM;
  int* sLimit = reinterpret_cast<int*>(sDelta + 2 * kBlockM);
  int* sLo = sLimit + 2 * kBlockM;
  int64_t* sMaskRow = reinterpret_cast<int64_t*>(sLo + 2 * kBlockM);  // kModes only
  int64_t* sDmaskRow = sMaskRow + 2 * kBlockM;                        // kModes only
  uint32_t* sDrop = reinterpret_cast<uint32_t*>(sDmaskRow + 2 * kBlockM);  // kModes only
  float* sAlibiSlope = reinterpret_cast<float*>(sDrop + 2 * kBlockM);       // kModes only
  int* sAlibiPos = reinterpret_cast<int*>(sAlibiSlope + 2 * kBlockM);       // kModes only

  const int tid = thread_index();
  const int warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int kw = warp % Cfg::kKeyWarps;  // the warp's 16-key strip
  const int ds = warp / Cfg::kKeyWarps;  // its slice of D: columns [ds * kDW, (ds + 1) * kDW)
  const int dcol0 = ds * kDW;

  // Key block fastest: a key block waits only on lower key blocks of its (batch, KV head). In
  // the ordered kernel the work item is a ticket taken at the CTA's start, so those have lower
  // tickets and their CTAs have started (dq_accum.cuh, forward progress); the ticket reaches
  // every thread through the first word of the dS tile, which the loop writes only after its
  // first barrier.
  const int n_kblocks = ceil_div(p.Lk, kBlockN);
  int64_t bid = block_index();
  if constexpr (kOrdered) {
    uint32_t* slot = reinterpret_cast<uint32_t*>(sdS);
    if (tid == 0) {
      uint32_t* tickets = p.dq_counters + caps::cuda_fused_bwd_counters(p.B, p.Hkv, p.group * p.Lq, D) - 1;
#if defined(MHAKERN_CUDA_EMULATE)
      // The emulator tests' defect 3: the work item from the block index (the protocol's old
      // assumption of block-order dispatch; tests/test_cuda_emulator.py shows it deadlock).
      if (::mhk_emu::state().defect == 3)
        *slot = static_cast<uint32_t>(bid);
      else
#endif
        *slot = take_ticket(tickets);
    }
    block_sync();
    bid = *slot;
  }
  const int kb = static_cast<int>(bid % n_kblocks);
  bid /= n_kblocks;
  const int hkv = static_cast<int>(bid % p.Hkv);
  const int b = static_cast<int>(bid / p.Hkv);
  const int n0 = kb * kBlockN;
  const int Lk_b = key_length_of(p, b);  // clamped into [0, Lk]
  const Visibility vis = visibility_of(p, Lk_b);
  const int rows_total = p.group * p.Lq;
  const int n_qblocks = ceil_div(rows_total, kBlockM);
  // The row blocks' counters of this (batch, KV head) start at counter_base (read from the
  // parameters at each use: nothing kept in registers across the loop for it).
  const int64_t counter_base = (static_cast<int64_t>(b) * p.Hkv + hkv) * n_qblocks;

  // As in the split dK/dV kernel: a query block matters when one of its rows may see a key of
  // this block; it needs per-element masks when one of its rows does not see all of them.
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

  const Elem* q = static_cast<const Elem*>(p.q);
  const Elem* dout = static_cast<const Elem*>(p.dout);
  auto load_qblock = [&](int mq, int stage) {
    const int rq0 = mq * kBlockM;
    load_tile_async<Elem, kBlockM, D, kThreads>(sQ + stage * Cfg::kQTile, p.q, [&](int rr) -> const Elem* {
      const int r = rq0 + rr;
      return r < rows_total ? q + packed_row_offset(p.q_stride, b, hkv, p.group, p.Lq, r) : nullptr;
    });
    load_tile_async<Elem, kBlockM, D, kThreads>(sdO + stage * Cfg::kQTile, p.dout, [&](int rr) -> const Elem* {
      const int r = rq0 + rr;
      return r < rows_total ? dout + packed_row_offset(p.do_stride, b, hkv, p.group, p.Lq, r) : nullptr;
    });
    for (int rr = tid; rr < kBlockM; rr += kThreads) {
      const int r = rq0 + rr;
      float lse2 = INFINITY, delta = 0.f;  // +inf zeroes P of rows past the end
      int limit = 0, first = 0;
      if (r < rows_total) {
        const int64_t lin = packed_row_linear(b, p.H, hkv, p.group, p.Lq, r);
        const float lse = p.lse[lin];
        lse2 = lse == -INFINITY ? INFINITY : lse * kLog2e;
        delta = p.delta[lin];
        limit = key_hi(vis, r % p.Lq);
        first = key_lo(vis, r % p.Lq);
      }
      const int at = stage * kBlockM + rr;
      sLse2[at] = lse2;
      sDelta[at] = delta;
      sLimit[at] = limit;
      sLo[at] = first;
      if (kModes) {
        const int h = hkv * p.group + (r < rows_total ? r / p.Lq : 0);
        const int i = r < rows_total ? r % p.Lq : 0;
        sMaskRow[at] = p.mask != nullptr ? mask_row_offset(p, b, h, i) : 0;
        sDmaskRow[at] = r < rows_total ? ((static_cast<int64_t>(b) * p.H + h) * p.Lq + i) * p.Lk : -1;
        sDrop[at] = dropout_row_hash(p, b, h, i);
        alibi_row(p, vis, b, h, i, sAlibiSlope[at], sAlibiPos[at]);
      }
    }
  };
  const ExtraModes em = extra_modes_of(p);

  int mq = n0 < Lk_b ? next_block(0) : n_qblocks;
  const int kv_read = mq < n_qblocks ? Lk_b : 0;  // keys at or past Lk_b are never read
  const Elem* k_head = static_cast<const Elem*>(p.k) + b * p.k_stride.batch + hkv * p.k_stride.head;
  const Elem* v_head = static_cast<const Elem*>(p.v) + b * p.v_stride.batch + hkv * p.v_stride.head;
  load_tile_async<Elem, kBlockN, D, kThreads>(sK, p.k, [&](int rr) -> const Elem* {
    const int j = n0 + rr;
    return j < kv_read ? k_head + static_cast<int64_t>(j) * p.k_stride.row : nullptr;
  });
  load_tile_async<Elem, kBlockN, D, kThreads>(sV, p.v, [&](int rr) -> const Elem* {
    const int j = n0 + rr;
    return j < kv_read ? v_head + static_cast<int64_t>(j) * p.v_stride.row : nullptr;
  });

  float dk[kDW / 8][4], dv[kDW / 8][4];
  MHK_UNROLL
  for (int dt = 0; dt < kDW / 8; ++dt) {
    dk[dt][0] = dk[dt][1] = dk[dt][2] = dk[dt][3] = 0.f;
    dv[dt][0] = dv[dt][1] = dv[dt][2] = dv[dt][3] = 0.f;
  }

  // The dQ product's share of this warp: strip dq_strip of the row block, columns
  // [dq_col0, dq_col0 + kDqCols).
  const int dq_strip = warp / Cfg::kDqWarpsPerStrip;
  const int dq_col0 = (warp % Cfg::kDqWarpsPerStrip) * Cfg::kDqCols;

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
    const Elem* sQs = sQ + stage * Cfg::kQTile;
    const Elem* sdOs = sdO + stage * Cfg::kQTile;
    const int so = stage * kBlockM;
    const int key0 = n0 + kw * 16;

    // S^T and dP^T of the warp's 16 keys x the row block (over its slice of D).
    float st[NT][4], dpt[NT][4];
    MHK_UNROLL
    for (int nt = 0; nt < NT; ++nt) {
      st[nt][0] = st[nt][1] = st[nt][2] = st[nt][3] = 0.f;
      dpt[nt][0] = dpt[nt][1] = dpt[nt][2] = dpt[nt][3] = 0.f;
    }
    mma_strip_x_rowsT<Elem, kPitch, kDW, NT>(st, sK, kw * 16, sQs, dcol0, lane);
    mma_strip_x_rowsT<Elem, kPitch, kDW, NT>(dpt, sV, kw * 16, sdOs, dcol0, lane);
    if constexpr (Cfg::kDSplit > 1) {
      // Each warp publishes its partial sums; both warps of a strip add half 0 + half 1.
      float* mine = sExch + warp * (2 * NT * 4 * 32);
      MHK_UNROLL
      for (int nt = 0; nt < NT; ++nt) {
        MHK_UNROLL
        for (int e = 0; e < 4; ++e) {
          mine[(nt * 4 + e) * 32 + lane] = st[nt][e];
          mine[(NT * 4 + nt * 4 + e) * 32 + lane] = dpt[nt][e];
        }
      }
      block_sync();
      const float* h0 = sExch + kw * (2 * NT * 4 * 32);
      const float* h1 = sExch + (Cfg::kKeyWarps + kw) * (2 * NT * 4 * 32);
      MHK_UNROLL
      for (int nt = 0; nt < NT; ++nt) {
        MHK_UNROLL
        for (int e = 0; e < 4; ++e) {
          st[nt][e] = h0[(nt * 4 + e) * 32 + lane] + h1[(nt * 4 + e) * 32 + lane];
          dpt[nt][e] = h0[(NT * 4 + nt * 4 + e) * 32 + lane] + h1[(NT * 4 + nt * 4 + e) * 32 + lane];
        }
      }
    }

    if constexpr (kModes) {
      if (em.softcap) {  // S^T -> tanh, in place (cap_pass): the loop reads it for the chain factor
        MHK_UNROLL
        for (int nt = 0; nt < NT; ++nt) {
          MHK_UNROLL
          for (int e = 0; e < 4; ++e) st[nt][e] = softcap_tanh(em, st[nt][e]);
        }
      }
    }
    // P^T (dropped, for dV) and dS^T = P o (dP o keep / (1 - p) - delta), in place. With a cap,
    // dS^T times its chain factor, read from the tanh in S^T either before the score (D <= 128)
    // or after dS (D 256): the order that fits 255 registers without local memory on sm_80 and
    // sm_90 (the other spilled 12 B at D 96 on sm_80, 4 B at D 256 on sm_90; the gate of
    // tools/check_cuda_build.py fails on either).
    constexpr bool kChainLast = Cfg::kDSplit > 1;
    MHK_UNROLL
    for (int nt = 0; nt < NT; ++nt) {
      MHK_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int qc = nt * 8 + 2 * t + (e & 1);
        const int key = key0 + g + 8 * (e >> 1);
        bool hidden = false;
        if (masked && key >= sLimit[so + qc]) hidden = true;
        if (masked && lo_masks && key < sLo[so + qc]) hidden = true;
        float x = st[nt][e] * p.scale_log2;
        float f = 1.f, chain = 1.f;
        if constexpr (kModes) {
          if (!kChainLast && em.softcap) chain = cap_chain(em, st[nt][e], hidden);
          const ModeRows rows{nullptr, nullptr, nullptr, sAlibiSlope + so, sAlibiPos + so};
          x = modified_score_log2(em, st[nt][e], p.scale_log2, rows, qc, key);
          if (em.mask_kind != 0 && !hidden) x += mask_bias_log2(em, sMaskRow[so + qc], key);
          f = em.dropout ? dropout_factor(em, sDrop[so + qc], key) : 1.f;
        }
        const float prob = fast_exp2(hidden ? -INFINITY : x - sLse2[so + qc]);
        float dsv = prob * (dpt[nt][e] * f - sDelta[so + qc]);
        if constexpr (kModes) {
          // dL/dscore of the float mask (at the capped score); exactly 0 where hidden (prob 0),
          // whatever dP holds.
          if (em.dmask != nullptr && ds == 0 && sDmaskRow[so + qc] >= 0 && key < em.Lk)
            em.dmask[sDmaskRow[so + qc] + key] = prob != 0.f ? dsv : 0.f;
          if (kChainLast && em.softcap) chain = cap_chain(em, st[nt][e], hidden);
          dsv *= chain;  // through the cap
        }
        st[nt][e] = prob * f;
        dpt[nt][e] = dsv;
      }
    }
    mma_regs_x_cols<Elem, kPitch, kBlockM, kDW>(dv, st, sdOs, dcol0, lane);   // dV += P^T dO
    mma_regs_x_cols<Elem, kPitch, kBlockM, kDW>(dk, dpt, sQs, dcol0, lane);   // dK += dS^T Q
    if (ds == 0) {
      // dS (query rows x keys) for the dQ product, in the element type as the product reads it.
      MHK_UNROLL
      for (int nt = 0; nt < NT; ++nt) {
        MHK_UNROLL
        for (int e = 0; e < 4; ++e) {
          const int qc = nt * 8 + 2 * t + (e & 1);
          sdS[qc * Cfg::kSPitch + kw * 16 + g + 8 * (e >> 1)] = ElemTraits<Elem>::from_float(dpt[nt][e]);
        }
      }
    }
    block_sync();

    // dQ_part = dS K, added into dq_accum (scaled by the convert kernel).
    const int rq0 = mq * kBlockM;
    const uint32_t turn = static_cast<uint32_t>(kb - first_key_block<kBlockN>(vis, rq0, imin(kBlockM, rows_total - rq0), p.Lq));
#if defined(MHAKERN_CUDA_EMULATE)
    // The emulator tests' deliberate defects (cuda_emu.h State::defect): 1 an ordering bug (a
    // key block goes once the counter reaches turn - 1, a turn early); 2 an early release (the
    // turn passed on before this block's adds).
    const int defect = ::mhk_emu::state().defect;
    if (kOrdered && defect == 1) {
      if (tid == 0)
        while (ld_acquire_gpu(p.dq_counters + counter_base + mq) + 1 < turn) spin_pause();
      block_sync();
    } else if (kOrdered && defect == 2) {
      dq_wait_turn(p.dq_counters + counter_base + mq, turn);
      dq_pass_turn(p.dq_counters + counter_base + mq);
    } else
#endif
    if constexpr (kOrdered)
      dq_wait_turn(p.dq_counters + counter_base + mq, turn);
    int64_t row_off[2];
    MHK_UNROLL
    for (int hh = 0; hh < 2; ++hh) {
      const int r = rq0 + dq_strip * 16 + g + 8 * hh;
      row_off[hh] = r < rows_total ? packed_row_linear(b, p.H, hkv, p.group, p.Lq, r) * D : -1;
    }
    MHK_UNROLL
    for (int c = 0; c < Cfg::kDqCols; c += Cfg::kDqChunk) {
      float acc[Cfg::kDqChunk / 8][4];
      MHK_UNROLL
      for (int dt = 0; dt < Cfg::kDqChunk / 8; ++dt) acc[dt][0] = acc[dt][1] = acc[dt][2] = acc[dt][3] = 0.f;
      mma_smem_x_cols<Elem, Cfg::kSPitch, kPitch, kBlockN, Cfg::kDqChunk>(acc, sdS, dq_strip * 16, sK, dq_col0 + c, lane);
      MHK_UNROLL
      for (int dt = 0; dt < Cfg::kDqChunk / 8; ++dt) {
        MHK_UNROLL
        for (int e = 0; e < 4; ++e) {
          const int64_t off = row_off[e >> 1];
          if (off >= 0) red_add_f32(p.dq_accum + off + dq_col0 + c + dt * 8 + 2 * t + (e & 1), acc[dt][e]);
        }
      }
    }
    // The next iteration's prefetch overwrites this stage, and its dS this dS.
#if defined(MHAKERN_CUDA_EMULATE)
    if (kOrdered && defect == 2)
      block_sync();
    else
#endif
    if constexpr (kOrdered)
      dq_pass_turn(p.dq_counters + counter_base + mq);
    else
      block_sync();
    mq = nxt;
    stage ^= 1;
  }
  cp_async_wait<0>();
  block_sync();  // K and V may have landed only now; staging below overwrites them

  // dK, dV staged through the K and V tiles (every warp read all of K in the dQ products: the
  // barrier above ends that; each warp writes only its own rows and columns), then written in
  // 16-byte rows; keys past Lk_b get the zeros they accumulated.
  stage_cols<Elem, kPitch, kDW>(sK, kw * 16, dcol0, dk, p.scale, lane);
  stage_cols<Elem, kPitch, kDW>(sV, kw * 16, dcol0, dv, 1.f, lane);
  block_sync();
  Elem* dk_head = static_cast<Elem*>(p.dk) + b * p.dk_stride.batch + hkv * p.dk_stride.head;
  Elem* dv_head = static_cast<Elem*>(p.dv) + b * p.dv_stride.batch + hkv * p.dv_stride.head;
  store_tile<Elem, kBlockN, D, kThreads>(sK, [&](int rr) -> Elem* {
    const int j = n0 + rr;
    return j < p.Lk ? dk_head + static_cast<int64_t>(j) * p.dk_stride.row : nullptr;
  });
  store_tile<Elem, kBlockN, D, kThreads>(sV, [&](int rr) -> Elem* {
    const int j = n0 + rr;
    return j < p.Lk ? dv_head + static_cast<int64_t>(j) * p.dv_stride.row : nullptr;
  });
}

// One kernel per (modes, order): the plain deterministic one is exactly the kernel without
// the modes' loads and branches.
template <typename Elem, int D, bool kModes, bool kOrdered>
__global__ void MHK_LAUNCH_BOUNDS(FusedBwdConfig<D>::kThreads, 2) attn_bwd_fused_kernel(const BwdParams p) {
  attn_bwd_fused_body<Elem, D, kModes, kOrdered>(p);
}

// dq = scale * dq_accum in the element type; one thread per pair of elements.
template <typename Elem, int D>
__global__ void MHK_LAUNCH_BOUNDS(256, 1) attn_bwd_fused_convert_kernel(const BwdParams p) {
  const int64_t n_rows = static_cast<int64_t>(p.B) * p.H * p.Lq;
  const int64_t idx = block_index() * 256 + thread_index();
  if (idx >= n_rows * (D / 2)) return;
  const int64_t row = idx / (D / 2);
  const int d = static_cast<int>(idx % (D / 2)) * 2;
  const float2 sum = *reinterpret_cast<const float2*>(p.dq_accum + row * D + d);
  const int i = static_cast<int>(row % p.Lq);
  const int h = static_cast<int>((row / p.Lq) % p.H);
  const int b = static_cast<int>(row / (static_cast<int64_t>(p.Lq) * p.H));
  Elem* dst = static_cast<Elem*>(p.dq) + b * p.dq_stride.batch + h * p.dq_stride.head + static_cast<int64_t>(i) * p.dq_stride.row + d;
  *reinterpret_cast<uint32_t*>(dst) = ElemTraits<Elem>::pack2(sum.x * p.scale, sum.y * p.scale);
}

template <typename Elem, int D, bool kModes, bool kOrdered>
cudaError_t launch_attn_bwd_fused_main(const BwdParams& p, int64_t grid, cudaStream_t stream) {
  using Cfg = FusedBwdConfig<D>;
  constexpr int kBytes = Cfg::kSmemBytes + (kModes ? Cfg::kModeSmemBytes : 0);
  constexpr int kTag = kTagBwdFused + (kModes ? kTagModes : 0) + (kOrdered ? 0 : 1);
  auto kernel = attn_bwd_fused_kernel<Elem, D, kModes, kOrdered>;
  const cudaError_t err = opt_in_dynamic_smem<kTag, Elem, D>(kernel, kBytes);
  if (err != cudaSuccess) return err;
  launch_kernel(kernel, grid, Cfg::kThreads, kBytes, stream, p);
  return cudaGetLastError();
}

// delta, the fused kernel, the conversion. p.dq_accum (B * H * Lq * D fp32) and p.dq_counters
// (caps::cuda_fused_bwd_counters) must be zero; p.bwd_kernel picks the order of the dQ adds.
template <typename Elem, int D>
cudaError_t run_attn_bwd_fused(const BwdParams& p, cudaStream_t stream) {
  using Cfg = FusedBwdConfig<D>;
  const int64_t rows = static_cast<int64_t>(p.B) * p.H * p.Lq;
  const int64_t grid = static_cast<int64_t>(ceil_div(p.Lk, Cfg::kBlockN)) * p.Hkv * p.B;
  if (rows == 0 || grid == 0) return cudaSuccess;
  if (grid > 0x7fffffff || (rows + 3) / 4 > 0x7fffffff || rows * (D / 2) / 256 >= 0x7fffffff)
    return cudaErrorInvalidConfiguration;
  if (p.dq_accum == nullptr || p.dq_counters == nullptr) return cudaErrorInvalidValue;
  // No packed path here: packed sequences run the split kernels (capabilities.h cuda_bwd_kernel).
  if (p.cu_seqlens_q != nullptr) return cudaErrorInvalidValue;

  launch_kernel(attn_bwd_delta_kernel<Elem, D>, (rows + 3) / 4, 128, 0, stream, p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;

  const bool modes = needs_modes_kernel(p);
  const bool ordered = p.bwd_kernel != caps::kBwdFusedAtomic;
  if (modes)
    err = ordered ? launch_attn_bwd_fused_main<Elem, D, true, true>(p, grid, stream)
                  : launch_attn_bwd_fused_main<Elem, D, true, false>(p, grid, stream);
  else
    err = ordered ? launch_attn_bwd_fused_main<Elem, D, false, true>(p, grid, stream)
                  : launch_attn_bwd_fused_main<Elem, D, false, false>(p, grid, stream);
  if (err != cudaSuccess) return err;

  const int64_t pairs = rows * (D / 2);
  launch_kernel(attn_bwd_fused_convert_kernel<Elem, D>, (pairs + 255) / 256, 256, 0, stream, p);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace mhakern

// The body of one generated backward instantiation file (tools/generate_kernels.py) for element
// tag `tag` (capabilities.h: MHK_CUDA_ELEM_TYPE_<tag>) and head dim D: the split kernels or the
// fused one, as p.bwd_kernel says (the host fills it from caps::cuda_bwd_kernel).
#define MHK_DEFINE_ATTN_BWD(tag, D)                                                     \
  namespace mhakern {                                                                   \
  namespace cuda {                                                                      \
  cudaError_t run_attn_bwd_##tag##_d##D(const BwdParams& p, cudaStream_t s) {           \
    if (p.bwd_kernel != caps::kBwdSplit) return run_attn_bwd_fused<MHK_CUDA_ELEM_TYPE_##tag, D>(p, s); \
    return run_attn_bwd<MHK_CUDA_ELEM_TYPE_##tag, D>(p, s);                             \
  }                                                                                     \
  }                                                                                     \
  }

// The same for a head dim that has only the fused backward (capabilities.h
// MHK_CUDA_BWD_ONLY_HEAD_DIM).
#define MHK_DEFINE_ATTN_BWD_FUSED_ONLY(tag, D)                                          \
  namespace mhakern {                                                                   \
  namespace cuda {                                                                      \
  cudaError_t run_attn_bwd_##tag##_d##D(const BwdParams& p, cudaStream_t s) {           \
    return run_attn_bwd_fused<MHK_CUDA_ELEM_TYPE_##tag, D>(p, s);                       \
  }                                                                                     \
  }                                                                                     \
  }
