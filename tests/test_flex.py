"""mhakern.flex_attention beyond the named mods (tests/test_conformance_flex.py runs those on
every backend): auto's choice, refusals and fallbacks with their reasons, argument errors, the
call under torch.compile, the block mask builders.

The cpu kernels these tests use are the named mods' (tests/flex_cases.py precompile_cpu: one
compiler run for all of them, the disk cache keeps them for the next run).
"""
from __future__ import annotations

import pytest
import torch

import mhakern
from mhakern import reference as ref_mod
from mhakern.flex import graph

tflex = pytest.importorskip("torch.nn.attention.flex_attention")

import flex_cases as fc  # noqa: E402
from flex_cases import causal, softcap  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def compiled_once():
    fc.precompile_cpu()


def test_auto_serves_cpu_and_no_block_mask_means_everything():
    q, k, v, _, _ = fc.inputs(fc.BY_NAME["per_head_window"])
    out = mhakern.flex_attention(q, k, v)
    assert mhakern.last_backend() == "cpu"
    r64, _ = mhakern.flex.reference(q.double(), k.double(), v.double())
    assert (out.double() - r64).abs().max() < 1e-5


# ------------------------------------------------------------------------------------------
# Refusals and fallbacks.

def _small():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(1, 2, 16, 8, generator=g) for _ in range(3)]


def test_data_dependent_modifier_is_refused():
    q, k, v = _small()

    def branchy(score, b, h, q_idx, kv_idx):
        return score if score > 0 else -score

    with pytest.raises(ValueError, match="data-dependent"):
        mhakern.flex_attention(q, k, v, branchy)


def test_unsupported_op_falls_back_with_warning_or_refuses_in_strict_mode():
    q, k, v = _small()

    def bessel(score, b, h, q_idx, kv_idx):
        return score + torch.special.bessel_j0(score)

    with pytest.warns(UserWarning, match="reference"):
        out = mhakern.flex_attention(q, k, v, bessel)
    assert mhakern.last_backend() == "reference"
    r64, _ = mhakern.flex.reference(q.double(), k.double(), v.double(), bessel)
    assert (out.double() - r64).abs().max() < 1e-5
    with pytest.raises(mhakern.FallbackError, match="bessel_j0"):
        mhakern.flex_attention(q, k, v, bessel, kernel_options={"strict": True})
    with pytest.raises(ValueError, match="backend='cpu'"):
        mhakern.flex_attention(q, k, v, bessel, backend="cpu")


def test_no_compiler_falls_back_or_refuses(monkeypatch):
    q, k, v = _small()
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.warns(UserWarning, match="compiler"):
        out = mhakern.flex_attention(q, k, v, softcap)
    assert mhakern.last_backend() == "reference"
    r64, _ = mhakern.flex.reference(q.double(), k.double(), v.double(), softcap)
    assert (out.double() - r64).abs().max() < 1e-5
    with pytest.raises(mhakern.FallbackError, match="compiler"):
        mhakern.flex_attention(q, k, v, softcap, kernel_options={"strict": True})


def test_capture_on_another_device_is_refused():
    q, k, v = _small()
    table = torch.zeros(2, device="meta")

    def on_meta(score, b, h, q_idx, kv_idx):
        return score + table[h]

    with pytest.raises(ValueError, match="meta"):
        mhakern.flex_attention(q, k, v, on_meta, backend="cpu")


@pytest.mark.parametrize("kwargs, match", [
    (dict(kernel_options={"BLOCK_M": 64}), "BLOCK_M"),
    (dict(kernel_options={"BACKEND": "TRITON"}), "BACKEND"),
    (dict(kernel_options={"strict": 1}), "strict"),
    (dict(return_aux="lse"), "return_aux"),
    (dict(return_lse=True, return_aux=tflex.AuxRequest(lse=True)), "return_lse, return_aux"),
    (dict(scale=float("nan")), "scale"),
    (dict(backend="tpu"), "backend"),
    (dict(score_mod=3), "score_mod"),
    (dict(block_mask="causal"), "block_mask"),
])
def test_bad_arguments_name_the_argument(kwargs, match):
    q, k, v = _small()
    with pytest.raises((ValueError, TypeError), match=match):
        mhakern.flex_attention(q, k, v, **kwargs)


def test_shape_errors():
    q, k, v = _small()
    with pytest.raises(ValueError, match="query"):
        mhakern.flex_attention(q[0], k, v)
    with pytest.raises(ValueError, match="enable_gqa"):
        mhakern.flex_attention(q, k[:, :1], v[:, :1])
    with pytest.raises(ValueError, match="max_scores"):
        mhakern.flex_attention(q, k, v, return_aux=tflex.AuxRequest(max_scores=True))
    bm = tflex.create_block_mask(causal, None, None, 32, 32, device="cpu")
    with pytest.raises(ValueError, match="block_mask"):
        mhakern.flex_attention(q, k, v, block_mask=bm)


