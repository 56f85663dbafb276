"""The mode table: every optional mode of an attention call, declared once.

A call's optional modes (everything beyond q, k, v, scale, causal and key_lengths) cross two
languages and a dozen places: the Python record :class:`mhakern.modes.Modes`, the Python
operators' schemas (mhakern/ops.py), the C++ operators' schemas and their gathering into
``op::ModeArgs`` (csrc/bindings.cpp, csrc/op_common.h), the kernels' parameter struct
``ModeParams`` (csrc/mode_params.h) and the feature bits of csrc/capabilities.h. Each of those is
generated from the rows below by ``tools/generate_modes.py``, as torchgen generates PyTorch's
bindings from native_functions.yaml; the outputs are committed and marked as generated, and
tests/test_mode_table.py fails when one is stale:

* ``mhakern/_modes_generated.py``: the record ``Modes`` (fields and defaults, ``from_op_args``,
  ``build`` (the fields by keyword, :data:`GROUPS` whole), ``op_args``, ``c_op_args`` /
  ``c_op_bwd_args``, ``required_features``, ``for_backend``, the properties of
  :data:`PROPERTIES`), ``DEFAULT_MODES`` and ``OP_SCHEMA_MODES``;
* ``mhakern/kernels/_modes_generated.py``: the plain call's record for the Triton launchers (the
  kernel layer imports nothing from the package) and the kernels' argument names per mode;
* ``csrc/generated/modes.h``: X-macro lists, no torch and no CUDA header: the feature bits and
  names (capabilities.h), ``ModeArgs``' members, the C++ operators' mode parameters and schema
  text, ``ModeParams``' members in layout order, which of them are copied from the op's
  arguments, and the feature test of each.

**Adding a scalar mode** (an int, float or bool the kernels read as it is given): a :class:`Mode`
row at the end of :data:`MODES` (with a :class:`Feature` at the end of :data:`FEATURES` if a
backend may lack it, and a ``copied`` :class:`Param` at the end of :data:`PARAMS` for the
compiled kernels), ``python tools/generate_modes.py``, then the reference math
(mhakern/reference.py), each kernel that implements it (and its family's feature mask in
csrc/capabilities.h, its Triton launcher's ``ModeArgs``), and its tests. Nothing else: the
record, both operator schemas, the C++ gathering, the parameter struct, its filling, the feature
checks and the feature names follow. A mode carried by a tensor (a block-sparse index, a
compiled modifier's handle) adds the same row plus its hand-written filler in
op_common.h's ``fill_mode_params`` (pointers and strides are not a copy) and its checks.

Rows are appended, never reordered: the operators take the modes positionally, and the order of
:data:`PARAMS` is ``ModeParams``' memory layout, which every compiled kernel reads.

Plain data: no import beyond the standard library (the generator loads this file by path).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

# Value kinds of a mode: the Python annotation, the Python operators' schema type, the C++
# operators' schema type, the C++ operator's parameter type, the ModeArgs member type (a pointer
# to the op's own optional for tensors: no refcount traffic) and the Python cast the C++ adapter
# applies (under torch.compile a SymInt becomes a plain int there).
KINDS = {
    # kind: (py annotation, op schema, C++ schema, C++ parameter, ModeArgs member, cast)
    "tensor": ("Optional[Tensor]", "Tensor?", "Tensor?", "const std::optional<at::Tensor>&",
               "const std::optional<at::Tensor>*", ""),
    "float": ("float", "float", "float", "double", "double", "float"),
    "int": ("int", "int", "int", "int64_t", "int64_t", "int"),
    "symint": ("int", "SymInt", "int", "int64_t", "int64_t", "int"),  # drawn inside a compiled graph
    "bool": ("bool", "bool", "bool", "bool", "bool", "bool"),
}

# When a mode is on (its feature needed): the test in Python and in C++ (``given`` is
# ModeArgs::given, the C++ side of ``is not None``).
ON_TESTS = {
    "given": ("{} is not None", "given({})"),
    "true": ("{}", "{}"),
    "positive": ("{} > 0.0", "{} > 0.0"),
    "nonneg": ("{} >= 0", "{} >= 0"),
}


@dataclass(frozen=True)
class Feature:
    """A mode a backend may lack: its name (``Backend.features``, capabilities.h
    ``kFeatureNames``) and, by its place in :data:`FEATURES`, its capability bit."""

    name: str
    doc: str

    @property
    def cpp(self) -> str:
        """capabilities.h's enumerator: ``kCacheBatchIdx`` for ``cache_batch_idx``."""
        return "k" + "".join(w.capitalize() for w in self.name.split("_"))


