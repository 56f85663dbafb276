"""The prepared GPU run (benchmarks/device_check.sh) fits its budget by its own accounting: a dry
run (nothing installed or run; every step accounted at its full allowance, the worst case) must
fit the default 6 minutes with every default stage in it, and with a smaller budget the steps
that no longer fit must be skipped and say so. No GPU needed; a few seconds."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "device_check.sh"
# One step per stage of the default run (and of the list: build, GPU tests with the
# backward's bit-identity, ceilings and headline table, forward variants, decode splits, ncu).
DEFAULT_STEPS = ("install and build", "ceilings", "smoke", "sm_90a family, backward opted in", "bit-identical",
                 "cuda backend", "headline benchmarks", "forward variants", "decode: planned and forced splits",
                 "ncu: fwd", "ncu: bwd", "ncu: decode ", "ncu: decode_mma", "benchmark report")


def _dry_run(tmp_path, budget=None):
    env = dict(os.environ, DEVICE_CHECK_DRY_RUN="1", PYTHON=sys.executable)
    env.pop("DEVICE_CHECK_STAGES", None)
    if budget is not None:
        env["DEVICE_CHECK_BUDGET_S"] = str(budget)
    r = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], capture_output=True, text=True, env=env,
                       timeout=120, cwd=ROOT)
    acc = r.stdout[r.stdout.index("time accounting"):]
    return r, acc


def test_dry_run_fits_six_minutes_with_every_stage(tmp_path):
    r, acc = _dry_run(tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for name in DEFAULT_STEPS:
        assert re.search(rf"{re.escape(name)}.*allowed", acc), f"step {name!r} missing from the accounting:\n{acc}"
    total = int(re.search(r"total: (\d+)s of 360s \(fits\)", acc).group(1))
    assert total <= 360
    assert "SKIPPED" not in acc


def test_dry_run_skips_what_a_smaller_budget_cannot_hold(tmp_path):
    r, acc = _dry_run(tmp_path, budget=150)
    skipped = re.findall(r"^\s+(.*?)\s+cap\s+\d+s\s+SKIPPED", acc, re.M)
    assert skipped and any("ncu" in n for n in skipped), acc  # the last steps go first
    assert "install and build" not in " ".join(skipped), acc  # the first steps still run
    assert int(re.search(r"total: (\d+)s of 150s", acc).group(1)) <= 150, acc
    assert "SKIPPED (the time budget was spent)" in r.stdout
