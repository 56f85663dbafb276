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
//
// One file above both families rather than one per family: each call is checked, allocated and
// planned once, then given to the family that serves it on this device (common/attn_dispatch.h
// choose_fwd_family / choose_bwd_family), with split-K planned for that family's tiles. What is
// a family's own, its launchers (grids, tensor maps, shared-memory opt-in), sits beside its
// kernels: mma/attn_{fwd,bwd}_kernel.cuh (run_attn_fwd / run_attn_bwd) and sm90/*_launch.cuh.
#pragma once
