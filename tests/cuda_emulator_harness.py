"""The CUDA emulator's build harness and front end, shared by the tests that run the kernels on it
(tests/test_cuda_host.py, test_cuda_emulator.py, test_cuda_sm90.py, test_cuda_sm90_bwd.py).

csrc/cuda/mma/*.cu, csrc/cuda/sm90/*.cu and the headers they include are compiled by g++ with
``-DMHAKERN_CUDA_EMULATE`` and the emulator (tests/cuda_emulator/) on the include path, which turns
the PTX primitives into calls to an emulator running each CUDA thread as a fiber, with the documented fragment layouts of ldmatrix and mma.sync. Compiled
objects are cached under pytest's cache dir (a digest of the sources and flags names the
directory), so every library of the same sources shares them. ``Emulator`` calls the C entry
points (cuda_emulator/emu_entry.cpp); every tensor handed to them sits in a larger NaN-filled buffer
(padded rows, a spare row): reading outside a tensor puts NaN into the results, and writing
outside an output changes the padding, which is checked. ``emulated_attention`` wraps forward
and backward into a function with ``mhakern.attention``'s calling convention, modes included.

Also here: the seeds of the emulator's random schedules (``MHK_EMU_SEED``), the cuda backend on
a pretend device (a faked capability table and tensor stand-ins), and the report of
tools/check_cuda_build.py shared by the tests that read one (``cuda_build_report``: nvcc compiles
each source once per sources digest).
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Optional, Sequence

import pytest
import torch

from mhakern import mode_table, reference
from mhakern._layout import heads_inner
from mhakern.backends import DEFAULT_MODES, Modes, cuda_backend
from mhakern.checks import draw_seed
from attn_testing import HARD_CASES

# ---------------------------------------------------------------------------------------------
# The CPU emulation of the kernels
# ---------------------------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parent.parent
CUDA_SRC = ROOT / "csrc" / "cuda"
# The emulator: test infrastructure, not part of mhakern._C (its README). The kernels' headers
# include its cuda_emu.h / cuda_emu_sm90.h under MHAKERN_CUDA_EMULATE, and its entry points
# include the kernels' headers, both through the include path (FLAGS).
EMULATOR = ROOT / "tests" / "cuda_emulator"


def _generator():
    spec = importlib.util.spec_from_file_location("generate_kernels", ROOT / "tools" / "generate_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# The instance list of the capability table (csrc/capabilities.h), read from the source so that
# the emulator tests need no built extension.
TABLE_INSTANCES = _generator().instances((ROOT / "csrc" / "capabilities.h").read_text())
HEAD_DIMS = tuple(sorted({d for _, d in TABLE_INSTANCES}))
# Head dims with only the (fused) mma.sync backward (capabilities.h MHK_CUDA_BWD_ONLY_HEAD_DIM).
BWD_ONLY_INSTANCES = _generator().bwd_only_instances((ROOT / "csrc" / "capabilities.h").read_text())
BWD_ONLY_HEAD_DIMS = tuple(sorted({d for _, d in BWD_ONLY_INSTANCES}))
ELEM = {torch.float16: 0, torch.bfloat16: 1}
TAG = {torch.float16: "fp16", torch.bfloat16: "bf16"}
# Shared memory per block on sm_86 / sm_89, the smallest of the sm_80+ family (sm_80: 163 KB,
# sm_90: 227 KB): every kernel must fit it, and the emulator enforces it.
SMEM_LIMIT = 99 * 1024
PAD_ELEMS = 8  # extra elements per row of every emulated tensor (keeps 16-byte alignment)
BWD_KERNELS = ("split", "fused", "fused_atomic")  # capabilities.h kCudaBwdKernelNames


def cuda_include_dir() -> Optional[Path]:
    """The CUDA toolkit's include dir (for cuda_fp16.h and friends), or None."""
    cands = []
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            cands.append(Path(os.environ[env]) / "include")
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = Path(os.path.realpath(nvcc))
        cands.append(real.parent.parent / "include")
        # a wrapper script in /usr/local/bin: follow the path it execs
        try:
            text = real.read_text(errors="ignore")[:4096]
            for tok in text.split():
                if tok.endswith("/bin/nvcc"):
                    cands.append(Path(tok).parent.parent / "include")
        except OSError:
            pass
    cands.append(Path("/usr/local/cuda/include"))
    for c in cands:
        if (c / "cuda_fp16.h").is_file() and (c / "driver_types.h").is_file():
            return c
    return None


