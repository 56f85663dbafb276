// Work decomposition of the cpu kernels, a function of the shapes only (never of the thread
// count, so results are bitwise reproducible): block sizes, the row blocks of the query heads
// sharing a KV head (decode-like calls group heads), and the split of long key ranges.
#pragma once

#include "vec_math.h"

namespace mhakern::cpu {
namespace CPU_CAPABILITY {

constexpr int64_t kRowBlock = 64;     // query rows per task
constexpr int64_t kKeyBlock = 128;    // keys per inner step
constexpr int64_t kRowVecs = (kRowBlock + VL - 1) / VL;  // row vectors of a block, at most
constexpr int64_t kTargetTasks = 64;  // split key ranges until there are about this many tasks
constexpr int64_t kPartialBudget = int64_t{1} << 24;  // floats of split partials (64 MiB)

// Row blocks of the query heads sharing one KV head: nh heads x nq queries each.
struct RowPlan {
  int64_t n_rep, Lq, nh, nq, n_hgroups, n_qblocks;
  int64_t blocks() const { return n_hgroups * n_qblocks; }
  int64_t max_rows() const { return nh * nq; }
};

inline RowPlan plan_rows(int64_t n_rep, int64_t Lq) {
  RowPlan rp{};
  rp.n_rep = n_rep;
  rp.Lq = Lq;
  if (Lq * 2 <= kRowBlock) {
    // Decode-like: the heads sharing a KV head go together, so a key block serves them all.
    rp.nq = Lq;
    rp.nh = std::min<int64_t>(n_rep, kRowBlock / std::max<int64_t>(Lq, 1));
  } else {
    rp.nq = kRowBlock;
    rp.nh = 1;
  }
  rp.n_hgroups = ceil_div(n_rep, rp.nh);
  rp.n_qblocks = ceil_div(Lq, rp.nq);
  return rp;
}

// Rows r = 0 .. nh*nq-1 of a block are (head h0 + r / nq, query i0 + r % nq).
struct RowBlock {
  int64_t h0, nh, i0, nq;
  int64_t rows() const { return nh * nq; }
};

inline RowBlock row_block(const RowPlan& rp, int64_t hkv, int64_t idx) {
  const int64_t hg = idx / rp.n_qblocks, qb = idx % rp.n_qblocks;
  RowBlock rb{};
  rb.h0 = hkv * rp.n_rep + hg * rp.nh;
  rb.nh = std::min(rp.nh, rp.n_rep - hg * rp.nh);
  rb.i0 = qb * rp.nq;
  rb.nq = std::min(rp.nq, rp.Lq - rb.i0);
  return rb;
}

// Whether a forward row block of R rows (Rp: padded to whole vectors) of an fp32 call runs on
// key-major tiles (forward.h forward_key_tiles), where the keys are the vector lanes and the
// products cost R rows instead of Rp: head dims of whole vectors, and rows that fill more than
// one vector but at most three quarters of their padded lanes (the trainer's 20 rows in 32 lanes
// of 16). The backward keeps its transposed tiles: the same key-major steps there (19% fewer
// multiply-adds at 20 rows, head dim 64) measured no faster (docs/results.md, section 4): its
// time is not in its products' lanes.
inline bool key_tiles_fit(const AttnParams& p, int64_t R, int64_t Rp) {
  return p.D % VL == 0 && p.Dv % VL == 0 && R > VL && 4 * R <= 3 * Rp;
}

// Number of key ranges a group of `base` tasks is split into: enough for kTargetTasks tasks,
// each range at least `min_keys` long, partial results within kPartialBudget.
inline int64_t plan_key_splits(int64_t base, int64_t Lk, int64_t min_keys, int64_t floats_per_split) {
  if (base >= kTargetTasks || Lk < 2 * min_keys) return 1;
  int64_t n = std::min(ceil_div(kTargetTasks, base), ceil_div(Lk, min_keys));
  n = std::min(n, kPartialBudget / std::max<int64_t>(floats_per_split, 1));
  return std::max<int64_t>(n, 1);
}

// The query rows of a block in view `x` (heads h0 .., queries i0 ..), at most kRowBlock of them.
template <typename T, int RW = 0, int LOC = 3, typename V>
inline void prefetch_block_rows(const V& x, int64_t b, const RowBlock& rb, int64_t elems) {
  const T* base = static_cast<const T*>(x.ptr) + b * x.sb;
  for (int64_t hh = 0; hh < rb.nh; ++hh)
    prefetch_rows<RW, LOC>(base + (rb.h0 + hh) * x.sh + rb.i0 * x.sl, std::min<int64_t>(rb.nq, kRowBlock), elems, x.sl);
}

}  // namespace CPU_CAPABILITY
}  // namespace mhakern::cpu
