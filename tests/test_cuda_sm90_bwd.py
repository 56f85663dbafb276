"""The sm_90a (Hopper) backward, checked without a GPU.

* The backward kernels of csrc/cuda/sm90/attn_bwd_sm90_kernel.cuh (dK/dV and dQ, every
  instantiation) under the CPU emulator's seeded random schedule, after the sm90 forward, on the
  hard cases and on shapes that wrap the stage rings, skip and mask causal tiles, straddle
  query heads with packed GQA rows (the dK/dV kernel's plain-load path) or not (its TMA path),
  cut key tiles at key_lengths (the dQ kernel's plain-load path), split the dQ keys, against the
  float64 reference by the project's tolerance rule (dq, dk, dv). Tensors sit in NaN-padded
  buffers: a read outside them poisons the result, a write outside them is detected.
* Keys past key_lengths hold garbage (NaN in K, inf in V): nothing there may reach a gradient,
  and theirs are 0.
* Determinism: two random schedules give bit-identical gradients.
* The backward's family choice by compute capability (faked capabilities).

What emulation cannot show (speed, register allocation, whether the hardware matches the
documented layouts) is for tools/check_cuda_build.py (SASS) and tests/test_cuda_sm90_gpu.py.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from mhakern import reference

from attn_testing import HARD_CASES, case_id, check_against_reference, make_inputs
from cuda_emulator_harness import (
    CUDA_SRC,
    ELEM,
    EMULATOR,
    _generator,
    _ptr,
    _st,
    build_units,
    dispatched,
    mode_params,
    missing_toolchain,
    padded,
    padded_empty,
    use_random_schedule,
)
from test_cuda_sm90 import _DUMMY, FAMILY_MODES, SMEM_LIMIT_SM90, Sm90Emulator

ROOT = Path(__file__).resolve().parent.parent
_CAPS = (ROOT / "csrc" / "capabilities.h").read_text()
FWD_INSTANCES = _generator().sm90_instances(_CAPS)
BWD_INSTANCES = _generator().sm90_bwd_instances(_CAPS)
BWD_DIMS = tuple(sorted({d for _, d in BWD_INSTANCES}))
UNITS = ("emu_entry.cpp", "emu_schedule.cpp", "emu_sm90_entry.cpp", "emu_sm90_bwd_entry.cpp")


def build_sm90_bwd(cache_dir: Path) -> Path:
    """The emulator with the sm90 forward and backward instances (objects shared with the other
    emulator builds of the same sources)."""
    units = [EMULATOR / u for u in UNITS]
    units += [CUDA_SRC / "sm90" / f"attn_fwd_sm90_{t}_d{d}.cu" for t, d in FWD_INSTANCES]
    units += [CUDA_SRC / "sm90" / f"attn_bwd_sm90_{t}_d{d}.cu" for t, d in BWD_INSTANCES]
    return build_units(cache_dir, units, "libmhk_emu_sm90_bwd.so")


class Sm90BwdEmulator(Sm90Emulator):
    def __init__(self, path: Path):
        super().__init__(path)
        # (major, minor, sm90_compiled, D, num_splits, modes, Hkv, k_head_stride, q_head_stride)
        self.lib.mhk_emu_bwd_family.argtypes = ([ctypes.c_int] * 5 + [ctypes.c_void_p, ctypes.c_int]
                                                + [ctypes.c_longlong] * 2)

    def backward(self, dout, q, k, v, out, lse, scale, causal, key_lengths, splits=1, fused=False,
                 deterministic=True, fault=0, workspace=None):
        """The split kernels (``splits`` dQ key splits), or with ``fused`` the fused kernel
        (``deterministic``: the ordered dQ adds; ``fault``: a deliberate bug, see
        BwdFusedParamsSm90::fault; ``workspace``: a list that receives its fp32 workspace)."""
        B, H, Lq, D = q.shape
        Hkv, Lk = k.shape[1], k.shape[2]
        dq, gq = padded_empty(q)
        dk, gk = padded_empty(k)
        dv, gv = padded_empty(v)
        delta = torch.full((B, H, Lq), float("nan"))
        dq_part = torch.full((splits, B, H, Lq, D), float("nan")) if splits > 1 else None
        # TMA may read only these buffers (their padding included: a box may cover it).
        bufs = [k, v, q, dout]
        begin = (ctypes.c_ulonglong * 4)(*[x.untyped_storage().data_ptr() for x in bufs])
        end = (ctypes.c_ulonglong * 4)(*[x.untyped_storage().data_ptr() + x.untyped_storage().nbytes() for x in bufs])
        self.lib.mhk_emu_guard_reads(4, begin, end)
        self.lib.mhk_emu_configure(1, SMEM_LIMIT_SM90)
        args = (ELEM[q.dtype], D, _ptr(dout), _st(dout), _ptr(q), _st(q), _ptr(k), _st(k), _ptr(v), _st(v), _ptr(out),
                _st(out), _ptr(lse), _ptr(dq), _st(dq), _ptr(dk), _st(dk), _ptr(dv), _st(dv), _ptr(delta),
                _ptr(key_lengths), B, H, Hkv, Lq, Lk, ctypes.c_float(scale), int(causal))
        if fused:
            ws = None
            if workspace is not None:
                self.lib.mhk_emu_sm90_bwd_fused_ws_floats.restype = ctypes.c_longlong
                ws = torch.empty(self.lib.mhk_emu_sm90_bwd_fused_ws_floats(B, H, Hkv, Lq, D), dtype=torch.float32)
                workspace.append(ws)
            rc = self.lib.mhk_emu_sm90_bwd_fused(*args, int(deterministic), fault, None if ws is None else _ptr(ws))
        else:
            rc = self.lib.mhk_emu_sm90_bwd(*args, splits, _ptr(dq_part))
        self.lib.mhk_emu_guard_reads(0, None, None)
        if rc != 0:
            raise RuntimeError(f"emulated sm90 backward: {self.error()}")
        for name, g in (("dq", gq), ("dk", gk), ("dv", gv)):
            g.check(name)
        return dq, dk, dv


@pytest.fixture(scope="module")
def emu(request):
    why = missing_toolchain()
    if why:
        pytest.skip(why)
    e = Sm90BwdEmulator(build_sm90_bwd(Path(request.config.cache.mkdir("mhakern_cuda_emu"))))
    yield e
    e.schedule(None)


@pytest.fixture
def rnd(emu, request):
    use_random_schedule(emu, request.node.nodeid)
    yield emu
    emu.schedule(None)


class _Sm90Attention(torch.autograd.Function):
    """The emulated sm90 forward and backward as one autograd op (CPU tensors)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal, key_lengths, emu, splits, bwd):
        qp, kp, vp = padded(q), padded(k), padded(v)
        out, lse = emu.forward(qp, kp, vp, scale, causal, key_lengths)
        ctx.save_for_backward(qp, kp, vp, out, lse)
        ctx.cfg = (scale, causal, key_lengths, emu, splits, bwd)
        ctx.mark_non_differentiable(lse)
        return out.clone(), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        qp, kp, vp, out, lse = ctx.saved_tensors
        scale, causal, key_lengths, emu, splits, bwd = ctx.cfg
        dq, dk, dv = emu.backward(padded(dout), qp, kp, vp, out, lse, scale, causal, key_lengths, splits, **bwd)
        return dq.clone(), dk.clone(), dv.clone(), None, None, None, None, None, None


