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
from mhakern.memorize.train import _Sampler, _Stack, _saturation, train_stack


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


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
    # The fused path goes through the backend contract, whose lse is float64 for float64
    # inputs (the backward recomputes probabilities from it): outputs and gradients to rounding.
    assert torch.allclose(fused_out, ref_out, rtol=0, atol=1e-12)
    for name, a, b in zip(("W_E", "b_E", "W_Q", "W_K", "W_V", "W_O", "W_D", "b_D"), fused_g, ref_g):
        scale = b.abs().max().item() + 1e-30
        assert (a - b).abs().max().item() <= 1e-9 * scale, name
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


def test_a_stack_refuses_runs_that_differ_in_more_than_their_seed():
    """A stack holds the seeds of one configuration (mixed H or T would round differently)."""
    base = RunConfig(heads=1, context=4, d_model=8, T=40, steps=30, eval_every=10, seed=3)
    for other in (dict(heads=4), dict(T=64), dict(d_head=4), dict(d_value=2)):
        with pytest.raises(ValueError, match="differ in more than their seed"):
            train_stack([base, RunConfig(**{**base.__dict__, **other, "seed": 5})], progress=False)


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
    res = train_stack(cfgs[:2], progress=False) + train_stack(cfgs[2:], progress=False)
    one = sum(r.examples for r in res if r.config.heads == 1) / 2
    eight = sum(r.examples for r in res if r.config.heads == 8) / 2
    assert eight > 2.5 * one, (one, eight)
    # and a seed's run stacked with others is the run it would be alone, bit for bit
    alone = train_stack([cfgs[0]], progress=False)[0]
    assert (alone.history, alone.loss, alone.mem_acc) == (res[0].history, res[0].loss, res[0].mem_acc)


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
    assert RunConfig(T=100_000, batch=256).total_steps == 500 * 100_000 // 256  # main.py rounds down
    assert RunConfig(T=1000).total_steps == 50_000


# ---------------------------------------------------------------------------- paper fidelity
class _PaperFormModel(torch.nn.Module):
    """The paper's model in the paper's own parameter layouts (attn_models.py): an nn.Linear
    embedding, per-head Wq, Wk (H, d, d_h) and Wv (H, d, d_v), Wo (H d_v, d), an nn.Linear
    decoder; every token attends tokens 1..n; token 0's output is decoded. Written here from the
    paper's description so that our weights can be loaded into it by name and layout."""

    def __init__(self, d_in, d, H, dh, dv, C):
        super().__init__()
        self.embedding = torch.nn.Linear(d_in, d, dtype=torch.float64)
        self.Wq = torch.nn.Parameter(torch.empty(H, d, dh, dtype=torch.float64))
        self.Wk = torch.nn.Parameter(torch.empty(H, d, dh, dtype=torch.float64))
        self.Wv = torch.nn.Parameter(torch.empty(H, d, dv, dtype=torch.float64))
        self.Wo = torch.nn.Parameter(torch.empty(H * dv, d, dtype=torch.float64))
        self.decoder = torch.nn.Linear(d, C, dtype=torch.float64)

    def load_from(self, P, r):
        H = self.Wq.shape[0]
        with torch.no_grad():
            self.embedding.weight.copy_(P["W_E"][r].T)
            self.embedding.bias.copy_(P["b_E"][r])
            self.Wq.copy_(P["W_Q"][r].permute(1, 0, 2))
            self.Wk.copy_(P["W_K"][r])
            self.Wv.copy_(P["W_V"][r])
            self.Wo.copy_(P["W_O"][r])
            self.decoder.weight.copy_(P["W_D"][r].T)
            self.decoder.bias.copy_(P["b_D"][r])
        assert self.Wo.shape[0] == H * self.Wv.shape[2]

    def forward(self, x, pe):  # x (b, n+1, d_in)
        t = self.embedding(x) + pe
        d = t.shape[-1]
        Q, K, V = (t[:, None] @ W[None] for W in (self.Wq, self.Wk, self.Wv))  # (b, H, n+1, .)
        s = Q @ K.transpose(2, 3) / math.sqrt(d)
        s[..., 0] = float("-inf")  # no token attends to position 0
        o = (torch.softmax(s, -1) @ V).transpose(1, 2).reshape(x.shape[0], x.shape[1], -1) @ self.Wo
        return self.decoder(o)[:, 0]


