"""``mhakern.flex_attention``: torch's FlexAttention interface on mhakern's kernels.

Backends: ``"cpu"`` (the modifiers traced and generated into C++, mhakern/flex/graph.py and
build.py, run by csrc/flex/flex_kernel.cpp) and ``"reference"`` (plain PyTorch, dense, in
float32 -- float64 for float64 inputs -- with the modifiers called on broadcast index tensors).
``"auto"`` serves cpu tensors of float32 and bfloat16 on the cpu kernel, everything else on the
reference; a modifier the code generator cannot compile (an op it lacks, no C++ compiler) goes
to the reference with a warning, and under strict mode (:func:`mhakern.set_strict`, or
``kernel_options={"strict": True}``) raises instead. A modifier that reads a value out of a
tensor (data-dependent control flow, ``.item()``) is refused on every backend. ``"triton"``
(mhakern/flex/triton_backend.py: the same traces generated into ``@triton.jit``) serves CUDA
tensors, and ``auto`` picks it for them; on cpu tensors it runs only under the Triton
interpreter, for tests. The CUDA families do not serve flex.
"""
from __future__ import annotations

import ctypes
import math
import warnings
import weakref
from typing import Callable, List, Optional, Tuple

import torch

from .. import backends as _backends
from .._errors import ArgumentError, ArgumentTypeError, FallbackError
from . import build as _build
from . import graph as _graph

Tensor = torch.Tensor

#: kernel_options keys that mean something here (the rest are refused by name).
KERNEL_OPTIONS = {
    "BACKEND": "torch's backend choice; only 'AUTO' (its default) is accepted: the backend is mhakern's `backend`",
    "strict": "bool: refuse instead of falling back to the reference for this call (as mhakern.set_strict)",
}
_DEFAULT_BLOCK = 128

# Traces are kept per function object (weakly) and device: a modifier is traced once on each
# device its calls use (its arguments there, beside its captures: cuda:1's, not cuda:0's).
_TRACES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _flex_module():
    from torch.nn.attention import flex_attention as tflex

    return tflex


def _trace_cached(fn: Callable, is_score: bool, device="cpu"):
    dev = str(torch.device(device))
    try:
        per_device = _TRACES.setdefault(fn, {})
    except TypeError:  # not weak-referenceable: trace every call
        per_device = {}
    hit = per_device.get(dev)
    if hit is None:
        try:
            hit = _graph.trace(fn, is_score, dev)
        except _graph.Untraceable as e:
            hit = e
        per_device[dev] = hit
    if isinstance(hit, Exception):
        raise hit
    return hit


# ------------------------------------------------------------------------------------------
# Argument checks.

