// The bf16 products of the cpu kernels (issue 35): operands as pairs of bf16 along the
// reduction dim, one uint32 per pair (low half the even element, high half the odd one), fp32
// accumulators, and the pair dot product of AVX512-BF16's vdpbf16ps, either the instruction
// (DotHw, only in units compiled with -mavx512bf16) or its bit-exact software model
// (DotModel, any unit), so that CPUs without the instruction still run and test the variant.
//
// vdpbf16ps, per fp32 lane (Intel SDM, VDPBF16PS; checked bit for bit against the hardware,
// tests/test_cpu_bf16.py):
//   acc = daz(acc); acc = ftz(fma(odd(a), odd(b), acc)); acc = ftz(fma(even(a), even(b), acc))
// with daz on the bf16 operands too: denormal inputs read as zero, denormal results flush to zero,
// round to nearest even, MXCSR ignored. The odd product comes first; each step rounds once (the
// product of two bf16 is exact in fp32 unless it underflows, and fma keeps even that exact).
#pragma once

#include <cmath>
#include <cstring>
#include <type_traits>

#if defined(__AVX512BF16__) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include "gemm.h"
#include "vec_math.h"

namespace mhakern::cpu {
namespace CPU_CAPABILITY {

// A float's bf16 bits as vcvtne2ps2bf16 rounds (Intel SDM, VCVTNE2PS2BF16; checked bit for bit
// against the instruction, tests/test_cpu_bf16.py): to nearest even, MXCSR ignored, a zero or
// denormal to the zero of its sign (DAZ), a NaN quieted with its sign and top payload bits kept.
// Every rounding of the variant (P, dS) is this one, so the model and the instruction agree.
inline uint32_t bf16_round_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
  if ((u & 0x7f800000u) == 0) return (u >> 16) & 0x8000u;
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

// The variant's two instructions, as a type the kernels are templated on: the pair dot product
// (dp: vdpbf16ps) and the rounding of two fp32 vectors into pairs (round_pairs, round_runs:
// vcvtne2ps2bf16), either the instructions (DotHw) or their bit-exact software model (DotModel).
//   round_pairs(x0, x1, dst): dst[i] = (x0[i], x1[i]), i < VL (two rows of a tile into pairs);
//   round_runs(x0, x1, dst):  dst[i] = (x[2 i], x[2 i + 1]), x = x0 then x1 (2 VL consecutive
//                             values of a row into pairs along it).
struct DotModel {
  static constexpr const char* name = "model";
  struct BV {
    uint32_t w[VL];
  };
  static BV load(const uint32_t* p) {
    BV b;
    std::memcpy(b.w, p, sizeof(b.w));
    return b;
  }
  static BV bcast(uint32_t x) {
    BV b;
    for (int64_t i = 0; i < VL; ++i) b.w[i] = x;
    return b;
  }
  static float daz(float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
    std::memcpy(&x, &u, 4);
    return x;
  }
  static float bf(uint32_t bits16) {
    const uint32_t u = (bits16 & 0xffffu) << 16;
    float x;
    std::memcpy(&x, &u, 4);
    return daz(x);
  }
  static float lane(float c, uint32_t a, uint32_t b) {
    c = daz(c);
    c = daz(std::fma(bf(a >> 16), bf(b >> 16), c));
    return daz(std::fma(bf(a), bf(b), c));
  }
  static Vec dp(Vec acc, const BV& a, const BV& b) {
    float c[VL];
    acc.store(c);
    for (int64_t i = 0; i < VL; ++i) c[i] = lane(c[i], a.w[i], b.w[i]);
    return Vec::loadu(c);
  }
  static void round_pairs(Vec x0, Vec x1, uint32_t* dst) {
    float a[VL], b[VL];
    x0.store(a);
    x1.store(b);
    for (int64_t i = 0; i < VL; ++i) dst[i] = bf16_round_bits(a[i]) | (bf16_round_bits(b[i]) << 16);
  }
  static void round_runs(Vec x0, Vec x1, uint32_t* dst) {
    float x[2 * VL];
    x0.store(x);
    x1.store(x + VL);
    for (int64_t i = 0; i < VL; ++i) dst[i] = bf16_round_bits(x[2 * i]) | (bf16_round_bits(x[2 * i + 1]) << 16);
  }
};

#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
struct DotHw {
  static constexpr const char* name = "hw";
  using BV = __m512i;
  static BV load(const uint32_t* p) { return _mm512_loadu_si512(p); }
  static BV bcast(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
  static Vec dp(Vec acc, BV a, BV b) {
    return Vec(_mm512_dpbf16_ps(static_cast<__m512>(acc), reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b)));
  }
  // vcvtne2ps2bf16 puts x0's 16 bf16 below x1's; vpermw interleaves them into pairs.
  static void round_pairs(Vec x0, Vec x1, uint32_t* dst) {
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i h = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(static_cast<__m512>(x1), static_cast<__m512>(x0)));
    _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(idx, h));
  }
  static void round_runs(Vec x0, Vec x1, uint32_t* dst) {
    _mm512_storeu_si512(dst, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(static_cast<__m512>(x1), static_cast<__m512>(x0))));
  }
};
#endif

