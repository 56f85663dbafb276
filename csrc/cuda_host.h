// Torch-facing host code of the CUDA attention kernels (csrc/cuda/): argument checks, dispatch
// on (dtype, head dim) to the compiled instantiations, split-K workspaces, and the Python
// bindings. Compiled into mhakern._C only when torch has CUDA and nvcc is found (setup.py
// defines MHAKERN_WITH_CUDA); the bindings call register_ops under that macro.
#pragma once

#include <pybind11/pybind11.h>

namespace mhakern {
namespace cuda {

// Adds to `m`:
//   cuda_attn_fwd(q, k, v, out, lse, key_lengths, scale, causal, num_splits) -> None
//   cuda_attn_bwd(dout, q, k, v, out, lse, dq, dk, dv, key_lengths, scale, causal, num_splits) -> None
//   cuda_head_dims() -> list[int]
// Outputs are allocated by the caller (mhakern/backends/cuda_backend.py), in the memory layout
// it wants; the functions check every argument and raise ValueError/TypeError-like
// RuntimeErrors (TORCH_CHECK) naming it.
void register_ops(pybind11::module& m);

}  // namespace cuda
}  // namespace mhakern
