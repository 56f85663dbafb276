"""Command line: ``mhakern-memorize`` (also ``python -m mhakern.memorize``).

Subcommands: ``run`` (one configuration, several seeds stacked), ``sweep`` (a grid),
``capacity`` (largest T memorized, by bracketing and bisection), ``stores`` (the memory-store
experiments), ``report`` (tables and plots from the database) and ``preset NAME`` (also
``mhakern-memorize NAME``: quick, paper-heads, paper-context, paper-dh, paper-regress-heads,
paper-regress-context, paper-saturation, large, the reduced-scale trends on the paper's
estimand trend-heads, trend-context, trend-dhead, and the capacity searches capacity-heads,
capacity-context, capacity-dhead).

Bad input ends with one line ``mhakern-memorize: error: FLAG: what is wrong`` on stderr and
exit status 2, and so does a database that is damaged or fails during the job (``--db: ...``,
saying where the results it could not take are kept); an interrupted job exits with 130 after
saying what was kept.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

PROG = "mhakern-memorize"
_DEFAULTS_HELP = (
    "Defaults (the quick preset's scale): H=4, n=8, d=16 (d_in = d_h = d), d_v=1, T=500, random context, "
    "uniform features, 100 classes, 3000 steps (--steps paper: the paper's max(floor(500 T / batch), 50000)), "
    "batch 256, Adam lr 1e-3, evaluation after steps 1, 501, 1001, ... (not after the last: --eval-last), target accuracy 1.0 with early "
    "stop, the paper's initialisation and regression rule, --impl fused, --backend auto, float32."
)


def cli_defaults():
    """The configuration that ``run``, ``sweep`` and ``capacity`` start from."""
    from .config import RunConfig

    return RunConfig(heads=4, context=8, d_model=16, T=500, steps=3000)
DEFAULT_OUT = "results"
DEFAULT_DB = os.path.join(DEFAULT_OUT, "memorize.sqlite")


class UsageError(Exception):
    """One-line user error (already naming the flag)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise UsageError(message.replace("\n", " "))


# ---------------------------------------------------------------------------- value parsing
def _split(flag: str, text: str) -> List[str]:
    parts = [p.strip() for p in str(text).split(",")]
    if not parts or any(p == "" for p in parts):
        raise UsageError(f"{flag}: expected a value or a comma-separated list, got {text!r}")
    return parts


def _int_list(flag: str, text: str) -> List[int]:
    """'1,2,4' or a range 'start:stop:step' (stop included) or a mix of both."""
    out: List[int] = []
    for p in _split(flag, text):
        try:
            if ":" in p:
                a, b, *c = (int(x.replace("_", "")) for x in p.split(":"))
                step = c[0] if c else 1
                if step <= 0 or len(c) > 1:
                    raise ValueError
                out.extend(range(a, b + 1, step))
            else:
                out.append(int(float(p.replace("_", ""))) if "e" in p.lower() else int(p.replace("_", "")))
        except ValueError:
            raise UsageError(f"{flag}: expected integers ('8', '1,2,4' or 'start:stop:step'), got {p!r}") from None
    return out


def _float_list(flag: str, text: str) -> List[float]:
    out = []
    for p in _split(flag, text):
        try:
            out.append(float(p))
        except ValueError:
            raise UsageError(f"{flag}: expected numbers, got {p!r}") from None
    return out


def _str_list(flag: str, text: str) -> List[str]:
    return _split(flag, text)


_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def _bool_list(flag: str, text: str) -> List[bool]:
    out = []
    for p in _split(flag, text):
        if p.lower() not in _TRUE + _FALSE:
            raise UsageError(f"{flag}: expected true or false, got {p!r}")
        out.append(p.lower() in _TRUE)
    return out


