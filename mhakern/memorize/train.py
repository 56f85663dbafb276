"""Training a stack of independent runs of one shape, side by side.

R runs that differ in their seed only (``RunConfig.stack_key``) are one batched model:
every matmul carries the run dim, the loss is the sum of the runs' losses, and
:class:`~mhakern.memorize.optim.BatchedAdam` gives each run its own learning-rate schedule. A
run leaves the stack when it reaches its target accuracy (the paper stops at 100%; see
``RunConfig.stops_early``) or its step budget; the others go on without it.

What a run does and reports follows the paper's code (``trainers.py``): batches of ``batch``
examples from a fresh random order of the run's T examples each epoch, the last partial batch
kept (a full batch of all T when T <= batch); the training set evaluated whole after steps
1, 1 + eval_every, 1 + 2 eval_every, ... (the paper's ``step % 500 == 0`` on 0-based steps),
and never after the last step unless ``RunConfig.eval_last`` asks for it; the kept checkpoint
is the lowest-loss evaluation and ``mem_acc`` its accuracy (``loss`` its loss: the MSE of a
regression).

A run's numbers do not depend on its stack, bit for bit on the CPU: a stack's runs have one
shape and one T, so every operation of a run sees the operands it sees alone, in the same
order (``tests/test_memorize_engine.py`` checks a run alone against the same run in a sweep
of mixed H and T).
"""
from __future__ import annotations

import math
import platform
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

import mhakern

from . import data as data_mod
from . import fused_step, products
from .config import ConfigError, RunConfig
from .extras import progress_bar
from .model import ModelShape, StackedParams, attention_weights, forward, sinusoidal_positions
from .optim import BatchedAdam, adam_foreach, adam_fused, fused_adam_variant, lr_factor

