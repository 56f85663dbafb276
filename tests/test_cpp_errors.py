"""Bad calls at the C++ boundary raise Python exceptions carrying their message; none crashes.

Each bad call goes straight to a dispatcher operator of mhakern._C (``torch.ops.mhakern_C.*``):
wrong rank, mismatched shapes, dtypes and devices, non-unit last stride, bad key_lengths
(dtype, shape, out-of-range values, in the forward and in the backward), bad masks and mode
arguments, a mode the kernel family does not implement, bad backward operands, and the meta
(fake-tensor) kernels on bad shapes. The calls run in a child process, one after another, each
announced before it runs: a crash (a signal, an abort, a non-Python exit) fails the test and
names the call that was running, instead of taking pytest down with it. A good call after all
the bad ones shows the module is still healthy.

The exception types are torch's translation of TORCH_CHECK_VALUE / _TYPE / _NOT_IMPLEMENTED:
ValueError, TypeError, NotImplementedError.
"""
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

import mhakern

_WHY = mhakern.available_backends().get("cpu", "backend 'cpu' is not registered")
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"mhakern._C unavailable: {_WHY}")

# name -> (python expression of the call, expected exception type, regex of its message). The
# expressions run in the child with: torch, fwd, bwd, good (a dict of good arguments), t(...)
# (random float32 tensor), i32(list) and the helpers below.
_SETUP = textwrap.dedent(
    """
    import json, sys, traceback
    import torch
    import mhakern._C  # registers torch.ops.mhakern_C
    ops = torch.ops.mhakern_C
    fwd, bwd = ops.fwd, ops.bwd

    def t(*shape, dtype=torch.float32, device="cpu"):
        return torch.randn(*shape).to(dtype=dtype, device=device)

    def i32(vals):
        return torch.tensor(vals, dtype=torch.int32)

    q, k, v = t(2, 4, 5, 16), t(2, 2, 7, 16), t(2, 2, 7, 16)
    NOMODES = (None, 0.0, 0, False, -1, -1)

    def F(q=q, k=k, v=v, scale=0.25, causal=False, kl=None, mask=None, p=0.0, seed=0, tl=False, wl=-1, wr=-1):
        return fwd(q, k, v, scale, causal, kl, mask, p, seed, tl, wl, wr)

    out, lse = F()
    dout = torch.randn_like(out)

    def B(dout=dout, q=q, k=k, v=v, out=out, lse=lse, scale=0.25, causal=False, kl=None, mask=None, p=0.0,
          seed=0, tl=False, wl=-1, wr=-1, mask_grad=False):
        return bwd(dout, q, k, v, out, lse, scale, causal, kl, mask, p, seed, tl, wl, wr, mask_grad)

    def M(x):
        return x.to("meta")

    cases = json.loads(sys.argv[1])
    for name, expr in cases:
        print("START " + name, flush=True)
        try:
            eval(expr)
        except Exception as e:  # the point: every bad call lands here, as an exception
            msg = str(e).splitlines()[0] if str(e) else ""
            print("RESULT " + json.dumps([name, type(e).__name__, str(e)]), flush=True)
        else:
            print("RESULT " + json.dumps([name, None, ""]), flush=True)
    # Healthy after all of that.
    o2, l2 = F()
    assert torch.equal(o2, out) and torch.equal(l2, lse)
    print("HEALTHY", flush=True)
    """
)


def _unimplemented_cpu_mode():
    """A (name, call) for a mode the cpu family does not implement, or None when it implements all."""
    import torch

    feats = set(json.loads(torch.ops.mhakern_C.capabilities())["cpu"]["features"])
    calls = {
        "attn_mask": "F(mask=torch.ones(2, 4, 5, 7, dtype=torch.bool))",
        "dropout": "F(p=0.5)",
        "top_left": "F(causal=True, tl=True)",
        "window": "F(wl=2)",
        "mask_grad": "B(mask=torch.zeros(2, 4, 5, 7), mask_grad=True)",
    }
    for name, call in calls.items():
        if name not in feats:
            return name, call
    return None


