#!/usr/bin/env python3
"""Compile-check the CUDA kernels without a GPU.

Checks that the instantiation files are current (tools/generate_kernels.py), then compiles
every csrc/cuda/mma/*.cu with nvcc for sm_80 and sm_90 (``-Xptxas -v``, the flags torch's
CUDAExtension and setup.py use), in parallel, and prints one table row per kernel and
architecture: registers, spill stores/loads, stack frame, static shared memory, the dynamic
shared memory its launcher asks for, and the local-memory instructions (LDL/STL) that sit inside a
loop of its SASS. Exits non-zero when a compile fails, when a kernel's shared memory exceeds the
per-block limit of the smallest sm_80+ part (99 KB on sm_86/sm_89), or when a main kernel touches
local memory inside a loop (its hot loop: a spill there is a defect). A spill outside every loop
(a few values parked across the main loop and reloaded for the epilogue) is reported, not
failed. The SASS comes from cuobjdump (the CUDA toolkit's, or the copy in Triton's package);
without one, any spill of a main kernel fails (``--allow-spills`` turns that into a warning).

It also parses csrc/cuda/cuda_host.cpp (the torch-facing host code) with g++ ``-fsyntax-only``
against the installed torch's headers plus the CUDA runtime headers, so that code which can only
be compiled on a CUDA-enabled torch is at least checked here (``--no-host`` skips it; it is
skipped with a note when torch's headers or Python's are missing).

The sm90 family (csrc/cuda/sm90/*.cu) is compiled on its own with
``-gencode=arch=compute_90a,code=sm_90a`` (wgmma and setmaxnreg exist only on the "a" target),
and its SASS is read: the main loop of each kernel (the SASS loop holding its HGMMA) must hold
HGMMA at all, no kernel may touch local memory (LDL/STL), use more than 255 registers per thread
at launch or more than 227 KB of shared memory (static + what its launcher asks for), and every
setmaxnreg target (USETMAXREG) must stay within 256; the fused backward's main loop must hold
exactly the HGMMA of its 5 products per tile (the config's kHgmmaPerStage; the dQ conversion
kernel, a memory-bound helper, is exempt from the HGMMA rule), and its dQ writer must pass a row
tile's turn only after the bulk adds completed and the proxy fence, in that order in the SASS
(mhakern/kernels/sass.py dq_writer_order). One row per kernel gives the main loop's instruction
mix (``--no-sm90`` skips it).

Recorded SASS: the plain mma.sync kernels and every kernel of the sm_90a units must compile to
the instruction text recorded for this nvcc release (mhakern/kernels/sass.py RECORDED_SASS names
the files): a restructuring proves it left them unchanged, and a deliberate change re-records
its family (``--record-plain-sass``, ``--record-sm90-sass``) in the same commit.

Usage: python tools/check_cuda_build.py [-j N] [--arch 80,90] [--only fwd_fp16_d64,...] [--dtypes fp16]
       [--allow-spills] [--no-host] [--no-sm90] [--json out.json] [--record-plain-sass]
       [--record-sm90-sass]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CUDA_DIR = ROOT / "csrc" / "cuda"
# torch's CUDAExtension compiles with these; the kernels must build under them.
TORCH_NVCC_FLAGS = [
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
    "--expt-relaxed-constexpr",
]
NVCC_FLAGS = ["-std=c++17", "-O3", "-Xptxas", "-v", "-lineinfo"] + TORCH_NVCC_FLAGS
MMA_DIR = CUDA_DIR / "mma"  # the mma.sync family (sm_80 and newer)
SM90_DIR = CUDA_DIR / "sm90"
# The CPU emulator of the CUDA features (test infrastructure): the tile-config printers below are
# host programs that compile the kernels' headers with MHAKERN_CUDA_EMULATE against it.
EMULATOR_DIR = ROOT / "tests" / "cuda_emulator"
SM90_GENCODE = "-gencode=arch=compute_90a,code=sm_90a"
SM90_SMEM_LIMIT = 227 * 1024  # opt-in shared memory per block on sm_90
SM90_MAX_REGS = 255
# Gates on the sm_90a forward's main loop (mhakern/kernels/sass.py reads it; docs/performance.md gives
# the model behind each number):
# - the softmax overlaps P V: at least BN / 2 of the loop's MUFU.EX2 (BN keys per stage, BN / 2
#   exps per thread) between its "S landed" wait (DEPBAR.LE gsb0, 1) and its "P V landed" wait
#   (DEPBAR.LE gsb0, 0). ptxas hoisted the second wait above the whole softmax once (0 of 66):
#   the ping-pong chain then holds the softmax after P V lands.
# - the instruction diet, at D 128: instructions one warp executes per key of an unmasked tile
#   (the main loop less the blocks a forward branch skips, over BN). FlashAttention-3's hdim-128
#   loop executes 3.4 with the same compiler; this kernel executed 5.11 (654 per 128 keys), 5.14
#   with the pin of the overlap (658), 4.05 (519) with the scale folded into the exponent's
#   FFMA, the descriptors built outside the loop and the stage counted without a modulo; 3.88
#   (496) with the consumers' warpgroup index warp-uniform to ptxas (the Q descriptors in
#   uniform registers); 3.70 (473) with separate K and V pipelines (a second full-barrier wait
#   and release per tile) and the shared base warp-uniform (the aligned base computed once);
#   3.67 (470) with the mask test against a precomputed first masked tile; 3.55 (455) on the
#   persistent grid. The bound is the target the forward was designed to.
SM90_FWD_MAX_EXECUTED_PER_KEY = {128: 3.7}
# The forward kernels held to those gates: the dense one and its packed-sequence twin (the same
# main loop: attn_fwd_sm90_kernel.cuh attn_fwd_sm90_body).
SM90_FWD_KERNELS = ("attn_fwd_sm90_kernel", "attn_fwd_sm90_varlen_kernel")
# sm90-namespace kernels without wgmma (memory-bound helpers): not held to HGMMA in a loop.
SM90_HELPER_KERNELS = ("attn_bwd_dq_convert_sm90_kernel",)
SMEM_LIMIT = 99 * 1024  # opt-in shared memory per block on sm_86 / sm_89 (sm_80: 163 KB, sm_90: 227 KB)
# Kernels whose inner loop is the product: a spill there is a defect. The small helper kernels
# (delta, combine, dq reduce) are memory-bound one-pass loops. The *_modes_kernel twins (attn_mask,
# dropout) are built from the same bodies and held to the same rule.
MAIN_KERNELS = ("attn_fwd_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel", "attn_fwd_modes_kernel",
                "attn_bwd_dkdv_modes_kernel", "attn_bwd_dq_modes_kernel", "attn_fwd_decode_kernel")
# Kernels held to no local memory at all (no spill, no stack frame, no LDL/STL anywhere): the
# decode forward keeps one 16-row strip per warp (half the main forward's registers), so
# anything in local memory there is a regression, not a trade-off.
NO_LOCAL_KERNELS = ("attn_fwd_decode_kernel",)
# Reviewed exceptions: (kernel, head dim) -> (most local-memory instructions allowed inside its
# loops, most spill bytes per thread when no SASS can be read, why). Beyond that, it fails.
ALLOWED_LOOP_LOCAL = {
    ("attn_fwd_kernel", 128): (2, 16, "one 4-byte reload per key step of a value parked across the loop "
                                      "(see FwdConfig in mma/attn_fwd_kernel.cuh)"),
}


def find_nvcc() -> str | None:
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            cand = Path(os.environ[env]) / "bin" / "nvcc"
            if cand.exists():
                return str(cand)
    return shutil.which("nvcc")


def cuda_include(nvcc: str) -> Path | None:
    real = Path(os.path.realpath(nvcc))
    cands = [real.parent.parent / "include"]
    try:  # a wrapper script that execs the real nvcc
        for tok in real.read_text(errors="ignore")[:4096].split():
            if tok.endswith("/bin/nvcc"):
                cands.append(Path(tok).parent.parent / "include")
    except (OSError, UnicodeDecodeError):
        pass
    cands.append(Path("/usr/local/cuda/include"))
    return next((c for c in cands if (c / "cuda_runtime_api.h").is_file()), None)


def find_cuobjdump(nvcc: str) -> str | None:
    cands = [Path(os.path.realpath(nvcc)).parent / "cuobjdump", Path(nvcc).parent / "cuobjdump"]
    inc = cuda_include(nvcc)
    if inc is not None:
        cands.append(inc.parent / "bin" / "cuobjdump")
    try:
        import importlib.util

        spec = importlib.util.find_spec("triton")
        if spec and spec.origin:
            cands.append(Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump")
    except (ImportError, ValueError):
        pass
    found = next((str(c) for c in cands if c.is_file() and os.access(c, os.X_OK)), None)
    return found or shutil.which("cuobjdump")


def _load_sass_reader():
    """mhakern/kernels/sass.py, the project's one SASS reader (listings, functions, loops, waits), loaded
    by path: the kernels package itself imports the Triton kernels, which this check needs not."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("mhakern_sass_reader", ROOT / "mhakern" / "kernels" / "sass.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while it loads
    spec.loader.exec_module(mod)
    return mod


