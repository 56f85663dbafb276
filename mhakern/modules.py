"""``FusedMHA``: a drop-in for ``torch.nn.MultiheadAttention`` on mhakern's fused kernels.

The module keeps nn.MultiheadAttention's parameter names, shapes and initialisation, so a
state dict moves between the two with ``load_state_dict``; its forward computes the same
function for the subset of options it supports, and raises a ValueError naming the argument for
the others. Extras: grouped-query attention (``num_kv_heads``), a free ``head_dim`` and the
choice of ``backend``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from . import backends
from .attention import attention

Tensor = torch.Tensor


class FusedMHA(nn.Module):
    r"""Multi-head attention computed by :func:`mhakern.attention`.

    Mirrors ``torch.nn.MultiheadAttention(embed_dim, num_heads, dropout, bias, add_bias_kv,
    add_zero_attn, kdim, vdim, batch_first, device, dtype)``; the differences are listed below.

    Args:
        embed_dim: E, the query (and output) feature size.
        num_heads: H, the number of query heads.
        dropout: attention dropout probability. Only 0 is computed; a module with
            ``dropout > 0`` can be built and used in ``eval()`` mode (where nn.MultiheadAttention
            applies no dropout either), but its forward raises in training mode.
        bias: add biases to the input and output projections.
        add_bias_kv, add_zero_attn: not supported; must be False.
        kdim, vdim: feature sizes of ``key`` and ``value`` (default E).
        batch_first: inputs and output are (N, L, E) when True (the default here, unlike
            nn.MultiheadAttention), (L, N, E) when False.
        device, dtype: of the parameters.
        num_kv_heads: Hkv, the number of key/value heads (default H). H must be a multiple of
            Hkv: query head ``h`` reads key/value head ``h // (H // Hkv)`` (grouped-query
            attention; Hkv = 1 is multi-query attention).
        head_dim: hd, the size of each head (default E // H, and then E must be divisible by H).
        backend: "auto" or a name from :func:`mhakern.available_backends`.

    Parameters (with Q = H * hd and K = Hkv * hd; with the defaults Q = K = E and every shape
    is exactly nn.MultiheadAttention's):

    * ``in_proj_weight`` (Q + 2K, E), when ``kdim == vdim == E``: rows ``[0, Q)`` project the
      query, ``[Q, Q + K)`` the key, ``[Q + K, Q + 2K)`` the value. Otherwise
      ``q_proj_weight`` (Q, E), ``k_proj_weight`` (K, kdim), ``v_proj_weight`` (K, vdim).
    * ``in_proj_bias`` (Q + 2K,) when ``bias``, split the same way (in both cases, as in
      nn.MultiheadAttention).
    * ``out_proj``: a Linear from Q to E features.

    Within each projection the features are head-major: feature ``h * hd + d`` is dimension
    ``d`` of head ``h``. Initialisation is nn.MultiheadAttention's: ``out_proj`` as a Linear,
    then Xavier-uniform input projection weights (the packed matrix as one), zero biases; with
    the default sizes and the same RNG state both modules start from identical parameters.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: Optional[int] = None,
        vdim: Optional[int] = None,
        batch_first: bool = True,
        device=None,
        dtype=None,
        *,
        num_kv_heads: Optional[int] = None,
        head_dim: Optional[int] = None,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        for name, val in (("embed_dim", embed_dim), ("num_heads", num_heads)):
            _check_positive_int(name, val)
        for name, val in (("kdim", kdim), ("vdim", vdim), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if val is not None:
                _check_positive_int(name, val)
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout <= 1.0:
            raise ValueError(f"dropout: expected a probability in [0, 1], got {dropout!r}")
        for name, val in (("bias", bias), ("batch_first", batch_first)):
            if not isinstance(val, bool):
                raise TypeError(f"{name}: expected a bool, got {type(val).__name__}")
        if add_bias_kv:
            raise ValueError("add_bias_kv: not supported by FusedMHA; only add_bias_kv=False is accepted")
        if add_zero_attn:
            raise ValueError("add_zero_attn: not supported by FusedMHA; only add_zero_attn=False is accepted")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_kv_heads: must divide num_heads ({num_heads}), got {num_kv_heads}"
            )
        if head_dim is None:
            if embed_dim % num_heads != 0:
                raise ValueError(
                    f"embed_dim: must be divisible by num_heads ({num_heads}) when head_dim is not given, "
                    f"got {embed_dim}"
                )
            head_dim = embed_dim // num_heads
        if not isinstance(backend, str):
            raise TypeError(f"backend: expected a string, got {type(backend).__name__}")
        if backend != "auto":
            backends.get(backend)  # raises ValueError naming the known backends

        factory = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dropout = float(dropout)
        self.batch_first = batch_first
        self.backend = backend
        # nn.MultiheadAttention keeps these as attributes; they are always off here.
        self.bias_k = self.bias_v = None
        self.add_zero_attn = False

        q_out, kv_out = num_heads * head_dim, num_kv_heads * head_dim
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty((q_out + 2 * kv_out, embed_dim), **factory))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty((q_out, embed_dim), **factory))
            self.k_proj_weight = nn.Parameter(torch.empty((kv_out, self.kdim), **factory))
            self.v_proj_weight = nn.Parameter(torch.empty((kv_out, self.vdim), **factory))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(q_out + 2 * kv_out, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        # The same class and creation order as nn.MultiheadAttention, so that equal RNG states
        # give equal parameters (and quantization tooling treats it alike).
        self.out_proj = NonDynamicallyQuantizableLinear(q_out, embed_dim, bias=bias, **factory)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        if self._qkv_same_embed_dim:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            nn.init.xavier_uniform_(self.q_proj_weight)
            nn.init.xavier_uniform_(self.k_proj_weight)
            nn.init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)

    def extra_repr(self) -> str:
        s = f"embed_dim={self.embed_dim}, num_heads={self.num_heads}"
        if self.num_kv_heads != self.num_heads:
            s += f", num_kv_heads={self.num_kv_heads}"
        if self.head_dim * self.num_heads != self.embed_dim:
            s += f", head_dim={self.head_dim}"
        if not self._qkv_same_embed_dim:
            s += f", kdim={self.kdim}, vdim={self.vdim}"
        if self.dropout:
            s += f", dropout={self.dropout}"
        return s + f", batch_first={self.batch_first}, backend={self.backend!r}"

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Optional[Tensor] = None,
        need_weights: bool = False,
        attn_mask: Optional[Tensor] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
        *,
        key_lengths: Optional[Tensor] = None,
    ) -> Tuple[Tensor, None]:
        r"""Attend from ``query`` to ``key``/``value``; returns ``(out, None)``.

        Shapes, as in nn.MultiheadAttention: ``query`` (N, L, E), ``key`` (N, S, kdim),
        ``value`` (N, S, vdim) with ``batch_first``, else (L, N, E), (S, N, kdim), (S, N, vdim);
        unbatched (L, E), (S, kdim), (S, vdim). ``out`` has the query's shape; with
        ``batch_first=False`` it is a transposed view of an (N, L, E) tensor (no copy is made).

        Args:
            key_padding_mask: (N, S), or (S,) unbatched: bool (True = ignore that key) or float
                (additive: 0 keeps a key, -inf ignores it). Only right padding is supported:
                in each row the ignored keys must form a suffix (possibly empty, possibly the
                whole row); otherwise ValueError (under ``torch.compile`` the check runs inside
                the graph and raises RuntimeError instead). It is converted to ``key_lengths``.
            need_weights: must be False (the fused kernels never form the weights).
            attn_mask: must be None; use ``is_causal`` for causal masking.
            average_attn_weights: ignored (it only matters with ``need_weights``).
            is_causal: causal masking aligned to the bottom right, per batch element: with
                ``n_b`` the number of keys element ``b`` keeps, query ``i`` sees key ``j`` iff
                ``j < n_b`` and ``j <= i + n_b - L``. Without padding (``n_b = S``) and with
                L == S this is exactly nn.MultiheadAttention's (top-left) causal mask
                ``j <= i``; with L != S the last query lines up with the last key (the KV-cache
                convention). With right padding the alignment is to each row's last kept key,
                which is *not* what right-padded causal self-attention wants; there, pass
                ``is_causal=True`` without the mask: the causal rule already hides every later
                key, padded ones included, from each real query, and only the outputs of padded
                query rows differ from nn.MultiheadAttention's.
            key_lengths: (extra) int tensor (N,) (shape () or (1,) unbatched): keys at
                positions >= key_lengths[b] are ignored. An alternative to
                ``key_padding_mask``; give at most one of the two.

        A query that sees no key (every key padded, or causally hidden) gets attention output
        0, so ``out`` is ``out_proj.bias`` there and its gradients are 0, where
        nn.MultiheadAttention returns NaN.
        """
        if need_weights:
            raise ValueError(
                "need_weights: FusedMHA never forms attention weights; only need_weights=False is accepted"
            )
        if attn_mask is not None:
            raise ValueError(
                "attn_mask: not supported by FusedMHA; only None is accepted (use is_causal=True for causal "
                "masking and key_padding_mask or key_lengths for padding)"
            )
        if not isinstance(is_causal, bool):
            raise TypeError(f"is_causal: expected a bool, got {type(is_causal).__name__}")
        if self.training and self.dropout > 0.0:
            raise ValueError(
                f"dropout: attention dropout is not supported in training mode (dropout={self.dropout}); "
                "build the module with dropout=0.0 or call .eval()"
            )
        if key_padding_mask is not None and key_lengths is not None:
            raise ValueError("key_padding_mask, key_lengths: give at most one of the two")

        batched = _check_inputs(query, key, value, self.embed_dim, self.kdim, self.vdim, self.batch_first)
        # Project in the inputs' own layout (no copy of them), sharing a GEMM where the inputs
        # are one tensor; then see the projections as (N, L, features).
        q, k, v = self._in_projection(query, key, value, query is key and key is value, key is value)
        if not batched:
            q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        elif not self.batch_first:
            # (L, N, F) memory seen as (N, L, F); mhakern.attention takes such strides as they are.
            q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        N, L, _ = q.shape
        S = k.shape[1]

        if key_padding_mask is not None:
            key_lengths = _right_padding_lengths(key_padding_mask, N, S, batched)
        elif key_lengths is not None and not batched:
            if isinstance(key_lengths, Tensor) and key_lengths.dim() == 0:
                key_lengths = key_lengths.reshape(1)

        H, Hkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        # Split the features into heads and see them as (N, H, L, hd): views, no copy. The output
        # comes back laid out like q, i.e. (N, L, H, hd) in memory, so merging heads is a view.
        q = q.unflatten(-1, (H, hd)).transpose(1, 2)
        k = k.unflatten(-1, (Hkv, hd)).transpose(1, 2)
        v = v.unflatten(-1, (Hkv, hd)).transpose(1, 2)
        o = attention(q, k, v, causal=is_causal, key_lengths=key_lengths, backend=self.backend)
        out = self.out_proj(o.transpose(1, 2).reshape(N, L, H * hd))

        if not batched:
            return out.squeeze(0), None
        if not self.batch_first:
            return out.transpose(0, 1), None
        return out, None

    def _in_projection(
        self, query: Tensor, key: Tensor, value: Tensor, same_qkv: bool, same_kv: bool
    ) -> Tuple[Tensor, Tensor, Tensor]:
        """Project to (N, L, H*hd), (N, S, Hkv*hd), (N, S, Hkv*hd), sharing GEMMs where inputs coincide."""
        q_out = self.num_heads * self.head_dim
        kv_out = self.num_kv_heads * self.head_dim
        b = self.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else b.split((q_out, kv_out, kv_out))
        if self._qkv_same_embed_dim:
            w = self.in_proj_weight
            if same_qkv:
                # Self-attention: one GEMM; q, k, v are column slices of its output.
                return F.linear(query, w, b).split((q_out, kv_out, kv_out), dim=-1)
            wq, wk, wv = w.split((q_out, kv_out, kv_out))
            if same_kv:
                bkv = None if b is None else b[q_out:]
                k, v = F.linear(key, w[q_out:], bkv).split((kv_out, kv_out), dim=-1)
                return F.linear(query, wq, bq), k, v
        else:
            wq, wk, wv = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        return F.linear(query, wq, bq), F.linear(key, wk, bk), F.linear(value, wv, bv)


