"""The benchmark report (benchmarks/report.py) on a tiny synthetic pytest-benchmark JSON, the
FLOP convention of the benchmark rows, and that the benchmark suite still collects.

The suites themselves are not run here (they are timed runs, not tests); this keeps the report
and the suites' wiring from rotting between benchmark runs.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.cases import Case, cases_for  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _bench(row, provider, origin, median, family="self", mode="fwd", Lq=1024, Lk=1024, B=2, H=4, Hkv=4,
           D=64, causal=False, dtype="fp32", peak=None, resolved=None):
    c = Case(family, mode, dtype, B, H, Hkv, Lq, Lk, D, causal)
    ei = c.as_info()
    ei["row"] = row or c.id
    ei.update(provider=provider, origin=origin, peak_bytes=peak, device="cpu", resolved=resolved)
    if family == "decode":
        ei["copy_bandwidth_gbps"] = 10.0
    return {
        "name": f"test_attention[{ei['row']}-{provider}]",
        "group": ei["row"],
        "stats": {"median": median, "iqr": median / 10, "rounds": 5},
        "extra_info": ei,
    }


def _synthetic(path):
    benches = []
    for L, t_peer in ((512, 0.010), (1024, 0.040)):
        benches.append(_bench(None, "sdpa:flash", "field", t_peer, Lq=L, Lk=L, peak=8 << 20))
        benches.append(_bench(None, "sdpa:math", "field", 4 * t_peer, Lq=L, Lk=L, peak=64 << 20))
        benches.append(_bench(None, "mhakern:reference", "mhakern", 5 * t_peer, Lq=L, Lk=L, peak=96 << 20))
        benches.append(_bench(None, "mhakern:auto", "mhakern", 0.5 * t_peer, Lq=L, Lk=L, peak=4 << 20, resolved="cpu"))
    for e, t in ((12, 0.001), (16, 0.010)):
        kw = dict(family="decode", Lq=1, Lk=1 << e, B=1, H=8, Hkv=1, D=128)
        benches.append(_bench(None, "sdpa:flash", "field", t, **kw))
        benches.append(_bench(None, "mhakern:cpu", "mhakern", t / 4, **kw))
    # A row without a field provider: figures but no ratio.
    benches.append(_bench(None, "mhakern:reference", "mhakern", 0.2, family="gqa", Hkv=2, causal=True))
    # Another suite's benchmarks, one marked as the peer; calls of several steps compare per step.
    benches.append({"name": "test_steps[paper]", "group": "trainer", "stats": {"median": 0.3, "rounds": 3},
                    "extra_info": {"peer": True, "steps_per_round": 2}})
    benches.append({"name": "test_steps[mhakern]", "group": "trainer", "stats": {"median": 0.1, "rounds": 3},
                    "extra_info": {"steps_per_round": 4}})
    data = {
        "machine_info": {
            "mhakern": {
                "device": "cpu", "device_name": "Test CPU 9000, 2 cores", "cpu_model": "Test CPU 9000",
                "cpu_cores": 2, "torch_threads": 2, "torch": "2.13.0", "triton": "3.9.0", "cuda": None,
                "python": "3.11", "backends": {"cpu": None, "triton": "no CUDA device"},
                "copy_bandwidth_gbps": 10.0, "bench_set": "cpu",
                "skipped": {"sdpa:cudnn": {"SDPA's cudnn kernel exists on CUDA only": 7}},
            }
        },
        "commit_info": {"id": "0123456789abcdef", "dirty": False},
        "benchmarks": benches,
        "datetime": "2026-01-01T00:00:00+00:00",
        "version": "5.2.3",
    }
    with open(path, "w") as f:
        json.dump(data, f)


def _run_report(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "benchmarks.report", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "MPLBACKEND": "Agg"})


def test_report_renders_tables_ratios_and_plots(tmp_path):
    src = tmp_path / "bench.json"
    _synthetic(src)
    out = tmp_path / "out"
    r = _run_report(str(src), "--out", str(out), "--headline")
    assert r.returncode == 0, r.stderr
    md = (out / "report.md").read_text()
    # The machine is named, with the software versions.
    assert "Test CPU 9000, 2 cores" in md and "torch 2.13.0" in md and "triton 3.9.0" in md
    # Peer = fastest field provider (sdpa:flash), in bold; others carry speed ratios to it.
    # L=512 forward: flops 4*2*4*512*512*64 = 536.9 MFLOP in 10 ms -> 53.7 GFLOP/s.
    assert "**53.7**" in md
    assert "(0.25x)" in md  # sdpa:math at 4x the peer's time
    assert "(0.20x)" in md  # reference at 5x
    assert "(2.00x, ->cpu)" in md  # auto at half the peer's time, and what it picked
    # Decode GB/s with the share of the copy bandwidth: (q+k+v+out) bytes / time.
    # Lk=4096: 4 * (2*8*128 + 2*4096*128) bytes in 1 ms = 4.20 GB/s; mhakern:cpu 4x that = 168%.
    assert "**4.20**" in md
    assert "(4.00x, 168%)" in md
    # At-a-glance geometric means, memory ratios, other suites, skips.
    assert "| mhakern:auto | 2.00x (2) |" in md
    assert "12.00x" in md  # reference's 96 MiB peak against the peer's 8 MiB
    # 0.3 s per 2 steps against 0.1 s per 4 steps: 6x faster per step.
    assert "Speed relative to its peer: `test_steps[paper]`" in md and "| 6.00x |" in md
    assert "`sdpa:cudnn` (7 rows): SDPA's cudnn kernel exists on CUDA only" in md
    # Both plots were drawn and are PNG files.
    for name in ("tflops.png", "decode.png"):
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000, name
    assert "![Self-attention (Lq = Lk)](tflops.png)" in md
    # The headline lines: mhakern's figures with ratios, then the peer.
    heads = [l for l in r.stdout.splitlines() if l.startswith("headline: ")]
    assert len(heads) == 5
    assert any("mhakern:auto->cpu 107 (2.00x)" in l and "peer sdpa:flash 53.7 GFLOP/s" in l for l in heads), heads
    # ...and mhakern's fastest against each named field kernel measured in the row (SDPA's flash here).
    assert any("; sdpa:flash 53.7 (mhakern 2.00x)" in l for l in heads), heads


def test_report_rejects_a_file_that_is_not_benchmark_json(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"hello": 1}))
    r = _run_report(str(bad), "--out", str(tmp_path))
    assert r.returncode == 2
    assert "x.json" in r.stderr and "pytest-benchmark" in r.stderr
    r = _run_report(str(tmp_path / "missing.json"))
    assert r.returncode == 2 and "missing.json" in r.stderr


def test_flop_convention():
    full = Case("self", "fwd", "fp16", 2, 3, 3, 128, 128, 64, False)
    assert full.flops() == 4 * 2 * 3 * 128 * 128 * 64
    assert Case("self", "fwd", "fp16", 2, 3, 3, 128, 128, 64, True).flops() == full.flops() / 2
    assert Case("self", "bwd", "fp16", 2, 3, 3, 128, 128, 64, False).flops() == 2.5 * full.flops()
    assert Case("self", "fwdbwd", "fp16", 2, 3, 3, 128, 128, 64, False).flops() == 3.5 * full.flops()
    # Bottom-right causal with Lq=2, Lk=4: query 0 sees keys 0..2, query 1 sees 0..3 -> 7 of 8.
    assert Case("cross", "fwd", "fp32", 1, 1, 1, 2, 4, 8, True).visible_fraction() == 7 / 8
    # Lq=4 > Lk=2: query i sees keys j <= i - 2, so queries 0 and 1 see none, 2 sees one, 3 two -> 3 of 8.
    assert Case("cross", "fwd", "fp32", 1, 1, 1, 4, 2, 8, True).visible_fraction() == 3 / 8
    # Decode bytes: q and out (B H Lq D), k and v (B Hkv Lk D), in the dtype's size.
    assert Case("decode", "fwd", "bf16", 1, 8, 1, 1, 1024, 128, False).io_bytes() == 2 * (2 * 8 * 128 + 2 * 1024 * 128)
    with pytest.raises(ValueError, match="Hkv"):
        Case("gqa", "fwd", "fp32", 1, 6, 4, 8, 8, 8, False)


def test_sets_cover_the_issue_shapes():
    cpu, gpu = cases_for("cpu"), cases_for("gpu")
    assert {c.Lq for c in cpu if c.family == "self"} == {512, 1024, 2048, 4096}
    assert max(c.Lq for c in gpu if c.family == "self") == 16384
    for rows, dtypes in ((cpu, {"fp32", "bf16"}), (gpu, {"fp16", "bf16"})):
        selfr = [c for c in rows if c.family == "self"]
        assert {c.dtype for c in selfr} == dtypes and {c.D for c in selfr} == {64, 128}
        assert {c.causal for c in selfr} == {False, True} and {c.mode for c in selfr} == {"fwd", "bwd", "fwdbwd"}
        assert any(c.family == "cross" and c.Lq != c.Lk for c in rows)
        assert any(c.family == "gqa" and c.Hkv < c.H for c in rows)
        dec = [c for c in rows if c.family == "decode"]
        assert max(c.Lk for c in dec) == 1 << 20 and all(c.Lq == 1 for c in dec)
        assert any(c.H // c.Hkv >= 8 for c in dec)
    # The GPU issue's decode target: 32 query heads over 8 KV heads, 128k keys, bf16, a headline row.
    assert any(c.family == "decode" and (c.H, c.Hkv, c.Lk, c.dtype) == (32, 8, 1 << 17, "bf16") and c.headline
               for c in cases_for("headline-gpu"))
    assert 0 < len(cases_for("headline-gpu")) < 25 and all(c.headline for c in cases_for("headline-cpu"))


def test_benchmark_suite_collects(tmp_path):
    # Collection only: imports the suite, builds its rows and providers, finds bench_*.py files.
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "benchmarks", "--collect-only", "-q", "--bench-set", "headline",
         "-p", "no:cacheprovider"],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ids = [l for l in r.stdout.splitlines() if "test_bench_attention.py::test_attention[" in l]
    import torch

    n_rows = len(cases_for("headline-gpu" if torch.cuda.is_available() else "headline-cpu"))
    assert len(ids) >= n_rows * 6, len(ids)  # every headline row against every provider
    assert any("-sdpa:flash]" in l for l in ids) and any("-mhakern:reference]" in l for l in ids)
    assert any("-mhakern:auto]" in l for l in ids)
