"""The sm_90a (Hopper) CUDA family, checked without a GPU.

* The emulated sm_90 instructions (tests/cuda_emulator/cuda_emu_sm90.h) against plain loops:
  TMA loads into 128-byte swizzled tiles, then wgmma from shared-memory descriptors (K-major A
  and B) or with A in registers and B N-major, must give the plain product; a wgmma without
  wgmma.fence, an mbarrier whose transaction count never reaches zero, a setmaxnreg plan over
  the register file, a named barrier nobody arrives at and one named with two thread counts
  are errors.
* The forward kernels (csrc/cuda/sm90/, every instantiation) under the emulator's seeded random
  schedule, on the hard cases and on shapes that wrap the K and V rings, cross the causal
  diagonal in several query tiles and straddle heads with packed GQA rows, split-K, negative
  and zero scales, against the float64 reference by the project's tolerance rule, on the
  persistent grid (2 emulated SMs: most calls loop over several work items per CTA). Tensors
  sit in NaN-padded buffers: a read outside them poisons the result, a write outside them is
  detected. Deliberate defects (a K, V or Q buffer released early) must fail.
* Packed sequences (the varlen kernel) against the per-sequence float64 reference: empty
  sequences on either side, one-token ones, sequences of more rows or keys than a tile,
  Lq_s != Lk_s, causal, GQA and MQA, every head dim; on one emulated SM (one CTA walking every
  item, the skipped row tiles included) bit for bit as on many; another sequence's keys
  (NaN keys, inf values) change no bit, and TMA reads no key tile wholly outside a sequence's
  visible keys (the emulator's read guard restricted to the tokens it may load).
* The family choice by compute capability (faked capabilities).

What emulation cannot show (speed, register allocation, whether the hardware matches the
documented layouts) is for tools/check_cuda_build.py (SASS) and a GPU.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from mhakern import reference
from mhakern.backends import Modes

from attn_testing import HARD_CASES, case_id, check_against_reference, make_inputs, rule_check
from cuda_emulator_harness import (
    CUDA_SRC,
    ELEM,
    EMULATOR,
    _generator,
    _ptr,
    _st,
    build_units,
    mode_params,
    missing_toolchain,
    padded,
    padded_empty,
    use_random_schedule,
)

ROOT = Path(__file__).resolve().parent.parent
SM90_INSTANCES = _generator().sm90_instances((ROOT / "csrc" / "capabilities.h").read_text())
SM90_DIMS = tuple(sorted({d for _, d in SM90_INSTANCES}))
TAG = {torch.float16: "fp16", torch.bfloat16: "bf16"}
SMEM_LIMIT_SM90 = 227 * 1024
UNITS = ("emu_entry.cpp", "emu_schedule.cpp", "emu_sm90_entry.cpp")


def build_sm90(cache_dir: Path) -> Path:
    units = [EMULATOR / u for u in UNITS]
    units += [CUDA_SRC / "sm90" / f"attn_fwd_sm90_{t}_d{d}.cu" for t, d in SM90_INSTANCES]
    # The directory tests/cuda_emulator_harness.py builds in: the runtime objects are shared.
    return build_units(cache_dir, units, "libmhk_emu_sm90.so")


class Sm90Emulator:
    def __init__(self, path: Path):
        self.lib = lib = ctypes.CDLL(str(path))
        lib.mhk_emu_last_error.restype = ctypes.c_char_p
        lib.mhk_emu_configure.argtypes = [ctypes.c_int, ctypes.c_longlong]
        lib.mhk_emu_schedule.argtypes = [ctypes.c_int, ctypes.c_ulonglong]
        lib.mhk_emu_schedule_knobs.argtypes = [ctypes.c_void_p]
        lib.mhk_emu_guard_reads.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        lib.mhk_sm90_selftest_wgmma.argtypes = [ctypes.c_int] * 3 + [ctypes.c_void_p] * 3
        # (major, minor, sm90_compiled, D, num_splits, modes, key_lengths, Hkv, k_head_stride)
        lib.mhk_emu_fwd_family.argtypes = [ctypes.c_int] * 5 + [ctypes.c_void_p] + [ctypes.c_int] * 2 + [
            ctypes.c_longlong]
        lib.mhk_emu_fwd_plan_splits.argtypes = [ctypes.c_int] * 10
        lib.mhk_emu_sm90_config.argtypes = [ctypes.c_int, ctypes.c_void_p]
        lib.mhk_emu_sm90_fwd_fault.argtypes = [ctypes.c_int]
        lib.mhk_emu_sm90_set_sms.argtypes = [ctypes.c_int]
        lib.mhk_emu_sm90_work_tiles.argtypes = [ctypes.c_int] * 7 + [ctypes.c_void_p, ctypes.c_int]

    def config(self, D: int) -> tuple:
        """(query rows, keys per stage, K stages, dynamic smem, V stages) of the compiled
        FwdConfigSm90<D>."""
        out = (ctypes.c_int * 5)()
        assert self.lib.mhk_emu_sm90_config(D, out) == 0
        return tuple(out)

    def fault(self, n: int) -> None:
        """The forward's deliberate defect for the next calls (attn_fwd_sm90_kernel.cuh
        MHK_SM90_FWD_FAULT: 1 K's stage released before S lands, 2 V's before P V lands)."""
        self.lib.mhk_emu_sm90_fwd_fault(n)

    def error(self) -> str:
        return self.lib.mhk_emu_last_error().decode()

    def schedule(self, seed) -> None:
        self.lib.mhk_emu_schedule(0 if seed is None else 1, 0 if seed is None else seed)

    def forward(self, q, k, v, scale, causal, key_lengths, splits=1, partials=None):
        """out, lse of the emulated forward; with `partials` (a list), the split-K fp32 partials
        (o_part, lse_part) are appended to it."""
        B, H, Lq, D = q.shape
        Hkv, Lk = k.shape[1], k.shape[2]
        out, guard = padded_empty(q)
        lse = torch.full((B, H, Lq), float("nan"))
        o_part = torch.full((splits, B, H, Lq, D), float("nan")) if splits > 1 else None
        l_part = torch.full((splits, B, H, Lq), float("nan")) if splits > 1 else None
        # TMA may read only k and v's buffers (their padding included: a box may cover it).
        bufs = [k, v]
        begin = (ctypes.c_ulonglong * 2)(*[x.untyped_storage().data_ptr() for x in bufs])
        end = (ctypes.c_ulonglong * 2)(*[x.untyped_storage().data_ptr() + x.untyped_storage().nbytes() for x in bufs])
        self.lib.mhk_emu_guard_reads(2, begin, end)
        self.lib.mhk_emu_configure(1, SMEM_LIMIT_SM90)
        rc = self.lib.mhk_emu_sm90_fwd(
            ELEM[q.dtype], D, _ptr(q), _st(q), _ptr(k), _st(k), _ptr(v), _st(v), _ptr(out), _st(out), _ptr(lse),
            _ptr(key_lengths), B, H, Hkv, Lq, Lk, ctypes.c_float(scale), int(causal), splits, _ptr(o_part),
            _ptr(l_part), None)
        self.lib.mhk_emu_guard_reads(0, None, None)
        if rc != 0:
            raise RuntimeError(f"emulated sm90 forward: {self.error()}")
        guard.check("out")
        if partials is not None:
            partials.append((o_part, l_part))
        return out, lse


    def forward_varlen(self, q, k, v, cq, ck, scale, causal, kv_tokens=None):
        """out (1, H, Tq, D), lse (1, H, Tq) of the emulated packed forward of q (1, H, Tq, D), k, v
        (1, Hkv, Tk, D) (views of packed (T, H, D) tensors, in NaN-padded buffers) with prefix
        sums cq, ck. kv_tokens: the [begin, end) key-token ranges TMA may read (default: all of
        k and v's buffers); a box that reads another token is an error."""
        _, H, Tq, D = q.shape
        Hkv, Tk = k.shape[1], k.shape[2]
        out, guard = padded_empty(q)
        lse = torch.full((1, H, Tq), float("nan"))
        if kv_tokens is None:
            ranges = [(x.untyped_storage().data_ptr(), x.untyped_storage().data_ptr() + x.untyped_storage().nbytes())
                      for x in (k, v)]
        else:  # token t of a (T, Hkv, D) tensor: bytes [t, t + 1) x its row stride
            ranges = [(x.data_ptr() + a * x.stride(2) * x.element_size(), x.data_ptr() + b * x.stride(2) * x.element_size())
                      for x in (k, v) for a, b in kv_tokens]
        begin = (ctypes.c_ulonglong * len(ranges))(*[a for a, _ in ranges])
        end = (ctypes.c_ulonglong * len(ranges))(*[b for _, b in ranges])
        self.lib.mhk_emu_guard_reads(len(ranges), begin, end)
        self.lib.mhk_emu_configure(1, SMEM_LIMIT_SM90)
        lens_q, lens_k = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
        packing = mode_params(cu_seqlens_q=cq.data_ptr(), cu_seqlens_k=ck.data_ptr(), num_seqs=len(cq) - 1,
                              max_seqlen_q=int(lens_q.max()) if len(lens_q) else 0,
                              max_seqlen_k=int(lens_k.max()) if len(lens_k) else 0)
        # B = 1, no key lengths, unsplit (the family's varlen kernel)
        rc = self.lib.mhk_emu_sm90_fwd(
            ELEM[q.dtype], D, _ptr(q), _st(q), _ptr(k), _st(k), _ptr(v), _st(v), _ptr(out), _st(out), _ptr(lse), None,
            1, H, Hkv, Tq, Tk, ctypes.c_float(scale), int(causal), 1, None, None, ctypes.byref(packing))
        self.lib.mhk_emu_guard_reads(0, None, None)
        if rc != 0:
            raise RuntimeError(f"emulated sm90 packed forward: {self.error()}")
        guard.check("out")
        return out, lse


@pytest.fixture(scope="module")
def emu(request):
    why = missing_toolchain()
    if why:
        pytest.skip(why)
    e = Sm90Emulator(build_sm90(Path(request.config.cache.mkdir("mhakern_cuda_emu"))))
    yield e
    e.schedule(None)


@pytest.fixture
def rnd(emu, request):
    use_random_schedule(emu, request.node.nodeid)
    yield emu
    emu.schedule(None)


# ---------------------------------------------------------------------------------------------
# The emulated instructions against plain loops
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [None, 5])
@pytest.mark.parametrize("variant", [0, 1], ids=["ss-kmajor", "rs-nmajor"])
@pytest.mark.parametrize("N", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tma_then_wgmma_is_the_plain_product(emu, variant, N, dtype, seed):
    g = torch.Generator().manual_seed(N + variant)
    A = torch.randn(64, 64, generator=g).to(dtype)
    # variant 0: B is (N, 64) with K inner, D = A B^T; variant 1: B is (64, N), D = A B
    B = torch.randn(N, 64, generator=g).to(dtype) if variant == 0 else torch.randn(64, N, generator=g).to(dtype)
    out = torch.full((64, N), float("nan"))
    emu.schedule(seed)
    rc = emu.lib.mhk_sm90_selftest_wgmma(variant, ELEM[dtype], N, _ptr(A), _ptr(B), _ptr(out))
    assert rc == 0, emu.error()
    want = A.double() @ (B.double().T if variant == 0 else B.double())
    # fp32 accumulation of 64 exact products: far below 1e-4 of the magnitudes here
    assert torch.allclose(out.double(), want, atol=1e-4, rtol=1e-5), (out.double() - want).abs().max()


@pytest.mark.parametrize("seed", [None, 3])
def test_tma_over_an_operand_in_flight_is_an_error(emu, seed):
    # A stage released before the wait that covers its last wgmma: the next copy into it lands
    # while the product may still read it. The emulator performs a wgmma at its covering wait,
    # so without this check such a copy could land first and still give the right answer (the
    # forward with its stage released before the P V wait passed every hard case).
    A = torch.randn(64, 64).to(torch.float16)
    B = torch.randn(64, 64).to(torch.float16)
    out = torch.zeros(64, 64)
    emu.schedule(seed)
    assert emu.lib.mhk_sm90_selftest_wgmma(4, 0, 64, _ptr(A), _ptr(B), _ptr(out)) == 1
    assert "a wgmma in flight still reads" in emu.error()


def test_wgmma_without_fence_is_an_error(emu):
    A = torch.zeros(64, 64, dtype=torch.float16)
    B = torch.zeros(64, 64, dtype=torch.float16)
    out = torch.zeros(64, 64)
    emu.schedule(None)
    assert emu.lib.mhk_sm90_selftest_wgmma(2, 0, 64, _ptr(A), _ptr(B), _ptr(out)) == 1
    assert "without a wgmma.fence" in emu.error()


def _seed_preempting(emu, p_preempt: int) -> int:
    """A random-schedule seed whose switch-point probability is p_preempt (units of 2^-32)."""
    knobs = (ctypes.c_uint * 3)()
    for seed in range(1, 200):
        emu.schedule(seed)
        emu.lib.mhk_emu_schedule_knobs(knobs)
        if knobs[0] == p_preempt:
            return seed
    raise AssertionError(f"no seed with p_preempt {p_preempt} in 1..199")


@pytest.mark.parametrize("seed", [None, 7, "busiest"])
def test_mbarrier_waits_for_every_transaction_byte(emu, seed):
    # The barrier is told 16 bytes fewer than the copies bring: its count goes negative, the
    # phase never completes, and the waiters are a deadlock, not a pass. "busiest": the seed
    # whose threads switch at a quarter of their switch points: 128 spinning waiters each
    # round must still not count as progress (they once did, and the launch never returned).
    A = torch.zeros(64, 64, dtype=torch.float16)
    B = torch.zeros(64, 64, dtype=torch.float16)
    out = torch.zeros(64, 64)
    if seed == "busiest":
        seed = _seed_preempting(emu, 1 << 30)
    emu.schedule(seed)
    assert emu.lib.mhk_sm90_selftest_wgmma(3, 0, 64, _ptr(A), _ptr(B), _ptr(out)) == 1
    assert "deadlock" in emu.error()


def test_setmaxnreg_checks_the_register_plan(emu):
    f = emu.lib.mhk_sm90_selftest_setmaxnreg
    # the forward's plan: 3 warpgroups from 168, producer to 40, consumers to 232 (and the
    # backward's, producer to 24, consumers to 240)
    assert f(3, 168, 40, 232) == 0, emu.error()
    assert f(3, 168, 24, 240) == 0, emu.error()
    # every consumer at 240 and no producer dec: 384 x 240 > 65536 can never be granted
    assert f(3, 168, 240, 240) == 1 and "deadlock" in emu.error()
    assert f(1, 168, 100, 100) == 1 and "multiple of 8" in emu.error()
    assert f(1, 168, 200, 200) == 0, emu.error()


@pytest.mark.parametrize("seed", [None, 9])
def test_named_barriers(emu, seed):
    emu.schedule(seed)
    assert emu.lib.mhk_sm90_selftest_named(0) == 0, emu.error()
    assert emu.lib.mhk_sm90_selftest_named(1) == 1 and "deadlock" in emu.error() and "bar.sync" in emu.error()
    assert emu.lib.mhk_sm90_selftest_named(2) == 1 and "different thread counts" in emu.error()
    emu.schedule(None)


# ---------------------------------------------------------------------------------------------
# The forward kernels against the float64 reference
# ---------------------------------------------------------------------------------------------


def sm90_attention(emu: Sm90Emulator, splits: int = 1):
    def fn(q, k, v, *, causal=False, key_lengths=None, scale=None, return_lse=False):
        D = q.shape[-1]
        scale = 1.0 / D**0.5 if scale is None else float(scale)
        kl = None if key_lengths is None else key_lengths.to(torch.int32).contiguous()
        out, lse = emu.forward(padded(q), padded(k), padded(v), scale, causal, kl, splits)
        out = out.clone()
        return (out, lse) if return_lse else out

    return fn


def _run(emu, case, dtype, layout="bhld", scale_inputs=1.0, scale=None, splits=1):
    B, H, Hkv, Lq, Lk, D, Dv, causal, kl = case
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, Dv, dtype=dtype, layout=layout, scale_inputs=scale_inputs)
    kl_t = None if kl is None else torch.tensor(kl, dtype=torch.int32)
    check_against_reference(sm90_attention(emu, splits), q, k, v, causal, kl_t, scale=scale, grads=False)


