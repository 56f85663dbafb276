// CPU emulation of the sm_90 (Hopper) features the csrc/cuda/sm90/ kernels use, on top of the
// fiber emulator of cuda_emu.h: warpgroup wgmma.mma_async with its fence / commit_group /
// wait_group, mbarrier with transaction counts, cp.async.bulk.tensor from a tensor map,
// fence.proxy.async, setmaxnreg and named barriers. Semantics from the PTX ISA (sections "Asynchronous
// Warpgroup Level Matrix Multiply-Accumulate Instructions", "mbarrier", "cp.async.bulk.tensor",
// "setmaxnreg"); what the emulator cannot know for sure is marked ASSUMPTION below, and is left
// to the GPU tests.
//
// Shared addresses: the emulator's shared address of a byte is its offset from the block's
// 1024-byte aligned dynamic shared memory (dynamic_smem()); descriptors and swizzles work on it.
//
// Asynchrony, as the random schedule sees it:
//  * wgmma: the operands in shared memory are read, and the accumulators written, only at the
//    wgmma.wait_group that covers the operation (the latest moment the ISA allows). A kernel
//    that frees a stage before that wait, or reads its accumulators before it, computes wrong
//    numbers. Register operands (A) are taken at issue, as the ISA requires them unchanged
//    until the wait anyway.
//  * a tensor copy lands (writes shared memory and completes its bytes on the mbarrier) at a
//    random moment after its issue: at once with the seed's p_land_now, after any fiber slice
//    with p_land_step, and at the latest when a thread waits on its barrier. The fixed schedule
//    lands it at the first wait on its barrier (or at issue when defer_async is off).
#pragma once

#include <map>

#include "cuda_emu.h"

