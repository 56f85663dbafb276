// The cpu backward: a task owns (batch, KV head, key range); backward_group gathers the query
// rows of the heads sharing the KV head once, then per key block recomputes P from lse and
// accumulates dV, dK (owned by the task) and dQ (per row block, as rows); backward_impl runs the tasks
// and sums split dQ partials in a fixed order.
#pragma once

#include <ATen/Parallel.h>

#include <cmath>
#include <memory>

#include "bf16_dot.h"
#include "gemm.h"
#include "modes.h"

namespace mhakern::cpu {
namespace CPU_CAPABILITY {

// Per row block: the gathered operands and the dQ accumulator.
struct RowSlot {
  RowBlock rb;
  float *qr, *qt, *dor, *dot, *lse2, *delta, *dqr;  // dqr: dQ of the rows (Rp x Dp)
  float* dead;      // 1 for a row that sees no key (lse -inf) and for padding rows, else 0
  uint32_t* rseed;  // dropout: the rows' r_i
  // The bf16 products (Dot not void): Q^T and dO^T as pairs along D / Dv, Q and dO as pairs of rows.
  uint32_t *qtp, *dotp, *qrp, *dorp;
  BlockRanges br;
  bool poisoned;  // some live row has an inf or NaN in q, dout, delta or lse
  bool dq_started;
  bool qt_ready;  // fp32: qt, dot hold Q^T, dO^T (made on first use: row_tiles reads Q and dO as rows)
};

struct BwdLayout {
  int64_t Dp, Dvp, Rp;  // Rp: the largest block's
  bool pairs = false;   // the bf16 products' operands too
  int64_t slot_floats() const {
    return Scratch::size_of(Rp * Dp) + Scratch::size_of(Dp * Rp) + Scratch::size_of(Rp * Dvp) +
           Scratch::size_of(Dvp * Rp) + 4 * Scratch::size_of(Rp) + Scratch::size_of(Dp * Rp) +
           (pairs ? 2 * Scratch::size_of(Dp / 2 * Rp) + 2 * Scratch::size_of(Dvp / 2 * Rp) : 0);
  }
};

// The dropout constants of a call, shared by every step.
struct DropoutConsts {
  bool on;
  uint32_t threshold;
  float keep_scale;  // 1 / (1 - p)
  int64_t k0;        // ModeParams::dropout_k0: the position the hash sees for key 0
  explicit DropoutConsts(const AttnParams& p)
      : on(p.dropout_p > 0.f),
        threshold(on ? dropout_threshold(p.dropout_p) : 0),
        keep_scale(on ? static_cast<float>(1.0 / (1.0 - static_cast<double>(p.dropout_p))) : 1.f),
        k0(p.dropout_k0) {}
};

// A task's per key block tiles: S^T / P^T and dP^T / dS^T (keys x rows), the block's dK and dV
// accumulators, K and V converted to fp32, the rows' range limits and keep factors, the rows of
// dQ on the way out, and the pairwise visibility.
struct BwdTiles {
  float *st, *dst, *dkb, *dvb, *kc, *vc, *lorel, *hirel, *kv, *kpad;
  float *kt, *vt;  // the key block's K^T, V^T (D x bkp, Dv x bkp) for row-major score tiles
  uint8_t* vis;
  // The bf16 products: P^T, dS^T as pairs of rows (bk x Rp / 2), dS as pairs of keys
  // (bk / 2 x Rp), the key block as pairs along D (kd) and of keys (kk), V as pairs along Dv.
  uint32_t *stp = nullptr, *dstp = nullptr, *dsp = nullptr, *kd = nullptr, *kk = nullptr, *vd = nullptr;
  ModScratch ms;
  static int64_t pair_floats(const BwdLayout& L) {
    return 3 * Scratch::size_of(kKeyBlock * L.Rp / 2) + Scratch::size_of(kKeyBlock * L.Dp / 2) +
           Scratch::size_of(kKeyBlock / 2 * L.Dp) + Scratch::size_of(kKeyBlock * L.Dvp / 2);
  }
  static int64_t floats(const BwdLayout& L, const ScoreMods& mods) {
    return mods.floats(L.Rp, true) + 2 * Scratch::size_of(kKeyBlock * L.Rp) + 2 * Scratch::size_of(kKeyBlock * L.Dp) +
           2 * Scratch::size_of(kKeyBlock * L.Dvp) + 3 * Scratch::size_of(L.Rp) + Scratch::size_of(kKeyBlock * L.Dp) +
           Scratch::size_of(kKeyBlock * L.Rp / 4) + Scratch::size_of(kKeyBlock * L.Dp) +
           Scratch::size_of(kKeyBlock * L.Dvp) + (L.pairs ? pair_floats(L) : 0);
  }
  BwdTiles(Scratch& buf, const BwdLayout& L, const ScoreMods& mods) {
    st = buf.take(kKeyBlock * L.Rp);
    dst = buf.take(kKeyBlock * L.Rp);
    dkb = buf.take(kKeyBlock * L.Dp);
    dvb = buf.take(kKeyBlock * L.Dvp);
    kc = buf.take(kKeyBlock * L.Dp);
    vc = buf.take(kKeyBlock * L.Dvp);
    lorel = buf.take(L.Rp);
    hirel = buf.take(L.Rp);
    kv = buf.take(L.Rp);
    kpad = buf.take(kKeyBlock * L.Dp);
    vis = reinterpret_cast<uint8_t*>(buf.take(kKeyBlock * L.Rp / 4));
    kt = buf.take(kKeyBlock * L.Dp);
    vt = buf.take(kKeyBlock * L.Dvp);
    ms = ModScratch(buf, mods, L.Rp, true);
    if (L.pairs) {
      auto take = [&](int64_t n) { return reinterpret_cast<uint32_t*>(buf.take(n)); };
      stp = take(kKeyBlock * L.Rp / 2);
      dstp = take(kKeyBlock * L.Rp / 2);
      dsp = take(kKeyBlock * L.Rp / 2);
      kd = take(kKeyBlock * L.Dp / 2);
      kk = take(kKeyBlock / 2 * L.Dp);
      vd = take(kKeyBlock * L.Dvp / 2);
    }
  }
};

// Step 0: this task owns dmask[b, its query heads, :, kbeg:kend); what no key block writes is 0.
MHK_STEP void zero_dmask_range(const AttnParams& p, const RowPlan& rp, int64_t b, int64_t hkv, int64_t kbeg,
                               int64_t kend) {
  for (int64_t h = hkv * rp.n_rep; h < (hkv + 1) * rp.n_rep; ++h)
    for (int64_t i = 0; i < p.Lq; ++i) {
      float* dm = p.dmask + ((b * p.H + h) * p.Lq + i) * p.Lk;
      std::fill(dm + kbeg, dm + kend, 0.f);
    }
}

// delta = dO . O rounded as score_tiles' GEMM rounds dP = dO . V_j (one multiply-add per
// element, d = 0, 1, .., in the micro-kernel's own fmadd): a row that sees one key has O = V_j
// exactly, so dP - delta is exactly 0 there and so are its dS, dQ and dK, as in the math
// (softmax over one key), instead of the rounding difference of two differently summed dot
// products (docs/contract.md, "Tolerance rule").
//
// Where Vec's fmadd is the fused instruction (AVX2, AVX-512): from the rows as gathered (Rp rows
// of dO and O, row stride ld, zero past R; Rp a multiple of 8), eight rows' chains interleaved
// so that each waits on its own latency only. A fused multiply-add rounds once in a vector lane
// or in a scalar alike, so these are the lanes' bits. Transposing dO and O to run the rows as
// lanes was 11% of the backward at 20 rows, head dim 64 (0.18 of 1.6 ms, one thread); the
// backward is 2% faster this way. Elsewhere (ATen's generic Vectorized, whose fmadd may round
// twice) the lanes of dO^T and O^T (dot, ot: Dv x Rp), as before. Rows R .. Rp - 1 get 0.
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
constexpr bool kDeltaMakesDoT = false;
#else
constexpr bool kDeltaMakesDoT = true;  // the lanes' path leaves dO^T in dot
#endif

inline void delta_rows(const float* dor, const float* orow, int64_t ld, int64_t R, int64_t Rp, int64_t Dv,
                       float* dot, float* ot, float* delta) {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  (void)dot, (void)ot;
  // Whole groups of eight rows, the last padded with rows R .. Rp - 1 (zero as gathered): a group
  // of fewer chains waits on their latency (rows 16 .. 19 as single chains lost most of the gain).
  for (int64_t r = 0; r < R; r += 8) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t d = 0; d < Dv; ++d)
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) acc[i] = std::fma(orow[(r + i) * ld + d], dor[(r + i) * ld + d], acc[i]);
    for (int i = 0; i < 8; ++i) delta[r + i] = acc[i];
  }
  std::fill(delta + R, delta + Rp, 0.f);