SM90_HARD = [c for c in HARD_CASES if c[5] == c[6] and c[5] in SM90_DIMS]
# Each head dim in one dtype here, the other in the shape tests below.
DTYPE_FOR_D = {d: (torch.bfloat16, torch.float16)[i % 2] for i, d in enumerate(SM90_DIMS)}
OTHER_DTYPE = {d: torch.float16 if t == torch.bfloat16 else torch.bfloat16 for d, t in DTYPE_FOR_D.items()}


@pytest.mark.parametrize("case", SM90_HARD, ids=case_id)
def test_sm90_forward_hard_cases(rnd, case):
    _run(rnd, case, DTYPE_FOR_D[case[5]])


# Head dim 256 (80 keys per stage, capabilities.h sm90_fwd_tiles) on the hard cases' shapes:
# length 1, 17 and 113, Lq != Lk both ways, causal with leading rows that see no key, key
# lengths with 0, MQA and GQA decode. The dtypes alternate so that both instances run.
SM90_HARD_D256 = [c[:5] + (256, 256) + c[7:] for c in HARD_CASES
                  if c[3] in (1, 17, 19, 37, 113) and c[5] == c[6]]


@pytest.mark.parametrize("case", SM90_HARD_D256, ids=case_id)
def test_sm90_forward_d256_hard_cases(rnd, case):
    _run(rnd, case, (torch.bfloat16, torch.float16)[SM90_HARD_D256.index(case) % 2])


