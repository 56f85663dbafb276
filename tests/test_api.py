"""Public API: dispatch, bad input, and the semantics on the reference backend."""
import pytest
import torch

import mhakern
from attn_testing import make_inputs


def test_available_backends_lists_reference_and_reasons():
    av = mhakern.available_backends()
    assert av["reference"] is None
    for name, why in av.items():
        assert why is None or (isinstance(why, str) and why), name


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
        (lambda: _bad(k=torch.randn(2, 0, 6, 16), v=torch.randn(2, 0, 6, 16)), ValueError, ["kv heads (0)", "(4)"]),
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


# ---------------------------------------------------------------------------------------------
# Silent failures (each of these failed before its fix)


def test_int64_key_lengths_are_range_checked_before_the_cast():
    q, k, v = make_inputs(2, 2, 2, 3, 4, 16, requires_grad=False)
    with pytest.raises(ValueError, match=r"key_lengths: values must lie in \[0, Lk=4\], got min 4 and max 4294967299"):
        mhakern.attention(q, k, v, key_lengths=torch.tensor([2**32 + 3, 4]), backend="reference")
    with pytest.raises(ValueError, match="max 4294967299"):
        torch.ops.mhakern.attn_fwd(q, k, v, 0.25, False, torch.tensor([2**32 + 3, 4]), "reference")


def test_attn_bwd_checks_key_lengths_values():
    q, k, v = make_inputs(2, 2, 2, 3, 4, 16, requires_grad=False)
    out, lse = torch.ops.mhakern.attn_fwd(q, k, v, 0.25, False, None, "reference")
    for bad in (torch.tensor([5, 1]), torch.tensor([-1, 1]), torch.tensor([2**32 + 1, 1])):
        with pytest.raises(ValueError, match="key_lengths: values must lie in"):
            torch.ops.mhakern.attn_bwd(out, q, k, v, out, lse, 0.25, False, bad, "reference")


@pytest.mark.parametrize(
    "call,words",
    [
        (lambda q, k, v: torch.ops.mhakern.attn_fwd(q[0], k, v, 0.25, False, None, "reference"), ["q:", "4 dims"]),
        (lambda q, k, v: torch.ops.mhakern.attn_fwd(q, k[:, :, :, :8], v, 0.25, False, None, "reference"), ["k:", "head dim 8"]),
        (lambda q, k, v: torch.ops.mhakern.attn_fwd(q, k, v[:, :, :3], 0.25, False, None, "reference"), ["k, v:", "must match"]),
        (lambda q, k, v: torch.ops.mhakern.attn_fwd(q, k, v, 0.25, False, None, "nope"), ["unknown backend 'nope'"]),
        (lambda q, k, v: torch.ops.mhakern.attn_fwd(q, k, v, float("inf"), False, None, "reference"), ["scale", "finite"]),
        (lambda q, k, v: torch.ops.mhakern.attn_fwd(q, k, v, 0.25, False, torch.tensor([1.0, 2.0]), "auto"), ["key_lengths", "integer"]),
        (lambda q, k, v: torch.ops.mhakern.attn_fwd(q, k, v, 0.25, False, None, "auto", torch.ones(3, 3)), ["attn_mask", "broadcastable"]),
        (lambda q, k, v: torch.ops.mhakern.attn_fwd(q, k, v, 0.25, False, None, "auto", None, 1.0), ["dropout_p", "[0, 1)"]),
        (lambda q, k, v: torch.ops.mhakern.attn_fwd(q, k, v, 0.25, False, None, "auto", None, 0.0, 0, False, -2), ["window_left"]),
        (lambda q, k, v: torch.ops.mhakern.attn_bwd(q[:, :, :2], q, k, v, q, q[..., 0].float(), 0.25, False, None, "auto"), ["dout", "shape"]),
        (lambda q, k, v: torch.ops.mhakern.attn_bwd(q, q, k, v, q, q[..., 0].double(), 0.25, False, None, "auto"), ["lse", "float32"]),
        (lambda q, k, v: torch.ops.mhakern.attn_bwd(q, q, k, v, q[..., :3], q[..., 0].float(), 0.25, False, None, "auto"), ["out:", "shape"]),
        (lambda q, k, v: torch.ops.mhakern.attn_bwd(q, q, k, v, q, q[..., 0].float(), 0.25, False, None, "auto", None, 0.0, 0, False, -1, -1, True), ["mask_grad", "floating attn_mask"]),
    ],
)
def test_the_ops_validate_and_name_the_argument(call, words):
    # Before: "not enough values to unpack", raw bmm errors, "unknown backend 'auto'".
    q, k, v = make_inputs(2, 4, 2, 5, 6, 16, requires_grad=False)
    with pytest.raises((ValueError, TypeError)) as info:
        call(q, k, v)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_the_ops_accept_auto_and_match_the_api():
    q, k, v = make_inputs(2, 4, 2, 5, 6, 16, requires_grad=False)
    out, lse = torch.ops.mhakern.attn_fwd(q, k, v, 0.25, True, torch.tensor([6, 2]), "auto")
    ref, ref_lse = mhakern.attention(q, k, v, causal=True, scale=0.25, key_lengths=torch.tensor([6, 2]), return_lse=True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)
    dq, dk, dv, dmask, dsinks = torch.ops.mhakern.attn_bwd(out, q, k, v, out, lse, 0.25, True, torch.tensor([6, 2]),
                                                           "auto")
    assert dq.shape == q.shape and dk.shape == k.shape and dmask.numel() == 0 and dsinks.numel() == 0


