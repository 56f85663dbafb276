"""Each measured row of the device check beside the performance model's prediction for it.

    python -m benchmarks.device_predict BENCH.json [DIAG.jsonl] [--append REPORT.md]

Prints (and appends to REPORT.md) a table: for mhakern's cuda rows that tools/perf_model.py
models -- the bf16 forward at D 128 (self and GQA rows) and decode -- the measured figure, the
model's range and whether the measurement falls inside it. The assumptions are named under the
table, and they are the model's: the forward's step is its tensor term (``2 tg_us()``: both
warpgroups' S and P V at one SM's share of the matmul rate; the term that binds every 3-stage
build, docs/performance.md), summed over each work item's key tiles (``ctas_and_tiles``) plus a
fixed cost per work item (``PERSISTENT_F_US``), over the SMs (``run_ms``'s sum); the products
run at 83% (FlashAttention-3's measured fraction of cuBLAS at D 128) to 100% of the matmul rate
this run measured (diag.jsonl's ceilings; else the model's ``MATMUL_TFLOPS``). Decode:
``decode_ms`` with the planner's split count (``planner_splits``), the exposed HBM latency left
out (an upper bound) and the same fixed-cost bracket. A function of perf_model that returns a
(low, high) pair instead of one figure is read as that range. The forward+backward rows have no
model unless perf_model has the fused sm_90a backward's (``bwd_ms``: its provider's rows), and
say so.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
FA3_FRACTION = 0.83  # FlashAttention-3's products against cuBLAS at D 128 (the conservative end)
PROVIDERS = ("mhakern:cuda", "mhakern:auto")
FUSED_BWD = "mhakern:cuda[sm90 fused bwd]"  # the backward the model has (bwd_ms), on the fwdbwd rows


def _model():
    spec = importlib.util.spec_from_file_location("perf_model", ROOT / "tools" / "perf_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _span(x) -> Tuple[float, float]:
    """A figure or a (low, high) pair as (low, high)."""
    if isinstance(x, (tuple, list)):
        return float(min(x)), float(max(x))
    return float(x), float(x)


def fractions(pm, pass_: str) -> Tuple[float, float]:
    """(optimistic, conservative) fraction of the matmul rate the products reach: the model's
    RATES where it has them, else 100% and FlashAttention-3's 83%."""
    rates = getattr(pm, "RATES", None)
    if rates:
        return rates["optimistic"][pass_], rates["conservative"][pass_]
    return 1.0, FA3_FRACTION


def forward_ms(pm, kind: str, B: int, H: int, Hkv: int, L: int, causal: bool, rate: float) -> Tuple[float, float]:
    """(fastest, slowest) ms of the forward by the model's tensor term at ``rate`` TFLOP/s."""
    out = []
    fast, slow = fractions(pm, "fwd")
    for frac, f_us in ((fast, min(pm.PERSISTENT_F_US)), (slow, max(pm.PERSISTENT_F_US))):
        lo, hi = _span(pm.tg_us())
        tg = (hi if frac < fast else lo) * pm.MATMUL_TFLOPS / (rate * frac)
        work = sum(n * (tiles * 2 * tg + f_us) for n, tiles in pm.ctas_and_tiles(kind, B, H, L, causal,
                                                                                  Hkv if Hkv != H else None))
        out.append(work / pm.SMS / 1e3)
    return out[0], out[1]


