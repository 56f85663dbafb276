"""Context parallelism: attention over a sequence sharded across the ranks of a
torch.distributed group, exact, forward and backward (docs/usage.md, "Context parallelism").

Three methods, one semantics (the whole sequence's attention, docs/contract.md):

* ``"ring"``: each rank's K/V travels around the ring (``batch_isend_irecv``), the next block
  in flight while the current one is computed; the blocks' outputs merge exactly through lse.
  The backward recomputes every block from the saved global (out, lse); the dK/dV
  accumulators travel with their K/V and each is added in a fixed order (the owner's share,
  then the next rank's, ...), so gradients are bit-identical run to run.
* ``"allgather"``: K/V gathered once (only the Hkv heads under GQA), then the same blocks in
  the same order as the ring; the backward sends each block's dK/dV share to its owner, who
  adds them in the ring's order. Ring and all-gather therefore give bit-identical outputs, lse
  and gradients.
* ``"ulysses"``: all-to-all from sequence shards to head shards (H and Hkv divisible by P), one
  local call over the whole sequence for H / P heads, all-to-all back; differs from the other
  two by rounding only (one call instead of merged blocks).

A block is cut into pieces that keep the global meaning of causal, windows, key lengths and
ALiBi (mhakern/distributed/_blocks.py). Before any data moves the ranks agree on their
arguments (mhakern/distributed/_comm.py): a rank whose input is bad, or inputs that differ
between ranks, make every rank raise naming the rank and the cause.
"""
from __future__ import annotations

import functools
import math
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from .._errors import ArgumentError
from .._layout import same_layout
from ..checks import (
    CAUSAL_ALIGNS,
    alibi_slopes_bh,
    check_backend,
    check_bool,
    check_dropout_p,
    check_key_lengths_meta,
    check_qkv,
    check_scale,
    check_sinks,
    check_softcap,
    check_window,
    draw_seed,
    parse_modes,
)
from ..ops import _with_sinks
from ..reference import lse_dtype, sink_grad
from ._blocks import Problem, merge, piece_backward, piece_forward
from ._comm import Comm, comm_device, digest, dtype_code, float_bits
from .layout import (
    LAYOUTS,
    PackedLayout,
    check_layout,
    cu_seqlens_list,
    layout_positions,
    num_chunks,
    resolve_group,
)

Tensor = torch.Tensor

METHODS = ("ring", "allgather", "ulysses")

_FIELDS = ("B", "H (query heads)", "Hkv (key/value heads)", "the local sequence length", "D", "Dv", "dtype",
           "device type", "method", "layout", "causal", "causal_align", "window left", "window right", "scale",
           "softcap", "alibi_slopes given", "sinks given", "key_lengths / cu_seqlens (their values)",
           "return_lse", "dropout_p")


class _Call:
    """What the autograd Function needs besides the tensors."""

    def __init__(self, comm: Comm, prob: Problem, method: str, scale: float, backend: str):
        self.comm, self.prob, self.method, self.scale, self.backend = comm, prob, method, scale, backend

    def kv_shape(self, k: Tensor, src: int) -> Tuple[int, ...]:
        """Shape of rank ``src``'s keys (``k`` this rank's): packed shares differ in length."""
        if self.prob.packed is None:
            return tuple(k.shape)
        return (k.shape[0], k.shape[1], self.prob.packed.tokens[src], k.shape[3])


def _gather_blocks(call: _Call, x: Tensor) -> List[Tensor]:
    """Every rank's ``x`` (B, Hx, L_r, D), packed shares padded to the longest for the
    collective and cut back."""
    comm, prob = call.comm, call.prob
    if prob.packed is None:
        return comm.all_gather(x)
    T = max(prob.packed.tokens)
    pad = x.new_zeros(x.shape[:2] + (T,) + x.shape[3:])
    pad[:, :, : x.shape[2]] = x
    return [g[:, :, : prob.packed.tokens[q]] for q, g in enumerate(comm.all_gather(pad))]


