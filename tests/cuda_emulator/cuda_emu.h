// CPU emulation of the CUDA features the attention kernels use, so that the host-side tests can
// run the kernels' own source without a GPU (tests/cuda_emulator_harness.py builds it with g++).
// Test infrastructure (README.md here): mhakern._C never compiles it.
//
// Each CUDA thread of a block is a fiber on one OS thread; blocks run one after the other.
// Barriers (__syncthreads, and the implicit warp rendezvous of ldmatrix, mma and shuffles)
// suspend a fiber until all its peers arrive; a barrier that can never complete (a thread that
// left while others wait) is reported as an error instead of hanging. Warp-collective
// instructions follow the PTX ISA's documented fragment layouts (see csrc/cuda/common/primitives.cuh).
//
// Two schedules (mhk_emu_schedule in emu_schedule.cpp selects one):
//  * fixed: fibers switch only where they must wait, and run in thread order; cp.async copies
//    land at once or, deferred, only at the wait that must cover them. Deterministic: the same
//    interleaving every run.
//  * random (seeded): every pass over the fibers runs them in a fresh random order (lanes of a
//    warp interleave with each other and with other warps), a fiber may be preempted at every
//    shared-memory primitive (cp.async issue and wait, barrier arrival and release, between an
//    ldmatrix's rendezvous and its shared-memory read), and each cp.async copy lands at a random
//    moment between its issue and the wait that covers it. A kernel that reads a tile before
//    waiting for it, overwrites one another warp still reads, or reads a neighbour's
//    plain shared-memory store without a barrier then computes wrong numbers for some seeds.
//    The per-block random stream is a function of (seed, launch shape, block index) only, so a
//    failing seed reproduces on its own; errors name the seed.
//
// Convergence: every .sync.aligned collective (mma.sync, ldmatrix, shfl.sync, vote.sync,
// bar.warp.sync) must be reached by all 32 lanes of the warp from the same program point with
// the full member mask, and every bar.sync (__syncthreads) by all threads of the block from the
// same program point; the emulator identifies a program point by the fiber's call stack (return
// addresses, so the same source line inlined into two templates is two points, as on the GPU).
// A divergent arrival or a partial mask is an error naming the call sites.
//
// Shared memory starts filled with NaN bytes each block. What this cannot show: timing,
// occupancy, register limits, bank conflicts, races between plain shared-memory accesses that
// no primitive separates (they are not switch points), and whether the hardware matches the
// documented layouts (that is left to the GPU test suite).
#pragma once

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#include <cxxabi.h>
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
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

constexpr uint32_t kFullMask = 0xffffffffu;
constexpr int kSiteFrames = 6;  // return addresses kept per arrival for error messages

struct AsyncCopy {
  void* dst;
  const void* src;
  bool valid;
  uint64_t group;  // sequence number of the commit group it belongs to
};

// A global-memory reduction in flight (red / atom without a return value): performed when it
// lands (global-memory section below). Issuer: its block and thread; bars: the __syncthreads
// the issuer had left when it issued it.
struct GlobalOp {
  enum Kind : int { kAddF32, kAddU32 } kind;
  void* addr;
  float f;
  uint32_t u;
  int64_t block;
  int thread;
  uint64_t bars;
};

// Where a fiber arrived at a collective or barrier: the operation, its member mask, a hash of
// the whole call stack (the program point) and its innermost return addresses.
struct Site {
  const char* op = nullptr;
  uint32_t mask = kFullMask;
  uint64_t hash = 0;
  int frames = 0;
  void* pc[kSiteFrames] = {};
};

struct Fiber {
#if defined(__x86_64__)
  void* sp = nullptr;
#else
  ucontext_t ctx;
#endif
  std::vector<char> stack;
  bool done = false;
  std::vector<AsyncCopy> inflight;  // issued and not landed yet, in issue order
  uint64_t groups_committed = 0;
  uint64_t bars_passed = 0;  // __syncthreads this fiber has left (global-memory ordering, below)
  Site site;
  // Per-lane mailbox of the warp collectives.
  uint32_t regs[6] = {0, 0, 0, 0, 0, 0};
  float out[4] = {0.f, 0.f, 0.f, 0.f};
  const void* addr = nullptr;
  float value = 0.f;
  uint32_t word = 0;
};