namespace mhk_emu {
namespace sm90 {

constexpr int kWarpgroup = 128;
constexpr int kMaxWarpgroups = 8;
constexpr int kRegisterFile = 65536;  // 32-bit registers per SM (sm_90)

// ---- tensor maps ---------------------------------------------------------------------------
// The emulator's CUtensorMap: what cuTensorMapEncodeTiled is given. Dims innermost first;
// strides[i] is the byte stride of dim i + 1 (dim 0 is dense), as in the driver API.
struct TensorMap {
  const void* base = nullptr;
  int rank = 0;
  int elem_bytes = 0;
  uint64_t dims[5] = {};
  uint64_t strides[4] = {};
  uint32_t box[5] = {};
  int swizzle_bytes = 0;  // 0 (none) or 128
};

// Validates what the driver documents for cuTensorMapEncodeTiled (16-byte aligned base and
// strides, box dims in [1, 256], the 128-byte swizzle's inner box at most 128 bytes).
// Returns an empty string or the reason.
inline std::string encode_tensor_map(TensorMap& m, const void* base, int rank, int elem_bytes, const uint64_t* dims,
                                     const uint64_t* strides, const uint32_t* box, int swizzle_bytes) {
  if (rank < 1 || rank > 5) return "tensor map: rank must be 1..5";
  if (reinterpret_cast<uintptr_t>(base) % 16) return "tensor map: global address not 16-byte aligned";
  m.base = base;
  m.rank = rank;
  m.elem_bytes = elem_bytes;
  m.swizzle_bytes = swizzle_bytes;
  for (int i = 0; i < rank; ++i) {
    if (dims[i] == 0 || dims[i] > (uint64_t{1} << 32)) return "tensor map: dim out of range";
    if (box[i] == 0 || box[i] > 256) return "tensor map: box dim must be in [1, 256]";
    m.dims[i] = dims[i];
    m.box[i] = box[i];
  }
  for (int i = 0; i + 1 < rank; ++i) {
    if (strides[i] % 16 || strides[i] >= (uint64_t{1} << 40)) return "tensor map: stride not a multiple of 16 bytes";
    m.strides[i] = strides[i];
  }
  if (swizzle_bytes != 0 && swizzle_bytes != 128) return "tensor map: only the 128-byte swizzle is emulated";
  // ASSUMPTION (documented as "inner box dim <= swizzle span"; the emulator requires equality
  // because it has no model of how a narrower box pads its rows inside the 128-byte pattern).
  if (swizzle_bytes == 128 && box[0] * elem_bytes != 128) return "tensor map: 128B swizzle needs a 128-byte inner box";
  return "";
}

// 128-byte swizzle (CU_TENSOR_MAP_SWIZZLE_128B, and the wgmma descriptor's mode 1): within each
// 1024-byte block of the shared address space, the 16-byte chunk index (address bits 4-6) is
// XORed with the 128-byte row index (bits 7-9). ASSUMPTION: the pattern is a function of the
// absolute shared address (so atoms must be 1024-byte aligned, which the emulator checks),
// and TMA and wgmma apply the same one; this is what lets a kernel advance a descriptor's
// start address by 32 bytes to step along K inside an atom.
inline uint32_t swizzle128(uint32_t addr) { return addr ^ (((addr >> 7) & 7u) << 4); }

// ---- per-block state -----------------------------------------------------------------------
struct MBarrier {
  int expected = 0;  // arrivals per phase (init count)
  int pending = 0;   // arrivals still missing in the current phase
  int64_t tx = 0;    // transaction bytes still expected in the current phase
  uint32_t phase = 0;  // completed phases; the current phase's parity is phase & 1
};

struct BulkCopy {
  uint32_t dst;  // shared address
  TensorMap map;
  int64_t coords[5];
  uint32_t bar;  // shared address of the mbarrier
};

struct WgmmaOp {
  int n = 0;
  bool bf16 = false;
  bool a_regs = false;
  float a[64][16];  // A taken at issue when from registers
  uint64_t desc_a = 0, desc_b = 0;
  bool trans_a = false;  // A from its descriptor MN-major (imm-trans-a = 1)
  bool trans_b = false;
  bool accumulate = true;
  float* acc[kWarpgroup];
  uint64_t group = 0;
};

struct WarpgroupState {
  int arrived = 0;
  uint64_t gen = 0;
  bool fenced = false;
  uint64_t committed = 0;  // commit groups so far
  std::vector<WgmmaOp> pending;
};

// A named barrier (bar.sync / bar.arrive with an id and a thread count).
struct NamedBarrier {
  int expected = 0;  // 0: not in use in the current generation
  int arrived = 0;
  uint64_t gen = 0;
};

struct Sm90State {
  std::map<uint32_t, MBarrier> bars;
  NamedBarrier named[16];
  std::vector<BulkCopy> copies;
  WarpgroupState wg[kMaxWarpgroups];
  int warp_regs[32] = {};
  int launch_regs = 0;  // per-thread registers every warp starts with (0: setmaxnreg unchecked)
  // mailboxes of the warpgroup collectives
  uint64_t desc_a[1024], desc_b[1024];
  uint32_t a_regs[1024][4];
  float* acc[1024];
  // Shared-memory operand reads of the wgmma in flight (issued, not yet covered by a
  // wgmma.wait_group), per 16-byte chunk: a tensor copy landing on a chunk with a reader is a
  // stage released before the wait that covers its last reader (wgmma reads its operands
  // asynchronously, at any moment until that wait), an error even when this schedule's copy
  // happened to land after the emulated read.
  std::vector<uint32_t> inflight;
};

inline Sm90State& st() {
  static Sm90State s;
  return s;
}

inline uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(static_cast<const unsigned char*>(p) - dynamic_smem());
}
inline unsigned char* shared_pointer(uint32_t a) { return dynamic_smem() + a; }

inline bool check_shared(uint32_t a, size_t bytes, const char* what) {
  State& s = state();
  const unsigned char* p = shared_pointer(a);
  if (p < s.smem.data() || p + bytes > s.smem.data() + s.smem.size()) {
    fail(std::string(what) + ": shared address " + std::to_string(a) + " outside the block's shared memory (thread " +
         std::to_string(s.current) + ")");
    return false;
  }
  return true;
}

// ---- mbarrier ------------------------------------------------------------------------------
inline MBarrier* find_bar(uint32_t a, const char* what) {
  auto it = st().bars.find(a);
  if (it == st().bars.end()) {
    fail(std::string(what) + ": mbarrier at shared address " + std::to_string(a) + " was never initialised (thread " +
         std::to_string(state().current) + ")");
    return nullptr;
  }
  return &it->second;
}

inline void try_complete(MBarrier& b) {
  if (b.pending == 0 && b.tx == 0) {
    ++b.phase;
    b.pending = b.expected;
    ++state().events;
  }
}

inline void mbar_init(void* p, int count) {
  const uint32_t a = shared_address(p);
  if (!check_shared(a, 8, "mbarrier.init")) return;
  if (a % 8) fail("mbarrier.init: address not 8-byte aligned");
  if (count < 1 || count > (1 << 20) - 1) fail("mbarrier.init: count out of range");
  MBarrier b;
  b.expected = b.pending = count;
  st().bars[a] = b;
  std::memset(p, 0, 8);  // the object's bytes are the barrier's, not data
}

inline void mbar_arrive_impl(uint32_t a, int64_t expect_tx, const char* what) {
  preempt_point();
  MBarrier* b = find_bar(a, what);
  if (!b) return;
  b->tx += expect_tx;
  if (b->pending == 0) {
    fail(std::string(what) + ": more arrivals than the mbarrier's count in one phase (thread " +
         std::to_string(state().current) + ")");
    return;
  }
  --b->pending;
  ++state().events;
  try_complete(*b);
}
inline void mbar_arrive(void* p) { mbar_arrive_impl(shared_address(p), 0, "mbarrier.arrive"); }
inline void mbar_arrive_expect_tx(void* p, uint32_t bytes) {
  mbar_arrive_impl(shared_address(p), bytes, "mbarrier.arrive.expect_tx");
}

// Writes one tensor copy into shared memory and completes its bytes on its barrier.
inline void land(const BulkCopy& c) {
  State& s = state();
  const TensorMap& m = c.map;
  uint64_t total = 1;
  for (int i = 0; i < m.rank; ++i) total *= m.box[i];
  const int eb = m.elem_bytes;
  std::vector<unsigned char> zero(eb, 0);
  for (uint64_t e = 0; e < total && s.error.empty(); ++e) {
    uint64_t rest = e;
    bool inside = true;
    uint64_t goff = 0;
    for (int i = 0; i < m.rank; ++i) {
      const int64_t ci = c.coords[i] + static_cast<int64_t>(rest % m.box[i]);
      rest /= m.box[i];
      if (ci < 0 || ci >= static_cast<int64_t>(m.dims[i])) inside = false;
      if (inside) goff += (i == 0 ? static_cast<uint64_t>(ci) * eb : static_cast<uint64_t>(ci) * m.strides[i - 1]);
    }
    uint32_t soff = c.dst + static_cast<uint32_t>(e * eb);
    if (m.swizzle_bytes == 128) soff = swizzle128(soff);
    if (soff / 16 < st().inflight.size() && st().inflight[soff / 16] != 0) {
      fail("cp.async.bulk.tensor writes shared memory that a wgmma in flight still reads (issued, not yet covered "
           "by a wgmma.wait_group): a stage released before the wait that covers its last reader");
      return;
    }
    unsigned char* d = shared_pointer(soff);
    // Out-of-bounds elements are zero-filled (CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), and count
    // towards the transaction bytes like the others.
    const unsigned char* src = inside ? static_cast<const unsigned char*>(m.base) + goff : zero.data();
    if (inside && !readable(src, eb)) {
      char buf[200];
      std::snprintf(buf, sizeof buf, "cp.async.bulk.tensor reads %d bytes at %p, outside every tensor the kernel may read",
                    eb, static_cast<const void*>(src));
      fail(buf);
      return;
    }
    std::memcpy(d, src, eb);
  }
  MBarrier* b = find_bar(c.bar, "cp.async.bulk.tensor complete_tx");
  if (!b) return;
  b->tx -= static_cast<int64_t>(total * eb);
  ++s.events;
  try_complete(*b);
}

inline void land_for_barrier(uint32_t bar, bool all) {
  auto& v = st().copies;
  for (size_t i = 0; i < v.size();) {
    if (v[i].bar == bar) {
      const BulkCopy c = v[i];
      v.erase(v.begin() + static_cast<long>(i));
      land(c);
      if (!all) return;
    } else {
      ++i;
    }
  }
}

// try_wait.parity: true once the phase with the given parity has completed, i.e. the current
// phase's parity differs from it (a fresh barrier is in phase 0, so waiting on parity 1 passes).
// first: the thread's first look at this wait, a switch point that counts as progress (the
// thread reached a new program point). The spinning looks after a failed one are not:
// preempt_point() there counted an event at random on every look, so that a block whose
// threads all wait on mbarriers that never complete ran forever instead of failing as a
// deadlock under the random schedule.
inline bool mbar_try_wait_parity(void* p, uint32_t parity, bool first) {
  State& s = state();
  if (first) preempt_point();
  const uint32_t a = shared_address(p);
  MBarrier* b = find_bar(a, "mbarrier.try_wait.parity");
  if (!b) return true;
  if ((b->phase & 1u) != (parity & 1u)) return true;
  record_site(s.fibers[s.current].site, "mbarrier.try_wait.parity", kFullMask);  // for a deadlock report
  // Not complete: copies bound for this barrier land now (all of them under the fixed schedule,
  // one under the random one), then the waiter looks again after the others ran.
  land_for_barrier(a, !s.sched.random);
  b = find_bar(a, "mbarrier.try_wait.parity");
  if (b && (b->phase & 1u) != (parity & 1u)) return true;
  yield();  // no event: a wait that never completes is a deadlock
  return false;
}

inline void mbar_wait_parity(void* p, uint32_t parity) {
  for (bool first = true; !mbar_try_wait_parity(p, parity, first); first = false) {
  }
}

// cp.async.bulk.tensor.Nd.shared::cluster.global.mbarrier::complete_tx::bytes
inline void tma_load(void* dst, const TensorMap* m, const int* coords, void* bar) {
  State& s = state();
  preempt_point();
  const uint32_t d = shared_address(dst);
  uint64_t bytes = m->elem_bytes;
  for (int i = 0; i < m->rank; ++i) bytes *= m->box[i];
  if (!check_shared(d, bytes, "cp.async.bulk.tensor destination")) return;
  if (m->swizzle_bytes == 128 ? d % 1024 : d % 128)
    fail("cp.async.bulk.tensor: shared destination not aligned (1024 bytes with the 128B swizzle, else 128)");
  if (!find_bar(shared_address(bar), "cp.async.bulk.tensor")) return;
  if (!s.error.empty()) return;
  BulkCopy c;
  c.dst = d;
  c.map = *m;
  for (int i = 0; i < 5; ++i) c.coords[i] = i < m->rank ? coords[i] : 0;
  c.bar = shared_address(bar);
  const bool now = s.sched.random ? chance(s.sched.p_land_now) : !s.defer_async;
  if (now)
    land(c);
  else
    st().copies.push_back(c);
}

// ---- warpgroup collectives -----------------------------------------------------------------
// Entry rendezvous of a .sync.aligned warpgroup instruction: the 128 threads of the calling
// thread's warpgroup arrive from one program point.
inline void warpgroup_collective(const char* op) {
  State& s = state();
  Fiber& me = s.fibers[s.current];
  record_site(me.site, op, kFullMask);
  const int w = s.current / kWarpgroup;
  if ((w + 1) * kWarpgroup > s.nthreads) {
    fail(std::string(op) + ": the block has no complete warpgroup for thread " + std::to_string(s.current));
    yield();
  }
  WarpgroupState& g = st().wg[w];
  const uint64_t gen = g.gen;
  ++s.events;
  if (++g.arrived == kWarpgroup) {
    const int base = kWarpgroup * w;
    for (int l = 1; l < kWarpgroup; ++l) {
      const Site& a = s.fibers[base].site;
      const Site& b = s.fibers[base + l].site;
      if (a.hash != b.hash || a.op != b.op) {
        fail("divergent warpgroup collective in block " + std::to_string(s.block) + ", warpgroup " +
             std::to_string(w) + ": its threads arrived from different program points: " +
             describe_groups(base, kWarpgroup));
        yield();
      }
    }
    g.arrived = 0;
    ++g.gen;
    return;
  }
  while (g.gen == gen) yield();
}

inline void warpgroup_sync() {
  State& s = state();
  WarpgroupState& g = st().wg[s.current / kWarpgroup];
  const uint64_t gen = g.gen;
  ++s.events;
  if (++g.arrived == kWarpgroup) {
    g.arrived = 0;
    ++g.gen;
    return;
  }
  while (g.gen == gen) yield();
}

inline bool leader() { return state().current % kWarpgroup == 0; }

// wgmma.fence.sync.aligned: orders the warpgroup's register accesses before the next
// wgmma.mma_async. The emulator requires one before every batch of mma_async that follows a
// wait (or the start), as the ISA requires it before the first mma_async and whenever the
// accumulators or A registers were touched by other instructions.
inline void wgmma_fence() {
  warpgroup_collective("wgmma.fence.sync.aligned");
  if (leader()) st().wg[state().current / kWarpgroup].fenced = true;
  warpgroup_sync();
}

// Element (row, k) of a K-major operand and (k, n) of an MN-major one in a shared-memory
// matrix descriptor (PTX ISA "Matrix Descriptor Format"): start address bits 0-13, leading
// byte offset bits 16-29, stride byte offset bits 32-45 (all >> 4), base offset bits 49-51,
// swizzle mode bits 62-63 (1 = 128B). ASSUMPTION, canonical 128B-swizzled layouts (the PTX
// ISA's figures, as CUTLASS's GmmaDescriptor comments restate them), 16-bit elements:
//   K-major:  8 rows of 128 bytes form an atom (64 elements of K per row); the next 8 rows of
//             M/N are SBO bytes further; K within the instruction's 16 stays inside one row; LBO
//             is unused.
//   MN-major: 8 rows of K, each 128 bytes holding 64 elements of M/N, form an atom; the next 8
//             rows of K are SBO bytes further, the next 64 elements of M/N LBO bytes further.
inline uint32_t desc_address(uint64_t desc, bool mn_major, int mn, int k) {
  const uint32_t start = static_cast<uint32_t>(desc & 0x3fff) << 4;
  const uint32_t lbo = static_cast<uint32_t>((desc >> 16) & 0x3fff) << 4;
  const uint32_t sbo = static_cast<uint32_t>((desc >> 32) & 0x3fff) << 4;
  uint32_t a;
  if (!mn_major)
    a = start + (mn / 8) * sbo + (mn % 8) * 128 + k * 2;
  else
    a = start + (mn / 64) * lbo + (mn % 64) * 2 + (k / 8) * sbo + (k % 8) * 128;
  return swizzle128(a);
}

inline float desc_element(uint64_t desc, bool mn_major, int mn, int k, bool bf16) {
  const uint32_t a = desc_address(desc, mn_major, mn, k);
  if (!check_shared(a, 2, "wgmma operand")) return 0.f;
  uint16_t bits;
  std::memcpy(&bits, shared_pointer(a), 2);
  return half_bits_to_float(bits, bf16);
}

inline bool check_desc(uint64_t desc) {
  if ((desc >> 62) != 1) {
    fail("wgmma: only the 128-byte swizzle descriptor mode is emulated");
    return false;
  }
  if (((desc >> 49) & 7) != 0) {
    fail("wgmma: descriptor base offset must be 0 (atoms 1024-byte aligned)");
    return false;
  }
  // The atom holding the start address must be 1024-byte aligned: the start may point into an
  // atom only by whole 16-byte K steps within the first 128-byte row.
  const uint32_t start = static_cast<uint32_t>(desc & 0x3fff) << 4;
  if ((start % 1024) >= 128) {
    fail("wgmma: descriptor start address is not within the first row of a 1024-byte aligned atom");
    return false;
  }
  return true;
}

// Counts (delta +1 at issue, -1 when performed) the shared-memory chunks an operation reads.
inline void mark_operands(const WgmmaOp& op, int delta) {
  std::vector<uint32_t>& v = st().inflight;
  const size_t chunks = (state().smem.size() + 15) / 16;
  if (v.size() < chunks) v.resize(chunks, 0);
  auto mark = [&](uint32_t a) {
    if (a / 16 < v.size()) v[a / 16] += static_cast<uint32_t>(delta);
  };
  for (int k = 0; k < 16; ++k) {
    if (!op.a_regs)
      for (int m = 0; m < 64; ++m) mark(desc_address(op.desc_a, false, m, k));
    for (int n = 0; n < op.n; ++n) mark(desc_address(op.desc_b, op.trans_b, n, k));
  }
}

inline void perform(WgmmaOp& op) {
  State& s = state();
  if (!op.a_regs && !check_desc(op.desc_a)) return;
  if (!check_desc(op.desc_b)) return;
  float A[64][16];
  if (op.a_regs) {
    std::memcpy(A, op.a, sizeof A);
  } else {
    for (int m = 0; m < 64; ++m)
      for (int k = 0; k < 16; ++k) A[m][k] = desc_element(op.desc_a, op.trans_a, m, k, op.bf16);
  }
  std::vector<float> B(16 * op.n);
  for (int k = 0; k < 16; ++k)
    for (int n = 0; n < op.n; ++n) B[k * op.n + n] = desc_element(op.desc_b, op.trans_b, n, k, op.bf16);
  if (!s.error.empty()) return;
  // Accumulator layout (PTX ISA, wgmma .m64nNk16 D fragment): thread T = 32 w + l of the
  // warpgroup, g = l / 4, t = l % 4, holds d[i] at row 16 w + g + 8 ((i % 4) / 2), column
  // 8 (i / 4) + 2 t + i % 2, for i in [0, N / 2).
  for (int T = 0; T < kWarpgroup; ++T) {
    const int w = T / 32, l = T % 32, g = l / 4, t = l % 4;
    float* d = op.acc[T];
    for (int i = 0; i < op.n / 2; ++i) {
      const int row = 16 * w + g + 8 * ((i % 4) / 2);
      const int col = 8 * (i / 4) + 2 * t + i % 2;
      float acc = op.accumulate ? d[i] : 0.f;
      for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k * op.n + col];
      d[i] = acc;
    }
  }
}

