#!/bin/bash
# Train across nodes without a scheduler: run this on every node, with the same arguments.
#
#   scripts/launch/multinode.sh NNODES HEAD_ADDRESS [train.py arguments ...]
#   scripts/launch/multinode.sh 2 10.0.0.1 --config moe-8x --set parallel.ep=8
#
# HEAD_ADDRESS is any one node's address that the others reach (its torchrun hosts the c10d rendezvous on PORT,
# default 29500). Each node runs launch.py (torchrun keeping train.py's exit statuses) with one worker per GPU
# (GPUS_PER_NODE, default: the GPUs nvidia-smi lists). Give --run-dir a folder every node sees (a shared
# filesystem): every rank writes its shards of each checkpoint there, and the run resumes from it when this
# command is run again. NCCL settings: see scripts/launch/slurm.sbatch.
set -euo pipefail

if [[ $# -lt 2 || "$1" == "--help" ]]; then
    sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'
    [[ "${1:-}" == "--help" ]] && exit 0 || exit 2
fi
nnodes=$1 head=$2
shift 2
if ! [[ "$nnodes" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: NNODES must be a positive number of nodes, got '$nnodes'" >&2
    exit 2
fi
REPO=${REPO:-$(cd "$(dirname "$0")/../.." && pwd)}
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
PORT=${PORT:-29500}
if [[ -z "${GPUS_PER_NODE:-}" ]]; then
    GPUS_PER_NODE=$( (nvidia-smi --list-gpus 2>/dev/null || true) | wc -l)
    if [[ "$GPUS_PER_NODE" -eq 0 ]]; then
        echo "error: no GPU found by nvidia-smi; set GPUS_PER_NODE (processes per node; on CPUs, gloo)" >&2
        exit 2
    fi
fi
if ! [[ "$GPUS_PER_NODE" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: GPUS_PER_NODE must be a positive number of processes per node, got '$GPUS_PER_NODE'" >&2
    exit 2
fi
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1  # restarted workers must not reuse old store addresses (#135712)

cd "$REPO"
exec "$PYTHON" launch.py --nnodes "$nnodes" --nproc-per-node "$GPUS_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$head:$PORT" --rdzv-id "${RDZV_ID:-moe-train}" \
    train.py "$@"
