"""The capability table is single: the committed CUDA instantiation files are what
tools/generate_kernels.py makes from csrc/capabilities.h, the compiled module reports the same
table, and the generator notices a stale or edited file."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from tool_loading import load_tool

ROOT = Path(__file__).resolve().parent.parent


gen = load_tool("generate_kernels")


def test_committed_instantiation_files_are_current():
    diffs = gen.differences()
    assert not diffs, "run `python tools/generate_kernels.py`:\n" + "\n".join(diffs)


def test_every_instance_has_a_forward_and_a_backward_file():
    inst = gen.instances((ROOT / "csrc" / "capabilities.h").read_text())
    assert len(inst) == len(set(inst)) > 0
    for tag, d in inst:
        for direction in ("fwd", "bwd"):
            text = (ROOT / "csrc" / "cuda" / "mma" / f"attn_{direction}_{tag}_d{d}.cu").read_text()
            assert f"MHK_DEFINE_ATTN_{direction.upper()}({tag}, {d})" in text


def test_check_mode_reports_stale_missing_and_edited_files(tmp_path):
    cuda = tmp_path / "cuda"
    shutil.copytree(ROOT / "csrc" / "cuda", cuda)
    caps = ROOT / "csrc" / "capabilities.h"
    assert gen.differences(cuda, caps) == []
    mma = cuda / "mma"
    (mma / "attn_fwd_fp16_d48.cu").write_text("// left over\n")
    (mma / "attn_bwd_bf16_d64.cu").unlink()
    (mma / "attn_fwd_bf16_d32.cu").write_text((mma / "attn_fwd_bf16_d32.cu").read_text() + "// edit\n")
    assert gen.differences(cuda, caps) == [
        "missing: mma/attn_bwd_bf16_d64.cu",
        "stale (no such instance): mma/attn_fwd_fp16_d48.cu",
        "differs: mma/attn_fwd_bf16_d32.cu",
    ]


def test_a_new_head_dim_is_one_edit_of_the_table(tmp_path):
    text = (ROOT / "csrc" / "capabilities.h").read_text()
    edited = text.replace("F(tag, 128)", "F(tag, 128) F(tag, 80)")
    assert edited != text
    names = set(gen.expected_files(edited))
    assert {"attn_fwd_fp16_d80.cu", "attn_bwd_bf16_d80.cu"} <= names


def test_the_compiled_module_reports_the_same_table():
    from mhakern.backends import cpu_backend

    caps = cpu_backend.capabilities()
    if caps is None:
        pytest.skip(f"mhakern._C is not built: {cpu_backend._ext_error}")
    inst = gen.instances((ROOT / "csrc" / "capabilities.h").read_text())
    assert caps["cuda"]["head_dims"] == list(dict.fromkeys(d for _, d in inst))
    names = {"fp16": "float16", "bf16": "bfloat16"}
    assert caps["cuda"]["dtypes"] == list(dict.fromkeys(names[t] for t, _ in inst))
    assert set(caps["cuda"]["tiles"]) == {str(d) for _, d in inst}
    # The limits that keep the kernels' 32-bit index arithmetic from overflowing.
    assert caps["cuda"]["max_group_rows"] <= 2**30 and caps["cuda"]["max_keys"] <= 2**30
    assert caps["cpu"]["max_head_dim"] >= 1 and set(caps["cpu"]["dtypes"]) >= {"float32"}
    assert json.loads(torch.ops.mhakern_C.capabilities()) == caps
