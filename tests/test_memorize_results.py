"""The trainer's results: SQLite store, resumable sweeps, capacity search, report, command line."""
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
import torch

from mhakern import backends
from mhakern.memorize import cli
from mhakern.memorize.capacity import find_capacity
from mhakern.memorize.config import RunConfig
from mhakern.memorize.report import aggregate, write_report
from mhakern.memorize.store import Heartbeat, ResultStore
from mhakern.memorize.sweep import expand_grid, plan_stacks, run_sweep
from mhakern.memorize.train import train_stack, versions

TINY = RunConfig(heads=2, context=3, d_model=8, T=24, steps=60, eval_every=30)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def _rows(db):
    """Finished runs by key; {} while the database or its schema does not exist yet.

    The sweep creates the file before its tables, so a poller can see the file first: that is a
    state to wait through, not an error.
    """
    if not os.path.exists(db):
        return {}
    con = sqlite3.connect(db)
    try:
        if con.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'runs'").fetchone() is None:
            return {}
        return {r[0]: r[1:] for r in con.execute("SELECT key, id, finished_at, mem_acc FROM runs")}
    finally:
        con.close()


def test_store_keeps_one_row_per_configuration_and_exports_csv(tmp_path):
    store = ResultStore(str(tmp_path / "r.sqlite"))
    res = train_stack([TINY], progress=False)[0]
    assert store.add_run(res, "exp", versions()) is True
    assert store.add_run(res, "exp", versions()) is False  # same key: kept once
    assert store.stored_keys([TINY.key(), "nope"]) == {TINY.key()}
    row = store.run_by_key(TINY.key())
    assert row["mem_acc"] == res.mem_acc and row["heads"] == 2 and row["steps"] == 60
    assert ResultStore.config_of(row) == TINY.resolved()
    n = store.export_csv(str(tmp_path / "runs.csv"))
    lines = (tmp_path / "runs.csv").read_text().splitlines()
    assert n == 1 and len(lines) == 2 and lines[0].startswith("id,key,experiment")


def test_keys_tell_configurations_apart_and_ignore_spelled_out_defaults():
    a = RunConfig(heads=2, d_model=16, steps=None, T=1000)
    assert a.key() == RunConfig(heads=2, d_model=16, d_in=16, d_head=16, steps=50_000, T=1000).key()
    assert a.key() != RunConfig(heads=2, d_model=16, T=1001).key()
    assert a.key() != RunConfig(heads=2, d_model=16, T=1000, seed=1).key()
    assert RunConfig(impl="eager", backend="x").key() == RunConfig(impl="eager").key()


def test_interrupted_sweep_resumes_without_redoing_or_losing_finished_runs(tmp_path):
    db = str(tmp_path / "r.sqlite")
    cfgs = expand_grid(TINY, {"heads": [1, 2]}, seeds=[0, 1])
    assert len(cfgs) == 4

    class Boom(KeyboardInterrupt):
        pass

    def crash_after_first(res):
        raise Boom()

    store = ResultStore(db)
    with pytest.raises(Boom):
        run_sweep(cfgs, store, "exp", progress=False, max_stack=1, on_stored=crash_after_first)
    store.close()
    before = _rows(db)
    assert len(before) == 1  # the finished run is stored; the interrupted ones are not
    store = ResultStore(db)
    summary = run_sweep(cfgs, store, "exp", progress=False, max_stack=1)
    assert (summary.total, summary.skipped, summary.trained) == (4, 1, 3)
    after = _rows(db)
    assert len(after) == 4
    for k, v in before.items():
        assert after[k] == v  # not redone: same row id, same finish time
    again = run_sweep(cfgs, store, "exp", progress=False, max_stack=1)
    assert (again.skipped, again.trained) == (4, 0)


