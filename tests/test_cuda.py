"""GPU tests of the ``cuda`` backend (csrc/cuda/ through mhakern._C).

Every test needs a CUDA device and is skipped without one (conftest.py). On a machine with a
device, ``test_cuda_backend_is_available_on_a_gpu`` fails when the backend is unavailable (an
extension built without its CUDA kernels is a broken build, not a missing device); the other
tests then skip with the backend's reason instead of failing a hundred times over.

Everything is checked against the float64 reference with the contract's tolerance rule (docs/contract.md)
(tests/attn_testing.py): forward, lse, and the gradients dq, dk, dv.
"""
from __future__ import annotations

import pytest
import torch

import mhakern
from mhakern import backends, reference
from mhakern.backends import cuda_backend
from attn_testing import HARD_CASES, case_id, check_against_reference, make_inputs, rule_check
from packed_cache_testing import check_kvcache, check_packed

pytestmark = pytest.mark.gpu

DTYPES = (torch.float16, torch.bfloat16)
DTYPE_IDS = ("fp16", "bf16")


def _cuda_fn(**extra):
    def fn(q, k, v, **kw):
        return mhakern.attention(q, k, v, backend="cuda", **kw, **extra)

    return fn


@pytest.fixture
def cuda_ready():
    why = mhakern.available_backends().get("cuda", "backend 'cuda' is not registered")
    if why is not None:
        pytest.skip(f"backend 'cuda' unavailable: {why}")


@pytest.fixture(params=["auto", "mma_sync"])
def family(request, cuda_ready):
    """The kernel family of both passes: the host's choice with the sm90 backward opted in, then
    (on a 9.0 device with the sm_90a pass, where that choice is the sm90 family for plain calls)
    the mma.sync family forced, which is what sm_80-89 devices run: both families meet the hard
    cases on a Hopper GPU."""
    family = request.param
    if family != "auto":
        sm90 = (cuda_backend.capabilities() or {}).get("cuda", {}).get("sm90", {})
        if torch.cuda.get_device_capability() != (9, 0) or not sm90.get("compiled", False):
            pytest.skip("the host already picks the mma.sync family on this device (no sm_90a family here)")
    prev = (torch.ops.mhakern_C.cuda_force_fwd_family(family), torch.ops.mhakern_C.cuda_force_bwd_family(family))
    try:
        yield family
    finally:
        torch.ops.mhakern_C.cuda_force_fwd_family(prev[0])
        torch.ops.mhakern_C.cuda_force_bwd_family(prev[1])


def _kl(kl):
    return None if kl is None else torch.tensor(kl, device="cuda")


def _head_dims():
    """The compiled head dims (the capability table of mhakern._C), or () without the extension."""
    caps = cuda_backend.capabilities()
    return tuple(caps["cuda"]["head_dims"]) if caps is not None else ()


def _supported(case) -> bool:
    D, Dv = case.D, case.Dv
    return D == Dv and D in _head_dims()


def test_cuda_backend_is_available_on_a_gpu():
    av = mhakern.available_backends()
    assert av.get("cuda", "not registered") is None, f"backend 'cuda' unavailable on a GPU machine: {av.get('cuda')}"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", [c for c in HARD_CASES if _supported(c)], ids=case_id)
def test_hard_cases(family, case, dtype):
    B, H, Hkv, Lq, Lk, D, Dv, causal, kl = case
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, Dv, dtype=dtype, device="cuda")
    check_against_reference(_cuda_fn(), q, k, v, causal, _kl(kl))


