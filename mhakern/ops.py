"""The raw forward and backward as PyTorch custom ops (``torch.ops.mhakern.*``), and the
argument checks every entry point shares.

Registering them through ``torch.library.custom_op`` with fake (meta) implementations makes
them opaque, shape-known nodes for ``torch.compile``: compiled graphs neither break on them
nor trace into the kernels. The autograd Function in :mod:`mhakern.attention` calls these ops
while tracing, and the same implementations (:func:`forward_impl`, :func:`backward_impl`)
directly in eager mode, where the custom-op dispatch would only add per-call cost.

The ops are public entry points: they validate every argument (and name it) on their own,
accept ``backend="auto"``, and check the values of ``key_lengths`` in the forward and the
backward. Semantics: docs/contract.md.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from . import backends
from ._errors import ArgumentError, ArgumentTypeError
from ._layout import empty_like_heads, same_layout
from .backends import DEFAULT_MODES, Modes

Tensor = torch.Tensor

INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
CAUSAL_ALIGNS = ("bottom_right", "top_left")


# ---------------------------------------------------------------------------------------------
# Checks (shapes, dtypes, devices: no data is read)


def check_qkv(q, k, v) -> None:
    """q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv): raise naming the argument."""
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
    if Bk != B:
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


def prepare_key_lengths(key_lengths: Optional[Tensor], Lk: int, device) -> Optional[Tensor]:
    """Check the values of ``key_lengths`` in its own dtype, then return it int32 on ``device``.

    The range is checked before the cast, so an int64 length of 2**32 + 3 is refused rather
    than wrapped to 3. Eager callers pay one host sync (none for CPU tensors). While a CUDA
    graph is being captured no sync is possible: the lengths are clamped into [0, Lk] on the
    device instead (docs/contract.md, "key_lengths"), so that no kernel reads outside k and v.
    """
    if key_lengths is None:
        return None
    if key_lengths.numel() and not torch.compiler.is_compiling():
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


def check_modes(dropout_p, top_left, window_left, window_right) -> None:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ArgumentError(f"dropout_p: expected a number in [0, 1), got {dropout_p!r}")
    if not isinstance(top_left, bool):
        raise TypeError(f"top_left: expected a bool, got {type(top_left).__name__}")
    for name, w in (("window_left", window_left), ("window_right", window_right)):
        if isinstance(w, bool) or not isinstance(w, int) or w < -1:
            raise ArgumentError(f"{name}: expected an int >= -1 (-1 = unbounded), got {w!r}")


def mask_dtype(q_dtype: torch.dtype) -> torch.dtype:
    """The dtype floating masks reach backends in: float32, float64 for float64 inputs."""
    return torch.float64 if q_dtype == torch.float64 else torch.float32


def expand_mask(attn_mask: Optional[Tensor], B: int, H: int, Lq: int, Lk: int) -> Optional[Tensor]:
    """The 4-D view of ``attn_mask`` broadcast to (B, H, Lq, Lk): stride 0 on broadcast dims,
    never a copy."""
    if attn_mask is None:
        return None
    if attn_mask.dim() < 4:
        attn_mask = attn_mask.view((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    return attn_mask.expand(B, H, Lq, Lk)


def reduce_mask_grad(dmask: Tensor, shape) -> Tensor:
    """Sum dL/dscore (B, H, Lq, Lk) over the dims on which a mask of 4-D ``shape`` broadcast."""
    dims = tuple(d for d in range(4) if shape[d] == 1 and dmask.shape[d] != 1)
    return dmask.sum(dims, keepdim=True) if dims else dmask


def draw_seed(generator: Optional[torch.Generator] = None) -> int:
    """The 64-bit dropout seed of one call: one draw from ``generator`` (default: torch's
    default CPU generator) on the generator's device (docs/contract.md, "Dropout")."""
    dev = generator.device if generator is not None else "cpu"
    return int(torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64, generator=generator, device=dev).item())


def make_modes(attn_mask, dropout_p, seed, top_left, window_left, window_right, mask_grad) -> Modes:
    if attn_mask is None and dropout_p == 0.0 and not top_left and window_left < 0 and window_right < 0 and not mask_grad:
        return DEFAULT_MODES
    return Modes(attn_mask, float(dropout_p), int(seed), top_left, window_left, window_right, mask_grad)


