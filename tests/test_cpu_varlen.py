"""The cpu kernels' packed variable-length sequences (forward and backward) through the ops
``torch.ops.mhakern_C.fwd/bwd``, against the float64 reference computed per sequence.

The op sees FlashAttention's packed (T, H, D) tensors as (1, H, T, D) views (non-contiguous).
Sequence s must equal batch element s of a dense call of its own lengths: the reference runs it
as element s of a batch of s + 1 copies, so the dropout hash and the ALiBi slopes see (s, h)
exactly as the dense call's element s does. The tolerance is the contract's rule
(``rule_check``: a multiple of torch's own math error in the input dtype, plus the atol).
"""
from __future__ import annotations

import math

import pytest
import torch

import mhakern
from attn_testing import rule_check
from mhakern import reference
from mhakern.backends import Modes

_WHY = mhakern.available_backends().get("cpu", "backend 'cpu' is not registered")
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"cpu backend unavailable: {_WHY}")


def _packed(T, H, D, dtype, g):
    """A packed (T, H, D) tensor seen as the op's (1, H, T, D) view."""
    return torch.randn(T, H, D, generator=g).to(dtype).transpose(0, 1).unsqueeze(0)


def _cu(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)


def _mods(m, alibi, n):
    """The modes of a batch of n whose element s is sequence s (alibi: the first n rows)."""
    return m._replace(alibi_slopes=None if alibi is None else alibi[:n].contiguous())


def run_varlen(lq, lk, H=2, Hkv=2, D=16, Dv=None, dtype=torch.float32, causal=False, top_left=False,
               window=(-1, -1), dropout_p=0.0, softcap=0.0, alibi=False, seed=0):
    Dv = Dv or D
    g = torch.Generator().manual_seed(seed)
    Tq, Tk, S = sum(lq), sum(lk), len(lq)
    q, k, v = _packed(Tq, H, D, dtype, g), _packed(Tk, Hkv, D, dtype, g), _packed(Tk, Hkv, Dv, dtype, g)
    dout = _packed(Tq, H, Dv, dtype, g)
    cq, ck = _cu(lq), _cu(lk)
    al = (torch.rand(S, H, generator=g) * 0.5 + 0.01) if alibi else None
    m = Modes(None, dropout_p, 777 if dropout_p else 0, top_left, window[0], window[1], False, softcap, al)
    scale = D ** -0.5
    extra = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=max(lq), max_seqlen_k=max(lk))
    out, lse = torch.ops.mhakern_C.fwd(q, k, v, scale, causal, None, *m.c_op_args(), **extra)
    dq, dk, dv, _ = torch.ops.mhakern_C.bwd(dout, q, k, v, out, lse, scale, causal, None, *m.c_op_bwd_args(), **extra)
    assert out.shape == (1, H, Tq, Dv) and lse.shape == (1, H, Tq)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape

    # Per sequence: the float64 oracle and torch's math in dtype (the tolerance rule's yardstick).
    ref = {n: [] for n in ("out", "lse", "dq", "dk", "dv")}
    mat = {n: [] for n in ("out", "dq", "dk", "dv")}
    for s in range(S):
        qs, ks, vs = q[:, :, cq[s]:cq[s + 1]], k[:, :, ck[s]:ck[s + 1]], v[:, :, ck[s]:ck[s + 1]]
        dos = dout[:, :, cq[s]:cq[s + 1]]
        if lq[s] == 0 or lk[s] == 0:
            # An empty side: rows get out 0, lse -inf; every gradient of the sequence is 0.
            for name, x in (("out", dos), ("dq", qs), ("dk", ks), ("dv", vs)):
                ref[name].append(torch.zeros(x.shape, dtype=torch.float64))
                mat[name].append(torch.zeros(x.shape, dtype=torch.float64))
            ref["lse"].append(torch.full(qs.shape[:3], -math.inf, dtype=torch.float64))
            continue
        rep = lambda x: x.expand(s + 1, *x.shape[1:])  # noqa: E731  (element s is the sequence)
        for upcast, dst in ((True, ref), (False, mat)):
            xs = [rep(x.double() if upcast else x) for x in (qs, ks, vs, dos)]
            o, l = reference.attention_forward(*xs[:3], scale, causal, None, upcast=upcast, modes=_mods(m, al, s + 1))
            gq, gk, gv, _ = reference.attention_backward_modes(xs[3], *xs[:3], o, l, scale, causal, None,
                                                               upcast=upcast, modes=_mods(m, al, s + 1))
            for name, x in (("out", o), ("dq", gq), ("dk", gk), ("dv", gv)):
                dst[name].append(x[s:s + 1])
            if upcast:
                ref["lse"].append(l[s:s + 1])
    cat = lambda xs: torch.cat([x.double() for x in xs], dim=2)  # noqa: E731
    rule_check("out", out, cat(ref["out"]), cat(mat["out"]), dtype, 2.0)
    lse64 = cat(ref["lse"])
    dead = torch.isneginf(lse64)
    assert torch.equal(torch.isneginf(lse.double()), dead), "lse: -inf pattern differs from the reference"
    if (~dead).any():
        err = (lse.double() - lse64)[~dead].abs().max().item()
        assert err <= 1e-3 * max(1.0, lse64[~dead].abs().max().item()), f"lse: max error {err:.3e}"
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
        rule_check(name, got, cat(ref[name]), cat(mat[name]), dtype, 3.0)
    return out, lse, dq, dk, dv


