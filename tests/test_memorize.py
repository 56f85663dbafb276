"""The memorization trainer: model forms, data, optimiser and training.

Fast by design (the whole file runs in well under a minute on 2 cores): tiny shapes, one
thread (the trainer's ops are small; see docs/trainer.md).
"""
import math

import pytest
import torch

from mhakern.memorize import data as D
from mhakern.memorize.config import ConfigError, RunConfig
from mhakern.memorize.model import ModelShape, StackedParams, folded_forward, paper_forward, sinusoidal_positions
from mhakern.memorize.optim import BatchedAdam, lr_factor
from mhakern.memorize.train import _Sampler, train_stack


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _setup(data, d_v, dtype=torch.float64, Ts=(10, 7), heads=3, d_head=4):
    cfg = RunConfig(heads=heads, context=5, d_model=8, d_in=6, d_head=d_head, d_value=d_v, T=max(Ts), data=data)
    P = StackedParams.init(ModelShape.of(cfg), [0, 1], dtype=dtype)
    task = D.TaskData([0, 1], list(Ts), 5, 6, data=data, dtype=dtype)
    q, c, y = task.batch(None)
    pe = sinusoidal_positions(6, 8, dtype)
    return P, q, c, y, pe


def _out_and_grads(P, fn):
    for p in P.tensors():
        p.grad = None
    out = fn()
    # A loss that weighs every logit differently, so that no gradient cancels by symmetry.
    w = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    (out * w).sum().backward()
    return out.detach(), [p.grad.detach().clone() for p in P.tensors()]


@pytest.mark.parametrize("data", ["random", "shared"])
@pytest.mark.parametrize("d_v", [1, 3])
def test_folded_and_paper_forms_agree_in_outputs_and_gradients(data, d_v):
    P, q, c, y, pe = _setup(data, d_v)
    ref_out, ref_g = _out_and_grads(P, lambda: paper_forward(P, q, c, pe))
    eager_out, eager_g = _out_and_grads(P, lambda: folded_forward(P, q, c, pe, attn="eager"))
    fused_out, fused_g = _out_and_grads(P, lambda: folded_forward(P, q, c, pe, attn="fused", backend="reference"))
    # Eager folding is the same algebra in float64: agreement to rounding.
    assert torch.allclose(eager_out, ref_out, rtol=0, atol=1e-12)
    for a, b in zip(eager_g, ref_g):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-12)
    # The fused path goes through the backend contract, whose lse is float32 (the backward
    # recomputes probabilities from it): outputs exact, gradients to float32 precision.
    assert torch.allclose(fused_out, ref_out, rtol=0, atol=1e-12)
    for name, a, b in zip(("W_E", "b_E", "W_Q", "W_K", "W_V", "W_O", "W_D", "b_D"), fused_g, ref_g):
        scale = b.abs().max().item() + 1e-30
        assert (a - b).abs().max().item() <= 1e-5 * scale, name
    # and the gradients are not trivially zero
    assert all(g.abs().max() > 0 for g in ref_g)


def test_fused_float32_is_as_accurate_as_eager_float32():
    """Tolerance rule of the project: fused error <= 3 x eager-math error + atol (vs float64)."""
    P64, q, c, y, pe = _setup("random", 1)
    ref_out, ref_g = _out_and_grads(P64, lambda: paper_forward(P64, q, c, pe))
    P32 = StackedParams({k: v.detach().float().requires_grad_(True) for k, v in P64.t.items()})
    q32, c32, pe32 = q.float(), c.float(), pe.float()
    e_out, e_g = _out_and_grads(P32, lambda: folded_forward(P32, q32, c32, pe32, attn="eager"))
    f_out, f_g = _out_and_grads(P32, lambda: folded_forward(P32, q32, c32, pe32, attn="fused", backend="reference"))
    err = lambda a, b: (a.double() - b).abs().max().item()  # noqa: E731
    assert err(f_out, ref_out) <= 2 * err(e_out, ref_out) + 1e-5
    for a, e, r in zip(f_g, e_g, ref_g):
        assert err(a, r) <= 3 * err(e, r) + 1e-5


