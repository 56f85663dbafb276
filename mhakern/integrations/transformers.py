"""An ``"mhakern"`` attention implementation for Hugging Face transformers.

::

    import mhakern.integrations.transformers as mk_transformers
    mk_transformers.register()            # idempotent; backend="auto" by default
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="mhakern")

:func:`register` adds two entries under the name ``"mhakern"``: an attention function
(``transformers.AttentionInterface``) and a mask function (``AttentionMaskInterface`` in
``transformers.masking_utils``). transformers passes ``attention_mask=None`` to an attention
implementation that has no mask function of its own, and padding and causality would be lost;
the mask function is what carries them.

How the model's visibility reaches :func:`mhakern.attention`
-------------------------------------------------------------
The mask function runs once per forward (per mask type: full, sliding) and returns a
:class:`Visibility` instead of a 4-D tensor; every layer's attention call then costs no mask
work. transformers describes a mask by a *mask function* over absolute positions (query
``q_offset + i``, key ``kv_offset + j``) and a 2-D padding mask (True = real token):

* the plain causal pattern (``kv <= q``), its sliding-window form (``q - sw < kv <= q``,
  Mistral/Qwen2/Gemma) and the bidirectional ones (with ``|q - kv| <= sw``) are recognised
  and mapped to ``causal``, ``window`` and an alignment: top-left when the queries start at the
  keys' start (prefill), bottom-right when the queries are the keys' suffix (generation with a
  KV cache), bottom-right over ``key_lengths = Lq + offset`` otherwise (a static cache);
* padding becomes ``key_lengths`` where each row's real tokens are a prefix and the alignment
  allows it (right padding), else a (B, 1, 1, Lk) bool ``attn_mask`` that is never expanded
  (left padding, arbitrary holes);
* anything else (packed sequences found from ``position_ids``, chunked attention, a model's
  own ``or``/``and`` mask functions, token-type blocks) is materialised by transformers' own
  ``sdpa_mask`` into a (B, 1, Lq, Lk) bool mask -- always correct, at SDPA's cost: B*Lq*Lk
  bytes built once per forward, and kernels that visit every key block.

Packed training (several sequences in one row, positions restarting) is thus a block-diagonal,
per-document causal bool mask. transformers finds packing while building masks only when no
cache object exists (``use_cache=False``); otherwise the attention call finds it from
``position_ids`` as the flash-attention path does (any batch size, only without a padding mask;
one host read per forward, cached across layers). The flash-attention kwargs
``cu_seq_lens_q``/``cu_seq_lens_k`` (a padding-free data collator's) are honoured the same way.
GQA models pass their fewer KV heads as they are (no ``repeat_kv`` copy). ``scaling`` and
``dropout`` go to mhakern as they come; T5's learned ``position_bias`` becomes an additive float
mask, which mhakern differentiates. Gemma 2's logit ``softcap`` becomes mhakern's ``softcap`` and
gpt-oss' attention sinks ``s_aux`` (the learned per-head ``sinks``) mhakern's ``sinks``, with
their gradient; an option mhakern does not have (a ``head_mask``), or one it cannot take as
given (a non-positive softcap, sinks not of shape (H,)), raises ``ValueError`` naming the
model's option.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

import mhakern

Tensor = torch.Tensor

#: The name under which :func:`register` adds the implementation (``attn_implementation=``).
NAME = "mhakern"

#: Oldest transformers release whose interfaces this module was checked against (its source:
#: the mask functions' ``(batch_size, q_length, kv_length, q_offset, kv_offset, ...)`` signature
#: appeared in 5.4.0). pyproject.toml's ``transformers`` extra carries the same bound.
MIN_TRANSFORMERS = "5.4.0"

_state = {"backend": "auto", "registered": False}


def _version_tuple(v: str) -> Tuple[int, ...]:
    out = []
    for part in v.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit()) if part[:1].isdigit() else ""
        out.append(int(digits) if digits else 0)
    return tuple(out)


def register(backend: str = "auto") -> None:
    """Register the ``"mhakern"`` attention and mask functions with transformers (idempotent).

    Args:
        backend: the mhakern backend every layer's call uses ("auto" or a name from
            :func:`mhakern.available_backends`); calling again with another name switches it.

    Raises:
        ImportError: transformers is missing or older than ``MIN_TRANSFORMERS``.
    """
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a string, got {type(backend).__name__}")
    if backend != "auto" and backend not in mhakern.available_backends():
        raise ValueError(f"backend: unknown backend {backend!r}; known: {sorted(mhakern.available_backends())}")
    try:
        import transformers
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:
        raise ImportError(
            f"mhakern.integrations.transformers needs transformers>={MIN_TRANSFORMERS} "
            f"(pip install 'mhakern[transformers]'): {e}"
        ) from None
    if _version_tuple(transformers.__version__) < _version_tuple(MIN_TRANSFORMERS):
        raise ImportError(
            f"mhakern.integrations.transformers needs transformers>={MIN_TRANSFORMERS}, "
            f"found {transformers.__version__}"
        )
    _state["backend"] = backend
    if not _state["registered"]:
        AttentionInterface.register(NAME, attention_forward)
        AttentionMaskInterface.register(NAME, mask_interface)
        _state["registered"] = True


# ---------------------------------------------------------------------------------------------
# The mask function: runs once per forward and per mask type


@dataclass(frozen=True)
class Visibility:
    """What one mask function call found, in :func:`mhakern.attention`'s terms.

    ``attn_mask`` is None, a (B, 1, 1, Lk) bool padding mask, or a (B, 1, Lq, Lk) bool mask of
    the whole visibility (``causal`` False and ``window`` None then). ``q_length`` and
    ``kv_length`` are the sizes it was made for; the attention call checks them.
    """

    causal: bool
    causal_align: str
    window: Optional[Tuple[int, int]]
    key_lengths: Optional[Tensor]
    attn_mask: Optional[Tensor]
    q_length: int
    kv_length: int

    # generate() with a static cache builds the masks ahead and hands them to the model's forward,
    # whose mask creation then sees a Visibility where a 2-D mask would be converted: ndim 4
    # marks it as prepared, and mask_interface passes it through.
    ndim = 4


def _pattern(mask_function, local_size, allow_causal_skip, allow_bidirectional_skip):
    """("causal" | "bidirectional", window) for the patterns mapped without a mask, else None.

    The plain patterns are recognised by identity. The sliding ones are closures made per
    forward; transformers passes ``local_size`` and leaves a skip flag set only for an
    unmodified base pattern, and chunked attention passes ``local_size`` too, so the closure is
    probed on positions that tell a window from chunks before it is trusted.
    """
    from transformers import masking_utils as mu

    if mask_function is mu.causal_mask_function and local_size is None:
        return "causal", None
    if mask_function is mu.bidirectional_mask_function and local_size is None:
        return "bidirectional", None
    if local_size is None or isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 1:
        return None
    if not (allow_causal_skip or allow_bidirectional_skip):
        return None
    kind = "causal" if allow_causal_skip else "bidirectional"
    sw = local_size
    q = torch.tensor([0, 1, sw - 1, sw, sw + 1, 2 * sw + 3, 3 * sw + 7]).view(1, 1, -1, 1)
    kv = torch.arange(3 * sw + 9).view(1, 1, 1, -1)
    zero = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    if kind == "causal":
        expect = (kv <= q) & (kv > q - sw)
    else:
        expect = (q - kv).abs() <= sw
    try:
        got = mask_function(zero, zero, q, kv)
        ok = isinstance(got, torch.Tensor) and got.shape == expect.shape and bool((got == expect).all())
    except Exception:  # a mask function that indexes tensors by position: not a base pattern
        ok = False
    if not ok:
        return None
    return kind, ((sw - 1, 0) if kind == "causal" else (sw, sw))


def _padding(attention_mask, batch_size, kv_length, kv_offset, device):
    """The (B, Lk) bool padding mask of keys ``kv_offset .. kv_offset + Lk``, None if all real.

    As transformers' ``prepare_padding_mask``: keys past the 2-D mask's end (a static cache's
    unwritten slots) are padding.
    """
    if attention_mask is None:
        return None
    pad = attention_mask
    if pad.dtype != torch.bool or pad.device != torch.device(device):
        pad = pad.to(device=device, dtype=torch.bool)
    if kv_offset or pad.shape[-1] != kv_length:
        pad = pad[:, kv_offset:kv_offset + kv_length]
    if pad.shape[-1] < kv_length:
        pad = torch.nn.functional.pad(pad, (0, kv_length - pad.shape[-1]), value=False)
    if pad.shape[0] != batch_size:
        pad = pad.expand(batch_size, -1)
    if bool(pad.all()):
        return None
    return pad


def _prefix_lengths(pad: Tensor) -> Optional[Tensor]:
    """int32 (B,) lengths if each row of ``pad`` is True on a prefix and False after, else None."""
    n = pad.sum(-1)
    prefix = torch.arange(pad.shape[-1], device=pad.device) < n[:, None]
    return n.to(torch.int32) if bool((prefix == pad).all()) else None


def mask_interface(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: Optional[Tensor] = None,
    local_size: Optional[int] = None,
    allow_is_causal_skip: bool = True,
    allow_is_bidirectional_skip: bool = False,
    use_vmap: bool = False,
    device="cpu",
    **kwargs,
):
    """transformers' mask-function signature (``AttentionMaskInterface``); returns a
    :class:`Visibility` (see the module docstring for what maps to what)."""
    from transformers import masking_utils as mu

    if mask_function is None:
        mask_function = mu.causal_mask_function
    if isinstance(attention_mask, Visibility):  # built ahead by generate() (see Visibility.ndim)
        if attention_mask.kv_length != kv_length or (
                not isinstance(q_length, torch.Tensor) and attention_mask.q_length != q_length):
            raise ValueError(
                f"attention_mask: a prepared mask for {attention_mask.q_length} queries and {attention_mask.kv_length} "
                f"keys does not fit this call's {q_length} and {kv_length}"
            )
        return attention_mask
    if isinstance(q_length, torch.Tensor):  # older callers pass cache_position in q_length's place
        q_offset, q_length = q_length[0], q_length.shape[0]
    sdpa_args = dict(
        batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
        mask_function=mask_function, attention_mask=attention_mask, local_size=local_size, use_vmap=use_vmap,
        device=device,
    )
    q_offset, kv_offset = int(q_offset), int(kv_offset)
    found = None if use_vmap else _pattern(mask_function, local_size, allow_is_causal_skip, allow_is_bidirectional_skip)
    if found is not None:
        kind, window = found
        pad = _padding(attention_mask, batch_size, kv_length, kv_offset, device)
        placed = _place(kind == "causal" or window is not None, q_offset - kv_offset, q_length, kv_length, pad,
                        batch_size, device)
        if placed is not None:
            align, key_lengths, attn_mask = placed
            return Visibility(kind == "causal", align, window, key_lengths, attn_mask, q_length, kv_length)
    # Everything else: transformers' own construction of the full bool mask.
    full = mu.sdpa_mask(allow_is_causal_skip=False, allow_is_bidirectional_skip=False, **sdpa_args)
    return Visibility(False, "bottom_right", None, None, full, q_length, kv_length)


def _place(positional: bool, off: int, Lq: int, Lk: int, pad, B: int, device):
    """(causal_align, key_lengths, attn_mask) for query ``i`` at key position ``i + off``.

    mhakern aligns top-left (offset 0) or bottom-right (offset ``Lk_b - Lq``, ``Lk_b`` the key
    length): key_lengths serve padding only where they leave that offset right. None when
    neither alignment gives ``off`` (the caller then builds the full mask).
    """
    prefix = None if pad is None else _prefix_lengths(pad)
    if not positional:  # no causal, no window: the offset is irrelevant
        if pad is None:
            return "bottom_right", None, None
        return ("bottom_right", prefix, None) if prefix is not None else ("bottom_right", None, pad[:, None, None, :])
    if pad is None and off == Lk - Lq:
        return "bottom_right", None, None
    if off == 0 and (pad is None or prefix is not None):
        return "top_left", prefix, None
    mask = None if pad is None else pad[:, None, None, :]
    if off == Lk - Lq:
        return "bottom_right", None, mask
    if off == 0:
        return "top_left", None, mask
    if 0 < off and Lq + off <= Lk:
        # Keys at or past Lq + off are after every query: hiding them changes nothing else. A
        # static cache's unwritten tail is exactly that padding: then no mask is needed.
        if prefix is not None and bool((prefix == Lq + off).all()):
            mask = None
        return "bottom_right", torch.full((B,), Lq + off, dtype=torch.int32, device=device), mask
    return None


# ---------------------------------------------------------------------------------------------
# The attention function: one call per layer


def _config_option(module, value) -> str:
    """The model config's option(s) holding ``value`` (for error messages)."""
    cfg = getattr(module, "config", None)
    names = []
    if cfg is not None:
        for k, v in vars(cfg).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v == value:
                names.append(k)
    return " or ".join(f"config.{n}" for n in names) if names else "the model's option"


