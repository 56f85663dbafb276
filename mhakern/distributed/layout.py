"""Sequence layouts of context parallelism: which tokens of the whole sequence each rank holds,
and the helpers that lay a full tensor out over a group (:func:`shard`) and gather it back
(:func:`unshard`), dense and packed.

A layout cuts the sequence into equal chunks: ``"contiguous"`` into P chunks, rank r holding
chunk r; ``"zigzag"`` into 2P chunks, rank r holding chunks r and 2P - 1 - r (in that order),
so that under causal attention every rank has the same amount of work (a late chunk sees many
keys, its partner few). Packed sequences are cut one sequence at a time into the layout's
chunks, as equal as the length allows (the first ``n % C`` chunks one token longer), so each
sequence is balanced on its own and a sequence shorter than the chunk count leaves some chunks
empty; a rank's tokens are, sequence by sequence, its chunks in the order above.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist

from .._errors import ArgumentError
from ..checks import check_prefix_sums

Tensor = torch.Tensor

LAYOUTS = ("contiguous", "zigzag")


def resolve_group(group):
    """(process group, size P, this process's rank in it) of ``group``: None (the default
    group), a ProcessGroup, or a one-dimensional DeviceMesh (or one dimension of one,
    ``mesh["cp"]``)."""
    if not dist.is_available() or not dist.is_initialized():
        raise ArgumentError("group: torch.distributed is not initialised (call torch.distributed.init_process_group "
                            "first)")
    if group is not None and hasattr(group, "get_group") and hasattr(group, "mesh"):
        if group.ndim != 1:
            raise ArgumentError(f"group: a DeviceMesh must have one dimension (pass mesh[name]), got {group.ndim}")
        group = group.get_group()
    pg = group if group is not None else dist.group.WORLD
    rank = dist.get_rank(pg)
    if rank < 0:
        raise ArgumentError("group: this process is not a member of the given group")
    return pg, dist.get_world_size(pg), rank


def check_layout(layout) -> None:
    if layout not in LAYOUTS:
        raise ArgumentError(f"layout: expected one of {LAYOUTS}, got {layout!r}")


def num_chunks(layout: str, P: int) -> int:
    """How many chunks the layout cuts the sequence into over P ranks."""
    return 2 * P if layout == "zigzag" else P


def rank_chunks(layout: str, P: int, r: int) -> Tuple[int, ...]:
    """The chunk numbers rank r holds, in its local order."""
    return (r, 2 * P - 1 - r) if layout == "zigzag" else (r,)


def layout_positions(layout: str, P: int, L: int) -> Tensor:
    """(L,) int64: the global position of each token of the ranks' shards laid end to end
    (rank 0's shard, then rank 1's, ...); L divisible by the chunk count."""
    n = num_chunks(layout, P)
    c = L // n
    return torch.cat([torch.arange(ch * c, (ch + 1) * c) for r in range(P) for ch in rank_chunks(layout, P, r)])


def _seq_dim(x: Tensor, seq_dim: int) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if isinstance(seq_dim, bool) or not isinstance(seq_dim, int) or not -x.dim() <= seq_dim < x.dim():
        raise ArgumentError(f"seq_dim: expected an int in [{-x.dim()}, {x.dim() - 1}] for a {x.dim()}-D tensor, "
                            f"got {seq_dim!r}")
    return seq_dim % x.dim()


def shard(x: Tensor, group=None, layout: str = "zigzag", seq_dim: int = 2) -> Tensor:
    """This rank's shard of the full tensor ``x`` (the same on every rank), cut along
    ``seq_dim`` (default 2: the L of (B, H, L, D)) by ``layout``; a new contiguous tensor.
    A length not divisible by the layout's chunk count (P, or 2P for zigzag) is refused."""
    check_layout(layout)
    dim = _seq_dim(x, seq_dim)
    _, P, r = resolve_group(group)
    n, L = num_chunks(layout, P), x.shape[dim]
    if L % n:
        raise ArgumentError(f"x: sequence length {L} (dim {dim}) is not divisible by the {n} chunks of layout "
                            f"{layout!r} over {P} ranks")
    chunks = x.chunk(n, dim) if L else [x] * n
    return torch.cat([chunks[c] for c in rank_chunks(layout, P, r)], dim)


def unshard(x: Tensor, group=None, layout: str = "zigzag", seq_dim: int = 2) -> Tensor:
    """The full tensor, on every rank, from each rank's shard ``x`` (laid out by ``layout``
    along ``seq_dim``); every shard must have the same shape. Not differentiable."""
    check_layout(layout)
    dim = _seq_dim(x, seq_dim)
    pg, P, _ = resolve_group(group)
    per = len(rank_chunks(layout, P, 0))
    if x.shape[dim] % per:
        raise ArgumentError(f"x: a {layout!r} shard holds {per} equal chunks; its length {x.shape[dim]} (dim {dim}) "
                            f"is not divisible by {per}")
    xs = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(P)]
    dist.all_gather(xs, x.contiguous(), group=pg)
    chunks = [None] * num_chunks(layout, P)
    for r in range(P):
        for c, part in zip(rank_chunks(layout, P, r), xs[r].chunk(per, dim) if x.shape[dim] else [xs[r]] * per):
            chunks[c] = part
    return torch.cat(chunks, dim)