def missing_toolchain() -> Optional[str]:
    """Why the emulator cannot be built here, or None."""
    if shutil.which("g++") is None:
        return "g++ not found (the CUDA emulation is compiled with it)"
    if cuda_include_dir() is None:
        return "CUDA toolkit headers (cuda_fp16.h) not found: set CUDA_HOME"
    return None


def _sources_digest(extra: Iterable[str]) -> str:
    h = hashlib.sha256()
    # csrc/generated/: the mode table's X-macros (ModeParams' members, the feature bits).
    for p in (sorted(CUDA_SRC.rglob("*")) + sorted(EMULATOR.glob("*"))
              + [ROOT / "csrc" / "mode_params.h", ROOT / "csrc" / "capabilities.h"]
              + sorted((ROOT / "csrc" / "generated").glob("*.h"))):
        if p.suffix in (".h", ".cuh", ".cu", ".cpp") and p.is_file():
            h.update(p.name.encode())
            h.update(p.read_bytes())
    for e in extra:
        h.update(e.encode())
    return h.hexdigest()[:16]


# The emulator names a collective's program point by its call stack (cuda_emu.h): frame pointers
# to walk it, and no jump threading, which copies a join point (a __syncthreads after an `if`)
# into each branch and so would split one program point into two.
FLAGS = ["-std=c++17", "-O1", "-fPIC", "-fno-omit-frame-pointer", "-fno-thread-jumps", "-DMHAKERN_CUDA_EMULATE", "-w",
         f"-I{CUDA_SRC}", f"-I{EMULATOR}"]
# The emulator's runtime entry points (schedule, read guard) and its self-test kernels.
RUNTIME_UNITS = ("emu_entry.cpp", "emu_schedule.cpp", "emu_selftest.cpp")


def build(cache_dir: Path, instances: Sequence[str], jobs: Optional[int] = None) -> Path:
    """Compile the emulator with the given instantiations (e.g. "fp16_d64"); return the .so path.

    Objects are cached in ``cache_dir`` under a digest of the sources and flags, so a rerun with
    unchanged sources links only.
    """
    units = [EMULATOR / u for u in RUNTIME_UNITS]
    for inst in instances:
        # a backward-only head dim (D 256) has no forward file
        units += [f for f in (CUDA_SRC / "mma" / f"attn_fwd_{inst}.cu", CUDA_SRC / "mma" / f"attn_bwd_{inst}.cu") if f.exists()]
    return build_units(cache_dir, units, "libmhk_emu_" + ("_".join(sorted(instances)) or "runtime") + ".so", jobs)


def build_units(cache_dir: Path, units: Sequence[Path], lib_name: str, jobs: Optional[int] = None) -> Path:
    """Compile ``units`` (g++, FLAGS, in parallel) into cache_dir/<sources digest>/ and link them
    into ``lib_name`` there; objects already built are reused (every emulator library of the
    same sources shares them: the sm90 files' builds too). Returns the library's path."""
    inc = cuda_include_dir()
    if inc is None:
        raise RuntimeError(missing_toolchain())
    out = cache_dir / _sources_digest(FLAGS + [str(inc)])
    out.mkdir(parents=True, exist_ok=True)

    def compile_one(src: Path) -> Path:
        obj = out / (src.name + ".o")
        if obj.exists():
            return obj
        tmp = obj.with_suffix(f".{os.getpid()}.tmp")
        cmd = ["g++", *FLAGS, f"-I{inc}", "-x", "c++", "-c", str(src), "-o", str(tmp)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"emulator build failed for {src.name}:\n{res.stderr[-4000:]}")
        os.replace(tmp, obj)
        return obj

    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 2) as pool:
        objs = list(pool.map(compile_one, units))
    lib = out / lib_name
    if not lib.exists():
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        res = subprocess.run(["g++", "-shared", "-o", str(tmp), *map(str, objs), "-ldl"], capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"emulator link failed:\n{res.stderr[-4000:]}")
        os.replace(tmp, lib)
    return lib


