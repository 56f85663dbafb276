"""The CUDA emulator's own checks (tests/cuda_emulator/), and the kernels under them.

The emulator (tests/cuda_emulator_harness.py builds it) runs the CUDA kernels' source on CPU fibers. Its
checks must be able to fail, so each one meets a toy kernel with the defect it claims to catch
(tests/cuda_emulator/emu_selftest.cpp) next to a correct twin:

* convergence: a ``.sync.aligned`` collective (mma, ldmatrix, shfl, vote, bar.warp.sync) reached
  from two program points, or with a partial member mask, and a ``__syncthreads`` reached from
  two program points, are errors naming the call sites;
* the seeded random schedule: shared-memory races that the fixed schedule (threads in order,
  cp.async landing at the wait) never exposes give wrong numbers under some seeds;
* the read guard: a cp.async from outside the registered tensors is an error, not a read;
* global memory: fp32 reductions landing late and blocks in flight together reorder a sum across
  blocks unless each block waits for its turn (acquire) and passes it on after its adds
  (release after a block barrier); each way of getting that wrong gives schedule-dependent
  bits, and a turn that never comes is reported as a deadlock.

Then the real kernels: every instantiation (both dtypes, every head dim) forward and backward
under a random schedule, the hard cases in the dtype tests/test_cuda_host.py does not use, several random schedules giving bit-identical results, and out-of-range
key lengths that must not make the kernels read outside k and v.

Seeds: the toy tests use fixed seeds (their outcome must not depend on the run); the kernel tests
derive theirs from the session seed (``MHK_EMU_SEED``, printed on failure with the rerun command).
``MHK_EMU_SEEDS`` sets how many random schedules the multi-seed test tries (default 3).
"""
from __future__ import annotations

import ctypes
import math
import os

import pytest
import torch

from attn_testing import HARD_CASES, case_id, check_against_reference, make_inputs, rule_check
from mhakern import reference
from mhakern.backends import Modes
from cuda_emulator_harness import (
    ALL_INSTANCES,
    BWD_ONLY_HEAD_DIMS,
    DTYPE_FOR_D,
    EMU_INSTANCES,
    SMEM_LIMIT,
    SUPPORTED_HARD,
    _make_emulator,
    _ptr,
    dispatched,
    mode_params,
    emu_test_seed,
    emulated_attention,
    padded,
    padded_empty,
    use_random_schedule,
)

TOY_SEEDS = range(1, 9)
N_SEEDS = int(os.environ.get("MHK_EMU_SEEDS", "3"))


@pytest.fixture(scope="module")
def emu(request):
    e = _make_emulator(request, EMU_INSTANCES)
    lib = e.lib
    lib.mhk_selftest_collectives.argtypes = [ctypes.c_int, ctypes.c_void_p]
    lib.mhk_selftest_race.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    lib.mhk_selftest_copy.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    lib.mhk_emu_guard_reads.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    lib.mhk_selftest_ordered_add.argtypes = [ctypes.c_int] * 3 + [ctypes.c_void_p] * 3
    lib.mhk_emu_set_defect.argtypes = [ctypes.c_int]
    lib.mhk_emu_fused_bwd_tiles.argtypes = [ctypes.c_int, ctypes.c_void_p]
    yield e
    e.schedule(None)
    lib.mhk_emu_guard_reads(0, None, None)


def _error(emu) -> str:
    return emu.lib.mhk_emu_last_error().decode()


def _collectives(emu, variant, seed=None):
    emu.schedule(seed)
    out = torch.full((128,), float("nan"))
    rc = emu.lib.mhk_selftest_collectives(variant, _ptr(out))
    return rc, out


# ---------------------------------------------------------------------------------------------
# Convergence of collectives and barriers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [None, 1, 2])
def test_convergent_collectives_pass(emu, seed):
    rc, out = _collectives(emu, 0, seed)
    assert rc == 0, _error(emu)
    # mma of ones over k = 16: 16; its neighbour's d[1]: 16; ballot(lane < 5): 5 bits
    assert torch.equal(out, torch.full((128,), 37.0))


@pytest.mark.parametrize("seed", [None, 3])
@pytest.mark.parametrize(
    "variant,needles",
    [
        (1, ["divergent warp collective", "mma.sync.aligned.m16n8k16.f16", "16 thread(s)",
             "lower_half_mma", "upper_half_mma"]),
        (3, ["divergent warp collective", "vote.sync.ballot", "lower_half_ballot", "upper_half_ballot"]),
        (2, ["shfl.sync.bfly: member mask 0x0000ffff", "collectives_body"]),
        (5, ["bar.warp.sync: member mask 0xfffffffe"]),
        (4, ["divergent barrier", "__syncthreads", "64 thread(s)", "first_warps_barrier", "last_warps_barrier"]),
        (6, ["deadlock in block 0", "64 threads have finished", "shfl.sync.bfly"]),
    ],
    ids=["mma-two-sites", "ballot-two-sites", "shfl-half-mask", "syncwarp-partial-mask", "syncthreads-two-sites",
         "lanes-exit-before-shfl"],
)
def test_divergence_and_partial_masks_are_errors_naming_the_site(emu, variant, needles, seed):
    rc, _ = _collectives(emu, variant, seed)
    msg = _error(emu)
    assert rc == 1
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    if seed is not None:
        assert f"seed {seed}" in msg


# ---------------------------------------------------------------------------------------------
# The random schedule finds races the fixed one hides
# ---------------------------------------------------------------------------------------------