@pytest.mark.parametrize("case", [c for c in HARD_CASES if not _supported(c)], ids=case_id)
def test_hard_cases_outside_the_kernels_fall_back(cuda_ready, case):
    B, H, Hkv, Lq, Lk, D, Dv, causal, kl = case
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, Dv, dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match="backend='cuda' cannot serve"):
        mhakern.attention(q, k, v, causal=causal, backend="cuda")
    assert backends.select("auto", q, k, v, causal, _kl(kl)).name != "cuda"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("D", _head_dims() or (64,))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_every_dtype_and_head_dim(family, dtype, D, causal):
    q, k, v = make_inputs(2, 4, 2, 97, 203, D, dtype=dtype, device="cuda")
    check_against_reference(_cuda_fn(), q, k, v, causal, torch.tensor([203, 120], device="cuda"))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_self_attention_several_tiles(cuda_ready, dtype, causal):
    q, k, v = make_inputs(2, 4, 4, 515, 515, 128, dtype=dtype, device="cuda")
    check_against_reference(_cuda_fn(), q, k, v, causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_strided_blhd_views_and_output_layout(cuda_ready, dtype):
    q, k, v = make_inputs(2, 8, 2, 77, 140, 64, dtype=dtype, device="cuda", layout="blhd")
    check_against_reference(_cuda_fn(), q, k, v, True)
    out = mhakern.attention(q, k, v, backend="cuda")
    assert out.transpose(1, 2).is_contiguous()  # (B, L, H, D) memory order kept


@pytest.mark.parametrize("D", [32, 128])
def test_large_logits(cuda_ready, D):
    q, k, v = make_inputs(1, 4, 2, 70, 90, D, dtype=torch.float16, device="cuda", scale_inputs=30.0)
    check_against_reference(_cuda_fn(), q, k, v, False)
    check_against_reference(_cuda_fn(), q, k, v, True)


@pytest.mark.parametrize(
    "B,H,Hkv,Lq,Lk,kl",
    [
        (4, 16, 1, 1, 4099, (4099, 1, 0, 2000)),  # MQA decode
        (3, 32, 8, 1, 1000, None),  # GQA decode
        (2, 8, 2, 4, 777, (777, 300)),  # speculative decode: a few queries
    ],
    ids=["mqa", "gqa", "gqa-4q"],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gqa_mqa_decode(cuda_ready, B, H, Hkv, Lq, Lk, kl, dtype):
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, 128, dtype=dtype, device="cuda")
    check_against_reference(_cuda_fn(), q, k, v, True, _kl(kl))
    check_against_reference(_cuda_fn(), q, k, v, False, _kl(kl))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_long_keys_take_the_split_k_path(cuda_ready, causal):
    B, H, Hkv, Lq, Lk, D = 1, 4, 1, 3, 2**20, 64
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert cuda_backend.plan_splits(B, Hkv, H // Hkv, Lq, Lk, D, sms) > 1
    assert cuda_backend.plan_splits(B, Hkv, H // Hkv, Lq, Lk, D, sms, backward=True) > 1
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, dtype=torch.bfloat16, device="cuda")
    check_against_reference(_cuda_fn(), q, k, v, causal, torch.tensor([Lk - 5], device="cuda"))


# Packed sequences on each family (on a 9.0 device "auto" is the sm90 forward, unsplit, and the
# mma.sync backward; "mma_sync" both passes on mma.sync): an empty sequence, one token,
# sequences longer than a row tile, Lq_s != Lk_s both ways, GQA.
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_packed_sequences_on_each_family(family, dtype):
    check_packed("cuda", [77, 0, 1, 300, 5], [90, 3, 1, 260, 40], 8, 2, 128, dtype, "cuda")


# The KV cache (the mma.sync forward on every device: the sm90 family takes no cache
# addressing): one query (the decode kernel) and four, cache_batch_idx rows and 16-token pages,
# a length 0 and one inside a page; the pool's other rows / pages and the slots past a length
# hold NaN. Lk 4096 at B 2: the planner splits the keys (split-K through the cache).
@pytest.mark.parametrize("kind", ["cache_batch_idx", "paged"])
@pytest.mark.parametrize("Lq,L", [(1, 4096), (4, 640)], ids=["decode-splitk", "4q"])
def test_kvcache_decode_paged_and_batch_idx(cuda_ready, kind, Lq, L):
    check_kvcache("cuda", kind, 2, 32, 8, Lq, L, [L - 3, 0] if Lq == 1 else [L, 133], 128, torch.bfloat16, "cuda")


_NOMODES = (None, 0.0, 0, False, -1, -1)  # attn_mask, dropout_p, seed, top_left, window_left, window_right


class _forced_splits:
    """Within the block, the CUDA host code uses ``splits`` key splits instead of planning."""

    def __init__(self, splits):
        self.splits = splits

    def __enter__(self):
        self.prev = torch.ops.mhakern_C.cuda_force_splits(self.splits)

    def __exit__(self, *exc):
        torch.ops.mhakern_C.cuda_force_splits(self.prev)


def _raw_fwd(q, k, v, scale, causal, kl, splits):
    with _forced_splits(splits):
        return torch.ops.mhakern_C.fwd(q, k, v, scale, causal, kl, *_NOMODES)


def _raw_bwd(dout, q, k, v, out, lse, scale, causal, kl, splits):
    with _forced_splits(splits):
        return torch.ops.mhakern_C.bwd(dout, q, k, v, out, lse, scale, causal, kl, *_NOMODES, False)[:3]


@pytest.mark.parametrize("splits", [2, 7, 64])
def test_forced_splits_agree_with_the_reference(cuda_ready, splits):
    B, H, Hkv, Lq, Lk, D = 2, 8, 2, 40, 3000, 128
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, dtype=torch.float16, device="cuda", requires_grad=False)
    kl = torch.tensor([3000, 150], dtype=torch.int32, device="cuda")  # 150: most splits see no key
    scale = D**-0.5
    out, lse = _raw_fwd(q, k, v, scale, True, kl, splits)
    ref, ref_lse = reference.attention_forward(q.double(), k.double(), v.double(), scale, True, kl, upcast=True)
    math_out, _ = reference.attention_forward(q, k, v, scale, True, kl)
    rule_check("out", out, ref, math_out, torch.float16, 2.0)
    assert torch.equal(torch.isneginf(lse), torch.isinf(ref_lse))
    dout = torch.randn_like(q)
    got = _raw_bwd(dout, q, k, v, out, lse, scale, True, kl, splits)
    want = _raw_bwd(dout, q, k, v, out, lse, scale, True, kl, 1)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-2, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("splits", [1, 5])
def test_backward_is_deterministic(cuda_ready, splits):
    B, H, Hkv, Lq, Lk, D = 2, 16, 2, 300, 700, 64
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, dtype=torch.bfloat16, device="cuda", requires_grad=False)
    kl = torch.tensor([700, 333], dtype=torch.int32, device="cuda")
    out, lse = _raw_fwd(q, k, v, 0.125, True, kl, 1)
    dout = torch.randn_like(q)
    first = _raw_bwd(dout, q, k, v, out, lse, 0.125, True, kl, splits)
    for _ in range(2):
        again = _raw_bwd(dout, q, k, v, out, lse, 0.125, True, kl, splits)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"{name}: two backward runs differ"
    out2, lse2 = _raw_fwd(q, k, v, 0.125, True, kl, 1)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


