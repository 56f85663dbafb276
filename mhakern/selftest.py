"""The first-use self-test of the compiled kernel families: no unverified kernel reaches a user
untested (issue 29).

A kernel family (:class:`Family`: ``sm90``, the wgmma/TMA CUDA kernels on 9.0 devices; ``mma``,
the mma.sync CUDA kernels; ``triton``) is tested once per device and build before its first call
there: a few small shapes, forward and backward, against the reference in float64 with the
tolerance rule of the tests (docs/testing.md), in a child process under a timeout. The verdict is
cached in one JSON file per key under ``<cache dir>/selftest/`` (``MHAKERN_SELF_TEST_DIR``
overrides it), the key being a hash of the family, the device's name, compute capability and
driver, the torch and CUDA versions and the family's build digest (:func:`build_digest`: the
recorded SASS for the CUDA families, the kernel sources and the triton version for Triton). So
a kernel whose code changes loses its pass, and a pass made by the device check
(:func:`record`) is a pass here.

The gate (:func:`gate`) is asked by the backends' ``supports`` on CUDA devices (the one route to
a backend consults it: no entry point bypasses it); its answer per (family, device) is kept for
the process, so after the first call it costs one dict lookup, and dispatch caches ``supports``
anyway. Processes that start together (a job's ranks) coordinate through a lock file next to the
entry: one tests, the others wait for the entry (bounded). A failure or a hang disables the
family on that device for that build, printed once per process in one line naming the family and
what failed; ``auto`` then routes to the next backend that serves the call.

Environment: ``MHAKERN_SELF_TEST=0`` trusts every family without testing, ``=force`` re-tests
once per process (a pass recorded by another process after this one started waiting counts);
``MHAKERN_SELF_TEST_TIMEOUT`` (seconds, default 300: the child's start, its first compiles and
the cases) bounds a child; ``MHAKERN_SELF_TEST_PLANT=wrong:<family>`` / ``hang:<family>`` plants
a wrong answer / a hang in that family's child (read by the child only: tests of this
machinery).

``python -m mhakern.selftest --family F --device D`` is the child; ``python -m mhakern.selftest``
alone runs :func:`self_test` (the table), ``--record F --device D`` records a pass from outside
(the device check).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

from ._cpuinfo import cpu_model

ENV_MODE = "MHAKERN_SELF_TEST"
ENV_TIMEOUT = "MHAKERN_SELF_TEST_TIMEOUT"
ENV_PLANT = "MHAKERN_SELF_TEST_PLANT"
ENV_DIR = "MHAKERN_SELF_TEST_DIR"
DEFAULT_TIMEOUT_S = 300.0
_RESULT_TAG = "MHAKERN_SELF_TEST_RESULT "
_THIS = "mhakern.selftest"  # this module's name, also when it runs as a script


class Case(NamedTuple):
    """One shape of a family's self-test: q (B, H, Lq, D), k/v (B, Hkv, Lk, D)."""

    B: int
    H: int
    Hkv: int
    Lq: int
    Lk: int
    D: int
    dtype: str  # "float16", "bfloat16", "float32"
    causal: bool = False
    key_lengths: Optional[Tuple[int, ...]] = None


@dataclasses.dataclass(frozen=True)
class Family:
    """A kernel family the self-test guards.

    ``kernels``: "module:function", imported in the child; the function takes the torch.device
    and returns ``(forward, backward)`` with the backend contract's signatures (backward
    returning at least dq, dk, dv). ``digest``: the build digest (a string) of the family's
    kernels. ``untestable(device)``: None when the family can be tested on the device, else why
    not. ``module``: the module that registers the family (the child imports it first)."""

    name: str
    backend: str
    cases: Tuple[Case, ...]
    kernels: str
    digest: Callable[[], str]
    untestable: Callable[[torch.device], Optional[str]]
    module: str = _THIS


class Record(NamedTuple):
    """One family's verdict on one device: ``verdict`` is "pass", "fail", "hang", "trusted"
    (MHAKERN_SELF_TEST=0) or "untestable"; ``reason`` says what failed or why not tested."""

    family: str
    device: str
    verdict: str
    reason: str


FAMILIES: Dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Add (or replace) a family; forgets this process's verdicts on it."""
    FAMILIES[family.name] = family
    forget(family.name)
    return family


