// The scalar basics of the cpu kernels, without ATen: the base-2 softmax's constants, index
// helpers and the forced-inline step marker. Included by common.h and by mhakern.flex's
// generated kernels (csrc/flex/flex_kernel.cpp), which include no torch header.
#pragma once

#ifndef CPU_CAPABILITY
#error "define CPU_CAPABILITY (and CPU_CAPABILITY_<ISA>) before including the cpu kernel headers"
#endif

#include <cstdint>
#include <limits>

namespace mhakern::cpu {
namespace CPU_CAPABILITY {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr double kLn2d = 0.6931471805599453094;
constexpr double kLog2ed = 1.4426950408889634074;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The named steps of the forward and backward are functions for the reader, not for the
// call: forced inline, so the split leaves the code the compiler emits as it was (a call per
// step and tile costs measurably on decode-sized tasks).
#if defined(__GNUC__)
#define MHK_STEP inline __attribute__((always_inline))
#else
#define MHK_STEP inline
#endif

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

}  // namespace CPU_CAPABILITY
}  // namespace mhakern::cpu