def test_killed_sweep_process_leaves_a_sound_database_and_resumes(tmp_path):
    db = str(tmp_path / "r.sqlite")
    argv = [sys.executable, "-m", "mhakern.memorize", "sweep", "-H", "1,2,3", "-n", "3", "-d", "8", "-T", "24",
            "--steps", "800", "--eval-every", "200", "--stack", "1", "--db", db, "--out", str(tmp_path), "--no-progress"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:
            if len(_rows(db)) >= 1:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the sweep ended before it could be killed: " + proc.stdout.read().decode()[-500:]
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    con = sqlite3.connect(db)
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    con.close()
    before = _rows(db)
    assert 1 <= len(before) < 3
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-800:]
    assert f"{len(before)} of 3 runs already stored" in out.stdout
    after = _rows(db)
    assert len(after) == 3 and all(after[k] == v for k, v in before.items())


def test_plan_stacks_packs_compatible_runs_and_splits_the_rest():
    cfgs = expand_grid(TINY, {"heads": [1, 2, 8], "T": [24, 48]}, seeds=[0, 1])
    stacks = plan_stacks(cfgs, max_stack=32)
    # the seeds of one configuration share a stack, nothing else does (exact numbers)
    assert [[(c.heads, c.T, c.seed) for c in st] for st in stacks] == [
        [(h, t, 0), (h, t, 1)] for h in (1, 2, 8) for t in (24, 48)]
    assert sum(len(s) for s in plan_stacks(cfgs, max_stack=1)) == 12
    big = expand_grid(RunConfig(d_model=64, context=32, T=10_000, heads=20), {}, seeds=range(3))
    assert [len(s) for s in plan_stacks(big)] == [1, 1, 1]  # 100M multiply-adds a step: over the CPU's 50M
    assert [len(s) for s in plan_stacks(expand_grid(TINY, {}, seeds=range(8)), max_stack=3)] == [3, 3, 2]


def test_capacity_bisection_finds_the_threshold_per_seed():
    truth = {0: 37, 1: 100}
    calls = []

    def fake(cfgs):
        calls.append([(c.seed, c.T) for c in cfgs])
        return {c.key(): (1.0 if c.T <= truth[c.seed] else 0.5) for c in cfgs}

    res = find_capacity(TINY, [0, 1], store=None, experiment="x", t_start=8, resolution=0.01, train_fn=fake)
    assert res.per_seed == [37, 100] and res.capped == [False, False]
    assert all(len(c) <= 2 for c in calls)  # the seeds' probes of a round go together
    res = find_capacity(TINY, [0], store=None, experiment="x", t_start=8, t_max=20, resolution=0.01, train_fn=fake)
    assert res.per_seed == [20] and res.capped == [True]


def test_capacity_search_trains_stores_and_resumes(tmp_path):
    store = ResultStore(str(tmp_path / "r.sqlite"))
    cfg = RunConfig(heads=2, context=3, d_model=8, steps=300, eval_every=50, lr=1e-2)
    res = find_capacity(cfg, [0], store, "cap", t_start=4, t_max=64, resolution=0.3, progress=False)
    # memorizes 8 (seen), not 32: the search must land in between
    assert 8 <= res.per_seed[0] < 32 and not res.capped[0]
    n_runs = len(store.runs("cap"))
    assert n_runs == res.probes
    again = find_capacity(cfg, [0], store, "cap", t_start=4, t_max=64, resolution=0.3, progress=False)
    assert again.per_seed == res.per_seed and len(store.runs("cap")) == n_runs  # probes reused
    assert len(store.capacities("cap")) == 1


def test_report_writes_table_plots_and_csv(tmp_path):
    store = ResultStore(str(tmp_path / "r.sqlite"))
    cfgs = expand_grid(TINY, {"heads": [1, 2], "T": [12, 24]}, seeds=[0])
    run_sweep(cfgs, store, "exp", progress=False)
    paths = write_report(store, str(tmp_path / "out"), "exp")
    names = {os.path.basename(p) for p in paths}
    assert {"table.md", "runs.csv", "capacity_vs_heads.png", "acc_vs_T.png"} <= names
    for p in paths:
        assert os.path.getsize(p) > 0
    table = (tmp_path / "out" / "table.md").read_text()
    assert table.count("\n| 1 | 3 | 8 |") == 2 and "examples memorized (mem_acc x T) against heads" not in table
    assert "examples memorized (mem_acc x T) against H" not in table  # two H: no fit of a line
    caps = expand_grid(TINY, {"heads": [1, 2, 3], "T": [12]}, seeds=[0])
    run_sweep(caps, store, "three", progress=False)
    write_report(store, str(tmp_path / "three"), "three", configs=caps)
    assert "examples memorized (mem_acc x T) against H (context=3, d_head=8, d_v=1, T=12, random)" in (
        tmp_path / "three" / "table.md").read_text()


