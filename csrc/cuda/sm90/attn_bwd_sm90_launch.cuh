// Host side of the sm_90a backward: delta, the tensor maps, the dK/dV and dQ kernels, and for
// split-K the ordered dQ reduction (delta and the reduction: both families' kernels, common/).
#pragma once

#include "../common/aux_kernels.cuh"  // attn_bwd_delta_kernel, attn_bwd_dq_reduce_kernel
#include "attn_bwd_sm90_kernel.cuh"
#include "attn_fwd_sm90_launch.cuh"  // encode_kv_map

namespace mhakern {
namespace cuda {
namespace sm90 {

// The sizes encode_kv_map reads (D, rows, heads, batch) for a (B, heads, rows, D) operand.
inline FwdParams map_sizes(const BwdParams& p, int rows, int heads) {
  FwdParams s;
  s.D = p.D;
  s.Lk = rows;
  s.Hkv = heads;
  s.B = p.B;
  return s;
}

template <typename Elem, int D>
cudaError_t run_attn_bwd_sm90(const BwdParams& p, cudaStream_t stream) {
  using Cfg = BwdConfigSm90<D>;
  if (p.D != D || p.num_splits < 1) return cudaErrorInvalidValue;
  const int64_t rows = static_cast<int64_t>(p.B) * p.H * p.Lq;
  const int64_t grid_kv = static_cast<int64_t>(ceil_div(p.Lk, Cfg::kDkvBlockN)) * p.Hkv * p.B;
  const int64_t grid_q =
      static_cast<int64_t>(ceil_div(p.group * p.Lq, Cfg::kDqBlockM)) * p.Hkv * p.B * p.num_splits;
  if (rows == 0 || grid_kv == 0) return cudaSuccess;
  if (grid_kv > 0x7fffffff || grid_q > 0x7fffffff || (rows + 3) / 4 > 0x7fffffff) return cudaErrorInvalidConfiguration;

  BwdDkvParamsSm90 Pkv;
  Pkv.p = p;
  const FwdParams kv = map_sizes(p, p.Lk, p.Hkv), qd = map_sizes(p, p.Lq, p.H);
  if (!encode_kv_map<Elem>(&Pkv.tma_k, p.k, p.k_stride, kv, Cfg::kDkvBlockN) ||
      !encode_kv_map<Elem>(&Pkv.tma_v, p.v, p.v_stride, kv, Cfg::kDkvBlockN) ||
      !encode_kv_map<Elem>(&Pkv.tma_q, p.q, p.q_stride, qd, Cfg::kDkvBlockM) ||
      !encode_kv_map<Elem>(&Pkv.tma_do, p.dout, p.do_stride, qd, Cfg::kDkvBlockM))
    return cudaErrorInvalidValue;
  BwdDqParamsSm90 Pq;
  Pq.p = p;
  if (!encode_kv_map<Elem>(&Pq.tma_k, p.k, p.k_stride, kv, Cfg::kDqBlockN) ||
      !encode_kv_map<Elem>(&Pq.tma_v, p.v, p.v_stride, kv, Cfg::kDqBlockN))
    return cudaErrorInvalidValue;

  launch_kernel(attn_bwd_delta_kernel<Elem, D>, (rows + 3) / 4, 128, 0, stream, p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;

  auto dkdv = attn_bwd_dkdv_sm90_kernel<Elem, D>;
  auto dq = attn_bwd_dq_sm90_kernel<Elem, D>;
  err = set_max_dynamic_smem(dkdv, Cfg::kDkvSmemAlloc);
  if (err == cudaSuccess) err = set_max_dynamic_smem(dq, Cfg::kDqSmemAlloc);
  if (err != cudaSuccess) return err;
#if defined(MHAKERN_CUDA_EMULATE)
  ::mhk_emu::sm90::install();
  // __launch_bounds__(384, 1): the per-thread registers setmaxnreg starts from (see the forward).
  ::mhk_emu::sm90::set_launch_registers((65536 / Cfg::kThreads) / 8 * 8);
#endif
  launch_kernel(dkdv, grid_kv, Cfg::kThreads, Cfg::kDkvSmemAlloc, stream, Pkv);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  launch_kernel(dq, grid_q, Cfg::kThreads, Cfg::kDqSmemAlloc, stream, Pq);
  err = cudaGetLastError();
  if (err != cudaSuccess || p.num_splits == 1) return err;
  const int64_t pairs = rows * (D / 2);
  launch_kernel(attn_bwd_dq_reduce_kernel<Elem, D>, (pairs + 255) / 256, 256, 0, stream, p);
  return cudaGetLastError();
}

}  // namespace sm90
}  // namespace cuda
}  // namespace mhakern

#include "attn_bwd_fused_sm90_launch.cuh"

// One instantiation per generated file (tools/generate_kernels.py): the split kernels and the
// fused one.
#define MHK_DEFINE_ATTN_BWD_SM90(tag, D)                                                            \
  namespace mhakern {                                                                               \
  namespace cuda {                                                                                  \
  cudaError_t run_attn_bwd_sm90_##tag##_d##D(const BwdParams& p, cudaStream_t s) {                 \
    return sm90::run_attn_bwd_sm90<MHK_CUDA_ELEM_TYPE_##tag, D>(p, s);                             \
  }                                                                                                 \
  cudaError_t run_attn_bwd_sm90_fused_##tag##_d##D(const BwdParams& p, float* ws, bool det, cudaStream_t s) { \
    return sm90::run_attn_bwd_sm90_fused<MHK_CUDA_ELEM_TYPE_##tag, D>(p, ws, det, s);              \
  }                                                                                                 \
  }                                                                                                 \
  }
