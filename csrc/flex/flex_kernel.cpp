// The cpu kernel of mhakern.flex_attention, one instance per traced modifier: mhakern/flex/graph.py
// writes the modifier's C++ (score_fwd, score_bwd, mask_fn and the constants below) in place of the
// generated-code marker line, and mhakern/flex/build.py compiles the result once per graph,
// instruction set and build into a shared library called through ctypes (plain C entry points:
// no Python per tile, no pybind to compile).
//
// Structure of the cpu attention kernel (csrc/cpu/kernel/forward.h, backward.h): per task a
// block of query rows, scores as the transposed tile S^T (keys x rows) from the same register
// -blocked gemm, an online softmax in base 2, the output accumulator O^T rescaled inside the
// gemm. The key blocks come from torch's BlockMask: per (batch, head, query block) a list of
// partial blocks (mask_fn evaluated per element) and of full blocks (mask_fn skipped); a block
// in neither list is never read. The backward recomputes the probabilities from lse in one pass
// over (batch, KV head, key range) tasks, as backward.h does, with the transposed block lists:
// dK and dV owned by the task, dQ into per-key-range partials summed in range order, the
// captured tables' gradients into per-chunk buffers summed chunk by chunk. Every sum runs in a
// fixed order, so the results are bit-identical run to run for a given thread count.
//
// What does not depend on the modifier -- the gemm, the softmax step, 2^x, the dtype
// conversions -- is mhakern._C's flex runtime table (csrc/cpu/flex_runtime.h), passed in
// FlexArgs::rt: this unit includes no ATen header and instantiates no gemm, so it compiles in
// about a second (with them: 5 to 7 s, most of a first call). Threads: OpenMP, as many as
// torch's intra-op setting (FlexArgs::nthreads).
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <new>
#include <stdexcept>
#include <vector>

#include "flex_runtime.h"
#include "kernel/scalar.h"