def _race(emu, variant, seed, steps=6, values=None):
    emu.schedule(seed)
    # tile j holds j + 1 everywhere: the sum over tiles is 21 for 6 tiles, unless a stage was
    # overwritten before it was read
    src = torch.arange(1, steps + 1, dtype=torch.float16).repeat_interleave(1024)
    out = torch.full((128,), float("nan"))
    rc = emu.lib.mhk_selftest_race(variant, _ptr(src), steps, _ptr(out))
    assert rc == 0, _error(emu)
    if variant <= 1:
        want = torch.arange(128, dtype=torch.float32).clamp(min=1)  # buf[t - 1] = t
    else:
        want = torch.full((128,), float(steps * (steps + 1) // 2))
    if values is not None:
        values.append(out)
    return torch.equal(out, want)


@pytest.mark.parametrize("racy,fixed_twin", [(0, 1), (2, 3)], ids=["neighbour-store-no-barrier", "prefetch-overwrites-stage"])
def test_random_schedule_exposes_races_the_fixed_one_hides(emu, racy, fixed_twin):
    # The fixed schedule runs threads in order and lands copies at their wait: both races pass
    # unnoticed there (which is why the random schedule exists).
    assert _race(emu, racy, None)
    caught = [s for s in TOY_SEEDS if not _race(emu, racy, s)]
    assert caught, f"no seed of {list(TOY_SEEDS)} exposed the race"
    # a seed replays its interleaving exactly: the same wrong numbers again
    first, again = [], []
    _race(emu, racy, caught[0], values=first)
    _race(emu, racy, caught[0], values=again)
    assert torch.equal(first[0].view(torch.int32), again[0].view(torch.int32))  # NaN included
    # the corrected kernel passes every schedule
    assert _race(emu, fixed_twin, None)
    for s in TOY_SEEDS:
        assert _race(emu, fixed_twin, s), f"seed {s}: the race-free twin gave wrong numbers"


# ---------------------------------------------------------------------------------------------
# Read guard
# ---------------------------------------------------------------------------------------------


def _guard(emu, ranges):
    n = len(ranges)
    begin = (ctypes.c_ulonglong * max(n, 1))(*[b for b, _ in ranges])
    end = (ctypes.c_ulonglong * max(n, 1))(*[e for _, e in ranges])
    emu.lib.mhk_emu_guard_reads(n, begin, end)


def test_read_guard_stops_a_copy_outside_the_tensors(emu):
    emu.schedule(None)
    src = torch.arange(64 * 4, dtype=torch.int32)  # 64 chunks of 16 bytes
    base = src.data_ptr()
    try:
        _guard(emu, [(base, base + 32 * 16)])
        dst = torch.full((64 * 4,), -1, dtype=torch.int32)
        assert emu.lib.mhk_selftest_copy(_ptr(src), 32, _ptr(dst)) == 0, _error(emu)
        assert torch.equal(dst[:128], src[:128])
        dst.fill_(-1)
        assert emu.lib.mhk_selftest_copy(_ptr(src), 33, _ptr(dst)) == 1
        assert "outside every tensor the kernel may read (thread 32, block 0)" in _error(emu)
    finally:
        _guard(emu, [])
    assert emu.lib.mhk_selftest_copy(_ptr(src), 33, _ptr(dst)) == 0, _error(emu)


# ---------------------------------------------------------------------------------------------
# Global memory: fp32 reductions and acquire/release turns across concurrent blocks
# ---------------------------------------------------------------------------------------------
# Block b adds vals[b] (n floats) into acc as turn b of a counter (csrc/cuda/common/dq_accum.cuh through
# emu_selftest.cpp's ordered_add_body). The values span 2^-12 .. 2^12, so that almost any change
# in the order of the fp32 adds changes the bits of the sums.
ORDER_SEEDS = range(1, 17)
ORDER_BUGS = {1: "no order", 2: "ordering bug (a turn early)", 3: "early release (turn passed before the adds)",
              4: "release without the block barrier", 5: "relaxed flag (no release)"}


def _ordered_add(emu, variant, seed, blocks=6, n=40):
    emu.schedule(seed)
    g = torch.Generator().manual_seed(7)
    vals = (torch.rand(blocks, n, generator=g) - 0.5) * torch.exp2(torch.randint(-12, 13, (blocks, n), generator=g))
    acc = torch.zeros(n)
    sem = torch.zeros(1, dtype=torch.int32)
    rc = emu.lib.mhk_selftest_ordered_add(variant, blocks, n, _ptr(vals), _ptr(acc), _ptr(sem))
    in_order = torch.zeros(n)
    for b in range(blocks):  # float32 adds in block order
        in_order += vals[b]
    return rc, acc, in_order, int(sem.item())


def test_ordered_adds_are_bit_identical_under_every_schedule(emu):
    for seed in (None, *ORDER_SEEDS):
        rc, acc, in_order, sem = _ordered_add(emu, 0, seed)
        assert rc == 0, _error(emu)
        assert torch.equal(acc, in_order), f"seed {seed}: the ordered adds differ from block order"
        assert sem == 6
    emu.schedule(None)


@pytest.mark.parametrize("variant", sorted(ORDER_BUGS), ids=lambda v: ORDER_BUGS[v].split(" (")[0].replace(" ", "-"))
def test_a_broken_order_gives_schedule_dependent_sums(emu, variant):
    # The fixed schedule (one block at a time, adds landing at once) hides every one of these
    # defects; some random schedule (blocks in flight together, adds landing late) must not.
    rc, acc, in_order, _ = _ordered_add(emu, variant, None)
    assert rc == 0 and torch.equal(acc, in_order)
    differ = []
    for seed in ORDER_SEEDS:
        rc, acc, in_order, _ = _ordered_add(emu, variant, seed)
        assert rc == 0, _error(emu)
        assert torch.allclose(acc.double(), in_order.double(), rtol=1e-5, atol=1e-6)  # only the order differs
        if not torch.equal(acc, in_order):
            differ.append(seed)
    emu.schedule(None)
    assert differ, f"{ORDER_BUGS[variant]}: every random schedule summed in block order"


def test_a_turn_that_never_comes_is_a_deadlock(emu):
    for seed in (None, 3):
        rc, *_ = _ordered_add(emu, 6, seed)
        assert rc == 1 and "deadlock" in _error(emu)
    emu.schedule(None)


# ---------------------------------------------------------------------------------------------
# The kernels
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def scheduled(emu, request):
    use_random_schedule(emu, request.node.nodeid)
    yield emu
    emu.schedule(None)


def _dtype(inst):
    return torch.float16 if inst.startswith("fp16") else torch.bfloat16


@pytest.mark.parametrize("inst", ALL_INSTANCES)
def test_every_instantiation_forward_and_backward(scheduled, inst):
    # GQA with lengths and causal, several key blocks, split-K in both passes: every kernel of
    # the instantiation (forward, combine, delta, dK/dV, dQ, dQ reduce) runs.
    D = int(inst.split("_d")[1])
    q, k, v = make_inputs(2, 4, 2, 21, 140, D, dtype=_dtype(inst), layout="blhd", seed=D)
    kl = torch.tensor([140, 33], dtype=torch.int32)
    check_against_reference(emulated_attention(scheduled, 2, 2), q, k, v, True, kl)


@pytest.mark.parametrize("case", SUPPORTED_HARD, ids=case_id)
def test_hard_cases_in_the_other_dtype(scheduled, case):
    # tests/test_cuda_host.py runs the hard cases in one dtype per head dim (DTYPE_FOR_D); these
    # are the other four instantiations on the same cases.
    B, H, Hkv, Lq, Lk, D, Dv, causal, kl = case
    dtype = torch.bfloat16 if DTYPE_FOR_D[D] == torch.float16 else torch.float16
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, Dv, dtype=dtype)
    kl_t = None if kl is None else torch.tensor(kl, dtype=torch.int32)
    check_against_reference(emulated_attention(scheduled), q, k, v, causal, kl_t)


def _run_all(emu, q, k, v, kl, splits=1):
    fn = emulated_attention(emu, splits, splits)
    qq, kk, vv = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    out, lse = fn(qq, kk, vv, causal=True, key_lengths=kl, return_lse=True)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.dtype))
    return [out.detach(), lse, qq.grad, kk.grad, vv.grad]


def test_random_schedules_give_bit_identical_results(emu, request):
    # The kernels' arithmetic order is fixed per thread, so no interleaving may change a bit.
    q, k, v = make_inputs(1, 2, 1, 130, 200, 64, dtype=torch.bfloat16, layout="blhd", seed=3)
    kl = torch.tensor([190], dtype=torch.int32)
    emu.schedule(None)
    want = _run_all(emu, q, k, v, kl, splits=2)
    for i in range(N_SEEDS):
        seed = emu_test_seed(request.node.nodeid, str(i))
        use_random_schedule(emu, request.node.nodeid, str(i))
        try:
            got = _run_all(emu, q, k, v, kl, splits=2)
        finally:
            emu.schedule(None)
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
            assert torch.equal(a, b), f"{name} differs from the fixed schedule's under seed {seed}"


def _row_ranges(x: torch.Tensor):
    """[begin, end) byte ranges of every (b, h, i) row of a (B, H, L, D) view."""
    B, H, L, D = x.shape
    e = x.element_size()
    idx = torch.arange(B).view(B, 1, 1) * x.stride(0) + torch.arange(H).view(1, H, 1) * x.stride(1)
    idx = idx + torch.arange(L).view(1, 1, L) * x.stride(2)
    begins = x.data_ptr() + e * idx.reshape(-1)
    return [(int(b), int(b) + D * e) for b in begins]


def _guarded(emu, *tensors):
    ranges = []
    for t in tensors:
        ranges += _row_ranges(t)
    _guard(emu, ranges)


# The kernels clamp key_lengths[b] into [0, Lk] (csrc/cuda/common/attn_params.h, key_length_of): a
# value past Lk must never make the last key block read rows past the end of k and v (on a GPU:
# an illegal address), which the read guard turns into an error here.
@pytest.mark.parametrize("splits", [1, 2])
def test_out_of_range_key_lengths_never_read_outside_k_and_v(emu, splits):
    # Every row of every input is registered with the read guard, so a cp.async from anywhere
    # else (the pad columns, the spare row, past the buffer) is an error before it reads. The
    # results must be those of the clamped lengths: above Lk means Lk, below 0 means 0.
    emu.schedule(None)
    B, H, Lq, Lk, D = 3, 2, 9, 70, 64
    q, k, v = make_inputs(B, H, H, Lq, Lk, D, dtype=torch.bfloat16, requires_grad=False, seed=11)
    bad = torch.tensor([Lk + 1, Lk + 100, -7], dtype=torch.int32)
    clamped = torch.tensor([Lk, Lk, 0], dtype=torch.int32)
    qp, kp, vp = padded(q), padded(k), padded(v)
    scale = D**-0.5
    out, lse = emu.forward(qp, kp, vp, scale, True, clamped, splits)
    dout = padded(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.dtype))
    dq, dk, dv = emu.backward(dout, qp, kp, vp, out, lse, scale, True, clamped, splits)
    try:
        _guarded(emu, qp, kp, vp, out, dout)
        out_bad, lse_bad = emu.forward(qp, kp, vp, scale, True, bad, splits)
        grads_bad = emu.backward(dout, qp, kp, vp, out, lse, scale, True, bad, splits)
    finally:
        _guard(emu, [])
    assert torch.equal(out_bad, out) and torch.equal(lse_bad, lse)
    for name, a, b in zip(("dq", "dk", "dv"), grads_bad, (dq, dk, dv)):
        assert torch.equal(a, b), name


def test_read_guard_passes_the_kernels_in_range(emu):
    # The guard itself does not get in the kernels' way: in-range lengths read only the rows.
    emu.schedule(None)
    B, H, Lq, Lk, D = 2, 2, 9, 70, 32
    q, k, v = make_inputs(B, H, H, Lq, Lk, D, dtype=torch.float16, requires_grad=False, seed=12)
    kl = torch.tensor([Lk, 5], dtype=torch.int32)
    qp, kp, vp = padded(q), padded(k), padded(v)
    try:
        _guarded(emu, qp, kp, vp)
        out, lse = emu.forward(qp, kp, vp, D**-0.5, True, kl, 2)
    finally:
        _guard(emu, [])
    assert torch.isfinite(out).all()


