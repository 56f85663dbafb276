"""Every Triton kernel variant the dispatcher can launch compiles for sm_80 and sm_90 with the
tiles the heuristics give that architecture, and fits the chip (no GPU needed: triton.compile
with a GPUTarget, then the SASS read back with the cuobjdump Triton ships):

* no register spills in a loop, and at most aot.STACK_SLACK bytes of stack (kernels/sass.py);
  without the JIT's alignment specialisation (head dims that are not multiples of 16), no
  spills in a loop;
* on sm_90, every loop that multiplies matrices uses the warpgroup MMA (HGMMA), except the
  variants heuristics.MMA_SYNC_ON_SM90 names with the reason;
* shared memory within the chip's limit.

The heuristics pick one tile configuration per (arch, dtype width, head-dim bucket: <= 64,
<= 128, <= 256); registers and shared memory grow with the head dim inside a bucket, so the
largest dim of each bucket is the variant to check. bf16 tiles have fp16's byte sizes and
compile to the same register allocation give or take a few. fp32 variants multiply in full fp32
(no tensor cores): their unrolled FMA code takes minutes per variant to compile on two cores,
too long for CI; ``python -m mhakern.kernels.aot`` builds every variant (fp32 included).
"""
import os
import subprocess
import sys

import pytest

from mhakern.kernels import sass

pytest.importorskip("triton", reason="triton is not installed")


def test_kernels_compile_for_sm80_and_sm90_without_spills_within_shared_memory():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, stated to silence its warning
    cmd = [sys.executable, "-m", "mhakern.kernels.aot", "--dtypes", "fp16", "--dims", "64", "128", "256"]
    # One process per target: the two compile in parallel on a two-core machine.
    procs = [
        subprocess.Popen(cmd + ["--arch", arch], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for arch in ("80", "90")
    ]
    outs = [p.communicate(timeout=1200)[0] for p in procs]
    report = "\n".join(outs)
    print(report)
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
    assert report.count(" ok (") == 2 * 3 * 4, report


def test_unaligned_variants_keep_local_memory_out_of_their_loops():
    # Strides that are not multiples of 16 (head dim 40, say) get no alignment specialisation:
    # loads go element by element and the prologue may spill, never the key loop.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    cmd = [sys.executable, "-m", "mhakern.kernels.aot", "--dtypes", "fp16", "--dims", "64", "--only", "fwd", "dq",
           "--unaligned"]
    out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1200)
    print(out.stdout)
    assert out.returncode == 0, out.stdout
    assert out.stdout.count(" ok (") == 2 * 2, out.stdout


# The SASS reading itself, on hand-written listings in cuobjdump's format.
_USAGE = "Function _attn_fwd_kernel:\nREG:168 STACK:16 SHARED:1024 LOCAL:0 CONSTANT[0]:664 TEXTURE:0"


def _listing(*insns):
    return "\n".join(f"        /*{addr:04x}*/                   {text} ;   /* 0x0000 */" for addr, text in insns)


def test_sass_counts_local_memory_inside_loops_only_there():
    text = _listing(
        (0x00, "STL [R1], R5"),  # before the loop
        (0x10, "LDGSTS.E.BYPASS.128 [R3], desc[UR4][R8.64]"),
        (0x20, "HMMA.16816.F32.BF16 R8, R12, R16, R8"),
        (0x30, "LDL R5, [R1]"),  # inside
        (0x40, "@P0 BRA 0x10"),
        (0x50, "LDL R6, [R1+0x4]"),  # after
        (0x60, "EXIT"),
    )
    rep = sass.analyse(text, _USAGE)
    assert (rep.regs, rep.stack) == (168, 16)
    assert (rep.ldl, rep.stl, rep.local_in_loops) == (2, 1, 1)
    assert rep.loops == [(0x10, 0x40)]
    assert (rep.mma_loops, rep.hgmma_loops) == (1, 0)


def test_sass_sees_hgmma_loops_and_ignores_forward_branches():
    text = _listing(
        (0x00, "@P1 BRA 0x50"),  # forward: not a loop
        (0x10, "WARPGROUP.ARRIVE"),
        (0x20, "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR28], RZ, !UPT"),
        (0x30, "BRA 0x10"),
        (0x40, "FFMA R1, R2, R3, R4"),
        (0x50, "EXIT"),
    )
    rep = sass.analyse(text, _USAGE.replace("STACK:16", "STACK:0"))
    assert rep.loops == [(0x10, 0x30)]
    assert (rep.mma_loops, rep.hgmma_loops, rep.local_in_loops, rep.stack) == (1, 1, 0, 0)
    # a uniform-predicated branch names its target last
    assert sass.loops_of(sass.parse_sass(_listing((0x10, "LDL R2, [R1]"), (0x20, "@!P0 BRA.U !UP0, 0x10")))) == [(0x10, 0x20)]


def test_sass_refuses_a_listing_without_resource_usage():
    with pytest.raises(ValueError, match="REG/STACK"):
        sass.analyse(_listing((0, "EXIT")), "nothing useful")
