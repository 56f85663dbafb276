"""benchmarks/trainer_grid.py: a paper grid trained as far as a time budget allows (issue 34,
What 4: for a lent GPU's last minutes; device-generic, so it is tested here on the CPU)."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import trainer_grid as tg  # noqa: E402
from mhakern.memorize import presets, sweep  # noqa: E402


def test_every_prefix_of_the_order_spans_the_axis():
    vals = [1, 5, 10, 20, 30, 40, 50, 60]
    # The middle, the ends, then the midpoint of the widest gap left: (1, 30) before (30, 60).
    assert tg.bisection_order(vals) == [30, 1, 60, 10, 40, 5, 20, 50]
    assert tg.bisection_order(list(reversed(vals))) == [30, 1, 60, 10, 40, 5, 20, 50]
    assert tg.bisection_order([7]) == [7] and tg.bisection_order([3, 1]) == [1, 3]
    assert tg.bisection_order([1, 2, 4, 8]) == [4, 1, 8, 2]


def test_the_paper_grid_runs_smallest_t_first_then_its_values_in_bisection_order():
    p = presets.get("paper-heads")
    cfgs = [c for pt in p.parts for c in sweep.expand_grid(pt.base, pt.grid, p.seeds)]
    axis, order = tg.ordered_runs(cfgs)
    assert axis == "heads" and len(order) == len(cfgs) == 80
    assert [(c.heads, c.T, c.data) for c in order[:4]] == [(30, 10_000, "shared"), (1, 10_000, "shared"),
                                                           (60, 10_000, "shared"), (10, 10_000, "shared")]
    assert [c.T for c in order] == sorted(c.T for c in order)
    random = [c for c in cfgs if c.data == "random"]
    _, order = tg.ordered_runs(random)
    assert [(c.heads, c.T) for c in order[:3]] == [(30, 30_000), (1, 30_000), (60, 30_000)]


def _grid(tmp_path, budget, *extra):
    out = tmp_path / "grid.md"
    r = subprocess.run([sys.executable, "-m", "benchmarks.trainer_grid", "--preset", "quick", "--budget-s", str(budget),
                        "--out", str(out), "--threads", "1", *extra], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    return r, out


def test_a_budget_too_small_for_any_run_still_writes_what_it_skipped(tmp_path):
    r, out = _grid(tmp_path, 1)
    assert r.returncode == 0, r.stderr[-2000:]
    text = out.read_text()
    assert "0 runs in" in text and text.count("the budget was spent") == 12, text
    r, _ = _grid(tmp_path, 3, "--data", "shared")
    assert r.returncode == 2 and "--preset: quick has no sweep over shared data" in r.stderr


def test_several_grids_get_a_table_each(tmp_path):
    r, out = _grid(tmp_path, 1, "--preset", "quick,trend-context")
    assert r.returncode == 0, r.stderr[-2000:]
    text = out.read_text()
    quick, context = text.split("## quick (random data)")[1].split("## trend-context (random data)")
    assert quick.count("the budget was spent") == 12 and "| heads | T |" in quick
    # Every run of every series listed (d_v 1, 4, 16 at H 4 and d_v 1 at H 16), none dropped.
    assert context.count("the budget was spent") == 144 and "| context | T |" in context
    for series in ("H 4, d_h 16, d_v 1, random", "H 4, d_h 16, d_v 16, random", "H 16, d_h 16, d_v 1, random"):
        assert context.count(f"T 512, {series}, seed 0") == 6, series


def test_no_run_is_dropped_where_a_field_outside_the_series_differs():
    import dataclasses

    base = presets.get("quick").parts[0].base
    cfgs = [dataclasses.replace(base, heads=h, dist=dist) for h in (1, 2, 4) for dist in ("uniform", "gaussian")]
    axis, order = tg.ordered_runs(cfgs)
    assert axis == "heads" and sorted(map(id, order)) == sorted(map(id, cfgs))


def test_a_grid_with_series_keeps_them_apart():
    p = presets.get("trend-dhead")
    cfgs = [c for pt in p.parts for c in sweep.expand_grid(pt.base, pt.grid, p.seeds)]
    axis, order = tg.ordered_runs(cfgs, "d_head")
    assert axis == "d_head" and sorted(map(id, order)) == sorted(map(id, cfgs))
    first = [(c.d_head, tg.series(c, axis)) for c in order[:4]]
    assert first == [(8, "H 4, n 16, d_v 1, random"), (2, "H 4, n 16, d_v 1, random"),
                     (16, "H 4, n 16, d_v 1, random"), (4, "H 4, n 16, d_v 1, random")], first


@pytest.mark.slow  # two runs of the quick preset: about 15 s
def test_the_runs_that_fit_are_trained_stored_and_tabled(tmp_path):
    from mhakern.memorize.store import ResultStore

    r, out = _grid(tmp_path, 15, "--db", str(tmp_path / "g.sqlite"))
    assert r.returncode == 0, r.stderr[-2000:]
    text = out.read_text()
    rows = re.findall(r"^\| (\d+) \| 500 \| n 8, d_h 16, d_v 1, random \| 0 \| 3000 / 3000 \| ([\d.]+) \| (\d+) \|",
                      text, re.M)
    assert [h for h, _, _ in rows][:2] == ["4", "1"], text  # bisection order: the middle, then the ends
    for _, acc, ex in rows:
        assert int(ex) == round(float(acc) * 500)
    with ResultStore(str(tmp_path / "g.sqlite")) as st:
        assert len(st.runs("quick-grid")) == len(rows)
