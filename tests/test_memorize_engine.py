"""The trainer's step engine (``train.StepEngine``) and the stack memory planner.

On the CPU the engine runs its step eagerly: the same code that CUDA captures as a graph. These
tests check that it trains exactly as the plain per-step loop (bit for bit: same histories,
checkpoints and stopping points), that its steps read nothing back to the host (counted with
patched torch functions), and the planner with faked memory sizes. The capture itself needs a
GPU (skipped without one). Tiny shapes, one thread: a few seconds in all.
"""
import dataclasses

import pytest
import torch

from mhakern.memorize import train as T
from mhakern.memorize.config import RunConfig


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def _same_results(cfgs, **kw):
    loop = T.train_stack(cfgs, progress=False, engine=False, **kw)
    eng = T.train_stack(cfgs, progress=False, engine=True, **kw)
    for a, b in zip(loop, eng):
        assert a.history == b.history  # exact: every evaluation's accuracy and loss
        assert (a.mem_acc, a.best_acc, a.final_acc, a.loss, a.steps_done, a.stopped_early) == (
            b.mem_acc, b.best_acc, b.final_acc, b.loss, b.steps_done, b.stopped_early)
    return eng


STACKS = {
    # partial last batches (T not a multiple of the batch), epochs crossing evaluation points
    "partial-batches": [RunConfig(heads=2, context=4, d_model=8, T=40, batch=16, steps=60, eval_every=20, seed=s)
                        for s in (0, 1, 2, 3)],
    # runs leave the stack at different steps (early stop at a lower target); float64, eager
    "drops": [RunConfig(heads=4, context=4, d_model=8, T=32, steps=300, eval_every=13, lr=1e-2, dtype="float64",
                        impl="eager", target_acc=0.5, seed=s) for s in (0, 1, 2)],
    # float32 runs leaving the stack: the one-sweep Adam on a stack that shrinks
    "drops-float32": [RunConfig(heads=2, context=4, d_model=8, T=32, steps=200, eval_every=13, lr=1e-2,
                                target_acc=0.5, seed=s) for s in (0, 1, 2)],
    # shared context, regression (no early stop), on-the-fly data generation
    "regress-shared-generated": [RunConfig(heads=2, context=3, d_model=8, T=50, batch=8, steps=70, eval_every=30,
                                           task="regress", data="shared", seed=1)],
}


@pytest.mark.parametrize("name", list(STACKS))
def test_engine_trains_exactly_as_the_per_step_loop(name):
    kw = dict(data_max_bytes=0) if "generated" in name else {}
    res = _same_results(STACKS[name], **kw)
    if name.startswith("drops"):
        assert len({r.steps_done for r in res}) > 1  # they did leave at different steps


def test_engine_crosses_segments_and_epochs_exactly():
    # Segments shorter than the evaluation interval, epochs spanning segment boundaries.
    cfgs = [RunConfig(heads=2, context=4, d_model=8, T=21, batch=8, steps=45, eval_every=40, eval_last=True, seed=s)
            for s in (5, 6)]
    loop = T.train_stack(cfgs, progress=False, engine=False)
    st = T._Stack(cfgs, "cpu", "rows", 2 << 30)
    eng = T.StepEngine(st, segment=7)
    for n in (1, 9, 35):  # the loop's evaluation points: after steps 1, 10 (no), 41 -> compare at 45
        eng.run(n)
    accs, losses = st.evaluate([0, 1])
    assert [h[-1] for h in (r.history for r in loop)] == [(45, a, l) for a, l in zip(accs, losses)]


def test_step_counter_indices_equal_the_block_indices():
    """The captured step (CUDA) computes its batch from the step counter; eager steps take theirs
    from blocks of steps. The same batches, so the same weights, on a stack with partial batches
    and epochs crossing a segment."""
    cfgs = STACKS["partial-batches"][:2]
    engines = [T.StepEngine(T._Stack(cfgs, "cpu", "rows", 2 << 30), segment=7) for _ in range(2)]
    engines[0].run(17)
    e = engines[1]
    for s0, n in ((0, 7), (7, 7), (14, 3)):
        e._fill_segment(s0, n)
        for _ in range(n):
            e._step()
    for a, b in zip(engines[0].st.P.tensors(), e.st.P.tensors()):
        assert torch.equal(a, b)


