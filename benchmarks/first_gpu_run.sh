#!/usr/bin/env bash
# The first run on a GPU machine: what catches the most in at most 7 minutes, every
# result in $OUT (8 files at most), one summary.md with every figure and every failure.
#
#   . .gpu/gpu-env.sh && OUT=/some/folder bash benchmarks/first_gpu_run.sh
#   REHEARSE=1 OUT=/tmp/rehearsal bash benchmarks/first_gpu_run.sh     # on a CPU
#
# Steps, in this order, each with its own time limit; a step that fails or runs out of
# time is recorded and the next one starts:
#   1. info       python3 -m d2lgpu info and nvidia-smi
#   2. gpu-tests  the tests marked gpu or multigpu
#   3. smoke      every chapter, then its solutions, in smoke mode (D2LGPU_SMOKE=1: full
#                 mode's code path, the work cut), in five lanes side by side, with
#                 per-cell wall times and every error kept (benchmarks/smoke_notebooks.py)
#   4. P1         the d2l recipe (ResNet-18, batch 256, lr 0.1, 10 epochs) on the fast
#                 path against the d2l-style loop, in one run (benchmarks/train_speed.py)
#   5. P2         chapter 2's fused multiply-add against the measured device-copy
#                 bandwidth (benchmarks/elementwise_bandwidth.py)
#   6. P3         autocast against strict FP32, step time and peak memory, at the largest
#                 batch of chapter 6's sweep (benchmarks/amp_sweep.py --largest)
# The limits add up to 405 s. P1-P3 run after the smoke lanes so that nothing else
# competes with their timings.
#
# REHEARSE=1 runs the same plumbing on a machine without CUDA, in seconds: one file's GPU
# tests are collected and skipped, one notebook runs in smoke mode, and P1-P3 run their quick
# sizes on the CPU (P1 one epoch, P3 its MLP only). Its figures mean nothing; tests/test_first_gpu_run.py
# runs it in CI.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder that should receive the results}"
mkdir -p "$OUT"
REHEARSE=${REHEARSE:-0}
export PYTHONUNBUFFERED=1
unset D2LGPU_QUICK D2LGPU_FULL D2LGPU_SMOKE

if [ "$REHEARSE" = 1 ]; then
    quick=--quick workers=2 p1_epochs="--epochs 1" p3_models="--models mlp"
    gpu_tests=tests/test_devices.py  # collected and skipped like the rest: the plumbing
    lanes=("notebooks/solutions/01_cuda_checks_solutions.ipynb")
else
    if ! python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "no usable CUDA GPU here (python3 -m d2lgpu info says why); REHEARSE=1 runs" \
             "the plumbing on a CPU" >&2
        exit 1
    fi
    quick= workers=8 p1_epochs= p3_models= gpu_tests=tests
    # Five lanes of chapters and their solutions, the slowest (compile, the GPT's training)
    # alone.
    s=notebooks/solutions
    lanes=(
        "notebooks/07_profiling_and_compile.ipynb $s/07_profiling_and_compile_solutions.ipynb"
        "notebooks/10_small_gpt.ipynb $s/10_small_gpt_solutions.ipynb"
        "notebooks/06_mixed_precision.ipynb notebooks/04_multi_gpu_concise.ipynb $s/06_mixed_precision_solutions.ipynb $s/04_multi_gpu_concise_solutions.ipynb"
        "notebooks/05_distributed_data_parallel.ipynb notebooks/08_memory_and_sharding.ipynb notebooks/09_model_parallelism.ipynb $s/05_distributed_data_parallel_solutions.ipynb $s/08_memory_and_sharding_solutions.ipynb $s/09_model_parallelism_solutions.ipynb"
        "notebooks/02_device_placement.ipynb notebooks/03_multi_gpu_from_scratch.ipynb notebooks/01_cuda_checks.ipynb $s/02_device_placement_solutions.ipynb $s/03_multi_gpu_from_scratch_solutions.ipynb $s/01_cuda_checks_solutions.ipynb"
    )
fi

summary=$OUT/summary.md
steps_table=$(mktemp)
failed=0

