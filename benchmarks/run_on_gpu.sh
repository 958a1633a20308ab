#!/usr/bin/env bash
# Everything that needs a GPU, in one go: the GPU-only tests, every benchmark,
# and every chapter executed in full mode (their outputs replace the committed
# CPU-mode ones; check them with nbval-lax afterwards). Logs go to $LOGS.
# Needs only what `pip install -e '.[dev]'` installs.
#
#   D2LGPU_DATA=/path/with/FashionMNIST/raw LOGS=/tmp/gpu-logs bash benchmarks/run_on_gpu.sh [step...]
#
# Steps: tests benchmarks notebooks (default: all three, in that order).
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS=${LOGS:-gpu-logs}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1
unset D2LGPU_QUICK  # full mode

if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no usable GPU here: see 'python -m d2lgpu info'" >&2
    exit 1
fi
python -m d2lgpu info | tee "$LOGS/info.txt"
nvidia-smi -L | tee -a "$LOGS/info.txt"

status=0
run() {  # run NAME COMMAND...: log to $LOGS/NAME.txt, remember a failure, go on
    local name=$1; shift
    echo "== $name: $*"
    "$@" 2>&1 | tee "$LOGS/$name.txt" || status=1
}

steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(tests benchmarks notebooks)
for step in "${steps[@]}"; do
    case $step in
    tests)
        run gpu-tests python -m pytest -p no:cacheprovider -m "gpu or multigpu" tests ;;
    benchmarks)
        run elementwise python benchmarks/elementwise_bandwidth.py
        run amp-sweep python benchmarks/amp_sweep.py
        run train-speed python benchmarks/train_speed.py
        run step-choices python benchmarks/step_choices.py
        run ablation python benchmarks/ablation.py --output "$LOGS/ablation-table.txt" ;;
    notebooks)
        for nb in notebooks/[0-9]*.ipynb; do
            run "$(basename "$nb" .ipynb)" python benchmarks/run_notebook.py "$nb" --timeout 1800
        done ;;
    *)
        echo "unknown step $step (use tests, benchmarks, notebooks)" >&2; exit 2 ;;
    esac
done
echo "logs in $LOGS; exit status $status"
exit $status
