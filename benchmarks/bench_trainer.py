"""Training steps per second of the memorization trainer (pytest-benchmark).

One run of the paper's model at H = 20 heads, n = 32 context tokens, d = d_in = d_h = 64,
d_v = 1, 100 classes, batch 256 (T = 10,000 random-context examples, so every step samples a
batch), one full step each: forward, backward and the Adam update. Three implementations of the
same function with the same weights:

* ``fused``  -- the trainer's model: folded queries and one attention call on
  ``mhakern.attention`` (backend ``auto``; whichever the registry picks on this device is
  named in ``extra_info``), heads passed as query rows of one head (the trainer's default);
  ``fused-mqa`` passes them as H query heads of one query over one KV head;
* ``eager``  -- the same folded model with its attention in eager PyTorch (matmul, softmax,
  matmul): what the fused kernels must beat;
* ``paper``  -- the paper's computation in plain PyTorch: per-head Q, K and V of all n + 1
  tokens and the full (n + 1) x (n + 1) attention.

``-x8`` variants train 8 seeds stacked as one batched model (what sweeps do): their steps/s is
per run, and the ratios compare run-steps per second.

``paper-code`` is the paper's own model (``BaselineAttention`` from
smahdavi4/attention-memorization's ``src/attn_models.py``) with its training step (cross-entropy
on token 0's logits, Adam, as its ``trainers.py``), imported from a checkout of that repository
named by ``MHAKERN_PAPER_SRC`` (its ``src`` folder); skipped when the variable is unset. The
project holds none of its code.

Each benchmark's ``extra_info`` holds steps/s and examples/s; at the end of the module every
figure is printed as a ratio to its peers from the same run (machines are shared and noisy:
only ratios from one run mean something). CPU threads: the trainer's default of 1 unless
``MHAKERN_BENCH_THREADS`` says otherwise. With one CPU thread the clock is the process's CPU
time (``time.process_time``), which other jobs on a shared machine do not inflate; otherwise,
and on CUDA, wall time.

Run: ``pytest benchmarks/bench_trainer.py --benchmark-only``.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

from mhakern.memorize.config import RunConfig
from mhakern.memorize.train import _Stack, device_name

SHAPE = dict(heads=20, context=32, d_model=64, d_in=64, d_head=64, d_value=1, classes=100, batch=256, T=10_000)
VARIANTS = {
    # name: (impl, layout, runs stacked)
    "fused": ("fused", "rows", 1),
    "fused-mqa": ("fused", "heads", 1),
    "eager": ("eager", "rows", 1),
    "paper": ("paper", "rows", 1),
    "fused-x8": ("fused", "rows", 8),
    "eager-x8": ("eager", "rows", 8),
    "paper-code": ("paper-code", None, 1),
}
_RESULTS = {}
_THREADS = int(os.environ.get("MHAKERN_BENCH_THREADS", "1"))
_CPU_CLOCK = not torch.cuda.is_available() and _THREADS == 1
pytestmark = pytest.mark.benchmark(timer=time.process_time if _CPU_CLOCK else time.perf_counter)


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module", autouse=True)
def _threads_and_summary(request):
    n = torch.get_num_threads()
    if _device() == "cpu" and _THREADS > 0:
        torch.set_num_threads(_THREADS)
    yield
    try:
        _summary(request)
    finally:
        torch.set_num_threads(n)


def _summary(request):
    rep = request.config.pluginmanager.get_plugin("terminalreporter")
    capman = request.config.pluginmanager.get_plugin("capturemanager")
    if rep is None or capman is None or not _RESULTS:
        return
    # Module teardown runs under output capture; the summary must reach the terminal.
    with capman.global_and_fixture_disabled():
        clock = "process CPU time" if _CPU_CLOCK else "wall time"
        rep.section(f"trainer at H=20, n=32, d=64, batch 256 ({device_name(torch.device(_device()))}; {clock})")
        for name, r in _RESULTS.items():
            rep.write_line(
                f"{name:10s} {r['steps_per_s']:9.2f} steps/s per run  {r['examples_per_s']:10.0f} examples/s per run"
                f"  {r['examples_per_s'] * r['runs']:10.0f} examples/s in all  ({r['backend']})"
            )
        for a in _RESULTS:
            for b in ("eager", "paper", "paper-code"):
                if a != b and b in _RESULTS:
                    ra, rb = _RESULTS[a], _RESULTS[b]
                    rep.write_line(f"{a} / {b}: {ra['steps_per_s'] * ra['runs'] / (rb['steps_per_s'] * rb['runs']):.2f}x "
                                   "(run-steps per second)")


def _paper_code_stepper():
    """The paper's model and training step from its own repository (see the module docstring)."""
    import sys

    import torch.nn.functional as F

    src = os.environ.get("MHAKERN_PAPER_SRC")
    if not src:
        pytest.skip("MHAKERN_PAPER_SRC (the src folder of a smahdavi4/attention-memorization checkout) is not set")
    sys.path.insert(0, src)
    try:
        from attn_models import BaselineAttention
    finally:
        sys.path.remove(src)
    dev = _device()
    torch.manual_seed(0)
    model = BaselineAttention(input_dim=64, n_classes=100, d_model=64, num_heads=SHAPE["heads"], dh=None).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    X = torch.rand(SHAPE["T"], SHAPE["context"] + 1, 64, generator=g).to(dev)
    Y = torch.randint(0, 100, (SHAPE["T"],), generator=g).to(dev)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    counter = [0]

    def steps(k):
        def run():
            for _ in range(k):
                i = (counter[0] * SHAPE["batch"]) % (SHAPE["T"] - SHAPE["batch"])
                x, y = X[i : i + SHAPE["batch"]], Y[i : i + SHAPE["batch"]]
                out, _ = model(x, y)
                loss = F.cross_entropy(out[:, 0, :], y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                counter[0] += 1
            sync()

        return run

    return None, steps


def _stepper(impl: str, layout: str, runs: int):
    if impl == "paper-code":
        return _paper_code_stepper()
    dev = _device()
    cfgs = [RunConfig(**SHAPE, impl=impl, steps=1_000_000, eval_every=10**9, seed=s) for s in range(runs)]
    st = _Stack(cfgs, dev, layout, 1 << 30)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    counter = [0]

    def steps(k):
        def run():
            for _ in range(k):
                st.train_step(counter[0])
                counter[0] += 1
            sync()

        return run

    return st, steps


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_trainer_steps_per_second(benchmark, variant):
    impl, layout, runs = VARIANTS[variant]
    st, steps = _stepper(impl, layout, runs)
    # Warm-up (allocations, first dispatch), then size a round to about 0.5 s.
    clock = time.process_time if _CPU_CLOCK else time.perf_counter
    t = clock()
    steps(2)()
    per_step = (clock() - t) / 2
    k = max(1, int(0.5 / max(per_step, 1e-6)))
    rounds = 5 if per_step * k * 5 < 30 else 3
    benchmark.pedantic(steps(k), rounds=rounds, iterations=1)
    med = benchmark.stats.stats.median
    sps = k / med
    if impl == "fused":
        import mhakern

        q = torch.empty((2, 1, 20, 64), device=_device())
        backend = "mhakern:" + mhakern.backends.select("auto", q, q, q, False, None).name
    elif impl == "paper-code":
        backend = "the paper's code"
    else:
        backend = "plain PyTorch"
    benchmark.extra_info.update(
        variant=variant, runs=runs, steps_per_round=k, steps_per_s=sps, examples_per_s=sps * SHAPE["batch"],
        backend=backend, threads=torch.get_num_threads(),
    )
    _RESULTS[variant] = dict(steps_per_s=sps, examples_per_s=sps * SHAPE["batch"], backend=backend, runs=runs)
