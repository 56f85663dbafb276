// Host side of the fused sm_90a backward: delta (the mma.sync family's kernel), the tensor maps,
// the fused kernel and the dQ conversion.
#pragma once

#include "../common/aux_kernels.cuh"  // attn_bwd_delta_kernel
#include "attn_bwd_fused_sm90_kernel.cuh"
#include "attn_bwd_sm90_launch.cuh"  // map_sizes (it includes this file at its end)
#include "attn_fwd_sm90_launch.cuh"  // encode_kv_map

namespace mhakern {
namespace cuda {
namespace sm90 {

// workspace: caps::sm90_bwd_fused_workspace_floats(B, Hkv, group, Lq, D) fp32 elements, zeros
// (the dQ sums, then the row tiles' semaphores, then the ticket counter). deterministic: order the dQ adds (see the kernel).
template <typename Elem, int D>
cudaError_t run_attn_bwd_sm90_fused(const BwdParams& p, float* workspace, bool deterministic, cudaStream_t stream) {
  using Cfg = BwdFusedConfigSm90<D>;
  if (p.D != D || workspace == nullptr) return cudaErrorInvalidValue;
  const int64_t rows = static_cast<int64_t>(p.B) * p.H * p.Lq;
  const int64_t grid = static_cast<int64_t>(ceil_div(p.Lk, Cfg::kBlockN)) * p.Hkv * p.B;
  if (rows == 0 || grid == 0) return cudaSuccess;
  const int64_t quads = rows * (D / 4);
  if (grid > 0x7fffffff || (rows + 3) / 4 > 0x7fffffff || (quads + 255) / 256 > 0x7fffffff)
    return cudaErrorInvalidConfiguration;

  BwdFusedParamsSm90 P;
  P.p = p;
  const int64_t tiles = static_cast<int64_t>(p.B) * p.Hkv * caps::sm90_bwd_fused_row_tiles(p.group, p.Lq, D);
  P.dq_accum = workspace;
  P.sem = reinterpret_cast<uint32_t*>(workspace + tiles * Cfg::kBlockM * D);
  P.ticket = P.sem + tiles;
  P.deterministic = deterministic;
#if defined(MHAKERN_CUDA_EMULATE)
  P.fault = ::mhk_emu::sm90::fused_bwd_fault();  // 0 but in the emulator's deliberate-bug tests
#endif
  const FwdParams kv = map_sizes(p, p.Lk, p.Hkv), qd = map_sizes(p, p.Lq, p.H);
  if (!encode_kv_map<Elem>(&P.tma_k, p.k, p.k_stride, kv, Cfg::kBlockN) ||
      !encode_kv_map<Elem>(&P.tma_v, p.v, p.v_stride, kv, Cfg::kBlockN) ||
      !encode_kv_map<Elem>(&P.tma_q, p.q, p.q_stride, qd, Cfg::kBlockM) ||
      !encode_kv_map<Elem>(&P.tma_do, p.dout, p.do_stride, qd, Cfg::kBlockM))
    return cudaErrorInvalidValue;

  launch_kernel(attn_bwd_delta_kernel<Elem, D>, (rows + 3) / 4, 128, 0, stream, p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  auto fused = attn_bwd_fused_sm90_kernel<Elem, D>;
  err = set_max_dynamic_smem(fused, Cfg::kSmemAlloc);
  if (err != cudaSuccess) return err;
#if defined(MHAKERN_CUDA_EMULATE)
  ::mhk_emu::sm90::install();
  // __launch_bounds__(384, 1): the per-thread registers setmaxnreg starts from (see the forward).
  ::mhk_emu::sm90::set_launch_registers((65536 / Cfg::kThreads) / 8 * 8);
#endif
  launch_kernel(fused, grid, Cfg::kThreads, Cfg::kSmemAlloc, stream, P);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  launch_kernel(attn_bwd_dq_convert_sm90_kernel<Elem, D>, (quads + 255) / 256, 256, 0, stream, P);
  return cudaGetLastError();
}

}  // namespace sm90
}  // namespace cuda
}  // namespace mhakern