// Knobs of the random schedule, drawn from the seed (so that different seeds also explore
// different kinds of interleaving); probabilities as thresholds on 32-bit random numbers.
struct Schedule {
  bool random = false;
  uint64_t seed = 0;
  uint32_t p_preempt = 0;  // a switch point yields
  uint32_t p_land_now = 0;  // a cp.async lands at its issue
  uint32_t p_land_step = 0;  // after each slice of a fiber, one of its in-flight copies lands
  int resident = 1;          // blocks of a launch in flight at once (global-memory section below)
};

// The order in which a launch's blocks become resident, and how many at once (global-memory
// section below). The CUDA programming model promises neither an order nor a number: kernels
// that make a block wait on another must hold under any. Set by mhk_emu_dispatch, kept across
// launches and schedules until changed.
struct Dispatch {
  enum Order : int { kInOrder = 0, kReversed = 1, kShuffled = 2 } order = kInOrder;
  int resident = 0;   // > 0: this many blocks in flight at once, whatever the schedule's own
  uint64_t seed = 0;  // kShuffled: the permutation's seed
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
  Schedule sched;
  Dispatch dispatch;
  uint64_t rng = 0;
  std::vector<int> order;
  // Global memory that cp.async may read (empty: unchecked); [begin, end) byte ranges.
  std::vector<std::pair<uintptr_t, uintptr_t>> readable;
  // sm_90 features (cuda_emu_sm90.h): reset at each block. Opaque here so that this header
  // stays independent of them; sm90_block_start / sm90_step are set by cuda_emu_sm90.h.
  void (*sm90_block_start)() = nullptr;  // called before a block's fibers start
  void (*sm90_step)() = nullptr;         // random schedule: after each fiber slice (lands copies)
  // Concurrent blocks (global-memory section below): an extension with per-block state of its
  // own exchanges it with its copy for resident slot `slot` (called when the launcher switches
  // the block it runs); without it a launch with sm90_block_start set runs one block at a time.
  void (*block_swap)(int slot) = nullptr;
  // Global-memory reductions issued and not yet performed (GlobalOp, below), and the launch's
  // own random stream (which resident block runs next).
  std::vector<GlobalOp> global_pending;
  uint64_t launch_rng = 0;
  int slot = 0;  // resident slot of the block being run
  // A deliberate defect a kernel compiled for emulation injects on request (0: none), so that a
  // test can show the emulator catching it in the real kernel (the fused backward's dQ order:
  // attn_bwd_fused_kernel.cuh). Never compiled into GPU code.
  int defect = 0;
};

inline State& state() {
  static State s;
  return s;
}

inline void fail(const std::string& msg) {
  State& s = state();
  if (!s.error.empty()) return;
  s.error = msg;
  if (s.sched.random) s.error += " [random schedule, seed " + std::to_string(s.sched.seed) + "]";
}

// splitmix64: the random stream of the schedule.
inline uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
inline uint32_t next_random() {
  State& s = state();
  s.rng = mix64(s.rng);
  return static_cast<uint32_t>(s.rng >> 32);
}
inline bool chance(uint32_t threshold) { return threshold != 0 && next_random() < threshold; }

// Seeds the knobs; mode 0 restores the fixed schedule.
inline void set_schedule(int random, uint64_t seed) {
  Schedule& c = state().sched;
  c = Schedule{};
  if (!random) return;
  c.random = true;
  c.seed = seed;
  const uint64_t r = mix64(seed ^ 0x5eed5eed5eedull);
  static const uint32_t kPreempt[4] = {1u << 26, 1u << 28, 1u << 29, 1u << 30};  // 1/64 .. 1/4
  static const uint32_t kNow[4] = {0u, 1u << 30, 3u << 30, 0xffffffffu};         // 0, 1/4, 3/4, 1
  static const uint32_t kStep[4] = {0u, 1u << 27, 1u << 29, 1u << 31};           // 0 .. 1/2
  c.p_preempt = kPreempt[r & 3];
  c.p_land_now = kNow[(r >> 2) & 3];
  c.p_land_step = kStep[(r >> 4) & 3];
  c.resident = 1 + static_cast<int>(((r >> 6) & 3) % 3);  // 1, 2, 3, 1: blocks in flight at once
}

inline int thread_index() { return state().current; }
inline int64_t block_index() { return state().block; }
// The block's dynamic shared memory starts 1024-byte aligned, as the sm_90 kernels declare it
// (the 128-byte swizzle of TMA and wgmma repeats every 1024 bytes of the shared address space;
// the emulator's "shared address" of a byte is its offset from this base).
constexpr uintptr_t kSmemAlign = 1024;
inline unsigned char* dynamic_smem() {
  unsigned char* p = state().smem.data();
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  return p + ((kSmemAlign - a % kSmemAlign) % kSmemAlign);
}

