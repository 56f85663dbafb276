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

Damage. A database is checked when it is opened (``PRAGMA integrity_check``: about 6 ms for a
store of 3,000 runs, 4 MB; 0.1 s for 20,000 runs with 100-point histories, 83 MB) and before
each write of results (``PRAGMA quick_check``, about 0.7x of that); a damaged file raises
:class:`StoreDamaged` (one line: the file, what is wrong, how to recover it) and is never written
again by this process, not even by SQLite's checkpoint when the connection closes. Results that
could not be stored (a damaged file, a lock held past the timeout, a full disk) are appended to
a side file next to the database, ``PATH.unstored.jsonl`` (:func:`side_path`, JSON lines), and
added to the database the next time it is opened healthy, once each.
"""
from __future__ import annotations

import csv
import functools
import json
import os
import shlex
import socket
import sqlite3
import tempfile
import threading
import time
import uuid
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple
from urllib.request import pathname2url

try:  # POSIX: the side file is locked while written and while imported
    import fcntl
except ImportError:  # pragma: no cover - Windows: appends are short, imports rename first
    fcntl = None

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
    # Records of the side file already added (see _import_side): an import is never applied twice.
    "CREATE TABLE IF NOT EXISTS imported (id TEXT PRIMARY KEY, at TEXT NOT NULL)",
]

#: Result tables (``claims`` is bookkeeping, not results).
TABLES = ("runs", "capacities", "store_curves", "store_capacities")

#: Seconds without a heartbeat after which a claim is considered dead and may be taken over.
DEFAULT_LEASE_S = 120.0


#: Suffix of the side file that keeps results the database could not take (see :func:`side_path`).
SIDE_SUFFIX = ".unstored.jsonl"


class StoreError(ValueError):
    """The database cannot be created, opened or written; the message is one line naming --db."""


class StoreDamaged(StoreError):
    """The database file is damaged (it fails SQLite's integrity check, or SQLite reports it
    malformed); nothing more is written to it. The message says how to recover it."""


def side_path(path: str) -> str:
    """The side file of the database at ``path``: results that could not be stored there, one
    JSON object a line, added to the database when it is next opened healthy."""
    return path + SIDE_SUFFIX


def _is_damage(e: BaseException) -> bool:
    """True when a sqlite3 error says the file is damaged (SQLITE_CORRUPT*, SQLITE_NOTADB), not
    busy, full or unwritable."""
    name = getattr(e, "sqlite_errorname", None) or ""
    if name:
        return name.startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB"))
    msg = str(e)
    return "malformed" in msg or "not a database" in msg


def recover_hint(path: str) -> str:
    """What to do about a damaged database at ``path`` (the end of a one-line message). The old
    write-ahead log must go with the old file: SQLite would replay it into the recovered one."""
    q, r = shlex.quote(path), shlex.quote(path + ".recovered")
    w = " ".join(shlex.quote(path + x) for x in ("-wal", "-shm"))
    return (f"recover it with: sqlite3 {q} .recover | sqlite3 {r} (.dump where this sqlite3 lacks .recover), "
            f"then rm -f {w}; mv {r} {q}; or point --db at another file")


def _close_without_checkpoint(conn: sqlite3.Connection, path: str) -> None:
    """Close ``conn`` without SQLite's checkpoint-on-close, which would copy the write-ahead log
    into the database file: a damaged file is not written, and the log stays beside it for
    recovery. Where the sqlite3 module cannot switch the checkpoint off (Python < 3.12), a
    read-only connection opened first holds the file, so that the closing connection is not the
    last one; a read-only connection never checkpoints."""
    opt = getattr(sqlite3, "SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE", None)
    if opt is not None and hasattr(conn, "setconfig"):
        try:
            conn.setconfig(opt, True)
            conn.close()
            return
        except sqlite3.Error:
            pass
    holder = None
    try:
        holder = sqlite3.connect(f"file:{pathname2url(os.path.abspath(path))}?mode=ro", uri=True)
        holder.execute("PRAGMA schema_version").fetchall()
    except sqlite3.Error:
        pass
    try:
        conn.close()
    finally:
        if holder is not None:
            holder.close()


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


_SQLITE_MAGIC = b"SQLite format 3\x00"


def _guarded(fn):
    """Method decorator: a store known to be damaged is refused, and a sqlite3 error becomes a
    one-line StoreError (a StoreDamaged, the store marked so, when it says the file is damaged)."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        if self.damaged is not None:
            raise StoreDamaged(self._damage_message())
        try:
            return fn(self, *args, **kwargs)
        except sqlite3.Error as e:
            raise self._error(e) from None

    return wrapper


