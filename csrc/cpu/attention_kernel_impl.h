// The fused CPU attention kernels. This header is compiled once per instruction set by
// kernels_<isa>.cpp, which defines CPU_CAPABILITY (and CPU_CAPABILITY_<ISA>) first, so ATen's
// Vectorized<float> is the AVX-512, AVX2 or portable one and everything here lands in the
// namespace mhakern::cpu::<ISA>; the host code picks one table at run time.
//
// Algorithm (exact attention, FlashAttention-2 style, fp32 accumulation whatever the input):
// * A task owns a block of query rows: either up to kRowBlock queries of one head, or, when
//   Lq is small (decode), the same queries of all the query heads that share a KV head, so each
//   key block is read once for all of them. Rows live in the columns of transposed scratch
//   tiles (Q^T: D x Rp), so the softmax statistics of a row block are plain vectors and the
//   score tile is S^T = K_blk * Q^T: K and V are read in place (no transposition, no copy for
//   fp32) as the broadcast operand of a register-blocked micro-kernel.
// * Forward: online softmax over key blocks in base 2 (scale * log2(e) folded into Q), the
//   output accumulated as O^T = V_blk^T * P^T; lse = (m + log2 l) * ln 2. Long key ranges with
//   few row blocks are split into key ranges whose normalised partials are merged by lse.
// * Backward: a task owns (batch, KV head, key range): it gathers all the query rows of the
//   heads sharing the KV head once, then for each key block recomputes P from lse and
//   accumulates dV, dK for the block (owned: no atomics) and dQ^T for the rows; with several
//   key ranges, dQ partials are summed in a fixed order.
// Memory: a thread's scratch is a few tiles, plus in the backward the gathered rows of one KV
// head's query heads (about 5 * rows * D floats); split partials stay within kPartialBudget.
// Nothing grows with Lk, so 2^22 keys and more run in bounded memory.
// Masks reduce to a per-row prefix: row (b, i) sees keys j < lim = min(Lk_b, i + Lk_b - Lq + 1)
// (causal) or j < Lk_b; lim <= 0 means the row sees nothing (out 0, lse -inf, zero gradient).
// Every decomposition depends on the shapes only, never on the thread count, so results are
// bitwise reproducible.
#pragma once

#ifndef CPU_CAPABILITY
#error "define CPU_CAPABILITY (and CPU_CAPABILITY_<ISA>) before including attention_kernel_impl.h"
#endif

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <type_traits>

#include "attention_params.h"