#else
  transpose(dor, ld, dot, Rp, Rp, ld);
  transpose(orow, ld, ot, Rp, Rp, ld);
  for (int64_t v = 0; v < Rp; v += VL) {
    Vec acc(0.f);
    for (int64_t d = 0; d < Dv; ++d)
      acc = at::vec::fmadd(Vec::loadu(ot + d * Rp + v), Vec::loadu(dot + d * Rp + v), acc);
    acc.store(delta + v);  // rows R .. Rp - 1 are zero as gathered: their lanes give 0
  }
#endif
}

// Step 1, once per row block of the group: Q (scaled) and dO as rows and transposed (fp32: Q^T
// and dO^T later, where a keys x rows tile needs them), lse in base 2 and delta = rowsum(dO * O)
// (which dropout leaves valid: O is the dropped output), the rows' key ranges and dropout seeds.
// Rows that see no key (lse -inf) stay zero. With the bf16 products (Dot not void) Q stays
// unscaled (exact), its scale goes to the scores, dK and dQ.
template <typename T, typename Dot = void>
MHK_STEP void gather_rows(const AttnParams& p, const RowPlan& rp, int64_t b, int64_t hkv, int64_t blk,
                          const BwdLayout& L, const DropoutConsts& drop, Scratch& buf, float* otile,
                          RowSlot& sl) {
  constexpr bool kPairs = !std::is_void_v<Dot>;
  const int64_t D = p.D, Dv = p.Dv, Dp = L.Dp, Dvp = L.Dvp;
  const float qmul = kPairs ? 1.f : p.scale * kLog2e;
  sl.rb = row_block(rp, hkv, blk);
  const int64_t R = sl.rb.rows(), Rp = round_up(R, VL);
  sl.qr = buf.take(L.Rp * Dp);
  sl.qt = buf.take(Dp * L.Rp);
  sl.dor = buf.take(L.Rp * Dvp);
  sl.dot = buf.take(Dvp * L.Rp);
  sl.lse2 = buf.take(L.Rp);
  sl.delta = buf.take(L.Rp);
  sl.dead = buf.take(L.Rp);
  sl.rseed = reinterpret_cast<uint32_t*>(buf.take(L.Rp));
  sl.dqr = buf.take(L.Rp * Dp);
  if constexpr (kPairs) {
    sl.qtp = reinterpret_cast<uint32_t*>(buf.take(Dp / 2 * L.Rp));
    sl.qrp = reinterpret_cast<uint32_t*>(buf.take(Dp / 2 * L.Rp));
    sl.dotp = reinterpret_cast<uint32_t*>(buf.take(Dvp / 2 * L.Rp));
    sl.dorp = reinterpret_cast<uint32_t*>(buf.take(Dvp / 2 * L.Rp));
  }
  sl.dq_started = false;
  sl.qt_ready = false;
  sl.poisoned = false;
  sl.br = BlockRanges{};
  float* orows = otile;               // O of the block's rows (Rp x Dvp)
  float* ot = otile + L.Rp * Dvp;       // and transposed (Dvp x Rp)
  for (int64_t r = 0; r < Rp; ++r) {
    float* qd = sl.qr + r * Dp;
    float* dd = sl.dor + r * Dvp;
    float* od = orows + r * Dvp;
    sl.lse2[r] = 0.f;
    const int64_t h = sl.rb.h0 + r / sl.rb.nq, i = sl.rb.i0 + r % sl.rb.nq;
    const float lse = r < R ? p.lse[(b * p.H + h) * p.lse_sh + i] : kNegInf;
    // Only lse = -inf marks a row that saw nothing: a NaN lse (NaN among the visible inputs)
    // is live, and spreads its NaN through the gradients it touches.
    const bool dead = lse == kNegInf;
    sl.dead[r] = dead ? 1.f : 0.f;
    sl.rseed[r] = drop.on && r < R ? dropout_row_seed(p, b, h, i) : 0u;
    if (r < R) sl.br.add(dead ? KeyRange{0, 0} : row_range(p, b, i));
    if (dead) {
      // Zero dO and O: the row's delta is then exactly 0.
      std::fill(qd, qd + Dp, 0.f);
      std::fill(dd, dd + Dvp, 0.f);
      std::fill(od, od + Dvp, 0.f);
      continue;
    }
    sl.lse2[r] = static_cast<float>(static_cast<double>(lse) * kLog2ed);
    load_row(static_cast<const T*>(p.q.ptr) + b * p.q.sb + h * p.q.sh + i * p.q.sl, D, qmul, qd, Dp);
    load_row(static_cast<const T*>(p.dout.ptr) + b * p.dout.sb + h * p.dout.sh + i * p.dout.sl, Dv, 1.f, dd, Dvp);
    load_row(static_cast<const T*>(p.out.ptr) + b * p.out.sb + h * p.out.sh + i * p.out.sl, Dv, 1.f, od, Dvp);
    sl.poisoned = sl.poisoned || !std::isfinite(sl.lse2[r]) || any_nonfinite(qd, 1, D, Dp) ||
                  any_nonfinite(dd, 1, Dv, Dvp);
  }
  if constexpr (kPairs) {
    pack_rows_transposed(sl.qr, Dp, Rp, sl.qtp, sl.qt);  // sl.qt, sl.dot: scratch here
    pack_rows_transposed(sl.dor, Dvp, Rp, sl.dotp, sl.dot);
    pack_row_pairs(sl.qr, Dp, Rp, Dp, sl.qrp, Dp);
    pack_row_pairs(sl.dor, Dvp, Rp, Dvp, sl.dorp, Dvp);
    // delta on the chain of dP's products (O is bf16: exact as pairs).
    uint32_t* otp = reinterpret_cast<uint32_t*>(ot);
    pack_rows_transposed(orows, Dvp, Rp, otp, sl.dot);
    dot_lanes_chain<Dot>(otp, sl.dotp, (Dv + 1) / 2, Rp, sl.delta);
  } else {
    delta_rows(sl.dor, orows, Dvp, R, Rp, Dv, sl.dot, ot, sl.delta);
  }
  for (int64_t r = 0; r < R && !sl.poisoned; ++r) sl.poisoned = !std::isfinite(sl.delta[r]);
}

