// The cpu forward: for one row block and one key range, the online softmax over key blocks
// (forward_rows); the merge of split key ranges by their lse (merge_splits); and the task loop
// over (batch, KV head, row block, key range) (forward_impl).
#pragma once

#include <ATen/Parallel.h>

#include <cmath>
#include <memory>

#include "bf16_dot.h"
#include "gemm.h"
#include "kv_cache.h"
#include "modes.h"

namespace mhakern::cpu {
namespace CPU_CAPABILITY {

// A thread's scratch tiles for one row block (Rp: the largest block's padded rows).
struct FwdScratch {
  float *qr, *qt, *st, *ot, *orow, *m, *l, *alpha, *lorel, *hirel, *kc, *vc, *kv, *bmax, *kt;
  uint32_t* rseed;
  uint8_t* vis;
  // The bf16 products' operands as pairs (bf16_dot.h): Q^T, a K block, a V block, P^T.
  uint32_t *qtp = nullptr, *kp = nullptr, *vp = nullptr, *ptp = nullptr;
  ModScratch ms;
  static int64_t pair_floats(int64_t Dp, int64_t Dvp, int64_t Rp) {
    return Scratch::size_of(Dp / 2 * Rp) + Scratch::size_of(kKeyBlock * Dp / 2) +
           Scratch::size_of(kKeyBlock / 2 * Dvp) + Scratch::size_of(kKeyBlock / 2 * Rp);
  }
  static int64_t floats(int64_t Dp, int64_t Dvp, int64_t Rp, const ScoreMods& mods, bool pairs = false) {
    return mods.floats(Rp, false) + Scratch::size_of(Rp * Dp) + Scratch::size_of(Dp * Rp) +
           Scratch::size_of(kKeyBlock * Rp) + Scratch::size_of(Dvp * Rp) + Scratch::size_of(Rp * Dvp) +
           8 * Scratch::size_of(Rp) +
           2 * Scratch::size_of(kKeyBlock * Dp) + Scratch::size_of(kKeyBlock * Dvp) +
           Scratch::size_of(kKeyBlock * Rp / 4) + (pairs ? pair_floats(Dp, Dvp, Rp) : 0);
  }
  FwdScratch(Scratch& s, int64_t Dp, int64_t Dvp, int64_t Rp, const ScoreMods& mods, bool pairs = false) {
    qr = s.take(Rp * Dp);
    qt = s.take(Dp * Rp);
    st = s.take(kKeyBlock * Rp);
    ot = s.take(Dvp * Rp);
    orow = s.take(Rp * Dvp);
    m = s.take(Rp);
    l = s.take(Rp);
    alpha = s.take(Rp);
    lorel = s.take(Rp);
    hirel = s.take(Rp);
    kv = s.take(Rp);
    bmax = s.take(Rp);
    rseed = reinterpret_cast<uint32_t*>(s.take(Rp));
    kc = s.take(kKeyBlock * Dp);
    kt = s.take(kKeyBlock * Dp);
    vc = s.take(kKeyBlock * Dvp);
    vis = reinterpret_cast<uint8_t*>(s.take(kKeyBlock * Rp / 4));  // Rp is a multiple of VL >= 4
    ms = ModScratch(s, mods, Rp, false);
    if (pairs) {
      qtp = reinterpret_cast<uint32_t*>(s.take(Dp / 2 * Rp));
      kp = reinterpret_cast<uint32_t*>(s.take(kKeyBlock * Dp / 2));
      vp = reinterpret_cast<uint32_t*>(s.take(kKeyBlock / 2 * Dvp));
      ptp = reinterpret_cast<uint32_t*>(s.take(kKeyBlock / 2 * Rp));
    }
  }
};

// Where a forward task puts its rows: the outputs, or (split key ranges) partial buffers
// holding the normalised output and the base-2 lse of the range.
struct FwdSink {
  float* part_o = nullptr;  // (splits, B, H, Lq, Dv) or nullptr for the final outputs
  // Each range's running max m (base 2) and sum l, kept apart rather than as m + log2(l): that
  // sum, rounded to float, is off by u * |m|, an error in every weight of the merge that grows
  // with the logits (docs/contract.md, "Tolerance rule"); m - max(m) is exact near the max.
  float* part_m = nullptr;  // (splits, B, H, Lq)
  float* part_l = nullptr;  // (splits, B, H, Lq)
  int64_t split = 0;
};

// The online softmax of a key block for the bf16 products (no dropout, no pairwise tile), NV row
// vectors held in registers: the running max m takes the block's column max bmax (the rows'
// maxima over the block's keys, from the S product's epilogue or a pass over S^T), alpha =
// 2^(m_old - m_new) rescales l (here) and O (in the P.V product), and P = 2^(S - m) goes
// straight from the exponent (exp2v_short: P is rounded to bf16) to bf16 pairs of keys (P^T
// itself is never stored).
template <typename Dot, int NV>
MHK_STEP void softmax_to_pairs_nv(const float* st, int64_t Rp, int64_t bk, const float* bmax, float* m, float* l,
                                  float* alpha, uint32_t* ptp) {
  Vec muse[NV], sum[NV];
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) {
    const Vec mold = Vec::loadu(m + v * VL);
    const Vec mnew = at::vec::clamp_min(mold, Vec::loadu(bmax + v * VL));
    // A row with nothing visible yet keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
    muse[v] = Vec::blendv(mnew, Vec(0.f), mnew == Vec(kNegInf));
    exp2v(mold - muse[v]).store(alpha + v * VL);
    mnew.store(m + v * VL);
    sum[v] = Vec(0.f);
  }
  int64_t j = 0;
  for (; j + 2 <= bk; j += 2) {
    const float* s0 = st + j * Rp;
    uint32_t* d = ptp + (j / 2) * Rp;
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      const Vec p0 = exp2v_short(Vec::loadu(s0 + v * VL) - muse[v]);
      const Vec p1 = exp2v_short(Vec::loadu(s0 + Rp + v * VL) - muse[v]);
      Dot::round_pairs(p0, p1, d + v * VL);
      sum[v] = sum[v] + p0;
      sum[v] = sum[v] + p1;
    }
  }
  if (j < bk) {  // an odd last key pairs with a zero
    const float* s0 = st + j * Rp;
    uint32_t* d = ptp + (j / 2) * Rp;
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      const Vec p0 = exp2v_short(Vec::loadu(s0 + v * VL) - muse[v]);
      Dot::round_pairs(p0, Vec(0.f), d + v * VL);
      sum[v] = sum[v] + p0;
    }
  }
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) (Vec::loadu(l + v * VL) * Vec::loadu(alpha + v * VL) + sum[v]).store(l + v * VL);
}