// wgmma.mma_async.sync.aligned.m64nNk16.f32.{f16,bf16}: d (N / 2 floats per thread) = A B (+ d).
// a_regs: A from registers (4 per thread, the mma.m16n8k16 A layout per warp, warp w holding
// rows 16 w..16 w + 15), else from the K-major descriptor desc_a. B from desc_b, N-major when
// trans_b (imm-trans-b = 1); A from desc_a MN-major when trans_a (imm-trans-a = 1).
inline void wgmma(float* d, int n, bool bf16, const uint32_t* a, uint64_t desc_a, uint64_t desc_b, bool trans_b,
                  bool accumulate, bool trans_a = false) {
  State& s = state();
  Sm90State& x = st();
  const int T = s.current;
  x.acc[T] = d;
  x.desc_a[T] = desc_a;
  x.desc_b[T] = desc_b;
  if (a)
    for (int i = 0; i < 4; ++i) x.a_regs[T][i] = a[i];
  warpgroup_collective(a ? "wgmma.mma_async.sync.aligned (A in registers)" : "wgmma.mma_async.sync.aligned");
  const int w = T / kWarpgroup;
  WarpgroupState& g = x.wg[w];
  if (leader()) {
    const int base = kWarpgroup * w;
    if (!g.fenced) fail("wgmma.mma_async without a wgmma.fence since the warpgroup's last wgmma.wait_group");
    if (n % 8 || n < 8 || n > 256) fail("wgmma: N must be a multiple of 8 in [8, 256]");
    for (int i = 1; i < kWarpgroup; ++i)
      if (x.desc_a[base + i] != x.desc_a[base] || x.desc_b[base + i] != x.desc_b[base])
        fail("wgmma: the threads of the warpgroup gave different descriptors");
    g.pending.emplace_back();
    WgmmaOp& op = g.pending.back();
    op.n = n;
    op.bf16 = bf16;
    op.a_regs = a != nullptr;
    op.desc_a = desc_a;
    op.desc_b = desc_b;
    op.trans_a = trans_a && a == nullptr;
    op.trans_b = trans_b;
    op.accumulate = accumulate;
    op.group = g.committed;
    for (int i = 0; i < kWarpgroup; ++i) op.acc[i] = x.acc[base + i];
    if (a) {
      // A fragment (PTX ISA, wgmma .m64nNk16 A in registers): per warp the m16n8k16 layout.
      for (int i = 0; i < kWarpgroup; ++i) {
        const uint32_t* r = x.a_regs[base + i];
        const int row = 16 * (i / 32) + (i % 32) / 4, c = 2 * (i % 4);
        const int rr[4] = {row, row + 8, row, row + 8}, cc[4] = {c, c, c + 8, c + 8};
        for (int j = 0; j < 4; ++j) {
          op.a[rr[j]][cc[j]] = bits_to_float(r[j], bf16);
          op.a[rr[j]][cc[j] + 1] = bits_to_float(r[j] >> 16, bf16);
        }
      }
    }
    mark_operands(op, +1);
  }
  warpgroup_sync();
}