namespace mhakern::cpu {
namespace CPU_CAPABILITY {

using Vec = at::vec::Vectorized<float>;
using IVec = at::vec::Vectorized<int32_t>;
constexpr int64_t VL = Vec::size();

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr double kLn2d = 0.6931471805599453094;
constexpr double kLog2ed = 1.4426950408889634074;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// ---------------------------------------------------------------------------------------------
// Block sizes and work decomposition (shape-only, see the header comment).

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

// Number of key ranges a group of `base` tasks is split into: enough for kTargetTasks tasks,
// each range at least `min_keys` long, partial results within kPartialBudget.
inline int64_t plan_key_splits(int64_t base, int64_t Lk, int64_t min_keys, int64_t floats_per_split) {
  if (base >= kTargetTasks || Lk < 2 * min_keys) return 1;
  int64_t n = std::min(ceil_div(kTargetTasks, base), ceil_div(Lk, min_keys));
  n = std::min(n, kPartialBudget / std::max<int64_t>(floats_per_split, 1));
  return std::max<int64_t>(n, 1);
}

// Keys visible to row (b, i) are exactly j < row_limit (<= 0: none).
inline int64_t row_limit(const AttnParams& p, int64_t b, int64_t i) {
  const int64_t lkb = p.key_lengths ? static_cast<int64_t>(p.key_lengths[b]) : p.Lk;
  return p.causal ? std::min(lkb, i + lkb - p.Lq + 1) : lkb;
}

// ---------------------------------------------------------------------------------------------
// Scratch memory: one zeroed, 64-byte aligned float buffer per thread chunk.

class Scratch {
 public:
  explicit Scratch(int64_t n) : n_(std::max<int64_t>(n, 1)) {
    p_ = static_cast<float*>(::operator new[](n_ * sizeof(float), std::align_val_t(64)));
    std::memset(p_, 0, n_ * sizeof(float));
  }
  ~Scratch() { ::operator delete[](p_, std::align_val_t(64)); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  // Hands out consecutive pieces, each rounded up to whole cache lines.
  float* take(int64_t n) {
    float* r = p_ + used_;
    used_ += size_of(n);
    TORCH_INTERNAL_ASSERT(used_ <= n_, "mhakern cpu kernel: scratch overflow");
    return r;
  }
  // Starts handing out from the beginning again (the contents are kept).
  void reset() { used_ = 0; }
  static int64_t size_of(int64_t n) { return round_up(std::max<int64_t>(n, 0), 16); }

 private:
  int64_t n_;
  int64_t used_ = 0;
  float* p_ = nullptr;
};

// ---------------------------------------------------------------------------------------------
// Vector helpers.

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

// sum(a[i] * b[i]), with VL partial sums (a fixed order: deterministic).
inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc(0.f);
  int64_t c = 0;
  for (; c + VL <= n; c += VL) acc = at::vec::fmadd(Vec::loadu(a + c), Vec::loadu(b + c), acc);
  if (c < n) acc = at::vec::fmadd(Vec::loadu(a + c, n - c), Vec::loadu(b + c, n - c), acc);
  float part[VL];
  acc.store(part);
  float sum = 0.f;
  for (int64_t i = 0; i < VL; ++i) sum += part[i];
  return sum;
}

// Asks for the cache lines of `rows` rows of `row_elems` elements (row stride `ld`) ahead of
// use: decode-sized tasks are short, so the next task's inputs are fetched while this one computes.
template <int RW = 0, typename T>
inline void prefetch_rows(const T* base, int64_t rows, int64_t row_elems, int64_t ld) {
#if defined(__GNUC__)
  constexpr int64_t kLine = 64 / sizeof(T);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < row_elems; c += kLine) __builtin_prefetch(base + r * ld + c, RW, 3);
#else
  (void)base, (void)rows, (void)row_elems, (void)ld;
#endif
}

// The query rows of a block in view `x` (heads h0 .., queries i0 ..), at most kRowBlock of them.
template <typename T, int RW = 0, typename V>
inline void prefetch_block_rows(const V& x, int64_t b, const RowBlock& rb, int64_t elems) {
  const T* base = static_cast<const T*>(x.ptr) + b * x.sb;
  for (int64_t hh = 0; hh < rb.nh; ++hh)
    prefetch_rows<RW>(base + (rb.h0 + hh) * x.sh + rb.i0 * x.sl, std::min<int64_t>(rb.nq, kRowBlock), elems, x.sl);
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

// ---------------------------------------------------------------------------------------------
// GEMM: C (M x N) = A (M x K) * B (K x N) + beta(C), all fp32. A is read by broadcasts at
// A[m * ars + k * acs] (any strides, so K, V, P^T and their transposes are used in place);
// B and C are row-major with N a multiple of VL (padded scratch tiles). beta(C) is 0 (Store),
// C (Accumulate) or C scaled per column by `cscale` (Rescale: the online softmax's correction
// of the output accumulator, fused into the load of C).

enum class CMode { Store, Accumulate, Rescale };

template <int MR, int NV, CMode MODE>
inline void micro_kernel(int64_t K, const float* A, int64_t ars, int64_t acs, const float* B, int64_t ldb,
                         float* C, int64_t ldc, const float* cscale) {
  // The loops over the tile are unrolled early so that the compiler keeps c in registers.
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
    const float* b = B + kk * ldb;
    Vec bv[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) bv[j] = Vec::loadu(b + j * VL);
    const float* a = A + kk * acs;
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const Vec av(a[i * ars]);
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) c[i][j] = at::vec::fmadd(av, bv[j], c[i][j]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) c[i][j].store(C + i * ldc + j * VL);
}

// Row tile height for NV vectors of columns: 12 accumulators (MR x NV) plus the NV loaded B
// vectors and one broadcast fit the 16 AVX2 registers.
template <int NV>
constexpr int tile_rows() {
  return NV == 1 ? 8 : (NV == 2 ? 6 : 4);
}

template <int MR, int NV, CMode MODE>
inline void micro_tail(int64_t rem, int64_t K, const float* A, int64_t ars, int64_t acs, const float* B, int64_t ldb,
                       float* C, int64_t ldc, const float* cscale) {
  if constexpr (MR > 0) {
    if (rem == MR)
      micro_kernel<MR, NV, MODE>(K, A, ars, acs, B, ldb, C, ldc, cscale);
    else
      micro_tail<MR - 1, NV, MODE>(rem, K, A, ars, acs, B, ldb, C, ldc, cscale);
  }
}

template <int NV, CMode MODE>
inline void gemm_strip(int64_t M, int64_t K, const float* A, int64_t ars, int64_t acs, const float* B, int64_t ldb,
                       float* C, int64_t ldc, const float* cscale) {
  constexpr int MR = tile_rows<NV>();
  int64_t m = 0;
  for (; m + MR <= M; m += MR)
    micro_kernel<MR, NV, MODE>(K, A + m * ars, ars, acs, B, ldb, C + m * ldc, ldc, cscale);
  if (m < M) micro_tail<MR - 1, NV, MODE>(M - m, K, A + m * ars, ars, acs, B, ldb, C + m * ldc, ldc, cscale);
}

template <CMode MODE>
inline void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t ars, int64_t acs, const float* B,
                 int64_t ldb, float* C, int64_t ldc, const float* cscale = nullptr) {
  if (M <= 0 || N <= 0) return;
  const int64_t nvec = N / VL;
  int64_t v = 0;
  auto sc = [&](int64_t vv) { return MODE == CMode::Rescale ? cscale + vv * VL : nullptr; };
  if (nvec % 3 == 0) {
    for (; v < nvec; v += 3) gemm_strip<3, MODE>(M, K, A, ars, acs, B + v * VL, ldb, C + v * VL, ldc, sc(v));
    return;
  }
  for (; v + 2 <= nvec; v += 2) gemm_strip<2, MODE>(M, K, A, ars, acs, B + v * VL, ldb, C + v * VL, ldc, sc(v));
  if (v < nvec) gemm_strip<1, MODE>(M, K, A, ars, acs, B + v * VL, ldb, C + v * VL, ldc, sc(v));
}

