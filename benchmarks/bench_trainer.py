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

``engine`` and ``engine-x8`` are ``fused`` through the trainer's step engine (``train.StepEngine``,
what ``train_stack`` runs; on CUDA one captured CUDA graph per step, no host sync between
evaluations); the others step through the per-step loop (``_Stack.train_step``).

``fused-aten`` is ``fused`` with the model's dense products as the ATen calls they replace
(``memorize.products.disabled``; the same numbers): ``fused / fused-aten`` is what running them
on the extension's micro-kernel gives, measured in the same run.

``fused-autograd`` (interleaved rounds only) is ``fused`` with each step's gradients through autograd
rather than ``memorize.fused_step``'s one operator call (the same numbers): ``fused /
fused-autograd`` is what that call gives, measured in the same run.

``-x8`` variants train 8 seeds stacked as one batched model (what sweeps do): their steps/s is
per run, and the ratios compare run-steps per second.

``paper-code`` is the paper's own model (``BaselineAttention`` from
smahdavi4/attention-memorization's ``src/attn_models.py``) with its training step (cross-entropy
on token 0's logits, Adam, as its ``trainers.py``), imported from a checkout of that repository
named by ``MHAKERN_PAPER_SRC`` (its ``src`` folder); skipped when the variable is unset. The
project holds none of its code. That is the paper's step alone, on pre-sliced tensors: a second,
named figure. ``paper-loop`` is the reference the docs quote: the paper's whole training loop,
its own ``Trainer.train`` (DataLoader, forward, backward, Adam, learning-rate scheduler, its
``.item()`` log call), with only logging and evaluation stubbed (see ``_paper_loop_stepper``).

Each benchmark's ``extra_info`` holds steps/s and examples/s; at the end of the module every
figure is printed as a ratio to its peers from the same run (machines are shared and noisy:
only ratios from one run mean something). CPU threads: the trainer's default of 1 unless
``MHAKERN_BENCH_THREADS`` says otherwise. With one CPU thread the clock is the process's CPU
time (``time.process_time``), which other jobs on a shared machine do not inflate; otherwise,
and on CUDA, wall time.

Run: ``pytest benchmarks/bench_trainer.py --benchmark-only``.
"""
from __future__ import annotations

import math
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
    "paper-loop": ("paper-loop", None, 1),
    # the fused model through the trainer's step engine (train.StepEngine; a CUDA graph on CUDA)
    "engine": ("engine", "rows", 1),
    "engine-x8": ("engine", "rows", 8),
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
            for b in ("eager", "paper", "paper-loop", "paper-code", "fused"):
                if a != b and b in _RESULTS:
                    ra, rb = _RESULTS[a], _RESULTS[b]
                    rep.write_line(f"{a} / {b}: {ra['steps_per_s'] * ra['runs'] / (rb['steps_per_s'] * rb['runs']):.2f}x "
                                   "(run-steps per second)")


def _paper_modules(*names):
    """The paper's modules ``names``, imported from its checkout's src folder
    (``MHAKERN_PAPER_SRC``); the benchmark skips when it is not set."""
    import importlib
    import sys

    src = os.environ.get("MHAKERN_PAPER_SRC")
    if not src:
        pytest.skip("MHAKERN_PAPER_SRC (the src folder of a smahdavi4/attention-memorization checkout) is not set")
    sys.path.insert(0, src)
    try:
        return tuple(importlib.import_module(n) for n in names)
    finally:
        sys.path.remove(src)


def _paper_code_stepper():
    """The paper's model and training step from its own repository (see the module docstring)."""
    import torch.nn.functional as F

    (attn_models,) = _paper_modules("attn_models")
    BaselineAttention = attn_models.BaselineAttention
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


class _StampedLoader:
    """A DataLoader as the paper's ``Trainer.train`` iterates it (``iter`` at each epoch, ``next``
    per step), reading ``clock`` when batch ``mark`` (0-based, counted over epochs) is requested:
    the start of step mark + 1, its fetch included."""

    def __init__(self, loader):
        self.loader = loader
        self.arm(0, time.perf_counter)

    def arm(self, mark: int, clock) -> None:
        self.mark, self.clock, self.fetched, self.t = mark, clock, 0, None

    def __iter__(self):
        it = None
        while True:
            if self.fetched == self.mark and self.t is None:
                self.t = self.clock()
            if it is None:
                it = iter(self.loader)
            try:
                batch = next(it)
            except StopIteration:
                return
            self.fetched += 1
            yield batch


