"""Ahead-of-time compilation of every Triton kernel variant the dispatcher can launch, with a
check of what each costs on the chip.

Runs with no GPU: ``triton.compile`` with a ``GPUTarget`` lowers each variant to a cubin for
sm_80 / sm_90 with the tiles heuristics.py gives that architecture, and with the
specialisation the JIT applies on a typical launch (16-byte aligned pointers, strides divisible
by 16; ``--unaligned`` drops it). kernels/sass.py then reads the cubin back with Triton's
cuobjdump. A variant fails when a local-memory load or store (a register spill) sits inside a
loop, when it keeps more stack than ``STACK_SLACK`` bytes, when on sm_90 a loop multiplies
matrices without HGMMA (unless heuristics.MMA_SYNC_ON_SM90 names it, with the reason), or when
its shared memory exceeds the chip's limit. A kernel that would not build or fit on a GPU therefore fails here, in CI.

    python -m mhakern.kernels.aot [--arch 80 90] [--dtypes fp16 bf16 fp32] [--dims 16 32 64 80 128 256]
                                  [--all-flags] [--only fwd delta dkdv dq]

Prints one row per variant: tile, warps/stages, shared memory, registers, stack bytes, LDL
count, LDL/STL inside loops, loops with HGMMA / loops with a matrix instruction.
kernels/ imports nothing from mhakern, so the same module runs against another triton version
by path (``sys.path.insert(0, checkout); from kernels import aot; aot.main([...])``).

Must run without TRITON_INTERPRET (the interpreter replaces the kernels by Python functions);
the tests run it in a subprocess.
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from dataclasses import dataclass
from typing import List, Tuple

import torch

from . import sass

# Shared memory a block may use (opt-in maximum), bytes.
SMEM_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}

_TY = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def _ptr(dtype) -> str:
    return "*" + _TY[dtype]


ALL_DIMS = (16, 32, 64, 80, 128, 256)


@dataclass(frozen=True)
class Variant:
    name: str
    kernel: object
    signature: dict
    constexprs: dict
    num_warps: int
    num_stages: int


def variants(arch: int, dtypes=("fp16", "bf16", "fp32"), dims=ALL_DIMS, flags=((True, True),)):
    """Each kernel variant to build for ``arch``, with the tiles the heuristics give that arch.

    Covers every (kernel, dtype, head dim) asked for, with the largest row tile each uses (the
    decode tiles are smaller), for each (CAUSAL, HAS_KL) in ``flags`` (default: both on, the
    variant with the most code).
    """
    from .attention_bwd import _attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel, _bwd_delta_kernel
    from .attention_fwd import _attn_fwd_kernel, precision
    from .heuristics import dkdv_config, dq_config, fwd_config, head_block

    by_name = {v: k for k, v in _TY.items()}
    strides = lambda names: {n: "i32" for n in names}  # noqa: E731
    for ty, d, (causal, has_kl) in itertools.product(dtypes, dims, flags):
        dtype = by_name[ty]
        p = _ptr(dtype)
        tag = "" if (causal, has_kl) == (True, True) else f"/{'c' if causal else '-'}{'k' if has_kl else '-'}"
        common = {"D": d, "DV": d, "BLOCK_D": head_block(d), "BLOCK_DV": head_block(d), "CAUSAL": causal,
                  "HAS_KL": has_kl, "PREC": precision(dtype), "IDX64": False}
        cfg = fwd_config(d, d, dtype, arch)
        sig = {"Q": p, "K": p, "V": p, "O": p, "LSE": "*fp32", "KL": "*i32"}
        sig.update(strides(["stride_qb", "stride_qh", "stride_qm", "stride_kb", "stride_kh", "stride_kn",
                            "stride_vb", "stride_vh", "stride_vn", "stride_ob", "stride_oh", "stride_om",
                            "H", "Lq", "Lk", "n_rep", "heads_per_prog"]))
        sig["sm_scale"] = "fp32"
        ce = dict(common, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
        yield Variant(f"fwd/{ty}/d{d}{tag}", _attn_fwd_kernel, sig, ce, cfg.num_warps, cfg.num_stages)
        if tag == "":
            sig = {"O": p, "DO": p, "DELTA": "*fp32"}
            sig.update(strides(["stride_ob", "stride_oh", "stride_om", "stride_db", "stride_dh", "stride_dm", "H",
                                "Lq"]))
            ce = {"DV": d, "BLOCK_M": 64, "BLOCK_DV": head_block(d), "IDX64": False}
            yield Variant(f"delta/{ty}/d{d}", _bwd_delta_kernel, sig, ce, 4, 1)
        # dK/dV and dQ share their argument list but for the output pointers
        bwd_strides = ["stride_qb", "stride_qh", "stride_qm", "stride_kb", "stride_kh", "stride_kn",
                       "stride_vb", "stride_vh", "stride_vn", "stride_db", "stride_dh", "stride_dm"]
        cfg = dkdv_config(d, d, dtype, arch)
        sig = {"Q": p, "K": p, "V": p, "DO": p, "LSE": "*fp32", "DELTA": "*fp32", "DK": p, "DV_": p, "KL": "*i32"}
        sig.update(strides(bwd_strides + ["stride_dkb", "stride_dkh", "stride_dkn", "stride_dvb", "stride_dvh",
                                          "stride_dvn", "H", "Lq", "Lk", "n_rep", "heads_per_prog"]))
        sig["sm_scale"] = "fp32"
        ce = dict(common, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
        yield Variant(f"dkdv/{ty}/d{d}{tag}", _attn_bwd_dkdv_kernel, sig, ce, cfg.num_warps, cfg.num_stages)
        cfg = dq_config(d, d, dtype, arch)
        sig = {"Q": p, "K": p, "V": p, "DO": p, "LSE": "*fp32", "DELTA": "*fp32", "DQ": p, "KL": "*i32"}
        sig.update(strides(bwd_strides + ["stride_dqb", "stride_dqh", "stride_dqm", "H", "Lq", "Lk", "n_rep",
                                          "heads_per_prog"]))
        sig["sm_scale"] = "fp32"
        ce = dict(common, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
        yield Variant(f"dq/{ty}/d{d}{tag}", _attn_bwd_dq_kernel, sig, ce, cfg.num_warps, cfg.num_stages)


def divisible_args(signature) -> list:
    """Arguments the JIT marks divisible by 16 on a typical launch: every pointer (torch's
    allocations are 16-byte aligned) and every stride (contiguous tensors of a head dim that is
    a multiple of 16). Sizes (H, Lq, Lk, ...) are left arbitrary."""
    return [n for n, ty in signature.items() if ty.startswith("*") or n.startswith("stride_")]


def compile_variant(kernel, signature, constexprs, num_warps, num_stages, arch: int, aligned: bool = True):
    import triton
    from triton.backends.compiler import GPUTarget

    sig = dict(signature)
    for name in constexprs:
        sig[name] = "constexpr"
    # Every parameter must appear in the signature, in the kernel's order.
    ordered = {name: sig[name] for name in kernel.arg_names}
    attrs = {}
    if aligned:
        attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible_args(signature)}
    src = triton.compiler.ASTSource(fn=kernel, signature=ordered, constexprs=dict(constexprs), attrs=attrs)
    return triton.compile(
        src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "num_stages": num_stages}
    )


# Stack a variant may keep, provided no local load or store sits inside a loop: a few spill
# slots in the prologue or epilogue cost one access per program, not one per key block. Seen:
# 8-16 B in some small-head-dim variants (d16/d32), where ptxas keeps the register count at
# 80-128 and parks a scalar or two. Anything larger is a tile too big for its registers.
STACK_SLACK = 16


def check(v: Variant, arch: int, compiled, aligned: bool = True) -> Tuple[List[str], "sass.SassReport"]:
    """(why this compiled variant is not fit for the chip, empty when it is; its SASS report)."""
    problems = []
    smem = compiled.metadata.shared
    if smem > SMEM_LIMIT[arch]:
        problems.append(f"shared memory {smem} B over sm_{arch}'s {SMEM_LIMIT[arch]} B")
    rep = sass.inspect_cubin(compiled.asm["cubin"])
    # Without the alignment specialisation (strides not multiples of 16: head dims such as 40)
    # tiles load element by element and their prologue spills addresses; only the loops are
    # held to the no-local-memory rule there.
    if rep.local_in_loops or (aligned and rep.stack > STACK_SLACK):
        problems.append(f"{rep.stack} B of stack (register spills: {rep.ldl} LDL, {rep.local_in_loops} in loops)")
    # fp32 multiplies exactly (ieee, FMA): no matrix unit to ask for.
    from .heuristics import MMA_SYNC_ON_SM90, head_bucket

    key = (v.name.split("/")[0], "32" if v.constexprs.get("PREC") == "ieee" else "16",
           head_bucket(v.constexprs.get("D", 0), v.constexprs.get("DV", 0)))
    wants_hgmma = v.constexprs.get("PREC") != "ieee" and key not in MMA_SYNC_ON_SM90
    if arch >= 90 and wants_hgmma and rep.mma_loops > rep.hgmma_loops:
        problems.append(f"{rep.mma_loops - rep.hgmma_loops} matrix loop(s) without HGMMA")
    return problems, rep


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, nargs="+", default=[80, 90], help="compute capabilities (default: 80 90)")
    ap.add_argument("--dtypes", nargs="+", default=list(_TY.values()), choices=list(_TY.values()))
    ap.add_argument("--dims", type=int, nargs="+", default=list(ALL_DIMS), help="head dims (default: %(default)s)")
    ap.add_argument("--all-flags", action="store_true",
                    help="every (causal, key lengths) combination, not only both on")
    ap.add_argument("--only", nargs="+", default=None, help="kernels to build (fwd delta dkdv dq; default: all)")
    ap.add_argument("--unaligned", action="store_true",
                    help="compile without the JIT's divisibility specialisation (strides not multiples of 16)")
    args = ap.parse_args(argv)
    from . import INTERPRET

    if INTERPRET:
        print("aot: TRITON_INTERPRET is set; unset it to compile the real kernels", file=sys.stderr)
        return 2
    flags = list(itertools.product((True, False), repeat=2)) if args.all_flags else [(True, True)]
    failures = 0
    print(f"{'variant':<24} {'arch':>4} {'tile':>9} {'w/s':>4} {'smem KiB':>8} {'regs':>4} {'stack':>5} {'LDL':>4} "
          f"{'inloop':>6} {'HGMMA':>5}  status")
    for arch in args.arch:
        for v in variants(arch, args.dtypes, args.dims, flags):
            if args.only and v.name.split("/")[0] not in args.only:
                continue
            t0 = time.time()
            tile = f"{v.constexprs.get('BLOCK_M', '')}x{v.constexprs.get('BLOCK_N', '-')}"
            try:
                compiled = compile_variant(v.kernel, v.signature, v.constexprs, v.num_warps, v.num_stages, arch,
                                           aligned=not args.unaligned)
                problems, rep = check(v, arch, compiled, aligned=not args.unaligned)
                smem = compiled.metadata.shared / 1024
                figures = (f"{smem:>8.1f} {rep.regs:>4} {rep.stack:>5} {rep.ldl:>4} {rep.local_in_loops:>6} "
                           f"{rep.hgmma_loops:>2}/{rep.mma_loops:<2}")
                status = "; ".join(problems) if problems else f"ok ({time.time() - t0:.0f}s)"
            except Exception as e:  # report every failing variant, not just the first
                problems = [e]
                figures = f"{'':>8} {'':>4} {'':>5} {'':>4} {'':>6} {'':>5}"
                status = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            failures += bool(problems)
            print(f"{v.name:<24} {arch:>4} {tile:>9} {v.num_warps:>2}/{v.num_stages} {figures}  {status}", flush=True)
    print(f"aot: {failures} failing variant(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
