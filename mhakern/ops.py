"""The operators ``torch.ops.mhakern.attn_fwd`` / ``attn_bwd``: the one autograd boundary of
every entry point, and the argument checks every entry point shares.

``attn_fwd`` carries autograd on the operator itself (its backward is ``attn_bwd``), and both
have fake (meta) implementations, so compiled graphs hold them as opaque, shape-known nodes
that neither break nor trace into the kernels. Their schemas end with the call record's fields
(:meth:`mhakern.modes.Modes.op_args`). Around every backend they apply the attention sinks
(forward rescale, backward from the sink-inclusive (out, lse), the sinks' gradient), which no
backend sees.

The ops are public entry points: they validate every argument (and name it) on their own,
accept ``backend="auto"``, and check the values of ``key_lengths`` in the forward and the
backward. Semantics: docs/contract.md.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from . import backends, reference
from ._errors import ArgumentError, ArgumentTypeError
from ._layout import empty_like_heads, same_layout
from .modes import DEFAULT_MODES, OP_SCHEMA_MODES, Modes, mask_4d
from .reference import lse_dtype, sink_grad

Tensor = torch.Tensor

INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
CAUSAL_ALIGNS = ("bottom_right", "top_left")


# ---------------------------------------------------------------------------------------------
# Checks (shapes, dtypes, devices: no data is read)


def check_qkv(q, k, v, cached: bool = False) -> None:
    """q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv): raise naming the argument.
    ``cached``: k and v are a KV cache addressed per batch element (their batch dim is the
    cache's rows or pages, any size)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ArgumentError(f"{name}: expected 4 dims (batch, heads, length, head_dim), got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise ArgumentTypeError(f"{name}: expected a floating-point dtype, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ArgumentTypeError(f"q, k, v: dtypes must match, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ArgumentError(f"q, k, v: must be on one device, got q on {q.device}, k on {k.device}, v on {v.device}")
    B, H, Lq, D = q.shape
    Bk, Hkv, Lk, Dk = k.shape
    if Bk != B and not cached:
        raise ArgumentError(f"k: batch size {Bk} does not match q's batch size {B}")
    if k.shape[:3] != v.shape[:3]:
        raise ArgumentError(
            f"k, v: (batch, kv heads, length) must match, got k {tuple(k.shape)} and v {tuple(v.shape)}"
        )
    if Dk != D:
        raise ArgumentError(f"k: head dim {Dk} does not match q's head dim {D}")
    # Zero heads on both sides is an empty problem (SDPA returns an empty result); otherwise
    # the kv heads must divide the query heads.
    if (Hkv == 0 and H != 0) or (Hkv != 0 and H % Hkv != 0):
        raise ArgumentError(
            f"k, v: number of kv heads ({Hkv}) must be positive and divide q's number of heads ({H})"
        )


def check_scale(scale, D: int) -> float:
    """None -> 1/sqrt(D) (1 for D = 0, whose scores are all 0 whatever the scale); a finite int
    or float -> float; else raise naming ``scale``."""
    if scale is None:
        return 1.0 / math.sqrt(D) if D > 0 else 1.0
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        scale = float(scale)
        if not math.isfinite(scale):
            raise ArgumentError(f"scale: must be a finite number, got {scale}")
        return scale
    raise TypeError(f"scale: expected None or a float, got {type(scale).__name__}")


def check_key_lengths_meta(key_lengths, B: int, device) -> None:
    """Type, dtype, shape and device of ``key_lengths`` (not its values)."""
    if key_lengths is None:
        return
    if not isinstance(key_lengths, torch.Tensor):
        raise TypeError(f"key_lengths: expected an integer tensor of shape ({B},), got {type(key_lengths).__name__}")
    if key_lengths.dtype not in INT_DTYPES:
        raise TypeError(f"key_lengths: expected an integer dtype, got {key_lengths.dtype}")
    if tuple(key_lengths.shape) != (B,):
        raise ArgumentError(f"key_lengths: expected shape ({B},) (one length per batch element), got {tuple(key_lengths.shape)}")
    if key_lengths.device != device and key_lengths.device.type != "cpu":
        raise ArgumentError(f"key_lengths: must be on q's device ({device}) or the CPU, got {key_lengths.device}")


def _check_index(t, name: str, dims: int, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected None or an integer tensor, got {type(t).__name__}")
    if t.dtype not in INT_DTYPES:
        raise TypeError(f"{name}: expected an integer dtype (int32 preferred), got {t.dtype}")
    if t.dim() != dims:
        raise ArgumentError(f"{name}: expected {dims} dim(s), got shape {tuple(t.shape)}")
    if t.device != device and t.device.type != "cpu":
        raise ArgumentError(f"{name}: must be on q's device ({device}) or the CPU, got {t.device}")


def check_packing_and_cache(modes: Modes, q, k, key_lengths, backward: bool = False) -> int:
    """Shapes, dtypes and combinations of the packing and cache fields (values:
    :func:`prepare_packing_and_cache`); returns the key length the kernels see (for a paged
    cache ``pages_per_seq * page_size``, else k's length)."""
    B, Lq, Lk = q.shape[0], q.shape[2], k.shape[2]
    if modes.packed:
        cq, ck = modes.cu_seqlens_q, modes.cu_seqlens_k
        if cq is None or ck is None:
            raise ArgumentError("cu_seqlens_q, cu_seqlens_k: packed sequences need both (got only "
                                f"{'cu_seqlens_q' if cq is not None else 'cu_seqlens_k'})")
        _check_index(cq, "cu_seqlens_q", 1, q.device)
        _check_index(ck, "cu_seqlens_k", 1, q.device)
        if cq.numel() < 1 or cq.numel() != ck.numel():
            raise ArgumentError("cu_seqlens_q, cu_seqlens_k: expected one entry more than there are sequences on both "
                                f"sides, got {cq.numel()} and {ck.numel()}")
        if B != 1:
            raise ArgumentError(f"q: packed sequences are one batch element of tokens (batch size 1), got {B}")
        for name, m, total in (("max_seqlen_q", modes.max_seqlen_q, Lq), ("max_seqlen_k", modes.max_seqlen_k, Lk)):
            if isinstance(m, bool) or not isinstance(m, (int, torch.SymInt)):
                raise TypeError(f"{name}: expected an int, got {type(m).__name__}")
            if not 0 <= m <= total:
                raise ArgumentError(f"{name}: expected a length in [0, {total}] (the tokens), got {m}")
        if modes.attn_mask is not None:
            raise ArgumentError("attn_mask: not with packed sequences (cu_seqlens_q); use causal, a window or "
                                "key padding per sequence instead")
        if key_lengths is not None:
            raise ArgumentError("key_lengths: not with packed sequences (each sequence's keys are its own "
                                "cu_seqlens_k range)")
        if modes.cached:
            raise ArgumentError("cache_batch_idx, block_table: not with packed sequences")
    if modes.cache_batch_idx is not None:
        _check_index(modes.cache_batch_idx, "cache_batch_idx", 1, q.device)
        if modes.cache_batch_idx.shape[0] != B:
            raise ArgumentError(f"cache_batch_idx: expected shape ({B},) (one K/V row per batch element), got "
                                f"{tuple(modes.cache_batch_idx.shape)}")
        if modes.block_table is not None:
            raise ArgumentError("cache_batch_idx, block_table: a paged cache picks its pages per batch element "
                                "already; give one of them")
    if modes.block_table is not None:
        bt = modes.block_table
        _check_index(bt, "block_table", 2, q.device)
        if bt.shape[0] != B:
            raise ArgumentError(f"block_table: expected (B={B}, pages per sequence), got shape {tuple(bt.shape)}")
        Lk = bt.shape[1] * k.shape[2]
    if backward and modes.cached:
        raise ArgumentError("cache_batch_idx, block_table: the KV-cache path is forward only (inference); no "
                            "backward takes them")
    return Lk


def _host_values_checkable(t: Tensor) -> bool:
    # As for key_lengths: no host read while compiling, none during CUDA-graph capture, none
    # of a meta tensor (no data: a meta call computes shapes only).
    return (not torch.compiler.is_compiling() and not t.is_meta
            and not (t.is_cuda and torch.cuda.is_current_stream_capturing()))


def prepare_packing_and_cache(modes: Modes, q, k) -> Modes:
    """Check the values of the packing and cache index tensors (one host read each; none while
    compiling or capturing a CUDA graph, where the caller vouches for them) and return the record
    with them int32, contiguous, on q's device: prefix sums from 0 to the token count,
    non-decreasing, each length at most its maximum; cache rows and pages in range."""
    upd = {}
    if modes.packed:
        for name, cu, total, mname, mx in (
                ("cu_seqlens_q", modes.cu_seqlens_q, q.shape[2], "max_seqlen_q", modes.max_seqlen_q),
                ("cu_seqlens_k", modes.cu_seqlens_k, k.shape[2], "max_seqlen_k", modes.max_seqlen_k)):
            if _host_values_checkable(cu):
                c = cu.tolist()
                if c[0] != 0:
                    raise ArgumentError(f"{name}: expected 0 first, got {c[0]}")
                if c[-1] != total:
                    raise ArgumentError(f"{name}: expected the token count {total} last, got {c[-1]}")
                lens = [b - a for a, b in zip(c, c[1:])]
                if lens and min(lens) < 0:
                    i = next(i for i, n in enumerate(lens) if n < 0)
                    raise ArgumentError(f"{name}: expected non-decreasing prefix sums, got {c[i]} then {c[i + 1]} at "
                                        f"index {i}")
                if lens and max(lens) > mx:
                    i = next(i for i, n in enumerate(lens) if n > mx)
                    raise ArgumentError(f"{name}: sequence {i} has {lens[i]} tokens, more than {mname} = {mx}")
            upd[name] = _int32_on(cu, q.device)
    for name, t in (("cache_batch_idx", modes.cache_batch_idx), ("block_table", modes.block_table)):
        if t is None:
            continue
        what = "k's batch rows" if name == "cache_batch_idx" else "k's pages"
        if t.numel() and _host_values_checkable(t):
            lo, hi = (int(x) for x in torch.stack(torch.aminmax(t)).tolist())
            if lo < 0 or hi >= k.shape[0]:
                raise ArgumentError(f"{name}: values must lie in [0, {k.shape[0]}) ({what}), got min {lo} and max {hi}")
        upd[name] = _int32_on(t, q.device)
    return modes._replace(**upd) if upd else modes


def _int32_on(t: Tensor, device) -> Tensor:
    if t.dtype != torch.int32 or t.device != device:
        t = t.to(device=device, dtype=torch.int32)
    return t.contiguous()


def prepare_key_lengths(key_lengths: Optional[Tensor], Lk: int, device) -> Optional[Tensor]:
    """Check the values of ``key_lengths`` in its own dtype, then return it int32 on ``device``.

    The range is checked before the cast, so an int64 length of 2**32 + 3 is refused rather
    than wrapped to 3. Eager callers pay one host sync (none for CPU tensors). While a CUDA
    graph is being captured no sync is possible: the lengths are clamped into [0, Lk] on the
    device instead (docs/contract.md, "key_lengths"), so that no kernel reads outside k and v.
    """
    if key_lengths is None:
        return None
    if key_lengths.numel() and not torch.compiler.is_compiling() and not key_lengths.is_meta:
        if key_lengths.is_cuda and torch.cuda.is_current_stream_capturing():
            key_lengths = key_lengths.clamp(0, Lk)
        else:
            lo, hi = (int(x) for x in torch.stack(torch.aminmax(key_lengths)).tolist())
            if lo < 0 or hi > Lk:
                raise ArgumentError(f"key_lengths: values must lie in [0, Lk={Lk}], got min {lo} and max {hi}")
    if key_lengths.dtype != torch.int32 or key_lengths.device != device:
        key_lengths = key_lengths.to(device=device, dtype=torch.int32)
    return key_lengths.contiguous()


def check_mask(attn_mask, B: int, H: int, Lq: int, Lk: int, device) -> None:
    """``attn_mask``: bool or floating, 1-D to 4-D, broadcastable to (B, H, Lq, Lk)."""
    if attn_mask is None:
        return
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask: expected None or a tensor, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise ArgumentTypeError(f"attn_mask: expected a bool (True = may attend) or floating (additive) dtype, got {attn_mask.dtype}")
    target = (B, H, Lq, Lk)
    # ``s == t`` before ``s == 1``: with a data-dependent (unbacked) batch size under
    # torch.export, u0 == u0 is known without a guard, u0 == 1 is not.
    if not 1 <= attn_mask.dim() <= 4 or any(
        not (s == t or s == 1) for s, t in zip(reversed(attn_mask.shape), reversed(target))
    ):
        raise ArgumentError(
            f"attn_mask: shape {tuple(attn_mask.shape)} is not broadcastable to (B, H, Lq, Lk) = {target} "
            "(1 to 4 dims, aligned from the right, each of size 1 or the full size)"
        )
    if attn_mask.device != device:
        raise ArgumentError(f"attn_mask: must be on q's device ({device}), got {attn_mask.device}")


def _causal_bias_class():
    try:
        from torch.nn.attention.bias import CausalBias
    except ImportError:  # a torch without it cannot hand us one
        return None
    return CausalBias


_CAUSAL_BIAS = _causal_bias_class()


def is_causal_bias(attn_mask) -> bool:
    """Whether ``attn_mask`` is a ``torch.nn.attention.bias.CausalBias`` (causal_upper_left /
    causal_lower_right): a tensor subclass whose storage holds no mask, to be read as causal
    masking, never as data."""
    return _CAUSAL_BIAS is not None and isinstance(attn_mask, _CAUSAL_BIAS)


def resolve_causal_bias(bias, Lq: int, Lk: int, exact_bottom_right: bool) -> Tuple[Optional[Tensor], bool]:
    """SDPA's reading of a CausalBias ``bias`` for queries of length Lq and keys of length Lk.

    Returns ``(mask, top_left)``: ``mask`` None means causal masking with that alignment (key
    ``j`` visible to query ``i`` iff ``j <= i`` top-left, ``j <= i + Lk - Lq`` bottom-right);
    otherwise ``mask`` is the bias materialised as a bool (Lq, Lk) mask, used when bottom-right
    causal masking would not be exactly the bias (``exact_bottom_right`` False: per-element key
    lengths move mhakern's bottom-right diagonal, not the bias'). As torch does: an upper-left
    bias, or one with equal lengths, is top-left causal whatever its sizes; a lower-right one of
    unequal lengths must have the sizes (Lq, Lk).
    """
    from torch.nn.attention.bias import CausalVariant

    if bias.variant == CausalVariant.UPPER_LEFT or bias.seq_len_q == bias.seq_len_kv:
        return None, True
    if (bias.seq_len_q, bias.seq_len_kv) != (Lq, Lk):
        raise ArgumentError(
            f"attn_mask: a lower-right CausalBias of sizes ({bias.seq_len_q}, {bias.seq_len_kv}) does not fit "
            f"queries of length {Lq} and keys of length {Lk}"
        )
    if exact_bottom_right:
        return None, False
    return bias._materialize(bias.device).view(1, 1, Lq, Lk), False


def check_modes(modes: Modes, B: int, H: int, Lq: int, Lk: int, device) -> None:
    """Every field of the call record but the packing and cache ones
    (:func:`check_packing_and_cache`), as the operators receive it: raise naming the field.

    ``attn_mask`` broadcastable to (B, H, Lq, Lk) (any of 1 to 4 dims); ``alibi_slopes`` a
    float32 (B, H) tensor (a view of (H,) slopes expanded is fine; (num_seqs, H) for packed
    sequences); ``sinks`` a floating (H,) tensor; all on ``device``.
    """
    if modes is DEFAULT_MODES:
        return
    if modes.packed and modes.cu_seqlens_q is not None:
        B = modes.cu_seqlens_q.shape[0] - 1  # ALiBi slopes per sequence
    dropout_p = modes.dropout_p
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ArgumentError(f"dropout_p: expected a number in [0, 1), got {dropout_p!r}")
    if not isinstance(modes.top_left, bool):
        raise TypeError(f"top_left: expected a bool, got {type(modes.top_left).__name__}")
    for name, w in (("window_left", modes.window_left), ("window_right", modes.window_right)):
        if isinstance(w, bool) or not isinstance(w, int) or w < -1:
            raise ArgumentError(f"{name}: expected an int >= -1 (-1 = unbounded), got {w!r}")
    check_mask(modes.attn_mask, B, H, Lq, Lk, device)
    if modes.mask_grad and (modes.attn_mask is None or not modes.attn_mask.is_floating_point()):
        raise ArgumentError("mask_grad: True needs a floating attn_mask (a bool mask has no gradient)")
    check_softcap(modes.softcap, allow_zero=True)
    a = modes.alibi_slopes
    if a is not None:
        if not isinstance(a, torch.Tensor):
            raise TypeError(f"alibi_slopes: expected None or a tensor, got {type(a).__name__}")
        if a.dtype != torch.float32 or tuple(a.shape) != (B, H) or a.device != device:
            raise ArgumentError(f"alibi_slopes: expected float32 of shape (B, H) = {(B, H)} on {device}, got "
                                f"{a.dtype} {tuple(a.shape)} on {a.device}")
    check_sinks(modes.sinks, H, device)


def check_softcap(softcap, allow_zero: bool = False) -> float:
    """A positive finite number (``allow_zero``: 0 too, the record's "off") as a float."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap: expected None or a positive float, got {type(softcap).__name__}")
    softcap = float(softcap)
    if not math.isfinite(softcap) or softcap < 0.0 or (softcap == 0.0 and not allow_zero):
        raise ArgumentError(f"softcap: expected a positive finite number (None = no capping), got {softcap!r}")
    return softcap


def check_sinks(sinks, H: int, device) -> None:
    """``sinks``: None or a floating (H,) tensor on ``device`` (one logit per query head)."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks: expected None or a tensor, got {type(sinks).__name__}")
    if not sinks.is_floating_point():
        raise ArgumentTypeError(f"sinks: expected a floating dtype, got {sinks.dtype}")
    if tuple(sinks.shape) != (H,) or sinks.device != device:
        raise ArgumentError(f"sinks: expected shape (H,) = ({H},) (one logit per query head) on {device}, got "
                            f"{tuple(sinks.shape)} on {sinks.device}")


def alibi_slopes_bh(alibi_slopes, B: int, H: int, device) -> Tensor:
    """The public ``alibi_slopes`` ((H,) or (B, H), any floating dtype, on ``device``) as the
    record's float32 (B, H) view; raise naming the argument."""
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes: expected None or a tensor, got {type(alibi_slopes).__name__}")
    if not alibi_slopes.is_floating_point():
        raise ArgumentTypeError(f"alibi_slopes: expected a floating dtype, got {alibi_slopes.dtype}")
    if tuple(alibi_slopes.shape) not in ((H,), (B, H)):
        raise ArgumentError(f"alibi_slopes: expected shape (H,) = ({H},) or (B, H) = {(B, H)}, got "
                            f"{tuple(alibi_slopes.shape)}")
    if alibi_slopes.device != device:
        raise ArgumentError(f"alibi_slopes: must be on q's device ({device}), got {alibi_slopes.device}")
    if alibi_slopes.requires_grad and torch.is_grad_enabled():
        # No kernel differentiates the bias: refusing beats a silently missing gradient.
        raise ArgumentError("alibi_slopes: the ALiBi bias has no gradient; pass a tensor that does not require "
                            "grad (detach() it)")
    a = alibi_slopes.to(torch.float32)
    return a.expand(B, H) if a.dim() == 1 else a


def mask_dtype(q_dtype: torch.dtype) -> torch.dtype:
    """The dtype floating masks reach backends in: float32, float64 for float64 inputs."""
    return torch.float64 if q_dtype == torch.float64 else torch.float32


def expand_mask(attn_mask: Optional[Tensor], B: int, H: int, Lq: int, Lk: int) -> Optional[Tensor]:
    """The 4-D view of ``attn_mask`` broadcast to (B, H, Lq, Lk): stride 0 on broadcast dims,
    never a copy."""
    if attn_mask is None:
        return None
    return mask_4d(attn_mask).expand(B, H, Lq, Lk)


def reduce_mask_grad(dmask: Tensor, shape) -> Tensor:
    """Sum dL/dscore (B, H, Lq, Lk) over the dims on which a mask of 4-D ``shape`` broadcast."""
    dims = tuple(d for d in range(4) if shape[d] == 1 and dmask.shape[d] != 1)
    return dmask.sum(dims, keepdim=True) if dims else dmask


def draw_seed(generator: Optional[torch.Generator] = None) -> int:
    """The 64-bit dropout seed of one call: one draw from ``generator`` (default: torch's
    default CPU generator) on the generator's device (docs/contract.md, "Dropout")."""
    dev = generator.device if generator is not None else "cpu"
    return int(torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64, generator=generator, device=dev).item())


