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

# The first-use self-test of the kernel families (mhakern/selftest.py) trusts without testing in
# the suite: its tests run the kernels against the reference themselves, and the tests of
# dispatch on a pretend CUDA device must not start a self-test there. tests/test_selftest.py
# switches it back on.
os.environ.setdefault("MHAKERN_SELF_TEST", "0")

import pytest  # noqa: E402


#: ``MHAKERN_SLOW=1`` runs the heavy cases (tests marked ``slow``, and more examples where a test
#: reads it): CI runs without it, within its time budget; run them before resolving an issue.
SLOW = os.environ.get("MHAKERN_SLOW", "") not in ("", "0")


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "cuda_build_report(full): reads the report of tools/check_cuda_build.py; runs at the end of the session, "
        "after the full check (full=True: the test that needs it) has compiled in the background meanwhile",
    )


def pytest_collection_modifyitems(config, items):
    # The compile check's tests last: the full check compiles in the background from the start
    # of the session (pytest_collection_finish), on the core the mostly single-threaded tests
    # leave idle, and these tests wait for it.
    late = [item for item in items if item.get_closest_marker("cuda_build_report")]
    if late:
        items[:] = [item for item in items if not item.get_closest_marker("cuda_build_report")] + late
    if not SLOW:
        heavy = pytest.mark.skip(reason="a heavy case: MHAKERN_SLOW=1 runs it")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(heavy)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# The full run of tools/check_cuda_build.py (minutes of nvcc), started in a thread when a selected
# test needs it; the tests that read its report wait for it (fixture cuda_build_check).
_full_check: dict = {}
# CI compiles the fp16 units of the mma.sync family (every kernel and head dim, both arches: each
# code path once) and the whole sm_90a family, about 5 minutes of one core less than both dtypes;
# MHAKERN_SLOW=1 compiles the bf16 units too. One nvcc at a time: the check has the session's
# length to finish in, and a second job would take the core the tests run on.
FULL_CHECK_ARGS = ["-j", "1"] + ([] if SLOW else ["--dtypes", "fp16"])


def _cuda_build_cache(config):
    from pathlib import Path

    return Path(config.cache.mkdir("mhakern_cuda_build"))


def pytest_collection_finish(session):
    config = session.config
    if not any((m := item.get_closest_marker("cuda_build_report")) and m.kwargs.get("full") for item in session.items):
        return
    # Not for a collection only, nor where the session may stop before the test that waits
    # (-x, --maxfail: it then compiles in its turn), nor in a worker of a distributed run.
    if config.option.collectonly or config.option.maxfail or hasattr(config, "workerinput"):
        return
    from cuda_emulator_harness import check_cuda_build_report, find_nvcc

    if find_nvcc() is None:
        return  # the test skips, saying so
    import threading

    def run():
        try:
            check_cuda_build_report(_cuda_build_cache(config), FULL_CHECK_ARGS)  # into the cache
        except BaseException as e:  # noqa: BLE001 -- handed to the test that waits
            _full_check["error"] = e

    _full_check["thread"] = threading.Thread(target=run, name="check_cuda_build", daemon=True)
    _full_check["thread"].start()


def pytest_sessionfinish(session):
    # A session that ended before its waiting test (an internal error) still waits for the
    # check: its nvcc processes must not outlive the session (Ctrl-C stops them with it).
    thread = _full_check.get("thread")
    if thread is not None and thread.is_alive():
        print("\nwaiting for the CUDA compile check started in the background (Ctrl-C stops it)", flush=True)
        thread.join()


@pytest.fixture
def cuda_build_check(request):
    """The compile check's cache dir, once the background full check (if one was started) has
    finished; its report is then in that cache, so that reading it compiles nothing again."""
    thread = _full_check.get("thread")
    if thread is not None:
        thread.join()
        if "error" in _full_check:
            raise _full_check["error"]
    return _cuda_build_cache(request.config)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module's tests (the trainer's tests: its CLI runs one thread by
    default, and bitwise comparisons must not depend on the machine's core count)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