// ---------------------------------------------------------------------------------------------
// Forward.

struct FwdScratch {
  float *qr, *qt, *st, *ot, *orow, *m, *l, *alpha, *lim, *kc, *vc;
  static int64_t floats(int64_t Dp, int64_t Dvp, int64_t Rp) {
    return Scratch::size_of(Rp * Dp) + Scratch::size_of(Dp * Rp) + Scratch::size_of(kKeyBlock * Rp) +
           Scratch::size_of(Dvp * Rp) + Scratch::size_of(Rp * Dvp) + 4 * Scratch::size_of(Rp) +
           Scratch::size_of(kKeyBlock * Dp) + Scratch::size_of(kKeyBlock * Dvp);
  }
  FwdScratch(Scratch& s, int64_t Dp, int64_t Dvp, int64_t Rp) {
    qr = s.take(Rp * Dp);
    qt = s.take(Dp * Rp);
    st = s.take(kKeyBlock * Rp);
    ot = s.take(Dvp * Rp);
    orow = s.take(Rp * Dvp);
    m = s.take(Rp);
    l = s.take(Rp);
    alpha = s.take(Rp);
    lim = s.take(Rp);
    kc = s.take(kKeyBlock * Dp);
    vc = s.take(kKeyBlock * Dvp);
  }
};

// Where a forward task puts its rows: the outputs, or (split key ranges) partial buffers
// holding the normalised output and the base-2 lse of the range.
struct FwdSink {
  float* part_o = nullptr;  // (splits, B, H, Lq, Dv) or nullptr for the final outputs
  float* part_l = nullptr;  // (splits, B, H, Lq)
  int64_t split = 0;
};

// Hides the scores of keys j0 + j >= lim[r] (lim relative to the block: j >= lim - j0).
inline void mask_block(float* st, int64_t Rp, int64_t bk, const float* limrel) {
  for (int64_t j = 0; j < bk; ++j) {
    const Vec jv(static_cast<float>(j));
    float* sp = st + j * Rp;
    for (int64_t v = 0; v < Rp / VL; ++v)
      Vec::blendv(Vec::loadu(sp + v * VL), Vec(kNegInf), jv >= Vec::loadu(limrel + v * VL)).store(sp + v * VL);
  }
}

