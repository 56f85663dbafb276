"""Benchmark rows: shapes, the sets they belong to, and the work each one counts.

A :class:`Case` is one row of the report: every provider of a row runs on the same inputs
(:func:`make_inputs` is deterministic in the row's input shape, so even separate processes see
identical tensors). Shapes follow mhakern's contract: q (B, H, Lq, D), k and v (B, Hkv, Lk, D).

Sets:

* ``cpu``  -- sized for a 2-core machine (the whole set well under 15 minutes there):
  self-attention L 512..4096 at a fixed token count B*L = 4096 and H*D = 128 (FlashAttention's
  convention of constant work per L step, scaled down), fp32 and bf16, D 64 and 128, causal
  and not (all three modes for fp32 D=64, fewer elsewhere); cross-attention (Lq != Lk), GQA, decode (Lq = 1, 8 query heads sharing one KV head,
  Lk up to 2^20) and the memorization trainer's attention call.
* ``gpu``  -- self-attention L 512..16384 with B*L = 16384 and H*D = 2048, fp16 and bf16, and
  the same families at GPU sizes.
* ``headline`` -- the few rows of the device set that the device check runs.

FLOPs follow FlashAttention's convention: forward ``4 B H Lq Lk D`` (H = query heads), halved
for causal self-attention (Lq = Lk); for causal rows with Lq != Lk the exact fraction of visible
(query, key) pairs under mhakern's bottom-right alignment is used instead of one half. Backward
counts 2.5x the forward, forward+backward 3.5x.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
MODES = ("fwd", "bwd", "fwdbwd")
MODE_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}
FAMILIES = ("self", "cross", "gqa", "decode", "memorize")
SETS = ("cpu", "gpu", "headline-cpu", "headline-gpu")


@dataclass(frozen=True)
class Case:
    """One benchmark row (every provider of the row shares its inputs)."""

    family: str  # one of FAMILIES
    mode: str  # one of MODES
    dtype: str  # key of DTYPE_BYTES
    B: int
    H: int
    Hkv: int
    Lq: int
    Lk: int
    D: int
    causal: bool
    headline: bool = False

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family: expected one of {FAMILIES}, got {self.family!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {self.mode!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype: expected one of {tuple(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.H % self.Hkv:
            raise ValueError(f"Hkv: must divide H={self.H}, got {self.Hkv}")

    @property
    def shape_id(self) -> str:
        s = f"B{self.B}H{self.H}"
        if self.Hkv != self.H:
            s += f"kv{self.Hkv}"
        s += f"-L{self.Lq}" if self.Lq == self.Lk else f"-q{self.Lq}k{self.Lk}"
        return s + f"-d{self.D}"

    @property
    def id(self) -> str:
        """Row name, e.g. ``self-fwd-bf16-B8H16-L2048-d128-causal``."""
        return f"{self.family}-{self.mode}-{self.dtype}-{self.shape_id}" + ("-causal" if self.causal else "")

    @property
    def input_key(self) -> Tuple:
        """What the inputs depend on (mode and masking do not change them)."""
        return (self.dtype, self.B, self.H, self.Hkv, self.Lq, self.Lk, self.D)

    def visible_fraction(self) -> float:
        """Fraction of (query, key) pairs the computation counts (FlashAttention's convention)."""
        if not self.causal:
            return 1.0
        if self.Lq == self.Lk:
            return 0.5
        # Bottom-right causal: query i sees keys j <= i + Lk - Lq.
        off = self.Lk - self.Lq
        pairs = sum(min(self.Lk, max(0, i + off + 1)) for i in range(self.Lq))
        return pairs / (self.Lq * self.Lk)

    def flops(self) -> float:
        """FLOPs of the timed call: 4 B H Lq Lk D x visible fraction x mode factor."""
        fwd = 4.0 * self.B * self.H * self.Lq * self.Lk * self.D * self.visible_fraction()
        return fwd * MODE_FACTOR[self.mode]

    def io_bytes(self) -> int:
        """Bytes of q, k, v and out: the minimum a forward must move (used for decode GB/s)."""
        n = self.B * (2 * self.H * self.Lq * self.D + 2 * self.Hkv * self.Lk * self.D)
        return n * DTYPE_BYTES[self.dtype]

    def score_elements(self) -> int:
        """Entries of the (B, H, Lq, Lk) score matrix a materialising implementation builds."""
        return self.B * self.H * self.Lq * self.Lk

    def materialised_bytes(self) -> int:
        """Rough working set of a materialising implementation (fp32 work): a few score-sized
        matrices plus K and V expanded to every query head (GQA)."""
        kv = 0 if self.H == self.Hkv else 2 * self.B * self.H * self.Lk * self.D
        mats = 3 if self.mode == "fwd" else 5
        return 4 * (mats * self.score_elements() + kv)

    def as_info(self) -> Dict:
        """The fields the report reads back from pytest-benchmark's extra_info."""
        return {
            "row": self.id,
            "family": self.family,
            "mode": self.mode,
            "dtype": self.dtype,
            "B": self.B,
            "H": self.H,
            "Hkv": self.Hkv,
            "Lq": self.Lq,
            "Lk": self.Lk,
            "D": self.D,
            "causal": self.causal,
            "flops": self.flops(),
            "io_bytes": self.io_bytes(),
        }


def _self_rows(tokens: int, hd: int, lengths, dims, dtypes, modes_for, headline) -> List[Case]:
    rows = []
    for dtype in dtypes:
        for D in dims:
            for causal in (False, True):
                for mode in modes_for(dtype, D):
                    for L in lengths:
                        B, H = max(1, tokens // L), max(1, hd // D)
                        rows.append(
                            Case("self", mode, dtype, B, H, H, L, L, D, causal, headline(dtype, D, L, mode))
                        )
    return rows


def cpu_cases() -> List[Case]:
    def head(dtype, D, L, mode):
        return dtype == "fp32" and D == 64 and L in (1024, 4096) and mode in ("fwd", "fwdbwd")

    def modes(dtype, D):
        # The full fp32 D=64 grid; elsewhere fewer modes: SDPA's CPU flash backward runs at a few
        # GFLOP/s in bf16 and would take most of the 15-minute budget on its own.
        if dtype == "fp32":
            return MODES if D == 64 else ("fwd", "fwdbwd")
        return ("fwd", "fwdbwd") if D == 64 else ("fwd",)

    rows = _self_rows(4096, 128, (512, 1024, 2048, 4096), (64, 128), ("fp32", "bf16"), modes, head)
    for Lq, Lk in ((512, 4096), (4096, 512)):
        for causal in (False, True):
            for mode in ("fwd", "fwdbwd"):
                rows.append(Case("cross", mode, "fp32", 1, 2, 2, Lq, Lk, 64, causal))
    for L in (1024, 4096):
        for mode in ("fwd", "fwdbwd"):
            rows.append(Case("gqa", mode, "fp32", 1, 8, 2, L, L, 64, True))
    # bf16 stops at 2^16: SDPA's CPU flash kernel takes seconds per call at 2^20 (it reads K and V
    # once per query head), which the fp32 rows already show.
    for dtype, exps in (("fp32", (12, 14, 16, 18, 20)), ("bf16", (12, 14, 16))):
        for e in exps:
            rows.append(Case("decode", "fwd", dtype, 1, 8, 1, 1, 1 << e, 128, False,
                             dtype == "fp32" and e in (12, 16, 20)))
    for mode in ("fwd", "fwdbwd"):
        rows.append(Case("memorize", mode, "fp32", 256, 20, 1, 1, 32, 64, False, mode == "fwdbwd"))
    return rows


def gpu_cases() -> List[Case]:
    def head(dtype, D, L, mode):
        return dtype == "bf16" and D == 128 and L in (4096, 16384) and mode in ("fwd", "fwdbwd")

    def modes(dtype, D):
        return MODES if dtype == "bf16" else ("fwd", "fwdbwd")

    rows = _self_rows(16384, 2048, (512, 1024, 2048, 4096, 8192, 16384), (64, 128), ("bf16", "fp16"), modes, head)
    for Lq, Lk in ((1024, 16384), (16384, 1024)):
        for causal in (False, True):
            for mode in ("fwd", "fwdbwd"):
                rows.append(Case("cross", mode, "bf16", 2, 16, 16, Lq, Lk, 128, causal))
    for L in (4096, 16384):
        for mode in ("fwd", "fwdbwd"):
            rows.append(Case("gqa", mode, "bf16", 1, 32, 8, L, L, 128, True, L == 16384 and mode == "fwd"))
    for dtype in ("bf16", "fp16"):
        for e in (12, 14, 16, 18, 20):
            rows.append(Case("decode", "fwd", dtype, 4, 32, 4, 1, 1 << e, 128, False,
                             dtype == "bf16" and e in (12, 16, 20)))
    # The decode target of the GPU issue: 32 query heads over 8 KV heads, 128k keys, bf16.
    rows.append(Case("decode", "fwd", "bf16", 4, 32, 8, 1, 1 << 17, 128, False, True))
    for dtype in ("fp32", "bf16"):
        for mode in ("fwd", "fwdbwd"):
            rows.append(Case("memorize", mode, dtype, 256, 20, 1, 1, 32, 64, False,
                             dtype == "fp32" and mode == "fwdbwd"))
    return rows


def cases_for(set_name: str) -> List[Case]:
    """The rows of a named set (see the module docstring)."""
    if set_name == "cpu":
        return cpu_cases()
    if set_name == "gpu":
        return gpu_cases()
    if set_name == "headline-cpu":
        return [c for c in cpu_cases() if c.headline]
    if set_name == "headline-gpu":
        return [c for c in gpu_cases() if c.headline]
    raise ValueError(f"--bench-set: expected one of {SETS} (or auto / headline), got {set_name!r}")


def make_inputs(case: Case, device: str):
    """q, k, v (B, H[kv], L, D) contiguous and dout (B, H, Lq, D), in the row's dtype.

    Seeded from the input shape alone, so every provider of a row sees the same values.
    Standard normal entries, as in FlashAttention's benchmarks.
    """
    import torch

    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[case.dtype]
    # Python's str hash is salted per process: derive the seed from a stable rendering.
    seed = sum((i + 1) * ord(ch) for i, ch in enumerate(repr(case.input_key))) % (2**31)
    g = torch.Generator(device=device).manual_seed(seed)

    def mk(*shape):
        return torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dt)

    q = mk(case.B, case.H, case.Lq, case.D)
    k = mk(case.B, case.Hkv, case.Lk, case.D)
    v = mk(case.B, case.Hkv, case.Lk, case.D)
    dout = mk(case.B, case.H, case.Lq, case.D)
    return q, k, v, dout
