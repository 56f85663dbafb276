"""Every Triton kernel variant the dispatcher can launch compiles for sm_80 and sm_90 and fits
the chip's shared memory (no GPU needed: triton.compile with a GPUTarget).

The heuristics pick one tile configuration per (dtype, head-dim bucket: <= 64, <= 128, <= 256);
shared memory grows with the head dim inside a bucket, so the largest dim of each bucket is the
variant to check. bf16 tiles have fp16's byte sizes and are covered by fp16's. fp32 variants
multiply in full fp32 (no tensor cores): their unrolled FMA code takes minutes per variant to
compile on two cores, too long for CI; ``python -m mhakern.kernels.aot`` builds every variant
(fp32 included; seen: at most 128 KiB of shared memory, fp32 dQ at head dim 256, against
sm_80's 163 KiB) and the device check runs it.
"""
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="triton is not installed")


def test_kernels_compile_for_sm80_and_sm90_within_shared_memory():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "mhakern.kernels.aot", "--dtypes", "fp16", "--dims", "64", "128", "256"]
    # One process per target: the two compile in parallel on a two-core machine.
    procs = [
        subprocess.Popen(cmd + ["--arch", arch], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for arch in ("80", "90")
    ]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    report = "\n".join(outs)
    print(report)
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
    assert report.count(" ok (") == 2 * 3 * 4, report