class Emulator:
    """ctypes front end of one emulator library."""

    def __init__(self, lib_path: Path, instances: Sequence[str]):
        self.lib = ctypes.CDLL(str(lib_path))
        self.lib.mhk_emu_last_error.restype = ctypes.c_char_p
        self.lib.mhk_emu_configure.argtypes = [ctypes.c_int, ctypes.c_longlong]
        self.lib.mhk_emu_schedule.argtypes = [ctypes.c_int, ctypes.c_ulonglong]
        self.lib.mhk_emu_set_bwd_kernel.argtypes = [ctypes.c_int, ctypes.c_int]
        self.instances = set(instances)
        self.defer_async = True

    def schedule(self, seed: Optional[int]) -> None:
        """The seeded random schedule for the following calls, or the fixed one (seed None)."""
        self.lib.mhk_emu_schedule(0 if seed is None else 1, 0 if seed is None else seed)

    def bwd_kernel(self, name: Optional[str]) -> None:
        """The mma.sync backward the following backward calls run (capabilities.h CudaBwdKernel:
        "split", "fused", "fused_atomic"; None: the default), as MHAKERN_CUDA_MMA_BWD sets it."""
        self.lib.mhk_emu_set_bwd_kernel(-1 if name is None else BWD_KERNELS.index(name), 0)

    def has(self, dtype: torch.dtype, D: int) -> bool:
        return f"{TAG[dtype]}_d{D}" in self.instances

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what}: {self.lib.mhk_emu_last_error().decode()}")

    def forward(self, q, k, v, scale, causal, key_lengths, num_splits=1, modes=None):
        """q, k, v: padded views (see :func:`padded`). Returns (out view, lse). ``modes``: a
        :class:`mhakern.backends.Modes` (attn_mask already a (B, H, Lq, Lk) view) or None.

        A head dim with only a mma.sync backward (BWD_ONLY_HEAD_DIMS: D 256, whose forward is the
        sm_90a family's) takes its forward from the reference in the input dtype (fp32
        accumulation, as every kernel), so that its backward is tested on a forward's out and lse."""
        B, H, Lq, D = q.shape
        if D in BWD_ONLY_HEAD_DIMS:
            out, lse = reference.attention_forward(q, k, v, scale, causal, key_lengths,
                                                   modes=modes if modes is not None else DEFAULT_MODES)
            view, _ = padded_empty(q)
            view.copy_(out)
            return view, lse.float().contiguous()
        Hkv, Lk = k.shape[1], k.shape[2]
        out, out_guard = padded_empty(q)
        lse = torch.full((B, H, Lq), float("nan"))
        o_part = torch.full((num_splits, B, H, Lq, D), float("nan")) if num_splits > 1 else None
        l_part = torch.full((num_splits, B, H, Lq), float("nan")) if num_splits > 1 else None
        self.lib.mhk_emu_configure(int(self.defer_async), SMEM_LIMIT)
        args = (
            ELEM[q.dtype], D, _ptr(q), _st(q), _ptr(k), _st(k), _ptr(v), _st(v), _ptr(out), _st(out), _ptr(lse),
            _ptr(key_lengths), B, H, Hkv, Lq, Lk, ctypes.c_float(scale), int(causal), num_splits,
            _ptr(o_part), _ptr(l_part),
        )
        if modes is None:
            rc = self.lib.mhk_emu_fwd(*args)
        else:
            rc = self.lib.mhk_emu_fwd_modes(*args, ctypes.byref(mode_params(modes)))
        self._check(rc, "emulated forward")
        out_guard.check("out")
        return out, lse

    def backward(self, dout, q, k, v, out, lse, scale, causal, key_lengths, num_splits=1, modes=None):
        """Returns (dq, dk, dv), and dmask (float32 (B, H, Lq, Lk)) last when modes.mask_grad."""
        B, H, Lq, D = q.shape
        Hkv, Lk = k.shape[1], k.shape[2]
        dq, gq = padded_empty(q)
        dk, gk = padded_empty(k)
        dv, gv = padded_empty(v)
        delta = torch.full((B, H, Lq), float("nan"))
        dq_part = torch.full((num_splits, B, H, Lq, D), float("nan")) if num_splits > 1 else None
        self.lib.mhk_emu_configure(int(self.defer_async), SMEM_LIMIT)
        args = (
            ELEM[q.dtype], D, _ptr(dout), _st(dout), _ptr(q), _st(q), _ptr(k), _st(k), _ptr(v), _st(v),
            _ptr(out), _st(out), _ptr(lse), _ptr(dq), _st(dq), _ptr(dk), _st(dk), _ptr(dv), _st(dv), _ptr(delta),
            _ptr(key_lengths), B, H, Hkv, Lq, Lk, ctypes.c_float(scale), int(causal), num_splits, _ptr(dq_part),
        )
        dmask = None
        if modes is None:
            rc = self.lib.mhk_emu_bwd(*args)
        else:
            # the op's allocation (op_common.h, alloc_dmask): zeros, the kernels write the visible entries
            dmask = torch.zeros((B, H, Lq, Lk), dtype=torch.float32) if modes.mask_grad else None
            rc = self.lib.mhk_emu_bwd_modes(*args, ctypes.byref(mode_params(modes, dmask=_ptr(dmask))))
        self._check(rc, "emulated backward")
        for name, g in (("dq", gq), ("dk", gk), ("dv", gv)):
            g.check(name)
        return (dq, dk, dv) if dmask is None else (dq, dk, dv, dmask)


