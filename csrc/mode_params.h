// The optional attention modes of one call (docs/contract.md), as every kernel family's
// parameter struct carries them: the cpu AttnParams (every CPU instruction-set variant) and the
// cuda FwdParams / BwdParams derive from this one definition, and op_common.h's fill_mode_params fills it. Plain C++: no torch
// and no CUDA header, so nvcc, the CPU kernels (compiled once per instruction set) and the host
// code all include it.
#pragma once

#include <cstdint>

#include "generated/modes.h"

namespace mhakern {

// The fields, their types, initialisers, order (the memory layout every compiled kernel reads) and
// meaning are rows of the mode table (mhakern/mode_table.py PARAMS), through the X-macro
// MHK_MODE_PARAMS of generated/modes.h, whose comments document each.
struct ModeParams {
#define MHK_MODE_PARAM_MEMBER_(type, name, init) type name = init;
  MHK_MODE_PARAMS(MHK_MODE_PARAM_MEMBER_)
#undef MHK_MODE_PARAM_MEMBER_
};

// The dropout counter hash of docs/contract.md, written once for the cpu and cuda families
// (Triton and the Python reference restate it in their languages): keep(b, h, i, j) iff
// mix32(r_i + j) >= threshold, r_i = dropout_row_hash(seed, b * H + h, i), h the query head,
// all modulo 2^32. Host and device: nvcc compiles these for both, every other compiler as inline.
#if defined(__CUDACC__) && !defined(MHAKERN_CUDA_EMULATE)
#define MHK_MODES_HD __host__ __device__ __forceinline__
#else
#define MHK_MODES_HD inline
#endif

// The lowbias32 finaliser.
MHK_MODES_HD uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x21F0AAADu;
  x ^= x >> 15;
  x *= 0x735A2D97u;
  x ^= x >> 15;
  return x;
}

// r_i for query row i of the (batch element, query head) pair bh = b * H + h.
MHK_MODES_HD uint32_t dropout_row_hash(uint64_t seed, uint32_t bh, uint32_t i) {
  const uint32_t lo = static_cast<uint32_t>(seed), hi = static_cast<uint32_t>(seed >> 32);
  return mix32(mix32(lo ^ mix32(hi ^ bh)) ^ i);
}

// min(floor(p * 2^32), 2^32 - 1), computed in double exactly as the reference does.
MHK_MODES_HD uint32_t dropout_threshold(double p) {
  const double t = p * 4294967296.0;
  return t >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(t);
}

}  // namespace mhakern
