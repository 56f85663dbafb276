"""Results in an embedded SQLite database: one row per finished run, crash-safe, resumable.

Every finished run is written in its own transaction the moment it finishes, so a Ctrl-C or a
kill loses at most the runs still training; SQLite's journal (write-ahead log, fully synced)
never leaves the file half-written. The row's ``key`` is the hash of the run's resolved
configuration (:meth:`RunConfig.key`): a sweep asks :meth:`ResultStore.stored_keys` which of
its runs exist and trains only the others.

Several sweeps may share one database (on one machine or on a shared file system that SQLite
locks correctly): before training runs, a sweep *claims* them in the ``claims`` table, each
claim a lease that its owner's heartbeat (:class:`Heartbeat`, a thread) renews every few
seconds. A run stored, or claimed by a live owner, is not trained by another sweep; a claim
whose heartbeat is older than the lease belongs to a dead process and is taken over, and so is
at once a claim of a process of this host that no longer exists (a killed sweep restarted on
the same machine does not wait for its own old lease).

Tables: ``runs`` (trainer runs), ``capacities`` (capacity searches), ``store_curves`` and
``store_capacities`` (memory-store experiments), ``claims`` (runs being trained).
:meth:`ResultStore.export_csv` writes any of them as CSV.

Bad paths (a folder, a path under a file, a place this user cannot write, a file that is not a
SQLite database) raise :class:`StoreError`, a ValueError whose message starts with ``--db:``
and says what is wrong in one line.
"""
from __future__ import annotations

import csv
import json
import os
import socket
import sqlite3
import threading
import time
import uuid
from typing import Any, Dict, Iterable, List, Optional, Sequence

from .config import CONFIG_FIELDS, RunConfig, from_dict

_RUN_COLUMNS = (
    # configuration (resolved)
    "heads INTEGER", "context INTEGER", "d_model INTEGER", "d_in INTEGER", "d_head INTEGER",
    "d_value INTEGER", "T INTEGER", "data TEXT", "dist TEXT", "task TEXT", "classes INTEGER",
    "seed INTEGER", "steps INTEGER", "batch INTEGER", "lr REAL", "warmup REAL", "eval_every INTEGER", "eval_last INTEGER",
    "target_acc REAL", "reg_tol REAL", "reg_rule TEXT", "early_stop INTEGER", "init TEXT", "analysis INTEGER",
    "impl TEXT", "backend TEXT", "dtype TEXT",
    # outcome
    "mem_acc REAL", "examples REAL", "best_acc REAL", "final_acc REAL", "loss REAL",
    "steps_done INTEGER", "stopped_early INTEGER", "wall_s REAL", "steps_per_s REAL",
    "examples_per_s REAL", "stack_size INTEGER", "backend_used TEXT", "device TEXT",
    "versions TEXT", "history TEXT", "finished_at TEXT", "saturation TEXT",
)

_SCHEMA = [
    "CREATE TABLE IF NOT EXISTS runs (id INTEGER PRIMARY KEY, key TEXT UNIQUE NOT NULL, "
    "experiment TEXT NOT NULL, config TEXT NOT NULL, " + ", ".join(_RUN_COLUMNS) + ")",
    "CREATE INDEX IF NOT EXISTS runs_experiment ON runs (experiment)",
    "CREATE TABLE IF NOT EXISTS capacities (id INTEGER PRIMARY KEY, key TEXT UNIQUE NOT NULL, "
    "experiment TEXT NOT NULL, config TEXT NOT NULL, heads INTEGER, context INTEGER, d_model INTEGER, "
    "d_head INTEGER, data TEXT, task TEXT, target_acc REAL, seeds TEXT, per_seed TEXT, "
    "capacity_mean REAL, capacity_min REAL, capacity_max REAL, probes INTEGER, wall_s REAL, finished_at TEXT)",
    "CREATE TABLE IF NOT EXISTS store_curves (id INTEGER PRIMARY KEY, experiment TEXT NOT NULL, "
    "store TEXT NOT NULL, d_k INTEGER, d_v INTEGER, param TEXT, M INTEGER, isr REAL, isr_pred REAL, "
    "isr_formula REAL, recall REAL, queries INTEGER, finished_at TEXT)",
    "CREATE TABLE IF NOT EXISTS store_capacities (id INTEGER PRIMARY KEY, experiment TEXT NOT NULL, "
    "store TEXT NOT NULL, d_k INTEGER, d_v INTEGER, param TEXT, capacity REAL, capacity_pred REAL, "
    "capacity_formula REAL, M_max INTEGER, backend TEXT, device TEXT, wall_s REAL, finished_at TEXT)",
    # heartbeat and claimed_at: seconds since the epoch (time.time()), comparable across processes.
    "CREATE TABLE IF NOT EXISTS claims (key TEXT PRIMARY KEY, owner TEXT NOT NULL, heartbeat REAL NOT NULL, "
    "claimed_at REAL NOT NULL)",
]

