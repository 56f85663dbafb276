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
* ``DROPOUT``: the contract's counter hash (``mix32``, lowbias32) on (seed, b, h, i, j) in
  uint32 arithmetic, h the query head; probabilities of dropped pairs leave the sum ``l`` (lse
  is that of the undropped softmax) but not the output, which takes ``1 / (1 - p)`` once at
  the end.

Score modifiers (docs/contract.md, "Score modifiers"), constexpr switches of the modes kernel
and of the split-K one (a call with only these and no mode runs the modes kernel with every
mode flag off, or the split one):

* ``SOFTCAP``: ``s = softcap * tanh(s / softcap)`` on the scaled score (tiles.tanh_f32: fp32
  to about an ulp, without libdevice);
* ``ALIBI``: ``s -= slope[b, h] * |i + off - j|`` after the cap, before the mask, with the
  row's slope read once per program.

The KV cache (docs/contract.md, "KV cache"; forward only), constexpr switches of the modes
kernel and of the split-K one, which only move where a key's row is read (positions, key
lengths, masks and the dropout hash stay logical):

* ``CACHE_IDX``: batch element ``b`` reads K/V batch row ``cache_batch_idx[b]`` (one load per
  program);
* ``PAGED``: K/V are a pool of pages (num_pages, Hkv, page_size, D), any strides; key ``j`` of
  ``b`` is row ``j % page_size`` of page ``block_table[b, j // page_size]``, gathered per key of
  each block (one block-table load per key block; a block may span pages or lie inside one,
  any page size >= 1). The key length is the logical ``pages_per_seq * page_size``, which the
  split-K plan uses too.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import attention_fwd_desc
from .heuristics import (
    MAX_SPLITS,
    desc_eligible,
    fwd_config,
    head_block,
    plan_fwd_splits,
    row_block,
)
from .launch import (
    ModeArgs,
    arch_of,
    check_buffer,
    kernel_key_length,
    launch_geometry,
    needs_64bit_offsets,
    num_sms_of,
    on_device,
    precision,
    tile_modes,
)
from .tiles import (
    alibi_rows,
    cap_inverse,
    elem_idx,
    keep_bits,
    key_length,
    load_rows,
    load_tile,
    mask_scores,
    modify_scores,
    row_tile,
    row_tile_modes,
    store_tile,
    unfold_rows_grid,
)


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, start, stop, kmax, lk_b, sm_scale,
    kmin, m_base, m_off, stride_mn, row_ok, r_drop, drop_thr,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, PREC: tl.constexpr, IDX64: tl.constexpr,
    BAND: tl.constexpr = False, MASK_KIND: tl.constexpr = 0, DROPOUT: tl.constexpr = False,
    softcap=0.0, inv_cap=0.0, slope=0.0, diag=0.0, SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False,
    bt_row=None, page_size=1, stride_kp=0, stride_vp=0, PAGED: tl.constexpr = False,
):
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(start, stop, BLOCK_N):
        offs_n = start_n + offs_n0
        key_ok = offs_n < lk_b
        if PAGED:
            # Each key's page from the block table (a block may span pages or lie inside one);
            # page offsets in 64 bits (the pool may span any size), the row inside its page as
            # before. Keys past lk_b (<= the table's logical length) read no table entry.
            if MASKED:
                pg = tl.load(bt_row + offs_n // page_size, mask=key_ok, other=0).to(tl.int64)
            else:
                pg = tl.load(bt_row + offs_n // page_size).to(tl.int64)
            slot = elem_idx(offs_n % page_size, IDX64)
            k = load_tile(k_base, pg * stride_kp + slot * stride_kn, key_ok, D, BLOCK_D, MASKED)
        else:
            k = load_tile(k_base, elem_idx(offs_n, IDX64) * stride_kn, key_ok, D, BLOCK_D, MASKED)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * sm_scale
        s, _t = modify_scores(s, softcap, inv_cap, slope, diag, offs_n, SOFTCAP, ALIBI, False)
        if MASK_KIND != 0:
            ptrs = m_base + (m_off[:, None] + elem_idx(offs_n, IDX64)[None, :] * stride_mn)
            if MASKED:
                s, mvis = mask_scores(s, ptrs, row_ok[:, None] & key_ok[None, :], MASK_KIND)
            else:
                s, mvis = mask_scores(s, ptrs, row_ok[:, None], MASK_KIND)
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
        if PAGED:
            v = load_tile(v_base, pg * stride_vp + slot * stride_vn, key_ok, DV, BLOCK_DV, MASKED)
        else:
            v = load_tile(v_base, elem_idx(offs_n, IDX64) * stride_vn, key_ok, DV, BLOCK_DV, MASKED)
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
            p = tl.where(keep_bits(r_drop[:, None], offs_n[None, :], drop_thr), p, 0.0)
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
    DROPOUT: tl.constexpr = False, split=0, num_splits=1, SPLIT: tl.constexpr = False, split_l_off=0,
    softcap=0.0, SLOPES=None, slope_sb=0, slope_sh=0, SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False,
    CUQ=None, CUK=None, Tq=0, VARLEN: tl.constexpr = False,
    CBI=None, BT=None, stride_bt=0, page_size=1, CACHE_IDX: tl.constexpr = False, PAGED: tl.constexpr = False,
):
    pid_m, pid_h, b = unfold_rows_grid(H, Lq, heads_per_prog, BLOCK_M)
    b = b.to(tl.int64)
    r, row_ok, hh, i, i_lo, i_hi, kvh = row_tile(pid_m, pid_h, heads_per_prog, n_rep, Lq, BLOCK_M)
    if VARLEN:
        # Packed sequences: b is the sequence, Lq the longest one's length (the tile grid), the
        # tensors one batch element of Tq / Lk tokens. Positions are sequence-local; a tile past
        # the sequence's end sees no key (lk_b = 0: every loop is empty, no row stored), and keys
        # past its own sequence's are never loaded (key_ok is j < lk_b, local).
        q0 = tl.load(CUQ + b)
        lq_b = tl.load(CUQ + b + 1) - q0
        k0 = tl.load(CUK + b)
        lk_b = tl.where(i_lo < lq_b, tl.load(CUK + b + 1) - k0, 0)
        row_ok = row_ok & (i < lq_b)
        i_hi = tl.minimum(i_hi, lq_b - 1)
        q0 = q0.to(tl.int64)
        k0 = k0.to(tl.int64)
        q = load_rows(Q + q0 * stride_qm, hh, i, stride_qh, stride_qm, row_ok, D, BLOCK_D, IDX64)
        k_base = K + k0 * stride_kn + kvh.to(tl.int64) * stride_kh
        v_base = V + k0 * stride_vn + kvh.to(tl.int64) * stride_vh
    else:
        # (The plain kernels' order of these statements, which their recorded SASS pins.)
        lq_b = Lq
        lk_b = key_length(KL, b, Lk, HAS_KL)
        q = load_rows(Q + b * stride_qb, hh, i, stride_qh, stride_qm, row_ok, D, BLOCK_D, IDX64)
        if CACHE_IDX:
            # KV cache: batch element b reads K/V row cache_batch_idx[b].
            kb = tl.load(CBI + b).to(tl.int64)
            k_base = K + kb * stride_kb + kvh.to(tl.int64) * stride_kh
            v_base = V + kb * stride_vb + kvh.to(tl.int64) * stride_vh
        elif PAGED:
            # Paged cache: K/V's batch dim is the page; _fwd_inner adds each key's own.
            k_base = K + kvh.to(tl.int64) * stride_kh
            v_base = V + kvh.to(tl.int64) * stride_vh
        else:
            k_base = K + b * stride_kb + kvh.to(tl.int64) * stride_kh
            v_base = V + b * stride_vb + kvh.to(tl.int64) * stride_vh
    kmin, kmax, start, full_lo, full, hi, m_base, m_off, r_drop = row_tile_modes(
        i, i_lo, i_hi, hh, b, lk_b, H, lq_b, win_l, win_r, seed_lo, seed_hi, MASK, stride_mb, stride_mh, stride_mm,
        BLOCK_N, CAUSAL, IDX64, BAND, TOP_LEFT, MASK_KIND, DROPOUT)
    # Score modifiers: 1 / softcap once per program; each row's ALiBi slope and diagonal.
    inv_cap = cap_inverse(softcap, SOFTCAP)
    slope = sm_scale
    diag = sm_scale
    if ALIBI:
        slope, diag = alibi_rows(SLOPES, slope_sb, slope_sh, b, hh, i, lk_b, lq_b, row_ok, TOP_LEFT)
    if SPLIT:
        # Split-K (no modes, so start = full_lo = 0 here): this program takes the split-th
        # of num_splits equal shares of the tile's key blocks [0, hi), unmasked up to `full` as
        # before. A share past the tile's last key is empty: l stays 0 and its lse -inf.
        per = tl.cdiv(tl.cdiv(hi, BLOCK_N), num_splits) * BLOCK_N
        full_lo = split * per
        hi = tl.minimum(hi, full_lo + per)
        full = tl.maximum(tl.minimum(full, hi), full_lo)

    bt_row = BT
    if PAGED:
        bt_row = BT + b * stride_bt
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    if BAND:
        # Left boundary of the band (its blocks all precede the fully visible ones).
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, start, full_lo, kmax, lk_b, sm_scale,
            kmin, m_base, m_off, stride_mn, row_ok, r_drop, drop_thr,
            D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, True, PREC, IDX64, BAND, MASK_KIND, DROPOUT,
            softcap, inv_cap, slope, diag, SOFTCAP, ALIBI, bt_row, page_size, stride_kb, stride_vb, PAGED,
        )
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, full_lo, full, kmax, lk_b, sm_scale,
        kmin, m_base, m_off, stride_mn, row_ok, r_drop, drop_thr,
        D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, False, PREC, IDX64, BAND, MASK_KIND, DROPOUT,
        softcap, inv_cap, slope, diag, SOFTCAP, ALIBI, bt_row, page_size, stride_kb, stride_vb, PAGED,
    )
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, full, hi, kmax, lk_b, sm_scale,
        kmin, m_base, m_off, stride_mn, row_ok, r_drop, drop_thr,
        D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, True, PREC, IDX64, BAND, MASK_KIND, DROPOUT,
        softcap, inv_cap, slope, diag, SOFTCAP, ALIBI, bt_row, page_size, stride_kb, stride_vb, PAGED,
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
    if VARLEN:
        store_tile(O + q0 * stride_om, elem_idx(hh, IDX64) * stride_oh + elem_idx(i, IDX64) * stride_om, row_ok,
                   out.to(O.dtype.element_ty), DV, BLOCK_DV)
        tl.store(LSE + hh.to(tl.int64) * Tq + q0 + i, lse, mask=row_ok)
    elif SPLIT:
        # A share's m and l, apart, for the launcher's merge: its lse m + log(l), rounded to
        # float32, would be off by u * |m|, an error in every share's weight that grows with the
        # logits (docs/contract.md, "Tolerance rule"), where m - max(m) is exact near the max.
        store_tile(O + b * stride_ob, elem_idx(hh, IDX64) * stride_oh + elem_idx(i, IDX64) * stride_om, row_ok,
                   out.to(O.dtype.element_ty), DV, BLOCK_DV)
        tl.store(LSE + (b * H + hh) * Lq + i, m_i, mask=row_ok)
        tl.store(LSE + split_l_off + (b * H + hh) * Lq + i, l_i, mask=row_ok)
    else:
        store_tile(O + b * stride_ob, elem_idx(hh, IDX64) * stride_oh + elem_idx(i, IDX64) * stride_om, row_ok,
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
    parameters are the plain kernel's, which mhakern/kernels/aot.py builds)."""
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
    n_rep, heads_per_prog, sm_scale, num_splits, softcap, SLOPES, slope_sb, slope_sh, D: tl.constexpr,
    DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_KL: tl.constexpr, PREC: tl.constexpr,
    IDX64: tl.constexpr, SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False,
    CBI=None, BT=None, stride_bt=0, page_size=1, CACHE_IDX: tl.constexpr = False, PAGED: tl.constexpr = False,
):
    """The forward without modes split over the keys (grid axis 1: the split): each program
    writes its share's normalised fp32 output into OP (S, B, H, Lq, DV) and its running max m
    and sum l into LSEP (2, S, B, H, Lq) (m in LSEP[0], l in LSEP[1]), which the launcher
    merges. The score modifiers (SOFTCAP,
    ALIBI) apply per score, so a split call may carry them, and so may the KV cache (CACHE_IDX,
    PAGED: as in the modes kernel)."""
    split = tl.program_id(1)
    _attn_fwd_body(
        Q, K, V, OP + split.to(tl.int64) * stride_os, LSEP + split.to(tl.int64) * stride_ls, KL, LSEP,
        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, 0, 0, 0, 0, H, Lq, Lk, n_rep,
        heads_per_prog, sm_scale, 0, 0, 0, 0, 0, 1.0, D, DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, CAUSAL,
        HAS_KL, PREC, IDX64, BAND=False, TOP_LEFT=False, MASK_KIND=0, DROPOUT=False,
        split=split, num_splits=num_splits, SPLIT=True, split_l_off=num_splits * stride_ls,
        softcap=softcap, SLOPES=SLOPES, slope_sb=slope_sb, slope_sh=slope_sh, SOFTCAP=SOFTCAP, ALIBI=ALIBI,
        CBI=CBI, BT=BT, stride_bt=stride_bt, page_size=page_size, CACHE_IDX=CACHE_IDX, PAGED=PAGED,
    )


