"""Triton device helpers shared by the forward and backward kernels: the row-tile geometry, key
lengths and visibility (causal, bands, windows), tile loads and stores, the mask's scores, the
dropout hash and the score modifiers (softcap, ALiBi; docs/contract.md). Every function here is
``@triton.jit``; the kernels that use them live in attention_fwd.py, attention_fwd_desc.py and
attention_bwd.py."""
import triton
import triton.language as tl


@triton.jit
def unfold_rows_grid(H, Lq, heads_per_prog, BLOCK_M: tl.constexpr):
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
def row_tile(pid_m, pid_h, heads_per_prog, n_rep, Lq, BLOCK_M: tl.constexpr):
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
def key_length(KL, b, Lk, HAS_KL: tl.constexpr):
    """Key length of batch element ``b``, clamped to [0, Lk]: callers validate key_lengths, but a
    value out of range must never make a kernel read outside k and v."""
    if HAS_KL:
        return tl.minimum(tl.maximum(tl.load(KL + b), 0), Lk)
    return Lk


@triton.jit
def last_visible_key(i, lk_b, Lq, CAUSAL: tl.constexpr):
    """Per row, the last key it sees (bottom-right causal alignment)."""
    if CAUSAL:
        return i + lk_b - Lq
    return i * 0 + lk_b - 1


@triton.jit
def elem_idx(x, IDX64: tl.constexpr):
    """Element offsets inside one batch element in 32 bits, unless the launcher found a tensor
    whose batch element spans 2**31 elements or more (IDX64). Batch offsets are always 64-bit;
    32-bit offsets halve the registers a tile of addresses takes."""
    if IDX64:
        return x.to(tl.int64)
    return x


@triton.jit
def tile_ptrs(base, row_off, BLOCK: tl.constexpr):
    """Pointers to a (rows, BLOCK) tile: row r starts at ``base + row_off[r]``, columns are unit-stride."""
    return base + row_off[:, None] + tl.arange(0, BLOCK)[None, :]


@triton.jit
def load_tile(base, row_off, row_ok, COLS: tl.constexpr, BLOCK: tl.constexpr, ROW_MASK: tl.constexpr):
    """A (rows, BLOCK) tile of a slab with COLS columns, zero outside. Masks only what can be out
    of range: the columns when COLS < BLOCK (padded head dims), the rows when ROW_MASK (a key
    block wholly inside the visible keys needs none)."""
    ptrs = tile_ptrs(base, row_off, BLOCK)
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
def store_tile(base, row_off, row_ok, x, COLS: tl.constexpr, BLOCK: tl.constexpr):
    ptrs = tile_ptrs(base, row_off, BLOCK)
    cols = tl.arange(0, BLOCK)
    if COLS < BLOCK:
        tl.store(ptrs, x, mask=row_ok[:, None] & (cols[None, :] < COLS))
    else:
        tl.store(ptrs, x, mask=row_ok[:, None])


@triton.jit
def load_rows(base, hh, i, stride_h, stride_m, row_ok, DIM: tl.constexpr, BLOCK: tl.constexpr,
               IDX64: tl.constexpr):
    """Rows (hh, i) of a (heads, length, DIM) slab, zero-padded to BLOCK columns."""
    return load_tile(base, elem_idx(hh, IDX64) * stride_h + elem_idx(i, IDX64) * stride_m, row_ok, DIM, BLOCK, True)


@triton.jit
def key_range(i_lo, i_hi, lk_b, Lq, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr):
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
def diagonal(i, lk_b, Lq, TOP_LEFT: tl.constexpr):
    """Per row, the key on its causal diagonal: ``i + off`` (docs/contract.md, "Visibility")."""
    if TOP_LEFT:
        return i
    return i + lk_b - Lq


@triton.jit
def band_edges(i, lk_b, Lq, win_l, win_r, TOP_LEFT: tl.constexpr):
    """Per row, the first and last key of its band ``[i + off - L, i + off + R]`` (BAND mode;
    not clipped to [0, lk_b): callers test ``j < lk_b`` anyway)."""
    d = diagonal(i, lk_b, Lq, TOP_LEFT)
    return d - win_l, d + win_r


