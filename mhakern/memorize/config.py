"""The configuration of one memorization run, its validation and its identity in the store.

A :class:`RunConfig` holds everything that decides a run's result. Two configurations with the
same :meth:`RunConfig.key` are the same run: the store keeps one row per key, and sweeps skip
keys already stored. Fields that only change speed (progress bars, the attention call layout,
the stack a run was trained in) are not part of the configuration.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any, Dict, Optional

#: Choices of the categorical fields, as the command line accepts them.
DATA_KINDS = ("random", "shared")
DISTS = ("uniform", "gaussian")
TASKS = ("classify", "regress")
IMPLS = ("fused", "eager", "paper")
DTYPES = ("float32", "float64", "bfloat16", "float16")
INITS = ("paper", "xavier-proj")
#: Regression rules: "mse" as the paper's code (train the whole budget, keep the lowest-MSE
#: checkpoint, report its MSE); "tol" counts an example memorized when |y_hat - y| < reg_tol and
#: may stop early at the target accuracy.
REG_RULES = ("mse", "tol")

# The paper's step rule: max(floor(500 T / batch), 50,000) steps (its main.py rounds down).
PAPER_EPOCHS = 500
PAPER_MIN_STEPS = 50_000

# Bumped when a change of the trainer would change the results of an unchanged configuration,
# so that old rows are not mistaken for new ones.
# 2: the paper's initialisation, batching (last partial batch kept), evaluation points, step rule
#    and checkpoint rule became the defaults.
# 3: no evaluation after the last step unless eval_last (the paper's evaluation points); a stack
#    holds runs of one shape and one T only (a run's numbers no longer depend on its stack).
SCHEMA_VERSION = 3


class ConfigError(ValueError):
    """Bad user input. ``flag`` names the command-line flag (e.g. ``--heads``) at fault."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")
        self.flag = flag
        self.message = message


