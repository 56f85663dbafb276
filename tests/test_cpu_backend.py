"""The ``cpu`` backend (mhakern._C's fused multi-core C++ kernels) against the float64 reference.

Forward and backward by the tolerance rule in fp32, bf16 and fp16: the shared hard cases,
strided (B, L, H, D) views, large logits, fully masked rows, row/key block boundaries, GQA/MQA
decode (the query heads of a KV head processed together), head dims up to 256, a long-key case
(Lk = 2^20) against a reference computed in key chunks, random shapes (hypothesis), bad input at
the C++ boundary, determinism (also across thread counts) and the portable (DEFAULT) kernel
variant. Everything skips, with the reason, when mhakern._C is not built.
"""
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import mhakern
from attn_testing import ATOL, HARD_CASES, case_id, check_against_reference, make_inputs, rule_check
from mhakern import backends

_WHY = mhakern.available_backends().get("cpu", "backend 'cpu' is not registered")
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"cpu backend unavailable: {_WHY}")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def cpu_attention(*a, **kw):
    return mhakern.attention(*a, backend="cpu", **kw)


def _kl(lengths):
    return None if lengths is None else torch.tensor(lengths)


# ---------------------------------------------------------------------------------------------
# Availability and dispatch


def test_available_and_auto_picks_cpu_for_cpu_tensors():
    assert mhakern.available_backends()["cpu"] is None
    for dtype in DTYPES:
        q, k, v = make_inputs(1, 2, 1, 3, 5, 16, dtype=dtype, requires_grad=False)
        assert backends.select("auto", q, k, v, False, None).name == "cpu"


def test_unsupported_inputs_are_refused_with_reason_and_auto_falls_back():
    q, k, v = make_inputs(1, 1, 1, 2, 3, 300, requires_grad=False)
    with pytest.raises(ValueError, match="cpu: head dims up to 256 only, got D=300"):
        cpu_attention(q, k, v)
    assert backends.select("auto", q, k, v, False, None).name != "cpu"
    q64, k64, v64 = (x.double() for x in make_inputs(1, 1, 1, 2, 3, 8, requires_grad=False))
    with pytest.raises(ValueError, match="cpu: dtype torch.float64"):
        cpu_attention(q64, k64, v64)


def test_kernels_run_on_several_threads():
    if torch.get_num_threads() < 2:
        pytest.skip("torch runs one thread here (torch.get_num_threads() == 1)")
    # 1 would mean at::parallel_for ran serially: the module was built without torch's OpenMP.
    assert torch.ops.mhakern_C.cpu_parallel_threads_probe(64) == min(torch.get_num_threads(), 64)


def test_kernel_isa_is_reported():
    from mhakern.backends.cpu_backend import kernel_isa

    assert kernel_isa() in ("AVX512", "AVX2", "DEFAULT")
    assert kernel_isa() == torch.ops.mhakern_C.cpu_kernel_isa()


# ---------------------------------------------------------------------------------------------
# Correctness against the float64 reference


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("case", HARD_CASES[1::2], ids=case_id)
def test_hard_cases_strided_blhd(case, dtype):
    B, H, Hkv, Lq, Lk, D, Dv, causal, kl = case
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, Dv, dtype=dtype, layout="blhd", seed=3)
    if H > 1 and Lq > 1:
        assert not q.is_contiguous() and q.stride(-1) == 1
    check_against_reference(cpu_attention, q, k, v, causal, _kl(kl))


def test_outputs_mirror_the_query_layout():
    q, k, v = make_inputs(2, 4, 2, 9, 11, 32, layout="blhd", requires_grad=False)
    out = cpu_attention(q, k, v)
    assert out.transpose(1, 2).is_contiguous()
    out_c = cpu_attention(q.contiguous(), k.contiguous(), v.contiguous())
    assert torch.equal(out, out_c)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_large_logits_do_not_overflow(dtype, causal):
    # Inputs scaled by 30: scores in the thousands; exact softmax must stay finite and exact.
    q, k, v = make_inputs(2, 4, 2, 33, 47, 64, dtype=dtype, scale_inputs=30.0)
    check_against_reference(cpu_attention, q, k, v, causal, torch.tensor([47, 20]), large_logits=True)


