"""Sweeps: a grid of configurations, trained in stacks, stored as they finish, resumable.

:func:`expand_grid` makes the configurations, :func:`plan_stacks` packs those not yet stored
into stacks of runs that can train side by side (same everything but seed, T, heads, d_head
and d_value; bounded padding waste and data size), and :func:`run_sweep` trains the stacks,
storing each run the moment it finishes. Re-running the same sweep trains only what is missing,
and sweeps running at once on one database share the work: each claims a stack's runs before
training them (a lease renewed by a heartbeat, see :mod:`.store`), so that no run is trained
twice and the runs of a sweep that died are taken over once its lease runs out.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

from .config import RunConfig
from .store import DEFAULT_LEASE_S, Heartbeat, ResultStore, new_owner
from .train import RunResult, train_stack, versions

# A stack may pad its runs to the largest (heads, d_head, d_value) when the padded work is at
# most this factor above the real work, or when a step is this cheap anyway (multiply-adds),
# since a small step costs its fixed overhead whatever its size.
PAD_FACTOR = 1.5
SMALL_STEP_MACS = 60e6
# Most work (multiply-adds of one forward step, padded, all runs) per stack. Stacking pays for
# small steps, whose cost is fixed overhead; on a CPU, large stacked steps run slower per run than
# separate ones (their tensors leave the caches: measured 0.8x for 8 runs at H=20, n=32, d=64),
# while a GPU wants all the work it can get in one launch.
STACK_MACS = {"cpu": 50e6, "cuda": 50e9}


def expand_grid(base: RunConfig, grid: Dict[str, Sequence], seeds: Sequence[int]) -> List[RunConfig]:
    """Every combination of ``grid`` (field name -> values) applied to ``base``, for each seed.

    Order: the grid's fields vary slowest in the order given, seeds fastest.
    """
    names = list(grid)
    out = []
    for combo in itertools.product(*(list(grid[n]) for n in names)):
        over = dict(zip(names, combo))
        for s in seeds:
            out.append(dataclasses.replace(base, **over, seed=int(s)).validate())
    # One configuration listed twice (e.g. repeated values) is one run.
    seen, uniq = set(), []
    for c in out:
        k = c.key()
        if k not in seen:
            seen.add(k)
            uniq.append(c)
    return uniq


def step_macs(cfg: RunConfig) -> float:
    """Multiply-adds of one forward step of one run of the folded model (for stack planning)."""
    b = min(cfg.batch, cfg.T)
    H, n, d, di, dh, dv = cfg.heads, cfg.context, cfg.d_model, cfg.din, cfg.dh, cfg.d_value
    emb = b * (n + 1) * di * d if cfg.data == "random" else b * di * d + n * di * d
    return float(emb + 2 * b * H * d * dh + 2 * b * H * n * d + 2 * b * H * d * dv + b * d * cfg.n_out)


def data_bytes(cfg: RunConfig) -> int:
    per = cfg.din if cfg.data == "shared" else (cfg.context + 1) * cfg.din
    return cfg.T * per * 4


def _padded(cfgs: Sequence[RunConfig]) -> RunConfig:
    return dataclasses.replace(
        cfgs[0],
        heads=max(c.heads for c in cfgs),
        d_head=max(c.dh for c in cfgs),
        d_value=max(c.d_value for c in cfgs),
    )


def plan_stacks(
    configs: Sequence[RunConfig], max_stack: int = 32, max_bytes: int = 2 << 30, max_macs: float = STACK_MACS["cpu"]
) -> List[List[RunConfig]]:
    """Pack configurations into stacks (lists of configurations with one stack key).

    A stack holds at most ``max_stack`` runs, ``max_bytes`` of materialised data and
    ``max_macs`` of padded work per step; it pads runs of different H, d_h, d_v only when that
    wastes little (``PAD_FACTOR``) or the step is small anyway (``SMALL_STEP_MACS``).
    """
    groups: Dict[tuple, List[RunConfig]] = {}
    for c in configs:
        groups.setdefault(c.stack_key(), []).append(c)
    stacks: List[List[RunConfig]] = []
    for cfgs in groups.values():
        # Similar sizes together: padding then wastes little.
        cfgs = sorted(cfgs, key=lambda c: (step_macs(c), c.T, c.seed))
        cur: List[RunConfig] = []
        for c in cfgs:
            trial = cur + [c]
            if cur:
                padded = step_macs(_padded(trial)) * len(trial)
                real = sum(step_macs(x) for x in trial)
                too_wasteful = padded > PAD_FACTOR * real and padded > SMALL_STEP_MACS
                too_big = sum(data_bytes(x) for x in trial) > max_bytes or padded > max_macs
                if len(trial) > max_stack or too_wasteful or too_big:
                    stacks.append(cur)
                    trial = [c]
            cur = trial
        if cur:
            stacks.append(cur)
    return stacks


@dataclass
class SweepSummary:
    total: int  # configurations in the sweep
    skipped: int  # already stored before this call
    trained: int  # finished and stored by this call
    wall_s: float
    by_others: int = 0  # stored meanwhile by other sweeps sharing the database


def run_sweep(
    configs: Sequence[RunConfig],
    store: ResultStore,
    experiment: str,
    device="cpu",
    progress: bool = True,
    max_stack: int = 32,
    layout: str = "rows",
    on_stored: Optional[Callable[[RunResult], None]] = None,
    log: Optional[Callable[[str], None]] = None,
    lease_s: float = DEFAULT_LEASE_S,
    poll_s: Optional[float] = None,
) -> SweepSummary:
    """Train every configuration not yet in ``store``; store each as it finishes.

    Work is claimed one stack at a time: of the runs neither stored nor claimed by a live
    sweep, the first planned stack is claimed and trained, until none is left. Runs that other
    live sweeps hold are then waited for (polling every ``poll_s`` seconds, default
    ``min(5, lease_s / 4)``), and taken over if their claimant stops renewing its lease
    (``lease_s`` seconds without a heartbeat); so when this returns, every configuration is stored.

    ``on_stored(result)`` is called after a run's row is committed. An exception (Ctrl-C
    included) propagates after the finished runs are safely stored and this sweep's claims are
    released; the runs in flight are lost and retrained by the next call.
    """
    t0 = time.perf_counter()
    configs = list(configs)
    by_key = {c.key(): c for c in configs}
    have = store.stored_keys(by_key)
    todo = [c for c in configs if c.key() not in have]
    skipped = len(configs) - len(todo)
    say = log or (lambda s: None)
    if skipped:
        say(f"{skipped} of {len(configs)} runs already stored in {store.path}; training the other {len(todo)}")
    vers = versions()
    trained = 0
    dev_type = "cuda" if str(device).startswith("cuda") else "cpu"
    poll = min(5.0, lease_s / 4) if poll_s is None else poll_s
    owner = new_owner()
    outer = None
    if progress and len(todo) > 1:
        from tqdm.auto import tqdm

        outer = tqdm(total=len(todo), desc=f"{experiment}: runs", unit="run", position=0, dynamic_ncols=True)

    def stored(res: RunResult) -> None:
        nonlocal trained
        if store.add_run(res, experiment, vers):
            trained += 1
        if outer is not None:
            outer.update(1)
        say(
            f"  {res.config.label()} T={res.config.T} seed={res.config.seed}: mem_acc {res.mem_acc:.3f} "
            f"({res.examples:.0f} examples), loss {res.loss:.4g}, in {res.steps_done} steps, {res.steps_per_s:.0f} steps/s"
            f"{', stopped early' if res.stopped_early else ''}"
        )
        if on_stored is not None:
            on_stored(res)

    waiting_said = False
    try:
        with Heartbeat(store.path, owner, interval=lease_s / 4, timeout=store.timeout):
            remaining = [c.key() for c in todo]
            while remaining:
                done = store.stored_keys(remaining)
                remaining = [k for k in remaining if k not in done]
                if not remaining:
                    break
                busy = store.claimed_by_others(remaining, owner, lease_s)
                free = [by_key[k] for k in remaining if k not in busy]
                if free:
                    stack = plan_stacks(free, max_stack=max_stack, max_macs=STACK_MACS[dev_type])[0]
                    mine = set(store.claim([c.key() for c in stack], owner, lease_s))
                    stack = [c for c in stack if c.key() in mine]
                    if stack:  # else another sweep claimed them first: look again
                        waiting_said = False
                        train_stack(stack, device=device, progress=progress, on_result=stored, layout=layout)
                    continue
                if not waiting_said:
                    say(f"waiting for {len(remaining)} runs that another sweep is training (claims in {store.path})")
                    waiting_said = True
                time.sleep(poll)
    finally:
        if outer is not None:
            outer.close()
        store.release(owner)
    by_others = len(todo) - trained
    return SweepSummary(len(configs), skipped, trained, time.perf_counter() - t0, by_others)