template <typename T>
void forward_rows(const AttnParams& p, int64_t b, const RowBlock& rb, int64_t kbeg, int64_t kend, const FwdScratch& s,
                  const FwdSink& sink) {
  const int64_t D = p.D, Dv = p.Dv, n_rep = p.H / p.Hkv;
  const int64_t Dp = round_up(D, VL), Dvp = round_up(Dv, VL);
  const int64_t R = rb.rows(), Rp = round_up(R, VL), nvec = Rp / VL;
  const int64_t hkv = rb.h0 / n_rep;

  int64_t minlim = std::numeric_limits<int64_t>::max(), maxlim = std::numeric_limits<int64_t>::min();
  for (int64_t r = 0; r < R; ++r) {
    const int64_t lim = row_limit(p, b, rb.i0 + r % rb.nq);
    minlim = std::min(minlim, lim);
    maxlim = std::max(maxlim, lim);
  }
  const int64_t kstop = std::min(kend, maxlim);

  // Q rows (scaled by scale * log2(e), so scores come out in base 2), then Q^T (Dp x Rp).
  const float qmul = p.scale * kLog2e;
  const T* q = static_cast<const T*>(p.q.ptr) + b * p.q.sb;
  for (int64_t r = 0; r < R; ++r)
    load_row(q + (rb.h0 + r / rb.nq) * p.q.sh + (rb.i0 + r % rb.nq) * p.q.sl, D, qmul, s.qr + r * Dp, Dp);
  std::fill(s.qr + R * Dp, s.qr + Rp * Dp, 0.f);
  transpose(s.qr, Dp, s.qt, Rp, Rp, Dp);
  for (int64_t v = 0; v < nvec; ++v) {
    Vec(kNegInf).store(s.m + v * VL);
    Vec(0.f).store(s.l + v * VL);
  }
  if (kbeg >= kstop) std::fill(s.ot, s.ot + Dvp * Rp, 0.f);  // no key block will write it

  const T* kbase = static_cast<const T*>(p.k.ptr) + b * p.k.sb + hkv * p.k.sh;
  const T* vbase = static_cast<const T*>(p.v.ptr) + b * p.v.sb + hkv * p.v.sh;
  for (int64_t j0 = kbeg; j0 < kstop; j0 += kKeyBlock) {
    const int64_t bk = std::min(kKeyBlock, kstop - j0);
    int64_t ldk, ldv;
    const float* Kb = rows_as_float<T>(kbase + j0 * p.k.sl, bk, D, p.k.sl, s.kc, &ldk);
    // S^T (bk x Rp) = K_blk * Q^T
    gemm<CMode::Store>(bk, Rp, D, Kb, ldk, 1, s.qt, Rp, s.st, Rp);

    if (j0 + bk > minlim) {
      // Some row's visible prefix ends inside this block. Limits relative to the block are
      // small integers, exact in float whatever Lk.
      for (int64_t r = 0; r < Rp; ++r)
        s.lim[r] = r < R ? static_cast<float>(std::clamp<int64_t>(row_limit(p, b, rb.i0 + r % rb.nq) - j0, 0, bk))
                         : 0.f;
      mask_block(s.st, Rp, bk, s.lim);
    }

    // Online softmax. Loops run over keys outside and row vectors inside, so the max and sum
    // reductions of the row vectors are independent chains rather than one serial one.
    Vec mx[kRowVecs], muse[kRowVecs], sum[kRowVecs];
    for (int64_t v = 0; v < nvec; ++v) {
      mx[v] = Vec(kNegInf);
      sum[v] = Vec(0.f);
    }
    for (int64_t j = 0; j < bk; ++j) {
      const float* sp = s.st + j * Rp;
      for (int64_t v = 0; v < nvec; ++v) mx[v] = at::vec::clamp_min(mx[v], Vec::loadu(sp + v * VL));
    }
    for (int64_t v = 0; v < nvec; ++v) {
      const Vec mold = Vec::loadu(s.m + v * VL);
      const Vec mnew = at::vec::clamp_min(mold, mx[v]);
      // A row with nothing visible yet keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
      muse[v] = Vec::blendv(mnew, Vec(0.f), mnew == Vec(kNegInf));
      exp2v(mold - muse[v]).store(s.alpha + v * VL);
      mnew.store(s.m + v * VL);
    }
    for (int64_t j = 0; j < bk; ++j) {
      float* sp = s.st + j * Rp;
      for (int64_t v = 0; v < nvec; ++v) {
        const Vec pj = exp2v(Vec::loadu(sp + v * VL) - muse[v]);
        pj.store(sp + v * VL);
        sum[v] = sum[v] + pj;
      }
    }
    for (int64_t v = 0; v < nvec; ++v)
      (Vec::loadu(s.l + v * VL) * Vec::loadu(s.alpha + v * VL) + sum[v]).store(s.l + v * VL);

    const float* Vb = rows_as_float<T>(vbase + j0 * p.v.sl, bk, Dv, p.v.sl, s.vc, &ldv);
    // O^T (Dv x Rp) = alpha * O^T + V_blk^T * P^T
    if (j0 == kbeg)
      gemm<CMode::Store>(Dv, Rp, bk, Vb, 1, ldv, s.st, Rp, s.ot, Rp);
    else
      gemm<CMode::Rescale>(Dv, Rp, bk, Vb, 1, ldv, s.st, Rp, s.ot, Rp, s.alpha);
  }

  // Rows of O (the padding rows of O^T, Dv .. Dvp, are never read back).
  transpose(s.ot, Rp, s.orow, Dvp, Dvp, Rp);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t h = rb.h0 + r / rb.nq, i = rb.i0 + r % rb.nq;
    const float l = s.l[r];
    const bool dead = !(l > 0.f);
    const float inv = dead ? 0.f : 1.f / l;
    // lse leaves in natural log and comes back in base 2 in the backward: round once each way
    // (in double), so the probabilities recomputed from it stay as exact as the scores. l >= 1
    // (the row's max contributes 1), so log2f's ulp-level error stays below 1e-6.
    const double lse2 = dead ? -std::numeric_limits<double>::infinity() : static_cast<double>(s.m[r]) + std::log2(l);
    const float* src = s.orow + r * Dvp;
    if (sink.part_o == nullptr) {
      store_row(src, Dv, inv, static_cast<T*>(p.out.ptr) + b * p.out.sb + h * p.out.sh + i * p.out.sl);
      p.lse[(b * p.H + h) * p.Lq + i] = dead ? kNegInf : static_cast<float>(lse2 * kLn2d);
    } else {
      const int64_t row = ((sink.split * p.B + b) * p.H + h) * p.Lq + i;
      float* po = sink.part_o + row * Dv;
      for (int64_t dv = 0; dv < Dv; ++dv) po[dv] = src[dv] * inv;
      sink.part_l[row] = static_cast<float>(lse2);
    }
  }
}

