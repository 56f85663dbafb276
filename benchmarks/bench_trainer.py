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

Each benchmark's ``extra_info`` holds steps/s and examples/s; at the end of the module every
figure is printed as a ratio to its peers from the same run (machines are shared and noisy:
only ratios from one run mean something). CPU threads: the trainer's default of 1 unless
``MHAKERN_BENCH_THREADS`` says otherwise.

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
    # name: (impl, layout)
    "fused": ("fused", "rows"),
    "fused-mqa": ("fused", "heads"),
    "eager": ("eager", "rows"),
    "paper": ("paper", "rows"),
}
_RESULTS = {}


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module", autouse=True)
def _threads_and_summary(request):
    n = torch.get_num_threads()
    want = int(os.environ.get("MHAKERN_BENCH_THREADS", "1"))
    if _device() == "cpu" and want > 0:
        torch.set_num_threads(want)
    yield
    torch.set_num_threads(n)
    rep = request.config.pluginmanager.get_plugin("terminalreporter")
    if rep is None or not _RESULTS:
        return
    rep.section(f"trainer steps/s at H=20, n=32, d=64, batch 256 ({device_name(torch.device(_device()))})")
    for name, r in _RESULTS.items():
        rep.write_line(f"{name:10s} {r['steps_per_s']:9.2f} steps/s  {r['examples_per_s']:11.0f} examples/s  ({r['backend']})")
    for a in _RESULTS:
        for b in _RESULTS:
            if a != b and b in ("eager", "paper"):
                rep.write_line(f"{a} / {b}: {_RESULTS[a]['steps_per_s'] / _RESULTS[b]['steps_per_s']:.2f}x")


def _stepper(impl: str, layout: str):
    dev = _device()
    cfg = RunConfig(**SHAPE, impl=impl, steps=1_000_000, eval_every=10**9)
    st = _Stack([cfg], dev, layout, 1 << 30)
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
    impl, layout = VARIANTS[variant]
    st, steps = _stepper(impl, layout)
    # Warm-up (allocations, first dispatch), then size a round to about 0.5 s.
    t = time.perf_counter()
    steps(2)()
    per_step = (time.perf_counter() - t) / 2
    k = max(1, int(0.5 / max(per_step, 1e-6)))
    rounds = 5 if per_step * k * 5 < 30 else 3
    benchmark.pedantic(steps(k), rounds=rounds, iterations=1)
    med = benchmark.stats.stats.median
    sps = k / med
    if impl == "fused":
        import mhakern

        q = torch.empty((2, 1, 20, 64), device=_device())
        backend = "mhakern:" + mhakern.backends.select("auto", q, q, q, False, None).name
    else:
        backend = "plain PyTorch"
    benchmark.extra_info.update(
        variant=variant, steps_per_round=k, steps_per_s=sps, examples_per_s=sps * SHAPE["batch"], backend=backend,
        threads=torch.get_num_threads(),
    )
    _RESULTS[variant] = dict(steps_per_s=sps, examples_per_s=sps * SHAPE["batch"], backend=backend)
