// Vector math and data movement of the cpu kernels: the softmax's 2^x, fp32 conversion of
// rows of the input dtypes, row loads and stores, a deterministic dot product, prefetches and
// the 8x8 transposes that turn rows into the column layout the tiles use.
#pragma once

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <type_traits>

#include "common.h"

namespace mhakern::cpu {
namespace CPU_CAPABILITY {

// 2^x for the softmax exponents (x <= 0 in exact arithmetic). Round-to-nearest range reduction
// and a degree-7 Taylor polynomial of 2^f on [-1/2, 1/2] (relative error below 1e-8, i.e.
// within an ulp of float); x below -127 (and -inf, for masked scores) gives exactly 0.
inline Vec exp2v(Vec x) {
  x = at::vec::clamp_max(at::vec::clamp_min(x, Vec(-127.f)), Vec(127.f));
  const Vec n = x.round();
  const Vec f = x - n;
  Vec r(1.5252733804059841e-05f);                 // ln2^7 / 7!
  r = at::vec::fmadd(r, f, Vec(1.5403530393381606e-04f));  // ln2^6 / 6!
  r = at::vec::fmadd(r, f, Vec(1.3333558146428443e-03f));  // ln2^5 / 5!
  r = at::vec::fmadd(r, f, Vec(9.6181291076284772e-03f));  // ln2^4 / 4!
  r = at::vec::fmadd(r, f, Vec(5.5504108664821580e-02f));  // ln2^3 / 3!
  r = at::vec::fmadd(r, f, Vec(2.4022650695910071e-01f));  // ln2^2 / 2!
  r = at::vec::fmadd(r, f, Vec(6.9314718055994531e-01f));  // ln2
  r = at::vec::fmadd(r, f, Vec(1.f));
  // 2^n from its exponent bits; n = -127 gives the bit pattern of +0.
  const IVec bits = (at::vec::convert_to_int_of_same_size(n) + IVec(127)) << IVec(23);
  return r * at::vec::cast<float>(bits);
}

// 2^x for the probabilities of the bf16 products (forward.h, backward.h), which are rounded to
// bf16 (8 bits) before any product and summed in fp32: exp2v's range reduction, a degree-5
// polynomial of 2^f with 2^0 = 1 exactly (a minimax fit of the relative error, 1.6e-7 at most,
// measured in float arithmetic over [-1/2, 1/2]; exp2v's degree 7 gives 1e-8), and 2^n applied
// as vscalefps applies it (r * 2^n rounded once): two fused multiply-adds and three integer
// steps fewer than exp2v. x below -160 (and -inf: masked scores) gives exactly 0; between -160 and
// -126 a denormal or 0, where exp2v gives 0 below -126.5: the bf16 rounding (DAZ) and the fp32
// sums (each row's sum holds its maximum's 1) see no difference. The fp32 products keep exp2v.
inline Vec exp2v_short(Vec x) {
  x = at::vec::clamp_max(at::vec::clamp_min(x, Vec(-160.f)), Vec(127.f));
  const Vec n = x.round();
  const Vec f = x - n;
  Vec r(1.3268215116113424e-03f);
  r = at::vec::fmadd(r, f, Vec(9.671511128544807e-03f));
  r = at::vec::fmadd(r, f, Vec(5.550721660256386e-02f));
  r = at::vec::fmadd(r, f, Vec(2.4022242426872253e-01f));
  r = at::vec::fmadd(r, f, Vec(6.931470036506653e-01f));
  r = at::vec::fmadd(r, f, Vec(1.f));
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_scalef_ps(r, n));
#else
  // The same single rounding: r * 2^n exactly below 2^-126 as (r * 2^(n + 64)) * 2^-64, whose
  // first product is exact.
  const auto lo = n < Vec(-126.f);
  const Vec e = Vec::blendv(n, n + Vec(64.f), lo);
  const IVec bits = (at::vec::convert_to_int_of_same_size(e) + IVec(127)) << IVec(23);
  return (r * at::vec::cast<float>(bits)) * Vec::blendv(Vec(1.f), Vec(0x1p-64f), lo);
#endif
}

// x, opaque to the optimiser: a product passed through it is rounded on its own, as a product
// stored to memory is, never contracted with a following addition into one fused multiply-add
// (GCC contracts the vector operators' mul and sub; a different rounding).
inline Vec opaque(Vec x) {
#if defined(__GNUC__) && defined(CPU_CAPABILITY_AVX512)
  __m512 r = x;
  asm("" : "+v"(r));
  return Vec(r);
#elif defined(__GNUC__) && defined(__AVX2__)
  __m256 r = x;
  asm("" : "+v"(r));
  return Vec(r);
#else
  return x;
#endif
}

// tanh(x) for the softcap, within an ulp or two of float. |x| < 0.625: x + x^3 P(x^2), P a
// degree-4 fit of (tanh x - x) / x^3 minimising the relative error (0.74 ulp at most, measured
// over the interval in float arithmetic); beyond, sign(x) (1 - 2 / (1 + 2^(2 |x| log2 e))), whose
// subtraction loses less than a bit there (tanh >= 0.55) and which is +-1 exactly for |x| > 44
// (exp2v saturates at 2^127) and at +-inf. A NaN stays NaN.
inline Vec tanhv(Vec x) {
  const Vec ax = x.abs(), x2 = x * x;
  Vec p(-5.704978373190422e-03f);
  p = at::vec::fmadd(p, x2, Vec(2.0639078740391947e-02f));
  p = at::vec::fmadd(p, x2, Vec(-5.373971215648989e-02f));
  p = at::vec::fmadd(p, x2, Vec(1.333144215753112e-01f));
  p = at::vec::fmadd(p, x2, Vec(-3.3333281940181897e-01f));
  const Vec small = at::vec::fmadd(x * x2, p, x);
  const Vec e = exp2v(ax * Vec(2.f * kLog2e));
  const Vec big = Vec(1.f) - Vec(2.f) / (e + Vec(1.f));
  const Vec t = Vec::blendv(Vec::blendv(big, Vec(0.f) - big, x < Vec(0.f)), small, ax < Vec(0.625f));
  return Vec::blendv(t, x, x != x);
}

template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

// Rows [0, n) of a (rows x cols, row stride ld) block as fp32: the block itself for float
// inputs, else a converted copy in `tmp` (row stride cols).
template <typename T>
inline const float* rows_as_float(const T* src, int64_t n, int64_t cols, int64_t ld, float* tmp, int64_t* out_ld) {
  if constexpr (std::is_same_v<T, float>) {
    *out_ld = ld;
    return src;
  } else {
    for (int64_t r = 0; r < n; ++r) {
      const T* s = src + r * ld;
      float* d = tmp + r * cols;
      for (int64_t c = 0; c < cols; ++c) d[c] = to_float(s[c]);
    }
    *out_ld = cols;
    return tmp;
  }
}

// One query row of a block, as fp32 times `mul`, into dst[0, ld): zero past the n values.
template <typename T>
inline void load_row(const T* src, int64_t n, float mul, float* dst, int64_t ld) {
  int64_t c = 0;
  if constexpr (std::is_same_v<T, float>) {
    const Vec m(mul);
    for (; c + VL <= n; c += VL) (Vec::loadu(src + c) * m).store(dst + c);
  }
  for (; c < n; ++c) dst[c] = to_float(src[c]) * mul;
  for (; c < ld; ++c) dst[c] = 0.f;
}

// dst[0, n) = src[0, n) * mul, converted to the output dtype.
template <typename T>
inline void store_row(const float* src, int64_t n, float mul, T* dst) {
  int64_t c = 0;
  if constexpr (std::is_same_v<T, float>) {
    const Vec m(mul);
    for (; c + VL <= n; c += VL) (Vec::loadu(src + c) * m).store(dst + c);
  }
  for (; c < n; ++c) dst[c] = static_cast<T>(src[c] * mul);
}

// Asks for the cache lines of `rows` rows of `row_elems` elements (row stride `ld`) ahead of
// use: decode-sized tasks are short, so the next task's inputs are fetched while this one computes.
template <int RW = 0, int LOC = 3, typename T>
inline void prefetch_rows(const T* base, int64_t rows, int64_t row_elems, int64_t ld) {
#if defined(__GNUC__)
  constexpr int64_t kLine = 64 / sizeof(T);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < row_elems; c += kLine) __builtin_prefetch(base + r * ld + c, RW, LOC);
#else
  (void)base, (void)rows, (void)row_elems, (void)ld;
#endif
}

