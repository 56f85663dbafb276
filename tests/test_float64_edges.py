"""float64 keeps float64 through lse, the backward and the sinks' rescaling (docs/contract.md,
"Shapes and layout"): gradcheck and gradgradcheck at their default settings, and the gradients
of the float64 path against a float64 math formula written here (plain autograd through
``torch.softmax``) to 1e-12 relative. Before, lse was float32 for every dtype: gradients carried
~1e-7 relative error, sinks the output too, and gradcheck failed on the sinks cases."""
import math

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

import mhakern
from mhakern import reference

F64 = torch.float64


def math_attention(q, k, v, scale, causal=False, key_lengths=None, sinks=None, softcap=None, mask=None):
    """Attention from its definition in float64, differentiated by autograd: bottom-right causal,
    key lengths, softcap, an additive mask, a sink column with no value; rows that see nothing
    (possible only here with a key length 0 and a sink) attend to the sink alone."""
    B, H, Lq, _ = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    kk, vv = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    s = q @ kk.transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if mask is not None:
        s = s + mask
    j = torch.arange(Lk).view(1, 1, 1, Lk)
    lk = torch.full((B,), Lk) if key_lengths is None else key_lengths
    vis = j < lk.view(B, 1, 1, 1)
    if causal:
        vis = vis & (j <= torch.arange(Lq).view(1, 1, Lq, 1) + lk.view(B, 1, 1, 1) - Lq)
    s = s.masked_fill(~vis, -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.view(1, H, 1, 1).expand(B, H, Lq, 1)], -1)
    return torch.softmax(s, -1)[..., :Lk] @ vv


# name: (B, H, Hkv, Lq, Lk, D), options
CASES = {
    "plain": ((1, 2, 2, 5, 7, 8), {}),
    "causal": ((1, 2, 2, 5, 7, 8), dict(causal=True)),
    "gqa": ((2, 4, 2, 3, 6, 8), {}),
    "key_lengths": ((2, 2, 2, 4, 6, 8), dict(key_lengths=(6, 3))),
    "softcap": ((1, 2, 2, 5, 7, 8), dict(softcap=3.0)),
    "mask_grad": ((1, 2, 2, 5, 7, 8), dict(mask=True)),
    "sinks": ((1, 2, 2, 5, 7, 8), dict(sinks=True)),
    # element 1 sees no key: its rows attend to the sink alone
    "sinks_causal_kl0": ((2, 2, 1, 4, 6, 8), dict(sinks=True, causal=True, key_lengths=(6, 0))),
}


def _inputs(name):
    (B, H, Hkv, Lq, Lk, D), opt = CASES[name]
    g = torch.Generator().manual_seed(sorted(CASES).index(name))

    def leaf(*shape):
        return torch.randn(*shape, generator=g, dtype=F64).requires_grad_()

    q, k, v = leaf(B, H, Lq, D), leaf(B, Hkv, Lk, D), leaf(B, Hkv, Lk, D)
    extra = {}
    if opt.get("sinks"):
        extra["sinks"] = leaf(H)
    if opt.get("mask"):
        extra["mask"] = leaf(1, H, Lq, Lk)
    kw = dict(causal=opt.get("causal", False), softcap=opt.get("softcap"))
    if "key_lengths" in opt:
        kw["key_lengths"] = torch.tensor(opt["key_lengths"])
    return (q, k, v), extra, kw


def _fn(extra, kw, backend="auto"):
    names = list(extra)

    def fn(q, k, v, *rest):
        x = dict(zip(names, rest))
        return mhakern.attention(q, k, v, sinks=x.get("sinks"), attn_mask=x.get("mask"), backend=backend, **kw)

    return fn


@pytest.mark.parametrize("name", list(CASES))
def test_float64_gradcheck_and_gradgradcheck_at_default_settings(name):
    qkv, extra, kw = _inputs(name)
    fn, inputs = _fn(extra, kw), qkv + tuple(extra.values())
    assert gradcheck(fn, inputs)
    assert gradgradcheck(fn, inputs)
    assert mhakern.last_backend() == "reference"  # the one backend that takes float64


