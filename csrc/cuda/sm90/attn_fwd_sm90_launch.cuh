// Host side of the sm_90a forward: the tensor maps of K and V, the grid, the launch.
#pragma once

#include <algorithm>

#include "../common/aux_kernels.cuh"  // the split-K combine kernel (attn_fwd_combine_kernel)
#include "attn_fwd_sm90_kernel.cuh"

// A diagnostic override of capabilities.h kSm90FwdPersistent (benchmarks/diag_fwd_sm90.cu builds
// MHK_SM90_FWD_PERSISTENT=0, one CTA per work item, to measure what the persistent grid gains;
// the results are the same either way). The extension never defines it.
#ifndef MHK_SM90_FWD_PERSISTENT
#define MHK_SM90_FWD_PERSISTENT (::mhakern::caps::kSm90FwdPersistent ? 1 : 0)
#endif

namespace mhakern {
namespace cuda {
namespace sm90 {

// A 4-D tensor map over a (B, Hkv, Lk, D) operand, dims innermost first (D, Lk, Hkv, B), box
// (64, kBlockN, 1, 1), 128-byte swizzle; out-of-range boxes are zero-filled (keys past Lk).
// A dim of size 1 gets a stride that is always valid (its only coordinate is 0).
template <typename Elem>
inline bool encode_kv_map(TensorMap* map, const void* base, const HeadStrides& st, const FwdParams& p, int box_rows) {
  const uint64_t eb = sizeof(Elem);
  const uint64_t dims[4] = {static_cast<uint64_t>(p.D), static_cast<uint64_t>(p.Lk), static_cast<uint64_t>(p.Hkv),
                            static_cast<uint64_t>(p.B)};
  uint64_t strides[3] = {static_cast<uint64_t>(st.row) * eb, static_cast<uint64_t>(st.head) * eb,
                         static_cast<uint64_t>(st.batch) * eb};
  uint64_t dense = dims[0] * eb;
  for (int i = 0; i < 3; ++i) {
    if (dims[i + 1] == 1) strides[i] = dense;
    dense = strides[i] * dims[i + 1];
  }
  const uint32_t box[4] = {64, static_cast<uint32_t>(box_rows), 1, 1};
#if defined(MHAKERN_CUDA_EMULATE)
  const std::string why = ::mhk_emu::sm90::encode_tensor_map(*map, base, 4, static_cast<int>(eb), dims, strides, box, 128);
  if (!why.empty()) ::mhk_emu::fail(why);
  return why.empty();
#else
  using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  // The driver's encoder, looked up once through the runtime (no link against libcuda).
  static Encode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<Encode>(fn);
  }();
  if (encode == nullptr) return false;
  const cuuint32_t estr[4] = {1, 1, 1, 1};
  const CUtensorMapDataType dt =
      ElemTraits<Elem>::kIsBf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const CUresult r = encode(map, dt, 4, const_cast<void*>(base), dims, strides, box, estr,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
#endif
}

template <typename Elem, int D>
cudaError_t run_attn_fwd_sm90(const FwdParams& p, cudaStream_t stream) {
  using Cfg = FwdConfigSm90<D>;
  if (p.D != D || p.num_splits < 1) return cudaErrorInvalidValue;
  FwdParamsSm90 P;
  P.p = p;
  if (!encode_kv_map<Elem>(&P.tma_k, p.k, p.k_stride, p, Cfg::kBlockN) ||
      !encode_kv_map<Elem>(&P.tma_v, p.v, p.v_stride, p, Cfg::kBlockN))
    return cudaErrorInvalidValue;
  // Packed sequences (cu_seqlens_q / _k): the varlen kernel over (row tile of the longest
  // sequence, KV head, sequence), unsplit (tile_scheduler.cuh seq_tile_work).
  const bool varlen = p.cu_seqlens_q != nullptr;
  if (varlen && (p.cu_seqlens_k == nullptr || p.num_splits != 1 || p.B != 1)) return cudaErrorInvalidValue;
  const int64_t items = varlen ? p.num_seqs * p.Hkv * ceil_div(p.group * static_cast<int>(p.max_seqlen_q), Cfg::kBlockM)
                               : static_cast<int64_t>(p.B) * p.Hkv * ceil_div(p.group * p.Lq, Cfg::kBlockM) * p.num_splits;
  if (items == 0) return cudaSuccess;
  if (items > 0x7fffffff) return cudaErrorInvalidConfiguration;
  // Persistent (capabilities.h kSm90FwdPersistent): one CTA per SM (the register plan's
  // occupancy), each looping over its items; otherwise one CTA per item.
  int64_t grid = items;
  if (MHK_SM90_FWD_PERSISTENT) {
    int sms = 0;
#if defined(MHAKERN_CUDA_EMULATE)
    sms = ::mhk_emu::sm90::emulated_sms();
#else
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (e != cudaSuccess) return e;
#endif
    grid = std::min<int64_t>(items, static_cast<int64_t>(sms) * caps::kSm90FwdCtasPerSm);
  }
  P.grid = static_cast<int>(grid);
  auto kernel = varlen ? attn_fwd_sm90_varlen_kernel<Elem, D> : attn_fwd_sm90_kernel<Elem, D>;
  cudaError_t err = set_max_dynamic_smem(kernel, Cfg::kSmemAlloc);
  if (err != cudaSuccess) return err;
#if defined(MHAKERN_CUDA_EMULATE)
  ::mhk_emu::sm90::install();
  // __launch_bounds__(384, 1): ptxas may give each thread up to 65536 / 384 registers, rounded
  // down to a multiple of 8: the count setmaxnreg starts from.
  ::mhk_emu::sm90::set_launch_registers((65536 / Cfg::kThreads) / 8 * 8);
#endif
  launch_kernel(kernel, grid, Cfg::kThreads, Cfg::kSmemAlloc, stream, P);
  err = cudaGetLastError();
  if (err != cudaSuccess || p.num_splits == 1) return err;
  // One combine for both families: the partials' layout is attn_params.h's.
  const int64_t rows = static_cast<int64_t>(p.B) * p.H * p.Lq;
  launch_kernel(attn_fwd_combine_kernel<Elem, D>, (rows + 3) / 4, 128, 0, stream, p);
  return cudaGetLastError();
}

}  // namespace sm90
}  // namespace cuda
}  // namespace mhakern

// One instantiation per generated file (tools/generate_kernels.py).
#define MHK_DEFINE_ATTN_FWD_SM90(tag, D)                                                            \
  namespace mhakern {                                                                               \
  namespace cuda {                                                                                  \
  cudaError_t run_attn_fwd_sm90_##tag##_d##D(const FwdParams& p, cudaStream_t s) {                 \
    return sm90::run_attn_fwd_sm90<MHK_CUDA_ELEM_TYPE_##tag, D>(p, s);                             \
  }                                                                                                 \
  }                                                                                                 \
  }
