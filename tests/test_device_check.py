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
# One step per stage of the default run: the build, the GPU tests under each backward kernel's
# setting, the backward kernels' bit-identity, the ceilings and the headline table.
DEFAULT_STEPS = ("install and build", "ceilings", "smoke", "sm_90a family, backward opted in",
                 "fused sm90 backward (MHAKERN_CUDA_SM90_BWD=fused", "cuda backend (",
                 "fused mma.sync backward (MHAKERN_CUDA_MMA_BWD=fused", "triton backend, fused deterministic backward",
                 "bit-identical, fused against split", "headline benchmarks", "benchmark report")


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
    assert skipped and any("headline benchmarks" in n for n in skipped), acc  # the last steps go first
    assert "install and build" not in " ".join(skipped), acc  # the first steps still run
    assert int(re.search(r"total: (\d+)s of 150s", acc).group(1)) <= 150, acc
    assert "SKIPPED (the time budget was spent)" in r.stdout


def test_bit_identity_step_covers_every_backward_kernel():
    # benchmarks/diag_gpu.py BWD_KERNELS names each backward kernel with its setting: every kernel
    # the capabilities and the Triton heuristics list must be there, with the determinism they claim.
    import json

    import torch

    import mhakern
    from mhakern.kernels import heuristics

    sys.path.insert(0, str(ROOT))
    from benchmarks import diag_gpu

    mhakern.available_backends()
    caps = json.loads(torch.ops.mhakern_C.capabilities())["cuda"]
    got = {}
    for label, family, settings, deterministic, peer in diag_gpu.BWD_KERNELS:
        (kind, name), = settings.items()
        got[(kind, name)] = deterministic
        assert peer is None or peer in {k[0] for k in diag_gpu.BWD_KERNELS}, label
    want = {("sm90", n): k["deterministic"] for n, k in caps["sm90"]["bwd_kernels"].items()}
    want.update({("mma", n): k["deterministic"] for n, k in caps["bwd"]["kernels"].items()})
    want.update({("triton", n): n != "atomic" for n in heuristics.BWD_MODES})
    assert got == want
