"""Host-side helpers the Triton launchers share: precision, 64-bit offsets, the device's arch
and multiprocessors, launch geometry, output-buffer checks and the modes' launch arguments
(``ModeArgs``, from the call's record)."""
from __future__ import annotations

import contextlib
import math
import os

import torch
import triton

from ._modes_generated import PLAIN as _PLAIN  # the plain call's record, from the mode table
from .heuristics import packed_rows, row_block


# Whether Triton runs in interpreter mode: read here, before any kernel module defines its
# kernels, which is when Triton reads the switch.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def precision(dtype: torch.dtype) -> str:
    """fp32 inputs multiply in full fp32 ("ieee"), never silently in tf32: exactness first."""
    return "ieee" if dtype == torch.float32 else "tf32"


MAX_PROGRAMS = 2**31 - 1  # CUDA's limit on grid axis 0, which carries every launch here


def needs_64bit_offsets(*tensors) -> bool:
    """Whether some tensor's batch element spans 2**31 elements or more, so that offsets inside
    one batch element (what the kernels compute per row) need 64 bits."""
    for t in tensors:
        if t.dim() and sum((n - 1) * abs(st) for n, st in zip(t.shape[1:], t.stride()[1:]) if n > 0) >= 2**31 - 1:
            return True
    return False


_ARCH = {}
_SMS = {}


def num_sms_of(t: torch.Tensor) -> int:
    """Multiprocessors of ``t``'s device, cached; 0 off CUDA (nothing to fill)."""
    if t.device.type != "cuda":
        return 0
    idx = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def arch_of(t: torch.Tensor) -> int:
    """Compute capability of ``t``'s device as an int (90 for sm_90), cached; 80 off CUDA (the
    interpreter), which only picks the tile table's row."""
    if t.device.type != "cuda":
        return 80
    idx = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if idx not in _ARCH:
        major, minor = torch.cuda.get_device_capability(idx)
        _ARCH[idx] = 10 * major + minor
    return _ARCH[idx]