// Back to the scheduler. A fiber resumed after an error never runs on: the scheduler stops a
// block at its first error, so this never returns then (its stack is reset at the next launch).
inline void yield() {
  State& s = state();
#if defined(__x86_64__)
  mhk_emu_switch(&s.fibers[s.current].sp, s.scheduler_sp);
#else
  swapcontext(&s.fibers[s.current].ctx, &s.scheduler);
#endif
}

// Records the calling fiber's program point: a hash of the return addresses on its stack,
// followed through the frame-pointer chain (the emulator is built with -fno-omit-frame-pointer;
// the chain ends at the fiber's entry, whose saved frame pointer is null) within the fiber's
// own stack.
__attribute__((noinline)) inline void record_site(Site& site, const char* op, uint32_t mask) {
  State& s = state();
  const std::vector<char>& stack = s.fibers[s.current].stack;
  const uintptr_t lo = reinterpret_cast<uintptr_t>(stack.data());
  const uintptr_t hi = lo + stack.size();
  void** fp = static_cast<void**>(__builtin_frame_address(0));
  uint64_t h = 0xcbf29ce484222325ull;
  int n = 0;
  for (int depth = 0; depth < 64; ++depth) {
    const uintptr_t f = reinterpret_cast<uintptr_t>(fp);
    if (f < lo || f + 2 * sizeof(void*) > hi) break;
    void* ret = fp[1];
    h = (h ^ reinterpret_cast<uintptr_t>(ret)) * 0x100000001b3ull;
    if (n < kSiteFrames) site.pc[n++] = ret;
    void** up = static_cast<void**>(fp[0]);
    if (up <= fp) break;
    fp = up;
  }
  site.op = op;
  site.mask = mask;
  site.hash = h;
  site.frames = n;
}

// "function<args>+0xoff" for a return address (the kernel's own frames, emulator frames skipped).
inline std::string describe_pc(void* pc) {
  Dl_info info;
  char buf[64];
  if (dladdr(pc, &info) == 0 || info.dli_sname == nullptr) {
    std::snprintf(buf, sizeof buf, "%p", pc);
    return buf;
  }
  int status = 0;
  char* dem = abi::__cxa_demangle(info.dli_sname, nullptr, nullptr, &status);
  std::string name = (status == 0 && dem) ? dem : info.dli_sname;
  std::free(dem);
  // Drop the parameter list: the template arguments name the instantiation.
  int depth = 0;
  for (size_t i = 0; i < name.size(); ++i) {
    if (name[i] == '<') ++depth;
    if (name[i] == '>') --depth;
    if (name[i] == '(' && depth == 0 && i > 0) {
      name.resize(i);
      break;
    }
  }
  if (name.size() > 120) name = name.substr(0, 117) + "...";
  std::snprintf(buf, sizeof buf, "+0x%lx", static_cast<unsigned long>(static_cast<char*>(pc) - static_cast<char*>(info.dli_saddr)));
  return name + buf;
}

inline std::string describe_site(const Site& site) {
  std::string out = site.op ? site.op : "?";
  out += " called from ";
  int shown = 0;
  for (int i = 0; i < site.frames && shown < 3; ++i) {
    const std::string d = describe_pc(site.pc[i]);
    if (d.rfind("mhk_emu::", 0) == 0) continue;  // the emulator's own frames
    if (shown++) out += " < ";
    out += d;
  }
  return out;
}

// Names the groups of threads [first, first + count) by program point, for error messages.
inline std::string describe_groups(int first, int count) {
  State& s = state();
  std::string out;
  std::vector<bool> seen(count, false);
  int groups = 0;
  for (int i = 0; i < count; ++i) {
    if (seen[i]) continue;
    const Site& a = s.fibers[first + i].site;
    std::string members;
    int n = 0;
    for (int j = i; j < count; ++j) {
      const Site& b = s.fibers[first + j].site;
      if (!seen[j] && b.hash == a.hash && b.op == a.op) {
        seen[j] = true;
        if (n < 8) members += (n ? "," : "") + std::to_string(first + j);
        ++n;
      }
    }
    if (n > 8) members += ",...";
    if (groups++ == 3) {
      out += "; ...";
      break;
    }
    out += (groups > 1 ? "; " : "") + std::to_string(n) + " thread(s) (" + members + ") at " + describe_site(a);
  }
  return out;
}