@triton.jit(do_not_specialize=["win_l", "win_r", "seed_lo", "seed_hi", "drop_thr"])
def _attn_fwd_modes_kernel(
    Q, K, V, O, LSE, KL, MASK, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, stride_mb, stride_mh,
    stride_mm, stride_mn, H, Lq, Lk, n_rep, heads_per_prog, sm_scale, win_l, win_r, seed_lo,
    seed_hi, drop_thr, drop_scale, softcap, SLOPES, slope_sb, slope_sh, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_KL: tl.constexpr, PREC: tl.constexpr, IDX64: tl.constexpr,
    BAND: tl.constexpr = False, TOP_LEFT: tl.constexpr = False, MASK_KIND: tl.constexpr = 0,
    DROPOUT: tl.constexpr = False, SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False,
    CUQ=None, CUK=None, Tq=0, VARLEN: tl.constexpr = False,
    CBI=None, BT=None, stride_bt=0, page_size=1, CACHE_IDX: tl.constexpr = False, PAGED: tl.constexpr = False,
):
    """The forward with optional modes and score modifiers (flags as constexprs; see the module
    docstring). VARLEN: packed sequences (CUQ, CUK their int32 prefix sums, Tq the packed query
    length, Lq the longest sequence's; B = 1 and the grid's batch axis is the sequence).
    The KV cache (Lk the logical key length): CACHE_IDX, batch element b reads K/V row CBI[b]
    (int32 (B,)); PAGED, K/V are (num_pages, Hkv, page_size, D) with the batch strides the
    page's, and key j of b is row j % page_size of page BT[b * stride_bt + j // page_size]."""
    _attn_fwd_body(
        Q, K, V, O, LSE, KL, MASK, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, stride_mb, stride_mh, stride_mm,
        stride_mn, H, Lq, Lk, n_rep, heads_per_prog, sm_scale, win_l, win_r, seed_lo, seed_hi, drop_thr,
        drop_scale, D, DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, CAUSAL, HAS_KL, PREC, IDX64, BAND=BAND,
        TOP_LEFT=TOP_LEFT, MASK_KIND=MASK_KIND, DROPOUT=DROPOUT,
        softcap=softcap, SLOPES=SLOPES, slope_sb=slope_sb, slope_sh=slope_sh, SOFTCAP=SOFTCAP, ALIBI=ALIBI,
        CUQ=CUQ, CUK=CUK, Tq=Tq, VARLEN=VARLEN,
        CBI=CBI, BT=BT, stride_bt=stride_bt, page_size=page_size, CACHE_IDX=CACHE_IDX, PAGED=PAGED,
    )