# ---- the decode kernel of the mma.sync forward (capabilities.h: group * Lq <= decode max_rows,
# no attn_mask / dropout): forced onto the mma.sync family, which serves calls with key_lengths
# on every device and every call below sm_90a.


@pytest.fixture
def mma_sync(cuda_ready):
    prev = (torch.ops.mhakern_C.cuda_force_fwd_family("mma_sync"), torch.ops.mhakern_C.cuda_force_bwd_family("mma_sync"))
    try:
        yield
    finally:
        torch.ops.mhakern_C.cuda_force_fwd_family(prev[0])
        torch.ops.mhakern_C.cuda_force_bwd_family(prev[1])


def _decode_rows():
    caps = cuda_backend.capabilities() or {}
    return caps.get("cuda", {}).get("decode", {}).get("max_rows", 0)


# (B, H, Hkv, Lq, Lk, key_lengths): GQA 32 / 8 with a length 0 and one inside a tile, MQA group
# 8, group 32 (two row blocks of 16), 3 queries x group 8 with a length below Lq (dead rows).
DECODE_GPU_CASES = [
    (3, 32, 8, 1, 5000, (5000, 0, 1237)),
    (4, 8, 1, 1, 3001, (1, 3001, 2048, 17)),
    (2, 32, 1, 1, 2500, None),
    (2, 16, 2, 3, 900, (900, 2)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("D", _head_dims() or (128,))
@pytest.mark.parametrize("case", DECODE_GPU_CASES, ids=lambda c: f"B{c[0]}H{c[1]}kv{c[2]}q{c[3]}k{c[4]}")
def test_decode_kernel_against_the_reference(mma_sync, case, D, dtype):
    B, H, Hkv, Lq, Lk, kl = case
    assert H // Hkv * Lq <= _decode_rows(), "the case must take the decode kernel"
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, dtype=dtype, device="cuda")
    check_against_reference(_cuda_fn(), q, k, v, True, _kl(kl))
    check_against_reference(_cuda_fn(), q.detach(), k.detach(), v.detach(), False, _kl(kl), grads=False)


@pytest.mark.parametrize("splits", [1, 3, 64])
def test_decode_forced_splits_and_determinism(mma_sync, splits):
    B, H, Hkv, Lq, Lk, D = 2, 32, 8, 1, 20000, 128
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, dtype=torch.bfloat16, device="cuda", requires_grad=False)
    kl = torch.tensor([20000, 77], dtype=torch.int32, device="cuda")  # 77: most splits see no key
    scale = D**-0.5
    out, lse = _raw_fwd(q, k, v, scale, False, kl, splits)
    ref, ref_lse = reference.attention_forward(q.double(), k.double(), v.double(), scale, False, kl, upcast=True)
    math_out, _ = reference.attention_forward(q, k, v, scale, False, kl)
    rule_check("out", out, ref, math_out, torch.bfloat16, 2.0)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=2e-2, atol=0)
    for _ in range(2):
        again, again_lse = _raw_fwd(q, k, v, scale, False, kl, splits)
        assert torch.equal(out, again) and torch.equal(lse, again_lse)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("Lq", [1, 10], ids=["decode-kernel", "main-kernel"])
