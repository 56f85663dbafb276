"""Packed sequences and the KV cache through the public entry points, against the float64
reference, by the contract's tolerance rule: the checks the GPU files run per kernel family
(tests/test_cuda.py, tests/test_cuda_sm90_gpu.py, tests/test_triton_gpu.py). Any backend and
device: the reference backend computes both the float64 oracle and the naive math in the
input dtype (torch_math_in_T) on the same packed / cached operands.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

import mhakern
from attn_testing import rule_check


def _cu(lens: Sequence[int], device) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(list(lens)).cumsum(0).tolist(), dtype=torch.int32, device=device)


def check_packed(backend: str, lq: Sequence[int], lk: Sequence[int], H: int, Hkv: int, D: int, dtype, device,
                 causal: bool = True, grads: bool = True, seed: int = 0) -> None:
    """mhakern.attention_varlen on packed (T, H, D) tokens of sequences of lengths lq / lk (empty
    ones allowed): out, and with ``grads`` dq, dk, dv, against the reference backend."""
    g = torch.Generator().manual_seed(seed)
    Tq, Tk = sum(lq), sum(lk)
    base = [torch.randn(T, h, D, generator=g) for T, h in ((Tq, H), (Tk, Hkv), (Tk, Hkv))]
    dout = torch.randn(Tq, H, D, generator=g).to(device, dtype)
    cq, ck = _cu(lq, device), _cu(lk, device)

    def run(dt, be):
        x = [t.to(device, dt, copy=True).requires_grad_(grads) for t in base]
        out = mhakern.attention_varlen(*x, cq, ck, max(lq), max(lk), causal=causal, backend=be)
        if grads:
            out.backward(dout.to(dt))
        return out, [t.grad for t in x]

    got, ggot = run(dtype, backend)
    ref, gref = run(torch.float64, "reference")
    mth, gmth = run(dtype, "reference")
    rule_check("out", got, ref, mth, dtype, 2.0)
    if grads:
        for name, a, r, m in zip(("dq", "dk", "dv"), ggot, gref, gmth):
            rule_check(name, a, r, m, dtype, 3.0)


def check_kvcache(backend: str, kind: str, B: int, H: int, Hkv: int, Lq: int, L: int, kl: Sequence[int], D: int,
                  dtype, device, page_size: int = 16, causal: bool = True, seed: int = 0,
                  block_table_pages: Optional[int] = None) -> None:
    """mhakern.attention_with_kvcache over a cache that holds dense (B, Hkv, L, D) K/V with key
    lengths ``kl``, read through ``cache_batch_idx`` (kind "cache_batch_idx": rows in another
    order in a larger pool) or pages (kind "paged": ``page_size``-token pages in random order in
    a pool with spare pages), no new keys; every slot the call must not read (spare rows and pages,
    positions past a key length) holds NaN. Against the reference on the dense K/V."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Lq, D, generator=g)
    kd, vd = torch.randn(B, Hkv, L, D, generator=g), torch.randn(B, Hkv, L, D, generator=g)
    src = [kd.clone(), vd.clone()]
    for x in src:
        for b, n in enumerate(kl):
            x[b, :, n:] = math.nan
    if kind == "cache_batch_idx":
        idx = torch.randperm(B + 2, generator=g)[:B]
        pools = [torch.full((B + 2, Hkv, L, D), math.nan) for _ in range(2)]
        for pool, x in zip(pools, src):
            pool[idx] = x
        rec = dict(cache_batch_idx=idx.to(torch.int32).to(device))
    elif kind == "paged":
        assert L % page_size == 0, "L must be a multiple of page_size"
        P = L // page_size
        n_pages = B * P + 3
        order = torch.randperm(n_pages, generator=g)[: B * P].view(B, P)
        pools = []
        for x in src:
            pool = torch.full((n_pages, page_size, Hkv, D), math.nan).transpose(1, 2)  # (pages, Hkv, page, D) view
            pool[order] = x.view(B, Hkv, P, page_size, D).permute(0, 2, 1, 3, 4)
            pools.append(pool)
        rec = dict(block_table=order.to(torch.int32).to(device))
    else:
        raise ValueError(f"kind: expected 'cache_batch_idx' or 'paged', got {kind!r}")
    seqlens = torch.tensor(list(kl), dtype=torch.int32, device=device)
    with torch.no_grad():
        got = mhakern.attention_with_kvcache(q.to(device, dtype), pools[0].to(device, dtype), pools[1].to(device, dtype),
                                             cache_seqlens=seqlens, causal=causal, backend=backend, **rec)

        def dense(dt):
            return mhakern.attention(q.to(device, dt), kd.to(device, dt), vd.to(device, dt), causal=causal,
                                     key_lengths=seqlens, backend="reference")

        ref, mth = dense(torch.float64), dense(dtype)
    rule_check("out", got, ref, mth, dtype, 2.0)
