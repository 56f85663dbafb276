"""Triton kernels of mhakern and their launchers (installed as ``mhakern.kernels``).

No autograd here, and no import from ``mhakern``: the launchers write into output buffers their
caller allocates, and :mod:`mhakern.backends.triton_backend` wraps them in the backend
contract. Tiles per architecture live in :mod:`.heuristics`; ``python -m mhakern.kernels.aot``
compiles every variant for sm_80 and sm_90 and checks its SASS (:mod:`.sass`).

``INTERPRET`` records whether Triton was put in interpreter mode (TRITON_INTERPRET=1) when the
kernels were defined, which is when Triton reads that switch.
"""
import os

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

from .attention_bwd import attention_backward  # noqa: E402
from .attention_fwd import attention_forward  # noqa: E402

__all__ = ["attention_forward", "attention_backward", "INTERPRET"]