# Lengths: empty sequences on either side, one-token ones, sequences longer than a row block (64)
# and a key block (128), Lq_s != Lk_s both ways.
MIXED_Q = [5, 0, 1, 70, 3, 9]
MIXED_K = [9, 4, 1, 150, 0, 2]
CASES = [
    ("plain", dict(lq=MIXED_Q, lk=MIXED_K)),
    ("causal-gqa", dict(lq=MIXED_Q, lk=MIXED_K, H=4, Hkv=2, D=32, Dv=24, causal=True)),
    ("causal-topleft", dict(lq=[40, 7, 1], lk=[13, 30, 5], causal=True, top_left=True)),
    ("window", dict(lq=[33, 0, 20], lk=[50, 3, 20], window=(6, 2))),
    ("dropout-causal", dict(lq=[17, 1, 30], lk=[17, 9, 40], causal=True, dropout_p=0.3)),
    ("softcap", dict(lq=[19, 4, 1], lk=[29, 4, 77], H=4, Hkv=1, causal=True, softcap=3.0)),
    # One sequence: the op's alibi_slopes check still asks for (batch = 1, H) where the packed
    # call's slopes are (num_seqs, H) (csrc/op_common.h check_modes; the kernels index row s).
    ("alibi-one-seq", dict(lq=[19], lk=[29], H=4, Hkv=1, causal=True, softcap=3.0, alibi=True)),
    ("decode-mqa", dict(lq=[1, 1, 1, 1], lk=[67, 1, 200, 0], H=8, Hkv=1, D=64)),
    ("splitk", dict(lq=[3, 2], lk=[2100, 5], causal=True)),
]


@pytest.mark.parametrize("case", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_varlen_fp32(case):
    run_varlen(**case)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_varlen_half(dtype):
    run_varlen([20, 0, 45], [33, 6, 45], H=2, Hkv=1, D=32, dtype=dtype, causal=True)


def test_varlen_deterministic_and_isolated():
    # Bitwise the same with 1 thread and with all; a NaN in another sequence's keys reaches nothing of this one.
    args = ([9, 30], [12, 40])
    a = run_varlen(*args, seed=4)
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the sequences' scheduling changes with the thread count, the bits do not
    try:
        b = run_varlen(*args, seed=4)
    finally:
        torch.set_num_threads(n)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    g = torch.Generator().manual_seed(1)
    q, k, v = _packed(39, 2, 16, torch.float32, g), _packed(52, 2, 16, torch.float32, g), _packed(52, 2, 16, torch.float32, g)
    extra = dict(cu_seqlens_q=_cu([9, 30]), cu_seqlens_k=_cu([12, 40]), max_seqlen_q=30, max_seqlen_k=40)
    o1, _ = torch.ops.mhakern_C.fwd(q, k, v, 0.25, False, None, *Modes().c_op_args(), **extra)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 12:] = math.nan
    v2[:, :, 12:] = math.nan
    o2, _ = torch.ops.mhakern_C.fwd(q, k2, v2, 0.25, False, None, *Modes().c_op_args(), **extra)
    assert torch.equal(o1[:, :, :9], o2[:, :, :9])


