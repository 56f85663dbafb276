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

namespace mhakern::cpu {
namespace CPU_CAPABILITY {

// A float's bf16 bits, rounded to nearest even; a NaN stays a quiet NaN of its sign (c10's rule).
inline uint32_t bf16_bits_rne(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7fffffffu) > 0x7f800000u ? ((u >> 16) & 0x8000u) | 0x7fc0u : r;
}

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
};
#endif

// acc[i] = one vdpbf16ps step on lane i, for i < n (n a multiple of VL): the check of the model
// against the instruction (tests/test_cpu_bf16.py).
template <typename Dot>
void dot_pairs_lanes(float* acc, const uint32_t* a, const uint32_t* b, int64_t n) {
  for (int64_t i = 0; i + VL <= n; i += VL)
    Dot::dp(Vec::loadu(acc + i), Dot::load(a + i), Dot::load(b + i)).store(acc + i);
}

// C (M x N) = A (M x K pairs) * B (K pairs x N) + beta(C), as gemm() (gemm.h) but on pairs:
// A read by broadcasts of A[m * ars + k * acs], B row-major (ldb uint32 per pair row, N a
// multiple of VL), C fp32. Store multiplies the products by `cmul` (the forward's scale).
template <typename Dot, int MR, int NV, CMode MODE>
inline void pair_kernel(int64_t K, const uint32_t* A, int64_t ars, int64_t acs, const uint32_t* B, int64_t ldb,
                        float* C, int64_t ldc, const float* cscale, float cmul) {
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
                      int64_t ldb, float* C, int64_t ldc, const float* cscale, float cmul) {
  if constexpr (MR > 0) {
    if (rem == MR)
      pair_kernel<Dot, MR, NV, MODE>(K, A, ars, acs, B, ldb, C, ldc, cscale, cmul);
    else
      pair_tail<Dot, MR - 1, NV, MODE>(rem, K, A, ars, acs, B, ldb, C, ldc, cscale, cmul);
  }
}

template <typename Dot, int NV, CMode MODE>
inline void pair_strip(int64_t M, int64_t K, const uint32_t* A, int64_t ars, int64_t acs, const uint32_t* B,
                       int64_t ldb, float* C, int64_t ldc, const float* cscale, float cmul) {
  constexpr int MR = pair_tile_rows<NV>();
  int64_t m = 0;
  for (; m + MR <= M; m += MR)
    pair_kernel<Dot, MR, NV, MODE>(K, A + m * ars, ars, acs, B, ldb, C + m * ldc, ldc, cscale, cmul);
  if (m < M) pair_tail<Dot, MR - 1, NV, MODE>(M - m, K, A + m * ars, ars, acs, B, ldb, C + m * ldc, ldc, cscale, cmul);
}

template <typename Dot, CMode MODE>
inline void gemm_pairs(int64_t M, int64_t N, int64_t K, const uint32_t* A, int64_t ars, int64_t acs,
                       const uint32_t* B, int64_t ldb, float* C, int64_t ldc, const float* cscale = nullptr,
                       float cmul = 1.f) {
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
      }
    }
    return;
  }
  const int64_t nvec = N / VL;
  int64_t v = 0;
  auto sc = [&](int64_t vv) { return MODE == CMode::Rescale ? cscale + vv * VL : nullptr; };
  for (; v + 4 <= nvec; v += 4)
    pair_strip<Dot, 4, MODE>(M, K, A, ars, acs, B + v * VL, ldb, C + v * VL, ldc, sc(v), cmul);
  for (; v + 2 <= nvec; v += 2)
    pair_strip<Dot, 2, MODE>(M, K, A, ars, acs, B + v * VL, ldb, C + v * VL, ldc, sc(v), cmul);
  if (v < nvec) pair_strip<Dot, 1, MODE>(M, K, A, ars, acs, B + v * VL, ldb, C + v * VL, ldc, sc(v), cmul);
}

// ---- Packing into pairs ----

// Q^T as pairs: dst[dd * Rp + r] = (rows[r][2 dd], rows[r][2 dd + 1]) for dd < Dp / 2, r < Rp;
// `rows` (Rp x Dp, fp32) hold bf16 values exactly, so the bits are their top halves.
inline void pack_rows_transposed(const float* rows, int64_t Dp, int64_t Rp, uint32_t* dst) {
  for (int64_t r = 0; r < Rp; ++r) {
    const float* x = rows + r * Dp;
    for (int64_t dd = 0; dd < Dp / 2; ++dd) {
      uint32_t lo, hi;
      std::memcpy(&lo, x + 2 * dd, 4);
      std::memcpy(&hi, x + 2 * dd + 1, 4);
      dst[dd * Rp + r] = (lo >> 16) | (hi & 0xffff0000u);
    }
  }
}