def test_nan_rows_stay_nan_through_the_epilogues(mma_sync, splits, Lq):
    # docs/contract.md "NaN and inf": a NaN query row or visible key makes out and lse NaN, through
    # the decode kernel's warp merge, the main kernel's epilogue and the split combine.
    q, k, v = make_inputs(2, 8, 2, Lq, 300, 64, dtype=torch.float16, device="cuda", requires_grad=False)
    kl = torch.tensor([0, 300], dtype=torch.int32, device="cuda")
    q[0, 1] = float("nan")
    q[1, 2] = float("nan")
    k[1, 1, 211, 5] = float("nan")
    v[1, 0, 37, 9] = float("inf")
    out, lse = _raw_fwd(q, k, v, 0.125, False, kl, splits)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()
    assert torch.isnan(out[1, 2]).all() and torch.isnan(lse[1, 2]).all()
    assert torch.isnan(out[1, 4:]).all() and torch.isnan(lse[1, 4:]).all()
    rest = out[1, [0, 1, 3]]
    assert not torch.isfinite(rest[..., 9]).any() and torch.isfinite(lse[1, [0, 1, 3]]).all()
    assert torch.isfinite(rest[..., :9]).all() and torch.isfinite(rest[..., 10:]).all()


def test_decode_planned_splits_and_garbage_past_lengths(mma_sync):
    # The measured decode shape, planned (several splits of the decode tiles), with NaN keys and
    # inf values past a length: the same result as with clean padding.
    B, H, Hkv, Lq, Lk, D = 2, 32, 8, 1, 2**17, 128
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert cuda_backend.plan_splits(B, Hkv, H // Hkv, Lq, Lk, D, sms) > 1
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, dtype=torch.bfloat16, device="cuda", requires_grad=False)
    kl = torch.tensor([Lk, 70001], dtype=torch.int32, device="cuda")
    clean, clean_lse = mhakern.attention(q, k, v, key_lengths=kl, backend="cuda", return_lse=True)
    k[1, :, 70001:] = float("nan")
    v[1, :, 70001:] = float("inf")
    out, lse = mhakern.attention(q, k, v, key_lengths=kl, backend="cuda", return_lse=True)
    assert torch.equal(out, clean) and torch.equal(lse, clean_lse)
    ref, ref_lse = reference.attention_forward(q.double(), k.double().nan_to_num(0, 0, 0),
                                               v.double().nan_to_num(0, 0, 0), D**-0.5, False, kl, upcast=True)
    math_out, _ = reference.attention_forward(q, k.nan_to_num(0, 0, 0), v.nan_to_num(0, 0, 0), D**-0.5, False, kl)
    rule_check("out", out, ref, math_out, torch.bfloat16, 2.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_fully_masked_rows_give_zero_and_no_nan(cuda_ready, dtype):
    # causal with Lq > Lk: rows 0 .. Lq - Lk - 1 see no key; key_lengths 0 hides all keys.
    q, k, v = make_inputs(3, 4, 2, 150, 40, 64, dtype=dtype, device="cuda")
    kl = torch.tensor([40, 0, 7], device="cuda")
    out, lse = mhakern.attention(q, k, v, causal=True, key_lengths=kl, backend="cuda", return_lse=True)
    out.float().square().sum().backward()
    dead = torch.isneginf(lse)
    assert dead[0, :, :110].all() and dead[1].all() and dead[2, :, :143].all()
    assert (out[dead] == 0).all() and (q.grad[dead] == 0).all()
    assert (k.grad[1] == 0).all() and (v.grad[1] == 0).all()
    for t in (out, q.grad, k.grad, v.grad):
        assert not torch.isnan(t).any()


def test_hidden_keys_may_hold_garbage(cuda_ready):
    q, k, v = make_inputs(2, 2, 2, 9, 80, 64, dtype=torch.bfloat16, device="cuda", requires_grad=False)
    kl = torch.tensor([50, 80], device="cuda")
    clean = mhakern.attention(q, k, v, key_lengths=kl, backend="cuda")
    k[0, :, 50:] = float("nan")
    v[0, :, 50:] = float("inf")
    assert torch.equal(mhakern.attention(q, k, v, key_lengths=kl, backend="cuda"), clean)


def test_auto_prefers_cuda_for_half_precision(cuda_ready):
    q, k, v = make_inputs(1, 2, 2, 8, 8, 64, dtype=torch.float16, device="cuda")
    assert backends.select("auto", q, k, v, False, None).name == "cuda"
    q32, k32, v32 = make_inputs(1, 2, 2, 8, 8, 64, dtype=torch.float32, device="cuda")
    assert backends.select("auto", q32, k32, v32, False, None).name != "cuda"


def test_extension_checks_name_the_argument(cuda_ready):
    # Raised by the CUDA kernels of the dispatcher ops, through torch's operator machinery (the
    # device-independent checks: tests/test_cpp_errors.py).
    fwd = torch.ops.mhakern_C.fwd
    q, k, v = make_inputs(1, 2, 2, 16, 16, 64, dtype=torch.float16, device="cuda", requires_grad=False)
    with pytest.raises(TypeError, match="q: the cuda kernels take float16 or bfloat16"):
        fwd(q.float(), k.float(), v.float(), 0.125, False, None, *_NOMODES)
    with pytest.raises(ValueError, match="head dim 48 has no compiled cuda kernel"):
        q48 = q[..., :48].contiguous()
        fwd(q48, k[..., :48].contiguous(), v[..., :48].contiguous(), 1.0, False, None, *_NOMODES)
    with pytest.raises(ValueError, match="v: head dim 32 differs from q's"):
        fwd(q, k, v[..., :32].contiguous(), 0.125, False, None, *_NOMODES)
    with pytest.raises(ValueError, match="k: strides of dims 0-2 must be multiples of 8"):
        big = torch.zeros(1, 2, 16, 68, dtype=torch.float16, device="cuda")[..., 2:66]
        fwd(q, big, v, 0.125, False, None, *_NOMODES)
    with pytest.raises(TypeError, match="key_lengths: expected dtype int32"):
        fwd(q, k, v, 0.125, False, torch.tensor([16], device="cuda"), *_NOMODES)
    with pytest.raises(ValueError, match=r"key_lengths: values must lie in \[0, Lk=16\], got 17 at index 0"):
        fwd(q, k, v, 0.125, False, torch.tensor([17], dtype=torch.int32, device="cuda"), *_NOMODES)
    with pytest.raises(ValueError, match="key_lengths: expected a tensor on cuda"):
        fwd(q, k, v, 0.125, False, torch.tensor([16], dtype=torch.int32), *_NOMODES)
    # Every mode is implemented now (docs/contract.md); a mode's argument out of range still raises.
    with pytest.raises(ValueError, match=r"dropout_p: expected a number in \[0, 1\), got 1.5"):
        fwd(q, k, v, 0.125, False, None, None, 1.5, 0, False, -1, -1)
    with pytest.raises(ValueError, match="cuda_force_splits: num_splits must lie in"):
        torch.ops.mhakern_C.cuda_force_splits(-1)
    out, lse = fwd(q, k, v, 0.125, False, None, *_NOMODES)
    with pytest.raises(TypeError, match="lse: expected dtype float32"):
        torch.ops.mhakern_C.bwd(out, q, k, v, out, lse.half(), 0.125, False, None, *_NOMODES, False)
    # Still healthy after all of that.
    out2, _ = fwd(q, k, v, 0.125, False, None, *_NOMODES)
    assert torch.equal(out, out2)


def test_clamped_key_lengths_under_graph_capture(cuda_ready):
    # Under CUDA-graph capture the host cannot read the lengths: the kernels clamp them, so an
    # out-of-range value gives the answer of the clamped one instead of reading outside k and v.
    q, k, v = make_inputs(2, 2, 2, 8, 40, 64, dtype=torch.float16, device="cuda", requires_grad=False)
    kl_bad = torch.tensor([1000, -5], dtype=torch.int32, device="cuda")
    kl_ok = torch.tensor([40, 0], dtype=torch.int32, device="cuda")
    want, want_lse = torch.ops.mhakern_C.fwd(q, k, v, 0.125, False, kl_ok, *_NOMODES)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got, got_lse = torch.ops.mhakern_C.fwd(q, k, v, 0.125, False, kl_bad, *_NOMODES)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)