sass_reader = _load_sass_reader()


def _is_local(text: str) -> bool:
    return sass_reader.opcode(text).split(".")[0] in ("LDL", "STL")


def sass_functions(cuobjdump: str, obj: Path) -> dict:
    """{(mangled kernel, sm): [(address, text), ...]} of one object: its one ``cuobjdump -sass``
    run, parsed once (the reader's parse_functions), which every SASS gate below reads. The
    listing of a backward object runs to about 160,000 lines: dumping and parsing it once per
    gate tripled the check's SASS time."""
    res = subprocess.run([cuobjdump, "-sass", str(obj)], capture_output=True, text=True)
    return sass_reader.parse_functions(res.stdout)


def loop_local_memory(functions: dict) -> dict[tuple[str, int], tuple[int, int]]:
    """{(mangled kernel, sm): (local-memory instructions, how many of them inside a loop)} of an
    object's parsed SASS (:func:`sass_functions`), loops by the reader's rule
    (mhakern/kernels/sass.py: loops_of)."""
    out: dict[tuple[str, int], tuple[int, int]] = {}
    for key, ins in functions.items():
        loops = sass_reader.loops_of(ins)
        local = [a for a, text in ins if _is_local(text)]
        out[key] = (len(local), sum(1 for a in local if any(lo <= a <= hi for lo, hi in loops)))
    return out


# ---- the fused mma.sync backward (csrc/cuda/mma/attn_bwd_fused_kernel.cuh) ------------------
# Gates: no local memory at all (spill, stack frame, LDL/STL), shared memory within 99 KB, and
# exactly FusedBwdConfig::kMmaPerStep HMMA in the main loop (the SASS loop holding the most
# HMMA): the five products per tile, so that a recomputed S or dP (the split kernels' seven)
# or a product split out of the loop fails. Registers and shared memory are reported.
_FUSED_CONFIG_PROGRAM = r"""
#include <cstdio>
#include "mma/attn_bwd_fused_kernel.cuh"
using namespace mhakern::cuda;
template <int D> void row() {
  using C = FusedBwdConfig<D>;
  std::printf("%d %d %d %d %d %d %d\n", D, C::kMmaPerStep, C::kSmemBytes, C::kModeSmemBytes, C::kBlockN, C::kBlockM,
              C::kThreads);
}
#define MHK_ROW_(tag, D) row<D>();
int main() { MHK_CUDA_FOR_EACH_HEAD_DIM(MHK_ROW_, _) MHK_CUDA_BWD_ONLY_HEAD_DIM(MHK_ROW_, _) }
"""


# Reviewed exceptions of the no-local-memory gate: head dim -> (most spill bytes per thread, why).
# Allowed only for the plain (no modes) kernels and only outside every SASS loop (a single
# LDL/STL inside one fails). At D 128 the plain kernels use 255 registers and ptxas spills 1-9
# values (4-36 B, changing with any edit) whose loads and stores all lie outside every loop; the
# modes twins of the same body fit, and no variant tried that keeps the five products in one
# unrolled loop fitted (row steps of 32 and 16, dQ rounds of 32 and 16 columns).
FUSED_ALLOWED_LOCAL = {128: (48, "spill outside every SASS loop (none in the main loop)")}


def fused_bwd_config(include: Path) -> dict[int, dict] | None:
    """{D: {mma, smem, smem_modes, n, m, threads}} of FusedBwdConfig, or None without g++."""
    stdout = _run_config_program(_FUSED_CONFIG_PROGRAM, include)
    if stdout is None:
        return None
    out = {}
    for line in stdout.splitlines():
        D, mma, smem, smem_m, n, m, threads = map(int, line.split())
        out[D] = dict(mma=mma, smem=smem, smem_modes=smem_m, n=n, m=m, threads=threads)
    return out


def fused_bwd_sass(functions: dict) -> dict[tuple[str, int], dict]:
    """{(mangled, sm): {hmma_loop, hmma, local}} for the fused backward kernels of one object's
    parsed SASS (:func:`sass_functions`): HMMA inside the loop holding the most of them (loops by
    the reader's rule), HMMA in the kernel, LDL/STL in the kernel."""
    out: dict[tuple[str, int], dict] = {}
    for (func, arch), ins in functions.items():
        if "attn_bwd_fused_kernel" not in func:
            continue
        hmma = [a for a, t in ins if sass_reader.opcode(t).split(".")[0] == "HMMA"]
        best = max((sum(1 for a in hmma if lo <= a <= hi) for lo, hi in sass_reader.loops_of(ins)), default=0)
        out[(func, arch)] = {"hmma_loop": best, "hmma": len(hmma), "local": sum(1 for _, t in ins if _is_local(t))}
    return out


