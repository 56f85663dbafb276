"""Every CUDA source compiles with nvcc for sm_80 and sm_90 (the mma.sync family's fp16 units in CI,
both dtypes under MHAKERN_SLOW=1: tests/conftest.py FULL_CHECK_ARGS), within registers, spills and shared
memory (tools/check_cuda_build.py: -Xptxas -v, SASS read for local memory in hot loops, the plain
kernels' SASS against its recorded baseline), and the host code parses against the installed
torch headers. No GPU needed; nvcc is. The check runs in the background from the start of the
session and this test, last, waits for it (tests/conftest.py). The report is cached per sources
digest (tests/cuda_emulator_harness.py), so the tests that read kernel rows of it compile nothing
again."""
import pytest
from conftest import FULL_CHECK_ARGS

from cuda_emulator_harness import check_cuda_build_report


@pytest.mark.cuda_build_report(full=True)
def test_every_cu_compiles_for_sm80_and_sm90(cuda_build_check):
    r = check_cuda_build_report(cuda_build_check, FULL_CHECK_ARGS, name="full")
    print(r["stdout"][-20000:])
    assert r["returncode"] == 0 and r["passed"], (r["stdout"] + r["stderr"])[-6000:]


# ---------------------------------------------------------------------------------------------
# The recorded SASS (mhakern/kernels/sass.py RECORDED_SASS; the full check above compares every
# compiled kernel with it): which kernels it must hold, and the per-family digests built on it
# ---------------------------------------------------------------------------------------------
import importlib.util  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ELEM_MANGLED = {"fp16": "6__half", "bf16": "13__nv_bfloat16"}


def _module(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    import sys

    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _reader():
    return _module("mhakern_sass_reader_test", ROOT / "mhakern" / "kernels" / "sass.py")


def test_every_sm90_kernel_has_a_recorded_digest():
    # Every instantiation of the capability table's sm_90a lists: the forward and its packed
    # twin per (dtype, D), the split backward's two kernels and the fused one with its dQ
    # conversion per backward (dtype, D), for the nvcc release(s) recorded.
    gen = _module("generate_kernels_test", ROOT / "tools" / "generate_kernels.py")
    caps = (ROOT / "csrc" / "capabilities.h").read_text()
    book = json.loads((ROOT / "csrc" / _reader().RECORDED_SASS["sm90"]).read_text())
    assert book, "no nvcc release recorded"
    want = []
    for tag, D in gen.sm90_instances(caps):
        want += [(k, tag, D) for k in ("attn_fwd_sm90_kernel", "attn_fwd_sm90_varlen_kernel")]
    for tag, D in gen.sm90_bwd_instances(caps):
        want += [(k, tag, D) for k in ("attn_bwd_dkdv_sm90_kernel", "attn_bwd_dq_sm90_kernel",
                                       "attn_bwd_fused_sm90_kernel", "attn_bwd_dq_convert_sm90_kernel")]
    assert len(want) >= 6 * 2 + 4 * 4
    for release, kernels in book.items():
        for kern, tag, D in want:
            prefix = f"_ZN7mhakern4cuda4sm90{len(kern)}{kern}I{ELEM_MANGLED[tag]}Li{D}EE"
            hits = [k for k in kernels if k.startswith(prefix) and k.endswith("@sm_90a")]
            assert len(hits) == 1, f"{release}: {kern}<{tag}, {D}> recorded {len(hits)} times"


def test_family_build_digests_follow_the_records(tmp_path):
    reader = _reader()
    csrc = tmp_path / "csrc"
    for rel in reader.RECORDED_SASS.values():
        (csrc / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / "csrc" / rel, csrc / rel)
    base = reader.family_build_digests(str(csrc))
    assert set(base) == set(reader.RECORDED_SASS) and all(len(d) == 16 for d in base.values())
    assert base == reader.family_build_digests(str(ROOT / "csrc"))
    # one sm_90a kernel's SASS changes: the sm90 family's digest changes, the mma family's not
    path = csrc / reader.RECORDED_SASS["sm90"]
    book = json.loads(path.read_text())
    release = sorted(book)[0]
    key = next(k for k in sorted(book[release]) if "attn_bwd_fused_sm90_kernel" in k)
    book[release][key][1] = "0" * 16
    path.write_text(json.dumps(book))
    changed = reader.family_build_digests(str(csrc))
    assert changed["sm90"] != base["sm90"] and changed["mma"] == base["mma"]
    # per nvcc release: the recorded one gives a digest, another gives none
    assert set(reader.family_build_digests(str(csrc), release)) == set(reader.RECORDED_SASS)
    assert reader.family_build_digests(str(csrc), "no such release") == {}
