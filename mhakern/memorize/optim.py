"""Adam for a stack of independent runs, and the paper's learning-rate schedule.

Adam is elementwise, so one Adam over stacked parameters equals R separate Adams as long as
each run gets its own learning rate (its schedule follows its own step budget) and the loss is
the *sum* of the runs' losses (each run's gradient is then its own). Runs that finish leave the
stack: :meth:`BatchedAdam.select` keeps the state of the others.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import torch

Tensor = torch.Tensor


def lr_factor(step: int, total: int, warmup: float = 0.05) -> float:
    """Multiplier of the base lr at ``step`` (0-based) of ``total``: linear warm-up from 0.01
    over the first ``warmup`` fraction of the steps, then cosine decay to 0 at ``total``."""
    w = int(warmup * total)
    if step < w:
        return 0.01 + 0.99 * step / w
    span = max(1, total - w)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - w) / span)))


class BatchedAdam:
    """Adam (PyTorch's defaults: betas 0.9, 0.999, eps 1e-8, no weight decay) with a per-run lr.

    ``params``: tensors with the run dim first. :meth:`step` takes ``lr`` (R,) and updates in
    place from each tensor's ``.grad``. All runs of a stack start together, so they share the
    step count used by the bias corrections.
    """

    def __init__(self, params: List[Tensor], betas=(0.9, 0.999), eps: float = 1e-8):
        self.params = list(params)
        self.b1, self.b2 = betas
        self.eps = eps
        self.t = 0
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]

    @torch.no_grad()
    def step(self, lr: Tensor) -> None:
        self.t += 1
        bc1 = 1 - self.b1**self.t
        p0 = self.params[0]
        # All in foreach calls (adam_foreach): a stack's step is small, and a Python loop over the
        # parameters with several ops each was a fifth of the fixed cost of a step.
        adam_foreach(self.params, [p.grad for p in self.params], self.m, self.v,
                     torch.tensor(math.sqrt(1 - self.b2**self.t), dtype=p0.dtype, device=p0.device),
                     (lr / bc1).to(p0.dtype), self.b1, self.b2, self.eps)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def select(self, runs: Tensor, new_params: List[Tensor]) -> None:
        """Keep the state of ``runs`` only, now attached to ``new_params``."""
        self.params = list(new_params)
        self.m = [m[runs].contiguous() for m in self.m]
        self.v = [v[runs].contiguous() for v in self.v]


def adam_foreach(params: List[Tensor], grads: Sequence[Tensor], m: List[Tensor], v: List[Tensor], sqrt_bc2: Tensor,
                 step_size: Tensor, b1: float, b2: float, eps: float) -> None:
    """One Adam step of the trainer's step engine as PyTorch's foreach passes, in place.

    ``sqrt_bc2``: one value, sqrt(1 - b2^t), as a 0-dim or 1-element tensor; ``step_size``:
    (R, 1) or (R,), lr / (1 - b1^t) per run, the first dim of every tensor. These passes define
    the arithmetic (the stored results' bits); :func:`fused_adam_variant` says where the one-sweep
    kernel gives the same bits.
    """
    torch._foreach_lerp_(m, grads, 1 - b1)
    torch._foreach_mul_(v, b2)
    torch._foreach_addcmul_(v, grads, grads, 1 - b2)
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, sqrt_bc2.view(()))
    torch._foreach_add_(denom, eps)
    upd = torch._foreach_div(m, denom)
    ss = step_size.reshape(-1)
    torch._foreach_mul_(upd, [ss.view((-1,) + (1,) * (p.dim() - 1)) for p in params])
    torch._foreach_sub_(params, upd)


def adam_fused(params: List[Tensor], grads: Sequence[Tensor], m: List[Tensor], v: List[Tensor], sqrt_bc2: Tensor,
               step_size: Tensor, b1: float, b2: float, eps: float, fma: bool) -> None:
    """:func:`adam_foreach` in one sweep per tensor (``torch.ops.mhakern_C.adam_step_``, float32
    on the CPU), reproducing ATen's kernels with (``fma``) or without fused multiply-adds."""
    torch.ops.mhakern_C.adam_step_(params, list(grads), m, v, step_size.reshape(-1), sqrt_bc2.reshape(1),
                                   1 - b1, 1 - b2, b2, eps, fma)


# ATen's CPU capability -> the fused kernel's variant that gives adam_foreach's bits (None: none).
_FUSED_VARIANT: Dict[str, Optional[bool]] = {}


def fused_adam_variant(params: Sequence[Tensor], b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> Optional[bool]:
    """The ``fma`` argument of :func:`adam_fused` that reproduces :func:`adam_foreach` bit for
    bit for ``params``, or None where the fused step must not be used (not float32 contiguous CPU
    tensors, no compiled kernel, or neither variant gives the foreach passes' bits here).

    Checked once per process and ATen CPU capability, by running both on random states for a few
    steps, tensors whose sizes leave every tail length: which of ATen's kernels run (with fused
    multiply-adds or not, how their tails are split) is a property of the torch build and the CPU,
    and the stored results fix these bits (config.SCHEMA_VERSION).
    """
    if not params or any(p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous() for p in params):
        return None
    if 1 - b1 >= 0.5:  # lerp's other formula; not reproduced
        return None
    from .. import _extension

    if _extension.load() is None or not hasattr(torch.ops.mhakern_C, "adam_step_"):
        return None
    key = torch.backends.cpu.get_cpu_capability()
    if key not in _FUSED_VARIANT:
        _FUSED_VARIANT[key] = _find_variant(b1, b2, eps)
    return _FUSED_VARIANT[key]


def _find_variant(b1: float, b2: float, eps: float) -> Optional[bool]:
    g = torch.Generator().manual_seed(1234)
    # Runs first; per-run lengths that leave every tail of 8 and 16 lanes, and a chunk boundary.
    shapes = [(2, 4111), (3, 5, 7), (1, 100), (2, 16), (1, 20000), (3, 1, 9)]
    ps = [torch.randn(s, generator=g) for s in shapes]
    steps = []
    for t in range(1, 4):
        grads = [torch.randn(s, generator=g) * 10.0 ** float(torch.randint(-6, 1, (), generator=g)) for s in shapes]
        if t == 2:
            for x in grads:
                x.view(-1)[::7] = 0.0  # exact zeros through lerp and addcmul
        steps.append((torch.tensor(math.sqrt(1 - b2**t), dtype=torch.float32), grads))
    ss = torch.tensor([[1e-3], [3e-4], [2e-3]], dtype=torch.float32)
    for fma in (True, False):
        ref, out = [p.clone() for p in ps], [p.clone() for p in ps]
        mr, vr, mo, vo = ([torch.zeros_like(p) for p in ps] for _ in range(4))
        try:
            for sb, grads in steps:
                for i, s in enumerate(shapes):
                    adam_foreach([ref[i]], [grads[i]], [mr[i]], [vr[i]], sb, ss[: s[0]], b1, b2, eps)
                    adam_fused([out[i]], [grads[i]], [mo[i]], [vo[i]], sb, ss[: s[0]], b1, b2, eps, fma)
        except RuntimeError:  # this variant is not built for this CPU
            continue
        if all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(ref + mr + vr, out + mo + vo)):
            return fma
    return None
