"""Tables and plots from stored results.

* ``table.md`` -- one row per configuration and T (seeds pooled): mem_acc and examples
  memorized (mem_acc x T: the examples the kept checkpoint gets right -- the paper's estimand)
  as mean, spread and seed min-max, the kept checkpoint's loss (the MSE of a paper-rule
  regression), steps and speed; capacity searches (largest T memorized at the target, a second
  statistic) when present.
* ``acc_vs_T.png`` -- mem_acc against T, a line per H (when T was swept).
* ``capacity_vs_heads.png`` / ``capacity_vs_context.png`` / ``capacity_vs_dhead.png`` -- against
  H, n or d_h: without capacity searches, the examples memorized at each T of the grid (a
  series per T and d_v: the paper's estimand); with searches, only the capacities found, and
  the theory's line c * H * min(n, d_h) with c fitted by least squares. Per series a free fit
  with its R^2: a line a + b x against H, and against d_h up to n, and a line that stops
  growing at a knee k, a + b min(n, k), against n (the paper's growth, then a plateau);
  ``table.md`` lists the fits.
* ``stores.md`` and ``stores_isr.png`` -- memory stores: measured ISR against M with the
  predictions, and the capacities.
* ``runs.csv`` (and ``capacities.csv``, ``store_curves.csv``, ``store_capacities.csv``).

The figures need matplotlib (the ``trainer`` extra); without it the rest is written
(extras.py).
"""
from __future__ import annotations

import json
import math
import os
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Tuple

from .extras import pyplot
from .store import ResultStore

# Fields that identify a configuration apart from its seed.
_CFG = ("heads", "context", "d_model", "d_in", "d_head", "d_value", "data", "dist", "task", "classes",
        "T", "steps", "batch", "lr", "impl", "backend", "dtype", "target_acc")


def _mean_sd(xs: Sequence[float]) -> Tuple[float, float]:
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return m, sd


def aggregate(rows: List[Dict]) -> List[Dict]:
    """Pool the seeds of each configuration."""
    groups: "OrderedDict[tuple, List[Dict]]" = OrderedDict()
    for r in rows:
        groups.setdefault(tuple(r[f] for f in _CFG), []).append(r)
    out = []
    for key, rs in groups.items():
        a = dict(zip(_CFG, key))
        acc_m, acc_sd = _mean_sd([r["mem_acc"] for r in rs])
        ex = [r["examples"] for r in rs]
        ex_m, ex_sd = _mean_sd(ex)
        losses = [r["loss"] for r in rs if r["loss"] is not None]
        a.update(
            loss=(sum(losses) / len(losses)) if losses else float("nan"),
            seeds=len(rs), mem_acc=acc_m, mem_acc_sd=acc_sd, examples=ex_m, examples_sd=ex_sd,
            examples_min=min(ex), examples_max=max(ex),
            steps_done=sum(r["steps_done"] for r in rs) / len(rs),
            early=sum(r["stopped_early"] for r in rs),
            steps_per_s=sum(r["steps_per_s"] for r in rs) / len(rs),
            examples_per_s=sum(r["examples_per_s"] or 0 for r in rs) / len(rs),
            wall_s=max(r["wall_s"] for r in rs),
            backend_used=",".join(sorted({r["backend_used"] for r in rs})),
            device=",".join(sorted({r["device"] for r in rs})),
        )
        out.append(a)
    return out


