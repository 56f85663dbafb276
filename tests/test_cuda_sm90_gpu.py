"""GPU tests of the sm_90a family (csrc/cuda/sm90/), on a compute capability 9.0 device only.

On such a device the cuda backend's forward runs on the sm90 family (wgmma + TMA) wherever it
serves the call (csrc/cuda/attn_dispatch.h: choose_fwd_family) and the backward on the mma.sync
family, which then starts from the sm90 forward's out and lse. So the hard cases here check, on
the hardware, the layouts the CPU emulator could only take from the PTX ISA
(tests/test_cuda_sm90.py), and that the two families agree on lse. Skipped without such a
device (conftest.py skips the gpu mark without any device).
"""
from __future__ import annotations

import pytest
import torch

import mhakern
from attn_testing import HARD_CASES, case_id, check_against_reference, make_inputs

pytestmark = pytest.mark.gpu

SM90_DIMS = (64, 128)  # csrc/capabilities.h: MHK_SM90_FOR_EACH_HEAD_DIM with a backward (D 256: forward only, below)


@pytest.fixture
def hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a compute capability 9.0 device (sm_90a code runs there only)")
    why = mhakern.available_backends().get("cuda", "backend 'cuda' is not registered")
    if why is not None:
        pytest.skip(f"backend 'cuda' unavailable: {why}")


def _fn(q, k, v, **kw):
    return mhakern.attention(q, k, v, backend="cuda", **kw)


def _run(case, dtype, layout="bhld", scale_inputs=1.0, grads=True):
    B, H, Hkv, Lq, Lk, D, Dv, causal, kl = case
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, Dv, dtype=dtype, device="cuda", layout=layout,
                          scale_inputs=scale_inputs)
    kl_t = None if kl is None else torch.tensor(kl, device="cuda", dtype=torch.int32)
    check_against_reference(_fn, q, k, v, causal, kl_t, grads=grads)


SM90_HARD = [c for c in HARD_CASES if c[5] == c[6] and c[5] in SM90_DIMS]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", SM90_HARD, ids=case_id)
def test_sm90_hard_cases_on_hopper(hopper, case, dtype):
    _run(case, dtype)


@pytest.mark.parametrize(
    "case,layout,scale_inputs",
    [
        ((2, 8, 2, 700, 1500, 128, 128, True, (1500, 333)), "bhld", 1.0),
        ((1, 4, 4, 513, 2049, 64, 64, False, None), "blhd", 1.0),
        ((1, 2, 2, 300, 900, 128, 128, True, None), "blhd", 30.0),
        ((4, 32, 8, 1, 4096, 128, 128, False, (4096, 17, 0, 2000)), "bhld", 1.0),  # decode: split-K
    ],
    ids=["gqa-causal-kl", "long-blhd", "large-logits", "decode-split-k"],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_sm90_pipeline_shapes_on_hopper(hopper, case, layout, scale_inputs, dtype):
    _run(case, dtype, layout=layout, scale_inputs=scale_inputs)


# Head dim 256: the sm90 forward only (no backward kernel on either family), so no gradient.
D256_CASES = [c[:5] + (256, 256) + c[7:] for c in HARD_CASES if c[3] in (1, 17, 19, 37, 113) and c[5] == c[6]]
D256_CASES += [(1, 1, 1, 300, 1000, 256, 256, True, None), (4, 16, 2, 1, 3000, 256, 256, False, (3000, 5, 0, 1777))]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", D256_CASES, ids=case_id)
def test_sm90_d256_forward_on_hopper(hopper, case, dtype):
    B, H, Hkv, Lq, Lk, D, Dv, causal, kl = case
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, Dv, dtype=dtype, device="cuda", requires_grad=False)
    kl_t = None if kl is None else torch.tensor(kl, device="cuda", dtype=torch.int32)
    check_against_reference(_fn, q, k, v, causal, kl_t, grads=False)


@pytest.mark.parametrize("D", [64, 128, 256])
def test_sm90_keys_past_a_length_may_hold_garbage_on_hopper(hopper, D):
    # The tile that straddles a key length brings in the keys past it; the kernel zeroes their
    # values (a NaN/inf there leaked through 0 * inf before).
    q, k, v = make_inputs(2, 4, 2, 9, 300, D, dtype=torch.bfloat16, device="cuda", requires_grad=False)
    kl = torch.tensor([170, 300], device="cuda")
    clean = mhakern.attention(q, k, v, key_lengths=kl, backend="cuda")
    k[0, :, 170:] = float("nan")
    v[0, :, 170:] = float("inf")
    assert torch.equal(mhakern.attention(q, k, v, key_lengths=kl, backend="cuda"), clean)


@pytest.mark.parametrize("splits", [2, 7])
def test_sm90_forced_split_k_on_hopper(hopper, splits):
    prev = torch.ops.mhakern_C.cuda_force_splits(splits)
    try:
        _run((2, 4, 2, 37, 1100, 128, 128, True, (1100, 90)), torch.bfloat16, grads=False)
    finally:
        torch.ops.mhakern_C.cuda_force_splits(prev)
