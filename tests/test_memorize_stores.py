"""Memory stores: measured interference-to-signal ratios against their derivations."""
import math

import numpy as np
import pytest
import torch

import mhakern
from mhakern.memorize import stores as S


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def test_linear_store_isr_matches_its_formula():
    cv = S.measure_curve("linear", 64, [16, 64, 256], trials=64, queries=256)
    exact, formula = S.predicted_isr("linear", np.array(cv.M), 64, {})
    # sqrt((M - 1) / d_k) in expectation; sqrt(M / d_k) is the paper's rounding of it
    assert np.allclose(exact, np.sqrt((np.array(cv.M) - 1) / 64))
    assert np.allclose(formula, [0.5, 1.0, 2.0])
    for m, got, want in zip(cv.M, cv.isr, exact):
        assert abs(got - want) <= 0.05 * want, (m, got, want)
    # capacity where interference equals signal: about d_k
    assert 55 <= S.crossing(cv.M, cv.isr) <= 75


def test_constructed_mlp_stores_match_their_predictions():
    for store, param, M in (("mlp-relu", {"t": 0.0}, 128), ("mlp-relu", {"t": 0.2}, 2048), ("mlp-relu2", {}, 2048)):
        cv = S.measure_curve(store, 64, [M], param, trials=8, queries=128)
        exact, _ = S.predicted_isr(store, np.array([M]), 64, param)
        assert abs(cv.isr[0] - exact[0]) <= 0.1 * exact[0], (store, param, cv.isr[0], exact[0])


def test_sphere_moments_are_the_known_closed_forms():
    d = 64
    assert S.interference_moment("linear", d, {})[0] == pytest.approx(1 / d, rel=1e-4)
    assert S.interference_moment("mlp-poly2", d, {})[0] == pytest.approx(3 / (d * (d + 2)), rel=1e-4)
    assert S.interference_moment("mlp-relu2", d, {})[0] == pytest.approx(1.5 / (d * (d + 2)), rel=1e-4)
    assert S.interference_moment("mlp-relu", d, {"t": 0.0})[0] == pytest.approx(1 / (2 * d), rel=1e-4)
    # attention: E exp(a c) on the sphere is Gamma(d/2) (2/a)^(d/2-1) I_(d/2-1)(a); with the
    # Bessel series summed here directly
    a, nu = 16.0, d / 2 - 1
    series = sum((a / 2) ** (2 * k) / (math.factorial(k) * math.gamma(nu + k + 1)) for k in range(80))
    want = math.gamma(d / 2) * series
    got = math.exp(S._log_sphere_mean_exp(a, d))
    assert got == pytest.approx(want, rel=1e-4)
    # the paper's capacity at beta = sqrt(64): e^14 ~ 1.2 million (Gaussian approximation)
    assert S.predicted_capacity("attention", 64, {"beta": 8.0})[1] == pytest.approx(math.exp(14), rel=1e-9)


def test_attention_store_chunked_through_lse_is_exact():
    """Chunks combined through their lse give the softmax over all keys, and the signal weight
    read from the lse is the softmax weight of the query's own memory."""
    d, M, beta = 16, 300, 4.0
    cv = S.measure_curve("attention", d, [M], {"beta": beta}, trials=1, queries=32, chunk=37)
    mem = S.Memories(1, d, d, 0)
    K, V = mem.get(0, M)
    q = K[0, :32].double()
    p = torch.softmax(beta * q @ K[0].double().T, dim=-1)
    out = p @ V[0].double()
    sig = p.diagonal().unsqueeze(-1) * V[0, :32].double()
    interf = out - sig
    want = math.sqrt(float((interf**2).sum(-1).mean() / (sig**2).sum(-1).mean()))
    assert cv.isr[0] == pytest.approx(want, rel=1e-4)


def test_attention_store_isr_follows_the_prediction_at_small_d_k():
    d, beta = 16, 4.0
    pts = [256, 1024, 4096]
    cv = S.measure_curve("attention", d, pts, {"beta": beta}, trials=2, queries=256)
    exact, _ = S.predicted_isr("attention", np.array(pts), d, {"beta": beta})
    for got, want in zip(cv.isr, exact):
        assert abs(got - want) <= 0.12 * want, (got, want)
    assert cv.backend == mhakern.backends.select("auto", *(torch.empty(1, 1, 2, d),) * 3, False, None).name


def test_trained_mlp_store_recalls_few_memories_and_fails_on_many():
    cv = S.measure_trained_mlp(16, [8, 512], width=32, steps=600, lr=1e-2)
    assert cv.isr[0] < 0.3 and cv.recall[0] == 1.0
    assert cv.isr[1] > 1.0


def test_crossing_interpolates_in_log_space():
    assert S.crossing([10, 100], [0.5, 2.0]) == pytest.approx(10 ** 1.5)
    assert math.isnan(S.crossing([10, 100], [0.1, 0.9]))
    assert S.crossing([10, 100], [1.5, 3.0]) == 10