// softmax_to_pairs_nv for nvec (1 .. kRowVecs) row vectors.
template <typename Dot, int NV = kRowVecs>
inline void softmax_to_pairs(int64_t nvec, const float* st, int64_t Rp, int64_t bk, const float* bmax, float* m,
                             float* l, float* alpha, uint32_t* ptp) {
  if constexpr (NV > 0) {
    if (nvec == NV) return softmax_to_pairs_nv<Dot, NV>(st, Rp, bk, bmax, m, l, alpha, ptp);
    softmax_to_pairs<Dot, NV - 1>(nvec, st, Rp, bk, bmax, m, l, alpha, ptp);
  }
}

// The forward of one row block over keys [kbeg, kend) when every row sees every one of them (no
// cut range, mask or dropout), with the keys as the vector lanes: per key block K^T (D x bkp),
// S = Q K^T (R x bkp), P, and O = P V (R x Dv) as rows, so the block's products cost R rows,
// not the Rp lanes of forward_rows' transposed tiles (20 rows: 32 lanes of 16; the keys, 32 at
// the trainer's call, fill whole vectors). The bits are forward_rows' own: every S and O element
// is the same chain of fused multiply-adds in the same order (a fused multiply-add is symmetric
// in its factors; O is rescaled by alpha, rounded, before its block's chain, as the Rescale
// product does in its load); each row's max and sum run over its keys in order from 0 with the
// comparison and additions of forward_rows' per-lane ones; m, alpha and l take its vector
// expressions, a row to a lane. Leaves O (not normalised) in s.orow (R x Dv), m and l in s.m, s.l.
MHK_STEP void forward_key_tiles(const AttnParams& p, int64_t b, int64_t hkv, int64_t R, int64_t Rp, int64_t kbeg,
                                int64_t kend, const FwdScratch& s) {
  const int64_t D = p.D, Dv = p.Dv;  // whole vectors (key_tiles_fit)
  const KvRows<float> krows(p, p.k, b, hkv), vrows(p, p.v, b, hkv);
  float* muse = s.kv;     // the max each row's P subtracts (forward_rows' muse)
  float* rsum = s.lorel;  // each row's sum of P over the block
  if (kbeg >= kend) std::fill(s.orow, s.orow + R * Dv, 0.f);
  bool first = true;
  for (int64_t j0 = kbeg; j0 < kend; j0 += kKeyBlock) {
    const int64_t bk = std::min(kKeyBlock, kend - j0), bkp = round_up(bk, VL);
    int64_t ldk = 0, ldv = 0;
    const float* Kb = krows.block(j0, bk, D, s.kc, &ldk);
    const float* Vb = vrows.block(j0, bk, Dv, s.vc, &ldv);
    keys_transposed(Kb, ldk, bk, D, s.kt);
    gemm<CMode::Store>(R, bkp, D, s.qr, D, 1, s.kt, bkp, s.st, bkp);
    // Row maxima, keys in order: forward_rows' per-lane clamp_min keeps the running max unless
    // the key's score is greater, so NaN scores and ties of signed zeros go alike here.
    std::fill(s.bmax, s.bmax + Rp, kNegInf);
    std::fill(rsum, rsum + Rp, 0.f);
    for (int64_t j = 0; j < bk; ++j)
      for (int64_t r = 0; r < R; ++r) {
        const float x = s.st[r * bkp + j];
        s.bmax[r] = x > s.bmax[r] ? x : s.bmax[r];
      }
    for (int64_t v = 0; v < Rp; v += VL) {
      const Vec mold = Vec::loadu(s.m + v);
      const Vec mnew = at::vec::clamp_min(mold, Vec::loadu(s.bmax + v));
      // A row with nothing visible yet keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
      const Vec mu = Vec::blendv(mnew, Vec(0.f), mnew == Vec(kNegInf));
      exp2v(mold - mu).store(s.alpha + v);
      mnew.store(s.m + v);
      mu.store(muse + v);
    }
    for (int64_t r = 0; r < R; ++r) {
      float* sr = s.st + r * bkp;
      const Vec mu(muse[r]);
      for (int64_t v = 0; v < bkp; v += VL) exp2v(Vec::loadu(sr + v) - mu).store(sr + v);
    }
    for (int64_t j = 0; j < bk; ++j)
      for (int64_t r = 0; r < R; ++r) rsum[r] += s.st[r * bkp + j];
    for (int64_t v = 0; v < Rp; v += VL)
      (Vec::loadu(s.l + v) * Vec::loadu(s.alpha + v) + Vec::loadu(rsum + v)).store(s.l + v);
    if (first) {
      gemm<CMode::Store>(R, Dv, bk, s.st, bkp, 1, Vb, ldv, s.orow, Dv);
    } else {
      for (int64_t r = 0; r < R; ++r) {
        const Vec a(s.alpha[r]);
        for (int64_t v = 0; v < Dv; v += VL) (Vec::loadu(s.orow + r * Dv + v) * a).store(s.orow + r * Dv + v);
      }
      gemm<CMode::Accumulate>(R, Dv, bk, s.st, bkp, 1, Vb, ldv, s.orow, Dv);
    }
    first = false;
  }
}

