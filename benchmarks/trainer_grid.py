"""As much of the paper's grids as a time budget allows, on the step engine; one markdown file out.

    python -m benchmarks.trainer_grid --preset paper-heads,paper-context --budget-s 140 --out grid.md

For a lent GPU's last minutes (issue 34, What 4). The paper's heads and context grids at its own
scale (d = d_in = d_h = 64, d_v = 1, batch 256, Adam 1e-3, its step rule: at least 50,000 steps)
are GPU days whole, and each of their runs trains alone (runs stack only when they differ in
their seed alone: ``RunConfig.stack_key``). So each grid's runs are ordered to cover it early:
the smallest T first, then the first seed, then each series the preset lists (d_v, H, the kind
of data), and within each the axis values in bisection order (the middle, the two ends, then
the points between), so that any prefix spans the axis. Several presets take turns, run by run,
so that a short budget samples each grid. A run is trained only if its projected time fits what
is left of the budget:

* the projection: the run's stack built and its first steps run (the CUDA graph capture), then
  timed for ``--measure-s``: its full step budget at that rate, with no early stop (an upper
  bound: a run that memorizes everything stops at its next evaluation);
* a run that does not fit is listed with its projection, and a cheaper one after it may still
  run; the measurements' own seconds count against the budget.

Each trained run goes through ``train_stack`` as a sweep's would (its evaluation points, kept
checkpoint and early stop), is stored in ``--db`` when given (``ResultStore``, experiment
``--experiment``, default PRESET-grid), and becomes a row of its grid's table: the axis value, T,
the series, the seed, steps done of its budget, mem_acc and examples memorized (mem_acc x T, the
paper's estimand), whether it stopped early, seconds and steps/s; the runs left out follow with
their projections. Device-generic: on a CPU it plans and trains the same way (the tests use the
small ``quick`` and ``trend-*`` presets).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mhakern.memorize import presets, sweep  # noqa: E402
from mhakern.memorize.config import RunConfig  # noqa: E402
from mhakern.memorize.train import device_name, stack_rate, train_stack, versions  # noqa: E402

AXES = ("heads", "context", "d_head")


def bisection_order(values: Sequence) -> List:
    """The values (sorted) in an order whose every prefix spans them: the middle, both ends,
    then the midpoints of the gaps left, the gap of most grid points first."""
    vals = sorted(values)
    if len(vals) <= 2:
        return vals
    out = [vals[len(vals) // 2], vals[0], vals[-1]]
    gaps = [(0, len(vals) // 2), (len(vals) // 2, len(vals) - 1)]
    while gaps:
        gaps.sort(key=lambda g: g[0] - g[1])  # widest first
        lo, hi = gaps.pop(0)
        if hi - lo < 2:
            continue
        mid = (lo + hi) // 2
        out.append(vals[mid])
        gaps += [(lo, mid), (mid, hi)]
    return out


# The fields that tell a grid's series apart (beside its axis), shown in each row.
SERIES = ("heads", "context", "d_head", "d_value", "data")


def series(c: RunConfig, axis: str) -> str:
    names = {"heads": "H", "context": "n", "d_head": "d_h", "d_value": "d_v", "data": ""}
    return ", ".join(f"{names[k]} {getattr(c, 'dh' if k == 'd_head' else k)}".strip() for k in SERIES if k != axis)


def ordered_runs(cfgs: Sequence[RunConfig], axis: Optional[str] = None) -> Tuple[str, List[RunConfig]]:
    """(the grid's axis, its runs in training order): the smallest T first, then the first
    seed, then each series (what else the grid varies: d_v, H, the data) in the order the
    preset lists them, and within each the axis values in :func:`bisection_order`. ``axis``
    (default: the first of AXES that varies) is what the preset's parts sweep."""
    axis = axis or next((a for a in AXES if len({getattr(c, a) for c in cfgs}) > 1), "heads")
    first: dict = {}
    groups: dict = {}
    for c in cfgs:
        key = series(c, axis)
        first.setdefault(key, len(first))
        # A list per value: configurations that differ in a field no series names stay apart.
        groups.setdefault((c.T, c.seed, first[key]), {}).setdefault(getattr(c, axis), []).append(c)
    out: List[RunConfig] = []
    for k in sorted(groups):
        out += [c for v in bisection_order(list(groups[k])) for c in groups[k][v]]
    return axis, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="paper-heads",
                    help="sweep presets, comma-separated (default paper-heads); several take turns, run by run")
    ap.add_argument("--data", default="random", help="random, shared or both (the presets' parts of that kind)")
    ap.add_argument("--budget-s", type=float, required=True, help="wall seconds for the measurements and the runs")
    ap.add_argument("--measure-s", type=float, default=1.0, help="timed seconds of each run's projection")
    ap.add_argument("--out", required=True, help="the markdown file to write")
    ap.add_argument("--db", default=None, help="also store each run in this results database")
    ap.add_argument("--experiment", default=None, help="tag stored with the runs (default: PRESET-grid)")
    ap.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads for torch (default 1)")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    if a.budget_s <= 0 or a.measure_s <= 0:
        ap.error("--budget-s, --measure-s: must be positive")
    if a.data not in ("random", "shared", "both"):
        ap.error(f"--data: expected random, shared or both, got {a.data!r}")
    names = [n for n in a.preset.split(",") if n]
    grids = []  # (preset, axis, runs in order)
    for name in names:
        if name not in presets.PRESETS:
            ap.error(f"--preset: unknown preset {name!r}; choose from {', '.join(presets.PRESETS)}")
        p = presets.get(name)
        parts = [pt for pt in p.parts if pt.kind == "sweep" and (a.data == "both" or pt.base.data == a.data)]
        if not parts:
            ap.error(f"--preset: {name} has no sweep over {a.data} data")
        swept = next((k for k in AXES if all(k in pt.grid for pt in parts)), None)
        grids.append((name, *ordered_runs([c for pt in parts for c in sweep.expand_grid(pt.base, pt.grid, p.seeds)],
                                          swept)))
    if not grids:
        ap.error("--preset: name at least one preset")
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        torch.set_num_threads(a.threads)
    # The grids take turns, one run each, so that a short budget samples every one of them.
    turns = [(g, cfg) for i in range(max(len(o) for _, _, o in grids)) for g in grids for cfg in g[2][i:i + 1]]
    store = None
    if a.db:
        from mhakern.memorize.store import ResultStore

        store = ResultStore(a.db)
    vers = versions()
    rows = {g[0]: [] for g in grids}
    skipped = {g[0]: [] for g in grids}
    say = lambda s: print(f"trainer_grid [{time.perf_counter() - t_start:5.0f}s]: {s}", flush=True)  # noqa: E731
    say(f"{', '.join(f'{n} ({len(o)} runs over {ax})' for n, ax, o in grids)}, {a.data} data, on "
        f"{device_name(device)}, budget {a.budget_s:.0f} s")
    for (name, axis, _), cfg in turns:
        left = a.budget_s - (time.perf_counter() - t_start)
        label = f"{name}: {_label(cfg, axis)}"
        if left < 2 * a.measure_s + 2:
            skipped[name].append((cfg, None, "the budget was spent"))
            continue
        rate = stack_rate([cfg], device, a.measure_s)
        need = cfg.total_steps / rate
        left = a.budget_s - (time.perf_counter() - t_start)
        if need > left:
            say(f"{label}: skipped, {cfg.total_steps} steps at {rate:.0f}/s need {need:.0f} s, {left:.0f} s left")
            skipped[name].append((cfg, need, f"{rate:.0f} steps/s"))
            continue
        say(f"{label}: {cfg.total_steps} steps at {rate:.0f}/s, at most {need:.0f} s")
        t = time.perf_counter()
        res = train_stack([cfg], device, progress=False)[0]
        if store is not None:
            store.add_run(res, a.experiment or f"{name}-grid", vers)
        rows[name].append((res, time.perf_counter() - t))
        say(f"{label}: mem_acc {res.mem_acc:.4f} ({res.examples:.0f} examples) after {res.steps_done} steps"
            f"{' (stopped early)' if res.stopped_early else ''} in {time.perf_counter() - t:.0f} s")
    if store is not None:
        store.close()
    write(a, grids, device, rows, skipped, time.perf_counter() - t_start)
    say(f"{sum(map(len, rows.values()))} runs trained, {sum(map(len, skipped.values()))} skipped; wrote {a.out}")
    return 0


