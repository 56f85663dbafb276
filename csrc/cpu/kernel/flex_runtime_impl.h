// The flex runtime table (../flex_runtime.h) of one instruction set: the steps of
// mhakern.flex_attention's cpu kernel that do not depend on the modifier, on this kernel's
// gemm and 2^x. Included by ../attention_kernel_impl.h; kernels_<isa>.cpp define the table
// (MHAKERN_DEFINE_FLEX_RUNTIME).
#pragma once

#include <c10/util/BFloat16.h>

#include "../flex_runtime.h"
#include "forward.h"
#include "gemm.h"
#include "vec_math.h"

namespace mhakern::cpu {
namespace CPU_CAPABILITY {
namespace flex_rt_impl {

// The forward handles at most this many rows per tile (flex_kernel.cpp's kRows): forward.h's
// softmax step takes up to kRowBlock.
constexpr int64_t kMaxRows = 64;
static_assert(kMaxRows <= kRowBlock, "flex tiles exceed forward.h's softmax step");

inline void gemm_any(int64_t mode, int64_t M, int64_t N, int64_t K, const float* A, int64_t ars, int64_t acs,
                     const float* B, int64_t ldb, float* C, int64_t ldc, const float* cscale) {
  switch (mode) {
    case 0: return gemm<CMode::Store>(M, N, K, A, ars, acs, B, ldb, C, ldc);
    case 1: return gemm<CMode::Accumulate>(M, N, K, A, ars, acs, B, ldb, C, ldc);
    default: return gemm<CMode::Rescale>(M, N, K, A, ars, acs, B, ldb, C, ldc, cscale);
  }
}

// forward.h's step, without dropout.
inline void softmax_step(float* st, int64_t Rp, int64_t bk, float* m, float* l, float* alpha) {
  TORCH_INTERNAL_ASSERT(Rp <= kMaxRows, "flex runtime: softmax tile of ", Rp, " rows");
  CPU_CAPABILITY::softmax_step(st, Rp, bk, m, l, alpha, [](int64_t) -> const float* { return nullptr; });
}

inline void prob_row(float* prow, float* dprow, int64_t n, float lse2, float delta) {
  const Vec lv(lse2), dlv(delta);
  for (int64_t j = 0; j < n; j += VL) {
    const Vec p = exp2v(Vec::loadu(prow + j) * Vec(kLog2e) - lv);
    p.store(prow + j);
    (p * (Vec::loadu(dprow + j) - dlv)).store(dprow + j);
  }
}

inline void load_rows(int64_t dtype, const void* src, int64_t sl, int64_t rows, int64_t D, float mul, float* dst,
                      int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    if (dtype == flex_rt::kBFloat16)
      load_row(static_cast<const c10::BFloat16*>(src) + r * sl, D, mul, dst + r * ld, ld);
    else
      load_row(static_cast<const float*>(src) + r * sl, D, mul, dst + r * ld, ld);
  }
}

inline void store_row_any(int64_t dtype, const float* src, int64_t n, float mul, void* dst) {
  if (dtype == flex_rt::kBFloat16)
    store_row(src, n, mul, static_cast<c10::BFloat16*>(dst));
  else
    store_row(src, n, mul, static_cast<float*>(dst));
}

inline const flex_rt::Runtime& table() {
  static const flex_rt::Runtime t{flex_rt::kVersion, VL, &gemm_any, &softmax_step, &prob_row, &load_rows,
                                  &store_row_any, &transpose};
  return t;
}

}  // namespace flex_rt_impl
}  // namespace CPU_CAPABILITY
}  // namespace mhakern::cpu

// Defines mhakern::cpu::flex_runtime_<ISA>(): this instruction set's flex runtime table.
#define MHAKERN_DEFINE_FLEX_RUNTIME(ISA)                                  \
  namespace mhakern::cpu {                                               \
  const flex_rt::Runtime* flex_runtime_##ISA() { return &ISA::flex_rt_impl::table(); } \
  }
