"""The named flex modifiers (issue 32's conformance list) and the check each flex backend passes
on them, in one place: tests/test_conformance_flex.py runs them on every backend that serves
flex, tests/test_flex.py and tests/test_flex_triton.py build their own tests from the same mods,
and the device check's Triton flex step runs the conformance file on a GPU.

A :class:`Case` is a modifier pair built from a dict of tables (``win``, ``prefix``, ``doc``,
``slopes``, ``table``, ``t5``: :func:`tables`), a shape and a BlockMask block size. ``shape`` is
what the cpu kernel, the reference and Triton on a GPU run; ``small`` what Triton's interpreter
runs (every program in Python: tiny shapes).

The cpu kernel compiles each modifier pair once per dtype into a library cached on disk, keyed
by the generated C++ (the graph, and the captures' kinds and ranks, not their sizes):
:func:`precompile_cpu` builds every pair the suites run in one compiler run, the first time a
process asks. A new named mod costs CI a compile on a fresh cache; a new case of an existing
pair (another shape, block size, backend) costs nothing.
"""
from __future__ import annotations

import functools
import warnings
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch
from conftest import SLOW

import mhakern
from mhakern import reference as ref_mod

NB = 4  # T5 buckets per direction


def causal(b, h, q, kv):
    return q >= kv


def _window(t):
    def window(b, h, q, kv):  # causal sliding window of t["win"] keys
        return (q >= kv) & (q - kv < t["win"][0])
    return window


def _prefix(t):
    def prefix_lm(b, h, q, kv):  # bidirectional over each element's prefix, causal after it
        return (kv <= q) | (kv < t["prefix"][b])
    return prefix_lm


def _document(t):
    def document(b, h, q, kv):
        return t["doc"][b, q] == t["doc"][b, kv]
    return document


def _doc_window(t):
    def doc_window(b, h, q, kv):
        return (t["doc"][b, q] == t["doc"][b, kv]) & (q >= kv) & (q - kv < t["win"][0])
    return doc_window


def _head_window(t):
    def head_window(b, h, q, kv):  # a causal window that widens with the head: mask_fn reads h
        return (q >= kv) & (q - kv < t["win"][0] * (h + 1))
    return head_window


def _alibi(t):
    def alibi(score, b, h, q, kv):
        return score + t["slopes"][h] * (kv - q)
    return alibi


