// Backward attention for sm_90a (Hopper): wgmma, TMA and an mbarrier pipeline, warp-specialised.
//
// With P recomputed from the saved lse, dP = dO V^T, delta = rowsum(dO o O) and
// dS = P o (dP - delta):  dV = P^T dO,  dK = scale dS^T Q,  dQ = scale dS K  (as the mma.sync
// family's ../mma/attn_bwd_kernel.cuh; the delta kernel and the split-K dQ reduction are shared:
// ../common/aux_kernels.cuh).
// Two kernels, each one CTA of 3 warpgroups: warpgroup 0 the producer (setmaxnreg.dec), filling
// a ring of kSm90BwdStages shared-memory stages guarded by "full" / "empty" mbarriers; warpgroups 1 and 2
// the consumers (setmaxnreg.inc), 64 accumulator rows each, issuing wgmma. No atomics: every sum
// is made in one thread's registers in one fixed order, so two runs are bit-identical.
//
//   attn_bwd_dkdv_sm90_kernel: one CTA per (batch b, kv head, tile of kDkvBlockN = 128 keys); K and
//     V of the tile by TMA once; the producer streams the group's packed query rows, kDkvBlockM =
//     64 per stage (Q and dO by TMA when the stage lies inside one query head, else plain 16-byte
//     loads + fence.proxy.async; the rows' lse, delta and visible limit by plain stores). Per stage
//     each consumer computes, transposed so that its keys are the accumulator rows:
//       S^T = K Q^T, dP^T = V dO^T          (wgmma, both operands K-major from shared memory)
//       P^T = exp2(S^T scale log2e - lse2), dS^T = P^T o (dP^T - delta)     (fp32 registers)
//       dV += P^T dO, dK += dS^T Q           (wgmma, A from registers, B N-major: Q, dO as stored)
//     Query tiles whose rows see no key of the CTA's tile are skipped (causal), and only tiles
//     that cross a row's visible limit are masked.
//   attn_bwd_dq_sm90_kernel: one CTA per (batch, kv head, tile of kDqBlockM = 128 packed query
//     rows, split); Q and dO loaded once by every thread; the producer streams the visible key
//     tiles (K and V by TMA, plain loads for a tile that crosses key_lengths[b] < Lk, whose hidden
//     keys must read as zeros). Per tile: S = Q K^T, dP = dO V^T, P, dS, then dQ += dS K (B
//     N-major). Split-K writes fp32 partials that attn_bwd_dq_reduce_kernel adds in split order.
//
// Semantics (../common/attn_params.h): bottom-right causal per batch element, key_lengths clamped into
// [0, Lk], the query heads of a GQA/MQA group packed into rows (r = (h - hkv group) Lq + i), rows
// that see no key (lse = -inf) get zero gradients and give none. Keys at or past key_lengths[b]
// get zero dK and dV whatever K and V hold there (the dK/dV epilogue writes zeros for them: TMA
// reads them, the dS of a masked position is 0 * (dP - delta), NaN when V holds a NaN there).
// Not here: the modes of docs/contract.md and other head dims (the mma.sync family serves them;
// attn_dispatch.h: choose_bwd_family).
#pragma once

#include "../../capabilities.h"
#include "../common/attn_params.h"
#include "primitives_sm90.cuh"

namespace mhakern {
namespace cuda {
namespace sm90 {

template <int D>
struct BwdConfigSm90 {
  static_assert(D == 64 || D == 128, "the sm90 backward is instantiated for head dims 64 and 128");
  static constexpr int kConsumers = 2;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kStages = caps::kSm90BwdStages;
  // Register plans (setmaxnreg), one CTA per SM: 128 x 24 + 256 x 240 = 64512 <= 65536 for the
  // dK/dV kernel, whose consumers hold dK, dV, S^T, dP^T and two A fragments (ptxas spills at D
  // 128 under 240); 128 x 40 + 256 x 232 = 64512 for the dQ kernel, whose producer's plain loads
  // of a key tile that crosses key_lengths spill under 40.
  static constexpr int kDkvProducerRegs = 24;
  static constexpr int kDkvConsumerRegs = 240;
  static constexpr int kDqProducerRegs = 40;
  static constexpr int kDqConsumerRegs = 232;
  static constexpr int kPanels = D / 64;  // 128-byte (64-element) column panels of D

