"""Triton kernels of mhakern and their launchers (installed as ``mhakern.kernels``).

No autograd here: :mod:`mhakern.backends.triton_backend` wraps these launchers in the backend
contract. ``INTERPRET`` records whether Triton was put in interpreter mode (TRITON_INTERPRET=1)
when the kernels were defined, which is when Triton reads that switch.
"""
import os

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

from .attention_bwd import attention_backward  # noqa: E402
from .attention_fwd import attention_forward  # noqa: E402

__all__ = ["attention_forward", "attention_backward", "INTERPRET"]