def _paper_loop_stepper():
    """The paper's whole training loop: its ``Trainer.train`` (``src/trainers.py``) run as is, on
    a ``DataLoader(shuffle=True, batch_size=256)`` as its ``main.py`` builds, with its tqdm bar,
    Adam, warm-up + cosine scheduler and its every-100-steps ``.item()`` log call. Stubbed, to keep
    evaluation and start-up out of the timed steps: the logger (a no-op ``log``), the evaluation
    (``evaluate_dataloader`` returns at once, ``_maybe_checkpoint_best_model`` writes nothing) and
    the task (its ``compute_loss_acc`` for classification, restated here because the paper's
    ``tasks.py`` imports Hugging Face packages: cross-entropy and accuracy on token 0's logits).
    The data is a ``TensorDataset`` of the same random shape in place of its ``RandomDataset``.
    Each call of ``steps(k)`` runs ``Trainer.train`` for k steps (its optimizer and scheduler made
    anew: microseconds against a step of about a second at this shape). ``steps(k, warm, clock)``
    runs it for warm + k steps and its run() returns the ``clock`` seconds of the last k: from the
    request of batch warm + 1 (its fetch included) to the return of ``train``. The first steps of
    a call run slower than the loop's steady state (its allocations fault their pages in again
    after other work; see ``MIN_WARM_STEPS``), which a reader running the paper's code for
    thousands of steps never sees; interleaved rounds leave them out (``interleaved``)."""
    import tempfile

    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    attn_models, trainers = _paper_modules("attn_models", "trainers")
    BaselineAttention, Trainer, TrainerConfig = attn_models.BaselineAttention, trainers.Trainer, trainers.TrainerConfig

    class _Task:
        def compute_loss_acc(self, outputs, labels):
            logits = outputs[:, 0, :]
            return F.cross_entropy(logits, labels), (logits.argmax(dim=-1) == labels).float().mean()

    class _Logger:
        def log(self, *a, **k):
            pass

    class _NoEvalTrainer(Trainer):
        def evaluate_dataloader(self, dataloader):
            return 1.0, 0.0

        def _maybe_checkpoint_best_model(self, val_loss):
            pass

    dev = _device()
    torch.manual_seed(0)
    model = BaselineAttention(input_dim=64, n_classes=100, d_model=64, num_heads=SHAPE["heads"], dh=None)
    g = torch.Generator().manual_seed(0)
    X = torch.rand(SHAPE["T"], SHAPE["context"] + 1, 64, generator=g)
    Y = torch.randint(0, 100, (SHAPE["T"],), generator=g)
    loader = _StampedLoader(DataLoader(TensorDataset(X, Y), batch_size=SHAPE["batch"], shuffle=True))
    ckpt = tempfile.mkdtemp(prefix="mhakern-bench-paper-")
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

    def steps(k, warm=0, clock=time.perf_counter):
        def run():
            cfg = TrainerConfig(lr=1e-3, train_steps=max(warm + k, 1), validate_every_n_steps=10**9,
                                checkpoint_path=ckpt, task=_Task(), device=dev, early_stop=False)
            loader.arm(warm, clock)
            _NoEvalTrainer(model, _Logger(), cfg).train(loader, None)
            sync()
            return clock() - loader.t if loader.t is not None else 0.0

        return run

    return model, steps


