"""A prebuilt mhakern._C, built on another machine for the device's stack, and when to use it.

``tools/prebuild_device.py`` builds the module on a CPU machine against the torch, CUDA and
Python a GPU machine has, and leaves it in a directory (default ``.prebuilt`` at the repository
root) beside a ``manifest.json`` that says what it was built against. On the GPU machine,

    python tools/prebuilt.py use [DIR]

installs it where an in-place build puts it (``mhakern/_C<EXT_SUFFIX>``) when it fits this
interpreter, this torch and these sources, prints ``prebuilt: used <file> (torch X, CUDA Y, cpZZ,
archs ...)`` and exits 0; otherwise it prints ``prebuilt: not used: <reason>``, installs nothing
and exits 1 (the caller then builds on the device).

It fits when the torch release (``2.11.0`` of ``2.11.0+cu130``), ``torch.version.cuda``, the
Python tag (``cp312``) and the source digest all equal the manifest's, the module file is the
one the manifest names (its SHA-256), its extension suffix is one this interpreter loads, and,
where a GPU is visible, the module carries code for its compute capability.

The source digest (:func:`source_digest`) covers what went into the module: every file under
``csrc/``, as the first-use build's cache key does, and the build recipe: the sources, macros and
compiler flags that mhakern/_build.py's ``plan`` gives for the manifest's archs and CUDA version
(so a changed flag counts, a changed comment in _build.py does not).

This file imports nothing heavy at module level (the tests run its matching logic without
torch); ``use`` imports torch to read the versions it must match.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import re
import shutil
import sys
from typing import List, Mapping, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MANIFEST = "manifest.json"
DEFAULT_DIR = ".prebuilt"
FORMAT = 1
# The manifest's keys that use reads (prebuild_device.py writes these and more).
REQUIRED = ("format", "module", "sha256", "torch", "cuda", "python_tag", "archs", "targets", "source_digest")
# The parts of _build.plan that change the compiled module (as in _build.build_key).
_PLAN_KEYS = ("sources", "isa_sources", "define_macros", "cxx_flags", "nvcc_flags")
_TARGET_RE = re.compile(r"^(sm|compute)_(\d+)(\d)([af]?)$")


def python_tag(version_info: Sequence[int] = tuple(sys.version_info[:2]), implementation: str = sys.implementation.name) -> str:
    """'cp312' for CPython 3.12 (the wheel tag of an extension module built for it)."""
    prefix = {"cpython": "cp", "pypy": "pp"}.get(implementation, implementation)
    return f"{prefix}{version_info[0]}{version_info[1]}"


def torch_release(version: str) -> str:
    """The release of a torch version string: '2.11.0' of '2.11.0+cu130'."""
    return version.split("+")[0].strip()


def _load_build(root: str):
    """mhakern/_build.py of ``root``, loaded by path (it imports no torch at module level), as a
    fresh module so that its cached reads (the minimum arch) are those of that tree."""
    path = os.path.join(root, "mhakern", "_build.py")
    spec = importlib.util.spec_from_file_location(f"_mhakern_build_{abs(hash(os.path.abspath(root)))}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def source_files(root: str) -> List[str]:
    """The files under ``root/csrc`` the module is built from, relative to ``root``, sorted: all
    of them (the set the first-use build's cache key hashes)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, "csrc")):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in filenames:
            out.append(os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/"))
    return sorted(out)


def build_recipe(root: str, archs: str, cuda: str, machine: str = "x86_64", platform: str = "linux") -> dict:
    """What _build.plan compiles for TORCH_CUDA_ARCH_LIST=archs with a CUDA ``cuda`` torch and a
    matching nvcc, independent of this machine (no torch imported, no compiler run): the plan's
    sources and flags for a canonical description of the build machine."""
    build = _load_build(root)
    info = {
        "version": "0", "cuda": cuda, "hip": None, "nvcc": "nvcc", "nvcc_version": cuda, "openmp": True,
        "cxx_runtime": None, "cxx_runtime_static_only": False, "machine": machine, "platform": platform,
    }
    p = build.plan({"TORCH_CUDA_ARCH_LIST": archs}, info, root)
    if not p.get("cuda"):
        raise ValueError(f"archs={archs!r}, cuda={cuda!r}: the build plan compiles no CUDA code ({p.get('cuda_why')})")
    return {k: p[k] for k in _PLAN_KEYS}


def source_digest(root: str, archs: str, cuda: str) -> str:
    """SHA-256 (hex) of the module's sources (:func:`source_files`, names and contents) and its
    build recipe (:func:`build_recipe` for ``archs`` and ``cuda``)."""
    h = hashlib.sha256()
    for rel in source_files(root):
        h.update(rel.encode() + b"\0")
        with open(os.path.join(root, rel), "rb") as fh:
            h.update(hashlib.sha256(fh.read()).digest())
    h.update(json.dumps(build_recipe(root, archs, cuda), sort_keys=True).encode())
    return h.hexdigest()


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def covers(targets: Sequence[str], capability: Tuple[int, int]) -> bool:
    """Whether a fat binary with these targets ('sm_80', 'sm_90a', 'compute_90') runs on a device
    of compute capability ``capability``: SASS sm_XY on major X, minor ≥ Y; sm_XYa/f on X.Y only;
    PTX compute_XY (JIT-compiled by the driver) on X.Y and newer, compute_XYa on X.Y only."""
    cap = tuple(capability)
    for t in targets:
        m = _TARGET_RE.match(t)
        if not m:
            continue
        kind, major, minor, suffix = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
        if suffix:
            if cap == (major, minor):
                return True
        elif kind == "sm" and cap[0] == major and cap[1] >= minor:
            return True
        elif kind == "compute" and cap >= (major, minor):
            return True
    return False


def match(
    manifest: Mapping,
    *,
    torch_version: str,
    cuda_version: Optional[str],
    python_tag: str,
    source_digest: str,
    device_capability: Optional[Tuple[int, int]] = None,
) -> Optional[str]:
    """None when the prebuilt module described by ``manifest`` fits, else the reason it does not
    (one line naming the first fact that differs, with both values).

    torch_version: this torch's ``torch.__version__`` (only its release is compared);
    cuda_version: ``torch.version.cuda`` (None for a CPU build of torch); python_tag: 'cp312';
    source_digest: :func:`source_digest` of this tree for the manifest's archs and CUDA;
    device_capability: the GPU's (major, minor), or None to skip the arch check (no GPU).
    """
    missing = [k for k in REQUIRED if k not in manifest]
    if missing:
        return f"the manifest lacks {', '.join(missing)}"
    if manifest["format"] != FORMAT:
        return f"manifest format {manifest['format']!r}, this tool reads format {FORMAT}"
    if torch_release(torch_version) != manifest["torch"]:
        return f"built for torch {manifest['torch']}, this is torch {torch_release(torch_version)}"
    if cuda_version != manifest["cuda"]:
        here = "a CPU build of torch" if cuda_version is None else f"torch.version.cuda {cuda_version}"
        return f"built for torch.version.cuda {manifest['cuda']}, this is {here}"
    if python_tag != manifest["python_tag"]:
        return f"built for {manifest['python_tag']}, this is {python_tag}"
    if source_digest != manifest["source_digest"]:
        return (
            f"the sources changed since it was built (source digest {source_digest[:12]}, the module's "
            f"{str(manifest['source_digest'])[:12]}): rerun tools/prebuild_device.py"
        )
    if device_capability is not None and not covers(manifest["targets"], device_capability):
        cap = "%d.%d" % tuple(device_capability)
        return f"it carries {', '.join(manifest['targets'])}, no code for this GPU's compute capability {cap}"
    return None


def read_manifest(directory: str) -> Tuple[Optional[dict], Optional[str]]:
    """(manifest, None), or (None, reason) when the directory or its manifest is missing or unreadable."""
    if not os.path.isdir(directory):
        return None, f"no directory {directory}"
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        return None, f"no {MANIFEST} in {directory}"
    try:
        with open(path) as fh:
            manifest = json.load(fh)
    except (OSError, ValueError) as e:
        return None, f"{path} is not readable JSON ({type(e).__name__}: {e})"
    if not isinstance(manifest, dict):
        return None, f"{path} holds no JSON object"
    return manifest, None


def _torch_facts() -> Tuple[str, Optional[str], Optional[Tuple[int, int]]]:
    """(torch.__version__, torch.version.cuda, the first visible GPU's capability or None)."""
    import torch

    cap = None
    try:
        if torch.version.cuda is not None and torch.cuda.is_available():
            cap = tuple(torch.cuda.get_device_capability(0))
    except Exception:  # noqa: BLE001 -- a broken driver: no capability to check against
        cap = None
    return torch.__version__, torch.version.cuda, cap


def use(directory: str, root: str = ROOT, facts=None) -> Tuple[int, str]:
    """Install the prebuilt module of ``directory`` into ``root``/mhakern when it fits: (0, the
    'prebuilt: used ...' line) or (1, 'prebuilt: not used: <reason>'). ``facts`` replaces
    :func:`_torch_facts` (tests)."""

    def no(reason: str) -> Tuple[int, str]:
        return 1, f"prebuilt: not used: {reason}"

    manifest, why = read_manifest(directory)
    if manifest is None:
        return no(why)
    missing = [k for k in REQUIRED if k not in manifest]
    if missing:
        return no(f"the manifest lacks {', '.join(missing)}")
    module = str(manifest["module"])
    if os.path.basename(module) != module or not module.startswith("_C."):
        return no(f"the manifest's module {module!r} is not a file name _C.<suffix>")
    try:
        torch_version, cuda_version, cap = facts() if facts is not None else _torch_facts()
    except ImportError as e:
        return no(f"torch does not import ({e})")
    try:
        digest = source_digest(root, str(manifest["archs"]), str(manifest["cuda"]))
    except (OSError, ValueError) as e:
        return no(f"the sources' digest cannot be computed ({type(e).__name__}: {e})")
    why = match(
        manifest, torch_version=torch_version, cuda_version=cuda_version, python_tag=python_tag(),
        source_digest=digest, device_capability=cap,
    )
    if why is not None:
        return no(why)
    suffix = module[len("_C"):]
    if suffix not in importlib.machinery.EXTENSION_SUFFIXES:
        return no(f"{module}'s suffix {suffix} is not one this interpreter loads ({', '.join(importlib.machinery.EXTENSION_SUFFIXES)})")
    src = os.path.join(directory, module)
    if not os.path.isfile(src):
        return no(f"no {module} in {directory}")
    if file_sha256(src) != manifest["sha256"]:
        return no(f"{src} is not the file the manifest describes (its SHA-256 differs: a partial copy?)")
    dst = os.path.join(root, "mhakern", module)
    tmp = dst + ".prebuilt-tmp"
    shutil.copyfile(src, tmp)
    os.chmod(tmp, 0o755)
    os.replace(tmp, dst)  # a process importing meanwhile sees the old file or the new one, never half
    rel = os.path.relpath(dst, os.getcwd())
    shown = dst if rel.startswith("..") else rel
    # What tools/prebuild_device.py found of the module's SASS against CI's records, if it did.
    sass = "; ".join(f"{fam} SASS {text}" for fam, text in (manifest.get("recorded_sass") or {}).items())
    return 0, (
        f"prebuilt: used {shown} (torch {manifest['torch']}, CUDA {manifest['cuda']}, {manifest['python_tag']}, "
        f"archs {','.join(manifest['targets'])}){'; ' + sass if sass else ''}"
    )


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/prebuilt.py", description="Use a prebuilt mhakern._C when it fits.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("use", help="install DIR's module into mhakern/ if torch, CUDA, Python and sources match")
    u.add_argument("dir", nargs="?", default=None, help=f"the prebuilt directory (default: {DEFAULT_DIR} at the repository root)")
    args = ap.parse_args(argv)
    directory = args.dir if args.dir is not None else os.path.join(ROOT, DEFAULT_DIR)
    rc, line = use(directory)
    print(line, flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
