// Forward instantiation: __nv_bfloat16, head dim 32.
#include "attn_dispatch.h"
#include "attn_fwd_kernel.cuh"

namespace mhakern {
namespace cuda {
cudaError_t run_attn_fwd_bf16_d32(const FwdParams& p, cudaStream_t s) { return run_attn_fwd<__nv_bfloat16, 32>(p, s); }
}  // namespace cuda
}  // namespace mhakern
