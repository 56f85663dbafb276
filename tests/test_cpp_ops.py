"""The C++ kernels as dispatcher operators (torch.ops.mhakern_C.*): schemas, the meta (fake)
kernels torch.compile relies on, and torch's own consistency checks of a custom op.

Bad input at this boundary: tests/test_cpp_errors.py."""
import json

import pytest
import torch

import mhakern
from attn_testing import make_inputs

_WHY = mhakern.available_backends().get("cpu", "backend 'cpu' is not registered")
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"mhakern._C unavailable: {_WHY}")

NOMODES = (None, 0.0, 0, False, -1, -1)  # attn_mask, dropout_p, seed, top_left, window_left, window_right


def _args(layout="bhld", kl=True):
    q, k, v = make_inputs(2, 4, 2, 9, 13, 32, 24, layout=layout, requires_grad=False)
    key_lengths = torch.tensor([13, 5], dtype=torch.int32) if kl else None
    return q, k, v, 0.2, True, key_lengths


def test_schemas_match_the_interface():
    fwd = torch.ops.mhakern_C.fwd.default._schema
    bwd = torch.ops.mhakern_C.bwd.default._schema
    assert [a.name for a in fwd.arguments] == [
        "q", "k", "v", "scale", "causal", "key_lengths", "attn_mask", "dropout_p", "seed", "top_left",
        "window_left", "window_right", "softcap", "alibi_slopes", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
        "max_seqlen_k", "cache_batch_idx", "block_table", "dropout_q0", "dropout_k0", "dropout_h0", "dropout_heads"]
    assert [r.name for r in fwd.returns] == ["out", "lse"]
    assert [a.name for a in bwd.arguments] == [
        "dout", "q", "k", "v", "out", "lse", "scale", "causal", "key_lengths", "attn_mask", "dropout_p", "seed",
        "top_left", "window_left", "window_right", "mask_grad", "softcap", "alibi_slopes", "cu_seqlens_q",
        "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "cache_batch_idx", "block_table", "dropout_q0", "dropout_k0", "dropout_h0", "dropout_heads"]
    assert [r.name for r in bwd.returns] == ["dq", "dk", "dv", "dmask"]


@pytest.mark.parametrize("layout", ["bhld", "blhd"])
def test_meta_kernels_give_the_real_shapes_dtypes_and_strides(layout):
    q, k, v, scale, causal, kl = _args(layout)
    out, lse = torch.ops.mhakern_C.fwd(q, k, v, scale, causal, kl, *NOMODES)
    grads = torch.ops.mhakern_C.bwd(torch.randn_like(out), q, k, v, out, lse, scale, causal, kl, *NOMODES, False)
    meta = [x.to("meta") for x in (q, k, v)]
    m_out, m_lse = torch.ops.mhakern_C.fwd(*meta, scale, causal, kl.to("meta"), *NOMODES)
    m_grads = torch.ops.mhakern_C.bwd(m_out, *meta, m_out, m_lse, scale, causal, kl.to("meta"), *NOMODES, False)
    for real, fake in zip((out, lse, *grads), (m_out, m_lse, *m_grads)):
        assert fake.device.type == "meta"
        assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype, real.stride())


def test_dmask_is_allocated_on_request_only():
    # The meta kernel shows the allocation without any kernel implementing mask gradients.
    q, k, v, scale, causal, kl = (x.to("meta") if isinstance(x, torch.Tensor) else x for x in _args())
    mask = torch.zeros(1, 1, 9, 13, device="meta").expand(2, 4, 9, 13)
    out, lse = torch.ops.mhakern_C.fwd(q, k, v, scale, causal, kl, mask, 0.0, 0, False, -1, -1)
    *_, dmask = torch.ops.mhakern_C.bwd(out, q, k, v, out, lse, scale, causal, kl, mask, 0.0, 0, False, -1, -1, True)
    assert dmask.shape == (2, 4, 9, 13) and dmask.dtype == torch.float32 and dmask.is_contiguous()
    *_, none = torch.ops.mhakern_C.bwd(out, q, k, v, out, lse, scale, causal, kl, mask, 0.0, 0, False, -1, -1, False)
    assert none.shape == (0,) and none.dtype == torch.float32


