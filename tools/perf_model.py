#!/usr/bin/env python3
"""A static performance model of the sm_90a forward and of decode, computed from SASS and
calibrated on the measured H200 rows (docs/performance.md explains every term).

    python tools/perf_model.py [--sass NAME=FILE ...] [--compile] [--markdown]

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

T_g comes from the FLOPs at the measured matmul rate; I (instructions one warp executes per
unmasked tile) and C (cycles from "P V landed" to the next batch's first HGMMA) from the SASS of
the main loop (mhakern/kernels/sass.py reads it; the chain through a one-warp in-order issue model
below); lam (the exposed copy latency) and F (the fixed cost per CTA) are fitted on the two
non-causal rows of the measured run, which was the 2-stage build with the hoisted wait (the SASS
of that build, 'measured', is compiled from the commit the run used or given). Decode: the
K/V bytes over the copy bandwidth of the CTAs that run at once, or each CTA's tile latency over
its stages in flight, whichever binds, in waves of the SMs a family fills. Which pipeline a
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
def tg_us(D=128, BM=128, BN=128) -> float:
    """One warpgroup's S + P V (64 rows x BN keys x D, two products) at one SM's share of the
    measured matmul rate."""
    flop = 2 * 2 * (BM // 2) * BN * D
    return flop / (MATMUL_TFLOPS * 1e12 / SMS) * 1e6


def step_us(t: dict, stages: int, lam: float, pinned: bool) -> tuple[float, dict]:
    """T_step and its terms; stages: of the coupled ring, or of the smaller of the K and V rings
    when the build's SASS has separate ones (t["split_kv"])."""
    Tg = tg_us()
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


def run_ms(kind, B, H, L, causal, t, stages, lam, F, pinned, Hkv=None):
    T, _ = step_us(t, stages, lam, pinned)
    work = sum(n * (tiles * T + F) for n, tiles in ctas_and_tiles(kind, B, H, L, causal, Hkv))
    return work / SMS / 1e3


def fit(t_measured: dict) -> tuple[float, float]:
    """lam, F from the two non-causal rows (2-stage build: the load term binds, checked after)."""
    Tg = tg_us()
    # ms = CTAs x (tiles x (2 Tg + lam) + F) / SMS / 1e3 for each row: linear in lam and F.
    rows = [(("self", 1, 16, 16384, False), 16 * 128, 128), (("self", 4, 16, 4096, False), 64 * 32, 32)]
    (k1, c1, n1), (k2, c2, n2) = rows
    a1, b1, y1 = c1 * n1, c1, MEASURED[k1] * 1e3 * SMS - c1 * n1 * 2 * Tg
    a2, b2, y2 = c2 * n2, c2, MEASURED[k2] * 1e3 * SMS - c2 * n2 * 2 * Tg
    det = a1 * b2 - a2 * b1
    lam = (y1 * b2 - y2 * b1) / det
    F = (a1 * y2 - a2 * y1) / det
    T, terms = step_us(t_measured, 2, lam, False)
    assert terms["load"] == T, f"the fit assumes the load term binds the 2-stage build: {terms}"
    return lam, F


# ------------------------------------------------------------------------------------- decode
def decode_ms(B, Hq, Hkv, Lk, family, splits, lam_hbm, F, stages=None, D=128, split_kv=False):
    """Decode time of one family: 'sm90' (128-row tile, 128-key stages, 1 CTA per SM) or
    'mma_sync' (the decode kernel: 16-row CTAs, 64-key tiles, 3 CTAs per SM on a 9.0 device);
    split_kv: the sm90 forward's separate K and V rings (a stage held for half the tile's
    products, not all of them)."""
    rows = Hq // Hkv
    if family == "sm90":
        per_sm, tile_keys, st = 1, 128, stages or 3
        compute = 2 * tg_us()  # the whole 128-row tile's products, 4 of its rows useful
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