def check_fused_bwd(entries: list[dict], fused: dict, names: dict, config: dict | None) -> tuple[list[str], list[str]]:
    """(report lines, problems) of the fused backward's gates."""
    lines, problems = [], []
    rows = [e for e in entries if "attn_bwd_fused_kernel" in names.get(e["mangled"], "")]
    if rows and config is None:
        problems.append("fused backward: FusedBwdConfig not read (the config printer did not build)")
    for e in sorted(rows, key=lambda e: (short_name(names[e["mangled"]]), e["arch"])):
        kern, dtype, D = short_name(names[e["mangled"]])
        cfg = (config or {}).get(D)
        f = fused.get((e["mangled"], e["arch"]))
        tag = f"{kern}<{dtype}, {D}> sm_{e['arch']}"
        smem = None if cfg is None else cfg["smem"] + (cfg["smem_modes"] if "[modes" in kern else 0)
        lines.append(f"{tag}: {e['regs']} registers, smem {smem} B, HMMA in main loop "
                     f"{'-' if f is None else f['hmma_loop']} (expected {cfg and cfg['mma']}: 5 products), "
                     f"local memory {e['spill_st']}/{e['spill_ld']} B spill, {e['stack']} B stack, "
                     f"{'-' if f is None else f['local']} LDL/STL")
        local = e["spill_st"] or e["spill_ld"] or e["stack"] or (f is not None and f["local"])
        allowed, why = FUSED_ALLOWED_LOCAL.get(D, (0, ""))
        if local and "[plain" in kern and e["local_in_loop"] == 0 and max(e["spill_st"], e["spill_ld"]) <= allowed:
            lines.append(f"    reviewed: {why} (FUSED_ALLOWED_LOCAL)")
        elif local:
            problems.append(f"{tag}: local memory (spill {e['spill_st']} B / {e['spill_ld']} B, stack {e['stack']} B, "
                            f"LDL/STL {f and f['local']}); the fused backward may use none")
        if cfg is not None and f is not None and f["hmma_loop"] != cfg["mma"]:
            problems.append(f"{tag}: {f['hmma_loop']} HMMA in the main loop, FusedBwdConfig::kMmaPerStep = {cfg['mma']} "
                            "(five products per tile)")
        if smem is not None and smem + e["smem_static"] > SMEM_LIMIT:
            problems.append(f"{tag}: needs {smem + e['smem_static']} B of shared memory (> {SMEM_LIMIT})")
    return lines, problems


# ---- the plain kernels' SASS (calls without attn_mask, dropout, softcap, ALiBi) --------------
# The modes (attn_mask, dropout, the score modifiers) live in the kModes instantiations only, so
# a call without them runs exactly the kernel it ran before a mode was added. Gate: every plain
# mma.sync kernel (not a *_modes_kernel, not attn_bwd_fused_kernel[modes,...]) has the SASS
# recorded in PLAIN_SASS_BASELINE for this nvcc release: the same instruction count and the same
# instruction text (digest). A deliberate change to a plain kernel re-records it
# (--record-plain-sass) in the same commit, with its reason and measurement.
PLAIN_SASS_BASELINE = ROOT / "csrc" / sass_reader.RECORDED_SASS["mma"]
# Every kernel of the sm_90a units (keys '<mangled>@sm_90a'): recorded the same way, so that the
# sm90 family's kernels are held to their SASS too (a deliberate change: --record-sm90-sass).
SM90_SASS_BASELINE = ROOT / "csrc" / sass_reader.RECORDED_SASS["sm90"]


_PARAM_OFFSET = re.compile(r"c\[0x0\]\[0x[0-9a-f]+\]")


def _is_plain_kernel(short: str) -> bool:
    return not short.endswith("_modes_kernel") and "[modes," not in short


def plain_kernel_digests(functions: dict, arch_suffix: str = "") -> dict[str, list]:
    """{'<mangled>@sm_<arch><arch_suffix>': [instructions, digest]} of every kernel in an object's
    parsed SASS (:func:`sass_functions`; the caller keeps the plain ones; arch_suffix "a" for the
    sm_90a units); digest: sha256 of the instruction
    texts, addresses left out, and the offsets of the kernel parameters in constant bank 0 too:
    a field added to the parameter struct (a new mode) moves them without changing the kernel's
    code."""
    import hashlib

    out = {}
    for (name, arch), ins in functions.items():
        text = "\n".join(_PARAM_OFFSET.sub("c[0x0][param]", re.sub(r"\s+", " ", t.split(";")[0]).strip())
                         for _, t in ins)
        out[f"{name}@sm_{arch}{arch_suffix}"] = [len(ins), hashlib.sha256(text.encode()).hexdigest()[:16]]
    return out


def check_recorded(kernels: dict[str, list], names: dict[str, str], version: str, record: bool, book_path: Path,
                   what: str, why: str) -> tuple[list[str], list[str]]:
    """(report lines, problems) of a recorded-SASS gate: ``kernels`` ({key: [instructions,
    digest]}) against the record of this nvcc release in ``book_path``; with ``record`` that
    record is rewritten from ``kernels`` instead. ``what`` names the kernels in the report,
    ``why`` says in a problem why a change matters."""
    if not kernels:
        return [], []
    book = json.loads(book_path.read_text()) if book_path.exists() else {}
    if record:
        book.setdefault(version, {}).update(kernels)
        book[version] = dict(sorted(book[version].items()))
        book_path.write_text(json.dumps(book, indent=1) + "\n")
        return [f"recorded {len(kernels)} {what} for {version} in {book_path.name}"], []
    base = book.get(version)
    if base is None:
        return [f"no baseline for {version} in {book_path.name}: {len(kernels)} {what} not compared"], []
    lines, problems, same, unknown = [], [], 0, 0
    for key, (n, dig) in sorted(kernels.items()):
        if key not in base:
            unknown += 1
            continue
        if base[key] == [n, dig]:
            same += 1
            continue
        kern, dtype, D = short_name(names.get(key.split("@")[0], key))
        problems.append(f"{what[:-1]} {kern}<{dtype}, {D}> {key.split('@')[1]}: SASS changed ({n} instructions, "
                        f"baseline {base[key][0]}): {why}")
    lines.append(f"{same}/{len(kernels)} {what} identical to the baseline (count and instruction text)"
                 + (f", {unknown} not in it" if unknown else ""))
    if unknown:
        problems.append(f"{unknown} {what} not in {book_path.name} for {version}: record them")
    return lines, problems


def check_plain_kernels(digests: dict[str, list], names: dict[str, str], version: str,
                        record: bool) -> tuple[list[str], list[str]]:
    """(report lines, problems) of the plain-kernel gate; with ``record`` the baseline of this
    nvcc release is rewritten from ``digests`` instead."""
    plain = {k: v for k, v in digests.items() if _is_plain_kernel(short_name(names.get(k.split("@")[0], k))[0])}
    return check_recorded(plain, names, version, record, PLAIN_SASS_BASELINE, "plain kernels",
                          "calls without modes must run the kernel they ran before")


