"""What a compiled kernel costs on the chip, read from its cubin with the ``cuobjdump`` that
Triton's package ships (no GPU needed).

``inspect_cubin`` gives registers, stack and static shared memory (``--dump-resource-usage``)
and, from the SASS (``--dump-sass``), the local-memory loads and stores (``LDL``/``STL``: the
register spills) with how many fall inside a loop, and whether the loops that multiply
matrices use Hopper's ``HGMMA`` or the older ``HMMA``, and the TMA copies (``UTMALDG`` loads,
``UTMASTG`` stores) of kernels that use tensor descriptors. Local memory in a loop is traffic
paid every iteration, which is what the AOT check refuses.

This is the project's one SASS reader: tools/check_cuda_build.py (the CUDA kernels' gates) loads
this file too (by path: it needs none of the Triton kernels of this package), so both read
listings, functions, loops and waits by the same rules:

* a **loop** is the address range from a backward branch's target to the branch, the target
  strictly before the branch (``loops_of``): the branch to itself that ends every CUDA kernel
  (the trap after EXIT) closes no loop body and is not one; a branch's target is the last
  address in its text (``BRA 0x10``, ``@!P0 BRA.U !UP0, 0x10``);
* a kernel's **main loop** is the innermost loop holding a given instruction (``main_loop``;
  HGMMA for the Hopper kernels): an out-of-line slow path (an mbarrier retry placed after the
  loop) that branches back into the middle makes a longer range that also holds it;
* inside a loop, a **skipped block** is the range a forward branch to a target inside the same
  loop jumps over (``skipped_blocks``): code that runs only on some iterations (the mask block of
  a tile that crosses a row's limit); ``executed_path`` is the loop less those blocks, what an
  iteration that skips them all executes;
* ``waits_and_exps`` gives, for each ``WARPGROUP.DEPBAR.LE gsb0, N`` of a range, how many
  ``MUFU.EX2`` precede it in that range (where a wgmma wait sits against the softmax);
* ``dq_writer_order`` finds, in the fused sm_90a backward, the dQ writer's pass of a row tile's
  turn and checks what must precede it in its basic block (the bulk add completed, the proxy
  fence, the release).

It also holds where the CUDA kernels' SASS digests are recorded (``RECORDED_SASS``, one file per
family under csrc/, written and checked by tools/check_cuda_build.py) and ``family_build_digests``,
one digest per family of those records: a kernel whose SASS changes changes its family's digest
(the first-use self-test keys its cache on it).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

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
    insns: int = 0  # instructions in the listing
    # sha256 (first 16 hex digits) of the instruction texts in order, operands and branch
    # targets included: two compiles with the same digest emitted the same machine code.
    digest: str = ""


_FUNC = re.compile(r"Function : (\S+)")
_ARCH = re.compile(r"code for sm_(\d+)")


def parse_sass(sass: str):
    """(address, text) of each instruction, in order."""
    out = []
    for line in sass.splitlines():
        m = _INSN.match(line)
        if m:
            out.append((int(m.group(1), 16), m.group(2)))
    return out


def parse_functions(sass: str) -> dict:
    """{(function, sm): [(address, text), ...]} of a ``cuobjdump -sass`` listing (several
    functions and architectures; sm 0 where the listing names none, 90 for sm_90a)."""
    out: dict = {}
    arch, cur = 0, None
    for line in sass.splitlines():
        m = _ARCH.search(line)
        if m:
            arch, cur = int(m.group(1)), None
            continue
        m = _FUNC.search(line)
        if m:
            cur = out.setdefault((m.group(1), arch), [])
            continue
        m = _INSN.match(line)
        if m and cur is not None:
            cur.append((int(m.group(1), 16), m.group(2)))
    return out


def _branch_target(text: str):
    """The target address of a branch instruction, None for any other."""
    if not _opcode(text).startswith("BRA"):
        return None
    targets = _ADDR.findall(text)
    return int(targets[-1], 16) if targets else None


def loops_of(insns) -> List[Tuple[int, int]]:
    """[start, end] address ranges closed by a backward branch (target strictly before it)."""
    found = []
    for addr, text in insns:
        tgt = _branch_target(text)
        if tgt is not None and tgt < addr:
            found.append((tgt, addr))
    return found


def opcode(text: str) -> str:
    """The opcode with its modifiers (``HGMMA.64x128x16.F32.BF16``), past any predicate guard."""
    return _opcode(text)


def _opcode(text: str) -> str:
    words = text.split()
    return words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "")


def main_loop(insns, marker: str = "HGMMA"):
    """The innermost loop holding an instruction whose opcode starts with ``marker``: its
    (start, end), or None."""
    best = None
    for lo, hi in loops_of(insns):
        if any(lo <= a <= hi and _opcode(t).startswith(marker) for a, t in insns):
            if best is None or hi - lo < best[1] - best[0]:
                best = (lo, hi)
    return best


def loop_body(insns, lo: int, hi: int):
    return [(a, t) for a, t in insns if lo <= a <= hi]


def skipped_blocks(insns, lo: int, hi: int) -> List[Tuple[int, int]]:
    """[first, last] address ranges inside the loop [lo, hi] that a forward branch to a target
    inside the loop jumps over (merged where they overlap)."""
    addrs = [a for a, _ in insns if lo <= a <= hi]
    ranges = []
    for a, t in insns:
        tgt = _branch_target(t)
        if lo <= a <= hi and tgt is not None and a < tgt <= hi:
            inside = [x for x in addrs if a < x < tgt]
            if inside:
                ranges.append((inside[0], inside[-1]))
    ranges.sort()
    merged: List[Tuple[int, int]] = []
    for r in ranges:
        if merged and r[0] <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], r[1]))
        else:
            merged.append(r)
    return merged


def executed_path(insns, lo: int, hi: int):
    """The loop's instructions less its skipped blocks: one iteration that skips them all."""
    skip = skipped_blocks(insns, lo, hi)
    return [(a, t) for a, t in loop_body(insns, lo, hi) if not any(s <= a <= e for s, e in skip)]


