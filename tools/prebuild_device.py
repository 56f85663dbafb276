"""Build mhakern._C here, on a machine without a GPU, for a GPU machine's stack, and leave it in
``.prebuilt/`` (the module, stripped, and ``manifest.json``) for ``tools/prebuilt.py use``.

    python tools/prebuild_device.py [--torch 2.11.*] [--python 3.12] [--archs 9.0]

The device's torch (a CUDA build, as the package index serves it for Linux x86-64) is installed
into a scratch venv of the device's Python outside the checkout (``--cache``, default
``$XDG_CACHE_HOME/mhakern-prebuild`` or ``~/.cache/mhakern-prebuild``; reused when present: the
CUDA wheels and their libraries are several GB). The module is built there with the project's
own build (mhakern/_build.py's first-use build worker: the same plan, sources and flags as
``pip install -e . --no-build-isolation``) by this machine's nvcc, which must have torch's CUDA
major version, for ``--archs`` (TORCH_CUDA_ARCH_LIST; default 9.0, the device's: it is built as
sm_90a, where both the sm_90a family and the mma.sync family have their kernels; the project's
default list, '8.0;9.0+PTX', makes a 91 MiB module, over what can travel). The object files stay
in the cache, so a rebuild after a small change compiles only what changed.

Then the module is stripped (host debug info; the GPU code is untouched), its GPU targets read
with cuobjdump, and it is checked in a scratch copy of the tree: ``tools/prebuilt.py use``
must take it, and it must import under the venv's torch (a CUDA build of torch imports without
a GPU) with the CUDA families compiled in ``capabilities()``. It must be at most 64 MiB (what
travels to a GPU machine with the working tree). Only then does it replace ``--out``.

MAX_JOBS (default 2) caps nvcc's parallel jobs. Exit 0 with a summary, or 1 with the reason.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import prebuilt  # noqa: E402  (tools/prebuilt.py: the manifest's reader)

ROOT = prebuilt.ROOT
LIMIT_BYTES = 64 * 1024 * 1024
DEFAULT_TORCH = "2.11.*"
DEFAULT_PYTHON = "3.12"
# The lent GPU's arch (an H200: 9.0, built as sm_90a). Its SASS alone is a third of the project's
# default list's ('8.0;9.0+PTX': 91 MiB, over LIMIT_BYTES); sm_80 SASS and compute_90 PTX serve
# other GPUs only.
DEFAULT_ARCHS = "9.0"
# Build tools the venv needs besides torch (setuptools below 82, as torch 2.11 requires).
BUILD_PACKAGES = ["ninja", "setuptools>=64,<82", "wheel", "numpy"]


class Failed(Exception):
    pass


def say(msg: str) -> None:
    print(f"prebuild: {msg}", flush=True)


def run(cmd: List[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def default_cache() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mhakern-prebuild")


def _python_version(exe: str) -> Optional[str]:
    try:
        out = run([exe, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def find_python(want: str) -> str:
    """An interpreter of Python ``want`` ('3.12', or a path): python3.12 on PATH if it runs, else
    pyenv's newest 3.12.x."""
    if os.sep in want:
        if not _python_version(want):
            raise Failed(f"--python {want} does not run")
        return want
    cands = []
    exe = shutil.which(f"python{want}")
    if exe:
        cands.append(exe)
    try:
        pyenv_root = run(["pyenv", "root"], timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pyenv_root = ""
    versions = os.path.join(pyenv_root, "versions") if pyenv_root else ""
    if versions and os.path.isdir(versions):
        found = [v for v in os.listdir(versions) if re.fullmatch(re.escape(want) + r"\.\d+", v)]
        for v in sorted(found, key=lambda s: int(s.rsplit(".", 1)[1]), reverse=True):
            cands.append(os.path.join(versions, v, "bin", f"python{want}"))
    for c in cands:
        if _python_version(c) == want:
            return c
    raise Failed(f"no Python {want} found (tried {', '.join(cands) or f'python{want} on PATH and pyenv'}); pass --python PATH")


def venv_facts(py: str) -> Optional[dict]:
    """Facts about the torch in the interpreter ``py``, or None where torch does not import."""
    code = r"""
import importlib.metadata as md, json, platform, sys, sysconfig, torch
req = [r for r in (md.requires("torch") or []) if r.split()[0].startswith(("nvidia", "cuda"))]
print(json.dumps({"version": torch.__version__, "cuda": torch.version.cuda,
    "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI), "python_tag": "cp%d%d" % sys.version_info[:2],
    "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX"), "machine": platform.machine(), "requires": req}))
"""
    out = run([py, "-c", code], timeout=600)
    if out.returncode != 0:
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def _release_matches(version: str, spec: str) -> bool:
    """Whether a torch version ('2.11.0+cu130') satisfies a pip spec of the form '2.11.*' or '2.11.0'."""
    rel = prebuilt.torch_release(version)
    return rel == spec or (spec.endswith(".*") and rel.startswith(spec[:-1]))


def ensure_venv(cache: str, python: str, torch_spec: str) -> tuple:
    """(venv python, facts): the scratch venv with torch==torch_spec, created or updated as needed."""
    pyver = _python_version(python)
    name = torch_spec[:-2] if torch_spec.endswith(".*") else torch_spec.replace("*", "x")
    venv = os.path.join(cache, f"venv-cp{pyver.replace('.', '')}-torch{name}")
    py = os.path.join(venv, "bin", "python")
    if not os.path.exists(py):
        say(f"creating the venv {venv} (Python {pyver})")
        out = run([python, "-m", "venv", venv])
        if out.returncode != 0:
            raise Failed(f"python -m venv {venv} failed: {out.stderr.strip()[-500:]}")
    facts = venv_facts(py)
    if facts is None or not _release_matches(facts["version"], torch_spec) or facts["cuda"] is None:
        say(f"installing torch=={torch_spec} and the build tools into {venv} (the CUDA wheels are several GB)")
        cmd = [py, "-m", "pip", "install", "--progress-bar", "off", f"torch=={torch_spec}", *BUILD_PACKAGES]
        if subprocess.run(cmd).returncode != 0:
            raise Failed(f"{' '.join(cmd)} failed (see above)")
        facts = venv_facts(py)
    if facts is None:
        raise Failed(f"torch does not import in {venv} after the install")
    if facts["cuda"] is None:
        raise Failed(f"the index served a CPU build of torch {facts['version']}: no CUDA build to build against")
    return py, facts


def find_cuda_home(explicit: Optional[str]) -> str:
    """The CUDA toolkit root: --cuda-home, else $CUDA_HOME, else where nvcc on PATH says its
    toolkit is (nvcc may be a wrapper script outside the toolkit, so ask it: -dryrun's TOP)."""
    for cand in (explicit, os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if cand:
            if not os.path.exists(os.path.join(cand, "bin", "nvcc")):
                raise Failed(f"{cand} has no bin/nvcc")
            return cand
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise Failed("nvcc is not on PATH; pass --cuda-home")
    with tempfile.TemporaryDirectory() as tmp:
        out = run([nvcc, "-dryrun", "-x", "cu", "-c", os.devnull, "-o", os.path.join(tmp, "x.o")], timeout=120)
    m = re.search(r"^#\$ TOP=(.+)$", out.stdout + out.stderr, re.MULTILINE)
    home = os.path.realpath(m.group(1).strip()) if m else os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    if not os.path.exists(os.path.join(home, "bin", "nvcc")):
        raise Failed(f"cannot tell the CUDA toolkit of {nvcc} (got {home}); pass --cuda-home")
    return home


def planned_targets(nvcc_flags: List[str]) -> List[str]:
    """The GPU code the build's -gencode flags ask for: ['sm_90a', 'compute_90'] (code= values)."""
    return [m.group(1) for f in nvcc_flags for m in [re.match(r"^-gencode=arch=compute_\w+,code=(\w+)$", f)] if m]


def find_cuobjdump(cuda_home: str, venv_py: str) -> Optional[str]:
    """The toolkit's cuobjdump, else the copy in the venv's Triton (a toolkit may ship without it)."""
    cands = [os.path.join(cuda_home, "bin", "cuobjdump")]
    cands += glob.glob(os.path.join(os.path.dirname(os.path.dirname(venv_py)), "lib", "python*", "site-packages",
                                    "triton", "backends", "nvidia", "bin", "cuobjdump"))
    return next((c for c in cands if os.access(c, os.X_OK)), None) or shutil.which("cuobjdump")


def check_targets(cuobjdump: Optional[str], module: str, planned: List[str]) -> str:
    """Check the module's fat binary against the planned targets; a line saying what was seen.
    cuobjdump names sm_90a's code sm_90 (before CUDA 13) or sm_90a, so arch numbers are compared."""
    if cuobjdump is None:
        return "no cuobjdump found: the fat binary's targets are the build's -gencode flags, unchecked"
    out = run([cuobjdump, "--list-elf", "--list-ptx", module], timeout=600)
    if out.returncode != 0:
        raise Failed(f"cuobjdump --list-elf --list-ptx {module} failed: {out.stderr.strip()[-300:]}")
    seen = {}
    for kind, num in re.findall(r"^(ELF|PTX) file\s+\d+: .*\.sm_(\d+)[af]?\.(?:cubin|ptx)$", out.stdout, re.MULTILINE):
        key = ("sm_" if kind == "ELF" else "compute_") + num
        seen[key] = seen.get(key, 0) + 1
    want = {re.sub(r"[af]$", "", t) for t in planned}
    if set(seen) != want:
        raise Failed(f"the fat binary carries {sorted(seen)}, the build asked for {planned}")
    return "cuobjdump: " + ", ".join(f"{k} in {v} objects" for k, v in sorted(seen.items()))


def recorded_sass(cuobjdump: Optional[str], module: str, nvcc: str) -> Dict[str, str]:
    """The module's kernels against the recorded SASS that CI's gates hold (tools/
    check_cuda_build.py): {family: 'k/n kernels identical to <record>', plus what differs or is
    missing}. The sm_90a family is recorded at sm_90a, the plain mma.sync kernels at sm_90 (the
    same code: this build compiles them for sm_90a)."""
    if cuobjdump is None:
        return {"all": "no cuobjdump found: not compared"}
    import check_cuda_build as ccb  # noqa: E402  (tools/: the digests as CI's gates compute them)

    out = run([cuobjdump, "-sass", module], timeout=900)
    if out.returncode != 0:
        return {"all": f"cuobjdump -sass failed: {out.stderr.strip()[-200:]}"}
    # The record's key: nvcc's last --version line, as check_cuda_build.py writes it.
    version = (run([nvcc, "--version"]).stdout.strip().splitlines() or [""])[-1]
    books = {"sm90": (ccb.ROOT / "csrc" / ccb.sass_reader.RECORDED_SASS["sm90"], "@sm_90a"),
             "mma.sync plain": (ccb.ROOT / "csrc" / ccb.sass_reader.RECORDED_SASS["mma"], "@sm_90")}
    return compare_sass(out.stdout, books, version)


def compare_sass(listing: str, books: Dict[str, tuple], version: str) -> Dict[str, str]:
    """{family: verdict} of a module's ``cuobjdump -sass`` listing against each family's record
    (books: {family: (record path, the key suffix kept)}) for nvcc ``version``. A helper kernel
    that two units instantiate is in the module twice, one cubin each: the listing is split per
    cubin, and any copy may match."""
    import check_cuda_build as ccb  # noqa: E402

    copies: Dict[str, List[list]] = {}
    for chunk in re.split(r"^\s*Fatbin elf code:.*$", listing, flags=re.MULTILINE):
        for key, val in ccb.plain_kernel_digests(ccb.sass_reader.parse_functions(chunk)).items():
            copies.setdefault(key.split("@")[0], []).append(val)
    res = {}
    for fam, (path, keep) in books.items():
        book = json.loads(path.read_text()) if path.exists() else {}
        base = {k: v for k, v in book.get(version, {}).items() if k.endswith(keep)}
        rel = os.path.relpath(path, ROOT)
        if not base:
            res[fam] = f"no record for {version} in {rel}: not compared"
            continue
        same = sum(1 for k, v in base.items() if v in copies.get(k.split("@")[0], []))
        missing = sum(1 for k in base if k.split("@")[0] not in copies)
        text = f"{same}/{len(base)} kernels identical to {rel}"
        if same < len(base):
            text += f" ({len(base) - same - missing} differ, {missing} missing: not the code CI's SASS gates hold)"
        res[fam] = text
    return res


def git_commit() -> Optional[str]:
    head = run(["git", "-C", ROOT, "rev-parse", "HEAD"])
    if head.returncode != 0:
        return None
    dirty = run(["git", "-C", ROOT, "status", "--porcelain", "--", "csrc", "mhakern/_build.py"]).stdout.strip()
    return head.stdout.strip() + ("+dirty" if dirty else "")


_CHECK = r"""
import json, sys
import torch, mhakern, mhakern._C
from mhakern._extension import capabilities
caps = capabilities()
assert caps is not None, "capabilities() is None: mhakern._C did not load"
cuda = caps["cuda"]
fams = []
if cuda.get("compiled"):
    fams.append("mma.sync")
    if cuda.get("sm90", {}).get("compiled"):
        fams.append("sm90a")
print("import: mhakern._C from %s under torch %s (CUDA %s, GPU visible: %s)" % (
    mhakern._C.__file__, torch.__version__, torch.version.cuda, torch.cuda.is_available()))
print("capabilities: cpu compiled=%s; cuda (mma.sync) compiled=%s, fwd head dims %s, bwd head dims %s, bwd kernels %s; "
      "sm90 (sm_90a) compiled=%s, fwd head dims %s, bwd head dims %s, bwd kernels %s" % (
    caps["cpu"]["compiled"], cuda.get("compiled"), cuda.get("head_dims"), cuda.get("bwd", {}).get("head_dims"),
    sorted(cuda.get("bwd", {}).get("kernels", {})), cuda.get("sm90", {}).get("compiled"),
    cuda.get("sm90", {}).get("head_dims"), cuda.get("sm90", {}).get("bwd_head_dims"),
    sorted(cuda.get("sm90", {}).get("bwd_kernels", {}))))
print("FAMILIES " + json.dumps(fams))
"""


def check_in_copy(py: str, out_dir: str, want_sm90a: bool) -> tuple:
    """Take the prebuilt with ``tools/prebuilt.py use`` in a scratch copy of the tree and import it
    there under the venv's torch: (the use line, the import check's lines, the families)."""
    with tempfile.TemporaryDirectory(prefix="mhakern-prebuilt-check-") as tmp:
        ignore = shutil.ignore_patterns("*.so", "__pycache__", "*.pyc")
        shutil.copytree(os.path.join(ROOT, "csrc"), os.path.join(tmp, "csrc"), ignore=ignore)
        shutil.copytree(os.path.join(ROOT, "mhakern"), os.path.join(tmp, "mhakern"), ignore=ignore)
        os.makedirs(os.path.join(tmp, "tools"))
        shutil.copy(os.path.join(ROOT, "tools", "prebuilt.py"), os.path.join(tmp, "tools"))
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
        env.update(PYTHONPATH=tmp, MHAKERN_NO_JIT="1")  # a module that is not the prebuilt one must not be built
        use = run([py, os.path.join(tmp, "tools", "prebuilt.py"), "use", out_dir], cwd=tmp, env=env, timeout=600)
        line = (use.stdout.strip().splitlines() or [use.stderr.strip()])[-1]
        if use.returncode != 0:
            raise Failed(f"tools/prebuilt.py use rejected the new build here: {line} {use.stderr.strip()[-500:]}")
        chk = run([py, "-c", _CHECK], cwd=tmp, env=env, timeout=600)
        if chk.returncode != 0:
            raise Failed(f"the prebuilt module does not import under the venv's torch: {chk.stderr.strip()[-1500:]}")
    lines = [ln for ln in chk.stdout.splitlines() if not ln.startswith("FAMILIES ")]
    fams = json.loads([ln for ln in chk.stdout.splitlines() if ln.startswith("FAMILIES ")][-1][len("FAMILIES "):])
    need = ["mma.sync"] + (["sm90a"] if want_sm90a else [])
    if any(f not in fams for f in need):
        raise Failed(f"capabilities() lists the CUDA families {fams}, not {need}: " + " | ".join(lines))
    return line, lines, fams


def real_recipe(py: str, archs: str, env: Dict[str, str]) -> dict:
    """The plan the build actually used (the venv's torch, this machine's nvcc), the same keys as
    prebuilt.build_recipe's."""
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1] + '/mhakern'); import _build as b; "
        "p = b.plan({'TORCH_CUDA_ARCH_LIST': sys.argv[2]}, b.torch_info(), sys.argv[1]); "
        f"print(json.dumps({{k: p[k] for k in {prebuilt._PLAN_KEYS!r}}}))"
    )
    out = run([py, "-c", code, ROOT, archs], env=env, timeout=600)
    if out.returncode != 0:
        raise Failed(f"reading the build plan failed: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/prebuild_device.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--torch", default=DEFAULT_TORCH, help=f"the device's torch, a pip version spec (default {DEFAULT_TORCH})")
    ap.add_argument("--python", default=DEFAULT_PYTHON, help=f"the device's Python version, or an interpreter's path (default {DEFAULT_PYTHON})")
    ap.add_argument("--archs", default=DEFAULT_ARCHS, help=f"TORCH_CUDA_ARCH_LIST to build (default {DEFAULT_ARCHS})")
    ap.add_argument("--out", default=os.path.join(ROOT, prebuilt.DEFAULT_DIR), help="where the module and manifest go (default: .prebuilt)")
    ap.add_argument("--cache", default=default_cache(), help="the venv and the build's objects (default: %(default)s)")
    ap.add_argument("--cuda-home", default=None, help="the CUDA toolkit (default: $CUDA_HOME, else nvcc's)")
    ap.add_argument("--strip", choices=("debug", "unneeded"), default="debug",
                    help="strip --strip-debug (default) or --strip-unneeded (also the symbols nothing links against)")
    args = ap.parse_args(argv)
    try:
        return _main(args)
    except Failed as e:
        say(f"FAILED: {e}")
        return 1