Tensor = torch.Tensor

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class RunResult:
    """What one finished run reports (one row of the store)."""

    config: RunConfig
    mem_acc: float
    best_acc: float
    final_acc: float
    loss: float
    steps_done: int
    stopped_early: bool
    wall_s: float
    steps_per_s: float
    stack_size: int
    backend_used: str
    device: str
    history: List[Tuple[int, float, float]] = field(default_factory=list)
    analysis: Optional[Dict[str, object]] = None

    @property
    def examples(self) -> float:
        """Examples memorized: mem_acc x T."""
        return self.mem_acc * self.config.T

    @property
    def examples_per_s(self) -> float:
        """Training examples processed per second by this run."""
        return self.steps_per_s * min(self.config.batch, self.config.T)


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def device_name(device: torch.device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    return f"cpu: {platform.machine()}, {torch.get_num_threads()} threads"


def versions() -> Dict[str, str]:
    v = {"python": platform.python_version(), "torch": torch.__version__, "mhakern": mhakern.__version__}
    if "triton" in sys.modules:
        v["triton"] = getattr(sys.modules["triton"], "__version__", "?")
    return v


def stack_shape(configs: Sequence[RunConfig]) -> ModelShape:
    """The model shape of a stack (its runs share it: they differ in their seed only)."""
    return ModelShape.of(configs[0])


def resolve_backend(cfg: RunConfig, device) -> str:
    """The backend that will serve this configuration's attention calls, by name.

    ``impl`` "eager" and "paper" use no backend (their name is returned). Raises
    :class:`ConfigError` for ``--backend`` when the named backend (or ``auto``) cannot serve the
    tensors the model passes to ``mhakern.attention``.
    """
    if cfg.impl != "fused":
        return cfg.impl
    dt = torch_dtype(cfg.dtype)
    dev = torch.device(device)
    H, n, d = cfg.heads, cfg.context, cfg.d_model
    # Meta tensors of the call's shapes: supports() looks at shapes, dtypes and devices only.
    if cfg.data == "shared":
        q = torch.empty((1, 1, 2 * H, d), dtype=dt, device=dev)
    else:
        q = torch.empty((2, 1, H, d), dtype=dt, device=dev)
    kv = torch.empty((q.shape[0], 1, n, d), dtype=dt, device=dev)
    try:
        return mhakern.backends.select(cfg.backend, q, kv, kv, False, None).name
    except ValueError as e:
        msg = str(e)
        if msg.startswith("backend: "):
            msg = msg[len("backend: "):]
        raise ConfigError("--backend", msg) from None


class _Sampler:
    """Per-run mini-batch indices, as the paper's ``DataLoader(shuffle=True)``: each epoch a
    fresh random order of the run's T examples, cut into batches of ``batch`` with the last,
    partial batch kept (T = 500 at batch 256: batches of 256 and 244).

    ``next(act)`` returns ``(idx, w)``: ``idx`` (len(act), b) example indices and ``w`` the
    matching 0/1 weights (None when every slot is a real example); the loss of a run is the mean
    over its real examples, as the paper's mean over its batch.
    """

    def __init__(self, seeds: Sequence[int], Ts: Sequence[int], batch: int, device):
        self.seeds, self.Ts = list(seeds), list(Ts)
        self.Tmax = max(self.Ts)
        self.b = min(batch, self.Tmax)
        self.device = device
        R = len(self.Ts)
        self.full = [T <= batch for T in self.Ts]
        # Every run full-batch with the same T: the whole dataset is the batch.
        self.trivial = all(self.full) and len(set(self.Ts)) == 1
        ar = torch.arange(self.b, device=device)
        self._ar = ar.view(1, -1)
        Tt = torch.tensor(self.Ts, device=device).view(-1, 1)
        self.full_idx = (ar.view(1, -1) % Tt).contiguous()
        self.full_w = (ar.view(1, -1) < Tt)
        self.perm = torch.zeros((R, self.Tmax), dtype=torch.int64, device=device)
        self.ptr = [0] * R
        self.epoch = [-1] * R
        # Orders of the next few epochs of each run, made in one call: small T means an epoch
        # every step or two, and one argsort per epoch would cost more than the step.
        self._ahead: Dict[int, List[Tensor]] = {}
        self._ahead_n = max(1, (1 << 16) // self.Tmax)
        for r in range(R):
            if not self.full[r]:
                self._new_epoch(r)

    def _new_epoch(self, r: int) -> None:
        self.epoch[r] += 1
        q = self._ahead.get(r)
        if not q:
            q = list(
                data_mod.epoch_permutations(
                    self.seeds[r], self.epoch[r], self._ahead_n, self.Ts[r], self.Tmax, self.device
                ).unbind(0)
            )
            self._ahead[r] = q
        self.perm[r] = q.pop(0)
        self.ptr[r] = 0

    def next(self, act: List[int], act_t: Tensor) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        if self.trivial:
            return None, None
        b = self.b
        starts, lens = [], []
        for r in act:
            if self.full[r]:
                starts.append(0)
                lens.append(self.Ts[r])
                continue
            if self.ptr[r] >= self.Ts[r]:
                self._new_epoch(r)
            n = min(b, self.Ts[r] - self.ptr[r])
            starts.append(self.ptr[r])
            lens.append(n)
            self.ptr[r] += n
        full = [self.full[r] for r in act]
        if all(full):
            w = self.full_w[act_t]
            return self.full_idx[act_t], (None if bool(w.all()) else w.to(torch.float32))
        st = torch.tensor(starts, device=self.device).view(-1, 1)
        ln = torch.tensor(lens, device=self.device).view(-1, 1)
        valid = self._ar < ln
        # Slots past a partial batch read the batch's first example, weighted 0.
        pos = torch.where(valid, st + self._ar, st)
        idx = self.perm[act_t].gather(1, pos)
        if any(full):
            f = torch.tensor(full, device=self.device).view(-1, 1)
            idx = torch.where(f, self.full_idx[act_t], idx)
        partial = any(n < b for n in lens)
        return idx, (valid.to(torch.float32) if partial else None)


def _per_run_loss(out: Tensor, y: Tensor, task: str) -> Tensor:
    """Unreduced loss (R, b): cross-entropy over the classes, or squared error."""
    R, b, C = out.shape
    if task == "classify":
        return F.cross_entropy(out.reshape(R * b, C).float(), y.reshape(R * b), reduction="none").view(R, b)
    return (out.squeeze(-1).float() - y.float()) ** 2


def _correct(out: Tensor, y: Tensor, task: str, reg_tol: float) -> Tensor:
    if task == "classify":
        return out.argmax(-1) == y
    return (out.squeeze(-1).float() - y.float()).abs() < reg_tol


class _Stack:
    """Mutable state of a stack during training (which runs remain, their weights)."""

    def __init__(self, configs: Sequence[RunConfig], device, layout: str, data_max_bytes: int):
        c0 = configs[0]
        self.cfgs = list(configs)
        self.c0 = c0
        self.device = torch.device(device)
        self.dtype = torch_dtype(c0.dtype)
        self.layout = layout
        self.shape = stack_shape(configs)
        seeds = [c.seed for c in configs]
        self.Ts = [c.T for c in configs]
        self.totals = [c.total_steps for c in configs]
        self.data = data_mod.TaskData(
            seeds, self.Ts, c0.context, c0.din, c0.data, c0.dist, c0.task, c0.classes,
            device=self.device, dtype=self.dtype, max_bytes=data_max_bytes,
        )
        self.pe = sinusoidal_positions(c0.context + 1, c0.d_model, self.dtype, self.device)
        self.P = StackedParams.init(self.shape, seeds, self.device, self.dtype, init=c0.init)
        self.opt = BatchedAdam(self.P.tensors())
        self.sampler = _Sampler(seeds, self.Ts, c0.batch, self.device)
        self.act = list(range(len(configs)))
        self.act_t = torch.arange(len(configs), device=self.device)
        self.T_t = torch.tensor(self.Ts, device=self.device, dtype=torch.float64)

    def logits(self, P, q, c):
        c0 = self.c0
        return forward(P, q, c, self.pe, c0.impl, c0.backend, self.layout)

    def train_step(self, step: int) -> None:
        c0 = self.c0
        lr = torch.tensor(
            [c0.lr * lr_factor(step, self.totals[r], c0.warmup) for r in self.act], dtype=torch.float64, device=self.device
        )
        idx, w = self.sampler.next(self.act, self.act_t)
        all_runs = len(self.act) == len(self.cfgs)
        q, c, y = self.data.batch(idx, None if all_runs else self.act_t)
        out = self.logits(self.P, q, c)
        per = _per_run_loss(out, y, c0.task)
        loss = per.mean(1) if w is None else (per * w).sum(1) / w.sum(1)
        self.opt.zero_grad()
        loss.sum().backward()
        self.opt.step(lr)

    @torch.no_grad()
    def evaluate(self, sel: List[int]) -> Tuple[List[float], List[float]]:
        """Accuracy and mean loss over the whole training set of the active runs at positions
        ``sel`` (indices into ``self.act``)."""
        c0 = self.c0
        sel_t = torch.tensor(sel, device=self.device)
        runs_t = self.act_t[sel_t]
        P = StackedParams({k: v.detach()[sel_t] for k, v in self.P.t.items()}) if len(sel) != len(self.act) else self.P.detached()
        Ts = [self.Ts[self.act[i]] for i in sel]
        Tmax = max(Ts)
        # Chunks of a fixed number of examples per run, whatever the stack holds: the chunking
        # rounds the sums, and a run's numbers must not depend on its stack.
        chunk = eval_chunk(c0, self.device)
        correct = torch.zeros(len(sel), dtype=torch.float64, device=self.device)
        loss = torch.zeros(len(sel), dtype=torch.float64, device=self.device)
        T_t = torch.tensor(Ts, device=self.device).view(-1, 1)
        for e0 in range(0, Tmax, chunk):
            e = torch.arange(e0, min(Tmax, e0 + chunk), device=self.device)
            idx = e.view(1, -1).expand(len(sel), -1)
            q, c, y = self.data.batch(idx, runs_t)
            out = self.logits(P, q, c)
            valid = e.view(1, -1) < T_t
            correct += (_correct(out, y, c0.task, c0.reg_tol) & valid).sum(1).double()
            loss += (_per_run_loss(out, y, c0.task) * valid).sum(1).double()
        Tt = torch.tensor(Ts, dtype=torch.float64, device=self.device)
        return (correct / Tt).tolist(), (loss / Tt).tolist()

    def drop(self, keep: List[int]) -> None:
        """Keep only the active runs at positions ``keep``."""
        keep_t = torch.tensor(keep, device=self.device, dtype=torch.long)
        self.P = self.P.select(keep_t)
        self.opt.select(keep_t, self.P.tensors())
        self.act = [self.act[i] for i in keep]
        self.act_t = self.act_t[keep_t]


def eval_chunk(cfg: RunConfig, device) -> int:
    """Examples per run in one chunk of an evaluation: a function of the configuration and the
    device type only (never of the stack), about 8 MB of input tokens per run on the CPU
    (cache-sized) and 512 MB on a GPU."""
    per_ex = (cfg.context + 1) * cfg.din if cfg.data == "random" else cfg.din
    budget, cap = ((1 << 27), 1 << 16) if torch.device(device).type == "cuda" else ((1 << 21), 8192)
    return max(1, min(cap, budget // per_ex))


SATURATION_THRESHOLD = 0.99  # the paper's analysis.py


@torch.no_grad()
def _saturation(st: "_Stack", r: int, weights: Dict[str, Tensor]) -> Dict[str, object]:
    """The paper's softmax-saturation analysis of run ``r``'s kept checkpoint ``weights`` (its
    slice of the stack's parameters): for every training example, each head's attention weights
    of the query over the context; a head is saturated on an example when its largest weight
    exceeds 0.99. Returns the threshold, the mean number of saturated heads per example, the
    fraction of (example, head) pairs saturated, the mean largest weight, and the histogram of
    saturated heads per example (index k: examples with k saturated heads)."""
    cfg = st.cfgs[r]
    H = cfg.heads
    P = StackedParams({k: v.unsqueeze(0) for k, v in weights.items()})
    runs = torch.tensor([r], device=st.device)
    hist = torch.zeros(H + 1, dtype=torch.int64)
    sat_total, max_total = 0, 0.0
    chunk = 4096
    for e0 in range(0, cfg.T, chunk):
        idx = torch.arange(e0, min(cfg.T, e0 + chunk), device=st.device).view(1, -1)
        q, c, _ = st.data.batch(idx, runs)
        theta = attention_weights(P, q, c, st.pe)[0, :, :H].double()  # (b, H, n)
        mx = theta.max(-1).values
        sat = (mx > SATURATION_THRESHOLD).sum(-1)  # saturated heads per example
        hist += torch.bincount(sat.cpu(), minlength=H + 1)
        sat_total += int(sat.sum())
        max_total += float(mx.sum())
    return dict(
        threshold=SATURATION_THRESHOLD,
        mean_saturated_heads=sat_total / cfg.T,
        frac_heads_saturated=sat_total / (cfg.T * H),
        mean_max_weight=max_total / (cfg.T * H),
        saturated_heads_hist=hist.tolist(),
    )


def stack_label(configs: Sequence[RunConfig]) -> str:
    """Short description of a stack for progress bars: the values that vary, listed."""
    c0 = configs[0]

    def vals(f):
        v = sorted({f(c) for c in configs})
        return ",".join(str(x) for x in v)

    s = f"H={vals(lambda c: c.heads)} n={c0.context} d={c0.d_model}"
    if any(c.dh != c0.d_model for c in configs):
        s += f" dh={vals(lambda c: c.dh)}"
    return s + f" T={vals(lambda c: c.T)} {c0.data} x{len(configs)}"


class StepEngine:
    """The training step of a :class:`_Stack` as one static-shaped function of device tensors.

    Everything a step needs lives in tensors whose shapes and addresses do not change from one
    step to the next: the step counter, the mini-batch indices (computed on the device from the
    step and per-run epoch orders), the data (gathered from the materialised store or generated
    from the counter hash), forward, backward, Adam and the learning-rate schedule (per-step
    step sizes in a buffer). So the step can run eagerly (CPU) or be captured once as a CUDA
    graph and replayed (CUDA), with the same code and the same numbers, and it never reads a
    value back to the host: the host touches the device only at *segment* boundaries, where it
    refills the buffers for the next segment's steps (epoch orders, step sizes) without waiting
    for the device, and at evaluations, which read accuracies back (``tolist``) by necessity.

    The numbers are those of :meth:`_Stack.train_step` bit for bit on the CPU: the same batches
    (the sampler's epochs are functions of (seed, epoch, T), see ``data.epoch_permutations``), the
    same loss (a weighted mean, which equals ``mean`` where every slot is real), the same Adam
    arithmetic with its bias corrections and step sizes computed on the host in float64 exactly
    as :class:`~mhakern.memorize.optim.BatchedAdam` computes them.

    CUDA graphs: we capture with ``torch.cuda.CUDAGraph`` directly rather than through
    ``torch.compile(mode="reduce-overhead")``. The step is already a fixed sequence of kernels
    with static shapes, so capture is all that is needed; compile would add minutes of tracing
    per stack shape (and again whenever runs leave a stack and the shape changes), would have to
    trace through mhakern's custom ops and the in-place optimizer, and its graph trees manage
    memory of mutated inputs we want to own. Capture costs a few steps (warm-up on a side stream
    with the state saved and restored, then one recorded step); a stack whose runs drop out is
    compacted and recaptured at the evaluation where they drop.
    """

    def __init__(self, st: "_Stack", segment: int = 512, capture: Optional[bool] = None):
        self.st = st
        c0 = st.c0
        dev = st.device
        self.segment = max(1, int(segment))
        self.capture = (dev.type == "cuda") if capture is None else bool(capture)
        if self.capture and dev.type != "cuda":
            raise ValueError("StepEngine: capture=True needs a CUDA device")
        self.b1, self.b2, self.eps = st.opt.b1, st.opt.b2, st.opt.eps
        self.task, self.lr0, self.warmup = c0.task, c0.lr, c0.warmup
        self.b = st.sampler.b
        self.m = [torch.zeros_like(p) for p in st.P.tensors()]
        self.v = [torch.zeros_like(p) for p in st.P.tensors()]
        self.step_host = 0  # steps done (the host's copy, advanced as segments are launched)
        self.step_t = torch.zeros((), dtype=torch.int64, device=dev)
        self.pos_t = torch.zeros(1, dtype=torch.int64, device=dev)  # position in the segment buffers
        self._runs_changed()

    # ------------------------------------------------------------------ per-stack buffers
    def _runs_changed(self) -> None:
        """(Re)build the per-run buffers for the stack's active runs (after start or a drop)."""
        st, dev, b = self.st, self.st.device, self.b
        act = st.act
        Ts = [st.Ts[r] for r in act]
        self.full = [st.sampler.full[r] for r in act]
        R = len(act)
        self.R = R
        self.runs_t = st.act_t.clone()
        T_t = torch.tensor(Ts, dtype=torch.int64, device=dev).view(-1, 1)
        # Batches per epoch; full-batch runs never change epoch (their batch is the whole set).
        nb = [-(-T // b) if not f else 1 << 40 for T, f in zip(Ts, self.full)]
        self.nb_host = nb
        self.nb_t = torch.tensor(nb, dtype=torch.int64, device=dev).view(-1, 1)
        self.T_t = T_t
        self.full_t = torch.tensor(self.full, device=dev).view(-1, 1)
        self.ar = torch.arange(b, device=dev).view(1, -1)
        self.full_idx = self.ar % T_t
        # Epochs a segment can touch: at most (segment - 1) // nb + 2 per run.
        self.E = max([(self.segment - 1) // n + 2 for n, f in zip(nb, self.full) if not f] or [1])
        self.Tmax = st.sampler.Tmax
        self.perm = torch.zeros((R, self.E * self.Tmax), dtype=torch.int64, device=dev)
        self.epoch0 = torch.zeros((R, 1), dtype=torch.int64, device=dev)
        self.step_size = torch.zeros((R, self.segment), dtype=st.dtype, device=dev)
        self.sqrt_bc2 = torch.zeros(self.segment, dtype=st.dtype, device=dev)
        # Adam in one sweep per tensor where that gives the foreach passes' bits (optim.py).
        self.fused_adam = fused_adam_variant(st.P.tensors()) if dev.type == "cpu" else None
        # The step's gradients in one call (fused_step): None until the first step decides,
        # False where they go through autograd, else (verdict key, plan).
        self.fused = None
        self.graph = None

    def select(self, keep: List[int]) -> None:
        """Keep the active runs at positions ``keep`` (their weights and Adam state)."""
        keep_t = torch.tensor(keep, device=self.st.device, dtype=torch.long)
        self.m = [m[keep_t].contiguous() for m in self.m]
        self.v = [v[keep_t].contiguous() for v in self.v]
        self.st.drop(keep)
        self._runs_changed()

    def _fill_segment(self, s0: int, length: int) -> None:
        """Write the buffers for steps s0 .. s0 + length - 1 (host work, no device read)."""
        st, dev = self.st, self.st.device
        host: Dict[str, Tensor] = {}
        # Epoch orders: the epochs each run's steps of this segment fall in.
        e0 = []
        for i, r in enumerate(st.act):
            if self.full[i]:
                e0.append(0)
                continue
            first, last = s0 // self.nb_host[i], (s0 + length - 1) // self.nb_host[i]
            e0.append(first)
            perms = data_mod.epoch_permutations(st.cfgs[r].seed, first, last - first + 1, st.Ts[r], self.Tmax, dev)
            self.perm[i, : perms.numel()].copy_(perms.view(-1))
        host["epoch0"] = torch.tensor(e0, dtype=torch.int64).view(-1, 1)
        # Step sizes lr / (1 - b1^t) per run and step and sqrt(1 - b2^t) per step, in float64 on
        # the host with BatchedAdam's expressions, then rounded once to the parameters' dtype.
        ts = range(s0 + 1, s0 + length + 1)
        bc1 = torch.tensor([1 - self.b1**t for t in ts], dtype=torch.float64)
        lr = torch.tensor(
            [[self.lr0 * lr_factor(s, st.totals[r], self.warmup) for s in range(s0, s0 + length)] for r in st.act],
            dtype=torch.float64,
        )
        ss = torch.zeros((self.R, self.segment), dtype=torch.float64)
        ss[:, :length] = lr / bc1
        host["step_size"] = ss.to(st.dtype)
        sb = torch.ones(self.segment, dtype=torch.float64)
        sb[:length] = torch.tensor([math.sqrt(1 - self.b2**t) for t in ts], dtype=torch.float64)
        host["sqrt_bc2"] = sb.to(st.dtype)
        for name, t in host.items():
            if dev.type == "cuda":
                t = t.pin_memory()  # an asynchronous copy: the host does not wait for the device
            getattr(self, name).copy_(t, non_blocking=True)
        self.pos_t.zero_()
        self.step_t.fill_(s0)

    # ------------------------------------------------------------------ the step
    def _indices(self, s: Tensor) -> Tuple[Tensor, Tensor]:
        """Example indices (K, R, b) and 0/1 weights (K, R, b) of the batches of steps ``s``
        (K, 1, 1) of this segment, on the device."""
        b, ar = self.b, self.ar
        e = torch.div(s, self.nb_t, rounding_mode="floor")
        start = (s - e * self.nb_t) * b
        valid = ar < torch.minimum(self.T_t - start, torch.full_like(start, b))
        # Slots past a partial batch read the batch's first example, weighted 0 (as _Sampler).
        pos = torch.where(valid, start + ar, start)
        flat = (e - self.epoch0) * self.Tmax + pos
        perm = self.perm.expand(flat.shape[0], -1, -1)
        idx = torch.where(self.full_t, self.full_idx, perm.gather(2, torch.where(self.full_t, 0, flat)))
        valid = torch.where(self.full_t, ar < self.T_t, valid)
        return idx, valid.to(torch.float32)

    def _autograd_grads(self, q: Tensor, c: Tensor, y: Tensor, w: Tensor) -> Sequence[Tensor]:
        """The weights' gradients of the runs' summed weighted-mean losses on batch (q, c, y, w)."""
        st = self.st
        per = _per_run_loss(st.logits(st.P, q, c), y, self.task)
        loss = (per * w).sum(1) / w.sum(1)
        return torch.autograd.grad(loss.sum(), st.P.tensors())

    def _grads(self, q: Tensor, c: Tensor, y: Tensor, w: Tensor) -> Sequence[Tensor]:
        """:meth:`_autograd_grads`, in one operator call where that gives the same bits
        (fused_step: the step's fixed cost on the CPU)."""
        st = self.st
        if self.fused is not False and products.enabled():
            if self.fused is None:
                c0 = st.c0
                the_plan = None
                # Only the trainer's own forward (a caller may have put another in st.logits).
                if (c0.impl == "fused" and st.layout == "rows" and self.task == "classify" and not self.capture
                        and "logits" not in vars(st)):
                    the_plan = fused_step.plan(st.P, q, c, st.pe, c0.backend)
                self.fused = False if the_plan is None else (fused_step.key_of(st.P, q, c, the_plan), the_plan)
            if self.fused:
                key, the_plan = self.fused
                if fused_step.known(key):
                    return fused_step.grads(st.P, q, c, y, w, st.pe, the_plan)
                ref = self._autograd_grads(q, c, y, w)
                if not fused_step.verified(key, ref, lambda: fused_step.grads(st.P, q, c, y, w, st.pe, the_plan)):
                    self.fused = False
                return ref
        return self._autograd_grads(q, c, y, w)

    def _block_indices(self, s0: int, k: int) -> Tuple[Tensor, Tensor]:
        """:meth:`_indices` of steps s0 .. s0 + k - 1 at once (eager steps: a dozen small ops a
        block instead of a step; about 1.5% of a step at the paper's shape)."""
        return self._indices(torch.arange(s0, s0 + k, device=self.st.device).view(-1, 1, 1))

    def _step(self, idx: Optional[Tensor] = None, w: Optional[Tensor] = None) -> None:
        """One training step of every active run; reads nothing back to the host. ``idx``, ``w``:
        this step's batch (from :meth:`_block_indices`), else computed from the step counter."""
        st = self.st
        params = st.P.tensors()
        if idx is None:
            idx, w = self._indices(self.step_t.view(1, 1, 1))
            idx, w = idx[0], w[0]
        runs = None if len(st.act) == len(st.cfgs) else self.runs_t
        q, c, y = st.data.batch(idx, runs)
        grads = self._grads(q, c, y, w)
        with torch.no_grad():
            ss = self.step_size.index_select(1, self.pos_t)
            sb = self.sqrt_bc2.index_select(0, self.pos_t)
            if self.fused_adam is None:
                adam_foreach(params, grads, self.m, self.v, sb, ss, self.b1, self.b2, self.eps)
            else:
                adam_fused(params, grads, self.m, self.v, sb, ss, self.b1, self.b2, self.eps, self.fused_adam)
            self.step_t += 1
            self.pos_t += 1

    def _capture(self) -> None:
        """Record :meth:`_step` as a CUDA graph (warm-up first, with the state restored)."""
        state = self.st.P.tensors() + self.m + self.v + [self.step_t, self.pos_t]
        saved = [t.detach().clone() for t in state]
        side = torch.cuda.Stream(self.st.device)
        side.wait_stream(torch.cuda.current_stream(self.st.device))
        with torch.cuda.stream(side):
            for _ in range(3):  # kernels selected, Triton compiled, cuBLAS workspaces made
                self._step()
        torch.cuda.current_stream(self.st.device).wait_stream(side)
        with torch.no_grad():
            for t, s in zip(state, saved):
                t.copy_(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            self._step()
        self.graph = g

    def run(self, steps: int) -> None:
        """Run ``steps`` training steps (any number; segments are cut internally)."""
        while steps > 0:
            n = min(steps, self.segment)
            self._fill_segment(self.step_host, n)
            if self.capture and self.graph is None:
                self._capture()
            if self.graph is not None:
                for _ in range(n):
                    self.graph.replay()
            else:
                # Eager steps take their batches from blocks of steps (at most about 2^20 indices).
                k = max(1, (1 << 20) // (self.R * self.b))
                for i0 in range(0, n, k):
                    idx, w = self._block_indices(self.step_host + i0, min(k, n - i0))
                    for i in range(idx.shape[0]):
                        self._step(idx[i], w[i])
            self.step_host += n
            steps -= n


def stack_rate(configs: Sequence[RunConfig], device="cpu", seconds: float = 1.0, data_max_bytes: int = 2 << 30,
               layout: str = "rows") -> float:
    """Run-steps per second of ``configs`` trained as one stack through :class:`StepEngine`,
    timed for about ``seconds`` after its first steps (the CUDA graph capture on CUDA); the
    stack is freed after. What the trainer's speed projections are made of."""
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    st = _Stack(list(configs), device, layout, data_max_bytes)
    eng = StepEngine(st)
    eng.run(3)
    sync()
    k, done, t0 = 8, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        eng.run(k)
        sync()
        done += k
        k = min(2 * k, 4096)
    rate = done * len(configs) / (time.perf_counter() - t0)
    del st, eng
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rate


def max_stack_runs(configs: Sequence[RunConfig], device="cpu", free_bytes: Optional[int] = None,
                   reserve: float = 0.15, data_max_bytes: int = 2 << 30) -> int:
    """How many runs of ``configs``' stack shape fit the device's memory at once (>= 1).

    ``free_bytes`` defaults to ``torch.cuda.mem_get_info`` on CUDA and the available physical
    memory on the CPU; ``reserve`` of it is left for the allocator's slack, the evaluation chunks
    (which size themselves to what is left) and other users. A stack keeps its tasks in memory
    while they total at most ``data_max_bytes`` (``TaskData``'s rule) and generates batches on the
    device beyond that, so the answer is the larger of the stacks that fit either way; the per-run
    footprints are :func:`run_footprint_bytes` of the padded stack shape.
    """
    device = torch.device(device)
    if free_bytes is None:
        if device.type == "cuda":
            free_bytes = torch.cuda.mem_get_info(device)[0]
        else:
            import os

            free_bytes = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    budget = int(free_bytes * (1 - reserve))
    store = task_bytes(configs)
    stored = min(budget // run_footprint_bytes(configs, stored=True), data_max_bytes // max(1, store))
    generated = budget // run_footprint_bytes(configs, stored=False)
    best = max(stored, generated) if generated * store > data_max_bytes else stored
    return max(1, best)


def task_bytes(configs: Sequence[RunConfig]) -> int:
    """Bytes of one run's stored task (tokens and labels) at the stack's largest T."""
    c0 = configs[0]
    es = torch.finfo(torch_dtype(c0.dtype)).bits // 8
    tok = c0.din if c0.data == "shared" else (c0.context + 1) * c0.din
    return max(c.T for c in configs) * (tok + 1) * es


def run_footprint_bytes(configs: Sequence[RunConfig], stored: bool = True) -> int:
    """Bytes one run of ``configs``' padded stack shape holds during training (an upper
    estimate): parameters with their gradients, Adam moments and update temporaries (6 copies),
    its stored task (``stored``; else batches are generated on the device), one step's
    activations and their gradients (the counter hash's int64 temporaries included), and the
    engine's epoch-order buffer."""
    c0 = configs[0]
    sh = stack_shape(configs)
    es = torch.finfo(torch_dtype(c0.dtype)).bits // 8
    H, n, d, di, C = sh.heads, sh.context, sh.d_model, sh.d_in, sh.n_out
    Tmax = max(c.T for c in configs)
    b = min(c0.batch, Tmax)
    params = 6 * sh.n_params() * es
    tok = di if c0.data == "shared" else (n + 1) * di
    # Activations per example: generated tokens (with ~5 int64 hash temporaries each), the
    # embedded context and its gradient, folded queries, attention outputs, scores and
    # probabilities (eager) and their gradients, head outputs, logits.
    gen = tok * (es + 5 * 8)
    act = gen + es * (3 * n * d + 6 * H * d + 4 * H * n + 4 * H * sh.d_value + 4 * d + 4 * C)
    perms = (512 * b + 2 * Tmax) * 8
    return params + (task_bytes(configs) if stored else 0) + b * act + perms


def train_stack(
    configs: Sequence[RunConfig],
    device="cpu",
    progress: bool = True,
    on_result: Optional[Callable[[RunResult], None]] = None,
    layout: str = "rows",
    data_max_bytes: int = 2 << 30,
    desc: Optional[str] = None,
    engine: bool = True,
    free_bytes: Optional[int] = None,
) -> List[RunResult]:
    """Train ``configs`` (same :meth:`RunConfig.stack_key`) as one stack; return their results.

    ``on_result`` is called as each run finishes (before the others do), so that a caller can
    store it at once. The results come back in the order of ``configs``.

    ``engine`` (default) runs the steps between evaluations through :class:`StepEngine` (one
    CUDA graph per step on CUDA, the same step eagerly on the CPU, no host sync between
    evaluations); ``engine=False`` is the plain per-step loop (:meth:`_Stack.train_step`), kept
    as the engine's reference: both give the same numbers on the CPU. On CUDA a stack larger than
    the device's memory holds (:func:`max_stack_runs`, ``free_bytes`` to fake the free memory)
    is trained as consecutive sub-stacks.
    """
    if not configs:
        return []
    configs = [c.validate() for c in configs]
    k0 = configs[0].stack_key()
    for c in configs[1:]:
        if c.stack_key() != k0:
            raise ValueError(
                "train_stack: configurations differ in more than their seed; they cannot share a stack "
                "(RunConfig.stack_key)"
            )
    device = torch.device(device)
    if device.type == "cuda" or free_bytes is not None:
        fit = max_stack_runs(configs, device, free_bytes, data_max_bytes=data_max_bytes)
        if len(configs) > fit:
            out: List[RunResult] = []
            for i in range(0, len(configs), fit):
                out += train_stack(configs[i : i + fit], device, progress, on_result, layout, data_max_bytes, desc,
                                   engine, free_bytes)
            return out
    t_start = time.perf_counter()
    backend_used = resolve_backend(configs[0], device)
    dev_name = device_name(device)
    st = _Stack(configs, device, layout, data_max_bytes)
    c0 = configs[0]
    R = len(configs)
    results: List[Optional[RunResult]] = [None] * R
    best = [(math.inf, 0.0) for _ in range(R)]  # (lowest loss, its accuracy)
    snap: Dict[int, Dict[str, Tensor]] = {}  # kept checkpoint's weights of runs with analysis
    top_acc = [0.0] * R
    hist: List[List[Tuple[int, float, float]]] = [[] for _ in range(R)]
    max_total = max(st.totals)
    bar = None
    if progress:
        label = desc or stack_label(configs)
        bar = progress_bar(total=max_total, desc=label, unit="step", leave=False, mininterval=0.5, dynamic_ncols=True)
    eng = StepEngine(st) if engine else None
    t_loop = time.perf_counter()
    last_acc = None
    try:
        step = 0
        while st.act:
            if eng is not None:
                # Steps up to the next evaluation point or the next run's last step, launched
                # without reading anything back.
                nxt = next_boundary(step, c0.eval_every, [st.totals[r] for r in st.act])
                eng.run(nxt - step)
                if bar is not None:
                    bar.update(nxt - step)
                step = nxt
            else:
                st.train_step(step)
                step += 1
                if bar is not None:
                    bar.update(1)
            # The paper evaluates after its 0-based step s when s % eval_every == 0, i.e. after
            # 1, 1 + eval_every, ... updates, and never after its last step; eval_last adds an
            # evaluation there (the runs of a stack share it: they share their configuration).
            at_eval = (step - 1) % c0.eval_every == 0 or (c0.eval_last and any(st.totals[r] == step for r in st.act))
            ending = [i for i, r in enumerate(st.act) if st.totals[r] == step]
            if not at_eval and not ending:
                continue
            sel = list(range(len(st.act))) if at_eval else []
            accs, losses = st.evaluate(sel) if sel else ([], [])
            evaluated = dict(zip(sel, zip(accs, losses)))
            done = []
            for i in sorted(set(sel) | set(ending)):
                r = st.act[i]
                if i in evaluated:
                    acc, ls = evaluated[i]
                    hist[r].append((step, acc, ls))
                    top_acc[r] = max(top_acc[r], acc)
                    hit = configs[r].stops_early and acc >= configs[r].target_acc
                    if ls < best[r][0]:
                        # The paper's checkpoint rule: the lowest loss so far is kept.
                        best[r] = (ls, acc)
                        if configs[r].analysis:
                            snap[r] = {k: v.detach()[i].clone() for k, v in st.P.t.items()}
                else:  # the budget ends between evaluation points: the last evaluation stands
                    hit, acc = False, hist[r][-1][1]
                if hit or st.totals[r] == step:
                    done.append(i)
                    now = time.perf_counter()
                    res = RunResult(
                        config=configs[r],
                        mem_acc=best[r][1],
                        best_acc=top_acc[r],
                        final_acc=acc,
                        loss=best[r][0],
                        steps_done=step,
                        stopped_early=hit and step < st.totals[r],
                        wall_s=now - t_start,
                        steps_per_s=step / max(1e-9, now - t_loop),
                        stack_size=R,
                        backend_used=backend_used,
                        device=dev_name,
                        history=hist[r],
                        analysis=_saturation(st, r, snap.pop(r)) if r in snap else None,
                    )
                    results[r] = res
                    if on_result is not None:
                        on_result(res)
            if accs:
                last_acc = sum(accs) / len(accs)
            if done:
                keep = [i for i in range(len(st.act)) if i not in done]
                if keep:
                    if eng is not None:
                        eng.select(keep)
                    else:
                        st.drop(keep)
                else:
                    st.act = []
            if bar is not None:
                bar.set_postfix(runs=len(st.act), acc=f"{last_acc or 0:.3f}", refresh=False)
    finally:
        if bar is not None:
            bar.close()
    return results  # type: ignore[return-value]


def next_boundary(step: int, eval_every: int, totals: Sequence[int]) -> int:
    """The first step count after ``step`` at which the loop must look at the runs: after an
    evaluation step (1, 1 + eval_every, ...) or a run's last step."""
    e = -(-step // eval_every) * eval_every + 1  # the first 1 + k eval_every > step
    if e <= step:
        e += eval_every
    return min([e] + [t for t in totals if t > step])


def run_one(cfg: RunConfig, device="cpu", progress: bool = False, **kw) -> RunResult:
    """Train a single configuration (a stack of one)."""
    return train_stack([cfg], device=device, progress=progress, **kw)[0]
