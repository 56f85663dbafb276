"""mhakern.flex_attention(..., backend="triton"): the traced modifiers generated into Triton
kernels (mhakern/flex/triton_gen.py), against the float64 reference with the tolerance rule
(docs/contract.md), forward, lse and gradients (q, k, v and a captured table); bit-identical
backward; block masks of any block size; auto's choice of backend.

Without a GPU the kernels run through Triton's interpreter on CPU tensors (conftest sets
TRITON_INTERPRET=1 when there is no CUDA device): every program runs in Python, so the shapes
are tiny. The named mods are test_flex.py's (the same functions, the same tables).
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
tflex = pytest.importorskip("torch.nn.attention.flex_attention")

import mhakern  # noqa: E402
from mhakern import reference as ref_mod  # noqa: E402
from test_flex import (  # noqa: E402
    Case, _alibi, _case_tables, _document, _head_window, _inputs, _mods, _rel_bias, _t5, _window, causal,
    softcap,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="no CUDA device and TRITON_INTERPRET is off",
)
SLOW = os.environ.get("MHAKERN_SLOW", "") not in ("", "0")

CASES = [
    Case("causal", None, lambda t: causal, (1, 2, 2, 40, 40, 16), (16, 16)),
    Case("sliding_window", None, _window, (1, 2, 2, 64, 64, 16), (16, 32)),
    Case("document", None, _document, (2, 1, 1, 60, 60, 16), (16, 16)),
    Case("alibi", _alibi, lambda t: causal, (1, 2, 2, 40, 40, 16), (32, 16)),
    Case("rel_bias", _rel_bias, None, (1, 2, 2, 24, 40, 16), (16, 32)),
    Case("softcap", lambda t: softcap, None, (1, 2, 2, 30, 30, 16), (128, 128), 4.0),
    # torch's #153799 case: a mask_mod with a score_mod at lengths that are not block multiples.
    Case("softcap_window_odd", lambda t: softcap, _window, (1, 2, 2, 45, 29, 16), (128, 128), 4.0),
    Case("gqa_causal_lq_ne_lk", None, lambda t: causal, (1, 4, 2, 24, 40, 16), (16, 32)),
    # Rows q >= Lk + 37 see no key: output 0, lse -inf, zero gradients.
    Case("no_visible_rows", None, _window, (1, 1, 1, 60, 16, 16), (16, 16)),
    # Mask blocks smaller than a tile (8 < 16: rows past the block masked), D not a power of two.
    Case("plain_d40_block8", None, lambda t: causal, (1, 2, 2, 37, 45, 40), (8, 8)),
]
SLOW_CASES = [
    Case("t5_bucket", _t5, None, (1, 4, 2, 70, 70, 32), (64, 64)),
    Case("per_head_window", None, _head_window, (1, 4, 4, 100, 100, 32), (64, 64)),
    Case("document_big", None, _document, (2, 2, 2, 180, 180, 48), (64, 32)),
]


def _on(t):
    return {n: (x.detach().to(DEVICE).requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x)
            for n, x in t.items()}


def _run(fn, q, k, v, do, leaves):
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out, lse = fn(qq, kk, vv)
    grads = torch.autograd.grad(out, [qq, kk, vv] + leaves, do.to(out.dtype), allow_unused=True)
    return out, lse, grads


def _check(case: Case, dtype=torch.float32):
    q, k, v, do, t = _inputs(case, dtype)
    q, k, v, do = (x.to(DEVICE) for x in (q, k, v, do))
    t = _on(t)
    score_mod, mask_mod = _mods(case, t)
    B, H, Hkv, Lq, Lk, D = case.shape
    bm = None if mask_mod is None else tflex.create_block_mask(mask_mod, B, None, Lq, Lk, device=DEVICE,
                                                               BLOCK_SIZE=case.block)
    gqa = H != Hkv
    learnable = case.score in (_rel_bias, _t5)
    leaves = [_case_tables(case, t)["table"]] if learnable else []
    got, lse, grads = _run(lambda a, b, c: mhakern.flex_attention(a, b, c, score_mod, bm, enable_gqa=gqa,
                                                                  return_lse=True, backend="triton"),
                           q, k, v, do, leaves)
    assert mhakern.last_backend() == "triton"
    assert got.dtype == dtype and lse.dtype == torch.float32
    t64 = {n: x.detach().double().requires_grad_(x.requires_grad) if x.dtype.is_floating_point else x
           for n, x in t.items()}
    s64, _ = _mods(case, t64)
    leaves64 = [_case_tables(case, t64)["table"]] if learnable else []
    r64, l64, g64 = _run(lambda a, b, c: mhakern.flex.reference(a.double(), b.double(), c.double(), s64, bm,
                                                                 enable_gqa=gqa), q, k, v, do, leaves64)
    # torch math in the inputs' dtype bounds the error (float32 for float32, else T itself).
    wdt = None if dtype == torch.float32 else dtype
    rT, lT, gT = _run(lambda a, b, c: mhakern.flex.reference(a, b, c, score_mod, bm, enable_gqa=gqa, upcast=False,
                                                              work_dtype=wdt), q, k, v, do, leaves)
    why = ref_mod.rule_violation(got, r64, rT, dtype, 2.0)
    assert why is None, f"out: {why}"
    assert torch.equal(torch.isinf(lse).cpu(), torch.isinf(l64).cpu()), "lse: -inf rows differ from the reference"
    why = ref_mod.rule_violation(lse, l64, lT, torch.float32, 2.0)
    assert why is None, f"lse: {why}"
    for name, a, b, c in zip(["dq", "dk", "dv", "dtable"], grads, g64, gT):
        assert torch.isfinite(a).all(), f"{name}: non-finite"
        why = ref_mod.rule_violation(a, b, c, dtype if name != "dtable" else torch.float32, 3.0)
        assert why is None, f"{name}: {why}"
    if case.name == "no_visible_rows":
        dead = torch.isinf(lse)
        assert dead.any() and (got[dead] == 0).all() and (grads[0][dead] == 0).all()
    return got, lse, grads


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_reference(case):
    _check(case)


@pytest.mark.slow
@pytest.mark.skipif(not SLOW, reason="MHAKERN_SLOW=1 runs the heavier cases")
@pytest.mark.parametrize("case", SLOW_CASES, ids=lambda c: c.name)
def test_matches_reference_slow(case):
    _check(case)


@pytest.mark.parametrize("case, dtype", [(CASES[2], torch.bfloat16), (CASES[3], torch.float16)],
                         ids=["document_bf16", "alibi_fp16"])
def test_half_inputs(case, dtype):
    _check(case, dtype)


def test_backward_bit_identical():
    """Two runs give the same bits (no atomics: fixed-order sums, the table's gradient by a
    deterministic index_put_)."""
    case = CASES[4]  # rel_bias: q, k, v and the table
    q, k, v, do, t = _inputs(case, seed=3)
    q, k, v, do = (x.to(DEVICE) for x in (q, k, v, do))
    t = _on(t)
    score_mod, _ = _mods(case, t)
    res = [_run(lambda a, b, c: mhakern.flex_attention(a, b, c, score_mod, return_lse=True, backend="triton"),
                q, k, v, do, [t["table"]]) for _ in range(2)]
    (o1, l1, g1), (o2, l2, g2) = res
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


@pytest.mark.slow  # compiles the cpu kernel of this case's modifier (seconds on a fresh cache)
@pytest.mark.skipif(DEVICE != "cpu", reason="the cpu kernel takes cpu tensors")
def test_agrees_with_the_cpu_kernel():
    """Triton and the cpu kernel within twice the other's error of the float64 oracle."""
    case = CASES[4]  # rel_bias: q, k, v and the table
    q, k, v, do, t = _inputs(case, seed=3)
    score_mod, _ = _mods(case, t)
    o1, _, g1 = _run(lambda a, b, c: mhakern.flex_attention(a, b, c, score_mod, return_lse=True, backend="triton"),
                     q, k, v, do, [t["table"]])
    oc, lc, gc = _run(lambda a, b, c: mhakern.flex_attention(a, b, c, score_mod, return_lse=True, backend="cpu"),
                      q, k, v, do, [t["table"]])
    t64 = {n: x.detach().double().requires_grad_(x.requires_grad) if x.dtype.is_floating_point else x
           for n, x in t.items()}
    s64, _ = _mods(case, t64)
    r64, _, g64 = _run(lambda a, b, c: mhakern.flex.reference(a.double(), b.double(), c.double(), s64), q, k, v, do,
                       [t64["table"]])
    # Each kernel within twice the other's error of the oracle (plus the rule's atol).
    assert ref_mod.rule_violation(o1, r64, oc, torch.float32, 2.0) is None
    for a, b, c in zip(g1, g64, gc):
        assert ref_mod.rule_violation(a, b, c, torch.float32, 2.0) is None


