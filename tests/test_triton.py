"""Triton backend against the float64 reference (forward and backward), by the tolerance rule.

Without a GPU this runs the kernels through Triton's interpreter on CPU tensors (conftest sets
TRITON_INTERPRET=1), fp32 and fp16; bf16 is left to the GPU tests (the interpreter's bf16
tl.dot is wrong). Shapes stay small: the interpreter executes every program in Python.
"""
import pytest
import torch

import mhakern
from mhakern.backends import Modes
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
    from mhakern.kernels.launch import launch_geometry
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


def test_kernel_modules_import_one_way_and_no_private_names():
    # tiles.py (jit helpers) and launch.py (host helpers) serve the kernel modules; no module
    # takes another's underscored names, and the graph of imports inside kernels/ has no cycle
    # (the package's __init__ counts as the module "__init__").
    import ast

    graph = {}
    for path in _kernel_sources():
        deps = graph.setdefault(path.stem, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                for alias in node.names:
                    if node.module:
                        deps.add(node.module)
                        assert not alias.name.startswith("_"), f"{path.name}:{node.lineno} imports {alias.name}"
                    else:
                        deps.add(alias.name if (path.parent / f"{alias.name}.py").exists() else "__init__")
    seen, done = set(), set()

    def visit(mod, trail):
        assert mod not in seen - done, f"import cycle: {' -> '.join(trail + [mod])}"
        if mod in done:
            return
        seen.add(mod)
        for dep in graph.get(mod, ()):
            visit(dep, trail + [mod])
        done.add(mod)

    for mod in graph:
        visit(mod, [])
    assert graph["attention_fwd"] >= {"tiles", "launch"} and not graph["tiles"] & {"attention_fwd", "attention_bwd"}


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
                      (attention_bwd, "_attn_bwd_fused_kernel")]:
        monkeypatch.setattr(mod, name, _GridRecorder(grids, name))
    B, H, Hkv, Lq, Lk, D = 70000, 4, 2, 3, 5, 16
    q = torch.zeros(B, H, Lq, D)
    k = torch.zeros(B, Hkv, Lk, D)
    assert mhakern.backends.get("triton").supports(q, k, k, False, None) is None
    from mhakern.backends import triton_backend

    be = triton_backend.TritonBackend()
    out, lse = be.forward(q, k, k, 0.25, True, None)
    assert be.backward(out, q, k, k, out, lse, 0.25, True, None)[3] is None
    assert [n for n, _ in grids] == ["_attn_fwd_kernel", "_bwd_delta_kernel", "_attn_bwd_fused_kernel"]
    for name, grid in grids:
        assert len(grid) == 1 and B <= grid[0] <= 2**31 - 1, (name, grid)
    # forward: one program per (row tile, head group, batch element); here decode packing puts
    # the 2 query heads of a KV head in one 16-row tile; the fused backward: one per (key block,
    # KV head, b). (The split kernels' grids are the same functions': launch_geometry.)
    assert dict(grids)["_attn_fwd_kernel"] == (B * Hkv,)
    assert dict(grids)["_attn_bwd_fused_kernel"] == (B * Hkv,)


def test_grid_folding_covers_every_batch_element_and_head():
    # Many (row tile, head, batch) programs in one flat grid: each output row written once, right.
    q, k, v = make_inputs(7, 6, 3, 21, 19, 16, device=DEVICE)
    check_against_reference(triton_attention, q, k, v, True, torch.tensor([19, 0, 5, 19, 1, 12, 18], device=DEVICE))


def test_on_device_guard_selects_the_tensors_device():
    import contextlib

    from torch._subclasses.fake_tensor import FakeTensorMode

    from mhakern.kernels.launch import on_device

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


# ---------------------------------------------------------------------------------------------
# Optional modes (docs/contract.md) beyond the conformance suite's cases: combinations with GQA,
# decode packing, key lengths, Lq != Lk, D != Dv and non-power-of-two dims; broadcast masks; the
# skipping of hidden key tiles; dropout's keep bits for any seed; hidden NaNs with masks.


def _mask(shape, seed, kind, p_hide=0.3, grad=False):
    g = torch.Generator().manual_seed(seed)
    if kind == "bool":
        return (torch.rand(shape, generator=g) >= p_hide).to(DEVICE)
    m = torch.randn(shape, generator=g)
    m[torch.rand(shape, generator=g) < p_hide] = float("-inf")
    return m.to(DEVICE).requires_grad_(grad)