@dataclass(frozen=True)
class Mode:
    """One field of the call record, in operator argument order.

    ``kind``: a key of :data:`KINDS`; ``default``: the Python default (None for tensors).
    ``passes``: which C++ operators take it, "both", "fwd" or "bwd" (the Python operators take
    every field). ``feature``: the :class:`Feature` it needs when on, ``on`` the test (a key of
    :data:`ON_TESTS`); a mode without a feature qualifies another (``of``: seed qualifies
    dropout_p) and is ignored when telling a default call. ``backends``: False for a mode the op
    layer applies around every backend (sinks): in the Python operators only. ``c_required``:
    the C++ schema gives it no default (the original head of the schema). ``c_tail``: in the
    C++ schemas' defaulted tail, which the Python adapter passes only when one of the tail's
    modes is on (so that a call with only the head's modes parses a short argument list); new
    rows join the tail. ``triton``: the Triton kernels'
    arguments that carry it (mhakern/kernels/, checked by the tests). ``doc``: its semantics
    (docs/contract.md has the full text)."""

    name: str
    kind: str
    default: object = None
    doc: str = ""
    passes: str = "both"
    feature: Optional[str] = None
    on: Optional[str] = None
    of: Optional[str] = None
    backends: bool = True
    c_required: bool = False
    c_tail: bool = True
    triton: Tuple[str, ...] = ()


@dataclass(frozen=True)
class Param:
    """One mode field of the kernels' parameter struct ``ModeParams`` (csrc/mode_params.h, the
    base of the cpu AttnParams and the cuda FwdParams / BwdParams), in memory order.

    ``ctype`` / ``default``: its C++ type and initialiser. ``copied``: filled by
    ``static_cast<ctype>`` of the :class:`Mode` of the same name (a scalar); otherwise op_common.h's
    ``fill_mode_params`` derives it from a tensor mode. ``feature`` / ``on``: the parameter that
    says a call uses the feature (cuda attn_params.h ``mode_features_of``); ``on`` "given" is a
    non-null pointer here. ``doc``: a comment for the struct."""

    name: str
    ctype: str
    default: str
    doc: str = ""
    copied: bool = False
    feature: Optional[str] = None
    on: Optional[str] = None


FEATURES: Tuple[Feature, ...] = (
    Feature("attn_mask", "a bool or additive float mask"),
    Feature("mask_grad", "the gradient of an additive mask"),
    Feature("dropout", "dropout with the counter-based keep mask"),
    Feature("top_left", "causal and window offset 0 (SDPA's alignment)"),
    Feature("window", "a sliding window"),
    Feature("softcap", "tanh capping of the scaled scores (ModeParams::softcap)"),
    Feature("alibi", "ALiBi slopes (ModeParams::alibi)"),
    Feature("varlen", "packed variable-length sequences (ModeParams::cu_seqlens_q / _k)"),
    Feature("cache_batch_idx", "K/V batch rows chosen per batch element (ModeParams::kv_batch_idx)"),
    Feature("paged", "paged K/V through a block table (ModeParams::block_table)"),
    Feature("dropout_offsets", "the dropout hash's query and key positions and heads shifted (ModeParams::dropout_q0 "
            "/ dropout_k0 / dropout_h0 / dropout_heads): a block of a longer call (context parallelism) draws that "
            "call's keep mask"),
)