  // dK/dV kernel: keys per CTA (2 consumers x 64), packed query rows per stage.
  static constexpr int kDkvBlockN = caps::kSm90BwdDkvBlockN;
  static constexpr int kDkvBlockM = caps::kSm90BwdDkvBlockM;
  static_assert(kDkvBlockN == 64 * kConsumers, "one 64-row wgmma accumulator of keys per consumer");
  static constexpr int kDkvPanelKV = kDkvBlockN * 128;
  static constexpr int kDkvPanelQ = kDkvBlockM * 128;
  static constexpr int kDkvTileKV = kPanels * kDkvPanelKV;
  static constexpr int kDkvTileQ = kPanels * kDkvPanelQ;
  static constexpr int kDkvOffV = kDkvTileKV;
  static constexpr int kDkvOffQ = 2 * kDkvTileKV;
  static constexpr int kDkvOffDo = kDkvOffQ + kStages * kDkvTileQ;
  static constexpr int kDkvOffRows = kDkvOffDo + kStages * kDkvTileQ;  // lse2, delta, limit per stage
  static constexpr int kDkvOffBar = kDkvOffRows + kStages * 3 * kDkvBlockM * 4;
  static constexpr int kDkvSmemBytes = kDkvOffBar + (2 * kStages + 1) * 8;
  // Room to round the base up to 1024 bytes (the 128B swizzle's period; see FwdConfigSm90).
  static constexpr int kDkvSmemAlloc = kDkvSmemBytes + 1024;
  static_assert(kDkvSmemAlloc <= 227 * 1024, "sm_90 allows 227 KB of shared memory per block");

