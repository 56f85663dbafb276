"""Ahead-of-time compile of the generated Triton flex kernels for sm_80 / sm_90, with no GPU, and
a check of their SASS for register spills inside loops (mhakern/kernels/aot.py's machinery).

The modifier compiled is a heavy one: a learnable relative-position table (its gradient stored
by dK/dV) with a document mask gathered from a captured tensor, so the check sees the most
registers a typical modifier needs. Tiles and warps are triton_backend.py's ``_TILES``.

    python -m mhakern.flex.triton_aot [--arch 80 90] [--dtypes bf16 fp32] [--d 64]

Prints one row per kernel; exits 1 when a kernel keeps local memory (a register spill) in a loop
or needs more shared memory than the chip has. Must run without TRITON_INTERPRET.
"""
from __future__ import annotations

import argparse
import inspect
import os
import sys
import time

import torch

_PTR = {"Q", "K", "V", "O", "DO", "DQ", "DK", "DV_"}


def _signature(kernel, dtype: str, caps) -> dict:
    sig = {}
    for p, prm in inspect.signature(kernel.fn).parameters.items():
        if "constexpr" in str(prm.annotation):
            continue
        if p in _PTR:
            sig[p] = "*" + dtype
        elif p in ("LSE", "DELTA") or p.startswith("GV"):
            sig[p] = "*fp32"
        elif p.startswith("GI"):
            sig[p] = "*i64"
        elif p.endswith("_NUM") or p.endswith("_IDX"):
            sig[p] = "*i32"
        elif p[0] == "C" and p[1:].isdigit():
            sig[p] = "*fp32" if caps[int(p[1:])].dtype.is_floating_point else "*i64"
        elif p == "sm_scale":
            sig[p] = "fp32"
        else:
            sig[p] = "i32"
    return sig


def example_module():
    """(generated module, captures) of the check's modifier pair."""
    from . import graph, triton_backend, triton_gen

    H, L = 8, 4096
    table = torch.zeros(H, 2 * L - 1, requires_grad=True)
    doc = torch.zeros(1, L, dtype=torch.long)

    def rel_bias(score, b, h, q, kv):
        return score + table[h, q - kv + L - 1]

    def document_causal(b, h, q, kv):
        return (doc[b, q] == doc[b, kv]) & (q >= kv)

    score, mask = graph.trace(rel_bias, True), graph.trace(document_causal, False)
    caps = graph.merge_captures(score, mask)
    score.captures = caps
    text, _ = triton_gen.source(score, mask, [True, False])
    return triton_backend._module(text), caps


def check(arch: int, dtype: str, D: int = 64):
    """Rows (kernel, problems, report) for one arch and input dtype."""
    from ..kernels import aot, sass
    from .triton_backend import _TILES

    mod, caps = example_module()
    rows = []
    width = 4 if dtype == "fp32" else 2
    for name, key in (("flex_fwd", "fwd"), ("flex_dq", "dq"), ("flex_dkdv", "dkdv")):
        bm, bn, warps = _TILES[(key, width)]
        kernel = getattr(mod, name)
        ce = dict(D=D, DV=D, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=D, BLOCK_DV=D, HAS_MASK=True, HAS_SCORE=True,
                  HAS_FULL=True, LOWP=dtype != "fp32")
        if name == "flex_dkdv":
            ce["CAP_GRAD"] = True
        t = time.time()
        compiled = aot.compile_variant(kernel, _signature(kernel, dtype, caps), ce, warps, 2, arch)
        rep = sass.inspect_cubin(compiled.asm["cubin"])
        problems = []
        if rep.local_in_loops:
            problems.append(f"{rep.local_in_loops} local-memory accesses in loops (register spills)")
        if compiled.metadata.shared > aot.SMEM_LIMIT[arch]:
            problems.append(f"shared memory {compiled.metadata.shared} B over sm_{arch}'s limit")
        rows.append((name, problems, rep))
        print(f"{name:10s} sm_{arch} {dtype:5s} tile {bm}x{bn} w{warps}  smem {compiled.metadata.shared:6d}  "
              f"stack {rep.stack:5d}  local-in-loops {rep.local_in_loops:4d}  {time.time() - t:4.0f}s"
              + (f"  FAIL: {'; '.join(problems)}" if problems else ""), flush=True)
    return rows


def main(argv=None) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("run without TRITON_INTERPRET (the interpreter replaces the kernels by Python functions)")
        return 2
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"])
    ap.add_argument("--d", type=int, default=64)
    a = ap.parse_args(argv)
    bad = 0
    for arch in a.arch:
        for dt in a.dtypes:
            bad += sum(1 for _, problems, _ in check(arch, dt, a.d) if problems)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
