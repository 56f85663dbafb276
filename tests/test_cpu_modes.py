"""The cpu kernels' modes (attn_mask, float-mask gradient, dropout, top-left causal, sliding
windows, key lengths) and the NaN/inf contract, against a float64 oracle by the contract's tolerance rule (docs/contract.md).

The oracle here is self-contained (the package's reference gains the same modes separately): it
materialises the visibility of every (query, key) pair, the dropout keep mask from the counter
hash of docs/contract.md in int64 torch arithmetic, and computes every product pair by pair with
hidden pairs replaced by zeros *before* multiplying, so that a NaN at a hidden position cannot
reach anything, in the forward or in autograd's backward.

The kernels are driven through torch.ops.mhakern_C.fwd/bwd (INTERFACE.md section 4), or where those
are not registered yet through mhakern._C's temporary entry points with the same arguments;
everything skips, with the reason, when mhakern._C is not built.
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import mhakern
from attn_testing import rule_check
from mhakern.backends.cpu_backend import kernel_isa

_WHY = mhakern.available_backends().get("cpu", "backend 'cpu' is not registered")
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"cpu backend unavailable: {_WHY}")

M32 = 0xFFFFFFFF
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _C():
    from mhakern import _C

    return _C


# ---------------------------------------------------------------------------------------------
# The kernels with every mode


def _ops():
    """torch.ops.mhakern_C when the dispatcher ops are registered (INTERFACE.md section 4), else
    None: then the module's temporary entry points with the same arguments are used."""
    _C()
    return torch.ops.mhakern_C if hasattr(torch.ops, "mhakern_C") and hasattr(torch.ops.mhakern_C, "fwd") else None


def kernel_fwd(q, k, v, scale, causal=False, key_lengths=None, attn_mask=None, dropout_p=0.0, seed=0,
               top_left=False, window=(-1, -1)):
    args = (q, k, v, scale, causal, key_lengths, attn_mask, dropout_p, seed, top_left, window[0], window[1])
    ops = _ops()
    return ops.fwd(*args) if ops is not None else _C().cpu_attn_fwd_modes(*args)


def kernel_bwd(dout, q, k, v, out, lse, scale, causal=False, key_lengths=None, attn_mask=None, dropout_p=0.0,
               seed=0, top_left=False, window=(-1, -1), mask_grad=False):
    args = (dout, q, k, v, out, lse, scale, causal, key_lengths, attn_mask, dropout_p, seed, top_left, window[0],
            window[1], mask_grad)
    ops = _ops()
    return ops.bwd(*args) if ops is not None else _C().cpu_attn_bwd_modes(*args)


# ---------------------------------------------------------------------------------------------
# The float64 oracle


def mix32(x):
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & M32
    return x ^ (x >> 15)


def keep_mask(seed, B, H, Lq, Lk, p):
    """(B, H, Lq, Lk) bool: the dropout keep mask of docs/contract.md, in int64 arithmetic."""
    seed_lo, seed_hi = seed & M32, (seed >> 32) & M32
    bh = (torch.arange(B).view(B, 1, 1, 1) * H + torch.arange(H).view(1, H, 1, 1)) & M32
    s_bh = mix32(seed_lo ^ mix32(seed_hi ^ bh))
    r_i = mix32(s_bh ^ torch.arange(Lq).view(1, 1, Lq, 1))
    u = mix32((r_i + torch.arange(Lk).view(1, 1, 1, Lk)) & M32)
    return u >= min(int(p * 4294967296.0), M32)


def visible(B, H, Lq, Lk, causal, key_lengths, top_left, window, attn_mask):
    """(B, H, Lq, Lk) bool: which key each query sees (before -inf entries of a float mask)."""
    kl = torch.full((B,), Lk) if key_lengths is None else key_lengths.to(torch.int64)
    i = torch.arange(Lq).view(1, Lq, 1)
    j = torch.arange(Lk).view(1, 1, Lk)
    lkb = kl.view(B, 1, 1)
    c = i + (0 if top_left else lkb - Lq)
    vis = j < lkb
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    if right >= 0:
        vis = vis & (j <= c + right)
    if left >= 0:
        vis = vis & (j >= c - left)
    vis = vis.unsqueeze(1).expand(B, H, Lq, Lk)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        vis = vis & attn_mask
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        vis = vis & (attn_mask != float("-inf"))
    return vis