# ---------------------------------------------------------------------------------------------
# The modes (docs/contract.md "Visibility"): top-left alignment and sliding windows
# ---------------------------------------------------------------------------------------------

# (B, H, Hkv, Lq, Lk, D, causal, key_lengths, causal_align, window, (splits, bwd_splits))
WINDOW_CASES = [
    # top-left causal, more queries than keys (rows past Lk see every key), lengths
    (2, 2, 1, 70, 40, 32, True, (40, 9), "top_left", None, (1, 1)),
    # top-left causal, fewer queries than keys: the key blocks past the last row's diagonal are skipped
    (1, 2, 2, 20, 150, 64, True, None, "top_left", None, (1, 1)),
    # left window only, bottom-right: blocks before the first row's window skipped
    (1, 2, 1, 50, 150, 64, False, None, "bottom_right", (30, -1), (1, 1)),
    # right window only, top-left, Lq > Lk: rows whose window starts past the keys see everything
    (1, 2, 2, 45, 30, 32, False, None, "top_left", (-1, 10), (1, 1)),
    # both sides, GQA with packed rows straddling heads, key lengths (one short)
    (2, 4, 2, 37, 90, 96, False, (90, 41), "bottom_right", (16, 8), (1, 1)),
    # window with causal (right becomes 0), top-left, D = 128
    (1, 2, 2, 40, 64, 128, True, None, "top_left", (20, 5), (1, 1)),
    # rows that see no key: top-left left window with Lq > Lk (rows i > Lk - 1 + 3), and the
    # diagonal-only window (0, 0)
    (1, 2, 2, 60, 20, 32, False, None, "top_left", (3, -1), (1, 1)),
    (1, 2, 1, 33, 70, 64, False, (70,), "bottom_right", (0, 0), (1, 1)),
    # split-K forced in both passes: decode with a window (most splits see no key) and a long
    # tile range cut into several splits
    (1, 4, 4, 3, 260, 32, False, None, "bottom_right", (40, 0), (3, 2)),
    (1, 2, 1, 24, 300, 64, True, (290,), "top_left", (-1, 200), (4, 3)),
]


def _window_id(c):
    B, H, Hkv, Lq, Lk, D, causal, kl, align, window, splits = c
    s = f"q{Lq}k{Lk}d{D}h{H}kv{Hkv}-{align}"
    s += "-causal" if causal else ""
    s += "" if window is None else f"-w{window[0]}_{window[1]}"
    s += "" if kl is None else "-kl"
    s += "" if splits == (1, 1) else f"-split{splits[0]}_{splits[1]}"
    return s


@pytest.mark.parametrize("case", WINDOW_CASES, ids=_window_id)
def test_top_left_and_windows_against_the_reference(scheduled, case):
    B, H, Hkv, Lq, Lk, D, causal, kl, align, window, (splits, bwd_splits) = case
    dtype = DTYPE_FOR_D[D]
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, dtype=dtype, layout="blhd" if D == 64 else "bhld", seed=Lq)
    kl_t = None if kl is None else torch.tensor(kl, dtype=torch.int32)
    check_against_reference(emulated_attention(scheduled, splits, bwd_splits), q, k, v, causal, kl_t,
                            causal_align=align, window=window)


@pytest.mark.parametrize("align,window,blocks", [
    # one query tile: rows 0..15 see keys up to 15 + 8 = 23, all in key block 0
    ("top_left", (8, 8), (0, 64)),
    # bottom-right: rows see keys [i + 284 - 20, i + 284], all in the last block (256..299)
    ("bottom_right", (20, 0), (256, 300)),
])
def test_hidden_key_blocks_are_never_read(emu, align, window, blocks):
    # Only the rows of k and v in the key blocks the window reaches are registered with the read
    # guard: reading (not merely masking) any other key block is an error, in the forward and in
    # both backward kernels (a dK/dV CTA whose keys no row sees writes zeros without reading).
    emu.schedule(None)
    B, H, Lq, Lk, D = 1, 2, 16, 300, 64
    q, k, v = make_inputs(B, H, H, Lq, Lk, D, dtype=torch.bfloat16, requires_grad=False, seed=21)
    modes = Modes.build(top_left=align == "top_left", window=window)
    qp, kp, vp = padded(q), padded(k), padded(v)
    scale = D**-0.5
    lo, hi = blocks
    want_out, want_lse = emu.forward(qp, kp, vp, scale, False, None, 1, modes)
    dout = padded(torch.randn(want_out.shape, generator=torch.Generator().manual_seed(3)).to(q.dtype))
    want = emu.backward(dout, qp, kp, vp, want_out, want_lse, scale, False, None, 1, modes)
    try:
        _guard(emu, _row_ranges(qp) + _row_ranges(want_out) + _row_ranges(dout)
               + _row_ranges(kp[:, :, lo:hi]) + _row_ranges(vp[:, :, lo:hi]))
        out, lse = emu.forward(qp, kp, vp, scale, False, None, 1, modes)
        got = emu.backward(dout, qp, kp, vp, want_out, want_lse, scale, False, None, 1, modes)
    finally:
        _guard(emu, [])
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), name
    # the keys outside the blocks get exact zeros
    assert (got[1][:, :, :lo] == 0).all() and (got[1][:, :, hi:] == 0).all()
    assert (got[2][:, :, :lo] == 0).all() and (got[2][:, :, hi:] == 0).all()


# ---------------------------------------------------------------------------------------------
# attn_mask (bool and additive float, broadcast views) and its gradient
# ---------------------------------------------------------------------------------------------


def _mask(kind, shape, seed, hide=0.3, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    if kind == "bool":
        return torch.rand(shape, generator=g) >= hide
    m = torch.randn(shape, generator=g)
    m = m.masked_fill(torch.rand(shape, generator=g) < hide, float("-inf"))
    return m.requires_grad_(requires_grad)


# (B, H, Hkv, Lq, Lk, D, causal, key_lengths, causal_align, window, mask kind, mask shape, splits)
MASK_CASES = [
    # bool, one mask for every head (stride 0 on the head dim), causal, lengths
    (2, 4, 2, 37, 90, 64, True, (90, 41), "bottom_right", None, "bool", (2, 1, 37, 90), (1, 1)),
    # float bias with gradient, a 2-D (Lq, Lk) mask broadcast over batch and heads, GQA decode-like
    (2, 8, 2, 5, 70, 32, False, None, "bottom_right", None, "float", (5, 70), (1, 1)),
    # float bias per head with a window and top-left; rows whose visible keys are all -inf
    (1, 2, 1, 40, 100, 128, True, None, "top_left", (30, -1), "float", (1, 2, 40, 100), (1, 1)),
    # key-padding style (B, 1, 1, Lk): stride 0 on the query dim; split-K in both passes
    (2, 2, 2, 6, 260, 96, False, None, "bottom_right", None, "float", (2, 1, 1, 260), (3, 2)),
]


@pytest.mark.parametrize("case", MASK_CASES, ids=lambda c: f"{c[10]}{'x'.join(map(str, c[11]))}-d{c[5]}"
                         + ("-causal" if c[6] else "") + ("" if c[9] is None else f"-w{c[9][0]}_{c[9][1]}")
                         + ("" if c[12] == (1, 1) else "-split"))
def test_attn_mask_against_the_reference(scheduled, case):
    B, H, Hkv, Lq, Lk, D, causal, kl, align, window, kind, shape, (splits, bwd_splits) = case
    dtype = DTYPE_FOR_D[D]
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, dtype=dtype, seed=Lk)
    hide = 0.97 if case[9] is not None else 0.3  # the windowed case: rows with every visible key hidden
    mask = _mask(kind, shape, seed=D, hide=hide, requires_grad=kind == "float")
    kl_t = None if kl is None else torch.tensor(kl, dtype=torch.int32)
    check_against_reference(emulated_attention(scheduled, splits, bwd_splits), q, k, v, causal, kl_t,
                            attn_mask=mask, causal_align=align, window=window)


def test_nan_bias_at_hidden_positions_changes_nothing(emu):
    # NaN bias entries where causal masking or key_lengths hide the key: the mask is never read
    # there, so out, lse and every gradient are those of a clean bias; the mask's gradient is
    # exactly 0 at those positions.
    emu.schedule(None)
    B, H, Lq, Lk, D = 2, 2, 20, 70, 64
    q, k, v = make_inputs(B, H, H, Lq, Lk, D, dtype=torch.bfloat16, requires_grad=False, seed=4)
    kl = torch.tensor([70, 33], dtype=torch.int32)
    bias = torch.randn(B, 1, Lq, Lk)
    dirty = bias.clone()
    dirty[:, :, 0, 51:] = float("nan")  # row 0 of element 0 sees keys up to 0 + 70 - 20 = 50
    dirty[1, :, :, 33:] = float("nan")  # past element 1's key length
    fn = emulated_attention(emu)

    def run(b):
        qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
        bb = b.clone().requires_grad_(True)
        out, lse = fn(qq, kk, vv, causal=True, key_lengths=kl, attn_mask=bb, return_lse=True)
        out.float().sum().backward()
        return [out, lse, qq.grad, kk.grad, vv.grad, bb.grad]

    clean, got = run(bias), run(dirty)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dmask"), got, clean):
        assert torch.equal(a, b), f"{name}: a NaN bias at a hidden position changed it"
    assert (got[5][:, :, 0, 51:] == 0).all() and (got[5][1, :, :, 33:] == 0).all()


