"""tools/prebuilt.py: when a module prebuilt for a GPU machine is used (the matching logic only:
no torch CUDA, no build; the prebuilt module itself is a tool's product, never needed here)."""
import hashlib
import importlib.machinery
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import prebuilt  # noqa: E402

ARCHS = "8.0;9.0+PTX"
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]  # one this interpreter loads


@pytest.fixture
def tree(tmp_path):
    """A scratch copy of what the digest reads: csrc/, mhakern/_build.py and the capability table
    it reads its archs from (mhakern/_caps.py)."""
    root = tmp_path / "tree"
    shutil.copytree(os.path.join(ROOT, "csrc"), root / "csrc", ignore=shutil.ignore_patterns("*.o", "*.so", "__pycache__"))
    (root / "mhakern").mkdir()
    shutil.copy(os.path.join(ROOT, "mhakern", "_build.py"), root / "mhakern" / "_build.py")
    shutil.copy(os.path.join(ROOT, "mhakern", "_caps.py"), root / "mhakern" / "_caps.py")
    return root


def _manifest(**over):
    m = {
        "format": prebuilt.FORMAT, "module": "_C" + SUFFIX, "sha256": "0" * 64, "torch": "2.11.0", "cuda": "13.0",
        "python_tag": "cp312", "archs": ARCHS, "targets": ["sm_80", "sm_90a", "compute_90"], "source_digest": "ab" * 32,
    }
    m.update(over)
    return m


def _match(m, **over):
    kw = dict(torch_version="2.11.0+cu130", cuda_version="13.0", python_tag="cp312", source_digest="ab" * 32,
              device_capability=(9, 0))
    kw.update(over)
    return prebuilt.match(m, **kw)


def test_tags():
    assert prebuilt.python_tag((3, 12), "cpython") == "cp312"
    assert prebuilt.python_tag() == "cp%d%d" % sys.version_info[:2]
    assert prebuilt.torch_release("2.11.0+cu130") == "2.11.0"
    assert prebuilt.torch_release("2.13.0") == "2.13.0"


def test_match_and_each_mismatch():
    m = _manifest()
    assert _match(m) is None
    assert _match(m, device_capability=None) is None  # no GPU here: nothing to check the archs against
    assert _match(m, device_capability=(8, 6)) is None  # sm_80 SASS runs on 8.x
    why = _match(m, torch_version="2.11.1+cu130")
    assert why == "built for torch 2.11.0, this is torch 2.11.1"
    why = _match(m, cuda_version="12.8")
    assert why == "built for torch.version.cuda 13.0, this is torch.version.cuda 12.8"
    assert _match(m, cuda_version=None) == "built for torch.version.cuda 13.0, this is a CPU build of torch"
    assert _match(m, python_tag="cp311") == "built for cp312, this is cp311"
    why = _match(m, source_digest="cd" * 32)
    assert why.startswith("the sources changed since it was built") and "cdcdcdcdcdcd" in why and "abababababab" in why
    why = _match(_manifest(targets=["sm_90a"]), device_capability=(8, 0))
    assert why == "it carries sm_90a, no code for this GPU's compute capability 8.0"
    assert _match(_manifest(format=2)) == f"manifest format 2, this tool reads format {prebuilt.FORMAT}"
    m.pop("source_digest")
    m.pop("cuda")
    assert _match(m) == "the manifest lacks cuda, source_digest"


@pytest.mark.parametrize("targets,cap,ok", [
    (["sm_80"], (8, 0), True), (["sm_80"], (8, 9), True), (["sm_80"], (9, 0), False), (["sm_86"], (8, 0), False),
    (["sm_90a"], (9, 0), True), (["sm_90a"], (10, 0), False), (["compute_90"], (10, 0), True),
    (["compute_90"], (8, 9), False), (["compute_90a"], (10, 0), False), (["sm_100f"], (10, 0), True), ([], (9, 0), False),
])
def test_covers(targets, cap, ok):
    assert prebuilt.covers(targets, cap) is ok


def test_read_manifest(tmp_path):
    assert prebuilt.read_manifest(str(tmp_path / "none")) == (None, f"no directory {tmp_path / 'none'}")
    assert prebuilt.read_manifest(str(tmp_path)) == (None, f"no manifest.json in {tmp_path}")
    (tmp_path / "manifest.json").write_text("{not json")
    m, why = prebuilt.read_manifest(str(tmp_path))
    assert m is None and why.startswith(f"{tmp_path / 'manifest.json'} is not readable JSON")
    (tmp_path / "manifest.json").write_text(json.dumps(_manifest()))
    assert prebuilt.read_manifest(str(tmp_path)) == (_manifest(), None)