def sm90_attention(emu, splits=1, **bwd):
    """The emulated sm90 forward + backward; ``bwd``: Sm90BwdEmulator.backward's options (fused, ...)."""
    def fn(q, k, v, *, causal=False, key_lengths=None, scale=None, return_lse=False):
        scale = 1.0 / q.shape[-1] ** 0.5 if scale is None else float(scale)
        kl = None if key_lengths is None else key_lengths.to(torch.int32).contiguous()
        out, lse = _Sm90Attention.apply(q, k, v, scale, causal, kl, emu, splits, bwd)
        return (out, lse) if return_lse else out

    return fn


def _run(emu, case, dtype, layout="bhld", scale_inputs=1.0, splits=1, large_logits=False, **bwd):
    B, H, Hkv, Lq, Lk, D, Dv, causal, kl = case
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, Dv, dtype=dtype, layout=layout, scale_inputs=scale_inputs)
    kl_t = None if kl is None else torch.tensor(kl, dtype=torch.int32)
    check_against_reference(sm90_attention(emu, splits, **bwd), q, k, v, causal, kl_t, large_logits=large_logits)


# ---------------------------------------------------------------------------------------------
# The backward against the float64 reference
# ---------------------------------------------------------------------------------------------

SM90_HARD = [c for c in HARD_CASES if c[5] == c[6] and c[5] in BWD_DIMS]
# Each hard case in one dtype, alternating; the shape tests below cover both per head dim.
DTYPES = (torch.bfloat16, torch.float16)


@pytest.mark.parametrize("i_case", range(len(SM90_HARD)), ids=[case_id(c) for c in SM90_HARD])
def test_sm90_backward_hard_cases(rnd, i_case):
    _run(rnd, SM90_HARD[i_case], DTYPES[i_case % 2])


