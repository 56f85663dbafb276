"""The cpu kernels' bf16 variant (issue 35): Q.K^T and P.V on bf16 operands through vdpbf16ps
(AVX512-BF16) or its bit-exact software model, chosen by ``MHAKERN_CPU_ISA``.

* the model of one vdpbf16ps step, and of the rounding into bf16 pairs (vcvtne2ps2bf16),
  against hand-computed values (every machine) and, where the CPU has the instructions, against
  the instructions themselves on random bits, every class of value;
* the dispatch: which kernels bf16 inputs run under each value of ``MHAKERN_CPU_ISA``;
* the conformance cases (hard cases, modes, fully masked rows, NaN in hidden keys) in bf16 on
  the model always and on the instruction where present, by the tolerance rule;
* the model against the instruction on whole attention calls, forward and backward (bit for
  bit), and the variant's determinism at 1 and 2 threads.
"""
from __future__ import annotations

import os
import struct

import pytest
import torch

import mhakern
from mhakern._cpuinfo import cpu_flags
from attn_testing import HARD_CASES, case_id, check_against_reference, make_inputs

WHY = mhakern.available_backends().get("cpu", "backend 'cpu' is not registered")
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"cpu backend unavailable: {WHY}")




def _ops():
    from mhakern.backends.cpu_backend import load

    load()
    return torch.ops.mhakern_C


def _has_hw() -> bool:
    if WHY is not None:
        return False
    from mhakern.backends.cpu_backend import kernel_isa

    return "avx512_bf16" in cpu_flags() and kernel_isa() == "AVX512"


HW = _has_hw()
NO_HW = "this CPU has no AVX512-BF16 (or ATen's capability is below AVX512): the model runs instead"
VARIANTS = ["avx512bf16_model"] + (["avx512bf16"] if HW else [])


@pytest.fixture
def variant(request, monkeypatch):
    monkeypatch.setenv("MHAKERN_CPU_ISA", request.param)
    return request.param


def _bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _bf(x: float) -> int:
    """bf16 bits of a float that is exactly a bf16."""
    b = _bits(x)
    assert b & 0xFFFF == 0, x
    return b >> 16


def _pair(even: float, odd: float) -> int:
    v = _bf(even) | (_bf(odd) << 16)
    return v - (1 << 32) if v >= 1 << 31 else v


def _lanes(cases, variant):
    """cases: (acc, (a_even, a_odd), (b_even, b_odd)); one vdpbf16ps step each."""
    n = 64
    acc = torch.zeros(n, dtype=torch.float32)
    a = torch.zeros(n, dtype=torch.int32)
    b = torch.zeros(n, dtype=torch.int32)
    for i, (c, (a0, a1), (b0, b1)) in enumerate(cases):
        acc[i] = c
        a[i] = _pair(a0, a1)
        b[i] = _pair(b0, b1)
    return _ops().cpu_bf16_dot_lanes(acc, a, b, variant)[: len(cases)].tolist()


TINY = 2.0 ** -126  # the smallest normal float
DENORMAL_BF16 = 2.0 ** -130  # a bf16 denormal (bits 0x0008)

