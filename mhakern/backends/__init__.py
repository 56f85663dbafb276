"""Backend registry and dispatch.

A backend implements the raw contract of docs/contract.md on tensors in logical
(B, H, L, D) layout with unit stride on the last dim:

* ``forward(q, k, v, scale, causal, key_lengths, modes=DEFAULT_MODES) -> (out, lse)``
* ``backward(dout, q, k, v, out, lse, scale, causal, key_lengths, modes=DEFAULT_MODES)
  -> (dq, dk, dv, dmask)``, ``dmask`` None unless ``modes.mask_grad``
* ``features``: the optional modes (fields of :class:`mhakern.modes.Modes`) the backend implements. Dispatch
  never hands a backend a mode outside its ``features``: such a backend sees DEFAULT_MODES only.
* ``unavailable() -> None | str``: None when the backend can run at all in this process,
  otherwise why not (missing library, no device, failed build).
* ``supports(q, k, v, causal, key_lengths) -> None | str``: None when it can serve these
  tensors, otherwise the reason. Dispatch never guesses: ``auto`` takes the highest-priority
  backend whose answer is None, and a backend named explicitly that answers with a reason
  raises ValueError carrying it.

``key_lengths`` reaches a backend already validated: int32, on the tensors' device, shape (B,),
values in [0, Lk]. ``scale`` is a float. The tensors reaching ``supports`` are real or fake
(meta) tensors, so ``supports`` looks only at shapes, strides, dtypes, devices and whether a
gradient is needed (grad mode on and an input requiring grad): dispatch caches its answers per
(backend, device, dtypes, shapes, strides, causal, key_lengths given, modes needed, gradient
needed), and a backend whose answer depends on anything else must not be registered.
``unavailable()`` is asked on every selection that misses the cache; :func:`register` and
:func:`clear_dispatch_cache` empty it.

A new backend plugs in by subclassing :class:`Backend` and calling :func:`register`; the
conformance suite (tests/test_conformance.py) then runs it on every case its ``features``
allow.
"""
from __future__ import annotations

import importlib
import sys
import threading
from typing import Dict, FrozenSet, List, Optional, Tuple, Union

import torch

from .._errors import ArgumentError, FallbackError
# The call record lives in mhakern.modes; re-exported here, where backends and tests import it.
from ..modes import ALL_FEATURES, DEFAULT_MODES, Modes  # noqa: F401

Tensor = torch.Tensor


class Backend:
    """Base class of a backend; subclasses override what they provide."""

    #: Registry name, as passed to ``mhakern.attention(backend=...)``.
    name: str = ""
    #: ``auto`` prefers higher numbers.
    priority: int = 0
    #: A fallback (the plain-PyTorch reference): strict dispatch refuses to let ``auto`` pick it.
    fallback: bool = False
    #: The optional modes it implements (a subset of ALL_FEATURES).
    features: FrozenSet[str] = frozenset()

    def unavailable(self) -> Optional[str]:
        return None

    def supports(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_lengths: Optional[Tensor]) -> Optional[str]:
        return None

    def mode_limits(self, q: Tensor, k: Tensor, v: Tensor, needed: FrozenSet[str]) -> Optional[str]:
        """The reason this backend cannot give these tensors the modes ``needed`` although its
        ``features`` list them (a kernel that serves some shapes without modes only), or None."""
        return None

    def auto_supports(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_lengths: Optional[Tensor]) -> Optional[str]:
        """Like :meth:`supports`, with the extra reasons for which ``auto`` should not pick it."""
        return self.supports(q, k, v, causal, key_lengths)

    def forward(self, q, k, v, scale, causal, key_lengths, modes: Modes = DEFAULT_MODES) -> Tuple[Tensor, Tensor]:
        raise NotImplementedError

    def backward(
        self, dout, q, k, v, out, lse, scale, causal, key_lengths, modes: Modes = DEFAULT_MODES
    ) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
        raise NotImplementedError

    def backward_kv_sum(self, dout, q, kv, out, lse, scale, causal, key_lengths) -> Optional[Tuple[Tensor, Tensor]]:
        """``(dq, dK + dV)`` of a call without modes whose keys and values are one tensor ``kv``,
        the sum rounded as autograd sums two gradients of one tensor; None where this backend has
        no kernel for it (the op layer then adds the two)."""
        return None