def _stepper(impl: str, layout: str, runs: int):
    if impl == "paper-code":
        return _paper_code_stepper()
    if impl == "paper-loop":
        return _paper_loop_stepper()
    from mhakern.memorize.train import StepEngine

    dev = _device()
    engine = impl == "engine"
    impl = "fused" if engine else impl
    cfgs = [RunConfig(**SHAPE, impl=impl, steps=1_000_000, eval_every=10**9, seed=s) for s in range(runs)]
    st = _Stack(cfgs, dev, layout, 1 << 30)
    eng = StepEngine(st) if engine else None
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    counter = [0]

    def steps(k):
        def run():
            if eng is not None:
                eng.run(k)
            for _ in range(k if eng is None else 0):
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
    if impl == "paper-loop":
        # Each round is a Trainer.train call, whose first steps run slower than the loop's steady
        # state (MIN_WARM_STEPS): those untimed in the figure; pytest-benchmark's own statistics
        # time the calls whole.
        k = max(k, 8)
        steady = []

        def target():
            steady.append(steps(k, MIN_WARM_STEPS, clock)())

    else:
        target = steps(k)
    rounds = 5 if per_step * k * 5 < 30 else 3
    benchmark.pedantic(target, rounds=rounds, iterations=1, warmup_rounds=1)
    med = benchmark.stats.stats.median
    if impl == "paper-loop":
        import statistics

        med = statistics.median(steady[1:])  # the warm-up round's left out, as pytest-benchmark's
    sps = k / med
    if impl in ("fused", "engine"):
        import mhakern

        q = torch.empty((2, 1, 20, 64), device=_device())
        backend = "mhakern:" + mhakern.backends.select("auto", q, q, q, False, None).name
    elif impl == "paper-code":
        backend = "the paper's code, step alone"
    elif impl == "paper-loop":
        backend = "the paper's code, whole loop"
    else:
        backend = "plain PyTorch"
    benchmark.extra_info.update(
        variant=variant, runs=runs, steps_per_round=k, steps_per_s=sps, examples_per_s=sps * SHAPE["batch"],
        backend=backend, threads=torch.get_num_threads(),
    )
    _RESULTS[variant] = dict(steps_per_s=sps, examples_per_s=sps * SHAPE["batch"], backend=backend, runs=runs)


# ---------------------------------------------------------------------------- interleaved rounds
# ``python benchmarks/bench_trainer.py [--rounds 6] [--seconds 1.0] [--compile]``: the variants
# below measured in interleaved rounds (A B C A B C ...) in one process, so that a shared
# machine's load changes hit every variant alike; medians of the rounds and the median of the
# per-round ratios are printed. One CPU thread, process CPU time on the CPU; wall time with the
# device synchronised on CUDA. Every variant runs the trainer's step engine (StepEngine: the same
# loop, data, loss and Adam), only the model differs, except ``loop``, the per-step loop that the
# engine replaced. On CUDA the engine captures its step as a CUDA graph.
ENGINE_VARIANTS = {
    # name: (impl, runs stacked, engine?, compiled?)
    "fused": ("fused", 1, True, False),
    "eager": ("eager", 1, True, False),
    "compiled": ("eager", 1, True, True),
    "paper": ("paper", 1, True, False),
    "fused-x8": ("fused", 8, True, False),
    # fused with the model's dense products as ATen calls (memorize.products.disabled): the same
    # numbers; what the products on the micro-kernel give, measured in the same run
    "fused-aten": ("fused-aten", 1, True, False),
    # fused with the step's gradients through autograd, not fused_step's one call: the same numbers
    "fused-autograd": ("fused-autograd", 1, True, False),
    "loop": ("fused", 1, False, False),
    # the paper's whole training loop, its Trainer.train (see _paper_loop_stepper; needs
    # MHAKERN_PAPER_SRC): the reference the docs quote
    "paper-loop": ("paper-loop", 1, False, False),
    # the paper's model step alone, on pre-sliced tensors (see _paper_code_stepper): named beside it
    "paper-code": ("paper-code", 1, False, False),
}


def _time_last(steps, k, warm, clock):
    """``clock`` seconds of the last k of warm + k steps (``steps(n)`` runs n of them)."""
    steps(warm)
    t = clock()
    steps(k)
    return clock() - t