def _cp_forward(call: _Call, q: Tensor, k: Tensor, v: Tensor, sinks: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    comm, prob, P, r = call.comm, call.prob, call.comm.P, call.comm.r
    B, H, Lq, _ = q.shape
    ldt = lse_dtype(q.dtype)
    acc = torch.zeros((B, H, Lq, v.shape[3]), dtype=ldt, device=q.device)
    lse_acc = torch.full((B, H, Lq), -math.inf, dtype=ldt, device=q.device)
    error: List[BaseException] = []

    def block(src: int, kb: Tensor, vb: Tensor) -> None:
        if error:  # this rank failed already: it only keeps the communication going
            return
        try:
            for p in prob.pieces(r, src):
                out, lse = piece_forward(p, q, kb, vb, call.scale, call.backend)
                rows = slice(p.qs, p.qs + p.n)
                merge(acc[:, :, rows], lse_acc[:, :, rows], out, lse)
        except Exception as exc:  # noqa: BLE001 - reported to every rank by comm.close
            error.append(exc)

    if call.method == "allgather":
        ks, vs = _gather_blocks(call, k), _gather_blocks(call, v)
        for t in range(P):
            src = (r - t) % P
            block(src, ks[src], vs[src])
    else:
        cur = [k, v]
        for t in range(P):
            src = (r - t) % P
            nxt = None
            if t < P - 1:  # the next block in flight while this one is computed
                shape = call.kv_shape(k, (src - 1) % P)
                nxt = comm.shift(cur, [shape, shape[:3] + (v.shape[3],)])
            block(src, *cur)
            if nxt is not None:
                cur = nxt.wait()
    comm.close(error[0] if error else None)
    if sinks is not None:
        acc, lse_acc = _with_sinks(acc, lse_acc, sinks)
    return same_layout(acc.to(q.dtype), q), lse_acc


def _cp_backward(call: _Call, dout, q, k, v, out, lse) -> Tuple[Tensor, Tensor, Tensor]:
    comm, prob, P, r = call.comm, call.prob, call.comm.P, call.comm.r
    ldt = lse.dtype
    dq = torch.zeros(q.shape, dtype=ldt, device=q.device)
    error: List[BaseException] = []

    def shares(src: int, kb: Tensor, vb: Tensor) -> Tuple[Tensor, Tensor]:
        """This rank's share of the gradients of rank src's keys and values (dq accumulated)."""
        dk = torch.zeros(kb.shape, dtype=ldt, device=q.device)
        dv = torch.zeros(vb.shape, dtype=ldt, device=q.device)
        if error:
            return dk, dv
        try:
            for p in prob.pieces(r, src):
                gq, gk, gv = piece_backward(p, dout, q, kb, vb, out, lse, call.scale, call.backend)
                dq[:, :, p.qs : p.qs + p.n] += gq
                dk[:, :, p.ks : p.ks + p.m] += gk
                dv[:, :, p.ks : p.ks + p.m] += gv
        except Exception as exc:  # noqa: BLE001 - reported to every rank by comm.close
            error.append(exc)
        return dk, dv

    if call.method == "allgather":
        ks, vs = _gather_blocks(call, k), _gather_blocks(call, v)
        mine = [None] * P
        for t in range(P):
            src = (r - t) % P
            mine[src] = shares(src, ks[src], vs[src])
        recv_k = [None if w == r else torch.empty(k.shape, dtype=ldt, device=q.device) for w in range(P)]
        recv_v = [None if w == r else torch.empty(v.shape, dtype=ldt, device=q.device) for w in range(P)]
        comm.exchange([None if w == r else mine[w][0] for w in range(P)], recv_k)
        comm.exchange([None if w == r else mine[w][1] for w in range(P)], recv_v)
        dk, dv = mine[r]
        for t in range(1, P):  # the ring's order: the owner's share, then the next rank's, ...
            w = (r + t) % P
            dk, dv = dk + recv_k[w], dv + recv_v[w]
    else:
        cur = [k, v]
        pending_acc = None
        for t in range(P):
            src = (r - t) % P
            nxt = None
            if t < P - 1:
                shape = call.kv_shape(k, (src - 1) % P)
                nxt = comm.shift(cur, [shape, shape[:3] + (v.shape[3],)])
            gk, gv = shares(src, *cur)
            if pending_acc is not None:  # the shares of the ranks before this one, in ring order
                ak, av = pending_acc.wait()
                gk, gv = ak + gk, av + gv
            if P > 1:  # on to the next rank; the previous rank's block comes in
                shape = call.kv_shape(k, (src - 1) % P)
                pending_acc = comm.shift([gk, gv], [shape, shape[:3] + (v.shape[3],)])
            else:
                dk, dv = gk, gv
            if nxt is not None:
                cur = nxt.wait()
        if P > 1:
            dk, dv = pending_acc.wait()  # this rank's own block, back from its last visit
    comm.close(error[0] if error else None)
    return (same_layout(dq.to(q.dtype), q), same_layout(dk.to(k.dtype), k), same_layout(dv.to(v.dtype), v))


class _ContextParallelFunction(torch.autograd.Function):
    """Ring and all-gather attention as one autograd node: saves q, k, v (this rank's shards)
    and the merged (out, lse); the backward recomputes every block from them."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, call: _Call):
        out, lse = _cp_forward(call, q.detach(), k.detach(), v.detach(), None if sinks is None else sinks.detach())
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.call = call
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        if dout is None:  # zeros, not a skip: the other ranks' backward needs this one in the ring
            dout = torch.zeros_like(out)
        dq, dk, dv = _cp_backward(ctx.call, dout.to(q.dtype), q, k, v, out, lse)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            # This rank's share of the gradient of a replicated parameter: its rows' sum. The
            # shares add up to the whole sequence's gradient (the data-parallel reduction of a
            # replicated parameter adds them).
            delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
            dsinks = sink_grad(sinks.detach(), lse, delta).to(sinks.dtype)
        return dq, dk, dv, dsinks, None


# ---------------------------------------------------------------------------------------------
# Ulysses


def _seq_to_heads(x: Tensor, comm: Comm) -> Tensor:
    """(B, Hx, L_local, D) sequence shards -> (B, Hx / P, P * L_local, D) head shards, the
    sequence in the ranks' order."""
    B, Hx, Ll, D = x.shape
    P = comm.P
    buf = x.reshape(B, P, Hx // P, Ll, D).transpose(0, 1).contiguous()
    out = torch.empty_like(buf)
    _all_to_all(out, buf, comm)
    return out.permute(1, 2, 0, 3, 4).reshape(B, Hx // P, P * Ll, D)


def _heads_to_seq(x: Tensor, comm: Comm) -> Tensor:
    """The inverse of :func:`_seq_to_heads`."""
    B, Hp, L, D = x.shape
    P = comm.P
    buf = x.reshape(B, Hp, P, L // P, D).permute(2, 0, 1, 3, 4).contiguous()
    out = torch.empty_like(buf)
    _all_to_all(out, buf, comm)
    return out.transpose(0, 1).reshape(B, P * Hp, L // P, D)


def _all_to_all(out: Tensor, buf: Tensor, comm: Comm, out_splits=None, in_splits=None) -> None:
    if comm.P == 1:
        out.copy_(buf)
        return
    try:
        dist.all_to_all_single(out, buf, out_splits, in_splits, group=comm.pg)
    except Exception as exc:  # noqa: BLE001
        raise comm._fail(exc, "every rank (all-to-all)") from exc


def _tokens_to_heads(x: Tensor, comm: Comm, counts: Sequence[int]) -> Tensor:
    """Packed shares (T_r, Hx, D), rank s holding counts[s] tokens -> (sum T, Hx / P, D): every
    rank's tokens (in rank order) for this rank's head shard."""
    T, Hx, D = x.shape
    P = comm.P
    buf = x.reshape(T, P, Hx // P, D).transpose(0, 1).reshape(P * T, Hx // P, D).contiguous()
    out = x.new_empty((sum(counts), Hx // P, D))
    _all_to_all(out, buf, comm, list(counts), [T] * P)
    return out


def _heads_to_tokens(x: Tensor, comm: Comm, counts: Sequence[int]) -> Tensor:
    """The inverse of :func:`_tokens_to_heads`."""
    _, Hp, D = x.shape
    P, T = comm.P, counts[comm.r]
    out = x.new_empty((P * T, Hp, D))
    _all_to_all(out, x.contiguous(), comm, [T] * P, list(counts))
    return out.reshape(P, T, Hp, D).transpose(0, 1).reshape(T, P * Hp, D)


class _AllToAll(torch.autograd.Function):
    """A redistribution ``there`` whose gradient goes back through its inverse ``back``."""

    @staticmethod
    def forward(ctx, x, there, back):
        ctx.back = back
        return there(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.back(g.contiguous()), None, None


def _ulysses(comm: Comm, layout, q, k, v, *, causal, causal_align, window, key_lengths, scale, softcap, slopes,
             sinks, backend, dropout_p, seed):
    """Ulysses on dense shards: (B, H, L_local, D) sequence shards -> the whole sequence for
    H / P heads (heads r * H / P .. of rank r, their KV heads alike), in the sequence's order,
    one mhakern.attention call with autograd, and back. (out, lse) as the shards. With dropout
    the local call's hash sees its heads as heads r * H / P .. of H (the modes dropout_h0 /
    dropout_heads): the whole call's keep mask."""
    from ..routing import route

    P, r = comm.P, comm.r
    H = q.shape[1]
    Hp = H // P
    there, back = functools.partial(_seq_to_heads, comm=comm), functools.partial(_heads_to_seq, comm=comm)
    qh, kh, vh = (_AllToAll.apply(x, there, back) for x in (q, k, v))
    L = qh.shape[2]
    order = None
    if layout != "contiguous" and P > 1:  # the ranks' order -> the sequence's natural order
        order = layout_positions(layout, P, L).to(q.device)
        natural = torch.argsort(order)
        qh, kh, vh = (x.index_select(2, natural) for x in (qh, kh, vh))
    error = None
    try:
        sk = None if sinks is None else sinks[r * Hp : (r + 1) * Hp]
        modes = parse_modes(qh, qh.shape[0], Hp, L, L, None, 0.0, None, causal, causal_align, window, softcap,
                            None if slopes is None else slopes[:, r * Hp : (r + 1) * Hp], sk)
        if dropout_p > 0.0:
            modes = modes._replace(dropout_p=float(dropout_p), seed=seed, dropout_h0=r * Hp, dropout_heads=H)
        grad = torch.is_grad_enabled() and (qh.requires_grad or kh.requires_grad or vh.requires_grad
                                            or (sk is not None and sk.requires_grad))
        out, lse = route(qh, kh, vh, scale, causal, key_lengths, backend, modes, grad)
    except Exception as exc:  # noqa: BLE001 - reported to every rank by comm.close
        error = exc
        out = qh.new_zeros(qh.shape[:3] + (v.shape[3],))
        lse = torch.zeros(qh.shape[:3], dtype=lse_dtype(q.dtype), device=q.device)
    if order is not None:
        out, lse = out.index_select(2, order), lse.index_select(2, order)
    out = _AllToAll.apply(out, back, there)
    lse = _heads_to_seq(lse.detach().unsqueeze(-1), comm).squeeze(-1)
    comm.close(error)
    return same_layout(out, q), lse


def _ulysses_varlen(comm: Comm, pl: PackedLayout, cu: List[int], max_seqlen: int, q, k, v, *, causal, causal_align,
                    window, scale, softcap, slopes, sinks, backend):
    """Ulysses over packed shares: (T_r, H, D) tokens -> every token of the pack for H / P heads,
    in the pack's order, one attention_varlen call, and back."""
    from ..varlen import attention_varlen

    P, r = comm.P, comm.r
    Hp = q.shape[1] // P
    counts = pl.tokens
    there = functools.partial(_tokens_to_heads, comm=comm, counts=counts)
    back = functools.partial(_heads_to_tokens, comm=comm, counts=counts)
    order = torch.cat(pl.index).to(q.device)  # pack position of each token in rank order
    natural = torch.argsort(order)
    qh, kh, vh = (_AllToAll.apply(x, there, back).index_select(0, natural) for x in (q, k, v))
    cu_t = torch.tensor(cu, dtype=torch.int32, device=q.device)
    error = None
    try:
        out, lse = attention_varlen(qh, kh, vh, cu_t, cu_t, max_seqlen, max_seqlen, causal=causal,
                                    causal_align=causal_align, window=window, scale=scale, softcap=softcap,
                                    alibi_slopes=None if slopes is None else slopes[:, r * Hp : (r + 1) * Hp],
                                    sinks=None if sinks is None else sinks[r * Hp : (r + 1) * Hp], backend=backend,
                                    return_lse=True)
    except Exception as exc:  # noqa: BLE001 - reported to every rank by comm.close
        error = exc
        out = qh.new_zeros(qh.shape[:2] + (v.shape[2],))
        lse = torch.zeros(qh.shape[1], qh.shape[0], dtype=lse_dtype(q.dtype), device=q.device)
    out = _AllToAll.apply(out.index_select(0, order), back, there)
    lse = back(lse.detach().t().index_select(0, order).unsqueeze(-1)).squeeze(-1).t()
    comm.close(error)
    return out, lse


# ---------------------------------------------------------------------------------------------
# The public entry points


def _check_common(method, layout, causal, causal_align, softcap, dropout_p, generator, backend, return_lse, P, H,
                  Hkv, Lg, window, packed: bool) -> Tuple[int, int, bool]:
    if method not in METHODS:
        raise ArgumentError(f"method: expected one of {METHODS}, got {method!r}")
    check_layout(layout)
    check_bool("causal", causal)
    check_bool("return_lse", return_lse)
    if causal_align not in CAUSAL_ALIGNS:
        raise ArgumentError(f"causal_align: expected one of {CAUSAL_ALIGNS}, got {causal_align!r}")
    if softcap is not None:
        check_softcap(softcap)
    check_backend(backend)
    check_dropout_p(dropout_p)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected None or a torch.Generator, got {type(generator).__name__}")
    if dropout_p > 0.0 and packed:
        raise ArgumentError("dropout_p: dropout under context parallelism is not available for packed sequences "
                            "(the keep mask's hash sees each sequence as a batch element); pass 0.0")
    if method == "ulysses" and (H % P or Hkv % P):
        raise ArgumentError(f"method: 'ulysses' shards the heads: H ({H}) and Hkv ({Hkv}) must be divisible by the "
                            f"group size {P}")
    wl, wr = check_window(window, causal, Lg, Lg)
    top_left = causal_align == "top_left"
    return wl, wr, top_left


def _fields(B, H, Hkv, Ll, D, Dv, q, method, layout, causal, top_left, wl, wr, scale, softcap, alibi, sinks,
            values, return_lse, dropout_p) -> List[int]:
    return [B, H, Hkv, Ll, D, Dv, dtype_code(q.dtype), {"cpu": 0, "cuda": 1}.get(q.device.type, 2),
            METHODS.index(method) if method in METHODS else -1, LAYOUTS.index(layout) if layout in LAYOUTS else -1,
            int(bool(causal)), int(bool(top_left)), wl, wr, float_bits(scale or 0.0), float_bits(softcap or 0.0),
            int(alibi is not None), int(sinks is not None), digest(values), int(bool(return_lse)),
            float_bits(dropout_p if isinstance(dropout_p, (int, float)) else -1.0)]


def _shared_seed(comm: Comm, generator, device) -> int:
    """The dropout seed of the call: drawn on every rank (so that every rank's generator moves
    as a single-device call's would), rank 0's sent to all."""
    seed = torch.tensor([draw_seed(generator)], dtype=torch.int64, device=comm.device)
    if comm.P > 1:
        try:
            dist.broadcast(seed, src=comm.global_rank(0), group=comm.pg)
        except Exception as exc:  # noqa: BLE001
            raise comm._fail(exc, "rank 0 (the dropout seed)") from exc
    return int(seed.item())


def _agree(comm: Comm, fields: Optional[List[int]], error: Optional[BaseException]) -> None:
    if error is not None:
        comm.agree([0] * len(_FIELDS), _FIELDS, f"{type(error).__name__}: {error}")
    else:
        comm.agree(fields, _FIELDS, None)


def _cp_entry(reason: str):
    """torch.compile graph-breaks around a context-parallel call (it communicates and reads
    host values: the compiled graphs on either side hold the model's other ops)."""
    def wrap(fn):
        try:
            return torch.compiler.disable(fn, reason=reason)
        except TypeError:  # torch without disable(reason=)
            return torch.compiler.disable(fn)
    return wrap


_COMPILE_REASON = "mhakern.distributed: context-parallel attention communicates between ranks; it runs eagerly"


@_cp_entry(_COMPILE_REASON)
def context_parallel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group=None,
    method: str = "ring",
    layout: str = "zigzag",
    causal: bool = False,
    causal_align: str = "bottom_right",
    window: Optional[Sequence[int]] = None,
    key_lengths: Optional[Tensor] = None,
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    generator: Optional[torch.Generator] = None,
    return_lse: bool = False,
    backend: str = "auto",
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Attention over a sequence sharded across ``group``: each rank passes its shard and gets
    its shard of the output of attention over the whole sequence, with gradients.

    Args:
        q: (B, H, L_local, D) this rank's queries, laid out by ``layout`` (:func:`shard`).
        k, v: (B, Hkv, L_local, D) and (B, Hkv, L_local, Dv), the same tokens' keys and values
            (H a multiple of Hkv; only Hkv heads travel).
        group: a ProcessGroup, a one-dimensional DeviceMesh, or None (the default group).
        method: "ring", "allgather" or "ulysses" (module docstring; docs/usage.md says which
            when). Ulysses needs H and Hkv divisible by the group size.
        layout: "zigzag" (rank r holds chunks r and 2P - 1 - r of 2P: causal work balanced)
            or "contiguous" (chunk r of P).
        causal, causal_align, window, scale, softcap, alibi_slopes, sinks, backend,
        return_lse: as :func:`mhakern.attention`, over global positions (the whole sequence
            of length P * L_local); ``key_lengths`` (B,) global lengths, the same on every
            rank (checked). ALiBi slopes must not require grad; sinks get this rank's share
            of their gradient (the shares sum to the whole sequence's).
        dropout_p, generator: as :func:`mhakern.attention`, every method: the keep mask is the
            one a single-device call over the whole sequence draws (its hash sees global
            positions and heads), the seed drawn from ``generator`` on every rank and rank 0's
            used. (Packed sequences refuse it by name.)

    Every rank must call with the same shapes, dtype and arguments: they are compared before
    any data moves, and a rank whose input is bad (or a kernel that fails on one rank) makes
    every rank raise :class:`ContextParallelError` naming that rank and the cause.

    Returns:
        ``out`` (B, H, L_local, Dv) in q's dtype, laid out like q, and with ``return_lse`` also
        ``lse`` (B, H, L_local) (float32, float64 for float64 inputs; not differentiable).
    """
    pg, P, r = resolve_group(group)
    comm = Comm(pg, P, r, comm_device(pg, q), "context_parallel_attention")
    error = fields = None
    try:
        check_qkv(q, k, v)
        B, H, Ll, D = q.shape
        Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
        if Lk != Ll:
            raise ArgumentError(f"k: the shards of one sequence must have the same length: q has {Ll} tokens, k {Lk}")
        Lg = Ll * P
        wl, wr, top_left = _check_common(method, layout, causal, causal_align, softcap, dropout_p, generator,
                                         backend, return_lse, P, H, Hkv, Lg, window, False)
        if Lg % num_chunks(layout, P):
            raise ArgumentError(f"q: a {layout!r} shard holds {num_chunks(layout, P) // P} equal chunks; its length "
                                f"{Ll} is not divisible by that")
        scale = check_scale(scale, D)
        check_key_lengths_meta(key_lengths, B, q.device)
        kl = None
        if key_lengths is not None:
            kl = [int(x) for x in key_lengths.tolist()]
            if any(x < 0 or x > Lg for x in kl):
                raise ArgumentError(f"key_lengths: values must lie in [0, L={Lg}] (global lengths), got min "
                                    f"{min(kl)} and max {max(kl)}")
        slopes = None if alibi_slopes is None else alibi_slopes_bh(alibi_slopes, B, H, q.device)
        check_sinks(sinks, H, q.device)
        fields = _fields(B, H, Hkv, Ll, D, Dv, q, method, layout, causal, top_left, wl, wr, scale, softcap,
                         alibi_slopes, sinks, kl or [], return_lse, dropout_p)
    except Exception as exc:  # noqa: BLE001 - every rank raises it after the agreement check
        error = exc
    _agree(comm, fields, error)
    if dropout_p == 1.0:  # every probability dropped, as mhakern.attention: the output times 0
        res = context_parallel_attention(q, k, v, group=group, method=method, layout=layout, causal=causal,
                                         causal_align=causal_align, window=window, key_lengths=key_lengths,
                                         scale=scale, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                                         return_lse=True, backend=backend)
        return (res[0] * 0.0, res[1]) if return_lse else res[0] * 0.0
    seed = _shared_seed(comm, generator, q.device) if dropout_p > 0.0 else 0
    if method == "ulysses":
        out, lse = _ulysses(comm, layout, q, k, v, causal=causal, causal_align=causal_align, window=window,
                            key_lengths=key_lengths, scale=scale, softcap=softcap, slopes=slopes, sinks=sinks,
                            backend=backend, dropout_p=float(dropout_p), seed=seed)
    else:
        prob = Problem(P=P, layout=layout, L=Lg, B=B, H=H, causal=causal, top_left=top_left, window=(wl, wr),
                       key_lengths=kl, softcap=0.0 if softcap is None else float(softcap), slopes=slopes, packed=None,
                       dtype=q.dtype, device=q.device, dropout_p=float(dropout_p), seed=seed)
        out, lse = _ContextParallelFunction.apply(q, k, v, sinks, _Call(comm, prob, method, scale, backend))
    return (out, lse) if return_lse else out


@_cp_entry(_COMPILE_REASON)
def context_parallel_attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    *,
    group=None,
    method: str = "ring",
    layout: str = "zigzag",
    causal: bool = False,
    causal_align: str = "bottom_right",
    window: Optional[Sequence[int]] = None,
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    generator: Optional[torch.Generator] = None,
    return_lse: bool = False,
    backend: str = "auto",
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Packed sequences under context parallelism: :func:`mhakern.attention_varlen` of the
    whole pack, each rank holding its :func:`shard_varlen` share (every sequence cut by
    ``layout`` on its own).

    Args:
        q: (T_local, H, D), k (T_local, Hkv, D), v (T_local, Hkv, Dv): this rank's tokens.
        cu_seqlens: (num_seqs + 1,) integer prefix sums of the *whole* pack (first 0, last the
            total token count), the same on every rank (checked); queries and keys share them.
        max_seqlen: a bound of the sequences' lengths (checked).
        method: "ring", "allgather" or "ulysses" (H and Hkv divisible by the group size).
        Other arguments as :func:`context_parallel_attention`; ``alibi_slopes`` (H,) or
        (num_seqs, H); causal and windows are per sequence (both alignments agree: queries
        and keys of a sequence have one length).

    Returns:
        ``out`` (T_local, H, Dv) and with ``return_lse`` also ``lse`` (H, T_local).
    """
    pg, P, r = resolve_group(group)
    comm = Comm(pg, P, r, comm_device(pg, q), "context_parallel_attention_varlen")
    error = fields = None
    try:
        for name, x in (("q", q), ("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor) or x.dim() != 3:
                raise ArgumentError(f"{name}: expected a 3-D (T, heads, dim) tensor, got "
                                    f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        qb, kb, vb = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        check_qkv(qb, kb, vb)
        _, H, T, D = qb.shape
        Hkv, Dv = kb.shape[1], vb.shape[3]
        if kb.shape[2] != T:
            raise ArgumentError(f"k: the shares of one pack must have the same tokens: q has {T}, k {kb.shape[2]}")
        cu = cu_seqlens_list(cu_seqlens)
        Lg = cu[-1]
        wl, wr, top_left = _check_common(method, layout, causal, causal_align, softcap, dropout_p, generator,
                                         backend, return_lse, P, H, Hkv, Lg, window, True)
        if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
            raise ArgumentError(f"max_seqlen: expected an int, got {max_seqlen!r}")
        longest = max((b - a for a, b in zip(cu, cu[1:])), default=0)
        if longest > max_seqlen:
            raise ArgumentError(f"max_seqlen: {max_seqlen} is below the longest sequence ({longest})")
        pl = PackedLayout(cu, layout, P)
        if T != pl.tokens[r]:
            raise ArgumentError(f"q: rank {r}'s share of cu_seqlens holds {pl.tokens[r]} tokens (shard_varlen's "
                                f"layout), got {T}")
        scale = check_scale(scale, D)
        slopes = None
        if alibi_slopes is not None:
            S = len(cu) - 1
            slopes = alibi_slopes_bh(alibi_slopes, S, H, q.device)
        check_sinks(sinks, H, q.device)
        fields = _fields(1, H, Hkv, 0, D, Dv, q, method, layout, causal, top_left, wl, wr, scale, softcap,
                         alibi_slopes, sinks, cu, return_lse, dropout_p)
    except Exception as exc:  # noqa: BLE001
        error = exc
    _agree(comm, fields, error)
    if method == "ulysses":
        out, lse = _ulysses_varlen(comm, pl, cu, max_seqlen, q, k, v, causal=causal, causal_align=causal_align,
                                   window=window, scale=scale, softcap=softcap,
                                   slopes=slopes, sinks=sinks,
                                   backend=backend)
        return (out, lse) if return_lse else out
    prob = Problem(P=P, layout=layout, L=Lg, B=1, H=H, causal=causal, top_left=top_left, window=(wl, wr),
                   key_lengths=None, softcap=0.0 if softcap is None else float(softcap), slopes=slopes, packed=pl,
                   dtype=q.dtype, device=q.device)
    out, lse = _ContextParallelFunction.apply(qb, kb, vb, sinks, _Call(comm, prob, method, scale, backend))
    out = out.squeeze(0).transpose(0, 1)
    return (out, lse.squeeze(0)) if return_lse else out