def oracle(q, k, v, scale, causal=False, key_lengths=None, attn_mask=None, keep=None, dropout_p=0.0, top_left=False,
           window=(-1, -1)):
    """out, lse in q's dtype (float64 for the oracle proper), pair by pair; differentiable in
    q, k, v and a float attn_mask ((B, H, Lq, Lk): its grad is dL/dscore)."""
    B, H, Lq, _ = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    vis = visible(B, H, Lq, Lk, causal, key_lengths, top_left, window, attn_mask)
    kr = k.repeat_interleave(H // Hkv, dim=1)
    vr = v.repeat_interleave(H // Hkv, dim=1)
    vis5 = vis.unsqueeze(-1)
    zero = torch.zeros((), dtype=q.dtype)
    qp = torch.where(vis5, q.unsqueeze(3), zero)
    kp = torch.where(vis5, kr.unsqueeze(2), zero)
    s = (qp * kp).sum(-1) * scale
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        s = s + torch.where(vis, attn_mask.to(q.dtype), zero)
    s = torch.where(vis, s, torch.tensor(float("-inf"), dtype=q.dtype))
    m = s.detach().amax(-1, keepdim=True) if Lk else torch.full((B, H, Lq, 1), float("-inf"), dtype=q.dtype)
    m = torch.where(m == float("-inf"), zero, m)
    e = torch.where(vis, torch.exp(s - m), zero)
    l = e.sum(-1, keepdim=True)
    p = e / torch.where(l == 0, torch.ones((), dtype=q.dtype), l)
    lse = torch.where(l == 0, torch.tensor(float("-inf"), dtype=q.dtype), m + torch.log(l)).squeeze(-1)
    if keep is not None:
        p = p * keep.to(q.dtype) / (1.0 - dropout_p)
    vp = torch.where(vis5, vr.unsqueeze(2), zero)
    out = (p.unsqueeze(-1) * vp).sum(3)
    return out, lse


def naive_math(q, k, v, scale, causal=False, key_lengths=None, attn_mask=None, keep=None, dropout_p=0.0,
               top_left=False, window=(-1, -1)):
    """The naive PyTorch computation in q's dtype (the rule's torch_math_in_T)."""
    B, H, Lq, _ = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    vis = visible(B, H, Lq, Lk, causal, key_lengths, top_left, window, attn_mask)
    kr = k.repeat_interleave(H // Hkv, dim=1)
    vr = v.repeat_interleave(H // Hkv, dim=1)
    s = (q @ kr.transpose(-1, -2)) * scale
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        s = s + attn_mask.to(q.dtype)
    s = s.masked_fill(~vis, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    if keep is not None:
        p = p * keep.to(q.dtype) / (1.0 - dropout_p)
    return p @ vr


# ---------------------------------------------------------------------------------------------
# One case through kernel and oracle, checked by the rule


def make(B, H, Hkv, Lq, Lk, D, Dv=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    Dv = D if Dv is None else Dv
    q = torch.randn(B, H, Lq, D, generator=g)
    k = torch.randn(B, Hkv, Lk, D, generator=g)
    v = torch.randn(B, Hkv, Lk, Dv, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def run_case(q, k, v, *, causal=False, key_lengths=None, attn_mask=None, dropout_p=0.0, seed=0, top_left=False,
             window=(-1, -1), mask_grad=False, scale=None, grads=True):
    """Kernel forward (and backward) against the oracle by the rule; returns the kernel's results."""
    dtype = q.dtype
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    scale = D**-0.5 if scale is None else scale
    kl = None if key_lengths is None else torch.tensor(key_lengths, dtype=torch.int32)
    mask4 = None if attn_mask is None else attn_mask.expand(B, H, Lq, Lk)
    keep = keep_mask(seed, B, H, Lq, Lk, dropout_p) if dropout_p > 0 else None
    modes = dict(causal=causal, key_lengths=kl, attn_mask=mask4, dropout_p=dropout_p, seed=seed, top_left=top_left,
                 window=window)
    out, lse = kernel_fwd(q, k, v, scale, **modes)
    assert out.dtype == dtype and lse.dtype == torch.float32

    omodes = dict(causal=causal, key_lengths=kl, keep=keep, dropout_p=dropout_p, top_left=top_left, window=window)
    leaf = lambda x, dt: x.detach().to(dt).requires_grad_(True)  # noqa: E731
    q64, k64, v64 = (leaf(x, torch.float64) for x in (q, k, v))
    qT, kT, vT = (leaf(x, dtype) for x in (q, k, v))
    m64 = mT = mask4
    if mask4 is not None and mask4.dtype != torch.bool:
        m64 = mask4.detach().to(torch.float64).contiguous().requires_grad_(mask_grad)
        mT = mask4.detach().to(dtype).contiguous().requires_grad_(mask_grad)
    ref, ref_lse = oracle(q64, k64, v64, scale, attn_mask=m64, **omodes)
    math = naive_math(qT, kT, vT, scale, attn_mask=mT, **omodes)
    rule_check("out", out, ref, math, dtype, 2.0)
    dead = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse.double()), dead), "lse: -inf pattern differs from the oracle"
    assert torch.equal(out[dead].float(), torch.zeros_like(out[dead].float())), "rows that see no key: out must be 0"
    if (~dead).any():
        err = (lse.double()[~dead] - ref_lse.detach()[~dead]).abs().max().item()
        assert err <= (1e-4 if dtype == torch.float32 else 2e-2) * max(1.0, ref_lse.detach()[~dead].abs().max().item())
    if not grads:
        return out, lse, None
    g = torch.Generator().manual_seed(7)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    dq, dk, dv, dmask = kernel_bwd(dout.to(dtype), q, k, v, out, lse, scale, mask_grad=mask_grad, **modes)
    ref.backward(dout)
    math.backward(dout.to(dtype))
    for name, got, x64, xT in (("dq", dq, q64, qT), ("dk", dk, k64, kT), ("dv", dv, v64, vT)):
        rule_check(name, got, x64.grad, xT.grad, dtype, 3.0)
    if mask_grad:
        assert dmask.shape == (B, H, Lq, Lk) and dmask.dtype == torch.float32
        rule_check("dmask", dmask, m64.grad, mT.grad, dtype, 3.0)
    else:
        assert dmask.numel() == 0
    return out, lse, (dq, dk, dv, dmask)


# ---------------------------------------------------------------------------------------------
# attn_mask


def _bool_mask(shape, seed=3, p_visible=0.7):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=g) < p_visible


MASK_SHAPES = {
    "1d": lambda B, H, Lq, Lk: (Lk,),
    "2d": lambda B, H, Lq, Lk: (Lq, Lk),
    "3d": lambda B, H, Lq, Lk: (H, Lq, Lk),
    "4d_b11": lambda B, H, Lq, Lk: (B, 1, 1, Lk),
    "4d_11qk": lambda B, H, Lq, Lk: (1, 1, Lq, Lk),
    "4d_full": lambda B, H, Lq, Lk: (B, H, Lq, Lk),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", list(MASK_SHAPES))
def test_bool_mask_broadcast_shapes(shape, dtype):
    B, H, Hkv, Lq, Lk, D = 2, 4, 2, 37, 150, 32
    q, k, v = make(B, H, Hkv, Lq, Lk, D, dtype=dtype)
    mask = _bool_mask(MASK_SHAPES[shape](B, H, Lq, Lk))
    run_case(q, k, v, attn_mask=mask)


def test_mask_is_read_in_place_through_broadcast_strides():
    # A (1, 1, Lq, Lk) mask expanded to (B, H, Lq, Lk) has stride 0 on B and H; a transposed
    # mask has a non-unit key stride. Both are read as given, never copied.
    B, H, Lq, Lk = 2, 3, 20, 70
    q, k, v = make(B, H, H, Lq, Lk, 16)
    base = _bool_mask((1, 1, Lq, Lk))
    view = base.expand(B, H, Lq, Lk)
    assert view.stride()[:2] == (0, 0)
    run_case(q, k, v, attn_mask=view)
    fm = torch.randn(1, 1, Lk, Lq).transpose(-1, -2)  # key stride Lq
    run_case(q, k, v, attn_mask=fm, mask_grad=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", ["2d", "3d", "4d_11qk", "4d_full"])
def test_float_mask_with_gradient(shape, dtype):
    B, H, Hkv, Lq, Lk, D = 2, 4, 1, 45, 140, 32
    q, k, v = make(B, H, Hkv, Lq, Lk, D, dtype=dtype, seed=1)
    g = torch.Generator().manual_seed(5)
    mask = torch.randn(MASK_SHAPES[shape](B, H, Lq, Lk), generator=g) * 2
    mask[..., 3] = float("-inf")  # hides key 3 exactly like a False
    run_case(q, k, v, attn_mask=mask, mask_grad=True)


def test_float_mask_minus_inf_equals_bool_false():
    B, H, Lq, Lk, D = 1, 2, 33, 90, 32
    q, k, v = make(B, H, H, Lq, Lk, D)
    vis = _bool_mask((B, H, Lq, Lk), seed=9)
    fmask = torch.zeros(B, H, Lq, Lk).masked_fill(~vis, float("-inf"))
    ob, lb = kernel_fwd(q, k, v, 0.2, attn_mask=vis)
    of, lf = kernel_fwd(q, k, v, 0.2, attn_mask=fmask)
    assert torch.equal(ob, of) and torch.equal(lb, lf)


def test_fully_masked_rows_give_zero_out_minus_inf_lse_and_zero_grads():
    B, H, Lq, Lk, D = 2, 2, 40, 100, 32
    q, k, v = make(B, H, 1, Lq, Lk, D)
    mask = _bool_mask((B, H, Lq, Lk), seed=4)
    mask[0, 1, 5] = False
    mask[1, :, 17:30] = False
    fmask = torch.zeros(B, H, Lq, Lk).masked_fill(~mask, float("-inf"))
    for m in (mask, fmask):
        out, lse, (dq, dk, dv, dmask) = run_case(q, k, v, attn_mask=m, mask_grad=m.dtype != torch.bool)
        assert torch.isneginf(lse[0, 1, 5]) and torch.isneginf(lse[1, :, 17:30]).all()
        assert (out[0, 1, 5] == 0).all() and (out[1, :, 17:30] == 0).all()
        assert (dq[0, 1, 5] == 0).all() and (dq[1, :, 17:30] == 0).all()
        if dmask.numel():
            assert (dmask[0, 1, 5] == 0).all() and (dmask[1, :, 17:30] == 0).all()


# ---------------------------------------------------------------------------------------------
# Causal alignment, windows, key lengths


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("Lq,Lk", [(50, 130), (130, 50), (70, 70)])
@pytest.mark.parametrize("top_left", [False, True])
def test_causal_alignment(Lq, Lk, top_left, dtype):
    q, k, v = make(2, 2, 1, Lq, Lk, 32, dtype=dtype)
    run_case(q, k, v, causal=True, top_left=top_left)


WINDOWS = [(0, 0), (5, 3), (16, -1), (-1, 7), (100, 0), (0, 200), (2**62, 2**62)]


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("top_left", [False, True])
def test_windows(window, top_left):
    # Lq > kRowBlock and Lk over two key blocks: windows skip whole key blocks and cut others.
    q, k, v = make(1, 2, 2, 150, 300, 32, seed=2)
    run_case(q, k, v, window=window, top_left=top_left)


@pytest.mark.parametrize("window", [(20, 5), (3, -1)], ids=str)
@pytest.mark.parametrize("top_left", [False, True])
def test_window_with_causal_and_key_lengths(window, top_left):
    q, k, v = make(3, 4, 2, 60, 140, 32, Dv=24, seed=3)
    run_case(q, k, v, causal=True, window=window, top_left=top_left, key_lengths=[140, 0, 61])


@pytest.mark.parametrize("Lq,Lk", [(0, 5), (4, 0), (0, 0)])
def test_empty_lengths_with_modes(Lq, Lk):
    q, k, v = make(2, 2, 1, Lq, Lk, 8)
    mask = torch.randn(2, 2, Lq, Lk)
    out, lse, (dq, dk, dv, dmask) = run_case(q, k, v, attn_mask=mask, mask_grad=True, dropout_p=0.5, seed=1,
                                             window=(1, 1), causal=True)
    assert (out == 0).all() and torch.isneginf(lse).all() and (dk == 0).all() and (dv == 0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_everything_at_once(dtype):
    # GQA, key lengths with a 0, a float mask with gradient, dropout, window, top-left causal.
    q, k, v = make(3, 6, 2, 70, 150, 48, Dv=40, dtype=dtype, seed=4)
    g = torch.Generator().manual_seed(6)
    mask = torch.randn(3, 1, 70, 150, generator=g)
    run_case(q, k, v, causal=True, top_left=True, window=(60, 2), key_lengths=[150, 0, 90], attn_mask=mask,
             mask_grad=True, dropout_p=0.25, seed=12345)


def test_decode_groups_with_modes():
    # Lq small: the query heads of a KV head share one row block; each keeps its own mask rows.
    q, k, v = make(2, 8, 2, 3, 300, 64, seed=5)
    mask = _bool_mask((2, 8, 3, 300), seed=8)
    run_case(q, k, v, attn_mask=mask, dropout_p=0.5, seed=-7, window=(40, 40), key_lengths=[300, 123])


def test_long_keys_split_path_with_modes():
    # Few rows and many keys: the forward and backward split the keys into ranges and merge them.
    q, k, v = make(1, 2, 1, 2, 5000, 32, seed=6)
    g = torch.Generator().manual_seed(2)
    mask = torch.randn(1, 1, 2, 5000, generator=g)
    run_case(q, k, v, attn_mask=mask, mask_grad=True, dropout_p=0.125, seed=99, window=(3000, -1),
             key_lengths=[4500])


# ---------------------------------------------------------------------------------------------
# Dropout


def _identity_case(B, H, Hkv, Lq, Lk, p, seed, **modes):
    """Kernel keep mask read back exactly: q = 0 makes the visible probabilities uniform and
    v = I (Dv = Lk) copies them to the output: out[..., i, j] != 0 iff key j is kept and visible."""
    q = torch.zeros(B, H, Lq, 16)
    k = torch.randn(B, Hkv, Lk, 16)
    v = torch.eye(Lk).expand(B, Hkv, Lk, Lk).contiguous()
    out, lse = kernel_fwd(q, k, v, 1.0, dropout_p=p, seed=seed, **modes)
    return out != 0


@pytest.mark.parametrize("p", [0.5, 0.125, 0.9, 0.1])
@pytest.mark.parametrize("seed", [0, 1, -1, 2**63 - 1, -(2**63), 0x1234_5678_9ABC_DEF0])
def test_dropout_mask_bit_pattern_equals_the_hash(p, seed):
    B, H, Hkv, Lq, Lk = 2, 4, 2, 70, 200
    got = _identity_case(B, H, Hkv, Lq, Lk, p, seed)
    want = keep_mask(seed, B, H, Lq, Lk, p)
    assert torch.equal(got, want), f"{(got != want).sum().item()} keep bits differ"
    frac = want.double().mean().item()
    assert abs(frac - (1 - p)) < 0.02


def test_dropout_mask_with_windows_and_decode_rows():
    B, H, Hkv, Lq, Lk = 1, 8, 1, 2, 256
    vis = visible(B, H, Lq, Lk, True, None, True, (100, -1), None)
    got = _identity_case(B, H, Hkv, Lq, Lk, 0.3, 77, causal=True, top_left=True, window=(100, -1))
    assert torch.equal(got, keep_mask(77, B, H, Lq, Lk, 0.3) & vis)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_against_oracle(dtype, p):
    q, k, v = make(2, 4, 2, 80, 170, 32, dtype=dtype, seed=8)
    run_case(q, k, v, dropout_p=p, seed=2024, causal=True)


def test_dropout_lse_is_the_undropped_softmax_and_p0_is_identity():
    q, k, v = make(1, 2, 2, 30, 60, 32)
    o0, l0 = kernel_fwd(q, k, v, 0.3)
    o1, l1 = kernel_fwd(q, k, v, 0.3, dropout_p=0.5, seed=3)
    ox, lx = kernel_fwd(q, k, v, 0.3, dropout_p=0.0, seed=3)
    assert torch.equal(l0, l1) and torch.equal(o0, ox) and torch.equal(l0, lx)
    assert not torch.equal(o0, o1)


def test_modes_deterministic_across_thread_counts():
    q, k, v = make(2, 4, 2, 90, 300, 32, seed=9)
    mask = torch.randn(2, 1, 90, 300)
    args = dict(attn_mask=mask.expand(2, 4, 90, 300), dropout_p=0.3, seed=5, window=(50, 10), causal=True)
    dout = torch.randn(2, 4, 90, 32)
    results = []
    n0 = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            out, lse = kernel_fwd(q, k, v, 0.2, **args)
            grads = kernel_bwd(dout, q, k, v, out, lse, 0.2, mask_grad=True, **args)
            results.append((out, lse) + tuple(grads))
    finally:
        torch.set_num_threads(n0)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# NaN / inf contract


def _nan_case(q, k, v, poison, **modes):
    """Kernel vs oracle with a NaN/inf planted by `poison(q, k, v)`: the non-finite pattern of
    out, lse and every gradient equals the oracle's, and the finite values agree."""
    q, k, v = q.clone(), k.clone(), v.clone()
    poison(q, k, v)
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    scale = D**-0.5
    kl = modes.pop("key_lengths", None)
    kl = None if kl is None else torch.tensor(kl, dtype=torch.int32)
    mask = modes.pop("attn_mask", None)
    mask4 = None if mask is None else mask.expand(B, H, Lq, Lk)
    out, lse = kernel_fwd(q, k, v, scale, key_lengths=kl, attn_mask=mask4, **modes)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    dq, dk, dv, _ = kernel_bwd(dout, q, k, v, out, lse, scale, key_lengths=kl, attn_mask=mask4, **modes)
    keep = None
    if modes.get("dropout_p", 0) > 0:
        keep = keep_mask(modes.get("seed", 0), B, H, Lq, Lk, modes["dropout_p"])
    q64, k64, v64 = (x.double().requires_grad_(True) for x in (q, k, v))
    omodes = {m: modes[m] for m in ("causal", "top_left", "window", "dropout_p") if m in modes}
    ref, ref_lse = oracle(q64, k64, v64, scale, key_lengths=kl, attn_mask=mask4, keep=keep, **omodes)
    ref.backward(dout.double())
    for name, got, want in (("out", out, ref), ("lse", lse, ref_lse), ("dq", dq, q64.grad), ("dk", dk, k64.grad),
                            ("dv", dv, v64.grad)):
        got, want = got.double(), want.detach()
        assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{name}: NaN pattern differs from the oracle"
        fin = torch.isfinite(want)
        assert torch.equal(torch.isfinite(got), fin), f"{name}: inf pattern differs from the oracle"
        assert torch.allclose(got[fin], want[fin], rtol=1e-4, atol=1e-4), f"{name}: finite values differ"
    return out, lse, dq, dk, dv


def _set(t, idx, val):
    t[idx] = val


def test_nan_in_a_visible_key_propagates_to_out_lse_and_gradients():
    q, k, v = make(1, 2, 1, 20, 40, 16)
    out, lse, dq, dk, dv = _nan_case(q, k, v, lambda q, k, v: _set(k, (0, 0, 5, 3), float("nan")))
    # Every row sees key 5: all of out and lse are NaN, and so are all gradients (none is 0).
    assert torch.isnan(out).all() and torch.isnan(lse).all()
    assert torch.isnan(dq).all() and torch.isnan(dk).all() and torch.isnan(dv).all()


@pytest.mark.parametrize(
    "modes",
    [
        dict(key_lengths=[30]),
        dict(causal=True),
        dict(causal=True, top_left=True),
        dict(window=(3, 2)),
        dict(attn_mask="bool"),
        dict(attn_mask="float"),
        dict(causal=True, dropout_p=0.5, seed=3),
    ],
    ids=lambda m: "-".join(f"{k}={v}" for k, v in m.items()),
)
@pytest.mark.parametrize("where", ["k", "v", "q"])
def test_nan_in_hidden_positions_never_influences_anything(modes, where):
    # A NaN in the keys/values that some rows cannot see (or in a query row that cannot see some
    # keys) reaches exactly what the oracle says: the rows (and keys) that see it, nothing else.
    modes = dict(modes)
    Lq, Lk = 20, 40
    if modes.get("attn_mask") == "bool":
        m = torch.ones(Lq, Lk, dtype=torch.bool)
        m[:, 33:] = False
        m[4, 10] = False
        modes["attn_mask"] = m
    elif modes.get("attn_mask") == "float":
        m = torch.zeros(Lq, Lk)
        m[:, 33:] = float("-inf")
        m[4, 10] = float("-inf")
        modes["attn_mask"] = m
    q, k, v = make(1, 2, 1, Lq, Lk, 16, seed=3)
    if where == "q":
        poison = lambda q, k, v: _set(q, (0, 1, 4, 2), float("nan"))  # noqa: E731
    else:
        # key 35: hidden by key_lengths, by the masks, and from early rows by causal/windows;
        # key 10 (masks only): hidden from row 4 alone.
        def poison(q, k, v):
            x = k if where == "k" else v
            x[0, 0, 35, 1] = float("nan")
            if "attn_mask" in modes:
                x[0, 0, 10, 2] = float("inf") if where == "v" else float("nan")

    out, lse, dq, dk, dv = _nan_case(q, k, v, poison, **modes)
    assert torch.isfinite(out).any() and torch.isfinite(dq).any()  # not everything is poisoned


def test_nan_in_hidden_key_of_a_long_split_row():
    # The forward's split key ranges merge partial results: a hidden NaN stays out of them.
    q, k, v = make(1, 1, 1, 1, 5000, 16, seed=4)
    out, lse, *_ = _nan_case(q, k, v, lambda q, k, v: (_set(k, (0, 0, 4900, 0), float("nan")),
                                                       _set(v, (0, 0, 4901, 0), float("nan"))),
                             key_lengths=[4800])
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    out, lse, *_ = _nan_case(q, k, v, lambda q, k, v: _set(k, (0, 0, 100, 0), float("nan")))
    assert torch.isnan(out).all() and torch.isnan(lse).all()


# ---------------------------------------------------------------------------------------------
# The portable kernels and bad arguments


@pytest.mark.parametrize("isa", ["DEFAULT", "AVX2"])
def test_other_isa_kernels_run_the_modes(isa):
    # The portable (ATEN_CPU_CAPABILITY=default) and AVX2 variants compile the same code with
    # other vectors: run a few mode and score-modifier cases there in a fresh process.
    if isa == "AVX2" and kernel_isa() != "AVX512":
        pytest.skip("the AVX2 variant is the one in use here, or the CPU lacks it")
    code = textwrap.dedent(
        """
        import sys, torch
        sys.path.insert(0, %r)
        import test_cpu_modes as t
        from mhakern.backends.cpu_backend import kernel_isa
        assert kernel_isa() == %r, kernel_isa()
        t.test_everything_at_once(torch.float32)
        t.test_everything_at_once(torch.bfloat16)
        t.test_dropout_mask_bit_pattern_equals_the_hash(0.3, -5)
        t.test_nan_in_hidden_positions_never_influences_anything(dict(window=(3, 2)), "v")
        t.test_nan_in_hidden_positions_never_influences_anything(dict(attn_mask="float"), "q")
        t.test_nan_in_a_visible_key_propagates_to_out_lse_and_gradients()
        import test_cpu_modifiers as tm  # the score modifiers' vector code (tanh) too
        cases = dict(tm.CASES)
        for name in ("cap2", "cap1000", "both-floatmask-grad", "decode-mqa"):
            tm.run_case(**cases[name])
        tm.run_case(dtype=torch.bfloat16, **cases["both-window"])
        print("ok")
        """
        % (os.path.dirname(os.path.abspath(__file__)), isa)
    )
    env = dict(os.environ, ATEN_CPU_CAPABILITY=isa.lower())
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(dropout_p=1.0), "dropout_p: expected a .* in \\[0, 1\\)"),
        (dict(dropout_p=-0.1), "dropout_p"),
        (dict(attn_mask=torch.ones(1, 2, 3, 4, dtype=torch.bool)), "attn_mask: expected"),
        (dict(attn_mask=torch.ones(1, 2, 3, 5, dtype=torch.int32)), "attn_mask: expected dtype bool"),
    ],
)
def test_bad_mode_arguments_are_refused_by_name(kw, match):
    q, k, v = make(1, 2, 2, 3, 5, 8)
    with pytest.raises((ValueError, TypeError), match=match):
        kernel_fwd(q, k, v, 1.0, **kw)


@pytest.mark.parametrize("window", [(-2, 0), (0, -5)])
def test_bad_windows_are_refused_by_the_python_layer_and_harmless_below_it(window):
    # One validation layer (docs/design.md): the window's range is the Python layer's check; the
    # C++ op, whose kernels read any side below 0 as unbounded, computes that and never reads
    # out of bounds.
    q, k, v = make(1, 2, 2, 3, 5, 8)
    with pytest.raises(ValueError, match="window: expected"):
        mhakern.attention(q, k, v, window=window, backend="cpu")
    out, lse = kernel_fwd(q, k, v, 1.0, window=window)
    want, want_lse = kernel_fwd(q, k, v, 1.0, window=tuple(max(w, -1) for w in window))
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