def test_misaligned_views_are_copied_not_refused(cuda_ready):
    # A view starting 2 elements into its storage breaks 16-byte alignment: the backend copies.
    base = torch.randn(1, 2, 33, 64, dtype=torch.float16, device="cuda")
    q = base.view(-1)[2 : 2 + 2 * 32 * 64].view(1, 2, 32, 64).requires_grad_(True)
    _, k, v = make_inputs(1, 2, 2, 32, 32, 64, dtype=torch.float16, device="cuda")
    check_against_reference(_cuda_fn(), q, k, v, False)


# ---------------------------------------------------------------------------------------------
# Modes: top-left alignment and sliding windows (docs/contract.md "Visibility")
# ---------------------------------------------------------------------------------------------

# (B, H, Hkv, Lq, Lk, D, causal, key_lengths, causal_align, window)
GPU_WINDOW_CASES = [
    (2, 4, 2, 300, 200, 64, True, (200, 17), "top_left", None),
    (1, 8, 2, 150, 1000, 128, True, None, "top_left", None),
    (2, 4, 4, 500, 700, 64, False, (700, 333), "bottom_right", (100, -1)),
    (1, 4, 1, 400, 256, 96, False, None, "top_left", (-1, 31)),
    (2, 8, 2, 333, 333, 32, False, None, "bottom_right", (64, 64)),
    (1, 4, 2, 256, 256, 128, True, None, "top_left", (128, 17)),
    (1, 4, 4, 300, 100, 64, False, None, "top_left", (5, -1)),  # rows past key 104 see nothing
    (1, 16, 2, 1, 4096, 64, False, (4096,), "bottom_right", (512, 0)),  # decode with a window
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", GPU_WINDOW_CASES, ids=lambda c: f"q{c[3]}k{c[4]}d{c[5]}-{c[8]}-w{c[9]}")
def test_top_left_and_windows(cuda_ready, case, dtype):
    B, H, Hkv, Lq, Lk, D, causal, kl, align, window = case
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, dtype=dtype, device="cuda")
    check_against_reference(_cuda_fn(), q, k, v, causal, _kl(kl), causal_align=align, window=window)


