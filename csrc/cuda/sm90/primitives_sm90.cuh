// The sm_90a primitives of the Hopper kernel family: warpgroup wgmma.mma_async (accumulators in
// registers, B and optionally A from shared-memory matrix descriptors with the 128-byte swizzle),
// mbarrier with transaction counts, cp.async.bulk.tensor from a tensor map (TMA),
// fence.proxy.async, setmaxnreg and named barriers. Written once: inline PTX when nvcc compiles for sm_90a
// (__CUDA_ARCH_FEAT_SM90_ALL), the CPU emulator's implementation (tests/cuda_emulator/cuda_emu_sm90.h)
// when a host compiler builds with MHAKERN_CUDA_EMULATE, as ../common/primitives.cuh does for the
// mma.sync family. Other nvcc passes (sm_80, sm_86, ...) compile the kernels' bodies away.
//
// Layouts (PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate"):
//   wgmma .m64nNk16, fp32 accumulator D, warpgroup thread T = 32 w + l, g = l / 4, t = l % 4:
//     d[i] is (row 16 w + g + 8 ((i % 4) / 2), col 8 (i / 4) + 2 t + i % 2), i < N / 2.
//   A in registers: 4 x 32-bit per thread, warp w the m16n8k16 A fragment of rows 16 w..16 w + 15
//     (a0 (g, 2t..2t+1), a1 (g + 8, 2t..), a2 (g, 2t + 8..), a3 (g + 8, 2t + 8..)); so the
//     accumulator of S = Q K^T, converted pairwise, is the A operand of O += P V.
//   Shared operands use the 128-byte swizzle (Swizzle<3,4,3> of the shared address): tiles of
//   64 elements (128 bytes) per row, 8 rows per 1024-byte atom, stored by TMA with
//   CU_TENSOR_MAP_SWIZZLE_128B in the same pattern (see make_desc_sw128).
#pragma once

#include <cstdint>

#include "../common/primitives.cuh"

#if defined(MHAKERN_CUDA_EMULATE)
#include "cuda_emu_sm90.h"  // tests/cuda_emulator/, as for ../common/primitives.cuh
#define MHK_GRID_CONSTANT
#else
#include <cuda.h>  // CUtensorMap, cuTensorMapEncodeTiled's types
#define MHK_GRID_CONSTANT __grid_constant__
#endif

// True in the nvcc pass that may emit wgmma / setmaxnreg (sm_90a) and in the emulator build.
#if defined(MHAKERN_CUDA_EMULATE) || (defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL))
#define MHK_SM90_ENABLED 1
#else
#define MHK_SM90_ENABLED 0
#endif