# acc, (a_even, a_odd), (b_even, b_odd) -> the instruction's result (Intel SDM, VDPBF16PS).
DOT_CASES = [
    ((1.0, (2.0, 3.0), (4.0, 5.0)), 24.0),
    # Odd product first, one rounding per step: 1 + 2^-24 ties to 1, twice; one rounding of the
    # sum (1 + 2^-23) or the even one first would differ.
    ((1.0, (2.0 ** -12, 2.0 ** -12), (2.0 ** -12, 2.0 ** -12)), 1.0),
    # Odd 2^-24 first (a tie: stays 1), then even 3 * 2^-25 (up to 1 + 2^-23); the even one
    # first would give 1 + 2^-23, then a tie up to 1 + 2^-22.
    ((1.0, (3.0 * 2.0 ** -13, 2.0 ** -12), (2.0 ** -12, 2.0 ** -12)), 1.0 + 2.0 ** -23),
    # Denormal inputs read as zero (DAZ), bf16 operands and the accumulator alike.
    ((0.0, (DENORMAL_BF16, 0.0), (2.0 ** 100, 0.0)), 0.0),
    ((TINY / 4, (0.0, 0.0), (0.0, 0.0)), 0.0),
    # A denormal result flushes to zero (FTZ): 2^-64 * 2^-64 underflows.
    ((0.0, (0.0, 2.0 ** -64), (0.0, 2.0 ** -64)), 0.0),
    # ... and an exact product just above it is kept, and cancels exactly.
    ((-(2.0 ** -120), (0.0, 2.0 ** -60), (0.0, 2.0 ** -60)), 0.0),
    # Ties to even where the ulp is 2: 2^24 + 1 stays, (2^24 + 2) + 1 goes up to 2^24 + 4, and
    # so does (2^24 + 2) + 2 (odd, exact) + 1 (even, a tie at 2^24 + 5).
    ((2.0 ** 24, (1.0, 0.0), (1.0, 0.0)), 2.0 ** 24),
    ((2.0 ** 24 + 2.0, (1.0, 0.0), (1.0, 0.0)), 2.0 ** 24 + 4.0),
    ((2.0 ** 24 + 2.0, (1.0, 1.0), (1.0, 2.0)), 2.0 ** 24 + 4.0),
]


def test_model_of_one_dot_step_matches_the_manual():
    got = _lanes([c for c, _ in DOT_CASES], "avx512bf16_model")
    for (case, want), g in zip(DOT_CASES, got):
        assert _bits(g) == _bits(want), f"{case}: model gives {g!r}, the instruction's definition {want!r}"


@pytest.mark.skipif(not HW, reason=NO_HW)
def test_instruction_matches_the_manual_cases():
    got = _lanes([c for c, _ in DOT_CASES], "avx512bf16")
    for (case, want), g in zip(DOT_CASES, got):
        assert _bits(g) == _bits(want), f"{case}: vdpbf16ps gives {g!r}, expected {want!r}"


@pytest.mark.skipif(not HW, reason=NO_HW)
@pytest.mark.parametrize("spread", ["all_bits", "near_one"])
def test_model_is_bit_identical_to_the_instruction(spread):
    g = torch.Generator().manual_seed(35)
    n = 1 << 18
    if spread == "all_bits":  # every class: zeros, denormals, normals, inf, NaN
        a, b, c = (torch.randint(-2 ** 31, 2 ** 31 - 1, (n,), dtype=torch.int32, generator=g) for _ in range(3))
        acc = c.view(torch.float32)
    else:  # values of attention's size, where the roundings of the two steps matter most
        a, b = (torch.randn(n, 2, generator=g).bfloat16().view(torch.int16).to(torch.int32) & 0xFFFF for _ in range(2))
        a, b = (x[:, 0] | (x[:, 1] << 16) for x in (a, b))
        acc = torch.randn(n, generator=g)
    hw = _ops().cpu_bf16_dot_lanes(acc, a, b, "avx512bf16")
    model = _ops().cpu_bf16_dot_lanes(acc, a, b, "avx512bf16_model")
    same = (hw.view(torch.int32) == model.view(torch.int32)) | (hw.isnan() & model.isnan())
    bad = (~same).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{bad.numel()} of {n} lanes differ; first: acc {acc[bad[0]].item()!r} a {a[bad[0]].item():#x} "
        f"b {b[bad[0]].item():#x}: instruction {hw[bad[0]].item()!r}, model {model[bad[0]].item()!r}")


def _round_lanes(x, runs, variant):
    return _ops().cpu_bf16_round_lanes(x, runs, variant)


