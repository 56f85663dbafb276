// The CPU attention kernels for AVX-512 (F, BW, VL, DQ). The build compiles this file alone
// with the matching -mavx512* flags (mhakern/_build.py, ISA_FLAGS); the host code calls it only when the CPU has them and
// ATen's CPU capability is AVX512.
#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || !defined(__AVX512DQ__)
#error "kernels_avx512.cpp must be compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq (see mhakern/_build.py)"
#endif
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#include "attention_kernel_impl.h"

MHAKERN_DEFINE_KERNEL_TABLE(AVX512)
MHAKERN_DEFINE_FLEX_RUNTIME(AVX512)
MHAKERN_DEFINE_BF16_TABLE(AVX512_BF16MODEL, AVX512, DotModel)
