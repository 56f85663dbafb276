"""transformers ``generate()`` with ``attn_implementation="mhakern"`` against ``"sdpa"`` on the CPU.

Issue 22's target: ``generate()`` of 64 tokens on a tiny Llama at most 1.0x SDPA's time, and a
decode attention call at most 10 us more than SDPA's. Three figures, each interleaved with its
peer round by round (the machine is shared and noisy; only ratios of one run mean anything):

1. ``generate``: greedy ``generate()`` of 64 new tokens from an 8-token prompt, batch 1, on one
   tiny Llama (GQA) whose weights both implementations share.
2. ``generate_sdpa_dropin``: the same ``generate()`` of the ``"sdpa"`` model, with
   ``torch.nn.functional.scaled_dot_product_attention`` as torch has it against patched to
   ``mhakern.scaled_dot_product_attention`` (the SDPA drop-in; the same greedy tokens).
3. ``decode_call``: one layer's attention call in a decode step (batch 1, 4 query heads over 2
   KV heads, 1 query, 72 keys, head dim 16): transformers' ``sdpa_attention_forward`` with the
   mask SDPA gets (None) against this integration's ``attention_forward`` with the Visibility
   its mask function returns for that step, and the bare ``mhakern.attention`` call for scale.
4. ``sdpa_dropin_call``: that decode call's SDPA call itself (``enable_gqa``, the layer's scale,
   no mask), torch's ``scaled_dot_product_attention`` against mhakern's drop-in, and
   transformers' ``sdpa_attention_forward`` with SDPA patched to the drop-in.
5. ``mask``: the mask function of one decode step (``sdpa_mask`` against ``mask_interface``).

    python benchmarks/bench_transformers_generate.py [--rounds 15] [--threads N] [--profile]

``--profile`` adds a cProfile of the mhakern decode call (where its per-call time goes).
``--split`` adds, for ``generate_sdpa_dropin``, the time spent inside the SDPA function during
one ``generate()`` (torch's against the drop-in, interleaved) and the rest: in a real decode
loop the caches are cold, and a call costs more than in the ``sdpa_dropin_call`` loop.
``--split-integration`` does the same for ``generate``: the time inside the layers' attention
functions (transformers' ``sdpa_attention_forward`` against this integration's) and inside the
mask functions (``sdpa_mask`` against ``mask_interface``), and the rest.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from typing import Callable, Dict

import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mhakern  # noqa: E402


def _models(backend: str):
    from transformers import AutoModelForCausalLM, LlamaConfig

    import mhakern.integrations.transformers as mkt

    mkt.register(backend)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    sdpa = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa").eval()
    mine = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="mhakern").eval()
    mine.load_state_dict(sdpa.state_dict())
    return sdpa, mine


_TORCH_SDPA = F.scaled_dot_product_attention


def _sdpa_dropin(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` run with torch.nn.functional.scaled_dot_product_attention patched to mhakern's drop-in
    (transformers' SDPA path looks the function up on every call)."""
    def run():
        F.scaled_dot_product_attention = mhakern.scaled_dot_product_attention
        try:
            return fn()
        finally:
            F.scaled_dot_product_attention = _TORCH_SDPA
    return run