#: Result tables (``claims`` is bookkeeping, not results).
TABLES = ("runs", "capacities", "store_curves", "store_capacities")

#: Seconds without a heartbeat after which a claim is considered dead and may be taken over.
DEFAULT_LEASE_S = 120.0


class StoreError(ValueError):
    """The database cannot be created, opened or written; the message is one line naming --db."""


def new_owner() -> str:
    """A claimant id unique across machines and processes: host, pid and a random tag."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def owner_is_dead_here(owner: str) -> bool:
    """True when ``owner`` (a :func:`new_owner` id) names a process of this host that no longer
    exists. Its claims need not wait for their lease to run out: a sweep killed and started
    again on the same machine resumes at once. Owners on other hosts, and ids of another form,
    are never judged here (their lease decides)."""
    host, _, rest = owner.partition(":")
    pid_text = rest.partition(":")[0]
    if host != socket.gethostname() or not pid_text.isdigit():
        return False
    pid = int(pid_text)
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # exists, owned by another user
        return False
    return False


def _check_path(path: str) -> None:
    """Raise StoreError when ``path`` cannot hold a database file (before SQLite tries)."""
    ap = os.path.abspath(path)
    if os.path.isdir(ap):
        raise StoreError(f"--db: {path} is a folder; give a file path such as {os.path.join(path, 'memorize.sqlite')}")
    folder = os.path.dirname(ap)
    probe = folder
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise StoreError(f"--db: cannot create {path}: {probe} is a file, not a folder")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise StoreError(f"--db: cannot create the folder {folder} for {path}: {e.strerror or e}") from None
    if os.path.exists(ap):
        if not os.access(ap, os.R_OK | os.W_OK):
            raise StoreError(f"--db: {path} exists but this user cannot read and write it")
    elif not os.access(folder, os.W_OK | os.X_OK):
        raise StoreError(f"--db: cannot create {path}: no write permission in the folder {folder}")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime())


class ResultStore:
    """A results database at ``path`` (created with its folder if missing).

    Safe to open from several processes: SQLite serialises writers (``timeout`` seconds of
    waiting for a lock before giving up).
    """

    def __init__(self, path: str, timeout: float = 60.0):
        self.path = path
        self.timeout = timeout
        _check_path(path)
        try:
            self.conn = sqlite3.connect(path, timeout=timeout, isolation_level=None)
        except sqlite3.Error as e:
            raise StoreError(f"--db: cannot open {path} as a database: {e}") from None
        self.conn.row_factory = sqlite3.Row
        try:
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=FULL")
            with self.transaction():
                for stmt in _SCHEMA:
                    self.conn.execute(stmt)
                self._add_missing_columns()
        except sqlite3.OperationalError as e:
            self.conn.close()
            msg = str(e)
            if "readonly" in msg or "unable to open" in msg or "disk I/O" in msg:
                raise StoreError(f"--db: cannot write {path} ({msg}): check the permissions of the file and its folder") from None
            raise StoreError(f"--db: {path}: {msg}") from None
        except sqlite3.DatabaseError as e:
            self.conn.close()
            raise StoreError(f"--db: {path} is not a usable SQLite database ({e})") from None

    def _add_missing_columns(self) -> None:
        """Databases written before a column existed get it (NULL in their old rows)."""
        have = {r[1] for r in self.conn.execute("PRAGMA table_info(runs)")}
        for col in _RUN_COLUMNS:
            if col.split()[0] not in have:
                self.conn.execute(f"ALTER TABLE runs ADD COLUMN {col}")

    # ------------------------------------------------------------------ plumbing
    def transaction(self):
        return _Transaction(self.conn)

    def close(self) -> None:
        self.conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ trainer runs
    def stored_keys(self, keys: Iterable[str]) -> set:
        keys = list(keys)
        found = set()
        for i in range(0, len(keys), 500):
            part = keys[i : i + 500]
            q = f"SELECT key FROM runs WHERE key IN ({','.join('?' * len(part))})"
            found.update(r[0] for r in self.conn.execute(q, part))
        return found

    def add_run(self, result, experiment: str, versions: Dict[str, str]) -> bool:
        """Store a finished run (a :class:`~mhakern.memorize.train.RunResult`). Returns False
        when its key was already stored (the stored row is kept)."""
        cfg: RunConfig = result.config
        d = cfg.as_dict()
        row = {k: d[k] for k in CONFIG_FIELDS if k != "min_steps"}
        row.update(
            key=cfg.key(),
            experiment=experiment,
            config=json.dumps(d, sort_keys=True),
            mem_acc=result.mem_acc,
            examples=result.examples,
            best_acc=result.best_acc,
            final_acc=result.final_acc,
            loss=result.loss,
            steps_done=result.steps_done,
            stopped_early=int(result.stopped_early),
            wall_s=result.wall_s,
            steps_per_s=result.steps_per_s,
            examples_per_s=result.examples_per_s,
            stack_size=result.stack_size,
            backend_used=result.backend_used,
            device=result.device,
            versions=json.dumps(versions, sort_keys=True),
            history=json.dumps(result.history),
            saturation=None if result.analysis is None else json.dumps(result.analysis),
            finished_at=_now(),
        )
        cols = list(row)
        sql = f"INSERT OR IGNORE INTO runs ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})"
        with self.transaction():
            cur = self.conn.execute(sql, [row[c] for c in cols])
            # The run is done: its claim (whoever held it) has nothing left to protect.
            self.conn.execute("DELETE FROM claims WHERE key = ?", (row["key"],))
        return cur.rowcount == 1

    # ------------------------------------------------------------------ claims (leases)
    def claim(self, keys: Iterable[str], owner: str, lease_s: float = DEFAULT_LEASE_S) -> List[str]:
        """Claim for ``owner`` those of ``keys`` that are neither stored nor claimed by a live
        owner (one whose heartbeat is at most ``lease_s`` old); returns the keys now held, in
        order. Atomic: of two sweeps claiming at once, each key goes to one."""
        keys = list(dict.fromkeys(keys))
        got: List[str] = []
        with self.transaction():
            now = time.time()
            stored = self._stored_in_txn(keys)
            for k in keys:
                if k in stored:
                    continue
                r = self.conn.execute("SELECT owner, heartbeat FROM claims WHERE key = ?", (k,)).fetchone()
                if r is None or r[0] == owner or now - r[1] > lease_s or owner_is_dead_here(r[0]):
                    self.conn.execute(
                        "INSERT OR REPLACE INTO claims (key, owner, heartbeat, claimed_at) VALUES (?, ?, ?, ?)",
                        (k, owner, now, now),
                    )
                    got.append(k)
        return got

    def claimed_by_others(self, keys: Iterable[str], owner: str, lease_s: float = DEFAULT_LEASE_S) -> Dict[str, str]:
        """{key: owner} of ``keys`` held by another live owner."""
        keys = list(keys)
        now = time.time()
        out: Dict[str, str] = {}
        for i in range(0, len(keys), 500):
            part = keys[i : i + 500]
            q = f"SELECT key, owner, heartbeat FROM claims WHERE key IN ({','.join('?' * len(part))})"
            for k, o, hb in self.conn.execute(q, part):
                if o != owner and now - hb <= lease_s and not owner_is_dead_here(o):
                    out[k] = o
        return out

    def release(self, owner: str) -> None:
        """Drop every claim of ``owner`` (its runs in flight are free for others at once)."""
        with self.transaction():
            self.conn.execute("DELETE FROM claims WHERE owner = ?", (owner,))

    def _stored_in_txn(self, keys: List[str]) -> set:
        found = set()
        for i in range(0, len(keys), 500):
            part = keys[i : i + 500]
            q = f"SELECT key FROM runs WHERE key IN ({','.join('?' * len(part))})"
            found.update(r[0] for r in self.conn.execute(q, part))
        return found

    def runs(self, experiment: Optional[str] = None, where: str = "", params: Sequence[Any] = ()) -> List[Dict[str, Any]]:
        """Stored runs as dicts (``experiment=None``: all experiments)."""
        clauses, args = [], []
        if experiment is not None:
            clauses.append("experiment = ?")
            args.append(experiment)
        if where:
            clauses.append(f"({where})")
            args.extend(params)
        sql = "SELECT * FROM runs" + (" WHERE " + " AND ".join(clauses) if clauses else "") + " ORDER BY id"
        return [dict(r) for r in self.conn.execute(sql, args)]

    def run_by_key(self, key: str) -> Optional[Dict[str, Any]]:
        r = self.conn.execute("SELECT * FROM runs WHERE key = ?", (key,)).fetchone()
        return None if r is None else dict(r)

    @staticmethod
    def config_of(row: Dict[str, Any]) -> RunConfig:
        return from_dict(json.loads(row["config"]))

    # ------------------------------------------------------------------ capacity searches
    def add_capacity(self, key: str, experiment: str, cfg: RunConfig, target: float, seeds, per_seed, probes: int, wall_s: float) -> None:
        vals = [float(c) for c in per_seed]
        row = dict(
            # One search may belong to several experiments (its probes are shared runs): a row each.
            key=f"{key}@{experiment}", experiment=experiment, config=json.dumps(cfg.as_dict(), sort_keys=True),
            heads=cfg.heads, context=cfg.context, d_model=cfg.d_model, d_head=cfg.dh, data=cfg.data,
            task=cfg.task, target_acc=target, seeds=json.dumps(list(seeds)), per_seed=json.dumps(vals),
            capacity_mean=sum(vals) / len(vals), capacity_min=min(vals), capacity_max=max(vals),
            probes=probes, wall_s=wall_s, finished_at=_now(),
        )
        cols = list(row)
        with self.transaction():
            self.conn.execute(
                f"INSERT OR REPLACE INTO capacities ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
                [row[c] for c in cols],
            )

    def capacities(self, experiment: Optional[str] = None) -> List[Dict[str, Any]]:
        if experiment is None:
            return [dict(r) for r in self.conn.execute("SELECT * FROM capacities ORDER BY id")]
        return [dict(r) for r in self.conn.execute("SELECT * FROM capacities WHERE experiment = ? ORDER BY id", (experiment,))]

    # ------------------------------------------------------------------ memory stores
    def add_store_results(self, experiment: str, curves: List[Dict[str, Any]], capacity: Dict[str, Any]) -> None:
        """One store's curve (rows of M, isr, ...) and its capacity, in one transaction."""
        now = _now()
        with self.transaction():
            for c in curves:
                row = dict(c, experiment=experiment, finished_at=now)
                cols = list(row)
                self.conn.execute(
                    f"INSERT INTO store_curves ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
                    [row[k] for k in cols],
                )
            row = dict(capacity, experiment=experiment, finished_at=now)
            cols = list(row)
            self.conn.execute(
                f"INSERT INTO store_capacities ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
                [row[k] for k in cols],
            )

    def table(self, name: str, experiment: Optional[str] = None) -> List[Dict[str, Any]]:
        if name not in TABLES:
            raise ValueError(f"table: unknown table {name!r}; choose one of {', '.join(TABLES)}")
        if experiment is None:
            return [dict(r) for r in self.conn.execute(f"SELECT * FROM {name} ORDER BY id")]
        return [dict(r) for r in self.conn.execute(f"SELECT * FROM {name} WHERE experiment = ? ORDER BY id", (experiment,))]

    def experiments(self) -> List[str]:
        names = set()
        for t in TABLES:
            names.update(r[0] for r in self.conn.execute(f"SELECT DISTINCT experiment FROM {t}"))
        return sorted(names)

    # ------------------------------------------------------------------ export
    def export_csv(self, path: str, table: str = "runs", experiment: Optional[str] = None, drop=("history",)) -> int:
        """Write ``table`` (optionally one experiment) as CSV; returns the number of rows."""
        rows = self.table(table, experiment)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        cols = [c[1] for c in self.conn.execute(f"PRAGMA table_info({table})") if c[1] not in drop]
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(cols)
            for r in rows:
                w.writerow([r[c] for c in cols])
        return len(rows)


