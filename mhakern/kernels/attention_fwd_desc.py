"""Fused attention forward through tensor descriptors (TMA on sm_90): the Hopper path of calls
without modes.

Same semantics and row tiles as :mod:`.attention_fwd` (the jit helpers of :mod:`.tiles` give
both the grid, the rows of a tile, key lengths, the visible key range and the last visible key); what differs
is how tiles move. Q, K and V are read, and O written, through 4-D descriptors over the caller's
(B, heads, L, head dim) tensors, with a box of one (batch, head) slab of BLOCK rows by the padded
head dim. On sm_90 each such load is one TMA copy into shared memory, issued by one thread and
pipelined by the compiler, instead of a tile of per-thread addresses; rows past L and columns
past the head dim read as zeros and are not written, so the boundary of each slab needs no mask.

What the descriptors do not give for free is handled here as the pointer path does:
* keys past ``key_lengths[b]`` but before Lk are real memory: their scores are masked, and their
  values are zeroed in the masked blocks, so a NaN stored there cannot reach ``out`` (the NaN
  contract: hidden keys contribute exactly nothing);
* decode shapes that pack the query heads of a KV head into one row tile (rows of several heads)
  are not one box: Q and O go through the pointer helpers there, K and V through descriptors.

Who gets this kernel: :func:`.heuristics.desc_eligible` (sm_90, fp16/bf16, no modes, strides that
TMA accepts). Host-side descriptors (``triton.tools.tensor_descriptor.TensorDescriptor``) are
used rather than ``tl.make_tensor_descriptor`` in the kernel, which would need a global scratch
allocator (``triton.set_allocator``) set by whoever calls us. Triton's interpreter implements
descriptors, which is how the tests run this kernel on CPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .heuristics import desc_config, head_block
from .launch import (
    arch_of,
    check_buffer,
    launch_geometry,
    needs_64bit_offsets,
    on_device,
    precision,
)
from .tiles import (
    elem_idx,
    key_length,
    key_range,
    last_visible_key,
    load_rows,
    row_tile,
    store_tile,
    unfold_rows_grid,
)

try:  # triton >= 3.4 (descriptors on the host side)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton: desc_eligible refuses every call
    TensorDescriptor = None


@triton.jit
def _desc_inner(
    acc, l_i, m_i, q, k_desc, v_desc, b, kvh, start, stop, kmax, lk_b, sm_scale,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    PREC: tl.constexpr,
):
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(start, stop, BLOCK_N):
        k = k_desc.load([b, kvh, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * sm_scale
        if MASKED:
            offs_n = start_n + offs_n0
            key_ok = offs_n < lk_b
            vis = key_ok[None, :] & (offs_n[None, :] <= kmax[:, None])
            s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet keeps m = -inf; shift by 0 there so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2((s - m_safe[:, None]) * 1.4426950408889634)
        alpha = tl.math.exp2((m_i - m_safe) * 1.4426950408889634)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = v_desc.load([b, kvh, start_n, 0]).reshape(BLOCK_N, BLOCK_DV)
        if MASKED:
            # Keys past key_lengths are real memory here (the pointer path loads them as zeros).
            v = tl.where(key_ok[:, None], v, 0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_desc_kernel(
    q_desc, k_desc, v_desc, o_desc, Q, O, LSE, KL,
    stride_qb, stride_qh, stride_qm, stride_ob, stride_oh, stride_om,
    H, Lq, Lk, n_rep, heads_per_prog, sm_scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_KL: tl.constexpr, PREC: tl.constexpr, IDX64: tl.constexpr,
    PACKED: tl.constexpr,
):
    pid_m, pid_h, b = unfold_rows_grid(H, Lq, heads_per_prog, BLOCK_M)
    r, row_ok, hh, i, i_lo, i_hi, kvh = row_tile(pid_m, pid_h, heads_per_prog, n_rep, Lq, BLOCK_M)
    lk_b = key_length(KL, b, Lk, HAS_KL)
    if PACKED:
        q = load_rows(Q + b.to(tl.int64) * stride_qb, hh, i, stride_qh, stride_qm, row_ok, D, BLOCK_D, IDX64)
    else:
        # One head per program: the rows are one box of the (b, head) slab, clipped at Lq.
        q = q_desc.load([b, pid_h, pid_m * BLOCK_M, 0]).reshape(BLOCK_M, BLOCK_D)
    kmax = last_visible_key(i, lk_b, Lq, CAUSAL)
    full, hi = key_range(i_lo, i_hi, lk_b, Lq, CAUSAL, BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    acc, l_i, m_i = _desc_inner(acc, l_i, m_i, q, k_desc, v_desc, b, kvh, 0, full, kmax, lk_b, sm_scale,
                                BLOCK_D, BLOCK_DV, BLOCK_N, False, PREC)
    acc, l_i, m_i = _desc_inner(acc, l_i, m_i, q, k_desc, v_desc, b, kvh, full, hi, kmax, lk_b, sm_scale,
                                BLOCK_D, BLOCK_DV, BLOCK_N, True, PREC)
    # As in attention_fwd: l = 0 exactly when the row saw no key; a NaN l stays NaN.
    seen = l_i != 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = (acc / l_safe[:, None]).to(O.dtype.element_ty)
    lse = tl.where(seen, m_i + tl.log(l_safe), float("-inf"))
    if PACKED:
        store_tile(O + b.to(tl.int64) * stride_ob, elem_idx(hh, IDX64) * stride_oh + elem_idx(i, IDX64) * stride_om,
                    row_ok, out, DV, BLOCK_DV)
    else:
        o_desc.store([b, pid_h, pid_m * BLOCK_M, 0], out.reshape(1, 1, BLOCK_M, BLOCK_DV))
    tl.store(LSE + (b.to(tl.int64) * H + hh) * Lq + i, lse, mask=row_ok)


def _descriptor(t, block_rows: int, block_cols: int):
    """4-D descriptor over ``t`` (B, heads, L, dim) with a (1, 1, block_rows, block_cols) box.

    TMA wants every stride but the last a multiple of 16 bytes; a dim of size one is never
    stepped over, so its stride (which torch leaves arbitrary) is replaced by a legal one."""
    align = 16 // t.element_size()
    strides = [s if n > 1 else align for n, s in zip(t.shape[:-1], t.stride()[:-1])] + [1]
    return TensorDescriptor(t, list(t.shape), strides, [1, 1, block_rows, block_cols])


def desc_forward(q, k, v, out, lse, scale: float, causal: bool, key_lengths=None):
    """The forward of :func:`.attention_fwd.attention_forward` through tensor descriptors, for
    the calls :func:`.heuristics.desc_eligible` accepts; same arguments, buffers and results."""
    B, H, Lq, D = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    check_buffer("out", out, (B, H, Lq, Dv), q.dtype, q)
    check_buffer("lse", lse, (B, H, Lq), torch.float32, q, contiguous=True)
    cfg = desc_config(D, Dv, q.dtype, arch_of(q))
    hpp, bm, grid = launch_geometry(B, H, Hkv, Lq, cfg.block_m)
    bd, bdv = head_block(D), head_block(Dv)
    kl = key_lengths if key_lengths is not None else lse  # unused pointer when HAS_KL is False
    with on_device(q):
        _attn_fwd_desc_kernel[grid](
            _descriptor(q, bm, bd), _descriptor(k, cfg.block_n, bd), _descriptor(v, cfg.block_n, bdv),
            _descriptor(out, bm, bdv), q, out, lse, kl,
            q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1), out.stride(2),
            H, Lq, Lk, H // Hkv, hpp, scale,
            D=D, DV=Dv, BLOCK_D=bd, BLOCK_DV=bdv, BLOCK_M=bm, BLOCK_N=cfg.block_n,
            CAUSAL=causal, HAS_KL=key_lengths is not None, PREC=precision(q.dtype),
            IDX64=needs_64bit_offsets(q, out), PACKED=hpp > 1,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return out, lse


#: The kernel of this module by the AOT check's name (mhakern/kernels/aot.py).
KERNELS = {"desc": _attn_fwd_desc_kernel}

__all__ = ["desc_forward", "KERNELS"]
