"""The device check's orchestrator (benchmarks/device_check.sh runs it; see that script's header).

    python -m benchmarks.device_check OUTDIR

Runs the steps of benchmarks/device_plan.py in table order, each under its allowance (its cap,
less what the budget has left after the report's reserve), every kernel family in its own child
process (a process group) under a watchdog shorter than the allowance. A child that does not
finish is killed (SIGINT, then SIGKILL of the whole group 3 s later) and named
``HUNG <family> <pass> <case>`` (``CUT`` where a test step's cap ran out while its test was
still under its own limit); a wrong answer ``WRONG <family> <pass> <case> <error> <bound>``;
an exception ``ERROR``, a process killed by a signal ``CRASHED``. A pytest step whose child hung or
crashed starts again on the tests not yet run while its allowance lasts. Each step's verdicts
are printed and appended to OUTDIR/summary.md as the step ends, so a kill from outside loses
nothing that finished. Nothing here imports torch: every touch of the GPU is in a child.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import device_child as dc  # noqa: E402
from benchmarks import device_plan as dp  # noqa: E402

MIN_STEP_S = 8  # a step allowed less than this is skipped (it could not start its child)
KILL_GRACE_S = 3
BENCH_PROVIDERS = ("mhakern:cuda", "mhakern:triton[", "sdpa:cudnn")


def _flag(name: str, default: str = "0") -> str:
    return os.environ.get(name, default)


class Check:
    def __init__(self, out: Path):
        self.out = out
        self.py = os.environ.get("PYTHON", sys.executable)
        self.budget = int(_flag("DEVICE_CHECK_BUDGET_S", str(dp.BUDGET_S)))
        self.dry = _flag("DEVICE_CHECK_DRY_RUN") == "1"
        self.rehearsal = _flag("DEVICE_CHECK_REHEARSAL") == "1"
        self.install = _flag("DEVICE_CHECK_INSTALL", "1") != "0"
        self.t0 = time.monotonic()
        self.sim = 0.0  # what a dry run accounts for the steps it does not run
        self.account: List[str] = []
        self.status = 0
        self.have_gpu = False
        self.prebuilt_used = False
        self.env_s = 0.0
        self.nodeids: List[str] = []
        self.bench_ids: List[str] = []
        self.plan = dp.Plan([])
        self.skip_bitident: List[str] = []
        self.bench_skip: List[str] = []
        self.extra_env: Dict[str, str] = {}
        self.fallback_ids: Dict[str, List[str]] = {}
        self.tmp = Path(tempfile.mkdtemp(prefix="device_check_"))
        self.summary = out / "summary.md"
        self.plant_kind, self.plant_step = "", ""
        # Per kernel family: the verification steps it ran ("ok", "failed", "skipped"), and the
        # families a verdict line named as failing: what record_self_tests() writes.
        self.family_steps: Dict[str, List[str]] = {f: [] for f in SELF_TEST_FAMILIES}
        self.family_failed: set = set()

    # ------------------------------------------------------------------ bookkeeping
    def now(self) -> float:
        if self.dry:  # the planned run: the environment step as on the device, the rest at their allowances
            return dp.ENV_S + self.sim
        return time.monotonic() - self.t0 + self.sim

    def note(self, msg: str) -> None:
        print(f"device_check [{self.now():.0f}s]: {msg}", flush=True)

    def say(self, line: str) -> None:
        """A verdict: printed now and appended to the summary now."""
        words = line.split()
        if len(words) > 1 and words[0] in FAILURE_WORDS:
            self.family_failed.add(words[1])
        elif len(words) > 2 and words[:2] == ["NOT", "RUN"]:
            self.family_failed.add(words[2])
        print(f"  {line}", flush=True)
        with open(self.summary, "a") as f:
            f.write(f"- {line}\n")

    def log(self, name: str) -> Path:
        return self.out / name

    # ------------------------------------------------------------------ children
    def spawn(self, cmd: Sequence[str], env: Dict[str, str], log: Path) -> subprocess.Popen:
        fh = open(log, "a")
        fh.write(f"$ {' '.join(cmd)}\n")
        fh.flush()
        p = subprocess.Popen(list(cmd), cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        p._log_fh = fh  # type: ignore[attr-defined]
        return p

    def wait(self, procs: List[Tuple[subprocess.Popen, float]], stalled=None, extend=None) -> Dict[int, str]:
        """Waits for each (process, deadline); a process past its deadline gets SIGINT (pytest
        then still writes its summary and JSON), its whole group SIGKILL KILL_GRACE_S later, all
        of them at once; ``stalled()`` true kills them too (a test past its own limit);
        ``extend()``, once it returns a time, is every process's deadline from then on (a
        fallback step's cap, known when its child has collected). Returns {pid: 'done' |
        'killed' (at its deadline) | 'stalled' (by ``stalled()``)}."""
        state: Dict[int, str] = {}
        signalled: Dict[int, float] = {}
        why: Dict[int, str] = {}
        while len(state) < len(procs):
            now = time.monotonic()
            if extend is not None:
                later = extend()
                if later is not None:
                    procs, extend = [(p, max(d, later)) for p, d in procs], None
            for p, deadline in procs:
                if p.pid in state:
                    continue
                if p.poll() is not None:
                    state[p.pid] = why.get(p.pid, "done")
                    _killpg(p.pid, signal.SIGKILL)  # what the child left running in its group
                elif p.pid not in signalled and (now > deadline or (stalled is not None and stalled())):
                    signalled[p.pid] = now
                    why[p.pid] = "killed" if now > deadline else "stalled"
                    _killpg(p.pid, signal.SIGINT)
                elif p.pid in signalled and now > signalled[p.pid] + KILL_GRACE_S:
                    _killpg(p.pid, signal.SIGKILL)
            time.sleep(0.1)
        for p, _ in procs:
            p._log_fh.close()  # type: ignore[attr-defined]
        return state

    def child_env(self, step: dp.Step, records: Path, planted: bool) -> Dict[str, str]:
        env = dict(os.environ)
        env.update(self.extra_env)
        env.update(dict(step.env))
        env[dc.RECORDS_ENV] = str(records)
        env.pop(dc.PLANT_ENV, None)
        if planted:
            env[dc.PLANT_ENV] = self.plant_kind
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        # The check verifies the families itself: its children must not spend their caps on the
        # first-use self-test (mhakern/selftest.py), whose cache it fills at the end instead.
        env["MHAKERN_SELF_TEST"] = "0"
        if not self.have_gpu:
            env.setdefault("TRITON_INTERPRET", "1")
        return env

    def planted_first(self, step: dp.Step) -> bool:
        if self.plant_step == step.name:
            self.plant_step = ""  # one plant a run, in the step's first child
            return True
        return False

    # ------------------------------------------------------------------ verdicts from records
    def verdicts(self, step: dp.Step, records: Path, killed: bool, rc: Optional[int],
                 fallback: Optional[Tuple[str, str, str]] = None, cut: bool = False) -> Tuple[List[str], List[str], str]:
        """(lines, finished cases, the case that hung or crashed or '') from one child's records;
        ``fallback``: (family, pass, case) of a child that hung before its first record; ``cut``:
        the child was killed at its step's cap, not for a test past its own limit (CUT, not HUNG)."""
        lines, finished = [], []
        current: Dict[int, dict] = {}
        broken = ""
        rows = []
        if records.exists():
            for ln in records.read_text().splitlines():
                try:
                    rows.append(json.loads(ln))
                except ValueError:
                    continue
        fam_of: Dict[str, Tuple[str, str]] = {}
        for r in rows:
            case, pid = r.get("case", ""), r.get("pid", 0)
            if r["ev"] == "start":
                current[pid] = {"case": case, "pass": r.get("pass") or step.passname}
                fam_of[case] = (r.get("family") or step.family, r.get("pass") or step.passname)
            elif r["ev"] == "phase" and pid in current:
                current[pid]["pass"] = r.get("pass", current[pid]["pass"])
            elif r["ev"] == "fail":
                fam, ps = fam_of.get(case, (step.family, step.passname))
                if r.get("kind") == "wrong":
                    kind, ps2, err, bound = "wrong", r.get("pass", ps), r["error"], r["bound"]
                else:
                    kind, ps2, err, bound = dc.parse_failure(r.get("msg", ""), current.get(pid, {}).get("pass", ps))
                if kind == "wrong":
                    lines.append(f"WRONG {fam} {ps2} {dc.token(f'{step.name}/{case}')} {err} {bound}")
                else:
                    lines.append(f"ERROR {fam} {ps2} {dc.token(f'{step.name}/{case}')} {r.get('exc', '?')}: {r.get('msg', '')[:160]}")
            elif r["ev"] == "end":
                current.pop(pid, None)
                finished.append(case)
        for pid, c in current.items():
            fam = fam_of.get(c["case"], (step.family, step.passname))[0]
            word = ("CUT" if cut else "HUNG") if killed else "CRASHED"
            if not killed and rc is not None and rc >= 0:
                word = "EXITED"
            lines.append(f"{word} {fam} {c['pass']} {dc.token(step.name + '/' + c['case'])}" + ("" if killed else f" (exit {rc})"))
            broken = broken or c["case"]
        if killed and not current and not finished:
            fam, ps, case = fallback or (step.family, step.passname, "startup")
            lines.append(f"{'CUT' if cut else 'HUNG'} {fam} {ps} {dc.token(f'{step.name}/{case}')}")
            broken = broken or case
        return lines, finished, broken

    # ------------------------------------------------------------------ running one step
    def allowance(self, step: dp.Step, cap: int) -> int:
        """The step's cap, cut to what the budget has left less the report's cap (the report
        always runs): under a budget below the caps' sum the last steps are cut first."""
        reserve = 0
        if step.name != "report" and any(s.name == "report" for s in self.plan.steps):
            reserve = self.plan.cap(dp.BY_NAME["report"])
        return int(min(cap, self.budget - self.now() - reserve))

    def run_step(self, step: dp.Step) -> None:
        cap = self.plan.cap(step)
        t = self.allowance(step, cap)
        n = self.plan.counts.get(step.name)
        size = f"{n} tests" if step.kind == "pytest" and n is not None else (
            f"{step.children} children" if step.kind == "children" else "")
        if t < MIN_STEP_S:
            if step.family in self.family_steps:
                self.family_steps[step.family].append("skipped")
            self.account.append(f"{step.name:<15} cap {cap:4d}s  SKIPPED (budget spent)  {size}")
            self.say(f"{step.name}: SKIPPED (the time budget was spent: {t}s left of its {cap}s cap)")
            return
        self.account.append(f"{step.name:<15} cap {cap:4d}s  allowed {t:4d}s  from {self.now():4.0f}s  {size}")
        if self.dry:
            self.note(f"{step.name} (dry run: accounted {t}s): {step.what}")
            self.sim += t
            return
        self.note(f"{step.name} (up to {t}s): {step.what}")
        t1 = time.monotonic()
        deadline = t1 + t
        handler = getattr(self, f"do_{step.kind}")
        ok = handler(step, deadline)
        if step.family in self.family_steps and step.plantable:
            self.family_steps[step.family].append("ok" if ok else "failed")
        self.say(f"{step.name}: {'ok' if ok else 'FAILED'} in {time.monotonic() - t1:.0f}s (allowed {t}s)")
        if not ok:
            self.status = 1

    def run_children(self, step: dp.Step, cmds: List[Tuple[str, str, List[str]]], deadline: float, log: Path,
                     parallel: int) -> Tuple[bool, List[str]]:
        """Runs (name, family, command) children, ``parallel`` at a time, each under the wave's
        share of what is left until the deadline; returns (all ok, verdict lines)."""
        ok, lines = True, []
        for i in range(0, len(cmds), parallel):
            wave = cmds[i:i + parallel]
            waves_left = (len(cmds) - i + parallel - 1) // parallel
            share = (deadline - time.monotonic()) / waves_left - KILL_GRACE_S - 1  # the watchdog, kill included
            if share < 3:
                for name, fam, _ in wave:
                    lines.append(f"NOT RUN {fam} {step.passname} {step.name}/{name} (the step's time was spent)")
                ok = False
                continue
            procs, recs = [], []
            for name, fam, cmd in wave:
                rec = self.tmp / f"{step.name}.{name}.jsonl"
                rec.unlink(missing_ok=True)
                child_log = self.tmp / f"{step.name}.{name}.log"
                p = self.spawn(cmd, self.child_env(step, rec, self.planted_first(step)), child_log)
                procs.append((p, time.monotonic() + share))
                recs.append((name, fam, p, rec, child_log))
            state = self.wait(procs)
            for name, fam, p, rec, child_log in recs:
                killed = state[p.pid] == "killed"
                v, _, _ = self.verdicts(step, rec, killed, p.returncode, (fam, step.passname, name))
                with open(log, "a") as f:
                    f.write(child_log.read_text())
                    f.write(f"[{name}: exit {p.returncode}{' (killed by the watchdog)' if killed else ''}]\n")
                if p.returncode != 0 or v:
                    ok = False
                    if not v:
                        v = [f"ERROR {fam} {step.passname} {step.name}/{name} exit {p.returncode}"]
                lines += v
        return ok, lines

    def do_children(self, step: dp.Step, deadline: float) -> bool:
        log = self.log("setup.log" if step.name == "smoke" else "tests.log")
        dev = "cuda" if self.have_gpu else "cpu"
        if step.name == "smoke":
            from benchmarks.device_smoke import SMOKE_CASES

            cmds = [(n, c[4], [self.py, "-m", "benchmarks.device_smoke", "--one", n, "--device", dev])
                    for n, c in SMOKE_CASES.items()]
            ok, lines = self.run_children(step, cmds, deadline, log, step.parallel)
            text = log.read_text()
            for ln in text.splitlines():
                if ln.startswith("smoke: "):
                    self.say(ln)
            self.decide_from_smoke(lines)
        else:  # bitident: the split kernels first (the others compare with them), then the rest
            from benchmarks.diag_gpu import BWD_KERNELS, kernel_family

            gdir = self.tmp / "grads"
            gdir.mkdir(exist_ok=True)
            base = [self.py, "benchmarks/diag_gpu.py", "bitident", "--causal", "--grads-dir", str(gdir),
                    "--json", str(self.log("diag.jsonl"))] + ([] if self.have_gpu else ["--rehearse"])
            kernels = [(label, kernel_family(settings), peer) for label, _, settings, _, peer in BWD_KERNELS
                       if not any(s in label for s in self.skip_bitident)]
            for label in self.skip_bitident:
                self.say(f"bitident: {label} left out (its step hung)")
            first = [(lb.replace(" ", "_"), f, base + ["--kernel", lb]) for lb, f, peer in kernels if peer is None]
            rest = [(lb.replace(" ", "_"), f, base + ["--kernel", lb]) for lb, f, peer in kernels if peer is not None]
            # The splits, then the rest, step.parallel at a time (on a GPU; a CPU rehearsal four).
            par = step.parallel if self.have_gpu else 4
            n1 = -(-len(first) // par)
            n2 = -(-len(rest) // par)
            ok1, l1 = self.run_children(step, first, time.monotonic() + (deadline - time.monotonic()) * n1 / max(1, n1 + n2),
                                        log, par)
            ok2, l2 = self.run_children(step, rest, deadline, log, par)
            ok, lines = ok1 and ok2, l1 + l2
            for ln in log.read_text().splitlines():
                if ln.startswith("diag: backward "):
                    self.say(ln[len("diag: "):])
        for ln in lines:
            self.say(ln)
        return ok

    def decide_from_smoke(self, lines: List[str]) -> None:
        for ln in lines:
            parts = ln.split()
            if parts[0] in ("HUNG", "CRASHED") and parts[3] == "smoke/sm90_default":
                # Every plain call would hang or crash again: the later steps (not the sm90
                # forward's own) run the mma.sync family.
                self.extra_env["MHAKERN_CUDA_FWD_FAMILY"] = "mma_sync"
                self.say("decision: the sm_90a forward hung or crashed in the smoke step: later steps but sm90_fwd "
                         "run with MHAKERN_CUDA_FWD_FAMILY=mma_sync")
            if parts[0] in ("HUNG", "CRASHED") and parts[3] == "smoke/sm90_bwd_optin":
                self.skip_bitident.append("cuda sm90")
                self.bench_skip += ["sm90 bwd", "sm90 fused bwd"]
                self.say("decision: the sm90 backward hung or crashed in the smoke step: bitident and the "
                         "benchmarks leave it out")

    def pytest_cmd(self, step: dp.Step, ids: Sequence[str], extra: Sequence[str] = ()) -> List[str]:
        cmd = [self.py, "-m", "pytest", *ids, "-q", "-p", "no:cacheprovider", "-p", "benchmarks.device_pytest_plugin",
               "-rfE", *extra]
        if step.xdist and self.have_gpu and self.has_xdist and len(ids) > 4:
            cmd += ["-n", str(min(step.xdist, max(1, (os.cpu_count() or 2) // 2)))]
        return cmd

    def do_pytest(self, step: dp.Step, deadline: float, ids: Optional[List[str]] = None, log_name: str = "tests.log",
                  extra: Sequence[str] = ()) -> bool:
        if ids is None:
            ids = dp.selected(step, self.nodeids)
            if not ids:  # the plan found none of them, or never ran (its step skipped): functions whole
                ids = self.fallback_ids.setdefault(step.name, sorted({f"{t.file}::{t.func}" for t in step.tests}))
        if not ids:
            self.say(f"{step.name}: no tests selected (the collection found none of its selections)")
            return False
        log = self.log(log_name)
        ok, todo, lines, counts = True, list(ids), [], []
        # Functions whole, uncounted by the plan: each child's cap follows its own count, within
        # what the budget has left before the report; after a hang the tests that ended and the
        # one that hung are deselected (its node ids are not in todo, which names functions).
        whole = step.name in self.fallback_ids and ids is self.fallback_ids[step.name]
        deselect: List[str] = []
        while todo:
            left = deadline - time.monotonic()
            if counts and left < max(MIN_STEP_S, step.start_s + KILL_GRACE_S + 2):  # no time to start again
                lines.append(f"NOT RUN {step.family} {step.passname} {len(todo)} tests of {step.name} "
                             f"(its time was spent after a hang)")
                ok = False
                break
            rec = self.tmp / f"{step.name}.jsonl"
            rec.unlink(missing_ok=True)
            child_log = self.tmp / f"{step.name}.log"
            child_log.unlink(missing_ok=True)
            more = [a for n in deselect for a in ("--deselect", n)]
            p = self.spawn(self.pytest_cmd(step, todo, [*extra, *more]),
                           self.child_env(step, rec, self.planted_first(step)), child_log)
            extend = None
            if whole:
                t_spawn, until = time.monotonic(), self.t0 + self.budget - self.plan.cap(dp.BY_NAME["report"])
                extend = lambda: _extended(rec, step, t_spawn, until)  # noqa: E731
            state = self.wait([(p, time.monotonic() + left - KILL_GRACE_S - 1)],
                              stalled=lambda: _test_overdue(rec, step.test_limit_s), extend=extend)[p.pid]
            if whole:  # the step's own deadline moves with its child's
                later = _extended(rec, step, t_spawn, until)
                deadline = max(deadline, later + KILL_GRACE_S + 1) if later is not None else deadline
            # Killed at the step's cap, a running test is CUT (under its own limit, maybe just
            # slow); past its own limit it is HUNG.
            killed, cut = state != "done", state == "killed"
            v, finished, broken = self.verdicts(step, rec, killed, p.returncode, cut=cut)
            text = child_log.read_text()
            how = " (cut at the step's cap)" if cut else " (killed by the watchdog: a test past its limit)" if killed else ""
            with open(log, "a") as f:
                f.write(text + f"[{step.name}: exit {p.returncode}{how}]\n")
            counts.append(_pytest_counts(text) or f"exit {p.returncode}")
            lines += v
            if killed or broken or (p.returncode not in (0, 1, 5)):
                ok = False
                done = set(finished) | {broken}
                if whole:
                    deselect += sorted(n for n in done if n and n not in deselect)
                else:
                    todo = [n for n in todo if n not in done]
                if not broken:
                    break
                continue
            if p.returncode not in (0, 5):
                ok = False
            break
        self.say(f"{step.name}: {'; '.join(counts)}")
        for ln in lines:
            self.say(ln)
        ok = ok and not lines
        if not ok and any(ln.startswith("HUNG") for ln in lines):
            self.after_hang(step)
        return ok

    def after_hang(self, step: dp.Step) -> None:
        """A backward kernel's step hung: bitident and the benchmarks leave that kernel out."""
        leave = {"sm90_bwd_fused": ("cuda sm90 fused", "sm90 fused bwd"), "sm90_bwd_split": ("cuda sm90 split", "sm90 bwd"),
                 "mma_bwd_fused": ("cuda mma.sync fused", "mma fused bwd"), "triton_bwd": ("triton deterministic", "deterministic bwd")}
        if step.name in leave:
            label, provider = leave[step.name]
            self.skip_bitident.append(label)
            self.bench_skip.append(provider)
            self.say(f"decision: {step.name} hung: bitident and the benchmarks leave {label} out")

    # ------------------------------------------------------------------ the other kinds
    def run_cmd(self, cmd: List[str], deadline: float, log: Path, env: Optional[Dict[str, str]] = None) -> int:
        p = self.spawn(cmd, env or self.child_env(dp.BY_NAME["plan"], self.tmp / "none.jsonl", False), log)
        killed = self.wait([(p, deadline - KILL_GRACE_S - 1)])[p.pid] == "killed"
        with open(log, "a") as f:
            f.write(f"[exit {p.returncode}{' (stopped at its time limit)' if killed else ''}]\n")
        return 124 if killed else p.returncode

    def do_install(self, step: dp.Step, deadline: float) -> bool:
        log = self.log("setup.log")
        pre = ROOT / "tools" / "prebuilt.py"
        if pre.exists():
            r = subprocess.run([self.py, str(pre), "use"], cwd=ROOT, capture_output=True, text=True,
                               timeout=max(5, deadline - time.monotonic()))
            line = (r.stdout.strip().splitlines() or [f"prebuilt: not used: exit {r.returncode}, no output"])[-1]
            with open(log, "a") as f:
                f.write(r.stdout + r.stderr)
            self.prebuilt_used = r.returncode == 0
            self.say(line)
        else:
            self.say("prebuilt: not used: tools/prebuilt.py is not in this tree")
        env = dict(os.environ, MHAKERN_NO_EXTENSION="1")
        rc = self.run_cmd([self.py, "-m", "pip", "install", "--no-index", "--no-deps", "--no-build-isolation", "-e", "."],
                          deadline, log, env)
        return rc == 0

    def do_build(self, step: dp.Step, deadline: float) -> bool:
        env = dict(os.environ, MHAKERN_REQUIRE_CUDA="1" if self.have_gpu else "0")
        env.setdefault("MAX_JOBS", str(os.cpu_count() or 2))
        rc = self.run_cmd([self.py, "-m", "mhakern.build"], deadline, self.log("setup.log"), env)
        return rc == 0

    def do_plan(self, step: dp.Step, deadline: float) -> bool:
        ok = self.collect(deadline)
        self.say(f"plan: {len(self.nodeids)} GPU tests and {len(self.bench_ids)} benchmark rows collected; per step: "
                 + ", ".join(f"{k} {v}" for k, v in self.plan.counts.items()))
        return ok

    def collect(self, deadline: Optional[float]) -> bool:
        """pytest --collect-only of the GPU test files this run's steps select from and of the
        benchmark file where bench runs, both at once: the node ids each step selects, and its
        test count. A collection that fails or runs out of time leaves each pytest step its
        selections as ``file::function`` (every parametrization of them), its cap then taken
        from the count its own child collects (do_pytest), and says so."""
        files = sorted({sel.file for s in self.plan.steps if s.kind == "pytest" for sel in s.tests})
        env = self.child_env(dp.BY_NAME["plan"], self.tmp / "none.jsonl", False)
        cmds = {}
        if files:
            cmds["tests"] = [self.py, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files]
        if any(s.name == "bench" for s in self.plan.steps) and not self.dry:
            cmds["bench"] = self.bench_collect_cmd()
        outs = self._collect_run(cmds, env, deadline)
        ok = True
        if files:
            out, rc = outs["tests"]
            self.nodeids = [ln.strip() for ln in out.splitlines() if "::" in ln and not ln.startswith(" ")]
            ok = rc == 0 and bool(self.nodeids)
            if not ok:
                self.say(f"plan: the collection of the GPU tests failed or ran out of time ({rc}): each test step "
                         "runs its functions whole, capped by the count its own child collects")
                self.nodeids = []
        for s in self.plan.steps:
            if s.kind == "pytest":
                sel = dp.selected(s, self.nodeids)
                self.plan.counts[s.name] = len(sel) if sel else len(s.tests)
        if "bench" in cmds:
            out, rc = outs["bench"]
            self.set_bench_ids(out)
            ok = ok and rc == 0
        return ok

    def bench_collect_cmd(self) -> List[str]:
        return [self.py, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                "benchmarks/test_bench_attention.py", *self.bench_args()]

    def set_bench_ids(self, collected: str) -> None:
        ids = bench_rows([ln.strip() for ln in collected.splitlines() if "::" in ln])
        # The decode rows first, then the forward rows, then forward+backward: a step cut by
        # its time limit loses the backward rows, which the bitident step has timed already.
        rank = lambda n: (0 if "decode-" in n else 1 if "-fwd-" in n else 2)  # noqa: E731
        self.bench_ids = sorted(ids, key=rank)

    def _collect_run(self, cmds: Dict[str, List[str]], env: Dict[str, str],
                     deadline: Optional[float]) -> Dict[str, Tuple[str, object]]:
        """Runs the collections side by side (each a cold start of torch on a fresh machine: one
        took over 15 s on the H200 of 2026-12-04); {name: (stdout, exit status or 'timed out')}."""
        procs = {name: subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, start_new_session=True) for name, cmd in cmds.items()}
        res: Dict[str, Tuple[str, object]] = {}
        for name, p in procs.items():
            try:
                out, err = p.communicate(timeout=None if deadline is None else max(3, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _killpg(p.pid, signal.SIGKILL)
                out, err = p.communicate()
                res[name] = (out or "", "timed out")
                with open(self.log("setup.log"), "a") as f:
                    f.write(f"$ {' '.join(cmds[name])}\n[timed out]\n{(out or '')[-1500:]}{(err or '')[-1500:]}\n")
                continue
            with open(self.log("setup.log"), "a") as f:
                f.write(f"$ {' '.join(cmds[name])}\n{out[-3000:]}{err[-3000:]}\n")
            res[name] = (out, p.returncode)
        return res

    def bench_args(self) -> List[str]:
        args = ["--bench-set", "headline"]
        for p in BENCH_PROVIDERS:
            args += ["--bench-provider", p]
        for s in self.bench_skip:
            args += ["--bench-skip", s]
        return args + os.environ.get("BENCH_ARGS", "").split()

    def do_ceilings(self, step: dp.Step, deadline: float) -> bool:
        log = self.log("setup.log")
        rc = self.run_cmd([self.py, "benchmarks/diag_gpu.py", "ceilings", "--json", str(self.log("diag.jsonl"))]
                          + ([] if self.have_gpu else ["--rehearse"]), deadline, log)
        lines = [ln for ln in log.read_text().splitlines() if ln.startswith("diag: ceilings: ")]
        self.say(f"ceilings of this card: {lines[-1][len('diag: ceilings: '):] if lines else 'not measured (see setup.log)'}")
        return rc == 0

    def do_bench(self, step: dp.Step, deadline: float) -> bool:
        if not self.bench_ids:  # the plan's collection failed (a cold machine): once more, warm now
            env = self.child_env(dp.BY_NAME["plan"], self.tmp / "none.jsonl", False)
            out, rc = self._collect_run({"bench": self.bench_collect_cmd()}, env,
                                        min(deadline - 10, time.monotonic() + 30))["bench"]
            self.set_bench_ids(out)
            self.say(f"bench: the rows collected again here: {len(self.bench_ids)} ({rc})")
        if not self.bench_ids:
            self.say("bench: no benchmark rows collected")
            return False
        extra = [*self.bench_args(), "--benchmark-only", "--benchmark-json", str(self.log("bench.json")),
                 "--benchmark-columns=median,iqr,rounds"]
        return self.do_pytest(step, deadline, ids=self.bench_ids, log_name="bench.log", extra=extra)

    def do_report(self, step: dp.Step, deadline: float) -> bool:
        bench = self.log("bench.json")
        if not bench.exists():
            self.say("report: no bench.json (the benchmarks did not finish; see bench.log)")
            return False
        log = self.log("bench.log")
        rc = self.run_cmd([self.py, "-m", "benchmarks.report", str(bench), "--out", str(self.out), "--headline"],
                          deadline, log)
        for ln in log.read_text().splitlines():
            if ln.startswith("headline: "):
                self.say(ln)
        rc2 = self.run_cmd([self.py, "-m", "benchmarks.device_predict", str(bench), str(self.log("diag.jsonl")),
                            "--append", str(self.log("report.md"))], deadline, log)
        for png in ("tflops.png", "decode.png"):  # drawn again from bench.json anywhere; 8 files come back
            (self.out / png).unlink(missing_ok=True)
        return rc == 0 and rc2 == 0

    def do_command(self, step: dp.Step, deadline: float) -> bool:
        diag = ["--json", str(self.log("diag.jsonl"))] + ([] if self.have_gpu else ["--rehearse"])
        cmds = {"decode": [self.py, "benchmarks/diag_gpu.py", "decode", *diag],
                "variants": ["bash", "benchmarks/device_diag.sh", "variants", str(self.tmp / "variants"), str(self.out)],
                "ncu": ["bash", "benchmarks/device_diag.sh", "ncu", str(self.out)],
                "trainer": (os.environ["TRAINER_CMD"].split() if os.environ.get("TRAINER_CMD") else
                            [self.py, "-m", "mhakern.memorize", "quick", "--device", "cuda" if self.have_gpu else "cpu",
                             "--out", str(self.tmp / "trainer"), "--no-progress"])}
        log = self.log("trainer.log" if step.name == "trainer" else "setup.log")
        rc = self.run_cmd(cmds[step.name], deadline, log)
        if step.name in ("decode", "ncu"):
            for ln in log.read_text().splitlines():
                if ln.startswith(("diag: decode", "diag: ncu")):
                    self.say(ln[len("diag: "):])
        return rc == 0

    # ------------------------------------------------------------------ the run
    def environment(self) -> None:
        log = self.log("setup.log")
        probe = ("import sys, torch\n"
                 "try:\n import triton; tv = triton.__version__\nexcept Exception as e:\n tv = f'not importable ({type(e).__name__})'\n"
                 "gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'\n"
                 "cap = '.'.join(map(str, torch.cuda.get_device_capability())) if torch.cuda.is_available() else ''\n"
                 "print(f'torch {torch.__version__} (CUDA {torch.version.cuda}), triton {tv}, GPU: {gpu}|{cap}')\n")
        try:
            r = subprocess.run([self.py, "-c", probe], capture_output=True, text=True, timeout=90, cwd=ROOT)
            line = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else f"torch does not import with {self.py}"
        except subprocess.TimeoutExpired:
            line = "the environment probe did not answer within 90 s"
        machine, _, cap = line.partition("|")
        self.have_gpu = bool(cap)
        if cap and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
            os.environ["TORCH_CUDA_ARCH_LIST"] = cap  # only this GPU's architecture: half the nvcc work
        smi = shutil.which("nvidia-smi")
        nvcc = shutil.which("nvcc")
        with open(log, "a") as f:
            f.write(f"# device check of mhakern at {_git_head()} ({time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())})\n")
            f.write(f"python: {self.py}; cores: {os.cpu_count()}\n{machine}\n")
            if smi:
                f.write(subprocess.run([smi], capture_output=True, text=True).stdout[:3000])
            if nvcc:
                f.write(subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout[-300:])
        self.has_xdist = subprocess.run([self.py, "-c", "import xdist"], capture_output=True).returncode == 0
        self.env_s = time.monotonic() - self.t0
        self.say(f"machine: {machine}; {os.cpu_count()} cores; nvcc {'found' if nvcc else 'not found'}")

    def main(self, stages: List[str]) -> int:
        self.summary.write_text(f"## Device check summary ({_git_head()})\n\n")
        plant = _flag("DEVICE_CHECK_PLANT", "")
        if plant:
            kind, _, name = plant.partition(":")
            plantable = [s.name for s in dp.STEPS if s.plantable]
            if not self.rehearsal or kind not in ("hang", "wrong") or name not in plantable or name not in stages:
                print(f"device_check: DEVICE_CHECK_PLANT={plant!r}: expected hang:<step> or wrong:<step> with "
                      f"DEVICE_CHECK_REHEARSAL=1, the step one of this run's: "
                      f"{' '.join(n for n in plantable if n in stages)}", file=sys.stderr)
                return 2
            if kind == "wrong" and name == "bench":
                print("device_check: DEVICE_CHECK_PLANT=wrong:bench: the benchmarks check no answers; plant a hang there",
                      file=sys.stderr)
                return 2
            self.plant_kind, self.plant_step = kind, name
            self.say(f"rehearsal: planted {kind} in the first child of {name}")
        self.environment()
        if not self.have_gpu and not self.rehearsal and not self.dry:
            self.say("STOPPED: no CUDA device is visible to torch: this check needs one; nothing was installed or run")
            return self.finish(3)
        self.plan = dp.Plan(dp.plan_steps(stages, self.install))
        if self.dry:
            self.collect(None)  # the caps of the pytest steps come from the tests they would run
            for line in dp.covers_lines([s for s in self.plan.steps]):
                print(line)
        if "variants" in stages and not self.dry and self.have_gpu:
            subprocess.Popen(["bash", "benchmarks/device_diag.sh", "build-variants", str(self.tmp / "variants")], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        for step in self.plan.steps:
            if step.name == "build" and (self.prebuilt_used or self.dry):
                # A dry run accounts the planned run, with the prebuilt module carried (tools/
                # prebuilt.py); finish() prints the total without it beside.
                why = "the prebuilt mhakern._C is used" if self.prebuilt_used else "only when the prebuilt is not used"
                self.account.append(f"{step.name:<15} cap {self.plan.cap(step):4d}s  not run ({why})")
                continue
            if step.name == "build" and not self.install:
                continue
            self.run_step(step)
            if step.name in ("install", "build") and not self.dry:
                if self.status:
                    self.say(f"{step.name}: FAILED (see setup.log): nothing else can run")
                    return self.finish(1)
                if step.name == "build" or self.prebuilt_used:
                    self.backends_line()
        self.record_self_tests()
        return self.finish(self.status)

    def record_self_tests(self) -> None:
        """A family whose every verification step ran and passed here, and that no verdict line
        named, passes its first-use self-test on this device and build: recorded in the same
        cache (``python -m mhakern.selftest --record``), so users of this machine start trusted.
        Only on a GPU, and never in a rehearsal (its planted faults are not the kernels')."""
        if self.dry or self.rehearsal or not self.have_gpu:
            return
        for fam, runs in self.family_steps.items():
            if not runs:
                continue
            if fam in self.family_failed or any(r != "ok" for r in runs):
                why = "failed here" if fam in self.family_failed or "failed" in runs else "a step was cut"
                self.say(f"self-test cache: {fam} not recorded ({why}): its first use on this device tests it")
                continue
            r = subprocess.run([self.py, "-m", "mhakern.selftest", "--record", fam, "--device", "cuda:0"],
                               capture_output=True, text=True, cwd=ROOT, timeout=120)
            said = "recorded a pass" if r.returncode == 0 else f"could not record: {r.stderr.strip()[-200:]}"
            self.say(f"self-test cache: {fam} {said} ({len(runs)} verification steps ok)")

    def backends_line(self) -> None:
        code = ("import mhakern\nbe = mhakern.available_backends()\n"
                "print('; '.join(f'{n}: ' + ('usable' if w is None else str(w)[:120]) for n, w in be.items()))\n")
        r = subprocess.run([self.py, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
        self.say(f"backends: {r.stdout.strip() or r.stderr.strip()[-300:]}")

    def finish(self, status: int) -> int:
        total = self.now()
        build = dp.BY_NAME["build"]
        if self.dry:
            self.say("dry run: nothing was installed or run; each step was accounted at its allowance")
            if total > self.budget:
                status = 1
        self.say(f"total wall time: {total:.0f} s{' (dry run: the steps accounted at their allowances)' if self.dry else ''}"
                 f" of the {self.budget} s budget")
        acc = [f"environment     {dp.ENV_S if self.dry else self.env_s:>4.0f}s  (not capped)"] + self.account
        acc.append(f"total: {total:.0f}s of {self.budget}s{' (fits)' if total <= self.budget else ' (OVER BUDGET)'}"
                   f"; slack {self.budget - total:.0f}s")
        if self.dry and self.install:
            with_build = total + self.plan.cap(build)
            acc.append(f"without the prebuilt (the build on the device, cap {self.plan.cap(build)}s): {with_build:.0f}s"
                       f"{'' if with_build <= self.budget else ' -- over the budget: the last steps are cut, each says so'}")
        with open(self.summary, "a") as f:
            f.write("\n### Time accounting\n\n```\n" + "\n".join(acc) + "\n```\n")
        report = self.out / "report.md"
        if report.exists():
            with open(report, "a") as f:
                f.write("\n" + self.summary.read_text())
        print("")
        print(f"================ device check: time accounting (budget {self.budget}s) ================")
        for line in acc:
            print(f"  {line}")
        print("================ device check summary: " + str(self.summary))
        print(self.summary.read_text())
        shutil.rmtree(self.tmp, ignore_errors=True)
        return status


#: The kernel families of the first-use self-test (mhakern/selftest.py) that the steps verify.
SELF_TEST_FAMILIES = ("sm90", "mma", "triton")
#: The first words of a verdict line that names a failing family (its second word).
FAILURE_WORDS = ("WRONG", "HUNG", "ERROR", "CRASHED", "EXITED")


def _extended(records: Path, step: dp.Step, t_spawn: float, until: float) -> Optional[float]:
    """The deadline of a fallback step's child once it has recorded its collected count: its
    start plus the step's cap for that count, no later than ``until``; None before."""
    try:
        text = records.read_text()
    except OSError:
        return None
    counts = []
    for ln in text.splitlines():
        if '"collected"' in ln:
            try:
                counts.append(int(json.loads(ln).get("n", 0)))
            except (ValueError, TypeError):  # a line the child is still writing
                continue
    if not counts:
        return None
    return min(until, t_spawn + step.cap(max(counts))) - KILL_GRACE_S - 1


def _test_overdue(records: Path, limit: float) -> bool:
    """Whether a test of a pytest child started over ``limit`` seconds ago and has not ended."""
    try:
        text = records.read_text()
    except OSError:
        return False
    open_: Dict[Tuple[int, str], float] = {}
    for ln in text.splitlines():
        try:
            r = json.loads(ln)
        except ValueError:
            continue
        key = (r.get("pid", 0), r.get("case", ""))
        if r.get("ev") == "start":
            open_[key] = r.get("t", 0.0)
        elif r.get("ev") == "end":
            open_.pop(key, None)
    return any(time.time() - t > limit for t in open_.values())


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def bench_rows(ids: Sequence[str]) -> List[str]:
    """The benchmark rows the bench step runs: a backward kernel's provider variant
    (``mhakern:cuda[sm90 bwd]``, ``mhakern:triton[split bwd]``, ...) only on the rows with a backward
    (on a forward row it would time the same forward again); not the trainer's fp32 row."""
    keep = []
    for n in ids:
        params = n.partition("[")[2]
        if "memorize-" in params:
            continue
        if "bwd]" in params and "-fwdbwd-" not in params and "-bwd-" not in params:
            continue
        keep.append(n)
    return keep


def _pytest_counts(text: str) -> str:
    import re

    hits = re.findall(r"^=*\s*((?:\d+ (?:passed|failed|errors?|skipped|deselected|xfailed|warnings?)[, ]*)+.*?)\s*=*$",
                      text, re.M)
    return hits[-1].strip() if hits else ""


def _git_head() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or "?"
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not argv[0]:
        print("usage: benchmarks/device_check.sh OUTDIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    try:
        stages = dp.parse_stages(os.environ.get("DEVICE_CHECK_STAGES"))
    except ValueError as e:
        print(f"device_check: {e}", file=sys.stderr)
        return 2
    return Check(out.resolve()).main(stages)


if __name__ == "__main__":
    sys.exit(main())