// Step 2: the score tile S^T = K_blk * Q^T and dP^T = V_blk * dO^T (bk x Rp) of a row block,
// with the score modifiers as in the forward (the cap's derivative kept), then masked:
// attn_mask, then the rows' ranges where the block cuts one (-inf scores give P = 0).
// With the bf16 products, Kd / Vd (pairs along D / Dv, row strides ldkd / ldvd) replace Kb / Vb.
template <typename Dot = void>
MHK_STEP void score_tiles(const AttnParams& p, const ScoreMods& mods, int64_t b, const RowSlot& sl, int64_t j0,
                          int64_t bk, const float* Kb, int64_t ldk, const float* Vb, int64_t ldv, const BwdTiles& t,
                          const uint32_t* Kd = nullptr, int64_t ldkd = 0, const uint32_t* Vd = nullptr,
                          int64_t ldvd = 0) {
  const int64_t R = sl.rb.rows(), Rp = round_up(R, VL);
  auto row_i = [&](int64_t r) { return sl.rb.i0 + r % sl.rb.nq; };
  if constexpr (!std::is_void_v<Dot>) {
    gemm_pairs<Dot, CMode::Store>(bk, Rp, (p.D + 1) / 2, Kd, ldkd, 1, sl.qtp, Rp, t.st, Rp, nullptr,
                                  p.scale * kLog2e);
    gemm_pairs<Dot, CMode::Store>(bk, Rp, (p.Dv + 1) / 2, Vd, ldvd, 1, sl.dotp, Rp, t.dst, Rp);
  } else {
    gemm<CMode::Store>(bk, Rp, p.D, Kb, ldk, 1, sl.qt, Rp, t.st, Rp);
    gemm<CMode::Store>(bk, Rp, p.Dv, Vb, ldv, 1, sl.dot, Rp, t.dst, Rp);
  }
  if (mods.any()) apply_score_mods(p, mods, t.ms, t.st, Rp, bk, b, sl.rb, j0);
  const bool ragged = sl.br.ragged(j0, bk);
  if (p.mask) apply_attn_mask(p, t.st, Rp, bk, b, sl.rb, j0);
  if (ragged) {
    range_limits(p, b, R, Rp, j0, bk, row_i, sl.dead, t.lorel, t.hirel);
    mask_block(t.st, Rp, bk, t.lorel, t.hirel, j0 < sl.br.maxlo);
  }
}

// Step 3: P^T = 2^(S^T - lse2); dS^T = P^T * (dP^T - delta), in place. With dropout, P^T is
// replaced by the dropped Pd^T = P^T * keep / (1 - p) (dV's operand) and
// dS^T = P^T * (dP^T * keep / (1 - p) - delta), dP^T being the gradient of Pd^T.
MHK_STEP void probs_and_dscores(const RowSlot& sl, int64_t j0, int64_t bk, const DropoutConsts& drop,
                                const BwdTiles& t) {
  const int64_t Rp = round_up(sl.rb.rows(), VL), nvec = Rp / VL;
  if (!drop.on) {
    for (int64_t j = 0; j < bk; ++j) {
      float* sp = t.st + j * Rp;
      float* dp = t.dst + j * Rp;
      for (int64_t v = 0; v < nvec; ++v) {
        const Vec pj = exp2v(Vec::loadu(sp + v * VL) - Vec::loadu(sl.lse2 + v * VL));
        pj.store(sp + v * VL);
        (pj * (Vec::loadu(dp + v * VL) - Vec::loadu(sl.delta + v * VL))).store(dp + v * VL);
      }
    }
  } else {
    for (int64_t j = 0; j < bk; ++j) {
      float* sp = t.st + j * Rp;
      float* dp = t.dst + j * Rp;
      dropout_keep(sl.rseed, Rp, j0 + j + drop.k0, drop.threshold, drop.keep_scale, t.kv);
      for (int64_t v = 0; v < nvec; ++v) {
        const Vec pj = exp2v(Vec::loadu(sp + v * VL) - Vec::loadu(sl.lse2 + v * VL));
        const Vec kj = Vec::loadu(t.kv + v * VL);
        (pj * kj).store(sp + v * VL);
        (pj * (Vec::loadu(dp + v * VL) * kj - Vec::loadu(sl.delta + v * VL))).store(dp + v * VL);
      }
    }
  }
}

// Steps 3 and 5a's packing in one pass, for the bf16 products where nothing else reads the fp32
// tiles (no dropout, dmask, softcap or pairwise tile): P = 2^(S - lse2) (exp2v_short: P is rounded
// to bf16) and dS = P (dP - delta), rounded straight into the pairs the products take
// (P^T and dS^T along the rows, dS across two keys), NV row vectors at a time in registers.
template <typename Dot, int NV>
MHK_STEP void probs_dscores_to_pairs_nv(const RowSlot& sl, int64_t bk, const BwdTiles& t) {
  constexpr int64_t Rp = NV * VL, h2 = Rp / 2;
  Vec lse[NV], dl[NV];
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) {
    lse[v] = Vec::loadu(sl.lse2 + v * VL);
    dl[v] = Vec::loadu(sl.delta + v * VL);
  }
  // P^T and dS^T of key j as pairs along its row: whole runs of two vectors, then (NV odd) the
  // last vector's VL / 2 pairs through a bounce buffer.
  auto runs = [&](const Vec* x, uint32_t* d) {
#pragma GCC unroll 8
    for (int v = 0; v + 2 <= NV; v += 2) Dot::round_runs(x[v], x[v + 1], d + v * VL / 2);
    if constexpr (NV % 2 == 1) {
      uint32_t tmp[VL];
      Dot::round_runs(x[NV - 1], Vec(0.f), tmp);
      std::memcpy(d + (NV - 1) * VL / 2, tmp, VL / 2 * sizeof(uint32_t));
    }
  };
  for (int64_t j = 0; j < bk; j += 2) {
    const bool two = j + 1 < bk;
    Vec p0[NV], d0[NV], p1[NV], d1[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      p0[v] = exp2v_short(Vec::loadu(t.st + j * Rp + v * VL) - lse[v]);
      d0[v] = p0[v] * (Vec::loadu(t.dst + j * Rp + v * VL) - dl[v]);
      if (two) {
        p1[v] = exp2v_short(Vec::loadu(t.st + (j + 1) * Rp + v * VL) - lse[v]);
        d1[v] = p1[v] * (Vec::loadu(t.dst + (j + 1) * Rp + v * VL) - dl[v]);
      } else {
        p1[v] = d1[v] = Vec(0.f);  // a zero key past bk
      }
    }
    runs(p0, t.stp + j * h2);
    runs(d0, t.dstp + j * h2);
    if (two) {
      runs(p1, t.stp + (j + 1) * h2);
      runs(d1, t.dstp + (j + 1) * h2);
    }
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) Dot::round_pairs(d0[v], d1[v], t.dsp + (j / 2) * Rp + v * VL);
  }
}