# ---------------------------------------------------------------------------------------------
# Dropout: the contract's counter hash, bit for bit
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, -(2**63), 2**63 - 1, 0x9234_5678_9ABC_DEF0 - 2**64])
def test_dropout_keep_mask_is_the_references_bit_for_bit(emu, seed):
    # With q = 0 every visible key gets probability 1 / Lk, and v = the identity makes out[i, j]
    # = keep(i, j) / ((1 - p) Lk): the kernel's keep mask, read off the output, must equal
    # mhakern.reference.dropout_keep_mask exactly (every position, heads of a GQA group apart).
    emu.schedule(None)
    B, H, Hkv, Lq, Lk, D, p = 2, 4, 2, 40, 64, 64, 0.37
    q = torch.zeros(B, H, Lq, D, dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, Lk, D, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    v = torch.eye(Lk, D, dtype=torch.bfloat16).expand(B, Hkv, Lk, D).contiguous()
    modes = Modes(dropout_p=p, seed=seed)
    out, lse = emu.forward(padded(q), padded(k), padded(v), 0.125, False, None, 1, modes)
    keep = out.float() > 0
    want = reference.dropout_keep_mask(seed, B, H, Lq, Lk, p)
    assert torch.equal(keep, want), f"{(keep != want).sum().item()} keep decisions differ from the reference"
    assert 0.5 < keep.float().mean().item() < 0.75
    # the kept entries are 1 / ((1 - p) Lk), rounded once to bfloat16; lse is the undropped one
    kept = out.float()[keep]
    assert torch.allclose(kept, torch.full_like(kept, 1 / ((1 - p) * Lk)), rtol=1e-2)
    assert torch.allclose(lse, torch.full_like(lse, math.log(Lk)), atol=1e-5)


# (B, H, Hkv, Lq, Lk, D, causal, key_lengths, causal_align, window, mask, p, splits)
DROPOUT_CASES = [
    (2, 4, 2, 37, 90, 64, True, (90, 41), "bottom_right", None, None, 0.2, (1, 1)),
    (1, 2, 1, 45, 30, 32, True, None, "top_left", (8, -1), "float", 0.5, (1, 1)),
    (1, 4, 2, 4, 200, 128, False, (170,), "bottom_right", None, "bool", 0.1, (3, 2)),
]


@pytest.mark.parametrize("case", DROPOUT_CASES, ids=lambda c: f"p{c[11]}-d{c[5]}" + ("" if c[10] is None else f"-{c[10]}")
                         + ("" if c[9] is None else "-window") + ("" if c[12] == (1, 1) else "-split"))
def test_dropout_against_the_reference(scheduled, case):
    # The oracle regenerates the keep mask from the seed the call draws: forward and every
    # gradient (the backward regenerates the mask in both kernels) by the tolerance rule.
    B, H, Hkv, Lq, Lk, D, causal, kl, align, window, mkind, p, (splits, bwd_splits) = case
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, dtype=DTYPE_FOR_D[D], seed=Lq + 1)
    mask = None if mkind is None else _mask(mkind, (B, 1, Lq, Lk), seed=5, requires_grad=mkind == "float")
    kl_t = None if kl is None else torch.tensor(kl, dtype=torch.int32)
    gen = torch.Generator().manual_seed(Lk)
    check_against_reference(emulated_attention(scheduled, splits, bwd_splits), q, k, v, causal, kl_t,
                            attn_mask=mask, dropout_p=p, generator=gen, causal_align=align, window=window)


def test_dropout_split_k_agrees_with_one_split(emu):
    # keep is a function of (seed, b, h, i, j) only: cutting the keys into splits changes only
    # the rounding of the combination, never which probabilities are dropped
    emu.schedule(None)
    q, k, v = make_inputs(1, 2, 1, 6, 300, 64, dtype=torch.bfloat16, requires_grad=False, seed=8)
    modes = Modes(dropout_p=0.3, seed=99)
    qp, kp, vp = padded(q), padded(k), padded(v)
    one, lse1 = emu.forward(qp, kp, vp, 0.125, False, None, 1, modes)
    three, lse3 = emu.forward(qp, kp, vp, 0.125, False, None, 3, modes)
    torch.testing.assert_close(three.float(), one.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse3, lse1)


# ---------------------------------------------------------------------------------------------
# The fused mma.sync backward (csrc/cuda/mma/attn_bwd_fused_kernel.cuh): 5 products per tile, dQ by
# fp32 reductions in key order (deterministic) or in any order (fused_atomic)
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def fused(emu, request):
    """emu under the test's random schedule, its backward the fused kernel (ordered)."""
    use_random_schedule(emu, request.node.nodeid)
    emu.bwd_kernel("fused")
    yield emu
    emu.bwd_kernel(None)
    emu.schedule(None)


def _d256(case):
    B, H, Hkv, Lq, Lk, D, Dv, causal, kl = case
    return (B, H, Hkv, Lq, Lk, 256, 256, causal, kl)


# The hard cases at every head dim the fused kernel has: the supported ones as they are, and
# each distinct shape again at D 256 (lengths 1/17/113, Lq != Lk both ways, leading rows that see
# no key, key_lengths with 0, GQA and MQA decode).
FUSED_CASES = list(SUPPORTED_HARD) + sorted({_d256(c) for c in HARD_CASES if c[5] == c[6]}, key=str)


@pytest.mark.parametrize("case", FUSED_CASES, ids=case_id)
def test_fused_backward_hard_cases(fused, case):
    B, H, Hkv, Lq, Lk, D, Dv, causal, kl = case
    dtype = DTYPE_FOR_D.get(D, torch.bfloat16)
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, Dv, dtype=dtype, seed=Lq + Lk)
    kl_t = None if kl is None else torch.tensor(kl, dtype=torch.int32)
    check_against_reference(emulated_attention(fused), q, k, v, causal, kl_t)


@pytest.mark.parametrize(
    "D,case,layout,scale_inputs,align",
    [
        # several key blocks and row blocks, strided (B, L, H, D) views, both causal alignments
        (64, (1, 2, 1, 130, 200, 64, 64, True, None), "blhd", 1.0, "bottom_right"),
        (128, (2, 2, 2, 70, 40, 128, 128, True, (40, 9)), "blhd", 1.0, "top_left"),
        (256, (1, 2, 1, 70, 45, 256, 256, True, (45,)), "blhd", 1.0, "top_left"),
        # GQA: a group's packed rows (4 heads x 37) straddle tiles and heads, causal, lengths
        (96, (2, 8, 2, 37, 90, 96, 96, True, (90, 41)), "bhld", 1.0, "bottom_right"),
        (256, (2, 4, 1, 9, 50, 256, 256, True, (50, 0)), "bhld", 1.0, "bottom_right"),
        # large logits: the exact softmax's recomputation from lse must not overflow
        (32, (1, 2, 2, 40, 70, 32, 32, False, None), "blhd", 30.0, "bottom_right"),
        (256, (1, 2, 1, 33, 65, 256, 256, True, None), "bhld", 30.0, "bottom_right"),
    ],
    ids=["multiblock-blhd-d64", "top-left-lengths-d128", "top-left-d256", "gqa-straddle-d96", "mqa-kl0-d256",
         "large-logits-d32", "large-logits-d256"],
)
def test_fused_backward_shapes(fused, D, case, layout, scale_inputs, align):
    B, H, Hkv, Lq, Lk, _, _, causal, kl = case
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, D, dtype=DTYPE_FOR_D.get(D, torch.float16), layout=layout,
                          scale_inputs=scale_inputs, seed=D + Lq)
    kl_t = None if kl is None else torch.tensor(kl, dtype=torch.int32)
    check_against_reference(emulated_attention(fused), q, k, v, causal, kl_t, causal_align=align,
                            large_logits=scale_inputs > 1)


@pytest.mark.parametrize("D", [64, 256])
def test_fused_backward_modes(fused, D):
    # Windows, a float mask with its gradient and dropout, in the fused kernel (which writes the
    # mask gradient from dS^T): one call with all of them, one with a bool mask and top-left.
    dtype = torch.bfloat16
    q, k, v = make_inputs(2, 4, 2, 37, 90, D, dtype=dtype, seed=11)
    mask = _mask("float", (2, 1, 37, 90), seed=3, requires_grad=True)
    check_against_reference(emulated_attention(fused), q, k, v, False, torch.tensor([90, 41], dtype=torch.int32),
                            attn_mask=mask, dropout_p=0.2, generator=torch.Generator().manual_seed(9),
                            window=(16, 8))
    q, k, v = make_inputs(1, 2, 1, 45, 30, D, dtype=dtype, seed=12)
    check_against_reference(emulated_attention(fused), q, k, v, True, None, attn_mask=_mask("bool", (1, 2, 45, 30), seed=4),
                            causal_align="top_left", window=(8, -1))


