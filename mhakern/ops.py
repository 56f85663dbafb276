"""The operators ``torch.ops.mhakern.attn_fwd`` / ``attn_bwd``: the one autograd boundary of
every entry point, their checks in order, and the implementation they run on a backend.

``attn_fwd`` carries autograd on the operator itself (its backward is ``attn_bwd``), and both
have fake (meta) implementations, so compiled graphs hold them as opaque, shape-known nodes
that neither break nor trace into the kernels. Their schemas end with the call record's fields
(:meth:`mhakern.modes.Modes.op_args`). Around every backend they apply the attention sinks
(forward rescale, backward from the sink-inclusive (out, lse), the sinks' gradient), which no
backend sees.

The ops are public entry points: :func:`prepare` runs the checks of mhakern/checks.py on every
argument (naming it), accepts ``backend="auto"``, and checks the values of ``key_lengths`` in
the forward and the backward. The public functions reach these operators through one route,
mhakern/routing.py. Semantics: docs/contract.md.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from . import backends, reference
from ._errors import ArgumentError
from ._layout import as_dtype, empty_like_heads, same_layout
from .checks import (
    check_bool,
    check_key_lengths_meta,
    check_modes,
    check_packing_and_cache,
    check_qkv,
    check_scale,
    expand_mask,
    mask_dtype,
    prepare_key_lengths,
    prepare_packing_and_cache,
)
from .modes import DEFAULT_MODES, OP_SCHEMA_MODES, Modes, mask_4d
from .reference import lse_dtype, sink_grad

Tensor = torch.Tensor


def reduce_mask_grad(dmask: Tensor, shape) -> Tensor:
    """Sum dL/dscore (B, H, Lq, Lk) over the dims on which a mask of 4-D ``shape`` broadcast."""
    dims = tuple(d for d in range(4) if shape[d] == 1 and dmask.shape[d] != 1)
    return dmask.sum(dims, keepdim=True) if dims else dmask


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
    sk = as_dtype(sinks.detach(), lse.dtype).view(1, -1, 1)
    lse2 = torch.logaddexp(lse, sk)
    # A row with lse = lse' = -inf (no key, sink -inf) keeps its zeros: factor 0, not exp(nan).
    factor = torch.exp(lse - lse2).masked_fill(torch.isneginf(lse2), 0.0)
    return (out * as_dtype(factor.unsqueeze(-1), out.dtype)), lse2


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


def backward_impl(be, dout, q, k, v, out, lse, scale, causal, key_lengths, modes: Modes, kv_sum: bool = False):
    """(dq, dk, dv, dmask, dsinks) of one checked call, from the forward's (out, lse) (both
    sink-inclusive: the softmax the backend recomputes from lse is then the one with the sink).
    ``dmask`` None unless ``modes.mask_grad``, else (B, H, Lq, Lk); ``dsinks`` None without
    sinks, else (H,); both float32 (float64 for float64 inputs: lse's dtype).

    ``kv_sum``: k and v are one tensor. A plain call then asks the backend for dk = dK + dV from
    its kernel (:meth:`~mhakern.backends.Backend.backward_kv_sum`: no dV tensor and no pass of
    its own for the sum) and returns dv None; where it has none, dk and dv come apart and the
    caller adds them (:class:`_AttnFunction`)."""
    B, H, Lq, D = q.shape
    Lk, Dv = k.shape[2], v.shape[3]
    dsinks = None
    if modes.sinks is not None:
        delta = (as_dtype(dout, lse.dtype) * as_dtype(out, lse.dtype)).sum(-1)
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
    if kv_sum and modes is DEFAULT_MODES:
        fused = be.backward_kv_sum(dout, q, k, out, lse, scale, causal, key_lengths)
        if fused is not None:
            return same_layout(fused[0], q), same_layout(fused[1], k), None, None, dsinks
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
    ``qkv_checked``: the caller (the route, mhakern/routing.py) has checked q, k, v, scale
    and causal already;
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
        check_bool("causal", causal)
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
        keyset, scale, causal, key_lengths, backend, given, ctx.kv_sum = call
        if torch.compiler.is_compiling():
            with torch._C._AutoDispatchBelowAutograd():
                out, lse = attn_fwd.redispatch(keyset & _AFTER_AUTOGRAD, q, k, v, scale, causal, key_lengths,
                                               backend, *given.op_args())
            ctx.be = None
        else:
            # keyset None: called by the route (mhakern/routing.py), which checked q, k, v.
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
                                                      modes, kv_sum=ctx.kv_sum and need[1])
            if modes.mask_grad:
                dmask = reduce_mask_grad(dmask, mask_4d(mask).shape).reshape(mask.shape).to(mask.dtype)
            dsinks = as_dtype(dsinks, sinks.dtype) if need[4] else None
        else:
            dq, dk, dv, dmask, dsinks = attn_bwd(dout, q, k, v, out, lse, scale, causal, kl, backend,
                                                 *modes.op_args())
            dmask = dmask.to(mask.dtype) if modes.mask_grad else None
            dsinks = as_dtype(dsinks, sinks.dtype) if need[4] else None
        if ctx.kv_sum and need[1] and dv is not None:
            # One tensor as k and v, its two gradients apart: their sum goes back through k alone,
            # rounded as autograd would sum them (the kernel's own sum left dv None).
            dk, dv = dk + dv, None
        return dq, dk, dv, dmask, dsinks, None


def apply_autograd(keyset, q, k, v, scale, causal, key_lengths, backend, modes: Modes) -> Tuple[Tensor, Tensor]:
    """(out, lse) of attn_fwd through its autograd (:class:`_AttnFunction`). ``keyset``: the
    dispatch keys of the operator's Autograd kernel, or None from the route
    (mhakern/routing.py), which has checked q, k, v, scale and causal: the direct entry skips
    the dispatcher's round trip to the Autograd kernel and a second check of q, k, v (a tiny
    call's forward + backward took 207 us through the operator against 166 us directly, 2-core
    Xeon, torch 2.13, benchmarks/bench_call_overhead.py, same run)."""
    # Self-attention callers may pass one tensor as q, k and v; torch.compile refuses an
    # autograd.Function given the same tensor twice, so distinct views (free) stand in. One
    # tensor as k and v (keys that are their own values) gets its gradient dK + dV through k
    # alone (kv_sum: backward_impl).
    kv_sum = v is k and k is not q
    if k is q:
        k = k.view(k.shape)
    if v is q or v is k:
        v = v.view(v.shape)
    return _AttnFunction.apply(q, k, v, modes.attn_mask, modes.sinks,
                               (keyset, scale, causal, key_lengths, backend, modes, kv_sum))


def _attn_fwd_autograd(keyset, q, k, v, scale, causal, key_lengths, backend, *mode_args):
    mode_args = _mode_tail(mode_args)
    if torch.is_grad_enabled() and torch._C._any_requires_grad(q, k, v, mode_args[0], mode_args[_MODE_SINKS]):
        return apply_autograd(keyset, q, k, v, scale, causal, key_lengths, backend,
                                    Modes.from_op_args(*mode_args))
    with torch._C._AutoDispatchBelowAutograd():
        return attn_fwd.redispatch(keyset & _AFTER_AUTOGRAD, q, k, v, scale, causal, key_lengths, backend, *mode_args)


_LIB.impl("attn_fwd", _attn_fwd_autograd, "Autograd", with_keyset=True)


def _differentiable_backward(need, dout, q, k, v, scale, causal, key_lengths, modes: Modes):
    """attn_fwd's backward as a graph of differentiable torch ops: the gradients of the math
    formula (:func:`mhakern.reference.attention`, with the same visibility, modifiers, mask,
    sinks and dropout keep mask), so that second derivatives are exact. Costs the (Lq x Lk)
    score matrix; used only under ``create_graph=True``."""
    wanted = [need[0], need[1], need[2], modes.mask_grad, need[4]]
    sources = (q, k, v, modes.attn_mask, modes.sinks)
    # fp32 work for half inputs, as every backend accumulates; the casts are part of the graph.
    wdt = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    with torch.enable_grad():
        # Each argument's own partial derivative: the gradients are taken with respect to a fresh
        # node per argument slot. With respect to the arguments themselves, one tensor given as k
        # and v (v a view of k: apply_autograd) would get dK + dV as k's gradient and dV again
        # as v's, which autograd then adds to it: dV counted twice.
        slots = [x.to(wdt).view_as(x) for x in (q, k, v)] + list(sources[3:])
        out = reference.attention(*slots[:3], scale, causal, key_lengths, upcast=False, modes=modes)
        inputs = [x for x, w in zip(slots, wanted) if w]
        grads = torch.autograd.grad(out, inputs, dout.to(wdt), create_graph=True, allow_unused=True)
    it = iter(grads)
    res = [next(it) if w else None for w in wanted]
    # In each argument's dtype: the gradients were taken at the slots, after the casts.
    return tuple(torch.zeros_like(x) if w and g is None else (g if g is None else g.to(x.dtype))
                 for x, g, w in zip(sources, res, wanted))
