"""mhakern.flex_attention(..., backend="triton") beyond the named mods (tests/test_conformance_flex.py
runs those, on Triton too): agreement with the cpu kernel, auto's choice of backend, refusals,
the generated module's cache, most of the generator's ops and their derivatives, the AOT compile.

Without a GPU the kernels run through Triton's interpreter on CPU tensors (conftest sets
TRITON_INTERPRET=1 when there is no CUDA device): every program runs in Python, so the shapes
are tiny (the named cases' ``small`` shapes, tests/flex_cases.py).
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("torch.nn.attention.flex_attention")

import flex_cases as fc  # noqa: E402
from conftest import SLOW  # noqa: E402
from flex_cases import softcap  # noqa: E402

import mhakern  # noqa: E402
from mhakern import reference as ref_mod  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="no CUDA device and TRITON_INTERPRET is off",
)


def _small(name):
    return fc.BY_NAME[name].sized(True)


@pytest.mark.slow  # compiles the cpu kernel of this case's modifier (seconds on a fresh cache)
@pytest.mark.skipif(DEVICE != "cpu", reason="the cpu kernel takes cpu tensors")
def test_agrees_with_the_cpu_kernel():
    """Triton and the cpu kernel within twice the other's error of the float64 oracle."""
    case = _small("rel_bias")  # q, k, v and the table
    q, k, v, do, t = fc.inputs(case, seed=3)
    score_mod, _ = fc.mods(case, t)
    o1, _, g1 = fc.run(fc.flex_call("triton", score_mod, None, False), q, k, v, do, [t["table"]])
    oc, _, gc = fc.run(fc.flex_call("cpu", score_mod, None, False), q, k, v, do, [t["table"]])
    t64 = fc.in_float64(t)
    s64, _ = fc.mods(case, t64)
    r64, _, g64 = fc.run(lambda a, b, c: mhakern.flex.reference(a.double(), b.double(), c.double(), s64), q, k, v, do,
                         [t64["table"]])
    # Each kernel within twice the other's error of the oracle (plus the rule's atol).
    assert ref_mod.rule_violation(o1, r64, oc, torch.float32, 2.0) is None
    for a, b, c in zip(g1, g64, gc):
        assert ref_mod.rule_violation(a, b, c, torch.float32, 2.0) is None


@pytest.mark.slow  # the interpreter at a cpu-sized shape: many tiles and blocks per row
def test_document_mask_at_full_size():
    """The document mask at the shape the cpu kernel runs (several partial and full blocks per
    row, D 48), where the conformance suite runs the interpreter at its small shape."""
    fc.check(fc.BY_NAME["document"], "triton", device=DEVICE)


def test_auto_keeps_cpu_tensors_on_the_cpu_kernel(monkeypatch):
    """auto never takes the Triton path (nor the interpreter) for CPU tensors."""
    from mhakern.flex import triton_backend

    def refuse(*a, **kw):
        raise AssertionError("auto routed CPU tensors to Triton")

    monkeypatch.setattr(triton_backend, "serve", refuse)
    q, k, v, _, _ = fc.inputs(_small("causal"))
    mhakern.flex_attention(q, k, v, block_mask=None)
    assert mhakern.last_backend() in ("cpu", "reference")


@pytest.mark.skipif(DEVICE != "cuda", reason="auto picks Triton on CUDA tensors")
def test_auto_picks_triton_on_cuda():
    q, k, v, _, _ = fc.inputs(_small("causal"))
    mhakern.flex_attention(q.cuda(), k.cuda(), v.cuda())
    assert mhakern.last_backend() == "triton"


def test_refusals_name_the_reason():
    q, k, v, _, _ = fc.inputs(_small("causal"))

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
    q, k, v, _, _ = fc.inputs(_small("softcap"))
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
    case = fc.Case("many_ops", lambda t: _many_ops, None, (1, 1, 1, 24, 24, 16), (16, 16), 2.0)
    fc.check(case, "triton", device=DEVICE)


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
