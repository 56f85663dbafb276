"""Sweeps: a grid of configurations, trained in stacks, stored as they finish, resumable.

:func:`expand_grid` makes the configurations, :func:`plan_stacks` packs those not yet stored
into stacks of runs that train side by side (the seeds of one configuration: a run's numbers
are then those it has alone, bit for bit; bounded work and data size), and :func:`run_sweep` trains the stacks,
storing each run the moment it finishes. Re-running the same sweep trains only what is missing,
and sweeps running at once on one database share the work: each claims a stack's runs before
training them (a lease renewed by a heartbeat, see :mod:`.store`), so that no run is trained
twice and the runs of a sweep that died are taken over once its lease runs out.

With a :class:`RayPool` (``run_sweep(..., pool=RayPool(...))``, the ``--ray ADDRESS`` and
``--workers N`` flags), the same stacks become Ray tasks, one GPU each on a cluster with GPUs and
one CPU slot each otherwise. The driver stays the only writer of the database: each task
streams its runs back as they finish and the driver stores each one as it arrives, so a killed
driver loses only the runs in flight and resumes like any sweep. A task whose worker dies is
run again (``max_retries``); training is deterministic, so the retry gives the results the lost
attempt would have given. The stacks are planned exactly as without Ray, so the results are
identical.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

from .config import RunConfig
from .extras import install_hint, progress_bar
from .store import DEFAULT_LEASE_S, Heartbeat, ResultStore, StoreError, new_owner
from .train import RunResult, train_stack, versions

# Most work (multiply-adds of one forward step, padded, all runs) per stack. Stacking pays for
# small steps, whose cost is fixed overhead; on a CPU, large stacked steps run slower per run than
# separate ones (their tensors leave the caches). 8 stacked against one, per run, one thread:
# 1.41x at H 8, n 8, d 16 (2.6 M a step), 0.95x at H 8, n 16, d 32 (11.7 M), 0.75x at the paper's
# H 20, n 32, d 64 (99.8 M: alone under this bound); docs/results.md section 4. A GPU wants all
# the work it can get in one launch.
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


def plan_stacks(
    configs: Sequence[RunConfig], max_stack: int = 32, max_bytes: int = 2 << 30, max_macs: float = STACK_MACS["cpu"]
) -> List[List[RunConfig]]:
    """Pack configurations into stacks (lists of configurations with one stack key: the seeds
    of one configuration).

    A stack holds at most ``max_stack`` runs, ``max_bytes`` of materialised data and
    ``max_macs`` of work per step. Stacks come in the order of the configurations' first seeds.
    """
    groups: Dict[tuple, List[RunConfig]] = {}
    for c in configs:
        groups.setdefault(c.stack_key(), []).append(c)
    stacks: List[List[RunConfig]] = []
    for cfgs in groups.values():
        cfgs = sorted(cfgs, key=lambda c: c.seed)
        cur: List[RunConfig] = []
        for c in cfgs:
            trial = cur + [c]
            if cur:
                too_big = sum(data_bytes(x) for x in trial) > max_bytes or step_macs(c) * len(trial) > max_macs
                if len(trial) > max_stack or too_big:
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
    dropped: int = 0  # of those, runs this call finished too but another sweep had stored first (a lost claim)


class _StackLost(Exception):
    """Raised from a stack's result callback to stop training it: every run still training in
    it was taken over by another sweep (see _Claims.check)."""


def _runs_text(cfgs: Sequence[RunConfig], most: int = 3) -> str:
    txt = ", ".join(f"{c.label()} T={c.T} seed={c.seed}" for c in cfgs[:most])
    return txt + (f" and {len(cfgs) - most} more" if len(cfgs) > most else "")


class _Claims:
    """The runs a sweep has claimed and is training (in groups: a stack, a Ray task), checked
    against the database before each run is stored, so that a sweep whose claims were taken
    over (it went longer than the lease without renewing it: paused, suspended, starved)
    notices it, says so once, and stops training a group none of whose runs is its own."""

    def __init__(self, store: ResultStore, owner: str, lease_s: float, by_key: Dict[str, RunConfig], say):
        self.store, self.owner, self.lease_s, self.by_key, self.say = store, owner, lease_s, by_key, say
        self.inflight: Dict[str, object] = {}  # key -> its group, while training and not yet stored
        self.announced: set = set()

    def add(self, keys: Sequence[str], group: object) -> None:
        for k in keys:
            self.inflight[k] = group

    def drop_group(self, group: object) -> None:
        for k in [k for k, g in self.inflight.items() if g is group]:
            del self.inflight[k]

    def check(self, key: str) -> set:
        """Before storing the run ``key``: renew this sweep's claims, say which runs in flight
        were lost (once each), and return the groups whose other runs are all lost. ``key``
        leaves the runs in flight."""
        lost = self.store.renew(list(self.inflight), self.owner, self.lease_s)
        new = {k: v for k, v in lost.items() if k not in self.announced}
        if new:
            self.announced.update(new)
            takers = sorted({v for v in new.values() if v != "stored"})
            n_stored = sum(v == "stored" for v in new.values())
            who = f"another sweep ({', '.join(takers)})" if takers else "another sweep"
            done = f"; {n_stored} of them stored already" if n_stored and takers else ""
            self.say(
                f"claim lost: {who} took over {len(new)} run{'s' if len(new) > 1 else ''} this sweep was training "
                f"({_runs_text([self.by_key[k] for k in new])}) after this sweep went more than {self.lease_s:g} s "
                f"without renewing its lease (paused?){done}; this sweep stops training them where it can and "
                "stores none of them that another sweep stored first"
            )
        group = self.inflight.pop(key, None)
        lost_groups = set()
        if group is not None:
            rest = [k for k, g in self.inflight.items() if g is group]
            if rest and all(k in lost for k in rest):
                lost_groups.add(group)
        return lost_groups


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
    pool: Optional["RayPool"] = None,
) -> SweepSummary:
    """Train every configuration not yet in ``store``; store each as it finishes.

    Work is claimed one stack at a time: of the runs neither stored nor claimed by a live
    sweep, the first planned stack is claimed and trained, until none is left. Runs that other
    live sweeps hold are then waited for (polling every ``poll_s`` seconds, default
    ``min(5, lease_s / 4)``), and taken over if their claimant stops renewing its lease
    (``lease_s`` seconds without a heartbeat, measured by ``store.clock``); so when this
    returns, every configuration is stored.

    Before each run is stored, the sweep renews its claims and checks them (:meth:`ResultStore.renew`):
    a sweep that went longer than the lease without renewing them (paused, suspended) may find
    them taken over. It then says so in one line, stops training a stack none of whose
    remaining runs is its own (another sweep trains them), and never stores, prints as
    finished or counts as trained a run another sweep stored first (``SweepSummary.dropped``);
    a finished run nobody stored yet is stored, whoever holds its claim now.

    ``on_stored(result)`` is called after a run's row is committed. An exception (Ctrl-C
    included) propagates after the finished runs are safely stored and this sweep's claims are
    released; the runs in flight are lost and retrained by the next call. A run the database
    cannot take (damaged, locked past its timeout) is kept in the store's side file and ends
    the sweep with a :class:`~mhakern.memorize.store.StoreError` that says where.

    ``pool``: train the stacks as tasks of this :class:`RayPool` (several at once) instead of
    here; ``device`` is then ignored for the pool's own (``RayPool.device``).
    """
    t0 = time.perf_counter()
    configs = list(configs)
    by_key = {c.key(): c for c in configs}
    have = store.stored_keys(by_key)
    todo = [c for c in configs if c.key() not in have]
    skipped = len(configs) - len(todo)
    say = log or (lambda s: None)
    # A lost claim and a failing database are said even without a log (capacity searches run
    # their probes' sweeps silently).
    warn = log or (lambda s: print(s, file=sys.stderr, flush=True))
    if skipped:
        say(f"{skipped} of {len(configs)} runs already stored in {store.path}; training the other {len(todo)}")
    vers = versions()
    trained = dropped = 0
    if pool is not None:
        device = pool.device
    dev_type = "cuda" if str(device).startswith("cuda") else "cpu"
    poll = min(5.0, lease_s / 4) if poll_s is None else poll_s
    owner = new_owner()
    claims = _Claims(store, owner, lease_s, by_key, warn)
    outer = None
    if progress and len(todo) > 1:
        outer = progress_bar(total=len(todo), desc=f"{experiment}: runs", unit="run", position=0, dynamic_ncols=True)

    failure: List[StoreError] = []  # the first error of the database, once met

    def failed(e: StoreError) -> None:
        if not failure:
            failure.append(e)
            n = len(claims.inflight)
            if n:  # said now: the stack in flight may train for a while yet (the error ends the sweep)
                warn(f"{e} -- finishing the {n} run{'s' if n > 1 else ''} in flight first (their results are kept "
                     "the same way), then stopping")

    def stored(res: RunResult) -> set:
        """Store a finished run; returns the groups found wholly taken over (see _Claims.check)."""
        nonlocal trained, dropped
        c = res.config
        lost_groups: set = set()
        if not failure:
            try:
                lost_groups = claims.check(c.key())
            except StoreError as e:
                failed(e)
        claims.inflight.pop(c.key(), None)
        try:
            ok = store.add_run(res, experiment, vers)
        except StoreError as e:  # the run is in the side file (the error says where)
            failed(e)
            ok = None
        if ok:
            trained += 1
            say(
                f"  {c.label()} T={c.T} seed={c.seed}: mem_acc {res.mem_acc:.3f} "
                f"({res.examples:.0f} examples), loss {res.loss:.4g}, in {res.steps_done} steps, {res.steps_per_s:.0f} steps/s"
                f"{', stopped early' if res.stopped_early else ''}"
            )
            if on_stored is not None:
                on_stored(res)
        elif ok is not None:
            dropped += 1
            say(f"  {c.label()} T={c.T} seed={c.seed}: finished here but not stored: another sweep stored it first "
                "(its stored result is kept)")
        if outer is not None:
            outer.update(1)
        return lost_groups

    stop = lambda: bool(failure)  # noqa: E731
    crashed = False
    try:
        with Heartbeat(store.path, owner, interval=lease_s / 4, timeout=store.timeout, clock=store.clock, store=store):
            if pool is not None:
                _drive_pool(pool, todo, by_key, store, owner, lease_s, poll, max_stack, layout, STACK_MACS[dev_type],
                            stored, say, claims, stop)
            else:
                _drive_here(todo, by_key, store, owner, lease_s, poll, max_stack, STACK_MACS[dev_type], device,
                            progress, layout, stored, say, claims, stop)
    except BaseException:
        crashed = True
        raise
    finally:
        if outer is not None:
            outer.close()
        try:
            store.release(owner)
        except StoreError:
            if not (crashed or failure):  # else the error on its way out says more (and the claims run out)
                raise
    if failure:
        # One line for all that the database could not take (the first error's when only one).
        raise store.kept_error() if store.kept > 1 else failure[0]
    by_others = len(todo) - trained
    return SweepSummary(len(configs), skipped, trained, time.perf_counter() - t0, by_others, dropped)


def _drive_here(todo, by_key, store: ResultStore, owner: str, lease_s: float, poll: float, max_stack: int,
                max_macs: float, device, progress: bool, layout: str, stored, say, claims: _Claims, stop) -> None:
    """run_sweep's loop in this process: claim the first free stack and train it, until no run
    is free; then wait for the runs other sweeps hold (taking over those of dead claimants).
    Ends after the stack in flight once ``stop()`` (the database failed)."""
    remaining = [c.key() for c in todo]
    waiting_said = False
    while remaining and not stop():
        done = store.stored_keys(remaining)
        remaining = [k for k in remaining if k not in done]
        if not remaining:
            break
        busy = store.claimed_by_others(remaining, owner, lease_s)
        free = [by_key[k] for k in remaining if k not in busy]
        if free:
            stack = plan_stacks(free, max_stack=max_stack, max_macs=max_macs)[0]
            mine = set(store.claim([c.key() for c in stack], owner, lease_s))
            stack = [c for c in stack if c.key() in mine]
            if stack:  # else another sweep claimed them first: look again
                waiting_said = False
                group = object()
                claims.add([c.key() for c in stack], group)

                def on_result(res: RunResult) -> None:
                    if group in stored(res):
                        raise _StackLost()

                try:
                    train_stack(stack, device=device, progress=progress, on_result=on_result, layout=layout)
                except _StackLost:
                    pass
                finally:
                    claims.drop_group(group)
            continue
        if not waiting_said:
            say(f"waiting for {len(remaining)} runs that another sweep is training (claims in {store.path})")
            waiting_said = True
        time.sleep(poll)


# ---------------------------------------------------------------------------- Ray
RAY_MISSING = f"Ray is not installed; install the optional extra: {install_hint('ray')}"


class RayUnavailable(RuntimeError):
    """Ray cannot be imported or the cluster cannot be reached; the message is one line."""


def _import_ray():
    try:
        import ray
    except ImportError:
        raise RayUnavailable(RAY_MISSING) from None
    return ray


def _stack_task(configs: List[RunConfig], device: str, layout: str, threads: int, crash_once: Optional[str]):
    """Body of a Ray task: train one stack on this worker and yield each run's result as it
    finishes (a streaming generator, so that the driver stores runs one by one).

    ``crash_once`` (tests only): a file path; when the file does not exist yet the worker creates
    it and dies at once (``os._exit``), as a worker lost with its machine would, so that Ray's
    retry is exercised deterministically.
    """
    if crash_once is not None and not os.path.exists(crash_once):
        with open(crash_once, "w") as f:
            f.write(str(os.getpid()))
        os._exit(1)
    import torch

    if threads > 0:
        torch.set_num_threads(threads)
    out: "queue.Queue" = queue.Queue()
    failed: List[BaseException] = []

    def work():
        try:
            train_stack(configs, device=device, progress=False, on_result=out.put, layout=layout)
        except BaseException as e:  # handed to the generator, which raises it in the task
            failed.append(e)
        finally:
            out.put(None)

    # train_stack reports runs through a callback; a thread turns the callbacks into yields.
    t = threading.Thread(target=work, name="mhakern-stack", daemon=True)
    t.start()
    while True:
        res = out.get()
        if res is None:
            break
        yield res
    t.join()
    if failed:
        raise failed[0]


def _check_reachable(address: str, timeout: float = 10.0) -> None:
    """A HOST:PORT address must accept a TCP connection within ``timeout`` seconds: Ray itself
    keeps retrying an unreachable cluster for minutes before it gives up."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return  # "auto", or a ray:// client address: Ray reports those itself
    import socket

    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as e:
        raise RayUnavailable(f"cannot reach a Ray cluster at {address}: {e.strerror or e}") from None