def _ptr(x: Optional[torch.Tensor]):
    return None if x is None else ctypes.c_void_p(x.data_ptr())


def _st(x: torch.Tensor):
    return (ctypes.c_int64 * 3)(x.stride(0), x.stride(1), x.stride(2))


# The kernels' ModeParams (csrc/mode_params.h) as a ctypes struct: its fields, types and order
# are the mode table's PARAMS (the emulator's mhk_emu_mode_params_layout reports the compiled
# layout, which tests/test_cuda_emulator.py compares with this one).
_CTYPES = {"bool": ctypes.c_bool, "int": ctypes.c_int, "int64_t": ctypes.c_int64, "uint64_t": ctypes.c_uint64,
           "float": ctypes.c_float, "double": ctypes.c_double}


class ModeParams(ctypes.Structure):
    _fields_ = [(p.name, ctypes.c_void_p if p.ctype.endswith("*") else _CTYPES[p.ctype]) for p in mode_table.PARAMS]

    def __init__(self, **fields):
        # the table's initialisers (nullptr, -1, 0.f, ...), then the fields given
        defaults = {p.name: None if p.default == "nullptr" else (p.default == "true" if p.ctype == "bool" else
                    float(p.default.rstrip("f")) if p.ctype in ("float", "double") else int(p.default))
                    for p in mode_table.PARAMS}
        super().__init__(**{**defaults, **fields})


def mode_params(modes=None, **fields) -> ModeParams:
    """The mode fields of the kernels' parameters for the record ``modes`` (a
    :class:`mhakern.backends.Modes`, attn_mask already a (B, H, Lq, Lk) view, alibi_slopes a
    float32 (B, H) view; None: the table's defaults), filled as op_common.h's fill_mode_params
    fills them: the table's copied params by name, pointers and strides of the tensor modes;
    then ``fields`` (pointers as ints or ctypes pointers: dmask, page_size, or a faked mode)."""
    p = ModeParams()
    if modes is not None:
        for prm in mode_table.PARAMS:
            if prm.copied:
                value = getattr(modes, prm.name)
                setattr(p, prm.name, value & (2**64 - 1) if prm.ctype == "uint64_t" else value)
        m = modes.attn_mask
        if m is not None:
            assert m.dtype in (torch.bool, torch.float32), "the kernels take a bool or float32 mask"
            p.mask, p.mask_kind = m.data_ptr(), 1 if m.dtype == torch.bool else 2
            p.mask_sb, p.mask_sh, p.mask_sq, p.mask_sk = m.stride()
        a = modes.alibi_slopes
        if a is not None:
            assert a.dtype == torch.float32 and a.dim() == 2, "the kernels take a float32 (B, H) view of the slopes"
            p.alibi, (p.alibi_sb, p.alibi_sh) = a.data_ptr(), a.stride()
        if modes.cu_seqlens_q is not None:
            p.cu_seqlens_q, p.cu_seqlens_k = modes.cu_seqlens_q.data_ptr(), modes.cu_seqlens_k.data_ptr()
            p.num_seqs = modes.cu_seqlens_q.numel() - 1
            p.max_seqlen_q, p.max_seqlen_k = modes.max_seqlen_q, modes.max_seqlen_k
        if modes.cache_batch_idx is not None:
            p.kv_batch_idx = modes.cache_batch_idx.data_ptr()
        if modes.block_table is not None:
            p.block_table, p.block_table_stride = modes.block_table.data_ptr(), modes.block_table.stride(0)
    for name, value in fields.items():
        setattr(p, name, value.value if isinstance(value, ctypes.c_void_p) else value)
    return p