  // dQ kernel: packed query rows per CTA (2 consumers x 64), keys per stage (fewer at D = 128:
  // the dQ accumulator, S and dP share the consumer's registers).
  static constexpr int kDqBlockM = caps::kSm90BwdDqBlockM;
  static constexpr int kDqBlockN = caps::sm90_bwd_dq_n(D);
  static_assert(kDqBlockM == 64 * kConsumers, "one 64-row wgmma accumulator of queries per consumer");
  static constexpr int kDqPanelQ = kDqBlockM * 128;
  static constexpr int kDqPanelKV = kDqBlockN * 128;
  static constexpr int kDqTileQ = kPanels * kDqPanelQ;
  static constexpr int kDqTileKV = kPanels * kDqPanelKV;
  static constexpr int kDqOffDo = kDqTileQ;
  static constexpr int kDqOffK = 2 * kDqTileQ;
  static constexpr int kDqOffV = kDqOffK + kStages * kDqTileKV;
  static constexpr int kDqOffBar = kDqOffV + kStages * kDqTileKV;
  static constexpr int kDqSmemBytes = kDqOffBar + 2 * kStages * 8;
  static constexpr int kDqSmemAlloc = kDqSmemBytes + 1024;
  static_assert(kDqSmemAlloc <= 227 * 1024, "sm_90 allows 227 KB of shared memory per block");
};

// Parameters: the common backward fields and the tensor maps (kernel parameter space,
// __grid_constant__, so TMA reads them where they are). dK/dV: K and V boxes of kDkvBlockN rows,
// Q and dO boxes of kDkvBlockM rows over (D, Lq, H, B); dQ: K and V boxes of kDqBlockN rows.
struct BwdDkvParamsSm90 {
  TensorMap tma_k;
  TensorMap tma_v;
  TensorMap tma_q;
  TensorMap tma_do;
  BwdParams p;
};
struct BwdDqParamsSm90 {
  TensorMap tma_k;
  TensorMap tma_v;
  BwdParams p;
};

// Rows [0, ROWS) of a (ROWS x D) tile into 128-byte swizzled panels at dst (panel pn: columns
// 64 pn.., ROWS x 128 bytes at dst + pn ROWS 128) with plain 16-byte loads by threads
// [0, nthreads) of the caller (thread `me`); row_ptr(r) is the row's first element or nullptr
// (zeros). The same layout TMA writes with CU_TENSOR_MAP_SWIZZLE_128B.
// Not unrolled: the producers run it at 24-40 registers, and unrolled copies of the loop keep
// their hoisted swizzle terms live (the fused kernel's 64 loaders spilled them).
template <typename Elem, int ROWS, int D, typename RowPtr>
MHK_DEVICE void load_rows_sw128(unsigned char* dst, int me, int nthreads, RowPtr row_ptr) {
  constexpr int kChunks = D / 8;
#if !defined(MHAKERN_CUDA_EMULATE)
#pragma unroll 1
#endif
  for (int c = me; c < ROWS * kChunks; c += nthreads) {
    const int row = c / kChunks, ch = c % kChunks;
    const Elem* src = row_ptr(row);
    uint4 val = make_uint4(0, 0, 0, 0);
    if (src != nullptr) val = *reinterpret_cast<const uint4*>(src + ch * 8);
    const int panel = ch / 8, cc = ch % 8;
    *reinterpret_cast<uint4*>(dst + panel * ROWS * 128 + row * 128 + ((cc ^ (row % 8)) * 16)) = val;
  }
}

// lse in base 2 for P = exp2(s scale log2e - lse2); +inf for a row that sees no key (lse -inf)
// or is past the group, which makes its P exactly 0.
MHK_DEVICE float lse_base2(float lse) { return lse == -INFINITY ? INFINITY : lse * kLog2e; }

#if MHK_SM90_ENABLED  // the wgmma wrappers exist only in the sm_90a pass and the emulator build
// A accumulator fragment (64 x N fp32, N / 2 per thread) as N / 16 A fragments of wgmma (pairs
// converted to Elem): the accumulator of one product is the A operand of the next.
template <typename Elem, int N>
MHK_DEVICE void acc_to_a(uint32_t (&a)[N / 16][4], const float (&x)[N / 2]) {
  MHK_UNROLL
  for (int ks = 0; ks < N / 16; ++ks) {
    MHK_UNROLL
    for (int j = 0; j < 4; ++j) a[ks][j] = ElemTraits<Elem>::pack2(x[8 * ks + 2 * j], x[8 * ks + 2 * j + 1]);
  }
}

// acc (64 x N) = A B^T over D, A rows at a_rows (a 64-row slice of a K-major swizzled tile of
// panels a_panel bytes apart), B the K-major tile at b (panels b_panel apart). One commit group's
// worth of wgmma (the caller fences and commits).
template <typename Elem, int N, int D>
MHK_DEVICE void issue_abt(float (&acc)[N / 2], const unsigned char* a_rows, int a_panel, const unsigned char* b,
                          int b_panel) {
  MHK_UNROLL
  for (int kk = 0; kk < D / 16; ++kk) {
    const int pn = kk / 4, off = (kk % 4) * 32;  // 16 elements of D = 32 bytes inside a 128-byte row
    const uint64_t da = desc_bits(shared_u32(a_rows + pn * a_panel + off), 16, 1024);
    const uint64_t db = desc_bits(shared_u32(b + pn * b_panel + off), 16, 1024);
    wgmma_ss<N, Elem>(acc, da, db, kk > 0 ? 1 : 0);
  }
}

// acc (64 x D) += A B, A (64 x K) in registers, B the (K x D) tile at b stored row-major in
// 64-column panels b_panel bytes apart (N-major: 8 rows of K per 1024-byte atom).
template <typename Elem, int K, int D>
MHK_DEVICE void issue_ab(float (&acc)[D / 2], const uint32_t (&a)[K / 16][4], const unsigned char* b, int b_panel) {
  MHK_UNROLL
  for (int ks = 0; ks < K / 16; ++ks) {
    const uint64_t db = desc_bits(shared_u32(b + ks * 16 * 128), b_panel, 1024);
    wgmma_rs_tb<D, Elem>(acc, a[ks], db);
  }
}

#endif  // MHK_SM90_ENABLED

// ---------------------------------------------------------------------------------------------
// dK / dV
// ---------------------------------------------------------------------------------------------
template <typename Elem, int D>
__global__ void MHK_LAUNCH_BOUNDS(BwdConfigSm90<D>::kThreads, 1)
    attn_bwd_dkdv_sm90_kernel(const MHK_GRID_CONSTANT BwdDkvParamsSm90 P) {
#if MHK_SM90_ENABLED
  using Cfg = BwdConfigSm90<D>;
  using Tr = ElemTraits<Elem>;
  constexpr int BM = Cfg::kDkvBlockM, BN = Cfg::kDkvBlockN, kStages = Cfg::kStages;
  const BwdParams& p = P.p;
  MHK_DYNAMIC_SMEM(smem_raw);
  unsigned char* smem = smem_raw + (1024 - shared_u32(smem_raw) % 1024) % 1024;
  const int tid = thread_index();

  const int group_rows = p.group * p.Lq;
  const int n_mtiles = ceil_div(group_rows, BM);
  const int n_ntiles = ceil_div(p.Lk, BN);
  int64_t bid = block_index();
  const int nt = static_cast<int>(bid % n_ntiles);
  bid /= n_ntiles;
  const int hkv = static_cast<int>(bid % p.Hkv);
  const int b = static_cast<int>(bid / p.Hkv);
  const int n0 = nt * BN;
  const int Lk_b = key_length_of(p, b);

  // The visible limits of query tile mt's first and last rows: the tile matters when lim_hi > n0
  // (a row sees a key of this CTA; never when n0 >= Lk_b), and needs a mask when lim_lo < n0 + BN.
  auto tile_limits = [&](int mt, int& lim_lo, int& lim_hi) {
    const int r0 = mt * BM;
    int i_lo, i_hi;
    tile_query_range(r0, imin(BM, group_rows - r0), p.Lq, i_lo, i_hi);
    lim_lo = visible_limit(i_lo, Lk_b, p.Lq, p.causal);
    lim_hi = visible_limit(i_hi, Lk_b, p.Lq, p.causal);
  };
  auto next_tile = [&](int mt) {
    for (; mt < n_mtiles; ++mt) {
      int lo, hi;
      tile_limits(mt, lo, hi);
      if (hi > n0) break;
    }
    return mt;
  };
  const int first_tile = next_tile(0);

  unsigned char* sK = smem;
  unsigned char* sV = smem + Cfg::kDkvOffV;
  unsigned char* sQ = smem + Cfg::kDkvOffQ;    // stage s at + s * kDkvTileQ
  unsigned char* sdO = smem + Cfg::kDkvOffDo;  // likewise
  float* sLse2 = reinterpret_cast<float*>(smem + Cfg::kDkvOffRows);  // stage s at + s * BM
  float* sDelta = sLse2 + kStages * BM;
  int* sLimit = reinterpret_cast<int*>(sDelta + kStages * BM);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + Cfg::kDkvOffBar);
  uint64_t* empty = full + kStages;
  uint64_t* kv_bar = empty + kStages;

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 128);                     // every producer thread, each stage
      mbar_init(&empty[s], Cfg::kConsumers * 128);  // every consumer thread
    }
    mbar_init(kv_bar, 1);
    fence_barrier_init();
  }
  block_sync();

  const int wg = tid / 128;
  if (wg == 0) {
    // ---- producer ----
    setmaxnreg_dec<Cfg::kDkvProducerRegs>();
    if (tid == 0 && first_tile < n_mtiles) {
      // K and V of the CTA's keys, once (rows past Lk zero-filled; rows in [Lk_b, Lk) are read
      // but their gradients are written as zeros).
      mbar_arrive_expect_tx(kv_bar, 2 * Cfg::kDkvTileKV);
      for (int pn = 0; pn < Cfg::kPanels; ++pn) {
        tma_load_4d(sK + pn * Cfg::kDkvPanelKV, &P.tma_k, pn * 64, n0, hkv, b, kv_bar);
        tma_load_4d(sV + pn * Cfg::kDkvPanelKV, &P.tma_v, pn * 64, n0, hkv, b, kv_bar);
      }
    }
    const Elem* q = static_cast<const Elem*>(p.q);
    const Elem* dout = static_cast<const Elem*>(p.dout);
    int it = 0;
    for (int mt = first_tile; mt < n_mtiles; mt = next_tile(mt + 1), ++it) {
      const int s = it % kStages;
      mbar_wait(&empty[s], ((it / kStages) & 1) ^ 1);
      const int r0 = mt * BM;
      // The rows' lse (base 2), delta and visible limit, stored before this thread arrives.
      if (tid < BM) {
        const int r = r0 + tid;
        float lse2 = INFINITY, delta = 0.f;
        int limit = 0;
        if (r < group_rows) {
          const int64_t lin = packed_row_linear(b, p.H, hkv, p.group, p.Lq, r);
          lse2 = lse_base2(p.lse[lin]);
          delta = p.delta[lin];
          limit = visible_limit(r % p.Lq, Lk_b, p.Lq, p.causal);
        }
        sLse2[s * BM + tid] = lse2;
        sDelta[s * BM + tid] = delta;
        sLimit[s * BM + tid] = limit;
      }
      unsigned char* dq_s = sQ + s * Cfg::kDkvTileQ;
      unsigned char* ddo_s = sdO + s * Cfg::kDkvTileQ;
      const int h0 = r0 / p.Lq, i0 = r0 % p.Lq;
      // TMA when the stage's rows are consecutive positions of one query head (rows past Lq
      // of the group's last head are past the group: the box's zero fill is what they need).
      if (i0 + BM <= p.Lq || h0 == p.group - 1) {
        if (tid == 0) {
          mbar_arrive_expect_tx(&full[s], 2 * Cfg::kDkvTileQ);
          const int h = hkv * p.group + h0;
          for (int pn = 0; pn < Cfg::kPanels; ++pn) {
            tma_load_4d(dq_s + pn * Cfg::kDkvPanelQ, &P.tma_q, pn * 64, i0, h, b, &full[s]);
            tma_load_4d(ddo_s + pn * Cfg::kDkvPanelQ, &P.tma_do, pn * 64, i0, h, b, &full[s]);
          }
        } else {
          mbar_arrive(&full[s]);
        }
      } else {
        // Packed rows that straddle two query heads: no tensor map describes them.
        load_rows_sw128<Elem, BM, D>(dq_s, tid, 128, [&](int rr) -> const Elem* {
          const int r = r0 + rr;
          return r < group_rows ? q + packed_row_offset(p.q_stride, b, hkv, p.group, p.Lq, r) : nullptr;
        });
        load_rows_sw128<Elem, BM, D>(ddo_s, tid, 128, [&](int rr) -> const Elem* {
          const int r = r0 + rr;
          return r < group_rows ? dout + packed_row_offset(p.do_stride, b, hkv, p.group, p.Lq, r) : nullptr;
        });
        fence_proxy_async();  // this thread's generic stores, before wgmma (async proxy) reads them
        mbar_arrive(&full[s]);
      }
    }
    return;
  }

  // ---- consumers ----
  setmaxnreg_inc<Cfg::kDkvConsumerRegs>();
  const int cw = wg - 1;
  const int t128 = tid % 128, warp = t128 / 32, lane = t128 % 32, g = lane / 4, t = lane % 4;
  // This thread's two keys (accumulator rows g and g + 8 of its warp's 16).
  int key[2];
  for (int h = 0; h < 2; ++h) key[h] = n0 + cw * 64 + warp * 16 + g + 8 * h;
  float dk[D / 2], dv[D / 2];
  MHK_UNROLL
  for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;
  const float sl2 = p.scale_log2;
  const unsigned char* sK_cw = sK + cw * 64 * 128;
  const unsigned char* sV_cw = sV + cw * 64 * 128;

  if (first_tile < n_mtiles) mbar_wait(kv_bar, 0);
  int it = 0;
  for (int mt = first_tile; mt < n_mtiles; mt = next_tile(mt + 1), ++it) {
    const int s = it % kStages;
    int lim_lo, lim_hi;
    tile_limits(mt, lim_lo, lim_hi);
    const bool masked = lim_lo < n0 + BN;
    const unsigned char* q_s = sQ + s * Cfg::kDkvTileQ;
    const unsigned char* do_s = sdO + s * Cfg::kDkvTileQ;
    const float* lse2 = sLse2 + s * BM;
    const float* delta = sDelta + s * BM;
    const int* limit = sLimit + s * BM;
    mbar_wait(&full[s], (it / kStages) & 1);

    float st[BM / 2], dpt[BM / 2];  // S^T, dP^T: rows = this warpgroup's keys, columns = query rows
    wgmma_fence();
    issue_abt<Elem, BM, D>(st, sK_cw, Cfg::kDkvPanelKV, q_s, Cfg::kDkvPanelQ);
    wgmma_commit();
    issue_abt<Elem, BM, D>(dpt, sV_cw, Cfg::kDkvPanelKV, do_s, Cfg::kDkvPanelQ);
    wgmma_commit();
    wgmma_wait<1>();  // S^T is in; dP^T may still run while P^T is formed
    // The thread's columns come in pairs (8 c + 2 t, + 1): one 8-byte shared load per pair.
    MHK_UNROLL
    for (int c = 0; c < BM / 8; ++c) {
      const float2 l2 = *reinterpret_cast<const float2*>(lse2 + 8 * c + 2 * t);
      const int2 lim2 = *reinterpret_cast<const int2*>(limit + 8 * c + 2 * t);
      MHK_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int i = 4 * c + e;
        // Scaled first, masked after: a hidden position is 0 whatever the sign of the scale.
        float x = st[i] * sl2 - (e % 2 ? l2.y : l2.x);
        if (masked && key[e / 2] >= (e % 2 ? lim2.y : lim2.x)) x = -INFINITY;
        st[i] = fast_exp2(x);
      }
    }
    // dV's product runs while dS^T is formed: it needs only P^T.
    uint32_t pa[BM / 16][4];
    acc_to_a<Elem, BM>(pa, st);
    wgmma_fence();  // dv and the A registers were written since the last wait
    issue_ab<Elem, BM, D>(dv, pa, do_s, Cfg::kDkvPanelQ);  // dV += P^T dO
    wgmma_commit();
    wgmma_wait<1>();  // dP^T is in; dV may still run
    MHK_UNROLL
    for (int c = 0; c < BM / 8; ++c) {
      const float2 d2 = *reinterpret_cast<const float2*>(delta + 8 * c + 2 * t);
      MHK_UNROLL
      for (int e = 0; e < 4; ++e) dpt[4 * c + e] = st[4 * c + e] * (dpt[4 * c + e] - (e % 2 ? d2.y : d2.x));
    }
    uint32_t dsa[BM / 16][4];
    acc_to_a<Elem, BM>(dsa, dpt);
    wgmma_fence();
    issue_ab<Elem, BM, D>(dk, dsa, q_s, Cfg::kDkvPanelQ);  // dK += dS^T Q (scaled at the end)
    wgmma_commit();
    wgmma_wait<0>();
    mbar_arrive(&empty[s]);  // the stage's operands are read: the producer may refill it
  }

  // ---- epilogue: dK (scaled), dV; keys in [Lk_b, Lk) get zeros ----
  Elem* dk_head = static_cast<Elem*>(p.dk) + b * p.dk_stride.batch + hkv * p.dk_stride.head;
  Elem* dv_head = static_cast<Elem*>(p.dv) + b * p.dv_stride.batch + hkv * p.dv_stride.head;
  for (int h = 0; h < 2; ++h) {
    const int j = key[h];
    if (j >= p.Lk) continue;
    const bool live = j < Lk_b;
    Elem* dkr = dk_head + static_cast<int64_t>(j) * p.dk_stride.row;
    Elem* dvr = dv_head + static_cast<int64_t>(j) * p.dv_stride.row;
    MHK_UNROLL
    for (int c = 0; c < D / 8; ++c) {
      const float k0 = live ? dk[4 * c + 2 * h] * p.scale : 0.f, k1 = live ? dk[4 * c + 2 * h + 1] * p.scale : 0.f;
      const float v0 = live ? dv[4 * c + 2 * h] : 0.f, v1 = live ? dv[4 * c + 2 * h + 1] : 0.f;
      *reinterpret_cast<uint32_t*>(dkr + 8 * c + 2 * t) = Tr::pack2(k0, k1);
      *reinterpret_cast<uint32_t*>(dvr + 8 * c + 2 * t) = Tr::pack2(v0, v1);
    }
  }
