"""The trainer's store under damage and lost claims.

Damaged stores are built in tmp_path (garbage inside a valid file, a truncated file, a file that
is not SQLite, damage that appears while a sweep trains); a sweep paused past its claim lease is
simulated with an injected clock, so nothing here sleeps or depends on timing. Runs are tiny
(one head, a few steps): the whole file takes a few seconds.
"""
import dataclasses
import os
import sqlite3

import pytest

from mhakern.memorize import cli
from mhakern.memorize import sweep as S
from mhakern.memorize.config import RunConfig
from mhakern.memorize.store import DEFAULT_LEASE_S, ResultStore, StoreDamaged, StoreError, side_path
from mhakern.memorize.sweep import run_sweep
from mhakern.memorize.train import RunResult, train_stack

TINY = RunConfig(heads=1, context=2, d_model=4, T=8, steps=2, eval_every=1)
TINY_FLAGS = ["-H", "1", "-n", "2", "-d", "4", "--eval-every", "1", "--no-progress"]
# A stack holds the seeds of one configuration (RunConfig.stack_key), so its runs share a step
# budget; tests that need runs of one stack to finish at different steps get that from the
# trainer's early stop (at 100% training accuracy, as the paper). With this configuration, on
# the CPU with one thread, seed 0 memorizes its 2 examples after 3 of its 6 steps and seeds 1
# and 2 do not, so they train to step 6 (checked by _check_early_stop: if a change of the
# trainer moves this, the check says so and the seeds are to be picked again).
EARLY = dataclasses.replace(TINY, T=2, steps=6, lr=0.2)
EARLY_FLAGS = TINY_FLAGS + ["-T", "2", "--steps", "6", "--lr", "0.2"]
EARLY_STEPS = [3, 6, 6]  # steps_done of seeds 0, 1, 2


def _check_early_stop(steps_done, stopped_early) -> None:
    n = len(steps_done)
    assert (list(steps_done), list(stopped_early)) == (EARLY_STEPS[:n], [True] + [False] * (n - 1)), (
        f"the trainer's early stop moved (seeds 0..{n - 1} of EARLY finished after steps {list(steps_done)}, "
        f"expected {EARLY_STEPS[:n]}): pick a configuration whose first seed stops early and whose others do not")


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def _fake(cfg: RunConfig, mem_acc: float = 0.5) -> RunResult:
    """A finished run's result without training (for stores that only need rows)."""
    return RunResult(cfg, mem_acc, mem_acc, mem_acc, 1.0, cfg.steps, False, 0.1, 20.0, 1, "cpu", "cpu",
                     history=[(1, mem_acc, 1.0)] * 20)


def _filled_store(path: str, runs: int = 60) -> None:
    """A closed store of ``runs`` rows: pages enough for damage at 8192 and beyond."""
    store = ResultStore(path)
    for i in range(runs):
        store.add_run(_fake(dataclasses.replace(TINY, T=100 + i)), "old", {})
    store.close()
    assert os.path.getsize(path) > 8 * 4096 and not os.path.exists(path + "-wal")


