#!/usr/bin/env bash
# The device check: one run on a fresh CUDA machine (torch, triton and nvcc installed, no
# network) that verifies and diagnoses: it installs mhakern and builds its kernels for this GPU,
# runs a smoke stage (each GPU backend once against the reference, bad calls at the C++ boundary
# that must raise), the GPU tests under each backward kernel's run-time setting, each in its own
# child process under its own cap (the sm_90a family with its backward opted in, split and fused
# -- MHAKERN_CUDA_SM90_BWD=fused --; the cuda backend's hard cases, and again with the fused
# mma.sync backward -- MHAKERN_CUDA_MMA_BWD=fused --; the Triton GPU file under its default
# fused deterministic backward), every backward kernel run twice for bit-identity and against
# its family's split kernel and the tolerance rule (benchmarks/diag_gpu.py bitident), and the
# headline benchmarks (a row per backward kernel on the backward rows) with the chip's matmul
# and copy ceilings measured in the same run, and leaves everything in OUTDIR. By name (not in
# the default stages): the compile-time variants of the sm_90a forward at L 16k whose
# differences split a step into load wait, softmax and overlap (benchmarks/diag_fwd_sm90.cu),
# decode with forced split counts on both kernel families (benchmarks/diag_gpu.py), and Nsight
# Compute on each main kernel (--clock-control none: the clocks as the run finds them). The whole run fits 6 minutes
# on one H200 by its own accounting (DEVICE_CHECK_BUDGET_S, default 360): each step runs under
# a time limit (its cap, less what the later steps reserve), and a step whose allowance is spent
# is skipped and says so; so a second run (after fixes, or with DEVICE_CHECK_STAGES naming only
# some stages) fits the same 15-minute lease.
#
#   benchmarks/device_check.sh OUTDIR
#
# OUTDIR receives at most 8 files (what the device machine gives back):
#   setup.log    environment, GPU, the install and extension build, the variants' builds, the
#                ceilings and the smoke stage
#   tests.log    the GPU tests and the backward kernels' bit-identity run
#   bench.log    pytest-benchmark output of the headline rows and the report's log
#   bench.json   pytest-benchmark JSON (input of python -m benchmarks.report, which also draws
#                the plots from it elsewhere)
#   report.md    the benchmark report, ending with this check's summary
#   diag.md      the diagnostics in tables: forward variants, decode splits, ncu's headline metrics
#   diag.jsonl   the same rows as JSON, one object per line (input of tools/perf_model.py)
#   ncu.tar.gz   Nsight Compute: per kernel the report (.ncu-rep), its details page and its
#                per-SASS-instruction source page (stall samples) as CSV, the metric names found
# and prints a short summary at the end.
#
# Without a GPU it records the environment, then stops with a clear message and exit status 3.
# Environment knobs: PYTHON (default python3), DEVICE_CHECK_BUDGET_S (default 360 s for the
# whole run), DEVICE_CHECK_STAGES (default "smoke sm90 cuda triton bitident bench": the stages
# after the install, in this order; "variants decode ncu" (the forward's diagnostics, out of the
# default since the backward kernels' verification needs their time) and "triton_suite other
# trainer" are available by name), TORCH_CUDA_ARCH_LIST (default: this GPU's), MAX_JOBS
# (default: all cores), TRAINER_CMD (default: the quick preset through python -m mhakern.memorize).
# DEVICE_CHECK_INSTALL=0 skips the install (a rerun on a machine that still has the build);
# DEVICE_CHECK_VARIANTS="production no_loads" builds only those forward variants (default: all
# seven: production, stages2, coupled_kv (K held until P V lands, as one coupled K/V stage was),
# persistent0 (one CTA per work item), no_softmax, no_loads, and the pin flipped).
# DEVICE_CHECK_REHEARSAL=1 runs every step even without a GPU (CPU rows; a developer's dry run
# of this script in a scratch environment -- it installs the package into PYTHON's environment).
# DEVICE_CHECK_DRY_RUN=1 runs nothing but the environment step: each later step is accounted
# at its full cap (the worst case), and the accounting is printed (a check, on any machine, that
# the stages fit the budget; tests/test_device_check.py runs it).