# (field, flag, short, parser, help)
_MODEL_FLAGS = [
    ("heads", "--heads", "-H", _int_list, "attention heads H"),
    ("context", "--context", "-n", _int_list, "context tokens n per example"),
    ("d_model", "--d-model", "-d", _int_list, "model (embedding) dim d"),
    ("d_in", "--d-in", None, _int_list, "input token dim (default: d)"),
    ("d_head", "--d-head", None, _int_list, "query/key dim per head d_h (default: d)"),
    ("d_value", "--d-value", None, _int_list, "value dim per head d_v (default 1, as the paper)"),
    ("T", "--T", "-T", _int_list, "training examples T"),
    ("data", "--data", None, _str_list, "random (a context per example) or shared (one context)"),
    ("dist", "--dist", None, _str_list, "uniform (U[0,1)) or gaussian features"),
    ("task", "--task", None, _str_list, "classify (100 classes) or regress"),
    ("classes", "--classes", None, _int_list, "number of classes"),
    ("steps", "--steps", None, None, "training steps, or 'paper' for max(500 T / batch, --min-steps)"),
    ("min_steps", "--min-steps", None, _int_list, "the paper rule's minimum (default 50000)"),
    ("batch", "--batch", None, _int_list, "batch size (default 256)"),
    ("lr", "--lr", None, _float_list, "Adam learning rate (default 1e-3)"),
    ("warmup", "--warmup", None, _float_list, "warm-up fraction of the steps (default 0.05)"),
    ("eval_every", "--eval-every", None, _int_list, "evaluate the whole training set every N steps (default 500)"),
    ("eval_last", "--eval-last", None, _bool_list,
     "also evaluate after the last step (default false: the paper evaluates after steps 1, 1 + N, 1 + 2N, ... only)"),
    ("target_acc", "--target-acc", None, _float_list, "training accuracy that counts as memorized (default 1.0)"),
    ("reg_tol", "--reg-tol", None, _float_list, "regression: |error| below this counts as within tolerance (default 0.01)"),
    ("reg_rule", "--reg-rule", None, _str_list,
     "regression: mse (the paper: whole budget, lowest-MSE checkpoint, MSE reported; default) or tol "
     "(|error| < --reg-tol counts as memorized, may stop early)"),
    ("early_stop", "--early-stop", None, _bool_list, "stop a run when it reaches --target-acc (default true, as the paper)"),
    ("init", "--init", None, _str_list,
     "initialisation: paper (per-head Xavier, nn.Linear embedding and decoder; default) or xavier-proj"),
    ("analysis", "--analysis", None, _bool_list, "softmax-saturation analysis of the kept checkpoint (default false)"),
    ("impl", "--impl", None, _str_list, "fused (mhakern.attention), eager (folded, plain PyTorch) or paper (paper form)"),
    ("backend", "--backend", None, _str_list, "mhakern backend for --impl fused: auto or a name"),
    ("dtype", "--dtype", None, _str_list, "float32, float64, bfloat16 or float16"),
]


def _steps_list(flag: str, text: str) -> List[Optional[int]]:
    out: List[Optional[int]] = []
    for p in _split(flag, text):
        out.extend([None] if p == "paper" else _int_list(flag, p))
    return out


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", default=None, help=f"SQLite results database (default {DEFAULT_DB}, or OUT/memorize.sqlite)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"results folder for plots and tables (default {DEFAULT_OUT})")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--threads", default="1",
                   help="CPU threads for torch (default 1; 0 = torch's choice). The trainer's operations are "
                        "small: on a shared machine, threads that wait for each other cost more than they give")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--experiment", default=None, help="tag stored with the results (default: the subcommand or preset)")


def _add_ray(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Ray (optional extra: pip install \"mhakern[ray]\")")
    g.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="train the stacks as tasks on the Ray cluster at ADDRESS ('auto', HOST:PORT or ray://HOST:PORT): "
                        "a GPU each on a cluster with GPUs, a CPU slot each otherwise; this process stores the results")
    g.add_argument("--workers", default=None, metavar="N",
                   help="start a local Ray on this machine with N CPU slots and train the stacks as its tasks")
    g.add_argument("--max-retries", default="3", metavar="N",
                   help="with --ray/--workers: how often a stack whose worker died is run again (default 3)")


# Stacking pays where a step's fixed cost dominates: on a GPU always, on a CPU only for small steps
# (8 stacked runs per run over one, one thread: 1.4x at H 8, n 8, d 16; 0.95x at H 8, n 16,
# d 32; 0.75x at the paper's H 20, n 32, d 64; docs/results.md section 4).
_STACK_HELP = ("most runs trained side by side in one stack (default 32); on a CPU a stack also stops at about "
               "50 M multiply-adds per step, so small steps stack and large ones (the paper's H 20, n 32, d 64: "
               "8 stacked ran 0.75-1.2x per run of one) train alone")


