"""Every CUDA source compiles with nvcc for sm_80 and sm_90, within registers, spills and shared
memory (tools/check_cuda_build.py: -Xptxas -v, SASS read for local memory in hot loops, the plain
kernels' SASS against its recorded baseline), and the host code parses against the installed
torch headers. No GPU needed; nvcc is. The report is cached per sources digest
(tests/cuda_emulator_harness.py), so the tests that read kernel rows of it compile nothing again."""
import os
from pathlib import Path

from cuda_emulator_harness import check_cuda_build_report


def test_every_cu_compiles_for_sm80_and_sm90(request):
    cache = Path(request.config.cache.mkdir("mhakern_cuda_build"))
    r = check_cuda_build_report(cache, ["-j", str(os.cpu_count() or 2)], name="full")
    print(r["stdout"][-20000:])
    assert r["returncode"] == 0 and r["passed"], (r["stdout"] + r["stderr"])[-6000:]