def test_source_digest_follows_sources_and_recipe(tree):
    d0 = prebuilt.source_digest(str(tree), ARCHS, "13.0")
    assert re.fullmatch(r"[0-9a-f]{64}", d0) and prebuilt.source_digest(str(tree), ARCHS, "13.0") == d0
    assert "csrc/bindings.cpp" in prebuilt.source_files(str(tree))
    # every file of csrc/ is the module's (the CUDA emulator, test infrastructure, is in tests/)
    assert prebuilt.source_files(str(tree)) == sorted(
        str(p.relative_to(tree)) for p in (tree / "csrc").rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    # what does not change the module does not count: a comment in _build.py
    build = tree / "mhakern" / "_build.py"
    build.write_text(build.read_text() + "\n# a comment\n")
    assert prebuilt.source_digest(str(tree), ARCHS, "13.0") == d0
    # the archs are part of the recipe (the CUDA version is matched on its own)
    assert prebuilt.source_digest(str(tree), "9.0", "13.0") != d0
    # a flag of the recipe
    text = build.read_text()
    assert '["-O3", "-Xptxas", "-v", "-lineinfo"]' in text
    build.write_text(text.replace('["-O3", "-Xptxas", "-v", "-lineinfo"]', '["-O2", "-Xptxas", "-v", "-lineinfo"]'))
    d1 = prebuilt.source_digest(str(tree), ARCHS, "13.0")
    assert d1 != d0
    # a source, a header
    host = tree / "csrc" / "cuda" / "cuda_host.cpp"
    host.write_text(host.read_text() + "\n")
    d2 = prebuilt.source_digest(str(tree), ARCHS, "13.0")
    assert d2 != d1
    hdr = tree / "csrc" / "cuda" / "sm90" / "primitives_sm90.cuh"
    hdr.write_text(hdr.read_text().replace("\n", "\n\n", 1))
    assert prebuilt.source_digest(str(tree), ARCHS, "13.0") != d2
    with pytest.raises(ValueError, match="compiles no CUDA code"):
        prebuilt.source_digest(str(tree), "7.5", "13.0")


def _prebuilt_dir(tmp_path, tree, module_bytes=b"\x7fELF not really", **over):
    d = tmp_path / "prebuilt"
    d.mkdir()
    (d / ("_C" + SUFFIX)).write_bytes(module_bytes)
    m = _manifest(sha256=hashlib.sha256(module_bytes).hexdigest(),
                  source_digest=prebuilt.source_digest(str(tree), ARCHS, "13.0"),
                  python_tag=prebuilt.python_tag())
    m.update(over)
    (d / "manifest.json").write_text(json.dumps(m))
    return d


def test_use_installs_when_everything_matches(tmp_path, tree):
    d = _prebuilt_dir(tmp_path, tree)
    rc, line = prebuilt.use(str(d), root=str(tree), facts=lambda: ("2.11.0+cu130", "13.0", (9, 0)))
    assert rc == 0, line
    dst = tree / "mhakern" / ("_C" + SUFFIX)
    assert dst.read_bytes() == b"\x7fELF not really"
    assert re.fullmatch(
        rf"prebuilt: used \S+_C{re.escape(SUFFIX)} \(torch 2\.11\.0, CUDA 13\.0, {prebuilt.python_tag()}, "
        r"archs sm_80,sm_90a,compute_90\)", line), line


@pytest.mark.parametrize("facts,targets,why", [
    (("2.13.0+cpu", None, None), None, "built for torch 2.11.0, this is torch 2.13.0"),
    (("2.11.0", "12.8", None), None, "built for torch.version.cuda 13.0, this is torch.version.cuda 12.8"),
    (("2.11.0", "13.0", (12, 0)), ["sm_80", "sm_90a"], "it carries sm_80, sm_90a, no code for this GPU's compute capability 12.0"),
])
def test_use_refuses_a_mismatch(tmp_path, tree, facts, targets, why):
    d = _prebuilt_dir(tmp_path, tree, **({"targets": targets} if targets else {}))
    rc, line = prebuilt.use(str(d), root=str(tree), facts=lambda: facts)
    assert rc == 1 and line.startswith("prebuilt: not used: ") and why in line, line
    assert not (tree / "mhakern" / ("_C" + SUFFIX)).exists()


def test_use_refuses_changed_sources_and_a_bad_file(tmp_path, tree):
    d = _prebuilt_dir(tmp_path, tree)
    ok = lambda: ("2.11.0", "13.0", None)  # noqa: E731
    (d / ("_C" + SUFFIX)).write_bytes(b"truncated")
    rc, line = prebuilt.use(str(d), root=str(tree), facts=ok)
    assert rc == 1 and "is not the file the manifest describes" in line
    shutil.rmtree(d)
    d = _prebuilt_dir(tmp_path, tree)
    m = json.loads((d / "manifest.json").read_text())
    (d / "manifest.json").write_text(json.dumps(dict(m, module="_C.cpython-399-x86_64-linux-gnu.so")))
    rc, line = prebuilt.use(str(d), root=str(tree), facts=ok)
    assert rc == 1 and "is not one this interpreter loads" in line
    (d / "manifest.json").write_text(json.dumps(m))
    (tree / "csrc" / "bindings.cpp").write_text((tree / "csrc" / "bindings.cpp").read_text() + "\n// changed\n")
    rc, line = prebuilt.use(str(d), root=str(tree), facts=ok)
    assert rc == 1 and "the sources changed since it was built" in line
    assert not (tree / "mhakern" / ("_C" + SUFFIX)).exists()


def test_cli_without_a_prebuilt(tmp_path):
    # no directory, then no manifest: exit 1 and one line, before torch would be imported
    for d in (tmp_path / "missing", tmp_path):
        out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "prebuilt.py"), "use", str(d)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 1, out.stderr
        assert out.stdout.strip().splitlines() == [f"prebuilt: not used: no {'directory ' + str(d) if d != tmp_path else 'manifest.json in ' + str(d)}"]


