"""Results in an embedded SQLite database: one row per finished run, crash-safe, resumable.

Every finished run is written in its own transaction the moment it finishes, so a Ctrl-C or a
kill loses at most the runs still training; SQLite's journal (write-ahead log, fully synced)
never leaves the file half-written. The row's ``key`` is the hash of the run's resolved
configuration (:meth:`RunConfig.key`): a sweep asks :meth:`ResultStore.stored_keys` which of
its runs exist and trains only the others.

Tables: ``runs`` (trainer runs), ``capacities`` (capacity searches), ``store_curves`` and
``store_capacities`` (memory-store experiments). :meth:`ResultStore.export_csv` writes any of
them as CSV.
"""
from __future__ import annotations

import csv
import json
import os
import sqlite3
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence

from .config import CONFIG_FIELDS, RunConfig, from_dict

_RUN_COLUMNS = (
    # configuration (resolved)
    "heads INTEGER", "context INTEGER", "d_model INTEGER", "d_in INTEGER", "d_head INTEGER",
    "d_value INTEGER", "T INTEGER", "data TEXT", "dist TEXT", "task TEXT", "classes INTEGER",
    "seed INTEGER", "steps INTEGER", "batch INTEGER", "lr REAL", "warmup REAL", "eval_every INTEGER",
    "target_acc REAL", "reg_tol REAL", "impl TEXT", "backend TEXT", "dtype TEXT",
    # outcome
    "mem_acc REAL", "examples REAL", "best_acc REAL", "final_acc REAL", "loss REAL",
    "steps_done INTEGER", "stopped_early INTEGER", "wall_s REAL", "steps_per_s REAL",
    "examples_per_s REAL", "stack_size INTEGER", "backend_used TEXT", "device TEXT",
    "versions TEXT", "history TEXT", "finished_at TEXT",
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
]

TABLES = ("runs", "capacities", "store_curves", "store_capacities")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime())


class ResultStore:
    """A results database at ``path`` (created with its folder if missing).

    Safe to open from several processes: SQLite serialises writers (``timeout`` seconds of
    waiting for a lock before giving up).
    """

    def __init__(self, path: str, timeout: float = 60.0):
        self.path = path
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        self.conn = sqlite3.connect(path, timeout=timeout, isolation_level=None)
        self.conn.row_factory = sqlite3.Row
        try:
            self.conn.execute("PRAGMA journal_mode=WAL")
        except sqlite3.DatabaseError as e:
            raise ValueError(f"--db: {path} is not a usable SQLite database ({e})") from None
        self.conn.execute("PRAGMA synchronous=FULL")
        with self.transaction():
            for stmt in _SCHEMA:
                self.conn.execute(stmt)

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
            finished_at=_now(),
        )
        cols = list(row)
        sql = f"INSERT OR IGNORE INTO runs ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})"
        with self.transaction():
            cur = self.conn.execute(sql, [row[c] for c in cols])
        return cur.rowcount == 1

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
            key=key, experiment=experiment, config=json.dumps(cfg.as_dict(), sort_keys=True),
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
