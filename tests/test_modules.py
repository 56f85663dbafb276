"""FusedMHA against torch.nn.MultiheadAttention, and its argument checks.

Equivalence is judged by the contract's tolerance rule (docs/contract.md): nn.MultiheadAttention in float64 is the
oracle, nn.MultiheadAttention in float32 the "torch math in T"; FusedMHA (float32, weights
loaded from the same state dict) must stay within 2x (outputs and attention weights) / 3x
(gradients of inputs, float masks and parameters) of torch's own error plus atol.

``test_walk_matches_torch`` walks every combination of mask form, padding form and weights form,
with the other arguments (self/cross attention, kdim/vdim, batch_first, unbatched, bias,
add_bias_kv, add_zero_attn, float masks that require grad) spread over the cases so that every
pair of argument values meets at least once. The simpler cases run on each backend usable for
CPU float32 tensors (reference always; the compiled cpu backend once built; triton under the
interpreter).
"""
import itertools
import math
import os

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
# The modes FusedMHA hands to mhakern.attention (window is not one of them).
_MODES = frozenset({"attn_mask", "mask_grad", "dropout", "top_left"})
FULL_BACKENDS = [b for b in BACKENDS if b == "reference" or _MODES <= backends.get(b).features]


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
            if "bias" in n and n not in ("bias_k", "bias_v"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    # The oracle holds exactly the tested parameters, upcast.
    m64 = nn.MultiheadAttention(**kw).to(device=device, dtype=torch.float64)
    m64.load_state_dict({n: p.double() for n, p in m32.state_dict().items()})
    return m32, m64


def _fused_from(m32, backend, batch_first, **extra):
    f = mhakern.FusedMHA(
        m32.embed_dim,
        m32.num_heads,
        dropout=m32.dropout,
        bias=m32.in_proj_bias is not None,
        add_bias_kv=m32.bias_k is not None,
        add_zero_attn=m32.add_zero_attn,
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


class _Run:
    """One forward and backward of a module on fresh leaves: out, weights and named gradients."""

    def __init__(self, module, dtype, inputs, kw, grad_kw, use_weights, out_rows, seed):
        device = next(module.parameters()).device
        cache = {}  # one leaf per distinct input object, so self-attention stays self-attention
        xs = []
        for x in inputs:
            if id(x) not in cache:
                cache[id(x)] = _leaf(x, dtype, device)
            xs.append(cache[id(x)])
        call_kw = {}
        for n, t in kw.items():
            if torch.is_tensor(t):
                # Float masks in the module's own dtype, so torch's fp32 math stays fp32.
                t = t.detach().to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
                if n in grad_kw:
                    t.requires_grad_(True)
            call_kw[n] = t
        self.out, self.weights = module(*xs, **call_kw)
        sel = (lambda t: t) if out_rows is None else out_rows
        g = torch.Generator().manual_seed(seed)
        dout = torch.randn(sel(self.out).shape, generator=g, dtype=torch.float64)
        loss = (sel(self.out) * dout.to(device=device, dtype=self.out.dtype)).sum()
        if use_weights and self.weights is not None:
            dw = torch.randn(self.weights.shape, generator=g, dtype=torch.float64)
            loss = loss + (self.weights * dw.to(device=device, dtype=self.weights.dtype)).sum()
        loss.backward()
        self.grads = {f"d(input {i})": x.grad for i, x in enumerate(cache.values())}
        self.grads.update({f"d({n})": call_kw[n].grad for n in grad_kw})
        self.grads.update({f"d({n})": p.grad for n, p in module.named_parameters()})


def _compare_to_torch(fused, m32, m64, inputs, fused_kw, torch_kw, out_rows=None, seed=7, grad_kw=()):
    """Forward and backward of FusedMHA vs nn.MHA in fp64 (oracle) and in FusedMHA's dtype T
    (torch math), on FusedMHA's device; ``m32`` is the torch module in T.

    ``inputs`` are float64 tensors (query, key, value) — the same objects where the call is
    self-attention, so that the fused module takes its packed path. ``out_rows`` optionally
    selects the output entries compared and back-propagated (the rest get zero gradient).
    ``grad_kw`` names float masks among the keyword arguments that require grad. The loss
    includes the attention weights when both modules return them, so their gradients count.

    Rows that see no key: nn.MHA's weights path gives NaN there, its SDPA path (need_weights
    False) 0 like FusedMHA. When the oracle's weights hold NaN rows, the weights are compared on
    the other rows (FusedMHA's must be 0 on those), and out and gradients against torch's SDPA
    path.
    """
    T = fused.out_proj.weight.dtype

    def runs(fkw, tkw, use_weights):
        return (
            _Run(fused, T, inputs, fkw, grad_kw, use_weights, out_rows, seed),
            _Run(m64, torch.float64, inputs, tkw, grad_kw, use_weights, out_rows, seed),
            _Run(m32, T, inputs, tkw, grad_kw, use_weights, out_rows, seed),
        )

    f, r64, r32 = runs(fused_kw, torch_kw, True)
    if r64.weights is not None and f.weights is not None:
        w64 = r64.weights.detach()
        assert f.weights.shape == w64.shape and f.weights.dtype == T
        dead = torch.isnan(w64).any(-1)
        if dead.any():
            live = ~dead
            assert torch.all(f.weights[dead] == 0), "weights of rows that see no key must be 0"
            rule_check("weights", f.weights[live], w64[live], r32.weights[live], T, 2.0)
            f, r64, r32 = runs(fused_kw, {**torch_kw, "need_weights": False}, False)
        else:
            rule_check("weights", f.weights, w64, r32.weights, T, 2.0)
    assert f.out.shape == r64.out.shape
    sel = (lambda t: t) if out_rows is None else out_rows
    rule_check("out", sel(f.out), sel(r64.out), sel(r32.out), T, 2.0)
    assert f.grads.keys() == r64.grads.keys(), (f.grads.keys(), r64.grads.keys())
    for name, g in f.grads.items():
        rule_check(name, g, r64.grads[name], r32.grads[name], T, 3.0)


def _bottom_right_block(L, S, lengths, num_heads):
    """nn.MHA attn_mask (N*H, L, S), True = blocked, equal to mhakern's causal rule."""
    vis = reference.visible_mask(L, S, True, lengths, torch.device("cpu"))
    vis = vis.expand(len(lengths) if lengths is not None else 1, num_heads, L, S)
    return ~vis.reshape(-1, L, S)


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# --------------------------------------------------------------------------------------------
# The combination walk.

_WALK_AXES = {
    "attn_mask": (None, "bool2", "float2", "bool3", "float3", "causal_bool", "causal_float"),
    "padding": (None, "right_bool", "right_float", "left_bool", "left_float", "holes_bool", "bias_float"),
    "weights": ("none", "averaged", "per_head"),
    "inputs": ("self", "kv", "cross"),
    "batch_first": (True, False),
    "batched": (True, False),
    "bias": (True, False),
    "add_bias_kv": (False, True),
    "add_zero_attn": (False, True),
    "mask_grad": (False, True),
}
_MAIN = ("attn_mask", "padding", "weights")


def _pairs(case):
    names = list(_WALK_AXES)
    return {((a, case[a]), (b, case[b])) for a, b in itertools.combinations(names, 2)}


def _walk_cases():
    """Every combination of the _MAIN axes; the other axes chosen greedily so that every pair
    of values of any two axes occurs in some case (then more cases until that holds)."""
    names = list(_WALK_AXES)
    others = [n for n in names if n not in _MAIN]
    wanted = {
        ((a, va), (b, vb))
        for a, b in itertools.combinations(names, 2)
        for va in _WALK_AXES[a]
        for vb in _WALK_AXES[b]
    }
    covered, cases = set(), []

    def best(fixed):
        free = [n for n in names if n not in fixed]
        options = [dict(fixed, **dict(zip(free, vals))) for vals in itertools.product(*(_WALK_AXES[n] for n in free))]
        gains = [len(_pairs(c) - covered) for c in options]
        top = [c for c, g in zip(options, gains) if g == max(gains)]
        # Among equals, rotate (deterministically), so that cases past full pair coverage still
        # vary the other arguments.
        return top[(37 * len(cases)) % len(top)]

    for main in itertools.product(*(_WALK_AXES[n] for n in _MAIN)):
        c = best(dict(zip(_MAIN, main)))
        covered |= _pairs(c)
        cases.append(c)
    while wanted - covered:
        (a, va), (b, vb) = min(wanted - covered, key=repr)
        c = best({a: va, b: vb})
        covered |= _pairs(c)
        cases.append(c)
    return cases


_WALK = _walk_cases()


def _walk_id(c):
    parts = [f"mask={c['attn_mask']}", f"pad={c['padding']}", f"w={c['weights']}", c["inputs"]]
    parts.append("bf" if c["batch_first"] else "sf")
    parts += [n for n in ("bias", "add_bias_kv", "add_zero_attn", "mask_grad") if c[n]]
    if not c["batched"]:
        parts.append("unbatched")
    return ",".join(parts)


def _walk_params():
    # The Triton interpreter takes about a second per call: it walks a spread seventh.
    for b in FULL_BACKENDS:
        step = 7 if b == "triton" and os.environ.get("TRITON_INTERPRET") == "1" else 1
        for i, c in enumerate(_WALK):
            if i % step == 0:
                yield pytest.param(b, c, id=f"{b}-{i}-{_walk_id(c)}")


def test_walk_covers_every_pair_of_argument_values():
    wanted = {
        ((a, va), (b, vb))
        for a, b in itertools.combinations(_WALK_AXES, 2)
        for va in _WALK_AXES[a]
        for vb in _WALK_AXES[b]
    }
    covered = set().union(*(_pairs(c) for c in _WALK))
    assert wanted <= covered, sorted(wanted - covered)[:5]
    main = {tuple(c[n] for n in _MAIN) for c in _WALK}
    assert len(main) == math.prod(len(_WALK_AXES[n]) for n in _MAIN)


def _walk_setup(c, i):
    """Modules, inputs and keyword arguments of walk case ``c`` (case number ``i``)."""
    E, H, N = 16, 2, 2
    kw = {"embed_dim": E, "num_heads": H, "batch_first": c["batch_first"], "bias": c["bias"],
          "add_bias_kv": c["add_bias_kv"], "add_zero_attn": c["add_zero_attn"]}
    if c["inputs"] == "self":
        L = S = 5
    else:
        L, S = 4, 6
    if c["inputs"] == "cross":
        kw.update(kdim=6, vdim=10)
    m32, m64 = _torch_pair(100 + i, **kw)
    kdim, vdim = m32.kdim, m32.vdim
    g = torch.Generator().manual_seed(200 + i)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    def seq(n, f):
        if not c["batched"]:
            return rnd(n, f)
        return rnd(N, n, f) if c["batch_first"] else rnd(n, N, f)

    q = seq(L, E)
    if c["inputs"] == "self":
        inputs = (q, q, q)
    elif c["inputs"] == "kv":
        kv = seq(S, E)
        inputs = (q, kv, kv)
    else:
        inputs = (q, seq(S, kdim), seq(S, vdim))

    # Key S // 2 stays visible under every mask and padding below (causal masks excepted),
    # so that most rows see a key; rows that see none are covered as _compare_to_torch says.
    anchor = S // 2
    heads = N * H if c["batched"] else H
    call, grad_kw = {}, []
    m = c["attn_mask"]
    if m is not None:
        if m.startswith("causal"):
            blocked = torch.ones(L, S, dtype=torch.bool).triu(1)
            call["is_causal"] = True
        else:
            shape = (L, S) if m.endswith("2") else (heads, L, S)
            blocked = torch.rand(shape, generator=g) < 0.35
            blocked[..., anchor] = False
        if m.startswith("bool") or m == "causal_bool":
            call["attn_mask"] = blocked
        else:
            causal_mask = m.startswith("causal")
            bias = torch.zeros(blocked.shape, dtype=torch.float64) if causal_mask else rnd(*blocked.shape)
            call["attn_mask"] = bias.masked_fill(blocked, float("-inf"))
            if c["mask_grad"]:
                grad_kw.append("attn_mask")
    p = c["padding"]
    if p is not None:
        j = torch.arange(S)
        ignore = {
            "right": torch.stack([torch.zeros(S, dtype=torch.bool), j >= S - 2]),
            "left": torch.stack([torch.zeros(S, dtype=torch.bool), j < 2]),
            "holes": torch.stack([(j == 1) | (j == S - 1), (j == 0) | (j == S - 2)]),
            # Right padding, but other values than 0 on kept keys: not key lengths alone.
            "bias": torch.stack([torch.zeros(S, dtype=torch.bool), j >= S - 2]),
        }[p.split("_")[0]]
        if p.endswith("float"):
            bias = rnd(2, S) if p.startswith("bias") else torch.zeros(2, S, dtype=torch.float64)
            kpm = bias.masked_fill(ignore, float("-inf"))
            if c["mask_grad"]:
                grad_kw.append("key_padding_mask")
        else:
            kpm = ignore
        call["key_padding_mask"] = kpm if c["batched"] else kpm[1]
    call["need_weights"] = c["weights"] != "none"
    call["average_attn_weights"] = c["weights"] == "averaged"
    return m32, m64, inputs, call, grad_kw


# torch warns when one mask is bool and the other float; the walk mixes them on purpose.
@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask and attn_mask is deprecated")
@pytest.mark.parametrize("backend,case", list(_walk_params()))
def test_walk_matches_torch(backend, case):
    i = _WALK.index(case)
    m32, m64, inputs, call, grad_kw = _walk_setup(case, i)
    fused = _fused_from(m32, backend, case["batch_first"])
    _compare_to_torch(fused, m32, m64, inputs, call, call, grad_kw=tuple(grad_kw), seed=300 + i)


# --------------------------------------------------------------------------------------------
# Named cases, on every backend.


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_self_attention_matches_torch(backend, batch_first):
    # torch's defaults: need_weights=True, averaged.
    m32, m64 = _torch_pair(0, embed_dim=24, num_heads=3, batch_first=batch_first)
    fused = _fused_from(m32, backend, batch_first)
    x = _x(2, 7, 24) if batch_first else _x(7, 2, 24)
    _compare_to_torch(fused, m32, m64, (x, x, x), {}, {})


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_head_weights_match_torch(backend):
    m32, m64 = _torch_pair(8, embed_dim=16, num_heads=4, batch_first=True)
    fused = _fused_from(m32, backend, True)
    x = _x(2, 6, 16, seed=17)
    kw = {"average_attn_weights": False}
    _compare_to_torch(fused, m32, m64, (x, x, x), kw, kw)
    assert fused(x.float(), x.float(), x.float(), **kw)[1].shape == (2, 4, 6, 6)


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
    # L == S: torch's hint path (SDPA's top-left is_causal) and mhakern's bottom-right causal
    # coincide, so every backend serves it.
    m32, m64 = _torch_pair(3, embed_dim=16, num_heads=2, batch_first=batch_first, bias=False)
    fused = _fused_from(m32, backend, batch_first)
    assert fused.in_proj_bias is None and fused.out_proj.bias is None
    x = _x(2, 6, 16, seed=6) if batch_first else _x(6, 2, 16, seed=6)
    mask = nn.Transformer.generate_square_subsequent_mask(6, dtype=torch.float64)
    kw = {"attn_mask": mask, "is_causal": True, "need_weights": False}
    _compare_to_torch(fused, m32, m64, (x, x, x), kw, kw)
    # The extension: is_causal without the mask is the same rule here.
    _compare_to_torch(fused, m32, m64, (x, x, x), {"is_causal": True, "need_weights": False}, kw)


@pytest.mark.parametrize("extra", ["none", "bias_kv", "zero_attn", "both"])
@pytest.mark.parametrize("L,S", [(5, 5), (3, 6), (6, 3)], ids=["square", "wide", "tall"])
@pytest.mark.parametrize("need_weights", [False, True], ids=["hint", "mask"])
def test_is_causal_hint_follows_torch(need_weights, L, S, extra):
    # torch reads is_causal with a (here top-left, honest) causal attn_mask as a hint: without
    # key_padding_mask and weights it drops the mask and runs SDPA's top-left causal rule over
    # all keys, the appended ones included (these then hide from the first queries); otherwise
    # it uses the mask, padded so that appended keys stay visible. FusedMHA follows both.
    bias_kv, zero_attn = extra in ("bias_kv", "both"), extra in ("zero_attn", "both")
    m32, m64 = _torch_pair(
        13, embed_dim=16, num_heads=2, batch_first=True, add_bias_kv=bias_kv, add_zero_attn=zero_attn
    )
    fused = _fused_from(m32, "reference", True)
    q, kv = _x(2, L, 16, seed=24), _x(2, S, 16, seed=25)
    kw = {"attn_mask": torch.ones(L, S, dtype=torch.bool).triu(1), "is_causal": True, "need_weights": need_weights}
    _compare_to_torch(fused, m32, m64, (q, kv, kv), kw, kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_is_causal_rectangular_with_padding_is_bottom_right_per_element(backend):
    # The extension (is_causal without attn_mask), L < S with right padding: query i sees key j
    # iff j < n_b and j <= i + n_b - L. torch gets the equivalent explicit mask.
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
        {"attn_mask": blocked},
    )
    # The same through key_lengths directly.
    q1 = q.float()
    a, wa = fused(q1, k.float(), v.float(), key_padding_mask=kpm, is_causal=True)
    b, wb = fused(q1, k.float(), v.float(), key_lengths=lengths, is_causal=True)
    assert torch.equal(a, b) and torch.equal(wa, wb)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unbatched_inputs(backend):
    m32, m64 = _torch_pair(5, embed_dim=12, num_heads=3, batch_first=True)
    fused = _fused_from(m32, backend, True)
    q, kv = _x(4, 12, seed=10), _x(5, 12, seed=11)
    kpm = torch.tensor([False, False, False, True, True])
    for avg in (True, False):
        kw = {"key_padding_mask": kpm, "average_attn_weights": avg}
        _compare_to_torch(fused, m32, m64, (q, kv, kv), kw, kw)
    out_a, w_a = fused(q.float(), kv.float(), kv.float(), key_padding_mask=kpm)
    out_b, w_b = fused(q.float(), kv.float(), kv.float(), key_lengths=torch.tensor(3))
    assert out_a.shape == (4, 12) and w_a.shape == (4, 5)
    assert torch.equal(out_a, out_b) and torch.equal(w_a, w_b)


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
        kw = {"attn_mask": mask, "is_causal": True, "need_weights": False}
    else:
        kpm = torch.arange(L) >= torch.tensor([[200], [137], [64], [1]])
        kw = {"key_padding_mask": kpm, "need_weights": False}
    _compare_to_torch(fused, m, m64, (x, x, x), kw, kw)


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
        {"is_causal": True, "need_weights": False},
        {"attn_mask": mask, "key_padding_mask": ~real, "need_weights": False},
        out_rows=lambda t: t[real],
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_row_without_keys_gives_bias_and_zero_gradient(backend):
    torch.manual_seed(0)
    fused = mhakern.FusedMHA(8, 2, backend=backend, batch_first=True)
    with torch.no_grad():
        fused.out_proj.bias.uniform_(-1, 1)
    q = torch.randn(2, 3, 8, requires_grad=True)
    kv = torch.randn(2, 4, 8, requires_grad=True)
    out, w = fused(q, kv, kv, key_lengths=torch.tensor([4, 0]))
    assert torch.equal(out[1], fused.out_proj.bias.detach().expand(3, 8))
    assert torch.all(w[1] == 0) and torch.allclose(w[0].sum(-1), torch.ones(3))
    (out.sum() + w.sum()).backward()
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
    # The attention probabilities per query head (kv head h // (H // Hkv)), by softmax.
    s = qh @ kh.repeat_interleave(H // Hkv, dim=1).transpose(-1, -2) / math.sqrt(hd)
    vis = reference.visible_mask(L, S, causal, key_lengths, q.device)
    s = s.masked_fill(~vis, float("-inf"))
    weights = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return out, weights, p


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "E,H,Hkv,hd,kdim,self_attn",
    [(16, 4, 2, None, None, True), (16, 4, 1, 6, None, False), (12, 2, 2, 10, 7, False), (24, 6, 3, 8, 5, False)],
    ids=["gqa-self", "mqa-hd6", "hd10-kdim", "gqa-hd8-kdim"],
)
def test_gqa_and_head_dim_against_stepwise_oracle(backend, E, H, Hkv, hd, kdim, self_attn):
    torch.manual_seed(1)
    fused = mhakern.FusedMHA(E, H, num_kv_heads=Hkv, head_dim=hd, kdim=kdim, vdim=kdim, backend=backend, batch_first=True)
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
    out, w = fused(q, k, k, is_causal=True, key_lengths=lengths, average_attn_weights=False)
    # Oracle and torch-math computations, each with its own leaves.
    qr, kr = leaves(torch.float64)
    ref, w_ref, p64 = _gqa_oracle(fused, qr, kr, kr, True, lengths, torch.float64)
    qt, kt = leaves(torch.float32)
    mth, w_mth, p32 = _gqa_oracle(fused, qt, kt, kt, True, lengths, torch.float32)
    rule_check("out", out, ref, mth, torch.float32, 2.0)
    rule_check("weights", w, w_ref, w_mth, torch.float32, 2.0)
    dout, dw = _x(*out.shape, seed=15), _x(*w.shape, seed=16)
    (out * dout.float()).sum().add((w * dw.float()).sum()).backward()
    (ref * dout).sum().add((w_ref * dw).sum()).backward()
    (mth * dout.float()).sum().add((w_mth * dw.float()).sum()).backward()
    rule_check("dq", q.grad, qr.grad, qt.grad, torch.float32, 3.0)
    rule_check("dk", k.grad, kr.grad, kt.grad, torch.float32, 3.0)
    for name, prm in fused.named_parameters():
        rule_check(f"d({name})", prm.grad, p64[name].grad, p32[name].grad, torch.float32, 3.0)


@pytest.mark.parametrize(
    "kw",
    [{}, {"kdim": 6, "vdim": 10}, {"bias": False}, {"add_bias_kv": True, "add_zero_attn": True}],
    ids=["packed", "separate", "no-bias", "bias-kv"],
)
def test_initialisation_and_state_dict_equal_torch(kw):
    torch.manual_seed(123)
    ref = nn.MultiheadAttention(16, 4, batch_first=True, **kw)
    torch.manual_seed(123)
    fused = mhakern.FusedMHA(16, 4, batch_first=True, **kw)
    sd_r, sd_f = ref.state_dict(), fused.state_dict()
    assert list(sd_r) == list(sd_f)
    for n in sd_r:
        assert sd_r[n].shape == sd_f[n].shape and torch.equal(sd_r[n], sd_f[n]), n
    # And back: nn.MultiheadAttention accepts FusedMHA's state dict.
    ref.load_state_dict(fused.state_dict())


def test_gqa_initialisation_is_xavier_on_the_packed_matrix():
    torch.manual_seed(0)
    fused = mhakern.FusedMHA(64, 8, num_kv_heads=2, head_dim=16, batch_first=True)
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
    fused(x, x, x, need_weights=False)
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


def test_weights_pass_runs_only_when_asked(monkeypatch):
    calls = []
    real = mhakern.modules.attention

    def spy(*a, **kw):
        calls.append(kw.get("return_lse", False))
        return real(*a, **kw)

    def no_weights(*a, **kw):
        raise AssertionError("the weights pass ran although need_weights=False")

    monkeypatch.setattr(mhakern.modules, "attention", spy)
    monkeypatch.setattr(mhakern.modules, "_attention_weights", no_weights)
    fused = mhakern.FusedMHA(16, 2, backend="reference", batch_first=True)
    x = torch.randn(2, 5, 16)
    out, w = fused(x, x, x, need_weights=False)
    assert w is None and calls == [False]


# --------------------------------------------------------------------------------------------
# Dropout: compared with dropout off, and for determinism with itself.


def _dropout_module(p, seed=0, **kw):
    torch.manual_seed(seed)
    fused = mhakern.FusedMHA(16, 2, dropout=p, backend="reference", batch_first=True, **kw)
    with torch.no_grad():
        fused.in_proj_bias.normal_()
        fused.out_proj.bias.normal_()
    return fused


def _grads_of(fused, x, seed, **kw):
    xl = x.detach().clone().requires_grad_(True)
    fused.zero_grad()
    torch.manual_seed(seed)
    out, w = fused(xl, xl, xl, **kw)
    loss = out.pow(2).sum() + (0.0 if w is None else w.pow(2).sum())
    loss.backward()
    return [out, w, xl.grad] + [p.grad.clone() for p in fused.parameters()]


def test_dropout_is_deterministic_for_a_seed_and_varies_across_seeds():
    fused = _dropout_module(0.4)
    x = torch.randn(2, 6, 16)
    a = _grads_of(fused, x, 11, average_attn_weights=False)
    b = _grads_of(fused, x, 11, average_attn_weights=False)
    for i, (u, v) in enumerate(zip(a, b)):
        assert torch.equal(u, v), f"result {i} (out, weights, dx, parameter grads) differs between equal seeds"
    c = _grads_of(fused, x, 12, average_attn_weights=False)
    assert not torch.equal(a[1] == 0, c[1] == 0), "another seed must drop other probabilities"
    # need_weights does not change what the output draws.
    d = _grads_of(fused, x, 11, need_weights=False)
    assert d[1] is None and torch.equal(a[0], d[0])


def test_dropout_weights_are_the_ones_that_made_the_output():
    p = 0.4
    fused = _dropout_module(p, seed=1)
    N, L, E, H = 2, 24, 16, 2
    x = torch.randn(N, L, E, dtype=torch.float32)
    torch.manual_seed(5)
    out, w = fused(x, x, x, average_attn_weights=False)
    assert w.shape == (N, H, L, L)
    # Stepwise from the returned (dropped, rescaled) weights: out = out_proj(w @ v).
    v = torch.nn.functional.linear(x, fused.in_proj_weight[2 * E:], fused.in_proj_bias[2 * E:])
    v = v.view(N, L, H, E // H).transpose(1, 2)
    o = (w @ v).transpose(1, 2).reshape(N, L, E)
    torch.testing.assert_close(out, fused.out_proj(o), rtol=1e-5, atol=1e-5)
    # The kept weights are the undropped probabilities / (1 - p); about p of them are dropped.
    fused.eval()
    _, full = fused(x, x, x, average_attn_weights=False)
    kept = w != 0
    torch.testing.assert_close(w[kept], full[kept] / (1 - p), rtol=1e-5, atol=1e-7)
    dropped = 1.0 - kept.double().mean().item()
    assert abs(dropped - p) < 0.05, dropped  # 2304 draws: 0.05 is about 5 standard deviations


def test_dropout_path_with_nothing_dropped_matches_torch_without_dropout():
    # p small enough that the keep threshold is 0: the dropout path runs (seed, generator,
    # kernel's keep test) and must keep everything, i.e. equal torch without dropout.
    m32, m64 = _torch_pair(9, embed_dim=16, num_heads=2, batch_first=True)
    fused = _fused_from(m32, "reference", True)
    fused.dropout = 1e-12
    assert fused.training and int(fused.dropout * 4294967296.0) == 0
    x = _x(2, 5, 16, seed=18)
    kpm = torch.tensor([[False] * 5, [True, False, False, False, False]])
    kw = {"key_padding_mask": kpm, "average_attn_weights": False}
    _compare_to_torch(fused, m32, m64, (x, x, x), kw, kw)


@pytest.mark.parametrize("training", [True, False], ids=["train-p1", "eval-p0.3"])
def test_dropout_edges_match_torch(training):
    # Training with p = 1 drops everything (out = out_proj.bias, weights 0, as torch's dropout);
    # in eval mode neither module drops anything.
    p = 1.0 if training else 0.3
    m32, m64 = _torch_pair(10, embed_dim=16, num_heads=2, dropout=p, batch_first=True)
    fused = _fused_from(m32, "reference", True)
    for m in (m32, m64, fused):
        m.train(training)
    x = _x(2, 5, 16, seed=19)
    _compare_to_torch(fused, m32, m64, (x, x, x), {}, {})
    if training:
        out, w = fused(x.float(), x.float(), x.float())
        assert torch.equal(out, fused.out_proj.bias.detach().expand_as(out)) and torch.all(w == 0)


# --------------------------------------------------------------------------------------------
# Extensions beyond nn.MultiheadAttention, against torch given the equivalent explicit mask.


@pytest.mark.parametrize(
    "ignore",
    [[[False] * 6, [True, True, False, False, False, False]], [[False, True, False, False, True, True], [False] * 6]],
    ids=["left", "holes"],
)
def test_is_causal_without_mask_aligns_to_the_last_kept_key(ignore):
    m32, m64 = _torch_pair(11, embed_dim=16, num_heads=2, batch_first=True)
    fused = _fused_from(m32, "reference", True)
    N, H, L, S = 2, 2, 3, 6
    kpm = torch.tensor(ignore)
    n = S - torch.argmax((~kpm).flip(1).int(), dim=1)  # 1 + the last kept position
    i, j = torch.arange(L).view(1, L, 1), torch.arange(S).view(1, 1, S)
    blocked = (j > i + n.view(N, 1, 1) - L).repeat_interleave(H, dim=0)
    q, kv = _x(N, L, 16, seed=20), _x(N, S, 16, seed=21)
    _compare_to_torch(
        fused, m32, m64, (q, kv, kv),
        {"key_padding_mask": kpm, "is_causal": True},
        {"key_padding_mask": kpm, "attn_mask": blocked},
    )


def test_key_lengths_with_appended_keys_keep_those_visible():
    m32, m64 = _torch_pair(12, embed_dim=16, num_heads=2, batch_first=True, add_bias_kv=True, add_zero_attn=True)
    fused = _fused_from(m32, "reference", True)
    lengths = torch.tensor([5, 0])
    kpm = torch.arange(5) >= lengths[:, None]
    q, kv = _x(2, 3, 16, seed=22), _x(2, 5, 16, seed=23)
    _compare_to_torch(fused, m32, m64, (q, kv, kv), {"key_lengths": lengths}, {"key_padding_mask": kpm})
    with pytest.raises(ValueError, match=r"key_lengths: values must lie in \[0, Lk=5\]"):
        fused(q.float(), kv.float(), kv.float(), key_lengths=torch.tensor([6, 0]))


def test_compiled_masks_and_weights_match_eager():
    # Under torch.compile the padding check cannot read the data: a left-padding mask, a float
    # attn_mask that requires grad and the weights pass must all compile into one graph and
    # give eager's results.
    torch._dynamo.reset()
    torch.manual_seed(14)
    fused = mhakern.FusedMHA(16, 2, add_bias_kv=True, backend="reference", batch_first=True)
    x = torch.randn(2, 5, 16, requires_grad=True)
    kpm = torch.tensor([[False] * 5, [True, True, False, False, False]])
    bias = torch.randn(5, 5).masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))

    def run(m):
        am = bias.clone().requires_grad_(True)
        x.grad = None
        fused.zero_grad()
        out, w = m(x, x, x, key_padding_mask=kpm, attn_mask=am, average_attn_weights=False)
        (out.pow(2).sum() + w.pow(2).sum()).backward()
        return [out, w, x.grad, am.grad] + [p.grad.clone() for p in fused.parameters()]

    compiled = torch.compile(fused, backend="aot_eager", fullgraph=True)
    for i, (c, e) in enumerate(zip(run(compiled), run(fused))):
        torch.testing.assert_close(c, e, msg=lambda m: f"result {i} (out, weights, then gradients): {m}")
    torch._dynamo.reset()


class _NoModesBackend(backends.Backend):
    """A registered backend that implements no optional mode (the reference underneath)."""

    name = "no_modes"
    priority = -5

    def forward(self, q, k, v, scale, causal, key_lengths, modes=backends.DEFAULT_MODES):
        assert modes == backends.DEFAULT_MODES
        return backends.get("reference").forward(q, k, v, scale, causal, key_lengths, modes)

    def backward(self, dout, q, k, v, out, lse, scale, causal, key_lengths, modes=backends.DEFAULT_MODES):
        return backends.get("reference").backward(dout, q, k, v, out, lse, scale, causal, key_lengths, modes)


@pytest.fixture
def no_modes():
    be = backends.register(_NoModesBackend())
    yield be
    del backends._REGISTRY[be.name]
    backends._ORDER = None
    backends.clear_dispatch_cache()


def test_backend_without_masks_serves_right_padding_and_names_the_mode_otherwise(no_modes):
    torch.manual_seed(15)
    fused = mhakern.FusedMHA(8, 2, backend="no_modes", batch_first=True)
    ref = mhakern.FusedMHA(8, 2, backend="reference", batch_first=True)
    ref.load_state_dict(fused.state_dict())
    x = torch.randn(2, 4, 8)
    right = torch.tensor([[False] * 4, [False, False, False, True]])
    left = torch.tensor([[False] * 4, [True, False, False, False]])
    for a, b in zip(fused(x, x, x, key_padding_mask=right), ref(x, x, x, key_padding_mask=right)):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="attn_mask"):
        fused(x, x, x, key_padding_mask=left)
    # Under compile the data cannot pick the path: right padding is required, checked in the graph.
    torch._dynamo.reset()
    compiled = torch.compile(fused, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(
        compiled(x, x, x, key_padding_mask=right, need_weights=False)[0],
        ref(x, x, x, key_padding_mask=right, need_weights=False)[0],
    )
    with pytest.raises(RuntimeError, match="right padding"):
        compiled(x, x, x, key_padding_mask=left, need_weights=False)
    torch._dynamo.reset()


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
        (_mk(add_bias_kv=1), TypeError, ["add_bias_kv", "bool"]),
        (_mk(add_zero_attn="no"), TypeError, ["add_zero_attn", "bool"]),
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
    fused = mhakern.FusedMHA(16, 4, kdim=8, vdim=8, backend="reference", batch_first=True)
    args = dict(query=torch.randn(2, 3, 16), key=torch.randn(2, 5, 8), value=torch.randn(2, 5, 8))
    args.update(over)
    return lambda: fused(**args)


@pytest.mark.parametrize(
    "make,exc,words",
    [
        (_call(need_weights=1), TypeError, ["need_weights", "bool"]),
        (_call(average_attn_weights=None), TypeError, ["average_attn_weights", "bool"]),
        (_call(is_causal=1), TypeError, ["is_causal", "bool"]),
        (_call(attn_mask=torch.zeros(3, 4)), ValueError, ["attn_mask", "(3, 5)", "(8, 3, 5)"]),
        (_call(attn_mask=torch.zeros(4, 3, 5)), ValueError, ["attn_mask", "(8, 3, 5)", "(4, 3, 5)"]),
        (_call(attn_mask=torch.zeros(1, 1, 3, 5)), ValueError, ["attn_mask", "(3, 5)", "(1, 1, 3, 5)"]),
        (_call(attn_mask=torch.zeros(3, 5, dtype=torch.int64)), TypeError, ["attn_mask", "bool or floating", "int64"]),
        (_call(attn_mask=[[0.0] * 5] * 3), TypeError, ["attn_mask", "Tensor"]),
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
    fused = mhakern.FusedMHA(16, 2, backend=refusing[0], dtype=torch.float64, batch_first=True)
    y = torch.randn(1, 3, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match=f"backend='{refusing[0]}' cannot serve"):
        fused(y, y, y)


def test_constructor_defaults_are_torchs():
    # A drop-in swap relies on every shared argument defaulting as in nn.MultiheadAttention
    # (batch_first above all: a different default silently reads (L, N, E) as (N, L, E)).
    import inspect

    ours = inspect.signature(mhakern.FusedMHA.__init__).parameters
    theirs = inspect.signature(nn.MultiheadAttention.__init__).parameters
    shared = [n for n in theirs if n != "self"]
    assert all(n in ours for n in shared), sorted(set(shared) - set(ours))
    for n in shared:
        assert ours[n].default == theirs[n].default, (n, ours[n].default, theirs[n].default)
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(8, 2)
    torch.manual_seed(0)
    fused = mhakern.FusedMHA(8, 2, backend="reference")
    x = torch.randn(5, 3, 8)  # (L, N, E): torch's default layout
    torch.testing.assert_close(fused(x, x, x)[0], ref(x, x, x)[0], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Drop-in fidelity: each of these failed before its fix

import collections  # noqa: E402
import contextlib  # noqa: E402

from torch.nn.attention.bias import causal_lower_right, causal_upper_left  # noqa: E402


def _swap_in_fused(model, E, H):
    """Replace every nn.MultiheadAttention of ``model`` by a FusedMHA with its weights; returns them."""
    fused = []
    for mod in list(model.modules()):
        for attr in ("self_attn", "multihead_attn"):
            a = getattr(mod, attr, None)
            if isinstance(a, nn.MultiheadAttention):
                f = mhakern.FusedMHA(E, H, batch_first=True, dtype=torch.float64)
                f.load_state_dict(a.state_dict())
                setattr(mod, attr, f)
                fused.append(f)
    return fused


def _transformer(kind, E=16, H=4):
    torch.manual_seed(1)
    layer = dict(d_model=E, nhead=H, dim_feedforward=32, dropout=0.0, batch_first=True)
    if kind == "encoder_layer":
        return nn.TransformerEncoderLayer(**layer).double()
    if kind == "encoder":
        return nn.TransformerEncoder(nn.TransformerEncoderLayer(**layer), 2).double()
    return nn.TransformerDecoderLayer(**layer).double()


@pytest.mark.parametrize("mode", ["train", "eval", "no_grad", "inference_mode"])
@pytest.mark.parametrize("kind", ["encoder_layer", "encoder", "decoder_layer"])
def test_fusedmha_runs_its_kernels_inside_torch_transformer_layers(kind, mode):
    # Before: eval() under no_grad / inference_mode raised AttributeError 'merge_masks' (torch's
    # fast path read FusedMHA's attributes and took its fused op, which would bypass mhakern).
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, generator=g, dtype=torch.float64)
    mem = torch.randn(3, 7, 16, generator=g, dtype=torch.float64)
    pad = torch.tensor([[0, 0, 0, 0, 0], [0, 0, 0, 1, 1], [0, 0, 0, 0, 1]], dtype=torch.bool)
    torch_model, ours = _transformer(kind), _transformer(kind)
    fused = _swap_in_fused(ours, 16, 4)
    calls = []
    for f in fused:
        # Counted by wrapping forward, not by a hook: a hook of the test's own would itself
        # make torch decline its fast path.
        f.forward = (lambda f, fwd: lambda *a, **kw: calls.append(f) or fwd(*a, **kw))(f, f.forward)
    for use_pad in (None, pad):
        outs = []
        for model in (torch_model, ours):
            model.train(mode == "train")
            ctx = {"no_grad": torch.no_grad(), "inference_mode": torch.inference_mode()}.get(mode, contextlib.nullcontext())
            with ctx:
                if kind == "decoder_layer":
                    o = model(x, mem, tgt_key_padding_mask=use_pad, tgt_is_causal=False)
                else:
                    o = model(x, src_key_padding_mask=use_pad)
            # torch's encoder returns zeros at padded rows on its nested path: compare real rows
            outs.append(o.to_padded_tensor(0.0, x.shape) if o.is_nested else o)
        keep = torch.ones(3, 5, 1, dtype=torch.bool) if use_pad is None else ~use_pad[..., None]
        torch.testing.assert_close(outs[1] * keep, outs[0] * keep, rtol=1e-7, atol=1e-7)
    assert len(calls) >= 2 * len(fused) and {id(f) for f in calls} == {id(f) for f in fused}, "FusedMHA was bypassed"


def test_fusedmha_takes_nested_inputs_as_torch_encoder_hands_them():
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randn(n, 16, generator=g, dtype=torch.float64) for n in (5, 3, 4)]
    nt = torch.nested.nested_tensor(seqs)
    m = torch.nn.MultiheadAttention(16, 4, batch_first=True, dtype=torch.float64)
    f = mhakern.FusedMHA(16, 4, batch_first=True, dtype=torch.float64)
    f.load_state_dict(m.state_dict())
    for causal in (False, True):
        out, w = f(nt, nt, nt, need_weights=False, is_causal=causal)
        assert out.is_nested and w is None
        for s, o in zip(seqs, out.unbind()):
            mask = torch.ones(len(s), len(s), dtype=torch.bool).triu(1) if causal else None
            want, _ = m(s[None], s[None], s[None], attn_mask=mask, need_weights=False)
            torch.testing.assert_close(o, want[0], rtol=1e-7, atol=1e-7)
    with pytest.raises(ValueError, match="need_weights=False"):
        f(nt, nt, nt)


@pytest.mark.parametrize("make", [causal_upper_left, causal_lower_right], ids=["upper_left", "lower_right"])
@pytest.mark.parametrize("L,S", [(4, 6), (5, 5)], ids=["wide", "square"])
@pytest.mark.parametrize("extra", [dict(), dict(need_weights=True), dict(padding=True), dict(add_bias_kv=True)],
                         ids=["plain", "weights", "padding", "bias_kv"])
def test_causal_bias_attn_mask_is_the_causal_mask(make, L, S, extra):
    # Before: the bias' uninitialised storage was read as a mask.
    extra = dict(extra)
    bias_kv = extra.pop("add_bias_kv", False)
    torch.manual_seed(0)
    m = torch.nn.MultiheadAttention(16, 4, batch_first=True, dtype=torch.float64, add_bias_kv=bias_kv)
    f = mhakern.FusedMHA(16, 4, batch_first=True, dtype=torch.float64, add_bias_kv=bias_kv)
    f.load_state_dict(m.state_dict())
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, L, 16, generator=g, dtype=torch.float64)
    kv = torch.randn(2, S, 16, generator=g, dtype=torch.float64)
    kw = {"need_weights": extra.get("need_weights", False)}
    if extra.get("padding"):
        kw["key_padding_mask"] = torch.arange(S).view(1, S) >= torch.tensor([[S], [S - 2]])
    bias = make(L, S)
    got, gw = f(q, kv, kv, attn_mask=bias, **kw)
    want, ww = m(q, kv, kv, attn_mask=~bias._materialize(), **kw)  # nn.MHA: True = hidden
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    if kw["need_weights"]:
        torch.testing.assert_close(gw, ww, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "call",
    [
        lambda f: f(torch.randn(2, 5, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 8)),
        lambda f: f(torch.randn(2, 5, 16), torch.randn(2, 6, 16), torch.randn(2, 5, 16)),
        lambda f: f(torch.randn(5, 2, 3, 16), torch.randn(5, 2, 3, 16), torch.randn(5, 2, 3, 16)),
        lambda f: f(torch.randn(2, 5, 16), torch.randn(2, 5, 16), torch.randn(2, 5, 16), key_padding_mask=torch.zeros(2, 4, dtype=torch.bool)),
        lambda f: mhakern.FusedMHA(10, 4),
    ],
    ids=["embed-dim", "key-value-length", "rank", "padding-shape", "divisible"],
)
def test_bad_shapes_are_assertion_errors_as_in_torch(call):
    # Before: ValueError only, where nn.MultiheadAttention raises AssertionError.
    f = mhakern.FusedMHA(16, 4, batch_first=True)
    with pytest.raises(AssertionError) as info:
        call(f)
    assert isinstance(info.value, ValueError)


def test_attn_mask_shape_error_is_a_runtime_error_as_in_torch():
    f = mhakern.FusedMHA(16, 4, batch_first=True)
    x = torch.randn(2, 5, 16)
    with pytest.raises(RuntimeError, match="attn_mask: expected shape"):
        f(x, x, x, attn_mask=torch.zeros(4, 5, dtype=torch.bool))


@pytest.mark.parametrize("same", [True, False], ids=["self", "cross"])
def test_float64_module_with_a_half_in_proj_bias_runs_as_torch(same):
    # Before: "self and mat2 must have the same dtype"; nn.MultiheadAttention promotes the bias.
    torch.manual_seed(0)
    m = torch.nn.MultiheadAttention(16, 4, batch_first=True, dtype=torch.float64)
    f = mhakern.FusedMHA(16, 4, batch_first=True, dtype=torch.float64)
    f.load_state_dict(m.state_dict())
    half_bias = torch.randn(48).half()
    for mod in (m, f):
        mod.in_proj_bias.data = half_bias.clone()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    kv = x if same else torch.randn(2, 6, 16, dtype=torch.float64)
    got, gw = f(x, kv, kv)
    want, ww = m(x, kv, kv)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gw, ww, rtol=1e-6, atol=1e-6)