def _empty(B, H, Lq, Lk, Dv) -> bool:
    return B == 0 or H == 0 or Lq == 0 or Lk == 0 or Dv == 0


# ---------------------------------------------------------------------------------------------
# Implementations (tensors already checked; key_lengths int32 and in range; mask 4-D expanded)


def _head_dim_zero(q: Tensor, k: Tensor) -> Tuple[Tensor, Tensor]:
    """q, k with D = 0 as one zero column each: every score is exactly 0 (as SDPA has them, an
    empty dot product), so the softmax sees only the mask; the kernels need D >= 1."""
    return q.new_zeros(q.shape[:3] + (1,)), k.new_zeros(k.shape[:3] + (1,))


def _with_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> Tuple[Tensor, Tensor]:
    """(out', lse') of a softmax whose denominator also holds ``exp(sink[h])`` (docs/contract.md,
    "Score modifiers"): ``lse' = logaddexp(lse, sink)``, ``out' = out * exp(lse - lse')``, in
    lse's dtype (float64 for float64 inputs, so that the rescaling keeps their precision)."""
    sk = sinks.detach().to(lse.dtype).view(1, -1, 1)
    lse2 = torch.logaddexp(lse, sk)
    # A row with lse = lse' = -inf (no key, sink -inf) keeps its zeros: factor 0, not exp(nan).
    factor = torch.exp(lse - lse2).masked_fill(torch.isneginf(lse2), 0.0)
    return (out * factor.unsqueeze(-1).to(out.dtype)), lse2