def test_features_declared():
    from mhakern import backends

    assert {"varlen", "cache_batch_idx", "paged"} <= backends.get("cpu").features


@pytest.mark.parametrize("bad,match", [
    (dict(cu_seqlens_q=torch.tensor([0, 3, 2, 5], dtype=torch.int32)), "cu_seqlens_q"),
    (dict(cu_seqlens_k=torch.tensor([0, 3, 6, 8], dtype=torch.int32)), "cu_seqlens_k"),
    (dict(max_seqlen_q=1), "max_seqlen_q"),
    (dict(key_lengths=torch.tensor([3], dtype=torch.int32)), "key_lengths"),
    (dict(cu_seqlens_k=None), "cu_seqlens"),
])
def test_bad_packing_names_the_argument(bad, match):
    g = torch.Generator().manual_seed(0)
    q, k, v = _packed(5, 2, 16, torch.float32, g), _packed(7, 2, 16, torch.float32, g), _packed(7, 2, 16, torch.float32, g)
    extra = dict(cu_seqlens_q=_cu([2, 1, 2]), cu_seqlens_k=_cu([3, 3, 1]), max_seqlen_q=2, max_seqlen_k=3)
    kl = bad.pop("key_lengths", None)
    extra.update(bad)
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        torch.ops.mhakern_C.fwd(q, k, v, 0.25, False, kl, *Modes().c_op_args(), **extra)


# ---- KV cache (forward only): cache_batch_idx and paged K/V -----------------------------------

def _check_fwd(out, lse, q, kd, vd, scale, causal, kl, m, dtype):
    """out, lse against the float64 reference on the dense (gathered) K/V."""
    o64, l64 = reference.attention_forward(q.double(), kd.double(), vd.double(), scale, causal, kl, upcast=True,
                                           modes=m)
    oT, _ = reference.attention_forward(q, kd, vd, scale, causal, kl, upcast=False, modes=m)
    rule_check("out", out, o64, oT, dtype, 2.0)
    dead = torch.isneginf(l64)
    assert torch.equal(torch.isneginf(lse.double()), dead), "lse: -inf pattern differs from the reference"
    if (~dead).any():
        err = (lse.double() - l64)[~dead].abs().max().item()
        assert err <= 1e-3 * max(1.0, l64[~dead].abs().max().item()), f"lse: max error {err:.3e}"


@pytest.mark.parametrize("Lq,H,Hkv,causal,window", [(1, 8, 2, False, (-1, -1)), (5, 2, 2, True, (-1, -1)),
                                                  (70, 2, 1, True, (9, 0))], ids=["decode-gqa", "causal", "window"])
def test_cache_batch_idx(Lq, H, Hkv, causal, window):
    g = torch.Generator().manual_seed(5)
    B, Bc, Lk, D = 3, 4, 150, 32
    q = torch.randn(B, H, Lq, D, generator=g)
    kc = torch.randn(Bc, Lk, Hkv, D, generator=g).transpose(1, 2)  # (Bc, Hkv, Lk, D), strided
    vc = torch.randn(Bc, Lk, Hkv, D, generator=g).transpose(1, 2)
    idx = torch.tensor([2, 0, 2], dtype=torch.int32)  # a repeat, a row never read
    kl = torch.tensor([150, 77, 5 + Lq], dtype=torch.int32)
    m = Modes(window_left=window[0], window_right=window[1])
    out, lse = torch.ops.mhakern_C.fwd(q, kc, vc, 0.2, causal, kl, *m.c_op_args(), cache_batch_idx=idx)
    _check_fwd(out, lse, q, kc[idx.long()], vc[idx.long()], 0.2, causal, kl, m, torch.float32)