// acc[i] = one vdpbf16ps step on lane i, for i < n (n a multiple of VL): the check of the model
// against the instruction (tests/test_cpu_bf16.py).
template <typename Dot>
void dot_pairs_lanes(float* acc, const uint32_t* a, const uint32_t* b, int64_t n) {
  for (int64_t i = 0; i + VL <= n; i += VL)
    Dot::dp(Vec::loadu(acc + i), Dot::load(a + i), Dot::load(b + i)).store(acc + i);
}

// The rounding into pairs lane by lane (n a multiple of VL, x of 2 n floats): out[i] =
// round_pairs of (x[i], x[n + i]), or with `runs` round_runs of (x[2 i], x[2 i + 1]); the check
// of the model's rounding against the instruction (tests/test_cpu_bf16.py).
template <typename Dot>
void round_pairs_lanes(const float* x, uint32_t* out, int64_t n, bool runs) {
  for (int64_t i = 0; i + VL <= n; i += VL) {
    if (runs)
      Dot::round_runs(Vec::loadu(x + 2 * i), Vec::loadu(x + 2 * i + VL), out + i);
    else
      Dot::round_pairs(Vec::loadu(x + i), Vec::loadu(x + n + i), out + i);
  }
}

// C (M x N) = A (M x K pairs) * B (K pairs x N) + beta(C), as gemm() (gemm.h) but on pairs:
// A read by broadcasts of A[m * ars + k * acs], B row-major (ldb uint32 per pair row, N a
// multiple of VL), C fp32. Store multiplies the products by `cmul` (the forward's scale) and,
// given `cmax` (N floats), folds each column's maximum into it, cmax[n] = max(C[m][n], cmax[n])
// as MAXPS takes it (a NaN product leaves cmax as it was): the forward's row maximum of the
// score tile S^T without a pass over it.
template <typename Dot, int MR, int NV, CMode MODE>
inline void pair_kernel(int64_t K, const uint32_t* A, int64_t ars, int64_t acs, const uint32_t* B, int64_t ldb,
                        float* C, int64_t ldc, const float* cscale, float cmul, float* cmax) {
  Vec c[MR][NV];
  if constexpr (MODE == CMode::Store) {
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) c[i][j] = Vec(0.f);
  } else if constexpr (MODE == CMode::Accumulate) {
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) c[i][j] = Vec::loadu(C + i * ldc + j * VL);
  } else {
    Vec sc[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) sc[j] = Vec::loadu(cscale + j * VL);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) c[i][j] = Vec::loadu(C + i * ldc + j * VL) * sc[j];
  }
  for (int64_t kk = 0; kk < K; ++kk) {
    const uint32_t* b = B + kk * ldb;
    typename Dot::BV bv[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) bv[j] = Dot::load(b + j * VL);
    const uint32_t* a = A + kk * acs;
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const typename Dot::BV av = Dot::bcast(a[i * ars]);
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) c[i][j] = Dot::dp(c[i][j], av, bv[j]);
    }
  }
  if (MODE == CMode::Store && cmul != 1.f) {
    const Vec m(cmul);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) c[i][j] = c[i][j] * m;
  }
  if (MODE == CMode::Store && cmax != nullptr) {
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      Vec mx = Vec::loadu(cmax + j * VL);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) mx = at::vec::clamp_min(mx, c[i][j]);
      mx.store(cmax + j * VL);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) c[i][j].store(C + i * ldc + j * VL);
}

