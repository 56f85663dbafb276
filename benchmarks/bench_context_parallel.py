"""Context parallelism on CPU: the ring against the same per-rank compute without
communication, the balance of the layouts, and peak memory per rank (issue 33's measurement).

Two ranks of one thread each (gloo on 127.0.0.1), B 1, H 2, L 16384, D 64, causal, float32,
forward + backward, interleaved round by round in one run (a warm-up round uncounted), medians
and minima (on a shared machine the minimum is the least disturbed run):

* ``ring``: :func:`mhakern.distributed.context_parallel_attention` (``method="ring"``), this
  rank's wall time;
* ``local``: the same pieces of work on the same rank with every rank's K/V already at hand
  (gathered before the clock starts): what the ring costs without its communication;
* ``stepped``: ``local`` with a barrier wherever the ring waits for its neighbour (after each
  block, forward and backward): the ranks kept in step as in the ring, nothing sent. On a
  loaded machine each wait costs the ranks the slower one's delays, so ``ring / stepped`` is the
  transfer's own cost and ``stepped / local`` the cost of keeping in step;
* per rank, for the zigzag and the contiguous layout: how far apart the ranks' ``local`` times
  are (the load balance);
* peak memory: the growth of each rank's resident set (VmHWM, reset before the call) during
  one ring forward + backward, against one process computing the whole sequence.

    python benchmarks/bench_context_parallel.py [--rounds 5] [--L 16384] [--heads 2]

On a machine with several GPUs the same measurement runs over NCCL, one GPU per rank, peak
memory from the CUDA allocator (docs/benchmarks.md, "Context parallelism", says what to run):

    python benchmarks/bench_context_parallel.py --device cuda --ranks 8 --dtype bfloat16 --L 131072 --heads 32

Prints the machine (CPU model, load average) with the figures: the machines are shared, and a
figure means something only next to its peer from the same run.
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mhakern  # noqa: E402
from mhakern._cpuinfo import cpu_model  # noqa: E402




def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets VmHWM to the current RSS
        f.write("5")


def _peak_growth_mb(fn, device: torch.device) -> float:
    """How far memory grows above its level before ``fn()`` at its peak: the CUDA allocator's
    count on a GPU, the resident set (VmHWM, reset first) on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - base) / 2**20
    _reset_peak()
    base = _rss_kb("VmRSS:")
    fn()
    return (_rss_kb("VmHWM:") - base) / 1024.0


