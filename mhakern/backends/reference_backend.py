"""The ``reference`` backend: plain PyTorch (mhakern.reference), any device, any dtype.

It materialises the (Lq x Lk) score matrix (in query chunks when Lk is long), so it is the
fallback of ``auto``, never its first choice.
"""
from __future__ import annotations

import torch

from .. import reference
from . import ALL_FEATURES, DEFAULT_MODES, Backend, register

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class ReferenceBackend(Backend):
    name = "reference"
    priority = 0
    fallback = True
    features = ALL_FEATURES

    def supports(self, q, k, v, causal, key_lengths):
        if q.dtype not in _DTYPES:
            return f"dtype {q.dtype} is not one of {_DTYPES}"
        return None

    def forward(self, q, k, v, scale, causal, key_lengths, modes=DEFAULT_MODES):
        return reference.attention_forward(q, k, v, scale, causal, key_lengths, modes=modes)

    def backward(self, dout, q, k, v, out, lse, scale, causal, key_lengths, modes=DEFAULT_MODES):
        return reference.attention_backward_modes(dout, q, k, v, out, lse, scale, causal, key_lengths, modes=modes)


register(ReferenceBackend())