def compile_unit(nvcc: str, src: Path, archs: list[int], outdir: Path, cuobjdump: str | None) -> dict:
    """One nvcc run for all archs: the front end runs once (about 15% less work than one run per arch)."""
    obj = outdir / f"{src.stem}.o"
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    cmd = [nvcc, *NVCC_FLAGS, *gencode, "-c", str(src), "-o", str(obj)]
    t0 = time.time()
    res = subprocess.run(cmd, capture_output=True, text=True)
    sass = fused = plain = None
    if cuobjdump and res.returncode == 0:
        functions = sass_functions(cuobjdump, obj)
        sass = loop_local_memory(functions)
        fused = fused_bwd_sass(functions) if "_bwd_" in src.name else None
        plain = plain_kernel_digests(functions)
    return {"src": src.name, "archs": archs, "rc": res.returncode, "log": res.stdout + res.stderr,
            "seconds": time.time() - t0, "cmd": " ".join(cmd), "sass": sass, "fused": fused, "plain": plain}


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for 'sm_(\d+)'")
_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(log: str) -> list[dict]:
    """Kernel entries of one ``-Xptxas -v`` log."""
    out, cur = [], None
    for line in log.splitlines():
        m = _ENTRY.search(line)
        if m:
            cur = {"mangled": m.group(1), "arch": int(m.group(2)), "regs": None, "stack": 0, "spill_st": 0,
                   "spill_ld": 0, "smem_static": 0}
            out.append(cur)
            continue
        if cur is None:
            continue
        m = _PROPS.search(line)
        if m:
            cur["stack"], cur["spill_st"], cur["spill_ld"] = map(int, m.groups())
        m = _USED.search(line)
        if m:
            cur["regs"] = int(m.group(1))
            s = _SMEM.search(line)
            cur["smem_static"] = int(s.group(1)) if s else 0
    return out


def demangle(names: list[str]) -> dict[str, str]:
    if not names or shutil.which("c++filt") is None:
        return {n: n for n in names}
    res = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
    lines = res.stdout.splitlines()
    return dict(zip(names, lines)) if len(lines) == len(names) else {n: n for n in names}


def short_name(demangled: str) -> tuple[str, str, int]:
    """('attn_fwd_kernel', 'fp16', 64) from 'void mhakern::cuda::attn_fwd_kernel<__half, 64>(...)';
    the fused backward's flags name its variant: 'attn_bwd_fused_kernel[modes,atomic]'."""
    m = re.search(r"mhakern::cuda::(?:sm90::)?(\w+)<(\w+), (\d+)((?:, (?:true|false))*)>", demangled)
    if not m:
        return demangled, "?", 0
    dtype = {"__half": "fp16", "__nv_bfloat16": "bf16"}.get(m.group(2), m.group(2))
    name = m.group(1)
    if m.group(4):
        modes, ordered = (f.strip() == "true" for f in m.group(4).strip(", ").split(","))
        name += f"[{'modes' if modes else 'plain'},{'ordered' if ordered else 'atomic'}]"
    return name, dtype, int(m.group(3))


_CONFIG_PROGRAM = r"""
#include <cstdio>
#include "mma/attn_fwd_kernel.cuh"
#include "mma/attn_bwd_kernel.cuh"
using namespace mhakern::cuda;
template <int D> void row() {
  using B = BwdConfig<D>;
  std::printf("%d %d %d %d %d %d %d %d\n", D, FwdConfig<D>::kLaunchSmemBytes, B::kDkvSmemBytes, B::kDqSmemBytes,
              FwdConfig<D, true>::kLaunchSmemBytes, B::kDkvSmemBytes + B::kDkvModeSmemBytes,
              B::kDqSmemBytes + B::kDqModeSmemBytes, FwdDecodeConfig<D>::kLaunchSmemBytes);
}
#define MHK_ROW_(tag, D) row<D>();
int main() { MHK_CUDA_FOR_EACH_HEAD_DIM(MHK_ROW_, _) }
"""


def _run_config_program(program: str, include: Path, libs: tuple = ()) -> str | None:
    """The output of a small C++ program that prints the kernels' tile configs (built with g++
    against the emulator's headers), or None without g++ or when it does not build."""
    if shutil.which("g++") is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "cfg.cpp", Path(tmp) / "cfg"
        src.write_text(program)
        cmd = ["g++", "-std=c++17", "-DMHAKERN_CUDA_EMULATE", f"-I{CUDA_DIR}", f"-I{EMULATOR_DIR}", f"-I{include}",
               str(src), "-o", str(exe), *libs]
        if subprocess.run(cmd, capture_output=True).returncode != 0:
            return None
        return subprocess.run([str(exe)], capture_output=True, text=True).stdout


def dynamic_smem(include: Path) -> dict[tuple[str, int], int] | None:
    """Dynamic shared memory each main kernel's launcher requests, read off the tile configs
    (the modes twins: their own tiles plus the per-row mode data, as launch_attn_fwd_main and
    launch_attn_bwd_main add them)."""
    stdout = _run_config_program(_CONFIG_PROGRAM, include)
    if stdout is None:
        return None
    table = {}
    for line in stdout.splitlines():
        D, fwd, dkdv, dq, fwd_m, dkdv_m, dq_m, fwd_dec = map(int, line.split())
        table[("attn_fwd_kernel", D)] = fwd
        table[("attn_bwd_dkdv_kernel", D)] = dkdv
        table[("attn_bwd_dq_kernel", D)] = dq
        table[("attn_fwd_modes_kernel", D)] = fwd_m
        table[("attn_bwd_dkdv_modes_kernel", D)] = dkdv_m
        table[("attn_bwd_dq_modes_kernel", D)] = dq_m
        table[("attn_fwd_decode_kernel", D)] = fwd_dec
    return table


def host_syntax_check(include: Path) -> tuple[str, str]:
    """('ok' | 'FAILED' | 'skipped', detail) for csrc/cuda/cuda_host.cpp parsed by g++."""
    if shutil.which("g++") is None:
        return "skipped", "g++ not found"
    try:
        import sysconfig

        import torch.utils.cpp_extension as ce
    except ImportError as e:
        return "skipped", f"torch not importable ({e})"
    py_inc = sysconfig.get_paths()["include"]
    if not (Path(py_inc) / "Python.h").is_file():
        return "skipped", f"Python headers not found in {py_inc}"
    with tempfile.TemporaryDirectory() as tmp:
        # A CPU-only torch ships c10/cuda headers but not this generated one; its content only
        # matters for building c10_cuda itself.
        shim = Path(tmp) / "c10" / "cuda" / "impl"
        shim.mkdir(parents=True)
        (shim / "cuda_cmake_macros.h").write_text("#pragma once\n")
        cmd = ["g++", "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-DMHAKERN_WITH_CUDA", f"-I{ROOT / 'csrc'}"]
        for d in ce.include_paths():
            cmd += ["-isystem", d]
        cmd += ["-isystem", tmp, "-isystem", py_inc, "-isystem", str(include), str(CUDA_DIR / "cuda_host.cpp")]
        res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0 or res.stderr.strip():
        return "FAILED", res.stderr[-6000:]
    return "ok", "g++ -fsyntax-only -Wall -Wextra against torch's headers: no error, no warning"


