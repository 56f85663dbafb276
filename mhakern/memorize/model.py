"""The paper's one-layer multi-head attention model, for a stack of R independent runs.

Per example (notation of Mahdavi, Liao & Thrampoulidis): tokens ``x_0`` (the query) and
``x_1 .. x_n`` (the context) of dim d_in are embedded, ``t_i = W_E^T x_i + b_E + pe_i`` (dim d,
sinusoidal positions). Head h scores the context against the query,
``alpha_h,i = (W_Q,h^T t_0) . (W_K,h^T t_i) / sqrt(d)``, takes ``theta_h = softmax(alpha_h)``
over i = 1..n (the query never attends to itself), and reads ``p_h = W_V,h^T sum_i theta_h,i t_i``
(dim d_v). Then ``o = W_O^T [p_1; ...; p_H]`` (dim d) and the decoder gives
``y_hat = W_D^T o + b_D`` (classes, or 1 for regression). No biases in Q, K, V, O: the layer of
the paper's analysis.

Three implementations of that one function, with the same weights:

* :func:`folded_forward` with ``attn="fused"`` -- the fast path. ``alpha_h,i = u_h . t_i / sqrt(d)``
  with the folded query ``u_h = W_K,h W_Q,h^T t_0`` (dim d), so every head attends the *same*
  keys ``t_1..t_n``: one multi-query attention call on ``mhakern.attention`` with one query per
  head and the context itself as keys and values. Per-head keys and values of the context are
  never formed; ``W_V,h`` is applied to the d-dim attention output afterwards.
* :func:`folded_forward` with ``attn="eager"`` -- the same folded model with the attention
  written in eager PyTorch (matmul, softmax, matmul): the baseline the fused kernels must beat.
* :func:`paper_forward` -- the paper's computation: per-head Q, K, V for every one of the n+1
  tokens, the full (n+1) x (n+1) masked attention, then token 0's output. The oracle.

Parameters of the R runs live in one :class:`StackedParams` with a leading run dim, and every
operation is batched over it; a run's output and gradient depend on its own weights only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Sequence

import torch

import mhakern

from . import products
from .config import INITS  # names of the initialisations of _init_run

Tensor = torch.Tensor

PARAM_NAMES = ("W_E", "b_E", "W_Q", "W_K", "W_V", "W_O", "W_D", "b_D")


@dataclass(frozen=True)
class ModelShape:
    """heads H, context n, model dim d, input dim d_in, head dim d_h, value dim d_v, outputs."""

    heads: int
    context: int
    d_model: int
    d_in: int
    d_head: int
    d_value: int
    n_out: int

    @classmethod
    def of(cls, cfg) -> "ModelShape":
        return cls(cfg.heads, cfg.context, cfg.d_model, cfg.din, cfg.dh, cfg.d_value, cfg.n_out)

    def n_params(self) -> int:
        H, d, di, dh, dv, c = self.heads, self.d_model, self.d_in, self.d_head, self.d_value, self.n_out
        return di * d + d + 2 * H * d * dh + H * d * dv + H * dv * d + d * c + c


def sinusoidal_positions(length: int, d: int, dtype=torch.float32, device="cpu") -> Tensor:
    """(length, d) positional encoding: sin on even features, cos on odd, base 10000."""
    pos = torch.arange(length, dtype=torch.float64, device=device).unsqueeze(1)
    i = torch.arange(0, d, 2, dtype=torch.float64, device=device)
    ang = pos / torch.pow(10000.0, i / d)
    pe = torch.zeros(length, d, dtype=torch.float64, device=device)
    pe[:, 0::2] = torch.sin(ang)
    pe[:, 1::2] = torch.cos(ang[:, : d // 2])
    return pe.to(dtype)


def _uniform(g: torch.Generator, bound: float, size) -> Tensor:
    """U(-bound, bound) in float64 from generator ``g``."""
    return (torch.rand(size, generator=g, dtype=torch.float64) * 2 - 1) * bound


def _xavier_bound(fan_in: int, fan_out: int) -> float:
    return math.sqrt(6.0 / (fan_in + fan_out))


def _init_run(g: torch.Generator, rs: "ModelShape", init: str) -> Dict[str, Tensor]:
    """One run's weights in the stack's layouts (unpadded), drawn from ``g``.

    ``paper``: as the paper's code (``attn_models.py``): ``nn.Linear`` defaults for the
    embedding and the decoder (weight and bias U(-1/sqrt(fan_in), 1/sqrt(fan_in))), Xavier-uniform
    *per head* over (d, d_h) for W_Q,h and W_K,h and (d, d_v) for W_V,h, Xavier over the whole
    (H d_v, d) for W_O. ``xavier-proj``: Xavier-uniform with the fans of the whole projection
    (d -> H d_h for Q and K, d -> H d_v for V), as a standard multi-head layer; zero biases
    (this trainer's initialisation before the paper's became the default).
    """
    H, d, di, dh, dv, C = rs.heads, rs.d_model, rs.d_in, rs.d_head, rs.d_value, rs.n_out
    f64 = torch.float64
    if init == "paper":
        W_E = _uniform(g, 1 / math.sqrt(di), (di, d))
        b_E = _uniform(g, 1 / math.sqrt(di), (d,))
        # Each head its own Xavier draw with the head's fans: (H, d, d_h) as the paper stores them.
        W_Q = _uniform(g, _xavier_bound(d, dh), (H, d, dh)).permute(1, 0, 2)
        W_K = _uniform(g, _xavier_bound(d, dh), (H, d, dh))
        W_V = _uniform(g, _xavier_bound(d, dv), (H, d, dv))
        W_O = _uniform(g, _xavier_bound(H * dv, d), (H, dv, d))
        W_D = _uniform(g, 1 / math.sqrt(d), (d, C))
        b_D = _uniform(g, 1 / math.sqrt(d), (C,))
    elif init == "xavier-proj":
        W_E = _uniform(g, _xavier_bound(di, d), (di, d))
        W_Q = _uniform(g, _xavier_bound(d, H * dh), (d, H, dh))
        W_K = _uniform(g, _xavier_bound(d, H * dh), (d, H, dh)).permute(1, 0, 2)
        W_V = _uniform(g, _xavier_bound(d, H * dv), (d, H, dv)).permute(1, 0, 2)
        W_O = _uniform(g, _xavier_bound(H * dv, d), (H, dv, d))
        W_D = _uniform(g, _xavier_bound(d, C), (d, C))
        b_E, b_D = torch.zeros(d, dtype=f64), torch.zeros(C, dtype=f64)
    else:
        raise ValueError(f"init: unknown initialisation {init!r}; choose one of {', '.join(INITS)}")
    return dict(W_E=W_E, b_E=b_E, W_Q=W_Q, W_K=W_K, W_V=W_V, W_O=W_O, W_D=W_D, b_D=b_D)


class StackedParams:
    """Weights of R independent models of one shape (each tensor has a leading run dim R).

    Layouts: ``W_E`` (R, d_in, d), ``b_E`` (R, d), ``W_Q`` (R, d, H, d_h), ``W_K`` (R, H, d, d_h),
    ``W_V`` (R, H, d, d_v), ``W_O`` (R, H * d_v, d), ``W_D`` (R, d, C), ``b_D`` (R, C).
    (The paper's code stores ``W_Q`` as (H, d, d_h) and the embedding and decoder as
    ``nn.Linear`` weights, the transposes of ``W_E`` and ``W_D``.)

    Initialisation (per run, from its own seed, in float64 on the CPU so that a seed gives the
    same weights on every device): ``init`` names it, see :func:`_init_run` (``paper`` by default).
    """

    def __init__(self, tensors: Dict[str, Tensor]):
        self.t = tensors

    @classmethod
    def init(
        cls,
        shape: ModelShape,
        seeds: Sequence[int],
        device="cpu",
        dtype=torch.float32,
        init: str = "paper",
    ) -> "StackedParams":
        """Weights of runs ``seeds``, all of shape ``shape`` (a stack holds one shape: see
        ``RunConfig.stack_key``)."""
        H, d, dv = shape.heads, shape.d_model, shape.d_value
        per_run: List[Dict[str, Tensor]] = []
        for s in seeds:
            # Weights use a stream apart from the data's hash streams: seed s's data and
            # weights are unrelated.
            g = torch.Generator().manual_seed(int(s) * 7919 + 1)
            w = _init_run(g, shape, init)
            w["W_O"] = w["W_O"].reshape(H * dv, d)
            per_run.append(w)
        t = {
            k: torch.stack([p[k] for p in per_run]).to(device=device, dtype=dtype).contiguous().requires_grad_(True)
            for k in PARAM_NAMES
        }
        return cls(t)

    def __getitem__(self, name: str) -> Tensor:
        return self.t[name]

    def tensors(self) -> List[Tensor]:
        return [self.t[k] for k in PARAM_NAMES]

    @property
    def R(self) -> int:
        return self.t["W_E"].shape[0]

    def select(self, runs: Tensor) -> "StackedParams":
        """A new leaf set holding only ``runs`` (indices into the run dim)."""
        return StackedParams({k: v.detach()[runs].contiguous().requires_grad_(True) for k, v in self.t.items()})

    def detached(self) -> "StackedParams":
        return StackedParams({k: v.detach() for k, v in self.t.items()})


def _embed(P: StackedParams, x: Tensor, pe: Tensor) -> Tensor:
    """Embed tokens ``x`` (R, ..., L, d_in) at positions ``pe`` (L, d): (R, ..., L, d)
    (``products.embed``: the bias added as the product's tiles are made, where the bits agree)."""
    return products.embed(x, P["W_E"], P["b_E"], pe)


def folds(b: int, H: int, d: int, dh: int) -> bool:
    """Whether :func:`_folded_queries` forms A_h = W_Q,h W_K,h^T (for a batch of b queries)."""
    return H * d * d * dh + b * H * d * d < 2 * b * H * d * dh


def _folded_queries(P: StackedParams, t0: Tensor) -> Tensor:
    """u_h = W_K,h W_Q,h^T t_0 for query tokens ``t0`` (R, b, d): (R, b, H, d).

    Two orders give the same numbers; the cheaper is taken. Forming A_h = W_Q,h W_K,h^T
    (H d^2 d_h multiply-adds) pays when the batch is large against d_h; going through the
    d_h-dim queries (2 b H d d_h) pays when d_h is small.
    """
    R, b, d = t0.shape
    W_Q, W_K = P["W_Q"], P["W_K"]
    H, dh = W_K.shape[1], W_K.shape[3]
    if folds(b, H, d, dh):
        A = products.fold(W_Q, W_K)  # (R, d, H d): einsum "rdhe,rhfe->rdhf", or its bits
        return products.bmm(t0, A).view(R, b, H, d)
    qh = products.bmm(t0, W_Q.reshape(R, d, H * dh)).view(R, b, H, dh)
    return torch.einsum("rbhe,rhfe->rbhf", qh, W_K)


def _context_attention(q: Tensor, C: Tensor, scale: float, backend: str) -> Tensor:
    """(B, 1, Lq, d) queries over keys = values = C (B, 1, n, d), by ``backend``.

    Through mhakern.attention like every caller: a direct path on the compiled ops (no checks,
    no operator layer) measured 4.53 ms against 4.54 ms through it for the trainer's context call
    forward + backward (B 256, Lq 20, n 32, d 64, one CPU thread, medians of 15 interleaved
    rounds), too little to keep a second path for.
    """
    return mhakern.attention(q, C, C, scale=scale, backend=backend)


def _attend(u: Tensor, C: Tensor, scale: float, attn: str, backend: str, layout: str) -> Tensor:
    """Attention of folded queries ``u`` (R, b, H, d) over context ``C``: (R, b, H, d).

    ``C`` is (R, b, n, d) (a context per example) or (R, n, d) (one context per run).
    """
    R, b, H, d = u.shape
    if attn == "eager":
        if C.dim() == 3:
            s = torch.matmul(u.reshape(R, b * H, d), C.transpose(-1, -2)) * scale
            return torch.matmul(torch.softmax(s, dim=-1), C).view(R, b, H, d)
        s = torch.matmul(u, C.transpose(-1, -2)) * scale
        return torch.matmul(torch.softmax(s, dim=-1), C)
    if C.dim() == 3:
        # Shared context: a run's b*H folded queries all read its one context.
        q = u.reshape(R, 1, b * H, d)
        return _context_attention(q, C.unsqueeze(1), scale, backend).view(R, b, H, d)
    kv = C.reshape(R * b, 1, C.shape[2], d)
    if layout == "heads":
        # Multi-query form: H query heads of one query each over one shared KV head.
        q = u.reshape(R * b, H, 1, d)
    else:
        # The same computation with the heads as the query rows of a single head: the context
        # is read once per example instead of once per head.
        q = u.reshape(R * b, 1, H, d)
    return _context_attention(q, kv, scale, backend).reshape(R, b, H, d)


def _head_outputs(P: StackedParams, z: Tensor) -> Tensor:
    """p_h = W_V,h^T z_h for attention outputs ``z`` (R, b, H, d): (R, b, H * d_v)."""
    R, b, H, d = z.shape
    W_V = P["W_V"]
    if W_V.shape[-1] == 1:
        # d_v = 1 (the paper's setting): a weighted sum over d, no matmul needed.
        return (z * W_V.view(R, 1, H, d)).sum(-1)
    return torch.einsum("rbhd,rhdv->rbhv", z, W_V).reshape(R, b, -1)


def _bmm(a: Tensor, b: Tensor) -> Tensor:
    """``torch.bmm(a, b)`` whose rounding does not depend on the number of runs R.

    On the CPU a batched matmul with one batch entry and a width-1 operand (an output of width 1,
    or -- in its backward -- a contraction of length 1) goes through a matrix-vector kernel that
    rounds otherwise than the kernel the same product gets with two or more entries, so one run
    alone would not give the numbers it gives in a stack. Width 1 is padded to 2 with zeros
    (exact: the zeros add exact zeros), which keeps every R on the one kernel. Only degenerate
    widths pay the copy (H d_v = 1 and the regression's single output).
    """
    if a.shape[-1] == 1:  # contraction of length 1: its backward has an output of width 1
        a = torch.cat([a, torch.zeros_like(a)], -1)
        b = torch.cat([b, torch.zeros_like(b)], -2)
    if b.shape[-1] == 1:
        return torch.bmm(a, torch.cat([b, torch.zeros_like(b)], -1))[..., :1]
    return torch.bmm(a, b)


def _decode(P: StackedParams, heads_out: Tensor) -> Tensor:
    W_O, W_D = P["W_O"], P["W_D"]
    if heads_out.shape[-1] == 1 or W_D.shape[-1] == 1:
        return _bmm(_bmm(heads_out, W_O), W_D) + P["b_D"].unsqueeze(1)
    o = products.bmm(heads_out, W_O)
    return products.baddbmm(P["b_D"].unsqueeze(1), o, W_D)


def folded_forward(
    P: StackedParams,
    query: Tensor,
    ctx: Tensor,
    pe: Tensor,
    attn: str = "fused",
    backend: str = "auto",
    layout: str = "rows",
) -> Tensor:
    """Logits (R, b, C) of the folded model.

    Args:
        query: (R, b, d_in) query tokens.
        ctx: (R, b, n, d_in) a context per example, or (R, n, d_in) one context per run.
        pe: (n + 1, d) positional encoding (row 0 is the query's).
        attn: "fused" (``mhakern.attention`` with ``backend``) or "eager".
        layout: for per-example contexts, "rows" passes the H folded queries of an example as
            query rows of one head, "heads" as H query heads over one KV head (same numbers).
    """
    d = P["W_E"].shape[2]
    t0 = _embed(P, query.unsqueeze(-2), pe[0:1]).squeeze(-2)
    C = _embed(P, ctx, pe[1:])
    u = _folded_queries(P, t0)
    z = _attend(u, C, 1.0 / math.sqrt(d), attn, backend, layout)
    return _decode(P, _head_outputs(P, z))


def paper_forward(P: StackedParams, query: Tensor, ctx: Tensor, pe: Tensor) -> Tensor:
    """Logits (R, b, C) computed as the paper's code does: per-head Q, K, V of all n+1 tokens
    and the full (n+1) x (n+1) attention in which no token attends to position 0; token 0's
    output is decoded. Shapes as :func:`folded_forward`.
    """
    R, b = query.shape[:2]
    if ctx.dim() == 3:
        ctx = ctx.unsqueeze(1).expand(R, b, *ctx.shape[1:])
    x = torch.cat([query.unsqueeze(2), ctx], dim=2)  # (R, b, n+1, d_in)
    L = x.shape[2]
    t = _embed(P, x, pe)  # (R, b, L, d)
    d = t.shape[-1]
    W_Q, W_K, W_V = P["W_Q"], P["W_K"], P["W_V"]
    H, dh, dv = W_K.shape[1], W_K.shape[3], W_V.shape[3]
    tf = t.reshape(R, b * L, d)
    Q = torch.bmm(tf, W_Q.reshape(R, d, H * dh)).view(R, b, L, H, dh)
    K = torch.bmm(tf, W_K.permute(0, 2, 1, 3).reshape(R, d, H * dh)).view(R, b, L, H, dh)
    V = torch.bmm(tf, W_V.permute(0, 2, 1, 3).reshape(R, d, H * dv)).view(R, b, L, H, dv)
    s = torch.einsum("rbqhe,rbkhe->rbhqk", Q, K) / math.sqrt(d)
    hide = torch.zeros(L, dtype=torch.bool, device=s.device)
    hide[0] = True  # no token attends to the query position
    s = s.masked_fill(hide, float("-inf"))
    out = torch.einsum("rbhqk,rbkhv->rbqhv", torch.softmax(s, dim=-1), V)
    heads_out = out[:, :, 0].reshape(R, b, H * dv)
    return _decode(P, heads_out)


def forward(P: StackedParams, query: Tensor, ctx: Tensor, pe: Tensor, impl: str, backend: str = "auto", layout: str = "rows") -> Tensor:
    """Dispatch on ``impl`` ("fused", "eager" or "paper"); see :func:`folded_forward`."""
    if impl == "paper":
        return paper_forward(P, query, ctx, pe)
    return folded_forward(P, query, ctx, pe, attn="eager" if impl == "eager" else "fused", backend=backend, layout=layout)


@torch.no_grad()
def attention_weights(P: StackedParams, query: Tensor, ctx: Tensor, pe: Tensor) -> Tensor:
    """theta (R, b, H, n): each head's softmax over the context for the query token (the
    weights the paper's saturation analysis reads). Shapes of ``query`` and ``ctx`` as
    :func:`folded_forward`.
    """
    d = P["W_E"].shape[2]
    t0 = _embed(P, query.unsqueeze(-2), pe[0:1]).squeeze(-2)
    C = _embed(P, ctx, pe[1:])
    u = _folded_queries(P, t0)  # (R, b, H, d)
    if C.dim() == 3:
        s = torch.einsum("rbhd,rnd->rbhn", u, C)
    else:
        s = torch.einsum("rbhd,rbnd->rbhn", u, C)
    return torch.softmax(s / math.sqrt(d), dim=-1)