@pytest.mark.parametrize("name", list(CASES))
def test_float64_output_lse_and_gradients_match_the_math_formula_to_1e12(name):
    qkv, extra, kw = _inputs(name)
    q, k, v = qkv
    inputs = qkv + tuple(extra.values())
    out, lse = mhakern.attention(q, k, v, sinks=extra.get("sinks"), attn_mask=extra.get("mask"), return_lse=True,
                                 backend="reference", **kw)
    assert lse.dtype == F64 and reference.lse_dtype(F64) == F64
    want = math_attention(q, k, v, 1 / math.sqrt(q.shape[-1]), kw["causal"], kw.get("key_lengths"),
                          extra.get("sinks"), kw["softcap"], extra.get("mask"))
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=F64)
    got_g = torch.autograd.grad(out, inputs, dout)
    want_g = torch.autograd.grad(want, inputs, dout)
    names = ["out", "dq", "dk", "dv"] + ["d" + n for n in extra]
    for n, a, b in zip(names, (out,) + got_g, (want,) + want_g):
        assert a.dtype == F64, n
        rel = ((a - b).abs().max() / b.abs().max()).item()
        assert rel <= 1e-12, f"{name} {n}: relative error {rel:.2e}"


def test_float64_lse_of_every_entry_point_and_float32_otherwise():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, L, 8, generator=g, dtype=F64) for L in (3, 5, 5))
    sinks = torch.randn(2, generator=g, dtype=F64)
    _, lse = mhakern.attention(q, k, v, sinks=sinks, return_lse=True)
    exact = torch.logaddexp(torch.logsumexp(q @ k.transpose(-1, -2) / math.sqrt(8), -1), sinks.view(1, 2, 1))
    assert lse.dtype == F64 and (lse - exact).abs().max().item() < 1e-14
    # an empty key set takes the same dtype
    assert mhakern.attention(q, k[:, :, :0], v[:, :, :0], return_lse=True)[1].dtype == F64
    cu = torch.tensor([0, 1, 3])
    _, lse_v = mhakern.attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu,
                                        torch.tensor([0, 2, 5]), 2, 3, sinks=sinks, return_lse=True)
    assert lse_v.dtype == F64 and lse_v.shape == (2, 3)
    _, lse_c = mhakern.attention_with_kvcache(q, k.clone(), v.clone(), cache_seqlens=torch.tensor([5]),
                                              return_lse=True)
    assert lse_c.dtype == F64
    for be in [n for n, why in mhakern.available_backends().items() if why is None]:
        _, lse32 = mhakern.attention(q.float(), k.float(), v.float(), sinks=sinks.float(), return_lse=True,
                                     backend=be)
        assert lse32.dtype == torch.float32, be


def test_the_ops_fake_implementations_give_the_float64_dtypes():
    # attn_fwd's lse, attn_bwd's dmask and dsinks: float64 for float64 inputs, as the real ops
    # (what torch.compile's graphs are built from).
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, L, 8, generator=g, dtype=F64) for L in (3, 5, 5))
    mask = torch.randn(1, 2, 3, 5, generator=g, dtype=F64)
    sinks = torch.randn(2, generator=g, dtype=F64)
    modes = mhakern.modes.DEFAULT_MODES._replace(attn_mask=mask, sinks=sinks)
    fwd_args = (q, k, v, 0.3, False, None, "auto", *modes.op_args())
    torch.library.opcheck(torch.ops.mhakern.attn_fwd.default, fwd_args, test_utils=("test_faketensor",))
    out, lse = torch.ops.mhakern.attn_fwd(*fwd_args)
    assert lse.dtype == F64
    bwd_args = (torch.ones_like(out), q, k, v, out, lse, 0.3, False, None, "auto",
                *modes._replace(mask_grad=True).op_args())
    torch.library.opcheck(torch.ops.mhakern.attn_bwd.default, bwd_args, test_utils=("test_faketensor",))
    dmask, dsinks = torch.ops.mhakern.attn_bwd(*bwd_args)[3:]
    assert dmask.dtype == F64 and dsinks.dtype == F64
    with pytest.raises(ValueError, match="lse: expected torch.float64"):
        torch.ops.mhakern.attn_bwd(*bwd_args[:5], lse.float(), *bwd_args[6:])