// Steps 2, 3 and the packing fused for the bf16 products on the instruction, where the scores
// go unchanged from their products to P (no modifier, mask, cut range, dropout, dmask or pairwise
// tile): MR keys x NV row vectors of S and of dP in registers (2 MR NV accumulators), their
// epilogue P = 2^(S - lse2), dS = P (dP - delta) rounded straight into P^T, dS^T (pairs along
// the rows) and dS (pairs of keys: MR even). The chains, the scaling and the operations are
// those of score_tiles and probs_dscores_to_pairs, so the bits are theirs (the model, which runs
// those, checks it bit for bit); the S^T and dP^T tiles are never stored.
// Rows j .. j + MR - 1 of the block, row vectors col0 .. col0 + NV VL - 1.
// Never inlined: inside backward_group the accumulators went to the stack (the backward 25%
// slower than unfused).
template <typename Dot, int MR, int NV>
#if defined(__GNUC__)
__attribute__((noinline))
#endif
void scores_to_pairs_tile(int64_t j, int64_t col0, int64_t D2, const uint32_t* Kd, int64_t ldkd,
                                   int64_t Dv2, const uint32_t* Vd, int64_t ldvd, float cmul, const RowSlot& sl,
                                   int64_t Rp, const BwdTiles& t) {
  static_assert(MR % 2 == 0, "dS pairs two keys of a tile");
  Vec sc[MR][NV], dp[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) sc[i][v] = dp[i][v] = Vec(0.f);
  for (int64_t kk = 0; kk < D2; ++kk) {
    typename Dot::BV bq[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bq[v] = Dot::load(sl.qtp + kk * Rp + col0 + v * VL);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const typename Dot::BV a = Dot::bcast(Kd[(j + i) * ldkd + kk]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) sc[i][v] = Dot::dp(sc[i][v], a, bq[v]);
    }
  }
  for (int64_t kk = 0; kk < Dv2; ++kk) {
    typename Dot::BV bo[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bo[v] = Dot::load(sl.dotp + kk * Rp + col0 + v * VL);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const typename Dot::BV a = Dot::bcast(Vd[(j + i) * ldvd + kk]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) dp[i][v] = Dot::dp(dp[i][v], a, bo[v]);
    }
  }
  const int64_t h2 = Rp / 2;
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) {
    const Vec lse = Vec::loadu(sl.lse2 + col0 + v * VL), dl = Vec::loadu(sl.delta + col0 + v * VL);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      // S rounded alone, as score_tiles stores it (x 1 is exact: as pair_kernel's skip).
      sc[i][v] = exp2v_short(opaque(sc[i][v] * Vec(cmul)) - lse);
      dp[i][v] = sc[i][v] * (dp[i][v] - dl);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int v = 0; v + 2 <= NV; v += 2) {
      Dot::round_runs(sc[i][v], sc[i][v + 1], t.stp + (j + i) * h2 + (col0 + v * VL) / 2);
      Dot::round_runs(dp[i][v], dp[i][v + 1], t.dstp + (j + i) * h2 + (col0 + v * VL) / 2);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; i += 2)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) Dot::round_pairs(dp[i][v], dp[i + 1][v], t.dsp + (j + i) / 2 * Rp + col0 + v * VL);
}

// scores_to_pairs_tile over the key block (bk even) and the row block (Rp a multiple of 2 VL):
// tiles of 6 keys by 2 row vectors (24 accumulators; 2 B vectors and a broadcast of the 32
// AVX-512 registers), then 4 or 2 keys.
template <typename Dot>
inline void scores_to_pairs(const AttnParams& p, const RowSlot& sl, int64_t bk, const uint32_t* Kd, int64_t ldkd,
                              const uint32_t* Vd, int64_t ldvd, const BwdTiles& t) {
  constexpr int NV = 2;
  const int64_t Rp = round_up(sl.rb.rows(), VL), D2 = (p.D + 1) / 2, Dv2 = (p.Dv + 1) / 2;
  const float cmul = p.scale * kLog2e;
  for (int64_t col0 = 0; col0 < Rp; col0 += NV * VL) {
    int64_t j = 0;
    for (; j + 6 <= bk; j += 6) scores_to_pairs_tile<Dot, 6, NV>(j, col0, D2, Kd, ldkd, Dv2, Vd, ldvd, cmul, sl, Rp, t);
    if (bk - j == 4) scores_to_pairs_tile<Dot, 4, NV>(j, col0, D2, Kd, ldkd, Dv2, Vd, ldvd, cmul, sl, Rp, t);
    if (bk - j == 2) scores_to_pairs_tile<Dot, 2, NV>(j, col0, D2, Kd, ldkd, Dv2, Vd, ldvd, cmul, sl, Rp, t);
  }
}

// probs_dscores_to_pairs_nv for the block's Rp / VL (1 .. kRowVecs) row vectors.
template <typename Dot, int NV = kRowVecs>
inline void probs_dscores_to_pairs(const RowSlot& sl, int64_t bk, const BwdTiles& t) {
  if constexpr (NV > 0) {
    if (round_up(sl.rb.rows(), VL) == NV * VL) return probs_dscores_to_pairs_nv<Dot, NV>(sl, bk, t);
    probs_dscores_to_pairs<Dot, NV - 1>(sl, bk, t);
  }
}

// Step 4 (mask_grad): dL/dscore of the live rows of the tile into dmask (hidden pairs have
// exactly 0 there).
MHK_STEP void store_dmask(const AttnParams& p, int64_t b, const RowSlot& sl, int64_t j0, int64_t bk, const float* dst) {
  const int64_t R = sl.rb.rows(), Rp = round_up(R, VL);
  for (int64_t r = 0; r < R; ++r) {
    if (sl.dead[r] != 0.f) continue;
    const int64_t i = sl.rb.i0 + r % sl.rb.nq;
    float* dm = p.dmask + ((b * p.H + sl.rb.h0 + r / sl.rb.nq) * p.Lq + i) * p.Lk + j0;
    for (int64_t j = 0; j < bk; ++j) dm[j] = dst[j * Rp + r];
  }
}

// Step 4b (softcap): dS^T of the raw product, dS^T * (1 - tanh^2). After store_dmask: the mask is
// added to the capped score, so its gradient is the unchained one. In a pairwise tile a hidden
// pair's factor may be NaN (its raw score was); step 5b never reads hidden pairs.
MHK_STEP void chain_softcap(const RowSlot& sl, int64_t bk, const BwdTiles& t) {
  const int64_t Rp = round_up(sl.rb.rows(), VL);
  for (int64_t e = 0; e < bk * Rp; e += VL)
    (Vec::loadu(t.dst + e) * Vec::loadu(t.ms.dcap + e)).store(t.dst + e);
}