def unregister_family(name: str) -> None:
    FAMILIES.pop(name, None)
    forget(name)


# ---------------------------------------------------------------------------------------------
# Keys: the device, the versions, the build
# ---------------------------------------------------------------------------------------------
def _driver_version() -> str:
    try:
        with open("/proc/driver/nvidia/version") as f:
            line = f.readline()
        for tok in line.split():
            if tok[:1].isdigit() and "." in tok:
                return tok
    except OSError:
        pass
    try:
        v = torch._C._cuda_getDriverVersion()  # an int such as 13000: the CUDA API version of the driver
        return f"cuda-api-{v}"
    except Exception:
        return "unknown"




def device_facts(device) -> Dict[str, str]:
    """What identifies a device for the cache: name, compute capability and driver (CUDA), the
    torch and CUDA versions. Not the index: identical devices share one entry."""
    d = torch.device(device)
    facts = {"type": d.type, "torch": torch.__version__, "cuda": str(torch.version.cuda)}
    if d.type == "cuda":
        idx = d.index if d.index is not None else torch.cuda.current_device()
        cap = torch.cuda.get_device_capability(idx)
        facts.update(name=torch.cuda.get_device_name(idx), capability=f"{cap[0]}.{cap[1]}", driver=_driver_version())
    else:
        facts.update(name=cpu_model())
    return facts


def _csrc_dir() -> Optional[str]:
    from ._build import source_root

    root = source_root()
    return None if root is None else os.path.join(root, "csrc")


def cuda_digest(family: str) -> str:
    """The CUDA family's digest from its recorded SASS (mhakern.kernels.sass.family_build_digests),
    or, without a record, from the csrc sources."""
    csrc = _csrc_dir()
    if csrc is not None:
        from .kernels.sass import family_build_digests

        got = family_build_digests(csrc).get(family)
        if got:
            return got
    return "sources-" + _tree_digest(csrc, (".h", ".cuh", ".cu", ".cpp")) if csrc else "unknown"


def _tree_digest(top: str, suffixes) -> str:
    h = hashlib.sha256()
    for dirpath, dirnames, files in os.walk(top):
        dirnames.sort()
        for f in sorted(files):
            if f.endswith(suffixes):
                p = os.path.join(dirpath, f)
                h.update(os.path.relpath(p, top).encode())
                with open(p, "rb") as fh:
                    h.update(hashlib.sha256(fh.read()).digest())
    return h.hexdigest()[:16]


def triton_digest() -> str:
    """The Triton family's digest: its kernel sources (mhakern/kernels/*.py) and the triton version."""
    try:
        import triton

        version = triton.__version__
    except Exception:  # no triton: the backend is unavailable anyway
        version = "none"
    kernels = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels")
    return hashlib.sha256(f"{_tree_digest(kernels, ('.py',))}:{version}".encode()).hexdigest()[:16]


def build_digest(family: str) -> str:
    return FAMILIES[family].digest()


def entry_key(family: str, device) -> Tuple[dict, str]:
    """(the facts of the key, the entry's file path)."""
    facts = dict(device_facts(device), family=family, digest=build_digest(family))
    h = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]
    slug = "".join(c if c.isalnum() else "-" for c in facts["name"]).strip("-")[:40] or "device"
    return facts, os.path.join(entry_dir(), f"{family}-{slug}-{h}.json")


def entry_dir() -> str:
    if os.environ.get(ENV_DIR):
        return os.path.abspath(os.path.expanduser(os.environ[ENV_DIR]))
    from ._build import cache_dir

    return os.path.join(cache_dir(), "selftest")


# ---------------------------------------------------------------------------------------------
# The cache: one JSON file per key, written atomically; a lock file per key
# ---------------------------------------------------------------------------------------------
def _read(path: str, facts: dict) -> Optional[dict]:
    try:
        with open(path) as f:
            entry = json.load(f)
    except (OSError, ValueError):
        return None
    return entry if entry.get("key") == facts and entry.get("verdict") in ("pass", "fail", "hang") else None


