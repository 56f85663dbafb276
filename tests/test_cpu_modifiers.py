"""The cpu kernels' score modifiers, softcap and ALiBi (docs/contract.md, "Score modifiers"),
forward and backward, against the float64 reference by the contract's tolerance rule.

Each case runs the kernels twice, through the backend object (``backends.get("cpu")``) and
through the dispatcher ops ``torch.ops.mhakern_C.fwd/bwd``, and meets the modifiers with the
other modes on every path the kernels have: the grouped decode path (Lq = 1, heads sharing a KV
head), the split key ranges (Lk long, few row blocks), masked and unmasked tiles, the pairwise
fallback, rows that see no key. The oracle is ``reference.attention_forward`` /
``attention_backward_modes`` in float64; "torch math in T" is the naive autograd reference
(``reference.attention`` without upcast) in the input dtype.
"""
from __future__ import annotations

import math

import pytest
import torch

import mhakern
from attn_testing import make_inputs, rule_check
from mhakern import backends, reference
from mhakern.backends import Modes

_WHY = mhakern.available_backends().get("cpu", "backend 'cpu' is not registered")
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"cpu backend unavailable: {_WHY}")


def _ops_fwd(q, k, v, scale, causal, kl, m):
    return torch.ops.mhakern_C.fwd(q, k, v, scale, causal, kl, *m.c_op_args())


def _ops_bwd(dout, q, k, v, out, lse, scale, causal, kl, m):
    dq, dk, dv, dmask = torch.ops.mhakern_C.bwd(dout, q, k, v, out, lse, scale, causal, kl, *m.c_op_bwd_args())
    return dq, dk, dv, (dmask if m.mask_grad else None)


def _be_fwd(q, k, v, scale, causal, kl, m):
    return backends.get("cpu").forward(q, k, v, scale, causal, kl, m)


def _be_bwd(dout, q, k, v, out, lse, scale, causal, kl, m):
    return backends.get("cpu").backward(dout, q, k, v, out, lse, scale, causal, kl, m)


def slopes(B, H, per_batch, seed=3):
    """float32 (B, H) ALiBi slopes: FlashAttention's geometric per-head ones expanded over the
    batch (stride 0), or per (batch, head) values as a transposed (non-contiguous) view."""
    if not per_batch:
        return torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)]).expand(B, H)
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(H, B, generator=g) * 0.5 + 0.01).t()


def run_case(B, H, Hkv, Lq, Lk, D, Dv=None, dtype=torch.float32, causal=False, kl=None, *, softcap=0.0,
             alibi=None, mask=None, mask_grad=False, dropout_p=0.0, top_left=False, window=(-1, -1), scale_inputs=1.0,
             seed=0):
    """Checks out, lse and dq, dk, dv (and dmask with mask_grad) of both entry points.

    ``alibi``: None, "head" (per head) or "batch" (per batch element and head); ``mask``:
    None, "bool" or "float" (B, H, Lq, Lk), with a few -inf / False entries and, for "bool",
    whole rows hidden."""
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, Dv, dtype=dtype, scale_inputs=scale_inputs, seed=seed,
                          requires_grad=False)
    g = torch.Generator().manual_seed(seed + 1)
    am = None
    if mask == "float":
        am = torch.randn(B, H, Lq, Lk, generator=g)
        am[torch.rand(B, H, Lq, Lk, generator=g) < 0.2] = -math.inf
    elif mask == "bool":
        am = torch.rand(B, H, Lq, Lk, generator=g) > 0.3
        am[:, :, :1] = False  # a row that sees no key
    al = None if alibi is None else slopes(B, H, alibi == "batch")
    klt = None if kl is None else torch.tensor(kl, dtype=torch.int32)
    m = Modes(am, dropout_p, 12345 if dropout_p else 0, top_left, window[0], window[1], mask_grad, softcap, al)
    scale = D ** -0.5
    dout = torch.randn(B, H, Lq, Dv or D, generator=g)

    # The oracle in float64, and the naive math in dtype T (autograd).
    q64, k64, v64 = (x.double() for x in (q, k, v))
    m64 = m._replace(attn_mask=None if am is None else (am if am.dtype == torch.bool else am.double()))
    out64, lse64 = reference.attention_forward(q64, k64, v64, scale, causal, klt, upcast=True, modes=m64)
    g64 = reference.attention_backward_modes(dout.double(), q64, k64, v64, out64, lse64, scale, causal, klt,
                                             upcast=True, modes=m64)
    qT, kT, vT = (x.clone().requires_grad_(True) for x in (q, k, v))
    amT = am
    if am is not None and am.dtype != torch.bool:
        amT = am.to(dtype).requires_grad_(mask_grad)
    outT = reference.attention(qT, kT, vT, scale, causal, klt, upcast=False, modes=m._replace(attn_mask=amT))
    outT.backward(dout.to(dtype))
    mathT = [qT.grad, kT.grad, vT.grad] + ([amT.grad] if mask_grad else [])

    for fwd, bwd in ((_be_fwd, _be_bwd), (_ops_fwd, _ops_bwd)):
        out, lse = fwd(q, k, v, scale, causal, klt, m)
        rule_check("out", out, out64, outT, dtype, 2.0)
        dead = torch.isneginf(lse64)
        assert torch.equal(torch.isneginf(lse.double()), dead), "lse: -inf pattern differs from the reference"
        if (~dead).any():
            err = (lse.double() - lse64)[~dead].abs().max().item()
            assert err <= 1e-3 * max(1.0, lse64[~dead].abs().max().item()), f"lse: max error {err:.3e}"
        grads = bwd(dout.to(dtype), q, k, v, out, lse, scale, causal, klt, m)
        names = ("dq", "dk", "dv", "dmask")
        for name, got, ref, mt in zip(names, grads, g64, mathT):
            rule_check(name, got, ref, mt, dtype, 3.0)
        assert (grads[3] is None) == (not mask_grad)


