// What the compiled kernel families of mhakern._C serve: the one place where head dims, dtypes,
// tile shapes, index limits and implemented modes are written. Everything else reads them:
//   - csrc/cuda/common/attn_dispatch.h and tests/cuda_emulator/emu_entry.cpp expand the instance list
//     below (X-macros), tools/generate_kernels.py writes one csrc/cuda/{mma,sm90}/*.cu per instance from
//     it (tests/test_generated_kernels.py checks the committed files are current);
//   - the kernels' tile configs (FwdConfig / BwdConfig) take their tiles from cuda_tiles();
//   - the host code (csrc/cpu/attention_cpu.cpp, csrc/cuda/cuda_host.cpp) checks against the limits;
//   - Python reads all of it from mhakern/_caps.py, which tools/generate_caps.py writes from
//     this file (through csrc/capabilities_json.h, compiled on the spot; tests/test_caps.py checks
//     the committed module is current), so that `import mhakern` knows it without mhakern._C;
//     torch.ops.mhakern_C.capabilities() reports the same table (the same writer) plus what
//     the build compiled.
// No torch and no CUDA header: nvcc, the emulator build and the host code all include it.
#pragma once

#include <cstdint>

#include "generated/modes.h"

namespace mhakern {
namespace caps {

// Modes of docs/contract.md a family may implement (bits of a feature mask; the names are the
// Python backends' feature names): rows of the mode table (mhakern/mode_table.py FEATURES),
// through csrc/generated/modes.h.
enum Feature : unsigned {
#define MHK_FEATURE_BIT_(k, bit, name) k = 1u << bit,
  MHK_MODE_FEATURES(MHK_FEATURE_BIT_)
#undef MHK_FEATURE_BIT_
};
#define MHK_FEATURE_NAME_(k, bit, name) name,
constexpr const char* kFeatureNames[] = {MHK_MODE_FEATURES(MHK_FEATURE_NAME_)};
#undef MHK_FEATURE_NAME_
constexpr int kNumFeatures = sizeof(kFeatureNames) / sizeof(kFeatureNames[0]);

// ---- cpu family (csrc/cpu/) ------------------------------------------------------------------
// dtypes float32, bfloat16, float16 (torch names; csrc/cpu/attention_cpu.cpp dispatches on them);
// any head dims D, Dv in [1, kCpuMaxHeadDim] (D != Dv allowed).
constexpr const char* kCpuDtypeNames[] = {"float32", "bfloat16", "float16"};
constexpr int kCpuNumDtypes = sizeof(kCpuDtypeNames) / sizeof(kCpuDtypeNames[0]);
constexpr int64_t kCpuMaxHeadDim = 256;
// Modes the cpu kernels implement (csrc/cpu/attention_kernel_impl.h and its kernel/ pieces read
// the params fields of attention_params.h). The op refuses the others with the mode's name.
constexpr unsigned kCpuFeatures =
    kAttnMask | kMaskGrad | kDropout | kTopLeft | kWindow | kSoftcap | kAlibi | kVarlen | kCacheBatchIdx | kPaged |
    kDropoutOffsets;

// ---- cuda family (csrc/cuda/) ----------------------------------------------------------------
// One compiled instantiation per (element type, head dim): F(tag, D) for each. Adding a head dim
// here (and running tools/generate_kernels.py) is all a new instance needs; the tile shapes of
// cuda_tiles() must cover it (the configs static_assert multiples of 16 up to 128).
#define MHK_CUDA_FOR_EACH_HEAD_DIM(F, tag) F(tag, 32) F(tag, 64) F(tag, 96) F(tag, 128)
// Element types by tag (fp16, bf16); csrc/cuda/common/attn_dispatch.h maps a tag to its C++ type and
// torch dtype. F(tag, D) for every instance: G(F, tag) for each tag.
#define MHK_CUDA_FOR_EACH_ELEM(G, F) G(F, fp16) G(F, bf16)
#define MHK_CUDA_FOR_EACH_INSTANCE(F) MHK_CUDA_FOR_EACH_ELEM(MHK_CUDA_FOR_EACH_HEAD_DIM_, F)
#define MHK_CUDA_FOR_EACH_HEAD_DIM_(F, tag) MHK_CUDA_FOR_EACH_HEAD_DIM(F, tag)

// C++ element type of each tag (used only where the CUDA headers are included).
#define MHK_CUDA_ELEM_TYPE_fp16 __half
#define MHK_CUDA_ELEM_TYPE_bf16 __nv_bfloat16
// Torch dtype name of each tag, in the order of MHK_CUDA_FOR_EACH_ELEM.
#define MHK_CUDA_DTYPE_NAME_fp16 "float16"
#define MHK_CUDA_DTYPE_NAME_bf16 "bfloat16"
#define MHK_CUDA_DTYPE_NAME_ITEM_(F, tag) MHK_CUDA_DTYPE_NAME_##tag,
constexpr const char* kCudaDtypeNames[] = {MHK_CUDA_FOR_EACH_ELEM(MHK_CUDA_DTYPE_NAME_ITEM_, _)};
#undef MHK_CUDA_DTYPE_NAME_ITEM_
constexpr int kCudaNumDtypes = sizeof(kCudaDtypeNames) / sizeof(kCudaDtypeNames[0]);

#define MHK_CUDA_HEAD_DIM_ITEM_(tag, D) D,
constexpr int kCudaHeadDims[] = {MHK_CUDA_FOR_EACH_HEAD_DIM(MHK_CUDA_HEAD_DIM_ITEM_, _)};
#undef MHK_CUDA_HEAD_DIM_ITEM_
constexpr int kCudaNumHeadDims = sizeof(kCudaHeadDims) / sizeof(kCudaHeadDims[0]);

// q, k and v of one head dim (D == Dv): the kernels keep one D for Q K^T and P V.
constexpr bool kCudaEqualHeadDims = true;

constexpr bool cuda_head_dim_supported(int64_t d) {
  for (int i = 0; i < kCudaNumHeadDims; ++i)
    if (kCudaHeadDims[i] == d) return true;
  return false;
}

// Compute capability the kernels need (mma.sync bf16, cp.async, ldmatrix).
constexpr int kCudaMinCapabilityMajor = 8, kCudaMinCapabilityMinor = 0;
// The kernels' index arithmetic is 32-bit: the packed rows of a KV-head group (H / Hkv * Lq)
// and the key positions stay below 2^30 so that ceil_div(n + block - 1) and a key block past
// the end never overflow an int.
constexpr int64_t kCudaMaxGroupRows = int64_t{1} << 30;
constexpr int64_t kCudaMaxKeys = int64_t{1} << 30;  // Lk < kCudaMaxKeys
// Modes the cuda kernels implement (csrc/cuda/common/primitives.cuh: Visibility, ExtraModes; softcap and
// ALiBi in the kModes kernels, modified_score_log2; packed sequences in the kModes forward and the
// split backward's kModes kernels, a sequence per CTA as a batch element of its own; the KV
// cache's cache_batch_idx and paged K/V in the modes forward, attn_fwd_kernel.cuh, a forward-only
// path); the op refuses the others with the mode's name, and auto falls back for them.
constexpr unsigned kCudaFeatures = kAttnMask | kMaskGrad | kDropout | kTopLeft | kWindow | kSoftcap | kAlibi |
                                   kVarlen | kCacheBatchIdx | kPaged;

// Tiles of each pass, per head dim: (packed query rows, keys) per CTA and step. The forward
// keeps 2 strips of 16 rows per warp x 4 warps; above D = 64 the keys per step halve so that
// accumulators and score tiles stay in registers (see FwdConfig / BwdConfig).
struct CudaTiles {
  int fwd_m, fwd_n;  // forward
  int dq_m, dq_n;    // backward, dQ kernel
  int dkv_n, dkv_m;  // backward, dK/dV kernel: keys per CTA, query rows per step
  // The forward with attn_mask / dropout (attn_fwd_modes_kernel): half the keys per step, so
  // that a strip's mask loads issue together without spilling (FwdConfig<D, true>).
  int fwd_modes_n;
};
constexpr CudaTiles cuda_tiles(int d) {
  return CudaTiles{128, d <= 64 ? 64 : 32, 64, d <= 64 ? 64 : 32, 64, d <= 64 ? 64 : 32, d <= 64 ? 32 : 16};
}

// ---- mma.sync backward: split kernels or the fused kernel (csrc/cuda/mma/attn_bwd_fused_kernel.cuh)
// The split backward (attn_bwd_kernel.cuh: a dK/dV kernel and a dQ kernel, 7 matrix products per
// tile, no atomics, bit-identical by construction) or the fused one (FlashAttention-2's design: a
// CTA per key block, 5 products per tile, dQ added in fp32 into a zeroed workspace by
// red.global.add.f32 and converted by a small kernel). The fused kernel's dQ adds are ordered by
// default (kBwdFusedOrdered: each row block's key blocks add in key order through a counter per
// row block, csrc/cuda/common/dq_accum.cuh: bit-identical across runs and schedules); kBwdFusedAtomic
// drops the order (faster, the last bits of dQ vary run to run).
enum CudaBwdKernel : int { kBwdSplit = 0, kBwdFusedOrdered = 1, kBwdFusedAtomic = 2 };
constexpr const char* kCudaBwdKernelNames[] = {"split", "fused", "fused_atomic"};
constexpr int kCudaNumBwdKernels = 3;
// Per kernel (in CudaBwdKernel order): the matrix products per tile, and whether two runs give
// bit-identical gradients.
constexpr int kCudaBwdKernelProducts[] = {7, 5, 5};
constexpr bool kCudaBwdKernelDeterministic[] = {true, true, false};
// Which one runs by default where both exist. The split kernels: the fused kernel has run only in
// the CPU emulator (tests/test_cuda_host.py, test_cuda_emulator.py), never on a GPU; a fragment
// layout the emulator reads wrongly would be a silent wrong gradient. MHAKERN_CUDA_MMA_BWD (or
// torch.ops.mhakern_C.cuda_force_mma_bwd_kernel) = "fused" / "fused_atomic" opts in.
constexpr CudaBwdKernel kCudaMmaBwdDefault = kBwdSplit;
// Head dims that have only the fused backward (no forward on this family, no split backward:
// the split dK/dV kernel keeps 16 keys x D of dK and dV per warp, 256 registers at D 256). The
// sm_90a forward serves D 256 on 9.0 devices; this backward is compiled for every arch.
#define MHK_CUDA_BWD_ONLY_HEAD_DIM(F, tag) F(tag, 256)
#define MHK_CUDA_BWD_ONLY_INSTANCE(F) MHK_CUDA_FOR_EACH_ELEM(MHK_CUDA_BWD_ONLY_HEAD_DIM_, F)
#define MHK_CUDA_BWD_ONLY_HEAD_DIM_(F, tag) MHK_CUDA_BWD_ONLY_HEAD_DIM(F, tag)
#define MHK_CUDA_BWD_ONLY_ITEM_(tag, D) D,
constexpr int kCudaBwdOnlyHeadDims[] = {MHK_CUDA_BWD_ONLY_HEAD_DIM(MHK_CUDA_BWD_ONLY_ITEM_, _)};
#undef MHK_CUDA_BWD_ONLY_ITEM_
constexpr int kCudaNumBwdOnlyHeadDims = sizeof(kCudaBwdOnlyHeadDims) / sizeof(kCudaBwdOnlyHeadDims[0]);
constexpr bool cuda_bwd_only_head_dim(int64_t d) {
  for (int i = 0; i < kCudaNumBwdOnlyHeadDims; ++i)
    if (kCudaBwdOnlyHeadDims[i] == d) return true;
  return false;
}
// Whether the mma.sync family has a backward for head dim d.
constexpr bool cuda_bwd_head_dim_supported(int64_t d) { return cuda_head_dim_supported(d) || cuda_bwd_only_head_dim(d); }
// The backward that runs for head dim d: `requested` (a CudaBwdKernel, or -1 for the default)
// where both exist; the fused kernel (ordered unless fused_atomic is requested) where only it does.
// Packed sequences (`packed`) run the split kernels whatever is requested: the fused kernel has
// no packed path (its modes instantiations sit at 246-255 registers at D 32-128 on sm_80 and
// sm_90, and a packed path's per-sequence lengths and token offsets put them in local memory,
// 64-156 B at D 96 with 4-12 LDL/STL in the main loop); cuda_host.cpp refuses a packed
// backward of a head dim with only the fused kernel.
constexpr CudaBwdKernel cuda_bwd_kernel(int64_t d, int requested, bool packed = false) {
  if (packed && !cuda_bwd_only_head_dim(d)) return kBwdSplit;
  const CudaBwdKernel want = requested >= 0 ? static_cast<CudaBwdKernel>(requested) : kCudaMmaBwdDefault;
  if (cuda_bwd_only_head_dim(d)) return want == kBwdFusedAtomic ? kBwdFusedAtomic : kBwdFusedOrdered;
  return want;
}
// Tiles of the fused kernel (FusedBwdConfig): keys per CTA (16 per strip of warps), packed query
// rows per step, warps per 16-key strip (each owning a slice of D). 4 warps. Up to D 128 each
// warp owns a 16-key strip and all of D; the rows per step are what fits 255 registers without
// local memory (tools/check_cuda_build.py gates it): 64 up to D 32, 32 at D 64 and 96, 16 at
// D 128 (dK and dV alone hold 128 fp32 registers there; with 32 rows, S^T and dP^T another 32,
// and the kernels spilled 8-56 bytes; at D 64, 64 rows spilled in the modes kernels). At D 256
// two warps share a strip, each half of D (dK, dV: 128 registers), 32 keys and 16 rows per
// step, so that K, V and two stages of Q, dO (pitch 264) stay within 99 KB: 77 KB.
struct CudaFusedBwdTiles {
  int n, m, d_split;
};
constexpr int kCudaFusedBwdWarps = 4;
constexpr CudaFusedBwdTiles cuda_fused_bwd_tiles(int d) {
  return d <= 128 ? CudaFusedBwdTiles{64, d <= 32 ? 64 : (d <= 96 ? 32 : 16), 1} : CudaFusedBwdTiles{32, 16, 2};
}
// The fused kernel's workspace: dq_accum (B * H * Lq * D fp32) and one 32-bit counter per
// (batch, KV head, row block of the group's packed rows), then the counter the ordered kernel's
// CTAs take their work items from (csrc/cuda/common/dq_accum.cuh, forward progress), all zeroed before
// the launch.
constexpr int64_t cuda_fused_bwd_counters(int64_t batch, int64_t kv_heads, int64_t group_rows, int d) {
  return batch * kv_heads * ((group_rows + cuda_fused_bwd_tiles(d).m - 1) / cuda_fused_bwd_tiles(d).m) + 1;
}

// The decode configuration of the mma.sync forward (attn_fwd_decode_kernel, FwdDecodeConfig in
// csrc/cuda/mma/attn_fwd_kernel.cuh). A decode call packs only group * Lq rows per (batch, KV head)
// (GQA 32 / 8 at Lq = 1: 4 rows), so the 128-row tile of cuda_tiles() spends 2 x 128 x D x N
// tensor-core work per N keys on 4 useful rows: measured on an H200 at 41% of the copy
// bandwidth, compute-bound by the padding. This kernel takes one m16 row block per CTA and
// gives each of its 4 warps a quarter of the key tile instead of a quarter of the rows (each
// warp runs its own online softmax; the warps' (max, sum, output) merge in shared memory at the
// end, in warp order: deterministic), with `stages` K/V tiles of 16-byte cp.async in flight:
// 8x less mma work per K/V byte than the 128-row tile.
// Served: forward calls without attn_mask, dropout, softcap and ALiBi (key_lengths, causal, window, top-left
// are in the kernel's Visibility masking) whose group * Lq <= kCudaDecodeMaxRows. Up to 32
// rows the CTAs of the 2 row blocks of a (batch, KV head, split) run next to each other and
// read the same K/V tiles, the second from L2 (2x the L2 traffic of one read, still 4x less
// mma work per HBM byte than the 128-row tile); at 64 rows the 4 L2 reads per HBM byte would
// compete with the 128-row tile, which then wastes only half its rows.
// Tiles per head dim: (rows, keys per tile = 4 warps x 16 or 32 keys, stages). Shared memory
// (pitch D + 8) stays within 82 KB, so that the smallest sm_80+ part (99 KB per block) runs it:
// D 32: 128 keys x 4 stages (81.4 KB); D 64: 64 x 4 (74.4 KB); D 96: 64 x 3 (81.4 KB); D 128:
// 64 x 2 (72.4 KB; a third stage, 106 KB, passes 99 KB). Bytes in flight per CTA while it
// works on one tile ((stages - 1) tiles): 60 / 54 / 52 / 34 KB. The split planner gives about
// two CTAs per SM (plan_splits), so 68-120 KB per SM are in flight: what ~4.8 TB/s of HBM
// needs over 132 SMs at 2 us of loaded latency (~70 KB per SM) and more. A 9.0 device would
// hold 3 CTAs of D 64 / 128 (smem 3 x 75 KB, registers <= 160 per thread).
struct CudaDecodeTiles {
  int m, n, stages;  // packed query rows per CTA, keys per tile (all warps), tiles in flight + 1
};
constexpr int kCudaDecodeWarps = 4;
constexpr int64_t kCudaDecodeMaxRows = 32;
constexpr CudaDecodeTiles cuda_decode_tiles(int d) {
  return CudaDecodeTiles{16, d <= 32 ? 128 : 64, d <= 64 ? 4 : (d <= 96 ? 3 : 2)};
}
// Whether a mma.sync forward call runs the decode kernel: group_rows = H / Hkv * Lq;
// modes_kernel: the call needs the modes kernel (attn_mask, dropout, softcap or ALiBi:
// csrc/cuda/common/attn_params.h needs_modes_kernel), which serves those.
constexpr bool use_cuda_decode_fwd(int64_t group_rows, bool modes_kernel) {
  return !modes_kernel && group_rows <= kCudaDecodeMaxRows;
}

// ---- cuda sm90 family (csrc/cuda/sm90/): Hopper, wgmma + TMA + mbarrier pipeline ----------
// A second family of CUDA kernels, compiled only in the sm_90a pass of nvcc
// (-gencode=arch=compute_90a,code=sm_90a: wgmma and setmaxnreg exist only on the "a" target,
// whose code runs on compute capability 9.0 exactly). A forward (split-K included, merged by the
// combine kernel both families share) and a backward (the sections further down); the host
// (choose_fwd_family in csrc/cuda/common/attn_dispatch.h, the backward's family choice in cuda_host.cpp)
// gives it the calls it serves on a 9.0 device (these head dims and dtypes, the modes its
// sections declare) and everything else to the mma.sync family above, built for sm_90a too. Instances: F(tag, D).
#define MHK_SM90_FOR_EACH_HEAD_DIM(F, tag) F(tag, 64) F(tag, 128) F(tag, 256)
#define MHK_SM90_FOR_EACH_INSTANCE(F) MHK_CUDA_FOR_EACH_ELEM(MHK_SM90_FOR_EACH_HEAD_DIM_, F)
#define MHK_SM90_FOR_EACH_HEAD_DIM_(F, tag) MHK_SM90_FOR_EACH_HEAD_DIM(F, tag)
constexpr int kSm90CapabilityMajor = 9, kSm90CapabilityMinor = 0;
// The passes it has kernels for.
constexpr const char* kSm90PassNames[] = {"fwd", "bwd"};
constexpr int kSm90NumPasses = 2;
// Modes (Feature bits) the sm90 forward and backward serve beyond key_lengths and bottom-right
// causal (choose_fwd_family / choose_bwd_family in csrc/cuda/common/attn_dispatch.h give every call
// with another mode, softcap and ALiBi included, to the mma.sync family, which serves
// kCudaFeatures): the forward, packed sequences (attn_fwd_sm90_varlen_kernel, bottom-right causal
// per sequence; with top_left they go to mma.sync); the backward, none.
constexpr unsigned kSm90FwdFeatures = kVarlen, kSm90BwdFeatures = 0;
// Forward tiles: packed query rows per CTA (2 consumer warpgroups x 64), keys per pipeline
// stage, stages of the K ring and of the V ring (separate pipelines: K's stage is released when
// S has landed, V's when P V has; csrc/cuda/sm90/attn_fwd_sm90_kernel.cuh: FwdConfigSm90, which
// argues them). kSm90FwdBlockN / kSm90FwdStages (K) / kSm90FwdStagesV are those of D 64 and 128
// (3 + 3 stages: 112 and 224 KB); D 256 keeps 128 rows with 80 keys per stage and 2 + 2 stages
// (Q 64 KB + 2 x (K + V) 160 KB = 224 KB of the 227 KB).
constexpr int kSm90FwdBlockM = 128, kSm90FwdBlockN = 128, kSm90FwdStages = 3, kSm90FwdStagesV = 3;
constexpr int kSm90FwdBlockND256 = 80, kSm90FwdStagesD256 = 2, kSm90FwdStagesVD256 = 2;
struct Sm90FwdTiles {
  int m, n, stages;  // packed query rows per CTA, keys per stage, stages of the K ring
  int v_stages;      // stages of the V ring
};
constexpr Sm90FwdTiles sm90_fwd_tiles(int d) {
  return d <= 128 ? Sm90FwdTiles{kSm90FwdBlockM, kSm90FwdBlockN, kSm90FwdStages, kSm90FwdStagesV}
                  : Sm90FwdTiles{kSm90FwdBlockM, kSm90FwdBlockND256, kSm90FwdStagesD256, kSm90FwdStagesVD256};
}
// The forward tiles split-K planning (plan_splits below) divides: (packed query rows per CTA,
// keys per step) of the family that runs the call, sm90 or mma.sync (cuda_tiles). A sm90 stage
// holds 2 to 4 times the keys of a mma.sync step: planned with the mma.sync tiles, a sm90 split
// got that much fewer key tiles than kMinBlocksPerSplit asks, and the kernel's ceil-divided
// shares left trailing splits empty (their CTAs launched for nothing).
// ctas_per_sm: how many CTAs of the family's kernel one SM holds, when the planner is to fill
// whole waves of them (plan_splits_by_waves); 0 keeps plan_splits' rule of about two CTAs per SM.
//   sm90 forward: 1 on every 9.0 device (its register plan, 128 x 24 + 256 x 240, takes the whole
//     register file; its shared memory too at D >= 128). Planned for 2 (plan_splits), a decode
//     call of 32 row tiles got 9 splits = 288 CTAs = 2.18 waves run as 3 (73%); measured on an
//     H200 at 48% of the copy bandwidth.
//   mma.sync (the main and the decode kernel): plan_splits' rule, unchanged (its decode kernel
//     holds 3 CTAs per SM on a 9.0 device, 2 on sm_80, 1 on sm_86/89 with 99 KB: a constexpr
//     table cannot tell them apart, and about two per SM keeps a latency-bound kernel fed).
constexpr int kSm90FwdCtasPerSm = 1;
// Whether the sm90 forward runs a persistent grid: kSm90FwdCtasPerSm CTAs per SM, each looping
// over work items (row tile, KV head, batch, split) heaviest first, its K/V rings running on from
// item to item and the producer's idle warps loading the next item's Q under the current one's
// last P V and epilogue (docs/performance.md, prediction 6); false: one CTA per item, the same
// kernel (its item loop runs once).
constexpr bool kSm90FwdPersistent = true;
struct FwdPlanTiles {
  int m, n;
  int ctas_per_sm = 0;
};
constexpr FwdPlanTiles fwd_plan_tiles(bool sm90_family, int d) {
  return sm90_family ? FwdPlanTiles{sm90_fwd_tiles(d).m, sm90_fwd_tiles(d).n, kSm90FwdCtasPerSm}
                     : FwdPlanTiles{cuda_tiles(d).fwd_m, cuda_tiles(d).fwd_n, 0};
}
// The tiles of one forward call: those of the family, and for a mma.sync call the decode
// kernel serves (use_cuda_decode_fwd) the decode tiles (the host plans its splits with these).
constexpr FwdPlanTiles fwd_plan_tiles(bool sm90_family, int d, int64_t group_rows, bool modes_kernel) {
  return !sm90_family && use_cuda_decode_fwd(group_rows, modes_kernel)
             ? FwdPlanTiles{cuda_decode_tiles(d).m, cuda_decode_tiles(d).n, 0}
             : fwd_plan_tiles(sm90_family, d);
}
// Backward tiles (csrc/cuda/sm90/attn_bwd_sm90_kernel.cuh: BwdConfigSm90), plain calls only
// (no mode; choose_bwd_family in csrc/cuda/common/attn_dispatch.h): the dK/dV kernel's keys per CTA
// (2 consumer warpgroups x 64) and packed query rows per pipeline stage; the dQ kernel's packed
// query rows per CTA (2 x 64) and keys per stage (sm90_bwd_dq_n: 64 at D 128, where the dQ
// accumulator, S and dP share a consumer's registers); stages of both rings: 3 (unmeasured
// estimate: a 32 KB stage at D 128 takes about as long to arrive at one SM's share of the
// bandwidth as its products take there; one CTA per SM, the register plan, leaves the shared
// memory for a third stage: at most 167 KB at D 128).
constexpr int kSm90BwdDkvBlockN = 128, kSm90BwdDkvBlockM = 64, kSm90BwdDqBlockM = 128, kSm90BwdStages = 3;
// Whether the host gives the sm90 backward the calls it serves by default. Not yet: unlike the
// sm90 forward (confirmed on an H200, tests/test_cuda_sm90_gpu.py), these kernels have run only
// in the CPU emulator, and a layout the emulator reads wrongly would be a silent wrong gradient.
// Until a 9.0 GPU passes the backward section of that file, MHAKERN_CUDA_BWD_FAMILY=auto (or
// torch.ops.mhakern_C.cuda_force_bwd_family("auto")) opts in; unset, the backward is mma.sync.
constexpr bool kSm90BwdByDefault = false;
constexpr int sm90_bwd_dq_n(int d) { return d <= 64 ? 128 : 64; }
// Backward instances (their own list: the forward's head dims may grow past the backward's).
#define MHK_SM90_BWD_FOR_EACH_HEAD_DIM(F, tag) F(tag, 64) F(tag, 128)
#define MHK_SM90_BWD_FOR_EACH_INSTANCE(F) MHK_CUDA_FOR_EACH_ELEM(MHK_SM90_BWD_FOR_EACH_HEAD_DIM_, F)
#define MHK_SM90_BWD_FOR_EACH_HEAD_DIM_(F, tag) MHK_SM90_BWD_FOR_EACH_HEAD_DIM(F, tag)
#define MHK_SM90_BWD_HEAD_DIM_ITEM_(tag, D) D,
constexpr int kSm90BwdHeadDims[] = {MHK_SM90_BWD_FOR_EACH_HEAD_DIM(MHK_SM90_BWD_HEAD_DIM_ITEM_, _)};
#undef MHK_SM90_BWD_HEAD_DIM_ITEM_
constexpr int kSm90BwdNumHeadDims = sizeof(kSm90BwdHeadDims) / sizeof(kSm90BwdHeadDims[0]);
constexpr bool sm90_bwd_head_dim_supported(int64_t d) {
  for (int i = 0; i < kSm90BwdNumHeadDims; ++i)
    if (kSm90BwdHeadDims[i] == d) return true;
  return false;
}
#define MHK_SM90_HEAD_DIM_ITEM_(tag, D) D,
constexpr int kSm90HeadDims[] = {MHK_SM90_FOR_EACH_HEAD_DIM(MHK_SM90_HEAD_DIM_ITEM_, _)};
#undef MHK_SM90_HEAD_DIM_ITEM_
constexpr int kSm90NumHeadDims = sizeof(kSm90HeadDims) / sizeof(kSm90HeadDims[0]);
constexpr bool sm90_head_dim_supported(int64_t d) {
  for (int i = 0; i < kSm90NumHeadDims; ++i)
    if (kSm90HeadDims[i] == d) return true;
  return false;
}

// ---- the fused sm90 backward (csrc/cuda/sm90/attn_bwd_fused_sm90_kernel.cuh) --------------
// One CTA per (batch, KV head, kSm90BwdFusedBlockN keys) computes dK, dV and dQ with 5 matrix
// products per tile (the split kernels above take 7); dQ is summed in fp32 by bulk reduce-adds
// into a zeroed workspace (sm90_bwd_fused_workspace_floats) and converted by a small kernel.
// Which backward the sm90 family runs for the calls it serves (choose_bwd_family, with the same
// opt-in: kSm90BwdByDefault / MHAKERN_CUDA_BWD_FAMILY): the split dK/dV + dQ kernels or the fused
// one, chosen at run time by MHAKERN_CUDA_SM90_BWD / torch.ops.mhakern_C.cuda_force_sm90_bwd_kernel
// (op_common.h sm90_bwd_kernel); kSm90BwdFused is the default ("default" or unset). Off: the
// fused kernel has run only in the CPU emulator.
enum Sm90BwdKernel : int { kSm90BwdKernelSplit = 0, kSm90BwdKernelFused = 1 };
constexpr const char* kSm90BwdKernelNames[] = {"split", "fused"};
constexpr int kSm90NumBwdKernels = 2;
constexpr bool kSm90BwdFused = false;
constexpr Sm90BwdKernel kSm90BwdKernelDefault = kSm90BwdFused ? kSm90BwdKernelFused : kSm90BwdKernelSplit;
// Deterministic: each row tile's fp32 dQ adds happen in increasing key-block order (a semaphore
// per row tile), so two runs, schedules or grid orders give bit-identical dQ. The other mode
// (adds in any order) exists for measurement; unmeasured, so not chosen.
constexpr bool kSm90BwdFusedDeterministic = true;
// Whether each sm90 backward (Sm90BwdKernel order) gives bit-identical dQ run to run: the split
// kernels add nothing atomically.
constexpr bool kSm90BwdKernelDeterministic[] = {true, kSm90BwdFusedDeterministic};
// Modes it serves beyond key_lengths and bottom-right causal: none yet (the mma.sync family
// serves the others, as for the split kernels).
constexpr unsigned kSm90BwdFusedFeatures = 0;
// Tiles: keys per CTA (2 consumer warpgroups x 64), packed query rows per stage (64: each
// consumer's dQ part is one 64 x 64 wgmma tile; 128 rows at D 64 spilled the consumers, whose
// S^T and dP^T would double), stages of the Q/dO ring (2: at D 128 K and V 64 KB, 2 stages
// 64 KB, dS^T 2 x 16 KB, the fp32 dQ tile 32 KB).
constexpr int kSm90BwdFusedBlockN = 128, kSm90BwdFusedBlockM = 64, kSm90BwdFusedStages = 2;
constexpr int sm90_bwd_fused_m(int) { return kSm90BwdFusedBlockM; }
// The workspace (fp32 elements, zero-filled by the caller): the dQ sums (B, Hkv, row tiles of
// sm90_bwd_fused_m rows, D), then one 32-bit semaphore per (B, Hkv, row tile), then the
// 32-bit counter the CTAs take their work items from (csrc/cuda/common/dq_accum.cuh, forward progress).
constexpr int64_t sm90_bwd_fused_row_tiles(int64_t group, int64_t q_len, int64_t head_dim) {
  return (group * q_len + sm90_bwd_fused_m(static_cast<int>(head_dim)) - 1) / sm90_bwd_fused_m(static_cast<int>(head_dim));
}
constexpr int64_t sm90_bwd_fused_workspace_floats(int64_t batch, int64_t kv_heads, int64_t group, int64_t q_len,
                                                  int64_t head_dim) {
  const int64_t tiles = batch * kv_heads * sm90_bwd_fused_row_tiles(group, q_len, head_dim);
  return tiles * sm90_bwd_fused_m(static_cast<int>(head_dim)) * head_dim + tiles + 1;
}

// Split-K planning (long keys with few query tiles: decode): at least kMinBlocksPerSplit key
// blocks per split, at most kMaxSplits splits, and the fp32 partial outputs under
// kMaxSplitWorkspaceBytes.
constexpr int64_t kMinBlocksPerSplit = 8;
constexpr int64_t kMaxSplits = 128;
constexpr int64_t kMaxSplitWorkspaceBytes = int64_t{1} << 30;

// The most splits the limits above allow a pass of `key_blocks` blocks of keys that writes `rows`
// output rows of `dv` fp32 values (at least kMinBlocksPerSplit key blocks per split, at most
// kMaxSplits, the partials within kMaxSplitWorkspaceBytes); may be below 1 (then: no split).
// split_rule and plan_splits_by_waves both clamp by it; the Triton launcher's planner
// (mhakern/kernels/heuristics.py split_rule) is its Python twin, reading these limits from
// mhakern/_caps.py (tests/test_split_plan.py checks the two agree).
constexpr int64_t split_limit(int64_t key_blocks, int64_t rows, int64_t dv) {
  const int64_t by_keys = key_blocks / kMinBlocksPerSplit;
  const int64_t row_bytes = rows * dv * 4;
  const int64_t by_memory = kMaxSplitWorkspaceBytes / (row_bytes > 0 ? row_bytes : 1);
  int64_t s = by_keys;
  if (by_memory < s) s = by_memory;
  if (kMaxSplits < s) s = kMaxSplits;
  return s;
}

// The split-K rule: a pass of `programs` CTAs (programs, for Triton), each stepping through
// `key_blocks` blocks of keys, that writes `rows` output rows of `dv` fp32 values. When the CTAs
// fill the GPU (at least num_sms) or there are none, 1; otherwise enough splits for about two
// CTAs per multiprocessor, within split_limit. The CUDA host's planners below call it; the
// bindings export it (torch.ops.mhakern_C.plan_key_splits) for the test that the Triton
// launcher's twin agrees.
constexpr int64_t split_rule(int64_t programs, int64_t key_blocks, int64_t rows, int64_t dv, int64_t num_sms) {
  if (programs <= 0 || num_sms <= 0 || programs >= num_sms) return 1;
  const int64_t by_occupancy = (2 * num_sms + programs - 1) / programs;
  const int64_t limit = split_limit(key_blocks, rows, dv);
  const int64_t s = limit < by_occupancy ? limit : by_occupancy;
  return s < 1 ? 1 : s;
}

// Number of key splits for a pass whose CTAs each take block_m packed query rows and step
// through the keys block_n at a time: one CTA per (batch, kv head, tile of block_m of the
// group's group * q_len rows), planned by split_rule.
constexpr int64_t plan_splits(int64_t batch, int64_t kv_heads, int64_t group, int64_t q_len, int64_t k_len,
                              int64_t head_dim, int64_t num_sms, int64_t block_m, int64_t block_n) {
  const int64_t ctas = batch * kv_heads * ((group * q_len + block_m - 1) / block_m);
  return split_rule(ctas, (k_len + block_n - 1) / block_n, batch * kv_heads * group * q_len, head_dim, num_sms);
}

// Number of key splits for a forward whose kernel holds ctas_per_sm CTAs per SM (FwdPlanTiles),
// by wave efficiency: with n = CTAs x splits / (num_sms x ctas_per_sm) waves, a launch runs
// ceil(n) waves, so its efficiency is n / ceil(n); the fewest splits whose efficiency is at least
// 85% of the best one within split_limit (key blocks per split, splits, the
// workspace) -- FlashAttention-3's split heuristic, on this family's real occupancy. Fewer
// splits is better at equal efficiency: each split adds a fixed cost per CTA and fp32 partials
// to combine. 32 row tiles on 132 SMs at 1 per SM: 4 splits (128 CTAs, 97%) instead of 9 (73%).
constexpr int64_t plan_splits_by_waves(int64_t batch, int64_t kv_heads, int64_t group, int64_t q_len, int64_t k_len,
                                       int64_t head_dim, int64_t num_sms, int64_t block_m, int64_t block_n,
                                       int64_t ctas_per_sm) {
  const int64_t ctas = batch * kv_heads * ((group * q_len + block_m - 1) / block_m);
  const int64_t slots = num_sms * ctas_per_sm;
  if (ctas == 0 || slots <= 0 || ctas >= slots) return 1;
  const int64_t s_max = split_limit((k_len + block_n - 1) / block_n, batch * kv_heads * group * q_len, head_dim);
  if (s_max <= 1) return 1;
  auto efficiency = [&](int64_t s) {
    const int64_t work = ctas * s;
    const int64_t waves = (work + slots - 1) / slots;
    return static_cast<double>(work) / static_cast<double>(waves * slots);
  };
  double best = 0.0;
  for (int64_t s = 1; s <= s_max; ++s)
    if (efficiency(s) > best) best = efficiency(s);
  for (int64_t s = 1; s <= s_max; ++s)
    if (efficiency(s) >= 0.85 * best) return s;
  return 1;
}

// The forward's split count with the tiles of the family that runs it (cuda_host.cpp, the
// bindings' cuda_plan_splits and the emulator entries all call this one).
constexpr int64_t plan_fwd_splits(int64_t batch, int64_t kv_heads, int64_t group, int64_t q_len, int64_t k_len,
                                  int64_t head_dim, int64_t num_sms, FwdPlanTiles t) {
  return t.ctas_per_sm > 0
             ? plan_splits_by_waves(batch, kv_heads, group, q_len, k_len, head_dim, num_sms, t.m, t.n, t.ctas_per_sm)
             : plan_splits(batch, kv_heads, group, q_len, k_len, head_dim, num_sms, t.m, t.n);
}

}  // namespace caps
}  // namespace mhakern