@pytest.mark.parametrize(
    "case,layout,scale_inputs",
    [
        # 3 query tiles crossing the causal diagonal, 5 key tiles: the 2-stage ring wraps twice,
        # causal tiles skipped, strided (B, L, H, D) operands, a partial last key tile
        ((1, 1, 1, 300, 560, 64, 64, True, None), "blhd", 1.0),
        # GQA: 4 query heads x 45 rows packed and straddling a tile edge, key lengths incl. 0
        ((2, 8, 2, 45, 300, 128, 128, True, (300, 0)), "bhld", 1.0),
        # more queries than keys, causal: the leading rows see no key (out 0, lse -inf)
        ((1, 2, 1, 200, 70, 64, 64, True, (70,)), "bhld", 1.0),
        # large logits: the online softmax must not overflow
        ((1, 2, 2, 70, 260, 128, 128, False, None), "blhd", 30.0),
        # D 256 (80 keys per stage): 3 query tiles across the causal diagonal, 6 key tiles with
        # a partial last one (420 = 5 x 80 + 20), the ring wrapping thrice, strided operands
        ((1, 1, 1, 300, 420, 256, 256, True, None), "blhd", 1.0),
        # D 256, GQA rows straddling a tile edge with large logits
        ((1, 6, 2, 45, 170, 256, 256, False, (170,)), "bhld", 30.0),
    ],
    ids=["ring-wraps-causal-blhd", "gqa-straddle-kl", "rows-without-keys", "large-logits", "d256-ring-wraps-causal-blhd",
         "d256-gqa-large-logits"],
)
def test_sm90_forward_shapes(rnd, case, layout, scale_inputs):
    _run(rnd, case, OTHER_DTYPE[case[5]], layout=layout, scale_inputs=scale_inputs)