@pytest.mark.parametrize(
    "case,dtype,layout",
    [
        # GQA: 4 query heads x 45 rows packed, stages straddling heads (plain loads), key
        # lengths incl. 0 and one inside a dQ key tile (its plain-load path), causal
        ((2, 8, 2, 45, 150, 128, 128, True, (100, 0)), torch.bfloat16, "bhld"),
        ((2, 8, 2, 45, 150, 64, 64, True, (97, 0)), torch.float16, "blhd"),
        # more queries than keys, causal: the leading rows see no key (zero gradients), 4
        # query stages of one head (TMA path) over one key tile
        ((1, 2, 1, 200, 70, 64, 64, True, (70,)), torch.bfloat16, "bhld"),
        ((1, 2, 1, 200, 70, 128, 128, True, None), torch.float16, "blhd"),
        # GQA with whole query stages per head: the dK/dV kernel's TMA boxes at head offsets
        ((1, 4, 2, 128, 150, 64, 64, True, None), torch.bfloat16, "blhd"),
        # fewer queries than keys, causal: 3 key tiles per dK/dV pass, the dQ ring wraps, the
        # query stages before the diagonal skipped
        ((1, 1, 1, 150, 300, 64, 64, True, None), torch.float16, "bhld"),
        ((1, 1, 1, 150, 300, 128, 128, True, None), torch.bfloat16, "blhd"),
    ],
    ids=["gqa-straddle-kl-d128", "gqa-straddle-kl-d64", "rows-without-keys-d64", "rows-without-keys-d128",
         "gqa-whole-stages", "causal-qlt-k-d64", "causal-qlt-k-d128"],
)
def test_sm90_backward_shapes(rnd, case, dtype, layout):
    _run(rnd, case, dtype, layout=layout)


@pytest.mark.parametrize("scale", [-0.3, 0.0])
def test_sm90_backward_any_finite_scale(rnd, scale):
    # A negative or zero scale must still hide masked keys (scaled first, masked after).
    B, H, Hkv, Lq, Lk, D = 1, 2, 1, 40, 150, 64
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, D, dtype=torch.bfloat16)
    check_against_reference(sm90_attention(rnd), q, k, v, True, torch.tensor([150], dtype=torch.int32), scale=scale)


def test_sm90_backward_large_logits(rnd):
    _run(rnd, (1, 2, 2, 70, 150, 64, 64, False, None), torch.bfloat16, layout="blhd", scale_inputs=30.0,
         large_logits=True)


@pytest.mark.parametrize("splits", [3])
def test_sm90_backward_split_dq(rnd, splits):
    # 5 dQ key tiles over 3 splits (one empty for the causal rows of the short key length), added
    # by the ordered reduction.
    _run(rnd, (2, 4, 2, 5, 600, 64, 64, True, (600, 70)), torch.bfloat16, splits=splits)


def test_sm90_backward_hidden_keys_never_leak(emu):
    # Keys past key_lengths hold garbage (NaN in K, inf in V): no gradient may see them, theirs are 0.
    B, H, Hkv, Lq, Lk, D = 2, 4, 2, 40, 200, 64
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, D, dtype=torch.float16, requires_grad=False)
    kl = torch.tensor([150, 37], dtype=torch.int32)
    for bb, n in enumerate(kl.tolist()):
        k[bb, :, n:] = float("nan")
        v[bb, :, n:] = float("inf")
    qp, kp, vp = padded(q), padded(k), padded(v)
    # out and lse from the reference (on the visible keys only), so that this checks the backward
    # alone: the sm90 forward is not the subject here.
    kc, vc = k.clone(), v.clone()
    for bb, n in enumerate(kl.tolist()):
        kc[bb, :, n:] = 0
        vc[bb, :, n:] = 0
    o64, lse = reference.attention_forward(q.double(), kc.double(), vc.double(), 0.125, True, kl, upcast=True)
    out, lse = padded(o64.to(q.dtype)), lse.float().contiguous()
    emu.schedule(3)
    dout = padded(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(q.dtype))
    dq, dk, dv = emu.backward(dout, qp, kp, vp, out, lse, 0.125, True, kl)
    emu.schedule(None)
    assert torch.isfinite(dq).all()
    for bb, n in enumerate(kl.tolist()):
        assert torch.isfinite(dk[bb, :, :n]).all() and torch.isfinite(dv[bb, :, :n]).all()
        assert (dk[bb, :, n:] == 0).all() and (dv[bb, :, n:] == 0).all()


def test_sm90_backward_is_deterministic_across_schedules(emu):
    q, k, v = make_inputs(1, 4, 2, 70, 200, 64, 64, dtype=torch.float16, requires_grad=False)
    qp, kp, vp = padded(q), padded(k), padded(v)
    emu.schedule(None)
    out, lse = emu.forward(qp, kp, vp, 0.125, True, None)
    dout = padded(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(q.dtype))
    grads = []
    for seed in (11, 12):
        emu.schedule(seed)
        grads.append([g.clone() for g in emu.backward(dout, qp, kp, vp, out, lse, 0.125, True, None)])
    emu.schedule(None)
    for a, b in zip(*grads):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# The fused kernel (attn_bwd_fused_sm90_kernel.cuh): dK, dV and dQ in one CTA per key block, dQ by