@pytest.mark.parametrize(
    "kw,exc,words",
    [
        (dict(attn_mask=torch.ones(5, 7, dtype=torch.bool)), ValueError, ["attn_mask", "(5, 7)", "broadcastable"]),
        (dict(attn_mask=torch.ones(2, 4, 5, 6, 1, dtype=torch.bool)), ValueError, ["attn_mask", "1 to 4 dims"]),
        (dict(attn_mask=torch.ones(5, 6, dtype=torch.int32)), TypeError, ["attn_mask", "bool", "int32"]),
        (dict(attn_mask=[[True]]), TypeError, ["attn_mask", "list"]),
        (dict(dropout_p=1.5), ValueError, ["dropout_p", "1.5"]),
        (dict(dropout_p=-0.1), ValueError, ["dropout_p"]),
        (dict(dropout_p=0.1, generator=3), TypeError, ["generator", "int"]),
        (dict(causal_align="bottom"), ValueError, ["causal_align", "top_left", "'bottom'"]),
        (dict(window=(2,)), ValueError, ["window", "(left, right)"]),
        (dict(window=(-2, 1)), ValueError, ["window", "[-1, 2**63 - 1]"]),
        (dict(window=(1.5, 1)), ValueError, ["window"]),
        (dict(backend="auto", key_lengths=torch.tensor([1, 2]).float()), TypeError, ["key_lengths", "integer"]),
    ],
)
def test_bad_mode_arguments_name_the_argument(kw, exc, words):
    q, k, v = make_inputs(2, 4, 2, 5, 6, 16, requires_grad=False)
    with pytest.raises(exc) as info:
        mhakern.attention(q, k, v, **kw)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


# ---------------------------------------------------------------------------------------------
# Modes through the public API on the reference


def test_bool_false_float_neg_inf_and_key_lengths_hide_alike():
    q, k, v = make_inputs(2, 4, 2, 5, 6, 16, requires_grad=False)
    kl = torch.tensor([6, 3])
    vis = (torch.arange(6) < kl.view(2, 1)).view(2, 1, 1, 6)
    bias = torch.zeros(2, 1, 1, 6).masked_fill(~vis, float("-inf"))
    a = mhakern.attention(q, k, v, key_lengths=kl, backend="reference")
    b = mhakern.attention(q, k, v, attn_mask=vis, backend="reference")
    c = mhakern.attention(q, k, v, attn_mask=bias, backend="reference")
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    torch.testing.assert_close(a, c, rtol=0, atol=1e-6)


def test_float_mask_gradient_is_reduced_to_its_shape_and_dtype():
    q, k, v = make_inputs(2, 4, 2, 5, 6, 16, dtype=torch.float64)
    for shape in [(6,), (5, 6), (4, 1, 6), (2, 1, 5, 1), (1, 4, 5, 6)]:
        m = torch.randn(shape, dtype=torch.float64, requires_grad=True)
        out = mhakern.attention(q, k, v, attn_mask=m, backend="reference")
        out.sum().backward()
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.detach(), k.detach().repeat_interleave(2, 1), v.detach().repeat_interleave(2, 1), attn_mask=m.detach().requires_grad_()
        )
        m2 = m.detach().requires_grad_()
        torch.nn.functional.scaled_dot_product_attention(
            q.detach(), k.detach().repeat_interleave(2, 1), v.detach().repeat_interleave(2, 1), attn_mask=m2
        ).sum().backward()
        # float64 throughout, lse and the mask's gradient included (the contract)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        assert m.grad.shape == m.shape and m.grad.dtype == m.dtype
        torch.testing.assert_close(m.grad, m2.grad, rtol=1e-10, atol=1e-12)


class _SpyBackend(mhakern.backends.Backend):
    """A registered third-party backend: the reference underneath, recording what it is given."""

    name = "spy"
    priority = -5
    features = frozenset({"attn_mask", "mask_grad"})

    def __init__(self):
        self.seen = []
        self.supports_calls = 0

    def supports(self, q, k, v, causal, key_lengths):
        self.supports_calls += 1
        return None

    def forward(self, q, k, v, scale, causal, key_lengths, modes=mhakern.backends.DEFAULT_MODES):
        self.seen.append(modes)
        return mhakern.backends.get("reference").forward(q, k, v, scale, causal, key_lengths, modes)

    def backward(self, dout, q, k, v, out, lse, scale, causal, key_lengths, modes=mhakern.backends.DEFAULT_MODES):
        self.seen.append(modes)
        return mhakern.backends.get("reference").backward(dout, q, k, v, out, lse, scale, causal, key_lengths, modes)


@pytest.fixture
def spy():
    from mhakern import backends

    be = backends.register(_SpyBackend())
    yield be
    del backends._REGISTRY["spy"]
    backends._ORDER = None
    backends.clear_dispatch_cache()


def test_a_registered_backend_gets_the_mask_as_an_expanded_view_never_a_copy(spy):
    q, k, v = make_inputs(2, 4, 2, 5, 6, 16)
    m = torch.randn(5, 6, requires_grad=True)
    mhakern.attention(q, k, v, attn_mask=m, backend="spy").sum().backward()
    fwd, bwd = spy.seen
    assert fwd.attn_mask.shape == (2, 4, 5, 6) and fwd.attn_mask.stride()[:2] == (0, 0)
    assert fwd.attn_mask.data_ptr() == m.data_ptr(), "the float32 mask was copied"
    assert not fwd.mask_grad and bwd.mask_grad
    assert m.grad is not None and m.grad.shape == (5, 6)


