"""As much of a paper grid as a time budget allows, on the step engine; one markdown file out.

    python -m benchmarks.trainer_grid --preset paper-heads --data random --budget-s 150 --out grid.md

For a lent GPU's last minutes (issue 34, What 4): the paper's heads and context grids at its own
scale (d = d_in = d_h = 64, d_v = 1, batch 256, Adam 1e-3, its step rule: at least 50,000
steps) are GPU days whole, and each of their runs is a stack of one (its T, and so its step
budget, differs from every other run's: ``RunConfig.stack_key``). So the runs are ordered to
cover the grid early -- the smallest T first, and within one T the grid's values in bisection
order (the middle, the two ends, then the points between), so that any prefix spans the axis
-- and each is trained only if its projected time fits what is left of the budget:

* the projection: the run's stack built and its first steps run (CUDA graph capture), then
  timed for ``--measure-s``; its full step budget at that rate, with no early stop (an upper
  bound: a run that memorizes everything stops at its next evaluation);
* a run that does not fit is skipped with its projection, and a cheaper one after it may still
  run; the measurement's own seconds count against the budget.

Each trained run goes through ``train_stack`` as a sweep's would (its evaluation points, kept
checkpoint and early stop), is stored in ``--db`` when given (``ResultStore``, experiment
``--experiment``), and becomes a row of the markdown: the grid value, T, steps done of the
budget, mem_acc and examples memorized (mem_acc x T, the paper's estimand), whether it stopped
early, seconds and steps/s; then the skipped runs with their projections, the device, the
budget, and the command. Device-generic: on a CPU it plans and trains the same way (tests use
the small ``quick`` preset).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import List, Sequence, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mhakern.memorize import presets, sweep  # noqa: E402
from mhakern.memorize.config import RunConfig  # noqa: E402
from mhakern.memorize.train import StepEngine, _Stack, device_name, train_stack, versions  # noqa: E402

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


def ordered_runs(cfgs: Sequence[RunConfig]) -> Tuple[str, List[RunConfig]]:
    """(the grid's axis, its runs in training order): the smallest T first, then the first
    seed, each such slice's grid values in :func:`bisection_order` (where the grid has two
    kinds of data, the random runs of a slice before the shared ones)."""
    axis = next((a for a in AXES if len({getattr(c, a) for c in cfgs}) > 1), "heads")
    out: List[RunConfig] = []
    for T in sorted({c.T for c in cfgs}):
        for seed in sorted({c.seed for c in cfgs}):
            for data in sorted({c.data for c in cfgs}, key=lambda d: d != "random"):
                at = {getattr(c, axis): c for c in cfgs if (c.T, c.seed, c.data) == (T, seed, data)}
                out += [at[v] for v in bisection_order(list(at))]
    return axis, out


def measure(cfg: RunConfig, device: torch.device, seconds: float) -> float:
    """Run-steps per second of ``cfg`` trained alone, after its first steps (the capture)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    st = _Stack([cfg], device, "rows", 2 << 30)
    eng = StepEngine(st)
    eng.run(3)
    sync()
    k, done, t0 = 4, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        eng.run(k)
        sync()
        done += k
        k = min(2 * k, 4096)
    rate = done / (time.perf_counter() - t0)
    del st, eng
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rate


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="paper-heads", help="a sweep preset (default paper-heads)")
    ap.add_argument("--data", default="random", help="random, shared or both (the preset's parts of that kind)")
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
    if a.preset not in presets.PRESETS:
        ap.error(f"--preset: unknown preset {a.preset!r}; choose one of {', '.join(presets.PRESETS)}")
    p = presets.get(a.preset)
    parts = [pt for pt in p.parts if pt.kind == "sweep" and (a.data == "both" or pt.base.data == a.data)]
    if not parts:
        ap.error(f"--preset: {a.preset} has no sweep over {a.data} data")
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        torch.set_num_threads(a.threads)
    cfgs = [c for pt in parts for c in sweep.expand_grid(pt.base, pt.grid, p.seeds)]
    axis, order = ordered_runs(cfgs)
    store = None
    if a.db:
        from mhakern.memorize.store import ResultStore

        store = ResultStore(a.db)
    experiment = a.experiment or f"{a.preset}-grid"
    vers = versions()
    rows, skipped = [], []
    say = lambda s: print(f"trainer_grid [{time.perf_counter() - t_start:5.0f}s]: {s}", flush=True)  # noqa: E731
    say(f"{a.preset} ({a.data}): {len(order)} runs over {axis} on {device_name(device)}, budget {a.budget_s:.0f} s")
    for cfg in order:
        left = a.budget_s - (time.perf_counter() - t_start)
        label = _label(cfg, axis)
        if left < 2 * a.measure_s + 2:
            skipped.append((cfg, None, "the budget was spent"))
            continue
        rate = measure(cfg, device, a.measure_s)
        need = cfg.total_steps / rate
        left = a.budget_s - (time.perf_counter() - t_start)
        if need > left:
            say(f"{label}: skipped, {cfg.total_steps} steps at {rate:.0f}/s need {need:.0f} s, {left:.0f} s left")
            skipped.append((cfg, need, f"{rate:.0f} steps/s"))
            continue
        say(f"{label}: {cfg.total_steps} steps at {rate:.0f}/s, at most {need:.0f} s")
        t = time.perf_counter()
        res = train_stack([cfg], device, progress=False)[0]
        if store is not None:
            store.add_run(res, experiment, vers)
        rows.append((res, time.perf_counter() - t))
        say(f"{label}: mem_acc {res.mem_acc:.4f} ({res.examples:.0f} examples) after {res.steps_done} steps"
            f"{' (stopped early)' if res.stopped_early else ''} in {time.perf_counter() - t:.0f} s")
    if store is not None:
        store.close()
    write(a, axis, device, rows, skipped, time.perf_counter() - t_start)
    say(f"{len(rows)} runs trained, {len(skipped)} skipped; wrote {a.out}")
    return 0


