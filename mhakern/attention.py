"""Public functional API: argument checks, dispatch, and the one autograd Function."""
from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch

from . import backends
from . import ops  # noqa: F401  (registers torch.ops.mhakern.*)

Tensor = torch.Tensor

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


class FusedAttentionFunction(torch.autograd.Function):
    """Autograd over ``torch.ops.mhakern.attn_fwd`` / ``attn_bwd`` for every backend.

    Saves q, k, v, out and lse; the backward recomputes the probabilities from lse. ``lse`` is
    returned as a non-differentiable output.
    """

    @staticmethod
    def forward(ctx, q, k, v, scale, causal, key_lengths, backend):
        out, lse = torch.ops.mhakern.attn_fwd(q, k, v, scale, causal, key_lengths, backend)
        ctx.save_for_backward(q, k, v, out, lse, key_lengths)
        ctx.scale, ctx.causal, ctx.backend = scale, causal, backend
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, key_lengths = ctx.saved_tensors
        dq, dk, dv = torch.ops.mhakern.attn_bwd(
            dout, q, k, v, out, lse, ctx.scale, ctx.causal, key_lengths, ctx.backend
        )
        return dq, dk, dv, None, None, None, None


def _check_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"{name}: expected 4 dims (batch, heads, length, head_dim), got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point dtype, got {x.dtype}")


def _unit_last_stride(x: Tensor) -> Tensor:
    # Kernels index the head dim contiguously; any other stride pattern is taken as is.
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def check_inputs(
    q: Tensor, k: Tensor, v: Tensor, scale: Optional[float], causal: bool, key_lengths: Optional[Tensor]
) -> Tuple[Tensor, Tensor, Tensor, float, Optional[Tensor]]:
    """Validate the arguments of :func:`attention`; return them normalised.

    Raises TypeError / ValueError naming the argument and what is accepted.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v: dtypes must match, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v: must be on one device, got q on {q.device}, k on {k.device}, v on {v.device}")
    B, H, Lq, D = q.shape
    Bk, Hkv, Lk, Dk = k.shape
    if Bk != B:
        raise ValueError(f"k: batch size {Bk} does not match q's batch size {B}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"k, v: (batch, kv heads, length) must match, got k {tuple(k.shape)} and v {tuple(v.shape)}"
        )
    if D == 0:
        raise ValueError("q: head dim must be positive, got 0")
    if Dk != D:
        raise ValueError(f"k: head dim {Dk} does not match q's head dim {D}")
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(
            f"k, v: number of kv heads ({Hkv}) must be positive and divide q's number of heads ({H})"
        )
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    elif isinstance(scale, (int, float)) and not isinstance(scale, bool):
        scale = float(scale)
        if not math.isfinite(scale):
            raise ValueError(f"scale: must be a finite number, got {scale}")
    else:
        raise TypeError(f"scale: expected None or a float, got {type(scale).__name__}")
    if key_lengths is not None:
        if not isinstance(key_lengths, torch.Tensor):
            raise TypeError(f"key_lengths: expected an integer tensor of shape ({B},), got {type(key_lengths).__name__}")
        if key_lengths.dtype not in _INT_DTYPES:
            raise TypeError(f"key_lengths: expected an integer dtype, got {key_lengths.dtype}")
        if tuple(key_lengths.shape) != (B,):
            raise ValueError(f"key_lengths: expected shape ({B},) (one length per batch element), got {tuple(key_lengths.shape)}")
        key_lengths = key_lengths.to(device=q.device, dtype=torch.int32).contiguous()
    return _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v), scale, key_lengths


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    scale: Optional[float] = None,
    key_lengths: Optional[Tensor] = None,
    backend: str = "auto",
    return_lse: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Exact softmax attention, fused.

    Args:
        q: (B, H, Lq, D) queries.
        k: (B, Hkv, Lk, D) keys; H must be a multiple of Hkv (GQA; Hkv = 1 is MQA). Query head
            ``h`` reads KV head ``h // (H // Hkv)``.
        v: (B, Hkv, Lk, Dv) values.
        causal: bottom-right aligned per batch element: key ``j`` is visible to query ``i`` iff
            ``j <= i + Lk_b - Lq``, where ``Lk_b`` is that element's key length.
        scale: multiplies ``q @ k^T``; default ``1 / sqrt(D)``.
        key_lengths: optional integer tensor (B,); keys at positions >= key_lengths[b] are
            hidden. Values must lie in [0, Lk].
        backend: "auto" (the fastest backend able to serve these tensors) or a name from
            :func:`mhakern.available_backends`.
        return_lse: also return the log-sum-exp of the scaled scores.

    Any strides with unit stride on the last dim are used without a copy, so (B, L, H, D)
    tensors viewed through ``.transpose(1, 2)`` work as they are. A query row that sees no key
    gets output 0 (lse = -inf) and zero gradient. Computation accumulates in fp32.

    Returns:
        ``out`` (B, H, Lq, Dv) in q's dtype, and with ``return_lse`` also ``lse`` float32
        (B, H, Lq), natural log (not differentiable).
    """
    q, k, v, scale, key_lengths = check_inputs(q, k, v, scale, causal, key_lengths)
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a string, got {type(backend).__name__}")
    be = backends.select(backend, q, k, v, causal, key_lengths)
    # Self-attention callers may pass one tensor as q, k and v; torch.compile refuses an
    # autograd.Function given the same tensor twice, so distinct views (free) stand in.
    if k is q:
        k = k.view(k.shape)
    if v is q or v is k:
        v = v.view(v.shape)
    out, lse = FusedAttentionFunction.apply(q, k, v, scale, causal, key_lengths, be.name)
    return (out, lse) if return_lse else out
