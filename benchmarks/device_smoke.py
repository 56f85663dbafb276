"""The device check's smoke step: does each kernel family run at all, and do C++ errors raise?

    python -m benchmarks.device_smoke --one NAME [--device cuda|cpu]

SMOKE_CASES names the checks; the device check (benchmarks/device_check.py) runs each in its own
child process, all at once, each under its watchdog: a family that hangs or kills its process
(an illegal address poisons the whole CUDA context) costs its own check only. A numerics check
runs one small causal GQA case with key lengths, forward and backward, in bf16, against the
float64 reference by the tolerance rule of the tests (tests/attn_testing.py), with the cuda
backend's families forced as the case says. ``bad_calls`` makes bad calls straight at the C++
ops (torch.ops.mhakern_C, schemas in docs/contract.md), past every Python check: each must end in
a Python exception whose message names the argument (a crash -- the process killed by a signal
-- is what the first GPU contact met: TORCH_CHECK aborting instead of raising).

The child prints ``smoke: <what>: ok|FAILED ...`` and writes benchmarks/device_child.py's
records. ``--device cpu`` rehearses the same checks on a CPU machine (the cpu backend for the
cuda cases, the Triton interpreter) on a smaller shape.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name: (what, backend, forward family, backward family, record's family, record's pass). The
# families are the cuda backend's run-time settings (torch.ops.mhakern_C.cuda_force_fwd_family /
# cuda_force_bwd_family); on a 9.0 device "auto" is the sm_90a family where it serves the call,
# and the sm90 backward is opt-in (csrc/capabilities.h kSm90BwdByDefault).
SMOKE_CASES = {
    "sm90_default": ("cuda, the default forward (sm_90a on a 9.0 device), mma.sync backward", "cuda", "auto", "mma_sync", "sm90", "fwd"),
    "mma_forced": ("cuda, the mma.sync family forced (what sm_80-89 devices run)", "cuda", "mma_sync", "mma_sync", "mma", "fwd"),
    "sm90_bwd_optin": ("cuda, the opt-in sm90 backward", "cuda", "auto", "auto", "sm90", "bwd"),
    "triton_default": ("triton, its default fused deterministic backward", "triton", None, None, "triton", "fwd"),
    "bad_calls": ("mhakern_C raises on bad calls", "cuda", None, None, "mma", "fwd"),
}

_BAD_CALLS = {
    "mismatched k and v lengths": "ops.fwd(q, q, q[:, :, :3], 0.125, False, None, None, 0.0, 0, False, -1, -1)",
    "key_lengths of a float dtype": "ops.fwd(q, q, q, 0.125, False, torch.ones(1, device=dev), None, 0.0, 0, False, -1, -1)",
    "key_lengths out of range": (
        "ops.fwd(q, q, q, 0.125, False, torch.tensor([L + 5], device=dev, dtype=torch.int32), None, 0.0, 0, False, -1, -1)"
    ),
}


def _numerics(name: str, device: str) -> bool:
    import torch

    import mhakern
    from attn_testing import check_against_reference, make_inputs

    from benchmarks import device_child as dc

    what, backend, fwd, bwd, family, ps = SMOKE_CASES[name]
    if device == "cpu" and backend == "cuda":
        backend = "cpu"  # the rehearsal: the same plumbing on the CPU kernels
    why = mhakern.available_backends().get(backend, "not registered")
    if why is not None:
        print(f"smoke: {what}: FAILED: backend {backend!r} unavailable: {why}", flush=True)
        dc.record("fail", case=name, exc="Unavailable", msg=str(why)[:300])
        return False
    if backend == "cuda":
        torch.ops.mhakern_C.cuda_force_fwd_family(fwd)
        torch.ops.mhakern_C.cuda_force_bwd_family(bwd)
    import attn_testing

    dc.install_wrong_plant(attn_testing)
    if device == "cuda":
        q, k, v = make_inputs(2, 8, 2, 100, 130, 64, dtype=torch.bfloat16, device=device)
        kl = torch.tensor([130, 77], device=device)
    else:
        q, k, v = make_inputs(2, 2, 1, 17, 33, 16, dtype=torch.float32, device=device)
        kl = torch.tensor([33, 20], device=device)
    t = time.perf_counter()
    try:
        check_against_reference(lambda *a, **kw: mhakern.attention(*a, backend=backend, **kw), q, k, v, True, kl)
    except AssertionError as e:
        msg = str(e).splitlines()[0][:300]
        dc.record("fail", case=name, exc="AssertionError", msg=msg)
        print(f"smoke: {what}: FAILED: {msg}", flush=True)
        return False
    print(f"smoke: {what}: ok: fwd+bwd against the float64 reference in {time.perf_counter() - t:.1f} s", flush=True)
    return True


def _bad_calls(device: str) -> bool:
    """Each bad call in turn; a crash ends the child (the parent names the call in progress)."""
    import torch

    import mhakern

    from benchmarks import device_child as dc

    mhakern.available_backends()  # loads mhakern._C, which registers torch.ops.mhakern_C
    ops, dev, L = torch.ops.mhakern_C, device, 16
    q = torch.randn(1, 2, L, 64, device=dev, dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
    ok = True
    for what, call in _BAD_CALLS.items():
        dc.record("phase", case="bad_calls", call=what, **{"pass": "fwd"})
        try:
            eval(call, {"ops": ops, "torch": torch, "q": q, "dev": dev, "L": L})  # noqa: S307 -- our own table
        except Exception as e:  # noqa: BLE001 -- the point: it must raise, and say what
            print(f"smoke: mhakern_C on {dev} raises on {what}: ok: raised {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:160] if str(e) else ''}", flush=True)
        else:
            ok = False
            dc.record("fail", case="bad_calls", exc="NoException", msg=f"{what}: the bad call did not raise")
            print(f"smoke: mhakern_C on {dev} raises on {what}: FAILED: no exception", flush=True)
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--one", required=True, choices=sorted(SMOKE_CASES), help="the check to run (SMOKE_CASES)")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        # The Triton kernels run through the interpreter on the CPU, which must be on before
        # mhakern.kernels is first imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    sys.path.insert(0, ROOT)
    from benchmarks import device_child as dc

    _, _, _, _, family, ps = SMOKE_CASES[args.one]
    dc.record("start", case=args.one, family=family, **{"pass": ps})
    dc.hang_if_planted(args.one)
    ok = _bad_calls(args.device) if args.one == "bad_calls" else _numerics(args.one, args.device)
    dc.record("end", case=args.one)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
