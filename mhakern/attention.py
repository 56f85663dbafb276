"""Public functional API: the arguments checked and parsed into the call record
(mhakern/checks.py), then the one route to a backend (mhakern/routing.py): the operator
``torch.ops.mhakern.attn_fwd`` (mhakern/ops.py), the one autograd boundary, or for a call that
needs no gradient the same implementation without the dispatcher's round trip. Semantics
(visibility, modes, dropout hash, NaN/inf rule, score modifiers): docs/contract.md.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch

from .checks import (
    causal_from_bias,
    check_backend,
    check_bool,
    check_dropout_p,
    check_qkv,
    check_scale,
    is_causal_bias,
    parse_modes,
)
from .modes import DEFAULT_MODES
from .routing import route

Tensor = torch.Tensor


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attn_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    generator: Optional[torch.Generator] = None,
    causal: bool = False,
    causal_align: str = "bottom_right",
    window: Optional[Sequence[int]] = None,
    scale: Optional[float] = None,
    key_lengths: Optional[Tensor] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    backend: str = "auto",
    return_lse: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Exact softmax attention, fused. Semantics: docs/contract.md.

    Args:
        q: (B, H, Lq, D) queries.
        k: (B, Hkv, Lk, D) keys; H must be a multiple of Hkv (GQA; Hkv = 1 is MQA). Query head
            ``h`` reads KV head ``h // (H // Hkv)``.
        v: (B, Hkv, Lk, Dv) values.
        attn_mask: bool (True = may attend, as SDPA) or floating (added to the scaled scores;
            -inf hides the key), any shape broadcastable to (B, H, Lq, Lk) (1-D to 4-D, aligned
            from the right). Never expanded in memory. A floating mask that requires grad
            gets its gradient. A ``torch.nn.attention.bias.CausalBias`` is causal masking, read
            as SDPA reads it: ``causal_upper_left`` top-left, ``causal_lower_right``
            bottom-right (with ``causal=False``).
        dropout_p: probability in [0, 1] of dropping each attention probability (the rest are
            scaled by 1 / (1 - p); p = 1 gives output 0 and zero gradients, as torch's
            dropout); the keep mask is the contract's counter-based hash of a
            64-bit seed drawn once per call from ``generator`` (default: torch's default CPU
            generator), identical on every backend; lse stays that of the undropped softmax.
        causal: key ``j`` is visible to query ``i`` iff ``j <= i + off``.
        causal_align: "bottom_right" (``off = Lk_b - Lq`` per batch element, the default) or
            "top_left" (``off = 0``, SDPA's ``is_causal``); also aligns ``window`` and ALiBi.
        window: ``(left, right)`` sliding window, -1 = unbounded on that side (FlashAttention's
            ``window_size``): ``i + off - left <= j <= i + off + right``.
        scale: multiplies ``q @ k^T``; default ``1 / sqrt(D)``.
        key_lengths: optional integer tensor (B,); keys at positions >= key_lengths[b] are
            hidden. Values must lie in [0, Lk] (checked in their own dtype).
        softcap: None, or a positive number: each scaled score ``s`` becomes
            ``softcap * tanh(s / softcap)`` (Gemma 2's logit capping) before ALiBi and the mask.
        alibi_slopes: None, or (H,) or (B, H) slopes (any floating dtype, computed in float32):
            ``-slope[b, h] * |i + off - j|`` is added to the (capped) score (FlashAttention's
            convention; ``off`` as for causal). Not differentiable.
        sinks: None, or (H,) floating logits (gpt-oss' attention sinks): each query head's
            ``exp(sink[h])`` joins every row's softmax denominator without a value, so rows
            may attend to "nothing". Differentiable (a learnable parameter gets its gradient);
            the returned lse includes it.
        backend: "auto" (the fastest backend able to serve this call) or a name from
            :func:`mhakern.available_backends`.
        return_lse: also return the log-sum-exp of the visible scaled (and masked) scores.

    Any strides with unit stride on the last dim are used without a copy, so (B, L, H, D)
    tensors viewed through ``.transpose(1, 2)`` work as they are. A query row that sees no key
    gets output 0, lse = -inf (the sink's value with sinks) and zero gradients. A NaN or inf in
    a visible input propagates; hidden positions never influence anything. Computation
    accumulates in fp32.

    Returns:
        ``out`` (B, H, Lq, Dv) in q's dtype, and with ``return_lse`` also ``lse`` (B, H, Lq),
        natural log (not differentiable), float32 (float64 for float64 inputs).
    """
    check_qkv(q, k, v)
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    check_bool("causal", causal)
    check_bool("return_lse", return_lse)
    check_dropout_p(dropout_p)
    if dropout_p == 1.0:
        # Every probability dropped, as torch's dropout does it: the output times 0 (zeros,
        # NaN stays NaN), zero gradients; lse stays that of the undropped softmax.
        res = attention(q, k, v, attn_mask=attn_mask, causal=causal, causal_align=causal_align, window=window,
                        scale=scale, key_lengths=key_lengths, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                        backend=backend, return_lse=True)
        return (res[0] * 0.0, res[1]) if return_lse else res[0] * 0.0
    if attn_mask is not None and is_causal_bias(attn_mask):
        attn_mask, causal, causal_align = causal_from_bias(attn_mask, causal, causal_align, window, key_lengths, Lq, Lk)
    scale = check_scale(scale, D)
    check_backend(backend)
    # The alignment matters only with causal (without a window or ALiBi, which are not plain):
    # SDPA's drop-in names "top_left" on every call.
    plain = (attn_mask is None and dropout_p == 0.0 and window is None and softcap is None and alibi_slopes is None
             and sinks is None and (causal_align == "bottom_right" or (causal_align == "top_left" and not causal)))
    modes = DEFAULT_MODES if plain else parse_modes(q, B, H, Lq, Lk, attn_mask, dropout_p, generator, causal,
                                                    causal_align, window, softcap, alibi_slopes, sinks)
    needs_grad = torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or modes.mask_grad
        or (modes.sinks is not None and modes.sinks.requires_grad)
    )
    out, lse = route(q, k, v, scale, causal, key_lengths, backend, modes, needs_grad)
    return (out, lse) if return_lse else out
