// Torch-facing host code of the CUDA attention kernels (csrc/cuda/): the CUDA implementations of
// the dispatcher ops mhakern_C::fwd / mhakern_C::bwd, registered for the CUDA dispatch key by
// cuda_host.cpp itself (TORCH_LIBRARY_IMPL) against the schemas of csrc/bindings.cpp. Compiled
// into mhakern._C only when torch has CUDA and nvcc is found (setup.py defines
// MHAKERN_WITH_CUDA). Nothing to declare: the dispatcher is the interface.
//
// Beyond the checks every device shares (op_common.h), the cuda kernels need float16 or
// bfloat16, D == Dv among the compiled head dims, 16-byte aligned rows and the index limits of
// capabilities.h; the optional modes they implement are kCudaFeatures, and the op refuses the
// others by name. Split-K is planned here (capabilities.h: plan_splits).
#pragma once