@pytest.mark.parametrize("scale,case,splits", [
    (-0.3, (1, 2, 1, 40, 150, 64, 64, True, (150,)), 1),
    (0.0, (1, 2, 1, 40, 150, 64, 64, True, (150,)), 1),
    # the scale folded into the exponent: a negative scale negates Q as it is loaded (row
    # maxima on raw scores), across tiles, a key length and split-K
    (-1.1, (2, 4, 2, 70, 300, 128, 128, True, (300, 171)), 2),
], ids=["negative", "zero", "negative-d128-split"])
def test_sm90_forward_any_finite_scale(rnd, scale, case, splits):
    # A negative or zero scale must still hide masked keys.
    _run(rnd, case, torch.bfloat16, scale=scale, splits=splits)


@pytest.mark.parametrize("splits", [3, 5])
def test_sm90_split_k_combines_through_lse(rnd, splits):
    # 5 key tiles over 3 or 5 splits; causal with a short key length leaves some splits with no
    # visible key (lse -inf partials), key length 0 leaves every split empty.
    _run(rnd, (2, 4, 2, 5, 600, 64, 64, True, (600, 70)), torch.bfloat16, splits=splits)
    _run(rnd, (1, 4, 4, 3, 560, 128, 128, False, (0,)), torch.float16, splits=splits)
    # D 256: 7 key tiles of 80; the shared combine kernel (csrc/cuda/common/aux_kernels.cuh) at a
    # head dim the mma.sync family does not compile
    _run(rnd, (1, 4, 2, 3, 540, 256, 256, True, (540,)), torch.bfloat16, splits=splits)


# (D, Lk): one CTA (8 query heads x 1 row over one KV head) on 132 SMs, keys long enough to split.
# D 128 at 17 key stages: the mma.sync tiles (32 keys per step) planned 8 splits, and the sm90
# kernel's ceil-divided shares (3 stages each) left the last two empty.
PLAN_SHAPES = [(64, 128 * 17), (128, 128 * 17), (256, 80 * 17 + 30)]


