"""The model's dense products on the extension's micro-kernel where that keeps ATen's bits (CPU).

* :func:`fold`: the folded query weights ``A (R, d, H f)``, ``A[r, :, h f : (h + 1) f] =
  W_Q[r, :, h, :] W_K[r, h]^T``, which :func:`model._folded_queries` forms when that order is
  the cheaper one; one autograd node in place of an einsum, its permutes and two copies.
* :func:`embed`: token embeddings ``x W_E + (b_E + pe)`` with the bias added as each tile of the
  product is made (no second pass over the embeddings).
* :func:`bmm`, :func:`baddbmm`: ``torch.bmm`` and ``torch.baddbmm`` with a bias row, forward and
  backward (the folded queries' product and the decoder).

Every product, backward ones included, goes through ``torch.ops.mhakern_C.dense_bmm``
(csrc/cpu/products.cpp) where that gives ``torch.bmm``'s bits, else ``torch.bmm`` itself; the
gradients of the biases are the composite's own reductions (``sum_to_size``, as autograd's
engine reduces a broadcast operand's gradient). At the paper's shape on one CPU thread the
trainer's step ran 8-13% faster than with the composites (docs/results.md, section 4).

The stored results fix the trainer's bits (``config.SCHEMA_VERSION``), so nothing here runs where
it would change them. MKL's sgemm on the hosts measured computes every output as chains of fused
multiply-adds over blocks of k from zero, the blocks' sums added in order (``kc`` in
``DenseProduct``, csrc/cpu/attention_params.h: one chain up to 192, two halves up to 384, then
blocks of 192), which the micro-kernel reproduces; but its blocking is a property of the BLAS and
the CPU, and some shapes (small ones, odd k) take other paths. So each shape and layout is checked
once per process: both ways on random inputs with the same strides, compared bit for bit, for
each candidate blocking in :data:`_KC`; a shape none matches, a non-float32 or non-CPU tensor, a
build without the ops, or a call traced by ``torch.compile`` takes ``torch.bmm`` / the composite,
and so does every call within :func:`disabled`.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Optional, Tuple

import torch

Tensor = torch.Tensor

# The blockings of k tried, in order (DenseProduct::kc; 0: one chain over all of k).
_KC = (0, 192, 256, 128, 384, 512)

# (what, shapes, strides, dtypes, devices) -> the blocking that gives torch's bits (for the fold
# and baddbmm: True), or None where none does.
_AGREES: Dict[Tuple, object] = {}


def have_ops(*names: str) -> bool:
    """Whether the extension is built with the operators ``names`` (default: the products')."""
    from .. import _extension

    return _extension.load() is not None and all(hasattr(torch.ops.mhakern_C, n) for n in names or ("dense_bmm",))


_DISABLED = [0]  # depth of disabled() contexts


@contextlib.contextmanager
def disabled():
    """Within this context every product runs as the ATen composite it replaces (the same
    numbers; to time one against the other, or to rule the micro-kernel out)."""
    _DISABLED[0] += 1
    try:
        yield
    finally:
        _DISABLED[0] -= 1


def enabled() -> bool:
    """Whether products may run on the micro-kernel now (not within :func:`disabled`, not traced
    by ``torch.compile``)."""
    return not _DISABLED[0] and not torch.compiler.is_compiling()


def _eligible(*ts: Tensor) -> bool:
    if _DISABLED[0] or torch.compiler.is_compiling():
        return False
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in ts)