// One key block's step of the online softmax in base 2 on the score tile S^T (bk keys x Rp
// rows, Rp a multiple of VL, at most kRowBlock): per row the new running maximum m, alpha =
// 2^(m_old - m_new), the tile replaced by P = 2^(S - m_new) (0 where -inf: a row with nothing
// visible yet subtracts 0, not -inf, so no NaN) and l = l * alpha + the row's sum of P. keep(j)
// gives key j's factors per row to store P with (dropout: l still sums the undropped P), or
// null. Loops run over keys outside and row vectors inside, so the max and sum reductions of
// the row vectors are independent chains rather than one serial one. Also the flex kernel's
// step (flex_runtime_impl.h).
template <typename Keep>
MHK_STEP void softmax_step(float* st, int64_t Rp, int64_t bk, float* m, float* l, float* alpha, Keep&& keep) {
  const int64_t nvec = Rp / VL;
  Vec mx[kRowVecs], muse[kRowVecs], sum[kRowVecs];
  for (int64_t v = 0; v < nvec; ++v) {
    mx[v] = Vec(kNegInf);
    sum[v] = Vec(0.f);
  }
  for (int64_t j = 0; j < bk; ++j) {
    const float* sp = st + j * Rp;
    for (int64_t v = 0; v < nvec; ++v) mx[v] = at::vec::clamp_min(mx[v], Vec::loadu(sp + v * VL));
  }
  for (int64_t v = 0; v < nvec; ++v) {
    const Vec mold = Vec::loadu(m + v * VL);
    const Vec mnew = at::vec::clamp_min(mold, mx[v]);
    muse[v] = Vec::blendv(mnew, Vec(0.f), mnew == Vec(kNegInf));
    exp2v(mold - muse[v]).store(alpha + v * VL);
    mnew.store(m + v * VL);
  }
  for (int64_t j = 0; j < bk; ++j) {
    float* sp = st + j * Rp;
    const float* kv = keep(j);
    for (int64_t v = 0; v < nvec; ++v) {
      const Vec pj = exp2v(Vec::loadu(sp + v * VL) - muse[v]);
      (kv ? pj * Vec::loadu(kv + v * VL) : pj).store(sp + v * VL);
      sum[v] = sum[v] + pj;
    }
  }
  for (int64_t v = 0; v < nvec; ++v)
    (Vec::loadu(l + v * VL) * Vec::loadu(alpha + v * VL) + sum[v]).store(l + v * VL);
}

