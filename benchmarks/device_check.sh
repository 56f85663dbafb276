#!/usr/bin/env bash
# The device check: one run on a fresh CUDA machine (torch, triton and nvcc installed, no
# network) that verifies every kernel family mhakern can route a call to on a 8.0 or 9.0 device
# against the float64 reference, then measures the headline rows beside the model's
# predictions, and leaves everything in OUTDIR.
#
#   benchmarks/device_check.sh OUTDIR
#
# The plan is one table, benchmarks/device_plan.py STEPS (run by benchmarks/device_check.py):
# install (tools/prebuilt.py's carried mhakern._C when torch, CUDA, the Python tag and the
# sources match; the build on the device otherwise), plan (pytest --collect-only: the tests of
# each step and so its cap), smoke, then the kernels never run on silicon first -- sm90_fwd,
# sm90_bwd_split, sm90_bwd_fused, mma_bwd_fused (with the D 256 backward), mma_modes (packed,
# cache_batch_idx, paged, split-K), triton_bwd, triton_cache (with four named mods of
# flex_attention's Triton kernels) --, bitident (every backward kernel
# in its own child), ceilings, bench (the decode rows first), report. By name only: decode,
# variants, ncu, triton_suite, cuda_suite, trainer.
#
# Every kernel family runs in its own child process under a watchdog shorter than its step's
# allowance. A child that does not finish is killed (its whole process group) and named
#   HUNG <family> <pass> <case>
# (CUT in place of HUNG where a test step's cap ran out while its test was under its own limit)
# and the check goes on (a test step starts again on the tests it had not run); a wrong answer:
#   WRONG <family> <pass> <case> <error> <bound>      (the tolerance rule's numbers)
# (and ERROR / CRASHED for an exception or a signal). Each step's verdicts are appended to
# OUTDIR/summary.md as it ends: a kill from outside loses nothing that finished.
#
# What the plan covers: the dry run prints one line per item,
#   covers: <family> <pass> <what> in <step>
# family: sm90 (the sm_90a kernels), mma (the mma.sync kernels), triton; pass: fwd or bwd; what,
# joined by '+', from: dense (plain calls, fp16 and bf16, D 64 and 128 and the family's others),
# d256 (head dim 256), varlen (packed sequences), paged (a paged KV cache), cache_batch_idx,
# splitk (split-K: decode, long keys, forced counts), split (the split backward), fused (the
# fused deterministic backward), fused_atomic (the fused backward with atomic dQ adds), bitident
# (two runs bit-identical, against the family's split kernel), flex (mhakern.flex_attention's
# generated kernels on named score_mod / mask_mod pairs) -- device_plan.py WHATS.
#
# OUTDIR receives at most 8 files (what the device machine gives back): setup.log (environment,
# install, build, smoke), tests.log (the GPU test steps and bitident), summary.md (the verdicts),
# bench.log, bench.json (pytest-benchmark JSON, input of python -m benchmarks.report), report.md
# (the benchmark report, each row beside the model's prediction, then the summary), diag.jsonl
# (ceilings, bitident rows), and with the named diagnostics diag.md and ncu.tar.gz.
#
# Without a GPU it records the environment, then stops with exit status 3.
# Environment knobs: PYTHON (default python3); DEVICE_CHECK_BUDGET_S (the whole run's; default
# device_plan.py BUDGET_S, about a tenth over the default stages' caps; a step whose allowance
# is spent is skipped and says so); DEVICE_CHECK_STAGES (names from the table, spaces or commas;
# default: every default step): a second run after fixes names only the steps it must repeat;
# DEVICE_CHECK_INSTALL=0 skips install and build (a rerun on a machine that has them);
# TORCH_CUDA_ARCH_LIST (default: this GPU's), MAX_JOBS (default: all cores), BENCH_ARGS (more
# pytest arguments for the bench step), TRAINER_CMD, DEVICE_CHECK_VARIANTS (device_diag.sh).
# DEVICE_CHECK_DRY_RUN=1 runs the environment step and the collection only: each later step is
# accounted at its full allowance (the worst case), and the accounting and the covers: lines are
# printed (tests/test_device_check.py runs it).
# DEVICE_CHECK_REHEARSAL=1 runs every step without a GPU (CPU rows: the cpu backend and the
# Triton interpreter in the smoke, the reference backend in bitident; the GPU tests skip);
# DEVICE_CHECK_PLANT=hang:<step> or wrong:<step> (a rehearsal only; one a run; steps: smoke,
# the test steps, bitident, bench (hang only)) makes that step's first child hang or return a
# perturbed result: the HUNG / WRONG line must name it, and every later step still report.
set -u
if [ $# -ne 1 ] || [ -z "$1" ]; then
    echo "usage: benchmarks/device_check.sh OUTDIR" >&2
    exit 2
fi
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
export PYTHON=$PY PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore MPLBACKEND=Agg
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
cd "$ROOT" && exec "$PY" -m benchmarks.device_check "$1"
