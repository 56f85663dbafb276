"""``torch.nn.functional.scaled_dot_product_attention``'s signature and semantics on mhakern.

``F.scaled_dot_product_attention = mhakern.scaled_dot_product_attention`` works in a model as
it stands. Differences from torch, by design (docs/contract.md):

* a query row that no key may attend gives 0 (torch's math backend gives NaN on some
  versions; torch 2.13's CPU kernels give 0 as well);
* dropout draws its keep mask from the contract's counter-based hash (seed drawn from torch's
  default CPU generator), so the dropped positions differ from torch's for the same seed;
  the statistics are the same.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ._errors import ArgumentError, ArgumentTypeError
from .attention import attention
from .checks import is_causal_bias, resolve_causal_bias
from .routing import plain_nograd

Tensor = torch.Tensor


def _four_d_direct(query, key, value, enable_gqa: bool) -> bool:
    """Whether query, key, value (tensors) are 4-D (B, H, L, E) operands of one batch size with
    their own heads (or GQA's, with ``enable_gqa``): what attention() takes as they are."""
    if not (query.dim() == 4 and key.dim() == 4 and value.dim() == 4):
        return False
    (B, Hq, L, E), (Bk, Hk, S, Ek), (Bv, Hv, Sv, _) = query.shape, key.shape, value.shape
    return (B == Bk == Bv and Hk == Hv and S == Sv and E == Ek
            and (Hk == Hq or (enable_gqa and Hk > 0 and Hq % Hk == 0)))


def _heads(x: Tensor) -> int:
    return x.shape[-3] if x.dim() >= 3 else 1


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention``.

    Shapes: query (..., Hq, L, E), key (..., H, S, E), value (..., H, S, Ev); leading dims
    broadcast as in torch. Without ``enable_gqa`` the head dims broadcast like the others
    (H = 1 serves every query head); with it Hq must be a multiple of H (query head ``h`` reads
    KV head ``h // (Hq // H)``). ``attn_mask``: bool (True = attend) or floating, broadcastable
    to (..., Hq, L, S), or a ``torch.nn.attention.bias.CausalBias`` (causal masking, upper-left
    or lower-right, as torch maps it). ``is_causal``: top-left causal (key ``j`` visible to query ``i`` iff
    ``j <= i``); at most one of ``is_causal`` and ``attn_mask``, as in torch. ``scale`` default
    ``1 / sqrt(E)``. Returns (..., Hq, L, Ev) in query's dtype.

    Under TorchScript (a model scripted after ``F.scaled_dot_product_attention`` was replaced by
    this function) the scripted graph calls torch's own operator: TorchScript cannot compile
    mhakern's dispatch; torch.compile and torch.export run mhakern's kernels.
    """
    if torch.jit.is_scripting():
        return torch._C._nn.scaled_dot_product_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


@torch.jit.unused
def _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    if attn_mask is None and is_causal is False and type(enable_gqa) is bool and type(dropout_p) in (float, int) \
            and dropout_p == 0:
        # A decode step's call (no mask, not causal): once its signature has passed the checks
        # below, plain_nograd serves it from one lookup; it returns None for calls needing a
        # gradient, and for shapes the 4-D branch below would not take.
        out = plain_nograd((_sdpa, enable_gqa), query, key, value, scale, False, "auto",
                           admit=lambda: _four_d_direct(query, key, value, enable_gqa))
        if out is not None:
            return out
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 2:
            raise ArgumentError(f"{name}: expected at least 2 dims (..., length, head_dim), got shape {tuple(x.shape)}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal: expected a bool, got {type(is_causal).__name__}")
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa: expected a bool, got {type(enable_gqa).__name__}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p: expected a float, got {type(dropout_p).__name__}")
    causal_align = "top_left"
    if attn_mask is not None and is_causal_bias(attn_mask):
        # torch.nn.attention.bias.causal_upper_left / causal_lower_right: causal masking, read as
        # torch's SDPA reads it (its storage holds no mask).
        if is_causal:
            raise ArgumentError("attn_mask, is_causal: a CausalBias is already causal masking; give is_causal=False "
                                "(torch's SDPA refuses both too: CausalBias should not be used with causal=True)")
        attn_mask, top_left = resolve_causal_bias(attn_mask, query.shape[-2], key.shape[-2], exact_bottom_right=True)
        is_causal, causal_align = True, ("top_left" if top_left else "bottom_right")
    if attn_mask is not None and is_causal:
        # torch's own message, word for word (code and tests match it); a RuntimeError as torch's.
        raise ArgumentError("_scaled_dot_product_attention: Explicit attn_mask should not be set when is_causal=True")
    if attn_mask is not None and isinstance(attn_mask, torch.Tensor) and attn_mask.is_floating_point():
        if attn_mask.dtype not in (torch.float32, query.dtype):
            raise ArgumentTypeError(
                f"attn_mask: a floating mask must be float32 or query's dtype ({query.dtype}), got {attn_mask.dtype}"
            )
    if _four_d_direct(query, key, value, enable_gqa) and not (isinstance(attn_mask, torch.Tensor) and attn_mask.dim() > 4):
        # (B, H, L, E) operands of one batch size with their own heads (or GQA's): what
        # attention() takes as they are, without the broadcasting below (six views and the
        # checks it needs).
        return attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, causal=is_causal,
                         causal_align=causal_align, scale=scale)
    L, E = query.shape[-2:]
    S, Ev = value.shape[-2], value.shape[-1]
    Hq, Hk, Hv = _heads(query), _heads(key), _heads(value)
    lead = lambda x: tuple(x.shape[:-3]) if x.dim() >= 3 else ()  # noqa: E731
    try:
        if enable_gqa:
            if Hk != Hv:
                raise ArgumentError(f"key, value: head counts must match with enable_gqa, got {Hk} and {Hv}")
            if Hk == 0 or Hq % Hk != 0:
                raise ArgumentError(f"key: with enable_gqa the number of key heads ({Hk}) must divide query's ({Hq})")
            batch = torch.broadcast_shapes(lead(query), lead(key), lead(value))
            H, Hkv = Hq, Hk
        else:
            full = torch.broadcast_shapes(tuple(query.shape[:-2]), tuple(key.shape[:-2]), tuple(value.shape[:-2]))
            batch, H = (full[:-1], full[-1]) if full else ((), 1)
            Hkv = 1 if Hk == 1 and Hv == 1 else H
    except RuntimeError as e:
        raise ArgumentError(f"query, key, value: batch dims do not broadcast ({e})") from None
    if key.shape[-2] != S:
        raise ArgumentError(f"key, value: lengths must match, got {key.shape[-2]} and {S}")
    if key.shape[-1] != E:
        raise ArgumentError(f"key: head dim {key.shape[-1]} does not match query's {E}")
    B = math.prod(batch)

    def to4(x, h, length, d):
        x = x.reshape((1,) * (3 - x.dim()) + tuple(x.shape)) if x.dim() < 3 else x
        x = x.expand(*batch, h, length, d)
        return x.reshape(B, h, length, d)

    q4 = to4(query, H, L, E)
    k4 = to4(key, Hkv, S, E)
    v4 = to4(value, Hkv, S, Ev)
    mask = attn_mask
    if isinstance(mask, torch.Tensor) and mask.dim() > 4 or (isinstance(mask, torch.Tensor) and len(batch) > 1):
        mask = mask.expand(*batch, H, L, S).reshape(B, H, L, S)
    out = attention(
        q4, k4, v4, attn_mask=mask, dropout_p=dropout_p, causal=is_causal, causal_align=causal_align, scale=scale,
    )
    out_shape = tuple(batch) + (H, L, Ev)
    out_dim = max(query.dim(), key.dim(), value.dim())
    return out.reshape(out_shape[len(out_shape) - out_dim:]) if out_dim < 4 else out.reshape(out_shape)
