"""Public entry points for packed variable-length sequences and the KV cache.

* :func:`attention_varlen`: FlashAttention's ``flash_attn_varlen_func`` convention (packed
  ``(total_tokens, heads, head_dim)`` tensors and prefix sums), forward and backward.
* :func:`attention_with_kvcache`: the inference path (new keys appended into a dense or paged
  cache in place, then attention over the cache), forward only.

Both take the same route to a backend (mhakern/routing.py) as :func:`mhakern.attention`, with
the call record's packing or cache fields set (mhakern/modes.py). Semantics: docs/contract.md,
"Packed sequences" and "KV cache".
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch

from ._errors import ArgumentError, ArgumentTypeError
from .checks import (
    INT_DTYPES,
    check_backend,
    check_bool,
    check_dropout_p,
    check_packing_and_cache,
    check_qkv,
    check_scale,
    host_values_checkable,
    parse_modes,
    prepare_packing_and_cache,
)
from .routing import route

Tensor = torch.Tensor


def _check_dims(name: str, x, dims: int, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != dims:
        raise ArgumentError(f"{name}: expected {dims} dims {what}, got shape {tuple(x.shape)}")


def attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    causal_align: str = "bottom_right",
    window: Optional[Sequence[int]] = None,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    generator: Optional[torch.Generator] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    backend: str = "auto",
    return_lse: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Attention over packed variable-length sequences (FlashAttention's varlen convention).

    Args:
        q: (Tq, H, D) the query tokens of every sequence, one after the other.
        k: (Tk, Hkv, D), v: (Tk, Hkv, Dv) the key / value tokens likewise; H a multiple of Hkv.
            Any strides with unit stride on the last dim.
        cu_seqlens_q, cu_seqlens_k: integer (num_seqs + 1,) prefix sums (int32 preferred; on
            q's device or the CPU): sequence s holds query tokens ``cu_seqlens_q[s] ..
            cu_seqlens_q[s + 1] - 1`` and key tokens ``cu_seqlens_k[s] .. cu_seqlens_k[s + 1] - 1``;
            first 0, last Tq / Tk, non-decreasing (empty sequences allowed). Checked on the host
            once per call (not while compiling or capturing a CUDA graph).
        max_seqlen_q, max_seqlen_k: upper bounds of the sequences' lengths (the kernels' grid).
        causal, causal_align, window, scale, dropout_p, generator, softcap, sinks, backend,
            return_lse: as for :func:`mhakern.attention`, per sequence: causal offset
            ``Lk_s - Lq_s`` bottom-right (0 top-left), dropout hashed with ``b = s`` and local
            positions.
        alibi_slopes: None, (H,) or (num_seqs, H) slopes.

    A sequence's queries see only its own keys. Rows of a sequence without keys get output 0,
    lse -inf (the sink with sinks) and zero gradients. Differentiable in q, k, v and sinks;
    deterministic.

    Returns:
        ``out`` (Tq, H, Dv) in q's dtype, and with ``return_lse`` ``lse`` (H, Tq)
        (FlashAttention's layout), float32 (float64 for float64 inputs).
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_dims(name, x, 3, "(total tokens, heads, head_dim)")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dtype not in INT_DTYPES or cu.dim() != 1 or cu.numel() < 1:
            raise ArgumentError(f"{name}: expected a 1-D integer tensor of num_seqs + 1 prefix sums, got "
                                f"{cu.dtype if isinstance(cu, torch.Tensor) else type(cu).__name__} "
                                f"{tuple(cu.shape) if isinstance(cu, torch.Tensor) else ''}")
    # The operator's (1, H, T, D) views: no copy.
    q4, k4, v4 = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    check_qkv(q4, k4, v4)
    check_bool("causal", causal)
    check_bool("return_lse", return_lse)
    check_dropout_p(dropout_p)
    if dropout_p == 1.0:  # every probability dropped, as attention() does it
        out, lse = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                    causal_align=causal_align, window=window, scale=scale, softcap=softcap,
                                    alibi_slopes=alibi_slopes, sinks=sinks, backend=backend, return_lse=True)
        return (out * 0.0, lse) if return_lse else out * 0.0
    check_backend(backend)
    _, H, Tq, D = q4.shape
    scale = check_scale(scale, D)
    num_seqs = cu_seqlens_q.shape[0] - 1
    modes = parse_modes(q4, num_seqs, H, Tq, k4.shape[2], None, dropout_p, generator, causal, causal_align, window,
                        softcap, alibi_slopes, sinks)
    modes = modes._replace(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                           max_seqlen_k=max_seqlen_k)
    needs_grad = torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or (sinks is not None and sinks.requires_grad))
    out4, lse4 = route(q4, k4, v4, scale, causal, None, backend, modes, needs_grad)
    out = out4[0].transpose(0, 1)
    return (out, lse4[0]) if return_lse else out


def attention_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Optional[Tensor] = None,
    v: Optional[Tensor] = None,
    *,
    cache_seqlens: Union[Tensor, int],
    cache_batch_idx: Optional[Tensor] = None,
    block_table: Optional[Tensor] = None,
    causal: bool = False,
    causal_align: str = "bottom_right",
    window: Optional[Sequence[int]] = None,
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    backend: str = "auto",
    return_lse: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Attention of new queries over a KV cache, after appending the new keys and values to it
    in place (FlashAttention's ``flash_attn_with_kvcache``, in mhakern's (B, H, L, D) layout).
    Forward only (inference).

    Args:
        q: (B, H, Lq, D) the new queries.
        k_cache, v_cache: the cache, either dense (B_cache, Hkv, L_cache, D / Dv) (batch element b
            reads row b, or ``cache_batch_idx[b]``), or paged (num_pages, Hkv, page_size, D / Dv)
            with ``block_table``. Any strides with unit stride on the last dim (FlashAttention's
            (..., L, Hkv, D) cache goes in through ``.transpose(1, 2)``, and is written through
            the view).
        k, v: None, or (B, Hkv, L_new, D / Dv) new keys and values, written into the cache at
            positions ``cache_seqlens[b] .. cache_seqlens[b] + L_new - 1`` of batch element b
            (refused, naming ``k``, when they do not fit) before the attention.
        cache_seqlens: integer (B,) (or an int for all): the keys already in the cache per batch
            element. Not advanced here: the caller adds L_new afterwards (as FlashAttention).
        cache_batch_idx: None or integer (B,): the cache row of each batch element (repeats
            allowed without new keys).
        block_table: None or integer (B, pages_per_seq): key j of batch element b is row
            ``j % page_size`` of page ``block_table[b, j // page_size]``; any page size >= 1,
            pages in any order, shared pages allowed (not appended into by two elements).
        causal, causal_align, window, scale, softcap, alibi_slopes, sinks, backend, return_lse:
            as for :func:`mhakern.attention`, over the key lengths ``cache_seqlens + L_new``:
            bottom-right, the new queries are the last Lq positions of each element's keys.

    Returns:
        ``out`` (B, H, Lq, Dv) in q's dtype, and with ``return_lse`` ``lse`` (B, H, Lq), float32
        (float64 for float64 inputs).
    """
    _check_dims("q", q, 4, "(batch, heads, length, head_dim)")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_dims(name, x, 4, "(batch or pages, kv heads, length or page size, head_dim)")
        if x.dtype != q.dtype:
            raise ArgumentTypeError(f"{name}: dtype {x.dtype} does not match q's {q.dtype}")
        if x.device != q.device:
            raise ArgumentError(f"{name}: must be on q's device ({q.device}), got {x.device}")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ArgumentError(f"k_cache, v_cache: (rows or pages, kv heads, length) must match, got "
                            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    check_bool("causal", causal)
    check_bool("return_lse", return_lse)
    check_backend(backend)
    if torch.is_grad_enabled():
        for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v), ("sinks", sinks)):
            if isinstance(x, torch.Tensor) and x.requires_grad:
                raise ArgumentError(f"{name}: attention_with_kvcache is forward only (inference) and has no "
                                    "gradient; call it under torch.no_grad() or detach() the input")
    B, H, Lq, D = q.shape
    Bc, Hkv, Lc, Dc = k_cache.shape
    paged = block_table is not None
    if cache_batch_idx is None and not paged and Bc != B:
        raise ArgumentError(f"k_cache: {Bc} cache rows for q's batch size {B}; give cache_batch_idx to choose a row "
                            "per batch element")
    L_new = 0
    if (k is None) != (v is None):
        raise ArgumentError("k, v: give both the new keys and the new values, or neither")
    if k is not None:
        _check_dims("k", k, 4, "(batch, kv heads, new length, head_dim)")
        _check_dims("v", v, 4, "(batch, kv heads, new length, head_dim)")
        L_new = k.shape[2]
        for name, x, cname, cache in (("k", k, "k_cache", k_cache), ("v", v, "v_cache", v_cache)):
            want = (B, Hkv, L_new, cache.shape[3])
            if tuple(x.shape) != want:
                raise ArgumentError(f"{name}: expected shape (B, Hkv, L_new, D) = {want}, got {tuple(x.shape)}")
            # Refused rather than cast into the cache (as q is refused): an integer or a wider
            # float written into it would lose what the caller handed in without a word.
            if not x.is_floating_point():
                raise ArgumentTypeError(f"{name}: expected a floating-point dtype, got {x.dtype}")
            if x.dtype != cache.dtype:
                raise ArgumentTypeError(f"{name}: dtype {x.dtype} does not match {cname}'s {cache.dtype}")
            if x.device != q.device:
                raise ArgumentError(f"{name}: must be on q's device ({q.device}), got {x.device}")
        if B and L_new:
            _check_writable(k_cache, v_cache)
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        cache_seqlens = torch.full((B,), cache_seqlens, dtype=torch.int32, device=q.device)
    if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dtype not in INT_DTYPES:
        raise TypeError("cache_seqlens: expected an integer tensor of shape (B,) or an int")
    if tuple(cache_seqlens.shape) != (B,):
        raise ArgumentError(f"cache_seqlens: expected shape ({B},), got {tuple(cache_seqlens.shape)}")
    if cache_seqlens.device != q.device and cache_seqlens.device.type != "cpu":
        raise ArgumentError(f"cache_seqlens: must be on q's device ({q.device}) or the CPU, got {cache_seqlens.device}")
    scale = check_scale(scale, D)
    L_logical = block_table.shape[1] * Lc if paged and block_table.dim() == 2 else Lc
    modes = parse_modes(q, B, H, Lq, L_logical, None, 0.0, None, causal, causal_align, window, softcap,
                        alibi_slopes, sinks)
    modes = modes._replace(cache_batch_idx=cache_batch_idx, block_table=block_table)
    if modes.cached:  # indices checked (shapes and values) before anything is written
        check_qkv(q, k_cache, v_cache, cached=True)
        check_packing_and_cache(modes, q, k_cache, None)
        modes = prepare_packing_and_cache(modes, q, k_cache)
    else:
        check_qkv(q, k_cache, v_cache)
    seqlens = cache_seqlens.to(device=q.device, dtype=torch.int64)
    # Value checks read the host (as for key_lengths): none while compiling or capturing a graph.
    checkable = host_values_checkable(seqlens)
    if checkable and B:
        lo, hi = (int(x) for x in torch.stack(torch.aminmax(seqlens)).tolist())
        if lo < 0 or hi + L_new > L_logical:
            if L_new:
                raise ArgumentError(f"k: {L_new} new keys at cache_seqlens in [{lo}, {hi}] do not fit the cache's "
                                    f"{L_logical} positions per sequence")
            raise ArgumentError(f"cache_seqlens: values must lie in [0, {L_logical}], got min {lo} and max {hi}")
    if L_new and B:
        _append(k_cache, v_cache, k, v, seqlens, modes, checkable)
    key_lengths = (seqlens + L_new).to(torch.int32)
    # The fit check above read the lengths once: seqlens + L_new lie in [0, L_logical].
    out, lse = route(q, k_cache, v_cache, scale, causal, key_lengths, backend, modes, False, packing_checked=True,
                     key_lengths_checked=checkable)
    return (out, lse) if return_lse else out