def targets(backend: str = "cpu") -> Dict[str, Dict[str, Callable[[], object]]]:
    from transformers import masking_utils as mu
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    import mhakern.integrations.transformers as mkt

    sdpa, mine = _models(backend)
    ids = torch.randint(1, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0)
    a, b = sdpa.generate(ids, **kw), mine.generate(ids, **kw)
    if not torch.equal(a, b):
        raise AssertionError("mhakern's greedy tokens differ from SDPA's")
    if not torch.equal(a, _sdpa_dropin(lambda: sdpa.generate(ids, **kw))()):
        raise AssertionError("the greedy tokens with SDPA patched to mhakern's drop-in differ from SDPA's")

    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 1, 4, 16, generator=g).transpose(1, 2)  # (B, H, 1, D) over (B, L, H, D) memory
    k, v = (torch.randn(1, 2, 72, 16, generator=g) for _ in range(2))
    module = mine.model.layers[0].self_attn
    am = torch.ones(1, 72, dtype=torch.bool)
    vis = mkt.mask_interface(1, 1, 72, q_offset=71, mask_function=mu.causal_mask_function, attention_mask=am)
    scaling = module.scaling
    # what a Llama layer passes in a decode step
    extra = dict(dropout=0.0, scaling=scaling, position_ids=torch.tensor([[71]]), use_cache=True)
    with torch.no_grad():
        ref = sdpa_attention_forward(module, q, k, v, None, scaling=scaling)[0]
        got = mkt.attention_forward(module, q, k, v, vis, scaling=scaling)[0]
        assert (ref - got).abs().max().item() < 1e-5
    no_grad = torch.no_grad

    def call(fn):
        def run():
            with no_grad():
                fn()
        return run

    return {
        "generate": {
            "sdpa": lambda: sdpa.generate(ids, **kw),
            "mhakern": lambda: mine.generate(ids, **kw),
        },
        "generate_sdpa_dropin": {
            "sdpa": lambda: sdpa.generate(ids, **kw),
            "mhakern sdpa drop-in": _sdpa_dropin(lambda: sdpa.generate(ids, **kw)),
        },
        "decode_call": {
            "sdpa": call(lambda: sdpa_attention_forward(module, q, k, v, None, **extra)),
            "mhakern": call(lambda: mkt.attention_forward(module, q, k, v, vis, **extra)),
            "bare mhakern.attention": call(lambda: mhakern.attention(q, k, v, causal=True, scale=scaling,
                                                                     backend=backend)),
        },
        "sdpa_dropin_call": {
            "sdpa": call(lambda: F.scaled_dot_product_attention(q, k, v, scale=scaling, enable_gqa=True)),
            "mhakern sdpa drop-in": call(lambda: mhakern.scaled_dot_product_attention(q, k, v, scale=scaling,
                                                                                      enable_gqa=True)),
            "sdpa_attention_forward, patched": call(_sdpa_dropin(
                lambda: sdpa_attention_forward(module, q, k, v, None, **extra))),
        },
        "mask": {
            "sdpa": lambda: mu.sdpa_mask(1, 1, 72, q_offset=71, mask_function=mu.causal_mask_function,
                                         attention_mask=am),
            "mhakern": lambda: mkt.mask_interface(1, 1, 72, q_offset=71, mask_function=mu.causal_mask_function,
                                                  attention_mask=am),
        },
    }