// dst[c * ldd + r] = src[r * lds + c] for r < rows, c < cols, both multiples of 8 (the scratch
// tiles are padded to whole vectors, which are 8 or 16 floats).
#if defined(__AVX2__)
inline void transpose8x8(const float* src, int64_t lds, float* dst, int64_t ldd) {
  const __m256 r0 = _mm256_loadu_ps(src + 0 * lds), r1 = _mm256_loadu_ps(src + 1 * lds);
  const __m256 r2 = _mm256_loadu_ps(src + 2 * lds), r3 = _mm256_loadu_ps(src + 3 * lds);
  const __m256 r4 = _mm256_loadu_ps(src + 4 * lds), r5 = _mm256_loadu_ps(src + 5 * lds);
  const __m256 r6 = _mm256_loadu_ps(src + 6 * lds), r7 = _mm256_loadu_ps(src + 7 * lds);
  const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
  const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
  const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
  const __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  _mm256_storeu_ps(dst + 0 * ldd, _mm256_permute2f128_ps(u0, u4, 0x20));
  _mm256_storeu_ps(dst + 1 * ldd, _mm256_permute2f128_ps(u1, u5, 0x20));
  _mm256_storeu_ps(dst + 2 * ldd, _mm256_permute2f128_ps(u2, u6, 0x20));
  _mm256_storeu_ps(dst + 3 * ldd, _mm256_permute2f128_ps(u3, u7, 0x20));
  _mm256_storeu_ps(dst + 4 * ldd, _mm256_permute2f128_ps(u0, u4, 0x31));
  _mm256_storeu_ps(dst + 5 * ldd, _mm256_permute2f128_ps(u1, u5, 0x31));
  _mm256_storeu_ps(dst + 6 * ldd, _mm256_permute2f128_ps(u2, u6, 0x31));
  _mm256_storeu_ps(dst + 7 * ldd, _mm256_permute2f128_ps(u3, u7, 0x31));
}
#endif