namespace mhakern {
namespace cuda {
namespace sm90 {

#if defined(MHAKERN_CUDA_EMULATE)
using TensorMap = ::mhk_emu::sm90::TensorMap;
#else
using TensorMap = CUtensorMap;
#endif

// Shared-memory matrix descriptor (PTX ISA "Matrix Descriptor Format") of a 128-byte swizzled
// operand: start address, leading and stride byte offsets (each >> 4), swizzle mode 1 (128B),
// base offset 0 (the kernels keep every atom 1024-byte aligned). K-major operands: SBO is the
// distance of 8-row groups (1024 bytes for a dense tile), LBO unused (1 by convention);
// MN-major: SBO the distance of 8-row groups of K, LBO that of 64-element groups of M/N.
MHK_DEVICE uint64_t desc_bits(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((saddr >> 4) & 0x3fff) | (static_cast<uint64_t>((lbo >> 4) & 0x3fff) << 16) |
         (static_cast<uint64_t>((sbo >> 4) & 0x3fff) << 32) | (uint64_t{1} << 62);
}

#if defined(MHAKERN_CUDA_EMULATE)

inline uint32_t shared_u32(const void* p) { return ::mhk_emu::sm90::shared_address(p); }
inline void mbar_init(uint64_t* bar, int count) { ::mhk_emu::sm90::mbar_init(bar, count); }
inline void fence_barrier_init() {}
inline void mbar_arrive(uint64_t* bar) { ::mhk_emu::sm90::mbar_arrive(bar); }
inline void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) { ::mhk_emu::sm90::mbar_arrive_expect_tx(bar, bytes); }
inline void mbar_wait(uint64_t* bar, uint32_t parity) { ::mhk_emu::sm90::mbar_wait_parity(bar, parity); }
// The same on a barrier's shared address (shared_u32), for loops that keep addresses as numbers.
inline void mbar_arrive(uint32_t bar) { ::mhk_emu::sm90::mbar_arrive(::mhk_emu::sm90::shared_pointer(bar)); }
inline void mbar_wait(uint32_t bar, uint32_t parity) {
  ::mhk_emu::sm90::mbar_wait_parity(::mhk_emu::sm90::shared_pointer(bar), parity);
}
inline void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  ::mhk_emu::sm90::mbar_arrive_expect_tx(::mhk_emu::sm90::shared_pointer(bar), bytes);
}
// Generic-proxy writes to shared memory made visible to the async proxy (wgmma, TMA). The
// emulator does not model proxies (it has one memory): a missing fence is not detected.
inline void fence_proxy_async() {}
inline void tma_load_4d(void* dst, const TensorMap* map, int c0, int c1, int c2, int c3, uint64_t* bar) {
  const int c[4] = {c0, c1, c2, c3};
  ::mhk_emu::sm90::tma_load(dst, map, c, bar);
}
inline void tma_load_4d(uint32_t dst, const TensorMap* map, int c0, int c1, int c2, int c3, uint32_t bar) {
  tma_load_4d(::mhk_emu::sm90::shared_pointer(dst), map, c0, c1, c2, c3,
              reinterpret_cast<uint64_t*>(::mhk_emu::sm90::shared_pointer(bar)));
}
inline void warp_sync_all() { ::mhk_emu::syncwarp(); }
inline int warpgroup_index() { return ::mhk_emu::thread_index() / 128; }
inline uint32_t warp_uniform(uint32_t x) { return x; }
// The nvcc build's scheduling pin (below); the emulator runs in program order already.
inline void pin_before_wait(float, int) {}
inline void named_bar_sync(int id, int count) { ::mhk_emu::sm90::named_barrier(id, count, true); }
inline void named_bar_arrive(int id, int count) { ::mhk_emu::sm90::named_barrier(id, count, false); }
inline void wgmma_fence() { ::mhk_emu::sm90::wgmma_fence(); }
inline void wgmma_commit() { ::mhk_emu::sm90::wgmma_commit(); }
template <int N>
inline void wgmma_wait() {
  ::mhk_emu::sm90::wgmma_wait(N);
}
template <int N>
inline void setmaxnreg_inc() {
  ::mhk_emu::sm90::setmaxnreg(N, true);
}
template <int N>
inline void setmaxnreg_dec() {
  ::mhk_emu::sm90::setmaxnreg(N, false);
}
// d (N / 2 floats) = A B (+ d): A, B K-major descriptors.
template <int N, typename Elem>
inline void wgmma_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  ::mhk_emu::sm90::wgmma(d, N, ElemTraits<Elem>::kIsBf16, nullptr, desc_a, desc_b, false, scale_d != 0);
}
// d (N / 2 floats) += A B: A in registers, B an N-major (transposed) descriptor.
template <int N, typename Elem>
inline void wgmma_rs_tb(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b) {
  ::mhk_emu::sm90::wgmma(d, N, ElemTraits<Elem>::kIsBf16, a, 0, desc_b, true, true);
}

#else  // nvcc

MHK_DEVICE uint32_t shared_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

