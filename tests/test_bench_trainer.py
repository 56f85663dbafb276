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


def test_stamped_loader_times_from_the_request_of_batch_mark_across_epochs():
    # The paper's loop iterates as its Trainer does: iter() per epoch, next() per step. With
    # 3 batches an epoch and mark 4, the clock is read once, when the 5th batch (the second of
    # the second epoch) is requested, before it is fetched.
    from torch.utils.data import DataLoader, TensorDataset

    events = []

    class Recording(TensorDataset):
        def __getitem__(self, i):
            events.append("fetch")
            return super().__getitem__(i)

    loader = bench_trainer._StampedLoader(DataLoader(Recording(torch.arange(6.0)), batch_size=2))

    def clock():
        events.append("clock")
        return float(len(events))

    loader.arm(4, clock)
    got = 0
    for _epoch in range(3):
        for _ in loader:
            got += 1
            if got == 7:
                break
        if got == 7:
            break
    assert events.count("clock") == 1
    # Batches of 2 examples: 4 batches (8 fetches) before the clock, then the 5th batch's fetches.
    assert events.index("clock") == 8 and events[9:11] == ["fetch", "fetch"]
    assert loader.t == 9.0 and loader.fetched == 7
    loader.arm(0, clock)
    next(iter(loader))
    assert loader.t is not None and loader.fetched == 1


def test_interleaved_runners_time_their_last_steps_only(monkeypatch):
    # interleaved() calls every variant's runner as run(k, warm, clock): warm steps untimed, then
    # k steps between two clock reads. A clock that counts the engine's steps sees k of them.
    from mhakern.memorize import train

    done = [0]
    step = train.StepEngine._step

    def counted(self, *a, **k):
        step(self, *a, **k)
        done[0] += 1

    monkeypatch.setattr(train.StepEngine, "_step", counted)
    shape = dict(bench_trainer.SHAPE, heads=2, context=4, d_model=8, d_in=8, d_head=8, classes=4, batch=4, T=16)
    run, _ = bench_trainer._engine_stepper("fused", 1, True, False, "cpu", shape=shape)
    before = done[0]
    assert run(3, 2, lambda: float(done[0])) == 3.0
    assert done[0] - before == 5
