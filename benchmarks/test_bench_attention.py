"""Attention against the field: forward, backward and forward+backward per row and provider.

Rows come from ``cases.py`` (``--bench-set``), providers from ``providers.py`` (mhakern's
registry, ``auto``, SDPA's kernels, flash-attn, xformers). Each test is one (row, provider):
it skips with the reason when the provider cannot run the row, otherwise warms up, measures the
peak memory of one call, picks the rounds and times the call with pytest-benchmark. The
pytest-benchmark group of a test is its row, so the terminal table compares the providers of a
row; ``python -m benchmarks.report`` renders the saved JSON.

Run: ``pytest benchmarks/test_bench_attention.py --benchmark-only --benchmark-json OUT.json``.
"""
from __future__ import annotations

import gc

import pytest
import torch

from benchmarks import cases as C
from benchmarks.harness import (
    SESSION,
    WARMUP_CALLS,
    bench_set_name,
    choose_rounds,
    copy_bandwidth_gbps,
    make_runner,
    timed_call_with_peak,
)
from benchmarks.providers import _first_line, all_providers, bench_device

DEVICE = bench_device()


def pytest_generate_tests(metafunc):
    if not {"case", "provider"} <= set(metafunc.fixturenames):
        return
    rows = C.cases_for(bench_set_name(metafunc.config))
    provs = all_providers()
    wanted = metafunc.config.getoption("--bench-provider")
    if wanted:
        provs = [p for p in provs if any(w in p.name for w in wanted)]
    unwanted = metafunc.config.getoption("--bench-skip")
    provs = [p for p in provs if not any(w in p.name for w in unwanted)]
    # Row-major order: the providers of a row run one after another on the cached inputs.
    params = [pytest.param(c, p, id=f"{c.id}-{p.name}") for c in rows for p in provs]
    metafunc.parametrize("case,provider", params)


# One row's inputs at a time (the long rows hold gigabytes).
_CACHE = {"key": None, "tensors": None}


def row_inputs(case: C.Case):
    if _CACHE["key"] != case.input_key:
        _CACHE["key"], _CACHE["tensors"] = None, None
        gc.collect()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        _CACHE["tensors"] = C.make_inputs(case, DEVICE)
        _CACHE["key"] = case.input_key
    return _CACHE["tensors"]


def _skip(provider, reason: str):
    SESSION.skip(provider.name, reason)
    pytest.skip(f"{provider.name}: {reason}")


def test_attention(benchmark, case, provider):
    why = provider.unavailable(DEVICE) or provider.supports(case, DEVICE)
    if why is not None:
        _skip(provider, why)
    q, k, v, dout = row_inputs(case)
    why = provider.supports(case, DEVICE, q, k, v)
    if why is not None:
        _skip(provider, why)
    with provider.scope():
        _measure(benchmark, case, provider, q, k, v, dout)


def _measure(benchmark, case, provider, q, k, v, dout):
    try:
        run = make_runner(provider, case, q, k, v, dout, DEVICE)
        for _ in range(WARMUP_CALLS[DEVICE] - 1):
            run()
        seconds, peak = timed_call_with_peak(run, DEVICE)
        if seconds < 0.5:
            # A cheap call: measure again without the first call's one-time allocations.
            seconds, peak2 = timed_call_with_peak(run, DEVICE)
            peak = peak2 if peak is None or peak2 is None else min(peak, peak2)
    except Exception as e:
        # Ours must run wherever they claim support: let the failure show. A field library that
        # turns a row down at run time (no kernel for this shape or dtype) is skipped with its words.
        if provider.origin == "mhakern":
            raise
        _skip(provider, f"cannot run this row: {_first_line(e)}")
    rounds = choose_rounds(seconds, DEVICE)
    info = case.as_info()
    info.update(
        provider=provider.name,
        origin=provider.origin,
        resolved=provider.resolved(case, q, k, v),
        peak_bytes=peak,
        device=DEVICE,
        rounds=rounds,
    )
    if case.family == "decode":
        info["copy_bandwidth_gbps"] = copy_bandwidth_gbps(DEVICE)
    benchmark.group = case.id
    benchmark.extra_info.update(info)
    benchmark.pedantic(run, rounds=rounds, iterations=1, warmup_rounds=0)
    if benchmark.stats is not None:  # None under --benchmark-disable (a single smoke call)
        SESSION.add(benchmark.extra_info, benchmark.stats.stats.median)