def test_paper_initialisation_in_the_paper_layouts():
    """init="paper" (the default) draws as the paper's code: per-head Xavier over (d, d_h) for
    W_Q, W_K and (d, d_v) for W_V, Xavier over (H d_v, d) for W_O, nn.Linear defaults (weights
    and random biases in +-1/sqrt(fan_in)) for the embedding and the decoder."""
    H, n, d, d_in, dh, dv, C = 20, 5, 64, 48, 64, 1, 100
    cfg = RunConfig(heads=H, context=n, d_model=d, d_in=d_in, d_head=dh, d_value=dv, classes=C)
    assert cfg.init == "paper"
    P = StackedParams.init(ModelShape.of(cfg), [0, 1], dtype=torch.float64)
    m = _PaperFormModel(d_in, d, H, dh, dv, C)
    m.load_from(P, 0)
    # The same weights give the same function in the paper's layouts and in ours.
    task = D.TaskData([0, 1], [16, 16], n, d_in, dtype=torch.float64)
    q, c, _ = task.batch(None)
    pe = sinusoidal_positions(n + 1, d, torch.float64)
    ours = paper_forward(StackedParams({k: v.detach() for k, v in P.t.items()}), q, c, pe)[0]
    theirs = m(torch.cat([q[0].unsqueeze(1), c[0]], 1), pe)
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-12)

    def check_uniform(w, bound, what):
        # U(-bound, bound): inside the bound, reaching near it, with variance bound^2 / 3.
        w = w.detach().flatten()
        assert w.abs().max() <= bound, what
        assert w.abs().max() >= 0.9 * bound, what
        assert abs(w.var().item() / (bound**2 / 3) - 1) < 0.25, (what, w.var().item(), bound**2 / 3)

    xq = math.sqrt(6 / (d + dh))
    for h in range(H):
        check_uniform(m.Wq[h], xq, f"Wq[{h}]")
        check_uniform(m.Wk[h], xq, f"Wk[{h}]")
        check_uniform(m.Wv[h], math.sqrt(6 / (d + dv)), f"Wv[{h}]")
    # Per head, not per projection: a projection-wide Xavier would bound every weight by
    # sqrt(6 / (d + H d_h)), 0.31x the per-head bound at H = 20.
    assert m.Wq.abs().max() > 2 * math.sqrt(6 / (d + H * dh))
    check_uniform(m.Wo, math.sqrt(6 / (H * dv + d)), "Wo")
    check_uniform(m.embedding.weight, 1 / math.sqrt(d_in), "embedding.weight")
    check_uniform(m.embedding.bias, 1 / math.sqrt(d_in), "embedding.bias")
    check_uniform(m.decoder.weight, 1 / math.sqrt(d), "decoder.weight")
    check_uniform(m.decoder.bias, 1 / math.sqrt(d), "decoder.bias")
    # Heads are independent draws, runs are their seeds' own.
    assert not torch.equal(m.Wq[0], m.Wq[1])
    assert not torch.equal(P["W_Q"][0], P["W_Q"][1])
    # The previous initialisation stays selectable by name: zero biases, projection-wide fans.
    X = StackedParams.init(ModelShape.of(cfg), [0], dtype=torch.float64, init="xavier-proj")
    assert X["b_E"].abs().max() == 0 and X["b_D"].abs().max() == 0
    assert X["W_Q"].abs().max() <= math.sqrt(6 / (d + H * dh))
    with pytest.raises(ConfigError, match="--init"):
        RunConfig(init="kaiming").validate()


