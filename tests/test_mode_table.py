"""The mode table (mhakern/mode_table.py) is the one place the call record's modes are listed:
tools/generate_modes.py writes the Python record, the Triton launchers' plain record and the C++
X-macros from it. The committed outputs are current, an edit of the table shows in them, and
what they define agrees with the table (and with the compiled operators' schemas)."""
import inspect
import shutil
from pathlib import Path

import pytest
import torch

from mhakern import _caps, _extension
from mhakern.kernels import _modes_generated as kernel_modes
from mhakern.kernels import attention_bwd, attention_fwd
from mhakern.modes import DEFAULT_MODES, OP_SCHEMA_MODES, Modes

from tool_loading import load_tool

ROOT = Path(__file__).resolve().parent.parent


gen = load_tool("generate_modes")
table = gen.load_table()


def test_committed_generated_files_are_current():
    diffs = gen.differences()
    assert not diffs, "run `python tools/generate_modes.py`:\n" + "\n".join(diffs)


def test_an_edit_of_the_table_shows_in_every_output(tmp_path):
    # A new scalar mode appended to the table: every output changes, and the new field reaches the
    # record, both C++ schemas, ModeArgs, ModeParams (copied) and the feature lists.
    text = (ROOT / "mhakern" / "mode_table.py").read_text()
    # Appended after the tables' last rows, whatever they are (rows are only ever appended).
    feat_end = text.index("\n)", text.index("FEATURES: Tuple[Feature, ...] = ("))
    edited = text[:feat_end] + '\n    Feature("q_offset", "a global query offset"),' + text[feat_end:]
    params_end = edited.index("\n)", edited.index("PARAMS: Tuple[Param, ...] = ("))
    edited = (edited[:params_end] + "\n) + PARAMS_EXTRA" + edited[params_end + 2:]).replace(
        '\n#: Properties of the record',
        '\nMODES = MODES + (Mode("q_offset", "int", 0, feature="q_offset", on="nonneg", doc="x"),)\n'
        'PARAMS_EXTRA = (Param("q_offset", "int64_t", "0", copied=True, feature="q_offset", on="nonneg"),)\n'
        '\n#: Properties of the record')
    assert edited.count("q_offset") == 5
    path = tmp_path / "mode_table.py"
    path.write_text(edited)
    root = tmp_path / "root"
    for rel in gen.render_all():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, root / rel)
    assert sorted(gen.differences(root, path)) == sorted(f"differs: {rel}" for rel in gen.render_all())
    out = gen.render_all(path)
    header = out[gen.CPP_HEADER]
    assert f"X(kQOffset, {len(table.FEATURES)}, \"q_offset\")" in header and "int q_offset=0\"" in header.replace(" \\\n  \"", "")
    assert "X(q_offset, int64_t, 0)" in header and "X(q_offset, int64_t)" in header
    assert "q_offset: int = 0" in out[gen.PY_RECORD] and "need.add(\"q_offset\")" in out[gen.PY_RECORD]


def test_the_record_is_the_tables():
    assert Modes._fields == tuple(m.name for m in table.MODES)
    assert tuple(Modes._field_defaults[m.name] for m in table.MODES) == tuple(m.default for m in table.MODES)
    assert DEFAULT_MODES == Modes() and Modes.from_op_args() is DEFAULT_MODES
    assert Modes.from_op_args(*DEFAULT_MODES.op_args()) is DEFAULT_MODES
    assert OP_SCHEMA_MODES == gen.op_schema_modes(table)
    # The plain record of the Triton launchers holds every field at its default.
    assert vars(kernel_modes.PLAIN) == DEFAULT_MODES._asdict()


def test_build_takes_the_groups_whole():
    # A public argument that gives several fields (window) is passed through whole; None leaves
    # them at their defaults, and a build of defaults is the default record itself.
    assert Modes.build() is DEFAULT_MODES and Modes.build(window=None, softcap=0.0) is DEFAULT_MODES
    for group, (fields, _) in table.GROUPS.items():
        values = tuple(range(3, 3 + len(fields)))
        m = Modes.build(**{group: values}, dropout_p=0.5)
        assert tuple(getattr(m, f) for f in fields) == values and m.dropout_p == 0.5
    assert Modes.build(window=(4, -1)) == Modes(window_left=4)
    with pytest.raises(TypeError):
        Modes.build(window_l=1)


def test_feature_names_and_bits_are_the_tables():
    assert _caps.FEATURE_NAMES == tuple(f.name for f in table.FEATURES)
    for m in table.MODES:
        if m.feature is None:
            continue
        # A record with only this mode on needs exactly its feature (sinks: nothing).
        on = {"given": torch.zeros(1), "true": True, "positive": 0.5, "nonneg": 3}[m.on]
        assert Modes(**{m.name: on}).required_features() == {m.feature}, m.name
    assert Modes(sinks=torch.zeros(1)).required_features() == frozenset()
    assert Modes(sinks=torch.zeros(1)).for_backend() == DEFAULT_MODES


def test_c_adapters_follow_the_schemas():
    m = Modes(window_left=3, softcap=2.0, mask_grad=True, seed=7)
    fwd = [x for x in table.MODES if x.backends and x.passes in ("both", "fwd") and not x.c_tail]
    bwd = [x for x in table.MODES if x.backends and x.passes in ("both", "bwd") and not x.c_tail]
    assert m.c_op_args() == tuple(getattr(m, x.name) for x in fwd)
    assert m.c_op_bwd_args() == tuple(getattr(m, x.name) for x in bwd)
    cu = torch.tensor([0, 2], dtype=torch.int32)
    packed = Modes(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=2, max_seqlen_k=2)
    tail = [x.name for x in table.MODES if x.c_tail and x.backends]
    assert packed.c_op_args()[len(fwd):] == tuple(getattr(packed, n) for n in tail)


def test_the_compiled_operators_have_the_tables_schemas():
    if _extension.load() is None:
        pytest.skip(f"mhakern._C is not built: {_extension.load_error()}")
    for op, pass_ in ((torch.ops.mhakern_C.fwd.default, "fwd"), (torch.ops.mhakern_C.bwd.default, "bwd")):
        names = [a.name for a in op._schema.arguments]
        modes = [x.name for x in table.MODES if x.backends and x.passes in ("both", pass_)]
        assert names[-len(modes):] == modes and names[-len(modes) - 1] == "key_lengths"


def test_triton_spellings_are_kernel_arguments():
    # The table's triton column names arguments the Triton kernels take (the forward's, and the
    # backward's for every mode but the forward-only KV cache).
    def args_of(module):
        names = set()
        for obj in vars(module).values():
            fn = getattr(obj, "fn", None)
            if callable(fn) and hasattr(obj, "arg_names"):
                names.update(inspect.signature(fn).parameters)
        return names

    fwd, bwd = args_of(attention_fwd), args_of(attention_bwd)
    assert kernel_modes.KERNEL_ARGS
    for name, args in kernel_modes.KERNEL_ARGS.items():
        assert set(args) <= fwd, (name, set(args) - fwd)
        if name not in ("cache_batch_idx", "block_table"):
            assert set(args) <= bwd, (name, set(args) - bwd)
