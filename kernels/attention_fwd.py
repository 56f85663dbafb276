"""Fused attention forward in Triton: one pass over keys with an online softmax (base 2).

Row tiles. A program owns ``BLOCK_M`` query rows of one batch element. Rows are numbered over
``heads_per_prog`` consecutive query heads times Lq queries: row ``r`` is query ``r % Lq`` of
head ``head0 + r // Lq``. With ``heads_per_prog == 1`` this is the usual per-head tile; with
``heads_per_prog == n_rep`` (decode shapes) the query heads that share a KV head fill one tile,
so their shared keys and values are read once.

Scores are kept in natural units (``s = (q . k) * scale``, the running max ``m`` too) and
exponentiated as ``exp2((s - m) * log2(e))``. Folding log2(e) into the scale, as Triton's
tutorial does, saves a multiply but leaves lse as a base-2 quantity whose conversion back to the
contract's natural log costs a rounding at the magnitude of the logits; with large logits that
rounding reaches every probability the backward recomputes. Here lse = m + log(l) is one
rounding away from the scores the backward recomputes identically.

Masking (bottom-right causal per batch element, key lengths) is applied only in the key blocks
that need it: an unmasked loop runs over the blocks every row of the tile sees entirely, then
a masked loop over the rest (diagonal and tail), through one inner function specialised by a
constexpr, as in Triton's fused-attention tutorial.

Optional modes (docs/contract.md), each behind a constexpr so that a call without them compiles
to the code above and nothing more:

* ``BAND``: top-left alignment and/or a sliding window. Row ``i`` sees keys
  ``[i + off - L, i + off + R]`` (``off`` 0 top-left, ``Lk_b - Lq`` bottom-right; the launcher
  folds causal into ``R`` and turns an unbounded side into ``Lq + Lk``). Key blocks below the
  tile's first visible key or past its last are never visited; blocks every row of the tile
  sees whole run unmasked; only the boundary blocks on either side are masked.
* ``MASK_KIND`` 1 (bool, True = attend) or 2 (float bias added to the scaled scores, -inf
  hides): read through the four strides of the (B, H, Lq, Lk) expanded view, never copied.
* ``DROPOUT``: the contract's counter hash (``_mix32``, lowbias32) on (seed, b, h, i, j) in
  uint32 arithmetic, h the query head; probabilities of dropped pairs leave the sum ``l`` (lse
  is that of the undropped softmax) but not the output, which takes ``1 / (1 - p)`` once at
  the end.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .heuristics import MAX_SPLITS, desc_eligible, fwd_config, head_block, packed_rows, plan_fwd_splits, row_block


@triton.jit
def _unfold_rows_grid(H, Lq, heads_per_prog, BLOCK_M: tl.constexpr):
    """(row tile, head group, batch element) of this program in the one-dimensional grid.

    The grid is flat, row tiles fastest, then head groups, then batch elements: CUDA limits grid
    axes 1 and 2 to 65,535, and batches (the trainer's runs x batch) go beyond that; axis 0
    takes 2**31 - 1 programs. Consecutive programs share a head and so its keys and values in L2.
    """
    pid = tl.program_id(0)
    n_m = tl.cdiv(heads_per_prog * Lq, BLOCK_M)
    n_h = H // heads_per_prog
    pid_m = pid % n_m
    rest = pid // n_m
    return pid_m, rest % n_h, rest // n_h


@triton.jit
def _row_tile(pid_m, pid_h, heads_per_prog, n_rep, Lq, BLOCK_M: tl.constexpr):
    """This program's rows: index ``r``, validity, query head ``hh`` and position ``i`` of each,
    the range [i_lo, i_hi] of positions they cover, and the KV head they all read."""
    head0 = pid_h * heads_per_prog
    rows_total = heads_per_prog * Lq
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    r0 = pid_m * BLOCK_M
    r1 = tl.minimum(r0 + BLOCK_M, rows_total) - 1
    # A tile spanning two heads covers positions that wrap around: take the whole range.
    same_head = (r0 // Lq) == (r1 // Lq)
    i_lo = tl.where(same_head, r0 % Lq, 0)
    i_hi = tl.where(same_head, r1 % Lq, Lq - 1)
    hh = head0 + r // Lq
    return r, r < rows_total, hh, r % Lq, i_lo, i_hi, head0 // n_rep


@triton.jit
def _key_length(KL, b, Lk, HAS_KL: tl.constexpr):
    """Key length of batch element ``b``, clamped to [0, Lk]: callers validate key_lengths, but a
    value out of range must never make a kernel read outside k and v."""
    if HAS_KL:
        return tl.minimum(tl.maximum(tl.load(KL + b), 0), Lk)
    return Lk


@triton.jit
def _last_visible_key(i, lk_b, Lq, CAUSAL: tl.constexpr):
    """Per row, the last key it sees (bottom-right causal alignment)."""
    if CAUSAL:
        return i + lk_b - Lq
    return i * 0 + lk_b - 1


@triton.jit
def _idx(x, IDX64: tl.constexpr):
    """Element offsets inside one batch element in 32 bits, unless the launcher found a tensor
    whose batch element spans 2**31 elements or more (IDX64). Batch offsets are always 64-bit;
    32-bit offsets halve the registers a tile of addresses takes."""
    if IDX64:
        return x.to(tl.int64)
    return x


@triton.jit
def _tile_ptrs(base, row_off, BLOCK: tl.constexpr):
    """Pointers to a (rows, BLOCK) tile: row r starts at ``base + row_off[r]``, columns are unit-stride."""
    return base + row_off[:, None] + tl.arange(0, BLOCK)[None, :]


@triton.jit
def _load_tile(base, row_off, row_ok, COLS: tl.constexpr, BLOCK: tl.constexpr, ROW_MASK: tl.constexpr):
    """A (rows, BLOCK) tile of a slab with COLS columns, zero outside. Masks only what can be out
    of range: the columns when COLS < BLOCK (padded head dims), the rows when ROW_MASK (a key
    block wholly inside the visible keys needs none)."""
    ptrs = _tile_ptrs(base, row_off, BLOCK)
    cols = tl.arange(0, BLOCK)
    if ROW_MASK:
        if COLS < BLOCK:
            x = tl.load(ptrs, mask=row_ok[:, None] & (cols[None, :] < COLS), other=0.0)
        else:
            x = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    else:
        if COLS < BLOCK:
            x = tl.load(ptrs, mask=cols[None, :] < COLS, other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _store_tile(base, row_off, row_ok, x, COLS: tl.constexpr, BLOCK: tl.constexpr):
    ptrs = _tile_ptrs(base, row_off, BLOCK)
    cols = tl.arange(0, BLOCK)
    if COLS < BLOCK:
        tl.store(ptrs, x, mask=row_ok[:, None] & (cols[None, :] < COLS))
    else:
        tl.store(ptrs, x, mask=row_ok[:, None])


@triton.jit
def _load_rows(base, hh, i, stride_h, stride_m, row_ok, DIM: tl.constexpr, BLOCK: tl.constexpr,
               IDX64: tl.constexpr):
    """Rows (hh, i) of a (heads, length, DIM) slab, zero-padded to BLOCK columns."""
    return _load_tile(base, _idx(hh, IDX64) * stride_h + _idx(i, IDX64) * stride_m, row_ok, DIM, BLOCK, True)


@triton.jit
def _key_range(i_lo, i_hi, lk_b, Lq, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys [0, full) are visible to every row of the tile; [full, hi) need the mask."""
    if CAUSAL:
        hi = tl.minimum(lk_b, tl.maximum(i_hi + lk_b - Lq + 1, 0))
        full = tl.minimum(lk_b, tl.maximum(i_lo + lk_b - Lq + 1, 0))
    else:
        hi = lk_b
        full = lk_b
    full = (full // BLOCK_N) * BLOCK_N
    return full, hi


@triton.jit
def _diag(i, lk_b, Lq, TOP_LEFT: tl.constexpr):
    """Per row, the key on its causal diagonal: ``i + off`` (docs/contract.md, "Visibility")."""
    if TOP_LEFT:
        return i
    return i + lk_b - Lq


@triton.jit
def _band(i, lk_b, Lq, win_l, win_r, TOP_LEFT: tl.constexpr):
    """Per row, the first and last key of its band ``[i + off - L, i + off + R]`` (BAND mode;
    not clipped to [0, lk_b): callers test ``j < lk_b`` anyway)."""
    d = _diag(i, lk_b, Lq, TOP_LEFT)
    return d - win_l, d + win_r


@triton.jit
def _band_key_range(i_lo, i_hi, lk_b, Lq, win_l, win_r, TOP_LEFT: tl.constexpr, BLOCK_N: tl.constexpr):
    """(start, full_lo, full_hi, stop) for a row tile of positions [i_lo, i_hi] in BAND mode:
    keys [start, full_lo) and [full_hi, stop) need the mask, [full_lo, full_hi) are seen by every
    row of the tile, keys outside [start, stop) by none. start, full_lo, full_hi are multiples
    of BLOCK_N. Both band edges grow with i, so the tile's first and last rows bound them."""
    kmin_lo, kmax_lo = _band(i_lo, lk_b, Lq, win_l, win_r, TOP_LEFT)
    kmin_hi, kmax_hi = _band(i_hi, lk_b, Lq, win_l, win_r, TOP_LEFT)
    stop = tl.minimum(lk_b, tl.maximum(kmax_hi + 1, 0))
    start = (tl.maximum(kmin_lo, 0) // BLOCK_N) * BLOCK_N
    full_hi = (tl.minimum(lk_b, tl.maximum(kmax_lo + 1, 0)) // BLOCK_N) * BLOCK_N
    full_lo = ((tl.maximum(kmin_hi, 0) + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    full_hi = tl.maximum(full_hi, start)
    full_lo = tl.minimum(tl.maximum(full_lo, start), full_hi)
    return start, full_lo, full_hi, stop


@triton.jit
def _mask_scores(s, ptrs, ld_mask, MASK_KIND: tl.constexpr):
    """Apply attn_mask to a tile of scaled scores: (scores, visible-by-the-mask).

    Bool (stored as bytes): hidden where 0. Float: the bias is added, and a -inf bias hides the
    pair whatever the score (a NaN score plus -inf must not leak). Out-of-range entries
    (``ld_mask`` False) read as hidden."""
    if MASK_KIND == 1:
        mv = tl.load(ptrs, mask=ld_mask, other=0)
        mvis = mv != 0
        s = tl.where(mvis, s, float("-inf"))
    else:
        bias = tl.load(ptrs, mask=ld_mask, other=float("-inf")).to(tl.float32)
        mvis = bias != float("-inf")
        s = tl.where(mvis, s + bias, float("-inf"))
    return s, mvis


@triton.jit
def _mix32(x):
    """lowbias32 finaliser on uint32 (docs/contract.md, "Dropout"); multiplies wrap mod 2**32."""
    x ^= x >> 16
    x = x * 0x21F0AAAD
    x ^= x >> 15
    x = x * 0x735A2D97
    x ^= x >> 15
    return x


@triton.jit
def _drop_rows(seed_lo, seed_hi, b, H, hh, i):
    """Per row (query head ``hh``, position ``i``): ``r_i`` of the contract's keep hash. The
    seed halves arrive as int32 holding the uint32 bits."""
    lo = seed_lo.to(tl.uint32, bitcast=True)
    hi = seed_hi.to(tl.uint32, bitcast=True)
    bh = (b * H + hh).to(tl.uint32)  # b is int64: (b * H + h) mod 2**32
    s_bh = _mix32(lo ^ _mix32(hi ^ bh))
    return _mix32(s_bh ^ i.to(tl.uint32))


@triton.jit
def _row_tile_modes(
    i, i_lo, i_hi, hh, b, lk_b, H, Lq, win_l, win_r, seed_lo, seed_hi, MASK, stride_mb, stride_mh, stride_mm,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, IDX64: tl.constexpr, BAND: tl.constexpr,
    TOP_LEFT: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr,
):
    """What a row tile of the forward and the dQ pass needs of the call's modes, per row and for
    the tile: (kmin, kmax) each row's first and last visible key (kmin = kmax without BAND,
    unused then), (start, full_lo, full_hi, stop) the tile's key range (_band_key_range's
    meaning; start = full_lo = 0 without BAND), the mask's scalar base and per-row offsets, and
    the rows' dropout hashes r_i (``i`` and ``MASK`` pass through where the mode is off)."""
    if BAND:
        kmin, kmax = _band(i, lk_b, Lq, win_l, win_r, TOP_LEFT)
        start, full_lo, full, hi = _band_key_range(i_lo, i_hi, lk_b, Lq, win_l, win_r, TOP_LEFT, BLOCK_N)
    else:
        kmax = _last_visible_key(i, lk_b, Lq, CAUSAL)
        kmin = kmax
        full, hi = _key_range(i_lo, i_hi, lk_b, Lq, CAUSAL, BLOCK_N)
        start = 0
        full_lo = 0
    # The mask's address splits into a scalar base and per-element offsets (int32 unless IDX64),
    # so that no (rows x keys) tile of 64-bit pointers stays live across the loop.
    m_base = MASK
    m_off = i
    if MASK_KIND != 0:
        m_base = MASK + b * stride_mb
        m_off = _idx(hh, IDX64) * stride_mh + _idx(i, IDX64) * stride_mm
    r_drop = i
    if DROPOUT:
        r_drop = _drop_rows(seed_lo, seed_hi, b, H, hh, i)
    return kmin, kmax, start, full_lo, full, hi, m_base, m_off, r_drop


@triton.jit
def _keep(r_i, j, drop_thr):
    """Keep bits of the (rows, keys) tile given per-row ``r_i`` and per-key ``j`` laid out for
    broadcasting (``r_i[:, None]`` and ``j[None, :]`` or transposed)."""
    return _mix32(r_i + j.to(tl.uint32)) >= drop_thr.to(tl.uint32, bitcast=True)


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, start, stop, kmax, lk_b, sm_scale,
    kmin, m_base, m_off, stride_mn, row_ok, r_drop, drop_thr,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, PREC: tl.constexpr, IDX64: tl.constexpr,
    BAND: tl.constexpr = False, MASK_KIND: tl.constexpr = 0, DROPOUT: tl.constexpr = False,
):
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(start, stop, BLOCK_N):
        offs_n = start_n + offs_n0
        key_ok = offs_n < lk_b
        k = _load_tile(k_base, _idx(offs_n, IDX64) * stride_kn, key_ok, D, BLOCK_D, MASKED)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * sm_scale
        if MASK_KIND != 0:
            ptrs = m_base + (m_off[:, None] + _idx(offs_n, IDX64)[None, :] * stride_mn)
            if MASKED:
                s, mvis = _mask_scores(s, ptrs, row_ok[:, None] & key_ok[None, :], MASK_KIND)
            else:
                s, mvis = _mask_scores(s, ptrs, row_ok[:, None], MASK_KIND)
        if MASKED:
            vis = key_ok[None, :] & (offs_n[None, :] <= kmax[:, None])
            if BAND:
                vis = vis & (offs_n[None, :] >= kmin[:, None])
            s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet keeps m = -inf; shift by 0 there so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2((s - m_safe[:, None]) * 1.4426950408889634)
        alpha = tl.math.exp2((m_i - m_safe) * 1.4426950408889634)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_tile(v_base, _idx(offs_n, IDX64) * stride_vn, key_ok, DV, BLOCK_DV, MASKED)
        if MASK_KIND != 0:
            # Values of keys that no row of the tile sees (a masked column, or outside every
            # row's band) become 0, so that a NaN there cannot reach the output through 0 * NaN.
            seen_t = mvis
            if MASKED:
                seen_t = seen_t & vis
            seen_any = tl.max(seen_t.to(tl.int32), 0) > 0
            v = tl.where(seen_any[:, None], v, 0.0)
        elif BAND and MASKED:
            # The same for the band alone, from the tile's outermost band edges: cheaper than a
            # reduction over the tile, which costs this variant its registers.
            seen_any = (offs_n >= tl.min(kmin, 0)) & (offs_n <= tl.max(kmax, 0)) & key_ok
            v = tl.where(seen_any[:, None], v, 0.0)
        if DROPOUT:
            p = tl.where(_keep(r_drop[:, None], offs_n[None, :], drop_thr), p, 0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_body(
    Q, K, V, O, LSE, KL, MASK,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    stride_mb, stride_mh, stride_mm, stride_mn,
    H, Lq, Lk, n_rep, heads_per_prog, sm_scale,
    win_l, win_r, seed_lo, seed_hi, drop_thr, drop_scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_KL: tl.constexpr, PREC: tl.constexpr, IDX64: tl.constexpr,
    BAND: tl.constexpr = False, TOP_LEFT: tl.constexpr = False, MASK_KIND: tl.constexpr = 0,
    DROPOUT: tl.constexpr = False, split=0, num_splits=1, SPLIT: tl.constexpr = False,
):
    pid_m, pid_h, b = _unfold_rows_grid(H, Lq, heads_per_prog, BLOCK_M)
    b = b.to(tl.int64)
    r, row_ok, hh, i, i_lo, i_hi, kvh = _row_tile(pid_m, pid_h, heads_per_prog, n_rep, Lq, BLOCK_M)
    lk_b = _key_length(KL, b, Lk, HAS_KL)
    q = _load_rows(Q + b * stride_qb, hh, i, stride_qh, stride_qm, row_ok, D, BLOCK_D, IDX64)
    k_base = K + b * stride_kb + kvh.to(tl.int64) * stride_kh
    v_base = V + b * stride_vb + kvh.to(tl.int64) * stride_vh
    kmin, kmax, start, full_lo, full, hi, m_base, m_off, r_drop = _row_tile_modes(
        i, i_lo, i_hi, hh, b, lk_b, H, Lq, win_l, win_r, seed_lo, seed_hi, MASK, stride_mb, stride_mh, stride_mm,
        BLOCK_N, CAUSAL, IDX64, BAND, TOP_LEFT, MASK_KIND, DROPOUT)
    if SPLIT:
        # Split-K (plain calls only, so start = full_lo = 0 here): this program takes the split-th
        # of num_splits equal shares of the tile's key blocks [0, hi), unmasked up to `full` as
        # before. A share past the tile's last key is empty: l stays 0 and its lse -inf.
        per = tl.cdiv(tl.cdiv(hi, BLOCK_N), num_splits) * BLOCK_N
        full_lo = split * per
        hi = tl.minimum(hi, full_lo + per)
        full = tl.maximum(tl.minimum(full, hi), full_lo)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    if BAND:
        # Left boundary of the band (its blocks all precede the fully visible ones).
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, start, full_lo, kmax, lk_b, sm_scale,
            kmin, m_base, m_off, stride_mn, row_ok, r_drop, drop_thr,
            D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, True, PREC, IDX64, BAND, MASK_KIND, DROPOUT,
        )
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, full_lo, full, kmax, lk_b, sm_scale,
        kmin, m_base, m_off, stride_mn, row_ok, r_drop, drop_thr,
        D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, False, PREC, IDX64, BAND, MASK_KIND, DROPOUT,
    )
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, full, hi, kmax, lk_b, sm_scale,
        kmin, m_base, m_off, stride_mn, row_ok, r_drop, drop_thr,
        D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, True, PREC, IDX64, BAND, MASK_KIND, DROPOUT,
    )
    # l = 0 exactly when the row saw no key (a seen key adds exp2(0) = 1); a NaN l (a NaN among
    # the visible scores) must stay NaN in out and lse, so test "!= 0", not "> 0".
    seen = l_i != 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    if DROPOUT:
        out = acc * (drop_scale / l_safe)[:, None]
    else:
        out = acc / l_safe[:, None]
    lse = tl.where(seen, m_i + tl.log(l_safe), float("-inf"))
    _store_tile(O + b * stride_ob, _idx(hh, IDX64) * stride_oh + _idx(i, IDX64) * stride_om, row_ok,
                out.to(O.dtype.element_ty), DV, BLOCK_DV)
    tl.store(LSE + (b * H + hh) * Lq + i, lse, mask=row_ok)


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, O, LSE, KL, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, H, Lq, Lk, n_rep,
    heads_per_prog, sm_scale, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_KL: tl.constexpr, PREC: tl.constexpr, IDX64: tl.constexpr,
):
    """The forward without optional modes: the body with every mode flag off (its code and
    parameters are the plain kernel's, which kernels/aot.py builds)."""
    _attn_fwd_body(
        Q, K, V, O, LSE, KL, LSE, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, 0, 0, 0, 0, H, Lq, Lk, n_rep,
        heads_per_prog, sm_scale, 0, 0, 0, 0, 0, 1.0, D, DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, CAUSAL,
        HAS_KL, PREC, IDX64, BAND=False, TOP_LEFT=False, MASK_KIND=0, DROPOUT=False,
    )


@triton.jit
def _attn_fwd_split_kernel(
    Q, K, V, OP, LSEP, KL, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_os, stride_ob, stride_oh, stride_om, stride_ls, H, Lq, Lk,
    n_rep, heads_per_prog, sm_scale, num_splits, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_KL: tl.constexpr, PREC: tl.constexpr, IDX64: tl.constexpr,
):
    """The plain forward split over the keys (grid axis 1: the split): each program writes its
    share's normalised fp32 output and lse into OP (S, B, H, Lq, DV) and LSEP (S, B, H, Lq),
    which the launcher merges through their lse."""
    split = tl.program_id(1)
    _attn_fwd_body(
        Q, K, V, OP + split.to(tl.int64) * stride_os, LSEP + split.to(tl.int64) * stride_ls, KL, LSEP,
        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, 0, 0, 0, 0, H, Lq, Lk, n_rep,
        heads_per_prog, sm_scale, 0, 0, 0, 0, 0, 1.0, D, DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, CAUSAL,
        HAS_KL, PREC, IDX64, BAND=False, TOP_LEFT=False, MASK_KIND=0, DROPOUT=False,
        split=split, num_splits=num_splits, SPLIT=True,
    )


@triton.jit(do_not_specialize=["win_l", "win_r", "seed_lo", "seed_hi", "drop_thr"])
def _attn_fwd_modes_kernel(
    Q, K, V, O, LSE, KL, MASK, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, stride_mb, stride_mh,
    stride_mm, stride_mn, H, Lq, Lk, n_rep, heads_per_prog, sm_scale, win_l, win_r, seed_lo,
    seed_hi, drop_thr, drop_scale, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_KL: tl.constexpr, PREC: tl.constexpr, IDX64: tl.constexpr, BAND: tl.constexpr = False,
    TOP_LEFT: tl.constexpr = False, MASK_KIND: tl.constexpr = 0, DROPOUT: tl.constexpr = False,
):
    """The forward with optional modes (flags as constexprs; see the module docstring)."""
    _attn_fwd_body(
        Q, K, V, O, LSE, KL, MASK, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, stride_mb, stride_mh, stride_mm,
        stride_mn, H, Lq, Lk, n_rep, heads_per_prog, sm_scale, win_l, win_r, seed_lo, seed_hi, drop_thr,
        drop_scale, D, DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, CAUSAL, HAS_KL, PREC, IDX64, BAND=BAND,
        TOP_LEFT=TOP_LEFT, MASK_KIND=MASK_KIND, DROPOUT=DROPOUT,
    )



def precision(dtype: torch.dtype) -> str:
    """fp32 inputs multiply in full fp32 ("ieee"), never silently in tf32: exactness first."""
    return "ieee" if dtype == torch.float32 else "tf32"


MAX_PROGRAMS = 2**31 - 1  # CUDA's limit on grid axis 0, which carries every launch here


def needs_64bit_offsets(*tensors) -> bool:
    """Whether some tensor's batch element spans 2**31 elements or more, so that offsets inside
    one batch element (what the kernels compute per row) need 64 bits."""
    for t in tensors:
        if t.dim() and sum((n - 1) * abs(st) for n, st in zip(t.shape[1:], t.stride()[1:]) if n > 0) >= 2**31 - 1:
            return True
    return False


_ARCH = {}
_SMS = {}
_FORCED_SPLITS = 0


def force_splits(n: int) -> int:
    """Test hook: split every plain forward into ``n`` key splits (0: planned); returns the
    previous setting. Under the interpreter the planner never splits (no multiprocessors to fill)."""
    global _FORCED_SPLITS
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_SPLITS:
        raise ValueError(f"force_splits: n must be an int in [0, {MAX_SPLITS}] (0: planned), got {n!r}")
    prev, _FORCED_SPLITS = _FORCED_SPLITS, n
    return prev


def num_sms_of(t: torch.Tensor) -> int:
    """Multiprocessors of ``t``'s device, cached; 0 off CUDA (nothing to fill)."""
    if t.device.type != "cuda":
        return 0
    idx = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def fwd_splits(q: torch.Tensor, Lk: int, Dv: int, programs: int, block_n: int) -> int:
    """Key splits of a plain forward (the hook's count when forced, else heuristics' plan)."""
    if _FORCED_SPLITS:
        return _FORCED_SPLITS
    B, H, Lq = q.shape[0], q.shape[1], q.shape[2]
    return plan_fwd_splits(programs, triton.cdiv(Lk, block_n), B * H * Lq, Dv, num_sms_of(q))


def arch_of(t: torch.Tensor) -> int:
    """Compute capability of ``t``'s device as an int (90 for sm_90), cached; 80 off CUDA (the
    interpreter), which only picks the tile table's row."""
    if t.device.type != "cuda":
        return 80
    idx = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if idx not in _ARCH:
        major, minor = torch.cuda.get_device_capability(idx)
        _ARCH[idx] = 10 * major + minor
    return _ARCH[idx]


def launch_geometry(B: int, H: int, Hkv: int, Lq: int, block_m: int):
    """(heads per program, row tile, grid) of the forward and dQ kernels: a flat grid of
    row tiles x head groups x batch elements (see ``_unfold_rows_grid``)."""
    n_rep = H // Hkv
    hpp = packed_rows(Lq, n_rep, block_m)
    bm = row_block(hpp * Lq, block_m)
    grid = (triton.cdiv(hpp * Lq, bm) * (H // hpp) * B,)
    return hpp, bm, grid


def on_device(t: torch.Tensor):
    """Make ``t``'s device current for a launch: Triton launches on the current device and its
    current stream, so without this a tensor on cuda:1 while cuda:0 is current would be read
    from the wrong device (the CUDA host code holds a CUDAGuard for the same reason)."""
    if t.device.type == "cuda":
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def check_buffer(name: str, t: torch.Tensor, shape, dtype, like: torch.Tensor, contiguous: bool = False):
    """Refuse an output buffer the kernels cannot write as given (launchers take the buffers
    their caller allocates)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != like.device:
        raise ValueError(
            f"{name}: expected a {dtype} tensor of shape {tuple(shape)} on {like.device}, "
            f"got {t.dtype} {tuple(t.shape)} on {t.device}"
        )
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: expected unit stride on the last dim, got strides {t.stride()}")


class ModeArgs:
    """The launch arguments of the optional modes (docs/contract.md), shared by the forward and
    backward launchers: what the kernels read at run time and the constexpr flags that select
    their variant. The plain call gives BAND, TOP_LEFT, MASK_KIND, DROPOUT all off."""

    def __init__(self, Lq: int, Lk: int, causal: bool, attn_mask, dropout_p: float, seed: int,
                 top_left: bool, window_left: int, window_right: int):
        self.band = bool(top_left) or window_left >= 0 or window_right >= 0
        self.top_left = bool(top_left) and self.band
        # An unbounded side becomes Lq + Lk, wider than any row can reach, and bounded sides are
        # capped there too, so that i + off +- L, R stays far inside int32.
        big = Lq + Lk
        self.win_l = big if window_left < 0 else min(int(window_left), big)
        win_r = big if window_right < 0 else min(int(window_right), big)
        self.win_r = min(win_r, 0) if causal else win_r  # causal is the band's right edge at 0
        self.mask = attn_mask
        self.mask_kind = 0
        self.mask_strides = (0, 0, 0, 0)
        if attn_mask is not None:
            if attn_mask.dim() != 4:
                raise ValueError(f"attn_mask: expected a 4-D (B, H, Lq, Lk) view, got {attn_mask.dim()}-D")
            if attn_mask.dtype == torch.bool:
                self.mask_kind = 1
                self.mask = attn_mask.view(torch.uint8)  # same bytes and strides; loads compare with 0
            elif attn_mask.dtype == torch.float32:
                self.mask_kind = 2
            else:
                raise ValueError(f"attn_mask: expected bool or float32, got {attn_mask.dtype}")
            self.mask_strides = tuple(attn_mask.stride())
        if not 0.0 <= dropout_p < 1.0:
            raise ValueError(f"dropout_p: expected 0 <= p < 1, got {dropout_p}")
        self.dropout = dropout_p > 0.0
        thr = min(int(dropout_p * 4294967296.0), 0xFFFFFFFF)
        seed = int(seed)
        # uint32 values travel as int32 with the same bits (the kernels bitcast them back).
        self.seed_lo, self.seed_hi, self.drop_thr = (
            _as_i32(x) for x in (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, thr))
        self.drop_scale = 1.0 / (1.0 - dropout_p)

    def any(self) -> bool:
        """Whether some mode is on (the launch takes the modes kernel, not the plain one)."""
        return self.band or self.mask_kind != 0 or self.dropout

    def runtime(self):
        return (self.win_l, self.win_r, self.seed_lo, self.seed_hi, self.drop_thr, self.drop_scale)

    def constexprs(self):
        return dict(BAND=self.band, TOP_LEFT=self.top_left, MASK_KIND=self.mask_kind, DROPOUT=self.dropout)


def tile_modes(modes: "ModeArgs") -> dict:
    """The modes that choose a launch's tile (heuristics.tile_config's keywords): the table in
    heuristics.py narrows the plain tile for them, per architecture."""
    return dict(band=modes.band, mask_kind=modes.mask_kind, dropout=modes.dropout)


def _as_i32(x: int) -> int:
    return x - (1 << 32) if x >= (1 << 31) else x


def attention_forward(q, k, v, out, lse, scale: float, causal: bool, key_lengths=None, *, attn_mask=None,
                      dropout_p: float = 0.0, seed: int = 0, top_left: bool = False, window_left: int = -1,
                      window_right: int = -1):
    """Launch the forward kernel into the caller's buffers; returns ``(out, lse)``.

    Shapes: q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv); out (B, H, Lq, Dv) in q's
    dtype, any strides with a unit last one; lse contiguous float32 (B, H, Lq), written in
    natural log, -inf on rows that see no key. key_lengths: None or int32 (B,) on q's device.
    Modes (docs/contract.md): attn_mask None or a (B, H, Lq, Lk) view (bool, or float32 bias;
    stride 0 on broadcast dims is read as such), dropout_p in [0, 1) with the 64-bit seed,
    top_left alignment, window_left / window_right (-1 unbounded).
    """
    B, H, Lq, D = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    modes = ModeArgs(Lq, Lk, causal, attn_mask, dropout_p, seed, top_left, window_left, window_right)
    cfg = fwd_config(D, Dv, q.dtype, arch_of(q), **tile_modes(modes))
    hpp, bm, grid = launch_geometry(B, H, Hkv, Lq, cfg.block_m)
    # Few row tiles over long keys (decode): split the keys across programs (plain calls only).
    splits = 1 if modes.any() else fwd_splits(q, Lk, Dv, grid[0], cfg.block_n)
    # sm_90 without modes: TMA through tensor descriptors (the predicate refuses any mode), unless
    # the call is split (one program per row tile would leave most multiprocessors idle).
    if splits == 1 and desc_eligible(q, k, v, out, attn_mask=attn_mask, dropout_p=dropout_p, top_left=top_left,
                                     window_left=window_left, window_right=window_right):
        from .attention_fwd_desc import desc_forward
        return desc_forward(q, k, v, out, lse, scale, causal, key_lengths)
    check_buffer("out", out, (B, H, Lq, Dv), q.dtype, q)
    check_buffer("lse", lse, (B, H, Lq), torch.float32, q, contiguous=True)
    kl = key_lengths if key_lengths is not None else lse  # unused pointer when HAS_KL is False
    mask = modes.mask if modes.mask is not None else lse  # unused pointer when MASK_KIND is 0
    common = dict(
        D=D, DV=Dv, BLOCK_D=head_block(D), BLOCK_DV=head_block(Dv), BLOCK_M=bm, BLOCK_N=cfg.block_n,
        CAUSAL=causal, HAS_KL=key_lengths is not None, PREC=precision(q.dtype),
        IDX64=needs_64bit_offsets(q, k, v, out, *(() if attn_mask is None else (attn_mask,))),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    with on_device(q):
        if splits > 1:
            _split_forward(q, k, v, out, lse, kl, scale, splits, hpp, grid, common)
        elif not modes.any():
            _attn_fwd_kernel[grid](
                q, k, v, out, lse, kl,
                q.stride(0), q.stride(1), q.stride(2),
                k.stride(0), k.stride(1), k.stride(2),
                v.stride(0), v.stride(1), v.stride(2),
                out.stride(0), out.stride(1), out.stride(2),
                H, Lq, Lk, H // Hkv, hpp, scale, **common,
            )
        else:
            _attn_fwd_modes_kernel[grid](
                q, k, v, out, lse, kl, mask,
                q.stride(0), q.stride(1), q.stride(2),
                k.stride(0), k.stride(1), k.stride(2),
                v.stride(0), v.stride(1), v.stride(2),
                out.stride(0), out.stride(1), out.stride(2),
                *modes.mask_strides,
                H, Lq, Lk, H // Hkv, hpp, scale,
                *modes.runtime(), **modes.constexprs(), **common,
            )
    return out, lse


def _split_forward(q, k, v, out, lse, kl, scale, splits, hpp, grid, common):
    """The plain forward over ``splits`` key shares (grid axis 1), then their merge: with
    lse_s and o_s the shares' (normalised) results, lse = log sum_s exp(lse_s) and
    out = sum_s exp(lse_s - lse) o_s; a share that saw no key (lse_s = -inf) weighs 0, a row
    that saw none gets 0 and -inf, and a NaN lse_s stays NaN in both."""
    B, H, Lq = q.shape[0], q.shape[1], q.shape[2]
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    op = torch.empty((splits, B, H, Lq, Dv), device=q.device, dtype=torch.float32)
    lsep = torch.empty((splits, B, H, Lq), device=q.device, dtype=torch.float32)
    _attn_fwd_split_kernel[(grid[0], splits)](
        q, k, v, op, lsep, kl,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        op.stride(0), op.stride(1), op.stride(2), op.stride(3), lsep.stride(0),
        H, Lq, Lk, H // Hkv, hpp, scale, splits, **common,
    )
    total = torch.logsumexp(lsep, dim=0)
    w = torch.where(torch.isneginf(lsep), 0.0, torch.exp(lsep - total))
    out.copy_((w.unsqueeze(-1) * op).sum(0))
    lse.copy_(total)


__all__ = ["attention_forward", "force_splits", "fwd_splits", "ModeArgs", "tile_modes", "launch_geometry", "precision", "on_device", "check_buffer", "MAX_PROGRAMS",
           "needs_64bit_offsets", "arch_of"]
