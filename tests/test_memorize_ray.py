"""The trainer on Ray: stacks as Ray tasks on a local cluster of two CPU
slots, the driver the only writer of the store.

One local Ray is started for the module (its start-up is most of the cost). Checked: a sweep
gives the same stored results with and without Ray; a task whose worker dies is retried and
its runs are stored once; a killed driver resumes without redoing the runs it stored; without
Ray installed, the flags say in one line how to get it.
"""
import dataclasses
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
import torch

from mhakern.memorize import cli
from mhakern.memorize.capacity import find_capacities, find_capacity
from mhakern.memorize.config import RunConfig
from mhakern.memorize.store import ResultStore
from mhakern.memorize.sweep import RAY_MISSING, expand_grid, plan_stacks, run_sweep

TINY = RunConfig(heads=1, context=3, d_model=8, T=24, steps=300, eval_every=100)
OUTCOME = ("key", "mem_acc", "best_acc", "final_acc", "loss", "steps_done", "stopped_early", "stack_size", "history")


def _outcomes(db):
    con = sqlite3.connect(db)
    con.row_factory = sqlite3.Row
    try:
        return {r["key"]: tuple(r[c] for c in OUTCOME) for r in con.execute("SELECT * FROM runs")}
    finally:
        con.close()


def _rows(db):
    if not os.path.exists(db):
        return {}
    con = sqlite3.connect(db, timeout=30)
    try:
        return {k: (i, f) for k, i, f in con.execute("SELECT key, id, finished_at FROM runs")}
    except sqlite3.OperationalError:  # the driver has not created the table yet
        return {}
    finally:
        con.close()


@pytest.fixture
def one_thread():
    # The runs here are tiny; one torch thread each, in this process and in the workers (the
    # pool passes this process's thread count on), keeps two workers from oversubscribing the
    # two cores, and the numbers are the same either way.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def pool():
    pytest.importorskip("ray")
    from mhakern.memorize.sweep import RayPool

    p = RayPool(workers=2, threads=1)
    try:
        yield p
    finally:
        p.close()


def test_a_sweep_on_ray_stores_what_it_stores_without_ray(tmp_path, pool, one_thread):
    cfgs = expand_grid(TINY, {"heads": [1, 2]}, seeds=[0, 1])
    assert len(plan_stacks(cfgs, max_stack=2)) == 2  # two tasks, run at once on the two slots
    here, there = str(tmp_path / "here.sqlite"), str(tmp_path / "ray.sqlite")
    a = run_sweep(cfgs, ResultStore(here), "exp", progress=False, max_stack=2)
    b = run_sweep(cfgs, ResultStore(there), "exp", progress=False, max_stack=2, pool=pool)
    assert (a.trained, b.trained) == (4, 4)
    assert pool.device == "cpu" and pool.slots == 2
    assert _outcomes(here) == _outcomes(there)  # same stacks, same seeds: the same numbers, bit for bit
    rows = ResultStore(there).runs("exp")
    assert {r["stack_size"] for r in rows} == {2}
    again = run_sweep(cfgs, ResultStore(there), "exp", progress=False, max_stack=2, pool=pool)
    assert (again.skipped, again.trained) == (4, 0)


def test_a_task_whose_worker_dies_is_retried_and_stored_once(tmp_path, pool, one_thread):
    from mhakern.memorize.sweep import RayPool

    cfgs = expand_grid(TINY, {"heads": [1, 2]}, seeds=[0])
    crash = tmp_path / "crashed"
    # The first attempt of a task finds no marker file: it writes one and its worker exits at
    # once (os._exit), as a worker lost with its node does; Ray runs the task again.
    crashing = RayPool(threads=1, max_retries=2, crash_once=str(crash))
    db = str(tmp_path / "r.sqlite")
    summary = run_sweep(cfgs, ResultStore(db), "exp", progress=False, max_stack=1, pool=crashing)
    assert crash.exists() and crash.read_text().isdigit()
    assert (summary.trained, summary.by_others) == (2, 0)
    ref = str(tmp_path / "ref.sqlite")
    run_sweep(cfgs, ResultStore(ref), "exp", progress=False, max_stack=1)
    assert _outcomes(db) == _outcomes(ref)
    assert ResultStore(db).conn.execute("SELECT COUNT(*) FROM claims").fetchone()[0] == 0

    # Without retries the lost worker fails the sweep, with the runs stored so far kept.
    crash.unlink()
    fragile = RayPool(threads=1, max_retries=0, crash_once=str(crash))
    import ray

    with pytest.raises(ray.exceptions.RayError):
        run_sweep(cfgs, ResultStore(str(tmp_path / "f.sqlite")), "exp", progress=False, max_stack=2, pool=fragile)