def test_manifest_targets_are_the_builds_gencode_targets():
    # prebuild_device.py writes the manifest's targets from the build recipe's -gencode flags,
    # which covers() then reads: 9.0 is built as sm_90a, '+PTX' adds the portable PTX.
    import prebuild_device

    def targets(archs):
        return prebuild_device.planned_targets(prebuilt.build_recipe(ROOT, archs, "13.0")["nvcc_flags"])

    assert targets("9.0") == ["sm_90a"]
    assert targets("8.0;9.0+PTX") == ["sm_80", "sm_90a", "compute_90"]
    assert prebuilt.covers(targets("9.0"), (9, 0)) and not prebuilt.covers(targets("9.0"), (8, 0))


def test_the_use_line_says_how_the_sass_compared(tmp_path, tree):
    sass = {"sm90": "42/42 kernels identical to csrc/cuda/sm90/sm90_kernels_sass.json"}
    d = _prebuilt_dir(tmp_path, tree, recorded_sass=sass)
    rc, line = prebuilt.use(str(d), root=str(tree), facts=lambda: ("2.11.0+cu130", "13.0", (9, 0)))
    assert rc == 0 and line.endswith("; sm90 SASS 42/42 kernels identical to csrc/cuda/sm90/sm90_kernels_sass.json"), line


def test_the_modules_sass_is_compared_per_cubin_with_the_record(tmp_path):
    # A helper kernel two units instantiate is in the module twice (one cubin each): read as one
    # listing it doubled, and 12 of 42 sm_90a kernels looked changed when none had.
    import check_cuda_build as ccb
    import prebuild_device as pd

    def cubin(*funcs):
        out = "\nFatbin elf code:\n================\narch = sm_90a\n\n\tcode for sm_90a\n"
        for name, ops in funcs:
            out += f"\t\tFunction : {name}\n"
            out += "".join(f"        /*{16 * i:04x}*/                   {op} ;  /* 0x0 */\n" for i, op in enumerate(ops))
        return out

    helper, kern = ("_Z6helperv", ["MOV R1, c[0x0][0x28]", "EXIT"]), ("_Z4kernv", ["IMAD R2, R3, R4, RZ", "EXIT"])
    one = {k.split("@")[0]: v for k, v in ccb.plain_kernel_digests(ccb.sass_reader.parse_functions(cubin(helper, kern))).items()}
    assert set(one) == {"_Z6helperv", "_Z4kernv"}
    book = tmp_path / "book.json"
    book.write_text(json.dumps({"nvcc X": {f"{k}@sm_90a": v for k, v in one.items()}}))
    books = {"fam": (book, "@sm_90a")}
    listing = cubin(helper, kern) + cubin(helper)
    assert pd.compare_sass(listing, books, "nvcc X") == {"fam": f"2/2 kernels identical to {os.path.relpath(book, ROOT)}"}
    changed = cubin(helper, ("_Z4kernv", ["IMAD R2, R3, R5, RZ", "EXIT"]))
    assert "1/2 kernels identical" in pd.compare_sass(changed, books, "nvcc X")["fam"]
    assert "1 differ, 0 missing" in pd.compare_sass(changed, books, "nvcc X")["fam"]
    assert "1 differ" not in pd.compare_sass(cubin(helper), books, "nvcc X")["fam"]  # kern missing
    assert pd.compare_sass(listing, books, "nvcc Y")["fam"].startswith("no record for nvcc Y")