# ---------------------------------------------------------------------------------------------
# Packed sequences


def cu_seqlens_list(cu_seqlens) -> List[int]:
    """The prefix sums as Python ints, checked: a 1-D integer tensor (or sequence), first 0,
    non-decreasing."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() or cu_seqlens.dtype == torch.bool:
            raise ArgumentError(f"cu_seqlens: expected a 1-D integer tensor, got {cu_seqlens.dtype} of shape "
                                f"{tuple(cu_seqlens.shape)}")
        cu = [int(c) for c in cu_seqlens.tolist()]
    else:
        cu = [int(c) for c in cu_seqlens]
    check_prefix_sums(cu, "cu_seqlens")
    return cu


def chunk_bounds(n: int, C: int) -> List[int]:
    """C + 1 cut points of a sequence of length n into C chunks as equal as possible (the first
    ``n % C`` one token longer)."""
    base, extra = divmod(n, C)
    cuts = [0]
    for c in range(C):
        cuts.append(cuts[-1] + base + (1 if c < extra else 0))
    return cuts


class PackedLayout:
    """Where every token of a pack of sequences sits under a layout over P ranks.

    ``index[r]``: (T_r,) int64, the pack positions of rank r's tokens in its local order;
    ``seq[r]`` / ``pos[r]``: their sequence numbers and positions inside their sequences."""

    def __init__(self, cu: Sequence[int], layout: str, P: int):
        C = num_chunks(layout, P)
        self.cu, self.P = list(cu), P
        idx, seq, pos = ([[] for _ in range(P)] for _ in range(3))
        for s in range(len(cu) - 1):
            cuts = chunk_bounds(cu[s + 1] - cu[s], C)
            for r in range(P):
                for c in rank_chunks(layout, P, r):
                    a, b = cuts[c], cuts[c + 1]
                    idx[r].append(torch.arange(cu[s] + a, cu[s] + b))
                    pos[r].append(torch.arange(a, b))
                    seq[r].append(torch.full((b - a,), s, dtype=torch.int64))
        cat = (lambda parts: torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64))
        self.index = [cat(p) for p in idx]
        self.seq = [cat(p) for p in seq]
        self.pos = [cat(p) for p in pos]
        self.tokens = [int(t.numel()) for t in self.index]


def shard_varlen(x: Tensor, cu_seqlens, group=None, layout: str = "zigzag", seq_dim: int = 0) -> Tensor:
    """This rank's tokens of the packed tensor ``x`` (all sequences, along ``seq_dim``, default
    0: the T of (T, H, D)), each sequence cut by ``layout`` on its own (module docstring)."""
    check_layout(layout)
    dim = _seq_dim(x, seq_dim)
    _, P, r = resolve_group(group)
    cu = cu_seqlens_list(cu_seqlens)
    if cu[-1] != x.shape[dim]:
        raise ArgumentError(f"cu_seqlens: its last entry {cu[-1]} must equal x's token count {x.shape[dim]} (dim {dim})")
    return x.index_select(dim, PackedLayout(cu, layout, P).index[r].to(x.device))


def unshard_varlen(x: Tensor, cu_seqlens, group=None, layout: str = "zigzag", seq_dim: int = 0) -> Tensor:
    """The full packed tensor, on every rank, from each rank's :func:`shard_varlen` share.
    Not differentiable."""
    check_layout(layout)
    dim = _seq_dim(x, seq_dim)
    pg, P, r = resolve_group(group)
    cu = cu_seqlens_list(cu_seqlens)
    pl = PackedLayout(cu, layout, P)
    if x.shape[dim] != pl.tokens[r]:
        raise ArgumentError(f"x: rank {r}'s share of these sequences holds {pl.tokens[r]} tokens (dim {dim}), "
                            f"got {x.shape[dim]}")
    xm = x.movedim(dim, 0)
    T = max(pl.tokens)
    padded = xm.new_zeros((T,) + tuple(xm.shape[1:]))
    padded[: xm.shape[0]] = xm
    parts = [torch.empty_like(padded) for _ in range(P)]
    dist.all_gather(parts, padded, group=pg)
    full = xm.new_empty((cu[-1],) + tuple(xm.shape[1:]))
    for q in range(P):
        full[pl.index[q].to(x.device)] = parts[q][: pl.tokens[q]]
    return full.movedim(0, dim)