def test_import_is_lazy():
    import subprocess
    import sys

    code = "import sys, mhakern; print('mhakern.flex' in sys.modules, 'torch.fx.experimental.proxy_tensor' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "False"


def test_under_torch_compile_it_is_a_graph_break():
    """torch.compile runs the call eagerly between the compiled graphs (a graph break), with the
    same result and gradients; fullgraph=True refuses with the reason."""
    case = fc.BY_NAME["alibi"]  # alibi + causal
    q, k, v, do, t = fc.inputs(case)
    score_mod, mask_mod = fc.mods(case, t)
    bm = fc.block_mask(case, mask_mod)

    def f(a, b, c):
        return mhakern.flex_attention(a * 1.0, b, c, score_mod, bm, backend="cpu") * 2.0

    torch._dynamo.reset()
    try:
        compiled = torch.compile(f, backend="eager")
        eager, _, g_eager = fc.run(lambda a, b, c: (f(a, b, c), None), q, k, v, do, [])
        got, _, g_got = fc.run(lambda a, b, c: (compiled(a, b, c), None), q, k, v, do, [])
        assert torch.equal(got, eager)
        for x, y in zip(g_got, g_eager):
            assert torch.equal(x, y)
        with pytest.raises(Exception, match="runs eagerly"):
            torch.compile(f, backend="eager", fullgraph=True)(q, k, v)
    finally:
        torch._dynamo.reset()


# ------------------------------------------------------------------------------------------
# Block mask builders.

def _check_builder(bm, B, Lq, Lk):
    """The builder's blocks and mask_mod show exactly the pairs its mask_mod allows: full
    blocks hold only visible pairs, every visible pair lies in a listed block."""
    from mhakern.flex.api import _Blocks

    assert tuple(bm.seq_lengths) == (Lq, Lk)
    partial, full = _Blocks(bm, B, 1, Lq, Lk).dense(Lq, Lk)
    m = bm.mask_mod(torch.arange(B).view(B, 1, 1, 1), torch.zeros(1, 1, 1, 1, dtype=torch.long),
                    torch.arange(Lq).view(1, 1, Lq, 1), torch.arange(Lk).view(1, 1, 1, Lk)).expand(B, 1, Lq, Lk)
    assert not (full.expand(B, 1, Lq, Lk) & ~m).any(), "a full block holds a hidden pair"
    assert torch.equal(full | (partial & m), m), "a visible pair lies outside the listed blocks"
    # torch's create_block_mask lists the same blocks (it may call a last, padded block partial).
    ref = tflex.create_block_mask(bm.mask_mod, B, None, Lq, Lk, device="cpu", BLOCK_SIZE=bm.BLOCK_SIZE)
    rp, rf = _Blocks(ref, B, 1, Lq, Lk).dense(Lq, Lk)
    assert torch.equal((partial | full).expand(B, 1, Lq, Lk), (rp | rf).expand(B, 1, Lq, Lk))


@pytest.mark.parametrize("kw", [dict(), dict(causal=False), dict(window=50), dict(causal=False, window=20)])
@pytest.mark.parametrize("bs", [128, (64, 32)])
def test_document_block_mask(kw, bs):
    _check_builder(mhakern.flex.document_block_mask(torch.tensor([0, 100, 130, 400, 401, 700]), block_size=bs, **kw),
                   1, 700, 700)


def test_prefix_and_causal_block_masks():
    for bs in (128, (32, 64)):
        _check_builder(mhakern.flex.prefix_lm_block_mask(torch.tensor([0, 50, 300]), 333, block_size=bs), 3, 333, 333)
        _check_builder(mhakern.flex.causal_block_mask(300, 200, window=70, block_size=bs), 1, 300, 200)
        _check_builder(mhakern.flex.causal_block_mask(300, block_size=bs), 1, 300, 300)


@pytest.mark.parametrize("make, L", [
    (lambda: mhakern.flex.document_block_mask(torch.tensor([0, 90, 91, 250, 300], dtype=torch.int32), window=40,
                                              block_size=(64, 32)), 300),
    # Few partial blocks (9 of 45): the cpu forward's 64-row tasks, trimming the diagonal's keys.
    (lambda: mhakern.flex.causal_block_mask(520, block_size=64), 520),
])
def test_builder_mask_runs_on_the_kernel(make, L):
    bm = make()
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, L, 32, generator=g) for _ in range(3))
    out = mhakern.flex_attention(q, k, v, block_mask=bm, backend="cpu")
    r64, _ = mhakern.flex.reference(q.double(), k.double(), v.double(), block_mask=bm)
    r32, _ = mhakern.flex.reference(q, k, v, block_mask=bm, upcast=False)
    why = ref_mod.rule_violation(out, r64, r32, torch.float32, 2.0)
    assert why is None, why


