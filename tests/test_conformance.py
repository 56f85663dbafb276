"""One conformance suite for every registered backend (docs/contract.md).

Parametrized over (backend, case, dtype): each backend usable in this process runs the hard
cases against the float64 reference by the tolerance rule, every mode its ``features`` declare
(and is refused, naming the mode, for every mode it does not), the fully-masked-row rule and
the NaN/inf contract. A new backend plugs in by ``mhakern.backends.register``: nothing here
names a backend except to choose its dtypes (``DTYPES``) and to say why a case cannot run.

Triton runs through its interpreter on CPU tensors here (tests/conftest.py sets
TRITON_INTERPRET=1 when there is no GPU), so its shapes are the same but its dtypes fewer.
"""
from __future__ import annotations

import math

import pytest
import torch

import mhakern
from attn_testing import DEVICE, HARD_CASES, case_id, check_against_reference, dtypes_of, make_inputs, usable_backends
from mhakern import backends
from mhakern.backends import Modes

BACKENDS = usable_backends()


PAIRS = [(n, dt) for n in BACKENDS for dt in dtypes_of(n)]
PAIR_IDS = [f"{n}-{str(dt).replace('torch.', '')}" for n, dt in PAIRS]
# Mode and NaN cases take one dtype per backend (the widest it serves below float64), to keep
# the interpreter's time in bounds; the hard cases take every dtype.
MAIN = [(n, next((d for d in (torch.float32, torch.float16) if d in dtypes_of(n)), None)) for n in BACKENDS]
MAIN = [(n, d) for n, d in MAIN if d is not None]
MAIN_IDS = [n for n, _ in MAIN]


# Contract gaps of registered backends that this suite found and that are not fixed yet, as
# (backend, test id): reason. Strict xfail: once a kernel is fixed the test XPASSes and fails,
# and the entry must go. The first is the exception docs/contract.md states for the tiled GPU
# kernels.
_TILE_VALUE_NAN = (
    "a non-finite value of a key hidden from some rows of a query tile but seen by others reaches "
    "the hidden rows through 0 * NaN in the tile's P @ V (docs/contract.md, NaN and inf)"
)
# The CUDA backward (read, not run: no GPU here) subtracts a NaN lse from a -inf score, giving
# P = NaN on that pair, and multiplies dS = 0 by an infinite q or k entry: the "-inf score" rule
# of docs/contract.md is not in its kernels yet.
_CUDA_MINUS_INF_SCORE = (
    "the CUDA backward does not yet treat a -inf score made by an infinite q or k entry as hidden "
    "(docs/contract.md, NaN and inf)"
)
KNOWN_GAPS: dict = {
    ("triton", "test_nan_value_of_a_causally_hidden_key_reaches_only_the_rows_that_see_it"): _TILE_VALUE_NAN,
    ("cuda", "test_nan_value_of_a_causally_hidden_key_reaches_only_the_rows_that_see_it"): _TILE_VALUE_NAN,
    ("cuda", "test_plus_inf_score_makes_its_row_nan_and_only_the_keys_it_sees[query]"): _CUDA_MINUS_INF_SCORE,
    ("cuda", "test_minus_inf_score_from_an_infinite_key_hides_its_pair_in_the_backward"): _CUDA_MINUS_INF_SCORE,
}


@pytest.fixture(autouse=True)
def _known_gap(request):
    params = request.node.callspec.params if hasattr(request.node, "callspec") else {}
    name, test = params.get("name"), request.node.originalname
    if "where" in params:
        test += f"[{params['where']}]"
    why = KNOWN_GAPS.get((name, test))
    if why is not None:
        request.applymarker(pytest.mark.xfail(strict=True, reason=f"known contract gap of {name}: {why}"))


def _run(name):
    return lambda *a, **kw: mhakern.attention(*a, backend=name, **kw)


