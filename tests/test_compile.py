"""torch.compile: FusedMHA and mhakern.attention compile with fullgraph=True.

The raw forward and backward are custom ops (mhakern.ops) with fake implementations, so a
compiled graph holds ``mhakern::attn_fwd`` / ``mhakern::attn_bwd`` as opaque nodes: no graph
break, no tracing into a backend. The "aot_eager" compiler backend keeps this fast on CPU
while still running dynamo and AOTAutograd (forward and backward graphs) in full.
"""
import subprocess
import sys
import textwrap

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import mhakern
from mhakern import backends


def _cpu_backends():
    probe = torch.zeros(1, 2, 3, 16)
    return [
        n
        for n, why in mhakern.available_backends().items()
        if why is None and backends.get(n).supports(probe, probe, probe, True, None) is None
    ]


BACKENDS = _cpu_backends()
FWD_OP = torch.ops.mhakern.attn_fwd.default
BWD_OP = torch.ops.mhakern.attn_bwd.default


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Each test compiles new modules and functions; start from empty caches so that earlier
    # tests' guards and recompiles cannot count against this one.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class GraphRecorder:
    """An AOTAutograd compiler backend that keeps the forward and backward FX graphs and runs
    them eagerly (the same as "aot_eager")."""

    def __init__(self):
        self.fw, self.bw = [], []
        self.backend = aot_autograd(fw_compiler=self._keep(self.fw), bw_compiler=self._keep(self.bw))

    @staticmethod
    def _keep(store):
        def compiler(gm, example_inputs):
            store.append(gm)
            return make_boxed_func(gm.forward)

        return compiler

    @staticmethod
    def targets(gm):
        return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _run(fn, inputs, params, seed=3):
    """Output and gradients (inputs, then parameters) of ``fn(*inputs)`` for a fixed cotangent."""
    for t in list(inputs) + list(params):
        t.grad = None
    out = fn(*inputs)
    out = out[0] if isinstance(out, tuple) else out
    g = torch.Generator().manual_seed(seed)
    out.backward(torch.randn(out.shape, generator=g).to(device=out.device, dtype=out.dtype))
    return [out.detach()] + [t.grad.clone() for t in list(inputs) + list(params)]


def _assert_same(compiled, eager, **tol):
    assert len(compiled) == len(eager)
    for i, (c, e) in enumerate(zip(compiled, eager)):
        torch.testing.assert_close(c, e, **tol, msg=lambda m: f"result {i} (0 = output, then gradients): {m}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_fused_mha_matches_eager(backend):
    torch.manual_seed(0)
    mha = mhakern.FusedMHA(16, 4, num_kv_heads=2, backend=backend, batch_first=True)
    with torch.no_grad():
        mha.in_proj_bias.normal_()
    x = torch.randn(2, 6, 16, requires_grad=True)
    kpm = torch.arange(6) >= torch.tensor([[6], [4]])  # right padding, True = ignore

    def call(m):
        return lambda x: m(x, x, x, key_padding_mask=kpm, is_causal=True)

    compiled = torch.compile(mha, backend="aot_eager", fullgraph=True)
    params = list(mha.parameters())
    _assert_same(_run(call(compiled), [x], params), _run(call(mha), [x], params))


def test_compiled_cross_attention_seq_first_matches_eager():
    torch.manual_seed(1)
    mha = mhakern.FusedMHA(16, 2, kdim=12, vdim=8, batch_first=False, backend="reference")
    q = torch.randn(5, 3, 16, requires_grad=True)
    k = torch.randn(7, 3, 12, requires_grad=True)
    v = torch.randn(7, 3, 8, requires_grad=True)
    kl = torch.tensor([7, 2, 0])
    compiled = torch.compile(mha, backend="aot_eager", fullgraph=True)
    params = list(mha.parameters())
    run = lambda m: _run(lambda *a: m(*a, key_lengths=kl), [q, k, v], params)  # noqa: E731
    _assert_same(run(compiled), run(mha))


def test_compiled_functional_attention_with_key_lengths_matches_eager():
    kl = torch.tensor([9, 0, 4])
    fn = lambda q, k, v: mhakern.attention(q, k, v, causal=True, key_lengths=kl)  # noqa: E731
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(3, h, L, 16, generator=g).requires_grad_() for h, L in ((4, 5), (2, 9), (2, 9)))
    _assert_same(_run(compiled, [q, k, v], []), _run(fn, [q, k, v], []))