def _fused_grads(emu, kernel, seed, q, k, v, kl, dout):
    emu.schedule(seed)
    emu.bwd_kernel(kernel)
    try:
        qq, kk, vv = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
        out = emulated_attention(emu)(qq, kk, vv, causal=True, key_lengths=kl)
        out.backward(dout)
        return [qq.grad, kk.grad, vv.grad]
    finally:
        emu.bwd_kernel(None)
        emu.schedule(None)


# GQA, causal, lengths: 5 key blocks x 3 row blocks per KV head, so that up to 5 key blocks add
# into each row block's dQ (fp32 addition is commutative: two addends in either order give the
# same bits, so an order can show only with three or more). Fixed seeds (the outcome must not
# depend on the run); they include schedules with 1, 2 and 3 blocks in flight.
DET_SEEDS = (11, 12, 13, 14, 15, 16, 17, 18)


def _det_inputs(D=64):
    q, k, v = make_inputs(1, 4, 2, 40, 310, D, dtype=torch.bfloat16, seed=21)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(q.dtype)
    return q, k, v, torch.tensor([300], dtype=torch.int32), dout


def test_fused_backward_is_bit_identical_across_schedules(emu):
    # Deterministic mode: every dQ element's fp32 sum is formed in key-block order, whichever
    # blocks run together and whenever their reductions land; dK and dV stay in registers.
    q, k, v, kl, dout = _det_inputs()
    want = _fused_grads(emu, "fused", None, q, k, v, kl, dout)
    for seed in DET_SEEDS:
        got = _fused_grads(emu, "fused", seed, q, k, v, kl, dout)
        for name, a, b in zip(("dq", "dk", "dv"), want, got):
            assert torch.equal(a, b), f"{name} differs under random schedule seed {seed}"


def test_fused_atomic_order_shows_in_the_last_bits(emu):
    # The twin without the order: the same gradients within rounding, but some schedule adds a
    # row block's dQ in another key order and changes bits (else the bit-identity above would
    # prove nothing about ordering).
    q, k, v, kl, dout = _det_inputs()
    want = _fused_grads(emu, "fused", None, q, k, v, kl, dout)
    differ = []
    for seed in DET_SEEDS:
        got = _fused_grads(emu, "fused_atomic", seed, q, k, v, kl, dout)
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])  # dK, dV: no atomics
        assert torch.allclose(got[0].float(), want[0].float(), rtol=1e-2, atol=1e-3)
        if not torch.equal(got[0], want[0]):
            differ.append(seed)
    assert differ, "no random schedule reordered the dQ reductions"


@pytest.mark.parametrize("defect", [1, 2], ids=["ordering-bug", "early-release"])
def test_fused_backward_defects_break_bit_identity(emu, defect):
    # The real kernel with a deliberate defect in its dQ order (attn_bwd_fused_kernel.cuh, under
    # emulation only): 1 a key block goes a turn early, 2 it passes its turn before its adds.
    # Some random schedule must then give other bits than the fixed order.
    q, k, v, kl, dout = _det_inputs()
    want = _fused_grads(emu, "fused", None, q, k, v, kl, dout)
    prev = emu.lib.mhk_emu_set_defect(defect)
    try:
        differ = [s for s in DET_SEEDS if not torch.equal(_fused_grads(emu, "fused", s, q, k, v, kl, dout)[0], want[0])]
    finally:
        emu.lib.mhk_emu_set_defect(prev)
    assert differ, f"defect {defect}: every random schedule kept the key order"


def test_fused_backward_out_of_order_dispatch_needs_tickets(emu):
    # The ordered dQ adds make key block n of a row block wait for key block n - 1. Taken from
    # the block index, that relies on CTAs starting in block order, which CUDA does not promise:
    # started in reverse with 2 resident (a first wave of a grid larger than the GPU holds),
    # both resident CTAs wait on turns of CTAs that cannot start (defect 3, the kernel's old
    # work assignment). The kernel takes a ticket at its start instead (dq_accum.cuh, forward
    # progress): any order and residency gives the in-order run's bits.
    q, k, v, kl, dout = _det_inputs()
    want = _fused_grads(emu, "fused", None, q, k, v, kl, dout)
    with dispatched(emu.lib, "reversed", resident=2):
        prev = emu.lib.mhk_emu_set_defect(3)
        try:
            with pytest.raises(RuntimeError, match="dispatch-order deadlock"):
                _fused_grads(emu, "fused", None, q, k, v, kl, dout)
        finally:
            emu.lib.mhk_emu_set_defect(prev)
        got = [_fused_grads(emu, "fused", None, q, k, v, kl, dout)]
    with dispatched(emu.lib, "shuffled", resident=3, seed=9):
        got.append(_fused_grads(emu, "fused", DET_SEEDS[0], q, k, v, kl, dout))
    for g in got:
        for name, a, b in zip(("dq", "dk", "dv"), want, g):
            assert torch.equal(a, b), f"{name} differs under out-of-order dispatch"


def test_fused_tiles_are_the_capability_table(emu):
    # FusedBwdConfig as compiled against capabilities.h's cuda_fused_bwd_tiles (the JSON's
    # cuda.bwd.fused_tiles), and within the 99 KB of the smallest sm_80+ part.
    from cuda_emulator_harness import _real_table

    table = _real_table()["cuda"]["bwd"]["fused_tiles"]
    out = (ctypes.c_int * 5)()
    for D in sorted({int(d) for d in table}):
        assert emu.lib.mhk_emu_fused_bwd_tiles(D, out) == 0
        n, m, d_split, threads, smem = out
        assert [n, m, d_split] == table[str(D)] and threads == 128 and smem <= 99 * 1024
    assert set(BWD_ONLY_HEAD_DIMS) <= {int(d) for d in table}


def test_mode_params_struct_is_the_compiled_layout(emu):
    # The harness's ctypes ModeParams (built from the mode table's PARAMS) has the size and the
    # field offsets of the struct the kernels were compiled with: every modes call passes it.
    from cuda_emulator_harness import ModeParams, mode_params_layout

    size, *offsets = mode_params_layout(emu.lib)
    assert size == ctypes.sizeof(ModeParams)
    assert offsets == [getattr(ModeParams, name).offset for name, _ in ModeParams._fields_]


# ---------------------------------------------------------------------------------------------
# The score modifiers (docs/contract.md "Score modifiers"): softcap and ALiBi in the kModes
# kernels (forward, split and fused backward), against the float64 reference
# ---------------------------------------------------------------------------------------------


def _slopes(shape, seed):
    """ALiBi slopes: per head (H,) or per batch element (B, H), FlashAttention's range (2^-8..1)."""
    g = torch.Generator().manual_seed(seed)
    return torch.exp2(-8 * torch.rand(shape, generator=g))


# (name, (B, H, Hkv, Lq, Lk, D), dtype, causal, key_lengths, modes of the call, backward kernel,
# (forward splits, backward splits), inputs scale). Between them: a cap that bends (2.0) and one
# that saturates only large logits (50 with inputs x30), slopes per head and per batch element,
# causal in both alignments, key lengths with 0, windows, GQA straddling heads, Lq > Lk (rows that
# see no key), float and bool masks with the float mask's gradient, dropout, split-K, decode
# shapes (the modes kernel serves them), D 64, 128 and 256 (its forward is the reference's).
MODIFIER_CASES = [
    ("cap2-gqa-kl-split", (2, 4, 2, 37, 90, 64), torch.float16, True, (90, 41), dict(softcap=2.0), "split", (2, 2), 1.0),
    ("cap50-x30-d128-fused", (1, 2, 1, 33, 65, 128), torch.bfloat16, True, None, dict(softcap=50.0), "fused", (1, 1), 30.0),
    ("alibi-head-topleft-deadrows", (1, 4, 2, 45, 30, 64), torch.bfloat16, True, None,
     dict(alibi=(4,), causal_align="top_left"), "fused", (1, 1), 1.0),
    ("alibi-batch-window-kl0-d128", (3, 2, 2, 40, 64, 128), torch.float16, False, (64, 0, 23),
     dict(alibi=(3, 2), window=(16, 8)), "split", (1, 2), 1.0),
    ("all-float-mask-dropout", (2, 4, 2, 37, 90, 64), torch.bfloat16, False, (90, 41),
     dict(softcap=3.0, alibi=(2, 4), mask="float", dropout_p=0.2), "split", (1, 1), 1.0),
    ("all-float-mask-dropout-fused", (2, 4, 2, 37, 90, 64), torch.float16, False, (90, 41),
     dict(softcap=3.0, alibi=(4,), mask="float", dropout_p=0.2), "fused", (1, 1), 1.0),
    ("cap-bool-mask-topleft-d128", (1, 2, 2, 45, 30, 128), torch.bfloat16, True, None,
     dict(softcap=4.0, mask="bool", causal_align="top_left"), "split", (1, 1), 1.0),
    ("decode-cap-alibi", (2, 8, 2, 1, 150, 64), torch.float16, False, (150, 9),
     dict(softcap=2.0, alibi=(2, 8)), "split", (3, 1), 1.0),
    ("d256-cap-alibi-fused", (2, 2, 1, 20, 45, 256), torch.bfloat16, True, (45, 17),
     dict(softcap=2.0, alibi=(2, 2)), "fused", (1, 1), 1.0),
]