def _same(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _checked(key: Tuple, check) -> object:
    """``check(generator)`` (cached per process, whose ATen CPU capability is fixed at start):
    the blocking, True, or None."""
    if key not in _AGREES:
        found = None
        if have_ops():
            try:
                with torch.no_grad():
                    found = check(torch.Generator().manual_seed(20240501))
            except (RuntimeError, ValueError):  # an op this build lacks, or a shape it refuses
                found = None
        _AGREES[key] = found
    return _AGREES[key]


def _like(t: Tensor, g: torch.Generator) -> Tensor:
    """Random values in a tensor of ``t``'s shape and strides."""
    out = torch.empty_strided(t.shape, t.stride())
    return out.copy_(torch.randn(t.shape, generator=g))


def _strided_ok(t: Tensor) -> bool:
    # No two elements share memory (copy_ into the check's stand-in would not be defined).
    return all(s > 0 or n <= 1 for s, n in zip(t.stride(), t.shape))


_MISS = object()
# The check runs both products on stand-ins of the operands' size; above this many elements (64
# MiB of float32: large evaluation chunks of big stacks) the composite runs unchecked instead.
_CHECK_MAX = 1 << 24


def _kc(a: Tensor, b: Tensor) -> Optional[int]:
    """The blocking with which ``dense_bmm(a, b)`` gives ``torch.bmm(a, b)``'s bits, or None."""
    # Looked up first (a step calls this eight times): the key holds everything the answer
    # depends on.
    key = ("bmm", a.shape, a.stride(), b.shape, b.stride(), a.dtype, b.dtype, a.device.type, b.device.type)
    found = _AGREES.get(key, _MISS)
    if found is not _MISS:
        return None if _DISABLED[0] or torch.compiler.is_compiling() else found
    if not (a.dim() == 3 and b.dim() == 3 and a.shape[0] == b.shape[0] and a.shape[2] == b.shape[1]
            and a.numel() > 0 and b.numel() > 0 and a.numel() + b.numel() <= _CHECK_MAX
            and _eligible(a, b) and _strided_ok(a) and _strided_ok(b)):
        return None

    def check(g: torch.Generator):
        sa, sb = _like(a, g), _like(b, g)
        ref = torch.bmm(sa, sb)
        for kc in _KC:
            if _same(ref, torch.ops.mhakern_C.dense_bmm(sa, sb, None, kc)):
                return kc
        return None

    return _checked(key, check)


def mm(a: Tensor, b: Tensor) -> Tensor:
    """``torch.bmm(a, b)``'s values and bits for ``a`` (R, M, K), ``b`` (R, K, N), on the
    micro-kernel where that gives them (no autograd: see :func:`bmm`)."""
    kc = _kc(a, b)
    return torch.bmm(a, b) if kc is None else torch.ops.mhakern_C.dense_bmm(a, b, None, kc)


# ------------------------------------------------------------------------------------- bmm
class _Bmm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor, kc: int) -> Tensor:
        ctx.save_for_backward(a, b)
        return torch.ops.mhakern_C.dense_bmm(a, b, None, kc)

    @staticmethod
    def backward(ctx, grad: Tensor):
        a, b = ctx.saved_tensors  # BmmBackward0's products
        da = mm(grad, b.transpose(1, 2)) if ctx.needs_input_grad[0] else None
        db = mm(a.transpose(1, 2), grad) if ctx.needs_input_grad[1] else None
        return da, db, None


def bmm(a: Tensor, b: Tensor) -> Tensor:
    """``torch.bmm(a, b)`` with its bits, forward and backward (``torch.bmm`` itself, a native
    autograd node, where the forward's shape has no match)."""
    kc = _kc(a, b)
    return torch.bmm(a, b) if kc is None else _Bmm.apply(a, b, kc)


class _Baddbmm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, bias: Tensor, a: Tensor, b: Tensor, kc: int) -> Tensor:
        ctx.save_for_backward(a, b)
        ctx.bias_shape = bias.shape
        return torch.ops.mhakern_C.dense_bmm(a, b, bias, kc)

    @staticmethod
    def backward(ctx, grad: Tensor):
        a, b = ctx.saved_tensors  # BaddbmmBackward0's products and the engine's reduction of the bias
        dbias = grad.sum_to_size(ctx.bias_shape) if ctx.needs_input_grad[0] else None
        da = mm(grad, b.transpose(1, 2)) if ctx.needs_input_grad[1] else None
        db = mm(a.transpose(1, 2), grad) if ctx.needs_input_grad[2] else None
        return dbias, da, db, None


def baddbmm_kc(bias: Tensor, a: Tensor, b: Tensor) -> Optional[int]:
    """The blocking with which ``dense_bmm(a, b, bias)`` gives ``torch.baddbmm(bias, a, b)``'s
    bits for a bias (R, 1, N), or None."""
    if bias.dim() == 3 and bias.shape[1] == 1 and _eligible(bias, a, b):
        kc = _kc(a, b)
        if kc is not None:
            def check(g: torch.Generator):
                sb, sa, sm = torch.randn(bias.shape, generator=g), _like(a, g), _like(b, g)
                return True if _same(torch.baddbmm(sb, sa, sm), torch.ops.mhakern_C.dense_bmm(sa, sm, sb, kc)) else None

            if _checked(("baddbmm", tuple(a.shape), a.stride(), tuple(b.shape), b.stride()), check):
                return kc
    return None