class ResultStore:
    """A results database at ``path`` (created with its folder if missing).

    Safe to open from several processes: SQLite serialises writers (``timeout`` seconds of
    waiting for a lock before giving up). ``clock`` gives the seconds since the epoch that
    claims' leases are measured in (tests inject one, so that a lease runs out without waiting).

    An existing file is checked first (``PRAGMA integrity_check``) and refused untouched when
    damaged (:class:`StoreDamaged`). Results kept in the side file (:func:`side_path`) by an
    earlier process are then added; ``imported`` says how many records were.
    """

    def __init__(self, path: str, timeout: float = 60.0, clock: Callable[[], float] = time.time):
        self.path = path
        self.timeout = timeout
        self.clock = clock
        self.damaged: Optional[str] = None  # what is wrong with the file, once known
        self.imported = 0
        self.kept = 0  # results this store could not take and kept aside (see _write)
        self.kept_in: Optional[str] = None  # the side file they went to
        self._lost_rows: List[str] = []  # results no file could take either (kept in the message)
        self._failure = self._failure_to_keep = ""
        _check_path(path)
        fresh = not os.path.exists(path) or os.path.getsize(path) == 0
        if not fresh:
            with open(path, "rb") as f:
                head = f.read(len(_SQLITE_MAGIC))
            if head != _SQLITE_MAGIC:
                raise StoreError(f"--db: {path} is not a usable SQLite database (it does not start with SQLite's header); "
                                 "point --db at another file (a new path makes a new database)")
        try:
            self.conn = sqlite3.connect(path, timeout=timeout, isolation_level=None)
        except sqlite3.Error as e:
            raise StoreError(f"--db: cannot open {path} as a database: {e}") from None
        self.conn.row_factory = sqlite3.Row
        try:
            self._prepare(fresh, timeout)
        except StoreDamaged:
            raise
        except sqlite3.OperationalError as e:
            self.conn.close()
            msg = str(e)
            if "readonly" in msg or "unable to open" in msg or "disk I/O" in msg:
                raise StoreError(f"--db: cannot write {path} ({msg}): check the permissions of the file and its folder") from None
            raise StoreError(f"--db: {path}: {msg}") from None
        except sqlite3.DatabaseError as e:
            if _is_damage(e):
                raise self._mark_damaged(str(e)) from None
            self.conn.close()
            raise StoreError(f"--db: {path} is not a usable SQLite database ({e})") from None
        try:
            self.imported = self._import_side()
        except sqlite3.Error as e:
            raise self._error(e) from None

    def _prepare(self, fresh: bool, timeout: float) -> None:
        """Check the file, then set the journal mode and the schema. Where waiting could deadlock
        (a reader that must upgrade while another connection writes: two sweeps opening one new
        database at once) SQLite answers "database is locked" at once instead of waiting out
        the busy timeout; the whole step is then tried again until the timeout has passed."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if not fresh:
                    # Before anything writes (the journal mode, the schema): a damaged file is
                    # refused as it was found.
                    self._check("integrity_check")
                self.conn.execute("PRAGMA journal_mode=WAL")
                self.conn.execute("PRAGMA synchronous=FULL")
                with self.transaction():
                    for stmt in _SCHEMA:
                        self.conn.execute(stmt)
                    self._add_missing_columns()
                return
            except sqlite3.OperationalError as e:
                if ("locked" not in str(e) and "busy" not in str(e)) or time.monotonic() >= deadline:
                    raise
                time.sleep(0.02)

    def _add_missing_columns(self) -> None:
        """Databases written before a column existed get it (NULL in their old rows)."""
        have = {r[1] for r in self.conn.execute("PRAGMA table_info(runs)")}
        for col in _RUN_COLUMNS:
            if col.split()[0] not in have:
                self.conn.execute(f"ALTER TABLE runs ADD COLUMN {col}")

    # ------------------------------------------------------------------ damage
    def _check(self, pragma: str) -> None:
        """Run ``PRAGMA integrity_check`` or ``quick_check``; raise StoreDamaged unless "ok"."""
        try:
            # This connection's page cache would hide a page damaged on disk since it was read
            # (in WAL mode SQLite trusts its cache while the log is unchanged): let it go first.
            self.conn.execute("PRAGMA shrink_memory")
            rows = [str(r[0]) for r in self.conn.execute(f"PRAGMA {pragma}")]
        except sqlite3.DatabaseError as e:
            if not _is_damage(e):
                raise
            rows = [str(e)]
        if rows == ["ok"]:
            return
        problems = [ln.strip() for r in rows for ln in r.splitlines() if ln.strip() and not ln.startswith("***")]
        more = f" and {len(problems) - 1} more problems" if len(problems) > 1 else ""
        raise self._mark_damaged(f"{pragma}: {problems[0] if problems else 'not ok'}{more}")

    def _mark_damaged(self, reason: str) -> StoreDamaged:
        """Remember that the file is damaged, close the connection without writing to the file,
        and return the exception to raise."""
        if self.damaged is None:
            self.damaged = " ".join(reason.split())[:200]
            _close_without_checkpoint(self.conn, self.path)
        return StoreDamaged(self._damage_message())

    def _damage_message(self) -> str:
        return f"--db: {self.path} is damaged ({self.damaged}); nothing more is written to it; {recover_hint(self.path)}"

    def _error(self, e: sqlite3.Error) -> StoreError:
        if _is_damage(e):
            return self._mark_damaged(str(e))
        msg = str(e)
        if "locked" in msg or "busy" in msg:
            msg += f" for more than {self.timeout:g} s by another process"
        return StoreError(f"--db: {self.path}: {msg}")

    # ------------------------------------------------------------------ writes of results, side file
    def _write(self, writes: List[Tuple[str, str, Dict[str, Any]]], what: str) -> List[int]:
        """Apply ``writes`` ((table, how, row) with how "ignore", "replace", "insert" or
        "unclaim") in one transaction, after a quick check of the file; returns the row counts.
        When the database cannot take them, they are appended to the side file and a StoreError
        says where (:meth:`kept_error`): a finished result is never lost."""
        if self.damaged is None:
            try:
                self._check("quick_check")
                with self.transaction():
                    return [_apply(self.conn, *w) for w in writes]
            except StoreDamaged:
                pass
            except sqlite3.Error as e:
                self._failure = str(self._error(e))
        kept, why = self._keep(writes)
        self.kept += 1
        if kept:
            self.kept_in = kept
        else:
            self._lost_rows.append(json.dumps(writes[0][2], default=str))
            self._failure_to_keep = why
        raise self.kept_error(what)

    def kept_error(self, what: Optional[str] = None) -> StoreError:
        """The error that says what the database could not take (``what``, default: how many
        results so far) and where it is kept; a StoreDamaged when the file is damaged."""
        plural = what is None and self.kept != 1
        what = what or (f"{self.kept} finished results" if plural else "1 finished result")
        verb = "are" if plural else "is"
        if self._lost_rows:  # no file could take them: the line itself keeps them
            where = f"could not be kept in a file ({self._failure_to_keep}); its rows: {'; '.join(self._lost_rows)}"
            if self.kept_in:
                where = f"{verb} kept in {self.kept_in} where it could; the others {where}"
        else:
            where = f"{verb} kept in {self.kept_in}"
        side = side_path(self.path)
        later = "added to the database at this path when it is next opened healthy"
        if self.kept_in and self.kept_in != side:  # the folder of the database took no file
            later = f"move the file to {side} to have it {later}"
        if self.damaged is not None:
            return StoreDamaged(f"--db: {self.path} is damaged ({self.damaged}); nothing more is written to it, and "
                                f"{what} {where} instead ({later}); {recover_hint(self.path)}")
        return StoreError(f"{self._failure}; {what} {where} ({later}): run the same command again to store "
                          f"{'them' if plural else 'it'} and go on")

    def _keep(self, writes) -> Tuple[Optional[str], str]:
        """Append ``writes`` as one record to the side file (else to one in the temporary
        folder); returns (the file, "") or (None, why not)."""
        rec = {"id": uuid.uuid4().hex, "at": _now(), "db": os.path.abspath(self.path), "writes": [list(w) for w in writes]}
        line = json.dumps(rec, default=str) + "\n"
        why = ""
        for path in (side_path(self.path), os.path.join(tempfile.gettempdir(), os.path.basename(side_path(self.path)))):
            try:
                _append_locked(path, line)
                return path, ""
            except OSError as e:
                why = f"{path}: {e.strerror or e}"
        return None, why

    def _import_side(self) -> int:
        """Add the side file's records that this database does not have yet (each once: their
        ids go to ``imported`` in the same transaction), then remove the file. Returns how
        many records were added."""
        side = side_path(self.path)
        if not os.path.exists(side):
            return 0
        added, bad = 0, 0
        try:
            f = _open_locked(side, "r")
        except OSError:
            return 0
        if f is None:
            return 0
        try:
            records = []
            for ln in f:
                try:
                    rec = json.loads(ln)
                    writes = [(str(t), str(how), dict(row)) for t, how, row in rec["writes"]]
                    records.append((str(rec["id"]), writes))
                except (ValueError, KeyError, TypeError):
                    bad += 1  # a line cut short by a crash while it was written
            with self.transaction():
                for rid, writes in records:
                    if self.conn.execute("SELECT 1 FROM imported WHERE id = ?", (rid,)).fetchone() is not None:
                        continue
                    # A record this database cannot take (a table or column it lacks) is left in
                    # the file, and the others are added.
                    self.conn.execute("SAVEPOINT side_record")
                    try:
                        for w in writes:
                            _apply(self.conn, *w)
                        self.conn.execute("INSERT INTO imported (id, at) VALUES (?, ?)", (rid, _now()))
                        added += 1
                    except (sqlite3.OperationalError, sqlite3.IntegrityError, ValueError, KeyError):
                        self.conn.execute("ROLLBACK TO side_record")
                        bad += 1
                    self.conn.execute("RELEASE side_record")
            if not bad:  # else kept for a look; what of it could be added is added already
                os.unlink(side)
        finally:
            f.close()  # releases the lock
        return added

    # ------------------------------------------------------------------ plumbing
    def transaction(self):
        return _Transaction(self.conn)

    def close(self) -> None:
        if self.damaged is None:
            self.conn.close()  # (a damaged store's connection is closed already)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ trainer runs
    @_guarded
    def stored_keys(self, keys: Iterable[str]) -> set:
        return self._stored_in_txn(list(keys))

    def add_run(self, result, experiment: str, versions: Dict[str, str]) -> bool:
        """Store a finished run (a :class:`~mhakern.memorize.train.RunResult`). Returns False
        when its key was already stored (the stored row is kept). When the database cannot
        take it, the run goes to the side file and StoreError (or StoreDamaged) says so."""
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
        # The run is done: its claim (whoever held it) has nothing left to protect.
        n = self._write([("runs", "ignore", row), ("claims", "unclaim", {"key": row["key"]})],
                        f"the finished run {cfg.label()} T={cfg.T} seed={cfg.seed}")
        return n[0] == 1

    # ------------------------------------------------------------------ claims (leases)
    def _free_for(self, k: str, owner: str, now: float, lease_s: float) -> bool:
        """In a transaction: may ``owner`` hold key ``k`` (not stored is checked by the caller)?"""
        r = self.conn.execute("SELECT owner, heartbeat FROM claims WHERE key = ?", (k,)).fetchone()
        if r is not None and r[0] == owner:
            return True
        return r is None or now - r[1] > lease_s or owner_is_dead_here(r[0])

    def _hold(self, k: str, owner: str, now: float) -> None:
        self.conn.execute("INSERT OR REPLACE INTO claims (key, owner, heartbeat, claimed_at) VALUES (?, ?, ?, ?)",
                          (k, owner, now, now))

    @_guarded
    def claim(self, keys: Iterable[str], owner: str, lease_s: float = DEFAULT_LEASE_S) -> List[str]:
        """Claim for ``owner`` those of ``keys`` that are neither stored nor claimed by a live
        owner (one whose heartbeat is at most ``lease_s`` old); returns the keys now held, in
        order. Atomic: of two sweeps claiming at once, each key goes to one."""
        keys = list(dict.fromkeys(keys))
        got: List[str] = []
        with self.transaction():
            now = self.clock()
            stored = self._stored_in_txn(keys)
            for k in keys:
                if k not in stored and self._free_for(k, owner, now, lease_s):
                    self._hold(k, owner, now)
                    got.append(k)
        return got

    @_guarded
    def renew(self, keys: Iterable[str], owner: str, lease_s: float = DEFAULT_LEASE_S) -> Dict[str, str]:
        """Renew ``owner``'s claims and say which of ``keys`` (runs it is training) it lost:
        {key: "stored"} for a run another sweep stored meanwhile, {key: that owner} for one that
        another live owner claimed (took over after ``owner``'s lease ran out). The others are
        held, as before or claimed again (a claim released or left by a dead owner meanwhile).
        A claim holder calls this before storing a run, so that it notices a lost claim."""
        keys = list(dict.fromkeys(keys))
        lost: Dict[str, str] = {}
        with self.transaction():
            now = self.clock()
            self.conn.execute("UPDATE claims SET heartbeat = ? WHERE owner = ?", (now, owner))
            stored = self._stored_in_txn(keys)
            for k in keys:
                if k in stored:
                    lost[k] = "stored"
                elif self._free_for(k, owner, now, lease_s):
                    self._hold(k, owner, now)
                else:
                    lost[k] = self.conn.execute("SELECT owner FROM claims WHERE key = ?", (k,)).fetchone()[0]
        return lost

    @_guarded
    def claimed_by_others(self, keys: Iterable[str], owner: str, lease_s: float = DEFAULT_LEASE_S) -> Dict[str, str]:
        """{key: owner} of ``keys`` held by another live owner."""
        keys = list(keys)
        now = self.clock()
        out: Dict[str, str] = {}
        for i in range(0, len(keys), 500):
            part = keys[i : i + 500]
            q = f"SELECT key, owner, heartbeat FROM claims WHERE key IN ({','.join('?' * len(part))})"
            for k, o, hb in self.conn.execute(q, part):
                if o != owner and now - hb <= lease_s and not owner_is_dead_here(o):
                    out[k] = o
        return out

    def release(self, owner: str) -> None:
        """Drop every claim of ``owner`` (its runs in flight are free for others at once). A
        damaged store is left alone: the claims then run out with their lease."""
        if self.damaged is None:
            self._release(owner)

    @_guarded
    def _release(self, owner: str) -> None:
        with self.transaction():
            self.conn.execute("DELETE FROM claims WHERE owner = ?", (owner,))

    def _stored_in_txn(self, keys: List[str]) -> set:
        found = set()
        for i in range(0, len(keys), 500):
            part = keys[i : i + 500]
            q = f"SELECT key FROM runs WHERE key IN ({','.join('?' * len(part))})"
            found.update(r[0] for r in self.conn.execute(q, part))
        return found

    @_guarded
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

    @_guarded
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
        self._write([("capacities", "replace", row)], f"the capacity search of {cfg.label()}")

    @_guarded
    def capacities(self, experiment: Optional[str] = None) -> List[Dict[str, Any]]:
        if experiment is None:
            return [dict(r) for r in self.conn.execute("SELECT * FROM capacities ORDER BY id")]
        return [dict(r) for r in self.conn.execute("SELECT * FROM capacities WHERE experiment = ? ORDER BY id", (experiment,))]

    # ------------------------------------------------------------------ memory stores
    def add_store_results(self, experiment: str, curves: List[Dict[str, Any]], capacity: Dict[str, Any]) -> None:
        """One store's curve (rows of M, isr, ...) and its capacity, in one transaction."""
        now = _now()
        writes = [("store_curves", "insert", dict(c, experiment=experiment, finished_at=now)) for c in curves]
        writes.append(("store_capacities", "insert", dict(capacity, experiment=experiment, finished_at=now)))
        self._write(writes, f"the results of the {capacity.get('store', 'memory')} store")

    @_guarded
    def table(self, name: str, experiment: Optional[str] = None) -> List[Dict[str, Any]]:
        if name not in TABLES:
            raise ValueError(f"table: unknown table {name!r}; choose one of {', '.join(TABLES)}")
        if experiment is None:
            return [dict(r) for r in self.conn.execute(f"SELECT * FROM {name} ORDER BY id")]
        return [dict(r) for r in self.conn.execute(f"SELECT * FROM {name} WHERE experiment = ? ORDER BY id", (experiment,))]

    @_guarded
    def experiments(self) -> List[str]:
        names = set()
        for t in TABLES:
            names.update(r[0] for r in self.conn.execute(f"SELECT DISTINCT experiment FROM {t}"))
        return sorted(names)

    # ------------------------------------------------------------------ export
    @_guarded
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


def _apply(conn: sqlite3.Connection, table: str, how: str, row: Dict[str, Any]) -> int:
    """One write of a result (see ResultStore._write); returns the row count."""
    if table not in TABLES + ("claims",):
        raise ValueError(f"side file: unknown table {table!r}")
    if how == "unclaim":
        return conn.execute("DELETE FROM claims WHERE key = ?", (row["key"],)).rowcount
    verb = {"ignore": "INSERT OR IGNORE", "replace": "INSERT OR REPLACE", "insert": "INSERT"}[how]
    cols = list(row)
    sql = f"{verb} INTO {table} ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})"
    return conn.execute(sql, [row[c] for c in cols]).rowcount


def _open_locked(path: str, mode: str):
    """``open(path, mode)`` holding an exclusive lock on the file that is at ``path`` now (a
    file replaced or removed while this waited for the lock is opened again); None when a
    file opened to read has gone meanwhile."""
    while True:
        try:
            f = open(path, mode)
        except FileNotFoundError:
            if mode == "r":
                return None
            raise
        if fcntl is None:
            return f
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            same = os.stat(path).st_ino == os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return f
        f.close()


def _append_locked(path: str, line: str) -> None:
    f = _open_locked(path, "a")
    try:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())
    finally:
        f.close()