// The bf16 products' operands of a tile: P^T and dS^T rounded to bf16 (as the GPU kernels round
// them) as pairs of rows, dS as pairs of keys.
template <typename Dot>
MHK_STEP void pack_tile_pairs(const RowSlot& sl, int64_t bk, const BwdTiles& t) {
  const int64_t Rp = round_up(sl.rb.rows(), VL);
  pack_cols_rounded<Dot>(t.st, bk, Rp, t.stp);
  pack_cols_rounded<Dot>(t.dst, bk, Rp, t.dstp);
  pack_probs<Dot>(t.dst, Rp, bk, t.dsp);
}

// Step 5a's fp32 products: dV_blk += P^T dO, dK_blk += dS^T Q, dQ += dS K_blk, with P and dS
// read by broadcasts from their tiles in t.st, t.dst, where key j, row r sits at j * ks + r * rs
// (keys x rows tiles: ks = Rp, rs = 1; row_tiles' rows x keys: ks = 1, rs = bkp).
MHK_STEP void fp32_tile_products(RowSlot& sl, int64_t bk, int64_t ks, int64_t rs, const float* Kp, int64_t ldkp,
                                 const BwdLayout& L, const BwdTiles& t, bool& started) {
  const int64_t R = sl.rb.rows(), Dp = L.Dp, Dvp = L.Dvp;
  if (started) {
    gemm<CMode::Accumulate>(bk, Dvp, R, t.st, ks, rs, sl.dor, Dvp, t.dvb, Dvp);
    gemm<CMode::Accumulate>(bk, Dp, R, t.dst, ks, rs, sl.qr, Dp, t.dkb, Dp);
  } else {
    gemm<CMode::Store>(bk, Dvp, R, t.st, ks, rs, sl.dor, Dvp, t.dvb, Dvp);
    gemm<CMode::Store>(bk, Dp, R, t.dst, ks, rs, sl.qr, Dp, t.dkb, Dp);
    started = true;
  }
  if (sl.dq_started) {
    gemm<CMode::Accumulate>(R, Dp, bk, t.dst, rs, ks, Kp, ldkp, sl.dqr, Dp);
  } else {
    gemm<CMode::Store>(R, Dp, bk, t.dst, rs, ks, Kp, ldkp, sl.dqr, Dp);
    sl.dq_started = true;
  }
}

// Step 5a: dV_blk += P^T dO ; dK_blk += dS^T Q ; dQ += dS K_blk, as tile products. dQ is kept as
// rows (R x Dp): its product then runs over the block's R rows, not the Rp of a transposed tile
// (20 rows are 32 with 16-float vectors), with the same multiply-adds in the same order as the
// transposed product, so the same bits. Kp: the key block as rows padded to Dp (ldkp).
// `started`: dK, dV of this key block already hold a contribution (else they are stored).
// With the bf16 products: P^T and dS^T rounded to bf16 (as the GPU kernels round them) and
// paired along the rows for dV and dK, dS paired along the keys for dQ against t.kk.
// `packed`: the bf16 operands are already in the tiles (probs_dscores_to_pairs).
template <typename Dot = void>
MHK_STEP void accumulate_tiles(RowSlot& sl, int64_t bk, const float* Kp, int64_t ldkp, const BwdLayout& L,
                               const BwdTiles& t, bool& started, bool packed = false) {
  const int64_t R = sl.rb.rows(), Rp = round_up(R, VL), Dp = L.Dp, Dvp = L.Dvp;
  if constexpr (!std::is_void_v<Dot>) {
    const int64_t R2 = (R + 1) / 2, bk2 = (bk + 1) / 2;
    if (!packed) pack_tile_pairs<Dot>(sl, bk, t);
    if (started) {
      gemm_pairs<Dot, CMode::Accumulate>(bk, Dvp, R2, t.stp, Rp / 2, 1, sl.dorp, Dvp, t.dvb, Dvp);
      gemm_pairs<Dot, CMode::Accumulate>(bk, Dp, R2, t.dstp, Rp / 2, 1, sl.qrp, Dp, t.dkb, Dp);
    } else {
      gemm_pairs<Dot, CMode::Store>(bk, Dvp, R2, t.stp, Rp / 2, 1, sl.dorp, Dvp, t.dvb, Dvp);
      gemm_pairs<Dot, CMode::Store>(bk, Dp, R2, t.dstp, Rp / 2, 1, sl.qrp, Dp, t.dkb, Dp);
      started = true;
    }
    if (sl.dq_started) {
      gemm_pairs<Dot, CMode::Accumulate>(R, Dp, bk2, t.dsp, 1, Rp, t.kk, Dp, sl.dqr, Dp);
    } else {
      gemm_pairs<Dot, CMode::Store>(R, Dp, bk2, t.dsp, 1, Rp, t.kk, Dp, sl.dqr, Dp);
      sl.dq_started = true;
    }
    return;
  }
  fp32_tile_products(sl, bk, Rp, 1, Kp, ldkp, L, t, started);
}

// Whether row_tiles does a row block's key block in fewer products than the transposed tiles:
// R x bkp score elements against bk x Rp (20 rows are 32 lanes with 16-float vectors; the keys
// pad instead, to whole vectors).
inline bool row_tiles_pay(int64_t R, int64_t bk) { return R * round_up(bk, VL) < bk * round_up(R, VL); }

// Steps 2, 3 and 5a of a plain tile (fp32; no modifier, mask, cut range, dropout, dmask or
// hidden pair) in the rows' own layout: S = Q K^T and dP = dO V^T as R x bkp tiles (rows x keys)
// instead of S^T and dP^T (bk x Rp), so a block of R rows costs R rows of products, not Rp. Each
// element is the chain of multiply-adds the transposed tiles make (a b = b a, and the order over
// d, rows and keys is theirs), so the bits are theirs; the padding keys' columns (bk .. bkp) are
// computed but never read. kt, vt: the key block transposed (keys_transposed).
MHK_STEP void row_tiles(RowSlot& sl, int64_t D, int64_t Dv, int64_t bk, const float* kt, const float* vt,
                        const float* Kp, int64_t ldkp, const BwdLayout& L, const BwdTiles& t, bool& started) {
  const int64_t R = sl.rb.rows(), bkp = round_up(bk, VL), nvec = bkp / VL, Dp = L.Dp, Dvp = L.Dvp;
  gemm<CMode::Store>(R, bkp, D, sl.qr, Dp, 1, kt, bkp, t.st, bkp);
  gemm<CMode::Store>(R, bkp, Dv, sl.dor, Dvp, 1, vt, bkp, t.dst, bkp);
  for (int64_t r = 0; r < R; ++r) {
    const Vec lse(sl.lse2[r]), dl(sl.delta[r]);
    float* sp = t.st + r * bkp;
    float* dp = t.dst + r * bkp;
    for (int64_t v = 0; v < nvec; ++v) {
      const Vec pj = exp2v(Vec::loadu(sp + v * VL) - lse);
      pj.store(sp + v * VL);
      (pj * (Vec::loadu(dp + v * VL) - dl)).store(dp + v * VL);
    }
  }
  fp32_tile_products(sl, bk, 1, bkp, Kp, ldkp, L, t, started);
}