def _label(c: RunConfig, axis: str) -> str:
    return f"{axis} {getattr(c, axis)}, T {c.T}, {series(c, axis)}, seed {c.seed}"


def _settings(c: RunConfig) -> str:
    """What a grid's runs share (its series and axis aside), from one of them."""
    steps = f"{c.steps} steps" if c.steps is not None else f"the paper's step rule (at least {c.min_steps} steps)"
    return (f"d {c.d_model}, d_in {c.din}, batch {c.batch}, lr {c.lr:g}, {c.task}, {steps}, "
            f"evaluated every {c.eval_every}")


def write(a, grids, device: torch.device, rows, skipped, wall: float) -> None:
    cmd = "python -m benchmarks.trainer_grid " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in (("preset", a.preset), ("data", a.data), ("budget_s", f"{a.budget_s:g}"),
                                                   ("measure_s", f"{a.measure_s:g}"), ("out", a.out)))
    n = sum(map(len, rows.values()))
    lines = [f"# Paper grids on {device_name(device)}: {n} runs in {wall:.0f} s of a {a.budget_s:g} s budget", "",
             f"torch {torch.__version__}; one table per grid, its runs in the order they trained; `{cmd}`"]
    for name, axis, order in grids:
        lines += ["", f"## {name} ({a.data} data)", "", f"{_settings(order[0])}.", "",
                  f"| {axis} | T | series | seed | steps done / budget | mem_acc | examples memorized | stopped early "
                  "| s | steps/s |", "|---|---|---|---|---|---|---|---|---|---|"]
        for res, secs in rows[name]:
            c = res.config
            lines.append(f"| {getattr(c, axis)} | {c.T} | {series(c, axis)} | {c.seed} | {res.steps_done} / {c.total_steps} | "
                         f"{res.mem_acc:.4f} | {res.examples:.0f} | {'yes' if res.stopped_early else 'no'} | "
                         f"{secs:.1f} | {res.steps_per_s:.0f} |")
        if skipped[name]:
            lines += ["", "Not trained (the projection: the full step budget at the measured rate, no early stop):", ""]
            for c, need, why in skipped[name]:
                lines.append(f"- {_label(c, axis)}: " + (f"needs {need:.0f} s ({why})" if need is not None else why))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