def _serves(name, q, k, v, causal, kl):
    why = backends.get(name).supports(q, k, v, causal, kl)
    if why is not None:
        pytest.skip(f"{name} does not serve this shape/dtype: {why}")


# ---------------------------------------------------------------------------------------------
# Hard cases, every dtype


@pytest.mark.parametrize("case", HARD_CASES, ids=case_id)
@pytest.mark.parametrize("name,dtype", PAIRS, ids=PAIR_IDS)
def test_hard_cases(name, dtype, case):
    B, H, Hkv, Lq, Lk, D, Dv, causal, kl = case
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, Dv, dtype=dtype, device=DEVICE)
    kl_t = None if kl is None else torch.tensor(kl, device=DEVICE)
    _serves(name, q, k, v, causal, kl_t)
    check_against_reference(_run(name), q, k, v, causal, kl_t)


@pytest.mark.parametrize("case", HARD_CASES[1::3], ids=case_id)
@pytest.mark.parametrize("name,dtype", MAIN, ids=MAIN_IDS)
def test_hard_cases_strided_blhd(name, dtype, case):
    B, H, Hkv, Lq, Lk, D, Dv, causal, kl = case
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, Dv, dtype=dtype, device=DEVICE, layout="blhd")
    kl_t = None if kl is None else torch.tensor(kl, device=DEVICE)
    _serves(name, q, k, v, causal, kl_t)
    check_against_reference(_run(name), q, k, v, causal, kl_t)


# ---------------------------------------------------------------------------------------------
# Modes: (id, shape, builder of the call's mode arguments)

MODE_SHAPES = {
    "self": (2, 4, 2, 17, 17, 32, 32),
    "cross": (2, 4, 1, 13, 29, 32, 16),
    "longq": (1, 2, 2, 29, 11, 16, 16),
    "decode": (3, 8, 2, 1, 40, 64, 64),
}


def _bool_mask(shape, seed, p_hide=0.3):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=g) >= p_hide).to(DEVICE)


def _float_mask(shape, seed, grad=False, n_inf=3):
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(shape, generator=g)
    flat = m.view(-1)
    for t in torch.randint(0, flat.numel(), (n_inf,), generator=g).tolist():
        flat[t] = -math.inf
    return m.to(DEVICE).requires_grad_(grad)


def _gen(seed):
    return torch.Generator(device="cpu").manual_seed(seed)


def _slopes(shape, seed, dtype=torch.float32):
    """ALiBi slopes in (0.1, 1): steep enough to reorder a row's scores."""
    g = torch.Generator().manual_seed(seed)
    return (0.1 + 0.9 * torch.rand(shape, generator=g)).to(device=DEVICE, dtype=dtype)


def _sinks(H, seed, grad=True):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(H, generator=g) * 2.0).to(DEVICE).requires_grad_(grad)


