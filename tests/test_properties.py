"""Property-based tests: every usable backend against the float64 oracle on random calls.

Hypothesis draws the shapes (GQA ratios, lengths 0 to 24, head dims), the memory layout, the
scale, causal, key lengths, and every mode the backend's ``features`` declare (bool and float
masks of every broadcast shape, mask gradients, dropout, top-left alignment, windows), and
``check_against_reference`` judges out, lse and the gradients by the tolerance rule of
docs/contract.md, with its round-off floor (tensors of a handful of elements: see there).

CI runs a few hundred examples in all, derandomized (the same examples every run).
``MHAKERN_SLOW=1 pytest tests/test_properties.py`` runs 20 times as many, randomly, with
Hypothesis's example database to replay failures.
"""
from __future__ import annotations

import math

import pytest
import torch

import mhakern
from attn_testing import DEVICE, check_against_reference, dtypes_of, make_inputs, usable_backends
from mhakern import backends

hypothesis = pytest.importorskip("hypothesis", reason="the property tests need hypothesis (pip install hypothesis)")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from conftest import SLOW  # noqa: E402
# Examples per backend in CI: the interpreter runs every Triton program in Python.
EXAMPLES = {"reference": 50, "cpu": 90, "triton": 12}
DEFAULT_EXAMPLES = 50


def _mask_shape(draw, B, H, Lq, Lk):
    return draw(st.sampled_from([(Lk,), (Lq, Lk), (1, H, 1, Lk), (B, 1, Lq, Lk), (B, H, Lq, Lk), (H, Lq, 1), (Lq, 1)]))


def _draw_call(data, name):
    draw = data.draw
    be = backends.get(name)
    feats = be.features
    dtype = draw(st.sampled_from(dtypes_of(name)), label="dtype")
    Hkv = draw(st.integers(1, 3), label="Hkv")
    H = Hkv * draw(st.integers(1, 3), label="group")
    B = draw(st.integers(1, 3), label="B")
    Lq = draw(st.integers(1, 24), label="Lq")
    Lk = draw(st.integers(0, 24), label="Lk")
    D = draw(st.sampled_from([1, 8, 16, 24, 32, 40, 64]), label="D")
    Dv = draw(st.sampled_from([D, D, 8, 16, 48]), label="Dv")
    layout = draw(st.sampled_from(["bhld", "blhd"]), label="layout")
    causal = draw(st.booleans(), label="causal")
    kl = draw(st.none() | st.lists(st.integers(0, Lk), min_size=B, max_size=B), label="key_lengths")
    scale = draw(st.none() | st.floats(-2.0, 2.0, allow_nan=False), label="scale")
    kw = {}
    if "top_left" in feats and draw(st.booleans(), label="top_left"):
        kw["causal_align"] = "top_left"
    if "window" in feats and draw(st.booleans(), label="windowed"):
        kw["window"] = (draw(st.integers(-1, 8), label="left"), draw(st.integers(-1, 8), label="right"))
    if "dropout" in feats and draw(st.booleans(), label="dropout"):
        kw["dropout_p"] = draw(st.sampled_from([0.1, 0.5, 0.9]), label="p")
        kw["generator"] = torch.Generator().manual_seed(draw(st.integers(0, 2**32), label="dropout seed"))
    if "attn_mask" in feats and draw(st.booleans(), label="masked"):
        shape = _mask_shape(draw, B, H, Lq, Lk)
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**16), label="mask seed"))
        if draw(st.booleans(), label="bool mask"):
            kw["attn_mask"] = (torch.rand(shape, generator=g) > draw(st.sampled_from([0.2, 0.6]))).to(DEVICE)
        else:
            m = torch.randn(shape, generator=g) * 2
            m = m.masked_fill(torch.rand(shape, generator=g) < 0.15, -math.inf)
            grad = "mask_grad" in feats and draw(st.booleans(), label="mask grad")
            kw["attn_mask"] = m.to(DEVICE).requires_grad_(grad)
    seed = draw(st.integers(0, 2**16), label="input seed")
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, Dv, dtype=dtype, device=DEVICE, layout=layout, seed=seed)
    kl_t = None if kl is None else torch.tensor(kl, device=DEVICE)
    return q, k, v, causal, kl_t, scale, kw


@pytest.mark.parametrize("name", usable_backends())
def test_random_calls_match_the_float64_oracle(name):
    n = EXAMPLES.get(name, DEFAULT_EXAMPLES) * (20 if SLOW else 1)

    @settings(
        max_examples=n,
        deadline=None,
        derandomize=not SLOW,
        database=None if not SLOW else hypothesis.settings.default.database,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )
    @given(st.data())
    def run(data):
        q, k, v, causal, kl, scale, kw = _draw_call(data, name)
        hypothesis.assume(backends.get(name).supports(q, k, v, causal, kl) is None)
        check_against_reference(
            lambda *a, **x: mhakern.attention(*a, backend=name, **x), q, k, v, causal, kl, scale,
            roundoff_floor=True, **kw,
        )

    run()