# Each case: (id, shapes, modes). Small shapes; every path of the kernels and every mode meets a
# modifier at least once, and softcap meets both a small cap (where tanh bends) and a large one.
CASES = [
    ("cap2", dict(B=2, H=2, Hkv=2, Lq=17, Lk=33, D=32, softcap=2.0, scale_inputs=3.0)),
    ("cap50-causal", dict(B=1, H=2, Hkv=2, Lq=37, Lk=113, D=32, causal=True, softcap=50.0)),
    # A cap far above the scores: tanh's argument is about 1e-3, so its error is amplified 1000x
    # (an exp-based tanh alone would be 6e-5 off here).
    ("cap1000", dict(B=1, H=2, Hkv=2, Lq=16, Lk=40, D=32, softcap=1000.0)),
    ("cap-saturated-x30", dict(B=1, H=2, Hkv=1, Lq=20, Lk=24, D=24, softcap=5.0, scale_inputs=30.0)),
    ("alibi-head-causal-kl", dict(B=3, H=4, Hkv=2, Lq=19, Lk=29, D=64, Dv=48, causal=True, kl=(29, 0, 13),
                                  alibi="head")),
    ("alibi-batch-topleft", dict(B=2, H=2, Hkv=2, Lq=113, Lk=37, D=32, causal=True, top_left=True,
                                 alibi="batch")),
    ("both-window", dict(B=1, H=4, Hkv=2, Lq=33, Lk=50, D=80, window=(7, 3), softcap=4.0, alibi="batch")),
    ("both-floatmask-grad", dict(B=2, H=2, Hkv=1, Lq=9, Lk=21, D=16, mask="float", mask_grad=True, softcap=3.0,
                                 alibi="head")),
    ("both-boolmask", dict(B=1, H=2, Hkv=2, Lq=20, Lk=40, D=16, mask="bool", softcap=10.0, alibi="batch")),
    ("both-dropout", dict(B=2, H=2, Hkv=2, Lq=17, Lk=17, D=16, causal=True, dropout_p=0.3, softcap=2.5,
                          alibi="head")),
    ("decode-mqa", dict(B=2, H=8, Hkv=1, Lq=1, Lk=67, D=64, kl=(67, 5), softcap=3.0, alibi="batch")),
    ("splitk", dict(B=1, H=1, Hkv=1, Lq=3, Lk=2100, D=16, causal=True, softcap=2.0, alibi="head")),
]
DTYPE_CASES = [
    ("bf16", torch.bfloat16, dict(B=1, H=2, Hkv=1, Lq=33, Lk=50, D=32, causal=True, softcap=2.0, alibi="batch")),
    ("fp16", torch.float16, dict(B=2, H=2, Hkv=2, Lq=19, Lk=29, D=64, kl=(29, 3), softcap=20.0, alibi="head")),
]


