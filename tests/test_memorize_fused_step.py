"""The step engine's gradients in one operator call (``memorize.fused_step``,
csrc/cpu/folded_step.cpp) against autograd's, bit for bit: where the engine takes the call, where
it must not, and that a call that disagrees with autograd is never used. One thread, small shapes
and one step at the paper's shape: a few seconds.
"""
import pytest
import torch

from mhakern.memorize import fused_step, products
from mhakern.memorize import train as T
from mhakern.memorize.config import RunConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

# Folded queries (model.folds) at batch 16: H d^2 d_h + b H d^2 < 2 b H d d_h.
SMALL = dict(heads=3, context=5, d_model=8, d_in=6, T=40, batch=16, steps=40, eval_every=15)


def _engine(cfgs, **kw):
    st = T._Stack(cfgs, "cpu", kw.pop("layout", "rows"), 2 << 30)
    return T.StepEngine(st, **kw)


def _need_op():
    if not fused_step._have_op():
        pytest.skip("the extension (folded_step_grads) is not built")


def _bits(ts):
    return [t.detach().contiguous().view(torch.int32).clone() for t in ts]


# A context per example, and one per run (at a context length whose products, on this host, take
# the micro-kernel: smaller ones keep ATen's calls there, and so autograd).
@pytest.mark.parametrize("shape", [SMALL, dict(SMALL, context=32, d_model=8, d_in=8, data="shared")],
                         ids=["random", "shared"])
def test_engine_takes_the_call_and_trains_as_autograd_bit_for_bit(shape):
    _need_op()
    cfgs = [RunConfig(**shape, seed=s) for s in (0, 1)]
    fast, slow = _engine(cfgs), _engine(cfgs)
    slow.fused = False  # autograd every step
    fast.run(1)
    if fast.fused is False:
        pytest.skip("the products do not run on the micro-kernel on this host (the engine keeps autograd)")
    key, _ = fast.fused
    assert fused_step.known(key)  # verified against autograd on its first step
    fast.run(29)
    slow.run(30)
    for a, b in zip(_bits(fast.st.P.tensors() + fast.m + fast.v), _bits(slow.st.P.tensors() + slow.m + slow.v)):
        assert torch.equal(a, b)


def test_whole_runs_agree_with_the_per_step_loop_while_runs_leave_the_stack(monkeypatch):
    # Runs stop early at different steps: the stack shrinks, the plan is made and verified again.
    _need_op()
    cfgs = [RunConfig(**{**SMALL, "steps": 300, "eval_every": 13}, lr=1e-2, target_acc=0.5, seed=s)
            for s in (0, 1, 2)]
    loop = T.train_stack(cfgs, progress=False, engine=False)
    runs_seen, real = set(), fused_step.grads

    def spy(P, *a):
        runs_seen.add(P.R)
        return real(P, *a)

    monkeypatch.setattr(fused_step, "grads", spy)
    eng = T.train_stack(cfgs, progress=False, engine=True)
    assert len({r.steps_done for r in eng}) > 1
    if not runs_seen:
        pytest.skip("the products do not run on the micro-kernel on this host (the engine keeps autograd)")
    assert len(runs_seen) > 1  # stacks of different sizes took the call
    for a, b in zip(loop, eng):
        assert a.history == b.history
        assert (a.mem_acc, a.loss, a.steps_done) == (b.mem_acc, b.loss, b.steps_done)


def test_at_the_papers_shape_the_call_is_planned_and_verified():
    _need_op()
    cfg = RunConfig(heads=20, context=32, d_model=64, T=300, batch=256, steps=10, seed=0)
    eng = _engine([cfg])
    eng.run(2)
    if eng.fused is False:
        pytest.skip("the products do not run on the micro-kernel on this host (the engine keeps autograd)")
    assert fused_step.known(eng.fused[0])


@pytest.mark.parametrize("change", [
    dict(impl="eager"), dict(task="regress"), dict(d_value=2), dict(layout="heads"),
    dict(dtype="float64"), dict(batch=2),  # b = 2: the queries through d_h (no fold)
])
def test_other_configurations_step_through_autograd(change):
    change = dict(change)
    layout = change.pop("layout", "rows")
    eng = _engine([RunConfig(**{**SMALL, **change}, seed=0)], layout=layout)
    eng.run(2)
    assert eng.fused is False


def test_inside_products_disabled_the_engine_steps_through_autograd(monkeypatch):
    _need_op()
    eng = _engine([RunConfig(**SMALL, seed=0)])
    eng.run(1)
    calls = []
    monkeypatch.setattr(fused_step, "grads", lambda *a: calls.append(1))
    with products.disabled():
        eng.run(2)
    assert not calls


def test_a_call_that_disagrees_with_autograd_is_never_used(monkeypatch):
    _need_op()
    real = fused_step.grads

    def off_by_one_ulp(*a):
        g = real(*a)
        g[5] = torch.nextafter(g[5], torch.full_like(g[5], float("inf")))
        return g

    monkeypatch.setattr(fused_step, "grads", off_by_one_ulp)
    monkeypatch.setattr(fused_step, "_VERIFIED", {})
    cfgs = [RunConfig(**SMALL, seed=3)]
    eng = _engine(cfgs)
    ref = _engine(cfgs)
    ref.fused = False
    eng.run(20)
    ref.run(20)
    if not fused_step._VERIFIED:
        pytest.skip("the products do not run on the micro-kernel on this host (no call was planned)")
    assert eng.fused is False and list(fused_step._VERIFIED.values()) == [False]
    assert all(torch.equal(a, b) for a, b in zip(_bits(eng.st.P.tensors()), _bits(ref.st.P.tensors())))


def test_the_operator_names_its_bad_arguments():
    _need_op()
    eng = _engine([RunConfig(**SMALL, seed=0)])
    st = eng.st
    q, c, y = st.data.batch(torch.zeros(1, 16, dtype=torch.long))
    w = torch.ones(1, 16)
    fields = list(torch.ops.mhakern_C.folded_step_fields())
    with pytest.raises(ValueError, match="plan must have"):
        torch.ops.mhakern_C.folded_step_grads(st.P.tensors(), q, c, y, w, st.pe, 0.5, [0])
    with pytest.raises(ValueError, match="params must be the 8 weights"):
        torch.ops.mhakern_C.folded_step_grads(st.P.tensors()[:3], q, c, y, w, st.pe, 0.5, [0] * len(fields))
    with pytest.raises(ValueError, match="ctx"):
        torch.ops.mhakern_C.folded_step_grads(st.P.tensors(), q, c[..., :-1], y, w, st.pe, 0.5, [0] * len(fields))
    with pytest.raises(ValueError, match="pe must be"):
        torch.ops.mhakern_C.folded_step_grads(st.P.tensors(), q, c, y, w, st.pe[:-1], 0.5, [0] * len(fields))