def test_second_derivatives_through_fusedmha():
    f = mhakern.FusedMHA(8, 2, batch_first=True, dtype=torch.float64, backend="reference")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 3, 8, generator=g, dtype=torch.float64, requires_grad=True)
    # The output and the weights (exp(s - lse), lse float64 for float64 inputs), at
    # gradgradcheck's default tolerances.
    fn = lambda x: f(x, x, x, is_causal=True, need_weights=True)  # noqa: E731
    assert torch.autograd.gradgradcheck(fn, (x,), fast_mode=True)


def test_torchscript_scripts_torchs_module_in_its_place_and_says_so():
    # torch.jit.script cannot compile FusedMHA's forward. Where nn.MultiheadAttention computes
    # the same function, that module is scripted instead, sharing FusedMHA's parameters, with a
    # warning; the scripted module gives FusedMHA's outputs (alone and inside a torch layer).
    torch.manual_seed(0)
    mha = mhakern.FusedMHA(16, 2, kdim=12, vdim=8, batch_first=True)
    q, k, v = torch.randn(2, 5, 16), torch.randn(2, 7, 12), torch.randn(2, 7, 8)
    with pytest.warns(UserWarning, match="torch.nn.MultiheadAttention with the same parameters is scripted"):
        scripted = torch.jit.script(mha)
    got, _ = scripted(q, k, v, need_weights=False)
    want, _ = mha(q, k, v, need_weights=False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        mha.out_proj.weight.mul_(2)  # shared, not copied
    torch.testing.assert_close(scripted(q, k, v, need_weights=False)[0], mha(q, k, v, need_weights=False)[0],
                               rtol=1e-5, atol=1e-6)
    layer = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
    layer.self_attn = mhakern.FusedMHA(16, 2, batch_first=True)
    x = torch.randn(2, 5, 16)
    with pytest.warns(UserWarning):
        torch.testing.assert_close(torch.jit.script(layer)(x), layer(x), rtol=1e-5, atol=1e-6)


def test_torchscript_is_refused_in_one_line_where_torch_has_no_equal():
    # GQA or a head dim of its own: no torch module computes it; the refusal names the ways
    # that run FusedMHA's kernels.
    for m in (mhakern.FusedMHA(16, 4, num_kv_heads=2), mhakern.FusedMHA(16, 2, head_dim=4)):
        with pytest.raises(RuntimeError, match="cannot be compiled by TorchScript"):
            torch.jit.script(m)


# ---------------------------------------------------------------------------------------------
# Score modifiers: softcap, ALiBi slopes, learnable sinks


def _manual_mha(m, x, causal):
    """mhakern.FusedMHA(softcap, alibi, sinks)'s function written out from its parameters (float64)."""
    N, L, E = x.shape
    H, hd = m.num_heads, m.head_dim
    q, k, v = torch.nn.functional.linear(x, m.in_proj_weight, m.in_proj_bias).split(E, dim=-1)
    q, k, v = (t.view(N, L, H, hd).transpose(1, 2) for t in (q, k, v))
    s = q @ k.transpose(-1, -2) / math.sqrt(hd)
    s = m.softcap * torch.tanh(s / m.softcap)
    i = torch.arange(L, dtype=torch.float64)
    s = s - m.alibi_slopes.double().view(1, H, 1, 1) * (i.view(L, 1) - i.view(1, L)).abs()
    if causal:
        s = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), -math.inf)
    z = torch.cat([s, m.sinks.view(1, H, 1, 1).expand(N, H, L, 1)], dim=-1)
    p = torch.softmax(z, dim=-1)[..., :L]
    o = (p @ v).transpose(1, 2).reshape(N, L, E)
    return m.out_proj(o), p