def waits_and_exps(body) -> List[Tuple[int, int, int]]:
    """(index in body, N, MUFU.EX2 before it) of each ``WARPGROUP.DEPBAR.LE gsb0, N`` of body."""
    out = []
    exps = 0
    for i, (_, t) in enumerate(body):
        op = _opcode(t)
        if op.startswith("MUFU.EX2"):
            exps += 1
        elif op.startswith("WARPGROUP.DEPBAR"):
            m = re.search(r"gsb0,\s*(0x[0-9a-f]+|\d+)", t)
            if m:
                out.append((i, int(m.group(1), 0), exps))
    return out


def exps_between_waits(body) -> Tuple[int, int]:
    """(MUFU.EX2 between the first ``DEPBAR.LE gsb0, 1`` and the next ``DEPBAR.LE gsb0, 0``,
    MUFU.EX2 in the whole body): the exps that run while the second commit group (P V) may
    still be in flight. (-1, total) when the body has no such pair of waits."""
    waits = waits_and_exps(body)
    total = sum(1 for _, t in body if _opcode(t).startswith("MUFU.EX2"))
    for j, (_, n, e1) in enumerate(waits):
        if n == 1:
            nxt = next((e0 for _, n0, e0 in waits[j + 1:] if n0 == 0), None)
            if nxt is not None:
                return nxt - e1, total
    return -1, total


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
    digest = hashlib.sha256("\n".join(t for _, t in insns).encode()).hexdigest()[:16]
    return SassReport(regs, stack, shared, ldl, stl, in_loops, loops, mma, hg, len(tma_ld),
                      sum(in_loop(a) for a in tma_ld), tma_st, len(insns), digest)


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


# ---- the dQ writer of the fused sm_90a backward (csrc/cuda/sm90/attn_bwd_fused_sm90_kernel.cuh) ----
# Its deterministic pass of a row tile's turn is, in PTX: cp.async.bulk.wait_group 0 (the bulk
# reduce-adds have completed), fence.proxy.async.global (the async proxy's writes ordered with
# the generic proxy's), red.release.gpu (the turn passed). ptxas (nvcc 13.0, sm_90a) emits:
#   DEPBAR.LE SB0, 0x0 ; CCTL.IVALL   the wait_group 0 (the .read form is the DEPBAR alone:
#                                     the CCTL tells the completed adds from the read source)
#   FENCE.VIEW.ASYNC.G                the proxy fence
#   MEMBAR.ALL.GPU ... REDG.E.ADD.STRONG.GPU   the release (its fence, then the add)
# all in the one basic block that ends in the REDG, after the kernel's UBLKRED (the bulk adds)
# and with none between. A release whose block lacks one of them, or holds them out of order,
# passes the turn before the adds it orders have landed.
DQ_WRITER_SEQUENCE = (
    ("DEPBAR.LE SB0, 0x0", "cp.async.bulk.wait_group 0 (the bulk adds completed)"),
    ("CCTL.IVALL", "its completion half (not wait_group.read)"),
    ("FENCE.VIEW.ASYNC.G", "fence.proxy.async.global"),
    ("MEMBAR.ALL.GPU", "the release's fence"),
)


