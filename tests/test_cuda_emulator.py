"""The CUDA emulator's own checks (csrc/cuda/emulation/), and the kernels under them.

The emulator (tests/test_cuda_host.py builds it) runs the CUDA kernels' source on CPU fibers. Its
checks must be able to fail, so each one meets a toy kernel with the defect it claims to catch
(csrc/cuda/emulation/emu_selftest.cpp) next to a correct twin:

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

from attn_testing import case_id, check_against_reference, make_inputs
from mhakern import reference
from mhakern.backends import Modes
from test_cuda_host import (
    ALL_INSTANCES,
    DTYPE_FOR_D,
    EMU_INSTANCES,
    SUPPORTED_HARD,
    _make_emulator,
    _ptr,
    emu_test_seed,
    emulated_attention,
    padded,
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
# Block b adds vals[b] (n floats) into acc as turn b of a counter (csrc/cuda/dq_accum.cuh through
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


# The kernels clamp key_lengths[b] into [0, Lk] (csrc/cuda/attn_params.h, key_length_of): a
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
    modes = Modes(None, 0.0, 0, align == "top_left", window[0], window[1], False)
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
    modes = Modes(None, p, seed, False, -1, -1, False)
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
    modes = Modes(None, 0.3, 99, False, -1, -1, False)
    qp, kp, vp = padded(q), padded(k), padded(v)
    one, lse1 = emu.forward(qp, kp, vp, 0.125, False, None, 1, modes)
    three, lse3 = emu.forward(qp, kp, vp, 0.125, False, None, 3, modes)
    torch.testing.assert_close(three.float(), one.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse3, lse1)