def test_a_killed_driver_resumes_without_redoing_finished_runs(tmp_path, pool, one_thread):
    import ray

    address = ray.get_runtime_context().gcs_address
    db = str(tmp_path / "r.sqlite")
    argv = [sys.executable, "-m", "mhakern.memorize", "sweep", "-H", "1:4", "-n", "3", "-d", "8", "-T", "24",
            "--steps", "600", "--eval-every", "200", "--stack", "1", "--db", db, "--out", str(tmp_path),
            "--no-progress", "--ray", address]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None and not _rows(db):
            time.sleep(0.05)
        assert proc.poll() is None, "the driver ended before it could be killed: " + proc.stdout.read().decode()[-800:]
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
    assert 1 <= len(before) < 4
    # Resume from here on the same cluster: the dead driver's claims are free at once (its
    # process is gone), its stored runs are skipped, the others trained.
    base = dataclasses.replace(cli.cli_defaults(), context=3, d_model=8, T=24, steps=600, eval_every=200)
    cfgs = expand_grid(base, {"heads": [1, 2, 3, 4]}, seeds=[0])
    assert set(before) <= {c.key() for c in cfgs}
    t0 = time.time()
    summary = run_sweep(cfgs, ResultStore(db), "sweep", progress=False, max_stack=1, pool=pool)
    assert time.time() - t0 < 100  # well under the 120 s lease it would otherwise wait out
    assert (summary.skipped, summary.trained) == (len(before), 4 - len(before))
    after = _rows(db)
    assert len(after) == 4 and all(after[k] == v for k, v in before.items())


@pytest.mark.parametrize(
    "argv",
    [
        ["sweep", "-H", "1,2", "--workers", "2"],
        ["capacity", "-H", "2", "--ray", "auto"],
        ["capacity-dhead", "--ray", "10.0.0.1:6379"],
    ],
)
def test_without_ray_the_flags_say_how_to_get_it(tmp_path, monkeypatch, capsys, argv):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError, as without the package
    code = cli.main(argv + ["--db", str(tmp_path / "r.sqlite"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and RAY_MISSING in err and 'pip install "mhakern[ray]"' in err
    assert not (tmp_path / "r.sqlite").exists()  # nothing started


def test_an_unreachable_cluster_is_one_line(tmp_path, capsys):
    pytest.importorskip("ray")
    import socket

    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = cli.main(["sweep", "--ray", f"127.0.0.1:{port}", "--db", str(tmp_path / "r.sqlite"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("mhakern-memorize: error: --ray: cannot reach a Ray cluster at 127.0.0.1:")


def test_ray_flags_are_checked_before_anything_runs(tmp_path, capsys):
    code = cli.main(["sweep", "--ray", "auto", "--workers", "2", "--db", str(tmp_path / "r.sqlite")])
    assert code == 2 and "--workers" in capsys.readouterr().err
    code = cli.main(["sweep", "--workers", "0", "--db", str(tmp_path / "r.sqlite")])
    assert code == 2 and "--workers: must be an integer >= 1" in capsys.readouterr().err


def test_capacity_searches_in_lockstep_probe_what_each_probes_alone():
    # Fake trainer: configuration j memorizes T <= limit[j] for seed 0 and one less for seed 1.
    limits = {1: 37, 2: 81, 3: 150}

    def fake(cfgs):
        return {c.key(): 1.0 if c.T <= limits[c.heads] - c.seed else 0.5 for c in cfgs}

    cfgs = [dataclasses.replace(TINY, heads=h) for h in (1, 2, 3)]
    together = find_capacities(cfgs, [0, 1], store=None, experiment="x", t_start=8, resolution=0.01, train_fn=fake)
    for c, res in zip(cfgs, together):
        alone = find_capacity(c, [0, 1], store=None, experiment="x", t_start=8, resolution=0.01, train_fn=fake)
        assert res.per_seed == alone.per_seed and res.probes == alone.probes
        assert res.per_seed == [limits[c.heads], limits[c.heads] - 1]
