// Toy kernels with known defects, for the emulator's own tests (tests/test_cuda_emulator.py):
// each defect is one the emulator claims to catch (divergent collectives, partial member masks,
// divergent barriers, shared-memory races that only some interleavings expose, reads outside
// the tensors), next to a correct twin that must pass. They call the emulator directly, as the
// kernels do through primitives.cuh.
//
// The two sides of a divergent branch call the collective from separate non-inlined functions so
// that the compiler cannot merge them into one call: on a GPU they would be two instructions.
#include <cstdint>
#include <cstring>

#include "common/dq_accum.cuh"
#include "cuda_emu.h"

namespace mhk_selftest {

using namespace mhk_emu;

uint32_t pack_ones() {
  const __half one = __float2half(1.f);
  uint16_t bits;
  std::memcpy(&bits, &one, 2);
  return static_cast<uint32_t>(bits) | (static_cast<uint32_t>(bits) << 16);
}

void mma_ones(float (&d)[4]) {
  const uint32_t one = pack_ones();
  const uint32_t a[4] = {one, one, one, one};
  mma_m16n8k16(d, a, one, one, false);
}

__attribute__((noinline)) void lower_half_mma(float (&d)[4]) { mma_ones(d); }
__attribute__((noinline)) void upper_half_mma(float (&d)[4]) { mma_ones(d); }
__attribute__((noinline)) uint32_t lower_half_ballot(bool p) { return ballot_sync(kFullMask, p); }
__attribute__((noinline)) uint32_t upper_half_ballot(bool p) { return ballot_sync(kFullMask, p); }
__attribute__((noinline)) void first_warps_barrier() { syncthreads(); }
__attribute__((noinline)) void last_warps_barrier() { syncthreads(); }

// One block of 128 threads; out[tid] receives the thread's result.
void collectives_body(int variant, float* out) {
  const int tid = thread_index(), lane = tid % 32;
  float d[4] = {0.f, 0.f, 0.f, 0.f};
  float r = 0.f;
  switch (variant) {
    case 0:  // convergent: every collective from one point, full masks
      mma_ones(d);
      r = d[0] + shfl_xor_sync(kFullMask, d[1], 1) + static_cast<float>(__builtin_popcount(ballot_sync(kFullMask, lane < 5)));
      syncwarp(kFullMask);
      syncthreads();
      break;
    case 1:  // the same mma, reached from two program points
      if (lane < 16)
        lower_half_mma(d);
      else
        upper_half_mma(d);
      r = d[0];
      break;
    case 2:  // a shuffle naming half the warp
      r = shfl_xor_sync(0x0000ffffu, 1.f, 1);
      break;
    case 3:  // a vote from two program points
      r = static_cast<float>(lane < 16 ? lower_half_ballot(true) : upper_half_ballot(true));
      break;
    case 4:  // __syncthreads from two program points
      if (tid < 64)
        first_warps_barrier();
      else
        last_warps_barrier();
      break;
    case 5:  // __syncwarp with a partial mask
      syncwarp(0xfffffffeu);
      break;
    case 6:  // half the warp leaves before a collective the other half waits at
      if (lane >= 16) return;
      r = shfl_xor_sync(kFullMask, 1.f, 1);
      break;
  }
  out[tid] = r;
}

// Races on shared memory (one block of 128 threads, out[tid] = the value the thread read):
//  variant 0/1: each thread reads the value its predecessor stored; 1 has the barrier between,
//    0 does not (in thread order the predecessor always runs first, so only a reordering
//    schedule sees the stale value).
//  variant 2/3: a double-buffered pipeline over `steps` tiles of src (128 x 8 halves each, one
//    16-byte chunk per thread, thread t reads chunk t ^ 32 of the other warp); 3 has the barrier
//    that keeps the prefetch of tile j + 2 from overwriting stage j & 1 before every warp has read
//    it, 2 does not. out[tid] = sum over tiles of the chunk's first element.
void race_body(int variant, const __half* src, int steps, float* out) {
  const int tid = thread_index();
  unsigned char* smem = dynamic_smem();
  if (variant <= 1) {
    float* buf = reinterpret_cast<float*>(smem);
    buf[tid] = static_cast<float>(tid + 1);
    if (variant == 1) syncthreads();
    out[tid] = buf[tid == 0 ? 0 : tid - 1];
    return;
  }
  __half* tiles = reinterpret_cast<__half*>(smem);  // stage s: 128 chunks of 8 halves at s * 1024
  float sum = 0.f;
  cp_async_16(tiles + tid * 8, src + tid * 8, true);
  cp_async_commit();
  for (int j = 0; j < steps; ++j) {
    const int stage = j & 1;
    if (j + 1 < steps) cp_async_16(tiles + (stage ^ 1) * 1024 + tid * 8, src + (j + 1) * 1024 + tid * 8, true);
    cp_async_commit();
    cp_async_wait(1);
    syncthreads();
    sum += __half2float(tiles[stage * 1024 + (tid ^ 32) * 8]);
    if (variant == 3) syncthreads();  // the barrier variant 2 forgets
  }
  cp_async_wait(0);
  out[tid] = sum;
}

// Copies n 16-byte chunks from src to dst through shared memory (one thread per chunk).
void copy_body(const unsigned char* src, int n, unsigned char* dst) {
  const int tid = thread_index();
  unsigned char* smem = dynamic_smem();
  if (tid < n) cp_async_16(smem + 16 * tid, src + 16 * tid, true);
  cp_async_commit();
  cp_async_wait(0);
  syncthreads();
  if (tid < n) std::memcpy(dst + 16 * tid, smem + 16 * tid, 16);
}

// Ordered accumulation across blocks (csrc/cuda/common/dq_accum.cuh): block b of the grid adds
// vals[b * n + t] to acc[t] (thread t < n) as the b-th turn of counter *sem, like a key block of
// the fused backward adding its share of a row block's dQ. variant:
//   0 correct: dq_wait_turn(b), the adds, dq_pass_turn;
//   1 no order (the non-deterministic mode): the adds only;
//   2 ordering bug: waits until the counter reaches b - 1 instead of b (a turn early);
//   3 early release: passes its turn before issuing its adds;
//   4 release without the barrier: thread 0 passes the turn right after its own add, while the
//     block's other threads may not have issued theirs;
//   5 relaxed flag: the counter advanced by a relaxed add (no release);
//   6 a turn that never comes (b + 1): the emulator must report a deadlock.
void ordered_add_body(int variant, int n, const float* vals, float* acc, uint32_t* sem) {
  namespace k = mhakern::cuda;
  const int tid = thread_index();
  const uint32_t b = static_cast<uint32_t>(block_index());
  auto adds = [&] {
    if (tid < n) k::red_add_f32(acc + tid, vals[b * n + tid]);
  };
  switch (variant) {
    case 0:
      k::dq_wait_turn(sem, b);
      adds();
      k::dq_pass_turn(sem);
      break;
    case 1:
      adds();
      break;
    case 2:
      if (tid == 0)
        while (k::ld_acquire_gpu(sem) + 1 < b) k::spin_pause();
      syncthreads();
      adds();
      k::dq_pass_turn(sem);
      break;
    case 3:
      k::dq_wait_turn(sem, b);
      k::dq_pass_turn(sem);
      adds();
      break;
    case 4:
      k::dq_wait_turn(sem, b);
      adds();
      if (tid == 0) k::red_release_add_gpu(sem, 1u);
      break;
    case 5:
      k::dq_wait_turn(sem, b);
      adds();
      syncthreads();
      if (tid == 0) red_add_u32(sem, 1u, false);
      break;
    case 6:
      k::dq_wait_turn(sem, b + 1);
      adds();
      k::dq_pass_turn(sem);
      break;
  }
}

}  // namespace mhk_selftest