# Each builder: (B, H, Lq, Lk) -> dict of check_against_reference keyword arguments.
MODE_CASES = {
    "mask-bool-2d": ("cross", lambda B, H, Lq, Lk: dict(attn_mask=_bool_mask((Lq, Lk), 1))),
    "mask-bool-4d-kl": ("self", lambda B, H, Lq, Lk: dict(attn_mask=_bool_mask((B, H, Lq, Lk), 2), key_lengths=(17, 5))),
    "mask-bool-row-dead": ("longq", lambda B, H, Lq, Lk: dict(attn_mask=_bool_mask((B, 1, Lq, 1), 3, 0.5))),
    "mask-float-1d": ("decode", lambda B, H, Lq, Lk: dict(attn_mask=_float_mask((Lk,), 4))),
    "mask-float-grad-bh1k": ("cross", lambda B, H, Lq, Lk: dict(attn_mask=_float_mask((B, H, 1, Lk), 5, grad=True))),
    "mask-float-grad-3d": ("self", lambda B, H, Lq, Lk: dict(attn_mask=_float_mask((H, Lq, Lk), 6, grad=True), causal=True)),
    "dropout": ("self", lambda B, H, Lq, Lk: dict(dropout_p=0.3, generator=_gen(7))),
    "dropout-causal-kl": ("cross", lambda B, H, Lq, Lk: dict(dropout_p=0.5, generator=_gen(8), causal=True, key_lengths=(29, 4))),
    "top-left-causal-longq": ("longq", lambda B, H, Lq, Lk: dict(causal=True, causal_align="top_left")),
    "top-left-causal-cross": ("cross", lambda B, H, Lq, Lk: dict(causal=True, causal_align="top_left", key_lengths=(7, 29))),
    "window-both": ("self", lambda B, H, Lq, Lk: dict(window=(3, 2))),
    "window-left-causal": ("cross", lambda B, H, Lq, Lk: dict(window=(5, -1), causal=True, key_lengths=(29, 9))),
    "window-right-top-left": ("longq", lambda B, H, Lq, Lk: dict(window=(-1, 0), causal_align="top_left")),
    "window-decode": ("decode", lambda B, H, Lq, Lk: dict(window=(8, 0), key_lengths=(40, 3, 0))),
    "all-modes": ("cross", lambda B, H, Lq, Lk: dict(
        attn_mask=_float_mask((1, H, Lq, Lk), 9, grad=True), dropout_p=0.2, generator=_gen(10), causal=True,
        causal_align="top_left", window=(6, -1), key_lengths=(20, 29))),
    # Score modifiers (docs/contract.md, "Score modifiers"): softcap where tanh bends (2) and
    # where it barely does (30); ALiBi per head and per batch element, with both alignments;
    # sinks (the op layer's, so every backend) with their gradient, on rows that see no key too.
    "softcap-small": ("self", lambda B, H, Lq, Lk: dict(softcap=2.0)),
    "softcap-large-causal-kl": ("cross", lambda B, H, Lq, Lk: dict(softcap=30.0, causal=True, key_lengths=(29, 4))),
    "softcap-mask-grad": ("self", lambda B, H, Lq, Lk: dict(
        softcap=2.0, attn_mask=_float_mask((B, H, Lq, Lk), 11, grad=True))),
    "alibi-heads-top-left": ("longq", lambda B, H, Lq, Lk: dict(
        alibi_slopes=_slopes((H,), 12, torch.float16), causal=True, causal_align="top_left")),
    "alibi-batch-window-kl": ("cross", lambda B, H, Lq, Lk: dict(
        alibi_slopes=_slopes((B, H), 13), window=(5, -1), causal=True, key_lengths=(29, 9))),
    "alibi-bottom-right-nocausal": ("longq", lambda B, H, Lq, Lk: dict(alibi_slopes=_slopes((H,), 14))),
    "softcap-alibi-bool-mask": ("cross", lambda B, H, Lq, Lk: dict(
        softcap=2.0, alibi_slopes=_slopes((H,), 15), attn_mask=_bool_mask((Lq, Lk), 16))),
    "sinks": ("self", lambda B, H, Lq, Lk: dict(sinks=_sinks(H, 17))),
    "sinks-dead-rows-causal-kl": ("cross", lambda B, H, Lq, Lk: dict(
        sinks=_sinks(H, 18), causal=True, key_lengths=(29, 0))),
    "sinks-dropout-mask-grad": ("self", lambda B, H, Lq, Lk: dict(
        sinks=_sinks(H, 19), dropout_p=0.3, generator=_gen(20), attn_mask=_float_mask((H, Lq, Lk), 21, grad=True))),
    "all-modifiers-decode": ("decode", lambda B, H, Lq, Lk: dict(
        softcap=2.0, alibi_slopes=_slopes((B, H), 22), sinks=_sinks(H, 23), window=(8, 0), key_lengths=(40, 3, 0))),
}