def _modifiers(module, query, softcap, s_aux) -> dict:
    """mhakern.attention's softcap / sinks for the model's ``softcap`` / ``s_aux``; a value that
    cannot be taken raises naming the model's option."""
    kw = {}
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0.0 < softcap < float("inf"):
            raise ValueError(
                f"attn_implementation='mhakern': softcap={softcap!r} (set by {_config_option(module, softcap)}) must be "
                "a positive finite number, or None for no capping"
            )
        kw["softcap"] = float(softcap)
    if s_aux is not None:
        H = query.shape[1]
        if not isinstance(s_aux, Tensor) or not s_aux.is_floating_point() or s_aux.reshape(-1).shape != (H,):
            names = [n for n, p in module.named_parameters(recurse=False) if p is s_aux]
            where = f"{type(module).__name__}.{names[0]}" if names else f"{type(module).__name__}'s s_aux"
            shape = tuple(s_aux.shape) if isinstance(s_aux, Tensor) else type(s_aux).__name__
            raise ValueError(
                f"attn_implementation='mhakern': attention sinks (s_aux, {where}) must be one floating logit per query "
                f"head, ({H},); got {shape}"
            )
        kw["sinks"] = s_aux.reshape(H)
    return kw


def _refuse_head_mask(kwargs) -> None:
    if kwargs.get("head_mask") is not None:
        raise ValueError("attn_implementation='mhakern': head_mask is not supported; use attn_implementation='eager'")