def _check_args(query, key, value, block_mask, scale, enable_gqa, return_lse, kernel_options, return_aux, backend):
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise ArgumentTypeError(f"{name}: expected a tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ArgumentError(f"{name}: expected 4 dims (B, H, L, D), got shape {tuple(t.shape)}")
    if not (query.dtype == key.dtype == value.dtype):
        raise ArgumentTypeError(f"query, key, value: dtypes differ ({query.dtype}, {key.dtype}, {value.dtype})")
    if not query.dtype.is_floating_point:
        raise ArgumentTypeError(f"query: expected a floating dtype, got {query.dtype}")
    if not (query.device == key.device == value.device):
        raise ArgumentError(f"query, key, value: devices differ ({query.device}, {key.device}, {value.device})")
    B, H, Lq, D = query.shape
    if key.shape[0] != B or value.shape[0] != B:
        raise ArgumentError(f"key, value: batch {key.shape[0]}, {value.shape[0]} differs from query's {B}")
    if key.shape[1] != value.shape[1] or key.shape[2] != value.shape[2]:
        raise ArgumentError(f"value: shape {tuple(value.shape)} does not match key {tuple(key.shape)} in heads and length")
    if key.shape[3] != D:
        raise ArgumentError(f"key: head dim {key.shape[3]} differs from query's {D}")
    if not isinstance(enable_gqa, bool):
        raise ArgumentTypeError(f"enable_gqa: expected a bool, got {type(enable_gqa).__name__}")
    Hkv = key.shape[1]
    if not enable_gqa and Hkv != H:
        raise ArgumentError(f"key: {Hkv} heads differ from query's {H}; set enable_gqa=True for GQA")
    if enable_gqa and (Hkv == 0 or H % Hkv != 0):
        raise ArgumentError(f"key: query heads {H} are not a multiple of key heads {Hkv} (enable_gqa)")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(float(scale))):
        raise ArgumentError(f"scale: expected None or a finite number, got {scale!r}")
    if not isinstance(return_lse, bool):
        raise ArgumentTypeError(f"return_lse: expected a bool, got {type(return_lse).__name__}")
    tflex = _flex_module()
    if return_aux is not None:
        if not isinstance(return_aux, tflex.AuxRequest):
            raise ArgumentTypeError(f"return_aux: expected None or torch's AuxRequest, got {type(return_aux).__name__}")
        if return_lse:
            raise ArgumentError("return_lse, return_aux: give one (return_lse is deprecated in torch for return_aux)")
        if return_aux.max_scores:
            raise ArgumentError("return_aux: max_scores is not supported by mhakern.flex_attention (lse is)")
    strict = False
    if kernel_options is not None:
        if not isinstance(kernel_options, dict):
            raise ArgumentTypeError(f"kernel_options: expected None or a dict, got {type(kernel_options).__name__}")
        for k, v in kernel_options.items():
            if k not in KERNEL_OPTIONS:
                raise ArgumentError(f"kernel_options: key {k!r} is not supported here (supported: "
                                    f"{', '.join(sorted(KERNEL_OPTIONS))})")
        if kernel_options.get("BACKEND", "AUTO") != "AUTO":
            raise ArgumentError(f"kernel_options: BACKEND={kernel_options['BACKEND']!r} is torch's; only 'AUTO' is "
                                "accepted (choose mhakern's backend with backend=)")
        strict = kernel_options.get("strict", False)
        if not isinstance(strict, bool):
            raise ArgumentTypeError(f"kernel_options: 'strict' must be a bool, got {type(strict).__name__}")
    if backend not in ("auto", "cpu", "triton", "reference"):
        raise ArgumentError(f"backend: expected 'auto', 'cpu', 'triton' or 'reference', got {backend!r}")
    if block_mask is not None:
        if not isinstance(block_mask, tflex.BlockMask):
            raise ArgumentTypeError(f"block_mask: expected torch's BlockMask, got {type(block_mask).__name__}")
        if tuple(block_mask.seq_lengths) != (Lq, key.shape[2]):
            raise ArgumentError(f"block_mask: made for (Q_LEN, KV_LEN) = {tuple(block_mask.seq_lengths)}, "
                                f"but the call has ({Lq}, {key.shape[2]})")
        mB, mH = block_mask.kv_num_blocks.shape[:2]
        if mB not in (1, B) or mH not in (1, H):
            raise ArgumentError(f"block_mask: batch and head dims ({mB}, {mH}) must be 1 or the query's ({B}, {H})")
        if block_mask.kv_num_blocks.device != query.device:
            raise ArgumentError(f"block_mask: on {block_mask.kv_num_blocks.device}, query on {query.device}")
        if getattr(block_mask, "mask_mod", None) is getattr(tflex, "_sliced_mask_mod_error", object()):
            raise ArgumentError("block_mask: a sliced BlockMask has no mask_mod to evaluate")
    return strict or _backends._STRICT


# ------------------------------------------------------------------------------------------
# Block structure (what the kernel reads): torch's BlockMask, or every block full.

