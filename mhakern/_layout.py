"""Allocation helpers shared by backends and the fake (meta) implementations of the ops.

Outputs follow the memory layout of the input they mirror: a query given as a (B, L, H, D)
tensor viewed as (B, H, L, D) gets an output laid out (B, L, H, Dv), so that merging heads
afterwards (``out.transpose(1, 2).reshape(B, L, H * Dv)``) is free, as in flash-attention.
"""
from __future__ import annotations

import torch


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype``: ``x`` itself when it already is. (``Tensor.to`` returns ``x`` then too,
    but its argument parsing costs about as much as a small op: this is the per-call path.)"""
    return x if x.dtype == dtype else x.to(dtype)


def heads_inner(x: torch.Tensor) -> bool:
    """True when ``x`` (B, H, L, D) is a (B, L, H, D) tensor seen through a transpose."""
    return x.shape[1] > 1 and x.shape[2] > 1 and x.stride(1) < x.stride(2)


def empty_like_heads(x: torch.Tensor, last_dim: int, dtype: torch.dtype = None) -> torch.Tensor:
    """Uninitialised (B, H, L, last_dim) tensor with ``x``'s head/sequence memory order."""
    B, H, L, _ = x.shape
    dtype = x.dtype if dtype is None else dtype
    if heads_inner(x):
        return torch.empty((B, L, H, last_dim), dtype=dtype, device=x.device).transpose(1, 2)
    return torch.empty((B, H, L, last_dim), dtype=dtype, device=x.device)


def layout_strides(like: torch.Tensor, last_dim: int):
    """The strides ``empty_like_heads(like, last_dim)`` gives."""
    B, H, L, _ = like.shape
    if heads_inner(like):
        return (L * H * last_dim, last_dim, H * last_dim, 1)
    return (H * L * last_dim, L * last_dim, last_dim, 1)


def same_layout(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` itself when laid out as ``empty_like_heads(like, ...)`` would be, else such a copy.

    Dims of size one are ignored: their stride carries no meaning.
    """
    want = layout_strides(like, t.shape[-1])
    have = t.stride()
    # Exact match first (the common case, one tuple comparison), then modulo size-1 dims.
    if have == want or all(n <= 1 or a == b for n, a, b in zip(t.shape, have, want)):
        return t
    # Out of place (no empty + copy_): under vmap (``autograd.grad(is_grads_batched=True)``)
    # ``t`` is a batched tensor, which cannot be copied into an unbatched one.
    if heads_inner(like):
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    return t.contiguous()
