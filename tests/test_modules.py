"""FusedMHA against torch.nn.MultiheadAttention, and its argument checks.

Equivalence is judged by GUIDE.md's tolerance rule: nn.MultiheadAttention in float64 is the
oracle, nn.MultiheadAttention in float32 the "torch math in T"; FusedMHA (float32, weights
loaded from the same state dict) must stay within 2x (outputs) / 3x (gradients of inputs and
parameters) of torch's own error plus atol. Every case runs on each backend usable for CPU
float32 tensors (reference always; triton under the interpreter once it is there).
"""
import math

import pytest
import torch
from torch import nn

import mhakern
import mhakern.modules
from attn_testing import rule_check
from mhakern import backends, reference


def _cpu_backends():
    probe = torch.zeros(1, 2, 3, 16)
    usable = []
    for name, why in mhakern.available_backends().items():
        if why is None and backends.get(name).supports(probe, probe, probe, True, None) is None:
            usable.append(name)
    return usable


BACKENDS = _cpu_backends()


def test_reference_backend_is_among_the_tested():
    assert "reference" in BACKENDS


def _torch_pair(seed, dtype=torch.float32, device="cpu", **kw):
    """An nn.MultiheadAttention in ``dtype`` and its float64 copy, on ``device``."""
    torch.manual_seed(seed)
    m32 = nn.MultiheadAttention(**kw).to(device=device, dtype=dtype)
    # Non-zero biases, so that a misplaced bias cannot hide behind nn.MHA's zero init.
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in m32.named_parameters():
            if "bias" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    # The oracle holds exactly the tested parameters, upcast.
    m64 = nn.MultiheadAttention(**kw).to(device=device, dtype=torch.float64)
    m64.load_state_dict({n: p.double() for n, p in m32.state_dict().items()})
    return m32, m64


def _fused_from(m32, backend, batch_first, **extra):
    f = mhakern.FusedMHA(
        m32.embed_dim,
        m32.num_heads,
        bias=m32.in_proj_bias is not None,
        kdim=m32.kdim,
        vdim=m32.vdim,
        batch_first=batch_first,
        backend=backend,
        device=m32.out_proj.weight.device,
        dtype=m32.out_proj.weight.dtype,
        **extra,
    )
    f.load_state_dict(m32.state_dict())
    return f


def _leaf(x, dtype, device="cpu"):
    return x.detach().to(device=device, dtype=dtype).requires_grad_(True)


def _compare_to_torch(fused, m32, m64, inputs, fused_kw, torch_kw, out_rows=None, seed=7):
    """Forward and backward of FusedMHA vs nn.MHA in fp64 (oracle) and in FusedMHA's dtype T
    (torch math), on FusedMHA's device; ``m32`` is the torch module in T.

    ``inputs`` are float64 tensors (query, key, value) — the same objects where the call is
    self-attention, so that the fused module takes its packed path. ``out_rows`` optionally
    selects the output entries compared and back-propagated (the rest get zero gradient).
    """
    T, device = fused.out_proj.weight.dtype, fused.out_proj.weight.device

    def run(module, dtype, kw):
        cache = {}  # one leaf per distinct input object, so self-attention stays self-attention
        xs = []
        for x in inputs:
            if id(x) not in cache:
                cache[id(x)] = _leaf(x, dtype, device)
            xs.append(cache[id(x)])
        if module is not fused:
            # Float masks in the module's own dtype, so torch's fp32 math stays fp32.
            kw = {n: t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype) if torch.is_tensor(t) else t
                  for n, t in kw.items()}
        else:
            kw = {n: t.to(device) if torch.is_tensor(t) else t for n, t in kw.items()}
        out, w = module(*xs, **kw)
        assert w is None or module is not fused
        return out, cache

    out_f, c_f = run(fused, T, fused_kw)
    out_64, c_64 = run(m64, torch.float64, torch_kw)
    out_32, c_32 = run(m32, T, torch_kw)
    assert out_f.shape == out_64.shape
    sel = (lambda t: t) if out_rows is None else out_rows
    rule_check("out", sel(out_f), sel(out_64), sel(out_32), T, 2.0)

    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(sel(out_64).shape, generator=g, dtype=torch.float64)
    for out, dt in ((out_f, T), (out_64, torch.float64), (out_32, T)):
        sel(out).backward(dout.to(device=device, dtype=dt))
    for i, (xf, x64, x32) in enumerate(zip(c_f.values(), c_64.values(), c_32.values())):
        rule_check(f"d(input {i})", xf.grad, x64.grad, x32.grad, T, 3.0)
    p64, p32 = dict(m64.named_parameters()), dict(m32.named_parameters())
    for name, p in fused.named_parameters():
        rule_check(f"d({name})", p.grad, p64[name].grad, p32[name].grad, T, 3.0)


