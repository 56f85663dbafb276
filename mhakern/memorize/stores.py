"""Memory stores: linear maps, MLPs and softmax attention as key-value memories.

A store holds M memories (key k_i in R^{d_k}, value v_i in R^{d_v}); recalling with k_j should
give v_j. The output splits into the signal (the part carried by memory j) and the
interference (everything else); the interference-to-signal ratio (ISR) measures recall, and a
store's capacity is the M at which the ISR reaches 1. docs/memory_stores.md derives every
prediction used here.

Stores (keys and values random unit vectors, the first M of one fixed stream, so that the
stores of M and M' > M are nested and one pass over the memories measures every M):

* ``linear``: W = sum_i v_i k_i^T, f(x) = W x.
* ``mlp-relu`` (threshold t), ``mlp-poly2``, ``mlp-relu2``: one hidden unit per memory,
  f(x) = sum_i v_i phi(k_i . x) with phi(c) = relu(c - t), c^2 or relu(c)^2 -- an MLP whose
  first-layer weights are the keys and second-layer weights the values.
* ``mlp-trained``: a fixed-width MLP f(x) = W_2 relu(W_1 x + b_1) + b_2 (width 4 d_k by
  default) trained by Adam on the M pairs; its signal is the projection of f(k_j) on v_j.
* ``attention``: the memories are the context, f(x) = sum_i v_i softmax_i(beta k_i . x),
  computed by ``mhakern.attention`` over chunks of keys combined through their log-sum-exp,
  so no M-wide score row is ever held. The signal weight of memory j is
  exp(beta k_j . k_j - lse_j), taken from the kernel's lse.

For the constructed stores the ISR measured is sqrt(mean_j |interference_j|^2 /
mean_j |signal_j|^2) over the queries, the quantity the predictions give in expectation.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

import mhakern

from .extras import progress_bar

Tensor = torch.Tensor

KERNEL_STORES = ("linear", "mlp-relu", "mlp-poly2", "mlp-relu2")
STORES = KERNEL_STORES + ("mlp-trained", "attention")


# ---------------------------------------------------------------------------- predictions
def _sphere_grid(d: int, n: int = 400_001) -> Tuple[np.ndarray, np.ndarray]:
    """Points c in (-1, 1) and quadrature weights of the density of c = k_i . k_j for
    independent uniform unit vectors in R^d: p(c) proportional to (1 - c^2)^((d - 3) / 2)."""
    c = np.linspace(-1.0, 1.0, n)[1:-1]
    logp = 0.5 * (d - 3) * np.log1p(-c * c)
    w = np.exp(logp - logp.max())
    w /= w.sum()
    return c, w


def phi_np(store: str, c: np.ndarray, param: Dict[str, float]) -> np.ndarray:
    if store == "linear":
        return c
    if store == "mlp-relu":
        return np.maximum(c - param["t"], 0.0)
    if store == "mlp-poly2":
        return c * c
    if store == "mlp-relu2":
        return np.maximum(c, 0.0) ** 2
    raise ValueError(f"store: no unit function for {store!r}")


def _log_sphere_mean_exp(a: float, d: int) -> float:
    """log E[exp(a c)] for c = k_i . k_j on the unit sphere of R^d (numerically)."""
    c, w = _sphere_grid(d)
    x = a * c + np.log(w)
    m = x.max()
    return float(m + np.log(np.exp(x - m).sum()))


def interference_moment(store: str, d_k: int, param: Dict[str, float]) -> Tuple[float, float]:
    """(exact, approx): E[phi(c)^2] / phi(1)^2 for a kernel store, or E[exp(2 beta c)] /
    exp(2 beta) for attention; ``exact`` on the sphere, ``approx`` with c ~ N(0, 1/d_k)."""
    d = d_k
    if store == "attention":
        b = param["beta"]
        exact = math.exp(_log_sphere_mean_exp(2 * b, d) - 2 * b)
        approx = math.exp(2 * b * b / d - 2 * b)
        return exact, approx
    c, w = _sphere_grid(d)
    phi1 = float(phi_np(store, np.array([1.0]), param)[0])
    exact = float((phi_np(store, c, param) ** 2 * w).sum()) / phi1**2
    s2 = 1.0 / d
    if store == "linear":
        approx = s2
    elif store == "mlp-relu":
        t = param["t"]
        s = math.sqrt(s2)
        a = t / s
        tail = 0.5 * math.erfc(a / math.sqrt(2))
        dens = math.exp(-a * a / 2) / math.sqrt(2 * math.pi)
        approx = s2 * ((1 + a * a) * tail - a * dens) / phi1**2
    elif store == "mlp-poly2":
        approx = 3 * s2 * s2
    else:  # mlp-relu2
        approx = 1.5 * s2 * s2
    return exact, approx


def predicted_isr(store: str, M: np.ndarray, d_k: int, param: Dict[str, float]) -> Tuple[np.ndarray, np.ndarray]:
    """(exact, formula) ISR at M memories: sqrt((M - 1) m_exact) and sqrt(M m_approx)."""
    ex, ap = interference_moment(store, d_k, param)
    M = np.asarray(M, dtype=np.float64)
    return np.sqrt((M - 1) * ex), np.sqrt(M * ap)


def predicted_capacity(store: str, d_k: int, param: Dict[str, float]) -> Tuple[float, float]:
    """(exact, formula) M at which the predicted ISR is 1."""
    ex, ap = interference_moment(store, d_k, param)
    return 1.0 + 1.0 / ex, 1.0 / ap


# ---------------------------------------------------------------------------- memories
def _unit(x: Tensor) -> Tensor:
    return x / x.norm(dim=-1, keepdim=True)


class Memories:
    """Keys (unit, dim d_k) and values (unit, dim d_v) of ``trials`` independent stores,
    generated chunk by chunk: memory i of trial r is the same whatever chunking reads it."""

    BLOCK = 1 << 12

    def __init__(self, trials: int, d_k: int, d_v: int, seed: int = 0, device="cpu", dtype=torch.float32):
        self.trials, self.d_k, self.d_v, self.seed = trials, d_k, d_v, seed
        self.device, self.dtype = torch.device(device), dtype
        self._cache: Dict[int, Tuple[Tensor, Tensor]] = {}

    def _block(self, b: int) -> Tuple[Tensor, Tensor]:
        if b in self._cache:
            return self._cache[b]
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + b)
        k = torch.randn((self.trials, self.BLOCK, self.d_k), generator=g)
        v = torch.randn((self.trials, self.BLOCK, self.d_v), generator=g)
        kv = (_unit(k).to(self.device, self.dtype), _unit(v).to(self.device, self.dtype))
        self._cache = {b: kv}  # one block kept: chunks are read in order
        return kv

    def get(self, a: int, b: int) -> Tuple[Tensor, Tensor]:
        """Keys (trials, b - a, d_k) and values (trials, b - a, d_v) of memories a .. b-1."""
        ks, vs = [], []
        i = a
        while i < b:
            blk = i // self.BLOCK
            lo = i - blk * self.BLOCK
            hi = min(self.BLOCK, b - blk * self.BLOCK)
            k, v = self._block(blk)
            ks.append(k[:, lo:hi])
            vs.append(v[:, lo:hi])
            i = blk * self.BLOCK + hi
        return torch.cat(ks, 1), torch.cat(vs, 1)


def geometric_points(lo: int, hi: int, per_octave: int = 8) -> List[int]:
    """Integers from lo to hi (both included) spaced by 2^(1/per_octave)."""
    pts, x = [], float(lo)
    while x < hi:
        pts.append(int(round(x)))
        x *= 2 ** (1.0 / per_octave)
    pts.append(hi)
    return sorted(set(p for p in pts if lo <= p <= hi))


# ---------------------------------------------------------------------------- measurement
@dataclass
class Curve:
    store: str
    d_k: int
    d_v: int
    param: Dict[str, float]
    M: List[int] = field(default_factory=list)
    isr: List[float] = field(default_factory=list)
    recall: List[float] = field(default_factory=list)
    queries: List[int] = field(default_factory=list)
    backend: str = ""
    wall_s: float = 0.0

    def isr_pred(self) -> Tuple[np.ndarray, np.ndarray]:
        if self.store == "mlp-trained":
            n = len(self.M)
            return np.full(n, np.nan), np.full(n, np.nan)
        return predicted_isr(self.store, np.array(self.M), self.d_k, self.param)

    def capacity(self) -> float:
        """M where the measured ISR first reaches 1, log-log interpolated (nan if never)."""
        return crossing(self.M, self.isr)


def crossing(M: Sequence[float], isr: Sequence[float], level: float = 1.0) -> float:
    """First M at which ``isr`` reaches ``level``, interpolating log isr linearly in log M.

    nan if it never does; M[0] if it already does at the first point.
    """
    for i, (m, r) in enumerate(zip(M, isr)):
        if r >= level:
            if i == 0:
                return float(m)
            m0, r0 = M[i - 1], isr[i - 1]
            if r0 <= 0 or r == r0:
                return float(m)
            f = (math.log(level) - math.log(r0)) / (math.log(r) - math.log(r0))
            return float(math.exp(math.log(m0) + f * (math.log(m) - math.log(m0))))
    return float("nan")


def _phi_t(store: str, c: Tensor, param: Dict[str, float]) -> Tensor:
    if store == "linear":
        return c
    if store == "mlp-relu":
        return torch.relu(c - param["t"])
    if store == "mlp-poly2":
        return c * c
    if store == "mlp-relu2":
        return torch.relu(c) ** 2
    raise ValueError(f"store: no unit function for {store!r}")


def _isr_and_recall(
    out: Tensor, signal_w: Tensor, mem: Memories, Qe: int, M: int, recall_max: int, v_q: Tensor
) -> Tuple[float, float]:
    """ISR over queries 0..Qe-1 and, for M <= recall_max, the fraction of queries whose output
    is closer (inner product) to their own value than to any other stored value."""
    o = out[:, :Qe].double()
    sig = signal_w[:, :Qe].double().unsqueeze(-1) * v_q[:, :Qe].double()
    interf = o - sig
    isr = math.sqrt(float((interf * interf).sum(-1).mean()) / float((sig * sig).sum(-1).mean()))
    rec = float("nan")
    if M <= recall_max:
        _, V = mem.get(0, M)
        scores = torch.matmul(out[:, :Qe].to(V.dtype), V.transpose(1, 2))  # (trials, Qe, M)
        rec = float((scores.argmax(-1) == torch.arange(Qe, device=scores.device)).double().mean())
    return isr, rec


def measure_curve(
    store: str,
    d_k: int,
    points: Sequence[int],
    param: Optional[Dict[str, float]] = None,
    d_v: Optional[int] = None,
    queries: int = 256,
    trials: int = 4,
    seed: int = 0,
    chunk: int = 1 << 16,
    recall_max: int = 1 << 14,
    device="cpu",
    backend: str = "auto",
    progress: bool = False,
) -> Curve:
    """ISR (and recall) of a constructed store (``KERNEL_STORES`` or ``attention``) at each M
    of ``points``, in one pass over the memories.

    Queries are the first ``queries`` memories' keys; at M below that, the first M of them.
    The attention store accumulates (output, lse) chunk by chunk: for chunks A and B,
    lse = logaddexp(lse_A, lse_B) and out = exp(lse_A - lse) out_A + exp(lse_B - lse) out_B.
    """
    param = dict(param or {})
    d_v = d_k if d_v is None else d_v
    pts = sorted(set(int(p) for p in points))
    if not pts or pts[0] < 1:
        raise ValueError(f"points: need positive memory counts, got {list(points)[:5]}")
    t0 = time.perf_counter()
    mem = Memories(trials, d_k, d_v, seed, device)
    Q = min(queries, pts[-1])
    Kq, Vq = mem.get(0, Q)
    # Constructed stores are plain torch matmuls; the attention store names its mhakern backend.
    curve = Curve(store, d_k, d_v, param, backend="torch" if store != "attention" else "")
    attn = store == "attention"
    beta = param.get("beta", math.sqrt(d_k))
    if attn:
        qk = (Kq * Kq).sum(-1).double()  # k_j . k_j (1 up to rounding)
        acc = torch.zeros((trials, Q, d_v), dtype=torch.float64, device=mem.device)
        lse = torch.full((trials, Q), -math.inf, dtype=torch.float64, device=mem.device)
        qt = Kq.unsqueeze(1)  # (trials, 1, Q, d_k)
    else:
        acc = torch.zeros((trials, Q, d_v), dtype=torch.float32, device=mem.device)
        sig_w = _phi_t(store, (Kq * Kq).sum(-1), param)
    bar = None
    if progress:
        bar = progress_bar(total=pts[-1], desc=f"{store} d_k={d_k}", unit="mem", unit_scale=True, leave=False,
                           dynamic_ncols=True)
    a = 0
    try:
        for M in pts:
            while a < M:
                b = min(M, a + chunk)
                K, V = mem.get(a, b)
                if attn:
                    out_c, lse_c = mhakern.attention(
                        qt, K.unsqueeze(1), V.unsqueeze(1), scale=beta, backend=backend, return_lse=True
                    )
                    if not curve.backend:
                        curve.backend = mhakern.backends.select(backend, qt, K.unsqueeze(1), V.unsqueeze(1), False, None).name
                    lse_c = lse_c[:, 0].double()
                    new = torch.logaddexp(lse, lse_c)
                    acc = acc * torch.exp(lse - new).unsqueeze(-1) + out_c[:, 0].double() * torch.exp(lse_c - new).unsqueeze(-1)
                    lse = new
                else:
                    c = torch.matmul(K, Kq.transpose(1, 2))  # (trials, b-a, Q)
                    acc += torch.matmul(_phi_t(store, c, param).transpose(1, 2), V)
                if bar is not None:
                    bar.update(b - a)
                a = b
            Qe = min(Q, M)
            if attn:
                w = torch.exp(beta * qk - lse)  # signal weight of memory j, from the lse
                isr, rec = _isr_and_recall(acc, w, mem, Qe, M, recall_max, Vq)
            else:
                isr, rec = _isr_and_recall(acc, sig_w, mem, Qe, M, recall_max, Vq)
            curve.M.append(M)
            curve.isr.append(isr)
            curve.recall.append(rec)
            curve.queries.append(Qe * trials)
    finally:
        if bar is not None:
            bar.close()
    curve.wall_s = time.perf_counter() - t0
    return curve


def measure_trained_mlp(
    d_k: int,
    points: Sequence[int],
    width: Optional[int] = None,
    d_v: Optional[int] = None,
    steps: int = 1000,
    lr: float = 1e-2,
    seed: int = 0,
    device="cpu",
    recall_max: int = 1 << 14,
    progress: bool = False,
) -> Curve:
    """ISR of a trained MLP f(x) = W_2 relu(W_1 x + b_1) + b_2 of hidden ``width``
    (default 4 d_k), one model per M of ``points`` (the first M memories of one stream).

    Each model is trained by full-batch Adam (``lr`` cosine-decayed to 0 over ``steps``) on the
    mean squared error over its M memories. Then for every memory j, signal =
    (f(k_j) . v_j) v_j and interference = f(k_j) - signal;
    ISR = sqrt(mean |interference|^2 / mean (f(k_j) . v_j)^2).
    """
    from .optim import BatchedAdam

    d_v = d_k if d_v is None else d_v
    width = 4 * d_k if width is None else width
    pts = sorted(set(int(p) for p in points))
    t0 = time.perf_counter()
    mem = Memories(1, d_k, d_v, seed, device)
    K_all, V_all = mem.get(0, pts[-1])
    curve = Curve("mlp-trained", d_k, d_v, {"width": width, "steps": steps, "lr": lr}, backend="torch")
    bar = None
    if progress:
        bar = progress_bar(total=steps * len(pts), desc=f"mlp-trained d_k={d_k} width={width}", unit="step",
                           leave=False, dynamic_ncols=True)
    try:
        for M in pts:
            K, V = K_all[:, :M], V_all[:, :M]  # (1, M, d)
            g = torch.Generator().manual_seed(seed * 1009 + M)

            def lin(fan_in, shape):
                # nn.Linear's default initialisation: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
                bd = 1.0 / math.sqrt(fan_in)
                return ((torch.rand(shape, generator=g) * 2 - 1) * bd).to(K.device).requires_grad_(True)

            W1, b1 = lin(d_k, (1, d_k, width)), lin(d_k, (1, 1, width))
            W2, b2 = lin(width, (1, width, d_v)), lin(width, (1, 1, d_v))
            opt = BatchedAdam([W1, b1, W2, b2])
            for s in range(steps):
                out = torch.baddbmm(b2, torch.relu(torch.baddbmm(b1, K, W1)), W2)
                loss = ((out - V) ** 2).sum(-1).mean()
                opt.zero_grad()
                loss.backward()
                opt.step(torch.full((1,), lr * 0.5 * (1 + math.cos(math.pi * s / steps)), device=K.device))
                if bar is not None:
                    bar.update(1)
            with torch.no_grad():
                o = torch.baddbmm(b2, torch.relu(torch.baddbmm(b1, K, W1)), W2)[0].double()
                Vd = V[0].double()
                sg = (o * Vd).sum(-1, keepdim=True)
                interf = o - sg * Vd
                curve.M.append(M)
                curve.isr.append(math.sqrt(float((interf**2).sum(-1).mean()) / float((sg**2).mean())))
                if M <= recall_max:
                    hit = (o @ Vd.T).argmax(-1) == torch.arange(M, device=o.device)
                    curve.recall.append(float(hit.double().mean()))
                else:
                    curve.recall.append(float("nan"))
                curve.queries.append(M)
    finally:
        if bar is not None:
            bar.close()
    curve.wall_s = time.perf_counter() - t0
    return curve


# ---------------------------------------------------------------------------- the experiment
@dataclass(frozen=True)
class StoreSpec:
    store: str
    param: Tuple[Tuple[str, float], ...] = ()

    @property
    def params(self) -> Dict[str, float]:
        return dict(self.param)

    @property
    def name(self) -> str:
        if not self.param:
            return self.store
        return self.store + "(" + ", ".join(f"{k}={v:g}" for k, v in self.param) + ")"


def default_specs(d_k: int, thresholds=(0.0, 0.1, 0.2, 0.3), betas: Optional[Sequence[float]] = None) -> List[StoreSpec]:
    betas = [math.sqrt(d_k)] if betas is None else list(betas)
    specs = [StoreSpec("linear")]
    specs += [StoreSpec("mlp-relu", (("t", float(t)),)) for t in thresholds]
    specs += [StoreSpec("mlp-poly2"), StoreSpec("mlp-relu2"), StoreSpec("mlp-trained")]
    specs += [StoreSpec("attention", (("beta", float(b)),)) for b in betas]
    return specs


def points_for(spec: StoreSpec, d_k: int, max_m: int, attn_max_m: int) -> List[int]:
    """Memory counts measured for a store: up to 4x its predicted capacity (capped)."""
    if spec.store == "attention":
        return geometric_points(16, attn_max_m, 8)
    if spec.store == "mlp-trained":
        # octaves from 4 d_k to 64 d_k, around the parameter count over d_v (about 2 width)
        return geometric_points(4 * d_k, min(max_m, 64 * d_k), 1)
    cap, _ = predicted_capacity(spec.store, d_k, spec.params)
    hi = int(min(max_m, max(64, 4 * cap)))
    return geometric_points(4, hi, 8)


def run_stores(
    specs: Sequence[StoreSpec],
    d_k: int = 64,
    d_v: Optional[int] = None,
    max_m: int = 1 << 17,
    attn_max_m: int = 1 << 22,
    queries: int = 256,
    trials: int = 4,
    seed: int = 0,
    device="cpu",
    backend: str = "auto",
    mlp_steps: int = 1000,
    mlp_width: Optional[int] = None,
    progress: bool = True,
    on_curve: Optional[Callable[[StoreSpec, Curve], None]] = None,
) -> List[Tuple[StoreSpec, Curve]]:
    """Measure each store's curve; ``on_curve`` is called as each finishes (to store it)."""
    out = []
    for spec in specs:
        pts = points_for(spec, d_k, max_m, attn_max_m)
        if spec.store == "mlp-trained":
            cv = measure_trained_mlp(d_k, pts, width=mlp_width, d_v=d_v, steps=mlp_steps, seed=seed, device=device, progress=progress)
        else:
            tr = 1 if spec.store == "attention" else trials
            cv = measure_curve(
                spec.store, d_k, pts, spec.params, d_v=d_v, queries=queries, trials=tr, seed=seed,
                device=device, backend=backend, progress=progress,
            )
        out.append((spec, cv))
        if on_curve is not None:
            on_curve(spec, cv)
    return out


def curve_rows(spec: StoreSpec, cv: Curve) -> List[Dict]:
    pe, pf = cv.isr_pred()
    return [
        dict(
            store=spec.store, d_k=cv.d_k, d_v=cv.d_v, param=json.dumps(cv.param, sort_keys=True), M=m,
            isr=i, isr_pred=_f(a), isr_formula=_f(b), recall=_f(r), queries=q,
        )
        for m, i, a, b, r, q in zip(cv.M, cv.isr, pe, pf, cv.recall, cv.queries)
    ]


def capacity_row(spec: StoreSpec, cv: Curve, device: str) -> Dict:
    if spec.store == "mlp-trained":
        pe = pf = None
    else:
        pe, pf = predicted_capacity(spec.store, cv.d_k, spec.params)
    return dict(
        store=spec.store, d_k=cv.d_k, d_v=cv.d_v, param=json.dumps(cv.param, sort_keys=True),
        capacity=_f(cv.capacity()), capacity_pred=pe, capacity_formula=pf, M_max=max(cv.M),
        backend=cv.backend, device=device, wall_s=cv.wall_s,
    )


def _f(x) -> Optional[float]:
    x = float(x)
    return None if math.isnan(x) else x