def test_nan_in_a_visible_key_gives_nan_lse_and_gradients_not_zeros():
    # Issue 12: a NaN in k used to give out NaN but lse -inf and all gradients exactly 0, so a
    # diverging model saw zero gradients. Now NaN reaches out, lse and every gradient, as in SDPA.
    q, k, v = make_inputs(1, 2, 1, 5, 7, 16)
    with torch.no_grad():
        k[0, 0, 3, 0] = float("nan")
    out, lse = cpu_attention(q, k, v, return_lse=True)
    assert torch.isnan(out).all() and torch.isnan(lse).all()
    out.sum().backward()
    for g in (q.grad, k.grad, v.grad):
        assert torch.isnan(g).all()


def test_nan_in_hidden_keys_influences_nothing():
    # Keys past key_lengths are hidden: a NaN or inf there changes nothing.
    q, k, v = make_inputs(2, 2, 2, 6, 9, 16, requires_grad=False)
    kl = torch.tensor([9, 6])
    clean = [x.clone().requires_grad_(True) for x in (q, k, v)]
    dirty = [x.clone() for x in (q, k, v)]
    dirty[1][1, :, 7] = float("nan")  # past key_lengths[1]
    dirty[2][1, :, 8] = float("inf")
    dirty = [x.requires_grad_(True) for x in dirty]
    for causal in (False, True):
        outs = []
        for qq, kk, vv in (clean, dirty):
            for x in (qq, kk, vv):
                x.grad = None
            out, lse = cpu_attention(qq, kk, vv, causal=causal, key_lengths=kl, return_lse=True)
            out.sum().backward()
            outs.append((out, lse, qq.grad, kk.grad[:, :, :6], vv.grad[:, :, :6]))
        for a, b in zip(*outs):
            assert torch.isfinite(b).all() and torch.equal(a, b)


def test_nan_above_the_causal_diagonal_reaches_only_the_rows_that_see_it():
    # Issue 12: in a key block that some rows see and others do not, a hidden key's zero weight
    # times its NaN value must not reach the rows that do not see it.
    q, k, v = make_inputs(1, 2, 2, 6, 9, 16)
    with torch.no_grad():
        v[0, 0, 5, 1] = float("nan")  # bottom-right causal: key 5 is seen by queries 2..5
        k[0, 1, 6, 0] = float("nan")  # key 6: queries 3..5
    out, lse = cpu_attention(q, k, v, causal=True, return_lse=True)
    assert torch.isfinite(out[0, 0, :2]).all() and torch.isnan(out[0, 0, 2:, 1]).all()
    assert torch.isfinite(out[0, 1, :3]).all() and torch.isnan(out[0, 1, 3:]).all()
    assert torch.isfinite(lse[0, 0]).all() and torch.isnan(lse[0, 1, 3:]).all()
    finite_cols = torch.tensor([c for c in range(16) if c != 1])
    assert torch.isfinite(out[0, 0][:, finite_cols]).all() and torch.isfinite(lse[0, 0]).all()
    assert torch.isfinite(lse[0, 1, :3]).all()
    out.sum().backward()
    g = q.grad[0]
    assert torch.isfinite(g[0, :2]).all() and torch.isnan(g[0, 2:]).all()
    assert torch.isfinite(g[1, :3]).all() and torch.isnan(g[1, 3:]).all()
    # Query 5 sees every key: dk is NaN in both heads; dv only where P is NaN (head 1).
    assert torch.isnan(k.grad).all() and torch.isfinite(v.grad[0, 0]).all() and torch.isnan(v.grad[0, 1]).all()