def _bottom_right_block(L, S, lengths, num_heads):
    """nn.MHA attn_mask (N*H, L, S), True = blocked, equal to mhakern's causal rule."""
    vis = reference.visible_mask(L, S, True, lengths, torch.device("cpu"))
    vis = vis.expand(len(lengths) if lengths is not None else 1, num_heads, L, S)
    return ~vis.reshape(-1, L, S)


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_self_attention_matches_torch(backend, batch_first):
    m32, m64 = _torch_pair(0, embed_dim=24, num_heads=3, batch_first=batch_first)
    fused = _fused_from(m32, backend, batch_first)
    x = _x(2, 7, 24) if batch_first else _x(7, 2, 24)
    _compare_to_torch(fused, m32, m64, (x, x, x), {}, {"need_weights": False})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_cross_attention_kdim_vdim_with_float_padding_mask(backend, batch_first):
    m32, m64 = _torch_pair(1, embed_dim=16, num_heads=2, kdim=12, vdim=20, batch_first=batch_first)
    fused = _fused_from(m32, backend, batch_first)
    assert fused.in_proj_weight is None and fused.q_proj_weight.shape == (16, 16)
    N, L, S = 3, 5, 9
    q, k, v = _x(N, L, 16, seed=1), _x(N, S, 12, seed=2), _x(N, S, 20, seed=3)
    if not batch_first:
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    lengths = torch.tensor([9, 4, 1])
    kpm = torch.where(torch.arange(S) < lengths[:, None], 0.0, -math.inf)
    _compare_to_torch(
        fused, m32, m64, (q, k, v), {"key_padding_mask": kpm}, {"key_padding_mask": kpm}
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_bool_padding_mask_and_key_is_value_path(backend):
    # key is value (one GEMM for both) while query differs; bool mask, True = ignore.
    m32, m64 = _torch_pair(2, embed_dim=16, num_heads=4, batch_first=True)
    fused = _fused_from(m32, backend, True)
    q, kv = _x(2, 3, 16, seed=4), _x(2, 6, 16, seed=5)
    kpm = torch.arange(6) >= torch.tensor([[6], [2]])
    _compare_to_torch(fused, m32, m64, (q, kv, kv), {"key_padding_mask": kpm}, {"key_padding_mask": kpm})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_is_causal_square_matches_torch_causal_mask(backend, batch_first):
    # L == S: bottom-right and top-left alignment coincide; torch takes its usual triu mask.
    m32, m64 = _torch_pair(3, embed_dim=16, num_heads=2, batch_first=batch_first, bias=False)
    fused = _fused_from(m32, backend, batch_first)
    assert fused.in_proj_bias is None and fused.out_proj.bias is None
    x = _x(2, 6, 16, seed=6) if batch_first else _x(6, 2, 16, seed=6)
    mask = nn.Transformer.generate_square_subsequent_mask(6, dtype=torch.float64)
    _compare_to_torch(
        fused, m32, m64, (x, x, x), {"is_causal": True}, {"attn_mask": mask, "is_causal": True, "need_weights": False}
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_is_causal_rectangular_with_padding_is_bottom_right_per_element(backend):
    # L < S with right padding: query i sees key j iff j < n_b and j <= i + n_b - L.
    m32, m64 = _torch_pair(4, embed_dim=16, num_heads=2, kdim=8, vdim=8, batch_first=True)
    fused = _fused_from(m32, backend, True)
    N, L, S = 2, 3, 7
    lengths = torch.tensor([7, 4])
    q, k, v = _x(N, L, 16, seed=7), _x(N, S, 8, seed=8), _x(N, S, 8, seed=9)
    kpm = torch.arange(S) >= lengths[:, None]
    blocked = _bottom_right_block(L, S, lengths, 2)
    _compare_to_torch(
        fused, m32, m64, (q, k, v),
        {"key_padding_mask": kpm, "is_causal": True},
        {"attn_mask": blocked, "need_weights": False},
    )
    # The same through key_lengths directly.
    q1 = q.float()
    a, _ = fused(q1, k.float(), v.float(), key_padding_mask=kpm, is_causal=True)
    b, _ = fused(q1, k.float(), v.float(), key_lengths=lengths, is_causal=True)
    assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unbatched_inputs(backend):
    m32, m64 = _torch_pair(5, embed_dim=12, num_heads=3, batch_first=True)
    fused = _fused_from(m32, backend, True)
    q, kv = _x(4, 12, seed=10), _x(5, 12, seed=11)
    kpm = torch.tensor([False, False, False, True, True])
    _compare_to_torch(fused, m32, m64, (q, kv, kv), {"key_padding_mask": kpm}, {"key_padding_mask": kpm})
    out_a, _ = fused(q.float(), kv.float(), kv.float(), key_padding_mask=kpm)
    out_b, _ = fused(q.float(), kv.float(), kv.float(), key_lengths=torch.tensor(3))
    assert out_a.shape == (4, 12) and torch.equal(out_a, out_b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_half_precision_matches_torch(dtype, causal):
    # The best backend for CUDA tensors ("auto"), larger shapes; right padding, or causal.
    m, m64 = _torch_pair(7, dtype=dtype, device="cuda", embed_dim=256, num_heads=4, batch_first=True)
    fused = _fused_from(m, "auto", True)
    N, L = 4, 200
    x = _x(N, L, 256, seed=16)
    if causal:
        mask = torch.ones(L, L, dtype=torch.bool).triu(1)
        fused_kw, torch_kw = {"is_causal": True}, {"attn_mask": mask, "is_causal": True, "need_weights": False}
    else:
        kpm = torch.arange(L) >= torch.tensor([[200], [137], [64], [1]])
        fused_kw, torch_kw = {"key_padding_mask": kpm}, {"key_padding_mask": kpm, "need_weights": False}
    _compare_to_torch(fused, m, m64, (x, x, x), fused_kw, torch_kw)


def test_padded_causal_self_attention_recipe_matches_torch_on_real_rows():
    # The docstring's advice: for right-padded causal self-attention pass is_causal without the
    # mask; real query rows then match nn.MHA given both the causal and the padding mask.
    m32, m64 = _torch_pair(6, embed_dim=16, num_heads=2, batch_first=True)
    fused = _fused_from(m32, "reference", True)
    N, L = 3, 6
    lengths = torch.tensor([6, 4, 1])
    real = torch.arange(L) < lengths[:, None]  # (N, L)
    x = _x(N, L, 16, seed=12)
    mask = torch.ones(L, L, dtype=torch.bool).triu(1)
    _compare_to_torch(
        fused, m32, m64, (x, x, x),
        {"is_causal": True},
        {"attn_mask": mask, "key_padding_mask": ~real, "need_weights": False},
        out_rows=lambda t: t[real],
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_row_without_keys_gives_bias_and_zero_gradient(backend):
    torch.manual_seed(0)
    fused = mhakern.FusedMHA(8, 2, backend=backend)
    with torch.no_grad():
        fused.out_proj.bias.uniform_(-1, 1)
    q = torch.randn(2, 3, 8, requires_grad=True)
    kv = torch.randn(2, 4, 8, requires_grad=True)
    out, _ = fused(q, kv, kv, key_lengths=torch.tensor([4, 0]))
    assert torch.equal(out[1], fused.out_proj.bias.detach().expand(3, 8))
    out.sum().backward()
    assert torch.all(q.grad[1] == 0) and torch.all(kv.grad[1] == 0)
    assert torch.isfinite(q.grad).all() and q.grad[0].abs().sum() > 0


def _gqa_oracle(fused, q, k, v, causal, key_lengths, dtype):
    """FusedMHA's function computed step by step: projections, reference attention, out_proj."""
    p = {n: t.detach().to(dtype).requires_grad_(True) for n, t in fused.named_parameters()}
    H, Hkv, hd = fused.num_heads, fused.num_kv_heads, fused.head_dim
    Q, K = H * hd, Hkv * hd
    if fused._qkv_same_embed_dim:
        wq, wk, wv = p["in_proj_weight"].split((Q, K, K))
    else:
        wq, wk, wv = p["q_proj_weight"], p["k_proj_weight"], p["v_proj_weight"]
    bq, bk, bv = p["in_proj_bias"].split((Q, K, K))
    N, L, S = q.shape[0], q.shape[1], k.shape[1]
    qh = (q @ wq.T + bq).view(N, L, H, hd).transpose(1, 2)
    kh = (k @ wk.T + bk).view(N, S, Hkv, hd).transpose(1, 2)
    vh = (v @ wv.T + bv).view(N, S, Hkv, hd).transpose(1, 2)
    o = reference.attention(qh, kh, vh, 1.0 / math.sqrt(hd), causal, key_lengths, upcast=dtype == torch.float64)
    out = o.transpose(1, 2).reshape(N, L, Q) @ p["out_proj.weight"].T + p["out_proj.bias"]
    return out, p


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "E,H,Hkv,hd,kdim,self_attn",
    [(16, 4, 2, None, None, True), (16, 4, 1, 6, None, False), (12, 2, 2, 10, 7, False), (24, 6, 3, 8, 5, False)],
    ids=["gqa-self", "mqa-hd6", "hd10-kdim", "gqa-hd8-kdim"],
)
def test_gqa_and_head_dim_against_stepwise_oracle(backend, E, H, Hkv, hd, kdim, self_attn):
    torch.manual_seed(1)
    fused = mhakern.FusedMHA(E, H, num_kv_heads=Hkv, head_dim=hd, kdim=kdim, vdim=kdim, backend=backend)
    hd = E // H if hd is None else hd
    Q, K, Ek = H * hd, Hkv * hd, kdim or E
    if kdim is None:
        assert fused.in_proj_weight.shape == (Q + 2 * K, E)
    else:
        assert fused.q_proj_weight.shape == (Q, E)
        assert fused.k_proj_weight.shape == fused.v_proj_weight.shape == (K, Ek)
    assert fused.in_proj_bias.shape == (Q + 2 * K,) and fused.out_proj.weight.shape == (E, Q)
    with torch.no_grad():
        fused.in_proj_bias.normal_()
        fused.out_proj.bias.normal_()
    N, L, S = 2, 4, 6
    lengths = torch.tensor([6, 5])
    q64, k64 = _x(N, L, E, seed=13), _x(N, S, Ek, seed=14)
    if self_attn:  # query is key is value: the fused module's one-GEMM path
        k64, lengths = q64, torch.tensor([4, 3])

    def leaves(dtype):
        q = _leaf(q64, dtype)
        return (q, q) if self_attn else (q, _leaf(k64, dtype))

    q, k = leaves(torch.float32)
    out, _ = fused(q, k, k, is_causal=True, key_lengths=lengths)
    # Oracle and torch-math computations, each with its own leaves.
    qr, kr = leaves(torch.float64)
    ref, p64 = _gqa_oracle(fused, qr, kr, kr, True, lengths, torch.float64)
    qt, kt = leaves(torch.float32)
    mth, p32 = _gqa_oracle(fused, qt, kt, kt, True, lengths, torch.float32)
    rule_check("out", out, ref, mth, torch.float32, 2.0)
    dout = _x(*out.shape, seed=15)
    out.backward(dout.float())
    ref.backward(dout)
    mth.backward(dout.float())
    rule_check("dq", q.grad, qr.grad, qt.grad, torch.float32, 3.0)
    rule_check("dk", k.grad, kr.grad, kt.grad, torch.float32, 3.0)
    for name, prm in fused.named_parameters():
        rule_check(f"d({name})", prm.grad, p64[name].grad, p32[name].grad, torch.float32, 3.0)


@pytest.mark.parametrize("kw", [{}, {"kdim": 6, "vdim": 10}, {"bias": False}], ids=["packed", "separate", "no-bias"])
def test_initialisation_and_state_dict_equal_torch(kw):
    torch.manual_seed(123)
    ref = nn.MultiheadAttention(16, 4, batch_first=True, **kw)
    torch.manual_seed(123)
    fused = mhakern.FusedMHA(16, 4, **kw)
    sd_r, sd_f = ref.state_dict(), fused.state_dict()
    assert list(sd_r) == list(sd_f)
    for n in sd_r:
        assert sd_r[n].shape == sd_f[n].shape and torch.equal(sd_r[n], sd_f[n]), n
    # And back: nn.MultiheadAttention accepts FusedMHA's state dict.
    ref.load_state_dict(fused.state_dict())


def test_gqa_initialisation_is_xavier_on_the_packed_matrix():
    torch.manual_seed(0)
    fused = mhakern.FusedMHA(64, 8, num_kv_heads=2, head_dim=16)
    w = fused.in_proj_weight
    bound = math.sqrt(6.0 / (64 + w.shape[0]))
    assert w.shape == (128 + 2 * 32, 64)
    assert w.abs().max() <= bound and w.abs().max() > 0.9 * bound
    assert torch.all(fused.in_proj_bias == 0) and torch.all(fused.out_proj.bias == 0)


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_projections_reach_attention_without_copies(monkeypatch, batch_first):
    seen = {}
    real = mhakern.modules.attention

    def spy(q, k, v, **kw):
        seen["qkv"] = (q, k, v)
        seen["out"] = real(q, k, v, **kw)
        return seen["out"]

    monkeypatch.setattr(mhakern.modules, "attention", spy)
    fused = mhakern.FusedMHA(32, 4, num_kv_heads=2, batch_first=batch_first, backend="reference")
    merged = {}
    fused.out_proj.register_forward_pre_hook(lambda m, args: merged.setdefault("x", args[0]))
    N, L = 2, 5
    x = torch.randn(N, L, 32) if batch_first else torch.randn(L, N, 32)
    fused(x, x, x)
    q, k, v = seen["qkv"]
    # All three are views of one (.., Q + 2K) projection, unit stride on the head dim.
    W = 32 + 2 * 16
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    if batch_first:
        assert q.stride() == (L * W, 8, W, 1)
    else:
        assert q.stride() == (W, 8, N * W, 1)
    # Merging heads is a view of the attention output.
    assert merged["x"].data_ptr() == seen["out"].data_ptr() and merged["x"].is_contiguous()


def test_dropout_allowed_in_eval_mode_only():
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(8, 2, dropout=0.3, batch_first=True)
    fused = mhakern.FusedMHA(8, 2, dropout=0.3, backend="reference")
    fused.load_state_dict(ref.state_dict())
    x = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match=r"dropout: .*training mode"):
        fused(x, x, x)
    ref.eval(), fused.eval()
    torch.testing.assert_close(fused(x, x, x)[0], ref(x, x, x, need_weights=False)[0])


def _mk(**kw):
    return lambda: mhakern.FusedMHA(**{"embed_dim": 16, "num_heads": 4, **kw})


@pytest.mark.parametrize(
    "make,exc,words",
    [
        (_mk(embed_dim=0), ValueError, ["embed_dim", "positive int"]),
        (_mk(num_heads=-2), ValueError, ["num_heads", "positive int"]),
        (_mk(embed_dim=10), ValueError, ["embed_dim", "divisible by num_heads (4)"]),
        (_mk(num_kv_heads=3), ValueError, ["num_kv_heads", "divide num_heads (4)"]),
        (_mk(num_kv_heads=0), ValueError, ["num_kv_heads", "positive int"]),
        (_mk(head_dim=2.5), ValueError, ["head_dim", "positive int"]),
        (_mk(kdim=0), ValueError, ["kdim", "positive int"]),
        (_mk(dropout=1.5), ValueError, ["dropout", "[0, 1]"]),
        (_mk(add_bias_kv=True), ValueError, ["add_bias_kv", "False"]),
        (_mk(add_zero_attn=True), ValueError, ["add_zero_attn", "False"]),
        (_mk(bias="yes"), TypeError, ["bias", "bool"]),
        (_mk(batch_first=None), TypeError, ["batch_first", "bool"]),
        (_mk(backend="nope"), ValueError, ["backend", "'nope'", "reference"]),
        (_mk(backend=3), TypeError, ["backend", "string"]),
    ],
)
def test_constructor_rejects_bad_arguments(make, exc, words):
    with pytest.raises(exc) as ei:
        make()
    for w in words:
        assert w in str(ei.value), (w, str(ei.value))


def _call(**over):
    fused = mhakern.FusedMHA(16, 4, kdim=8, vdim=8, backend="reference")
    args = dict(query=torch.randn(2, 3, 16), key=torch.randn(2, 5, 8), value=torch.randn(2, 5, 8))
    args.update(over)
    return lambda: fused(**args)


_LEFT = torch.tensor([[False] * 5, [True, False, False, False, False]])
_HOLE = torch.tensor([[False, True, False, True, True], [False] * 5])
_FLOAT_BIAS = torch.tensor([[0.0, -1.0, 0.0, 0.0, 0.0], [0.0] * 5])


@pytest.mark.parametrize(
    "make,exc,words",
    [
        (_call(need_weights=True), ValueError, ["need_weights", "False"]),
        (_call(attn_mask=torch.zeros(3, 5)), ValueError, ["attn_mask", "None", "is_causal"]),
        (_call(is_causal=1), TypeError, ["is_causal", "bool"]),
        (_call(key_padding_mask=_LEFT), ValueError, ["key_padding_mask", "right padding"]),
        (_call(key_padding_mask=_HOLE), ValueError, ["key_padding_mask", "right padding"]),
        (_call(key_padding_mask=_FLOAT_BIAS), ValueError, ["key_padding_mask", "-inf"]),
        (_call(key_padding_mask=torch.zeros(2, 5, dtype=torch.int64)), TypeError, ["key_padding_mask", "bool"]),
        (_call(key_padding_mask=torch.zeros(2, 4, dtype=torch.bool)), ValueError, ["key_padding_mask", "(2, 5)"]),
        (_call(key_padding_mask=[[0] * 5] * 2), TypeError, ["key_padding_mask", "Tensor"]),
        (
            _call(key_padding_mask=torch.zeros(2, 5, dtype=torch.bool), key_lengths=torch.tensor([5, 5])),
            ValueError,
            ["key_padding_mask, key_lengths", "at most one"],
        ),
        (_call(key_lengths=torch.tensor([5, 5, 5])), ValueError, ["key_lengths", "(2,)"]),
        (_call(key_lengths=torch.tensor([5, 6])), ValueError, ["key_lengths", "[0, Lk=5]"]),
        (_call(query=torch.randn(1, 2, 3, 16)), ValueError, ["query", "3 dims", "2 dims"]),
        (_call(key=torch.randn(5, 8)), ValueError, ["key", "3 dims"]),
        (_call(query=torch.randn(2, 3, 15)), ValueError, ["query", "embed_dim=16"]),
        (_call(key=torch.randn(2, 5, 16)), ValueError, ["key", "kdim=8"]),
        (_call(value=torch.randn(2, 5, 9)), ValueError, ["value", "vdim=8"]),
        (_call(value=torch.randn(2, 4, 8)), ValueError, ["key, value", "must match"]),
        (_call(key=torch.randn(3, 5, 8), value=torch.randn(3, 5, 8)), ValueError, ["key", "batch size 3", "2"]),
        (_call(query="q"), TypeError, ["query", "Tensor"]),
    ],
)
def test_forward_rejects_bad_arguments(make, exc, words):
    with pytest.raises(exc) as ei:
        make()
    for w in words:
        assert w in str(ei.value), (w, str(ei.value))


def test_backend_that_cannot_serve_names_its_reason():
    # float64 is outside every compiled backend's dtypes; reference serves it, so pick a backend
    # that refuses it, if one is usable here.
    x = torch.zeros(1, 2, 3, 16, dtype=torch.float64)
    refusing = [n for n in BACKENDS if backends.get(n).supports(x, x, x, False, None) is not None]
    if not refusing:
        pytest.skip(f"needs a compiled backend (triton or cpu); usable here: {BACKENDS}")
    fused = mhakern.FusedMHA(16, 2, backend=refusing[0], dtype=torch.float64)
    y = torch.randn(1, 3, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match=f"backend='{refusing[0]}' cannot serve"):
        fused(y, y, y)
