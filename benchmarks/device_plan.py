"""The device check's plan: one table of steps (what each runs, what it covers, what it costs).

benchmarks/device_check.py runs it; its dry run prints it. Every other fact about a step is
derived from its row here: the ``covers:`` lines, the time accounting, the HUNG / WRONG lines'
family and pass, which steps a planted fault may name. Nothing here imports torch.

What a step covers is written ``<family> <pass> <what>``: family ``sm90`` (the sm_90a kernels,
csrc/cuda/sm90), ``mma`` (the mma.sync kernels, csrc/cuda/mma), ``triton`` (kernels/); pass ``fwd``
or ``bwd``; what, joined by ``+``, from WHATS.

Costs. A pytest step's cap is ``slack x (start + tests x per_test)``, the tests counted by
``pytest --collect-only`` of its selection (the plan step on the device; the dry run here), the
per-test times taken from the last H200 run (docs/benchmarks/h200/report.md: the sm_90a file,
18 tests in 8.95 s with about 5 s of it the process start; the cuda file, 129 tests in 21 s;
the Triton GPU file, compile-bound, about 2 s a test on one process) and scaled for the larger
shapes added since. A child step's cap is ``slack x waves x per_child`` (a child of the last
run's smoke stage took 8.6 s: torch's import, the CUDA context, the first kernel). The rest are
fixed, from that run's log (install 46 s with the build, the headline benchmarks 61 s with 8
providers), with the slack written beside them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

FAMILIES = ("sm90", "mma", "triton")
PASSES = ("fwd", "bwd")
# What a covered item is (documented in benchmarks/device_check.sh and docs/testing.md):
WHATS = {
    "dense": "plain (B, H, L, D) calls, fp16 and bf16, D 64 and 128 (and the family's others), causal, GQA, key lengths",
    "d256": "head dim 256",
    "varlen": "packed variable-length sequences (mhakern.attention_varlen)",
    "paged": "a paged KV cache (attention_with_kvcache with block_table)",
    "cache_batch_idx": "a KV cache read through cache_batch_idx",
    "splitk": "split-K (several key splits merged through lse: decode and long keys, forced counts)",
    "split": "the split backward (dK/dV and dQ in separate kernels)",
    "fused": "the fused deterministic backward (one kernel, ordered dQ adds)",
    "fused_atomic": "the fused backward with atomic dQ adds (not deterministic)",
    "bitident": "two runs bit-identical where deterministic, against the family's split kernel",
    "flex": "mhakern.flex_attention's generated kernels: named score_mod / mask_mod pairs of tests/flex_cases.py "
            "on torch's BlockMask, with a learnable table's gradient",
}

# The whole run's default budget (DEVICE_CHECK_BUDGET_S): the default steps by their caps with
# about a tenth to spare, and a lent machine's 15 minutes leaving room for its start and a rerun.
BUDGET_S = 420
ENV_S = 5  # the environment step (torch's import, nvidia-smi): not capped, accounted at this in a dry run
GPU_TEST_FILES = ("tests/test_cuda_sm90_gpu.py", "tests/test_cuda.py", "tests/test_triton_gpu.py",
                  "tests/test_triton_varlen.py", "tests/test_triton_kvcache.py", "tests/test_conformance_flex.py")


@dataclass(frozen=True)
class Sel:
    """Tests of one function of one file; ``ids``: parametrization ids containing any of these
    substrings (None: all of them)."""
    file: str
    func: str
    ids: Optional[Tuple[str, ...]] = None

    def matches(self, nodeid: str) -> bool:
        path, _, rest = nodeid.partition("::")
        name, _, params = rest.partition("[")
        if path != self.file or name != self.func:
            return False
        return self.ids is None or any(s in params for s in self.ids)


@dataclass(frozen=True)
class Step:
    name: str
    kind: str  # install | build | plan | children | pytest | bench | ceilings | report | command
    what: str  # one line for the accounting
    family: str = "-"  # HUNG / WRONG lines' family and pass where a record does not say
    passname: str = "-"
    covers: Tuple[str, ...] = ()  # "family pass what+what"
    default: bool = True
    fixed_s: float = 0.0  # fixed cost (install, report, ...)
    start_s: float = 6.0  # process start: python, torch, pytest, the CUDA context
    per_test_s: float = 0.0  # pytest steps: wall seconds a test, with the step's xdist workers
    tests: Tuple[Sel, ...] = ()
    env: Tuple[Tuple[str, str], ...] = ()
    xdist: int = 0  # pytest-xdist workers where installed (compile-bound steps)
    # A test running longer is hung (its child is killed, the step starts again after it): 50x
    # the sm_90a file's mean test on the H200 (0.22 s); Triton's first calls compile.
    test_limit_s: float = 12.0
    per_child_s: float = 0.0  # children steps: the children and how many run at once
    children: int = 0
    parallel: int = 1
    slack: float = 1.4
    plantable: bool = False  # hang and wrong plants: the steps whose children check answers
    why: str = ""

    def cap(self, n_tests: Optional[int] = None) -> int:
        if self.kind == "pytest":
            n = len(self.tests) if n_tests is None else n_tests
            return int(math.ceil(self.slack * (self.start_s + self.per_test_s * n)))
        if self.kind == "children":
            waves = math.ceil(self.children / max(1, self.parallel))
            return int(math.ceil(self.slack * waves * self.per_child_s))
        return int(math.ceil(self.slack * self.fixed_s))


S90, CU, TG = "tests/test_cuda_sm90_gpu.py", "tests/test_cuda.py", "tests/test_triton_gpu.py"
TV, TK = "tests/test_triton_varlen.py", "tests/test_triton_kvcache.py"
CF = "tests/test_conformance_flex.py"
# The Triton flex tests of the triton_cache step: a score_mod with a learnable table (and its
# backward twice, bit for bit), a mask_mod with a score_mod at lengths that are not block
# multiples (torch's #153799), a bucketed learnable table under GQA, and the prefix-LM mask, which
# compares its index arguments with a captured tensor (it failed to trace on the H200 of
# 2026-12-04: the arguments were made on the CPU). Each compiles its own three kernels (forward,
# dQ, dK/dV), about as long as a Triton test of the step: the rest of the named mods run there
# when the file is named (DEVICE_CHECK_STAGES=triton_suite).
FLEX_MODS = ("triton-rel_bias", "triton-softcap_window_odd", "triton-t5_bucket", "triton-prefix_lm")

# Run order: the install, then the kernels never run on silicon (highest risk first), the
# bit-identity of every backward kernel, then the speed rows and the report. The steps after
# "report" run only when named in DEVICE_CHECK_STAGES.
STEPS: Tuple[Step, ...] = (
    Step("install", "install", "install mhakern (the prebuilt mhakern._C when it matches, else no extension yet)",
         fixed_s=10, slack=1.5, why="pip install -e . without a build: a few seconds; tools/prebuilt.py use first"),
    Step("build", "build", "build mhakern._C for this GPU (only when the prebuilt was not used)",
         fixed_s=60, slack=1.6, why="46 s on the last run; the 9.0 build grew by about 45 CPU-s since"),
    Step("plan", "plan", "pytest --collect-only of the GPU test files: the tests per step, their caps",
         fixed_s=16, slack=2.0, why="two collections side by side (the GPU test files, the benchmark rows): 5 s here, "
                                    "over 15 s for the first on a fresh H200 (2026-12-04: a cold start of CUDA torch)"),
    Step("smoke", "children", "smoke: each family once against the float64 reference, bad calls raise (one child each, in parallel)",
         family="sm90", passname="fwd", per_child_s=10, children=5, parallel=5, slack=2.0, plantable=True,
         covers=("sm90 fwd dense", "mma fwd dense", "mma bwd split", "sm90 bwd split", "triton fwd dense", "triton bwd fused"),
         why="8.6 s a child on the last run, all at once here: one wave"),
    Step("sm90_fwd", "pytest", "sm_90a forward: hard cases, pipeline shapes, D 256, packed, split-K (backward on mma.sync)",
         family="sm90", passname="fwd", per_test_s=0.35, plantable=True,
         covers=("sm90 fwd dense+d256+varlen+splitk",),
         env=(("MHAKERN_CUDA_FWD_FAMILY", "auto"), ("MHAKERN_CUDA_BWD_FAMILY", "mma_sync")),
         tests=(Sel(S90, "test_sm90_hard_cases_on_hopper"), Sel(S90, "test_sm90_pipeline_shapes_on_hopper"),
                Sel(S90, "test_sm90_d256_forward_on_hopper"), Sel(S90, "test_sm90_keys_past_a_length_may_hold_garbage_on_hopper"),
                Sel(S90, "test_sm90_forced_split_k_on_hopper"), Sel(S90, "test_sm90_packed_forward_on_hopper"))),
    Step("sm90_bwd_split", "pytest", "sm_90a split backward (opted in): backward shapes, determinism, split dQ, hidden keys",
         family="sm90", passname="bwd", per_test_s=0.35, plantable=True,
         covers=("sm90 bwd dense+split",),
         env=(("MHAKERN_CUDA_FWD_FAMILY", "auto"), ("MHAKERN_CUDA_BWD_FAMILY", "auto"), ("MHAKERN_CUDA_SM90_BWD", "split")),
         tests=(Sel(S90, "test_sm90_hard_cases_on_hopper", ("bf16",)), Sel(S90, "test_sm90_backward_shapes_on_hopper", ("auto",)),
                Sel(S90, "test_sm90_backward_is_deterministic_on_hopper"), Sel(S90, "test_sm90_backward_forced_split_dq_on_hopper"),
                Sel(S90, "test_sm90_backward_hidden_keys_never_leak_on_hopper"))),
    Step("sm90_bwd_fused", "pytest", "sm_90a fused backward (MHAKERN_CUDA_SM90_BWD=fused): the same tests",
         family="sm90", passname="bwd", per_test_s=0.35, plantable=True,
         covers=("sm90 bwd dense+fused",),
         env=(("MHAKERN_CUDA_FWD_FAMILY", "auto"), ("MHAKERN_CUDA_BWD_FAMILY", "auto"), ("MHAKERN_CUDA_SM90_BWD", "fused")),
         tests=(Sel(S90, "test_sm90_hard_cases_on_hopper", ("bf16",)), Sel(S90, "test_sm90_backward_shapes_on_hopper", ("auto",)),
                Sel(S90, "test_sm90_backward_is_deterministic_on_hopper"), Sel(S90, "test_sm90_backward_forced_split_dq_on_hopper"),
                Sel(S90, "test_sm90_backward_hidden_keys_never_leak_on_hopper"))),
    Step("mma_bwd_fused", "pytest", "mma.sync fused backward (MHAKERN_CUDA_MMA_BWD=fused) on the mma.sync forward; the D 256 backward",
         family="mma", passname="bwd", per_test_s=0.2, plantable=True,
         covers=("mma fwd dense", "mma bwd dense+fused+d256", "sm90 fwd d256"),
         env=(("MHAKERN_CUDA_MMA_BWD", "fused"),),
         tests=(Sel(CU, "test_hard_cases", ("mma_sync",)), Sel(CU, "test_every_dtype_and_head_dim", ("mma_sync",)),
                Sel(CU, "test_backward_is_deterministic"), Sel(S90, "test_sm90_d256_backward_on_hopper"))),
    Step("mma_modes", "pytest", "mma.sync: packed forward and backward, cache_batch_idx and paged decode, split-K, its split backward",
         family="mma", passname="fwd", per_test_s=0.25, plantable=True,
         covers=("mma fwd varlen+paged+cache_batch_idx+splitk", "mma bwd varlen+split", "sm90 fwd splitk"),
         tests=(Sel(CU, "test_packed_sequences_on_each_family"), Sel(CU, "test_kvcache_decode_paged_and_batch_idx"),
                Sel(CU, "test_decode_forced_splits_and_determinism"), Sel(CU, "test_long_keys_take_the_split_k_path"),
                Sel(CU, "test_forced_splits_agree_with_the_reference"),
                Sel(CU, "test_decode_kernel_against_the_reference", ("-128-bf16",)),
                Sel(S90, "test_sm90_backward_shapes_on_hopper", ("mma_sync",)))),
    Step("triton_bwd", "pytest", "Triton forward and fused deterministic backward (its default): hard cases, larger shapes, D 256",
         family="triton", passname="bwd", per_test_s=0.5, xdist=8, start_s=12, test_limit_s=30.0, plantable=True,
         covers=("triton fwd dense+d256", "triton bwd dense+fused+d256"),
         tests=(Sel(TG, "test_hard_cases_gpu", ("bfloat16",)), Sel(TG, "test_larger_shapes_gpu", ("True-",)),
                Sel(TG, "test_backward_deterministic_gpu"), Sel(TG, "test_large_logits_gpu"))),
    Step("triton_cache", "pytest", "Triton: packed forward and backward, KV cache (cache_batch_idx, paged), split-K decode; "
         "flex_attention's generated kernels on four named mods (fwd, lse, bwd, bit-identical rerun)",
         family="triton", passname="fwd", per_test_s=0.5, xdist=8, start_s=12, test_limit_s=30.0, plantable=True,
         covers=("triton fwd varlen+paged+cache_batch_idx+splitk+flex", "triton bwd varlen+fused+split+flex+bitident"),
         tests=(Sel(TV, "test_varlen_forward_and_backward"), Sel(TV, "test_varlen_never_reads_other_sequences"),
                Sel(TK, "test_kvcache_forward"), Sel(TG, "test_kvcache_decode_gpu"), Sel(TG, "test_packed_sequences_gpu"),
                Sel(TG, "test_decode_packing_gpu", ("bfloat16-4099",)), Sel(CF, "test_named_mods", FLEX_MODS),
                Sel(CF, "test_backward_bit_identical", ("triton",)))),
    Step("bitident", "children", "every backward kernel in its own child: two runs bit-identical, against its split peer, tolerance rule",
         family="-", passname="bwd", per_child_s=20, children=8, parallel=5, slack=1.5, plantable=True,
         covers=("sm90 bwd split+fused+bitident", "mma bwd split+fused+fused_atomic+bitident",
                 "triton bwd split+fused+fused_atomic+bitident"),
         why="L 4k causal, two runs and a ragged shape each; splits first, then 5 at once. On the H200 of 2026-12-04 "
             "the cuda children took 4.6-7.8 s, Triton's 10 s with a warm compile cache and over 14 s cold"),
    Step("ceilings", "ceilings", "the card's ceilings (8192^3 bf16 product, 2 GB copy)", fixed_s=7, slack=1.5),
    Step("bench", "bench", "headline benchmarks, decode rows first (mhakern:cuda and its backward kernels, mhakern:triton[, sdpa:cudnn)",
         fixed_s=42, slack=1.2, plantable=True,
         why="61 s for 96 rows on the last run (0.63 s a row); about 70 rows now (device_check.py bench_rows)"),
    Step("report", "report", "the benchmark report, each row beside the model's prediction", fixed_s=6, slack=1.5),
    # By name only.
    Step("decode", "command", "decode with planned and forced splits, both families (diag_gpu.py decode)", default=False, fixed_s=25),
    Step("variants", "command", "the sm_90a forward's compile-time variants at L 16k (built in the background)",
         default=False, fixed_s=25),
    Step("ncu", "command", "Nsight Compute on each main kernel (4 profiles)", default=False, fixed_s=72),
    Step("triton_suite", "pytest", "the Triton GPU file whole, the device-generic Triton suites and every named flex mod",
         family="triton", passname="fwd", default=False, per_test_s=0.6, xdist=8, start_s=14,
         tests=(Sel(TG, "test_hard_cases_gpu"), Sel(TG, "test_larger_shapes_gpu"), Sel(TG, "test_long_keys_decode_gpu"),
                Sel(TG, "test_decode_packing_gpu"), Sel(TG, "test_launched_kernels_do_not_spill_gpu"),
                Sel(TG, "test_batch_above_the_grid_limit_gpu"), Sel(TG, "test_auto_picks_a_compiled_gpu_backend"),
                Sel(CF, "test_named_mods", ("triton-",)), Sel(CF, "test_half_inputs", ("triton-",)),
                Sel(CF, "test_backward_bit_identical", ("triton",)))),
    Step("cuda_suite", "pytest", "the cuda GPU file whole (both families, every mode)", family="mma", passname="fwd",
         default=False, per_test_s=0.2, tests=tuple(Sel(CU, f) for f in (
             "test_hard_cases", "test_hard_cases_outside_the_kernels_fall_back", "test_every_dtype_and_head_dim",
             "test_self_attention_several_tiles", "test_strided_blhd_views_and_output_layout", "test_large_logits",
             "test_gqa_mqa_decode", "test_nan_rows_stay_nan_through_the_epilogues",
             "test_decode_planned_splits_and_garbage_past_lengths", "test_fully_masked_rows_give_zero_and_no_nan",
             "test_hidden_keys_may_hold_garbage", "test_auto_prefers_cuda_for_half_precision",
             "test_extension_checks_name_the_argument", "test_clamped_key_lengths_under_graph_capture",
             "test_misaligned_views_are_copied_not_refused", "test_top_left_and_windows", "test_forced_splits_with_windows",
             "test_auto_picks_cuda_for_windows_and_top_left", "test_attn_mask_and_its_gradient",
             "test_dropout_against_the_reference", "test_dropout_keep_mask_is_the_references_bit_for_bit",
             "test_cuda_backend_is_available_on_a_gpu"))),
    Step("trainer", "command", "the trainer's quick preset", default=False, fixed_s=25),
)
BY_NAME: Dict[str, Step] = {s.name: s for s in STEPS}
DEFAULT_STAGES = tuple(s.name for s in STEPS if s.default and s.kind not in ("install", "build", "plan"))
# Steps that run whenever the check runs (the rest only when named): install (unless
# DEVICE_CHECK_INSTALL=0), build (only when the prebuilt was not used) and plan.
ALWAYS = ("install", "build", "plan")


def covers_lines(steps: Sequence[Step]) -> List[str]:
    """``covers: <family> <pass> <what> in <step>`` for every item each step covers."""
    out = []
    for s in steps:
        for c in s.covers:
            fam, ps, what = c.split()
            out.append(f"covers: {fam} {ps} {what} in {s.name}")
    return out


def check_table() -> List[str]:
    """Problems of the table itself (a test asserts there are none)."""
    bad = []
    for s in STEPS:
        for c in s.covers:
            parts = c.split()
            if len(parts) != 3 or parts[0] not in FAMILIES or parts[1] not in PASSES:
                bad.append(f"{s.name}: covers {c!r} is not '<family> <pass> <what>'")
                continue
            for w in parts[2].split("+"):
                if w not in WHATS:
                    bad.append(f"{s.name}: covers {c!r}: {w!r} is not in WHATS")
        for sel in s.tests:
            if sel.file not in GPU_TEST_FILES:
                bad.append(f"{s.name}: {sel.file} is not among GPU_TEST_FILES")
    return bad


def selected(step: Step, nodeids: Sequence[str]) -> List[str]:
    """The collected node ids a pytest step runs, in the order of its selections."""
    out: List[str] = []
    seen = set()
    for sel in step.tests:
        for n in nodeids:
            if n not in seen and sel.matches(n):
                out.append(n)
                seen.add(n)
    return out


@dataclass
class Plan:
    """The steps of one run, with their caps (pytest steps' from the counted tests)."""
    steps: List[Step]
    counts: Dict[str, int] = field(default_factory=dict)

    def cap(self, step: Step) -> int:
        return step.cap(self.counts.get(step.name)) if step.kind == "pytest" else step.cap()


def parse_stages(text: Optional[str]) -> List[str]:
    """DEVICE_CHECK_STAGES: names separated by spaces or commas (default: DEFAULT_STAGES).
    Raises ValueError naming an unknown one."""
    names = [n for n in (text or "").replace(",", " ").split() if n]
    if not names:
        return list(DEFAULT_STAGES)
    unknown = [n for n in names if n not in BY_NAME or n in ALWAYS]
    if unknown:
        raise ValueError(f"DEVICE_CHECK_STAGES: unknown stage(s) {', '.join(unknown)}; expected names from: "
                         f"{' '.join(s.name for s in STEPS if s.name not in ALWAYS)}")
    return names


def plan_steps(stages: Sequence[str], install: bool = True) -> List[Step]:
    """The steps of a run in table order: install, build and plan first, then the named stages."""
    want = set(stages)
    out = []
    for s in STEPS:
        if s.name in ("install", "build"):
            if install:
                out.append(s)
        elif s.name == "plan" or s.name in want:
            out.append(s)
    return out