def _write(path: str, entry: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(entry, f, indent=1, sort_keys=True)
    os.replace(tmp, path)  # a reader sees the old file or the whole new one


class _Lock:
    """An exclusive fcntl lock on ``path`` taken within ``wait_s`` seconds, or not at all
    (``acquired`` False). Without fcntl (not POSIX) it is always acquired."""

    def __init__(self, path: str, wait_s: float):
        self.path, self.wait_s, self.fd, self.acquired = path, wait_s, None, False

    def __enter__(self):
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            import fcntl
        except ImportError:
            self.acquired = True
            return self
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self.acquired = True
                return self
            except OSError:
                if time.monotonic() >= deadline:
                    return self
                time.sleep(0.1)

    def __exit__(self, *exc):
        os.close(self.fd)  # drops the lock


# ---------------------------------------------------------------------------------------------
# Running a family's self-test in a child
# ---------------------------------------------------------------------------------------------
def timeout_s() -> float:
    try:
        return float(os.environ.get(ENV_TIMEOUT, DEFAULT_TIMEOUT_S))
    except ValueError:
        return DEFAULT_TIMEOUT_S


def _child_env(fam: Family, device: torch.device) -> Dict[str, str]:
    env = dict(os.environ)
    env[ENV_MODE] = "0"  # the child calls kernels directly; nothing in it may start another test
    # The child imports the same mhakern (and the family's module) as this process.
    paths = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    mod = sys.modules.get(fam.module)
    if fam.module != _THIS and mod is not None and getattr(mod, "__file__", None):
        paths.append(os.path.dirname(os.path.abspath(mod.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if device.type == "cpu" and fam.name == "triton":
        env["TRITON_INTERPRET"] = "1"  # Triton on a CPU: through its interpreter
    return env


def run_child(fam: Family, device: torch.device) -> Tuple[str, str, float]:
    """Runs ``fam``'s self-test on ``device`` in a child process: (verdict, reason, seconds)."""
    cmd = [sys.executable, "-m", _THIS, "--family", fam.name, "--device", str(device)]
    if fam.module != _THIS:
        cmd += ["--module", fam.module]
    limit = timeout_s()
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_child_env(fam, device),
                            start_new_session=True, text=True)
    try:
        out, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the child and anything it started
        except OSError:
            proc.kill()
        proc.communicate()
        return "hang", f"did not finish within {limit:g} s (killed)", time.monotonic() - t0
    seconds = time.monotonic() - t0
    for line in reversed(out.splitlines()):
        if line.startswith(_RESULT_TAG):
            res = json.loads(line[len(_RESULT_TAG):])
            return res["verdict"], res["reason"], seconds
    tail = [ln for ln in out.splitlines() if ln.strip()][-1:] or ["no output"]
    return "fail", f"the self-test process exited with status {proc.returncode}: {tail[0][:300]}", seconds


def _plant(family: str) -> Optional[str]:
    """The fault planted in this child, read here only: "wrong", "hang" or None."""
    spec = os.environ.get(ENV_PLANT, "")
    for item in spec.split(","):
        kind, _, name = item.strip().partition(":")
        if name == family and kind in ("wrong", "hang"):
            return kind
    return None


def _resolve(spec: str):
    mod, _, fn = spec.partition(":")
    return getattr(importlib.import_module(mod), fn)


def _naive(q, k, v, scale, causal, key_lengths):
    """Attention in the inputs' dtype through autograd (the tolerance rule's torch math in T)."""
    B, H, Lq, _ = q.shape
    Lk, rep = k.shape[2], q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ kk.transpose(-1, -2)) * scale
    cols = torch.arange(Lk, device=q.device)
    kl = torch.full((B,), Lk, device=q.device) if key_lengths is None else key_lengths.long()
    hidden = cols.view(1, 1, 1, Lk) >= kl.view(B, 1, 1, 1)
    if causal:
        rows = torch.arange(Lq, device=q.device).view(1, 1, Lq, 1)
        hidden = hidden | (cols.view(1, 1, 1, Lk) > rows + kl.view(B, 1, 1, 1) - Lq)
    s = s.masked_fill(hidden, float("-inf"))
    return torch.softmax(s, dim=-1) @ vv


def _compare(what: str, got: torch.Tensor, ref64: torch.Tensor, naive: torch.Tensor, factor: float, dtype) -> Optional[str]:
    if not torch.isfinite(got.detach()).all():
        return f"{what} has non-finite values"
    from . import reference

    why = reference.rule_violation(got, ref64, naive, dtype, factor)
    return None if why is None else f"{what} error: {why}"


def run_case(forward, backward, case: Case, device: torch.device, plant: Optional[str]) -> Optional[str]:
    """Why ``case`` fails on these kernels, or None."""
    from . import reference

    dtype = getattr(torch, case.dtype)
    g = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))
    mk = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    q, k, v = mk(case.B, case.H, case.Lq, case.D), mk(case.B, case.Hkv, case.Lk, case.D), mk(case.B, case.Hkv, case.Lk, case.D)
    dout = mk(case.B, case.H, case.Lq, case.D)
    kl = None if case.key_lengths is None else torch.tensor(case.key_lengths, dtype=torch.int32, device=device)
    scale = case.D ** -0.5
    if plant == "hang":
        while True:  # a kernel that never returns
            time.sleep(1)
    out, lse = forward(q, k, v, scale, case.causal, kl)
    if plant == "wrong":
        out = out + 0.25  # a wrong answer
    q64, k64, v64 = (x.detach().to(torch.float64).requires_grad_() for x in (q, k, v))
    ref, ref_lse = reference.attention_forward(q64, k64, v64, scale, case.causal, kl, upcast=True)
    qt, kt, vt = (x.detach().clone().requires_grad_() for x in (q, k, v))
    naive = _naive(qt, kt, vt, scale, case.causal, kl)
    name = f"{case.dtype} B{case.B} H{case.H}/{case.Hkv} Lq{case.Lq} Lk{case.Lk} D{case.D}" + (
        " causal" if case.causal else "") + (" key_lengths" if kl is not None else "")
    why = _compare("forward out", out, ref.detach(), naive, 2.0, dtype)
    if why is None:
        lse_err = (lse.detach().to(torch.float64) - ref_lse.detach()).abs().max().item()
        why = f"forward lse error {lse_err:.3g} > 2e-3" if not lse_err <= 2e-3 else None
    if why is None:
        grads = backward(dout, q, k, v, out.detach(), lse, scale, case.causal, kl)[:3]
        refs = torch.autograd.grad(ref, (q64, k64, v64), dout.to(torch.float64))
        nts = torch.autograd.grad(naive, (qt, kt, vt), dout)
        for nm, gk, gr, gn in zip(("dq", "dk", "dv"), grads, refs, nts):
            why = why or _compare(f"backward {nm}", gk, gr, gn, 3.0, dtype)
    return None if why is None else f"{why} ({name})"