// Step 5b, bf16 products: the same chains as step 5a's pair products, element by element, with
// the hidden pairs' products zeroed (masked_pair_chain), so the visible pairs give the bits the
// tiles give.
template <typename Dot>
MHK_STEP void accumulate_pairwise_pairs(RowSlot& sl, int64_t D, int64_t Dv, int64_t bk, const BwdLayout& L,
                                        const BwdTiles& t, bool& started) {
  const int64_t R = sl.rb.rows(), Rp = round_up(R, VL), Dp = L.Dp, Dvp = L.Dvp;
  const int64_t R2 = (R + 1) / 2, bk2 = (bk + 1) / 2, h2 = Rp / 2;
  pack_tile_pairs<Dot>(sl, bk, t);
  for (int64_t j = 0; j < bk; ++j) {
    const uint8_t* vj = t.vis + j * Rp;
    auto hid = [&](int64_t k, int h) { return 2 * k + h >= R || !vj[2 * k + h]; };
    for (int64_t d = 0; d < Dv; ++d)
      t.dvb[j * Dvp + d] = masked_pair_chain(
          started ? t.dvb[j * Dvp + d] : 0.f, R2, [&](int64_t k) { return t.stp[j * h2 + k]; },
          [&](int64_t k) { return sl.dorp[k * Dvp + d]; }, hid);
    for (int64_t d = 0; d < D; ++d)
      t.dkb[j * Dp + d] = masked_pair_chain(
          started ? t.dkb[j * Dp + d] : 0.f, R2, [&](int64_t k) { return t.dstp[j * h2 + k]; },
          [&](int64_t k) { return sl.qrp[k * Dp + d]; }, hid);
  }
  for (int64_t r = 0; r < R; ++r) {
    auto hid = [&](int64_t k, int h) { return 2 * k + h >= bk || !t.vis[(2 * k + h) * Rp + r]; };
    for (int64_t d = 0; d < D; ++d)
      sl.dqr[r * Dp + d] = masked_pair_chain(
          sl.dq_started ? sl.dqr[r * Dp + d] : 0.f, bk2, [&](int64_t k) { return t.dsp[k * Rp + r]; },
          [&](int64_t k) { return t.kk[k * Dp + d]; }, hid);
  }
  started = true;
  sl.dq_started = true;
}

// Step 5b: the same products pair by pair, skipping the hidden pairs (see visibility()), for
// tiles where a hidden pair meets an inf or NaN.
MHK_STEP void accumulate_pairwise(RowSlot& sl, int64_t D, int64_t Dv, int64_t bk, const float* Kb, int64_t ldk,
                                  const BwdLayout& L, const BwdTiles& t, bool& started) {
  const int64_t R = sl.rb.rows(), Rp = round_up(R, VL), Dp = L.Dp, Dvp = L.Dvp;
  for (int64_t j = 0; j < bk; ++j) {
    const uint8_t* vj = t.vis + j * Rp;
    for (int64_t d = 0; d < Dv; ++d) {
      float acc = started ? t.dvb[j * Dvp + d] : 0.f;
      for (int64_t r = 0; r < R; ++r)
        if (vj[r]) acc += t.st[j * Rp + r] * sl.dor[r * Dvp + d];
      t.dvb[j * Dvp + d] = acc;
    }
    for (int64_t d = 0; d < D; ++d) {
      float acc = started ? t.dkb[j * Dp + d] : 0.f;
      for (int64_t r = 0; r < R; ++r)
        if (vj[r]) acc += t.dst[j * Rp + r] * sl.qr[r * Dp + d];
      t.dkb[j * Dp + d] = acc;
    }
  }
  for (int64_t d = 0; d < D; ++d)
    for (int64_t r = 0; r < R; ++r) {
      float acc = sl.dq_started ? sl.dqr[r * Dp + d] : 0.f;
      for (int64_t j = 0; j < bk; ++j)
        if (t.vis[j * Rp + r]) acc += Kb[j * ldk + d] * t.dst[j * Rp + r];
      sl.dqr[r * Dp + d] = acc;
    }
  started = true;
  sl.dq_started = true;
}

// Step 6: the key block's dK and dV rows. Q was scaled by scale * log2(e): dK = ln(2) * dS^T
// (scaled Q); unscaled for the bf16 products: dK = scale * dS^T Q. Keys no row sees (`started`
// false) get 0.
template <typename T>
MHK_STEP void store_key_block(const AttnParams& p, T* dkbase, T* dvbase, int64_t j0, int64_t bk, const BwdLayout& L,
                              const BwdTiles& t, bool started) {
  const float dk_mul = L.pairs ? p.scale : kLn2;
  if constexpr (std::is_same_v<T, float>) {
    if (p.kv_sum) {
      // One row dK + dV: the product rounded on its own (store_row's), then the sum.
      for (int64_t j = 0; j < bk; ++j) {
        float* dr = dkbase + (j0 + j) * p.dk.sl;
        if (!started) {
          std::fill(dr, dr + p.D, 0.f);
          continue;
        }
        const float* a = t.dkb + j * L.Dp;
        const float* v = t.dvb + j * L.Dvp;
        int64_t c = 0;
        for (; c + VL <= p.D; c += VL) (opaque(Vec::loadu(a + c) * Vec(dk_mul)) + Vec::loadu(v + c)).store(dr + c);
        for (; c < p.D; ++c) {
          volatile float x = a[c] * dk_mul;  // rounded alone, as store_row's tail
          dr[c] = x + v[c];
        }
      }
      return;
    }
  }
  for (int64_t j = 0; j < bk; ++j) {
    T* dkr = dkbase + (j0 + j) * p.dk.sl;
    T* dvr = dvbase + (j0 + j) * p.dv.sl;
    if (!started) {
      std::fill(dkr, dkr + p.D, static_cast<T>(0.f));
      std::fill(dvr, dvr + p.Dv, static_cast<T>(0.f));
      continue;
    }
    store_row(t.dkb + j * L.Dp, p.D, dk_mul, dkr);
    store_row(t.dvb + j * L.Dvp, p.Dv, 1.f, dvr);
  }
}

// Step 7: dQ = scale * dS K of a row block, to the output or to this key range's partial.
template <typename T>
MHK_STEP void store_dq(const AttnParams& p, int64_t b, RowSlot& sl, const BwdLayout& L, float* dq_part) {
  const int64_t D = p.D, Dp = L.Dp;
  const int64_t R = sl.rb.rows();
  if (!sl.dq_started) std::fill(sl.dqr, sl.dqr + R * Dp, 0.f);  // no key seen: dQ is 0
  for (int64_t r = 0; r < R; ++r) {
    const int64_t h = sl.rb.h0 + r / sl.rb.nq, i = sl.rb.i0 + r % sl.rb.nq;
    const float* src = sl.dqr + r * Dp;
    if (dq_part == nullptr) {
      store_row(src, D, p.scale, static_cast<T*>(p.dq.ptr) + b * p.dq.sb + h * p.dq.sh + i * p.dq.sl);
    } else {
      store_row(src, D, p.scale, dq_part + ((b * p.H + h) * p.Lq + i) * D);
    }
  }
}