# ---------------------------------------------------------------------------- command line
BAD = [
    (["run", "--heads", "-1"], "--heads"),
    (["run", "--heads", "0"], "--heads"),
    (["run", "--heads", "1,2"], "--heads"),
    (["run", "--d-head", "x"], "--d-head"),
    (["run", "--data", "fixed"], "--data"),
    (["run", "--backend", "no-such-backend"], "--backend"),
    (["run", "--dtype", "int8"], "--dtype"),
    (["run", "--steps", "-5"], "--steps"),
    (["sweep", "--T", "10,x"], "--T"),
    (["sweep", "--seeds", "-1"], "--seeds"),
    (["capacity", "--resolution", "2"], "--resolution"),
    (["stores", "--d-k", "0"], "--d-k"),
    (["stores", "--stores", "hopfield"], "--stores"),
    (["preset", "nope"], "preset"),
    (["run", "--threads", "-2"], "--threads"),
    (["run", "--no-such-flag"], "--no-such-flag"),
    (["run", "--init", "kaiming"], "--init"),
    (["run", "--reg-rule", "abs"], "--reg-rule"),
    (["run", "--early-stop", "maybe"], "--early-stop"),
    (["capacity", "--task", "regress", "--no-progress"], "--reg-rule"),
]


@pytest.mark.parametrize("argv,flag", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_gives_one_line_naming_the_flag_and_status_2(argv, flag, tmp_path, capsys):
    rc = cli.main(argv + ["--out", str(tmp_path)] if argv[0] != "preset" else argv)
    err = capsys.readouterr().err
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mhakern-memorize: error:") and flag in lines[0], err
    assert not os.path.exists(tmp_path / "memorize.sqlite")  # nothing started


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error for a missing CUDA device")
def test_cuda_device_without_cuda_is_refused(tmp_path, capsys):
    assert cli.main(["run", "--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "--device" in capsys.readouterr().err


def test_module_entry_point_exit_status(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mhakern.memorize", "run", "--context", "-3"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["mhakern-memorize: error: --context: must be a positive integer, got -3"]


def test_cli_run_and_report_end_to_end(tmp_path, capsys):
    args = ["-H", "2", "-n", "3", "-d", "8", "-T", "16", "--steps", "40", "--seeds", "0,1", "--out", str(tmp_path), "--no-progress"]
    assert cli.main(["run"] + args) == 0
    out = capsys.readouterr().out
    probe = torch.zeros(1, 1, 1, 8)
    auto = backends.select("auto", probe, probe, probe, False, None).name  # cpu once built, else reference
    assert out.count("examples fitted") == 2 and f"backend {auto}" in out
    assert cli.main(["run"] + args) == 0  # stored: nothing retrained
    assert "already stored" in capsys.readouterr().out
    assert cli.main(["report", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "run" / "table.md").exists()


# ---------------------------------------------------------------------------- bad databases
def _db_error(tmp_path, capsys, db):
    argv = ["run", "-H", "1", "-n", "2", "-d", "4", "-T", "4", "--steps", "1", "--no-progress", "--out", str(tmp_path), "--db", db]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mhakern-memorize: error: --db: "), err
    return err[0]


def test_bad_database_paths_give_one_line_and_exit_2(tmp_path, capsys):
    f = tmp_path / "FILE"
    f.write_text("not a folder")
    assert "is a file, not a folder" in _db_error(tmp_path, capsys, str(f / "x.sqlite"))
    assert "is a file, not a folder" in _db_error(tmp_path, capsys, str(f / "sub" / "x.sqlite"))
    assert "is a folder" in _db_error(tmp_path, capsys, str(tmp_path))
    assert "not a usable SQLite database" in _db_error(tmp_path, capsys, str(f))
    # Places no user can write, root included (procfs refuses new files and folders).
    assert "cannot create the folder" in _db_error(tmp_path, capsys, "/proc/mhakern-test/x.sqlite")
    assert "/proc/x.sqlite" in _db_error(tmp_path, capsys, "/proc/x.sqlite")
    if os.geteuid() != 0:  # permissions bind only other users than root
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        try:
            assert "no write permission" in _db_error(tmp_path, capsys, str(ro / "x.sqlite"))
        finally:
            ro.chmod(0o700)


# ---------------------------------------------------------------------------- concurrent sweeps
def test_concurrent_sweeps_on_one_database_never_train_a_run_twice(tmp_path):
    import threading

    db = str(tmp_path / "r.sqlite")
    cfgs = expand_grid(TINY, {"heads": [1, 2, 3]}, seeds=[0, 1])
    trained = {0: [], 1: []}
    summaries = {}
    errors = []

    def sweep(i):
        try:
            store = ResultStore(db)
            summaries[i] = run_sweep(cfgs, store, "exp", progress=False, max_stack=1,
                                     on_stored=lambda r: trained[i].append(r.config.key()), poll_s=0.05)
            store.close()
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=sweep, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    keys = {c.key() for c in cfgs}
    assert not set(trained[0]) & set(trained[1])  # no run trained by both
    assert set(trained[0]) | set(trained[1]) == keys  # and every run by one of them
    assert summaries[0].trained + summaries[1].trained == len(cfgs)
    assert len(_rows(db)) == len(cfgs)
    con = sqlite3.connect(db)
    assert con.execute("SELECT COUNT(*) FROM claims").fetchone()[0] == 0  # released
    con.close()


def test_runs_of_a_dead_claimant_are_taken_over(tmp_path):
    import threading

    db = str(tmp_path / "r.sqlite")
    cfgs = expand_grid(TINY, {"heads": [1, 2]}, seeds=[0])
    store = ResultStore(db)
    # A claim whose heartbeat stopped long ago is taken at once.
    assert store.claim([cfgs[0].key()], "ghost-old") == [cfgs[0].key()]
    store.conn.execute("UPDATE claims SET heartbeat = heartbeat - 1000 WHERE owner = 'ghost-old'")
    # A live claimant (its heartbeat renewed) keeps its run until it dies: here, when the sweep
    # says that it is waiting for it; the sweep takes the run over once the lease runs out.
    assert store.claim([cfgs[1].key()], "ghost-new") == [cfgs[1].key()]
    assert store.claim([cfgs[1].key()], "someone-else", lease_s=60) == []  # alive: not taken
    dies, beating = threading.Event(), threading.Event()

    def ghost():
        with Heartbeat(db, "ghost-new", interval=0.02) as hb:
            while hb.beats < 1 and not dies.is_set():
                time.sleep(0.01)
            beating.set()
            dies.wait()

    t = threading.Thread(target=ghost)
    t.start()
    beating.wait()
    said = []

    def log(msg):
        said.append(msg)
        if "another sweep is training" in msg:
            dies.set()

    try:
        summary = run_sweep(cfgs, store, "exp", progress=False, max_stack=1, lease_s=1.0, poll_s=0.05, log=log)
    finally:
        dies.set()
        t.join()
    assert summary.trained == 2 and len(_rows(db)) == 2
    assert dies.is_set() and any("another sweep is training" in s for s in said)
    assert store.conn.execute("SELECT COUNT(*) FROM claims").fetchone()[0] == 0


def test_heartbeat_renews_its_owners_claims_only(tmp_path):
    db = str(tmp_path / "r.sqlite")
    store = ResultStore(db)
    store.claim(["a", "b"], "me")
    store.claim(["c"], "other")
    before = dict(store.conn.execute("SELECT key, heartbeat FROM claims").fetchall())
    with Heartbeat(db, "me", interval=0.01) as hb:
        deadline = time.time() + 60
        while hb.beats < 2 and time.time() < deadline:
            time.sleep(0.01)
    after = dict(store.conn.execute("SELECT key, heartbeat FROM claims").fetchall())
    assert hb.beats >= 2
    assert after["a"] > before["a"] and after["b"] > before["b"] and after["c"] == before["c"]
    store.release("me")
    assert [r[0] for r in store.conn.execute("SELECT key FROM claims")] == ["c"]


def test_a_database_from_before_new_columns_is_upgraded_in_place(tmp_path):
    db = str(tmp_path / "old.sqlite")
    con = sqlite3.connect(db)
    # The runs table as the first schema wrote it: no reg_rule, early_stop, init, analysis, saturation.
    con.execute("CREATE TABLE runs (id INTEGER PRIMARY KEY, key TEXT UNIQUE NOT NULL, experiment TEXT NOT NULL, "
                "config TEXT NOT NULL, heads INTEGER, mem_acc REAL)")
    con.execute("INSERT INTO runs (key, experiment, config, heads, mem_acc) VALUES ('old', 'e', '{}', 3, 0.5)")
    con.commit()
    con.close()
    store = ResultStore(db)
    cols = {r[1] for r in store.conn.execute("PRAGMA table_info(runs)")}
    assert {"reg_rule", "early_stop", "init", "analysis", "saturation", "loss"} <= cols
    res = train_stack([TINY], progress=False)[0]
    assert store.add_run(res, "exp", versions())
    assert store.run_by_key("old")["mem_acc"] == 0.5 and store.run_by_key(TINY.key())["init"] == "paper"


def test_fits_of_a_grid_name_the_papers_estimand_per_T_not_capacity(tmp_path):
    # A sweep's fits are of examples memorized (mem_acc x T, the paper's estimand), one series
    # per T; they must not be labelled capacity (the largest T memorized at 100%, a search).
    from mhakern.memorize.report import ESTIMAND, capacity_points, trend_fits

    pts = [dict(heads=h, context=8, d_head=16, d_value=1, T=t, data="random", task="classify", capacity=20.0 * h * t,
                source="grid") for h in (1, 2, 4, 8) for t in (100, 200)]
    fits = trend_fits(pts, "heads", ESTIMAND)
    assert len(fits) == 2 and all(f["r2"] > 0.999 for f in fits)
    assert [f["b"] for f in fits] == pytest.approx([2000.0, 4000.0])  # a slope per T
    assert fits[0]["text"].startswith("examples memorized (mem_acc x T) against H")
    (fit,) = trend_fits([p for p in pts if p["T"] == 100], "heads")
    assert fit["text"].startswith("capacity against H")
    # d_h beyond n is left out of the d_h fit (the paper's trend holds up to n)
    dh = [dict(p, heads=4, context=4, d_head=k, capacity=float(min(k, 4))) for p, k in zip(pts[:5], (1, 2, 3, 4, 64))]
    (f,) = trend_fits([dict(p, T=100) for p in dh], "d_head")
    assert f["xs"] == [1.0, 2.0, 3.0, 4.0] and f["r2"] > 0.999
    store = ResultStore(str(tmp_path / "r.sqlite"))
    cfgs = expand_grid(TINY, {"heads": [1, 2, 3], "T": [12, 16]}, seeds=[0, 1])
    run_sweep(cfgs, store, "grid", progress=False)
    assert len(capacity_points(aggregate(store.runs("grid")), [])) == 6  # a point per H and T
    write_report(store, str(tmp_path / "out"), "grid")
    table = (tmp_path / "out" / "table.md").read_text()
    assert "capacity against" not in table and table.count("examples memorized (mem_acc x T) against H") == 2, table
    # a report by configuration finds runs stored under another experiment
    paths = write_report(store, str(tmp_path / "cfg"), "other", configs=cfgs[:4])
    assert (tmp_path / "cfg" / "table.md").read_text().count("\n| 1 | 3 | 8 |") == 2 and paths
