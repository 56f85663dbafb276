// The small fp32 GEMM of the cpu kernels: a register-blocked micro-kernel that reads A by
// broadcasts through any strides (so K, V and the probability tiles are used in place, transposed
// or not) and B, C as padded row-major scratch tiles. Every product of the forward and backward
// goes through gemm<MODE>().
#pragma once

#include "common.h"

namespace mhakern::cpu {
namespace CPU_CAPABILITY {

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

}  // namespace CPU_CAPABILITY
}  // namespace mhakern::cpu