def test_dispatch_refuses_modes_outside_features_and_auto_skips(spy):
    q, k, v = make_inputs(1, 2, 2, 3, 4, 16, requires_grad=False)
    with pytest.raises(ValueError, match="backend='spy' cannot serve these inputs: spy: does not implement window"):
        mhakern.attention(q, k, v, window=(1, 1), backend="spy")
    with pytest.raises(ValueError, match="does not implement dropout"):
        mhakern.attention(q, k, v, dropout_p=0.5, backend="spy")
    from mhakern import backends

    chosen = backends.select("auto", q, k, v, False, None, frozenset({"window", "dropout"}))
    assert {"window", "dropout"} <= chosen.features


def test_selection_is_cached_per_call_signature(spy):
    q, k, v = make_inputs(1, 2, 2, 3, 4, 16, requires_grad=False)
    for _ in range(5):
        mhakern.attention(q, k, v, backend="spy")
    assert spy.supports_calls == 1
    q2, k2, v2 = make_inputs(1, 2, 2, 7, 4, 16, requires_grad=False)
    mhakern.attention(q2, k2, v2, backend="spy")
    assert spy.supports_calls == 2


def test_dropout_reproducible_from_the_generator_and_the_default_seed():
    q, k, v = make_inputs(2, 4, 2, 5, 6, 16, requires_grad=False)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    a = mhakern.attention(q, k, v, dropout_p=0.5, generator=g1, backend="reference")
    b = mhakern.attention(q, k, v, dropout_p=0.5, generator=g2, backend="reference")
    assert torch.equal(a, b)
    assert not torch.equal(a, mhakern.attention(q, k, v, dropout_p=0.5, generator=g1, backend="reference"))
    torch.manual_seed(9)
    c = mhakern.attention(q, k, v, dropout_p=0.5, backend="reference")
    torch.manual_seed(9)
    assert torch.equal(c, mhakern.attention(q, k, v, dropout_p=0.5, backend="reference"))
    # p = 0 draws nothing: the default generator is not advanced
    state = torch.random.get_rng_state()
    mhakern.attention(q, k, v, dropout_p=0.0, backend="reference")
    assert torch.equal(state, torch.random.get_rng_state())


def test_dropout_backward_uses_the_forward_keep_mask():
    q, k, v = make_inputs(1, 2, 2, 4, 9, 8, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    out = mhakern.attention(q, k, v, dropout_p=0.4, generator=g, backend="reference")
    out.pow(2).sum().backward()
    from attn_testing import oracle_modes
    from mhakern import reference

    modes = oracle_modes(dropout_p=0.4, generator=torch.Generator().manual_seed(3))
    q2, k2, v2 = (x.detach().requires_grad_() for x in (q, k, v))
    reference.attention(q2, k2, v2, modes=modes).pow(2).sum().backward()
    for a, b in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        torch.testing.assert_close(a, b)


def test_no_grad_and_grad_paths_agree():
    q, k, v = make_inputs(2, 4, 2, 5, 6, 16)
    with torch.no_grad():
        a, la = mhakern.attention(q, k, v, causal=True, return_lse=True)
    b, lb = mhakern.attention(q, k, v, causal=True, return_lse=True)
    assert torch.equal(a, b.detach()) and torch.equal(la, lb)
    assert b.requires_grad and not a.requires_grad and not lb.requires_grad


@pytest.mark.gpu
def test_key_lengths_under_cuda_graph_capture_are_clamped_without_a_sync():
    q, k, v = make_inputs(2, 4, 2, 5, 6, 16, device="cuda", requires_grad=False)
    kl = torch.tensor([9, 3], device="cuda")
    with pytest.raises(ValueError, match="key_lengths"):
        mhakern.attention(q, k, v, key_lengths=kl, backend="reference")
    from mhakern.checks import prepare_key_lengths

    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        clamped = prepare_key_lengths(kl, 6, q.device)
    graph.replay()
    torch.cuda.synchronize()
    assert clamped.tolist() == [6, 3]


# ---------------------------------------------------------------------------------------------
# mhakern.scaled_dot_product_attention against torch's

import itertools  # noqa: E402

import torch.nn.functional as F  # noqa: E402

SDPA_SHAPES = {
    "4d": ((2, 4, 5, 8), (2, 4, 7, 8), (2, 4, 7, 6), False),
    "4d-gqa": ((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8), True),
    "4d-one-kv-head-broadcast": ((2, 4, 5, 8), (2, 1, 7, 8), (2, 1, 7, 8), False),
    "4d-batch-broadcast": ((2, 4, 6, 8), (1, 4, 4, 8), (1, 4, 4, 8), False),
    "3d": ((3, 5, 8), (3, 7, 8), (3, 7, 8), False),
    "2d": ((5, 8), (7, 8), (7, 8), False),
    "5d": ((2, 3, 2, 5, 8), (2, 3, 2, 7, 8), (2, 3, 2, 7, 8), False),
}


def _sdpa_mask(kind, L, S):
    g = torch.Generator().manual_seed(3)
    if kind is None:
        return None
    if kind == "bool-2d":
        m = torch.rand(L, S, generator=g) > 0.4
        m[0] = False  # a row that sees nothing
        return m
    if kind == "bool-bcast":
        return torch.rand(1, 1, L, S, generator=g) > 0.3
    if kind == "float-2d":
        return torch.randn(L, S, generator=g, dtype=torch.float64)
    if kind == "float-row":
        return torch.randn(1, S, generator=g, dtype=torch.float64).requires_grad_()
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "shape,mask,is_causal,scale",
    list(itertools.product(SDPA_SHAPES, [None, "bool-2d", "bool-bcast", "float-2d", "float-row"], [False, True], [None, 0.3])),
)
def test_sdpa_matches_torch(shape, mask, is_causal, scale):
    qs, ks, vs, gqa = SDPA_SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64).requires_grad_() for s in (qs, ks, vs))
    L, S = qs[-2], ks[-2]
    m = _sdpa_mask(mask, L, S)
    if m is not None and m.dim() > len(qs):
        m = m.reshape(m.shape[-len(qs):])
    kw = dict(attn_mask=m, is_causal=is_causal, scale=scale, enable_gqa=gqa)
    if m is not None and is_causal:
        # torch documents the refusal (some of its paths combine the two instead); we refuse.
        with pytest.raises(ValueError, match="Explicit attn_mask should not be set when is_causal=True"):
            mhakern.scaled_dot_product_attention(q, k, v, **kw)
        return
    ours = mhakern.scaled_dot_product_attention(q, k, v, **kw)
    leaves = [q, k, v] + ([m] if m is not None and m.requires_grad else [])
    dout = torch.randn(ours.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(ours, leaves, dout)
    theirs = F.scaled_dot_product_attention(q, k, v, **kw)
    want = torch.autograd.grad(theirs, leaves, dout)
    assert ours.shape == theirs.shape
    # float64 throughout, lse included (the contract)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    for name, a, b in zip(("dq", "dk", "dv", "dmask"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


def test_sdpa_float32_and_dropout_semantics():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 6, 16, generator=g) for _ in range(3))
    torch.testing.assert_close(
        mhakern.scaled_dot_product_attention(q, k, v, is_causal=True), F.scaled_dot_product_attention(q, k, v, is_causal=True)
    )
    torch.manual_seed(4)
    a = mhakern.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(4)
    b = mhakern.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert torch.equal(a, b) and not torch.equal(a, mhakern.scaled_dot_product_attention(q, k, v))