inline void wgmma_commit() {
  warpgroup_collective("wgmma.commit_group.sync.aligned");
  if (leader()) ++st().wg[state().current / kWarpgroup].committed;
  warpgroup_sync();
}

// wgmma.wait_group N: all but the N most recent commit groups are complete (operations not
// committed yet are not waited for).
inline void wgmma_wait(int n) {
  warpgroup_collective("wgmma.wait_group.sync.aligned");
  if (leader()) {
    WarpgroupState& g = st().wg[state().current / kWarpgroup];
    const uint64_t limit = g.committed >= static_cast<uint64_t>(n) ? g.committed - n : 0;
    std::vector<WgmmaOp> keep;
    for (auto& op : g.pending) {
      if (op.group < limit) {
        mark_operands(op, -1);
        perform(op);
      } else
        keep.push_back(op);
    }
    g.pending.swap(keep);
    g.fenced = false;
  }
  warpgroup_sync();
}

// setmaxnreg.{inc,dec}.sync.aligned.u32 n: the warpgroup's per-thread register count becomes n.
// The emulator checks the plan: n a multiple of 8 in [24, 256], inc never lowers and dec never
// raises the count, and the block's warps never hold more than the register file
// (ASSUMPTION: one CTA per SM, as the sm_90 kernels launch; an inc that does not fit waits for
// a dec of another warpgroup, as the hardware does).
inline void setmaxnreg(int n, bool inc) {
  State& s = state();
  warpgroup_collective(inc ? "setmaxnreg.inc.sync.aligned" : "setmaxnreg.dec.sync.aligned");
  Sm90State& x = st();
  if (leader() && x.launch_regs > 0) {
    const int w0 = 4 * (s.current / kWarpgroup);
    if (n % 8 || n < 24 || n > 256) fail("setmaxnreg: count must be a multiple of 8 in [24, 256]");
    if (inc ? n < x.warp_regs[w0] : n > x.warp_regs[w0])
      fail(std::string("setmaxnreg.") + (inc ? "inc" : "dec") + " to " + std::to_string(n) + " from " +
           std::to_string(x.warp_regs[w0]) + " registers");
    for (;;) {
      int total = 0;
      for (int w = 0; w < s.nthreads / 32; ++w) total += 32 * (w / 4 == w0 / 4 ? n : x.warp_regs[w]);
      if (total <= kRegisterFile || !s.error.empty()) break;
      yield();  // wait for another warpgroup's dec (no event: never a dec is a deadlock)
    }
    for (int w = w0; w < w0 + 4; ++w) x.warp_regs[w] = n;
  }
  warpgroup_sync();
}