_FORCED_SPLITS = 0


def force_splits(n: int) -> int:
    """Test hook: split every plain forward into ``n`` key splits (0: planned); returns the
    previous setting. Under the interpreter the planner never splits (no multiprocessors to fill)."""
    global _FORCED_SPLITS
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_SPLITS:
        raise ValueError(f"force_splits: n must be an int in [0, {MAX_SPLITS}] (0: planned), got {n!r}")
    prev, _FORCED_SPLITS = _FORCED_SPLITS, n
    return prev


def fwd_splits(q: torch.Tensor, Lk: int, Dv: int, programs: int, block_n: int) -> int:
    """Key splits of a plain forward (the hook's count when forced, else heuristics' plan)."""
    if _FORCED_SPLITS:
        return _FORCED_SPLITS
    B, H, Lq = q.shape[0], q.shape[1], q.shape[2]
    return plan_fwd_splits(programs, triton.cdiv(Lk, block_n), B * H * Lq, Dv, num_sms_of(q))


def attention_forward(q, k, v, out, lse, scale: float, causal: bool, key_lengths=None, modes=None):
    """Launch the forward kernel into the caller's buffers; returns ``(out, lse)``.

    Shapes: q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv); out (B, H, Lq, Dv) in q's
    dtype, any strides with a unit last one; lse contiguous float32 (B, H, Lq), written in
    natural log, -inf on rows that see no key. key_lengths: None or int32 (B,) on q's device.
    ``modes``: the call's record (``mhakern.backends.Modes``; None: the plain call), read as
    :class:`.launch.ModeArgs` says: attn_mask None or a (B, H, Lq, Lk) view (bool, or float32
    bias; stride 0 on broadcast dims is read as such), dropout_p in [0, 1) with the 64-bit seed,
    top_left alignment, the window's left and right sizes (-1 unbounded), softcap (0 off), alibi_slopes
    None or a float32 (B, H) view; the KV cache: cache_batch_idx None or int32 (B,) (k, v then
    (B_cache, Hkv, Lk, D*)), or block_table None or int32 (B, pages_per_seq) (k, v then pages
    (num_pages, Hkv, page_size, D*), Lk = pages_per_seq * page_size); their values in range
    are the caller's to check. Never through the descriptor kernel; split-K as a plain call.
    """
    B, H, Lq, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[3]
    if getattr(modes, "cu_seqlens_q", None) is not None:
        return _varlen_forward(q, k, v, out, lse, scale, causal, key_lengths, modes)
    Lk = kernel_key_length(modes, k)
    margs = ModeArgs(B, H, Lq, Lk, causal, modes, q.device)
    cfg = fwd_config(D, Dv, q.dtype, arch_of(q), **tile_modes(margs))
    hpp, bm, grid = launch_geometry(B, H, Hkv, Lq, cfg.block_m)
    # Few row tiles over long keys (decode): split the keys across programs (no modes; the score
    # modifiers apply per score, and the KV cache only moves the rows, so they may split; a
    # paged cache's split is planned over its logical length).
    splits = 1 if margs.any() else fwd_splits(q, Lk, Dv, grid[0], cfg.block_n)
    # sm_90 without modes, modifiers or cache: TMA through tensor descriptors, unless the call
    # is split (one program per row tile would leave most multiprocessors idle).
    plain = not margs.any() and not margs.modified() and not margs.cached()
    if splits == 1 and desc_eligible(q, k, v, out, plain=plain):
        return attention_fwd_desc.desc_forward(q, k, v, out, lse, scale, causal, key_lengths)
    check_buffer("out", out, (B, H, Lq, Dv), q.dtype, q)
    check_buffer("lse", lse, (B, H, Lq), torch.float32, q, contiguous=True)
    kl = key_lengths if key_lengths is not None else lse  # unused pointer when HAS_KL is False
    mask = margs.mask if margs.mask is not None else lse  # unused pointer when MASK_KIND is 0
    common = dict(
        D=D, DV=Dv, BLOCK_D=head_block(D), BLOCK_DV=head_block(Dv), BLOCK_M=bm, BLOCK_N=cfg.block_n,
        CAUSAL=causal, HAS_KL=key_lengths is not None, PREC=precision(q.dtype),
        IDX64=needs_64bit_offsets(q, k, v, out, *(() if margs.mask is None else (margs.mask,))),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    with on_device(q):
        if splits > 1:
            _split_forward(q, k, v, out, lse, kl, scale, Lk, splits, hpp, grid, common, margs)
        elif plain:
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
                *margs.mask_strides,
                H, Lq, Lk, H // Hkv, hpp, scale,
                *margs.runtime(), *margs.modifier_args(lse), **margs.constexprs(), **margs.cache_args(k),
                **common,
            )
    return out, lse


