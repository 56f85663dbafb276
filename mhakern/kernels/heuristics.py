"""Block sizes, warps and pipeline depth of the Triton attention kernels, per architecture.

Kept apart from the kernels so that tuning means editing one table. Every configuration here
is compiled ahead of time for its architecture by ``python -m mhakern.kernels.aot`` (and by
tests/test_triton_aot.py), which reads the cubin's SASS and fails when a variant spills
registers to local memory, uses more shared memory than the chip has, or (sm_90) multiplies
in a loop without the warpgroup MMA (HGMMA). Change the table and that check tells you.

How the table was chosen (triton 3.9, cuobjdump figures in the AOT report): start from the
tiles of Triton's fused-attention tutorial and FlashAttention 2, then shrink (fewer rows or
keys per tile, or more warps to spread the accumulators) until the variant has no stack. A
thread can hold 255 registers; the accumulators alone take rows * cols * 4 B / threads, e.g.
the forward's (BLOCK_M x Dv) fp32 accumulator at 128 x 128 over 8 warps is 64 registers, the
scores tile (BLOCK_M x BLOCK_N) as much again, so the larger head dims take more warps or
fewer keys. sm_90 tiles keep BLOCK_M a multiple of 64 per warpgroup where the MMA allows
(wgmma's M is 64), sm_80 tiles keep 16 rows per warp.

Head dims that are not multiples of 16 have their own rows (UNALIGNED_TILES, with why), and
the sm_90 forward of calls without modes goes through tensor descriptors (TMA) when
``desc_eligible`` says the tensors allow it (its tiles: the "fwd_desc" rows).

Launches with modes (a mask, a band or window, dropout) take the modes kernels at a tile the
same functions give for those modes: the plain row narrowed by ``mode_tiles``, capped per arch
by MODE_CAPS (``python -m mhakern.kernels.aot --modes`` checks them).

Both supported triton versions must pass (3.9 here, 3.6 on the GPU machine): their register
allocations differ by up to ~20 registers, so a tile at the edge in one spills in the other
(dK/dV at head dim 64 on sm_80 spills 48 B with triton 3.6 at 2 stages, none at 1 stage).

fp32 multiplies in full precision (ieee: FMA, no tensor cores; exactness first). Triton's FMA
dot keeps, per thread, its rows of the left operand and columns of the right one over the whole
reduction dim in registers, so the tiles that spill are those whose reduction dim is long
(the head dim in q.k, BLOCK_N in p.v) with many rows or columns per thread: 64x64 at 4 warps
spilled 1.3 KB in the forward's loop and the old backward tiles 0.4-12 KB. The fp32 rows below
are 8 warps over small tiles, checked with ``--dtypes fp32`` (not in CI: up to a minute per
variant on a busy two-core machine). They are not tuned for speed.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Dict, Tuple

import torch

try:
    from .. import _caps
except ImportError:  # mhakern/kernels/ loaded by path as `kernels` (aot.py): _caps.py is on that path
    import _caps  # type: ignore[no-redef]

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


def arch_family(capability: Tuple[int, int]) -> int:
    """Row of the table for a device of this compute capability: 90 (Hopper and newer) or 80."""
    return 90 if capability[0] >= 9 else 80


def head_bucket(d: int, dv: int) -> int:
    """Row of the table for head dims (d, dv): the padded head dim, at least 64."""
    return max(64, head_block(d), head_block(dv))


# (kernel, arch family, "16" for fp16/bf16 or "32" for fp32, padded head dim bucket) -> tiles.
# "dkdv" tiles: block_n keys stay resident while block_m query rows stream past.
_T = TileConfig
TILES: Dict[Tuple[str, int, str, int], TileConfig] = {
    # forward
    ("fwd", 90, "16", 64): _T(128, 64, 4, 3),
    ("fwd", 90, "16", 128): _T(128, 64, 8, 2),
    ("fwd", 90, "16", 256): _T(64, 32, 8, 2),
    ("fwd", 80, "16", 64): _T(128, 64, 8, 3),
    ("fwd", 80, "16", 128): _T(128, 32, 8, 2),
    ("fwd", 80, "16", 256): _T(64, 32, 8, 2),
    ("fwd", 90, "32", 64): _T(64, 32, 8, 1),
    ("fwd", 90, "32", 128): _T(32, 32, 8, 1),
    ("fwd", 90, "32", 256): _T(16, 16, 8, 1),
    ("fwd", 80, "32", 64): _T(64, 32, 8, 1),
    ("fwd", 80, "32", 128): _T(32, 32, 8, 1),
    ("fwd", 80, "32", 256): _T(16, 16, 8, 1),
    # dQ
    ("dq", 90, "16", 64): _T(64, 64, 4, 2),
    ("dq", 90, "16", 128): _T(64, 64, 8, 2),
    ("dq", 90, "16", 256): _T(64, 16, 8, 2),
    ("dq", 80, "16", 64): _T(64, 64, 8, 2),
    ("dq", 80, "16", 128): _T(64, 64, 8, 2),
    ("dq", 80, "16", 256): _T(64, 32, 8, 1),
    ("dq", 90, "32", 64): _T(32, 32, 8, 1),
    ("dq", 90, "32", 128): _T(32, 16, 8, 1),
    ("dq", 90, "32", 256): _T(16, 16, 8, 1),
    ("dq", 80, "32", 64): _T(32, 32, 8, 1),
    ("dq", 80, "32", 128): _T(32, 16, 8, 1),
    ("dq", 80, "32", 256): _T(16, 16, 8, 1),
    # dK/dV
    ("dkdv", 90, "16", 64): _T(32, 128, 8, 2),
    ("dkdv", 90, "16", 128): _T(16, 64, 8, 2),
    ("dkdv", 90, "16", 256): _T(16, 32, 8, 1),  # mma.sync: see MMA_SYNC_ON_SM90
    ("dkdv", 80, "16", 64): _T(32, 128, 8, 1),
    ("dkdv", 80, "16", 128): _T(32, 64, 8, 2),
    ("dkdv", 80, "16", 256): _T(16, 32, 8, 1),
    ("dkdv", 90, "32", 64): _T(16, 32, 8, 1),
    ("dkdv", 90, "32", 128): _T(16, 32, 8, 1),
    ("dkdv", 90, "32", 256): _T(16, 16, 8, 1),
    ("dkdv", 80, "32", 64): _T(16, 32, 8, 1),
    ("dkdv", 80, "32", 128): _T(16, 32, 8, 1),
    ("dkdv", 80, "32", 256): _T(16, 16, 8, 1),
    # fused backward (dK, dV and dQ's shares in one program; "dkdv" semantics of block_m/block_n:
    # block_n keys resident, block_m rows a step). Registers, triton 3.9: sm_90 d64 207, d128 252
    # (8/1: 254), d256 167 (mma.sync, as dK/dV's); sm_80 d128 219, d256 233.
    ("fused", 90, "16", 64): _T(32, 128, 8, 2),
    ("fused", 90, "16", 128): _T(16, 64, 8, 2),
    ("fused", 90, "16", 256): _T(16, 32, 8, 1),
    ("fused", 80, "16", 64): _T(32, 64, 8, 1),  # dK/dV's 32x128: 255 registers, no margin for 3.6; 187 here
    ("fused", 80, "16", 128): _T(32, 64, 8, 2),
    ("fused", 80, "16", 256): _T(16, 32, 8, 1),
    ("fused", 90, "32", 64): _T(16, 32, 8, 1),
    ("fused", 90, "32", 128): _T(16, 32, 8, 1),
    ("fused", 90, "32", 256): _T(16, 16, 8, 1),
    ("fused", 80, "32", 64): _T(16, 32, 8, 1),
    ("fused", 80, "32", 128): _T(16, 32, 8, 1),
    ("fused", 80, "32", 256): _T(16, 16, 8, 1),
    # forward through tensor descriptors (sm_90 only; see desc_eligible)
    ("fwd_desc", 90, "16", 64): _T(128, 64, 4, 3),
    ("fwd_desc", 90, "16", 128): _T(128, 64, 8, 2),
    ("fwd_desc", 90, "16", 256): _T(64, 32, 8, 2),
}

# Head dims that are not multiples of 16 (40, 72, 100, 200, ...): the JIT cannot mark their
# strides divisible by 16 (it looks at the element count, and 40 is not, though 80 bytes are),
# so the pointer kernels load and store element by element with a 64-bit address per element,
# and tiles that fit when aligned spill those addresses. These rows replace TILES' there.
# Each row names what the aligned tile costs here (triton 3.9). Stack left outside the loops
# (the Q/K/V tiles loaded once per program, the output stored once) is allowed for these: one
# access per program, not one per key block; the AOT check still refuses local memory in a loop.
UNALIGNED_TILES: Dict[Tuple[str, int, str, int], TileConfig] = {
    ("fwd", 90, "16", 64): _T(128, 64, 8, 3),  # 4 warps: 496 B of stack
    ("dq", 90, "16", 64): _T(64, 64, 8, 2),  # 4 warps: 24 B
    ("dq", 80, "16", 64): _T(32, 64, 8, 2),  # 64x64: 160 B, 3 LDL/STL in the loop (k's non-finite entries zeroed there)
    ("dq", 90, "16", 128): _T(64, 32, 8, 2),  # 64x64: 176 B
    ("dkdv", 90, "16", 128): _T(16, 32, 8, 2),  # mma.sync; every wgmma tile tried spills in the loop
    ("fwd", 90, "16", 256): _T(64, 16, 8, 2),  # 64x32: 1 LDL in the loop with triton 3.6
    ("dq", 90, "16", 256): _T(16, 16, 8, 1),  # mma.sync (32x16: 254 registers); 64x16 wgmma: 27 LDL/STL in the loop
    # The fused backward takes dK/dV's rows (see _AS_DKDV) except here:
    ("fused", 80, "16", 256): _T(16, 16, 8, 1),  # dK/dV's 16x32: 216 B, 10 LDL/STL in the loop (16x32 4 warps: 240)
}


# Variants allowed to multiply with mma.sync (HMMA) on sm_90 instead of the warpgroup MMA, as
# (kernel, dtype width, head-dim bucket, strides aligned to 16 elements).
# dK/dV at head dim 256 keeps two (BLOCK_N x 256) fp32 accumulators per program; wgmma needs
# BLOCK_N >= 64 there (its M is 64 per warpgroup), which makes them 128 registers a thread at
# 8 warps, next to the resident K and V tiles and the streamed Q/dO operands: every such tile
# spills inside the key loop. Measured (triton 3.9, bf16/fp16, causal + key lengths; stack B /
# LDL+STL in loops): 16x64 8 warps 1 stage 760 / 197; 32x64 8w 944 / 252; 16x64 4w 1568 / 661;
# 16 warps cap a thread at 128 registers and spill more. No wgmma tile of this kernel fits;
# one that does would split the work differently (dK and dV, or halves of the head dim, in
# separate programs), a change of the kernel rather than of its tiles. 32 keys with mma.sync
# fit with no stack.
# Unaligned head dims (see UNALIGNED_TILES) at the larger buckets: every wgmma tile tried keeps
# local memory in the key loop, because the operands streamed through the loop are loaded
# element by element (a 64-bit address per element) before they reach shared memory.
MMA_SYNC_ON_SM90 = frozenset({
    ("dkdv", "16", 256, True), ("dkdv", "16", 256, False), ("dkdv", "16", 128, False), ("dq", "16", 256, False),
})


# The fused backward is the dK/dV kernel plus dQ's share (a (BLOCK_M x D) fp32 tile more per
# step): it takes dK/dV's rows in UNALIGNED_TILES, MODE_CAPS and the mma.sync exceptions, for
# the same reasons (its own TILES rows say where its plain tile differs).
_AS_DKDV = {"fused": "dkdv"}


def allows_mma_sync(kernel: str, width: str, bucket: int, aligned: bool, modes: str = "",
                    modified: bool = False) -> bool:
    """Whether a variant may multiply with mma.sync on sm_90 (the AOT check's exception):
    MMA_SYNC_ON_SM90 for its tile row, MMA_SYNC_MODES_ON_SM90 for its ``modes`` (mode_class), or,
    ``modified`` (softcap or ALiBi on), MMA_SYNC_MODIFIERS_ON_SM90."""
    if modified and (kernel, width, bucket) in MMA_SYNC_MODIFIERS_ON_SM90:
        return True
    kernel = _AS_DKDV.get(kernel, kernel)
    return ((kernel, width, bucket, aligned) in MMA_SYNC_ON_SM90
            or (kernel, width, bucket, modes) in MMA_SYNC_MODES_ON_SM90)


def strides_aligned(d: int, dv: int) -> bool:
    """Whether the layouts the dispatcher allocates give strides the JIT marks divisible by 16:
    every stride is a multiple of the head dim, so head dims that are multiples of 16."""
    return d % 16 == 0 and dv % 16 == 0


def tile_config(kernel: str, d: int, dv: int, dtype: torch.dtype, arch: int = 80, *, band: bool = False,
                mask_kind: int = 0, dropout: bool = False, modified: bool = False) -> TileConfig:
    """Tiles of ``kernel`` ("fwd", "dq", "dkdv", "fused" or "fwd_desc") for head dims (d, dv), dtype and
    arch family; with modes (``band``: a window or top-left alignment, ``mask_kind`` 0 none /
    1 bool / 2 float, ``dropout``) or a score modifier (``modified``: softcap or ALiBi), the
    mode variant's tile (``mode_tiles``)."""
    width = "32" if dtype == torch.float32 else "16"
    family = 90 if arch >= 90 else 80
    key = (kernel, family, width, head_bucket(d, dv))
    cfg = TILES[key]
    alias = (_AS_DKDV.get(kernel, kernel),) + key[1:]
    if not strides_aligned(d, dv):
        cfg = UNALIGNED_TILES.get(key) or UNALIGNED_TILES.get(alias) or cfg
    if kernel == "fwd_desc":
        return cfg
    return mode_tiles(kernel, cfg, arch=family, width=width, bucket=key[3], band=band, mask_kind=mask_kind,
                      dropout=dropout, modified=modified)


# --- Tiles of the mode variants (the ``*_modes_kernel`` entry points) --------------------------
# The optional modes add (rows x keys) tiles beside the plain kernel's: the mask's values (bool
# read as bytes, or float32), the column test that zeroes the values of keys no row sees, the
# band's bounds, the dropout keep bits. The plain tile of each row above is narrowed until
# those fit: budgets are elements of one (rows x keys) tile per thread, found with the AOT
# check (``python -m mhakern.kernels.aot --modes``) on sm_80 and sm_90, fp16/bf16, head dims 64
# and 128, where the variants spilled at the plain tiles. The plain variant keeps its tile.
#   forward: mask 16 (8 with band or dropout too), band or dropout alone 32; with a mask at
#            most 64 rows (sm_80 d128 spilled at 128 x 32 within the budget) and 2 stages;
#   dK/dV with a mask: at most 16 rows x 64 keys; dQ with a mask: at most 32 keys.
# MODE_CAPS then caps a narrowed tile where it still spilled on one architecture or triton.
#
# (kernel, arch family, dtype width, head-dim bucket, mode class) -> a cap on the tile:
# block_m, block_n and num_stages each at most the cap's (num_warps is the cap's). Classes
# (mode_class): "mask" a bool or float mask alone, "mask+" a mask with a band or dropout (it
# falls back to the "mask" row when it has none), "nomask" a band or dropout without a mask.
# Each row says what the tile it replaces cost (stack B / local accesses in loops), fp16/bf16.
MODE_CAPS: Dict[Tuple[str, int, str, int, str], TileConfig] = {
    # 64x64 2 stages: 24 B outside the loop with a float mask (triton 3.6)
    ("fwd", 80, "16", 64, "mask"): _T(64, 32, 8, 2),
    # 64x64 2 stages: 56 B outside the loop with a bool mask (triton 3.9)
    ("fwd", 90, "16", 128, "mask"): _T(64, 32, 8, 2),
    # 64x32 2 stages: 24 B outside the loop with every mode (3.6); 1 stage still 8 B
    ("dq", 80, "16", 128, "mask+"): _T(32, 32, 8, 2),
    # 32x128 1 stage: 24 B outside the loop with dropout (3.6); 32x64 leaves 16 B, within slack
    ("dkdv", 80, "16", 64, "nomask"): _T(32, 64, 8, 1),
    # 32x128 2 stages: 24 B, 3 local accesses in the loop with a band or dropout (3.6)
    ("dkdv", 90, "16", 64, "nomask"): _T(32, 128, 8, 1),
    # 16x64 2 stages: 32-56 B, 1-7 in the loop with every mode (3.6)
    ("dkdv", 80, "16", 128, "mask+"): _T(16, 64, 8, 1),
    # Head dims 129-256 (triton 3.9, fp16; d256 and the unaligned d200). With every mode: fwd
    # 64x32 left 48 B (sm_80) / 96 B (sm_90) outside the loop and 92 local accesses in the loop
    # at d200 on sm_80; dQ 64x32 one stage 69 / 155 in the loop on sm_80 (32x32: still 31),
    # 64x16 on sm_90 27 in the loop (one stage 99). A mask alone, or a band alone: fwd d200
    # sm_80 3-135 in the loop, dQ d200 sm_80 4-49, dQ d256 48-216 B outside the loop on both
    # arches (1 in the loop with the mask's gradient on sm_90). dQ takes 16 rows there, below
    # wgmma's 64, so mma.sync on sm_90 (MMA_SYNC_MODES_ON_SM90).
    ("fwd", 80, "16", 256, "mask+"): _T(32, 32, 8, 2),
    ("fwd", 80, "16", 256, "mask"): _T(32, 32, 8, 2),
    ("fwd", 80, "16", 256, "nomask"): _T(16, 32, 8, 2),  # 32x32: d200 band 2 in the loop (3.6)
    ("fwd", 90, "16", 256, "mask+"): _T(64, 16, 8, 2),
    ("dq", 80, "16", 256, "mask+"): _T(16, 32, 8, 1),
    ("dq", 80, "16", 256, "mask"): _T(16, 32, 8, 1),
    ("dq", 80, "16", 256, "nomask"): _T(16, 32, 8, 1),
    ("dq", 90, "16", 256, "mask+"): _T(16, 32, 8, 1),
    ("dq", 90, "16", 256, "mask"): _T(16, 32, 8, 1),
    ("dq", 90, "16", 256, "nomask"): _T(16, 32, 8, 1),
    # sm_90 16x64 8 warps wgmma, 2 stages (triton 3.9): a bool or float mask kept 40 B with an
    # LDL in the key loop; one stage fits a bool mask (245 registers) but a float one still keeps
    # 24 B, and with a band or dropout too 40 B and an LDL in the loop; with every mode, 4 warps
    # 56 B (11 in loops), 16 warps 312 B, 32 rows 272 B: no wgmma tile fits (wgmma's M is 64
    # keys here and 16 rows is tl.dot's minimum), so 32 keys with mma.sync (158 registers, no
    # stack), as the unaligned d128 row does; MMA_SYNC_MODES_ON_SM90 names it for the AOT check.
    ("dkdv", 90, "16", 128, "mask"): _T(16, 32, 8, 1),
}

# Mode variants allowed mma.sync on sm_90, as (kernel, dtype width, head-dim bucket, mode
# class): those whose MODE_CAPS row takes fewer keys than wgmma's 64 (see there why).
MMA_SYNC_MODES_ON_SM90 = frozenset({
    ("dkdv", "16", 128, "mask"), ("dkdv", "16", 128, "mask+"),
    ("dq", "16", 256, "mask"), ("dq", "16", 256, "mask+"), ("dq", "16", 256, "nomask"),
})


def mode_class(band: bool = False, mask_kind: int = 0, dropout: bool = False) -> str:
    """Which MODE_CAPS rows apply: "mask+" (a mask and a band or dropout), "mask", "nomask"
    (a band or dropout without a mask), or "" (no mode: the plain kernel)."""
    if not mask_kind:
        return "nomask" if (band or dropout) else ""
    return "mask+" if (band or dropout) else "mask"


def mode_tiles(kernel: str, cfg: TileConfig, *, arch: int = 80, width: str = "16", bucket: int = 64,
               band: bool = False, mask_kind: int = 0, dropout: bool = False, modified: bool = False) -> TileConfig:
    """The tile of ``kernel`` ("fwd", "dkdv", "dq") for a launch with modes, from ``cfg``, the
    plain variant's tile for the same (arch, dtype width, head-dim bucket); see the comment
    above for the rule, and MODIFIER_CAPS for ``modified``. With no mode and no modifier the
    plain tile comes back unchanged."""
    if modified:
        cfg = _modifier_caps(kernel, mode_tiles(kernel, cfg, arch=arch, width=width, bucket=bucket, band=band,
                                                mask_kind=mask_kind, dropout=dropout),
                             arch, width, bucket, mode_class(band, mask_kind, dropout))
        return cfg
    if kernel == "fwd":
        if mask_kind:
            budget = 8 if (band or dropout) else 16
        elif band or dropout:
            budget = 32
        else:
            return cfg
        bm, bn = (min(cfg.block_m, 64) if mask_kind else cfg.block_m), cfg.block_n
        while bm * bn > budget * 32 * cfg.num_warps and bm > 64:
            bm //= 2
        while bm * bn > budget * 32 * cfg.num_warps and bn > 32:
            bn //= 2
        cfg = TileConfig(bm, bn, cfg.num_warps, min(cfg.num_stages, 2) if mask_kind else cfg.num_stages)
    elif mask_kind and kernel in ("dkdv", "fused"):
        cfg = TileConfig(min(cfg.block_m, 16), min(cfg.block_n, 64), cfg.num_warps, cfg.num_stages)
    elif mask_kind:
        cfg = TileConfig(cfg.block_m, min(cfg.block_n, 32), cfg.num_warps, cfg.num_stages)
    cls = mode_class(band, mask_kind, dropout)
    key = (_AS_DKDV.get(kernel, kernel), 90 if arch >= 90 else 80, width, bucket)
    cap = MODE_CAPS.get(key + (cls,)) or (MODE_CAPS.get(key + ("mask",)) if cls == "mask+" else None)
    if cap is not None:
        cfg = TileConfig(min(cfg.block_m, cap.block_m), min(cfg.block_n, cap.block_n), cap.num_warps,
                         min(cfg.num_stages, cap.num_stages))
    return cfg


# --- The score modifiers (softcap, ALiBi) -----------------------------------------------------------
# They add per-score work (the cap's tanh, ALiBi's |i + off - j|) and, in the backward, keep the
# cap's tanh tile live from the scores to dS. The mode tile (or the plain one) stands except
# where the AOT check (``--modes modifiers all``, fp16, d64/128/256, both arches, triton 3.9)
# found it spilling; MODIFIER_CAPS caps it there, as MODE_CAPS does for the modes:
# (kernel, arch family, dtype width, head-dim bucket, mode class) -> cap. The "" row (the
# modifiers alone) applies to every call with a modifier; a call with modes too then takes its
# class's row, else the "mask+" one (measured with every mode on: the most code). Kernel names
# are the kernels' own here (the fused backward spills where dK/dV does not). Each row says
# what the tile it replaces cost (stack B / local accesses in loops). Registers at the capped
# tiles: sm_80 fused d128 187, d256 254, dq d256 180; sm_90 fused d128 190, dq d128 227,
# dq d256 128. Known gap: the unaligned d200 fused backward on sm_80 with every mode and a
# modifier keeps 10 local accesses in its loop at 16x16 (the smallest tile; 4 warps: 77,
# 16 warps: 36).
MODIFIER_CAPS: Dict[Tuple[str, int, str, int, str], TileConfig] = {
    # 16x64 one stage with every mode: 56 B, 9 in the loop
    ("fused", 80, "16", 128, "mask+"): _T(16, 32, 8, 1),
    # 16x32 with every mode: 160 B, 34 in the loop
    ("fused", 80, "16", 256, "mask+"): _T(16, 16, 8, 1),
    # 16x64 8 warps, 1 or 2 stages: 104 B, 8 in the loop; 4 warps: 24 in the loop. 32 keys is
    # below wgmma's 64: mma.sync (MMA_SYNC_MODIFIERS_ON_SM90), as the masked dK/dV row
    ("fused", 90, "16", 128, ""): _T(16, 32, 8, 1),
    # 64x32 with every mode: 56 B outside the loop (one stage: 64 B, 2 in the loop)
    ("dq", 90, "16", 128, "mask+"): _T(64, 16, 8, 2),
    # 64x32 (the plain tile): d200 576 B, 3 in the loop; d256 255 registers and 8 B, no margin
    # for triton 3.6. 32x32: d256 180 registers, d200 64 B outside the loop (allowed unaligned)
    ("dq", 80, "16", 256, ""): _T(32, 32, 8, 1),
    # 64x16 (the plain tile): 72 B outside the loop; one stage 104 B, 1 in the loop; 16 rows,
    # below wgmma's 64: mma.sync
    ("dq", 90, "16", 256, ""): _T(16, 32, 8, 1),
}

# Variants with a score modifier allowed mma.sync on sm_90, as (kernel, dtype width, bucket):
# those whose MODIFIER_CAPS row takes fewer than 64 keys (fused) or rows (dq).
MMA_SYNC_MODIFIERS_ON_SM90 = frozenset({("fused", "16", 128), ("dq", "16", 256)})


def _modifier_caps(kernel: str, cfg: TileConfig, arch: int, width: str, bucket: int, cls: str) -> TileConfig:
    key = (kernel, 90 if arch >= 90 else 80, width, bucket)
    rows = [MODIFIER_CAPS.get(key + ("",))]
    if cls:
        rows.append(MODIFIER_CAPS.get(key + (cls,)) or MODIFIER_CAPS.get(key + ("mask+",)))
    for cap in rows:
        if cap is not None:
            cfg = TileConfig(min(cfg.block_m, cap.block_m), min(cfg.block_n, cap.block_n), cap.num_warps,
                             min(cfg.num_stages, cap.num_stages))
    return cfg


def fwd_config(d: int, dv: int, dtype: torch.dtype, arch: int = 80, **modes) -> TileConfig:
    return tile_config("fwd", d, dv, dtype, arch, **modes)


def desc_config(d: int, dv: int, dtype: torch.dtype, arch: int = 90) -> TileConfig:
    """Tiles of the descriptor forward: sm_90's row whatever ``arch`` (the kernel is for TMA;
    elsewhere only the interpreter runs it, in tests)."""
    return tile_config("fwd_desc", d, dv, dtype, 90)


def dq_config(d: int, dv: int, dtype: torch.dtype, arch: int = 80, **modes) -> TileConfig:
    return tile_config("dq", d, dv, dtype, arch, **modes)


def dkdv_config(d: int, dv: int, dtype: torch.dtype, arch: int = 80, **modes) -> TileConfig:
    return tile_config("dkdv", d, dv, dtype, arch, **modes)


def fused_config(d: int, dv: int, dtype: torch.dtype, arch: int = 80, **modes) -> TileConfig:
    return tile_config("fused", d, dv, dtype, arch, **modes)


# --- Which backward kernel (mhakern/kernels/attention_bwd.py) -------------------------------------------
# "deterministic": the fused kernel (5 products per tile; dQ's fp32 shares added in a fixed
# key-block order per row tile, so two runs give the same bits); "atomic": the same kernel with
# dQ added by atomics in arrival order (no waits; the bits depend on the schedule); "split": the
# dK/dV and dQ kernels (7 products; deterministic without atomics). Read once at import from
# MHAKERN_TRITON_BWD (default "deterministic"); tests set the attribute; attention_backward's
# ``bwd_mode`` overrides it per call.
BWD_MODES = ("deterministic", "atomic", "split")
BWD_MODE = os.environ.get("MHAKERN_TRITON_BWD", "deterministic")

# (dtype width, head-dim bucket) the fused kernel does not serve: the split kernels do, in every
# mode (see each entry's reason).
SPLIT_ONLY_BWD: frozenset = frozenset()


def bwd_kernel(d: int, dv: int, dtype: torch.dtype, mode=None) -> str:
    """The backward a call takes: ``mode`` (None: BWD_MODE), or "split" where SPLIT_ONLY_BWD
    says the fused kernel does not serve the head dims."""
    mode = BWD_MODE if mode is None else mode
    if mode not in BWD_MODES:
        raise ValueError(f"MHAKERN_TRITON_BWD / bwd_mode: expected one of {BWD_MODES}, got {mode!r}")
    width = "32" if dtype == torch.float32 else "16"
    if mode != "split" and (width, head_bucket(d, dv)) in SPLIT_ONLY_BWD:
        return "split"
    return mode


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


# --- The tensor-descriptor forward (mhakern/kernels/attention_fwd_desc.py) -----------------------------

# "auto": sm_90 and newer where the call qualifies; "1": every qualifying call, on any arch and
# under the interpreter (how the tests run it on CPU); "0": never. Read once at import from
# MHAKERN_TRITON_DESC; tests set the attribute.
DESC_MODE = os.environ.get("MHAKERN_TRITON_DESC", "auto")


@functools.lru_cache(maxsize=None)
def _descriptors_available() -> bool:
    try:
        import triton.language as tl
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return hasattr(tl, "make_tensor_descriptor")


def tma_compatible(t: torch.Tensor) -> bool:
    """Whether a (B, heads, L, dim) tensor meets TMA's rules: not empty, 16-byte aligned base,
    unit last stride, the other strides multiples of 16 bytes (dims of size one excepted: never stepped),
    and a padded head dim that fits a box (at most 256 elements)."""
    if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.numel() == 0:
        return False  # the launcher's own checks name what is wrong; TMA has no empty tensors
    size = t.element_size()
    if t.data_ptr() % 16 or t.stride(-1) != 1 or head_block(t.shape[-1]) > 256:
        return False
    return all(n <= 1 or (st * size) % 16 == 0 for n, st in zip(t.shape[:-1], t.stride()[:-1]))


# Split-K of the forward (long keys, few row tiles: decode). The Triton launcher owns its rule:
# split_rule below is the Python twin of csrc/capabilities.h's split_rule / split_limit (about
# two programs per multiprocessor; at least MIN_BLOCKS_PER_SPLIT key blocks per split, at most
# MAX_SPLITS, fp32 partials within MAX_SPLIT_WORKSPACE_BYTES), with the limits read from
# mhakern/_caps.py (generated from that header), so that the Triton forward splits without
# mhakern._C. tests/test_split_plan.py checks it against the compiled rule.
_SPLIT = _caps.TABLE["cuda"]["split"]
MIN_BLOCKS_PER_SPLIT: int = _SPLIT["min_blocks_per_split"]
MAX_SPLITS: int = _SPLIT["max_splits"]
MAX_SPLIT_WORKSPACE_BYTES: int = _SPLIT["max_workspace_bytes"]


def split_rule(programs: int, key_blocks: int, rows: int, dv: int, num_sms: int) -> int:
    """Key splits for a pass of ``programs`` programs, each stepping through ``key_blocks``
    blocks of keys, that writes ``rows`` output rows of ``dv`` fp32 values, on ``num_sms``
    multiprocessors: 1 when the programs fill the GPU (or there are none, or no
    multiprocessors); else enough splits for about two programs per multiprocessor, within the
    limits above, and at least 1."""
    if programs <= 0 or num_sms <= 0 or programs >= num_sms:
        return 1
    by_occupancy = -(-2 * num_sms // programs)
    row_bytes = rows * dv * 4
    limit = min(key_blocks // MIN_BLOCKS_PER_SPLIT, MAX_SPLIT_WORKSPACE_BYTES // max(row_bytes, 1), MAX_SPLITS)
    return max(1, min(by_occupancy, limit))


@functools.lru_cache(maxsize=4096)
def plan_fwd_splits(programs: int, key_blocks: int, rows: int, dv: int, num_sms: int) -> int:
    """Key splits for a forward of ``programs`` row-tile programs over ``key_blocks`` blocks of
    keys, ``rows`` = B * H * Lq output rows of ``dv`` values, on ``num_sms`` multiprocessors
    (:func:`split_rule`). Cached per shape: decode repeats its shapes."""
    return split_rule(programs, key_blocks, rows, dv, num_sms)


def desc_eligible(q, k, v, out, *, plain: bool = True) -> bool:
    """Whether the forward goes through tensor descriptors (mhakern/kernels/attention_fwd_desc.py).

    Only ``plain`` calls (no mode and no score modifier: those live in the pointer kernels; the
    launcher's ModeArgs says which a call has), in fp16/bf16 (fp32 multiplies with FMA, where
    TMA buys nothing), on sm_90 or newer (TMA) unless DESC_MODE forces it, with a triton that
    has descriptors and tensors TMA can address. Everything else takes the pointer path of
    attention_fwd.py.
    """
    if not plain or DESC_MODE == "0" or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if DESC_MODE != "1":
        if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] < 9:
            return False
    return _descriptors_available() and all(tma_compatible(t) for t in (q, k, v, out))
