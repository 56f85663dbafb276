"""Capacity: the largest T a configuration memorizes at a target accuracy, per seed -- a second
statistic beside the paper's estimand, not the paper's.

The paper reads its trends from examples memorized (mem_acc x T) at fixed T across a grid (the
``trend-*`` presets); it has no capacity search. Capacity is an extreme-value statistic (the
single hardest example decides it), tied to the step budget (the paper's step rule gives a
larger T more steps but, above the floor, the same epochs), and resolved only to the search's
``resolution``; it need not scale as the examples memorized do.

For each seed, T is bracketed by doubling (or halving) from a start value until one T is
memorized (mem_acc >= target) and a larger one is not, then bisected until the bracket is
narrower than ``resolution`` (relative) or one example. Every probe is an ordinary run in the
store, so an interrupted search resumes from its stored probes; the probes of one round with the
same T (the seeds') are trained together as one stack.

Success is not monotone in T. The first T examples of a larger task are the smaller task (see
:mod:`mhakern.memorize.data`), but a run on T examples is not a run on T' < T of them plus more:
its batches (their order and their split into batches), its step budget and with it its
learning-rate schedule all depend on T. So a seed may memorize some T and fail a smaller one,
and bisection finds *a* T memorized whose larger neighbour in the bracket failed, not the
largest T memorized: the answer is neither an upper nor a lower bound in general (it is only
the largest memorized T among those probed).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

from .config import ConfigError, RunConfig
from .store import ResultStore
from .sweep import RayPool, run_sweep


@dataclass
class _Search:
    seed: int
    lo: int = 0  # largest T memorized so far
    hi: Optional[int] = None  # smallest T not memorized so far
    next_T: int = 0
    done: bool = False
    capped: bool = False  # memorized even at t_max
    probes: List[tuple] = field(default_factory=list)


@dataclass
class CapacityResult:
    config: RunConfig
    target: float
    seeds: List[int]
    per_seed: List[int]
    capped: List[bool]
    probes: int
    wall_s: float

    @property
    def mean(self) -> float:
        return sum(self.per_seed) / len(self.per_seed)


def capacity_key(cfg: RunConfig, target: float, seeds: Sequence[int], t_start, t_max, resolution) -> str:
    d = dataclasses.replace(cfg, T=1, seed=0, target_acc=target).as_dict()
    d.update(target=target, seeds=list(seeds), t_start=t_start, t_max=t_max, resolution=resolution)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:24]


def check_searchable(cfg: RunConfig) -> None:
    """Raise ConfigError unless runs of ``cfg`` say whether T examples were memorized."""
    if cfg.task == "regress" and cfg.reg_rule != "tol":
        raise ConfigError(
            "--reg-rule",
            "a capacity search of a regression needs --reg-rule tol (an example within --reg-tol counts as memorized); "
            "the paper's mse rule reports an MSE, not examples memorized",
        )


def _advance(s: _Search, T: int, ok: bool, t_max: int, resolution: float) -> None:
    s.probes.append((T, ok))
    if ok:
        s.lo = max(s.lo, T)
    else:
        s.hi = T if s.hi is None else min(s.hi, T)
    if s.hi is None:
        if s.lo >= t_max:
            s.done, s.capped = True, True
        else:
            s.next_T = min(t_max, 2 * s.lo)
        return
    if s.lo == 0:
        if s.hi <= 1:
            s.done = True
        else:
            s.next_T = s.hi // 2
        return
    if s.hi - s.lo <= max(1, int(resolution * s.lo)):
        s.done = True
    else:
        s.next_T = (s.lo + s.hi) // 2


def find_capacity(
    cfg: RunConfig,
    seeds: Sequence[int],
    store: ResultStore,
    experiment: str,
    target: float = 1.0,
    t_start: Optional[int] = None,
    t_max: int = 1 << 22,
    resolution: float = 0.05,
    device="cpu",
    progress: bool = True,
    log: Optional[Callable[[str], None]] = None,
    train_fn: Optional[Callable[[List[RunConfig]], Dict[str, float]]] = None,
    pool: Optional[RayPool] = None,
) -> CapacityResult:
    """Capacity of ``cfg`` (its T and seed ignored) for each of ``seeds``.

    Args:
        target: accuracy that counts as memorized (1.0 is the paper's criterion, 0.99 a looser
            one); runs stop early once they reach it.
        t_start: first T probed (default H * min(n, d_h), the theory's scale).
        t_max: largest T probed; a seed that memorizes it is reported as capped.
        resolution: stop when the bracket's width is at most this fraction of its lower end.
        train_fn: for tests, maps a round's configurations to {key: mem_acc} instead of
            training and storing them.
        pool: train each round's stacks as Ray tasks (see :class:`~mhakern.memorize.sweep.RayPool`).
    """
    if not 0 < target <= 1:
        raise ConfigError("--target-acc", f"must lie in (0, 1], got {target!r}")
    return find_capacities(
        [dataclasses.replace(cfg, target_acc=target)], seeds, store, experiment, t_start=t_start, t_max=t_max,
        resolution=resolution, device=device, progress=progress, log=log, train_fn=train_fn, pool=pool,
    )[0]


def find_capacities(
    cfgs: Sequence[RunConfig],
    seeds: Sequence[int],
    store: ResultStore,
    experiment: str,
    t_start: Optional[int] = None,
    t_max: int = 1 << 22,
    resolution: float = 0.05,
    device="cpu",
    progress: bool = True,
    log: Optional[Callable[[str], None]] = None,
    train_fn: Optional[Callable[[List[RunConfig]], Dict[str, float]]] = None,
    pool: Optional[RayPool] = None,
) -> List[CapacityResult]:
    """Capacity searches of several configurations (each at its own ``target_acc``), in lockstep.

    Each search probes exactly the T values it would probe alone (:func:`find_capacity`), so
    its probes are the same stored runs; a round trains the probes of all unfinished searches
    as one sweep. Results come back in the order of ``cfgs``.
    """
    if not 0 < resolution < 1:
        raise ConfigError("--resolution", f"must lie in (0, 1), got {resolution!r}")
    seeds = [int(s) for s in seeds]
    if not seeds:
        raise ConfigError("--seeds", "give at least one seed")
    bases, starts = [], []
    for cfg in cfgs:
        if not 0 < cfg.target_acc <= 1:
            raise ConfigError("--target-acc", f"must lie in (0, 1], got {cfg.target_acc!r}")
        check_searchable(cfg)
        start = t_start if t_start is not None else max(2, cfg.heads * min(cfg.context, cfg.dh))
        if start < 1:
            raise ConfigError("--t-start", f"must be a positive integer, got {start!r}")
        if t_max < start:
            raise ConfigError("--t-max", f"must be at least the start T ({start}), got {t_max}")
        bases.append(cfg)
        starts.append(start)
    t0 = time.perf_counter()
    searches = [[_Search(seed=s, next_T=st) for s in seeds] for st in starts]
    say = log or (lambda s: None)
    n_probes = [0] * len(bases)
    rnd = 0
    while not all(s.done for ss in searches for s in ss):
        rnd += 1
        live = [(j, s) for j, ss in enumerate(searches) for s in ss if not s.done]
        round_cfgs = [dataclasses.replace(bases[j], T=s.next_T, seed=s.seed).validate() for j, s in live]
        if train_fn is not None:
            accs = train_fn(round_cfgs)
        else:
            run_sweep(round_cfgs, store, experiment, device=device, progress=progress, log=None, pool=pool)
            accs = {c.key(): store.run_by_key(c.key())["mem_acc"] for c in round_cfgs}
        for (j, s), c in zip(live, round_cfgs):
            n_probes[j] += 1
            _advance(s, c.T, accs[c.key()] >= c.target_acc, t_max, resolution)
        for j in sorted({j for j, _ in live}):
            probed = [(s, c) for (jj, s), c in zip(live, round_cfgs) if jj == j]
            say(
                f"  round {rnd}{'' if len(bases) == 1 else ' ' + bases[j].label()}: "
                + ", ".join(
                    f"seed {s.seed}: T={c.T} {'memorized' if accs[c.key()] >= c.target_acc else 'not'} "
                    f"({accs[c.key()]:.3f})"
                    for s, c in probed
                )
            )
    wall = time.perf_counter() - t0
    out = []
    for j, base in enumerate(bases):
        ss = searches[j]
        res = CapacityResult(
            config=base,
            target=base.target_acc,
            seeds=seeds,
            per_seed=[s.lo for s in ss],
            capped=[s.capped for s in ss],
            probes=n_probes[j],
            wall_s=wall,
        )
        if train_fn is None:
            key = capacity_key(base, base.target_acc, seeds, starts[j], t_max, resolution)
            store.add_capacity(key, experiment, base, base.target_acc, seeds, res.per_seed, n_probes[j], res.wall_s)
        out.append(res)
    return out