// 4 x 16 columns by 6 rows: 24 accumulators, 4 B vectors and a broadcast of the 32 AVX-512
// registers (the fp32 gemm's tiles are sized for AVX2's 16).
template <int NV>
constexpr int pair_tile_rows() {
  return NV == 4 ? 6 : (NV == 2 ? 6 : 8);
}

template <typename Dot, int MR, int NV, CMode MODE>
inline void pair_tail(int64_t rem, int64_t K, const uint32_t* A, int64_t ars, int64_t acs, const uint32_t* B,
                      int64_t ldb, float* C, int64_t ldc, const float* cscale, float cmul, float* cmax) {
  if constexpr (MR > 0) {
    if (rem == MR)
      pair_kernel<Dot, MR, NV, MODE>(K, A, ars, acs, B, ldb, C, ldc, cscale, cmul, cmax);
    else
      pair_tail<Dot, MR - 1, NV, MODE>(rem, K, A, ars, acs, B, ldb, C, ldc, cscale, cmul, cmax);
  }
}

template <typename Dot, int NV, CMode MODE>
inline void pair_strip(int64_t M, int64_t K, const uint32_t* A, int64_t ars, int64_t acs, const uint32_t* B,
                       int64_t ldb, float* C, int64_t ldc, const float* cscale, float cmul, float* cmax) {
  constexpr int MR = pair_tile_rows<NV>();
  int64_t m = 0;
  for (; m + MR <= M; m += MR)
    pair_kernel<Dot, MR, NV, MODE>(K, A + m * ars, ars, acs, B, ldb, C + m * ldc, ldc, cscale, cmul, cmax);
  if (m < M)
    pair_tail<Dot, MR - 1, NV, MODE>(M - m, K, A + m * ars, ars, acs, B, ldb, C + m * ldc, ldc, cscale, cmul, cmax);
}

template <typename Dot, CMode MODE>
inline void gemm_pairs(int64_t M, int64_t N, int64_t K, const uint32_t* A, int64_t ars, int64_t acs,
                       const uint32_t* B, int64_t ldb, float* C, int64_t ldc, const float* cscale = nullptr,
                       float cmul = 1.f, float* cmax = nullptr) {
  if (M <= 0 || N <= 0) return;
  if constexpr (std::is_same_v<Dot, DotModel>) {
    // The model element by element: each output runs the chain a tile's lane runs (the tiling
    // never changes an element's steps), at a fraction of the register tiles' compile time.
    for (int64_t m = 0; m < M; ++m) {
      float* c = C + m * ldc;
      for (int64_t n = 0; n < N; ++n) {
        float acc = MODE == CMode::Store ? 0.f : (MODE == CMode::Accumulate ? c[n] : c[n] * cscale[n]);
        for (int64_t kk = 0; kk < K; ++kk) acc = DotModel::lane(acc, A[m * ars + kk * acs], B[kk * ldb + n]);
        c[n] = MODE == CMode::Store && cmul != 1.f ? acc * cmul : acc;
        if (MODE == CMode::Store && cmax != nullptr) cmax[n] = c[n] > cmax[n] ? c[n] : cmax[n];  // MAXPS
      }
    }
    return;
  }
  const int64_t nvec = N / VL;
  int64_t v = 0;
  auto sc = [&](int64_t vv) { return MODE == CMode::Rescale ? cscale + vv * VL : nullptr; };
  auto cm = [&](int64_t vv) { return cmax ? cmax + vv * VL : nullptr; };
  for (; v + 4 <= nvec; v += 4)
    pair_strip<Dot, 4, MODE>(M, K, A, ars, acs, B + v * VL, ldb, C + v * VL, ldc, sc(v), cmul, cm(v));
  for (; v + 2 <= nvec; v += 2)
    pair_strip<Dot, 2, MODE>(M, K, A, ars, acs, B + v * VL, ldb, C + v * VL, ldc, sc(v), cmul, cm(v));
  if (v < nvec) pair_strip<Dot, 1, MODE>(M, K, A, ars, acs, B + v * VL, ldb, C + v * VL, ldc, sc(v), cmul, cm(v));
}