@pytest.mark.parametrize("case", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_modifiers_fp32(case):
    run_case(**case)


@pytest.mark.parametrize("dtype,case", [(c[1], c[2]) for c in DTYPE_CASES], ids=[c[0] for c in DTYPE_CASES])
def test_modifiers_half(dtype, case):
    run_case(dtype=dtype, **case)


def test_features_declared():
    # Read from csrc/capabilities.h through the module: dispatch routes modifier calls here.
    assert {"softcap", "alibi"} <= backends.get("cpu").features


@pytest.mark.parametrize("softcap", [-1.0, math.nan, math.inf])
def test_bad_softcaps_are_refused_by_the_python_layer(softcap):
    # One validation layer (docs/design.md): the cap's range is checked once, by the Python
    # layer, for every entry point and backend (the public call and the operator); below it the
    # C++ kernels read the value as given (it indexes no memory).
    q, k, v = make_inputs(2, 4, 2, 5, 7, 16, requires_grad=False)
    with pytest.raises(ValueError, match="softcap: expected a positive finite number"):
        mhakern.attention(q, k, v, softcap=softcap, backend="cpu")
    with pytest.raises(ValueError, match="softcap"):
        torch.ops.mhakern.attn_fwd(q, k, v, 0.25, False, None, "cpu", *Modes(softcap=softcap).op_args())


@pytest.mark.parametrize("entry", ["backend", "ops"])
@pytest.mark.parametrize("bad,match", [
    (dict(alibi_slopes=torch.ones(2, 4, dtype=torch.float64)), "alibi_slopes"),
    (dict(alibi_slopes=torch.ones(4)), "alibi_slopes"),
    (dict(alibi_slopes=torch.ones(2, 3)), "alibi_slopes"),
])
def test_bad_modifiers_name_the_argument(entry, bad, match):
    q, k, v = make_inputs(2, 4, 2, 5, 7, 16, requires_grad=False)
    m = Modes(**bad)
    fwd, bwd = (_be_fwd, _be_bwd) if entry == "backend" else (_ops_fwd, _ops_bwd)
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        fwd(q, k, v, 0.25, False, None, m)
    out, lse = fwd(q, k, v, 0.25, False, None, Modes())
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        bwd(out, q, k, v, out, lse, 0.25, False, None, m)


@pytest.mark.parametrize("where,value", [("q", math.inf), ("k", math.inf), ("q", math.nan), ("v", math.inf)])
@pytest.mark.parametrize("causal", [False, True])
def test_nonfinite_inputs_spread_as_the_reference(where, value, causal):
    # The cap maps an infinite score to +-softcap (finite) and its derivative to 0, so an inf
    # reaches only what 0 * inf makes NaN: the NaN/inf pattern of every output must be the
    # oracle's, and the finite values must agree (loosely: the precision is the rule-checked
    # cases' business; here a gross error is what is looked for).
    q, k, v = make_inputs(1, 2, 2, 6, 9, 8, requires_grad=False, seed=5)
    {"q": q, "k": k, "v": v}[where][0, 1, 2, 3] = value
    m = Modes(softcap=2.0, alibi_slopes=torch.full((1, 2), 0.3))
    dout = torch.randn(1, 2, 6, 8, generator=torch.Generator().manual_seed(6))
    out, lse = _be_fwd(q, k, v, 0.35, causal, None, m)
    got = [out, lse, *_be_bwd(dout, q, k, v, out, lse, 0.35, causal, None, m)[:3]]
    q64, k64, v64 = (x.double() for x in (q, k, v))
    o64, l64 = reference.attention_forward(q64, k64, v64, 0.35, causal, None, upcast=True, modes=m)
    ref = [o64, l64, *reference.attention_backward_modes(dout.double(), q64, k64, v64, o64, l64, 0.35, causal, None,
                                                         upcast=True, modes=m)[:3]]
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        a = a.double()
        assert torch.equal(torch.isnan(a), torch.isnan(b)), f"{name}: NaN pattern differs"
        assert torch.equal(torch.isinf(a), torch.isinf(b)), f"{name}: inf pattern differs"
        fin = torch.isfinite(b)
        assert torch.allclose(a[fin], b[fin], atol=1e-4, rtol=1e-4), f"{name}: finite values differ"