@pytest.mark.parametrize(
    "B,H,Hkv,Lq,Lk,causal,kl",
    [
        (1, 2, 2, 65, 129, True, None),  # one query past a row block, one key past a key block
        (1, 2, 1, 130, 257, False, (200,)),
        (2, 2, 2, 64, 128, True, (128, 100)),  # exact blocks
        (1, 3, 3, 200, 70, True, None),  # Lq > Lk: leading rows see nothing, several row blocks
        (1, 2, 2, 33, 33, True, None),  # just above the decode grouping threshold
        (1, 4, 1, 32, 40, True, (17,)),  # at it: heads of a KV head share a row block
        (2, 80, 1, 1, 37, False, (37, 3)),  # MQA with more heads than one row block holds
        (2, 12, 3, 5, 45, True, (45, 2)),  # GQA decode with several queries, causal
    ],
)
def test_block_boundaries_and_head_grouping(B, H, Hkv, Lq, Lk, causal, kl):
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, 24, 40, seed=5)
    check_against_reference(cpu_attention, q, k, v, causal, _kl(kl))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_trainer_shape_mqa_one_query_per_head(dtype):
    # The memorization trainer's call (batch reduced; torch's own bf16 math, the rule's peer,
    # is slow on these tiny batched products): 20 query heads, one KV head, Lq = 1.
    q, k, v = make_inputs(16 if dtype == torch.float32 else 2, 20, 1, 1, 32, 64, dtype=dtype)
    check_against_reference(cpu_attention, q, k, v, False, None)


@pytest.mark.parametrize(
    "B,H,Hkv,Lq,Lk,D,Dv",
    [(8, 1, 1, 20, 32, 64, 64), (4, 4, 2, 5, 200, 64, 64), (3, 2, 2, 7, 33, 40, 24), (2, 3, 1, 3, 130, 12, 12)],
)
def test_row_major_backward_tiles_give_the_transposed_tiles_bits(B, H, Hkv, Lq, Lk, D, Dv):
    # The fp32 backward does a plain key block of a short row block (R rows padding to more
    # lanes than the keys do) as rows x keys tiles; any mask sends it through the keys x rows
    # tiles, and a mask of zeros changes no score. Both orders make every element by the same
    # chain of multiply-adds, so the gradients agree bit for bit (including a tensor given as
    # both k and v, head dims off the vector width and a partial second key block).
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, Dv, seed=13)
    for kv_same in (False, True) if D == Dv else (False,):
        vv = k if kv_same else v
        ins = (q, k) if kv_same else (q, k, vv)
        o = cpu_attention(q, k, vv)
        g = torch.randn_like(o)
        plain = torch.autograd.grad(o, ins, g)
        masked = torch.autograd.grad(cpu_attention(q, k, vv, attn_mask=torch.zeros(Lq, Lk)), ins, g)
        for a, b in zip(plain, masked):
            assert torch.equal(a, b)


@pytest.mark.parametrize("D,Dv", [(256, 256), (256, 8), (1, 1), (3, 130), (200, 17)])
def test_head_dims(D, Dv):
    q, k, v = make_inputs(2, 2, 1, 19, 23, D, Dv, seed=7)
    check_against_reference(cpu_attention, q, k, v, True, torch.tensor([23, 11]))


def test_split_key_ranges_with_few_rows():
    # Few row blocks and Lk >= 2048: the forward splits the keys across tasks and merges by
    # lse, the backward sums dQ partials of several key ranges.
    q, k, v = make_inputs(1, 2, 1, 3, 3000, 32, seed=11)
    check_against_reference(cpu_attention, q, k, v, True, torch.tensor([2900]))
    q, k, v = make_inputs(1, 2, 2, 70, 2500, 16, seed=12, dtype=torch.bfloat16)
    check_against_reference(cpu_attention, q, k, v, False, None)