@pytest.mark.parametrize("case", MODIFIER_CASES, ids=[c[0] for c in MODIFIER_CASES])
def test_score_modifiers_against_the_reference(scheduled, case):
    _, (B, H, Hkv, Lq, Lk, D), dtype, causal, kl, mods, bwd, (splits, bwd_splits), xs = case
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, dtype=dtype, scale_inputs=xs, seed=Lq + D)
    kw = {key: val for key, val in mods.items() if key in ("softcap", "causal_align", "window", "dropout_p")}
    if "alibi" in mods:
        kw["alibi_slopes"] = _slopes(mods["alibi"], seed=D)
    if mods.get("mask") == "float":
        kw["attn_mask"] = _mask("float", (B, 1, Lq, Lk), seed=3, requires_grad=True)
    elif mods.get("mask") == "bool":
        kw["attn_mask"] = _mask("bool", (1, H, Lq, Lk), seed=4)
    if "dropout_p" in mods:
        kw["generator"] = torch.Generator().manual_seed(9)
    scheduled.bwd_kernel(bwd)
    try:
        check_against_reference(emulated_attention(scheduled, splits, bwd_splits), q, k, v, causal,
                                None if kl is None else torch.tensor(kl, dtype=torch.int32),
                                large_logits=xs > 1, **kw)
    finally:
        scheduled.bwd_kernel(None)


def test_score_modifiers_hidden_keys_hold_garbage(scheduled):
    # Keys past key_lengths[b] (NaN keys, inf values) reach no result through the cap or the
    # ALiBi bias, in the forward and in both backward kernels: bit-identical to clean padding.
    B, H, Lq, Lk, D = 2, 2, 20, 80, 64
    q, k, v = make_inputs(B, H, H, Lq, Lk, D, dtype=torch.float16, requires_grad=False)
    kl = torch.tensor([50, 80], dtype=torch.int32)
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[0, :, 50:] = float("nan")
    v_bad[0, :, 50:] = float("inf")
    slopes = _slopes((B, H), seed=1)
    for bwd in ("split", "fused"):
        scheduled.bwd_kernel(bwd)
        try:
            runs = []
            for kk, vv in ((k_bad, v_bad), (k, v)):
                xs = [x.clone().requires_grad_(True) for x in (q, kk, vv)]
                out, lse = emulated_attention(scheduled)(*xs, causal=True, key_lengths=kl, return_lse=True,
                                                         softcap=2.0, alibi_slopes=slopes)
                out.float().sum().backward()
                runs.append([out, lse] + [x.grad for x in xs])
        finally:
            scheduled.bwd_kernel(None)
        for a, b in zip(*runs):
            assert torch.equal(a, b) and torch.isfinite(a).all(), bwd


def test_score_modifiers_never_go_to_the_sm90_family(emu):
    # capabilities.h kSm90FwdFeatures / kSm90BwdFeatures: the sm90 family serves neither, so a 9.0
    # device with the sm_90a pass gives such calls to mma.sync (its kModes kernels); a plain call
    # of the same shape goes to sm90 (so the answer is not mma.sync for every call).
    lib = emu.lib
    lib.mhk_emu_modifier_family.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float,
                                            ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    modes_kernel = ctypes.c_int(-1)
    for backward in (0, 1):
        assert lib.mhk_emu_modifier_family(9, 0, 1, 64, 0.0, 0, backward, ctypes.byref(modes_kernel)) == 1
        assert modes_kernel.value == 0
        for softcap, alibi in ((30.0, 0), (0.0, 1), (30.0, 1)):
            assert lib.mhk_emu_modifier_family(9, 0, 1, 64, softcap, alibi, backward, ctypes.byref(modes_kernel)) == 0
            assert modes_kernel.value == 1


# packed variable-length sequences: the modes forward kernel, against the float64
# reference computed per sequence
# ---------------------------------------------------------------------------------------------


def _packing(cq, ck) -> dict:
    """The packing fields of ModeParams (fill_mode_params' values) for prefix sums cq, ck."""
    lens_q, lens_k = (cq[1:] - cq[:-1]), (ck[1:] - ck[:-1])
    return dict(cu_seqlens_q=cq.data_ptr(), cu_seqlens_k=ck.data_ptr(), num_seqs=len(cq) - 1,
                max_seqlen_q=int(lens_q.max()), max_seqlen_k=int(lens_k.max()))


def _emu_fwd_varlen(emu, q, k, v, cq, ck, scale, causal, modes):
    """The kernel's packed forward: q, k, v (1, H*, T*, D) views of packed (T, H, D) tensors; returns
    (out (1, H, Tq, D), lse (1, H, Tq)), both NaN-filled before the call so an unwritten row shows."""
    _, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    out = torch.full((Tq, H, D), float("nan"), dtype=q.dtype).transpose(0, 1).unsqueeze(0)
    lse = torch.full((1, H, Tq), float("nan"))
    st = lambda x: (ctypes.c_int64 * 3)(x.stride(0), x.stride(1), x.stride(2))  # noqa: E731
    emu.lib.mhk_emu_configure(int(emu.defer_async), SMEM_LIMIT)
    # B = 1, no key lengths, unsplit (the kernels run packed calls unsplit)
    rc = emu.lib.mhk_emu_fwd_modes(
        {torch.float16: 0, torch.bfloat16: 1}[q.dtype], D, _ptr(q), st(q), _ptr(k), st(k), _ptr(v), st(v),
        _ptr(out), st(out), _ptr(lse), None, 1, H, Hkv, Tq, Tk, ctypes.c_float(scale), int(causal), 1, None, None,
        ctypes.byref(mode_params(modes, **_packing(cq, ck))))
    emu._check(rc, "emulated packed forward")
    return out, lse


def _packed_t(T, H, D, dtype, g):
    return torch.randn(T, H, D, generator=g).to(dtype).transpose(0, 1).unsqueeze(0)


# (name, lengths q, lengths k, H, Hkv, D, causal, modes kwargs). Between them: empty sequences on
# either side, one-token ones, a sequence longer than a query tile (70 x group 2 > 128 rows) and
# than a key block, Lq_s != Lk_s both ways, GQA, causal in both alignments, a window, dropout
# (the hash of (s, h, local i, local j)), softcap and per-sequence ALiBi slopes.
VARLEN_CASES = [
    ("mixed-causal-gqa", [5, 0, 1, 70, 3, 9], [9, 4, 1, 150, 0, 2], 4, 2, 64, True, dict()),
    ("topleft-window-dropout-cap-alibi", [40, 7, 1], [13, 30, 5], 2, 1, 32, True,
     dict(top_left=True, window=(6, 2), dropout_p=0.3, softcap=3.0, alibi=True)),
]