// One task: batch element b, KV head hkv, keys [kbeg, kend). dq_part: this key range's dQ
// partial ((B, H, Lq, D) float32) when the keys are split, else nullptr (dQ written directly).
template <typename T, typename Dot = void>
void backward_group(const AttnParams& p, const RowPlan& rp, int64_t b, int64_t hkv, int64_t kbeg, int64_t kend,
                    const BwdLayout& L, Scratch& buf, RowSlot* slots, float* dq_part) {
  constexpr bool kPairs = !std::is_void_v<Dot>;
  const int64_t D = p.D, Dv = p.Dv;
  const int64_t nblk = rp.blocks();
  const DropoutConsts drop(p);
  const ScoreMods mods(p);
  float* otile = buf.take(2 * L.Rp * L.Dvp);
  if (p.dmask) zero_dmask_range(p, rp, b, hkv, kbeg, kend);

  int64_t kfirst = std::numeric_limits<int64_t>::max(), kstop_all = 0;
  for (int64_t blk = 0; blk < nblk; ++blk) {
    gather_rows<T, Dot>(p, rp, b, hkv, blk, L, drop, buf, otile, slots[blk]);
    kfirst = std::min(kfirst, slots[blk].br.first);
    kstop_all = std::max(kstop_all, slots[blk].br.stop);
  }
  const BwdTiles t(buf, L, mods);

  const T* kbase = static_cast<const T*>(p.k.ptr) + b * p.k.sb + hkv * p.k.sh;
  const T* vbase = static_cast<const T*>(p.v.ptr) + b * p.v.sb + hkv * p.v.sh;
  T* dkbase = static_cast<T*>(p.dk.ptr) + b * p.dk.sb + hkv * p.dk.sh;
  T* dvbase = static_cast<T*>(p.dv.ptr) + b * p.dv.sb + hkv * p.dv.sh;
  const int64_t kstop = std::min(kend, kstop_all);

  for (int64_t j0 = kbeg; j0 < kend; j0 += kKeyBlock) {
    const int64_t bk = std::min(kKeyBlock, kend - j0);
    bool started = false;  // dK, dV of this block received a contribution
    if (j0 < kstop && j0 + bk > kfirst) {
      int64_t ldk, ldv;
      const float* Kb = rows_as_float<T>(kbase + j0 * p.k.sl, bk, D, p.k.sl, t.kc, &ldk);
      const float* Vb = rows_as_float<T>(vbase + j0 * p.v.sl, bk, Dv, p.v.sl, t.vc, &ldv);
      // dQ's product reads the key block as rows of Dp floats: in place when that is what it is.
      const float* Kp = Kb;
      int64_t ldkp = ldk;
      if (D != L.Dp) {
        for (int64_t j = 0; j < bk; ++j) {
          std::copy(Kb + j * ldk, Kb + j * ldk + D, t.kpad + j * L.Dp);
          std::fill(t.kpad + j * L.Dp + D, t.kpad + (j + 1) * L.Dp, 0.f);
        }
        Kp = t.kpad;
        ldkp = L.Dp;
      }
      // The bf16 products' operands, once per key block: K, V as pairs along D, Dv (in place
      // when their rows are whole pairs in memory) and K as pairs of keys.
      const uint32_t *Kd = nullptr, *Vd = nullptr;
      int64_t ldkd = 0, ldvd = 0;
      if constexpr (kPairs) {
        const StridedRows<T> kr{kbase, p.k.sl}, vr{vbase, p.v.sl};
        auto pairs_along = [&](const StridedRows<T>& x, int64_t cols, uint32_t* tmp, int64_t* ld) {
          const T* r0 = x.row(j0);
          if (cols % 2 == 0 && x.sl % 2 == 0 && reinterpret_cast<uintptr_t>(r0) % 4 == 0) {
            *ld = x.sl / 2;
            return reinterpret_cast<const uint32_t*>(r0);
          }
          pack_rows(x, j0, bk, cols, tmp, (cols + 1) / 2);
          *ld = (cols + 1) / 2;
          return static_cast<const uint32_t*>(tmp);
        };
        Kd = pairs_along(kr, D, t.kd, &ldkd);
        Vd = pairs_along(vr, Dv, t.vd, &ldvd);
        pack_key_pairs(kr, j0, bk, D, t.kk, L.Dp);
      }
      int kv_bad = -1;  // inf or NaN in this K or V block: -1 not looked yet
      bool transposed = false;  // t.kt, t.vt hold this key block (row_tiles)
      // A tensor given as both k and v (as fp32 in place) is transposed once, into t.kt.
      const bool own_vt = Vb != Kb || ldv != ldk || Dv != D;
      for (int64_t blk = 0; blk < nblk; ++blk) {
        RowSlot& sl = slots[blk];
        if (sl.br.stop <= j0 || sl.br.first >= j0 + bk) continue;
        const int64_t Rp = round_up(sl.rb.rows(), VL);
        // Every tile, masked or not: a -inf score hides its pair in the backward whatever made it
        // -inf (an infinite entry of q or k too), and a NaN row's P is NaN only on the pairs it
        // sees (docs/contract.md, "NaN and inf"). The scan is once per key block, and of K alone
        // where V is K (own_vt false: one tensor given as both).
        if (!sl.poisoned && kv_bad < 0)
          kv_bad = any_nonfinite(Kb, bk, D, ldk) || (own_vt && any_nonfinite(Vb, bk, Dv, ldv)) ? 1 : 0;
        const bool pairwise = sl.poisoned || kv_bad == 1;
        // The instruction's products (not the model: it runs the unfused steps, whose bits these
        // are) with scores untouched between their product and P: products, P and dS in one pass.
        if constexpr (kPairs && !std::is_same_v<Dot, DotModel>) {
          if (!pairwise && !drop.on && !p.dmask && !mods.any() && !p.mask && !sl.br.ragged(j0, bk) && bk % 2 == 0 &&
              Rp % (2 * VL) == 0) {
            scores_to_pairs<Dot>(p, sl, bk, Kd, ldkd, Vd, ldvd, t);
            accumulate_tiles<Dot>(sl, bk, Kp, ldkp, L, t, started, true);
            continue;
          }
        }
        if constexpr (!kPairs) {
          if (!pairwise && !drop.on && !p.dmask && !mods.any() && !p.mask && !sl.br.ragged(j0, bk) &&
              row_tiles_pay(sl.rb.rows(), bk)) {
            if (!transposed) {
              keys_transposed(Kb, ldk, bk, D, t.kt);
              if (own_vt) keys_transposed(Vb, ldv, bk, Dv, t.vt);
              transposed = true;
            }
            row_tiles(sl, D, Dv, bk, t.kt, own_vt ? t.vt : t.kt, Kp, ldkp, L, t, started);
            continue;
          }
        }
        if (!kPairs && !sl.qt_ready) {
          transpose(sl.qr, L.Dp, sl.qt, Rp, Rp, L.Dp);
          if (!kDeltaMakesDoT) transpose(sl.dor, L.Dvp, sl.dot, Rp, Rp, L.Dvp);
          sl.qt_ready = true;
        }
        score_tiles<Dot>(p, mods, b, sl, j0, bk, Kb, ldk, Vb, ldv, t, Kd, ldkd, Vd, ldvd);
        if (pairwise) visibility(t.st, Rp, bk, t.vis);
        if constexpr (kPairs) {
          if (!pairwise && !drop.on && !p.dmask && !mods.softcap) {
            probs_dscores_to_pairs<Dot>(sl, bk, t);
            accumulate_tiles<Dot>(sl, bk, Kp, ldkp, L, t, started, true);
            continue;
          }
        }
        probs_and_dscores(sl, j0, bk, drop, t);
        if (pairwise) {
          // Hidden pairs to exactly 0 first: dmask reads them.
          for (int64_t e = 0; e < bk * Rp; ++e)
            if (!t.vis[e]) t.st[e] = t.dst[e] = 0.f;
        }
        if (p.dmask) store_dmask(p, b, sl, j0, bk, t.dst);
        if (mods.softcap) chain_softcap(sl, bk, t);
        if constexpr (kPairs) {
          if (pairwise)
            accumulate_pairwise_pairs<Dot>(sl, D, Dv, bk, L, t, started);
          else
            accumulate_tiles<Dot>(sl, bk, Kp, ldkp, L, t, started);
        } else if (pairwise) {
          accumulate_pairwise(sl, D, Dv, bk, Kb, ldk, L, t, started);
        } else {
          accumulate_tiles<Dot>(sl, bk, Kp, ldkp, L, t, started);
        }
      }
    }
    store_key_block<T>(p, dkbase, dvbase, j0, bk, L, t, started);
  }
  for (int64_t blk = 0; blk < nblk; ++blk) store_dq<T>(p, b, slots[blk], L, dq_part);
}