// kMods: the call has a score modifier (mods.any()); a template flag, so the plain call's
// instance has no trace of them (a runtime branch per tile cost 3% on decode-sized tasks).
// Dot: void for the fp32 products (every dtype converted to fp32), else the pair dot product of
// bf16_dot.h (DotHw, DotModel; bf16 inputs only): Q.K^T and P.V on bf16 operands with fp32
// accumulation, P rounded to bf16, the softmax in fp32 as before.
template <typename T, bool kMods, typename Dot = void>
void forward_rows(const AttnParams& p, const ScoreMods& mods, int64_t b, const RowBlock& rb, int64_t kbeg,
                  int64_t kend, const FwdScratch& s, const FwdSink& sink) {
  const int64_t D = p.D, Dv = p.Dv, n_rep = p.H / p.Hkv;
  const int64_t Dp = round_up(D, VL), Dvp = round_up(Dv, VL);
  const int64_t R = rb.rows(), Rp = round_up(R, VL), nvec = Rp / VL;
  const int64_t hkv = rb.h0 / n_rep;
  auto row_i = [&](int64_t r) { return rb.i0 + r % rb.nq; };

  BlockRanges br;
  for (int64_t r = 0; r < R; ++r) br.add(row_range(p, b, row_i(r)));
  const int64_t kstop = std::min(kend, br.stop);
  const int64_t jstart = br.first_block(kbeg, kKeyBlock);
  const bool dropout = p.dropout_p > 0.f;
  const uint32_t threshold = dropout ? dropout_threshold(p.dropout_p) : 0;
  if (dropout) {
    for (int64_t r = 0; r < Rp; ++r) s.rseed[r] = r < R ? dropout_row_seed(p, b, rb.h0 + r / rb.nq, row_i(r)) : 0u;
  }

  constexpr bool kPairs = !std::is_void_v<Dot>;
  static_assert(!kPairs || std::is_same_v<T, c10::BFloat16>, "the pair products take bf16 inputs");
  // Q rows (scaled by scale * log2(e), so scores come out in base 2), then Q^T (Dp x Rp). The
  // pair products keep Q exact (bf16) and scale the fp32 scores instead.
  const float qmul = p.scale * kLog2e;
  const T* q = static_cast<const T*>(p.q.ptr) + b * p.q.sb;
  for (int64_t r = 0; r < R; ++r)
    load_row(q + (rb.h0 + r / rb.nq) * p.q.sh + row_i(r) * p.q.sl, D, kPairs ? 1.f : qmul, s.qr + r * Dp, Dp);
  std::fill(s.qr + R * Dp, s.qr + Rp * Dp, 0.f);
  for (int64_t v = 0; v < nvec; ++v) {
    Vec(kNegInf).store(s.m + v * VL);
    Vec(0.f).store(s.l + v * VL);
  }
  // Short row blocks of fp32 calls whose rows see every key of the range: key-major tiles.
  bool key_tiles = false;
  if constexpr (std::is_same_v<T, float> && !kMods && !kPairs)
    key_tiles = key_tiles_fit(p, R, Rp) && !dropout && !p.mask && br.maxlo <= kbeg && br.minhi >= kend;
  if (key_tiles) {
    forward_key_tiles(p, b, hkv, R, Rp, kbeg, kend, s);
  } else {
    if constexpr (kPairs)
      pack_rows_transposed(s.qr, Dp, Rp, s.qtp, s.qt);
    else
      transpose(s.qr, Dp, s.qt, Rp, Rp, Dp);
    const int64_t D2 = (D + 1) / 2;
    if (jstart >= kstop) std::fill(s.ot, s.ot + Dvp * Rp, 0.f);  // no key block will write it

    const KvRows<T> krows(p, p.k, b, hkv), vrows(p, p.v, b, hkv);
    bool first = true;
    for (int64_t j0 = jstart; j0 < kstop; j0 += kKeyBlock) {
      const int64_t bk = std::min(kKeyBlock, kstop - j0);
      const bool ragged = br.ragged(j0, bk);
      // The bf16 products take the rows' max over the block from the S product's epilogue where
      // nothing changes S^T after it (a pass over the tile less).
      const bool fuse_max = kPairs && !kMods && !p.mask && !ragged && !dropout;
      int64_t ldk = 0, ldv = 0;
      if constexpr (kPairs) {
        // S^T (bk x Rp) = K_blk * Q^T, K read in place when its rows are whole pairs in memory.
        const T* k0 = krows.row(j0);
        const bool in_place = krows.run(j0, bk) == bk && D % 2 == 0 && krows.sl % 2 == 0 &&
                              reinterpret_cast<uintptr_t>(k0) % 4 == 0;
        const uint32_t* Kp = s.kp;
        int64_t ldkp = D2;
        if (in_place) {
          Kp = reinterpret_cast<const uint32_t*>(k0);
          ldkp = krows.sl / 2;
        } else {
          pack_rows(krows, j0, bk, D, s.kp, D2);
        }
        if (fuse_max) std::fill(s.bmax, s.bmax + Rp, kNegInf);
        gemm_pairs<Dot, CMode::Store>(bk, Rp, D2, Kp, ldkp, 1, s.qtp, Rp, s.st, Rp, nullptr, qmul,
                                      fuse_max ? s.bmax : nullptr);
      } else {
        const float* Kb = krows.block(j0, bk, D, s.kc, &ldk);
        // S^T (bk x Rp) = K_blk * Q^T
        gemm<CMode::Store>(bk, Rp, D, Kb, ldk, 1, s.qt, Rp, s.st, Rp);
      }
      if constexpr (kMods) apply_score_mods(p, mods, s.ms, s.st, Rp, bk, b, rb, j0);

      if (p.mask) apply_attn_mask(p, s.st, Rp, bk, b, rb, j0);
      if (ragged) {
        // Some row's visible range starts or ends inside this block.
        range_limits(p, b, R, Rp, j0, bk, row_i, nullptr, s.lorel, s.hirel);
        mask_block(s.st, Rp, bk, s.lorel, s.hirel, j0 < br.maxlo);
      }
      // The pair products read V as fp32 only where a hidden pair may meet an inf or NaN.
      const float* Vb = kPairs && !(ragged || p.mask) ? nullptr : vrows.block(j0, bk, Dv, s.vc, &ldv);
      // A hidden pair next to an inf or NaN in V: accumulate pair by pair (see visibility()).
      const bool pairwise = (ragged || p.mask) && any_nonfinite(Vb, bk, Dv, ldv);
      if (pairwise) visibility(s.st, Rp, bk, s.vis);

      // Online softmax. Loops run over keys outside and row vectors inside, so the max and sum
      // reductions of the row vectors are independent chains rather than one serial one.
      const bool pairs_softmax = kPairs && !dropout && !pairwise;
      if (pairs_softmax) {
        if (!fuse_max) {
          Vec mx[kRowVecs];
          for (int64_t v = 0; v < nvec; ++v) mx[v] = Vec(kNegInf);
          for (int64_t j = 0; j < bk; ++j) {
            const float* sp = s.st + j * Rp;
            for (int64_t v = 0; v < nvec; ++v) mx[v] = at::vec::clamp_min(mx[v], Vec::loadu(sp + v * VL));
          }
          for (int64_t v = 0; v < nvec; ++v) mx[v].store(s.bmax + v * VL);
        }
        if constexpr (kPairs) softmax_to_pairs<Dot>(nvec, s.st, Rp, bk, s.bmax, s.m, s.l, s.alpha, s.ptp);
      } else if (!dropout) {
        softmax_step(s.st, Rp, bk, s.m, s.l, s.alpha, [](int64_t) -> const float* { return nullptr; });
      } else {
        // l sums the undropped probabilities (lse is the plain softmax's); the output gets the
        // kept ones, and 1 / (1 - p) when it is normalised.
        softmax_step(s.st, Rp, bk, s.m, s.l, s.alpha, [&](int64_t j) -> const float* {
          dropout_keep(s.rseed, Rp, j0 + j + p.dropout_k0, threshold, 1.f, s.kv);
          return s.kv;
        });
      }

      // O^T (Dv x Rp) = alpha * O^T + V_blk^T * P^T
      if (kPairs && pairwise) {
        const int64_t bk2 = (bk + 1) / 2;
        if constexpr (kPairs) pack_probs<Dot>(s.st, Rp, bk, s.ptp);
        pack_key_pairs(vrows, j0, bk, Dv, s.vp, Dvp);
        for (int64_t d = 0; d < Dv; ++d) {
          float* od = s.ot + d * Rp;
          for (int64_t r = 0; r < Rp; ++r) {
            const float acc = first ? 0.f : od[r] * s.alpha[r];
            od[r] = masked_pair_chain(
                acc, bk2, [&](int64_t k) { return s.vp[k * Dvp + d]; }, [&](int64_t k) { return s.ptp[k * Rp + r]; },
                [&](int64_t k, int h) { return 2 * k + h >= bk || !s.vis[(2 * k + h) * Rp + r]; });
          }
        }
      } else if (pairwise) {
        for (int64_t d = 0; d < Dv; ++d) {
          float* od = s.ot + d * Rp;
          for (int64_t r = 0; r < Rp; ++r) {
            float acc = first ? 0.f : od[r] * s.alpha[r];
            for (int64_t j = 0; j < bk; ++j)
              if (s.vis[j * Rp + r]) acc += s.st[j * Rp + r] * Vb[j * ldv + d];
            od[r] = acc;
          }
        }
      } else if constexpr (kPairs) {
        const int64_t bk2 = (bk + 1) / 2;
        if (!pairs_softmax) pack_probs<Dot>(s.st, Rp, bk, s.ptp);
        pack_key_pairs(vrows, j0, bk, Dv, s.vp, Dvp);
        if (first)
          gemm_pairs<Dot, CMode::Store>(Dv, Rp, bk2, s.vp, 1, Dvp, s.ptp, Rp, s.ot, Rp);
        else
          gemm_pairs<Dot, CMode::Rescale>(Dv, Rp, bk2, s.vp, 1, Dvp, s.ptp, Rp, s.ot, Rp, s.alpha);
      } else if (first) {
        gemm<CMode::Store>(Dv, Rp, bk, Vb, 1, ldv, s.st, Rp, s.ot, Rp);
      } else {
        gemm<CMode::Rescale>(Dv, Rp, bk, Vb, 1, ldv, s.st, Rp, s.ot, Rp, s.alpha);
      }
      first = false;
    }

    // Rows of O (the padding rows of O^T, Dv .. Dvp, are never read back).
    transpose(s.ot, Rp, s.orow, Dvp, Dvp, Rp);
  }
  const float keep_scale = dropout ? static_cast<float>(1.0 / (1.0 - static_cast<double>(p.dropout_p))) : 1.f;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t h = rb.h0 + r / rb.nq, i = row_i(r);
    const float l = s.l[r];
    // Only a row that saw no key has l = 0 (any visible key adds its 2^0 = 1 at the max); a NaN
    // l (a NaN or inf among the visible inputs) is not dead: it gives lse NaN, as the math does.
    const bool dead = l == 0.f;
    const float inv = dead ? 0.f : keep_scale / l;
    // lse leaves in natural log and comes back in base 2 in the backward: round once each way
    // (in double), so the probabilities recomputed from it stay as exact as the scores. l >= 1
    // (the row's max contributes 1), so log2f's ulp-level error stays below 1e-6.
    const double lse2 = dead ? -std::numeric_limits<double>::infinity() : static_cast<double>(s.m[r]) + std::log2(l);
    const float* src = s.orow + r * Dvp;
    if (sink.part_o == nullptr) {
      T* orow = static_cast<T*>(p.out.ptr) + b * p.out.sb + h * p.out.sh + i * p.out.sl;
      if (dead)
        std::fill(orow, orow + Dv, static_cast<T>(0.f));
      else
        store_row(src, Dv, inv, orow);
      p.lse[(b * p.H + h) * p.lse_sh + i] = dead ? kNegInf : static_cast<float>(lse2 * kLn2d);
    } else {
      const int64_t row = ((sink.split * p.B + b) * p.H + h) * p.Lq + i;
      float* po = sink.part_o + row * Dv;
      for (int64_t dv = 0; dv < Dv; ++dv) po[dv] = dead ? 0.f : src[dv] * inv;
      sink.part_m[row] = dead ? kNegInf : s.m[r];
      sink.part_l[row] = l;
    }
  }
}