def _append(k_cache, v_cache, k, v, seqlens, modes, checkable: bool) -> None:
    """Write k, v (B, Hkv, L_new, D*) at positions ``seqlens[b] ..`` of each batch element's
    cache row or pages, in place (one indexed write per tensor)."""
    B, L_new = k.shape[0], k.shape[2]
    pos = seqlens.view(B, 1) + torch.arange(L_new, device=seqlens.device).view(1, L_new)  # (B, L_new)
    if modes.block_table is not None:
        ps = k_cache.shape[2]
        rows = modes.block_table.to(torch.int64).gather(1, pos // ps)
        slots = pos % ps
    else:
        idx = modes.cache_batch_idx
        rows = (torch.arange(B, device=pos.device) if idx is None else idx.to(torch.int64)).view(B, 1).expand(B, L_new)
        slots = pos
    if checkable and modes.cached:
        # Two batch elements writing one cache slot would race (the last write wins in no
        # defined order): refused rather than left to chance.
        flat = rows * (k_cache.shape[2]) + slots
        if flat.unique().numel() != flat.numel():
            raise ArgumentError("k: two batch elements would append into the same cache slot (repeated "
                                "cache_batch_idx rows, or a page shared by two sequences at the positions written)")
    with torch.no_grad():
        # Advanced indices around a slice: the indexed view is (B, L_new, Hkv, D).
        k_cache[rows, :, slots] = k.permute(0, 2, 1, 3)
        v_cache[rows, :, slots] = v.permute(0, 2, 1, 3)


def _may_overlap(shape, strides) -> bool:
    """Whether two indices of a tensor of this shape and these strides may address one memory
    element. Sufficient for "no": with the dims of size > 1 sorted by stride, each stride
    exceeds the largest offset the smaller ones reach (then every index has its own offset);
    a stride 0 (an expanded dim) always fails it. The few layouts that fail it without
    overlapping interleave their dims (strides (2, 3) over sizes (3, 2)); no cache is laid out so."""
    reach = 0  # the largest offset the dims seen so far reach
    for st, sz in sorted((abs(st), sz) for st, sz in zip(strides, shape) if sz > 1):
        if st <= reach:
            return True
        reach += st * (sz - 1)
    return False


def _check_writable(k_cache: Tensor, v_cache: Tensor) -> None:
    """Refuse caches that the new keys and values cannot be written into position by position:
    one whose positions share memory (an expanded cache: its batch elements would read one
    another's appended keys, or lose them to the last write), or a k_cache and v_cache that
    share memory (the values would overwrite the keys)."""
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        for d, (st, sz) in enumerate(zip(x.stride(), x.shape)):
            if st == 0 and sz > 1:
                raise ArgumentError(f"{name}: dim {d} (size {sz}) has stride 0, an expanded tensor whose rows share "
                                    "memory: new keys and values cannot be written into it; give a cache with memory "
                                    "of its own (.contiguous())")
        if _may_overlap(x.shape, x.stride()):
            raise ArgumentError(f"{name}: its strides {tuple(x.stride())} for shape {tuple(x.shape)} let two positions "
                                "share memory: new keys and values cannot be written into it; give a cache with "
                                "memory of its own (.contiguous())")
    if (k_cache.numel() and v_cache.numel() and k_cache.device.type != "meta" and not torch.compiler.is_compiling()
            and k_cache.untyped_storage().data_ptr() == v_cache.untyped_storage().data_ptr()):
        # One storage: k_cache and v_cache may be two halves of one (2, ...) or (..., 2, D) block
        # (disjoint although their extents interleave): disjoint if, seen as one tensor with a
        # dim of size 2 whose stride is their offset, they pass the test above.
        (k_lo, k_hi), (v_lo, v_hi) = _extent(k_cache), _extent(v_cache)
        gap = v_cache.storage_offset() - k_cache.storage_offset()
        halves = (k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride() and gap != 0
                  and not _may_overlap((2,) + tuple(k_cache.shape), (gap,) + tuple(k_cache.stride())))
        if k_lo <= v_hi and v_lo <= k_hi and not halves:
            raise ArgumentError("k_cache, v_cache: they share memory, so the new values would overwrite keys "
                                "(or the reverse); give them memory of their own")


def _extent(x: Tensor) -> Tuple[int, int]:
    """First and last byte offsets (within its storage) of the elements of a non-empty x."""
    lo = hi = x.storage_offset()
    for st, sz in zip(x.stride(), x.shape):
        if st < 0:
            lo += st * (sz - 1)
        else:
            hi += st * (sz - 1)
    return lo * x.element_size(), (hi + 1) * x.element_size() - 1