def launch_geometry(B: int, H: int, Hkv: int, Lq: int, block_m: int):
    """(heads per program, row tile, grid) of the forward and dQ kernels: a flat grid of
    row tiles x head groups x batch elements (see ``unfold_rows_grid``)."""
    n_rep = H // Hkv
    hpp = packed_rows(Lq, n_rep, block_m)
    bm = row_block(hpp * Lq, block_m)
    grid = (triton.cdiv(hpp * Lq, bm) * (H // hpp) * B,)
    return hpp, bm, grid


def on_device(t: torch.Tensor):
    """Make ``t``'s device current for a launch: Triton launches on the current device and its
    current stream, so without this a tensor on cuda:1 while cuda:0 is current would be read
    from the wrong device (the CUDA host code holds a CUDAGuard for the same reason)."""
    if t.device.type == "cuda":
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def check_buffer(name: str, t: torch.Tensor, shape, dtype, like: torch.Tensor, contiguous: bool = False):
    """Refuse an output buffer the kernels cannot write as given (launchers take the buffers
    their caller allocates)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != like.device:
        raise ValueError(
            f"{name}: expected a {dtype} tensor of shape {tuple(shape)} on {like.device}, "
            f"got {t.dtype} {tuple(t.shape)} on {t.device}"
        )
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: expected unit stride on the last dim, got strides {t.stride()}")




def kernel_key_length(modes, k: torch.Tensor) -> int:
    """The key length the kernels iterate over: a paged cache's logical ``pages_per_seq *
    page_size`` (block_table (B, pages_per_seq), k (num_pages, Hkv, page_size, D)), else k's
    length (docs/contract.md, "KV cache")."""
    bt = getattr(modes, "block_table", None)
    if bt is None:
        return k.shape[2]
    if not isinstance(bt, torch.Tensor) or bt.dim() != 2:
        raise ValueError(f"block_table: expected an int32 (B, pages_per_seq) tensor, got {bt!r:.80}")
    return bt.shape[1] * k.shape[2]


class ModeArgs:
    """The launch arguments of a call's modes, shared by the forward and backward launchers:
    what the kernels read at run time and the constexpr flags that select their variant.

    ``modes`` is the call's record (``mhakern.backends.Modes``, read by attribute: the fields
    the mode table gives the kernels' arguments, ``_modes_generated.KERNEL_ARGS``, and sinks) or
    None for the plain call. Three groups (docs/contract.md):

    * the **modes** (band: top-left alignment or a window; a mask; dropout) select the modes
      kernels; ``any()`` says whether one is on;
    * the **score modifiers** (softcap, ALiBi) are switches of every pointer kernel, the plain
      forward's split-K one included; ``modified()`` says whether one is on;
    * the **KV cache** (cache_batch_idx, or a paged cache's block_table; forward only) is a
      switch of the modes forward and of the split-K one; ``cached()`` says whether it is on,
      and ``Lk`` is then the kernels' (logical) key length (:func:`kernel_key_length`).

    The plain call gives every flag off. ``sinks`` never reaches a kernel (the op layer applies
    them around the forward): a record carrying them is refused.
    """

    def __init__(self, B: int, H: int, Lq: int, Lk: int, causal: bool, modes=None, device=None):
        m = _PLAIN if modes is None else modes
        attn_mask, slopes = m.attn_mask, m.alibi_slopes
        dropout_p, seed, softcap = float(m.dropout_p), int(m.seed), float(m.softcap)
        top_left, window_left, window_right = bool(m.top_left), int(m.window_left), int(m.window_right)
        if getattr(m, "sinks", None) is not None:
            raise ValueError("sinks: the kernels never see them (the op layer applies them around the forward); "
                             "pass a record without sinks")
        self.band = top_left or window_left >= 0 or window_right >= 0
        self.top_left = top_left and self.band
        # An unbounded side becomes Lq + Lk, wider than any row can reach, and bounded sides are
        # capped there too, so that i + off +- L, R stays far inside int32.
        big = Lq + Lk
        self.win_l = big if window_left < 0 else min(window_left, big)
        win_r = big if window_right < 0 else min(window_right, big)
        self.win_r = min(win_r, 0) if causal else win_r  # causal is the band's right edge at 0
        self.mask = attn_mask
        self.mask_kind = 0
        self.mask_strides = (0, 0, 0, 0)
        if attn_mask is not None:
            if attn_mask.dim() != 4:
                raise ValueError(f"attn_mask: expected a 4-D (B, H, Lq, Lk) view, got {attn_mask.dim()}-D")
            if attn_mask.dtype == torch.bool:
                self.mask_kind = 1
                self.mask = attn_mask.view(torch.uint8)  # same bytes and strides; loads compare with 0
            elif attn_mask.dtype == torch.float32:
                self.mask_kind = 2
            else:
                raise ValueError(f"attn_mask: expected bool or float32, got {attn_mask.dtype}")
            self.mask_strides = tuple(attn_mask.stride())
        if not 0.0 <= dropout_p < 1.0:
            raise ValueError(f"dropout_p: expected 0 <= p < 1, got {dropout_p}")
        self.dropout = dropout_p > 0.0
        thr = min(int(dropout_p * 4294967296.0), 0xFFFFFFFF)
        # uint32 values travel as int32 with the same bits (the kernels bitcast them back).
        self.seed_lo, self.seed_hi, self.drop_thr = (
            _as_i32(x) for x in (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, thr))
        self.drop_scale = 1.0 / (1.0 - dropout_p)
        if not (softcap >= 0.0 and math.isfinite(softcap)):
            raise ValueError(f"softcap: expected a finite value >= 0 (0: off), got {softcap}")
        self.softcap = softcap
        self.slopes = slopes
        self.slope_strides = (0, 0)
        if slopes is not None:
            if not isinstance(slopes, torch.Tensor) or slopes.dtype != torch.float32 or tuple(slopes.shape) != (B, H):
                got = f"{slopes.dtype} {tuple(slopes.shape)}" if isinstance(slopes, torch.Tensor) else type(slopes).__name__
                raise ValueError(f"alibi_slopes: expected a float32 (B, H) = ({B}, {H}) view, got {got}")
            if device is not None and slopes.device != device:
                raise ValueError(f"alibi_slopes: expected a tensor on {device}, got {slopes.device}")
            self.slope_strides = tuple(slopes.stride())
        self.cache_idx = _cache_index(getattr(m, "cache_batch_idx", None), "cache_batch_idx", (B,), device)
        self.block_table = _cache_index(getattr(m, "block_table", None), "block_table", (B, None), device)
        if self.cache_idx is not None and self.block_table is not None:
            # Memory safety for a direct caller: the kernels would add a row's offset to a page's.
            raise ValueError("cache_batch_idx, block_table: the kernels address K/V through one of them, got both")

    def any(self) -> bool:
        """Whether some mode is on (the launch takes the modes kernel, not the plain one)."""
        return self.band or self.mask_kind != 0 or self.dropout

    def modified(self) -> bool:
        """Whether a score modifier (softcap, ALiBi) is on."""
        return self.softcap > 0.0 or self.slopes is not None

    def runtime(self):
        """The modes kernels' run-time mode arguments, in their order (win_l .. drop_scale)."""
        return (self.win_l, self.win_r, self.seed_lo, self.seed_hi, self.drop_thr, self.drop_scale)

    def modifier_args(self, unused):
        """The run-time arguments of the score modifiers, in the kernels' order (softcap, SLOPES,
        slope_sb, slope_sh); ``unused``: a float32 tensor passed as SLOPES when ALiBi is off."""
        return (self.softcap, self.slopes if self.slopes is not None else unused, *self.slope_strides)

    def cached(self) -> bool:
        """Whether K/V rows are addressed through the KV cache's indices (forward only)."""
        return self.cache_idx is not None or self.block_table is not None

    def cache_args(self, k: torch.Tensor) -> dict:
        """The forward kernels' KV-cache keywords (none for a call without the cache): the
        indices, the block table's row stride and the page size (k's length when paged)."""
        if not self.cached():
            return {}
        bt = self.block_table
        return dict(CBI=self.cache_idx, BT=bt, stride_bt=0 if bt is None else bt.stride(0),
                    page_size=1 if bt is None else k.shape[2], CACHE_IDX=self.cache_idx is not None,
                    PAGED=bt is not None)

    def modifier_constexprs(self):
        return dict(SOFTCAP=self.softcap > 0.0, ALIBI=self.slopes is not None)

    def constexprs(self):
        return dict(BAND=self.band, TOP_LEFT=self.top_left, MASK_KIND=self.mask_kind, DROPOUT=self.dropout,
                    **self.modifier_constexprs())


def tile_modes(modes: "ModeArgs") -> dict:
    """The modes that choose a launch's tile (heuristics.tile_config's keywords): the table in
    heuristics.py narrows the plain tile for them, per architecture."""
    return dict(band=modes.band, mask_kind=modes.mask_kind, dropout=modes.dropout, modified=modes.modified())


def _cache_index(t, name: str, shape, device):
    """A KV-cache index tensor as the kernels read it: int32 of ``shape`` (None: any size) on
    ``device``, unit stride on its last dim (a copy otherwise). Its values (rows or pages in
    range) are the op layer's to check."""
    if t is None:
        return None
    if (not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != len(shape)
            or any(n is not None and n != got for n, got in zip(shape, t.shape))):
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        want = ", ".join("any" if n is None else str(n) for n in shape)
        raise ValueError(f"{name}: expected an int32 tensor of shape ({want}), got {got}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got {t.device}")
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _as_i32(x: int) -> int:
    return x - (1 << 32) if x >= (1 << 31) else x
