"""Build script: the pure-Python package always; the extension module mhakern._C when possible.

Package metadata lives in pyproject.toml; this file only decides which compiled extensions to
build (see ``_extension_modules``). A build that cannot make the extension still installs the
pure-Python package and says why in one line.

Build matrix of mhakern._C (decided by ``_plan``, which tests call with fake environments):

=====================================================  =========================================
situation                                              what is built
=====================================================  =========================================
MHAKERN_NO_EXTENSION=1                                 nothing (pure Python; backend 'cpu' absent)
torch not importable (pip's build isolation)           nothing; one line: use
                                                       ``pip install -e . --no-build-isolation``
torch without CUDA, or MHAKERN_NO_CUDA=1, or no        CppExtension: bindings + CPU kernels
nvcc (CUDA_HOME), or no csrc/cuda/*.cu yet
torch with CUDA, nvcc found, csrc/cuda/*.cu present    CUDAExtension: the above + csrc/cuda/*.cu
                                                       + csrc/cuda_host.cpp, -DMHAKERN_WITH_CUDA
=====================================================  =========================================

CPU kernels: csrc/cpu/kernels_default.cpp with the baseline flags and, on x86-64,
kernels_avx2.cpp and kernels_avx512.cpp each compiled alone with its own -m flags (never
-march=native: the module must run on other CPUs); attention_cpu.cpp picks one at run time.
CUDA: arch list 8.0 and 9.0 plus PTX unless TORCH_CUDA_ARCH_LIST says otherwise; ``-Xptxas -v``
prints registers, spills and shared memory per kernel into the build log; no --use_fast_math
(the kernels are exact). MAX_JOBS bounds the parallel compile jobs (ninja, or setuptools'
parallel build without it). A failed compile prints a warning and the pure-Python install goes
on, unless MHAKERN_REQUIRE_EXTENSION=1 (CI) makes it an error.
"""
import glob
import os
import platform
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))

INSTALL_HINT = "pip install -e . --no-build-isolation"
# Per-ISA compile flags of the CPU kernel variants (x86-64, GCC/Clang).
ISA_FLAGS = {
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
}
DEFAULT_CUDA_ARCH_FLAGS = [
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90,code=sm_90",
    "-gencode=arch=compute_90,code=compute_90",
]


def _say(msg: str) -> None:
    print(f"mhakern setup: {msg}", file=sys.stderr)


def _env_flag(env, name: str) -> bool:
    return env.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def _rel(path: str) -> str:
    # setuptools wants source paths relative to the project root.
    return os.path.relpath(path, ROOT).replace(os.sep, "/")


def _torch_info():
    """Facts about the torch importable here, or None when there is none."""
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
    return {
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "nvcc": nvcc,
        "openmp": openmp,
        "machine": platform.machine().lower(),
        "platform": sys.platform,
    }


