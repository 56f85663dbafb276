"""GPU tests of the sm_90a family (csrc/cuda/sm90/), on a compute capability 9.0 device only.

On such a device the cuda backend's forward runs on the sm90 family (wgmma + TMA) wherever it
serves the call (csrc/cuda/common/attn_dispatch.h: choose_fwd_family). The sm90 backward is opt-in
until this file has passed on a 9.0 GPU (csrc/capabilities.h: kSm90BwdByDefault): every test
here opts in (the ``hopper`` fixture), so the hard cases check, on the hardware, the layouts the
CPU emulator could only take from the PTX ISA (tests/test_cuda_sm90.py, test_cuda_sm90_bwd.py)
for both passes. Skipped without such a device (conftest.py skips the gpu mark without any
device).
"""
from __future__ import annotations

import os

import pytest
import torch

import mhakern
from attn_testing import HARD_CASES, case_id, check_against_reference, make_inputs
from packed_cache_testing import check_packed

pytestmark = pytest.mark.gpu

SM90_DIMS = (64, 128)  # csrc/capabilities.h: MHK_SM90_FOR_EACH_HEAD_DIM with a backward (D 256: forward only, below)


@pytest.fixture
def hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a compute capability 9.0 device (sm_90a code runs there only)")
    why = mhakern.available_backends().get("cuda", "backend 'cuda' is not registered")
    if why is not None:
        pytest.skip(f"backend 'cuda' unavailable: {why}")
    # The sm90 backward is opt-in until verified here (capabilities.h: kSm90BwdByDefault); a
    # backward family set in the environment (MHAKERN_CUDA_BWD_FAMILY: the device check's
    # sm90_fwd step runs the forward's tests on the mma.sync backward) is kept.
    prev = torch.ops.mhakern_C.cuda_force_bwd_family(os.environ.get("MHAKERN_CUDA_BWD_FAMILY") or "auto")
    try:
        yield
    finally:
        torch.ops.mhakern_C.cuda_force_bwd_family(prev)


def _fn(q, k, v, **kw):
    return mhakern.attention(q, k, v, backend="cuda", **kw)


def _run(case, dtype, layout="bhld", scale_inputs=1.0, grads=True):
    B, H, Hkv, Lq, Lk, D, Dv, causal, kl = case
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, Dv, dtype=dtype, device="cuda", layout=layout,
                          scale_inputs=scale_inputs)
    kl_t = None if kl is None else torch.tensor(kl, device="cuda", dtype=torch.int32)
    check_against_reference(_fn, q, k, v, causal, kl_t, grads=grads)


SM90_HARD = [c for c in HARD_CASES if c.D == c.Dv and c.D in SM90_DIMS]


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
D256_CASES = [c._replace(D=256, Dv=256) for c in HARD_CASES if c.Lq in (1, 17, 19, 37, 113) and c.D == c.Dv]
D256_CASES += [(1, 1, 1, 300, 1000, 256, 256, True, None), (4, 16, 2, 1, 3000, 256, 256, False, (3000, 5, 0, 1777))]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", D256_CASES, ids=case_id)
def test_sm90_d256_forward_on_hopper(hopper, case, dtype):
    B, H, Hkv, Lq, Lk, D, Dv, causal, kl = case
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, Dv, dtype=dtype, device="cuda", requires_grad=False)
    kl_t = None if kl is None else torch.tensor(kl, device="cuda", dtype=torch.int32)
    check_against_reference(_fn, q, k, v, causal, kl_t, grads=False)


