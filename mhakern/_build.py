"""Building the extension module mhakern._C: at install time (setup.py) or at first use.

One plan serves both routes, so they compile the same thing:

* ``pip install -e . --no-build-isolation`` (torch importable while building): setup.py loads this
  file by path and builds mhakern._C in place with :func:`extension_modules`.
* a plain ``pip install -e .`` (pip's build isolation: torch is not importable while building,
  and making it a build requirement would make pip fetch a second torch -- the CUDA wheels are
  several GB, and a version or variant other than the user's gives a module that does not
  import): the install is pure Python and the first ``import mhakern._C`` (a backend needing
  it) runs mhakern/_C.py, whose :func:`load_built_module` builds the module with torch's
  BuildExtension (ninja) in a child process, into a per-user cache (:func:`cache_dir`) keyed
  by the sources' hash, the torch, Python and CUDA versions and the GPU archs. A file lock makes concurrent processes build once; a failed build
  is remembered (no retry on every import) and reported with the compiler's first error.
  ``python -m mhakern.build`` builds ahead of time.

What is compiled (:func:`plan`, a pure function of the environment and a description of the
torch at hand, tested with faked ones):

* CPU: ``csrc/*.cpp`` and ``csrc/cpu/**/*.cpp``; of these,
  ``csrc/cpu/kernels_<isa>.cpp`` on x86-64 each with its own -m flags (:data:`ISA_FLAGS`, never
  -march=native: the module must run on other CPUs), the rest with the baseline flags.
* CUDA, when torch has CUDA, nvcc is found with torch's CUDA major version, and some arch of at
  least the kernels' minimum (:func:`min_arch`, from the capability table mhakern/_caps.py) is asked for:
  ``csrc/cuda/**/*.{cu,cpp}``, -DMHAKERN_WITH_CUDA. Archs: ``TORCH_CUDA_ARCH_LIST``
  with those below that minimum dropped (one line says what was dropped), else the visible
  GPUs' archs in a first-use build, else 8.0 and 9.0 + PTX.
* A CUDA part that fails (torch's CUDA version check or compiler bounds, nvcc, ptxas) never
  costs the CPU kernels: the module is rebuilt CPU-only, with one line saying why, unless
  ``MHAKERN_REQUIRE_CUDA=1``.

Switches: ``MHAKERN_NO_EXTENSION=1`` (setup: build nothing), ``MHAKERN_NO_CUDA=1`` (CPU kernels
only), ``MHAKERN_REQUIRE_EXTENSION=1`` (setup: a failed build fails the install),
``MHAKERN_REQUIRE_CUDA=1`` (a failed CUDA part fails the build instead of falling back),
``MHAKERN_NO_JIT=1`` (never build at first use), ``MHAKERN_CACHE_DIR`` (the cache; default
``$XDG_CACHE_HOME/mhakern`` or ``~/.cache/mhakern``), ``MAX_JOBS``, ``TORCH_CUDA_ARCH_LIST``.

This file imports neither torch nor the rest of mhakern at module level: setup.py runs it where
torch may be missing, and the first-use build runs it as a script in a child process.
"""
from __future__ import annotations

import functools
import glob
import hashlib
import importlib
import importlib.machinery
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from typing import Dict, List, Mapping, Optional, Tuple

MODULE = "mhakern._C"
INSTALL_HINT = "pip install -e . --no-build-isolation"
# Per-ISA compile flags of the CPU kernel variants (x86-64, GCC/Clang).
ISA_FLAGS = {
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    # The bf16 variant (bf16 inputs only, issue 35): vdpbf16ps.
    "AVX512BF16": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c", "-mavx512bf16"],
}
# torch's named archs (torch.utils.cpp_extension), expanded before filtering.
NAMED_ARCHES = {
    "Kepler+Tesla": "3.7", "Kepler": "3.5+PTX", "Maxwell+Tegra": "5.3", "Maxwell": "5.0;5.2+PTX",
    "Pascal": "6.0;6.1+PTX", "Volta+Tegra": "7.2", "Volta": "7.0+PTX", "Turing": "7.5+PTX",
    "Ampere+Tegra": "8.7", "Ampere": "8.0;8.6+PTX", "Ada": "8.9+PTX", "Hopper": "9.0+PTX",
    "Blackwell+Tegra": "11.0", "Blackwell": "10.0;10.3;12.0;12.1+PTX",
}
_ARCH_RE = re.compile(r"^(\d+)\.(\d+)([af]?)(\+PTX)?$")
# The compiler's first error in a build log: GCC/Clang/nvcc diagnostics, then ninja or the linker.
_ERROR_RES = [
    re.compile(r":\s*(fatal )?error\s*:", re.IGNORECASE),
    re.compile(r"\b(error|fatal)\b", re.IGNORECASE),
    re.compile(r"\bFAILED\b|undefined reference|No such file|not found", re.IGNORECASE),
]


def say(msg: str) -> None:
    print(f"mhakern: {msg}", file=sys.stderr, flush=True)