# x -> the bf16 bits vcvtne2ps2bf16 gives (Intel SDM, VCVTNE2PS2BF16): nearest even, a zero or
# denormal to the zero of its sign, a NaN quieted keeping its sign and top payload bits.
ROUND_CASES = [
    (0x3F808000, 0x3F80),  # 1 + 2^-8: a tie, stays even
    (0x3F818000, 0x3F82),  # a tie up to even
    (0x3F808001, 0x3F81),  # above the tie
    (0x00400000, 0x0000),  # a denormal to +0
    (0x80000001, 0x8000),  # a negative denormal to -0
    (0x00800000, 0x0080),  # the smallest normal stays
    (0x7F7FFFFF, 0x7F80),  # the largest float rounds to inf
    (0xFF800000, 0xFF80),  # -inf
    (0x7F800001, 0x7FC0),  # a signalling NaN quieted
    (0xFFA12345, 0xFFE1),  # its sign and top payload bits kept
]


def _floats(bits):
    return torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits], dtype=torch.int32).view(torch.float32)


@pytest.mark.parametrize("runs", [False, True])
def test_model_of_the_rounding_matches_the_manual(runs):
    n = 64
    xs = [c for c, _ in ROUND_CASES]
    want = [w for _, w in ROUND_CASES]
    lo = _floats(xs + [0] * (n - len(xs)))
    hi = _floats(list(reversed(xs)) + [0x3F800000] * (n - len(xs)))
    x = torch.stack([lo, hi], 1).flatten() if runs else torch.cat([lo, hi])
    got = _round_lanes(x, runs, "avx512bf16_model")[: len(xs)].tolist()
    for i, g in enumerate(got):
        g &= 0xFFFFFFFF
        assert (g & 0xFFFF, g >> 16) == (want[i], want[len(xs) - 1 - i]), f"lane {i}: {g:#010x}"


@pytest.mark.skipif(not HW, reason=NO_HW)
@pytest.mark.parametrize("runs", [False, True])
def test_rounding_model_is_bit_identical_to_the_instruction(runs):
    g = torch.Generator().manual_seed(36)
    n = 1 << 18
    x = torch.randint(-2 ** 31, 2 ** 31 - 1, (2 * n,), dtype=torch.int32, generator=g)
    x[: n // 4] = torch.randint(0, 1 << 24, (n // 4,), dtype=torch.int32, generator=g) + 0x3F000000  # near 1: ties
    x = x.view(torch.float32)
    hw = _round_lanes(x, runs, "avx512bf16")
    model = _round_lanes(x, runs, "avx512bf16_model")
    bad = (hw != model).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} of {n} lanes differ; first lane {bad[0].item()}"


# ---------------------------------------------------------------------------------------------
# Dispatch


def test_dispatch_follows_mhakern_cpu_isa(monkeypatch):
    from mhakern.backends.cpu_backend import kernel_isa

    ops = _ops()
    base = kernel_isa()
    monkeypatch.delenv("MHAKERN_CPU_ISA", raising=False)
    assert ops.cpu_bf16_kernel_isa() == ("AVX512BF16" if HW else base)
    monkeypatch.setenv("MHAKERN_CPU_ISA", "avx512bf16_model")
    assert ops.cpu_bf16_kernel_isa() == f"{base}_BF16MODEL"
    monkeypatch.setenv("MHAKERN_CPU_ISA", "fp32")
    assert ops.cpu_bf16_kernel_isa() == base
    monkeypatch.setenv("MHAKERN_CPU_ISA", "avx512bf16")
    if HW:
        assert ops.cpu_bf16_kernel_isa() == "AVX512BF16"
    else:
        with pytest.raises(RuntimeError, match="avx512bf16_model"):
            ops.cpu_bf16_kernel_isa()
    monkeypatch.setenv("MHAKERN_CPU_ISA", "avx9")
    with pytest.raises(ValueError, match="MHAKERN_CPU_ISA: expected one of"):
        ops.cpu_bf16_kernel_isa()
    # Other dtypes never see it.
    q = torch.randn(1, 1, 4, 16)
    assert mhakern.attention(q, q, q, backend="cpu").dtype == torch.float32