def _segments_mask(cu_q: Tensor, cu_k: Tensor, Lq: int, Lk: int) -> Tensor:
    """(1, 1, Lq, Lk) bool: query and key in the same packed sequence (FlashAttention's cu_seqlens)."""
    if cu_q.dim() != 1 or cu_k.dim() != 1 or cu_q.shape != cu_k.shape:
        raise ValueError(
            f"cu_seq_lens_q, cu_seq_lens_k: expected two 1-D tensors of one length, got {tuple(cu_q.shape)} "
            f"and {tuple(cu_k.shape)}"
        )
    if int(cu_q[-1]) != Lq or int(cu_k[-1]) != Lk:
        raise ValueError(
            f"cu_seq_lens_q, cu_seq_lens_k: must end at the packed lengths ({Lq}, {Lk}) of a batch of one row, got "
            f"({int(cu_q[-1])}, {int(cu_k[-1])})"
        )
    seg_q = torch.searchsorted(cu_q[1:].contiguous(), torch.arange(Lq, device=cu_q.device), right=True)
    seg_k = torch.searchsorted(cu_k[1:].contiguous(), torch.arange(Lk, device=cu_k.device), right=True)
    return (seg_q[:, None] == seg_k[None, :]).view(1, 1, Lq, Lk)


# The last position_ids seen and their segments mask: every layer of a forward gets the same
# tensor, so the host read that detects packing happens once per forward, not per layer.
_segments_cache = [None, None, None]