class _Counter:
    """Counts calls that read a tensor's value on the host (on CUDA each is a device sync)."""

    NAMES = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self, monkeypatch):
        self.n = 0
        for name in self.NAMES:
            orig = getattr(torch.Tensor, name)

            def wrapped(t, *a, _orig=orig, **k):
                self.n += 1
                return _orig(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, wrapped)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: self._sync())

    def _sync(self):
        self.n += 1


def test_engine_steps_read_nothing_back(monkeypatch):
    cfgs = STACKS["partial-batches"]
    st = T._Stack(cfgs, "cpu", "rows", 2 << 30)
    eng = T.StepEngine(st, segment=64)
    eng.run(2)  # first calls (backend selection caches) outside the count
    count = _Counter(monkeypatch)
    eng.run(50)
    assert count.n == 0


def test_host_reads_grow_with_evaluations_not_steps(monkeypatch):
    def reads(steps):
        cfg = RunConfig(heads=2, context=4, d_model=8, T=40, batch=16, steps=steps, eval_every=1000, seed=0)
        count = _Counter(monkeypatch)
        T.train_stack([cfg], progress=False)
        monkeypatch.undo()
        return count.n

    # one evaluation (after step 1) in both; 10x the steps
    n = reads(20)
    assert n > 0 and reads(200) == n


# ---------------------------------------------------------------------------- planner
def test_planner_sizes_stacks_to_the_memory_given():
    cfgs = [RunConfig(heads=20, context=32, d_model=64, T=30_000, seed=s) for s in range(4)]
    per = T.run_footprint_bytes(cfgs)
    lots = 1 << 62  # tasks always stored
    assert T.max_stack_runs(cfgs, free_bytes=10 * per, reserve=0.0, data_max_bytes=lots) == 10
    assert T.max_stack_runs(cfgs, free_bytes=10 * per, reserve=0.15, data_max_bytes=lots) == 8
    assert T.max_stack_runs(cfgs, free_bytes=per // 2, data_max_bytes=lots) == 1  # never below one run
    # more heads, more bytes; a generated task costs no storage
    assert T.run_footprint_bytes([dataclasses.replace(c, heads=60) for c in cfgs]) > per
    gen = T.run_footprint_bytes(cfgs, stored=False)
    assert gen == per - T.task_bytes(cfgs)
    # Stored tasks limited to 3 runs' worth: a larger stack generates its batches instead, and
    # fits as many runs as the generated footprint allows.
    three = 3 * T.task_bytes(cfgs)
    assert T.max_stack_runs(cfgs, free_bytes=10 * per, reserve=0.0, data_max_bytes=three) == 10 * per // gen
    # ... unless so few would fit that the stack stores its tasks after all (2 runs' tasks are
    # under the limit, so a stack of 2 stores them and does not fit twice the generated size)
    assert T.max_stack_runs(cfgs, free_bytes=2 * gen, reserve=0.0, data_max_bytes=three) == 1


def test_planner_reads_the_cuda_free_memory(monkeypatch):
    cfgs = [RunConfig(heads=4, context=8, d_model=16, T=500, seed=0)]
    per = T.run_footprint_bytes(cfgs)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * per, 200 * per))
    assert T.max_stack_runs(cfgs, "cuda", reserve=0.0, data_max_bytes=1 << 62) == 100


def test_a_stack_larger_than_memory_trains_as_sub_stacks():
    cfgs = [RunConfig(heads=2, context=4, d_model=8, T=16, steps=5, eval_every=5, seed=s) for s in range(3)]
    per = T.run_footprint_bytes(cfgs)
    res = T.train_stack(cfgs, progress=False, free_bytes=int(2.5 * per))
    assert [r.stack_size for r in res] == [2, 2, 1]
    assert [r.config.seed for r in res] == [0, 1, 2]