MODE_COMBOS = {
    # id: (dtype, (B, H, Hkv, Lq, Lk, D, Dv), causal, key_lengths, mode kwargs builder)
    "window-boolmask-b11k-gqa-kl": (torch.float32, (2, 6, 2, 13, 37, 24, 40), False, (37, 11),
                                    lambda: dict(window=(4, 3), attn_mask=_mask((2, 1, 1, 37), 1, "bool"))),
    "topleft-causal-floatgrad-11qk-dropout": (torch.float16, (2, 4, 2, 21, 9, 16, 8), True, None,
                                              lambda: dict(causal_align="top_left", dropout_p=0.25,
                                                           generator=torch.Generator().manual_seed(3),
                                                           attn_mask=_mask((1, 1, 21, 9), 2, "float", grad=True))),
    "diagonal-window-longq": (torch.float32, (1, 2, 1, 40, 23, 8, 8), False, (20,), lambda: dict(window=(0, 0))),
    "decode-packed-window-causal-floatgrad": (torch.float32, (2, 8, 2, 3, 70, 16, 16), True, (70, 33),
                                              lambda: dict(window=(9, -1), attn_mask=_mask((2, 8, 3, 1), 4, "float",
                                                                                         p_hide=0.2, grad=True))),
    "right-window-topleft-dropout-mask-kl": (torch.float16, (2, 2, 2, 35, 20, 32, 24), False, (20, 6),
                                             lambda: dict(window=(-1, 5), causal_align="top_left", dropout_p=0.5,
                                                          generator=torch.Generator().manual_seed(5),
                                                          attn_mask=_mask((35, 20), 6, "bool", p_hide=0.2))),
}


def test_long_window_runs_masked_and_unmasked_tiles_on_both_sides_of_the_band():
    # 192 x 192, top-left window (100, 70): with the interpreter's fp32 tiles (64-row forward
    # tiles, 64-key dK/dV blocks of 32-row steps) every row tile and key block has its left
    # masked part, an unmasked middle and its right masked part.
    q, k, v = make_inputs(1, 1, 1, 192, 192, 16, device=DEVICE)
    check_against_reference(triton_attention, q, k, v, False, None, window=(100, 70), causal_align="top_left")


@pytest.mark.parametrize("combo", list(MODE_COMBOS))
def test_modes_combined(combo):
    dtype, (B, H, Hkv, Lq, Lk, D, Dv), causal, kl, build = MODE_COMBOS[combo]
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, Dv, dtype=dtype, device=DEVICE)
    kl = None if kl is None else torch.tensor(kl, device=DEVICE)
    check_against_reference(triton_attention, q, k, v, causal, kl, **build())


@pytest.mark.parametrize("bwd", ["deterministic", "split"])
def test_window_skips_key_tiles_no_row_of_a_tile_sees(bwd):
    # The backward writes dL/dscore of every (row, key) pair it visits (0 where hidden): a
    # sentinel left in the buffer marks the tiles it skipped. Window (2, 2) on 130 x 130: the
    # tiles holding (row 0, key 129) and (row 129, key 0) lie outside every band, in the fused
    # kernel's tiling (key blocks x row steps) and in the split dQ kernel's (row tiles x keys).
    from mhakern.kernels import attention_backward, attention_forward

    B, H, L, D = 1, 1, 130, 16
    q, k, v = make_inputs(B, H, H, L, L, D, device=DEVICE, requires_grad=False)
    bias = torch.zeros(B, H, L, L, device=DEVICE)
    modes = Modes(attn_mask=bias, window_left=2, window_right=2)
    out, lse = torch.empty(B, H, L, D, device=DEVICE), torch.empty(B, H, L, device=DEVICE)
    attention_forward(q, k, v, out, lse, 0.25, False, None, modes)
    dmask = torch.full((B, H, L, L), 7.0, device=DEVICE)
    grads = [torch.empty_like(x) for x in (q, k, v)]
    attention_backward(torch.randn_like(out), q, k, v, out, lse, *grads, 0.25, False, None, modes, dmask=dmask,
                       bwd_mode=bwd)
    assert dmask[0, 0, 0, L - 1] == 7.0, "a key tile past every row's band was visited"
    assert dmask[0, 0, L - 1, 0] == 7.0, "a key tile before every row's band was visited"
    i = torch.arange(L).view(L, 1)
    j = torch.arange(L).view(1, L)
    band = (j >= i - 2) & (j <= i + 2)
    visited = dmask != 7.0
    assert torch.all(visited[0, 0][band]), "a visible pair was skipped"
    assert torch.all(dmask[0, 0][visited[0, 0] & ~band] == 0), "a hidden pair got a mask gradient"