def forward_impl(be, q, k, v, scale, causal, key_lengths, modes: Modes) -> Tuple[Tensor, Tensor]:
    """(out, lse) of one checked call: ``be``'s forward on the record without sinks, then the
    sinks' rescaling (``lse`` then includes the sink)."""
    B, H, Lq, D = q.shape
    Lk, Dv = k.shape[2], v.shape[3]
    if D == 0:
        q, k = _head_dim_zero(q, k)
    if B == 0 or H == 0 or Lq == 0 or Lk == 0:  # no score at all; inline: every call asks
        out = empty_like_heads(q, Dv).zero_()
        lse = torch.full((B, H, Lq), -math.inf, dtype=lse_dtype(q.dtype), device=q.device)
    else:
        bmodes = modes
        if modes is not DEFAULT_MODES:
            bmodes = modes.for_backend()
            if bmodes.mask_grad:  # a backward matter: the forward is the same either way
                bmodes = bmodes._replace(mask_grad=False)
        # Dv = 0: the output is empty, but lse is that of the scores all the same; the kernels
        # compute it over one zero value column (they need Dv >= 1), the column then dropped.
        vb = v if Dv else v.new_zeros(v.shape[:3] + (1,))
        out, lse = be.forward(q, k, vb, scale, causal, key_lengths, bmodes)
        out, lse = (same_layout(out, q) if Dv else empty_like_heads(q, 0)), lse.contiguous()
    if modes.sinks is not None:
        out, lse = _with_sinks(out, lse, modes.sinks)
        out = same_layout(out, q)
    return out, lse


