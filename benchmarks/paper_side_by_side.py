"""The trainer beside the paper's own code, seed by seed, on the paper's estimand.

``python benchmarks/paper_side_by_side.py [--configs h3,shared,regress,h12-t2048] [--seeds 12]``

For each named configuration (``CONFIGS``) and seed, two runs of the same experiment:

* **paper** -- the paper's code (smahdavi4/attention-memorization, its ``src`` folder named by
  ``MHAKERN_PAPER_SRC``; the project holds none of it), in a child process per run, driven as its
  ``src/main.py::run`` drives it: ``_seed_all``'s three seeds, its ``RandomTask`` and
  ``BaselineAttention``, the shuffled and the in-order ``DataLoader``, its ``Trainer.train``,
  ``load_best_checkpoint`` and ``evaluate_dataloader``. Left out: wandb (a logger whose ``log``
  does nothing), absl and ml_collections (flag parsing: the configuration is passed directly) and
  the Hugging Face packages its ``task_datasets.py`` imports for its text tasks (empty modules:
  the random task never touches them). Checkpoints go to a temporary folder.
* **mhakern** -- ``mhakern.memorize.train.train_stack`` on the same configuration, the seeds of
  one configuration stacked (a run's numbers are the same alone and in a stack, bit for bit).

The two codes draw data and weights from different generators (the same distributions, not the
same numbers), so runs are compared as samples: per configuration the mean, the range, the ratio
of the means and Welch's t. The statistic is the paper's: examples memorized (``mem_acc`` x T of
the kept checkpoint) for classification, the kept checkpoint's training MSE (``mem_loss``) for
regression, whose accuracy the paper's code does not define.

Every finished run is appended to ``--out`` (JSON lines) at once; a rerun skips what is there, so
an interrupted comparison loses at most the runs in flight. ``--jobs`` runs that many paper
children at once (one torch thread each).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, List, Optional

# The shared settings of section 1 of docs/results.md: d = d_in = 16, d_v = 1, 100 classes (one
# output for regression), batch 256, Adam 1e-3 with the paper's warm-up and cosine schedule over
# 3,000 steps, evaluation every 500 steps, early stop at 100% (classification only), the
# lowest-loss checkpoint kept.
STEPS, EVAL_EVERY, BATCH, D = 3000, 500, 256, 16


@dataclass(frozen=True)
class Side:
    heads: int
    context: int
    T: int = 500
    d_head: int = D
    data: str = "random"  # "random" contexts, or one "shared" context per run (the paper's "fixed")
    task: str = "classify"  # or "regress"


#: The configurations compared (name: shape). ``quick-hN`` are section 1's; the rest are the four
#: held-out configurations of issue 34 (docs/results.md does not tabulate them otherwise).
CONFIGS: Dict[str, Side] = {
    "quick-h1": Side(heads=1, context=8),
    "quick-h4": Side(heads=4, context=8),
    "quick-h8": Side(heads=8, context=8),
    "h3": Side(heads=3, context=8),
    "shared": Side(heads=6, context=12, d_head=6, data="shared"),
    "regress": Side(heads=4, context=8, task="regress"),
    "h12-t2048": Side(heads=12, context=8, T=2048),
}


def _statistic(side: Side, mem_acc: float, mem_loss: float) -> float:
    return mem_loss if side.task == "regress" else mem_acc * side.T


# ---------------------------------------------------------------------------- the paper's side
def _paper_child(name: str, seed: int) -> None:
    """One run of the paper's code (in its own process: its seeding is global). Prints one JSON
    line."""
    import random
    import tempfile
    import types

    import numpy as np
    import torch
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)
    src = os.environ["MHAKERN_PAPER_SRC"]
    for mod in ("datasets", "transformers", "tokenizers"):  # its text tasks' imports, unused here
        sys.modules.setdefault(mod, types.ModuleType(mod))
    sys.path.insert(0, src)
    from attn_models import BaselineAttention
    from tasks import RandomTask
    from trainers import Trainer, TrainerConfig

    s = CONFIGS[name]
    classify = s.task == "classify"
    # main.py's run(), step by step, with the configuration given directly.
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    task = RandomTask(n_dims=D, context_size=s.context, n_classes=100 if classify else 1, seed=seed,
                      dataset_size=s.T, is_classification=classify,
                      context_type="fixed" if s.data == "shared" else "random")
    model = BaselineAttention(input_dim=task.n_dims, n_classes=task.n_classes, d_model=D, dh=s.d_head,
                              num_heads=s.heads)
    data = task.get_datasets()
    train_loader = DataLoader(data["train"], batch_size=BATCH, shuffle=True)
    train_loader_test = DataLoader(data["train"], batch_size=BATCH, shuffle=False)

    class _Logger:  # wandb's run, disabled
        def log(self, *a, **k):
            pass

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mhakern-paper-") as ckpt:
        trainer = Trainer(model=model, logger=_Logger(), config=TrainerConfig(
            train_steps=STEPS, checkpoint_path=ckpt, device="cpu", task=task, validate_every_n_steps=EVAL_EVERY,
            micro_batch_accumulation=1, mixed_precision=False, early_stop=True, lr=1e-3))
        trainer.train(train_dataloader=train_loader, val_dataloader=train_loader_test)
        trainer.load_best_checkpoint()
        mem_loss, mem_acc = trainer.evaluate_dataloader(train_loader_test)
    print(json.dumps(dict(mem_acc=mem_acc, mem_loss=mem_loss, wall_s=time.perf_counter() - t0)))


def _paper_run(name: str, seed: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", name, str(seed)], env=env,
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"the paper's code, {name} seed {seed}, exited {p.returncode}:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------- mhakern's side
def _mhakern_runs(name: str, seeds: List[int]) -> List[dict]:
    import torch

    from mhakern.memorize.config import RunConfig
    from mhakern.memorize.train import train_stack

    torch.set_num_threads(1)
    s = CONFIGS[name]
    cfgs = [RunConfig(heads=s.heads, context=s.context, d_model=D, d_head=s.d_head, T=s.T, data=s.data, task=s.task,
                      steps=STEPS, eval_every=EVAL_EVERY, batch=BATCH, seed=k) for k in seeds]
    return [dict(seed=r.config.seed, mem_acc=r.mem_acc, mem_loss=r.loss, wall_s=r.wall_s)
            for r in train_stack(cfgs, device="cpu")]


# ---------------------------------------------------------------------------- the comparison
def welch_t(a: List[float], b: List[float]) -> float:
    """Welch's t of mean(a) - mean(b) (nan for fewer than two runs a side or no spread)."""
    if len(a) < 2 or len(b) < 2:
        return math.nan
    se = math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))
    return (statistics.fmean(a) - statistics.fmean(b)) / se if se > 0 else math.nan