def test_sampler_keeps_the_last_partial_batch_of_an_epoch():
    """As the paper's DataLoader(shuffle=True): T = 7 at batch 3 gives batches of 3, 3 and 1."""
    s = _Sampler([0], [7], batch=3, device="cpu")
    act_t = torch.tensor([0])
    got = []
    for k in range(3):
        idx, w = s.next([0], act_t)
        n = 3 if w is None else int(w.sum())
        assert n == (1 if k == 2 else 3)
        got += idx[0, :n].tolist()
    assert sorted(got) == list(range(7))
    idx, w = s.next([0], act_t)  # the next epoch starts with a full batch
    assert w is None


def test_checkpoint_evaluation_points_and_early_stop_follow_the_paper():
    """Evaluations after steps 1, 1 + E, ... (not the last); mem_acc is the lowest-loss
    evaluation's accuracy; early_stop=False trains the whole budget."""
    base = RunConfig(heads=4, context=4, d_model=16, T=32, steps=260, eval_every=50, seed=0)
    r = train_stack([base], progress=False)[0]
    steps = [h[0] for h in r.history]
    assert steps[:3] == [1, 51, 101]
    lo = min(r.history, key=lambda h: h[2])
    assert r.mem_acc == lo[1] and r.loss == lo[2]
    full = train_stack([RunConfig(**{**base.__dict__, "early_stop": False})], progress=False)[0]
    assert full.steps_done == 260 and not full.stopped_early
    assert [h[0] for h in full.history] == [1, 51, 101, 151, 201, 251]


def test_regression_by_default_trains_the_budget_and_reports_the_lowest_mse():
    """The paper's regression: no early stop, the lowest-MSE checkpoint; the |err| < reg_tol
    rule ("tol") may stop early."""
    mse = RunConfig(heads=2, context=3, d_model=8, T=8, steps=400, eval_every=50, task="regress", reg_tol=0.5, seed=1)
    assert mse.reg_rule == "mse" and not mse.stops_early
    r = train_stack([mse], progress=False)[0]
    assert r.steps_done == 400 and not r.stopped_early
    assert r.loss == min(h[2] for h in r.history)
    assert r.best_acc == 1.0  # every example within 0.5 long before the end: no stop all the same
    tol = RunConfig(**{**mse.__dict__, "reg_rule": "tol"})
    assert tol.key() != mse.key()
    t = train_stack([tol], progress=False)[0]
    assert t.stopped_early and t.mem_acc == 1.0 and t.steps_done < 400


def test_saturation_analysis_counts_heads_above_099():
    cfg = RunConfig(heads=3, context=4, d_model=8, T=20, steps=30, eval_every=10, data="shared",
                    early_stop=False, analysis=True, seed=2)
    r = train_stack([cfg], progress=False)[0]
    a = r.analysis
    assert a["threshold"] == 0.99 and len(a["saturated_heads_hist"]) == 4 and sum(a["saturated_heads_hist"]) == 20
    assert 0 <= a["frac_heads_saturated"] <= 1 and 0.25 <= a["mean_max_weight"] <= 1
    assert a["mean_saturated_heads"] == sum(k * c for k, c in enumerate(a["saturated_heads_hist"])) / 20
    # Known answers: zero queries attend uniformly (largest weight 1/n, nothing saturated);
    # queries scaled up a thousandfold make every head pick one key.
    st = _Stack([cfg], "cpu", "rows", 1 << 20)
    w = {k: v.detach()[0].clone() for k, v in st.P.t.items()}
    flat = _saturation(st, 0, dict(w, W_Q=torch.zeros_like(w["W_Q"])))
    assert flat["saturated_heads_hist"] == [20, 0, 0, 0] and flat["mean_max_weight"] == pytest.approx(1 / 4)
    sharp = _saturation(st, 0, dict(w, W_Q=w["W_Q"] * 1000))
    assert sharp["frac_heads_saturated"] > 0.9 and sharp["mean_max_weight"] > 0.98
    assert train_stack([RunConfig(**{**cfg.__dict__, "analysis": False})], progress=False)[0].analysis is None
