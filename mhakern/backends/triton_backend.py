"""The ``triton`` backend: mhakern.kernels on CUDA tensors, or on CPU tensors through Triton's
interpreter when TRITON_INTERPRET=1 was set before mhakern's kernels were imported (for
testing: ``auto`` never picks the interpreter)."""
from __future__ import annotations

import os

import torch

from .. import selftest
from .._layout import empty_like_heads
from . import DEFAULT_MODES, Backend, register

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _interpreting() -> bool:
    try:
        from mhakern.kernels import INTERPRET
    except ImportError:
        return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return INTERPRET


class TritonBackend(Backend):
    name = "triton"
    priority = 30
    features = frozenset({"attn_mask", "mask_grad", "dropout", "top_left", "window", "softcap", "alibi", "varlen",
                          "cache_batch_idx", "paged"})

    def __init__(self):
        self._import_error = None
        self._checked = False

    def _kernels(self):
        from mhakern import kernels

        return kernels

    def unavailable(self):
        if not self._checked:
            self._checked = True
            try:
                import triton  # noqa: F401

                self._kernels()
            except Exception as e:  # ImportError, or a Triton that fails to initialise
                self._import_error = f"triton could not be imported ({type(e).__name__}: {e}); pip install triton"
        if self._import_error:
            return self._import_error
        if _interpreting():
            return None
        if not torch.cuda.is_available():
            return (
                "no CUDA device (torch.cuda.is_available() is False); set TRITON_INTERPRET=1 before "
                "importing mhakern to run the Triton kernels through the interpreter on CPU tensors"
            )
        return None

    def supports(self, q, k, v, causal, key_lengths):
        from mhakern.kernels.launch import MAX_PROGRAMS
        from mhakern.kernels.heuristics import MAX_HEAD_DIM

        interp = _interpreting()
        if interp and q.device.type != "cpu":
            return f"the Triton interpreter (TRITON_INTERPRET=1) runs on CPU tensors, got {q.device.type} tensors"
        if not interp and q.device.type != "cuda":
            return f"needs CUDA tensors, got {q.device.type} tensors (TRITON_INTERPRET=1 runs the interpreter on CPU)"
        if q.dtype not in _DTYPES:
            return f"dtype {q.dtype} is not supported (float16, bfloat16, float32)"
        if interp and q.dtype == torch.bfloat16:
            return "bfloat16 is not supported by the Triton interpreter (its bf16 tl.dot is wrong); use a GPU"
        D, Dv = q.shape[-1], v.shape[-1]
        if D > MAX_HEAD_DIM or Dv > MAX_HEAD_DIM:
            return f"head dim {max(D, Dv)} exceeds {MAX_HEAD_DIM}"
        # Every launch is a flat grid on axis 0; its programs number at most B * H * tiles, and
        # no tile is shorter than 16 rows or keys.
        B, H, Lq, Lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        programs = B * H * -(-max(Lq, Lk, 1) // 16)
        if programs > MAX_PROGRAMS:
            return f"B * H * ceil(max(Lq, Lk) / 16) = {programs} programs exceed CUDA's grid limit {MAX_PROGRAMS}"
        # The first-use self-test (mhakern/selftest.py) guards the compiled kernels, on a GPU; the
        # interpreter (a test tool) is not gated.
        return selftest.gate("triton", q.device) if q.device.type == "cuda" else None

    def auto_supports(self, q, k, v, causal, key_lengths):
        if _interpreting():
            return "running under TRITON_INTERPRET=1 (the interpreter is for testing; auto never picks it)"
        return self.supports(q, k, v, causal, key_lengths)

    def forward(self, q, k, v, scale, causal, key_lengths, modes=DEFAULT_MODES):
        B, H, Lq, _ = q.shape
        out = empty_like_heads(q, v.shape[-1])
        lse = torch.empty((B, H, Lq), dtype=torch.float32, device=q.device)
        return self._kernels().attention_forward(q, k, v, out, lse, scale, causal, key_lengths, modes)

    def backward(self, dout, q, k, v, out, lse, scale, causal, key_lengths, modes=DEFAULT_MODES):
        dq = empty_like_heads(q, q.shape[-1])
        dk = empty_like_heads(k, k.shape[-1])
        dv = empty_like_heads(v, v.shape[-1])
        dmask = None
        if modes.mask_grad:
            # Zeros: key blocks no row of a tile sees are never visited, and their gradient is 0.
            B, H, Lq, _ = q.shape
            dmask = torch.zeros((B, H, Lq, k.shape[2]), dtype=torch.float32, device=q.device)
        self._kernels().attention_backward(dout, q, k, v, out, lse, dq, dk, dv, scale, causal, key_lengths, modes,
                                           dmask=dmask)
        return dq, dk, dv, dmask


register(TritonBackend())
