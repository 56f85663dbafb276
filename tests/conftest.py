"""Test configuration shared by every suite.

Without a CUDA device the Triton backend runs through its interpreter on CPU tensors; the
interpreter must be switched on before any Triton kernel is defined, so it is set here, before
mhakern.kernels can be imported.
"""
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module's tests (the trainer's tests: its CLI runs one thread by
    default, and bitwise comparisons must not depend on the machine's core count)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
