// The memory-bound kernels both families launch around their main kernels (csrc/cuda/mma/ and
// csrc/cuda/sm90/ alike): the split-K combine of the forward, the backward's delta = rowsum(dO o O)
// before the main kernels, and the sum of the split-K dQ partials after them. Each reads and
// writes through the family-neutral parameter structs (attn_params.h) and runs on any sm_80+
// device, so one definition serves both families' launchers.
#pragma once

#include "primitives.cuh"

namespace mhakern {
namespace cuda {

// Merges split-K partials: lse = log sum_s exp(lse_s), out = sum_s exp(lse_s - lse) out_s.
// One warp per output row; the sums run in a fixed order (deterministic).
template <typename Elem, int D>
__global__ void MHK_LAUNCH_BOUNDS(128, 1) attn_fwd_combine_kernel(const FwdParams p) {
  const int tid = thread_index();
  const int warp = tid / 32, lane = tid % 32;
  const int64_t n_rows = static_cast<int64_t>(p.B) * p.H * p.Lq;
  const int64_t row = block_index() * 4 + warp;
  if (row >= n_rows) return;  // whole warps leave; no block barrier follows
  const int S = p.num_splits;

  // A NaN partial lse (a NaN score in that split: docs/contract.md "NaN and inf") makes the row
  // NaN; fmaxf would skip it and, when every split is NaN, read the row as dead (0, -inf).
  // `bad` is 0, or a NaN that the warp's sum spreads to every lane.
  float mx = -INFINITY, bad = 0.f;
  for (int s = lane; s < S; s += 32) {
    const float x = p.lse_partial[s * n_rows + row];
    mx = fmaxf(mx, x);
    if (x != x) bad = x;
  }
  MHK_UNROLL
  for (int off = 16; off > 0; off >>= 1) {
    mx = fmaxf(mx, shfl_xor(mx, off));
    bad += shfl_xor(bad, off);
  }
  float sum = 0.f;
  if (mx > -INFINITY)
    for (int s = lane; s < S; s += 32) sum += expf(p.lse_partial[s * n_rows + row] - mx);
  MHK_UNROLL
  for (int off = 16; off > 0; off >>= 1) sum += shfl_xor(sum, off);
  const float lse = bad != bad ? bad : (mx > -INFINITY ? mx + logf(sum) : -INFINITY);

  const int i = static_cast<int>(row % p.Lq);
  const int h = static_cast<int>((row / p.Lq) % p.H);
  const int b = static_cast<int>(row / (static_cast<int64_t>(p.Lq) * p.H));
  Elem* o = static_cast<Elem*>(p.o) + b * p.o_stride.batch + h * p.o_stride.head + static_cast<int64_t>(i) * p.o_stride.row;
  constexpr int kPerLane = (D + 31) / 32;
  float out[kPerLane];
  MHK_UNROLL
  for (int e = 0; e < kPerLane; ++e) out[e] = 0.f;
  if (mx > -INFINITY) {
    for (int s = 0; s < S; ++s) {
      const float w = expf(p.lse_partial[s * n_rows + row] - lse);
      const float* part = p.o_partial + (s * n_rows + row) * D;
      MHK_UNROLL
      for (int e = 0; e < kPerLane; ++e) {
        const int d = lane + 32 * e;
        if (d < D) out[e] += w * part[d];
      }
    }
  }
  MHK_UNROLL
  for (int e = 0; e < kPerLane; ++e) {
    const int d = lane + 32 * e;
    if (d < D) o[d] = ElemTraits<Elem>::from_float(bad != bad ? bad : out[e]);
  }
  if (lane == 0) p.lse[row] = lse;
}

// delta[b, h, i] = sum_d dout[b, h, i, d] * out[b, h, i, d], fp32; one warp per row.
template <typename Elem, int D>
__global__ void MHK_LAUNCH_BOUNDS(128, 1) attn_bwd_delta_kernel(const BwdParams p) {
  const int tid = thread_index();
  const int warp = tid / 32, lane = tid % 32;
  const int64_t n_rows = static_cast<int64_t>(p.B) * p.H * p.Lq;
  const int64_t row = block_index() * 4 + warp;
  if (row >= n_rows) return;  // whole warps leave; no block barrier follows
  const int i = static_cast<int>(row % p.Lq);
  const int h = static_cast<int>((row / p.Lq) % p.H);
  const int b = static_cast<int>(row / (static_cast<int64_t>(p.Lq) * p.H));
  const Elem* o = static_cast<const Elem*>(p.o) + b * p.o_stride.batch + h * p.o_stride.head + static_cast<int64_t>(i) * p.o_stride.row;
  const Elem* dout = static_cast<const Elem*>(p.dout) + b * p.do_stride.batch + h * p.do_stride.head + static_cast<int64_t>(i) * p.do_stride.row;
  float sum = 0.f;
  MHK_UNROLL
  for (int d = 2 * lane; d < D; d += 64) {
    sum += ElemTraits<Elem>::to_float(o[d]) * ElemTraits<Elem>::to_float(dout[d]);
    sum += ElemTraits<Elem>::to_float(o[d + 1]) * ElemTraits<Elem>::to_float(dout[d + 1]);
  }
  MHK_UNROLL
  for (int off = 16; off > 0; off >>= 1) sum += shfl_xor(sum, off);
  if (lane == 0) p.delta[row] = sum;
}

// dq = sum over splits of the fp32 partials, added in split order; one thread per pair of
// elements.
template <typename Elem, int D>
__global__ void MHK_LAUNCH_BOUNDS(256, 1) attn_bwd_dq_reduce_kernel(const BwdParams p) {
  const int64_t n_rows = static_cast<int64_t>(p.B) * p.H * p.Lq;
  const int64_t idx = block_index() * 256 + thread_index();
  if (idx >= n_rows * (D / 2)) return;
  const int64_t row = idx / (D / 2);
  const int d = static_cast<int>(idx % (D / 2)) * 2;
  float2 sum = {0.f, 0.f};
  for (int s = 0; s < p.num_splits; ++s) {
    const float2 part = *reinterpret_cast<const float2*>(p.dq_partial + (s * n_rows + row) * D + d);
    sum.x += part.x;
    sum.y += part.y;
  }
  const int i = static_cast<int>(row % p.Lq);
  const int h = static_cast<int>((row / p.Lq) % p.H);
  const int b = static_cast<int>(row / (static_cast<int64_t>(p.Lq) * p.H));
  Elem* dst = static_cast<Elem*>(p.dq) + b * p.dq_stride.batch + h * p.dq_stride.head + static_cast<int64_t>(i) * p.dq_stride.row + d;
  *reinterpret_cast<uint32_t*>(dst) = ElemTraits<Elem>::pack2(sum.x, sum.y);
}

}  // namespace cuda
}  // namespace mhakern
