"""tools/perf_model.py: the static performance model behind docs/performance.md's predictions.

No nvcc, no GPU: the forward's SASS terms are given as the model reads them from the two builds
(the measured 2-stage build and the 3 + 3 split persistent one, nvcc 13.0), and the backward has
no SASS input. What is held: each prediction is made at two product rates that are what the
documentation says they are, the calibration reproduces the measured rows at either rate, and the
backward's dispatch and ordered-dQ model behaves as its docstring says on shapes small enough to
follow by hand.
"""
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def pm():
    spec = importlib.util.spec_from_file_location("perf_model", ROOT / "tools" / "perf_model.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


# loop_terms of the two builds' bf16 D 128 forward (tools/perf_model.py on their cuobjdump -sass).
MEASURED_TERMS = {"executed": 646, "W": 66, "P": 935, "split_kv": False, "exps_between": 0, "exps": 66}
HEAD_TERMS = {"executed": 455, "W": 774, "P": 154, "split_kv": True, "exps_between": 66, "exps": 66}


def test_the_two_rates_are_the_documented_assumptions(pm):
    c, o = pm.RATES["conservative"], pm.RATES["optimistic"]
    assert c["fwd"] == pytest.approx(648.0 / 782.0) and c["bwd"] == pytest.approx(561.0 / 782.0)
    assert o["fwd"] == 1.0
    assert o["bwd"] == pytest.approx(1.0 / (0.6 / 0.85 + 0.4))  # SS products at 85%, RS at 100%
    for p in ("fwd", "bwd"):
        assert 0.0 < c[p] < o[p] <= 1.0
    assert pm.tg_us(fraction=0.5) == pytest.approx(2 * pm.tg_us())


@pytest.mark.parametrize("rate", ["conservative", "optimistic"])
def test_the_fit_reproduces_its_two_rows_at_each_rate(pm, rate):
    fr = pm.RATES[rate]["fwd"]
    lam, F = pm.fit(MEASURED_TERMS, fr)
    for key in [("self", 1, 16, 16384, False), ("self", 4, 16, 4096, False)]:
        kind, B, H, L, causal = key
        ms = pm.run_ms(kind, B, H, L, causal, MEASURED_TERMS, 2, lam, F, False, None, fr)
        assert ms == pytest.approx(pm.MEASURED[key], rel=1e-9)
    # The rows fix 2 T_g + lam: a slower product leaves less exposed copy latency.
    lam_o, _ = pm.fit(MEASURED_TERMS, 1.0)
    assert lam == pytest.approx(lam_o - 2 * (pm.tg_us(fraction=fr) - pm.tg_us()))


def test_forward_predictions_bracket_by_rate(pm):
    builds = {"measured": MEASURED_TERMS, "head": HEAD_TERMS}
    cons, opt = (pm.forward_predictions(builds, r) for r in ("conservative", "optimistic"))
    for key in pm.MEASURED:
        c, o = cons["rows"][key], opt["rows"][key]
        assert c["head"] > o["head"]
        assert c["persistent"][0] < c["persistent"][1] and o["persistent"][0] < o["persistent"][1]
        assert c["persistent"][0] > o["persistent"][0]
    # The split persistent build is tensor-bound at both rates: its step is both warpgroups' products.
    for r in ("conservative", "optimistic"):
        fr = pm.RATES[r]["fwd"]
        lam, _ = pm.fit(MEASURED_TERMS, fr)
        T, terms = pm.step_us(HEAD_TERMS, 3, lam, True, fr)
        assert T == terms["tensor"] == pytest.approx(2 * pm.tg_us(fraction=fr))


def test_backward_one_cta_by_hand(pm):
    # L 128: one key block over two 64-row tiles; the add of each tile after its products, the
    # second tile's products not held up (the first add is done before they end), F at the end.
    for end in (0, 1):
        T = pm.bwd_step_us(1.0, pm.BWD_EXPOSED_US[end])
        want = 2 * T + pm.BWD_ADD_US[end] + pm.BWD_F_US
        for det in (False, True):
            assert pm.bwd_ms(1, 1, 128, False, 1.0, end, det) * 1e3 == pytest.approx(want)


def test_backward_ordered_adds(pm):
    T = pm.bwd_step_us(1.0, pm.BWD_EXPOSED_US[0])
    n_kb = 16  # one head, every key block on its own SM at once
    L = n_kb * pm.BWD_BLOCK_N
    n_mt = L // pm.BWD_BLOCK_M
    free = pm.bwd_ms(1, 1, L, False, 1.0, 0, False) * 1e3
    det = pm.bwd_ms(1, 1, L, False, 1.0, 0, True) * 1e3
    # Non-causal: key block n adds into row tile 0 after blocks 0..n-1, and keeps that lag.
    assert det == pytest.approx(free + (n_kb - 1) * pm.BWD_ADD_US[0])
    # Causal: the last key block starts at its diagonal row tile, which key block 0 reaches only
    # after all but its last few tiles: in the deterministic mode every block lasts about as
    # long as block 0, so the causal call takes the non-causal call's time.
    causal_free = pm.bwd_ms(1, 1, L, True, 1.0, 0, False) * 1e3
    causal_det = pm.bwd_ms(1, 1, L, True, 1.0, 0, True) * 1e3
    assert causal_free == pytest.approx(free)  # block 0 walks every row tile either way
    assert causal_det >= n_mt * T
    # Conservative slower than optimistic; the reported rate of a row by the convention.
    assert pm.bwd_ms(1, 1, L, False, pm.RATES["conservative"]["bwd"], 0) > pm.bwd_ms(
        1, 1, L, False, pm.RATES["optimistic"]["bwd"], 0)
    ms = pm.bwd_ms(1, 1, L, False, 1.0, 0)
    assert pm.tflops(1, 1, L, False, ms, 2.5) == pytest.approx(10 * L * L * 128 / ms / 1e9)


def test_backward_waves(pm):
    # More CTAs than SMs: a second wave, in block order on the first free SM.
    # Every CTA has the same work (its L / 64 row tiles): the call lasts two CTAs.
    L = (pm.SMS + 1) * pm.BWD_BLOCK_N
    per_cta = pm.bwd_ms(1, 1, L, False, 1.0, 0, False)
    T = pm.bwd_step_us(1.0, pm.BWD_EXPOSED_US[0])
    cta = (L // pm.BWD_BLOCK_M) * T + pm.BWD_ADD_US[0] + pm.BWD_F_US
    assert per_cta * 1e3 == pytest.approx(2 * cta)


def test_fwd_bwd_combination(pm):
    assert pm.fwd_bwd_tflops(500.0, 500.0) == pytest.approx(500.0)
    # Time adds: 1 + 2.5 units of work at each pass's rate.
    assert pm.fwd_bwd_tflops(700.0, 400.0) == pytest.approx(3.5 / (1 / 700 + 2.5 / 400))


def test_main_needs_the_measured_build(pm, capsys):
    assert pm.main([]) == 2
    assert "--sass measured=FILE" in capsys.readouterr().err
