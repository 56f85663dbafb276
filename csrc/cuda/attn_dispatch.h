// The compiled instantiations of the CUDA attention kernels and the switch that picks one.
// One instantiation (element type x head dim) per .cu file, so a parallel build compiles them
// side by side; this header declares them and maps (dtype, head dim) to the right one. No torch
// header: the host code (cuda_host.cpp) and the CPU emulation used by the tests share it.
#pragma once

#if defined(MHAKERN_CUDA_EMULATE)
#include <driver_types.h>
#else
#include <cuda_runtime_api.h>
#endif

#include "attn_params.h"

namespace mhakern {
namespace cuda {

enum class ElemType { kFloat16 = 0, kBFloat16 = 1 };

// Head dims with a compiled kernel; anything else is refused by the host, and the Python
// backend's supports() names the list so that dispatch falls back to another backend.
constexpr int kHeadDims[] = {32, 64, 96, 128};

constexpr bool head_dim_supported(int d) {
  return d == 32 || d == 64 || d == 96 || d == 128;
}

#define MHK_DECLARE_INSTANCE(tag, D)                                          \
  cudaError_t run_attn_fwd_##tag##_d##D(const FwdParams& p, cudaStream_t s); \
  cudaError_t run_attn_bwd_##tag##_d##D(const BwdParams& p, cudaStream_t s);
MHK_DECLARE_INSTANCE(fp16, 32)
MHK_DECLARE_INSTANCE(fp16, 64)
MHK_DECLARE_INSTANCE(fp16, 96)
MHK_DECLARE_INSTANCE(fp16, 128)
MHK_DECLARE_INSTANCE(bf16, 32)
MHK_DECLARE_INSTANCE(bf16, 64)
MHK_DECLARE_INSTANCE(bf16, 96)
MHK_DECLARE_INSTANCE(bf16, 128)
#undef MHK_DECLARE_INSTANCE

// Runs the forward (and, for split-K, its combine) on `stream`. cudaErrorInvalidValue for a
// (dtype, head dim) without an instantiation: the host checks before calling.
inline cudaError_t dispatch_attn_fwd(ElemType t, int D, const FwdParams& p, cudaStream_t s) {
  const bool h = t == ElemType::kFloat16;
  switch (D) {
    case 32: return h ? run_attn_fwd_fp16_d32(p, s) : run_attn_fwd_bf16_d32(p, s);
    case 64: return h ? run_attn_fwd_fp16_d64(p, s) : run_attn_fwd_bf16_d64(p, s);
    case 96: return h ? run_attn_fwd_fp16_d96(p, s) : run_attn_fwd_bf16_d96(p, s);
    case 128: return h ? run_attn_fwd_fp16_d128(p, s) : run_attn_fwd_bf16_d128(p, s);
    default: return cudaErrorInvalidValue;
  }
}

// Runs delta, dK/dV and dQ (and, for split-K, the dQ reduction) on `stream`.
inline cudaError_t dispatch_attn_bwd(ElemType t, int D, const BwdParams& p, cudaStream_t s) {
  const bool h = t == ElemType::kFloat16;
  switch (D) {
    case 32: return h ? run_attn_bwd_fp16_d32(p, s) : run_attn_bwd_bf16_d32(p, s);
    case 64: return h ? run_attn_bwd_fp16_d64(p, s) : run_attn_bwd_bf16_d64(p, s);
    case 96: return h ? run_attn_bwd_fp16_d96(p, s) : run_attn_bwd_bf16_d96(p, s);
    case 128: return h ? run_attn_bwd_fp16_d128(p, s) : run_attn_bwd_bf16_d128(p, s);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace cuda
}  // namespace mhakern