def test_explicit_scale():
    q, k, v = make_inputs(2, 2, 2, 10, 12, 32)
    check_against_reference(cpu_attention, q, k, v, False, None, scale=0.37)
    q, k, v = make_inputs(2, 2, 2, 10, 12, 32)
    check_against_reference(cpu_attention, q, k, v, True, None, scale=-1.5)


# ---------------------------------------------------------------------------------------------
# Long keys against a reference computed in key chunks


def _chunked_attention(q, k, v, dout, scale, causal, key_lengths, dtype, chunk=1 << 17):
    """out, lse, dq, dk, dv and the largest |visible logit|, computed over key chunks in `dtype`
    (three passes: lse, out, grads).

    The query heads of a KV head are stacked as rows, (B, Hkv, rep * Lq, D), so K and V chunks
    are used without expanding them per query head.
    """
    B, H, Lq, D = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    rows = (H // Hkv) * Lq
    qg = q.to(dtype).reshape(B, Hkv, rows, D)
    dog = dout.to(dtype).reshape(B, Hkv, rows, Dv)
    k, v = k.to(dtype), v.to(dtype)
    lk = [Lk] * B if key_lengths is None else key_lengths.tolist()
    # Every row sees a prefix of the keys: j < lim[b][r].
    lim = [[min(lk[b], r % Lq + lk[b] - Lq + 1) if causal else lk[b] for r in range(rows)] for b in range(B)]

    def scores(j0):
        kc = k[:, :, j0 : j0 + chunk]
        s = torch.matmul(qg, kc.transpose(-1, -2)) * scale
        for b in range(B):
            for r in range(rows):
                s[b, :, r, max(0, lim[b][r] - j0) :] = -math.inf
        return s, kc

    lse = torch.full((B, Hkv, rows), -math.inf, dtype=dtype)
    max_logit = 0.0
    for j0 in range(0, Lk, chunk):
        s = scores(j0)[0]
        lse = torch.logaddexp(lse, torch.logsumexp(s, dim=-1))
        max_logit = max(max_logit, s[torch.isfinite(s)].abs().max().item())
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1)
    out = torch.zeros(B, Hkv, rows, Dv, dtype=dtype)
    for j0 in range(0, Lk, chunk):
        out += torch.matmul(torch.exp(scores(j0)[0] - safe), v[:, :, j0 : j0 + chunk])
    delta = (dog * out).sum(-1, keepdim=True)
    dq = torch.zeros_like(qg)
    dks, dvs = [], []
    for j0 in range(0, Lk, chunk):
        s, kc = scores(j0)
        p = torch.exp(s - safe)
        vc = v[:, :, j0 : j0 + chunk]
        ds = p * (torch.matmul(dog, vc.transpose(-1, -2)) - delta) * scale
        dq += torch.matmul(ds, kc)
        dks.append(torch.matmul(ds.transpose(-1, -2), qg))
        dvs.append(torch.matmul(p.transpose(-1, -2), dog))
    return (
        out.reshape(B, H, Lq, Dv),
        lse.reshape(B, H, Lq),
        dq.reshape(B, H, Lq, D),
        torch.cat(dks, 2),
        torch.cat(dvs, 2),
        max_logit,
    )


