"""What a child of the device check tells its parent, and the faults a rehearsal plants in it.

A child (a smoke check, a bit-identity kernel, a pytest process through
benchmarks/device_pytest_plugin.py) appends one JSON object a line to the file named by
``DEVICE_CHECK_RECORDS``: ``start`` (a case begins: its name, family, pass), ``phase`` (the case
enters its backward or leaves it), ``fail`` (a case failed: a wrong answer with the error and the
bound of the tolerance rule, or an exception), ``end``. The parent reads the file after the child
ends or is killed: a case started and never ended is the one that hung (or crashed).
Lines are written and flushed one at a time, so a kill loses none that were written.

``DEVICE_CHECK_CHILD_PLANT`` (set by the parent for the first child of the planted step only):
``hang`` makes the child hang at its first case; ``wrong`` perturbs the first result that the
tolerance rule checks (tests/attn_testing.py rule_check), so that the rule itself reports it.
"""
from __future__ import annotations

import json
import os
import re
import time
from typing import Optional, Tuple

RECORDS_ENV = "DEVICE_CHECK_RECORDS"
PLANT_ENV = "DEVICE_CHECK_CHILD_PLANT"
_GRAD_NAMES = ("dq", "dk", "dv", "dmask", "dsinks", "dalibi")


def record(ev: str, **kw) -> None:
    path = os.environ.get(RECORDS_ENV)
    if not path:
        return
    kw.update(ev=ev, pid=os.getpid(), t=round(time.time(), 3))
    with open(path, "a") as f:
        f.write(json.dumps(kw) + "\n")
        f.flush()


def planted() -> str:
    return os.environ.get(PLANT_ENV, "")


def hang_if_planted(case: str) -> None:
    """The planted hang: the case never returns (the parent's watchdog must kill it)."""
    if planted() == "hang":
        record("planted", what="hang", case=case)
        while True:
            time.sleep(3600)


def install_wrong_plant(*modules) -> None:
    """The planted wrong answer: the first rule_check call sees its result moved by 1 (far
    outside any bound of the rule), in attn_testing and in every module given that imported it."""
    if planted() != "wrong":
        return
    import attn_testing

    original = attn_testing.rule_check
    state = {"done": False}

    def perturbed(name, got, *a, **kw):
        if not state["done"]:
            state["done"] = True
            record("planted", what="wrong", check=name)
            got = got.detach().double() + 1.0
        return original(name, got, *a, **kw)

    attn_testing.rule_check = perturbed
    for m in modules:
        if getattr(m, "rule_check", None) is original:
            m.rule_check = perturbed


_NUM = r"([-+0-9.eE]+|nan|inf)"


def parse_failure(msg: str, default_pass: str) -> Tuple[str, str, str, str]:
    """(kind, pass, error, bound) of a failure message: kind ``wrong`` for the tolerance rule's
    message (tests/attn_testing.py rule_check: 'NAME: max error E at ... = BOUND (kernel ...'),
    or a non-finite / lse / identity mismatch; ``error`` otherwise."""
    first = (msg or "").strip().splitlines()[0] if (msg or "").strip() else ""
    name = first.split(":", 1)[0].strip()
    ps = "bwd" if name in _GRAD_NAMES else ("fwd" if name in ("out", "lse") else default_pass)
    m = re.search(rf"max error {_NUM} .*= {_NUM} \(kernel", first)
    if m:
        return "wrong", ps, m.group(1), m.group(2)
    m = re.search(rf"max error {_NUM}", first)
    if m:
        return "wrong", ps, m.group(1), "-"
    if "non-finite" in first:
        return "wrong", ps, "nonfinite", "finite"
    if "-inf pattern" in first:
        return "wrong", ps, "lse_pattern", "reference_pattern"
    if "differ" in first:
        return "wrong", ps, "differs", "bit_identical"
    return "error", ps, "-", "-"


def token(s: str) -> str:
    """A case name as one token of a HUNG / WRONG line (no spaces)."""
    s = s.replace("tests/", "").replace("benchmarks/", "").replace(".py::", "::")
    return re.sub(r"\s+", "_", s) or "-"


def default_records(path: Optional[str]) -> None:
    if path:
        os.environ[RECORDS_ENV] = path
