"""Plain PyTorch attention: the oracle of every test and the fallback of ``auto``.

Shapes and semantics are those of the backend contract (docs/contract.md):

* ``q``: (B, H, Lq, D), ``k``: (B, Hkv, Lk, D), ``v``: (B, Hkv, Lk, Dv), H a multiple of Hkv;
  query head ``h`` reads KV head ``h // (H // Hkv)``.
* Visibility of key ``j`` to query ``i`` of element ``b``: ``j < Lk_b`` (``key_lengths[b]`` or
  Lk); with ``off = 0`` if ``modes.top_left`` else ``Lk_b - Lq``, ``causal`` requires
  ``j <= i + off``, a window ``(left, right)`` requires ``j >= i + off - left`` (left >= 0) and
  ``j <= i + off + right`` (right >= 0); a bool ``attn_mask`` hides False entries, a float one is
  added to the scaled scores (-inf hides).
* Dropout: the keep mask :func:`dropout_keep_mask`, applied to the normalised probabilities
  (``out = (P * keep / (1 - p)) @ V``); lse is that of the undropped softmax.
* A query row that sees no key gets output 0, lse = -inf and zero gradients.
* NaN/inf: a non-finite value in a visible input propagates as IEEE arithmetic makes it (as in
  SDPA's math); hidden positions never contribute, not even ``0 * NaN``.

Packed sequences (``modes.cu_seqlens_q/k``) are computed sequence by sequence, each as batch
element s of a dense call (:func:`sequence_bounds`); the KV cache's addressing
(``modes.cache_batch_idx``, ``modes.block_table``) by gathering the dense K/V first
(:func:`gather_cache`). docs/contract.md, "Packed sequences" and "KV cache".

``upcast=True`` computes in float64 (the oracle); ``upcast=False`` computes in the input dtype
(the "torch math in T" of the tolerance rule). Outputs are returned in the input dtype unless
``upcast`` is set, in which case they stay float64 so that tests can measure the kernels' error.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from ._layout import as_dtype
from .modes import DEFAULT_MODES, Modes, mask_4d

Tensor = torch.Tensor

# Query rows per chunk: bounds the (rows x Lk) score matrix when Lk is very long.
_SCORE_BUDGET = 1 << 24

M32 = 0xFFFFFFFF


# ---------------------------------------------------------------------------------------------
# Dropout hash (docs/contract.md, "Dropout"): the same bits in every backend.


def mix32(x):
    """lowbias32 finaliser on 32-bit values held in int64 tensors (or Python ints).

    Every product of a 32-bit value with a 32-bit constant below 2**31 stays below 2**63, so
    int64 arithmetic is exact before the ``& M32``.
    """
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & M32
    x = x ^ (x >> 15)
    return x


def dropout_threshold(p: float) -> int:
    """The 32-bit threshold: a probability is kept iff its hash is >= this."""
    return min(int(p * 4294967296.0), M32)


def dropout_keep_bit(seed: int, b: int, h: int, H: int, i: int, j: int, p: float) -> bool:
    """One keep decision, in plain Python integers (the specification the tensor code follows)."""
    seed_lo, seed_hi = seed & M32, (seed >> 32) & M32
    s_bh = mix32(seed_lo ^ mix32(seed_hi ^ ((b * H + h) & M32)))
    r_i = mix32(s_bh ^ (i & M32))
    u = mix32((r_i + j) & M32)
    return u >= dropout_threshold(p)


def dropout_keep_mask(
    seed: int,
    B: int,
    H: int,
    Lq: int,
    Lk: int,
    p: float,
    device=None,
    row_offset: int = 0,
    rows: Optional[int] = None,
    batch_offset: int = 0,
    q0: int = 0,
    k0: int = 0,
    h0: int = 0,
    heads: int = 0,
) -> Tensor:
    """Bool keep mask (B, H, rows, Lk) of query rows ``row_offset ..`` (all rows by default) of
    batch elements ``batch_offset ..`` (a packed call's sequence s hashes as b = s); the hash
    sees row i as ``i + q0``, key j as ``j + k0`` and head h as ``h + h0`` of ``heads`` heads (0:
    ``H``) (the modes ``dropout_q0`` / ``_k0`` / ``_h0`` / ``_heads``: a block or a head shard of
    a longer call).

    ``H`` is the number of *query* heads. ``p = 0`` keeps everything.
    """
    rows = Lq - row_offset if rows is None else rows
    seed_lo, seed_hi = seed & M32, (seed >> 32) & M32
    i64 = dict(dtype=torch.int64, device=device)
    Ht = heads if heads > 0 else H
    bh = (torch.arange(batch_offset, batch_offset + B, **i64).view(B, 1) * Ht
          + torch.arange(h0, h0 + H, **i64).view(1, H)) & M32
    s_bh = mix32(seed_lo ^ mix32(seed_hi ^ bh))
    i = torch.arange(q0 + row_offset, q0 + row_offset + rows, **i64) & M32
    r_i = mix32(s_bh.view(B, H, 1) ^ i.view(1, 1, rows))
    j = torch.arange(k0, k0 + Lk, **i64)
    u = mix32((r_i.view(B, H, rows, 1) + j.view(1, 1, 1, Lk)) & M32)
    return u >= dropout_threshold(p)


# ---------------------------------------------------------------------------------------------
# Visibility


def visible_mask(
    Lq: int,
    Lk: int,
    causal: bool,
    key_lengths: Optional[Tensor],
    device: torch.device,
    row_offset: int = 0,
    rows: Optional[int] = None,
    *,
    top_left: bool = False,
    window_left: int = -1,
    window_right: int = -1,
) -> Optional[Tensor]:
    """Boolean mask of structurally visible (query, key) pairs (key lengths, causal, window),
    or None when every key is visible. ``attn_mask`` is not part of it.

    Returns a tensor broadcastable to (B, H, rows, Lk): shape (B or 1, 1, rows, Lk), for the
    query rows ``row_offset .. row_offset + rows - 1``.
    """
    rows = Lq - row_offset if rows is None else rows
    windowed = window_left >= 0 or window_right >= 0
    if not causal and key_lengths is None and not windowed:
        return None
    j = torch.arange(Lk, device=device).view(1, 1, 1, Lk)
    if key_lengths is None:
        lk = torch.full((1,), Lk, device=device, dtype=torch.long)
    else:
        lk = key_lengths.to(device=device, dtype=torch.long)
    lk = lk.view(-1, 1, 1, 1)
    mask = j < lk
    if causal or windowed:
        i = torch.arange(row_offset, row_offset + rows, device=device).view(1, 1, rows, 1)
        diag = i if top_left else i + lk - Lq
        if causal:
            mask = mask & (j <= diag)
        if window_left >= 0:
            mask = mask & (j >= diag - window_left)
        if window_right >= 0:
            mask = mask & (j <= diag + window_right)
    return mask


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of ``lse`` for inputs of ``dtype``, and of the backward's float32-or-better
    results (a floating mask's gradient, the sinks' gradient): float64 for float64 inputs,
    float32 for the rest (docs/contract.md, "Shapes and layout")."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _work_dtype(dtype: torch.dtype, upcast: bool) -> torch.dtype:
    """float64 with ``upcast``; otherwise fp32 for half inputs (fp32 accumulation, as every
    backend) and the input dtype for the rest."""
    if upcast:
        return torch.float64
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _expand_kv(x: Tensor, n_rep: int) -> Tensor:
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def alibi_bias(slopes, B, H, r0, rows, Lq, Lk, key_lengths, top_left, device, wdt) -> Tensor:
    """``-slope[b, h] * |i + off - j|`` (B, H, rows, Lk) for query rows ``r0 ..``, slopes (H,) or
    (B, H); ``off = 0`` top-left, else ``Lk_b - Lq``."""
    a = slopes.to(device=device, dtype=wdt)
    a = a.reshape(1, -1) if a.dim() == 1 else a
    i = torch.arange(r0, r0 + rows, device=device, dtype=wdt).view(1, 1, rows, 1)
    j = torch.arange(Lk, device=device, dtype=wdt).view(1, 1, 1, Lk)
    if top_left:
        off = torch.zeros((1, 1, 1, 1), device=device, dtype=wdt)
    else:
        lk = torch.full((1,), Lk, device=device) if key_lengths is None else key_lengths.to(device)
        off = (lk.to(wdt) - Lq).view(-1, 1, 1, 1)
    return -a.expand(B, H).reshape(B, H, 1, 1) * (i + off - j).abs()


def _scores(q, kk, scale, r0, rows, Lq, Lk, causal, key_lengths, modes, wdt, want_cap_grad=False):
    """Scaled scores (B, H, rows, Lk) after the score modifiers (softcap, then ALiBi) with the
    float mask added, and the visibility (or None); with ``want_cap_grad`` also the derivative of
    the cap ``1 - tanh^2`` (None without softcap).

    Hidden positions hold -inf in the scores whatever q and k hold there.
    """
    s = torch.matmul(q[:, :, r0 : r0 + rows].to(wdt), kk.transpose(-1, -2)) * scale
    cap_grad = None
    if modes.softcap > 0.0:
        t = torch.tanh(s / modes.softcap)
        s = t * modes.softcap
        if want_cap_grad:
            cap_grad = 1.0 - t * t
    if modes.alibi_slopes is not None:
        s = s + alibi_bias(modes.alibi_slopes, q.shape[0], q.shape[1], r0, rows, Lq, Lk, key_lengths, modes.top_left,
                           q.device, wdt)
    vis = visible_mask(
        Lq, Lk, causal, key_lengths, q.device, r0, rows,
        top_left=modes.top_left, window_left=modes.window_left, window_right=modes.window_right,
    )
    m = mask_4d(modes.attn_mask)
    if m is not None:
        m = m[:, :, r0 : r0 + rows] if m.shape[2] != 1 else m
        if m.dtype == torch.bool:
            vis = m if vis is None else vis & m
        else:
            m = m.to(wdt)
            s = s + m
            hide = m != float("-inf")
            vis = hide if vis is None else vis & hide
    if vis is not None:
        vis = vis.expand(s.shape)
        s = s.masked_fill(~vis, float("-inf"))
    if want_cap_grad:
        return s, vis, cap_grad
    return s, vis


def _sink_column(modes, B, H, wdt, device) -> Tensor:
    """The sinks as a (B, H, 1, 1) score column."""
    return modes.sinks.to(device=device, dtype=wdt).view(1, H, 1, 1).expand(B, H, 1, 1)


def sink_grad(sinks: Tensor, lse: Tensor, delta: Tensor) -> Tensor:
    """dL/dsink[h] = -sum over (b, i) of ``exp(sink[h] - lse) * delta``, with ``lse`` the
    sink-inclusive log-sum-exp (B, H, Lq) and ``delta = rowsum(dout * out)`` (B, H, Lq); 0 for a
    sink of -inf. In ``lse``'s dtype."""
    sk = as_dtype(sinks, lse.dtype).view(1, -1, 1)
    p_sink = torch.exp(sk - lse).masked_fill(torch.isneginf(sk).expand_as(lse), 0.0)
    return -(p_sink * as_dtype(delta, lse.dtype)).sum((0, 2))


def _support_matmul(a: Tensor, b: Tensor, present: Optional[Tensor]) -> Tensor:
    """``a @ b`` summing only the terms where ``present`` (shape of ``a``) is True.

    A term left out contributes nothing, not even ``0 * inf = NaN``: a NaN or inf in ``b`` at a
    position hidden from a row never reaches that row. Terms present keep IEEE semantics
    (``0 * inf`` is NaN, ``inf + -inf`` is NaN), as SDPA's math gives them.
    """
    if present is None:
        return torch.matmul(a, b)
    a0 = a.masked_fill(~present, 0.0)
    fin_b = torch.isfinite(b)
    try:
        finite = bool(fin_b.all())
    except RuntimeError:
        # Under vmap (autograd.grad(is_grads_batched=True)) ``b`` is batched and its values
        # cannot steer Python; the general path below is exact anyway.
        finite = False
    if finite:
        return torch.matmul(a0, b)
    out = torch.matmul(a0, b.masked_fill(~fin_b, 0.0))
    f = a.dtype
    pos_a = (present & (a > 0)).to(f)
    neg_a = (present & (a < 0)).to(f)
    zero_or_nan_a = (present & ~(a > 0) & ~(a < 0)).to(f)
    nan_b, pinf_b, ninf_b = torch.isnan(b).to(f), (b == math.inf).to(f), (b == -math.inf).to(f)
    n_nan = torch.matmul(present.to(f), nan_b) + torch.matmul(zero_or_nan_a, pinf_b + ninf_b)
    n_pos = torch.matmul(pos_a, pinf_b) + torch.matmul(neg_a, ninf_b)
    n_neg = torch.matmul(pos_a, ninf_b) + torch.matmul(neg_a, pinf_b)
    nan = (n_nan > 0) | ((n_pos > 0) & ((n_neg > 0) | (out == -math.inf))) | ((n_neg > 0) & (out == math.inf))
    out = torch.where(n_pos > 0, torch.full_like(out, math.inf), out)
    out = torch.where(n_neg > 0, torch.full_like(out, -math.inf), out)
    return out.masked_fill(nan, math.nan)


# ---------------------------------------------------------------------------------------------
# Packed sequences and the KV cache, in terms of the dense call


def sequence_bounds(modes: Modes):
    """``[(q0, q1, k0, k1), ...]``: the query and key token ranges of each packed sequence (one
    host read of the prefix sums)."""
    cq = modes.cu_seqlens_q.tolist()
    ck = modes.cu_seqlens_k.tolist()
    return [(cq[s], cq[s + 1], ck[s], ck[s + 1]) for s in range(len(cq) - 1)]


def sequence_modes(modes: Modes, s: int) -> Modes:
    """The record of packed sequence ``s`` as a dense batch of one: no packing, ALiBi row s."""
    a = modes.alibi_slopes
    return modes._replace(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
                          alibi_slopes=None if a is None else a[s : s + 1])


def gather_cache(k: Tensor, v: Tensor, modes: Modes) -> Tuple[Tensor, Tensor]:
    """The dense (B, Hkv, Lk, D*) K/V a cache call reads: rows ``cache_batch_idx[b]``, or the
    pages of ``block_table`` in order (Lk = pages_per_seq * page_size)."""
    if modes.cache_batch_idx is not None:
        idx = modes.cache_batch_idx.to(device=k.device, dtype=torch.long)
        k, v = k[idx], v[idx]
    if modes.block_table is not None:
        bt = modes.block_table.to(device=k.device, dtype=torch.long)
        B, P = bt.shape

        def pages(x):  # (B, P, Hkv, page_size, D) -> (B, Hkv, P * page_size, D)
            g = x[bt]
            return g.permute(0, 2, 1, 3, 4).reshape(B, x.shape[1], P * x.shape[2], x.shape[3])

        k, v = pages(k), pages(v)
    return k, v


def _dense_cache(k, v, modes):
    k, v = gather_cache(k, v, modes)
    return k, v, modes._replace(cache_batch_idx=None, block_table=None)


def _cat_seqs(parts, like: Tensor, last: Optional[int]) -> Tensor:
    # Sequences tile the tokens in order, so their results concatenate along the tokens; no
    # sequence at all (num_seqs = 0) leaves an empty result.
    if parts:
        return torch.cat(parts, dim=2)
    shape = (like.shape[0], like.shape[1], 0) + (() if last is None else (last,))
    return like.new_zeros(shape)


def attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: Optional[float] = None,
    causal: bool = False,
    key_lengths: Optional[Tensor] = None,
    upcast: bool = False,
    modes: Modes = DEFAULT_MODES,
    *,
    batch_offset: int = 0,
) -> Tuple[Tensor, Tensor]:
    """Exact attention by materialising the scores. Returns ``(out, lse)``.

    ``out``: (B, H, Lq, Dv) in the compute dtype's output dtype (see module docstring);
    ``lse``: :func:`lse_dtype` (float64 with ``upcast``) of shape (B, H, Lq), natural log, -inf for rows
    that see no key. Work dtype is float64 with ``upcast``, float32 for half inputs otherwise
    (accumulation in fp32, as every backend), else the input dtype. ``modes``: the optional
    modes (:class:`mhakern.modes.Modes`); its ``attn_mask`` may have any shape broadcastable
    to (B, H, Lq, Lk). ``batch_offset``: the dropout hash's index of batch element 0.
    """
    if modes.packed:
        outs, lses = [], []
        for s, (q0, q1, k0, k1) in enumerate(sequence_bounds(modes)):
            o, lo = attention_forward(q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], scale, causal, None, upcast,
                                      sequence_modes(modes, s), batch_offset=s)
            outs.append(o)
            lses.append(lo)
        wdt = torch.float64 if upcast else q.dtype
        return (_cat_seqs(outs, q.new_zeros((), dtype=wdt).expand(q.shape[:2]), v.shape[-1]),
                _cat_seqs(lses, q.new_zeros((), dtype=torch.float64 if upcast else lse_dtype(q.dtype))
                          .expand(q.shape[:2]), None))
    if modes.cached:
        k, v, modes = _dense_cache(k, v, modes)
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    wdt = _work_dtype(q.dtype, upcast)
    kk = _expand_kv(k, H // Hkv).to(wdt)
    vv = _expand_kv(v, H // Hkv).to(wdt)
    outs, lses = [], []
    step = max(1, _SCORE_BUDGET // max(1, B * H * Lk))
    for r0 in range(0, Lq, step):
        rows = min(step, Lq - r0)
        s, vis = _scores(q, kk, scale, r0, rows, Lq, Lk, causal, key_lengths, modes, wdt)
        # p = exp(s - m) / l with m the row's max (the sink's too), as the kernels and torch's
        # softmax compute it: exp(s - lse) would add lse's rounding, u * |lse|, to every
        # exponent, an error that grows with the logits (docs/contract.md, "Tolerance rule").
        m = s.amax(-1, keepdim=True) if Lk else s.new_full(s.shape[:-1] + (1,), -math.inf)  # amax refuses 0 keys
        if modes.sinks is not None:  # the sink joins the denominator (docs/contract.md)
            sk = _sink_column(modes, B, H, wdt, q.device)
            m = torch.maximum(m, sk)
        # A row that sees nothing (m = -inf) shifts by 0 and gets l = 0, lse -inf and output 0.
        # A +inf among the visible scores makes m +inf and l NaN (inf - inf): the softmax is
        # undefined and its lse NaN, as a NaN score's is (docs/contract.md, "NaN and inf").
        m = m.masked_fill(torch.isneginf(m), 0.0)
        e = torch.exp(s - m)
        l = e.sum(-1, keepdim=True)
        if modes.sinks is not None:
            l = l + torch.exp(sk - m)
        dead = l == 0
        lse = (m + torch.log(l)).masked_fill(dead, -math.inf).squeeze(-1)
        p = e / l.masked_fill(dead, 1.0)
        if modes.dropout_p > 0.0:
            keep = dropout_keep_mask(modes.seed, B, H, Lq, Lk, modes.dropout_p, q.device, r0, rows, batch_offset,
                                     modes.dropout_q0, modes.dropout_k0, modes.dropout_h0, modes.dropout_heads)
            p = p * keep.to(wdt) / (1.0 - modes.dropout_p)
        outs.append(_support_matmul(p, vv, vis))
        lses.append(lse)
    out = torch.cat(outs, dim=2) if outs else q.new_zeros((B, H, 0, v.shape[-1]), dtype=wdt)
    lse = torch.cat(lses, dim=2) if lses else q.new_zeros((B, H, 0), dtype=wdt)
    if upcast:
        return out, lse
    return out.to(q.dtype), lse.to(lse_dtype(q.dtype))


def attention_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: Optional[float] = None,
    causal: bool = False,
    key_lengths: Optional[Tensor] = None,
    upcast: bool = False,
    modes: Modes = DEFAULT_MODES,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients by the contract: probabilities recomputed from ``lse``, ``delta = rowsum(dout*out)``
    (as ``sum_j P dP``, its value in exact arithmetic; ``out`` gives only the shape).

    Returns ``(dq, dk, dv)`` shaped like ``q``, ``k``, ``v``; dk and dv are summed over the query
    heads that share a KV head. :func:`attention_backward_modes` also returns dL/dscore.
    """
    return attention_backward_modes(dout, q, k, v, out, lse, scale, causal, key_lengths, upcast, modes)[:3]


def attention_backward_modes(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: Optional[float] = None,
    causal: bool = False,
    key_lengths: Optional[Tensor] = None,
    upcast: bool = False,
    modes: Modes = DEFAULT_MODES,
    *,
    batch_offset: int = 0,
) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """:func:`attention_backward` plus ``dmask``: None unless ``modes.mask_grad``, else
    dL/d(score) (B, H, Lq, Lk) in the work dtype (:func:`lse_dtype`, float64 with ``upcast``), 0 where
    hidden: the gradient of an additive mask before its reduction to the mask's shape. Packed
    sequences: per sequence (no mask with them, so ``dmask`` None); the cache is forward only."""
    if modes.packed:
        dqs, dks, dvs = [], [], []
        for s, (q0, q1, k0, k1) in enumerate(sequence_bounds(modes)):
            g = attention_backward_modes(dout[:, :, q0:q1], q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1],
                                         out[:, :, q0:q1], lse[:, :, q0:q1], scale, causal, None, upcast,
                                         sequence_modes(modes, s), batch_offset=s)
            dqs.append(g[0])
            dks.append(g[1])
            dvs.append(g[2])
        wdt = torch.float64 if upcast else q.dtype
        z = q.new_zeros((), dtype=wdt)
        return (_cat_seqs(dqs, z.expand(q.shape[:2]), q.shape[-1]), _cat_seqs(dks, z.expand(k.shape[:2]), k.shape[-1]),
                _cat_seqs(dvs, z.expand(v.shape[:2]), v.shape[-1]), None)
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    n_rep = H // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    wdt = _work_dtype(q.dtype, upcast)
    qw, dow = q.to(wdt), dout.to(wdt)
    kk = _expand_kv(k, n_rep).to(wdt)
    vv = _expand_kv(v, n_rep).to(wdt)
    s, vis, cap_grad = _scores(q, kk, scale, 0, Lq, Lq, Lk, causal, key_lengths, modes, wdt, want_cap_grad=True)
    # In the backward a pair whose score is -inf is hidden, whatever made it -inf (a mask, or an
    # infinite entry of q or k): no 0 * inf from it, and 0 in P even on a NaN row
    # (docs/contract.md, "NaN and inf"). Hidden pairs already hold -inf.
    vis = s != -math.inf
    vis = None if bool(vis.all()) else vis
    lse_w = lse.to(wdt).unsqueeze(-1)
    dead = torch.isneginf(lse_w)
    p = torch.exp(s - lse_w.masked_fill(dead, 0.0)).masked_fill(dead, 0.0)
    if vis is not None:
        p = p.masked_fill(~vis, 0.0)
    dp = _support_matmul(dow, vv.transpose(-1, -2), None)
    if modes.dropout_p > 0.0:
        keep = dropout_keep_mask(modes.seed, B, H, Lq, Lk, modes.dropout_p, q.device, batch_offset=batch_offset,
                                 q0=modes.dropout_q0, k0=modes.dropout_k0, h0=modes.dropout_h0,
                                 heads=modes.dropout_heads).to(wdt) / (1.0 - modes.dropout_p)
        pd, dp = p * keep, dp * keep
    else:
        pd = p
    # delta = rowsum(dout * out) = sum_j P_ij dP_ij (out = Pd V, and dp is the gradient of Pd
    # here), computed from the same P and dP as dS: a row that sees one key (P = 1) then gets
    # dS = 0 exactly, as the math (a softmax over one key) has it, rather than the rounding
    # difference of two differently summed dot products. Hidden pairs add nothing (where, not a
    # product: dp may be NaN there).
    pdp = p * dp
    delta = (pdp if vis is None else pdp.masked_fill(~vis, 0.0)).masked_fill(dead, 0.0).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    if vis is not None:
        # where, not a product: dp may be NaN at a hidden key (a NaN in v there).
        ds = ds.masked_fill(~vis, 0.0)
    ds = ds.masked_fill(dead, 0.0)
    dmask_ds = ds  # dL/d(capped score): where the mask and the ALiBi bias are added
    if cap_grad is not None:
        ds = ds * cap_grad  # through the cap to the raw scaled score
    vis_t = None if vis is None else vis.transpose(-1, -2)
    dv = _support_matmul(pd.transpose(-1, -2), dow, vis_t)
    dq = _support_matmul(ds, kk, vis) * scale
    dk = _support_matmul(ds.transpose(-1, -2), qw, vis_t) * scale
    if n_rep > 1:
        dk = dk.view(B, Hkv, n_rep, Lk, D).sum(2)
        dv = dv.view(B, Hkv, n_rep, Lk, v.shape[-1]).sum(2)
    # dmask in the work dtype: float32 for half and float32 inputs, float64 for float64 ones
    # (lse_dtype) or with upcast.
    dmask = dmask_ds if modes.mask_grad else None
    if upcast:
        return dq, dk, dv, dmask
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dmask


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: Optional[float] = None,
    causal: bool = False,
    key_lengths: Optional[Tensor] = None,
    upcast: bool = True,
    modes: Modes = DEFAULT_MODES,
    *,
    batch_offset: int = 0,
) -> Tensor:
    """Differentiable naive attention (autograd through PyTorch ops), for tests.

    Unlike :func:`attention_forward` this one lets autograd derive the gradients, so it checks
    the hand-written backward formulas rather than sharing them. A float ``modes.attn_mask``
    that requires grad receives its gradient. Non-finite values in keys past ``key_lengths``
    are kept out; for other hidden positions (causal, window, mask) holding NaN or inf use
    :func:`attention_forward` / :func:`attention_backward_modes`, which exclude every hidden
    term. Packed sequences and the cache as in :func:`attention_forward`.
    """
    if modes.packed:
        outs = [attention(q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], scale, causal, None, upcast,
                          sequence_modes(modes, s), batch_offset=s)
                for s, (q0, q1, k0, k1) in enumerate(sequence_bounds(modes))]
        return _cat_seqs(outs, q.new_zeros((), dtype=torch.float64 if upcast else q.dtype).expand(q.shape[:2]),
                         v.shape[-1])
    if modes.cached:
        k, v, modes = _dense_cache(k, v, modes)
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    wdt = torch.float64 if upcast else q.dtype
    k, v = k.to(wdt), v.to(wdt)
    if key_lengths is not None:
        # Keys past a length are replaced (where, not a product) before any arithmetic, so
        # that a NaN stored there reaches neither the output nor a gradient.
        live = (torch.arange(Lk, device=k.device) < key_lengths.to(k.device).view(-1, 1)).view(B, 1, Lk, 1)
        k, v = torch.where(live, k, 0.0), torch.where(live, v, 0.0)
    kk, vv = _expand_kv(k, H // Hkv), _expand_kv(v, H // Hkv)
    s, vis = _scores(q, kk, scale, 0, Lq, Lq, Lk, causal, key_lengths, modes, wdt)
    if modes.sinks is not None:
        # The sink as one more score column with no value: softmax over Lk + 1, then dropped.
        z = torch.cat([s, _sink_column(modes, B, H, wdt, q.device).expand(B, H, Lq, 1)], dim=-1)
        dead = torch.isneginf(z).all(-1, keepdim=True)
        p = torch.softmax(z.masked_fill(dead, 0.0), dim=-1)[..., :Lk].masked_fill(dead, 0.0)
        if vis is not None:
            p = p.masked_fill(~vis, 0.0)
    elif vis is not None:
        dead = ~vis.any(-1, keepdim=True)
        # softmax of an all -inf row is NaN; give those rows zero weights instead.
        p = torch.softmax(s.masked_fill(dead, 0.0), dim=-1).masked_fill(dead | ~vis, 0.0)
    else:
        p = torch.softmax(s, dim=-1)
    if modes.dropout_p > 0.0:
        keep = dropout_keep_mask(modes.seed, B, H, Lq, Lk, modes.dropout_p, q.device, batch_offset=batch_offset,
                                 q0=modes.dropout_q0, k0=modes.dropout_k0, h0=modes.dropout_h0,
                                 heads=modes.dropout_heads)
        p = p * keep.to(wdt) / (1.0 - modes.dropout_p)
    return torch.matmul(p, vv)


# ---------------------------------------------------------------------------------------------
# The tolerance rule (docs/contract.md), for everything that checks a kernel against this
# reference: the tests, the first-use self-test (mhakern/selftest.py), the device check.

#: The rule's absolute floor per input dtype.
ATOL = {torch.float16: 1e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5, torch.float64: 1e-10}


def rule_violation(got: Tensor, ref64: Tensor, math_T: Tensor, dtype: torch.dtype, factor: float,
                   extra: float = 0.0) -> Optional[str]:
    """None when ``max|got - ref64| <= factor * max|math_T - ref64| + ATOL[dtype] + extra``, else
    why not, naming the worst index and both values: ``ref64`` is this reference in float64,
    ``math_T`` the naive computation in the inputs' dtype ``dtype``; ``factor`` 2 for outputs, 3
    for gradients. Shapes must agree.

    The maxima run over the elements where ``ref64`` is finite (non-finite reference values are
    the caller's to judge first), and the naive math's error over those where it is finite too:
    where the naive math in T overflows (fp16 scores of large logits at D 256 reach inf), its
    error elsewhere still bounds the kernel everywhere, rather than a NaN bound passing anything.
    A non-finite ``got`` where the reference is finite is a violation. With no element to compare
    (every reference value non-finite), or no finite naive value to bound by, nothing is judged."""
    got64, ref64 = got.detach().to(torch.float64).cpu(), ref64.detach().to(torch.float64).cpu()
    if got64.numel() == 0:
        return None
    judged = torch.isfinite(ref64)
    math64 = math_T.detach().to(torch.float64).cpu()
    bounded = judged & torch.isfinite(math64)
    if not bounded.any():
        return None
    err = (got64 - ref64).abs().nan_to_num(nan=math.inf).masked_fill(~judged, 0.0)
    math_err = (math64 - ref64).abs()[bounded].max().item()
    bound = factor * math_err + ATOL[dtype] + extra
    worst = err.max().item()
    if worst <= bound:
        return None
    idx = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape))
    return (f"max error {worst:.3e} at {idx} exceeds {factor} x torch-math error {math_err:.3e} + atol "
            f"{ATOL[dtype]:.0e} (+ {extra:.1e}) = {bound:.3e} (kernel {got64[idx].item():.6g}, reference "
            f"{ref64[idx].item():.6g})")