class RayPool:
    """Stacks trained as Ray tasks on a cluster (``address``) or on a local Ray started here.

    Args:
        address: a running cluster's address ("auto", "HOST:PORT" or "ray://HOST:PORT"); None
            starts a local Ray on this machine with ``workers`` CPU slots (default: its cores).
        workers: CPU slots of the local Ray (only without ``address``).
        device: "cuda" or "cpu" for every task; None: "cuda" when the cluster has GPUs (one
            GPU per task), else "cpu" (one CPU slot per task).
        threads: torch threads in each task (default: this process's ``torch.get_num_threads()``,
            so that a run gives the same numbers with and without Ray).
        max_retries: how often a task whose worker died is run again.
        crash_once: tests only, see :func:`_stack_task`.

    Use as a context manager, or call :meth:`close`: a local Ray is shut down there.
    """

    def __init__(self, address: Optional[str] = None, workers: Optional[int] = None, device: Optional[str] = None,
                 threads: Optional[int] = None, max_retries: int = 3, crash_once: Optional[str] = None):
        ray = _import_ray()
        import torch

        self.ray = ray
        self._owns = False
        if address:
            _check_reachable(address)
        if not ray.is_initialized():  # else: this process is already connected (tests, notebooks)
            kw = dict(include_dashboard=False, log_to_driver=False, logging_level="WARNING")
            try:
                if address:
                    ray.init(address=address, **kw)
                else:
                    ray.init(num_cpus=workers or os.cpu_count() or 1, **kw)
                    self._owns = True
            except (ConnectionError, RuntimeError, ValueError) as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise RayUnavailable(f"cannot connect to Ray at {address or 'a local start'}: {first}") from None
        res = ray.cluster_resources()
        self.gpus = int(res.get("GPU", 0))
        self.cpus = int(res.get("CPU", 0))
        if device is None:
            device = "cuda" if self.gpus > 0 else "cpu"
        if str(device).startswith("cuda") and self.gpus == 0:
            raise RayUnavailable(f"device {device} asked but the Ray cluster has no GPU (resources: {res})")
        self.device = "cuda" if str(device).startswith("cuda") else "cpu"
        self.threads = torch.get_num_threads() if threads is None else int(threads)
        self.max_retries = int(max_retries)
        self.crash_once = crash_once
        opts = dict(max_retries=self.max_retries, retry_exceptions=False)
        if self.device == "cuda":
            opts.update(num_gpus=1, num_cpus=1)
        else:
            opts.update(num_cpus=1)
        self._task = ray.remote(**opts)(_stack_task)

    @property
    def slots(self) -> int:
        """Tasks that can run at once."""
        return max(1, self.gpus if self.device == "cuda" else self.cpus)

    def submit(self, stack: List[RunConfig], layout: str = "rows"):
        """Start one stack; returns the task's stream of results (an ObjectRefGenerator)."""
        return self._task.remote(list(stack), self.device, layout, self.threads, self.crash_once)

    def close(self) -> None:
        if self._owns and self.ray.is_initialized():
            self.ray.shutdown()
        self._owns = False

    def __enter__(self) -> "RayPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _drive_pool(pool: RayPool, todo, by_key, store: ResultStore, owner: str, lease_s: float, poll: float,
                max_stack: int, layout: str, max_macs: float, stored, say, claims: _Claims, stop) -> None:
    """run_sweep's loop on a pool: claim and submit every free stack, store runs as they stream
    back, wait for runs that other sweeps hold (taking over those of dead claimants); a task
    whose remaining runs were all taken over by another sweep is cancelled. Once ``stop()`` (the
    database failed), no stack is submitted and the tasks in flight are drained."""
    ray = pool.ray
    pending: Dict[object, List[str]] = {}  # task stream -> keys of its stack
    remaining = [c.key() for c in todo]
    waiting_said = False
    try:
        while remaining or pending:
            if stop():  # the database failed: no new stack; the tasks in flight finish, kept aside
                remaining = []
            if remaining:
                done = store.stored_keys(remaining)
                remaining = [k for k in remaining if k not in done]
            inflight = {k for ks in pending.values() for k in ks}
            busy = store.claimed_by_others([k for k in remaining if k not in inflight], owner, lease_s)
            free = [by_key[k] for k in remaining if k not in inflight and k not in busy]
            if free:
                # The same stacks, in the same order, as the loop without a pool plans them.
                for stack in plan_stacks(free, max_stack=max_stack, max_macs=max_macs):
                    mine = set(store.claim([c.key() for c in stack], owner, lease_s))
                    stack = [c for c in stack if c.key() in mine]
                    if stack:
                        gen = pool.submit(stack, layout)
                        pending[gen] = [c.key() for c in stack]
                        claims.add(pending[gen], gen)
                        waiting_said = False
            if pending:
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=poll)
                for gen in ready:
                    if gen not in pending:  # cancelled just now: its runs were taken over
                        continue
                    try:
                        ref = next(gen)
                    except StopIteration:
                        del pending[gen]
                        claims.drop_group(gen)
                        continue
                    # A task that failed for good raises here (after its retries).
                    for lost in stored(ray.get(ref)):
                        try:
                            ray.cancel(lost)
                        except Exception:  # finished meanwhile: its last results are not needed
                            pass
                        pending.pop(lost, None)
                        claims.drop_group(lost)
            elif remaining:
                if not waiting_said:
                    say(f"waiting for {len(remaining)} runs that another sweep is training (claims in {store.path})")
                    waiting_said = True
                time.sleep(poll)
    finally:
        # Stop this sweep's tasks still running (an error or Ctrl-C here): their runs are lost
        # anyway, and their claims are released by run_sweep.
        for gen in pending:
            try:
                ray.cancel(gen)
            except Exception:  # already finished or its worker gone: nothing left to stop
                pass