# D 256 with gradients: the sm90 forward, then the mma.sync family's D 256 backward (its fused
# kernel: the only one at that head dim, capabilities.h bwd_only_head_dims).
D256_BWD_CASES = [(2, 4, 2, 113, 300, 256, 256, True, (300, 77)), (1, 2, 1, 37, 37, 256, 256, False, None)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", D256_BWD_CASES, ids=case_id)
def test_sm90_d256_backward_on_hopper(hopper, case, dtype):
    _run(case, dtype)


# Packed sequences (attention_varlen): the sm90 forward serves them unsplit
# (capabilities.h kSm90FwdFeatures); their backward is the mma.sync family's (kSm90BwdFeatures:
# none). Lengths: an empty sequence, one token, sequences longer than a 128-row tile and than a
# key tile, Lq_s != Lk_s both ways.
@pytest.mark.parametrize("D,dtype", [(128, torch.bfloat16), (64, torch.float16)], ids=["d128-bf16", "d64-fp16"])
def test_sm90_packed_forward_on_hopper(hopper, D, dtype):
    check_packed("cuda", [300, 0, 1, 700, 129], [257, 5, 1, 900, 64], 8, 2, D, dtype, "cuda")


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


# ---------------------------------------------------------------------------------------------
# The sm90 backward (csrc/cuda/sm90/attn_bwd_sm90_kernel.cuh): with the opt-in of the ``hopper``
# fixture the plain backward calls of the hard cases above run on it; here the shapes
# that exercise its pipelines, determinism, split dQ keys, and hidden keys that hold NaN.
# ---------------------------------------------------------------------------------------------

SM90_BWD_DIMS = (64, 128)  # csrc/capabilities.h: MHK_SM90_BWD_FOR_EACH_HEAD_DIM


@pytest.mark.parametrize(
    "case,layout",
    [
        ((2, 8, 2, 45, 700, 128, 128, True, (700, 0)), "bhld"),     # GQA rows straddling heads, kl 0
        ((2, 8, 2, 300, 1000, 64, 64, True, (1000, 333)), "blhd"),  # kl inside a dQ key tile
        ((1, 4, 1, 900, 300, 128, 128, True, None), "bhld"),        # Lq > Lk: rows without keys
        ((1, 2, 2, 1100, 1100, 64, 64, False, None), "blhd"),       # rings wrap many times
    ],
    ids=["gqa-straddle-kl0", "kl-in-tile-blhd", "rows-without-keys", "long"],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("bwd_family", ["auto", "mma_sync"])
def test_sm90_backward_shapes_on_hopper(hopper, case, layout, dtype, bwd_family):
    # "auto": the sm90 backward (these are plain calls); "mma_sync": that family forced
    # (cuda_force_bwd_family), what sm_80-89 devices run, on the same shapes.
    prev = torch.ops.mhakern_C.cuda_force_bwd_family(bwd_family)
    try:
        _run(case, dtype, layout=layout)
    finally:
        torch.ops.mhakern_C.cuda_force_bwd_family(prev)


def _bwd_op(dout, q, k, v, out, lse, scale, causal, kl):
    return torch.ops.mhakern_C.bwd(dout, q, k, v, out, lse, scale, causal, kl, None, 0.0, 0, False, -1, -1, False)[:3]


@pytest.mark.parametrize("D", SM90_BWD_DIMS)
def test_sm90_backward_is_deterministic_on_hopper(hopper, D):
    q, k, v = make_inputs(2, 8, 2, 333, 777, D, D, dtype=torch.bfloat16, device="cuda", requires_grad=False)
    out, lse = torch.ops.mhakern_C.fwd(q, k, v, D**-0.5, True, None, None, 0.0, 0, False, -1, -1)
    dout = torch.randn_like(out)
    a = _bwd_op(dout, q, k, v, out, lse, D**-0.5, True, None)
    b = _bwd_op(dout, q, k, v, out, lse, D**-0.5, True, None)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("splits", [3])
def test_sm90_backward_forced_split_dq_on_hopper(hopper, splits):
    prev = torch.ops.mhakern_C.cuda_force_splits(splits)
    try:
        _run((2, 4, 2, 37, 1100, 128, 128, True, (1100, 90)), torch.bfloat16)
    finally:
        torch.ops.mhakern_C.cuda_force_splits(prev)


def test_sm90_backward_hidden_keys_never_leak_on_hopper(hopper):
    # K holds NaN and V inf past key_lengths; out and lse come from the reference on the visible keys,
    # so that only the backward is under test. Hidden keys get zero gradients, the rest stay finite.
    from mhakern import reference

    B, H, Hkv, Lq, Lk, D = 2, 4, 2, 100, 500, 128
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, D, dtype=torch.float16, device="cuda", requires_grad=False)
    kl = torch.tensor([300, 37], dtype=torch.int32, device="cuda")
    kc, vc = k.clone(), v.clone()
    for bb, n in enumerate(kl.tolist()):
        k[bb, :, n:] = float("nan")
        v[bb, :, n:] = float("inf")
        kc[bb, :, n:] = 0
        vc[bb, :, n:] = 0
    o64, lse = reference.attention_forward(q.double(), kc.double(), vc.double(), D**-0.5, True, kl, upcast=True)
    out, lse = o64.to(q.dtype), lse.float().contiguous()
    dout = torch.randn_like(out)
    dq, dk, dv = _bwd_op(dout, q, k, v, out, lse, D**-0.5, True, kl)
    assert torch.isfinite(dq).all()
    for bb, n in enumerate(kl.tolist()):
        assert torch.isfinite(dk[bb, :, :n]).all() and torch.isfinite(dv[bb, :, :n]).all()
        assert (dk[bb, :, n:] == 0).all() and (dv[bb, :, n:] == 0).all()