def _engine_stepper(impl, runs, engine, compiled, device, shape=SHAPE):
    import contextlib

    from mhakern.memorize import products
    from mhakern.memorize.model import forward
    from mhakern.memorize.train import StepEngine

    if impl == "paper-loop":
        _, steps = _paper_loop_stepper()
        steps(1)()
        return (lambda k, warm=0, clock=time.perf_counter: steps(k, warm, clock)()), None
    if impl == "paper-code":
        _, steps = _paper_code_stepper()
        steps(1)()
        return (lambda k, warm=0, clock=time.perf_counter: _time_last(lambda n: steps(n)(), k, warm, clock)), None
    aten, autograd = impl == "fused-aten", impl == "fused-autograd"
    impl = "fused" if aten or autograd else impl
    cfgs = [RunConfig(**shape, impl=impl, steps=1_000_000, eval_every=10**9, seed=s) for s in range(runs)]
    st = _Stack(cfgs, device, "rows", 1 << 30)
    compile_s = None
    if compiled:
        # The folded model with its attention in eager PyTorch, compiled by inductor (forward;
        # the backward through AOTAutograd), called in the engine's step as the trainer's model.
        fn = torch.compile(lambda P, q, c, pe: forward(P, q, c, pe, "eager"), dynamic=False)
        st.logits = lambda P, q, c: fn(P, q, c, st.pe)
    eng = StepEngine(st) if engine else None
    if autograd:
        eng.fused = False  # never the one-call gradients (StepEngine._grads)
    counter = [0]
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)

    def steps(k):
        with products.disabled() if aten else contextlib.nullcontext():
            if eng is not None:
                eng.run(k)
            else:
                for _ in range(k):
                    st.train_step(counter[0])
                    counter[0] += 1
        sync()

    def run(k, warm=0, clock=time.perf_counter):
        return _time_last(steps, k, warm, clock)

    t = time.perf_counter()
    steps(3)  # first calls, compilation, capture
    if compiled:
        compile_s = time.perf_counter() - t
    return run, compile_s


# Untimed steps at the start of every interleaved round, at least (``interleaved``). The paper's
# whole loop right after 2,000 of the engine's steps, two calls of 41 steps (process time, the
# Zen 4 host of docs/results.md, section 4): 0.65 and 0.72 s a step over a call's first five
# steps (system time 0.21 and 0.27 s of them: its allocations fault their pages in again), then
# 0.45-0.68 s over each later five (0.55-0.59 s over most; system time 0.08-0.20 s).
MIN_WARM_STEPS = 5


def interleaved(variants, rounds=6, seconds=1.0, device=None, shape=SHAPE, warmup=3.0):
    """Run-steps/s (steps/s times the runs stacked) of each variant: {name: [round values]},
    plus compile times.

    Each round of a variant first runs ``warmup`` seconds' worth of its steps untimed (at least
    MIN_WARM_STEPS; none when ``warmup`` is 0), then times about ``seconds`` of steps: the steps
    right after another variant ran are not the variant's steady state, and rounds of a few of
    the paper's loop's steps timed whole overstated every ratio to it (docs/results.md,
    section 4)."""
    device = device or _device()
    cuda = torch.device(device).type == "cuda"
    clock = time.perf_counter if cuda else time.process_time
    runners, sizes, warm, compile_s = {}, {}, {}, {}
    for name in variants:
        impl, runs, engine, compiled = ENGINE_VARIANTS[name]
        run, cs = _engine_stepper(impl, runs, engine, compiled, device, shape)
        if cs is not None:
            compile_s[name] = cs
        per = run(2, 0, clock) / 2
        runners[name], sizes[name] = run, max(1, int(seconds / max(per, 1e-6)))
        warm[name] = 0 if warmup <= 0 else max(MIN_WARM_STEPS, math.ceil(warmup / max(per, 1e-6)))
    out = {n: [] for n in variants}
    for _ in range(rounds):
        for name in variants:
            k = sizes[name]
            out[name].append(k * ENGINE_VARIANTS[name][1] / runners[name](k, warm[name], clock))
    return out, compile_s