def _needed(kw) -> frozenset:
    m = kw.get("attn_mask")
    w = kw.get("window") or (-1, -1)
    causal_or_window = kw.get("causal", False) or w != (-1, -1)
    return Modes(
        attn_mask=m,
        dropout_p=kw.get("dropout_p", 0.0),
        top_left=kw.get("causal_align") == "top_left" and (causal_or_window or kw.get("alibi_slopes") is not None),
        window_left=w[0],
        window_right=w[1],
        mask_grad=m is not None and m.is_floating_point() and m.requires_grad,
        softcap=kw.get("softcap") or 0.0,
        alibi_slopes=kw.get("alibi_slopes"),
    ).required_features()


@pytest.mark.parametrize("mode", list(MODE_CASES))
@pytest.mark.parametrize("name,dtype", MAIN, ids=MAIN_IDS)
def test_modes(name, dtype, mode):
    shape_id, build = MODE_CASES[mode]
    B, H, Hkv, Lq, Lk, D, Dv = MODE_SHAPES[shape_id]
    kw = build(B, H, Lq, Lk)
    needed = _needed(kw)
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, Dv, dtype=dtype, device=DEVICE)
    causal = kw.pop("causal", False)
    kl = kw.pop("key_lengths", None)
    kl = None if kl is None else torch.tensor(kl, device=DEVICE)
    _serves(name, q, k, v, causal, kl)
    missing = sorted(needed - backends.get(name).features)
    if missing:
        # Dispatch must refuse it by name, never run it without the mode.
        with pytest.raises(ValueError, match="does not implement " + missing[0]):
            _run(name)(q, k, v, causal=causal, key_lengths=kl, **kw)
        return
    check_against_reference(_run(name), q, k, v, causal, kl, **kw)


@pytest.mark.parametrize("name,dtype", MAIN, ids=MAIN_IDS)
def test_dropout_is_reproducible_and_drops_the_reference_keep_mask(name, dtype):
    B, H, Lq, Lk, D = 2, 3, 5, 40, 16
    q, k, v = make_inputs(B, H, 1, Lq, Lk, D, dtype=dtype, device=DEVICE, requires_grad=False)
    if "dropout" not in backends.get(name).features:
        with pytest.raises(ValueError, match="does not implement dropout"):
            mhakern.attention(q, k, v, dropout_p=0.4, backend=name)
        return
    # v = identity rows (Lk = value dim would be needed): use v = one-hot of the key index, so
    # out[..., j] / P[..., j] is exactly keep / (1 - p) and the keep pattern can be read back.
    v = torch.eye(Lk, dtype=dtype, device=DEVICE).expand(B, 1, Lk, Lk).contiguous()
    p = 0.4
    a = mhakern.attention(q, k, v, dropout_p=p, generator=_gen(123), backend=name)
    b = mhakern.attention(q, k, v, dropout_p=p, generator=_gen(123), backend=name)
    assert torch.equal(a, b), "same generator state, different output"
    seed = mhakern.checks.draw_seed(_gen(123))
    keep = mhakern.reference.dropout_keep_mask(seed, B, H, Lq, Lk, p, DEVICE)
    assert torch.equal(a != 0, keep), "dropped positions differ from the reference keep mask"
    c = mhakern.attention(q, k, v, dropout_p=p, generator=_gen(124), backend=name)
    assert not torch.equal(a != 0, c != 0), "another seed, the same keep mask"


# ---------------------------------------------------------------------------------------------
# Rows that see no key, and the NaN/inf contract


@pytest.mark.parametrize("name,dtype", MAIN, ids=MAIN_IDS)
def test_fully_masked_rows_zero_output_and_gradient(name, dtype):
    q, k, v = make_inputs(2, 2, 2, 8, 5, 16, dtype=dtype, device=DEVICE)
    _serves(name, q, k, v, True, torch.tensor([0, 5]))
    out, lse = _run(name)(q, k, v, causal=True, key_lengths=torch.tensor([0, 5], device=DEVICE), return_lse=True)
    assert torch.all(out[0] == 0) and torch.all(torch.isneginf(lse[0]))
    assert torch.all(out[1, :, :3] == 0) and torch.all(torch.isneginf(lse[1, :, :3]))
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.all(q.grad[0] == 0) and torch.all(q.grad[1, :, :3] == 0)
    assert torch.all(k.grad[0] == 0) and torch.all(v.grad[0] == 0)