def mode_params_layout(lib) -> tuple:
    """(sizeof, offsets of the fields in order) of ModeParams as the emulator library compiled it."""
    out = (ctypes.c_longlong * (len(ModeParams._fields_) + 1))()
    n = lib.mhk_emu_mode_params_layout(out, len(out))
    assert n == len(ModeParams._fields_), f"ModeParams: {n} fields compiled, {len(ModeParams._fields_)} in the table"
    return tuple(out)


class _Guard:
    """Remembers a buffer's padding (everything outside the view) to detect stray writes."""

    def __init__(self, buf: torch.Tensor, view: torch.Tensor):
        self.buf, self.view = buf, view
        mask = torch.ones(buf.numel(), dtype=torch.bool)
        idx = torch.arange(buf.numel()).as_strided(view.shape, view.stride(), view.storage_offset() - buf.storage_offset())
        mask[idx.reshape(-1)] = False
        self.mask = mask
        self.before = buf.reshape(-1)[mask].view(torch.int16).clone()

    def check(self, name: str) -> None:
        after = self.buf.reshape(-1)[self.mask].view(torch.int16)
        bad = (after != self.before).nonzero()
        if bad.numel():
            raise AssertionError(f"{name}: the kernel wrote {bad.numel()} elements outside the tensor")


def _padded_buffer(x: torch.Tensor, fill: float):
    """A NaN-filled buffer with x's shape and memory order, padded rows, and a view into it."""
    B, H, L, D = x.shape
    if heads_inner(x):
        buf = torch.full((B, L + 1, H, D + PAD_ELEMS), fill, dtype=x.dtype)
        view = buf[:, :L, :, :D].transpose(1, 2)
    else:
        buf = torch.full((B, H, L + 1, D + PAD_ELEMS), fill, dtype=x.dtype)
        view = buf[:, :, :L, :D]
    return buf, view


def padded(x: torch.Tensor) -> torch.Tensor:
    """x's values in a NaN-padded buffer (same memory order): reads outside x give NaN."""
    buf, view = _padded_buffer(x, float("nan"))
    view.copy_(x.detach())
    return view


def padded_empty(like: torch.Tensor):
    """A NaN-filled output view shaped and laid out like ``like``, and the guard of its padding."""
    buf, view = _padded_buffer(like, float("nan"))
    return view, _Guard(buf, view)


