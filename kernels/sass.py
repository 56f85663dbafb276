"""What a compiled kernel costs on the chip, read from its cubin with the ``cuobjdump`` that
Triton's package ships (no GPU needed).

``inspect_cubin`` gives registers, stack and static shared memory (``--dump-resource-usage``)
and, from the SASS (``--dump-sass``), the local-memory loads and stores (``LDL``/``STL``: the
register spills) with how many fall inside a loop, and whether the loops that multiply
matrices use Hopper's ``HGMMA`` or the older ``HMMA``, and the TMA copies (``UTMALDG`` loads,
``UTMASTG`` stores) of kernels that use tensor descriptors. A loop is the address range from a
backward branch's target to the branch; local memory in it is traffic paid every iteration,
which is what the AOT check refuses.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import List, Tuple

_INSN = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_ADDR = re.compile(r"0x[0-9a-f]+")
_USAGE = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


def cuobjdump() -> str:
    """Path of the cuobjdump inside Triton's NVIDIA backend (or $MHAKERN_CUOBJDUMP)."""
    override = os.environ.get("MHAKERN_CUOBJDUMP")
    if override:
        return override
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(path):
        raise FileNotFoundError(f"cuobjdump not found at {path}; set MHAKERN_CUOBJDUMP to one")
    return path


@dataclass
class SassReport:
    regs: int
    stack: int  # bytes of local memory per thread (spill slots)
    static_shared: int
    ldl: int  # local loads anywhere in the kernel
    stl: int
    local_in_loops: int  # LDL/STL inside a loop
    loops: List[Tuple[int, int]] = field(default_factory=list)
    mma_loops: int = 0  # loops with a matrix instruction
    hgmma_loops: int = 0  # ... of which use HGMMA (sm_90 warpgroup MMA)
    tma_loads: int = 0  # UTMALDG: tensor-memory-accelerator copies global -> shared (sm_90)
    tma_loads_in_loops: int = 0
    tma_stores: int = 0  # UTMASTG


def parse_sass(sass: str):
    """(address, text) of each instruction, in order."""
    out = []
    for line in sass.splitlines():
        m = _INSN.match(line)
        if m:
            out.append((int(m.group(1), 16), m.group(2)))
    return out


def loops_of(insns) -> List[Tuple[int, int]]:
    """[start, end] address ranges closed by a backward branch."""
    found = []
    for addr, text in insns:
        # "BRA 0x10", "@!P0 BRA 0x10", "BRA.U !UP0, 0x10": the target is the last address.
        if _opcode(text).startswith("BRA"):
            targets = _ADDR.findall(text)
            if targets and int(targets[-1], 16) <= addr:
                found.append((int(targets[-1], 16), addr))
    return found


def _opcode(text: str) -> str:
    words = text.split()
    return words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "")


def analyse(sass: str, usage: str) -> SassReport:
    m = _USAGE.search(usage)
    if not m:
        raise ValueError(f"cuobjdump --dump-resource-usage gave no REG/STACK line: {usage[:300]!r}")
    regs, stack, shared, _local = map(int, m.groups())
    insns = parse_sass(sass)
    loops = loops_of(insns)

    def in_loop(addr):
        return any(a <= addr <= b for a, b in loops)

    ldl = stl = in_loops = 0
    for addr, text in insns:
        op = _opcode(text)
        if op.startswith("LDL") or op.startswith("STL"):
            ldl += op.startswith("LDL")
            stl += op.startswith("STL")
            in_loops += in_loop(addr)
    tma = [(addr, _opcode(text)) for addr, text in insns if _opcode(text).startswith("UTMA")]
    tma_ld = [a for a, op in tma if op.startswith("UTMALDG")]
    tma_st = sum(op.startswith("UTMASTG") for _, op in tma)
    mma = hg = 0
    for a, b in loops:
        ops = [t for addr, t in insns if a <= addr <= b]
        has_hg = any("HGMMA" in t for t in ops)
        has_mma = has_hg or any(re.search(r"\bHMMA\b|\bHMMA\.", t) for t in ops)
        mma += has_mma
        hg += has_hg
    return SassReport(regs, stack, shared, ldl, stl, in_loops, loops, mma, hg, len(tma_ld),
                      sum(in_loop(a) for a in tma_ld), tma_st)


def inspect_cubin(cubin: bytes) -> SassReport:
    tool = cuobjdump()
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        usage = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([tool, "--dump-sass", path], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(path)
    return analyse(sass, usage)
