// The CPU attention kernels for AVX2 + FMA. The build compiles this file alone with
// -mavx2 -mfma -mf16c (mhakern/_build.py, ISA_FLAGS); the host code calls it only when the CPU has them (and ATen's CPU
// capability allows AVX2), so the module still loads and runs on older x86-64 CPUs.
#if !defined(__AVX2__) || !defined(__FMA__)
#error "kernels_avx2.cpp must be compiled with -mavx2 -mfma (mhakern/_build.py passes them for this file only)"
#endif
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#include "attention_kernel_impl.h"

MHAKERN_DEFINE_KERNEL_TABLE(AVX2)
MHAKERN_DEFINE_FLEX_RUNTIME(AVX2)
MHAKERN_DEFINE_BF16_TABLE(AVX2_BF16MODEL, AVX2, DotModel)