# bulk fp32 reduce-adds ordered by semaphores. Under the random schedule up to three CTAs run at
# once (cuda_emu.h), so the adds of different key blocks into one row tile race unless ordered.
# ---------------------------------------------------------------------------------------------

FUSED_CASES = [
    # each hard case once, alternating dtypes (the shapes below add the fused kernel's own paths)
    *[(c, DTYPES[i % 2], "bhld") for i, c in enumerate(SM90_HARD)],
    # GQA packed rows straddling heads (the loaders' plain path), key lengths incl. 0, causal,
    # several key blocks adding into each row tile
    ((2, 8, 2, 45, 300, 128, 128, True, (260, 0)), torch.bfloat16, "bhld"),
    ((2, 8, 2, 45, 300, 64, 64, True, (197, 0)), torch.float16, "blhd"),
    # more queries than keys, causal: leading rows see no key (zero dQ from the untouched sums)
    ((1, 2, 1, 200, 70, 64, 64, True, (70,)), torch.bfloat16, "bhld"),
    # fewer queries than keys, causal: row tiles skipped before the diagonal, 3 key blocks, the
    # Q/dO ring and both dS^T buffers wrap
    ((1, 1, 1, 150, 300, 128, 128, True, None), torch.float16, "blhd"),
    ((1, 2, 2, 300, 300, 64, 64, False, None), torch.bfloat16, "bhld"),
]


@pytest.mark.parametrize("i_case", range(len(FUSED_CASES)),
                         ids=[f"{case_id(c)}-{str(d)[6:]}-{lay}" for c, d, lay in FUSED_CASES])
def test_sm90_fused_backward_against_reference(rnd, i_case):
    case, dtype, layout = FUSED_CASES[i_case]
    _run(rnd, case, dtype, layout=layout, fused=True)


def test_sm90_fused_backward_nondeterministic_mode(rnd):
    # The unordered adds: the same numbers up to the order of fp32 additions.
    _run(rnd, (1, 4, 2, 70, 400, 64, 64, False, (400,)), torch.bfloat16, fused=True, deterministic=False)


def test_sm90_fused_backward_large_logits(rnd):
    _run(rnd, (1, 2, 2, 70, 150, 128, 128, False, None), torch.bfloat16, layout="blhd", scale_inputs=30.0,
         large_logits=True, fused=True)


def test_sm90_fused_backward_hidden_keys_never_leak(emu):
    # Keys past key_lengths hold garbage (NaN in K, inf in V): no gradient may see them, theirs are 0.
    B, H, Hkv, Lq, Lk, D = 2, 4, 2, 40, 300, 64
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, D, dtype=torch.float16, requires_grad=False)
    kl = torch.tensor([150, 37], dtype=torch.int32)
    for bb, n in enumerate(kl.tolist()):
        k[bb, :, n:] = float("nan")
        v[bb, :, n:] = float("inf")
    kc, vc = k.clone(), v.clone()
    for bb, n in enumerate(kl.tolist()):
        kc[bb, :, n:] = 0
        vc[bb, :, n:] = 0
    o64, lse = reference.attention_forward(q.double(), kc.double(), vc.double(), 0.125, True, kl, upcast=True)
    out, lse = padded(o64.to(q.dtype)), lse.float().contiguous()
    dout = padded(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(q.dtype))
    emu.schedule(5)
    dq, dk, dv = emu.backward(dout, padded(q), padded(k), padded(v), out, lse, 0.125, True, kl, fused=True)
    emu.schedule(None)
    assert torch.isfinite(dq).all()
    for bb, n in enumerate(kl.tolist()):
        assert torch.isfinite(dk[bb, :, :n]).all() and torch.isfinite(dv[bb, :, :n]).all()
        assert (dk[bb, :, n:] == 0).all() and (dv[bb, :, n:] == 0).all()


# Three row tiles (64 rows) per head group that 4 key blocks each add into: an add left in flight
# at one tile is overtaken while its block works on the next.
_ORDER_SHAPE = dict(B=1, H=2, Hkv=2, Lq=130, Lk=500, D=128)
_ORDER_SEEDS = (21, 22, 23, 24, 25, 26)


