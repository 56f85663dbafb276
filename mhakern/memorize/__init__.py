"""mhakern.memorize: the memorization-capacity experiments, on mhakern's attention kernels.

Reproduces "Memorization Capacity of Multi-Head Attention in Transformers" (Mahdavi, Liao,
Thrampoulidis, ICLR 2024) -- how many random (context, query) -> label examples a one-layer
multi-head attention model memorizes as heads H, context n and head dim d_h grow -- and the
associative-memory view of linear maps, MLPs and attention as key-value stores.

Entry points: the command line ``mhakern-memorize`` (``python -m mhakern.memorize``), or
:func:`run_one` / :func:`train_stack` (training), :func:`sweep.run_sweep`,
:func:`capacity.find_capacity`, :mod:`stores` and :mod:`report` from Python. docs/trainer.md
describes the design; docs/memory_stores.md derives the stores' interference formulas.
"""
from .config import ConfigError, RunConfig
from .train import RunResult, run_one, train_stack

__all__ = ["ConfigError", "RunConfig", "RunResult", "run_one", "train_stack"]
