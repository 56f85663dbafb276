// Backward instantiation: __half, head dim 96.
#include "attn_bwd_kernel.cuh"
#include "attn_dispatch.h"

namespace mhakern {
namespace cuda {
cudaError_t run_attn_bwd_fp16_d96(const BwdParams& p, cudaStream_t s) { return run_attn_bwd<__half, 96>(p, s); }
}  // namespace cuda
}  // namespace mhakern