def _child_main(args) -> int:
    if args.module:
        importlib.import_module(args.module)
    fam = FAMILIES[args.family]
    device = torch.device(args.device)
    plant = _plant(fam.name)
    forward, backward = _resolve(fam.kernels)(device)
    why = None
    for case in fam.cases:
        why = run_case(forward, backward, case, device, plant)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if why:
            break
    res = {"verdict": "fail" if why else "pass", "reason": why or f"{len(fam.cases)} cases, forward and backward"}
    print(_RESULT_TAG + json.dumps(res), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------
# Verdicts: the cache, the gate, the table
# ---------------------------------------------------------------------------------------------
def _device_label(facts: dict, device) -> str:
    cap = f" (sm_{facts['capability'].replace('.', '')})" if "capability" in facts else ""
    return f"{device} {facts['name']}{cap}"


def check(family: str, device, force: bool = False) -> Record:
    """``family``'s verdict on ``device`` from the cache, or from running its self-test (``force``:
    run it, unless another process recorded a verdict after this call began)."""
    fam = FAMILIES[family]
    device = torch.device(device)
    facts, path = entry_key(family, device)
    label = _device_label(facts, device)
    if not force:
        entry = _read(path, facts)
        if entry is not None:
            return Record(family, label, entry["verdict"], entry["reason"])
    started = time.time()
    limit = timeout_s()
    with _Lock(path + ".lock", wait_s=limit + 60) as lock:
        entry = _read(path, facts)
        if entry is not None and (not force or entry.get("time", 0) >= started):
            return Record(family, label, entry["verdict"], entry["reason"])  # another process tested meanwhile
        if not lock.acquired:
            return Record(family, label, "hang",
                          f"another process's self-test of it did not finish within {limit + 60:g} s")
        verdict, reason, seconds = run_child(fam, device)
        _write(path, {"key": facts, "verdict": verdict, "reason": reason, "seconds": round(seconds, 2),
                      "time": time.time(), "source": "self-test"})
        return Record(family, label, verdict, reason)


def record(family: str, device, verdict: str = "pass", reason: str = "", source: str = "device check") -> str:
    """Records ``verdict`` for ``family`` on ``device`` as a self-test would (the device check,
    after its verification steps for the family passed); returns the entry's path."""
    if verdict not in ("pass", "fail", "hang"):
        raise ValueError(f"verdict: expected 'pass', 'fail' or 'hang', got {verdict!r}")
    facts, path = entry_key(family, torch.device(device))
    with _Lock(path + ".lock", wait_s=timeout_s() + 60):
        _write(path, {"key": facts, "verdict": verdict, "reason": reason or f"recorded by the {source}",
                      "seconds": 0.0, "time": time.time(), "source": source})
    forget(family)
    return path


_UNKNOWN = object()
_VERDICTS: Dict[Tuple[str, torch.device], Optional[str]] = {}
_GATE_LOCK = threading.Lock()


def forget(family: Optional[str] = None) -> None:
    """Forget this process's verdicts (on one family, or all): the next gate reads the cache."""
    with _GATE_LOCK:
        for key in [k for k in _VERDICTS if family is None or k[0] == family]:
            del _VERDICTS[key]


def gate(family: str, device: torch.device) -> Optional[str]:
    """None when ``family`` may run on ``device`` (it passed its self-test there for this build,
    or MHAKERN_SELF_TEST=0), else why not. The first call per (family, device) in a process may
    run the self-test (seconds); later calls cost a dict lookup."""
    hit = _VERDICTS.get((family, device), _UNKNOWN)
    if hit is not _UNKNOWN:
        return hit
    with _GATE_LOCK:  # one thread tests; the others wait for its verdict
        hit = _VERDICTS.get((family, device), _UNKNOWN)
        if hit is not _UNKNOWN:
            return hit
        mode = os.environ.get(ENV_MODE, "1").strip().lower()
        if mode in ("0", "off", "false", "no", "trust"):
            why = None
        else:
            # force: once per process, as every verdict (kept in _VERDICTS)
            rec = check(family, device, force=mode == "force")
            why = None
            if rec.verdict != "pass":
                what = "hung" if rec.verdict == "hang" else "failed"
                why = f"the {family} kernels {what} their self-test on this device: {rec.reason}"
                sys.stderr.write(f"mhakern: self-test: family '{family}' disabled on {rec.device} for this build "
                                 f"({what}: {rec.reason}); calls go to the next backend "
                                 f"(MHAKERN_SELF_TEST=force re-tests)\n")
                sys.stderr.flush()
        _VERDICTS[(family, device)] = why
        return why


def self_test(families: Optional[List[str]] = None, devices: Optional[List] = None, verbose: bool = True) -> List[Record]:
    """Runs the self-test of every family (or those named) on every CUDA device (or those
    given) now, whatever the cache holds, and records the verdicts there; prints a table and
    returns one :class:`Record` per family and device (name, device, verdict, reason). A family
    that cannot be tested here is named with why (verdict "untestable"). On a machine without
    CUDA, Triton is tested through its interpreter on the CPU."""
    _ensure_builtins()
    names = list(FAMILIES) if families is None else list(families)
    if devices is None:
        devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())] or [torch.device("cpu")]
    records = []
    for device in map(torch.device, devices):
        for name in names:
            fam = FAMILIES[name]
            why = fam.untestable(device)
            if why is not None:
                records.append(Record(name, str(device), "untestable", why))
                continue
            rec = check(name, device, force=True)
            forget(name)
            records.append(rec)
    if verbose:
        print(format_table(records))
    return records


