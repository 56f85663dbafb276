"""Triton backend against the float64 reference (forward and backward), by the tolerance rule.

Without a GPU this runs the kernels through Triton's interpreter on CPU tensors (conftest sets
TRITON_INTERPRET=1), fp32 and fp16; bf16 is left to the GPU tests (the interpreter's bf16
tl.dot is wrong). Shapes stay small: the interpreter executes every program in Python.
"""
import pytest
import torch

import mhakern
from attn_testing import HARD_CASES, case_id, check_against_reference, make_inputs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERP_DTYPES = (torch.float32, torch.float16)
pytestmark = pytest.mark.skipif(
    mhakern.available_backends().get("triton", "absent") is not None,
    reason=f"triton backend unavailable: {mhakern.available_backends().get('triton', 'absent')}",
)


def triton_attention(*a, **kw):
    return mhakern.attention(*a, backend="triton", **kw)


@pytest.mark.parametrize("dtype", INTERP_DTYPES, ids=str)
@pytest.mark.parametrize("case", HARD_CASES, ids=case_id)
def test_hard_cases(case, dtype):
    B, H, Hkv, Lq, Lk, D, Dv, causal, kl = case
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, Dv, dtype=dtype, device=DEVICE)
    kl_t = None if kl is None else torch.tensor(kl, device=DEVICE)
    check_against_reference(triton_attention, q, k, v, causal, kl_t)


@pytest.mark.parametrize("dtype", INTERP_DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_strided_blhd_inputs(dtype, causal):
    q, k, v = make_inputs(2, 4, 2, 23, 31, 64, dtype=dtype, device=DEVICE, layout="blhd")
    assert not q.is_contiguous() and q.stride(-1) == 1
    check_against_reference(triton_attention, q, k, v, causal, torch.tensor([31, 9], device=DEVICE))


@pytest.mark.parametrize("dtype", INTERP_DTYPES, ids=str)
def test_large_logits_do_not_overflow(dtype):
    # Inputs scaled by 30 (fp16: by 8, so q and k stay representable): scores in the thousands.
    s = 30.0 if dtype == torch.float32 else 8.0
    q, k, v = make_inputs(1, 2, 2, 33, 47, 64, dtype=dtype, device=DEVICE, scale_inputs=s)
    check_against_reference(triton_attention, q, k, v, True, None, large_logits=True)


@pytest.mark.parametrize("D", [16, 24, 64, 80, 96, 128])
def test_head_dims(D):
    q, k, v = make_inputs(1, 2, 1, 19, 21, D, device=DEVICE)
    check_against_reference(triton_attention, q, k, v, False, None)


@pytest.mark.parametrize("Lq,n_rep", [(1, 20), (3, 8), (1, 64)])
def test_decode_packs_query_heads_of_a_kv_head(Lq, n_rep):
    from mhakern.kernels.attention_fwd import launch_geometry
    from mhakern.kernels.heuristics import fwd_config

    B, Hkv, Lk, D = 3, 2, 45, 64
    cfg = fwd_config(D, D, torch.float32)
    hpp, bm, grid = launch_geometry(B, n_rep * Hkv, Hkv, Lq, cfg.block_m)
    # One program per (row tile, KV head, batch element): each reads its keys once for the group.
    assert hpp == n_rep and grid[1] == Hkv
    q, k, v = make_inputs(B, n_rep * Hkv, Hkv, Lq, Lk, D, device=DEVICE)
    check_against_reference(triton_attention, q, k, v, True, torch.tensor([45, 0, 17], device=DEVICE))


def test_trainer_shape_mqa_one_query_per_head():
    # The memorization trainer's call: H query heads, one shared context (MQA), Lq = 1.
    q, k, v = make_inputs(16, 20, 1, 1, 32, 64, device=DEVICE)
    check_against_reference(triton_attention, q, k, v, False, None)


def test_dv_differs_from_d_and_tiny_dims():
    q, k, v = make_inputs(2, 2, 2, 9, 13, 40, 1, device=DEVICE)  # the paper's d_v = 1
    check_against_reference(triton_attention, q, k, v, False, None)


def test_backward_is_deterministic():
    q, k, v = make_inputs(2, 4, 1, 37, 53, 32, device=DEVICE)
    grads = []
    for _ in range(2):
        for x in (q, k, v):
            x.grad = None
        triton_attention(q, k, v, causal=True).pow(2).sum().backward()
        grads.append([x.grad.clone() for x in (q, k, v)])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_fully_masked_rows_zero_output_and_gradient():
    q, k, v = make_inputs(2, 2, 2, 8, 5, 16, device=DEVICE)
    out, lse = triton_attention(q, k, v, causal=True, key_lengths=torch.tensor([0, 5], device=DEVICE), return_lse=True)
    assert torch.all(out[0] == 0) and torch.all(torch.isneginf(lse[0]))
    assert torch.all(out[1, :, :3] == 0) and torch.all(torch.isneginf(lse[1, :, :3]))
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.all(q.grad[0] == 0) and torch.all(q.grad[1, :, :3] == 0)
    assert torch.all(k.grad[0] == 0) and torch.all(v.grad[0] == 0)


def test_head_dim_over_limit_is_refused_with_reason():
    q, k, v = make_inputs(1, 1, 1, 2, 2, 300, device=DEVICE, requires_grad=False)
    with pytest.raises(ValueError, match="triton: head dim 300 exceeds 256"):
        triton_attention(q, k, v)
    # auto still serves it (falls back)
    assert mhakern.attention(q, k, v).shape == (1, 1, 2, 300)


def test_auto_never_picks_the_interpreter():
    if DEVICE == "cuda":
        pytest.skip("interpreter-only check")
    from mhakern import backends

    q, k, v = make_inputs(1, 2, 2, 4, 4, 16, requires_grad=False)
    assert backends.select("auto", q, k, v, False, None).name != "triton"
