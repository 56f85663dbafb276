"""Measurement plumbing shared by the suites: the timed callables, rounds, peak memory, the
device's copy bandwidth and the description of the machine.

Timing is pytest-benchmark's ``pedantic`` mode with rounds chosen from a warm-up call: the
timed function synchronises CUDA before it returns, so a round is the whole call as a user sees
it (launches, dispatch and the kernels). The report uses the median round.
"""
from __future__ import annotations

import ctypes
import math
import os
import platform
import statistics
import time
from typing import Callable, Dict, List, Optional

import torch

from mhakern._cpuinfo import cpu_model

from .cases import Case

# Rounds per benchmark: enough to fill ``target`` seconds, within [lo, hi].
ROUNDS = {"cpu": {"target": 0.6, "lo": 3, "hi": 40}, "cuda": {"target": 0.2, "lo": 10, "hi": 200}}
# Untimed calls before measuring: the first compiles / autotunes / allocates workspaces.
WARMUP_CALLS = {"cpu": 1, "cuda": 2}


def bench_set_name(config) -> str:
    """The set of rows selected by ``--bench-set`` on this machine (see cases.py)."""
    name = config.getoption("--bench-set")
    cuda = torch.cuda.is_available()
    if name == "auto":
        return "gpu" if cuda else "cpu"
    if name == "headline":
        return "headline-gpu" if cuda else "headline-cpu"
    return name


def synchronizer(device: str) -> Callable[[], None]:
    if device == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def make_runner(provider, case: Case, q, k, v, dout, device: str) -> Callable[[], None]:
    """The timed callable of one (provider, row).

    ``fwd``: the forward without autograd. ``bwd``: the backward alone, on a forward graph built
    here once and kept (``retain_graph``). ``fwdbwd``: both. Gradients are returned by
    ``torch.autograd.grad`` (nothing accumulates into ``.grad``).
    """
    sync = synchronizer(device)
    grad = case.mode != "fwd"
    fn, args = provider.prepare(case, q, k, v, grad)
    if case.mode == "fwd":

        def run():
            with torch.no_grad():
                fn(*args)
            sync()

    elif case.mode == "bwd":
        out = fn(*args)

        def run():
            torch.autograd.grad(out, args, dout, retain_graph=True)
            sync()

    else:

        def run():
            out = fn(*args)
            torch.autograd.grad(out, args, dout)
            sync()

    return run


def choose_rounds(seconds_per_call: float, device: str) -> int:
    r = ROUNDS[device]
    n = math.ceil(r["target"] / max(seconds_per_call, 1e-9))
    return int(min(r["hi"], max(r["lo"], n)))


# ---------------------------------------------------------------------------------------------
# Peak memory of one call


def _proc_status(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _release_free_heap() -> None:
    # Freed heap blocks stay resident and would be reused unseen by the next call: hand their
    # pages back first (glibc), so that every buffer the call touches shows in its peak RSS.
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_peak_rss() -> bool:
    # Linux: writing 5 to clear_refs resets VmHWM (the peak resident set) to the current RSS.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def timed_call_with_peak(run: Callable[[], None], device: str):
    """Run once; return ``(seconds, peak_bytes)``: the memory the call needed above what was
    allocated before it (None where it cannot be measured).

    CUDA: the caching allocator's peak. CPU: growth of the peak resident set (VmHWM, reset
    before the call, after the C heap's free pages were released), i.e. every page the call
    touched beyond what was resident: a close measure for buffers of a page or more.
    """
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        run()
        dt = time.perf_counter() - t0
        return dt, max(0, torch.cuda.max_memory_allocated() - base)
    _release_free_heap()
    ok = _reset_peak_rss()
    base = _proc_status("VmRSS")
    t0 = time.perf_counter()
    run()
    dt = time.perf_counter() - t0
    peak = _proc_status("VmHWM")
    if not ok or base is None or peak is None:
        return dt, None
    return dt, max(0, peak - base)


# ---------------------------------------------------------------------------------------------
# The device's copy bandwidth (the roof for memory-bound decode rows)

_COPY_BW: Dict[str, float] = {}


def copy_bandwidth_gbps(device: str) -> float:
    """Measured ``dst.copy_(src)`` bandwidth in GB/s, counting bytes read plus bytes written.

    Same convention as the decode rows' GB/s (bytes of q, k, v read and out written).
    """
    if device in _COPY_BW:
        return _COPY_BW[device]
    nbytes = (1 << 30) if device == "cuda" else (256 << 20)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    sync = synchronizer(device)
    times = []
    for i in range(12 if device == "cuda" else 7):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    del src, dst
    _COPY_BW[device] = 2 * nbytes / statistics.median(times) / 1e9
    return _COPY_BW[device]


# ---------------------------------------------------------------------------------------------
# The machine




def _version(modname: str) -> Optional[str]:
    try:
        mod = __import__(modname)
        return getattr(mod, "__version__", "unknown")
    except Exception:
        return None


def machine_description(device: str) -> Dict:
    """What the report prints about the machine (stored in the JSON's machine_info)."""
    from mhakern import available_backends

    info = {
        "device": device,
        "cpu_model": cpu_model(detailed=True),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "backends": {k: v for k, v in available_backends().items()},
        "copy_bandwidth_gbps": copy_bandwidth_gbps(device),
    }
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        info["gpu_name"] = torch.cuda.get_device_name(0)
        info["gpu_capability"] = f"{p.major}.{p.minor}"
        info["gpu_sms"] = p.multi_processor_count
        info["gpu_memory_gib"] = round(p.total_memory / 2**30, 1)
        info["device_name"] = info["gpu_name"]
    else:
        info["device_name"] = f"{info['cpu_model']}, {info['cpu_cores']} cores"
    return info


# ---------------------------------------------------------------------------------------------
# What one session measured and skipped (printed at its end, stored in the JSON)


class SessionLog:
    def __init__(self):
        self.results: List[Dict] = []
        self.skips: Dict[str, Dict[str, int]] = {}

    def skip(self, provider: str, reason: str) -> None:
        d = self.skips.setdefault(provider, {})
        d[reason] = d.get(reason, 0) + 1

    def add(self, extra_info: Dict, median: float) -> None:
        self.results.append({"extra_info": dict(extra_info), "stats": {"median": median}})


SESSION = SessionLog()
