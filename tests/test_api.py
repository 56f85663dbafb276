"""Public API: dispatch, bad input, and the semantics on the reference backend."""
import pytest
import torch

import mhakern
from attn_testing import HARD_CASES, case_id, check_against_reference, make_inputs


def test_available_backends_lists_reference_and_reasons():
    av = mhakern.available_backends()
    assert av["reference"] is None
    for name, why in av.items():
        assert why is None or (isinstance(why, str) and why), name


@pytest.mark.parametrize("case", HARD_CASES, ids=case_id)
def test_reference_backend_through_autograd_function(case):
    B, H, Hkv, Lq, Lk, D, Dv, causal, kl = case
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, Dv)
    kl_t = None if kl is None else torch.tensor(kl)
    check_against_reference(lambda *a, **kw: mhakern.attention(*a, backend="reference", **kw), q, k, v, causal, kl_t)


def test_strided_blhd_inputs_are_not_copied_and_output_follows_layout():
    q, k, v = make_inputs(2, 4, 2, 9, 11, 16, layout="blhd")
    out = mhakern.attention(q, k, v, backend="reference")
    assert out.shape == (2, 4, 9, 16)
    # (B, L, H, D) memory order kept: merging heads afterwards needs no copy
    assert out.transpose(1, 2).is_contiguous()


def test_empty_keys_give_zero_output_and_neg_inf_lse():
    q, k, v = make_inputs(1, 2, 2, 3, 0, 16)
    out, lse = mhakern.attention(q, k, v, return_lse=True, backend="reference")
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))
    out.sum().backward()
    assert torch.all(q.grad == 0)


def _bad(**over):
    q, k, v = make_inputs(2, 4, 2, 5, 6, 16, requires_grad=False)
    args = dict(q=q, k=k, v=v)
    args.update(over)
    kw = {n: args.pop(n) for n in list(args) if n not in ("q", "k", "v")}
    return lambda: mhakern.attention(args["q"], args["k"], args["v"], **kw)


@pytest.mark.parametrize(
    "make,exc,words",
    [
        (lambda: _bad(k=torch.randn(3, 2, 6, 16)), ValueError, ["k:", "batch size 3", "2"]),
        (lambda: _bad(k=torch.randn(2, 3, 6, 16), v=torch.randn(2, 3, 6, 16)), ValueError, ["kv heads (3)", "(4)"]),
        (lambda: _bad(v=torch.randn(2, 2, 7, 16)), ValueError, ["k, v:", "must match"]),
        (lambda: _bad(k=torch.randn(2, 2, 6, 8)), ValueError, ["head dim 8", "16"]),
        (lambda: _bad(q=torch.randn(2, 4, 5, 16, dtype=torch.float64)), TypeError, ["dtypes must match", "float64"]),
        (lambda: _bad(q=torch.randn(2, 4, 5, 16, device="meta")), ValueError, ["one device", "meta"]),
        (lambda: _bad(q=torch.randn(4, 5, 16)), ValueError, ["q:", "4 dims"]),
        (lambda: _bad(q=torch.randn(2, 4, 5, 0), k=torch.randn(2, 2, 6, 0)), ValueError, ["q:", "head dim", "positive"]),
        (lambda: _bad(q=torch.ones(2, 4, 5, 16, dtype=torch.int32)), TypeError, ["q:", "floating"]),
        (lambda: _bad(key_lengths=torch.tensor([1, 2, 3])), ValueError, ["key_lengths", "(2,)"]),
        (lambda: _bad(key_lengths=torch.tensor([1.0, 2.0])), TypeError, ["key_lengths", "integer"]),
        (lambda: _bad(key_lengths=torch.tensor([1, 7])), ValueError, ["key_lengths", "[0, Lk=6]", "max 7"]),
        (lambda: _bad(key_lengths=torch.tensor([-1, 2])), ValueError, ["key_lengths", "min -1"]),
        (lambda: _bad(causal=1), TypeError, ["causal"]),
        (lambda: _bad(scale=float("nan")), ValueError, ["scale", "finite"]),
        (lambda: _bad(backend="nope"), ValueError, ["unknown backend 'nope'", "reference"]),
    ],
)
def test_bad_input_names_the_argument(make, exc, words):
    with pytest.raises(exc) as info:
        make()()
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_auto_falls_back_to_a_working_backend_for_float64():
    q, k, v = make_inputs(1, 2, 2, 4, 4, 16, dtype=torch.float64, requires_grad=False)
    out = mhakern.attention(q, k, v)
    assert out.dtype == torch.float64


def test_dispatch_never_sends_a_mode_outside_a_backends_features():
    from mhakern.backends import Backend, Modes, missing_features

    plain = Backend()
    assert Modes().required_features() == frozenset()
    need = Modes(dropout_p=0.1, top_left=True, window_left=3).required_features()
    assert need == {"dropout", "top_left", "window"}
    assert missing_features(plain, need) == "does not implement dropout, top_left, window"
    plain.features = frozenset({"dropout", "top_left", "window"})
    assert missing_features(plain, need) is None
