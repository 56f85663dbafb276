// The sm_90a forward's work assignment: which (batch, KV head, row tile, key split) or (row
// tile, KV head, packed sequence) item each CTA of the grid takes, in which order, and the item's
// key range (first tile, tile count, visible limits). Pure integer arithmetic on the parameters:
// no barrier, no shared memory. Every role of the CTA (the producer's K/V warp, its Q loaders,
// both consumer warpgroups) calls it for the same items (attn_fwd_sm90_kernel.cuh begin_item), so
// that they agree without exchanging anything; nothing of it lives across setmaxnreg.
#pragma once

#include "fwd_config.cuh"

namespace mhakern {
namespace cuda {
namespace sm90 {

// The work items of the grid, heaviest first: item w -> the block index row_tile_work reads
// (split fastest, then row tile, KV head, batch). Items run in rounds of `grid` (one per CTA,
// persistent or not), and the row tiles go from the last to the first: under causal masking the
// last row tiles see the most keys (bottom-right alignment, and packed GQA rows grow with the
// query index within a head), so the longest items start first and the short ones fill the
// tail (FlashAttention-3's order for causal). Without causal masking every item is as long.
// Items number fewer than 2^31 (the launcher checks): 32-bit arithmetic.
MHK_DEVICE int fwd_work_block(const FwdParams& p, int n_mtiles, int w) {
  const int per_mtile = p.B * p.Hkv * p.num_splits;
  const int mt = n_mtiles - 1 - w / per_mtile;
  const int rest = w % per_mtile;
  const int split = rest % p.num_splits, bh = rest / p.num_splits;
  return (bh * n_mtiles + mt) * p.num_splits + split;
}

// Packed sequences (ModeParams::cu_seqlens_q / _k, B = 1): the work of item w of the grid over
// (tile of BM packed rows of group * max_seqlen_q, KV head, sequence), heaviest first as
// fwd_work_block orders a dense grid: the last row tiles first (they exist only in the longest
// sequences, and under causal masking see the most keys). The item is row tile mt of sequence s
// seen as batch element 0 of a dense call of lengths (Lq_s, Lk_s) whose tokens start at q0, k0:
// group * Lq_s packed rows (none when the tile starts past them: every role skips the item),
// key tiles of BN from k0 up to the rows' largest visible limit (at most Lk_s: no tile wholly of
// another sequence is loaded). No split-K (the launcher refuses it: the combine kernel's rows are
// dense ones). The prefix sums are clamped into [0, Tq] / [0, Tk] and non-decreasing here, so that
// values the host could not read (device tensors) never address outside q, k, v, out and lse.
struct SeqTileWork {
  RowTileWork w;  // split 0, b 0 (the packed tensors' one batch element)
  int q0, k0, Lq;  // the sequence's first query and key token, its query length
};
template <int BM, int BN>
MHK_DEVICE SeqTileWork seq_tile_work(const FwdParams& p, int n_mtiles, int item) {
  const int per_mtile = static_cast<int>(p.num_seqs) * p.Hkv;
  const int mt = n_mtiles - 1 - item / per_mtile;
  const int rest = item % per_mtile;
  const int s = rest / p.Hkv;
  SeqTileWork sw;
  RowTileWork& w = sw.w;
  w.split = 0;
  w.hkv = rest % p.Hkv;
  w.b = 0;
  sw.q0 = imin(imax(p.cu_seqlens_q[s], 0), p.Lq);
  sw.k0 = imin(imax(p.cu_seqlens_k[s], 0), p.Lk);
  sw.Lq = imin(imax(p.cu_seqlens_q[s + 1], sw.q0), p.Lq) - sw.q0;
  w.Lk_b = imin(imax(p.cu_seqlens_k[s + 1], sw.k0), p.Lk) - sw.k0;
  w.group_rows = p.group * sw.Lq;
  w.r0 = mt * BM;
  w.lim_min = 0;
  w.t0 = 0;
  w.n_tiles = 0;
  if (w.r0 < w.group_rows) {
    int i_lo, i_hi;
    tile_query_range(w.r0, imin(BM, w.group_rows - w.r0), sw.Lq, i_lo, i_hi);
    const int lim_max = visible_limit(i_hi, w.Lk_b, sw.Lq, p.causal);
    w.lim_min = visible_limit(i_lo, w.Lk_b, sw.Lq, p.causal);
    w.n_tiles = lim_max > 0 ? ceil_div(lim_max, BN) : 0;
  }
  return sw;
}

}  // namespace sm90
}  // namespace cuda
}  // namespace mhakern
