"""Render pytest-benchmark JSON into a Markdown report and PNG plots.

Usage::

    python -m benchmarks.report RESULTS.json [MORE.json ...] [--out DIR] [--title TEXT] [--note TEXT]

Writes into DIR (default: the first JSON's folder) ``report.md``, ``tflops.png`` (self-attention
throughput against sequence length, one line per provider) and ``decode.png`` (decode GB/s
against the key length, with the device's measured copy bandwidth as the roof); a plot without
data is not written.

Every figure is shown next to its peer's from the same run as a ratio. The peer of a row is the
fastest of the field's providers (SDPA kernels, flash-attn, xformers) measured in that row;
``x`` numbers are speed relative to it (peer time / provider time: above 1 is faster than the
peer). Rows of the attention suite carry their shape, FLOPs and bytes in ``extra_info`` (see
benchmarks/cases.py). Benchmarks of other suites (the bench_*.py files) are listed per group,
relative to the entry whose ``extra_info["peer"]`` is true, or else to the group's slowest.

Needs only the JSON (and matplotlib for the plots): a report can be rendered on another machine.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import OrderedDict
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

PLOT_FILES = {"self": "tflops.png", "decode": "decode.png"}
FAMILY_TITLES = OrderedDict(
    [
        ("self", "Self-attention (Lq = Lk)"),
        ("cross", "Cross-attention (Lq != Lk)"),
        ("gqa", "Grouped-query attention"),
        ("decode", "Decode (Lq = 1, many query heads per KV head)"),
        ("memorize", "The memorization trainer's attention call"),
    ]
)
MODE_TITLES = {"fwd": "forward", "bwd": "backward", "fwdbwd": "forward+backward"}


class ReportError(Exception):
    """Bad input to the report (named file, what was expected)."""


# ---------------------------------------------------------------------------------------------
# Loading


def load(paths: Sequence[str]) -> Tuple[List[Dict], List[Dict], List[Dict]]:
    """``(machine_infos, attention_records, other_records)`` from pytest-benchmark JSON files.

    A record is the JSON's benchmark entry (``name``, ``group``, ``stats``, ``extra_info``).
    """
    machines, attn, other = [], [], []
    for path in paths:
        try:
            with open(path) as f:
                data = json.load(f)
        except OSError as e:
            raise ReportError(f"{path}: cannot read: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise ReportError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(data, dict) or not isinstance(data.get("benchmarks"), list):
            raise ReportError(f"{path}: not a pytest-benchmark JSON (no 'benchmarks' list); "
                              "write one with pytest --benchmark-json PATH")
        mi = dict(data.get("machine_info") or {})
        mi["_datetime"] = data.get("datetime")
        mi["_commit"] = data.get("commit_info") or {}
        machines.append(mi)
        for b in data["benchmarks"]:
            stats = b.get("stats") or {}
            if not isinstance(stats.get("median"), (int, float)):
                raise ReportError(f"{path}: benchmark {b.get('name')!r} has no stats.median")
            ei = b.get("extra_info") or {}
            (attn if "row" in ei and "provider" in ei else other).append(b)
    return machines, attn, other


# ---------------------------------------------------------------------------------------------
# Figures and peers


def is_bandwidth_row(ei: Dict) -> bool:
    return ei.get("family") == "decode" and ei.get("mode") == "fwd"


def figure(rec: Dict) -> float:
    """TFLOP/s, or GB/s (bytes of q, k, v, out) for decode forward rows."""
    ei, med = rec["extra_info"], rec["stats"]["median"]
    if is_bandwidth_row(ei):
        return ei["io_bytes"] / med / 1e9
    return ei["flops"] / med / 1e12


def group_rows(records: Iterable[Dict]) -> "OrderedDict[str, Dict[str, Dict]]":
    """row id -> provider -> record (the last one wins if a row was measured twice)."""
    rows: "OrderedDict[str, Dict[str, Dict]]" = OrderedDict()
    for r in records:
        rows.setdefault(r["extra_info"]["row"], {})[r["extra_info"]["provider"]] = r
    return rows


def peer_of(row: Dict[str, Dict]) -> Optional[str]:
    """The fastest field provider measured in this row, or None."""
    field = [(r["stats"]["median"], p) for p, r in row.items() if r["extra_info"].get("origin") == "field"]
    return min(field)[1] if field else None


def speed_vs_peer(row: Dict[str, Dict], provider: str) -> Optional[float]:
    peer = peer_of(row)
    if peer is None:
        return None
    return row[peer]["stats"]["median"] / row[provider]["stats"]["median"]


def _fmt(x: float) -> str:
    if x == 0:
        return "0"
    digits = max(0, 2 - int(math.floor(math.log10(abs(x)))))
    return f"{x:.{min(digits, 4)}f}"


def _ratio(x: Optional[float]) -> str:
    return "" if x is None else f"{x:.2f}x"


def _provider_label(rec: Dict) -> str:
    ei = rec["extra_info"]
    p = ei["provider"]
    if p == "mhakern:auto" and ei.get("resolved"):
        return f"{p}->{ei['resolved']}"
    return p


def text_summary(records: Sequence[Dict]) -> List[str]:
    """One line per row: the peer's figure, then every provider's figure and its ratio."""
    lines = []
    for row_id, row in group_rows(records).items():
        peer = peer_of(row)
        unit, div = _unit_for(list(row.values()))
        parts = []
        for p, r in sorted(row.items(), key=lambda kv: kv[1]["stats"]["median"]):
            s = f"{_provider_label(r)} {_fmt(figure(r) / div)} {unit}"
            if p == peer:
                s += " (peer)"
            elif peer is not None:
                s += f" ({_ratio(speed_vs_peer(row, p))})"
            parts.append(s)
        lines.append(f"{row_id}: " + " | ".join(parts))
    return lines


# The field kernels a headline line names one by one (issue: ratios to SDPA's cuDNN and flash
# kernels, and to flash-attn where it imports), besides the row's fastest peer.
HEADLINE_PEERS = ("sdpa:cudnn", "sdpa:flash", "flash-attn", "flash-attn3")


def headline_lines(records: Sequence[Dict]) -> List[str]:
    """Per row, mhakern's providers (fastest first) as ``figure (ratio to the fastest peer)``,
    then each of HEADLINE_PEERS measured in the row with mhakern's fastest provider's speed
    ratio to it: the lines a device check copies into its summary."""
    lines = []
    for row_id, row in group_rows(records).items():
        peer = peer_of(row)
        unit, div = _unit_for(list(row.values()))
        ours = sorted((r["stats"]["median"], p) for p, r in row.items() if r["extra_info"].get("origin") == "mhakern")
        parts = []
        for _, p in ours:
            s = f"{_provider_label(row[p])} {_fmt(figure(row[p]) / div)}"
            if peer is not None:
                s += f" ({_ratio(speed_vs_peer(row, p))})"
            parts.append(s)
        tail = f"peer {peer} {_fmt(figure(row[peer]) / div)} {unit}" if peer else f"no peer measured ({unit})"
        named = []
        for name in HEADLINE_PEERS:
            if name in row and ours:
                best = ours[0][1]
                ratio = row[name]["stats"]["median"] / row[best]["stats"]["median"]
                named.append(f"{name} {_fmt(figure(row[name]) / div)} (mhakern {ratio:.2f}x)")
        if named:
            tail += "; " + ", ".join(named)
        lines.append(f"{row_id}: " + (", ".join(parts) if parts else "no mhakern provider measured") + f"; {tail}")
    return lines


# ---------------------------------------------------------------------------------------------
# Markdown


def _machine_lines(machines: List[Dict]) -> List[str]:
    out = []
    seen = set()
    for mi in machines:
        m = mi.get("mhakern")
        cpu = (mi.get("cpu") or {}).get("brand_raw")
        key = json.dumps(m, sort_keys=True, default=str) if m else cpu
        if key in seen:
            continue
        seen.add(key)
        if not m:
            out.append(f"- Machine: {cpu or mi.get('processor') or 'unknown'} (no mhakern machine info in this JSON)")
            continue
        if m.get("device") == "cuda":
            out.append(
                f"- Machine: **{m.get('gpu_name')}** (compute capability {m.get('gpu_capability')}, "
                f"{m.get('gpu_sms')} SMs, {m.get('gpu_memory_gib')} GiB); host CPU {m.get('cpu_model')}, "
                f"{m.get('cpu_cores')} cores"
            )
        else:
            out.append(
                f"- Machine: **{m.get('cpu_model')}, {m.get('cpu_cores')} cores** "
                f"(torch uses {m.get('torch_threads')} threads), no GPU"
            )
        out.append(
            f"- Software: torch {m.get('torch')}, triton {m.get('triton') or 'not installed'}, "
            f"CUDA {m.get('cuda') or 'none'}, Python {m.get('python')}"
        )
        out.append(
            f"- Measured copy bandwidth (read + write): {_fmt(m.get('copy_bandwidth_gbps', 0))} GB/s; "
            f"benchmark set: `{m.get('bench_set')}`"
        )
        commit = mi.get("_commit") or {}
        when = mi.get("_datetime")
        if commit.get("id") or when:
            dirty = " (with uncommitted changes)" if commit.get("dirty") else ""
            out.append(f"- Run: {when or '?'} at commit {str(commit.get('id', '?'))[:10]}{dirty}")
        be = m.get("backends") or {}
        if be:
            # The first clause of each reason; the full text is in "Providers not measured".
            parts = [f"`{n}` " + ("usable" if why is None else f"unavailable ({why.split(';')[0][:100]})")
                     for n, why in be.items()]
            out.append("- mhakern backends: " + "; ".join(parts))
    return out


def _shape_label(ei: Dict) -> str:
    heads = f"H{ei['H']}" + (f"/kv{ei['Hkv']}" if ei["Hkv"] != ei["H"] else "")
    if ei["family"] in ("decode",):
        e = math.log2(ei["Lk"])
        lk = f"2^{int(e)}" if e == int(e) else str(ei["Lk"])
        return f"Lk={lk} (B{ei['B']} {heads})"
    if ei["Lq"] == ei["Lk"]:
        return f"L={ei['Lq']} (B{ei['B']} {heads})"
    return f"Lq={ei['Lq']} Lk={ei['Lk']} (B{ei['B']} {heads})"


def _table_key(ei: Dict) -> Tuple:
    return (ei["family"], ei["mode"], ei["dtype"], ei["D"], bool(ei["causal"]))


def _provider_order(names: Iterable[str]) -> List[str]:
    def key(n):
        return (0 if n.startswith("mhakern:") and n != "mhakern:reference" else 1 if n == "mhakern:reference" else 2, n)

    return sorted(set(names), key=key)


def _unit_for(records: List[Dict]) -> Tuple[str, float]:
    """(unit, divisor applied to TFLOP/s) so that the figures of a table read well."""
    if any(is_bandwidth_row(r["extra_info"]) for r in records):
        return "GB/s", 1.0
    top = max(figure(r) for r in records)
    return ("TFLOP/s", 1.0) if top >= 1.0 else ("GFLOP/s", 1e-3)


def attention_tables(records: List[Dict]) -> List[str]:
    """Markdown tables: one per (family, mode, dtype, D, causal), a row per shape, a column per
    provider; each cell ``figure (speed vs peer)``, the peer's cell in bold."""
    out: List[str] = []
    rows = group_rows(records)
    tables: "OrderedDict[Tuple, List[str]]" = OrderedDict()
    for row_id, row in rows.items():
        ei = next(iter(row.values()))["extra_info"]
        tables.setdefault(_table_key(ei), []).append(row_id)
    for fam, title in FAMILY_TITLES.items():
        keys = [k for k in tables if k[0] == fam]
        if not keys:
            continue
        out.append(f"## {title}")
        out.append("")
        if fam in PLOT_FILES:
            out.append(f"![{title}]({PLOT_FILES[fam]})")
            out.append("")
        for key in sorted(keys, key=lambda k: (list(MODE_TITLES).index(k[1]), k[2], k[3], k[4])):
            _, mode, dtype, D, causal = key
            row_ids = sorted(tables[key], key=lambda r: (next(iter(rows[r].values()))["extra_info"]["Lq"],
                                                         next(iter(rows[r].values()))["extra_info"]["Lk"]))
            recs = [r for rid in row_ids for r in rows[rid].values()]
            unit, div = _unit_for(recs)
            provs = _provider_order(r["extra_info"]["provider"] for r in recs)
            note = " (% of the measured copy bandwidth)" if unit == "GB/s" else ""
            out.append(
                f"### {MODE_TITLES[mode]}, {dtype}, D={D}{', causal' if causal else ''} -- {unit}{note}; "
                "(x) = speed relative to the row's peer (**bold**)"
            )
            out.append("")
            out.append("| shape | " + " | ".join(provs) + " |")
            out.append("|---|" + "---|" * len(provs))
            for rid in row_ids:
                row = rows[rid]
                peer = peer_of(row)
                cells = []
                for p in provs:
                    r = row.get(p)
                    if r is None:
                        cells.append("--")
                        continue
                    val = figure(r) / div
                    s = _fmt(val)
                    extra = []
                    if unit == "GB/s" and r["extra_info"].get("copy_bandwidth_gbps"):
                        pct = 100 * figure(r) / r["extra_info"]["copy_bandwidth_gbps"]
                        extra.append(f"{pct:.1f}%" if pct < 10 else f"{pct:.0f}%")
                    if p == peer:
                        s = f"**{s}**"
                    elif peer is not None:
                        extra.insert(0, _ratio(speed_vs_peer(row, p)))
                    if p == "mhakern:auto" and r["extra_info"].get("resolved"):
                        extra.append(f"->{r['extra_info']['resolved']}")
                    cells.append(s + (f" ({', '.join(extra)})" if extra else ""))
                ei = next(iter(row.values()))["extra_info"]
                out.append(f"| {_shape_label(ei)} | " + " | ".join(cells) + " |")
            out.append("")
    return out