def _position_segments(position_ids: Tensor, B: int, L: int) -> Optional[Tensor]:
    """(B, 1, L, L) bool same-sequence mask if ``position_ids`` show packing, else None.

    As transformers' ``find_packed_sequence_indices``: a new sequence starts wherever the
    position does not follow its predecessor by one.
    """
    key = (B, L, position_ids._version)
    if _segments_cache[0] is position_ids and _segments_cache[1] == key:
        return _segments_cache[2]
    if position_ids.dim() != 2 or position_ids.shape[-1] != L or position_ids.shape[0] not in (1, B):
        raise ValueError(f"position_ids: expected shape ({B} or 1, {L}), got {tuple(position_ids.shape)}")
    pos = position_ids.expand(B, -1)
    first = pos[:, :1] - 1
    seg = (torch.diff(pos, prepend=first, dim=-1) != 1).cumsum(-1)
    out = (seg[:, :, None] == seg[:, None, :])[:, None] if bool((seg[:, -1] != 0).any()) else None
    _segments_cache[:] = [position_ids, key, out]
    return out


def _and(mask: Optional[Tensor], extra: Tensor) -> Tensor:
    return extra if mask is None else mask & extra


def attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    is_causal: Optional[bool] = None,
    s_aux: Optional[Tensor] = None,
    **kwargs,
) -> Tuple[Tensor, None]:
    """transformers' attention-function signature (``AttentionInterface``).

    Args:
        query: (B, H, Lq, D); key, value: (B, Hkv, Lk, D|Dv), Hkv dividing H (GQA, as given).
        attention_mask: a :class:`Visibility` from :func:`mask_interface`; a 4-D bool (True =
            attend) or additive float mask a caller built itself (the whole visibility, as SDPA
            takes it); or None: then, as transformers' flash-attention path, ``is_causal`` (else
            ``module.is_causal``) bottom-right, ``sliding_window`` as the window and packing from
            ``position_ids``.
        dropout: attention dropout probability (transformers passes 0 in eval mode).
        scaling: the score scale (default 1/sqrt(D)).
        softcap: Gemma 2's logit cap (mhakern's ``softcap``), or None.
        s_aux: gpt-oss' attention sinks, one learned logit per query head (mhakern's
            ``sinks``; differentiable), or None.
        kwargs: ``cu_seq_lens_q``/``cu_seq_lens_k`` (packed, one row) restrict attention to each
            sequence; ``position_ids`` (see above); others not affecting attention are ignored.

    Returns:
        (attn_output (B, Lq, H, Dv) contiguous, None): transformers' convention.
    """
    modifiers = _modifiers(module, query, softcap, s_aux) if softcap is not None or s_aux is not None else {}
    Lq, Lk = query.shape[2], key.shape[2]
    vis = attention_mask
    if type(vis) is Visibility:
        if vis.q_length != Lq or vis.kv_length != Lk:
            raise ValueError(
                f"attention_mask: made for {vis.q_length} queries and {vis.kv_length} keys, but this layer has {Lq} "
                f"and {Lk}; the model changed the sizes after building the mask"
            )
        causal, align, window = vis.causal, vis.causal_align, vis.window
        key_lengths, mask = vis.key_lengths, vis.attn_mask
    elif vis is None:
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
        align, key_lengths, mask = "bottom_right", None, None
        window = None
        if sliding_window is not None and sliding_window < Lk:
            window = (sliding_window - 1, 0) if causal else (sliding_window - 1, sliding_window - 1)
    elif isinstance(vis, torch.Tensor):
        if vis.dim() != 4:
            raise ValueError(
                f"attention_mask: expected a 4-D mask (B, 1|H, Lq, Lk) or the mhakern mask function's output, got "
                f"shape {tuple(vis.shape)}; was the model built with attn_implementation='mhakern' after register()?"
            )
        causal, align, window, key_lengths, mask = False, "bottom_right", None, None, vis
    else:
        raise TypeError(f"attention_mask: expected None, a tensor or a Visibility, got {type(vis).__name__}")
    # Most calls carry only kwargs that do not change attention (position_ids in a decode step,
    # use_cache): one set intersection decides whether any of the others need looking at.
    if kwargs and not (_KWARGS_PACKED if Lq > 1 else _KWARGS).isdisjoint(kwargs):
        mask = _from_kwargs(module, query, Lq, Lk, mask, key_lengths, kwargs)
    out = mhakern.attention(
        query, key, value,
        attn_mask=mask, dropout_p=dropout, causal=causal, causal_align=align, window=window, scale=scaling,
        key_lengths=key_lengths, backend=_state["backend"], **modifiers,
    )
    return out.transpose(1, 2).contiguous(), None


