#!/usr/bin/env bash
# The device check's diagnostics of the sm_90a forward, by name only (DEVICE_CHECK_STAGES=
# "variants" or "ncu"; benchmarks/device_check.py runs them as steps):
#
#   benchmarks/device_diag.sh build-variants VDIR       one binary per compile-time variant of the
#                                                       sm_90a forward (benchmarks/diag_fwd_sm90.cu),
#                                                       built in parallel (the check starts it at
#                                                       its beginning, in the background)
#   benchmarks/device_diag.sh variants VDIR OUTDIR      waits for those builds, runs each at L 16k
#                                                       (and two at L 4k causal): OUTDIR/diag.md,
#                                                       OUTDIR/diag.jsonl, the logs to OUTDIR/setup.log
#   benchmarks/device_diag.sh ncu OUTDIR                Nsight Compute on each main kernel
#                                                       (--clock-control none): OUTDIR/ncu.tar.gz
#
# DEVICE_CHECK_VARIANTS="production no_loads" builds only those variants (default: all seven:
# production, stages2, coupled_kv (K held until P V lands, as one coupled K/V stage was),
# persistent0 (one CTA per work item), no_softmax, no_loads, and the softmax pin flipped).
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2
PY=${PYTHON:-python3}
CMD=${1:-}
PIN_DEFAULT=$(grep -oE '#define MHK_SM90_FWD_PIN_SOFTMAX [01]' csrc/cuda/sm90/attn_fwd_sm90_kernel.cuh | grep -oE '[01]$')
PIN_OTHER=$((1 - ${PIN_DEFAULT:-0}))
VARIANTS=()
for v in "production:" "stages2:-DMHK_SM90_FWD_DIAG_STAGES=2" "coupled_kv:-DMHK_SM90_FWD_DIAG_COUPLED_KV=1" \
         "persistent0:-DMHK_SM90_FWD_PERSISTENT=0" \
         "no_softmax:-DMHK_SM90_FWD_DIAG_NO_SOFTMAX=1" "no_loads:-DMHK_SM90_FWD_DIAG_NO_LOADS=1" \
         "pin${PIN_OTHER}:-DMHK_SM90_FWD_PIN_SOFTMAX=${PIN_OTHER}"; do
    [[ " ${DEVICE_CHECK_VARIANTS:-${v%%:*}} " == *" ${v%%:*} "* ]] && VARIANTS+=("$v")
done

case "$CMD" in
build-variants)
    VDIR=$2
    mkdir -p "$VDIR"
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
    ;;