def test_torch_opcheck_forward_and_backward():
    # Schema, fake-tensor kernel, and AOT dispatch agree with the real kernel (torch.library.opcheck).
    q, k, v, scale, causal, kl = _args()
    torch.library.opcheck(torch.ops.mhakern_C.fwd.default, (q, k, v, scale, causal, kl, *NOMODES))
    out, lse = torch.ops.mhakern_C.fwd(q, k, v, scale, causal, kl, *NOMODES)
    torch.library.opcheck(torch.ops.mhakern_C.bwd.default,
                          (torch.randn_like(out), q, k, v, out, lse, scale, causal, kl, *NOMODES, False))


def test_ops_compile_with_fullgraph():
    q, k, v, scale, causal, kl = _args()

    def f(q, k, v):
        out, lse = torch.ops.mhakern_C.fwd(q, k, v, scale, causal, kl, *NOMODES)
        return out * 2, lse

    torch._dynamo.reset()
    try:
        got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    finally:
        torch._dynamo.reset()
    want = f(q, k, v)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_capabilities_is_json_with_both_families():
    caps = json.loads(torch.ops.mhakern_C.capabilities())
    assert set(caps) == {"cpu", "cuda"}
    assert caps["cpu"]["compiled"] is True and isinstance(caps["cuda"]["compiled"], bool)
    for fam in caps.values():
        assert set(fam["features"]) <= mhakern.backends.ALL_FEATURES
    # The sm_90a forward family sits inside the cuda block: compiled only with CUDA and 9.0 in
    # the arch list (never in a CPU-only build). Its head dims are the cuda family's plus those
    # only its forward serves (fwd_only_head_dims: D 256, whose backward is the mma.sync
    # family's fused kernel: cuda.bwd.bwd_only_head_dims).
    sm90 = caps["cuda"]["sm90"]
    assert sm90["passes"] == ["fwd", "bwd"] and sm90["capability"] == [9, 0]
    assert sm90["bwd_head_dims"] and set(sm90["bwd_head_dims"]) == {int(d) for d in sm90["bwd_dq_tile"]}
    assert set(sm90["bwd_head_dims"]) <= set(caps["cuda"]["head_dims"])
    fwd_only = set(sm90["fwd_only_head_dims"])
    assert fwd_only == set(sm90["head_dims"]) - set(caps["cuda"]["head_dims"]) and sm90["head_dims"]
    assert not fwd_only & set(sm90["bwd_head_dims"])
    assert 256 in fwd_only and set(sm90["fwd_tiles"]) == {str(d) for d in sm90["head_dims"]}
    assert not sm90["compiled"] or caps["cuda"]["compiled"]
    # The mma.sync backward: which kernel runs by default, whether each is deterministic, and a
    # backward for every head dim the family serves, D 256 (forward on sm_90a only) included.
    bwd = caps["cuda"]["bwd"]
    assert bwd["default"] in bwd["kernels"] and set(bwd["kernels"]) == {"split", "fused", "fused_atomic"}
    assert [bwd["kernels"][k]["deterministic"] for k in ("split", "fused", "fused_atomic")] == [True, True, False]
    assert [bwd["kernels"][k]["products_per_tile"] for k in ("split", "fused", "fused_atomic")] == [7, 5, 5]
    assert set(bwd["head_dims"]) == set(caps["cuda"]["head_dims"]) | set(bwd["bwd_only_head_dims"])
    assert 256 in bwd["bwd_only_head_dims"] and fwd_only <= set(bwd["head_dims"])
    assert set(bwd["fused_tiles"]) == {str(d) for d in bwd["head_dims"]}