#if MHK_SM90_ENABLED
MHK_DEVICE void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_u32(bar)), "r"(count) : "memory");
}
// Makes the initialised barriers visible to the async proxy (TMA completes on them).
MHK_DEVICE void fence_barrier_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
MHK_DEVICE void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
MHK_DEVICE void mbar_arrive(uint64_t* bar) { mbar_arrive(shared_u32(bar)); }
MHK_DEVICE void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
MHK_DEVICE void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) { mbar_arrive_expect_tx(shared_u32(bar), bytes); }
// On the barrier's shared address: a loop that keeps its barriers' addresses as numbers computes
// them once (from a pointer, ptxas rebuilt the 1024-byte aligned base every iteration).
MHK_DEVICE void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "mbar_wait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra mbar_wait_%=;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
MHK_DEVICE void mbar_wait(uint64_t* bar, uint32_t parity) { mbar_wait(shared_u32(bar), parity); }
MHK_DEVICE void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// dst and bar by shared address (the producer of a 24-register warpgroup keeps numbers, not
// 64-bit pointers) or by pointer.
MHK_DEVICE void tma_load_4d(uint32_t dst, const TensorMap* map, int c0, int c1, int c2, int c3, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}
MHK_DEVICE void tma_load_4d(void* dst, const TensorMap* map, int c0, int c1, int c2, int c3, uint64_t* bar) {
  tma_load_4d(shared_u32(dst), map, c0, c1, c2, c3, shared_u32(bar));
}
// A shared store that never executes (num_splits >= 1 always) but that ptxas cannot prove dead:
// placed right before a wgmma wait, it keeps the code that computes `x` above that wait, since
// ptxas orders shared stores before a wgmma wait and must compute the store's operand first.
MHK_DEVICE void pin_before_wait(float x, int num_splits) {
  if (num_splits < 0) asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(0), "f"(x) : "memory");
}
// __syncwarp over the whole warp (memory ordering among its lanes included).
MHK_DEVICE void warp_sync_all() { __syncwarp(); }
// threadIdx.x / 128 through a shuffle from lane 0: the same number, but one ptxas knows to be
// warp-uniform, so what derives from it (the consumer's Q descriptors) lives in uniform
// registers; from threadIdx.x directly, each HGMMA's descriptor was rebuilt in per-thread
// registers and moved over by R2UR (~6 instructions per HGMMA of S = Q K^T).
MHK_DEVICE int warpgroup_index() { return __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0); }
// x, the same in every lane (the caller's promise), as lane 0's copy: ptxas keeps it in a
// uniform register and, unable to recompute a shuffle, computes it once. The consumers' shared
// addresses come from it: derived from the aligned base of shared memory (S2UR of the CTA's
// window, then the rounding), ptxas rebuilt them in every iteration (~20 instructions a tile).
MHK_DEVICE uint32_t warp_uniform(uint32_t x) { return __shfl_sync(0xffffffffu, x, 0); }
// Named barriers (ids 1..15; 0 is __syncthreads): `count` threads, whole warps.
MHK_DEVICE void named_bar_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
MHK_DEVICE void named_bar_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
MHK_DEVICE void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
MHK_DEVICE void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
MHK_DEVICE void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
template <int N>
MHK_DEVICE void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
MHK_DEVICE void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

// The wgmma forms the kernels use (tools/generate_kernels.py: one asm per shape, dtype and A source).
#include "wgmma_asm.inc"