def decode_ms(pm, B: int, Hq: int, Hkv: int, Lk: int) -> Tuple[float, float]:
    splits = pm.planner_splits(B, Hkv, Hq // Hkv, Lk, "sm90")
    times = []
    for f_us in pm.PERSISTENT_F_US:
        times += _span(pm.decode_ms(B, Hq, Hkv, Lk, "sm90", splits, 0.0, f_us, stages=3, split_kv=True))
    return min(times), max(times)


def fwdbwd_ms(pm, B: int, H: int, L: int, causal: bool, rate: float) -> Optional[Tuple[float, float]]:
    """(fastest, slowest) ms of forward + the fused sm_90a backward, where the model has a
    backward (``bwd_ms``), else None."""
    if not hasattr(pm, "bwd_ms"):
        return None
    f_fast, f_slow = forward_ms(pm, "self", B, H, H, L, causal, rate)
    b_fast, b_slow = fractions(pm, "bwd")
    scale = rate / pm.MATMUL_TFLOPS  # bwd_ms's fraction is of the model's matmul rate
    lo = _span(pm.bwd_ms(B, H, L, causal, b_fast * scale, 0))[0]
    hi = _span(pm.bwd_ms(B, H, L, causal, b_slow * scale, 1))[1]
    return f_fast + lo, f_slow + hi


def rows(bench: Dict, rate: float, pm) -> List[str]:
    out = []
    for b in bench.get("benchmarks", []):
        ei = b.get("extra_info") or {}
        if ei.get("provider") not in PROVIDERS + (FUSED_BWD,) or ei.get("dtype") != "bf16" or ei.get("D") != 128:
            continue
        if (ei["provider"] == FUSED_BWD) != (ei.get("mode") == "fwdbwd"):
            continue  # the fused backward's provider on its backward rows only; the others on the rest
        med = b["stats"]["median"]
        fam, mode = ei.get("family"), ei.get("mode")
        label = f"{ei['row']} ({ei['provider']})"
        if fam in ("self", "gqa") and mode == "fwd" and ei["Lq"] == ei["Lk"]:
            fast, slow = forward_ms(pm, fam, ei["B"], ei["H"], ei["Hkv"], ei["Lq"], ei["causal"], rate)
            got, lo, hi, unit = ei["flops"] / med / 1e12, ei["flops"] / slow / 1e9, ei["flops"] / fast / 1e9, "TFLOP/s"
        elif fam == "decode" and mode == "fwd":
            fast, slow = decode_ms(pm, ei["B"], ei["H"], ei["Hkv"], ei["Lk"])
            kv = 2 * ei["B"] * ei["Hkv"] * ei["Lk"] * ei["D"] * 2
            got, lo, hi, unit = kv / med / 1e9, kv / slow / 1e6, kv / fast / 1e6, "GB/s of K/V"
        elif fam == "self" and mode == "fwdbwd" and ei["provider"] == FUSED_BWD and \
                fwdbwd_ms(pm, ei["B"], ei["H"], ei["Lq"], ei["causal"], rate) is not None:
            fast, slow = fwdbwd_ms(pm, ei["B"], ei["H"], ei["Lq"], ei["causal"], rate)
            got, lo, hi, unit = ei["flops"] / med / 1e12, ei["flops"] / slow / 1e9, ei["flops"] / fast / 1e9, "TFLOP/s"
        else:
            out.append(f"| {label} | {ei['flops'] / med / 1e12:.0f} TFLOP/s | not modelled | - |")
            continue
        inside = "inside" if lo <= got <= hi else ("below" if got < lo else "above")
        out.append(f"| {label} | {got:.0f} {unit} | {lo:.0f}-{hi:.0f} | {inside} |")
    return out


def measured_rate(diag: Optional[Path], pm) -> Tuple[float, str]:
    if diag is not None and diag.exists():
        for ln in reversed(diag.read_text().splitlines()):
            try:
                r = json.loads(ln)
            except ValueError:
                continue
            if r.get("stage") == "ceilings" and r.get("matmul_tflops"):
                return float(r["matmul_tflops"]), "measured in this run"
    return float(pm.MATMUL_TFLOPS), "the model's (the last H200 run's), not measured in this run"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench")
    ap.add_argument("diag", nargs="?")
    ap.add_argument("--append", help="append the section to this Markdown file")
    args = ap.parse_args(argv)
    pm = _model()
    bench = json.loads(Path(args.bench).read_text())
    rate, rate_src = measured_rate(Path(args.diag) if args.diag else None, pm)
    body = rows(bench, rate, pm)
    text = "\n".join([
        "", "## Measured against the model (tools/perf_model.py)", "",
        "| row (provider) | measured | model's range | |", "|---|---|---|---|", *body, "",
        f"Assumptions: the forward step is the tensor term (both warpgroups' S and P V) at "
        f"{100 * fractions(pm, 'fwd')[1]:.0f}-{100 * fractions(pm, 'fwd')[0]:.0f}% of "
        f"the matmul rate {rate:.0f} TFLOP/s ({rate_src}), plus {min(pm.PERSISTENT_F_US):g}-{max(pm.PERSISTENT_F_US):g} us "
        f"per work item of the persistent grid, over {pm.SMS} SMs; the model has no L2 term and no chain or issue term "
        "binding at 3 stages. Decode: the sm90 forward's planned splits, 3 + 3 stages of separate K/V rings, the copy "
        f"rate {pm.COPY_TBS} TB/s, no exposed HBM latency (an upper bound). Forward + backward (the fused sm_90a "
        f"backward's rows, where the model has bwd_ms): the forward's range plus bwd_ms at its fast and slow "
        f"assumptions and {100 * fractions(pm, 'bwd')[1]:.0f}-{100 * fractions(pm, 'bwd')[0]:.0f}% of the rate. "
        "docs/performance.md derives each term.", ""])
    print(text)
    if args.append:
        with open(args.append, "a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
