"""benchmarks/bench_trainer.py's reference, the paper's whole training loop (``paper-loop``).

It needs a checkout of smahdavi4/attention-memorization named by ``MHAKERN_PAPER_SRC`` (its
``src`` folder) and skips without one. One step of the paper's shape on one thread: about two
seconds.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks import bench_trainer  # noqa: E402


@pytest.mark.skipif(not os.environ.get("MHAKERN_PAPER_SRC"), reason="MHAKERN_PAPER_SRC is not set")
def test_paper_loop_trains_through_its_trainer():
    model, steps = bench_trainer._paper_loop_stepper()
    before = [p.detach().clone() for p in model.parameters()]
    steps(1)()
    # The paper's Trainer.train ran its optimizer: every parameter with a gradient moved.
    moved = [not torch.equal(a, p) for a, p in zip(before, model.parameters())]
    assert any(moved)
    assert all(p.grad is None or not p.grad.any() for p in model.parameters()), "zero_grad after the step"

