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
