"""Packed sequences (mhakern.attention_varlen) and the KV cache (mhakern.attention_with_kvcache)
on every backend whose features list the mode, against the float64 reference computed per
sequence (packed) or on the dense K/V the cache holds (cache); errors name the argument.

docs/contract.md, "Packed sequences" and "KV cache".
"""
from __future__ import annotations

import math

import pytest
import torch

import mhakern
from mhakern import backends, reference
from mhakern.modes import Modes
from mhakern.checks import draw_seed

from attn_testing import rule_check, usable_backends


def _serving(feature):
    """The usable backends that list ``feature`` and take this file's operands (CPU float32, head
    dim 16): on a GPU machine the CUDA-only backends are left out here (the CUDA kernels run these
    cases in the emulator, tests/test_cuda_emulator.py)."""
    probe = torch.zeros(1, 2, 3, D)
    return [n for n in usable_backends()
            if feature in backends.get(n).features and backends.get(n).supports(probe, probe, probe, False, None) is None]


# Lengths per sequence: an empty query side, an empty key side (rows see nothing), one token,
# one longer than any kernel's tile, Lq_s != Lk_s.
LQ = [3, 0, 1, 70, 5, 2]
LK = [5, 4, 1, 75, 0, 9]
H, D = 4, 16


def _cu(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)


# (causal, causal_align, window, dropout_p, Hkv, modifiers): modifiers are softcap/ALiBi, used
# where the backend lists them.
CASES = [
    (False, "bottom_right", None, 0.0, 2, False),
    (True, "bottom_right", None, 0.2, 4, False),
    (True, "top_left", (3, -1), 0.0, 1, True),
    (False, "bottom_right", (4, 2), 0.0, 2, True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"causal{int(c[0])}-{c[1]}-w{c[2]}-p{c[3]}-kv{c[4]}-mod{int(c[5])}")
@pytest.mark.parametrize("name", _serving("varlen"))
def test_varlen_forward_and_gradients(name, case):
    causal, align, window, p, Hkv, mods = case
    be = backends.get(name)
    softcap = 8.0 if mods and "softcap" in be.features else None
    alibi = (torch.rand(len(LQ), H) * 0.3) if mods and "alibi" in be.features else None
    dt = torch.float32
    g = torch.Generator().manual_seed(1)
    Tq, Tk = sum(LQ), sum(LK)
    # q strided as a (H, T, D) tensor seen as (T, H, D): any strides with unit last stride.
    q = torch.randn(H, Tq, D, generator=g).transpose(0, 1).requires_grad_()
    k = torch.randn(Tk, Hkv, D, generator=g).requires_grad_()
    v = torch.randn(Tk, Hkv, D, generator=g).requires_grad_()
    sinks = (torch.randn(H, generator=g)).requires_grad_() if not causal else None
    dout = torch.randn(Tq, H, D, generator=g)
    cq, ck = _cu(LQ), _cu(LK)
    out, lse = mhakern.attention_varlen(
        q, k, v, cq, ck, max(LQ), max(LK), causal=causal, causal_align=align, window=window, dropout_p=p,
        generator=torch.Generator().manual_seed(5), softcap=softcap, alibi_slopes=alibi, sinks=sinks, backend=name,
        return_lse=True)
    assert out.shape == (Tq, H, D) and lse.shape == (H, Tq) and lse.dtype == torch.float32
    leaves = [q, k, v] + ([sinks] if sinks is not None else [])
    grads = torch.autograd.grad(out, leaves, dout)

    # The oracle: each sequence as a dense batch of one (dropout hashed with b = s).
    seed = draw_seed(torch.Generator().manual_seed(5)) if p > 0 else 0
    wl, wr = (-1, -1) if window is None else window
    if causal and window is not None:
        wr = 0
    base = Modes(dropout_p=p, seed=seed, top_left=align == "top_left", window_left=wl, window_right=wr,
                 softcap=softcap or 0.0, sinks=sinks)

    def run(upcast):
        src = [x.detach().to(torch.float64 if upcast else dt).requires_grad_() for x in leaves]
        qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in src[:3])
        outs, lses, q0, k0 = [], [], 0, 0
        for s, (lq, lk) in enumerate(zip(LQ, LK)):
            m = base._replace(sinks=src[3] if sinks is not None else None,
                              alibi_slopes=None if alibi is None else alibi[s : s + 1])
            a = (qs[:, :, q0:q0 + lq], ks[:, :, k0:k0 + lk], vs[:, :, k0:k0 + lk])
            outs.append(reference.attention(*a, None, causal, None, upcast, m, batch_offset=s))
            lses.append(reference.attention_forward(*[x.detach() for x in a], None, causal, None, True, m,
                                                    batch_offset=s)[1])
            q0, k0 = q0 + lq, k0 + lk
        o = torch.cat(outs, 2)[0].transpose(0, 1)
        return o, torch.cat(lses, 2)[0], torch.autograd.grad(o, src, dout.to(o.dtype), allow_unused=True)

    o64, lse64, g64 = run(True)
    oT, _, gT = run(False)
    rule_check("out", out, o64, oT, dt, 2)
    dead = torch.isneginf(lse64)
    assert torch.equal(torch.isneginf(lse), dead), "lse: -inf exactly on the rows that see no key"
    assert (lse[~dead].double() - lse64[~dead]).abs().max() < 1e-4
    # Rows of sequences without keys: output 0; their keys and queries: zero gradients.
    if sinks is None:
        assert out[sum(LQ[:4]):sum(LQ[:5])].abs().max() == 0
    for nm, got, r64, rT in zip(("dq", "dk", "dv", "dsinks"), grads, g64, gT):
        rule_check(nm, got, r64, rT, dt, 3)
    # Keys of the sequence without queries, queries of the one without keys: zero gradients.
    assert grads[1][5:9].abs().max() == 0 and grads[0][sum(LQ[:4]):sum(LQ[:5])].abs().max() == 0
    assert grads[0][:3].abs().max() > 0


