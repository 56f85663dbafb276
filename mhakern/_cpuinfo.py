"""The CPU's name and feature flags as Linux reports them (/proc/cpuinfo), read once.

Used where a result names its machine (the self-test's cache key, the benchmarks' reports) and
where a test asks whether the chip has an instruction set; the kernels themselves pick their ISA
unit from cpuid in C++ (csrc/cpu/attention_cpu.cpp), not from here.
"""
from __future__ import annotations

import functools
import platform
from typing import Dict, FrozenSet


@functools.lru_cache(maxsize=1)
def _first_processor() -> Dict[str, str]:
    """The first processor's ``key: value`` lines ({} where /proc/cpuinfo cannot be read)."""
    fields: Dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break  # the processors repeat the same block
                    continue
                key, _, val = line.partition(":")
                fields.setdefault(key.strip(), val.strip())
    except OSError:
        pass
    return fields


def cpu_flags() -> FrozenSet[str]:
    """The feature flags (``avx2``, ``avx512_bf16``, ...); empty where unknown."""
    return frozenset(_first_processor().get("flags", "").split())


def cpu_model(detailed: bool = False) -> str:
    """The model name; with ``detailed``, its family and model numbers when the name is generic
    (ends without a digit, as virtual machines often report it)."""
    f = _first_processor()
    name = f.get("model name") or platform.processor() or platform.machine() or "cpu"
    fam, model = f.get("cpu family"), f.get("model")
    if detailed and fam is not None and model is not None and not any(ch.isdigit() for ch in name.split()[-1]):
        name += f" (family {fam}, model {model})"
    return name