def backward_impl(be, dout, q, k, v, out, lse, scale, causal, key_lengths, modes: Modes):
    """(dq, dk, dv, dmask, dsinks) of one checked call, from the forward's (out, lse) (both
    sink-inclusive: the softmax the backend recomputes from lse is then the one with the sink).
    ``dmask`` None unless ``modes.mask_grad``, else (B, H, Lq, Lk); ``dsinks`` None without
    sinks, else (H,); both float32 (float64 for float64 inputs: lse's dtype)."""
    B, H, Lq, D = q.shape
    Lk, Dv = k.shape[2], v.shape[3]
    dsinks = None
    if modes.sinks is not None:
        delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
        dsinks = sink_grad(modes.sinks.detach(), lse, delta)
    if _empty(B, H, Lq, Lk, Dv):
        dmask = None
        if modes.mask_grad:
            dmask = torch.zeros((B, H, Lq, Lk), dtype=lse_dtype(q.dtype), device=q.device)
        return (empty_like_heads(q, D).zero_(), empty_like_heads(k, D).zero_(), empty_like_heads(v, Dv).zero_(),
                dmask, dsinks)
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    bmodes = modes if modes is DEFAULT_MODES else modes.for_backend()
    if D == 0:  # the scores do not depend on q and k: their (empty) gradients are zeros
        q0, k0 = q, k
        q, k = _head_dim_zero(q, k)
        _, _, dv, dmask = be.backward(dout, q, k, v, out, lse, scale, causal, key_lengths, bmodes)
        return empty_like_heads(q0, 0), empty_like_heads(k0, 0), same_layout(dv, v), dmask, dsinks
    dq, dk, dv, dmask = be.backward(dout, q, k, v, out, lse, scale, causal, key_lengths, bmodes)
    return same_layout(dq, q), same_layout(dk, k), same_layout(dv, v), dmask, dsinks