def project_preset(name: str, seconds: float = 2.0, device=None, data_max_bytes: int = 2 << 30):
    """Project a preset's wall time on this device from a timed slice of each of its stacks.

    The preset's runs are planned as the sweep plans them (``sweep.plan_stacks`` with the
    device's work bound, then cut to :func:`~mhakern.memorize.train.max_stack_runs`); each stack
    is built, its first steps run (CUDA graph capture), and then timed for about ``seconds``.
    A stack trains until its longest run's budget, so its time is at most that many steps at the
    full stack's rate (runs that stop early or finish sooner only shorten it): the projection is
    an upper bound without early stopping. Returns (rows, total seconds); a row per stack:
    (label, runs, run-steps/s measured, steps of its longest run, projected seconds).
    """
    from mhakern.memorize import presets, sweep
    from mhakern.memorize.train import max_stack_runs, stack_label, stack_rate

    device = torch.device(device or _device())
    p = presets.get(name)
    cfgs = [c for part in p.parts for c in sweep.expand_grid(part.base, part.grid, p.seeds)]
    bound = sweep.STACK_MACS["cuda" if device.type == "cuda" else "cpu"]
    stacks = []
    # No bound on a stack's task bytes here: a stack whose tasks exceed data_max_bytes generates
    # its batches on the device instead of storing them; memory bounds the stack below.
    for s in sweep.plan_stacks(cfgs, max_stack=10**6, max_bytes=1 << 62, max_macs=bound):
        fit = max_stack_runs(s, device, data_max_bytes=data_max_bytes)
        stacks += [s[i : i + fit] for i in range(0, len(s), fit)]
    rows, total = [], 0.0
    for s in stacks:
        rs = stack_rate(s, device, seconds, data_max_bytes)
        longest = max(c.total_steps for c in s)
        est = longest * len(s) / rs
        rows.append((stack_label(s), len(s), rs, longest, est))
        total += est
    return rows, total


def main(argv=None):
    import argparse
    import statistics

    ap = argparse.ArgumentParser(description="Interleaved trainer step rounds (see the module docstring).")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=1.0, help="length of one variant's timed round")
    ap.add_argument("--warmup", type=float, default=3.0,
                    help=f"untimed steps at the start of each round, in seconds (at least {MIN_WARM_STEPS} steps; "
                         "0: none)")
    ap.add_argument("--variants", default=None, help="comma list of " + ",".join(ENGINE_VARIANTS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--project", default=None, metavar="PRESET",
                    help="instead: project PRESET's wall time from a timed slice of each of its stacks")
    a = ap.parse_args(argv)
    dev = _device()
    if dev == "cpu":
        torch.set_num_threads(a.threads)
    if a.project:
        t = time.perf_counter()
        rows, total = project_preset(a.project, a.seconds)
        print(f"{a.project} on {device_name(torch.device(_device()))}: {len(rows)} stacks, "
              f"measured in {time.perf_counter() - t:.0f} s")
        for label, n, rs, longest, est in rows:
            print(f"  {label:50s} {n:3d} runs {rs:10.0f} run-steps/s  longest {longest:7d} steps"
                  f"  -> {est / 60:7.1f} min")
        print(f"  projected total (no early stop, an upper bound): {total / 60:.1f} min")
        return
    names = a.variants.split(",") if a.variants else [
        n for n in ENGINE_VARIANTS if not n.startswith("paper-") or os.environ.get("MHAKERN_PAPER_SRC")]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    res, comp = interleaved(names, a.rounds, a.seconds, dev, warmup=a.warmup)
    load2 = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"trainer step at H=20, n=32, d=64, batch 256; {device_name(torch.device(dev))}; "
          f"{a.rounds} interleaved rounds of ~{a.seconds:g} s timed, "
          + (f"after ~{a.warmup:g} s (at least {MIN_WARM_STEPS} steps) untimed" if a.warmup > 0
             else "no untimed steps")
          + f"; load average {load:.1f} -> {load2:.1f}")
    for n in names:
        med = statistics.median(res[n])
        extra = f"  (first steps incl. compilation: {comp[n]:.1f} s wall)" if n in comp else ""
        print(f"  {n:10s} {med:9.2f} run-steps/s (median)  rounds {min(res[n]):.2f}-{max(res[n]):.2f}{extra}")
    # Ratios of run-steps per second (a stacked variant's steps advance all its runs).
    for n in names:
        for base in ("eager", "compiled", "paper", "paper-loop", "paper-code", "fused", "fused-aten", "fused-autograd"):
            if n != base and base in res and not (n in ("eager", "compiled", "paper", "paper-loop", "paper-code",
                                                        "fused-aten", "fused-autograd") and base == "fused") and \
                    (base not in ("fused-aten", "fused-autograd") or n == "fused"):
                ratios = [x / y for x, y in zip(res[n], res[base])]
                print(f"  {n} / {base}: {statistics.median(ratios):.2f}x "
                      f"(round ratios {min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
