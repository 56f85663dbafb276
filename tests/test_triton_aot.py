"""Every Triton kernel variant the dispatcher can launch compiles for sm_80 and sm_90 with the
tiles the heuristics give that architecture, and fits the chip (no GPU needed: triton.compile
with a GPUTarget, then the SASS read back with the cuobjdump Triton ships):

* no register spills in a loop, and at most aot.STACK_SLACK bytes of stack (mhakern/kernels/sass.py);
  for head dims that are not multiples of 16 (strides the JIT cannot mark divisible), no
  spills in a loop;
* on sm_90, every loop that multiplies matrices uses the warpgroup MMA (HGMMA), except the
  variants heuristics.MMA_SYNC_ON_SM90 (or MMA_SYNC_MODES_ON_SM90) names with the reason, and the tensor-descriptor forward
  loads its keys and values with TMA (UTMALDG in its loops);
* shared memory within the chip's limit.

The heuristics pick one tile configuration per (arch, dtype width, head-dim bucket: <= 64,
<= 128, <= 256, and whether the head dims are multiples of 16); registers and shared memory
grow with the head dim inside a bucket, so the largest dim of each bucket is the variant to
check (40 and 200 here for the unaligned rows; ``--dims 40 100 200`` in the full run). bf16 tiles have fp16's byte sizes and
compile to the same register allocation give or take a few. fp32 variants multiply in full fp32
(no tensor cores): their unrolled FMA code takes minutes per variant to compile on two cores,
too long for CI; ``python -m mhakern.kernels.aot`` builds every variant (fp32 included).
The mode variants (``--modes``: band, masks, dropout, the mask's gradient) are checked here at
their heaviest, all modes on per kernel; ``--modes`` alone builds every mode set.
"""
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import SLOW
from mhakern.kernels import sass

pytest.importorskip("triton", reason="triton is not installed")