@dataclass(frozen=True)
class RunConfig:
    """One training run of the paper's single-layer attention model on a random task.

    Shapes: each example is a query token and ``context`` context tokens of dim ``d_in``;
    ``heads`` heads of query/key dim ``d_head`` and value dim ``d_value`` over model dim
    ``d_model``. ``d_in`` and ``d_head`` default (None) to ``d_model``, as in the paper.

    ``steps=None`` means the paper's rule ``max(floor(500 T / batch), min_steps)``.
    ``impl`` picks the model's implementation: ``fused`` (folded, on ``mhakern.attention`` with
    ``backend``), ``eager`` (folded, attention in eager PyTorch) or ``paper`` (per-head K and V
    of every token, full (n+1) x (n+1) attention, as the paper's code computes it).

    What is kept and reported follows the paper's code: the training set is evaluated after
    steps 1, 1 + eval_every, 1 + 2 eval_every, ... (its ``step % 500 == 0`` on 0-based steps)
    and not after the last step (``eval_last`` adds that evaluation, which the paper's code
    never makes: at a small budget it can turn a run into "memorized"); the kept checkpoint is the lowest-loss evaluation and ``mem_acc`` is its
    accuracy; ``early_stop`` ends a run at the first evaluation whose accuracy reaches
    ``target_acc`` (the paper: 100%). Regression (``task="regress"``) follows ``reg_rule``: "mse"
    (the paper: no early stop, the kept checkpoint's MSE is the result; ``mem_acc`` is reported
    as the fraction within ``reg_tol`` for information only) or "tol" (an example within
    ``reg_tol`` counts as memorized, and the run may stop early). ``init`` names the
    initialisation (``model.INITS``); ``analysis`` adds the paper's softmax-saturation analysis of
    the kept checkpoint to the result.
    """

    heads: int = 1
    context: int = 8
    d_model: int = 64
    d_in: Optional[int] = None
    d_head: Optional[int] = None
    d_value: int = 1
    T: int = 1000
    data: str = "random"
    dist: str = "uniform"
    task: str = "classify"
    classes: int = 100
    seed: int = 0
    steps: Optional[int] = None
    min_steps: int = PAPER_MIN_STEPS
    batch: int = 256
    lr: float = 1e-3
    warmup: float = 0.05
    eval_every: int = 500
    eval_last: bool = False
    target_acc: float = 1.0
    reg_tol: float = 0.01
    reg_rule: str = "mse"
    early_stop: bool = True
    init: str = "paper"
    analysis: bool = False
    impl: str = "fused"
    backend: str = "auto"
    dtype: str = "float32"

    # ------------------------------------------------------------------ derived values
    @property
    def din(self) -> int:
        return self.d_model if self.d_in is None else self.d_in

    @property
    def dh(self) -> int:
        return self.d_model if self.d_head is None else self.d_head

    @property
    def n_out(self) -> int:
        """Width of the decoder's output: the classes, or 1 for regression."""
        return self.classes if self.task == "classify" else 1

    @property
    def total_steps(self) -> int:
        if self.steps is not None:
            return self.steps
        return max((PAPER_EPOCHS * self.T) // self.batch, self.min_steps)

    def resolved(self) -> "RunConfig":
        """The same run with defaults made explicit (d_in, d_head, steps): what the key hashes."""
        return dataclasses.replace(self, d_in=self.din, d_head=self.dh, steps=self.total_steps)

    def shape_key(self) -> tuple:
        """Everything but the seed, T and the step budget (which follows T): the configuration
        of a grid point of a sweep over T."""
        r = self.resolved()
        d = dataclasses.asdict(r)
        for f in ("seed", "T", "steps", "min_steps"):
            d.pop(f)
        return tuple(sorted(d.items()))

    def stack_key(self) -> tuple:
        """Runs with equal stack keys share a stack: they differ in their seed only.

        That is what keeps a run's numbers independent of its stack, bit for bit (on the CPU):
        every tensor of the stacked step is a run's own tensor with a leading run dim, of the
        same shape as alone, so each matmul, kernel call and reduction of a run sees the same
        operands in the same order. Mixing shapes or sizes breaks that: zero-padded heads
        (mixed H, d_h or d_v) change the length of the reductions over heads, and a run whose
        T is below the batch, stacked beside a larger T, trains on zero-weighted padded batch
        slots, which change the length of the reductions over the batch; both round
        differently (measured up to 3.5e-4 relative in the stored loss after 2,000 steps).
        """
        r = self.resolved()
        d = dataclasses.asdict(r)
        d.pop("seed")
        return tuple(sorted(d.items()))

    def as_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self.resolved())

    def key(self) -> str:
        """Stable identity of the run: a hash of the resolved configuration."""
        d = self.as_dict()
        d.pop("min_steps")  # folded into steps
        if d["impl"] != "fused":
            d["backend"] = None  # the backend does not serve eager or paper-form models
        if d["task"] != "classify":
            d["classes"] = None
        else:
            d["reg_tol"] = d["reg_rule"] = None
        d["schema"] = SCHEMA_VERSION
        blob = json.dumps(d, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:24]

    def label(self) -> str:
        """Short human description for progress bars and logs."""
        s = f"H={self.heads} n={self.context} d={self.d_model}"
        if self.dh != self.d_model:
            s += f" dh={self.dh}"
        if self.d_value != 1:
            s += f" dv={self.d_value}"
        s += f" {self.data}"
        if self.task != "classify":
            s += f" {self.task}"
        if self.init != "paper":
            s += f" init={self.init}"
        return s

    @property
    def stops_early(self) -> bool:
        """Whether reaching ``target_acc`` ends the run (never for paper-rule regression)."""
        return self.early_stop and not (self.task == "regress" and self.reg_rule == "mse")

    # ------------------------------------------------------------------ validation
    def validate(self) -> "RunConfig":
        """Raise :class:`ConfigError` (naming the flag) for anything that cannot run."""
        pos = {
            "--heads": self.heads,
            "--context": self.context,
            "--d-model": self.d_model,
            "--d-value": self.d_value,
            "--T": self.T,
            "--batch": self.batch,
            "--eval-every": self.eval_every,
        }
        for flag, v in pos.items():
            _positive_int(flag, v)
        if self.d_in is not None:
            _positive_int("--d-in", self.d_in)
        if self.d_head is not None:
            _positive_int("--d-head", self.d_head)
        if self.steps is not None:
            _positive_int("--steps", self.steps)
        _positive_int("--min-steps", self.min_steps)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**31:
            raise ConfigError("--seeds", f"seeds must be integers in [0, 2^31), got {self.seed!r}")
        _choice("--data", self.data, DATA_KINDS)
        _choice("--dist", self.dist, DISTS)
        _choice("--task", self.task, TASKS)
        _choice("--impl", self.impl, IMPLS)
        _choice("--dtype", self.dtype, DTYPES)
        _choice("--init", self.init, INITS)
        _choice("--reg-rule", self.reg_rule, REG_RULES)
        for flag, v in (("--early-stop", self.early_stop), ("--analysis", self.analysis), ("--eval-last", self.eval_last)):
            if not isinstance(v, bool):
                raise ConfigError(flag, f"must be true or false, got {v!r}")
        if self.task == "classify":
            if not isinstance(self.classes, int) or self.classes < 2:
                raise ConfigError("--classes", f"must be an integer >= 2, got {self.classes!r}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError("--lr", f"must be a positive number, got {self.lr!r}")
        if not (isinstance(self.warmup, (int, float)) and 0 <= self.warmup < 1):
            raise ConfigError("--warmup", f"must be a fraction in [0, 1), got {self.warmup!r}")
        if not (isinstance(self.target_acc, (int, float)) and 0 < self.target_acc <= 1):
            raise ConfigError("--target-acc", f"must lie in (0, 1], got {self.target_acc!r}")
        if not (isinstance(self.reg_tol, (int, float)) and self.reg_tol > 0):
            raise ConfigError("--reg-tol", f"must be a positive number, got {self.reg_tol!r}")
        if not isinstance(self.backend, str) or not self.backend:
            raise ConfigError("--backend", f"must be 'auto' or a backend name, got {self.backend!r}")
        return self


def _positive_int(flag: str, v) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ConfigError(flag, f"must be a positive integer, got {v!r}")


def _choice(flag: str, v, choices) -> None:
    if v not in choices:
        raise ConfigError(flag, f"must be one of {', '.join(choices)}; got {v!r}")


CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(RunConfig))


def from_dict(d: Dict[str, Any]) -> RunConfig:
    """A RunConfig from a dict (e.g. a stored row's JSON), ignoring unknown keys."""
    return RunConfig(**{k: v for k, v in d.items() if k in CONFIG_FIELDS})
