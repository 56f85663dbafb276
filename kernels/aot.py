"""Ahead-of-time compilation of every Triton kernel variant the dispatcher can launch.

Runs with no GPU: ``triton.compile`` with a ``GPUTarget`` lowers each variant to a cubin for
sm_80 / sm_90 and reports its shared memory, which is checked against the chip's limit. A
kernel that could not build (or would not fit) on a GPU therefore fails here, in CI.

    python -m mhakern.kernels.aot [--arch 80 90] [--dtypes fp16 bf16 fp32] [--dims 16 32 64 80 128 256]

Must run without TRITON_INTERPRET (the interpreter replaces the kernels by Python functions);
the tests run it in a subprocess.
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time

import torch

# Shared memory a block may use (opt-in maximum), bytes.
SMEM_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}

_TY = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def _ptr(dtype) -> str:
    return "*" + _TY[dtype]


ALL_DIMS = (16, 32, 64, 80, 128, 256)


def variants(dtypes=("fp16", "bf16", "fp32"), dims=ALL_DIMS):
    """(name, kernel, signature, constexprs, num_warps, num_stages) of each variant to build.

    Covers every (kernel, dtype, padded head dim) the heuristics can pick, with the largest row
    tile each uses (the decode tiles are smaller, so they fit whenever these do), with causal
    masking and key lengths on (the variant with the most code).
    """
    from .attention_bwd import _attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel, _bwd_delta_kernel
    from .attention_fwd import _attn_fwd_kernel, precision
    from .heuristics import dkdv_config, dq_config, fwd_config, head_block

    by_name = {v: k for k, v in _TY.items()}
    dtypes = [by_name[t] for t in dtypes]
    strides = lambda names: {n: "i32" for n in names}  # noqa: E731
    for dtype, d in itertools.product(dtypes, dims):
        p = _ptr(dtype)
        common = {"D": d, "DV": d, "BLOCK_D": head_block(d), "BLOCK_DV": head_block(d), "CAUSAL": True, "HAS_KL": True,
                  "PREC": precision(dtype)}
        # forward
        cfg = fwd_config(d, d, dtype)
        sig = {"Q": p, "K": p, "V": p, "O": p, "LSE": "*fp32", "KL": "*i32"}
        sig.update(strides(["stride_qb", "stride_qh", "stride_qm", "stride_kb", "stride_kh", "stride_kn",
                            "stride_vb", "stride_vh", "stride_vn", "stride_ob", "stride_oh", "stride_om",
                            "H", "Lq", "Lk", "n_rep", "heads_per_prog"]))
        sig["sm_scale"] = "fp32"
        ce = dict(common, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
        yield (f"fwd/{_TY[dtype]}/d{d}", _attn_fwd_kernel, sig, ce, cfg.num_warps, cfg.num_stages)
        # delta
        sig = {"O": p, "DO": p, "DELTA": "*fp32"}
        sig.update(strides(["stride_ob", "stride_oh", "stride_om", "stride_db", "stride_dh", "stride_dm", "H", "Lq"]))
        ce = {"DV": d, "BLOCK_M": 64, "BLOCK_DV": head_block(d)}
        yield (f"delta/{_TY[dtype]}/d{d}", _bwd_delta_kernel, sig, ce, 4, 1)
        # dK/dV and dQ share their argument list but for the output pointers
        bwd_strides = ["stride_qb", "stride_qh", "stride_qm", "stride_kb", "stride_kh", "stride_kn",
                       "stride_vb", "stride_vh", "stride_vn", "stride_db", "stride_dh", "stride_dm"]
        cfg = dkdv_config(d, d, dtype)
        sig = {"Q": p, "K": p, "V": p, "DO": p, "LSE": "*fp32", "DELTA": "*fp32", "DK": p, "DV_": p, "KL": "*i32"}
        sig.update(strides(bwd_strides + ["stride_dkb", "stride_dkh", "stride_dkn", "stride_dvb", "stride_dvh",
                                          "stride_dvn", "H", "Lq", "Lk", "n_rep", "heads_per_prog"]))
        sig["sm_scale"] = "fp32"
        ce = dict(common, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
        yield (f"dkdv/{_TY[dtype]}/d{d}", _attn_bwd_dkdv_kernel, sig, ce, cfg.num_warps, cfg.num_stages)
        cfg = dq_config(d, d, dtype)
        sig = {"Q": p, "K": p, "V": p, "DO": p, "LSE": "*fp32", "DELTA": "*fp32", "DQ": p, "KL": "*i32"}
        sig.update(strides(bwd_strides + ["stride_dqb", "stride_dqh", "stride_dqm", "H", "Lq", "Lk", "n_rep",
                                          "heads_per_prog"]))
        sig["sm_scale"] = "fp32"
        ce = dict(common, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
        yield (f"dq/{_TY[dtype]}/d{d}", _attn_bwd_dq_kernel, sig, ce, cfg.num_warps, cfg.num_stages)


def compile_variant(kernel, signature, constexprs, num_warps, num_stages, arch: int):
    import triton
    from triton.backends.compiler import GPUTarget

    sig = dict(signature)
    for name in constexprs:
        sig[name] = "constexpr"
    # Every parameter must appear in the signature, in the kernel's order.
    ordered = {name: sig[name] for name in kernel.arg_names}
    src = triton.compiler.ASTSource(fn=kernel, signature=ordered, constexprs=dict(constexprs))
    return triton.compile(
        src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "num_stages": num_stages}
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, nargs="+", default=[80, 90], help="compute capabilities (default: 80 90)")
    ap.add_argument("--dtypes", nargs="+", default=list(_TY.values()), choices=list(_TY.values()))
    ap.add_argument("--dims", type=int, nargs="+", default=list(ALL_DIMS), help="head dims (default: %(default)s)")
    args = ap.parse_args(argv)
    from . import INTERPRET

    if INTERPRET:
        print("aot: TRITON_INTERPRET is set; unset it to compile the real kernels", file=sys.stderr)
        return 2
    failures = 0
    print(f"{'variant':<22} {'arch':>4} {'warps':>5} {'stages':>6} {'smem KiB':>9} {'limit':>6}  status")
    for (name, kernel, sig, ce, warps, stages), arch in itertools.product(list(variants(args.dtypes, args.dims)), args.arch):
        t0 = time.time()
        try:
            compiled = compile_variant(kernel, sig, ce, warps, stages, arch)
            smem = compiled.metadata.shared
            ok = smem <= SMEM_LIMIT[arch]
            status = f"ok ({time.time() - t0:.1f}s)" if ok else "EXCEEDS SHARED MEMORY"
        except Exception as e:  # report every failing variant, not just the first
            smem, ok, status = -1, False, f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        failures += not ok
        print(f"{name:<22} {arch:>4} {warps:>5} {stages:>6} {smem / 1024:>9.1f} {SMEM_LIMIT[arch] // 1024:>6}  {status}",
              flush=True)
    print(f"aot: {failures} failing variant(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