def _rel_bias(t):
    def rel_bias(score, b, h, q, kv):  # a learnable (H, Lq + Lk - 1) table of relative positions
        return score + t["table"][h, q - kv + t["table"].shape[1] // 2]
    return rel_bias


def _t5(t):
    def t5_bucket(score, b, h, q, kv):  # log-spaced buckets per direction, learnable (H, 2 NB) table
        rel = kv - q
        mag = torch.clamp((torch.log(torch.abs(rel).float() + 1.0) * 1.5).long(), max=NB - 1)
        return score + t["table"][h, mag + torch.where(rel > 0, NB, 0)]
    return t5_bucket


def softcap(score, b, h, q, kv):
    return 5.0 * torch.tanh(score / 5.0)


Shape = Tuple[int, int, int, int, int, int]  # B, H, Hkv, Lq, Lk, D


class Case(NamedTuple):
    name: str
    score: Optional[Callable]  # tables -> score_mod
    mask: Optional[Callable]  # tables -> mask_mod
    shape: Shape
    block: Tuple[int, int]
    qmul: float = 1.0  # scales q: softcap needs large scores to bite
    small: Optional[Tuple[Shape, Tuple[int, int]]] = None  # (shape, block) under Triton's interpreter
    slow: Tuple[str, ...] = ()  # backends that run this case only under MHAKERN_SLOW=1

    def sized(self, small: bool) -> "Case":
        """This case at its interpreter size (``small``) or as it is."""
        return self._replace(shape=self.small[0], block=self.small[1]) if small else self


def _mask_only(mask):
    return lambda t: mask


# The named mods. "cpu" in ``slow``: a pair whose features other cases also reach (a window, a
# prefix, a document mask, a bucketed table, softcap alone): each pair compiled costs CI seconds
# on a fresh cache. "triton" in ``slow``: the interpreter's heavier cases.
CASES = [
    Case("causal", None, _mask_only(causal), (2, 4, 4, 157, 157, 32), (128, 128),
         small=((1, 2, 2, 40, 40, 16), (16, 16))),
    Case("sliding_window", None, _window, (1, 4, 4, 200, 200, 32), (32, 64),
         small=((1, 2, 2, 64, 64, 16), (16, 32)), slow=("cpu",)),
    Case("prefix_lm", None, _prefix, (3, 2, 2, 150, 150, 32), (64, 64),
         small=((3, 1, 1, 48, 48, 16), (16, 16)), slow=("cpu",)),
    Case("document", None, _document, (2, 2, 2, 180, 180, 48), (64, 32),
         small=((2, 1, 1, 60, 60, 16), (16, 16)), slow=("cpu",)),
    Case("document_window", None, _doc_window, (2, 2, 2, 180, 180, 32), (32, 32),
         small=((2, 1, 1, 64, 64, 16), (16, 16))),
    Case("alibi", _alibi, _mask_only(causal), (1, 4, 4, 130, 130, 32), (64, 64),
         small=((1, 2, 2, 40, 40, 16), (32, 16))),
    Case("rel_bias", _rel_bias, None, (2, 2, 2, 96, 120, 32), (32, 64),
         small=((1, 2, 2, 24, 40, 16), (16, 32))),
    Case("t5_bucket", _t5, None, (1, 4, 2, 110, 110, 32), (64, 64),
         small=((1, 4, 2, 70, 70, 32), (64, 64)), slow=("cpu", "triton")),
    Case("softcap", lambda t: softcap, None, (1, 2, 2, 100, 100, 32), (128, 128), 4.0,
         small=((1, 2, 2, 30, 30, 16), (128, 128)), slow=("cpu",)),
    # torch's #153799 case: a mask_mod with a score_mod at lengths that are not block multiples.
    Case("softcap_window_odd", lambda t: softcap, _window, (2, 2, 2, 129, 77, 32), (128, 128), 4.0,
         small=((1, 2, 2, 45, 29, 16), (128, 128))),
    Case("gqa_causal_lq_ne_lk", None, _mask_only(causal), (2, 6, 2, 100, 180, 32), (64, 128),
         small=((1, 4, 2, 24, 40, 16), (16, 32))),
    # Rows q >= Lk + 37 see no key: output 0, lse -inf, zero gradients.
    Case("no_visible_rows", None, _window, (1, 2, 2, 150, 40, 32), (32, 32),
         small=((1, 1, 1, 60, 16, 16), (16, 16))),
    Case("plain", None, None, (1, 2, 2, 70, 90, 40), (128, 128), small=((1, 2, 2, 20, 30, 40), (128, 128))),
    # Mask blocks smaller than a tile (8 < 16: Triton masks the rows past the block), D 40.
    Case("causal_d40_block8", None, _mask_only(causal), (1, 2, 2, 37, 45, 40), (8, 8),
         small=((1, 2, 2, 37, 45, 40), (8, 8))),
    Case("per_head_window", None, _head_window, (1, 4, 4, 200, 200, 32), (64, 64),
         small=((1, 4, 4, 100, 100, 32), (64, 64)), slow=("triton",)),
]
BY_NAME: Dict[str, Case] = {c.name: c for c in CASES}
# 16-bit inputs: the cpu kernel serves bf16, Triton fp16 and bf16.
HALF_CASES = [
    (Case("document_bf16", None, _document, (2, 2, 2, 180, 180, 64), (64, 64),
          small=((2, 1, 1, 60, 60, 16), (16, 16))), torch.bfloat16),
    (Case("alibi_fp16", _alibi, _mask_only(causal), (1, 4, 4, 130, 130, 32), (64, 64),
          small=((1, 2, 2, 40, 40, 16), (32, 16))), torch.float16),
]
LEARNABLE = (_rel_bias, _t5)  # score mods whose table requires grad


def tables(B, H, Lq, Lk, g: torch.Generator) -> Dict[str, torch.Tensor]:
    L = max(Lq, Lk)
    doc = torch.cumsum((torch.rand(B, L, generator=g) < 0.03).long(), 1)
    return {
        "win": torch.tensor([37]),
        "prefix": torch.tensor([23, 70, 5][:B]),
        "doc": doc,
        "slopes": torch.rand(H, generator=g) * 0.3,
        "table": (torch.randn(H, Lq + Lk - 1, generator=g)).requires_grad_(),
        "t5": (torch.randn(H, 2 * NB, generator=g)).requires_grad_(),
    }


def case_tables(case: Case, t):
    """The tables ``case``'s mods read: T5's bucket table in place of the relative one."""
    if case.score is _t5:
        t = dict(t, table=t["t5"])
    return t


def mods(case: Case, t):
    """(score_mod, mask_mod) of ``case`` over tables ``t``."""
    t = case_tables(case, t)
    return (case.score(t) if case.score else None), (case.mask(t) if case.mask else None)


def leaves(case: Case, t):
    """The captured tables whose gradient ``case`` checks."""
    return [case_tables(case, t)["table"]] if case.score in LEARNABLE else []


def inputs(case: Case, dtype=torch.float32, seed=0):
    """q, k, v, dout (on the CPU) and the tables of ``case``'s shape."""
    B, H, Hkv, Lq, Lk, D = case.shape
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, H, Lq, D, generator=g) * case.qmul).to(dtype)
    k = torch.randn(B, Hkv, Lk, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, Lk, D, generator=g).to(dtype)
    do = torch.randn(B, H, Lq, D, generator=g).to(dtype)
    return q, k, v, do, tables(B, H, Lq, Lk, g)