def _add_model(p: argparse.ArgumentParser, listy: bool) -> None:
    g = p.add_argument_group("configuration" + (" (comma lists and start:stop:step ranges make a grid)" if listy else ""))
    for field, flag, short, _, hlp in _MODEL_FLAGS:
        names = [flag] + ([short] if short else [])
        g.add_argument(*names, dest=field, default=None, help=hlp)
    g.add_argument("--seeds", default=None, help="seeds, e.g. 0,1,2 or 0:4 (default 0)")
    p.add_argument("--stack", default="32", help=_STACK_HELP)
    p.add_argument("--layout", default="rows", choices=("rows", "heads"),
                   help="how folded queries reach mhakern.attention: rows (H query rows of one head, default) or heads (MQA)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Memorization capacity of multi-head attention, on mhakern's kernels.")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    r = sub.add_parser("run", help="train one configuration (its seeds stacked)", epilog=_DEFAULTS_HELP)
    _add_model(r, listy=False)
    _add_common(r)
    s = sub.add_parser("sweep", help="train a grid of configurations; re-running skips stored runs", epilog=_DEFAULTS_HELP)
    _add_model(s, listy=True)
    _add_common(s)
    _add_ray(s)
    c = sub.add_parser("capacity", help="largest T memorized at a target accuracy, per seed (bracketing and bisection); "
                       "comma lists search several configurations in lockstep", epilog=_DEFAULTS_HELP)
    _add_model(c, listy=True)
    c.add_argument("--t-start", default=None, help="first T probed (default H * min(n, d_h))")
    c.add_argument("--t-max", default=str(1 << 22), help="largest T probed (default 2^22)")
    c.add_argument("--resolution", default="0.05", help="stop when the bracket is this fraction of T wide (default 0.05)")
    _add_common(c)
    _add_ray(c)
    st = sub.add_parser("stores", help="interference and capacity of linear, MLP and attention memory stores")
    st.add_argument("--d-k", default="64", help="key dim (default 64)")
    st.add_argument("--d-v", default=None, help="value dim (default: d_k)")
    st.add_argument("--stores", default=None,
                    help="which: linear, mlp-relu, mlp-poly2, mlp-relu2, mlp-trained, attention (default all)")
    st.add_argument("--thresholds", default="0,0.1,0.2,0.3", help="mlp-relu thresholds t (default 0,0.1,0.2,0.3)")
    st.add_argument("--beta", default=None, help="attention inverse temperatures (default sqrt(d_k))")
    st.add_argument("--max-m", default=str(1 << 22), help="attention store: most memories (default 2^22)")
    st.add_argument("--kernel-max-m", default=str(1 << 17), help="linear and constructed MLP stores: most memories (default 2^17)")
    st.add_argument("--queries", default="256", help="recall queries per trial (default 256)")
    st.add_argument("--trials", default="4", help="independent stores averaged, constructed stores (default 4)")
    st.add_argument("--mlp-steps", default="1000", help="Adam steps of the trained MLP (default 1000)")
    st.add_argument("--mlp-width", default=None, help="hidden width of the trained MLP (default 4 d_k)")
    st.add_argument("--backend", default="auto", help="mhakern backend of the attention store (default auto)")
    st.add_argument("--seed", default="0", help="seed of the memories (default 0)")
    _add_common(st)
    rp = sub.add_parser("report", help="tables, plots and CSV from the database")
    _add_common(rp)
    pr = sub.add_parser("preset", help="a named experiment: " + ", ".join(_preset_names()))
    pr.add_argument("name", help="preset name")
    pr.add_argument("--seeds", default=None, help="override the preset's seeds")
    pr.add_argument("--dry-run", action="store_true", help="list what would run and exit")
    pr.add_argument("--stack", default="32", help=_STACK_HELP)
    pr.add_argument("--layout", default="rows", choices=("rows", "heads"), help=argparse.SUPPRESS)
    pr.add_argument("--backend", default=None, help="mhakern backend (default: the preset's, auto)")
    _add_common(pr)
    _add_ray(pr)
    return p


def _preset_names():
    from .presets import PRESETS

    return list(PRESETS)


# ---------------------------------------------------------------------------- helpers
def _one_int(flag: str, text, lo: int = 1) -> int:
    vals = _int_list(flag, text)
    if len(vals) != 1:
        raise UsageError(f"{flag}: expected one integer, got {text!r}")
    if vals[0] < lo:
        raise UsageError(f"{flag}: must be an integer >= {lo}, got {vals[0]}")
    return vals[0]


def _one_float(flag: str, text) -> float:
    vals = _float_list(flag, text)
    if len(vals) != 1:
        raise UsageError(f"{flag}: expected one number, got {text!r}")
    return vals[0]