_SM90_CONFIG_PROGRAM = r"""
#include <cstdio>
#include "../capabilities.h"
#include "sm90/attn_fwd_sm90_kernel.cuh"
using namespace mhakern::cuda::sm90;
#include "sm90/attn_bwd_sm90_kernel.cuh"
#include "sm90/attn_bwd_fused_sm90_kernel.cuh"
#define MHK_ROW_(tag, D) std::printf("%d %d %d\nattn_fwd_sm90_varlen_kernel %d %d\n", D, FwdConfigSm90<D>::kSmemAlloc, \
                                    FwdConfigSm90<D>::kBlockN, D, FwdConfigSm90<D>::kSmemAlloc);
#define MHK_BWD_ROW_(tag, D) \
  std::printf("attn_bwd_dkdv_sm90_kernel %d %d\nattn_bwd_dq_sm90_kernel %d %d\n", D, \
              BwdConfigSm90<D>::kDkvSmemAlloc, D, BwdConfigSm90<D>::kDqSmemAlloc); \
  std::printf("attn_bwd_fused_sm90_kernel %d %d\nattn_bwd_dq_convert_sm90_kernel %d 0\n", D, \
              BwdFusedConfigSm90<D>::kSmemAlloc, D); \
  std::printf("hgmma attn_bwd_fused_sm90_kernel %d %d\n", D, BwdFusedConfigSm90<D>::kHgmmaPerStage);
int main() { MHK_SM90_FOR_EACH_HEAD_DIM(MHK_ROW_, _) MHK_SM90_BWD_FOR_EACH_HEAD_DIM(MHK_BWD_ROW_, _) }
"""


def sm90_dynamic_smem(include: Path) -> dict | None:
    """{head dim: dynamic shared memory} the sm90 forward's launcher requests, {("fwd_block_n",
    head dim): keys per stage} of its tiles, {(kernel, head dim): ...} for the backward's
    kernels, and {("hgmma", kernel, head dim): HGMMA its main loop must hold} where the config
    states it (the fused backward: 5 products per tile)."""
    stdout = _run_config_program(_SM90_CONFIG_PROGRAM, include, ("-ldl",))
    if stdout is None:
        return None
    out: dict = {}
    for ln in stdout.splitlines():
        f = ln.split()
        if f[0].isdigit():
            out[int(f[0])] = int(f[1])
            out[("fwd_block_n", int(f[0]))] = int(f[2])
        elif f[0] == "hgmma":
            out[("hgmma", f[1], int(f[2]))] = int(f[3])
        else:
            out[(f[0], int(f[1]))] = int(f[2])
    return out


_SETMAXNREG = re.compile(r"USETMAXREG\.\S+\s+(?:\w+,\s*)?(0x[0-9a-f]+)")


def sass_facts_text(sass: str) -> dict[str, dict]:
    """sass_facts_of the parsed cuobjdump -sass output (mhakern/kernels/sass.py reads it)."""
    return sass_facts_of(sass_reader.parse_functions(sass))


def sass_facts_of(functions: dict) -> dict[str, dict]:
    """{mangled kernel: facts} of an sm_90a object's parsed SASS (:func:`sass_functions`): the
    main loop (the innermost backward-branch range holding HGMMA) and its instruction mix,
    local-memory instructions, setmaxnreg targets, TMA loads, and for the fused backward its dQ
    writer's pass of a turn (the reader's dq_writer_order: [SASS lines, problems])."""
    R = sass_reader
    out = {}
    for (name, _arch), ins in functions.items():
        def op(text: str) -> str:
            return R.opcode(text)

        best = R.main_loop(ins, "HGMMA")
        body = R.loop_body(ins, *best) if best else []
        mix: dict[str, int] = {}
        for _, t in body:
            mix[op(t).split(".")[0]] = mix.get(op(t).split(".")[0], 0) + 1
        executed = R.executed_path(ins, *best) if best else []
        between, exps = R.exps_between_waits(body)
        out[name] = {
            "main_loop": None if best is None else [best[0], best[1]],
            "loop_hgmma": sum(1 for _, t in body if op(t).startswith("HGMMA")),
            "loop_instructions": len(body),
            # one iteration that skips every block a forward branch jumps over (the mask block
            # of a tile that crosses a row's limit): what an unmasked key tile executes per warp
            "loop_executed": len(executed),
            "loop_skipped_blocks": [] if best is None else [[a, b] for a, b in R.skipped_blocks(ins, *best)],
            "loop_exps": exps,
            # MUFU.EX2 between the loop's "S landed" wait (DEPBAR.LE gsb0, 1) and its "P V
            # landed" wait (DEPBAR.LE gsb0, 0): the softmax that overlaps P V (-1: no such pair)
            "loop_exps_between_waits": between,
            "loop_mix": dict(sorted(mix.items(), key=lambda kv: -kv[1])),
            "hgmma_total": sum(1 for _, t in ins if op(t).startswith("HGMMA")),
            "local_ins": sum(1 for _, t in ins if _is_local(t)),
            "setmaxnreg": [int(m.group(1), 16) for _, t in ins for m in [_SETMAXNREG.search(t)] if m],
            "tma_loads": sum(1 for _, t in ins if op(t).startswith("UTMALDG")),
        }
        if "attn_bwd_fused_sm90_kernel" in name:
            out[name]["dq_writer"] = list(R.dq_writer_order(ins))
    return out


def compile_sm90(nvcc: str, src: Path, outdir: Path, cuobjdump: str | None) -> dict:
    obj = outdir / f"{src.stem}.o"
    cmd = [nvcc, *NVCC_FLAGS, SM90_GENCODE, "-c", str(src), "-o", str(obj)]
    t0 = time.time()
    res = subprocess.run(cmd, capture_output=True, text=True)
    facts = digests = None
    if cuobjdump and res.returncode == 0:
        functions = sass_functions(cuobjdump, obj)
        facts = sass_facts_of(functions)
        digests = plain_kernel_digests(functions, arch_suffix="a")
    return {"src": src.name, "rc": res.returncode, "log": res.stdout + res.stderr, "seconds": time.time() - t0,
            "cmd": " ".join(cmd), "facts": facts, "digests": digests}


