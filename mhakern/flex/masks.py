"""Block masks straight from what users have: cu_seqlens, windows, prefix lengths, causal.

torch's ``create_block_mask`` evaluates ``mask_mod`` on every (query, key) pair (seconds at 8k
tokens on a CPU). Every mask here shows each query row one interval of keys,
``lo[q] <= kv <= hi[q]``, so the block structure follows from the intervals alone, in
O(rows + blocks) tensor work:

* a key block j is *touched* by row q when the row's interval meets the block; per query block
  the touched blocks are a union of intervals of blocks, counted with a difference array
  (+1 at the first block a row touches, -1 after its last) and a cumulative sum;
* a key block is *full* when every row of the query block sees all of it: the intersection of
  the rows' fully covered block ranges, ``[max first, min last]``;
* partial = touched and not full.

Each builder returns torch's ``BlockMask`` (its constructor, with the transposed lists too) with a ``mask_mod``
that reads the same facts from captured tensors, so torch's own ``flex_attention`` and
mhakern's agree on it, and mhakern compiles that ``mask_mod`` once whatever the lengths.
Windows follow FlashAttention's ``window_size`` left side: key kv is visible to query q when
``q - kv <= window`` (and causal: ``kv <= q``).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Optional, Tuple, Union

import torch

from .._errors import ArgumentError, ArgumentTypeError

Tensor = torch.Tensor
_BIG = 1 << 40


@contextlib.contextmanager
def _one_thread():
    """The builders' tensors are small (rows and blocks): torch's intra-op threads only add
    wake-up latency (milliseconds per op on a loaded machine), so they run on this thread."""
    n = torch.get_num_threads()
    if n > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if n > 1:
            torch.set_num_threads(n)


def _tflex():
    from torch.nn.attention import flex_attention as tflex

    return tflex


def _block_size(block_size) -> Tuple[int, int]:
    bs = (block_size, block_size) if isinstance(block_size, int) and not isinstance(block_size, bool) else block_size
    if (not isinstance(bs, (tuple, list)) or len(bs) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in bs)):
        raise ArgumentError(f"block_size: expected a positive int or a pair of them, got {block_size!r}")
    return int(bs[0]), int(bs[1])


def _check_window(window) -> Optional[int]:
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ArgumentError(f"window: expected None or an int >= 0 (keys q - window .. q), got {window!r}")
    return window


def blocks_from_intervals(lo: Tensor, hi: Tensor, Lk: int, block_size) -> Tuple[Tensor, Tensor]:
    """Block structure of a mask that shows row q of (..., Lq) the keys ``lo[..., q] ..
    hi[..., q]`` (inclusive, int64; empty when lo > hi), with block sizes ``(Q_BLOCK,
    KV_BLOCK)``: ``(partial, full)``, bool (..., q blocks, kv blocks), disjoint."""
    QB, KB = _block_size(block_size)
    *batch, Lq = lo.shape
    nq, nk = -(-Lq // QB), -(-Lk // KB)
    lo = lo.clamp(min=0)
    hi = hi.clamp(max=Lk - 1)
    live = lo <= hi
    pad = nq * QB - Lq
    # Touched blocks: per row [lo // KB, hi // KB]; a difference array per query block.
    first = torch.where(live, lo // KB, nk)
    last = torch.where(live, hi // KB, -1)
    diff = torch.zeros(*batch, nq, nk + 1, dtype=torch.int32)
    qblk = (torch.arange(Lq) // QB).expand(*batch, Lq)
    flat = diff.view(*batch, nq * (nk + 1))
    base = qblk * (nk + 1)
    ones = live.to(torch.int32)
    flat.scatter_add_(-1, base + first.clamp(max=nk), ones)
    flat.scatter_add_(-1, base + (last + 1).clamp(min=0, max=nk), -ones)
    touched = diff.cumsum(-1)[..., :nk] > 0
    # Full blocks: per row the blocks it covers whole, [ceil(lo / KB), last whole block]; the
    # last block ends at Lk - 1 (it may be short).
    ffirst = torch.where(live, -(-lo // KB), _BIG)
    end_whole = torch.where(hi >= Lk - 1, nk - 1, (hi + 1) // KB - 1)
    flast = torch.where(live, end_whole, -_BIG)
    if pad:
        # Rows past Lq do not exist: they constrain nothing.
        ffirst = torch.cat([ffirst, ffirst.new_full((*batch, pad), -_BIG)], -1)
        flast = torch.cat([flast, flast.new_full((*batch, pad), _BIG)], -1)
    fa = ffirst.view(*batch, nq, QB).amax(-1, keepdim=True)
    fb = flast.view(*batch, nq, QB).amin(-1, keepdim=True)
    col = torch.arange(nk)
    full = (col >= fa) & (col <= fb) & touched
    return touched & ~full, full


def _ordered(dense: Tensor) -> Tuple[Tensor, Tensor]:
    """A dense block matrix as BlockMask's (count, indices) per row, int32, ascending."""
    num = dense.sum(-1, dtype=torch.int32)
    idx = torch.argsort((~dense).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num, idx


def _block_mask(lo, hi, Lq, Lk, block_size, mask_mod):
    QB, KB = _block_size(block_size)
    partial, full = blocks_from_intervals(lo, hi, Lk, (QB, KB))
    kv_num, kv_idx = _ordered(partial)
    fkv_num, fkv_idx = _ordered(full)
    # The transposed lists (per key block, its query blocks) from the same matrices: torch's
    # from_kv_blocks derives them through vmap, 8 ms of the 8k-token budget.
    q_num, q_idx = _ordered(partial.transpose(-1, -2))
    fq_num, fq_idx = _ordered(full.transpose(-1, -2))
    return _tflex().BlockMask(seq_lengths=(Lq, Lk), kv_num_blocks=kv_num, kv_indices=kv_idx,
                              full_kv_num_blocks=fkv_num, full_kv_indices=fkv_idx, q_num_blocks=q_num,
                              q_indices=q_idx, full_q_num_blocks=fq_num, full_q_indices=fq_idx,
                              BLOCK_SIZE=(QB, KB), mask_mod=mask_mod)


def _single_threaded(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _one_thread():
            return fn(*args, **kwargs)
    return wrapper


def _check_cu_seqlens(cu_seqlens) -> Tensor:
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ArgumentError("cu_seqlens: expected a 1-d integer tensor of at least 2 prefix sums")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        raise ArgumentTypeError(f"cu_seqlens: expected an integer dtype, got {cu_seqlens.dtype}")
    cu = cu_seqlens.to("cpu", torch.int64)
    if cu[0] != 0 or bool((cu[1:] < cu[:-1]).any()):
        raise ArgumentError("cu_seqlens: must start at 0 and be non-decreasing")
    return cu


@_single_threaded
def document_block_mask(cu_seqlens: Tensor, *, causal: bool = True, window: Optional[int] = None,
                        block_size: Union[int, Tuple[int, int]] = 128):
    """Packed documents (FlashAttention's ``cu_seqlens``: document s holds tokens
    ``cu_seqlens[s] .. cu_seqlens[s + 1] - 1`` of one sequence of ``cu_seqlens[-1]`` tokens):
    a token attends within its document, causally unless ``causal=False``, and with ``window``
    to the ``window`` keys before it at most. Returns torch's BlockMask for (Q_LEN, KV_LEN) =
    (T, T), broadcast over batch and heads; its mask_mod reads the document ids."""
    cu = _check_cu_seqlens(cu_seqlens)
    if not isinstance(causal, bool):
        raise ArgumentTypeError(f"causal: expected a bool, got {type(causal).__name__}")
    window = _check_window(window)
    T = int(cu[-1])
    if T == 0:
        raise ArgumentError("cu_seqlens: the documents hold no token")
    q = torch.arange(T)
    doc = torch.searchsorted(cu[1:], q, right=True)  # (repeat_interleave is 40x slower here)
    lo = cu[:-1][doc]
    hi = cu[1:][doc] - 1
    if causal:
        hi = torch.minimum(hi, q)
    if window is not None:
        lo = torch.maximum(lo, q - window)
        if not causal:
            hi = torch.minimum(hi, q + window)
    doc_ids = doc.to(torch.int32)
    win = torch.tensor([window if window is not None else 0], dtype=torch.int32)
    if causal and window is not None:
        def mask_mod(b, h, q_idx, kv_idx):
            return (doc_ids[q_idx] == doc_ids[kv_idx]) & (kv_idx <= q_idx) & (q_idx - kv_idx <= win[0])
    elif causal:
        def mask_mod(b, h, q_idx, kv_idx):
            return (doc_ids[q_idx] == doc_ids[kv_idx]) & (kv_idx <= q_idx)
    elif window is not None:
        def mask_mod(b, h, q_idx, kv_idx):
            return (doc_ids[q_idx] == doc_ids[kv_idx]) & (torch.abs(q_idx - kv_idx) <= win[0])
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return doc_ids[q_idx] == doc_ids[kv_idx]
    return _block_mask(lo[None, None], hi[None, None], T, T, block_size, mask_mod)


@_single_threaded
def prefix_lm_block_mask(prefix_lengths: Tensor, seq_len: int, *, block_size: Union[int, Tuple[int, int]] = 128):
    """Prefix-LM per batch element: keys ``kv < prefix_lengths[b]`` are visible to every query
    of element b (a bidirectional prefix), the rest causally (``kv <= q``). ``prefix_lengths``:
    integer (B,). Returns torch's BlockMask for (seq_len, seq_len), batch B, broadcast heads."""
    if not isinstance(prefix_lengths, Tensor) or prefix_lengths.dim() != 1:
        raise ArgumentError("prefix_lengths: expected a 1-d integer tensor (B,)")
    if prefix_lengths.dtype.is_floating_point or prefix_lengths.dtype == torch.bool:
        raise ArgumentTypeError(f"prefix_lengths: expected an integer dtype, got {prefix_lengths.dtype}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
        raise ArgumentError(f"seq_len: expected a positive int, got {seq_len!r}")
    pre = prefix_lengths.to("cpu", torch.int64)
    if bool((pre < 0).any()):
        raise ArgumentError("prefix_lengths: must be >= 0")
    q = torch.arange(seq_len)
    hi = torch.maximum(q[None, :], pre[:, None] - 1)
    lo = torch.zeros_like(hi)
    prefix = pre.to(torch.int32)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx < prefix[b])

    return _block_mask(lo[:, None], hi[:, None], seq_len, seq_len, block_size, mask_mod)


@_single_threaded
def causal_block_mask(q_len: int, kv_len: Optional[int] = None, *, window: Optional[int] = None,
                      block_size: Union[int, Tuple[int, int]] = 128):
    """Causal (torch's convention, top-left: ``kv <= q``), with ``window`` at most that many
    keys before the query. Returns torch's BlockMask for (q_len, kv_len), broadcast over batch
    and heads."""
    kv_len = q_len if kv_len is None else kv_len
    for name, n in (("q_len", q_len), ("kv_len", kv_len)):
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ArgumentError(f"{name}: expected a positive int, got {n!r}")
    window = _check_window(window)
    q = torch.arange(q_len)
    hi = q.clone()
    lo = q - window if window is not None else torch.zeros_like(q)
    if window is None:
        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx
    else:
        win = torch.tensor([window], dtype=torch.int32)

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (q_idx - kv_idx <= win[0])
    return _block_mask(lo[None, None], hi[None, None], q_len, kv_len, block_size, mask_mod)
