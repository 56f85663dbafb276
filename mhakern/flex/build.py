"""Compiling a generated flex kernel once, and loading it.

The source is csrc/flex/flex_kernel.cpp with the modifier's C++ in place of its marker
(mhakern/flex/graph.py). It is compiled with the host C++ compiler straight into a shared
library with plain C entry points, called through ctypes: no pybind, no torch or ATen header.
What does not depend on the modifier (the gemm, the softmax step, the dtype conversions) is
mhakern._C's flex runtime table for this machine's instruction set (csrc/cpu/flex_runtime.h,
:func:`runtime`), which the calls pass in; so a unit is the modifier's loops and the block walk,
compiled for that instruction set's vectors (mhakern._build.ISA_FLAGS, chosen by torch's cpu
capability) with OpenMP (the libgomp torch loads), in about a second. One library serves every
input dtype (the conversions are the runtime's).

A library holds one or more modifiers (a bundle: :func:`kernels` compiles every modifier it is
given that is not built yet in one compiler run, the way the tests build theirs). Cache, in
``<mhakern cache>/flex/``: ``bundle-<hash>.so`` and, per modifier, ``<key>.ref`` naming its
bundle and index, where key hashes the generated C++ (so the graph, the captures' kinds, ranks
and gradients), the template and the headers it includes (_HEADERS), the ISA, the
compiler, torch's version and the flags. Concurrent processes building the same bundle: a file
lock per bundle, the library written under a temporary name and renamed into place (a reader
never sees a half-written file). Bounded: at most ``_MAX_BUNDLES`` libraries on disk (the least
recently built go first) and ``_MAX_LOADED`` modifiers in this process's table.
"""
from __future__ import annotations

import ctypes
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections import OrderedDict
from typing import Dict, List, Optional

import torch

from .. import _build

_MAX_LOADED = 64
_MAX_BUNDLES = 256
_MARKER = "// MHK_FLEX_GENERATED"
_ENTRIES = "// MHK_FLEX_ENTRIES"
_LOCK = threading.Lock()
_LOADED: "OrderedDict[str, Entry]" = OrderedDict()
# -fopenmp: the kernel's threads (libgomp.so.1, the soname torch loads its own copy under, so
# the process keeps one OpenMP runtime).
_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-fno-math-errno", "-w"]
# The files the unit includes besides its template (the runtime table's interface, scalar basics).
_HEADERS = [("csrc", "cpu", "flex_runtime.h"), ("csrc", "cpu", "kernel", "scalar.h")]


class CompileError(RuntimeError):
    """The host C++ compiler is missing or failed on a generated kernel."""


def _src_root() -> str:
    root = _build.source_root()
    if root is None or not os.path.isfile(os.path.join(root, "csrc", "flex", "flex_kernel.cpp")):
        raise CompileError("the flex kernel template csrc/flex/flex_kernel.cpp is not in this install")
    return root


def compiler() -> Optional[str]:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    return cxx


