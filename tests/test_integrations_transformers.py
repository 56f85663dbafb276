"""mhakern.integrations.transformers: tiny random models from configs, "mhakern" against "sdpa".

Each model is built twice from one config on the same weights, once per implementation, and
compared on logits and parameter gradients at the real (non-padding) positions, with right and
left padding; greedy generate() must give SDPA's tokens; a packed batch (position_ids restarting
at 0) must give the padded batch's logits and gradients. Oracle and tolerance (the contract's
rule, at model level): float64 SDPA; the float32 "cpu" backend may be off by at most twice
float32 SDPA's own error plus 1e-5 (3x for gradients); the float64 "reference" backend by 1e-10
in the logits, and in the gradients by 1e-10 of their largest magnitude (float64 throughout, lse
included: docs/contract.md, "Shapes and layout").
No network: configs only, random input ids.
"""
import copy
import pathlib
import sys

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", minversion="5.4.0",
    reason="transformers>=5.4.0 is not installed (pip install 'mhakern[transformers]')",
)

import mhakern  # noqa: E402
import mhakern.backends  # noqa: E402
import mhakern.integrations.transformers as mkt  # noqa: E402
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM  # noqa: E402
from transformers import masking_utils as mu  # noqa: E402

V = 128
SMALL = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64)


def _configs():
    from transformers import BertConfig, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    return {
        "llama": (LlamaConfig(**SMALL, num_key_value_heads=2), AutoModelForCausalLM),
        "mistral": (MistralConfig(**SMALL, num_key_value_heads=2, sliding_window=4), AutoModelForCausalLM),
        "gpt2": (GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64), AutoModelForCausalLM),
        "bert": (BertConfig(**SMALL), AutoModelForMaskedLM),
        "qwen2": (Qwen2Config(**SMALL, num_key_value_heads=1, use_sliding_window=True, sliding_window=4,
                              max_window_layers=1), AutoModelForCausalLM),
    }


@pytest.fixture(scope="module", autouse=True)
def registered():
    mkt.register()
    yield
    mkt.register("auto")


def _pair(name, dtype, backend):
    cfg, auto = _configs()[name]
    torch.manual_seed(0)
    ref = auto.from_config(copy.deepcopy(cfg), attn_implementation="sdpa", dtype=dtype).eval()
    mine = auto.from_config(copy.deepcopy(cfg), attn_implementation="mhakern", dtype=dtype).eval()
    mine.load_state_dict(ref.state_dict())
    mkt.register(backend)
    return ref, mine


def _batch(padding, B=3, L=9):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, V, (B, L), generator=g)
    lengths = torch.tensor([L, 6, 4])
    real = torch.arange(L)[None, :] < lengths[:, None]
    if padding == "left":
        real = real.flip(-1)
    return ids, real.long(), real


def _logits_and_grads(model, ids, mask, real, **kw):
    model.zero_grad(set_to_none=True)
    logits = model(ids, attention_mask=mask, **kw).logits
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(logits.dtype)
    (logits * w)[real].sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach()[real], grads


def _err(a, b):
    return (a.double() - b.double()).abs().max().item()


def _grad_tol64(g):
    # relative to the largest gradient: see the module docstring
    return 1e-10 * g.abs().max().item() + 1e-12


MODELS = ["llama", "mistral", "gpt2", "bert", "qwen2"]


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("name", MODELS)
def test_logits_and_gradients_match_sdpa(name, padding):
    ids, mask, real = _batch(padding)
    ref64, mine64 = _pair(name, torch.float64, "reference")
    l64, g64 = _logits_and_grads(ref64, ids, mask, real)
    m64, gm64 = _logits_and_grads(mine64, ids, mask, real)
    assert _err(m64, l64) <= 1e-10
    assert g64.keys() == gm64.keys()
    for n in g64:
        assert _err(gm64[n], g64[n]) <= _grad_tol64(g64[n]), n

    ref32, mine32 = _pair(name, torch.float32, "cpu")
    l32, g32 = _logits_and_grads(ref32, ids, mask, real)
    m32, gm32 = _logits_and_grads(mine32, ids, mask, real)
    assert _err(m32, l64) <= 2 * _err(l32, l64) + 1e-5
    for n in g64:
        assert _err(gm32[n], g64[n]) <= 3 * _err(g32[n], g64[n]) + 1e-5, n


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "gpt2"])
def test_generate_gives_sdpa_tokens(name):
    # Left padding (as generation wants) and a prompt + 10 new tokens longer than the sliding
    # window (4): decode steps use the bottom-right alignment and the sliding cache.
    ids, mask, _ = _batch("left", L=7)
    ref, mine = _pair(name, torch.float32, "cpu")
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(mine.generate(ids, **kw), ref.generate(ids, **kw))


