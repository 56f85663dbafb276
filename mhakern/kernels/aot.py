"""Ahead-of-time compilation of every Triton kernel variant the dispatcher can launch, with a
check of what each costs on the chip.

Runs with no GPU: ``triton.compile`` with a ``GPUTarget`` lowers each variant to a cubin for
sm_80 / sm_90 with the tiles heuristics.py gives that architecture, and with the
specialisation the JIT applies on a typical launch: 16-byte aligned pointers, and strides
divisible by 16 when the head dims are multiples of 16 (see ``divisible_args``; ``--unaligned``
drops it all). mhakern/kernels/sass.py then reads the cubin back with Triton's cuobjdump. A variant
fails when a local-memory load or store (a register spill) sits inside a loop, when it keeps
more stack than ``STACK_SLACK`` bytes (head dims multiples of 16), when on sm_90 a loop
multiplies matrices without HGMMA (unless heuristics.MMA_SYNC_ON_SM90, or for a mode variant
MMA_SYNC_MODES_ON_SM90, names it, with the reason), when the tensor-descriptor forward has no TMA load in a loop, or when its shared
memory exceeds the chip's limit. A kernel that would not build or fit on a GPU therefore fails
here, in CI.

    python -m mhakern.kernels.aot [--arch 80 90] [--dtypes fp16 bf16 fp32] [--dims 16 32 40 64 ...]
                                  [--all-flags] [--only fwd fwdsplit desc delta dkdv dq fused KERNEL+MODE]
                                  [--tile M N WARPS STAGES] [--no-plain]
                                  [--modes [band mask1 mask2 mask2grad dropout softcap alibi modifiers varlen
                                            cache_idx paged all]]

``--modes`` also builds the mode variants (``_attn_fwd_modes_kernel`` and the three backward
ones; the split-K forward for the score modifiers' sets) with the tiles heuristics.tile_config
gives those modes on each arch (``--modes`` alone: every set in MODE_SETS); ``--no-plain``
leaves out the plain kernels.

Prints one row per variant: tile, warps/stages, shared memory, registers, stack bytes, LDL
count, LDL/STL inside loops, loops with HGMMA / loops with a matrix instruction, TMA loads, the
SASS's instruction count and digest (sass.SassReport: equal digests, the same machine code).
fp32 variants (FMA code, no tensor cores) take one to three minutes each on a busy two-core
machine: ``--dtypes fp32`` builds them, the CI test does not.
mhakern/kernels/ imports nothing from the rest of mhakern but the capability table (_caps.py,
plain data beside it), so the same module runs against another
triton version by path (``sys.path.insert(0, checkout + "/mhakern"); from kernels import aot;
aot.main([...])``).

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
from .heuristics import TileConfig

# Shared memory a block may use (opt-in maximum), bytes.
SMEM_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}

_TY = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def _ptr(dtype) -> str:
    return "*" + _TY[dtype]


# Head dims compiled by default: each bucket of the tile table at its largest dim, multiples of 16
# (aligned strides) and not (40, 100, 200: strides the JIT cannot mark), and a padded one (80).
ALL_DIMS = (16, 32, 40, 64, 80, 100, 128, 200, 256)


@dataclass(frozen=True)
class Variant:
    name: str  # "kernel/dtype/dD[/flags][+modes]": the kernel's key is the first field
    kernel: object
    signature: dict
    constexprs: dict
    num_warps: int
    num_stages: int


# Pointer arguments of the kernels by name (the rest are i32 sizes and strides, or fp32 scales).
_FP32_PTRS = {"LSE", "DELTA", "OP", "LSEP", "DQACC"}
_DATA_PTRS = {"Q", "K", "V", "O", "DO", "DK", "DV_", "DQ"}
_OTHER_PTRS = {"KL": "*i32", "MASK": "*u8", "DMASK": "*fp32", "SEM": "*i32", "SLOPES": "*fp32", "CUQ": "*i32",
               "CUK": "*i32", "CBI": "*i32", "BT": "*i32"}
_FP32_SCALARS = {"softcap"}  # besides the ``*scale*`` ones
# The mask pointer's type per MASK_KIND: without a mask the launchers pass an fp32 buffer
# (lse or delta) in its place, a bool mask travels as its uint8 view, a float mask is fp32.
_MASK_PTR = {0: "*fp32", 1: "*u8", 2: "*fp32"}

# Mode sets compiled by ``--modes``: name -> the modes kernels' constexprs (the rest off).
# "mask2grad" is the dQ kernel's (it writes the float mask's gradient); "all" turns on every
# mode at once (float mask, and its gradient in dQ), the variant with the most code.
MODE_SETS = {
    "band": dict(BAND=True, TOP_LEFT=True),
    "mask1": dict(MASK_KIND=1),
    "mask2": dict(MASK_KIND=2),
    "mask2grad": dict(MASK_KIND=2, MASK_GRAD=True),
    "dropout": dict(DROPOUT=True),
    # The score modifiers (softcap, ALiBi): switches of the modes kernels and of the split-K
    # forward ("fwdsplit+modifiers"), which is built for the sets whose switches it has.
    "softcap": dict(SOFTCAP=True),
    "alibi": dict(ALIBI=True),
    "modifiers": dict(SOFTCAP=True, ALIBI=True),
    # Packed sequences: the modes kernels' per-sequence bounds and offsets.
    "varlen": dict(VARLEN=True),
    # The KV cache (forward only): rows through cache_batch_idx, or pages through a block
    # table, in the modes forward and the split-K one.
    "cache_idx": dict(CACHE_IDX=True),
    "paged": dict(PAGED=True),
    "all": dict(BAND=True, TOP_LEFT=True, MASK_KIND=2, DROPOUT=True, MASK_GRAD=True, SOFTCAP=True, ALIBI=True),
}

_SIZES = {"H"}  # upper-case names that are not pointers


def signature_of(kernel, dtype, descs=None) -> dict:
    """Triton signature of ``kernel``'s runtime arguments, in its order: data pointers in
    ``dtype``, LSE/DELTA fp32, key lengths i32, any ``*scale*`` fp32, every other scalar i32;
    ``descs`` gives the type of descriptor arguments ("tensordesc<fp16[1,1,128,64]>")."""
    import inspect

    sig = {}
    for name, param in inspect.signature(kernel.fn).parameters.items():
        if "constexpr" in str(param.annotation):
            continue
        if descs and name in descs:
            sig[name] = descs[name]
        elif name in _DATA_PTRS:
            sig[name] = _ptr(dtype)
        elif name in _FP32_PTRS:
            sig[name] = "*fp32"
        elif name in _OTHER_PTRS:
            sig[name] = _OTHER_PTRS[name]
        elif name.isupper() and name not in _SIZES:
            raise ValueError(f"aot: {kernel.fn.__name__} takes {name}, a pointer of unknown type: name it in _OTHER_PTRS")
        else:
            sig[name] = "fp32" if ("scale" in name or name in _FP32_SCALARS) else "i32"
    return sig


def constexpr_defaults(kernel) -> dict:
    """Constexpr parameters with a default (optional modes): the plain call's values."""
    import inspect

    return {n: p.default for n, p in inspect.signature(kernel.fn).parameters.items()
            if "constexpr" in str(p.annotation) and p.default is not inspect.Parameter.empty}