@pytest.mark.parametrize("D,Lk", PLAN_SHAPES, ids=[f"d{d}" for d, _ in PLAN_SHAPES])
def test_sm90_split_plan_uses_the_family_tiles(rnd, D, Lk):
    bm, bn, stages, _, _ = rnd.config(D)
    B, H, Hkv, Lq, sms = 1, 8, 1, 1, 132
    splits = rnd.lib.mhk_emu_fwd_plan_splits(9, 0, 1, D, B, Hkv, H // Hkv, Lq, Lk, sms)
    # what capabilities.h's planner gives with the compiled config's tiles
    n_all = -(-Lk // bn)
    assert splits == max(1, min(-(-2 * sms // 1), n_all // 8)), (splits, n_all)
    assert splits >= 2
    per = -(-n_all // splits)
    assert (splits - 1) * per < n_all, "a split with no key tile"
    # The planned splits, run: every split saw keys (no causal, no key length: a finite lse in
    # every row of every split), and the combined result is right.
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, D, dtype=torch.bfloat16)
    parts = []

    def fn(q, k, v, *, causal=False, key_lengths=None, scale=None, return_lse=False):
        out, lse = rnd.forward(padded(q), padded(k), padded(v), 1.0 / D**0.5 if scale is None else float(scale),
                               causal, None, splits, parts)
        return (out.clone(), lse) if return_lse else out.clone()

    check_against_reference(fn, q, k, v, False, None, grads=False)
    assert parts and all(torch.isfinite(lp).all() for _, lp in parts)
    if D == 128:
        # the plan with the mma.sync main kernel's tiles (32 keys per step: what the host once
        # planned a sm90 call with), had the sm90 kernel run it: a split with no key tile
        old = max(1, min(-(-2 * sms // 1), -(-Lk // 32) // 8, 128))
        assert (old - 1) * -(-n_all // old) >= n_all


@pytest.mark.parametrize("Hkv,Lk,want90", [(8, 131072, 4), (4, 65536, 8), (4, 1 << 20, 8), (4, 4096, 4)])
def test_sm90_decode_splits_fill_whole_waves(emu, Hkv, Lk, want90):
    # The headline decode rows (B 4, 32 query heads, one query, D 128) on faked devices of 132
    # SMs. On 9.0 the sm90 forward holds one CTA per SM: splits by wave efficiency (kv 8: 32 row
    # tiles x 4 = 128 CTAs, 97% of one wave; planned for two per SM it was 9 = 288 CTAs, 3 waves
    # at 73%). On 8.0 the mma.sync decode kernel keeps the two-per-SM rule.
    B, H, sms = 4, 32, 132
    s90 = emu.lib.mhk_emu_fwd_plan_splits(9, 0, 1, 128, B, Hkv, H // Hkv, 1, Lk, sms)
    s80 = emu.lib.mhk_emu_fwd_plan_splits(8, 0, 1, 128, B, Hkv, H // Hkv, 1, Lk, sms)
    assert s90 == want90
    ctas = B * Hkv * s90
    waves = -(-ctas // sms)
    assert ctas / (waves * sms) >= 0.85 or Lk // 128 // 8 <= s90  # a full wave, or the key limit binds
    key_blocks = -(-Lk // 64)
    assert s80 == max(1, min(-(-2 * sms // (B * Hkv)), key_blocks // 8, 128))


def test_sm90_config_is_the_capability_table(emu):
    # FwdConfigSm90 takes its tiles from capabilities.h (sm90_fwd_tiles); the extension's
    # table reports the same numbers, and the split planner op plans with them.
    caps = _extension_caps()
    for D in SM90_DIMS:
        bm, bn, stages, smem, v_stages = emu.config(D)
        assert smem <= SMEM_LIMIT_SM90 and stages >= 2 and v_stages >= 2
        if caps is not None:
            assert caps["cuda"]["sm90"]["fwd_tiles"][str(D)] == [bm, bn, stages]
    if caps is not None:
        plan = torch.ops.mhakern_C.cuda_plan_splits
        for D, Lk in PLAN_SHAPES:
            want = emu.lib.mhk_emu_fwd_plan_splits(9, 0, 1, D, 1, 1, 8, 1, Lk, 132)
            assert plan(1, 1, 8, 1, Lk, D, 132, sm90=True) == want
        with pytest.raises(ValueError, match="forward only"):
            plan(1, 1, 8, 1, 4096, 128, 132, True, True)
        with pytest.raises(ValueError, match="no compiled sm90 kernel"):
            plan(1, 1, 8, 1, 4096, 96, 132, sm90=True)


def _extension_caps():
    """The capability table of the built extension, or None without one."""
    try:
        import json

        import mhakern._C  # noqa: F401

        return json.loads(torch.ops.mhakern_C.capabilities())
    except (ImportError, OSError, AttributeError, RuntimeError):
        return None


@pytest.mark.parametrize(
    "D,Lk,kl,causal,splits",
    [
        (64, 80, (50, 80), False, 1),           # the H200's failing call (tests/test_cuda.py)
        (128, 300, (170, 128, 0, 299), True, 2),  # mid-split straddle, a length on a tile edge, 0
        (256, 200, (90, 200), False, 1),        # 80-key tiles: the length inside the second
    ],
    ids=["d64", "d128-split", "d256"],
)
def test_sm90_keys_past_a_length_may_hold_garbage(rnd, D, Lk, kl, causal, splits):
    # docs/contract.md: keys past key_lengths may hold anything, NaN and inf included, and never
    # influence a result. The tensor map zero-fills only past Lk, so the tile that straddles a
    # length brings them in; NaN K and inf V there must not reach out or lse (0 * inf in P V).
    B = len(kl)
    q, k, v = make_inputs(B, 4, 2, 9, Lk, D, D, dtype=torch.bfloat16, requires_grad=False)
    klt = torch.tensor(kl, dtype=torch.int32)
    check_against_reference(sm90_attention(rnd, splits), q, k, v, causal, klt, grads=False)

    def run(k, v):
        out, lse = rnd.forward(padded(q), padded(k), padded(v), 0.3, causal, klt, splits)
        return out.clone(), lse.clone()

    clean = run(k, v)
    for b, n in enumerate(kl):
        k[b, :, n:] = float("nan")
        v[b, :, n:] = float("inf")
    dirty = run(k, v)
    assert torch.isfinite(dirty[0]).all()
    assert torch.equal(dirty[0], clean[0]) and torch.equal(dirty[1], clean[1])


def test_sm90_decode_packs_query_heads(rnd):
    # Lq = 1, 16 query heads over 2 KV heads: each group's 8 rows share one tile.
    _run(rnd, (3, 16, 2, 1, 150, 64, 64, False, (150, 1, 77)), torch.bfloat16)


# Shapes whose key tiles wrap both rings (more tiles than stages): a stage released early can
# only be overwritten by the copy of a later tile into it.
_RING_WRAPS = [
    ((1, 2, 1, 130, 700, 64, 64, False, None), torch.float16),     # 6 tiles of 128 over 3 + 3 stages
    ((2, 2, 2, 70, 600, 128, 128, True, (600, 431)), torch.bfloat16),  # causal, a key length
    ((1, 1, 1, 40, 420, 256, 256, False, None), torch.bfloat16),   # 6 tiles of 80 over 2 + 2 stages
]


@pytest.mark.parametrize("fault", [1, 2], ids=["k-released-before-s-lands", "v-released-before-pv-lands"])
def test_sm90_forward_early_stage_release_fails(emu, fault):
    # The deliberate defects of attn_fwd_sm90_kernel.cuh (MHK_SM90_FWD_FAULT): K's stage
    # released before the wait that S has landed, V's before the wait that P V has. The
    # emulator performs a wgmma at that wait, so the copy into the released stage could land
    # after it and the answer still come out right; the in-flight check (cuda_emu_sm90.h: a
    # copy onto the operand of a wgmma in flight is an error) makes such a schedule fail too.
    # Under one fixed seed (deterministic: measured with seeds 21-23, 8 and 7 of the 9 runs
    # caught faults 1 and 2) each fault must be caught on these shapes, by that error: a correct
    # kernel never raises it, so no clean rerun is needed to tell it from another failure.
    caught = []
    try:
        emu.schedule(21)
        emu.fault(fault)
        for case, dtype in _RING_WRAPS:
            try:
                _run(emu, case, dtype)
            except (RuntimeError, AssertionError) as e:
                caught.append(str(e)[:300])
    finally:
        emu.fault(0)
        emu.schedule(None)
    assert any("a wgmma in flight still reads" in c for c in caught), (fault, caught)


def test_sm90_work_items_run_heaviest_first(emu):
    # Causal self-attention, Lq = Lk = 1000 (8 row tiles of 128), 2 batches x 3 KV heads: the
    # grid takes the row tiles from the last (8 key tiles) to the first (1), every item of one
    # row tile together; without causal masking every item is as long (8 tiles).
    out = (ctypes.c_int * 64)()
    n = emu.lib.mhk_emu_sm90_work_tiles(2, 3, 1, 1000, 1000, 1, 1, out, 64)
    tiles = list(out[:n])
    assert n == 48 and tiles == sorted(tiles, reverse=True) and tiles[0] == 8 and tiles[-1] == 1, tiles
    assert sorted(tiles) == sorted([t for t in range(1, 9) for _ in range(6)])
    n = emu.lib.mhk_emu_sm90_work_tiles(2, 3, 1, 1000, 1000, 0, 1, out, 64)
    assert set(out[:n]) == {8}


def test_sm90_persistent_grid_is_the_one_item_per_cta_grid(rnd):
    # The persistent grid (capabilities.h kSm90FwdPersistent): CTAs loop over work items
    # heaviest first, their K/V rings, Q halves and barrier phases running on from item to item.
    # On one emulated SM a single CTA takes every item (16 here: 2 batches x 2 KV heads x 2 row
    # tiles x 2 splits); with as many SMs as items each CTA takes one. Causal with Lq not a
    # multiple of the tile, GQA rows straddling heads, a key length inside a tile (the V rows
    # cleared on every item that holds it), split-K: the same bits either way, and right.
    case = (2, 6, 2, 70, 300, 64, 64, True, (300, 171))
    q, k, v = make_inputs(*case[:7], dtype=torch.bfloat16, requires_grad=False)
    kl = torch.tensor(case[8], dtype=torch.int32)
    runs = []
    old = rnd.lib.mhk_emu_sm90_set_sms(1)
    try:
        for sms in (1, 1000):
            rnd.lib.mhk_emu_sm90_set_sms(sms)
            out, lse = rnd.forward(padded(q), padded(k), padded(v), 0.125, True, kl, 2)
            runs.append((out.clone(), lse.clone()))
        check_against_reference(sm90_attention(rnd, 2), q, k, v, True, kl, scale=0.125, grads=False)
    finally:
        rnd.lib.mhk_emu_sm90_set_sms(old)
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    # Deliberate defect 3: a consumer releases its Q half as soon as it has it, so the loaders
    # write the next item's Q while this item's products read it: wrong numbers on one SM.
    rnd.lib.mhk_emu_sm90_set_sms(1)
    rnd.fault(3)
    try:
        bad, _ = rnd.forward(padded(q), padded(k), padded(v), 0.125, True, kl, 2)
    finally:
        rnd.fault(0)
        rnd.lib.mhk_emu_sm90_set_sms(old)
    assert not torch.equal(bad, runs[0][0])


def test_sm90_forward_is_deterministic_across_schedules(emu):
    q, k, v = make_inputs(1, 2, 1, 130, 290, 64, 64, dtype=torch.float16)
    outs = []
    for seed in (11, 12):
        emu.schedule(seed)
        out, lse = emu.forward(padded(q), padded(k), padded(v), 0.125, True, None)
        outs.append((out.clone(), lse.clone()))
    emu.schedule(None)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


# ---------------------------------------------------------------------------------------------
# Packed sequences (attn_fwd_sm90_varlen_kernel) against the per-sequence float64 reference
# ---------------------------------------------------------------------------------------------


def _packed(T, H, D, dtype, g):
    """A (1, H, T, D) view of a packed (T, H, D) tensor, in a NaN-padded buffer."""
    return padded(torch.randn(T, H, D, generator=g).to(dtype).transpose(0, 1).unsqueeze(0))


def _prefix(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def _check_varlen(out, lse, q, k, v, cq, ck, scale, causal):
    """The tolerance rule on every query token against the reference of each sequence as a batch
    of one (mhakern.reference with packed modes), the lse's -inf pattern exactly."""
    lens_q, lens_k = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
    m = Modes(cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=int(lens_q.max()), max_seqlen_k=int(lens_k.max()))
    o64, l64 = reference.attention_forward(q.double(), k.double(), v.double(), scale, causal, None, upcast=True, modes=m)
    oT, _ = reference.attention_forward(q, k, v, scale, causal, None, modes=m)
    rule_check("out", out, o64, oT, q.dtype, 2.0)
    dead = torch.isneginf(l64)
    assert torch.equal(torch.isneginf(lse), dead), "lse: -inf pattern differs from the reference"
    err = (lse.double() - l64)[~dead].abs().max().item() if (~dead).any() else 0.0
    assert err <= 1e-3 * max(1.0, l64[~dead].abs().max().item()), f"lse error {err:.3e}"
    for s in range(len(lens_q)):  # a sequence without keys: out 0 (rule_check saw finite values)
        if lens_k[s] == 0 and lens_q[s] > 0:
            assert not out[:, :, int(cq[s]):int(cq[s + 1])].any(), f"sequence {s}: out of no keys"


# (name, lengths q, lengths k, H, Hkv, D, dtype, causal). Row tiles of 128 packed rows, key
# tiles of 128 (D 64, 128) and 80 (D 256). Between them: empty sequences on either side (no
# queries: row tiles skipped; no keys: out 0, lse -inf), one-token sequences, a sequence of more
# rows than a tile (70 x group 2, 130) and of more keys than a tile (150, 300, 170), Lq_s != Lk_s
# both ways (causal with leading rows that see no key), GQA and MQA, and tiles holding a
# sequence's end that bring in the next sequence's keys.
SM90_VARLEN_CASES = [
    ("d64-gqa-causal-empty", [5, 0, 1, 70, 3, 0, 9], [9, 4, 1, 150, 0, 0, 2], 4, 2, 64, torch.bfloat16, True),
    ("d128-mha-long", [130, 17, 1], [40, 300, 129], 2, 2, 128, torch.float16, False),
    ("d256-mqa-causal", [1, 45, 20, 0], [170, 45, 81, 3], 2, 1, 256, torch.bfloat16, True),
]


@pytest.mark.parametrize("case", SM90_VARLEN_CASES, ids=[c[0] for c in SM90_VARLEN_CASES])
def test_sm90_varlen_forward_against_the_per_sequence_reference(rnd, case):
    _, lq, lk, H, Hkv, D, dtype, causal = case
    g = torch.Generator().manual_seed(D + len(lq))
    q, k, v = _packed(sum(lq), H, D, dtype, g), _packed(sum(lk), Hkv, D, dtype, g), _packed(sum(lk), Hkv, D, dtype, g)
    cq, ck = _prefix(lq), _prefix(lk)
    scale = D ** -0.5
    out, lse = rnd.forward_varlen(q, k, v, cq, ck, scale, causal)
    _check_varlen(out, lse, q, k, v, cq, ck, scale, causal)
    if D == 64:
        # One emulated SM: one CTA walks every item, the skipped row tiles past a sequence's rows
        # included (their Q halves' phases must stay paired); the same bits as a CTA per item.
        old = rnd.lib.mhk_emu_sm90_set_sms(1)
        try:
            one = rnd.forward_varlen(q, k, v, cq, ck, scale, causal)
            rnd.lib.mhk_emu_sm90_set_sms(1000)
            many = rnd.forward_varlen(q, k, v, cq, ck, scale, causal)
        finally:
            rnd.lib.mhk_emu_sm90_set_sms(old)
        for a, b in zip(one, many):
            assert torch.equal(a, b)
        assert torch.equal(one[0], out) and torch.equal(one[1], lse)


def test_sm90_varlen_never_reads_or_sees_another_sequences_keys(rnd):
    # Sequence 1 has 400 keys and no query: nothing may load them but the box of sequence 0's
    # only key tile (128 keys from 0, its 50 keys and sequence 1's first 78), which must mask
    # them (keys) and zero them (values). So TMA may read key tokens [0, 128) and sequence 2's
    # [450, 700) only, and NaN keys with inf values in sequence 1 change no bit of the others.
    lq, lk, H, D = [9, 0, 20], [50, 400, 250], 2, 64
    g = torch.Generator().manual_seed(7)
    q, k, v = _packed(sum(lq), H, D, torch.float16, g), _packed(700, H, D, torch.float16, g), _packed(700, H, D, torch.float16, g)
    cq, ck = _prefix(lq), _prefix(lk)
    allowed = [(0, 128), (450, 700)]
    clean = rnd.forward_varlen(q, k, v, cq, ck, 0.125, False, kv_tokens=allowed)
    _check_varlen(*clean, q, k, v, cq, ck, 0.125, False)
    k[:, :, 50:450] = float("nan")
    v[:, :, 50:450] = float("inf")
    dirty = rnd.forward_varlen(q, k, v, cq, ck, 0.125, False, kv_tokens=allowed)
    assert torch.isfinite(dirty[0]).all()
    assert torch.equal(dirty[0], clean[0]) and torch.equal(dirty[1], clean[1])
    # the guard is live: with sequence 2's tokens left out, its own boxes are errors
    with pytest.raises(RuntimeError, match="outside every tensor"):
        rnd.forward_varlen(q, k, v, cq, ck, 0.125, False, kv_tokens=[(0, 128)])


# ---------------------------------------------------------------------------------------------
# Which family serves a call
# ---------------------------------------------------------------------------------------------


# The faked call properties of the family tests, as ModeParams fields (mode 5: key lengths, not
# a mode): 0 none, 1 attn_mask, 2 dropout, 3 window, 4 top_left, 6 packed sequences (one of 100
# tokens), 7 packed sequences with top_left. Pointers only need to be non-null here.
_DUMMY = torch.zeros(2, dtype=torch.int32)
_PACKED = dict(cu_seqlens_q=_DUMMY.data_ptr(), cu_seqlens_k=_DUMMY.data_ptr(), num_seqs=1, max_seqlen_q=100,
               max_seqlen_k=100)
FAMILY_MODES = {0: {}, 1: dict(mask=_DUMMY.data_ptr()), 2: dict(dropout_p=0.1), 3: dict(window_left=4),
                4: dict(top_left=True), 5: {}, 6: _PACKED, 7: dict(_PACKED, top_left=True)}


@pytest.mark.parametrize(
    "cc,compiled,D,splits,mode,Hkv,head_stride,want",
    [
        ((9, 0), 1, 128, 1, 0, 2, 12800, 1),  # Hopper, a call the family serves
        ((9, 0), 1, 64, 1, 0, 1, 0, 1),       # a single KV head: its stride does not matter
        ((8, 0), 1, 128, 1, 0, 2, 12800, 0),  # A100: mma.sync
        ((8, 9), 1, 64, 1, 0, 2, 6400, 0),    # Ada: mma.sync
        ((10, 0), 1, 64, 1, 0, 2, 6400, 0),   # sm_90a code does not run on 10.0
        ((9, 0), 0, 64, 1, 0, 2, 6400, 0),    # built without the sm_90a pass
        ((9, 0), 1, 96, 1, 0, 2, 9600, 0),    # a head dim the family lacks
        ((9, 0), 1, 64, 4, 0, 2, 6400, 1),    # split-K (the family's own, merged by the combine)
        ((9, 0), 1, 64, 1, 1, 2, 6400, 0),    # attn_mask
        ((9, 0), 1, 64, 1, 2, 2, 6400, 0),    # dropout
        ((9, 0), 1, 64, 1, 3, 2, 6400, 0),    # window
        ((9, 0), 1, 64, 1, 4, 2, 6400, 0),    # top-left causal
        ((9, 0), 1, 64, 1, 5, 2, 6400, 1),    # key_lengths (the keys past a length are zeroed)
        ((9, 0), 1, 64, 1, 0, 2, 0, 0),       # K broadcast over heads (stride 0): no tensor map
        ((9, 0), 1, 128, 1, 6, 2, 12800, 1),  # packed sequences (the varlen kernel)
        ((9, 0), 1, 128, 2, 6, 2, 12800, 0),  # packed sequences, split (it runs them unsplit)
        ((9, 0), 1, 128, 1, 7, 2, 12800, 0),  # packed sequences with top-left causal
        ((8, 0), 1, 128, 1, 6, 2, 12800, 0),  # packed sequences on A100
    ],
)
def test_family_choice_by_compute_capability(emu, cc, compiled, D, splits, mode, Hkv, head_stride, want):
    modes = ctypes.byref(mode_params(**FAMILY_MODES[mode]))
    key_lengths = int(mode == 5)
    assert emu.lib.mhk_emu_fwd_family(cc[0], cc[1], compiled, D, splits, modes, key_lengths, Hkv, head_stride) == want


@pytest.mark.parametrize("grad", [False, True])
def test_cuda_backend_serves_d256_on_hopper_only(monkeypatch, grad):
    # D 256's forward is the sm_90a family's only (capabilities: sm90.fwd_only_head_dims) and its
    # backward the fused mma.sync kernel (cuda.bwd.head_dims): the cuda backend takes it on a 9.0
    # device of a build with the sm_90a pass, gradient or not, and says why not on other devices
    # or builds (so that auto falls back). Faked device and table.
    from cuda_emulator_harness import _compiled_table, _FakeCudaTensor, _fresh_backend

    class Fake(_FakeCudaTensor):
        requires_grad = grad

    table = _compiled_table()
    table["cuda"]["sm90"]["compiled"] = True
    be = _fresh_backend(monkeypatch, "13.0", table)
    assert be.unavailable() is None
    be._caps = {0: (9, 0)}
    qkv = lambda D: (Fake((1, 4, 64, D)), Fake((1, 2, 64, D)), Fake((1, 2, 64, D)))  # noqa: E731
    assert 256 in table["cuda"]["bwd"]["head_dims"]
    assert be.supports(*qkv(256), False, None) is None
    with torch.no_grad():
        assert be.supports(*qkv(256), True, None) is None
        assert "no compiled cuda kernel" in be.supports(*qkv(80), False, None)
        be._caps = {0: (8, 0)}
        assert "served only by the sm_90a forward" in be.supports(*qkv(256), False, None)
        be._caps = {0: (9, 0)}
        table["cuda"]["sm90"]["compiled"] = False
        assert "served only by the sm_90a forward" in be.supports(*qkv(256), False, None)


# ---------------------------------------------------------------------------------------------
# The SASS check of tools/check_cuda_build.py can fail (synthetic SASS; the real compile runs in
# tests/test_cuda_build.py)
# ---------------------------------------------------------------------------------------------

_MANGLED = "_ZN7mhakern4cuda4sm9020attn_fwd_sm90_kernelI6__halfLi64EEEvNS1_13FwdParamsSm90E"


def _check_tool():
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_cuda_build", ROOT / "tools" / "check_cuda_build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _sass(body: list[str]) -> str:
    lines = ["\tcode for sm_90a", f"\t\tFunction : {_MANGLED}"]
    lines += [f"        /*{16 * i:04x}*/                   {ins} ;" for i, ins in enumerate(body)]
    return "\n".join(lines)


def _ptxas_log(regs=168, spill=0):
    return (f"ptxas info    : Compiling entry function '{_MANGLED}' for 'sm_90a'\n"
            f"ptxas info    : Function properties for {_MANGLED}\n"
            f"    0 bytes stack frame, {spill} bytes spill stores, {spill} bytes spill loads\n"
            f"ptxas info    : Used {regs} registers, used 1 barriers\n")


# A main loop that passes the forward's loop gates at 128 keys per stage: the S-landed wait, 64
# exps (BN / 2), the P V-landed wait.
_SOFTMAX = ["WARPGROUP.DEPBAR.LE gsb0, 0x1"] + ["MUFU.EX2 R30, R30"] * 64 + ["WARPGROUP.DEPBAR.LE gsb0, 0x0"]


def _fwd_loop(extra=(), hoisted=False):
    """A loop from 0x00: HGMMA, the softmax (its P V wait above the exps when hoisted), extra."""
    soft = ([_SOFTMAX[0], _SOFTMAX[-1]] + _SOFTMAX[1:-1]) if hoisted else _SOFTMAX
    body = ["HGMMA.64x128x16.F32 R24, gdesc[UR16], R24, gsb0"] + soft + list(extra)
    return body + ["@!P0 BRA 0x00", "EXIT"]


@pytest.mark.parametrize(
    "body,regs,smem,needle",
    [
        (["USETMAXREG.DEALLOC.CTAPOOL 0x18", "SYNCS.ARRIVE.TRANS64 RZ, [UR4], RZ"] + _fwd_loop(), 168, 81952, None),
        # the product outside the loop: the main loop has no HGMMA
        (["HGMMA.64x64x16.F32 R24, gdesc[UR16], R24, gsb0", "FADD R1, R2, R3", "@!P0 BRA 0x10", "EXIT"], 168, 81952,
         "no HGMMA inside any loop"),
        (_fwd_loop(["STL [R1], R2"]), 168, 81952, "local-memory instructions"),
        (_fwd_loop(), 168, 240 * 1024, "of shared memory"),
        (_fwd_loop(), 256, 81952, "registers per thread"),
        # ptxas's hoisted wait (seen in the SASS of the kernel before the pin): 0 of 64 exps overlap
        (_fwd_loop(hoisted=True), 168, 81952, "0 of the loop's 64 MUFU.EX2"),
        (["HGMMA.64x64x16.F32 R24, gdesc[UR16], R24, gsb0", "@!P0 BRA 0x00", "EXIT"], 168, 81952,
         "no 'S landed' / 'P V landed' wait pair"),
    ],
    ids=["good", "hgmma-outside-loop", "local-memory", "smem-over-227KB", "regs-over-255", "wait-hoisted",
         "no-wait-pair"],
)
def test_sass_check_fails_on_each_defect(body, regs, smem, needle):
    tool = _check_tool()
    facts = tool.sass_facts_text(_sass(body))
    result = {"src": "attn_fwd_sm90_fp16_d64.cu", "rc": 0, "log": _ptxas_log(regs), "facts": facts}
    rows, problems, lines = tool.check_sm90([result], {64: smem, ("fwd_block_n", 64): 128})
    assert len(rows) == 1 and rows[0]["kernel"] == "attn_fwd_sm90_kernel" and rows[0]["D"] == 64
    if needle is None:
        assert problems == [], problems
        assert "1 HGMMA" in lines[0]
    else:
        assert any(needle in p for p in problems), problems


@pytest.mark.parametrize("filler,masked,fails", [(700, 0, True), (700, 300, False), (0, 0, False)],
                         ids=["too-many", "mask-block-skipped", "lean"])
def test_sass_check_counts_executed_instructions_per_key(filler, masked, fails):
    # D 128: at most SM90_FWD_MAX_EXECUTED_PER_KEY[128] executed per key of an unmasked tile; a
    # block that a forward branch skips (the mask block) is not executed on such a tile.
    tool = _check_tool()
    n_mask = masked
    block = ["FADD R1, R1, R2"] * (filler - masked)
    if n_mask:
        start = 1 + len(_SOFTMAX) + len(block)  # index of the branch in the loop below
        block += [f"@!P1 BRA 0x{16 * (start + n_mask + 1):x}"] + ["FSEL R3, R3, -INF, P2"] * n_mask
    body = _fwd_loop(block)
    mangled = _MANGLED.replace("I6__halfLi64E", "I6__halfLi128E")
    facts = tool.sass_facts_text(_sass(body).replace(_MANGLED, mangled))
    log = _ptxas_log().replace(_MANGLED, mangled)
    rows, problems, _ = tool.check_sm90([{"src": "attn_fwd_sm90_fp16_d128.cu", "rc": 0, "log": log, "facts": facts}],
                                        {128: 1024, ("fwd_block_n", 128): 128})
    executed = facts[mangled]["loop_executed"]
    assert executed == len(body) - 1 - n_mask  # the loop less EXIT and the skipped block
    per_key = [p for p in problems if "per key" in p]
    assert bool(per_key) == fails, (executed, problems)
    # The packed-sequence kernel (the same main loop) is held to the same gates, its shared
    # memory read from its own row of the config printer.
    vmangled = mangled.replace("20attn_fwd_sm90_kernel", "27attn_fwd_sm90_varlen_kernel")
    vfacts = tool.sass_facts_text(_sass(body).replace(_MANGLED, vmangled))
    rows, problems, _ = tool.check_sm90([{"src": "attn_fwd_sm90_fp16_d128.cu", "rc": 0, "log": log.replace(mangled, vmangled),
                                          "facts": vfacts}],
                                        {128: 1024, ("fwd_block_n", 128): 128, ("attn_fwd_sm90_varlen_kernel", 128): 1024})
    assert rows[0]["kernel"] == "attn_fwd_sm90_varlen_kernel" and rows[0]["smem_dynamic"] == 1024
    assert bool([p for p in problems if "per key" in p]) == fails, problems
