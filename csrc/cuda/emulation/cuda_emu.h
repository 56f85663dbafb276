// CPU emulation of the CUDA features the attention kernels use, so that the host-side tests can
// run the kernels' own source without a GPU (tests/test_cuda_host.py builds it with g++).
//
// Each CUDA thread of a block is a fiber on one OS thread; blocks run one after the
// other. Barriers (__syncthreads, and the implicit warp rendezvous of ldmatrix, mma and
// shuffles) suspend a fiber until all its peers arrive; a barrier that can never complete
// (divergent __syncthreads) is reported as an error instead of hanging. Warp-collective
// instructions follow the PTX ISA's documented fragment layouts (see ../primitives.cuh), and
// cp.async copies either land at once or only at the wait that must cover them (deferred mode),
// so a kernel that reads a tile before waiting for it, or overwrites one still being read,
// computes wrong numbers here. Shared memory starts filled with NaN bytes each block.
//
// What this cannot show: timing, occupancy, register limits, bank conflicts, and whether the
// hardware matches the documented layouts (that is left to the GPU test suite).
#pragma once

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <driver_types.h>
#include <vector_types.h>

// Fiber switch. swapcontext saves the signal mask with a system call on every switch, and the
// emulator switches a few times per warp instruction; on x86-64 a 14-instruction switch of the
// callee-saved registers (defined in emu_entry.cpp) makes the emulation several times faster.
#if defined(__x86_64__)
extern "C" void mhk_emu_switch(void** save_sp, void* load_sp);
#endif

namespace mhk_emu {

struct AsyncCopy {
  void* dst;
  const void* src;
  bool valid;
};

struct Fiber {
#if defined(__x86_64__)
  void* sp = nullptr;
#else
  ucontext_t ctx;
#endif
  std::vector<char> stack;
  bool done = false;
  std::vector<AsyncCopy> open_group;
  std::deque<std::vector<AsyncCopy>> committed;
  // Per-lane mailbox of the warp collectives.
  uint32_t regs[6] = {0, 0, 0, 0, 0, 0};
  float out[4] = {0.f, 0.f, 0.f, 0.f};
  const void* addr = nullptr;
  float value = 0.f;
};

struct State {
  std::function<void()> body;
  int nthreads = 0;
  int64_t block = 0;
  std::vector<unsigned char> smem;
  std::vector<Fiber> fibers;
#if defined(__x86_64__)
  void* scheduler_sp = nullptr;
#else
  ucontext_t scheduler;
#endif
  int current = -1;
  int bar_arrived = 0;
  uint64_t bar_gen = 0;
  int warp_arrived[32] = {};
  uint64_t warp_gen[32] = {};
  uint64_t events = 0;
  std::string error;
  bool defer_async = true;
  size_t stack_bytes = 256 * 1024;
  int64_t max_smem = 227 * 1024;  // sm_90's opt-in limit per block
};

inline State& state() {
  static State s;
  return s;
}

inline void fail(const std::string& msg) {
  State& s = state();
  if (s.error.empty()) s.error = msg;
}

inline int thread_index() { return state().current; }
inline int64_t block_index() { return state().block; }
inline unsigned char* dynamic_smem() { return state().smem.data(); }

inline void yield() {
  State& s = state();
#if defined(__x86_64__)
  mhk_emu_switch(&s.fibers[s.current].sp, s.scheduler_sp);
#else
  swapcontext(&s.fibers[s.current].ctx, &s.scheduler);
#endif
}

inline void syncthreads() {
  State& s = state();
  const uint64_t gen = s.bar_gen;
  ++s.events;
  if (++s.bar_arrived == s.nthreads) {
    s.bar_arrived = 0;
    ++s.bar_gen;
    return;
  }
  while (s.bar_gen == gen) yield();
}

inline void warp_sync() {
  State& s = state();
  const int w = s.current / 32;
  const uint64_t gen = s.warp_gen[w];
  ++s.events;
  if (++s.warp_arrived[w] == 32) {
    s.warp_arrived[w] = 0;
    ++s.warp_gen[w];
    return;
  }
  while (s.warp_gen[w] == gen) yield();
}

inline bool in_smem(const void* p, size_t bytes) {
  State& s = state();
  const unsigned char* c = static_cast<const unsigned char*>(p);
  return c >= s.smem.data() && c + bytes <= s.smem.data() + s.smem.size();
}

inline void check_smem_access(const void* p, size_t bytes, const char* what) {
  if (!in_smem(p, bytes)) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "%s: address outside the block's shared memory (thread %d, block %lld)", what,
                  state().current, static_cast<long long>(state().block));
    fail(buf);
  } else if (reinterpret_cast<uintptr_t>(p) % 16 != 0) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "%s: shared address not 16-byte aligned (thread %d)", what, state().current);
    fail(buf);
  }
}