def _order_runs(emu, seeds, shape=_ORDER_SHAPE, causal=False, **bwd):
    s = shape
    q, k, v = make_inputs(s["B"], s["H"], s["Hkv"], s["Lq"], s["Lk"], s["D"], s["D"], dtype=torch.bfloat16,
                          requires_grad=False)
    qp, kp, vp = padded(q), padded(k), padded(v)
    emu.schedule(None)
    out, lse = emu.forward(qp, kp, vp, 0.1, causal, None)
    dout = padded(torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(q.dtype))
    runs = []
    try:
        for seed in seeds:
            emu.schedule(seed)
            ws = []
            grads = emu.backward(dout, qp, kp, vp, out, lse, 0.1, causal, None, fused=True, workspace=ws, **bwd)
            # [fp32 dQ sums, dq, dk, dv]: the sums' bits first (a bf16 dq rounds most of them away)
            runs.append([ws[0]] + [g.clone() for g in grads])
    finally:
        emu.schedule(None)
    return runs


def test_sm90_fused_backward_is_bit_identical_across_schedules(emu):
    # Schedules with 1 to 3 CTAs in flight, the bulk adds landing at random moments: the ordered
    # adds give the same bits every time, and the same as the fixed schedule (one CTA at a time).
    runs = _order_runs(emu, (None,) + _ORDER_SEEDS)
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


def _differs_across_schedules(runs):
    return any(not torch.equal(r[0], runs[0][0]) for r in runs[1:])


def test_sm90_fused_backward_unordered_adds_differ_across_schedules(emu):
    # The check above can fail: the same seeds without the ordering (the non-deterministic mode,
    # and the deliberate bugs 1 "no wait" and 2 "released before the adds complete") give
    # different fp32 dQ sums for some schedule. (dK and dV have no cross-CTA sums: always identical.)
    for bwd in (dict(deterministic=False), dict(fault=1), dict(fault=2)):
        runs = _order_runs(emu, _ORDER_SEEDS, **bwd)
        assert _differs_across_schedules(runs), bwd
        for r in runs[1:]:
            assert torch.equal(r[2], runs[0][2]) and torch.equal(r[3], runs[0][3])


def test_sm90_fused_backward_early_buffer_release_fails(emu):
    # Deliberate bug 3: the dQ writer frees the shared dQ tile before its bulk add has read it.
    # Causal, Lq = Lk: key block 1 starts at row tile 2 and waits there for block 0 to add tiles
    # 0-2 first; meanwhile its consumers finish tile 3 and overwrite the shared tile, so a
    # schedule with both blocks in flight adds tile 3's numbers as tile 2's. The ordered kernel
    # is bit-identical across schedules (above), so any difference from its sums is a wrong read.
    shape = dict(B=1, H=1, Hkv=1, Lq=320, Lk=320, D=64)
    good = _order_runs(emu, (None,), shape, True)[0][0]
    bad = _order_runs(emu, _ORDER_SEEDS, shape, True, fault=3)
    assert any(not torch.equal(r[0], good) for r in bad)
    # wrong numbers, not a rounding: some sum off by far more than fp32 reordering could make
    assert max((r[0] - good).abs().max().item() for r in bad) > 1e-3 * good.abs().max().item()


# CTAs out of block order (cuda_emu.h Dispatch). The ordered dQ adds make key block n of a row
# tile wait for key block n - 1. Taken from the block index, that relies on the hardware starting
# CTAs in block order, which CUDA does not promise: started in reverse with 2 resident (as 132 SMs
# hold a first wave of a 2,048-CTA grid), the two resident CTAs wait on turns of CTAs that cannot
# start before one of them ends. Taken from a ticket at the CTA's start (the kernel), every lower
# ticket's CTA has started, and the results are the in-order run's bits.
def test_sm90_fused_backward_out_of_order_dispatch_needs_tickets(emu):
    ref = _order_runs(emu, (None,))[0]
    with dispatched(emu.lib, "reversed", resident=2):
        with pytest.raises(RuntimeError, match="dispatch-order deadlock") as err:
            _order_runs(emu, (None,), fault=4)  # work item = block index: the protocol's assumption
        assert "spin wait" in str(err.value)
        runs = _order_runs(emu, (None,))
    with dispatched(emu.lib, "shuffled", resident=3, seed=5):
        runs += _order_runs(emu, (_ORDER_SEEDS[0],))
    for r in runs:
        for a, b in zip(ref, r):
            assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# Which family serves a backward call
# ---------------------------------------------------------------------------------------------


# The faked call properties of the backward's family tests: the forward's 0 to 4 (none,
# attn_mask, dropout, window, top_left) and 5 the mask's gradient.
BWD_FAMILY_MODES = {**{m: FAMILY_MODES[m] for m in range(5)}, 5: dict(mask=_DUMMY.data_ptr(), dmask=_DUMMY.data_ptr())}


