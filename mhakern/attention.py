"""Public functional API: argument parsing into the call record, dispatch, and the call.

The call itself goes through the operator ``torch.ops.mhakern.attn_fwd`` (mhakern/ops.py), the
one autograd boundary; a call that needs no gradient goes straight to the backend (the same
implementation, without the dispatcher's round trip). Semantics (visibility, modes, dropout
hash, NaN/inf rule, score modifiers): docs/contract.md.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch

from . import backends
from ._errors import ArgumentError
from .modes import DEFAULT_MODES, Modes, mask_4d
from .ops import (
    CAUSAL_ALIGNS,
    alibi_slopes_bh,
    call_attention,
    check_mask,
    check_qkv,
    check_scale,
    check_sinks,
    check_softcap,
    draw_seed,
    forward_impl,
    is_causal_bias,
    mask_dtype,
    prepare,
    resolve_causal_bias,
)

Tensor = torch.Tensor


_INT64_MAX = 2**63 - 1


def _window(window, causal: bool, Lq: int, Lk: int) -> Tuple[int, int]:
    """(left, right) of ``window`` (-1 = unbounded), checked: ints in [-1, 2**63 - 1]. A side
    of at least Lq + Lk bounds nothing (``|i + off - j| < Lq + Lk`` for every query and key,
    either alignment, any key lengths) and becomes -1, so that no backend adds it to a
    position in a narrower integer."""
    if window is None:
        return -1, -1
    if (
        not isinstance(window, (tuple, list))
        or len(window) != 2
        or any(isinstance(w, bool) or not isinstance(w, int) or not -1 <= w <= _INT64_MAX for w in window)
    ):
        raise ArgumentError(f"window: expected None or (left, right), two ints in [-1, 2**63 - 1] (-1 = unbounded), "
                            f"got {window!r}")
    left, right = (-1 if w >= Lq + Lk else w for w in window)
    if causal and (left >= 0 or right >= 0):
        right = 0  # causal with a window is the window with right = min(right, 0)
    return left, right


def _causal_from_bias(bias, causal, causal_align, window, key_lengths, Lq, Lk):
    """(attn_mask, causal, causal_align) standing for a CausalBias ``attn_mask`` (ops.resolve_causal_bias)."""
    if causal:
        raise ArgumentError("attn_mask, causal: a CausalBias is already causal masking; give causal=False "
                            "(as torch's SDPA: CausalBias should not be used with causal=True)")
    mask, top_left = resolve_causal_bias(bias, Lq, Lk, exact_bottom_right=key_lengths is None)
    align = "top_left" if top_left else "bottom_right"
    if window is not None and align != causal_align:
        raise ArgumentError(f"attn_mask, causal_align: this CausalBias is {align} causal masking, but the window "
                            f"is aligned {causal_align!r}; pass causal_align={align!r}")
    if mask is not None:
        return mask.to(bias.device), False, causal_align
    return None, True, align


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
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse: expected a bool, got {type(return_lse).__name__}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p: expected a float in [0, 1], got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p <= 1.0:
        raise ArgumentError(f"dropout_p: expected a number in [0, 1], got {dropout_p!r}")
    if dropout_p == 1.0:
        # Every probability dropped, as torch's dropout does it: the output times 0 (zeros,
        # NaN stays NaN), zero gradients; lse stays that of the undropped softmax.
        res = attention(q, k, v, attn_mask=attn_mask, causal=causal, causal_align=causal_align, window=window,
                        scale=scale, key_lengths=key_lengths, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                        backend=backend, return_lse=True)
        return (res[0] * 0.0, res[1]) if return_lse else res[0] * 0.0
    if attn_mask is not None and is_causal_bias(attn_mask):
        attn_mask, causal, causal_align = _causal_from_bias(attn_mask, causal, causal_align, window, key_lengths, Lq, Lk)
    scale = check_scale(scale, D)
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a string, got {type(backend).__name__}")
    # The alignment matters only with causal (without a window or ALiBi, which are not plain):
    # SDPA's drop-in names "top_left" on every call.
    plain = (attn_mask is None and dropout_p == 0.0 and window is None and softcap is None and alibi_slopes is None
             and sinks is None and (causal_align == "bottom_right" or (causal_align == "top_left" and not causal)))
    modes = DEFAULT_MODES if plain else _parse_modes(q, B, H, Lq, Lk, attn_mask, dropout_p, generator, causal,
                                                     causal_align, window, softcap, alibi_slopes, sinks)
    needs_grad = torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or modes.mask_grad
        or (modes.sinks is not None and modes.sinks.requires_grad)
    )
    if needs_grad or torch.compiler.is_compiling():
        # The operator checks the rest (once) and carries the autograd.
        out, lse = call_attention(q, k, v, scale, causal, key_lengths, backend, modes)
    else:
        # Nothing to differentiate: the operator's implementation directly, without its round
        # trip through the dispatcher.
        q, k, v, kl, be, modes = prepare(q, k, v, scale, causal, key_lengths, backend, modes, qkv_checked=True)
        out, lse = forward_impl(be, q, k, v, scale, causal, kl, modes)
    return (out, lse) if return_lse else out


def _parse_modes(q, B, H, Lq, Lk, attn_mask, dropout_p, generator, causal, causal_align, window, softcap,
                 alibi_slopes, sinks) -> Modes:
    """The call record of attention()'s public mode arguments (checked, named on error); the
    mask 4-D (not yet broadcast) in the kernels' dtype, the slopes float32 (B, H)."""
    if causal_align not in CAUSAL_ALIGNS:
        raise ArgumentError(f"causal_align: expected one of {CAUSAL_ALIGNS}, got {causal_align!r}")
    wl, wr = _window(window, causal, Lq, Lk)
    top_left = causal_align == "top_left" and (causal or wl >= 0 or wr >= 0 or alibi_slopes is not None)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected None or a torch.Generator, got {type(generator).__name__}")
    check_mask(attn_mask, B, H, Lq, Lk, q.device)
    mask, mask_grad = attn_mask, False
    if mask is not None:
        if mask.is_floating_point():
            # Kernels take float32 masks (float64 for float64 inputs); converted before the
            # broadcast so that a small mask stays small.
            mask = mask.to(mask_dtype(q.dtype))
            mask_grad = mask.requires_grad and torch.is_grad_enabled()
        mask = mask_4d(mask)
    seed = draw_seed(generator) if dropout_p > 0.0 else 0
    cap = 0.0 if softcap is None else check_softcap(softcap)
    slopes = None if alibi_slopes is None else alibi_slopes_bh(alibi_slopes, B, H, q.device)
    check_sinks(sinks, H, q.device)
    # The default record itself when every field is at its default (the SDPA drop-in's plain
    # call names an alignment): later steps skip their checks for it.
    return Modes.build(attn_mask=mask, dropout_p=float(dropout_p), seed=seed, top_left=top_left, window=(wl, wr),
                       mask_grad=mask_grad, softcap=cap, alibi_slopes=slopes, sinks=sinks)