# ---------------------------------------------------------------------------- CUDA graphs
@pytest.mark.gpu  # tests/conftest.py skips it without a CUDA device
def test_captured_step_matches_the_eager_step_on_cuda():
    cfgs = [RunConfig(heads=4, context=8, d_model=16, T=t, batch=32, steps=60, eval_every=20, seed=s)
            for s, t in ((0, 50), (1, 100))]

    def train(capture):
        st = T._Stack(cfgs, "cuda", "rows", 2 << 30)
        eng = T.StepEngine(st, segment=16, capture=capture)
        eng.run(60)
        return [p.detach().cpu() for p in st.P.tensors()], eng

    eager, _ = train(False)
    graph, eng = train(True)
    assert eng.graph is not None
    for a, b in zip(eager, graph):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu  # tests/conftest.py skips it without a CUDA device
def test_captured_steps_do_not_sync_on_cuda():
    cfgs = [RunConfig(heads=4, context=8, d_model=16, T=100, batch=32, steps=100, seed=s) for s in (0, 1)]
    st = T._Stack(cfgs, "cuda", "rows", 2 << 30)
    eng = T.StepEngine(st, segment=32)
    eng.run(32)  # capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eng.run(64)  # refills and replays: any synchronizing call raises
    finally:
        torch.cuda.set_sync_debug_mode("default")
    res = T.train_stack(cfgs, device="cuda", progress=False)
    assert all(r.steps_done == 100 for r in res)