def test_generate_with_a_static_cache():
    # A static cache holds more key slots than tokens seen: queries sit at the cache position,
    # neither top-left nor bottom-right of the keys (key_lengths = position + 1 align them).
    ids, mask, _ = _batch("left", L=7)
    ref, mine = _pair("llama", torch.float32, "cpu")
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation="static")
    assert torch.equal(mine.generate(ids, **kw), ref.generate(ids, **kw))
    vis = mkt.mask_interface(1, 1, 16, q_offset=5, mask_function=mu.causal_mask_function,
                             attention_mask=torch.ones(1, 6, dtype=torch.bool))
    assert vis.causal_align == "bottom_right" and vis.key_lengths.tolist() == [6] and vis.attn_mask is None


class _NoVarlen(mhakern.backends.Backend):
    """The reference's kernels under a non-fallback name, without packed sequences: a stand-in
    for a fast backend that lacks "varlen"."""

    name = "no_varlen"
    priority = 100  # above every built-in: "auto" picks it for the dense calls
    features = mhakern.backends.ALL_FEATURES - {"varlen"}

    def forward(self, *args, **kw):
        return mhakern.backends.get("reference").forward(*args, **kw)

    def backward(self, *args, **kw):
        return mhakern.backends.get("reference").backward(*args, **kw)


@pytest.fixture
def entry_points(monkeypatch):
    """The names of the mhakern entry points the integration calls, in order."""
    calls = []
    for name in ("attention", "attention_varlen"):
        def spy(*args, _fn=getattr(mhakern, name), _name=name, **kw):
            calls.append(_name)
            return _fn(*args, **kw)
        monkeypatch.setattr(mhakern, name, spy)
    return calls


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_packed_matches_padded(name, entry_points):
    # Three sequences (9, 6, 4 tokens) packed in one row, positions restarting at 0, no mask:
    # block-diagonal causal attention (Mistral: and its window of 4); must equal the
    # right-padded batch at its real tokens, through attention_varlen in every layer, whichever
    # way the packing reaches the integration: position_ids with a cache object (the attention
    # call finds it), without one (transformers' mask function), a flattening collator's
    # cu_seq_lens. A backend without "varlen" gets the packing's mask instead, named or picked
    # by "auto".
    ids, mask, real = _batch("right")
    lengths = real.sum(-1).tolist()
    packed = torch.cat([ids[b, :n] for b, n in enumerate(lengths)])[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    ref, mine64 = _pair(name, torch.float64, "reference")
    mine = mine64
    pad_logits, pad_grads = _logits_and_grads(mine, ids, mask, real)
    layers = len(mine.model.layers)

    def packed_run(**kw):
        mine.zero_grad(set_to_none=True)
        entry_points.clear()
        logits = mine(packed, position_ids=pos, **kw).logits[0]
        w = torch.randn((3, 9, V), generator=torch.Generator().manual_seed(2), dtype=torch.float64)[real]
        (logits * w).sum().backward()
        return logits.detach(), {n: p.grad.detach().clone() for n, p in mine.named_parameters() if p.grad is not None}

    def check(logits, grads):
        assert _err(logits, pad_logits) <= 1e-10
        for n in pad_grads:
            assert _err(grads[n], pad_grads[n]) <= _grad_tol64(pad_grads[n]), n

    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32)
    for kw in ({}, dict(use_cache=False), dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=9, max_length_k=9)):
        check(*packed_run(**kw))
        assert entry_points == ["attention_varlen"] * layers, kw
    # The cpu kernels' varlen path in float32, held to the contract's rule against float64
    ref32, mine32 = _pair(name, torch.float32, "cpu")
    l32, g32 = _logits_and_grads(ref32, ids, mask, real)
    mine = mine32
    m32, gm32 = packed_run()
    assert entry_points == ["attention_varlen"] * layers and mhakern.last_backend() == "cpu"
    assert _err(m32, pad_logits) <= 2 * _err(l32, pad_logits) + 1e-5
    for n in pad_grads:
        assert _err(gm32[n], pad_grads[n]) <= 3 * _err(g32[n], pad_grads[n]) + 1e-5, n
    mine = mine64
    mkt.register("reference")
    be = mhakern.backends.register(_NoVarlen())
    try:
        for backend in ("no_varlen", "auto"):
            mkt.register(backend)
            check(*packed_run())
            assert entry_points == ["attention"] * layers, backend
    finally:
        del mhakern.backends._REGISTRY[be.name]
        mhakern.backends._ORDER = None
        mhakern.backends.clear_dispatch_cache()
    # and the padded batch itself is SDPA's
    sdpa_logits, _ = _logits_and_grads(ref, ids, mask, real)
    assert _err(pad_logits, sdpa_logits) <= 1e-10


