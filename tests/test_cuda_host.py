"""Host-side tests of the cuda backend: everything that can be checked without a GPU.

* The reasons ``available_backends()["cuda"]`` gives (torch without CUDA, extension without
  CUDA, no device), the dispatch decisions of ``supports`` and the split-K planner.
* The kernels themselves, through the CPU emulation (tests/cuda_emulator_harness.py builds it
  and wraps it): the emulated kernels go through the same tolerance rule against the float64
  reference as every backend. What emulation cannot show (timing, register limits, whether the
  hardware matches the documented layouts) is left to tests/test_cuda.py on a GPU.

The run builds all eight instantiations and the two backward-only ones of D 256
(``EMU_INSTANCES``; the fused backward's D 256 has no mma.sync forward, the reference's stands in
for it, see ``Emulator.forward``); a build may leave some out, and the emulator then reports
them as not compiled in. The tests that use the ``deferred`` fixture run under the emulator's
seeded random schedule (one seed per test, derived from a session seed: ``MHK_EMU_SEED`` pins
it, and a failing test prints it); the emulator's own checks are in tests/test_cuda_emulator.py.
"""
from __future__ import annotations

import ctypes

import pytest
import torch

import mhakern
from mhakern import backends
from mhakern.backends import cuda_backend
from attn_testing import case_id, check_against_reference, make_inputs
from cuda_emulator_harness import (
    DTYPE_FOR_D,
    EMU_INSTANCES,
    HEAD_DIMS,
    SMEM_LIMIT,
    SUPPORTED_HARD,
    UNSUPPORTED_HARD,
    _compiled_table,
    _FakeCudaTensor,
    _fresh_backend,
    _make_emulator,
    _real_table,
    check_cuda_build_report,
    emulated_attention,
    full_cuda_build_report,
    padded_empty,
    use_random_schedule,
)

# ---------------------------------------------------------------------------------------------
# The kernels on the CPU emulation
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def emu(request):
    return _make_emulator(request, EMU_INSTANCES)


@pytest.fixture
def deferred(emu, request):
    """emu under the seeded random schedule (the test's own seed); fixed again afterwards."""
    emu.defer_async = True
    use_random_schedule(emu, request.node.nodeid)
    yield emu
    emu.schedule(None)
    emu.defer_async = True


def _run(emu, case, dtype, splits=1, bwd_splits=1, layout="bhld", scale_inputs=1.0, scale=None, seed=0):
    B, H, Hkv, Lq, Lk, D, Dv, causal, kl = case
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, Dv, dtype=dtype, layout=layout, scale_inputs=scale_inputs, seed=seed)
    kl_t = None if kl is None else torch.tensor(kl, dtype=torch.int32)
    check_against_reference(emulated_attention(emu, splits, bwd_splits), q, k, v, causal, kl_t, scale=scale)


@pytest.mark.parametrize("case", SUPPORTED_HARD, ids=case_id)
def test_emulated_kernels_hard_cases(deferred, case):
    _run(deferred, case, DTYPE_FOR_D[case[5]])


@pytest.mark.parametrize(
    "case,layout,scale_inputs",
    [
        # several query tiles and key blocks (pipelining over 4 key blocks), strided (B, L, H, D)
        ((1, 2, 1, 130, 200, 64, 64, True, None), "blhd", 1.0),
        # GQA: a group's packed rows (4 heads x 37) straddle tiles and heads, causal, lengths
        ((2, 8, 2, 37, 90, 96, 96, True, (90, 41)), "bhld", 1.0),
        # large logits: exact softmax must not overflow
        ((1, 2, 2, 40, 70, 32, 32, False, None), "blhd", 30.0),
        ((1, 2, 1, 33, 65, 128, 128, True, None), "bhld", 30.0),
    ],
    ids=["multiblock-blhd", "gqa-straddle", "large-logits-d32", "large-logits-d128"],
)
def test_emulated_kernels_shapes(deferred, case, layout, scale_inputs):
    _run(deferred, case, DTYPE_FOR_D[case[5]], layout=layout, scale_inputs=scale_inputs)


def test_emulated_decode_packs_query_heads(deferred):
    # Lq = 1, 16 query heads over 2 KV heads: each group's 8 rows share one tile.
    _run(deferred, (3, 16, 2, 1, 150, 64, 64, False, (150, 1, 77)), torch.bfloat16)
    _run(deferred, (2, 16, 1, 3, 100, 128, 128, True, None), torch.bfloat16)