def _fwd_bwd(name, q, k, v, **kw):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out, lse = _run(name)(q, k, v, return_lse=True, **kw)
    g = torch.Generator().manual_seed(11)
    out.backward(torch.randn(out.shape, generator=g).to(device=out.device, dtype=out.dtype))
    return out.detach(), lse, q.grad, k.grad, v.grad


@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("name,dtype", MAIN, ids=MAIN_IDS)
def test_nan_in_a_key_hidden_by_key_lengths_changes_nothing(name, dtype, where):
    q, k, v = make_inputs(2, 4, 2, 6, 12, 16, dtype=dtype, device=DEVICE, requires_grad=False)
    kl = torch.tensor([7, 12], device=DEVICE)
    clean = _fwd_bwd(name, q, k, v, key_lengths=kl, causal=True)
    dirty = {"k": k.clone(), "v": v.clone()}
    dirty[where][0, :, 7:] = math.nan
    dirty[where][0, 1, 9, 3] = math.inf
    got = _fwd_bwd(name, q, dirty["k"], dirty["v"], key_lengths=kl, causal=True)
    # Hidden keys get zero gradients in both runs, so everything must be bit-identical.
    for label, a, b in zip(("out", "lse", "dq", "dk", "dv"), clean, got):
        assert torch.equal(a, b), f"{label}: a NaN/inf in a hidden key changed the result"
    assert torch.all(got[3][0, :, 7:] == 0) and torch.all(got[4][0, :, 7:] == 0), "hidden keys got a gradient"


@pytest.mark.parametrize("name,dtype", MAIN, ids=MAIN_IDS)
def test_nan_in_a_causally_hidden_key_reaches_only_the_rows_that_see_it(name, dtype):
    # Lq = Lk = 9 bottom-right causal: key 6 is seen by rows 6.. only.
    q, k, v = make_inputs(1, 2, 2, 9, 9, 16, dtype=dtype, device=DEVICE, requires_grad=False)
    k[0, :, 6, 0] = math.nan
    out, lse, dq, dk, dv = _fwd_bwd(name, q, k, v, causal=True)
    assert torch.isfinite(out[:, :, :6]).all() and torch.isfinite(lse[:, :, :6]).all(), "rows before 6 saw the NaN"
    assert torch.isfinite(dq[:, :, :6]).all(), "dq of rows that do not see the NaN key"
    assert torch.isnan(out[:, :, 6:]).all() and torch.isnan(lse[:, :, 6:]).all(), "rows that see it must be NaN"
    assert torch.isnan(dq[:, :, 6:]).all(), "dq of rows that see it must be NaN (never silently finite)"
    assert torch.isnan(dk).any() and torch.isnan(dv).any()


@pytest.mark.parametrize("name,dtype", MAIN, ids=MAIN_IDS)
def test_nan_value_of_a_causally_hidden_key_reaches_only_the_rows_that_see_it(name, dtype):
    # As above with the NaN in v: rows before 6 share a tile with the rows that see key 6.
    q, k, v = make_inputs(1, 2, 2, 9, 9, 16, dtype=dtype, device=DEVICE, requires_grad=False)
    v[0, :, 6, 0] = math.nan
    out, lse, dq, dk, dv = _fwd_bwd(name, q, k, v, causal=True)
    assert torch.isnan(out[:, :, 6:, 0]).all(), "rows that see the NaN value must be NaN in its column"
    assert torch.isfinite(out[:, :, :6]).all() and torch.isfinite(dq[:, :, :6]).all(), "rows before 6 saw the NaN value"