def test_heads_layout_gives_the_rows_layout_numbers():
    P, q, c, y, pe = _setup("random", 2)
    a = folded_forward(P, q, c, pe, backend="reference", layout="rows")
    b = folded_forward(P, q, c, pe, backend="reference", layout="heads")
    assert torch.allclose(a, b, rtol=0, atol=1e-12)


def test_padded_heads_train_exactly_as_alone():
    """Runs of different H share a stack by zero-padding; the padding must change nothing."""
    small = RunConfig(heads=1, d_head=3, context=4, d_model=8, T=40, steps=30, eval_every=10, seed=3, dtype="float64")
    big = RunConfig(heads=4, context=4, d_model=8, T=64, steps=30, eval_every=10, seed=5, dtype="float64")
    alone = train_stack([small], progress=False)[0]
    together = train_stack([small, big], progress=False)
    # pytest.approx compares flat sequences only (pytest >= 9.2 refuses nested tuples): flatten.
    assert [len(h) for h in together[0].history] == [len(h) for h in alone.history]
    flat = [x for h in together[0].history for x in h]
    assert flat == pytest.approx([x for h in alone.history for x in h], rel=1e-9, abs=1e-12)
    assert together[1].config.heads == 4 and together[1].steps_done == 30


def test_batched_adam_equals_independent_torch_adams():
    torch.manual_seed(0)
    init = torch.randn(2, 5, 3, dtype=torch.float64)
    x = init.clone().requires_grad_(True)
    opt = BatchedAdam([x])
    refs = [init[r].clone().requires_grad_(True) for r in range(2)]
    topts = [torch.optim.Adam([refs[r]], lr=1.0) for r in range(2)]
    totals = (7, 12)
    for step in range(7):
        lr = torch.tensor([1e-2 * lr_factor(step, totals[r]) for r in range(2)], dtype=torch.float64)
        target = torch.sin(torch.arange(15, dtype=torch.float64) + step).view(5, 3)
        opt.zero_grad()
        ((x - target) ** 3).sum().backward()
        opt.step(lr)
        for r in range(2):
            topts[r].zero_grad()
            ((refs[r] - target) ** 3).sum().backward()
            for g in topts[r].param_groups:
                g["lr"] = float(lr[r])
            topts[r].step()
    for r in range(2):
        assert torch.allclose(x[r].detach(), refs[r].detach(), rtol=1e-12, atol=1e-14)


def test_lr_schedule_warms_up_from_one_percent_then_decays_to_zero():
    total = 1000
    assert lr_factor(0, total) == pytest.approx(0.01)
    assert lr_factor(50, total) == pytest.approx(1.0)
    assert lr_factor(25, total) == pytest.approx(0.01 + 0.99 * 0.5)
    assert lr_factor(525, total) == pytest.approx(0.5, abs=1e-9)
    assert lr_factor(total, total) == pytest.approx(0.0, abs=1e-12)
    vals = [lr_factor(s, total) for s in range(50, total)]
    assert all(a >= b for a, b in zip(vals, vals[1:]))


# ---------------------------------------------------------------------------- data
def test_hash_uniforms_look_uniform_and_are_deterministic():
    base = torch.tensor([D.stream_base(7, 1)], dtype=torch.int64)
    idx = torch.arange(200_000, dtype=torch.int64).view(1, -1)
    u = D.uniform(base, idx, torch.float64)
    assert torch.equal(u, D.uniform(base, idx, torch.float64))
    assert 0 <= u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.005
    assert abs(u.var().item() - 1 / 12) < 0.002
    # neighbouring indices are uncorrelated, and another seed gives other numbers
    assert abs(torch.corrcoef(torch.stack([u[0, :-1], u[0, 1:]]))[0, 1].item()) < 0.01
    other = D.uniform(torch.tensor([D.stream_base(8, 1)]), idx, torch.float64)
    assert (other != u).float().mean() > 0.99
    g = D.gaussian(base, base + 1, idx)
    assert abs(g.mean().item()) < 0.01 and abs(g.std().item() - 1) < 0.01