@pytest.mark.parametrize("splits,bwd_splits", [(3, 2), (5, 4)])
def test_emulated_split_k_combines_through_lse(deferred, splits, bwd_splits):
    # Causal with short key lengths leaves some splits with no visible key (lse -inf partials).
    _run(deferred, (2, 4, 2, 5, 300, 64, 64, True, (300, 70)), torch.bfloat16, splits, bwd_splits)
    _run(deferred, (1, 4, 4, 3, 260, 32, 32, False, (0,)), torch.float16, splits, bwd_splits)


def test_emulated_immediate_async_copies(emu):
    # cp.async data landing at once (instead of at the wait) exposes a missing barrier before a
    # stage is overwritten; deferred landing (the other tests) exposes reads before the wait.
    emu.defer_async = False
    try:
        _run(emu, (1, 2, 1, 130, 200, 64, 64, True, None), torch.bfloat16)
        _run(emu, (2, 4, 2, 20, 150, 96, 96, False, (150, 9)), torch.float16, splits=2, bwd_splits=2)
    finally:
        emu.defer_async = True


def test_emulated_hidden_keys_are_never_read(deferred):
    # Keys at or past key_lengths[b] may hold garbage: NaN there must not reach any result.
    B, H, Lq, Lk, D = 2, 2, 9, 80, 64
    q, k, v = make_inputs(B, H, H, Lq, Lk, D, dtype=torch.bfloat16, requires_grad=False)
    kl = torch.tensor([50, 80], dtype=torch.int32)
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[0, :, 50:] = float("nan")
    v_bad[0, :, 50:] = float("inf")
    fn = emulated_attention(deferred)
    for x in (q, k_bad, v_bad):
        x.requires_grad_(True)
    out, lse = fn(q, k_bad, v_bad, key_lengths=kl, return_lse=True)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all()
    assert torch.isfinite(k_bad.grad).all() and torch.isfinite(v_bad.grad).all()
    assert (k_bad.grad[0, :, 50:] == 0).all() and (v_bad.grad[0, :, 50:] == 0).all()
    ref = emulated_attention(deferred)(q.detach(), k, v, key_lengths=kl)
    assert torch.equal(out.detach(), ref)


def test_emulated_kernels_clamp_out_of_range_key_lengths(deferred):
    # The host refuses such lengths where it can read them; where it cannot (CUDA-graph capture)
    # the kernels clamp them into [0, Lk]: never a read outside k and v (which the NaN padding
    # around every emulated tensor would turn into NaN results).
    q, k, v = make_inputs(3, 4, 2, 9, 40, 32, dtype=torch.float16)
    fn = emulated_attention(deferred)
    bad = torch.tensor([41, -3, 2**31 - 1], dtype=torch.int32)
    clamped = bad.clamp(0, 40)
    out, lse = fn(q, k, v, causal=True, key_lengths=bad, return_lse=True)
    dout = torch.randn(out.shape).to(out.dtype)
    got = torch.autograd.grad(out, (q, k, v), dout)
    q2, k2, v2 = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    out2, lse2 = fn(q2, k2, v2, causal=True, key_lengths=clamped, return_lse=True)
    want = torch.autograd.grad(out2, (q2, k2, v2), dout)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    for a, b in zip(got, want):
        assert torch.equal(a, b) and not torch.isnan(a).any()


def test_emulated_fully_masked_rows_are_zero_with_zero_gradient(deferred):
    # Causal with Lq > Lk: the first Lq - Lk rows see no key; key_lengths 0 hides every key.
    q, k, v = make_inputs(2, 2, 2, 70, 20, 32, dtype=torch.float16)
    kl = torch.tensor([20, 0], dtype=torch.int32)
    out, lse = emulated_attention(deferred)(q, k, v, causal=True, key_lengths=kl, return_lse=True)
    (out.float() * torch.randn(out.shape)).sum().backward()
    dead = torch.zeros(2, 2, 70, dtype=torch.bool)
    dead[0, :, :50] = True
    dead[1] = True
    assert torch.isneginf(lse[dead]).all() and torch.isfinite(lse[~dead]).all()
    assert (out[dead] == 0).all() and (q.grad[dead] == 0).all()
    assert (k.grad[1] == 0).all() and (v.grad[1] == 0).all()
    for g in (q.grad, k.grad, v.grad):
        assert not torch.isnan(g).any()


