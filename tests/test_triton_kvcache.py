"""The Triton forward over a KV cache (cache_batch_idx rows, paged K/V through a block table)
through the launcher, under the interpreter on CPU tensors (conftest sets TRITON_INTERPRET=1),
against the float64 reference on the dense K/V the cache holds, by the contract's tolerance
rule. The cache is built from that dense K/V: rows or pages in random order inside a pool whose
other rows / pages, and every slot past a batch element's key length, hold NaN (never read).
The split-K decode kernel is forced where a case names splits (the interpreter's planner never
splits). tests/test_varlen_kvcache.py runs the public entry point on every backend."""
from __future__ import annotations

import math

import pytest
import torch

import mhakern
from attn_testing import rule_check
from mhakern import reference
from mhakern.backends import Modes

_WHY = mhakern.available_backends().get("triton", "absent")
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"triton backend unavailable: {_WHY}")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _cache(kind, dense, kl, g, page_size=0, share=False):
    """(pools, index record) holding each of ``dense`` (B, Hkv, L, D*) as a cache_batch_idx pool
    ("rows") or pages ("paged", pool (num_pages, page_size, Hkv, D*) seen through transpose(1,
    2)); NaN everywhere the call must not read. ``share``: element 2's first page is element 1's."""
    B, Hkv, L, _ = dense[0].shape
    srcs = [x.clone() for x in dense]
    for src in srcs:
        for b, n in enumerate(kl):
            src[b, :, n:] = math.nan
    if kind == "rows":
        idx = torch.arange(B + 1, 1, -1)  # no batch element reads its own row
        pools = [torch.full((B + 2,) + tuple(x.shape[1:]), math.nan) for x in srcs]
        for pool, src in zip(pools, srcs):
            pool[idx] = src
        return pools, dict(cache_batch_idx=idx.to(torch.int32))
    P = L // page_size
    n_pages = B * P + 2
    order = torch.randperm(n_pages, generator=g)[: B * P].view(B, P)
    if share:  # the shared page holds the same keys for both, and both read it whole
        assert min(kl[1], kl[2]) >= page_size
        order[2, 0] = order[1, 0]
    pools = [torch.full((n_pages, page_size, Hkv, x.shape[3]), math.nan).transpose(1, 2) for x in srcs]
    for pool, src in zip(pools, srcs):
        for b in range(B):
            for p in range(P):
                pool[order[b, p]] = src[b, :, p * page_size:(p + 1) * page_size]
    return pools, dict(block_table=order.to(torch.int32))


def run_cache(kind, B, H, Hkv, Lq, L, kl, page_size=0, share=False, causal=False, window=(-1, -1), dropout_p=0.0,
              softcap=0.0, alibi=False, splits=0, dtype=torch.float32, D=16):
    from mhakern.kernels import attention_forward
    from mhakern.kernels.attention_fwd import force_splits

    g = torch.Generator().manual_seed(B * 100 + L)
    q = torch.randn(B, H, Lq, D, generator=g)
    kd, vd = torch.randn(B, Hkv, L, D, generator=g), torch.randn(B, Hkv, L, D, generator=g)
    if share:
        kd[2, :, :page_size], vd[2, :, :page_size] = kd[1, :, :page_size], vd[1, :, :page_size]
    (kp, vp), rec = _cache(kind, (kd, vd), kl, g, page_size, share)
    klt = torch.tensor(kl, dtype=torch.int32)
    al = torch.rand(B, H, generator=g) * 0.5 + 0.01 if alibi else None
    m = Modes(None, dropout_p, 4242 if dropout_p else 0, False, window[0], window[1], False, softcap, al)
    dev = lambda x: None if x is None else x.to(DEVICE)  # noqa: E731
    md = m._replace(alibi_slopes=dev(al), **{n: dev(t) for n, t in rec.items()})
    out = torch.full((B, H, Lq, D), math.nan, dtype=dtype, device=DEVICE)
    lse = torch.full((B, H, Lq), math.nan, dtype=torch.float32, device=DEVICE)
    prev = force_splits(splits)
    try:
        attention_forward(dev(q.to(dtype)), dev(kp.to(dtype)), dev(vp.to(dtype)), out, lse, D ** -0.5, causal,
                          dev(klt), md)
    finally:
        force_splits(prev)
    qT, kT, vT = (x.to(dtype).float() for x in (q, kd, vd))
    o64, l64 = reference.attention_forward(qT.double(), kT.double(), vT.double(), D ** -0.5, causal, klt, True, m)
    oT = reference.attention_forward(qT, kT, vT, D ** -0.5, causal, klt, False, m)[0]
    rule_check("out", out, o64, oT, dtype, 2.0)
    dead = torch.isneginf(l64)
    assert torch.equal(torch.isneginf(lse.cpu()), dead), "lse: -inf exactly on the rows that see no key"
    assert (lse.cpu().double() - l64)[~dead].abs().max() < 1e-3