def prepare_nograd(q: Tensor, k: Tensor, v: Tensor, *, attn_mask: Optional[Tensor] = None, causal: bool = False,
                   causal_align: str = "bottom_right", window: Optional[Sequence[int]] = None,
                   scale: Optional[float] = None, key_lengths: Optional[Tensor] = None, backend: str = "auto"):
    """:func:`attention`'s checks and preparation of a call that needs no gradient (no dropout,
    softcap, ALiBi or sinks), without running it. Returns ``(be, q, k, v, scale, causal,
    key_lengths, modes)``, the arguments of :func:`mhakern.ops.forward_impl`, whose ``out`` is
    attention()'s. For a caller that makes several calls sharing the masks and lengths and one
    signature (a model's layers within one forward step): the preparation holds for any q, k, v
    of the same dtypes, devices, shapes and strides, provided that q, k and v come back as given
    (no layout copy was needed). Raises what attention() raises."""
    check_qkv(q, k, v)
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    if attn_mask is not None and is_causal_bias(attn_mask):
        attn_mask, causal, causal_align = _causal_from_bias(attn_mask, causal, causal_align, window, key_lengths, Lq, Lk)
    scale = check_scale(scale, D)
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a string, got {type(backend).__name__}")
    modes = _parse_modes(q, B, H, Lq, Lk, attn_mask, 0.0, None, causal, causal_align, window, None, None, None)
    q, k, v, kl, be, modes = prepare(q, k, v, scale, causal, key_lengths, backend, modes, qkv_checked=True,
                                     grad=False)
    return be, q, k, v, scale, causal, kl, modes
