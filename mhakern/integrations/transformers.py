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
* causal (or bidirectional) attention within consecutive blocks of each row, with or without
  the sliding window, and no padding -- packed sequences transformers found from
  ``position_ids``, chunked attention -- becomes a :class:`Packing` (prefix sums), recognised
  by comparing transformers' own mask with the candidate once per forward;
* anything else (a model's own ``or``/``and`` mask functions, token-type blocks, packing with
  padding) is materialised by transformers' own ``sdpa_mask`` into a (B, 1, Lq, Lk) bool mask
  -- always correct, at SDPA's cost: B*Lq*Lk bytes built once per forward, and kernels that
  visit every key block.

Packed training (several sequences in one row, positions restarting) goes to
:func:`mhakern.attention_varlen`, as transformers' flash-attention path goes to
``flash_attn_varlen_func``: the layer's (B, H, L, D) tensors are read as (B * L, H, D) tokens
(views for one row, and for rows in transformers' (B, L, H, D) memory), each sequence causal
within itself with the model's window, GQA, softcap, sinks and dropout as for a dense call; no
mask is built or read. transformers finds packing while building masks only when no cache object exists
(``use_cache=False``); otherwise the attention call finds it from ``position_ids`` as the
flash-attention path does (any batch size, only without a padding mask; one host read per
forward, cached across layers). The flash-attention kwargs ``cu_seq_lens_q``/``cu_seq_lens_k``
and ``max_length_q``/``max_length_k`` (a padding-free data collator's) are taken as they are.
Where the backend in use does not serve packed sequences (its ``features`` lack ``"varlen"``;
under ``"auto"``: where only the reference would serve them packed while a kernel serves the
dense call), the packing becomes its block-diagonal bool mask on a dense call, built once per
forward. GQA models pass their fewer KV heads as they are (no ``repeat_kv`` copy). ``scaling`` and
``dropout`` go to mhakern as they come; T5's learned ``position_bias`` becomes an additive float
mask, which mhakern differentiates. Gemma 2's logit ``softcap`` becomes mhakern's ``softcap`` and
gpt-oss' attention sinks ``s_aux`` (the learned per-head ``sinks``) mhakern's ``sinks``, with
their gradient; an option mhakern does not have (a ``head_mask``), or one it cannot take as
given (a non-positive softcap, sinks not of shape (H,)), raises ``ValueError`` naming the
model's option.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch

import mhakern
from mhakern import backends
from mhakern.routing import plain_nograd, prepare_nograd

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


# slots, not frozen: a frozen dataclass's __init__ costs 1.5 us more, once per forward of a
# decode step. Not to be modified once made (every layer of a forward shares it).
@dataclass(slots=True)
class Visibility:
    """What one mask function call found, in :func:`mhakern.attention`'s terms.

    ``attn_mask`` is None, a (B, 1, 1, Lk) bool padding mask, or a (B, 1, Lq, Lk) bool mask of
    the whole visibility (``causal`` False and ``window`` None then). ``packing``: None, or the
    packed sequences of the rows (``causal`` and ``window`` then hold within each sequence, and
    ``attn_mask`` and ``key_lengths`` are None). ``q_length`` and ``kv_length`` are the sizes it
    was made for; the attention call checks them.
    """

    causal: bool
    causal_align: str
    window: Optional[Tuple[int, int]]
    key_lengths: Optional[Tensor]
    attn_mask: Optional[Tensor]
    q_length: int
    kv_length: int
    packing: Optional["Packing"] = None
    # The one field written after construction: attention_forward's memo of the first layer's
    # prepared call, (signature, mhakern.routing.PreparedCall), which the next layers of the same
    # forward reuse (the checks, the mode record, the mask's broadcast view, the selection).
    prepared: Optional[tuple] = field(default=None, repr=False, compare=False)

    # generate() with a static cache builds the masks ahead and hands them to the model's forward,
    # whose mask creation then sees a Visibility where a 2-D mask would be converted: ndim 4
    # marks it as prepared, and mask_interface passes it through.
    ndim = 4


_MU = None  # transformers.masking_utils once imported (transformers is an optional dependency)


def _masking_utils():
    global _MU
    from transformers import masking_utils

    _MU = masking_utils
    return masking_utils


def _pattern(mask_function, local_size, allow_causal_skip, allow_bidirectional_skip):
    """("causal" | "bidirectional", window) for the patterns mapped without a mask, else None.

    The plain patterns are recognised by identity. The sliding ones are closures made per
    forward; transformers passes ``local_size`` and leaves a skip flag set only for an
    unmodified base pattern, and chunked attention passes ``local_size`` too, so the closure is
    probed on positions that tell a window from chunks before it is trusted.
    """
    mu = _MU or _masking_utils()
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
    if pad.dtype != torch.bool or pad.device != (device if isinstance(device, torch.device) else torch.device(device)):
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
    mu = _MU or _masking_utils()
    if (attention_mask is None and local_size is None and not use_vmap and type(q_length) is int
            and type(q_offset) is int and type(kv_offset) is int
            and (mask_function is None or mask_function is mu.causal_mask_function)
            and q_offset - kv_offset == kv_length - q_length):
        # A decode step with a dynamic cache and no padding (or such a prefill): the queries are
        # the keys' suffix, plain causal -- what the general path below finds, without its steps
        # (once per forward; sdpa_mask's own shortcut for this case costs ~1.3 us).
        return Visibility(True, "bottom_right", None, None, None, q_length, kv_length)
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
    given_offsets = (q_offset, kv_offset)  # as transformers passed them (a static cache's tensor), for sdpa_mask
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
    # Everything else: transformers' own construction of the full bool mask, then (without
    # padding, in a prefill) a look whether it is causal attention within blocks of each row:
    # packed sequences found from position_ids (no cache object), chunked attention.
    full = mu.sdpa_mask(
        batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=given_offsets[0],
        kv_offset=given_offsets[1], mask_function=mask_function, attention_mask=attention_mask, local_size=local_size,
        use_vmap=use_vmap, device=device, allow_is_causal_skip=False, allow_is_bidirectional_skip=False,
    )
    if attention_mask is None and q_offset == 0 and kv_offset == 0 and q_length == kv_length:
        found = _packing_from_mask(full.expand(batch_size, -1, -1, -1), local_size, device)
        if found is not None:
            causal, window, packing = found
            return Visibility(causal, "bottom_right", window, None, None, q_length, kv_length, packing)
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


# ---------------------------------------------------------------------------------------------
# Packed sequences: several sequences in the rows of one call, served by attention_varlen


class Packing:
    """Packed sequences of one call, in :func:`mhakern.attention_varlen`'s terms.

    The call's (B, H, Lq, D) queries are read as ``B * Lq`` tokens, row after row (its keys as
    ``B * Lk``); sequence s holds query tokens ``cu_q[s] .. cu_q[s + 1] - 1`` and key tokens
    ``cu_k[s] .. cu_k[s + 1] - 1``, and no sequence spans two rows. ``cu_q``, ``cu_k``: int32
    (num_seqs + 1,) prefix sums on the tensors' device; ``max_q``, ``max_k``: the longest
    sequence's lengths. Within a sequence causality and windows are bottom-right (offset
    ``Lk_s - Lq_s``, FlashAttention's varlen convention; 0 where a sequence has as many queries
    as keys, as a packed batch always does).
    """

    __slots__ = ("cu_q", "cu_k", "max_q", "max_k", "batch", "_masks")

    def __init__(self, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, batch: int):
        self.cu_q, self.cu_k, self.max_q, self.max_k, self.batch = cu_q, cu_k, max_q, max_k, batch
        self._masks = {}

    @property
    def num_seqs(self) -> int:
        return self.cu_q.shape[0] - 1

    def mask(self, causal: bool, window: Optional[Tuple[int, int]]) -> Tensor:
        """(B, 1, Lq, Lk) bool, True = visible: the visibility of the varlen call as a dense
        mask (for a backend that does not serve packed sequences; built once per forward)."""
        key = (causal, window)
        got = self._masks.get(key)
        if got is not None:
            return got
        B = self.batch
        seg_q, loc_q, len_q = self._tokens(self.cu_q)
        seg_k, loc_k, _ = self._tokens(self.cu_k)
        len_k = torch.diff(self.cu_k.long())
        # query i of sequence s sits at key position loc_q + Lk_s - Lq_s of that sequence
        diag = (loc_q + len_k[seg_q] - len_q).view(B, -1)
        seg_q, seg_k, loc_k = seg_q.view(B, -1), seg_k.view(B, -1), loc_k.view(B, -1)
        vis = seg_q[:, :, None] == seg_k[:, None, :]
        behind = diag[:, :, None] - loc_k[:, None, :]  # how far key j lies left of query i's diagonal
        if causal:
            vis &= behind >= 0
        if window is not None:
            left, right = window
            if left >= 0:
                vis &= behind <= left
            if right >= 0:
                vis &= behind >= -right
        out = vis[:, None]
        self._masks[key] = out
        return out

    @staticmethod
    def _tokens(cu: Tensor):
        """Per token: its sequence, its position in it, its sequence's length."""
        cu = cu.long()
        t = torch.arange(int(cu[-1]), device=cu.device)
        seg = torch.searchsorted(cu[1:].contiguous(), t, right=True)
        return seg, t - cu[seg], torch.diff(cu)[seg]


def _starts_to_packing(starts: Tensor, device) -> Optional[Packing]:
    """Packing of (B, L) bool sequence starts (column 0 all True), or None when every row holds
    one sequence (the dense call is then right as it is). One host read."""
    B, L = starts.shape
    first = starts.reshape(-1).nonzero().view(-1)
    if first.shape[0] == B:
        return None
    cu = torch.cat([first, first.new_full((1,), B * L)]).to(device=device, dtype=torch.int32)
    longest = int(torch.diff(first, append=first.new_full((1,), B * L)).max())
    return Packing(cu, cu, longest, longest, B)


# The last position_ids / cu_seq_lens seen and the Packing found from them: every layer of a
# forward gets the same tensors, so the host reads that find packing happen once per forward.
_packing_cache = {}


def _cached(kind: str, tensors, key, build):
    hit = _packing_cache.get(kind)
    full_key = (key, tuple(t._version for t in tensors))
    if hit is not None and all(a is b for a, b in zip(hit[0], tensors)) and hit[1] == full_key:
        return hit[2]
    out = build()
    _packing_cache[kind] = (tuple(tensors), full_key, out)
    return out


def _packing_from_positions(position_ids: Tensor, B: int, L: int, device) -> Optional[Packing]:
    """The sequences of ``position_ids`` (B or 1, L) if some row holds more than one, else None.

    As transformers' ``find_packed_sequence_indices``: a new sequence starts wherever the
    position does not follow its predecessor by one (and at every row's start).
    """
    if position_ids.dim() != 2 or position_ids.shape[-1] != L or position_ids.shape[0] not in (1, B):
        raise ValueError(f"position_ids: expected shape ({B} or 1, {L}), got {tuple(position_ids.shape)}")

    def build():
        pos = position_ids.expand(B, -1)
        starts = torch.ones(B, L, dtype=torch.bool, device=pos.device)
        starts[:, 1:] = (pos[:, 1:] - pos[:, :-1]) != 1
        return _starts_to_packing(starts, device)

    return _cached("position_ids", (position_ids,), (B, L, str(device)), build)


def _packing_from_cu(kwargs, B: int, Lq: int, Lk: int, device) -> Packing:
    """The Packing of a padding-free collator's ``cu_seq_lens_q/k`` (and ``max_length_q/k``)."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None or cu_k is None:
        raise ValueError("cu_seq_lens_q, cu_seq_lens_k: give both or neither")
    if not isinstance(cu_q, Tensor) or not isinstance(cu_k, Tensor) or cu_q.dim() != 1 or cu_q.shape != cu_k.shape:
        raise ValueError(
            f"cu_seq_lens_q, cu_seq_lens_k: expected two 1-D tensors of one length, got "
            f"{tuple(getattr(cu_q, 'shape', ()))} and {tuple(getattr(cu_k, 'shape', ()))}"
        )
    if B != 1:
        raise ValueError(f"cu_seq_lens_q: packed sequences need a batch of one row, got {B}")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")

    def build():
        if int(cu_q[-1]) != Lq or int(cu_k[-1]) != Lk:
            raise ValueError(
                f"cu_seq_lens_q, cu_seq_lens_k: must end at the packed lengths ({Lq}, {Lk}) of a batch of one row, "
                f"got ({int(cu_q[-1])}, {int(cu_k[-1])})"
            )
        mq = int(max_q) if isinstance(max_q, int) else int(torch.diff(cu_q).max())
        mk = int(max_k) if isinstance(max_k, int) else int(torch.diff(cu_k).max())
        same = cu_k is cu_q
        cq = cu_q.to(device=device, dtype=torch.int32)
        return Packing(cq, cq if same else cu_k.to(device=device, dtype=torch.int32), mq, mk, 1)

    return _cached("cu_seq_lens", (cu_q, cu_k), (Lq, Lk, max_q, max_k, str(device)), build)


def _packing_from_mask(full: Tensor, local_size, device):
    """(causal, window, Packing) when the (B, 1, L, L) bool mask ``full`` is causal (or
    bidirectional) attention within consecutive blocks of each row -- packed sequences found by
    transformers from ``position_ids``, chunked attention -- optionally with the sliding window
    ``local_size``; else None. Exact: the candidate is compared with the whole mask (once per
    forward, where the mask is made)."""
    if full.dim() != 4 or full.shape[1] != 1 or full.shape[2] != full.shape[3] or full.shape[2] < 2:
        return None
    m = full[:, 0]
    B, L, _ = m.shape
    if not bool(m.diagonal(dim1=-2, dim2=-1).all()):
        return None
    starts = torch.ones(B, L, dtype=torch.bool, device=m.device)
    starts[:, 1:] = ~m.diagonal(offset=-1, dim1=-2, dim2=-1)  # query i does not see key i - 1
    if bool(starts[:, 1:].any()) is False:
        return None
    causal = not bool(m.diagonal(offset=1, dim1=-2, dim2=-1).any())
    seg = starts.cumsum(-1)
    same = seg[:, :, None] == seg[:, None, :]
    i = torch.arange(L, device=m.device)
    behind = i[:, None] - i[None, :]
    windows = [None]  # first: a window no block outgrows is not worth the kernels' window logic
    if isinstance(local_size, int) and not isinstance(local_size, bool) and local_size >= 1:
        windows.append((local_size - 1, 0) if causal else (local_size, local_size))
    for window in windows:
        want = same & (behind >= 0) if causal else same.clone()
        if window is not None:
            want &= (behind <= window[0]) & (behind >= -window[1])
        if torch.equal(want, m):
            packing = _starts_to_packing(starts, device)
            return (causal, window, packing) if packing is not None else None
    return None


def _serves_varlen(query, key, value, packed, packing, causal, window, dropout, modifiers) -> bool:
    """Whether the packed call goes to attention_varlen (else to a dense call with the
    packing's mask): the backend the call names must serve "varlen" (its ``features`` say), and
    under "auto" a packed call must not fall back to the reference while a fast kernel would
    serve the masked dense call."""
    from mhakern import backends
    from mhakern.modes import Modes

    name = _state["backend"]
    q3, k3, v3 = packed
    p = modifiers.get("softcap", 0.0)
    needed = Modes.build(dropout_p=dropout, window=window, softcap=p, cu_seqlens_q=packing.cu_q,
                         cu_seqlens_k=packing.cu_k).required_features()
    try:
        be = backends.select(name, *(x.transpose(0, 1).unsqueeze(0) for x in (q3, k3, v3)), causal, None, needed)
    except ValueError:  # the named backend lacks it, or strict dispatch refuses the fallback
        return False
    if be.fallback and name == "auto":
        dense = (needed - {"varlen"}) | {"attn_mask"}
        try:
            return backends.select("auto", query, key, value, False, None, dense).fallback
        except ValueError:
            return True
    return True


def _packed_attention(query, key, value, packing: Packing, causal, window, dropout, scaling, modifiers):
    """One layer's packed call: (B, Lq, H, Dv), through attention_varlen where the backend
    serves it, else a dense call with the packing's (B, 1, Lq, Lk) mask."""
    B, H, Lq, D = query.shape
    Lk = key.shape[2]
    if packing.batch != B:
        raise ValueError(f"attention_mask: packed sequences found for {packing.batch} rows, but this layer has {B}")
    # (B, H, L, D) -> (B * L, H, D): a view for transformers' (B, L, H, D) projections and B = 1
    q3 = query.transpose(1, 2).reshape(B * Lq, H, D)
    k3 = key.transpose(1, 2).reshape(B * Lk, key.shape[1], key.shape[3])
    v3 = value.transpose(1, 2).reshape(B * Lk, value.shape[1], value.shape[3])
    if _serves_varlen(query, key, value, (q3, k3, v3), packing, causal, window, dropout, modifiers):
        out = mhakern.attention_varlen(
            q3, k3, v3, packing.cu_q, packing.cu_k, packing.max_q, packing.max_k, causal=causal, window=window,
            scale=scaling, dropout_p=dropout, backend=_state["backend"], **modifiers,
        )
        return out.view(B, Lq, H, out.shape[-1])
    out = mhakern.attention(
        query, key, value, attn_mask=packing.mask(causal, window), dropout_p=dropout, scale=scaling,
        backend=_state["backend"], **modifiers,
    )
    return out.transpose(1, 2).contiguous()


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
        kwargs: ``cu_seq_lens_q``/``cu_seq_lens_k`` (with ``max_length_q``/``max_length_k``;
            packed, one row) restrict attention to each sequence; ``position_ids`` (see above);
            others not affecting attention are ignored.

    A call that needs no gradient and carries no mask, key lengths, window, packing, dropout,
    softcap or sinks (a decode step with a KV cache, an unpadded prefill in eval mode) goes
    through :func:`mhakern.routing.plain_nograd`: attention()'s checks on its signature's first
    call, one lookup on later ones. Other calls without gradient, dropout, softcap or sinks (a
    padded decode step: a padding mask or key lengths) are prepared once per forward, by the
    first layer, and the later layers reuse that preparation (:func:`_prepared_call`).

    Packed sequences (from the mask function, ``position_ids`` or ``cu_seq_lens_q/k``) go to
    :func:`mhakern.attention_varlen` as (B * L, H, D) views, unless the backend does not serve
    packed sequences: then to :func:`mhakern.attention` with their block-diagonal mask.

    Returns:
        (attn_output (B, Lq, H, Dv) contiguous, None): transformers' convention.
    """
    vis = attention_mask
    if (type(vis) is Visibility and vis.attn_mask is None and vis.key_lengths is None and vis.window is None
            and vis.packing is None and not dropout and softcap is None and s_aux is None):
        out = _plain(query, key, value, vis, scaling, kwargs)
        if out is not None:
            return out, None
    modifiers = _modifiers(module, query, softcap, s_aux) if softcap is not None or s_aux is not None else {}
    Lq, Lk = query.shape[2], key.shape[2]
    packing = None
    if type(vis) is Visibility:
        if vis.q_length != Lq or vis.kv_length != Lk:
            raise ValueError(
                f"attention_mask: made for {vis.q_length} queries and {vis.kv_length} keys, but this layer has {Lq} "
                f"and {Lk}; the model changed the sizes after building the mask"
            )
        causal, align, window = vis.causal, vis.causal_align, vis.window
        key_lengths, mask, packing = vis.key_lengths, vis.attn_mask, vis.packing
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
        causal, window, mask, packing = _from_kwargs(module, query, Lk, causal, window, mask, key_lengths, packing,
                                                     kwargs)
    if packing is not None:
        return _packed_attention(query, key, value, packing, causal, window, dropout, scaling, modifiers), None
    if Lq == 1 and align == "bottom_right" and window is None:
        # One query, bottom-right: it sees every key below its element's length (j <= Lk_b - 1),
        # which key_lengths and the mask already say; the causal kernels' checks cost time.
        causal = False
    if (type(vis) is Visibility and mask is vis.attn_mask and not dropout and not modifiers
            and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad))):
        return _prepared_call(vis, query, key, value, causal, align, window, scaling, key_lengths, mask), None
    out = mhakern.attention(
        query, key, value,
        attn_mask=mask, dropout_p=dropout, causal=causal, causal_align=align, window=window, scale=scaling,
        key_lengths=key_lengths, backend=_state["backend"], **modifiers,
    )
    return out.transpose(1, 2).contiguous(), None


def _prepared_call(vis: Visibility, query, key, value, causal, align, window, scaling, key_lengths, mask) -> Tensor:
    """The layer's (B, Lq, H, Dv) output of a call without gradient over ``vis``'s masks and
    lengths: the first layer of a forward prepares it (:func:`mhakern.routing.prepare_nograd`,
    all of attention()'s checks), the others reuse that preparation when their q, k, v have its
    signature (a decode step's layers do; a left-padded decode call of a 4-layer Llama went from
    140 to 90 us, 2-core AMD EPYC, the same call repeated).
    What the preparation read (the masks, lengths, scale, options) is the same for every layer
    of one forward; only q, k, v change, and their signature is compared."""
    sig = (query.dtype, query.device, query.shape, key.shape, value.shape, query.stride(), key.stride(),
           value.stride(), key.dtype, value.dtype, key.device, value.device, scaling, causal, _state["backend"])
    memo = vis.prepared
    if memo is not None and memo[0] == sig:
        return memo[1].forward(query, key, value).transpose(1, 2).contiguous()
    call, q, k, v = prepare_nograd(
        query, key, value, attn_mask=mask, causal=causal, causal_align=align, window=window, scale=scaling,
        key_lengths=key_lengths, backend=_state["backend"])
    out = call.forward(q, k, v)
    if q is query and k is key and v is value:  # no layout copy: later layers pass the same way
        vis.prepared = (sig, call)
    return out.transpose(1, 2).contiguous()


# kwargs that change what a layer computes; position_ids only matter to a packed (Lq > 1) call.
_KWARGS = frozenset({"head_mask", "output_attentions", "cu_seq_lens_q", "cu_seq_lens_k", "position_bias"})
_KWARGS_PACKED = _KWARGS | {"position_ids"}


def _plain(query, key, value, vis: Visibility, scaling, kwargs) -> Optional[Tensor]:
    """The layer's (B, Lq, H, Dv) output through :func:`mhakern.routing.plain_nograd` when ``vis``
    (no mask, key lengths, window or packing; the caller checked) and the kwargs leave a plain
    call, else None (the full path then decides, and raises what it raises).

    A decode step with a KV cache is bottom-right causal over one query, which sees every key:
    the plain non-causal call, the signature SDPA's drop-in decode call also has. After a
    signature's first call (attention()'s checks) a call costs one lookup and the kernel.
    """
    Lq, Lk = query.shape[2], key.shape[2]
    if vis.q_length != Lq or vis.kv_length != Lk:
        return None
    if kwargs and not (_KWARGS_PACKED if Lq > 1 else _KWARGS).isdisjoint(kwargs):
        return None
    causal = vis.causal
    if causal:
        if vis.causal_align != "bottom_right" and Lq != Lk:  # plain_nograd's causal is bottom-right
            return None
        if Lq == 1:
            causal = False
    out = plain_nograd(attention_forward, query, key, value, scaling, causal, _state["backend"])
    return None if out is None else out.transpose(1, 2).contiguous()


def _from_kwargs(module, query, Lk, causal, window, mask, key_lengths, packing, kwargs):
    """(causal, window, mask, packing) after the kwargs that refine them (packing, position
    bias); refuses head_mask."""
    _refuse_head_mask(kwargs)
    if kwargs.get("output_attentions", False):
        warnings.warn("attn_implementation='mhakern' returns no attention weights (output_attentions=True ignored)",
                      stacklevel=3)
    B, Lq = query.shape[0], query.shape[2]
    given_cu = kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None
    position_ids = kwargs.get("position_ids")
    if given_cu:
        found = _packing_from_cu(kwargs, B, Lq, Lk, query.device)
        if mask is None and key_lengths is None:
            packing = found
        else:  # a mask beside the packing (not a collator's batch): keep it, within each sequence
            seg = found.mask(False, None)
            mask = mask.masked_fill(~seg, float("-inf")) if mask.dtype != torch.bool else mask & seg
    elif (packing is None and position_ids is not None and mask is None and key_lengths is None and Lq == Lk > 1
          and isinstance(position_ids, torch.Tensor)):
        # Packed rows without a padding mask, as transformers' flash-attention path finds them:
        # the mask function misses them whenever a cache object exists (use_cache=True).
        packing = _packing_from_positions(position_ids, B, Lq, query.device)
    bias = kwargs.get("position_bias")
    if bias is not None:
        # T5-style relative position bias (B|1, H, Lq, Lk): an additive float mask, which
        # mhakern differentiates (the bias is learned). A bool mask is folded in as -inf;
        # packed sequences become their mask (varlen takes no bias).
        if packing is not None:
            mask, packing = packing.mask(causal, window), None
            causal, window = False, None
        if mask is None:
            mask = bias
        elif mask.dtype == torch.bool:
            mask = bias.masked_fill(~mask, float("-inf"))
        else:
            mask = bias + mask
    return causal, window, mask, packing


__all__ = ["register", "NAME", "MIN_TRANSFORMERS", "Visibility", "Packing", "attention_forward", "mask_interface"]
