"""The communication of context parallelism, every wait bounded and every failure named:
the agreement check of a call's metadata across ranks before any data moves, the closing
status exchange that turns one rank's exception into every rank's, and the ring's
point-to-point shift.

Agreement first: each rank sends a small int64 vector (status, shapes, dtype, the call's
arguments, a digest of the global tensors that must agree) plus its error message, if any,
in one all_gather; every rank then raises the same error when a rank failed its own checks
or the vectors disagree, naming the rank and the field. A rank that fails *during* the
computation (a kernel error) keeps taking part in the communication with its share marked
bad, and the closing status all_gather makes every rank raise, naming it. A rank that dies
or hangs leaves the others blocked in a wait that the group's timeout ends; that error is
re-raised naming the peer waited for.
"""
from __future__ import annotations

import struct
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

Tensor = torch.Tensor

_MSG_BYTES = 480


class ContextParallelError(RuntimeError):
    """A context-parallel call failed on some rank (named in the message) or the ranks' inputs
    disagree; raised on every rank of the group."""


def float_bits(x: float) -> int:
    """The IEEE-754 double bits of ``x`` as a signed int64, for exact comparison across ranks."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def digest(values: Sequence[int]) -> int:
    """An order-sensitive 61-bit digest of a list of ints (key lengths, prefix sums)."""
    m = (1 << 61) - 1
    h = (len(values) + 0x9E3779B97F4A7C15) % m
    for x in values:
        h = ((h ^ (int(x) & 0xFFFFFFFFFFFFFFFF)) * 0x100000001B3) % m
    return h


def comm_device(pg, like: Tensor) -> torch.device:
    """Where the group's collectives take tensors: the data's device for NCCL, else the CPU."""
    try:
        backend = str(dist.get_backend(pg)).lower()
    except Exception:  # noqa: BLE001 - a fake or custom group: the data's device
        return like.device
    return like.device if "nccl" in backend else torch.device("cpu")


class Comm:
    """A group, this rank's place in it and its ring neighbours (as global ranks, which
    point-to-point calls take)."""

    def __init__(self, pg, P: int, r: int, device: torch.device, what: str):
        self.pg, self.P, self.r, self.device, self.what = pg, P, r, device, what
        self.next_global = dist.get_global_rank(pg, (r + 1) % P) if P > 1 else None
        self.prev_global = dist.get_global_rank(pg, (r - 1) % P) if P > 1 else None

    def global_rank(self, q: int) -> int:
        return dist.get_global_rank(self.pg, q)

    def _fail(self, exc: BaseException, waiting_for: str) -> ContextParallelError:
        return ContextParallelError(f"{self.what}: rank {self.r} got no data from {waiting_for} within the group's "
                                    f"timeout (that rank failed, exited or hangs): {exc}")

    def agree(self, fields: Sequence[int], names: Sequence[str], error: Optional[str],
              verb: str = "refused its input") -> None:
        """The agreement check (module docstring): raises ContextParallelError on every rank
        when any rank's ``error`` is set or ``fields`` differ between ranks."""
        msg = (error or "").encode("utf-8")[:_MSG_BYTES]
        row = torch.zeros(2 + len(fields) + _MSG_BYTES, dtype=torch.int64)
        row[0] = 1 if error else 0
        row[1] = len(msg)
        row[2 : 2 + len(fields)] = torch.tensor([int(f) for f in fields], dtype=torch.int64)
        if msg:
            row[2 + len(fields) : 2 + len(fields) + len(msg)] = torch.tensor(list(msg), dtype=torch.int64)
        rows = self._gather_rows(row.to(self.device), "every rank (the agreement check)")
        failed = [q for q in range(self.P) if rows[q][0]]
        if failed:
            q = failed[0]
            n = int(rows[q][1])
            text = bytes(int(b) for b in rows[q][2 + len(fields) : 2 + len(fields) + n]).decode("utf-8", "replace")
            others = f" (ranks {failed} failed)" if len(failed) > 1 else ""
            raise ContextParallelError(f"{self.what}: rank {q} {verb}{others}: {text}")
        for i, name in enumerate(names):
            vals = [int(rows[q][2 + i]) for q in range(self.P)]
            if any(v != vals[0] for v in vals):
                raise ContextParallelError(f"{self.what}: the ranks disagree on {name}: "
                                           + ", ".join(f"rank {q}: {_show(name, v)}" for q, v in enumerate(vals)))

    def close(self, error: Optional[BaseException]) -> None:
        """The closing status exchange: every rank raises if any rank's share failed."""
        self.agree((), (), None if error is None else f"{type(error).__name__}: {error}", "failed")

    def _gather_rows(self, row: Tensor, waiting_for: str) -> List[Tensor]:
        if self.P == 1:
            return [row.cpu()]
        out = [torch.empty_like(row) for _ in range(self.P)]
        try:
            dist.all_gather(out, row, group=self.pg)
        except Exception as exc:  # noqa: BLE001 - gloo / NCCL errors have no common type
            raise self._fail(exc, waiting_for) from exc
        return [o.cpu() for o in out]

    def shift(self, tensors: Sequence[Tensor], recv_shapes=None) -> "Pending":
        """Send ``tensors`` to the next rank and receive the previous rank's (same shapes and
        dtypes unless ``recv_shapes`` says otherwise), without waiting."""
        sends = [t.contiguous() for t in tensors]
        shapes = recv_shapes or [t.shape for t in sends]
        recvs = [torch.empty(s, dtype=t.dtype, device=t.device) for s, t in zip(shapes, sends)]
        ops = [dist.P2POp(dist.isend, t, self.next_global, self.pg) for t in sends]
        ops += [dist.P2POp(dist.irecv, t, self.prev_global, self.pg) for t in recvs]
        return Pending(self, dist.batch_isend_irecv(ops), recvs, sends, f"rank {(self.r - 1) % self.P} (ring)")

    def exchange(self, sends: Sequence[Optional[Tensor]], recvs: Sequence[Optional[Tensor]]) -> None:
        """Point-to-point with every other rank at once: ``sends[q]`` to rank q, ``recvs[q]``
        filled from rank q (None at this rank's own place); waits."""
        ops = []
        for q in range(self.P):
            if q != self.r:
                ops.append(dist.P2POp(dist.isend, sends[q].contiguous(), self.global_rank(q), self.pg))
                ops.append(dist.P2POp(dist.irecv, recvs[q], self.global_rank(q), self.pg))
        if ops:
            Pending(self, dist.batch_isend_irecv(ops), list(recvs), list(sends), "the other ranks").wait()

    def all_gather(self, x: Tensor) -> List[Tensor]:
        out = [torch.empty_like(x) for _ in range(self.P)]
        try:
            dist.all_gather(out, x.contiguous(), group=self.pg)
        except Exception as exc:  # noqa: BLE001
            raise self._fail(exc, "every rank (all-gather)") from exc
        return out


class Pending:
    """Point-to-point transfers in flight; :meth:`wait` returns the received tensors."""

    def __init__(self, comm: Comm, works, recvs, sends, peer: str):
        self.comm, self.works, self.recvs, self.sends, self.peer = comm, works, recvs, sends, peer

    def wait(self) -> List[Tensor]:
        try:
            for w in self.works:
                w.wait()
        except Exception as exc:  # noqa: BLE001
            raise self.comm._fail(exc, self.peer) from exc
        return self.recvs


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def dtype_code(dt: torch.dtype) -> int:
    return _DTYPES.index(dt) if dt in _DTYPES else 99


def _show(name: str, v: int) -> str:
    if name == "dtype":
        return str(_DTYPES[v]) if 0 <= v < len(_DTYPES) else "another dtype"
    if name in ("scale", "softcap"):
        return repr(struct.unpack("<d", struct.pack("<q", v))[0])
    return str(v)