# run_step NAME LIMIT FILE COMMAND...: run under `timeout`, output to $OUT/FILE.
run_step() {
    local name=$1 limit=$2 file=$3 start=$SECONDS rc
    shift 3
    echo "== $name (limit ${limit} s): $*" >&2
    timeout -k 5 "$limit" "$@" >"$OUT/$file" 2>&1
    rc=$?
    local verdict=ok
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then verdict="out of time"; failed=1
    elif [ "$rc" -ne 0 ]; then verdict="failed (exit $rc)"; failed=1; fi
    echo "| $name | $verdict | $((SECONDS - start)) | $limit | $file |" >>"$steps_table"
}

info='python3 -m d2lgpu info; echo; nvidia-smi || echo "(nvidia-smi: not available here)"
python3 -c "import torch; print(\"torch\", torch.__version__, \"| cuda\", torch.version.cuda,
\"| arch list\", torch.cuda.get_arch_list() if torch.cuda.is_available() else [])"
echo; python3 benchmarks/gpu_facts.py'

# smoke LIMIT: the lanes side by side, each under its own `timeout`; a killed lane's
# report keeps the cells it finished.
smoke() {
    local limit=$1 start=$SECONDS i=0 pids=() rc=0
    echo "== smoke (limit ${limit} s): ${#lanes[@]} lane(s)" >&2
    for lane in "${lanes[@]}"; do
        i=$((i + 1))
        # shellcheck disable=SC2086 # a lane is a space-separated list of notebooks
        D2LGPU_SMOKE=1 timeout -k 5 "$limit" python3 benchmarks/smoke_notebooks.py $lane \
            --timeout 130 --out "$OUT/smoke-lane$i.md" >/dev/null 2>>"$OUT/smoke-log.txt" &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do
        wait "$pid"
        local lane_rc=$?
        if [ "$lane_rc" -eq 124 ] || [ "$lane_rc" -eq 137 ]; then rc=124
        elif [ "$lane_rc" -ne 0 ] && [ "$rc" -eq 0 ]; then rc=$lane_rc; fi
    done
    local verdict=ok
    if [ "$rc" -eq 124 ]; then verdict="out of time (a lane)"; failed=1
    elif [ "$rc" -ne 0 ]; then verdict="failed (a cell raised)"; failed=1; fi
    echo "| smoke | $verdict | $((SECONDS - start)) | $limit | smoke.md |" >>"$steps_table"
}

run_step info 30 info.txt bash -c "$info"
run_step gpu-tests 60 gpu-tests.txt python3 -m pytest -p no:cacheprovider -n 0 -q -rfE \
    -m "gpu or multigpu" $gpu_tests
smoke 130
run_step P1 90 p1.txt python3 benchmarks/train_speed.py $quick --loops d2l-style fast --workers $workers $p1_epochs
run_step P2 35 p2.txt python3 benchmarks/elementwise_bandwidth.py $quick --no-cpu
run_step P3 60 p3.txt python3 benchmarks/amp_sweep.py $quick $p3_models --largest --modes fp32 bf16

# One smoke.md from the lanes (killed lanes keep the cells they finished).
for f in "$OUT"/smoke-lane*.md; do
    [ -e "$f" ] || continue
    { echo "### $(basename "$f" .md)"; cat "$f"; echo; } >>"$OUT/smoke.md"
    rm -f "$f"
done

{
    echo "# First GPU run, $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo
    [ "$REHEARSE" = 1 ] && echo "**Rehearsal on a machine without CUDA: the figures mean nothing.**" && echo
    echo "| step | result | seconds | limit | file |"
    echo "|---|---|---|---|---|"
    cat "$steps_table"
    echo
    echo "## info"
    echo '```'
    cat "$OUT/info.txt"
    echo '```'
    echo "## gpu-tests"
    echo '```'
    tail -n 25 "$OUT/gpu-tests.txt"
    echo '```'
    echo "## smoke mode"
    cat "$OUT/smoke.md" 2>/dev/null || echo "(no smoke report)"
    for p in p1 p2 p3; do
        echo "## ${p^^}"
        echo '```'
        tail -n 30 "$OUT/$p.txt"
        echo '```'
    done
} >"$summary"
rm -f "$steps_table"
echo "summary: $summary" >&2
exit $failed
