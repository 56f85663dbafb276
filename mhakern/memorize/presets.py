"""Named experiments: the quick demonstration, every experiment of the paper's reproduce.sh,
its three trends at a reduced scale (``trend-*``: the paper's estimand, mem_acc and examples
memorized per grid point and T), the capacity searches (``capacity-*``: a second statistic),
and the large GPU sweep.

A preset is a list of parts; each part is a sweep (a grid of configurations) or a set of
capacity searches. The paper presets follow its public code (smahdavi4/attention-memorization,
``reproduce.sh`` and ``src/main.py``): d = d_in = d_h = 64, d_v = 1, 100 classes (1 output for
regression), batch 256, Adam 1e-3, the step rule max(floor(500 T / 256), 50,000) (300,000 for
the d_h sweep and the saturation runs), the paper's initialisation, checkpoint and regression
rules (the RunConfig defaults), one seed. reproduce.sh's experiments and their presets:

* memory_regress_scale_ctx_size, ..._shared: ``paper-regress-context``
* memory_regress_scale_head, ..._shared: ``paper-regress-heads``
* memory_scale_head, ..._shared: ``paper-heads``
* memory_scale_ctx_size, ..._shared: ``paper-context``
* memory_scale_dh_shared: ``paper-dh``
* head_saturation_v3 (H = 4 and 8): ``paper-saturation``
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from .config import RunConfig


@dataclass
class Part:
    """A sweep over ``grid`` (kind "sweep") or a capacity search per grid point ("capacity")."""

    kind: str
    base: RunConfig
    grid: Dict[str, Sequence]
    target: float = 1.0
    resolution: float = 0.05  # capacity searches: bracket width at which they stop (fraction of T)
    t_start: Optional[int] = None  # capacity searches: first T (default H min(n, d_h))


@dataclass
class Preset:
    name: str
    description: str
    parts: List[Part]
    seeds: Sequence[int] = (0,)
    needs_gpu: bool = False
    est: str = ""  # rough cost, for --help and the dry run


def _k(*xs):
    return [x * 1000 for x in xs]


_PAPER = RunConfig(heads=20, context=32, d_model=64, d_in=64, d_head=64, d_value=1, classes=100, batch=256, lr=1e-3)

# The trend presets measure the paper's estimand at a reduced scale (docs/results.md section 4):
# one run per (grid point, T), its mem_acc (the kept checkpoint's training accuracy) and the
# examples memorized, mem_acc x T, with the paper's rules (the RunConfig defaults: 100 classes,
# random contexts, batch 256, Adam 1e-3 with warm-up and cosine decay, evaluation after steps
# 1, 501, ..., early stop at 100%, the lowest-loss checkpoint) and its step rule
# max(floor(500 T / 256), floor). Scale: d = d_in = 16 (the paper: 64), d_h = 16 unless swept,
# T in TREND_T (multiples of the batch, so that floor(500 T / 256) steps are exactly 500 epochs
# of ceil(T / 256) batches), the floor lowered from 50,000 to TREND_MIN_STEPS (the paper's floor
# is its 500-epoch budget near its smallest T; here it is 1,000 epochs at T = 512), 3 seeds.
TREND_T = (512, 2048)
TREND_MIN_STEPS = 2000
TREND_SEEDS = (0, 1, 2)
_TREND = RunConfig(d_model=16, context=8, steps=None, min_steps=TREND_MIN_STEPS)
# The capacity presets' scale (the second statistic, docs/results.md section 5): the same model,
# the largest T memorized at exactly 100% by bisection, in the paper's step rule with a
# 4,000-step floor.
_CAPACITY = RunConfig(d_model=16, context=8, steps=None, min_steps=4000)

PRESETS: Dict[str, Preset] = {
    "quick": Preset(
        "quick",
        "examples fitted in a fixed budget of 3,000 steps (partial fitting, not capacity) as H grows: "
        "H = 1, 2, 4, 8 at d = 16, n = 8, T = 500, 3 seeds",
        [Part("sweep", RunConfig(d_model=16, context=8, T=500, steps=3000, eval_every=500), {"heads": [1, 2, 4, 8]})],
        seeds=(0, 1, 2),
        est="about 100 s of one CPU core",
    ),
    "paper-heads": Preset(
        "paper-heads",
        "the paper's heads sweep: H in 1, 5, 10, ..., 60 at n = 32; random contexts T = 30k..130k, shared T = 10k..40k",
        [
            Part("sweep", dataclasses.replace(_PAPER, data="random"),
                 {"heads": [1, 5, 10, 20, 30, 40, 50, 60], "T": _k(30, 50, 70, 90, 110, 130)}),
            Part("sweep", dataclasses.replace(_PAPER, data="shared"),
                 {"heads": [1, 5, 10, 20, 30, 40, 50, 60], "T": _k(10, 20, 30, 40)}),
        ],
        needs_gpu=True,
        est="80 runs of 50k-250k steps: GPU days",
    ),
    "paper-context": Preset(
        "paper-context",
        "the paper's context sweep: n in 1, 5, 10, ..., 60 at H = 20; random T = 20k..60k, shared T = 6k..18k",
        [
            Part("sweep", dataclasses.replace(_PAPER, data="random"),
                 {"context": [1, 5, 10, 20, 30, 40, 50, 60], "T": _k(20, 30, 40, 50, 60)}),
            Part("sweep", dataclasses.replace(_PAPER, data="shared"),
                 {"context": [1, 5, 10, 20, 30, 40, 50, 60], "T": _k(6, 10, 14, 18)}),
        ],
        needs_gpu=True,
        est="72 runs of 50k-120k steps: GPU days",
    ),
    "paper-dh": Preset(
        "paper-dh",
        "the paper's head-dim sweep: d_h in 10, 15, ..., 60, 64 at H = 30, n = 32, shared context, 300k steps",
        [
            Part("sweep", dataclasses.replace(_PAPER, heads=30, data="shared", min_steps=300_000),
                 {"d_head": [10, 15, 20, 25, 30, 35, 40, 45, 50, 55, 60, 64], "T": _k(10, 15, 20)}),
        ],
        needs_gpu=True,
        est="36 runs of 300k steps: GPU days",
    ),
    "paper-regress-context": Preset(
        "paper-regress-context",
        "the paper's regression context sweep (MSE): n in 1, 5, 10, ..., 60 at H = 20; "
        "random T = 10k..90k, shared T = 10k..25k",
        [
            Part("sweep", dataclasses.replace(_PAPER, task="regress", data="random"),
                 {"context": [1, 5, 10, 20, 30, 40, 50, 60], "T": _k(10, 30, 50, 70, 90)}),
            Part("sweep", dataclasses.replace(_PAPER, task="regress", data="shared"),
                 {"context": [1, 5, 10, 20, 30, 40, 50, 60], "T": _k(10, 15, 20, 25)}),
        ],
        needs_gpu=True,
        est="72 runs of 50k-175k steps (no early stop): GPU days",
    ),
    "paper-regress-heads": Preset(
        "paper-regress-heads",
        "the paper's regression heads sweep (MSE): H in 1, 5, 10, ..., 60 at n = 32; "
        "random T = 10k..90k, shared T = 10k..30k",
        [
            Part("sweep", dataclasses.replace(_PAPER, task="regress", data="random"),
                 {"heads": [1, 5, 10, 20, 30, 40, 50, 60], "T": _k(10, 30, 50, 70, 90)}),
            Part("sweep", dataclasses.replace(_PAPER, task="regress", data="shared"),
                 {"heads": [1, 5, 10, 20, 30, 40, 50, 60], "T": _k(10, 15, 20, 25, 30)}),
        ],
        needs_gpu=True,
        est="80 runs of 50k-175k steps (no early stop): GPU days",
    ),
    "paper-saturation": Preset(
        "paper-saturation",
        "the paper's softmax-saturation runs: H = 4 at T = 550 and H = 8 at T = 1300, n = 32, shared context, "
        "300k steps without early stop, saturation analysis (heads with a weight > 0.99) of the kept checkpoint",
        [
            Part("sweep", dataclasses.replace(_PAPER, data="shared", min_steps=300_000, early_stop=False, analysis=True),
                 {"heads": [4], "T": [550]}),
            Part("sweep", dataclasses.replace(_PAPER, data="shared", min_steps=300_000, early_stop=False, analysis=True),
                 {"heads": [8], "T": [1300]}),
        ],
        needs_gpu=True,
        est="2 runs of 300k steps: GPU hours (CPU: about a day)",
    ),
    "large": Preset(
        "large",
        "beyond the paper: capacity (99% target) at H up to 256 and n up to 8192, past the n < d regime",
        [
            Part("capacity", dataclasses.replace(_PAPER, data="random", steps=100_000, target_acc=0.99),
                 {"heads": [64, 128, 256], "context": [64]}, target=0.99),
            Part("capacity", dataclasses.replace(_PAPER, heads=64, data="random", steps=100_000, target_acc=0.99),
                 {"context": [16, 128, 512, 1024, 4096, 8192]}, target=0.99),
        ],
        needs_gpu=True,
        est="9 capacity searches of ~10 probes of 100k steps each: GPU days",
    ),
    "trend-heads": Preset(
        "trend-heads",
        "the paper's heads trend, its estimand at a reduced scale: mem_acc and examples memorized (mem_acc x T) "
        "for H = 1, 2, 4, ..., 32 at d = d_h = 16, n = 8, T = 512 and 2,048, 500 epochs or more at every T, 3 seeds",
        [Part("sweep", _TREND, {"heads": [1, 2, 4, 8, 16, 32], "T": list(TREND_T)})],
        seeds=TREND_SEEDS,
        est="about 4 CPU-minutes (one thread)",
    ),
    "trend-context": Preset(
        "trend-context",
        "the paper's context trend, its estimand at a reduced scale: mem_acc and examples memorized for "
        "n = 1, 2, 4, ..., 32 at d = d_h = 16, T = 512 and 2,048; at H = 4 with d_v = 1, 4, 16 (the bottleneck test: "
        "the layer hands the decoder H d_v numbers) and at H = 16 with d_v = 1; 3 seeds",
        [Part("sweep", dataclasses.replace(_TREND, heads=4),
              {"d_value": [1, 4, 16], "context": [1, 2, 4, 8, 16, 32], "T": list(TREND_T)}),
         Part("sweep", dataclasses.replace(_TREND, heads=16), {"context": [1, 2, 4, 8, 16, 32], "T": list(TREND_T)})],
        seeds=TREND_SEEDS,
        est="about 11 CPU-minutes (one thread)",
    ),
    "trend-dhead": Preset(
        "trend-dhead",
        "the paper's head-dim trend, its estimand at a reduced scale: mem_acc and examples memorized for "
        "d_h = 2, 4, 8, 16 (up to n) at n = 16, d = 16, T = 512 and 2,048; at H = 4 with d_v = 1, 4, 16 and at "
        "H = 16 with d_v = 1; 3 seeds",
        [Part("sweep", dataclasses.replace(_TREND, heads=4, context=16),
              {"d_value": [1, 4, 16], "d_head": [2, 4, 8, 16], "T": list(TREND_T)}),
         Part("sweep", dataclasses.replace(_TREND, heads=16, context=16), {"d_head": [2, 4, 8, 16], "T": list(TREND_T)})],
        seeds=TREND_SEEDS,
        est="about 8 CPU-minutes (one thread)",
    ),
    "capacity-heads": Preset(
        "capacity-heads",
        "a second statistic, not the paper's: capacity (the largest T memorized at exactly 100%, by bisection) "
        "for H = 1, 2, 4, ..., 256 at d = d_h = 16, n = 8, the paper's step rule with a 4,000-step floor, 3 seeds",
        [Part("capacity", _CAPACITY, {"heads": [1, 2, 4, 8, 16, 32, 64, 128, 256]}, resolution=0.1)],
        seeds=(0, 1, 2),
        est="H <= 32: about 15 CPU-minutes; H = 64, 128, 256: CPU hours (a GPU, or Ray)",
    ),
    "capacity-context": Preset(
        "capacity-context",
        "a second statistic, not the paper's: capacity at 100% for n = 1, 2, 4, ..., 256 at H = 4, d = d_h = 16, "
        "the paper's step rule with a 4,000-step floor, 3 seeds",
        [Part("capacity", dataclasses.replace(_CAPACITY, heads=4), {"context": [1, 2, 4, 8, 16, 32, 64, 128, 256]},
              resolution=0.1)],
        seeds=(0, 1, 2),
        est="n <= 64: about 15 CPU-minutes; n = 128, 256: CPU hours",
    ),
    "capacity-dhead": Preset(
        "capacity-dhead",
        "a second statistic, not the paper's: capacity at 100% for d_h = 2, 4, 8, 16 at H = 4, n = 16, d = 16, "
        "the paper's step rule with a 4,000-step floor, 3 seeds",
        [Part("capacity", dataclasses.replace(_CAPACITY, heads=4, context=16), {"d_head": [2, 4, 8, 16]},
              resolution=0.1)],
        seeds=(0, 1, 2),
        est="about 10 CPU-minutes",
    ),
}


def get(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        from .config import ConfigError

        raise ConfigError("preset", f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None
