"""The call record: every optional mode of one attention call, in one frozen value.

Everything between the public entry points (:func:`mhakern.attention`, the SDPA drop-in,
FusedMHA) and the kernels passes a :class:`Modes`. Its fields, their defaults and meaning are
rows of the mode table (mhakern/mode_table.py), from which tools/generate_modes.py writes the
record (mhakern/_modes_generated.py) and everything that flattens it. It is flattened in
exactly two adapters, one per operator schema:

* :meth:`Modes.op_args` / :meth:`Modes.from_op_args`: the Python operators
  ``torch.ops.mhakern.attn_fwd`` / ``attn_bwd`` (mhakern/ops.py), whose schemas end with the
  fields in declaration order;
* :meth:`Modes.c_op_args` / :meth:`Modes.c_op_bwd_args`: the C++ operators
  ``torch.ops.mhakern_C.fwd`` / ``bwd`` (csrc/bindings.cpp), whose C++ side rebuilds one
  ``ModeArgs`` and then one ``ModeParams`` from them (csrc/op_common.h, expanding the table's
  X-macros of csrc/generated/modes.h). :func:`c_fwd` / :func:`c_bwd`, the calls every
  backend of those kernels makes, send the default record to ``fwd_plain`` / ``bwd_plain``
  instead: the same kernels, with no mode argument to parse.

A new mode is a row of the table (its docstring says what else: the reference math, the
kernels that implement it, its tests); the adapters follow.

``causal`` and ``key_lengths`` are not fields: they are the contract's base arguments, which
every backend's ``supports`` takes and dispatch caches on; the record holds what a backend may
lack (its ``features``).
"""
from __future__ import annotations

from typing import FrozenSet, Optional

import torch

from ._caps import FEATURE_NAMES
# The record itself (fields, defaults, both flattenings, the Python operators' schema text) is
# generated from the mode table.
from ._modes_generated import DEFAULT_MODES, OP_SCHEMA_MODES, Modes  # noqa: F401

Tensor = torch.Tensor

#: Every optional mode a backend may implement (the names used in ``Backend.features``): the
#: feature names of csrc/capabilities.h (``kFeatureNames``, through mhakern/_caps.py).
#: ``sinks`` is not one: the op layer applies it around every backend (docs/contract.md).
ALL_FEATURES: FrozenSet[str] = frozenset(FEATURE_NAMES)


def c_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, key_lengths: Optional[Tensor],
          modes: Modes) -> tuple:
    """``(out, lse)`` of the C++ forward (``torch.ops.mhakern_C.fwd``) on the record ``modes``;
    the default record through ``fwd_plain``, whose schema ends at ``key_lengths``: on a tiny
    call torch's parsing of the full schema's mode arguments, given or defaulted, costs about a
    quarter of the operator's instructions (benchmarks/bench_call_overhead.py, raw and
    raw_fwd)."""
    if modes is DEFAULT_MODES:
        return torch.ops.mhakern_C.fwd_plain(q, k, v, float(scale), bool(causal), key_lengths)
    return torch.ops.mhakern_C.fwd(q, k, v, float(scale), bool(causal), key_lengths, *modes.c_op_args())


def c_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, causal: bool,
          key_lengths: Optional[Tensor], modes: Modes) -> tuple:
    """``(dq, dk, dv, dmask)`` of the C++ backward (``torch.ops.mhakern_C.bwd``) on the record
    ``modes`` (``bwd_plain`` for the default record, as :func:`c_fwd`); ``dmask`` None unless
    ``modes.mask_grad``."""
    if modes is DEFAULT_MODES:
        dq, dk, dv, _ = torch.ops.mhakern_C.bwd_plain(dout, q, k, v, out, lse, float(scale), bool(causal),
                                                      key_lengths)
        return dq, dk, dv, None
    dq, dk, dv, dmask = torch.ops.mhakern_C.bwd(dout, q, k, v, out, lse, float(scale), bool(causal), key_lengths,
                                                *modes.c_op_bwd_args())
    return dq, dk, dv, (dmask if modes.mask_grad else None)


def mask_4d(attn_mask: Optional[Tensor]) -> Optional[Tensor]:
    """``attn_mask`` (1-D to 4-D, SDPA's right-aligned broadcast rule) as a 4-D view: leading
    dims of size 1 prepended, no copy."""
    if attn_mask is None or attn_mask.dim() == 4:
        return attn_mask
    return attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