def _empty(B, H, Lq, Lk, Dv) -> bool:
    return B == 0 or H == 0 or Lq == 0 or Lk == 0 or Dv == 0


# ---------------------------------------------------------------------------------------------
# Implementations (tensors already checked; key_lengths int32 and in range; mask 4-D expanded)


def _head_dim_zero(q: Tensor, k: Tensor) -> Tuple[Tensor, Tensor]:
    """q, k with D = 0 as one zero column each: every score is exactly 0 (as SDPA has them, an
    empty dot product), so the softmax sees only the mask; the kernels need D >= 1."""
    return q.new_zeros(q.shape[:3] + (1,)), k.new_zeros(k.shape[:3] + (1,))


def forward_impl(be, q, k, v, scale, causal, key_lengths, modes: Modes) -> Tuple[Tensor, Tensor]:
    B, H, Lq, D = q.shape
    Lk, Dv = k.shape[2], v.shape[3]
    if D == 0:
        q, k = _head_dim_zero(q, k)
    if _empty(B, H, Lq, Lk, Dv):
        out = empty_like_heads(q, Dv).zero_()
        lse = torch.full((B, H, Lq), -math.inf, dtype=torch.float32, device=q.device)
        return out, lse
    out, lse = be.forward(q, k, v, scale, causal, key_lengths, modes)
    return same_layout(out, q), lse.contiguous()


def backward_impl(be, dout, q, k, v, out, lse, scale, causal, key_lengths, modes: Modes):
    """(dq, dk, dv, dmask): dmask None unless ``modes.mask_grad``, else float32 (B, H, Lq, Lk)."""
    B, H, Lq, D = q.shape
    Lk, Dv = k.shape[2], v.shape[3]
    if _empty(B, H, Lq, Lk, Dv):
        dmask = None
        if modes.mask_grad:
            dmask = torch.zeros((B, H, Lq, Lk), dtype=torch.float32, device=q.device)
        return empty_like_heads(q, D).zero_(), empty_like_heads(k, D).zero_(), empty_like_heads(v, Dv).zero_(), dmask
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    if D == 0:  # the scores do not depend on q and k: their (empty) gradients are zeros
        q0, k0 = q, k
        q, k = _head_dim_zero(q, k)
        _, _, dv, dmask = be.backward(dout, q, k, v, out, lse, scale, causal, key_lengths, modes)
        return empty_like_heads(q0, 0), empty_like_heads(k0, 0), same_layout(dv, v), dmask
    dq, dk, dv, dmask = be.backward(dout, q, k, v, out, lse, scale, causal, key_lengths, modes)
    return same_layout(dq, q), same_layout(dk, k), same_layout(dv, v), dmask


def _unit_last_stride(x: Tensor) -> Tensor:
    # Kernels index the head dim contiguously; any other stride pattern is taken as is.
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def _op_prologue(q, k, v, scale, causal, key_lengths, backend, attn_mask, dropout_p, top_left, wl, wr, mask_grad=False):
    """Shared checks of both ops; returns (q, k, v, key_lengths int32, backend, modes-ready mask)."""
    check_qkv(q, k, v)
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    check_scale(scale, D)
    check_key_lengths_meta(key_lengths, B, q.device)
    check_mask(attn_mask, B, H, Lq, Lk, q.device)
    check_modes(dropout_p, top_left, wl, wr)
    if mask_grad and (attn_mask is None or not attn_mask.is_floating_point()):
        raise ArgumentError("mask_grad: True needs a floating attn_mask (a bool mask has no gradient)")
    q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
    kl = prepare_key_lengths(key_lengths, Lk, q.device)
    if attn_mask is not None and attn_mask.is_floating_point():
        attn_mask = attn_mask.to(mask_dtype(q.dtype))
    mask4 = expand_mask(attn_mask, B, H, Lq, Lk)
    modes = make_modes(mask4, dropout_p, 0, top_left, wl, wr, mask_grad)
    be = backends.select(backend, q, k, v, causal, kl, modes.required_features())
    return q, k, v, kl, be, mask4


# ---------------------------------------------------------------------------------------------
# Custom ops