def check_packing(q, modes, key_lengths):
    """The packed call's record, checked as far as the host can without reading device memory
    (the values, sorted prefix sums within the bounds, are the op layer's to check): returns
    (cu_seqlens_q, cu_seqlens_k, num_seqs, max_seqlen_q, max_seqlen_k)."""
    cu_q, cu_k = modes.cu_seqlens_q, getattr(modes, "cu_seqlens_k", None)
    if q.shape[0] != 1:
        raise ValueError(f"q: packed sequences come as one batch element (1, H, Tq, D), got batch {q.shape[0]}")
    if key_lengths is not None or getattr(modes, "attn_mask", None) is not None:
        raise ValueError("cu_seqlens_q: packed sequences take neither key_lengths nor attn_mask")
    for name, t in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1 or t.numel() < 2:
            raise ValueError(f"{name}: expected an int32 (num_seqs + 1,) tensor, got {t!r:.80}")
        if t.device != q.device:
            raise ValueError(f"{name}: expected a tensor on {q.device}, got {t.device}")
    if cu_q.numel() != cu_k.numel():
        raise ValueError(f"cu_seqlens_k: expected {cu_q.numel()} entries like cu_seqlens_q, got {cu_k.numel()}")
    max_q, max_k = int(modes.max_seqlen_q), int(getattr(modes, "max_seqlen_k", 0))
    if max_q < 1 or max_k < 1:
        raise ValueError(f"max_seqlen_q / max_seqlen_k: expected bounds >= 1 on the sequences' lengths, "
                         f"got {max_q} / {max_k}")
    return cu_q, cu_k, cu_q.numel() - 1, max_q, max_k


