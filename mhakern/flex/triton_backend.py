"""``flex_attention(..., backend="triton")``: the traced modifiers generated into Triton kernels
(triton_gen.py, triton_kernels.py), launched on CUDA tensors, or on CPU tensors through
Triton's interpreter when TRITON_INTERPRET=1 was set before Triton was imported.

The generated module is written once per source hash under ``<mhakern cache>/flex_triton/``
(``@triton.jit`` needs a file to read its functions' source) and imported; a process keeps the
modules it imported. Captured tables that require grad get their gradient from the per-score
adjoints the dK/dV kernel stores, summed by ``index_put_(accumulate=True)`` under torch's
deterministic mode (a sort-based fixed order on CUDA, a serial loop on CPU): the backward is
bit-identical run to run. Those buffers are dense, 12 bytes per (b, h, i, j) and per load node
that feeds a wanted gradient, and exist only while such a table requires grad.
"""
from __future__ import annotations

import importlib.util
import math
import os
import tempfile
import warnings
from typing import Callable, List, Optional

import torch

from .. import backends as _backends
from .._errors import ArgumentError, ArgumentTypeError, FallbackError
from . import api as _api
from . import graph as _graph
from . import triton_gen

Tensor = torch.Tensor

_MODULES = {}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def unusable(query: Tensor) -> Optional[str]:
    """Why the Triton kernels cannot take ``query``'s call, or None."""
    try:
        import triton  # noqa: F401
    except Exception as e:  # noqa: BLE001 -- ImportError, or a Triton that fails to initialise
        return f"triton could not be imported ({type(e).__name__}: {e})"
    if query.device.type == "cuda":
        return None
    if query.device.type == "cpu" and _interpreting():
        return None
    return (f"the Triton kernels take CUDA tensors, not {query.device} (CPU tensors only under "
            "TRITON_INTERPRET=1, set before Triton is imported)")


