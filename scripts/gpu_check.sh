#!/usr/bin/env bash
# Check a GPU machine in one command: install what is missing, build megablocks, run the GPU tests and the GPU
# benchmarks, and print one summary table (what passed, the figures).
#
# usage: scripts/gpu_check.sh [--wheels DIR] [--out DIR] [--no-build] [--only STEP,...]
#        scripts/gpu_check.sh --prepare DIR
#   --prepare DIR  on a machine WITH network: download into DIR what a GPU machine without network needs
#                  (megablocks, grouped_gemm and stanford-stk sdists; wheels of wandb, einops, pyyaml,
#                  safetensors, tokenizers, fla-core (linear attention's kernels) and their dependencies for
#                  Python 3.12 on x86-64 Linux)
#   --wheels DIR   the folder --prepare filled; packages missing here are installed from it (never torch)
#   --out DIR      where logs, test results and benchmark JSON go (default runs/gpu_check)
#   --no-build     do not build megablocks (its tests then skip, saying so)
#   --only STEPS   run only these steps (comma-separated names from the summary's table; install always runs),
#                  e.g. --only megablocks_build,megablocks_tests to re-run what failed
# environment: PYTHON (default python3: the GPU image's own Python and torch)
#
# The GPU image's torch is used as it is and never replaced: pip installs with --no-deps or under a
# constraint pinning torch. Each step has a time limit, and the whole check a deadline (GPU_CHECK_SECONDS, 570):
# a step that would pass it runs with what is left, and one with under 10 s left is recorded as not run (124).
set -uo pipefail
PYTHON=${PYTHON:-python3}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WHEELS="" OUT="$ROOT/runs/gpu_check" BUILD=1 PREPARE="" ONLY=""
STEP_NAMES="install megablocks_build gpu_tests train_step_bench megablocks_tests moe_layer_bench"
STEP_NAMES+=" compile_tests compile_bench"
SECONDS_ALLOWED=${GPU_CHECK_SECONDS:-570}  # the whole check's deadline: under the device tool's 10 minutes a call
# import name -> distribution name of what the toolkit needs at run time (pyproject.toml's dependencies)
RUNTIME_PACKAGES="wandb:wandb einops:einops yaml:pyyaml safetensors:safetensors tokenizers:tokenizers numpy:numpy fla:fla-core"

usage() { sed -n '5,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
need_value() { [[ $2 -ge 2 ]] || { echo "gpu_check: $1 needs a value" >&2; usage >&2; exit 2; }; }
while [[ $# -gt 0 ]]; do
    case "$1" in
        --prepare) need_value "$1" $#; PREPARE=$2; shift 2 ;;
        --wheels) need_value "$1" $#; WHEELS=$2; shift 2 ;;
        --out) need_value "$1" $#; OUT=$2; shift 2 ;;
        --no-build) BUILD=0; shift ;;
        --only) need_value "$1" $#; ONLY=",$2,"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu_check: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
    esac
done