@triton.jit
def band_key_range(i_lo, i_hi, lk_b, Lq, win_l, win_r, TOP_LEFT: tl.constexpr, BLOCK_N: tl.constexpr):
    """(start, full_lo, full_hi, stop) for a row tile of positions [i_lo, i_hi] in BAND mode:
    keys [start, full_lo) and [full_hi, stop) need the mask, [full_lo, full_hi) are seen by every
    row of the tile, keys outside [start, stop) by none. start, full_lo, full_hi are multiples
    of BLOCK_N. Both band edges grow with i, so the tile's first and last rows bound them."""
    kmin_lo, kmax_lo = band_edges(i_lo, lk_b, Lq, win_l, win_r, TOP_LEFT)
    kmin_hi, kmax_hi = band_edges(i_hi, lk_b, Lq, win_l, win_r, TOP_LEFT)
    stop = tl.minimum(lk_b, tl.maximum(kmax_hi + 1, 0))
    start = (tl.maximum(kmin_lo, 0) // BLOCK_N) * BLOCK_N
    full_hi = (tl.minimum(lk_b, tl.maximum(kmax_lo + 1, 0)) // BLOCK_N) * BLOCK_N
    full_lo = ((tl.maximum(kmin_hi, 0) + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    full_hi = tl.maximum(full_hi, start)
    full_lo = tl.minimum(tl.maximum(full_lo, start), full_hi)
    return start, full_lo, full_hi, stop


@triton.jit
def mask_scores(s, ptrs, ld_mask, MASK_KIND: tl.constexpr):
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
def mix32(x):
    """lowbias32 finaliser on uint32 (docs/contract.md, "Dropout"); multiplies wrap mod 2**32."""
    x ^= x >> 16
    x = x * 0x21F0AAAD
    x ^= x >> 15
    x = x * 0x735A2D97
    x ^= x >> 15
    return x


@triton.jit
def drop_rows(seed_lo, seed_hi, b, H, hh, i):
    """Per row (query head ``hh``, position ``i``): ``r_i`` of the contract's keep hash. The
    seed halves arrive as int32 holding the uint32 bits."""
    lo = seed_lo.to(tl.uint32, bitcast=True)
    hi = seed_hi.to(tl.uint32, bitcast=True)
    bh = (b * H + hh).to(tl.uint32)  # b is int64: (b * H + h) mod 2**32
    s_bh = mix32(lo ^ mix32(hi ^ bh))
    return mix32(s_bh ^ i.to(tl.uint32))


@triton.jit
def row_tile_modes(
    i, i_lo, i_hi, hh, b, lk_b, H, Lq, win_l, win_r, seed_lo, seed_hi, MASK, stride_mb, stride_mh, stride_mm,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, IDX64: tl.constexpr, BAND: tl.constexpr,
    TOP_LEFT: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr,
):
    """What a row tile of the forward and the dQ pass needs of the call's modes, per row and for
    the tile: (kmin, kmax) each row's first and last visible key (kmin = kmax without BAND,
    unused then), (start, full_lo, full_hi, stop) the tile's key range (band_key_range's
    meaning; start = full_lo = 0 without BAND), the mask's scalar base and per-row offsets, and
    the rows' dropout hashes r_i (``i`` and ``MASK`` pass through where the mode is off)."""
    if BAND:
        kmin, kmax = band_edges(i, lk_b, Lq, win_l, win_r, TOP_LEFT)
        start, full_lo, full, hi = band_key_range(i_lo, i_hi, lk_b, Lq, win_l, win_r, TOP_LEFT, BLOCK_N)
    else:
        kmax = last_visible_key(i, lk_b, Lq, CAUSAL)
        kmin = kmax
        full, hi = key_range(i_lo, i_hi, lk_b, Lq, CAUSAL, BLOCK_N)
        start = 0
        full_lo = 0
    # The mask's address splits into a scalar base and per-element offsets (int32 unless IDX64),
    # so that no (rows x keys) tile of 64-bit pointers stays live across the loop.
    m_base = MASK
    m_off = i
    if MASK_KIND != 0:
        m_base = MASK + b * stride_mb
        m_off = elem_idx(hh, IDX64) * stride_mh + elem_idx(i, IDX64) * stride_mm
    r_drop = i
    if DROPOUT:
        r_drop = drop_rows(seed_lo, seed_hi, b, H, hh, i)
    return kmin, kmax, start, full_lo, full, hi, m_base, m_off, r_drop


@triton.jit
def keep_bits(r_i, j, drop_thr):
    """Keep bits of the (rows, keys) tile given per-row ``r_i`` and per-key ``j`` laid out for
    broadcasting (``r_i[:, None]`` and ``j[None, :]`` or transposed)."""
    return mix32(r_i + j.to(tl.uint32)) >= drop_thr.to(tl.uint32, bitcast=True)


# tanh in fp32 to about an ulp, from what every Triton version and the interpreter have (no
# libdevice: triton 3.9's interpreter returns None for libdevice.tanh). |x| < 0.625:
# x + x z P(z), z = x^2, P of degree 4 fitted (least squares, relative error) for this file;
# max error 1.4 * 2**-24 relative in fp32. Beyond: (1 - e) / (1 + e), e = exp(-2|x|) <= 0.29, so
# no cancellation; 2.8 * 2**-24 with an exact exp2 (the GPU's ex2.approx adds about 2 ulp).
# +-inf give +-1, NaN stays NaN.
@triton.jit
def tanh_f32(x):
    a = tl.abs(x)
    z = x * x
    small = x + x * z * (-0.333332896 + z * (0.133316174 + z * (-0.0537544340 + z * (0.0206870623
                                                                                    + z * -0.00575835211))))
    e = tl.math.exp2(a * -2.8853900817779268)  # exp(-2|x|)
    big = (1.0 - e) / (1.0 + e)
    big = tl.where(x < 0, -big, big)
    return tl.where(a < 0.625, small, big)


@triton.jit
def alibi_rows(SLOPES, slope_sb, slope_sh, b, hh, i, lk_b, Lq, row_ok, TOP_LEFT: tl.constexpr):
    """Per row (query head ``hh``, position ``i`` of batch element ``b``): its ALiBi slope
    ``slope[b, hh]`` and its diagonal ``i + off`` in fp32 (exact: positions stay below 2**24)."""
    slope = tl.load(SLOPES + b * slope_sb + hh * slope_sh, mask=row_ok, other=0.0)
    return slope, diagonal(i, lk_b, Lq, TOP_LEFT).to(tl.float32)


@triton.jit
def modify_scores(s, softcap, inv_cap, slope, diag, j, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
                  KEYS_FIRST: tl.constexpr):
    """The score modifiers on a tile of scaled scores ``s`` (docs/contract.md, "Score
    modifiers"): softcap ``s = softcap * tanh(s / softcap)``, then ALiBi ``s -= slope * |diag - j|``
    with the rows' ``slope`` and ``diag`` (alibi_rows) and the keys ``j``; the tile is (rows,
    keys), or (keys, rows) with KEYS_FIRST. Returns (scores, tanh): the backward's cap
    derivative is ``1 - tanh^2``, from the capped value (``tanh`` is ``s`` itself without SOFTCAP)."""
    t = s
    if SOFTCAP:
        t = tanh_f32(s * inv_cap)
        s = softcap * t
    if ALIBI:
        if KEYS_FIRST:
            s = s - slope[None, :] * tl.abs(diag[None, :] - j.to(tl.float32)[:, None])
        else:
            s = s - slope[:, None] * tl.abs(diag[:, None] - j.to(tl.float32)[None, :])
    return s, t


@triton.jit
def cap_inverse(softcap, SOFTCAP: tl.constexpr):
    """1 / softcap for modify_scores (computed once per program; unused without SOFTCAP)."""
    if SOFTCAP:
        return 1.0 / softcap
    return softcap
