"""The call record: every optional mode of one attention call, in one frozen value.

Everything between the public entry points (:func:`mhakern.attention`, the SDPA drop-in,
FusedMHA) and the kernels passes a :class:`Modes`. It is flattened in exactly two adapters,
one per operator schema:

* :meth:`Modes.op_args` / :meth:`Modes.from_op_args`: the Python operators
  ``torch.ops.mhakern.attn_fwd`` / ``attn_bwd`` (mhakern/ops.py), whose schemas end with the
  fields in declaration order;
* :meth:`Modes.c_op_args` / :meth:`Modes.c_op_bwd_args`: the C++ operators
  ``torch.ops.mhakern_C.fwd`` / ``bwd`` (csrc/bindings.cpp), whose C++ side rebuilds one
  ``ModeParams`` from them (csrc/op_common.h). :func:`c_fwd` / :func:`c_bwd`, the calls every
  backend of those kernels makes, send the default record to ``fwd_plain`` / ``bwd_plain``
  instead: the same kernels, with no mode argument to parse.

A new mode is a new field here, its place in those two adapters, and the kernels.

``causal`` and ``key_lengths`` are not fields: they are the contract's base arguments, which
every backend's ``supports`` takes and dispatch caches on; the record holds what a backend may
lack (its ``features``).
"""
from __future__ import annotations

from typing import FrozenSet, NamedTuple, Optional

import torch

from ._caps import FEATURE_NAMES

Tensor = torch.Tensor

#: Every optional mode a backend may implement (the names used in ``Backend.features``): the
#: feature names of csrc/capabilities.h (``kFeatureNames``, through mhakern/_caps.py).
#: ``sinks`` is not one: the op layer applies it around every backend (docs/contract.md).
ALL_FEATURES: FrozenSet[str] = frozenset(FEATURE_NAMES)


