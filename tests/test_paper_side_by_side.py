"""benchmarks/paper_side_by_side.py: the trainer beside the paper's own code.

The comparison's arithmetic and its resumable record run everywhere (mhakern's side only, at a
few steps); the paper's side needs a checkout of smahdavi4/attention-memorization named by
``MHAKERN_PAPER_SRC`` and, being a minute of its training, ``MHAKERN_SLOW=1``.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks import paper_side_by_side as sbs  # noqa: E402


def test_welch_t_by_hand():
    a, b = [10.0, 12.0, 14.0], [9.0, 10.0, 11.0, 12.0]
    se = math.sqrt(statistics.variance(a) / 3 + statistics.variance(b) / 4)
    assert sbs.welch_t(a, b) == pytest.approx((12.0 - 10.5) / se)
    assert sbs.welch_t(b, a) == pytest.approx(-(12.0 - 10.5) / se)
    assert math.isnan(sbs.welch_t([1.0], b))  # one run: no variance
    assert math.isnan(sbs.welch_t([2.0, 2.0], [2.0, 2.0]))  # no spread


def test_mhakern_side_records_and_resumes(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sbs, "STEPS", 40)
    monkeypatch.setattr(sbs, "EVAL_EVERY", 20)
    out = str(tmp_path / "runs.jsonl")
    args = ["--side", "mhakern", "--configs", "h3,regress", "--seeds", "2", "--out", out]
    assert sbs.main(args) == 0
    rows = [json.loads(line) for line in open(out)]
    assert sorted((r["config"], r["seed"]) for r in rows) == [("h3", 0), ("h3", 1), ("regress", 0), ("regress", 1)]
    assert all(r["side"] == "mhakern" and 0.0 <= r["mem_acc"] <= 1.0 and r["mem_loss"] > 0 for r in rows)
    table = capsys.readouterr().out
    # Classification reads examples memorized (mem_acc x T), regression the kept checkpoint's MSE.
    h3 = [r for r in rows if r["config"] == "h3"]
    mean = statistics.fmean(r["mem_acc"] * 500 for r in h3)
    assert f"| {mean:.4g} (" in table and "examples memorized of 500" in table and "training MSE" in table
    # A rerun finds every run recorded and trains nothing.
    assert sbs.main(args) == 0
    assert len(open(out).read().splitlines()) == 4
    assert "mhakern h3:" not in capsys.readouterr().out


def test_unknown_configuration_is_named(tmp_path):
    with pytest.raises(SystemExit):
        sbs.main(["--side", "mhakern", "--configs", "h3,nope", "--out", str(tmp_path / "x.jsonl")])


@pytest.mark.skipif(not (os.environ.get("MHAKERN_PAPER_SRC") and os.environ.get("MHAKERN_SLOW") == "1"),
                    reason="needs MHAKERN_PAPER_SRC and MHAKERN_SLOW=1 (a minute of the paper's training)")
def test_paper_side_reproduces_the_papers_own_run():
    # docs/results.md section 1: the paper's code fits 276 examples at H = 8, seed 0, run to run.
    r = sbs._paper_run("quick-h8", 0)
    assert round(r["mem_acc"] * 500) == 276
