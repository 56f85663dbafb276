// Dense fp32 products outside attention (DenseProduct, ../attention_params.h; the host side is
// ../products.cpp) on the attention kernels' micro-kernel: every element of C is one chain of
// fused multiply-adds over k from zero, then at most one rounded add of a bias row.
#pragma once

#include <vector>

#include "gemm.h"
#include "vec_math.h"

namespace mhakern::cpu {
namespace CPU_CAPABILITY {

// Rows of C per pass: a multiple of every tile height of gemm() (8, 6 and 4), and few enough
// that the pass's rows of A and its tile of C stay in L1 while the strips of columns go over
// them and the bias is added.
constexpr int64_t kDenseRows = 48;

// C (M x N) = A B over a row-major B with whole vectors of columns (ldb its row stride).
// AVX-512 has the registers for 6 x 4 accumulator vectors: with N = 64 (the trainer's d) each
// broadcast of A then feeds 4 products instead of gemm()'s 2.
inline void dense_gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t ars, int64_t acs, const float* B,
                       int64_t ldb, float* C, int64_t ldc) {
#if defined(CPU_CAPABILITY_AVX512)
  if ((N / VL) % 4 == 0) {
    for (int64_t v = 0; v < N / VL; v += 4) {
      int64_t m = 0;
      for (; m + 6 <= M; m += 6)
        micro_kernel<6, 4, CMode::Store>(K, A + m * ars, ars, acs, B + v * VL, ldb, C + m * ldc + v * VL, ldc, nullptr);
      if (m < M)
        micro_tail<5, 4, CMode::Store>(M - m, K, A + m * ars, ars, acs, B + v * VL, ldb, C + m * ldc + v * VL, ldc,
                                       nullptr);
    }
    return;
  }
#endif
  gemm<CMode::Store>(M, N, K, A, ars, acs, B, ldb, C, ldc);
}

inline void dense_product(const DenseProduct& d) {
  if (d.M <= 0 || d.N <= 0) return;
  const int64_t Np = round_up(d.N, VL);
  // B as the row-major tile the micro-kernel reads: in place when it is one already, else
  // copied with its columns padded to whole vectors by zeros (a padded column's products never
  // reach C).
  thread_local std::vector<float> bp, cp;
  const float* B = d.B;
  int64_t ldb = d.brs;
  if (d.bcs != 1 || Np != d.N) {
    bp.resize(static_cast<size_t>(std::max<int64_t>(d.K, 1) * Np));
    if (d.brs == 1) {  // B^T is row-major: transposed by 8 x 8 blocks, as a key block is
      keys_transposed(d.B, d.bcs, d.N, d.K, bp.data());
    } else {
      for (int64_t k = 0; k < d.K; ++k) {
        float* row = bp.data() + k * Np;
        for (int64_t n = 0; n < d.N; ++n) row[n] = d.B[k * d.brs + n * d.bcs];
        std::fill(row + d.N, row + Np, 0.f);
      }
    }
    B = bp.data();
    ldb = Np;
  }
  // The blocks of k (DenseProduct::kc).
  int64_t kb = d.K;
  if (d.kc > 0 && d.K > d.kc) kb = d.K <= 2 * d.kc ? (d.K + 1) / 2 : d.kc;
  // C is written in place where its rows are whole vectors, else through a padded tile; the
  // second and later blocks of k go through a tile of their own and are added to it.
  const bool direct = Np == d.N;
  float* part = nullptr;
  if (!direct || kb < d.K) {
    cp.resize(static_cast<size_t>(2 * kDenseRows * Np));
    part = cp.data() + kDenseRows * Np;
  }
  for (int64_t m0 = 0; m0 < d.M; m0 += kDenseRows) {
    const int64_t mc = std::min(kDenseRows, d.M - m0);
    float* c = direct ? d.C + m0 * d.ldc : cp.data();
    const int64_t ldc = direct ? d.ldc : Np;
    const float* a = d.A + m0 * d.ars;
    dense_gemm(mc, Np, std::min(kb, d.K), a, d.ars, d.acs, B, ldb, c, ldc);
    for (int64_t k0 = kb; k0 < d.K; k0 += kb) {
      dense_gemm(mc, Np, std::min(kb, d.K - k0), a + k0 * d.acs, d.ars, d.acs, B + k0 * ldb, ldb, part, Np);
      for (int64_t i = 0; i < mc; ++i)
        for (int64_t n = 0; n < Np; n += VL)
          (Vec::loadu(c + i * ldc + n) + Vec::loadu(part + i * Np + n)).store(c + i * ldc + n);
    }
    for (int64_t i = 0; i < mc; ++i) {
      float* row = c + i * ldc;
      if (d.bias != nullptr) {
        const float* b = d.bias + ((d.row0 + m0 + i) % d.period) * d.bias_ld;
        int64_t n = 0;
        for (; n + VL <= d.N; n += VL) (Vec::loadu(row + n) + Vec::loadu(b + n)).store(row + n);
        for (; n < d.N; ++n) row[n] = row[n] + b[n];
      }
      if (!direct) std::memcpy(d.C + (m0 + i) * d.ldc, row, static_cast<size_t>(d.N) * sizeof(float));
    }
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace mhakern::cpu