def test_cu_seq_lens_reach_varlen_with_the_models_options_and_refusals_name_them(entry_points):
    # A padding-free collator's cu_seq_lens (an empty sequence among them), without position_ids
    # showing the packing, keep the sequences apart through attention_varlen with the sliding
    # window, GQA, softcap and sinks: each sequence as its own dense call. What cannot be taken
    # is refused naming the option.
    mkt.register("auto")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 9, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 9, 8, generator=g, dtype=torch.float64) for _ in range(2))
    cu = torch.tensor([0, 3, 3, 9], dtype=torch.int32)
    sinks = torch.tensor([0.5, -1.0, 0.0, 2.0], dtype=torch.float64)
    vis = mkt.mask_interface(1, 9, 9, mask_function=mu.sliding_window_causal_mask_function(4), local_size=4)
    module = torch.nn.Module()
    out, _ = mkt.attention_forward(module, q, k, v, vis, softcap=2.0, s_aux=sinks, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    assert entry_points == ["attention_varlen"]
    parts = [mhakern.attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], causal=True, window=(3, 0), softcap=2.0,
                               sinks=sinks, backend="reference") for a, b in ((0, 3), (3, 9))]
    assert _err(out, torch.cat(parts, 2).transpose(1, 2)) <= 1e-12
    with pytest.raises(ValueError, match="head_mask"):
        mkt.attention_forward(module, q, k, v, vis, head_mask=torch.ones(4))
    with pytest.raises(ValueError, match="cu_seq_lens_q, cu_seq_lens_k: give both"):
        mkt.attention_forward(module, q, k, v, vis, cu_seq_lens_q=cu)
    with pytest.raises(ValueError, match=r"cu_seq_lens_q, cu_seq_lens_k: must end at .*\(9, 9\)"):
        bad = torch.tensor([0, 3, 8], dtype=torch.int32)
        mkt.attention_forward(module, q, k, v, vis, cu_seq_lens_q=bad, cu_seq_lens_k=bad)
    two = [x.expand(2, -1, -1, -1) for x in (q, k, v)]
    with pytest.raises(ValueError, match="cu_seq_lens_q: packed sequences need a batch of one row, got 2"):
        mkt.attention_forward(module, *two, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    with pytest.raises(ValueError, match=r"position_ids: expected shape \(2 or 1, 9\)"):
        mkt.attention_forward(module, *two, None, position_ids=torch.zeros(3, 9, dtype=torch.long))


def test_mask_fast_paths():
    # Right padding -> key_lengths; left padding -> a (B, 1, 1, Lk) mask; decode -> bottom-right;
    # sliding windows -> window; causal blocks (chunked attention) -> packed sequences; anything
    # else -> transformers' full mask.
    real = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    vis = mkt.mask_interface(2, 4, 4, mask_function=mu.causal_mask_function, attention_mask=real)
    assert vis.causal and vis.causal_align == "top_left" and vis.attn_mask is None
    assert vis.key_lengths.tolist() == [4, 2]
    vis = mkt.mask_interface(2, 4, 4, mask_function=mu.causal_mask_function, attention_mask=real.flip(-1))
    assert vis.key_lengths is None and vis.attn_mask.shape == (2, 1, 1, 4)
    vis = mkt.mask_interface(2, 1, 5, q_offset=4, mask_function=mu.causal_mask_function,
                             attention_mask=torch.ones(2, 5, dtype=torch.bool))
    assert vis.causal and vis.causal_align == "bottom_right" and vis.attn_mask is None and vis.key_lengths is None
    # no padding mask (generate() without one): the same, by the shortcut; a static cache's
    # unwritten tail (queries not the keys' suffix) is not the shortcut's case
    vis = mkt.mask_interface(2, 1, 5, q_offset=4, mask_function=mu.causal_mask_function)
    assert (vis.causal, vis.causal_align, vis.window, vis.attn_mask, vis.key_lengths) == (
        True, "bottom_right", None, None, None) and (vis.q_length, vis.kv_length) == (1, 5)
    vis = mkt.mask_interface(2, 1, 8, q_offset=3, mask_function=mu.causal_mask_function)
    assert vis.causal and vis.causal_align == "bottom_right" and vis.key_lengths.tolist() == [4, 4]
    vis = mkt.mask_interface(2, 6, 6, mask_function=mu.sliding_window_causal_mask_function(3), local_size=3)
    assert vis.causal and vis.window == (2, 0) and vis.attn_mask is None
    chunked = mu.chunked_causal_mask_function(3, torch.zeros(2, dtype=torch.long))
    vis = mkt.mask_interface(2, 7, 7, mask_function=chunked, local_size=3)
    want = mu.sdpa_mask(2, 7, 7, mask_function=chunked, allow_is_causal_skip=False)
    assert vis.causal and vis.window is None and vis.attn_mask is None
    assert vis.packing.cu_q.tolist() == [0, 3, 6, 7, 10, 13, 14] and vis.packing.max_q == 3
    assert torch.equal(vis.packing.mask(True, None), want)
    extra = mu.or_masks(mu.causal_mask_function, lambda b, h, q, kv: (q == 4) & (kv == 6))
    vis = mkt.mask_interface(2, 7, 7, mask_function=extra)
    want = mu.sdpa_mask(2, 7, 7, mask_function=extra, allow_is_causal_skip=False)
    assert vis.packing is None and not vis.causal and torch.equal(vis.attn_mask, want)


def test_dropout_reaches_mhakern():
    # Training-mode attention dropout goes to mhakern: the keep mask is the contract's hash of
    # one seed, so the cpu and reference backends drop the same positions.
    from transformers import LlamaConfig

    cfg = LlamaConfig(**SMALL, num_key_value_heads=2, attention_dropout=0.5)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="mhakern").train()
    ids = torch.randint(1, V, (2, 8), generator=torch.Generator().manual_seed(1))
    outs = []
    for backend in ("cpu", "reference"):
        mkt.register(backend)
        torch.manual_seed(5)
        outs.append(model(ids).logits)
    model.eval()
    assert _err(outs[0], outs[1]) <= 1e-4
    assert _err(outs[0], model(ids).logits) > 1e-2


