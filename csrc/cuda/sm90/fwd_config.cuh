// The sm_90a forward's configuration: tiles, stages, the shared-memory plan, the register plan
// (FwdConfigSm90), the kernel's parameters (FwdParamsSm90) and the compile-time switches of the
// diagnostic and deliberately defective variants. No code: the forward's parts
// (tile_scheduler.cuh, attn_fwd_sm90_kernel.cuh) read their sizes and offsets from here.
#pragma once

#include "../../capabilities.h"
#include "../common/attn_params.h"
#include "primitives_sm90.cuh"

// Compile-time diagnostic variants (benchmarks/diag_fwd_sm90.cu builds them, one per binary, to
// split a step's time on a GPU into load wait, softmax and overlap; the extension never defines
// them, so with all of them unset the production kernel is exactly the code below):
//   MHK_SM90_FWD_DIAG_STAGES n   rings of n K and n V stages instead of the capability table's (D <= 128)
//   MHK_SM90_FWD_DIAG_COUPLED_KV 1  K's stage released only once P V has landed, with V's (the
//                                 coupled release of one K/V stage, as before the split; the
//                                 results stay exact: the variant measures what the split gains)
//   MHK_SM90_FWD_DIAG_NO_SOFTMAX  P = S packed as it is: no mask, row max, exp, sum or O rescale
//                                 (the GEMMs and the pipeline alone; the output is meaningless)
//   MHK_SM90_FWD_DIAG_NO_LOADS    the producer fills each stage once, then completes the later
//                                 tiles' barriers without copying (compute alone; output meaningless)
//   MHK_SM90_FWD_PIN_SOFTMAX 0|1  the never-taken shared store that keeps ptxas from hoisting the
//                                 P V wait above the softmax (pin_before_wait); its default is
//                                 the production kernel's choice
#ifndef MHK_SM90_FWD_DIAG_STAGES
#define MHK_SM90_FWD_DIAG_STAGES 0
#endif
#ifndef MHK_SM90_FWD_DIAG_COUPLED_KV
#define MHK_SM90_FWD_DIAG_COUPLED_KV 0
#endif
#ifndef MHK_SM90_FWD_DIAG_NO_SOFTMAX
#define MHK_SM90_FWD_DIAG_NO_SOFTMAX 0
#endif
#ifndef MHK_SM90_FWD_DIAG_NO_LOADS
#define MHK_SM90_FWD_DIAG_NO_LOADS 0
#endif
#ifndef MHK_SM90_FWD_PIN_SOFTMAX
#define MHK_SM90_FWD_PIN_SOFTMAX 1
#endif
#if (MHK_SM90_FWD_DIAG_STAGES || MHK_SM90_FWD_DIAG_NO_SOFTMAX || MHK_SM90_FWD_DIAG_NO_LOADS) && \
    !defined(MHK_SM90_FWD_DIAG_BUILD)
#error "the sm90 forward's diagnostic variants give wrong results: only benchmarks/diag_fwd_sm90.cu builds them"
#endif

// Deliberate defects for the emulator's suite only (tests/test_cuda_sm90.py sets them at run
// time, cuda_emu_sm90.h fwd_fault): 1 releases K's stage before the wait that S has landed, 2
// V's before the wait that P V has, 3 a consumer's Q half as soon as it has it (before its
// products read it). Each must fail the suite; the nvcc build has none.
#if defined(MHAKERN_CUDA_EMULATE)
#define MHK_SM90_FWD_FAULT(n) (::mhk_emu::sm90::fwd_fault() == (n))
#else
#define MHK_SM90_FWD_FAULT(n) false
#endif

