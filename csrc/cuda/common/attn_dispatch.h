// The compiled instantiations of the CUDA attention kernels and the switch that picks one, both
// expanded from the instance list of csrc/capabilities.h (MHK_CUDA_FOR_EACH_INSTANCE). One
// instantiation (element type x head dim) per generated .cu file (tools/generate_kernels.py), so
// a parallel build compiles them side by side. No torch header: the host code (cuda_host.cpp) and
// the CPU emulation used by the tests share it.
#pragma once

#if defined(MHAKERN_CUDA_EMULATE)
#include <driver_types.h>
#else
#include <cuda_runtime_api.h>
#endif

#include "../../capabilities.h"
#include "attn_params.h"

namespace mhakern {
namespace cuda {

// Element types by tag, numbered in the order of MHK_CUDA_FOR_EACH_ELEM (fp16 = 0, bf16 = 1).
#define MHK_ELEM_ENUM_ITEM_(F, tag) tag,
enum class ElemType : int { MHK_CUDA_FOR_EACH_ELEM(MHK_ELEM_ENUM_ITEM_, _) };
#undef MHK_ELEM_ENUM_ITEM_

#define MHK_DECLARE_INSTANCE_(tag, D)                                         \
  cudaError_t run_attn_fwd_##tag##_d##D(const FwdParams& p, cudaStream_t s); \
  cudaError_t run_attn_bwd_##tag##_d##D(const BwdParams& p, cudaStream_t s);
MHK_CUDA_FOR_EACH_INSTANCE(MHK_DECLARE_INSTANCE_)
#undef MHK_DECLARE_INSTANCE_

// Runs the forward (and, for split-K, its combine) on `stream`. cudaErrorInvalidValue for a
// (dtype, head dim) without an instantiation: the host checks before calling.
inline cudaError_t dispatch_attn_fwd(ElemType t, int D, const FwdParams& p, cudaStream_t s) {
#define MHK_FWD_CASE_(tag, DD) \
  if (t == ElemType::tag && D == DD) return run_attn_fwd_##tag##_d##DD(p, s);
  MHK_CUDA_FOR_EACH_INSTANCE(MHK_FWD_CASE_)
#undef MHK_FWD_CASE_
  return cudaErrorInvalidValue;
}

// Head dims with only a backward (the fused kernel): capabilities.h MHK_CUDA_BWD_ONLY_HEAD_DIM.
#define MHK_DECLARE_BWD_ONLY_INSTANCE_(tag, D) cudaError_t run_attn_bwd_##tag##_d##D(const BwdParams& p, cudaStream_t s);
MHK_CUDA_BWD_ONLY_INSTANCE(MHK_DECLARE_BWD_ONLY_INSTANCE_)
#undef MHK_DECLARE_BWD_ONLY_INSTANCE_

// Runs the backward p.bwd_kernel names (capabilities.h CudaBwdKernel): delta, dK/dV and dQ (and,
// for split-K, the dQ reduction), or delta, the fused kernel and the dQ conversion, on `stream`.
inline cudaError_t dispatch_attn_bwd(ElemType t, int D, const BwdParams& p, cudaStream_t s) {
#define MHK_BWD_CASE_(tag, DD) \
  if (t == ElemType::tag && D == DD) return run_attn_bwd_##tag##_d##DD(p, s);
  MHK_CUDA_FOR_EACH_INSTANCE(MHK_BWD_CASE_)
  MHK_CUDA_BWD_ONLY_INSTANCE(MHK_BWD_CASE_)
#undef MHK_BWD_CASE_
  return cudaErrorInvalidValue;
}

// ---- the sm90 family (csrc/cuda/sm90/, capabilities.h) ---------------------------------------
#define MHK_DECLARE_SM90_INSTANCE_(tag, D) cudaError_t run_attn_fwd_sm90_##tag##_d##D(const FwdParams& p, cudaStream_t s);
MHK_SM90_FOR_EACH_INSTANCE(MHK_DECLARE_SM90_INSTANCE_)
#undef MHK_DECLARE_SM90_INSTANCE_

inline cudaError_t dispatch_attn_fwd_sm90(ElemType t, int D, const FwdParams& p, cudaStream_t s) {
#define MHK_FWD_SM90_CASE_(tag, DD) \
  if (t == ElemType::tag && D == DD) return run_attn_fwd_sm90_##tag##_d##DD(p, s);
  MHK_SM90_FOR_EACH_INSTANCE(MHK_FWD_SM90_CASE_)
#undef MHK_FWD_SM90_CASE_
  return cudaErrorInvalidValue;
}

enum class FwdFamily : int { mma_sync = 0, sm90 = 1 };

// Which family runs a forward call (params filled, splits planned) on a device of compute
// capability major.minor. sm90_compiled: the build has the sm_90a pass (MHAKERN_WITH_SM90A).
// The sm90 family takes a call only where it implements all of it: a 9.0 device (sm_90a code
// runs there only), its head dims (both dtypes; split-K included), only the modes it serves
// (capabilities.h kSm90FwdFeatures: packed sequences, unsplit; mask, dropout, window, top-left,
// softcap, ALiBi and the KV cache's addressing go to mma.sync), and K/V strides a tensor map
// can describe (a broadcast dim of stride 0 cannot be). key_lengths included: the kernel zeroes
// the values of the keys past a length that its tensor-map loads bring in (a NaN/inf there
// leaked through 0 * inf on an H200 before); likewise those of the next packed sequence.
inline FwdFamily choose_fwd_family(int major, int minor, bool sm90_compiled, const FwdParams& p) {
  if (!sm90_compiled || major != caps::kSm90CapabilityMajor || minor != caps::kSm90CapabilityMinor)
    return FwdFamily::mma_sync;
  if (!caps::sm90_head_dim_supported(p.D) || p.num_splits < 1) return FwdFamily::mma_sync;
  if ((mode_features_of(p) & ~caps::kSm90FwdFeatures) != 0) return FwdFamily::mma_sync;
  if (p.cu_seqlens_q != nullptr && p.num_splits != 1) return FwdFamily::mma_sync;  // packed: unsplit only
  const HeadStrides* kv[2] = {&p.k_stride, &p.v_stride};
  for (const HeadStrides* st : kv) {
    if ((p.Lk > 1 && st->row == 0) || (p.Hkv > 1 && st->head == 0) || (p.B > 1 && st->batch == 0))
      return FwdFamily::mma_sync;
  }
  return FwdFamily::sm90;
}

// ---- the sm90 backward (csrc/cuda/sm90/attn_bwd_sm90_*, capabilities.h) ---------------------
#define MHK_DECLARE_SM90_BWD_INSTANCE_(tag, D)                                    \
  cudaError_t run_attn_bwd_sm90_##tag##_d##D(const BwdParams& p, cudaStream_t s); \
  cudaError_t run_attn_bwd_sm90_fused_##tag##_d##D(const BwdParams& p, float* ws, bool det, cudaStream_t s);
MHK_SM90_BWD_FOR_EACH_INSTANCE(MHK_DECLARE_SM90_BWD_INSTANCE_)
#undef MHK_DECLARE_SM90_BWD_INSTANCE_

// Runs delta, dK/dV and dQ of the sm90 family (and, for split-K, the dQ reduction) on `stream`.
inline cudaError_t dispatch_attn_bwd_sm90(ElemType t, int D, const BwdParams& p, cudaStream_t s) {
#define MHK_BWD_SM90_CASE_(tag, DD) \
  if (t == ElemType::tag && D == DD) return run_attn_bwd_sm90_##tag##_d##DD(p, s);
  MHK_SM90_BWD_FOR_EACH_INSTANCE(MHK_BWD_SM90_CASE_)
#undef MHK_BWD_SM90_CASE_
  return cudaErrorInvalidValue;
}

// Runs delta, the fused sm90 kernel and the dQ conversion on `stream`; workspace: zeros of
// caps::sm90_bwd_fused_workspace_floats (fp32), deterministic: the ordered dQ adds.
inline cudaError_t dispatch_attn_bwd_sm90_fused(ElemType t, int D, const BwdParams& p, float* workspace,
                                                bool deterministic, cudaStream_t s) {
#define MHK_BWD_SM90_FUSED_CASE_(tag, DD) \
  if (t == ElemType::tag && D == DD) return run_attn_bwd_sm90_fused_##tag##_d##DD(p, workspace, deterministic, s);
  MHK_SM90_BWD_FOR_EACH_INSTANCE(MHK_BWD_SM90_FUSED_CASE_)
#undef MHK_BWD_SM90_FUSED_CASE_
  return cudaErrorInvalidValue;
}

using BwdFamily = FwdFamily;

// Which family runs a backward call (params filled, splits planned), by the forward's rule: a
// 9.0 device with the sm_90a pass built, the backward's head dims, only the modes it serves
// (capabilities.h kSm90BwdFeatures: none), and q, k, v, dout strides a tensor map can describe (no stride 0
// on a dim longer than 1: q and dout are read by TMA too).
inline BwdFamily choose_bwd_family(int major, int minor, bool sm90_compiled, const BwdParams& p) {
  if (!sm90_compiled || major != caps::kSm90CapabilityMajor || minor != caps::kSm90CapabilityMinor)
    return BwdFamily::mma_sync;
  if (!caps::sm90_bwd_head_dim_supported(p.D) || p.num_splits < 1) return BwdFamily::mma_sync;
  if ((mode_features_of(p) & ~caps::kSm90BwdFeatures) != 0) return BwdFamily::mma_sync;
  const struct {
    const HeadStrides* st;
    int rows, heads;
  } ops[4] = {{&p.k_stride, p.Lk, p.Hkv}, {&p.v_stride, p.Lk, p.Hkv}, {&p.q_stride, p.Lq, p.H}, {&p.do_stride, p.Lq, p.H}};
  for (const auto& o : ops) {
    if ((o.rows > 1 && o.st->row == 0) || (o.heads > 1 && o.st->head == 0) || (p.B > 1 && o.st->batch == 0))
      return BwdFamily::mma_sync;
  }
  return BwdFamily::sm90;
}

}  // namespace cuda
}  // namespace mhakern