template <typename T, typename Dot = void>
void backward_impl(const AttnParams& p) {
  if (p.B == 0 || p.Hkv == 0) return;
  const int64_t n_rep = p.H / p.Hkv;
  const int64_t rows = p.B * p.H * p.Lq;
  if (p.Lq == 0) {
    // No query: dK and dV are zero.
    for (int64_t b = 0; b < p.B; ++b)
      for (int64_t h = 0; h < p.Hkv; ++h)
        for (int64_t j = 0; j < p.Lk; ++j) {
          T* dkr = static_cast<T*>(p.dk.ptr) + b * p.dk.sb + h * p.dk.sh + j * p.dk.sl;
          T* dvr = static_cast<T*>(p.dv.ptr) + b * p.dv.sb + h * p.dv.sh + j * p.dv.sl;
          std::fill(dkr, dkr + p.D, static_cast<T>(0.f));
          std::fill(dvr, dvr + p.Dv, static_cast<T>(0.f));
        }
    return;
  }
  const RowPlan rp = plan_rows(n_rep, p.Lq);
  const int64_t base = p.B * p.Hkv;
  int64_t n_ranges = plan_key_splits(base, p.Lk, 512, rows * p.D);
  int64_t span = std::max<int64_t>(p.Lk, 1);
  if (n_ranges > 1) {
    span = round_up(ceil_div(p.Lk, n_ranges), kKeyBlock);
    n_ranges = ceil_div(p.Lk, span);
  }
  BwdLayout L{};
  L.Dp = round_up(p.D, VL);
  L.Dvp = round_up(p.Dv, VL);
  L.Rp = round_up(rp.max_rows(), VL);
  L.pairs = !std::is_void_v<Dot>;
  const int64_t nblk = rp.blocks();
  const int64_t per_thread = Scratch::size_of(2 * L.Rp * L.Dvp) + nblk * L.slot_floats() + BwdTiles::floats(L, ScoreMods(p));

  std::unique_ptr<Scratch> partials;
  float* dq_part = nullptr;
  if (n_ranges > 1) {
    partials = std::make_unique<Scratch>(n_ranges * rows * p.D);
    dq_part = partials->take(n_ranges * rows * p.D);
  }
  at::parallel_for(0, base * n_ranges, 1, [&](int64_t t0, int64_t t1) {
    Scratch buf(per_thread);
    std::unique_ptr<RowSlot[]> slots(new RowSlot[nblk]);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t c = t % n_ranges, hkv = (t / n_ranges) % p.Hkv, b = t / (n_ranges * p.Hkv);
      const int64_t kbeg = c * span, kend = std::min(p.Lk, kbeg + span);
      if (t + 1 < t1 && nblk == 1) {
        // Small groups (decode, the trainer's 20 folded queries): fetch the next task's rows and
        // first key block meanwhile, into L2 (hint 2), not L1: they (about 36 KiB at 20 rows,
        // 32 keys, d 64) would evict this task's tiles from a 32-48 KiB L1. A tensor given as both
        // k and v (and its one gradient, kv_sum) is asked for once. Measured at 256 x 20 queries
        // over 32 keys, d 64, one thread, Zen 4 (three runs of 20-60 alternating rounds): the
        // backward 0.20-0.23 ms (7%) faster than with hint 3 and the duplicates; against no
        // prefetch within 0.12 ms either way.
        const int64_t c1 = (t + 1) % n_ranges, hkv1 = ((t + 1) / n_ranges) % p.Hkv, b1 = (t + 1) / (n_ranges * p.Hkv);
        const RowBlock rb1 = row_block(rp, hkv1, 0);
        const int64_t j1 = c1 * span, n1 = std::min({kKeyBlock, span, p.Lk - j1});
        prefetch_block_rows<T, 0, 2>(p.q, b1, rb1, p.D);
        prefetch_block_rows<T, 0, 2>(p.dout, b1, rb1, p.Dv);
        prefetch_block_rows<T, 0, 2>(p.out, b1, rb1, p.Dv);
        if (n_ranges == 1) prefetch_block_rows<T, 1, 2>(p.dq, b1, rb1, p.D);
        // Key row j1 of view x for the next task.
        auto key0 = [&](const auto& x) { return static_cast<const T*>(x.ptr) + b1 * x.sb + hkv1 * x.sh + j1 * x.sl; };
        prefetch_rows<1, 2>(key0(p.dk), n1, p.D, p.dk.sl);
        if (p.dv.ptr != p.dk.ptr) prefetch_rows<1, 2>(key0(p.dv), n1, p.Dv, p.dv.sl);
        prefetch_rows<0, 2>(key0(p.k), n1, p.D, p.k.sl);
        if (p.v.ptr != p.k.ptr) prefetch_rows<0, 2>(key0(p.v), n1, p.Dv, p.v.sl);
      }
      buf.reset();
      backward_group<T, Dot>(p, rp, b, hkv, kbeg, kend, L, buf, slots.get(), dq_part ? dq_part + c * rows * p.D : nullptr);
    }
  });
  if (n_ranges > 1) {
    // dQ = sum of the key ranges' partials, in range order.
    at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
      Scratch buf(p.D + 16, Scratch::kUninit);  // acc, written before read
      float* acc = buf.take(p.D);
      for (int64_t row = r0; row < r1; ++row) {
        const int64_t i = row % p.Lq, h = (row / p.Lq) % p.H, b = row / (p.Lq * p.H);
        T* dqr = static_cast<T*>(p.dq.ptr) + b * p.dq.sb + h * p.dq.sh + i * p.dq.sl;
        // Range by range over the whole row (vectorised; each element still adds its ranges in
        // order from 0).
        std::fill(acc, acc + p.D, 0.f);
        for (int64_t c = 0; c < n_ranges; ++c) {
          const float* part = dq_part + (c * rows + row) * p.D;
          for (int64_t d = 0; d < p.D; ++d) acc[d] += part[d];
        }
        for (int64_t d = 0; d < p.D; ++d) dqr[d] = static_cast<T>(acc[d]);
      }
    });
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace mhakern::cpu
