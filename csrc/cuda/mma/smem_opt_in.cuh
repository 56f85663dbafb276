// Opting a kernel into more than 48 KB of dynamic shared memory, once per device.
//
// cudaFuncSetAttribute is a driver call; made before every launch it costs microseconds on
// exactly the small calls (decode) where launch overhead matters. The attribute belongs to the
// kernel on the current device and stays set, so each (kernel, device) pays it once; the device
// is the current one, which the host code sets to the tensors' (CUDAGuard) before launching.
#pragma once

#include <atomic>
#include <cstdint>

#include "../common/primitives.cuh"

namespace mhakern {
namespace cuda {

// Which: a distinct number per kernel template (the kernels of one Params type share their
// function type, so the tag keeps their caches apart).
template <int Which, typename Elem, int D, typename Params>
inline cudaError_t opt_in_dynamic_smem(void (*kernel)(Params), int bytes) {
#if defined(MHAKERN_CUDA_EMULATE)
  // The emulator's shared-memory limit is configured per run: check every launch.
  return set_max_dynamic_smem(kernel, bytes);
#else
  if (bytes <= 48 * 1024) return cudaSuccess;
  static std::atomic<uint64_t> done{0};  // bit d: set on device d (devices 64+ are not cached)
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  const uint64_t bit = (dev >= 0 && dev < 64) ? (uint64_t{1} << dev) : 0;
  if (bit != 0 && (done.load(std::memory_order_acquire) & bit)) return cudaSuccess;
  err = set_max_dynamic_smem(kernel, bytes);
  if (err == cudaSuccess && bit != 0) done.fetch_or(bit, std::memory_order_acq_rel);
  return err;
#endif
}

enum KernelTag : int { kTagFwd = 0, kTagBwdDkdv = 1, kTagBwdDq = 2, kTagFwdDecode = 3 };

}  // namespace cuda
}  // namespace mhakern