def test_emulator_catches_an_out_of_bounds_write():
    # The guard itself must be able to fail.
    view, guard = padded_empty(torch.zeros(1, 2, 3, 16, dtype=torch.float16))
    guard.check("untouched")
    view.as_strided((1,), (1,), view.storage_offset() + 16).fill_(1.0)  # the pad after row 0
    with pytest.raises(AssertionError, match="outside the tensor"):
        guard.check("poked")


def test_emulator_reports_a_missing_instantiation(request):
    # A build with one instantiation (linked from the cached objects) reports the others.
    partial = _make_emulator(request, ("fp16_d32",))
    q, k, v = make_inputs(1, 1, 1, 4, 4, 64, dtype=torch.bfloat16, requires_grad=False)
    with pytest.raises(RuntimeError, match="run_attn_fwd_bf16_d64 is not compiled into this emulator build"):
        emulated_attention(partial)(q, k, v)


@pytest.mark.parametrize("scale", [-0.3, 0.0])
def test_emulated_negative_and_zero_scale(deferred, scale):
    # A negative scale flips which keys dominate (the mask must still win); zero gives uniform
    # weights over the visible keys.
    _run(deferred, (1, 2, 2, 100, 30, 96, 96, True, None), torch.float16, scale=scale)


# ---------------------------------------------------------------------------------------------
# Decode: the mma.sync forward's decode kernel (group * Lq <= the table's max_rows, no attn_mask
# or dropout): one 16-row block per CTA, the warps split each key tile, merge at the end
# ---------------------------------------------------------------------------------------------


def _decode_tiles(emu, D):
    out = (ctypes.c_int * 7)()
    assert emu.lib.mhk_emu_decode_tiles(D, out) == 0
    return dict(m=out[0], n=out[1], stages=out[2], warp_n=out[3], warps=out[4], smem=out[5], max_rows=out[6])


def _plan_mma(emu, D, B, Hkv, group, Lq, Lk, sms, mask_or_dropout=False):
    decode = ctypes.c_int(-1)
    s = emu.lib.mhk_emu_fwd_plan_mma(D, B, Hkv, group, Lq, Lk, sms, int(mask_or_dropout), ctypes.byref(decode))
    return s, bool(decode.value)


# (B, H, Hkv, Lq, Lk, D, Dv, causal, key_lengths), forced splits: every case runs the decode kernel
# (group * Lq <= 32). Key lengths of 0 and 1, lengths that end inside a warp's slice of a tile,
# MQA, group 8 and 32 (two row blocks), Lq > 1 with bottom-right causal (rows that see no key
# when a length is below Lq), every head dim.
DECODE_CASES = [
    ((3, 32, 8, 1, 300, 128, 128, False, (300, 0, 77)), torch.bfloat16, 1),
    ((3, 32, 8, 1, 300, 128, 128, False, (300, 0, 77)), torch.bfloat16, 3),
    ((2, 8, 1, 1, 200, 64, 64, True, (200, 1)), torch.float16, 2),          # MQA, group 8
    ((1, 32, 1, 1, 260, 32, 32, False, (259,)), torch.bfloat16, 1),          # group 32: 2 row blocks
    ((2, 16, 2, 3, 150, 96, 96, True, (150, 2)), torch.float16, 4),          # 24 rows, dead rows
    ((1, 4, 4, 1, 700, 128, 128, True, None), torch.float16, 5),             # MHA decode, 5 splits
]


@pytest.mark.parametrize("case,dtype,splits", DECODE_CASES,
                         ids=[f"{case_id(c)}-{str(d)[6:]}-s{s}" for c, d, s in DECODE_CASES])
