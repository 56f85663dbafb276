// The modifier-independent steps of mhakern.flex_attention's cpu kernel, compiled into
// mhakern._C once per instruction set (kernel/flex_runtime_impl.h) and handed to each generated
// flex library as a table of plain function pointers (FlexArgs::rt, csrc/flex/flex_kernel.cpp).
//
// Why a table: the generated unit is compiled on a user's first call, and what it compiled
// before -- ATen's vector headers (1.6 s) and the gemm's unrolled micro-kernels (1.4 s for the
// forward alone) -- does not depend on the modifier. With these steps here the generated unit
// is plain C++ (the modifier's scalar loops, the block walk, OpenMP) and builds in about a
// second. Each entry runs on whole tiles, so the indirect call costs nothing measurable.
//
// No ATen and no torch types: this header is included by both sides. kVersion changes whenever
// a signature or the struct changes; the generated code refuses a table of another version.
#pragma once

#include <cstdint>

namespace mhakern::cpu::flex_rt {

constexpr int64_t kVersion = 2;

// dtype codes of FlexArgs::dtype.
constexpr int64_t kFloat32 = 0, kBFloat16 = 1;

struct Runtime {
  int64_t version;  // kVersion of the build that filled the table
  int64_t vl;       // floats per vector of its instruction set: tiles are padded to it
  // C (M x N) = A (M x K) B (K x N) + beta(C), kernel/gemm.h's gemm<MODE> with mode 0 Store,
  // 1 Accumulate, 2 Rescale (cscale per column); A at A[m * ars + k * acs], N a multiple of vl.
  void (*gemm)(int64_t mode, int64_t M, int64_t N, int64_t K, const float* A, int64_t ars, int64_t acs,
               const float* B, int64_t ldb, float* C, int64_t ldc, const float* cscale);
  // One key step of the forward's online softmax in base 2 on a transposed score tile
  // st (bk keys x Rp rows, Rp a multiple of vl, at most 64): per row the new running maximum m,
  // alpha = 2^(m_old - m_new), st = 2^(st - m_new) (0 where -inf, no NaN for a row that saw
  // nothing yet), l = l * alpha + the row's sum.
  void (*softmax_step)(float* st, int64_t Rp, int64_t bk, float* m, float* l, float* alpha);
  // The backward's P and dS on one row of n (a multiple of vl) scores: s_row in natural units,
  // prow = 2^(s log2 e - lse2), dprow = prow * (dprow - delta).
  void (*prob_row)(float* prow, float* dprow, int64_t n, float lse2, float delta);
  // rows x D of a (row stride sl) block of dtype `dtype`, as fp32 times mul, zero-padded to ld.
  void (*load_rows)(int64_t dtype, const void* src, int64_t sl, int64_t rows, int64_t D, float mul, float* dst,
                    int64_t ld);
  // dst[0, n) = src[0, n) * mul in dtype `dtype` (round to nearest even for bf16).
  void (*store_row)(int64_t dtype, const float* src, int64_t n, float mul, void* dst);
  // dst[c * ldd + r] = src[r * lds + c] for r < rows, c < cols, both multiples of 8
  // (kernel/vec_math.h's transpose: 8x8 register tiles where the set has them).
  void (*transpose)(const float* src, int64_t lds, float* dst, int64_t ldd, int64_t rows, int64_t cols);
};

}  // namespace mhakern::cpu::flex_rt