MODES: Tuple[Mode, ...] = (
    Mode("attn_mask", "tensor", None, feature="attn_mask", on="given", c_required=True, c_tail=False,
         triton=("MASK", "MASK_KIND"),
         doc="None, or a 4-D view broadcast to (B, H, Lq, Lk) (stride 0 on broadcast dims), bool (True = the key "
             "may be attended) or float (added to the scaled scores)"),
    Mode("dropout_p", "float", 0.0, feature="dropout", on="positive", c_required=True, c_tail=False,
         triton=("DROPOUT", "drop_thr"),
         doc="in [0, 1), with the 64-bit seed of the counter-based keep mask"),
    Mode("seed", "symint", 0, of="dropout_p", c_required=True, c_tail=False,
         triton=("seed_lo", "seed_hi"),
         doc="the keep mask's 64-bit seed (a SymInt: under torch.compile it is drawn inside the graph)"),
    Mode("top_left", "bool", False, feature="top_left", on="true", c_required=True, c_tail=False,
         triton=("TOP_LEFT",),
         doc="causal (and window) offset 0 instead of Lk_b - Lq"),
    Mode("window_left", "int", -1, feature="window", on="nonneg", c_required=True, c_tail=False,
         triton=("BAND", "win_l"),
         doc="sliding window size to the left of the diagonal, -1 for unbounded"),
    Mode("window_right", "int", -1, feature="window", on="nonneg", c_required=True, c_tail=False,
         triton=("BAND", "win_r"),
         doc="sliding window size to the right of the diagonal, -1 for unbounded"),
    Mode("mask_grad", "bool", False, passes="bwd", feature="mask_grad", on="true", c_required=True, c_tail=False,
         doc="a float mask requires grad: the backward returns dL/dscore"),
    Mode("softcap", "float", 0.0, feature="softcap", on="positive", c_tail=False, triton=("SOFTCAP", "softcap"),
         doc="0 (off) or > 0: the scaled score s becomes softcap * tanh(s / softcap), before the ALiBi bias "
             "and the mask are added"),
    Mode("alibi_slopes", "tensor", None, feature="alibi", on="given", c_tail=False, triton=("ALIBI", "SLOPES"),
         doc="None or a float32 (B, H) view (stride 0 on B for per-head slopes): the bias "
             "-slope[b, h] * |i + off - j| is added to the (capped) score, off as for causal"),
    Mode("sinks", "tensor", None, backends=False,
         doc="None or a float (H,) tensor of logits that join every row's softmax denominator (no value): "
             "lse' = logaddexp(lse, sink[h]), out' = out * exp(lse - lse'); the op layer applies it around "
             "every backend's forward and gives its gradient"),
    Mode("cu_seqlens_q", "tensor", None, feature="varlen", on="given",
         doc="packed sequences: int32 (num_seqs + 1,) prefix sums of the query tokens (first 0, last Tq)"),
    Mode("cu_seqlens_k", "tensor", None, feature="varlen", on="given",
         doc="packed sequences: int32 (num_seqs + 1,) prefix sums of the key tokens (first 0, last Tk)"),
    Mode("max_seqlen_q", "symint", 0, of="cu_seqlens_q",
         doc="a bound of the packed query lengths"),
    Mode("max_seqlen_k", "symint", 0, of="cu_seqlens_k",
         doc="a bound of the packed key lengths"),
    Mode("cache_batch_idx", "tensor", None, feature="cache_batch_idx", on="given",
         triton=("CACHE_IDX", "CBI"),
         doc="KV cache (forward only): int32 (B,), batch element b reads K/V row cache_batch_idx[b]"),
    Mode("block_table", "tensor", None, feature="paged", on="given", triton=("PAGED", "BT"),
         doc="paged KV cache (forward only): int32 (B, pages_per_seq); k/v are (num_pages, Hkv, page_size, D*) "
             "and key j of element b is row j % page_size of page block_table[b, j // page_size]"),
    Mode("dropout_q0", "int", 0, feature="dropout_offsets", on="positive",
         doc="the dropout hash sees query row i as i + dropout_q0 (>= 0; nothing else moves): the row's position "
             "in a longer sequence of which this call computes a block (mhakern.distributed)"),
    Mode("dropout_k0", "int", 0, feature="dropout_offsets", on="positive",
         doc="the dropout hash sees key j as j + dropout_k0 (>= 0; nothing else moves)"),
    Mode("dropout_h0", "int", 0, feature="dropout_offsets", on="positive",
         doc="the dropout hash sees query head h as h + dropout_h0 (>= 0): a head shard of a longer call"),
    Mode("dropout_heads", "int", 0, feature="dropout_offsets", on="positive",
         doc="the query head count H the dropout hash multiplies b by (0: the call's own H)"),
)

#: Properties of the record, each whether one of the named features is on.
PROPERTIES = {
    "packed": (("varlen",), "Whether the call holds packed sequences (either prefix sum given)."),
    "cached": (("cache_batch_idx", "paged"),
               "Whether K/V rows are addressed through the cache's indices (cache_batch_idx or pages)."),
}

#: Public arguments that give several fields at once (``mhakern.attention(window=...)``): the
#: record's :meth:`Modes.build` takes them whole, so that a caller passes the pair through and
#: never spells its fields. name: (the fields, in the value's order; what the value is). None
#: leaves the fields at their defaults.
GROUPS = {
    "window": (("window_left", "window_right"), "``(left, right)``, -1 = unbounded on that side"),
}