def _aot(*args, arches=("80", "90"), per_arch=None):
    """Run ``python -m mhakern.kernels.aot ARGS --arch A`` for each arch, in parallel (one
    process per target: the two compile side by side on a two-core machine); their reports.
    ``per_arch``: {arch: [more args]} for that arch's process only."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, stated to silence its warning
    cmd = [sys.executable, "-m", "mhakern.kernels.aot", *args]
    procs = [subprocess.Popen(cmd + ["--arch", arch, *(per_arch or {}).get(arch, [])], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for arch in arches]
    outs = [p.communicate(timeout=1200)[0] for p in procs]
    print("\n".join(outs))
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
    return "\n".join(outs)


@pytest.fixture(scope="module")
def plain_report():
    """The AOT report of the plain kernels, fp16, head dims 64, 128, 256, both arches."""
    return _aot("--dtypes", "fp16", "--dims", "64", "128", "256")


@pytest.fixture(scope="module")
def unaligned_report():
    """The AOT report of the plain kernels at head dims 40 and 200 (strides not multiples of 16)."""
    return _aot("--dtypes", "fp16", "--dims", "40", "200", "--only", "fwd", "desc", "dq", "dkdv", "fused")


def test_kernels_compile_for_sm80_and_sm90_without_spills_within_shared_memory(plain_report):
    report = plain_report
    # fwd, split fwd, delta, dK/dV, dQ, fused backward per dim and arch, and the descriptor
    # forward on sm_90
    assert report.count(" ok (") == 2 * 3 * 6 + 3, report
    assert report.count("fused/fp16/") == 2 * 3, report
    assert report.count("fwdsplit/fp16/") == 2 * 3, report
    assert report.count("desc/fp16/") == 3, report


def test_head_dims_not_multiple_of_16_keep_local_memory_out_of_their_loops(unaligned_report):
    # Head dims 40 and 200: strides the JIT cannot mark divisible by 16 (the worst case of the
    # layouts the dispatcher allocates), so loads go element by element with the tiles of
    # heuristics.UNALIGNED_TILES; a prologue may spill, never a loop, and sm_90 keeps HGMMA
    # except where heuristics.MMA_SYNC_ON_SM90 says why not. D = 40 (80-byte rows) also takes
    # the descriptor forward on sm_90; 200 (400-byte rows) too.
    assert unaligned_report.count(" ok (") == 2 * 2 * 4 + 2, unaligned_report


# The plain kernels' SASS (instruction count, digest of the instruction texts: sass.SassReport)
# as it stood before the score modifiers (softcap, ALiBi) joined the kernels as constexpr
# switches, compiled by the two fixtures above under this triton. A call without modes or
# modifiers must keep running exactly these kernels: a change to one (a modifier's code left in
# the plain path, a reordering) changes its digest. A deliberate change to a plain kernel
# records the new figures here (the report's insns and digest columns) with its reason. The
# split forward's were recorded again when its shares came to store their (max, sum) rather
# than their lse (docs/contract.md, "Tolerance rule"); the others stand as recorded.
PLAIN_SASS_TRITON = "3.9.0"
PLAIN_SASS = {
    ("fwd/fp16/d64", 80): (1872, "b2bc0a311ceedd83"),
    ("fwdsplit/fp16/d64", 80): (2096, "4e21bfb25283df25"),
    ("delta/fp16/d64", 80): (312, "ec0dcc7f88ae5e05"),
    ("dkdv/fp16/d64", 80): (2432, "0730665edd9fe504"),
    ("dq/fp16/d64", 80): (2608, "dab8e7394045bdfb"),
    ("fused/fp16/d64", 80): (2552, "56b5ceb5cda59ad5"),
    ("fwd/fp16/d128", 80): (1944, "f842c2b7139c01ff"),
    ("fwdsplit/fp16/d128", 80): (2296, "5915c6ecb10fdd53"),
    ("delta/fp16/d128", 80): (528, "3112e1b4253b49b7"),
    ("dkdv/fp16/d128", 80): (2504, "948298dbd0c1be2a"),
    ("dq/fp16/d128", 80): (2224, "bc47639abb6146b5"),
    ("fused/fp16/d128", 80): (3696, "f61d6111932f1b55"),
    ("fwd/fp16/d256", 80): (3016, "072e2e3ee07c2e52"),
    ("fwdsplit/fp16/d256", 80): (3200, "6fa88da7ec3c326f"),
    ("delta/fp16/d256", 80): (968, "9fde9cb674f927a8"),
    ("dkdv/fp16/d256", 80): (1888, "06cada0656c39989"),
    ("dq/fp16/d256", 80): (2848, "bd53b1cc1c73af63"),
    ("fused/fp16/d256", 80): (3200, "4ba8958c19938a3f"),
    ("fwd/fp16/d64", 90): (3152, "28103952df20d0dd"),
    ("fwdsplit/fp16/d64", 90): (3448, "0c23edda5ff6e981"),
    ("desc/fp16/d64", 90): (2944, "c1cf9e8113c30fad"),
    ("delta/fp16/d64", 90): (328, "0fb019797393c54e"),
    ("dkdv/fp16/d64", 90): (2040, "ac4d408b7ecd97e7"),
    ("dq/fp16/d64", 90): (2208, "646a03e471a00eba"),
    ("fused/fp16/d64", 90): (2864, "1d6b3ed43ca50f7d"),
    ("fwd/fp16/d128", 90): (2264, "1b1e636f3914c347"),
    ("fwdsplit/fp16/d128", 90): (2696, "2614e2a075defda8"),
    ("desc/fp16/d128", 90): (2192, "0f761280e4bd26c6"),
    ("delta/fp16/d128", 90): (536, "a783a2d0c45faa52"),
    ("dkdv/fp16/d128", 90): (2008, "963c17858a2a0efa"),
    ("dq/fp16/d128", 90): (2528, "f462c2523ff72a4e"),
    ("fused/fp16/d128", 90): (2656, "accbca59087ae782"),
    ("fwd/fp16/d256", 90): (2512, "8f8c72bf03d12cdd"),
    ("fwdsplit/fp16/d256", 90): (2784, "8cfb885ef9af3c39"),
    ("desc/fp16/d256", 90): (2368, "6b6586d9f520547c"),
    ("delta/fp16/d256", 90): (984, "51cd1a1491063872"),
    ("dkdv/fp16/d256", 90): (1984, "440a853c00ec06fc"),
    ("dq/fp16/d256", 90): (2712, "d05e2565055836a1"),
    ("fused/fp16/d256", 90): (2704, "289b588879a74d16"),
    ("fwd/fp16/d40", 80): (3472, "cec03a5cb4781e02"),
    ("dkdv/fp16/d40", 80): (4320, "16017ded5d433e3a"),
    ("dq/fp16/d40", 80): (1928, "57bcc4539a0cff29"),
    ("fused/fp16/d40", 80): (3696, "0b9c36c171286e4c"),
    ("fwd/fp16/d200", 80): (5960, "8b3a01b2461dcad0"),
    ("dkdv/fp16/d200", 80): (4224, "28339c705a13fd33"),
    ("dq/fp16/d200", 80): (6368, "8a0283d019e56125"),
    ("fused/fp16/d200", 80): (4280, "9e9464af79945bac"),
    ("fwd/fp16/d40", 90): (3240, "b563d82cb2b0ce04"),
    ("desc/fp16/d40", 90): (2944, "c1cf9e8113c30fad"),
    ("dkdv/fp16/d40", 90): (3640, "1a864699be77c499"),
    ("dq/fp16/d40", 90): (2848, "94ddcba4cda5ea3c"),
    ("fused/fp16/d40", 90): (4232, "e1d89c154ce7d743"),
    ("fwd/fp16/d200", 90): (4776, "492c66d8a75c50d8"),
    ("desc/fp16/d200", 90): (2368, "6b6586d9f520547c"),
    ("dkdv/fp16/d200", 90): (4696, "c56033499f7c1dd4"),
    ("dq/fp16/d200", 90): (2200, "cd527d015cdc1c2a"),
    ("fused/fp16/d200", 90): (4416, "232084f99908c344"),
}
_ROW = re.compile(r"^(\S+)\s+(80|90)\s.*\s(\d+)\s([0-9a-f]{16})\s+ok \(", re.M)


@pytest.mark.parametrize("which", ["plain_report", "unaligned_report"])
def test_plain_kernels_compile_to_the_recorded_sass(which, request):
    import triton

    if triton.__version__ != PLAIN_SASS_TRITON:
        pytest.skip(f"the SASS digests were recorded with triton {PLAIN_SASS_TRITON}; this is {triton.__version__}")
    got = {(name, int(arch)): (int(n), digest) for name, arch, n, digest in _ROW.findall(request.getfixturevalue(which))}
    want = {key: val for key, val in PLAIN_SASS.items() if key in got}
    assert len(want) == (39 if which == "plain_report" else 18), sorted(got)
    changed = {key: (want[key], got[key]) for key in want if got[key] != want[key]}
    assert not changed, f"plain kernels whose SASS changed ((insns, digest) recorded -> now): {changed}"


def test_mode_variants_with_all_modes_on_compile_without_spills():
    # The modes kernels (band + top-left, float mask, dropout, dQ's mask gradient, softcap and
    # ALiBi all at once: the variant with the most code of each kernel) at the tiles
    # heuristics.tile_config gives those modes per arch: sm_80 fp16 d64 and sm_90 bf16 d128
    # (where dK/dV takes mma.sync, heuristics.MODE_CAPS), about 15 s a variant here, the two
    # arches side by side; and the split-K forward with both score modifiers. Every mode set at
    # both head dims, dtypes and arches takes ~30 min here: ``--modes`` alone, by hand.
    # The packed-sequence forward too: its per-sequence offsets must not spill either; and the
    # paged KV cache's forward and split-K decode (a page gathered per key: 64-bit offsets).
    # CI compiles the sm_90 half (bf16 d128, where the tiles are largest and HGMMA must hold):
    # about two minutes of one core; MHAKERN_SLOW=1 adds sm_80.
    arches = ("80", "90") if SLOW else ("90",)
    report = _aot("--modes", "all", "modifiers", "varlen", "paged", "--no-plain",
                  "--only", "fwd+all", "dkdv+all", "dq+all", "fused+all", "fwdsplit+modifiers", "fwd+varlen",
                  "fwd+paged", "fwdsplit+paged", arches=arches,
                  per_arch={"80": ["--dtypes", "fp16", "--dims", "64"], "90": ["--dtypes", "bf16", "--dims", "128"]})
    n = len(arches)
    assert report.count("+all ") == n * 4, report
    assert report.count("fwdsplit/") == n * 2 and report.count("+modifiers ") == n, report
    assert report.count("+varlen ") == n and report.count("+paged ") == n * 2, report
    assert report.count(" ok (") == n * 8, report
    assert re.search(r"dkdv/bf16/d128\+all\s+90\s+16x32 ", report), report
    assert re.search(r"fused/bf16/d128\+all\s+90\s+16x32 ", report), report


def test_mode_variants_take_the_tables_tiles_and_leave_mask_strides_unmarked():
    from mhakern.kernels import aot, heuristics

    built = {v.name: v for v in aot.variants(90, ("fp16",), (128,), modes=list(aot.MODE_SETS), plain=False)}
    modifiers_only = {m for m, ms in aot.MODE_SETS.items() if set(ms) <= {"SOFTCAP", "ALIBI"}}
    assert modifiers_only == {"softcap", "alibi", "modifiers"}
    cache = {m for m, ms in aot.MODE_SETS.items() if set(ms) & {"CACHE_IDX", "PAGED"}}
    assert cache == {"cache_idx", "paged"}
    # mask2grad is a backward mode (the forward has no mask gradient); the KV cache a forward one
    want = {f"{k}/fp16/d128+{m}" for k in ("fwd", "dkdv", "dq", "fused") for m in aot.MODE_SETS
            if (k in ("dq", "fused") or m != "mask2grad") and (k == "fwd" or m not in cache)}
    want |= {f"fwdsplit/fp16/d128+{m}" for m in modifiers_only | cache}
    assert set(built) == want
    for name, v in built.items():
        kernel, mode = name.split("/")[0], name.split("+")[1]
        ms = aot.MODE_SETS[mode]
        cfg = heuristics.tile_config("fwd" if kernel == "fwdsplit" else kernel, 128, 128, torch.float16, 90,
                                     band=ms.get("BAND", False), mask_kind=ms.get("MASK_KIND", 0),
                                     dropout=ms.get("DROPOUT", False), modified="SOFTCAP" in ms or "ALIBI" in ms)
        assert (v.constexprs["BLOCK_M"], v.constexprs["BLOCK_N"], v.num_warps, v.num_stages) == \
            (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages), name
        assert all(v.constexprs[n] == val for n, val in ms.items() if n in aot.constexpr_defaults(v.kernel)), name
        assert v.signature["SLOPES"] == "*fp32" and v.signature["softcap"] == "fp32", name
        if kernel == "fwdsplit":
            continue
        assert v.signature["MASK"] == ("*u8" if ms.get("MASK_KIND") == 1 else "*fp32"), name
        marked = aot.divisible_args(v.signature)
        assert "stride_qm" in marked and not any(n.startswith("stride_m") for n in marked), name
    assert built["dq/fp16/d128+all"].constexprs["MASK_GRAD"] and "MASK_GRAD" not in built["fwd/fp16/d128+all"].constexprs
    assert built["fused/fp16/d128+all"].constexprs["MASK_GRAD"]
    # sm_90 dK/dV d128 with a mask: mma.sync over 32 keys at one stage (MODE_CAPS), allowed by the check
    assert all(built[f"dkdv/fp16/d128+{m}"].constexprs["BLOCK_N"] == 32 for m in ("mask1", "mask2", "all"))
    assert built["dkdv/fp16/d128+band"].constexprs["BLOCK_N"] == 64
    assert heuristics.allows_mma_sync("dkdv", "16", 128, True, "mask+")
    assert not heuristics.allows_mma_sync("dkdv", "16", 128, True, "nomask")
    # no mode: the plain tile, on either arch
    for arch in (80, 90):
        assert heuristics.dkdv_config(128, 128, torch.float16, arch, mask_kind=0) == \
            heuristics.TILES[("dkdv", arch, "16", 128)]


def test_launchers_choose_tiles_from_the_table_with_the_calls_modes(monkeypatch):
    # The forward and backward launchers ask heuristics for the tile of the call's modes.
    import mhakern
    from mhakern.kernels import INTERPRET, attention_bwd, attention_fwd

    if not INTERPRET and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 or a GPU")
    asked = []

    def spy(name, real):
        def f(*a, **kw):
            asked.append((name, kw))
            return real(*a, **kw)
        return f

    monkeypatch.setattr(attention_fwd, "fwd_config", spy("fwd", attention_fwd.fwd_config))
    monkeypatch.setattr(attention_bwd, "fused_config", spy("fused", attention_bwd.fused_config))
    monkeypatch.setattr(attention_bwd, "dkdv_config", spy("dkdv", attention_bwd.dkdv_config))
    monkeypatch.setattr(attention_bwd, "dq_config", spy("dq", attention_bwd.dq_config))
    q, k, v = (torch.randn(1, 1, 8, 16, device=_DEV, requires_grad=True) for _ in range(3))
    mask = torch.rand(8, 8, device=_DEV) > 0.3
    mhakern.attention(q, k, v, attn_mask=mask, window=(2, 1), backend="triton").sum().backward()
    want = dict(band=True, mask_kind=1, dropout=False, modified=False)
    assert [n for n, _ in asked] == ["fwd", "fused"] and all(kw == want for _, kw in asked), asked
    from mhakern.kernels import heuristics

    monkeypatch.setattr(heuristics, "BWD_MODE", "split")
    asked.clear()
    mhakern.attention(q, k, v, attn_mask=mask, window=(2, 1), backend="triton").sum().backward()
    assert [n for n, _ in asked] == ["fwd", "dkdv", "dq"] and all(kw == want for _, kw in asked), asked


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


def test_sass_counts_tma_copies_and_those_in_loops():
    text = _listing(
        (0x00, "UTMALDG.4D [UR8], [UR4]"),  # Q, once
        (0x10, "SYNCS.ARRIVE.TRANS64.RED.A1T0 RZ, [UR5], RZ"),
        (0x20, "@!UP0 UTMALDG.4D [UR16], [UR10]"),  # K, per key block
        (0x30, "HGMMA.64x64x16.F32 R24, gdesc[UR28], RZ, !UPT"),
        (0x40, "@P0 BRA 0x10"),
        (0x50, "UTMASTG.4D [UR4], [UR6]"),
        (0x60, "EXIT"),
    )
    rep = sass.analyse(text, _USAGE)
    assert (rep.tma_loads, rep.tma_loads_in_loops, rep.tma_stores) == (2, 1, 1)


def test_sass_refuses_a_listing_without_resource_usage():
    with pytest.raises(ValueError, match="REG/STACK"):
        sass.analyse(_listing((0, "EXIT")), "nothing useful")


# --- The tensor-descriptor forward (mhakern/kernels/attention_fwd_desc.py), through the interpreter ----
# On CPU the predicate is forced (heuristics.DESC_MODE = "1"): the calls then take the
# descriptor kernel, which the interpreter runs like the GPU (rows past L and columns past the
# head dim read as zeros, stores clipped to the tensor).

def _desc_attention(monkeypatch):
    import mhakern
    from mhakern.kernels import INTERPRET, attention_fwd_desc, heuristics

    if not INTERPRET and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 or a GPU")
    if not heuristics._descriptors_available():
        pytest.skip("this triton has no tensor descriptors")
    monkeypatch.setattr(heuristics, "DESC_MODE", "1")
    calls = []
    real = attention_fwd_desc.desc_forward

    def spy(*a, **kw):
        calls.append(a[0].shape)
        return real(*a, **kw)

    monkeypatch.setattr(attention_fwd_desc, "desc_forward", spy)

    def fn(*a, **kw):
        return mhakern.attention(*a, backend="triton", **kw)

    return fn, calls


_DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    "B, H, Hkv, Lq, Lk, D, Dv, causal, kl, layout",
    [
        # GQA, Lq < Lk, key lengths with an empty batch element (rows that see no key), D = 40
        # (a box wider than the rows: columns past D read as zeros)
        (2, 4, 2, 37, 53, 40, 40, True, [50, 0], "bhld"),
        # Lq > Lk under causal: the first rows see no key; row tiles past Lq clipped
        (1, 2, 1, 70, 20, 32, 32, True, None, "blhd"),
        # decode: the query heads of a KV head packed into one tile (pointer Q/O, descriptor K/V)
        (2, 8, 2, 3, 45, 16, 16, True, [1, 45], "bhld"),
        # D != Dv, no causal, key lengths cutting a key block
        (1, 2, 2, 20, 30, 16, 32, False, [17], "bhld"),
    ],
)
def test_descriptor_forward_matches_the_reference(monkeypatch, B, H, Hkv, Lq, Lk, D, Dv, causal, kl, layout):
    from attn_testing import check_against_reference, make_inputs

    fn, calls = _desc_attention(monkeypatch)
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, Dv, dtype=torch.float16, device=_DEV, layout=layout,
                          requires_grad=False)
    key_lengths = None if kl is None else torch.tensor(kl, dtype=torch.int32, device=_DEV)
    check_against_reference(fn, q, k, v, causal, key_lengths, grads=False)
    assert calls, "the descriptor kernel did not run"


def test_descriptor_forward_gradients_and_nan_past_key_lengths(monkeypatch):
    # The backward (pointer kernels) reads the descriptor forward's lse; values past the key
    # length are real memory to a descriptor and must not reach out, even as NaN.
    from attn_testing import check_against_reference, make_inputs

    fn, calls = _desc_attention(monkeypatch)
    q, k, v = make_inputs(2, 2, 1, 19, 40, 16, dtype=torch.float16, device=_DEV)
    kl = torch.tensor([21, 40], dtype=torch.int32, device=_DEV)
    check_against_reference(fn, q, k, v, True, kl)
    with torch.no_grad():
        k[0, :, 21:] = float("nan")
        v[0, :, 21:] = float("nan")
    out = fn(q.detach(), k.detach(), v.detach(), causal=True, key_lengths=kl)
    assert torch.isfinite(out).all()
    assert len(calls) >= 2


@pytest.mark.parametrize(
    "kw",
    [{"window": (3, 0)}, {"causal_align": "top_left"}, {"dropout_p": 0.25}, {"attn_mask": "bool"}],
    ids=["window", "top_left", "dropout", "mask"],
)
def test_calls_with_modes_never_take_the_descriptor_kernel(monkeypatch, kw):
    # The descriptor kernel has no modes: even forced, a call with one takes the pointer kernel
    # and gets the mode's result (the hand-off in attention_forward passes the modes on).
    import mhakern

    fn, calls = _desc_attention(monkeypatch)
    q, k, v = (torch.randn(1, 2, 12, 16, dtype=torch.float16, device=_DEV) for _ in range(3))
    kw = dict(kw)
    if kw.get("attn_mask") == "bool":
        kw["attn_mask"] = torch.rand(12, 12, device=_DEV) > 0.3
    gen = torch.Generator(device=_DEV).manual_seed(3) if "dropout_p" in kw else None
    got = fn(q, k, v, causal=True, generator=gen, **kw)
    gen = torch.Generator(device=_DEV).manual_seed(3) if "dropout_p" in kw else None
    want = mhakern.attention(q.double(), k.double(), v.double(), causal=True, generator=gen, backend="reference", **kw)
    assert not calls, "a call with a mode went through the descriptor kernel"
    torch.testing.assert_close(got.double(), want, atol=2e-3, rtol=2e-3)


def test_descriptor_predicate_refuses_what_tma_cannot_address(monkeypatch):
    from mhakern.kernels import heuristics

    monkeypatch.setattr(heuristics, "DESC_MODE", "1")
    x = torch.zeros(1, 2, 8, 40, dtype=torch.float16)
    assert heuristics.desc_eligible(x, x, x, x)
    assert not heuristics.desc_eligible(x.float(), x.float(), x.float(), x.float())  # fp32: pointer path
    odd = torch.zeros(1, 2, 8, 36, dtype=torch.float16)  # 72-byte rows: not a multiple of 16 bytes
    assert not heuristics.desc_eligible(odd, odd, odd, odd)
    shifted = torch.zeros(2 * 8 * 40 + 1, dtype=torch.float16)[1:].view(1, 2, 8, 40)  # base off by 2 bytes
    assert not heuristics.desc_eligible(shifted, x, x, x)
    empty = torch.zeros(1, 2, 0, 40, dtype=torch.float16)  # no keys: the pointer path serves it
    assert not heuristics.desc_eligible(x, empty, empty, x)
    # one size-1 dim with a stride TMA would refuse is never stepped over
    assert heuristics.desc_eligible(torch.zeros(1, 1, 8, 40, dtype=torch.float16).as_strided((1, 1, 8, 40), (1, 3, 40, 1)),
                                    x, x, x)
    assert not heuristics.desc_eligible(x, x, x, x, plain=False)  # a mode or a score modifier
    monkeypatch.setattr(heuristics, "DESC_MODE", "auto")
    assert not heuristics.desc_eligible(x, x, x, x)  # CPU tensors: only when forced