// Merges the key-range partials of every row, in range order.
template <typename T>
void merge_splits(const AttnParams& p, int64_t n_splits, const float* part_o, const float* part_l) {
  const int64_t rows = p.B * p.H * p.Lq, Dv = p.Dv;
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    Scratch buf(Dv + n_splits + 32);
    float* acc = buf.take(Dv);
    float* w = buf.take(n_splits);
    for (int64_t row = r0; row < r1; ++row) {
      const int64_t i = row % p.Lq, h = (row / p.Lq) % p.H, b = row / (p.Lq * p.H);
      float mx = kNegInf;
      for (int64_t sp = 0; sp < n_splits; ++sp) mx = std::max(mx, part_l[sp * rows + row]);
      T* orow = static_cast<T*>(p.out.ptr) + b * p.out.sb + h * p.out.sh + i * p.out.sl;
      if (mx == kNegInf) {
        for (int64_t dv = 0; dv < Dv; ++dv) orow[dv] = static_cast<T>(0.f);
        p.lse[row] = kNegInf;
        continue;
      }
      float wsum = 0.f;
      for (int64_t sp = 0; sp < n_splits; ++sp) {
        w[sp] = std::exp2(part_l[sp * rows + row] - mx);
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
      p.lse[row] = static_cast<float>((static_cast<double>(mx) + std::log2(static_cast<double>(wsum))) * kLn2d);
    }
  });
}

template <typename T>
void forward_impl(const AttnParams& p) {
  if (p.B == 0 || p.H == 0 || p.Lq == 0) return;
  const int64_t n_rep = p.H / p.Hkv;
  const RowPlan rp = plan_rows(n_rep, p.Lq);
  const int64_t nblk = rp.blocks();
  const int64_t base = p.B * p.Hkv * nblk;
  const int64_t rows = p.B * p.H * p.Lq;
  int64_t n_splits = plan_key_splits(base, p.Lk, 1024, rows * (p.Dv + 1));
  int64_t span = p.Lk;
  if (n_splits > 1) {
    span = round_up(ceil_div(p.Lk, n_splits), kKeyBlock);
    n_splits = ceil_div(p.Lk, span);
  }
  const int64_t Rpmax = round_up(rp.max_rows(), VL);
  const int64_t Dp = round_up(p.D, VL), Dvp = round_up(p.Dv, VL);
  const int64_t per_thread = FwdScratch::floats(Dp, Dvp, Rpmax);

  std::unique_ptr<Scratch> partials;
  FwdSink sink;
  if (n_splits > 1) {
    partials = std::make_unique<Scratch>(n_splits * rows * (p.Dv + 1) + 32);
    sink.part_o = partials->take(n_splits * rows * p.Dv);
    sink.part_l = partials->take(n_splits * rows);
  }
  at::parallel_for(0, base * n_splits, 1, [&](int64_t t0, int64_t t1) {
    Scratch buf(per_thread);
    const FwdScratch s(buf, Dp, Dvp, Rpmax);
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
        prefetch_rows(static_cast<const T*>(p.k.ptr) + b1 * p.k.sb + hkv1 * p.k.sh + j1 * p.k.sl, n1, p.D, p.k.sl);
        prefetch_rows(static_cast<const T*>(p.v.ptr) + b1 * p.v.sb + hkv1 * p.v.sh + j1 * p.v.sl, n1, p.Dv, p.v.sl);
      }
      task(t, &b, &hkv, &blk, &sp);
      FwdSink my = sink;
      my.split = sp;
      const int64_t kbeg = sp * span, kend = std::min(p.Lk, kbeg + span);
      forward_rows<T>(p, b, row_block(rp, hkv, blk), kbeg, kend, s, my);
    }
  });
  if (n_splits > 1) merge_splits<T>(p, n_splits, sink.part_o, sink.part_l);
}

// ---------------------------------------------------------------------------------------------
// Backward.

// Per row block: the gathered operands and the dQ^T accumulator.
struct RowSlot {
  RowBlock rb;
  float *qr, *qt, *dor, *dot, *lse2, *delta, *dqt;
  int64_t minlim, maxlim;
  bool dq_started;
};