class EmulatedAttention(torch.autograd.Function):
    """The emulated CUDA forward and backward as one autograd op (CPU tensors)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal, key_lengths, emu, splits, bwd_splits, mask, modes):
        qp, kp, vp = padded(q), padded(k), padded(v)
        if modes is not None and mask is not None:
            # as the API hands it to backends: float32 (or bool), a 4-D view with stride 0 on
            # broadcast dims (docs/contract.md "Visibility")
            B, H, Lq, _ = q.shape
            m = mask.detach()
            m = (m if m.dtype == torch.bool else m.to(torch.float32)).expand(B, H, Lq, k.shape[2])
            modes = modes._replace(attn_mask=m, mask_grad=mask.requires_grad and mask.is_floating_point())
        out, lse = emu.forward(qp, kp, vp, scale, causal, key_lengths, splits, modes)
        ctx.save_for_backward(qp, kp, vp, out, lse)
        ctx.cfg = (scale, causal, key_lengths, emu, bwd_splits, modes, None if mask is None else mask.shape)
        ctx.mark_non_differentiable(lse)
        return out.clone(), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        qp, kp, vp, out, lse = ctx.saved_tensors
        scale, causal, key_lengths, emu, bwd_splits, modes, mask_shape = ctx.cfg
        grads = emu.backward(padded(dout), qp, kp, vp, out, lse, scale, causal, key_lengths, bwd_splits, modes)
        dmask = grads[3].sum_to_size(mask_shape) if len(grads) == 4 else None
        dq, dk, dv = grads[:3]
        return dq.clone(), dk.clone(), dv.clone(), None, None, None, None, None, None, dmask, None


def emulated_attention(emu: Emulator, splits: int = 1, bwd_splits: int = 1):
    """A function with ``mhakern.attention``'s calling convention running the emulated kernels,
    modes included (attn_mask, dropout_p with generator, causal_align, window, softcap,
    alibi_slopes (H,) or (B, H))."""

    def fn(q, k, v, *, causal=False, key_lengths=None, scale=None, return_lse=False, attn_mask=None, dropout_p=0.0,
           generator=None, causal_align="bottom_right", window=None, softcap=0.0, alibi_slopes=None):
        D = q.shape[-1]
        scale = 1.0 / D**0.5 if scale is None else float(scale)
        kl = None if key_lengths is None else key_lengths.to(torch.int32).contiguous()
        modes = None
        if (attn_mask is not None or dropout_p or causal_align != "bottom_right" or window is not None or softcap
                or alibi_slopes is not None):
            seed = draw_seed(generator) if dropout_p else 0
            alibi = None
            if alibi_slopes is not None:  # as the API hands them to backends: a float32 (B, H) view
                alibi = alibi_slopes.detach().to(torch.float32).expand(q.shape[0], q.shape[1])
            modes = Modes.build(dropout_p=float(dropout_p), seed=seed, top_left=causal_align == "top_left",
                                window=window, softcap=float(softcap), alibi_slopes=alibi)
        out, lse = EmulatedAttention.apply(q, k, v, scale, causal, kl, emu, splits, bwd_splits, attn_mask, modes)
        return (out, lse) if return_lse else out

    return fn


# Instantiations built for the tests: all of them (the capability table's list). The hard cases
# run each head dim in one dtype (DTYPE_FOR_D, alternating); tests/test_cuda_emulator.py runs
# every instantiation in the other.
ALL_INSTANCES = tuple(f"{t}_d{d}" for t, d in TABLE_INSTANCES)
EMU_INSTANCES = ALL_INSTANCES + tuple(f"{t}_d{d}" for t, d in BWD_ONLY_INSTANCES)
DTYPE_FOR_D = {d: (torch.float16, torch.bfloat16)[i % 2] for i, d in enumerate(HEAD_DIMS)}


# The emulator's block dispatch (tests/cuda_emulator/cuda_emu.h Dispatch): the order in which a
# launch's CTAs start and how many are resident at once. The hardware promises no order; with
# fewer resident CTAs than the grid (2,048 CTAs on 132 SMs) a CTA that waits on another's turn
# can wait on one that has not started.
DISPATCH_ORDERS = {"in_order": 0, "reversed": 1, "shuffled": 2}


@contextlib.contextmanager
def dispatched(lib, order: str, resident: int = 0, seed: int = 0):
    """Within the block, the emulator library ``lib`` starts the CTAs of every launch in
    ``order`` (DISPATCH_ORDERS; "shuffled": a permutation drawn from ``seed``) with ``resident``
    in flight at once (0: the schedule's own number); block-index order again afterwards."""
    lib.mhk_emu_dispatch.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_ulonglong]
    lib.mhk_emu_dispatch(DISPATCH_ORDERS[order], resident, seed)
    try:
        yield
    finally:
        lib.mhk_emu_dispatch(0, 0, 0)


def emu_session_seed() -> int:
    """The session's base seed of the random schedule: MHK_EMU_SEED, or a fresh one per run."""
    env = os.environ.get("MHK_EMU_SEED")
    if env:
        return int(env, 0)
    if not hasattr(emu_session_seed, "seed"):
        emu_session_seed.seed = int.from_bytes(os.urandom(4), "little")
    return emu_session_seed.seed