@pytest.mark.parametrize("seed", [-1, -(2**63), 0x0123456789ABCDEF])
def test_dropout_keep_bits_match_the_reference_for_any_seed(seed):
    # v one-hot over the keys: out[..., j] is 0 exactly where key j is dropped for the row.
    from mhakern.kernels import attention_forward

    B, H, Hkv, Lq, Lk, p = 2, 4, 2, 5, 40, 0.37
    q = make_inputs(B, H, Hkv, Lq, Lk, 16, device=DEVICE, requires_grad=False)[0]
    k = torch.zeros(B, Hkv, Lk, 16, device=DEVICE)  # uniform probabilities: none underflows
    v = torch.eye(Lk, device=DEVICE).expand(B, Hkv, Lk, Lk).contiguous()
    out, lse = torch.empty(B, H, Lq, Lk, device=DEVICE), torch.empty(B, H, Lq, device=DEVICE)
    attention_forward(q, k, v, out, lse, 0.25, False, None, Modes(dropout_p=p, seed=seed))
    keep = mhakern.reference.dropout_keep_mask(seed, B, H, Lq, Lk, p, DEVICE)
    assert torch.equal(out != 0, keep)
    torch.testing.assert_close(out[keep], torch.full_like(out[keep], 1 / (Lk * (1 - p))))


def test_dropout_backward_is_deterministic_and_regenerates_the_forward_mask():
    q, k, v = make_inputs(1, 4, 2, 19, 26, 16, device=DEVICE)
    grads = []
    for _ in range(2):
        for x in (q, k, v):
            x.grad = None
        out = triton_attention(q, k, v, dropout_p=0.4, generator=torch.Generator().manual_seed(9), causal=True)
        out.pow(2).sum().backward()
        grads.append([out.detach(), *(x.grad.clone() for x in (q, k, v))])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_nan_in_keys_hidden_by_a_bool_mask_or_window_changes_nothing():
    # Keys 4 and 5 are masked for every query, keys 10.. lie outside every row's window.
    q, k, v = make_inputs(2, 2, 1, 6, 16, 16, device=DEVICE, requires_grad=False)
    mask = torch.ones(6, 16, dtype=torch.bool, device=DEVICE)
    mask[:, 4:6] = False
    kw = dict(attn_mask=mask, window=(3, 2), causal_align="top_left")

    def run(k, v):
        q_, k_, v_ = (x.detach().clone().requires_grad_() for x in (q, k, v))
        out, lse = triton_attention(q_, k_, v_, return_lse=True, **kw)
        out.backward(torch.ones_like(out))
        return out.detach(), lse, q_.grad, k_.grad, v_.grad

    clean = run(k, v)
    k, v = k.clone(), v.clone()
    for x in (k, v):
        x[:, :, 4:6] = float("nan")
        x[:, :, 10:] = float("nan")
        x[1, 0, 12, 3] = float("inf")
    got = run(k, v)
    for label, a, b in zip(("out", "lse", "dq", "dk", "dv"), clean, got):
        assert torch.equal(a, b), f"{label}: a NaN/inf in a hidden key changed the result"
    assert torch.all(got[3][:, :, 4:6] == 0) and torch.all(got[4][:, :, 10:] == 0), "hidden keys got a gradient"


def test_rows_that_see_no_key_under_masks_and_windows_give_zero_and_no_nan():
    # Row 1 fully masked, rows beyond Lk + 1 outside the top-left window; NaN queries there too.
    q, k, v = make_inputs(1, 2, 2, 12, 8, 16, device=DEVICE, requires_grad=False)
    bias = torch.randn(12, 8, device=DEVICE)
    bias[1] = float("-inf")
    q[:, :, 1] = float("nan")
    q = q.requires_grad_()
    k, v = k.requires_grad_(), v.requires_grad_()
    bias = bias.requires_grad_()
    out, lse = triton_attention(q, k, v, attn_mask=bias, window=(1, 1), causal_align="top_left", return_lse=True)
    dead = [1] + list(range(10, 12))
    assert torch.all(out[:, :, dead] == 0) and torch.isneginf(lse[:, :, dead]).all()
    out.sum().backward()
    for g in (q.grad, k.grad, v.grad, bias.grad):
        assert torch.isfinite(g).all()
    assert torch.all(q.grad[:, :, dead] == 0) and torch.all(bias.grad[dead] == 0)


