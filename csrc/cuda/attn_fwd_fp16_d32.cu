// Forward instantiation: __half, head dim 32.
#include "attn_dispatch.h"
#include "attn_fwd_kernel.cuh"

namespace mhakern {
namespace cuda {
cudaError_t run_attn_fwd_fp16_d32(const FwdParams& p, cudaStream_t s) { return run_attn_fwd<__half, 32>(p, s); }
}  // namespace cuda
}  // namespace mhakern
