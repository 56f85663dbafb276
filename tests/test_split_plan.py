"""Split-K: the Triton launcher owns its rule (mhakern/kernels/heuristics.py split_rule, the
Python twin of csrc/capabilities.h split_rule, its limits from mhakern/_caps.py), which agrees
with the compiled one (torch.ops.mhakern_C.plan_key_splits) and, with the CUDA forward's tiles,
plans what the CUDA host plans (torch.ops.mhakern_C.cuda_plan_splits); heuristics' limits are
the compiled ones."""
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


SHAPES = [(B, Hkv, g, Lq, Lk, D, sms)
          for B in (1, 3) for Hkv in (1, 8) for g in (1, 4) for Lq in (1, 5, 200)
          for Lk in (100, 4096, 10**6) for D in (64, 128) for sms in (0, 20, 132)]


def test_triton_rule_is_the_compiled_rule():
    # Over the grid below with Triton's own tiles (block_m x block_n in 16..128), and at the
    # edges of each limit (the workspace cap, MAX_SPLITS, no multiprocessors).
    cases = set()
    for B, Hkv, g, Lq, Lk, D, sms in SHAPES:
        for m, n in ((16, 64), (64, 32), (128, 128)):
            cases.add((B * Hkv * g * math.ceil(Lq / m), math.ceil(Lk / n), B * Hkv * g * Lq, D, sms))
    cases |= {(1, 10**6, 2**22, 128, 132), (1, 10**6, 2**18, 128, 132), (1, 10**6, 1, 128, 10**4),
              (0, 10, 1, 64, 132), (4, 3 * heuristics.MIN_BLOCKS_PER_SPLIT, 4, 128, 132), (1, 0, 0, 0, 8)}
    splits = set()
    for args in sorted(cases):
        want = torch.ops.mhakern_C.plan_key_splits(*args)
        assert heuristics.split_rule(*args) == want, args
        splits.add(want)
    assert {1, heuristics.MAX_SPLITS} <= splits and len(splits) > 5  # the rule's branches, not only "1"


def test_triton_and_cuda_plan_the_same_splits():
    cuda = _caps()
    decode = cuda["decode"]
    splits = set()
    for B, Hkv, g, Lq, Lk, D, sms in SHAPES:
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