# ---------------------------------------------------------------------------- Adam in one sweep
def _adam_case(seed=0):
    """Stacked parameters (runs first) whose per-run lengths leave tails past whole 8- and 16-lane
    vectors (1, 3, 4 elements) and cross the kernel's 16,384-element chunks, gradients with exact
    zeros, and two strided gradients laid out as autograd gives the trainer's W_Q and W_K
    gradients."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(3, 5, 7), (2, 64, 5, 16), (2, 5, 16, 16), (1, 20001), (2, 100), (3, 1, 1)]
    params = [torch.randn(s, generator=g) for s in shapes]
    grads = []
    for step in range(4):
        gs = [torch.randn(s, generator=g) * 10.0 ** -(step + 1) for s in shapes]
        gs[0].view(-1)[::5] = 0.0
        gs[1] = (gs[1].permute(0, 2, 1, 3).contiguous()).permute(0, 2, 1, 3)  # strides of W_Q's gradient
        gs[2] = gs[2].transpose(2, 3).contiguous().transpose(2, 3)  # and of W_K's
        grads.append(gs)
    return params, grads


def _run_adam(params, grads, step_fn):
    import math

    ps = [p.clone() for p in params]
    m, v = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    ss = torch.tensor([[1e-3], [5e-4], [2e-2]])
    for t, gs in enumerate(grads, start=1):
        sb = torch.tensor([math.sqrt(1 - 0.999**t)])
        for i in range(len(ps)):
            step_fn([ps[i]], [gs[i]], [m[i]], [v[i]], sb, ss[: ps[i].shape[0]])
    return ps + m + v


def test_fused_adam_gives_the_foreach_passes_bits():
    """The engine's one-sweep Adam (csrc/cpu/adam.cpp) against PyTorch's foreach passes, bit for
    bit, with the variant the engine picks on this host; the other variant differs (so the check
    that picks it can tell them apart)."""
    from mhakern.memorize import optim

    params, grads = _adam_case()
    variant = optim.fused_adam_variant(params)
    if variant is None:
        pytest.skip("the one-sweep Adam does not reproduce ATen's kernels on this host (the engine keeps foreach)")
    ref = _run_adam(params, grads, lambda *a: optim.adam_foreach(*a, 0.9, 0.999, 1e-8))
    fused = _run_adam(params, grads, lambda *a: optim.adam_fused(*a, 0.9, 0.999, 1e-8, variant))
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(ref, fused))
    try:
        other = _run_adam(params, grads, lambda *a: optim.adam_fused(*a, 0.9, 0.999, 1e-8, not variant))
    except RuntimeError:
        return  # the fma variant is not built for this CPU
    assert not all(torch.equal(a, b) for a, b in zip(ref, other))
    st = T._Stack(STACKS["partial-batches"], "cpu", "rows", 2 << 30)
    assert T.StepEngine(st).fused_adam is variant
    st64 = T._Stack(STACKS["drops"], "cpu", "rows", 2 << 30)
    assert T.StepEngine(st64).fused_adam is None  # float64: the foreach passes


def test_fused_adam_names_its_bad_arguments():
    from mhakern.memorize import optim

    p = [torch.zeros(2, 3), torch.zeros(2, 4)]
    if optim.fused_adam_variant(p) is None:
        pytest.skip("no one-sweep Adam on this host")
    op = torch.ops.mhakern_C.adam_step_
    ss, sb = torch.ones(2), torch.ones(1)

    def call(params=p, grads=p, m=p, v=p, step_size=ss, sqrt_bc2=sb, w=0.1):
        op(params, grads, m, v, step_size, sqrt_bc2, w, 0.001, 0.999, 1e-8, False)

    with pytest.raises(RuntimeError, match=r"params\[1\] must be a contiguous float32"):
        call(params=[p[0], torch.zeros(2, 4, dtype=torch.float64)])
    with pytest.raises(RuntimeError, match=r"grads\[1\] has shape \[2, 5\], params\[1\] \[2, 4\]"):
        call(grads=[p[0], torch.zeros(2, 5)])
    with pytest.raises(RuntimeError, match="exp_avg has 1 tensors, params 2"):
        call(m=[p[0]])
    with pytest.raises(RuntimeError, match=r"step_size must be a float32 CPU tensor of shape \(R,\)"):
        call(step_size=torch.ones(2, 2))
    with pytest.raises(RuntimeError, match=r"params\[0\] must have the runs \(3\) as its first dim"):
        call(step_size=torch.ones(3))
    with pytest.raises(RuntimeError, match="lerp_weight"):
        call(w=0.6)


def test_fused_adam_reproduces_the_portable_kernels_too():
    """Under ATEN_CPU_CAPABILITY=default ATen's kernels use no fused multiply-add: the check picks
    the other variant there, and the engine still trains exactly as the per-step loop."""
    import os
    import subprocess
    import sys

    code = (
        "import torch; torch.set_num_threads(1)\n"
        "from mhakern.memorize import optim, train as T\n"
        "from mhakern.memorize.config import RunConfig\n"
        "cfgs = [RunConfig(heads=2, context=4, d_model=8, T=40, batch=16, steps=60, eval_every=20, seed=s)"
        " for s in (0, 1)]\n"
        "st = T._Stack(cfgs, 'cpu', 'rows', 1 << 30)\n"
        "print(torch.backends.cpu.get_cpu_capability(), T.StepEngine(st).fused_adam)\n"
        "a = T.train_stack(cfgs, progress=False, engine=False)\n"
        "b = T.train_stack(cfgs, progress=False, engine=True)\n"
        "print([x.history == y.history for x, y in zip(a, b)])\n"
    )
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    cap, variant = out.stdout.splitlines()[0].split()
    assert cap == "DEFAULT" and variant in ("False", "None")
    assert out.stdout.splitlines()[1] == "[True, True]"


# ---------------------------------------------------------------------------- direct attention op
@pytest.mark.parametrize("data", ["random", "shared"])
@pytest.mark.parametrize("layout", ["rows", "heads"])
def test_direct_op_attention_equals_mhakern_attention_and_the_paper_form(data, layout):
    """The trainer's own autograd Function over torch.ops.mhakern_C gives mhakern.attention's
    numbers (bit for bit: same kernels) and the paper's function."""
    import mhakern
    from mhakern.memorize import model as M

    cfg = RunConfig(heads=3, context=5, d_model=16, d_in=6, d_head=4, d_value=2, T=9, data=data)
    P = M.StackedParams.init(M.ModelShape.of(cfg), [0, 1])
    task = T.data_mod.TaskData([0, 1], [9, 7], 5, 6, data=data)
    q, c, _ = task.batch(None)
    pe = M.sinusoidal_positions(6, 16)

    def out_and_grads(fn):
        for p in P.tensors():
            p.grad = None
        out = fn()
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return [out.detach()] + [p.grad.clone() for p in P.tensors()]

    direct = out_and_grads(lambda: M.folded_forward(P, q, c, pe, backend="cpu", layout=layout))
    orig = M._context_attention
    try:
        M._context_attention = lambda q_, C_, s_, b_: mhakern.attention(q_, C_, C_, scale=s_, backend=b_)
        generic = out_and_grads(lambda: M.folded_forward(P, q, c, pe, backend="cpu", layout=layout))
    finally:
        M._context_attention = orig
    paper = out_and_grads(lambda: M.paper_forward(P, q, c, pe))
    for a, g, p in zip(direct, generic, paper):
        assert torch.equal(a, g)
        torch.testing.assert_close(a, p, rtol=2e-5, atol=2e-6)


