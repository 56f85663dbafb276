// The sm_90a forward's epilogue: one consumer thread's two rows of an item, normalised and stored.
// A consumer's accumulator rows g and g + 8 of its warp's 16 (rows[0], rows[1]) hold O (not yet
// divided by the row sums), the running maxima m (base 2, scaled) and this thread's part of the
// row sums l; the quad of threads t = 0..3 that shares a row sums l, and each thread stores its
// columns. Unsplit: O in the output's element type and lse (natural log) at the row's place; a
// split (num_splits > 1): the fp32 partials o_partial, lse_partial that the combine kernel
// (../common/aux_kernels.cuh) merges. Rows past the group's (a packed tile's padding) store nothing;
// a row that saw no key gives 0 and -inf.
#pragma once

#include "fwd_config.cuh"

namespace mhakern {
namespace cuda {
namespace sm90 {

#if MHK_SM90_ENABLED
// o, m, l, rows: the consumer's state (attn_fwd_sm90_kernel.cuh); group_rows, hkv, b, split: the
// item's (tile_scheduler.cuh); q0, seq_lq: a packed sequence's first query token and length
// (kVarlen; a dense call reads p.Lq); t: the thread's index in its quad.
template <typename Elem, int D, bool kVarlen>
MHK_DEVICE void fwd_epilogue(const FwdParams& p, const float (&o)[D / 2], const float (&m)[2], const float (&l)[2],
                             const int (&rows)[2], int group_rows, int hkv, int b, int split, int q0, int seq_lq,
                             int t) {
  using Tr = ElemTraits<Elem>;
  Elem* out = static_cast<Elem*>(p.o);
  const int64_t n_rows = static_cast<int64_t>(p.B) * p.H * p.Lq;
  MHK_UNROLL
  for (int h = 0; h < 2; ++h) {
    const float lsum = quad_sum(l[h]);
    const int r = rows[h];
    if (r >= group_rows) continue;
    const bool seen = lsum > 0.f;
    const float inv = seen ? 1.f / lsum : 0.f;
    const float lse = seen ? (m[h] + log2f(lsum)) * kLn2 : -INFINITY;
    // lse (H, Tq) of packed sequences: query token q0 + i of head h at h * Tq + q0 + i.
    const int64_t lin = kVarlen ? static_cast<int64_t>(hkv * p.group + r / seq_lq) * p.Lq + q0 + r % seq_lq
                                : packed_row_linear(b, p.H, hkv, p.group, p.Lq, r);
    if (p.num_splits > 1) {
      float* dst = p.o_partial + (split * n_rows + lin) * D;
      MHK_UNROLL
      for (int j = 0; j < D / 8; ++j) {
        dst[8 * j + 2 * t] = o[4 * j + 2 * h] * inv;
        dst[8 * j + 2 * t + 1] = o[4 * j + 2 * h + 1] * inv;
      }
      if (t == 0) p.lse_partial[split * n_rows + lin] = lse;
    } else {
      Elem* dst = out + static_cast<int64_t>(q0) * p.o_stride.row +
                  packed_row_offset(p.o_stride, b, hkv, p.group, kVarlen ? seq_lq : p.Lq, r);
      MHK_UNROLL
      for (int j = 0; j < D / 8; ++j) {
        const uint32_t v = Tr::pack2(o[4 * j + 2 * h] * inv, o[4 * j + 2 * h + 1] * inv);
        *reinterpret_cast<uint32_t*>(dst + 8 * j + 2 * t) = v;
      }
      if (t == 0) p.lse[lin] = lse;
    }
  }
}
#endif  // MHK_SM90_ENABLED

}  // namespace sm90
}  // namespace cuda
}  // namespace mhakern
