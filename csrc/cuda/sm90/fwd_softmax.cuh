// The sm_90a forward's online softmax, one consumer thread's part of a key tile: its two rows
// (accumulator rows g and g + 8 of its warp's 16) and, per row, BN / 4 of the tile's scores
// (wgmma's m64nN accumulator fragment: element i is row (i % 4) / 2, column 8 (i / 4) + 2 t +
// i % 2 of the tile). Base 2 with the scale folded into the exponent: the row maxima are taken on
// raw scores and scaled once (sl2 > 0), then p = exp2(s * sl2 - m) by one FFMA per score. The
// running state (m, l, and O, which the caller rescales by alpha) lives in the consumer's
// registers (attn_fwd_sm90_kernel.cuh); these functions update it in place.
#pragma once

#include "fwd_config.cuh"

namespace mhakern {
namespace cuda {
namespace sm90 {

#if MHK_SM90_ENABLED
// Mask (only where the tile crosses a row's visible limit: it >= it_mask) and exponentiate tile
// t0 + it of scores `sc` in place, updating the row maxima m and this thread's row sums l;
// alpha = exp2(m_old - m_new) rescales what O holds so far. lim: each row's visible limit (keys
// at or past it are hidden); t: the thread's index in its quad. A row with every key so far
// hidden keeps m = -inf and exponentiates against 0, so that exp2(-inf - 0) = 0 instead of NaN.
// The scalars are references, read where they are used, as the consumer's lambda read them when
// this was its body: taken by value they compiled to the same instructions in another order
// (tools/check_cuda_build.py's recorded SASS tells).
template <int BN>
MHK_DEVICE void fwd_softmax_tile(float (&sc)[BN / 2], int it, float (&alpha)[2], float (&m)[2], float (&l)[2],
                                 const int (&lim)[2], const int& it_mask, const int& t0, const int& t, const float& sl2) {
  if (MHK_SM90_FWD_DIAG_NO_SOFTMAX) {  // diagnostic: P = S, nothing rescaled
    alpha[0] = alpha[1] = 1.f;
    return;
  }
  // Raw scores masked (sl2 > 0: a hidden key's -inf stays -inf once scaled).
  if (it >= it_mask) {
    const int n0 = (t0 + it) * BN;
    MHK_UNROLL
    for (int i = 0; i < BN / 2; ++i) {
      const int col = n0 + 8 * (i / 4) + 2 * t + (i % 2);
      if (col >= lim[(i % 4) / 2]) sc[i] = -INFINITY;
    }
  }
  float m_use[2];
  MHK_UNROLL
  for (int h = 0; h < 2; ++h) {
    float mx = -INFINITY;
    MHK_UNROLL
    for (int i = 0; i < BN / 2; ++i)
      if ((i % 4) / 2 == h) mx = fmaxf(mx, sc[i]);
    mx = quad_max(mx) * sl2;  // the scaled maximum (sl2 > 0 commutes with max)
    const float m_new = fmaxf(m[h], mx);
    m_use[h] = m_new == -INFINITY ? 0.f : m_new;
    alpha[h] = fast_exp2(m[h] - m_use[h]);
    m[h] = m_new;
  }
  float rs[2] = {0.f, 0.f};
  MHK_UNROLL
  for (int i = 0; i < BN / 2; ++i) {
    const int h = (i % 4) / 2;
    sc[i] = fast_exp2(fmaf(sc[i], sl2, -m_use[h]));
    rs[h] += sc[i];
  }
  MHK_UNROLL
  for (int h = 0; h < 2; ++h) l[h] = l[h] * alpha[h] + rs[h];
}

// P of a tile (the exponentiated scores) into wgmma's A fragment for O += P V: the accumulator
// fragment of two n8 chunks per k16 step is the A fragment, packed to the element type.
template <typename Elem, int BN>
MHK_DEVICE void fwd_pack_p(uint32_t (&pa)[BN / 16][4], const float (&sc)[BN / 2]) {
  using Tr = ElemTraits<Elem>;
  MHK_UNROLL
  for (int ks = 0; ks < BN / 16; ++ks) {
    pa[ks][0] = Tr::pack2(sc[8 * ks + 0], sc[8 * ks + 1]);
    pa[ks][1] = Tr::pack2(sc[8 * ks + 2], sc[8 * ks + 3]);
    pa[ks][2] = Tr::pack2(sc[8 * ks + 4], sc[8 * ks + 5]);
    pa[ks][3] = Tr::pack2(sc[8 * ks + 6], sc[8 * ks + 7]);
  }
}
#endif  // MHK_SM90_ENABLED

}  // namespace sm90
}  // namespace cuda
}  // namespace mhakern