def _grid_from_args(args, listy: bool) -> Dict[str, List[Any]]:
    grid: Dict[str, List[Any]] = {}
    for field, flag, _, parse, _ in _MODEL_FLAGS:
        text = getattr(args, field)
        if text is None:
            continue
        vals = _steps_list(flag, text) if field == "steps" else parse(flag, text)
        if not listy and len(vals) != 1:
            raise UsageError(f"{flag}: {args.cmd} takes one value (use sweep for a grid), got {text!r}")
        grid[field] = vals
    return grid


def _seeds(args, default=(0,)) -> List[int]:
    if getattr(args, "seeds", None) is None:
        return list(default)
    seeds = _int_list("--seeds", args.seeds)
    if any(s < 0 for s in seeds):
        raise UsageError(f"--seeds: must be non-negative integers, got {args.seeds!r}")
    return sorted(set(seeds))


def _device(args):
    import torch

    name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device: expected cpu, cuda or cuda:N, got {name!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device: {name} requested but no CUDA device is available (torch.cuda.is_available() is False)")
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"--device: expected cpu, cuda or cuda:N, got {name!r}")
    return dev


def _open_pool(args):
    """The RayPool that --ray / --workers ask for, or None (raises UsageError, one line)."""
    address, workers = getattr(args, "ray", None), getattr(args, "workers", None)
    if address is None and workers is None:
        return None
    flag = "--ray" if address is not None else "--workers"
    if address is not None and workers is not None:
        raise UsageError("--workers: starts a local Ray; with --ray ADDRESS the cluster's own slots are used")
    if address is not None and not address.strip():
        raise UsageError("--ray: expected a cluster address ('auto', HOST:PORT or ray://HOST:PORT)")
    n = None if workers is None else _one_int("--workers", workers)
    retries = _one_int("--max-retries", args.max_retries, lo=0)
    from .sweep import RayPool, RayUnavailable

    try:
        return RayPool(address=address, workers=n, device=args.device, max_retries=retries)
    except RayUnavailable as e:
        raise UsageError(f"{flag}: {e}") from None


def _pool_device(pool):
    """The device the pool's tasks train on, as a torch.device this process can validate on."""
    import torch

    if pool.device == "cuda" and not torch.cuda.is_available():
        return None  # the driver has no GPU: configurations are validated, backends resolve on the workers
    return torch.device(pool.device)


def _setup_threads(args) -> None:
    import torch

    n = _one_int("--threads", args.threads, lo=0)
    if n > 0:
        torch.set_num_threads(n)


def _open_store(args):
    from .store import ResultStore, side_path

    path = args.db or os.path.join(args.out, "memorize.sqlite")
    try:
        store = ResultStore(path)
    except ValueError as e:  # StoreError, StoreDamaged: one line naming the file and what to do
        raise UsageError(str(e)) from None
    except OSError as e:
        raise UsageError(f"--db: cannot open {path}: {e}") from None
    if store.imported:
        n = store.imported
        print(f"--db: {path}: added {n} result{'s' if n > 1 else ''} that an earlier command could not store there "
              f"and kept in {side_path(path)}", file=sys.stderr, flush=True)
    return store


def _log(args):
    from .extras import tqdm_class

    # Lines go through tqdm.write while bars are drawn (so that they do not tear a bar), and
    # straight to stdout without bars: --no-progress, or tqdm not installed.
    tqdm = None if args.no_progress else tqdm_class()
    if tqdm is None:
        return lambda s: print(s, flush=True)
    return lambda s: tqdm.write(s)


def _check_configs(cfgs, device) -> None:
    """Validate every configuration and that its backend can serve it (raises ConfigError)."""
    from .train import resolve_backend

    seen = set()
    for c in cfgs:
        c.validate()
        k = (c.impl, c.backend, c.dtype, c.data, c.heads, c.context, c.d_model)
        if device is not None and k not in seen:
            seen.add(k)
            resolve_backend(c, device)


def _base_from_grid(grid: Dict[str, List[Any]], base=None):
    from .config import RunConfig

    base = base or RunConfig()
    single = {k: v[0] for k, v in grid.items() if len(v) == 1}
    multi = {k: v for k, v in grid.items() if len(v) > 1}
    return dataclasses.replace(base, **single), multi


