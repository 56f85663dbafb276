"""Block sizes, warps and pipeline depth of the Triton attention kernels.

Kept apart from the kernels so that tuning means editing one table. Every configuration
returned here is compiled ahead of time for sm_80 and sm_90 by tests/test_triton_aot.py, which
fails when one exceeds the chip's shared memory; change the table and that test tells you.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # query rows per tile
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int


def next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def head_block(d: int) -> int:
    """Padded head dim: a power of two of at least 16 (tl.dot's minimum); the kernels mask the rest."""
    return max(16, next_pow2(d))


def _wide(dtype: torch.dtype) -> bool:
    return dtype == torch.float32


def fwd_config(d: int, dv: int, dtype: torch.dtype) -> TileConfig:
    """Forward (and dQ) tiles by padded head dim and dtype."""
    dmax = max(head_block(d), head_block(dv))
    if _wide(dtype):
        if dmax <= 64:
            return TileConfig(64, 64, 4, 2)
        if dmax <= 128:
            return TileConfig(64, 32, 4, 2)
        return TileConfig(32, 32, 4, 1)
    if dmax <= 64:
        return TileConfig(128, 64, 4, 3)
    if dmax <= 128:
        return TileConfig(128, 64, 8, 2)
    return TileConfig(64, 32, 4, 2)


def dq_config(d: int, dv: int, dtype: torch.dtype) -> TileConfig:
    dmax = max(head_block(d), head_block(dv))
    if _wide(dtype):
        return TileConfig(64, 32, 4, 1) if dmax <= 128 else TileConfig(32, 32, 4, 1)
    if dmax <= 128:
        return TileConfig(64, 64, 4, 2)
    return TileConfig(64, 32, 8, 1)


def dkdv_config(d: int, dv: int, dtype: torch.dtype) -> TileConfig:
    """dK/dV tiles: block_n keys stay resident while block_m query rows stream past."""
    dmax = max(head_block(d), head_block(dv))
    if _wide(dtype):
        return TileConfig(32, 64, 4, 1) if dmax <= 64 else TileConfig(16, 32, 4, 1)
    if dmax <= 64:
        return TileConfig(32, 128, 4, 2)
    if dmax <= 128:
        return TileConfig(32, 64, 8, 2)
    return TileConfig(16, 32, 8, 1)


def packed_rows(lq: int, n_rep: int, block_m: int) -> int:
    """Heads per program for the row tile: all ``n_rep`` query heads of a KV head when one head's
    queries do not fill a tile (decode shapes), else 1.

    Packing puts the queries of the heads that share a KV head in one tile, so the shared keys
    and values are read once for all of them.
    """
    return n_rep if n_rep > 1 and lq < block_m else 1


def row_block(rows: int, block_m: int) -> int:
    """Shrink the row tile for short row counts (decode), never below tl.dot's 16."""
    return max(16, min(block_m, next_pow2(rows)))
