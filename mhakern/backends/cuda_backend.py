"""The ``cuda`` backend: hand-written fused attention kernels on tensor cores (csrc/cuda/),
compiled into ``mhakern._C`` when torch has CUDA and nvcc was found at build time.

Serves CUDA tensors in float16 and bfloat16 with head dims 32, 64, 96 and 128 (q, k and v with
the same head dim) on devices of compute capability 8.0 and newer; it refuses anything else
with the reason, so that ``auto`` falls back (to ``triton``, which also serves float32).

Kernels (FlashAttention-2 scheme on mma.sync, fp32 accumulation and online softmax): the
forward keeps the log-sum-exp; the backward recomputes P from it and is deterministic (no
atomics: dK/dV per key block summed over the query heads of the group, dQ in its own kernel).
Query rows of the heads that share a KV head are packed into one tile, so decode (Lq = 1 with
many query heads per KV head) reads each key block once per group. When the query tiles alone
would leave most multiprocessors idle and the keys are long, the keys are split across CTAs
(split-K) and the partial results combined through their lse; :func:`plan_splits` decides.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch

from .._layout import empty_like_heads
from . import DEFAULT_MODES, Backend, register

HEAD_DIMS = (32, 64, 96, 128)
DTYPES = (torch.float16, torch.bfloat16)
MIN_CAPABILITY = (8, 0)

# Tile sizes of the compiled kernels (FwdConfig in csrc/cuda/attn_fwd_kernel.cuh, BwdConfig in
# attn_bwd_kernel.cuh): the split planner counts CTAs and key blocks with them.
def fwd_tiles(head_dim: int) -> Tuple[int, int]:
    """(packed query rows, keys) per CTA and step of the forward kernel."""
    return 128, (64 if head_dim <= 64 else 32)


def dq_tiles(head_dim: int) -> Tuple[int, int]:
    """(packed query rows, keys) per CTA and step of the backward's dQ kernel."""
    return 64, (64 if head_dim <= 64 else 32)


# Limits of the kernels' 32-bit index arithmetic (csrc/cuda_host.cpp checks the same).
MAX_GROUP_ROWS = 2**31 - 1
MAX_KEYS = 2**30
# Split-K: at least this many key blocks per split, at most this many splits, and a cap on the
# fp32 workspace of the partial outputs.
MIN_BLOCKS_PER_SPLIT = 8
MAX_SPLITS = 128
MAX_SPLIT_WORKSPACE_BYTES = 1 << 30

_BUILD_HINT = "pip install -e . --no-build-isolation"


def plan_splits(
    batch: int,
    kv_heads: int,
    group: int,
    q_len: int,
    k_len: int,
    head_dim: int,
    num_sms: int,
    tiles: Optional[Tuple[int, int]] = None,
) -> int:
    """Number of key splits for a pass whose CTAs each take ``block_m`` packed query rows and
    step through the keys ``block_n`` at a time, ``(block_m, block_n) = tiles`` (default: the
    forward's, :func:`fwd_tiles`).

    One CTA per (batch, kv head, tile of ``block_m`` rows of the group's ``group * q_len`` rows).
    When those CTAs fill the GPU (at least ``num_sms``), or the keys are short, no split (1).
    Otherwise enough splits to give about two CTAs per multiprocessor, keeping at least
    ``MIN_BLOCKS_PER_SPLIT`` key blocks of ``block_n`` per split, at most ``MAX_SPLITS``, and
    the fp32 partial output (splits x rows x head_dim x 4 bytes) under
    ``MAX_SPLIT_WORKSPACE_BYTES``.
    """
    for name, val in (("batch", batch), ("kv_heads", kv_heads), ("group", group), ("q_len", q_len),
                      ("k_len", k_len), ("head_dim", head_dim), ("num_sms", num_sms)):
        if not isinstance(val, int) or val < 0:
            raise ValueError(f"plan_splits: {name} must be a non-negative int, got {val!r}")
    block_m, block_n = fwd_tiles(head_dim) if tiles is None else tiles
    ctas = batch * kv_heads * math.ceil(group * q_len / block_m)
    if ctas == 0 or ctas >= num_sms:
        return 1
    key_blocks = math.ceil(k_len / block_n)
    by_occupancy = math.ceil(2 * num_sms / ctas)
    by_keys = key_blocks // MIN_BLOCKS_PER_SPLIT
    rows = batch * kv_heads * group * q_len
    by_memory = MAX_SPLIT_WORKSPACE_BYTES // max(1, rows * head_dim * 4)
    return max(1, min(by_occupancy, by_keys, by_memory, MAX_SPLITS))


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """``x`` if the kernels can read it in place (16-byte aligned rows), else a contiguous copy."""
    ok = x.stride(-1) == 1 and x.data_ptr() % 16 == 0
    ok = ok and all(n <= 1 or s % 8 == 0 for n, s in zip(x.shape[:3], x.stride()[:3]))
    return x if ok else x.contiguous()