def test_gemma2_softcap_matches_eager():
    # Gemma 2 caps its logits (softcap = config.attn_logit_softcapping): mhakern's softcap.
    from transformers import Gemma2Config

    cfg = Gemma2Config(**SMALL, num_key_value_heads=2, head_dim=8, attn_logit_softcapping=0.05, sliding_window=4,
                       query_pre_attn_scalar=8)
    mkt.register("reference")  # the backend serving softcap on every branch
    try:
        torch.manual_seed(0)
        ours = AutoModelForCausalLM.from_config(cfg, attn_implementation="mhakern").eval()
        theirs = copy.deepcopy(ours)
        theirs.config._attn_implementation = "eager"
        ids = torch.randint(1, V, (2, 7), generator=torch.Generator().manual_seed(1))
        assert _err(ours(ids).logits, theirs(ids).logits) <= 1e-4
        cfg_bad = copy.deepcopy(cfg)
        cfg_bad.attn_logit_softcapping = -1.0
        bad = AutoModelForCausalLM.from_config(cfg_bad, attn_implementation="mhakern")
        with pytest.raises(ValueError, match=r"softcap=-1\.0.*config\.attn_logit_softcapping"):
            bad(ids)
    finally:
        mkt.register("auto")


def test_sinks_from_s_aux_match_the_eager_formula_with_their_gradient():
    # gpt-oss passes its learned per-head sinks as s_aux: a score column with no value.
    class WithSinks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sinks = torch.nn.Parameter(torch.tensor([0.5, -1.0]))

    module = WithSinks()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, L, 4, generator=g, dtype=torch.float64) for L in (3, 5, 5))
    out, _ = mkt.attention_forward(module, q, k, v, None, s_aux=module.sinks, is_causal=False)
    out.sum().backward()
    sinks = module.sinks.detach().clone().double().requires_grad_()
    s = q @ k.transpose(-1, -2) * 0.5
    z = torch.cat([s, sinks.view(1, 2, 1, 1).expand(1, 2, 3, 1)], dim=-1)
    ref = (torch.softmax(z, -1)[..., :5] @ v).transpose(1, 2)
    ref.sum().backward()
    torch.testing.assert_close(out, ref.to(out.dtype))
    torch.testing.assert_close(module.sinks.grad.double(), sinks.grad, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"sinks \(s_aux, WithSinks's s_aux\).*\(2,\)"):
        mkt.attention_forward(module, q, k, v, None, s_aux=torch.zeros(3))