class Heartbeat:
    """Renews ``owner``'s claims in the database at ``path`` every ``interval`` seconds from a
    daemon thread (its own connection), from ``__enter__`` until ``__exit__``. A failed renewal
    (the database busy past its timeout) is retried at the next tick; the lease is several
    ticks long."""

    def __init__(self, path: str, owner: str, interval: float, timeout: float = 60.0):
        self.path, self.owner, self.interval, self.timeout = path, owner, interval, timeout
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.beats = 0

    def _run(self) -> None:
        conn = sqlite3.connect(self.path, timeout=self.timeout, isolation_level=None)
        try:
            while not self._stop.wait(self.interval):
                try:
                    conn.execute("UPDATE claims SET heartbeat = ? WHERE owner = ?", (time.time(), self.owner))
                    self.beats += 1
                except sqlite3.Error:
                    pass
        finally:
            conn.close()

    def __enter__(self) -> "Heartbeat":
        self._thread = threading.Thread(target=self._run, name=f"mhakern-heartbeat-{self.owner}", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT, rolled back on any exception (KeyboardInterrupt included)."""

    def __init__(self, conn: sqlite3.Connection):
        self.conn = conn

    def __enter__(self):
        self.conn.execute("BEGIN IMMEDIATE")
        return self.conn

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.conn.execute("COMMIT")
        else:
            self.conn.execute("ROLLBACK")
        return False
