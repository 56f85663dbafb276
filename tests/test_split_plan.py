"""The split-K rule is written once (csrc/capabilities.h split_rule): the Triton launcher's planner
(mhakern/kernels/heuristics.py) and the CUDA host's (torch.ops.mhakern_C.cuda_plan_splits) give
the same splits for the same tiles, and heuristics' limits are the compiled ones."""
from __future__ import annotations

import json
import math

import pytest
import torch

from mhakern import _extension
from mhakern.kernels import heuristics

pytestmark = pytest.mark.skipif(_extension.load() is None, reason="mhakern._C is not built")


def _caps():
    return json.loads(torch.ops.mhakern_C.capabilities())["cuda"]


def test_limits_are_the_compiled_ones():
    split = _caps()["split"]
    assert (heuristics.MIN_BLOCKS_PER_SPLIT, heuristics.MAX_SPLITS, heuristics.MAX_SPLIT_WORKSPACE_BYTES) == (
        split["min_blocks_per_split"], split["max_splits"], split["max_workspace_bytes"])


def test_triton_and_cuda_plan_the_same_splits():
    cuda = _caps()
    decode = cuda["decode"]
    shapes = [(B, Hkv, g, Lq, Lk, D, sms)
              for B in (1, 3) for Hkv in (1, 8) for g in (1, 4) for Lq in (1, 5, 200)
              for Lk in (100, 4096, 10**6) for D in (64, 128) for sms in (0, 20, 132)]
    splits = set()
    for B, Hkv, g, Lq, Lk, D, sms in shapes:
        # The tiles the mma.sync forward plans with (capabilities.h fwd_plan_tiles): the decode
        # kernel's for few packed rows, else the main kernel's.
        if g * Lq <= decode["max_rows"]:
            m, n = decode["tiles"][str(D)][:2]
        else:
            m, n = cuda["tiles"][str(D)]["fwd"]
        want = torch.ops.mhakern_C.cuda_plan_splits(B, Hkv, g, Lq, Lk, D, sms)
        programs = B * Hkv * math.ceil(g * Lq / m)
        got = heuristics.plan_fwd_splits(programs, math.ceil(Lk / n), B * Hkv * g * Lq, D, sms)
        assert got == want, (B, Hkv, g, Lq, Lk, D, sms)
        splits.add(got)
    assert len(splits) > 3  # the grid reaches the rule's branches, not only "1"