def test_emulated_decode_kernel_against_reference(deferred, case, dtype, splits):
    B, H, Hkv, Lq, Lk, D, Dv, causal, kl = case
    assert _plan_mma(deferred, D, B, Hkv, H // Hkv, Lq, Lk, 132)[1], "the case must run the decode kernel"
    _run(deferred, case, dtype, splits=splits)


def test_emulated_decode_large_logits_and_window(deferred):
    # Logits in the hundreds (exact softmax across the warps' merge), then a window and top-left
    # alignment, which the decode kernel masks itself (only attn_mask / dropout leave it).
    _run(deferred, (2, 8, 2, 1, 333, 64, 64, False, (333, 100)), torch.bfloat16, splits=2, scale_inputs=30.0)
    q, k, v = make_inputs(2, 8, 2, 2, 260, 32, dtype=torch.float16, requires_grad=False)
    kl = torch.tensor([260, 90], dtype=torch.int32)
    for window, align in (((40, 0), "bottom_right"), ((7, 70), "top_left")):
        check_against_reference(emulated_attention(deferred, 3), q, k, v, False, kl, grads=False, window=window,
                                causal_align=align)


def test_emulated_decode_hidden_keys_hold_garbage(deferred):
    # NaN keys and inf values past a length, in a tile a split and a warp's slice straddle.
    B, H, Hkv, Lq, Lk, D = 2, 8, 2, 1, 200, 128
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, dtype=torch.bfloat16, requires_grad=False)
    kl = torch.tensor([75, 200], dtype=torch.int32)
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[0, :, 75:] = float("nan")
    v_bad[0, :, 75:] = float("inf")
    for splits in (1, 2):
        fn = emulated_attention(deferred, splits)
        out, lse = fn(q, k_bad, v_bad, key_lengths=kl, return_lse=True)
        ref, ref_lse = fn(q, k, v, key_lengths=kl, return_lse=True)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        assert torch.equal(out, ref) and torch.equal(lse, ref_lse)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("Lq", [1, 10], ids=["decode-kernel", "main-kernel"])
def test_emulated_nan_and_inf_follow_the_contract(deferred, splits, Lq):
    # docs/contract.md "NaN and inf" through the decode kernel's warp merge, the main kernel's
    # epilogue (4 x 10 packed rows) and the split combine: a NaN query row or a NaN visible key
    # makes out and lse NaN (a NaN score leaves the running max alone, so neither may read a
    # max of -inf or a sum that is not > 0 as "saw nothing"); a NaN query of a row with no
    # visible key stays 0 / -inf; an inf value makes its output column non-finite only.
    B, H, Hkv, Lk, D = 2, 8, 2, 300, 64
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, dtype=torch.float16, requires_grad=False)
    kl = torch.tensor([0, 300], dtype=torch.int32)
    fn = emulated_attention(deferred, splits)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    q2[0, 1] = float("nan")      # batch 0 sees no key
    q2[1, 2] = float("nan")      # query head 2 of batch 1: kv head 0
    k2[1, 1, 211, 5] = float("nan")  # kv head 1 (query heads 4..7), key 211: warp 1's slice of tile 3
    v2[1, 0, 37, 9] = float("inf")   # kv head 0 (query heads 0..3), column 9
    out, lse = fn(q2, k2, v2, key_lengths=kl, return_lse=True)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()
    assert torch.isnan(out[1, 2]).all() and torch.isnan(lse[1, 2]).all()
    assert torch.isnan(out[1, 4:]).all() and torch.isnan(lse[1, 4:]).all()
    rest = out[1, [0, 1, 3]]
    assert not torch.isfinite(rest[..., 9]).any()
    assert torch.isfinite(rest[..., :9]).all() and torch.isfinite(rest[..., 10:]).all()
    assert torch.isfinite(lse[1, [0, 1, 3]]).all()


def test_emulated_decode_dead_rows_and_determinism(emu):
    # Key length 0 (every row dead: 0 and -inf), and the same call under the fixed schedule with
    # copies landing at once (a slot of the ring refilled before every warp is done with it would
    # show) and at the wait, and two random schedules (copies landing at random moments, warps
    # interleaved): bit-identical.
    q, k, v = make_inputs(3, 16, 2, 1, 400, 64, dtype=torch.bfloat16, requires_grad=False)
    kl = torch.tensor([0, 400, 131], dtype=torch.int32)
    results = []
    try:
        for seed, defer in ((None, False), (None, True), (11, True), (12345, True)):
            emu.schedule(seed)
            emu.defer_async = defer
            for splits in (1, 4):
                out, lse = emulated_attention(emu, splits)(q, k, v, key_lengths=kl, return_lse=True)
                results.append((splits, out.clone(), lse.clone()))
    finally:
        emu.schedule(None)
        emu.defer_async = True
    for splits, out, lse in results:
        assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()
        assert torch.isfinite(out[1:]).all() and torch.isfinite(lse[1:]).all()
        first = next(r for r in results if r[0] == splits)
        assert torch.equal(out, first[1]) and torch.equal(lse, first[2])
    check_against_reference(emulated_attention(emu, 4), q, k, v, False, kl, grads=False)


def test_emulated_decode_feeds_the_backward(deferred):
    # out and lse of the decode kernel are what the backward reads: gradients through it.
    _run(deferred, (2, 8, 2, 1, 140, 64, 64, True, (140, 33)), torch.float16, splits=2, bwd_splits=2)


