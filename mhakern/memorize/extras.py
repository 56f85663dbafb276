"""The trainer's optional packages, each installed by an extra of mhakern (pyproject.toml).

``trainer``: tqdm (progress bars) and matplotlib (the report's figures). The trainer runs
without them, as a library install leaves it: plain log lines instead of bars (what
``--no-progress`` prints), and reports with their tables, fits and CSV files but no figures.
The first time a missing package is wanted, one line on stderr names it and the extra.
``ray`` (sweeps across processes and machines) is needed only where asked for, and its absence
is an error (sweep.RAY_MISSING).
"""
from __future__ import annotations

import sys

TRAINER = "trainer"

_said: set = set()


def install_hint(extra: str) -> str:
    """How to install mhakern's ``extra``, installed from a package index or from a checkout."""
    return f'pip install "mhakern[{extra}]" (in a checkout: pip install -e ".[{extra}]")'


def missing_line(package: str, what: str, instead: str) -> str:
    """The one line said when ``package`` (needed for ``what``) is missing; ``instead``: what
    the trainer does without it."""
    return f"mhakern.memorize: {what} need {package}, which is not installed; {instead}. " \
           f"Install the {TRAINER!r} extra: {install_hint(TRAINER)}"


def _say_once(package: str, what: str, instead: str) -> None:
    if package not in _said:
        _said.add(package)
        print(missing_line(package, what, instead), file=sys.stderr, flush=True)


def tqdm_class():
    """``tqdm.auto.tqdm``, or None (said once) when tqdm is not installed."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        _say_once("tqdm", "progress bars", "running without them")
        return None
    return tqdm


def progress_bar(**kwargs):
    """A tqdm bar made with ``kwargs``, or None when tqdm is not installed (callers treat None
    as "no bar", as with progress=False)."""
    tqdm = tqdm_class()
    return None if tqdm is None else tqdm(**kwargs)


def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend (files only, no display needed),
    or None (said once) when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        _say_once("matplotlib", "the report's figures", "writing the tables and CSV files without them")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