set -u
if [ $# -ne 1 ] || [ -z "$1" ]; then
    echo "usage: benchmarks/device_check.sh OUTDIR" >&2
    exit 2
fi
OUT=$1
mkdir -p "$OUT" || { echo "device_check: cannot create OUTDIR $OUT" >&2; exit 2; }
OUT=$(cd "$OUT" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2
PY=${PYTHON:-python3}
BUDGET=${DEVICE_CHECK_BUDGET_S:-360}
STAGES=" ${DEVICE_CHECK_STAGES:-smoke sm90 cuda triton bitident bench} "
DRY=${DEVICE_CHECK_DRY_RUN:-0}
stage() { [[ "$STAGES" == *" $1 "* ]]; }
T0=$SECONDS
SIM=0  # seconds a dry run accounts for the steps it does not run (each at its cap)
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore MPLBACKEND=Agg
declare -a SUMMARY=()
declare -a ACCOUNT=()

now() { echo $((SECONDS - T0 + SIM)); }
note() { echo "device_check [$(now)s]: $*"; }
say() { SUMMARY+=("$*"); }
# Seconds a step may take: its cap, less what the later steps reserve, never beyond the budget.
allow() {
    local cap=$1 left=$((BUDGET - $(now) - $2))
    [ "$left" -lt "$cap" ] && cap=$left
    echo "$cap"
}
# run_step NAME LOG CAP RESERVE CMD...: runs CMD under its time allowance, appending to LOG.
# SIGINT first, so that pytest still writes its JSON and summary, then KILL 15 s later. A dry
# run accounts the whole allowance instead of running CMD.
run_step() {
    local name=$1 log=$2 cap=$3 reserve=$4
    shift 4
    local t
    t=$(allow "$cap" "$reserve")
    if [ "$t" -lt 10 ]; then
        note "$name: SKIPPED, the time budget is spent (cap ${cap}s, ${t}s left after the later steps' ${reserve}s)"
        echo "SKIPPED: time budget spent" >>"$log"
        ACCOUNT+=("$(printf '%-58s cap %4ss  SKIPPED (budget spent)' "$name" "$cap")")
        say "$name: SKIPPED (the time budget was spent)"
        return 124
    fi
    if [ "$t" -lt "$cap" ]; then note "$name: allowance cut to ${t}s of its ${cap}s cap"; fi
    ACCOUNT+=("$(printf '%-58s cap %4ss  allowed %4ss  from %4ss' "$name" "$cap" "$t" "$(now)")")
    if [ "$DRY" = "1" ]; then
        note "$name (dry run: accounted ${t}s) would run: $*"
        SIM=$((SIM + t))
        return 0
    fi
    note "$name (up to ${t}s) -> $(basename "$log")"
    echo "\$ $* (time limit ${t}s)" >>"$log"
    local t1=$SECONDS
    timeout -s INT -k 15 "$t" "$@" >>"$log" 2>&1
    local rc=$?
    echo "[exit status $rc after $((SECONDS - t1))s]" >>"$log"
    [ "$rc" -eq 124 ] && note "$name: stopped at its time limit (${t}s)"
    return "$rc"
}
pytest_counts() { # the last pytest result line of a log, e.g. "12 passed, 3 skipped in 40.1s"
    grep -E "^=*\s*[0-9]+ (passed|failed|errors?|skipped|deselected)|no tests ran" "$1" | tail -1 | sed -E 's/=+//g; s/^ +| +$//g'
}
finish() {
    local status=$1
    {
        echo ""
        echo "## Device check summary"
        echo ""
        for line in "${SUMMARY[@]}"; do echo "- $line"; done
        echo "- total wall time: $(now) s$([ "$DRY" = "1" ] && echo ' (dry run: the steps accounted at their allowances)') of the ${BUDGET} s budget"
    } >"$OUT/.summary.md"
    if [ -f "$OUT/report.md" ]; then cat "$OUT/.summary.md" >>"$OUT/report.md"; else cat "$OUT/.summary.md" >>"$OUT/setup.log"; fi
    echo ""
    echo "================ device check: time accounting (budget ${BUDGET}s) ================"
    for line in "${ACCOUNT[@]}"; do echo "  $line"; done
    echo "  total: $(now)s of ${BUDGET}s$([ "$(now)" -le "$BUDGET" ] && echo ' (fits)' || echo ' (OVER BUDGET)')"
    echo "================ device check summary ================"
    for line in "${SUMMARY[@]}"; do echo "  $line"; done
    echo "  total wall time: $(now) s; files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
    echo "======================================================="
    rm -f "$OUT/.summary.md"
    exit "$status"
}

# ------------------------------------------------------------------ 1. environment
SETUP=$OUT/setup.log
: >"$SETUP"
note "environment -> setup.log"
{
    echo "# device check of mhakern at $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?') ($(date -u +%FT%TZ))"
    echo "python: $(command -v "$PY") $("$PY" --version 2>&1)"
    echo "cores: $(nproc)"
    if command -v nvidia-smi >/dev/null; then nvidia-smi 2>&1 | head -15; else echo "nvidia-smi: not found"; fi
    if command -v nvcc >/dev/null; then nvcc --version 2>&1 | tail -2; else echo "nvcc: not found on PATH"; fi
} >>"$SETUP" 2>&1
ENV_LINE=$("$PY" - <<'EOF' 2>>"$SETUP"
import torch
try:
    import triton
    tv = triton.__version__
except Exception as e:
    tv = f"not importable ({type(e).__name__})"
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {tv}, GPU: {gpu}")
EOF
)
[ -z "$ENV_LINE" ] && ENV_LINE="torch does not import with $PY (see setup.log)"
echo "$ENV_LINE" >>"$SETUP"
NVCC=$(command -v nvcc >/dev/null && nvcc --version 2>&1 | grep -o 'release [0-9.]*' | head -1)
say "machine: $ENV_LINE; $(nproc) cores; nvcc ${NVCC:-not found}"
HAVE_GPU=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
if [ "$HAVE_GPU" != "1" ] && [ "${DEVICE_CHECK_REHEARSAL:-0}" != "1" ] && [ "$DRY" != "1" ]; then
    say "STOPPED: no CUDA device is visible to torch (torch.cuda.is_available() is False): this check needs one; nothing was installed or run"
    note "no CUDA device: stopping (setup.log has the environment)"
    finish 3
fi

# The steps' caps in seconds, in run order (one table). Each step runs under its cap, cut to what
# the budget has left less the report's cap (the report always runs); the default caps sum to
# the budget, so in the default run every step gets its whole cap, and under a smaller budget
# the later steps are the ones skipped (each says so).
# Measured on the last H200 run (348 s for the older set of stages): install 46 s, smoke 52 s
# (now capped lower: it skips checks past its own budget), sm_90a tests 9 s, cuda tests 21 s,
# the headline benchmarks 61 s with 8 providers; the Triton suite ran past 68 s with xdist (its
# GPU file alone now, with a narrower second pass).
# Each backward kernel's GPU tests run under its run-time setting (sm90_fused: the sm90 family's
# fused kernel, cuda_fused: the mma.sync family's, triton: its default deterministic fused
# kernel), then the bit-identity step runs every backward kernel; the forward's diagnostics
# (variants 25 s, decode 25 s, ncu 4 x 18 s) left the default stages to pay for them and for the
# larger build.
# The environment step before them takes a few seconds (not capped; it counts against the budget).
STEP_ORDER=(install ceilings smoke sm90 sm90_fused cuda cuda_fused triton bitident bench variants decode ncu_fwd ncu_bwd ncu_decode ncu_decode_mma triton_suite other trainer report)
# install: 46 s measured with fewer kernels; since then the nvcc work of the 9.0 build (one
# sm_90a pass per .cu) grew by about 45 CPU-s to about 150 CPU-s (28 files timed one at a time
# on a 2-core Xeon: backward files 8-10 s, forwards 4-5 s, sm90 files 2-4 s), i.e. +3 s on 16
# cores, +11 s at a poor 4-way overlap: about 50-57 s expected; cap 90 s, a build killed by its
# cap costs the whole session.
declare -A CAP=([install]=90 [ceilings]=10 [smoke]=20 [sm90]=15 [sm90_fused]=15 [cuda]=25 [cuda_fused]=20
                [triton]=45 [bitident]=35 [bench]=60 [variants]=25 [decode]=25 [ncu_fwd]=18 [ncu_bwd]=18
                [ncu_decode]=18 [ncu_decode_mma]=18 [triton_suite]=70 [other]=25 [trainer]=25 [report]=10)
step_enabled() {
    case $1 in
        install) [ "${DEVICE_CHECK_INSTALL:-1}" != "0" ] ;;
        report) stage bench ;;
        ceilings) stage bench ;;
        sm90_fused) stage sm90 ;;
        cuda_fused) stage cuda ;;
        ncu_*) stage ncu ;;
        *) stage "$1" ;;
    esac
}
reserve_after() {  # what must stay for the steps after $1: the report's cap, if it is to run
    if [ "$1" != "report" ] && step_enabled report; then echo "${CAP[report]}"; else echo 0; fi
}
# step KEY NAME LOG CMD...: run_step with the table's cap and reserve.
step() {
    local key=$1 name=$2 log=$3
    shift 3
    run_step "$name" "$log" "${CAP[$key]}" "$(reserve_after "$key")" "$@"
}