@pytest.mark.parametrize("D", HEAD_DIMS)
def test_decode_config_is_the_capability_table(emu, D):
    t = _decode_tiles(emu, D)
    assert t["m"] == 16 and t["warps"] * t["warp_n"] == t["n"] and t["warp_n"] % 16 == 0
    assert t["smem"] <= SMEM_LIMIT and t["stages"] >= 2
    caps = cuda_backend.capabilities()
    if caps is not None:
        dec = caps["cuda"]["decode"]
        assert dec["tiles"][str(D)] == [t["m"], t["n"], t["stages"]]
        assert dec["max_rows"] == t["max_rows"] and dec["warps"] == t["warps"]


def test_decode_switch_and_plan(emu):
    # The switch: group * Lq up to max_rows, never with attn_mask or dropout.
    max_rows = _decode_tiles(emu, 128)["max_rows"]
    assert _plan_mma(emu, 128, 1, 8, 4, 1, 2**17, 132)[1]
    assert _plan_mma(emu, 128, 1, 1, max_rows, 1, 2**17, 132)[1]
    assert not _plan_mma(emu, 128, 1, 1, max_rows + 1, 1, 2**17, 132)[1]
    assert not _plan_mma(emu, 128, 1, 8, 4, 1, 2**17, 132, mask_or_dropout=True)[1]
    # The measured decode shapes, planned with the decode tiles (16 rows, 64 keys at D 128):
    # about two CTAs per SM, each split holding whole tiles and none empty.
    for B, Hkv, group, Lk in ((1, 8, 4, 2**17), (4, 4, 8, 2**16), (4, 4, 8, 2**20)):
        s, dec = _plan_mma(emu, 128, B, Hkv, group, 1, Lk, 132)
        tiles = -(-Lk // 64)
        ctas = B * Hkv * -(-group // 16)
        assert dec and s == min(-(-2 * 132 // ctas), tiles // 8, 128)
        assert (s - 1) * -(-tiles // s) < tiles
    caps = cuda_backend.capabilities()
    if caps is not None and caps["cuda"]["compiled"] is not None:
        plan = torch.ops.mhakern_C.cuda_plan_splits
        for args in ((1, 8, 4, 1, 2**17, 128, 132), (2, 1, 32, 1, 5000, 32, 80), (1, 2, 8, 8, 9000, 64, 132)):
            assert plan(*args) == _plan_mma(emu, args[5], *args[:5], args[6])[0]


# ---------------------------------------------------------------------------------------------
# Availability reasons
# ---------------------------------------------------------------------------------------------


def test_available_backends_reports_cuda_with_a_reason_here():
    av = mhakern.available_backends()
    assert "cuda" in av
    if torch.version.cuda is None:
        assert av["cuda"] is not None and "without CUDA" in av["cuda"]
    elif not torch.cuda.is_available():
        assert av["cuda"] is not None


def test_reason_torch_without_cuda(monkeypatch):
    be = _fresh_backend(monkeypatch, None, _compiled_table())
    why = be.unavailable()
    assert "built without CUDA" in why and "torch.version.cuda is None" in why


def test_reason_extension_missing(monkeypatch):
    be = _fresh_backend(monkeypatch, "13.0", None, ext_error="No module named 'mhakern._C'")
    why = be.unavailable()
    assert "mhakern._C" in why and "No module named" in why and "--no-build-isolation" in why


def test_reason_extension_built_without_cuda(monkeypatch):
    table = _compiled_table()
    table["cuda"]["compiled"] = False
    be = _fresh_backend(monkeypatch, "13.0", table)
    assert "built without its CUDA kernels" in be.unavailable()


def test_reason_no_device(monkeypatch):
    be = _fresh_backend(monkeypatch, "13.0", _compiled_table(), device=False)
    assert "no CUDA device" in be.unavailable()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert be.unavailable() is None


def test_reason_only_old_devices(monkeypatch):
    be = _fresh_backend(monkeypatch, "13.0", _compiled_table(), caps=((7, 5), (7, 0)))
    assert "compute capability 8.0 or newer (found 7.5, 7.0)" in be.unavailable()


def test_backend_reads_the_capability_table(monkeypatch):
    table = _compiled_table()
    be = _fresh_backend(monkeypatch, "13.0", table)
    assert be.unavailable() is None
    assert be.table == table["cuda"] and set(be._head_dims) == set(HEAD_DIMS)
    assert be.features == frozenset(table["cuda"]["features"])
    # A table that serves more is served: nothing about head dims is restated in Python (the
    # table Python reads is mhakern/_caps.py's, generated from csrc/capabilities.h).
    monkeypatch.setitem(cuda_backend._CUDA, "head_dims", [*HEAD_DIMS, 80])
    be2 = _fresh_backend(monkeypatch, "13.0", table)
    assert be2.unavailable() is None and be2.supports(*_qkv(D=80), False, None) is None


# ---------------------------------------------------------------------------------------------
# Dispatch decisions (tensor stand-ins on a pretend CUDA device: supports() reads only
# shapes, dtypes, devices)
# ---------------------------------------------------------------------------------------------


def _qkv(B=2, H=8, Hkv=2, Lq=128, Lk=256, D=64, Dv=None, dtype=torch.float16):
    Dv = D if Dv is None else Dv
    return (_FakeCudaTensor((B, H, Lq, D), dtype), _FakeCudaTensor((B, Hkv, Lk, D), dtype),
            _FakeCudaTensor((B, Hkv, Lk, Dv), dtype))


@pytest.fixture
def be(monkeypatch):
    b = _fresh_backend(monkeypatch, "13.0", _compiled_table())
    assert b.unavailable() is None
    b._caps = {0: (9, 0)}  # what unavailable() reads on an H100
    return b


@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_supports_fp16_bf16_and_every_compiled_head_dim(be, D, dtype):
    assert be.supports(*_qkv(D=D, dtype=dtype), True, None) is None


@pytest.mark.parametrize(
    "kw,needle",
    [
        (dict(dtype=torch.float32), "served by the triton backend"),
        (dict(dtype=torch.float64), "float16 or bfloat16"),
        (dict(D=80), "supported: " + ", ".join(map(str, HEAD_DIMS))),
        (dict(D=256), "head dim 256"),
        (dict(D=64, Dv=32), "differ"),
        (dict(Lk=2**30), "exceeds"),
        # 2^30 + 2 packed rows of one KV head: ceil_div over 32-bit rows would overflow near 2^31
        (dict(B=1, H=2, Hkv=1, Lq=2**29 + 1), "exceeds the cuda kernels' limit of 1073741824"),
    ],
)
def test_supports_refuses_with_a_reason(be, kw, needle):
    why = be.supports(*_qkv(**kw), False, None)
    assert why is not None and needle in why


def test_supports_refuses_cpu_tensors_and_old_gpus(be, monkeypatch):
    q = torch.zeros(1, 1, 4, 64, dtype=torch.float16)
    assert "needs CUDA tensors" in be.supports(q, q, q, False, None)
    be._caps = {0: (8, 0), 1: (7, 5)}
    assert be.supports(*_qkv(), False, None) is None  # the fake tensors live on cuda:0
    be._caps = {0: (7, 5)}
    assert "compute capability 7.5" in be.supports(*_qkv(), False, None)


def test_auto_picks_cuda_first_and_falls_back_with_its_reason(monkeypatch):
    be = backends.get("cuda")
    assert be.priority == 40 and be.priority > backends.get("reference").priority
    table = _compiled_table()["cuda"]
    monkeypatch.setattr(be, "unavailable", lambda: None)
    monkeypatch.setattr(be, "_caps", {0: (8, 0)})
    monkeypatch.setattr(be, "table", table)
    monkeypatch.setattr(be, "_dtypes", (torch.float16, torch.bfloat16))
    monkeypatch.setattr(be, "_head_dims", tuple(table["head_dims"]))
    monkeypatch.setattr(be, "_min_capability", tuple(table["min_capability"]))
    assert backends.select("auto", *_qkv(), False, None) is be
    # float32 and head dim 80: cuda says why, and auto moves on to another backend
    for kw in (dict(dtype=torch.float32), dict(D=80)):
        chosen = backends.select("auto", *_qkv(**kw), False, None)
        assert chosen is not be
        with pytest.raises(ValueError, match="backend='cuda' cannot serve"):
            backends.select("cuda", *_qkv(**kw), False, None)


@pytest.mark.parametrize("case", UNSUPPORTED_HARD, ids=case_id)
def test_hard_cases_outside_the_kernels_are_refused_not_guessed(be, case):
    B, H, Hkv, Lq, Lk, D, Dv, causal, kl = case
    assert be.supports(*_qkv(B, H, Hkv, Lq, Lk, D, Dv), causal, None) is not None


# ---------------------------------------------------------------------------------------------
# Split-K planning
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def split_table():
    return _real_table()["cuda"]["split"]


def test_plan_splits_no_split_when_query_tiles_fill_the_gpu(split_table):
    # 16 x 16 heads x 2048 rows / 64 = 8192 CTAs on 132 SMs
    assert cuda_backend.plan_splits(16, 16, 1, 2048, 2048, 128, 132) == 1


def test_plan_splits_long_key_decode_splits_the_keys(split_table):
    # MQA decode: 8 query heads share one KV head, Lq = 1: a single CTA per batch element.
    s = cuda_backend.plan_splits(1, 1, 8, 1, 2**20, 128, 132)
    assert s == split_table["max_splits"]
    s = cuda_backend.plan_splits(4, 2, 4, 1, 2**20, 64, 132)  # 8 CTAs
    assert s == 33  # ceil(2 * 132 / 8)


def test_plan_splits_keeps_enough_keys_per_split(split_table):
    # 640 keys = 10 blocks of 64: one split of at least 8 blocks
    assert split_table["min_blocks_per_split"] == 8
    assert cuda_backend.plan_splits(1, 1, 1, 1, 640, 64, 132) == 1
    assert cuda_backend.plan_splits(1, 1, 1, 1, 64 * 8 * 5, 64, 132) == 5


def test_plan_splits_caps_the_workspace(split_table):
    # 2^19 packed rows x 128 dims x 4 B = 256 MiB per split: the 1 GiB cap allows 4 splits
    # (a device with very many SMs would otherwise ask for more).
    rows = 64 * 2**13
    s = cuda_backend.plan_splits(1, 1, 64, 2**13, 2**29, 128, 10**9)
    assert s == 4
    assert s * rows * 128 * 4 <= split_table["max_workspace_bytes"]


@pytest.mark.parametrize("D", HEAD_DIMS)
def test_planner_tiles_match_the_compiled_configs(emu, D):
    # The kernels' FwdConfig / BwdConfig take their tiles from the table; the emulator build
    # reports what the compiled configs hold, the extension what the table says.
    out = (ctypes.c_int * 7)()
    assert emu.lib.mhk_emu_tiles(D, out) == 0
    tiles = _real_table()["cuda"]["tiles"][str(D)]
    assert tuple(tiles["fwd"]) == (out[0], out[1])
    assert tuple(tiles["dq"]) == (out[2], out[3])
    assert tuple(tiles["dkv"]) == (out[5], out[4])
    assert tuple(tiles["fwd_modes"]) == (out[0], out[6])


def test_plan_splits_uses_the_pass_tiles(split_table):
    # 8 query heads x 16 rows = 128 packed rows: one forward CTA (128 rows), two dq CTAs (64)
    # on 40 SMs: 2 x 40 CTAs wanted, so 80 splits of the one forward CTA, 40 of each dq CTA
    fwd = cuda_backend.plan_splits(1, 1, 8, 16, 2**16, 128, 40)
    dq = cuda_backend.plan_splits(1, 1, 8, 16, 2**16, 128, 40, backward=True)
    assert (fwd, dq) == (80, 40)


def test_plan_splits_rejects_bad_arguments(split_table):
    with pytest.raises(ValueError, match="num_sms"):
        cuda_backend.plan_splits(1, 1, 1, 1, 64, 64, -1)


# ---------------------------------------------------------------------------------------------
# The compile check (tools/check_cuda_build.py; CI runs it on every .cu for sm_80 and sm_90)
# ---------------------------------------------------------------------------------------------


@pytest.mark.cuda_build_report(full=False)
def test_compile_check_tool_on_one_file(cuda_build_check):
    # The rows of one source in the tool's report: the full check's (tests/test_cuda_build.py,
    # which this test runs after, tests/conftest.py) when it ran on these sources, else a check
    # of that one file for sm_80 (compiled once per sources digest either way:
    # cuda_emulator_harness.check_cuda_build_report).
    cache = cuda_build_check
    report = full_cuda_build_report(cache) or check_cuda_build_report(
        cache, ["--only", "fwd_fp16_d32", "--arch", "80", "--no-host", "--no-sm90", "-j", "1"], name="fwd_fp16_d32")
    assert report["returncode"] == 0, report["stdout"][-3000:] + report["stderr"][-3000:]
    kernels = {k["kernel"]: k for k in report["kernels"] if k["src"] == "attn_fwd_fp16_d32.cu" and k["arch"] == 80}
    # the plain forward, its twin for calls with attn_mask / dropout / score modifiers, the decode
    # kernel (few packed rows) and the split-K combine
    assert report["passed"] and set(kernels) == {"attn_fwd_kernel", "attn_fwd_modes_kernel", "attn_fwd_decode_kernel",
                                                 "attn_fwd_combine_kernel"}
    fwd = kernels["attn_fwd_kernel"]
    assert fwd["arch"] == 80 and 0 < fwd["regs"] <= 255 and fwd["spill_st"] == 0
    assert fwd["smem_dynamic"] > 0 and "attn_fwd_kernel" in report["stdout"]
    dec = kernels["attn_fwd_decode_kernel"]
    assert dec["spill_st"] == dec["spill_ld"] == dec["stack"] == 0 and dec["local_ins"] in (0, None)
    assert 0 < dec["smem_dynamic"] <= 99 * 1024


def test_views_the_kernels_cannot_read_in_place_are_copied():
    # The cuda backend hands the op 16-byte aligned rows: a contiguous view at an odd offset is
    # copied (contiguous() would return it as is; the first GPU run met that), aligned and
    # strided-but-aligned views pass through untouched. Pure tensor logic: checked on CPU tensors.
    from mhakern.backends.cuda_backend import _aligned

    base = torch.zeros(1, 2, 33, 64, dtype=torch.float16)
    odd = base.view(-1)[2 : 2 + 2 * 32 * 64].view(1, 2, 32, 64)
    assert odd.is_contiguous() and odd.data_ptr() % 16 != 0
    fixed = _aligned(odd)
    assert fixed.data_ptr() % 16 == 0 and torch.equal(fixed, odd) and fixed.data_ptr() != odd.data_ptr()
    aligned = torch.zeros(1, 2, 32, 64, dtype=torch.float16)
    assert _aligned(aligned) is aligned
    blhd = torch.zeros(1, 32, 2, 64, dtype=torch.float16).transpose(1, 2)  # (B, H, L, D) view
    assert _aligned(blhd) is blhd
    narrow = torch.zeros(1, 2, 32, 68, dtype=torch.float16)[..., 2:66]  # rows start 4 bytes in
    assert _aligned(narrow).data_ptr() % 16 == 0 and _aligned(narrow).is_contiguous()


def test_forward_only_head_dim_is_served_without_gradient_or_modes_on_hopper_only(monkeypatch):
    # D 256's forward is the sm_90a family's only (capabilities()["cuda"]["sm90"]["fwd_only_head_dims"]),
    # its backward the mma.sync family's fused kernel (["cuda"]["bwd"]["head_dims"]): served on
    # a 9.0 device of a build with the sm_90a pass, gradient or not, for calls without a mode
    # (the forward takes none); refused with the reason otherwise, so that auto falls back.
    table = _compiled_table()
    table["cuda"]["sm90"]["compiled"] = True
    be = _fresh_backend(monkeypatch, "13.0", table)
    assert be.unavailable() is None
    be._caps = {0: (9, 0)}
    assert 256 in table["cuda"]["sm90"]["fwd_only_head_dims"]
    assert be.supports(*_qkv(D=256), True, None) is None
    why = backends.missing_features(be, frozenset({"attn_mask"}), *_qkv(D=256))
    assert why is not None and "takes no attn_mask (its modes: varlen; asked: attn_mask)" in why
    assert backends.missing_features(be, frozenset({"attn_mask"}), *_qkv(D=128)) is None  # mma.sync has them
    q, k, v = _qkv(D=256)
    q.requires_grad = True  # a call that will need the backward: the fused mma.sync kernel's
    assert 256 in table["cuda"]["bwd"]["head_dims"]
    assert be.supports(q, k, v, True, None) is None
    with torch.no_grad():
        assert be.supports(q, k, v, True, None) is None
    # A table without that backward is refused with the reason.
    bwd_dims = [d for d in cuda_backend._CUDA["bwd"]["head_dims"] if d != 256]
    monkeypatch.setitem(cuda_backend._CUDA["bwd"], "head_dims", bwd_dims)
    be = _fresh_backend(monkeypatch, "13.0", table)
    assert be.unavailable() is None
    be._caps = {0: (9, 0)}
    assert "forward kernel only" in be.supports(q, k, v, True, None)
    be._caps = {0: (8, 0)}
    assert "served only by the sm_90a forward" in be.supports(*_qkv(D=256), True, None)