def _varlen_forward(q, k, v, out, lse, scale, causal, key_lengths, modes):
    """Packed sequences (docs/contract.md, "Packed sequences"): q (1, H, Tq, D), k (1, Hkv, Tk, D),
    v (1, Hkv, Tk, Dv) hold ``num_seqs`` sequences delimited by the record's int32 prefix sums
    cu_seqlens_q / cu_seqlens_k; out (1, H, Tq, Dv), lse (1, H, Tq). One modes-kernel launch over
    (query tile of max_seqlen_q, head, sequence); never split, never through descriptors."""
    B, H, Tq, D = q.shape
    Hkv, Tk, Dv = k.shape[1], k.shape[2], v.shape[3]
    cu_q, cu_k, num_seqs, max_q, _max_k = check_packing(q, modes, key_lengths)
    margs = ModeArgs(num_seqs, H, Tq, Tk, causal, modes, q.device)
    check_buffer("out", out, (1, H, Tq, Dv), q.dtype, q)
    check_buffer("lse", lse, (1, H, Tq), torch.float32, q, contiguous=True)
    cfg = fwd_config(D, Dv, q.dtype, arch_of(q), **tile_modes(margs))
    bm = row_block(max_q, cfg.block_m)
    grid = (triton.cdiv(max_q, bm) * H * num_seqs,)
    with on_device(q):
        _attn_fwd_modes_kernel[grid](
            q, k, v, out, lse, lse, lse,
            0, q.stride(1), q.stride(2),
            0, k.stride(1), k.stride(2),
            0, v.stride(1), v.stride(2),
            0, out.stride(1), out.stride(2),
            0, 0, 0, 0,
            H, max_q, Tk, H // Hkv, 1, scale,
            *margs.runtime(), *margs.modifier_args(lse), **margs.constexprs(),
            CUQ=cu_q, CUK=cu_k, Tq=Tq, VARLEN=True,
            D=D, DV=Dv, BLOCK_D=head_block(D), BLOCK_DV=head_block(Dv), BLOCK_M=bm, BLOCK_N=cfg.block_n,
            CAUSAL=causal, HAS_KL=False, PREC=precision(q.dtype), IDX64=needs_64bit_offsets(q, k, v, out),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return out, lse


def _split_forward(q, k, v, out, lse, kl, scale, Lk, splits, hpp, grid, common, margs):
    """The forward without modes over ``splits`` key shares of the ``Lk`` keys (grid axis 1;
    a paged cache's logical length), then their merge: with m_s, l_s and o_s the shares' max,
    sum and (normalised) output, M = max_s m_s, w_s = l_s exp(m_s - M), out = sum_s w_s o_s /
    sum_s w_s and lse = M + log(sum_s w_s); a share that saw no key (m_s = -inf, l_s = 0)
    weighs 0, a row that saw none gets 0 and -inf, and a NaN l_s stays NaN in both."""
    B, H, Lq = q.shape[0], q.shape[1], q.shape[2]
    Hkv, Dv = k.shape[1], v.shape[3]
    op = torch.empty((splits, B, H, Lq, Dv), device=q.device, dtype=torch.float32)
    lsep = torch.empty((2, splits, B, H, Lq), device=q.device, dtype=torch.float32)
    _attn_fwd_split_kernel[(grid[0], splits)](
        q, k, v, op, lsep, kl,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        op.stride(0), op.stride(1), op.stride(2), op.stride(3), lsep.stride(1),
        H, Lq, Lk, H // Hkv, hpp, scale, splits, *margs.modifier_args(lse),
        **margs.modifier_constexprs(), **margs.cache_args(k), **common,
    )
    m, l = lsep[0], lsep[1]
    mx = m.amax(0)
    mx = mx.masked_fill(torch.isneginf(mx), 0.0)
    w = torch.where(torch.isneginf(m), 0.0, l * torch.exp(m - mx))
    wsum = w.sum(0)
    dead = wsum == 0
    out.copy_((w.unsqueeze(-1) * op).sum(0) / wsum.masked_fill(dead, 1.0).unsqueeze(-1))
    lse.copy_((mx + torch.log(wsum)).masked_fill(dead, -math.inf))


#: The kernels of this module by the AOT check's names (mhakern/kernels/aot.py).
KERNELS = {"fwd": _attn_fwd_kernel, "fwdsplit": _attn_fwd_split_kernel, "fwd+modes": _attn_fwd_modes_kernel}

__all__ = ["attention_forward", "force_splits", "fwd_splits", "KERNELS"]