@pytest.mark.parametrize(
    "kw,exc,words",
    [
        (dict(attn_mask=torch.zeros(6, 6, dtype=torch.float64)), TypeError, ["attn_mask", "float32 or query's dtype"]),
        (dict(dropout_p=1.5), ValueError, ["dropout_p"]),
        (dict(is_causal=1), TypeError, ["is_causal"]),
        (dict(enable_gqa="yes"), TypeError, ["enable_gqa"]),
    ],
)
def test_sdpa_bad_arguments(kw, exc, words):
    q = torch.randn(2, 4, 6, 16)
    with pytest.raises(exc) as info:
        mhakern.scaled_dot_product_attention(q, q, q, **kw)
    for w in words:
        assert w in str(info.value)


def test_sdpa_gqa_needs_enable_gqa_like_torch():
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="do not broadcast"):
        mhakern.scaled_dot_product_attention(q, k, k)
    with pytest.raises(ValueError, match="must divide"):
        mhakern.scaled_dot_product_attention(q, torch.randn(1, 3, 5, 8), torch.randn(1, 3, 5, 8), enable_gqa=True)


def test_sdpa_replaces_torchs_inside_nn_multihead_attention(monkeypatch):
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 4, batch_first=True, dtype=torch.float64)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    mask = torch.ones(5, 5, dtype=torch.bool).triu(1)  # True = not allowed, torch's module convention
    want, _ = mha(x, x, x, attn_mask=mask, need_weights=False)
    calls = []

    def ours(*a, **kw):
        calls.append(1)
        return mhakern.scaled_dot_product_attention(*a, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", ours)
    got, _ = mha(x, x, x, attn_mask=mask, need_weights=False)
    assert calls, "nn.MultiheadAttention did not go through the replacement"
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# torch.compile with the modes (tests/test_compile.py covers the plain path)


def test_compiled_modes_and_mask_gradient_match_eager():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, L, 16, generator=g).requires_grad_() for h, L in ((4, 5), (2, 7), (2, 7)))
    m = torch.randn(5, 7, generator=g).requires_grad_()
    kl = torch.tensor([7, 3])

    def fn(q, k, v, m):
        return mhakern.attention(q, k, v, attn_mask=m, window=(2, 1), causal=True, causal_align="top_left", key_lengths=kl)

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    results = []
    for f in (compiled, fn):
        for x in (q, k, v, m):
            x.grad = None
        out = f(q, k, v, m)
        out.pow(2).sum().backward()
        results.append([out.detach()] + [x.grad.clone() for x in (q, k, v, m)])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)
    torch._dynamo.reset()


def test_compiled_dropout_draws_the_same_seed_as_eager():
    # The seed is a data-dependent scalar: fullgraph needs capture_scalar_outputs (contract).
    torch._dynamo.reset()
    q, k, v = make_inputs(1, 2, 2, 4, 6, 16)
    fn = lambda q, k, v: mhakern.attention(q, k, v, dropout_p=0.3)  # noqa: E731
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
        torch.manual_seed(3)
        a = compiled(q, k, v)
        a.sum().backward()
    torch.manual_seed(3)
    assert torch.equal(a, fn(q, k, v))
    assert q.grad is not None and torch.isfinite(q.grad).all()
    torch._dynamo.reset()


