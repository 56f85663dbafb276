"""The device check's first stage: does each GPU backend run at all, and do C++ errors raise?

    python -m benchmarks.device_smoke [--device cuda] [--budget-s 60]

For each GPU backend (``cuda``, ``triton``; on a 9.0 device the cuda backend under both forward
families), in bf16, each in its own child process: one small causal GQA case with key lengths,
forward and backward, against the float64 reference with the tolerance rule
of the tests (tests/attn_testing.py). Then, in child processes, one bad call at the C++
boundary: it must raise a Python exception (a crash -- the process killed by a signal -- is the
failure the first GPU contact met: TORCH_CHECK aborting instead of raising).

Prints one line per check (``smoke: <what>: ok`` or ``smoke: <what>: FAILED ...``) and exits 1
when any failed, so that the device check stops before spending its budget on a broken build.
``--device cpu`` rehearses the same stage on a CPU machine (the cpu backend, and the Triton
interpreter when TRITON_INTERPRET=1).
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from typing import List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Bad calls straight at the C++ ops (torch.ops.mhakern_C, schemas in docs/contract.md), past
# every Python check, each run in a child process: it must end with a Python exception whose
# message names the argument. Each child prints "raised: <first line>" when it raised.
_BAD_CALLS = {
    "mismatched k and v lengths": "torch.ops.mhakern_C.fwd(q, q, q[:, :, :3], 0.125, False, None, None, 0.0, 0, False, -1, -1)",
    "key_lengths of a float dtype": (
        "torch.ops.mhakern_C.fwd(q, q, q, 0.125, False, torch.ones(1, device=dev), None, 0.0, 0, False, -1, -1)"
    ),
    "key_lengths out of range": (
        "torch.ops.mhakern_C.fwd(q, q, q, 0.125, False, torch.tensor([L + 5], device=dev, dtype=torch.int32), "
        "None, 0.0, 0, False, -1, -1)"
    ),
}
_CHILD = """
import torch, mhakern
print(mhakern.available_backends())  # loads mhakern._C, which registers torch.ops.mhakern_C
dev, dt, L = {dev!r}, getattr(torch, {dtype!r}), 16
q = torch.randn(1, 2, L, 64, device=dev, dtype=dt)
try:
    {call}
except Exception as e:
    print("raised:", type(e).__name__, str(e).splitlines()[0][:160])
else:
    print("no exception")