template <int N, typename Elem>
MHK_DEVICE void wgmma_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  static_assert(N == 64 || N == 80 || N == 128, "wgmma_ss: N 64, 80 or 128 (tools/generate_kernels.py: WGMMA_FORMS)");
  if constexpr (N == 64 && ElemTraits<Elem>::kIsBf16) MHK_WGMMA_SS_N64_BF16;
  if constexpr (N == 64 && !ElemTraits<Elem>::kIsBf16) MHK_WGMMA_SS_N64_F16;
  if constexpr (N == 80 && ElemTraits<Elem>::kIsBf16) MHK_WGMMA_SS_N80_BF16;
  if constexpr (N == 80 && !ElemTraits<Elem>::kIsBf16) MHK_WGMMA_SS_N80_F16;
  if constexpr (N == 128 && ElemTraits<Elem>::kIsBf16) MHK_WGMMA_SS_N128_BF16;
  if constexpr (N == 128 && !ElemTraits<Elem>::kIsBf16) MHK_WGMMA_SS_N128_F16;
}
template <int N, typename Elem>
MHK_DEVICE void wgmma_rs_tb(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b) {
  static_assert(N == 64 || N == 128 || N == 256, "wgmma_rs_tb: N 64, 128 or 256 (tools/generate_kernels.py: WGMMA_FORMS)");
  const int scale_d = 1;
  if constexpr (N == 64 && ElemTraits<Elem>::kIsBf16) MHK_WGMMA_RS_N64_BF16;
  if constexpr (N == 64 && !ElemTraits<Elem>::kIsBf16) MHK_WGMMA_RS_N64_F16;
  if constexpr (N == 128 && ElemTraits<Elem>::kIsBf16) MHK_WGMMA_RS_N128_BF16;
  if constexpr (N == 128 && !ElemTraits<Elem>::kIsBf16) MHK_WGMMA_RS_N128_F16;
  if constexpr (N == 256 && ElemTraits<Elem>::kIsBf16) MHK_WGMMA_RS_N256_BF16;
  if constexpr (N == 256 && !ElemTraits<Elem>::kIsBf16) MHK_WGMMA_RS_N256_F16;
}
#endif  // MHK_SM90_ENABLED

#endif

// The work of one CTA of a forward-shaped grid (the forward, the backward's dQ pass): its key
// split, tile of BM packed query rows (r = (h - hkv * group) * Lq + i), KV head and batch element
// (fastest first), and the key tiles of BN keys it takes, [t0, t0 + n_tiles) of the tiles
// [0, n_all) that reach the largest visible limit of its rows (possibly none: a split's partial
// is then 0 with lse -inf, which the combine weighs away). Tiles that end at or before lim_min,
// the smallest limit of its rows, need no mask.
struct RowTileWork {
  int split, hkv, b, group_rows, r0, Lk_b, lim_min, t0, n_tiles;
};
// bid < 2^31 (a grid's x extent, or a work item of one): 32-bit divisions, a few instructions
// each where 64-bit ones call a subroutine (the sm90 forward's producer, at 24 registers, spilled
// around them).
template <int BM, int BN, typename Params>
MHK_DEVICE RowTileWork row_tile_work(const Params& p, int64_t block) {
  RowTileWork w;
  w.group_rows = p.group * p.Lq;
  const int n_mtiles = ceil_div(w.group_rows, BM);
  int bid = static_cast<int>(block);
  w.split = bid % p.num_splits;
  bid /= p.num_splits;
  const int mt = bid % n_mtiles;
  bid /= n_mtiles;
  w.hkv = bid % p.Hkv;
  w.b = bid / p.Hkv;
  w.r0 = mt * BM;
  w.Lk_b = key_length_of(p, w.b);
  int i_lo, i_hi;
  tile_query_range(w.r0, imin(BM, w.group_rows - w.r0), p.Lq, i_lo, i_hi);
  const int lim_max = visible_limit(i_hi, w.Lk_b, p.Lq, p.causal);
  w.lim_min = visible_limit(i_lo, w.Lk_b, p.Lq, p.causal);
  const int n_all = lim_max > 0 ? ceil_div(lim_max, BN) : 0;
  const int per_split = ceil_div(n_all, p.num_splits);
  w.t0 = imin(n_all, w.split * per_split);
  w.n_tiles = imin(n_all, w.t0 + per_split) - w.t0;
  return w;
}

}  // namespace sm90
}  // namespace cuda
}  // namespace mhakern