def _label(c: RunConfig, axis: str) -> str:
    return f"{axis} {getattr(c, axis)}, T {c.T}, {c.data}, seed {c.seed}"


def _settings(c: RunConfig, axis: str) -> str:
    """What the grid's runs share, from one of them (the axis left out)."""
    fixed = {"heads": f"H {c.heads}", "context": f"n {c.context}", "d_head": f"d_h {c.dh}"}
    fixed.pop(axis, None)
    steps = f"{c.steps} steps" if c.steps is not None else f"the paper's step rule (at least {c.min_steps} steps)"
    return (", ".join(fixed.values()) + f", d {c.d_model}, d_in {c.din}, d_v {c.d_value}, batch {c.batch}, "
            f"lr {c.lr:g}, {c.task}, {steps}, evaluated every {c.eval_every}")


def write(a, axis: str, device: torch.device, rows, skipped, wall: float) -> None:
    cmd = "python -m benchmarks.trainer_grid " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in (("preset", a.preset), ("data", a.data), ("budget_s", f"{a.budget_s:g}"),
                                                   ("measure_s", f"{a.measure_s:g}"), ("out", a.out)))
    lines = [f"## {a.preset} ({a.data} data) on {device_name(device)}: {len(rows)} runs in {wall:.0f} s of a "
             f"{a.budget_s:g} s budget", "",
             f"torch {torch.__version__}; {_settings((rows[0][0].config if rows else skipped[0][0]), axis)}; "
             f"`{cmd}`", "",
             f"| {axis} | T | data | seed | steps done / budget | mem_acc | examples memorized | stopped early | s | steps/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for res, secs in rows:
        c = res.config
        lines.append(f"| {getattr(c, axis)} | {c.T} | {c.data} | {c.seed} | {res.steps_done} / {c.total_steps} | "
                     f"{res.mem_acc:.4f} | {res.examples:.0f} | {'yes' if res.stopped_early else 'no'} | {secs:.1f} | "
                     f"{res.steps_per_s:.0f} |")
    if skipped:
        lines += ["", "Not trained (the projection: the full step budget at the measured rate, no early stop):", ""]
        for c, need, why in skipped:
            lines.append(f"- {_label(c, axis)}: " + (f"needs {need:.0f} s ({why})" if need is not None else why))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