# ---------------------------------------------------------------------------- exact stacking
def test_a_run_stores_the_same_numbers_alone_and_in_a_mixed_sweep(tmp_path):
    """A run's stored loss, accuracies and history do not depend on what it was stacked with
    (bit for bit): here one run alone against the same run in a sweep of mixed H and T, with
    seeds that stop early beside it (a stack that shrinks) and a T below the batch."""
    from mhakern.memorize.store import ResultStore
    from mhakern.memorize.sweep import expand_grid, run_sweep

    base = RunConfig(heads=2, context=4, d_model=8, T=8, batch=16, steps=400, eval_every=50, seed=2)
    grid = expand_grid(base, {"heads": [2, 4], "T": [8, 24]}, seeds=[2, 3, 4])
    mixed = ResultStore(str(tmp_path / "mixed.sqlite"))
    run_sweep(grid, mixed, "mixed", progress=False)
    alone = ResultStore(str(tmp_path / "alone.sqlite"))
    run_sweep([base], alone, "alone", progress=False, max_stack=1)
    a, m = alone.run_by_key(base.key()), mixed.run_by_key(base.key())
    fields = ("loss", "mem_acc", "best_acc", "final_acc", "steps_done", "history")
    assert {f: a[f] for f in fields} == {f: m[f] for f in fields}
    assert m["stack_size"] == 3 and a["stack_size"] == 1


# ---------------------------------------------------------------------------- the paper's estimand
def test_default_evaluation_points_are_the_papers():
    """After steps 1, 501, 1001, ... (the paper's step % 500 == 0 on 0-based steps) and not after
    the last step; --eval-last adds that one."""
    cfg = RunConfig(heads=2, context=4, d_model=8, T=16, steps=1200, early_stop=False, seed=0)
    assert cfg.eval_every == 500 and not cfg.eval_last
    r = T.train_stack([cfg], progress=False)[0]
    assert [h[0] for h in r.history] == [1, 501, 1001] and r.steps_done == 1200
    assert r.final_acc == r.history[-1][1]
    last = T.train_stack([dataclasses.replace(cfg, eval_last=True)], progress=False)[0]
    assert [h[0] for h in last.history] == [1, 501, 1001, 1200]
    assert last.history[:3] == r.history  # the same run up to there


def test_trend_presets_sweep_T_with_at_least_500_epochs_at_every_T():
    """The trend presets are sweeps over T (the paper's estimand, not capacity searches), and
    the step rule gives every T at least 500 epochs of ceil(T / batch) batches (the last
    partial batch kept)."""
    from mhakern.memorize import presets
    from mhakern.memorize.sweep import expand_grid

    for name in ("trend-heads", "trend-context", "trend-dhead"):
        pre = presets.get(name)
        for part in pre.parts:
            assert part.kind == "sweep" and len(part.grid["T"]) >= 2
            for c in expand_grid(part.base, part.grid, pre.seeds):
                assert c.steps is None  # the paper's rule, max(floor(500 T / batch), floor)
                epochs = c.total_steps / -(-c.T // c.batch)
                assert epochs >= 500, (name, c.label(), c.T, epochs)
                assert c.eval_every == 500 and not c.eval_last