// bar.sync id, count / bar.arrive id, count: `count` threads (whole warps) meet at barrier id
// (1..15; 0 is __syncthreads); arrive does not wait. Every arrival of one generation must name
// the same count. The emulator counts threads (the hardware counts warps x 32: the same for
// the whole-warpgroup arrivals the kernels make).
inline void named_barrier(int id, int count, bool wait) {
  State& s = state();
  preempt_point();
  if (id < 1 || id > 15 || count % 32 || count <= 0 || count > s.nthreads) {
    fail("bar.sync/bar.arrive: id must be in [1, 15] and the count a multiple of 32 up to the block size");
    return;
  }
  record_site(s.fibers[s.current].site, wait ? "bar.sync (named barrier)" : "bar.arrive (named barrier)", kFullMask);
  NamedBarrier& nb = st().named[id];
  if (nb.expected == 0) nb.expected = count;
  if (nb.expected != count) {
    fail("named barrier " + std::to_string(id) + ": arrivals name different thread counts (" +
         std::to_string(nb.expected) + ", " + std::to_string(count) + ")");
    return;
  }
  const uint64_t gen = nb.gen;
  ++s.events;
  if (++nb.arrived == count) {
    nb.arrived = 0;
    nb.expected = 0;
    ++nb.gen;
    return;
  }
  if (wait)
    while (nb.gen == gen) yield();
}