@pytest.mark.parametrize(
    "cc,compiled,D,splits,mode,Hkv,k_head_stride,q_head_stride,want",
    [
        ((9, 0), 1, 128, 1, 0, 2, 12800, 6400, 1),  # Hopper, a call the family serves
        ((9, 0), 1, 64, 3, 0, 2, 6400, 3200, 1),    # split dQ keys
        ((9, 0), 1, 64, 1, 0, 1, 0, 3200, 1),       # a single KV head: its stride does not matter
        ((8, 0), 1, 128, 1, 0, 2, 12800, 6400, 0),  # A100: mma.sync
        ((8, 9), 1, 64, 1, 0, 2, 6400, 3200, 0),    # Ada: mma.sync
        ((10, 0), 1, 64, 1, 0, 2, 6400, 3200, 0),   # sm_90a code does not run on 10.0
        ((9, 0), 0, 64, 1, 0, 2, 6400, 3200, 0),    # built without the sm_90a pass
        ((9, 0), 1, 96, 1, 0, 2, 9600, 4800, 0),    # a head dim the backward lacks
        ((9, 0), 1, 64, 1, 1, 2, 6400, 3200, 0),    # attn_mask
        ((9, 0), 1, 64, 1, 2, 2, 6400, 3200, 0),    # dropout
        ((9, 0), 1, 64, 1, 3, 2, 6400, 3200, 0),    # window
        ((9, 0), 1, 64, 1, 4, 2, 6400, 3200, 0),    # top-left causal
        ((9, 0), 1, 64, 1, 5, 2, 6400, 3200, 0),    # the mask's gradient
        ((9, 0), 1, 64, 1, 0, 2, 0, 3200, 0),       # K broadcast over heads: no tensor map
        ((9, 0), 1, 64, 1, 0, 2, 6400, 0, 0),       # q broadcast over heads: no tensor map
    ],
)
def test_bwd_family_choice_by_compute_capability(emu, cc, compiled, D, splits, mode, Hkv, k_head_stride,
                                                  q_head_stride, want):
    modes = ctypes.byref(mode_params(**BWD_FAMILY_MODES[mode]))
    got = emu.lib.mhk_emu_bwd_family(cc[0], cc[1], compiled, D, splits, modes, Hkv, k_head_stride, q_head_stride)
    assert got == want


# ---------------------------------------------------------------------------------------------
# The SASS check of tools/check_cuda_build.py guards the backward kernels too (synthetic SASS;
# the real compile runs in tests/test_cuda_build.py)
# ---------------------------------------------------------------------------------------------

_DKDV = "_ZN7mhakern4cuda4sm9025attn_bwd_dkdv_sm90_kernelI6__halfLi64EEEvNS1_16BwdDkvParamsSm90E"


def _check_tool():
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_cuda_build", ROOT / "tools" / "check_cuda_build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    "body,smem,needle",
    [
        (["HGMMA.64x64x16.F32 R24, gdesc[UR16], R24, gsb0", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "@!P0 BRA 0x00", "EXIT"],
         {("attn_bwd_dkdv_sm90_kernel", 64): 68136, 64: 240 * 1024}, None),
        (["HGMMA.64x64x16.F32 R24, gdesc[UR16], R24", "FADD R1, R2, R3", "@!P0 BRA 0x10", "EXIT"],
         {("attn_bwd_dkdv_sm90_kernel", 64): 68136}, "no HGMMA inside any loop"),
        (["HGMMA.64x64x16.F32 R24, gdesc[UR16], R24", "LDL R2, [R1]", "@!P0 BRA 0x00", "EXIT"],
         {("attn_bwd_dkdv_sm90_kernel", 64): 68136}, "local-memory instructions"),
        # its own row, not the forward's (keyed by head dim alone), decides
        (["HGMMA.64x64x16.F32 R24, gdesc[UR16], R24", "@!P0 BRA 0x00", "EXIT"],
         {("attn_bwd_dkdv_sm90_kernel", 64): 240 * 1024, 64: 1024}, "of shared memory"),
        (["HGMMA.64x64x16.F32 R24, gdesc[UR16], R24", "@!P0 BRA 0x00", "EXIT"], {64: 1024},
         "dynamic shared memory unknown"),
    ],
    ids=["good", "hgmma-outside-loop", "local-memory", "smem-over-227KB", "smem-row-missing"],
)
def test_sass_check_guards_the_backward_kernels(body, smem, needle):
    tool = _check_tool()
    sass = "\n".join(["\tcode for sm_90a", f"\t\tFunction : {_DKDV}"]
                     + [f"        /*{16 * i:04x}*/                   {ins} ;" for i, ins in enumerate(body)])
    log = (f"ptxas info    : Compiling entry function '{_DKDV}' for 'sm_90a'\n"
           f"ptxas info    : Function properties for {_DKDV}\n"
           "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
           "ptxas info    : Used 168 registers, used 1 barriers\n")
    result = {"src": "attn_bwd_sm90_fp16_d64.cu", "rc": 0, "log": log, "facts": tool.sass_facts_text(sass)}
    rows, problems, _ = tool.check_sm90([result], smem)
    assert len(rows) == 1 and rows[0]["kernel"] == "attn_bwd_dkdv_sm90_kernel" and rows[0]["D"] == 64
    if needle is None:
        assert problems == [], problems
    else:
        assert any(needle in p for p in problems), problems