def test_launchers_refuse_bad_mode_arguments():
    from mhakern.kernels import attention_forward

    q, k, v = make_inputs(1, 2, 1, 5, 6, 16, device=DEVICE, requires_grad=False)
    out, lse = torch.empty(1, 2, 5, 16), torch.empty(1, 2, 5)
    with pytest.raises(ValueError, match="dropout_p: expected 0 <= p < 1"):
        attention_forward(q, k, v, out, lse, 0.25, False, None, Modes(dropout_p=1.0))
    with pytest.raises(ValueError, match="attn_mask: expected bool or float32"):
        attention_forward(q, k, v, out, lse, 0.25, False, None, Modes(attn_mask=torch.zeros(1, 2, 5, 6, dtype=torch.int32)))
    with pytest.raises(ValueError, match="attn_mask: expected a 4-D"):
        attention_forward(q, k, v, out, lse, 0.25, False, None, Modes(attn_mask=torch.zeros(5, 6)))


# ---------------------------------------------------------------------------------------------
# Split-K forward (decode: few row tiles over long keys; mhakern/kernels/attention_fwd.py _split_forward)
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def forced_splits(request):
    from mhakern.kernels import attention_fwd

    prev = attention_fwd.force_splits(request.param)
    yield request.param
    attention_fwd.force_splits(prev)


# (B, H, Hkv, Lq, Lk, D, causal, key_lengths): decode with an empty batch element, MQA with
# long keys, causal rows whose tiles reach different key counts (so some splits see nothing),
# a row tile spanning two heads.
SPLIT_CASES = [
    (2, 8, 2, 1, 700, 64, False, [700, 0]),
    (1, 16, 1, 1, 1000, 32, False, None),
    (1, 4, 4, 37, 300, 32, True, None),
    (2, 4, 1, 3, 513, 64, True, [513, 40]),
]


@pytest.mark.parametrize("forced_splits", [2, 7], indirect=True)
@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: f"B{c[0]}H{c[1]}kv{c[2]}q{c[3]}k{c[4]}d{c[5]}")
def test_split_forward_against_the_reference(forced_splits, case):
    B, H, Hkv, Lq, Lk, D, causal, kl = case
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, device=DEVICE)
    klt = None if kl is None else torch.tensor(kl, device=DEVICE, dtype=torch.int32)
    check_against_reference(triton_attention, q, k, v, causal, klt)


@pytest.mark.parametrize("forced_splits", [4], indirect=True)
def test_split_forward_dead_rows_nan_scores_and_hidden_garbage(forced_splits):
    # A row that sees no key: 0 and -inf; keys past a length may hold NaN (never read into a
    # share); a NaN among the visible scores stays NaN in out and lse, as unsplit.
    q, k, v = make_inputs(2, 4, 2, 1, 400, 64, device=DEVICE, requires_grad=False)
    kl = torch.tensor([0, 250], device=DEVICE, dtype=torch.int32)
    k[1, :, 250:] = float("nan")
    v[1, :, 250:] = float("inf")
    out, lse = mhakern.attention(q, k, v, key_lengths=kl, backend="triton", return_lse=True)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()
    assert torch.isfinite(out[1]).all() and torch.isfinite(lse[1]).all()
    k2 = k.clone()
    k2[1, 0, 10] = float("nan")
    out2, lse2 = mhakern.attention(q, k2, v, key_lengths=kl, backend="triton", return_lse=True)
    assert torch.isnan(out2[1, :2]).all() and torch.isnan(lse2[1, :2]).all()  # the KV head's query heads
    assert torch.equal(out2[1, 2:], out[1, 2:])  # the other KV head's rows are untouched


def test_split_plan_fills_the_multiprocessors_within_its_limits():
    from mhakern.kernels.heuristics import MAX_SPLITS, MIN_BLOCKS_PER_SPLIT, plan_fwd_splits

    # decode, 32 programs (B 4 x 8 KV heads) on 132 SMs, 128k keys in blocks of 64: about two
    # programs per SM.
    assert plan_fwd_splits(32, 2048, 4 * 32, 128, 132) == 9
    assert plan_fwd_splits(200, 2048, 10**4, 128, 132) == 1  # the row tiles fill the GPU
    assert plan_fwd_splits(4, 3 * MIN_BLOCKS_PER_SPLIT, 4, 128, 132) == 3  # short keys cap it
    assert plan_fwd_splits(1, 10**6, 1, 128, 10**4) == MAX_SPLITS
    assert plan_fwd_splits(1, 10**6, 2**22, 128, 132) == 1  # 2**22 rows x 128 fp32: one share fills the workspace cap
    assert plan_fwd_splits(1, 10**6, 2**18, 128, 132) == 8  # 2**30 / (2**18 x 512 B)
    assert plan_fwd_splits(8, 10**4, 8, 64, 0) == 1  # no multiprocessors to fill (the interpreter)