def env_flag(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


# ---------------------------------------------------------------------------------------------
# The plan


def nvcc_version(nvcc: Optional[str]) -> Optional[str]:
    """'12.4' from ``nvcc --version``, or None."""
    if not nvcc:
        return None
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else None


def _printed_file(cxx: str, name: str) -> Optional[str]:
    """The path the C++ compiler's driver finds for library file ``name``, or None."""
    try:
        out = subprocess.run([cxx, f"-print-file-name={name}"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    path = out.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


def cxx_runtime_to_link(cxx: Optional[str] = None) -> Optional[str]:
    """The shared C++ runtime (libstdc++.so.6) to name on the link line (Linux), or None.

    Named explicitly, before the driver's own ``-lstdc++``, it resolves every C++ runtime
    symbol of the module, so that no part of the static ``libstdc++.a`` can be pulled in. One
    GPU image (GCC 13.3, torch 2.11) linked ``libstdc++.a`` into every extension built there,
    ours and a minimal one alike: the module then carried a second C++ runtime beside torch's,
    and every ``std::string`` or exception crossing between them crashed the process
    (TORCH_CHECK aborting instead of raising; a string-returning op segfaulting inside
    ostream's locale code, seen with cuda-gdb). Where the driver links the shared runtime
    anyway (every usual toolchain) this names the same library and changes nothing.
    """
    if not sys.platform.startswith("linux"):
        return None
    cxx = cxx or os.environ.get("CXX", "c++")
    found = _printed_file(cxx, "libstdc++.so.6")
    if found is not None:
        return os.path.realpath(found)
    try:  # the one this process already runs on (torch loaded it)
        with open("/proc/self/maps") as fh:
            for line in fh:
                path = line.split()[-1] if line.strip() else ""
                if os.path.basename(path).startswith("libstdc++.so.6") and os.path.exists(path):
                    return path
    except OSError:
        pass
    return None


def cxx_runtime_is_static_only(cxx: Optional[str] = None) -> bool:
    """Whether the driver finds no ``libstdc++.so`` to link (only the static archive)."""
    return sys.platform.startswith("linux") and _printed_file(cxx or os.environ.get("CXX", "c++"), "libstdc++.so") is None


def torch_info() -> Optional[dict]:
    """Facts about the torch importable here (the input of :func:`plan`), or None without one."""
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        return None
    cuda_home = getattr(cpp_extension, "CUDA_HOME", None)
    nvcc = None
    if cuda_home:
        cand = os.path.join(cuda_home, "bin", "nvcc.exe" if os.name == "nt" else "nvcc")
        nvcc = cand if os.path.exists(cand) else None
    try:
        openmp = "OpenMP" in torch.__config__.parallel_info().split("ATen parallel backend:")[-1]
    except Exception:  # noqa: BLE001 -- an old or unusual torch: assume no OpenMP
        openmp = False
    cuda = torch.version.cuda
    return {
        "version": torch.__version__,
        "cuda": cuda,
        "hip": getattr(torch.version, "hip", None),
        "nvcc": nvcc,
        "nvcc_version": nvcc_version(nvcc) if cuda and nvcc else None,
        "openmp": openmp,
        "cxx_runtime": cxx_runtime_to_link(),
        "cxx_runtime_static_only": cxx_runtime_is_static_only(),
        "machine": platform.machine().lower(),
        "platform": sys.platform,
    }


def visible_gpu_archs() -> List[str]:
    """Compute capabilities of the visible CUDA devices ('9.0', ...), empty without any. As in
    torch, a device newer than anything this torch was built for is clamped to the newest arch
    it knows (that toolkit may not know the device's; the PTX of the newest covers it)."""
    try:
        import torch

        if torch.version.cuda is None or not torch.cuda.is_available():
            return []
        known = [int(a[3:]) for a in torch.cuda.get_arch_list() if re.fullmatch(r"sm_\d+", a)]
        newest = max(((n // 10, n % 10) for n in known), default=None)
        caps = {tuple(torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())}
        if newest is not None:
            caps = {min(c, newest) for c in caps}
        return ["%d.%d" % c for c in sorted(caps)]
    except Exception:  # noqa: BLE001 -- a broken driver: build for the default list
        return []


@functools.lru_cache(maxsize=None)
def _caps_table() -> dict:
    """The capability table (mhakern/_caps.py, generated from csrc/capabilities.h), loaded by
    path: this file runs where the package cannot be imported (setup.py, the first-use build's
    child process)."""
    path = os.path.join(package_dir(), "_caps.py")
    spec = importlib.util.spec_from_file_location("mhakern_caps_for_build", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.TABLE


def min_arch() -> Tuple[int, int]:
    """The oldest GPU arch the CUDA kernels run on, as (major, minor): the capability table's
    (csrc/capabilities.h: kCudaMinCapabilityMajor/Minor), where the kernels state it, so that
    the build and the run-time check cannot disagree."""
    major, minor = _caps_table()["cuda"]["min_capability"]
    return major, minor


def sm90_arch() -> str:
    """The arch of the sm_90a family's pass ('9.0': csrc/capabilities.h kSm90CapabilityMajor/Minor)."""
    return "%d.%d" % tuple(_caps_table()["cuda"]["sm90"]["capability"])


def default_arch_list() -> str:
    """The archs built when nothing names any: the kernels' minimum and the sm_90a family's, with
    the latter's PTX ('8.0;9.0+PTX')."""
    return "%d.%d;%s+PTX" % (*min_arch(), sm90_arch())


def filter_arch_list(text: str) -> Tuple[List[str], List[str]]:
    """(kept, dropped) entries of a TORCH_CUDA_ARCH_LIST-style string ('8.6;7.5+PTX', names
    like 'Ampere', ' ' or ';' separated): kept are those of at least :func:`min_arch`; dropped
    are the older ones and anything unrecognised."""
    text = text.replace(" ", ";").replace(",", ";")
    for name, archs in NAMED_ARCHES.items():  # combined names first, as torch does
        text = text.replace(name, archs)
    kept, dropped = [], []
    for entry in (e.strip() for e in text.split(";")):
        if not entry:
            continue
        m = _ARCH_RE.match(entry)
        if m and (int(m.group(1)), int(m.group(2))) >= min_arch():
            if entry not in kept:
                kept.append(entry)
        else:
            dropped.append(entry)
    return kept, dropped


def arch_flags(archs: List[str]) -> List[str]:
    """nvcc -gencode flags for kept arch entries ('9.0a', '8.6+PTX', ...).

    9.0 is built as the sm_90a target (-gencode=arch=compute_90a,code=sm_90a): its SASS runs on
    the same devices as sm_90's (compute capability 9.0) and it is the pass in which the sm90
    family (csrc/cuda/sm90/: wgmma, setmaxnreg) has its kernel bodies; every other pass compiles
    those bodies away. '+PTX' still embeds the portable compute_90 PTX."""
    flags = []
    for entry in archs:
        num = entry.split("+")[0].replace(".", "")
        sass = num + "a" if num == sm90_arch().replace(".", "") else num
        flags.append(f"-gencode=arch=compute_{sass},code=sm_{sass}")
        if entry.endswith("+PTX"):
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


def builds_sm90a(archs: List[str]) -> bool:
    """Whether the arch list has the sm_90a pass (so the sm90 family has kernels)."""
    return any(entry.split("+")[0] in (sm90_arch(), sm90_arch() + "a") for entry in archs)


def _rel(root: str, path: str) -> str:
    # setuptools wants source paths relative to the project root (the build runs there).
    return os.path.relpath(path, root).replace(os.sep, "/")


def _sources(root: str) -> Dict[str, List[str]]:
    """The csrc files by role (see the module docstring), relative to ``root``, sorted."""

    def find(*patterns):
        found = set()
        for p in patterns:
            found.update(glob.glob(os.path.join(root, "csrc", p), recursive=True))
        return sorted(_rel(root, f) for f in found)

    cpu = find("*.cpp") + find("cpu/**/*.cpp")
    isa = {s for s in cpu if os.path.basename(s)[len("kernels_"):-len(".cpp")].upper() in ISA_FLAGS
           and os.path.basename(s).startswith("kernels_")}
    return {
        "cpu": [s for s in cpu if s not in isa],
        "isa": sorted(isa),
        "cuda": find("cuda/**/*.cu", "cuda/**/*.cpp"),
    }


def plan(env: Mapping[str, str], info: Optional[dict], root: str, gpu_archs: Optional[List[str]] = None) -> dict:
    """What to build, as plain data.

    env: the environment (switches, TORCH_CUDA_ARCH_LIST). info: :func:`torch_info`'s dict or
    None. root: the directory holding csrc/. gpu_archs: the visible GPUs' archs, used when
    TORCH_CUDA_ARCH_LIST is unset (a first-use build targets the machine it runs on).

    Returns {"build": False, "message": ...} or {"build": True, "message": ..., "notes": [...],
    "cuda": bool, "cuda_why": reason or None, "sources": [...], "cpu_sources": [...],
    "isa_sources": [(source, flags)], "define_macros": [...], "cxx_flags": [...],
    "nvcc_flags": [...], "link_flags": [...], "arch_list": "8.0;9.0+PTX" or None}.
    ``message`` is the one line a build prints; ``notes`` are further one-line remarks (archs
    dropped). ``cpu_sources`` is what a CPU-only fallback compiles besides the ISA files.
    """
    if env_flag(env, "MHAKERN_NO_EXTENSION"):
        return {
            "build": False,
            "message": "MHAKERN_NO_EXTENSION is set: skipping the C++ extension mhakern._C "
            "(pure-Python install; backend 'cpu' unavailable)",
        }
    if info is None:
        return {
            "build": False,
            "message": "torch is not importable in this build environment (pip's build isolation): mhakern._C "
            "is not built now; it is built on first use (or ahead with `python -m mhakern.build`), or during "
            f"the install with `{INSTALL_HINT}`",
        }
    src = _sources(root)
    isa_sources, macros = [], []
    x86 = info["machine"] in ("x86_64", "amd64", "i386", "i686")
    for s in src["isa"]:
        isa = os.path.basename(s)[len("kernels_"):-len(".cpp")].upper()
        if x86 and info["platform"] != "win32":
            isa_sources.append((s, list(ISA_FLAGS[isa])))
            macros.append((f"MHAKERN_CPU_{isa}", None))
    # -g0: the debug info Python's CFLAGS ask for doubles the compile time of these template-heavy files.
    cxx = ["-O3", "-g0", "-Wno-unknown-pragmas", "-Wno-psabi"]
    link = []
    if info["openmp"] and info["platform"].startswith("linux"):
        # at::parallel_for is inline: without OpenMP here the kernels would run on one thread.
        cxx.append("-fopenmp")
        link.append("-fopenmp")
    variants = ", ".join(["DEFAULT"] + [os.path.basename(s)[8:-4].upper() for s, _ in isa_sources])

    notes = []
    if info.get("cxx_runtime"):
        link.append(info["cxx_runtime"])  # the shared C++ runtime, by name (cxx_runtime_to_link)
        if info.get("cxx_runtime_static_only"):
            notes.append(
                f"the C++ compiler finds no shared libstdc++ to link (only the static one, which would put a "
                f"second C++ runtime into the module: strings and exceptions crossing into torch crash); "
                f"linking {info['cxx_runtime']} by name"
            )
    cuda_why = None
    archs: List[str] = []
    torch_major = (info.get("cuda") or "").split(".")[0]
    nv = info.get("nvcc_version")
    arch_env = env.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if env_flag(env, "MHAKERN_NO_CUDA"):
        cuda_why = "MHAKERN_NO_CUDA is set"
    elif not info.get("cuda"):
        cuda_why = "torch has no CUDA" + (" (ROCm build)" if info.get("hip") else "")
    elif not info.get("nvcc"):
        cuda_why = "nvcc not found (set CUDA_HOME)"
    elif nv and nv.split(".")[0] != torch_major:
        # torch's BuildExtension would raise on this before any file compiles.
        cuda_why = (
            f"nvcc is CUDA {nv} but torch was built with CUDA {info['cuda']} (major versions differ; point "
            f"CUDA_HOME at a CUDA {torch_major}.x toolkit for the CUDA kernels)"
        )
    else:
        if arch_env == "native":
            arch_src, arch_text = "the visible GPUs", ";".join(gpu_archs or [])
        elif arch_env:
            arch_src, arch_text = "TORCH_CUDA_ARCH_LIST", arch_env
        elif gpu_archs:
            arch_src, arch_text = "the visible GPUs", ";".join(gpu_archs)
        else:
            arch_src, arch_text = "the default", default_arch_list()
        archs, dropped = filter_arch_list(arch_text)
        if arch_src == "the visible GPUs" and archs and not archs[-1].endswith("+PTX"):
            archs[-1] += "+PTX"
        if dropped:
            notes.append(
                f"{arch_src} ({arch_text}): dropped {', '.join(dropped)} (the CUDA kernels need sm_{'%d%d' % min_arch()} or newer)"
                + (f"; building for {';'.join(archs)}" if archs else "")
            )
        if not archs:
            cuda_why = f"{arch_src} ({arch_text or 'none'}) names no GPU arch of {'%d.%d' % min_arch()} or newer"

    p = {
        "build": True,
        "cuda": cuda_why is None,
        "cuda_why": cuda_why,
        "notes": notes,
        "cpu_sources": list(src["cpu"]),
        "sources": list(src["cpu"]),
        "isa_sources": isa_sources,
        "define_macros": macros,
        "cxx_flags": cxx,
        "nvcc_flags": [],
        "link_flags": link,
        "arch_list": None,
    }
    if cuda_why is None:
        p["sources"] += src["cuda"]
        p["define_macros"] = macros + [("MHAKERN_WITH_CUDA", None)]
        if builds_sm90a(archs):  # the host may then pick the sm90 family on 9.0 devices
            p["define_macros"].append(("MHAKERN_WITH_SM90A", None))
        # Explicit -gencode flags: torch then adds none of its own (it skips when it sees 'arch').
        p["nvcc_flags"] = ["-O3", "-Xptxas", "-v", "-lineinfo"] + arch_flags(archs)
        p["arch_list"] = ";".join(archs)
        n_cu = sum(s.endswith(".cu") for s in src["cuda"])
        p["message"] = (
            f"building mhakern._C with CPU kernels ({variants}) and CUDA kernels ({n_cu} .cu files, "
            f"torch CUDA {info['cuda']}, arch {p['arch_list']})"
        )
    else:
        p["message"] = f"building mhakern._C with CPU kernels ({variants}); no CUDA code: {cuda_why}"
    return p


# ---------------------------------------------------------------------------------------------
# The build (torch's BuildExtension)


def _make_cpu_only(ext, p: dict) -> None:
    """Turn a CUDA extension object into the CPU-only one of the same plan, in place."""
    from torch.utils import cpp_extension

    ref = cpp_extension.CppExtension(name=ext.name, sources=list(p["cpu_sources"]))
    ext.sources = list(p["cpu_sources"])
    ext.define_macros = [m for m in (ext.define_macros or []) if m[0] != "MHAKERN_WITH_CUDA"]
    ext.libraries = list(ref.libraries)
    ext.library_dirs = list(ref.library_dirs)
    ext.include_dirs = [d for d in ext.include_dirs if d in ref.include_dirs or d.endswith("csrc")]
    # extra_compile_args stay: the nvcc flags go unused without .cu files, and the -D flags
    # BuildExtension's preprocessing may already have put in the cxx list are still wanted.
    ext.mhakern_cuda = False


def first_error(text: str) -> str:
    """The compiler's first error line in a build log (or its last non-empty line)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for rx in _ERROR_RES:
        for ln in lines:
            if rx.search(ln) and not ln.startswith(("mhakern:", "-- ")) and "warning" not in ln.lower()[:40]:
                return ln[:400]
    return lines[-1][:400] if lines else "no output"


def build_ext_class(env: Mapping[str, str]):
    """torch's BuildExtension plus: per-file ISA flags; a CUDA failure that rebuilds CPU-only; a
    failure that warns and lets the install go on (unless MHAKERN_REQUIRE_EXTENSION=1)."""
    from torch.utils.cpp_extension import BuildExtension

    class BuildExt(BuildExtension):
        def finalize_options(self):
            super().finalize_options()
            # Without ninja, setuptools' own parallel compile honours MAX_JOBS.
            jobs = env.get("MAX_JOBS", "").strip()
            if not self.use_ninja and jobs.isdigit() and int(jobs) > 1 and not self.parallel:
                self.parallel = int(jobs)

        def build_extensions(self):
            # torch checks nvcc against its own CUDA version and the host compiler's bounds before
            # any extension builds, and raises: fall back to CPU-only extensions before that point.
            try:
                super().build_extensions()
            except Exception as e:  # noqa: BLE001
                cuda = [x for x in self.extensions if getattr(x, "mhakern_cuda", False)]
                if getattr(self, "_mhakern_started", False) or not cuda or env_flag(env, "MHAKERN_REQUIRE_CUDA"):
                    raise
                self._cuda_failed(e)
                for x in cuda:
                    _make_cpu_only(x, x.mhakern_plan)
                super().build_extensions()

        def _cuda_failed(self, e):
            msg = first_error(str(e)) if str(e).strip() else type(e).__name__
            say(
                f"WARNING: the CUDA part of mhakern._C failed ({type(e).__name__}: {msg}); building the CPU "
                "kernels alone (MHAKERN_REQUIRE_CUDA=1 makes this an error)"
            )
            self.mhakern_cuda_error = f"{type(e).__name__}: {msg}"

        def build_extension(self, ext):
            self._mhakern_started = True
            try:
                try:
                    self._build_with_isa_variants(ext)
                except Exception as e:  # noqa: BLE001 -- any compiler/linker/toolchain failure
                    if not getattr(ext, "mhakern_cuda", False) or env_flag(env, "MHAKERN_REQUIRE_CUDA"):
                        raise
                    self._cuda_failed(e)
                    _make_cpu_only(ext, ext.mhakern_plan)
                    self._build_with_isa_variants(ext)
            except Exception as e:  # noqa: BLE001
                if env_flag(env, "MHAKERN_REQUIRE_EXTENSION"):
                    raise
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                say(
                    f"WARNING: building the C++ extension {ext.name} failed ({type(e).__name__}: {first}); "
                    "installing the pure-Python package without it (it is built on first use instead). "
                    "See the compiler output above; MHAKERN_REQUIRE_EXTENSION=1 makes this an error."
                )

        def _build_with_isa_variants(self, ext):
            # The ISA variants need their own -m flags, which torch's ninja build cannot give to
            # single files: compile each alone, then link its object after the others (so that
            # inline functions shared with the baseline files keep their baseline copy). Each
            # variant compiles in a thread of its own while the main build compiles the rest
            # (the link waits for them): one after the other, ahead of the main build, they
            # left all but one core idle for about half of a CPU-only build. Each gets its own
            # build directory, since a ninja compile writes build.ninja where its objects go.
            # MAX_JOBS=1 keeps the serial order.
            variants = list(getattr(ext, "mhakern_isa_sources", []))
            jobs = env.get("MAX_JOBS", "").strip()
            jobs = int(jobs) if jobs.isdigit() and int(jobs) > 0 else (os.cpu_count() or 1)

            def compile_variant(src, flags):
                args = ext.extra_compile_args
                args = {k: list(v) for k, v in args.items()} if isinstance(args, dict) else {"cxx": list(args)}
                args["cxx"] = args.get("cxx", []) + flags
                isa = os.path.basename(src)[len("kernels_"):-len(".cpp")]
                return self.compiler.compile(
                    [src],
                    output_dir=os.path.join(self.build_temp, f"isa_{isa}"),
                    macros=list(ext.define_macros or []),
                    include_dirs=ext.include_dirs,
                    debug=self.debug,
                    extra_postargs=args,
                    depends=ext.depends,
                )

            if not variants:
                super().build_extension(ext)
                return
            if jobs <= 1:
                saved = list(ext.extra_objects or [])
                ext.extra_objects = saved + [o for src, flags in variants for o in compile_variant(src, flags)]
                try:
                    super().build_extension(ext)
                finally:
                    ext.extra_objects = saved
                return
            from concurrent.futures import ThreadPoolExecutor

            pool = ThreadPoolExecutor(max_workers=min(len(variants), jobs))
            futures = [pool.submit(compile_variant, src, flags) for src, flags in variants]
            compiler = self.compiler
            had_own = "link_shared_object" in vars(compiler)
            link = compiler.link_shared_object

            def link_after_the_variants(objects, *args, **kwargs):
                variant_objects = [o for f in futures for o in f.result()]  # a variant's error raises here
                return link(list(objects) + variant_objects, *args, **kwargs)

            compiler.link_shared_object = link_after_the_variants
            try:
                super().build_extension(ext)
                for f in futures:  # raise a variant's failure even where the link was skipped
                    f.result()
            finally:
                if had_own:
                    compiler.link_shared_object = link
                else:
                    del compiler.link_shared_object
                pool.shutdown(wait=True)

    return BuildExt


def extension_modules(env: Optional[Mapping[str, str]] = None, root: Optional[str] = None, p: Optional[dict] = None):
    """(ext_modules, cmdclass) for mhakern._C as setup() takes them, or empty ones when the plan
    builds nothing. Prints the plan's lines."""
    env = os.environ if env is None else env
    root = source_root() if root is None else root
    if p is None:
        p = plan(env, torch_info() if not env_flag(env, "MHAKERN_NO_EXTENSION") else None, root)
    say(p["message"])
    for note in p.get("notes", []):
        say(note)
    if not p["build"]:
        return [], {}
    from torch.utils import cpp_extension

    kwargs = dict(
        name=MODULE,
        sources=p["sources"],
        include_dirs=[os.path.join(root, "csrc")],
        define_macros=p["define_macros"],
        extra_compile_args={"cxx": list(p["cxx_flags"])},
        extra_link_args=p["link_flags"],
    )
    if p["cuda"]:
        kwargs["extra_compile_args"]["nvcc"] = list(p["nvcc_flags"])
        ext = cpp_extension.CUDAExtension(**kwargs)
    else:
        ext = cpp_extension.CppExtension(**kwargs)
    ext.mhakern_isa_sources = p["isa_sources"]
    ext.mhakern_cuda = p["cuda"]
    ext.mhakern_plan = p
    # optional: setuptools then skips copying a module that failed to build (editable installs
    # would otherwise stop there), after BuildExt's warning.
    ext.optional = not env_flag(env, "MHAKERN_REQUIRE_EXTENSION")
    ext.depends = sorted(_rel(root, f) for f in glob.glob(os.path.join(root, "csrc", "**", "*.h"), recursive=True))
    return [ext], {"build_ext": build_ext_class(env)}


# ---------------------------------------------------------------------------------------------
# Build at first use


def package_dir() -> str:
    return os.path.dirname(os.path.abspath(__file__))


def source_root() -> Optional[str]:
    """The directory holding csrc/: the project root of a checkout or editable install, or the
    copy a regular install carries (mhakern/_src); None when neither exists."""
    for cand in (os.path.dirname(package_dir()), os.path.join(package_dir(), "_src")):
        if os.path.isfile(os.path.join(cand, "csrc", "bindings.cpp")):
            return cand
    return None


def cache_dir(env: Optional[Mapping[str, str]] = None) -> str:
    env = os.environ if env is None else env
    if env.get("MHAKERN_CACHE_DIR"):
        return os.path.abspath(os.path.expanduser(env["MHAKERN_CACHE_DIR"]))
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mhakern")


def build_key(root: str, info: dict, p: dict) -> str:
    """Directory name of a first-use build: readable versions and a hash of everything that
    changes the module: csrc/ (sources and headers), the torch, CUDA and Python versions, and
    the plan's sources and flags (the GPU archs among them)."""
    h = hashlib.sha256()
    # csrc/flex/ holds the templates of mhakern.flex's generated kernels (built apart, per
    # modifier): editing them must not rebuild _C.
    files = sorted(f for f in glob.glob(os.path.join(root, "csrc", "**", "*"), recursive=True)
                   if os.path.isfile(f) and not _rel(root, f).startswith("csrc/flex/"))
    for f in files:
        h.update(_rel(root, f).encode())
        with open(f, "rb") as fh:
            h.update(hashlib.sha256(fh.read()).digest())
    facts = {k: info.get(k) for k in ("version", "cuda", "hip", "nvcc_version", "machine", "platform")}
    facts["ext_suffix"] = sysconfig.get_config_var("EXT_SUFFIX")
    facts["plan"] = {k: p.get(k) for k in ("sources", "isa_sources", "define_macros", "cxx_flags", "nvcc_flags")}
    facts["cxx"] = os.environ.get("CXX", "")
    h.update(json.dumps(facts, sort_keys=True, default=str).encode())
    tag = "torch{}-{}-py{}{}".format(
        info["version"].split("+")[0], "cu" + info["cuda"].replace(".", "") if p.get("cuda") else "cpu",
        *sys.version_info[:2],
    )
    return f"{tag}-{h.hexdigest()[:16]}"


def _module_file(lib_dir: str) -> Optional[str]:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        f = os.path.join(lib_dir, "mhakern", "_C" + suffix)
        if os.path.exists(f):
            return f
    return None


class _FileLock:
    """An exclusive lock on a file (fcntl on POSIX; on other systems, no lock)."""

    def __init__(self, path: str):
        self.path = path
        self.fd = None

    def acquire(self, on_wait=None):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            import fcntl
        except ImportError:
            return self
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def release(self):
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock
            self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def _child_env(env: Mapping[str, str]) -> Dict[str, str]:
    child = dict(env)
    # ninja comes with the package (a dependency) into this interpreter's scripts directory,
    # which is not on PATH when the venv is not activated; torch looks for it on PATH.
    extra = [sysconfig.get_path("scripts"), os.path.dirname(sys.executable)]
    child["PATH"] = os.pathsep.join([d for d in extra if d] + [env.get("PATH", "")])
    return child


class BuildFailed(ImportError):
    pass


def ensure_built(key_dir: str, build, force: bool = False, on_start=None, on_wait=None) -> str:
    """The module file in ``key_dir``, building it with ``build(key_dir)`` first unless it is
    there. One process builds at a time per key (a file lock); a failure is recorded in
    ``key_dir/failed.json`` and raised as BuildFailed, and not retried unless ``force``."""
    lib = os.path.join(key_dir, "lib")
    found = _module_file(lib)
    if found and not force:
        return found
    os.makedirs(key_dir, exist_ok=True)
    failed = os.path.join(key_dir, "failed.json")
    with _FileLock(key_dir + ".lock").acquire(on_wait):
        found = _module_file(lib)
        if found and not force:
            return found  # another process built it while this one waited
        if os.path.exists(failed) and not force:
            with open(failed) as fh:
                raise BuildFailed(json.load(fh)["message"])
        if os.path.exists(failed):
            os.remove(failed)
        if on_start is not None:
            on_start()
        try:
            build(key_dir)
        except BuildFailed as e:
            with open(failed, "w") as fh:
                json.dump({"message": str(e), "time": time.time()}, fh)
            raise
        found = _module_file(lib)
        if found is None:
            raise BuildFailed(f"the build in {key_dir} finished without a module file")
        return found


def _run_build(root: str, key_dir: str, env: Mapping[str, str]) -> None:
    """Build in a child process (this file as a script), its output in key_dir/build.log; the
    module goes to key_dir/staging, renamed to key_dir/lib when complete (a process that looks
    without the lock never sees a half-written file)."""
    log = os.path.join(key_dir, "build.log")
    staging, lib = os.path.join(key_dir, "staging"), os.path.join(key_dir, "lib")
    shutil.rmtree(staging, ignore_errors=True)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", root, key_dir]
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, cwd=root, env=_child_env(env), stdout=fh, stderr=subprocess.STDOUT).returncode
    if rc == 0 and _module_file(staging) is not None:
        shutil.rmtree(lib, ignore_errors=True)
        os.replace(staging, lib)
        shutil.rmtree(os.path.join(key_dir, "tmp"), ignore_errors=True)  # objects: up to GBs with CUDA
    else:
        with open(log, errors="replace") as fh:
            first = first_error(fh.read())
        raise BuildFailed(
            f"building mhakern._C at first use failed: {first} (full log: {log}); fix the cause, then "
            f"`python -m mhakern.build --force`, or build during the install with `{INSTALL_HINT}`"
        )


def _worker(root: str, key_dir: str) -> int:
    """The child process of a first-use build: setuptools' build_ext with :func:`build_ext_class`."""
    from setuptools import Distribution

    env = dict(os.environ)
    env["MHAKERN_REQUIRE_EXTENSION"] = "1"  # a failure must show as one here, not as a warning
    env.pop("MHAKERN_NO_EXTENSION", None)
    p = plan(env, torch_info(), root, visible_gpu_archs())
    exts, cmdclass = extension_modules(env, root, p)
    dist = Distribution({"name": "mhakern", "ext_modules": exts, "cmdclass": cmdclass, "script_name": "setup.py"})
    cmd = dist.get_command_obj("build_ext")
    cmd.build_lib = os.path.join(key_dir, "staging")
    cmd.build_temp = os.path.join(key_dir, "tmp")
    cmd.inplace = False
    dist.run_command("build_ext")
    info = {"message": p["message"], "notes": p["notes"], "cuda": p["cuda"] and exts[0].mhakern_cuda,
            "cuda_error": getattr(dist.get_command_obj("build_ext"), "mhakern_cuda_error", None)}
    with open(os.path.join(key_dir, "staging", "build_info.json"), "w") as fh:
        json.dump(info, fh)
    return 0


def jit_build(env: Optional[Mapping[str, str]] = None, force: bool = False) -> str:
    """Build mhakern._C into the cache if it is not there yet (or ``force``); returns the module
    file. Raises BuildFailed (an ImportError) with the compiler's first error."""
    env = os.environ if env is None else env
    root = source_root()
    if root is None:
        raise BuildFailed(
            f"mhakern._C is not built and this install carries no C++ sources to build it from; reinstall "
            f"from a checkout with `{INSTALL_HINT}`"
        )
    info = torch_info()
    if info is None:
        raise BuildFailed("torch is not importable")
    env = {k: v for k, v in env.items() if k != "MHAKERN_NO_EXTENSION"}
    p = plan(env, info, root, visible_gpu_archs())
    key_dir = os.path.join(cache_dir(env), build_key(root, info, p))
    t0 = []

    def on_start():
        t0.append(time.monotonic())
        what = p["message"][len("building mhakern._C with "):]
        say(
            f"building mhakern._C for this machine ({what}) into {key_dir}: a few minutes, once "
            f"(`python -m mhakern.build` does it ahead; log: {os.path.join(key_dir, 'build.log')})"
        )

    def on_wait():
        say(f"waiting for another process that is building mhakern._C into {key_dir}")

    path = ensure_built(key_dir, lambda d: _run_build(root, d, env), force, on_start, on_wait)
    if t0:
        extra = ""
        info_file = os.path.join(key_dir, "lib", "build_info.json")
        if os.path.exists(info_file):
            with open(info_file) as fh:
                cuda_error = json.load(fh).get("cuda_error")
            if cuda_error:
                extra = f" (CPU kernels only: the CUDA part failed: {cuda_error})"
        say(f"built mhakern._C in {time.monotonic() - t0[0]:.0f} s{extra}")
    return path


_failed: List[str] = []  # this process's first-use build error, so that it is not retried


def _import_file(path: str):
    loader = importlib.machinery.ExtensionFileLoader(MODULE, path)
    spec = importlib.util.spec_from_file_location(MODULE, path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def load_built_module():
    """The compiled module from the first-use build (building it now if needed).

    mhakern/_C.py calls this: Python's import prefers a compiled ``mhakern/_C*.so`` (built at
    install) to that file, so ``import mhakern._C`` gives the install's module where there is
    one and this one otherwise, and nothing else in mhakern needs to know which route built it.
    Raises ImportError with the complete reason (the compiler's first error, the log, what to
    do); a failure is not retried within the process."""
    if _failed:
        raise ImportError(_failed[0])
    if env_flag(os.environ, "MHAKERN_NO_JIT"):
        why = (
            "mhakern._C is not built and MHAKERN_NO_JIT=1 forbids building it at first use; build it with "
            f"`python -m mhakern.build` or during the install with `{INSTALL_HINT}`"
        )
        raise ImportError(why)
    try:
        return _import_file(jit_build())
    except ImportError as e:
        _failed.append(str(e))
    except Exception as e:  # noqa: BLE001 -- a broken cache or toolchain must not crash the caller
        hint = "; MHAKERN_CACHE_DIR chooses another cache directory" if isinstance(e, OSError) else ""
        _failed.append(f"building mhakern._C at first use raised {type(e).__name__}: {e}{hint}")
    raise ImportError(_failed[0])


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m mhakern.build [--force]``: build mhakern._C into the cache now."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m mhakern.build", description=main.__doc__)
    ap.add_argument("--force", action="store_true", help="rebuild even if built (or failed) before")
    args = ap.parse_args(argv)
    spec = importlib.util.find_spec(MODULE)
    if spec is not None and isinstance(spec.loader, importlib.machinery.ExtensionFileLoader) and not args.force:
        print(f"mhakern._C was built at install time: {spec.origin}; nothing to build (--force builds the cache copy)")
        return 0
    try:
        path = jit_build(force=args.force)
    except ImportError as e:
        print(f"mhakern.build: {e}", file=sys.stderr)
        return 1
    print(f"mhakern._C: {path}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        sys.exit(_worker(sys.argv[2], sys.argv[3]))
    sys.exit(main())
