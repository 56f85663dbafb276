"""Context parallelism (mhakern.distributed) on CPU: gloo on 127.0.0.1, one long-lived group
of worker processes per world size serving every case (tests/cp_workers.py), each case
compared on every rank with single-process float64 attention over the whole sequence
(tests/cp_cases.py): forward, lse and gradients under the tolerance rule."""
from __future__ import annotations

import pytest
import torch

import mhakern

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available in this torch build", allow_module_level=True)

from cp_workers import GROUP_TIMEOUT_S, WorkerPool  # noqa: E402


@pytest.fixture(scope="module")
def cp2():
    pool = WorkerPool(2)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def cp4():
    pool = WorkerPool(4)
    yield pool
    pool.close()


def _no_errors(answers):
    errs = [f"rank {r}: {e}" for r, a in enumerate(answers) for e in a["errors"]]
    assert not errs, "\n".join(errs)


DENSE = [
    # every method x layout, causal in both alignments, GQA
    *[dict(method=m, layout=lay, causal=c, causal_align=al, H=4, Hkv=2)
      for m in ("ring", "allgather", "ulysses") for lay in ("zigzag", "contiguous")
      for c, al in ((False, "bottom_right"), (True, "bottom_right"), (True, "top_left"))],
    dict(method="ring", causal=True, H=4, Hkv=1),  # MQA
    dict(method="allgather", causal=True, B=2, Dv=8),
    # key lengths: alignment-sensitive with bottom-right, zero and full lengths
    *[dict(method=m, causal=True, causal_align=al, B=3, Hkv=2, key_lengths=[20, 0, 32])
      for m in ("ring", "ulysses") for al in ("bottom_right", "top_left")],
    dict(method="allgather", layout="contiguous", B=2, key_lengths=[5, 17]),
    # windows (either side, with causal), softcap with large logits, ALiBi, sinks
    dict(method="ring", causal=True, window=(5, -1)),
    dict(method="ring", window=(3, 4), layout="contiguous"),
    dict(method="allgather", causal=True, window=(6, 0), key_lengths=[27], causal_align="bottom_right"),
    dict(method="ulysses", causal=True, window=(4, 0), Hkv=2),
    dict(method="ring", causal=True, softcap=3.0, scale_inputs=3.0),
    dict(method="ring", causal=True, alibi=True, B=2, key_lengths=[25, 32]),
    dict(method="ulysses", causal=True, alibi=True, H=4, Hkv=2),
    dict(method="ring", causal=True, sinks=True, H=4, Hkv=2),
    dict(method="ulysses", causal=True, sinks=True, H=4, Hkv=2),
    # dropout: the single-device call's keep mask over the whole sequence
    dict(method="ring", causal=True, dropout_p=0.3, H=4, Hkv=2),
    dict(method="allgather", layout="contiguous", dropout_p=0.5, window=(5, 3), B=2, key_lengths=[30, 11]),
    dict(method="ulysses", causal=True, dropout_p=0.3, H=4, Hkv=2, sinks=True),
    dict(method="ulysses", layout="contiguous", dropout_p=0.5, window=(5, 3), B=2, key_lengths=[30, 11], Hkv=2),
    # (B, L, H, D) memory seen through a transpose: used as it is, the output laid out alike
    dict(method="ring", causal=True, strided=True, H=4, Hkv=2),
    dict(method="ulysses", causal=True, strided=True, H=4, Hkv=2, layout="contiguous"),
    # half precision: merged in fp32
    dict(method="ring", causal=True, dtype="float16"),
    dict(method="allgather", causal=True, dtype="bfloat16", layout="contiguous"),
    dict(method="ulysses", causal=True, dtype="bfloat16", Hkv=2),
]