def test_t5_position_bias_matches_sdpa():
    # T5's learned relative position bias is an additive mask that mhakern differentiates.
    from transformers import AutoModelForSeq2SeqLM, T5Config

    cfg = T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                   relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0)
    ids, mask, real = _batch("right")
    dec = torch.randint(1, V, (3, 5), generator=torch.Generator().manual_seed(3))
    runs = []
    for impl, backend in (("sdpa", "cpu"), ("mhakern", "reference")):
        torch.manual_seed(0)
        model = AutoModelForSeq2SeqLM.from_config(copy.deepcopy(cfg), attn_implementation=impl,
                                                  dtype=torch.float64).eval()
        if runs:
            model.load_state_dict(runs[0][2])
        mkt.register(backend)
        logits = model(ids, attention_mask=mask, decoder_input_ids=dec).logits
        w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        (logits * w).sum().backward()
        runs.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
                     model.state_dict()))
    (l0, g0, _), (l1, g1, _) = runs
    assert _err(l1, l0) <= 1e-10
    assert g0.keys() == g1.keys() and any("relative_attention_bias" in n for n in g0)
    for n in g0:
        assert _err(g1[n], g0[n]) <= _grad_tol64(g0[n]), n


def test_register_is_idempotent_and_extra_pins_the_checked_version():
    mkt.register()
    mkt.register()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert AttentionInterface._global_mapping[mkt.NAME] is mkt.attention_forward
    assert AttentionMaskInterface._global_mapping[mkt.NAME] is mkt.mask_interface
    with pytest.raises(ValueError, match="backend"):
        mkt.register("no-such-backend")
    if sys.version_info >= (3, 11):
        import tomllib

        root = pathlib.Path(__file__).resolve().parents[1]
        extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        pin = f"transformers>={mkt.MIN_TRANSFORMERS}"
        assert extras["transformers"] == [pin]
        assert pin in extras["test"]