for name in ${ONLY//,/ }; do
    [[ " $STEP_NAMES " == *" $name "* ]] || { echo "gpu_check: --only: no step '$name' (steps: $STEP_NAMES)" >&2; exit 2; }
done

if [[ -n "$PREPARE" ]]; then
    set -e
    mkdir -p "$PREPARE"
    "$PYTHON" "$ROOT/scripts/fetch_sdists.py" "$PREPARE"
    # binary wheels for the GPU image's interpreter (Python 3.12, x86-64 glibc), whatever this machine is
    "$PYTHON" -m pip download --quiet --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$PREPARE" wandb einops pyyaml safetensors tokenizers fla-core
    echo "gpu_check: $PREPARE holds $(ls "$PREPARE" | wc -l) files, $(du -sh "$PREPARE" | cut -f1);" \
         "on the GPU machine run: scripts/gpu_check.sh --wheels $PREPARE"
    exit 0
fi

if ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: no CUDA GPU is visible to $PYTHON's torch" \
         "($("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo 'not installed')):" \
         "this script checks a GPU machine. Prepare its packages here with: scripts/gpu_check.sh --prepare DIR" >&2
    exit 2
fi
[[ -z "$WHEELS" || -d "$WHEELS" ]] || { echo "gpu_check: --wheels $WHEELS is not a folder" >&2; exit 2; }
mkdir -p "$OUT"
STEPS="$OUT/steps.tsv"
: > "$STEPS"
step() {  # step NAME LIMIT_S COMMAND...: run with a time limit, log to $OUT/NAME.log, record status and seconds
    local name=$1 limit=$2 began status
    shift 2
    [[ -z "$ONLY" || "$name" == install || "$ONLY" == *",$name,"* ]] || return 0  # not among --only's steps
    began=$(date +%s)
    (( limit > DEADLINE - began )) && limit=$(( DEADLINE - began ))
    if (( limit < 10 )); then
        echo "gpu_check: $name not run: the check's deadline (GPU_CHECK_SECONDS=$SECONDS_ALLOWED) has passed"
        printf '%s\t124\t0\n' "$name" >> "$STEPS"
        return 0
    fi
    echo "gpu_check: $name ..."
    timeout "$limit" bash -c '"$@"' _ "$@" > "$OUT/$name.log" 2>&1  # through bash: COMMAND may be a function
    status=$?
    printf '%s\t%s\t%s\n' "$name" "$status" "$(( $(date +%s) - began ))" >> "$STEPS"
    [[ $status -eq 0 ]] || tail -n 5 "$OUT/$name.log" | sed "s/^/  $name: /"
    return 0
}
install_missing() {
    local constraint="$OUT/constraints.txt" missing=() pair
    "$PYTHON" -c 'import torch; print("torch==" + torch.__version__)' > "$constraint"
    for pair in $RUNTIME_PACKAGES; do
        "$PYTHON" -c "import ${pair%%:*}" 2>/dev/null || missing+=("${pair##*:}")
    done
    [[ ${#missing[@]} -eq 0 ]] && { echo "nothing missing"; return 0; }
    [[ -n "$WHEELS" ]] || { echo "missing ${missing[*]}, and no --wheels folder to install them from"; return 1; }
    "$PYTHON" -m pip install --no-index --find-links "$WHEELS" --constraint "$constraint" "${missing[@]}"
}
build_megablocks() {
    if "$PYTHON" -c 'import grouped_gemm.ops, megablocks' 2>/dev/null; then echo "already installed"; return 0; fi
    [[ -n "$WHEELS" ]] || { echo "no --wheels folder holding the megablocks sources"; return 1; }
    bash "$ROOT/scripts/install_megablocks.sh" --from "$WHEELS"
}

export -f install_missing build_megablocks
DEADLINE=$(( $(date +%s) + SECONDS_ALLOWED ))
export PYTHON WHEELS OUT ROOT RUNTIME_PACKAGES
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PYTHON" - > "$OUT/device.txt" <<'PY'
import torch
print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | CUDA {torch.version.cuda}")
PY
step install 30 install_missing
# megablocks compiles on 3/4 of the CPU cores for minutes (158 to 223 s with 12 of an H200 machine's 16) while
# the GPU runs what does not need it; its tests and the layer benchmark (which compares both backends) wait for
# the build. Compiling with Inductor comes last: it is the newest and slowest step, and the deadline cuts it first.
if [[ $BUILD -eq 1 ]]; then
    MAX_JOBS=${MAX_JOBS:-$(( $(nproc) * 3 / 4 ))} step megablocks_build 330 build_megablocks &
    build=$!
fi
step gpu_tests 300 "$PYTHON" -m pytest -q -s -rs tests/gpu --ignore tests/gpu/test_megablocks_parity.py \
    --ignore tests/gpu/test_compile.py -k "not megablocks" --junitxml "$OUT/gpu_tests.xml"
step train_step_bench 90 "$PYTHON" benchmarks/train_step.py --device cuda --json "$OUT/train_step.json"
[[ $BUILD -eq 1 ]] && wait "$build"
step megablocks_tests 45 "$PYTHON" -m pytest -q -rs tests/gpu/test_megablocks_parity.py tests/gpu/test_syncs.py \
    -k megablocks --junitxml "$OUT/megablocks_tests.xml"
step moe_layer_bench 90 "$PYTHON" benchmarks/moe_layer.py --device cuda --json "$OUT/moe_layer.json"
step compile_tests 150 "$PYTHON" -m pytest -q -rs tests/gpu/test_compile.py --junitxml "$OUT/compile_tests.xml"
step compile_bench 150 "$PYTHON" benchmarks/train_step.py --device cuda --compile --json "$OUT/compile_bench.json"
"$PYTHON" scripts/gpu_summary.py "$OUT"