CASES = {
    # q, k, v
    "q_rank": ("F(q=t(2, 4, 16))", ValueError, r"q: expected 4 dims \(batch, heads, length, head_dim\), got shape \[2, 4, 16\]"),
    "k_rank": ("F(k=t(2, 7, 16))", ValueError, r"k: expected 4 dims"),
    "v_rank": ("F(v=t(2, 2, 7, 16, 1))", ValueError, r"v: expected 4 dims"),
    "k_batch": ("F(k=t(3, 2, 7, 16))", ValueError, r"k: expected batch size 2 \(q's\), got 3"),
    "k_heads": ("F(k=t(2, 3, 7, 16), v=t(2, 3, 7, 16))", ValueError,
                r"k: number of kv heads \(3\) must be positive and divide q's number of heads \(4\)"),
    "k_zero_heads": ("F(k=t(2, 0, 7, 16), v=t(2, 0, 7, 16))", ValueError, r"k: number of kv heads \(0\) must be positive"),
    "k_head_dim": ("F(k=t(2, 2, 7, 8))", ValueError, r"k: expected head dim 16 \(q's\), got 8"),
    "v_length": ("F(v=t(2, 2, 6, 16))", ValueError, r"v: expected \(batch, kv heads, length\) = \(2, 2, 7\)"),
    "q_dtype": ("F(q=t(2, 4, 5, 16, dtype=torch.float64), k=k.double(), v=v.double())", TypeError,
                r"q: expected dtype float32, bfloat16 or float16, got Double"),
    "k_dtype": ("F(k=t(2, 2, 7, 16, dtype=torch.bfloat16))", TypeError, r"k: expected dtype Float \(q's\), got BFloat16"),
    "v_int": ("F(v=torch.zeros(2, 2, 7, 16, dtype=torch.int32))", TypeError, r"v: expected dtype Float \(q's\), got Int"),
    "q_head_dim_max": ("F(q=t(2, 4, 5, 300), k=t(2, 2, 7, 300), v=t(2, 2, 7, 300))", ValueError,
                       r"q: head dim 300 exceeds the cpu kernels' maximum of 256"),
    "v_head_dim_max": ("F(v=t(2, 2, 7, 257))", ValueError, r"v: head dim 257 exceeds"),
    "q_last_stride": ("F(q=t(2, 4, 16, 5).transpose(-1, -2))", ValueError, r"q: expected unit stride on the last dim"),
    "k_last_stride": ("F(k=t(2, 2, 16, 7).transpose(-1, -2))", ValueError, r"k: expected unit stride on the last dim"),
    "k_device": ("F(k=M(k))", ValueError, r"k: expected a tensor on (cpu|meta) \(q's device\), got one on (meta|cpu)"),
    # key_lengths
    "kl_dtype": ("F(kl=torch.tensor([7, 3]))", TypeError, r"key_lengths: expected dtype int32, got Long"),
    "kl_shape": ("F(kl=i32([7]))", ValueError, r"key_lengths: expected shape \(2,\)"),
    "kl_rank": ("F(kl=i32([[7, 3]]))", ValueError, r"key_lengths: expected shape \(2,\)"),
    "kl_high": ("F(kl=i32([7, 8]))", ValueError, r"key_lengths: values must lie in \[0, Lk=7\], got 8 at index 1"),
    "kl_negative": ("F(kl=i32([-1, 2]))", ValueError, r"key_lengths: values must lie in \[0, Lk=7\], got -1 at index 0"),
    "kl_huge": ("F(kl=i32([2**31 - 1, 2]))", ValueError, r"key_lengths: values must lie in \[0, Lk=7\], got 2147483647"),
    "kl_strided_ok_values_bad": ("F(kl=i32([3, 9, 3, 9])[::2].add(5))", ValueError, r"got 8 at index 0"),
    "bwd_kl_high": ("B(kl=i32([7, 100]))", ValueError, r"key_lengths: values must lie in \[0, Lk=7\], got 100 at index 1"),
    "bwd_kl_dtype": ("B(kl=torch.tensor([7, 3], dtype=torch.int16))", TypeError, r"key_lengths: expected dtype int32, got Short"),
    # masks and modes
    "mask_dtype": ("F(mask=torch.zeros(2, 4, 5, 7, dtype=torch.int32))", TypeError,
                   r"attn_mask: expected dtype bool \(True = may attend\) or float32 \(additive\), got Int"),
    "mask_half": ("F(mask=torch.zeros(2, 4, 5, 7, dtype=torch.float16))", TypeError, r"attn_mask: expected dtype bool .* got Half"),
    "mask_rank": ("F(mask=torch.ones(5, 7, dtype=torch.bool))", ValueError, r"attn_mask: expected a 4-D view broadcast to .* = \(2, 4, 5, 7\)"),
    "mask_shape": ("F(mask=torch.ones(2, 4, 5, 6, dtype=torch.bool))", ValueError, r"attn_mask: expected shape \[2, 4, 5, 7\]"),
    "mask_unexpanded": ("F(mask=torch.ones(1, 1, 5, 7, dtype=torch.bool))", ValueError, r"attn_mask: expected shape \[2, 4, 5, 7\] .*expand"),
    "mask_device": ("F(mask=M(torch.ones(2, 4, 5, 7, dtype=torch.bool)))", ValueError, r"attn_mask: expected a tensor on cpu \(q's device\), got one on meta"),
    "dropout_one": ("F(p=1.0)", ValueError, r"dropout_p: expected a number in \[0, 1\), got 1"),
    "dropout_negative": ("F(p=-0.1)", ValueError, r"dropout_p: expected a number in \[0, 1\), got -0.1"),
    "dropout_nan": ("F(p=float('nan'))", ValueError, r"dropout_p: expected a number in \[0, 1\), got nan"),
    # backward operands
    "lse_shape": ("B(lse=torch.zeros(2, 4, 6))", ValueError, r"lse: expected shape \[2, 4, 5\] \(batch, heads, q length\), got \[2, 4, 6\]"),
    "lse_dtype": ("B(lse=lse.double())", TypeError, r"lse: expected dtype float32, got Double"),
    "dout_shape": ("B(dout=dout[:, :, :4])", ValueError, r"dout: expected shape \[2, 4, 5, 16\] \(like the forward's out\)"),
    "dout_last_stride": ("B(dout=t(2, 4, 16, 5).transpose(-1, -2))", ValueError, r"dout: expected unit stride"),
    "out_dtype": ("B(out=out.half())", TypeError, r"out: expected dtype Float \(q's\), got Half"),
    "out_rank": ("B(out=out[0])", ValueError, r"out: expected 4 dims"),
    # the meta kernels (torch.compile's fake tensors run them) check the same
    "meta_q_rank": ("F(q=M(t(2, 4, 16)), k=M(k), v=M(v))", ValueError, r"q: expected 4 dims"),
    "meta_k_batch": ("F(q=M(q), k=M(t(3, 2, 7, 16)), v=M(v))", ValueError, r"k: expected batch size 2"),
    "meta_kl_dtype": ("F(q=M(q), k=M(k), v=M(v), kl=M(torch.tensor([7, 3])))", TypeError, r"key_lengths: expected dtype int32"),
    "meta_bwd_lse": ("B(dout=M(dout), q=M(q), k=M(k), v=M(v), out=M(out), lse=M(torch.zeros(2, 4, 6)))", ValueError, r"lse: expected shape"),
    # helpers
    "plan_splits_negative": ("ops.cuda_plan_splits(1, 1, 1, 1, 64, 64, -1)", ValueError, r"cuda_plan_splits: num_sms must be non-negative"),
    "plan_splits_head_dim": ("ops.cuda_plan_splits(1, 1, 1, 1, 64, 80, 132)", ValueError, r"cuda_plan_splits: head_dim 80 has no compiled cuda kernel"),
    "probe_tasks": ("ops.cpu_parallel_threads_probe(0)", ValueError, r"tasks: expected a positive number, got 0"),
    "bf16_lanes_count": ("ops.cpu_bf16_dot_lanes(torch.zeros(10), torch.zeros(10, dtype=torch.int32), "
                         "torch.zeros(10, dtype=torch.int32), 'avx512bf16_model')", ValueError,
                         r"acc: expected a multiple of 64 lanes, got 10"),
    "bf16_lanes_dtype": ("ops.cpu_bf16_dot_lanes(torch.zeros(64), torch.zeros(64), torch.zeros(64), 'avx512bf16_model')",
                         ValueError, r"a, b: expected contiguous int32 CPU tensors"),
    "bf16_lanes_variant": ("ops.cpu_bf16_dot_lanes(torch.zeros(64), torch.zeros(64, dtype=torch.int32), "
                           "torch.zeros(64, dtype=torch.int32), 'avx9')", ValueError,
                           r"variant: expected avx512bf16 or avx512bf16_model, got 'avx9'"),
    "bf16_round_count": ("ops.cpu_bf16_round_lanes(torch.zeros(100), False, 'avx512bf16_model')", ValueError,
                         r"x: expected a multiple of 128 values, got 100"),
    "bf16_round_dtype": ("ops.cpu_bf16_round_lanes(torch.zeros(128, dtype=torch.int32), True, 'avx512bf16_model')",
                         ValueError, r"x: expected a contiguous 1-D float32 CPU tensor"),
    "bf16_round_variant": ("ops.cpu_bf16_round_lanes(torch.zeros(128), False, 'avx9')", ValueError,
                           r"variant: expected avx512bf16 or avx512bf16_model, got 'avx9'"),
}