def test_plain_layer_calls_take_the_checked_once_path(monkeypatch):
    # A decode step (one query, bottom-right causal: every key), a prefill without padding and a
    # non-causal call go through routing.plain_nograd (twice each: the first call checks, the second
    # is the remembered signature); a top-left causal single query sees key 0 only and must not
    # be read as the plain call. GQA (4 query heads over 2), q in transformers' (B, L, H, D) memory.
    g = torch.Generator().manual_seed(3)
    k, v = (torch.randn(1, 2, 6, 8, generator=g) for _ in range(2))
    kr, vr = (x.double().repeat_interleave(2, dim=1) for x in (k, v))
    served = []
    plain = mkt.plain_nograd

    def spy(*a, **kw):
        out = plain(*a, **kw)
        served.append(out is not None)
        return out

    monkeypatch.setattr(mkt, "plain_nograd", spy)
    for Lq, causal, align, plain_expected in [(1, True, "bottom_right", True), (6, True, "top_left", True),
                                              (2, False, "top_left", True), (1, True, "top_left", False)]:
        q = torch.randn(1, Lq, 4, 8, generator=g).transpose(1, 2)
        off = 6 - Lq if align == "bottom_right" else 0
        seen = torch.arange(6)[None, :] <= torch.arange(Lq)[:, None] + off if causal else torch.ones(Lq, 6, dtype=bool)
        s = (q.double() @ kr.transpose(-1, -2) / 8 ** 0.5).masked_fill(~seen, float("-inf"))
        ref = (torch.softmax(s, -1) @ vr).transpose(1, 2)
        own = (torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), attn_mask=seen).transpose(1, 2) - ref)
        vis = mkt.Visibility(causal, align, None, None, None, Lq, 6)
        # a decode step's position_ids change nothing; a longer call's may mean packed rows (full path)
        extra = dict(position_ids=torch.tensor([[5]])) if Lq == 1 else {}
        served.clear()
        for _ in range(2):
            with torch.no_grad():
                out, _ = mkt.attention_forward(None, q, k, v, vis, use_cache=True, **extra)
            assert out.shape == (1, Lq, 4, 8) and out.is_contiguous()
            assert _err(out, ref) <= 2 * own.abs().max().item() + 1e-5, (Lq, causal, align)
        assert served == [plain_expected] * 2 if plain_expected else served == [], (Lq, causal, align, served)


@pytest.mark.parametrize("pad", ["left", "right"])
def test_layers_of_one_forward_reuse_the_first_layers_preparation(pad, monkeypatch):
    # Issue 31 item 8: a padded decode step's layers shared one Visibility but each ran all of
    # attention()'s checks and mode handling again. Now the first prepares, the others reuse
    # it when q, k, v have its signature; every layer's output stays attention()'s.
    B, H, Hkv, Lk, D = 3, 4, 2, 9, 16
    real = torch.ones(B, Lk, dtype=torch.bool)
    real[1, :3] = real[2, :5] = False
    if pad == "right":
        real = real.flip(-1)
    vis = mkt.mask_interface(B, 1, Lk, q_offset=Lk - 1, mask_function=mu.causal_mask_function, attention_mask=real)
    assert vis.attn_mask is not None and vis.prepared is None
    module = torch.nn.Module()
    g = torch.Generator().manual_seed(0)

    def layer_inputs(blhd=False):
        q = torch.randn(B, 1, H, D, generator=g).transpose(1, 2) if blhd else torch.randn(B, H, 1, D, generator=g)
        return q, torch.randn(B, Hkv, Lk, D, generator=g), torch.randn(B, Hkv, Lk, D, generator=g)

    prepared = []
    real_prepare = mkt.prepare_nograd
    monkeypatch.setattr(mkt, "prepare_nograd", lambda *a, **kw: prepared.append(1) or real_prepare(*a, **kw))
    want_kw = dict(attn_mask=vis.attn_mask, key_lengths=vis.key_lengths, causal=True, scale=0.3)
    with torch.no_grad():
        for i, blhd in enumerate((False, False, True, True)):  # a new signature is prepared anew
            q, k, v = layer_inputs(blhd)
            out, _ = mkt.attention_forward(module, q, k, v, vis, scaling=0.3)
            want = mhakern.attention(q, k, v, **want_kw).transpose(1, 2)
            torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
            assert vis.prepared is not None and vis.prepared[0][5] == q.stride()
            assert len(prepared) == 1 + (i >= 2), "a layer of the same signature prepared its call again"
    # A call that needs a gradient takes attention()'s own path (no memo involved).
    q, k, v = (x.requires_grad_() for x in layer_inputs())
    out, _ = mkt.attention_forward(module, q, k, v, vis, scaling=0.3)
    out.sum().backward()
    assert q.grad is not None and k.grad.abs().sum() > 0