@pytest.mark.parametrize("causal", [False, True])
def test_fused_mha_modifiers_match_their_formula_forward_and_backward(causal):
    torch.manual_seed(0)
    m = mhakern.FusedMHA(16, 2, batch_first=True, softcap=2.0, alibi=True, sinks=True, backend="reference",
                 dtype=torch.float64)
    with torch.no_grad():
        m.sinks.copy_(torch.tensor([0.5, -1.0]))
    assert torch.equal(m.alibi_slopes, torch.tensor([2.0 ** -4, 2.0 ** -8]))  # 2^(-8 (h + 1) / H)
    assert "sinks" in m.state_dict() and "alibi_slopes" not in m.state_dict()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    out, w = m(x, x, x, is_causal=causal, need_weights=True, average_attn_weights=False)
    (out.sum() + w.sum()).backward()
    got = [p.grad.clone() for p in (m.sinks, m.in_proj_weight)]
    m.zero_grad()
    ref, p = _manual_mha(m, x, causal)
    (ref.sum() + p.sum()).backward()
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)  # lse float64 (the contract)
    torch.testing.assert_close(w, p, rtol=1e-12, atol=1e-12)
    for a, b in zip(got, (m.sinks.grad, m.in_proj_weight.grad)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_fused_mha_given_slopes_and_bad_options_name_the_option():
    m = mhakern.FusedMHA(8, 2, alibi=torch.tensor([0.5, 0.25], dtype=torch.float64))
    assert m.alibi_slopes.dtype == torch.float32 and m.alibi_slopes.tolist() == [0.5, 0.25]
    assert "alibi=True" in repr(m)
    for kw, exc, word in ((dict(softcap=0.0), ValueError, "softcap"), (dict(softcap=float("nan")), ValueError, "softcap"),
                          (dict(alibi=torch.ones(3)), ValueError, "alibi"), (dict(alibi="yes"), TypeError, "alibi"),
                          (dict(sinks=1), TypeError, "sinks")):
        with pytest.raises(exc, match=word):
            mhakern.FusedMHA(8, 2, **kw)


def test_user_hooks_run_and_fusedmha_keeps_its_own_hooks_empty():
    # The sign torch's encoder reads (a hook on a child that is never called) leaves FusedMHA's
    # own hooks empty, so nn.Module.__call__ keeps its no-hook path; a user's hook runs, also
    # after a copy.
    import copy

    m = mhakern.FusedMHA(8, 2, batch_first=True)
    assert len(m._forward_pre_hooks) == 0 and type(m._forward_pre_hooks) is collections.OrderedDict
    assert any(len(c._forward_pre_hooks) for c in m.modules())
    seen = []
    handle = m.register_forward_pre_hook(lambda mod, args: seen.append(mod))
    x = torch.randn(1, 3, 8)
    m(x, x, x)
    copy.deepcopy(m)(x, x, x)
    assert len(seen) == 2
    handle.remove()
    assert len(m._forward_pre_hooks) == 0