@torch.library.custom_op("mhakern::attn_fwd", mutates_args=())
def attn_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    causal: bool,
    key_lengths: Optional[Tensor],
    backend: str,
    attn_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    seed: int = 0,
    top_left: bool = False,
    window_left: int = -1,
    window_right: int = -1,
) -> Tuple[Tensor, Tensor]:
    """Forward: ``out`` (B, H, Lq, Dv) in q's dtype and ``lse`` float32 (B, H, Lq).

    ``attn_mask``: None or a tensor broadcastable to (B, H, Lq, Lk); the modes as in
    :class:`mhakern.backends.Modes`; ``backend``: "auto" or a registered name.
    """
    q, k, v, kl, be, mask4 = _op_prologue(
        q, k, v, scale, causal, key_lengths, backend, attn_mask, dropout_p, top_left, window_left, window_right
    )
    modes = make_modes(mask4, dropout_p, seed, top_left, window_left, window_right, False)
    return forward_impl(be, q, k, v, float(scale), causal, kl, modes)


@attn_fwd.register_fake
def _attn_fwd_fake(q, k, v, scale, causal, key_lengths, backend, attn_mask=None, dropout_p=0.0, seed=0,
                   top_left=False, window_left=-1, window_right=-1):
    B, H, Lq, _ = q.shape
    return empty_like_heads(q, v.shape[3]), q.new_empty((B, H, Lq), dtype=torch.float32)


@torch.library.custom_op("mhakern::attn_bwd", mutates_args=())
def attn_bwd(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    causal: bool,
    key_lengths: Optional[Tensor],
    backend: str,
    attn_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    seed: int = 0,
    top_left: bool = False,
    window_left: int = -1,
    window_right: int = -1,
    mask_grad: bool = False,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Backward: ``(dq, dk, dv, dmask)``, dq/dk/dv shaped and laid out like ``q``, ``k``, ``v``;
    ``dmask`` the gradient of a floating ``attn_mask`` in its (given) shape, float32, when
    ``mask_grad``, else an empty (0,) float32 tensor."""
    for name, x in (("dout", dout), ("out", out), ("lse", lse)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    q, k, v, kl, be, mask4 = _op_prologue(
        q, k, v, scale, causal, key_lengths, backend, attn_mask, dropout_p, top_left, window_left, window_right,
        mask_grad,
    )
    B, H, Lq, _ = q.shape
    Dv = v.shape[3]
    if tuple(out.shape) != (B, H, Lq, Dv) or out.device != q.device:
        raise ArgumentError(f"out: expected shape {(B, H, Lq, Dv)} on {q.device}, got {tuple(out.shape)} on {out.device}")
    if tuple(dout.shape) != (B, H, Lq, Dv) or dout.device != q.device or not dout.is_floating_point():
        raise ArgumentError(f"dout: expected a floating tensor of shape {(B, H, Lq, Dv)} on {q.device}, got {tuple(dout.shape)} {dout.dtype} on {dout.device}")
    if tuple(lse.shape) != (B, H, Lq) or lse.dtype != torch.float32 or lse.device != q.device:
        raise ArgumentError(f"lse: expected float32 of shape {(B, H, Lq)} on {q.device}, got {lse.dtype} {tuple(lse.shape)} on {lse.device}")
    modes = make_modes(mask4, dropout_p, seed, top_left, window_left, window_right, mask_grad)
    dq, dk, dv, dmask = backward_impl(be, dout.to(q.dtype), q, k, v, out, lse, float(scale), causal, kl, modes)
    if mask_grad:
        dmask = reduce_mask_grad(dmask.float(), _mask_shape4(attn_mask)).reshape(attn_mask.shape)
    else:
        dmask = q.new_empty((0,), dtype=torch.float32)
    return dq, dk, dv, dmask


def _mask_shape4(attn_mask: Tensor) -> Tuple[int, ...]:
    return (1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)


@attn_bwd.register_fake
def _attn_bwd_fake(dout, q, k, v, out, lse, scale, causal, key_lengths, backend, attn_mask=None, dropout_p=0.0,
                   seed=0, top_left=False, window_left=-1, window_right=-1, mask_grad=False):
    dmask = attn_mask.new_empty(attn_mask.shape, dtype=torch.float32) if mask_grad else q.new_empty((0,), dtype=torch.float32)
    return empty_like_heads(q, q.shape[3]), empty_like_heads(k, k.shape[3]), empty_like_heads(v, v.shape[3]), dmask