@pytest.mark.parametrize("variant", VARIANTS, indirect=True)
def test_variant_runs_its_own_products(variant, monkeypatch):
    """The bf16 products round P (and dS) to bf16: the variant's results differ from the fp32
    products' (so the switch reaches both kernels), by no more than bf16's rounding."""
    q, k, v, do, causal, kw = _inputs((1, 2, 2, 64, 200, 64, 64, False, {}))
    mine = _fwd_bwd(q, k, v, do, causal, kw)
    monkeypatch.setenv("MHAKERN_CPU_ISA", "fp32")
    plain = _fwd_bwd(q, k, v, do, causal, kw)
    for name, a, b in zip(NAMES, mine, plain):
        if name == "lse":
            continue  # the scores' products differ only in order: lse may agree
        assert not torch.equal(a, b), f"{name}: the bf16 products gave the fp32 products' bits"
        assert (a.float() - b.float()).abs().max() < 5e-2 * max(1.0, b.float().abs().max().item()), name


# ---------------------------------------------------------------------------------------------
# The conformance cases in bf16, by the tolerance rule


def _run(*a, **kw):
    return mhakern.attention(*a, backend="cpu", **kw)


@pytest.mark.parametrize("case", HARD_CASES, ids=case_id)
@pytest.mark.parametrize("variant", VARIANTS, indirect=True)
def test_hard_cases(variant, case):
    B, H, Hkv, Lq, Lk, D, Dv, causal, kl = case
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, Dv, dtype=torch.bfloat16, device="cpu")
    kl_t = None if kl is None else torch.tensor(kl)
    check_against_reference(_run, q, k, v, causal, kl_t)


@pytest.mark.parametrize("variant", VARIANTS, indirect=True)
@pytest.mark.parametrize("layout", ["blhd", "large_logits"])
def test_strided_and_large_logits(variant, layout):
    if layout == "blhd":
        q, k, v = make_inputs(2, 4, 2, 37, 113, 64, 64, dtype=torch.bfloat16, device="cpu", layout="blhd")
        check_against_reference(_run, q, k, v, True, None)
    else:
        q, k, v = make_inputs(1, 2, 2, 40, 70, 32, 32, dtype=torch.bfloat16, device="cpu", scale_inputs=30.0)
        check_against_reference(_run, q, k, v, False, None, large_logits=True)


def _mode_cases():
    import test_conformance as tc

    return tc


@pytest.mark.parametrize("mode", list(_mode_cases().MODE_CASES))
@pytest.mark.parametrize("variant", VARIANTS, indirect=True)
def test_modes(variant, mode):
    tc = _mode_cases()
    tc.test_modes("cpu", torch.bfloat16, mode)


@pytest.mark.parametrize(
    "check",
    ["test_fully_masked_rows_zero_output_and_gradient", "test_nan_in_a_causally_hidden_key_reaches_only_the_rows_that_see_it",
     "test_nan_value_of_a_causally_hidden_key_reaches_only_the_rows_that_see_it",
     "test_nan_in_a_visible_key_gives_nan_out_lse_and_gradients", "test_inf_in_a_visible_value_propagates"])
@pytest.mark.parametrize("variant", VARIANTS, indirect=True)
def test_rows_and_nan_rules(variant, check):
    getattr(_mode_cases(), check)("cpu", torch.bfloat16)


@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("variant", VARIANTS, indirect=True)
def test_nan_in_a_key_hidden_by_key_lengths(variant, where):
    _mode_cases().test_nan_in_a_key_hidden_by_key_lengths_changes_nothing("cpu", torch.bfloat16, where)


# ---------------------------------------------------------------------------------------------
# Bit for bit: the model against the instruction, and across thread counts

