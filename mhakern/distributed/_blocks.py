"""One block of context-parallel attention: this rank's queries against one rank's keys, cut
into pieces (a chunk of queries against a chunk of keys, or for packed sequences a rank's
tokens against a rank's tokens), each an ordinary mhakern call, and the exact merge of their
outputs through lse.

Every piece keeps the global meaning of the call (causal in either alignment, windows, key
lengths, ALiBi, packing) by one of three exact means, chosen per piece:

* skipped, when no query of the piece sees any of its keys (causal's upper blocks, keys past
  every key length, a window far away);
* a plain local call when the global visibility restricted to the piece is one the kernels
  know: everything (not causal, or keys wholly in the past), or causal on the piece's own
  diagonal (top-left, or bottom-right for pieces of unequal lengths), with the key lengths
  shifted to the piece. Zigzag and contiguous layouts with equal chunks give only these for
  causal attention, so the common case runs on the kernels' fastest paths;
* an explicit mask otherwise (windows, bottom-right alignment with key lengths, packed
  sequences, ALiBi): a bool (B, 1, n, m) mask of the global visibility, or for ALiBi the float
  bias ``-slope * |i + off - j|`` over global positions with -inf where hidden, (B, H, n, m).
  Its memory is that of one piece's scores, built again in the backward, never kept.

Outputs merge in lse's dtype (float32; float64 for float64 inputs) in a fixed order, so the
forward and the backward are deterministic.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from ..checks import mask_dtype
from ..modes import Modes
from ..ops import attn_bwd, attn_fwd
from .layout import PackedLayout, num_chunks, rank_chunks

Tensor = torch.Tensor


@dataclass
class Piece:
    """Queries ``qs .. qs + n - 1`` of the local tensor against keys ``ks .. ks + m - 1`` of a
    block, computed by one call with these arguments."""

    qs: int
    n: int
    ks: int
    m: int
    causal: bool
    key_lengths: Optional[Tensor]
    modes: Modes


class Problem:
    """The whole call as every rank sees it: the global semantics and where each rank's
    tokens sit. ``key_lengths``: the global lengths as a list of ints (dense only); ``slopes``:
    float32 (B, H) ALiBi slopes (dense) or (num_seqs, H) (packed); ``packed``: a
    :class:`PackedLayout` or None; ``L``: the global sequence length (dense)."""

    def __init__(self, *, P, layout, L, B, H, causal, top_left, window, key_lengths, softcap, slopes, packed,
                 dtype, device, dropout_p=0.0, seed=0):
        self.P, self.layout, self.L, self.B, self.H = P, layout, L, B, H
        self.causal, self.top_left = causal, top_left
        self.wl, self.wr = window
        self.kl = key_lengths
        self.softcap, self.slopes, self.packed = softcap, slopes, packed
        self.dtype, self.device = dtype, device
        # Dropout: every piece draws the whole sequence's keep mask, its hash seeing global
        # positions (the modes dropout_q0 / dropout_k0; dense layouts only).
        self.dropout_p, self.seed = dropout_p, seed
        # The diagonal offset per batch element: key j_g is on query i_g's diagonal at
        # j_g = i_g + off_b. Queries and keys are one sequence (length L), so bottom-right is
        # top-left unless the key lengths differ from L.
        if key_lengths is None or top_left or packed is not None:
            self.offs = [0] * B
        else:
            self.offs = [k - L for k in key_lengths]
        self.uniform = all(o == self.offs[0] for o in self.offs) if B else True

    # -- where the tokens sit --------------------------------------------------------------
    def chunks(self, r: int) -> List[Tuple[int, int, int]]:
        """(local start, length, global start) of rank r's chunks (dense)."""
        c = self.L // num_chunks(self.layout, self.P)
        return [(i * c, c, ch * c) for i, ch in enumerate(rank_chunks(self.layout, self.P, r))]

    # -- the pieces of a block ---------------------------------------------------------------
    def pieces(self, rq: int, rk: int) -> List[Piece]:
        """The pieces of rank rq's queries against rank rk's keys, in a fixed order."""
        if self.packed is not None:
            p = self._packed_piece(rq, rk)
            return [p] if p is not None else []
        out = []
        for qs, n, qg in self.chunks(rq):
            for ks, m, kg in self.chunks(rk):
                p = self._dense_piece(qs, n, qg, ks, m, kg)
                if p is not None:
                    out.append(p)
        return out

    def _modes(self, qg: int, kg: int, mask=None, top_left=False) -> Modes:
        """The record of a piece whose queries and keys start at global positions qg, kg."""
        if self.dropout_p > 0.0:
            return Modes.build(attn_mask=mask, top_left=top_left, softcap=self.softcap, dropout_p=self.dropout_p,
                               seed=self.seed, dropout_q0=qg, dropout_k0=kg)
        return Modes.build(attn_mask=mask, top_left=top_left, softcap=self.softcap)

    def _dense_piece(self, qs, n, qg, ks, m, kg) -> Optional[Piece]:
        if n == 0 or m == 0:
            return None
        if self.slopes is None and self.wl < 0 and self.wr < 0 and self.uniform:
            kl = None
            if self.kl is not None:
                local = [min(max(k - kg, 0), m) for k in self.kl]
                if not any(local):
                    return None
                if any(x != m for x in local):
                    kl = torch.tensor(local, dtype=torch.int32, device=self.device)
            if not self.causal:
                return Piece(qs, n, ks, m, False, kl, self._modes(qg, kg))
            d = qg + self.offs[0] - kg  # row i sees local keys j <= i + d
            if d + n - 1 < 0:
                return None
            if d >= m - 1:
                return Piece(qs, n, ks, m, False, kl, self._modes(qg, kg))
            if d == 0:
                return Piece(qs, n, ks, m, True, kl, self._modes(qg, kg, top_left=True))
            if kl is None and d == m - n:
                return Piece(qs, n, ks, m, True, None, self._modes(qg, kg))
        qpos = torch.arange(qg, qg + n, device=self.device).view(1, 1, n, 1)
        kpos = torch.arange(kg, kg + m, device=self.device).view(1, 1, 1, m)
        off = torch.tensor(self.offs, device=self.device).view(-1, 1, 1, 1)
        vis = self._visible(qpos + off, kpos)
        if self.kl is not None:
            vis = vis & (kpos < torch.tensor(self.kl, device=self.device).view(-1, 1, 1, 1))
        return self._masked(qs, n, ks, m, vis, (qpos + off - kpos).abs(), self.slopes, qg, kg)

    def _packed_piece(self, rq, rk) -> Optional[Piece]:
        pl: PackedLayout = self.packed
        n, m = pl.tokens[rq], pl.tokens[rk]
        if n == 0 or m == 0:
            return None
        dev = self.device
        qseq, kseq = pl.seq[rq].to(dev).view(1, 1, n, 1), pl.seq[rk].to(dev).view(1, 1, 1, m)
        qpos, kpos = pl.pos[rq].to(dev).view(1, 1, n, 1), pl.pos[rk].to(dev).view(1, 1, 1, m)
        vis = self._visible(qpos, kpos) & (qseq == kseq)
        slopes = None
        if self.slopes is not None:  # (num_seqs, H): the slope of each query token's sequence
            slopes = self.slopes[pl.seq[rq].to(dev)].t().unsqueeze(0)  # (1, H, n)
        return self._masked(0, n, 0, m, vis, (qpos - kpos).abs(), slopes, 0, 0)

    def _visible(self, diag: Tensor, kpos: Tensor) -> Tensor:
        """Causal and window visibility of keys ``kpos`` for queries whose diagonal key is
        ``diag`` (broadcast shapes)."""
        vis = torch.ones_like(diag + kpos, dtype=torch.bool)
        if self.causal:
            vis = vis & (kpos <= diag)
        if self.wl >= 0:
            vis = vis & (kpos >= diag - self.wl)
        if self.wr >= 0:
            vis = vis & (kpos <= diag + self.wr)
        return vis

    def _masked(self, qs, n, ks, m, vis: Tensor, dist_: Tensor, slopes: Optional[Tensor], qg: int,
                kg: int) -> Optional[Piece]:
        if not bool(vis.any()):
            return None
        if slopes is None:
            mask = None if bool(vis.all()) else vis
        else:
            # The ALiBi bias over global positions, computed in float32 as the kernels do.
            s = slopes.to(torch.float32)
            s = s.view(s.shape[0], s.shape[1], 1, 1) if s.dim() == 2 else s.unsqueeze(-1)
            bias = -s * dist_.to(torch.float32)
            mask = bias.masked_fill(~vis, float("-inf")).to(mask_dtype(self.dtype))
        return Piece(qs, n, ks, m, False, None, self._modes(qg, kg, mask))