def test_graphs_hold_the_custom_ops_and_nothing_traced_from_a_backend():
    rec = GraphRecorder()
    torch.manual_seed(3)
    mha = mhakern.FusedMHA(16, 4, backend="reference", batch_first=True)
    x = torch.randn(2, 5, 16, requires_grad=True)
    compiled = torch.compile(mha, backend=rec.backend, fullgraph=True)
    out, _ = compiled(x, x, x, is_causal=True, need_weights=False)
    out.sum().backward()
    # One forward and one backward graph: no break (fullgraph would also refuse one).
    assert len(rec.fw) == 1 and len(rec.bw) == 1
    fw, bw = rec.targets(rec.fw[0]), rec.targets(rec.bw[0])
    assert fw.count(FWD_OP) == 1 and BWD_OP not in fw, fw
    assert bw.count(BWD_OP) == 1 and FWD_OP not in bw, bw
    # The reference backend computes with softmax and matmuls; the op being opaque, none of
    # them may appear in the graphs (only the projections' GEMMs do, as addmm/mm).
    aten = torch.ops.aten
    leaked = {aten._softmax.default, aten.softmax.int, aten.bmm.default, aten.exp.default, aten.logsumexp.default}
    assert not leaked & (set(fw) | set(bw)), sorted(map(str, leaked & (set(fw) | set(bw))))


def test_explain_reports_no_graph_break():
    mha = mhakern.FusedMHA(8, 2, batch_first=False, backend="reference")
    x = torch.randn(4, 2, 8)
    kpm = torch.tensor([[False] * 4, [False, False, True, True]])
    ex = torch._dynamo.explain(mha)(x, x, x, key_padding_mask=kpm, is_causal=True)
    assert ex.graph_break_count == 0 and ex.graph_count == 1, ex.break_reasons


def test_dynamic_shapes_compile_once_for_two_lengths():
    torch.manual_seed(4)
    mha = mhakern.FusedMHA(16, 2, backend="reference", batch_first=True)
    compiled = torch.compile(mha, backend="aot_eager", fullgraph=True, dynamic=True)
    params = list(mha.parameters())
    for L in (5, 9):
        x = torch.randn(2, L, 16, requires_grad=True)
        run = lambda m: _run(lambda x: m(x, x, x, is_causal=True), [x], params)  # noqa: E731
        _assert_same(run(compiled), run(mha))


def test_compiled_left_padding_matches_eager():
    # Left padding goes in as a mask under compile (the module cannot read the padding's data to
    # pick the key_lengths fast path inside a graph).
    mha = mhakern.FusedMHA(8, 2, backend="reference", batch_first=True)
    compiled = torch.compile(mha, backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 4, 8)
    left = torch.tensor([[False] * 4, [True, False, False, False]])
    torch.testing.assert_close(compiled(x, x, x, key_padding_mask=left)[0], mha(x, x, x, key_padding_mask=left)[0])


@pytest.mark.gpu
def test_inductor_compiles_fused_mha_on_cuda():
    # The default compiler (inductor, generating Triton code around the opaque ops), on the
    # best backend for CUDA tensors; fp16, GQA, right padding and causal.
    torch.manual_seed(5)
    mha = mhakern.FusedMHA(128, 4, num_kv_heads=2, device="cuda", dtype=torch.float16, batch_first=True)
    with torch.no_grad():
        mha.in_proj_bias.normal_()
    x = torch.randn(2, 64, 128, device="cuda", dtype=torch.float16, requires_grad=True)
    kpm = torch.arange(64, device="cuda") >= torch.tensor([[64], [40]], device="cuda")
    compiled = torch.compile(mha, fullgraph=True)
    params = list(mha.parameters())
    run = lambda m: _run(lambda x: m(x, x, x, key_padding_mask=kpm, is_causal=True), [x], params)  # noqa: E731
    # Inductor may fuse the projections' bias adds differently from eager: half-precision slack.
    _assert_same(run(compiled), run(mha), atol=1e-2, rtol=1e-2)


