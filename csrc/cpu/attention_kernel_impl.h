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
// Modes (docs/contract.md): causal alignment, windows and key lengths give each row a range of
// visible keys [lo, hi) (row_range); key blocks outside the union of a row block's ranges are
// skipped and only blocks cut by some range are masked, so the unmasked path does no per-score
// work. attn_mask (bool or additive float32, read in place through its strides) is applied to
// each score tile. Dropout multiplies the probabilities by a keep mask that is a pure hash of
// (seed, b, h, i, j), regenerated in the backward. A row that sees nothing gets out 0, lse -inf
// and zero gradients; an inf or NaN in a visible input spreads as in the plain math, and tiles
// where a hidden pair meets an inf or NaN operand are computed pair by pair so that hidden
// positions never influence anything.
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
  return dropout_row_hash(p.seed, static_cast<uint32_t>(b * p.H + h), static_cast<uint32_t>(i));
}

// kv[r] = keep(row r, key j) ? kept : 0 for the Rp rows of a tile (rseed: their r_i). A plain
// loop over 32-bit lanes, which the compiler vectorises.
inline void dropout_keep(const uint32_t* rseed, int64_t Rp, int64_t j, uint32_t threshold, float kept, float* kv) {
  const uint32_t jj = static_cast<uint32_t>(j);
  for (int64_t r = 0; r < Rp; ++r) kv[r] = mix32(rseed[r] + jj) >= threshold ? kept : 0.f;
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
  float *qr, *qt, *st, *ot, *orow, *m, *l, *alpha, *lorel, *hirel, *kc, *vc, *kv;
  uint32_t* rseed;
  uint8_t* vis;
  static int64_t floats(int64_t Dp, int64_t Dvp, int64_t Rp) {
    return Scratch::size_of(Rp * Dp) + Scratch::size_of(Dp * Rp) + Scratch::size_of(kKeyBlock * Rp) +
           Scratch::size_of(Dvp * Rp) + Scratch::size_of(Rp * Dvp) + 7 * Scratch::size_of(Rp) +
           Scratch::size_of(kKeyBlock * Dp) + Scratch::size_of(kKeyBlock * Dvp) + Scratch::size_of(kKeyBlock * Rp / 4);
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
    lorel = s.take(Rp);
    hirel = s.take(Rp);
    kv = s.take(Rp);
    rseed = reinterpret_cast<uint32_t*>(s.take(Rp));
    kc = s.take(kKeyBlock * Dp);
    vc = s.take(kKeyBlock * Dvp);
    vis = reinterpret_cast<uint8_t*>(s.take(kKeyBlock * Rp / 4));  // Rp is a multiple of VL >= 4
  }
};

// Where a forward task puts its rows: the outputs, or (split key ranges) partial buffers
// holding the normalised output and the base-2 lse of the range.
struct FwdSink {
  float* part_o = nullptr;  // (splits, B, H, Lq, Dv) or nullptr for the final outputs
  float* part_l = nullptr;  // (splits, B, H, Lq)
  int64_t split = 0;
};

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
  Vec acc(0.f);
  const Vec zero(0.f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * ld;
    int64_t c = 0;
    for (; c + VL <= cols; c += VL) acc = at::vec::fmadd(Vec::loadu(xr + c), zero, acc);
    if (c < cols) acc = at::vec::fmadd(Vec::loadu(xr + c, cols - c), zero, acc);
  }
  float part[VL];
  acc.store(part);
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

