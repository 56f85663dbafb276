"""Providers: the attention implementations a benchmark row runs on.

* ``mhakern:<backend>`` -- every backend in mhakern's registry that is usable in this process
  (discovered from the registry, so a backend that lands later appears by itself), and
  ``mhakern:auto`` (dispatch included; the report names the backend it picked).
* ``sdpa:<kernel>`` -- ``torch.nn.functional.scaled_dot_product_attention`` pinned to one of its
  kernels through ``torch.nn.attention.sdpa_kernel``: math, flash, efficient, cudnn (on CPU
  only math and flash exist).
* ``flash-attn`` / ``flash-attn3`` / ``xformers`` -- when they import, skipped with the import
  error otherwise.

Each provider is the field's peer of mhakern (``origin == "field"``) or one of ours
(``origin == "mhakern"``). A provider turns the row's shared inputs (q, k, v contiguous
(B, H[kv], L, D)) into its own argument objects in :meth:`Provider.prepare`, outside the timed
region, and returns a function whose output is viewed as (B, H, Lq, D) so that one ``dout``
serves every provider of a row.

Semantics match mhakern's: default scale 1/sqrt(D); causal is bottom-right aligned (SDPA gets
``is_causal`` when Lq = Lk, where top-left and bottom-right coincide, and a lower-right causal
bias otherwise); GQA through each library's own grouped-head support, never a K/V copy made by
the benchmark.
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Callable, List, Optional, Tuple

import torch

from .cases import Case

Fn = Callable[..., torch.Tensor]

# Materialising providers build the (B, H, Lq, Lk) scores; past these sizes they would take
# minutes per row (CPU) or most of the device's memory, and their ratio to the peer is already
# plain from the smaller rows.
_MATERIALISE_CAP = {
    "cpu": {"elements": 1 << 23, "bytes": 2 << 30},
    "cuda": {"elements": 1 << 31, "bytes": 40 << 30},
}


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


class Provider:
    """One implementation under test."""

    name: str = ""
    origin: str = "field"  # "mhakern" or "field"
    #: Builds the full score matrix (time and memory grow with Lq * Lk).
    materialises: bool = False

    def unavailable(self, device: str) -> Optional[str]:
        """None when this provider can run on ``device`` ("cpu" or "cuda") at all, else why not."""
        return None

    def supports(self, case: Case, device: str, q=None, k=None, v=None) -> Optional[str]:
        """None when this provider should run this row, else the reason it is skipped.

        Called first without tensors (shape rules only), then with the row's real inputs.
        """
        if self.materialises:
            cap = _MATERIALISE_CAP[device]
            if case.score_elements() > cap["elements"] or case.materialised_bytes() > cap["bytes"]:
                return (
                    f"materialises the (B, H, Lq, Lk) scores: rows above 2^{cap['elements'].bit_length() - 1} "
                    f"score entries or {cap['bytes'] >> 30} GiB of work buffers are skipped on {device}"
                )
        return None

    def prepare(self, case: Case, q, k, v, grad: bool) -> Tuple[Fn, Tuple[torch.Tensor, ...]]:
        """``(fn, args)``: ``fn(*args)`` computes the output, viewed as (B, H, Lq, D).

        ``args`` are leaf tensors made from q, k, v (views, or copies into the provider's layout),
        with ``requires_grad=grad``. Runs outside the timed region.
        """
        raise NotImplementedError

    def resolved(self, case: Case, q, k, v) -> Optional[str]:
        """For dispatching providers, what they picked for this row."""
        return None

    def scope(self):
        """A context held around the whole measurement of a row (warm-up and timing): process
        settings a provider needs (by default none)."""
        return contextlib.nullcontext()


def _torch_version() -> Tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def _leaf(x: torch.Tensor, grad: bool) -> torch.Tensor:
    return x.detach().requires_grad_(grad)


class MhakernProvider(Provider):
    """``mhakern.attention(..., backend=name)`` for one registry backend, or ``auto``."""

    origin = "mhakern"

    def __init__(self, backend: str):
        self.backend = backend
        self.name = f"mhakern:{backend}"
        # The reference backend materialises the scores like SDPA's math kernel.
        self.materialises = backend == "reference"

    def _registry_entry(self):
        from mhakern import backends

        return backends.get(self.backend)

    def unavailable(self, device):
        if self.backend == "auto":
            return None
        be = self._registry_entry()
        why = be.unavailable()
        return why

    def supports(self, case, device, q=None, k=None, v=None):
        why = super().supports(case, device)
        if why is not None:
            return why
        if self.backend == "auto" and device == "cpu" and not case.headline and case.family in ("self", "cross", "gqa"):
            # On long rows auto costs what the backend it picks costs (the report names it);
            # the CPU set's time budget keeps it to the headline, decode and trainer rows.
            return "on CPU, auto is measured on the headline, decode and trainer rows only (time budget)"
        if q is None:
            return None
        from mhakern import backends

        try:
            picked = backends.select(self.backend, q, k, v, case.causal, None).name
        except ValueError as e:
            return str(e)
        if self.backend == "auto" and picked != "auto":
            # auto on a row where it picks a materialising backend costs what that one costs.
            why = MhakernProvider(picked).supports(case, device)
            return None if why is None else f"picks {picked}, which {why}"
        return None

    def prepare(self, case, q, k, v, grad):
        import mhakern

        args = tuple(_leaf(x, grad) for x in (q, k, v))
        backend, causal = self.backend, case.causal

        def fn(q, k, v):
            return mhakern.attention(q, k, v, causal=causal, backend=backend)

        return fn, args

    def resolved(self, case, q, k, v):
        if self.backend != "auto":
            return self.backend
        from mhakern import backends

        return backends.select("auto", q, k, v, case.causal, None).name


class MhakernFamilyProvider(MhakernProvider):
    """The cuda backend with its kernel families set (``torch.ops.mhakern_C.cuda_force_fwd_family``
    and ``cuda_force_bwd_family``) and optionally a backward kernel of a family
    (``cuda_force_sm90_bwd_kernel`` / ``cuda_force_mma_bwd_kernel``) for the whole measurement
    (:meth:`scope`): ``mhakern:cuda[mma_sync]`` (both passes on mma.sync, what sm_80-89 devices
    run), ``mhakern:cuda[sm90 bwd]`` (the host's choice for both passes, the opt-in sm90 backward
    included), and the fused backward kernels ``mhakern:cuda[mma fused bwd]`` and
    ``mhakern:cuda[sm90 fused bwd]`` (backward rows only: their forward is a peer's), measured
    only where the host has another family to pick (a 9.0 device with the sm_90a pass), so that a
    Hopper run shows the families and backward kernels side by side."""

    def __init__(self, label: str, fwd: str, bwd: str, sm90_bwd: Optional[str] = None, mma_bwd: Optional[str] = None):
        super().__init__("cuda")
        self.fwd, self.bwd = fwd, bwd
        self.sm90_bwd, self.mma_bwd = sm90_bwd, mma_bwd
        self.name = f"mhakern:cuda[{label}]"

    def unavailable(self, device):
        why = super().unavailable(device)
        if why is not None:
            return why
        from mhakern.backends import cuda_backend

        sm90 = ((cuda_backend.capabilities() or {}).get("cuda") or {}).get("sm90") or {}
        if device != "cuda" or not sm90.get("compiled") or torch.cuda.get_device_capability() != tuple(sm90["capability"]):
            return "the cuda backend has one kernel family here (no sm_90a family on this device)"
        return None

    def supports(self, case, device, q=None, k=None, v=None):
        if (self.sm90_bwd or self.mma_bwd) and case.mode != "fwdbwd":
            return "a backward kernel's variant: forward rows are its family's provider's"
        return super().supports(case, device, q, k, v)

    @contextlib.contextmanager
    def scope(self):
        ops = torch.ops.mhakern_C
        prev = (ops.cuda_force_fwd_family(self.fwd), ops.cuda_force_bwd_family(self.bwd))
        kern = []
        try:
            if self.sm90_bwd:
                kern.append((ops.cuda_force_sm90_bwd_kernel, ops.cuda_force_sm90_bwd_kernel(self.sm90_bwd)))
            if self.mma_bwd:
                kern.append((ops.cuda_force_mma_bwd_kernel, ops.cuda_force_mma_bwd_kernel(self.mma_bwd)))
            yield
        finally:
            for force, was in kern:
                force(was)
            ops.cuda_force_fwd_family(prev[0])
            ops.cuda_force_bwd_family(prev[1])

    def resolved(self, case, q, k, v):
        kern = f" ({'sm90' if self.sm90_bwd else 'mma.sync'} kernel {self.sm90_bwd or self.mma_bwd})" if (
            self.sm90_bwd or self.mma_bwd) else ""
        return f"cuda, forward {self.fwd}, backward {self.bwd}{kern}"


class MhakernTritonBwdProvider(MhakernProvider):
    """The triton backend with its backward mode set (mhakern/kernels/heuristics.py ``BWD_MODE``) for the
    whole measurement: ``mhakern:triton[deterministic bwd]`` (the fused kernel, dQ added in
    key-block order: the default) and ``mhakern:triton[split bwd]`` (the dK/dV and dQ kernels),
    backward rows only, so that a run that leaves ``mhakern:triton`` out still has both."""

    def __init__(self, mode: str):
        super().__init__("triton")
        self.mode = mode
        self.name = f"mhakern:triton[{mode} bwd]"

    def supports(self, case, device, q=None, k=None, v=None):
        if case.mode != "fwdbwd":
            return "a backward mode's variant: forward rows are mhakern:triton's"
        return super().supports(case, device, q, k, v)

    @contextlib.contextmanager
    def scope(self):
        from mhakern.kernels import heuristics

        prev = heuristics.BWD_MODE
        heuristics.BWD_MODE = self.mode
        try:
            yield
        finally:
            heuristics.BWD_MODE = prev

    def resolved(self, case, q, k, v):
        return f"triton, backward {self.mode}"


_SDPA_KERNELS = {
    "math": "MATH",
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
}


class SdpaProvider(Provider):
    """``torch.nn.functional.scaled_dot_product_attention`` restricted to one kernel."""

    def __init__(self, kernel: str):
        self.kernel = kernel
        self.name = f"sdpa:{kernel}"
        self.materialises = kernel == "math"

    def unavailable(self, device):
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401
        except ImportError as e:
            return f"torch.nn.attention.sdpa_kernel is missing: {_first_line(e)}"
        if not hasattr(SDPBackend, _SDPA_KERNELS[self.kernel]):
            return f"this torch has no SDPBackend.{_SDPA_KERNELS[self.kernel]}"
        if device == "cpu" and self.kernel in ("efficient", "cudnn"):
            return f"SDPA's {self.kernel} kernel exists on CUDA only"
        return None

    def supports(self, case, device, q=None, k=None, v=None):
        why = super().supports(case, device)
        if why is not None:
            return why
        if case.H != case.Hkv and _torch_version() < (2, 5):
            return "SDPA's enable_gqa needs torch >= 2.5"
        return None

    def prepare(self, case, q, k, v, grad):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, _SDPA_KERNELS[self.kernel])
        kw = {}
        if case.H != case.Hkv:
            kw["enable_gqa"] = True
        if case.causal and case.Lq == case.Lk:
            kw["is_causal"] = True
        elif case.causal:
            from torch.nn.attention.bias import causal_lower_right

            kw["attn_mask"] = causal_lower_right(case.Lq, case.Lk)
        args = tuple(_leaf(x, grad) for x in (q, k, v))

        def fn(q, k, v):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, **kw)

        return fn, args


class FlashAttnProvider(Provider):
    """flash-attn 2 (``flash_attn.flash_attn_func``) or 3 (``flash_attn_interface``), (B, L, H, D)."""

    def __init__(self, version: int):
        self.version = version
        self.name = "flash-attn" if version == 2 else "flash-attn3"
        self.module = "flash_attn" if version == 2 else "flash_attn_interface"

    def unavailable(self, device):
        if device != "cuda":
            return f"{self.name} runs on CUDA only"
        try:
            importlib.import_module(self.module)
        except Exception as e:  # an import can fail with more than ImportError (ABI mismatch)
            return f"{self.name} does not import: {_first_line(e)}"
        return None

    def supports(self, case, device, q=None, k=None, v=None):
        if case.dtype not in ("fp16", "bf16"):
            return f"{self.name} takes fp16/bf16 only"
        return super().supports(case, device)

    def prepare(self, case, q, k, v, grad):
        func = importlib.import_module(self.module).flash_attn_func
        # Its native layout is (B, L, H, D); the row's contiguous (B, H, L, D) tensors seen through
        # a transpose have unit last stride, which flash-attn accepts without a copy.
        args = tuple(_leaf(x.transpose(1, 2), grad) for x in (q, k, v))
        causal = case.causal  # bottom-right aligned since flash-attn 2.1, as mhakern's

        def fn(q, k, v):
            out = func(q, k, v, causal=causal)
            if isinstance(out, tuple):  # some flash-attn 3 builds also return the lse
                out = out[0]
            return out.transpose(1, 2)

        return fn, args


class XformersProvider(Provider):
    """``xformers.ops.memory_efficient_attention`` in its (B, M, [G,] H, K) layout."""

    name = "xformers"

    def unavailable(self, device):
        if device != "cuda":
            return "benchmarked on CUDA only (its CPU path is not a fused kernel)"
        try:
            importlib.import_module("xformers.ops")
        except Exception as e:
            return f"xformers does not import: {_first_line(e)}"
        return None

    def prepare(self, case, q, k, v, grad):
        xops = importlib.import_module("xformers.ops")
        bias_mod = importlib.import_module("xformers.ops.fmha.attn_bias")
        B, H, Hkv, Lq, Lk, D = case.B, case.H, case.Hkv, case.Lq, case.Lk, case.D
        bias = None
        if case.causal:
            bias = bias_mod.LowerTriangularMask() if Lq == Lk else bias_mod.LowerTriangularFromBottomRightMask()
        if H == Hkv:
            args = tuple(_leaf(x.transpose(1, 2), grad) for x in (q, k, v))

            def fn(q, k, v):
                return xops.memory_efficient_attention(q, k, v, attn_bias=bias).transpose(1, 2)

            return fn, args
        # GQA: 5-D (B, M, G, Hq/G, K) with K and V broadcast (stride 0) over the group's heads.
        # The layout change is a copy made here, untimed.
        G, R = Hkv, H // Hkv
        q5 = _leaf(q.transpose(1, 2).reshape(B, Lq, G, R, D).contiguous(), grad)
        k4 = _leaf(k.transpose(1, 2).contiguous(), grad)
        v4 = _leaf(v.transpose(1, 2).contiguous(), grad)

        def fn(q5, k4, v4):
            k5 = k4.unsqueeze(3).expand(B, Lk, G, R, D)
            v5 = v4.unsqueeze(3).expand(B, Lk, G, R, D)
            out = xops.memory_efficient_attention(q5, k5, v5, attn_bias=bias)
            return out.reshape(B, Lq, H, D).transpose(1, 2)

        return fn, (q5, k4, v4)


def all_providers() -> List[Provider]:
    """Every provider this process knows of, mhakern's first (registry order, then auto)."""
    from mhakern import backends

    provs: List[Provider] = [MhakernProvider(n) for n in backends.names()]
    provs.append(MhakernProvider("auto"))
    provs.append(MhakernFamilyProvider("mma_sync", "mma_sync", "mma_sync"))
    provs.append(MhakernFamilyProvider("sm90 bwd", "auto", "auto"))
    provs.append(MhakernFamilyProvider("mma fused bwd", "mma_sync", "mma_sync", mma_bwd="fused"))
    provs.append(MhakernFamilyProvider("sm90 fused bwd", "auto", "auto", sm90_bwd="fused"))
    provs += [MhakernTritonBwdProvider("deterministic"), MhakernTritonBwdProvider("split")]
    provs += [SdpaProvider(k) for k in _SDPA_KERNELS]
    provs += [FlashAttnProvider(2), FlashAttnProvider(3), XformersProvider()]
    return provs


def bench_device() -> str:
    """"cuda" when a CUDA device is present, else "cpu" (touches the device only when asked)."""
    return "cuda" if torch.cuda.is_available() else "cpu"