@pytest.mark.parametrize("name,dtype", MAIN, ids=MAIN_IDS)
def test_nan_in_a_visible_key_gives_nan_out_lse_and_gradients(name, dtype):
    q, k, v = make_inputs(2, 4, 2, 5, 8, 16, dtype=dtype, device=DEVICE, requires_grad=False)
    k[1, 0, 3, 5] = math.nan  # kv head 0 serves query heads 0 and 1 of element 1
    out, lse, dq, dk, dv = _fwd_bwd(name, q, k, v)
    assert torch.isnan(out[1, :2]).all() and torch.isnan(lse[1, :2]).all()
    assert torch.isnan(dq[1, :2]).all() and torch.isnan(dk[1, 0]).any() and torch.isnan(dv[1, 0]).any()
    # everything else is untouched
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[1, 2:]).all() and torch.isfinite(lse[1, 2:]).all()
    assert torch.isfinite(dq[0]).all() and torch.isfinite(dk[1, 1]).all() and torch.isfinite(dv[0]).all()


@pytest.mark.parametrize("name,dtype", MAIN, ids=MAIN_IDS)
def test_inf_in_a_visible_value_propagates(name, dtype):
    q, k, v = make_inputs(1, 2, 1, 4, 6, 16, dtype=dtype, device=DEVICE, requires_grad=False)
    v[0, 0, 2, 7] = math.inf
    out, lse, dq, dk, dv = _fwd_bwd(name, q, k, v)
    assert not torch.isfinite(out[..., 7]).any(), "an inf in a visible value must not vanish"
    assert torch.isfinite(out[..., :7]).all() and torch.isfinite(out[..., 8:]).all()
    assert torch.isfinite(lse).all()


def _nan_rows(x):
    """Indices (along dim 2) of the rows of x holding a NaN."""
    return sorted(set(torch.nonzero(torch.isnan(x), as_tuple=True)[2].tolist()))


@pytest.mark.parametrize("name,dtype", MAIN, ids=MAIN_IDS)
def test_nan_query_reaches_only_the_keys_its_row_sees(name, dtype):
    # Lq = Lk = 9 bottom-right causal: row 2 sees keys 0..2. Its NaN makes its out, lse and dq
    # NaN and dk, dv NaN for keys 0..2 alone (SDPA's math kernel spreads it to every key).
    q, k, v = make_inputs(1, 2, 2, 9, 9, 16, dtype=dtype, device=DEVICE, requires_grad=False)
    q[0, :, 2, 3] = math.nan
    out, lse, dq, dk, dv = _fwd_bwd(name, q, k, v, causal=True)
    assert _nan_rows(out) == [2] and _nan_rows(lse.unsqueeze(-1)) == [2] and _nan_rows(dq) == [2]
    assert _nan_rows(dk) == [0, 1, 2] and _nan_rows(dv) == [0, 1, 2], "a key the NaN row cannot see got NaN"
    assert torch.isnan(dv[0, :, :3]).all()


