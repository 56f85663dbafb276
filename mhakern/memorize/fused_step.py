"""A training step's weight gradients in one operator call, where that gives autograd's bits (CPU).

:class:`~mhakern.memorize.train.StepEngine` computes each step's gradients as
``autograd.grad`` of the weighted mean loss through :func:`model.folded_forward`
(``StepEngine._autograd_grads``): about 320 operator calls, views included, each through the
interpreter, and the autograd engine between them. At the paper's shape (H 20, n 32, d 64, batch 256, one CPU
thread) that was about 1 ms of a 7.2 ms step. ``torch.ops.mhakern_C.folded_step_grads``
(csrc/cpu/folded_step.cpp) runs the same operations -- the same ATen calls and mhakern_C operators
on the same operands, in the order the autograd engine runs them -- in one call.

Which kernel each of its products runs is the *plan*: the blocking the products module
(:mod:`~mhakern.memorize.products`) would choose for that product's operands, or -1 for the ATen
product, in the fields the operator names (``folded_step_fields``). The plan is made from the
products module's own decisions, so it moves with them; and before a plan is used, one step's
gradients are computed both ways and compared bit for bit (once per shape and process,
:func:`verified`); a plan that differs anywhere is never used.

Only the configurations of the paper's classification sweeps take this path: CPU, float32, the
fused model with its heads as query rows, a context per example or one per run, d_v = 1,
classification, the folded query weights formed (``model.folds``), and the products on the
micro-kernel (not inside ``products.disabled``). Every other configuration steps through
autograd as before.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import products
from .model import StackedParams, folds

Tensor = torch.Tensor

# verdict key (key_of) -> whether the operator gave autograd's bits there; absent: not checked yet
_VERIFIED: Dict[Tuple, bool] = {}


def _have_op() -> bool:
    return products.have_ops("folded_step_grads")


def plan(P: StackedParams, q: Tensor, c: Tensor, pe: Tensor, backend: str) -> Optional[List[int]]:
    """The operator's plan for a batch of queries ``q`` (R, b, d_in) and contexts ``c``
    (R, b, n, d_in), or one per run (R, n, d_in), through :func:`model.folded_forward` (fused,
    heads as rows), or None where that forward's operations are not the operator's (see the
    module docstring)."""
    W_E, b_E, W_Q, W_K, W_V, W_O, W_D, b_D = P.tensors()
    if not (_have_op() and q.dim() == 3 and c.dim() in (3, 4) and W_V.dim() == 4 and W_V.shape[-1] == 1):
        return None
    R, b, d_in = q.shape
    shared = c.dim() == 3
    n, d, H, dh, C = c.shape[-2], W_E.shape[2], W_K.shape[1], W_K.shape[3], W_D.shape[2]
    tensors = (q, c, pe, *P.tensors())
    if (H == 1 or C == 1 or not folds(b, H, d, dh) or b == 0 or n == 0 or q.requires_grad or c.requires_grad
            or any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors)
            or not all(p.is_contiguous() for p in P.tensors())):
        return None
    import mhakern

    probe = torch.empty((R, 1, b * H, d) if shared else (R * b, 1, H, d))
    kv = torch.empty((R, 1, n, d) if shared else (R * b, 1, n, d))
    try:
        if mhakern.backends.select(backend, probe, kv, kv, False, None).name != "cpu":
            return None
    except (RuntimeError, ValueError):
        return None
    xq = q.unsqueeze(-2)
    kc_q = products.embed_kc(xq, W_E, b_E, pe[0:1])
    kc_c = products.embed_kc(c, W_E, b_E, pe[1:])
    if kc_q is None or kc_c is None or not products.fold_agrees(W_Q, W_K):
        return None

    # Stand-ins with the shapes and strides of the operands the step makes (products decide by
    # shape, strides, dtype and device alone).
    def like(*shape):
        return torch.empty(shape)

    t0 = like(R, b, 1, d).squeeze(-2)
    A = like(R, d, H * d)
    p, o, g = like(R, b, H), like(R, b, d), like(R, b, C)

    def kc(a: Tensor, m: Tensor) -> int:
        k = products._kc(a, m)
        return -1 if k is None else k

    def pair(forward_kc: int, ga: Tuple[Tensor, Tensor], gb: Tuple[Tensor, Tensor]) -> Tuple[int, int]:
        # A product on the micro-kernel has products' backward (each product chosen alike); one
        # left to ATen has ATen's backward (torch.bmm's: ATen products).
        return (kc(*ga), kc(*gb)) if forward_kc >= 0 else (-1, -1)

    kc_u, kc_o = kc(t0, A), kc(p, W_O)
    k_d = products.baddbmm_kc(b_D.unsqueeze(1), o, W_D)
    kc_d = -1 if k_d is None else k_d
    du, d_o = like(R, b, H * d), like(R, b, d)
    gda, gdb = pair(kc_d, (g, W_D.transpose(1, 2)), (o.transpose(1, 2), g))
    gha, ghb = pair(kc_o, (d_o, W_O.transpose(1, 2)), (p.transpose(1, 2), d_o))
    gqa, gqb = pair(kc_u, (du, A.transpose(1, 2)), (t0.transpose(1, 2), du))
    fields = dict(
        embed_query=kc_q, embed_ctx=kc_c, queries=kc_u, heads_out=kc_o, decode=kc_d,
        grad_decode_a=gda, grad_decode_b=gdb, grad_heads_a=gha, grad_heads_b=ghb,
        grad_queries_a=gqa, grad_queries_b=gqb,
        grad_embed_ctx=kc(c.reshape(R, -1, d_in).transpose(1, 2), like(R, n if shared else b * n, d)),
        grad_embed_query=kc(xq.reshape(R, -1, d_in).transpose(1, 2), like(R, b, 1, d).reshape(R, -1, d)),
    )
    names = list(torch.ops.mhakern_C.folded_step_fields())
    if sorted(names) != sorted(fields):
        return None  # a build whose operator takes other fields than this module makes
    return [int(fields[k]) for k in names]


def grads(P: StackedParams, q: Tensor, c: Tensor, y: Tensor, w: Tensor, pe: Tensor,
          the_plan: Sequence[int]) -> List[Tensor]:
    """The gradients of the runs' summed weighted-mean cross-entropy through the fused model, in
    one call (``the_plan`` from :func:`plan`; use it only where :func:`verified` said yes)."""
    d = P["W_E"].shape[2]
    return list(torch.ops.mhakern_C.folded_step_grads(P.tensors(), q, c, y, w, pe, 1.0 / math.sqrt(d),
                                                      list(the_plan)))


def known(key: Tuple) -> bool:
    """Whether the operator was verified for ``key`` in this process (:func:`verified`)."""
    return _VERIFIED.get(key, False)


def verified(key: Tuple, ref: Sequence[Tensor], compute) -> bool:
    """Whether the operator gives autograd's gradients bit for bit: ``compute()`` (the operator's
    gradients of a batch) against ``ref`` (autograd's of the same batch), compared the first
    time ``key`` is seen in this process; the verdict is kept."""
    if key not in _VERIFIED:
        try:
            got = compute()
            ok = len(got) == len(ref) and all(
                a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))
                for a, b in zip(got, ref))
        except (RuntimeError, ValueError):
            ok = False
        _VERIFIED[key] = ok
    return _VERIFIED[key]


def key_of(P: StackedParams, q: Tensor, c: Tensor, the_plan: Sequence[int]) -> Tuple:
    """What a verdict of :func:`verified` holds for: the shapes, the plan and the ATen CPU
    capability (which of ATen's kernels run)."""
    return (tuple(tuple(t.shape) for t in P.tensors()), tuple(q.shape), tuple(c.shape), tuple(the_plan),
            torch.backends.cpu.get_cpu_capability())