def test_get_auto_says_it_must_be_selected_not_that_it_is_unknown():
    from mhakern import backends

    # Before: "unknown backend 'auto'; choose 'auto' or ..."
    with pytest.raises(ValueError, match="'auto' must be resolved by mhakern.backends.select"):
        backends.get("auto")
    with pytest.raises(ValueError, match="reserved"):
        backends.register(type("B", (backends.Backend,), {"name": "auto"})())
    with pytest.raises(ValueError, match="unknown features"):
        # sinks is no backend feature (the op layer applies them around every backend)
        backends.register(type("B", (backends.Backend,), {"name": "x", "features": frozenset({"sinks"})})())


def test_the_op_hands_backends_float32_masks_and_returns_the_mask_gradient_in_its_shape():
    q, k, v = make_inputs(2, 4, 2, 5, 6, 16, requires_grad=False)
    m = torch.randn(1, 4, 1, 6, dtype=torch.bfloat16)
    out, lse = torch.ops.mhakern.attn_fwd(q, k, v, 0.25, False, None, "reference", m)
    ref = mhakern.attention(q, k, v, scale=0.25, attn_mask=m.float(), backend="reference")
    torch.testing.assert_close(out, ref)
    dq, dk, dv, dmask, _ = torch.ops.mhakern.attn_bwd(out, q, k, v, out, lse, 0.25, False, None, "reference", m,
                                                      mask_grad=True)
    assert dmask.shape == m.shape and dmask.dtype == torch.float32


_REGISTRY_RACE_CHILD = r"""
import importlib, threading
import mhakern.backends as bk

# Thread A pauses inside the first built-in import; thread B then asks for the registry. B must
# wait for the lock (seen through the wrapper below) rather than return a partial list.
cond = threading.Condition()
state = {"a_inside": False, "b_acquiring": False, "go": False, "b_result": None}
real_import = importlib.import_module

def paused_import(name, *a):
    if threading.current_thread().name == "A" and not state["a_inside"]:
        with cond:
            state["a_inside"] = True
            cond.notify_all()
            cond.wait_for(lambda: state["go"])
    return real_import(name, *a)

class SpyLock:
    def __init__(self, lock):
        self.lock = lock
    def __enter__(self):
        if threading.current_thread().name == "B":
            with cond:
                state["b_acquiring"] = True
                cond.notify_all()
        return self.lock.__enter__()
    def __exit__(self, *exc):
        return self.lock.__exit__(*exc)

bk.importlib = type("M", (), {"import_module": staticmethod(paused_import)})
if hasattr(bk, "_LOAD_LOCK"):
    bk._LOAD_LOCK = SpyLock(bk._LOAD_LOCK)

def b():
    state["b_result"] = bk.names()
    with cond:
        cond.notify_all()

ta = threading.Thread(target=bk.names, name="A")
ta.start()
with cond:
    cond.wait_for(lambda: state["a_inside"])
tb = threading.Thread(target=b, name="B")
tb.start()
with cond:
    cond.wait_for(lambda: state["b_acquiring"] or state["b_result"] is not None)
    early = state["b_result"]
    state["go"] = True
    cond.notify_all()
ta.join(); tb.join()
assert early is None, f"thread B saw a partial registry: {early}"
assert set(state["b_result"]) >= {"reference", "triton", "cpu", "cuda"}, state["b_result"]
print("ok")
"""


def test_first_registry_lookup_from_two_threads_waits_for_every_builtin():
    # Two sweeps in threads used to race the first look-up: the second saw the registry half
    # filled (KeyError 'cuda', or no backend at all).
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _REGISTRY_RACE_CHILD], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


# ---------------------------------------------------------------------------------------------
# Drop-in fidelity: each of these failed before its fix

from torch.nn.attention.bias import causal_lower_right, causal_upper_left  # noqa: E402


def _f64(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).requires_grad_()


@pytest.mark.parametrize("make", [causal_upper_left, causal_lower_right], ids=["upper_left", "lower_right"])
@pytest.mark.parametrize("L,S", [(4, 6), (6, 4), (5, 5)], ids=["wide", "tall", "square"])
@pytest.mark.parametrize("entry", ["sdpa", "attention"])
def test_causal_bias_is_causal_masking_with_its_alignment(make, L, S, entry):
    # Before: the bias' uninitialised storage was read as a mask (outputs off by 0.7-2.6).
    q, k, v = _f64(1, 2, L, 8), _f64(1, 2, S, 8, seed=1), _f64(1, 2, S, 8, seed=2)
    bias = make(L, S)
    call = mhakern.scaled_dot_product_attention if entry == "sdpa" else mhakern.attention
    ours = call(q, k, v, attn_mask=bias)
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=bias._materialize())
    dout = torch.randn(ours.shape, dtype=torch.float64)
    got = torch.autograd.grad(ours, (q, k, v), dout)
    want = torch.autograd.grad(theirs, (q, k, v), dout)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_causal_bias_with_key_lengths_and_refusals():
    q, k, v = _f64(2, 2, 3, 8), _f64(2, 2, 5, 8, seed=1), _f64(2, 2, 5, 8, seed=2)
    kl = torch.tensor([5, 2])
    # lower-right is the bias' diagonal (offset S - L), not mhakern's per-element one
    ours = mhakern.attention(q, k, v, attn_mask=causal_lower_right(3, 5), key_lengths=kl)
    hide = torch.arange(5).view(1, 1, 1, 5) >= kl.view(2, 1, 1, 1)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(3, 5)._materialize() & ~hide)
    torch.testing.assert_close(ours, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="attn_mask, is_causal"):
        mhakern.scaled_dot_product_attention(q, k, v, attn_mask=causal_upper_left(3, 5), is_causal=True)
    with pytest.raises(RuntimeError, match="attn_mask: a lower-right CausalBias of sizes \\(4, 5\\)"):
        mhakern.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(4, 5))


