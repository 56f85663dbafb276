"""The ``reference`` backend: plain PyTorch (mhakern.reference), any device, any dtype.

It materialises the (Lq x Lk) score matrix (in query chunks when Lk is long), so it is the
fallback of ``auto``, never its first choice.
"""
from __future__ import annotations

import torch

from .. import reference
from . import DEFAULT_MODES, Backend, register

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class ReferenceBackend(Backend):
    name = "reference"
    priority = 0

    def supports(self, q, k, v, causal, key_lengths):
        if q.dtype not in _DTYPES:
            return f"dtype {q.dtype} is not one of {_DTYPES}"
        return None

    def forward(self, q, k, v, scale, causal, key_lengths, modes=DEFAULT_MODES):
        return reference.attention_forward(q, k, v, scale, causal, key_lengths)

    def backward(self, dout, q, k, v, out, lse, scale, causal, key_lengths, modes=DEFAULT_MODES):
        dq, dk, dv = reference.attention_backward(dout, q, k, v, out, lse, scale, causal, key_lengths)
        return dq, dk, dv, None


register(ReferenceBackend())