# kwargs that change what a layer computes; position_ids only matter to a packed (Lq > 1) call.
_KWARGS = frozenset({"head_mask", "output_attentions", "cu_seq_lens_q", "cu_seq_lens_k", "position_bias"})
_KWARGS_PACKED = _KWARGS | {"position_ids"}


def _from_kwargs(module, query, Lq, Lk, mask, key_lengths, kwargs):
    """The mask after the kwargs that refine it (packing, position bias); refuses head_mask."""
    _refuse_head_mask(kwargs)
    if kwargs.get("output_attentions", False):
        warnings.warn("attn_implementation='mhakern' returns no attention weights (output_attentions=True ignored)",
                      stacklevel=3)
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    position_ids = kwargs.get("position_ids")
    if (position_ids is not None and cu_q is None and mask is None and key_lengths is None and Lq == Lk > 1
            and isinstance(position_ids, torch.Tensor)):
        # Packed rows without a padding mask, as transformers' flash-attention path finds them:
        # the mask function misses them whenever a cache object exists (use_cache=True).
        mask = _position_segments(position_ids, query.shape[0], Lq)
    if cu_q is not None or cu_k is not None:
        if cu_q is None or cu_k is None:
            raise ValueError("cu_seq_lens_q, cu_seq_lens_k: give both or neither")
        if query.shape[0] != 1:
            raise ValueError(f"cu_seq_lens_q: packed sequences need a batch of one row, got {query.shape[0]}")
        seg = _segments_mask(cu_q, cu_k, Lq, Lk)
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.masked_fill(~seg, float("-inf"))
        else:
            mask = _and(mask, seg)
    bias = kwargs.get("position_bias")
    if bias is not None:
        # T5-style relative position bias (B|1, H, Lq, Lk): an additive float mask, which
        # mhakern differentiates (the bias is learned). A bool mask is folded in as -inf.
        if mask is None:
            mask = bias
        elif mask.dtype == torch.bool:
            mask = bias.masked_fill(~mask, float("-inf"))
        else:
            mask = bias + mask
    return mask


__all__ = ["register", "NAME", "MIN_TRANSFORMERS", "Visibility", "attention_forward", "mask_interface"]