#endif  // MHK_SM90_ENABLED
}

// ---------------------------------------------------------------------------------------------
// dQ
// ---------------------------------------------------------------------------------------------
template <typename Elem, int D>
__global__ void MHK_LAUNCH_BOUNDS(BwdConfigSm90<D>::kThreads, 1)
    attn_bwd_dq_sm90_kernel(const MHK_GRID_CONSTANT BwdDqParamsSm90 P) {
#if MHK_SM90_ENABLED
  using Cfg = BwdConfigSm90<D>;
  using Tr = ElemTraits<Elem>;
  constexpr int BM = Cfg::kDqBlockM, BN = Cfg::kDqBlockN, kStages = Cfg::kStages;
  const BwdParams& p = P.p;
  MHK_DYNAMIC_SMEM(smem_raw);
  unsigned char* smem = smem_raw + (1024 - shared_u32(smem_raw) % 1024) % 1024;
  const int tid = thread_index();

  // This CTA's rows and key tiles (primitives_sm90.cuh: row_tile_work).
  const RowTileWork w = row_tile_work<BM, BN>(p, block_index());
  const int split = w.split, hkv = w.hkv, b = w.b, group_rows = w.group_rows, r0 = w.r0, Lk_b = w.Lk_b;
  const int lim_min = w.lim_min, t0 = w.t0, n_tiles = w.n_tiles;

  unsigned char* sQ = smem;
  unsigned char* sdO = smem + Cfg::kDqOffDo;
  unsigned char* sK = smem + Cfg::kDqOffK;  // stage s at + s * kDqTileKV
  unsigned char* sV = smem + Cfg::kDqOffV;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + Cfg::kDqOffBar);
  uint64_t* empty = full + kStages;

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 128);
      mbar_init(&empty[s], Cfg::kConsumers * 128);
    }
    fence_barrier_init();
  }
  // Q and dO once, by every thread (packed rows: no tensor map describes them); rows past the
  // group are zeros (their results are never stored).
  const Elem* q = static_cast<const Elem*>(p.q);
  const Elem* dout = static_cast<const Elem*>(p.dout);
  if (n_tiles > 0) {
    load_rows_sw128<Elem, BM, D>(sQ, tid, Cfg::kThreads, [&](int rr) -> const Elem* {
      const int r = r0 + rr;
      return r < group_rows ? q + packed_row_offset(p.q_stride, b, hkv, p.group, p.Lq, r) : nullptr;
    });
    load_rows_sw128<Elem, BM, D>(sdO, tid, Cfg::kThreads, [&](int rr) -> const Elem* {
      const int r = r0 + rr;
      return r < group_rows ? dout + packed_row_offset(p.do_stride, b, hkv, p.group, p.Lq, r) : nullptr;
    });
  }
  fence_proxy_async();
  block_sync();

  const int wg = tid / 128;
  if (wg == 0) {
    // ---- producer ----
    setmaxnreg_dec<Cfg::kDqProducerRegs>();
    const Elem* k_head = static_cast<const Elem*>(p.k) + b * p.k_stride.batch + hkv * p.k_stride.head;
    const Elem* v_head = static_cast<const Elem*>(p.v) + b * p.v_stride.batch + hkv * p.v_stride.head;
    for (int it = 0; it < n_tiles; ++it) {
      const int s = it % kStages;
      mbar_wait(&empty[s], ((it / kStages) & 1) ^ 1);
      const int n0 = (t0 + it) * BN;
      unsigned char* k_s = sK + s * Cfg::kDqTileKV;
      unsigned char* v_s = sV + s * Cfg::kDqTileKV;
      // TMA unless the tile holds keys in [Lk_b, Lk): those must read as zeros (a hidden key's
      // dS is 0, and 0 x NaN in dS K would reach the row), which only the box's fill past Lk is.
      if (n0 + BN <= Lk_b || Lk_b == p.Lk) {
        if (tid == 0) {
          mbar_arrive_expect_tx(&full[s], 2 * Cfg::kDqTileKV);
          for (int pn = 0; pn < Cfg::kPanels; ++pn) {
            tma_load_4d(k_s + pn * Cfg::kDqPanelKV, &P.tma_k, pn * 64, n0, hkv, b, &full[s]);
            tma_load_4d(v_s + pn * Cfg::kDqPanelKV, &P.tma_v, pn * 64, n0, hkv, b, &full[s]);
          }
        } else {
          mbar_arrive(&full[s]);
        }
      } else {
        load_rows_sw128<Elem, BN, D>(k_s, tid, 128, [&](int rr) -> const Elem* {
          const int j = n0 + rr;
          return j < Lk_b ? k_head + static_cast<int64_t>(j) * p.k_stride.row : nullptr;
        });
        load_rows_sw128<Elem, BN, D>(v_s, tid, 128, [&](int rr) -> const Elem* {
          const int j = n0 + rr;
          return j < Lk_b ? v_head + static_cast<int64_t>(j) * p.v_stride.row : nullptr;
        });
        fence_proxy_async();
        mbar_arrive(&full[s]);
      }
    }
    return;
  }

  // ---- consumers ----
  setmaxnreg_inc<Cfg::kDqConsumerRegs>();
  const int cw = wg - 1;
  const int t128 = tid % 128, warp = t128 / 32, lane = t128 % 32, g = lane / 4, t = lane % 4;
  int rows[2], lim[2];
  float lse2[2], delta[2];
  for (int h = 0; h < 2; ++h) {
    rows[h] = r0 + cw * 64 + warp * 16 + g + 8 * h;
    lim[h] = 0;
    lse2[h] = INFINITY;
    delta[h] = 0.f;
    if (rows[h] < group_rows) {
      const int64_t lin = packed_row_linear(b, p.H, hkv, p.group, p.Lq, rows[h]);
      lim[h] = visible_limit(rows[h] % p.Lq, Lk_b, p.Lq, p.causal);
      lse2[h] = lse_base2(p.lse[lin]);
      delta[h] = p.delta[lin];
    }
  }
  float dq[D / 2];
  MHK_UNROLL
  for (int i = 0; i < D / 2; ++i) dq[i] = 0.f;
  const float sl2 = p.scale_log2;
  const unsigned char* sQ_cw = sQ + cw * 64 * 128;
  const unsigned char* sdO_cw = sdO + cw * 64 * 128;

  // Overlap across key tiles (as the forward's): each step issues S and dP of tile `it` and
  // dQ += dS K of tile it - 1 (three commit groups), forms P while dP and the previous dQ product
  // run, and dS once dP has landed; the previous tile's stage is released once its dQ product has.
  // The first tile's step issues no dQ product and the last tile's follows the loop, so that the
  // loop body has no branch around its wgmma.
  uint32_t dsa[BN / 16][4];  // dS of the previous tile in wgmma's A fragment
  // S and dP of the tile in stage s: P formed in sc, dS in dp, then dsa. `prev`: issue the
  // previous tile's dQ product (stage s_prev) after S and dP.
  auto step = [&](int it, bool prev) {
    const int s = it % kStages;
    const int s_prev = (it + kStages - 1) % kStages;
    const int n0 = (t0 + it) * BN;
    const bool masked = n0 + BN > lim_min;
    const unsigned char* k_s = sK + s * Cfg::kDqTileKV;
    const unsigned char* v_s = sV + s * Cfg::kDqTileKV;
    mbar_wait(&full[s], (it / kStages) & 1);
    float sc[BN / 2], dp[BN / 2];  // S, dP: rows = this warpgroup's query rows, columns = keys
    wgmma_fence();
    issue_abt<Elem, BN, D>(sc, sQ_cw, Cfg::kDqPanelQ, k_s, Cfg::kDqPanelKV);
    wgmma_commit();
    issue_abt<Elem, BN, D>(dp, sdO_cw, Cfg::kDqPanelQ, v_s, Cfg::kDqPanelKV);
    wgmma_commit();
    if (prev) issue_ab<Elem, BN, D>(dq, dsa, sK + s_prev * Cfg::kDqTileKV, Cfg::kDqPanelKV);
    wgmma_commit();  // (an empty group when !prev: the waits below count the same either way)
    wgmma_wait<2>();  // S is in
    MHK_UNROLL
    for (int i = 0; i < BN / 2; ++i) {
      const int h = (i % 4) / 2;
      // Scaled first, masked after: a hidden position is 0 whatever the sign of the scale.
      float x = sc[i] * sl2 - lse2[h];
      if (masked && n0 + 8 * (i / 4) + 2 * t + (i % 2) >= lim[h]) x = -INFINITY;
      sc[i] = fast_exp2(x);
    }
    wgmma_wait<1>();  // dP is in
    MHK_UNROLL
    for (int i = 0; i < BN / 2; ++i) dp[i] = sc[i] * (dp[i] - delta[(i % 4) / 2]);
    wgmma_wait<0>();  // the previous dQ product has read dsa and its K stage
    if (prev) mbar_arrive(&empty[s_prev]);
    acc_to_a<Elem, BN>(dsa, dp);
  };
  if (n_tiles > 0) step(0, false);
  for (int it = 1; it < n_tiles; ++it) step(it, true);
  if (n_tiles > 0) {
    const int s_last = (n_tiles - 1) % kStages;
    wgmma_fence();
    issue_ab<Elem, BN, D>(dq, dsa, sK + s_last * Cfg::kDqTileKV, Cfg::kDqPanelKV);  // dQ += dS K
    wgmma_commit();
    wgmma_wait<0>();
    mbar_arrive(&empty[s_last]);
  }

  // ---- epilogue: dQ (scaled), or this split's fp32 partial ----
  const int64_t n_rows = static_cast<int64_t>(p.B) * p.H * p.Lq;
  for (int h = 0; h < 2; ++h) {
    const int r = rows[h];
    if (r >= group_rows) continue;
    if (p.num_splits > 1) {
      float* dst = p.dq_partial + (split * n_rows + packed_row_linear(b, p.H, hkv, p.group, p.Lq, r)) * D;
      MHK_UNROLL
      for (int c = 0; c < D / 8; ++c) {
        dst[8 * c + 2 * t] = dq[4 * c + 2 * h] * p.scale;
        dst[8 * c + 2 * t + 1] = dq[4 * c + 2 * h + 1] * p.scale;
      }
    } else {
      Elem* dst = static_cast<Elem*>(p.dq) + packed_row_offset(p.dq_stride, b, hkv, p.group, p.Lq, r);
      MHK_UNROLL
      for (int c = 0; c < D / 8; ++c)
        *reinterpret_cast<uint32_t*>(dst + 8 * c + 2 * t) =
            Tr::pack2(dq[4 * c + 2 * h] * p.scale, dq[4 * c + 2 * h + 1] * p.scale);
    }
  }
#endif  // MHK_SM90_ENABLED
}

}  // namespace sm90
}  // namespace cuda
}  // namespace mhakern
