"""The ``cuda`` backend: hand-written fused attention kernels on tensor cores (csrc/cuda/),
compiled into ``mhakern._C`` when torch has CUDA and nvcc was found at build time.

Serves CUDA tensors in the dtypes, head dims (q, k and v of one head dim), index limits and
compute capabilities of the capability table (csrc/capabilities.h, read from mhakern/_caps.py's
``TABLE["cuda"]``; what the build compiled from ``torch.ops.mhakern_C.capabilities()``, kept in
``CudaBackend.table``); it refuses
anything else with the reason, so that ``auto`` falls back (to ``triton``, which also serves
float32). The kernels are the dispatcher operators ``torch.ops.mhakern_C.fwd`` / ``bwd``.

Kernels (FlashAttention-2 scheme on mma.sync, fp32 accumulation and online softmax): the
forward keeps the log-sum-exp; the backward recomputes P from it and is deterministic: by
default split kernels without atomics (dK/dV per key block summed over the query heads of the
group, dQ in its own kernel); opt-in (``MHAKERN_CUDA_MMA_BWD=fused``) a fused kernel with 5
products per tile whose dQ adds (fp32 ``red.global.add``) come in a fixed key order, or
``fused_atomic`` without that order. Head dim 256 has only the fused backward (its forward is
the sm_90a family's); the table's ``bwd`` entry says which backward runs and whether it is
deterministic. The sm_90a family's backward (opt-in) is likewise split or fused
(``MHAKERN_CUDA_SM90_BWD``; the table's ``sm90.bwd_kernel`` and ``sm90.bwd_kernels``).
Query rows of the heads that share a KV head are packed into one tile, so decode (Lq = 1 with
many query heads per KV head) reads each key block once per group. Where those packed rows are
few (H / Hkv * Lq up to the table's ``decode.max_rows``, no attn_mask or dropout) the mma.sync
forward runs its decode kernel: 16-row CTAs whose warps split each key tile instead of the
rows, so that the tensor cores no longer multiply 128-row tiles for a handful of rows and the
call is bound by reading K and V. When the query tiles alone
would leave most multiprocessors idle and the keys are long, the keys are split across CTAs
(split-K) and the partial results combined through their lse; the op plans it
(:func:`plan_splits` asks the same planner).

Modes (docs/contract.md): ``features`` is the capability table's list for the cuda family
(csrc/capabilities.h, ``kCudaFeatures``); the others are refused by dispatch, so that ``auto``
falls back. The head dims only the sm_90a forward has take that forward's modes
(``sm90.fwd_features``) only, and of those only the ones verified on a GPU
(:data:`SM90_FWD_UNVERIFIED`; :meth:`CudaBackend.mode_limits`). Causal alignment and windows
bound each query tile's key range: key blocks that no row of the tile sees are skipped
(neither read nor computed), and only blocks that cross a visibility boundary are masked per
element.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from .. import selftest
from ..modes import c_bwd, c_fwd
from . import DEFAULT_MODES, Backend, register
from .._build import INSTALL_HINT as _BUILD_HINT
from .._caps import TABLE
from .._extension import capabilities, load_error

_CUDA = TABLE["cuda"]
_SM90 = _CUDA["sm90"]

#: Modes the sm_90a forward implements (the table's ``sm90.fwd_features``: packed sequences)
#: that no GPU run has verified yet. A call needing one of them on a head dim only that forward
#: has (``sm90.fwd_only_head_dims``: D 256) keeps its route until a GPU passes it (the first-use
#: self-test): refused here with that reason, so that ``auto`` falls back. On the head dims the
#: mma.sync family has too, the host's family choice is unaffected.
SM90_FWD_UNVERIFIED = frozenset({"varlen"})


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """``x`` if the kernels can read it in place (16-byte aligned rows), else a contiguous copy.

    A copy, not ``contiguous()``: a contiguous view that starts at an odd offset into its
    storage is returned as is by ``contiguous()`` (the first GPU run met exactly that)."""
    ok = x.stride(-1) == 1 and x.data_ptr() % 16 == 0
    ok = ok and all(n <= 1 or s % 8 == 0 for n, s in zip(x.shape[:3], x.stride()[:3]))
    return x if ok else x.clone(memory_format=torch.contiguous_format)


def plan_splits(batch: int, kv_heads: int, group: int, q_len: int, k_len: int, head_dim: int, num_sms: int,
                backward: bool = False, sm90: bool = False) -> int:
    """The number of key splits the kernels' host code chooses for a forward (or the backward's
    dQ pass) on a device with ``num_sms`` multiprocessors, with the tiles of the family that runs
    it (``sm90``: the sm_90a forward; else mma.sync, whose decode kernel takes calls of few packed
    rows): csrc/capabilities.h's planner (``plan_fwd_splits``: the sm90 family by wave efficiency
    at its one CTA per SM, mma.sync by about two CTAs per SM), called through
    ``torch.ops.mhakern_C.cuda_plan_splits`` (it needs the extension, CUDA or not)."""
    return torch.ops.mhakern_C.cuda_plan_splits(batch, kv_heads, group, q_len, k_len, head_dim, num_sms, backward,
                                                sm90)


class CudaBackend(Backend):
    name = "cuda"
    priority = 40

    #: What the kernels serve: the capability table's cuda entry.
    features = frozenset(_CUDA["features"])

    def __init__(self):
        self._static_reason: Optional[str] = None
        self._checked = False
        self._sm90_pinned = False
        self._caps: Optional[Dict[int, Tuple[int, int]]] = None
        # The cuda entry of torch.ops.mhakern_C.capabilities(): the table with what this build
        # compiled (filled by _static_unavailable; its "compiled" flags are read from here).
        self.table: dict = {}
        self._dtypes: Tuple[torch.dtype, ...] = tuple(getattr(torch, n) for n in _CUDA["dtypes"])
        self._head_dims: Tuple[int, ...] = tuple(_CUDA["head_dims"])
        self._min_capability: Tuple[int, int] = tuple(_CUDA["min_capability"])

    # -- availability ------------------------------------------------------------------------
    def _capabilities(self) -> Optional[dict]:
        return capabilities()

    def _static_unavailable(self) -> Optional[str]:
        """Reasons that cannot change during the process: torch's build, mhakern._C's build."""
        if torch.version.cuda is None:
            return (
                f"torch {torch.__version__} was built without CUDA (torch.version.cuda is None); install a CUDA "
                f"build of torch, then rebuild mhakern ({_BUILD_HINT}) so that nvcc compiles the kernels"
            )
        caps = self._capabilities()
        if caps is None:
            return (f"the extension mhakern._C is not built or failed to import ({load_error()}); rebuild with "
                    f"{_BUILD_HINT}")
        cuda = caps["cuda"]
        if not cuda["compiled"]:
            return (
                "mhakern._C was built without its CUDA kernels (nvcc not found at build time, or MHAKERN_NO_CUDA "
                f"set); set CUDA_HOME to a CUDA toolkit and rebuild with {_BUILD_HINT}"
            )
        self.table = cuda
        return None

    def unavailable(self) -> Optional[str]:
        if not self._checked:
            self._static_reason = self._static_unavailable()
            self._checked = True
        if self._static_reason is not None:
            return self._static_reason
        if not torch.cuda.is_available():
            return "no CUDA device (torch.cuda.is_available() is False)"
        if self._caps is None:
            self._caps = self._device_capabilities()
        need = self._min_capability
        if not any(tuple(c) >= need for c in self._caps.values()):
            found = ", ".join(f"{c[0]}.{c[1]}" for c in self._caps.values()) or "none"
            return (f"no CUDA device of compute capability {need[0]}.{need[1]} or newer (found {found}); the kernels "
                    "use sm_80 mma.sync")
        return None

    def _device_capabilities(self) -> Dict[int, Tuple[int, int]]:
        return {i: tuple(torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())}

    # -- dispatch ------------------------------------------------------------------------------
    def supports(self, q, k, v, causal, key_lengths) -> Optional[str]:
        if q.device.type != "cuda":
            return f"needs CUDA tensors, got {q.device.type} tensors"
        if q.dtype not in self._dtypes:
            extra = " (float32 is served by the triton backend)" if q.dtype == torch.float32 else ""
            names = " or ".join(str(d).replace("torch.", "") for d in self._dtypes)
            return f"dtype {q.dtype} is not supported: the tensor-core kernels take {names}{extra}"
        D, Dv = q.shape[-1], v.shape[-1]
        if _CUDA["equal_head_dims"] and Dv != D:
            return f"head dims of q/k ({D}) and v ({Dv}) differ; the cuda kernels need them equal"
        if D not in self._head_dims:
            why = self._fwd_only_head_dim(q, k, v, D)
            if why is not None:
                return why
        B, H, Lq, _ = q.shape
        Hkv, Lk = k.shape[1], k.shape[2]
        max_rows, max_keys = _CUDA["max_group_rows"], _CUDA["max_keys"]
        if (H // Hkv) * Lq > max_rows:
            return f"(heads per kv head) x Lq = {(H // Hkv) * Lq} exceeds the cuda kernels' limit of {max_rows}"
        if Lk >= max_keys:
            return f"key length {Lk} exceeds the cuda kernels' limit of {max_keys - 1}"
        # Capabilities were read by unavailable() (dispatch asks it first): a dict lookup here keeps
        # supports() traceable by torch.compile.
        cap = (self._caps or {}).get(q.device.index if q.device.index is not None else 0)
        if cap is not None and tuple(cap) < self._min_capability:
            need = self._min_capability
            return (f"device {q.device} has compute capability {cap[0]}.{cap[1]}; the cuda kernels need "
                    f"{need[0]}.{need[1]} or newer")
        return self._self_tested(q.device, cap, D)

    def _self_tested(self, device, cap, D: int) -> Optional[str]:
        """The first-use self-test's gate (mhakern/selftest.py) for the families this call may run
        on ``device``: the mma.sync family (every backward, every forward off 9.0) and, on a 9.0
        device of a build with it, the sm_90a family. A failed mma.sync family refuses the call; a
        failed sm_90a family pins both passes to mma.sync (process-wide: the host's family setting)
        and refuses the head dims only it serves, so that ``auto`` routes them on."""
        why = selftest.gate("mma", device)
        if why is not None:
            return why
        if cap is None or tuple(cap) != tuple(_SM90["capability"]) or not self.table.get("sm90", {}).get("compiled"):
            return None
        why = selftest.gate("sm90", device)
        if why is None:
            return None
        if not self._sm90_pinned:
            torch.ops.mhakern_C.cuda_force_fwd_family("mma_sync")
            torch.ops.mhakern_C.cuda_force_bwd_family("mma_sync")
            self._sm90_pinned = True
        if D in _SM90["fwd_only_head_dims"]:
            return f"head dim {D} is served only by the sm_90a family: {why}"
        return None

    def mode_limits(self, q, k, v, needed) -> Optional[str]:
        """The head dims whose forward only the sm_90a family has (D 256; their mma.sync backward,
        the fused kernel, would take the modes, but a call needs the forward first) take only the
        modes that forward serves (``sm90.fwd_features``), and of those not the ones awaiting a
        GPU (:data:`SM90_FWD_UNVERIFIED`)."""
        D = q.shape[-1]
        if not needed or D not in _SM90["fwd_only_head_dims"]:
            return None
        asked = ", ".join(sorted(needed))
        off = needed - frozenset(_SM90["fwd_features"])
        if off:
            served = ", ".join(_SM90["fwd_features"]) or "none"
            return (f"head dim {D} is served only by the sm_90a forward, which takes no {', '.join(sorted(off))} "
                    f"(its modes: {served}; asked: {asked})")
        unverified = needed & SM90_FWD_UNVERIFIED
        if unverified:
            return (f"head dim {D} is served only by the sm_90a forward, whose {', '.join(sorted(unverified))} "
                    f"path is not yet verified on a GPU (asked: {asked})")
        return None

    def _fwd_only_head_dim(self, q, k, v, D: int) -> Optional[str]:
        """None when the sm_90a forward serves head dim ``D``, which no mma.sync forward has (the
        table's ``sm90.fwd_only_head_dims``): a 9.0 device of a build with the sm_90a pass, and
        either no gradient needed or a backward for ``D`` (the mma.sync family's fused kernel:
        ``bwd.head_dims``, D 256). Else the reason, so that ``auto`` falls back. Modes:
        :meth:`mode_limits`."""
        supported = ", ".join(map(str, self._head_dims))
        if D not in _SM90["fwd_only_head_dims"]:
            return f"head dim {D} has no compiled cuda kernel (supported: {supported})"
        need = tuple(_SM90["capability"])
        cap = (self._caps or {}).get(q.device.index if q.device.index is not None else 0)
        if not self.table.get("sm90", {}).get("compiled") or cap is None or tuple(cap) != need:
            return (f"head dim {D} is served only by the sm_90a forward (a compute capability {need[0]}.{need[1]} "
                    f"device and a build with the sm_90a pass); the cuda kernels otherwise take {supported}")
        has_bwd = D in _CUDA["bwd"]["head_dims"]
        if not has_bwd and torch.is_grad_enabled() and any(getattr(x, "requires_grad", False) for x in (q, k, v)):
            return (f"head dim {D} has a forward kernel only (sm_90a), no backward: call under torch.no_grad() or "
                    "with tensors that do not require grad")
        return None

    # -- compute -------------------------------------------------------------------------------
    # The op allocates the outputs (laid out like q, k, v), plans split-K and checks every
    # argument (csrc/cuda/cuda_host.cpp); inputs at an odd offset or stride are copied first.
    def forward(self, q, k, v, scale, causal, key_lengths, modes=DEFAULT_MODES):
        q, k, v = _aligned(q), _aligned(k), _aligned(v)
        return c_fwd(q, k, v, scale, causal, key_lengths, modes)

    def backward(self, dout, q, k, v, out, lse, scale, causal, key_lengths, modes=DEFAULT_MODES):
        dout, q, k, v, out = (_aligned(x) for x in (dout, q, k, v, out))
        return c_bwd(dout, q, k, v, out, lse, scale, causal, key_lengths, modes)


register(CudaBackend())