extern "C" {

// Each returns 0, or 1 with the error in mhk_emu_last_error(). The error state is cleared first.
int mhk_selftest_collectives(int variant, float* out) {
  mhk_emu::state().error.clear();
  mhk_emu::launch([=] { mhk_selftest::collectives_body(variant, out); }, 1, 128, 0);
  return mhk_emu::state().error.empty() ? 0 : 1;
}

int mhk_selftest_race(int variant, const void* src, int steps, float* out) {
  mhk_emu::state().error.clear();
  mhk_emu::state().defer_async = true;
  const __half* s = static_cast<const __half*>(src);
  mhk_emu::launch([=] { mhk_selftest::race_body(variant, s, steps, out); }, 1, 128, 2 * 1024 * 2);
  return mhk_emu::state().error.empty() ? 0 : 1;
}

int mhk_selftest_copy(const void* src, int n, void* dst) {
  mhk_emu::state().error.clear();
  mhk_emu::launch([=] { mhk_selftest::copy_body(static_cast<const unsigned char*>(src), n, static_cast<unsigned char*>(dst)); },
                  1, 128, 128 * 16);
  return mhk_emu::state().error.empty() ? 0 : 1;
}

// acc (n floats) and *sem must be zero; vals holds blocks * n values.
int mhk_selftest_ordered_add(int variant, int blocks, int n, const float* vals, float* acc, unsigned* sem) {
  mhk_emu::state().error.clear();
  mhk_emu::launch([=] { mhk_selftest::ordered_add_body(variant, n, vals, acc, sem); }, blocks, 64, 0);
  return mhk_emu::state().error.empty() ? 0 : 1;
}

}  // extern "C"
