#!/usr/bin/env bash
# Three ways to balance the default MoE, trained for the same steps on the same data and seed:
# the Switch/GShard aux loss (the default config), no balancing at all, and aux-loss-free
# balancing (DeepSeek-V3's per-expert selection bias, with the aux loss off). Then one line per run:
# final losses, and imbalance / MaxVio / dropped fraction / entropy over the last logging intervals.
#
#   scripts/balancing_story.sh                  # 300 steps each (the default config's length)
#   STEPS=40 scripts/balancing_story.sh --set logging.wandb=disabled   # extra args go to every train.py
#
# Each run goes to runs/balance-<time>-{aux,none,bias}, so earlier runs are never overwritten.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
CONFIG=${CONFIG:-moe-8x}
STEPS=${STEPS:-300}
BIAS_RATE=${BIAS_RATE:-0.001}  # DeepSeek-V3's bias update speed
stamp=$(date +%Y%m%d-%H%M%S)
runs=()
for variant in aux none bias; do
    case $variant in
        aux)  settings=() ;;
        none) settings=(moe.aux_loss_coef=0) ;;
        bias) settings=(moe.aux_loss_coef=0 "moe.bias_update_rate=$BIAS_RATE") ;;
    esac
    dir="runs/balance-$stamp-$variant"
    echo "== $variant: $dir" >&2
    "$PY" train.py --config "$CONFIG" --run-dir "$dir" --set "train.steps=$STEPS" ${settings[@]+"${settings[@]}"} "$@"
    runs+=("$dir")
done
"$PY" -m analysis.router summary "${runs[@]}"