// ---- Packing into pairs ----


// P^T (n x Rp fp32, rows = keys) as pairs of keys, rounded to bf16 (Dot's rounding, nearest
// even), as the GPU kernels round P: dst[jj * Rp + r] = (P[2 jj][r], P[2 jj + 1][r]), a zero key
// past n (bf16 of +0 is 0).
template <typename Dot>
inline void pack_probs(const float* p, int64_t Rp, int64_t n, uint32_t* dst) {
  const Vec zero(0.f);
  for (int64_t jj = 0; jj < (n + 1) / 2; ++jj) {
    const float* p0 = p + 2 * jj * Rp;
    const float* p1 = p0 + Rp;
    uint32_t* d = dst + jj * Rp;
    const bool both = 2 * jj + 1 < n;
    for (int64_t r = 0; r < Rp; r += VL) Dot::round_pairs(Vec::loadu(p0 + r), both ? Vec::loadu(p1 + r) : zero, d + r);
  }
}

// Rows j0 .. j0 + n - 1 of a bf16 K (one row per key, `cols` values) as pairs along the row:
// dst[j * ldd + dd], zero past cols (ldd >= ceil(cols / 2)).
template <typename Rows>
inline void pack_rows(const Rows& rows, int64_t j0, int64_t n, int64_t cols, uint32_t* dst, int64_t ldd) {
  for (int64_t j = 0; j < n; ++j) {
    uint32_t* d = dst + j * ldd;
    std::memcpy(d, rows.row(j0 + j), cols * 2);
    if (cols % 2) reinterpret_cast<uint16_t*>(d)[cols] = 0;
  }
}

// Rows j0 .. j0 + n - 1 of a bf16 V as pairs of keys: dst[jj * ldd + d] = (V[2 jj][d],
// V[2 jj + 1][d]) for d < cols, a zero key past n, zero columns from cols to ldd. Bits are only
// moved, so the AVX-512 interleave (vpermt2w, 32 columns at a time) gives the scalar loop's.
template <typename Rows>
inline void pack_key_pairs(const Rows& rows, int64_t j0, int64_t n, int64_t cols, uint32_t* dst, int64_t ldd) {
  for (int64_t jj = 0; jj < (n + 1) / 2; ++jj) {
    const uint16_t* v0 = reinterpret_cast<const uint16_t*>(rows.row(j0 + 2 * jj));
    uint32_t* d = dst + jj * ldd;
    if (2 * jj + 1 < n) {
      const uint16_t* v1 = reinterpret_cast<const uint16_t*>(rows.row(j0 + 2 * jj + 1));
      int64_t c = 0;
#if defined(CPU_CAPABILITY_AVX512)
      const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                          37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
      const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
      for (; c + 32 <= cols; c += 32) {
        const __m512i a = _mm512_loadu_si512(v0 + c), b = _mm512_loadu_si512(v1 + c);
        _mm512_storeu_si512(d + c, _mm512_permutex2var_epi16(a, lo, b));
        _mm512_storeu_si512(d + c + 16, _mm512_permutex2var_epi16(a, hi, b));
      }
#endif
      for (; c < cols; ++c) d[c] = static_cast<uint32_t>(v0[c]) | (static_cast<uint32_t>(v1[c]) << 16);
    } else {
      for (int64_t c = 0; c < cols; ++c) d[c] = v0[c];
    }
    std::fill(d + cols, d + ldd, 0u);
  }
}

// Strided rows of a dense tensor, as pack_rows and pack_key_pairs read them.
template <typename T>
struct StridedRows {
  const T* base;
  int64_t sl;
  const T* row(int64_t j) const { return base + j * sl; }
};