def split_generate(rounds: int) -> Dict[str, tuple]:
    """Per SDPA function (torch's, mhakern's drop-in): the seconds of each round's ``generate()``
    and of the SDPA calls inside it, rounds interleaved."""
    sdpa, _ = _models("cpu")
    ids = torch.randint(1, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0)
    spent = [0.0]

    def timed(fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[0] += time.perf_counter() - t0
        return run

    fns = {"sdpa": timed(_TORCH_SDPA), "mhakern sdpa drop-in": timed(mhakern.scaled_dot_product_attention)}
    out = {p: ([], []) for p in fns}
    try:
        for r in range(rounds + 1):  # round 0: warm-up
            for p, fn in fns.items():
                F.scaled_dot_product_attention = fn
                spent[0] = 0.0
                t0 = time.perf_counter()
                sdpa.generate(ids, **kw)
                if r:
                    out[p][0].append(time.perf_counter() - t0)
                    out[p][1].append(spent[0])
    finally:
        F.scaled_dot_product_attention = _TORCH_SDPA
    return out


def split_generate_integration(rounds: int) -> Dict[str, tuple]:
    """Per implementation ("sdpa": transformers' sdpa_attention_forward and sdpa_mask; "mhakern":
    this integration's attention_forward and mask_interface): the seconds of each round's
    ``generate()``, of the layers' attention calls inside it and of its mask-function calls (and
    a one-item list: the attention calls of one ``generate()``),
    rounds interleaved. The functions are looked up by name on every call, so a timed wrapper
    registered under the same name sees each call."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    sdpa, mine = _models("cpu")
    ids = torch.randint(1, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0)
    spent = {"attention": 0.0, "mask": 0.0}
    calls = [0]

    def timed(fn, part):
        def run(*a, **k):
            calls[0] += part == "attention"
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[part] += time.perf_counter() - t0
        return run

    maps = (AttentionInterface._global_mapping, AttentionMaskInterface._global_mapping)
    saved = {name: (maps[0][name], maps[1][name]) for name in ("sdpa", "mhakern")}
    models = {"sdpa": sdpa, "mhakern": mine}
    out = {p: ([], [], [], calls) for p in models}
    try:
        for name, (attn, mask) in saved.items():
            maps[0][name], maps[1][name] = timed(attn, "attention"), timed(mask, "mask")
        for r in range(rounds + 1):  # round 0: warm-up
            for p, model in models.items():
                spent.update(attention=0.0, mask=0.0)
                calls[0] = 0
                t0 = time.perf_counter()
                model.generate(ids, **kw)
                if r:
                    out[p][0].append(time.perf_counter() - t0)
                    out[p][1].append(spent["attention"])
                    out[p][2].append(spent["mask"])
    finally:
        for name, (attn, mask) in saved.items():
            maps[0][name], maps[1][name] = attn, mask
    return out


def _time(fn: Callable[[], object], inner: int) -> float:
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def run_interleaved(built, rounds: int) -> Dict[str, Dict[str, list]]:
    """Per figure and provider, the per-call seconds of each round (providers alternate)."""
    out = {}
    for name, providers in built.items():
        for fn in providers.values():  # warm-up
            fn()
        one = min(_time(fn, 1) for fn in providers.values())
        inner = max(1, int(0.02 / max(one, 1e-7)))
        samples = {p: [] for p in providers}
        for _ in range(rounds):
            for p, fn in providers.items():
                samples[p].append(_time(fn, inner))
        out[name] = samples
    return out


def _fmt(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--profile", action="store_true", help="cProfile the mhakern decode call")
    ap.add_argument("--split", action="store_true", help="time inside SDPA during generate()")
    ap.add_argument("--split-integration", action="store_true",
                    help="time inside the attention and mask functions during generate(), sdpa against mhakern")
    args = ap.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    import transformers

    built = targets(args.backend)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads, "
          f"backend {args.backend}; {args.rounds} interleaved rounds")
    samples = run_interleaved(built, args.rounds)
    # The median says what a user sees on this shared machine; the minimum, what a call costs
    # when nothing else interferes (the steadier figure under load).
    for stat in (statistics.median, min):
        for name, per in samples.items():
            m = {p: stat(s) for p, s in per.items()}
            base = m["sdpa"]
            parts = [f"{p} {_fmt(t)} ({t / base:.2f}x, {(t - base) * 1e6:+.1f} us)" for p, t in m.items()]
            print(f"{stat.__name__:>6} {name}: " + "; ".join(parts))
    if args.split:
        for p, (whole, inside) in split_generate(args.rounds).items():
            print(f"split generate_sdpa_dropin, {p}: min {_fmt(min(whole))}, inside SDPA min {_fmt(min(inside))} "
                  f"(median {_fmt(statistics.median(inside))}), outside min "
                  f"{_fmt(min(w - i for w, i in zip(whole, inside)))}")
    if args.split_integration:
        for p, (whole, attn, mask, calls) in split_generate_integration(args.rounds).items():
            print(f"split generate, {p}: min {_fmt(min(whole))}, inside attention min {_fmt(min(attn))} "
                  f"({_fmt(min(attn) / calls[0])} a call), inside the mask function min {_fmt(min(mask))}, outside min "
                  f"{_fmt(min(w - a - m for w, a, m in zip(whole, attn, mask)))}")
    if args.profile:
        import cProfile
        import pstats

        fn = built["decode_call"]["mhakern"]
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20000):
            fn()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    return 0


def test_generate_against_sdpa(benchmark):
    import pytest

    pytest.importorskip("transformers", minversion="5.4.0", reason="transformers>=5.4.0 is not installed")
    built = targets()["generate"]
    benchmark.extra_info.update(kind="transformers generate, 64 tokens, tiny Llama")
    benchmark.pedantic(built["mhakern"], rounds=5, warmup_rounds=1)


if __name__ == "__main__":
    sys.exit(main())