def _ggc(fn, *inputs):
    # fast_mode: the second-order check along random directions (one pass per input, not one
    # per element); small shapes keep it under a second.
    return torch.autograd.gradgradcheck(fn, inputs, eps=1e-6, atol=1e-5, rtol=1e-4, fast_mode=True)


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(causal=True), dict(causal=True, causal_align="top_left"), dict(window=(1, 0)),
     dict(key_lengths=torch.tensor([2, 4]))],
    ids=["plain", "causal", "causal-top-left", "window", "key-lengths"],
)
def test_second_derivatives_are_exact_on_the_reference(kw):
    # Before: gradgradcheck failed (d/dq off by 0.08, d/dk by 0.16): the backward's graph
    # treated out and lse as constants.
    q, k, v = _f64(2, 2, 3, 4), _f64(2, 1, 4, 4, seed=1), _f64(2, 1, 4, 4, seed=2)
    assert _ggc(lambda q, k, v: mhakern.attention(q, k, v, backend="reference", **kw), q, k, v)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_create_graph_gradients_of_one_tensor_given_twice_are_its_gradients(backend):
    """One tensor as k and v (and as q, k and v): under create_graph=True its gradient is the same
    as without, dK + dV (+ dQ). Before: the math backward took each gradient with respect to the
    arguments themselves, v a view of k, so k's already held dV and autograd added v's dV again
    (off by 1.4 in 4.0 here)."""
    if mhakern.available_backends().get(backend) is not None:
        pytest.skip(f"backend {backend} unavailable")
    dt = torch.float64 if backend == "reference" else torch.float32
    q = torch.randn(1, 2, 5, 8, dtype=dt, generator=torch.Generator().manual_seed(0)).requires_grad_()
    kv = torch.randn(1, 2, 6, 8, dtype=dt, generator=torch.Generator().manual_seed(1)).requires_grad_()
    for args, wrt in (((q, kv, kv), (q, kv)), ((q, q, q), (q,))):
        def loss():
            return mhakern.attention(*args, backend=backend, causal=True).pow(2).sum()

        plain = torch.autograd.grad(loss(), wrt)
        graph = torch.autograd.grad(loss(), wrt, create_graph=True)
        for a, b in zip(plain, graph):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
            assert b.requires_grad


def test_second_derivatives_with_a_float_mask_and_dropout():
    q, k, v, m = _f64(1, 2, 3, 4), _f64(1, 2, 4, 4, seed=1), _f64(1, 2, 4, 4, seed=2), _f64(3, 4, seed=3)
    assert _ggc(lambda q, k, v, m: mhakern.attention(q, k, v, attn_mask=m, backend="reference"), q, k, v, m)

    def dropped(q, k, v):
        return mhakern.attention(q, k, v, dropout_p=0.3, generator=torch.Generator().manual_seed(1), backend="reference")

    assert _ggc(dropped, q, k, v)


def test_second_derivatives_through_the_cpu_backend():
    # Before: create_graph=True left q.grad None (a UserWarning only): the compiled backward has no
    # derivative of its own.
    if mhakern.available_backends().get("cpu") is not None:
        pytest.skip("mhakern._C (the cpu backend) is not built")
    q64, k64, v64 = _f64(1, 2, 5, 8), _f64(1, 2, 6, 8, seed=1), _f64(1, 2, 6, 8, seed=2)
    q, k, v = (x.detach().float().requires_grad_() for x in (q64, k64, v64))
    out = mhakern.attention(q, k, v, causal=True, backend="cpu")
    (gq,) = torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
    gq.pow(2).sum().backward()
    ref = mhakern.reference.attention(q64, k64, v64, causal=True)
    (gq64,) = torch.autograd.grad(ref.pow(2).sum(), q64, create_graph=True)
    gq64.pow(2).sum().backward()
    torch.testing.assert_close(gq.double(), gq64, rtol=1e-4, atol=1e-5)
    for a, b in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert a is not None
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "shapes",
    [((1, 2, 4, 0), (1, 2, 6, 0), (1, 2, 6, 8)), ((1, 0, 4, 8), (1, 0, 6, 8), (1, 0, 6, 8)),
     ((0, 2, 4, 8), (0, 2, 6, 8), (0, 2, 6, 8)), ((1, 2, 0, 8), (1, 2, 6, 8), (1, 2, 6, 8)),
     ((1, 2, 4, 8), (1, 2, 0, 8), (1, 2, 0, 8)), ((1, 2, 4, 8), (1, 2, 6, 8), (1, 2, 6, 0))],
    ids=["head-dim-0", "heads-0", "batch-0", "queries-0", "keys-0", "value-dim-0"],
)
@pytest.mark.parametrize("masked", [False, True])
def test_zero_sizes_return_what_sdpa_returns(shapes, masked):
    # Before: head dim 0 and 0 heads raised ValueError; SDPA returns a result.
    q, k, v = (_f64(*s, seed=i) for i, s in enumerate(shapes))
    L, S = shapes[0][2], shapes[1][2]
    m = torch.randn(L, S, dtype=torch.float64) if masked else None
    ours = mhakern.scaled_dot_product_attention(q, k, v, attn_mask=m)
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    if ours.numel():
        dout = torch.randn(ours.shape, dtype=torch.float64)
        for a, b in zip(torch.autograd.grad(ours, (q, k, v), dout), torch.autograd.grad(theirs, (q, k, v), dout)):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_dropout_one_drops_everything_as_torch():
    q, k, v = _f64(1, 2, 4, 8), _f64(1, 2, 6, 8, seed=1), _f64(1, 2, 6, 8, seed=2)
    ours = mhakern.scaled_dot_product_attention(q, k, v, dropout_p=1.0)
    theirs = F.scaled_dot_product_attention(q, k, v, dropout_p=1.0)
    assert torch.equal(ours, theirs)
    g = torch.autograd.grad(ours.sum(), (q, k, v))
    assert all(torch.equal(x, torch.zeros_like(x)) for x in g)