def _module(text: str):
    key = _graph.source_hash(text)
    mod = _MODULES.get(key)
    if mod is not None:
        return mod
    from .. import _build

    d = os.path.join(_build.cache_dir(), "flex_triton")
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, f"flex_{key}.py")
    if not os.path.exists(path):
        # Written whole and renamed: another process compiling the same modifier reads either
        # nothing or the complete file.
        fd, tmp = tempfile.mkstemp(dir=d, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    spec = importlib.util.spec_from_file_location(f"mhakern_flex_triton_{key}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    _MODULES[key] = mod
    return mod


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _tile(block: int, cap: int) -> int:
    """Rows (or keys) per tile inside a mask block of ``block``: the largest power of two at
    most ``cap`` dividing it, 16 at least (tl.dot's minimum); a tile that does not divide the
    block has its rows past the block masked, so any block size works."""
    t = 16
    while t * 2 <= cap and block % (t * 2) == 0:
        t *= 2
    return t


# Tiles per kernel and input width: (rows, keys, warps). From compiling the kernels for sm_80
# and sm_90 with no GPU (triton.compile with a GPUTarget, as mhakern/kernels/aot.py does) for a
# modifier with a captured table, its gradient and a gathered mask, D 64, and reading the SASS
# for local memory inside loops (register spills): none at these tiles (dK/dV at 32x64 kept 6 on
# sm_80, dQ at 64x64 kept 4). python -m mhakern.flex.triton_aot repeats the check.
_TILES = {
    ("fwd", 2): (64, 64, 8), ("dq", 2): (64, 32, 8), ("dkdv", 2): (32, 32, 8),
    ("fwd", 4): (32, 32, 4), ("dq", 4): (32, 32, 4), ("dkdv", 4): (16, 16, 4),
}


class _Kernel:
    """One generated module with the call's block structure and captures."""

    def __init__(self, mod, n_grad: int, blocks, caps: List[Tensor], grad_caps: List[bool], loads: List[int],
                 device, B: int, H: int):
        self.mod, self.n_grad, self.blocks, self.caps_src, self.grad_caps = mod, n_grad, blocks, caps, grad_caps
        self.loads = loads  # per gradient buffer pair, the capture it belongs to
        self.caps = [c.detach().to(device=device, dtype=torch.float32 if c.dtype.is_floating_point else torch.int64)
                     .contiguous() for c in caps]
        self.cap_args = []
        for c in self.caps:
            self.cap_args += [c, *c.shape, c.numel()]

        def lists(num, idx, nrow):
            if num is None:
                return None
            num = num.to(device).expand(B, H, nrow)
            idx = idx.to(device).expand(B, H, nrow, idx.shape[-1])
            return num, idx, (num.stride(0), num.stride(1), idx.stride(0), idx.stride(1), idx.stride(2))

        b = blocks
        self.kv = lists(b.kv_num, b.kv_idx, b.kv_num.shape[-1])
        self.fkv = lists(b.fkv_num, b.fkv_idx, b.kv_num.shape[-1])
        self.q = lists(b.q_num, b.q_idx, b.q_num.shape[-1])
        self.fq = lists(b.fq_num, b.fq_idx, b.q_num.shape[-1])
        self.QBS, self.KVBS = b.QBS, b.KVBS

    def _geometry(self, kernel: str, q):
        """(BLOCK_M, BLOCK_N, num_warps) of ``kernel``: "fwd", "dq" or "dkdv"."""
        bm, bn, warps = _TILES[(kernel, 4 if q.dtype == torch.float32 else 2)]
        return _tile(self.QBS, bm), _tile(self.KVBS, bn), warps

    def _consts(self, D, Dv, q, kernel):
        # 16-bit products on the tensor cores; not bf16 under the interpreter (its bf16 tl.dot is wrong).
        lowp = q.dtype == torch.float16 or (q.dtype == torch.bfloat16 and q.device.type == "cuda")
        bm, bn, warps = self._geometry(kernel, q)
        return dict(D=D, DV=Dv, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, BLOCK_D=max(16, _pow2(D)),
                    BLOCK_DV=max(16, _pow2(Dv)), HAS_MASK=self.blocks.mask_mod is not None,
                    HAS_SCORE=self.has_score, LOWP=lowp)

    @staticmethod
    def _list_args(main, full):
        f = full if full is not None else main
        return [main[0], main[1], f[0], f[1]], [*main[2], *f[2]]

    def forward(self, q, k, v, scale):
        B, H, Lq, D = q.shape
        Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
        out = torch.empty(B, H, Lq, Dv, dtype=q.dtype, device=q.device)
        lse = torch.empty(B, H, Lq, dtype=torch.float32, device=q.device)
        ptrs, strides = self._list_args(self.kv, self.fkv)
        consts = self._consts(D, Dv, q, "fwd")
        nsub = -(-self.QBS // consts["BLOCK_M"])
        grid = (self.kv[0].shape[-1] * nsub, B * H)
        self.mod.flex_fwd[grid](q, k, v, out, lse, *ptrs, *self.cap_args,
                                *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], *strides,
                                H, H // Hkv, Lq, Lk, self.blocks.QBS, self.blocks.KVBS, nsub, scale,
                                HAS_FULL=self.fkv is not None, **consts)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, scale):
        B, H, Lq, D = q.shape
        Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
        dout = dout if dout.stride(-1) == 1 else dout.contiguous()
        delta = (dout.float() * out.float()).sum(-1).contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        want = any(self.grad_caps)
        if want and self.n_grad and Lq * Lk >= 2**31:
            raise ArgumentError(f"score_mod: the gradient of a captured tensor at Lq * Lk = {Lq * Lk} (2**31 or more) "
                                "is beyond the Triton kernels' per-score buffers; use backend='cpu'")
        gbuf = []
        for _ in range(max(self.n_grad, 1)):
            n = B * H * Lq * Lk if (want and self.n_grad) else 1
            gbuf += [torch.zeros(n, dtype=torch.float32, device=q.device), torch.zeros(n, dtype=torch.int64,
                                                                                         device=q.device)]
        consts = self._consts(D, Dv, q, "dq")
        ptrs, strides = self._list_args(self.kv, self.fkv)
        nsub = -(-self.QBS // consts["BLOCK_M"])
        self.mod.flex_dq[(self.kv[0].shape[-1] * nsub, B * H)](
            q, k, v, dout, dq, lse, delta, *ptrs, *self.cap_args, *gbuf,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3], *dq.stride()[:3], *strides,
            H, H // Hkv, Lq, Lk, self.blocks.QBS, self.blocks.KVBS, nsub, scale, HAS_FULL=self.fkv is not None,
            **consts)
        ptrs, strides = self._list_args(self.q, self.fq)
        consts = self._consts(D, Dv, q, "dkdv")
        nsub = -(-self.KVBS // consts["BLOCK_N"])
        self.mod.flex_dkdv[(self.q[0].shape[-1] * nsub, B * Hkv)](
            q, k, v, dout, dk, dv, lse, delta, *ptrs, *self.cap_args, *gbuf,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3], *dk.stride()[:3],
            *dv.stride()[:3], *strides, H, Hkv, H // Hkv, Lq, Lk, self.blocks.QBS, self.blocks.KVBS, nsub, scale,
            HAS_FULL=self.fq is not None, CAP_GRAD=bool(want and self.n_grad), **consts)
        cap_grads = []
        for i, (c, w) in enumerate(zip(self.caps, self.grad_caps)):
            if not w:
                cap_grads.append(None)
                continue
            g = torch.zeros(c.numel(), dtype=torch.float32, device=q.device)
            prev = torch.are_deterministic_algorithms_enabled()
            warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
            try:
                # index_put_ accumulates in a fixed order under deterministic mode.
                torch.use_deterministic_algorithms(True)
                for k_, cap in enumerate(self.loads):
                    if cap == i:
                        g.index_put_((gbuf[2 * k_ + 1],), gbuf[2 * k_], accumulate=True)
            finally:
                torch.use_deterministic_algorithms(prev, warn_only=warn_only)
            cap_grads.append(g.view(c.shape).to(self.caps_src[i].dtype))
        return dq, dk, dv, cap_grads


def _kernel(score_mod: Optional[Callable], blocks, device, B: int, H: int) -> _Kernel:
    """Traces (cached per function, as the cpu backend), generates and imports (cached by
    hash). Raises Untraceable."""
    score_t = _api._trace_cached(score_mod, True, device) if score_mod is not None else None
    mask_t = _api._trace_cached(blocks.mask_mod, False, device) if blocks.mask_mod is not None else None
    if mask_t is not None:  # merge_captures renumbers the mask's references: a copy of the cached trace
        mask_t = _graph.Traced(list(mask_t.nodes), list(mask_t.inputs), mask_t.output, list(mask_t.captures))
    if score_t is not None:
        score_t = _graph.Traced(list(score_t.nodes), list(score_t.inputs), score_t.output, list(score_t.captures))
    caps = _graph.merge_captures(score_t, mask_t)
    for c in caps:
        if c.device != torch.device(device):
            raise _graph.Untraceable(f"a modifier captures a tensor on {c.device}; the Triton kernels read captures "
                                     f"on the inputs' device ({device})")
    if score_t is not None:
        score_t.captures = caps
    # Only score_mod's captures can have a gradient (mask_mod's values are piecewise constant).
    n_score = len(_api._trace_cached(score_mod, True, device).captures) if score_mod is not None else 0
    grad_caps = [i < n_score and c.requires_grad and c.dtype.is_floating_point for i, c in enumerate(caps)]
    text, loads = triton_gen.source(score_t, mask_t, grad_caps)
    k = _Kernel(_module(text), len(loads), blocks, caps, grad_caps, loads, device, B, H)
    k.has_score = score_t is not None
    return k


def serve(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse, kernel_options, return_aux,
          backend):
    """mhakern.flex_attention on the Triton kernels (the arguments and results of
    :func:`mhakern.flex.api.flex_attention`), for ``backend`` "triton" or "auto" (api.py routes
    CUDA tensors here under "auto"). ``"triton"`` refuses (ArgumentError) where Triton cannot
    run or the modifier cannot be generated. ``"auto"`` returns None there, after a warning
    (FallbackError under strict mode), and api.py serves the call by the reference. A modifier
    that reads a value out of a tensor is refused on every backend."""
    strict = _api._check_args(query, key, value, block_mask, scale, enable_gqa, return_lse, kernel_options,
                              return_aux, "auto")
    if score_mod is not None and not callable(score_mod):
        raise ArgumentTypeError(f"score_mod: expected a callable or None, got {type(score_mod).__name__}")
    B, H, Lq, D = query.shape
    Lk = key.shape[2]
    blocks = _api._Blocks(block_mask, B, H, Lq, Lk)
    why = unusable(query)
    kernel = None
    if why is None:
        try:
            kernel = _kernel(score_mod, blocks, query.device, B, H)
        except _graph.Untraceable as e:
            if "reads a value out of a tensor" in str(e):
                raise ArgumentError(str(e)) from None
            why = str(e)
    if kernel is None:
        if backend == "triton":
            raise ArgumentError(f"backend='triton': {why}")
        if strict:
            raise FallbackError(f"flex_attention would fall back to the reference: {why}")
        warnings.warn(f"mhakern.flex_attention: served by the plain-PyTorch reference: {why}", stacklevel=3)
        return None
    sc = 1.0 / math.sqrt(D) if scale is None else float(scale)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    # Rows are addressed in int32 inside one (batch, head): refuse what would overflow.
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.shape[2] * abs(t.stride(2)) + t.shape[3] >= 2**31:
            raise ArgumentError(f"{name}: one head spans 2**31 elements or more; the Triton flex kernels "
                                "address rows in 32 bits (use backend='cpu' or shorter sequences)")
    grad_caps = [c for c, w in zip(kernel.caps_src, kernel.grad_caps) if w]
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or grad_caps):
        out, lse = _api._FlexFn.apply(kernel, sc, q, k, v, *grad_caps)  # the cpu kernel's autograd: same interface
    else:
        out, lse = kernel.forward(q, k, v, sc)
    _backends.note_served("triton")
    if return_aux is not None:
        return out, _api._flex_module().AuxOutput(lse=lse if return_aux.lse else None, max_scores=None)
    if return_lse:
        return out, lse
    return out


__all__ = ["serve", "unusable"]