def sm90_fwd_loop_gates(label: str, D: int, f: dict, smem: dict | None) -> list[str]:
    """The sm_90a forward's main-loop gates (SM90_FWD_MAX_EXECUTED_PER_KEY and the overlap rule
    above) on its SASS facts; smem: sm90_dynamic_smem's table (its keys per stage)."""
    bn = (smem or {}).get(("fwd_block_n", D))
    if bn is None:
        return [f"{label}: keys per stage unknown (no fwd_block_n row in the config printer): loop gates unchecked"]
    out = []
    if f["loop_exps_between_waits"] < bn // 2:
        where = ("no 'S landed' / 'P V landed' wait pair in the loop" if f["loop_exps_between_waits"] < 0
                 else f"{f['loop_exps_between_waits']} of the loop's {f['loop_exps']}")
        out.append(f"{label}: softmax not overlapped with P V: {where} MUFU.EX2 between DEPBAR.LE gsb0, 0x1 and "
                   f"DEPBAR.LE gsb0, 0x0 (at least BN / 2 = {bn // 2})")
    bound = SM90_FWD_MAX_EXECUTED_PER_KEY.get(D)
    if bound is not None and f["loop_executed"] / bn > bound + 1e-9:
        out.append(f"{label}: {f['loop_executed']} instructions executed per unmasked {bn}-key tile = "
                   f"{f['loop_executed'] / bn:.2f} per key (at most {bound})")
    return out


def check_sm90(results: list[dict], smem: dict[int, int] | None) -> tuple[list[dict], list[str], list[str]]:
    """(rows, problems, report lines) of the compiled sm90 units (compile_sm90's results);
    smem: {head dim: dynamic shared memory} (sm90_dynamic_smem), None when unknown."""
    rows, problems, lines = [], [], []
    # ptxas names the target 'sm_90a'; parse_ptxas reads the number only.
    entries = [(r, e) for r in results if r["rc"] == 0 for e in parse_ptxas(r["log"].replace("'sm_90a'", "'sm_90'"))]
    for r in results:
        if r["rc"] == 0 and not any(x is r for x, _ in entries):
            problems.append(f"{r['src']}: compiled, but ptxas reported no kernel for sm_90a (empty body?)")
    names = demangle(sorted({e["mangled"] for _, e in entries}))
    for r, e in entries:
        m = re.search(r"mhakern::cuda::sm90::(\w+)<(\w+), (\d+)>", names[e["mangled"]])
        if m is None:
            # A kernel of the other family the unit launches too (the split-K combine): it is
            # checked with that family; here only that it compiles for sm_90a without spilling.
            kern, dtype, D = short_name(names[e["mangled"]])
            if e["spill_st"] or e["spill_ld"] or e["stack"]:
                problems.append(f"{kern}<{dtype}, {D}> sm_90a: spills {e['spill_st']} B / {e['spill_ld']} B")
            continue
        kern, dtype, D = m.group(1), {"__half": "fp16", "__nv_bfloat16": "bf16"}.get(m.group(2)), int(m.group(3))
        f = (r["facts"] or {}).get(e["mangled"])
        # The forward's row is keyed by head dim, the backward kernels' by (kernel, head dim).
        dyn = (smem or {}).get((kern, D), (smem or {}).get(D, 0) if kern == "attn_fwd_sm90_kernel" else 0)
        label = f"{kern}<{dtype}, {D}> sm_90a"
        if f is None:
            problems.append(f"{label}: no SASS read (cuobjdump missing): HGMMA and local memory unchecked")
        else:
            want_hgmma = (smem or {}).get(("hgmma", kern, D))
            if f["loop_hgmma"] == 0 and kern not in SM90_HELPER_KERNELS:
                problems.append(f"{label}: no HGMMA inside any loop of its SASS (wgmma not emitted in the main loop)")
            elif want_hgmma is not None and f["loop_hgmma"] != want_hgmma:
                # The fused backward's 5 products per tile (BwdFusedConfigSm90::kHgmmaPerStage): more
                # is a product recomputed, fewer a loop the compiler split or a product left out.
                problems.append(f"{label}: {f['loop_hgmma']} HGMMA in its main loop, the config's 5 products "
                                f"per tile are {want_hgmma}")
            if f["local_ins"]:
                problems.append(f"{label}: {f['local_ins']} local-memory instructions (LDL/STL)")
            if any(n > 256 for n in f["setmaxnreg"]):
                problems.append(f"{label}: setmaxnreg target above 256: {f['setmaxnreg']}")
            if kern in SM90_FWD_KERNELS:
                problems += sm90_fwd_loop_gates(label, D, f, smem)
            if kern == "attn_bwd_fused_sm90_kernel":
                # The dQ writer passes a row tile's turn only once its bulk adds have completed
                # (wait_group 0, then the proxy fence, then the release: the reader's
                # DQ_WRITER_SEQUENCE), in the SASS as in the source.
                writer, order_problems = f.get("dq_writer") or ([], ["dQ writer not read"])
                problems += [f"{label}: dQ writer's turn: {x}" for x in order_problems]
                if not order_problems:
                    lines.append(f"{label}: dQ writer passes its turn after (SASS, its basic block): "
                                 + "; ".join(w.split("*/ ")[1] for w in writer
                                             if any(w.split("*/ ")[1].startswith(k) for k, _ in
                                                    sass_reader.DQ_WRITER_SEQUENCE) or "REDG" in w))
        if e["spill_st"] or e["spill_ld"] or e["stack"]:
            problems.append(f"{label}: spills {e['spill_st']} B / {e['spill_ld']} B, stack {e['stack']} B")
        if e["regs"] is not None and e["regs"] > SM90_MAX_REGS:
            problems.append(f"{label}: {e['regs']} registers per thread at launch (> {SM90_MAX_REGS})")
        if smem is None:
            problems.append(f"{label}: dynamic shared memory not read (the config printer did not build)")
        elif kern != "attn_fwd_sm90_kernel" and (kern, D) not in smem:
            problems.append(f"{label}: dynamic shared memory unknown (no row in the config printer)")
        elif dyn + e["smem_static"] > SM90_SMEM_LIMIT:
            problems.append(f"{label}: {dyn + e['smem_static']} B of shared memory (> {SM90_SMEM_LIMIT})")
        e.update(kernel=kern, dtype=dtype, D=D, smem_dynamic=dyn, sass=f, src=r["src"])
        rows.append(e)
        if f is not None:
            top = ", ".join(f"{k} {v}" for k, v in list(f["loop_mix"].items())[:8])
            lines.append(f"{kern}<{dtype}, {D}> sm_90a: {e['regs']} regs at launch, setmaxnreg {f['setmaxnreg']}, "
                         f"smem {e['smem_static']} + {dyn} B, local-memory instructions {f['local_ins']}, "
                         f"TMA loads {f['tma_loads']}; main loop {f['loop_instructions']} instructions with "
                         f"{f['loop_hgmma']} HGMMA (of {f['hgmma_total']}), {f['loop_executed']} executed when its "
                         f"forward-skipped blocks are, MUFU.EX2 {f['loop_exps_between_waits']} of {f['loop_exps']} "
                         f"between the wgmma waits: {top}")
    return rows, problems, lines


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--arch", default="80,90", help="comma-separated SM versions (default 80,90)")
    ap.add_argument("--only", default="", help="comma-separated .cu stems without 'attn_' (e.g. fwd_fp16_d64), or 'sm90' for the sm90 family only")
    ap.add_argument("--dtypes", default="fp16,bf16",
                    help="comma-separated dtypes of the mma.sync units to compile (default fp16,bf16); the "
                         "sm_90a family is compiled whole")
    ap.add_argument("--allow-spills", action="store_true", help="report main-kernel spills without failing")
    ap.add_argument("--no-host", action="store_true", help="skip the syntax check of csrc/cuda/cuda_host.cpp")
    ap.add_argument("--no-sm90", action="store_true", help="skip the sm_90a family (csrc/cuda/sm90/)")
    ap.add_argument("--json", default="", help="also write the results as JSON to this path")
    ap.add_argument("--record-plain-sass", action="store_true",
                    help=f"rewrite {PLAIN_SASS_BASELINE.relative_to(ROOT)} (this nvcc) from the plain kernels compiled")
    ap.add_argument("--record-sm90-sass", action="store_true",
                    help=f"rewrite {SM90_SASS_BASELINE.relative_to(ROOT)} (this nvcc) from the sm_90a kernels compiled")
    return ap.parse_args(argv)