def _print_results(results, log) -> None:
    for r in results:
        c = r.config
        if c.task == "regress" and c.reg_rule == "mse":
            what = f"MSE {r.loss:.4g} (kept checkpoint; {r.mem_acc:.1%} of examples within {c.reg_tol:g})"
        else:
            what = f"mem_acc {r.mem_acc:.4f} = {r.examples:.0f} examples fitted, loss {r.loss:.4g}"
        log(
            f"{c.label()} T={c.T} seed={c.seed}: {what}; "
            f"{r.steps_done} steps{' (stopped early)' if r.stopped_early else ''}, {r.wall_s:.1f} s, "
            f"{r.steps_per_s:.0f} steps/s, {r.examples_per_s:.0f} examples/s per run, backend {r.backend_used}"
        )


# ---------------------------------------------------------------------------- commands
def cmd_run(args) -> int:
    from .sweep import run_sweep

    grid = _grid_from_args(args, listy=False)
    base, _ = _base_from_grid(grid, cli_defaults())
    seeds = _seeds(args)
    cfgs = [dataclasses.replace(base, seed=s) for s in seeds]
    dev = _device(args)
    _check_configs(cfgs, dev)
    store = _open_store(args)
    exp = args.experiment or "run"
    log = _log(args)
    have = store.stored_keys(c.key() for c in cfgs)
    todo = [c for c in cfgs if c.key() not in have]
    if have:
        log(f"{len(have)} of these runs are already stored in {store.path}; training {len(todo)}")
    done = []
    if todo:
        # Through the sweep machinery: claims keep a concurrent sweep on this database from
        # training the same runs.
        run_sweep(todo, store, exp, device=dev, progress=not args.no_progress, max_stack=_one_int("--stack", args.stack),
                  layout=args.layout, on_stored=done.append)
    _print_results(sorted(done, key=lambda r: r.config.seed), log)
    trained = {r.config.key() for r in done}
    for c in cfgs:
        if c.key() not in trained:
            row = store.run_by_key(c.key())
            log(f"{c.label()} T={c.T} seed={c.seed}: stored: mem_acc {row['mem_acc']:.4f} = {row['examples']:.0f} examples fitted, "
                f"loss {row['loss']:.4g}")
    log(f"stored in {store.path} (experiment {exp!r})")
    return 0


def _do_sweep(cfgs, args, exp: str, dev, log, out_dir: Optional[str], pool=None) -> None:
    from .report import write_report
    from .sweep import run_sweep

    store = _open_store(args)
    t0 = time.perf_counter()
    summary = run_sweep(
        cfgs, store, exp, device=dev, progress=not args.no_progress,
        max_stack=_one_int("--stack", args.stack), layout=args.layout, log=log, pool=pool,
    )
    where = "" if pool is None else f" on Ray ({pool.slots} {'GPU' if pool.device == 'cuda' else 'CPU'} slots)"
    others = f", {summary.by_others} stored by other sweeps" if summary.by_others else ""
    if summary.dropped:
        others += f" ({summary.dropped} of them finished here too, not stored: claims lost)"
    log(
        f"{exp}: {summary.total} runs ({summary.skipped} already stored, {summary.trained} trained{others}) "
        f"in {time.perf_counter() - t0:.1f} s{where}; database {store.path}"
    )
    if out_dir:
        for p in write_report(store, out_dir, exp):
            log(f"  wrote {p}")


def cmd_sweep(args) -> int:
    from .sweep import expand_grid

    grid = _grid_from_args(args, listy=True)
    base, multi = _base_from_grid(grid, cli_defaults())
    cfgs = expand_grid(base, multi, _seeds(args))
    exp = args.experiment or "sweep"
    pool = _open_pool(args)
    try:
        dev = _device(args) if pool is None else _pool_device(pool)
        _check_configs(cfgs, dev)
        _do_sweep(cfgs, args, exp, dev, _log(args), os.path.join(args.out, exp), pool=pool)
    finally:
        if pool is not None:
            pool.close()
    return 0