// Merges the key-range partials of every row, in range order: range s weighs
// l_s * 2^(m_s - max m) (0 for a range that saw no key: l_s = 0, m_s = -inf).
template <typename T>
void merge_splits(const AttnParams& p, int64_t n_splits, const float* part_o, const float* part_m,
                  const float* part_l) {
  const int64_t rows = p.B * p.H * p.Lq, Dv = p.Dv;
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    Scratch buf(Dv + n_splits + 32, Scratch::kUninit);  // acc and w written before read
    float* acc = buf.take(Dv);
    float* w = buf.take(n_splits);
    for (int64_t row = r0; row < r1; ++row) {
      const int64_t i = row % p.Lq, h = (row / p.Lq) % p.H, b = row / (p.Lq * p.H);
      float mx = kNegInf;
      bool nan = false;  // a range's sum is NaN: so is the row's softmax, hence out and lse
      for (int64_t sp = 0; sp < n_splits; ++sp) {
        const float ms = part_m[sp * rows + row], ls = part_l[sp * rows + row];
        nan = nan || ls != ls || ms != ms;
        mx = std::max(mx, ms);
      }
      T* orow = static_cast<T*>(p.out.ptr) + b * p.out.sb + h * p.out.sh + i * p.out.sl;
      if (nan) {
        for (int64_t dv = 0; dv < Dv; ++dv) orow[dv] = static_cast<T>(std::numeric_limits<float>::quiet_NaN());
        p.lse[(b * p.H + h) * p.lse_sh + i] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      if (mx == kNegInf) {
        for (int64_t dv = 0; dv < Dv; ++dv) orow[dv] = static_cast<T>(0.f);
        p.lse[(b * p.H + h) * p.lse_sh + i] = kNegInf;
        continue;
      }
      float wsum = 0.f;
      for (int64_t sp = 0; sp < n_splits; ++sp) {
        const float ms = part_m[sp * rows + row];
        w[sp] = ms == kNegInf ? 0.f : part_l[sp * rows + row] * std::exp2(ms - mx);
        wsum += w[sp];
      }
      std::fill(acc, acc + Dv, 0.f);
      for (int64_t sp = 0; sp < n_splits; ++sp) {
        if (w[sp] == 0.f) continue;
        const float* po = part_o + (sp * rows + row) * Dv;
        for (int64_t dv = 0; dv < Dv; ++dv) acc[dv] += w[sp] * po[dv];
      }
      const float inv = 1.f / wsum;
      for (int64_t dv = 0; dv < Dv; ++dv) orow[dv] = static_cast<T>(acc[dv] * inv);
      p.lse[(b * p.H + h) * p.lse_sh + i] = static_cast<float>((static_cast<double>(mx) + std::log2(static_cast<double>(wsum))) * kLn2d);
    }
  });
}