def _main(args) -> int:
    t_start = time.monotonic()
    build_mod = prebuilt._load_build(ROOT)
    archs = args.archs
    kept, dropped = build_mod.filter_arch_list(archs)
    if dropped or not kept:
        raise Failed(f"--archs {archs!r}: {', '.join(dropped) or 'nothing'} is not an arch the CUDA kernels build for")
    python = find_python(args.python)
    os.makedirs(args.cache, exist_ok=True)
    py, facts = ensure_venv(args.cache, python, args.torch)
    release = prebuilt.torch_release(facts["version"])
    say(f"torch {facts['version']} (torch.version.cuda {facts['cuda']}, C++11 ABI {facts['cxx11_abi']}, "
        f"{facts['python_tag']}); its CUDA requirements: {'; '.join(r.split(';')[0].strip() for r in facts['requires']) or 'none'}")
    cuda_home = find_cuda_home(args.cuda_home)
    nvcc = os.path.join(cuda_home, "bin", "nvcc")
    nv = build_mod.nvcc_version(nvcc)
    if nv is None or nv.split(".")[0] != facts["cuda"].split(".")[0]:
        raise Failed(f"{nvcc} is CUDA {nv}, torch was built with CUDA {facts['cuda']}: the major versions must agree")
    if nv != facts["cuda"]:
        say(f"note: nvcc is CUDA {nv}, torch's CUDA is {facts['cuda']} (same major version: compatible)")
    digest = prebuilt.source_digest(ROOT, archs, facts["cuda"])

    env = dict(os.environ)
    env.update(
        TORCH_CUDA_ARCH_LIST=archs, CUDA_HOME=cuda_home, MHAKERN_REQUIRE_CUDA="1", MAX_JOBS=env.get("MAX_JOBS", "2"),
        PATH=os.pathsep.join([os.path.dirname(py), os.path.join(cuda_home, "bin"), env.get("PATH", "")]),
    )
    env.pop("PYTHONPATH", None)
    env.pop("MHAKERN_NO_CUDA", None)
    recipe = real_recipe(py, archs, env)
    if json.dumps(recipe, sort_keys=True) != json.dumps(prebuilt.build_recipe(ROOT, archs, facts["cuda"]), sort_keys=True):
        raise Failed("the plan this build uses differs from the recipe the manifest's digest describes "
                     "(tools/prebuilt.py build_recipe's canonical machine no longer matches mhakern/_build.py's plan)")
    targets_named = "_".join(
        ("sm90a" if e.split("+")[0] == "9.0" else "sm" + e.split("+")[0].replace(".", ""))
        + ("_ptx" + e.split("+")[0].replace(".", "") if e.endswith("+PTX") else "") for e in kept)
    tag = f"{facts['python_tag']}-torch{release}-cu{facts['cuda'].replace('.', '')}-{targets_named}"
    build_dir = os.path.join(args.cache, f"build-{tag}")
    staging = os.path.join(build_dir, "staging")
    shutil.rmtree(staging, ignore_errors=True)
    log = build_dir + ".log"
    os.makedirs(build_dir, exist_ok=True)
    say(f"building with {nvcc} (CUDA {nv}) for {archs}, MAX_JOBS={env['MAX_JOBS']}, objects in {build_dir}, log {log}")
    t0 = time.monotonic()
    with open(log, "w") as fh:
        rc = subprocess.run([py, os.path.join(ROOT, "mhakern", "_build.py"), "--worker", ROOT, build_dir],
                            cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT).returncode
    build_s = time.monotonic() - t0
    with open(log, errors="replace") as fh:
        text = fh.read()
    module_name = "_C" + facts["ext_suffix"]
    module = os.path.join(staging, "mhakern", module_name)
    if rc != 0 or not os.path.isfile(module):
        raise Failed(f"the build failed after {build_s:.0f} s (exit {rc}): {build_mod.first_error(text)} (log: {log})")
    with open(os.path.join(staging, "build_info.json")) as fh:
        info = json.load(fh)
    if not info.get("cuda"):
        raise Failed(f"the module was built without its CUDA part: {info.get('cuda_error')} (log: {log})")
    say(f"built in {build_s:.0f} s")
    if prebuilt.source_digest(ROOT, archs, facts["cuda"]) != digest:
        raise Failed("the sources changed while the module was being built; run again")

    tmp_out = args.out.rstrip(os.sep) + ".tmp"
    shutil.rmtree(tmp_out, ignore_errors=True)
    os.makedirs(tmp_out)
    dst = os.path.join(tmp_out, module_name)
    size_before = os.path.getsize(module)
    out = run(["strip", f"--strip-{args.strip}", "-o", dst, module])
    if out.returncode != 0:
        raise Failed(f"strip --strip-{args.strip} failed: {out.stderr.strip()}")
    size_after = os.path.getsize(dst)
    say(f"{module_name}: {size_before / 2**20:.1f} MiB, {size_after / 2**20:.1f} MiB after strip --strip-{args.strip}")
    if size_after > LIMIT_BYTES:
        raise Failed(f"{size_after / 2**20:.1f} MiB after stripping is over the {LIMIT_BYTES // 2**20} MiB that travels to "
                     f"the device: drop archs the device does not need (--archs 9.0 for an H100/H200)")
    targets = planned_targets(recipe["nvcc_flags"])
    cuobjdump = find_cuobjdump(cuda_home, py)
    say(check_targets(cuobjdump, dst, targets))
    sass = recorded_sass(cuobjdump, dst, nvcc)
    for fam, text in sass.items():
        say(f"recorded SASS, {fam}: {text}")
    manifest = {
        "format": prebuilt.FORMAT,
        "module": module_name,
        "sha256": prebuilt.file_sha256(dst),
        "size_bytes": size_after,
        "size_unstripped_bytes": size_before,
        "strip": f"--strip-{args.strip}",
        "torch": release,
        "torch_version": facts["version"],
        "cuda": facts["cuda"],
        "torch_requires": facts["requires"],
        "cxx11_abi": facts["cxx11_abi"],
        "python_tag": facts["python_tag"],
        "ext_suffix": facts["ext_suffix"],
        "machine": facts["machine"],
        "archs": archs,
        "targets": targets,
        "families": [],
        "recorded_sass": sass,
        "nvcc": nv,
        "source_digest": digest,
        "source_files": len(prebuilt.source_files(ROOT)),
        "commit": git_commit(),
        "build_seconds": round(build_s),
        "built_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }

    def write_manifest():
        with open(os.path.join(tmp_out, prebuilt.MANIFEST), "w") as fh:
            json.dump(manifest, fh, indent=1)
            fh.write("\n")

    write_manifest()
    use_line, check_lines, fams = check_in_copy(py, tmp_out, build_mod.builds_sm90a(kept))
    manifest["families"] = fams
    write_manifest()
    shutil.rmtree(args.out, ignore_errors=True)
    os.replace(tmp_out, args.out)
    say(f"check in a scratch copy of the tree: {use_line}")
    for ln in check_lines:
        say(ln)
    say(f"left {os.path.join(args.out, module_name)} ({size_after / 2**20:.1f} MiB, targets {', '.join(targets)}, "
        f"families {', '.join(fams)}) and {prebuilt.MANIFEST} in {args.out} after {time.monotonic() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
