"""The device check's first stage: does each GPU backend run at all, and do C++ errors raise?

    python -m benchmarks.device_smoke [--device cuda] [--budget-s 60]

For each GPU backend (``cuda``, ``triton``) and dtype (bf16, fp16): one small causal GQA case
with key lengths, forward and backward, against the float64 reference with the tolerance rule
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--budget-s", type=float, default=60.0, help="stop starting new checks after this many seconds")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        # The CPU rehearsal runs the Triton kernels through the interpreter, which must be on
        # before mhakern.kernels is first imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("smoke: no CUDA device visible to torch", flush=True)
        return 1
    t0 = time.perf_counter()
    failed = 0
    dtypes = [("bfloat16", torch.bfloat16), ("float16", torch.float16)]
    if args.device == "cpu":
        dtypes = [("float32", torch.float32)]
    for backend in _gpu_backends(args.device):
        for dname, dt in dtypes:
            if time.perf_counter() - t0 > args.budget_s:
                print(f"smoke: {backend} {dname}: NOT RUN (stage budget of {args.budget_s:.0f} s spent)", flush=True)
                failed += 1
                continue
            ok, msg = _check_numerics(backend, dt, args.device)
            failed += not ok
            print(f"smoke: {backend} {dname}: {'ok' if ok else 'FAILED'}: {msg}", flush=True)
    # The C++ boundary on this device's kernels.
    for what, call in _BAD_CALLS.items():
        left = args.budget_s - (time.perf_counter() - t0)
        ok, msg = _check_raises(dtypes[0][0], args.device, call, timeout=max(20.0, left))
        failed += not ok
        print(f"smoke: mhakern_C on {args.device} raises on {what}: {'ok' if ok else 'FAILED'}: {msg}", flush=True)
    print(f"smoke: {'all ok' if not failed else f'{failed} FAILED'} in {time.perf_counter() - t0:.1f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
