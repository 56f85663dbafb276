"""The ``cpu`` backend: the fused multi-core C++ kernels of ``mhakern._C`` on CPU tensors.

Exact attention with a blocked online softmax (fp32 accumulation) for the dtypes and head dims
of the capability table (float32, bfloat16, float16; D and Dv may differ), GQA/MQA, causal (bottom-right) and
key lengths; parallel over (batch, KV head, query block) with at::parallel_for, and
deterministic (the work split depends on the shapes only). For small query lengths (decode)
the query heads sharing a KV head are processed together, so each key block is read once; long
key ranges with few query rows are split across threads and merged by their lse, in bounded
memory. The kernels exist per instruction set (AVX-512, AVX2, portable) and the one matching
the CPU and ATen's capability (``ATEN_CPU_CAPABILITY``) is used: see ``kernel_isa()``. bf16
inputs run a variant of their own where the CPU has AVX512-BF16: every product on bf16 operands
through ``vdpbf16ps`` (fp32 accumulation, P and dS rounded to bf16, the softmax in fp32), or, on
any CPU, the same kernels on a bit-exact software model of the instruction;
``MHAKERN_CPU_ISA`` chooses (docs/install.md) and ``torch.ops.mhakern_C.cpu_bf16_kernel_isa()``
says which runs.

The kernels are the dispatcher operators ``torch.ops.mhakern_C.fwd`` / ``bwd`` (``fwd_plain`` /
``bwd_plain`` for calls without modes: mhakern/modes.py c_fwd; schemas in
csrc/bindings.cpp; outputs allocated by the op, laid out like the input they mirror); what they
serve is the capability table's ``cpu`` entry (csrc/capabilities.h, through mhakern/_caps.py),
never restated here.

When ``mhakern._C`` is missing (not built, build skipped or failed; mhakern/_extension.py),
the backend stays registered and ``available_backends()["cpu"]`` says why.
"""
from __future__ import annotations

import torch

from .._caps import TABLE
from .._extension import capabilities, kernel_isa, load, load_error  # noqa: F401 (re-exported)
from ..modes import c_bwd, c_fwd
from . import DEFAULT_MODES, Backend, register


def __getattr__(name):
    # The loader's error under its former name, for callers that read it here.
    if name == "_ext_error":
        return load_error()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class CpuBackend(Backend):
    name = "cpu"
    priority = 20

    #: What the kernels serve: the capability table's cpu entry.
    features = frozenset(TABLE["cpu"]["features"])

    def __init__(self):
        self._dtypes = tuple(getattr(torch, n) for n in TABLE["cpu"]["dtypes"])
        self._max_head_dim = TABLE["cpu"]["max_head_dim"]

    def unavailable(self):
        return load_error() if load() is None else None

    def supports(self, q, k, v, causal, key_lengths):
        if q.device.type != "cpu":
            return f"serves CPU tensors only, got a tensor on {q.device}"
        if q.dtype not in self._dtypes:
            return f"dtype {q.dtype} is not one of {self._dtypes}"
        max_dim = self._max_head_dim
        if q.shape[-1] > max_dim or v.shape[-1] > max_dim:
            return f"head dims up to {max_dim} only, got D={q.shape[-1]} and Dv={v.shape[-1]}"
        return None

    def forward(self, q, k, v, scale, causal, key_lengths, modes=DEFAULT_MODES):
        return c_fwd(q, k, v, scale, causal, key_lengths, modes)

    def backward(self, dout, q, k, v, out, lse, scale, causal, key_lengths, modes=DEFAULT_MODES):
        return c_bwd(dout, q, k, v, out, lse, scale, causal, key_lengths, modes)

    def backward_kv_sum(self, dout, q, kv, out, lse, scale, causal, key_lengths):
        # float32: other dtypes round dK and dV to the dtype before their sum (op layer).
        if q.dtype != torch.float32:
            return None
        return torch.ops.mhakern_C.bwd_plain_kv_sum(dout, q, kv, out, lse, float(scale), bool(causal), key_lengths)


register(CpuBackend())
