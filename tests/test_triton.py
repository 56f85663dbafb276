"""Triton backend against the float64 reference (forward and backward), by the tolerance rule.

Without a GPU this runs the kernels through Triton's interpreter on CPU tensors (conftest sets
TRITON_INTERPRET=1), fp32 and fp16; bf16 is left to the GPU tests (the interpreter's bf16
tl.dot is wrong). Shapes stay small: the interpreter executes every program in Python.
"""
import pytest
import torch

import mhakern
from attn_testing import check_against_reference, make_inputs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERP_DTYPES = (torch.float32, torch.float16)
pytestmark = pytest.mark.skipif(
    mhakern.available_backends().get("triton", "absent") is not None,
    reason=f"triton backend unavailable: {mhakern.available_backends().get('triton', 'absent')}",
)


def triton_attention(*a, **kw):
    return mhakern.attention(*a, backend="triton", **kw)


@pytest.mark.parametrize("dtype", INTERP_DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_strided_blhd_inputs(dtype, causal):
    q, k, v = make_inputs(2, 4, 2, 23, 31, 64, dtype=dtype, device=DEVICE, layout="blhd")
    assert not q.is_contiguous() and q.stride(-1) == 1
    check_against_reference(triton_attention, q, k, v, causal, torch.tensor([31, 9], device=DEVICE))


@pytest.mark.parametrize("dtype", INTERP_DTYPES, ids=str)
def test_large_logits_do_not_overflow(dtype):
    # Inputs scaled by 30 (fp16: by 8, so q and k stay representable): scores in the thousands.
    s = 30.0 if dtype == torch.float32 else 8.0
    q, k, v = make_inputs(1, 2, 2, 33, 47, 64, dtype=dtype, device=DEVICE, scale_inputs=s)
    check_against_reference(triton_attention, q, k, v, True, None, large_logits=True)


@pytest.mark.parametrize("D", [16, 24, 64, 80, 96, 128])
def test_head_dims(D):
    q, k, v = make_inputs(1, 2, 1, 19, 21, D, device=DEVICE)
    check_against_reference(triton_attention, q, k, v, False, None)


@pytest.mark.parametrize("Lq,n_rep", [(1, 20), (3, 8), (1, 64)])
def test_decode_packs_query_heads_of_a_kv_head(Lq, n_rep):
    from mhakern.kernels.attention_fwd import launch_geometry
    from mhakern.kernels.heuristics import fwd_config

    B, Hkv, Lk, D = 3, 2, 45, 64
    cfg = fwd_config(D, D, torch.float32)
    hpp, bm, grid = launch_geometry(B, n_rep * Hkv, Hkv, Lq, cfg.block_m)
    # One program per (row tile, KV head, batch element): each reads its keys once for the group.
    assert hpp == n_rep and grid == (-(-(n_rep * Lq) // bm) * Hkv * B,)
    q, k, v = make_inputs(B, n_rep * Hkv, Hkv, Lq, Lk, D, device=DEVICE)
    check_against_reference(triton_attention, q, k, v, True, torch.tensor([45, 0, 17], device=DEVICE))


def test_trainer_shape_mqa_one_query_per_head():
    # The memorization trainer's call: H query heads, one shared context (MQA), Lq = 1.
    q, k, v = make_inputs(16, 20, 1, 1, 32, 64, device=DEVICE)
    check_against_reference(triton_attention, q, k, v, False, None)


def test_dv_differs_from_d_and_tiny_dims():
    q, k, v = make_inputs(2, 2, 2, 9, 13, 40, 1, device=DEVICE)  # the paper's d_v = 1
    check_against_reference(triton_attention, q, k, v, False, None)


def test_backward_is_deterministic():
    q, k, v = make_inputs(2, 4, 1, 37, 53, 32, device=DEVICE)
    grads = []
    for _ in range(2):
        for x in (q, k, v):
            x.grad = None
        triton_attention(q, k, v, causal=True).pow(2).sum().backward()
        grads.append([x.grad.clone() for x in (q, k, v)])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_head_dim_over_limit_is_refused_with_reason():
    q, k, v = make_inputs(1, 1, 1, 2, 2, 300, device=DEVICE, requires_grad=False)
    with pytest.raises(ValueError, match="triton: head dim 300 exceeds 256"):
        triton_attention(q, k, v)
    # auto still serves it (falls back)
    assert mhakern.attention(q, k, v).shape == (1, 1, 2, 300)


def test_auto_never_picks_the_interpreter():
    if DEVICE == "cuda":
        pytest.skip("interpreter-only check")
    from mhakern import backends

    q, k, v = make_inputs(1, 2, 2, 4, 4, 16, requires_grad=False)
    assert backends.select("auto", q, k, v, False, None).name != "triton"


def _kernel_sources():
    import pathlib

    import mhakern.kernels

    return sorted(pathlib.Path(mhakern.kernels.__file__).parent.glob("*.py"))


def test_kernels_import_nothing_from_mhakern():
    # The kernel layer sits below the package: launchers take the buffers the backend allocates.
    import ast

    files = _kernel_sources()
    assert len(files) >= 4, files
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            for name in names:
                assert name.split(".")[0] != "mhakern", f"{path.name}:{node.lineno} imports {name}"


class _GridRecorder:
    """Stands in for a kernel: records each launch's grid instead of running it."""

    def __init__(self, grids, name):
        self.grids, self.name = grids, name

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.grids.append((self.name, tuple(grid)))

        return launch


def test_batches_beyond_cuda_grid_axis_limits_launch_within_them(monkeypatch):
    # The trainer (fp32, hence Triton on a GPU) reaches runs x batch > 65,535, CUDA's limit on
    # grid axes 1 and 2. Every launch uses a flat grid on axis 0 instead. Running 65,537
    # batch elements through the interpreter would take hours (about 0.1 s per program here),
    # so this records the grids the launchers ask for; the folding itself (program id ->
    # row tile, head, batch element) runs in every interpreter test of this file.
    from mhakern.kernels import attention_bwd, attention_fwd

    grids = []
    for mod, name in [(attention_fwd, "_attn_fwd_kernel"), (attention_bwd, "_bwd_delta_kernel"),
                      (attention_bwd, "_attn_bwd_dkdv_kernel"), (attention_bwd, "_attn_bwd_dq_kernel")]:
        monkeypatch.setattr(mod, name, _GridRecorder(grids, name))
    B, H, Hkv, Lq, Lk, D = 70000, 4, 2, 3, 5, 16
    q = torch.zeros(B, H, Lq, D)
    k = torch.zeros(B, Hkv, Lk, D)
    assert mhakern.backends.get("triton").supports(q, k, k, False, None) is None
    from mhakern.backends import triton_backend

    be = triton_backend.TritonBackend()
    out, lse = be.forward(q, k, k, 0.25, True, None)
    assert be.backward(out, q, k, k, out, lse, 0.25, True, None)[3] is None
    assert [n for n, _ in grids] == ["_attn_fwd_kernel", "_bwd_delta_kernel", "_attn_bwd_dkdv_kernel",
                                     "_attn_bwd_dq_kernel"]
    for name, grid in grids:
        assert len(grid) == 1 and B <= grid[0] <= 2**31 - 1, (name, grid)
    # forward and dQ: one program per (row tile, head group, batch element); here decode packing
    # puts the 2 query heads of a KV head in one 16-row tile; dK/dV: one per (key block, KV head, b)
    assert dict(grids)["_attn_fwd_kernel"] == (B * Hkv,)
    assert dict(grids)["_attn_bwd_dkdv_kernel"] == (B * Hkv,)


def test_grid_folding_covers_every_batch_element_and_head():
    # Many (row tile, head, batch) programs in one flat grid: each output row written once, right.
    q, k, v = make_inputs(7, 6, 3, 21, 19, 16, device=DEVICE)
    check_against_reference(triton_attention, q, k, v, True, torch.tensor([19, 0, 5, 19, 1, 12, 18], device=DEVICE))


def test_on_device_guard_selects_the_tensors_device():
    import contextlib

    from torch._subclasses.fake_tensor import FakeTensorMode

    from mhakern.kernels.attention_fwd import on_device

    with FakeTensorMode():
        t = torch.empty(2, device="cuda:1")
    guard = on_device(t)
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    assert isinstance(on_device(torch.empty(2)), contextlib.nullcontext)


def test_launchers_run_under_the_device_guard(monkeypatch):
    import contextlib

    from mhakern.kernels import attention_bwd, attention_fwd

    entered = []

    @contextlib.contextmanager
    def recording_guard(t):
        entered.append(t.device)
        yield

    monkeypatch.setattr(attention_fwd, "on_device", recording_guard)
    monkeypatch.setattr(attention_bwd, "on_device", recording_guard)
    q, k, v = make_inputs(1, 2, 1, 5, 6, 16, device=DEVICE)
    triton_attention(q, k, v).sum().backward()
    assert len(entered) == 2, entered


def test_launchers_refuse_wrong_output_buffers():
    from mhakern.kernels import attention_forward

    q, k, v = make_inputs(1, 2, 1, 5, 6, 16, device=DEVICE, requires_grad=False)
    lse = torch.empty(1, 2, 5)
    with pytest.raises(ValueError, match="out: expected a torch.float32 tensor of shape \\(1, 2, 5, 16\\)"):
        attention_forward(q, k, v, torch.empty(1, 2, 5, 8), lse, 0.25, False)
    with pytest.raises(ValueError, match="lse: expected a contiguous tensor"):
        attention_forward(q, k, v, torch.empty(1, 2, 5, 16), torch.empty(1, 5, 2).transpose(1, 2), 0.25, False)
    with pytest.raises(ValueError, match="out: expected unit stride on the last dim"):
        attention_forward(q, k, v, torch.empty(1, 2, 16, 5).transpose(2, 3), lse, 0.25, False)


def test_key_lengths_out_of_range_are_clamped_in_the_kernels():
    # Callers validate key_lengths; the kernels still never read outside k and v with a bad one.
    from mhakern.kernels import attention_backward, attention_forward

    q, k, v = make_inputs(2, 2, 1, 4, 6, 16, device=DEVICE, requires_grad=False)
    scale = 0.25

    def run(kl):
        out, lse = torch.empty(2, 2, 4, 16), torch.empty(2, 2, 4)
        attention_forward(q, k, v, out, lse, scale, True, kl)
        grads = [torch.empty_like(x) for x in (q, k, v)]
        attention_backward(torch.ones_like(out), q, k, v, out, lse, *grads, scale, True, kl)
        return [out, lse, *grads]

    bad = run(torch.tensor([100, -5], dtype=torch.int32))
    good = run(torch.tensor([6, 0], dtype=torch.int32))
    for a, b in zip(bad, good):
        assert torch.equal(a, b)