// The per-thread register count of every warp at launch (the kernel's launch bounds allow
// floor(65536 / threads) rounded down to 8, at most 255 - ptxas may use fewer).
inline void set_launch_registers(int regs) { st().launch_regs = regs; }

inline void block_start() {
  Sm90State& x = st();
  x.bars.clear();
  x.copies.clear();
  for (auto& g : x.wg) g = WarpgroupState{};
  for (auto& nb : x.named) nb = NamedBarrier{};
  for (int& r : x.warp_regs) r = x.launch_regs;
  x.inflight.assign(x.inflight.size(), 0);
}

// Random schedule: after a fiber slice, one in-flight tensor copy may land.
inline void step() {
  State& s = state();
  Sm90State& x = st();
  if (x.copies.empty() || !chance(s.sched.p_land_step)) return;
  const size_t i = next_random() % x.copies.size();
  const BulkCopy c = x.copies[i];
  x.copies.erase(x.copies.begin() + static_cast<long>(i));
  land(c);
}

// The fused backward's section (below) adds per-block state of its own.
inline void bulk_block_start();
inline void bulk_step();
inline void block_swap(int slot);
inline void block_start_all() {
  block_start();
  bulk_block_start();
}
inline void step_all() {
  step();
  bulk_step();
}

// The multiprocessors the sm90 forward's persistent grid is sized for under emulation: few, so
// that the hard cases' small grids already loop over several work items per CTA (rings and
// barrier phases running on from item to item).
inline int& emulated_sms() {
  static int n = 2;
  return n;
}

