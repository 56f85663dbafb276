#!/usr/bin/env bash
# The device check: one run on a fresh CUDA machine (torch, triton and nvcc installed, no
# network) that installs mhakern, runs a smoke stage (each GPU backend once against the reference,
# and bad calls at the C++ boundary that must raise, not crash), the GPU tests per backend, the
# headline benchmarks and the trainer's quick preset, and leaves everything in OUTDIR. The whole
# run fits 7 minutes on one H200 by its own accounting (DEVICE_CHECK_BUDGET_S, default 420), so
# that with a machine's start it runs twice within a 15-minute lease (the second time with a
# smaller budget, or only some stages: DEVICE_CHECK_STAGES), once to see, once after the fixes.
#
#   benchmarks/device_check.sh OUTDIR
#
# OUTDIR receives at most 8 files:
#   setup.log    environment, GPU, the install and extension build (all cores, this GPU's arch),
#                and the smoke stage
#   tests.log    the GPU tests: the cuda backend's, the triton backend's (its GPU file and its
#                device-generic suite on CUDA tensors), then every other test marked gpu
#   bench.log    pytest-benchmark output of the headline rows (and the trainer's benchmark)
#   bench.json   pytest-benchmark JSON (input of python -m benchmarks.report)
#   trainer.log  the trainer's quick preset on the GPU (its table copied in)
#   report.md    the benchmark report, ending with this check's summary
#   tflops.png   TFLOP/s against sequence length, one line per provider
#   decode.png   decode GB/s against the key length
# and prints a short summary at the end (tests passed or failed, headline figures and ratios).
#
# Without a GPU it records the environment, then stops with a clear message and exit status 3.
# Environment knobs: PYTHON (default python3), DEVICE_CHECK_BUDGET_S (default 420 s for the
# whole run), DEVICE_CHECK_STAGES (default "smoke sm90 cuda bench triton other trainer": the
# stages after the install, in this order), TORCH_CUDA_ARCH_LIST (default: this GPU's), MAX_JOBS (default: all cores),
# TRAINER_CMD (default: the quick preset through python -m mhakern.memorize).
# DEVICE_CHECK_REHEARSAL=1 runs every step even without a GPU (CPU rows; a developer's dry run
# of this script in a scratch environment -- it installs the package into PYTHON's environment).

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
BUDGET=${DEVICE_CHECK_BUDGET_S:-420}
STAGES=" ${DEVICE_CHECK_STAGES:-smoke sm90 cuda bench triton other trainer} "
stage() { [[ "$STAGES" == *" $1 "* ]]; }
T0=$SECONDS
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore MPLBACKEND=Agg
declare -a SUMMARY=()

note() { echo "device_check [$((SECONDS - T0))s]: $*"; }
say() { SUMMARY+=("$*"); }
# Seconds a step may take: its cap, less what the later steps need, never beyond the budget.
allow() {
    local cap=$1 reserve=$2 left=$((BUDGET - (SECONDS - T0) - $2))
    [ "$left" -lt "$cap" ] && cap=$left
    echo "$cap"
}
# run_step NAME LOG CAP RESERVE CMD...: runs CMD under its time allowance, appending to LOG.
# SIGINT first, so that pytest still writes its JSON and summary, then KILL 15 s later.
run_step() {
    local name=$1 log=$2 cap=$3 reserve=$4
    shift 4
    local t
    t=$(allow "$cap" "$reserve")
    if [ "$t" -lt 10 ]; then
        note "$name: skipped, the time budget is spent"
        echo "SKIPPED: time budget spent" >>"$log"
        return 124
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
        echo "- total wall time: $((SECONDS - T0)) s"
    } >"$OUT/.summary.md"
    if [ -f "$OUT/report.md" ]; then cat "$OUT/.summary.md" >>"$OUT/report.md"; else cat "$OUT/.summary.md" >>"$OUT/setup.log"; fi
    echo ""
    echo "================ device check summary ================"
    for line in "${SUMMARY[@]}"; do echo "  $line"; done
    echo "  total wall time: $((SECONDS - T0)) s; files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
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
if [ "$HAVE_GPU" != "1" ] && [ "${DEVICE_CHECK_REHEARSAL:-0}" != "1" ]; then
    say "STOPPED: no CUDA device is visible to torch (torch.cuda.is_available() is False): this check needs one; nothing was installed or run"
    note "no CUDA device: stopping (setup.log has the environment)"
    finish 3
fi

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
run_step "install" "$SETUP" 180 220 bash -c "MHAKERN_NO_EXTENSION=1 \"$PY\" -m pip install --no-index --no-deps --no-build-isolation -e . && \"$PY\" -m mhakern.build"
rc=$?
if [ $rc -ne 0 ]; then
    say "install: FAILED (exit $rc, see setup.log)"
    finish 1
fi
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
say "install: ok in $(grep -o 'exit status 0 after [0-9]*s' "$SETUP" | tail -1 | grep -o '[0-9]*s$'); ${BACKENDS:-mhakern does not import (see setup.log)}"