def test_long_keys_against_chunked_reference():
    B, H, Hkv, Lq, Lk, D, Dv = 2, 2, 1, 2, 1 << 20, 8, 4
    g = torch.Generator().manual_seed(21)
    # q scaled up so that attention concentrates on a few keys: the gradients of those keys
    # are far above the absolute tolerance, so dk and dv are really checked. Logits reach ~40,
    # so the gradients get the large-logit allowance of check_against_reference: one rounding
    # of the largest logit in every probability recomputed from lse.
    q = (torch.randn(B, H, Lq, D, generator=g) * 8).requires_grad_()
    k = torch.randn(B, Hkv, Lk, D, generator=g).requires_grad_()
    v = torch.randn(B, Hkv, Lk, Dv, generator=g).requires_grad_()
    dout = torch.randn(B, H, Lq, Dv, generator=g, dtype=torch.float64)
    kl = torch.tensor([Lk, Lk - 54321])
    scale = D**-0.5
    out, lse = cpu_attention(q, k, v, causal=True, key_lengths=kl, return_lse=True)
    out.backward(dout.float())
    with torch.no_grad():
        ref = _chunked_attention(q.double(), k, v, dout, scale, True, kl, torch.float64)
        mth = _chunked_attention(q.detach(), k.detach(), v.detach(), dout, scale, True, kl, torch.float32)
    rule_check("out", out, ref[0], mth[0], torch.float32, 2.0)
    assert (lse.double() - ref[1]).abs().max().item() <= 1e-3 * ref[1].abs().max().item()
    extra = 8 * torch.finfo(torch.float32).eps / 2 * ref[5]
    for name, got, r, m in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), ref[2:5], mth[2:5]):
        assert r.abs().max().item() > 100 * ATOL[torch.float32], f"{name}: check would be vacuous"
        rule_check(name, got, r, m, torch.float32, 3.0, extra * r.abs().max().item())


# ---------------------------------------------------------------------------------------------
# Random shapes and masks


def test_random_shapes_and_masks():
    hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed")
    st = hypothesis.strategies

    @hypothesis.settings(max_examples=20, deadline=None, derandomize=True, database=None)
    @hypothesis.given(
        B=st.integers(1, 3),
        Hkv=st.integers(1, 3),
        rep=st.integers(1, 4),
        Lq=st.integers(1, 80),
        Lk=st.integers(1, 150),
        D=st.integers(1, 72),
        Dv=st.integers(1, 40),
        causal=st.booleans(),
        masked=st.booleans(),
        layout=st.sampled_from(["bhld", "blhd"]),
        seed=st.integers(0, 2**16),
    )
    def run(B, Hkv, rep, Lq, Lk, D, Dv, causal, masked, layout, seed):
        q, k, v = make_inputs(B, rep * Hkv, Hkv, Lq, Lk, D, Dv, layout=layout, seed=seed)
        kl = torch.randint(0, Lk + 1, (B,), generator=torch.Generator().manual_seed(seed)) if masked else None
        check_against_reference(cpu_attention, q, k, v, causal, kl)

    run()


# ---------------------------------------------------------------------------------------------
# Determinism


