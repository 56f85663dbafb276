"""The conformance suite of mhakern.flex_attention (issue 32, What 4): every named mod of
tests/flex_cases.py on every flex backend usable in this process, against the float64 reference
by the tolerance rule (docs/contract.md) -- forward, lse and gradients, a learnable table's
included -- and against torch's eager flex_attention (forward and lse, CPU float32); the
backward bit-identical run to run on each backend.

Parametrized as tests/test_conformance.py is, over (backend, dtype) pairs and the cases:
``cpu`` (the traced modifiers compiled into C++, when a C++ compiler is present), ``triton`` (on
a GPU, or through Triton's interpreter on CPU tensors -- tests/conftest.py sets TRITON_INTERPRET=1
without one -- at each case's small shape) and ``reference`` (plain PyTorch, dense). The device
check's Triton flex step runs this file's ``triton`` tests on a GPU.
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("torch.nn.attention.flex_attention")

import flex_cases as fc  # noqa: E402

import mhakern  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _unusable(backend: str):
    """Why ``backend`` cannot serve flex in this process, or None."""
    if backend == "cpu":
        from mhakern.flex import build

        return None if build.compiler() else "no C++ compiler (set CXX)"
    if backend == "triton":
        from mhakern.flex import triton_backend

        return triton_backend.unusable(torch.zeros(1, device=DEVICE))
    return None


BACKENDS = [b for b in ("cpu", "triton", "reference") if _unusable(b) is None]
# The devices and dtypes each backend serves (the reference is the float32 torch math the rule
# bounds the others by: its half-precision runs would only repeat that math).
_DEVICE = {"cpu": "cpu", "triton": DEVICE, "reference": "cpu"}
_DTYPES = {"cpu": (torch.float32, torch.bfloat16), "triton": (torch.float32, torch.float16, torch.bfloat16),
           "reference": (torch.float32,)}


def _ready(backend: str) -> str:
    """The device ``backend`` runs on, its kernels for the named mods compiled first (the cpu
    kernel's in one compiler run, when a cpu test runs first: the device check's GPU step
    selects only Triton's)."""
    if backend == "cpu":
        fc.precompile_cpu()
    return _DEVICE[backend]


def _param(backend: str, case: fc.Case, dtype=torch.float32):
    """(backend, case at the size the backend runs it, dtype), marked slow or skipped as the case says."""
    small = backend == "reference" or (backend == "triton" and INTERPRETED)
    slow = backend in case.slow and (backend != "triton" or INTERPRETED)
    if small and case.small is None:
        return pytest.param(backend, case, dtype, id=f"{backend}-{case.name}",
                            marks=pytest.mark.skip(reason="no interpreter-sized shape for this case"))
    return pytest.param(backend, case.sized(small), dtype, id=f"{backend}-{case.name}",
                        marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("backend, case, dtype", [_param(b, c) for b in BACKENDS for c in fc.CASES])
def test_named_mods(backend, case, dtype):
    fc.check(case, backend, dtype, _ready(backend))


@pytest.mark.parametrize("backend, case, dtype", [_param(b, c, dt) for b in BACKENDS for c, dt in fc.HALF_CASES
                                                  if dt in _DTYPES[b]])
def test_half_inputs(backend, case, dtype):
    fc.check(case, backend, dtype, _ready(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_bit_identical(backend):
    """Two runs give the same bits: out, lse and the gradients of q, k, v and the table (the cpu
    kernel and Triton sum in a fixed order, with no atomics)."""
    case = fc.BY_NAME["rel_bias"].sized(backend == "reference" or (backend == "triton" and INTERPRETED))
    q, k, v, do, t = fc.inputs(case, seed=3)
    dev = _ready(backend)
    q, k, v, do = (x.to(dev) for x in (q, k, v, do))
    t = fc.on(t, dev)
    score_mod, _ = fc.mods(case, t)
    res = [fc.run(fc.flex_call(backend, score_mod, None, False), q, k, v, do, fc.leaves(case, t)) for _ in range(2)]
    assert mhakern.last_backend() == backend
    (o1, l1, g1), (o2, l2, g2) = res
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)