def _unguarded(text: str) -> str:
    """The instruction text past any predicate guard (``@P0 ``)."""
    return text.split(None, 1)[1] if text.startswith("@") and " " in text else text


def _is_release(text: str) -> bool:
    op = _opcode(text)
    return op.startswith("REDG") and ".STRONG.GPU" in op


def _basic_block_ending_at(insns, i: int):
    """The instructions of the basic block that ends at index i: back to the nearest branch,
    barrier, convergence or exit instruction, or to the nearest branch target."""
    targets = {t for _, text in insns for t in [_branch_target(text)] if t is not None}
    lo = i
    while lo > 0:
        prev_op = _opcode(insns[lo - 1][1]).split(".")[0]
        if insns[lo][0] in targets or prev_op in ("BRA", "BSSY", "BSYNC", "EXIT", "BAR", "WARPSYNC", "RET", "CALL"):
            break
        lo -= 1
    return insns[lo:i + 1]


def dq_writer_order(insns) -> Tuple[List[str], List[str]]:
    """(the release's basic block as SASS lines, problems) of a fused sm_90a backward kernel's
    parsed SASS: exactly one release (REDG ... .STRONG.GPU), preceded in its basic block by
    DQ_WRITER_SEQUENCE in that order, after the kernel's bulk adds (UBLKRED) and with none of
    them inside the block."""
    rel = [i for i, (_, t) in enumerate(insns) if _is_release(t)]
    if len(rel) != 1:
        return [], [f"{len(rel)} releases (REDG .STRONG.GPU) in the kernel; the dQ writer passes its turn by one"]
    i = rel[0]
    block = _basic_block_ending_at(insns, i)
    lines = [f"/*{a:04x}*/ {t}" for a, t in block]
    problems = []
    if not any(_opcode(t).startswith("UBLKRED") for _, t in insns[:i]):
        problems.append("no bulk reduce-add (UBLKRED) before the release")
    if any(_opcode(t).startswith("UBLKRED") for _, t in block):
        problems.append("a bulk reduce-add (UBLKRED) inside the release's basic block, after its wait")
    at = 0
    for want, what in DQ_WRITER_SEQUENCE:
        k = next((j for j in range(at, len(block) - 1) if _unguarded(block[j][1]).startswith(want)), None)
        if k is None:
            problems.append(f"{want} ({what}) missing before the release in its basic block, or out of order")
            break
        at = k + 1
    return lines, problems


# ---- the recorded SASS digests of the CUDA families --------------------------------------------
# {family: path under csrc/} of the files tools/check_cuda_build.py writes (--record-plain-sass,
# --record-sm90-sass) and checks: {nvcc release: {"<mangled>@sm_<arch>": [instructions, digest]}}.
# "mma": the plain mma.sync kernels (calls without modes), sm_80 and sm_90; "sm90": every kernel
# of the sm_90a units (their own and the helpers they launch), keys "@sm_90a".
RECORDED_SASS = {"mma": "cuda/mma/plain_kernels_sass.json", "sm90": "cuda/sm90/sm90_kernels_sass.json"}


def family_build_digests(csrc_dir: str, nvcc_release: Optional[str] = None) -> Dict[str, str]:
    """{family: 16 hex digits} over that family's recorded kernel digests (RECORDED_SASS), for
    one nvcc release (the ``nvcc --version`` last line the records are keyed by) or, by default,
    every release recorded. csrc_dir: the csrc/ directory (the package layer finds it:
    ``os.path.join(mhakern._build.source_root(), "csrc")``; the kernel layer imports nothing from
    the package). A family without a record file, or without the release, is
    left out. The CI check keeps the records equal to what the sources compile to, so a kernel
    whose SASS changes changes its family's digest."""
    out = {}
    for family, rel in RECORDED_SASS.items():
        path = os.path.join(csrc_dir, rel)
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            book = json.load(f)
        releases = sorted(book) if nvcc_release is None else [r for r in (nvcc_release,) if r in book]
        if not releases:
            continue
        h = hashlib.sha256()
        for r in releases:
            for key, (n, dig) in sorted(book[r].items()):
                h.update(f"{r}\t{key}\t{n}\t{dig}\n".encode())
        out[family] = h.hexdigest()[:16]
    return out