@pytest.mark.parametrize("case", DENSE, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_dense_against_whole_sequence(cp2, case):
    _no_errors(cp2.run("dense", **case))


PACKED = [
    dict(method="ring"),  # uneven lengths and a sequence shorter than the 4 zigzag chunks
    dict(method="allgather", lengths=(1, 2, 0, 3), layout="contiguous"),
    dict(method="ring", window=(3, 0), alibi=True),
    dict(method="allgather", causal=False, sinks=True, softcap=2.0, H=4, Hkv=2),
    dict(method="ulysses", Hkv=2),
    dict(method="ulysses", layout="contiguous", lengths=(1, 2, 0, 3), window=(2, 0), alibi=True, sinks=True, H=4,
         Hkv=2),
]


@pytest.mark.parametrize("case", PACKED, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_packed_against_whole_pack(cp2, case):
    _no_errors(cp2.run("packed", **case))


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_shard_unshard(cp2, layout):
    _no_errors(cp2.run("layouts", layout=layout))


def test_gradients_bit_identical_across_runs_and_ring_allgather(cp2):
    kw = dict(causal=True, H=4, Hkv=2, B=2, key_lengths=[30, 17], sinks=True)
    ring = cp2.run("bits", method="ring", **kw)
    for per_rank in ring:
        assert per_rank[0] == per_rank[1], "ring: two runs differ"
    gathered = cp2.run("bits", method="allgather", runs=1, **kw)
    assert [g[0] for g in gathered] == [r[0] for r in ring], "ring and allgather differ"
    uly = cp2.run("bits", method="ulysses", **kw)
    for per_rank in uly:
        assert per_rank[0] == per_rank[1], "ulysses: two runs differ"


@pytest.mark.parametrize("kind, expected", [
    ("length", "the ranks disagree on the local sequence length: rank 0: 8, rank 1: 12"),
    ("dtype", "the ranks disagree on dtype: rank 0: torch.float32, rank 1: torch.float64"),
    ("odd", "rank 0 refused its input (ranks [0, 1] failed): ArgumentError: q: a 'zigzag' shard holds 2 equal chunks"),
    ("heads_local", "rank 1 refused its input: ArgumentError: k, v"),
    ("key_lengths", "the ranks disagree on key_lengths"),
    ("ulysses_heads", "method: 'ulysses' shards the heads: H (3) and Hkv (1) must be divisible by the group size 2"),
    ("generator", "rank 1 refused its input: TypeError: generator: expected None or a torch.Generator, got int"),
    ("kernel", "rank 1 failed: RuntimeError: injected kernel failure"),
])
def test_faults_raise_on_every_rank_naming_the_rank(cp2, kind, expected):
    answers = cp2.run("refusal", kind=kind)
    for r, a in enumerate(answers):
        assert a["message"] is not None and expected in a["message"], f"rank {r}: {a['message']!r}"
        assert a["after"] == (1, 2, 8, 16), "the group is not usable after the refusal"


def test_torch_compile_graph_breaks_with_reason(cp2):
    for a in cp2.run("compiled"):
        assert a["graph_breaks"] == 1
        assert any("context-parallel attention communicates between ranks" in r for r in a["reasons"]), a["reasons"]
        assert a["equal"]


def test_device_mesh_dimension(cp2):
    _no_errors(cp2.run("dense", method="ring", causal=True, mesh=True))


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_fused_mha_context_parallel_group(cp2, method):
    _no_errors(cp2.run("fused_mha", method=method))


def test_without_a_process_group_refused():
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="group: torch.distributed is not initialised"):
        mhakern.distributed.context_parallel_attention(q, q, q)


# ---------------------------------------------------------------------------------------------
# Four ranks (slow)

DENSE4 = [
    *[dict(method=m, layout=lay, causal=True, causal_align=al, H=4, Hkv=4 if m == "ulysses" else 2, L=48)
      for m in ("ring", "allgather", "ulysses") for lay in ("zigzag", "contiguous") for al in ("bottom_right", "top_left")],
    dict(method="ring", causal=True, B=2, key_lengths=[40, 7], window=(9, 0), L=48),
    dict(method="allgather", causal=True, alibi=True, sinks=True, L=48, H=4, Hkv=1),
    dict(method="ring", causal=True, group_ranks=[1, 3], L=32),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", DENSE4, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_four_ranks(cp4, case):
    _no_errors(cp4.run("dense", **case))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ring", "allgather", "ulysses"])
def test_four_ranks_packed(cp4, method):
    _no_errors(cp4.run("packed", method=method, lengths=(3, 29, 1, 0, 16, 7), H=4, Hkv=4))


@pytest.mark.slow
def test_four_ranks_bits_and_faults(cp4):
    kw = dict(causal=True, H=4, Hkv=2, L=48)
    ring = cp4.run("bits", method="ring", **kw)
    gathered = cp4.run("bits", method="allgather", runs=1, **kw)
    assert all(r[0] == r[1] for r in ring) and [g[0] for g in gathered] == [r[0] for r in ring]
    for a in cp4.run("refusal", kind="kernel"):
        assert "rank 1 failed" in a["message"]


@pytest.mark.slow
def test_usage_torchrun_example_runs_as_written(tmp_path):
    # docs/usage.md's two-process script, run as the document says (torchrun, 2 processes, CPU).
    import re
    import subprocess
    import sys
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "usage.md").read_text()
    m = re.search(r"save it as cp_example\.py.*?-->\s*```python\n(.*?)^```$", text, re.S | re.M)
    assert m, "docs/usage.md: the torchrun example is gone"
    script = tmp_path / "cp_example.py"
    script.write_text(m.group(1))
    env = dict(__import__("os").environ, OMP_NUM_THREADS="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(__import__("cp_workers").free_port()), str(script)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    diffs = [float(line.split()[1]) for line in res.stdout.splitlines() if re.match(r"^[01] \S+$", line)]
    assert len(diffs) == 2 and max(diffs) < 1e-5, res.stdout


# ---------------------------------------------------------------------------------------------
# The dropout offsets mode (one process): a block of a longer call draws that call's keep mask


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_dropout_offsets_draw_the_longer_calls_mask(backend):
    # A block of rows, keys and query heads of a longer call, through dropout_q0 / _k0 / _h0 /
    # _heads: its keep bits are the longer call's.
    from mhakern import reference
    from mhakern.modes import Modes
    from mhakern.ops import attn_bwd, attn_fwd

    if mhakern.available_backends().get(backend) is not None:
        pytest.skip(f"backend {backend} unavailable: {mhakern.available_backends()[backend]}")
    g = torch.Generator().manual_seed(3)
    B, H, Hkv, L, D, p, seed = 2, 4, 2, 24, 16, 0.4, 1234567
    a, n, c, m = 7, 9, 3, 13  # rows a .. a + n - 1 against keys c .. c + m - 1
    h0, heads = 4, 12  # query heads 4 .. 7 of a call of 12
    q, k, v, dout = (torch.randn(B, h, l, D, generator=g) for h, l in ((H, n), (Hkv, m), (Hkv, m), (H, n)))
    keep = reference.dropout_keep_mask(seed, B, heads, L, L, p)[:, h0 : h0 + H, a : a + n, c : c + m]
    # The oracle: softmax of the block, the longer call's keep bits, in float64.
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    kk, vv = (x.repeat_interleave(H // Hkv, 1) for x in (k64, v64))
    pr = torch.softmax(q64 @ kk.transpose(-1, -2) * D ** -0.5, -1)
    want = (pr * keep / (1 - p)) @ vv
    want.backward(dout.double())
    modes = Modes.build(dropout_p=p, seed=seed, dropout_q0=a, dropout_k0=c, dropout_h0=h0, dropout_heads=heads)
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = attn_fwd(*xs, D ** -0.5, False, None, backend, *modes.op_args())
    assert (out.double() - want).abs().max().item() < 1e-5
    dq, dk, dv, _, _ = attn_bwd(dout, *xs, out, lse, D ** -0.5, False, None, backend, *modes.op_args())
    for got, ref in ((dq, q64.grad), (dk, k64.grad), (dv, v64.grad)):
        assert (got.double() - ref).abs().max().item() < 1e-4
    # Offsets 0 draw the block's own mask: a different one.
    out0, _ = attn_fwd(*xs, D ** -0.5, False, None, backend, *Modes.build(dropout_p=p, seed=seed).op_args())
    assert (out0.double() - want).abs().max().item() > 1e-2


def test_dropout_offsets_refused_by_backends_without_them():
    from mhakern.modes import Modes
    from mhakern.ops import attn_fwd

    q = torch.randn(1, 1, 4, 16)
    modes = Modes.build(dropout_p=0.1, seed=1, dropout_k0=4)
    assert "dropout_offsets" in modes.required_features()
    with pytest.raises(ValueError, match="does not implement dropout_offsets"):
        attn_fwd(q, q, q, 0.25, False, None, "triton", *modes.op_args())
    with pytest.raises(ValueError, match="dropout_k0: expected an int in"):
        attn_fwd(q, q, q, 0.25, False, None, "reference", *Modes.build(dropout_p=0.1, dropout_k0=-1).op_args())


@pytest.mark.slow
@pytest.mark.parametrize("where", ["before", "ring"])
def test_a_rank_that_dies_makes_the_others_raise(where):
    # Its own pool: the case ends the group. Rank 1 exits; rank 0 must raise naming a peer
    # (gloo sees the closed connection; at worst the group's timeout ends the wait).
    import queue as _queue

    pool = WorkerPool(2)
    try:
        for q in pool.inbox:
            q.put(("exit_rank", {"dead": 1, "where": where}))
        r, status, answer = pool.outbox.get(timeout=GROUP_TIMEOUT_S + 60)
        assert (r, status) == (0, "ok"), answer
        assert answer["message"] and "rank 0 got no data from" in answer["message"], answer
        with pytest.raises(_queue.Empty):
            pool.outbox.get(timeout=1)  # rank 1 never answered: it exited
    finally:
        pool.close()
