// Backward instantiation: __nv_bfloat16, head dim 96.
#include "attn_bwd_kernel.cuh"
#include "attn_dispatch.h"

namespace mhakern {
namespace cuda {
cudaError_t run_attn_bwd_bf16_d96(const BwdParams& p, cudaStream_t s) { return run_attn_bwd<__nv_bfloat16, 96>(p, s); }
}  // namespace cuda
}  // namespace mhakern