namespace mhakern::cpu {
namespace CPU_CAPABILITY {
namespace flex {

// The captured tensors a modifier reads, as the generated code indexes them: data (float32 or
// int64, contiguous) and up to 4 sizes each.
struct Caps {
  const void* const* ptr;
  const int64_t* size;  // [ncap * 4]
};

inline int64_t wrap_index(int64_t i, int64_t n) { return i < 0 ? i + n : i; }
inline float fsign(float x) { return (x > 0.f) - (x < 0.f); }
inline int64_t py_floordiv(int64_t a, int64_t b) {
  const int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
inline int64_t py_mod(int64_t a, int64_t b) {
  const int64_t r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
inline float py_fmod(float a, float b) {
  const float r = std::fmod(a, b);
  return (r != 0.f && ((r < 0.f) != (b < 0.f))) ? r + b : r;
}

// MHK_FLEX_GENERATED

}  // namespace flex

using flex::Caps;

// The argument record, mirrored field for field by mhakern/flex/api.py (ctypes).
struct FlexArgs {
  int64_t dtype;  // flex_rt::kFloat32 or kBFloat16: q, k, v, dout, out, dq, dk, dv
  int64_t B, H, Hkv, Lq, Lk, D, Dv;
  double scale;
  const void *q, *k, *v, *dout;
  void *out, *dq, *dk, *dv;
  float* lse;           // (B, H, Lq) contiguous
  const float* delta;   // (B, H, Lq) contiguous: rowsum(dout * out), for the backward
  int64_t qs[3], ks[3], vs[3], os[3], dos[3], dqs[3], dks[3], dvs[3];  // (batch, head, row) strides
  // The BlockMask (int32, contiguous): per (mask batch, mask head, row block) the count and the
  // indices of partial and of full key blocks, and per key block the same for row blocks.
  int64_t QBS, KVBS, mB, mH, nqb, nkb;
  const int32_t *kv_num, *kv_idx, *fkv_num, *fkv_idx;  // fkv_* may be null
  int64_t kv_w, fkv_w;                                 // last-dim widths of the index tensors
  const int32_t *q_num, *q_idx, *fq_num, *fq_idx;
  int64_t q_w, fq_w;
  const void* const* cap_ptr;
  const int64_t* cap_size;
  float* const* cap_grad;  // per capture: its float32 gradient (zeroed), or null
  const int64_t* cap_numel;
  int64_t ncap;
  const flex_rt::Runtime* rt;  // mhakern._C's table for this instruction set
  int64_t nthreads;            // torch's intra-op thread count
  // 1 when mask_mod reads that argument (mhakern/flex/graph.py, reads): a mask that reads
  // neither h nor b is evaluated once per partial block for all heads (MaskCache).
  int64_t mask_reads_b, mask_reads_h;
  char err[256];
};

namespace {

constexpr int64_t kRows = 64;         // query rows per task (as the cpu kernel's kRowBlock)
constexpr int64_t kRowsPartial = 32;  // where partial blocks are common: their dead keys are trimmed per task
constexpr int64_t kKeys = 128;  // keys per step (its kKeyBlock)
enum GemmMode : int64_t { kStore = 0, kAccumulate = 1, kRescale = 2 };  // flex_rt::Runtime::gemm

// A thread's scratch: 64-byte aligned floats handed out in whole cache lines, uninitialised
// (every tile is written before it is read).
class Scratch {
 public:
  explicit Scratch(int64_t n) : n_(std::max<int64_t>(n, 1)) {
    p_ = static_cast<float*>(::operator new[](n_ * sizeof(float), std::align_val_t(64)));
  }
  ~Scratch() { ::operator delete[](p_, std::align_val_t(64)); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  float* take(int64_t n) {
    float* r = p_ + used_;
    used_ += round_up(std::max<int64_t>(n, 0), 16);
    if (used_ > n_) throw std::runtime_error("flex kernel: scratch overflow");
    return r;
  }

 private:
  int64_t n_, used_ = 0;
  float* p_ = nullptr;
};

// Runs body(thread) on nthreads OpenMP threads; the first exception of any thread is rethrown
// here (one escaping an OpenMP region would end the process).
template <typename F>
void parallel(int64_t nthreads, F&& body) {
  std::exception_ptr err;
  std::atomic<bool> failed{false};
#pragma omp parallel num_threads(static_cast<int>(std::max<int64_t>(nthreads, 1)))
  {
    try {
      body(static_cast<int64_t>(omp_get_thread_num()), static_cast<int64_t>(omp_get_num_threads()));
    } catch (...) {
      if (!failed.exchange(true)) err = std::current_exception();
    }
  }
  if (err) std::rethrow_exception(err);
}

// src (rows x cols, ld sld) -> dst (cols x ldd), columns >= rows up to ldd zeroed.
void transpose_pad(const float* src, int64_t sld, int64_t rows, int64_t cols, float* dst, int64_t ldd) {
  for (int64_t c = 0; c < cols; ++c) {
    float* d = dst + c * ldd;
    for (int64_t r = 0; r < rows; ++r) d[r] = src[r * sld + c];
    for (int64_t r = rows; r < ldd; ++r) d[r] = 0.f;
  }
}

struct BlockList {
  const int32_t* idx;
  int64_t n;
};

inline BlockList blocks(const int32_t* num, const int32_t* idx, int64_t w, int64_t mb, int64_t mh, int64_t mH,
                        int64_t nrow, int64_t row) {
  if (num == nullptr) return {nullptr, 0};
  const int64_t at = (mb * mH + mh) * nrow + row;
  return {idx + at * w, num[at]};
}

inline int64_t elem_size(int64_t dtype) { return dtype == flex_rt::kBFloat16 ? 2 : 4; }

inline const char* at_row(const void* base, int64_t dtype, int64_t offset) {
  return static_cast<const char*>(base) + offset * elem_size(dtype);
}

// n key rows (row stride sl) as fp32: in place for float32 inputs, else converted into `buf`.
inline const float* key_rows(const flex_rt::Runtime& rt, int64_t dtype, const void* base, int64_t sl, int64_t n,
                             int64_t D, float* buf, int64_t* ld) {
  if (dtype == flex_rt::kFloat32) {
    *ld = sl;
    return static_cast<const float*>(base);
  }
  rt.load_rows(dtype, base, sl, n, D, 1.f, buf, D);
  *ld = D;
  return buf;
}

// mask_fn over a partial block's transposed tile (bk keys x R rows, rows q0 .., keys j0 ..):
// vis[j * Rp + r] = 1 where visible. Returns the keys [*jlo, *jhi) that some row sees, so the
// products skip the block's dead keys (a document boundary cuts most partial blocks in two:
// without the trim a document mask computed 1.2x the pairs attention_varlen does), and whether
// every row sees every one of those keys (*dense: then the tile needs no mask pass).
// Not inlined: its callers (a cache slot, a task's own tile) would each compile the
// vectorized mask loops again, and a call per tile costs nothing measurable.
template <typename Mod>
__attribute__((noinline)) void mask_tile_t(bool* vis, int64_t Rp, int64_t R, int64_t bk, int64_t b, int64_t h, int64_t q0,
                          int64_t j0, const Caps& caps, int64_t* jlo, int64_t* jhi, bool* dense) {
  int64_t lo = bk, hi = 0, seen = 0;
  for (int64_t j = 0; j < bk; ++j) {
    bool* __restrict vp = vis + j * Rp;
    const int64_t kv = j0 + j;
    // Two loops, each one the compiler vectorizes (mask_fn's capture reads become gathers).
    // bool, not uint8_t: a store through a character type may alias the captures' pointers
    // and sizes, which then are reloaded per element and the loop stays scalar.
#pragma omp simd
    for (int64_t r = 0; r < R; ++r) vp[r] = Mod::mask_fn(b, h, q0 + r, kv, caps);
    int64_t cnt = 0;
    for (int64_t r = 0; r < R; ++r) cnt += vp[r];
    if (cnt) {
      lo = std::min(lo, j);
      hi = j + 1;
      seen += cnt;
    }
  }
  *jlo = lo;
  *jhi = hi;
  *dense = hi > lo && seen == (hi - lo) * R;
}

// The modifiers on a transposed score tile S^T (bk keys x Rp rows; rows q0 .., keys j0 ..):
// score_mod times `post`, then where `vis` is given (a partial block) its hidden pairs -inf,
// and -inf in the padding rows. Separate loops of plain selects over contiguous rows, so the
// compiler vectorizes them (one branchy loop ran the mask at a third of the speed).
template <typename Mod>
MHK_STEP void mods_tile_t(float* st, int64_t Rp, int64_t R, int64_t bk, int64_t b, int64_t h, int64_t q0, int64_t j0,
                          const bool* vis, const Caps& caps, float post) {
  for (int64_t j = 0; j < bk; ++j) {
    float* __restrict sp = st + j * Rp;
    const int64_t kv = j0 + j;
    if constexpr (Mod::kHasScoreMod) {
      for (int64_t r = 0; r < R; ++r) sp[r] = Mod::score_fwd(sp[r], b, h, q0 + r, kv, caps) * post;
    }
    if (vis != nullptr) {
      // Read as bytes: GCC vectorizes no select on a bool (a branch and a store per masked
      // score, 3% of the causal forward on one thread), it does on unsigned char.
      const unsigned char* __restrict vp = reinterpret_cast<const unsigned char*>(vis + j * Rp);
      for (int64_t r = 0; r < R; ++r) sp[r] = vp[r] ? sp[r] : kNegInf;
    }
    for (int64_t r = R; r < Rp; ++r) sp[r] = kNegInf;
  }
}

// The mask tiles of the partial blocks, computed once for all query heads when mask_mod does
// not read h and the BlockMask is the same for every head (document masks, causal, prefix-LM):
// with 8 heads, evaluating mask_mod per head cost a fifth of a document-masked forward.
// A slot per (cache batch, row block, partial block of its list, tile of the block): the
// tile's visibility (layout given by the pass), its live key range [jlo, jhi) and live row
// range [rlo, rhi), and whether those rows see all those keys (dense: no mask pass). Cache
// batch cb: b when mask_mod reads b, else the BlockMask's batch. Tiles of a row block lie
// at `first[cb * nrow + row]` onwards. Bounded by kMaxBytes, else each task evaluates its own.
// A slot is filled by the first task that needs it (no pass of its own: a barrier more, which
// costs when the machine is shared); a task that finds it being filled computes its own copy
// (the same values), so no task waits.
struct TileInfo {
  int64_t jlo, jhi, rlo, rhi;
  bool dense;
};

struct MaskCache {
  static constexpr int64_t kMaxBytes = int64_t{64} << 20;
  enum : uint8_t { kEmpty = 0, kFilling = 1, kReady = 2 };
  bool on = false;
  int64_t cB = 0, per_block = 0, tile_bytes = 0;
  std::vector<int64_t> first;  // (cB * nrow + 1) prefix sums of the lists' partial counts, in tiles
  std::unique_ptr<bool[]> vis;  // (not std::vector<bool>: that one packs bits)
  std::unique_ptr<TileInfo[]> info;
  std::unique_ptr<std::atomic<uint8_t>[]> state;

  // Lists num[(mb * mH + 0) * nrow + row]; per_block tiles of tile_bytes per partial block.
  bool plan(const FlexArgs& a, const int32_t* num, int64_t nrow, int64_t tiles_per_block, int64_t bytes) {
    if (a.mask_reads_h || a.mH != 1 || a.H <= 1 || num == nullptr) return false;
    cB = a.mask_reads_b ? a.B : a.mB;
    per_block = tiles_per_block;
    tile_bytes = bytes;
    first.assign(cB * nrow + 1, 0);
    for (int64_t cb = 0; cb < cB; ++cb)
      for (int64_t row = 0; row < nrow; ++row) {
        const int64_t mb = a.mB == 1 ? 0 : cb, e = cb * nrow + row;
        first[e + 1] = first[e] + num[mb * nrow + row] * per_block;
      }
    const int64_t ntiles = first.back();
    if (ntiles == 0 || ntiles * tile_bytes > kMaxBytes) return false;
    vis.reset(new bool[ntiles * tile_bytes]);
    info.reset(new TileInfo[ntiles]);
    state.reset(new std::atomic<uint8_t>[ntiles]());
    on = true;
    return true;
  }
  int64_t cache_batch(const FlexArgs& a, int64_t b) const { return a.mask_reads_b ? b : (a.mB == 1 ? 0 : b); }

  // Tile `tile` of partial block n of the list of (cb, row): its visibility in *tile_vis and
  // its TileInfo; fill(vis, info) computes them (for cache batch cb and head 0), into the cache
  // or, while another task fills the slot, into `own_vis` and `own`.
  template <typename Fill>
  const TileInfo* get(int64_t cb, int64_t nrow, int64_t row, int64_t n, int64_t tile, bool* own_vis, TileInfo* own,
                      const bool** tile_vis, Fill&& fill) {
    const int64_t sl = first[cb * nrow + row] + n * per_block + tile;
    bool* v = vis.get() + sl * tile_bytes;
    uint8_t s = state[sl].load(std::memory_order_acquire);
    if (s == kReady) {
      *tile_vis = v;
      return &info[sl];
    }
    const bool mine = s == kEmpty && state[sl].compare_exchange_strong(s, kFilling, std::memory_order_acq_rel);
    TileInfo* t = mine ? &info[sl] : own;
    bool* dst = mine ? v : own_vis;
    *tile_vis = dst;
    fill(dst, t);
    if (mine) state[sl].store(kReady, std::memory_order_release);
    return t;
  }
};

// mask_fn over a partial block's slice in the backward's layout (R rows x bk keys, rows q0 ..,
// keys j0 ..): vis[r * ld + j]. The rows that see some key, [rlo, rhi), the keys some row sees,
// [jlo, jhi) (a document boundary leaves a block's rows and keys of the other document dead),
// and whether those rows see all those keys.
template <typename Mod>
__attribute__((noinline)) void mask_slice(bool* vis, int64_t ld, int64_t R, int64_t bk, int64_t b, int64_t h, int64_t q0,
                         int64_t j0, const Caps& caps, TileInfo* ti) {
  int64_t rlo = R, rhi = 0, jlo = bk, jhi = 0, seen = 0;
  for (int64_t r = 0; r < R; ++r) {
    bool* __restrict vp = vis + r * ld;
#pragma omp simd
    for (int64_t j = 0; j < bk; ++j) vp[j] = Mod::mask_fn(b, h, q0 + r, j0 + j, caps);
    int64_t first = bk, last = -1, cnt = 0;
    for (int64_t j = 0; j < bk; ++j)
      if (vp[j]) {
        first = std::min(first, j);
        last = j;
        ++cnt;
      }
    if (last >= 0) {
      rlo = std::min(rlo, r);
      rhi = r + 1;
      jlo = std::min(jlo, first);
      jhi = std::max(jhi, last + 1);
      seen += cnt;
    }
  }
  ti->rlo = rlo;
  ti->rhi = rhi;
  ti->jlo = jlo;
  ti->jhi = jhi;
  ti->dense = rhi > rlo && seen == (rhi - rlo) * (jhi - jlo);
}

template <typename Mod>
void forward(const FlexArgs& a) {
  const flex_rt::Runtime& rt = *a.rt;
  const Caps caps{a.cap_ptr, a.cap_size};
  const int64_t VL = rt.vl, dt = a.dtype;
  const int64_t D = a.D, Dv = a.Dv, QBS = a.QBS, KVBS = a.KVBS, n_rep = a.H / a.Hkv;
  // Smaller row tasks when partial blocks are common: a partial block's keys are trimmed to
  // those its task's rows see, and 32 rows cut more than 64 (document masks of 8 x 1k tokens,
  // a third of the blocks partial: 0.93x attention_varlen against 0.80x); where few blocks are
  // partial 64 rows are faster (causal, one partial block in 8.5: 0.93x attention(causal=True)
  // against 0.88x at 32, medians of three same-session runs each).
  int64_t npart = 0, nfull = 0;
  for (int64_t e = 0; e < a.mB * a.mH * a.nqb; ++e) {
    npart += a.kv_num[e];
    if (a.fkv_num != nullptr) nfull += a.fkv_num[e];
  }
  const bool has_partial = npart > 0;
  const int64_t RB = std::min(QBS, 4 * npart > npart + nfull ? kRowsPartial : kRows), nsub = ceil_div(QBS, RB);
  const int64_t KB = std::min(KVBS, kKeys);
  const int64_t Rmax = round_up(RB, VL), Dp = round_up(D, VL), Dvp = round_up(Dv, VL), Dv8 = round_up(Dv, 8);
  const int64_t ntask = a.B * a.H * a.nqb * nsub;
  // Scores in natural units for the modifier; without one, Q carries log2(e) and the tile
  // needs no pass before the softmax.
  const float qmul = static_cast<float>(a.scale) * (Mod::kHasScoreMod ? 1.f : kLog2e);

  // Tasks are taken from a shared counter, kUnit at a time, the last first: a head's row blocks
  // run in a row (its K and V stay in cache; heads innermost, which let the heads share a
  // row block's mask tiles, ran 0.83x attention(causal=True) against 0.93x), and under a
  // causal mask the last row blocks are the heaviest (a static split of the task range gave one
  // thread three quarters of the work). Each task writes only its own rows, so the order
  // changes no bit of the result.
  // The partial blocks' mask tiles of all heads at once, when they are the same for all heads:
  // per (row block, partial block) its nsub x nstep tiles, as each task would compute them.
  const int64_t nstep = ceil_div(KVBS, KB);
  MaskCache mc;
  if (has_partial) mc.plan(a, a.kv_num, a.nqb, nsub * nstep, KB * Rmax);

  constexpr int64_t kUnit = 4;
  const int64_t nunit = ceil_div(ntask, kUnit);
  std::atomic<int64_t> next{0};
  parallel(std::min(a.nthreads, nunit), [&](int64_t, int64_t) {
    // 11 pieces, each rounded up to 16 floats by take().
    Scratch s(Rmax * Dp * 2 + KB * Rmax + Dvp * Rmax + 3 * Rmax + KB * (D + Dv) + KB * Rmax / 4 + 1 + Rmax * Dvp +
              16 * 11);
    float* qr = s.take(Rmax * Dp);
    float* qt = s.take(Dp * Rmax);
    float* st = s.take(KB * Rmax);
    float* ot = s.take(Dvp * Rmax);  // rows Dv .. Dv8 are transposed with the rest, never read back
    float* m = s.take(Rmax);
    float* l = s.take(Rmax);
    float* alpha = s.take(Rmax);
    float* kc = s.take(KB * D);
    float* vc = s.take(KB * Dv);
    bool* vis = reinterpret_cast<bool*>(s.take(KB * Rmax / 4 + 1));
    float* orows = s.take(Rmax * Dvp);  // O as rows
    for (int64_t unit; (unit = next.fetch_add(1)) < nunit;)
    for (int64_t t = std::min(ntask, (nunit - unit) * kUnit) - 1; t >= (nunit - 1 - unit) * kUnit; --t) {
      const int64_t sub = t % nsub, qb = (t / nsub) % a.nqb, h = (t / (nsub * a.nqb)) % a.H;
      const int64_t b = t / (nsub * a.nqb * a.H), hkv = h / n_rep, q0 = qb * QBS + sub * RB;
      if (q0 >= std::min(a.Lq, (qb + 1) * QBS)) continue;
      const int64_t R = std::min({RB, a.Lq - q0, (qb + 1) * QBS - q0}), Rp = round_up(R, VL);
      const int64_t mb = a.mB == 1 ? 0 : b, mh = a.mH == 1 ? 0 : h;
      rt.load_rows(dt, at_row(a.q, dt, b * a.qs[0] + h * a.qs[1] + q0 * a.qs[2]), a.qs[2], R, D, qmul, qr, Dp);
      std::fill(qr + R * Dp, qr + Rp * Dp, 0.f);
      rt.transpose(qr, Dp, qt, Rp, Rp, Dp);  // whole 8x8 tiles (a scalar loop here cost 1-2%)
      for (int64_t r = 0; r < Rp; ++r) {
        m[r] = kNegInf;
        l[r] = 0.f;
      }
      bool first = true;  // no key step yet: O^T is 0, its product is stored, not rescaled
      const int64_t koff = b * a.ks[0] + hkv * a.ks[1], voff = b * a.vs[0] + hkv * a.vs[1];
      const BlockList lists[2] = {blocks(a.kv_num, a.kv_idx, a.kv_w, mb, mh, a.mH, a.nqb, qb),
                                  blocks(a.fkv_num, a.fkv_idx, a.fkv_w, mb, mh, a.mH, a.nqb, qb)};
      const int64_t cb = mc.on ? mc.cache_batch(a, b) : 0;
      for (int li = 0; li < 2; ++li) {
        const bool partial = li == 0;
        for (int64_t n = 0; n < lists[li].n; ++n) {
          const int64_t jb = int64_t(lists[li].idx[n]) * KVBS, jend = std::min(jb + KVBS, a.Lk);
          // A block mask's key block in steps of at most kKeys keys (the tile stays in L1/L2).
          for (int64_t jstep = jb, step = 0; jstep < jend; jstep += KB, ++step) {
            int64_t j0 = jstep, bk = std::min(KB, jend - jstep);
            const bool* tvis = nullptr;
            if (partial) {
              TileInfo own;
              const TileInfo* ti = &own;
              const bool* tile = vis;
              if (mc.on) {
                ti = mc.get(cb, a.nqb, qb, n, sub * nstep + step, vis, &own, &tile, [&](bool* v, TileInfo* t) {
                  mask_tile_t<Mod>(v, Rp, R, bk, cb, 0, q0, j0, caps, &t->jlo, &t->jhi, &t->dense);
                });
              } else {
                mask_tile_t<Mod>(vis, Rp, R, bk, b, h, q0, j0, caps, &own.jlo, &own.jhi, &own.dense);
              }
              if (ti->jlo >= ti->jhi) continue;  // no row of this task sees these keys
              tvis = ti->dense ? nullptr : tile + ti->jlo * Rp;
              j0 += ti->jlo;
              bk = ti->jhi - ti->jlo;
            }
            int64_t ldk = 0, ldv = 0;
            const float* Kb = key_rows(rt, dt, at_row(a.k, dt, koff + j0 * a.ks[2]), a.ks[2], bk, D, kc, &ldk);
            rt.gemm(kStore, bk, Rp, D, Kb, ldk, 1, qt, Rp, st, Rp, nullptr);  // S^T = K Q^T
            if (Mod::kHasScoreMod || tvis != nullptr || R < Rp)
              mods_tile_t<Mod>(st, Rp, R, bk, b, h, q0, j0, tvis, caps, kLog2e);
            rt.softmax_step(st, Rp, bk, m, l, alpha);
            const float* Vb = key_rows(rt, dt, at_row(a.v, dt, voff + j0 * a.vs[2]), a.vs[2], bk, Dv, vc, &ldv);
            rt.gemm(first ? kStore : kRescale, Dv, Rp, bk, Vb, 1, ldv, st, Rp, ot, Rp, alpha);  // O^T = a O^T + V^T P^T
            first = false;
          }
        }
      }
      if (first) std::fill(ot, ot + Dv8 * Rp, 0.f);  // no key visible to any row
      rt.transpose(ot, Rp, orows, Dvp, Dv8, Rp);        // as the Q tile: a strided read per row cost 1-2%
      char* o = static_cast<char*>(a.out) + (b * a.os[0] + h * a.os[1] + q0 * a.os[2]) * elem_size(dt);
      float* lse = a.lse + (b * a.H + h) * a.Lq + q0;
      for (int64_t r = 0; r < R; ++r) {
        // A row that saw no key: output 0, lse -inf (docs/contract.md).
        const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
        const float* src = orows + r * Dvp;
        if (dt == flex_rt::kFloat32) {  // inline (a call per row cost 1-2%)
          float* orf = reinterpret_cast<float*>(o) + r * a.os[2];
          for (int64_t d = 0; d < Dv; ++d) orf[d] = src[d] * inv;
        } else {
          rt.store_row(dt, src, Dv, inv, o + r * a.os[2] * elem_size(dt));
        }
        lse[r] = l[r] > 0.f ? (m[r] + std::log2(l[r])) * kLn2 : kNegInf;
      }
    }
  });
}

// lse of a row as the backward uses it: +inf for a row with no visible key, so that every
// exp(s - lse) there is 0.
inline float lse_use(float x) { return x == kNegInf ? std::numeric_limits<float>::infinity() : x; }

// The backward in one pass over (batch, KV head, key range) tasks, as the cpu kernel's
// backward.h: per key block of the range, over the query heads of the group and the row blocks
// the transposed lists name (partial, then full), P is recomputed from lse and dV, dK (owned by
// the task) and dQ accumulate; dQ goes to the key range's float32 partial (rows padded to Dp),
// and the partials are summed range by range at the end. The captured tables' gradients go to
// one buffer per chunk of tasks, summed chunk by chunk. Every sum has a fixed order.
template <typename Mod>
void backward(const FlexArgs& a) {
  const flex_rt::Runtime& rt = *a.rt;
  const Caps caps{a.cap_ptr, a.cap_size};
  const int64_t VL = rt.vl, dt = a.dtype;
  const int64_t D = a.D, Dv = a.Dv, QBS = a.QBS, KVBS = a.KVBS, n_rep = a.H / a.Hkv;
  const int64_t Kp = round_up(KVBS, VL), Dp = round_up(D, VL), Dvp = round_up(Dv, VL);
  const float scale = static_cast<float>(a.scale);
  // Key ranges: enough tasks for the threads (4 per thread), within 256 MiB of dQ partials.
  const int64_t nthr = std::max<int64_t>(a.nthreads, 1), groups = a.B * a.Hkv;
  const int64_t part_floats = a.B * a.H * a.Lq * Dp;
  int64_t nsplit = std::min<int64_t>(a.nkb, ceil_div(4 * nthr, std::max<int64_t>(groups, 1)));
  nsplit = std::max<int64_t>(1, std::min<int64_t>(nsplit, (int64_t{1} << 26) / std::max<int64_t>(part_floats, 1)));
  std::vector<float> dq_part(nsplit * part_floats, 0.f);
  const int64_t ntask = groups * nsplit;
  int64_t gsize = 0;
  std::vector<int64_t> goff(a.ncap + 1, 0);
  for (int64_t c = 0; c < a.ncap; ++c) {
    goff[c] = gsize;
    if (a.cap_grad[c] != nullptr) gsize += a.cap_numel[c];
  }
  // The chunks (and so the order of the tables' gradient sums) depend on the thread count
  // only, not on which thread takes which.
  const int64_t nchunk = std::max<int64_t>(1, std::min<int64_t>(ntask, nthr));
  std::vector<float> gbuf(Mod::kHasCapGrad ? nchunk * gsize : 0, 0.f);
  // The partial blocks' mask slices of all heads at once (MaskCache): per (key block, partial
  // row block) its slices of kRowsPartial rows.
  MaskCache mc;
  mc.plan(a, a.q_num, a.nkb, ceil_div(QBS, kRowsPartial), kRowsPartial * Kp);
  std::atomic<int64_t> next_chunk{0};
  parallel(nchunk, [&](int64_t, int64_t) {
    Scratch s(KVBS * (Dp + Dvp) * 2 + Dp * Kp + Dvp * Kp + QBS * (Dp + Dvp) + 4 * QBS * Kp + 2 * QBS + QBS * Kp / 4 + 1 +
              16 * 15);
    float* kr = s.take(KVBS * Dp);
    float* kt = s.take(Dp * Kp);
    float* vr = s.take(KVBS * Dvp);
    float* vt = s.take(Dvp * Kp);
    float* dk = s.take(KVBS * Dp);
    float* dv = s.take(KVBS * Dvp);
    float* qs = s.take(QBS * Dp);
    float* dor = s.take(QBS * Dvp);
    float* sc = s.take(QBS * Kp);
    float* pp = s.take(QBS * Kp);
    float* dp = s.take(QBS * Kp);
    float* lr = s.take(QBS);
    float* dl = s.take(QBS);
    bool* vis = reinterpret_cast<bool*>(s.take(QBS * Kp / 4 + 1));
    std::vector<float*> gcap(a.ncap + 1, nullptr);
    for (int64_t chunk; (chunk = next_chunk.fetch_add(1)) < nchunk;) {
      for (int64_t c = 0; c < a.ncap; ++c)
        gcap[c] = a.cap_grad[c] != nullptr && Mod::kHasCapGrad ? gbuf.data() + chunk * gsize + goff[c] : nullptr;
      for (int64_t t = chunk * ntask / nchunk; t < (chunk + 1) * ntask / nchunk; ++t) {
        const int64_t split = t % nsplit, hkv = (t / nsplit) % a.Hkv, b = t / (nsplit * a.Hkv);
        float* dqp = dq_part.data() + split * part_floats;
        const int64_t mb = a.mB == 1 ? 0 : b, cb = mc.on ? mc.cache_batch(a, b) : 0;
        for (int64_t kb = split * a.nkb / nsplit; kb < (split + 1) * a.nkb / nsplit; ++kb) {
          const int64_t j0 = kb * KVBS;
          if (j0 >= a.Lk) break;
          const int64_t bk = std::min(KVBS, a.Lk - j0), bkp = round_up(bk, VL);
          rt.load_rows(dt, at_row(a.k, dt, b * a.ks[0] + hkv * a.ks[1] + j0 * a.ks[2]), a.ks[2], bk, D, 1.f, kr, Dp);
          transpose_pad(kr, Dp, bk, D, kt, bkp);
          rt.load_rows(dt, at_row(a.v, dt, b * a.vs[0] + hkv * a.vs[1] + j0 * a.vs[2]), a.vs[2], bk, Dv, 1.f, vr, Dvp);
          transpose_pad(vr, Dvp, bk, Dv, vt, bkp);
          // Keys no row sees get 0; the others sum their rows' terms onto it.
          std::fill(dk, dk + bk * Dp, 0.f);
          std::fill(dv, dv + bk * Dvp, 0.f);
          for (int64_t h = hkv * n_rep; h < (hkv + 1) * n_rep; ++h) {
            const int64_t mh = a.mH == 1 ? 0 : h;
            const BlockList lists[2] = {blocks(a.q_num, a.q_idx, a.q_w, mb, mh, a.mH, a.nkb, kb),
                                        blocks(a.fq_num, a.fq_idx, a.fq_w, mb, mh, a.mH, a.nkb, kb)};
            for (int li = 0; li < 2; ++li) {
              const bool partial = li == 0;
              for (int64_t n = 0; n < lists[li].n; ++n) {
                const int64_t qstart = int64_t(lists[li].idx[n]) * QBS;
                if (qstart >= a.Lq) continue;
                const int64_t qend = std::min(qstart + QBS, a.Lq);
                // A partial block in slices of kRowsPartial rows, each trimmed to its own live
                // rows and keys (as the forward's row tasks).
                const int64_t step = partial ? kRowsPartial : QBS;
                for (int64_t qslice = qstart; qslice < qend; qslice += step) {
                  int64_t q0 = qslice;
                  int64_t R = std::min(step, qend - qslice);
                  const bool* tvis = nullptr;
                  // The keys computed: [c0, c1) of the block, whole vectors (a partial block: only
                  // those some live row sees).
                  int64_t c0 = 0, c1 = bkp;
                  if (partial) {
                    TileInfo own;
                    const TileInfo* ti = &own;
                    const bool* tile = vis;
                    if (mc.on) {
                      ti = mc.get(cb, a.nkb, kb, n, (qslice - qstart) / kRowsPartial, vis, &own, &tile,
                                  [&](bool* v, TileInfo* t) { mask_slice<Mod>(v, bkp, R, bk, cb, 0, q0, j0, caps, t); });
                    } else {
                      mask_slice<Mod>(vis, bkp, R, bk, b, h, q0, j0, caps, &own);
                    }
                    if (ti->rlo >= ti->rhi) continue;
                    q0 += ti->rlo;
                    R = ti->rhi - ti->rlo;
                    c0 = ti->jlo / VL * VL;
                    c1 = std::min(bkp, round_up(ti->jhi, VL));
                    // Dense over exactly the computed keys: no mask pass.
                    if (!(ti->dense && c0 == ti->jlo && std::min(c1, bk) == ti->jhi)) tvis = tile + ti->rlo * bkp;
                  }
                  const int64_t nc = c1 - c0, nk = std::min(c1, bk) - c0;  // computed, and real keys
                  rt.load_rows(dt, at_row(a.q, dt, b * a.qs[0] + h * a.qs[1] + q0 * a.qs[2]), a.qs[2], R, D, scale, qs,
                               Dp);
                  // dO: float32 rows of whole vectors are read in place (the copy was a thirtieth of
                  // the backward), others converted and padded.
                  const float* dO = dor;
                  int64_t ldo = Dvp;
                  if (dt == flex_rt::kFloat32 && Dv == Dvp) {
                    dO = static_cast<const float*>(a.dout) + b * a.dos[0] + h * a.dos[1] + q0 * a.dos[2];
                    ldo = a.dos[2];
                  } else {
                    rt.load_rows(dt, at_row(a.dout, dt, b * a.dos[0] + h * a.dos[1] + q0 * a.dos[2]), a.dos[2], R, Dv,
                                 1.f, dor, Dvp);
                  }
                  const float* lse = a.lse + (b * a.H + h) * a.Lq + q0;
                  const float* delta = a.delta + (b * a.H + h) * a.Lq + q0;
                  for (int64_t r = 0; r < R; ++r) {
                    lr[r] = lse_use(lse[r]) * kLog2e;
                    dl[r] = delta[r];
                  }
                  rt.gemm(kStore, R, nc, D, qs, Dp, 1, kt + c0, bkp, sc, nc, nullptr);    // S = Qs K^T
                  rt.gemm(kStore, R, nc, Dv, dO, ldo, 1, vt + c0, bkp, dp, nc, nullptr);  // dP = dO V^T
                  const int64_t kc0 = j0 + c0;  // the first computed key
                  for (int64_t r = 0; r < R; ++r) {
                    const int64_t i = q0 + r;
                    float* srow = sc + r * nc;
                    float* prow = pp + r * nc;
                    float* dprow = dp + r * nc;
                    if constexpr (Mod::kHasScoreMod) {
                      for (int64_t j = 0; j < nk; ++j) prow[j] = Mod::score_fwd(srow[j], b, h, i, kc0 + j, caps);
                    } else {
                      for (int64_t j = 0; j < nk; ++j) prow[j] = srow[j];
                    }
                    if (tvis != nullptr) {
                      // Bytes, as in mods_tile_t: a select on bool is not vectorized.
                      const unsigned char* __restrict vp = reinterpret_cast<const unsigned char*>(tvis + r * bkp + c0);
                      for (int64_t j = 0; j < nk; ++j) prow[j] = vp[j] ? prow[j] : kNegInf;
                    }
                    for (int64_t j = nk; j < nc; ++j) prow[j] = kNegInf;
                    // P = exp(s - lse); dS = P (dP - delta), the gradient at the modified score.
                    rt.prob_row(prow, dprow, nc, lr[r], dl[r]);
                    if constexpr (Mod::kHasScoreMod) {
                      // Through the modifier to the raw score (and into the tables), where visible.
                      for (int64_t j = 0; j < nk; ++j)
                        if (dprow[j] != 0.f || std::isnan(dprow[j]))
                          dprow[j] = Mod::template score_bwd<Mod::kHasCapGrad>(srow[j], b, h, i, kc0 + j, caps, dprow[j],
                                                                              gcap.data());
                    }
                  }
                  rt.gemm(kAccumulate, nk, Dvp, R, pp, 1, nc, dO, ldo, dv + c0 * Dvp, Dvp, nullptr);  // dV += P^T dO
                  rt.gemm(kAccumulate, nk, Dp, R, dp, 1, nc, qs, Dp, dk + c0 * Dp, Dp, nullptr);        // dK += dS^T Qs
                  float* dqr = dqp + ((b * a.H + h) * a.Lq + q0) * Dp;
                  rt.gemm(kAccumulate, R, Dp, nk, dp, nc, 1, kr + c0 * Dp, Dp, dqr, Dp, nullptr);  // dQ += dS K
                }
              }
            }
          }
          char* dkp = static_cast<char*>(a.dk) + (b * a.dks[0] + hkv * a.dks[1] + j0 * a.dks[2]) * elem_size(dt);
          char* dvp = static_cast<char*>(a.dv) + (b * a.dvs[0] + hkv * a.dvs[1] + j0 * a.dvs[2]) * elem_size(dt);
          for (int64_t j = 0; j < bk; ++j) {
            rt.store_row(dt, dk + j * Dp, D, 1.f, dkp + j * a.dks[2] * elem_size(dt));
            rt.store_row(dt, dv + j * Dvp, Dv, 1.f, dvp + j * a.dvs[2] * elem_size(dt));
          }
        }
      }
    }
  });
  // dQ = scale * (sum of the key ranges' partials, in range order).
  const int64_t nrows = a.B * a.H * a.Lq;
  std::atomic<int64_t> next_rows{0};
  parallel(std::min(nthr, ceil_div(nrows, 256)), [&](int64_t, int64_t) {
    std::vector<float> acc(D);
    for (int64_t r0; (r0 = next_rows.fetch_add(256)) < nrows;) {
      for (int64_t row = r0; row < std::min(r0 + 256, nrows); ++row) {
        const int64_t i = row % a.Lq, h = (row / a.Lq) % a.H, b = row / (a.Lq * a.H);
        for (int64_t d = 0; d < D; ++d) {
          float x = dq_part[row * Dp + d];
          for (int64_t sp = 1; sp < nsplit; ++sp) x += dq_part[sp * part_floats + row * Dp + d];
          acc[d] = x;
        }
        rt.store_row(dt, acc.data(), D, scale,
                     static_cast<char*>(a.dq) + (b * a.dqs[0] + h * a.dqs[1] + i * a.dqs[2]) * elem_size(dt));
      }
    }
  });
  if constexpr (Mod::kHasCapGrad) {
    for (int64_t c = 0; c < a.ncap; ++c) {
      if (a.cap_grad[c] == nullptr) continue;
      for (int64_t chunk = 0; chunk < nchunk; ++chunk) {
        const float* g = gbuf.data() + chunk * gsize + goff[c];
        for (int64_t e = 0; e < a.cap_numel[c]; ++e) a.cap_grad[c][e] += g[e];
      }
    }
  }
}

template <typename F>
int guarded(FlexArgs* a, F&& f) {
  try {
    if (a->rt == nullptr || a->rt->version != flex_rt::kVersion)
      throw std::runtime_error("mhakern._C's flex runtime is of another version than this kernel (rebuild mhakern._C)");
    if (a->dtype != flex_rt::kFloat32 && a->dtype != flex_rt::kBFloat16) throw std::runtime_error("unknown dtype");
    f();
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(a->err, sizeof(a->err), "%s", e.what());
    return 1;
  }
}

template <typename Mod>
int run_forward(FlexArgs* a) {
  return guarded(a, [&] { forward<Mod>(*a); });
}

template <typename Mod>
int run_backward(FlexArgs* a) {
  return guarded(a, [&] { backward<Mod>(*a); });
}

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace mhakern::cpu

// The entry points of modifier i (flex::Mod<i>): a library may hold several (a bundle).
#define MHK_FLEX_ENTRY(i)                                                                   \
  extern "C" int mhk_flex_forward_##i(mhakern::cpu::CPU_CAPABILITY::FlexArgs* a) {          \
    return mhakern::cpu::CPU_CAPABILITY::run_forward<mhakern::cpu::CPU_CAPABILITY::flex::Mod##i>(a);  \
  }                                                                                         \
  extern "C" int mhk_flex_backward_##i(mhakern::cpu::CPU_CAPABILITY::FlexArgs* a) {         \
    return mhakern::cpu::CPU_CAPABILITY::run_backward<mhakern::cpu::CPU_CAPABILITY::flex::Mod##i>(a); \
  }

// MHK_FLEX_ENTRIES

extern "C" int64_t mhk_flex_args_size() { return sizeof(mhakern::cpu::CPU_CAPABILITY::FlexArgs); }
