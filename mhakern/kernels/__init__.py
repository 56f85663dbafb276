"""Triton kernels of mhakern and their launchers (installed as ``mhakern.kernels``).

No autograd here, and no import from ``mhakern``: the launchers write into output buffers their
caller allocates, and :mod:`mhakern.backends.triton_backend` wraps them in the backend
contract. Tiles per architecture live in :mod:`.heuristics`; ``python -m mhakern.kernels.aot``
compiles every variant for sm_80 and sm_90 and checks its SASS (:mod:`.sass`).

``INTERPRET`` (from :mod:`.launch`) records whether Triton was put in interpreter mode
(TRITON_INTERPRET=1) when the kernels were defined, which is when Triton reads that switch.

Imports go one way: the kernel modules (attention_fwd.py, attention_fwd_desc.py,
attention_bwd.py) take jit helpers from tiles.py, host helpers from launch.py and tiles from
heuristics.py, and none of those imports a kernel module; aot.py reads the kernels through each
module's ``KERNELS`` table. No module imports another's private (underscored) names.
"""
from .attention_bwd import attention_backward
from .attention_fwd import attention_forward
from .launch import INTERPRET

__all__ = ["attention_forward", "attention_backward", "INTERPRET"]