struct BwdLayout {
  int64_t Dp, Dvp, Rp;  // Rp: the largest block's
  int64_t slot_floats() const {
    return Scratch::size_of(Rp * Dp) + Scratch::size_of(Dp * Rp) + Scratch::size_of(Rp * Dvp) +
           Scratch::size_of(Dvp * Rp) + 2 * Scratch::size_of(Rp) + Scratch::size_of(Dp * Rp);
  }
  int64_t block_floats() const {
    return 2 * Scratch::size_of(kKeyBlock * Rp) + Scratch::size_of(kKeyBlock * Dp) +
           Scratch::size_of(kKeyBlock * Dvp) + Scratch::size_of(kKeyBlock * Dp) + Scratch::size_of(kKeyBlock * Dvp) +
           Scratch::size_of(Rp) + Scratch::size_of(Rp * Dp) + Scratch::size_of(Dvp);
  }
};

template <typename T>
void backward_group(const AttnParams& p, const RowPlan& rp, int64_t b, int64_t hkv, int64_t kbeg, int64_t kend,
                    const BwdLayout& L, Scratch& buf, RowSlot* slots, float* dq_part) {
  const int64_t D = p.D, Dv = p.Dv, Dp = L.Dp, Dvp = L.Dvp;
  const int64_t nblk = rp.blocks();
  const float qmul = p.scale * kLog2e;
  float* orow_tmp = buf.take(Dvp);

  // Gather every row of the group once: Q (scaled) and dO as rows and transposed, lse in base 2
  // and delta = rowsum(dO * O). Rows that see no key stay zero.
  int64_t maxlim_all = 0;
  for (int64_t blk = 0; blk < nblk; ++blk) {
    RowSlot& sl = slots[blk];
    sl.rb = row_block(rp, hkv, blk);
    const int64_t R = sl.rb.rows(), Rp = round_up(R, VL);
    sl.qr = buf.take(L.Rp * Dp);
    sl.qt = buf.take(Dp * L.Rp);
    sl.dor = buf.take(L.Rp * Dvp);
    sl.dot = buf.take(Dvp * L.Rp);
    sl.lse2 = buf.take(L.Rp);
    sl.delta = buf.take(L.Rp);
    sl.dqt = buf.take(Dp * L.Rp);
    sl.dq_started = false;
    sl.minlim = std::numeric_limits<int64_t>::max();
    sl.maxlim = 0;
    for (int64_t r = 0; r < Rp; ++r) {
      float* qd = sl.qr + r * Dp;
      float* dd = sl.dor + r * Dvp;
      sl.lse2[r] = 0.f;
      sl.delta[r] = 0.f;
      const int64_t h = sl.rb.h0 + r / sl.rb.nq, i = sl.rb.i0 + r % sl.rb.nq;
      const float lse = r < R ? p.lse[(b * p.H + h) * p.Lq + i] : kNegInf;
      // A row without a finite lse sees nothing (and so gets no gradient).
      const int64_t lim = r < R && std::isfinite(lse) ? row_limit(p, b, i) : 0;
      if (r < R) {
        sl.minlim = std::min(sl.minlim, lim);
        sl.maxlim = std::max(sl.maxlim, lim);
      }
      if (lim <= 0) {
        std::fill(qd, qd + Dp, 0.f);
        std::fill(dd, dd + Dvp, 0.f);
        continue;
      }
      sl.lse2[r] = static_cast<float>(static_cast<double>(lse) * kLog2ed);
      load_row(static_cast<const T*>(p.q.ptr) + b * p.q.sb + h * p.q.sh + i * p.q.sl, D, qmul, qd, Dp);
      load_row(static_cast<const T*>(p.dout.ptr) + b * p.dout.sb + h * p.dout.sh + i * p.dout.sl, Dv, 1.f, dd, Dvp);
      load_row(static_cast<const T*>(p.out.ptr) + b * p.out.sb + h * p.out.sh + i * p.out.sl, Dv, 1.f, orow_tmp,
               Dvp);
      sl.delta[r] = dot(dd, orow_tmp, Dv);
    }
    transpose(sl.qr, Dp, sl.qt, Rp, Rp, Dp);
    transpose(sl.dor, Dvp, sl.dot, Rp, Rp, Dvp);
    maxlim_all = std::max(maxlim_all, sl.maxlim);
  }

  float* st = buf.take(kKeyBlock * L.Rp);
  float* dst = buf.take(kKeyBlock * L.Rp);
  float* dkb = buf.take(kKeyBlock * Dp);
  float* dvb = buf.take(kKeyBlock * Dvp);
  float* kc = buf.take(kKeyBlock * Dp);
  float* vc = buf.take(kKeyBlock * Dvp);
  float* limrel = buf.take(L.Rp);
  float* dqrow = buf.take(L.Rp * Dp);

  const T* kbase = static_cast<const T*>(p.k.ptr) + b * p.k.sb + hkv * p.k.sh;
  const T* vbase = static_cast<const T*>(p.v.ptr) + b * p.v.sb + hkv * p.v.sh;
  T* dkbase = static_cast<T*>(p.dk.ptr) + b * p.dk.sb + hkv * p.dk.sh;
  T* dvbase = static_cast<T*>(p.dv.ptr) + b * p.dv.sb + hkv * p.dv.sh;
  const int64_t kstop = std::min(kend, maxlim_all);

  for (int64_t j0 = kbeg; j0 < kend; j0 += kKeyBlock) {
    const int64_t bk = std::min(kKeyBlock, kend - j0);
    bool started = false;  // dK, dV of this block received a contribution
    if (j0 < kstop) {
      int64_t ldk, ldv;
      const float* Kb = rows_as_float<T>(kbase + j0 * p.k.sl, bk, D, p.k.sl, kc, &ldk);
      const float* Vb = rows_as_float<T>(vbase + j0 * p.v.sl, bk, Dv, p.v.sl, vc, &ldv);
      for (int64_t blk = 0; blk < nblk; ++blk) {
        RowSlot& sl = slots[blk];
        if (sl.maxlim <= j0) continue;
        const int64_t R = sl.rb.rows(), Rp = round_up(R, VL), nvec = Rp / VL;
        // S^T = K_blk * Q^T and dP^T = V_blk * dO^T (bk x Rp)
        gemm<CMode::Store>(bk, Rp, D, Kb, ldk, 1, sl.qt, Rp, st, Rp);
        gemm<CMode::Store>(bk, Rp, Dv, Vb, ldv, 1, sl.dot, Rp, dst, Rp);
        if (j0 + bk > sl.minlim) {
          for (int64_t r = 0; r < Rp; ++r) {
            const int64_t i = sl.rb.i0 + r % sl.rb.nq;
            const bool live = r < R && std::isfinite(p.lse[(b * p.H + sl.rb.h0 + r / sl.rb.nq) * p.Lq + i]);
            limrel[r] = live ? static_cast<float>(std::clamp<int64_t>(row_limit(p, b, i) - j0, 0, bk)) : 0.f;
          }
          mask_block(st, Rp, bk, limrel);  // -inf scores give P = 0
        }
        // P^T = 2^(S^T - lse2); dS^T = P^T * (dP^T - delta), in place.
        for (int64_t j = 0; j < bk; ++j) {
          float* sp = st + j * Rp;
          float* dp = dst + j * Rp;
          for (int64_t v = 0; v < nvec; ++v) {
            const Vec pj = exp2v(Vec::loadu(sp + v * VL) - Vec::loadu(sl.lse2 + v * VL));
            pj.store(sp + v * VL);
            (pj * (Vec::loadu(dp + v * VL) - Vec::loadu(sl.delta + v * VL))).store(dp + v * VL);
          }
        }
        // dV_blk += P^T dO ; dK_blk += dS^T Q ; dQ^T += K_blk^T dS^T
        if (started) {
          gemm<CMode::Accumulate>(bk, Dvp, R, st, Rp, 1, sl.dor, Dvp, dvb, Dvp);
          gemm<CMode::Accumulate>(bk, Dp, R, dst, Rp, 1, sl.qr, Dp, dkb, Dp);
        } else {
          gemm<CMode::Store>(bk, Dvp, R, st, Rp, 1, sl.dor, Dvp, dvb, Dvp);
          gemm<CMode::Store>(bk, Dp, R, dst, Rp, 1, sl.qr, Dp, dkb, Dp);
          started = true;
        }
        if (sl.dq_started) {
          gemm<CMode::Accumulate>(D, Rp, bk, Kb, 1, ldk, dst, Rp, sl.dqt, Rp);
        } else {
          gemm<CMode::Store>(D, Rp, bk, Kb, 1, ldk, dst, Rp, sl.dqt, Rp);
          sl.dq_started = true;
        }
      }
    }
    // Q was scaled by scale * log2(e): dK = ln(2) * dS^T (scaled Q). Keys no row sees get 0.
    for (int64_t j = 0; j < bk; ++j) {
      T* dkr = dkbase + (j0 + j) * p.dk.sl;
      T* dvr = dvbase + (j0 + j) * p.dv.sl;
      if (!started) {
        std::fill(dkr, dkr + D, static_cast<T>(0.f));
        std::fill(dvr, dvr + Dv, static_cast<T>(0.f));
        continue;
      }
      store_row(dkb + j * Dp, D, kLn2, dkr);
      store_row(dvb + j * Dvp, Dv, 1.f, dvr);
    }
  }

  // dQ = scale * dS K, to the output or to this key range's partial.
  for (int64_t blk = 0; blk < nblk; ++blk) {
    const RowSlot& sl = slots[blk];
    const int64_t R = sl.rb.rows(), Rp = round_up(R, VL);
    if (sl.dq_started)
      transpose(sl.dqt, Rp, dqrow, Dp, Dp, Rp);  // rows D .. Dp of dQ^T are never read back
    else
      std::fill(dqrow, dqrow + Rp * Dp, 0.f);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t h = sl.rb.h0 + r / sl.rb.nq, i = sl.rb.i0 + r % sl.rb.nq;
      const float* src = dqrow + r * Dp;
      if (dq_part == nullptr) {
        store_row(src, D, p.scale, static_cast<T*>(p.dq.ptr) + b * p.dq.sb + h * p.dq.sh + i * p.dq.sl);
      } else {
        store_row(src, D, p.scale, dq_part + ((b * p.H + h) * p.Lq + i) * D);
      }
    }
  }
}

