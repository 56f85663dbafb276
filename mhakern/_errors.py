"""Exception classes of bad input: instances of what torch raises for the same mistake.

Code written against torch catches ``RuntimeError`` from SDPA's checks (shapes, dtypes,
devices, an ``attn_mask`` with ``is_causal``) and ``AssertionError`` from
nn.MultiheadAttention's shape checks; mhakern's checks raise classes that derive from the
Python exception they describe *and* from torch's, so both kinds of handler catch them. The
messages still name the argument (docs/contract.md, "Errors").
"""
from __future__ import annotations


class ArgumentError(ValueError, RuntimeError):
    """A bad value or shape (a ValueError) where torch raises RuntimeError."""


class ArgumentTypeError(TypeError, RuntimeError):
    """A bad dtype (a TypeError) where torch raises RuntimeError."""


class ShapeAssertionError(ValueError, AssertionError):
    """A bad shape given to FusedMHA (a ValueError) where nn.MultiheadAttention asserts."""


class TypeAssertionError(TypeError, AssertionError):
    """A bad dtype given to FusedMHA (a TypeError) where nn.MultiheadAttention asserts."""


class FallbackError(ArgumentError):
    """Strict dispatch: ``backend="auto"`` would have served the call on a fallback backend."""
