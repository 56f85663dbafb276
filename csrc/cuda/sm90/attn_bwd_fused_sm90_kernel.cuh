// Fused backward attention for sm_90a (Hopper): one CTA per (batch, KV head, 128 keys) computes
// dK, dV and dQ with 5 matrix products per tile (attn_bwd_sm90_kernel.cuh's two kernels take 7:
// its dQ kernel recomputes S and dP). Opt-in (capabilities.h: kSm90BwdFused), never run on a GPU.
//
// With P recomputed from the saved lse, dP = dO V^T, delta = rowsum(dO o O), dS = P o (dP - delta):
// dV = P^T dO, dK = scale dS^T Q, dQ = scale dS K. One CTA of 3 warpgroups:
//   warpgroup 0, warps 0-1 (the producer): K and V of the CTA's keys once by TMA, then a ring of
//     kStages stages of kBlockM = 64 packed query rows (Q and dO by TMA when the stage lies in one
//     query head, else plain 16-byte loads + fence.proxy.async; the rows' lse, delta and visible
//     limit by plain stores), guarded by "full" / "empty" mbarriers.
//   warpgroup 0, warp 3 (the dQ writer): adds each stage's fp32 dQ tile from shared memory into
//     the global fp32 workspace with one bulk reduce-add (cp.reduce.async.bulk .add.f32) of
//     kBlockM x D floats (the workspace holds a (B, Hkv) group's packed rows contiguously, padded
//     to whole row tiles, so a tile is one contiguous range); in the deterministic mode it first
//     waits until the row tile's semaphore counts this CTA's key-block index (ld.acquire.gpu),
//     and after the add has completed advances it (red.release.gpu): the fp32 adds into each row
//     tile happen in increasing key-block order, whatever the schedule. The CTA's work item (its
//     key block) is its ticket, taken at its start from a counter (../common/dq_accum.cuh
//     take_ticket), not its block index: the hardware starts CTAs in no promised order, and a
//     CTA that waits on a key block whose CTA has not started, while every SM is held by such
//     waiters, would wait forever (a 2,048-CTA grid on 132 SMs). With tickets, every lower
//     ticket's CTA has started (it is resident or done), so the chain of waits always ends.
//   warpgroups 1 and 2 (the consumers, 64 keys each, setmaxnreg.inc): per stage
//       S^T = K Q^T, dP^T = V dO^T                      (SS, keys are the accumulator rows)
//       P^T = exp2(S^T scale log2e - lse2), dV += P^T dO  (RS: P^T from registers)
//       dS^T = P^T o (dP^T - delta), dK += dS^T Q       (RS)
//       dS^T to shared memory (bf16, query rows contiguous per key), both consumers meet, then
//       dQ_part = dS K (SS, A and B both MN-major), the consumers splitting the 64 x D tile: at
//       D 128 each computes 64 of the columns over all 128 keys; at D 64 each the whole tile
//       over its own 64 keys (the writer adds the two parts one after the other). The part goes
//       to an fp32 dQ tile in shared memory.
//   A small kernel (attn_bwd_dq_convert_sm90_kernel) scales the workspace into dQ afterwards.
// dK and dV are sums over the group's packed query rows (every query head of the KV head) in one
// thread's registers, in one order: no atomics. Rows that see no key (lse = -inf) give nothing;
// keys at or past key_lengths[b] get zero dK and dV (written as zeros), and nothing of what K and
// V hold there reaches dQ: TMA reads them, so the consumers zero those rows of K in shared memory
// and set a hidden position's dS to 0 (not 0 x (dP - delta), NaN where V holds a NaN or inf).
// Not here (choose_bwd_family falls back to the mma.sync family): attn_mask, its gradient,
// dropout, windows, top-left causal (capabilities.h: kSm90BwdFusedFeatures).
#pragma once

#include "../common/dq_accum.cuh"  // ld_acquire_gpu, red_release_add_gpu, spin_pause, take_ticket
#include "attn_bwd_sm90_kernel.cuh"  // lse_base2, load_rows_sw128, acc_to_a, issue_abt, issue_ab