def _raw_fwd_modes(q, k, v, scale, causal, kl, splits, top_left, window):
    with _forced_splits(splits):
        return torch.ops.mhakern_C.fwd(q, k, v, scale, causal, kl, None, 0.0, 0, top_left, *window)


def _raw_bwd_modes(dout, q, k, v, out, lse, scale, causal, kl, splits, top_left, window):
    with _forced_splits(splits):
        return torch.ops.mhakern_C.bwd(dout, q, k, v, out, lse, scale, causal, kl, None, 0.0, 0, top_left, *window,
                                       False)[:3]


@pytest.mark.parametrize("splits", [2, 9])
@pytest.mark.parametrize("window,top_left", [((300, 0), False), ((-1, 40), True), ((64, 64), False)])
def test_forced_splits_with_windows(cuda_ready, splits, window, top_left):
    B, H, Hkv, Lq, Lk, D = 2, 8, 2, 40, 3000, 64
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, dtype=torch.bfloat16, device="cuda", requires_grad=False)
    kl = torch.tensor([3000, 150], dtype=torch.int32, device="cuda")
    scale = D**-0.5
    modes = backends.Modes(None, 0.0, 0, top_left, window[0], window[1], False)
    out, lse = _raw_fwd_modes(q, k, v, scale, False, kl, splits, top_left, window)
    ref, ref_lse = reference.attention_forward(q.double(), k.double(), v.double(), scale, False, kl, upcast=True,
                                               modes=modes)
    math_out, _ = reference.attention_forward(q, k, v, scale, False, kl, modes=modes)
    rule_check("out", out, ref, math_out, torch.bfloat16, 2.0)
    assert torch.equal(torch.isneginf(lse), torch.isinf(ref_lse))
    dout = torch.randn_like(q)
    got = _raw_bwd_modes(dout, q, k, v, out, lse, scale, False, kl, splits, top_left, window)
    want = _raw_bwd_modes(dout, q, k, v, out, lse, scale, False, kl, 1, top_left, window)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-2, msg=lambda m: f"{name}: {m}")