"""


def _gpu_backends(device: str) -> List[str]:
    return ["cuda", "triton"] if device == "cuda" else ["cpu", "triton"]


def _check_numerics(backend: str, dtype, device: str) -> Tuple[bool, str]:
    import torch

    import mhakern
    from attn_testing import check_against_reference, make_inputs

    why = mhakern.available_backends().get(backend, "not registered")
    if why is not None:
        return False, f"unavailable: {why}"
    q, k, v = make_inputs(2, 8, 2, 100, 130, 64, dtype=dtype, device=device)
    kl = torch.tensor([130, 77], device=device)

    def fn(q, k, v, **kw):
        return mhakern.attention(q, k, v, backend=backend, **kw)

    t = time.perf_counter()
    try:
        check_against_reference(fn, q, k, v, True, kl)
    except AssertionError as e:
        return False, str(e).splitlines()[0][:200]
    except Exception as e:  # noqa: BLE001 -- report, do not crash the stage
        return False, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return True, f"fwd+bwd against the float64 reference in {time.perf_counter() - t:.1f} s"


def _check_raises(dtype_name: str, device: str, call: str, timeout: float) -> Tuple[bool, str]:
    code = _CHILD.format(dev=device, dtype=dtype_name, call=call)
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return False, f"no answer within {timeout:.0f} s"
    if r.returncode < 0:
        return False, f"CRASHED: killed by signal {signal.Signals(-r.returncode).name}; stderr: {r.stderr.strip()[-300:]}"
    out = r.stdout.strip().splitlines()
    last = out[-1] if out else ""
    if r.returncode != 0:
        return False, f"exit {r.returncode}: {r.stderr.strip().splitlines()[-1][:200] if r.stderr.strip() else ''}"
    if not last.startswith("raised:"):
        return False, f"the bad call did not raise ({last or 'no output'})"
    return True, last


def _one_check(backend: str, dname: str, device: str, family: str) -> int:
    """The child's side of a numerics check (``--one``): prints ``result: ok|FAILED: msg``.
    ``family``: FWD or FWD/BWD, the cuda families of the two passes (``auto``, ``mma_sync``)."""
    import torch

    if family != "auto":
        import mhakern

        mhakern.available_backends()  # loads mhakern._C (the ops below live there)
        fwd, _, bwd = family.partition("/")
        torch.ops.mhakern_C.cuda_force_fwd_family(fwd)
        if bwd:
            torch.ops.mhakern_C.cuda_force_bwd_family(bwd)
    ok, msg = _check_numerics(backend, getattr(torch, dname), device)
    print(f"result: {'ok' if ok else 'FAILED'}: {msg}", flush=True)
    return 0


def _run_child_check(backend: str, dname: str, device: str, family: str, timeout: float) -> Tuple[bool, str, bool]:
    """One numerics check in a child process, so that a kernel that hangs or kills the process
    (an illegal address poisons the whole CUDA context) costs this check only. Returns
    ``(ok, message, broke)``: broke is a hang or a crash, not a wrong answer."""
    cmd = [sys.executable, "-m", "benchmarks.device_smoke", "--device", device, "--one", backend, dname,
           "--family", family]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return False, f"HUNG: no answer within {timeout:.0f} s (killed)", True
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("result: ")]
    if r.returncode != 0 or not lines:
        sig = f"killed by signal {signal.Signals(-r.returncode).name}" if r.returncode < 0 else f"exit {r.returncode}"
        err = r.stderr.strip().splitlines()
        return False, f"CRASHED: {sig}; {err[-1][:240] if err else 'no stderr'}", True
    ok = lines[-1].startswith("result: ok")
    return ok, lines[-1].split(": ", 2)[-1], False


def _sm90_family_here(device: str) -> bool:
    """Whether the cuda backend's plain forward runs on the sm90 family on this device."""
    if device != "cuda":
        return False
    import torch

    import mhakern
    from mhakern.backends import cuda_backend

    if mhakern.available_backends().get("cuda", "x") is not None:
        return False
    sm90 = ((cuda_backend.capabilities() or {}).get("cuda") or {}).get("sm90") or {}
    return bool(sm90.get("compiled")) and torch.cuda.get_device_capability() == tuple(sm90.get("capability", ()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--budget-s", type=float, default=60.0, help="stop starting new checks after this many seconds")
    ap.add_argument("--one", nargs=2, metavar=("BACKEND", "DTYPE"), help=argparse.SUPPRESS)  # a child's check
    ap.add_argument("--family", default="auto", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.device == "cpu":
        # The CPU rehearsal runs the Triton kernels through the interpreter, which must be on
        # before mhakern.kernels is first imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    if args.one:
        return _one_check(args.one[0], args.one[1], args.device, args.family)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("smoke: no CUDA device visible to torch", flush=True)
        return 1
    t0 = time.perf_counter()
    failed = 0
    # One dtype per backend: each check is a child process (about 5 s of torch import and CUDA
    # start before any kernel runs), and the GPU tests cover fp16 next.
    dnames = ["bfloat16"] if args.device == "cuda" else ["float32"]
    checks = [(b, d, "auto") for b in _gpu_backends(args.device) for d in dnames]
    if _sm90_family_here(args.device):
        # On a 9.0 device the plain forward runs on the sm90 family: check the mma.sync family
        # (what sm_80-89 devices run) too, forced, and the opt-in sm90 backward
        # (csrc/capabilities.h: kSm90BwdByDefault).
        checks[1:1] = [("cuda", d, "mma_sync/mma_sync") for d in dnames] + [("cuda", d, "auto/auto") for d in dnames]
    for backend, dname, family in checks:
        what = f"{backend} {dname}" + {"auto": "", "mma_sync/mma_sync": " (mma_sync family forced)",
                                        "auto/auto": " (the opt-in sm90 backward)"}[family]
        left = args.budget_s - (time.perf_counter() - t0)
        if left <= 0:
            print(f"smoke: {what}: NOT RUN (stage budget of {args.budget_s:.0f} s spent)", flush=True)
            failed += 1
            continue
        ok, msg, broke = _run_child_check(backend, dname, args.device, family, timeout=max(30.0, left))
        failed += not ok
        print(f"smoke: {what}: {'ok' if ok else 'FAILED'}: {msg}", flush=True)
        if broke and backend == "cuda" and family == "auto" and _sm90_family_here(args.device):
            # The later stages would hang or crash on every plain call: they run with the
            # mma.sync family forced (the device check reads this line), the sm90 file alone not.
            print("smoke-decision: MHAKERN_CUDA_FWD_FAMILY=mma_sync", flush=True)
        if broke and family == "auto/auto":
            # The opt-in backward hung or crashed: the benchmarks leave its provider out.
            print("smoke-decision: skip the sm90 backward", flush=True)
    # The C++ boundary on this device's kernels.
    for what, call in _BAD_CALLS.items():
        left = args.budget_s - (time.perf_counter() - t0)
        ok, msg = _check_raises(dnames[0], args.device, call, timeout=max(20.0, left))
        failed += not ok
        print(f"smoke: mhakern_C on {args.device} raises on {what}: {'ok' if ok else 'FAILED'}: {msg}", flush=True)
    print(f"smoke: {'all ok' if not failed else f'{failed} FAILED'} in {time.perf_counter() - t0:.1f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
