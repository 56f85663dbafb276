// The modes of a call as they act on a score tile (docs/contract.md): each row's range of
// visible keys (key lengths, causal alignment, windows) and its summary over a row block, which
// decides which key blocks are skipped, seen whole or masked; the dropout keep mask; attn_mask
// (bool or additive); and the pairwise-visibility fallback for tiles where a hidden pair meets an
// inf or NaN operand. Tiles are S^T (keys x padded rows), scores in base 2.
#pragma once

#include "plan.h"

namespace mhakern::cpu {
namespace CPU_CAPABILITY {

// Key length of batch element b. The host checks key_lengths; clamping again keeps a bad value
// from ever reading outside k and v.
inline int64_t key_len(const AttnParams& p, int64_t b) {
  return p.key_lengths ? std::clamp<int64_t>(p.key_lengths[b], 0, p.Lk) : p.Lk;
}

// Before attn_mask, the keys visible to row (b, i) are exactly lo <= j < hi (empty: 0, 0).
struct KeyRange {
  int64_t lo, hi;
};

inline KeyRange row_range(const AttnParams& p, int64_t b, int64_t i) {
  const int64_t lkb = key_len(p, b);
  const int64_t c = i + (p.top_left ? 0 : lkb - p.Lq);  // the key on the row's diagonal
  // A window wider than Lq + Lk changes nothing; capping it keeps the sums below from overflowing.
  const int64_t far = p.Lq + p.Lk;
  int64_t lo = 0, hi = lkb;
  if (p.causal) hi = std::min(hi, c + 1);
  if (p.window_right >= 0) hi = std::min(hi, c + std::min(p.window_right, far) + 1);
  if (p.window_left >= 0) lo = std::max(lo, c - std::min(p.window_left, far));
  return hi > lo ? KeyRange{lo, hi} : KeyRange{0, 0};
}

// The key ranges of the rows of a block, summarised: key blocks outside [first, stop) are seen
// by no row (skipped); a key block inside [maxlo, minhi) is seen whole by every row (no range
// masking). A row that sees nothing has the range (0, 0), so every block is ragged for it.
struct BlockRanges {
  int64_t first = std::numeric_limits<int64_t>::max(), stop = 0;
  int64_t maxlo = 0, minhi = std::numeric_limits<int64_t>::max();
  void add(const KeyRange& kr) {
    if (kr.hi > kr.lo) {
      first = std::min(first, kr.lo);
      stop = std::max(stop, kr.hi);
    }
    maxlo = std::max(maxlo, kr.lo);
    minhi = std::min(minhi, kr.hi);
  }
  bool ragged(int64_t j0, int64_t bk) const { return j0 < maxlo || j0 + bk > minhi; }
  // The first key block (aligned to kbeg) that some row sees.
  int64_t first_block(int64_t kbeg, int64_t block) const {
    return first > kbeg && first != std::numeric_limits<int64_t>::max() ? kbeg + (first - kbeg) / block * block : kbeg;
  }
};

// ---------------------------------------------------------------------------------------------
// Dropout: the counter hash of docs/contract.md. keep(b, h, i, j) = mix32(r_i + j) >= threshold
// with r_i = mix32(s_bh ^ i), s_bh = mix32(seed_lo ^ mix32(seed_hi ^ (b * H + h))), all modulo
// 2^32 and h the query head: a pure function of the position, so the backward regenerates the
// forward's mask and any decomposition of the work gives the same one.

// mix32, dropout_row_hash and dropout_threshold: csrc/mode_params.h (shared with the cuda family).
inline uint32_t dropout_row_seed(const AttnParams& p, int64_t b, int64_t h, int64_t i) {
  // dropout_q0 / _h0 / _heads: the row's position and head in a longer call (ModeParams; 0 unless
  // this call is a block or a head shard of one).
  const int64_t heads = p.dropout_heads > 0 ? p.dropout_heads : p.H;
  return dropout_row_hash(p.seed, static_cast<uint32_t>((b + p.hash_b0) * heads + h + p.dropout_h0),
                          static_cast<uint32_t>(i + p.dropout_q0));
}

// kv[r] = keep(row r, key j) ? kept : 0 for the Rp rows of a tile (rseed: their r_i). A plain
// loop over 32-bit lanes, which the compiler vectorises.
inline void dropout_keep(const uint32_t* rseed, int64_t Rp, int64_t j, uint32_t threshold, float kept, float* kv) {
  const uint32_t jj = static_cast<uint32_t>(j);
  for (int64_t r = 0; r < Rp; ++r) kv[r] = mix32(rseed[r] + jj) >= threshold ? kept : 0.f;
}

// ---------------------------------------------------------------------------------------------
// Score modifiers (ModeParams: softcap, alibi), the first thing a score meets after the product:
// s = c tanh(s / c), then s -= slope(b, h) |i + off - j|, off the causal offset. In the base 2 of
// the tiles both keep their form with c and the slope times log2(e). The backward chains through
// the cap with its derivative 1 - tanh^2 at the same pair; ALiBi has no gradient.

struct ScoreMods {
  bool softcap, alibi;
  float cap2, inv_cap2;  // softcap * log2(e) and its inverse
  explicit ScoreMods(const AttnParams& p)
      : softcap(p.softcap > 0.f),
        alibi(p.alibi != nullptr),
        cap2(softcap ? p.softcap * kLog2e : 0.f),
        inv_cap2(softcap ? 1.f / (p.softcap * kLog2e) : 0.f) {}
  bool any() const { return softcap || alibi; }
  // Scratch floats of apply_score_mods for tiles of Rp rows (backward: with the cap's derivative).
  int64_t floats(int64_t Rp, bool backward) const {
    return (alibi ? 2 * Scratch::size_of(Rp) : 0) + (softcap && backward ? Scratch::size_of(kKeyBlock * Rp) : 0);
  }
};

// Per row buffers of apply_score_mods (slope2: -slope * log2(e); diag: i + off - j0, the row's
// diagonal key relative to the tile) and, in the backward, the cap's derivative per pair.
struct ModScratch {
  float *slope2 = nullptr, *diag = nullptr, *dcap = nullptr;
  ModScratch() = default;
  ModScratch(Scratch& s, const ScoreMods& m, int64_t Rp, bool backward) {
    if (m.alibi) {
      slope2 = s.take(Rp);
      diag = s.take(Rp);
    }
    if (m.softcap && backward) dcap = s.take(kKeyBlock * Rp);
  }
};

// Applies the modifiers to the score tile S^T (bk x Rp, base 2) of the rows of rb and keys j0 ..;
// with `dcap` (backward), stores 1 - tanh^2 of each pair there, the factor dS_raw / dS. Runs on
// the raw product, before attn_mask and the range masks: a hidden pair is -inf after it whatever
// this did. Padding rows (r >= R) get slope 0; their scores are never read.
inline void apply_score_mods(const AttnParams& p, const ScoreMods& m, const ModScratch& ms, float* st, int64_t Rp,
                             int64_t bk, int64_t b, const RowBlock& rb, int64_t j0) {
  const int64_t nvec = Rp / VL;
  if (m.softcap) {
    const Vec c(m.cap2), ic(m.inv_cap2);
    for (int64_t e = 0; e < bk * Rp; e += VL) {
      const Vec t = tanhv(Vec::loadu(st + e) * ic);
      (t * c).store(st + e);
      if (ms.dcap) (Vec(1.f) - t * t).store(ms.dcap + e);
    }
  }
  if (m.alibi) {
    const int64_t R = rb.rows();
    const int64_t off = p.top_left ? 0 : key_len(p, b) - p.Lq;
    for (int64_t r = 0; r < Rp; ++r) {
      if (r >= R) {
        ms.slope2[r] = ms.diag[r] = 0.f;
        continue;
      }
      const int64_t h = rb.h0 + r / rb.nq, i = rb.i0 + r % rb.nq;
      ms.slope2[r] = -p.alibi[b * p.alibi_sb + h * p.alibi_sh] * kLog2e;
      // Exact in float up to 2^24 keys away; beyond, the distance rounds like the product does.
      ms.diag[r] = static_cast<float>(i + off - j0);
    }
    for (int64_t j = 0; j < bk; ++j) {
      const Vec jv(static_cast<float>(j));
      float* sp = st + j * Rp;
      for (int64_t v = 0; v < nvec; ++v) {
        const Vec dist = (Vec::loadu(ms.diag + v * VL) - jv).abs();
        at::vec::fmadd(Vec::loadu(ms.slope2 + v * VL), dist, Vec::loadu(sp + v * VL)).store(sp + v * VL);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Masking a score tile: ranges, attn_mask, and the pairwise fallback.

// Hides (sets to -inf) the scores of keys outside [lorel[r], hirel[r]) (relative to the block,
// small integers exact in float whatever Lk); lorel is read only when use_lo.
inline void mask_block(float* st, int64_t Rp, int64_t bk, const float* lorel, const float* hirel, bool use_lo) {
  for (int64_t j = 0; j < bk; ++j) {
    const Vec jv(static_cast<float>(j));
    float* sp = st + j * Rp;
    if (use_lo) {
      for (int64_t v = 0; v < Rp / VL; ++v) {
        const Vec hide = (jv >= Vec::loadu(hirel + v * VL)) | (jv < Vec::loadu(lorel + v * VL));
        Vec::blendv(Vec::loadu(sp + v * VL), Vec(kNegInf), hide).store(sp + v * VL);
      }
    } else {
      for (int64_t v = 0; v < Rp / VL; ++v)
        Vec::blendv(Vec::loadu(sp + v * VL), Vec(kNegInf), jv >= Vec::loadu(hirel + v * VL)).store(sp + v * VL);
    }
  }
}

// Range limits of the rows of a tile relative to key j0, for mask_block. Rows past R and
// rows flagged dead (dead[r] != 0, when given) see nothing.
template <typename RowKey>
inline void range_limits(const AttnParams& p, int64_t b, int64_t R, int64_t Rp, int64_t j0, int64_t bk, RowKey&& row_i,
                         const float* dead, float* lorel, float* hirel) {
  for (int64_t r = 0; r < Rp; ++r) {
    KeyRange kr{0, 0};
    if (r < R && !(dead && dead[r] != 0.f)) kr = row_range(p, b, row_i(r));
    lorel[r] = static_cast<float>(std::clamp<int64_t>(kr.lo - j0, 0, bk));
    hirel[r] = static_cast<float>(std::clamp<int64_t>(kr.hi - j0, 0, bk));
  }
}

// Applies attn_mask to the score tile S^T (bk x Rp, scores in base 2) of the R rows of `rb`
// and keys j0 ..: a false (zero) bool hides the key; a float adds value * log2(e), and -inf
// hides the key exactly like a false (never -inf + NaN = NaN from a hidden key's NaN score).
// Must run before mask_block: a range-hidden score stays -inf whatever the mask value.
inline void apply_attn_mask(const AttnParams& p, float* st, int64_t Rp, int64_t bk, int64_t b, const RowBlock& rb,
                            int64_t j0) {
  const int64_t R = rb.rows(), sk = p.mask_sk;
  const Vec minf(kNegInf), log2e(kLog2e);
  // VL rows at a time: their mask values for key j are gathered into one vector (each row's
  // mask is read along its own key stride) and applied to the contiguous row vector of S^T.
  for (int64_t r0 = 0; r0 < R; r0 += VL) {
    const int64_t n = std::min<int64_t>(VL, R - r0);
    int64_t off[VL];
    for (int64_t t = 0; t < n; ++t) {
      const int64_t r = r0 + t, h = rb.h0 + r / rb.nq, i = rb.i0 + r % rb.nq;
      off[t] = b * p.mask_sb + h * p.mask_sh + i * p.mask_sq + j0 * sk;
    }
    alignas(64) float mv[VL];
    std::fill(mv, mv + VL, 0.f);  // padding rows: no change
    if (p.mask_kind == 1) {
      const uint8_t* m = static_cast<const uint8_t*>(p.mask);
      for (int64_t j = 0; j < bk; ++j) {
        for (int64_t t = 0; t < n; ++t) mv[t] = m[off[t] + j * sk] ? 0.f : kNegInf;
        float* sp = st + j * Rp + r0;
        Vec::blendv(Vec::loadu(sp), minf, Vec::loadu(mv) == minf).store(sp);
      }
    } else {
      const float* m = static_cast<const float*>(p.mask);
      for (int64_t j = 0; j < bk; ++j) {
        for (int64_t t = 0; t < n; ++t) mv[t] = m[off[t] + j * sk];
        float* sp = st + j * Rp + r0;
        const Vec x = Vec::loadu(mv);
        Vec::blendv(at::vec::fmadd(x, log2e, Vec::loadu(sp)), minf, x == minf).store(sp);
      }
    }
  }
}

// Whether a (rows x cols, row stride ld) fp32 block holds an inf or a NaN (x * 0 is NaN
// exactly for those).
inline bool any_nonfinite(const float* x, int64_t rows, int64_t cols, int64_t ld) {
  // Four accumulators (a NaN stays in its own): one chain of multiply-adds waits on each one's
  // latency, and the scan of a 32 x 64 key block was 5% of the backward's samples at the
  // trainer's 20 queries over 32 keys.
  Vec acc[4] = {Vec(0.f), Vec(0.f), Vec(0.f), Vec(0.f)};
  const Vec zero(0.f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * ld;
    int64_t c = 0;
    for (; c + 4 * VL <= cols; c += 4 * VL)
      for (int u = 0; u < 4; ++u) acc[u] = at::vec::fmadd(Vec::loadu(xr + c + u * VL), zero, acc[u]);
    for (; c + VL <= cols; c += VL) acc[0] = at::vec::fmadd(Vec::loadu(xr + c), zero, acc[0]);
    if (c < cols) acc[1] = at::vec::fmadd(Vec::loadu(xr + c, cols - c), zero, acc[1]);
  }
  float part[VL];
  ((acc[0] + acc[1]) + (acc[2] + acc[3])).store(part);
  for (int64_t i = 0; i < VL; ++i)
    if (part[i] != part[i]) return true;
  return false;
}

// Visibility of each pair of a tile after masking: vis[j * Rp + r] = (S^T[j, r] != -inf).
// Only for tiles where a hidden pair meets a non-finite operand: a plain product would turn the
// hidden pair's zero weight times that inf or NaN into a NaN (hidden positions must never
// influence anything), so such tiles take the pair-by-pair paths below.
inline void visibility(const float* st, int64_t Rp, int64_t bk, uint8_t* vis) {
  for (int64_t e = 0; e < bk * Rp; ++e) vis[e] = st[e] != kNegInf;
}

}  // namespace CPU_CAPABILITY
}  // namespace mhakern::cpu