def _damage(path: str, how: str, offset: int = 8192) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        if how == "garbage":  # 4 KiB of garbage inside a valid file: its header is intact
            f.seek(offset)
            f.write(bytes((i * 37 + 11) % 256 for i in range(4096)))
        elif how == "truncated":  # cut at a page boundary: the schema survives, rows do not
            f.truncate((size // 4096 // 2) * 4096)
        elif how == "not-sqlite":
            f.seek(0)
            f.write(b"this is a text file, not a database\n" * 100)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _one_error_line(capsys, out=None) -> str:
    """The one line on stderr (``out``, a list: the stdout is appended to it)."""
    cap = capsys.readouterr()
    if out is not None:
        out.append(cap.out)
    err = cap.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mhakern-memorize: error: --db: "), err
    return err[0]


# ---------------------------------------------------------------------------- damaged when opened
@pytest.mark.parametrize("how", ["garbage", "truncated", "not-sqlite"])
def test_a_damaged_store_is_refused_in_one_line_and_left_untouched(tmp_path, capsys, how):
    db = str(tmp_path / "r.sqlite")
    _filled_store(db)
    _damage(db, how)
    before = _read(db)
    rc = cli.main(["run"] + TINY_FLAGS + ["-T", "8", "--steps", "2", "--db", db, "--out", str(tmp_path)])
    line = _one_error_line(capsys)
    assert rc == 2 and db in line
    if how == "not-sqlite":
        assert "not a usable SQLite database" in line and "point --db at another file" in line, line
    else:  # names the damage and how to recover what the file holds
        assert "is damaged" in line and f"sqlite3 {db} .recover" in line and "point --db at another file" in line, line
    assert _read(db) == before  # not written, not even by a checkpoint when closing
    assert not os.path.exists(side_path(db))  # refused before anything trained


def test_damage_no_query_of_the_job_would_meet_is_refused_too(tmp_path):
    # Garbage in the runs' pages, and a job that writes memory-store results only: without the
    # check at open it would write into the damaged file and succeed.
    db = str(tmp_path / "r.sqlite")
    _filled_store(db)
    _damage(db, "garbage", offset=os.path.getsize(db) - 4096)
    before = _read(db)
    with pytest.raises(StoreDamaged, match="integrity_check"):
        ResultStore(db).add_store_results("stores", [], {"store": "linear", "d_k": 8})
    assert _read(db) == before


# ---------------------------------------------------------------------------- damaged during a sweep
@pytest.mark.parametrize("where", ["index", "rows"])
def test_damage_during_a_sweep_loses_no_finished_run(tmp_path, capsys, monkeypatch, where):
    """The file is damaged while the first stack trains (on a page that storing a run meets, or
    one it does not): the finished runs go to the side file, the command ends with one line and
    status 2, the file is not written again; once recovered, the kept runs are added, once."""
    db = str(tmp_path / "r.sqlite")
    _filled_store(db)
    healthy = _read(db)
    offset = 8192 if where == "index" else os.path.getsize(db) - 4096
    real = S.train_stack
    damaged = {}

    def train_then_damage(stack, **kw):
        _damage(db, "garbage", offset)
        damaged["bytes"] = _read(db)
        return real(stack, **kw)

    monkeypatch.setattr(S, "train_stack", train_then_damage)
    # Two runs in one stack (two seeds) that finish at different steps (seed 0 stops early): the
    # second trains on after the damage was found, finishes, and is kept as well.
    argv = ["sweep"] + EARLY_FLAGS + ["--seeds", "0,1", "--db", db, "--out", str(tmp_path)]
    rc = cli.main(argv)
    out = []
    line = _one_error_line(capsys, out)
    assert rc == 2 and f"{db} is damaged" in line and f"2 finished results are kept in {side_path(db)}" in line, line
    # Found when seed 0 (stopped early) was stored, seed 1 still training.
    assert "T=2 seed=0 is kept in" in out[0], out
    assert "finishing the 1 run in flight first" in out[0], out
    assert _read(db) == damaged["bytes"]  # nothing written since the damage
    with open(side_path(db)) as f:
        assert len(f.readlines()) == 2

    # Recovery (as the message says; here the healthy copy stands in for what .recover gives).
    for p in (db + "-wal", db + "-shm"):
        if os.path.exists(p):
            os.remove(p)
    with open(db, "wb") as f:
        f.write(healthy)
    store = ResultStore(db)
    assert store.imported == 2 and not os.path.exists(side_path(db))
    new = store.runs("sweep")
    new.sort(key=lambda r: r["seed"])
    assert [r["seed"] for r in new] == [0, 1] and all(r["steps"] == 6 for r in new)
    _check_early_stop([r["steps_done"] for r in new], [bool(r["stopped_early"]) for r in new])
    store.close()
    assert ResultStore(db).imported == 0  # added once
    monkeypatch.setattr(S, "train_stack", real)
    assert cli.main(argv) == 0 and "2 of 2 runs already stored" in capsys.readouterr().out


def test_a_run_the_database_cannot_take_is_kept_and_added_later(tmp_path):
    """Not damage: the database locked past the store's timeout (zero here, so nothing waits)."""
    db = str(tmp_path / "r.sqlite")
    store = ResultStore(db, timeout=0.0)
    other = sqlite3.connect(db, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
    with pytest.raises(StoreError, match="locked") as e:
        store.add_run(_fake(TINY, 0.25), "exp", {})
    assert not isinstance(e.value, StoreDamaged)
    assert f"kept in {side_path(db)}" in str(e.value) and "run the same command again" in str(e.value)
    other.execute("ROLLBACK")
    other.close()
    with open(side_path(db), "a") as f:
        f.write('{"id": "cut sh')  # a line cut short by a crash: skipped, the file kept for a look
    again = ResultStore(db)
    assert again.imported == 1 and again.run_by_key(TINY.key())["mem_acc"] == 0.25
    assert os.path.exists(side_path(db)) and ResultStore(db).imported == 0
    assert again.add_run(_fake(TINY, 0.75), "exp", {}) is False  # stored once, the first kept


# ---------------------------------------------------------------------------- lost claims
class _Clock:
    """Seconds since the epoch that only move when a test moves them."""

    def __init__(self):
        self.t = 1.0e9

    def __call__(self) -> float:
        return self.t


def _paused_sweep(tmp_path, monkeypatch, take_over):
    """Run a sweep of one stack of 3 runs (seeds 0, 1, 2 of EARLY: finishing at steps 3, 6, 6)
    that is 'paused' for ten leases right after claiming it; ``take_over(other, keys, results)``
    is what another sweep does meanwhile. Returns (summary, log lines, runs this sweep stored, other, keys, results)."""
    db = str(tmp_path / "r.sqlite")
    clock = _Clock()
    cfgs = [dataclasses.replace(EARLY, seed=s) for s in range(3)]
    keys = [c.key() for c in cfgs]
    trained = train_stack(cfgs, progress=False)
    _check_early_stop([r.steps_done for r in trained], [r.stopped_early for r in trained])
    results = {r.config.key(): r for r in trained}
    other = ResultStore(db, clock=clock)
    real = S.train_stack

    def paused(stack, **kw):
        assert [c.key() for c in stack] == keys
        clock.t += 10 * DEFAULT_LEASE_S  # SIGSTOP, a suspended machine: no heartbeat meanwhile
        take_over(other, keys, results)
        return real(stack, **kw)

    monkeypatch.setattr(S, "train_stack", paused)
    said, mine = [], []

    def log(msg):
        said.append(msg)
        if "another sweep is training" in msg:  # the other sweep finishes while this one waits
            for k in keys:
                other.add_run(results[k], "other", {})

    store = ResultStore(db, clock=clock)
    summary = run_sweep(cfgs, store, "mine", progress=False, max_stack=3, log=log, poll_s=0.0, on_stored=mine.append)
    assert store.conn.execute("SELECT COUNT(*) FROM claims").fetchone()[0] == 0
    return summary, said, mine, other, keys, results


def test_a_sweep_paused_past_its_lease_stops_training_what_was_taken_over(tmp_path, monkeypatch):
    def take_all(other, keys, results):
        assert other.claim(keys, "elsewhere:1:x") == keys  # the lease ran out: all taken over
        other.add_run(results[keys[0]], "other", {})  # and the first run stored

    summary, said, mine, other, keys, _ = _paused_sweep(tmp_path, monkeypatch, take_all)
    lost = [s for s in said if s.startswith("claim lost")]
    assert len(lost) == 1 and "took over 3 runs" in lost[0] and "elsewhere:1:x" in lost[0], said
    # Nothing printed as finished, stored or counted here: the first run finished here too but
    # was stored first by the other sweep; the other two stopped training when the loss was seen.
    assert not any("mem_acc" in s for s in said) and mine == []
    assert sum("finished here but not stored" in s for s in said) == 1
    assert (summary.trained, summary.by_others, summary.dropped) == (0, 3, 1)
    assert {r["key"]: r["experiment"] for r in other.runs()} == {k: "other" for k in keys}


def test_a_lapsed_claim_nobody_took_is_renewed_and_the_runs_stored(tmp_path, monkeypatch):
    summary, said, mine, other, keys, results = _paused_sweep(tmp_path, monkeypatch, lambda *a: None)
    assert not any(s.startswith("claim lost") for s in said), said
    assert summary.trained == 3 and len(mine) == 3
    assert [r["experiment"] for r in other.runs()] == ["mine"] * 3


def test_a_run_taken_over_but_not_stored_yet_is_stored_once(tmp_path, monkeypatch):
    def take_first(other, keys, results):
        assert other.claim(keys[:1], "elsewhere:1:x") == keys[:1]

    summary, said, mine, other, keys, results = _paused_sweep(tmp_path, monkeypatch, take_first)
    lost = [s for s in said if s.startswith("claim lost")]
    assert len(lost) == 1 and "took over 1 run " in lost[0], said
    # This sweep's other runs are still its own: the stack trains on, and the finished run that
    # nobody stored yet is stored (and counted) here; the other sweep's copy is not stored again.
    assert summary.trained == 3 and summary.dropped == 0 and len(mine) == 3
    assert other.add_run(results[keys[0]], "other", {}) is False
    assert [r["experiment"] for r in other.runs()] == ["mine"] * 3


class _FakeRay:
    """What the sweep's Ray driver calls of Ray, in this process: a task's stream yields its
    stack's results one by one (trained when submitted)."""

    def __init__(self):
        self.cancelled = []

    def wait(self, gens, num_returns, timeout):
        return gens[:num_returns], gens[num_returns:]

    def get(self, ref):
        return ref

    def cancel(self, gen):
        self.cancelled.append(gen)


class _FakePool:
    device = "cpu"

    def __init__(self, before_training):
        self.ray = _FakeRay()
        self.before_training = before_training

    def submit(self, stack, layout="rows"):
        self.before_training(stack)
        return iter(train_stack(stack, progress=False, layout=layout))


def test_a_ray_driver_paused_past_its_lease_cancels_the_task_taken_over(tmp_path):
    db = str(tmp_path / "r.sqlite")
    clock = _Clock()
    cfgs = [dataclasses.replace(EARLY, seed=s) for s in range(3)]
    keys = [c.key() for c in cfgs]
    theirs = {r.config.key(): r for r in train_stack(cfgs, progress=False)}
    other = ResultStore(db, clock=clock)

    def paused(stack):
        clock.t += 10 * DEFAULT_LEASE_S
        assert other.claim(keys, "elsewhere:1:x") == keys
        other.add_run(theirs[keys[0]], "other", {})

    def log(msg):
        said.append(msg)
        if "another sweep is training" in msg:
            for k in keys:
                other.add_run(theirs[k], "other", {})

    said, pool = [], _FakePool(paused)
    summary = run_sweep(cfgs, ResultStore(db, clock=clock), "mine", progress=False, max_stack=3, log=log,
                        poll_s=0.0, pool=pool)
    assert len(pool.ray.cancelled) == 1 and sum(s.startswith("claim lost") for s in said) == 1, said
    assert (summary.trained, summary.by_others, summary.dropped) == (0, 3, 1)
    assert {r["experiment"] for r in other.runs()} == {"other"}


def test_an_open_that_meets_a_lock_sqlite_will_not_wait_for_tries_again(tmp_path, monkeypatch):
    """Two sweeps opening one new database at once: where waiting could deadlock, SQLite
    answers "database is locked" at once instead of waiting out the busy timeout (a real race,
    seen in CI); the open tries its check-and-schema step again instead of failing."""
    db = str(tmp_path / "r.sqlite")
    ResultStore(db).close()
    real = ResultStore._check
    calls = []

    def locked_once(self, pragma):
        calls.append(pragma)
        if len(calls) == 1:
            raise sqlite3.OperationalError("database is locked")
        return real(self, pragma)

    monkeypatch.setattr(ResultStore, "_check", locked_once)
    store = ResultStore(db)
    assert calls == ["integrity_check", "integrity_check"] and store.damaged is None
    store.close()
    # A lock that outlasts the timeout still fails, naming the file.
    monkeypatch.setattr(ResultStore, "_check", lambda self, pragma: (_ for _ in ()).throw(
        sqlite3.OperationalError("database is locked")))
    with pytest.raises(StoreError, match="database is locked"):
        ResultStore(db, timeout=0.0)