def missing_features(be: Backend, needed: FrozenSet[str], q=None, k=None, v=None) -> Optional[str]:
    """The reason ``be`` cannot serve a call needing ``needed`` modes, or None: modes outside its
    ``features``, then (given the tensors) its :meth:`Backend.mode_limits`."""
    missing = sorted(needed - be.features)
    if missing:
        return "does not implement " + ", ".join(missing)
    if needed and q is not None:
        return be.mode_limits(q, k, v, needed)
    return None


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
# Held while the built-in modules import, so that a second thread's first call (two sweeps in
# threads, a DataLoader worker) waits for a complete registry instead of seeing part of it.
# Re-entrant: a backend module's import may itself look the registry up.
_LOAD_LOCK = threading.RLock()


# Dispatch caches: what cannot change between calls in one process. Cleared by register() and
# clear_dispatch_cache().
_ORDER: Optional[List[str]] = None
_SELECTED: Dict[tuple, object] = {}
_SELECTED_MAX = 4096  # distinct call signatures kept; the cache restarts when full
# Calls checked once (remember_call): a signature whose every check reads metadata only, with
# what serving it again needs. Kept beside the selections, forgotten with them.
_CALLS: Dict[tuple, tuple] = {}


def register(backend: Backend) -> Backend:
    """Add (or replace) a backend under ``backend.name``."""
    global _ORDER
    if not isinstance(backend, Backend) or not backend.name or not isinstance(backend.name, str):
        raise ValueError("register: expected a Backend instance with a non-empty string name")
    if backend.name == "auto":
        raise ValueError("register: 'auto' is reserved for automatic selection")
    unknown = set(backend.features) - ALL_FEATURES
    if unknown:
        raise ValueError(f"register: {backend.name}: unknown features {sorted(unknown)}; known: {sorted(ALL_FEATURES)}")
    _REGISTRY[backend.name] = backend
    _ORDER = None
    _SELECTED.clear()
    _CALLS.clear()
    return backend


# Which backend served the last call of this thread, and the strict switch (set_strict).
_LAST = threading.local()
_STRICT = False


def last_backend() -> Optional[str]:
    """The name of the backend that :func:`select` resolved last in this thread (the last
    ``mhakern.attention`` / SDPA drop-in / FusedMHA call, or op), None before any call. Under
    torch.compile it is set when the compiled graph runs its ops."""
    return getattr(_LAST, "name", None)


def set_strict(enabled: bool) -> bool:
    """Strict dispatch: while on, ``backend="auto"`` raises :class:`mhakern.FallbackError` (a
    ValueError and a RuntimeError) with every fast backend's reason instead of falling back to a
    ``fallback`` backend (the plain-PyTorch reference: float64, head dims beyond the kernels',
    a device no kernel serves). Naming ``backend="reference"`` still works. Process-wide;
    returns the previous setting."""
    global _STRICT
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled: expected a bool, got {type(enabled).__name__}")
    prev, _STRICT = _STRICT, enabled
    return prev


def _refuse_fallback(be: "Backend", q, k, v, causal, key_lengths, needed) -> None:
    reasons = []
    for n in names():
        other = _REGISTRY[n]
        if other.fallback:
            continue
        why = available_backends()[n] or missing_features(other, needed, q, k, v) or other.auto_supports(
            q, k, v, causal, key_lengths
        )
        reasons.append(f"{n}: {why}")
    raise FallbackError(
        f"backend='auto': strict dispatch (mhakern.set_strict) refuses to fall back to {be.name!r} "
        "(" + "; ".join(reasons) + ")"
    )