def test_auto_keeps_cpu_tensors_on_the_cpu_kernel(monkeypatch):
    """auto never takes the Triton path (nor the interpreter) for CPU tensors."""
    from mhakern.flex import triton_backend

    def refuse(*a, **kw):
        raise AssertionError("auto routed CPU tensors to Triton")

    monkeypatch.setattr(triton_backend, "serve", refuse)
    q, k, v, _, _ = _inputs(CASES[0])
    mhakern.flex_attention(q, k, v, block_mask=None)
    assert mhakern.last_backend() in ("cpu", "reference")


@pytest.mark.skipif(DEVICE != "cuda", reason="auto picks Triton on CUDA tensors")
def test_auto_picks_triton_on_cuda():
    q, k, v, _, _ = _inputs(CASES[0])
    mhakern.flex_attention(q.cuda(), k.cuda(), v.cuda())
    assert mhakern.last_backend() == "triton"


def test_refusals_name_the_reason():
    q, k, v, _, _ = _inputs(CASES[0])

    def bessel(score, b, h, q_idx, kv_idx):
        return score + torch.special.bessel_j0(score)

    def branchy(score, b, h, q_idx, kv_idx):
        return score if score > 0 else -score

    q, k, v = (x.to(DEVICE) for x in (q, k, v))
    with pytest.raises(ValueError, match="backend='triton'.*bessel_j0"):
        mhakern.flex_attention(q, k, v, bessel, backend="triton")
    with pytest.raises(ValueError, match="data-dependent"):
        mhakern.flex_attention(q, k, v, branchy, backend="triton")
    with pytest.raises(ValueError, match="kernel_options"):
        mhakern.flex_attention(q, k, v, backend="triton", kernel_options={"BLOCK_M": 64})