def isa() -> str:
    """The instruction set the kernels are compiled for: torch's cpu capability, as the main
    kernel's dispatch picks it (AVX512BF16 is compiled as AVX512 here: no bf16 dot products)."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap.startswith("AVX512"):
        return "AVX512"
    if cap.startswith("AVX2"):
        return "AVX2"
    return "DEFAULT"


def _template(root: str) -> str:
    with open(os.path.join(root, "csrc", "flex", "flex_kernel.cpp")) as fh:
        return fh.read()


def _headers_digest(root: str) -> str:
    h = hashlib.sha256()
    for parts in _HEADERS:
        with open(os.path.join(root, *parts), "rb") as fh:
            h.update("/".join(parts).encode() + hashlib.sha256(fh.read()).digest())
    return h.hexdigest()


def _command(root: str, src: str, out: str, which: str) -> list:
    flags = list(_FLAGS)
    if which != "DEFAULT":
        flags += _build.ISA_FLAGS[which] + [f"-DCPU_CAPABILITY={which}", f"-DCPU_CAPABILITY_{which}"]
    else:
        flags += ["-DCPU_CAPABILITY=DEFAULT"]
    libdir = os.path.join(os.path.dirname(torch.__file__), "lib")
    return [compiler(), *flags, f"-I{os.path.join(root, 'csrc', 'cpu')}", src, "-o", out, f"-Wl,-rpath,{libdir}"]


def runtime(which: Optional[str] = None) -> int:
    """The address of mhakern._C's flex runtime table for instruction set ``which`` (default
    :func:`isa`), for FlexArgs.rt. Raises CompileError when mhakern._C is missing or lacks it."""
    from .. import _extension

    which = which or isa()
    with _LOCK:
        if which in _RUNTIME:
            return _RUNTIME[which]
    if _extension.load() is None:
        raise CompileError(f"the cpu kernel needs mhakern._C: {_extension.load_error()}")
    try:
        addr = int(torch.ops.mhakern_C.cpu_flex_runtime(which))
    except (AttributeError, RuntimeError) as e:
        raise CompileError(f"mhakern._C has no flex runtime (rebuild it): {str(e).splitlines()[0]}") from None
    if addr == 0:
        raise CompileError(f"mhakern._C has no flex runtime for {which} on this build or CPU")
    with _LOCK:
        _RUNTIME[which] = addr
    return addr


_RUNTIME: Dict[str, int] = {}


def _facts(root: str, which: str, cxx: str) -> str:
    return "\0".join([_template(root), _headers_digest(root), which, cxx, torch.__version__, " ".join(_FLAGS),
                      sys.platform])


# (ISA, $CXX) -> (root, ISA, compiler, digest of _facts): looked up once per process, not per call
# (the compiler search and the template's hash were a millisecond of every call).
_FACTS: Dict[tuple, tuple] = {}


def _setup() -> tuple:
    which = isa()
    memo = (which, os.environ.get("CXX"))
    hit = _FACTS.get(memo)
    if hit is None:
        root = _src_root()
        cxx = compiler()
        if cxx is None:
            raise CompileError("no C++ compiler found (set CXX)")
        hit = _FACTS[memo] = (root, which, cxx, hashlib.sha256(_facts(root, which, cxx).encode()).hexdigest())
    return hit


class Entry:
    """A compiled modifier: its forward and backward entry points (ctypes functions)."""

    def __init__(self, lib: ctypes.CDLL, index: int):
        self.lib, self.index = lib, index
        self.forward = getattr(lib, f"mhk_flex_forward_{index}")
        self.backward = getattr(lib, f"mhk_flex_backward_{index}")
        self.forward.restype = self.backward.restype = ctypes.c_int


def kernels(variants: List[str]) -> List[Entry]:
    """The compiled entry points of each variant (a ``struct MOD_NAME {...};`` from
    graph.cpp), for every input dtype: from this process's table, from a library on disk
    (a bundle compiled earlier, found through ``<variant key>.ref``), or compiled now -- every
    missing variant together in one unit, so a test suite's modifiers cost one compile."""
    root, which, _cxx, facts = _setup()
    keys = [hashlib.sha256(f"{facts}\0{v}".encode()).hexdigest()[:24] for v in variants]
    d = os.path.join(_build.cache_dir(), "flex")
    os.makedirs(d, exist_ok=True)
    found: Dict[str, Entry] = {}
    with _LOCK:
        for k in keys:
            if k in _LOADED:
                _LOADED.move_to_end(k)
                found[k] = _LOADED[k]
    for k in keys:
        if k not in found:
            e = _from_ref(d, k)
            if e is not None:
                found[k] = e
    missing = list(dict.fromkeys(k for k in keys if k not in found))
    if missing:
        texts = {k: v for k, v in zip(keys, variants)}
        bundle = hashlib.sha256("\0".join(missing).encode()).hexdigest()[:24]
        so = os.path.join(d, f"bundle-{bundle}.so")
        with _build._FileLock(so + ".lock").acquire():
            if not os.path.exists(so):  # another process may have built it while this one waited
                source = _source(root, [texts[k] for k in missing])
                _compile(root, source, so, which)
            for i, k in enumerate(missing):
                _write_atomic(os.path.join(d, f"{k}.ref"), json.dumps({"so": os.path.basename(so), "index": i}))
        lib = _load(so)
        for i, k in enumerate(missing):
            found[k] = Entry(lib, i)
    with _LOCK:
        for k in keys:
            _LOADED[k] = found[k]
            _LOADED.move_to_end(k)
        while len(_LOADED) > _MAX_LOADED:
            _LOADED.popitem(last=False)
    return [found[k] for k in keys]


def _source(root: str, variants: List[str]) -> str:
    text = _template(root)
    if _MARKER not in text or _ENTRIES not in text:
        raise CompileError("csrc/flex/flex_kernel.cpp lacks its generated-code markers")
    structs = "".join(v.replace("MOD_NAME", f"Mod{i}") for i, v in enumerate(variants))
    entries = "\n".join(f"MHK_FLEX_ENTRY({i})" for i in range(len(variants)))
    return text.replace(_MARKER, structs).replace(_ENTRIES, entries)


def _from_ref(d: str, key: str) -> Optional[Entry]:
    ref = os.path.join(d, f"{key}.ref")
    try:
        with open(ref) as fh:
            info = json.load(fh)
        so = os.path.join(d, info["so"])
        if not os.path.exists(so):
            return None
        return Entry(_load(so), int(info["index"]))
    except (OSError, ValueError, KeyError, AttributeError):
        return None


_LIBS: Dict[str, ctypes.CDLL] = {}


def _load(so: str) -> ctypes.CDLL:
    with _LOCK:
        lib = _LIBS.get(so)
        if lib is None:
            lib = _LIBS[so] = ctypes.CDLL(so)
        return lib


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def _compile(root: str, source: str, so: str, which: str) -> None:
    d = os.path.dirname(so)
    with tempfile.TemporaryDirectory(dir=d) as tmp:
        src = os.path.join(tmp, "flex_kernel.cpp")
        with open(src, "w") as fh:
            fh.write(source)
        out = os.path.join(tmp, "kernel.so")
        try:
            r = subprocess.run(_command(root, src, out, which), capture_output=True, text=True)
        except OSError as e:
            raise CompileError(f"the C++ compiler could not run: {e}") from None
        if r.returncode != 0:
            raise CompileError("the generated flex kernel failed to compile: "
                               + _build.first_error(r.stdout + r.stderr))
        os.replace(out, so)  # atomic: readers see the old absence or the whole file
        with open(os.path.join(d, os.path.basename(so)[:-3] + ".cpp"), "w") as fh:
            fh.write(source)  # kept beside the library, for the curious
    _prune(d)


def _prune(d: str) -> None:
    """Drops the oldest bundles beyond _MAX_BUNDLES (their .ref files then point nowhere and are
    rebuilt on use; a process that has one loaded keeps its mapping)."""
    libs = sorted(glob.glob(os.path.join(d, "bundle-*.so")), key=lambda f: os.path.getmtime(f))
    for so in libs[:max(0, len(libs) - _MAX_BUNDLES)]:
        for f in (so, so[:-3] + ".cpp", so + ".lock"):
            try:
                os.remove(f)
            except OSError:
                pass