class CudaBackend(Backend):
    name = "cuda"
    priority = 40

    def __init__(self):
        self._static_reason: Optional[str] = None
        self._checked = False
        self._caps: Optional[Dict[int, Tuple[int, int]]] = None
        self._sms = {}

    # -- availability ------------------------------------------------------------------------
    def _extension(self):
        from mhakern import _C

        return _C

    def _static_unavailable(self) -> Optional[str]:
        """Reasons that cannot change during the process: torch's build, mhakern._C's build."""
        if torch.version.cuda is None:
            return (
                f"torch {torch.__version__} was built without CUDA (torch.version.cuda is None); install a CUDA "
                f"build of torch, then rebuild mhakern ({_BUILD_HINT}) so that nvcc compiles the kernels"
            )
        try:
            C = self._extension()
        except ImportError as e:
            return f"the extension mhakern._C is not built or failed to import ({e}); rebuild with {_BUILD_HINT}"
        if not getattr(C, "with_cuda", False) or not hasattr(C, "cuda_attn_fwd"):
            return (
                "mhakern._C was built without its CUDA kernels (nvcc not found at build time, or MHAKERN_NO_CUDA "
                f"set); set CUDA_HOME to a CUDA toolkit and rebuild with {_BUILD_HINT}"
            )
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
        if not any(tuple(c) >= MIN_CAPABILITY for c in self._caps.values()):
            found = ", ".join(f"{c[0]}.{c[1]}" for c in self._caps.values()) or "none"
            return f"no CUDA device of compute capability 8.0 or newer (found {found}); the kernels use sm_80 mma.sync"
        return None

    def _device_capabilities(self) -> Dict[int, Tuple[int, int]]:
        return {i: tuple(torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())}

    # -- dispatch ------------------------------------------------------------------------------
    def supports(self, q, k, v, causal, key_lengths) -> Optional[str]:
        if q.device.type != "cuda":
            return f"needs CUDA tensors, got {q.device.type} tensors"
        if q.dtype not in DTYPES:
            extra = " (float32 is served by the triton backend)" if q.dtype == torch.float32 else ""
            return f"dtype {q.dtype} is not supported: the tensor-core kernels take float16 or bfloat16{extra}"
        D, Dv = q.shape[-1], v.shape[-1]
        if Dv != D:
            return f"head dims of q/k ({D}) and v ({Dv}) differ; the cuda kernels need them equal"
        if D not in HEAD_DIMS:
            return f"head dim {D} has no compiled cuda kernel (supported: {', '.join(map(str, HEAD_DIMS))})"
        B, H, Lq, _ = q.shape
        Hkv, Lk = k.shape[1], k.shape[2]
        if (H // Hkv) * Lq > MAX_GROUP_ROWS:
            return f"(heads per kv head) x Lq = {(H // Hkv) * Lq} exceeds {MAX_GROUP_ROWS}"
        if Lk >= MAX_KEYS:
            return f"key length {Lk} exceeds the cuda kernels' limit of {MAX_KEYS - 1}"
        # Capabilities were read by unavailable() (dispatch asks it first): a dict lookup here keeps
        # supports() traceable by torch.compile.
        cap = (self._caps or {}).get(q.device.index if q.device.index is not None else 0)
        if cap is not None and tuple(cap) < MIN_CAPABILITY:
            return f"device {q.device} has compute capability {cap[0]}.{cap[1]}; the cuda kernels need 8.0 or newer"
        return None

    def _num_sms(self, device: torch.device) -> int:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in self._sms:
            self._sms[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
        return self._sms[idx]

    # -- compute -------------------------------------------------------------------------------
    def forward(self, q, k, v, scale, causal, key_lengths, modes=DEFAULT_MODES):
        q, k, v = _aligned(q), _aligned(k), _aligned(v)
        B, H, Lq, D = q.shape
        Hkv, Lk = k.shape[1], k.shape[2]
        out = empty_like_heads(q, D)
        lse = torch.empty((B, H, Lq), dtype=torch.float32, device=q.device)
        splits = plan_splits(B, Hkv, H // Hkv, Lq, Lk, D, self._num_sms(q.device))
        self._extension().cuda_attn_fwd(q, k, v, out, lse, key_lengths, float(scale), bool(causal), splits)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, scale, causal, key_lengths, modes=DEFAULT_MODES):
        dout, q, k, v, out = (_aligned(x) for x in (dout, q, k, v, out))
        lse = lse.contiguous()
        B, H, Lq, D = q.shape
        Hkv, Lk = k.shape[1], k.shape[2]
        dq = empty_like_heads(q, D)
        dk = empty_like_heads(k, D)
        dv = empty_like_heads(v, D)
        splits = plan_splits(B, Hkv, H // Hkv, Lq, Lk, D, self._num_sms(q.device), tiles=dq_tiles(D))
        self._extension().cuda_attn_bwd(
            dout, q, k, v, out, lse, dq, dk, dv, key_lengths, float(scale), bool(causal), splits
        )
        return dq, dk, dv, None


register(CudaBackend())