def _paged(B, Hkv, pages_per_seq, ps, D, dtype, g, share=True):
    """Pages in vLLM's (num_pages, page_size, Hkv, D) layout seen as (num_pages, Hkv, ps, D), an
    unsorted block table (one page shared by two sequences) and the dense K/V it describes."""
    n = B * pages_per_seq + 3
    kp = torch.randn(n, ps, Hkv, D, generator=g).to(dtype).transpose(1, 2)
    vp = torch.randn(n, ps, Hkv, D, generator=g).to(dtype).transpose(1, 2)
    bt = torch.randperm(n, generator=g)[:B * pages_per_seq].reshape(B, pages_per_seq).to(torch.int32)
    if share and B > 1:
        bt[1, 0] = bt[0, -1]
    dense = lambda x: x[bt.long()].permute(0, 2, 1, 3, 4).reshape(B, Hkv, pages_per_seq * ps, D)  # noqa: E731
    return kp, vp, bt.contiguous(), dense(kp), dense(vp)


@pytest.mark.parametrize("ps,pages,Lq,H,Hkv,causal,dtype", [
    (16, 9, 1, 8, 2, False, torch.float32),     # decode, heads grouped, blocks cross pages
    (1, 40, 3, 2, 2, True, torch.float32),      # one row a page
    (50, 4, 20, 2, 1, True, torch.float32),     # a page size not dividing the key block
    (200, 1, 4, 2, 2, False, torch.float32),    # one page longer than a key block
    (16, 132, 2, 1, 1, True, torch.float32),    # split key ranges over a long logical cache
    (16, 9, 1, 4, 1, False, torch.bfloat16),
], ids=["ps16-decode", "ps1", "ps50", "ps200", "ps16-splitk", "ps16-bf16"])
def test_paged(ps, pages, Lq, H, Hkv, causal, dtype):
    g = torch.Generator().manual_seed(ps + pages)
    B, D = 3, 32
    kp, vp, bt, kd, vd = _paged(B, Hkv, pages, ps, D, dtype, g)
    Lk = pages * ps
    q = torch.randn(B, H, Lq, D, generator=g).to(dtype)
    kl = torch.tensor([Lk, max(Lk - 7, Lq), min(Lq + 3, Lk)], dtype=torch.int32)
    m = Modes(softcap=5.0) if ps == 50 else Modes()
    out, lse = torch.ops.mhakern_C.fwd(q, kp, vp, 0.2, causal, kl, *m.c_op_args(), block_table=bt)
    _check_fwd(out, lse, q, kd, vd, 0.2, causal, kl, m, dtype)


def test_paged_bad_key_lengths_and_pages():
    g = torch.Generator().manual_seed(0)
    kp, vp, bt, _, _ = _paged(2, 1, 3, 16, 16, torch.float32, g)
    q = torch.randn(2, 1, 1, 16, generator=g)
    with pytest.raises(ValueError, match="key_lengths"):  # beyond the logical length 3 * 16
        torch.ops.mhakern_C.fwd(q, kp, vp, 0.25, False, torch.tensor([49, 3], dtype=torch.int32),
                                *Modes().c_op_args(), block_table=bt)
    bad = bt.clone()
    bad[0, 0] = kp.shape[0]
    with pytest.raises(ValueError, match="block_table"):
        torch.ops.mhakern_C.fwd(q, kp, vp, 0.25, False, None, *Modes().c_op_args(), block_table=bad)
    with pytest.raises(ValueError, match="cache_batch_idx"):
        torch.ops.mhakern_C.fwd(q, kp[:2], vp[:2], 0.25, False, None, *Modes().c_op_args(),
                                cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32))
