"""pytest plugin of the device check's test steps (``-p benchmarks.device_pytest_plugin``).

Writes benchmarks/device_child.py's records for every test (``start`` before its setup,
``phase`` around each backward call, ``fail`` with the exception's first line, ``end``) so that
the parent names the test that hung, crashed or answered wrong, even after a kill. Under a
planted fault (device_child.PLANT_ENV): ``hang`` hangs the first test; ``wrong`` perturbs the
first result the tolerance rule checks; where the first test would skip for want of a GPU (a
rehearsal on a CPU machine) it runs instead one small reference-backend case on the CPU through
that same rule, so that the rule reports the planted error as it would a kernel's.
Inert without ``DEVICE_CHECK_RECORDS``.
"""
from __future__ import annotations

import os
import sys

import pytest

from benchmarks import device_child as dc

_state = {"case": "", "first": True}


def _wrap_backward():
    import torch

    def wrap(fn):
        def run(*a, **kw):
            dc.record("phase", case=_state["case"], **{"pass": "bwd"})
            try:
                return fn(*a, **kw)
            finally:
                dc.record("phase", case=_state["case"], **{"pass": "fwd"})

        return run

    torch.Tensor.backward = wrap(torch.Tensor.backward)
    torch.autograd.backward = wrap(torch.autograd.backward)
    torch.autograd.grad = wrap(torch.autograd.grad)


def pytest_configure(config):
    if os.environ.get(dc.RECORDS_ENV):
        _wrap_backward()


def pytest_collection_finish(session):
    if os.environ.get(dc.RECORDS_ENV):  # the count a fallback step's cap follows (device_check.py)
        dc.record("collected", n=len(session.items))
    if os.environ.get(dc.RECORDS_ENV) and dc.planted() == "wrong":
        dc.install_wrong_plant(*[m for m in list(sys.modules.values()) if m is not None and hasattr(m, "rule_check")])


def _canary():
    """One small CPU case through the tolerance rule (the planted wrong answer's carrier on a
    machine where the GPU tests skip)."""
    import attn_testing
    import torch

    import mhakern

    q, k, v = attn_testing.make_inputs(1, 2, 1, 9, 13, 16, dtype=torch.float32, device="cpu")
    attn_testing.check_against_reference(lambda *a, **kw: mhakern.attention(*a, backend="reference", **kw),
                                         q, k, v, True, None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if os.environ.get(dc.RECORDS_ENV):
        _state["case"] = item.nodeid
        dc.record("start", case=item.nodeid)
        if _state["first"]:
            _state["first"] = False
            dc.hang_if_planted(item.nodeid)
            if dc.planted() == "wrong" and any(m.name == "skip" for m in item.iter_markers()):
                try:
                    _canary()
                except AssertionError as e:
                    dc.record("fail", case=item.nodeid, exc="AssertionError", msg=str(e).splitlines()[0][:300])
    outcome = yield
    interrupted = outcome.excinfo is not None and issubclass(outcome.excinfo[0], KeyboardInterrupt)
    if os.environ.get(dc.RECORDS_ENV) and not interrupted:  # a test stopped by the watchdog did not end
        dc.record("end", case=item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if not os.environ.get(dc.RECORDS_ENV):
        return
    rep = outcome.get_result()
    if call.excinfo is not None and rep.failed:
        e = call.excinfo.value
        msg = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        dc.record("fail", case=item.nodeid, exc=type(e).__name__, msg=msg, when=call.when)
    elif rep.when == "call" or (rep.when == "setup" and rep.skipped):
        dc.record("outcome", case=item.nodeid, outcome=rep.outcome)