# ------------------------------------------------------------------ 3. ceilings and smoke
# The chip's two ceilings, measured here (a device-to-device copy, a large bf16 product), so that
# the figures below can be read against this card as found.
if [ "$HAVE_GPU" = "1" ]; then
    CEIL=$(timeout 60 "$PY" - <<'EOF' 2>>"$SETUP"
import torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
src = torch.randn(1 << 28, device="cuda")
dst = torch.empty_like(src)
def timed(f, n):
    for _ in range(3):
        f()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        f()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / 1e3 / n
t_mm = timed(lambda: a @ b, 10)
t_cp = timed(lambda: dst.copy_(src), 10)
print(f"bf16 8192^3 product {2 * 8192**3 / t_mm / 1e12:.0f} TFLOP/s, copy {2 * src.numel() * 4 / t_cp / 1e12:.2f} TB/s (read + write)")
EOF
)
    echo "ceilings: ${CEIL:-not measured}" >>"$SETUP"
    say "ceilings of this card: ${CEIL:-not measured (see setup.log)}"
    nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv >>"$SETUP" 2>&1
fi
SMOKE_DEV=$([ "$HAVE_GPU" = "1" ] && echo cuda || echo cpu)
BENCH_SKIP=()
if stage smoke; then
    : >"$OUT/.smoke.log"
    run_step "smoke: each GPU backend once (child processes), C++ errors raise" "$OUT/.smoke.log" 80 200 "$PY" -m benchmarks.device_smoke --device "$SMOKE_DEV" --budget-s 70
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
        BENCH_SKIP=(--bench-skip "sm90 bwd")
        say "the opt-in sm90 backward hung or crashed in the smoke stage: the benchmarks leave it out"
    fi
    rm -f "$OUT/.smoke.log"
fi

# ------------------------------------------------------------------ 4. GPU tests, per backend
TESTS=$OUT/tests.log
: >"$TESTS"
PYTEST_EXTRA=()
"$PY" -c "import pytest_timeout" 2>/dev/null && PYTEST_EXTRA+=(--timeout=60)
# gpu_tests NAME CAP RESERVE FILES/ARGS...: one pytest run, its counts (and first failures) in
# the summary.
gpu_tests() {
    local name=$1 cap=$2 reserve=$3
    shift 3
    : >"$OUT/.t.log"
    run_step "GPU tests: $name" "$OUT/.t.log" "$cap" "$reserve" "$PY" -m pytest "$@" -q -p no:cacheprovider -rfE "${PYTEST_EXTRA[@]}"
    local rc=$?
    cat "$OUT/.t.log" >>"$TESTS"
    say "GPU tests, $name: $(pytest_counts "$OUT/.t.log") [exit $rc]"
    while IFS= read -r line; do say "  $line"; done < <(grep -E '^(FAILED|ERROR) ' "$OUT/.t.log" | head -6 | cut -c1-220)
    rm -f "$OUT/.t.log"
    return "$rc"
}
rc1=0
# The sm_90a family's own GPU file first, alone and with the family as the host picks it (its
# layouts are the emulator's reading of the PTX ISA until this runs on a 9.0 device; it skips
# elsewhere): a hang there costs this step only.
if stage sm90; then
    MHAKERN_CUDA_FWD_FAMILY=auto gpu_tests "sm_90a family (tests/test_cuda_sm90_gpu.py)" 45 190 tests/test_cuda_sm90_gpu.py || rc1=1
fi
# The cuda backend: its GPU file (the hard cases under both forward families on a 9.0 device),
# then the conformance suite (hard cases in every dtype, modes, NaN/inf contract) restricted to it.
if stage cuda; then
    gpu_tests "cuda backend (tests/test_cuda.py, conformance -k cuda)" 60 150 tests/test_cuda.py tests/test_conformance.py -k "cuda or not conformance" || rc1=1
fi

# ------------------------------------------------------------------ 5. headline benchmarks
BENCH=$OUT/bench.log
: >"$BENCH"
if stage bench; then
    BENCH_FILES=(benchmarks/test_bench_attention.py)
    [ -f benchmarks/bench_trainer.py ] && BENCH_FILES+=(benchmarks/bench_trainer.py)
    # mhakern's GPU providers (the cuda backend as it runs by default, with both passes on
    # mma.sync, and with the opt-in sm90 backward; triton; auto) and the
    # field's fused kernels; the materialising ones (the reference, SDPA's math) add minutes, not facts.
    PROVIDERS=(--bench-provider mhakern:cuda --bench-provider mhakern:triton --bench-provider mhakern:auto
               --bench-provider sdpa:flash --bench-provider sdpa:cudnn --bench-provider sdpa:efficient
               --bench-provider flash-attn --bench-provider xformers)
    run_step "headline benchmarks" "$BENCH" 100 80 "$PY" -m pytest "${BENCH_FILES[@]}" --benchmark-only --bench-set headline \
        "${PROVIDERS[@]}" "${BENCH_SKIP[@]}" --benchmark-json "$OUT/bench.json" --benchmark-columns=median,iqr,rounds -q -p no:cacheprovider ${BENCH_ARGS:-}
    rc=$?
    say "benchmarks (${BENCH_FILES[*]}, headline set): $(pytest_counts "$BENCH") [exit $rc]"