@pytest.mark.parametrize("where", ["bias", "query"])
@pytest.mark.parametrize("name,dtype", MAIN, ids=MAIN_IDS)
def test_plus_inf_score_makes_its_row_nan_and_only_the_keys_it_sees(name, dtype, where):
    # Row 2 of a 9 x 9 causal call gets a +inf score for key 1 (a +inf bias entry, or q[2, 0] =
    # +inf against k[1, 0] > 0), so its softmax is undefined (inf / inf): lse NaN, not +inf,
    # and P NaN on the pairs it sees. With the query, key 0 gets k[0, 0] < 0, a -inf score:
    # probability 0 exactly, so its dk and dv stay finite even on this NaN row.
    q, k, v = make_inputs(1, 2, 2, 9, 9, 16, dtype=dtype, device=DEVICE, requires_grad=False)
    kw = {}
    if where == "bias":
        if "attn_mask" not in backends.get(name).features:
            pytest.skip(f"{name} does not implement attn_mask")
        bias = torch.zeros(9, 9, device=DEVICE)
        bias[2, 1] = math.inf
        kw["attn_mask"] = bias
        seen = [0, 1, 2]
    else:
        q[0, :, 2, 0] = math.inf
        k[0, :, 0, 0] = -1.0
        k[0, :, 1, 0] = 1.0
        k[0, :, 2, 0] = 0.5
        seen = [1, 2]
    out, lse, dq, dk, dv = _fwd_bwd(name, q, k, v, causal=True, **kw)
    assert torch.isnan(lse[:, :, 2]).all(), "a +inf score's row has a NaN lse"
    assert _nan_rows(out) == [2] and _nan_rows(dq) == [2]
    assert torch.isfinite(lse[:, :, [0, 1, 3, 4, 5, 6, 7, 8]]).all()
    assert _nan_rows(dv) == seen and _nan_rows(dk) == seen, (_nan_rows(dk), _nan_rows(dv))
    assert torch.isnan(dv[0, :, seen]).all()


@pytest.mark.parametrize("name,dtype", MAIN, ids=MAIN_IDS)
def test_minus_inf_score_from_an_infinite_key_hides_its_pair_in_the_backward(name, dtype):
    # k[1, 0] = +inf, not causal, 40 keys (a block with no masking in the tiled kernels): rows
    # with q[i, 0] > 0 get a +inf score (NaN rows), rows with q[i, 0] < 0 a -inf one, which hides
    # the pair: their dq has no 0 * inf from key 1 and stays finite, as their out and lse.
    q, k, v = make_inputs(1, 1, 1, 20, 40, 16, dtype=dtype, device=DEVICE, requires_grad=False)
    q[0, 0, :, 0] = torch.where(torch.arange(20, device=DEVICE) % 3 == 0, 1.0, -1.0).to(dtype)
    k[0, 0, 1, 0] = math.inf
    out, lse, dq, dk, dv = _fwd_bwd(name, q, k, v)
    pos = [i for i in range(20) if i % 3 == 0]
    assert _nan_rows(out) == pos and _nan_rows(lse.unsqueeze(-1)) == pos and _nan_rows(dq) == pos
    assert torch.isnan(dk).any() and torch.isnan(dv).all()  # the NaN rows see every key


@pytest.mark.parametrize("name,dtype", MAIN, ids=MAIN_IDS)
def test_nan_in_a_query_that_sees_no_key_changes_nothing(name, dtype):
    q, k, v = make_inputs(2, 2, 2, 3, 5, 16, dtype=dtype, device=DEVICE, requires_grad=False)
    kl = torch.tensor([0, 5], device=DEVICE)
    q[0] = math.nan
    out, lse, dq, dk, dv = _fwd_bwd(name, q, k, v, key_lengths=kl)
    assert torch.all(out[0] == 0) and torch.isneginf(lse[0]).all() and torch.all(dq[0] == 0)
    assert torch.isfinite(out[1]).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()


@pytest.mark.parametrize("name,dtype", MAIN, ids=MAIN_IDS)
def test_nan_in_a_masked_float_bias_changes_nothing(name, dtype):
    q, k, v = make_inputs(1, 2, 2, 4, 6, 16, dtype=dtype, device=DEVICE, requires_grad=False)
    kl = torch.tensor([4], device=DEVICE)
    bias = torch.randn(4, 6, device=DEVICE)
    if "attn_mask" not in backends.get(name).features:
        with pytest.raises(ValueError, match="does not implement attn_mask"):
            mhakern.attention(q, k, v, attn_mask=bias, backend=name)
        return
    clean = _fwd_bwd(name, q, k, v, key_lengths=kl, attn_mask=bias)
    bias[:, 4:] = math.nan  # hidden by key_lengths
    got = _fwd_bwd(name, q, k, v, key_lengths=kl, attn_mask=bias)
    for label, a, b in zip(("out", "lse", "dq", "dk", "dv"), clean, got):
        assert torch.equal(a, b), f"{label}: a NaN in the bias of hidden keys changed the result"
    bias[1, 0] = math.nan  # visible: row 1 becomes NaN
    out = _fwd_bwd(name, q, k, v, key_lengths=kl, attn_mask=bias)[0]
    assert torch.isnan(out[:, :, 1]).all() and torch.isfinite(out[:, :, [0, 2, 3]]).all()