def cmd_capacity(args) -> int:
    from .capacity import check_searchable, find_capacities
    from .report import write_report
    from .sweep import expand_grid

    grid = _grid_from_args(args, listy=True)
    grid.pop("T", None)
    base, multi = _base_from_grid(grid, cli_defaults())
    bases = expand_grid(base, multi, [0])
    seeds = _seeds(args)
    t_start = None if args.t_start is None else _one_int("--t-start", args.t_start)
    t_max = _one_int("--t-max", args.t_max)
    resolution = _one_float("--resolution", args.resolution)
    if not 0 < resolution < 1:
        raise UsageError(f"--resolution: must lie in (0, 1), got {resolution}")
    for b in bases:
        check_searchable(b)
        start = t_start if t_start is not None else max(2, b.heads * min(b.context, b.dh))
        if t_max < start:
            raise UsageError(f"--t-max: must be at least the first T probed ({start}), got {t_max}")
    pool = _open_pool(args)
    try:
        dev = _device(args) if pool is None else _pool_device(pool)
        _check_configs(bases, dev)
        store = _open_store(args)
        exp = args.experiment or "capacity"
        log = _log(args)
        results = find_capacities(
            bases, seeds, store, exp, t_start=t_start, t_max=t_max,
            resolution=resolution, device=dev, progress=not args.no_progress, log=log, pool=pool,
        )
    finally:
        if pool is not None:
            pool.close()
    for res in results:
        caps = ", ".join(f"seed {s}: {c}{'+' if k else ''}" for s, c, k in zip(res.seeds, res.per_seed, res.capped))
        log(f"capacity of {res.config.label()} at target {res.target:g}: {caps}; mean {res.mean:.1f} "
            f"({res.probes} probes, {res.wall_s:.1f} s)")
    for p in write_report(store, os.path.join(args.out, exp), exp):
        log(f"  wrote {p}")
    return 0


def cmd_stores(args) -> int:
    import torch

    from . import stores as S
    from .report import stores_table, write_report
    from .train import device_name

    d_k = _one_int("--d-k", args.d_k)
    d_v = None if args.d_v is None else _one_int("--d-v", args.d_v)
    which = S.STORES if args.stores is None else _str_list("--stores", args.stores)
    for w in which:
        if w not in S.STORES:
            raise UsageError(f"--stores: unknown store {w!r}; choose from {', '.join(S.STORES)}")
    thr = _float_list("--thresholds", args.thresholds)
    if any(not 0 <= t < 1 for t in thr):
        raise UsageError(f"--thresholds: must lie in [0, 1), got {args.thresholds!r}")
    betas = None if args.beta is None else _float_list("--beta", args.beta)
    if betas is not None and any(b <= 0 or not math.isfinite(b) for b in betas):
        raise UsageError(f"--beta: must be positive numbers, got {args.beta!r}")
    max_m = _one_int("--max-m", args.max_m, lo=16)
    kmax = _one_int("--kernel-max-m", args.kernel_max_m, lo=16)
    queries = _one_int("--queries", args.queries)
    trials = _one_int("--trials", args.trials)
    mlp_steps = _one_int("--mlp-steps", args.mlp_steps)
    mlp_width = None if args.mlp_width is None else _one_int("--mlp-width", args.mlp_width)
    seed = _one_int("--seed", args.seed, lo=0)
    dev = _device(args)
    if "attention" in which:
        import mhakern

        q = torch.empty((1, 1, 2, d_k), device=dev)
        try:
            mhakern.backends.select(args.backend, q, q, q, False, None)
        except ValueError as e:
            raise UsageError(f"--backend: {e}") from None
    specs = [s for s in S.default_specs(d_k, thr, betas) if s.store in which]
    store = _open_store(args)
    exp = args.experiment or "stores"
    log = _log(args)
    dname = device_name(dev)

    def keep(spec, cv):
        store.add_store_results(exp, S.curve_rows(spec, cv), S.capacity_row(spec, cv, dname))
        cap = cv.capacity()
        pe = "" if spec.store == "mlp-trained" else " (predicted %.0f)" % S.predicted_capacity(spec.store, d_k, spec.params)[0]
        log(f"{spec.name}: capacity {('> %d' % max(cv.M)) if math.isnan(cap) else '%.0f' % cap}{pe}; "
            f"ISR {cv.isr[-1]:.3f} at M = {cv.M[-1]:,}; {cv.wall_s:.1f} s")

    S.run_stores(
        specs, d_k=d_k, d_v=d_v, max_m=kmax, attn_max_m=max_m, queries=queries, trials=trials, seed=seed,
        device=dev, backend=args.backend, mlp_steps=mlp_steps, mlp_width=mlp_width,
        progress=not args.no_progress, on_curve=keep,
    )
    out = os.path.join(args.out, exp)
    for p in write_report(store, out, exp):
        log(f"  wrote {p}")
    log("")
    log(stores_table(store.table("store_capacities", exp)[-len(specs):]))
    return 0