def theory_fit(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares c of y = c x (the line through the origin)."""
    sxx = sum(x * x for x in xs)
    return sum(x * y for x, y in zip(xs, ys)) / sxx if sxx > 0 else float("nan")


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> Tuple[float, float, float]:
    """Least-squares line y = a + b x; returns (a, b, R^2)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    a = my - b * mx
    return a, b, _r2(ys, [a + b * x for x in xs])


def _r2(ys: Sequence[float], fit: Sequence[float]) -> float:
    my = sum(ys) / len(ys)
    tot = sum((y - my) ** 2 for y in ys)
    res = sum((y - f) ** 2 for y, f in zip(ys, fit))
    return 1.0 - res / tot if tot > 0 else float("nan")


def knee_fit(xs: Sequence[float], ys: Sequence[float]) -> Tuple[float, float, float, float]:
    """Least-squares y = a + b min(x, k) over a, b and the knee k (growth up to k, then a
    plateau); returns (a, b, k, R^2). k is searched on a fine log grid between the smallest and
    the largest x (k at the largest x is a plain line: no plateau seen)."""
    lo, hi = min(xs), max(xs)
    best = None
    steps = 400
    for i in range(steps + 1):
        k = lo * (hi / lo) ** (i / steps) if lo > 0 else lo + (hi - lo) * i / steps
        a, b, r2 = linear_fit([min(x, k) for x in xs], ys)
        sse = sum((y - a - b * min(x, k)) ** 2 for x, y in zip(xs, ys))
        if best is None or sse < best[0] - 1e-12:
            best = (sse, a, b, k, r2)
    return best[1], best[2], best[3], best[4]


ESTIMAND = "examples memorized (mem_acc x T)"


def trend_fits(points: List[Dict], var: str, what: str = "capacity") -> List[Dict]:
    """Per series of ``points`` in which ``var`` varies (the other variables, d_v and T fixed):
    the free fit of the points' ``capacity`` value against ``var`` -- a line (H; d_h, over
    d_h <= n) or a line with a knee (n). ``what`` names the measure in the text (``ESTIMAND``
    for a grid's examples memorized, "capacity" for searches).

    Each entry: ``series`` (a label), ``xs``, ``ys``, ``kind`` ("line" or "knee"), ``a``, ``b``,
    ``k`` (knee; None for a line), ``r2``, ``text`` (one line for a table)."""
    out = []
    for key, s in _series(points, var).items():
        s = sorted(s, key=lambda p: p[var])
        if var == "d_head":
            s = [p for p in s if p["d_head"] <= p["context"]]  # the paper's trend: d_h up to n
        xs = [float(p[var]) for p in s]
        ys = [float(p["capacity"]) for p in s]
        if len(xs) < 3:
            continue
        label = _series_label(var, key)
        if var == "context":
            a, b, k, r2 = knee_fit(xs, ys)
            text = (f"{what} against n ({label}): {a:.1f} + {b:.2f}·min(n, {k:.1f}), R² = {r2:.3f} "
                    f"(knee at n = {k:.1f}; d_h = {s[0]['d_head']})")
            if xs[0] == 1 and len(xs) >= 4:
                # n = 1 is a degenerate layer (a softmax over one token weighs it 1 whatever the
                # scores): its jump to n = 2 can decide the knee alone, so the fit without it too.
                a2, b2, k2, r22 = knee_fit(xs[1:], ys[1:])
                text += f"; over n >= 2: {a2:.1f} + {b2:.2f}·min(n, {k2:.1f}), R² = {r22:.3f}"
        else:
            a, b, r2 = linear_fit(xs, ys)
            k = None
            name = "H" if var == "heads" else "d_h"
            text = f"{what} against {name} ({label}): {a:.1f} + {b:.2f}·{name}, R² = {r2:.4f}"
        out.append(dict(series=label, xs=xs, ys=ys, kind="knee" if k is not None else "line", a=a, b=b, k=k,
                        r2=r2, text=text, var=var))
    return out


def _others(var: str) -> List[str]:
    return [f for f in ("heads", "context", "d_head") if f != var]


def _series(points: List[Dict], var: str) -> "OrderedDict[tuple, List[Dict]]":
    """Points grouped by everything but ``var``: (data, task, the other two of H, n, d_h, d_v, T)."""
    series: "OrderedDict[tuple, List[Dict]]" = OrderedDict()
    for p in points:
        key = (p["data"], p["task"]) + tuple(p[f] for f in _others(var)) + (p.get("d_value"), p.get("T"))
        series.setdefault(key, []).append(p)
    return OrderedDict((k, s) for k, s in series.items() if len({p[var] for p in s}) > 1)


def _series_label(var: str, key: tuple) -> str:
    parts = [f"{f}={v}" for f, v in zip(_others(var), key[2:4])]
    if key[4] is not None:
        parts.append(f"d_v={key[4]}")
    if key[5] is not None:
        parts.append(f"T={key[5]}")
    return ", ".join(parts) + f", {key[0]}"


def _theory_x(a: Dict) -> float:
    return a["heads"] * min(a["context"], a["d_head"])


def capacity_points(aggs: List[Dict], caps: List[Dict]) -> List[Dict]:
    """The points of the trend plots and fits, each with ``capacity`` (the value plotted), ``lo``
    and ``hi`` (seed min and max) and ``source``.

    Without capacity searches: one point per configuration and T, the examples memorized
    (mem_acc x T, the paper's estimand), source "grid". When ``caps`` holds any search, only
    searches are points (source "search@target", T None): the probes of a search are not a
    grid of the estimand.
    """
    pts: "OrderedDict[tuple, Dict]" = OrderedDict()
    for a in aggs if not caps else []:
        pts[tuple(a[f] for f in _CFG)] = dict(a, capacity=a["examples"], lo=a["examples_min"], hi=a["examples_max"],
                                             source="grid")
    for c in caps:
        cfg = json.loads(c["config"])
        d = {f: cfg.get(f) for f in _CFG if f not in ("T", "steps")}
        d["T"] = None
        d.update(capacity=c["capacity_mean"], lo=c["capacity_min"], hi=c["capacity_max"], source=f"search@{c['target_acc']:g}",
                 seeds=len(json.loads(c["seeds"])))
        pts[tuple(d.get(f) for f in _CFG if f not in ("T", "steps"))] = d
    return list(pts.values())


def markdown_table(aggs: List[Dict], caps: List[Dict]) -> str:
    lines = []
    if aggs:
        lines += [
            "| H | n | d | d_h | d_v | data | task | T | seeds | mem_acc | examples memorized, mem_acc x T (min-max) | loss (MSE for regress) "
            "| steps | steps/s | examples/s | backend |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for a in sorted(aggs, key=lambda a: (a["data"], a["task"], a["context"], a["d_head"], a["heads"], a["T"])):
            lines.append(
                f"| {a['heads']} | {a['context']} | {a['d_model']} | {a['d_head']} | {a['d_value']} | {a['data']} | {a['task']} "
                f"| {a['T']} | {a['seeds']} | {a['mem_acc']:.3f} ± {a['mem_acc_sd']:.3f} "
                f"| {a['examples']:.1f} ({a['examples_min']:.0f}-{a['examples_max']:.0f}) | {a['loss']:.4g} | {a['steps_done']:.0f} "
                f"| {a['steps_per_s']:.0f} | {a['examples_per_s']:.0f} | {a['backend_used']} |"
            )
    if caps:
        lines += ["", "| H | n | d | d_h | data | task | target | seeds | capacity (mean) | min | max | probes |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for c in caps:
            lines.append(
                f"| {c['heads']} | {c['context']} | {c['d_model']} | {c['d_head']} | {c['data']} | {c['task']} | {c['target_acc']:g} "
                f"| {len(json.loads(c['seeds']))} | {c['capacity_mean']:.1f} | {c['capacity_min']:.0f} | {c['capacity_max']:.0f} | {c['probes']} |"
            )
    return "\n".join(lines) + "\n"


def plot_acc_vs_T(aggs: List[Dict], path: str) -> bool:
    series: "OrderedDict[tuple, List[Dict]]" = OrderedDict()
    for a in aggs:
        series.setdefault((a["data"], a["context"], a["d_head"], a["heads"]), []).append(a)
    if not any(len({a["T"] for a in s}) > 1 for s in series.values()):
        return False
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for (data, n, dh, H), s in series.items():
        s = sorted(s, key=lambda a: a["T"])
        ax.errorbar([a["T"] for a in s], [a["mem_acc"] for a in s], yerr=[a["mem_acc_sd"] for a in s],
                    marker="o", ms=3, capsize=2, label=f"H={H} n={n} d_h={dh} {data}")
    ax.set_xlabel("T (training examples)")
    ax.set_ylabel("mem_acc (training accuracy)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_capacity(points: List[Dict], var: str, path: str, label: str) -> Optional[float]:
    """Capacity against ``var`` (heads, context or d_head) with the fitted theory line.

    Returns the fitted constant, or None when ``var`` takes fewer than two values; the figure is
    drawn where matplotlib is installed.
    """
    series = _series(points, var)
    if not series:
        return None
    grid = all(p["source"] == "grid" for s in series.values() for p in s)
    xs = [_theory_x(p) for s in series.values() for p in s]
    ys = [p["capacity"] for s in series.values() for p in s]
    c = theory_fit(xs, ys)
    plt = pyplot()
    if plt is None:
        return c
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for k, s in series.items():
        s = sorted(s, key=lambda p: p[var])
        v = [p[var] for p in s]
        y = [p["capacity"] for p in s]
        err = [[p["capacity"] - p["lo"] for p in s], [p["hi"] - p["capacity"] for p in s]]
        line = ax.errorbar(v, y, yerr=err, marker="o", capsize=3, label=f"measured ({_series_label(var, k)})")
        if not grid:
            ax.plot(v, [c * _theory_x(p) for p in s], "--", color=line[0].get_color(), alpha=0.7,
                    label=f"theory c·H·min(n, d_h), c = {c:.3g}")
    for fit in trend_fits(points, var):
        lo, hi = min(fit["xs"]), max(fit["xs"])
        grid = [lo + (hi - lo) * i / 200 for i in range(201)]
        if fit["kind"] == "knee":
            fy = [fit["a"] + fit["b"] * min(x, fit["k"]) for x in grid]
            lab = f"fit {fit['a']:.0f} + {fit['b']:.1f}·min(n, {fit['k']:.1f}), R² = {fit['r2']:.3f}"
        else:
            fy = [fit["a"] + fit["b"] * x for x in grid]
            lab = f"fit {fit['a']:.0f} + {fit['b']:.1f}·x, R² = {fit['r2']:.4f}"
        ax.plot(grid, fy, ":", color="k", lw=1.2, label=lab)
    ax.set_xlabel(label)
    if grid:
        ax.set_ylabel("examples memorized (mem_acc x T), per T")
        ax.set_xscale("log", base=2) if var != "heads" else None
    else:
        ax.set_ylabel("capacity (largest T memorized at the target)")
    ax.set_title("mean over seeds; bars: seed min to max", fontsize=9)
    ax.grid(alpha=0.3)
    if len(series) > 2:  # many series: the legend beside the axes, not over the points
        fig.set_size_inches(11, 4.8)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return c


def plot_stores(curves: List[Dict], caps: List[Dict], path: str) -> bool:
    if not curves:
        return False
    plt = pyplot()
    if plt is None:
        return False
    series: "OrderedDict[tuple, List[Dict]]" = OrderedDict()
    for r in curves:
        series.setdefault((r["store"], r["param"], r["d_k"]), []).append(r)
    fig, ax = plt.subplots(figsize=(7.2, 4.8))
    for (store, param, dk), rs in series.items():
        rs = sorted(rs, key=lambda r: r["M"])
        name = store + _param_text(param)
        line, = ax.loglog([r["M"] for r in rs], [r["isr"] for r in rs], lw=1.6, label=f"{name}")
        pr = [(r["M"], r["isr_pred"]) for r in rs if r["isr_pred"] is not None]
        if pr:
            ax.loglog([m for m, _ in pr], [p for _, p in pr], ":", color=line.get_color(), lw=1.2)
    ax.axhline(1.0, color="k", lw=0.8)
    # Below 1e-3 the measured ratios are float32 rounding of an exact recall (thresholded and
    # trained stores with few memories): clip there so that the curves stay readable.
    top = max(r["isr"] for r in curves)
    ax.set_ylim(1e-3, max(2.0, top * 1.5))
    ax.set_xlabel("M (memories)")
    ax.set_ylabel("interference / signal (ISR)")
    ax.set_title("measured (solid) and predicted (dotted) ISR, d_k = " + ",".join(str(k) for k in sorted({r['d_k'] for r in curves})))
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _param_text(param: str) -> str:
    p = json.loads(param) if param else {}
    keep = {k: v for k, v in p.items() if k in ("t", "beta", "width")}
    return "" if not keep else "(" + ", ".join(f"{k}={v:g}" for k, v in keep.items()) + ")"


def stores_table(caps: List[Dict]) -> str:
    lines = [
        "| store | d_k | measured capacity | predicted (sphere) | formula (Gaussian) | M measured up to | backend | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def f(x):
        return "-" if x is None else f"{x:,.0f}"

    for c in caps:
        meas = f(c["capacity"]) if c["capacity"] is not None else f"> {c['M_max']:,}"
        lines.append(
            f"| {c['store']}{_param_text(c['param'])} | {c['d_k']} | {meas} | {f(c['capacity_pred'])} | {f(c['capacity_formula'])} "
            f"| {c['M_max']:,} | {c['backend']} | {c['wall_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def _write_csv(path: str, rows: List[Dict], drop=("history",)) -> None:
    import csv

    cols = [c for c in (rows[0] if rows else {}) if c not in drop]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for r in rows:
            w.writerow([r[c] for c in cols])


def write_report(store: ResultStore, out_dir: str, experiment: Optional[str] = None, configs=None) -> List[str]:
    """Write the tables, plots and CSV files for ``experiment`` (None: everything) into
    ``out_dir``; return the paths written. ``configs`` (RunConfigs): report these runs, looked
    up by key, whichever experiment stored them (a preset whose grid shares runs with another),
    instead of the runs stored under ``experiment``."""
    os.makedirs(out_dir, exist_ok=True)
    written = []
    figures = pyplot() is not None  # without matplotlib: the tables, fits and CSV files only
    if configs is None:
        rows = store.runs(experiment)
    else:
        rows = [r for r in (store.run_by_key(c.key()) for c in configs) if r is not None]
    caps = store.capacities(experiment)
    aggs = aggregate(rows)
    if rows or caps:
        p = os.path.join(out_dir, "table.md")
        title = f"# Memorization results{'' if experiment is None else ': ' + experiment}\n\n"
        body = markdown_table(aggs, caps)
        pts = capacity_points(aggs, caps)
        fits = []
        for var, fname, lab in (("heads", "capacity_vs_heads.png", "H (heads)"),
                                ("context", "capacity_vs_context.png", "n (context tokens)"),
                                ("d_head", "capacity_vs_dhead.png", "d_h (head dim)")):
            path = os.path.join(out_dir, fname)
            c = plot_capacity(pts, var, path, lab)
            if c is not None:
                if figures:
                    written.append(path)
                searches = any(q["source"] != "grid" for q in pts)
                what = "capacity" if searches else ESTIMAND
                if searches:
                    fits.append(f"{what} against {var}: theory c·H·min(n, d_h) fitted with c = {c:.3g}")
                fits.extend(f["text"] for f in trend_fits(pts, var, what))
        if plot_acc_vs_T(aggs, os.path.join(out_dir, "acc_vs_T.png")):
            written.append(os.path.join(out_dir, "acc_vs_T.png"))
        with open(p, "w") as f:
            f.write(title + body + ("\n" + "\n".join(f"- {s}" for s in fits) + "\n" if fits else ""))
        written.append(p)
        written.append(os.path.join(out_dir, "runs.csv"))
        if configs is None:
            store.export_csv(written[-1], "runs", experiment)
        else:
            _write_csv(written[-1], rows)
        if caps:
            written.append(os.path.join(out_dir, "capacities.csv"))
            store.export_csv(written[-1], "capacities", experiment)
    curves = store.table("store_curves", experiment)
    scaps = store.table("store_capacities", experiment)
    if scaps:
        p = os.path.join(out_dir, "stores.md")
        with open(p, "w") as f:
            f.write("# Memory stores\n\n" + stores_table(scaps))
        written.append(p)
        if plot_stores(curves, scaps, os.path.join(out_dir, "stores_isr.png")):
            written.append(os.path.join(out_dir, "stores_isr.png"))
        for t in ("store_curves", "store_capacities"):
            written.append(os.path.join(out_dir, f"{t}.csv"))
            store.export_csv(written[-1], t, experiment)
    return written