_FUSED = "_ZN7mhakern4cuda4sm9026attn_bwd_fused_sm90_kernelI6__halfLi64EEEvNS1_18BwdFusedParamsSm90E"
_CONVERT = "_ZN7mhakern4cuda4sm9031attn_bwd_dq_convert_sm90_kernelI6__halfLi64EEEvNS1_18BwdFusedParamsSm90E"


@pytest.mark.parametrize(
    "kernel,n_loop_hgmma,loop_extra,needle",
    [
        (_FUSED, 32, [], None),
        (_FUSED, 40, [], "the config's 5 products per tile are 32"),  # a product recomputed (7 per tile)
        (_FUSED, 24, [], "the config's 5 products per tile are 32"),  # a product left out of the loop
        (_FUSED, 32, ["STL [R1], R2"], "local-memory instructions"),
        (_CONVERT, 0, [], None),  # the conversion kernel: no wgmma, no loop required
    ],
    ids=["good", "seven-products", "product-outside-loop", "local-memory", "convert-helper"],
)
def test_sass_check_guards_the_fused_backward(kernel, n_loop_hgmma, loop_extra, needle):
    # The fused kernel's main loop must hold exactly its 5 products' HGMMA (the config printer's
    # kHgmmaPerStage; 32 here), no local memory; the conversion kernel is exempt from HGMMA.
    tool = _check_tool()
    body = ["HGMMA.64x64x16.F32 R24, gdesc[UR16], R24, gsb0"] * n_loop_hgmma + loop_extra + ["@!P0 BRA 0x00"]
    sass = _sass_listing(kernel, body + (_DQ_WRITER if kernel == _FUSED else ["EXIT"]))
    log = (f"ptxas info    : Compiling entry function '{kernel}' for 'sm_90a'\n"
           f"ptxas info    : Function properties for {kernel}\n"
           "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
           "ptxas info    : Used 168 registers, used 1 barriers\n")
    result = {"src": "attn_bwd_sm90_fp16_d64.cu", "rc": 0, "log": log, "facts": tool.sass_facts_text(sass)}
    smem = {("attn_bwd_fused_sm90_kernel", 64): 200 * 1024, ("attn_bwd_dq_convert_sm90_kernel", 64): 0,
            ("hgmma", "attn_bwd_fused_sm90_kernel", 64): 32}
    rows, problems, _ = tool.check_sm90([result], smem)
    assert len(rows) == 1
    if needle is None:
        assert problems == [], problems
    else:
        assert any(needle in p for p in problems), problems


# The dQ writer's pass of a row tile's turn as ptxas emits it (nvcc 13.0, sm_90a, the fused
# kernels of csrc/cuda/sm90/): the bulk add and its wait_group.read, then, in the block that
# only the deterministic mode runs, wait_group 0 (DEPBAR + CCTL), the proxy fence, the release.
# "{end}" is the address of the instruction after the release.
_DQ_WRITER = ["UBLKRED.G.S.ADD.F32.RN [UR8], [UR6], UR7", "DEPBAR.LE SB0, 0x0", "BAR.ARV 0x3, 0x120",
              "@P0 BRA {end}", "DEPBAR.LE SB0, 0x0", "CCTL.IVALL", "FENCE.VIEW.ASYNC.G", "IADD3 R3, P0, R7, R4, RZ",
              "MEMBAR.ALL.CTA", "MEMBAR.ALL.GPU", "ERRBAR", "REDG.E.ADD.STRONG.GPU desc[UR32][R2.64], R7", "EXIT"]


def _sass_listing(kernel, body):
    """A cuobjdump -sass listing of one sm_90a kernel: body's instructions 16 bytes apart; "{end}"
    in an instruction is the address of the one after the release (REDG)."""
    end = next((16 * (i + 1) for i, t in enumerate(body) if t.startswith("REDG")), 16 * len(body))
    return "\n".join(["\tcode for sm_90a", f"\t\tFunction : {kernel}"]
                     + [f"        /*{16 * i:04x}*/                   {ins.format(end=f'0x{end:x}')} ;"
                        for i, ins in enumerate(body)])