_NO_FEATURES = DEFAULT_MODES.required_features()


def _unit_last_stride(x: Tensor) -> Tensor:
    # Kernels index the head dim contiguously; any other stride pattern is taken as is.
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def prepare(q, k, v, scale, causal, key_lengths, backend, modes: Modes, qkv_checked: bool = False,
            grad: Optional[bool] = None, backward: bool = False, packing_checked: bool = False,
            key_lengths_checked: bool = False):
    """The checks of one call as the operators receive it; returns (q, k, v, key_lengths int32,
    backend, modes with the mask as its (B, H, Lq, Lk) view in the kernels' dtype).
    ``qkv_checked``: the caller (:func:`mhakern.attention`) has checked q, k, v, scale and
    causal already;
    ``grad``: whether a gradient will be needed, for the backend's selection (default: grad
    mode and the inputs' requires_grad); ``backward``: the checks of attn_bwd (no KV cache);
    ``packing_checked``: the caller has run :func:`check_packing_and_cache` and
    :func:`prepare_packing_and_cache` on ``modes`` (their host reads are not repeated);
    ``key_lengths_checked``: the caller has checked the values of ``key_lengths`` (int32,
    contiguous, on q's device, in [0, Lk]), so that they are not read again."""
    B, H, Lq, D = q.shape if qkv_checked else check_qkv(q, k, v, modes.cached) or q.shape
    Lk = k.shape[2]
    if not qkv_checked:
        check_scale(scale, D)
        if not isinstance(causal, bool):
            raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    if key_lengths is not None:
        check_key_lengths_meta(key_lengths, B, q.device)
    needed = _NO_FEATURES
    if modes is not DEFAULT_MODES:
        if modes.packed or modes.cached:
            Lk = check_packing_and_cache(modes, q, k, key_lengths, backward=backward)
            if not packing_checked:
                modes = prepare_packing_and_cache(modes, q, k)
        check_modes(modes, B, H, Lq, Lk, q.device)
        mask = modes.attn_mask
        if mask is not None:
            if mask.is_floating_point():
                mask = mask.to(mask_dtype(q.dtype))
            modes = modes._replace(attn_mask=expand_mask(mask, B, H, Lq, Lk))
        needed = modes.required_features()
    q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
    kl = key_lengths if key_lengths is None or key_lengths_checked else prepare_key_lengths(key_lengths, Lk, q.device)
    be = backends.select(backend, q, k, v, causal, kl, needed, grad=grad)
    return q, k, v, kl, be, modes