// fp32 rows (n x cols, row stride ld, n even) holding bf16 values exactly, as pairs of rows:
// dst[rr * ldd + c] = (x[2 rr][c], x[2 rr + 1][c]), the top halves of their bits.
inline void pack_row_pairs(const float* x, int64_t ld, int64_t n, int64_t cols, uint32_t* dst, int64_t ldd) {
  for (int64_t rr = 0; rr < n / 2; ++rr) {
    const float* x0 = x + 2 * rr * ld;
    const float* x1 = x0 + ld;
    uint32_t* d = dst + rr * ldd;
    for (int64_t c = 0; c < cols; ++c) {
      uint32_t lo, hi;
      std::memcpy(&lo, x0 + c, 4);
      std::memcpy(&hi, x1 + c, 4);
      d[c] = (lo >> 16) | (hi & 0xffff0000u);
    }
  }
}

// Q^T as pairs: dst[dd * Rp + r] = (rows[r][2 dd], rows[r][2 dd + 1]) for dd < Dp / 2, r < Rp;
// `rows` (Rp x Dp, fp32, both multiples of 8) hold bf16 values exactly, so the bits are their top
// halves. Through the 8x8 transposes into `tmp` (Dp x Rp floats) and pairs of its rows: whole
// vectors, where pairing along the rows in place stored one uint32 at a time.
inline void pack_rows_transposed(const float* rows, int64_t Dp, int64_t Rp, uint32_t* dst, float* tmp) {
  transpose(rows, Dp, tmp, Rp, Rp, Dp);
  pack_row_pairs(tmp, Rp, Dp, Rp, dst, Rp);
}

// fp32 rows (n x cols, cols a multiple of VL) as pairs along each row, rounded to bf16 (Dot's
// rounding): dst[j * (cols / 2) + cc] = (x[j][2 cc], x[j][2 cc + 1]).
template <typename Dot>
inline void pack_cols_rounded(const float* x, int64_t n, int64_t cols, uint32_t* dst) {
  for (int64_t j = 0; j < n; ++j) {
    const float* xr = x + j * cols;
    uint32_t* d = dst + j * (cols / 2);
    int64_t c = 0;
    for (; c + 2 * VL <= cols; c += 2 * VL) Dot::round_runs(Vec::loadu(xr + c), Vec::loadu(xr + c + VL), d + c / 2);
    for (; c < cols; c += 2) d[c / 2] = bf16_round_bits(xr[c]) | (bf16_round_bits(xr[c + 1]) << 16);
  }
}

// One output element of a pair product, pair by pair, for tiles where a hidden pair meets an inf
// or NaN (modes.h, visibility()): the chain pair_kernel runs (the model's steps are the
// instruction's bit for bit), with both halves of a hidden pair zeroed, so its product is +0
// where the tile would add 0 * a finite value: the visible pairs give the tile's bits.
// a(k), b(k): the k-th pairs; hidden(k, half): that half's pair is hidden.
template <typename A, typename B, typename Hidden>
inline float masked_pair_chain(float acc, int64_t n, const A& a, const B& b, const Hidden& hidden) {
  for (int64_t k = 0; k < n; ++k) {
    uint32_t x = a(k), y = b(k);
    if (hidden(k, 0)) {
      x &= 0xffff0000u;
      y &= 0xffff0000u;
    }
    if (hidden(k, 1)) {
      x &= 0xffffu;
      y &= 0xffffu;
    }
    acc = DotModel::lane(acc, x, y);
  }
  return acc;
}

// Lane-wise pair dot products over n pairs: out[r] = the chain acc = dp(acc, a[k][r], b[k][r]),
// k = 0 .. n - 1, from 0 (a, b: n x Rp pairs, Rp a multiple of VL). The chain a GEMM's output
// element runs, so delta = dO . O rounds as dP = dO . V_j does.
template <typename Dot>
inline void dot_lanes_chain(const uint32_t* a, const uint32_t* b, int64_t n, int64_t Rp, float* out) {
  for (int64_t v = 0; v < Rp; v += VL) {
    Vec acc(0.f);
    for (int64_t k = 0; k < n; ++k) acc = Dot::dp(acc, Dot::load(a + k * Rp + v), Dot::load(b + k * Rp + v));
    acc.store(out + v);
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace mhakern::cpu
