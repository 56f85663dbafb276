"""Public functional API: argument checks, dispatch, and the one autograd Function.

Semantics (visibility, modes, dropout hash, NaN/inf rule): docs/contract.md.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch

from . import backends
from .backends import DEFAULT_MODES
from ._errors import ArgumentError
from .ops import (
    CAUSAL_ALIGNS,
    backward_impl,
    check_key_lengths_meta,
    check_mask,
    check_modes,
    check_qkv,
    check_scale,
    draw_seed,
    expand_mask,
    forward_impl,
    is_causal_bias,
    make_modes,
    mask_dtype,
    prepare_key_lengths,
    reduce_mask_grad,
    resolve_causal_bias,
    _unit_last_stride,
)
from .reference import attention as _math_attention

Tensor = torch.Tensor


class FusedAttentionFunction(torch.autograd.Function):
    """Autograd over one backend's forward and backward, for every backend.

    Saves q, k, v, out, lse (and the mask); the backward recomputes the probabilities from lse,
    and the dropout keep mask from the saved seed. ``lse`` is a non-differentiable output. A
    floating ``attn_mask`` (4-D, size 1 on its broadcast dims) gets its gradient, reduced to
    its shape. While torch.compile traces, it calls the custom ops ``torch.ops.mhakern.*``
    (opaque graph nodes); in eager mode it calls the same implementations directly.
    """

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, scale, causal, key_lengths, backend, dropout_p, seed, top_left,
                window_left, window_right, mask_grad):
        if torch.compiler.is_compiling():
            out, lse = torch.ops.mhakern.attn_fwd(
                q, k, v, scale, causal, key_lengths, backend, attn_mask, dropout_p, seed, top_left,
                window_left, window_right,
            )
        else:
            B, H, Lq, _ = q.shape
            modes = make_modes(expand_mask(attn_mask, B, H, Lq, k.shape[2]), dropout_p, seed, top_left,
                               window_left, window_right, False)
            out, lse = forward_impl(backends.get(backend), q, k, v, scale, causal, key_lengths, modes)
        ctx.save_for_backward(q, k, v, out, lse, key_lengths, attn_mask)
        # lse never receives a gradient: no zeros tensor for it on every backward.
        ctx.set_materialize_grads(False)
        ctx.args = (scale, causal, backend, dropout_p, seed, top_left, window_left, window_right, mask_grad)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, key_lengths, attn_mask = ctx.saved_tensors
        if dout is None:  # only lse was used downstream: nothing flows back
            return (None,) * 14
        scale, causal, backend, dropout_p, seed, top_left, wl, wr, mask_grad = ctx.args
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            # create_graph=True: the gradients must themselves be differentiable, which no
            # kernel's backward is. They come from the math formula instead (docs/contract.md,
            # "Second derivatives").
            return _differentiable_backward(ctx, dout, q, k, v, attn_mask, key_lengths)
        if torch.compiler.is_compiling():
            dq, dk, dv, dmask = torch.ops.mhakern.attn_bwd(
                dout, q, k, v, out, lse, scale, causal, key_lengths, backend, attn_mask, dropout_p, seed,
                top_left, wl, wr, mask_grad,
            )
        else:
            B, H, Lq, _ = q.shape
            modes = make_modes(expand_mask(attn_mask, B, H, Lq, k.shape[2]), dropout_p, seed, top_left, wl, wr,
                               mask_grad)
            dq, dk, dv, dmask = backward_impl(backends.get(backend), dout, q, k, v, out, lse, scale, causal,
                                              key_lengths, modes)
            if mask_grad:
                dmask = reduce_mask_grad(dmask, attn_mask.shape)
        gmask = dmask.to(attn_mask.dtype) if mask_grad else None
        return dq, dk, dv, gmask, None, None, None, None, None, None, None, None, None, None


def _differentiable_backward(ctx, dout, q, k, v, attn_mask, key_lengths):
    """The backward of :class:`FusedAttentionFunction` as a graph of differentiable torch ops:
    the gradients of the math formula (:func:`mhakern.reference.attention`, with the same
    visibility, mask and dropout keep mask), so that second derivatives are exact. Costs the
    (Lq x Lk) score matrix; used only under ``create_graph=True``."""
    scale, causal, _backend, dropout_p, seed, top_left, wl, wr, mask_grad = ctx.args
    wanted = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2], mask_grad]
    modes = make_modes(attn_mask, dropout_p, seed, top_left, wl, wr, mask_grad)
    # fp32 work for half inputs, as every backend accumulates; the casts are part of the graph.
    wdt = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    inputs = [x for x, w in zip((q, k, v, attn_mask), wanted) if w]
    with torch.enable_grad():
        out = _math_attention(q.to(wdt), k.to(wdt), v.to(wdt), scale, causal, key_lengths, upcast=False, modes=modes)
        grads = torch.autograd.grad(out, inputs, dout.to(wdt), create_graph=True, allow_unused=True)
    it = iter(grads)
    res = [next(it) if w else None for w in wanted]
    res = [torch.zeros_like(x) if w and g is None else g for x, g, w in zip((q, k, v, attn_mask), res, wanted)]
    return (res[0], res[1], res[2], res[3]) + (None,) * 10


def _window(window, causal: bool) -> Tuple[int, int]:
    if window is None:
        return -1, -1
    if (
        not isinstance(window, (tuple, list))
        or len(window) != 2
        or any(isinstance(w, bool) or not isinstance(w, int) or w < -1 for w in window)
    ):
        raise ArgumentError(f"window: expected None or (left, right), two ints >= -1 (-1 = unbounded), got {window!r}")
    left, right = window
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
            "top_left" (``off = 0``, SDPA's ``is_causal``); also aligns ``window``.
        window: ``(left, right)`` sliding window, -1 = unbounded on that side (FlashAttention's
            ``window_size``): ``i + off - left <= j <= i + off + right``.
        scale: multiplies ``q @ k^T``; default ``1 / sqrt(D)``.
        key_lengths: optional integer tensor (B,); keys at positions >= key_lengths[b] are
            hidden. Values must lie in [0, Lk] (checked in their own dtype).
        backend: "auto" (the fastest backend able to serve this call) or a name from
            :func:`mhakern.available_backends`.
        return_lse: also return the log-sum-exp of the visible scaled (and masked) scores.

    Any strides with unit stride on the last dim are used without a copy, so (B, L, H, D)
    tensors viewed through ``.transpose(1, 2)`` work as they are. A query row that sees no key
    gets output 0, lse = -inf and zero gradients. A NaN or inf in a visible input propagates;
    hidden positions never influence anything. Computation accumulates in fp32.

    Returns:
        ``out`` (B, H, Lq, Dv) in q's dtype, and with ``return_lse`` also ``lse`` float32
        (B, H, Lq), natural log (not differentiable).
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
                        scale=scale, key_lengths=key_lengths, backend=backend, return_lse=True)
        return (res[0] * 0.0, res[1]) if return_lse else res[0] * 0.0
    if attn_mask is not None and is_causal_bias(attn_mask):
        attn_mask, causal, causal_align = _causal_from_bias(attn_mask, causal, causal_align, window, key_lengths, Lq, Lk)
    scale = check_scale(scale, D)
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a string, got {type(backend).__name__}")
    check_key_lengths_meta(key_lengths, B, q.device)
    compiling = torch.compiler.is_compiling()
    # Under torch.compile the values are checked by the op, on real tensors.
    kl = key_lengths if compiling else prepare_key_lengths(key_lengths, Lk, q.device)
    q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)

    plain = attn_mask is None and dropout_p == 0.0 and window is None and causal_align == "bottom_right"
    if plain:
        top_left, wl, wr, mask, mask_grad, seed, dropout_p = False, -1, -1, None, False, 0, 0.0
        modes = DEFAULT_MODES
    else:
        if causal_align not in CAUSAL_ALIGNS:
            raise ArgumentError(f"causal_align: expected one of {CAUSAL_ALIGNS}, got {causal_align!r}")
        wl, wr = _window(window, causal)
        top_left = causal_align == "top_left" and (causal or wl >= 0 or wr >= 0)
        check_modes(dropout_p, top_left, wl, wr)
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
            if mask.dim() < 4:
                mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        seed = 0
        if dropout_p > 0.0:
            seed = draw_seed(generator)
        dropout_p = float(dropout_p)
        modes = make_modes(None if mask is None else expand_mask(mask, B, H, Lq, Lk), dropout_p, seed, top_left,
                           wl, wr, mask_grad)
    be = backends.select(backend, q, k, v, causal, kl, modes.required_features())

    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or mask_grad)
    if not needs_grad and not compiling:
        # Nothing to differentiate: the backend directly, without the autograd Function.
        out, lse = forward_impl(be, q, k, v, scale, causal, kl, modes)
        return (out, lse) if return_lse else out
    # Self-attention callers may pass one tensor as q, k and v; torch.compile refuses an
    # autograd.Function given the same tensor twice, so distinct views (free) stand in.
    if k is q:
        k = k.view(k.shape)
    if v is q or v is k:
        v = v.view(v.shape)
    out, lse = FusedAttentionFunction.apply(
        q, k, v, mask, scale, causal, kl, be.name, dropout_p, seed, top_left, wl, wr, mask_grad
    )
    return (out, lse) if return_lse else out