def variants(arch: int, dtypes=("fp16", "bf16", "fp32"), dims=ALL_DIMS, flags=((True, True),), tile=None,
             modes=(), plain=True):
    """Each kernel variant to build for ``arch``, with the tiles the heuristics give that arch.

    Covers every (kernel, dtype, head dim) asked for, with the largest row tile each uses (the
    decode tiles are smaller), for each (CAUSAL, HAS_KL) in ``flags`` (default: both on, the
    variant with the most code), optional modes off. On sm_90 the tensor-descriptor forward
    too ("desc", fp16/bf16, the head dims TMA can address). ``tile``: a TileConfig to try
    instead of the table's. ``modes``: names of MODE_SETS to build as mode variants too (the
    "+name" ones), each with its own tiles; ``plain``: whether to build the plain kernels.
    """
    from . import attention_bwd, attention_fwd, attention_fwd_desc
    from .heuristics import desc_config, dkdv_config, dq_config, fused_config, fwd_config, head_block
    from .launch import precision

    K = dict(attention_fwd.KERNELS, **attention_fwd_desc.KERNELS, **attention_bwd.KERNELS)

    pick = (lambda f: lambda *a, **kw: tile or f(*a, **kw))  # noqa: E731
    dkdv_config, dq_config, fwd_config, desc_config, fused_config = map(
        pick, (dkdv_config, dq_config, fwd_config, desc_config, fused_config))

    by_name = {v: k for k, v in _TY.items()}
    for ty, d, (causal, has_kl) in itertools.product(dtypes, dims, flags):
        dtype = by_name[ty]
        tag = "" if (causal, has_kl) == (True, True) else f"/{'c' if causal else '-'}{'k' if has_kl else '-'}"
        bd = head_block(d)
        common = {"D": d, "DV": d, "BLOCK_D": bd, "BLOCK_DV": bd, "CAUSAL": causal,
                  "HAS_KL": has_kl, "PREC": precision(dtype), "IDX64": False}

        def make(name, kernel, cfg, ce, descs=None):
            ce = dict(constexpr_defaults(kernel), **ce)
            sig = signature_of(kernel, dtype, descs)
            if "MASK" in sig:
                sig["MASK"] = _MASK_PTR[ce.get("MASK_KIND", 0)]
            return Variant(name, kernel, sig, ce, cfg.num_warps, cfg.num_stages)

        for mode in modes:
            ms = MODE_SETS[mode]
            kw = dict(band=ms.get("BAND", False), mask_kind=ms.get("MASK_KIND", 0), dropout=ms.get("DROPOUT", False),
                      modified=ms.get("SOFTCAP", False) or ms.get("ALIBI", False))
            for name, kernel, config in (("fwd", K["fwd+modes"], fwd_config),
                                         ("fwdsplit", K["fwdsplit"], fwd_config),
                                         ("dkdv", K["dkdv+modes"], dkdv_config),
                                         ("dq", K["dq+modes"], dq_config),
                                         ("fused", K["fused+modes"], fused_config)):
                ce = {n: val for n, val in ms.items() if n in constexpr_defaults(kernel)}
                if mode == "mask2grad" and "MASK_GRAD" not in ce:
                    continue  # the mask's gradient is the dQ kernel's (or the fused one's)
                if not ce:
                    continue  # a set none of whose switches this kernel has (varlen: the split-K forward)
                if name == "fwdsplit" and len(ce) < len(ms):
                    continue  # the split forward takes the score modifiers only
                cfg = tile or config(d, d, dtype, arch, **kw)
                yield make(f"{name}/{ty}/d{d}{tag}+{mode}", kernel, cfg,
                           dict(common, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **ce))
        if not plain:
            continue

        cfg = fwd_config(d, d, dtype, arch)
        yield make(f"fwd/{ty}/d{d}{tag}", K["fwd"], cfg, dict(common, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n))
        # The same forward split over the keys (decode: few row tiles, long keys).
        yield make(f"fwdsplit/{ty}/d{d}{tag}", K["fwdsplit"], cfg,
                   dict(common, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n))
        # TMA: rows of a multiple of 16 bytes (the launcher's predicate, heuristics.desc_eligible)
        if arch >= 90 and ty != "fp32" and (d * dtype.itemsize) % 16 == 0:
            cfg = desc_config(d, d, dtype, arch)
            box = lambda rows: f"tensordesc<{ty}[1,1,{rows},{bd}]>"  # noqa: E731
            descs = {"q_desc": box(cfg.block_m), "o_desc": box(cfg.block_m), "k_desc": box(cfg.block_n),
                     "v_desc": box(cfg.block_n)}
            yield make(f"desc/{ty}/d{d}{tag}", K["desc"], cfg,
                       dict(common, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, PACKED=False), descs)
        if tag == "":
            ce = {"DV": d, "BLOCK_M": 64, "BLOCK_DV": bd, "IDX64": False}
            yield make(f"delta/{ty}/d{d}", K["delta"], TileConfig(64, 0, 4, 1), ce)
        cfg = dkdv_config(d, d, dtype, arch)
        yield make(f"dkdv/{ty}/d{d}{tag}", K["dkdv"], cfg,
                   dict(common, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n))
        cfg = dq_config(d, d, dtype, arch)
        yield make(f"dq/{ty}/d{d}{tag}", K["dq"], cfg, dict(common, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n))
        # The fused backward, deterministic (its wait and release around each dQ add; the atomic
        # variant is the same code without them).
        cfg = fused_config(d, d, dtype, arch)
        yield make(f"fused/{ty}/d{d}{tag}", K["fused"], cfg,
                   dict(common, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n))