def _geomean(xs: List[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def glance_table(records: List[Dict]) -> List[str]:
    """Geometric mean over rows of each provider's speed relative to the row's peer."""
    rows = group_rows(records)
    acc: Dict[Tuple[str, str, str], List[float]] = {}
    for row in rows.values():
        for p in row:
            x = speed_vs_peer(row, p)
            if x is None:
                continue
            ei = row[p]["extra_info"]
            acc.setdefault((p, ei["family"], ei["mode"]), []).append(x)
    if not acc:
        return ["No row had a field provider to compare with."]
    cols = [(f, m) for f in FAMILY_TITLES for m in MODE_TITLES if any(k[1] == f and k[2] == m for k in acc)]
    provs = _provider_order(k[0] for k in acc)
    out = [
        "Geometric mean over the rows of each provider's speed relative to the row's peer "
        "(the fastest field provider of the row; above 1 = faster), with the number of rows.",
        "",
        "| provider | " + " | ".join(f"{f} {MODE_TITLES[m]}" for f, m in cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for p in provs:
        cells = []
        for f, m in cols:
            xs = acc.get((p, f, m))
            cells.append(f"{_geomean(xs):.2f}x ({len(xs)})" if xs else "--")
        out.append(f"| {p} | " + " | ".join(cells) + " |")
    return out


def details_table(records: List[Dict]) -> List[str]:
    """Every measurement: median, spread, rounds, peak memory and its ratio to the peer's."""
    out = [
        "| row | provider | median ms | IQR ms | rounds | figure | speed vs peer | peak MiB | memory vs peer |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row_id, row in group_rows(records).items():
        peer = peer_of(row)
        unit, div = _unit_for(list(row.values()))
        for p in sorted(row, key=lambda n: row[n]["stats"]["median"]):
            r = row[p]
            st, ei = r["stats"], r["extra_info"]
            mem = ei.get("peak_bytes")
            pmem = row[peer]["extra_info"].get("peak_bytes") if peer else None
            mem_s = "n/a" if mem is None else f"{mem / 2**20:.1f}"
            if p == peer:
                memr, spd = "peer", "peer"
            else:
                # A ratio to a peer that needed (next to) nothing says nothing.
                memr = f"{mem / pmem:.2f}x" if mem is not None and pmem and pmem >= 2**20 else ""
                spd = _ratio(speed_vs_peer(row, p))
            iqr = st.get("iqr")
            out.append(
                f"| {row_id} | {_provider_label(r)} | {st['median'] * 1e3:.3f} | "
                f"{'' if iqr is None else f'{iqr * 1e3:.3f}'} | {st.get('rounds', '')} | "
                f"{_fmt(figure(r) / div)} {unit} | {spd} | {mem_s} | {memr} |"
            )
    return out


def _other_group(b: Dict) -> str:
    return b.get("group") or b.get("name", "?").split("[")[0]


def _per_item(b: Dict) -> Tuple[float, str]:
    """(seconds per item, item name): a timed call may do several steps (``extra_info`` says how
    many as ``steps_per_round`` or ``items_per_call``), and only per-item times compare."""
    ei = b.get("extra_info") or {}
    for key, item in (("steps_per_round", "step"), ("items_per_call", "item")):
        n = ei.get(key)
        if isinstance(n, (int, float)) and n > 0:
            return b["stats"]["median"] / n, item
    return b["stats"]["median"], "call"


def other_tables(records: List[Dict]) -> List[str]:
    """The other suites' benchmarks, per group, relative to their marked peer or slowest entry."""
    groups: "OrderedDict[str, List[Dict]]" = OrderedDict()
    for b in records:
        groups.setdefault(_other_group(b), []).append(b)
    out = []
    for g, bs in groups.items():
        peers = [b for b in bs if (b.get("extra_info") or {}).get("peer")]
        ref = peers[0] if peers else max(bs, key=lambda b: _per_item(b)[0])
        how = "its peer" if peers else "the group's slowest"
        out += [f"### {g}", "", f"Speed relative to {how}: `{ref['name']}` (per item: a step where the suite says so).", ""]
        out += ["| benchmark | median ms per item | item | items/s | rounds | speed | extra |",
                "|---|---|---|---|---|---|---|"]
        t_ref = _per_item(ref)[0]
        for b in sorted(bs, key=lambda b: _per_item(b)[0]):
            t, item = _per_item(b)
            extra = ", ".join(
                f"{k}={_fmt(v) if isinstance(v, float) else v}" for k, v in (b.get("extra_info") or {}).items() if k != "peer"
            )
            out.append(
                f"| {b['name']} | {t * 1e3:.3f} | {item} | {1 / t:.1f} | {b['stats'].get('rounds', '')} | "
                f"{t_ref / t:.2f}x | {extra} |"
            )
        out.append("")
    return out


def skipped_lines(machines: List[Dict]) -> List[str]:
    out = []
    for mi in machines:
        for prov, reasons in ((mi.get("mhakern") or {}).get("skipped") or {}).items():
            for why, n in reasons.items():
                out.append(f"- `{prov}` ({n} row{'s' if n != 1 else ''}): {why}")
    return out


def render_markdown(machines, attn, other, plots: Dict[str, str], title: Optional[str] = None,
                    note: Optional[str] = None) -> str:
    dev = next((m["mhakern"].get("device_name") for m in machines if m.get("mhakern")), None)
    lines = [f"# {title or 'mhakern benchmarks' + (f' -- {dev}' if dev else '')}", ""]
    if note:
        lines += [note, ""]
    lines += _machine_lines(machines)
    lines += [
        "",
        "Timing: pytest-benchmark, warm-up first, rounds sized from the warm-up, medians; a CUDA "
        "synchronise ends every timed call. TFLOP/s by FlashAttention's convention (forward "
        "4 B H Lq Lk D, halved for causal Lq = Lk, backward 2.5x the forward); decode GB/s count "
        "the bytes of q, k, v and out. Shared machines are noisy: read the ratios, which compare "
        "figures of one run.",
        "",
    ]
    if attn:
        lines += ["## At a glance", ""] + glance_table(attn) + [""]
        missing = [f for f in PLOT_FILES if f not in plots and any(r["extra_info"]["family"] == f for r in attn)]
        for f in missing:
            lines += [f"(plot {PLOT_FILES[f]} not drawn: matplotlib unavailable)", ""]
        lines += attention_tables(attn)
        lines += ["## All measurements", ""] + details_table(attn) + [""]
    if other:
        lines += ["## Other suites", ""] + other_tables(other)
    sk = skipped_lines(machines)
    if sk:
        lines += ["## Providers not measured, and why", ""] + sk + [""]
    if not attn and not other:
        lines += ["No benchmarks in the input.", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Plots

_MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h", "p"]


def _series_style(providers: List[str]) -> Dict[str, Dict]:
    """A fixed colour and marker per provider, so that a provider looks the same in every panel."""
    import matplotlib

    colors = matplotlib.colormaps["tab10"].colors
    return {p: {"marker": _MARKERS[i % len(_MARKERS)], "color": colors[i % len(colors)], "linestyle": "-"}
            for i, p in enumerate(providers)}


def plot_self(records: List[Dict], path: str) -> bool:
    """TFLOP/s against sequence length: a panel per (dtype, D, causal, mode) measured, a line per
    provider (same marker for a provider in every panel)."""
    recs = [r for r in records if r["extra_info"]["family"] == "self"]
    if not recs:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def pkey(ei):
        return (ei["dtype"], ei["D"], bool(ei["causal"]), list(MODE_TITLES).index(ei["mode"]))

    unit, div = _unit_for(recs)
    panels = sorted({pkey(r["extra_info"]) for r in recs})
    provs = _provider_order(r["extra_info"]["provider"] for r in recs)
    style = _series_style(provs)
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.3 * nrows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, pk in zip(axes.flat, panels):
        dtype, D, causal, mode_i = pk
        sel = [r for r in recs if pkey(r["extra_info"]) == pk]
        for p in provs:
            pts = sorted((r["extra_info"]["Lq"], figure(r) / div) for r in sel if r["extra_info"]["provider"] == p)
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], label=p, markersize=4, **style[p])
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_title(f"{list(MODE_TITLES.values())[mode_i]}, {dtype}, D={D}{', causal' if causal else ''}", fontsize=9)
        ax.set_xlabel("sequence length L", fontsize=8)
        ax.set_ylabel(unit, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, alpha=0.3)
    seen = {}
    for ax in axes.flat:
        for h, l in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(l, h)
    labels = [p for p in provs if p in seen]
    fig.legend([seen[p] for p in labels], labels, loc="upper center", ncol=min(6, len(labels)), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.4 / (3.3 * nrows)))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def plot_decode(records: List[Dict], path: str) -> bool:
    """Decode GB/s against Lk, a panel per (dtype, B, H, Hkv, D), the copy bandwidth dashed."""
    recs = [r for r in records if is_bandwidth_row(r["extra_info"])]
    if not recs:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def pkey(ei):
        return (ei["dtype"], ei["B"], ei["H"], ei["Hkv"], ei["D"])

    panels = sorted({pkey(r["extra_info"]) for r in recs})
    provs = _provider_order(r["extra_info"]["provider"] for r in recs)
    style = _series_style(provs)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.8), squeeze=False)
    for ax, pk in zip(axes[0], panels):
        sel = [r for r in recs if pkey(r["extra_info"]) == pk]
        for p in provs:
            pts = sorted((r["extra_info"]["Lk"], figure(r)) for r in sel if r["extra_info"]["provider"] == p)
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], label=p, markersize=4, **style[p])
        bw = [r["extra_info"].get("copy_bandwidth_gbps") for r in sel if r["extra_info"].get("copy_bandwidth_gbps")]
        if bw:
            ax.axhline(bw[0], linestyle="--", color="gray", label="copy bandwidth")
        dtype, B, H, Hkv, D = pk
        ax.set_xscale("log", base=2)
        # Log scale: the copy bandwidth roof and slow providers an order of magnitude below it.
        ax.set_yscale("log")
        ax.set_title(f"decode {dtype}, B={B} H={H} Hkv={Hkv} D={D}", fontsize=9)
        ax.set_xlabel("key length Lk", fontsize=8)
        ax.set_ylabel("GB/s (q, k, v, out)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------------------
# Entry point


def write_report(paths: Sequence[str], out_dir: str, title: Optional[str] = None,
                 note: Optional[str] = None) -> Dict[str, str]:
    """Render the report; returns {"report": path, "self": png, "decode": png} for what was written."""
    machines, attn, other = load(paths)
    os.makedirs(out_dir, exist_ok=True)
    written: Dict[str, str] = {}
    try:
        import matplotlib  # noqa: F401

        have_mpl = True
    except ImportError:
        have_mpl = False
    if have_mpl:
        for fam, fname in PLOT_FILES.items():
            p = os.path.join(out_dir, fname)
            ok = plot_self(attn, p) if fam == "self" else plot_decode(attn, p)
            if ok:
                written[fam] = p
    md = render_markdown(machines, attn, other, dict(written), title, note)
    rp = os.path.join(out_dir, "report.md")
    with open(rp, "w") as f:
        f.write(md + "\n")
    written["report"] = rp
    return written


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.report",
        description="pytest-benchmark JSON -> Markdown report and PNG plots (see benchmarks/README.md)",
    )
    ap.add_argument("json", nargs="+", help="pytest-benchmark JSON file(s) (pytest --benchmark-json PATH)")
    ap.add_argument("--out", help="output folder (default: the first JSON's folder)")
    ap.add_argument("--title", help="report title (default: names the machine)")
    ap.add_argument("--note", help="a paragraph under the title (e.g. how loaded the machine was)")
    ap.add_argument("--print", dest="show", action="store_true", help="also print every row's figures and ratios")
    ap.add_argument("--headline", action="store_true",
                    help="also print one line per row: mhakern's figures and ratios, then the peer's (prefixed 'headline: ')")
    args = ap.parse_args(argv)
    out_dir = args.out or os.path.dirname(os.path.abspath(args.json[0]))
    try:
        written = write_report(args.json, out_dir, args.title, args.note)
    except ReportError as e:
        print(f"benchmarks.report: {e}", file=sys.stderr)
        return 2
    if args.show or args.headline:
        _, attn, _ = load(args.json)
        if args.show:
            for line in text_summary(attn):
                print(line)
        if args.headline:
            for line in headline_lines(attn):
                print(f"headline: {line}")
    for k in ("report", "self", "decode"):
        if k in written:
            print(f"wrote {written[k]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