def test_auto_picks_cuda_for_windows_and_top_left(cuda_ready):
    q, k, v = make_inputs(1, 4, 2, 64, 128, 64, dtype=torch.float16, device="cuda", requires_grad=False)
    feats = backends.get("cuda").features
    assert {"top_left", "window"} <= feats
    be = backends.select("auto", q, k, v, True, None, frozenset({"top_left", "window"}))
    assert be.name == "cuda"


# ---------------------------------------------------------------------------------------------
# Modes: attn_mask (bool, additive float with its gradient) and dropout
# ---------------------------------------------------------------------------------------------


def _gpu_mask(kind, shape, seed, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    if kind == "bool":
        return (torch.rand(shape, generator=g) >= 0.3).cuda()
    m = torch.randn(shape, generator=g).masked_fill(torch.rand(shape, generator=g) < 0.2, float("-inf"))
    return m.cuda().requires_grad_(requires_grad)


# (B, H, Hkv, Lq, Lk, D, causal, key_lengths, kind, mask shape, window)
GPU_MASK_CASES = [
    (2, 8, 2, 200, 300, 64, True, (300, 77), "bool", (2, 1, 200, 300), None),
    (1, 4, 4, 150, 150, 128, False, None, "float", (150, 150), None),
    (2, 4, 1, 1, 2048, 64, False, (2048, 100), "float", (2, 1, 1, 2048), None),  # decode, key padding bias
    (1, 4, 2, 256, 256, 96, True, None, "float", (1, 4, 256, 256), (64, -1)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", GPU_MASK_CASES, ids=lambda c: f"{c[8]}-q{c[3]}k{c[4]}d{c[5]}")
def test_attn_mask_and_its_gradient(cuda_ready, case, dtype):
    B, H, Hkv, Lq, Lk, D, causal, kl, kind, shape, window = case
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, dtype=dtype, device="cuda")
    mask = _gpu_mask(kind, shape, seed=D, requires_grad=kind == "float")
    check_against_reference(_cuda_fn(), q, k, v, causal, _kl(kl), attn_mask=mask, window=window)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_against_the_reference(cuda_ready, p):
    q, k, v = make_inputs(2, 8, 2, 300, 400, 64, dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(7)
    check_against_reference(_cuda_fn(), q, k, v, True, _kl((400, 123)), dropout_p=p, generator=gen)


def test_dropout_keep_mask_is_the_references_bit_for_bit(cuda_ready):
    # q = 0 and v = the identity: out[i, j] = keep(i, j) / ((1 - p) Lk)
    B, H, Hkv, Lq, Lk, D, p, seed = 2, 8, 2, 300, 64, 64, 0.3, -12345
    q = torch.zeros(B, H, Lq, D, dtype=torch.float16, device="cuda")
    k = torch.randn(B, Hkv, Lk, D, device="cuda").half()
    v = torch.eye(Lk, D, device="cuda").half().expand(B, Hkv, Lk, D).contiguous()
    out, _ = torch.ops.mhakern_C.fwd(q, k, v, 0.125, False, None, None, p, seed, False, -1, -1)
    want = reference.dropout_keep_mask(seed, B, H, Lq, Lk, p, device="cuda")
    assert torch.equal(out > 0, want)
