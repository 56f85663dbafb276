"""The trainer's optional packages (mhakern/memorize/extras.py): tqdm and matplotlib come with the
``trainer`` extra, not with mhakern; ``import mhakern`` (and the trainer's own import) loads
neither; without them the trainer runs, says once per package which extra to install, and
writes its reports without figures."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAINER_PACKAGES = ("tqdm", "matplotlib")


def _pyproject():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _name(requirement: str) -> str:
    """The distribution name of a requirement string ("tqdm>=4.60; ..." -> "tqdm")."""
    for i, ch in enumerate(requirement):
        if not (ch.isalnum() or ch in "-_."):
            return requirement[:i].lower()
    return requirement.lower()


def test_trainer_packages_are_an_extra():
    project = _pyproject()
    extras = project["optional-dependencies"]
    base = {_name(r) for r in project["dependencies"]}
    assert not base & set(TRAINER_PACKAGES), f"[project] dependencies still hold {sorted(base & set(TRAINER_PACKAGES))}"
    assert sorted(_name(r) for r in extras["trainer"]) == sorted(TRAINER_PACKAGES)
    # The tests run the trainer with its bars and figures: the test extra brings the trainer's.
    assert "mhakern[trainer]" in extras["test"]


def _python(script: str, cwd, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSTARTUP"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_import_loads_neither(tmp_path):
    # torch itself imports tqdm when it is installed (torch.hub), so what counts is what mhakern
    # and its trainer load beyond torch.
    r = _python(f"""
        import sys
        import torch
        by_torch = {{m for m in {TRAINER_PACKAGES!r} if m in sys.modules}}
        def new():
            return sorted(m for m in {TRAINER_PACKAGES!r} if m in sys.modules and m not in by_torch)
        import mhakern
        base = new()
        import mhakern.memorize, mhakern.memorize.cli, mhakern.memorize.report, mhakern.memorize.stores
        print(base, new())
    """, tmp_path)
    assert r.returncode == 0, r.stderr
    # The trainer imports them where it draws a bar or a figure, not when it is imported.
    assert r.stdout.splitlines()[-1] == "[] []", r.stdout


def test_trainer_runs_without_its_extra(tmp_path):
    """A sweep with progress bars asked for and its report, tqdm and matplotlib made unimportable
    (None in sys.modules: what an install without the extra meets): both succeed, each missing
    package is said once, in one line naming the extra and the package, and the report has its
    table and CSV files but no figure. The same commands with the packages installed draw the
    figure (the check that the missing figure is the missing package's doing)."""
    where = ["--db", str(tmp_path / "m.sqlite"), "--out", str(tmp_path / "out")]
    grid = ["-H", "1,2,4", "-n", "2", "-d", "4", "-T", "4", "--steps", "2", "--eval-every", "1"]
    r = _python(f"""
        import sys
        for name in {TRAINER_PACKAGES!r}:
            sys.modules[name] = None  # import raises ModuleNotFoundError, as when not installed
        from mhakern.memorize import cli
        assert cli.main(["sweep", *{grid + where!r}]) == 0  # trains, then writes its report
        assert cli.main(["report", *{where!r}]) == 0
    """, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    said = [line for line in r.stderr.splitlines() if line.startswith("mhakern.memorize:")]
    assert len(said) == 2, r.stderr
    for line, package in zip(said, TRAINER_PACKAGES):
        assert f"need {package}, which is not installed" in line, line
        assert 'pip install "mhakern[trainer]"' in line and 'pip install -e ".[trainer]"' in line, line
    report = tmp_path / "out" / "sweep"
    assert (report / "table.md").exists() and (report / "runs.csv").exists()
    assert not list(report.glob("*.png"))
    # The fits that the figure would draw are still listed in the table.
    assert "- examples memorized (mem_acc x T) against H" in (report / "table.md").read_text()

    pytest.importorskip("matplotlib", reason="the comparison with the figure drawn needs the trainer extra")
    from mhakern.memorize import cli

    assert cli.main(["report", *where]) == 0
    assert (report / "capacity_vs_heads.png").exists()
