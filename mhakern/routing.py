"""The one route from a public entry point to a backend.

Every public function (``mhakern.attention``, ``attention_varlen``, ``attention_with_kvcache``,
the SDPA drop-in, ``FusedMHA``, the transformers integration) checks and parses its own
arguments (mhakern/checks.py) into q, k, v in (B, H, L, D) layout and one call record
(mhakern/modes.py), then hands the call to :func:`route`:

* a call that needs a gradient enters the operator's autograd (:func:`mhakern.ops.apply_autograd`);
* under torch.compile the graph holds the operator itself (``torch.ops.mhakern.attn_fwd``);
* any other call runs the operator's implementation directly (:func:`mhakern.ops.prepare`, then
  :func:`mhakern.ops.forward_impl`), without the dispatcher's round trip.

Two shortcuts of the same route skip checks that were made once already, each behind the
public interface of mhakern.backends:

* :func:`plain_nograd`: a plain call without a gradient (a decode step) is checked once per call
  signature (``backends.remember_call``), later calls go from one lookup to the backend;
* :func:`prepare_nograd`: a call's checks and selection done once (:class:`PreparedCall`), for a
  caller that makes several calls of one signature over the same masks and lengths (a model's
  layers in one forward step).
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from . import backends
from ._layout import same_layout
from .checks import causal_from_bias, check_backend, check_bool, check_qkv, check_scale, is_causal_bias, parse_modes
from .modes import DEFAULT_MODES, Modes
from .ops import apply_autograd, attn_fwd, forward_impl, prepare

Tensor = torch.Tensor


def route(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, key_lengths: Optional[Tensor], backend: str,
          modes: Modes, needs_grad: bool, packing_checked: bool = False,
          key_lengths_checked: bool = False) -> Tuple[Tensor, Tensor]:
    """``(out, lse)`` of a call whose q, k, v (B, H, L, D), scale (a float), causal and backend
    (a string) the entry point has checked, and whose public mode arguments it parsed into
    ``modes``; the rest (key lengths, the record's fields, the selection) is checked on the way.

    ``needs_grad``: the call needs a gradient (grad mode on and q, k, v, a floating mask or the
    sinks requiring one). ``packing_checked`` / ``key_lengths_checked``: as for
    :func:`mhakern.ops.prepare`, for a caller that read those values itself (the KV cache's
    entry point); they matter only to a call without a gradient.
    """
    if torch.compiler.is_compiling():
        return attn_fwd(q, k, v, scale, causal, key_lengths, backend, *modes.op_args())
    if needs_grad:
        return apply_autograd(None, q, k, v, scale, causal, key_lengths, backend, modes)
    q, k, v, kl, be, modes = prepare(q, k, v, scale, causal, key_lengths, backend, modes, qkv_checked=True,
                                     grad=False, packing_checked=packing_checked,
                                     key_lengths_checked=key_lengths_checked)
    return forward_impl(be, q, k, v, scale, causal, kl, modes)


# ---------------------------------------------------------------------------------------------
# Plain calls without a gradient (a decode step): the checks once per call signature.
#
# Every check of a call without modes, key lengths or a gradient reads the tensors' metadata
# only (type, dims, dtypes, devices, shapes, strides) and the scale; the selection reads the
# same. A signature that passed them once and was served without a copy passes them again, so
# its later calls go from one lookup to the backend's forward: the checks, the selection's own
# signature and the layout step cost more than the C++ operator itself on a decode step
# (benchmarks/bench_transformers_generate.py, sdpa_dropin_call). backends.register() and
# clear_dispatch_cache() forget the remembered calls with the selections.

# Bound once: the lookup is the whole of a remembered call's routing.
_remembered_call = backends.remembered_call


def _plain_key(tag, q, k, v, causal: bool, backend):
    return (tag, backend, causal, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
            q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride())


def plain_nograd(tag, q, k, v, scale, causal: bool, backend, admit=None) -> Optional[Tensor]:
    """``out`` of :func:`mhakern.attention` (q, k, v, scale=scale, causal=causal,
    backend=backend) for a call without modes, key lengths or lse, or None when the call needs
    a gradient or runs under torch.compile (the caller takes its full path then). ``tag``
    names the caller's own conditions on the shapes (SDPA's ``enable_gqa``), part of the key;
    ``admit``: on a signature's first call, a function of no arguments saying whether the
    caller takes this path for it at all (None when not). Raises what that call raises,
    naming the argument."""
    if type(q) is not Tensor or type(k) is not Tensor or type(v) is not Tensor:
        return None
    if (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)) \
            or torch.compiler.is_compiling():
        return None
    key = _plain_key(tag, q, k, v, causal, backend)
    hit = _remembered_call(key)
    if hit is not None:
        be, default_scale, strides = hit
        scale = default_scale if scale is None else check_scale(scale, q.shape[3])
        out = be.forward(q, k, v, scale, causal, None, DEFAULT_MODES)[0]
        # The layout the first call's output had after same_layout: one comparison, not its steps.
        return out if out.stride() == strides else same_layout(out, q)
    if admit is not None and not admit():
        return None
    # A first call of this signature: mhakern.attention()'s steps for it, in its order.
    check_qkv(q, k, v)
    scale = check_scale(scale, q.shape[3])
    check_backend(backend)
    qc, kc, vc, kl, be, modes = prepare(q, k, v, scale, causal, None, backend, DEFAULT_MODES, qkv_checked=True)
    out, _ = forward_impl(be, qc, kc, vc, scale, causal, kl, modes)
    B, H, Lq, D = q.shape
    # Remembered: the calls forward_impl sends to the backend as they are (no copy by the
    # layout step, not empty, D > 0), by a backend the strict switch lets serve "auto".
    if qc is q and kc is k and vc is v and min(B, H, Lq, D, k.shape[2], v.shape[3]) > 0 and not be.fallback:
        backends.remember_call(key, (be, check_scale(None, D), out.stride()))
    return out


# ---------------------------------------------------------------------------------------------
# A call prepared once, run for several q, k, v of one signature


class PreparedCall:
    """The checks and selection of one call without a gradient, made once
    (:func:`prepare_nograd`): ``forward(q, k, v)`` runs it for any q, k, v of the signature it
    was prepared for (dtypes, devices, shapes and strides), over the same masks, lengths, scale
    and options. Returns ``out`` (B, H, Lq, Dv) as :func:`mhakern.attention` would."""

    __slots__ = ("backend", "scale", "causal", "key_lengths", "modes")

    def __init__(self, backend, scale: float, causal: bool, key_lengths: Optional[Tensor], modes: Modes):
        self.backend, self.scale, self.causal, self.key_lengths, self.modes = backend, scale, causal, key_lengths, modes

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        be = self.backend
        backends.note_served(be)
        return forward_impl(be, q, k, v, self.scale, self.causal, self.key_lengths, self.modes)[0]


def prepare_nograd(q: Tensor, k: Tensor, v: Tensor, *, attn_mask: Optional[Tensor] = None, causal: bool = False,
                   causal_align: str = "bottom_right", window: Optional[Sequence[int]] = None,
                   scale: Optional[float] = None, key_lengths: Optional[Tensor] = None,
                   backend: str = "auto") -> Tuple[PreparedCall, Tensor, Tensor, Tensor]:
    """:func:`mhakern.attention`'s checks and preparation of a call that needs no gradient (no
    dropout, softcap, ALiBi or sinks), without running it. Returns ``(call, q, k, v)``: the
    :class:`PreparedCall`, and q, k, v as it takes them (``call.forward(q, k, v)`` is
    attention()'s ``out``). The preparation holds for any q, k, v of the same dtypes, devices,
    shapes and strides provided that q, k and v came back as given (no layout copy was needed).
    Raises what attention() raises."""
    check_qkv(q, k, v)
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    check_bool("causal", causal)
    if attn_mask is not None and is_causal_bias(attn_mask):
        attn_mask, causal, causal_align = causal_from_bias(attn_mask, causal, causal_align, window, key_lengths, Lq, Lk)
    scale = check_scale(scale, D)
    check_backend(backend)
    modes = parse_modes(q, B, H, Lq, Lk, attn_mask, 0.0, None, causal, causal_align, window, None, None, None)
    q, k, v, kl, be, modes = prepare(q, k, v, scale, causal, key_lengths, backend, modes, qkv_checked=True,
                                     grad=False)
    return PreparedCall(be, scale, causal, kl, modes), q, k, v