def divisible_args(signature, strides_too: bool = True) -> list:
    """Arguments the JIT marks divisible by 16 on a typical launch: every pointer (torch's
    allocations are 16-byte aligned) and, with ``strides_too``, every stride.

    The JIT's divisibility is that of the integer's *value* (a count of elements), not of bytes:
    the layouts the dispatcher allocates (``(B, H, L, D)`` or ``(B, L, H, D)`` viewed as such) have
    every stride a multiple of the head dim, so all are marked when the head dims are multiples
    of 16. A head dim such as 40 has 80-byte rows, 16-byte aligned, yet a row stride of 40
    elements, which the JIT leaves unmarked (and ``H * 40`` only when H is even): the worst case,
    compiled here, is no stride marked. Sizes (H, Lq, Lk, ...) are left arbitrary.

    The mask's strides (``stride_m*``) are never marked: a mask broadcast over batch, heads or
    rows has stride 0 there and its last stride is 1, so no launch can be assumed to give
    multiples of 16."""
    return [n for n, ty in signature.items()
            if ty.startswith("*") or (strides_too and n.startswith("stride_") and not n.startswith("stride_m"))]


def strides_aligned(constexprs) -> bool:
    """Whether the JIT marks this variant's strides divisible by 16 (head dims multiples of 16)."""
    from .heuristics import strides_aligned as aligned

    return aligned(constexprs.get("D", 16), constexprs.get("DV", 16))


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
        attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]]
                 for n in divisible_args(signature, strides_aligned(constexprs))}
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
    # Without the alignment specialisation (``--unaligned``, or head dims such as 40 whose strides
    # the JIT cannot mark) tiles load element by element and their prologue/epilogue may spill
    # addresses once per program; only the loops are held to the no-local-memory rule there.
    strict = aligned and strides_aligned(v.constexprs)
    if rep.local_in_loops or (strict and rep.stack > STACK_SLACK):
        problems.append(f"{rep.stack} B of stack (register spills: {rep.ldl} LDL, {rep.local_in_loops} in loops)")
    # fp32 multiplies exactly (ieee, FMA): no matrix unit to ask for.
    from .heuristics import allows_mma_sync, head_bucket, mode_class

    key = (v.name.split("/")[0], "32" if v.constexprs.get("PREC") == "ieee" else "16",
           head_bucket(v.constexprs.get("D", 0), v.constexprs.get("DV", 0)), strides_aligned(v.constexprs))
    modes = mode_class(v.constexprs.get("BAND", False), v.constexprs.get("MASK_KIND", 0),
                       v.constexprs.get("DROPOUT", False))
    modified = v.constexprs.get("SOFTCAP", False) or v.constexprs.get("ALIBI", False)
    wants_hgmma = v.constexprs.get("PREC") != "ieee" and not allows_mma_sync(*key, modes, modified)
    if arch >= 90 and wants_hgmma and rep.mma_loops > rep.hgmma_loops:
        problems.append(f"{rep.mma_loops - rep.hgmma_loops} matrix loop(s) without HGMMA")
    # The descriptor forward exists for TMA: its key loops must load through it (a triton that
    # lowered the descriptors to pointer code would pass every other check).
    if arch >= 90 and key[0] == "desc" and not rep.tma_loads_in_loops:
        problems.append("no TMA load (UTMALDG) in a loop")
    return problems, rep


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, nargs="+", default=[80, 90], help="compute capabilities (default: 80 90)")
    ap.add_argument("--dtypes", nargs="+", default=list(_TY.values()), choices=list(_TY.values()))
    ap.add_argument("--dims", type=int, nargs="+", default=list(ALL_DIMS), help="head dims (default: %(default)s)")
    ap.add_argument("--all-flags", action="store_true",
                    help="every (causal, key lengths) combination, not only both on")
    ap.add_argument("--only", nargs="+", default=None,
                    help="kernels to build (fwd fwdsplit desc delta dkdv dq fused, in every mode built; or "
                         "KERNEL+MODE, that mode variant alone; default: all)")
    ap.add_argument("--unaligned", action="store_true",
                    help="compile without the JIT's divisibility specialisation (strides not multiples of 16)")
    ap.add_argument("--modes", nargs="*", default=None, choices=list(MODE_SETS),
                    help="also build the mode variants of these sets (alone: all of them)")
    ap.add_argument("--no-plain", action="store_true", help="leave out the plain kernels (with --modes)")
    ap.add_argument("--tile", type=int, nargs=4, metavar=("M", "N", "WARPS", "STAGES"),
                    help="try this tile for every variant instead of the table's (to tune the table)")
    args = ap.parse_args(argv)
    from .launch import INTERPRET

    if INTERPRET:
        print("aot: TRITON_INTERPRET is set; unset it to compile the real kernels", file=sys.stderr)
        return 2
    flags = list(itertools.product((True, False), repeat=2)) if args.all_flags else [(True, True)]
    failures = 0
    print(f"{'variant':<30} {'arch':>4} {'tile':>9} {'w/s':>4} {'smem KiB':>8} {'regs':>4} {'stack':>5} {'LDL':>4} "
          f"{'inloop':>6} {'HGMMA':>5} {'TMA':>3} {'insns':>5} {'sass digest':<16}  status")
    for arch in args.arch:
        trial = TileConfig(*args.tile) if args.tile else None
        modes = list(MODE_SETS) if args.modes == [] else (args.modes or [])
        for v in variants(arch, args.dtypes, args.dims, flags, trial, modes, plain=not args.no_plain):
            kernel, mode = v.name.split("/")[0], v.name.partition("+")[2]
            if args.only and kernel not in args.only and f"{kernel}+{mode}" not in args.only:
                continue
            t0 = time.time()
            tile = f"{v.constexprs.get('BLOCK_M', '')}x{v.constexprs.get('BLOCK_N', '-')}"
            try:
                compiled = compile_variant(v.kernel, v.signature, v.constexprs, v.num_warps, v.num_stages, arch,
                                           aligned=not args.unaligned)
                problems, rep = check(v, arch, compiled, aligned=not args.unaligned)
                smem = compiled.metadata.shared / 1024
                figures = (f"{smem:>8.1f} {rep.regs:>4} {rep.stack:>5} {rep.ldl:>4} {rep.local_in_loops:>6} "
                           f"{rep.hgmma_loops:>2}/{rep.mma_loops:<2} {rep.tma_loads:>3} {rep.insns:>5} {rep.digest:<16}")
                status = "; ".join(problems) if problems else f"ok ({time.time() - t0:.0f}s)"
            except Exception as e:  # report every failing variant, not just the first
                problems = [e]
                figures = f"{'':>8} {'':>4} {'':>5} {'':>4} {'':>6} {'':>5} {'':>3} {'':>5} {'':<16}"
                status = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            failures += bool(problems)
            print(f"{v.name:<30} {arch:>4} {tile:>9} {v.num_warps:>2}/{v.num_stages} {figures}  {status}", flush=True)
    print(f"aot: {failures} failing variant(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
