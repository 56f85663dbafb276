"""GPU diagnostics of the device check (benchmarks/device_check.sh), one subcommand per stage:

* ``bitident``: every backward kernel (the cuda sm90 and mma.sync families' split and fused
  kernels, Triton's three modes; BWD_KERNELS) at L 4k, run twice on the same inputs: the
  gradients must be bit-identical where the kernel is deterministic, within a few bf16 ulps of
  the same family's split kernel, and within the tolerance rule on a ragged GQA shape.
* ``decode``: the decode rows of the headline table (B 4, 32 query heads, 4 or 8 KV heads, one
  query, D 128) on the sm90 forward with its planned split count and with forced counts, and on
  the mma.sync decode kernel (forced family): median ms and GB/s of the K/V bytes, so that the
  split planner and the routing rule (csrc/capabilities.h) can be checked against a measurement.
* ``ceilings``: the chip's two ceilings measured now (8192^3 bf16 product, a 2 GB copy).
* ``one``: builds one kernel's inputs once and calls it N times (what Nsight Compute profiles:
  ``fwd``, ``bwd``, ``decode``, ``decode_mma``).

Each prints ``diag: ...`` lines (the device check copies them into its summary) and, with
``--json``, appends one JSON object per row to that file. ``--rehearse`` runs the same plumbing
on the CPU with tiny shapes and the reference backend (no timing meaning): a dry run of the code
path, for a machine without a GPU.

Timing: CUDA events around each call, 3 warm-ups, the median of the timed calls; random inputs
(never zeros), three rotating sets so that a call does not find its K/V in L2.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# (B, Hq, Hkv, Lk): the decode rows of the headline table (docs/benchmarks/h200/report.md).
DECODE_SHAPES = ((4, 32, 4, 4096), (4, 32, 4, 65536), (4, 32, 4, 1048576), (4, 32, 8, 131072))
FORCED_SPLITS = (4, 8, 9, 17, 33)


def _setup(rehearse: bool):
    import torch

    import mhakern

    dev = "cpu" if rehearse else "cuda"
    if not rehearse:
        why = mhakern.available_backends().get("cuda")
        if why is not None:
            raise SystemExit(f"diag: the cuda backend is not usable: {why}")
    return torch, mhakern, dev


def _timer(torch, dev, fn, reps):
    """Median seconds of fn() over reps calls (CUDA events on a GPU; a host clock on the CPU)."""
    for _ in range(3):
        fn(0)
    ts = []
    for i in range(reps):
        if dev == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn(i)
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e) / 1e3)
        else:
            t0 = time.perf_counter()
            fn(i)
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _emit(args, row: dict, line: str) -> None:
    print(f"diag: {line}", flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")


def _ops(torch):
    return torch.ops.mhakern_C


def cmd_ceilings(args) -> int:
    torch, _, dev = _setup(args.rehearse)
    n = 512 if args.rehearse else 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    src = torch.randn((1 << 16) if args.rehearse else (1 << 28), device=dev)
    dst = torch.empty_like(src)
    t_mm = _timer(torch, dev, lambda i: a @ b, 10)
    t_cp = _timer(torch, dev, lambda i: dst.copy_(src), 10)
    mm, cp = 2 * n**3 / t_mm / 1e12, 2 * src.numel() * 4 / t_cp / 1e12
    _emit(args, {"stage": "ceilings", "matmul_tflops": mm, "copy_tbs": cp},
          f"ceilings: bf16 {n}^3 product {mm:.0f} TFLOP/s, copy {cp:.2f} TB/s (read + write)")
    return 0


def _family(torch, fwd=None, bwd=None):
    ops = _ops(torch)
    if fwd is not None:
        ops.cuda_force_fwd_family(fwd)
    if bwd is not None:
        ops.cuda_force_bwd_family(bwd)


# The backward kernels the bit-identity stage runs: (label, family setting, kernel settings,
# deterministic, the split kernel of the same family it is compared with). Each is selected by
# its run-time setting (csrc/op_common.h: cuda_force_bwd_family, cuda_force_sm90_bwd_kernel,
# cuda_force_mma_bwd_kernel; mhakern/kernels/heuristics.py BWD_MODE for Triton).
BWD_KERNELS = (
    ("cuda sm90 split", "auto", {"sm90": "split"}, True, None),
    ("cuda sm90 fused", "auto", {"sm90": "fused"}, True, "cuda sm90 split"),
    ("cuda mma.sync split", "mma_sync", {"mma": "split"}, True, None),
    ("cuda mma.sync fused", "mma_sync", {"mma": "fused"}, True, "cuda mma.sync split"),
    ("cuda mma.sync fused_atomic", "mma_sync", {"mma": "fused_atomic"}, False, "cuda mma.sync split"),
    ("triton split", None, {"triton": "split"}, True, None),
    ("triton deterministic", None, {"triton": "deterministic"}, True, "triton split"),
    ("triton atomic", None, {"triton": "atomic"}, False, "triton split"),
)


def _bwd_kernel(torch, family, kernels):
    """Sets one backward kernel (BWD_KERNELS' settings); returns a function that restores the
    previous settings."""
    undo = []
    if family is not None:
        ops = _ops(torch)
        prev = (ops.cuda_force_fwd_family("auto" if family == "auto" else "mma_sync"), ops.cuda_force_bwd_family(family))
        undo.append(lambda: (ops.cuda_force_fwd_family(prev[0]), ops.cuda_force_bwd_family(prev[1])))
        if "sm90" in kernels:
            p = ops.cuda_force_sm90_bwd_kernel(kernels["sm90"])
            undo.append(lambda: ops.cuda_force_sm90_bwd_kernel(p))
        if "mma" in kernels:
            p2 = ops.cuda_force_mma_bwd_kernel(kernels["mma"])
            undo.append(lambda: ops.cuda_force_mma_bwd_kernel(p2))
    if "triton" in kernels:
        from mhakern.kernels import heuristics

        p3 = heuristics.BWD_MODE
        heuristics.BWD_MODE = kernels["triton"]
        undo.append(lambda: setattr(heuristics, "BWD_MODE", p3))
    return lambda: [u() for u in reversed(undo)]


def kernel_family(settings: dict) -> str:
    """The device check's family name of a BWD_KERNELS row (sm90, mma, triton)."""
    (kind,) = settings
    return kind


def cmd_bitident(args) -> int:
    """One backward kernel of BWD_KERNELS (``--kernel``; the device check runs each in its own
    child) or all of them: on a large shape (B 1, H 16, L 4k, D 128, bf16) two runs on the same
    inputs must give identical bits where the kernel is deterministic, and its gradients must lie
    within a few bf16 ulps of its family's split kernel (read from ``--grads-dir``, where each
    kernel's child leaves its gradients: the split kernels run first); on a ragged GQA shape
    (B 2, H 8, Hkv 2, Lq 333, Lk 777, key lengths 777 and 400, D 128) each must pass the tolerance
    rule against the float64 reference (tests/attn_testing.check_against_reference), which is what
    "the fused kernel against the split one" means in the project's terms. One row per kernel.
    ``--rehearse``: the reference backend under each label, tiny shapes, on the CPU."""
    torch, mhakern, dev = _setup(args.rehearse)
    sys.path.insert(0, str(ROOT / "tests"))
    import attn_testing
    from attn_testing import check_against_reference, make_inputs

    from benchmarks import device_child as dc

    B, H, L, D = (1, 2, 64, 64) if args.rehearse else (1, 16, 4096, 128)
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v, do = (torch.randn(B, H, L, D, generator=g).to(dev, torch.bfloat16) for _ in range(4))
    avail = mhakern.available_backends()
    only = [s for s in (args.only or "").split(",") if s]
    skip = [s for s in (args.skip or "").split(",") if s]
    gdir = Path(args.grads_dir) if args.grads_dir else None
    status, grads = 0, {}
    for label, family, settings, deterministic, peer in BWD_KERNELS:
        if args.kernel and label != args.kernel:
            continue
        if (only and not any(o in label for o in only)) or any(o in label for o in skip):
            continue
        case, fam = label.replace(" ", "_"), kernel_family(settings)
        dc.record("start", case=case, family=fam, **{"pass": "bwd"})
        dc.hang_if_planted(case)
        dc.install_wrong_plant(attn_testing)
        backend = "reference" if args.rehearse else ("cuda" if family is not None else "triton")
        if avail.get(backend) is not None:
            _emit(args, {"stage": "bitident", "kernel": label, "skipped": avail[backend]},
                  f"backward {label}: not run ({backend}: {avail[backend]})")
            dc.record("end", case=case, outcome="skipped")
            continue
        restore = _bwd_kernel(torch, family, settings) if not args.rehearse else (lambda: None)
        t0 = time.perf_counter()
        fails = []
        try:
            def run():
                qq, kk, vv = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
                o = mhakern.attention(qq, kk, vv, causal=args.causal, backend=backend)
                o.backward(do)
                return [qq.grad, kk.grad, vv.grad]

            first, second = run(), run()
            same = all(torch.equal(a, b) for a, b in zip(first, second))
            if gdir is not None:
                torch.save([x.cpu() for x in first], gdir / f"{case}.pt")
            grads[label] = first
            if peer is not None and peer not in grads and gdir is not None and (gdir / f"{peer.replace(' ', '_')}.pt").exists():
                grads[peer] = [x.to(dev) for x in torch.load(gdir / f"{peer.replace(' ', '_')}.pt")]
            err = norm_err = None
            if peer in grads:
                # Two bf16 kernels of different accumulation orders: a few bf16 ulps of the scale.
                err = max(float((a.float() - b.float()).abs().max() / (b.float().abs().max() + 1e-6))
                          for a, b in zip(first, grads[peer]))
                # The largest difference is one ulp of the largest element for every kernel
                # (5.25e-04 for all of them on the H200 of 2026-12-04): the norm-wise one ranks them.
                norm_err = max(float((a.float() - b.float()).norm() / (b.float().norm() + 1e-6))
                               for a, b in zip(first, grads[peer]))
            if deterministic and not same:
                fails.append(("differs", "bit_identical", "two runs differ"))
            if err is not None and not err < 3e-2:
                fails.append((f"{err:.3e}", "3.000e-02", f"relative difference from {peer}"))
            rule = "ok"
            try:
                H2, Lq2, Lk2 = (2, 33, 77) if args.rehearse else (8, 333, 777)
                q2, k2, v2 = make_inputs(2, H2, 2 if H2 > 2 else 1, Lq2, Lk2, D, D, dtype=torch.bfloat16, device=dev)
                check_against_reference(lambda *a, **kw: mhakern.attention(*a, backend=backend, **kw), q2, k2, v2,
                                        True, torch.tensor([Lk2, Lk2 // 2 + 12], device=dev))
            except AssertionError as e:
                rule = "FAILED: " + str(e).splitlines()[0][:200]
                _, _, e_err, e_bound = dc.parse_failure(str(e), "bwd")
                fails.append((e_err, e_bound, str(e).splitlines()[0][:200]))
        finally:
            restore()
        for e_err, e_bound, msg in fails:
            dc.record("fail", case=case, kind="wrong", error=e_err, bound=e_bound, msg=msg, **{"pass": "bwd"})
        ok = not fails
        status |= int(not ok)
        _emit(args, {"stage": "bitident", "kernel": label, "deterministic": deterministic, "identical": same,
                     "rel_err_vs_split": err, "norm_err_vs_split": norm_err, "tolerance_rule": rule, "causal": args.causal,
                     "seconds": time.perf_counter() - t0},
              f"backward {label} B{B}H{H}L{L}D{D}{' causal' if args.causal else ''}: two runs "
              f"{'bit-identical' if same else ('differ (not deterministic by design)' if not deterministic else 'DIFFER')}"
              f"{'' if err is None else f'; against {peer} {err:.2e} (largest, relative), {norm_err:.2e} (norm-wise)'}"
              f"; tolerance rule {rule}"
              f" -> {'ok' if ok else 'FAILED'}")
        dc.record("end", case=case)
    return status


def cmd_decode(args) -> int:
    torch, mhakern, dev = _setup(args.rehearse)
    ops = None if args.rehearse else _ops(torch)
    backend = "reference" if args.rehearse else "cuda"
    shapes = ((1, 4, 1, 256), (1, 4, 2, 512)) if args.rehearse else DECODE_SHAPES
    status = 0
    for B, Hq, Hkv, Lk in shapes:
        D = 32 if args.rehearse else 128
        sets = [(torch.randn(B, Hq, 1, D, device=dev, dtype=torch.bfloat16),
                 torch.randn(B, Hkv, Lk, D, device=dev, dtype=torch.bfloat16),
                 torch.randn(B, Hkv, Lk, D, device=dev, dtype=torch.bfloat16)) for _ in range(3)]
        nbytes = 2 * B * Hkv * Lk * D * 2
        ref = None
        configs = [("sm90 planned", "auto", 0)] + [(f"sm90 splits {s}", "auto", s) for s in FORCED_SPLITS]
        configs += [("mma.sync decode planned", "mma_sync", 0)] + [(f"mma.sync decode splits {s}", "mma_sync", s)
                                                                   for s in (8, 16)]
        for label, fam, splits in configs:
            if ops is not None:
                ops.cuda_force_fwd_family(fam)
                ops.cuda_force_splits(splits)
            try:
                t = _timer(torch, dev, lambda i: mhakern.attention(*sets[i % 3], backend=backend), args.reps)
                out = mhakern.attention(*sets[0], backend=backend).float()
            finally:
                if ops is not None:
                    ops.cuda_force_splits(0)
                    ops.cuda_force_fwd_family("auto")
            if ref is None:
                ref = out
            err = float((out - ref).abs().max())
            planned = ""
            if ops is not None and splits == 0:
                from mhakern.backends.cuda_backend import plan_splits

                sms = torch.cuda.get_device_properties(0).multi_processor_count
                planned = f" (plan: {plan_splits(B, Hkv, Hq // Hkv, 1, Lk, D, sms, sm90=fam == 'auto')} splits)"
            bad = err > 3e-2
            status |= int(bad)
            _emit(args, {"stage": "decode", "shape": [B, Hq, Hkv, Lk, D], "config": label, "ms": t * 1e3,
                         "gbs": nbytes / t / 1e9, "max_abs_diff_vs_first": err},
                  f"decode B{B}H{Hq}kv{Hkv}k{Lk}: {label}{planned}: {t * 1e3:.3f} ms, {nbytes / t / 1e9:.0f} GB/s"
                  f"{'  OUTPUT DIFFERS ' + format(err, '.2e') if bad else ''}")
    return status


def cmd_one(args) -> int:
    """One kernel, called args.reps times on inputs built once (what ncu profiles)."""
    torch, mhakern, dev = _setup(args.rehearse)
    backend = "reference" if args.rehearse else "cuda"
    small = args.rehearse
    kind = args.kind
    if kind in ("fwd", "bwd"):
        B, H, L, D = (1, 2, 128, 64) if small else (1, 16, 16384, 128)
        q, k, v = (torch.randn(B, H, L, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    else:
        B, Hq, Hkv, Lk, D = (1, 4, 1, 256, 32) if small else (4, 32, 8, 131072, 128)
        q = torch.randn(B, Hq, 1, D, device=dev, dtype=torch.bfloat16)
        k, v = (torch.randn(B, Hkv, Lk, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    if not small:
        _family(torch, "mma_sync" if kind == "decode_mma" else "auto", "auto")
    for _ in range(args.reps):
        if kind == "bwd":
            qq, kk, vv = (x.detach().requires_grad_(True) for x in (q, k, v))
            mhakern.attention(qq, kk, vv, backend=backend).sum().backward()
        else:
            mhakern.attention(q, k, v, backend=backend)
    if dev == "cuda":
        torch.cuda.synchronize()
    print(f"diag: one {kind}: {args.reps} calls done", flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=("ceilings", "bitident", "decode", "one"))
    ap.add_argument("kind", nargs="?", default="fwd", choices=("fwd", "bwd", "decode", "decode_mma"))
    ap.add_argument("--rehearse", action="store_true", help="CPU, tiny shapes, reference backend: plumbing only")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--only", default="", help="bitident: comma-separated parts of kernel labels (e.g. 'fused,triton')")
    ap.add_argument("--skip", default="", help="bitident: comma-separated parts of kernel labels to leave out")
    ap.add_argument("--kernel", default="", help="bitident: this BWD_KERNELS label only (exactly)")
    ap.add_argument("--grads-dir", default="", help="bitident: where each kernel leaves its gradients for its peers")
    ap.add_argument("--json", default="", help="append one JSON object per row to this file")
    args = ap.parse_args(argv)
    return {"ceilings": cmd_ceilings, "bitident": cmd_bitident, "decode": cmd_decode, "one": cmd_one}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
