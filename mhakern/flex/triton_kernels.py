"""The Triton flex kernels, as the text triton_gen.py completes: ``__CAPS__`` becomes the
captures' parameters (pointer, sizes, count each) and ``__GRADS__`` the gradient buffers of the
captured tables (value and flat index, dense (B, H, Lq, Lk), per load node that feeds one).

Three kernels, each walking torch's BlockMask lists (the block sparsity is data):

* ``flex_fwd``: a program per (query block, row tile inside it; batch x head). Over the key
  blocks of the row block's partial list (``kv_num``/``kv_indices``: mask_fn evaluated) then of
  its full list (``full_kv_*``: mask_fn skipped), in tiles of BLOCK_N keys, an online softmax
  in base 2 over scores kept in natural units (lse = m + log l, one rounding from the scores the
  backward recomputes). A row that sees no key: output 0, lse -inf.
* ``flex_dq``: the same walk; P = exp(s - lse), dS = P (dP - delta) taken through score_bwd to
  the raw score, dQ += dS K.
* ``flex_dkdv``: a program per (key block, key tile inside it; batch x KV head). Over the query
  heads of its group and the transposed lists (``q_num_blocks``/``q_indices`` partial, then
  ``full_q_*``): dV += P^T dO, dK += dS^T Q; score_bwd stores the captured tables' per-score
  adjoints here, where every (b, h, i, j) is visited exactly once.

No atomics, and every sum runs in a fixed order (list order, heads in order): the backward is
bit-identical run to run. A mask block of QBS rows is split into tiles of BLOCK_M <= QBS rows or,
when QBS is smaller than the smallest tile (16, tl.dot's minimum), one tile whose rows past the
block are masked (likewise keys); so any block size works.

Products accumulate in float32: fp32 inputs multiply in IEEE fp32 (never tf32); with ``LOWP``
(fp16/bf16 inputs on a GPU, fp16 under the interpreter, whose bf16 tl.dot is wrong) the tiles stay
in their 16-bit dtype and P, dS are rounded to it before their products, as flash attention
does; everything else (scores, the modifiers, the softmax) is float32. Outputs are stored in the
inputs' dtype.
"""