def on(t, device):
    """Tables on ``device``, keeping which require grad."""
    return {n: (x.detach().to(device).requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x)
            for n, x in t.items()}


def in_float64(t):
    return {n: x.detach().double().requires_grad_(x.requires_grad) if x.dtype.is_floating_point else x
            for n, x in t.items()}


def block_mask(case: Case, mask_mod, device="cpu"):
    from torch.nn.attention.flex_attention import create_block_mask

    B, H, Hkv, Lq, Lk, D = case.shape
    if mask_mod is None:
        return None
    return create_block_mask(mask_mod, B, None, Lq, Lk, device=device, BLOCK_SIZE=case.block)


def run(fn, q, k, v, do, leaves):
    """(out, lse, gradients of q, k, v and ``leaves``) of ``fn(q, k, v) -> (out, lse)``."""
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out, lse = fn(qq, kk, vv)
    grads = torch.autograd.grad(out, [qq, kk, vv] + leaves, do.to(out.dtype), allow_unused=True)
    return out, lse, grads


def flex_call(backend, score_mod, bm, gqa):
    """``fn(q, k, v) -> (out, lse)`` through mhakern.flex_attention on ``backend``."""
    def fn(a, b, c):
        return mhakern.flex_attention(a, b, c, score_mod, bm, enable_gqa=gqa, return_lse=True, backend=backend)
    return fn