def piece_forward(p: Piece, q: Tensor, k: Tensor, v: Tensor, scale: float, backend: str) -> Tuple[Tensor, Tensor]:
    """(out, lse) of one piece: queries p.qs .. of ``q`` against keys p.ks .. of ``k``, ``v``."""
    qp = q[:, :, p.qs : p.qs + p.n]
    kp, vp = k[:, :, p.ks : p.ks + p.m], v[:, :, p.ks : p.ks + p.m]
    return attn_fwd(qp, kp, vp, scale, p.causal, p.key_lengths, backend, *p.modes.op_args())


def piece_backward(p: Piece, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
                   backend: str) -> Tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of one piece from the whole call's (out, lse) of its query rows: the
    probabilities the kernel recomputes from the global lse are the piece's share of the
    global softmax, and ``delta = rowsum(dout * out)`` is the global row's."""
    rows = slice(p.qs, p.qs + p.n)
    keys = slice(p.ks, p.ks + p.m)
    dq, dk, dv, _, _ = attn_bwd(dout[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys], out[:, :, rows],
                                lse[:, :, rows].contiguous(), scale, p.causal, p.key_lengths, backend,
                                *p.modes.op_args())
    return dq, dk, dv


def merge(acc: Tensor, lse_acc: Tensor, out: Tensor, lse: Tensor) -> None:
    """Fold one share (out, lse) into the running (acc, lse_acc) of the same rows, in place,
    in lse_acc's dtype: lse' = logaddexp(lse_acc, lse), acc' = acc e^(lse_acc - lse') +
    out e^(lse - lse'). Rows no share has seen (-inf, -inf) keep output 0; a NaN lse
    propagates."""
    new = torch.logaddexp(lse_acc, lse)
    dead = torch.isneginf(new)
    a = torch.exp(lse_acc - new).masked_fill_(dead, 0.0)
    b = torch.exp(lse.to(new.dtype) - new).masked_fill_(dead, 0.0)
    acc.mul_(a.unsqueeze(-1)).add_(out.to(acc.dtype) * b.unsqueeze(-1))
    lse_acc.copy_(new)