PARAMS: Tuple[Param, ...] = (
    Param("top_left", "bool", "false", "Causal and window offset: off = top_left ? 0 : Lk_b - Lq (bottom-right, the "
          "default).", copied=True, feature="top_left", on="true"),
    Param("window_left", "int64_t", "-1", "-1 = unbounded", copied=True, feature="window", on="nonneg"),
    Param("window_right", "int64_t", "-1", "-1 = unbounded", copied=True, feature="window", on="nonneg"),
    Param("mask", "const void*", "nullptr", "attn_mask: nullptr or a (B, H, Lq, Lk) view with element strides (0 on "
          "broadcast dims).", feature="attn_mask", on="given"),
    Param("mask_kind", "int", "0", "0 none, 1 bool (uint8/bool bytes, nonzero = visible), 2 additive float32"),
    Param("mask_sb", "int64_t", "0"),
    Param("mask_sh", "int64_t", "0"),
    Param("mask_sq", "int64_t", "0"),
    Param("mask_sk", "int64_t", "0"),
    Param("dmask", "float*", "nullptr", "backward: (B, H, Lq, Lk) contiguous float32 dL/dscore, or nullptr",
          feature="mask_grad", on="given"),
    Param("dropout_p", "double", "0.0", "double: the keep threshold floor(p * 2^32) must equal the reference's "
          "exactly.", copied=True, feature="dropout", on="positive"),
    Param("seed", "uint64_t", "0", copied=True),
    Param("softcap", "float", "0.f", "Score modifiers (docs/contract.md, \"Score modifiers\"), in the order a score "
          "meets them: s = scale * q.k; s = softcap * tanh(s / softcap) when softcap > 0; s += -slope(b, h) * "
          "|i + off - j| when alibi (off as for causal); then the additive mask. The backward chains through the "
          "cap: dS_pre = dS * (1 - tanh^2), and dmask is dS. 0 = off.", copied=True, feature="softcap",
          on="positive"),
    Param("alibi", "const float*", "nullptr", "float32 slopes, slope(b, h) = alibi[b * alibi_sb + h * alibi_sh]",
          feature="alibi", on="given"),
    Param("alibi_sb", "int64_t", "0", "element strides (alibi_sb 0: one slope per head)"),
    Param("alibi_sh", "int64_t", "0"),
    Param("cu_seqlens_q", "const int32_t*", "nullptr", "Packed variable-length sequences (docs/contract.md, "
          "\"Packed sequences\"): q, k, v are one batch element (B = 1, Lq / Lk the token counts Tq / Tk); sequence "
          "s holds the query tokens cu_seqlens_q[s] .. cu_seqlens_q[s + 1] - 1 and the key tokens cu_seqlens_k[s] "
          ".. cu_seqlens_k[s + 1] - 1 (int32 prefix sums, num_seqs + 1 entries, each length at most max_seqlen_q / "
          "max_seqlen_k); within a sequence everything is as for batch element s of a dense call (local positions, "
          "its own causal offset, dropout hash and ALiBi slope of (s, h)). nullptr: no packing.",
          feature="varlen", on="given"),
    Param("cu_seqlens_k", "const int32_t*", "nullptr"),
    Param("num_seqs", "int64_t", "0"),
    Param("max_seqlen_q", "int64_t", "0"),
    Param("max_seqlen_k", "int64_t", "0"),
    Param("kv_batch_idx", "const int32_t*", "nullptr", "KV cache addressing (forward only): the K/V batch row that "
          "batch element b reads (int32 (B,)); nullptr: row b.", feature="cache_batch_idx", on="given"),
    Param("block_table", "const int32_t*", "nullptr", "Paged K/V: k, v are (num_pages, Hkv, page_size, D) and key j "
          "of batch element b lives in page block_table[b * block_table_stride + j / page_size], row j % page_size; "
          "the logical key length (the params' Lk, set by the host) is pages_per_seq * page_size. nullptr: dense "
          "K/V.", feature="paged", on="given"),
    Param("block_table_stride", "int64_t", "0"),
    Param("page_size", "int64_t", "0"),
    Param("dropout_q0", "int64_t", "0", "Dropout hash offsets (docs/contract.md, \"Dropout\"): keep(b, h, i, j) is "
          "drawn for row i + dropout_q0 and key j + dropout_k0, visibility and every other mode unchanged; 0 = the "
          "call's own positions.", copied=True, feature="dropout_offsets", on="positive"),
    Param("dropout_k0", "int64_t", "0", copied=True, feature="dropout_offsets", on="positive"),
    Param("dropout_h0", "int64_t", "0", "The hash's head index h + dropout_h0 of dropout_heads heads (0: H): a head "
          "shard of a longer call.", copied=True, feature="dropout_offsets", on="positive"),
    Param("dropout_heads", "int64_t", "0", copied=True, feature="dropout_offsets", on="positive"),
)
