"""Build script: the pure-Python package always; the extension module mhakern._C when torch is
importable while building.

Package metadata lives in pyproject.toml. What mhakern._C is made of, and every decision about
it (CPU kernels per ISA, CUDA or not, GPU archs, the fallbacks), lives in mhakern/_build.py,
which the first-use build shares: see its docstring. This file loads it by path (importing the
package would import torch, which pip's build isolation does not have).

=====================================================  =========================================
situation                                              what this build does
=====================================================  =========================================
MHAKERN_NO_EXTENSION=1                                 nothing compiled (pure Python)
torch not importable (a plain ``pip install -e .``:    nothing compiled, one line; mhakern._C is
pip's build isolation)                                 built at first use (or ``python -m
                                                       mhakern.build``)
torch importable (``--no-build-isolation``)            mhakern._C in place: CPU kernels, and CUDA
                                                       kernels when torch has CUDA and a matching
                                                       nvcc is found (else CPU only, one line why)
=====================================================  =========================================

A failed compile prints a warning and the pure-Python install goes on (the module is then built
at first use), unless MHAKERN_REQUIRE_EXTENSION=1 (CI) makes it an error.
"""
import importlib.util
import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))


def _load_build_module():
    spec = importlib.util.spec_from_file_location("mhakern_build_plan", os.path.join(ROOT, "mhakern", "_build.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class BuildPyWithSources(build_py):
    """A regular (non-editable) install carries csrc/ as mhakern/_src/csrc, so that the module can
    be built at first use there too; an editable install builds from the checkout itself."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        dst = os.path.join(self.build_lib, "mhakern", "_src", "csrc")
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(
            os.path.join(ROOT, "csrc"), dst,
            ignore=shutil.ignore_patterns("*.o", "*.so", "__pycache__", "build"),
        )


if __name__ == "__main__":
    _build = _load_build_module()
    ext_modules, cmdclass = _build.extension_modules(os.environ, ROOT)
    cmdclass["build_py"] = BuildPyWithSources
    setup(
        packages=find_packages(include=["mhakern", "mhakern.*"]),
        ext_modules=ext_modules,
        cmdclass=cmdclass,
    )