namespace mhakern {
namespace cuda {
namespace sm90 {

// Tiles (capabilities.h: sm90_fwd_tiles, read here and by the split-K planner).
//   D 64 and 128: 128 query rows x 128 keys per stage, 3 K stages and 3 V stages. Why rings
//     this deep (FlashAttention-3's pipelining argument: a load must be issued a whole step of
//     math before its tile is needed, or the copy's latency adds to every step): with the
//     intra-warpgroup overlap (attn_fwd_sm90_kernel.cuh), step `it` reads K of tile it (S)
//     and V of tile it - 1 (P V). K's stage is free once both consumers' S has landed, within
//     the step that reads it; V's once both consumers' P V has, at the end of the step after
//     the one its K served. A stage freed at the end of step j is needed again S steps of its
//     ring later, so a copy has (S - 1) steps to land: 2 steps per ring here (docs/performance.md, the load term
//     lambda / (S - 1)). One coupled K/V stage, released after P V, had S - 2 = 1 step with the
//     same 3 stages and 192 KB; a ring of 2 coupled stages none (the latency was paid on every
//     step, measured on an H200). Shared memory: Q 16 / 32 KB + 3 x K + 3 x V = 96 / 192 KB =
//     112 / 224 KB (+ barriers and the 1 KB alignment slack) of the 227 KB. One CTA per SM
//     either way (the register plan takes the whole register file), so the stages cost no
//     occupancy. The other use of the memory the split frees, 176 keys per stage with 2 + 2
//     stages (FlashAttention-3's hdim-128 tile): one step per copy instead of two (0.98 us of
//     latency absorbed instead of 2.1, docs/performance.md) and ~10% fewer instructions per
//     key, at 196 live accumulator and fragment registers of 240; the model (tensor-bound
//     either way) prefers the deeper rings.
//   D 256: Q alone is 128 x 256 x 2 B = 64 KB, and one stage of K and V is 2 x kBlockN x 512 B,
//     so 2 stages hold at most (227 KB - 64 KB - 1 KB of alignment) / 2 KB = 81 keys: 80 keys
//     (a multiple of 16, the k of O += P V), 224 KB in all. 96 keys would need 256 KB; 64 keys
//     with 2 stages wastes 32 KB, and 3 stages of 64 keys (256 KB) do not fit. 64 query rows
//     per CTA (one consumer warpgroup) would halve Q but also halve the reuse of every K/V byte
//     and leave no warpgroup to ping-pong with. This is FlashAttention-3's D 256 tile too. No
//     third stage: 3 x 80 keys need 304 KB, and 3 x 48 keys (208 KB) would add 5/3 of the
//     fixed per-step costs (barriers, row maxima, rescales) per key. With separate K and V
//     rings of 2 each a copy still has one step (1.4 us of math for 80 keys) to land.
//   Registers per consumer thread (the setmaxnreg plan gives 240): O 64 x D / 128 fp32 = 128 at
//     D 256, S 64 x kBlockN / 128 = 40, and the previous tile's P in wgmma's A fragment,
//     kBlockN / 16 x 4 = 20 (the intra-warpgroup overlap keeps S and P live together): 188 and
//     the row state, where 128 keys would need 128 + 64 + 32 = 224 before any address.
template <int D>
struct FwdConfigSm90 {
  static_assert(D == 64 || D == 128 || D == 256, "the sm90 forward is instantiated for head dims 64, 128 and 256");
  static constexpr int kBlockM = caps::sm90_fwd_tiles(D).m;  // packed query rows per CTA (2 consumer warpgroups x 64)
  static constexpr int kBlockN = caps::sm90_fwd_tiles(D).n;  // keys per pipeline stage
  static constexpr int kStagesK =
      MHK_SM90_FWD_DIAG_STAGES > 0 && D <= 128 ? MHK_SM90_FWD_DIAG_STAGES : caps::sm90_fwd_tiles(D).stages;
  static constexpr int kStagesV =
      MHK_SM90_FWD_DIAG_STAGES > 0 && D <= 128 ? MHK_SM90_FWD_DIAG_STAGES : caps::sm90_fwd_tiles(D).v_stages;
  static_assert(kStagesK >= 2 && kStagesV >= 2, "a ring of one stage cannot load while it computes");
  static constexpr int kConsumers = 2;
  static_assert(kBlockM == 64 * kConsumers, "one 64-row wgmma strip per consumer warpgroup");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "keys per stage: a multiple of the k of P V, at most wgmma's N");
  static constexpr int kThreads = 128 * (1 + kConsumers);
  // Register plan (setmaxnreg): 128 x 40 + 256 x 232 = 64512 (what 384 x 168 at launch gives the
  // CTA), one CTA per SM. The producer loops over work items (persistent grid): at 24 registers
  // it spilled its item count; the consumers fit 232 without a spill (ptxas, every head dim).
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;
  static constexpr int kPanels = D / 64;        // 128-byte (64-element) column panels of D
  static constexpr int kPanelBytesQ = kBlockM * 128;
  static constexpr int kPanelBytesKV = kBlockN * 128;
  static constexpr int kQBytes = kPanels * kPanelBytesQ;
  static constexpr int kTileBytes = kPanels * kPanelBytesKV;  // one K or V stage
  static constexpr int kOffK = kQBytes;
  static constexpr int kOffV = kOffK + kStagesK * kTileBytes;
  static constexpr int kOffBar = kOffV + kStagesV * kTileBytes;
  // Barriers: K full, K empty, V full, V empty (one per stage of each), fix (see the producer).
  static constexpr int kOffFullK = kOffBar, kOffEmptyK = kOffFullK + 8 * kStagesK;
  static constexpr int kOffFullV = kOffEmptyK + 8 * kStagesK, kOffEmptyV = kOffFullV + 8 * kStagesV;
  static constexpr int kOffFix = kOffEmptyV + 8 * kStagesV;
  // Q's halves (one per consumer): full (the producer's Q loaders arrive), empty (the consumer).
  static constexpr int kOffQFull = kOffFix + 8, kOffQEmpty = kOffQFull + 8 * kConsumers;
  static constexpr int kSmemBytes = kOffQEmpty + 8 * kConsumers;
  // Producer threads that load Q (warps 1-3; warp 0 streams K and V).
  static constexpr int kQLoaders = 96;
  // What the launch asks for: room to round the base up to 1024 bytes, the period of the 128B
  // swizzle that TMA writes and wgmma reads (the declared alignment of dynamic shared memory
  // is not a guarantee of it).
  static constexpr int kSmemAlloc = kSmemBytes + 1024;
  // Named barriers of the consumers' ping-pong (0 is __syncthreads): consumer c waits on
  // kBarTurn + c for its turn to issue wgmma.
  static constexpr int kBarTurn = 1;
  static_assert(kSmemAlloc <= 227 * 1024, "sm_90 allows 227 KB of shared memory per block");
};

// The kernel's parameters: the common forward fields and the tensor maps of K and V (in the
// kernel parameter space: __grid_constant__, so TMA may read them where they are).
struct FwdParamsSm90 {  // CUtensorMap is 64-byte aligned, so is this
  TensorMap tma_k;
  TensorMap tma_v;
  FwdParams p;
  int grid = 1;  // CTAs launched: CTA c takes work items c, c + grid, ... (fwd_work_block)
};

}  // namespace sm90
}  // namespace cuda
}  // namespace mhakern