def _inputs(args, device):
    g = torch.Generator().manual_seed(0)
    dt = getattr(torch, args.dtype)
    return [torch.randn(1, args.heads, args.L, 64, generator=g).to(device=device, dtype=dt) for _ in range(4)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _local(prob, r, P, q, ks, vs, dout, sync=None):
    """The ring's per-rank work with every block at hand: forward merge, then the backward's
    pieces (dq, and the dk/dv shares this rank would send). ``sync``: called where the ring
    waits for the other ranks (after each block, forward and backward), so that the ranks keep
    in step as in the ring but nothing is sent."""
    from mhakern.distributed._blocks import merge, piece_backward, piece_forward

    B, H, Lq, _ = q.shape
    acc = torch.zeros(B, H, Lq, vs[0].shape[3], device=q.device)
    lse = torch.full((B, H, Lq), float("-inf"), device=q.device)
    order = [(r - t) % P for t in range(P)]
    for src in order:
        for p in prob.pieces(r, src):
            o, l_ = piece_forward(p, q, ks[src], vs[src], q.shape[3] ** -0.5, "auto")
            merge(acc[:, :, p.qs : p.qs + p.n], lse[:, :, p.qs : p.qs + p.n], o, l_)
        if sync:
            sync()
    out = acc.to(q.dtype)
    dq = torch.zeros_like(q)
    for src in order:
        dk, dv = torch.zeros_like(ks[src]), torch.zeros_like(vs[src])
        for p in prob.pieces(r, src):
            gq, gk, gv = piece_backward(p, dout, q, ks[src], vs[src], out, lse, q.shape[3] ** -0.5, "auto")
            dq[:, :, p.qs : p.qs + p.n] += gq
            dk[:, :, p.ks : p.ks + p.m] += gk
            dv[:, :, p.ks : p.ks + p.m] += gv
        if sync:
            sync()
    return out


def _worker(r, P, port, args, results):
    import torch.distributed as dist

    from mhakern import distributed as cpd
    from mhakern.distributed._blocks import Problem

    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", r)
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=r, world_size=P, timeout=datetime.timedelta(seconds=600))
    q, k, v, dout = _inputs(args, device)
    data = {}
    for layout in ("zigzag", "contiguous"):
        sh = [cpd.shard(x, layout=layout) for x in (q, k, v, dout)]
        prob = Problem(P=P, layout=layout, L=args.L, B=1, H=args.heads, causal=True, top_left=False,
                       window=(-1, -1), key_lengths=None, softcap=0.0, slopes=None, packed=None,
                       dtype=q.dtype, device=device)
        ks = [cpd.shard(k, layout=layout) if s == r else None for s in range(P)]
        vs = [cpd.shard(v, layout=layout) if s == r else None for s in range(P)]
        for s in range(P):  # every rank's shard, as the ring would bring it (built locally: no clock)
            idx = torch.cat([torch.arange(c * (args.L // (2 * P if layout == "zigzag" else P)),
                                          (c + 1) * (args.L // (2 * P if layout == "zigzag" else P)), device=device)
                             for c in ((s, 2 * P - 1 - s) if layout == "zigzag" else (s,))])
            ks[s], vs[s] = k.index_select(2, idx), v.index_select(2, idx)
        data[layout] = (sh, prob, ks, vs)

    def ring(layout):
        (qs, kss, vss, ds), _, _, _ = data[layout]
        xs = [x.clone().requires_grad_() for x in (qs, kss, vss)]
        out = cpd.context_parallel_attention(*xs, causal=True, layout=layout, method="ring")
        out.backward(ds)

    def local(layout, sync=None):
        (qs, _, _, ds), prob, ks, vs = data[layout]
        _local(prob, r, P, qs, ks, vs, ds, sync)

    # Memory first, on a fresh process: the allocator has cached nothing yet (and the
    # environment fixes glibc's mmap threshold, so that freed blocks leave the resident set).
    dist.barrier()
    peak = _peak_growth_mb(lambda: ring("zigzag"), device)
    times = {name: [] for name in ("ring/zigzag", "local/zigzag", "stepped/zigzag", "ring/contiguous",
                                   "local/contiguous")}
    for i in range(args.rounds + 1):  # round 0 warms up, uncounted
        for name in times:
            kind, layout = name.split("/")
            _sync(device)
            dist.barrier()
            t0 = time.perf_counter()
            if kind == "ring":
                ring(layout)
            else:
                local(layout, dist.barrier if kind == "stepped" else None)
            _sync(device)
            if i:
                times[name].append(time.perf_counter() - t0)
    dist.barrier()
    results.put((r, {name: (statistics.median(ts), min(ts)) for name, ts in times.items()}, peak))
    dist.barrier()
    dist.destroy_process_group()


def _whole(args, results):
    """One process, one thread, the whole sequence: peak memory growth (first call) and time."""
    torch.set_num_threads(args.threads)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    q, k, v, dout = _inputs(args, device)

    def whole():
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        mhakern.attention(*xs, causal=True).backward(dout)

    single = _peak_growth_mb(whole, device)
    _sync(device)
    t0 = time.perf_counter()
    whole()
    _sync(device)
    results.put((single, time.perf_counter() - t0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--L", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (CPU)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL, one GPU per rank")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    args = ap.parse_args()
    P = args.ranks
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores; load average before: {os.getloadavg()}")
    where = f"{P} GPUs (NCCL)" if args.device == "cuda" else f"{P} ranks x {args.threads} thread(s) (gloo)"
    print(f"torch {torch.__version__}; B 1, H {args.heads}, L {args.L}, D 64, causal, {args.dtype}, forward + "
          f"backward, {where}, {args.rounds} rounds, medians")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Freed blocks go back to the system at once, so the resident set's peak is the live peak.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, P, port, args, results)) for r in range(P)]
    for p in procs:
        p.start()
    got = sorted(results.get(timeout=3600) for _ in range(P))
    for p in procs:
        p.join(timeout=60)
    print(f"load average after: {os.getloadavg()}")
    for r, t, peak in got:
        print(f"rank {r}: " + ", ".join(f"{k} {med:.3f} s (min {lo:.3f})" for k, (med, lo) in t.items())
              + f"; ring peak memory growth {peak:.0f} MB")
    for i, stat in ((0, "medians"), (1, "minima")):
        ratios = [t["ring/zigzag"][i] / t["stepped/zigzag"][i] for _, t, _ in got]
        print(f"zigzag ({stat}): ring / stepped per rank {', '.join(f'{x:.3f}' for x in ratios)} (the transfer's "
              f"cost alone)")
    for layout in ("zigzag", "contiguous"):
        for i, stat in ((0, "medians"), (1, "minima")):
            ratios = [t[f"ring/{layout}"][i] / t[f"local/{layout}"][i] for _, t, _ in got]
            loc = [t[f"local/{layout}"][i] for _, t, _ in got]
            print(f"{layout} ({stat}): ring / local per rank {', '.join(f'{x:.3f}' for x in ratios)}; local max / min "
                  f"over ranks {max(loc) / min(loc):.3f}")
    child = ctx.Process(target=_whole, args=(args, results))
    child.start()
    single, t1 = results.get(timeout=3600)
    child.join(timeout=60)
    ring_peak = max(p for _, _, p in got)
    print(f"one process, whole sequence: {t1:.3f} s (second call), peak RSS growth {single:.0f} MB; ring's largest "
          f"rank / whole = {ring_peak / single:.3f} (1/P = {1 / P:.3f})")


if __name__ == "__main__":
    main()
