// The bf16 variant of the CPU attention kernels on AVX512-BF16 (issue 35): bf16 inputs only,
// Q.K^T and P.V through vdpbf16ps (kernel/bf16_dot.h). The build compiles this file alone with
// the AVX-512 flags plus -mavx512bf16 (mhakern/_build.py, ISA_FLAGS); the host code calls it
// only for bf16 inputs on a CPU that has the instruction (attention_cpu.cpp, kernels_for).
#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || !defined(__AVX512DQ__) || \
    !defined(__AVX512BF16__)
#error "kernels_avx512bf16.cpp must be compiled with the AVX-512 flags and -mavx512bf16 (see mhakern/_build.py)"
#endif
#define CPU_CAPABILITY AVX512BF16
#define CPU_CAPABILITY_AVX512
#include "attention_kernel_impl.h"

MHAKERN_DEFINE_BF16_TABLE(AVX512BF16, AVX512BF16, DotHw)
