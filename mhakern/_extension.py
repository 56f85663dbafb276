"""The compiled extension ``mhakern._C``: loaded once, on first use, by every backend that
needs it (cpu, cuda), with the reason when it cannot be; and its capability table.

Importing ``mhakern._C`` registers the ``torch.ops.mhakern_C`` operators. When the module is
missing (not built, build skipped or failed, built against another torch) nothing fails at
import: :func:`load` returns None and :func:`load_error` says why, with the install hint.
"""
from __future__ import annotations

import importlib
import json
from typing import Optional

import torch

_ext = None
_error: Optional[str] = None
_caps: Optional[dict] = None


def _hint() -> str:
    from ._build import INSTALL_HINT  # the one place the install command is written

    return (f"build it with `{INSTALL_HINT}` (torch must be importable at build time; MHAKERN_NO_EXTENSION=1 "
            "skips it, and a failed compile prints a warning in the build log)")


def load():
    """The extension module, or None (the reason in :func:`load_error`)."""
    global _ext, _error
    if _ext is None and _error is None:
        try:
            _ext = importlib.import_module("mhakern._C")
        except ImportError as e:  # not built, or built against another torch
            _error = f"mhakern._C is not available ({e}); {_hint()}"
    return _ext


def load_error() -> Optional[str]:
    """Why :func:`load` returned None (None while it has not failed)."""
    load()
    return _error


def capabilities() -> Optional[dict]:
    """What the compiled kernel families serve and what this build compiled:
    ``{"cpu": {...}, "cuda": {...}}``, mhakern/_caps.py's ``TABLE`` (csrc/capabilities.h, the one
    place it is written: dtypes, head dims, tiles, limits, features) with the build's facts at
    the key paths of ``_caps.BUILD_FACTS`` (which families were compiled, which sm90 backward
    runs now), or None when mhakern._C is not available. What needs no build reads ``_caps``."""
    global _caps
    if _caps is None and load() is not None:
        _caps = json.loads(torch.ops.mhakern_C.capabilities())
    return _caps


def kernel_isa() -> Optional[str]:
    """The instruction-set variant the cpu kernels run ('AVX512', 'AVX2', 'DEFAULT'), or None."""
    return None if load() is None else torch.ops.mhakern_C.cpu_kernel_isa()