# ------------------------------------------------------------------ 2. install (no deps, no isolation, all cores)
if [ "$HAVE_GPU" = "1" ] && [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
    # Only this GPU's architecture: half the nvcc work of the default list.
    TORCH_CUDA_ARCH_LIST=$("$PY" -c "import torch; a, b = torch.cuda.get_device_capability(); print(f'{a}.{b}')")
    export TORCH_CUDA_ARCH_LIST
fi
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
echo "TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-} MAX_JOBS=$MAX_JOBS" >>"$SETUP"
# The pure-Python install (the GPU machine has no network, so no build isolation: pip could not
# fetch setuptools), then the compiled kernels built the way a plain `pip install -e .` user gets
# them: the first-use build, ahead of time (python -m mhakern.build), for this GPU's arch only. A
# CUDA part that fails to build fails here instead of falling back to the CPU kernels unnoticed.
export MHAKERN_REQUIRE_CUDA=1
if [ "${DEVICE_CHECK_INSTALL:-1}" = "0" ]; then
    note "install: skipped (DEVICE_CHECK_INSTALL=0: a rerun on a machine that has the build)"
else
step install "install and build" "$SETUP" bash -c "MHAKERN_NO_EXTENSION=1 \"$PY\" -m pip install --no-index --no-deps --no-build-isolation -e . && \"$PY\" -m mhakern.build"
rc=$?
if [ $rc -ne 0 ]; then
    say "install: FAILED (exit $rc, see setup.log)"
    finish 1
fi
fi
if [ "$DRY" != "1" ]; then
    BACKENDS=$("$PY" - <<'EOF' 2>>"$SETUP"
import sys
import mhakern
try:
    import mhakern._C  # noqa: F401
    ext = "mhakern._C built"
except Exception as e:
    ext = f"mhakern._C missing ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
be = mhakern.available_backends()
for n, why in be.items():
    print(f"backend {n}: {'usable' if why is None else why}", file=sys.stderr)
usable = [n for n, why in be.items() if why is None]
print(f"{ext}; usable backends: {', '.join(usable) or 'none'}; unavailable: {', '.join(n for n in be if n not in usable) or 'none'} (reasons in setup.log)")
EOF
)
    echo "$BACKENDS" >>"$SETUP"
    if [ "${DEVICE_CHECK_INSTALL:-1}" = "0" ]; then say "install: skipped (DEVICE_CHECK_INSTALL=0); ${BACKENDS:-mhakern does not import (see setup.log)}"
    else say "install: ok in $(grep -o 'exit status 0 after [0-9]*s' "$SETUP" | tail -1 | grep -o '[0-9]*s$'); ${BACKENDS:-mhakern does not import (see setup.log)}"; fi
fi

# ------------------------------------------------------------------ 2b. the forward's diagnostic variants, built in the background
# One binary per compile-time variant of the sm_90a forward (csrc/cuda/sm90/attn_fwd_sm90_kernel.cuh's
# MHK_SM90_FWD_DIAG_* / MHK_SM90_FWD_PIN_SOFTMAX), built in parallel while the tests run (the GPU
# stages leave the cores idle); the variants stage waits for them. NAME:FLAGS.
PIN_DEFAULT=$(grep -oE '#define MHK_SM90_FWD_PIN_SOFTMAX [01]' csrc/cuda/sm90/attn_fwd_sm90_kernel.cuh | grep -oE '[01]$')
PIN_OTHER=$((1 - ${PIN_DEFAULT:-0}))
VARIANTS=()
for v in "production:" "stages2:-DMHK_SM90_FWD_DIAG_STAGES=2" "coupled_kv:-DMHK_SM90_FWD_DIAG_COUPLED_KV=1" \
         "persistent0:-DMHK_SM90_FWD_PERSISTENT=0" \
         "no_softmax:-DMHK_SM90_FWD_DIAG_NO_SOFTMAX=1" "no_loads:-DMHK_SM90_FWD_DIAG_NO_LOADS=1" \
         "pin${PIN_OTHER}:-DMHK_SM90_FWD_PIN_SOFTMAX=${PIN_OTHER}"; do
    # DEVICE_CHECK_VARIANTS="production no_loads" keeps some (default: all)
    [[ " ${DEVICE_CHECK_VARIANTS:-${v%%:*}} " == *" ${v%%:*} "* ]] && VARIANTS+=("$v")
done
# The Python diagnostics run their CPU rehearsal where no GPU is (DEVICE_CHECK_REHEARSAL=1).
DIAG_FLAGS=()
[ "$HAVE_GPU" != "1" ] && DIAG_FLAGS=(--rehearse)
VDIR=$(mktemp -d)
DIAG_MD=$OUT/diag.md
DIAG_JSON=$OUT/diag.jsonl
: >"$DIAG_JSON"
{ echo "# Device check diagnostics ($(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?'), $(date -u +%FT%TZ))"; echo; } >"$DIAG_MD"
VBUILD_PID=""
if stage variants && [ "$DRY" != "1" ] && command -v nvcc >/dev/null; then
    (
        for v in "${VARIANTS[@]}"; do
            name=${v%%:*}
            flags=${v#*:}
            # shellcheck disable=SC2086
            timeout 170 nvcc -std=c++17 -O3 -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ \
                -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ --expt-relaxed-constexpr \
                -gencode=arch=compute_90a,code=sm_90a -I csrc/cuda -DMHK_SM90_FWD_DIAG_BUILD $flags \
                benchmarks/diag_fwd_sm90.cu -o "$VDIR/$name" >"$VDIR/$name.log" 2>&1 &
        done
        wait
        touch "$VDIR/.done"
    ) &
    VBUILD_PID=$!
    note "building the forward variants in the background: ${VARIANTS[*]}"
fi

# ------------------------------------------------------------------ 3. ceilings and smoke
# The chip's two ceilings, measured here (a device-to-device copy, a large bf16 product), so that
# the figures below can be read against this card as found.
if stage bench; then
    : >"$OUT/.ceil.log"
    step ceilings "ceilings (8192^3 bf16 product, 2 GB copy)" "$OUT/.ceil.log" "$PY" benchmarks/diag_gpu.py ceilings "${DIAG_FLAGS[@]}" --json "$DIAG_JSON"
    CEIL=$(grep '^diag: ceilings: ' "$OUT/.ceil.log" | tail -1 | sed 's/^diag: ceilings: //')
    cat "$OUT/.ceil.log" >>"$SETUP"
    rm -f "$OUT/.ceil.log"
    say "ceilings of this card: ${CEIL:-not measured (see setup.log)}"
    [ "$HAVE_GPU" = "1" ] && nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv >>"$SETUP" 2>&1
fi
SMOKE_DEV=$([ "$HAVE_GPU" = "1" ] && echo cuda || echo cpu)
BENCH_SKIP=()
if stage smoke; then
    : >"$OUT/.smoke.log"
    step smoke "smoke: each GPU backend once (child processes), C++ errors raise" "$OUT/.smoke.log" "$PY" -m benchmarks.device_smoke --device "$SMOKE_DEV" --budget-s $((CAP[smoke] - 5))
    rc0=$?
    cat "$OUT/.smoke.log" >>"$SETUP"
    while IFS= read -r line; do say "$line"; done < <(grep '^smoke: ' "$OUT/.smoke.log")
    [ "$rc0" -ne 0 ] && say "smoke: exit $rc0 (the later stages run anyway: their failures say more)"
    if grep -q '^smoke-decision: MHAKERN_CUDA_FWD_FAMILY=mma_sync' "$OUT/.smoke.log"; then
        # The sm90 forward hung or crashed: every later stage but its own file runs the mma.sync
        # family, so that one broken family does not cost the rest of the run.
        export MHAKERN_CUDA_FWD_FAMILY=mma_sync
        say "the sm90 forward hung or crashed in the smoke stage: later stages (not tests/test_cuda_sm90_gpu.py) run with MHAKERN_CUDA_FWD_FAMILY=mma_sync"
    fi
    if grep -q '^smoke-decision: skip the sm90 backward' "$OUT/.smoke.log"; then
        BENCH_SKIP=(--bench-skip "sm90 bwd" --bench-skip "sm90 fused bwd")
        SKIP_SM90_BWD=1
        say "the opt-in sm90 backward hung or crashed in the smoke stage: its fused-kernel tests, the benchmarks and the bit-identity run leave it out"
    fi
    rm -f "$OUT/.smoke.log"
fi

# ------------------------------------------------------------------ 4. GPU tests, per backend
TESTS=$OUT/tests.log
: >"$TESTS"
PYTEST_EXTRA=()
"$PY" -c "import pytest_timeout" 2>/dev/null && PYTEST_EXTRA+=(--timeout=60)
# gpu_tests KEY NAME FILES/ARGS...: one pytest run, its counts (and first failures) in the summary.
gpu_tests() {
    local key=$1 name=$2
    shift 2
    : >"$OUT/.t.log"
    step "$key" "GPU tests: $name" "$OUT/.t.log" "$PY" -m pytest "$@" -q -p no:cacheprovider -rfE "${PYTEST_EXTRA[@]}"
    local rc=$?
    cat "$OUT/.t.log" >>"$TESTS"
    [ "$DRY" != "1" ] && say "GPU tests, $name: $(pytest_counts "$OUT/.t.log") [exit $rc]"
    while IFS= read -r line; do say "  $line"; done < <(grep -E '^(FAILED|ERROR) ' "$OUT/.t.log" | head -6 | cut -c1-220)
    rm -f "$OUT/.t.log"
    return "$rc"
}
rc1=0
# hung_kernel RC LABEL PROVIDER: a fused backward's tests stopped at their time limit (a kernel
# that waits on a dQ counter forever hangs the process): the bit-identity step and the
# benchmarks leave that kernel out rather than hang on it again.
BI_SKIP_LABELS=""
hung_kernel() {
    if [ "$1" -eq 124 ] || [ "$1" -eq 137 ]; then
        BI_SKIP_LABELS="$BI_SKIP_LABELS${BI_SKIP_LABELS:+,}$2"
        BENCH_SKIP+=(--bench-skip "$3")
        say "the $2 backward's tests stopped at their time limit: the bit-identity step and the benchmarks leave it out"
    fi
}
# The sm_90a family's own GPU file first, with both passes as the host picks them and the sm90
# backward opted in (MHAKERN_CUDA_BWD_FAMILY=auto; kSm90BwdByDefault is off until this passes),
# alone: a hang there costs this step only; then the same file with the fused sm90 backward
# (MHAKERN_CUDA_SM90_BWD=fused), each in its own child process under its own cap.
if stage sm90; then
    MHAKERN_CUDA_FWD_FAMILY=auto MHAKERN_CUDA_BWD_FAMILY=auto gpu_tests sm90 "sm_90a family, backward opted in (tests/test_cuda_sm90_gpu.py)" tests/test_cuda_sm90_gpu.py || rc1=1
    if [ "${SKIP_SM90_BWD:-0}" != "1" ]; then
        MHAKERN_CUDA_FWD_FAMILY=auto MHAKERN_CUDA_BWD_FAMILY=auto MHAKERN_CUDA_SM90_BWD=fused gpu_tests sm90_fused "sm_90a family, fused sm90 backward (MHAKERN_CUDA_SM90_BWD=fused, tests/test_cuda_sm90_gpu.py)" tests/test_cuda_sm90_gpu.py
        rc=$?
        [ "$rc" -ne 0 ] && rc1=1
        hung_kernel "$rc" "sm90 fused" "sm90 fused bwd"
    fi
fi
# The cuda backend: its GPU file (the hard cases under both forward families on a 9.0 device),
# then the conformance suite (hard cases in every dtype, modes, NaN/inf contract) restricted to it;
# then its GPU file with the mma.sync family's fused backward (MHAKERN_CUDA_MMA_BWD=fused; its
# atomic twin is not deterministic, so the determinism tests would fail by design: the
# bit-identity step checks it against the tolerance rule instead).
if stage cuda; then
    gpu_tests cuda "cuda backend (tests/test_cuda.py, conformance -k cuda)" tests/test_cuda.py tests/test_conformance.py -k "cuda or not conformance" || rc1=1
    MHAKERN_CUDA_MMA_BWD=fused gpu_tests cuda_fused "cuda backend, fused mma.sync backward (MHAKERN_CUDA_MMA_BWD=fused, tests/test_cuda.py)" tests/test_cuda.py
    rc=$?
    [ "$rc" -ne 0 ] && rc1=1
    hung_kernel "$rc" "mma.sync fused" "mma fused bwd"
fi
# The Triton backend's GPU file under its default backward (the fused deterministic kernel,
# MHAKERN_TRITON_BWD unset), compiled by xdist workers sharing one kernel cache; its atomic
# mode is checked by the bit-identity step (tolerance rule), its split mode ran on the last run.
XDIST=()
"$PY" -c "import xdist" 2>/dev/null && XDIST=(-n "$(( $(nproc) / 2 > 8 ? 8 : $(nproc) / 2 ))")
if stage triton; then
    # The forward-only decode tests (the Triton forward ran on the last H200 run) stay in the
    # triton_suite stage.
    gpu_tests triton "triton backend, fused deterministic backward (tests/test_triton_gpu.py, not the decode tests)" "${XDIST[@]}" tests/test_triton_gpu.py -k "not long_keys_decode and not decode_packing" || rc1=1
fi
# Every backward kernel: two runs bit-identical where deterministic, against its family's split
# kernel, and the tolerance rule on a ragged GQA shape (benchmarks/diag_gpu.py BWD_KERNELS).
if stage bitident; then
    [ "${SKIP_SM90_BWD:-0}" = "1" ] && BI_SKIP_LABELS="$BI_SKIP_LABELS${BI_SKIP_LABELS:+,}sm90"
    BI_SKIP=()
    [ -n "$BI_SKIP_LABELS" ] && BI_SKIP=(--skip "$BI_SKIP_LABELS")
    : >"$OUT/.b.log"
    step bitident "backward kernels: two runs bit-identical, fused against split (L 4k, causal)" "$OUT/.b.log" "$PY" benchmarks/diag_gpu.py bitident --causal "${BI_SKIP[@]}" "${DIAG_FLAGS[@]}" --json "$DIAG_JSON" || rc1=1
    cat "$OUT/.b.log" >>"$TESTS"
    while IFS= read -r line; do say "${line#diag: }"; done < <(grep '^diag: ' "$OUT/.b.log")
    rm -f "$OUT/.b.log"
fi

# ------------------------------------------------------------------ 5. headline benchmarks
BENCH=$OUT/bench.log
: >"$BENCH"
if stage bench; then
    BENCH_FILES=(benchmarks/test_bench_attention.py)
    # mhakern's cuda backend as it runs by default, with both passes on mma.sync and with the
    # opt-in sm90 backward, and on the backward rows each fused backward kernel (mhakern:cuda
    # matches all five: the mma.sync and sm90 fused kernels), the Triton backward's fused
    # deterministic and split kernels (mhakern:triton[ matches both; backward rows only), and the
    # field's fused kernels. Triton's forward, auto and SDPA's efficient kernel were measured on
    # the last run (docs/benchmarks/h200) and are not what this run diagnoses; BENCH_ARGS adds
    # providers back.
    PROVIDERS=(--bench-provider mhakern:cuda --bench-provider "mhakern:triton[" --bench-provider sdpa:flash
               --bench-provider sdpa:cudnn --bench-provider flash-attn --bench-provider xformers)
    step bench "headline benchmarks" "$BENCH" "$PY" -m pytest "${BENCH_FILES[@]}" --benchmark-only --bench-set headline \
        "${PROVIDERS[@]}" "${BENCH_SKIP[@]}" --benchmark-json "$OUT/bench.json" --benchmark-columns=median,iqr,rounds -q -p no:cacheprovider ${BENCH_ARGS:-}
    rc=$?
    [ "$DRY" != "1" ] && say "benchmarks (${BENCH_FILES[*]}, headline set): $(pytest_counts "$BENCH") [exit $rc]"
fi

# ------------------------------------------------------------------ 6. the forward's variants at L 16k
if stage variants; then
    : >"$OUT/.v.log"
    run_variants() {  # runs in a child shell (under the step's time limit): polls for the builds
        while [ ! -f "$VDIR/.done" ]; do sleep 1; done
        local v name
        for v in "${VARIANTS[@]}"; do
            name=${v%%:*}
            cat "$VDIR/$name.log" 2>/dev/null
            if [ ! -x "$VDIR/$name" ]; then echo "{\"variant\": \"$name\", \"error\": \"not built (see setup.log)\"}"; continue; fi
            timeout 30 "$VDIR/$name" "$name" 1 16 16384 0 || echo "exit status $? of $name"
        done
        # The persistent grid's gain where the model puts it largest (per-item fixed cost
        # against 32 key tiles): L 4k causal, production and persistent0 only.
        for name in production persistent0; do
            [ -x "$VDIR/$name" ] && { timeout 30 "$VDIR/$name" "${name}_L4k_causal" 4 16 4096 1 || echo "exit status $? of $name"; }
        done
    }
    if [ "$DRY" = "1" ]; then
        step variants "forward variants at L 16k (${#VARIANTS[@]} binaries)" "$OUT/.v.log" true
    else
        # A function cannot run under timeout: the loop runs in a child shell of this script.
        step variants "forward variants at L 16k (${#VARIANTS[@]} binaries)" "$OUT/.v.log" bash -c "$(declare -f run_variants); VBUILD_PID=; VDIR='$VDIR'; VARIANTS=(${VARIANTS[*]}); run_variants"
        [ -n "$VBUILD_PID" ] && wait "$VBUILD_PID" 2>/dev/null
    fi
    grep -v '^{"' "$OUT/.v.log" >>"$SETUP"
    grep '^{"' "$OUT/.v.log" | sed 's/^{/{"stage": "variant", /' >>"$DIAG_JSON"
    {
        echo "## sm_90a forward variants (bf16, D 128, median of 20; B 1, H 16, L 16384, non-causal, and B 4, H 16, L 4096, causal for the rows named L4k_causal)"
        echo
        "$PY" - "$OUT/.v.log" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith('{"')]
t = {r["variant"]: r.get("ms") for r in rows}
print("| variant | K + V stages | ms | TFLOP/s | spread (min-max ms) | check |")
print("|---|---|---|---|---|---|")
for r in rows:
    if "error" in r:
        print(f"| {r.get('variant', '?')} | | | | | {r['error']} |")
        continue
    chk = "n/a (math changed)" if r["max_abs_err"] < 0 else f"max err {r['max_abs_err']:.3g}"
    print(f"| {r['variant']} | {r['stages']} + {r.get('v_stages', r['stages'])} | {r['ms']:.3f} | {r['tflops']:.0f} | {r['min_ms']:.3f}-{r['max_ms']:.3f} | {chk} |")
p = t.get("production")
if p:
    print()
    for name, what in (("no_loads", "load wait (production - no_loads)"), ("no_softmax", "softmax on the critical path (production - no_softmax)"),
                       ("stages2", "the third stage of each ring (stages2 - production)"),
                       ("coupled_kv", "separate K and V pipelines' gain (coupled_kv - production)"),
                       ("persistent0", "the persistent grid's gain at L 16k (persistent0 - production)"),
                       ("pin0", "overlap gained by the pin (pin0 - production)"),
                       ("pin1", "overlap the pin would gain (production - pin1)")):
        if t.get(name):
            d = (p - t[name]) if name in ("no_loads", "no_softmax", "pin1") else (t[name] - p)
            print(f"- {what}: {d:+.3f} ms ({100 * d / p:+.1f}% of the production step)")
p4, n4 = t.get("production_L4k_causal"), t.get("persistent0_L4k_causal")
if p4 and n4:
    print(f"- the persistent grid's gain at L 4k causal (B 4): {n4 - p4:+.3f} ms ({100 * (n4 - p4) / p4:+.1f}%)")
EOF
        echo
    } >>"$DIAG_MD" 2>>"$SETUP"
    while IFS= read -r line; do say "variant: $line"; done < <(grep '^|' "$DIAG_MD" | grep -v -e '^| variant' -e '^|---' | tail -6)
    rm -f "$OUT/.v.log"
fi

# ------------------------------------------------------------------ 7. decode with forced split counts
if stage decode; then
    : >"$OUT/.d.log"
    step decode "decode: planned and forced splits, both families" "$OUT/.d.log" "$PY" benchmarks/diag_gpu.py decode "${DIAG_FLAGS[@]}" --json "$DIAG_JSON"
    { echo "## Decode (bf16, D 128, one query; GB/s of the K/V bytes)"; echo; grep '^diag: ' "$OUT/.d.log" | sed 's/^diag: /- /'; echo; } >>"$DIAG_MD"
    cat "$OUT/.d.log" >>"$SETUP"
    rm -f "$OUT/.d.log"
fi

# ------------------------------------------------------------------ 8. Nsight Compute on each main kernel
if stage ncu; then
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
    if [ -z "$NCU" ] && [ "$DRY" != "1" ]; then
        say "ncu: not found on this machine: no profiles"
    else
        NDIR=$(mktemp -d)
        NCU=${NCU:-ncu}
        # The metric names this ncu knows (an unknown name fails the whole profile): the wanted
        # ones are kept if their base name is listed.
        WANT=(sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed
              sm__inst_executed_pipe_xu.sum smsp__inst_executed.sum smsp__issue_active.avg.pct_of_peak_sustained_elapsed
              lts__t_bytes.sum.per_second dram__bytes_read.sum.per_second l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum
              sm__cycles_elapsed.avg.per_second)
        METRICS=""
        if [ "$DRY" != "1" ]; then
            timeout 20 "$NCU" --query-metrics >"$NDIR/metrics.txt" 2>&1
            for m in "${WANT[@]}"; do grep -q "^${m%%.*} " "$NDIR/metrics.txt" && METRICS="$METRICS${METRICS:+,}$m"; done
        fi
        echo "ncu $("$NCU" --version 2>/dev/null | tail -1); metrics kept: ${METRICS:-none}" >>"$SETUP"
        SECTIONS=()
        for sec in SpeedOfLight ComputeWorkloadAnalysis MemoryWorkloadAnalysis SchedulerStats WarpStateStats Occupancy LaunchStats SourceCounters; do SECTIONS+=(--section "$sec"); done
        # KIND:KERNEL REGEX:LAUNCHES TO SKIP:LAUNCHES TO PROFILE (each call launches the kernel once,
        # the backward's two once each; the first calls warm up).
        for spec in "fwd:attn_fwd_sm90:2:1" "bwd:attn_bwd_(dkdv|dq)_sm90:4:2" "decode:attn_fwd_sm90:2:1" "decode_mma:attn_fwd_decode:2:1"; do
            IFS=: read -r kind regex skip count <<<"$spec"
            : >"$OUT/.n.log"
            step "ncu_$kind" "ncu: $kind ($regex)" "$OUT/.n.log" "$NCU" --clock-control none --target-processes all \
                -k "regex:$regex" --launch-skip "$skip" -c "$count" "${SECTIONS[@]}" --import-source yes \
                ${METRICS:+--metrics "$METRICS"} -f -o "$NDIR/$kind" "$PY" benchmarks/diag_gpu.py one "$kind" --reps 4
            rc=$?
            cat "$OUT/.n.log" >>"$SETUP"
            rm -f "$OUT/.n.log"
            if [ "$DRY" != "1" ] && [ -f "$NDIR/$kind.ncu-rep" ]; then
                timeout 30 "$NCU" -i "$NDIR/$kind.ncu-rep" --page details --csv >"$NDIR/${kind}_details.csv" 2>&1
                timeout 30 "$NCU" -i "$NDIR/$kind.ncu-rep" --page source --csv --print-source sass >"$NDIR/${kind}_sass_stalls.csv" 2>&1
                "$PY" - "$kind" "$NDIR/${kind}_details.csv" >>"$DIAG_MD" 2>>"$SETUP" <<'EOF'
import csv, sys
keep = ("Duration", "SM Frequency", "Compute (SM) Throughput", "Memory Throughput", "L2 Cache Throughput",
        "DRAM Throughput", "Registers Per Thread", "Achieved Occupancy", "Issue Slots Busy", "No Eligible")
print(f"## ncu: {sys.argv[1]}\n")
with open(sys.argv[2], newline="") as f:
    rows = [r for r in csv.DictReader(f) if r.get("Metric Name")]
for r in rows:
    name = r["Metric Name"]
    if name in keep or "__" in name:
        kern = r.get("Kernel Name", "").split("<")[0].split("(")[0].split("::")[-1]
        print(f"- {kern}: {name} = {r.get('Metric Value', '')} {r.get('Metric Unit', '')}")
print()
EOF
                say "ncu $kind: profiled (exit $rc)"
            elif [ "$DRY" != "1" ]; then
                say "ncu $kind: no report (exit $rc, see setup.log)"
            fi
        done
        if [ "$DRY" != "1" ]; then
            tar -czf "$OUT/ncu.tar.gz" -C "$NDIR" . 2>>"$SETUP"
            # What comes back from the device machine is at most 16 MiB a file: the reports go
            # first if it is larger (the CSVs hold the same numbers).
            if [ "$(stat -c %s "$OUT/ncu.tar.gz")" -gt 15000000 ]; then
                tar -czf "$OUT/ncu.tar.gz" -C "$NDIR" --exclude '*.ncu-rep' . 2>>"$SETUP"
                say "ncu: the .ncu-rep files were left out of ncu.tar.gz (over 15 MB); the CSVs are in"
            fi
        fi
        rm -rf "$NDIR"
    fi
fi
rm -rf "$VDIR"

# The Triton backend's GPU file and its device-generic suite, compiled (not interpreted; of the
# ahead-of-time compile file only the tensor-descriptor tests, which run on CUDA tensors here).
TRITON_TESTS=$(ls tests/test_triton*.py 2>/dev/null | grep -v -e _aot || true)
if stage triton_suite; then
    # shellcheck disable=SC2086
    gpu_tests triton_suite "triton suite ($(echo $TRITON_TESTS | tr '\n' ' '), descriptor tests, conformance -k triton)" "${XDIST[@]}" $TRITON_TESTS tests/test_triton_aot.py tests/test_conformance.py -k "(triton or not conformance) and (not aot or descriptor or modes_never)" || rc1=1
fi
if stage other; then
    OTHER_IGNORE=(--ignore tests/test_conformance.py)
    for f in tests/test_cuda.py tests/test_cuda_sm90_gpu.py tests/test_triton_aot.py $TRITON_TESTS; do OTHER_IGNORE+=(--ignore "$f"); done
    gpu_tests other "everything else marked gpu" tests -m gpu "${OTHER_IGNORE[@]}"
    rc=$?
    # pytest's 5: nothing else is marked gpu.
    [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ] && rc1=1
fi

# ------------------------------------------------------------------ 9. the trainer's quick preset (not in the default stages)
if stage trainer; then
    TRAIN=$OUT/trainer.log
    : >"$TRAIN"
    TDIR=$(mktemp -d)
    TCMD=()
    if [ -n "${TRAINER_CMD:-}" ]; then
        read -r -a TCMD <<<"$TRAINER_CMD"
    else
        TCMD=("$PY" -m mhakern.memorize quick)
        HELP=$(cd "$TDIR" && "${TCMD[@]}" --help 2>&1 || true)
        grep -q -- "--device" <<<"$HELP" && TCMD+=(--device "$([ "$HAVE_GPU" = "1" ] && echo cuda || echo cpu)")
        grep -q -- "--out" <<<"$HELP" && TCMD+=(--out "$TDIR/results")
        grep -q -- "--no-progress" <<<"$HELP" && TCMD+=(--no-progress)
    fi
    (cd "$TDIR" && step trainer "trainer quick preset" "$TRAIN" "${TCMD[@]}")
    rc=$?
    say "trainer quick preset: exit $rc; last line: $(grep -v -e '^\[exit' -e '^\s*$' "$TRAIN" | tail -1 | cut -c1-160)"
fi

# ------------------------------------------------------------------ 10. report
if [ "$DRY" = "1" ]; then
    stage bench && step report "benchmark report" /dev/null true
    say "dry run: nothing was installed or run; each step was accounted at its allowance"
    [ "$(now)" -gt "$BUDGET" ] && rc1=1
elif [ -f "$OUT/bench.json" ]; then
    RLOG=$(mktemp)
    if step report "benchmark report" "$RLOG" "$PY" -m benchmarks.report "$OUT/bench.json" --out "$OUT" --headline; then
        while IFS= read -r line; do say "$line"; done < <(grep '^headline: ' "$RLOG")
    else
        say "report: FAILED (see bench.log)"
    fi
    # The plots are drawn again from bench.json anywhere (python -m benchmarks.report): the
    # device machine gives back 8 files.
    rm -f "$OUT/tflops.png" "$OUT/decode.png"
    cat "$RLOG" >>"$BENCH"
    rm -f "$RLOG"
elif stage bench; then
    say "report: no bench.json (the benchmarks did not finish; see bench.log)"
fi

status=0
[ "${rc0:-0}" -ne 0 ] && status=1
[ "${rc1:-0}" -ne 0 ] && status=1
finish $status