@pytest.mark.parametrize("data", ["random", "shared"])
def test_tasks_are_nested_in_T_and_generation_matches_materialisation(data):
    big = D.TaskData([3, 4], [50, 50], 6, 5, data=data, materialize=True)
    small = D.TaskData([3, 4], [20, 20], 6, 5, data=data, materialize=True)
    lazy = D.TaskData([3, 4], [50, 50], 6, 5, data=data, materialize=False)
    qb, cb, yb = big.batch(None)
    qs, cs, ys = small.batch(None)
    ql, cl, yl = lazy.batch(None)
    assert torch.equal(qb[:, :20], qs) and torch.equal(yb[:, :20], ys)
    assert torch.equal(qb, ql) and torch.equal(cb, cl) and torch.equal(yb, yl)
    if data == "random":
        assert torch.equal(cb[:, :20], cs) and cb.shape == (2, 50, 6, 5)
    else:
        assert torch.equal(cb, cs) and cb.shape == (2, 6, 5)
    # a subset of runs and examples
    idx = torch.tensor([[3, 1, 4]])
    runs = torch.tensor([1])
    q1, c1, y1 = big.batch(idx, runs)
    q2, c2, y2 = lazy.batch(idx, runs)
    assert torch.equal(q1, qb[1:2, [3, 1, 4]]) and torch.equal(q1, q2) and torch.equal(c1, c2) and torch.equal(y1, y2)
    assert yb.min() >= 0 and yb.max() < 100 and (qb[0] != qb[1]).any()


def test_sampler_visits_every_example_once_per_epoch():
    s = _Sampler([0, 1], [10, 4], batch=5, device="cpu")
    act = [0, 1]
    act_t = torch.tensor(act)
    seen = []
    for _ in range(2):  # one epoch of run 0 (2 batches of 5)
        idx, w = s.next(act, act_t)
        seen.append(idx[0])
        # run 1 has T=4 <= batch: full batch, padded slot weighted 0
        assert sorted(idx[1][:4].tolist()) == [0, 1, 2, 3] and w[1].tolist() == [1, 1, 1, 1, 0]
    assert sorted(torch.cat(seen).tolist()) == list(range(10))
    idx, _ = s.next(act, act_t)
    assert not torch.equal(idx[0], seen[0])  # a new epoch, a new order


# ---------------------------------------------------------------------------- training
def test_small_random_task_is_memorized_to_100_percent():
    cfgs = [RunConfig(heads=4, context=4, d_model=16, T=32, steps=1500, eval_every=50, seed=s) for s in (0, 1)]
    res = train_stack(cfgs, progress=False)
    for r in res:
        assert r.mem_acc == 1.0 and r.stopped_early and r.steps_done < 1500
        assert r.history[-1][1] == 1.0


def test_more_heads_memorize_more_examples():
    cfgs = [RunConfig(heads=H, context=4, d_model=8, T=120, steps=500, eval_every=100, seed=s) for H in (1, 8) for s in (0, 1)]
    res = train_stack(cfgs, progress=False)
    one = sum(r.examples for r in res if r.config.heads == 1) / 2
    eight = sum(r.examples for r in res if r.config.heads == 8) / 2
    assert eight > 2.5 * one, (one, eight)
    # and a seed's run stacked with others is the run it would be alone (up to the rounding
    # of differently batched matmuls, which may flip an example or two)
    alone = train_stack([cfgs[0]], progress=False)[0]
    assert abs(alone.examples - res[0].examples) <= 2


def test_regression_task_trains_and_reports_accuracy_within_tolerance():
    cfg = RunConfig(heads=2, context=3, d_model=8, T=16, steps=300, eval_every=100, task="regress", reg_tol=0.05, seed=1)
    r = train_stack([cfg], progress=False)[0]
    assert 0.0 <= r.mem_acc <= 1.0 and math.isfinite(r.loss)
    assert r.history[-1][2] < r.history[0][2] or r.mem_acc == 1.0


def test_configuration_errors_name_the_flag():
    with pytest.raises(ConfigError, match="--heads"):
        RunConfig(heads=0).validate()
    with pytest.raises(ConfigError, match="--data"):
        RunConfig(data="fixed").validate()
    with pytest.raises(ConfigError, match="--target-acc"):
        RunConfig(target_acc=1.5).validate()
    with pytest.raises(ConfigError, match="--backend"):
        train_stack([RunConfig(backend="no-such-backend", steps=1, T=4)], progress=False)
    # the paper's step rule
    assert RunConfig(T=100_000, batch=256).total_steps == math.ceil(500 * 100_000 / 256)
    assert RunConfig(T=1000).total_steps == 50_000
