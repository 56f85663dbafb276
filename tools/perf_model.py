#!/usr/bin/env python3
"""A static performance model of the sm_90a forward and of decode, computed from SASS and
calibrated on the measured H200 rows (docs/performance.md explains every term).

    python tools/perf_model.py [--sass NAME=FILE ...] [--compile]

Per 128-key step of one CTA (two consumer warpgroups taking turns, S stages of K/V):

    T_step = max( 2 T_g,                         tensor pipe: both warpgroups' S and P V
                  T_g + C,                       ping-pong: my chain C after my P V lands must
                                                 fit under the other warpgroup's batch
                  load,                          coupled K/V release (one stage for both): a
                                                 stage is refilled only after both warpgroups'
                                                 P V, then the copy latency: (2 T_g + lam) / (S - 1);
                                                 separate K and V rings: K's stage refilled once
                                                 both S have landed, V's once both P V have, each
                                                 about T_g after its first reader:
                                                 (T_g + lam) / (min(S_K, S_V) - 1)
                  I x 8 warps / 4 schedulers / f )  issue slots
    T_run  = (sum over CTAs of tiles x T_step + CTAs x F) / SMs

T_g comes from the FLOPs at a fraction of the measured matmul rate (RATES: the assumption that
moves every forward and backward figure most, so each is given at two rates); I (instructions one warp executes per
unmasked tile) and C (cycles from "P V landed" to the next batch's first HGMMA) from the SASS of
the main loop (mhakern/kernels/sass.py reads it; the chain through a one-warp in-order issue model
below); lam (the exposed copy latency) and F (the fixed cost per CTA) are fitted on the two
non-causal rows of the measured run, which was the 2-stage build with the hoisted wait (the SASS
of that build, 'measured', is compiled from the commit the run used or given). Decode: the
K/V bytes over the copy bandwidth of the CTAs that run at once, or each CTA's tile latency over
its stages in flight, whichever binds, in waves of the SMs a family fills. The fused sm_90a
backward (no SASS input): per 64-row stage its 5 products at the rate plus the time no wgmma is
in flight, its CTAs dispatched in block order onto the SMs, the deterministic mode's ordered dQ
adds followed tile by tile (bwd_ms). Which pipeline a
build has is read from its SASS: two full-barrier waits (SYNCS.PHASECHK) in the executed main
loop are separate K and V rings, one a coupled stage.

The numbers are predictions until a GPU run measures them (benchmarks/device_check.sh).
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The H200 as measured in the run of docs/benchmarks/h200/report.md (same run as the rows).
SMS = 132
MATMUL_TFLOPS = 782.0   # bf16 8192^3 product
COPY_TBS = 4.24         # device-to-device copy, read + write
CLOCK_GHZ = 1.83        # SM clock under load (assumed: the sustained clock of that product's rate / peak)
CHAIN_BARRIER_CYCLES = 80  # bar.sync/arrive round trip of the ping-pong (assumed)
# The fixed cost per work item of the persistent grid (capabilities.h kSm90FwdPersistent), an
# assumption bracketing what it keeps of the fitted per-CTA F (11.5 us): the CTA's start (barrier
# init, setmaxnreg), the K/V fill (the producer runs on into the next item) and Q's load (under
# the previous item's last P V and epilogue) go; the first step's lone S, the last's lone P V
# and the epilogue's scattered stores stay.
PERSISTENT_F_US = (8.0, 4.0)

# The products' rate, as a fraction of MATMUL_TFLOPS, per pass: (conservative, optimistic).
# Conservative: FlashAttention-3's own measured fraction, its published H100 SXM5 figures at D 128,
# L 16k (arXiv 2407.08608, first version, FP16: forward non-causal 648 TFLOP/s, backward 561)
# over the product rate measured here (an H100 SXM5 and an H200 have the same GH100 tensor cores:
# 132 SMs at the same clocks; the H200 differs in memory): 0.83 and 0.72. It is FA3's whole-kernel
# rate taken as the rate of the products alone, so what this model adds on top (F, the exposed
# backward time) is counted twice: a lower bound, not a likely figure. Optimistic: the forward's
# products at the measured rate; the backward's RS products at it and its SS ones (S^T, dP^T, dQ:
# 60% of its FLOPs, operands both from shared memory, 128 B/clk) at 85% of it.
FA3_TFLOPS = {"fwd": 648.0, "bwd": 561.0}
BWD_SS_SHARE, BWD_SS_EFFICIENCY = 0.6, 0.85
RATES = {
    "conservative": {"fwd": FA3_TFLOPS["fwd"] / MATMUL_TFLOPS, "bwd": FA3_TFLOPS["bwd"] / MATMUL_TFLOPS},
    "optimistic": {"fwd": 1.0, "bwd": 1.0 / (BWD_SS_SHARE / BWD_SS_EFFICIENCY + 1.0 - BWD_SS_SHARE)},
}

# The fused sm_90a backward (capabilities.h kSm90BwdFused*: 128 keys per CTA, 64-row stages, one
# CTA per SM), its assumptions (docs/performance.md, Backward (sm_90a)); pairs are (fast, slow).
BWD_BLOCK_N, BWD_BLOCK_M = 128, 64
BWD_EXPOSED_US = (0.24, 0.71)  # no wgmma in flight per stage: conflict-free fp32 dQ stores .. the
                               # row-major tile as written (8-way bank conflicts)
BWD_ADD_US = (1.0, 1.5)        # one 64 x D fp32 bulk reduce-add and its release/acquire turn
BWD_F_US = 5.0                 # per CTA: K/V by TMA, the dK/dV epilogue (not fitted)

# Measured rows (ms) of that run, mhakern:cuda, bf16, D 128 (report.md).
MEASURED = {
    ("self", 1, 16, 16384, False): 4.590,
    ("self", 4, 16, 4096, False): 1.281,
    ("self", 1, 16, 16384, True): 2.464,
    ("self", 4, 16, 4096, True): 0.775,
    ("gqa", 1, 32, 16384, True): 4.732,
}
MEASURED_DECODE = {  # (B, Hq, Hkv, Lk): ms of mhakern:cuda (the sm90 forward, 2 stages, planner of 2 CTAs/SM)
    (4, 32, 4, 4096): 0.061,
    (4, 32, 4, 65536): 0.280,
    (4, 32, 4, 1048576): 4.128,
    (4, 32, 8, 131072): 1.066,
}

# One-warp in-order issue model (assumptions for sm_90, one warp alone on its scheduler):
# result latency in cycles, and cycles a warp instruction holds its pipe.
LATENCY = {"MUFU": 18, "SHFL": 28, "F2FP": 5, "S2R": 20, "LDS": 30, "R2UR": 6}
PIPE = {"MUFU": ("xu", 8), "FMNMX": ("alu", 2), "FSEL": ("alu", 2), "ISETP": ("alu", 2), "FSETP": ("alu", 2),
        "LOP3": ("alu", 2), "SEL": ("alu", 2), "F2FP": ("alu", 2), "SHFL": ("lsu", 2), "FADD": ("fma", 1),
        "FMUL": ("fma", 1), "FFMA": ("fma", 1)}
_REG = re.compile(r"\bR(\d+)\b")
_NO_DEST = ("ISETP", "FSETP", "PLOP3", "SYNCS", "BAR", "HGMMA", "WARPGROUP", "STS", "STG", "BRA", "YIELD")


def _reader():
    spec = importlib.util.spec_from_file_location("mhakern_sass_reader", ROOT / "mhakern" / "kernels" / "sass.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def chain_cycles(body) -> int:
    """Cycles for one warp to issue `body` in order (dependencies through R registers)."""
    ready: dict[int, int] = {}
    pipe: dict[str, int] = {}
    t = 0
    R = _reader()
    for _, text in body:
        op = R.opcode(text)
        base = op.split(".")[0]
        if base in ("BRA", "WARPSYNC", "NOP", "BSSY", "BSYNC"):
            continue
        operands = text.split(None, 1)[1] if text.startswith("@") else text
        regs = [int(x) for x in _REG.findall(operands.split(None, 1)[1] if " " in operands else "")]
        dst = None if base in _NO_DEST or not regs else regs[0]
        srcs = regs if dst is None else regs[1:]
        issue = max([t + 1] + [ready.get(r, 0) for r in srcs])
        if base in PIPE:
            name, occ = PIPE[base]
            issue = max(issue, pipe.get(name, 0))
            pipe[name] = issue + occ
        if dst is not None:
            ready[dst] = issue + LATENCY.get(base, 4)
        t = issue
    return t


def loop_terms(sass_text: str, D: int = 128) -> dict:
    """The SASS terms of the forward's main loop (bf16, head dim D): executed instructions per
    unmasked tile, the softmax segment W (S landed -> P V wait), the post-wait path P (P V
    landed -> loop end, plus loop top -> first HGMMA), in one-warp cycles."""
    R = _reader()
    for (name, _), ins in R.parse_functions(sass_text).items():
        if "attn_fwd_sm90_kernel" not in name or f"Li{D}E" not in name:
            continue
        lo, hi = R.main_loop(ins)
        path = R.executed_path(ins, lo, hi)
        waits = R.waits_and_exps(path)
        i1 = next(i for i, n, _ in waits if n == 1)
        i0 = next(i for i, n, _ in waits if n == 0 and i > i1)
        first_hgmma = next(i for i, (_, t) in enumerate(path) if R.opcode(t).startswith("HGMMA"))
        between, exps = R.exps_between_waits(path)
        full_waits = sum(1 for _, t in path if R.opcode(t).startswith("SYNCS.PHASECHK"))
        return {"executed": len(path), "W": chain_cycles(path[i1 + 1:i0]), "split_kv": full_waits >= 2,
                "P": chain_cycles(path[i0 + 1:]) + chain_cycles(path[:first_hgmma]),
                "exps_between": between, "exps": exps}
    raise ValueError(f"no attn_fwd_sm90_kernel<bf16, {D}> in the listing")


def compile_sass(src_root: Path) -> str:
    """SASS of csrc/cuda/sm90/attn_fwd_sm90_bf16_d128.cu under src_root (nvcc, the check's flags)."""
    import tempfile

    sys.path.insert(0, str(ROOT / "tools"))
    import check_cuda_build as ccb

    nvcc = ccb.find_nvcc()
    cuobj = ccb.find_cuobjdump(nvcc)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "f.cubin"
        subprocess.run([nvcc, *ccb.NVCC_FLAGS, ccb.SM90_GENCODE, "-I", str(src_root / "csrc" / "cuda"), "-cubin",
                        str(src_root / "csrc" / "cuda" / "sm90" / "attn_fwd_sm90_bf16_d128.cu"), "-o", str(cubin)],
                       check=True, capture_output=True)
        return subprocess.run([cuobj, "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout


# ------------------------------------------------------------------------------------- forward
def tg_us(D=128, BM=128, BN=128, fraction=1.0) -> float:
    """One warpgroup's S + P V (64 rows x BN keys x D, two products) at one SM's share of
    `fraction` of the measured matmul rate."""
    flop = 2 * 2 * (BM // 2) * BN * D
    return flop / (fraction * MATMUL_TFLOPS * 1e12 / SMS) * 1e6


def step_us(t: dict, stages: int, lam: float, pinned: bool, fraction=1.0) -> tuple[float, dict]:
    """T_step and its terms; stages: of the coupled ring, or of the smaller of the K and V rings
    when the build's SASS has separate ones (t["split_kv"]); fraction: of the matmul rate."""
    Tg = tg_us(fraction=fraction)
    c_cyc = (max(0.0, t["W"] - Tg / 2 * CLOCK_GHZ * 1e3) if pinned else t["W"]) + t["P"] + CHAIN_BARRIER_CYCLES
    C = c_cyc / (CLOCK_GHZ * 1e3)
    held = Tg if t.get("split_kv") else 2 * Tg  # from a stage's first reader to its release
    terms = {"tensor": 2 * Tg, "chain": Tg + C, "load": (held + lam) / (stages - 1),
             "issue": t["executed"] * 8 / 4 / (CLOCK_GHZ * 1e3)}
    return max(terms.values()), terms


def ctas_and_tiles(kind, B, H, L, causal, Hkv=None, BM=128, BN=128):
    """[(CTAs, tiles each)] of a self-attention (or GQA: packed rows) forward."""
    Hkv = Hkv or H
    rows = H // Hkv * L
    mt = math.ceil(rows / BM)
    out = []
    for m in range(mt):
        if causal:
            i_hi = min((m + 1) * BM, rows) - 1
            q_hi = i_hi % L if H == Hkv else min(L - 1, max(r % L for r in range(m * BM, min((m + 1) * BM, rows))))
            tiles = math.ceil((q_hi + 1) / BN)
        else:
            tiles = math.ceil(L / BN)
        out.append((B * Hkv, tiles))
    return out


def run_ms(kind, B, H, L, causal, t, stages, lam, F, pinned, Hkv=None, fraction=1.0):
    """Forward time (ms) of one row: every CTA's tiles at T_step plus F, over the SMs."""
    T, _ = step_us(t, stages, lam, pinned, fraction)
    work = sum(n * (tiles * T + F) for n, tiles in ctas_and_tiles(kind, B, H, L, causal, Hkv))
    return work / SMS / 1e3


def fit(t_measured: dict, fraction=1.0) -> tuple[float, float]:
    """lam, F from the two non-causal rows (2-stage build: the load term binds, checked after),
    with the products at `fraction` of the matmul rate: the rows fix 2 T_g + lam, so a slower
    product leaves less exposed latency."""
    Tg = tg_us(fraction=fraction)
    # ms = CTAs x (tiles x (2 Tg + lam) + F) / SMS / 1e3 for each row: linear in lam and F.
    rows = [(("self", 1, 16, 16384, False), 16 * 128, 128), (("self", 4, 16, 4096, False), 64 * 32, 32)]
    (k1, c1, n1), (k2, c2, n2) = rows
    a1, b1, y1 = c1 * n1, c1, MEASURED[k1] * 1e3 * SMS - c1 * n1 * 2 * Tg
    a2, b2, y2 = c2 * n2, c2, MEASURED[k2] * 1e3 * SMS - c2 * n2 * 2 * Tg
    det = a1 * b2 - a2 * b1
    lam = (y1 * b2 - y2 * b1) / det
    F = (a1 * y2 - a2 * y1) / det
    T, terms = step_us(t_measured, 2, lam, False, fraction)
    assert terms["load"] == T, f"the fit assumes the load term binds the 2-stage build: {terms}"
    return lam, F


# ------------------------------------------------------------------------------------- decode
def decode_ms(B, Hq, Hkv, Lk, family, splits, lam_hbm, F, stages=None, D=128, split_kv=False, fraction=1.0):
    """Decode time of one family: 'sm90' (128-row tile, 128-key stages, 1 CTA per SM) or
    'mma_sync' (the decode kernel: 16-row CTAs, 64-key tiles, 3 CTAs per SM on a 9.0 device);
    split_kv: the sm90 forward's separate K and V rings (a stage held for half the tile's
    products, not all of them); fraction: of the matmul rate (the sm90 tile's products)."""
    rows = Hq // Hkv
    if family == "sm90":
        per_sm, tile_keys, st = 1, 128, stages or 3
        compute = 2 * tg_us(fraction=fraction)  # the whole 128-row tile's products, 4 of its rows useful
        blocks = math.ceil(rows / 128)
    else:
        per_sm, tile_keys, st = 3, 64, stages or 2
        compute = 0.25  # ~1,400 warp-instructions per 64-key tile per CTA on 4 schedulers (SASS count)
        blocks = math.ceil(rows / 16)
    ctas = B * Hkv * blocks * splits
    resident = min(ctas, SMS * per_sm)
    waves = math.ceil(ctas / (SMS * per_sm))
    tile_bytes = 2 * tile_keys * D * 2
    tiles = math.ceil(Lk / tile_keys / splits)
    # bandwidth: the resident CTAs share the copy rate (K/V bytes read once from HBM; rows of
    # other row blocks of the same KV head read them again from L2)
    t_bw = tile_bytes * resident / blocks / (COPY_TBS * 1e12) * 1e6
    held = compute / 2 if family == "sm90" and split_kv else compute
    t_lat = (held + lam_hbm) / max(1, st - 1)
    t_tile = max(t_bw, t_lat, compute)
    return waves * (tiles * t_tile + F) / 1e3


def fit_decode_lambda(F: float, fraction=1.0) -> float:
    """The HBM copy latency exposed per tile, from the measured kv-8 decode row (2 stages, 9
    splits planned for 2 CTAs per SM: 288 CTAs, 3 waves), products at `fraction` of the rate."""
    B, Hq, Hkv, Lk = 4, 32, 8, 131072
    waves, tiles = 3, math.ceil(Lk / 128 / 9)
    t_tile = (MEASURED_DECODE[(B, Hq, Hkv, Lk)] * 1e3 / waves - F) / tiles
    return t_tile - 2 * tg_us(fraction=fraction)


def planner_splits(B, Hkv, rows, Lk, family, per_sm_old=False):
    """The split count of csrc/capabilities.h's planner, its Python twin for the model only
    (tests/test_cuda_sm90.py checks the C++ one on these rows): the sm90 family by wave
    efficiency at 1 CTA per SM (plan_splits_by_waves), the mma.sync decode kernel and the old
    sm90 plan by about two CTAs per SM (plan_splits)."""
    bm, bn = (128, 128) if family == "sm90" else (16, 64)
    ctas = B * Hkv * math.ceil(rows / bm)
    key_blocks = math.ceil(Lk / bn)
    if family != "sm90" or per_sm_old:
        if ctas >= SMS:
            return 1
        return max(1, min(math.ceil(2 * SMS / ctas), key_blocks // 8, 128))
    if ctas >= SMS:
        return 1
    s_max = min(128, key_blocks // 8)
    if s_max <= 1:
        return 1
    effs = {s: (ctas * s) / (math.ceil(ctas * s / SMS) * SMS) for s in range(1, s_max + 1)}
    top = max(effs.values())
    return min(s for s, e in effs.items() if e >= 0.85 * top)


# ------------------------------------------------------------------------------------- backward
def bwd_step_us(fraction: float, exposed: float, D=128) -> float:
    """One 64-row stage of the fused sm_90a backward's CTA (128 keys): its 5 products
    (2 x 64 x 128 x D each) at one SM's share of `fraction` of the matmul rate, plus `exposed`
    (us with no wgmma in flight: the drain, the fp32 dQ part to shared memory, two barriers)."""
    flop = 5 * 2 * BWD_BLOCK_M * BWD_BLOCK_N * D
    return flop / (fraction * MATMUL_TFLOPS * 1e12 / SMS) * 1e6 + exposed


def bwd_ms(B, H, L, causal, fraction, end=0, deterministic=True, D=128) -> float:
    """Fused sm_90a backward time (ms) of a self-attention row (Lq = Lk = L, H heads), at the
    assumptions' fast (end 0) or slow (end 1) value. CTAs (key blocks fastest, as the kernel
    reads its block index) start in index order on the first free SM. A CTA walks its row tiles
    upward (causal: from the first that sees its keys); each tile's products wait for the single
    shared dQ tile to be free (the previous tile's add), and its add (BWD_ADD_US) in the
    deterministic mode also for the previous key block's add into that row tile to complete."""
    import heapq

    T = bwd_step_us(fraction, BWD_EXPOSED_US[end], D)
    exposed, t_add = BWD_EXPOSED_US[end], BWD_ADD_US[end]
    n_kb, n_mt = math.ceil(L / BWD_BLOCK_N), math.ceil(L / BWD_BLOCK_M)
    free = [0.0] * SMS
    finish = 0.0
    for _ in range(B * H):
        last_add = [0.0] * n_mt  # when each row tile's latest add completed (this head)
        for n in range(n_kb):
            start = heapq.heappop(free)
            c, a = start, start
            for mt in range((n * BWD_BLOCK_N) // BWD_BLOCK_M if causal else 0, n_mt):
                c = max(c + T, a + exposed)  # this tile's dQ part waits for the last add to be read
                a = (max(c, last_add[mt]) if deterministic else c) + t_add
                last_add[mt] = a
            done = a + BWD_F_US
            finish = max(finish, done)
            heapq.heappush(free, done)
    return finish / 1e3


def tflops(B, H, L, causal, ms, passes=1.0, D=128) -> float:
    """FlashAttention's convention: forward 4 B H L^2 D (halved when causal), the backward 2.5x."""
    return passes * 4 * B * H * L * L * D / (2 if causal else 1) / ms / 1e9


def fwd_bwd_tflops(fwd: float, bwd: float) -> float:
    """Forward + backward TFLOP/s from each pass's (3.5 x the forward's FLOPs over both times)."""
    return 3.5 / (1.0 / fwd + 2.5 / bwd)


def forward_predictions(builds: dict, rate: str) -> dict:
    """At RATES[rate]: the fit (lam, F) and, per MEASURED row, ms per build (3 stages unless
    'measured') and, with a 'head' build, the persistent grid's (fast, slow) ms."""
    fr = RATES[rate]["fwd"]
    lam, F = fit(builds["measured"], fr)
    rows = {}
    for key in MEASURED:
        kind, B, H, L, causal = key
        Hkv = 8 if kind == "gqa" else None
        cells = {}
        for name, t in builds.items():
            pin = t["exps_between"] >= t["exps"] // 2
            cells[name] = run_ms(kind, B, H, L, causal, t, 2 if name == "measured" else 3, lam, F, pin, Hkv, fr)
        if "head" in builds:
            t = builds["head"]
            pin = t["exps_between"] >= t["exps"] // 2
            cells["persistent"] = tuple(run_ms(kind, B, H, L, causal, t, 3, lam, f, pin, Hkv, fr)
                                        for f in sorted(PERSISTENT_F_US))
        rows[key] = cells
    return {"lam": lam, "F": F, "rows": rows}


def _rng(lo: float, hi: float, fmt="{:.0f}") -> str:
    a, b = fmt.format(lo), fmt.format(hi)
    return a if a == b else f"{a}-{b}"


BWD_ROWS = [(1, 16, 16384, False), (1, 16, 16384, True), (4, 16, 4096, False), (4, 16, 4096, True)]


def backward_predictions(rate: str) -> dict:
    """At RATES[rate]: per BWD_ROWS row, the fused sm_90a backward's (fast, slow) ms, deterministic
    (the default) and not."""
    fr = RATES[rate]["bwd"]
    return {row: {det: tuple(bwd_ms(*row, fr, end, det) for end in (0, 1)) for det in (True, False)}
            for row in BWD_ROWS}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sass", action="append", default=[], help="NAME=FILE: cuobjdump -sass of a build "
                    "(NAME 'measured' is the build the H200 run measured; others are predicted)")
    ap.add_argument("--compile", action="store_true", help="also compile this tree's forward (nvcc) as 'head'")
    args = ap.parse_args(argv)
    builds = {}
    for spec in args.sass:
        name, _, path = spec.partition("=")
        builds[name] = loop_terms(Path(path).read_text())
    if args.compile:
        builds["head"] = loop_terms(compile_sass(ROOT))
    if "measured" not in builds:
        print("perf_model: give --sass measured=FILE (the SASS of the build the H200 run measured)", file=sys.stderr)
        return 2
    rates = list(RATES)
    print("products' rate (fraction of the measured matmul rate, 782 TFLOP/s): "
          + "; ".join(f"{r} forward {RATES[r]['fwd']:.3f}, backward {RATES[r]['bwd']:.3f}" for r in rates))
    fwd = {r: forward_predictions(builds, r) for r in rates}
    for r in rates:
        print(f"calibration at the {r} rate (2 non-causal rows, 2-stage build): lam = {fwd[r]['lam']:.3f} us exposed "
              f"per step, F = {fwd[r]['F']:.2f} us per CTA; T_g = {tg_us(fraction=RATES[r]['fwd']):.3f} us")
    print()
    print("| build | rate | executed / key | exps overlapping P V | W (cycles) | P (cycles) | tensor | chain | load | issue "
          "| T_step (us) | lam it tolerates (us) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, t in builds.items():
        for r in rates:
            fr = RATES[r]["fwd"]
            pinned = t["exps_between"] >= t["exps"] // 2
            st = 2 if name == "measured" else 3
            T, terms = step_us(t, st, fwd[r]["lam"], pinned, fr)
            held = tg_us(fraction=fr) if t["split_kv"] else 2 * tg_us(fraction=fr)
            others = max(v for k, v in terms.items() if k != "load")
            pipe = f"{st} + {st} stages, split K/V" if t["split_kv"] else f"{st} stages, coupled K/V"
            print(f"| {name} ({pipe}) | {r} | {t['executed'] / 128:.2f} | {t['exps_between']} of {t['exps']} | {t['W']} | "
                  f"{t['P']} | {terms['tensor']:.2f} | {terms['chain']:.2f} | {terms['load']:.2f} | {terms['issue']:.2f} | "
                  f"{T:.2f} | {others * (st - 1) - held:.2f} |")
    print()
    now = "persistent" if "head" in builds else list(builds)[-1]
    cols = [f"{n}: {' / '.join(rates)} ms (TFLOP/s)" for n in builds]
    if "head" in builds:
        cols += [f"head, persistent (F per item {PERSISTENT_F_US[0]:g}-{PERSISTENT_F_US[1]:g} us), {r}: ms (TFLOP/s)" for r in rates]
    print("| row (bf16, D 128) | measured ms (TFLOP/s) | " + " | ".join(cols) + " | predicted range TFLOP/s |")
    print("|---|---|" + "---|" * (len(cols) + 1))
    fwd_tf = {}  # row -> rate -> (slow, fast) TFLOP/s of the build now
    for key, m in MEASURED.items():
        kind, B, H, L, causal = key
        Hkv = 8 if kind == "gqa" else None
        tf = lambda ms: tflops(B, H, L, causal, ms)  # noqa: E731
        cells = []
        for name in builds:
            ms = [fwd[r]["rows"][key][name] for r in rates]
            cells.append(" / ".join(f"{x:.3f}" for x in ms) + f" ({' / '.join(f'{tf(x):.0f}' for x in ms)})")
        per_rate = {}
        for r in rates:
            v = fwd[r]["rows"][key][now]
            fast, slow = (v, v) if not isinstance(v, tuple) else v
            per_rate[r] = (tf(slow), tf(fast))
            if "head" in builds:
                cells.append(f"{_rng(fast, slow, '{:.3f}')} ({_rng(tf(slow), tf(fast))})")
        fwd_tf[key] = per_rate
        lo, hi = per_rate[rates[0]][0], per_rate[rates[-1]][1]
        print(f"| {kind} B{B}H{H}{'kv8' if Hkv else ''} L{L}{' causal' if causal else ''} | {m:.3f} ({tf(m):.0f}) | "
              + " | ".join(cells) + f" | **{lo:.0f}-{hi:.0f}** |")
    print()
    for r in rates:
        print(f"decode calibration at the {r} rate (the kv-8 row, 2 stages, 9 splits, 3 waves): HBM latency exposed "
              f"per tile {fit_decode_lambda(fwd[r]['F'], RATES[r]['fwd']):.2f} us")
    print()
    print("| decode row (B4 H32, 1 query, D 128) | measured GB/s (sm90, 2 st, old plan) | model of that build | "
          "sm90, old plan, 3 st | sm90, wave-efficiency plan, 3 + 3 split K/V (now) | mma.sync decode kernel, its plan |")
    print("|---|---|---|---|---|---|")
    for (B, Hq, Hkv, Lk), m in MEASURED_DECODE.items():
        nbytes = 2 * B * Hkv * Lk * 128 * 2
        rows = Hq // Hkv
        s_old = planner_splits(B, Hkv, rows, Lk, "sm90", per_sm_old=True)
        s_new = planner_splits(B, Hkv, rows, Lk, "sm90")
        s_mma = planner_splits(B, Hkv, rows, Lk, "mma_sync")
        cells = []
        for fam, s, st, sp in (("sm90", s_old, 2, False), ("sm90", s_old, 3, False), ("sm90", s_new, 3, True),
                               ("mma_sync", s_mma, 2, False)):
            gbs = []
            for r in rates:
                fr = RATES[r]["fwd"]
                ms = decode_ms(B, Hq, Hkv, Lk, fam, s, fit_decode_lambda(fwd[r]["F"], fr), fwd[r]["F"], stages=st,
                               split_kv=sp, fraction=fr)
                gbs.append(nbytes / ms / 1e6)
            cells.append(f"{_rng(min(gbs), max(gbs))} ({s} splits)")
        print(f"| kv{Hkv} Lk {Lk} | {nbytes / m / 1e6:.0f} | " + " | ".join(cells) + " |")
    print()
    bwd = {r: backward_predictions(r) for r in rates}
    print("| fused sm_90a backward (bf16, D 128) | " + " | ".join(
        f"{r}: T_step (us) | {r}: non-deterministic | {r}: deterministic (default)" for r in rates)
          + " | deterministic range TFLOP/s |")
    print("|---|" + "---|" * (3 * len(rates) + 1))
    for row in BWD_ROWS:
        B, H, L, causal = row
        cells, det = [], {}
        for r in rates:
            steps = [bwd_step_us(RATES[r]["bwd"], e) for e in BWD_EXPOSED_US]
            tf = {d: tuple(tflops(B, H, L, causal, ms, 2.5) for ms in bwd[r][row][d]) for d in (False, True)}
            det[r] = tf[True]
            cells += [_rng(*steps, "{:.2f}"), _rng(tf[False][1], tf[False][0]), _rng(tf[True][1], tf[True][0])]
        print(f"| B{B}H{H} L{L}{' causal' if causal else ''} | " + " | ".join(cells)
              + f" | **{det[rates[0]][1]:.0f}-{det[rates[-1]][0]:.0f}** |")
    print()
    print(f"| forward ({now}) + fused sm_90a backward, deterministic (TFLOP/s) | " + " | ".join(rates) + " | range |")
    print("|---|" + "---|" * (len(rates) + 1))
    for row in BWD_ROWS:
        B, H, L, causal = row
        f = fwd_tf[("self", B, H, L, causal)]
        cells = {}
        for r in rates:
            bt = [tflops(B, H, L, causal, ms, 2.5) for ms in bwd[r][row][True]]  # fast, slow
            cells[r] = (fwd_bwd_tflops(f[r][0], bt[1]), fwd_bwd_tflops(f[r][1], bt[0]))
        print(f"| B{B}H{H} L{L}{' causal' if causal else ''} | " + " | ".join(_rng(*cells[r]) for r in rates)
              + f" | **{cells[rates[0]][0]:.0f}-{cells[rates[-1]][1]:.0f}** |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
