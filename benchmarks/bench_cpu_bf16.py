"""The cpu backend in bf16 against its own fp32 rate, torch's bf16 GEMM and SDPA's CPU kernel.

Issue 35's measurement, one run, interleaved round by round, medians:

* ``cpu_fp32`` / ``cpu_bf16``: ``mhakern.attention(..., backend="cpu")`` forward (and forward +
  backward), B 1, H 8, L 2048, D 64, not causal;
* ``sdpa_bf16``: ``scaled_dot_product_attention`` on the same bf16 tensors (its CPU flash kernel);
* ``gemm_bf16`` / ``gemm_fp32``: ``torch.matmul`` of two 2048 x 2048 matrices, the machine's
  matrix-product rate in each dtype (the roofline the attention rows are a fraction of).

Rates in GFLOP/s by FlashAttention's convention (forward 4·B·H·L²·D, backward 2.5x that).

    python benchmarks/bench_cpu_bf16.py [--rounds 15] [--threads 1] [--bwd] [--clock thread]

``--clock thread`` (one thread only) times each call by the calling thread's CPU time instead of
the wall clock: on a machine shared with other jobs a call that loses its core for a while is
not charged for it, so the ratios hold where wall-clock rounds scatter. It assumes every
provider computes on the calling thread at one torch thread (the printed wall/thread ratio per
provider, near 1 on an idle machine, is the check).

``MHAKERN_CPU_ISA`` (see mhakern/backends/cpu_backend.py) chooses the kernels' variant as for
any call; the variant in use is printed with the machine and its flags.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict

import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mhakern  # noqa: E402
from mhakern._cpuinfo import cpu_flags, cpu_model  # noqa: E402

_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16")


def _flags() -> str:
    return " ".join(w for w in _FLAGS if w in cpu_flags()) or platform.machine()


B, H, L, D = 1, 8, 2048, 64
N = 2048  # GEMM side


def providers(bwd: bool) -> Dict[str, tuple]:
    """name -> (callable, flops per call)."""
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(B, H, L, D, generator=g) for _ in range(3)]
    fl = 4.0 * B * H * L * L * D * (3.5 if bwd else 1.0)
    out: Dict[str, tuple] = {}

    def attn(dtype, fn):
        q, k, v = (x.to(dtype).requires_grad_(bwd) for x in base)
        do = torch.randn(B, H, L, D, generator=g).to(dtype)

        def run():
            o = fn(q, k, v)
            if bwd:
                q.grad = k.grad = v.grad = None
                o.backward(do)
        return run

    cpu = lambda q, k, v: mhakern.attention(q, k, v, backend="cpu")  # noqa: E731
    out["cpu_fp32"] = (attn(torch.float32, cpu), fl)
    out["cpu_bf16"] = (attn(torch.bfloat16, cpu), fl)
    out["sdpa_bf16"] = (attn(torch.bfloat16, F.scaled_dot_product_attention), fl)
    a, b = (torch.randn(N, N, generator=g) for _ in range(2))
    ab, bb = a.bfloat16(), b.bfloat16()
    out["gemm_fp32"] = (lambda: torch.matmul(a, b), 2.0 * N ** 3)
    out["gemm_bf16"] = (lambda: torch.matmul(ab, bb), 2.0 * N ** 3)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own)")
    ap.add_argument("--bwd", action="store_true", help="forward + backward (default: forward)")
    ap.add_argument("--only", default="", help="comma-separated providers")
    ap.add_argument("--clock", choices=["wall", "thread"], default="wall",
                    help="wall clock, or the calling thread's CPU time (one thread only)")
    args = ap.parse_args(argv)
    if args.clock == "thread" and args.threads != 1:
        ap.error("--clock thread: expected --threads 1 (other threads' work would not be counted)")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    provs = providers(args.bwd)
    if args.only:
        provs = {k: v for k, v in provs.items() if k in args.only.split(",")}
    from mhakern.backends.cpu_backend import kernel_isa

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{cpu_model()} [{_flags()}], torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"cpu kernels {kernel_isa()}, load {load:.1f}; {'fwd+bwd' if args.bwd else 'fwd'} "
          f"B{B} H{H} L{L} D{D}, medians of {args.rounds} interleaved rounds, {args.clock} clock")
    times: Dict[str, list] = {p: [] for p in provs}
    walls: Dict[str, list] = {p: [] for p in provs}
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    for fn, _ in provs.values():
        fn()
    order = list(provs)
    for r in range(args.rounds):
        for p in order if r % 2 == 0 else reversed(order):
            t0, w0 = clock(), time.perf_counter()
            provs[p][0]()
            times[p].append(clock() - t0)
            walls[p].append(time.perf_counter() - w0)
    rate = {p: provs[p][1] / statistics.median(ts) / 1e9 for p, ts in times.items()}
    for p, r in rate.items():
        extra = ""
        if args.clock == "thread":
            extra = f"  (wall / thread {statistics.median(walls[p]) / statistics.median(times[p]):.2f})"
        print(f"  {p:10s} {statistics.median(times[p]) * 1e3:9.2f} ms  {r:8.1f} GFLOP/s{extra}")

    def ratio(a, b):
        if a in rate and b in rate:
            print(f"  {a} / {b}: {rate[a] / rate[b]:.2f}x")
    ratio("cpu_bf16", "cpu_fp32")
    ratio("cpu_bf16", "gemm_bf16")
    ratio("cpu_fp32", "gemm_fp32")
    ratio("cpu_bf16", "sdpa_bf16")
    return 0


if __name__ == "__main__":
    sys.exit(main())