# Arguments the C++ ops take as their kernels' arithmetic, not as a memory hazard: the Python
# operator layer names them (mhakern/checks.py; tests/test_api.py), the ops only must not crash
# on them (csrc/op_common.h keeps the memory-safety checks alone). name -> call, which must return.
ARITHMETIC = {
    "scale_nan": "F(scale=float('nan'))",
    "scale_inf": "F(scale=float('inf'))",
    "window_left_below_minus_one": "F(wl=-2)",  # every kernel reads a negative side as unbounded
    "window_right_below_minus_one": "F(wr=-5)",
    "mask_grad_without_mask": "B(mask_grad=True)",  # dmask is allocated whatever the mask
    "mask_grad_bool_mask": "B(mask=torch.ones(2, 4, 5, 7, dtype=torch.bool), mask_grad=True)",
}


@pytest.fixture(scope="module")
def child_run():
    cases = {n: c for n, c in CASES.items()}
    cases.update({n: (call, None, "") for n, call in ARITHMETIC.items()})
    extra = _unimplemented_cpu_mode()
    if extra is not None:
        cases["mode_not_implemented"] = (extra[1], NotImplementedError,
                                         rf"the cpu kernels do not implement {extra[0]}")
    payload = json.dumps([[n, c[0]] for n, c in cases.items()])
    res = subprocess.run([sys.executable, "-c", _SETUP, payload], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, PYTHONFAULTHANDLER="1"))
    started, results = [], {}
    for line in res.stdout.splitlines():
        if line.startswith("START "):
            started.append(line[6:])
        elif line.startswith("RESULT "):
            name, typ, msg = json.loads(line[7:])
            results[name] = (typ, msg)
    return cases, res, started, results