def test_split_forward_is_refused_a_bad_forced_count():
    from mhakern.kernels import attention_fwd

    with pytest.raises(ValueError, match=r"force_splits: n must be an int in \[0, 128\]"):
        attention_fwd.force_splits(-1)
    with pytest.raises(ValueError, match="force_splits"):
        attention_fwd.force_splits(2.0)


# ---------------------------------------------------------------------------------------------
# The fused backward (mhakern/kernels/attention_bwd.py: one program per key block computes dK, dV and
# dQ's fp32 shares). The conformance suite runs it (the default, deterministic) on every hard
# case and mode; here the other two kernels on hard combinations, and the order of dQ's adds.


@pytest.mark.parametrize("bwd", ["atomic", "split"])
@pytest.mark.parametrize("combo", ["topleft-causal-floatgrad-11qk-dropout", "decode-packed-window-causal-floatgrad"])
def test_other_backward_kernels_on_mode_combinations(bwd, combo, monkeypatch):
    from mhakern.kernels import heuristics

    monkeypatch.setattr(heuristics, "BWD_MODE", bwd)
    dtype, (B, H, Hkv, Lq, Lk, D, Dv), causal, kl, build = MODE_COMBOS[combo]
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, Dv, dtype=dtype, device=DEVICE)
    kl = None if kl is None else torch.tensor(kl, device=DEVICE)
    check_against_reference(triton_attention, q, k, v, causal, kl, **build())


def test_backward_kernel_choice_is_refused_an_unknown_mode():
    from mhakern.kernels import heuristics

    with pytest.raises(ValueError, match="MHAKERN_TRITON_BWD / bwd_mode: expected one of"):
        heuristics.bwd_kernel(64, 64, torch.float16, "fast")
    assert heuristics.bwd_kernel(64, 64, torch.float16, None) == heuristics.BWD_MODE


@pytest.fixture
def reversed_program_order(monkeypatch):
    """Make the interpreter run a launch's programs last to first (it runs them one at a time,
    in grid order): a schedule a GPU may produce, and the worst for an ordered add."""
    if DEVICE != "cpu":
        pytest.skip("interpreter-only check")
    from triton.runtime import interpreter

    cls = type(interpreter.interpreter_builder)
    real = cls.set_grid_idx

    def set_grid_idx(self, x, y, z):
        real(self, self.grid_dim[0] - 1 - x, y, z)

    monkeypatch.setattr(cls, "set_grid_idx", set_grid_idx)


def _fused_grads(bwd, q, k, v, causal=False):
    from mhakern.kernels import attention_backward, attention_forward

    out, lse = torch.empty_like(q), torch.empty(q.shape[:3])
    attention_forward(q, k, v, out, lse, 0.25, causal)
    g = torch.Generator().manual_seed(5)
    dout = torch.randn(out.shape, generator=g)
    grads = [torch.empty_like(x) for x in (q, k, v)]
    attention_backward(dout, q, k, v, out, lse, *grads, 0.25, causal, bwd_mode=bwd)
    return grads


# 4 key blocks of 32 (the interpreter's fp32 tile) reach every row tile: dQ sums 4 shares.
_ORDER_SHAPE = (1, 2, 1, 24, 128, 16)


def test_deterministic_dq_is_bitwise_independent_of_the_program_order(request):
    q, k, v = make_inputs(*_ORDER_SHAPE[:5], _ORDER_SHAPE[5], device=DEVICE, requires_grad=False)
    first = _fused_grads("deterministic", q, k, v)
    again = _fused_grads("deterministic", q, k, v)
    request.getfixturevalue("reversed_program_order")
    reversed_ = _fused_grads("deterministic", q, k, v)
    for a, b, c in zip(first, again, reversed_):
        assert torch.equal(a, b) and torch.equal(a, c)
    # The atomic kernel's dQ follows the schedule: the same reversed order changes its bits
    # (so the equality above can fail), though both are right to rounding.
    atomic = _fused_grads("atomic", q, k, v)
    assert not torch.equal(atomic[0], first[0]), "reversing 4 fp32 shares changed no bit: the check is blind"
    torch.testing.assert_close(atomic[0], first[0], rtol=1e-5, atol=1e-6)
    assert torch.equal(atomic[1], first[1]) and torch.equal(atomic[2], first[2])  # dK, dV: no atomics