def clear_dispatch_cache() -> None:
    """Forget the cached selections and remembered calls (for a backend whose availability
    changed in-process)."""
    _SELECTED.clear()
    _CALLS.clear()


def remember_call(key: tuple, entry: tuple) -> None:
    """Remember a call signature ``key`` that passed every check once, with ``entry``: a tuple
    whose first item is the :class:`Backend` that served it, the rest the caller's own (what
    serving the signature again needs). For a caller whose checks read nothing but what ``key``
    holds (mhakern/routing.py); :func:`register` and :func:`clear_dispatch_cache` forget it."""
    if len(_CALLS) >= _SELECTED_MAX:
        _CALLS.clear()
    _CALLS[key] = entry


def remembered_call(key: tuple) -> Optional[tuple]:
    """The entry :func:`remember_call` stored under ``key``, its backend then noted as the one
    that served this thread's last call (:func:`last_backend`); None when there is none."""
    hit = _CALLS.get(key)
    if hit is not None:
        _LAST.name = hit[0].name
    return hit


def remembered_calls() -> List[tuple]:
    """The keys of the calls remembered now (tests, diagnostics)."""
    return list(_CALLS)


def note_served(be: Union[Backend, str]) -> None:
    """Note ``be`` (a backend or its name) as the backend of this thread's last call
    (:func:`last_backend`), for a caller that runs a selection it made earlier without
    :func:`select`, or serves the call with kernels of its own (``mhakern.flex``)."""
    _LAST.name = be if isinstance(be, str) else be.name


def _constant_under_compile(fn):
    """``torch.compiler.assume_constant_result(fn)``, without importing torch._dynamo first.

    The public decorator imports dynamo (about 2 s, most of ``import mhakern``'s own time) only to
    set the mark dynamo reads when it traces a call of ``fn``. Where dynamo is loaded already the
    public decorator runs; otherwise the mark is set here, and dynamo reads it whenever it is
    imported later (tests/test_compile.py compiles in a fresh interpreter to hold that)."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


# Dynamo cannot trace importlib: under torch.compile this runs once at trace time instead, its
# (constant) result taken as is, so compiling before any eager call still fills the registry.
@_constant_under_compile
def _load_builtins() -> None:
    global _loaded
    if _loaded:
        return
    with _LOAD_LOCK:
        if _loaded:  # another thread finished loading while this one waited
            return
        # Every built-in module exists; what one of them needs and lacks (the extension, triton)
        # it reports through unavailable(), never by failing to import.
        for mod in _BUILTIN:
            importlib.import_module(mod)
        _loaded = True  # only now: a thread that sees it True sees every built-in registered


def names() -> List[str]:
    """Registered backend names, highest priority first."""
    global _ORDER
    _load_builtins()
    if _ORDER is None:
        _ORDER = sorted(_REGISTRY, key=lambda n: -_REGISTRY[n].priority)
    return list(_ORDER)


def get(name: str) -> Backend:
    """The backend registered as ``name`` ("auto" is not a backend: see :func:`select`)."""
    _load_builtins()
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        if name == "auto":
            raise ValueError(
                "backend: 'auto' must be resolved by mhakern.backends.select() first; "
                f"get() takes a registered backend name, one of {names()}"
            ) from None
        raise ValueError(f"backend: unknown backend {name!r}; choose 'auto' or one of {names()}") from None


# unavailable() may import modules (the extension, triton): under torch.compile the answers are
# computed at trace time and taken as constants, for the same reason as _load_builtins.
@_constant_under_compile
def available_backends() -> Dict[str, Optional[str]]:
    """Each backend's name with None (usable in this process) or the reason it is not."""
    return {n: _REGISTRY[n].unavailable() for n in names()}


