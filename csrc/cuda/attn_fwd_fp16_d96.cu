// Forward instantiation: __half, head dim 96.
#include "attn_dispatch.h"
#include "attn_fwd_kernel.cuh"

namespace mhakern {
namespace cuda {
cudaError_t run_attn_fwd_fp16_d96(const FwdParams& p, cudaStream_t s) { return run_attn_fwd<__half, 96>(p, s); }
}  // namespace cuda
}  // namespace mhakern