template <typename T>
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
  const int64_t nblk = rp.blocks();
  const int64_t per_thread = Scratch::size_of(L.Dvp) + nblk * L.slot_floats() + L.block_floats();

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
        // Small groups (decode): fetch the next task's rows and first key block meanwhile.
        const int64_t c1 = (t + 1) % n_ranges, hkv1 = ((t + 1) / n_ranges) % p.Hkv, b1 = (t + 1) / (n_ranges * p.Hkv);
        const RowBlock rb1 = row_block(rp, hkv1, 0);
        const int64_t j1 = c1 * span, n1 = std::min({kKeyBlock, span, p.Lk - j1});
        prefetch_block_rows<T>(p.q, b1, rb1, p.D);
        prefetch_block_rows<T>(p.dout, b1, rb1, p.Dv);
        prefetch_block_rows<T>(p.out, b1, rb1, p.Dv);
        if (n_ranges == 1) prefetch_block_rows<T, 1>(p.dq, b1, rb1, p.D);
        prefetch_rows<1>(static_cast<const T*>(p.dk.ptr) + b1 * p.dk.sb + hkv1 * p.dk.sh + j1 * p.dk.sl, n1, p.D, p.dk.sl);
        prefetch_rows<1>(static_cast<const T*>(p.dv.ptr) + b1 * p.dv.sb + hkv1 * p.dv.sh + j1 * p.dv.sl, n1, p.Dv, p.dv.sl);
        prefetch_rows(static_cast<const T*>(p.k.ptr) + b1 * p.k.sb + hkv1 * p.k.sh + j1 * p.k.sl, n1, p.D, p.k.sl);
        prefetch_rows(static_cast<const T*>(p.v.ptr) + b1 * p.v.sb + hkv1 * p.v.sh + j1 * p.v.sl, n1, p.Dv, p.v.sl);
      }
      buf.reset();
      backward_group<T>(p, rp, b, hkv, kbeg, kend, L, buf, slots.get(), dq_part ? dq_part + c * rows * p.D : nullptr);
    }
  });
  if (n_ranges > 1) {
    // dQ = sum of the key ranges' partials, in range order.
    at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
      for (int64_t row = r0; row < r1; ++row) {
        const int64_t i = row % p.Lq, h = (row / p.Lq) % p.H, b = row / (p.Lq * p.H);
        T* dqr = static_cast<T*>(p.dq.ptr) + b * p.dq.sb + h * p.dq.sh + i * p.dq.sl;
        for (int64_t d = 0; d < p.D; ++d) {
          float acc = 0.f;
          for (int64_t c = 0; c < n_ranges; ++c) acc += dq_part[(c * rows + row) * p.D + d];
          dqr[d] = static_cast<T>(acc);
        }
      }
    });
  }
}

// ---------------------------------------------------------------------------------------------
// Entry points of this instruction set.

inline void forward(const AttnParams& p) {
  switch (p.dtype) {
    case DType::Float32: return forward_impl<float>(p);
    case DType::BFloat16: return forward_impl<c10::BFloat16>(p);
    case DType::Float16: return forward_impl<c10::Half>(p);
  }
}

inline void backward(const AttnParams& p) {
  switch (p.dtype) {
    case DType::Float32: return backward_impl<float>(p);
    case DType::BFloat16: return backward_impl<c10::BFloat16>(p);
    case DType::Float16: return backward_impl<c10::Half>(p);
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace mhakern::cpu

// Defines mhakern::cpu::kernels_<ISA>() returning this instruction set's table.
#define MHAKERN_DEFINE_KERNEL_TABLE(ISA)                                                   \
  namespace mhakern::cpu {                                                                \
  const KernelTable& kernels_##ISA() {                                                    \
    static const KernelTable table{#ISA, &ISA::forward, &ISA::backward};                  \
    return table;                                                                         \
  }                                                                                       \
  }