def _signature(name, q, k, v, causal, key_lengths, needed, grad) -> tuple:
    # Everything supports() may look at (module docstring): the cache key of a selection.
    if grad is None:
        grad = torch.is_grad_enabled() and any(getattr(x, "requires_grad", False) for x in (q, k, v))
    return (
        # torch.Size is a tuple (hashed and compared as one): no conversion per call
        name, q.device, q.dtype, k.dtype, v.dtype, q.shape, k.shape, v.shape,
        q.stride(), k.stride(), v.stride(), bool(causal), key_lengths is None, needed,
        # whether a gradient is needed: the cuda backend serves its forward-only head dims
        # (sm_90a, D 256) only without one
        grad,
    )


_PLAIN_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})


def select(
    name: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    key_lengths: Optional[Tensor],
    needed: FrozenSet[str] = frozenset(),
    grad: Optional[bool] = None,
) -> Backend:
    """Resolve ``name`` ("auto" or a backend name) to the backend that will serve these tensors.

    ``needed``: the optional modes of the call (:meth:`Modes.required_features`). Raises
    ValueError with every backend's reason when none can serve the call. Answers are cached per
    call signature when the tensors are real (fake tensors under torch.compile may carry
    symbolic shapes, which are not hashed). ``grad``: whether the call will need a gradient
    (default: grad mode on and an input requiring grad); the operator layer says it from inside
    its autograd.Function, where grad mode is off.
    """
    if not isinstance(name, str):
        raise TypeError(f"backend: expected a string ('auto' or one of {names()}), got {type(name).__name__}")
    key = None
    # Real tensors outside tracing only: fake tensors may carry symbolic shapes, and stand-ins
    # (tests' duck-typed tensors) need not have strides.
    if type(q) in _PLAIN_TYPES and type(k) in _PLAIN_TYPES and type(v) in _PLAIN_TYPES \
            and not torch.compiler.is_compiling():
        key = _signature(name, q, k, v, causal, key_lengths, frozenset(needed), grad)
        hit = _SELECTED.get(key)
        if hit is not None:
            if isinstance(hit, Backend):
                if _STRICT and hit.fallback and name == "auto":
                    _refuse_fallback(hit, q, k, v, causal, key_lengths, frozenset(needed))
                _LAST.name = hit.name
                return hit
            raise ArgumentError(hit)
    try:
        if grad and not torch.is_grad_enabled():
            # supports() reads grad mode for "a gradient is needed" (the cuda backend's
            # forward-only head dims); a miss is rare, so the context costs nothing per call.
            with torch.enable_grad():
                be = _select(name, q, k, v, causal, key_lengths, frozenset(needed))
        else:
            be = _select(name, q, k, v, causal, key_lengths, frozenset(needed))
    except ValueError as e:
        if key is not None and (name in _REGISTRY or name == "auto"):
            _remember(key, str(e))
        raise
    if key is not None:
        _remember(key, be)
    if _STRICT and be.fallback and name == "auto":
        _refuse_fallback(be, q, k, v, causal, key_lengths, frozenset(needed))
    _LAST.name = be.name
    return be


def _remember(key, answer) -> None:
    if len(_SELECTED) >= _SELECTED_MAX:
        _SELECTED.clear()
    _SELECTED[key] = answer


def _select(name, q, k, v, causal, key_lengths, needed) -> Backend:
    usable = available_backends()
    if name != "auto":
        be = get(name)
        why = usable[name] or missing_features(be, needed, q, k, v) or be.supports(q, k, v, causal, key_lengths)
        if why is not None:
            raise ArgumentError(f"backend={name!r} cannot serve these inputs: {name}: {why}")
        return be
    reasons = []
    for n in names():
        be = _REGISTRY[n]
        why = usable[n] or missing_features(be, needed, q, k, v) or be.auto_supports(q, k, v, causal, key_lengths)
        if why is None:
            return be
        reasons.append(f"{n}: {why}")
    raise ArgumentError("backend='auto': no backend can serve these inputs (" + "; ".join(reasons) + ")")