@pytest.mark.parametrize("call, match", [
    (lambda: mhakern.flex.document_block_mask(torch.tensor([1, 5])), "cu_seqlens"),
    (lambda: mhakern.flex.document_block_mask(torch.tensor([0.0, 5.0])), "cu_seqlens"),
    (lambda: mhakern.flex.document_block_mask(torch.tensor([0, 5]), window=-1), "window"),
    (lambda: mhakern.flex.document_block_mask(torch.tensor([0, 5]), block_size=0), "block_size"),
    (lambda: mhakern.flex.prefix_lm_block_mask(torch.tensor([-1]), 8), "prefix_lengths"),
    (lambda: mhakern.flex.causal_block_mask(0), "q_len"),
])
def test_builder_errors(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_flex_templates_do_not_change_the_build_key(tmp_path):
    """csrc/flex/ holds the generated kernels' template, built apart: editing it must not
    rebuild mhakern._C (mhakern/_build.py's build_key skips it)."""
    from mhakern import _build

    (tmp_path / "csrc" / "flex").mkdir(parents=True)
    (tmp_path / "csrc" / "a.cpp").write_text("int a;")
    (tmp_path / "csrc" / "flex" / "flex_kernel.cpp").write_text("int b;")
    info = {"version": "2.13.0", "cuda": None}
    key = _build.build_key(str(tmp_path), info, {})
    (tmp_path / "csrc" / "flex" / "flex_kernel.cpp").write_text("int c;")
    assert _build.build_key(str(tmp_path), info, {}) == key
    (tmp_path / "csrc" / "a.cpp").write_text("int d;")
    assert _build.build_key(str(tmp_path), info, {}) != key


def _reading_h(mask_mod):
    """mask_mod, written so that it reads h (the same mask)."""
    def reads_h(b, h, q, kv):
        return mask_mod(b, h, q, kv) & (h >= 0)
    return reads_h


@pytest.mark.parametrize("name", ["causal", "document_window"])
def test_mask_shared_across_heads_is_bit_identical(name):
    """The cpu kernel evaluates a mask_mod that reads neither h nor b once per partial block for
    all heads (causal), one that reads b once per batch element (document_window): the same
    mask read per head gives the same bits, forward and backward."""
    case = fc.BY_NAME[name]
    case = case._replace(shape=(2, 4, 4) + case.shape[3:])
    q, k, v, do, t = fc.inputs(case, seed=7)
    _, mask_mod = fc.mods(case, t)
    assert graph.reads(graph.trace(mask_mod, False))[:2] == [name != "causal", False]
    res = []
    for mm in (mask_mod, _reading_h(mask_mod)):
        res.append(fc.run(fc.flex_call("cpu", None, fc.block_mask(case, mm), False), q, k, v, do, []))
    (o1, l1, g1), (o2, l2, g2) = res
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


def test_modifiers_are_traced_on_the_calls_device():
    """A mask_mod that mixes its index arguments with a captured tensor (prefix_lm's
    ``kv < prefix[b]``) is traced with the arguments on the call's device, where the capture
    lives: on a GPU the cpu arguments failed the trace (found by the H200 device check of
    2026-12-04). The meta device stands in for a GPU here; each device keeps its own trace."""
    from mhakern.flex import api

    prefix = torch.tensor([23, 70, 5], device="meta")

    def prefix_lm(b, h, q, kv):
        return (kv <= q) | (kv < prefix[b])

    t = graph.trace(prefix_lm, False, "meta")
    assert [n[1] for n in t.nodes] == ["le", "load", "lt", "bitwise_or"] and t.captures == [prefix]
    assert api._trace_cached(prefix_lm, False, torch.device("meta")).nodes == t.nodes
    with pytest.raises(graph.Untraceable, match="mask_mod could not be traced"):
        api._trace_cached(prefix_lm, False, "cpu")  # cpu arguments beside a capture elsewhere
    # A capture left on the CPU in a call elsewhere (the kernels read a copy on the call's
    # device): the CPU's arguments trace it, as before.
    table = torch.randn(2, 9)

    def bias(score, b, h, q, kv):
        return score + table[h, q - kv + 4]

    t = api._trace_cached(bias, True, "meta")
    assert t.captures == [table] and "load" in [n[1] for n in t.nodes]
    with pytest.raises(graph.Untraceable, match="mask_mod could not be traced"):  # neither device traces it
        graph.trace(lambda b, h, q, kv: (kv < prefix[b]) & (q < table[h, kv]), False, "meta")
