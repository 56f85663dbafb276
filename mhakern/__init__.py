"""mhakern: fused exact multi-head attention kernels and a memorization-capacity trainer.

Public API:

* :func:`attention` -- functional, SDPA-like shapes (B, H, L, D), GQA/MQA, causal (either
  alignment), sliding windows, key lengths, bool or additive masks, dropout, and the score
  modifiers softcap, ALiBi slopes and (learnable) attention sinks.
* :func:`scaled_dot_product_attention` -- torch's SDPA signature and semantics on mhakern.
* :func:`attention_varlen` -- packed variable-length sequences (FlashAttention's ``cu_seqlens``
  convention), forward and backward.
* :func:`flex_attention` -- torch's FlexAttention interface (``score_mod``, ``BlockMask``), the
  modifiers traced and compiled into the cpu kernel, forward and backward (mhakern/flex/).
* :func:`attention_with_kvcache` -- inference over a dense or paged KV cache, appending the new
  keys and values in place.
* :class:`FusedMHA` -- a module mirroring ``torch.nn.MultiheadAttention``.
* :func:`available_backends` -- each backend with None (usable) or the reason it is not.
* :func:`self_test` -- test the compiled kernel families on this machine's devices now (they are
  tested on first use anyway, once per device and build: mhakern/selftest.py).
* :mod:`mhakern.distributed` -- context parallelism: attention over a sequence sharded across
  the ranks of a torch.distributed group (ring, all-gather, Ulysses), forward and backward.
* :func:`last_backend` -- the backend that served this thread's last call;
  :func:`set_strict` -- refuse, rather than fall back to the plain-PyTorch reference.

Importing mhakern touches no device and compiles nothing. Semantics and the backend contract:
docs/contract.md.
"""
from ._errors import ArgumentError, ArgumentTypeError, FallbackError, ShapeAssertionError, TypeAssertionError
from .attention import attention
from .backends import available_backends, last_backend, set_strict
from .sdpa import scaled_dot_product_attention
from .varlen import attention_varlen, attention_with_kvcache

__version__ = "0.1.0"

__all__ = [
    "attention", "scaled_dot_product_attention", "attention_varlen", "attention_with_kvcache", "available_backends", "last_backend", "set_strict",
    "FusedMHA", "ArgumentError", "ArgumentTypeError", "ShapeAssertionError", "TypeAssertionError",
    "FallbackError", "self_test", "flex_attention", "__version__",
]


def __getattr__(name):
    # FusedMHA lives in modules.py, imported on first use.
    if name == "FusedMHA":
        from .modules import FusedMHA

        return FusedMHA
    if name == "distributed":  # context parallelism (mhakern/distributed/), imported on first use
        import importlib

        return importlib.import_module(".distributed", __name__)
    if name in ("flex", "flex_attention"):  # mhakern/flex/, imported on first use (it loads torch.fx)
        import importlib

        mod = importlib.import_module(".flex", __name__)
        return mod if name == "flex" else mod.flex_attention
    if name == "self_test":  # the kernel families' self-test (mhakern/selftest.py), imported on first use
        from .selftest import self_test

        return self_test
    raise AttributeError(f"module 'mhakern' has no attribute {name!r}")