def test_compile_before_the_backend_registry_is_loaded():
    # A fresh interpreter, so that no earlier eager call has loaded the registry (whose imports
    # dynamo cannot trace), and one tensor passed as q, k and v (an autograd.Function may not
    # get the same tensor twice under dynamo).
    code = textwrap.dedent(
        """
        import sys, torch, mhakern
        # importing mhakern does not import dynamo (2 s); the registry's marks still hold under it
        assert "torch._dynamo" not in sys.modules
        fn = torch.compile(lambda q, k, v: mhakern.attention(q, k, v, causal=True), backend="aot_eager", fullgraph=True)
        q = torch.randn(1, 2, 3, 16, requires_grad=True)
        fn(q, q, q).sum().backward()
        assert q.grad is not None and q.grad.abs().sum() > 0
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("entry", ["sdpa", "fusedmha"])
def test_causal_bias_compiles_as_causal_masking(entry):
    # Before: a TypeError under torch.compile (and wrong numbers in eager).
    from torch.nn.attention.bias import causal_lower_right

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    if entry == "sdpa":
        q, k, v = (torch.randn(1, 2, L, 16, generator=g).requires_grad_() for L in (4, 6, 6))
        bias = causal_lower_right(4, 6)
        fn = lambda q, k, v: mhakern.scaled_dot_product_attention(q, k, v, attn_mask=bias)  # noqa: E731
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias._materialize())
        leaves = [q, k, v]
    else:
        mha = mhakern.FusedMHA(16, 4, batch_first=True)
        x, kv = torch.randn(2, 4, 16, generator=g, requires_grad=True), torch.randn(2, 6, 16, generator=g)
        bias = causal_lower_right(4, 6)
        fn = lambda x: mha(x, kv, kv, attn_mask=bias, need_weights=False)[0]  # noqa: E731
        want = mha(x, kv, kv, attn_mask=~bias._materialize(), need_weights=False)[0]
        leaves = [x]
    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(*leaves)
    torch.testing.assert_close(got, want)
    dout = torch.randn(got.shape, generator=g)
    for a, b in zip(torch.autograd.grad(got, leaves, dout), torch.autograd.grad(want, leaves, dout)):
        torch.testing.assert_close(a, b)
    torch._dynamo.reset()


class _DataDependentBatch(torch.nn.Module):
    """Attention over the first ``sel.sum()`` sequences: a batch size known only from data."""

    def __init__(self, entry):
        super().__init__()
        self.entry = entry
        self.mha = mhakern.FusedMHA(16, 4, batch_first=True)

    def forward(self, q, mask, sel):
        n = sel.sum().item()
        torch._check(n >= 1)
        torch._check(n <= q.shape[0])
        q, mask = q[:n], mask[:n]
        if self.entry == "sdpa":
            return mhakern.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        if self.entry == "attention":
            return mhakern.attention(q, q, q, attn_mask=mask, causal=True)
        x = q.flatten(1, 2)[..., :16]
        return self.mha(x, x, x, need_weights=False, is_causal=True)[0]


@pytest.mark.parametrize("entry", ["sdpa", "attention", "fusedmha"])
def test_export_with_a_data_dependent_batch_size(entry):
    # Before: GuardOnDataDependentSymNode in the mask's shape check (Eq(u0, 1)).
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, 5, 16, generator=g)
    mask = torch.rand(3, 1, 5, 5, generator=g) > 0.2
    sel = torch.tensor([1, 1, 0])
    mod = _DataDependentBatch(entry)
    ep = torch.export.export(mod, (q, mask, sel))
    for s in (sel, torch.tensor([1, 1, 1])):
        torch.testing.assert_close(ep.module()(q, mask, s), mod(q, mask, s))


def test_dropout_weights_hash_runs_eagerly_under_compile():
    """FusedMHA with dropout and need_weights under torch.compile: the weights pass regenerates the
    keep mask by mhakern's 64-bit integer hash, which inductor's CPU code generation miscompiles
    (a C++ compile error, torch 2.13). The hash must stay out of every compiled graph (it runs
    eagerly), and the weights returned must be those the output was computed with."""
    torch.manual_seed(0)
    m = mhakern.FusedMHA(8, 2, dropout=0.5, batch_first=True, backend="cpu" if "cpu" in BACKENDS else "reference")
    x = torch.randn(2, 5, 8)
    rec = GraphRecorder()
    o, w = torch.compile(m, backend=rec.backend)(x, x, x, average_attn_weights=False)
    xor = {torch.ops.aten.bitwise_xor.Tensor, torch.ops.aten.bitwise_xor.Scalar,
           torch.ops.aten.__xor__.Tensor, torch.ops.aten.__xor__.Scalar}
    assert rec.fw and not [t for gm in rec.fw for t in GraphRecorder.targets(gm) if t in xor]
    v = (x @ m.in_proj_weight[16:].T + m.in_proj_bias[16:]).view(2, 5, 2, 4).transpose(1, 2)
    torch.testing.assert_close(o, m.out_proj((w @ v).transpose(1, 2).reshape(2, 5, 8)))
    assert 0 < (w == 0).float().mean() < 1  # some weights dropped, not all