// A point where another fiber may run first (random schedule only). Counts as progress for the
// deadlock check.
inline void preempt_point() {
  State& s = state();
  if (!s.sched.random || !chance(s.sched.p_preempt)) return;
  ++s.events;
  yield();
}

inline void syncthreads() {
  State& s = state();
  preempt_point();
  record_site(s.fibers[s.current].site, "bar.sync (__syncthreads)", kFullMask);
  const uint64_t gen = s.bar_gen;
  ++s.events;
  if (++s.bar_arrived == s.nthreads) {
    for (int i = 1; i < s.nthreads; ++i) {
      if (s.fibers[i].site.hash != s.fibers[0].site.hash) {
        fail("divergent barrier in block " + std::to_string(s.block) +
             ": the threads reached __syncthreads from different program points: " + describe_groups(0, s.nthreads));
        yield();
      }
    }
    s.bar_arrived = 0;
    ++s.bar_gen;
  } else {
    while (s.bar_gen == gen) yield();
  }
  ++s.fibers[s.current].bars_passed;
  preempt_point();  // leave the barrier in a random order
}

// Plain rendezvous of the calling fiber's warp (no checks): the second half of a collective.
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

// The entry rendezvous of a .sync.aligned warp collective: every lane must come from the same
// program point with the full member mask. After it, every lane's mailbox is filled.
inline void warp_collective(const char* op, uint32_t mask) {
  State& s = state();
  Fiber& me = s.fibers[s.current];
  record_site(me.site, op, mask);
  if (mask != kFullMask) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "0x%08x", mask);
    fail(std::string(op) + ": member mask " + buf + " in block " + std::to_string(s.block) + ", thread " +
         std::to_string(s.current) + " (" + describe_site(me.site) +
         "): the kernels' collectives must name the full warp, 0xffffffff");
    yield();
  }
  const int w = s.current / 32;
  const uint64_t gen = s.warp_gen[w];
  ++s.events;
  if (++s.warp_arrived[w] == 32) {
    const int base = 32 * w;
    for (int l = 1; l < 32; ++l) {
      const Site& a = s.fibers[base].site;
      const Site& b = s.fibers[base + l].site;
      if (a.hash != b.hash || a.op != b.op) {
        fail("divergent warp collective in block " + std::to_string(s.block) + ", warp " + std::to_string(w) +
             ": its lanes arrived from different program points: " + describe_groups(base, 32));
        yield();
      }
    }
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
  warp_collective(trans ? "ldmatrix.sync.aligned.x4.trans" : "ldmatrix.sync.aligned.x4", kFullMask);
  preempt_point();  // the shared-memory read happens some time after the rendezvous
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
  warp_collective(bf16 ? "mma.sync.aligned.m16n8k16.bf16" : "mma.sync.aligned.m16n8k16.f16", kFullMask);
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

// shfl.sync.bfly.b32: lane l receives lane (l ^ lane_mask)'s x.
inline float shfl_xor_sync(uint32_t member_mask, float x, int lane_mask) {
  State& s = state();
  s.fibers[s.current].value = x;
  warp_collective("shfl.sync.bfly", member_mask);
  const int lane = s.current % 32, base = s.current - lane;
  const float y = s.fibers[base + ((lane ^ lane_mask) & 31)].value;
  warp_sync();
  return y;
}

// The kernels' shuffle (primitives.cuh): __shfl_xor_sync over the full warp.
inline float shfl_xor(float x, int lane_mask) { return shfl_xor_sync(kFullMask, x, lane_mask); }

// vote.sync.ballot.b32: bit l of the result is lane l's predicate.
inline uint32_t ballot_sync(uint32_t member_mask, bool pred) {
  State& s = state();
  s.fibers[s.current].word = pred ? 1u : 0u;
  warp_collective("vote.sync.ballot", member_mask);
  const int base = s.current - s.current % 32;
  uint32_t bits = 0;
  for (int l = 0; l < 32; ++l) bits |= s.fibers[base + l].word << l;
  warp_sync();
  return bits;
}
inline bool all_sync(uint32_t member_mask, bool pred) { return ballot_sync(member_mask, pred) == kFullMask; }
inline bool any_sync(uint32_t member_mask, bool pred) { return ballot_sync(member_mask, pred) != 0; }

// bar.warp.sync (__syncwarp).
inline void syncwarp(uint32_t member_mask = kFullMask) { warp_collective("bar.warp.sync", member_mask); }

inline void perform(const AsyncCopy& c) {
  if (c.valid)
    std::memcpy(c.dst, c.src, 16);
  else
    std::memset(c.dst, 0, 16);
}

// s.readable is sorted by begin and its ranges do not overlap (emu_schedule.cpp merges them).
inline bool readable(const void* p, size_t bytes) {
  State& s = state();
  if (s.readable.empty()) return true;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = std::upper_bound(s.readable.begin(), s.readable.end(), std::make_pair(a, ~uintptr_t(0)));
  if (it == s.readable.begin()) return false;
  --it;
  return a >= it->first && a + bytes <= it->second;
}

inline void cp_async_16(void* smem, const void* gmem, bool valid) {
  State& s = state();
  preempt_point();
  check_smem_access(smem, 16, "cp.async destination");
  if (reinterpret_cast<uintptr_t>(gmem) % 16 != 0) fail("cp.async: global source not 16-byte aligned");
  if (valid && !readable(gmem, 16)) {
    char buf[200];
    std::snprintf(buf, sizeof buf,
                  "cp.async reads 16 bytes at %p, outside every tensor the kernel may read (thread %d, block %lld)",
                  gmem, s.current, static_cast<long long>(s.block));
    fail(buf);
  }
  if (!s.error.empty()) return;
  Fiber& me = s.fibers[s.current];
  const AsyncCopy c{smem, gmem, valid, me.groups_committed};
  const bool now = s.sched.random ? chance(s.sched.p_land_now) : !s.defer_async;
  if (now)
    perform(c);
  else
    me.inflight.push_back(c);
}

inline void cp_async_commit() {
  State& s = state();
  ++s.fibers[s.current].groups_committed;
}

// cp.async.wait_group n: all but the n most recent committed groups have landed (copies not
// committed yet are not waited for, as on the GPU).
inline void cp_async_wait(int n) {
  State& s = state();
  preempt_point();
  Fiber& me = s.fibers[s.current];
  if (me.groups_committed < static_cast<uint64_t>(n)) return;
  const uint64_t limit = me.groups_committed - n;  // groups [0, limit) must have landed
  size_t keep = 0;
  for (size_t i = 0; i < me.inflight.size(); ++i) {
    if (me.inflight[i].group < limit)
      perform(me.inflight[i]);
    else
      me.inflight[keep++] = me.inflight[i];
  }
  me.inflight.resize(keep);
}

// Random schedule: one in-flight copy of fiber f lands now.
inline void land_one(Fiber& f) {
  if (f.inflight.empty()) return;
  const size_t i = next_random() % f.inflight.size();
  perform(f.inflight[i]);
  f.inflight[i] = f.inflight.back();
  f.inflight.pop_back();
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
// "returns" into mhk_emu_fiber_entry with the stack aligned as after a call. The zero frame
// pointer ends record_site's walk.
inline void* fresh_stack(std::vector<char>& stack) {
  uintptr_t top = reinterpret_cast<uintptr_t>(stack.data() + stack.size()) & ~uintptr_t(15);
  void** sp = reinterpret_cast<void**>(top);
  *--sp = nullptr;                                               // fake return address of the entry
  *--sp = reinterpret_cast<void*>(&mhk_emu_fiber_entry);         // popped by ret
  for (int i = 0; i < 6; ++i) *--sp = nullptr;                   // rbp rbx r12-r15
  return sp;
}
#endif

inline void run_fiber(int i) {
  State& s = state();
  s.current = i;
#if defined(__x86_64__)
  mhk_emu_switch(&s.scheduler_sp, s.fibers[i].sp);
#else
  swapcontext(&s.scheduler, &s.fibers[i].ctx);
#endif
}

inline std::string describe_deadlock(int64_t blk, int threads) {
  State& s = state();
  int waiting = 0, finished = 0, first = -1;
  for (int i = 0; i < threads; ++i) {
    if (s.fibers[i].done) {
      ++finished;
    } else {
      ++waiting;
      if (first < 0) first = i;
    }
  }
  std::string msg = "deadlock in block " + std::to_string(blk) + ": " + std::to_string(waiting) +
                    " threads wait at a barrier the others never reach (" + std::to_string(finished) +
                    " threads have finished)";
  if (first >= 0) msg += "; thread " + std::to_string(first) + " waits at " + describe_site(s.fibers[first].site);
  return msg;
}

// ---- Global memory: reductions, acquire/release, concurrent blocks ---------------------------
// What a kernel that orders its CTAs through global memory needs (the fused backward's dQ:
// fp32 `red.global.add.f32` into a workspace, and, in its deterministic mode, a semaphore per
// row block that each key block waits on with `ld.acquire.gpu` and advances with
// `red.release.gpu`; csrc/cuda/common/dq_accum.cuh). PTX ISA "Memory Consistency Model", modelled as:
//  * a reduction (red_add_f32, red_add_u32) does not change memory when it is issued: under
//    the random schedule it lands at once with the seed's p_land_now, else at a random later
//    moment (after any fiber slice with p_land_step, or when nothing else can progress), and at
//    the latest when the launch ends; two reductions to one address may land in either order,
//    so fp32 sums come out in a schedule-dependent order unless the kernel orders them. The
//    fixed schedule performs each at its issue.
//  * a release (red_release_add_u32, and fence_acq_rel_gpu, __threadfence) first performs every
//    reduction of its own thread still in flight and, cumulatively, every one of its block
//    issued before a __syncthreads that the releasing thread has since left (bar.sync orders
//    the block's threads before the releaser); then its own reduction is in flight like any
//    other. A relaxed reduction used as a flag orders nothing (the deliberate-bug tests rely on
//    that).
//  * ld_acquire_u32 reads memory as it is (landed reductions only), at a switch point; a spin
//    loop calls spin_pause between its loads. Loads are never speculated early, so a missing
//    *acquire* is not caught (a missing or misplaced release is).
//  * blocks: under the random schedule up to `resident` blocks of a launch (1 to 3, from the
//    seed) are in flight at once and interleave slice by slice; the fixed schedule runs one
//    block at a time. Blocks start in block-index order unless State::dispatch says otherwise
//    (reversed, or a seeded permutation, with its own number of resident blocks): the hardware
//    promises no order, and a grid of 2,048 CTAs on 132 SMs has most of its blocks waiting to
//    start while the first wave runs. A wait nothing can satisfy (every resident block waiting,
//    nothing in flight) is reported as a deadlock; where blocks of the grid have not started
//    yet, the report says so (a resident block waits on one that cannot start before a
//    resident one ends: a dependence on the dispatch order).
// Plain global loads and stores are immediate, as before (no kernel communicates through them
// within a launch).

inline void perform(const GlobalOp& op) {
  if (op.kind == GlobalOp::kAddF32)
    *static_cast<float*>(op.addr) += op.f;
  else
    *static_cast<uint32_t*>(op.addr) += op.u;
  ++state().events;  // a landing can satisfy a waiting block
}

inline void land_global(size_t i) {
  State& s = state();
  const GlobalOp op = s.global_pending[i];
  s.global_pending.erase(s.global_pending.begin() + static_cast<long>(i));
  perform(op);
}

inline void issue_global(const GlobalOp& op) {
  State& s = state();
  if (!s.sched.random || chance(s.sched.p_land_now))
    perform(op);
  else
    s.global_pending.push_back(op);
}

inline GlobalOp global_op(GlobalOp::Kind kind, void* addr, float f, uint32_t u) {
  State& s = state();
  return GlobalOp{kind, addr, f, u, s.block, s.current, s.fibers[s.current].bars_passed};
}

// red.global.add.f32 (atomicAdd without a result): relaxed, gpu scope.
inline void red_add_f32(float* addr, float v) {
  preempt_point();
  issue_global(global_op(GlobalOp::kAddF32, addr, v, 0));
}

// Performs what a release by the calling thread orders before itself (see above).
inline void release_prior() {
  State& s = state();
  const uint64_t passed = s.fibers[s.current].bars_passed;
  for (size_t i = 0; i < s.global_pending.size();) {
    const GlobalOp& op = s.global_pending[i];
    if (op.block == s.block && (op.thread == s.current || op.bars < passed))
      land_global(i);
    else
      ++i;
  }
}

// red{.relaxed,.release}.gpu.global.add.u32.
inline void red_add_u32(uint32_t* addr, uint32_t v, bool release) {
  preempt_point();
  if (release) release_prior();
  issue_global(global_op(GlobalOp::kAddU32, addr, 0.f, v));
}

// atom.global.add.u32 with its result (atomicAdd, relaxed, gpu scope): performed at once (its
// old value is the result), after every reduction in flight to the same address has landed,
// so that it reads the sum of all of them (PTX: operations on one address are totally ordered).
inline uint32_t atom_add_u32(uint32_t* addr, uint32_t v) {
  preempt_point();
  State& s = state();
  for (size_t i = 0; i < s.global_pending.size();) {
    if (s.global_pending[i].addr == addr)
      land_global(i);
    else
      ++i;
  }
  const uint32_t old = *addr;
  *addr = old + v;
  ++s.events;
  return old;
}

// fence.acq_rel.gpu (__threadfence): the release half; loads are never early here.
inline void fence_acq_rel_gpu() {
  preempt_point();
  release_prior();
}

// A switch point that counts as no progress (a waiting thread's): the deadlock check sees a
// round of only these as a wait that cannot end.
inline void quiet_yield() { yield(); }

// ld.acquire.gpu.global.u32. (Its switch point counts as progress: the thread may be about to
// read a value that lets it go on. In a spin loop that cannot end, some round eventually
// passes with every preemption skipped and only spin_pause yielding: the deadlock report.)
inline uint32_t ld_acquire_u32(const uint32_t* addr) {
  preempt_point();
  return *addr;
}

// Between the loads of a spin loop (nanosleep on the GPU).
inline void spin_pause() {
  State& s = state();
  record_site(s.fibers[s.current].site, "spin wait (ld.acquire loop)", kFullMask);
  quiet_yield();
}

// A resident block's own state, exchanged with State's fields while it runs.
struct BlockSlot {
  int64_t block = -1;  // -1: free
  std::vector<unsigned char> smem;
  std::vector<Fiber> fibers;
  int bar_arrived = 0;
  uint64_t bar_gen = 0;
  int warp_arrived[32] = {};
  uint64_t warp_gen[32] = {};
  uint64_t rng = 0;
  std::vector<int> order;
};

inline std::vector<BlockSlot>& block_slots() {
  static std::vector<BlockSlot> slots;
  return slots;
}

inline void swap_in(BlockSlot& b, int slot) {
  State& s = state();
  std::swap(s.block, b.block);
  s.smem.swap(b.smem);
  s.fibers.swap(b.fibers);
  std::swap(s.bar_arrived, b.bar_arrived);
  std::swap(s.bar_gen, b.bar_gen);
  for (int w = 0; w < 32; ++w) {
    std::swap(s.warp_arrived[w], b.warp_arrived[w]);
    std::swap(s.warp_gen[w], b.warp_gen[w]);
  }
  std::swap(s.rng, b.rng);
  s.order.swap(b.order);
  s.slot = slot;
  if (s.block_swap) s.block_swap(slot);
}

inline uint32_t launch_random() {
  State& s = state();
  s.launch_rng = mix64(s.launch_rng);
  return static_cast<uint32_t>(s.launch_rng >> 32);
}

// Starts block blk in the swapped-in slot.
inline void start_block(int64_t blk, int64_t grid, int threads, int smem_bytes) {
  State& s = state();
  s.block = blk;
  // NaN in every float type; room to align the base (dynamic_smem).
  s.smem.assign(static_cast<size_t>(smem_bytes) + kSmemAlign + 16, 0xff);
  if (s.sm90_block_start) s.sm90_block_start();
  s.bar_arrived = 0;
  for (int w = 0; w < 32; ++w) s.warp_arrived[w] = 0;
  // The block's random stream depends on the seed and the launch shape only.
  s.rng = mix64(s.sched.seed ^ mix64(static_cast<uint64_t>(grid) * 0x10001u + threads) ^
                mix64(static_cast<uint64_t>(smem_bytes) << 20 ^ static_cast<uint64_t>(blk)));
  if (static_cast<int>(s.fibers.size()) < threads) s.fibers.resize(threads);
  s.order.resize(threads);
  for (int i = 0; i < threads; ++i) {
    s.order[i] = i;
    Fiber& f = s.fibers[i];
    f.done = false;
    f.inflight.clear();
    f.groups_committed = 0;
    f.bars_passed = 0;
    f.site = Site{};
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
}

// One pass over the swapped-in block's fibers; returns how many are still running.
inline int run_pass(int threads) {
  State& s = state();
  if (s.sched.random) {
    for (int i = threads - 1; i > 0; --i) std::swap(s.order[i], s.order[next_random() % (i + 1)]);
  }
  int live = 0;
  for (int k = 0; k < threads; ++k) {
    const int i = s.order[k];
    if (s.fibers[i].done) continue;
    run_fiber(i);
    if (!s.error.empty()) break;  // the block stops at its first error
    if (s.sched.random && chance(s.sched.p_land_step)) land_one(s.fibers[i]);
    if (s.sched.random && s.sm90_step && s.error.empty()) s.sm90_step();
    if (s.sched.random && !s.global_pending.empty() && chance(s.sched.p_land_step))
      land_global(next_random() % s.global_pending.size());
    if (!s.fibers[i].done) ++live;
  }
  return live;
}

// Runs grid blocks of `threads` threads; each thread runs body(). One block at a time in order,
// or (random schedule) up to sched.resident at once, interleaved (see above).
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
  int resident = s.sched.random ? s.sched.resident : 1;
  if (s.sm90_block_start && !s.block_swap) resident = 1;  // an extension without per-slot state
  if (s.dispatch.resident > 0) resident = s.dispatch.resident;
  if (s.sm90_block_start && !s.block_swap) resident = 1;  // (as above, whatever dispatch says)
  if (grid < resident) resident = static_cast<int>(grid < 1 ? 1 : grid);
  // The block that starts n-th (see Dispatch).
  std::vector<int64_t> start_order;
  if (s.dispatch.order != Dispatch::kInOrder) {
    start_order.resize(static_cast<size_t>(grid));
    for (int64_t i = 0; i < grid; ++i) start_order[i] = s.dispatch.order == Dispatch::kReversed ? grid - 1 - i : i;
    if (s.dispatch.order == Dispatch::kShuffled) {
      uint64_t r = mix64(s.dispatch.seed ^ 0xd15ba7c4ull ^ static_cast<uint64_t>(grid));
      for (int64_t i = grid - 1; i > 0; --i) {
        r = mix64(r);
        std::swap(start_order[i], start_order[r % static_cast<uint64_t>(i + 1)]);
      }
    }
  }
  std::vector<BlockSlot>& slots = block_slots();
  if (static_cast<int>(slots.size()) < resident) slots.resize(resident);
  for (int j = 0; j < resident; ++j) slots[j].block = -1;
  s.launch_rng = mix64(s.sched.seed ^ 0x1a0c4ull ^ mix64(static_cast<uint64_t>(grid) * 0x10001u + threads));
  int64_t next = 0;
  std::vector<int> round(resident);
  while (s.error.empty()) {
    int running = 0;
    for (int j = 0; j < resident; ++j) {
      if (slots[j].block < 0 && next < grid) {
        swap_in(slots[j], j);
        start_block(start_order.empty() ? next : start_order[next], grid, threads, smem_bytes);
        ++next;
        swap_in(slots[j], j);
      }
      if (slots[j].block >= 0) ++running;
    }
    if (running == 0) break;
    for (int j = 0; j < resident; ++j) round[j] = j;
    if (s.sched.random)
      for (int j = resident - 1; j > 0; --j) std::swap(round[j], round[launch_random() % (j + 1)]);
    const uint64_t before = s.events;
    for (int j : round) {
      if (slots[j].block < 0) continue;
      swap_in(slots[j], j);
      const int live = run_pass(threads);
      const bool finished = live == 0 && s.error.empty();
      swap_in(slots[j], j);
      if (finished) slots[j].block = -1;
      if (!s.error.empty()) break;
    }
    if (s.error.empty() && s.events == before) {
      // Nothing ran on: what is in flight lands eventually; if nothing is, the wait is endless.
      if (!s.global_pending.empty()) {
        land_global(s.sched.random ? launch_random() % s.global_pending.size() : 0);
        continue;
      }
      for (int j = 0; j < resident; ++j) {
        if (slots[j].block < 0) continue;
        swap_in(slots[j], j);
        std::string msg = describe_deadlock(s.block, threads);
        swap_in(slots[j], j);
        if (running > 1) msg += " (" + std::to_string(running) + " blocks in flight, all waiting)";
        if (next < grid)
          msg += "; " + std::to_string(grid - next) + " blocks of the grid not dispatched yet (" +
                 (s.dispatch.order == Dispatch::kReversed ? "reversed"
                  : s.dispatch.order == Dispatch::kShuffled ? "shuffled" : "in-order") +
                 " dispatch, " + std::to_string(resident) +
                 " resident at once): dispatch-order deadlock, a resident block waits on a block that "
                 "cannot start until a resident one ends";
        fail(msg);
        break;
      }
    }
  }
  // The launch's end makes every reduction visible (in a random order under that schedule).
  while (!s.global_pending.empty()) {
    if (!s.error.empty()) {
      s.global_pending.clear();
      break;
    }
    land_global(s.sched.random ? launch_random() % s.global_pending.size() : 0);
  }
  s.current = -1;
}

}  // namespace mhk_emu

inline cudaError_t cudaGetLastError() {
  return mhk_emu::state().error.empty() ? cudaSuccess : cudaErrorLaunchFailure;
}
