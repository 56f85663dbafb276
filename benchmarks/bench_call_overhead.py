"""The fixed per-call cost of mhakern's entry points on problems too small to measure a kernel.

Cases (CPU tensors, fp32, the ``cpu`` backend):

* ``sdpa_decode``: the SDPA drop-in on one decode step (B 1, H 8, Lq 1, Lk 64, D 64), no grad;
* ``mha_nograd`` / ``mha_grad``: a FusedMHA(64, 4) call on (2, 8, 64), without and with
  forward + backward;
* ``attn_nograd`` / ``attn_grad``: ``mhakern.attention`` on B 1, H 1, Lq 1, Lk 4, D 16,
  without and with forward + backward;
* ``attn_sinks_grad``: the same with learnable sinks (forward + backward);
* ``raw``: the C++ operator a plain call runs, the floor under all of them
  (``torch.ops.mhakern_C.fwd_plain``; in a tree without it, ``fwd`` with its twelve arguments);
* ``raw_fwd``: the full operator ``torch.ops.mhakern_C.fwd`` given those twelve arguments (the
  rest of its schema defaulted), what a call with modes pays;
* ``torch_op``: torch's own ``aten.add`` through ``torch.ops`` on the same tensors: no mhakern
  code, the same in both trees (the yardstick of the "per torch op" column).

    python benchmarks/bench_call_overhead.py                   # this tree: medians in us
    python benchmarks/bench_call_overhead.py --compare OTHER   # OTHER (a checkout's root, its
                                                               # mhakern/_C built) against this
                                                               # tree, interleaved, as ratios

The machine is shared and noisy: ``--compare`` alternates the two trees process by process and
reports the ratio of the medians of each case (this tree / OTHER; below 1 is faster), also
normalised per process by its ``torch_op`` case.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _cases():
    import torch

    import mhakern

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    cases = {}

    qd = torch.randn(1, 8, 1, 64, generator=g)
    kd = torch.randn(1, 8, 64, 64, generator=g)

    def sdpa_decode():
        with torch.no_grad():
            mhakern.scaled_dot_product_attention(qd, kd, kd)

    cases["sdpa_decode"] = sdpa_decode

    mha = mhakern.FusedMHA(64, 4, batch_first=True, backend="cpu")
    x = torch.randn(2, 8, 64, generator=g)

    def mha_nograd():
        with torch.no_grad():
            mha(x, x, x, need_weights=False)

    def mha_grad():
        mha.zero_grad(set_to_none=True)
        mha(x, x, x, need_weights=False)[0].sum().backward()

    cases["mha_nograd"], cases["mha_grad"] = mha_nograd, mha_grad

    q = torch.randn(1, 1, 1, 16, generator=g).requires_grad_()
    k = torch.randn(1, 1, 4, 16, generator=g).requires_grad_()
    v = torch.randn(1, 1, 4, 16, generator=g).requires_grad_()

    def attn_nograd():
        with torch.no_grad():
            mhakern.attention(q, k, v, backend="cpu")

    def attn_grad():
        q.grad = k.grad = v.grad = None
        mhakern.attention(q, k, v, backend="cpu").sum().backward()

    cases["attn_nograd"], cases["attn_grad"] = attn_nograd, attn_grad
    try:
        sinks = torch.zeros(1, requires_grad=True)
        mhakern.attention(q, k, v, backend="cpu", sinks=sinks)

        def attn_sinks_grad():
            q.grad = k.grad = v.grad = sinks.grad = None
            mhakern.attention(q, k, v, backend="cpu", sinks=sinks).sum().backward()

        cases["attn_sinks_grad"] = attn_sinks_grad
    except TypeError:  # a tree without sinks
        pass

    import mhakern._C  # noqa: F401  (registers the operators)

    qn, kn, vn = q.detach(), k.detach(), v.detach()

    full = torch.ops.mhakern_C.fwd

    def raw_fwd():
        full(qn, kn, vn, 0.25, False, None, None, 0.0, 0, False, -1, -1)

    try:
        plain = torch.ops.mhakern_C.fwd_plain
    except AttributeError:  # a tree whose plain calls run fwd itself
        cases["raw"] = raw_fwd
    else:
        def raw():
            plain(qn, kn, vn, 0.25, False, None)

        cases["raw"] = raw
    cases["raw_fwd"] = raw_fwd
    add = torch.ops.aten.add.Tensor

    def torch_op():
        add(qn, qn)

    cases["torch_op"] = torch_op
    return cases


def measure(rounds: int, calls: int) -> dict:
    """Median microseconds per call of each case, rounds interleaved across the cases."""
    cases = _cases()
    for fn in cases.values():  # warm-up: first-call imports, dispatch caches
        for _ in range(50):
            fn()
    samples = {n: [] for n in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[name].append((time.perf_counter() - t0) / calls * 1e6)
    return {n: statistics.median(s) for n, s in samples.items()}


def _run_tree(root: str, rounds: int, calls: int) -> dict:
    env = dict(os.environ, PYTHONPATH=root)
    out = subprocess.run([sys.executable, os.path.join(HERE, "bench_call_overhead.py"), "--json", "--rounds",
                          str(rounds), "--calls", str(calls)], env=env, cwd=root, check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--compare", metavar="OTHER_ROOT")
    ap.add_argument("--pairs", type=int, default=3, help="with --compare: processes per tree, alternated")
    ap.add_argument("--json", action="store_true", help="print one JSON line (used by --compare)")
    args = ap.parse_args()
    if args.compare is None:
        res = measure(args.rounds, args.calls)
        if args.json:
            print(json.dumps(res))
        else:
            for n, us in res.items():
                print(f"{n:16s} {us:8.1f} us")
        return
    ours, theirs = [], []
    for _ in range(args.pairs):
        theirs.append(_run_tree(os.path.abspath(args.compare), args.rounds, args.calls))
        ours.append(_run_tree(ROOT, args.rounds, args.calls))
    # Each process's speed also drifts with the machine's load: "per torch op" divides every case
    # by that process's ``torch_op`` (torch's code only, the same in both trees) before taking the
    # ratio; a tree without that case is normalised by its ``raw``.
    # "best": the fastest process of each tree, the figure least touched by other load.
    norm = "torch_op" if "torch_op" in theirs[0] else "raw"
    print(f"{'case':16s} {'other us':>9s} {'this us':>9s} {'this/other':>10s} {'per torch op':>12s} {'best':>6s}")
    for n in ours[0]:
        if n not in theirs[0]:
            print(f"{n:16s} {'-':>9s} {statistics.median(r[n] for r in ours):9.1f}")
            continue
        a = statistics.median(r[n] for r in theirs)
        b = statistics.median(r[n] for r in ours)
        an = statistics.median(r[n] / r[norm] for r in theirs)
        bn = statistics.median(r[n] / r[norm if norm in r else "raw"] for r in ours)
        best = min(r[n] for r in ours) / min(r[n] for r in theirs)
        print(f"{n:16s} {a:9.1f} {b:9.1f} {b / a:10.2f} {bn / an:12.2f} {best:6.2f}")


if __name__ == "__main__":
    main()
