"""``FusedMHA``: a drop-in for ``torch.nn.MultiheadAttention`` on mhakern's fused kernels.

The module keeps nn.MultiheadAttention's parameter names, shapes and initialisation, so a
state dict moves between the two with ``load_state_dict``, and its forward takes the same
arguments and computes the same function (outputs, attention weights and gradients). Extras:
grouped-query attention (``num_kv_heads``), a free ``head_dim``, ``key_lengths``, causal
masking without a mask tensor, and the choice of ``backend``.
"""
from __future__ import annotations

import math
import warnings
from typing import Optional, Tuple, Union

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.modules.activation import MultiheadAttention as _TorchMHA
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from . import backends, reference
from ._errors import ArgumentError, ShapeAssertionError, TypeAssertionError
from .attention import attention
from .checks import check_softcap, draw_seed, is_causal_bias, resolve_causal_bias
from .varlen import attention_varlen

Tensor = torch.Tensor


class FusedMHA(nn.Module):
    r"""Multi-head attention computed by :func:`mhakern.attention`.

    Mirrors ``torch.nn.MultiheadAttention(embed_dim, num_heads, dropout, bias, add_bias_kv,
    add_zero_attn, kdim, vdim, batch_first, device, dtype)``; the differences are listed below.

    Args:
        embed_dim: E, the query (and output) feature size.
        num_heads: H, the number of query heads.
        dropout: attention dropout probability in [0, 1], applied in training mode to the
            attention probabilities (and to the returned weights), as nn.MultiheadAttention
            does. The keep mask is mhakern's counter-based one (see :func:`mhakern.attention`),
            seeded by one draw from torch's default CPU generator per forward: equal RNG states
            give equal results; the bits differ from torch's own dropout.
        bias: add biases to the input and output projections.
        add_bias_kv: append one learnt key and value (``bias_k``, ``bias_v``) to every
            sequence, after its projected keys and values.
        add_zero_attn: append one key and value of zeros (after ``bias_k``/``bias_v``).
        kdim, vdim: feature sizes of ``key`` and ``value`` (default E).
        batch_first: inputs and output are (N, L, E) when True, (L, N, E) when False (the
            default, as in nn.MultiheadAttention, so that swapping the modules changes nothing).
        device, dtype: of the parameters.
        num_kv_heads: Hkv, the number of key/value heads (default H). H must be a multiple of
            Hkv: query head ``h`` reads key/value head ``h // (H // Hkv)`` (grouped-query
            attention; Hkv = 1 is multi-query attention).
        head_dim: hd, the size of each head (default E // H, and then E must be divisible by H).
        backend: "auto" or a name from :func:`mhakern.available_backends`.
        softcap: None, or a positive number: the scores are capped, ``softcap * tanh(s / softcap)``
            (Gemma 2; :func:`mhakern.attention`'s ``softcap``).
        alibi: None; True for the standard ALiBi slopes ``2^(-8 (h + 1) / H)`` of head ``h``; or
            a tensor of slopes, (H,) or (N, H) (a non-persistent buffer ``alibi_slopes``,
            float32): ``-slope * |i + off - j|`` is added to the scores, ``off`` the causal
            alignment's offset.
        sinks: True adds a learnable logit per query head, the Parameter ``sinks`` (H,),
            initialised to 0, that joins every row's softmax denominator (gpt-oss' attention
            sinks; :func:`mhakern.attention`'s ``sinks``).
        context_parallel_group: None, or a torch.distributed group (or one-dimensional
            DeviceMesh) over which the sequence is sharded: each rank passes its shard of the
            sequence (laid out by ``context_parallel_layout``, :func:`mhakern.distributed.shard`)
            and gets its shard of the output, through
            :func:`mhakern.distributed.context_parallel_attention` (self-attention over the
            whole sequence; ``is_causal`` and ``key_lengths`` global; no masks, weights,
            appended keys, packing or dropout in training, each refused by name).
        context_parallel_method, context_parallel_layout: that function's ``method`` and
            ``layout`` ("ring", "zigzag" by default).

    Parameters (with Q = H * hd and K = Hkv * hd; with the defaults Q = K = E and every shape
    is exactly nn.MultiheadAttention's):

    * ``in_proj_weight`` (Q + 2K, E), when ``kdim == vdim == E``: rows ``[0, Q)`` project the
      query, ``[Q, Q + K)`` the key, ``[Q + K, Q + 2K)`` the value. Otherwise
      ``q_proj_weight`` (Q, E), ``k_proj_weight`` (K, kdim), ``v_proj_weight`` (K, vdim).
    * ``in_proj_bias`` (Q + 2K,) when ``bias``, split the same way (in both cases, as in
      nn.MultiheadAttention).
    * ``bias_k``, ``bias_v`` (1, 1, K) with ``add_bias_kv`` (None otherwise).
    * ``out_proj``: a Linear from Q to E features.

    Within each projection the features are head-major: feature ``h * hd + d`` is dimension
    ``d`` of head ``h``. Initialisation is nn.MultiheadAttention's: ``out_proj`` as a Linear,
    then Xavier-uniform input projection weights (the packed matrix as one), zero biases,
    Xavier-normal ``bias_k`` and ``bias_v``; with the default sizes and the same RNG state both
    modules start from identical parameters.
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
        batch_first: bool = False,
        device=None,
        dtype=None,
        *,
        num_kv_heads: Optional[int] = None,
        head_dim: Optional[int] = None,
        backend: str = "auto",
        softcap: Optional[float] = None,
        alibi: Union[None, bool, Tensor] = None,
        sinks: bool = False,
        context_parallel_group=None,
        context_parallel_method: str = "ring",
        context_parallel_layout: str = "zigzag",
    ) -> None:
        super().__init__()
        for name, val in (("embed_dim", embed_dim), ("num_heads", num_heads)):
            _check_positive_int(name, val)
        for name, val in (("kdim", kdim), ("vdim", vdim), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if val is not None:
                _check_positive_int(name, val)
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout <= 1.0:
            raise ValueError(f"dropout: expected a probability in [0, 1], got {dropout!r}")
        for name, val in (
            ("bias", bias),
            ("add_bias_kv", add_bias_kv),
            ("add_zero_attn", add_zero_attn),
            ("batch_first", batch_first),
        ):
            _check_flag(name, val)
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_kv_heads: must divide num_heads ({num_heads}), got {num_kv_heads}"
            )
        if head_dim is None:
            if embed_dim % num_heads != 0:
                raise ShapeAssertionError(
                    f"embed_dim: must be divisible by num_heads ({num_heads}) when head_dim is not given, "
                    f"got {embed_dim}"
                )
            head_dim = embed_dim // num_heads
        if not isinstance(backend, str):
            raise TypeError(f"backend: expected a string, got {type(backend).__name__}")
        if backend != "auto":
            backends.get(backend)  # raises ValueError naming the known backends
        _check_flag("sinks", sinks)
        self.softcap = None if softcap is None else check_softcap(softcap)

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
        # Not module state: a process group is not picklable, and a state dict is the same with or
        # without context parallelism.
        self.context_parallel_group = context_parallel_group
        self.context_parallel_method = context_parallel_method
        self.context_parallel_layout = context_parallel_layout

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
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty((1, 1, kv_out), **factory))
            self.bias_v = nn.Parameter(torch.empty((1, 1, kv_out), **factory))
        else:
            # Plain attributes, as in nn.MultiheadAttention (code that reads them finds None).
            self.bias_k = self.bias_v = None
        self.add_zero_attn = add_zero_attn
        self.register_buffer("alibi_slopes", _alibi_slopes(alibi, num_heads, device), persistent=False)
        if sinks:
            self.sinks = nn.Parameter(torch.zeros(num_heads, **factory))
        else:
            self.register_parameter("sinks", None)
        self._reset_parameters()
        # torch's TransformerEncoderLayer takes its inference fast path (one fused aten op fed
        # with self_attn's weights, which would bypass mhakern) when self_attn looks like an
        # nn.MultiheadAttention, and declines it when any submodule has forward hooks. A no-op
        # hook on a child that is never called is that sign: inside torch's layers FusedMHA runs
        # its own kernels in every mode (TransformerEncoder may still hand the layers nested
        # tensors: see forward). On the child, not on FusedMHA itself: FusedMHA's own hooks
        # stay empty, so nn.Module.__call__ skips its hook-running path (about 2 us a call), and
        # the hook dicts stay plain dicts, which torch.compile traces (it cannot take len() of a
        # dict subclass).
        self._torch_fast_path_sign = _TorchFastPathSign()

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
        if self.bias_k is not None:
            nn.init.xavier_normal_(self.bias_k)
            nn.init.xavier_normal_(self.bias_v)
        if self.sinks is not None:
            nn.init.zeros_(self.sinks)

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
        if self.bias_k is not None:
            s += ", add_bias_kv=True"
        if self.add_zero_attn:
            s += ", add_zero_attn=True"
        if self.softcap is not None:
            s += f", softcap={self.softcap}"
        if self.alibi_slopes is not None:
            s += ", alibi=True"
        if self.sinks is not None:
            s += ", sinks=True"
        return s + f", batch_first={self.batch_first}, backend={self.backend!r}"

    def __prepare_scriptable__(self):
        # torch.jit.script calls this on every submodule before compiling it. FusedMHA's forward
        # runs Python (dispatch, the autograd op, nested inputs) that TorchScript cannot compile.
        # Where torch.nn.MultiheadAttention computes the same function (no GQA, the default head
        # dim), that module is scripted instead, sharing this one's parameters, and a warning
        # says so (the scripted model runs torch's kernels, with torch's is_causal rule);
        # otherwise one line refuses. Never a silent swap.
        if (self.num_kv_heads != self.num_heads or self.head_dim * self.num_heads != self.embed_dim
                or self.softcap is not None or self.alibi_slopes is not None or self.sinks is not None):
            raise RuntimeError(
                "mhakern.FusedMHA with num_kv_heads, head_dim, softcap, alibi or sinks of its own cannot be compiled by "
                "TorchScript (torch.jit.script): use torch.compile or torch.export, which run its kernels"
            )
        warnings.warn(
            "mhakern.FusedMHA under torch.jit.script: TorchScript cannot run mhakern's kernels, so "
            "torch.nn.MultiheadAttention with the same parameters is scripted in its place (use "
            "torch.compile or torch.export to keep mhakern's kernels)",
            stacklevel=2,
        )
        # torch's class as imported with this module (code that swaps nn.MultiheadAttention for
        # FusedMHA must not get FusedMHA back here).
        twin = _TorchMHA(
            self.embed_dim, self.num_heads, dropout=self.dropout, bias=self.in_proj_bias is not None,
            add_bias_kv=self.bias_k is not None, add_zero_attn=self.add_zero_attn, kdim=self.kdim,
            vdim=self.vdim, batch_first=self.batch_first, device="meta",
        )
        for name in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias",
                     "bias_k", "bias_v"):
            setattr(twin, name, getattr(self, name))
        twin.out_proj = self.out_proj
        return twin.train(self.training)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Optional[Tensor] = None,
        need_weights: bool = True,
        attn_mask: Optional[Tensor] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
        *,
        key_lengths: Optional[Tensor] = None,
        cu_seqlens=None,
        max_seqlen=None,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        r"""Attend from ``query`` to ``key``/``value``; returns ``(out, weights)``.

        Shapes, as in nn.MultiheadAttention: ``query`` (N, L, E), ``key`` (N, S, kdim),
        ``value`` (N, S, vdim) with ``batch_first``, else (L, N, E), (S, N, kdim), (S, N, vdim);
        unbatched (L, E), (S, kdim), (S, vdim). ``out`` has the query's shape; with
        ``batch_first=False`` it is a transposed view of an (N, L, E) tensor (no copy is made).
        Below, S' = S + ``add_bias_kv`` + ``add_zero_attn`` counts the appended keys, which no
        mask hides.

        Args:
            key_padding_mask: (N, S), or (S,) unbatched: bool (True = ignore that key) or float
                (added to the scores of that key; -inf ignores it). Any pattern (right or left
                padding, holes). A right-padding mask (bool, or float of 0 and -inf only) runs
                as per-element key lengths; any other as an attention mask (under
                ``torch.compile`` always the latter: the check would need the mask's data).
            need_weights: also return the attention weights (default True, as in torch). They
                are computed in a second pass, only when asked, exactly from the forward's
                log-sum-exp: ``exp(scale * q.k + mask - lse)``; with dropout in training they
                are the dropped and rescaled probabilities that produced ``out``.
            attn_mask: (L, S) or (N * H, L, S) (unbatched (L, S) or (H, L, S)); bool (True =
                *not* allowed to attend, nn.MultiheadAttention's convention, opposite to SDPA's)
                or float (added to the scores). Merged with ``key_padding_mask`` as torch does
                (a float sum when either is float). A float mask that requires grad gets its
                gradient.
            average_attn_weights: with ``need_weights``, return weights averaged over heads,
                (N, L, S'), rather than per head, (N, H, L, S') (unbatched without the N).
            is_causal: as in nn.MultiheadAttention, a hint that ``attn_mask`` is the causal
                mask: when ``need_weights`` is False and there is no ``key_padding_mask`` the
                mask is dropped and the top-left causal rule ``j <= i`` applied to all S' keys
                (SDPA's ``is_causal``); otherwise ``attn_mask`` is used as given. Extension:
                without ``attn_mask`` (which nn.MultiheadAttention refuses) it is causal masking
                aligned to the bottom right, per batch element: with ``n_b`` = 1 + the position
                of the last key that element keeps (S' when it keeps the last, S' with
                ``add_bias_kv`` or ``add_zero_attn``), query ``i`` sees key ``j`` iff
                ``j <= i + n_b - L``. With L == S' and no padding this is ``j <= i``; with
                L != S' the last query lines up with the last key (the KV-cache convention).
                With right padding the alignment is to each row's last kept key, which is
                *not* what right-padded causal self-attention wants; there, pass
                ``is_causal=True`` without the mask: the causal rule already hides every later
                key, padded ones included, from each real query, and only the outputs of padded
                query rows differ from nn.MultiheadAttention's.
            key_lengths: (extra) int tensor (N,) (shape () or (1,) unbatched): keys at
                positions >= key_lengths[b] (among the S given ones) are ignored. An alternative
                to a right-padding ``key_padding_mask``; give at most one of the two.
            cu_seqlens: (extra) packed variable-length sequences: ``query`` (T, E), ``key``
                (Tk, kdim), ``value`` (Tk, vdim) hold the tokens of every sequence one after
                the other, and ``cu_seqlens`` their integer (num_seqs + 1,) prefix sums (one
                tensor for query and key alike, or a pair ``(cu_seqlens_q, cu_seqlens_k)``);
                sequence s attends only to its own keys (:func:`mhakern.attention_varlen`;
                ``is_causal`` is causal per sequence, bottom-right). Needs
                ``need_weights=False`` and no masks, key lengths, ``add_bias_kv`` or
                ``add_zero_attn``; ``out`` is (T, E), weights None.
            max_seqlen: with ``cu_seqlens``, the longest sequence (an int, or a pair for query
                and key); default: read from ``cu_seqlens`` (one host read).

        Returns:
            ``out``, and ``weights`` (None unless ``need_weights``) in the query's dtype.

        A query that sees no key (every key padded or masked) gets attention output 0, so
        ``out`` is ``out_proj.bias`` there, its gradients are 0 and its weights 0;
        nn.MultiheadAttention gives the same output when ``need_weights`` is False and NaN
        output and weights when it is True.
        """
        for name, val in (
            ("need_weights", need_weights),
            ("average_attn_weights", average_attn_weights),
            ("is_causal", is_causal),
        ):
            _check_flag(name, val)
        if key_padding_mask is not None and key_lengths is not None:
            raise ValueError("key_padding_mask, key_lengths: give at most one of the two")
        if cu_seqlens is not None:
            return self._forward_packed(query, key, value, cu_seqlens, max_seqlen, key_padding_mask, need_weights,
                                        attn_mask, is_causal, key_lengths)
        if max_seqlen is not None:
            raise ArgumentError("max_seqlen: only with cu_seqlens (packed sequences)")
        if any(isinstance(x, Tensor) and x.is_nested for x in (query, key, value)):
            return self._forward_nested(query, key, value, key_padding_mask, need_weights, attn_mask, is_causal,
                                        key_lengths)

        batched = _check_inputs(query, key, value, self.embed_dim, self.kdim, self.vdim, self.batch_first)
        if self.context_parallel_group is not None:
            return self._forward_context_parallel(query, key, value, key_padding_mask, need_weights, attn_mask,
                                                  is_causal, key_lengths, batched)
        H, Hkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        if batched:
            bd, ld = (0, 1) if self.batch_first else (1, 0)
            N, L, S = query.shape[bd], query.shape[ld], key.shape[ld]
        else:
            N, L, S = 1, query.shape[0], key.shape[0]
        dev = query.device
        pad, amask, causal, top_left, key_lengths = self._visibility(
            attn_mask, key_padding_mask, key_lengths, is_causal, need_weights, N, L, S, batched, dev)
        q, k, v, extra = self._project(query, key, value, N, batched)
        Sx = S + extra

        lengths, kmask = _kept_keys(pad, key_lengths, N, S, extra > 0, self.backend)
        if kmask is not None:
            kmask = kmask[:, None, None, :]
        mask = _merge_masks(_append_visible(amask, extra), _append_visible(kmask, extra))
        if causal and top_left and lengths is None and L == Sx:
            top_left = False  # the same rule either way; bottom-right leaves every backend a choice

        p = self.dropout if self.training else 0.0
        kw = {"causal": causal, "key_lengths": lengths, "backend": self.backend}
        modifiers = self._modifiers(N)
        kw.update(modifiers)
        if mask is not None:
            kw["attn_mask"] = mask
        if top_left:
            kw["causal_align"] = "top_left"
        dropout_seed = None
        if 0.0 < p < 1.0:
            # One draw from torch's default generator, as nn.MultiheadAttention's dropout makes;
            # it seeds the generator handed to attention(), so that the weights pass can repeat
            # attention()'s own seed draw and regenerate its keep mask.
            dropout_seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
            kw["dropout_p"] = p
            kw["generator"] = torch.Generator().manual_seed(dropout_seed)

        # Split the features into heads and see them as (N, H, L, hd): views, no copy. The output
        # comes back laid out like q, i.e. (N, L, H, hd) in memory, so merging heads is a view.
        q = q.unflatten(-1, (H, hd)).transpose(1, 2)
        k = k.unflatten(-1, (Hkv, hd)).transpose(1, 2)
        v = v.unflatten(-1, (Hkv, hd)).transpose(1, 2)
        if need_weights:
            o, lse = attention(q, k, v, return_lse=True, **kw)
        else:
            o = attention(q, k, v, **kw)
        if p >= 1.0:
            # Every probability dropped: torch's dropout multiplies by zero (NaN stays NaN).
            o = o * 0.0
        out = self.out_proj(o.transpose(1, 2).reshape(N, L, H * hd))

        weights = None
        if need_weights:
            weights = self._weights(q, k, lse, mask, lengths, causal, top_left, dropout_seed, p, modifiers,
                                    average_attn_weights, batched).to(query.dtype)

        if not batched:
            return out.squeeze(0), weights
        if not self.batch_first:
            return out.transpose(0, 1), weights
        return out, weights

    def _visibility(self, attn_mask, key_padding_mask, key_lengths, is_causal, need_weights, N, L, S, batched, dev):
        """The masks in SDPA's convention and the causal rule, as nn.MultiheadAttention reads its
        arguments: ``(pad (N, S) or None, amask (1|N, 1|H, L, S) or None, causal, top_left,
        key_lengths)``."""
        H = self.num_heads
        bias_causal = None  # (top_left,) of a CausalBias attn_mask read as causal masking
        if attn_mask is not None and is_causal_bias(attn_mask):
            appended = self.bias_k is not None or self.add_zero_attn
            exact = key_padding_mask is None and key_lengths is None and not appended
            mask, tl = resolve_causal_bias(attn_mask, L, S, exact_bottom_right=exact)
            if mask is None and appended:  # the appended keys stay visible, as with any attn_mask
                mask = torch.ones(L, S, dtype=torch.bool, device=dev).tril()
            if mask is not None:
                attn_mask = ~mask.view(L, S)  # nn.MultiheadAttention's convention: True = hidden
            else:
                attn_mask, bias_causal = None, (tl,)
        # Both masks in SDPA's convention (True or a finite value: may attend).
        pad = _padding_mask(key_padding_mask, N, S, batched, dev)
        amask = _attn_mask_4d(attn_mask, N, H, L, S, batched, dev)
        if key_lengths is not None and not batched:
            if isinstance(key_lengths, Tensor) and key_lengths.dim() == 0:
                key_lengths = key_lengths.reshape(1)

        # is_causal, as nn.MultiheadAttention reads it (F.multi_head_attention_forward): a hint
        # that replaces the mask by SDPA's top-left causal rule only without key_padding_mask
        # and without weights; otherwise the mask speaks.
        causal = top_left = False
        if bias_causal is not None:
            causal, top_left = True, bias_causal[0]
        elif is_causal:
            if amask is None:
                causal = True
            elif key_padding_mask is None and not need_weights:
                amask, causal, top_left = None, True, True

        return pad, amask, causal, top_left, key_lengths

    def _project(self, query, key, value, N: int, batched: bool):
        """(q (N, L, H*hd), k, v (N, S', Hkv*hd), the number of appended keys)."""
        # Project in the inputs' own layout (no copy of them), sharing a GEMM where the inputs
        # are one tensor; then see the projections as (N, L, features).
        q, k, v = self._in_projection(query, key, value, query is key and key is value, key is value)
        if not batched:
            q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        elif not self.batch_first:
            # (L, N, F) memory seen as (N, L, F); mhakern.attention takes such strides as they are.
            q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        extra = 0
        if self.bias_k is not None:
            k = torch.cat([k, self.bias_k.expand(N, 1, -1)], dim=1)
            v = torch.cat([v, self.bias_v.expand(N, 1, -1)], dim=1)
            extra += 1
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(N, 1, k.shape[-1])], dim=1)
            v = torch.cat([v, v.new_zeros(N, 1, v.shape[-1])], dim=1)
            extra += 1
        return q, k, v, extra

    def _weights(self, q, k, lse, mask, lengths, causal, top_left, dropout_seed, p, modifiers, average, batched):
        """The attention weights of the call that returned ``lse`` (need_weights)."""
        N, H, L, hd = q.shape
        keep = None
        if dropout_seed is not None:
            seed = draw_seed(torch.Generator().manual_seed(dropout_seed))
            # Under torch.compile the hash runs eagerly (a graph break): inductor's CPU code for
            # its 64-bit integer mixing does not compile (torch 2.13), and the mask is data, not
            # something a compiled graph gains from.
            keep_mask = torch.compiler.disable(reference.dropout_keep_mask) if _is_compiling() \
                else reference.dropout_keep_mask
            keep = keep_mask(seed, N, H, L, k.shape[2], p, q.device)
        weights = _attention_weights(q, k, lse, 1.0 / math.sqrt(hd), mask, lengths, causal, top_left, keep, p,
                                     **modifiers)
        if p >= 1.0:
            weights = weights * 0.0
        if average:
            weights = weights.mean(dim=1)
        return weights if batched else weights.squeeze(0)

    def _forward_context_parallel(self, query, key, value, key_padding_mask, need_weights, attn_mask, is_causal,
                                  key_lengths, batched):
        """forward() with ``context_parallel_group``: this rank's sequence shard through
        :func:`mhakern.distributed.context_parallel_attention`."""
        from .distributed import context_parallel_attention

        refused = (("need_weights", need_weights), ("attn_mask", attn_mask is not None),
                   ("key_padding_mask", key_padding_mask is not None),
                   ("add_bias_kv", self.bias_k is not None), ("add_zero_attn", self.add_zero_attn),
                   ("dropout", self.training and self.dropout > 0.0))
        for name, bad in refused:
            if bad:
                raise ArgumentError(f"{name}: not available with context_parallel_group (the sequence is sharded "
                                    f"across ranks); pass key_lengths and is_causal for global masking")
        if batched:
            bd, ld = (0, 1) if self.batch_first else (1, 0)
            N, L = query.shape[bd], query.shape[ld]
        else:
            N, L = 1, query.shape[0]
        if key_lengths is not None:
            key_lengths = key_lengths.reshape(N)
        H, Hkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v, _ = self._project(query, key, value, N, batched)
        q = q.unflatten(-1, (H, hd)).transpose(1, 2)
        k = k.unflatten(-1, (Hkv, hd)).transpose(1, 2)
        v = v.unflatten(-1, (Hkv, hd)).transpose(1, 2)
        o = context_parallel_attention(q, k, v, group=self.context_parallel_group, method=self.context_parallel_method,
                                       layout=self.context_parallel_layout, causal=is_causal,
                                       key_lengths=key_lengths, backend=self.backend, **self._modifiers(N))
        out = self.out_proj(o.transpose(1, 2).reshape(N, L, H * hd))
        if not batched:
            return out.squeeze(0), None
        return (out, None) if self.batch_first else (out.transpose(0, 1), None)

    def _modifiers(self, N: int) -> dict:
        """The score modifiers' keyword arguments of attention() (none when unset)."""
        kw = {}
        if self.softcap is not None:
            kw["softcap"] = self.softcap
        # The registries directly: nn.Module.__getattr__ costs a microsecond a lookup per call.
        a = self._buffers.get("alibi_slopes")
        if a is not None:
            if a.dim() == 2 and a.shape[0] != N:
                raise ArgumentError(f"alibi: the module's (N, H) slopes have N = {a.shape[0]}, the batch has {N}")
            kw["alibi_slopes"] = a
        sinks = self._parameters.get("sinks")
        if sinks is not None:
            kw["sinks"] = sinks
        return kw

    def _forward_packed(self, query, key, value, cu_seqlens, max_seqlen, key_padding_mask, need_weights, attn_mask,
                        is_causal, key_lengths):
        """Packed (T, E) tokens with their prefix sums, through attention_varlen."""
        if need_weights or key_padding_mask is not None or attn_mask is not None or key_lengths is not None:
            raise ArgumentError("cu_seqlens: give need_weights=False and no key_padding_mask, attn_mask or "
                                "key_lengths (the packing already says which keys each token sees)")
        if self.bias_k is not None or self.add_zero_attn:
            raise ArgumentError("cu_seqlens: not with add_bias_kv or add_zero_attn (keys appended per sequence)")
        for name, x, dim in (("query", query, self.embed_dim), ("key", key, self.kdim), ("value", value, self.vdim)):
            if not isinstance(x, Tensor) or x.dim() != 2 or x.shape[1] != dim:
                raise ArgumentError(f"{name}: with cu_seqlens expected packed tokens (T, {dim}), got "
                                    f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
        if key.shape[0] != value.shape[0]:
            raise ArgumentError(f"key, value: token counts must match, got {key.shape[0]} and {value.shape[0]}")
        cu_q, cu_k = cu_seqlens if isinstance(cu_seqlens, (tuple, list)) else (cu_seqlens, cu_seqlens)
        for name, cu in (("cu_seqlens", cu_q), ("cu_seqlens", cu_k)):
            if not isinstance(cu, Tensor) or cu.dim() != 1 or cu.numel() < 1:
                raise ArgumentError(f"{name}: expected a 1-D integer tensor of num_seqs + 1 prefix sums (or a pair)")
        if max_seqlen is None:
            mq, mk = (int((c[1:] - c[:-1]).max()) if c.numel() > 1 else 0 for c in (cu_q, cu_k))
        elif isinstance(max_seqlen, (tuple, list)):
            mq, mk = max_seqlen
        else:
            mq = mk = max_seqlen
        H, Hkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        T = query.shape[0]
        q, k, v = self._in_projection(query, key, value, query is key and key is value, key is value)
        q, k, v = q.unflatten(-1, (H, hd)), k.unflatten(-1, (Hkv, hd)), v.unflatten(-1, (Hkv, hd))
        kw = {"causal": is_causal, "backend": self.backend}
        kw.update(self._modifiers(cu_q.shape[0] - 1))
        p = self.dropout if self.training else 0.0
        if p > 0.0:
            kw["dropout_p"] = p
        o = attention_varlen(q, k, v, cu_q, cu_k, mq, mk, **kw)
        return self.out_proj(o.reshape(T, H * hd)), None

    def _forward_nested(self, query, key, value, key_padding_mask, need_weights, attn_mask, is_causal, key_lengths):
        """Nested (ragged batch) inputs, as torch's TransformerEncoder hands its layers in
        inference with a ``src_key_padding_mask``: padded, run with per-element key lengths,
        and returned nested like ``query`` (weights None)."""
        if not all(isinstance(x, Tensor) and x.is_nested for x in (query, key, value)):
            raise ArgumentError("query, key, value: nested tensors are accepted for all three together only")
        if not self.batch_first:
            raise ArgumentError("query: nested tensors need batch_first=True (their first dim is the batch)")
        if need_weights or key_padding_mask is not None or attn_mask is not None or key_lengths is not None:
            raise ArgumentError(
                "query: with nested tensors give need_weights=False and no key_padding_mask, attn_mask or "
                "key_lengths (the nesting already says which keys exist)"
            )
        lq = [t.shape[0] for t in query.unbind()]
        ls = [t.shape[0] for t in key.unbind()]
        if ls != [t.shape[0] for t in value.unbind()]:
            raise ArgumentError("key, value: nested lengths must match")
        if len(lq) != len(ls):
            raise ShapeAssertionError(f"key: batch size {len(ls)} does not match query's {len(lq)}")
        if is_causal and lq != ls:
            raise ArgumentError("is_causal: with nested tensors each query sequence must be as long as its keys")
        qp, kp, vp = (x.to_padded_tensor(0.0) for x in (query, key, value))
        lengths = torch.tensor(ls, device=query.device)
        mask = None
        if is_causal:  # per element j <= i: top-left on the padded rows
            from torch.nn.attention.bias import causal_upper_left

            mask = causal_upper_left(qp.shape[1], kp.shape[1])
        out, _ = self.forward(qp, kp, vp, need_weights=False, attn_mask=mask, key_lengths=lengths)
        return torch.nested.as_nested_tensor([out[b, :n] for b, n in enumerate(lq)], layout=query.layout), None

    def _in_projection(
        self, query: Tensor, key: Tensor, value: Tensor, same_qkv: bool, same_kv: bool
    ) -> Tuple[Tensor, Tensor, Tensor]:
        """Project to (N, L, H*hd), (N, S, Hkv*hd), (N, S, Hkv*hd), sharing GEMMs where inputs coincide."""
        q_out = self.num_heads * self.head_dim
        kv_out = self.num_kv_heads * self.head_dim
        b = self.in_proj_bias
        if b is not None and b.dtype != query.dtype and b.is_floating_point() and query.is_floating_point():
            # A bias in another precision (a float64 module with a half bias): added in the
            # inputs' dtype, where nn.MultiheadAttention's matmul-then-add promotes it.
            b = b.to(query.dtype)
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


def _alibi_slopes(alibi, H: int, device) -> Optional[Tensor]:
    """The module's ALiBi slopes (float32, (H,) or (N, H)) from its ``alibi`` option."""
    if alibi is None or alibi is False:
        return None
    if alibi is True:
        # The standard geometric sequence (ALiBi's, exact for power-of-two head counts).
        return torch.pow(2.0, -8.0 * torch.arange(1, H + 1, dtype=torch.float64, device=device) / H).float()
    if not isinstance(alibi, Tensor) or not alibi.is_floating_point():
        raise TypeError(f"alibi: expected None, a bool or a floating tensor of slopes, got {alibi!r}")
    if alibi.dim() not in (1, 2) or alibi.shape[-1] != H:
        raise ValueError(f"alibi: expected slopes of shape (H,) = ({H},) or (N, H), got {tuple(alibi.shape)}")
    return alibi.detach().to(device=device if device is not None else alibi.device, dtype=torch.float32)


def _decline_torch_fast_path(module, args):
    """Forward pre-hook of :class:`_TorchFastPathSign`: does nothing (and never runs); its
    presence makes torch's TransformerEncoderLayer decline its fused inference path (see
    FusedMHA.__init__)."""
    return None


class _TorchFastPathSign(nn.Module):
    """A child of every FusedMHA that holds no tensors, is never called and carries one no-op
    forward pre-hook: the sign torch's TransformerEncoderLayer reads to decline its fused path."""

    def __init__(self) -> None:
        super().__init__()
        self.register_forward_pre_hook(_decline_torch_fast_path)


def _check_positive_int(name: str, val) -> None:
    if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
        raise ValueError(f"{name}: expected a positive int, got {val!r}")


def _check_inputs(query, key, value, embed_dim: int, kdim: int, vdim: int, batch_first: bool) -> bool:
    """Check shapes and feature sizes as nn.MultiheadAttention does; return whether batched."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    # The messages carry nn.MultiheadAttention's own wording (after the argument's name), so
    # that code matching torch's text matches ours.
    if query.dim() not in (2, 3):
        raise ShapeAssertionError(
            f"query: expected 3 dims (batched) or 2 dims (unbatched), got shape {tuple(query.shape)} "
            f"(query should be unbatched 2D or batched 3D tensor but received {query.dim()}-D query tensor)"
        )
    if key.dim() != query.dim() or value.dim() != query.dim():
        d = query.dim()
        raise ShapeAssertionError(
            f"key, value: expected {d} dims like query (shape {tuple(query.shape)}), got shapes {tuple(key.shape)} "
            f"and {tuple(value.shape)} (expected `key` and `value` to be {d}-D but found {key.dim()}-D and "
            f"{value.dim()}-D tensors respectively)"
        )
    for name, x, want, what in (
        ("query", query, embed_dim, "embed_dim"),
        ("key", key, kdim, "kdim"),
        ("value", value, vdim, "vdim"),
    ):
        if x.shape[-1] != want:
            raise ShapeAssertionError(f"{name}: last dim must be {what}={want}, got shape {tuple(x.shape)}")
    if key.shape[:-1] != value.shape[:-1]:
        raise ShapeAssertionError(
            f"key, value: leading dims (length and batch) must match, got key {tuple(key.shape)} "
            f"and value {tuple(value.shape)}"
        )
    if query.dim() == 3:
        bd = 0 if batch_first else 1
        if key.shape[bd] != query.shape[bd]:
            # nn.MultiheadAttention raises RuntimeError here (a failing view), not an assertion.
            raise ArgumentError(
                f"key: batch size {key.shape[bd]} (dim {bd}, batch_first={batch_first}) does not match "
                f"query's {query.shape[bd]}"
            )
    return query.dim() == 3




def _check_flag(name: str, val) -> None:
    if not isinstance(val, bool):
        raise TypeError(f"{name}: expected a bool, got {type(val).__name__}")


def _check_mask_dtype(name: str, mask) -> None:
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        # An assertion in nn.MultiheadAttention (F._canonical_mask), with its wording after ours.
        raise TypeAssertionError(f"{name}: expected a bool or floating-point tensor, got {mask.dtype} (only bool and "
                                 f"floating types of {name} are supported)")


def _is_compiling() -> bool:
    return torch.compiler.is_compiling()


def _padding_mask(mask, N: int, S: int, batched: bool, device) -> Optional[Tensor]:
    """``key_padding_mask`` checked and turned into SDPA's convention, (N, S): bool True = keep,
    or the float bias as given."""
    if mask is None:
        return None
    _check_mask_dtype("key_padding_mask", mask)
    want = (N, S) if batched else (S,)
    if mask.dim() != len(want):
        raise ShapeAssertionError(
            f"key_padding_mask: expected shape {want} (batch, source length), got {tuple(mask.shape)} (expected "
            f"`key_padding_mask` to be `None` or {len(want)}-D but found {mask.dim()}-D tensor instead)"
        )
    if tuple(mask.shape) != want:
        raise ShapeAssertionError(f"key_padding_mask: expected shape {want} (batch, source length), got {tuple(mask.shape)}")
    mask = _on_query_device("key_padding_mask", mask, device).reshape(N, S)
    return ~mask if mask.dtype == torch.bool else mask


def _attn_mask_4d(mask, N: int, H: int, L: int, S: int, batched: bool, device) -> Optional[Tensor]:
    """``attn_mask`` checked and seen as a (1 or N, 1 or H, L, S) view in SDPA's convention."""
    if mask is None:
        return None
    _check_mask_dtype("attn_mask", mask)
    per_head = (N * H, L, S) if batched else (H, L, S)
    if mask.dim() not in (2, 3):
        raise ShapeAssertionError(
            f"attn_mask: expected shape {(L, S)} or {per_head}, got {tuple(mask.shape)} (expected `attn_mask` to "
            f"be `None`, 2-D or 3-D but found {mask.dim()}-D tensor instead)"
        )
    if not batched and mask.dim() == 3 and tuple(mask.shape) != per_head:
        # nn.MultiheadAttention asserts here (unbatched); for batched inputs it raises RuntimeError.
        raise ShapeAssertionError(
            f"attn_mask: expected shape {per_head} (heads, target length, source length), got "
            f"{tuple(mask.shape)} (Expected `attn_mask` shape to be {per_head} but got {tuple(mask.shape)})"
        )
    if mask.dim() == 2 and tuple(mask.shape) == (L, S):
        mask = mask[None, None]
    elif mask.dim() == 3 and tuple(mask.shape) == per_head:
        # Row b * H + h is (batch element b, head h), as in nn.MultiheadAttention.
        mask = mask.unflatten(0, (N, H))
    else:
        raise ArgumentError(
            f"attn_mask: expected shape {(L, S)} or {per_head} ((target length, source length), or with "
            f"{'batch * heads' if batched else 'heads'} first), got {tuple(mask.shape)}"
        )
    mask = _on_query_device("attn_mask", mask, device)
    return ~mask if mask.dtype == torch.bool else mask


def _on_query_device(name: str, mask: Tensor, device) -> Tensor:
    """``mask`` moved to the query's ``device``; refused naming it unless it is there already or
    on the CPU (a meta mask holds no data to move)."""
    if mask.device != device and mask.device.type != "cpu":
        raise ArgumentError(f"{name}: must be on query's device ({device}) or the CPU, got {mask.device}")
    return mask.to(device)


def _kept_keys(pad: Optional[Tensor], key_lengths, N: int, S: int, appended: bool, backend: str):
    """Split key-side masking into attention()'s ``key_lengths`` and an (N, S) mask.

    Returns ``(lengths, kmask)``. Without appended keys ``lengths`` is 1 + the position of each
    element's last kept key (the causal alignment point, and a bound that lets kernels skip
    tiles), and ``kmask`` is None when the lengths say everything: right padding, which eager
    mode checks on the data. Under torch.compile a check on the data cannot choose the path, so
    the mask goes along, unless ``backend`` is named and takes no mask: then right padding is
    required (checked inside the graph). Appended keys sit after the padding, so then only the
    mask can express it.
    """
    if pad is None and key_lengths is None:
        return None, None
    if pad is None:
        if not appended:
            return key_lengths, None
        return None, _lengths_mask(key_lengths, N, S)
    if appended:
        return None, pad
    keep = pad if pad.dtype == torch.bool else ~torch.isneginf(pad)
    pos = torch.arange(1, S + 1, device=pad.device)
    lengths = (keep * pos).amax(dim=1) if S > 0 else torch.zeros(N, dtype=torch.int64, device=pad.device)
    # A float mask that requires grad must reach attention() to get its gradient.
    if pad.requires_grad:
        return lengths, pad
    # A meta mask holds no data to choose the path by: as under torch.compile.
    compiling = _is_compiling() or pad.is_meta
    if compiling and (backend == "auto" or "attn_mask" in backends.get(backend).features):
        return lengths, pad
    plain = torch.all(keep == (pos <= lengths[:, None]))
    if pad.dtype != torch.bool:
        plain &= torch.all(~keep | (pad == 0))
    if compiling:
        torch._assert_async(
            plain,
            f"key_padding_mask: backend {backend!r} takes no attention mask, so under torch.compile only "
            "right padding is accepted (bool: False then True; float: 0 then -inf)",
        )
        return lengths, None
    return (lengths, None) if bool(plain) else (lengths, pad)


def _lengths_mask(key_lengths, N: int, S: int) -> Tensor:
    """(N, S) bool mask, True for keys below ``key_lengths``; checks the argument like attention()."""
    if not isinstance(key_lengths, Tensor):
        raise TypeError(f"key_lengths: expected an integer tensor of shape ({N},), got {type(key_lengths).__name__}")
    if key_lengths.dtype.is_floating_point or key_lengths.dtype.is_complex or key_lengths.dtype == torch.bool:
        raise TypeError(f"key_lengths: expected an integer dtype, got {key_lengths.dtype}")
    if tuple(key_lengths.shape) != (N,):
        raise ValueError(
            f"key_lengths: expected shape ({N},) (one length per batch element), got {tuple(key_lengths.shape)}"
        )
    ok = torch.all((key_lengths >= 0) & (key_lengths <= S))
    msg = f"key_lengths: values must lie in [0, Lk={S}]"
    if _is_compiling():
        torch._assert_async(ok, msg)
    elif not bool(ok):
        raise ValueError(f"{msg}, got {key_lengths.tolist()}")
    return torch.arange(S, device=key_lengths.device) < key_lengths[:, None].long()


def _append_visible(mask: Optional[Tensor], extra: int) -> Optional[Tensor]:
    """Extend a (.., S) mask by ``extra`` always-visible keys (add_bias_kv, add_zero_attn)."""
    if mask is None or extra == 0:
        return mask
    fill = torch.ones if mask.dtype == torch.bool else torch.zeros
    return torch.cat([mask, fill(mask.shape[:-1] + (extra,), dtype=mask.dtype, device=mask.device)], dim=-1)


def _merge_masks(a: Optional[Tensor], b: Optional[Tensor]) -> Optional[Tensor]:
    """One SDPA-convention mask for both: ``and`` of bool masks, else a float sum (torch's rule:
    a bool mask turns into 0 / -inf and the biases add)."""
    if a is None or b is None:
        return b if a is None else a
    if a.dtype == torch.bool and b.dtype == torch.bool:
        return a & b
    if a.dtype == torch.bool:
        a, b = b, a
    if b.dtype == torch.bool:
        b = torch.zeros(b.shape, dtype=a.dtype, device=b.device).masked_fill(~b, float("-inf"))
    return a + b


class _SoftmaxFromLse(torch.autograd.Function):
    """``p = exp(s - lse)`` for scores ``s`` whose row log-sum-exp the kernel already computed,
    differentiated as the softmax it equals (``lse`` is the function of ``s`` it stands for).
    Rows with lse = -inf see no key: p = 0 there."""

    @staticmethod
    def forward(ctx, s, lse):
        lse = lse.to(s.dtype).unsqueeze(-1)
        p = torch.exp(s - torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse))
        ctx.save_for_backward(p)
        return p

    @staticmethod
    def backward(ctx, dp):
        (p,) = ctx.saved_tensors
        return p * (dp - (dp * p).sum(dim=-1, keepdim=True)), None


def _attention_weights(q, k, lse, scale, mask, lengths, causal, top_left, keep, p, softcap=None, alibi_slopes=None,
                       sinks=None) -> Tensor:
    """The attention probabilities (N, H, L, S) of one attention() call, from its lse.

    q (N, H, L, hd), k (N, Hkv, S, hd); ``mask``, ``lengths``, ``causal``, ``top_left`` as passed
    to attention(); ``keep`` the dropout keep mask (N, H, L, S) or None, ``p`` its probability.
    Computed in float32 (float64 for float64 inputs), like the kernels' accumulation and lse.
    """
    N, H, L, _ = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    wdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    # Query head h reads kv head h // (H // Hkv): group the query heads instead of copying k.
    qg = q.to(wdt).unflatten(1, (Hkv, H // Hkv))
    s = torch.matmul(qg, k.to(wdt).unsqueeze(2).transpose(-1, -2)).flatten(1, 2) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if alibi_slopes is not None:
        slopes = alibi_slopes.float().expand(N, H) if alibi_slopes.dim() == 1 else alibi_slopes.float()
        s = s + reference.alibi_bias(slopes, N, H, 0, L, L, S, lengths, top_left, q.device, wdt)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.to(wdt)
    vis = reference.visible_mask(L, S, causal, lengths, q.device, top_left=top_left)
    if vis is not None:
        s = s.masked_fill(~vis, float("-inf"))
    if sinks is not None:
        # The sink as one more score column: a softmax differentiable in the sinks too.
        z = torch.cat([s, sinks.to(wdt).view(1, H, 1, 1).expand(N, H, L, 1)], dim=-1)
        dead = torch.isneginf(z).all(-1, keepdim=True)
        w = torch.softmax(z.masked_fill(dead, 0.0), dim=-1)[..., :S].masked_fill(dead, 0.0)
    else:
        w = _SoftmaxFromLse.apply(s, lse)
    if keep is not None:
        w = w * keep * (1.0 / (1.0 - p))
    return w