def baddbmm(bias: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``torch.baddbmm(bias, a, b)`` for a bias (R, 1, N) with its bits, forward and backward."""
    kc = baddbmm_kc(bias, a, b)
    return torch.baddbmm(bias, a, b) if kc is None else _Baddbmm.apply(bias, a, b, kc)


# ------------------------------------------------------------------------------------ fold
def fold_reference(W_Q: Tensor, W_K: Tensor) -> Tensor:
    """The composite: ``W_Q`` (R, d, H, e), ``W_K`` (R, H, f, e) -> A (R, d, H f)."""
    R, d, H = W_Q.shape[:3]
    return torch.einsum("rdhe,rhfe->rdhf", W_Q, W_K).reshape(R, d, H * W_K.shape[2])


class _Fold(torch.autograd.Function):
    @staticmethod
    def forward(ctx, W_Q: Tensor, W_K: Tensor) -> Tensor:
        ctx.save_for_backward(W_Q, W_K)
        return torch.ops.mhakern_C.fold_heads(W_Q, W_K)

    @staticmethod
    def backward(ctx, grad: Tensor):
        W_Q, W_K = ctx.saved_tensors
        dq, dk = torch.ops.mhakern_C.fold_heads_backward(grad, W_Q, W_K)
        return (dq if ctx.needs_input_grad[0] else None), (dk if ctx.needs_input_grad[1] else None)


def _check_fold(qs, ks):
    def check(g: torch.Generator):
        W_Q, W_K = torch.randn(qs, generator=g), torch.randn(ks, generator=g)
        with torch.enable_grad():
            a, b = W_Q.clone().requires_grad_(True), W_K.clone().requires_grad_(True)
            out = fold_reference(a, b)
            grad = torch.randn(out.shape, generator=g)
            rq, rk = torch.autograd.grad(out, (a, b), grad)
        dq, dk = torch.ops.mhakern_C.fold_heads_backward(grad, W_Q, W_K)
        ok = _same(out.detach(), torch.ops.mhakern_C.fold_heads(W_Q, W_K)) and _same(rq, dq) and _same(rk, dk)
        return True if ok else None

    return check


def fold_agrees(W_Q: Tensor, W_K: Tensor) -> bool:
    """Whether ``fold_heads`` and its backward give :func:`fold_reference`'s bits here."""
    return bool(W_Q.dim() == 4 and W_K.dim() == 4 and _eligible(W_Q, W_K)
                and _checked(("fold", tuple(W_Q.shape), tuple(W_K.shape)), _check_fold(W_Q.shape, W_K.shape)))


def fold(W_Q: Tensor, W_K: Tensor) -> Tensor:
    """A (R, d, H f) from ``W_Q`` (R, d, H, e) and ``W_K`` (R, H, f, e): the bits of
    :func:`fold_reference`, forward and backward."""
    return _Fold.apply(W_Q, W_K) if fold_agrees(W_Q, W_K) else fold_reference(W_Q, W_K)


# ----------------------------------------------------------------------------------- embed
def embed_reference(x: Tensor, W_E: Tensor, b_E: Tensor, pe: Tensor) -> Tensor:
    """The composite: tokens ``x`` (R, ..., L, d_in), ``W_E`` (R, d_in, d), ``b_E`` (R, d) at
    positions ``pe`` (L, d) -> (R, ..., L, d)."""
    R = x.shape[0]
    lead = x.shape[1:-1]
    y = torch.bmm(x.reshape(R, -1, x.shape[-1]), W_E).view(R, *lead, -1)
    return y + (b_E.view(R, *([1] * len(lead)), -1) + pe)


class _Embed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, W_E: Tensor, b_E: Tensor, pe: Tensor, kc: int) -> Tensor:
        R, lead, d = x.shape[0], x.shape[1:-1], W_E.shape[-1]
        bias = b_E.view(R, *([1] * len(lead)), -1) + pe  # the composite's add: its bits
        ctx.save_for_backward(x, W_E)
        ctx.shapes = (b_E.shape, bias.shape, pe.shape, len(lead))
        # The product's sums, then one rounded add of the bias: the composite's two roundings.
        out = torch.ops.mhakern_C.dense_bmm(x.reshape(R, -1, x.shape[-1]), W_E, bias.reshape(R, -1, d), kc)
        return out.view(R, *lead, d)

    @staticmethod
    def backward(ctx, grad: Tensor):
        # What autograd runs for embed_reference: ViewBackward, BmmBackward0, and for the two
        # broadcast adds the engine's reduction to each input's shape (sum_to_size).
        x, W_E = ctx.saved_tensors
        b_shape, bias_shape, pe_shape, nlead = ctx.shapes
        R, d = x.shape[0], W_E.shape[-1]
        g2 = grad.reshape(R, -1, d)
        dx = dW = db = dpe = None
        if ctx.needs_input_grad[0]:
            dx = mm(g2, W_E.transpose(1, 2)).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            dW = mm(x.reshape(R, -1, x.shape[-1]).transpose(1, 2), g2)
        if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
            gb = grad.sum_to_size(bias_shape)
            if ctx.needs_input_grad[2]:
                db = gb.sum_to_size((R,) + (1,) * nlead + (d,)).reshape(b_shape)
            if ctx.needs_input_grad[3]:
                dpe = gb.sum_to_size(pe_shape)
        return dx, dW, db, dpe, None


def embed_kc(x: Tensor, W_E: Tensor, b_E: Tensor, pe: Tensor) -> Optional[int]:
    """The blocking of :func:`embed`'s product (its :class:`_Embed` node), or None where it
    runs :func:`embed_reference`."""
    if (x.dim() >= 3 and pe.dim() == 2 and W_E.dim() == 3 and b_E.dim() == 2 and pe.shape[0] == x.shape[-2]
            and _eligible(x, W_E, b_E, pe)):
        return _kc(x.reshape(x.shape[0], -1, x.shape[-1]), W_E)
    return None


def embed(x: Tensor, W_E: Tensor, b_E: Tensor, pe: Tensor) -> Tensor:
    """:func:`embed_reference` with its bits, forward and backward."""
    kc = embed_kc(x, W_E, b_E, pe)
    return embed_reference(x, W_E, b_E, pe) if kc is None else _Embed.apply(x, W_E, b_E, pe, kc)
