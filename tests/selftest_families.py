"""A test-only kernel family for the first-use self-test (mhakern/selftest.py,
tests/test_selftest.py): ``emu_mma``, the mma.sync CUDA kernels (fp16, head dim 32) running on
CPU tensors through the CUDA emulator (tests/cuda_emulator_harness.py), so that the self-test's
machinery (the child, the timeout, the cache, the gate) runs for real on a machine without a GPU.

Importing this module registers the family; the self-test's child imports it too (the family
names this module). Environment: ``MHAKERN_TEST_EMU_LIB``, the emulator library to load;
``MHAKERN_TEST_SELFTEST_RUNS``, a file the child appends one line to per self-test run (the
tests count runs).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from mhakern import selftest

EMU_LIB_ENV = "MHAKERN_TEST_EMU_LIB"
RUNS_ENV = "MHAKERN_TEST_SELFTEST_RUNS"
INSTANCE = "fp16_d32"


def emulated_kernels(lib_path: str):
    """(forward, backward) of the emulated mma.sync kernels, with the backend contract's
    signatures, on CPU tensors."""
    from cuda_emulator_harness import Emulator, padded

    emu = Emulator(Path(lib_path), (INSTANCE,))

    def forward(q, k, v, scale, causal, key_lengths, modes=None):
        out, lse = emu.forward(padded(q), padded(k), padded(v), scale, causal, key_lengths)
        return out.clone(), lse

    def backward(dout, q, k, v, out, lse, scale, causal, key_lengths, modes=None):
        grads = emu.backward(padded(dout), padded(q), padded(k), padded(v), padded(out), lse.contiguous(), scale,
                             causal, key_lengths)
        return tuple(g.clone() for g in grads) + (None,)

    return forward, backward


def _kernels(device):
    runs = os.environ.get(RUNS_ENV)
    if runs:
        with open(runs, "a") as f:
            f.write(f"{os.getpid()}\n")
    return emulated_kernels(os.environ[EMU_LIB_ENV])


def _digest() -> str:
    # The library's directory is named by the digest of the emulator's sources and flags.
    return "emu-" + Path(os.environ.get(EMU_LIB_ENV, "none")).parent.name


EMU_MMA = selftest.Family(
    name="emu_mma",
    backend="emu",
    cases=(
        selftest.Case(2, 4, 2, 33, 47, 32, "float16", True, (47, 40)),
        selftest.Case(1, 4, 1, 1, 70, 32, "float16"),
    ),
    kernels=f"{__name__}:_kernels",
    digest=_digest,
    untestable=lambda device: None if device.type == "cpu" else "the emulator runs on CPU tensors",
    module=__name__,
)
selftest.register_family(EMU_MMA)