// The sm90 forward's deliberate defect (attn_fwd_sm90_kernel.cuh MHK_SM90_FWD_FAULT): 0 none,
// 1 K's stage released before S lands, 2 V's before P V lands, 3 Q's half released before its
// products. Set by the test entry point.
inline int& fwd_fault() {
  static int f = 0;
  return f;
}

// Hooks the per-block reset, the random landing and the exchange of a resident block's state
// into the launcher (idempotent).
inline void install() {
  state().sm90_block_start = &block_start_all;
  state().sm90_step = &step_all;
  state().block_swap = &block_swap;
}

// ==== The fused backward's pieces (csrc/cuda/sm90/attn_bwd_fused_sm90_kernel.cuh) ============
// cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [dst], [src], bytes with its
// cp.async.bulk.commit_group and cp.async.bulk.wait_group{,.read} 0 (PTX ISA "cp.reduce.async.bulk"):
// an asynchronous element-wise fp32 add of `bytes` of shared memory into global memory, by one
// thread, in two phases the random schedule places independently:
//  * the read of the shared source, at a random moment after the issue (at once with the seed's
//    p_land_now, after any fiber slice with p_land_step) and at the latest at the issuing
//    thread's wait_group.read or wait_group. A kernel that lets the source be rewritten before
//    its wait_group.read adds the new contents.
//  * the adds into global memory, after the read, at a random moment (after any fiber slice of
//    any resident block, with p_land_step / 256, among the operations of every block in flight:
//    rare, as a slice is short and there are hundreds per round, so that an operation may stay
//    in flight while other blocks go on) and at the latest at the thread's wait_group (not
//    .read); never through a release (a generic-proxy release does not order the async proxy's
//    writes). A kernel that signals
//    another CTA before that wait lets the other CTA's adds land first: the fp32 sum's order,
//    and its bits, then depend on the schedule. An operation still in flight when its launch
//    ends is never performed (the sums lack it).
// ASSUMPTION (as for wgmma, the latest moment the ISA allows): the adds of one operation are
// performed together; the hardware's element order within one operation is not modelled (two
// operations never overlap in a correct kernel of this project: the deterministic mode orders
// them, the other mode accepts any order).
// Resident blocks (cuda_emu.h's concurrent blocks): each slot keeps its own Sm90State and commit
// counts, exchanged by block_swap; the operations in flight are one list for the launch.
struct BulkReduce {
  float* dst = nullptr;
  uint32_t src = 0;  // shared address
  uint32_t bytes = 0;
  int64_t block = 0;
  int thread = 0;
  uint64_t group = 0;  // the issuing thread's commit group
  bool read = false;
  uint64_t launch = 0;
  std::vector<float> data;  // the source, once read
};