@pytest.mark.parametrize("name", BACKENDS)
def test_registered_backend_declares_known_features_and_refuses_what_it_lacks(name):
    be = backends.get(name)
    assert be.features <= backends.ALL_FEATURES
    q, k, v = make_inputs(1, 2, 2, 3, 4, 16, device=DEVICE, requires_grad=False)
    for feat, kw in (("window", dict(window=(1, 1))), ("top_left", dict(causal=True, causal_align="top_left")),
                     ("dropout", dict(dropout_p=0.5)), ("attn_mask", dict(attn_mask=torch.ones(3, 4, dtype=torch.bool))),
                     ("softcap", dict(softcap=5.0)), ("alibi", dict(alibi_slopes=torch.ones(2, device=DEVICE)))):
        if feat in be.features:
            continue
        with pytest.raises(ValueError, match=f"backend={name!r} cannot serve.*does not implement {feat}"):
            mhakern.attention(q, k, v, backend=name, **kw)


# ---------------------------------------------------------------------------------------------
# Sinks: the gradient by finite differences, and the identities that pin the composition


def test_sinks_gradient_by_finite_differences_in_float64():
    # The op layer's analytic dsinks (and dq, dk, dv from the sink-inclusive lse) against
    # central differences, on the reference backend in float64; rows 0..2 of element 1 see no
    # key (key length 0) and so attend to the sink alone.
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, L, 8, generator=g, dtype=torch.float64, device=DEVICE).requires_grad_()
               for L in (3, 5, 5))
    sinks = torch.randn(2, generator=g, dtype=torch.float64, device=DEVICE).requires_grad_()
    kl = torch.tensor([5, 0], device=DEVICE)

    def fn(q, k, v, sinks):
        return mhakern.attention(q, k, v, causal=True, key_lengths=kl, sinks=sinks, softcap=3.0, backend="reference")

    # At gradcheck's defaults: lse, the sinks' rescaling and dsinks are float64 for float64
    # inputs (the contract), so central differences see no float32 rounding.
    assert torch.autograd.gradcheck(fn, (q, k, v, sinks))


@pytest.mark.parametrize("name,dtype", MAIN, ids=MAIN_IDS)
def test_sinks_of_minus_inf_change_nothing_and_large_sinks_take_the_mass(name, dtype):
    q, k, v = make_inputs(2, 4, 2, 5, 7, 16, dtype=dtype, device=DEVICE, requires_grad=False)
    kl = torch.tensor([7, 0], device=DEVICE)
    run = _run(name)
    out, lse = run(q, k, v, key_lengths=kl, return_lse=True)
    none = torch.full((4,), -math.inf, device=DEVICE)
    out2, lse2 = run(q, k, v, key_lengths=kl, sinks=none, return_lse=True)
    assert torch.equal(out, out2) and torch.equal(lse, lse2), "a sink of -inf must be no sink"
    big = torch.full((4,), 60.0, device=DEVICE)
    out3, lse3 = run(q, k, v, key_lengths=kl, sinks=big, return_lse=True)
    assert out3.abs().max().item() < 1e-12 + 0.0 * out.abs().max().item() + 1e-6, "the sink takes the mass"
    assert torch.allclose(lse3, torch.full_like(lse3, 60.0), atol=1e-4), "lse includes the sink"
    assert torch.all(out3[1] == 0) and torch.all(lse3[1] == 60.0), "a row with no key attends to the sink alone"
