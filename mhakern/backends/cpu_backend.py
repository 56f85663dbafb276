"""The ``cpu`` backend: the fused multi-core C++ kernels of ``mhakern._C`` on CPU tensors.

Exact attention with a blocked online softmax (fp32 accumulation) for float32, bfloat16 and
float16 inputs, head dims up to 256 (D and Dv may differ), GQA/MQA, causal (bottom-right) and
key lengths; parallel over (batch, KV head, query block) with at::parallel_for, and
deterministic (the work split depends on the shapes only). For small query lengths (decode)
the query heads sharing a KV head are processed together, so each key block is read once; long
key ranges with few query rows are split across threads and merged by their lse, in bounded
memory. The kernels exist per instruction set (AVX-512, AVX2, portable) and the one matching
the CPU and ATen's capability (``ATEN_CPU_CAPABILITY``) is used: see ``kernel_isa()``.

When ``mhakern._C`` is missing (not built, build skipped or failed), the backend stays
registered and ``available_backends()["cpu"]`` says why.
"""
from __future__ import annotations

import importlib
from typing import Optional

import torch

from .._layout import empty_like_heads
from . import DEFAULT_MODES, Backend, register

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BUILD_HINT = (
    "build it with `pip install -e . --no-build-isolation` (torch must be importable at build time; "
    "MHAKERN_NO_EXTENSION=1 skips it, and a failed compile prints a warning in the build log)"
)

_ext = None
_ext_error: Optional[str] = None


def _load():
    """The extension module, or None (with the reason in ``_ext_error``)."""
    global _ext, _ext_error
    if _ext is None and _ext_error is None:
        try:
            _ext = importlib.import_module("mhakern._C")
        except ImportError as e:  # not built, or built against another torch
            _ext_error = f"mhakern._C is not available ({e}); {_BUILD_HINT}"
    return _ext


def kernel_isa() -> Optional[str]:
    """The instruction-set variant the cpu kernels run ('AVX512', 'AVX2', 'DEFAULT'), or None."""
    ext = _load()
    return None if ext is None else ext.cpu_kernel_isa()


class CpuBackend(Backend):
    name = "cpu"
    priority = 20

    def unavailable(self):
        return None if _load() is not None else _ext_error

    def supports(self, q, k, v, causal, key_lengths):
        if q.device.type != "cpu":
            return f"serves CPU tensors only, got a tensor on {q.device}"
        if q.dtype not in _DTYPES:
            return f"dtype {q.dtype} is not one of {_DTYPES}"
        max_dim = 256
        if q.shape[-1] > max_dim or v.shape[-1] > max_dim:
            return f"head dims up to {max_dim} only, got D={q.shape[-1]} and Dv={v.shape[-1]}"
        return None

    def forward(self, q, k, v, scale, causal, key_lengths, modes=DEFAULT_MODES):
        out = empty_like_heads(q, v.shape[-1])
        return _load().cpu_attn_fwd(q, k, v, scale, causal, key_lengths, out)

    def backward(self, dout, q, k, v, out, lse, scale, causal, key_lengths, modes=DEFAULT_MODES):
        dq = empty_like_heads(q, q.shape[-1])
        dk = empty_like_heads(k, k.shape[-1])
        dv = empty_like_heads(v, v.shape[-1])
        dq, dk, dv = _load().cpu_attn_bwd(dout, q, k, v, out, lse, scale, causal, key_lengths, dq, dk, dv)
        return dq, dk, dv, None


register(CpuBackend())
