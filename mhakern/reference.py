"""Plain PyTorch attention: the oracle of every test and the fallback of ``auto``.

Shapes follow the backend contract (GUIDE.md section 3):

* ``q``: (B, H, Lq, D), ``k``: (B, Hkv, Lk, D), ``v``: (B, Hkv, Lk, Dv), H a multiple of Hkv;
  query head ``h`` reads KV head ``h // (H // Hkv)``.
* ``key_lengths``: optional integer tensor (B,); keys at positions >= key_lengths[b] are hidden.
* ``causal``: bottom-right aligned per batch element: key ``j`` is visible to query ``i`` iff
  ``j <= i + Lk_b - Lq`` where ``Lk_b`` is that element's key length.
* A query row that sees no key gets output 0 and lse = -inf, and zero gradient.

``upcast=True`` computes in float64 (the oracle); ``upcast=False`` computes in the input dtype
(the "torch math in T" of the tolerance rule). Outputs are returned in the input dtype unless
``upcast`` is set, in which case they stay float64 so that tests can measure the kernels' error.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

Tensor = torch.Tensor

# Query rows per chunk: bounds the (rows x Lk) score matrix when Lk is very long.
_SCORE_BUDGET = 1 << 24


def visible_mask(
    Lq: int,
    Lk: int,
    causal: bool,
    key_lengths: Optional[Tensor],
    device: torch.device,
    row_offset: int = 0,
    rows: Optional[int] = None,
) -> Optional[Tensor]:
    """Boolean mask of visible (query, key) pairs, or None when every key is visible.

    Returns a tensor broadcastable to (B, H, rows, Lk): shape (B or 1, 1, rows, Lk), for the
    query rows ``row_offset .. row_offset + rows - 1``.
    """
    rows = Lq - row_offset if rows is None else rows
    if not causal and key_lengths is None:
        return None
    j = torch.arange(Lk, device=device).view(1, 1, 1, Lk)
    if key_lengths is None:
        lk = torch.full((1,), Lk, device=device, dtype=torch.long)
    else:
        lk = key_lengths.to(device=device, dtype=torch.long)
    lk = lk.view(-1, 1, 1, 1)
    mask = j < lk
    if causal:
        i = torch.arange(row_offset, row_offset + rows, device=device).view(1, 1, rows, 1)
        mask = mask & (j <= i + lk - Lq)
    return mask


def _work_dtype(dtype: torch.dtype, upcast: bool) -> torch.dtype:
    """float64 with ``upcast``; otherwise fp32 for half inputs (fp32 accumulation, as every
    backend) and the input dtype for the rest."""
    if upcast:
        return torch.float64
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _expand_kv(x: Tensor, n_rep: int) -> Tensor:
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: Optional[float] = None,
    causal: bool = False,
    key_lengths: Optional[Tensor] = None,
    upcast: bool = False,
) -> Tuple[Tensor, Tensor]:
    """Exact attention by materialising the scores. Returns ``(out, lse)``.

    ``out``: (B, H, Lq, Dv) in the compute dtype's output dtype (see module docstring);
    ``lse``: float32 (float64 with ``upcast``) of shape (B, H, Lq), natural log, -inf for rows
    that see no key. Work dtype is float64 with ``upcast``, float32 for half inputs otherwise
    (accumulation in fp32, as every backend), else the input dtype.
    """
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
        s = torch.matmul(q[:, :, r0 : r0 + rows].to(wdt), kk.transpose(-1, -2)) * scale
        mask = visible_mask(Lq, Lk, causal, key_lengths, q.device, r0, rows)
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        # exp(s - lse) is NaN on rows with lse = -inf; those rows must give exactly 0.
        safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        p = torch.exp(s - safe.unsqueeze(-1))
        outs.append(torch.matmul(p, vv))
        lses.append(lse)
    out = torch.cat(outs, dim=2) if outs else q.new_zeros((B, H, 0, v.shape[-1]), dtype=wdt)
    lse = torch.cat(lses, dim=2) if lses else q.new_zeros((B, H, 0), dtype=wdt)
    if upcast:
        return out, lse
    return out.to(q.dtype), lse.float()


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
) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients by the contract: probabilities recomputed from ``lse``, ``delta = rowsum(dout*out)``.

    Returns ``(dq, dk, dv)`` shaped like ``q``, ``k``, ``v``; dk and dv are summed over the query
    heads that share a KV head.
    """
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    n_rep = H // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    wdt = _work_dtype(q.dtype, upcast)
    qw, dow = q.to(wdt), dout.to(wdt)
    kk = _expand_kv(k, n_rep).to(wdt)
    vv = _expand_kv(v, n_rep).to(wdt)
    delta = (dow * out.to(wdt)).sum(-1, keepdim=True)
    s = torch.matmul(qw, kk.transpose(-1, -2)) * scale
    lse_w = lse.to(wdt).unsqueeze(-1)
    p = torch.exp(s - torch.where(torch.isinf(lse_w), torch.zeros_like(lse_w), lse_w))
    mask = visible_mask(Lq, Lk, causal, key_lengths, q.device)
    if mask is not None:
        p = p.masked_fill(~mask, 0.0)
    p = p.masked_fill(torch.isinf(lse_w), 0.0)
    dv = torch.matmul(p.transpose(-1, -2), dow)
    dp = torch.matmul(dow, vv.transpose(-1, -2))
    ds = p * (dp - delta) * scale
    dq = torch.matmul(ds, kk)
    dk = torch.matmul(ds.transpose(-1, -2), qw)
    if n_rep > 1:
        dk = dk.view(B, Hkv, n_rep, Lk, D).sum(2)
        dv = dv.view(B, Hkv, n_rep, Lk, v.shape[-1]).sum(2)
    if upcast:
        return dq, dk, dv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: Optional[float] = None,
    causal: bool = False,
    key_lengths: Optional[Tensor] = None,
    upcast: bool = True,
) -> Tensor:
    """Differentiable naive attention (autograd through PyTorch ops), for tests.

    Unlike :func:`attention_forward` this one lets autograd derive the gradients, so it checks
    the hand-written backward formulas rather than sharing them.
    """
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    wdt = torch.float64 if upcast else q.dtype
    kk = _expand_kv(k.to(wdt), H // Hkv)
    vv = _expand_kv(v.to(wdt), H // Hkv)
    s = torch.matmul(q.to(wdt), kk.transpose(-1, -2)) * scale
    mask = visible_mask(Lq, Lk, causal, key_lengths, q.device)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
        # Fully hidden rows: softmax of all -inf is NaN; give them zero weights instead.
        dead = ~mask.any(-1, keepdim=True)
        s = s.masked_fill(dead, 0.0)
        p = torch.softmax(s, dim=-1).masked_fill(dead, 0.0)
    else:
        p = torch.softmax(s, dim=-1)
    return torch.matmul(p, vv)