namespace mhakern {
namespace cuda {
namespace sm90 {

// ---- primitives of the fused backward: wgmma with both operands MN-major, bulk reduce-add,
// the row tiles' semaphores -----------------------------------------------------------------
#if defined(MHAKERN_CUDA_EMULATE)
// d (N / 2 floats) = A B (+ d): A and B from descriptors, both MN-major (imm-trans-a = imm-trans-b = 1).
template <int N, typename Elem>
inline void wgmma_ss_tt(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  ::mhk_emu::sm90::wgmma(d, N, ElemTraits<Elem>::kIsBf16, nullptr, desc_a, desc_b, true, scale_d != 0, true);
}
// cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [dst], [src], bytes.
inline void bulk_reduce_add_f32(float* dst, const void* src, uint32_t bytes) {
  ::mhk_emu::sm90::bulk_reduce_add_f32(dst, src, bytes);
}
inline void bulk_commit() { ::mhk_emu::sm90::bulk_commit(); }
// cp.async.bulk.wait_group.read 0: the thread's bulk operations have read their shared source.
inline void bulk_wait_read() { ::mhk_emu::sm90::bulk_wait(true); }
// cp.async.bulk.wait_group 0: they have completed (their global writes performed).
inline void bulk_wait_done() { ::mhk_emu::sm90::bulk_wait(false); }
// fence.proxy.async.global: orders the async proxy's global accesses with the generic proxy's.
inline void fence_proxy_async_global() {}
#elif MHK_SM90_ENABLED
template <int N, typename Elem>
MHK_DEVICE void wgmma_ss_tt(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  static_assert(N == 64, "wgmma_ss_tt: N 64 (tools/generate_kernels.py: WGMMA_FORMS)");
  if constexpr (ElemTraits<Elem>::kIsBf16) MHK_WGMMA_SST_N64_BF16;
  if constexpr (!ElemTraits<Elem>::kIsBf16) MHK_WGMMA_SST_N64_F16;
}
MHK_DEVICE void bulk_reduce_add_f32(float* dst, const void* src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
               "r"(shared_u32(src)), "r"(bytes)
               : "memory");
}
MHK_DEVICE void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
MHK_DEVICE void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
MHK_DEVICE void bulk_wait_done() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
MHK_DEVICE void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;\n" ::: "memory"); }
#endif

// One thread's wait for a row tile's turn and its pass to the next key block (../common/dq_accum.cuh's
// acquire/release primitives; its CTA-wide dq_wait_turn / dq_pass_turn would stop the consumers,
// here only the dQ writer waits).
MHK_DEVICE void sem_wait_eq(const uint32_t* sem, uint32_t want) {
  while (ld_acquire_gpu(sem) != want) spin_pause();
}
MHK_DEVICE void sem_release_inc(uint32_t* sem) { red_release_add_gpu(sem, 1u); }

template <int D>
struct BwdFusedConfigSm90 {
  static_assert(D == 64 || D == 128, "the fused sm90 backward is instantiated for head dims 64 and 128");
  static constexpr int kConsumers = 2;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  // Producer threads (warps 0-1; warp 2 idles, warp 3 writes dQ): with 96 the plain-load path's
  // swizzle pattern is not loop-invariant (6 rows per pass) and spilled 12 bytes under 24
  // registers; with 64 a pass covers 4 or 8 rows, as 128 covers 8 or 16.
  static constexpr int kLoaders = 64;
  static constexpr int kStages = caps::kSm90BwdFusedStages;
  // One CTA per SM: 128 x 24 + 256 x 240 = 64512 = 384 x 168, the launch's registers (the
  // dK/dV kernel's plan). The consumers hold dK, dV (2 x D / 2), S^T and dP^T (2 x 32), the dQ
  // part (32) and two A fragments: at D 128 ptxas serialises the wgmma and spills under 240.
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  static constexpr int kPanels = D / 64;  // 128-byte (64-element) column panels of D
  static constexpr int kBlockN = caps::kSm90BwdFusedBlockN;
  static constexpr int kBlockM = caps::kSm90BwdFusedBlockM;
  static_assert(kBlockN == 64 * kConsumers, "one 64-row wgmma accumulator of keys per consumer");
  static_assert(kBlockM == 64, "one 64-row dQ accumulator per consumer");
  // The dQ part of consumer cw, a 64 x 64 wgmma tile: at D 128 columns [64 cw, +64) over all the
  // CTA's keys; at D 64 all columns over the consumer's own 64 keys (kSplitKeys), the two parts
  // then added one after the other by the dQ writer (two bulk adds, in consumer order).
  static constexpr bool kSplitKeys = D == 64;
  static constexpr int kDqKeys = kSplitKeys ? 64 : kBlockN;  // keys of one consumer's dQ product
  static constexpr int kPanelKV = kBlockN * 128;  // one 64-column panel of K or V
  static constexpr int kPanelQ = kBlockM * 128;
  static constexpr int kTileKV = kPanels * kPanelKV;
  static constexpr int kTileQ = kPanels * kPanelQ;
  // dS^T: kBlockN key rows of 128 bytes (the stage's 64 query rows).
  static constexpr int kTileDs = kBlockN * 128;
  static constexpr int kTileDq = kBlockM * D * 4;  // fp32, row-major (the workspace's layout)
  static constexpr int kDqParts = kSplitKeys ? kConsumers : 1;  // dQ tiles in shared memory
  static constexpr int kOffV = kTileKV;
  static constexpr int kOffQ = 2 * kTileKV;
  static constexpr int kOffDo = kOffQ + kStages * kTileQ;
  static constexpr int kOffDs = kOffDo + kStages * kTileQ;  // two buffers (stage parity)
  static constexpr int kOffDq = kOffDs + 2 * kTileDs;
  static constexpr int kOffRows = kOffDq + kDqParts * kTileDq;  // lse2, delta, limit per stage
  static constexpr int kOffBar = kOffRows + kStages * 3 * kBlockM * 4;
  static constexpr int kOffTicket = kOffBar + (2 * kStages + 1) * 8;  // the CTA's work item
  static constexpr int kSmemBytes = kOffTicket + 8;
  static constexpr int kSmemAlloc = kSmemBytes + 1024;  // room to round the base up to 1024 bytes
  static_assert(kSmemAlloc <= 227 * 1024, "sm_90 allows 227 KB of shared memory per block");
  // HGMMA per stage and consumer: S^T and dP^T (D / 16 each), dV and dK (kBlockM / 16 each), the
  // dQ part (kBlockN / 16): the 5 products (tools/check_cuda_build.py checks the main loop).
  static constexpr int kHgmmaPerStage = 2 * (D / 16) + 2 * (kBlockM / 16) + kDqKeys / 16;
  // Named barriers (0 is __syncthreads): both consumers' dS^T stored; the dQ tile written
  // (consumers arrive, the dQ writer waits); the dQ tile read by the bulk add (the reverse).
  static constexpr int kBarDs = 1, kBarDqFull = 2, kBarDqEmpty = 3;
  static constexpr int kDqBarThreads = 128 * kConsumers + 32;
};

// Parameters: the common backward fields, the tensor maps (K and V boxes of kBlockN rows, Q and
// dO boxes of kBlockM rows) and the zeroed workspace (caps::sm90_bwd_fused_workspace_floats):
// the fp32 dQ sums, then one uint32 semaphore per (batch, KV head, row tile), then the ticket
// counter.
struct BwdFusedParamsSm90 {
  TensorMap tma_k;
  TensorMap tma_v;
  TensorMap tma_q;
  TensorMap tma_do;
  BwdParams p;
  float* dq_accum = nullptr;  // (B, Hkv, n_row_tiles * kBlockM, D)
  uint32_t* sem = nullptr;    // (B, Hkv, n_row_tiles)
  uint32_t* ticket = nullptr;  // one counter: the deterministic mode's work items by arrival
  bool deterministic = true;
#if defined(MHAKERN_CUDA_EMULATE)
  // Deliberate bugs, for the emulator's own tests (which must see each fail); never compiled
  // for a GPU. 1: the deterministic mode skips its wait (adds in any order); 2: it advances the
  // semaphore once the add has read its source, before the add completes; 3: the dQ writer
  // frees the shared dQ tile before the bulk add has read it; 4: the deterministic mode takes
  // its work item from the block index instead of a ticket (deadlocks when CTAs start out of
  // block order with fewer resident than the grid: tests/test_cuda_sm90_bwd.py).
  int fault = 0;
#endif
};

#if defined(MHAKERN_CUDA_EMULATE)
#define MHK_FUSED_FAULT(n) (P.fault == (n))
#else
#define MHK_FUSED_FAULT(n) false
#endif

#if MHK_SM90_ENABLED
// acc (64 x 64) = A B over kBlockN keys: A = dS (64 query rows x keys), stored as dS^T with a
// key per 128-byte row (query rows contiguous: MN-major) at a; B = K (keys x 64 columns), a
// 64-column panel of the K tile stored a key per row (N-major) at b. Both descriptors step 16
// keys = 2 atoms of 8 rows per k-step.
template <typename Elem, int KEYS>
MHK_DEVICE void issue_dq(float (&acc)[32], const unsigned char* a, const unsigned char* b) {
  MHK_UNROLL
  for (int ks = 0; ks < KEYS / 16; ++ks) {
    const uint64_t da = desc_bits(shared_u32(a + ks * 16 * 128), 16, 1024);
    const uint64_t db = desc_bits(shared_u32(b + ks * 16 * 128), 16, 1024);
    wgmma_ss_tt<64, Elem>(acc, da, db, ks > 0 ? 1 : 0);
  }
}
#endif

template <typename Elem, int D>
__global__ void MHK_LAUNCH_BOUNDS(BwdFusedConfigSm90<D>::kThreads, 1)
    attn_bwd_fused_sm90_kernel(const MHK_GRID_CONSTANT BwdFusedParamsSm90 P) {
#if MHK_SM90_ENABLED
  using Cfg = BwdFusedConfigSm90<D>;
  using Tr = ElemTraits<Elem>;
  constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN, kStages = Cfg::kStages;
  const BwdParams& p = P.p;
  MHK_DYNAMIC_SMEM(smem_raw);
  unsigned char* smem = smem_raw + (1024 - shared_u32(smem_raw) % 1024) % 1024;
  const int tid = thread_index();
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + Cfg::kOffBar);
  uint64_t* empty = full + kStages;
  uint64_t* kv_bar = empty + kStages;
  uint32_t* sTicket = reinterpret_cast<uint32_t*>(smem + Cfg::kOffTicket);

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], Cfg::kLoaders);           // every loader thread, each stage
      mbar_init(&empty[s], Cfg::kConsumers * 128);  // every consumer thread
    }
    mbar_init(kv_bar, 1);
    fence_barrier_init();
    // The work item: in the deterministic mode the next ticket (see the header), else the
    // block index (nothing waits on another CTA).
    *sTicket = P.deterministic && !MHK_FUSED_FAULT(4) ? take_ticket(P.ticket) : static_cast<uint32_t>(block_index());
  }
  block_sync();

  const int group_rows = p.group * p.Lq;
  const int n_mtiles = ceil_div(group_rows, BM);
  const int n_ntiles = ceil_div(p.Lk, BN);
  int64_t bid = *sTicket;
  // Key blocks fastest: the work items that add into one row tile before this one have lower
  // tickets, so their CTAs have started (the deterministic mode's wait cannot deadlock).
  const int nt = static_cast<int>(bid % n_ntiles);
  bid /= n_ntiles;
  const int hkv = static_cast<int>(bid % p.Hkv);
  const int b = static_cast<int>(bid / p.Hkv);
  const int n0 = nt * BN;
  const int Lk_b = key_length_of(p, b);

  // The visible limits of query tile mt's first and last rows: the tile matters when lim_hi > n0
  // (a row sees a key of this CTA; never when n0 >= Lk_b), and needs a mask when lim_lo < n0 + BN.
  // The key blocks that add into a row tile are therefore [0, ceil(lim_hi / BN)): this CTA is
  // the nt-th, which is what its semaphore counts before this CTA's turn.
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
  unsigned char* sV = smem + Cfg::kOffV;
  unsigned char* sQ = smem + Cfg::kOffQ;    // stage s at + s * kTileQ
  unsigned char* sdO = smem + Cfg::kOffDo;  // likewise
  unsigned char* sDs = smem + Cfg::kOffDs;  // buffer it % 2 at + (it % 2) * kTileDs
  float* sDq = reinterpret_cast<float*>(smem + Cfg::kOffDq);
  float* sLse2 = reinterpret_cast<float*>(smem + Cfg::kOffRows);  // stage s at + s * BM
  float* sDelta = sLse2 + kStages * BM;
  int* sLimit = reinterpret_cast<int*>(sDelta + kStages * BM);

  const int wg = tid / 128;
  if (wg == 0) {
    setmaxnreg_dec<Cfg::kProducerRegs>();
    if (tid >= 96) {
      // ---- dQ writer (warp 3) ----
      const int lane = tid % 32;
      const int64_t head_tiles = (static_cast<int64_t>(b) * p.Hkv + hkv) * n_mtiles;
      int it = 0;
      for (int mt = first_tile; mt < n_mtiles; ++it) {
        const int next = next_tile(mt + 1);
        named_bar_sync(Cfg::kBarDqFull, Cfg::kDqBarThreads);  // the consumers wrote the tile
        const bool early_free = MHK_FUSED_FAULT(3) && next < n_mtiles;
        if (early_free) named_bar_arrive(Cfg::kBarDqEmpty, Cfg::kDqBarThreads);
        if (lane == 0) {
          uint32_t* sem = P.sem + head_tiles + mt;
          if (P.deterministic && !MHK_FUSED_FAULT(1)) sem_wait_eq(sem, static_cast<uint32_t>(nt));
          fence_proxy_async_global();  // the previous block's adds, seen through the acquire
          float* dst = P.dq_accum + (head_tiles + mt) * BM * D;
          for (int part = 0; part < Cfg::kDqParts; ++part) {
            // The second part's adds after the first's have completed: the same addresses, and
            // two bulk operations in flight are not ordered.
            if (part > 0) bulk_wait_done();
            bulk_reduce_add_f32(dst, reinterpret_cast<const unsigned char*>(sDq) + part * Cfg::kTileDq, Cfg::kTileDq);
            bulk_commit();
          }
          bulk_wait_read();
        }
        warp_sync_all();
        // The tile may be rewritten (the consumers wait for this only before a next tile).
        if (next < n_mtiles && !early_free) named_bar_arrive(Cfg::kBarDqEmpty, Cfg::kDqBarThreads);
        if (lane == 0 && P.deterministic) {
          if (!MHK_FUSED_FAULT(2)) bulk_wait_done();  // the adds are performed before the next key block's
          fence_proxy_async_global();
          sem_release_inc(P.sem + head_tiles + mt);
        }
        mt = next;
      }
      if (lane == 0) bulk_wait_done();  // nothing in flight when the block's shared memory goes
      return;
    }
    if (tid >= Cfg::kLoaders) return;  // warp 2
    // ---- loaders (warps 0-1) ----
    if (tid == 0 && first_tile < n_mtiles) {
      // K and V of the CTA's keys, once (rows past Lk zero-filled; rows in [Lk_b, Lk) are read
      // but their gradients are written as zeros).
      mbar_arrive_expect_tx(kv_bar, 2 * Cfg::kTileKV);
      for (int pn = 0; pn < Cfg::kPanels; ++pn) {
        tma_load_4d(sK + pn * Cfg::kPanelKV, &P.tma_k, pn * 64, n0, hkv, b, kv_bar);
        tma_load_4d(sV + pn * Cfg::kPanelKV, &P.tma_v, pn * 64, n0, hkv, b, kv_bar);
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
      static_assert(BM <= Cfg::kLoaders, "a row's lse, delta and limit per loader thread");
      if (tid < BM) {
        const int rr = tid, r = r0 + rr;
        float lse2 = INFINITY, delta = 0.f;
        int limit = 0;
        if (r < group_rows) {
          const int64_t lin = packed_row_linear(b, p.H, hkv, p.group, p.Lq, r);
          lse2 = lse_base2(p.lse[lin]);
          delta = p.delta[lin];
          limit = visible_limit(r % p.Lq, Lk_b, p.Lq, p.causal);
        }
        sLse2[s * BM + rr] = lse2;
        sDelta[s * BM + rr] = delta;
        sLimit[s * BM + rr] = limit;
      }
      unsigned char* dq_s = sQ + s * Cfg::kTileQ;
      unsigned char* ddo_s = sdO + s * Cfg::kTileQ;
      const int h0 = r0 / p.Lq, i0 = r0 % p.Lq;
      // TMA when the stage's rows are consecutive positions of one query head (rows past Lq
      // of the group's last head are past the group: the box's zero fill is what they need).
      if (i0 + BM <= p.Lq || h0 == p.group - 1) {
        if (tid == 0) {
          mbar_arrive_expect_tx(&full[s], 2 * Cfg::kTileQ);
          const int h = hkv * p.group + h0;
          for (int pn = 0; pn < Cfg::kPanels; ++pn) {
            tma_load_4d(dq_s + pn * Cfg::kPanelQ, &P.tma_q, pn * 64, i0, h, b, &full[s]);
            tma_load_4d(ddo_s + pn * Cfg::kPanelQ, &P.tma_do, pn * 64, i0, h, b, &full[s]);
          }
        } else {
          mbar_arrive(&full[s]);
        }
      } else {
        // Packed rows that straddle two query heads: no tensor map describes them.
        load_rows_sw128<Elem, BM, D>(dq_s, tid, Cfg::kLoaders, [&](int rr) -> const Elem* {
          const int r = r0 + rr;
          return r < group_rows ? q + packed_row_offset(p.q_stride, b, hkv, p.group, p.Lq, r) : nullptr;
        });
        load_rows_sw128<Elem, BM, D>(ddo_s, tid, Cfg::kLoaders, [&](int rr) -> const Elem* {
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
  setmaxnreg_inc<Cfg::kConsumerRegs>();
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
  // This consumer's dQ part: at D 128 A = dS^T of all keys, B = the K panel of its columns; at
  // D 64 A = dS^T of its keys, B = K of its keys (one panel), into its own fp32 tile.
  const int ds_key0 = Cfg::kSplitKeys ? 64 * cw : 0;
  const unsigned char* sK_dq = Cfg::kSplitKeys ? sK + 64 * cw * 128 : sK + cw * Cfg::kPanelKV;
  float* sDq_cw = sDq + (Cfg::kSplitKeys ? cw * BM * D : 0);
  const int dq_col0 = Cfg::kSplitKeys ? 0 : 64 * cw;

  if (first_tile < n_mtiles) {
    mbar_wait(kv_bar, 0);
    // Keys in [Lk_b, Lk) as zeros in K: dQ = dS K would turn their dS of 0 into NaN where K
    // holds a NaN there (TMA zero-fills only past Lk). Both consumers read every key of K.
    if (n0 + BN > Lk_b && Lk_b < p.Lk) {
      const int hidden0 = imax(Lk_b - n0, 0);
      for (int c = t128 + 128 * cw; c < (BN - hidden0) * 8 * Cfg::kPanels; c += 128 * Cfg::kConsumers) {
        const int row = hidden0 + c / (8 * Cfg::kPanels), rest = c % (8 * Cfg::kPanels);
        *reinterpret_cast<uint4*>(sK + (rest / 8) * Cfg::kPanelKV + row * 128 + (rest % 8) * 16) = make_uint4(0, 0, 0, 0);
      }
      fence_proxy_async();  // generic stores, before wgmma reads K
      named_bar_sync(Cfg::kBarDs, 128 * Cfg::kConsumers);
    }
  }
  int it = 0;
  for (int mt = first_tile; mt < n_mtiles; mt = next_tile(mt + 1), ++it) {
    const int s = it % kStages;
    int lim_lo, lim_hi;
    tile_limits(mt, lim_lo, lim_hi);
    const bool masked = lim_lo < n0 + BN;
    const unsigned char* q_s = sQ + s * Cfg::kTileQ;
    const unsigned char* do_s = sdO + s * Cfg::kTileQ;
    unsigned char* ds_buf = sDs + (it % 2) * Cfg::kTileDs;
    const float* lse2 = sLse2 + s * BM;
    const float* delta = sDelta + s * BM;
    const int* limit = sLimit + s * BM;
    mbar_wait(&full[s], (it / kStages) & 1);

    float st[BM / 2], dpt[BM / 2];  // S^T, dP^T: rows = this warpgroup's keys, columns = query rows
    wgmma_fence();
    issue_abt<Elem, BM, D>(st, sK_cw, Cfg::kPanelKV, q_s, Cfg::kPanelQ);
    wgmma_commit();
    issue_abt<Elem, BM, D>(dpt, sV_cw, Cfg::kPanelKV, do_s, Cfg::kPanelQ);
    wgmma_commit();
    wgmma_wait<1>();  // S^T is in; dP^T may still run while P^T is formed
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
    uint32_t pa[BM / 16][4];
    acc_to_a<Elem, BM>(pa, st);
    wgmma_fence();  // dv and the A registers were written since the last wait
    issue_ab<Elem, BM, D>(dv, pa, do_s, Cfg::kPanelQ);  // dV += P^T dO
    wgmma_commit();
    wgmma_wait<1>();  // dP^T is in; dV may still run
    MHK_UNROLL
    for (int c = 0; c < BM / 8; ++c) {
      const float2 d2 = *reinterpret_cast<const float2*>(delta + 8 * c + 2 * t);
      const int2 lim2 = *reinterpret_cast<const int2*>(limit + 8 * c + 2 * t);
      MHK_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int i = 4 * c + e;
        dpt[i] = st[i] * (dpt[i] - (e % 2 ? d2.y : d2.x));
        // A hidden position's dS is 0 exactly, not 0 x (dP - delta): that is NaN when V holds a
        // NaN or inf past key_lengths, and dS reaches dQ here (the split kernels' dQ pass loads
        // hidden keys as zeros instead).
        if (masked && key[e / 2] >= (e % 2 ? lim2.y : lim2.x)) dpt[i] = 0.f;
      }
    }
    uint32_t dsa[BM / 16][4];
    acc_to_a<Elem, BM>(dsa, dpt);
    wgmma_fence();
    issue_ab<Elem, BM, D>(dk, dsa, q_s, Cfg::kPanelQ);  // dK += dS^T Q (scaled at the end)
    wgmma_commit();
    // dS^T into this stage's buffer: the word dsa[ks][j] holds keys g + 8 (j % 2) of the warp,
    // query rows 8 (2 ks + j / 2) + 2 t, + 1 (acc_to_a's pairs). A row of 128 bytes per key,
    // the 16-byte chunks swizzled by the key's row in its 8-row atom. The buffer
    // was last read by the dQ products of stage it - 2, and both consumers have completed those:
    // each arrived at stage it - 1's kBarDs only after its wait for them.
    MHK_UNROLL
    for (int ks = 0; ks < BM / 16; ++ks) {
      MHK_UNROLL
      for (int j = 0; j < 4; ++j) {
        const int kr = cw * 64 + warp * 16 + g + 8 * (j % 2);  // key row in the CTA's tile
        const int qc = 8 * (2 * ks + j / 2) + 2 * t;           // query row in the stage
        unsigned char* row = ds_buf + kr * 128;
        *reinterpret_cast<uint32_t*>(row + (((qc / 8) ^ (kr % 8)) * 16) + (qc % 8) * 2) = dsa[ks][j];
      }
    }
    fence_proxy_async();  // the generic stores of dS^T, before wgmma reads them
    named_bar_sync(Cfg::kBarDs, 128 * Cfg::kConsumers);
    float dqp[32];  // this consumer's 64 x 64 part of the stage's dQ tile
    wgmma_fence();
    issue_dq<Elem, Cfg::kDqKeys>(dqp, ds_buf + ds_key0 * 128, sK_dq);
    wgmma_commit();
    wgmma_wait<0>();
    mbar_arrive(&empty[s]);  // the stage's operands are read: the producer may refill it
    // The fp32 part into the shared dQ tile, once the bulk add of the previous tile has read it.
    if (it > 0) named_bar_sync(Cfg::kBarDqEmpty, Cfg::kDqBarThreads);
    MHK_UNROLL
    for (int i = 0; i < 32; i += 2) {
      const int row = warp * 16 + g + 8 * ((i % 4) / 2);
      const int col = dq_col0 + 8 * (i / 4) + 2 * t;
      *reinterpret_cast<float2*>(sDq_cw + row * D + col) = make_float2(dqp[i], dqp[i + 1]);
    }
    fence_proxy_async();  // the generic stores, before the bulk add (async proxy) reads them
    named_bar_arrive(Cfg::kBarDqFull, Cfg::kDqBarThreads);
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

// dq[b, h, i, :] = scale * the workspace's row of packed row r = (h - hkv group) Lq + i: one
// thread per 4 consecutive elements. Compiled for every target (plain loads and stores).
template <typename Elem, int D>
__global__ void MHK_LAUNCH_BOUNDS(256, 1) attn_bwd_dq_convert_sm90_kernel(const BwdFusedParamsSm90 P) {
  using Cfg = BwdFusedConfigSm90<D>;
  const BwdParams& p = P.p;
  const int64_t quads = static_cast<int64_t>(p.B) * p.H * p.Lq * (D / 4);
  const int64_t x = block_index() * 256 + thread_index();
  if (x >= quads) return;
  const int c = static_cast<int>(x % (D / 4)) * 4;
  const int64_t row = x / (D / 4);
  const int i = static_cast<int>(row % p.Lq);
  const int h = static_cast<int>((row / p.Lq) % p.H);
  const int b = static_cast<int>(row / (static_cast<int64_t>(p.Lq) * p.H));
  const int hkv = h / p.group;
  const int r = (h - hkv * p.group) * p.Lq + i;
  const int64_t padded = static_cast<int64_t>(ceil_div(p.group * p.Lq, Cfg::kBlockM)) * Cfg::kBlockM;
  const float* src = P.dq_accum + ((static_cast<int64_t>(b) * p.Hkv + hkv) * padded + r) * D + c;
  Elem* dst = static_cast<Elem*>(p.dq) + b * p.dq_stride.batch + h * p.dq_stride.head +
              static_cast<int64_t>(i) * p.dq_stride.row + c;
  const float4 v = *reinterpret_cast<const float4*>(src);
  *reinterpret_cast<uint32_t*>(dst) = ElemTraits<Elem>::pack2(v.x * p.scale, v.y * p.scale);
  *reinterpret_cast<uint32_t*>(dst + 2) = ElemTraits<Elem>::pack2(v.z * p.scale, v.w * p.scale);
}

}  // namespace sm90
}  // namespace cuda
}  // namespace mhakern