@pytest.mark.parametrize("case", VARLEN_CASES, ids=[c[0] for c in VARLEN_CASES])
def test_varlen_forward_against_the_per_sequence_reference(scheduled, case):
    _, lq, lk, H, Hkv, D, causal, kw = case
    dtype = DTYPE_FOR_D[D]
    g = torch.Generator().manual_seed(D + len(lq))
    S, Tq, Tk = len(lq), sum(lq), sum(lk)
    q, k, v = _packed_t(Tq, H, D, dtype, g), _packed_t(Tk, Hkv, D, dtype, g), _packed_t(Tk, Hkv, D, dtype, g)
    cq = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32)
    ck = torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist(), dtype=torch.int32)
    al = torch.exp2(-8 * torch.rand(S, H, generator=g)) if kw.get("alibi") else None
    m = Modes.build(dropout_p=kw.get("dropout_p", 0.0), seed=4242 if kw.get("dropout_p") else 0,
                    top_left=kw.get("top_left", False), window=kw.get("window"), softcap=kw.get("softcap", 0.0),
                    alibi_slopes=al)
    scale = D ** -0.5
    out, lse = _emu_fwd_varlen(scheduled, q, k, v, cq, ck, scale, causal, m)
    for s in range(S):
        rows = slice(int(cq[s]), int(cq[s + 1]))
        if lq[s] == 0:
            continue
        if lk[s] == 0:
            assert torch.equal(out[:, :, rows], torch.zeros_like(out[:, :, rows])), f"seq {s}: out of no keys"
            assert torch.isneginf(lse[:, :, rows]).all(), f"seq {s}: lse of no keys"
            continue
        # Element s of a batch of s + 1 copies: the dropout hash and the slope row see (s, h).
        xs = [x.expand(s + 1, *x.shape[1:]) for x in
              (q[:, :, rows], k[:, :, int(ck[s]):int(ck[s + 1])], v[:, :, int(ck[s]):int(ck[s + 1])])]
        ms = m._replace(alibi_slopes=None if al is None else al[:s + 1].contiguous())
        o64, l64 = reference.attention_forward(*[x.double() for x in xs], scale, causal, None, upcast=True, modes=ms)
        oT, _ = reference.attention_forward(*xs, scale, causal, None, modes=ms)
        rule_check(f"out seq {s}", out[:, :, rows], o64[s:s + 1], oT[s:s + 1], dtype, 2.0)
        dead = torch.isneginf(l64[s:s + 1])
        assert torch.equal(torch.isneginf(lse[:, :, rows]), dead), f"seq {s}: lse -inf pattern"
        err = (lse[:, :, rows].double() - l64[s:s + 1])[~dead].abs().max().item() if (~dead).any() else 0.0
        assert err <= 1e-3 * max(1.0, l64[s:s + 1][~dead].abs().max().item()), f"seq {s}: lse error {err:.3e}"


def test_varlen_forward_never_reads_another_sequences_keys(scheduled):
    # NaN keys and values in sequence 1 reach nothing of sequences 0 and 2: bit-identical outputs.
    g = torch.Generator().manual_seed(3)
    lq, lk, H, D = [9, 30, 20], [12, 40, 70], 2, 64
    q, k, v = (_packed_t(sum(lq), H, D, torch.float16, g), _packed_t(sum(lk), H, D, torch.float16, g),
               _packed_t(sum(lk), H, D, torch.float16, g))
    cq = torch.tensor([0, 9, 39, 59], dtype=torch.int32)
    ck = torch.tensor([0, 12, 52, 122], dtype=torch.int32)
    o1, l1 = _emu_fwd_varlen(scheduled, q, k, v, cq, ck, 0.125, False, Modes())
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 12:52] = float("nan")
    v2[:, :, 12:52] = float("nan")
    o2, l2 = _emu_fwd_varlen(scheduled, q, k2, v2, cq, ck, 0.125, False, Modes())
    for rows in (slice(0, 9), slice(39, 59)):
        assert torch.equal(o1[:, :, rows], o2[:, :, rows]) and torch.equal(l1[:, :, rows], l2[:, :, rows])
    assert torch.isnan(o2[:, :, 9:39]).all()


def _emu_bwd_varlen(emu, dout, q, k, v, out, lse, cq, ck, scale, causal, modes):
    """The kernel's packed backward (the split kernels, whatever emu.bwd_kernel asks) on NaN-padded copies
    of its inputs (a read outside a tensor shows as NaN); returns (dq, dk, dv) as (1, H*, T*, D)
    views into NaN-filled buffers whose padding is checked (a write outside shows)."""
    _, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    dop, qp, kp, vp, op = (padded(x) for x in (dout, q, k, v, out))
    (dq, gq), (dk, gk), (dv, gv) = (padded_empty(x) for x in (q, k, v))
    delta = torch.full((1, H, Tq), float("nan"))
    st = lambda x: (ctypes.c_int64 * 3)(x.stride(0), x.stride(1), x.stride(2))  # noqa: E731
    emu.lib.mhk_emu_configure(int(emu.defer_async), SMEM_LIMIT)
    rc = emu.lib.mhk_emu_bwd_modes(
        {torch.float16: 0, torch.bfloat16: 1}[q.dtype], D, _ptr(dop), st(dop), _ptr(qp), st(qp), _ptr(kp), st(kp),
        _ptr(vp), st(vp), _ptr(op), st(op), _ptr(lse.contiguous()), _ptr(dq), st(dq), _ptr(dk), st(dk), _ptr(dv),
        st(dv), _ptr(delta), None, 1, H, Hkv, Tq, Tk, ctypes.c_float(scale), int(causal), 1, None,
        ctypes.byref(mode_params(modes, **_packing(cq, ck))))
    emu._check(rc, "emulated packed backward")
    for name, g in (("dq", gq), ("dk", gk), ("dv", gv)):
        g.check(name)
    return dq, dk, dv


def _varlen_inputs(case, seed):
    """Packed q, k, v, dout and the call's Modes (packing included) of a VARLEN_CASES entry."""
    _, lq, lk, H, Hkv, D, causal, kw = case
    dtype = DTYPE_FOR_D[D]
    g = torch.Generator().manual_seed(seed)
    Tq, Tk = sum(lq), sum(lk)
    q, k, v = _packed_t(Tq, H, D, dtype, g), _packed_t(Tk, Hkv, D, dtype, g), _packed_t(Tk, Hkv, D, dtype, g)
    dout = _packed_t(Tq, H, D, dtype, g)
    cq = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32)
    ck = torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist(), dtype=torch.int32)
    al = torch.exp2(-8 * torch.rand(len(lq), H, generator=g)) if kw.get("alibi") else None
    m = Modes.build(dropout_p=kw.get("dropout_p", 0.0), seed=4242 if kw.get("dropout_p") else 0,
                    top_left=kw.get("top_left", False), window=kw.get("window"), softcap=kw.get("softcap", 0.0),
                    alibi_slopes=al, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=max(lq), max_seqlen_k=max(lk))
    return q, k, v, dout, m


# The backward of packed sequences (csrc/cuda/mma/attn_bwd_kernel.cuh BwdSeqView; the split kernels,
# capabilities.h cuda_bwd_kernel): the forward cases above (empty sequences on either side, one-token ones, a sequence longer than
# a tile and a key block, Lq_s != Lk_s, GQA, causal in both alignments, a window, dropout with
# the per-sequence hash, softcap and per-sequence ALiBi), and those of the packed conformance
# suite (tests/test_varlen_kvcache.py, which runs on the backends usable in the process: never
# this emulator) at the kernels' head dims: not causal, causal with dropout and no GQA, a window
# both sides of the diagonal, MQA. Gradients against the float64 reference computed per
# sequence; the rows and keys of empty sequences get exact zeros.
_CONF_LQ, _CONF_LK = [3, 0, 1, 70, 5, 2], [5, 4, 1, 75, 0, 9]
VARLEN_BWD_CASES = VARLEN_CASES + [
    ("conf-gqa", _CONF_LQ, _CONF_LK, 4, 2, 32, False, dict()),
    ("conf-causal-dropout", _CONF_LQ, _CONF_LK, 4, 4, 64, True, dict(dropout_p=0.2)),
    ("conf-topleft-window-mqa-cap-alibi", _CONF_LQ, _CONF_LK, 4, 1, 32, True,
     dict(top_left=True, window=(3, -1), softcap=8.0, alibi=True)),
    ("conf-window-gqa-cap-alibi", _CONF_LQ, _CONF_LK, 4, 2, 64, False, dict(window=(4, 2), softcap=8.0, alibi=True)),
]


@pytest.mark.parametrize("case", VARLEN_BWD_CASES, ids=[c[0] for c in VARLEN_BWD_CASES])
def test_varlen_backward_against_the_per_sequence_reference(scheduled, case):
    _, lq, lk, H, Hkv, D, causal, kw = case
    dtype = DTYPE_FOR_D[D]
    q, k, v, dout, m = _varlen_inputs(case, D + len(lq))
    cq, ck = m.cu_seqlens_q, m.cu_seqlens_k
    scale = D ** -0.5
    out, lse = _emu_fwd_varlen(scheduled, q, k, v, cq, ck, scale, causal, m)
    got = _emu_bwd_varlen(scheduled, dout, q, k, v, out, lse, cq, ck, scale, causal, m)
    x64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    xT = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    m64 = m._replace(alibi_slopes=None if m.alibi_slopes is None else m.alibi_slopes.double())
    reference.attention(*x64, scale, causal, None, True, m64).backward(dout.double())
    reference.attention(*xT, scale, causal, None, False, m).backward(dout)
    for name, g, r64, rT in zip(("dq", "dk", "dv"), got, x64, xT):
        rule_check(name, g, r64.grad, rT.grad, dtype, 3.0)
    for s in range(len(lq)):
        q_rows, k_rows = slice(int(cq[s]), int(cq[s + 1])), slice(int(ck[s]), int(ck[s + 1]))
        if lk[s] == 0:
            assert torch.equal(got[0][:, :, q_rows], torch.zeros_like(got[0][:, :, q_rows])), f"seq {s}: dq of no keys"
        if lq[s] == 0:
            for name, g in (("dk", got[1]), ("dv", got[2])):
                assert torch.equal(g[:, :, k_rows], torch.zeros_like(g[:, :, k_rows])), f"seq {s}: {name} of no queries"