inline void transpose(const float* src, int64_t lds, float* dst, int64_t ldd, int64_t rows, int64_t cols) {
#if defined(__AVX2__)
  for (int64_t r = 0; r < rows; r += 8)
    for (int64_t c = 0; c < cols; c += 8) transpose8x8(src + r * lds + c, lds, dst + c * ldd + r, ldd);
#else
  for (int64_t r = 0; r < rows; r += 8)
    for (int64_t c = 0; c < cols; c += 8)
      for (int64_t rr = r; rr < r + 8; ++rr)
        for (int64_t cc = c; cc < c + 8; ++cc) dst[cc * ldd + rr] = src[rr * lds + cc];
#endif
}

// A key block (bk rows of `cols` floats, row stride ld) transposed into xt (cols x bkp, bkp =
// bk rounded up to whole vectors), the columns past bk zero: the B operand of the key-major
// tiles' score product (rows of Q times K^T, forward.h and the backward's row tiles). Whole 8 x 8
// blocks by transpose, the rest of the keys and of the columns element by element.
inline void keys_transposed(const float* x, int64_t ld, int64_t bk, int64_t cols, float* xt) {
  const int64_t bkp = round_up(bk, VL), bk8 = bk / 8 * 8, cols8 = cols / 8 * 8;
  transpose(x, ld, xt, bkp, bk8, cols8);
  for (int64_t c = 0; c < cols; ++c) {
    float* row = xt + c * bkp;
    for (int64_t j = c < cols8 ? bk8 : 0; j < bk; ++j) row[j] = x[j * ld + c];
    std::fill(row + bk, row + bkp, 0.f);
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace mhakern::cpu