TEMPLATE = '''

@triton.jit
def _up(x, LOWP: tl.constexpr):
    """A loaded tile as the products take it: float32 (products in IEEE fp32), or with LOWP
    (fp16/bf16 inputs) as loaded, for the tensor cores with fp32 accumulation."""
    # One return: Triton checks every return's type, even in a constexpr branch not taken.
    if LOWP:
        y = x
    else:
        y = x.to(tl.float32)
    return y


@triton.jit
def _mm(a, b, LOWP: tl.constexpr):
    """a @ b in fp32 accumulation: with LOWP ``a`` (an fp32 tile: P, dS) rounded to ``b``'s
    16-bit dtype, as flash attention does; else both fp32, multiplied exactly (never tf32)."""
    if LOWP:
        c = tl.dot(a.to(b.dtype), b)
    else:
        c = tl.dot(a, b, input_precision="ieee")
    return c

@triton.jit
def _tile(P, rows, ok, stride, NCOL: tl.constexpr, BLOCK: tl.constexpr, LOWP: tl.constexpr):
    """Rows ``rows`` of the row-major matrix at P (row stride ``stride``; rows not ``ok`` and
    columns past NCOL read 0), BLOCK columns, as the products take it (_up)."""
    cols = tl.arange(0, BLOCK)
    return _up(tl.load(P + rows[:, None] * stride + cols[None, :], mask=ok[:, None] & (cols[None, :] < NCOL),
                       other=0.0), LOWP)


@triton.jit
def _store_tile(P, rows, ok, stride, x, NCOL: tl.constexpr, BLOCK: tl.constexpr):
    """Stores tile ``x`` where _tile reads, in P's dtype."""
    cols = tl.arange(0, BLOCK)
    tl.store(P + rows[:, None] * stride + cols[None, :], x.to(P.dtype.element_ty),
             mask=ok[:, None] & (cols[None, :] < NCOL))


@triton.jit
def _program(NH, L, BS, nsub, BLOCK: tl.constexpr):
    """This program's (batch, head, mask block, positions of its tile, which of them lie in the
    block), for a grid of (blocks x nsub tiles of BLOCK, batch x NH heads) over L positions."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    blk = pid // nsub
    offs = blk * BS + (pid % nsub) * BLOCK + tl.arange(0, BLOCK)
    return (bh // NH).to(tl.int64), (bh % NH).to(tl.int64), blk, offs, offs < tl.minimum(blk * BS + BS, L)


@triton.jit
def _scores(q, k, b32, h32, qi, kj, row_ok, key_ok, sm_scale __CAPS__, PARTIAL: tl.constexpr, HAS_MASK: tl.constexpr,
            HAS_SCORE: tl.constexpr, LOWP: tl.constexpr):
    """(raw scores, modified scores with the hidden pairs at -inf, visibility) of a tile: the
    forward and both backward loops recompute the same scores this one way."""
    s_raw = _mm(q, tl.trans(k), LOWP) * sm_scale
    s = s_raw
    if HAS_SCORE:
        s = score_fwd(s_raw, b32, h32, qi, kj __CAPS__)
    vis = row_ok[:, None] & key_ok[None, :]
    if PARTIAL and HAS_MASK:
        vis = vis & mask_fn(b32, h32, qi, kj __CAPS__)
    return s_raw, tl.where(vis, s, float("-inf")), vis


@triton.jit
def _fwd_blocks(acc, l_i, m_i, q, b, h, offs_m, row_ok, K, V, stride_kn, stride_vn, NUM, IDX, Lk, KVBS, sm_scale
                __CAPS__, D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_DV: tl.constexpr, PARTIAL: tl.constexpr, HAS_MASK: tl.constexpr, HAS_SCORE: tl.constexpr,
                LOWP: tl.constexpr):
    # The modifiers see int32 indices (torch's dtype for them); addresses stay 64-bit.
    b32 = b.to(tl.int32)
    h32 = h.to(tl.int32)
    qi = offs_m[:, None]
    num = tl.load(NUM)
    for n in range(0, num):
        kstart = tl.load(IDX + n) * KVBS
        kend = tl.minimum(kstart + KVBS, Lk)
        for js in range(kstart, kend, BLOCK_N):
            offs_n = js + tl.arange(0, BLOCK_N)
            key_ok = offs_n < kend
            k = _tile(K, offs_n, key_ok, stride_kn, D, BLOCK_D, LOWP)
            _, s, _ = _scores(q, k, b32, h32, qi, offs_n[None, :], row_ok, key_ok, sm_scale __CAPS__, PARTIAL,
                              HAS_MASK, HAS_SCORE, LOWP)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row that has seen no key yet keeps m = -inf; shift by 0 there so exp2 gives 0, not NaN.
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.math.exp2((m_i - m_use) * LOG2E)
            p = tl.math.exp2((s - m_use[:, None]) * LOG2E)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = _tile(V, offs_n, key_ok, stride_vn, DV, BLOCK_DV, LOWP)
            acc = acc * alpha[:, None] + _mm(p, v, LOWP)
            m_i = m_new
    return acc, l_i, m_i


@triton.jit
def flex_fwd(Q, K, V, O, LSE, KV_NUM, KV_IDX, FKV_NUM, FKV_IDX __CAPS__,
             sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som,
             snb, snh, sib, sih, sir, sfnb, sfnh, sfib, sfih, sfir,
             H, n_rep, Lq, Lk, QBS, KVBS, nsub, sm_scale,
             D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_MASK: tl.constexpr, HAS_SCORE: tl.constexpr,
                LOWP: tl.constexpr,
             HAS_FULL: tl.constexpr):
    b, h, qb, offs_m, row_ok = _program(H, Lq, QBS, nsub, BLOCK_M)
    hkv = h // n_rep
    q = _tile(Q + b * sqb + h * sqh, offs_m, row_ok, sqm, D, BLOCK_D, LOWP)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    Kb = K + b * skb + hkv * skh
    Vb = V + b * svb + hkv * svh
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, b, h, offs_m, row_ok, Kb, Vb, skn, svn,
                                KV_NUM + b * snb + h * snh + qb, KV_IDX + b * sib + h * sih + qb * sir,
                                Lk, KVBS, sm_scale __CAPS__, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, True, HAS_MASK,
                                HAS_SCORE, LOWP)
    if HAS_FULL:
        acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, b, h, offs_m, row_ok, Kb, Vb, skn, svn,
                                    FKV_NUM + b * sfnb + h * sfnh + qb, FKV_IDX + b * sfib + h * sfih + qb * sfir,
                                    Lk, KVBS, sm_scale __CAPS__, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, False, HAS_MASK,
                                    HAS_SCORE, LOWP)
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    _store_tile(O + b * sob + h * soh, offs_m, row_ok, som, acc / l_safe[:, None], DV, BLOCK_DV)
    lse = tl.where(seen, m_i + tl.log(l_safe), float("-inf"))
    tl.store(LSE + (b * H + h) * Lq + offs_m, lse, mask=row_ok)


@triton.jit
def _dq_blocks(dq, q, do, lse_use, delta, b, h, offs_m, row_ok, K, V, stride_kn, stride_vn, NUM, IDX, Lk, KVBS,
               sm_scale __CAPS__ __GRADS__, D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PARTIAL: tl.constexpr, HAS_MASK: tl.constexpr,
               HAS_SCORE: tl.constexpr,
                LOWP: tl.constexpr):
    # The modifiers see int32 indices (torch's dtype for them); addresses stay 64-bit.
    b32 = b.to(tl.int32)
    h32 = h.to(tl.int32)
    qi = offs_m[:, None]
    num = tl.load(NUM)
    for n in range(0, num):
        kstart = tl.load(IDX + n) * KVBS
        kend = tl.minimum(kstart + KVBS, Lk)
        for js in range(kstart, kend, BLOCK_N):
            offs_n = js + tl.arange(0, BLOCK_N)
            key_ok = offs_n < kend
            k = _tile(K, offs_n, key_ok, stride_kn, D, BLOCK_D, LOWP)
            v = _tile(V, offs_n, key_ok, stride_vn, DV, BLOCK_DV, LOWP)
            kj = offs_n[None, :]
            s_raw, s, vis = _scores(q, k, b32, h32, qi, kj, row_ok, key_ok, sm_scale __CAPS__, PARTIAL, HAS_MASK,
                                    HAS_SCORE, LOWP)
            p = tl.math.exp2((s - lse_use[:, None]) * LOG2E)
            dp = _mm(do, tl.trans(v), LOWP)
            ds = p * (dp - delta[:, None])
            if HAS_SCORE:
                ds = score_bwd(s_raw, b32, h32, qi, kj __CAPS__, ds, 0, qi * 0 + kj, vis __GRADS__, False)
            dq += _mm(ds, k, LOWP)
    return dq


@triton.jit
def flex_dq(Q, K, V, DO, DQ, LSE, DELTA, KV_NUM, KV_IDX, FKV_NUM, FKV_IDX __CAPS__ __GRADS__,
            sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdom, sdqb, sdqh, sdqm,
            snb, snh, sib, sih, sir, sfnb, sfnh, sfib, sfih, sfir,
            H, n_rep, Lq, Lk, QBS, KVBS, nsub, sm_scale,
            D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_MASK: tl.constexpr, HAS_SCORE: tl.constexpr,
                LOWP: tl.constexpr,
            HAS_FULL: tl.constexpr):
    b, h, qb, offs_m, row_ok = _program(H, Lq, QBS, nsub, BLOCK_M)
    hkv = h // n_rep
    q = _tile(Q + b * sqb + h * sqh, offs_m, row_ok, sqm, D, BLOCK_D, LOWP)
    do = _tile(DO + b * sdob + h * sdoh, offs_m, row_ok, sdom, DV, BLOCK_DV, LOWP)
    lse = tl.load(LSE + (b * H + h) * Lq + offs_m, mask=row_ok, other=0.0)
    # A row with no visible key (lse -inf) takes +inf: every exp(s - lse) there is 0.
    lse_use = tl.where(lse == float("-inf"), float("inf"), lse)
    delta = tl.load(DELTA + (b * H + h) * Lq + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    Kb = K + b * skb + hkv * skh
    Vb = V + b * svb + hkv * svh
    dq = _dq_blocks(dq, q, do, lse_use, delta, b, h, offs_m, row_ok, Kb, Vb, skn, svn,
                    KV_NUM + b * snb + h * snh + qb, KV_IDX + b * sib + h * sih + qb * sir, Lk, KVBS, sm_scale
                    __CAPS__ __GRADS__, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, True, HAS_MASK,
                        HAS_SCORE, LOWP)
    if HAS_FULL:
        dq = _dq_blocks(dq, q, do, lse_use, delta, b, h, offs_m, row_ok, Kb, Vb, skn, svn,
                        FKV_NUM + b * sfnb + h * sfnh + qb, FKV_IDX + b * sfib + h * sfih + qb * sfir, Lk, KVBS,
                        sm_scale __CAPS__ __GRADS__, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, False, HAS_MASK,
                        HAS_SCORE, LOWP)
    _store_tile(DQ + b * sdqb + h * sdqh, offs_m, row_ok, sdqm, dq * sm_scale, D, BLOCK_D)


@triton.jit
def _dkdv_blocks(dk, dv, k, v, b, h, offs_n, key_ok, Q, DO, LSE, DELTA, stride_qm, stride_dom, NUM, IDX, H, Lq, Lk,
                 QBS, sm_scale __CAPS__ __GRADS__, D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PARTIAL: tl.constexpr, HAS_MASK: tl.constexpr,
                 HAS_SCORE: tl.constexpr,
                LOWP: tl.constexpr, CAP_GRAD: tl.constexpr):
    # The modifiers see int32 indices (torch's dtype for them); addresses stay 64-bit.
    b32 = b.to(tl.int32)
    h32 = h.to(tl.int32)
    kj = offs_n[None, :]
    num = tl.load(NUM)
    for n in range(0, num):
        qstart = tl.load(IDX + n) * QBS
        qend = tl.minimum(qstart + QBS, Lq)
        for ms in range(qstart, qend, BLOCK_M):
            offs_m = ms + tl.arange(0, BLOCK_M)
            row_ok = offs_m < qend
            q = _tile(Q, offs_m, row_ok, stride_qm, D, BLOCK_D, LOWP)
            do = _tile(DO, offs_m, row_ok, stride_dom, DV, BLOCK_DV, LOWP)
            lse = tl.load(LSE + offs_m, mask=row_ok, other=0.0)
            lse_use = tl.where(lse == float("-inf"), float("inf"), lse)
            delta = tl.load(DELTA + offs_m, mask=row_ok, other=0.0)
            qi = offs_m[:, None]
            s_raw, s, vis = _scores(q, k, b32, h32, qi, kj, row_ok, key_ok, sm_scale __CAPS__, PARTIAL, HAS_MASK,
                                    HAS_SCORE, LOWP)
            p = tl.math.exp2((s - lse_use[:, None]) * LOG2E)
            dv += _mm(tl.trans(p), do, LOWP)
            dp = _mm(do, tl.trans(v), LOWP)
            ds = p * (dp - delta[:, None])
            if HAS_SCORE:
                # The captured tables' adjoints go to their dense (B, H, Lq, Lk) buffers.
                # (b, h)'s offset in 64 bits, the tile's inside it in 32 (an int64 tile spilled).
                ds = score_bwd(s_raw, b32, h32, qi, kj __CAPS__, ds, (b * H + h) * Lq * Lk, qi * Lk + kj, vis
                               __GRADS__, CAP_GRAD)
            dk += _mm(tl.trans(ds), q, LOWP)
    return dk, dv


@triton.jit
def flex_dkdv(Q, K, V, DO, DK, DV_, LSE, DELTA, Q_NUM, Q_IDX, FQ_NUM, FQ_IDX __CAPS__ __GRADS__,
              sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdom, sdkb, sdkh, sdkn, sdvb, sdvh, sdvn,
              snb, snh, sib, sih, sir, sfnb, sfnh, sfib, sfih, sfir,
              H, Hkv, n_rep, Lq, Lk, QBS, KVBS, nsub, sm_scale,
              D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_MASK: tl.constexpr, HAS_SCORE: tl.constexpr,
                LOWP: tl.constexpr,
              HAS_FULL: tl.constexpr, CAP_GRAD: tl.constexpr):
    b, hkv, kb, offs_n, key_ok = _program(Hkv, Lk, KVBS, nsub, BLOCK_N)
    k = _tile(K + b * skb + hkv * skh, offs_n, key_ok, skn, D, BLOCK_D, LOWP)
    v = _tile(V + b * svb + hkv * svh, offs_n, key_ok, svn, DV, BLOCK_DV, LOWP)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    for hh in range(0, n_rep):
        h = hkv * n_rep + hh
        Qh = Q + b * sqb + h * sqh
        DOh = DO + b * sdob + h * sdoh
        LSEh = LSE + (b * H + h) * Lq
        DELTAh = DELTA + (b * H + h) * Lq
        dk, dv = _dkdv_blocks(dk, dv, k, v, b, h, offs_n, key_ok, Qh, DOh, LSEh, DELTAh, sqm, sdom,
                              Q_NUM + b * snb + h * snh + kb, Q_IDX + b * sib + h * sih + kb * sir, H, Lq, Lk, QBS,
                              sm_scale __CAPS__ __GRADS__, D, DV, BLOCK_M, BLOCK_D, BLOCK_DV, True, HAS_MASK,
                              HAS_SCORE, LOWP, CAP_GRAD)
        if HAS_FULL:
            dk, dv = _dkdv_blocks(dk, dv, k, v, b, h, offs_n, key_ok, Qh, DOh, LSEh, DELTAh, sqm, sdom,
                                  FQ_NUM + b * sfnb + h * sfnh + kb, FQ_IDX + b * sfib + h * sfih + kb * sfir, H, Lq,
                                  Lk, QBS, sm_scale __CAPS__ __GRADS__, D, DV, BLOCK_M, BLOCK_D, BLOCK_DV, False,
                                  HAS_MASK, HAS_SCORE, LOWP, CAP_GRAD)
    _store_tile(DK + b * sdkb + hkv * sdkh, offs_n, key_ok, sdkn, dk * sm_scale, D, BLOCK_D)
    _store_tile(DV_ + b * sdvb + hkv * sdvh, offs_n, key_ok, sdvn, dv, DV, BLOCK_DV)
'''
