"""Backend registry and dispatch.

A backend implements the raw contract of GUIDE.md section 3 on tensors in logical
(B, H, L, D) layout with unit stride on the last dim:

* ``forward(q, k, v, scale, causal, key_lengths) -> (out, lse)``
* ``backward(dout, q, k, v, out, lse, scale, causal, key_lengths) -> (dq, dk, dv)``
* ``unavailable() -> None | str``: None when the backend can run at all in this process,
  otherwise why not (missing library, no device, failed build).
* ``supports(q, k, v, causal, key_lengths) -> None | str``: None when it can serve these
  tensors, otherwise the reason. Dispatch never guesses: ``auto`` takes the highest-priority
  backend whose answer is None, and a backend named explicitly that answers with a reason
  raises ValueError carrying it.

``key_lengths`` reaches a backend already validated: int32, on the tensors' device, shape (B,),
values in [0, Lk]. ``scale`` is a float. The tensors reaching ``supports`` are real or fake
(meta) tensors, so ``supports`` looks only at shapes, strides, dtypes and devices.
"""
from __future__ import annotations

import importlib
from typing import Dict, List, Optional, Tuple

import torch

Tensor = torch.Tensor


class Backend:
    """Base class of a backend; subclasses override what they provide."""

    #: Registry name, as passed to ``mhakern.attention(backend=...)``.
    name: str = ""
    #: ``auto`` prefers higher numbers.
    priority: int = 0
    #: Whether ``auto`` may pick it (the Triton interpreter may run, but is never fast).
    auto: bool = True

    def unavailable(self) -> Optional[str]:
        return None

    def supports(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_lengths: Optional[Tensor]) -> Optional[str]:
        return None

    def auto_supports(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_lengths: Optional[Tensor]) -> Optional[str]:
        """Like :meth:`supports`, with the extra reasons for which ``auto`` should not pick it."""
        return self.supports(q, k, v, causal, key_lengths)

    def forward(self, q, k, v, scale, causal, key_lengths) -> Tuple[Tensor, Tensor]:
        raise NotImplementedError

    def backward(self, dout, q, k, v, out, lse, scale, causal, key_lengths) -> Tuple[Tensor, Tensor, Tensor]:
        raise NotImplementedError


_REGISTRY: Dict[str, Backend] = {}
# Modules that register the built-in backends, imported on first use of the registry so that
# ``import mhakern`` stays cheap and touches no device.
_BUILTIN = (
    "mhakern.backends.reference_backend",
    "mhakern.backends.triton_backend",
    "mhakern.backends.cpu_backend",
    "mhakern.backends.cuda_backend",
)
_loaded = False


def register(backend: Backend) -> Backend:
    """Add (or replace) a backend under ``backend.name``."""
    if not backend.name:
        raise ValueError("register: backend.name must be a non-empty string")
    _REGISTRY[backend.name] = backend
    return backend


# Dynamo cannot trace importlib: under torch.compile this runs once at trace time instead, its
# (constant) result taken as is, so compiling before any eager call still fills the registry.
@torch.compiler.assume_constant_result
def _load_builtins() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for mod in _BUILTIN:
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            # A backend module not written yet (or removed) is simply absent; anything it
            # imports that is missing must be reported by the backend itself via unavailable().
            if e.name != mod:
                raise


def names() -> List[str]:
    _load_builtins()
    return sorted(_REGISTRY, key=lambda n: -_REGISTRY[n].priority)


def get(name: str) -> Backend:
    _load_builtins()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"backend: unknown backend {name!r}; choose 'auto' or one of {names()}") from None


# unavailable() may import modules (the extension, triton): under torch.compile the answers are
# computed at trace time and taken as constants, for the same reason as _load_builtins.
@torch.compiler.assume_constant_result
def available_backends() -> Dict[str, Optional[str]]:
    """Each backend's name with None (usable in this process) or the reason it is not."""
    return {n: _REGISTRY[n].unavailable() for n in names()}


def select(name: str, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_lengths: Optional[Tensor]) -> Backend:
    """Resolve ``name`` ("auto" or a backend name) to the backend that will serve these tensors."""
    usable = available_backends()
    if name != "auto":
        be = get(name)
        why = usable[name] or be.supports(q, k, v, causal, key_lengths)
        if why is not None:
            raise ValueError(f"backend={name!r} cannot serve these inputs: {name}: {why}")
        return be
    reasons = []
    for n in names():
        be = _REGISTRY[n]
        if not be.auto:
            continue
        why = usable[n] or be.auto_supports(q, k, v, causal, key_lengths)
        if why is None:
            return be
        reasons.append(f"{n}: {why}")
    raise ValueError("backend='auto': no backend can serve these inputs (" + "; ".join(reasons) + ")")