def test_the_child_process_survived_every_bad_call(child_run):
    cases, res, started, results = child_run
    crashed_in = started[-1] if started and started[-1] not in results else None
    assert res.returncode == 0 and "HEALTHY" in res.stdout, (
        f"child exited with {res.returncode} (negative: killed by signal {-res.returncode})"
        + (f" during case {crashed_in!r}: {cases[crashed_in][0]}" if crashed_in else "")
        + f"\nstderr:\n{res.stderr[-4000:]}"
    )
    assert set(results) == set(cases)


@pytest.mark.parametrize("name", sorted(ARITHMETIC))
def test_arithmetic_arguments_return_without_a_check(child_run, name):
    cases, res, started, results = child_run
    assert name in results, f"{name} never finished (the child died in it?): {res.stderr[-3000:]}"
    typ, msg = results[name]
    assert typ is None, f"{name}: {cases[name][0]} raised {typ}: {msg}"


@pytest.mark.parametrize("name", sorted(CASES) + ["mode_not_implemented"])
def test_bad_call_raises_with_its_message(child_run, name):
    cases, res, started, results = child_run
    if name not in cases:
        pytest.skip("the cpu kernels implement every mode (capabilities()['cpu']['features'])")
    expr, exc, pattern = cases[name]
    assert name in results, f"{name} never finished (the child died in it?): {res.stderr[-3000:]}"
    typ, msg = results[name]
    assert typ is not None, f"{name}: {expr} raised nothing"
    assert typ == exc.__name__, f"{name}: {expr} raised {typ}, expected {exc.__name__}: {msg}"
    assert re.search(pattern, msg), f"{name}: message {msg!r} does not match {pattern!r}"


def test_a_crash_in_the_child_is_reported_as_a_failure():
    # The harness itself: a child killed by a signal must not look like success.
    res = subprocess.run([sys.executable, "-c", "import os, signal; print('START x', flush=True); "
                          "os.kill(os.getpid(), signal.SIGSEGV)"], capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "HEALTHY" not in res.stdout
