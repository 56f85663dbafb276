// What every piece of the cpu kernels stands on: the instruction set's vector type, the numeric
// constants of the base-2 softmax, index helpers and the per-thread scratch buffer. Compiled once
// per instruction set (see ../attention_kernel_impl.h): CPU_CAPABILITY names the namespace, so
// Vectorized<float> is the AVX-512, AVX2 or portable one.
#pragma once

#include "scalar.h"  // first: it checks that CPU_CAPABILITY is defined

#include <ATen/cpu/vec/vec.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>

#include "../attention_params.h"

namespace mhakern::cpu {
namespace CPU_CAPABILITY {

using Vec = at::vec::Vectorized<float>;
using IVec = at::vec::Vectorized<int32_t>;
constexpr int64_t VL = Vec::size();

// Scratch memory: one 64-byte aligned float buffer per thread chunk, zeroed (the backward's
// accumulators rely on it) or left as it comes (kUninit: the forward, whose every tile is
// written before it is read; the memset was a fifth of a decode call's instructions).
// MHAKERN_CPU_SCRATCH_POISON=1 in the environment fills an unzeroed buffer with NaN instead,
// so that a test run shows no tile is read before it is written.

inline bool scratch_poison() {
  static const bool on = [] {
    const char* e = std::getenv("MHAKERN_CPU_SCRATCH_POISON");
    return e != nullptr && e[0] == '1';
  }();
  return on;
}

class Scratch {
 public:
  enum Init { kZeroed, kUninit };
  explicit Scratch(int64_t n, Init init = kZeroed) : n_(std::max<int64_t>(n, 1)) {
    p_ = static_cast<float*>(::operator new[](n_ * sizeof(float), std::align_val_t(64)));
    if (init == kZeroed)
      std::memset(p_, 0, n_ * sizeof(float));
    else if (scratch_poison())
      std::fill(p_, p_ + n_, std::numeric_limits<float>::quiet_NaN());
  }
  ~Scratch() { ::operator delete[](p_, std::align_val_t(64)); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  // Hands out consecutive pieces, each rounded up to whole cache lines.
  float* take(int64_t n) {
    float* r = p_ + used_;
    used_ += size_of(n);
    TORCH_INTERNAL_ASSERT(used_ <= n_, "mhakern cpu kernel: scratch overflow");
    return r;
  }
  // Starts handing out from the beginning again (the contents are kept).
  void reset() { used_ = 0; }
  static int64_t size_of(int64_t n) { return round_up(std::max<int64_t>(n, 0), 16); }

 private:
  int64_t n_;
  int64_t used_ = 0;
  float* p_ = nullptr;
};

}  // namespace CPU_CAPABILITY
}  // namespace mhakern::cpu