# ---------------------------------------------------------------------------------------------
# Plain calls without a gradient (a decode step): the checks once per call signature.
#
# Every check of a call without modes, key lengths or a gradient reads the tensors' metadata
# only (type, dims, dtypes, devices, shapes, strides) and the scale; the selection reads the
# same. A signature that passed them once and was served without a copy passes them again, so
# its later calls go from one dict lookup to the backend's forward: the checks, the selection's
# own signature and the layout step cost more than the C++ operator itself on a decode step
# (benchmarks/bench_transformers_generate.py, sdpa_dropin_call). The entries live in the
# dispatch cache, so register() and clear_dispatch_cache() forget them with the selections.

_PLAIN_KEY = object()  # first field of the entries' keys: they never meet select()'s own


def _plain_key(tag, q, k, v, causal: bool, backend):
    return (_PLAIN_KEY, tag, backend, causal, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
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
    hit = backends._SELECTED.get(key)
    if hit is not None:
        be, default_scale, strides = hit
        scale = default_scale if scale is None else check_scale(scale, q.shape[3])
        backends._LAST.name = be.name
        out = be.forward(q, k, v, scale, causal, None, DEFAULT_MODES)[0]
        # The layout the first call's output had after same_layout: one comparison, not its steps.
        return out if out.stride() == strides else same_layout(out, q)
    if admit is not None and not admit():
        return None
    # A first call of this signature: mhakern.attention()'s steps for it, in its order.
    check_qkv(q, k, v)
    scale = check_scale(scale, q.shape[3])
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a string, got {type(backend).__name__}")
    qc, kc, vc, kl, be, modes = prepare(q, k, v, scale, causal, None, backend, DEFAULT_MODES, qkv_checked=True)
    out, _ = forward_impl(be, qc, kc, vc, scale, causal, kl, modes)
    B, H, Lq, D = q.shape
    # Remembered: the calls forward_impl sends to the backend as they are (no copy by
    # _unit_last_stride, not empty, D > 0), by a backend the strict switch lets serve "auto".
    if qc is q and kc is k and vc is v and min(B, H, Lq, D, k.shape[2], v.shape[3]) > 0 and not be.fallback:
        backends._remember(key, (be, check_scale(None, D), out.stride()))
    return out


# ---------------------------------------------------------------------------------------------
# The operators: the autograd boundary of every entry point.
#
# Defined through torch.library (schema, CPU/CUDA implementation, fake implementation for
# torch.compile, and an Autograd kernel), so that compiled graphs hold them as opaque,
# shape-known nodes and autograd is registered on the op itself, as pytorch/extension-cpp
# does. The Autograd kernel is written here rather than by torch.library.register_autograd:
# that helper re-fills the schema's defaults on every call, 110 us of Python per call on this
# schema (2-core Xeon, torch 2.13), where this kernel costs the autograd.Function it wraps.

_LIB = torch.library.Library("mhakern", "DEF")
_LIB.define(
    "attn_fwd(Tensor q, Tensor k, Tensor v, float scale, bool causal, Tensor? key_lengths, str backend, "
    f"{OP_SCHEMA_MODES}) -> (Tensor, Tensor)"
)
_LIB.define(
    "attn_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float scale, bool causal, "
    f"Tensor? key_lengths, str backend, {OP_SCHEMA_MODES}) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)
# The mode arguments' defaults, for the calls whose trailing defaults the dispatcher dropped.
_DEFAULT_TAIL = DEFAULT_MODES.op_args()
_N_MODES = len(_DEFAULT_TAIL)


def _mode_tail(mode_args: tuple) -> tuple:
    n = len(mode_args)
    return mode_args if n == _N_MODES else mode_args + _DEFAULT_TAIL[n:]


def _attn_fwd(q, k, v, scale, causal, key_lengths, backend, *mode_args):
    """Forward: ``out`` (B, H, Lq, Dv) in q's dtype, laid out like q, and ``lse`` (B, H, Lq),
    float32 (float64 for float64 inputs), including the sinks when given; the modes as in :class:`mhakern.modes.Modes`
    (``attn_mask`` any shape broadcastable to (B, H, Lq, Lk)); ``backend``: "auto" or a
    registered name."""
    modes = Modes.from_op_args(*_mode_tail(mode_args))
    q, k, v, kl, be, modes = prepare(q, k, v, scale, causal, key_lengths, backend, modes)
    return forward_impl(be, q, k, v, float(scale), causal, kl, modes)


def _attn_bwd(dout, q, k, v, out, lse, scale, causal, key_lengths, backend, *mode_args):
    """Backward from the forward's (out, lse): ``(dq, dk, dv, dmask, dsinks)``, dq/dk/dv shaped
    and laid out like ``q``, ``k``, ``v``; ``dmask`` the gradient of a floating ``attn_mask`` in
    its (given) shape when ``mask_grad``, else an empty (0,) tensor; ``dsinks`` (H,) with
    ``sinks``, else empty (0,); both in lse's dtype (float32, float64 for float64 inputs)."""
    for name, x in (("dout", dout), ("out", out), ("lse", lse)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    given = Modes.from_op_args(*_mode_tail(mode_args))
    q, k, v, kl, be, modes = prepare(q, k, v, scale, causal, key_lengths, backend, given, backward=True)
    B, H, Lq, _ = q.shape
    Dv = v.shape[3]
    if tuple(out.shape) != (B, H, Lq, Dv) or out.device != q.device:
        raise ArgumentError(f"out: expected shape {(B, H, Lq, Dv)} on {q.device}, got {tuple(out.shape)} on {out.device}")
    if tuple(dout.shape) != (B, H, Lq, Dv) or dout.device != q.device or not dout.is_floating_point():
        raise ArgumentError(f"dout: expected a floating tensor of shape {(B, H, Lq, Dv)} on {q.device}, got {tuple(dout.shape)} {dout.dtype} on {dout.device}")
    ldt = lse_dtype(q.dtype)
    if tuple(lse.shape) != (B, H, Lq) or lse.dtype != ldt or lse.device != q.device:
        raise ArgumentError(f"lse: expected {ldt} of shape {(B, H, Lq)} on {q.device}, got {lse.dtype} {tuple(lse.shape)} on {lse.device}")
    dq, dk, dv, dmask, dsinks = backward_impl(be, dout.to(q.dtype), q, k, v, out, lse, float(scale), causal, kl, modes)
    if modes.mask_grad:
        m = given.attn_mask
        dmask = reduce_mask_grad(dmask.to(ldt), mask_4d(m).shape).reshape(m.shape)
    else:
        dmask = q.new_empty((0,), dtype=ldt)
    if dsinks is None:
        dsinks = q.new_empty((0,), dtype=ldt)
    return dq, dk, dv, dmask, dsinks.to(ldt)


_LIB.impl("attn_fwd", _attn_fwd, "CompositeExplicitAutograd")
_LIB.impl("attn_bwd", _attn_bwd, "CompositeExplicitAutograd")


@torch.library.register_fake("mhakern::attn_fwd", lib=_LIB)
def _attn_fwd_fake(q, k, v, scale, causal, key_lengths, backend, *mode_args):
    B, H, Lq, _ = q.shape
    return empty_like_heads(q, v.shape[3]), q.new_empty((B, H, Lq), dtype=lse_dtype(q.dtype))


@torch.library.register_fake("mhakern::attn_bwd", lib=_LIB)
def _attn_bwd_fake(dout, q, k, v, out, lse, scale, causal, key_lengths, backend, *mode_args):
    modes = Modes.from_op_args(*_mode_tail(mode_args))
    m, sinks, ldt = modes.attn_mask, modes.sinks, lse_dtype(q.dtype)
    dmask = m.new_empty(m.shape, dtype=ldt) if modes.mask_grad else q.new_empty((0,), dtype=ldt)
    dsinks = q.new_empty((0,), dtype=ldt) if sinks is None else sinks.new_empty(sinks.shape, dtype=ldt)
    return (empty_like_heads(q, q.shape[3]), empty_like_heads(k, k.shape[3]), empty_like_heads(v, v.shape[3]), dmask,
            dsinks)


attn_fwd = torch.ops.mhakern.attn_fwd.default
attn_bwd = torch.ops.mhakern.attn_bwd.default
_AFTER_AUTOGRAD = torch._C._after_autograd_keyset
_MODE_SINKS = Modes._fields.index("sinks")


class _AttnFunction(torch.autograd.Function):
    """attn_fwd's autograd: saves q, k, v, out, lse and the record's tensors; the backward is
    attn_bwd (probabilities recomputed from lse, the dropout keep mask from the saved seed).

    Its inputs are the differentiable tensors (q, k, v, the mask, the sinks) and one tuple
    ``call = (keyset, scale, causal, key_lengths, backend, modes)`` holding the rest with the
    call record unflattened: torch.autograd.Function.apply costs per input (unwrapping, the
    needs_input_grad tuple, one returned gradient each), and the record's fields as inputs
    were 16 of 24 of them (benchmarks/bench_call_overhead.py, attn_grad).

    Eager calls run the operators' implementations directly in here (the forward's checks
    done once, the backward from what they produced): the dispatcher's round trip to attn_fwd's
    own kernel, and attn_bwd's, with attn_bwd's second round of checks, cost about 60 us of the
    160 us of a tiny call's forward + backward. While torch.compile traces, the graph must hold
    the operators themselves.
    """

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, sinks, call):
        keyset, scale, causal, key_lengths, backend, given = call
        if torch.compiler.is_compiling():
            with torch._C._AutoDispatchBelowAutograd():
                out, lse = attn_fwd.redispatch(keyset & _AFTER_AUTOGRAD, q, k, v, scale, causal, key_lengths,
                                               backend, *given.op_args())
            ctx.be = None
        else:
            # keyset None: called by mhakern.attention(), which checked q, k, v (call_attention).
            qc, kc, vc, key_lengths, be, modes = prepare(q, k, v, scale, causal, key_lengths, backend, given,
                                                         qkv_checked=keyset is None, grad=True)
            out, lse = forward_impl(be, qc, kc, vc, float(scale), causal, key_lengths, modes)
            ctx.be = be
            if given.packed:  # the backward takes the prefix sums as checked (int32, on q's device)
                given = given._replace(cu_seqlens_q=modes.cu_seqlens_q, cu_seqlens_k=modes.cu_seqlens_k)
        # The inputs themselves (not the checked copies): create_graph's math backward must
        # differentiate through them to the caller's tensors.
        ctx.save_for_backward(q, k, v, out, lse, key_lengths, attn_mask, given.alibi_slopes, sinks)
        ctx.args = (scale, causal, backend, given)
        # lse never receives a gradient: no zeros tensor for it on every backward.
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:  # only lse was used downstream: nothing flows back
            return None, None, None, None, None, None
        q, k, v, out, lse, kl, mask, alibi, sinks = ctx.saved_tensors
        scale, causal, backend, modes = ctx.args
        need = ctx.needs_input_grad
        if modes is not DEFAULT_MODES:  # the tensors as saved (version-checked), mask_grad as asked
            modes = modes._replace(attn_mask=mask, alibi_slopes=alibi, sinks=sinks, mask_grad=need[3])
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            # create_graph=True: the gradients must themselves be differentiable, which no
            # kernel's backward is. They come from the math formula instead (docs/contract.md,
            # "Second derivatives").
            dq, dk, dv, dmask, dsinks = _differentiable_backward(need, dout, q, k, v, scale, causal, kl, modes)
        elif ctx.be is not None:
            # kl was checked and converted by the forward; q, k, v and the mask take the same
            # (free) steps again.
            if dout.dtype != q.dtype:
                dout = dout.to(q.dtype)
            if mask is not None:
                B, H, Lq, _ = q.shape
                m = mask.to(mask_dtype(q.dtype)) if mask.is_floating_point() else mask
                modes = modes._replace(attn_mask=expand_mask(m, B, H, Lq, k.shape[2]))
            dq, dk, dv, dmask, dsinks = backward_impl(ctx.be, dout, _unit_last_stride(q), _unit_last_stride(k),
                                                      _unit_last_stride(v), out, lse, float(scale), causal, kl,
                                                      modes)
            if modes.mask_grad:
                dmask = reduce_mask_grad(dmask, mask_4d(mask).shape).reshape(mask.shape).to(mask.dtype)
            dsinks = dsinks.to(sinks.dtype) if need[4] else None
        else:
            dq, dk, dv, dmask, dsinks = attn_bwd(dout, q, k, v, out, lse, scale, causal, kl, backend,
                                                 *modes.op_args())
            dmask = dmask.to(mask.dtype) if modes.mask_grad else None
            dsinks = dsinks.to(sinks.dtype) if need[4] else None
        return dq, dk, dv, dmask, dsinks, None


def _apply_attn_function(keyset, q, k, v, scale, causal, key_lengths, backend, modes: Modes):
    # Self-attention callers may pass one tensor as q, k and v; torch.compile refuses an
    # autograd.Function given the same tensor twice, so distinct views (free) stand in.
    if k is q:
        k = k.view(k.shape)
    if v is q or v is k:
        v = v.view(v.shape)
    return _AttnFunction.apply(q, k, v, modes.attn_mask, modes.sinks,
                               (keyset, scale, causal, key_lengths, backend, modes))


def _attn_fwd_autograd(keyset, q, k, v, scale, causal, key_lengths, backend, *mode_args):
    mode_args = _mode_tail(mode_args)
    if torch.is_grad_enabled() and torch._C._any_requires_grad(q, k, v, mode_args[0], mode_args[_MODE_SINKS]):
        return _apply_attn_function(keyset, q, k, v, scale, causal, key_lengths, backend,
                                    Modes.from_op_args(*mode_args))
    with torch._C._AutoDispatchBelowAutograd():
        return attn_fwd.redispatch(keyset & _AFTER_AUTOGRAD, q, k, v, scale, causal, key_lengths, backend, *mode_args)


_LIB.impl("attn_fwd", _attn_fwd_autograd, "Autograd", with_keyset=True)


def call_attention(q, k, v, scale, causal, key_lengths, backend, modes: Modes) -> Tuple[Tensor, Tensor]:
    """``attn_fwd(q, k, v, scale, causal, key_lengths, backend, *modes.op_args())`` for
    :func:`mhakern.attention`, which has checked q, k and v: eager calls that need a gradient
    enter the operator's autograd (:class:`_AttnFunction`) directly, the rest the operator.

    The direct entry skips the dispatcher's round trip to the Autograd kernel and a second
    check of q, k, v: a tiny call's forward + backward took 207 us through the operator against
    166 us for the autograd.Function this layer replaced, and takes about the latter directly
    (2-core Xeon, torch 2.13, benchmarks/bench_call_overhead.py, same run).
    """
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return attn_fwd(q, k, v, scale, causal, key_lengths, backend, *modes.op_args())
    return _apply_attn_function(None, q, k, v, scale, causal, key_lengths, backend, modes)


def _differentiable_backward(need, dout, q, k, v, scale, causal, key_lengths, modes: Modes):
    """attn_fwd's backward as a graph of differentiable torch ops: the gradients of the math
    formula (:func:`mhakern.reference.attention`, with the same visibility, modifiers, mask,
    sinks and dropout keep mask), so that second derivatives are exact. Costs the (Lq x Lk)
    score matrix; used only under ``create_graph=True``."""
    wanted = [need[0], need[1], need[2], modes.mask_grad, need[4]]
    sources = (q, k, v, modes.attn_mask, modes.sinks)
    # fp32 work for half inputs, as every backend accumulates; the casts are part of the graph.
    wdt = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    inputs = [x for x, w in zip(sources, wanted) if w]
    with torch.enable_grad():
        out = reference.attention(q.to(wdt), k.to(wdt), v.to(wdt), scale, causal, key_lengths, upcast=False,
                                  modes=modes)
        grads = torch.autograd.grad(out, inputs, dout.to(wdt), create_graph=True, allow_unused=True)
    it = iter(grads)
    res = [next(it) if w else None for w in wanted]
    return tuple(torch.zeros_like(x) if w and g is None else g for x, g, w in zip(sources, res, wanted))