def test_varlen_deterministic_and_matches_dense_for_one_sequence():
    # One sequence is the dense call; two runs give the same bits.
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(7, 2, 8, generator=g).requires_grad_() for _ in range(3))
    cu = torch.tensor([0, 7], dtype=torch.int32)
    for name in _serving("varlen"):
        outs = [mhakern.attention_varlen(q, k, v, cu, cu, 7, 7, causal=True, backend=name) for _ in range(2)]
        gs = [torch.autograd.grad(o.sum(), (q, k, v)) for o in outs]
        assert torch.equal(outs[0], outs[1]) and all(torch.equal(a, b) for a, b in zip(*gs))
        dense = mhakern.attention(*(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)), causal=True, backend=name)
        torch.testing.assert_close(outs[0], dense[0].transpose(0, 1))


def test_varlen_of_equal_lengths_is_the_dense_batch():
    # Equal-length sequences are the dense batch, bit for bit in the dropout keep mask (b = s)
    # and per sequence in the ALiBi slopes: the dense call is the independent oracle here.
    g = torch.Generator().manual_seed(4)
    S, Lq, Lk = 3, 5, 6
    q = torch.randn(S * Lq, 2, 8, generator=g).requires_grad_()
    k, v = (torch.randn(S * Lk, 1, 8, generator=g).requires_grad_() for _ in range(2))
    cq = torch.arange(0, S * Lq + 1, Lq, dtype=torch.int32)
    ck = torch.arange(0, S * Lk + 1, Lk, dtype=torch.int32)
    for name in _serving("varlen"):
        kw = dict(causal=True, dropout_p=0.3, backend=name)
        if "alibi" in backends.get(name).features:
            kw["alibi_slopes"] = torch.rand(S, 2)
        out = mhakern.attention_varlen(q, k, v, cq, ck, Lq, Lk, generator=torch.Generator().manual_seed(9), **kw)
        gp = torch.autograd.grad(out.sum(), (q, k, v))
        qd, kd, vd = (x.view(S, -1, x.shape[1], 8).transpose(1, 2) for x in (q, k, v))
        dense = mhakern.attention(qd, kd, vd, generator=torch.Generator().manual_seed(9), **kw)
        gd = torch.autograd.grad(dense.sum(), (q, k, v))
        torch.testing.assert_close(out, dense.transpose(1, 2).reshape(S * Lq, 2, 8))
        for a, b in zip(gp, gd):
            torch.testing.assert_close(a, b)