def select_sources(args) -> tuple[list[Path], list[Path]] | None:
    """(mma.sync units, sm90 units) that --only / --no-sm90 select; None (after a message) when
    --only names a file that does not exist."""
    sources = sorted(MMA_DIR.glob("*.cu"))
    only_sm90 = args.only.strip() == "sm90"
    if only_sm90:
        sources = []
    elif args.only:
        wanted = {f"attn_{s.strip()}" for s in args.only.split(",") if s.strip()}
        sources = [s for s in sources if s.stem in wanted]
        if len(sources) != len(wanted):
            print(f"check_cuda_build: --only names no .cu file for {sorted(wanted - {s.stem for s in sources})}",
                  file=sys.stderr)
            return None
    # fp16 and bf16 units are one template per kernel and head dim: a check of one dtype
    # compiles every code path (the tests' default, within CI's time); both dtypes by default.
    dtypes = {d.strip() for d in args.dtypes.split(",") if d.strip()}
    unknown = dtypes - {"fp16", "bf16"}
    if unknown or not dtypes:
        print(f"check_cuda_build: --dtypes takes fp16 and/or bf16, got {args.dtypes!r}", file=sys.stderr)
        return None
    sources = [s for s in sources if s.stem.split("_")[2] in dtypes]
    sm90 = [] if args.no_sm90 or (args.only and not only_sm90) else sorted(SM90_DIR.glob("attn_*.cu"))
    return sources, sm90


def stale_instantiations() -> list[str]:
    """The instantiation files that differ from what the capability table generates: a stale set
    would check (and build) something else than the table says."""
    sys.path.insert(0, str(ROOT / "tools"))
    from generate_kernels import differences

    return differences()


def compile_all(nvcc: str, include: Path | None, cuobjdump: str | None, sources: list[Path], sm90_sources: list[Path],
                archs: list[int], args) -> dict:
    """Every unit compiled in one pool (and the host parsed, and the tile-config printers built
    and run): {failed, entries (mma.sync kernel builds, their SASS local-memory counts attached),
    jobs, sm90_results, host, configs ({"smem", "fused", "sm90_smem"}: the printers' tables, None
    where not built), elapsed}."""
    t0 = time.time()
    failed, entries = [], []
    host = ("skipped", "--no-host")
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        host_future = None
        if not args.no_host and include is not None:
            host_future = pool.submit(host_syntax_check, include)
        # The config printers (a g++ build each, seconds) go into the pool too: run after the
        # compiles they left one core idle at the end.
        config_jobs = {}
        if include is not None:
            if sources:
                config_jobs["smem"] = pool.submit(dynamic_smem, include)
            if any("_bwd_" in s.name for s in sources):
                config_jobs["fused"] = pool.submit(fused_bwd_config, include)
            if sm90_sources:
                config_jobs["sm90_smem"] = pool.submit(sm90_dynamic_smem, include)
        # Largest first (the backward files take longest): the pool drains evenly.
        ordered = sorted(sources, key=lambda s: ("bwd" not in s.name, s.name))
        jobs = [pool.submit(compile_unit, nvcc, s, archs, Path(tmp), cuobjdump) for s in ordered]
        sm90_jobs = [pool.submit(compile_sm90, nvcc, s, Path(tmp), cuobjdump) for s in sm90_sources]
        for fut in jobs:
            r = fut.result()
            if r["rc"] != 0:
                failed.append(r)
                continue
            for e in parse_ptxas(r["log"]):
                e["src"] = r["src"]
                local = (r["sass"] or {}).get((e["mangled"], e["arch"]))
                e["local_ins"], e["local_in_loop"] = local if local else (None, None)
                entries.append(e)
        sm90_results = [f.result() for f in sm90_jobs]
        failed += [r for r in sm90_results if r["rc"] != 0]
        if host_future is not None:
            host = host_future.result()
        elif not args.no_host:
            host = ("skipped", "CUDA include dir not found")
        configs = {k: f.result() for k, f in config_jobs.items()}
    return {"failed": failed, "entries": entries, "jobs": [f.result() for f in jobs], "sm90_results": sm90_results,
            "host": host, "configs": configs, "elapsed": time.time() - t0}


def check_mma_sync(entries: list[dict], names: dict, smem_dyn: dict | None) -> tuple[list, list, set]:
    """(table rows, problems, reviewed-spill notes) of the mma.sync kernel builds: local memory in
    loops, reviewed spills, the no-local-memory kernels, the 99 KB shared-memory limit."""
    problems: list[str] = []
    notes: set[str] = set()
    rows = []
    for e in entries:
        kern, dtype, D = short_name(names[e["mangled"]])
        dyn = (smem_dyn or {}).get((kern, D), 0)
        e.update(kernel=kern, dtype=dtype, D=D, smem_dynamic=dyn)
        flags = []
        spills = e["spill_st"] or e["spill_ld"] or e["stack"]
        allowed, allowed_bytes, why = ALLOWED_LOOP_LOCAL.get((kern, D), (0, 0, ""))
        within = (e["local_in_loop"] is not None and e["local_in_loop"] <= allowed) or (
            e["local_in_loop"] is None and max(e["spill_st"], e["spill_ld"]) <= allowed_bytes)
        if spills and allowed and within:
            flags.append("reviewed spill (note below)")
            notes.add(f"{kern}, D = {D}: {why}")
        elif e["local_in_loop"]:
            flags.append("LOCAL-MEM IN LOOP")
            if kern in MAIN_KERNELS:
                problems.append(f"{kern}<{dtype}, {D}> sm_{e['arch']}: {e['local_in_loop']} local-memory instructions "
                                "inside a loop (hot-loop spill)")
        elif spills and e["local_in_loop"] is None:
            flags.append("SPILL")
            if kern in MAIN_KERNELS:
                problems.append(f"{kern}<{dtype}, {D}> sm_{e['arch']} spills {e['spill_st']} B / {e['spill_ld']} B "
                                "(no SASS to tell whether inside its loop)")
        elif spills:
            flags.append("spill outside loops")
        if kern in NO_LOCAL_KERNELS and (spills or e["local_ins"]):
            flags.append("LOCAL-MEM")
            problems.append(f"{kern}<{dtype}, {D}> sm_{e['arch']}: local memory (spill {e['spill_st']} B / "
                            f"{e['spill_ld']} B, stack {e['stack']} B, LDL/STL {e['local_ins']}); this kernel may use none")
        if dyn + e["smem_static"] > SMEM_LIMIT:
            flags.append("SMEM>99KB")
            problems.append(f"{kern}<{dtype}, {D}> needs {dyn + e['smem_static']} B of shared memory (> {SMEM_LIMIT})")
        loop_col = "-" if e["local_in_loop"] is None else f"{e['local_in_loop']}/{e['local_ins']}"
        rows.append((kern, dtype, D, e["arch"], e["regs"], e["spill_st"], e["spill_ld"], e["stack"], loop_col,
                     e["smem_static"], dyn, ", ".join(flags)))
    rows.sort(key=lambda r: (r[0], r[2], r[1], r[3]))
    return rows, problems, notes