variants)
    VDIR=$2
    OUT=$3
    DIAG_MD=$OUT/diag.md
    DIAG_JSON=$OUT/diag.jsonl
    SETUP=$OUT/setup.log
    VLOG=$(mktemp)
    while [ ! -f "$VDIR/.done" ]; do sleep 1; done
    for v in "${VARIANTS[@]}"; do
        name=${v%%:*}
        cat "$VDIR/$name.log" 2>/dev/null >>"$VLOG"
        if [ ! -x "$VDIR/$name" ]; then echo "{\"variant\": \"$name\", \"error\": \"not built (see setup.log)\"}" >>"$VLOG"; continue; fi
        timeout 30 "$VDIR/$name" "$name" 1 16 16384 0 >>"$VLOG" 2>&1 || echo "exit status $? of $name" >>"$VLOG"
    done
    # The persistent grid's gain where the model puts it largest (per-item fixed cost against 32
    # key tiles): L 4k causal, production and persistent0 only.
    for name in production persistent0; do
        [ -x "$VDIR/$name" ] && { timeout 30 "$VDIR/$name" "${name}_L4k_causal" 4 16 4096 1 >>"$VLOG" 2>&1 || echo "exit status $? of $name" >>"$VLOG"; }
    done
    grep -v '^{"' "$VLOG" >>"$SETUP"
    grep '^{"' "$VLOG" | sed 's/^{/{"stage": "variant", /' >>"$DIAG_JSON"
    {
        echo "## sm_90a forward variants (bf16, D 128, median of 20; B 1, H 16, L 16384, non-causal, and B 4, H 16, L 4096, causal for the rows named L4k_causal)"
        echo
        "$PY" - "$VLOG" <<'EOF'
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
    rm -f "$VLOG"
    ;;
ncu)
    OUT=$2
    DIAG_MD=$OUT/diag.md
    SETUP=$OUT/setup.log
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
    if [ -z "$NCU" ]; then echo "ncu: not found on this machine: no profiles"; exit 1; fi
    NDIR=$(mktemp -d)
        # The metric names this ncu knows (an unknown name fails the whole profile): the wanted
        # ones are kept if their base name is listed.
        WANT=(sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed
              sm__inst_executed_pipe_xu.sum smsp__inst_executed.sum smsp__issue_active.avg.pct_of_peak_sustained_elapsed
              lts__t_bytes.sum.per_second dram__bytes_read.sum.per_second l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum
              sm__cycles_elapsed.avg.per_second)
        METRICS=""
        timeout 20 "$NCU" --query-metrics >"$NDIR/metrics.txt" 2>&1
        for m in "${WANT[@]}"; do grep -q "^${m%%.*} " "$NDIR/metrics.txt" && METRICS="$METRICS${METRICS:+,}$m"; done
        echo "ncu $("$NCU" --version 2>/dev/null | tail -1); metrics kept: ${METRICS:-none}" >>"$SETUP"
        SECTIONS=()
        for sec in SpeedOfLight ComputeWorkloadAnalysis MemoryWorkloadAnalysis SchedulerStats WarpStateStats Occupancy LaunchStats SourceCounters; do SECTIONS+=(--section "$sec"); done
        # KIND:KERNEL REGEX:LAUNCHES TO SKIP:LAUNCHES TO PROFILE (each call launches the kernel once,
        # the backward's two once each; the first calls warm up).
        for spec in "fwd:attn_fwd_sm90:2:1" "bwd:attn_bwd_(dkdv|dq)_sm90:4:2" "decode:attn_fwd_sm90:2:1" "decode_mma:attn_fwd_decode:2:1"; do
            IFS=: read -r kind regex skip count <<<"$spec"
            # each profile under 18 s (the step's cap is four of them)
            timeout -s INT -k 5 18 "$NCU" --clock-control none --target-processes all \
                -k "regex:$regex" --launch-skip "$skip" -c "$count" "${SECTIONS[@]}" --import-source yes \
                ${METRICS:+--metrics "$METRICS"} -f -o "$NDIR/$kind" "$PY" benchmarks/diag_gpu.py one "$kind" --reps 4 >>"$SETUP" 2>&1
            rc=$?
            if [ -f "$NDIR/$kind.ncu-rep" ]; then
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
                echo "diag: ncu $kind: profiled (exit $rc)"
            else
                echo "diag: ncu $kind: no report (exit $rc, see setup.log)"
            fi
        done
        if true; then
            tar -czf "$OUT/ncu.tar.gz" -C "$NDIR" . 2>>"$SETUP"
            # What comes back from the device machine is at most 16 MiB a file: the reports go
            # first if it is larger (the CSVs hold the same numbers).
            if [ "$(stat -c %s "$OUT/ncu.tar.gz")" -gt 15000000 ]; then
                tar -czf "$OUT/ncu.tar.gz" -C "$NDIR" --exclude '*.ncu-rep' . 2>>"$SETUP"
                echo "diag: ncu: the .ncu-rep files were left out of ncu.tar.gz (over 15 MB); the CSVs are in"
            fi
        fi
        rm -rf "$NDIR"
    ;;
*)
    echo "usage: benchmarks/device_diag.sh build-variants VDIR | variants VDIR OUTDIR | ncu OUTDIR" >&2
    exit 2
    ;;
esac