def test_a_dq_add_out_of_key_block_order_is_caught(monkeypatch):
    # A deliberate ordering bug: the ticket counter starts at 1, so key block 1 runs before key
    # block 0 and comes to add its dQ share first. Under the interpreter the wait is a check
    # (programs run one at a time: the turn must have come), which the launcher reports.
    if DEVICE != "cpu":
        pytest.skip("interpreter-only check")
    from mhakern.kernels import attention_bwd

    def skewed(n, device):
        locks = torch.zeros((n,), dtype=torch.int32, device=device)
        locks[0] = 1
        return locks

    monkeypatch.setattr(attention_bwd, "_lock_buffer", skewed)
    q, k, v = make_inputs(*_ORDER_SHAPE[:5], _ORDER_SHAPE[5], device=DEVICE, requires_grad=False)
    with pytest.raises(RuntimeError, match="dQ add out of key-block order"):
        _fused_grads("deterministic", q, k, v)


# ---------------------------------------------------------------------------------------------
# Score modifiers (softcap, ALiBi; docs/contract.md): the backend called directly with a Modes
# record, against the float64 reference by the tolerance rule, forward and backward (the mask's
# gradient included), on the hard cases: tanh bending (softcap 2) and barely (50), large logits
# under the cap, slopes per head and per batch element, both causal alignments, key lengths with
# rows that see no key, windows, GQA and decode packing, float and bool masks, dropout, Lq != Lk,
# D != Dv; the three backward kernels and the split-K forward.

def _slopes(B, H, per_batch, seed=0):
    g = torch.Generator().manual_seed(seed)
    if per_batch:
        return torch.rand(B, H, generator=g).to(DEVICE)
    return torch.rand(H, generator=g).to(DEVICE).expand(B, H)  # per head: stride 0 over B


def _check_modified(q, k, v, causal, kl, modes, scale=0.3):
    """out, lse, dq, dk, dv (and dmask with modes.mask_grad) of the triton backend against the
    reference (float64 for the oracle, the input dtype for the rule's torch math)."""
    from attn_testing import rule_check

    from mhakern import backends, reference

    be = backends.get("triton")
    dtype = q.dtype
    out, lse = be.forward(q, k, v, scale, causal, kl, modes)
    g = torch.Generator().manual_seed(7)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    dq, dk, dv, dmask = be.backward(dout.to(DEVICE, dtype), q, k, v, out, lse, scale, causal, kl, modes)
    klc = None if kl is None else kl.cpu()
    m = modes.attn_mask
    results = {}
    for wdt, upcast in ((torch.float64, True), (dtype, False)):
        leaves = [x.detach().cpu().to(wdt).requires_grad_() for x in (q, k, v)]
        mw = None
        if m is not None:
            mw = m.detach().cpu().to(wdt).requires_grad_(modes.mask_grad) if m.is_floating_point() else m.cpu()
        mods = modes._replace(attn_mask=mw, alibi_slopes=None if modes.alibi_slopes is None else modes.alibi_slopes.cpu())
        o = reference.attention(*leaves, scale, causal, klc, upcast=upcast, modes=mods)
        o.backward(dout.to(wdt))
        results[upcast] = (o, *(x.grad for x in leaves), None if not modes.mask_grad else mw.grad, mods)
    ref, math = results[True], results[False]
    rule_check("out", out, ref[0], math[0], dtype, 2.0)
    _, ref_lse = reference.attention_forward(*(x.detach().cpu().double() for x in (q, k, v)), scale, causal, klc,
                                             upcast=True, modes=ref[5]._replace(
                                                 attn_mask=None if ref[5].attn_mask is None else ref[5].attn_mask.detach()))
    dead = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse.cpu()), dead), "lse: -inf pattern differs from the reference"
    if (~dead).any():
        err = (lse.cpu().double() - ref_lse)[~dead].abs().max().item()
        assert err <= (1e-3 if dtype == torch.float32 else 2e-2) * max(1.0, ref_lse[~dead].abs().max().item()), err
    for name, got, i in (("dq", dq, 1), ("dk", dk, 2), ("dv", dv, 3)):
        rule_check(name, got, ref[i], math[i], dtype, 3.0)
    if modes.mask_grad:
        # dmask is dL/d(capped score) per (b, h, i, j); the reference's mask gradient is its sum
        # over the mask's broadcast dims.
        got = dmask.cpu().double().sum_to_size(m.shape)
        rule_check("dmask", got, ref[4], math[4], dtype, 3.0)
    assert (dmask is None) == (not modes.mask_grad)
    return out, lse