def test_varlen_backward_never_reads_another_sequences_tokens(emu, request):
    # NaN queries, keys, values, outputs and output gradients in sequence 1 reach nothing of
    # sequences 0 and 2, under two different random schedules, the second with the fused kernel
    # requested (a packed call runs the split kernels whatever is asked): their gradients are
    # bit-identical, sequence 1's all NaN.
    g = torch.Generator().manual_seed(4)
    lq, lk, H, Hkv, D = [9, 30, 20], [12, 40, 200], 4, 2, 32
    q, k, v, dout = (_packed_t(n, h, D, torch.float16, g) for n, h in ((59, H), (252, Hkv), (252, Hkv), (59, H)))
    cq = torch.tensor([0, 9, 39, 59], dtype=torch.int32)
    ck = torch.tensor([0, 12, 52, 252], dtype=torch.int32)
    m = Modes(dropout_p=0.2, seed=7)
    emu.schedule(None)
    out, lse = _emu_fwd_varlen(emu, q, k, v, cq, ck, 0.125, True, m)
    bad = [x.clone() for x in (q, k, v, out, dout)]
    for x, rows in zip(bad, (slice(9, 39), slice(12, 52), slice(12, 52), slice(9, 39), slice(9, 39))):
        x[:, :, rows] = float("nan")
    try:
        use_random_schedule(emu, request.node.nodeid, "clean")
        want = _emu_bwd_varlen(emu, dout, q, k, v, out, lse, cq, ck, 0.125, True, m)
        use_random_schedule(emu, request.node.nodeid, "nan")
        emu.bwd_kernel("fused")
        qb, kb, vb, ob, db = bad
        got = _emu_bwd_varlen(emu, db, qb, kb, vb, ob, lse, cq, ck, 0.125, True, m)
    finally:
        emu.bwd_kernel(None)
        emu.schedule(None)
    for name, a, b, rows in zip(("dq", "dk", "dv"), want, got, ((0, 9, 39, 59), (0, 12, 52, 252), (0, 12, 52, 252))):
        for lo, hi in ((rows[0], rows[1]), (rows[2], rows[3])):
            assert torch.equal(a[:, :, lo:hi], b[:, :, lo:hi]), f"{name} rows {lo}:{hi} changed"
        assert torch.isnan(b[:, :, rows[1]:rows[2]]).all(), f"{name}: sequence 1 not NaN"


def test_varlen_goes_to_the_sm90_family_only_where_it_serves_it(emu):
    # The mma.sync family serves packed sequences in both passes; a 9.0 device gives a packed
    # call to the sm90 family only for a pass whose features (capabilities.h) list them.
    lib = emu.lib
    lib.mhk_emu_varlen_family.argtypes = [ctypes.c_int] * 5 + [ctypes.c_void_p]
    serves = ctypes.c_int(-1)
    for backward in (0, 1):
        for D in (64, 128):
            assert lib.mhk_emu_varlen_family(8, 0, 1, D, backward, ctypes.byref(serves)) == 0
            assert lib.mhk_emu_varlen_family(9, 0, 1, D, backward, ctypes.byref(serves)) == serves.value


# the KV cache: batch rows by cache_batch_idx and paged K/V in the modes forward
# kernel, against the float64 reference on the dense K/V gathered through the index / table
# ---------------------------------------------------------------------------------------------


def _emu_fwd_cache(emu, q, k, v, Lk, scale, causal, kl, kv_idx=None, table=None, splits=1):
    B, H, Lq, D = q.shape
    out = torch.full((B, H, Lq, D), float("nan"), dtype=q.dtype)
    lse = torch.full((B, H, Lq), float("nan"))
    o_part = torch.full((splits, B, H, Lq, D), float("nan")) if splits > 1 else None
    l_part = torch.full((splits, B, H, Lq), float("nan")) if splits > 1 else None
    st = lambda x: (ctypes.c_int64 * 3)(x.stride(0), x.stride(1), x.stride(2))  # noqa: E731
    # the host sets the page size from k (num_pages, Hkv, page_size, D)
    modes = mode_params(Modes(cache_batch_idx=kv_idx, block_table=table), page_size=0 if table is None else k.shape[2])
    emu.lib.mhk_emu_configure(int(emu.defer_async), SMEM_LIMIT)
    rc = emu.lib.mhk_emu_fwd_modes(
        {torch.float16: 0, torch.bfloat16: 1}[q.dtype], D, _ptr(q), st(q), _ptr(k), st(k), _ptr(v), st(v),
        _ptr(out), st(out), _ptr(lse), _ptr(kl), B, H, k.shape[1], Lq, Lk, ctypes.c_float(scale), int(causal), splits,
        _ptr(o_part), _ptr(l_part), ctypes.byref(modes))
    emu._check(rc, "emulated KV-cache forward")
    return out, lse


def _check_dense(out, lse, q, kd, vd, scale, causal, kl):
    o64, l64 = reference.attention_forward(q.double(), kd.double(), vd.double(), scale, causal, kl, upcast=True)
    oT, _ = reference.attention_forward(q, kd, vd, scale, causal, kl)
    rule_check("out", out, o64, oT, q.dtype, 2.0)
    dead = torch.isneginf(l64)
    assert torch.equal(torch.isneginf(lse), dead), "lse: -inf pattern differs from the reference"
    assert (lse.double() - l64)[~dead].abs().max().item() <= 1e-3 * max(1.0, l64[~dead].abs().max().item())


# (page size, pages per sequence, splits): a page of one key, vLLM's 16, and 5, which divides no
# key block; split-K over the logical length once.
@pytest.mark.parametrize("page,pages,splits", [(1, 70, 1), (16, 5, 2), (5, 13, 1)], ids=["page1", "page16-split", "page5"])
def test_paged_kv_forward_against_the_gathered_reference(scheduled, page, pages, splits):
    B, H, Hkv, Lq, D = 3, 4, 2, 3, 64
    dtype = DTYPE_FOR_D[D]
    g = torch.Generator().manual_seed(page)
    n_pages = B * pages + 3
    # vLLM's layout (num_pages, page_size, Hkv, D) seen as the kernels' (num_pages, Hkv, page_size, D).
    k = torch.randn(n_pages, page, Hkv, D, generator=g).to(dtype).transpose(1, 2)
    v = torch.randn(n_pages, page, Hkv, D, generator=g).to(dtype).transpose(1, 2)
    table = torch.randperm(n_pages, generator=g)[:B * pages].reshape(B, pages).to(torch.int32)
    table[2, : pages // 2] = table[0, : pages // 2]  # sequences 0 and 2 share their first pages
    Lk = pages * page
    kl = torch.tensor([Lk, Lk // 2 + 1, 2], dtype=torch.int32)
    q = torch.randn(B, H, Lq, D, generator=g).to(dtype)
    # Unused pages hold NaN: a key read from a page outside the table would show.
    used = torch.zeros(n_pages, dtype=torch.bool)
    used[table.flatten().long()] = True
    k[~used] = float("nan")
    v[~used] = float("nan")
    out, lse = _emu_fwd_cache(scheduled, q, k, v, Lk, D ** -0.5, True, kl, table=table, splits=splits)
    gather = lambda x: x[table.long()].permute(0, 2, 1, 3, 4).reshape(B, Hkv, Lk, D)  # noqa: E731
    kd, vd = gather(k), gather(v)
    for b in range(B):  # keys past the fill are hidden; zero them for the reference's 0 * NaN
        kd[b, :, int(kl[b]):] = 0
        vd[b, :, int(kl[b]):] = 0
    _check_dense(out, lse, q, kd, vd, D ** -0.5, True, kl)


def test_cache_batch_idx_forward_with_repeats(scheduled):
    B, H, Hkv, Lq, Lk, D = 4, 2, 1, 5, 90, 32
    dtype = DTYPE_FOR_D[D]
    g = torch.Generator().manual_seed(11)
    k = torch.randn(6, Hkv, Lk, D, generator=g).to(dtype)
    v = torch.randn(6, Hkv, Lk, D, generator=g).to(dtype)
    idx = torch.tensor([4, 1, 4, 0], dtype=torch.int32)
    k[[2, 3, 5]] = float("nan")  # rows no batch element reads
    v[[2, 3, 5]] = float("nan")
    kl = torch.tensor([90, 40, 7, 0], dtype=torch.int32)
    q = torch.randn(B, H, Lq, D, generator=g).to(dtype)
    out, lse = _emu_fwd_cache(scheduled, q, k, v, Lk, D ** -0.5, True, kl, kv_idx=idx)
    kd, vd = k[idx.long()].clone(), v[idx.long()].clone()
    for b in range(B):
        kd[b, :, int(kl[b]):] = 0
        vd[b, :, int(kl[b]):] = 0
    _check_dense(out, lse, q, kd, vd, D ** -0.5, True, kl)
