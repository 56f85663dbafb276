"""Attention backward in Triton: delta preprocessing, then the gradient kernels.

Probabilities are recomputed from the forward's lse (``p = exp(s - lse)``), never stored.
``delta = rowsum(dout * out)`` is computed first. Three ways to compute the gradients, chosen
by ``heuristics.BWD_MODE`` (``MHAKERN_TRITON_BWD``):

* ``deterministic`` (the default), fused: one program per (key block, KV head, batch element)
  keeps its keys and values resident and streams the query rows of *all* query heads sharing
  that KV head past them (the sum over the group in registers, in a fixed order), computing
  dK, dV and its share of dQ (5 products per tile); the dQ shares are added into an fp32
  buffer in key-block order per row tile (a ticketed turn per row tile), so every run gives
  bit-identical gradients.
* ``atomic``: the same kernel with unordered atomic dQ adds (bits depend on the schedule).
* ``split``: no atomics; a dK/dV kernel as above and a dQ kernel, one program per query row
  tile (the forward's tiling, decode packing included) streaming the keys (7 products).

Masked rows and keys follow the forward exactly; a row that saw no key has lse = -inf, which
is read as +inf so its probabilities, and so all its gradients, are 0.

The optional modes are the forward's (see attention_fwd.py), under the same constexpr flags.
BAND: the dK/dV program visits only the query rows whose band meets its key block, masking the
boundary row blocks; dQ visits the forward's key range. Dropout regenerates the keep bits from
the seed: ``dV = (P * keep / (1 - p))^T dO`` and ``dS = P * (dP * keep / (1 - p) - delta)``.
The float mask's gradient is dS itself (the bias is added after the scale): the dQ kernel, which
visits each (row, key) pair once, writes it into a zeroed float32 (B, H, Lq, Lk) buffer
(``MASK_GRAD``), 0 wherever the pair is hidden.

Score modifiers (``SOFTCAP``, ``ALIBI``, as in the forward): the scores are recomputed capped
and biased; dS is formed at the capped score (the float mask's gradient is that dS), then
``dS_raw = dS * (1 - tanh^2)`` from the recomputed cap goes into dQ and dK. ALiBi has no
gradient.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .heuristics import (
    bwd_kernel,
    dkdv_config,
    dq_config,
    fused_config,
    head_block,
    next_pow2,
    packed_rows,
    row_block,
)
from .launch import (
    INTERPRET,
    ModeArgs,
    arch_of,
    check_buffer,
    launch_geometry,
    needs_64bit_offsets,
    on_device,
    precision,
    tile_modes,
)
from .tiles import (
    alibi_rows,
    band_edges,
    cap_inverse,
    diagonal,
    drop_rows,
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
def _bwd_delta_kernel(
    O, DO, DELTA, stride_ob, stride_oh, stride_om, stride_db, stride_dh, stride_dm, H, Lq,
    DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, IDX64: tl.constexpr,
):
    # Flat grid: row tiles fastest, then heads, then batch elements (see unfold_rows_grid).
    pid_m, h, b = unfold_rows_grid(H, Lq, 1, BLOCK_M)
    b = b.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < Lq
    h = elem_idx(h, IDX64)
    rows = elem_idx(offs_m, IDX64)
    o = load_tile(O + b * stride_ob, h * stride_oh + rows * stride_om, row_ok, DV, BLOCK_DV, True)
    do = load_tile(DO + b * stride_db, h * stride_dh + rows * stride_dm, row_ok, DV, BLOCK_DV, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + (b * H + h) * Lq + offs_m, delta, mask=offs_m < Lq)


@triton.jit
def _finite_or_zero(x):
    return tl.where(tl.abs(x) < float("inf"), x, 0.0)


@triton.jit
def _load_lse(LSE, idx, mask):
    """lse (natural log); -inf (row saw no key) becomes +inf so that exp(s - lse) is 0.

    The backward works in natural units, unlike the forward's base 2: lse is stored in natural
    log, and converting a large lse (large logits) to base 2 would add a rounding of up to an
    ulp of |lse| * log2(e) to every recomputed probability.
    """
    lse = tl.load(LSE + idx, mask=mask, other=0.0)
    return tl.where(lse == float("-inf"), float("inf"), lse)


@triton.jit
def _dkdv_rows(
    dk, dv, k, v, Q, DO, LSE, DELTA, q_base_b, do_base_b, head0, rows_total,
    stride_qh, stride_qm, stride_dh, stride_dm, offs_n, lk_b, H, Lq, b, sm_scale, start, stop,
    MASK, stride_mb, stride_mh, stride_mm, stride_mn, win_l, win_r, seed_lo, seed_hi, drop_thr, drop_scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr,
    IDX64: tl.constexpr, BAND: tl.constexpr = False, TOP_LEFT: tl.constexpr = False,
    MASK_KIND: tl.constexpr = 0, DROPOUT: tl.constexpr = False,
    k_dq=None, DQACC=None, SEM=None, DMASK=None, dm_stride=0, sem_base=0, n_self=0, prev_lo=0, prev_hi=0,
    FUSED: tl.constexpr = False, DETERMINISTIC: tl.constexpr = False, SEQUENTIAL: tl.constexpr = False,
    MASK_GRAD: tl.constexpr = False, softcap=0.0, inv_cap=0.0, SLOPES=None, slope_sb=0, slope_sh=0,
    SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False, Tq=0, q0=0, VARLEN: tl.constexpr = False,
):
    """Stream the row tiles [start, stop) past the resident key block: dK, dV (and, FUSED, each
    tile's dQ share and the mask's gradient; see _fused_dq_add). The extra arguments of the
    fused kernel are unused, and compiled away, in the split one; so are the score modifiers'
    without SOFTCAP and ALIBI."""
    for start_m in range(start, stop, BLOCK_M):
        r = start_m + tl.arange(0, BLOCK_M)
        row_ok = r < rows_total
        hh = head0 + r // Lq
        i = r % Lq
        q = load_rows(Q + q_base_b, hh, i, stride_qh, stride_qm, row_ok, D, BLOCK_D, IDX64)
        do = load_rows(DO + do_base_b, hh, i, stride_dh, stride_dm, row_ok, DV, BLOCK_DV, IDX64)
        if VARLEN:
            row_idx = hh * Tq + q0 + i  # packed (1, H, Tq): the sequence's rows start at q0
        else:
            row_idx = (b * H + hh) * Lq + i
        lse = _load_lse(LSE, row_idx, row_ok)
        delta = tl.load(DELTA + row_idx, mask=row_ok, other=0.0)
        # Transposed scores (keys x rows): keeps dK and dV as (BLOCK_N, D) accumulators.
        s_t = tl.dot(k, tl.trans(q), input_precision=PREC) * sm_scale
        slope = sm_scale
        diag = sm_scale
        if ALIBI:
            slope, diag = alibi_rows(SLOPES, slope_sb, slope_sh, b, hh, i, lk_b, Lq, row_ok, TOP_LEFT)
        s_t, t_t = modify_scores(s_t, softcap, inv_cap, slope, diag, offs_n, SOFTCAP, ALIBI, True)
        if MASK_KIND != 0:
            m_off = elem_idx(hh, IDX64) * stride_mh + elem_idx(i, IDX64) * stride_mm
            ptrs = MASK + b * stride_mb + (m_off[None, :] + elem_idx(offs_n, IDX64)[:, None] * stride_mn)
            s_t, mvis = mask_scores(s_t, ptrs, (offs_n[:, None] < lk_b) & row_ok[None, :], MASK_KIND)
        if MASKED:
            # Hidden pairs get -inf before exp: a hidden logit far above lse would overflow.
            vis = (offs_n[:, None] < lk_b) & row_ok[None, :]
            if BAND:
                kmin, kmax = band_edges(i, lk_b, Lq, win_l, win_r, TOP_LEFT)
                vis = vis & (offs_n[:, None] <= kmax[None, :]) & (offs_n[:, None] >= kmin[None, :])
            elif CAUSAL:
                vis = vis & (offs_n[:, None] <= (i + lk_b - Lq)[None, :])
            s_t = tl.where(vis, s_t, float("-inf"))
        # A pair with a -inf score (hidden, masked, or made -inf by an infinite q or k entry)
        # gives exactly 0 (docs/contract.md, "NaN and inf"): a row whose lse is NaN (a NaN or
        # +inf among its scores) would otherwise get exp(-inf - NaN) = NaN there, and the keys
        # it does not see a NaN dV.
        live = s_t != float("-inf")
        p_t = tl.where(live, tl.exp(s_t - lse[None, :]), 0.0)
        if DROPOUT:
            keep_t = keep_bits(drop_rows(seed_lo, seed_hi, b, H, hh, i)[None, :], offs_n[:, None], drop_thr)
            dv += tl.dot(tl.where(keep_t, p_t, 0.0).to(do.dtype), do, input_precision=PREC)
        else:
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=PREC)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PREC)
        if DROPOUT:
            dp_t = tl.where(keep_t, dp_t * drop_scale, 0.0)
        # Such pairs contribute exactly 0 to dS too, even against a NaN or inf in a value the row
        # does not see (0 * NaN would be NaN).
        ds_t = tl.where(live, p_t * (dp_t - delta[None, :]), 0.0)
        if SOFTCAP:
            # dS so far is at the capped score (where the mask and ALiBi are added: the mask's
            # gradient); through the cap to the raw scaled score, 1 - tanh^2 from the capped
            # value. The mask's gradient is stored first, so that one dS tile stays live.
            if FUSED:
                if MASK_GRAD:
                    tl.store(DMASK + row_idx[None, :].to(tl.int64) * dm_stride + offs_n[:, None].to(tl.int64), ds_t,
                             mask=row_ok[None, :] & (offs_n[:, None] < lk_b))
            ds_t = tl.where(live, ds_t * (1.0 - t_t * t_t), 0.0)
        # q's non-finite entries are zeroed for dK (docs/contract.md, "NaN and inf"): one makes
        # every score of its row non-finite, so the row either has a NaN lse, and NaN ds on every
        # key it sees, or scores that are all -inf (it sees no key). Zeroing it drops only the
        # 0 * inf of pairs whose ds is 0 (hidden, or a -inf score).
        dk += tl.dot(ds_t.to(q.dtype), _finite_or_zero(q), input_precision=PREC)
        if FUSED:
            if MASK_GRAD and not SOFTCAP:
                # dL/d(bias) = dS (the bias is added after the scale), each visible pair once.
                tl.store(DMASK + row_idx[None, :].to(tl.int64) * dm_stride + offs_n[:, None].to(tl.int64), ds_t,
                         mask=row_ok[None, :] & (offs_n[:, None] < lk_b))
            # The fifth product: this key block's share of the tile's dQ, (BLOCK_M, BLOCK_D), with
            # k's non-finite entries zeroed (k_dq) for the reason q's are for dK.
            dq_t = tl.dot(tl.trans(ds_t).to(k_dq.dtype), k_dq, input_precision=PREC)
            _fused_dq_add(DQACC, SEM, dq_t, row_idx, row_ok, sem_base + start_m // BLOCK_M,
                          (start_m >= prev_lo) & (start_m < prev_hi), n_self, D, BLOCK_D, DETERMINISTIC, SEQUENTIAL)
    return dk, dv


@triton.jit
def _fused_dq_add(DQACC, SEM, dq_t, row_idx, row_ok, lock_idx, prev_visits, n_self,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, DETERMINISTIC: tl.constexpr, SEQUENTIAL: tl.constexpr):
    """Add a key block's dQ share to the fp32 (B, H, Lq, D) accumulator DQACC.

    Non-deterministic: ``tl.atomic_add``, in whatever order the key blocks arrive. Deterministic:
    each row tile's adds are ordered by key block, ascending, through its lock ``SEM[lock_idx]``
    (``SEM[0]`` is the ticket counter, ``SEM[1]`` the interpreter's order-error flag),
    which holds the index + 1 of the last key block that added (0: none yet). The key blocks that
    visit a row tile are consecutive (their row ranges are monotone in the key block), so key
    block ``n_self`` waits for ``n_self`` when its predecessor visits the tile too, else for 0,
    and then publishes ``n_self + 1``. The acquire on the wait and the release after a barrier
    order the adds of one tile across programs. Forward progress: see _attn_bwd_dkdv_body.
    """
    ptrs = DQACC + row_idx[:, None].to(tl.int64) * D + tl.arange(0, BLOCK_D)[None, :]
    ok = row_ok[:, None]
    if D < BLOCK_D:
        ok = ok & (tl.arange(0, BLOCK_D)[None, :] < D)
    if DETERMINISTIC:
        lock = SEM + lock_idx
        turn = tl.where(prev_visits, n_self, 0)
        if SEQUENTIAL:
            # The interpreter runs programs one at a time in ticket order, so a wait could never
            # end: the turn must have come, else the flag tells the launcher, which raises.
            if tl.atomic_cas(lock, turn, turn, sem="acquire") != turn:
                tl.atomic_xchg(SEM + 1, 1)
        else:
            while tl.atomic_cas(lock, turn, turn, sem="acquire") != turn:
                pass
        tl.atomic_add(ptrs, dq_t, mask=ok, sem="relaxed")
        tl.debug_barrier()  # every thread's adds precede the release
        tl.atomic_xchg(lock, n_self + 1, sem="release")
    else:
        tl.atomic_add(ptrs, dq_t, mask=ok, sem="relaxed")


@triton.jit
def _band_row_range(n0, lk_b, Lq, rows_total, heads_per_prog, win_l, win_r,
                    TOP_LEFT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(m_lo, f_lo, f_hi, m_hi) for the key block [n0, n0 + BLOCK_N) in BAND mode: rows
    [m_lo, f_lo) and [f_hi, m_hi) need the mask, [f_lo, f_hi) see every key of the block, rows
    outside [m_lo, m_hi) see none of it. Row i sees [i + off - L, i + off + R] (both edges grow
    with i), so it meets the block when n0 - off - R <= i <= n1 - off + L and covers it when
    n1 - off - R <= i <= n0 - off + L. Tiles packing several heads take every row, masked."""
    n1 = n0 + BLOCK_N - 1
    off = diagonal(0, lk_b, Lq, TOP_LEFT)
    m_lo = (tl.maximum(n0 - off - win_r, 0) // BLOCK_M) * BLOCK_M
    m_hi = tl.minimum(n1 - off + win_l + 1, rows_total)
    m_hi = tl.where(n0 < lk_b, tl.maximum(m_hi, m_lo), m_lo)
    f_lo = ((tl.maximum(n1 - off - win_r, 0) + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    f_lo = tl.maximum(f_lo, m_lo)
    x = n0 - off + win_l + 1
    f_hi = tl.where(x >= rows_total, rows_total, (x // BLOCK_M) * BLOCK_M)
    empty = (n1 >= lk_b) | (f_lo >= f_hi)
    f_lo = tl.where(empty, m_lo, f_lo)
    f_hi = tl.where(empty, m_lo, f_hi)
    packed = heads_per_prog != 1
    m_lo = tl.where(packed, 0, m_lo)
    f_lo = tl.where(packed, rows_total, f_lo)
    f_hi = tl.where(packed, rows_total, f_hi)
    m_hi = tl.where(packed, rows_total, m_hi)
    return m_lo, f_lo, f_hi, m_hi


@triton.jit
def _attn_bwd_dkdv_body(
    Q, K, V, DO, LSE, DELTA, DK, DV_, KL, MASK,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_db, stride_dh, stride_dm,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_mb, stride_mh, stride_mm, stride_mn,
    H, Lq, Lk, n_rep, heads_per_prog, sm_scale,
    win_l, win_r, seed_lo, seed_hi, drop_thr, drop_scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_KL: tl.constexpr, PREC: tl.constexpr, IDX64: tl.constexpr,
    BAND: tl.constexpr = False, TOP_LEFT: tl.constexpr = False, MASK_KIND: tl.constexpr = 0,
    DROPOUT: tl.constexpr = False, DQACC=None, SEM=None, DMASK=None, FUSED: tl.constexpr = False,
    DETERMINISTIC: tl.constexpr = False, SEQUENTIAL: tl.constexpr = False, MASK_GRAD: tl.constexpr = False,
    softcap=0.0, SLOPES=None, slope_sb=0, slope_sh=0, SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False,
    CUQ=None, CUK=None, Tq=0, VARLEN: tl.constexpr = False,
):
    inv_cap = cap_inverse(softcap, SOFTCAP)
    # Flat grid: key blocks fastest, then KV heads, then batch elements (see unfold_rows_grid).
    pid = tl.program_id(0)
    if FUSED:
        if DETERMINISTIC:
            # Work goes by ticket, not by program id: a program takes the next ticket when it
            # starts, so every program with a smaller ticket has started too (it is resident or
            # done). Key block n of a (batch element, KV head) waits only on key block n - 1,
            # whose ticket is one less: by induction from ticket 0, which never waits, every
            # wait ends, whatever order the hardware starts programs in and however few are
            # resident at once. Under the interpreter the tickets follow the grid order.
            # (The modulo only keeps a broken schedule, a counter not reset, inside the grid.)
            pid = tl.atomic_add(SEM, 1, sem="relaxed") % tl.num_programs(0)
    n_blocks = tl.cdiv(Lk, BLOCK_N)
    Hkv = H // n_rep
    pid_n = pid % n_blocks
    kvh = ((pid // n_blocks) % Hkv).to(tl.int64)
    b = (pid // n_blocks // Hkv).to(tl.int64)
    if VARLEN:
        # Packed sequences: b is the sequence, Lk the longest one's key length (the block grid);
        # positions are sequence-local, K/V/Q/dO start at the sequence's first token, and a key
        # block past the sequence's keys streams no rows (it stores nothing either).
        q0 = tl.load(CUQ + b)
        lq_b = tl.load(CUQ + b + 1) - q0
        k0 = tl.load(CUK + b)
        lk_b = tl.load(CUK + b + 1) - k0
        q0 = q0.to(tl.int64)
        k0 = k0.to(tl.int64)
        n0 = pid_n * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        key_in = offs_n < lk_b
    else:
        # (The plain kernels' order of these statements, which their recorded SASS pins: the
        # K/V offsets stay inside the loads' expressions, after key_vis.)
        q0 = b
        k0 = b
        lq_b = Lq
        lk_b = key_length(KL, b, Lk, HAS_KL)
        n0 = pid_n * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        key_in = offs_n < Lk
    # Keys past this element's length are loaded as zeros: their gradients are 0 whatever they
    # hold (a NaN value would otherwise reach dK through dP).
    key_vis = offs_n < lk_b
    if VARLEN:
        k = load_tile(K + k0 * stride_kn + kvh * stride_kh, elem_idx(offs_n, IDX64) * stride_kn, key_vis, D,
                      BLOCK_D, True)
        v = load_tile(V + k0 * stride_vn + kvh * stride_vh, elem_idx(offs_n, IDX64) * stride_vn, key_vis, DV,
                      BLOCK_DV, True)
    else:
        k = load_tile(K + b * stride_kb + kvh * stride_kh, elem_idx(offs_n, IDX64) * stride_kn, key_vis, D,
                      BLOCK_D, True)
        v = load_tile(V + b * stride_vb + kvh * stride_vh, elem_idx(offs_n, IDX64) * stride_vn, key_vis, DV,
                      BLOCK_DV, True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    rows_total = heads_per_prog * lq_b
    if VARLEN:
        rows_total = tl.where(n0 < lk_b, rows_total, 0)
    if BAND:
        m_lo, m_full, m_full_hi, m_hi = _band_row_range(n0, lk_b, lq_b, rows_total, heads_per_prog, win_l, win_r,
                                                        TOP_LEFT, BLOCK_M, BLOCK_N)
    else:
        block_full = n0 + BLOCK_N <= lk_b
        # Rows [m_lo, m_full) need the mask, rows [m_full, rows_total) see every key of this block.
        if CAUSAL:
            if heads_per_prog == 1:
                i_first = tl.maximum(n0 - lk_b + lq_b, 0)
                m_lo = (i_first // BLOCK_M) * BLOCK_M
                i_all = n0 + BLOCK_N - 1 - lk_b + lq_b
                m_full = tl.maximum(((tl.maximum(i_all, 0) + BLOCK_M - 1) // BLOCK_M) * BLOCK_M, m_lo)
            else:
                m_lo = 0
                m_full = rows_total
        else:
            m_lo = 0
            m_full = 0
        m_full = tl.where(block_full, m_full, rows_total)
        m_full = tl.minimum(m_full, rows_total)
        m_full_hi = rows_total
        m_hi = rows_total
    n_chunks = n_rep // heads_per_prog
    # Fused: the rows of key block pid_n - 1 (the wait's predecessor, see _fused_dq_add) and the
    # number of row tiles, which numbers this program's locks.
    prev_lo = 0
    prev_hi = 0
    n_rt = tl.cdiv(rows_total, BLOCK_M)
    if VARLEN:
        # One numbering of the locks for every sequence (rows_total varies with the sequence):
        # each (sequence, head group) owns the tiles of the longest one, Lq = max_seqlen_q rows.
        n_rt = tl.cdiv(heads_per_prog * Lq, BLOCK_M)
    k_dq = k
    if FUSED:
        k_dq = _finite_or_zero(k)
        if pid_n > 0:
            if BAND:
                prev_lo, _f0, _f1, prev_hi = _band_row_range(n0 - BLOCK_N, lk_b, lq_b, rows_total, heads_per_prog,
                                                             win_l, win_r, TOP_LEFT, BLOCK_M, BLOCK_N)
            else:
                # Row ranges [m_lo, rows_total) only shrink from the front with the key block.
                prev_hi = rows_total
    for c in range(0, n_chunks):
        head0 = kvh * n_rep + c * heads_per_prog
        sem_base = 2 + (b * (H // heads_per_prog) + head0 // heads_per_prog) * n_rt
        # Row offsets written here, not through a helper: an inlined call opens a debug scope
        # whose labels ptxas schedules around, which changes the plain kernels' SASS.
        if VARLEN:
            q_off = q0 * stride_qm
            do_off = q0 * stride_dm
        else:
            q_off = b * stride_qb
            do_off = b * stride_db
        dk, dv = _dkdv_rows(
            dk, dv, k, v, Q, DO, LSE, DELTA, q_off, do_off, head0, rows_total,
            stride_qh, stride_qm, stride_dh, stride_dm, offs_n, lk_b, H, lq_b, b, sm_scale, m_lo, m_full,
            MASK, stride_mb, stride_mh, stride_mm, stride_mn, win_l, win_r, seed_lo, seed_hi, drop_thr, drop_scale,
            D, DV, BLOCK_D, BLOCK_DV, BLOCK_M, True, CAUSAL, PREC, IDX64, BAND, TOP_LEFT, MASK_KIND, DROPOUT,
            k_dq, DQACC, SEM, DMASK, Lk, sem_base, pid_n, prev_lo, prev_hi, FUSED, DETERMINISTIC, SEQUENTIAL,
            MASK_GRAD, softcap, inv_cap, SLOPES, slope_sb, slope_sh, SOFTCAP, ALIBI, Tq, q0, VARLEN,
        )
        dk, dv = _dkdv_rows(
            dk, dv, k, v, Q, DO, LSE, DELTA, q_off, do_off, head0, rows_total,
            stride_qh, stride_qm, stride_dh, stride_dm, offs_n, lk_b, H, lq_b, b, sm_scale, m_full, m_full_hi,
            MASK, stride_mb, stride_mh, stride_mm, stride_mn, win_l, win_r, seed_lo, seed_hi, drop_thr, drop_scale,
            D, DV, BLOCK_D, BLOCK_DV, BLOCK_M, False, CAUSAL, PREC, IDX64, BAND, TOP_LEFT, MASK_KIND, DROPOUT,
            k_dq, DQACC, SEM, DMASK, Lk, sem_base, pid_n, prev_lo, prev_hi, FUSED, DETERMINISTIC, SEQUENTIAL,
            MASK_GRAD, softcap, inv_cap, SLOPES, slope_sb, slope_sh, SOFTCAP, ALIBI, Tq, q0, VARLEN,
        )
        if BAND:
            dk, dv = _dkdv_rows(
                dk, dv, k, v, Q, DO, LSE, DELTA, q_off, do_off, head0, rows_total,
                stride_qh, stride_qm, stride_dh, stride_dm, offs_n, lk_b, H, lq_b, b, sm_scale, m_full_hi, m_hi,
                MASK, stride_mb, stride_mh, stride_mm, stride_mn, win_l, win_r, seed_lo, seed_hi, drop_thr,
                drop_scale,
                D, DV, BLOCK_D, BLOCK_DV, BLOCK_M, True, CAUSAL, PREC, IDX64, BAND, TOP_LEFT, MASK_KIND, DROPOUT,
                k_dq, DQACC, SEM, DMASK, Lk, sem_base, pid_n, prev_lo, prev_hi, FUSED, DETERMINISTIC, SEQUENTIAL,
                MASK_GRAD, softcap, inv_cap, SLOPES, slope_sb, slope_sh, SOFTCAP, ALIBI, Tq, q0, VARLEN,
            )
    dk = dk * sm_scale
    if DROPOUT:
        dv = dv * drop_scale
    if VARLEN:
        store_tile(DK + k0 * stride_dkn + kvh * stride_dkh, elem_idx(offs_n, IDX64) * stride_dkn, key_in,
                   dk.to(DK.dtype.element_ty), D, BLOCK_D)
        store_tile(DV_ + k0 * stride_dvn + kvh * stride_dvh, elem_idx(offs_n, IDX64) * stride_dvn, key_in,
                   dv.to(DV_.dtype.element_ty), DV, BLOCK_DV)
    else:
        store_tile(DK + b * stride_dkb + kvh * stride_dkh, elem_idx(offs_n, IDX64) * stride_dkn, key_in,
                   dk.to(DK.dtype.element_ty), D, BLOCK_D)
        store_tile(DV_ + b * stride_dvb + kvh * stride_dvh, elem_idx(offs_n, IDX64) * stride_dvn, key_in,
                   dv.to(DV_.dtype.element_ty), DV, BLOCK_DV)


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV_, KL, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh,
    stride_kn, stride_vb, stride_vh, stride_vn, stride_db, stride_dh, stride_dm, stride_dkb,
    stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn, H, Lq, Lk, n_rep, heads_per_prog,
    sm_scale, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_KL: tl.constexpr,
    PREC: tl.constexpr, IDX64: tl.constexpr,
):
    """dK/dV without optional modes: the body with every mode flag off."""
    _attn_bwd_dkdv_body(
        Q, K, V, DO, LSE, DELTA, DK, DV_, KL, LSE, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh,
        stride_kn, stride_vb, stride_vh, stride_vn, stride_db, stride_dh, stride_dm, stride_dkb, stride_dkh,
        stride_dkn, stride_dvb, stride_dvh, stride_dvn, 0, 0, 0, 0, H, Lq, Lk, n_rep, heads_per_prog,
        sm_scale, 0, 0, 0, 0, 0, 1.0, D, DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, CAUSAL, HAS_KL, PREC,
        IDX64, BAND=False, TOP_LEFT=False, MASK_KIND=0, DROPOUT=False,
    )


@triton.jit(do_not_specialize=["win_l", "win_r", "seed_lo", "seed_hi", "drop_thr"])
def _attn_bwd_dkdv_modes_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV_, KL, MASK, stride_qb, stride_qh, stride_qm, stride_kb,
    stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, stride_db, stride_dh, stride_dm,
    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn, stride_mb, stride_mh,
    stride_mm, stride_mn, H, Lq, Lk, n_rep, heads_per_prog, sm_scale, win_l, win_r, seed_lo,
    seed_hi, drop_thr, drop_scale, softcap, SLOPES, slope_sb, slope_sh, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_KL: tl.constexpr, PREC: tl.constexpr, IDX64: tl.constexpr,
    BAND: tl.constexpr = False, TOP_LEFT: tl.constexpr = False, MASK_KIND: tl.constexpr = 0,
    DROPOUT: tl.constexpr = False, SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False,
    CUQ=None, CUK=None, Tq=0, VARLEN: tl.constexpr = False,
):
    """dK/dV with optional modes and score modifiers; VARLEN: packed sequences (as the
    forward's modes kernel: B = 1, the grid's batch axis the sequence, Lk the longest one's keys)."""
    _attn_bwd_dkdv_body(
        Q, K, V, DO, LSE, DELTA, DK, DV_, KL, MASK, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh,
        stride_kn, stride_vb, stride_vh, stride_vn, stride_db, stride_dh, stride_dm, stride_dkb, stride_dkh,
        stride_dkn, stride_dvb, stride_dvh, stride_dvn, stride_mb, stride_mh, stride_mm, stride_mn, H, Lq,
        Lk, n_rep, heads_per_prog, sm_scale, win_l, win_r, seed_lo, seed_hi, drop_thr, drop_scale, D, DV,
        BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, CAUSAL, HAS_KL, PREC, IDX64, BAND=BAND, TOP_LEFT=TOP_LEFT,
        MASK_KIND=MASK_KIND, DROPOUT=DROPOUT, softcap=softcap, SLOPES=SLOPES, slope_sb=slope_sb,
        slope_sh=slope_sh, SOFTCAP=SOFTCAP, ALIBI=ALIBI, CUQ=CUQ, CUK=CUK, Tq=Tq, VARLEN=VARLEN,
    )



@triton.jit
def _attn_bwd_fused_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV_, KL, DQACC, SEM, stride_qb, stride_qh, stride_qm, stride_kb,
    stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, stride_db, stride_dh, stride_dm,
    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn, H, Lq, Lk, n_rep,
    heads_per_prog, sm_scale, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_KL: tl.constexpr, PREC: tl.constexpr, IDX64: tl.constexpr, DETERMINISTIC: tl.constexpr = True,
    SEQUENTIAL: tl.constexpr = False,
):
    """dK, dV and dQ's fp32 shares in one pass (5 products per tile), no optional modes."""
    _attn_bwd_dkdv_body(
        Q, K, V, DO, LSE, DELTA, DK, DV_, KL, LSE, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh,
        stride_kn, stride_vb, stride_vh, stride_vn, stride_db, stride_dh, stride_dm, stride_dkb, stride_dkh,
        stride_dkn, stride_dvb, stride_dvh, stride_dvn, 0, 0, 0, 0, H, Lq, Lk, n_rep, heads_per_prog,
        sm_scale, 0, 0, 0, 0, 0, 1.0, D, DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, CAUSAL, HAS_KL, PREC,
        IDX64, BAND=False, TOP_LEFT=False, MASK_KIND=0, DROPOUT=False, DQACC=DQACC, SEM=SEM, DMASK=LSE,
        FUSED=True, DETERMINISTIC=DETERMINISTIC, SEQUENTIAL=SEQUENTIAL, MASK_GRAD=False,
    )


@triton.jit(do_not_specialize=["win_l", "win_r", "seed_lo", "seed_hi", "drop_thr"])
def _attn_bwd_fused_modes_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV_, KL, MASK, DQACC, SEM, DMASK, stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, stride_db, stride_dh, stride_dm,
    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn, stride_mb, stride_mh,
    stride_mm, stride_mn, H, Lq, Lk, n_rep, heads_per_prog, sm_scale, win_l, win_r, seed_lo,
    seed_hi, drop_thr, drop_scale, softcap, SLOPES, slope_sb, slope_sh, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_KL: tl.constexpr, PREC: tl.constexpr, IDX64: tl.constexpr,
    BAND: tl.constexpr = False, TOP_LEFT: tl.constexpr = False, MASK_KIND: tl.constexpr = 0,
    DROPOUT: tl.constexpr = False, MASK_GRAD: tl.constexpr = False, DETERMINISTIC: tl.constexpr = True,
    SEQUENTIAL: tl.constexpr = False, SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False,
    CUQ=None, CUK=None, Tq=0, VARLEN: tl.constexpr = False,
):
    """The fused backward with optional modes and score modifiers (and the float mask's gradient
    into DMASK); VARLEN: packed sequences (as the split dK/dV kernel's, DQACC (1, H, Tq, D))."""
    _attn_bwd_dkdv_body(
        Q, K, V, DO, LSE, DELTA, DK, DV_, KL, MASK, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh,
        stride_kn, stride_vb, stride_vh, stride_vn, stride_db, stride_dh, stride_dm, stride_dkb, stride_dkh,
        stride_dkn, stride_dvb, stride_dvh, stride_dvn, stride_mb, stride_mh, stride_mm, stride_mn, H, Lq,
        Lk, n_rep, heads_per_prog, sm_scale, win_l, win_r, seed_lo, seed_hi, drop_thr, drop_scale, D, DV,
        BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, CAUSAL, HAS_KL, PREC, IDX64, BAND=BAND, TOP_LEFT=TOP_LEFT,
        MASK_KIND=MASK_KIND, DROPOUT=DROPOUT, DQACC=DQACC, SEM=SEM, DMASK=DMASK, FUSED=True,
        DETERMINISTIC=DETERMINISTIC, SEQUENTIAL=SEQUENTIAL, MASK_GRAD=MASK_GRAD, softcap=softcap, SLOPES=SLOPES,
        slope_sb=slope_sb, slope_sh=slope_sh, SOFTCAP=SOFTCAP, ALIBI=ALIBI,
        CUQ=CUQ, CUK=CUK, Tq=Tq, VARLEN=VARLEN,
    )



@triton.jit
def _dq_inner(
    dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, start, stop, kmax, lk_b, sm_scale,
    kmin, m_base, m_off, stride_mn, row_ok, r_drop, drop_thr, drop_scale, dm_row,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, PREC: tl.constexpr, IDX64: tl.constexpr,
    BAND: tl.constexpr = False, MASK_KIND: tl.constexpr = 0, DROPOUT: tl.constexpr = False,
    MASK_GRAD: tl.constexpr = False, softcap=0.0, inv_cap=0.0, slope=0.0, diag=0.0,
    SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False,
):
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(start, stop, BLOCK_N):
        offs_n = start_n + offs_n0
        key_ok = offs_n < lk_b
        k = load_tile(k_base, elem_idx(offs_n, IDX64) * stride_kn, key_ok, D, BLOCK_D, MASKED)
        v = load_tile(v_base, elem_idx(offs_n, IDX64) * stride_vn, key_ok, DV, BLOCK_DV, MASKED)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * sm_scale
        s, t = modify_scores(s, softcap, inv_cap, slope, diag, offs_n, SOFTCAP, ALIBI, False)
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
        p = tl.exp(s - lse[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        if DROPOUT:
            dp = tl.where(keep_bits(r_drop[:, None], offs_n[None, :], drop_thr), dp * drop_scale, 0.0)
        # As in dK/dV: pairs with a -inf score give exactly 0, even against a NaN or inf in a
        # value the row does not see; k's non-finite entries are zeroed as q's are there.
        ds = tl.where(s != float("-inf"), p * (dp - delta[:, None]), 0.0)
        k = _finite_or_zero(k)
        if MASK_GRAD:
            # dL/d(bias) = dS (the bias is added after the scale); offs_n < Lk keeps the tail
            # block of the row inside the buffer.
            tl.store(dm_row[:, None] + offs_n[None, :].to(tl.int64), ds,
                     mask=row_ok[:, None] & (offs_n[None, :] < lk_b))
        if SOFTCAP:
            # Through the cap to the raw scaled score (the mask's gradient above is at the capped one).
            ds = tl.where(s != float("-inf"), ds * (1.0 - t * t), 0.0)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
    return dq


@triton.jit
def _attn_bwd_dq_body(
    Q, K, V, DO, LSE, DELTA, DQ, KL, MASK, DMASK,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_db, stride_dh, stride_dm,
    stride_dqb, stride_dqh, stride_dqm,
    stride_mb, stride_mh, stride_mm, stride_mn,
    H, Lq, Lk, n_rep, heads_per_prog, sm_scale,
    win_l, win_r, seed_lo, seed_hi, drop_thr, drop_scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_KL: tl.constexpr, PREC: tl.constexpr, IDX64: tl.constexpr,
    BAND: tl.constexpr = False, TOP_LEFT: tl.constexpr = False, MASK_KIND: tl.constexpr = 0,
    DROPOUT: tl.constexpr = False, MASK_GRAD: tl.constexpr = False,
    softcap=0.0, SLOPES=None, slope_sb=0, slope_sh=0, SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False,
    CUQ=None, CUK=None, Tq=0, VARLEN: tl.constexpr = False,
):
    pid_m, pid_h, b = unfold_rows_grid(H, Lq, heads_per_prog, BLOCK_M)
    b = b.to(tl.int64)
    r, row_ok, hh, i, i_lo, i_hi, kvh = row_tile(pid_m, pid_h, heads_per_prog, n_rep, Lq, BLOCK_M)
    if VARLEN:
        # Packed sequences, as in the forward's modes kernel (attention_fwd._attn_fwd_body).
        q0 = tl.load(CUQ + b)
        lq_b = tl.load(CUQ + b + 1) - q0
        k0 = tl.load(CUK + b)
        lk_b = tl.where(i_lo < lq_b, tl.load(CUK + b + 1) - k0, 0)
        row_ok = row_ok & (i < lq_b)
        i_hi = tl.minimum(i_hi, lq_b - 1)
        q0 = q0.to(tl.int64)
        k0 = k0.to(tl.int64)
        q = load_rows(Q + q0 * stride_qm, hh, i, stride_qh, stride_qm, row_ok, D, BLOCK_D, IDX64)
        do = load_rows(DO + q0 * stride_dm, hh, i, stride_dh, stride_dm, row_ok, DV, BLOCK_DV, IDX64)
        row_idx = hh * Tq + q0 + i
    else:
        # (The plain kernels' order of these statements, which their recorded SASS pins.)
        lq_b = Lq
        lk_b = key_length(KL, b, Lk, HAS_KL)
        q = load_rows(Q + b * stride_qb, hh, i, stride_qh, stride_qm, row_ok, D, BLOCK_D, IDX64)
        do = load_rows(DO + b * stride_db, hh, i, stride_dh, stride_dm, row_ok, DV, BLOCK_DV, IDX64)
        row_idx = (b * H + hh) * Lq + i
    lse = _load_lse(LSE, row_idx, row_ok)
    delta = tl.load(DELTA + row_idx, mask=row_ok, other=0.0)
    kmin, kmax, start, full_lo, full, hi, m_base, m_off, r_drop = row_tile_modes(
        i, i_lo, i_hi, hh, b, lk_b, H, lq_b, win_l, win_r, seed_lo, seed_hi, MASK, stride_mb, stride_mh, stride_mm,
        BLOCK_N, CAUSAL, IDX64, BAND, TOP_LEFT, MASK_KIND, DROPOUT)
    dm_row = DMASK
    if MASK_GRAD:
        dm_row = DMASK + row_idx.to(tl.int64) * Lk  # contiguous float32 (B, H, Lq, Lk)
    inv_cap = cap_inverse(softcap, SOFTCAP)
    slope = sm_scale
    diag = sm_scale
    if ALIBI:
        slope, diag = alibi_rows(SLOPES, slope_sb, slope_sh, b, hh, i, lk_b, lq_b, row_ok, TOP_LEFT)
    if VARLEN:
        k_base = K + k0 * stride_kn + kvh.to(tl.int64) * stride_kh
        v_base = V + k0 * stride_vn + kvh.to(tl.int64) * stride_vh
    else:
        k_base = K + b * stride_kb + kvh.to(tl.int64) * stride_kh
        v_base = V + b * stride_vb + kvh.to(tl.int64) * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if BAND:
        dq = _dq_inner(
            dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, start, full_lo, kmax, lk_b, sm_scale,
            kmin, m_base, m_off, stride_mn, row_ok, r_drop, drop_thr, drop_scale, dm_row,
            D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, True, PREC, IDX64, BAND, MASK_KIND, DROPOUT, MASK_GRAD,
            softcap, inv_cap, slope, diag, SOFTCAP, ALIBI,
        )
    dq = _dq_inner(
        dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, full_lo, full, kmax, lk_b, sm_scale,
        kmin, m_base, m_off, stride_mn, row_ok, r_drop, drop_thr, drop_scale, dm_row,
        D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, False, PREC, IDX64, BAND, MASK_KIND, DROPOUT, MASK_GRAD,
        softcap, inv_cap, slope, diag, SOFTCAP, ALIBI,
    )
    dq = _dq_inner(
        dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, full, hi, kmax, lk_b, sm_scale,
        kmin, m_base, m_off, stride_mn, row_ok, r_drop, drop_thr, drop_scale, dm_row,
        D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, True, PREC, IDX64, BAND, MASK_KIND, DROPOUT, MASK_GRAD,
        softcap, inv_cap, slope, diag, SOFTCAP, ALIBI,
    )
    dq = dq * sm_scale
    if VARLEN:
        store_tile(DQ + q0 * stride_dqm, elem_idx(hh, IDX64) * stride_dqh + elem_idx(i, IDX64) * stride_dqm, row_ok,
                   dq.to(DQ.dtype.element_ty), D, BLOCK_D)
    else:
        store_tile(DQ + b * stride_dqb, elem_idx(hh, IDX64) * stride_dqh + elem_idx(i, IDX64) * stride_dqm, row_ok,
                   dq.to(DQ.dtype.element_ty), D, BLOCK_D)


@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, KL, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh,
    stride_kn, stride_vb, stride_vh, stride_vn, stride_db, stride_dh, stride_dm, stride_dqb,
    stride_dqh, stride_dqm, H, Lq, Lk, n_rep, heads_per_prog, sm_scale, D: tl.constexpr,
    DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_KL: tl.constexpr, PREC: tl.constexpr,
    IDX64: tl.constexpr,
):
    """dQ without optional modes: the body with every mode flag off."""
    _attn_bwd_dq_body(
        Q, K, V, DO, LSE, DELTA, DQ, KL, LSE, LSE, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh,
        stride_kn, stride_vb, stride_vh, stride_vn, stride_db, stride_dh, stride_dm, stride_dqb, stride_dqh,
        stride_dqm, 0, 0, 0, 0, H, Lq, Lk, n_rep, heads_per_prog, sm_scale, 0, 0, 0, 0, 0, 1.0, D, DV,
        BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, CAUSAL, HAS_KL, PREC, IDX64, BAND=False, TOP_LEFT=False,
        MASK_KIND=0, DROPOUT=False, MASK_GRAD=False,
    )


@triton.jit(do_not_specialize=["win_l", "win_r", "seed_lo", "seed_hi", "drop_thr"])
def _attn_bwd_dq_modes_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, KL, MASK, DMASK, stride_qb, stride_qh, stride_qm, stride_kb,
    stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, stride_db, stride_dh, stride_dm,
    stride_dqb, stride_dqh, stride_dqm, stride_mb, stride_mh, stride_mm, stride_mn, H, Lq, Lk,
    n_rep, heads_per_prog, sm_scale, win_l, win_r, seed_lo, seed_hi, drop_thr, drop_scale,
    softcap, SLOPES, slope_sb, slope_sh,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_KL: tl.constexpr,
    PREC: tl.constexpr, IDX64: tl.constexpr, BAND: tl.constexpr = False,
    TOP_LEFT: tl.constexpr = False, MASK_KIND: tl.constexpr = 0, DROPOUT: tl.constexpr = False,
    MASK_GRAD: tl.constexpr = False, SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False,
    CUQ=None, CUK=None, Tq=0, VARLEN: tl.constexpr = False,
):
    """dQ with optional modes and score modifiers; VARLEN: packed sequences (as the forward's)."""
    _attn_bwd_dq_body(
        Q, K, V, DO, LSE, DELTA, DQ, KL, MASK, DMASK, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh,
        stride_kn, stride_vb, stride_vh, stride_vn, stride_db, stride_dh, stride_dm, stride_dqb, stride_dqh,
        stride_dqm, stride_mb, stride_mh, stride_mm, stride_mn, H, Lq, Lk, n_rep, heads_per_prog, sm_scale,
        win_l, win_r, seed_lo, seed_hi, drop_thr, drop_scale, D, DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N,
        CAUSAL, HAS_KL, PREC, IDX64, BAND=BAND, TOP_LEFT=TOP_LEFT, MASK_KIND=MASK_KIND, DROPOUT=DROPOUT,
        MASK_GRAD=MASK_GRAD, softcap=softcap, SLOPES=SLOPES, slope_sb=slope_sb, slope_sh=slope_sh,
        SOFTCAP=SOFTCAP, ALIBI=ALIBI, CUQ=CUQ, CUK=CUK, Tq=Tq, VARLEN=VARLEN,
    )



def attention_backward(dout, q, k, v, out, lse, dq, dk, dv, scale: float, causal: bool, key_lengths=None,
                       modes=None, *, dmask=None, bwd_mode=None):
    """Launch the backward into the caller's buffers; returns ``(dq, dk, dv)``.

    Shapes as the forward's (out and lse are its outputs, dout like out); dq (B, H, Lq, D),
    dk (B, Hkv, Lk, D), dv (B, Hkv, Lk, Dv) in q's dtype with any strides of unit last stride.
    dk and dv are summed over the query heads sharing each KV head. The modes are the
    forward's record, with the same values (the keep mask is regenerated from its seed). ``dmask``:
    None, or a zeroed contiguous float32 (B, H, Lq, Lk) buffer that receives dL/d(score), the
    gradient of a float ``attn_mask`` before its reduction to the mask's shape.
    ``bwd_mode``: "deterministic", "atomic" or "split" (heuristics.BWD_MODES); None takes
    heuristics.bwd_kernel's choice for the call (MHAKERN_TRITON_BWD, default deterministic).
    """
    B, H, Lq, D = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    if getattr(modes, "cu_seqlens_q", None) is not None:
        return _varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, scale, causal, key_lengths, modes, dmask,
                                bwd_mode)
    check_buffer("dq", dq, (B, H, Lq, D), q.dtype, q)
    check_buffer("dk", dk, (B, Hkv, Lk, D), q.dtype, q)
    check_buffer("dv", dv, (B, Hkv, Lk, Dv), q.dtype, q)
    check_buffer("lse", lse, (B, H, Lq), torch.float32, q, contiguous=True)
    if dmask is not None:
        check_buffer("dmask", dmask, (B, H, Lq, Lk), torch.float32, q, contiguous=True)
    margs = ModeArgs(B, H, Lq, Lk, causal, modes, q.device)
    plain = not margs.any() and not margs.modified() and dmask is None
    kernel = bwd_kernel(D, Dv, q.dtype, bwd_mode)
    n_rep = H // Hkv
    bd, bdv = head_block(D), head_block(Dv)
    prec = precision(q.dtype)
    has_kl = key_lengths is not None
    arch = arch_of(q)
    idx64 = needs_64bit_offsets(q, k, v, out, dout, dq, dk, dv, *(() if margs.mask is None else (margs.mask,)))
    with on_device(q):
        delta = torch.empty((B, H, Lq), dtype=torch.float32, device=q.device)
        bm_delta = min(64, next_pow2(Lq))
        _bwd_delta_kernel[(triton.cdiv(Lq, bm_delta) * H * B,)](
            out, dout, delta, out.stride(0), out.stride(1), out.stride(2),
            dout.stride(0), dout.stride(1), dout.stride(2), H, Lq,
            DV=Dv, BLOCK_M=bm_delta, BLOCK_DV=bdv, IDX64=idx64,
        )
        kl = key_lengths if has_kl else delta  # unused pointer when HAS_KL is False
        mask = margs.mask if margs.mask is not None else delta  # unused pointer when MASK_KIND is 0
        kv_args = (
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            dout.stride(0), dout.stride(1), dout.stride(2),
            dk.stride(0), dk.stride(1), dk.stride(2),
            dv.stride(0), dv.stride(1), dv.stride(2),
        )
        if kernel != "split":
            _fused_backward(q, k, v, dout, lse, delta, dq, dk, dv, kl, mask, dmask, kv_args, margs, scale,
                            causal, has_kl, prec, idx64, arch, deterministic=kernel == "deterministic")
            return dq, dk, dv

        cfg = dkdv_config(D, Dv, q.dtype, arch, **tile_modes(margs))
        hpp = packed_rows(Lq, n_rep, cfg.block_m)
        common = dict(D=D, DV=Dv, BLOCK_D=bd, BLOCK_DV=bdv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                      CAUSAL=causal, HAS_KL=has_kl, PREC=prec, IDX64=idx64,
                      num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        grid = (triton.cdiv(Lk, cfg.block_n) * Hkv * B,)
        if plain:
            _attn_bwd_dkdv_kernel[grid](q, k, v, dout, lse, delta, dk, dv, kl, *kv_args, H, Lq, Lk, n_rep, hpp,
                                        scale, **common)
        else:
            _attn_bwd_dkdv_modes_kernel[grid](
                q, k, v, dout, lse, delta, dk, dv, kl, mask, *kv_args, *margs.mask_strides,
                H, Lq, Lk, n_rep, hpp, scale, *margs.runtime(), *margs.modifier_args(delta), **margs.constexprs(),
                **common,
            )

        cfg = dq_config(D, Dv, q.dtype, arch, **tile_modes(margs))
        hpp, bm, grid = launch_geometry(B, H, Hkv, Lq, cfg.block_m)
        args = (
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            dout.stride(0), dout.stride(1), dout.stride(2),
            dq.stride(0), dq.stride(1), dq.stride(2),
        )
        common = dict(D=D, DV=Dv, BLOCK_D=bd, BLOCK_DV=bdv, BLOCK_M=bm, BLOCK_N=cfg.block_n,
                      CAUSAL=causal, HAS_KL=has_kl, PREC=prec, IDX64=idx64,
                      num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        if plain:
            _attn_bwd_dq_kernel[grid](q, k, v, dout, lse, delta, dq, kl, *args, H, Lq, Lk, n_rep, hpp, scale, **common)
        else:
            _attn_bwd_dq_modes_kernel[grid](
                q, k, v, dout, lse, delta, dq, kl, mask, dmask if dmask is not None else delta, *args,
                *margs.mask_strides, H, Lq, Lk, n_rep, hpp, scale, *margs.runtime(), *margs.modifier_args(delta),
                **margs.constexprs(), MASK_GRAD=dmask is not None, **common,
            )
    return dq, dk, dv


def _fused_backward(q, k, v, dout, lse, delta, dq, dk, dv, kl, mask, dmask, kv_args, margs, scale, causal, has_kl,
                    prec, idx64, arch, deterministic: bool):
    """The fused kernel (one program per key block, KV head and batch element: dK, dV and dQ's
    fp32 shares), then dQ converted into the caller's buffer: dq = scale * the fp32 sums.

    Deterministic: a zeroed int32 buffer holds the ticket counter (slot 0), the interpreter's
    order-error flag (slot 1) and one lock per row tile of dQ (see _fused_dq_add); the adds of
    each row tile follow the key-block order."""
    B, H, Lq, D = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    n_rep = H // Hkv
    cfg = fused_config(D, Dv, q.dtype, arch, **tile_modes(margs))
    hpp = packed_rows(Lq, n_rep, cfg.block_m)
    dq_acc = torch.zeros((B, H, Lq, D), dtype=torch.float32, device=q.device)
    n_locks = 2 + B * (H // hpp) * triton.cdiv(hpp * Lq, cfg.block_m) if deterministic else 1
    sem = _lock_buffer(n_locks, q.device)
    sequential = deterministic and INTERPRET
    common = dict(D=D, DV=Dv, BLOCK_D=head_block(D), BLOCK_DV=head_block(Dv), BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n, CAUSAL=causal, HAS_KL=has_kl, PREC=prec, IDX64=idx64,
                  DETERMINISTIC=deterministic, SEQUENTIAL=sequential,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    grid = (triton.cdiv(Lk, cfg.block_n) * Hkv * B,)
    if not margs.any() and not margs.modified() and dmask is None:
        _attn_bwd_fused_kernel[grid](q, k, v, dout, lse, delta, dk, dv, kl, dq_acc, sem, *kv_args,
                                     H, Lq, Lk, n_rep, hpp, scale, **common)
    else:
        _attn_bwd_fused_modes_kernel[grid](
            q, k, v, dout, lse, delta, dk, dv, kl, mask, dq_acc, sem, dmask if dmask is not None else delta,
            *kv_args, *margs.mask_strides, H, Lq, Lk, n_rep, hpp, scale, *margs.runtime(),
            *margs.modifier_args(delta), **margs.constexprs(), MASK_GRAD=dmask is not None, **common,
        )
    if sequential and int(sem[1]) != 0:
        raise RuntimeError("fused backward: a dQ add out of key-block order (a key block came before its "
                           "predecessor had added)")
    dq.copy_(dq_acc.mul_(scale))


def _varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, scale, causal, key_lengths, modes, dmask, bwd_mode):
    """The backward of packed sequences (the forward's record; shapes as attention_fwd's
    _varlen_forward, dq/dk/dv like q/k/v). Deterministic whatever ``bwd_mode`` asks ("atomic"
    takes the ordered fused kernel: the contract promises packed gradients bit for bit): the
    fused kernel, one program per (key block of max_seqlen_k, KV head, sequence) streaming its
    own sequence's rows, dQ's fp32 shares added in key-block order; or ("split") the split
    kernels, dK/dV over the same grid, dQ one program per (query tile of max_seqlen_q, head,
    sequence). Key blocks of another sequence are never loaded, nor past a sequence's keys.
    delta = rowsum(out * dout) is row-local, so the dense kernel computes it over the packed
    rows as one batch element."""
    from .attention_fwd import check_packing

    B, H, Tq, D = q.shape
    Hkv, Tk, Dv = k.shape[1], k.shape[2], v.shape[3]
    cu_q, cu_k, num_seqs, max_q, max_k = check_packing(q, modes, key_lengths)
    if dmask is not None:
        raise ValueError("dmask: packed sequences take no attn_mask, so no mask gradient")
    check_buffer("dq", dq, (1, H, Tq, D), q.dtype, q)
    check_buffer("dk", dk, (1, Hkv, Tk, D), q.dtype, q)
    check_buffer("dv", dv, (1, Hkv, Tk, Dv), q.dtype, q)
    check_buffer("lse", lse, (1, H, Tq), torch.float32, q, contiguous=True)
    margs = ModeArgs(num_seqs, H, Tq, Tk, causal, modes, q.device)
    kernel = bwd_kernel(D, Dv, q.dtype, bwd_mode)
    n_rep = H // Hkv
    bd, bdv = head_block(D), head_block(Dv)
    prec = precision(q.dtype)
    arch = arch_of(q)
    idx64 = needs_64bit_offsets(q, k, v, out, dout, dq, dk, dv)
    # Batch strides 0: the sequence's first token offsets the rows (CUQ, CUK).
    kv_args = (0, q.stride(1), q.stride(2), 0, k.stride(1), k.stride(2), 0, v.stride(1), v.stride(2),
               0, dout.stride(1), dout.stride(2), 0, dk.stride(1), dk.stride(2), 0, dv.stride(1), dv.stride(2))
    varlen = dict(CUQ=cu_q, CUK=cu_k, Tq=Tq, VARLEN=True)
    with on_device(q):
        delta = torch.empty((1, H, Tq), dtype=torch.float32, device=q.device)
        bm_delta = min(64, next_pow2(Tq))
        _bwd_delta_kernel[(triton.cdiv(Tq, bm_delta) * H,)](
            out, dout, delta, out.stride(0), out.stride(1), out.stride(2),
            dout.stride(0), dout.stride(1), dout.stride(2), H, Tq,
            DV=Dv, BLOCK_M=bm_delta, BLOCK_DV=bdv, IDX64=idx64,
        )
        # Tokens past the last sequence (a caller's Tq or Tk beyond cu_seqlens[-1]; the op layer
        # refuses that) get no store from the kernels: zeroed first.
        dk.zero_()
        dv.zero_()
        if kernel != "split":
            # One head per program (no packing of a KV head's query heads: rows_total varies
            # with the sequence), so the locks number (sequence, head, row tile of max_seqlen_q).
            cfg = fused_config(D, Dv, q.dtype, arch, **tile_modes(margs))
            dq_acc = torch.zeros((1, H, Tq, D), dtype=torch.float32, device=q.device)
            sem = _lock_buffer(2 + num_seqs * H * triton.cdiv(max_q, cfg.block_m), q.device)
            _attn_bwd_fused_modes_kernel[(triton.cdiv(max_k, cfg.block_n) * Hkv * num_seqs,)](
                q, k, v, dout, lse, delta, dk, dv, delta, delta, dq_acc, sem, delta, *kv_args, 0, 0, 0, 0,
                H, max_q, max_k, n_rep, 1, scale, *margs.runtime(), *margs.modifier_args(delta),
                **margs.constexprs(), MASK_GRAD=False, DETERMINISTIC=True, SEQUENTIAL=INTERPRET, **varlen,
                D=D, DV=Dv, BLOCK_D=bd, BLOCK_DV=bdv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=causal,
                HAS_KL=False, PREC=prec, IDX64=idx64, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )
            if INTERPRET and int(sem[1]) != 0:
                raise RuntimeError("fused backward: a dQ add out of key-block order (a key block came before its "
                                   "predecessor had added)")
            dq.copy_(dq_acc.mul_(scale))
            return dq, dk, dv
        cfg = dkdv_config(D, Dv, q.dtype, arch, **tile_modes(margs))
        common = dict(D=D, DV=Dv, BLOCK_D=bd, BLOCK_DV=bdv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                      CAUSAL=causal, HAS_KL=False, PREC=prec, IDX64=idx64,
                      num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        _attn_bwd_dkdv_modes_kernel[(triton.cdiv(max_k, cfg.block_n) * Hkv * num_seqs,)](
            q, k, v, dout, lse, delta, dk, dv, delta, delta, *kv_args, 0, 0, 0, 0,
            H, max_q, max_k, n_rep, 1, scale, *margs.runtime(), *margs.modifier_args(delta),
            **margs.constexprs(), **varlen, **common,
        )
        dq.zero_()
        cfg = dq_config(D, Dv, q.dtype, arch, **tile_modes(margs))
        bm = row_block(max_q, cfg.block_m)
        common = dict(common, BLOCK_M=bm, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        _attn_bwd_dq_modes_kernel[(triton.cdiv(max_q, bm) * H * num_seqs,)](
            q, k, v, dout, lse, delta, dq, delta, delta, delta, *kv_args[:12],
            0, dq.stride(1), dq.stride(2), 0, 0, 0, 0, H, max_q, max_k, n_rep, 1, scale, *margs.runtime(),
            *margs.modifier_args(delta), **margs.constexprs(), MASK_GRAD=False, **varlen, **common,
        )
    return dq, dk, dv


def _lock_buffer(n: int, device) -> torch.Tensor:
    """The fused kernel's zeroed int32 ticket counter (slot 0) and locks (a function of its own
    so that a test can hand the kernel a schedule that breaks the order)."""
    return torch.zeros((n,), dtype=torch.int32, device=device)


#: The kernels of this module by the AOT check's names (mhakern/kernels/aot.py).
KERNELS = {
    "delta": _bwd_delta_kernel,
    "dkdv": _attn_bwd_dkdv_kernel, "dkdv+modes": _attn_bwd_dkdv_modes_kernel,
    "dq": _attn_bwd_dq_kernel, "dq+modes": _attn_bwd_dq_modes_kernel,
    "fused": _attn_bwd_fused_kernel, "fused+modes": _attn_bwd_fused_modes_kernel,
}

__all__ = ["attention_backward", "KERNELS"]
