"""Triton backend on a CUDA device: bf16 (the interpreter cannot check it), larger shapes, long
keys. Skipped without a GPU (conftest marks ``gpu`` tests)."""
import pytest
import torch

import mhakern
from attn_testing import HARD_CASES, case_id, check_against_reference, make_inputs
from packed_cache_testing import check_kvcache, check_packed

pytestmark = pytest.mark.gpu


def triton_attention(*a, **kw):
    return mhakern.attention(*a, backend="triton", **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", HARD_CASES, ids=case_id)
def test_hard_cases_gpu(case, dtype):
    B, H, Hkv, Lq, Lk, D, Dv, causal, kl = case
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, Dv, dtype=dtype, device="cuda")
    kl_t = None if kl is None else torch.tensor(kl, device="cuda")
    check_against_reference(triton_attention, q, k, v, causal, kl_t)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("D", [64, 96, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_larger_shapes_gpu(dtype, D, causal):
    q, k, v = make_inputs(2, 4, 2, 1000, 1100, D, dtype=dtype, device="cuda", layout="blhd")
    check_against_reference(triton_attention, q, k, v, causal, torch.tensor([1100, 517], device="cuda"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_long_keys_decode_gpu(dtype):
    q, k, v = make_inputs(1, 16, 1, 1, 1 << 18, 64, dtype=dtype, device="cuda")
    check_against_reference(triton_attention, q, k, v, False, None)


def test_large_logits_gpu():
    q, k, v = make_inputs(1, 4, 2, 257, 300, 64, dtype=torch.bfloat16, device="cuda", scale_inputs=30.0)
    check_against_reference(triton_attention, q, k, v, True, None)


def test_auto_picks_a_compiled_gpu_backend():
    q, k, v = make_inputs(1, 2, 2, 8, 8, 64, dtype=torch.float16, device="cuda", requires_grad=False)
    from mhakern import backends

    assert backends.select("auto", q, k, v, False, None).name in ("cuda", "triton")


def test_backward_deterministic_gpu():
    q, k, v = make_inputs(2, 8, 2, 700, 900, 128, dtype=torch.bfloat16, device="cuda")
    runs = []
    for _ in range(2):
        for x in (q, k, v):
            x.grad = None
        triton_attention(q, k, v, causal=True).float().pow(2).sum().backward()
        runs.append([x.grad.clone() for x in (q, k, v)])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("Lk", [1, 77, 4099])
def test_decode_packing_gpu(dtype, Lk):
    """Lq = 1 with 32 query heads over 8 KV heads: the four query heads of a group share a tile."""
    q, k, v = make_inputs(3, 32, 8, 1, Lk, 128, dtype=dtype, device="cuda")
    kl = torch.tensor([Lk, max(Lk // 2, 1), 0], device="cuda")
    check_against_reference(triton_attention, q, k, v, False, kl)


@pytest.mark.parametrize("D", [64, 128])
def test_packed_sequences_gpu(D):
    """Packed sequences, forward and the default (fused deterministic) backward, in bf16."""
    check_packed("triton", [77, 0, 1, 300, 5], [90, 3, 1, 260, 40], 8, 2, D, torch.bfloat16, "cuda")


@pytest.mark.parametrize("kind", ["cache_batch_idx", "paged"])
@pytest.mark.parametrize("Lq,L", [(1, 8192), (4, 640)], ids=["decode-splitk", "4q"])
def test_kvcache_decode_gpu(kind, Lq, L):
    """The KV cache in bf16: one query over 8k keys (the planner splits them) and four queries."""
    check_kvcache("triton", kind, 2, 32, 8, Lq, L, [L - 3, 0] if Lq == 1 else [L, 133], 128, torch.bfloat16, "cuda")


def test_batch_above_the_grid_limit_gpu():
    """More batch elements than CUDA's grid axes y/z hold (65,535): the trainer's stacked runs."""
    q, k, v = make_inputs(70_000, 1, 1, 1, 8, 16, dtype=torch.float32, device="cuda")
    check_against_reference(triton_attention, q, k, v, False, None)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_runs_on_the_tensors_device_not_the_current_one_gpu():
    q, k, v = make_inputs(1, 4, 2, 65, 70, 64, dtype=torch.float16, device="cuda:1")
    with torch.cuda.device(0):
        check_against_reference(triton_attention, q, k, v, True, None)


class _KernelRecorder:
    """Forwards to a Triton kernel and keeps the compiled kernel each launch returns."""

    def __init__(self, kernel, name, seen):
        self.kernel, self.name, self.seen = kernel, name, seen

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            compiled = launch(*args, **kwargs)
            self.seen.append((self.name, compiled))
            return compiled

        return run


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("D", [64, 128, 256])
def test_launched_kernels_do_not_spill_gpu(monkeypatch, dtype, D):
    """What tests/test_triton_aot.py checks ahead of time, on the kernels this GPU really compiles
    (``n_spills`` is Triton's count of spilled 4-byte words)."""
    from mhakern.kernels import aot, attention_bwd, attention_fwd

    seen = []
    for mod, name in [(attention_fwd, "_attn_fwd_kernel"), (attention_bwd, "_bwd_delta_kernel"),
                      (attention_bwd, "_attn_bwd_dkdv_kernel"), (attention_bwd, "_attn_bwd_dq_kernel")]:
        monkeypatch.setattr(mod, name, _KernelRecorder(getattr(mod, name), name, seen))
    q, k, v = make_inputs(2, 4, 2, 300, 333, D, dtype=dtype, device="cuda")
    kl = torch.tensor([333, 100], device="cuda")
    triton_attention(q, k, v, causal=True, key_lengths=kl).float().sum().backward()
    launched = [n for n, _ in seen]
    assert launched == ["_attn_fwd_kernel", "_bwd_delta_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel"], launched
    for name, compiled in seen:
        assert compiled.n_spills * 4 <= aot.STACK_SLACK, f"{name}: {compiled.n_regs} regs, {compiled.n_spills} words spilled"
