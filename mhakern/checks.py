"""Argument checks of every entry point, each written once: they raise naming the argument and
what it accepts (mhakern._errors), and read shapes, dtypes and devices only, except where a
function says it reads values (one host read, never while compiling or capturing a CUDA graph).

Callers: the public entry points (mhakern.attention, attention_varlen, attention_with_kvcache,
the SDPA drop-in, FusedMHA), the operators (mhakern/ops.py) and the route (mhakern/routing.py).
The C++ operators keep only the memory-safety checks that protect their kernels from a direct
caller (csrc/op_common.h); the Triton launchers check nothing the operators checked.
Semantics: docs/contract.md.
"""
from __future__ import annotations

import math
import sys
from typing import List, Optional, Tuple

import torch

from ._errors import ArgumentError, ArgumentTypeError
from .modes import DEFAULT_MODES, Modes, mask_4d

Tensor = torch.Tensor

INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
CAUSAL_ALIGNS = ("bottom_right", "top_left")


# ---------------------------------------------------------------------------------------------
# Flags and plain arguments


def check_bool(name: str, x) -> None:
    """``x`` a bool, else TypeError naming ``name``."""
    if not isinstance(x, bool):
        raise TypeError(f"{name}: expected a bool, got {type(x).__name__}")


def check_backend(backend) -> None:
    """``backend`` a string (its value is the registry's to judge: mhakern.backends.select)."""
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a string, got {type(backend).__name__}")


def check_dropout_p(dropout_p) -> None:
    """The public ``dropout_p``: a number in [0, 1] (1 drops every probability)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p: expected a float in [0, 1], got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p <= 1.0:
        raise ArgumentError(f"dropout_p: expected a number in [0, 1], got {dropout_p!r}")


# ---------------------------------------------------------------------------------------------
# Tensors (shapes, dtypes, devices: no data is read)

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


def check_index(t, name: str, dims: int, device) -> None:
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
        check_index(cq, "cu_seqlens_q", 1, q.device)
        check_index(ck, "cu_seqlens_k", 1, q.device)
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
        check_index(modes.cache_batch_idx, "cache_batch_idx", 1, q.device)
        if modes.cache_batch_idx.shape[0] != B:
            raise ArgumentError(f"cache_batch_idx: expected shape ({B},) (one K/V row per batch element), got "
                                f"{tuple(modes.cache_batch_idx.shape)}")
        if modes.block_table is not None:
            raise ArgumentError("cache_batch_idx, block_table: a paged cache picks its pages per batch element "
                                "already; give one of them")
    if modes.block_table is not None:
        bt = modes.block_table
        check_index(bt, "block_table", 2, q.device)
        if bt.shape[0] != B:
            raise ArgumentError(f"block_table: expected (B={B}, pages per sequence), got shape {tuple(bt.shape)}")
        Lk = bt.shape[1] * k.shape[2]
    if backward and modes.cached:
        raise ArgumentError("cache_batch_idx, block_table: the KV-cache path is forward only (inference); no "
                            "backward takes them")
    return Lk


def host_values_checkable(t: Tensor) -> bool:
    # As for key_lengths: no host read while compiling, none during CUDA-graph capture, none
    # of a meta tensor (no data: a meta call computes shapes only).
    return (not torch.compiler.is_compiling() and not t.is_meta
            and not (t.is_cuda and torch.cuda.is_current_stream_capturing()))


def check_prefix_sums(c: List[int], name: str, total: Optional[int] = None, max_len: Optional[int] = None,
                      max_name: str = "") -> None:
    """Check sequence boundaries ``c`` (prefix sums of the sequence lengths, as ints): at least one
    value, 0 first, non-decreasing, ``total`` last and each length at most ``max_len`` (named
    ``max_name``) where given. Every caller that takes prefix sums checks them here."""
    if not c or c[0] != 0:
        raise ArgumentError(f"{name}: expected 0 first, got {c[0] if c else 'no values'}")
    if total is not None and c[-1] != total:
        raise ArgumentError(f"{name}: expected the token count {total} last, got {c[-1]}")
    lens = [b - a for a, b in zip(c, c[1:])]
    if lens and min(lens) < 0:
        i = next(i for i, n in enumerate(lens) if n < 0)
        raise ArgumentError(f"{name}: expected non-decreasing prefix sums, got {c[i]} then {c[i + 1]} at index {i}")
    if max_len is not None and lens and max(lens) > max_len:
        i = next(i for i, n in enumerate(lens) if n > max_len)
        raise ArgumentError(f"{name}: sequence {i} has {lens[i]} tokens, more than {max_name} = {max_len}")


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
            if host_values_checkable(cu):
                check_prefix_sums(cu.tolist(), name, total, mx, mname)
            upd[name] = _int32_on(cu, q.device)
    for name, t in (("cache_batch_idx", modes.cache_batch_idx), ("block_table", modes.block_table)):
        if t is None:
            continue
        what = "k's batch rows" if name == "cache_batch_idx" else "k's pages"
        if t.numel() and host_values_checkable(t):
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


def is_causal_bias(attn_mask) -> bool:
    """Whether ``attn_mask`` is a ``torch.nn.attention.bias.CausalBias`` (causal_upper_left /
    causal_lower_right): a tensor subclass whose storage holds no mask, to be read as causal
    masking, never as data. Read from sys.modules, not imported: one can exist only once its
    module is loaded, and importing it loads torch._dynamo (half of ``import mhakern``'s time)."""
    bias_module = sys.modules.get("torch.nn.attention.bias")
    return bias_module is not None and isinstance(attn_mask, bias_module.CausalBias)


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
    for name, x in (("dropout_q0", modes.dropout_q0), ("dropout_k0", modes.dropout_k0),
                    ("dropout_h0", modes.dropout_h0), ("dropout_heads", modes.dropout_heads)):
        if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < 2**32:
            raise ArgumentError(f"{name}: expected an int in [0, 2**32) (a position the dropout hash sees), got {x!r}")
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


def draw_seed(generator: Optional[torch.Generator] = None) -> int:
    """The 64-bit dropout seed of one call: one draw from ``generator`` (default: torch's
    default CPU generator) on the generator's device (docs/contract.md, "Dropout")."""
    dev = generator.device if generator is not None else "cpu"
    return int(torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64, generator=generator, device=dev).item())


# ---------------------------------------------------------------------------------------------
# The public mode arguments into the call record


_INT64_MAX = 2**63 - 1


def check_window(window, causal: bool, Lq: int, Lk: int) -> Tuple[int, int]:
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


def causal_from_bias(bias, causal, causal_align, window, key_lengths, Lq, Lk):
    """(attn_mask, causal, causal_align) standing for a CausalBias ``attn_mask`` (resolve_causal_bias)."""
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


def parse_modes(q, B, H, Lq, Lk, attn_mask, dropout_p, generator, causal, causal_align, window, softcap,
                 alibi_slopes, sinks) -> Modes:
    """The call record of attention()'s public mode arguments (checked, named on error); the
    mask 4-D (not yet broadcast) in the kernels' dtype, the slopes float32 (B, H)."""
    if causal_align not in CAUSAL_ALIGNS:
        raise ArgumentError(f"causal_align: expected one of {CAUSAL_ALIGNS}, got {causal_align!r}")
    wl, wr = check_window(window, causal, Lq, Lk)
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
