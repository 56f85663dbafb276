"""The capability table crosses into Python one way: mhakern/_caps.py, generated from
csrc/capabilities.h by tools/generate_caps.py (through csrc/capabilities_json.h, the writer the
compiled module's torch.ops.mhakern_C.capabilities() uses too). The committed module is current,
the generator reads the header (an edit shows), the compiled module reports the same table plus
its build facts, and `import mhakern` knows the table without mhakern._C."""
import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mhakern import _caps, _extension
from mhakern.backends import ALL_FEATURES, cuda_backend

from tool_loading import load_tool

ROOT = Path(__file__).resolve().parent.parent


gen = load_tool("generate_caps")
needs_compiler = pytest.mark.skipif(gen.compiler() is None, reason="no C++ compiler (the generator compiles the table)")


@needs_compiler
def test_committed_caps_module_is_current():
    diffs = gen.differences()
    assert not diffs, "run `python tools/generate_caps.py`:\n" + "\n".join(diffs)


@needs_compiler
def test_the_generator_reads_the_header(tmp_path):
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    for name in ("capabilities.h", "capabilities_json.h"):
        shutil.copy(ROOT / "csrc" / name, csrc / name)
    shutil.copytree(ROOT / "csrc" / "generated", csrc / "generated")  # the feature bits (mode table)
    header = csrc / "capabilities.h"
    text = header.read_text()
    edited = text.replace("kCpuMaxHeadDim = 256;", "kCpuMaxHeadDim = 512;").replace(
        "kSm90FwdFeatures = kVarlen,", "kSm90FwdFeatures = kVarlen | kSoftcap,")
    assert edited.count("512") > text.count("512") and edited != text
    header.write_text(edited)
    assert gen.differences(csrc) == ["differs: _caps.py"]
    out = tmp_path / "_caps.py"
    out.write_text(gen.render(csrc))
    ns: dict = {}
    exec(compile(out.read_text(), str(out), "exec"), ns)
    assert ns["TABLE"]["cpu"]["max_head_dim"] == 512
    assert ns["TABLE"]["cuda"]["sm90"]["fwd_features"] == ["softcap", "varlen"]  # capabilities.h's bit order


def test_feature_names_are_the_headers_and_every_family_uses_them():
    assert ALL_FEATURES == frozenset(_caps.FEATURE_NAMES) and len(_caps.FEATURE_NAMES) == len(ALL_FEATURES)
    cuda = _caps.TABLE["cuda"]
    for feats in (_caps.TABLE["cpu"]["features"], cuda["features"], cuda["sm90"]["fwd_features"],
                  cuda["sm90"]["bwd_features"], cuda["sm90"]["bwd_fused"]["features"]):
        assert set(feats) <= ALL_FEATURES
    # The sm_90a forward serves packed sequences (capabilities.h kSm90FwdFeatures), its backward none.
    assert cuda["sm90"]["fwd_features"] == ["varlen"] and cuda["sm90"]["bwd_features"] == []


def test_the_compiled_module_reports_the_same_table_with_its_build_facts():
    if _extension.load() is None:
        pytest.skip(f"mhakern._C is not built: {_extension.load_error()}")
    full = json.loads(torch.ops.mhakern_C.capabilities())
    table = copy.deepcopy(full)
    for path in _caps.BUILD_FACTS:
        node = table
        for key in path[:-1]:
            node = node[key]
        node.pop(path[-1])  # KeyError: a build fact the module no longer reports
    assert table == _caps.TABLE
    assert full["cpu"]["compiled"] is True and isinstance(full["cuda"]["sm90"]["compiled"], bool)


def test_packed_calls_of_a_head_dim_only_the_sm90_forward_has_keep_their_route():
    # D 256's forward is the sm_90a family's only; that forward serves packed sequences
    # (sm90.fwd_features) but no GPU has run it packed: the cuda backend refuses such a call
    # with that reason (auto falls back), and the modes the forward lacks with theirs. D 128
    # (a mma.sync forward too) is unaffected.
    be = cuda_backend.CudaBackend()
    q = torch.empty(1, 4, 8, 256)
    kv = torch.empty(1, 2, 8, 256)
    assert "varlen" in cuda_backend.SM90_FWD_UNVERIFIED <= set(_caps.TABLE["cuda"]["sm90"]["fwd_features"])
    why = be.mode_limits(q, kv, kv, frozenset({"varlen"}))
    assert why is not None and "sm_90a forward" in why and "not yet verified on a GPU" in why
    why = be.mode_limits(q, kv, kv, frozenset({"varlen", "window"}))
    assert why is not None and "takes no window" in why and "its modes: varlen" in why
    assert be.mode_limits(q, kv, kv, frozenset()) is None
    q128, kv128 = torch.empty(1, 4, 8, 128), torch.empty(1, 2, 8, 128)
    assert be.mode_limits(q128, kv128, kv128, frozenset({"varlen", "window"})) is None


def test_import_without_the_extension_knows_the_table_and_splits_triton_decode():
    # mhakern._C made unimportable: the table, the feature names, the build's archs and the
    # Triton forward's split-K plan come from mhakern/_caps.py alone.
    code = (
        "import sys; sys.modules['mhakern._C'] = None\n"
        "import mhakern\n"
        "from mhakern import _build, _caps, _extension\n"
        "from mhakern.backends import ALL_FEATURES, cpu_backend, cuda_backend\n"
        "from mhakern.kernels import heuristics\n"
        "assert _extension.load() is None and _extension.capabilities() is None\n"
        "assert ALL_FEATURES == set(_caps.FEATURE_NAMES)\n"
        "cpu = cpu_backend.CpuBackend()\n"
        "assert cpu.unavailable() is not None and cpu._max_head_dim == _caps.TABLE['cpu']['max_head_dim']\n"
        "assert cuda_backend.CudaBackend.features == set(_caps.TABLE['cuda']['features'])\n"
        "assert _build.min_arch() == (8, 0) and _build.default_arch_list() == '8.0;9.0+PTX'\n"
        "assert _build.builds_sm90a(['9.0+PTX']) and not _build.builds_sm90a(['8.0', '8.6+PTX'])\n"
        "assert heuristics.plan_fwd_splits(32, 2048, 4 * 32, 128, 132) == 9\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]