def _load(path: str) -> List[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _append(path: str, row: dict) -> None:
    # The store's side-file append (locked, flushed and synced): a line is whole or absent.
    from mhakern.memorize.store import _append_locked

    _append_locked(path, json.dumps(row) + "\n")


def report(rows: List[dict], names: List[str]) -> str:
    out = ["| configuration | statistic | paper's code: mean (min-max), runs | mhakern: mean (min-max), runs "
           "| mhakern / paper | Welch t |", "|---|---|---|---|---|---|"]
    for name in names:
        s = CONFIGS[name]
        vals = {side: [_statistic(s, r["mem_acc"], r["mem_loss"]) for r in rows if r["config"] == name and r["side"] == side]
                for side in ("paper", "mhakern")}
        mean = {k: statistics.fmean(v) if v else math.nan for k, v in vals.items()}
        cell = {k: (f"{mean[k]:.4g} ({min(v):.4g}-{max(v):.4g}), {len(v)}" if v else "-") for k, v in vals.items()}
        ratio = mean["mhakern"] / mean["paper"] if mean["paper"] else math.nan  # nan propagates
        stat = "training MSE" if s.task == "regress" else f"examples memorized of {s.T}"
        shape = f"{name}: H {s.heads}, n {s.context}, d_h {s.d_head}, T {s.T}, {s.data}, {s.task}"
        out.append(f"| {shape} | {stat} | {cell['paper']} | {cell['mhakern']} | {ratio:.3f} "
                   f"| {welch_t(vals['mhakern'], vals['paper']):.2f} |")
    return "\n".join(out)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="h3,shared,regress,h12-t2048",
                    help="comma list of " + ", ".join(CONFIGS))
    ap.add_argument("--seeds", type=int, default=12, help="seeds 0 .. N-1 on each side")
    ap.add_argument("--side", choices=("both", "paper", "mhakern"), default="both")
    ap.add_argument("--jobs", type=int, default=1, help="paper runs at once (one thread each)")
    ap.add_argument("--out", default="paper_side_by_side.jsonl", help="the runs (JSON lines; a rerun resumes)")
    ap.add_argument("--child", nargs=2, metavar=("CONFIG", "SEED"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        _paper_child(a.child[0], int(a.child[1]))
        return 0
    names = [n for n in a.configs.split(",") if n]
    bad = [n for n in names if n not in CONFIGS]
    if bad:
        ap.error(f"--configs: unknown {', '.join(bad)}; known: {', '.join(CONFIGS)}")
    if a.side != "mhakern" and not os.environ.get("MHAKERN_PAPER_SRC"):
        ap.error("MHAKERN_PAPER_SRC must name the src folder of a smahdavi4/attention-memorization checkout")
    done = {(r["side"], r["config"], r["seed"]) for r in _load(a.out)}
    seeds = list(range(a.seeds))
    for name in names:
        if a.side in ("both", "mhakern"):
            todo = [k for k in seeds if ("mhakern", name, k) not in done]
            if todo:
                t = time.perf_counter()
                for r in _mhakern_runs(name, todo):
                    _append(a.out, dict(side="mhakern", config=name, **r))
                print(f"mhakern {name}: {len(todo)} seeds in {time.perf_counter() - t:.0f} s", flush=True)
        if a.side in ("both", "paper"):
            todo = [k for k in seeds if ("paper", name, k) not in done]
            with ThreadPoolExecutor(max(1, a.jobs)) as pool:
                for k, r in zip(todo, pool.map(lambda k: _paper_run(name, k), todo)):
                    _append(a.out, dict(side="paper", config=name, seed=k, **r))
                    print(f"paper {name} seed {k}: {r['mem_acc']:.4f} acc, {r['mem_loss']:.4g} loss, "
                          f"{r['wall_s']:.0f} s", flush=True)
    print(report(_load(a.out), names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