class Modes(NamedTuple):
    """The optional attention modes of one call, beyond causal and key_lengths.

    ``attn_mask``: None, or a 4-D view broadcast to (B, H, Lq, Lk) (stride 0 on broadcast dims),
    bool (True = the key may be attended) or float (added to the scaled scores).
    ``dropout_p`` in [0, 1) with the 64-bit ``seed`` of the counter-based keep mask.
    ``top_left``: causal (and window) offset 0 instead of ``Lk_b - Lq``.
    ``window_left`` / ``window_right``: sliding window sizes, -1 for unbounded.
    ``mask_grad``: a float mask requires grad; the backward returns dL/dscore.
    ``softcap``: 0 (off) or > 0: the scaled score ``s`` becomes ``softcap * tanh(s / softcap)``,
    before the ALiBi bias and the mask are added.
    ``alibi_slopes``: None or a float32 (B, H) view (stride 0 on B for per-head slopes): the bias
    ``-slope[b, h] * |i + off - j|`` is added to the (capped) score, ``off`` as for causal.
    ``sinks``: None or a float (H,) tensor of logits that join every row's softmax denominator
    (no value): ``lse' = logaddexp(lse, sink[h])``, ``out' = out * exp(lse - lse')``. Backends
    never see it: the op layer applies it around their forward and gives its gradient.

    Packed sequences ("varlen", docs/contract.md "Packed sequences"): q (1, H, Tq, D), k/v
    (1, Hkv, Tk, D*) hold ``num_seqs`` sequences; ``cu_seqlens_q`` / ``cu_seqlens_k`` int32
    (num_seqs + 1,) prefix sums (first 0, last Tq / Tk), ``max_seqlen_q`` / ``max_seqlen_k`` bounds
    of the lengths. Sequence s is batch element s of a dense call (local positions, its own causal
    offset, dropout hash with b = s, ALiBi slopes row s: ``alibi_slopes`` is then (num_seqs, H)).
    The KV cache (forward only, docs/contract.md "KV cache"): ``cache_batch_idx`` int32 (B,): batch
    element b reads K/V row ``cache_batch_idx[b]``; ``block_table`` int32 (B, pages_per_seq): k/v
    are (num_pages, Hkv, page_size, D*) and key j of element b is row ``j % page_size`` of page
    ``block_table[b, j // page_size]`` (logical key length ``pages_per_seq * page_size``).
    """

    attn_mask: Optional[Tensor] = None
    dropout_p: float = 0.0
    seed: int = 0
    top_left: bool = False
    window_left: int = -1
    window_right: int = -1
    mask_grad: bool = False
    softcap: float = 0.0
    alibi_slopes: Optional[Tensor] = None
    sinks: Optional[Tensor] = None
    cu_seqlens_q: Optional[Tensor] = None
    cu_seqlens_k: Optional[Tensor] = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    cache_batch_idx: Optional[Tensor] = None
    block_table: Optional[Tensor] = None

    def required_features(self) -> FrozenSet[str]:
        """The names of the modes a backend must implement for this call (empty for the
        default call; ``sinks`` never reaches a backend)."""
        if self is DEFAULT_MODES:
            return _NONE
        need = set()
        if self.attn_mask is not None:
            need.add("attn_mask")
        if self.mask_grad:
            need.add("mask_grad")
        if self.dropout_p > 0.0:
            need.add("dropout")
        if self.top_left:
            need.add("top_left")
        if self.window_left >= 0 or self.window_right >= 0:
            need.add("window")
        if self.softcap > 0.0:
            need.add("softcap")
        if self.alibi_slopes is not None:
            need.add("alibi")
        if self.cu_seqlens_q is not None or self.cu_seqlens_k is not None:
            need.add("varlen")
        if self.cache_batch_idx is not None:
            need.add("cache_batch_idx")
        if self.block_table is not None:
            need.add("paged")
        return frozenset(need)

    @property
    def packed(self) -> bool:
        """Whether the call holds packed sequences (either prefix sum given)."""
        return self.cu_seqlens_q is not None or self.cu_seqlens_k is not None

    @property
    def cached(self) -> bool:
        """Whether K/V rows are addressed through the cache's indices (cache_batch_idx or pages)."""
        return self.cache_batch_idx is not None or self.block_table is not None

    def for_backend(self) -> "Modes":
        """The record a backend sees: without ``sinks`` (the op layer's part)."""
        return self if self.sinks is None else self._replace(sinks=None)

    # -- the Python operators' schema (mhakern/ops.py) --------------------------------------
    def op_args(self) -> tuple:
        """The trailing mode arguments of ``torch.ops.mhakern.attn_fwd`` / ``attn_bwd``: the
        fields in order (no conversion: under torch.compile the seed may be a symbolic int)."""
        return tuple(self)

    @classmethod
    def from_op_args(cls, attn_mask, dropout_p, seed, top_left, window_left, window_right, mask_grad, softcap,
                     alibi_slopes, sinks, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
                     cache_batch_idx=None, block_table=None) -> "Modes":
        """The record from :meth:`op_args`' flattening (the default record when every field
        has its default, so that ``required_features`` is free for plain calls)."""
        if (attn_mask is None and dropout_p == 0.0 and top_left is False and window_left == -1 and window_right == -1
                and mask_grad is False and softcap == 0.0 and alibi_slopes is None and sinks is None
                and cu_seqlens_q is None and cu_seqlens_k is None and cache_batch_idx is None and block_table is None):
            return DEFAULT_MODES
        return cls(attn_mask, dropout_p, seed, top_left, window_left, window_right, mask_grad, softcap, alibi_slopes,
                   sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, cache_batch_idx, block_table)

    # -- the C++ operators' schema (csrc/bindings.cpp) --------------------------------------
    def c_op_args(self) -> tuple:
        """The mode arguments of ``torch.ops.mhakern_C.fwd`` in schema order (after
        ``key_lengths``); ``bwd`` takes ``mask_grad`` after ``window_right``
        (:meth:`c_op_bwd_args`). The packing and cache arguments, the schema's defaulted tail,
        are passed only when the call has them (a plain call's dispatch stays as short)."""
        head = (self.attn_mask, float(self.dropout_p), int(self.seed), bool(self.top_left), int(self.window_left),
                int(self.window_right), float(self.softcap), self.alibi_slopes)
        return head + self._c_tail() if self.packed or self.cached else head

    def c_op_bwd_args(self) -> tuple:
        """The mode arguments of ``torch.ops.mhakern_C.bwd`` in schema order."""
        head = (self.attn_mask, float(self.dropout_p), int(self.seed), bool(self.top_left), int(self.window_left),
                int(self.window_right), bool(self.mask_grad), float(self.softcap), self.alibi_slopes)
        return head + self._c_tail() if self.packed or self.cached else head

    def _c_tail(self) -> tuple:
        return (self.cu_seqlens_q, self.cu_seqlens_k, int(self.max_seqlen_q), int(self.max_seqlen_k),
                self.cache_batch_idx, self.block_table)


DEFAULT_MODES = Modes()
_NONE: FrozenSet[str] = frozenset()


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


#: The mode arguments of the Python operators' schemas (mhakern/ops.py), in field order, with
#: the defaults of DEFAULT_MODES: the schema side of :meth:`Modes.op_args`. The seed is a SymInt:
#: under torch.compile it is drawn inside the graph (a data-dependent scalar).
OP_SCHEMA_MODES = (
    "Tensor? attn_mask=None, float dropout_p=0.0, SymInt seed=0, bool top_left=False, int window_left=-1, "
    "int window_right=-1, bool mask_grad=False, float softcap=0.0, Tensor? alibi_slopes=None, Tensor? sinks=None, "
    "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, SymInt max_seqlen_q=0, SymInt max_seqlen_k=0, "
    "Tensor? cache_batch_idx=None, Tensor? block_table=None"
)