def _check_positive_int(name: str, val) -> None:
    if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
        raise ValueError(f"{name}: expected a positive int, got {val!r}")


def _check_inputs(query, key, value, embed_dim: int, kdim: int, vdim: int, batch_first: bool) -> bool:
    """Check shapes and feature sizes as nn.MultiheadAttention does; return whether batched."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if query.dim() not in (2, 3):
        raise ValueError(
            f"query: expected 3 dims (batched) or 2 dims (unbatched), got shape {tuple(query.shape)}"
        )
    for name, x in (("key", key), ("value", value)):
        if x.dim() != query.dim():
            raise ValueError(
                f"{name}: expected {query.dim()} dims like query (shape {tuple(query.shape)}), "
                f"got shape {tuple(x.shape)}"
            )
    for name, x, want, what in (
        ("query", query, embed_dim, "embed_dim"),
        ("key", key, kdim, "kdim"),
        ("value", value, vdim, "vdim"),
    ):
        if x.shape[-1] != want:
            raise ValueError(f"{name}: last dim must be {what}={want}, got shape {tuple(x.shape)}")
    if key.shape[:-1] != value.shape[:-1]:
        raise ValueError(
            f"key, value: leading dims (length and batch) must match, got key {tuple(key.shape)} "
            f"and value {tuple(value.shape)}"
        )
    if query.dim() == 3:
        bd = 0 if batch_first else 1
        if key.shape[bd] != query.shape[bd]:
            raise ValueError(
                f"key: batch size {key.shape[bd]} (dim {bd}, batch_first={batch_first}) does not match "
                f"query's {query.shape[bd]}"
            )
    return query.dim() == 3


def _right_padding_lengths(mask, N: int, S: int, batched: bool) -> Tensor:
    """Key lengths (N,) int64 of a right-padding ``key_padding_mask``; ValueError otherwise."""
    if not isinstance(mask, Tensor):
        raise TypeError(f"key_padding_mask: expected a torch.Tensor, got {type(mask).__name__}")
    want = (N, S) if batched else (S,)
    if tuple(mask.shape) != want:
        raise ValueError(f"key_padding_mask: expected shape {want} (batch, source length), got {tuple(mask.shape)}")
    if not batched:
        mask = mask.unsqueeze(0)
    if mask.dtype == torch.bool:
        keep = ~mask
        well_formed = None
    elif mask.is_floating_point():
        keep = mask == 0
        well_formed = torch.all(keep | torch.isneginf(mask))
    else:
        raise TypeError(f"key_padding_mask: expected a bool or floating-point tensor, got {mask.dtype}")
    lengths = keep.sum(dim=1)
    # Right padding: the kept keys are exactly a prefix of each row.
    prefix = torch.all(keep == (torch.arange(S, device=mask.device) < lengths.unsqueeze(1)))
    ok = prefix if well_formed is None else prefix & well_formed
    msg = (
        "key_padding_mask: only right padding is supported: each row must keep a prefix of the keys and "
        "ignore the rest (bool: False then True; float: 0 then -inf, no other values)"
    )
    if torch.compiler.is_compiling():
        # A Python branch on tensor data would break the graph; the check runs as an op instead
        # (it raises RuntimeError when the compiled code runs).
        torch._assert_async(ok, msg)
    elif not bool(ok):
        raise ValueError(msg)
    return lengths