MODIFIER_CASES = {
    # id: (dtype, (B, H, Hkv, Lq, Lk, D, Dv), causal, key_lengths, input scale, Modes builder)
    # softcap 2 bends every score (inputs x4), slopes per batch element, bottom-right causal with
    # Lq > Lk (the leading rows see no key) and a batch element of length 0, GQA, D != Dv
    "cap2-alibi-per-b-causal-kl0-gqa": (torch.float32, (2, 4, 2, 23, 17, 16, 24), True, (17, 0), 4.0,
                                        lambda B, H, Lq, Lk: Modes(softcap=2.0, alibi_slopes=_slopes(B, H, True))),
    # softcap 50 (barely bends), per-head slopes, top-left window, a float mask with its gradient
    "cap50-alibi-per-h-topleft-window-floatgrad": (
        torch.float16, (2, 2, 2, 19, 30, 16, 16), True, (30, 12), 1.0,
        lambda B, H, Lq, Lk: Modes(softcap=50.0, alibi_slopes=_slopes(B, H, False, 1), top_left=True, window_left=5,
                                   attn_mask=_mask((1, H, Lq, Lk), 8, "float").expand(B, H, Lq, Lk),
                                   mask_grad=True)),
    # decode packing (the 4 query heads of a KV head in one tile), a bool mask, dropout, softcap 2
    # and per-batch slopes, no causal
    "decode-cap2-alibi-boolmask-dropout": (torch.float32, (2, 8, 2, 3, 37, 16, 16), False, (37, 20), 2.0,
                                           lambda B, H, Lq, Lk: Modes(softcap=2.0, alibi_slopes=_slopes(B, H, True, 2),
                                                                      attn_mask=_mask((B, 1, 1, Lk), 9, "bool").expand(B, H, Lq, Lk),
                                                                      dropout_p=0.3, seed=11)),
    # ALiBi alone on the plain path (no mode), fp16, Lq < Lk bottom-right causal
    "alibi-only-fp16-causal": (torch.float16, (1, 2, 1, 9, 33, 32, 32), True, None, 1.0,
                               lambda B, H, Lq, Lk: Modes(alibi_slopes=_slopes(B, H, True, 3))),
}


def _modifier_inputs(case):
    dtype, (B, H, Hkv, Lq, Lk, D, Dv), causal, kl, s, build = MODIFIER_CASES[case]
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, Dv, dtype=dtype, device=DEVICE, scale_inputs=s, requires_grad=False)
    kl = None if kl is None else torch.tensor(kl, dtype=torch.int32, device=DEVICE)
    return q, k, v, causal, kl, build(B, H, Lq, Lk)


@pytest.mark.parametrize("case", list(MODIFIER_CASES))
def test_score_modifiers_against_the_reference(case):
    _check_modified(*_modifier_inputs(case))


@pytest.mark.parametrize("bwd", ["atomic", "split"])
@pytest.mark.parametrize("case", ["cap2-alibi-per-b-causal-kl0-gqa", "cap50-alibi-per-h-topleft-window-floatgrad"])
def test_score_modifiers_in_the_other_backward_kernels(bwd, case, monkeypatch):
    from mhakern.kernels import heuristics

    monkeypatch.setattr(heuristics, "BWD_MODE", bwd)
    _check_modified(*_modifier_inputs(case))


@pytest.mark.parametrize("forced_splits", [3], indirect=True)
def test_split_forward_takes_the_score_modifiers(forced_splits, monkeypatch):
    # Decode with long keys: the split-K kernel with softcap and ALiBi (slopes per batch element),
    # key lengths cutting the shares unevenly.
    from mhakern.kernels import attention_fwd

    calls = []
    real = attention_fwd._split_forward
    monkeypatch.setattr(attention_fwd, "_split_forward", lambda *a: calls.append(1) or real(*a))
    B, H, Hkv, Lq, Lk, D = 2, 4, 1, 1, 300, 16
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, device=DEVICE, scale_inputs=3.0, requires_grad=False)
    modes = Modes(softcap=2.0, alibi_slopes=_slopes(B, H, True, 4) * 0.05)
    _check_modified(q, k, v, True, torch.tensor([300, 77], dtype=torch.int32, device=DEVICE), modes)
    assert calls, "the split kernel did not run"