# Interpreter tiles (fp32/fp16, D = 16): 64 x 32. Page sizes: 48 (a key block inside one page,
# and one across two; not dividing the block), 5 and 1 (a block over many pages); a page shared by
# two sequences; decode with the query heads of a KV head packed into one tile (GQA); empty and
# full key lengths; the split-K kernel with the score modifiers; the modes kernel with a window
# and dropout.
CASES = [
    ("paged48-split3-gqa-decode", dict(kind="paged", B=3, H=4, Hkv=2, Lq=1, L=144, kl=[0, 100, 144], page_size=48,
                                       share=True, causal=True, splits=3)),
    ("rows-split2-softcap-alibi", dict(kind="rows", B=2, H=2, Hkv=1, Lq=3, L=70, kl=[70, 33], causal=True,
                                       softcap=5.0, alibi=True, splits=2)),
    ("paged5-window-dropout-fp16", dict(kind="paged", B=3, H=2, Hkv=2, Lq=4, L=45, kl=[45, 17, 9], page_size=5,
                                        share=True, causal=True, window=(7, -1), dropout_p=0.2, dtype=torch.float16)),
    ("paged1-split2", dict(kind="paged", B=2, H=2, Hkv=1, Lq=2, L=37, kl=[37, 20], page_size=1, splits=2)),
]


@pytest.mark.parametrize("case", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_kvcache_forward(case):
    run_cache(**case)


def test_kvcache_index_errors_name_the_argument():
    from mhakern.kernels import attention_forward

    q = torch.randn(2, 2, 1, 16, device=DEVICE)
    k = torch.randn(3, 2, 4, 16, device=DEVICE)
    out, lse = torch.empty_like(q), torch.empty(2, 2, 1, device=DEVICE)
    for rec, msg in ((dict(cache_batch_idx=torch.tensor([0, 1], device=DEVICE)), "cache_batch_idx: expected an int32"),
                     (dict(block_table=torch.zeros(3, 2, dtype=torch.int32, device=DEVICE)),
                      r"block_table: expected an int32 tensor of shape \(2, any\)")):
        with pytest.raises(ValueError, match=msg):
            attention_forward(q, k, k, out, lse, 0.25, False, None, Modes()._replace(**rec))


def test_split_plan_sees_the_logical_key_length(monkeypatch):
    # The planner is asked with a paged cache's logical length (10 pages of 4 keys: 40 keys),
    # not the page size, and its split serves the call.
    from mhakern.kernels import attention_fwd
    from mhakern.kernels.heuristics import TileConfig

    asked = []

    def plan(programs, key_blocks, *rest):
        asked.append(key_blocks)
        return 2

    monkeypatch.setattr(attention_fwd, "plan_fwd_splits", plan)
    monkeypatch.setattr(attention_fwd, "fwd_config", lambda *a, **kw: TileConfig(16, 16, 4, 1))
    run_cache("paged", B=1, H=2, Hkv=2, Lq=1, L=40, kl=[37], page_size=4)
    assert asked == [3]  # ceil(40 / 16) key blocks
