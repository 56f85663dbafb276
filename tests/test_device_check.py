"""The prepared GPU run (benchmarks/device_check.sh, its plan in benchmarks/device_plan.py) fits its
budget by its own accounting, covers every kernel family, pass and mode that ``auto`` can route a
call to on a 8.0 or 9.0 device, and survives a hang: a dry run (nothing installed or run, every
step accounted at its full allowance, the worst case) must fit the default 6 minutes with slack
and print a ``covers:`` line for each item; a rehearsal on the CPU with a hang planted in one
step must name it and still report the steps after it within its budget. No GPU needed.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "device_check.sh"
sys.path.insert(0, str(ROOT))

from benchmarks import device_plan as dp  # noqa: E402

# What the check must launch against the float64 reference (issue 29, What 2): family, pass, what.
REQUIRED = [
    ("sm90", "fwd", "dense"), ("sm90", "fwd", "varlen"), ("sm90", "fwd", "d256"), ("sm90", "fwd", "splitk"),
    ("sm90", "bwd", "split"), ("sm90", "bwd", "fused"),
    ("mma", "fwd", "dense"), ("mma", "bwd", "split"), ("mma", "bwd", "fused"), ("mma", "bwd", "fused_atomic"),
    ("mma", "bwd", "d256"), ("mma", "fwd", "varlen"), ("mma", "bwd", "varlen"),
    ("mma", "fwd", "cache_batch_idx"), ("mma", "fwd", "paged"), ("mma", "fwd", "splitk"),
    ("triton", "fwd", "dense"), ("triton", "bwd", "fused"), ("triton", "fwd", "varlen"), ("triton", "bwd", "varlen"),
    ("triton", "fwd", "cache_batch_idx"), ("triton", "fwd", "paged"), ("triton", "fwd", "splitk"),
    # issue 32: mhakern.flex_attention's generated Triton kernels, forward and backward.
    ("triton", "fwd", "flex"), ("triton", "bwd", "flex"),
]
TOKEN = r"[a-z0-9_.-]+"


def _run(tmp_path, timeout=150, **env_extra):
    env = dict(os.environ, PYTHON=sys.executable)
    for k in ("DEVICE_CHECK_STAGES", "DEVICE_CHECK_PLANT", "DEVICE_CHECK_BUDGET_S", "DEVICE_CHECK_DRY_RUN",
              "DEVICE_CHECK_REHEARSAL", "DEVICE_CHECK_INSTALL"):
        env.pop(k, None)
    env.update(env_extra)
    out = tmp_path / "out"
    r = subprocess.run(["bash", str(SCRIPT), str(out)], capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    return r, out


def _accounting(stdout):
    return stdout[stdout.index("time accounting"):]


def test_plan_table_is_consistent():
    assert dp.check_table() == []
    from benchmarks.device_smoke import SMOKE_CASES
    from benchmarks.diag_gpu import BWD_KERNELS

    assert dp.BY_NAME["smoke"].children == len(SMOKE_CASES)
    assert dp.BY_NAME["bitident"].children == len(BWD_KERNELS)


@pytest.mark.slow  # the whole plan in dry mode (15 s): run it before a GPU session (docs/install.md)
def test_dry_run_fits_with_slack_and_covers_every_kernel(tmp_path):
    r, out = _run(tmp_path, DEVICE_CHECK_DRY_RUN="1")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    acc = _accounting(r.stdout)
    caps = {m.group(1): int(m.group(2)) for m in re.finditer(r"^\s+(\w+)\s+cap\s+(\d+)s\s+allowed", acc, re.M)}
    for name in dp.DEFAULT_STAGES + ("install", "plan"):
        assert name in caps, f"step {name!r} missing from the accounting:\n{acc}"
    # Every test step runs tests the collection found (a renamed test would leave it empty).
    for name, n in re.findall(r"^\s+(\w+)\s+cap.*allowed.*\s(\d+) tests$", acc, re.M):
        assert int(n) > 0, f"{name}: no test selected\n{acc}"
    total = int(re.search(rf"total: (\d+)s of {dp.BUDGET_S}s \(fits\)", acc).group(1))
    assert total <= 0.92 * dp.BUDGET_S, f"the default run must leave slack in its {dp.BUDGET_S} s:\n{acc}"
    assert "SKIPPED" not in acc
    # A second run after fixes, naming some steps, fits in what a 15-minute lease has left.
    second = dp.ENV_S + caps["install"] + caps["plan"] + sum(caps[n] for n in ("sm90_bwd_fused", "triton_bwd", "bitident"))
    assert second <= 200, caps
    # One covers: line per item, each token of the documented alphabet, naming a step of the run.
    covers = re.findall(rf"^covers: ({TOKEN}) ({TOKEN}) ({TOKEN}(?:\+{TOKEN})*) in ({TOKEN})$", r.stdout, re.M)
    assert len(covers) == len([ln for ln in r.stdout.splitlines() if ln.startswith("covers:")])
    got = set()
    for fam, ps, what, step in covers:
        assert fam in dp.FAMILIES and ps in dp.PASSES and step in caps, (fam, ps, what, step)
        for w in what.split("+"):
            assert w in dp.WHATS, w
            got.add((fam, ps, w))
    missing = [item for item in REQUIRED if item not in got]
    assert not missing, f"not covered: {missing}"
    assert (out / "summary.md").exists()


def test_a_small_budget_skips_the_last_steps_and_keeps_the_report(tmp_path):
    # No test step: no collection, a few seconds.
    r, _ = _run(tmp_path, DEVICE_CHECK_DRY_RUN="1", DEVICE_CHECK_BUDGET_S="90",
                DEVICE_CHECK_STAGES="smoke bitident ceilings bench report")
    acc = _accounting(r.stdout)
    skipped = re.findall(r"^\s+(\w+)\s+cap\s+\d+s\s+SKIPPED", acc, re.M)
    assert skipped == ["ceilings", "bench"], acc  # the last steps go first
    assert re.search(r"^\s+report\s+cap\s+\d+s\s+allowed", acc, re.M), acc
    assert int(re.search(r"total: (\d+)s of 90s", acc).group(1)) <= 90, acc


def test_unknown_stage_and_bad_plant_are_refused(tmp_path):
    r, _ = _run(tmp_path, DEVICE_CHECK_STAGES="smoke sm90_fwdd", DEVICE_CHECK_DRY_RUN="1")
    assert r.returncode == 2 and "sm90_fwdd" in r.stderr
    r, _ = _run(tmp_path, DEVICE_CHECK_STAGES="smoke", DEVICE_CHECK_PLANT="hang:smoke", DEVICE_CHECK_DRY_RUN="1")
    assert r.returncode == 2 and "DEVICE_CHECK_REHEARSAL=1" in r.stderr  # a plant only in a rehearsal


def test_rehearsal_names_a_planted_hang_and_reports_the_later_steps(tmp_path):
    # The CPU rehearsal: the smoke step's children on the cpu backend and the Triton interpreter,
    # its first child hung by the plant; the sm_90a tests after it skip (no GPU) but must report.
    budget = 45
    r, out = _run(tmp_path, timeout=budget + 60, DEVICE_CHECK_REHEARSAL="1", DEVICE_CHECK_INSTALL="0",
                  DEVICE_CHECK_STAGES="smoke sm90_fwd", DEVICE_CHECK_PLANT="hang:smoke",
                  DEVICE_CHECK_BUDGET_S=str(budget))
    summary = (out / "summary.md").read_text()
    hung = re.compile(rf"^\s*-?\s*HUNG sm90 fwd smoke/sm90_default$", re.M)
    assert hung.search(r.stdout) and hung.search(summary), r.stdout[-4000:]
    for line in re.findall(r"^(?:HUNG|WRONG|ERROR|CRASHED) .*$", summary.replace("- ", ""), re.M):
        assert re.fullmatch(rf"(HUNG|CRASHED) ({'|'.join(dp.FAMILIES)}) (fwd|bwd) \S+", line) or \
            re.fullmatch(rf"(WRONG) ({'|'.join(dp.FAMILIES)}) (fwd|bwd) \S+ \S+ \S+", line) or line.startswith("ERROR"), line
    # The other smoke children finished, and the step after it ran and reported.
    assert "smoke: triton, its default fused deterministic backward: ok" in summary, summary
    assert re.search(r"^- sm90_fwd: (ok|FAILED) in \d+s", summary, re.M), summary
    assert int(re.search(r"total wall time: (\d+) s", summary).group(1)) <= budget, summary
    assert r.returncode == 1  # a hang is a failed check


def test_bit_identity_step_covers_every_backward_kernel():
    # benchmarks/diag_gpu.py BWD_KERNELS names each backward kernel with its setting: every kernel
    # the capabilities and the Triton heuristics list must be there, with the determinism they claim.
    import json

    import torch

    import mhakern
    from benchmarks import diag_gpu
    from mhakern.kernels import heuristics

    mhakern.available_backends()
    caps = json.loads(torch.ops.mhakern_C.capabilities())["cuda"]
    got = {}
    for label, family, settings, deterministic, peer in diag_gpu.BWD_KERNELS:
        (kind, name), = settings.items()
        got[(kind, name)] = deterministic
        assert peer is None or peer in {k[0] for k in diag_gpu.BWD_KERNELS}, label
        assert diag_gpu.kernel_family(settings) in dp.FAMILIES
    want = {("sm90", n): k["deterministic"] for n, k in caps["sm90"]["bwd_kernels"].items()}
    want.update({("mma", n): k["deterministic"] for n, k in caps["bwd"]["kernels"].items()})
    want.update({("triton", n): n != "atomic" for n in heuristics.BWD_MODES})
    assert got == want


def test_a_step_without_the_plans_count_is_capped_by_its_childs(tmp_path):
    # The H200 run of 2026-12-04: the plan's collection ran out of time on a cold machine, every
    # step then ran its functions whole under the cap of a count of one test a function, and was
    # killed mid-run. Now the child's own collection ("collected" record) sets its deadline.
    import json
    import time

    from benchmarks import device_check as chk

    step, rec = dp.BY_NAME["sm90_fwd"], tmp_path / "r.jsonl"
    t0 = time.monotonic()
    assert chk._extended(rec, step, t0, t0 + 1000) is None  # nothing recorded yet
    rec.write_text(json.dumps({"ev": "start", "case": "x"}) + "\n")
    assert chk._extended(rec, step, t0, t0 + 1000) is None
    with open(rec, "a") as f:
        f.write(json.dumps({"ev": "collected", "n": 43}) + "\n")
    late = chk._extended(rec, step, t0, t0 + 1000)
    assert late == pytest.approx(t0 + step.cap(43) - chk.KILL_GRACE_S - 1)
    assert step.cap(43) > 2 * step.cap(len(step.tests))  # 30 s against the 12 s the device gave it
    assert chk._extended(rec, step, t0, t0 + 10) == pytest.approx(t0 + 10 - chk.KILL_GRACE_S - 1)  # the budget's end


def test_a_cut_step_is_told_from_a_hang(tmp_path):
    # The same run: the step's cap ran out with Triton tests compiling under their own 30 s limit,
    # and the summary said HUNG. A child killed at its deadline leaves its running test CUT; one
    # killed for a test past its own limit, HUNG.
    import json
    import shutil
    import time

    from benchmarks import device_check as chk

    check = chk.Check(tmp_path)
    try:
        log = tmp_path / "child.log"
        for stalled, want in ((None, "killed"), (lambda: True, "stalled")):
            p = check.spawn([sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ), log)
            t = time.monotonic()
            assert check.wait([(p, t + (0.3 if stalled is None else 60))], stalled=stalled)[p.pid] == want
            assert time.monotonic() - t < 20
        step, rec = dp.BY_NAME["triton_cache"], tmp_path / "r.jsonl"
        rec.write_text("".join(json.dumps(r) + "\n" for r in (
            {"ev": "collected", "n": 2, "pid": 1}, {"ev": "start", "case": "a", "pid": 1}, {"ev": "end", "case": "a", "pid": 1},
            {"ev": "start", "case": "t::b", "pid": 1})))
        for cut, word in ((True, "CUT"), (False, "HUNG")):
            lines, finished, broken = check.verdicts(step, rec, True, -2, cut=cut)
            assert lines == [f"{word} triton fwd triton_cache/t::b"] and finished == ["a"] and broken == "t::b"
    finally:
        shutil.rmtree(check.tmp, ignore_errors=True)


@pytest.mark.slow  # a planted hang under the per-test limit: about 20 s
def test_rehearsal_without_the_plans_collection_still_names_a_hang_and_runs_the_rest(tmp_path):
    # The H200 run of 2026-12-04, rehearsed: the collection runs out of time, so sm90_fwd runs its
    # functions whole. Its child's own count must raise its cap above the 12 s per-test limit
    # (else the planted hang would be CUT at the step's cap), and the rerun must deselect the
    # hung test and run the rest.
    driver = ("import sys; from benchmarks import device_check as chk; "
              "chk.Check._collect_run = lambda self, cmds, env, deadline: {n: ('', 'timed out') for n in cmds}; "
              "sys.exit(chk.main([sys.argv[1]]))")
    env = dict(os.environ, PYTHON=sys.executable, DEVICE_CHECK_REHEARSAL="1", DEVICE_CHECK_INSTALL="0",
               DEVICE_CHECK_STAGES="sm90_fwd", DEVICE_CHECK_PLANT="hang:sm90_fwd")
    env.pop("DEVICE_CHECK_BUDGET_S", None)
    env.pop("DEVICE_CHECK_DRY_RUN", None)
    r = subprocess.run([sys.executable, "-c", driver, str(tmp_path / "out")], capture_output=True, text=True,
                       env=env, timeout=150, cwd=ROOT)
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "each test step runs its functions whole" in summary, summary
    assert re.search(r"^- HUNG sm90 fwd sm90_fwd/\S+$", summary, re.M), summary
    assert re.search(r"^- sm90_fwd: exit 2; \d+ skipped, 1 deselected", summary, re.M), summary
    assert "NOT RUN" not in summary and "CUT" not in summary and r.returncode == 1, summary