template <typename T, typename Dot = void>
void forward_impl(const AttnParams& p) {
  if (p.B == 0 || p.H == 0 || p.Lq == 0) return;
  const int64_t n_rep = p.H / p.Hkv;
  const RowPlan rp = plan_rows(n_rep, p.Lq);
  const int64_t nblk = rp.blocks();
  const int64_t base = p.B * p.Hkv * nblk;
  const int64_t rows = p.B * p.H * p.Lq;
  int64_t n_splits = plan_key_splits(base, p.Lk, 1024, rows * (p.Dv + 2));
  int64_t span = p.Lk;
  if (n_splits > 1) {
    span = round_up(ceil_div(p.Lk, n_splits), kKeyBlock);
    n_splits = ceil_div(p.Lk, span);
  }
  const int64_t Rpmax = round_up(rp.max_rows(), VL);
  const ScoreMods mods(p);
  const int64_t Dp = round_up(p.D, VL), Dvp = round_up(p.Dv, VL);
  constexpr bool kPairs = !std::is_void_v<Dot>;
  const int64_t per_thread = FwdScratch::floats(Dp, Dvp, Rpmax, mods, kPairs);

  std::unique_ptr<Scratch> partials;
  FwdSink sink;
  if (n_splits > 1) {
    // Every (split, row) is written by its task before the merge reads it.
    partials = std::make_unique<Scratch>(n_splits * rows * (p.Dv + 2) + 64, Scratch::kUninit);
    sink.part_o = partials->take(n_splits * rows * p.Dv);
    sink.part_m = partials->take(n_splits * rows);
    sink.part_l = partials->take(n_splits * rows);
  }
  at::parallel_for(0, base * n_splits, 1, [&](int64_t t0, int64_t t1) {
    Scratch buf(per_thread, Scratch::kUninit);  // forward_rows writes each tile before reading it
    const FwdScratch s(buf, Dp, Dvp, Rpmax, mods, kPairs);
    auto task = [&](int64_t t, int64_t* b, int64_t* hkv, int64_t* blk, int64_t* sp) {
      *sp = t % n_splits;
      *blk = (t / n_splits) % nblk;
      *hkv = (t / (n_splits * nblk)) % p.Hkv;
      *b = t / (n_splits * nblk * p.Hkv);
    };
    for (int64_t t = t0; t < t1; ++t) {
      int64_t b, hkv, blk, sp;
      if (t + 1 < t1) {
        int64_t b1, hkv1, blk1, sp1;
        task(t + 1, &b1, &hkv1, &blk1, &sp1);
        const int64_t j1 = sp1 * span, n1 = std::min({kKeyBlock, span, p.Lk - j1});
        prefetch_block_rows<T>(p.q, b1, row_block(rp, hkv1, blk1), p.D);
        if (n_splits == 1) prefetch_block_rows<T, 1>(p.out, b1, row_block(rp, hkv1, blk1), p.Dv);
        if (n1 > 0) {  // a paged row's address reads the block table: only rows that exist
          const KvRows<T> k1(p, p.k, b1, hkv1), v1(p, p.v, b1, hkv1);
          prefetch_rows(k1.row(j1), k1.run(j1, n1), p.D, p.k.sl);
          prefetch_rows(v1.row(j1), v1.run(j1, n1), p.Dv, p.v.sl);
        }
      }
      task(t, &b, &hkv, &blk, &sp);
      FwdSink my = sink;
      my.split = sp;
      const int64_t kbeg = sp * span, kend = std::min(p.Lk, kbeg + span);
      if (mods.any())
        forward_rows<T, true, Dot>(p, mods, b, row_block(rp, hkv, blk), kbeg, kend, s, my);
      else
        forward_rows<T, false, Dot>(p, mods, b, row_block(rp, hkv, blk), kbeg, kend, s, my);
    }
  });
  if (n_splits > 1) merge_splits<T>(p, n_splits, sink.part_o, sink.part_m, sink.part_l);
}

}  // namespace CPU_CAPABILITY
}  // namespace mhakern::cpu
