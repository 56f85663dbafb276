// The cpu kernel of mhakern.flex_attention, one instance per traced modifier and input dtype: mhakern/flex/graph.py
// writes the modifier's C++ (score_fwd, score_bwd, mask_fn and the constants below) in place of the
// generated-code marker line, and mhakern/flex/build.py compiles the result once per graph, dtype
// set, instruction set and build into a shared library called through ctypes (plain C entry
// points: no Python per tile, no pybind to compile).
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
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdio>
#include <exception>
#include <stdexcept>
#include <atomic>
#include <vector>

#include "gemm.h"
#include "vec_math.h"

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

// The argument record, mirrored field for field by mhakern/flex/build.py (ctypes).
struct FlexArgs {
  int64_t dtype;  // 0 float32, 1 bfloat16
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
  char err[256];
};

namespace {

constexpr int64_t kRows = 64;         // query rows per task (as the cpu kernel's kRowBlock)
constexpr int64_t kRowsPartial = 32;  // with partial blocks: their dead keys are trimmed per task
constexpr int64_t kKeys = 128;  // keys per step (its kKeyBlock)
constexpr int64_t kRowVecs = (kRows + VL - 1) / VL;

template <typename T>
inline float tof(T x) {
  return static_cast<float>(x);
}
template <typename T>
inline T fromf(float x) {
  return static_cast<T>(x);
}

// rows x D of a (B, H, L, D) view starting at row i0, as fp32 times mul, padded with zeros to
// ld columns.
template <typename T>
void load_rows(const T* base, int64_t sl, int64_t rows, int64_t D, float mul, float* dst, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* s = base + r * sl;
    float* d = dst + r * ld;
    for (int64_t c = 0; c < D; ++c) d[c] = tof(s[c]) * mul;
    for (int64_t c = D; c < ld; ++c) d[c] = 0.f;
  }
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

// A key block's rows (fp32): in place for float32 inputs, else converted into `buf`.
template <typename T>
const float* key_rows(const T* base, int64_t sl, int64_t n, int64_t D, float* buf, int64_t* ld) {
  if constexpr (std::is_same_v<T, float>) {
    *ld = sl;
    return base;
  } else {
    load_rows(base, sl, n, D, 1.f, buf, D);
    *ld = D;
    return buf;
  }
}

// mask_fn over a partial block's transposed tile (bk keys x R rows, rows q0 .., keys j0 ..):
// vis[j * Rp + r] = 1 where visible. Returns the keys [*jlo, *jhi) that some row sees, so the
// products skip the block's dead keys (a document boundary cuts most partial blocks in two:
// without the trim a document mask computed 1.2x the pairs attention_varlen does).
template <typename Mod>
MHK_STEP void mask_tile_t(uint8_t* vis, int64_t Rp, int64_t R, int64_t bk, int64_t b, int64_t h, int64_t q0,
                          int64_t j0, const Caps& caps, int64_t* jlo, int64_t* jhi) {
  int64_t lo = bk, hi = 0;
  for (int64_t j = 0; j < bk; ++j) {
    uint8_t* __restrict vp = vis + j * Rp;
    const int64_t kv = j0 + j;
    uint8_t any = 0;
    for (int64_t r = 0; r < R; ++r) {
      const uint8_t m = Mod::mask_fn(b, h, q0 + r, kv, caps) ? 1 : 0;
      vp[r] = m;
      any |= m;
    }
    if (any) {
      lo = std::min(lo, j);
      hi = j + 1;
    }
  }
  *jlo = lo;
  *jhi = hi;
}

// The modifiers on a transposed score tile S^T (bk keys x Rp rows; rows q0 .., keys j0 ..):
// score_mod times `post`, then where `vis` is given (a partial block) its hidden pairs -inf,
// and -inf in the padding rows. Separate loops of plain selects over contiguous rows, so the
// compiler vectorizes them (one branchy loop ran the mask at a third of the speed).
template <typename Mod>
MHK_STEP void mods_tile_t(float* st, int64_t Rp, int64_t R, int64_t bk, int64_t b, int64_t h, int64_t q0, int64_t j0,
                          const uint8_t* vis, const Caps& caps, float post) {
  for (int64_t j = 0; j < bk; ++j) {
    float* __restrict sp = st + j * Rp;
    const int64_t kv = j0 + j;
    if constexpr (Mod::kHasScoreMod) {
      for (int64_t r = 0; r < R; ++r) sp[r] = Mod::score_fwd(sp[r], b, h, q0 + r, kv, caps) * post;
    }
    if (vis != nullptr) {
      const uint8_t* vp = vis + j * Rp;
      for (int64_t r = 0; r < R; ++r) sp[r] = vp[r] ? sp[r] : kNegInf;
    }
    for (int64_t r = R; r < Rp; ++r) sp[r] = kNegInf;
  }
}

template <typename T, typename Mod>
void forward(const FlexArgs& a) {
  const Caps caps{a.cap_ptr, a.cap_size};
  const int64_t D = a.D, Dv = a.Dv, QBS = a.QBS, KVBS = a.KVBS, n_rep = a.H / a.Hkv;
  // Smaller row tasks when some block is partial: a partial block's keys are trimmed to those
  // its task's rows see, and 32 rows cut more than 64 (document masks of 8 x 1k tokens: 0.93x
  // attention_varlen against 0.80x); without partial blocks 64 rows are faster (0.88x at 32).
  bool has_partial = false;
  for (int64_t e = 0; e < a.mB * a.mH * a.nqb && !has_partial; ++e) has_partial = a.kv_num[e] > 0;
  const int64_t RB = std::min(QBS, has_partial ? kRowsPartial : kRows), nsub = ceil_div(QBS, RB);
  const int64_t KB = std::min(KVBS, kKeys);
  const int64_t Rmax = round_up(RB, VL), Dp = round_up(D, VL);
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
  constexpr int64_t kUnit = 4;
  const int64_t nunit = ceil_div(ntask, kUnit);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), nunit)), 1, [&](int64_t, int64_t) {
    // 9 pieces, each rounded up to 16 floats by take().
    Scratch s(Rmax * Dp * 2 + KB * Rmax + Dv * Rmax + 3 * Rmax + KB * (D + Dv) + KB * Rmax / 4 + 1 + 16 * 10,
              Scratch::kUninit);
    float* qr = s.take(Rmax * Dp);
    float* qt = s.take(Dp * Rmax);
    float* st = s.take(KB * Rmax);
    float* ot = s.take(Dv * Rmax);
    float* m = s.take(Rmax);
    float* l = s.take(Rmax);
    float* alpha = s.take(Rmax);
    float* kc = s.take(KB * D);
    float* vc = s.take(KB * Dv);
    uint8_t* vis = reinterpret_cast<uint8_t*>(s.take(KB * Rmax / 4 + 1));
    for (int64_t unit; (unit = next.fetch_add(1)) < nunit;)
    for (int64_t t = std::min(ntask, (nunit - unit) * kUnit) - 1; t >= (nunit - 1 - unit) * kUnit; --t) {
      const int64_t sub = t % nsub, qb = (t / nsub) % a.nqb, h = (t / (nsub * a.nqb)) % a.H;
      const int64_t b = t / (nsub * a.nqb * a.H), hkv = h / n_rep, q0 = qb * QBS + sub * RB;
      if (q0 >= std::min(a.Lq, (qb + 1) * QBS)) continue;
      const int64_t R = std::min({RB, a.Lq - q0, (qb + 1) * QBS - q0}), Rp = round_up(R, VL), nvec = Rp / VL;
      const int64_t mb = a.mB == 1 ? 0 : b, mh = a.mH == 1 ? 0 : h;
      const T* q = static_cast<const T*>(a.q) + b * a.qs[0] + h * a.qs[1] + q0 * a.qs[2];
      load_rows(q, a.qs[2], R, D, qmul, qr, Dp);
      transpose_pad(qr, Dp, R, D, qt, Rp);
      for (int64_t r = 0; r < Rp; ++r) {
        m[r] = kNegInf;
        l[r] = 0.f;
      }
      std::fill(ot, ot + Dv * Rp, 0.f);
      const T* kb0 = static_cast<const T*>(a.k) + b * a.ks[0] + hkv * a.ks[1];
      const T* vb0 = static_cast<const T*>(a.v) + b * a.vs[0] + hkv * a.vs[1];
      const BlockList lists[2] = {blocks(a.kv_num, a.kv_idx, a.kv_w, mb, mh, a.mH, a.nqb, qb),
                                  blocks(a.fkv_num, a.fkv_idx, a.fkv_w, mb, mh, a.mH, a.nqb, qb)};
      for (int li = 0; li < 2; ++li) {
        const bool partial = li == 0;
        for (int64_t n = 0; n < lists[li].n; ++n) {
          const int64_t jb = int64_t(lists[li].idx[n]) * KVBS, jend = std::min(jb + KVBS, a.Lk);
          // A block mask's key block in steps of at most kKeys keys (the tile stays in L1/L2).
          for (int64_t jstep = jb; jstep < jend; jstep += KB) {
            int64_t j0 = jstep, bk = std::min(KB, jend - jstep);
            const uint8_t* tvis = nullptr;
            if (partial) {
              int64_t jlo = 0, jhi = 0;
              mask_tile_t<Mod>(vis, Rp, R, bk, b, h, q0, j0, caps, &jlo, &jhi);
              tvis = vis + jlo * Rp;
              if (jlo >= jhi) continue;  // no row of this task sees these keys
              j0 += jlo;
              bk = jhi - jlo;
            }
            int64_t ldk = 0, ldv = 0;
            const float* Kb = key_rows(kb0 + j0 * a.ks[2], a.ks[2], bk, D, kc, &ldk);
            gemm<CMode::Store>(bk, Rp, D, Kb, ldk, 1, qt, Rp, st, Rp);  // S^T = K Q^T
            if (Mod::kHasScoreMod || partial || R < Rp)
              mods_tile_t<Mod>(st, Rp, R, bk, b, h, q0, j0, tvis, caps, kLog2e);
            // Online softmax, as forward.h: keys outside and row vectors inside, so the max and
            // sum reductions of the row vectors are independent chains (vectors outside, keys
            // inside ran the forward at 0.7x).
            Vec mx[kRowVecs], muse[kRowVecs], sum[kRowVecs];
            for (int64_t vv = 0; vv < nvec; ++vv) {
              mx[vv] = Vec(kNegInf);
              sum[vv] = Vec(0.f);
            }
            for (int64_t j = 0; j < bk; ++j) {
              const float* sp = st + j * Rp;
              for (int64_t vv = 0; vv < nvec; ++vv) mx[vv] = at::vec::clamp_min(mx[vv], Vec::loadu(sp + vv * VL));
            }
            for (int64_t vv = 0; vv < nvec; ++vv) {
              const Vec mold = Vec::loadu(m + vv * VL);
              const Vec mnew = at::vec::clamp_min(mold, mx[vv]);
              // Nothing visible yet: subtract 0 rather than -inf, so exp2 gives 0 and not NaN.
              muse[vv] = Vec::blendv(mnew, Vec(0.f), mnew == Vec(kNegInf));
              exp2v(mold - muse[vv]).store(alpha + vv * VL);
              mnew.store(m + vv * VL);
            }
            for (int64_t j = 0; j < bk; ++j) {
              float* sp = st + j * Rp;
              for (int64_t vv = 0; vv < nvec; ++vv) {
                const Vec pj = exp2v(Vec::loadu(sp + vv * VL) - muse[vv]);
                pj.store(sp + vv * VL);
                sum[vv] = sum[vv] + pj;
              }
            }
            for (int64_t vv = 0; vv < nvec; ++vv)
              (Vec::loadu(l + vv * VL) * Vec::loadu(alpha + vv * VL) + sum[vv]).store(l + vv * VL);
            const float* Vb = key_rows(vb0 + j0 * a.vs[2], a.vs[2], bk, Dv, vc, &ldv);
            gemm<CMode::Rescale>(Dv, Rp, bk, Vb, 1, ldv, st, Rp, ot, Rp, alpha);  // O^T = a O^T + V^T P^T
          }
        }
      }
      T* o = static_cast<T*>(a.out) + b * a.os[0] + h * a.os[1] + q0 * a.os[2];
      float* lse = a.lse + (b * a.H + h) * a.Lq + q0;
      for (int64_t r = 0; r < R; ++r) {
        // A row that saw no key: output 0, lse -inf (docs/contract.md).
        const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
        for (int64_t d = 0; d < Dv; ++d) o[r * a.os[2] + d] = fromf<T>(ot[d * Rp + r] * inv);
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
template <typename T, typename Mod>
void backward(const FlexArgs& a) {
  const Caps caps{a.cap_ptr, a.cap_size};
  const int64_t D = a.D, Dv = a.Dv, QBS = a.QBS, KVBS = a.KVBS, n_rep = a.H / a.Hkv;
  const int64_t Kp = round_up(KVBS, VL), Dp = round_up(D, VL), Dvp = round_up(Dv, VL);
  const float scale = static_cast<float>(a.scale);
  // Key ranges: enough tasks for the threads (4 per thread), within 256 MiB of dQ partials.
  const int64_t nthr = at::get_num_threads(), groups = a.B * a.Hkv;
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
  const int64_t nchunk = std::max<int64_t>(1, std::min<int64_t>(ntask, nthr));
  std::vector<float> gbuf(Mod::kHasCapGrad ? nchunk * gsize : 0, 0.f);
  at::parallel_for(0, nchunk, 1, [&](int64_t c0, int64_t c1) {
    Scratch s(KVBS * (Dp + Dvp) * 2 + Dp * Kp + Dvp * Kp + QBS * (Dp + Dvp) + 4 * QBS * Kp + 2 * QBS + QBS * Kp / 4 + 1 +
                  16 * 15,
              Scratch::kUninit);
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
    uint8_t* vis = reinterpret_cast<uint8_t*>(s.take(QBS * Kp / 4 + 1));
    std::vector<float*> gcap(a.ncap + 1, nullptr);
    for (int64_t chunk = c0; chunk < c1; ++chunk) {
      for (int64_t c = 0; c < a.ncap; ++c)
        gcap[c] = a.cap_grad[c] != nullptr && Mod::kHasCapGrad ? gbuf.data() + chunk * gsize + goff[c] : nullptr;
      for (int64_t t = chunk * ntask / nchunk; t < (chunk + 1) * ntask / nchunk; ++t) {
        const int64_t split = t % nsplit, hkv = (t / nsplit) % a.Hkv, b = t / (nsplit * a.Hkv);
        float* dqp = dq_part.data() + split * part_floats;
        const int64_t mb = a.mB == 1 ? 0 : b;
        for (int64_t kb = split * a.nkb / nsplit; kb < (split + 1) * a.nkb / nsplit; ++kb) {
          const int64_t j0 = kb * KVBS;
          if (j0 >= a.Lk) break;
          const int64_t bk = std::min(KVBS, a.Lk - j0), bkp = round_up(bk, VL);
          load_rows(static_cast<const T*>(a.k) + b * a.ks[0] + hkv * a.ks[1] + j0 * a.ks[2], a.ks[2], bk, D, 1.f, kr,
                    Dp);
          transpose_pad(kr, Dp, bk, D, kt, bkp);
          load_rows(static_cast<const T*>(a.v) + b * a.vs[0] + hkv * a.vs[1] + j0 * a.vs[2], a.vs[2], bk, Dv, 1.f, vr,
                    Dvp);
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
                  const uint8_t* tvis = nullptr;
                  // The keys computed: [c0, c1) of the block, whole vectors (a partial block: only
                  // those some live row sees).
                  int64_t c0 = 0, c1 = bkp;
                  if (partial) {
                    // The mask first; then only the rows that see some key of this block and the
                    // keys some row sees (a document boundary leaves a block's rows and keys of the
                    // other document dead).
                    int64_t rlo = R, rhi = 0, jlo = bk, jhi = 0;
                    for (int64_t r = 0; r < R; ++r) {
                      uint8_t* __restrict vp = vis + r * bkp;
                      for (int64_t j = 0; j < bk; ++j) vp[j] = Mod::mask_fn(b, h, q0 + r, j0 + j, caps) ? 1 : 0;
                      int64_t first = bk, last = -1;
                      for (int64_t j = 0; j < bk; ++j)
                        if (vp[j]) {
                          first = std::min(first, j);
                          last = j;
                        }
                      if (last >= 0) {
                        rlo = std::min(rlo, r);
                        rhi = r + 1;
                        jlo = std::min(jlo, first);
                        jhi = std::max(jhi, last + 1);
                      }
                    }
                    if (rlo >= rhi) continue;
                    tvis = vis + rlo * bkp;
                    q0 += rlo;
                    R = rhi - rlo;
                    c0 = jlo / VL * VL;
                    c1 = std::min(bkp, round_up(jhi, VL));
                  }
                  const int64_t nc = c1 - c0, nk = std::min(c1, bk) - c0;  // computed, and real keys
                  load_rows(static_cast<const T*>(a.q) + b * a.qs[0] + h * a.qs[1] + q0 * a.qs[2], a.qs[2], R, D, scale,
                            qs, Dp);
                  load_rows(static_cast<const T*>(a.dout) + b * a.dos[0] + h * a.dos[1] + q0 * a.dos[2], a.dos[2], R,
                            Dv, 1.f, dor, Dvp);
                  const float* lse = a.lse + (b * a.H + h) * a.Lq + q0;
                  const float* delta = a.delta + (b * a.H + h) * a.Lq + q0;
                  for (int64_t r = 0; r < R; ++r) {
                    lr[r] = lse_use(lse[r]) * kLog2e;
                    dl[r] = delta[r];
                  }
                  gemm<CMode::Store>(R, nc, D, qs, Dp, 1, kt + c0, bkp, sc, nc);    // S = Qs K^T
                  gemm<CMode::Store>(R, nc, Dv, dor, Dvp, 1, vt + c0, bkp, dp, nc);  // dP = dO V^T
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
                      const uint8_t* vp = tvis + r * bkp + c0;
                      for (int64_t j = 0; j < nk; ++j) prow[j] = vp[j] ? prow[j] : kNegInf;
                    }
                    for (int64_t j = nk; j < nc; ++j) prow[j] = kNegInf;
                    // P = exp(s - lse); dS = P (dP - delta), the gradient at the modified score.
                    const Vec lv(lr[r]), dlv(dl[r]);
                    for (int64_t j = 0; j < nc; j += VL) {
                      const Vec p = exp2v(Vec::loadu(prow + j) * Vec(kLog2e) - lv);
                      p.store(prow + j);
                      (p * (Vec::loadu(dprow + j) - dlv)).store(dprow + j);
                    }
                    if constexpr (Mod::kHasScoreMod) {
                      // Through the modifier to the raw score (and into the tables), where visible.
                      for (int64_t j = 0; j < nk; ++j)
                        if (dprow[j] != 0.f || std::isnan(dprow[j]))
                          dprow[j] = Mod::template score_bwd<Mod::kHasCapGrad>(srow[j], b, h, i, kc0 + j, caps, dprow[j],
                                                                              gcap.data());
                    }
                  }
                  gemm<CMode::Accumulate>(nk, Dvp, R, pp, 1, nc, dor, Dvp, dv + c0 * Dvp, Dvp);  // dV += P^T dO
                  gemm<CMode::Accumulate>(nk, Dp, R, dp, 1, nc, qs, Dp, dk + c0 * Dp, Dp);        // dK += dS^T Qs
                  float* dqr = dqp + ((b * a.H + h) * a.Lq + q0) * Dp;
                  gemm<CMode::Accumulate>(R, Dp, nk, dp, nc, 1, kr + c0 * Dp, Dp, dqr, Dp);  // dQ += dS K
                  }
              }
            }
          }
          T* dkp = static_cast<T*>(a.dk) + b * a.dks[0] + hkv * a.dks[1] + j0 * a.dks[2];
          T* dvp = static_cast<T*>(a.dv) + b * a.dvs[0] + hkv * a.dvs[1] + j0 * a.dvs[2];
          for (int64_t j = 0; j < bk; ++j) {
            for (int64_t d = 0; d < D; ++d) dkp[j * a.dks[2] + d] = fromf<T>(dk[j * Dp + d]);
            for (int64_t d = 0; d < Dv; ++d) dvp[j * a.dvs[2] + d] = fromf<T>(dv[j * Dvp + d]);
          }
        }
      }
    }
  });
  // dQ = scale * (sum of the key ranges' partials, in range order).
  at::parallel_for(0, a.B * a.H * a.Lq, 256, [&](int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; ++row) {
      const int64_t i = row % a.Lq, h = (row / a.Lq) % a.H, b = row / (a.Lq * a.H);
      T* dq = static_cast<T*>(a.dq) + b * a.dqs[0] + h * a.dqs[1] + i * a.dqs[2];
      for (int64_t d = 0; d < D; ++d) {
        float acc = dq_part[row * Dp + d];
        for (int64_t sp = 1; sp < nsplit; ++sp) acc += dq_part[sp * part_floats + row * Dp + d];
        dq[d] = fromf<T>(acc * scale);
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
    f();
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(a->err, sizeof(a->err), "%s", e.what());
    return 1;
  }
}

// One input dtype per library (the generated section defines MHK_FLEX_BF16 or not): each
// instantiation of the three loops costs seconds of compile time.
#if MHK_FLEX_BF16
using Elem = c10::BFloat16;
constexpr int64_t kDtype = 1;
#else
using Elem = float;
constexpr int64_t kDtype = 0;
#endif

template <typename Mod>
int run_forward(FlexArgs* a) {
  return guarded(a, [&] {
    if (a->dtype != kDtype) throw std::runtime_error("this library was compiled for another dtype");
    forward<Elem, Mod>(*a);
  });
}

template <typename Mod>
int run_backward(FlexArgs* a) {
  return guarded(a, [&] {
    if (a->dtype != kDtype) throw std::runtime_error("this library was compiled for another dtype");
    backward<Elem, Mod>(*a);
  });
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