def fit_decode_lambda(F: float) -> float:
    """The HBM copy latency exposed per tile, from the measured kv-8 decode row (2 stages, 9
    splits planned for 2 CTAs per SM: 288 CTAs, 3 waves)."""
    B, Hq, Hkv, Lk = 4, 32, 8, 131072
    waves, tiles = 3, math.ceil(Lk / 128 / 9)
    t_tile = (MEASURED_DECODE[(B, Hq, Hkv, Lk)] * 1e3 / waves - F) / tiles
    return t_tile - 2 * tg_us()


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
    lam, F = fit(builds["measured"])
    print(f"calibration (2 non-causal rows, 2-stage build): lam = {lam:.3f} us exposed per step, F = {F:.2f} us per CTA; "
          f"T_g = {tg_us():.3f} us")
    print()
    print("| build | executed / key | exps overlapping P V | W (cycles) | P (cycles) | tensor | chain | load | issue | T_step (us) | lam it tolerates (us) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, t in builds.items():
        pinned = t["exps_between"] >= t["exps"] // 2
        st = 2 if name == "measured" else 3
        T, terms = step_us(t, st, lam, pinned)
        held = tg_us() if t["split_kv"] else 2 * tg_us()
        others = max(v for k, v in terms.items() if k != "load")
        pipe = f"{st} + {st} stages, split K/V" if t["split_kv"] else f"{st} stages, coupled K/V"
        print(f"| {name} ({pipe}) | {t['executed'] / 128:.2f} | {t['exps_between']} of {t['exps']} | {t['W']} | {t['P']} | "
              f"{terms['tensor']:.2f} | {terms['chain']:.2f} | {terms['load']:.2f} | {terms['issue']:.2f} | {T:.2f} | "
              f"{others * (st - 1) - held:.2f} |")
    print()
    persistent = ["head, persistent (F per item 8-4 us)"] if "head" in builds else []
    print("| row (bf16, D 128) | measured ms | " + " | ".join(f"{n} ms (TFLOP/s)" for n in [*builds, *persistent]) + " |")
    print("|---|---|" + "---|" * (len(builds) + len(persistent)))
    for key in MEASURED:
        kind, B, H, L, causal = key
        Hkv = 8 if kind == "gqa" else None
        flop = 4 * B * H * L * L * 128 / (2 if causal else 1)
        cells = []
        for name, t in builds.items():
            st = 2 if name == "measured" else 3
            ms = run_ms(kind, B, H, L, causal, t, st, lam, F, t["exps_between"] >= t["exps"] // 2, Hkv)
            cells.append(f"{ms:.3f} ({flop / ms / 1e9:.0f})")
        if "head" in builds:  # the persistent grid: the head build's step with F per item bracketed
            t = builds["head"]
            pin = t["exps_between"] >= t["exps"] // 2
            slow, fast = (run_ms(kind, B, H, L, causal, t, 3, lam, f, pin, Hkv) for f in PERSISTENT_F_US)
            cells.append(f"{fast:.3f}-{slow:.3f} ({flop / slow / 1e9:.0f}-{flop / fast / 1e9:.0f})")
        m = MEASURED[key]
        print(f"| {kind} B{B}H{H}{'kv8' if Hkv else ''} L{L}{' causal' if causal else ''} | {m:.3f} ({flop / m / 1e9:.0f}) | "
              + " | ".join(cells) + " |")
    lam_hbm = fit_decode_lambda(F)
    print()
    print(f"decode calibration (the kv-8 row, 2 stages, 9 splits, 3 waves): HBM latency exposed per tile {lam_hbm:.2f} us")
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
            ms = decode_ms(B, Hq, Hkv, Lk, fam, s, lam_hbm, F, stages=st, split_kv=sp)
            cells.append(f"{nbytes / ms / 1e6:.0f} ({s} splits)")
        print(f"| kv{Hkv} Lk {Lk} | {nbytes / m / 1e6:.0f} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
