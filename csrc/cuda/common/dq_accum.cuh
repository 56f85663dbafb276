// dQ of a fused backward, accumulated across CTAs in a global fp32 workspace (both CUDA
// families: the mma.sync fused kernel, attn_bwd_fused_kernel.cuh, and the sm_90a one).
//
// A fused backward runs one CTA per key block; each adds its share dS K of every row block's dQ
// into dq_accum (fp32, zeroed before the launch) with `red.global.add.f32`, and a small kernel
// converts the sums. fp32 addition is not associative, so the result depends on the order in
// which the key blocks' adds reach an element. Deterministic mode fixes that order: a counter
// per row block (zeroed with the workspace) holds how many of the row block's key blocks have
// added so far, and the key block that comes `turn`-th in a fixed order waits until the counter
// reads `turn` (ld.acquire), adds, and advances it (red.release) for the next. The order is a
// function of the problem only (not of the schedule or the split of the grid), so every run
// gives the same bits.
//
// Forward progress: the CUDA programming model promises no order in which a grid's CTAs start,
// and with more CTAs than fit at once (2,048 on 132 SMs) the resident ones could all be waiting
// on turns of CTAs that cannot start until one of them ends. So the callers choose a CTA's work
// item (its key block) by a ticket taken at its start (take_ticket: an atomic counter zeroed
// with the workspace), not by its block index, and number the work items so that earlier turns
// have lower tickets: every CTA with a lower ticket has started (it is resident or done) and
// waits only on lower tickets still, so by induction from ticket 0, which waits on nothing,
// every wait ends, in any dispatch order and at any residency. (The CPU emulator's
// out-of-order dispatch shows the block-index version deadlock: tests/cuda_emulator/cuda_emu.h Dispatch.)
//
// Memory order (PTX ISA, memory consistency model): every thread's adds precede the block
// barrier in dq_pass_turn, which synchronizes them with thread 0, whose release is cumulative
// over them; the next CTA's thread 0 acquires the counter and its block barrier orders the
// acquire before every thread's adds. The CPU emulator (tests/cuda_emulator/cuda_emu.h, global-memory
// section) models exactly these rules and in-flight adds under random schedules.
#pragma once

#include <cstdint>

#include "primitives.cuh"

namespace mhakern {
namespace cuda {

#if !defined(MHAKERN_CUDA_EMULATE)

// *p += v, relaxed, no result (the compiler would emit RED for an unused atomicAdd too; the asm
// makes it explicit for the SASS check).
MHK_DEVICE void red_add_f32(float* p, float v) {
  asm volatile("red.relaxed.gpu.global.add.f32 [%0], %1;\n" ::"l"(p), "f"(v) : "memory");
}
MHK_DEVICE uint32_t ld_acquire_gpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
MHK_DEVICE void red_release_add_gpu(uint32_t* p, uint32_t v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
MHK_DEVICE void spin_pause() { __nanosleep(64); }
// The next ticket of a zeroed counter (atom.add, relaxed: it orders nothing, only numbers the
// CTAs in the order they reach it).
MHK_DEVICE uint32_t take_ticket(uint32_t* counter) {
  uint32_t v;
  asm volatile("atom.relaxed.gpu.global.add.u32 %0, [%1], 1;\n" : "=r"(v) : "l"(counter) : "memory");
  return v;
}

#else  // MHAKERN_CUDA_EMULATE

inline void red_add_f32(float* p, float v) { ::mhk_emu::red_add_f32(p, v); }
inline uint32_t ld_acquire_gpu(const uint32_t* p) { return ::mhk_emu::ld_acquire_u32(p); }
inline void red_release_add_gpu(uint32_t* p, uint32_t v) { ::mhk_emu::red_add_u32(p, v, true); }
inline void spin_pause() { ::mhk_emu::spin_pause(); }
inline uint32_t take_ticket(uint32_t* counter) { return ::mhk_emu::atom_add_u32(counter, 1u); }

#endif

// CTA-wide (every thread calls it): returns once the row block's counter reads `turn`.
MHK_DEVICE void dq_wait_turn(const uint32_t* counter, uint32_t turn) {
  if (thread_index() == 0) {
    while (ld_acquire_gpu(counter) != turn) spin_pause();
  }
  block_sync();
}

// CTA-wide, after every thread has issued its adds for the row block: the next turn may start.
MHK_DEVICE void dq_pass_turn(uint32_t* counter) {
  block_sync();
  if (thread_index() == 0) red_release_add_gpu(counter, 1u);
}

}  // namespace cuda
}  // namespace mhakern