// Two vectors of probabilities (keys 2 jj and 2 jj + 1, VL rows) as VL pairs, rounded as
// bf16_bits_rne rounds (the same bits, vectorised where the instruction set allows).
inline void store_pair_rne(Vec p0, Vec p1, uint32_t* dst) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff);
  const __m512i absm = _mm512_set1_epi32(0x7fffffff), infb = _mm512_set1_epi32(0x7f800000);
  auto rne = [&](__m512 x) {  // bf16 bits in the top half
    const __m512i u = _mm512_castps_si512(x);
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, absm), infb);
    const __m512i qnan = _mm512_or_si512(_mm512_and_si512(u, _mm512_set1_epi32(static_cast<int>(0x80000000u))),
                                         _mm512_set1_epi32(0x7fc00000));
    return _mm512_mask_blend_epi32(nan, r, qnan);
  };
  const __m512i lo = _mm512_srli_epi32(rne(static_cast<__m512>(p0)), 16);
  const __m512i hi = _mm512_and_si512(rne(static_cast<__m512>(p1)), _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  _mm512_storeu_si512(dst, _mm512_or_si512(lo, hi));
#else
  float a[VL], b[VL];
  p0.store(a);
  p1.store(b);
  for (int64_t i = 0; i < VL; ++i) dst[i] = bf16_bits_rne(a[i]) | (bf16_bits_rne(b[i]) << 16);
#endif
}

// P^T (n x Rp fp32, rows = keys) as pairs of keys, rounded to bf16 (nearest even), as the GPU
// kernels round P: dst[jj * Rp + r] = (P[2 jj][r], P[2 jj + 1][r]), a zero key past n.
inline void pack_probs(const float* p, int64_t Rp, int64_t n, uint32_t* dst) {
  for (int64_t jj = 0; jj < (n + 1) / 2; ++jj) {
    const float* p0 = p + 2 * jj * Rp;
    const float* p1 = p0 + Rp;
    uint32_t* d = dst + jj * Rp;
    if (2 * jj + 1 < n) {
      for (int64_t r = 0; r < Rp; ++r) d[r] = bf16_bits_rne(p0[r]) | (bf16_bits_rne(p1[r]) << 16);
    } else {
      for (int64_t r = 0; r < Rp; ++r) d[r] = bf16_bits_rne(p0[r]);
    }
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
// V[2 jj + 1][d]) for d < cols, a zero key past n, zero columns from cols to ldd.
template <typename Rows>
inline void pack_key_pairs(const Rows& rows, int64_t j0, int64_t n, int64_t cols, uint32_t* dst, int64_t ldd) {
  for (int64_t jj = 0; jj < (n + 1) / 2; ++jj) {
    const uint16_t* v0 = reinterpret_cast<const uint16_t*>(rows.row(j0 + 2 * jj));
    uint32_t* d = dst + jj * ldd;
    if (2 * jj + 1 < n) {
      const uint16_t* v1 = reinterpret_cast<const uint16_t*>(rows.row(j0 + 2 * jj + 1));
      for (int64_t c = 0; c < cols; ++c) d[c] = static_cast<uint32_t>(v0[c]) | (static_cast<uint32_t>(v1[c]) << 16);
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

// fp32 rows (n x cols, row stride ld, n even) as pairs of rows: dst[rr * ldd + c] = (x[2 rr][c],
// x[2 rr + 1][c]). round: to bf16 nearest even (probabilities, dS); else the rows hold bf16
// values exactly and their top halves are taken.
inline void pack_row_pairs(const float* x, int64_t ld, int64_t n, int64_t cols, uint32_t* dst, int64_t ldd,
                           bool round) {
  for (int64_t rr = 0; rr < n / 2; ++rr) {
    const float* x0 = x + 2 * rr * ld;
    const float* x1 = x0 + ld;
    uint32_t* d = dst + rr * ldd;
    if (round) {
      for (int64_t c = 0; c < cols; ++c) d[c] = bf16_bits_rne(x0[c]) | (bf16_bits_rne(x1[c]) << 16);
    } else {
      for (int64_t c = 0; c < cols; ++c) {
        uint32_t lo, hi;
        std::memcpy(&lo, x0 + c, 4);
        std::memcpy(&hi, x1 + c, 4);
        d[c] = (lo >> 16) | (hi & 0xffff0000u);
      }
    }
  }
}

// fp32 rows (n x cols, cols even) as pairs along each row, rounded to bf16 nearest even:
// dst[j * (cols / 2) + cc] = (x[j][2 cc], x[j][2 cc + 1]).
inline void pack_cols_rounded(const float* x, int64_t n, int64_t cols, uint32_t* dst) {
  for (int64_t j = 0; j < n; ++j) {
    const float* xr = x + j * cols;
    uint32_t* d = dst + j * (cols / 2);
    for (int64_t cc = 0; cc < cols / 2; ++cc) d[cc] = bf16_bits_rne(xr[2 * cc]) | (bf16_bits_rne(xr[2 * cc + 1]) << 16);
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
