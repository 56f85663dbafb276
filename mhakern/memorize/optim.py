"""Adam for a stack of independent runs, and the paper's learning-rate schedule.

Adam is elementwise, so one Adam over stacked parameters equals R separate Adams as long as
each run gets its own learning rate (its schedule follows its own step budget) and the loss is
the *sum* of the runs' losses (each run's gradient is then its own). Runs that finish leave the
stack: :meth:`BatchedAdam.select` keeps the state of the others.
"""
from __future__ import annotations

import math
from typing import List

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
        self._shapes()

    def _shapes(self) -> None:
        # The per-run step size (R,) viewed to broadcast over each parameter.
        self._bshape = [(-1,) + (1,) * (p.dim() - 1) for p in self.params]

    @torch.no_grad()
    def step(self, lr: Tensor) -> None:
        self.t += 1
        bc1 = 1 - self.b1**self.t
        bc2 = 1 - self.b2**self.t
        grads = [p.grad for p in self.params]
        torch._foreach_lerp_(self.m, grads, 1 - self.b1)
        torch._foreach_mul_(self.v, self.b2)
        torch._foreach_addcmul_(self.v, grads, grads, 1 - self.b2)
        denom = torch._foreach_sqrt(self.v)
        torch._foreach_div_(denom, math.sqrt(bc2))
        torch._foreach_add_(denom, self.eps)
        # All in foreach calls: a stack's step is small, and a Python loop over the parameters
        # with several ops each was a fifth of the fixed cost of a step.
        upd = torch._foreach_div(self.m, denom)
        step_size = (lr / bc1).to(self.params[0].dtype)
        torch._foreach_mul_(upd, [step_size.view(s) for s in self._bshape])
        torch._foreach_sub_(self.params, upd)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def select(self, runs: Tensor, new_params: List[Tensor]) -> None:
        """Keep the state of ``runs`` only, now attached to ``new_params``."""
        self.params = list(new_params)
        self.m = [m[runs].contiguous() for m in self.m]
        self.v = [v[runs].contiguous() for v in self.v]
        self._shapes()