def test_generated_source_is_cached_by_hash(tmp_path, monkeypatch):
    """The module is written once per source under the cache directory and imported from there."""
    from mhakern.flex import triton_backend

    monkeypatch.setenv("MHAKERN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(triton_backend, "_MODULES", {})
    q, k, v, _, _ = _inputs(CASES[5])
    q, k, v = (x.to(DEVICE) for x in (q, k, v))
    a = mhakern.flex_attention(q, k, v, softcap, backend="triton")
    files = sorted((tmp_path / "flex_triton").glob("flex_*.py"))
    assert len(files) == 1 and "def score_fwd" in files[0].read_text()
    b = mhakern.flex_attention(q, k, v, softcap, backend="triton")
    assert torch.equal(a, b) and sorted((tmp_path / "flex_triton").glob("flex_*.py")) == files


def _many_ops(score, b, h, q, kv):
    """Most of the generator's ops at once, integer ones on negative operands (Python's floor
    semantics, which compiled Triton's // and % do not have)."""
    rel = kv - q
    x = torch.where(rel.remainder(3) == 1, torch.sigmoid(score), torch.tanh(score) * 2.0)
    x = x + torch.log1p(torch.abs(score)) - torch.expm1(score * 0.1) + torch.sqrt(torch.abs(score) + 1.0)
    x = x + torch.round(score * 2.5) * 0.1 + torch.trunc(score * 3.0) * 0.05 + rel // 4
    x = x + (rel % 3) * 0.5 + torch.fmod(rel, 5) * 0.25 + torch.floor(score) * 0.1
    x = x + torch.clamp(score, -1.0, 0.5) + torch.maximum(score, torch.zeros_like(score)) + score ** 2 * 0.1
    x = x + torch.exp2(torch.minimum(score, score * 0.5)) + torch.erf(score) + torch.relu(-score)
    return x + (rel.abs() > 3).float() * torch.sin(score) - torch.cos(score) * torch.sign(score)


def test_generated_ops_match_torch():
    """The pointwise ops of triton_gen.py and their derivatives, against the reference."""
    case = Case("many_ops", lambda t: _many_ops, None, (1, 1, 1, 24, 24, 16), (16, 16), 2.0)
    _check(case)


@pytest.mark.slow
@pytest.mark.skipif(not SLOW, reason="MHAKERN_SLOW=1 runs the AOT compile (about a minute)")
def test_aot_compile_sm80_sm90_without_spills_in_loops():
    """The generated kernels compile for sm_80 and sm_90 with no GPU, the forward and dQ with no
    register spill inside a loop (python -m mhakern.flex.triton_aot)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "mhakern.flex.triton_aot", "--arch", "80", "90", "--dtypes", "bf16",
                        "fp32"], capture_output=True, text=True, env=env, cwd=root, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert r.stdout.count("flex_") == 12