@pytest.mark.parametrize("backend", [b for b in ("reference", "cpu") if mhakern.available_backends().get(b) is None])
def test_batched_grads_on_non_contiguous_inputs(backend):
    # Before: aten::copy_ into an unbatched buffer inside the backward refused the vmap.
    q, k, v = (torch.randn(2, L, 3, 8).transpose(1, 2).requires_grad_() for L in (5, 6, 6))
    out = mhakern.attention(q, k, v, causal=True, backend=backend)
    douts = torch.randn(3, *out.shape)
    batched = torch.autograd.grad(out, (q, k, v), douts, is_grads_batched=True, retain_graph=True)
    for i, d in enumerate(douts):
        one = torch.autograd.grad(out, (q, k, v), d, retain_graph=True)
        for a, b in zip(batched, one):
            torch.testing.assert_close(a[i], b)


@pytest.mark.parametrize(
    "call,exc,words",
    [
        (lambda q: mhakern.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(6, 6, dtype=torch.bool), is_causal=True), ValueError, ["attn_mask", "is_causal=True"]),
        (lambda q: mhakern.scaled_dot_product_attention(q[0, 0, 0], q[0, 0, 0], q[0, 0, 0]), ValueError, ["query", "2 dims"]),
        (lambda q: mhakern.scaled_dot_product_attention(q.double(), q, q), TypeError, ["dtypes must match"]),
        (lambda q: mhakern.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(6, 6, dtype=torch.int32)), TypeError, ["attn_mask", "int32"]),
        (lambda q: mhakern.scaled_dot_product_attention(q, q, q, attn_mask=torch.zeros(6, 6, dtype=torch.float64)), TypeError, ["attn_mask"]),
        (lambda q: mhakern.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(5, 6, dtype=torch.bool)), ValueError, ["attn_mask", "broadcastable"]),
        (lambda q: mhakern.scaled_dot_product_attention(q, q[..., :8], q), ValueError, ["key: head dim 8"]),
        (lambda q: mhakern.scaled_dot_product_attention(q, q, q, dropout_p=1.5), ValueError, ["dropout_p", "1.5"]),
        (lambda q: mhakern.attention(q, q, q, backend="cpu", dropout_p=0.0, scale=1.0, key_lengths=torch.tensor([9, 9])), ValueError, ["key_lengths"]),
    ],
)
def test_errors_are_instances_of_what_torch_raises(call, exc, words):
    # Before: ValueError / TypeError only; code catching torch's RuntimeError missed them.
    q = torch.randn(2, 4, 6, 16)
    with pytest.raises(RuntimeError) as info:
        call(q)
    assert isinstance(info.value, exc)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_last_backend_and_strict_mode():
    # Before: float64 and head dims above the kernels' ran on the reference without a sign.
    q, k, v = make_inputs(1, 2, 2, 3, 4, 16, dtype=torch.float64, requires_grad=False)
    mhakern.attention(q, k, v)
    assert mhakern.last_backend() == "reference"
    fast = [n for n, why in mhakern.available_backends().items() if why is None and n != "reference"]
    q32, k32, v32 = (x.float() for x in (q, k, v))
    if "cpu" in fast:
        mhakern.attention(q32, k32, v32)
        assert mhakern.last_backend() == "cpu"
    assert mhakern.set_strict(True) is False
    try:
        for _ in range(2):  # the second call takes the cached selection
            with pytest.raises(mhakern.FallbackError, match="strict dispatch .* refuses to fall back to 'reference'") as info:
                mhakern.attention(q, k, v)
            assert isinstance(info.value, RuntimeError) and isinstance(info.value, ValueError)
        mhakern.attention(q, k, v, backend="reference")  # asked for by name: served
        assert mhakern.last_backend() == "reference"
        if "cpu" in fast:
            mhakern.attention(q32, k32, v32)
            with pytest.raises(mhakern.FallbackError, match="cpu: head dims up to"):
                mhakern.attention(torch.randn(1, 1, 2, 300), torch.randn(1, 1, 2, 300), torch.randn(1, 1, 2, 300))
    finally:
        assert mhakern.set_strict(False) is True
    with pytest.raises(TypeError, match="enabled: expected a bool"):
        mhakern.set_strict("yes")