def check(case: Case, backend: str, dtype=torch.float32, device="cpu"):
    """``case`` on ``backend`` against the float64 reference by the tolerance rule
    (docs/contract.md): out and lse with factor 2, the gradients of q, k, v and of a learnable
    table with factor 3, the peer being torch math in the inputs' dtype; the rows that see no
    key (lse -inf) those of the reference. On CPU float32 inputs also against torch's own eager
    flex_attention (forward and lse, within twice its error: torch has no cpu backward) -- for
    the reference backend, which is that torch math itself, the part of the check that can fail.
    Returns (out, lse, grads)."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention as torch_flex

    q, k, v, do, t = inputs(case, dtype)
    q, k, v, do = (x.to(device) for x in (q, k, v, do))
    t = on(t, device)
    score_mod, mask_mod = mods(case, t)
    bm = block_mask(case, mask_mod, device)
    gqa = case.shape[1] != case.shape[2]
    got, lse, grads = run(flex_call(backend, score_mod, bm, gqa), q, k, v, do, leaves(case, t))
    assert mhakern.last_backend() == backend
    assert got.dtype == dtype and lse.dtype == torch.float32
    t64 = in_float64(t)
    s64, _ = mods(case, t64)
    r64, l64, g64 = run(lambda a, b, c: mhakern.flex.reference(a.double(), b.double(), c.double(), s64, bm,
                                                                enable_gqa=gqa), q, k, v, do, leaves(case, t64))
    # torch math in the inputs' dtype bounds the error (float32 for float32, else T itself).
    wdt = None if dtype == torch.float32 else dtype
    rT, lT, gT = run(lambda a, b, c: mhakern.flex.reference(a, b, c, score_mod, bm, enable_gqa=gqa, upcast=False,
                                                             work_dtype=wdt), q, k, v, do, leaves(case, t))
    why = ref_mod.rule_violation(got, r64, rT, dtype, 2.0)
    assert why is None, f"out: {why}"
    assert torch.equal(torch.isinf(lse).cpu(), torch.isinf(l64).cpu()), "lse: -inf rows differ from the reference"
    why = ref_mod.rule_violation(lse, l64, lT, torch.float32, 2.0)
    assert why is None, f"lse: {why}"
    for name, a, b, c in zip(["dq", "dk", "dv", "dtable"], grads, g64, gT):
        assert torch.isfinite(a).all(), f"{name}: non-finite"
        why = ref_mod.rule_violation(a, b, c, dtype if name != "dtable" else torch.float32, 3.0)
        assert why is None, f"{name}: {why}"
    if device == "cpu" and dtype == torch.float32:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t_out, t_aux = torch_flex(q, k, v, score_mod, bm, enable_gqa=gqa, return_aux=AuxRequest(lse=True))
        assert torch.equal(torch.isinf(t_aux.lse), torch.isinf(lse)), "lse: -inf rows differ from torch's"
        why = ref_mod.rule_violation(got, r64, t_out, torch.float32, 2.0)
        assert why is None, f"out vs torch's error: {why}"
        why = ref_mod.rule_violation(lse, l64, t_aux.lse, torch.float32, 2.0)
        assert why is None, f"lse vs torch's error: {why}"
    if case.name == "no_visible_rows":
        dead = torch.isinf(lse)
        assert dead.any() and (got[dead] == 0).all() and (grads[0][dead] == 0).all()
    return got, lse, grads


def cpu_cases():
    """The named cases the cpu kernel runs in this session (the heavy ones under MHAKERN_SLOW=1)."""
    return [c for c in CASES if SLOW or "cpu" not in c.slow]


def _case_mods(case: Case):
    """``case``'s mods over tables of its own shape: the generated C++ holds what the mods
    compute from a table's size (rel_bias's centre column), so only these hit the cache."""
    return mods(case, inputs(case)[4])


@functools.lru_cache(maxsize=None)
def precompile_cpu() -> None:
    """Every modifier pair the flex suites run on the cpu kernel, compiled in one compiler run
    per dtype (float32, bfloat16) the first time a process asks; cached on disk after."""
    builder_mask = mhakern.flex.document_block_mask(torch.tensor([0, 5]), window=3).mask_mod
    mhakern.flex.precompile([_case_mods(c) for c in cpu_cases()] + [(None, builder_mask)], torch.float32)
    mhakern.flex.precompile([_case_mods(c) for c, dt in HALF_CASES if dt == torch.bfloat16], torch.bfloat16)