inline float half_bits_to_float(uint16_t bits, bool bf16) {
  if (bf16) {
    __nv_bfloat16 h;
    std::memcpy(&h, &bits, 2);
    return __bfloat162float(h);
  }
  __half h;
  std::memcpy(&h, &bits, 2);
  return __half2float(h);
}

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16
inline void ldmatrix_x4(uint32_t (&r)[4], const void* p, bool trans) {
  State& s = state();
  check_smem_access(p, 16, "ldmatrix");
  Fiber& me = s.fibers[s.current];
  me.addr = s.error.empty() ? p : s.smem.data();
  warp_sync();
  const int lane = s.current % 32, base = s.current - lane;
  const int g = lane / 4, t = lane % 4;
  for (int j = 0; j < 4; ++j) {
    uint16_t lo, hi;
    if (!trans) {
      const uint16_t* row = static_cast<const uint16_t*>(s.fibers[base + 8 * j + g].addr);
      lo = row[2 * t];
      hi = row[2 * t + 1];
    } else {
      const uint16_t* r0 = static_cast<const uint16_t*>(s.fibers[base + 8 * j + 2 * t].addr);
      const uint16_t* r1 = static_cast<const uint16_t*>(s.fibers[base + 8 * j + 2 * t + 1].addr);
      lo = r0[g];
      hi = r1[g];
    }
    r[j] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  }
  warp_sync();
}

inline float bits_to_float(uint32_t bits16, bool bf16) {
  const uint16_t b = static_cast<uint16_t>(bits16);
  return half_bits_to_float(b, bf16);
}

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32, d += a * b. Lane 0 multiplies
// for the whole warp between the two rendezvous; each lane then takes its four results.
inline void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, bool bf16) {
  State& s = state();
  Fiber& me = s.fibers[s.current];
  for (int i = 0; i < 4; ++i) me.regs[i] = a[i];
  me.regs[4] = b0;
  me.regs[5] = b1;
  for (int e = 0; e < 4; ++e) me.out[e] = d[e];
  warp_sync();
  const int lane = s.current % 32, base = s.current - lane;
  if (lane == 0) {
    float A[16][16], B[16][8];
    for (int L = 0; L < 32; ++L) {
      const uint32_t* rg = s.fibers[base + L].regs;
      const int gl = L / 4, tl = L % 4;
      A[gl][2 * tl] = bits_to_float(rg[0], bf16);
      A[gl][2 * tl + 1] = bits_to_float(rg[0] >> 16, bf16);
      A[gl + 8][2 * tl] = bits_to_float(rg[1], bf16);
      A[gl + 8][2 * tl + 1] = bits_to_float(rg[1] >> 16, bf16);
      A[gl][2 * tl + 8] = bits_to_float(rg[2], bf16);
      A[gl][2 * tl + 9] = bits_to_float(rg[2] >> 16, bf16);
      A[gl + 8][2 * tl + 8] = bits_to_float(rg[3], bf16);
      A[gl + 8][2 * tl + 9] = bits_to_float(rg[3] >> 16, bf16);
      B[2 * tl][gl] = bits_to_float(rg[4], bf16);
      B[2 * tl + 1][gl] = bits_to_float(rg[4] >> 16, bf16);
      B[2 * tl + 8][gl] = bits_to_float(rg[5], bf16);
      B[2 * tl + 9][gl] = bits_to_float(rg[5] >> 16, bf16);
    }
    for (int L = 0; L < 32; ++L) {
      const int g = L / 4, t = L % 4;
      const int rows[4] = {g, g, g + 8, g + 8};
      const int cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
      float* o = s.fibers[base + L].out;
      for (int e = 0; e < 4; ++e) {
        float acc = o[e];
        for (int k = 0; k < 16; ++k) acc += A[rows[e]][k] * B[k][cols[e]];
        o[e] = acc;
      }
    }
  }
  warp_sync();
  // Lane 0 writes `out` again only after the next first rendezvous, which this lane reaches
  // only after reading.
  for (int e = 0; e < 4; ++e) d[e] = me.out[e];
}

inline float shfl_xor(float x, int mask) {
  State& s = state();
  s.fibers[s.current].value = x;
  warp_sync();
  const int lane = s.current % 32, base = s.current - lane;
  const float y = s.fibers[base + (lane ^ mask)].value;
  warp_sync();
  return y;
}

inline void perform(const AsyncCopy& c) {
  if (c.valid)
    std::memcpy(c.dst, c.src, 16);
  else
    std::memset(c.dst, 0, 16);
}

