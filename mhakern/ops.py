"""The raw forward and backward as PyTorch custom ops (``torch.ops.mhakern.*``).

Registering them through ``torch.library.custom_op`` with fake (meta) implementations makes
them opaque, shape-known nodes for ``torch.compile``: compiled graphs neither break on them
nor trace into the kernels. The autograd Function in :mod:`mhakern.attention` calls these ops.

Both ops take the backend by name, already resolved by dispatch (never "auto"), and tensors
already checked by :func:`mhakern.attention.attention` for shapes, dtypes and devices; only
the values of ``key_lengths`` are checked here, where the tensors are real.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from . import backends
from ._layout import empty_like_heads, same_layout

Tensor = torch.Tensor


def _check_key_lengths_values(key_lengths: Optional[Tensor], Lk: int) -> None:
    if key_lengths is None or key_lengths.numel() == 0:
        return
    # One host sync (a CUDA caller pays it): an out-of-range length would make a kernel read
    # outside k and v, so it is refused rather than clamped into a silently different answer.
    lo, hi = (int(x) for x in torch.stack(torch.aminmax(key_lengths)).tolist())
    if lo < 0 or hi > Lk:
        raise ValueError(
            f"key_lengths: values must lie in [0, Lk={Lk}], got min {lo} and max {hi}"
        )


@torch.library.custom_op("mhakern::attn_fwd", mutates_args=())
def attn_fwd(
    q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, key_lengths: Optional[Tensor], backend: str
) -> Tuple[Tensor, Tensor]:
    """Forward: ``out`` (B, H, Lq, Dv) in q's dtype and ``lse`` float32 (B, H, Lq)."""
    B, H, Lq, _ = q.shape
    Lk, Dv = k.shape[2], v.shape[3]
    _check_key_lengths_values(key_lengths, Lk)
    if B == 0 or H == 0 or Lq == 0 or Lk == 0 or Dv == 0:
        out = empty_like_heads(q, Dv).zero_()
        lse = torch.full((B, H, Lq), -math.inf, dtype=torch.float32, device=q.device)
        return out, lse
    out, lse = backends.get(backend).forward(q, k, v, scale, causal, key_lengths)
    return same_layout(out, q), lse.contiguous()


@attn_fwd.register_fake
def _attn_fwd_fake(q, k, v, scale, causal, key_lengths, backend):
    B, H, Lq, _ = q.shape
    return empty_like_heads(q, v.shape[3]), q.new_empty((B, H, Lq), dtype=torch.float32)


@torch.library.custom_op("mhakern::attn_bwd", mutates_args=())
def attn_bwd(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    causal: bool,
    key_lengths: Optional[Tensor],
    backend: str,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Backward: ``(dq, dk, dv)`` shaped and laid out like ``q``, ``k``, ``v``."""
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    if B == 0 or H == 0 or Lq == 0 or Lk == 0 or v.shape[3] == 0:
        return (
            empty_like_heads(q, D).zero_(),
            empty_like_heads(k, D).zero_(),
            empty_like_heads(v, v.shape[3]).zero_(),
        )
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    dq, dk, dv, _ = backends.get(backend).backward(dout, q, k, v, out, lse, scale, causal, key_lengths)
    return same_layout(dq, q), same_layout(dk, k), same_layout(dv, v)


@attn_bwd.register_fake
def _attn_bwd_fake(dout, q, k, v, out, lse, scale, causal, key_lengths, backend):
    return empty_like_heads(q, q.shape[3]), empty_like_heads(k, k.shape[3]), empty_like_heads(v, v.shape[3])