# (B, H, Hkv, Lq, Lk, D, Dv, causal, kwargs): a split key range (few rows, long keys), decode
# with GQA, odd head dims and lengths, a strided K that is read in place, a paged-like gather,
# and whole unmasked tiles (64 rows, key blocks of 128, 128 and 40), where the instruction's
# backward runs its fused score tiles (all three tile heights) and the model the separate steps.
WHOLE_CASES = [
    (1, 2, 1, 3, 3000, 64, 64, False, {}),
    (2, 8, 2, 1, 300, 64, 64, True, {}),
    (1, 2, 2, 77, 131, 63, 33, True, {}),
    (2, 4, 4, 130, 257, 64, 64, False, {"window": (50, 7)}),
    (1, 4, 2, 65, 129, 32, 48, True, {"softcap": 5.0}),
    (1, 2, 1, 100, 296, 48, 32, False, {}),
    (1, 1, 1, 128, 128, 64, 32, False, {}),  # a score the fused tile once rounded as one fma with lse
]


def _inputs(case, seed=0, layout="bhld"):
    B, H, Hkv, Lq, Lk, D, Dv, causal, kw = case
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, Dv, dtype=torch.bfloat16, device="cpu", layout=layout, seed=seed)
    do = torch.randn(B, H, Lq, Dv, generator=torch.Generator().manual_seed(seed + 1)).bfloat16()
    return q, k, v, do, causal, kw


def _fwd_bwd(q, k, v, do, causal, kw):
    """out, lse, dq, dk, dv."""
    for x in (q, k, v):
        x.grad = None
    out, lse = mhakern.attention(q, k, v, causal=causal, backend="cpu", return_lse=True, **kw)
    out.backward(do)
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


NAMES = ("out", "lse", "dq", "dk", "dv")


@pytest.mark.skipif(not HW, reason=NO_HW)
@pytest.mark.parametrize("case", range(len(WHOLE_CASES)))
def test_model_and_instruction_give_the_same_attention(case, monkeypatch):
    q, k, v, do, causal, kw = _inputs(WHOLE_CASES[case], layout="blhd" if case % 2 else "bhld")
    res = {}
    for var in ("avx512bf16", "avx512bf16_model"):
        monkeypatch.setenv("MHAKERN_CPU_ISA", var)
        res[var] = _fwd_bwd(q, k, v, do, causal, kw)
    for name, a, b in zip(NAMES, res["avx512bf16"], res["avx512bf16_model"]):
        assert torch.equal(a, b), f"{name}: the model and the instruction differ"


@pytest.mark.parametrize("case", [0, 1, 3])
@pytest.mark.parametrize("variant", VARIANTS, indirect=True)
def test_deterministic_at_1_and_2_threads(variant, case):
    q, k, v, do, causal, kw = _inputs(WHOLE_CASES[case], seed=3)
    saved = torch.get_num_threads()
    res = []
    try:
        for t in (1, 2, 1):
            torch.set_num_threads(t)
            res.append(_fwd_bwd(q, k, v, do, causal, kw))
    finally:
        torch.set_num_threads(saved)
    for got in res[1:]:
        for name, a, b in zip(NAMES, res[0], got):
            assert torch.equal(a, b), f"{name} differs between 1 and 2 threads"


# ---------------------------------------------------------------------------------------------
# Packed sequences and KV caches (forward reads of K and V through page tables and row indices)


@pytest.mark.parametrize("variant", VARIANTS, indirect=True)
def test_packed_sequences(variant):
    from packed_cache_testing import check_packed

    check_packed("cpu", [5, 0, 70, 17], [9, 3, 70, 150], 4, 2, 64, torch.bfloat16, "cpu")


@pytest.mark.parametrize("kind", ["paged", "cache_batch_idx"])
@pytest.mark.parametrize("variant", VARIANTS, indirect=True)
def test_kv_cache(variant, kind):
    from packed_cache_testing import check_kvcache

    # Pages of 16 tokens: every key block of 128 crosses pages (gathered), odd head dim 63.
    check_kvcache("cpu", kind, 3, 8, 2, 2, 256, [256, 37, 1], 63, torch.bfloat16, "cpu")
    check_kvcache("cpu", kind, 2, 4, 4, 5, 160, [160, 77], 64, torch.bfloat16, "cpu", page_size=32)
