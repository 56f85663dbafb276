"""mhakern: fused exact multi-head attention kernels and a memorization-capacity trainer.

Public API:

* :func:`attention` -- functional, SDPA-like shapes (B, H, L, D), GQA/MQA, causal, key lengths.
* :class:`FusedMHA` -- a module mirroring ``torch.nn.MultiheadAttention``.
* :func:`available_backends` -- each backend with None (usable) or the reason it is not.

Importing mhakern touches no device and compiles nothing.
"""
from .attention import FusedAttentionFunction, attention
from .backends import available_backends

__version__ = "0.1.0"

__all__ = ["attention", "available_backends", "FusedAttentionFunction", "FusedMHA", "__version__"]


def __getattr__(name):
    # FusedMHA lives in modules.py, imported on first use.
    if name == "FusedMHA":
        from .modules import FusedMHA

        return FusedMHA
    raise AttributeError(f"module 'mhakern' has no attribute {name!r}")