def test_the_module_links_no_pybind11():
    # Errors cross into Python only through torch's operator machinery: the module holds no
    # pybind11 of its own (a pybind11 differing from torch's was one hypothesis for the
    # TORCH_CHECK crash seen on a GPU machine).
    import shutil
    import subprocess

    import mhakern._C

    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not installed")
    res = subprocess.run([nm, "-D", "-C", mhakern._C.__file__], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "PyInit__C" in res.stdout
    assert "pybind11" not in res.stdout


def test_forward_family_hook_round_trips_and_names_its_choices():
    # The GPU tests' and benchmarks' switch between the CUDA forward families (op_common.h); it
    # exists in every build, so its argument check is tested here.
    prev = torch.ops.mhakern_C.cuda_force_fwd_family("mma_sync")
    try:
        assert torch.ops.mhakern_C.cuda_force_fwd_family("mma_sync") == "mma_sync"
        with pytest.raises(ValueError, match=r"family must be 'auto' or 'mma_sync', got 'sm90'"):
            torch.ops.mhakern_C.cuda_force_fwd_family("sm90")
        assert torch.ops.mhakern_C.cuda_force_fwd_family("auto") == "mma_sync"  # a refused call changes nothing
    finally:
        torch.ops.mhakern_C.cuda_force_fwd_family(prev)


def test_mma_backward_kernel_hook_round_trips_and_names_its_choices():
    # Which backward the mma.sync family runs (op_common.h KernelSetting mma_bwd_kernel; the names are
    # capabilities()["cuda"]["bwd"]["kernels"]): the GPU tests' and benchmarks' switch.
    kernels = json.loads(torch.ops.mhakern_C.capabilities())["cuda"]["bwd"]["kernels"]
    prev = torch.ops.mhakern_C.cuda_force_mma_bwd_kernel("fused")
    try:
        for name in kernels:
            torch.ops.mhakern_C.cuda_force_mma_bwd_kernel(name)
            assert torch.ops.mhakern_C.cuda_force_mma_bwd_kernel(name) == name
        with pytest.raises(ValueError, match=r"kernel must be 'default' or 'split' or 'fused' or 'fused_atomic', got 'x'"):
            torch.ops.mhakern_C.cuda_force_mma_bwd_kernel("x")
        assert torch.ops.mhakern_C.cuda_force_mma_bwd_kernel("default") == name  # a refused call changes nothing
    finally:
        torch.ops.mhakern_C.cuda_force_mma_bwd_kernel(prev)


def test_sm90_backward_kernel_hook_round_trips_and_capabilities_report_the_choice():
    # Which backward the sm90 family runs (op_common.h KernelSetting sm90_bwd_kernel; the names
    # are capabilities()["cuda"]["sm90"]["bwd_kernels"]): the JSON reports the current choice
    # and its determinism, the default stays capabilities.h kSm90BwdFused's.
    def sm90():
        return json.loads(torch.ops.mhakern_C.capabilities())["cuda"]["sm90"]

    import re
    from pathlib import Path

    header = (Path(__file__).resolve().parents[1] / "csrc" / "capabilities.h").read_text()
    names = re.findall(r'"(\w+)"', re.search(r"kSm90BwdKernelNames\[\] = \{([^}]*)\}", header).group(1))
    default = "fused" if re.search(r"constexpr bool kSm90BwdFused = (true|false);", header).group(1) == "true" else "split"
    table = sm90()
    assert list(table["bwd_kernels"]) == names and "split" in names and "fused" in names
    assert table["bwd_kernel_default"] == default
    assert all(isinstance(k["deterministic"], bool) for k in table["bwd_kernels"].values())
    prev = torch.ops.mhakern_C.cuda_force_sm90_bwd_kernel("fused")
    try:
        for name in ("split", "fused", "default"):
            torch.ops.mhakern_C.cuda_force_sm90_bwd_kernel(name)
            assert torch.ops.mhakern_C.cuda_force_sm90_bwd_kernel(name) == name
            now = sm90()
            assert now["bwd_kernel"] == (default if name == "default" else name)
            assert now["bwd_deterministic"] == now["bwd_kernels"][now["bwd_kernel"]]["deterministic"]
        with pytest.raises(ValueError, match=r"kernel must be 'default' or 'split' or 'fused', got 'fused_atomic'"):
            torch.ops.mhakern_C.cuda_force_sm90_bwd_kernel("fused_atomic")
        assert torch.ops.mhakern_C.cuda_force_sm90_bwd_kernel("split") == "default"  # a refused call changes nothing
    finally:
        torch.ops.mhakern_C.cuda_force_sm90_bwd_kernel(prev)


def test_sm90_backward_kernel_reads_its_environment_variable_at_load():
    # MHAKERN_CUDA_SM90_BWD=fused selects the fused kernel in a fresh process (read once, at load).
    import os
    import subprocess
    import sys

    code = ("import json, torch, mhakern; mhakern.available_backends(); "
            "print(json.loads(torch.ops.mhakern_C.capabilities())['cuda']['sm90']['bwd_kernel'], "
            "torch.ops.mhakern_C.cuda_force_sm90_bwd_kernel('default'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, MHAKERN_CUDA_SM90_BWD="fused"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split("\n")[-2] == "fused fused", r.stdout


def test_backward_family_hook_round_trips_and_names_its_choices():
    # The backward's twin (op_common.h: cuda_bwd_family).
    prev = torch.ops.mhakern_C.cuda_force_bwd_family("mma_sync")
    try:
        assert torch.ops.mhakern_C.cuda_force_bwd_family("mma_sync") == "mma_sync"
        with pytest.raises(ValueError, match=r"family must be 'auto' or 'mma_sync', got 'sm90'"):
            torch.ops.mhakern_C.cuda_force_bwd_family("sm90")
        assert torch.ops.mhakern_C.cuda_force_bwd_family("auto") == "mma_sync"  # a refused call changes nothing
    finally:
        torch.ops.mhakern_C.cuda_force_bwd_family(prev)


def test_the_sm90_backward_is_opt_in_until_a_gpu_has_verified_it():
    # Unset, MHAKERN_CUDA_BWD_FAMILY leaves the backward on mma.sync (capabilities.h:
    # kSm90BwdByDefault, reported as sm90.bwd_default); "auto" opts in. The variable is read
    # once, at load: the opt-in runs in a fresh process, the default here (every test that
    # changes the setting restores it).
    import os
    import subprocess
    import sys

    assert json.loads(torch.ops.mhakern_C.capabilities())["cuda"]["sm90"]["bwd_default"] is False
    if "MHAKERN_CUDA_BWD_FAMILY" not in os.environ:
        prev = torch.ops.mhakern_C.cuda_force_bwd_family("mma_sync")
        torch.ops.mhakern_C.cuda_force_bwd_family(prev)
        assert prev == "mma_sync"
    code = ("import torch, mhakern; mhakern.available_backends(); "
            "print(torch.ops.mhakern_C.cuda_force_bwd_family('mma_sync'), torch.ops.mhakern_C.cuda_force_fwd_family('auto'))")
    env = dict(os.environ, MHAKERN_CUDA_BWD_FAMILY="auto")
    env.pop("MHAKERN_CUDA_FWD_FAMILY", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split("\n")[-2] == "auto auto", r.stdout


@pytest.mark.parametrize("layout", ["bhld", "blhd"])
def test_plain_ops_are_the_full_ops_without_modes(layout):
    # fwd_plain / bwd_plain (what every call without modes runs) give the full ops' bits, real and
    # meta, and check their arguments the same way.
    q, k, v, scale, causal, kl = _args(layout)
    out, lse = torch.ops.mhakern_C.fwd(q, k, v, scale, causal, kl, *NOMODES)
    p_out, p_lse = torch.ops.mhakern_C.fwd_plain(q, k, v, scale, causal, kl)
    dout = torch.randn_like(out)
    grads = torch.ops.mhakern_C.bwd(dout, q, k, v, out, lse, scale, causal, kl, *NOMODES, False)
    p_grads = torch.ops.mhakern_C.bwd_plain(dout, q, k, v, out, lse, scale, causal, kl)
    for a, b in zip((out, lse, *grads), (p_out, p_lse, *p_grads)):
        assert torch.equal(a, b) and a.stride() == b.stride()
    meta = [x.to("meta") for x in (q, k, v)]
    m_out, m_lse = torch.ops.mhakern_C.fwd_plain(*meta, scale, causal, kl.to("meta"))
    m_grads = torch.ops.mhakern_C.bwd_plain(m_out, *meta, m_out, m_lse, scale, causal, kl.to("meta"))
    for real, fake in zip((out, lse, *grads), (m_out, m_lse, *m_grads)):
        assert (fake.device.type, fake.shape, fake.dtype, fake.stride()) == ("meta", real.shape, real.dtype,
                                                                             real.stride())
    with pytest.raises(ValueError, match="key_lengths: values must lie in"):
        torch.ops.mhakern_C.fwd_plain(q, k, v, scale, causal, torch.tensor([14, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="^q: expected 4 dims"):
        torch.ops.mhakern_C.fwd_plain(q[0], k, v, scale, causal, kl)
    with pytest.raises(ValueError, match="lse: expected shape"):
        torch.ops.mhakern_C.bwd_plain(dout, q, k, v, out, lse[:, :1], scale, causal, kl)