class _Blocks:
    """The BlockMask's tensors as int32 contiguous, and its block sizes."""

    def __init__(self, block_mask, B, H, Lq, Lk):
        if block_mask is None:
            self.QBS = self.KVBS = _DEFAULT_BLOCK
            nq, nk = -(-Lq // self.QBS), -(-Lk // self.KVBS)
            z = torch.zeros(1, 1, nq, dtype=torch.int32)
            self.kv_num, self.kv_idx = z, torch.zeros(1, 1, nq, 1, dtype=torch.int32)
            self.fkv_num = torch.full((1, 1, nq), nk, dtype=torch.int32)
            self.fkv_idx = torch.arange(nk, dtype=torch.int32).expand(1, 1, nq, nk).contiguous()
            self.q_num, self.q_idx = torch.zeros(1, 1, nk, dtype=torch.int32), torch.zeros(1, 1, nk, 1, dtype=torch.int32)
            self.fq_num = torch.full((1, 1, nk), nq, dtype=torch.int32)
            self.fq_idx = torch.arange(nq, dtype=torch.int32).expand(1, 1, nk, nq).contiguous()
            self.mask_mod = None
        else:
            bs = block_mask.BLOCK_SIZE
            self.QBS, self.KVBS = (int(bs[0]), int(bs[1])) if isinstance(bs, (tuple, list)) else (int(bs), int(bs))
            c = lambda t: None if t is None else t.to(torch.int32).contiguous()  # noqa: E731
            self.kv_num, self.kv_idx = c(block_mask.kv_num_blocks), c(block_mask.kv_indices)
            self.fkv_num, self.fkv_idx = c(block_mask.full_kv_num_blocks), c(block_mask.full_kv_indices)
            self.q_num, self.q_idx = c(block_mask.q_num_blocks), c(block_mask.q_indices)
            self.fq_num, self.fq_idx = c(block_mask.full_q_num_blocks), c(block_mask.full_q_indices)
            tflex = _flex_module()
            self.mask_mod = None if block_mask.mask_mod is tflex.noop_mask else block_mask.mask_mod
            if self.q_num is None:
                raise ArgumentError("block_mask: has no q_num_blocks/q_indices (the transposed lists the backward needs)")
        nq, nk = -(-Lq // self.QBS), -(-Lk // self.KVBS)
        if self.kv_num.shape[-1] != nq or self.q_num.shape[-1] != nk:
            raise ArgumentError(f"block_mask: {self.kv_num.shape[-1]} x {self.q_num.shape[-1]} blocks of "
                                f"{self.QBS} x {self.KVBS} do not cover ({Lq}, {Lk})")
        self.mB, self.mH = self.kv_num.shape[0], self.kv_num.shape[1]

    def dense(self, Lq: int, Lk: int) -> Tuple[Tensor, Tensor]:
        """(partial, full) as bool (mB, mH, Lq, Lk) element masks (for the reference)."""
        def d(num, idx, nrow, ncol):
            out = torch.zeros(self.mB, self.mH, nrow, ncol + 1, dtype=torch.bool)
            if num is None:
                return out[..., :ncol]
            ar = torch.arange(idx.shape[-1])
            idx = torch.where(ar < num[..., None].long(), idx.long(), ncol)
            out.scatter_(-1, idx, True)
            return out[..., :ncol]
        nq, nk = -(-Lq // self.QBS), -(-Lk // self.KVBS)
        def up(m):
            return m.repeat_interleave(self.QBS, -2).repeat_interleave(self.KVBS, -1)[..., :Lq, :Lk]
        return up(d(self.kv_num, self.kv_idx, nq, nk)), up(d(self.fkv_num, self.fkv_idx, nq, nk))


# ------------------------------------------------------------------------------------------
# The reference: dense, the modifiers called on broadcast index tensors.

def reference(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False, upcast=True,
              work_dtype=None):
    """Plain PyTorch flex attention: ``(out, lse)``, out (B, H, Lq, Dv), lse (B, H, Lq) natural
    log. ``upcast`` computes in float64 (the oracle of the tests), else in float32 (float64
    inputs stay float64) or in ``work_dtype`` when given (the tolerance rule's "torch math in
    T"); out is returned in the working dtype when ``upcast``, else in the input dtype.
    Differentiable (q, k, v and whatever score_mod captures)."""
    B, H, Lq, D = query.shape
    Hkv, Lk = key.shape[1], key.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    wdt = torch.float64 if (upcast or query.dtype == torch.float64) else (work_dtype or torch.float32)
    q, k, v = query.to(wdt), key.to(wdt), value.to(wdt)
    if Hkv != H:
        k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    dev = query.device
    bi = torch.arange(B, device=dev, dtype=torch.int32).view(B, 1, 1, 1)
    hi = torch.arange(H, device=dev, dtype=torch.int32).view(1, H, 1, 1)
    qi = torch.arange(Lq, device=dev, dtype=torch.int32).view(1, 1, Lq, 1)
    ki = torch.arange(Lk, device=dev, dtype=torch.int32).view(1, 1, 1, Lk)
    if score_mod is not None:
        s = score_mod(s, bi, hi, qi, ki).to(wdt).expand(B, H, Lq, Lk)
    blocks = _Blocks(block_mask, B, H, Lq, Lk)
    partial, full = blocks.dense(Lq, Lk)
    visible = full.to(dev)
    if blocks.mask_mod is not None:
        visible = visible | (partial.to(dev) & blocks.mask_mod(bi, hi, qi, ki).to(torch.bool))
    else:
        visible = visible | partial.to(dev)
    s = s.masked_fill(~visible.expand(B, H, Lq, Lk), -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])  # rows with no key: exp(-inf) = 0
    out = p @ v
    if not upcast:
        out = out.to(query.dtype)
    return out, lse


# ------------------------------------------------------------------------------------------
# The cpu kernel.

class _Args(ctypes.Structure):
    _fields_ = ([("dtype", ctypes.c_int64)] + [(n, ctypes.c_int64) for n in ("B", "H", "Hkv", "Lq", "Lk", "D", "Dv")]
                + [("scale", ctypes.c_double)]
                + [(n, ctypes.c_void_p) for n in ("q", "k", "v", "dout", "out", "dq", "dk", "dv", "lse", "delta")]
                + [(n, ctypes.c_int64 * 3) for n in ("qs", "ks", "vs", "os", "dos", "dqs", "dks", "dvs")]
                + [(n, ctypes.c_int64) for n in ("QBS", "KVBS", "mB", "mH", "nqb", "nkb")]
                + [(n, ctypes.c_void_p) for n in ("kv_num", "kv_idx", "fkv_num", "fkv_idx")]
                + [("kv_w", ctypes.c_int64), ("fkv_w", ctypes.c_int64)]
                + [(n, ctypes.c_void_p) for n in ("q_num", "q_idx", "fq_num", "fq_idx")]
                + [("q_w", ctypes.c_int64), ("fq_w", ctypes.c_int64)]
                + [(n, ctypes.c_void_p) for n in ("cap_ptr", "cap_size", "cap_grad", "cap_numel")]
                + [("ncap", ctypes.c_int64), ("rt", ctypes.c_void_p), ("nthreads", ctypes.c_int64),
                   ("mask_reads_b", ctypes.c_int64), ("mask_reads_h", ctypes.c_int64), ("err", ctypes.c_char * 256)])


def _ptr(t: Optional[Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def _strides(t: Tensor):
    return (ctypes.c_int64 * 3)(t.stride(0), t.stride(1), t.stride(2))


class _Kernel:
    """One compiled modifier pair with the call's block structure and captures."""

    def __init__(self, entry, runtime: int, blocks: _Blocks, caps: List[Tensor], grad_caps: List[bool]):
        self.entry, self.runtime, self.blocks, self.caps_src, self.grad_caps = entry, runtime, blocks, caps, grad_caps
        # Whether mask_mod reads b and h (a mask that reads neither is evaluated once for all
        # heads: csrc/flex/flex_kernel.cpp's MaskCache).
        mask_t = _trace_cached(blocks.mask_mod, False) if blocks.mask_mod is not None else None
        self.mask_reads_b, self.mask_reads_h = _graph.reads(mask_t)[:2] if mask_t is not None else (False, False)
        # Captures as the generated code reads them: float32 or int64, contiguous.
        self.caps = [c.detach().to(torch.float32 if c.dtype.is_floating_point else torch.int64).contiguous()
                     for c in caps]
        self.cap_ptrs = (ctypes.c_void_p * max(1, len(caps)))(*[c.data_ptr() for c in self.caps])
        sizes = []
        for c in self.caps:
            sizes += list(c.shape) + [1] * (4 - c.dim())
        self.cap_sizes = (ctypes.c_int64 * max(1, len(sizes)))(*sizes)
        self.cap_numel = (ctypes.c_int64 * max(1, len(caps)))(*[c.numel() for c in self.caps])

    def _args(self, q, k, v, scale) -> _Args:
        a = _Args()
        b = self.blocks
        a.dtype = 0 if q.dtype == torch.float32 else 1
        a.B, a.H, a.Lq, a.D = q.shape
        a.Hkv, a.Lk, a.Dv = k.shape[1], k.shape[2], v.shape[3]
        a.scale = scale
        a.q, a.k, a.v = q.data_ptr(), k.data_ptr(), v.data_ptr()
        a.qs, a.ks, a.vs = _strides(q), _strides(k), _strides(v)
        a.QBS, a.KVBS, a.mB, a.mH = b.QBS, b.KVBS, b.mB, b.mH
        a.nqb, a.nkb = b.kv_num.shape[-1], b.q_num.shape[-1]
        a.kv_num, a.kv_idx, a.kv_w = _ptr(b.kv_num), _ptr(b.kv_idx), b.kv_idx.shape[-1]
        a.fkv_num, a.fkv_idx = _ptr(b.fkv_num), _ptr(b.fkv_idx)
        a.fkv_w = 0 if b.fkv_idx is None else b.fkv_idx.shape[-1]
        a.q_num, a.q_idx, a.q_w = _ptr(b.q_num), _ptr(b.q_idx), b.q_idx.shape[-1]
        a.fq_num, a.fq_idx = _ptr(b.fq_num), _ptr(b.fq_idx)
        a.fq_w = 0 if b.fq_idx is None else b.fq_idx.shape[-1]
        a.cap_ptr = ctypes.cast(self.cap_ptrs, ctypes.c_void_p)
        a.cap_size = ctypes.cast(self.cap_sizes, ctypes.c_void_p)
        a.cap_numel = ctypes.cast(self.cap_numel, ctypes.c_void_p)
        a.ncap = len(self.caps)
        a.rt = self.runtime
        a.nthreads = torch.get_num_threads()
        a.mask_reads_b, a.mask_reads_h = int(self.mask_reads_b), int(self.mask_reads_h)
        return a

    def forward(self, q, k, v, scale) -> Tuple[Tensor, Tensor]:
        B, H, Lq, _ = q.shape
        out = torch.empty(B, H, Lq, v.shape[3], dtype=q.dtype)
        lse = torch.empty(B, H, Lq, dtype=torch.float32)
        a = self._args(q, k, v, scale)
        a.out, a.os, a.lse = out.data_ptr(), _strides(out), lse.data_ptr()
        grads = (ctypes.c_void_p * max(1, len(self.caps)))()
        a.cap_grad = ctypes.cast(grads, ctypes.c_void_p)
        if self.entry.forward(ctypes.byref(a)) != 0:
            raise RuntimeError(f"mhakern.flex_attention cpu kernel: {a.err.decode(errors='replace')}")
        return out, lse

    def backward(self, dout, q, k, v, out, lse, scale):
        dout = dout if dout.stride(-1) == 1 else dout.contiguous()
        delta = (dout.float() * out.float()).sum(-1).contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        cg = [torch.zeros(c.shape, dtype=torch.float32) if want else None for c, want in zip(self.caps, self.grad_caps)]
        a = self._args(q, k, v, scale)
        a.dout, a.dos, a.delta, a.lse = dout.data_ptr(), _strides(dout), delta.data_ptr(), lse.data_ptr()
        a.dq, a.dqs, a.dk, a.dks, a.dv, a.dvs = (dq.data_ptr(), _strides(dq), dk.data_ptr(), _strides(dk),
                                                 dv.data_ptr(), _strides(dv))
        grads = (ctypes.c_void_p * max(1, len(self.caps)))(*[None if g is None else g.data_ptr() for g in cg])
        a.cap_grad = ctypes.cast(grads, ctypes.c_void_p)
        if self.entry.backward(ctypes.byref(a)) != 0:
            raise RuntimeError(f"mhakern.flex_attention cpu kernel: {a.err.decode(errors='replace')}")
        return dq, dk, dv, [None if g is None else g.to(src.dtype) for g, src in zip(cg, self.caps_src)]


class _FlexFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kernel, scale, q, k, v, *grad_caps):
        out, lse = kernel.forward(q, k, v, scale)
        ctx.kernel, ctx.scale = kernel, scale
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv, cap_grads = ctx.kernel.backward(dout, q, k, v, out, lse, ctx.scale)
        wanted = [g for g, w in zip(cap_grads, ctx.kernel.grad_caps) if w]
        return (None, None, dq, dk, dv, *wanted)


def _cpu_unusable(query) -> Optional[str]:
    if query.device.type != "cpu":
        return f"the cpu kernel takes cpu tensors, not {query.device} (backend='triton' serves CUDA tensors)"
    if query.dtype not in (torch.float32, torch.bfloat16):
        return f"the cpu kernel takes float32 and bfloat16, not {query.dtype}"
    return None


def _variant(score_mod, mask_mod):
    """Traces the modifiers (cached) and writes their C++ struct (graph.cpp): returns
    (source, captures, grad_caps). Raises Untraceable."""
    score_t = _trace_cached(score_mod, True) if score_mod is not None else None
    mask_t = _trace_cached(mask_mod, False) if mask_mod is not None else None
    # merge_captures renumbers the mask's references: work on a copy of the cached trace.
    if mask_t is not None:
        mask_t = _graph.Traced(list(mask_t.nodes), list(mask_t.inputs), mask_t.output, list(mask_t.captures))
    caps = _graph.merge_captures(score_t, mask_t)
    n_score = len(score_t.captures) if score_t is not None else 0
    # A learnable table's gradient code is generated whenever it requires grad (also under
    # no_grad: one library serves both).
    grad_caps = [i < n_score and c.requires_grad and c.dtype.is_floating_point for i, c in enumerate(caps)]
    # The generated code depends on the captures' kinds and ranks (and which want gradients).
    sig = "".join(f"// capture {i}: {'float' if c.dtype.is_floating_point else 'int'} rank {c.dim()} grad {int(g)}\n"
                  for i, (c, g) in enumerate(zip(caps, grad_caps)))
    return sig + _graph.cpp(score_t, mask_t, grad_caps, "MOD_NAME"), caps, grad_caps


def _cpu_kernel(score_mod, blocks: _Blocks, dtype: torch.dtype) -> _Kernel:
    """Traces, generates and compiles (each cached); raises Untraceable or CompileError."""
    source, caps, grad_caps = _variant(score_mod, blocks.mask_mod)
    for c in caps:
        if c.device.type != "cpu":
            raise _graph.Untraceable(f"a modifier captures a tensor on {c.device}; the cpu kernel reads captures on "
                                     "the cpu")
    runtime = _build.runtime()
    entry = _build.kernels([source])[0]
    return _Kernel(entry, runtime, blocks, caps, grad_caps)


def precompile(modifiers, dtype: torch.dtype = torch.float32) -> int:
    """Compiles the cpu kernels of several modifier pairs in one unit (one compiler run instead
    of one per pair; what is compiled already is skipped). ``modifiers``: an iterable of
    ``(score_mod, mask_mod)`` (either may be None; a BlockMask's ``mask_mod`` is its
    ``block_mask.mask_mod``); ``dtype``: float32 or bfloat16, the inputs' dtype (checked only:
    one library serves both). Returns how
    many pairs were given. Raises ArgumentError for a modifier that cannot be compiled."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ArgumentTypeError(f"dtype: expected torch.float32 or torch.bfloat16, got {dtype}")
    sources = []
    for score_mod, mask_mod in modifiers:
        try:
            sources.append(_variant(score_mod, mask_mod)[0])
        except _graph.Untraceable as e:
            raise ArgumentError(f"modifiers: {e}") from None
    _build.kernels(sources)
    return len(sources)


def flex_attention(query: Tensor, key: Tensor, value: Tensor, score_mod: Optional[Callable] = None,
                   block_mask=None, scale: Optional[float] = None, enable_gqa: bool = False,
                   return_lse: bool = False, kernel_options: Optional[dict] = None, *, return_aux=None,
                   backend: str = "auto"):
    """torch's ``flex_attention`` (torch.nn.attention.flex_attention, 2.13) on mhakern.

    Args:
        query: (B, H, Lq, D); key: (B, Hkv, Lk, D); value: (B, Hkv, Lk, Dv). Hkv == H unless
            ``enable_gqa`` (then H a multiple of Hkv; query head h reads KV head h // (H // Hkv)).
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score`` on the scaled score
            (float32), or None. May read captured tensors (``table[h, q_idx - kv_idx]``); those
            that require grad get their gradient.
        block_mask: torch's ``BlockMask`` (``create_block_mask`` or mhakern.flex's builders), any
            block sizes; None attends everywhere. Empty blocks are skipped, full blocks skip
            ``mask_mod``, partial blocks evaluate it.
        scale: multiplies ``q @ k^T``; default ``1 / sqrt(D)``.
        return_lse / return_aux: as torch: ``return_aux=AuxRequest(lse=True)`` returns
            ``(out, AuxOutput(lse=...))``, ``return_lse=True`` returns ``(out, lse)``.
        kernel_options: None or a dict of the keys in :data:`KERNEL_OPTIONS`.
        backend: "auto", "cpu", "triton" or "reference" (module docstring).

    Returns ``out`` (B, H, Lq, Dv) in query's dtype, and lse (B, H, Lq), float32 natural log
    (not differentiable). A row that sees no key: output 0, lse -inf, zero gradients.
    """
    # --- Triton hook (mhakern/flex/triton_backend.py): backend="triton", and "auto" on CUDA tensors.
    if backend == "triton" or (backend == "auto" and getattr(getattr(query, "device", None), "type", "") == "cuda"):
        from . import triton_backend

        served = triton_backend.serve(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
                                      kernel_options, return_aux, backend)
        if served is not None:
            return served
    # --- end of the Triton hook
    strict = _check_args(query, key, value, block_mask, scale, enable_gqa, return_lse, kernel_options, return_aux,
                         backend)
    if score_mod is not None and not callable(score_mod):
        raise ArgumentTypeError(f"score_mod: expected a callable or None, got {type(score_mod).__name__}")
    B, H, Lq, D = query.shape
    Lk = key.shape[2]
    sc = 1.0 / math.sqrt(D) if scale is None else float(scale)
    blocks = _Blocks(block_mask, B, H, Lq, Lk)
    why = None if backend == "reference" else _cpu_unusable(query)
    kernel = None
    if backend != "reference" and why is None:
        try:
            kernel = _cpu_kernel(score_mod, blocks, query.dtype)
        except _graph.Untraceable as e:
            if "reads a value out of a tensor" in str(e):
                raise ArgumentError(str(e)) from None
            why = str(e)
        except _build.CompileError as e:
            why = str(e)
    if kernel is None and backend != "reference":
        if backend == "cpu":
            raise ArgumentError(f"backend='cpu': {why}")
        if strict:
            raise FallbackError(f"flex_attention would fall back to the reference: {why}")
        if query.device.type == "cpu" and query.dtype in (torch.float32, torch.bfloat16):
            warnings.warn(f"mhakern.flex_attention: served by the plain-PyTorch reference: {why}", stacklevel=2)
    if kernel is not None:
        # Modules are not kept on the tensors: contiguous last dims are all the kernel needs.
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
        grad_caps = [c for c, w in zip(kernel.caps_src, kernel.grad_caps) if w]
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or grad_caps):
            out, lse = _FlexFn.apply(kernel, sc, q, k, v, *grad_caps)
        else:
            out, lse = kernel.forward(q, k, v, sc)
        _backends.note_served("cpu")
    else:
        out, lse = reference(query, key, value, score_mod, block_mask, sc, enable_gqa, upcast=False)
        lse = lse.detach().float() if query.dtype != torch.float64 else lse.detach()
        _backends.note_served("reference")
    if return_aux is not None:
        return out, _flex_module().AuxOutput(lse=lse if return_aux.lse else None, max_scores=None)
    if return_lse:
        return out, lse
    return out