def print_mma_sync_table(rows: list, smem_dyn: dict | None, notes: set) -> None:
    header = ("kernel", "dtype", "D", "sm", "regs", "spill st", "spill ld", "stack", "LDL/STL in loop", "smem static",
              "smem dyn", "")
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)] if rows else [len(h) for h in header]
    fmt = "  ".join(f"{{:<{w}}}" if i < 2 else f"{{:>{w}}}" for i, w in enumerate(widths))
    print()
    print(fmt.format(*header))
    print(fmt.format(*["-" * w for w in widths]))
    for r in rows:
        print(fmt.format(*[("" if x is None else x) for x in r]))
    if smem_dyn is None:
        print("(dynamic shared memory not read: g++ could not build the config printer)")
    for n in sorted(notes):
        print(f"note: reviewed spill of {n}")


def print_section(title: str, lines: list[str]) -> None:
    if lines:
        print(f"\n{title}")
        for ln in lines:
            print("  " + ln)


def main(argv=None) -> int:
    args = parse_args(argv)
    nvcc = find_nvcc()
    if nvcc is None:
        print("check_cuda_build: nvcc not found (set CUDA_HOME or put nvcc on PATH)", file=sys.stderr)
        return 2
    include = cuda_include(nvcc)
    cuobjdump = find_cuobjdump(nvcc)
    selected = select_sources(args)
    if selected is None:
        return 2
    sources, sm90_sources = selected
    archs = [int(a) for a in args.arch.split(",") if a.strip()]
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    print(f"check_cuda_build: {len(sources)} .cu files x sm_{', sm_'.join(map(str, archs))} with {nvcc} "
          f"({version}), {args.jobs} jobs; SASS loop check: {cuobjdump or 'unavailable (no cuobjdump)'}")
    stale = stale_instantiations()
    if stale:
        print("check_cuda_build: the instantiation files are not current (run tools/generate_kernels.py):\n  "
              + "\n  ".join(stale), file=sys.stderr)
        return 1

    built = compile_all(nvcc, include, cuobjdump, sources, sm90_sources, archs, args)
    failed, entries, host = built["failed"], built["entries"], built["host"]
    for r in failed:
        print(f"\nFAILED: {r['src']}\n  {r['cmd']}\n{r['log'][-6000:]}", file=sys.stderr)

    names = demangle(sorted({e["mangled"] for e in entries}))
    smem_dyn = built["configs"].get("smem")
    problems = []
    if include is not None and smem_dyn is None and entries:
        # Without the launchers' dynamic sizes the shared-memory limit below would be checked
        # against the static part alone, and pass blindly.
        problems.append("dynamic shared memory of the mma.sync kernels not read (the config printer did not build)")
    rows, mma_problems, notes = check_mma_sync(entries, names, smem_dyn)
    problems += mma_problems
    print_mma_sync_table(rows, smem_dyn, notes)
    print(f"\ncuda_host.cpp syntax check: {host[0]} ({host[1] if host[0] != 'FAILED' else 'see below'})")
    if host[0] == "FAILED":
        print(host[1], file=sys.stderr)

    fused_facts = {}
    for r in built["jobs"]:
        fused_facts.update(r.get("fused") or {})
    fused_lines, fused_problems = check_fused_bwd(entries, fused_facts, names,
                                                  built["configs"].get("fused"))
    problems += fused_problems
    print_section("fused mma.sync backward (csrc/cuda/mma/attn_bwd_fused_kernel.cuh), main loop = the SASS loop holding "
                  "the most HMMA:", fused_lines)

    plain_digests = {}
    for r in built["jobs"]:
        plain_digests.update(r.get("plain") or {})
    plain_lines, plain_problems = check_plain_kernels(plain_digests, names, version, args.record_plain_sass)
    problems += plain_problems
    for ln in plain_lines:
        print("\nplain kernels' SASS: " + ln)

    sm90_results = built["sm90_results"]
    sm90_smem = built["configs"].get("sm90_smem")
    sm90_rows, sm90_problems, sm90_lines = check_sm90(sm90_results, sm90_smem)
    problems += sm90_problems
    sm90_digests = {}
    for r in sm90_results:
        sm90_digests.update(r.get("digests") or {})
    sm90_names = demangle(sorted({k.split("@")[0] for k in sm90_digests}))
    rec_lines, rec_problems = check_recorded(sm90_digests, sm90_names, version, args.record_sm90_sass,
                                             SM90_SASS_BASELINE, "sm_90a kernels",
                                             "the sm90 family's kernels must be the ones recorded (re-record a "
                                             "deliberate change: --record-sm90-sass)")
    problems += rec_problems
    sm90_lines += rec_lines
    print_section("sm90 family (-gencode=arch=compute_90a,code=sm_90a), main loop = the SASS loop holding the HGMMA:",
                  sm90_lines)

    def tolerated(p: str) -> bool:
        return args.allow_spills and ("spills" in p or "hot-loop" in p)

    ok = not failed and host[0] != "FAILED" and all(tolerated(p) for p in problems)
    for p in problems:
        print(("WARNING: " if tolerated(p) else "ERROR: ") + p)
    print("columns: bytes per thread (spill, stack), bytes per block (smem); 'LDL/STL in loop' = local-memory "
          "instructions inside a SASS loop / in the whole kernel")
    n_units = len(sources) + len(sm90_sources)
    print(f"\ncheck_cuda_build: {n_units - len(failed)}/{n_units} files compiled for sm_{', sm_'.join(map(str, archs))}, "
          f"{len(entries) + len(sm90_rows)} kernel builds, "
          f"{built['elapsed']:.0f} s wall, {'PASSED' if ok else 'FAILED'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"passed": ok, "seconds": built["elapsed"],
                                               "failed": [f["src"] for f in failed], "host_syntax": host[0],
                                               "kernels": entries, "sm90": sm90_rows}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