fi

# The Triton backend's GPU file and its device-generic suite, compiled (not interpreted; of the
# ahead-of-time compile file only the tensor-descriptor tests, which run on CUDA tensors here).
TRITON_TESTS=$(ls tests/test_triton*.py 2>/dev/null | grep -v -e _aot || true)
if stage triton; then
    # Triton compiles each kernel variant at first use (about 2 s each on an H200 host: the first
    # run finished 30 of 107 tests in 70 s): spread the tests over processes when pytest-xdist
    # is there (the compiled kernels land in one shared cache).
    XDIST=()
    "$PY" -c "import xdist" 2>/dev/null && XDIST=(-n "$(( $(nproc) / 2 > 8 ? 8 : $(nproc) / 2 ))")
    # shellcheck disable=SC2086
    gpu_tests "triton backend ($(echo $TRITON_TESTS | tr '\n' ' '), descriptor tests, conformance -k triton)" 70 30 "${XDIST[@]}" $TRITON_TESTS tests/test_triton_aot.py tests/test_conformance.py -k "(triton or not conformance) and (not aot or descriptor or modes_never)" || rc1=1
fi
if stage other; then
    OTHER_IGNORE=(--ignore tests/test_conformance.py)
    for f in tests/test_cuda.py tests/test_cuda_sm90_gpu.py tests/test_triton_aot.py $TRITON_TESTS; do OTHER_IGNORE+=(--ignore "$f"); done
    gpu_tests "everything else marked gpu" 25 15 tests -m gpu "${OTHER_IGNORE[@]}"
    rc=$?
    # pytest's 5: nothing else is marked gpu.
    [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ] && rc1=1
fi

# ------------------------------------------------------------------ 6. the trainer's quick preset
TRAIN=$OUT/trainer.log
: >"$TRAIN"
TDIR=$(mktemp -d)
TCMD=()
if ! stage trainer; then
    echo "not in DEVICE_CHECK_STAGES" >>"$TRAIN"
elif [ -n "${TRAINER_CMD:-}" ]; then
    read -r -a TCMD <<<"$TRAINER_CMD"
elif "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('mhakern.memorize.__main__') is None)" 2>/dev/null; then
    TCMD=("$PY" -m mhakern.memorize quick)
elif "$PY" -c "import mhakern.memorize.cli" 2>/dev/null; then
    TCMD=("$PY" -c "import sys; from mhakern.memorize.cli import main; sys.exit(main())" quick)
else
    echo "the trainer has no command line here (mhakern.memorize.cli does not import)" >>"$TRAIN"
    say "trainer quick preset: NOT RUN (mhakern.memorize.cli does not import)"
fi
if [ ${#TCMD[@]} -gt 0 ]; then
    if [ -z "${TRAINER_CMD:-}" ]; then
        HELP=$(cd "$TDIR" && "${TCMD[@]}" --help 2>&1 || true)
        grep -q -- "--device" <<<"$HELP" && TCMD+=(--device "$([ "$HAVE_GPU" = "1" ] && echo cuda || echo cpu)")
        grep -q -- "--out" <<<"$HELP" && TCMD+=(--out "$TDIR/results")
        grep -q -- "--no-progress" <<<"$HELP" && TCMD+=(--no-progress)
    fi
    (cd "$TDIR" && run_step "trainer quick preset" "$TRAIN" 25 0 "${TCMD[@]}")
    rc=$?
    # The preset's Markdown tables (its results stay in a scratch folder: 8 files come back).
    for md in $(find "$TDIR" -name '*.md' 2>/dev/null | head -3); do
        { echo ""; echo "---- ${md#"$TDIR"/}"; cat "$md"; } >>"$TRAIN"
    done
    last=$(grep -v -e '^\[exit' -e '^\s*$' -e '^----' -e '^|' "$TRAIN" | tail -1 | cut -c1-160)
    say "trainer quick preset: exit $rc after $(grep -o 'exit status [0-9]* after [0-9]*s' "$TRAIN" | tail -1 | grep -o '[0-9]*s$'); last line: $last"
fi

# ------------------------------------------------------------------ 7. report
if [ -f "$OUT/bench.json" ]; then
    RLOG=$(mktemp)
    if timeout 60 "$PY" -m benchmarks.report "$OUT/bench.json" --out "$OUT" --headline >"$RLOG" 2>&1; then
        while IFS= read -r line; do say "$line"; done < <(grep '^headline: ' "$RLOG")
    else
        say "report: FAILED (see bench.log)"
    fi
    cat "$RLOG" >>"$BENCH"
    rm -f "$RLOG"
else
    say "report: no bench.json (the benchmarks did not finish; see bench.log)"
fi

status=0
[ "${rc0:-0}" -ne 0 ] && status=1
[ "${rc1:-0}" -ne 0 ] && status=1
finish $status