@pytest.mark.parametrize(
    "call,exc,words",
    [
        (lambda q: mhakern.scaled_dot_product_attention(q, q, q, dropout_p=torch.tensor([0.1, 0.2])), TypeError, ["dropout_p", "Tensor"]),
        (lambda q: mhakern.attention(q, q, q, dropout_p=torch.tensor([0.1, 0.2])), TypeError, ["dropout_p", "Tensor"]),
        (lambda q: mhakern.attention(q, q, q, return_lse="no"), TypeError, ["return_lse", "bool", "str"]),
    ],
)
def test_arguments_of_the_wrong_type_are_named(call, exc, words):
    # Before: "Boolean value of Tensor ... is ambiguous"; return_lse='no' was taken as true.
    q = torch.randn(2, 4, 6, 16)
    with pytest.raises(exc) as info:
        call(q)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_compiled_op_names_an_undefined_operand():
    # Before: "tensor does not have a device" (the device was read before q was checked).
    if mhakern.available_backends().get("cpu") is not None:
        pytest.skip("mhakern._C (the cpu backend) is not built")
    k = torch.randn(1, 2, 6, 8)
    with pytest.raises(ValueError, match="q: expected a tensor, got None"):
        torch.ops.mhakern_C.fwd(None, k, k, 0.3, False, None, None, 0.0, 0, False, -1, -1)
    with pytest.raises(ValueError, match="dout: expected a tensor, got None"):
        torch.ops.mhakern_C.bwd(None, k, k, k, k, k[..., 0], 0.3, False, None, None, 0.0, 0, False, -1, -1, False)


def test_sdpa_drop_in_under_torchscript_calls_torchs_operator():
    # A model scripted after F.scaled_dot_product_attention was swapped for the drop-in
    # compiles it: TorchScript takes torch's own operator (it cannot compile mhakern's dispatch),
    # which computes the same function.
    scripted = torch.jit.script(mhakern.scaled_dot_product_attention)
    q, k, v = (torch.randn(2, 3, 5, 8) for _ in range(3))
    torch.testing.assert_close(scripted(q, k, v, None, 0.0, True), mhakern.scaled_dot_product_attention(q, k, v, is_causal=True))


@pytest.mark.parametrize(
    "kw,exc,words",
    [
        (dict(softcap=0.0), ValueError, ["softcap", "positive"]),
        (dict(softcap=-1.0), ValueError, ["softcap"]),
        (dict(softcap=float("inf")), ValueError, ["softcap", "finite"]),
        (dict(softcap="2"), TypeError, ["softcap"]),
        (dict(alibi_slopes=torch.ones(3)), ValueError, ["alibi_slopes", "(H,)"]),
        (dict(alibi_slopes=torch.ones(2, 4, dtype=torch.int32)), TypeError, ["alibi_slopes", "floating"]),
        (dict(alibi_slopes=torch.ones(4, requires_grad=True)), ValueError, ["alibi_slopes", "no gradient"]),
        (dict(alibi_slopes=[0.5] * 4), TypeError, ["alibi_slopes"]),
        (dict(sinks=torch.zeros(2, 4)), ValueError, ["sinks", "(H,)"]),
        (dict(sinks=torch.zeros(4, dtype=torch.int64)), TypeError, ["sinks", "floating"]),
        (dict(sinks=0.0), TypeError, ["sinks"]),
    ],
)
def test_bad_score_modifiers_are_refused_naming_the_argument(kw, exc, words):
    q, k, v = make_inputs(2, 4, 2, 5, 6, 16)
    with pytest.raises(exc) as info:
        mhakern.attention(q, k, v, backend="reference", **kw)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_the_op_refuses_bad_modifier_values_and_takes_good_ones():
    q, k, v = make_inputs(2, 4, 2, 5, 6, 16, requires_grad=False)
    with pytest.raises(ValueError, match="alibi_slopes: expected float32 of shape"):
        torch.ops.mhakern.attn_fwd(q, k, v, 0.25, False, None, "reference", alibi_slopes=torch.ones(4))
    with pytest.raises(ValueError, match="softcap"):
        torch.ops.mhakern.attn_fwd(q, k, v, 0.25, False, None, "reference", softcap=-2.0)
    sinks = torch.randn(4)
    out, lse = torch.ops.mhakern.attn_fwd(q, k, v, 0.25, False, None, "reference", softcap=2.0,
                                          alibi_slopes=torch.ones(4).expand(2, 4), sinks=sinks)
    ref, ref_lse = mhakern.attention(q, k, v, scale=0.25, softcap=2.0, alibi_slopes=torch.ones(4), sinks=sinks,
                                     backend="reference", return_lse=True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)
    *_, dsinks = torch.ops.mhakern.attn_bwd(out, q, k, v, out, lse, 0.25, False, None, "reference", sinks=sinks)
    assert dsinks.shape == (4,) and dsinks.dtype == torch.float32


def test_second_derivatives_with_the_score_modifiers_and_sinks():
    # create_graph=True takes the math formula's gradients: exact with every modifier too.
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, L, 4, generator=g, dtype=torch.float64).requires_grad_() for L in (3, 4, 4))
    sinks = torch.randn(2, generator=g, dtype=torch.float64).requires_grad_()
    slopes = torch.tensor([0.5, 0.25])

    def fn(q, k, v, sinks):
        return mhakern.attention(q, k, v, causal=True, softcap=2.0, alibi_slopes=slopes, sinks=sinks,
                                 backend="reference")

    assert torch.autograd.gradgradcheck(fn, (q, k, v, sinks))