class Heartbeat:
    """Renews ``owner``'s claims in the database at ``path`` every ``interval`` seconds from a
    daemon thread (its own connection), from ``__enter__`` until ``__exit__``. A failed renewal
    (the database busy past its timeout) is retried at the next tick; the lease is several
    ticks long. ``clock``: as :class:`ResultStore`'s. With ``store``, the beats stop once that
    store knows its file is damaged (and the connection closes without writing to it)."""

    def __init__(self, path: str, owner: str, interval: float, timeout: float = 60.0,
                 clock: Callable[[], float] = time.time, store: Optional[ResultStore] = None):
        self.path, self.owner, self.interval, self.timeout = path, owner, interval, timeout
        self.clock, self.store = clock, store
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.beats = 0

    def _damaged(self) -> bool:
        return self.store is not None and self.store.damaged is not None

    def _run(self) -> None:
        conn = sqlite3.connect(self.path, timeout=self.timeout, isolation_level=None)
        try:
            while not self._stop.wait(self.interval) and not self._damaged():
                try:
                    conn.execute("UPDATE claims SET heartbeat = ? WHERE owner = ?", (self.clock(), self.owner))
                    self.beats += 1
                except sqlite3.Error:
                    pass
        finally:
            if self._damaged():
                _close_without_checkpoint(conn, self.path)
            else:
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
        elif self.conn.in_transaction:
            # SQLite may have rolled back already (a damaged page met mid-statement); a failing
            # ROLLBACK must not hide the error that got here.
            try:
                self.conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
        return False