struct BulkState {
  std::vector<uint64_t> committed = std::vector<uint64_t>(1024, 0);  // per thread of the block
};

inline BulkState& bulk() {  // the running block's
  static BulkState b;
  return b;
}
inline std::vector<BulkReduce>& bulk_ops() {  // issued, not yet performed (every block's)
  static std::vector<BulkReduce> v;
  return v;
}
inline uint64_t& bulk_launch() {  // launches so far (bulk_block_start)
  static uint64_t n = 0;
  return n;
}

inline void bulk_read(BulkReduce& op) {
  if (op.read) return;
  op.data.resize(op.bytes / 4);
  std::memcpy(op.data.data(), shared_pointer(op.src), op.bytes);
  op.read = true;
  ++state().events;
}

inline void bulk_perform(BulkReduce& op) {
  bulk_read(op);
  for (size_t i = 0; i < op.data.size(); ++i) op.dst[i] += op.data[i];
  ++state().events;  // a landing can satisfy a waiting block
}

inline void bulk_reduce_add_f32(float* dst, const void* src, uint32_t bytes) {
  State& s = state();
  preempt_point();
  const uint32_t a = shared_address(src);
  if (bytes == 0 || bytes % 16 || a % 16 || reinterpret_cast<uintptr_t>(dst) % 16)
    fail("cp.reduce.async.bulk: size, shared and global addresses must be multiples of 16 bytes");
  if (!check_shared(a, bytes, "cp.reduce.async.bulk source") || !s.error.empty()) return;
  BulkReduce op;
  op.dst = dst;
  op.src = a;
  op.bytes = bytes;
  op.block = s.block;
  op.thread = s.current;
  op.group = bulk().committed[s.current];
  op.launch = bulk_launch();
  if (!s.sched.random) {
    if (!s.defer_async) bulk_perform(op);
    else bulk_ops().push_back(op);
    return;
  }
  if (chance(s.sched.p_land_now)) bulk_read(op);
  bulk_ops().push_back(op);
}

inline void bulk_commit() { ++bulk().committed[state().current]; }

// cp.async.bulk.wait_group[.read] 0: every committed operation of the calling thread has read its
// source (read_only) or completed.
inline void bulk_wait(bool read_only) {
  State& s = state();
  preempt_point();
  auto& v = bulk_ops();
  const uint64_t limit = bulk().committed[s.current];
  for (size_t i = 0; i < v.size();) {
    if (v[i].block == s.block && v[i].thread == s.current && v[i].group < limit) {
      if (read_only) {
        bulk_read(v[i]);
      } else {
        bulk_perform(v[i]);
        v.erase(v.begin() + static_cast<long>(i));
        continue;
      }
    }
    ++i;
  }
}

// Random schedule: after a fiber slice, one operation in flight may advance a phase: a read
// (only the running block's: its shared memory is the one swapped in) or, rarely, the adds of
// any block's read operation.
inline void bulk_step() {
  State& s = state();
  auto& v = bulk_ops();
  if (v.empty() || !chance(s.sched.p_land_step)) return;
  const size_t i = next_random() % v.size();
  if (!v[i].read) {
    if (v[i].block == s.block) bulk_read(v[i]);
  } else if (next_random() % 256 == 0) {
    bulk_perform(v[i]);
    v.erase(v.begin() + static_cast<long>(i));
  }
}

// A new launch drops what an earlier one left in flight (its sums lacked it: a failed launch, or
// a kernel without its final wait_group); each block starts with no commit group.
inline void bulk_block_start() {
  if (state().block == 0) {  // block 0 starts every launch first
    ++bulk_launch();
    auto& v = bulk_ops();
    v.erase(std::remove_if(v.begin(), v.end(), [](const BulkReduce& op) { return op.launch != bulk_launch(); }),
            v.end());
  }
  std::fill(bulk().committed.begin(), bulk().committed.end(), 0);
}

// The deliberate bug the fused backward's next launches make (BwdFusedParamsSm90::fault; 0 none).
inline int& fused_bwd_fault() {
  static int f = 0;
  return f;
}

inline void block_swap(int slot) {
  static std::vector<Sm90State> sm90_slots;
  static std::vector<BulkState> bulk_slots;
  if (static_cast<int>(sm90_slots.size()) <= slot) {
    sm90_slots.resize(slot + 1);
    bulk_slots.resize(slot + 1);
  }
  // The register plan is the launch's (set before it), not a block's.
  const int regs = st().launch_regs;
  std::swap(st(), sm90_slots[slot]);
  st().launch_regs = sm90_slots[slot].launch_regs = regs;
  std::swap(bulk(), bulk_slots[slot]);
}

}  // namespace sm90
}  // namespace mhk_emu