def _writer_variant(name):
    w = list(_DQ_WRITER)
    wait, cctl, fence, rel = (w.index("DEPBAR.LE SB0, 0x0", 2), w.index("CCTL.IVALL"), w.index("FENCE.VIEW.ASYNC.G"),
                              w.index("MEMBAR.ALL.GPU"))
    if name == "release-before-wait":  # the turn passed, then the wait: another CTA's adds may land first
        return w[:wait] + w[fence:-1] + w[wait:fence] + ["EXIT"]
    if name == "read-wait-only":  # wait_group.read: the source read, the adds perhaps not performed
        return w[:cctl] + w[cctl + 1:]
    if name == "no-proxy-fence":
        return w[:fence] + w[fence + 1:]
    if name == "fence-after-membar":
        return w[:fence] + w[fence + 1:rel + 1] + [w[fence]] + w[rel + 1:]
    if name == "no-wait-in-block":  # the release path relies on the .read wait before the branch
        return w[:wait] + w[wait + 2:]
    raise ValueError(name)


@pytest.mark.parametrize("variant", ["release-before-wait", "read-wait-only", "no-proxy-fence", "fence-after-membar",
                                     "no-wait-in-block"])
def test_sass_check_asserts_the_dq_writers_order(variant):
    # The fused kernel's release of a row tile's turn must follow, in its basic block, the bulk
    # adds' completion (wait_group 0), then the proxy fence; each reordering fails the gate.
    tool = _check_tool()
    good = tool.sass_reader.parse_functions(_sass_listing(_FUSED, _DQ_WRITER))[(_FUSED, 90)]
    lines, problems = tool.sass_reader.dq_writer_order(good)
    assert problems == [] and lines[-1].endswith("REDG.E.ADD.STRONG.GPU desc[UR32][R2.64], R7")
    bad = tool.sass_reader.parse_functions(_sass_listing(_FUSED, _writer_variant(variant)))[(_FUSED, 90)]
    assert tool.sass_reader.dq_writer_order(bad)[1], variant


def test_sass_check_catches_a_reordered_dq_writer_in_the_compiled_kernel(tmp_path):
    # The real kernel compiled by nvcc with its release moved before the wait for the adds (a
    # patched copy of the sources): the gate that passes the kernel as written (tests/
    # test_cuda_build.py's full check) fails this one.
    import shutil
    import subprocess

    from cuda_emulator_harness import find_nvcc

    tool = _check_tool()
    nvcc = find_nvcc()
    obj = nvcc and tool.find_cuobjdump(nvcc)
    if not nvcc or not obj:
        pytest.skip("nvcc and cuobjdump (the CUDA compiler and disassembler) are needed")
    src = tmp_path / "csrc"
    shutil.copytree(ROOT / "csrc", src, ignore=shutil.ignore_patterns("*.json", "*.o", "*.so"))
    kern = src / "cuda" / "sm90" / "attn_bwd_fused_sm90_kernel.cuh"
    text = kern.read_text()
    wait = "          if (!MHK_FUSED_FAULT(2)) bulk_wait_done();  // the adds are performed before the next key block's\n"
    release = "          fence_proxy_async_global();\n          sem_release_inc(P.sem + head_tiles + mt);\n"
    assert text.count(wait + release) == 1, "the dQ writer's release changed: update this test's patch"
    kern.write_text(text.replace(wait + release, release + wait))
    cubin = tmp_path / "k.cubin"
    res = subprocess.run([nvcc, *tool.NVCC_FLAGS, tool.SM90_GENCODE, "-cubin", str(src / "cuda" / "sm90" /
                          "attn_bwd_sm90_fp16_d64.cu"), "-o", str(cubin)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    funcs = tool.sass_functions(obj, cubin)
    fused = [ins for (name, _), ins in funcs.items() if "attn_bwd_fused_sm90_kernel" in name]
    assert len(fused) == 1
    problems = tool.sass_reader.dq_writer_order(fused[0])[1]
    assert any("DEPBAR.LE SB0, 0x0" in p for p in problems), problems


def test_fused_backward_config_states_five_products():
    # The gate's expectation comes from the kernel's config (one fact): 5 products per stage.
    from cuda_emulator_harness import cuda_include_dir

    inc = cuda_include_dir()
    if inc is None:
        pytest.skip(missing_toolchain())
    smem = _check_tool().sm90_dynamic_smem(inc)
    assert smem is not None
    for D in BWD_DIMS:
        # S^T, dP^T over D; dV, dK over the 64 rows; dQ over the keys of one consumer's part
        # (all 128 at D 128, its own 64 at D 64)
        assert smem[("hgmma", "attn_bwd_fused_sm90_kernel", D)] == 2 * (D // 16) + 2 * 4 + (128 if D > 64 else 64) // 16
        assert smem[("attn_bwd_fused_sm90_kernel", D)] <= 227 * 1024