def _plan(env, info):
    """What to build, as plain data.

    Returns {"build": False, "message": ...} or {"build": True, "message": ..., "cuda": bool,
    "sources": [...], "isa_sources": [(source, flags)], "define_macros": [...],
    "cxx_flags": [...], "nvcc_flags": [...], "link_flags": [...]}. ``message`` is the one line
    the build prints.
    """
    if _env_flag(env, "MHAKERN_NO_EXTENSION"):
        return {
            "build": False,
            "message": "MHAKERN_NO_EXTENSION is set: skipping the C++ extension mhakern._C "
            "(pure-Python install; backend 'cpu' unavailable)",
        }
    if info is None:
        return {
            "build": False,
            "message": "torch is not importable in this build environment (build isolation?): skipping the "
            f"C++ extension mhakern._C; to build it, install torch and run `{INSTALL_HINT}`",
        }
    cpu_sources = [
        "csrc/bindings.cpp",
        "csrc/cpu/attention_cpu.cpp",
        "csrc/cpu/kernels_default.cpp",
    ]
    isa_sources = []
    macros = []
    x86 = info["machine"] in ("x86_64", "amd64", "i386", "i686")
    if x86 and info["platform"] != "win32":
        for isa, flags in ISA_FLAGS.items():
            isa_sources.append((f"csrc/cpu/kernels_{isa.lower()}.cpp", list(flags)))
            macros.append((f"MHAKERN_CPU_{isa}", None))
    # -g0: the debug info Python's CFLAGS ask for doubles the compile time of these template-heavy files.
    cxx = ["-O3", "-g0", "-Wno-unknown-pragmas", "-Wno-psabi"]
    link = []
    if info["openmp"] and info["platform"].startswith("linux"):
        # at::parallel_for is inline: without OpenMP here the kernels would run on one thread.
        cxx.append("-fopenmp")
        link.append("-fopenmp")
    variants = ", ".join(["DEFAULT"] + [os.path.basename(s)[8:-4].upper() for s, _ in isa_sources])

    cuda_why = None
    cu_files = sorted(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")))
    if _env_flag(env, "MHAKERN_NO_CUDA"):
        cuda_why = "MHAKERN_NO_CUDA is set"
    elif not info["cuda"]:
        cuda_why = "torch has no CUDA" + (" (ROCm build)" if info.get("hip") else "")
    elif not info["nvcc"]:
        cuda_why = "nvcc not found (set CUDA_HOME)"
    elif not cu_files:
        cuda_why = "csrc/cuda/ holds no .cu file"
    elif not os.path.exists(os.path.join(ROOT, "csrc", "cuda_host.cpp")):
        cuda_why = "csrc/cuda_host.cpp is missing"

    plan = {
        "build": True,
        "cuda": cuda_why is None,
        "sources": list(cpu_sources),
        "isa_sources": isa_sources,
        "define_macros": macros,
        "cxx_flags": cxx,
        "nvcc_flags": [],
        "link_flags": link,
    }
    if cuda_why is None:
        plan["sources"] += ["csrc/cuda_host.cpp"] + [_rel(f) for f in cu_files]
        plan["define_macros"].append(("MHAKERN_WITH_CUDA", None))
        arch = [] if env.get("TORCH_CUDA_ARCH_LIST") else list(DEFAULT_CUDA_ARCH_FLAGS)
        plan["nvcc_flags"] = ["-O3", "-Xptxas", "-v", "-lineinfo"] + arch
        arch_txt = env.get("TORCH_CUDA_ARCH_LIST") or "8.0;9.0+PTX"
        plan["message"] = (
            f"building mhakern._C with CPU kernels ({variants}) and CUDA kernels ({len(cu_files)} .cu files, "
            f"torch CUDA {info['cuda']}, arch {arch_txt})"
        )
    else:
        plan["message"] = f"building mhakern._C with CPU kernels ({variants}); no CUDA code: {cuda_why}"
    return plan


def _build_ext_class(env):
    """torch's BuildExtension, plus per-file ISA flags and a failure that does not abort."""
    from torch.utils.cpp_extension import BuildExtension

    class BuildExt(BuildExtension):
        def finalize_options(self):
            super().finalize_options()
            # Without ninja, setuptools' own parallel compile honours MAX_JOBS.
            jobs = env.get("MAX_JOBS", "").strip()
            if not self.use_ninja and jobs.isdigit() and int(jobs) > 1 and not self.parallel:
                self.parallel = int(jobs)

        def build_extension(self, ext):
            try:
                self._build_with_isa_variants(ext)
            except Exception as e:  # noqa: BLE001 -- any compiler/linker/toolchain failure
                if _env_flag(env, "MHAKERN_REQUIRE_EXTENSION"):
                    raise
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                _say(
                    f"WARNING: building the C++ extension {ext.name} failed ({type(e).__name__}: {first}); "
                    "installing the pure-Python package without it, so backend 'cpu' is unavailable. "
                    "See the compiler output above; MHAKERN_REQUIRE_EXTENSION=1 makes this an error."
                )

        def _build_with_isa_variants(self, ext):
            # The ISA variants need their own -m flags, which torch's ninja build cannot give to
            # single files: compile each alone, then link its object after the others (so that
            # inline functions shared with the baseline files keep their baseline copy).
            extra_objects = []
            for src, flags in getattr(ext, "mhakern_isa_sources", []):
                args = ext.extra_compile_args
                args = {k: list(v) for k, v in args.items()} if isinstance(args, dict) else {"cxx": list(args)}
                args["cxx"] = args.get("cxx", []) + flags
                extra_objects += self.compiler.compile(
                    [src],
                    output_dir=self.build_temp,
                    macros=list(ext.define_macros or []),
                    include_dirs=ext.include_dirs,
                    debug=self.debug,
                    extra_postargs=args,
                    depends=ext.depends,
                )
            saved = list(ext.extra_objects or [])
            ext.extra_objects = saved + extra_objects
            try:
                super().build_extension(ext)
            finally:
                ext.extra_objects = saved

    return BuildExt


def _extension_modules(env=None):
    """(ext_modules, cmdclass) for mhakern._C, or empty ones when it is not to be built."""
    env = os.environ if env is None else env
    plan = _plan(env, _torch_info() if not _env_flag(env, "MHAKERN_NO_EXTENSION") else None)
    _say(plan["message"])
    if not plan["build"]:
        return [], {}
    from torch.utils import cpp_extension

    kwargs = dict(
        name="mhakern._C",
        sources=plan["sources"],
        include_dirs=[os.path.join(ROOT, "csrc")],
        define_macros=plan["define_macros"],
        extra_compile_args={"cxx": plan["cxx_flags"]},
        extra_link_args=plan["link_flags"],
    )
    if plan["cuda"]:
        kwargs["extra_compile_args"]["nvcc"] = plan["nvcc_flags"]
        ext = cpp_extension.CUDAExtension(**kwargs)
    else:
        ext = cpp_extension.CppExtension(**kwargs)
    ext.mhakern_isa_sources = plan["isa_sources"]
    # optional: setuptools then skips copying a module that failed to build (editable installs
    # would otherwise stop there), after BuildExt's warning.
    ext.optional = not _env_flag(env, "MHAKERN_REQUIRE_EXTENSION")
    ext.depends = sorted(_rel(p) for p in glob.glob(os.path.join(ROOT, "csrc", "**", "*.h"), recursive=True))
    return [ext], {"build_ext": _build_ext_class(env)}


if __name__ == "__main__":
    ext_modules, cmdclass = _extension_modules()
    # The Triton kernels live in kernels/ at the top of the tree but install as mhakern.kernels: a
    # top-level package named "kernels" would collide with an unrelated one on PyPI.
    packages = find_packages(include=["mhakern", "mhakern.*"]) + ["mhakern.kernels"]
    setup(
        packages=packages,
        package_dir={"mhakern.kernels": "kernels"},
        ext_modules=ext_modules,
        cmdclass=cmdclass,
    )
