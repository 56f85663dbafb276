"""Defects found from outside (issue 31): writes into caches that share memory, lse with Dv = 0,
new keys of another dtype, arguments on the meta device, windows past int64, and the drop-ins
under PyTorch's own tests (torch's message, torch.compile of torch's encoder, the one call
FusedMHA accepts where torch refuses). Each test failed before its fix.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import mhakern
from mhakern import backends

from attn_testing import usable_backends

ALL_BACKENDS = ["reference", "cpu", "triton", "cuda"]


def _cache_call(k_cache, v_cache, B=2, Hkv=1, D=4, backend="auto", **kw):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, 2 * Hkv, 1, D, generator=g)
    k, v = torch.randn(B, Hkv, 1, D, generator=g), torch.randn(B, Hkv, 1, v_cache.shape[-1], generator=g)
    return mhakern.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor([3] * B),
                                          backend=backend, **kw)


# --- 1. appending into a cache whose positions share memory -------------------------------------


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_append_into_an_expanded_cache_is_refused_before_any_backend(backend):
    # Before: batch element 0 read element 1's appended key (error 0.56), with only torch's
    # "index_put_ on expanded tensors" warning. The check runs before dispatch, so a backend named
    # explicitly (usable here or not) meets it first.
    k1, v1 = torch.randn(1, 1, 8, 4), torch.randn(1, 1, 8, 4)
    k_before, v_before = k1.clone(), v1.clone()
    with pytest.raises(mhakern.ArgumentError, match=r"^k_cache: dim 0 \(size 2\) has stride 0"):
        _cache_call(k1.expand(2, 1, 8, 4), v1.expand(2, 1, 8, 4), backend=backend)
    with pytest.raises(mhakern.ArgumentError, match=r"^v_cache: .*stride 0"):
        _cache_call(torch.zeros(2, 1, 8, 4), v1.expand(2, 1, 8, 4), backend=backend)
    assert torch.equal(k1, k_before) and torch.equal(v1, v_before), "refused, but written"


def test_append_into_overlapping_or_shared_caches_is_refused():
    base = torch.zeros(2, 1, 8, 4)
    # Overlapping strides without a stride 0: positions 4 apart, rows of 8 floats.
    overlapping = torch.zeros(64).as_strided((2, 1, 8, 4), (8, 8, 4, 1))
    with pytest.raises(mhakern.ArgumentError, match=r"^k_cache: its strides \(8, 8, 4, 1\) .* share memory"):
        _cache_call(overlapping, torch.zeros(2, 1, 8, 4))
    # One tensor for keys and values: the values would overwrite the keys.
    with pytest.raises(mhakern.ArgumentError, match=r"^k_cache, v_cache: they share memory"):
        _cache_call(base, base)
    # Two views over one buffer that overlap by a row.
    buf = torch.zeros(3, 1, 8, 4)
    with pytest.raises(mhakern.ArgumentError, match=r"^k_cache, v_cache: they share memory"):
        _cache_call(buf[:2], buf[1:])
    # A paged pool expanded over its pages.
    pool = torch.zeros(1, 1, 4, 4).expand(6, 1, 4, 4)
    with pytest.raises(mhakern.ArgumentError, match=r"^k_cache: dim 0 \(size 6\) has stride 0"):
        _cache_call(pool, torch.zeros(6, 1, 4, 4), block_table=torch.tensor([[0, 1], [2, 3]]))


def test_caches_sharing_one_buffer_without_overlap_are_written_as_separate_ones():
    # The check refuses overlap, not shared storage: a stacked (2, ...) KV block, an interleaved
    # (..., 2, D) one and a slice of a longer cache are appended into as separate tensors are.
    def run(kc, vc):
        out = _cache_call(kc, vc)
        return out, kc.clone(), vc.clone()

    g = torch.Generator().manual_seed(0)
    fill = torch.randn(2, 2, 1, 8, 4, generator=g)
    want = run(fill[0].clone(), fill[1].clone())
    stacked = fill.clone()
    inter = fill.permute(1, 3, 2, 0, 4).contiguous()  # (B, L, Hkv, 2, D)
    longer = torch.zeros(2, 1, 12, 4)
    longer_v = torch.zeros(2, 1, 12, 4)
    longer[:, :, 2:10], longer_v[:, :, 2:10] = fill[0], fill[1]
    for kc, vc in ((stacked[0], stacked[1]),
                   (inter[..., 0, :].permute(0, 2, 1, 3), inter[..., 1, :].permute(0, 2, 1, 3)),
                   (longer[:, :, 2:10], longer_v[:, :, 2:10])):
        got = run(kc, vc)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_reading_an_expanded_cache_stays_allowed():
    # Nothing is written without new keys: a cache shared by every batch element is sound.
    g = torch.Generator().manual_seed(1)
    k1, v1 = torch.randn(1, 1, 8, 4, generator=g), torch.randn(1, 1, 8, 4, generator=g)
    q = torch.randn(2, 2, 1, 4, generator=g)
    got = mhakern.attention_with_kvcache(q, k1.expand(2, 1, 8, 4), v1.expand(2, 1, 8, 4), cache_seqlens=5)
    want = mhakern.attention_with_kvcache(q, k1.repeat(2, 1, 1, 1), v1.repeat(2, 1, 1, 1), cache_seqlens=5)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# --- 2. lse with Dv = 0 --------------------------------------------------------------------------


def _lse64(q, k, scale, visible):
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    return torch.logsumexp(s.masked_fill(~visible, float("-inf")), dim=-1)


@pytest.mark.parametrize("backend", [n for n in usable_backends() if n != "cuda"])
def test_lse_with_no_value_columns_is_that_of_the_scores(backend):
    # Before: lse was -inf on every row (the empty-output shortcut), though every key is visible.
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 4, 5, 16, generator=g), torch.randn(2, 2, 7, 16, generator=g)
    v = torch.randn(2, 2, 7, 0)
    kl = torch.tensor([7, 3])
    j, i = torch.arange(7), torch.arange(5)[:, None]
    k_rep = k.repeat_interleave(2, dim=1)
    for causal, lengths in ((False, None), (True, kl)):
        out, lse = mhakern.attention(q, k, v, causal=causal, key_lengths=lengths, backend=backend, return_lse=True)
        Lk = torch.tensor([7, 7]) if lengths is None else lengths
        vis = (j < Lk[:, None, None, None]) & (~torch.tensor(causal) | (j <= i + Lk[:, None, None, None] - 5))
        assert out.shape == (2, 4, 5, 0)
        torch.testing.assert_close(lse.double(), _lse64(q, k_rep, 0.25, vis), rtol=1e-5, atol=1e-5)
    # With sinks, and through the KV cache.
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    _, lse = mhakern.attention(q, k, v, sinks=sinks, backend=backend, return_lse=True)
    full = _lse64(q, k_rep, 0.25, torch.ones(5, 7, dtype=torch.bool))
    torch.testing.assert_close(lse.double(), torch.logaddexp(full, sinks.double()[:, None]), rtol=1e-5, atol=1e-5)
    if "paged" in backends.get(backend).features or backend == "reference":
        _, lse = mhakern.attention_with_kvcache(q, k, v, cache_seqlens=7, backend=backend, return_lse=True)
        torch.testing.assert_close(lse.double(), full, rtol=1e-5, atol=1e-5)


# --- 3. new keys and values of another dtype -----------------------------------------------------


@pytest.mark.parametrize("name, dtype, msg", [
    ("k", torch.int32, r"^k: expected a floating-point dtype, got torch.int32"),
    ("v", torch.int64, r"^v: expected a floating-point dtype, got torch.int64"),
    ("k", torch.float64, r"^k: dtype torch.float64 does not match k_cache's torch.float32"),
    ("v", torch.float16, r"^v: dtype torch.float16 does not match v_cache's torch.float32"),
])
def test_new_keys_of_another_dtype_are_refused_not_cast(name, dtype, msg):
    # Before: cast into the float32 cache without a word (an integer q is refused).
    kc, vc = torch.zeros(2, 1, 8, 4), torch.zeros(2, 1, 8, 4)
    q = torch.randn(2, 2, 1, 4)
    new = {"k": torch.ones(2, 1, 1, 4), "v": torch.ones(2, 1, 1, 4)}
    new[name] = new[name].to(dtype)
    with pytest.raises(mhakern.ArgumentTypeError, match=msg):
        mhakern.attention_with_kvcache(q, kc, vc, new["k"], new["v"], cache_seqlens=3)
    assert not kc.any() and not vc.any()


# --- 4. arguments on the meta device, windows past int64 -----------------------------------------


def test_arguments_on_the_meta_device_are_named():
    # Before: "Cannot copy out of meta tensor; no data!", naming nothing.
    q = torch.randn(2, 2, 1, 4)
    kc = torch.zeros(2, 1, 8, 4)
    with pytest.raises(mhakern.ArgumentError, match=r"^cache_seqlens: must be on q's device \(cpu\) or the CPU, got meta"):
        mhakern.attention_with_kvcache(q, kc, kc.clone(), cache_seqlens=torch.tensor([3, 3], device="meta"))
    m = mhakern.FusedMHA(8, 2, batch_first=True)
    x = torch.randn(2, 5, 8)
    for name, mask in (("key_padding_mask", torch.zeros(2, 5, dtype=torch.bool, device="meta")),
                       ("attn_mask", torch.zeros(5, 5, device="meta"))):
        with pytest.raises(mhakern.ArgumentError, match=rf"^{name}: must be on query's device \(cpu\) or the CPU, got meta"):
            m(x, x, x, **{name: mask})


def test_calls_entirely_on_the_meta_device_compute_shapes():
    # Before: the value checks read the (absent) data of key lengths, cache lengths and padding.
    M = "meta"
    q = torch.empty(2, 4, 3, 8, device=M)
    kl = torch.tensor([1, 3], device=M)
    assert mhakern.attention(q, q[:, :2], q[:, :2], key_lengths=kl).shape == (2, 4, 3, 8)
    kc = torch.empty(2, 2, 16, 8, device=M)
    new = torch.empty(2, 2, 1, 8, device=M)
    out = mhakern.attention_with_kvcache(q, kc, kc.clone(), new, new.clone(), cache_seqlens=kl)
    assert out.shape == (2, 4, 3, 8) and out.is_meta
    m = mhakern.FusedMHA(8, 2, batch_first=True, device=M)
    x = torch.empty(2, 5, 8, device=M)
    out, w = m(x, x, x, key_padding_mask=torch.zeros(2, 5, dtype=torch.bool, device=M))
    assert out.shape == (2, 5, 8) and w.shape == (2, 5, 5)


@pytest.mark.parametrize("window", [(2**63, 0), (0, 2**64), (-2, 0)])
def test_window_out_of_range_is_named_with_the_accepted_range(window):
    # Before: torch's schema message "Expected a value of type 'int' for argument 'window_left'
    # but instead found type 'int'".
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(mhakern.ArgumentError, match=r"^window: .*two ints in \[-1, 2\*\*63 - 1\]"):
        mhakern.attention(q, q, q, window=window)
    with pytest.raises(mhakern.ArgumentError, match=r"^window: "):
        mhakern.attention_with_kvcache(q, torch.zeros(1, 2, 8, 4), torch.zeros(1, 2, 8, 4), cache_seqlens=3,
                                       window=window)


@pytest.mark.parametrize("backend", [n for n in usable_backends() if n != "cuda"])
def test_windows_wider_than_the_keys_are_unbounded(backend):
    # Before: the reference added the window to positions in int64 and wrapped: (2**63 - 1,
    # 2**63 - 1) hid keys that every window wider than the keys shows (error 1.2).
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g) for n in (5, 7, 7))
    for causal, window in ((False, (2**63 - 1, 2**63 - 1)), (True, (2**63 - 1, 0)), (False, (2**40, 12))):
        got = mhakern.attention(q, k, v, causal=causal, window=window, backend=backend)
        want = mhakern.attention(q, k, v, causal=causal, backend=backend)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# --- 7. PyTorch's own tests ----------------------------------------------------------------------


def test_sdpa_dropin_refuses_a_mask_with_is_causal_in_torchs_words():
    # Before: "attn_mask, is_causal: give at most one (as torch's SDPA: ...)"; PyTorch's own test
    # matches torch's message, under torch's math backend as that test runs (torch 2.13's CPU
    # flash kernel takes both).
    q = torch.randn(2, 2, 3, 4, dtype=torch.float64)
    mask = torch.ones(3, 3, dtype=torch.bool).tril()
    with pytest.raises(RuntimeError) as theirs, sdpa_kernel(SDPBackend.MATH):
        torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask, is_causal=True)
    with pytest.raises(RuntimeError) as ours:
        mhakern.scaled_dot_product_attention(q, q, q, attn_mask=mask, is_causal=True)
    assert str(ours.value) == str(theirs.value)
    assert "Explicit attn_mask should not be set when is_causal=True" in str(ours.value)


def test_torch_encoder_fast_path_check_with_fusedmha_compiles():
    # PyTorch's test_fast_path_check_with_mask_does_not_break_in_compile with FusedMHA as
    # self_attn. Before: dynamo raised "Observed exception" (TypeError: object of type
    # '_SignHooks' has no len()) in the layer's fast-path check.
    torch.manual_seed(0)
    E, H = 16, 4
    layer = nn.TransformerEncoderLayer(d_model=E, nhead=H, dim_feedforward=32, dropout=0.1, batch_first=True,
                                       dtype=torch.float64)
    ref = nn.TransformerEncoder(layer, num_layers=2).eval()
    ours = copy.deepcopy(ref)
    for lay in ours.layers:
        f = mhakern.FusedMHA(E, H, dropout=0.1, batch_first=True, dtype=torch.float64)
        f.load_state_dict(lay.self_attn.state_dict())
        lay.self_attn = f
    ours.eval()
    x = torch.randn(1, 9, E, dtype=torch.float64)
    pad = torch.rand(1, 9) > 0.5
    pad[..., 0] = True
    got = torch.compile(ours, backend="aot_eager", fullgraph=True)(x, mask=None, src_key_padding_mask=pad)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's nested-tensor prototype warning
        want = ref(x, mask=None, src_key_padding_mask=pad)
    want = want.to_padded_tensor(0.0, x.shape) if want.is_nested else want
    keep = ~pad[..., None]
    torch.testing.assert_close(got * keep, want * keep, rtol=1e-10, atol=1e-10)


# Calls that torch.nn.MultiheadAttention (and torch's SDPA) refuse, each with FusedMHA's (and the
# drop-in's) answer: the same refusal, an instance of torch's exception class, except for the one
# documented extension (docs/usage.md, "FusedMHA"). A new acceptance shows up here as a failure.
_E, _H, _N, _L, _S = 8, 2, 2, 3, 4
_g = torch.Generator().manual_seed(0)
_x = torch.randn(_N, _L, _E, generator=_g)
_kv = torch.randn(_N, _S, _E, generator=_g)
_B = torch.bool
_MHA_REFUSED = {
    "is_causal without attn_mask": ((_x, _x, _x), dict(is_causal=True)),
    "query 4-D": ((_x[None], _x[None], _x[None]), {}),
    "query 1-D": ((_x[0, 0], _x[0, 0], _x[0, 0]), {}),
    "key and value not 3-D like query": ((_x, _kv[0], _kv[0]), {}),
    "query embed dim": ((_x[..., :4], _kv, _kv), {}),
    "key embed dim": ((_x, _kv[..., :4], _kv), {}),
    "key and value lengths differ": ((_x, _kv, _kv[:, :3]), {}),
    "key batch size": ((_x, _kv[:1], _kv[:1]), {}),
    "attn_mask 2-D shape": ((_x, _kv, _kv), dict(attn_mask=torch.zeros(_L, _S + 1, dtype=_B))),
    "attn_mask 3-D shape": ((_x, _kv, _kv), dict(attn_mask=torch.zeros(_N * _H + 1, _L, _S, dtype=_B))),
    "attn_mask 4-D": ((_x, _kv, _kv), dict(attn_mask=torch.zeros(_N, _H, _L, _S, dtype=_B))),
    "attn_mask integer": ((_x, _kv, _kv), dict(attn_mask=torch.zeros(_L, _S, dtype=torch.int64))),
    "key_padding_mask shape": ((_x, _kv, _kv), dict(key_padding_mask=torch.zeros(_N, _S + 1, dtype=_B))),
    "key_padding_mask 1-D, batched": ((_x, _kv, _kv), dict(key_padding_mask=torch.zeros(_S, dtype=_B))),
    "key_padding_mask integer": ((_x, _kv, _kv), dict(key_padding_mask=torch.zeros(_N, _S, dtype=torch.int64))),
    "unbatched attn_mask heads": ((_x[0], _kv[0], _kv[0]), dict(attn_mask=torch.zeros(_H + 1, _L, _S, dtype=_B))),
    "unbatched key_padding_mask 2-D": ((_x[0], _kv[0], _kv[0]), dict(key_padding_mask=torch.zeros(1, _S, dtype=_B))),
    "query float64, weights float32": ((_x.double(), _kv, _kv), {}),
    "integer inputs": ((_x.long(), _kv.long(), _kv.long()), {}),
    "key on another device": ((_x, _kv.to("meta"), _kv.to("meta")), {}),
}
_MHA_ACCEPTED = {"is_causal without attn_mask"}  # the documented extension: bottom-right causal


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("case", sorted(_MHA_REFUSED))
def test_fusedmha_refuses_what_torch_refuses_with_one_documented_exception(case, batch_first):
    args, kw = _MHA_REFUSED[case]
    if not batch_first:
        args = tuple(a.transpose(0, 1) if a.dim() == 3 else a for a in args)
    with pytest.raises(Exception) as theirs, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nn.MultiheadAttention(_E, _H, batch_first=batch_first)(*args, **kw)
    fused = mhakern.FusedMHA(_E, _H, batch_first=batch_first)
    if case in _MHA_ACCEPTED:
        out, _ = fused(*args, **kw)
        assert out.shape == args[0].shape
        return
    with pytest.raises(type(theirs.value)):
        fused(*args, **kw)


# torch's SDPA as PyTorch's tests run it (the math backend): what it refuses the drop-in refuses.
_SDPA_REFUSED = {
    "attn_mask with is_causal": dict(attn_mask=torch.ones(3, 3, dtype=_B), is_causal=True),
    "key head dim": dict(key=torch.randn(2, 2, 3, 5, dtype=torch.float64)),
    "dtypes differ": dict(key=torch.randn(2, 2, 3, 4)),
    "float mask of another dtype": dict(attn_mask=torch.zeros(3, 3, dtype=torch.float16)),
    "mask shape": dict(attn_mask=torch.ones(3, 4, dtype=_B)),
    "enable_gqa heads not dividing": dict(key=torch.randn(2, 3, 3, 4, dtype=torch.float64),
                                         value=torch.randn(2, 3, 3, 4, dtype=torch.float64), enable_gqa=True),
}


@pytest.mark.parametrize("case", sorted(_SDPA_REFUSED))
def test_sdpa_dropin_refuses_what_torch_refuses(case):
    q = torch.randn(2, 2, 3, 4, dtype=torch.float64)
    kw = dict(query=q, key=q, value=q)
    kw.update(_SDPA_REFUSED[case])
    with pytest.raises(Exception) as theirs, sdpa_kernel(SDPBackend.MATH):
        torch.nn.functional.scaled_dot_product_attention(**kw)
    with pytest.raises(type(theirs.value)):
        mhakern.scaled_dot_product_attention(**kw)