def format_table(records: List[Record]) -> str:
    rows = [("family", "device", "verdict", "reason")] + [tuple(r) for r in records]
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(f"{r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {r[2]:<{w[2]}}  {r[3]}" for r in rows)


# ---------------------------------------------------------------------------------------------
# The built-in families
# ---------------------------------------------------------------------------------------------
def _cuda_untestable(sm90: bool):
    def why(device: torch.device) -> Optional[str]:
        if device.type != "cuda":
            return "not testable here: no CUDA device" if not torch.cuda.is_available() else \
                f"not testable on {device}: a CUDA family"
        from .backends import get

        be = get("cuda")
        reason = be.unavailable()
        if reason is not None:
            return f"not testable here: {reason}"
        if sm90:
            cap = tuple(torch.cuda.get_device_capability(device))
            if cap != tuple(be.table["sm90"]["capability"]) or not be.table["sm90"].get("compiled"):
                return f"not used here: the sm_90a family runs on compute capability 9.0 with a build that has it " \
                       f"(this device: {cap[0]}.{cap[1]})"
        return None

    return why


def _triton_untestable(device: torch.device) -> Optional[str]:
    try:
        import triton  # noqa: F401
    except Exception as e:
        return f"not testable here: triton could not be imported ({type(e).__name__})"
    if device.type in ("cuda", "cpu"):
        return None  # on a CPU through the interpreter (its child sets TRITON_INTERPRET=1)
    return f"not testable on {device}"