def test_score_modifiers_keep_hidden_nans_out():
    # NaN in keys and values past a key length, and a NaN in a key outside some rows' window,
    # change nothing for the rows that do not see them, with softcap and ALiBi on (the cap turns
    # an infinite raw score finite, so hiding must not rest on the score being -inf, and a NaN
    # raw score must not reach dS through the cap's derivative).
    from mhakern import backends

    be = backends.get("triton")
    B, H, L, D = 2, 2, 16, 16
    q, k, v = make_inputs(B, H, H, L, L, D, device=DEVICE, requires_grad=False)
    kl = torch.tensor([16, 12], dtype=torch.int32, device=DEVICE)
    modes = Modes(softcap=2.0, alibi_slopes=_slopes(B, H, True, 5), window_left=3, window_right=0)
    dout = torch.randn(B, H, L, D, generator=torch.Generator().manual_seed(2)).to(DEVICE)

    def run(k, v):
        out, lse = be.forward(q, k, v, 0.25, False, kl, modes)
        return (out, lse, *be.backward(dout, q, k, v, out, lse, 0.25, False, kl, modes)[:3])

    clean = run(k, v)
    k2, v2 = k.clone(), v.clone()
    for x in (k2, v2):
        x[1, :, 12:] = float("nan")  # past element 1's length
    k2[0, :, 5, 3] = float("nan")  # key 5: outside the window of rows 9..15
    got = run(k2, v2)
    rows = slice(9, 16)
    for label, a, b in zip(("out", "lse", "dq"), clean, got):
        assert torch.equal(a[1], b[1]), f"{label}: a NaN past the key length changed the result"
        assert torch.equal(a[0][:, rows], b[0][:, rows]), f"{label}: a NaN outside the window changed the result"
    assert torch.all(got[3][1, :, 12:] == 0) and torch.all(got[4][1, :, 12:] == 0)


def test_launchers_refuse_bad_modifier_arguments():
    from mhakern.kernels import attention_backward, attention_forward

    q, k, v = make_inputs(2, 2, 1, 5, 6, 16, device=DEVICE, requires_grad=False)
    out, lse = torch.empty(2, 2, 5, 16, device=DEVICE), torch.empty(2, 2, 5, device=DEVICE)
    for bad, match in [(Modes(softcap=-1.0), "softcap: expected a finite value >= 0"),
                       (Modes(softcap=float("nan")), "softcap: expected a finite value >= 0"),
                       (Modes(alibi_slopes=torch.ones(2, device=DEVICE)), r"alibi_slopes: expected a float32 \(B, H\)"),
                       (Modes(alibi_slopes=torch.ones(2, 2, dtype=torch.float64, device=DEVICE)), "alibi_slopes"),
                       (Modes(sinks=torch.zeros(2, device=DEVICE)), "sinks: the kernels never see them")]:
        with pytest.raises(ValueError, match=match):
            attention_forward(q, k, v, out, lse, 0.25, False, None, bad)
        with pytest.raises(ValueError, match=match):
            attention_backward(out, q, k, v, out, lse, torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
                               0.25, False, None, bad)


def test_score_modifiers_never_take_the_descriptor_kernel(monkeypatch):
    from mhakern import backends
    from mhakern.kernels import attention_fwd_desc, heuristics

    if not heuristics._descriptors_available():
        pytest.skip("this triton has no tensor descriptors")
    monkeypatch.setattr(heuristics, "DESC_MODE", "1")
    calls = []
    monkeypatch.setattr(attention_fwd_desc, "desc_forward", lambda *a, **kw: calls.append(1))
    q, k, v = (torch.randn(1, 2, 12, 16, dtype=torch.float16, device=DEVICE) for _ in range(3))
    be = backends.get("triton")
    for modes in (Modes(softcap=5.0), Modes(alibi_slopes=_slopes(1, 2, True))):
        out, _ = be.forward(q, k, v, 0.25, True, None, modes)
        assert out is not None and not calls, "a call with a score modifier went through the descriptor kernel"
    be.forward(q, k, v, 0.25, True, None, Modes())
    assert calls, "the forced descriptor path is not taken by a plain call: the check above is blind"
