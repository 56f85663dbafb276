"""Every CUDA source compiles with nvcc for sm_80 and sm_90, within registers, spills and shared
memory (tools/check_cuda_build.py: -Xptxas -v, SASS read for local memory in hot loops, the plain
kernels' SASS against its recorded baseline), and the host code parses against the installed
torch headers. No GPU needed; nvcc is. The check runs in the background from the start of the
session and this test, last, waits for it (tests/conftest.py). The report is cached per sources
digest (tests/cuda_emulator_harness.py), so the tests that read kernel rows of it compile nothing
again."""
import pytest
from conftest import FULL_CHECK_ARGS

from cuda_emulator_harness import check_cuda_build_report


@pytest.mark.cuda_build_report(full=True)
def test_every_cu_compiles_for_sm80_and_sm90(cuda_build_check):
    r = check_cuda_build_report(cuda_build_check, FULL_CHECK_ARGS, name="full")
    print(r["stdout"][-20000:])
    assert r["returncode"] == 0 and r["passed"], (r["stdout"] + r["stderr"])[-6000:]