def _paged(cache_dense, page_size, g, shared=False):
    """A paged copy of dense (B, Hkv, L, D) caches: pages in random order inside a pool with spare
    pages, stored as FlashAttention's (num_pages, page_size, Hkv, D) seen through transpose(1, 2);
    ``shared``: element 1's first page is element 0's."""
    B, Hkv, L, Dd = cache_dense.shape
    P = L // page_size
    n_pages = B * P + 3
    order = torch.randperm(n_pages, generator=g)[: B * P].view(B, P).to(torch.int32)
    if shared:
        order[1, 0] = order[0, 0]
        cache_dense = cache_dense.clone()
        cache_dense[1, :, :page_size] = cache_dense[0, :, :page_size]
    pool = torch.randn(n_pages, page_size, Hkv, Dd, generator=g).transpose(1, 2)
    pool[order.long()] = cache_dense.view(B, Hkv, P, page_size, Dd).permute(0, 2, 1, 3, 4)
    return pool, order, cache_dense


@pytest.mark.parametrize("kind", ["dense", "batch_idx", "page1", "page16", "page5_shared"])
def test_kvcache_append_and_attention(kind):
    feature = {"dense": None, "batch_idx": "cache_batch_idx"}.get(kind, "paged")
    names = usable_backends() if feature is None else _serving(feature)
    g = torch.Generator().manual_seed(11)
    B, Hkv, Lq, L_new = 3, 2, 2, 2
    L = 80 if kind == "page16" else 40  # logical positions per sequence
    seqlens = torch.tensor([0, 13, L - L_new], dtype=torch.int32)
    if kind == "page5_shared":
        seqlens = torch.tensor([7, 9, 20], dtype=torch.int32)  # the shared first page is only read
    dense0 = torch.randn(B, Hkv, L, D, generator=g)
    q = torch.randn(B, H, Lq, D, generator=g)
    kn, vn = torch.randn(B, Hkv, L_new, D, generator=g), torch.randn(B, Hkv, L_new, D, generator=g)
    for name in names:
        kw = {}
        if kind in ("dense", "batch_idx"):
            idx = torch.tensor([2, 0, 4], dtype=torch.int32)
            if kind == "dense":
                kc, vc = dense0.clone(), (dense0 * 0.5).clone()
            else:
                kc, vc = torch.randn(5, Hkv, L, D, generator=g), torch.randn(5, Hkv, L, D, generator=g)
                kc[idx.long()], vc[idx.long()] = dense0, dense0 * 0.5
                kw["cache_batch_idx"] = idx
            kd, vd = dense0.clone(), dense0 * 0.5
        else:
            ps = {"page1": 1, "page16": 16, "page5_shared": 5}[kind]
            kc, bt, kd = _paged(dense0, ps, g, shared=kind == "page5_shared")
            vc = kc * 0.5
            vd = kd * 0.5
            kw["block_table"] = bt
        # The expected logical K/V after the append.
        for b in range(B):
            s0 = int(seqlens[b])
            kd[b, :, s0:s0 + L_new], vd[b, :, s0:s0 + L_new] = kn[b], vn[b]
        out = mhakern.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, causal=True, window=(6, -1),
                                             backend=name, **kw)
        kl = seqlens + L_new
        m = Modes(window_left=6, window_right=0)
        ref64 = reference.attention_forward(q.double(), kd.double(), vd.double(), None, True, kl, True, m)[0]
        refT = reference.attention_forward(q, kd, vd, None, True, kl, False, m)[0]
        rule_check(f"{name} out", out, ref64, refT, torch.float32, 2)
        # The cache now holds the new keys where the addressing says.
        got_k = reference.gather_cache(kc, vc, Modes(**kw))[0] if kw else kc
        torch.testing.assert_close(got_k, kd, rtol=0, atol=0)