template <typename T>
void forward_rows(const AttnParams& p, int64_t b, const RowBlock& rb, int64_t kbeg, int64_t kend, const FwdScratch& s,
                  const FwdSink& sink) {
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

  // Q rows (scaled by scale * log2(e), so scores come out in base 2), then Q^T (Dp x Rp).
  const float qmul = p.scale * kLog2e;
  const T* q = static_cast<const T*>(p.q.ptr) + b * p.q.sb;
  for (int64_t r = 0; r < R; ++r)
    load_row(q + (rb.h0 + r / rb.nq) * p.q.sh + row_i(r) * p.q.sl, D, qmul, s.qr + r * Dp, Dp);
  std::fill(s.qr + R * Dp, s.qr + Rp * Dp, 0.f);
  transpose(s.qr, Dp, s.qt, Rp, Rp, Dp);
  for (int64_t v = 0; v < nvec; ++v) {
    Vec(kNegInf).store(s.m + v * VL);
    Vec(0.f).store(s.l + v * VL);
  }
  if (jstart >= kstop) std::fill(s.ot, s.ot + Dvp * Rp, 0.f);  // no key block will write it

  const T* kbase = static_cast<const T*>(p.k.ptr) + b * p.k.sb + hkv * p.k.sh;
  const T* vbase = static_cast<const T*>(p.v.ptr) + b * p.v.sb + hkv * p.v.sh;
  bool first = true;
  for (int64_t j0 = jstart; j0 < kstop; j0 += kKeyBlock) {
    const int64_t bk = std::min(kKeyBlock, kstop - j0);
    int64_t ldk, ldv;
    const float* Kb = rows_as_float<T>(kbase + j0 * p.k.sl, bk, D, p.k.sl, s.kc, &ldk);
    // S^T (bk x Rp) = K_blk * Q^T
    gemm<CMode::Store>(bk, Rp, D, Kb, ldk, 1, s.qt, Rp, s.st, Rp);

    const bool ragged = br.ragged(j0, bk);
    if (p.mask) apply_attn_mask(p, s.st, Rp, bk, b, rb, j0);
    if (ragged) {
      // Some row's visible range starts or ends inside this block.
      range_limits(p, b, R, Rp, j0, bk, row_i, nullptr, s.lorel, s.hirel);
      mask_block(s.st, Rp, bk, s.lorel, s.hirel, j0 < br.maxlo);
    }
    const float* Vb = rows_as_float<T>(vbase + j0 * p.v.sl, bk, Dv, p.v.sl, s.vc, &ldv);
    // A hidden pair next to an inf or NaN in V: accumulate pair by pair (see visibility()).
    const bool pairwise = (ragged || p.mask) && any_nonfinite(Vb, bk, Dv, ldv);
    if (pairwise) visibility(s.st, Rp, bk, s.vis);

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
    if (!dropout) {
      for (int64_t j = 0; j < bk; ++j) {
        float* sp = s.st + j * Rp;
        for (int64_t v = 0; v < nvec; ++v) {
          const Vec pj = exp2v(Vec::loadu(sp + v * VL) - muse[v]);
          pj.store(sp + v * VL);
          sum[v] = sum[v] + pj;
        }
      }
    } else {
      // l sums the undropped probabilities (lse is the plain softmax's); the output gets the
      // kept ones, and 1 / (1 - p) when it is normalised.
      for (int64_t j = 0; j < bk; ++j) {
        float* sp = s.st + j * Rp;
        dropout_keep(s.rseed, Rp, j0 + j, threshold, 1.f, s.kv);
        for (int64_t v = 0; v < nvec; ++v) {
          const Vec pj = exp2v(Vec::loadu(sp + v * VL) - muse[v]);
          (pj * Vec::loadu(s.kv + v * VL)).store(sp + v * VL);
          sum[v] = sum[v] + pj;
        }
      }
    }
    for (int64_t v = 0; v < nvec; ++v)
      (Vec::loadu(s.l + v * VL) * Vec::loadu(s.alpha + v * VL) + sum[v]).store(s.l + v * VL);

    // O^T (Dv x Rp) = alpha * O^T + V_blk^T * P^T
    if (pairwise) {
      for (int64_t d = 0; d < Dv; ++d) {
        float* od = s.ot + d * Rp;
        for (int64_t r = 0; r < Rp; ++r) {
          float acc = first ? 0.f : od[r] * s.alpha[r];
          for (int64_t j = 0; j < bk; ++j)
            if (s.vis[j * Rp + r]) acc += s.st[j * Rp + r] * Vb[j * ldv + d];
          od[r] = acc;
        }
      }
    } else if (first) {
      gemm<CMode::Store>(Dv, Rp, bk, Vb, 1, ldv, s.st, Rp, s.ot, Rp);
    } else {
      gemm<CMode::Rescale>(Dv, Rp, bk, Vb, 1, ldv, s.st, Rp, s.ot, Rp, s.alpha);
    }
    first = false;
  }

  // Rows of O (the padding rows of O^T, Dv .. Dvp, are never read back).
  transpose(s.ot, Rp, s.orow, Dvp, Dvp, Rp);
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
      p.lse[(b * p.H + h) * p.Lq + i] = dead ? kNegInf : static_cast<float>(lse2 * kLn2d);
    } else {
      const int64_t row = ((sink.split * p.B + b) * p.H + h) * p.Lq + i;
      float* po = sink.part_o + row * Dv;
      for (int64_t dv = 0; dv < Dv; ++dv) po[dv] = dead ? 0.f : src[dv] * inv;
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
      bool nan = false;  // a range's lse is NaN: so is the row's softmax, hence out and lse
      for (int64_t sp = 0; sp < n_splits; ++sp) {
        const float ls = part_l[sp * rows + row];
        nan = nan || ls != ls;
        mx = std::max(mx, ls);
      }
      T* orow = static_cast<T*>(p.out.ptr) + b * p.out.sb + h * p.out.sh + i * p.out.sl;
      if (nan) {
        for (int64_t dv = 0; dv < Dv; ++dv) orow[dv] = static_cast<T>(std::numeric_limits<float>::quiet_NaN());
        p.lse[row] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
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
  float* dead;      // 1 for a row that sees no key (lse -inf) and for padding rows, else 0
  uint32_t* rseed;  // dropout: the rows' r_i
  BlockRanges br;
  bool poisoned;  // some live row has an inf or NaN in q, dout, delta or lse
  bool dq_started;
};

struct BwdLayout {
  int64_t Dp, Dvp, Rp;  // Rp: the largest block's
  int64_t slot_floats() const {
    return Scratch::size_of(Rp * Dp) + Scratch::size_of(Dp * Rp) + Scratch::size_of(Rp * Dvp) +
           Scratch::size_of(Dvp * Rp) + 4 * Scratch::size_of(Rp) + Scratch::size_of(Dp * Rp);
  }
  int64_t block_floats() const {
    return 2 * Scratch::size_of(kKeyBlock * Rp) + Scratch::size_of(kKeyBlock * Dp) +
           Scratch::size_of(kKeyBlock * Dvp) + Scratch::size_of(kKeyBlock * Dp) + Scratch::size_of(kKeyBlock * Dvp) +
           3 * Scratch::size_of(Rp) + Scratch::size_of(Rp * Dp) + Scratch::size_of(Dvp) +
           Scratch::size_of(kKeyBlock * Rp / 4);
  }
};

template <typename T>
void backward_group(const AttnParams& p, const RowPlan& rp, int64_t b, int64_t hkv, int64_t kbeg, int64_t kend,
                    const BwdLayout& L, Scratch& buf, RowSlot* slots, float* dq_part) {
  const int64_t D = p.D, Dv = p.Dv, Dp = L.Dp, Dvp = L.Dvp;
  const int64_t nblk = rp.blocks();
  const float qmul = p.scale * kLog2e;
  const bool dropout = p.dropout_p > 0.f;
  const uint32_t threshold = dropout ? dropout_threshold(p.dropout_p) : 0;
  const float keep_scale = dropout ? static_cast<float>(1.0 / (1.0 - static_cast<double>(p.dropout_p))) : 1.f;
  float* orow_tmp = buf.take(Dvp);

  if (p.dmask) {
    // This task owns dmask[b, its query heads, :, kbeg:kend); what no key block writes is 0.
    for (int64_t h = hkv * rp.n_rep; h < (hkv + 1) * rp.n_rep; ++h)
      for (int64_t i = 0; i < p.Lq; ++i) {
        float* dm = p.dmask + ((b * p.H + h) * p.Lq + i) * p.Lk;
        std::fill(dm + kbeg, dm + kend, 0.f);
      }
  }

  // Gather every row of the group once: Q (scaled) and dO as rows and transposed, lse in base 2
  // and delta = rowsum(dO * O) (which dropout leaves valid: O is the dropped output). Rows that
  // see no key (lse -inf) stay zero.
  int64_t kfirst = std::numeric_limits<int64_t>::max(), kstop_all = 0;
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
    sl.dead = buf.take(L.Rp);
    sl.rseed = reinterpret_cast<uint32_t*>(buf.take(L.Rp));
    sl.dqt = buf.take(Dp * L.Rp);
    sl.dq_started = false;
    sl.poisoned = false;
    sl.br = BlockRanges{};
    for (int64_t r = 0; r < Rp; ++r) {
      float* qd = sl.qr + r * Dp;
      float* dd = sl.dor + r * Dvp;
      sl.lse2[r] = 0.f;
      sl.delta[r] = 0.f;
      const int64_t h = sl.rb.h0 + r / sl.rb.nq, i = sl.rb.i0 + r % sl.rb.nq;
      const float lse = r < R ? p.lse[(b * p.H + h) * p.Lq + i] : kNegInf;
      // Only lse = -inf marks a row that saw nothing: a NaN lse (NaN among the visible inputs)
      // is live, and spreads its NaN through the gradients it touches.
      const bool dead = lse == kNegInf;
      sl.dead[r] = dead ? 1.f : 0.f;
      sl.rseed[r] = dropout && r < R ? dropout_row_seed(p, b, h, i) : 0u;
      if (r < R) sl.br.add(dead ? KeyRange{0, 0} : row_range(p, b, i));
      if (dead) {
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
      sl.poisoned = sl.poisoned || !std::isfinite(sl.lse2[r]) || !std::isfinite(sl.delta[r]) ||
                    any_nonfinite(qd, 1, D, Dp) || any_nonfinite(dd, 1, Dv, Dvp);
    }
    transpose(sl.qr, Dp, sl.qt, Rp, Rp, Dp);
    transpose(sl.dor, Dvp, sl.dot, Rp, Rp, Dvp);
    kfirst = std::min(kfirst, sl.br.first);
    kstop_all = std::max(kstop_all, sl.br.stop);
  }

  float* st = buf.take(kKeyBlock * L.Rp);
  float* dst = buf.take(kKeyBlock * L.Rp);
  float* dkb = buf.take(kKeyBlock * Dp);
  float* dvb = buf.take(kKeyBlock * Dvp);
  float* kc = buf.take(kKeyBlock * Dp);
  float* vc = buf.take(kKeyBlock * Dvp);
  float* lorel = buf.take(L.Rp);
  float* hirel = buf.take(L.Rp);
  float* kv = buf.take(L.Rp);
  float* dqrow = buf.take(L.Rp * Dp);
  uint8_t* vis = reinterpret_cast<uint8_t*>(buf.take(kKeyBlock * L.Rp / 4));

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
      const float* Kb = rows_as_float<T>(kbase + j0 * p.k.sl, bk, D, p.k.sl, kc, &ldk);
      const float* Vb = rows_as_float<T>(vbase + j0 * p.v.sl, bk, Dv, p.v.sl, vc, &ldv);
      int kv_bad = -1;  // inf or NaN in this K or V block: -1 not looked yet
      for (int64_t blk = 0; blk < nblk; ++blk) {
        RowSlot& sl = slots[blk];
        if (sl.br.stop <= j0 || sl.br.first >= j0 + bk) continue;
        const int64_t R = sl.rb.rows(), Rp = round_up(R, VL), nvec = Rp / VL;
        auto row_i = [&](int64_t r) { return sl.rb.i0 + r % sl.rb.nq; };
        // S^T = K_blk * Q^T and dP^T = V_blk * dO^T (bk x Rp)
        gemm<CMode::Store>(bk, Rp, D, Kb, ldk, 1, sl.qt, Rp, st, Rp);
        gemm<CMode::Store>(bk, Rp, Dv, Vb, ldv, 1, sl.dot, Rp, dst, Rp);
        const bool ragged = sl.br.ragged(j0, bk);
        if (p.mask) apply_attn_mask(p, st, Rp, bk, b, sl.rb, j0);
        if (ragged) {
          range_limits(p, b, R, Rp, j0, bk, row_i, sl.dead, lorel, hirel);
          mask_block(st, Rp, bk, lorel, hirel, j0 < sl.br.maxlo);  // -inf scores give P = 0
        }
        // Every tile, masked or not: a -inf score hides its pair in the backward whatever made it
        // -inf (an infinite entry of q or k too), and a NaN row's P is NaN only on the pairs it
        // sees (docs/contract.md, "NaN and inf"). The scan is once per key block.
        if (!sl.poisoned && kv_bad < 0)
          kv_bad = any_nonfinite(Kb, bk, D, ldk) || any_nonfinite(Vb, bk, Dv, ldv) ? 1 : 0;
        const bool pairwise = sl.poisoned || kv_bad == 1;
        if (pairwise) visibility(st, Rp, bk, vis);
        // P^T = 2^(S^T - lse2); dS^T = P^T * (dP^T - delta), in place. With dropout, P^T is
        // replaced by the dropped Pd^T = P^T * keep / (1 - p) (dV's operand) and
        // dS^T = P^T * (dP^T * keep / (1 - p) - delta), dP^T being the gradient of Pd^T.
        if (!dropout) {
          for (int64_t j = 0; j < bk; ++j) {
            float* sp = st + j * Rp;
            float* dp = dst + j * Rp;
            for (int64_t v = 0; v < nvec; ++v) {
              const Vec pj = exp2v(Vec::loadu(sp + v * VL) - Vec::loadu(sl.lse2 + v * VL));
              pj.store(sp + v * VL);
              (pj * (Vec::loadu(dp + v * VL) - Vec::loadu(sl.delta + v * VL))).store(dp + v * VL);
            }
          }
        } else {
          for (int64_t j = 0; j < bk; ++j) {
            float* sp = st + j * Rp;
            float* dp = dst + j * Rp;
            dropout_keep(sl.rseed, Rp, j0 + j, threshold, keep_scale, kv);
            for (int64_t v = 0; v < nvec; ++v) {
              const Vec pj = exp2v(Vec::loadu(sp + v * VL) - Vec::loadu(sl.lse2 + v * VL));
              const Vec kj = Vec::loadu(kv + v * VL);
              (pj * kj).store(sp + v * VL);
              (pj * (Vec::loadu(dp + v * VL) * kj - Vec::loadu(sl.delta + v * VL))).store(dp + v * VL);
            }
          }
        }
        if (pairwise) {
          for (int64_t e = 0; e < bk * Rp; ++e)
            if (!vis[e]) st[e] = dst[e] = 0.f;
        }
        if (p.dmask) {
          // dL/dscore of the live rows (hidden pairs have exactly 0).
          for (int64_t r = 0; r < R; ++r) {
            if (sl.dead[r] != 0.f) continue;
            float* dm = p.dmask + ((b * p.H + sl.rb.h0 + r / sl.rb.nq) * p.Lq + row_i(r)) * p.Lk + j0;
            for (int64_t j = 0; j < bk; ++j) dm[j] = dst[j * Rp + r];
          }
        }
        // dV_blk += P^T dO ; dK_blk += dS^T Q ; dQ^T += K_blk^T dS^T
        if (pairwise) {
          // Pair by pair, skipping the hidden ones (see visibility()).
          for (int64_t j = 0; j < bk; ++j) {
            const uint8_t* vj = vis + j * Rp;
            for (int64_t d = 0; d < Dv; ++d) {
              float acc = started ? dvb[j * Dvp + d] : 0.f;
              for (int64_t r = 0; r < R; ++r)
                if (vj[r]) acc += st[j * Rp + r] * sl.dor[r * Dvp + d];
              dvb[j * Dvp + d] = acc;
            }
            for (int64_t d = 0; d < D; ++d) {
              float acc = started ? dkb[j * Dp + d] : 0.f;
              for (int64_t r = 0; r < R; ++r)
                if (vj[r]) acc += dst[j * Rp + r] * sl.qr[r * Dp + d];
              dkb[j * Dp + d] = acc;
            }
          }
          for (int64_t d = 0; d < D; ++d)
            for (int64_t r = 0; r < Rp; ++r) {
              float acc = sl.dq_started ? sl.dqt[d * Rp + r] : 0.f;
              for (int64_t j = 0; j < bk; ++j)
                if (vis[j * Rp + r]) acc += Kb[j * ldk + d] * dst[j * Rp + r];
              sl.dqt[d * Rp + r] = acc;
            }
          started = true;
          sl.dq_started = true;
          continue;
        }
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