def emu_test_seed(nodeid: str, salt: str = "") -> int:
    """The seed of one test: a function of the session seed and the test's id."""
    digest = hashlib.sha256(f"{emu_session_seed()}:{nodeid}:{salt}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def use_random_schedule(emu: "Emulator", nodeid: str, salt: str = "") -> int:
    """Puts emu on the random schedule for one test and prints how to rerun it (pytest shows the
    print when the test fails). Returns the seed."""
    seed = emu_test_seed(nodeid, salt)
    emu.schedule(seed)
    print(f"emulator: random schedule seed {seed} (rerun with MHK_EMU_SEED={emu_session_seed()} "
          f"python -m pytest '{nodeid}')")
    return seed


def _make_emulator(request, instances) -> Emulator:
    why = missing_toolchain()
    if why:
        pytest.skip(why)
    cache = Path(request.config.cache.mkdir("mhakern_cuda_emu"))
    return Emulator(build(cache, instances), instances)

# ---------------------------------------------------------------------------------------------
# The hard cases the cuda kernels serve (D == Dv, a compiled head dim)
# ---------------------------------------------------------------------------------------------
def _cuda_supported(case) -> bool:
    D, Dv = case[5], case[6]
    return D == Dv and D in HEAD_DIMS


SUPPORTED_HARD = [c for c in HARD_CASES if _cuda_supported(c)]
UNSUPPORTED_HARD = [c for c in HARD_CASES if not _cuda_supported(c)]


# ---------------------------------------------------------------------------------------------
# The cuda backend on a pretend device: the built extension's capability table, faked as a
# build with the CUDA kernels, and tensor stand-ins (supports() reads only shapes, dtypes, devices)
# ---------------------------------------------------------------------------------------------


def _real_table():
    """The capability table of the built extension, or skip (the tests below read its limits)."""
    caps = cuda_backend.capabilities()
    if caps is None:
        pytest.skip("mhakern._C is not built (the capability table comes from it)")
    return caps


def _compiled_table():
    """The real table, as a build with the CUDA kernels would report it."""
    caps = json.loads(json.dumps(_real_table()))
    caps["cuda"]["compiled"] = True
    return caps


def _fresh_backend(monkeypatch, cuda_version, table, device=True, caps=((9, 0),), ext_error=None):
    be = cuda_backend.CudaBackend()
    monkeypatch.setattr(be, "_device_capabilities", lambda: dict(enumerate(caps)))
    monkeypatch.setattr(torch.version, "cuda", cuda_version)
    monkeypatch.setattr(be, "_capabilities", lambda: table)
    if ext_error is not None:
        from mhakern import _extension

        monkeypatch.setattr(_extension, "_error", ext_error)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: device)
    return be


class _FakeCudaTensor:
    def __init__(self, shape, dtype=torch.float16):
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.device = torch.device("cuda", 0)

    def dim(self):
        return len(self.shape)


# ---------------------------------------------------------------------------------------------
# tools/check_cuda_build.py, run once per sources digest: tests/test_cuda_build.py runs it on
# every source, the tests that read a few kernels' rows take that report when it exists (as in a
# full run, where test_cuda_build.py comes first) and compile only what they read otherwise
# ---------------------------------------------------------------------------------------------
CHECK_TOOL = ROOT / "tools" / "check_cuda_build.py"


def find_nvcc() -> Optional[str]:
    nvcc = shutil.which("nvcc") or (os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if "CUDA_HOME" in os.environ else None)
    return nvcc if nvcc and os.path.exists(nvcc) else None


def _build_digest(nvcc: str) -> str:
    """What a check's report depends on: the CUDA and host sources, the emulator's headers (the
    tile-config printers compile against them), the tool and the SASS reader it loads, and the
    compiler."""
    h = hashlib.sha256(subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.encode())
    files = sorted((ROOT / "csrc").rglob("*")) + sorted(EMULATOR.glob("*")) + [
        CHECK_TOOL, ROOT / "tools" / "generate_kernels.py", ROOT / "mhakern" / "kernels" / "sass.py"]
    for p in files:
        if p.is_file() and p.suffix in (".h", ".cuh", ".cu", ".cpp", ".py", ".json"):
            h.update(str(p.relative_to(ROOT)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def check_cuda_build_report(cache_dir: Path, args: Sequence[str] = (), name: str = "full") -> dict:
    """The report of ``tools/check_cuda_build.py ARGS --json`` (its JSON plus ``returncode``,
    ``stdout`` and ``stderr``), cached under cache_dir/<digest>/<name>.json: each (sources, args)
    compiles once. Skips without nvcc."""
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc (the CUDA compiler) is not installed")
    out = cache_dir / _build_digest(nvcc)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    if not path.exists():
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        res = subprocess.run([sys.executable, str(CHECK_TOOL), *args, "--json", str(tmp)], capture_output=True,
                             text=True, timeout=1500, cwd=ROOT)
        report = json.loads(tmp.read_text()) if tmp.exists() else {"passed": False, "kernels": []}
        report.update(returncode=res.returncode, stdout=res.stdout, stderr=res.stderr)
        path.write_text(json.dumps(report))
        tmp.unlink(missing_ok=True)
    return json.loads(path.read_text())


def full_cuda_build_report(cache_dir: Path) -> Optional[dict]:
    """The report of a full check of the current sources if one was made (None otherwise)."""
    nvcc = find_nvcc()
    if nvcc is None:
        return None
    path = cache_dir / _build_digest(nvcc) / "full.json"
    return json.loads(path.read_text()) if path.exists() else None