def test_kvcache_batch_idx_repeats_without_append():
    g = torch.Generator().manual_seed(2)
    kc, vc = torch.randn(2, 1, 9, 8, generator=g), torch.randn(2, 1, 9, 8, generator=g)
    q = torch.randn(3, 2, 1, 8, generator=g)
    idx = torch.tensor([1, 1, 0], dtype=torch.int32)
    lens = torch.tensor([9, 4, 6], dtype=torch.int32)
    for name in _serving("cache_batch_idx"):
        out = mhakern.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, cache_batch_idx=idx, backend=name)
        ref = reference.attention_forward(q.double(), kc[idx.long()].double(), vc[idx.long()].double(), None, False,
                                          lens, True)[0]
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_errors_name_the_argument():
    q, k, v = torch.randn(6, 2, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    for bad, msg in ((torch.tensor([1, 2, 6]), "cu_seqlens_q: expected 0 first"),
                     (torch.tensor([0, 2, 5]), "cu_seqlens_q: expected the token count 6 last"),
                     (torch.tensor([0, 4, 2, 6]), "cu_seqlens_q, cu_seqlens_k: expected one entry more"),
                     (torch.tensor([0, 2.0, 6]), "cu_seqlens_q: expected a 1-D integer tensor")):
        with pytest.raises((ValueError, TypeError), match=msg):
            mhakern.attention_varlen(q, k, v, bad, cu, 6, 6)
    with pytest.raises(ValueError, match="cu_seqlens_k: expected non-decreasing"):
        mhakern.attention_varlen(q, k, v, cu, torch.tensor([0, 7, 6]), 6, 6)
    with pytest.raises(ValueError, match="cu_seqlens_q: sequence 1 has 4 tokens, more than max_seqlen_q = 3"):
        mhakern.attention_varlen(q, k, v, cu, cu, 3, 6)
    with pytest.raises(ValueError, match="max_seqlen_k"):
        mhakern.attention_varlen(q, k, v, cu, cu, 6, 9)
    with pytest.raises(ValueError, match="q: expected 3 dims"):
        mhakern.attention_varlen(q[None], k, v, cu, cu, 6, 6)
    with pytest.raises(ValueError, match="alibi_slopes"):
        mhakern.attention_varlen(q, k, v, cu, cu, 6, 6, alibi_slopes=torch.ones(3, 2))

    kc, vc = torch.zeros(2, 2, 8, 8), torch.zeros(2, 2, 8, 8)
    qc, kn = torch.randn(2, 2, 1, 8), torch.randn(2, 2, 3, 8)
    lens = torch.tensor([2, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="k: 3 new keys"):
        mhakern.attention_with_kvcache(qc, kc, vc, kn, kn, cache_seqlens=lens)
    assert kc.abs().max() == 0, "nothing written when the new keys do not fit"
    with pytest.raises(ValueError, match="q: attention_with_kvcache is forward only"):
        mhakern.attention_with_kvcache(qc.requires_grad_(), kc, vc, cache_seqlens=lens)
    qc = qc.detach()
    with pytest.raises(ValueError, match="k_cache: 3 cache rows"):
        mhakern.attention_with_kvcache(qc, torch.zeros(3, 2, 8, 8), torch.zeros(3, 2, 8, 8), cache_seqlens=lens)
    with pytest.raises(ValueError, match=r"block_table: values must lie in \[0, 2\)"):
        mhakern.attention_with_kvcache(qc, kc, vc, cache_seqlens=lens,
                                       block_table=torch.tensor([[0, 1], [1, 2]], dtype=torch.int32))
    with pytest.raises(ValueError, match="k: two batch elements would append into the same cache slot"):
        mhakern.attention_with_kvcache(qc, kc, vc, kn[:, :, :1], kn[:, :, :1], cache_seqlens=torch.tensor([3, 3]),
                                       cache_batch_idx=torch.tensor([1, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="k, v: give both"):
        mhakern.attention_with_kvcache(qc, kc, vc, kn, None, cache_seqlens=lens)
    # The op refuses the cache in a backward, and packing with key_lengths, by name.
    m = Modes(cache_batch_idx=torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="cache_batch_idx, block_table: the KV-cache path is forward only"):
        torch.ops.mhakern.attn_bwd(qc, qc, kc, kc, qc, torch.zeros(2, 2, 1), 0.3, False, None, "auto", *m.op_args())
    m = Modes(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6, max_seqlen_k=6)
    q4 = q.transpose(0, 1).unsqueeze(0)
    with pytest.raises(ValueError, match="key_lengths: not with packed sequences"):
        torch.ops.mhakern.attn_fwd(q4, q4, q4, 0.3, False, torch.tensor([6]), "auto", *m.op_args())
    assert math.isfinite(float(torch.ops.mhakern.attn_fwd(q4, q4, q4, 0.3, False, None, "auto", *m.op_args())[0].sum()))


@pytest.mark.parametrize("name", usable_backends())
def test_a_backend_without_the_feature_refuses_it_by_name(name):
    feats = backends.get(name).features
    q = torch.randn(4, 2, 16)
    cu = torch.tensor([0, 1, 4], dtype=torch.int32)
    calls = {
        "varlen": lambda: mhakern.attention_varlen(q, q, q, cu, cu, 3, 3, backend=name),
        "cache_batch_idx": lambda: mhakern.attention_with_kvcache(
            q[None], q[None], q[None], cache_seqlens=torch.tensor([2]), cache_batch_idx=torch.tensor([0]),
            backend=name),
        "paged": lambda: mhakern.attention_with_kvcache(
            q[None], q[None], q[None], cache_seqlens=torch.tensor([2]), block_table=torch.tensor([[0]]), backend=name),
    }
    for feat, call in calls.items():
        if feat in feats:
            call()
        else:
            with pytest.raises(ValueError, match=f"backend={name!r} cannot serve.*does not implement {feat}"):
                call()


def test_varlen_under_torch_compile():
    # The operator's fake implementation carries the packed call through a full graph.
    cu = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    q, k, v = (torch.randn(7, 2, 8).requires_grad_() for _ in range(3))

    def f(q, k, v, cu):
        return mhakern.attention_varlen(q, k, v, cu, cu, 4, 4, causal=True)

    out = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, cu)
    gc = torch.autograd.grad(out.sum(), (q, k, v))
    ref = f(q, k, v, cu)
    torch.testing.assert_close(out, ref)
    for a, b in zip(gc, torch.autograd.grad(ref.sum(), (q, k, v))):
        torch.testing.assert_close(a, b)


def test_fused_mha_packed_tokens_are_its_calls_per_sequence():
    torch.manual_seed(0)
    mha = mhakern.FusedMHA(16, 4, batch_first=True, num_kv_heads=2)
    lens = [3, 1, 6]
    x = torch.randn(sum(lens), 16, requires_grad=True)
    cu = _cu(lens)
    out, w = mha(x, x, x, need_weights=False, is_causal=True, cu_seqlens=cu)
    assert w is None and out.shape == (10, 16)
    ref = torch.cat([mha(s[None], s[None], s[None], need_weights=False, is_causal=True)[0][0]
                     for s in x.split(lens)])
    torch.testing.assert_close(out, ref)
    g = torch.randn(10, 16)
    got = torch.autograd.grad(out, (x, mha.in_proj_weight), g)
    want = torch.autograd.grad(ref, (x, mha.in_proj_weight), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="cu_seqlens: give need_weights=False"):
        mha(x, x, x, cu_seqlens=cu)
    with pytest.raises(ValueError, match="query: with cu_seqlens expected packed tokens"):
        mha(x[None], x[None], x[None], need_weights=False, cu_seqlens=cu)