def cuda_kernels(device: torch.device, fwd_family: str):
    """The cuda backend's kernels with the forward family forced ("auto": sm90 where it serves,
    "mma_sync"); the backward family as the environment sets it for "auto", mma.sync otherwise."""
    from .backends import get

    be = get("cuda")
    if be.unavailable() is not None:
        raise RuntimeError(be.unavailable())
    torch.ops.mhakern_C.cuda_force_fwd_family(fwd_family)
    if fwd_family == "mma_sync":
        torch.ops.mhakern_C.cuda_force_bwd_family("mma_sync")
    return be.forward, be.backward


def _mma_kernels(device):
    return cuda_kernels(device, "mma_sync")


def _sm90_kernels(device):
    return cuda_kernels(device, "auto")


def _triton_kernels(device):
    from .backends import get

    be = get("triton")
    return be.forward, be.backward


_BUILTIN_DONE = False


def _ensure_builtins() -> None:
    global _BUILTIN_DONE
    if _BUILTIN_DONE:
        return
    _BUILTIN_DONE = True
    for fam in BUILTIN:
        FAMILIES.setdefault(fam.name, fam)


BUILTIN = (
    Family("sm90", "cuda", (
        Case(2, 4, 2, 100, 150, 64, "float16", True, (150, 120)),
        Case(1, 8, 1, 1, 300, 128, "bfloat16"),
        Case(1, 2, 2, 130, 130, 128, "bfloat16", True),
        Case(1, 2, 1, 40, 90, 256, "float16"),
    ), f"{_THIS}:_sm90_kernels", lambda: cuda_digest("sm90"), _cuda_untestable(True)),
    Family("mma", "cuda", (
        Case(2, 4, 2, 100, 150, 64, "float16", True, (150, 120)),
        Case(1, 8, 1, 1, 300, 128, "bfloat16"),
        Case(1, 2, 2, 33, 47, 32, "bfloat16", True),
        Case(1, 2, 1, 40, 90, 96, "float16", False, (61,)),
    ), f"{_THIS}:_mma_kernels", lambda: cuda_digest("mma"), _cuda_untestable(False)),
    Family("triton", "triton", (
        Case(2, 4, 2, 33, 47, 32, "float16", True, (47, 40)),
        Case(1, 4, 1, 1, 70, 64, "float32"),
        Case(1, 2, 2, 20, 20, 40, "float32", True),
    ), f"{_THIS}:_triton_kernels", triton_digest, _triton_untestable),
)
_ensure_builtins()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mhakern.selftest", description=__doc__.split("\n\n")[0])
    p.add_argument("--family", help="run this family's self-test (the child: prints its verdict)")
    p.add_argument("--device", default=None)
    p.add_argument("--module", default=None, help="the module that registers --family, if not mhakern's")
    p.add_argument("--record", metavar="FAMILY", help="record a pass for FAMILY on --device (the device check)")
    args = p.parse_args(argv)
    if args.record:
        print(record(args.record, args.device or "cuda"))
        return 0
    if args.family:
        if args.device is None:
            p.error("--family needs --device")
        return _child_main(args)
    recs = self_test(devices=[args.device] if args.device else None)
    return 0 if all(r.verdict in ("pass", "untestable") for r in recs) else 1


if __name__ == "__main__":
    # Run as the imported module, whose family registry the families' modules fill.
    from mhakern import selftest as _module

    sys.exit(_module.main())