inline void cp_async_16(void* smem, const void* gmem, bool valid) {
  State& s = state();
  check_smem_access(smem, 16, "cp.async destination");
  if (reinterpret_cast<uintptr_t>(gmem) % 16 != 0) fail("cp.async: global source not 16-byte aligned");
  if (!s.error.empty()) return;
  const AsyncCopy c{smem, gmem, valid};
  if (s.defer_async)
    s.fibers[s.current].open_group.push_back(c);
  else
    perform(c);
}

inline void cp_async_commit() {
  State& s = state();
  Fiber& me = s.fibers[s.current];
  me.committed.push_back(std::move(me.open_group));
  me.open_group.clear();
}

inline void cp_async_wait(int n) {
  State& s = state();
  Fiber& me = s.fibers[s.current];
  while (static_cast<int>(me.committed.size()) > n) {
    for (const AsyncCopy& c : me.committed.front()) perform(c);
    me.committed.pop_front();
  }
}

inline cudaError_t check_dynamic_smem(int bytes) {
  return bytes <= state().max_smem ? cudaSuccess : cudaErrorInvalidValue;
}

inline void fiber_main() {
  State& s = state();
  s.body();
  s.fibers[s.current].done = true;
  ++s.events;
#if defined(__x86_64__)
  void* dead_sp = nullptr;
  mhk_emu_switch(&dead_sp, s.scheduler_sp);  // never resumed
#endif
  // (ucontext: returning resumes the scheduler through uc_link.)
}

#if defined(__x86_64__)
extern "C" inline void mhk_emu_fiber_entry() { fiber_main(); }

// Prepares a fresh stack so that the first mhk_emu_switch into it pops six zero registers and
// "returns" into mhk_emu_fiber_entry with the stack aligned as after a call.
inline void* fresh_stack(std::vector<char>& stack) {
  uintptr_t top = reinterpret_cast<uintptr_t>(stack.data() + stack.size()) & ~uintptr_t(15);
  void** sp = reinterpret_cast<void**>(top);
  *--sp = nullptr;                                               // fake return address of the entry
  *--sp = reinterpret_cast<void*>(&mhk_emu_fiber_entry);         // popped by ret
  for (int i = 0; i < 6; ++i) *--sp = nullptr;                   // rbp rbx r12-r15
  return sp;
}
#endif

// Runs grid blocks of `threads` threads one after the other; each thread runs body().
inline void launch(std::function<void()> body, int64_t grid, int threads, int smem_bytes) {
  State& s = state();
  if (!s.error.empty()) return;
  if (threads % 32 != 0 || threads > 1024) {
    fail("launch: block size must be a multiple of 32, at most 1024");
    return;
  }
  if (smem_bytes > s.max_smem) {
    fail("launch: dynamic shared memory above the device limit");
    return;
  }
  s.body = std::move(body);
  s.nthreads = threads;
  if (static_cast<int>(s.fibers.size()) < threads) s.fibers.resize(threads);
  for (int64_t blk = 0; blk < grid && s.error.empty(); ++blk) {
    s.block = blk;
    s.smem.assign(static_cast<size_t>(smem_bytes) + 16, 0xff);  // NaN in every float type
    s.bar_arrived = 0;
    for (int w = 0; w < 32; ++w) s.warp_arrived[w] = 0;
    for (int i = 0; i < threads; ++i) {
      Fiber& f = s.fibers[i];
      f.done = false;
      f.open_group.clear();
      f.committed.clear();
      f.stack.resize(s.stack_bytes);
#if defined(__x86_64__)
      f.sp = fresh_stack(f.stack);
#else
      getcontext(&f.ctx);
      f.ctx.uc_stack.ss_sp = f.stack.data();
      f.ctx.uc_stack.ss_size = f.stack.size();
      f.ctx.uc_link = &s.scheduler;
      makecontext(&f.ctx, fiber_main, 0);
#endif
    }
    int live = threads;
    while (live > 0) {
      const uint64_t before = s.events;
      live = 0;
      for (int i = 0; i < threads; ++i) {
        if (s.fibers[i].done) continue;
        s.current = i;
#if defined(__x86_64__)
        mhk_emu_switch(&s.scheduler_sp, s.fibers[i].sp);
#else
        swapcontext(&s.scheduler, &s.fibers[i].ctx);
#endif
        if (!s.fibers[i].done) ++live;
      }
      if (live > 0 && s.events == before) {
        char buf[160];
        std::snprintf(buf, sizeof buf,
                      "deadlock in block %lld: %d threads wait at a barrier the others never reach",
                      static_cast<long long>(blk), live);
        fail(buf);
        break;
      }
    }
    s.current = -1;
  }
}

}  // namespace mhk_emu

inline cudaError_t cudaGetLastError() {
  return mhk_emu::state().error.empty() ? cudaSuccess : cudaErrorLaunchFailure;
}