def _fwd_bwd(q, k, v, causal, kl):
    for x in (q, k, v):
        x.grad = None
    out, lse = cpu_attention(q, k, v, causal=causal, key_lengths=kl, return_lse=True)
    (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return [out.detach().clone(), lse.clone(), q.grad.clone(), k.grad.clone(), v.grad.clone()]


@pytest.mark.parametrize(
    "shape", [(2, 4, 1, 37, 53, 32), (1, 2, 1, 4, 3000, 16), (1, 2, 2, 300, 1100, 32)], ids=str
)
def test_deterministic_across_runs_and_thread_counts(shape):
    B, H, Hkv, Lq, Lk, D = shape
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, dtype=torch.bfloat16, seed=2)
    kl = torch.tensor([Lk - 1] + [Lk // 2] * (B - 1))
    first = _fwd_bwd(q, k, v, True, kl)
    assert all(torch.equal(a, b) for a, b in zip(first, _fwd_bwd(q, k, v, True, kl)))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = _fwd_bwd(q, k, v, True, kl)
    finally:
        torch.set_num_threads(threads)
    # The work split depends on the shapes only, so one thread computes the same bits.
    assert all(torch.equal(a, b) for a, b in zip(first, single))


# ---------------------------------------------------------------------------------------------
# The C++ boundary: the dispatcher ops torch.ops.mhakern_C.fwd / bwd (bad input at the boundary:
# tests/test_cpp_errors.py, in a child process)

_NOMODES = (None, 0.0, 0, False, -1, -1)  # attn_mask, dropout_p, seed, top_left, window_left, window_right


def _fwd(q, k, v, scale, causal, key_lengths=None):
    return torch.ops.mhakern_C.fwd(q, k, v, scale, causal, key_lengths, *_NOMODES)


def _bwd(dout, q, k, v, out, lse, scale, causal, key_lengths=None):
    return torch.ops.mhakern_C.bwd(dout, q, k, v, out, lse, scale, causal, key_lengths, *_NOMODES, False)


def test_direct_calls_match_the_autograd_path():
    q, k, v = make_inputs(2, 4, 2, 9, 13, 32, seed=4)
    out, lse = cpu_attention(q, k, v, causal=True, return_lse=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    o2, l2 = _fwd(q.detach(), k.detach(), v.detach(), 32**-0.5, True)
    assert torch.equal(out, o2) and torch.equal(lse, l2)
    dq, dk, dv, dmask = _bwd(dout, q.detach(), k.detach(), v.detach(), o2, l2, 32**-0.5, True)
    assert torch.equal(dq, q.grad) and torch.equal(dk, k.grad) and torch.equal(dv, v.grad)
    assert dmask.shape == (0,) and dmask.dtype == torch.float32


@pytest.mark.parametrize("layout", ["bhld", "blhd"])
def test_outputs_are_allocated_by_the_op_in_the_inputs_layout(layout):
    q, k, v = make_inputs(2, 4, 2, 9, 13, 32, 24, layout=layout, requires_grad=False)
    out, lse = _fwd(q, k, v, 0.2, False)
    dq, dk, dv, _ = _bwd(torch.randn_like(out), q, k, v, out, lse, 0.2, False)
    for x, like, last in ((out, q, 24), (dq, q, 32), (dk, k, 32), (dv, v, 24)):
        assert x.shape == like.shape[:3] + (last,)
        # (B, L, H, D) inputs seen as (B, H, L, D) get outputs laid out the same way
        assert (x.stride(1) < x.stride(2)) == (layout == "blhd")
    assert lse.shape == (2, 4, 9) and lse.is_contiguous() and lse.dtype == torch.float32


def test_key_lengths_are_checked_by_the_backward_too():
    # Only the forward used to check the values: a bad length reaching the backward must raise,
    # never read outside k and v.
    q, k, v = make_inputs(2, 4, 2, 5, 7, 16, requires_grad=False)
    out, lse = _fwd(q, k, v, 0.25, False)
    with pytest.raises(ValueError, match=r"key_lengths: values must lie in \[0, Lk=7\], got 8 at index 0"):
        _bwd(torch.randn_like(out), q, k, v, out, lse, 0.25, False, torch.tensor([8, 1], dtype=torch.int32))


# ---------------------------------------------------------------------------------------------
# The portable kernel variant


_DEFAULT_ISA_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    import mhakern._C  # registers torch.ops.mhakern_C
    from attn_testing import check_against_reference, make_inputs

    ops = torch.ops.mhakern_C
    assert ops.cpu_kernel_isa() == "DEFAULT", ops.cpu_kernel_isa()
    NOMODES = (None, 0.0, 0, False, -1, -1)

    # mhakern._C's ops straight under autograd: the backend registry (and the other backends'
    # imports) stay out of this short process.
    class Attn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, scale, causal, kl):
            out, lse = ops.fwd(q, k, v, scale, causal, kl, *NOMODES)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.args = (scale, causal, kl)
            ctx.mark_non_differentiable(lse)
            return out, lse

        @staticmethod
        def backward(ctx, dout, _):
            q, k, v, out, lse = ctx.saved_tensors
            grads = ops.bwd(dout.contiguous(), q, k, v, out, lse, *ctx.args, *NOMODES, False)
            return (*grads[:3], None, None, None)

    def fn(q, k, v, causal=False, key_lengths=None, scale=None, return_lse=False):
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        kl = None if key_lengths is None else key_lengths.to(torch.int32)
        out, lse = Attn.apply(q, k, v, scale, causal, kl)
        return (out, lse) if return_lse else out

    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = make_inputs(2, 4, 2, 70, 90, 40, 24, dtype=dtype, layout="blhd")
        check_against_reference(fn, q, k, v, True, torch.tensor([90, 61]))
        q, k, v = make_inputs(3, 8, 1, 1, 33, 64, dtype=dtype)
        check_against_reference(fn, q, k, v, False, torch.tensor([33, 0, 5]))
    print("DEFAULT OK")
    """
)


def test_portable_default_variant_in_a_subprocess():
    # ATen's capability caps the variant: ATEN_CPU_CAPABILITY=default selects the portable one.
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    script = _DEFAULT_ISA_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "DEFAULT OK" in res.stdout


# ---------------------------------------------------------------------------------------------
# The forward's key-major tiles (kernel/plan.h key_tiles_fit): row blocks of 17-24 rows in
# AVX-512 vectors

# (B, H, Hkv, Lq, Lk, D, Dv): the trainer's call (20 query rows over 32 keys), keys not a
# multiple of 8, three key blocks, split key ranges, GQA decode of 20 heads, 19 and 24 rows.
_KEY_TILE_CASES = [
    (4, 1, 1, 20, 32, 64, 64),
    (2, 1, 1, 20, 37, 64, 32),
    (2, 2, 2, 19, 300, 32, 16),
    (1, 1, 1, 20, 3000, 64, 64),
    (2, 40, 2, 1, 77, 64, 64),
    (2, 1, 1, 24, 5, 128, 64),
]


def _key_tile_results():
    """Forward and backward of the cpu kernels on _KEY_TILE_CASES (the first case with a NaN row
    and a zero row), as int32 bits."""
    ops = torch.ops.mhakern_C
    res = []
    for i, (B, H, Hkv, Lq, Lk, D, Dv) in enumerate(_KEY_TILE_CASES):
        g = torch.Generator().manual_seed(i)
        q, k, v, do = (torch.randn(*s, generator=g) for s in
                       ((B, H, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, Dv), (B, H, Lq, Dv)))
        if i == 0:
            q[0, 0, 3, 5] = float("nan")
            q[1, 0, 7] = 0.0
        out, lse = ops.fwd_plain(q, k, v, D**-0.5, False, None)
        grads = ops.bwd_plain(do, q, k, v, out, lse, D**-0.5, False, None)[:3]
        res.append([x.view(torch.int32) for x in (out, lse, *grads)])
    return res


@pytest.mark.parametrize("case", _KEY_TILE_CASES[:5], ids=str)
def test_key_major_tiles_against_the_reference(case):
    B, H, Hkv, Lq, Lk, D, Dv = case
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, Dv)
    check_against_reference(cpu_attention, q, k, v)


def test_key_major_tiles_give_the_transposed_tiles_bits(tmp_path):
    # The forward's key-major tiles compute every element with the chains of the transposed
    # ones, so a call gives the same bits whichever it runs: with the AVX-512 kernels these
    # cases' forwards run key tiles, with the AVX2 ones (24 lanes for 20 rows: more than three
    # quarters filled) the transposed tiles, and the two tables agree bit for bit where both run
    # the same tiles (the backwards here).
    from mhakern.backends.cpu_backend import kernel_isa

    if kernel_isa() != "AVX512":
        pytest.skip(f"the AVX-512 kernels are not in use here ({kernel_isa()})")
    path = tmp_path / "avx2.pt"
    code = (f"import sys, torch; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
            f"import test_cpu_backend as t; torch.save(t._key_tile_results(), {str(path)!r})")
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for case, here, avx2 in zip(_KEY_TILE_CASES, _key_tile_results(), torch.load(path)):
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), here, avx2):
            assert torch.equal(a, b), (case, name)


# ---------------------------------------------------------------------------------------------
# One tensor as keys and values: its gradient dK + dV from the kernel

_KV_CASES = [
    # (q shape, kv shape, kwargs): the trainer's call (20 rows over 32 keys), causal GQA with a
    # long key range (split into key ranges), head dims not a multiple of 16, key lengths with an
    # empty row, a NaN key (the pairwise tiles), bf16 and a mask (the sum in the op layer)
    ((16, 1, 20, 64), (16, 1, 32, 64), dict(scale=0.125)),
    ((1, 4, 37, 24), (1, 2, 1300, 24), dict(causal=True)),
    ((1, 2, 5, 72), (1, 1, 300, 72), {}),
    ((2, 2, 9, 16), (2, 2, 11, 16), dict(key_lengths=torch.tensor([3, 0]))),
    ((2, 2, 9, 8), (2, 2, 11, 8), dict(nan_key=True)),
    ((2, 2, 9, 16), (2, 2, 11, 16), dict(dtype=torch.bfloat16)),
    ((2, 2, 9, 16), (2, 2, 11, 16), dict(attn_mask=torch.rand(9, 11) > 0.3)),
]


@pytest.mark.parametrize("qs,kvs,kw", _KV_CASES, ids=range(len(_KV_CASES)))
def test_one_tensor_as_keys_and_values_gets_the_sum_of_their_gradients(qs, kvs, kw, monkeypatch):
    """k is v: the tensor's gradient is dK + dV with autograd's rounding of the sum of two
    gradients (bit for bit the gradient of the same values given as two tensors), from the
    kernel itself for a plain float32 call (no dV tensor, no pass of its own for the sum)."""
    kw = dict(kw)
    dtype, nan_key = kw.pop("dtype", torch.float32), kw.pop("nan_key", False)
    g = torch.Generator().manual_seed(3)
    q, kv = torch.randn(qs, generator=g).to(dtype), torch.randn(kvs, generator=g).to(dtype)
    if nan_key:
        kv[0, 0, 4, 1] = float("nan")
    dout = torch.randn(qs[:3] + kvs[3:], generator=g).to(dtype)
    calls = []
    orig = type(backends.get("cpu")).backward_kv_sum
    def counted(self, *a):
        out = orig(self, *a)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(type(backends.get("cpu")), "backward_kv_sum", counted)

    def grads(shared):
        qq, k = q.clone().requires_grad_(), kv.clone().requires_grad_()
        v = k if shared else kv.clone().requires_grad_()
        out = cpu_attention(qq, k, v, **kw)
        out.backward(dout)
        return qq.grad, (k.grad if shared else k.grad + v.grad)

    one, two = grads(True), grads(False)
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[dtype]
    assert all(torch.equal(a.view(bits), b.view(bits)) for a, b in zip(one, two))
    assert sum(calls) == (1 if dtype == torch.float32 and "attn_mask" not in kw else 0)
    if nan_key:
        assert one[1].isnan().any() and not one[1][1].isnan().any()


def test_self_attention_and_bad_kv_sum_calls():
    """q is k is v keeps the three gradients apart (their sum is autograd's); the kv-sum operator
    names a non-float32 kv."""
    q = torch.randn(1, 2, 6, 8, requires_grad=True)
    cpu_attention(q, q, q).sum().backward()
    q2 = q.detach().clone().requires_grad_()
    cpu_attention(q2, q2.view(q2.shape), q2.view(q2.shape)).sum().backward()
    assert torch.equal(q.grad, q2.grad)
    x = torch.randn(1, 1, 4, 8, dtype=torch.bfloat16)
    out, lse = torch.ops.mhakern_C.fwd_plain(x, x, x, 1.0, False, None)
    with pytest.raises(ValueError, match="kv: expected float32"):
        torch.ops.mhakern_C.bwd_plain_kv_sum(out, x, x, out, lse, 1.0, False, None)