def cmd_report(args) -> int:
    from .report import write_report

    store = _open_store(args)
    exps = [args.experiment] if args.experiment else store.experiments()
    if not exps:
        raise UsageError(f"--db: {store.path} holds no results yet")
    for e in exps:
        for p in write_report(store, os.path.join(args.out, e), e):
            print(f"wrote {p}")
    return 0


def cmd_preset(args) -> int:
    from . import presets

    pre = presets.get(args.name)
    seeds = _seeds(args, pre.seeds)
    pool = None if args.dry_run else _open_pool(args)
    try:
        return _run_preset(args, pre, seeds, pool)
    finally:
        if pool is not None:
            pool.close()


def _run_preset(args, pre, seeds, pool) -> int:
    from .capacity import find_capacities
    from .report import write_report
    from .sweep import expand_grid, plan_stacks

    dev = _device(args) if pool is None else _pool_device(pool)
    log = _log(args)
    exp = args.experiment or pre.name
    run_dev = pool.device if pool is not None else dev.type
    if pre.needs_gpu and run_dev != "cuda" and not args.dry_run:
        log(f"note: preset {pre.name!r} is sized for a GPU ({pre.est}); running on {run_dev} anyway")
    sweeps, caps = [], []
    for part in pre.parts:
        base = part.base if args.backend is None else dataclasses.replace(part.base, backend=args.backend)
        if part.kind == "sweep":
            sweeps.extend(expand_grid(base, part.grid, seeds))
        else:
            for c in expand_grid(dataclasses.replace(base, T=1, target_acc=part.target), part.grid, [0]):
                caps.append((c, part))
    _check_configs(sweeps + [c for c, _ in caps], dev)
    if args.dry_run:
        from .sweep import STACK_MACS
        from .train import stack_label

        stacks = plan_stacks(sweeps, max_stack=_one_int("--stack", args.stack), max_macs=STACK_MACS[run_dev])
        log(f"{pre.name}: {pre.description}")
        log(f"  {len(sweeps)} runs in {len(stacks)} stacks, {len(caps)} capacity searches; {pre.est}")
        for st in stacks:
            log(f"  stack: {stack_label(st)}")
        for c, part in caps:
            log(f"  capacity at {part.target:g}: {c.label()}")
        return 0
    log(f"{pre.name}: {pre.description}")
    out_dir = os.path.join(args.out, exp)
    if sweeps:
        _do_sweep(sweeps, args, exp, dev, log, None, pool=pool)
    store = _open_store(args)
    # Searches of one part (same resolution and T range) run in lockstep: on Ray, in parallel.
    by_part: Dict[int, list] = {}
    for c, part in caps:
        by_part.setdefault(id(part), [part, []])[1].append(c)
    for part, cfgs in by_part.values():
        for res in find_capacities(cfgs, seeds, store, exp, t_start=part.t_start, resolution=part.resolution,
                                   device=dev, progress=not args.no_progress, log=log, pool=pool):
            caps_txt = ", ".join(f"seed {s}: {v}{'+' if k else ''}" for s, v, k in zip(res.seeds, res.per_seed, res.capped))
            log(f"capacity of {res.config.label()} at target {res.target:g}: {caps_txt}; mean {res.mean:.1f}")
    # A preset's grid may share runs with another's (the same configuration, stored once):
    # its report reads its own configurations wherever they are stored.
    for p in write_report(store, out_dir, exp, configs=sweeps if sweeps and not caps else None):
        log(f"  wrote {p}")
    return 0


_COMMANDS = {"run": cmd_run, "sweep": cmd_sweep, "capacity": cmd_capacity, "stores": cmd_stores,
             "report": cmd_report, "preset": cmd_preset}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the exit status (0 ok, 2 bad input, 130 interrupted)."""
    from .config import ConfigError
    from .store import StoreError

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _preset_names():
        argv = ["preset"] + argv
    try:
        args = build_parser().parse_args(argv)
        _setup_threads(args)
        return _COMMANDS[args.cmd](args)
    except (UsageError, ConfigError, StoreError) as e:
        # StoreError here: the database failed during the job (damaged, locked too long); the
        # message says where the results it could not take are kept.
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            f"{PROG}: interrupted: finished runs are stored; runs in flight were lost. "
            "Run the same command again to resume.",
            file=sys.stderr,
        )
        return 130
