"""A long-lived group of worker processes for the context-parallel tests: P processes on
127.0.0.1 (gloo) started once, each running the cases the test process sends it over a queue
and answering with plain data. Every wait is bounded: a case that does not answer in time
fails its test and the pool is torn down.

The case functions (``case_*``) run on every rank with the same arguments; they compare this
rank's shard of the context-parallel result with its shard of a single-process float64
computation over the whole sequence and return the violations they found (strings), never
tensors.
"""
from __future__ import annotations

import datetime
import hashlib
import os
import queue
import socket
import sys
import traceback

import torch
import torch.multiprocessing as mp

ANSWER_S = 240.0  # the longest a case may take on a loaded 2-core machine before its test fails
GROUP_TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerPool:
    """P worker processes forming one gloo group; :meth:`run` sends one case to all of them."""

    def __init__(self, P: int):
        ctx = mp.get_context("spawn")
        self.P = P
        self.inbox = [ctx.Queue() for _ in range(P)]
        self.outbox = ctx.Queue()
        port = free_port()
        self.procs = [ctx.Process(target=_worker, args=(r, P, port, self.inbox[r], self.outbox), daemon=True)
                      for r in range(P)]
        for p in self.procs:
            p.start()
        ready = self._collect("ready", 180.0)
        bad = [a for a in ready if a[1] != "ok"]
        if bad:
            self.close()
            raise RuntimeError(f"worker start failed: {bad}")

    def run(self, case: str, **kwargs):
        """Each rank's answer (in rank order) to ``case(**kwargs)``; raises if a rank raised
        something the case did not catch, or did not answer within ANSWER_S."""
        for q in self.inbox:
            q.put((case, kwargs))
        answers = self._collect(case, ANSWER_S)
        errs = [f"rank {r}: {a}" for r, status, a in answers if status != "ok"]
        if errs:
            raise AssertionError("\n".join(errs))
        return [a for _, _, a in answers]

    def _collect(self, what: str, timeout: float):
        got = {}
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        while len(got) < self.P:
            left = (deadline - datetime.datetime.now()).total_seconds()
            dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in got]
            try:
                r, status, answer = self.outbox.get(timeout=min(max(left, 0.01), 1.0))
            except queue.Empty:
                if left > 0 and not dead:
                    continue
                self.close()
                if dead:
                    raise AssertionError(f"{what}: ranks {dead} exited (exit codes "
                                         f"{[self.procs[r].exitcode for r in dead]}); the worker pool was closed") from None
                raise AssertionError(f"{what}: ranks {sorted(set(range(self.P)) - set(got))} did not answer within "
                                     f"{timeout:.0f} s; the worker pool was closed") from None
            got[r] = (r, status, answer)
        return [got[r] for r in range(self.P)]

    def close(self):
        for q in self.inbox:
            try:
                q.put(None)
            except Exception:  # noqa: BLE001 - closing after a failure
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def _worker(rank: int, P: int, port: int, inbox, outbox):
    # The checkout these tests belong to, before any installed mhakern.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [os.path.dirname(here), here]
    try:
        torch.set_num_threads(1)
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=P,
                                timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
        import cp_cases

        outbox.put((rank, "ok", None))
    except Exception:  # noqa: BLE001
        outbox.put((rank, "error", traceback.format_exc()))
        return
    parent = os.getppid()
    while True:
        try:
            msg = inbox.get(timeout=5.0)
        except queue.Empty:
            if os.getppid() != parent:  # the test process is gone (killed): do not linger
                break
            continue
        if msg is None:
            break
        case, kwargs = msg
        try:
            outbox.put((rank, "ok", getattr(cp_cases, case)(**kwargs)))
        except Exception:  # noqa: BLE001 - the test shows it
            outbox.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()


def digest(*tensors) -> str:
    """sha256 of the tensors' bytes: equal digests are bit-identical results."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous().cpu()
        h.update((t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes())
    return h.hexdigest()
