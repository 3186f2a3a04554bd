#!/usr/bin/env bash
# Try scripts/launch/slurm.sbatch against a real Slurm on this one machine: a controller and two node daemons
# (Debian's slurm-wlm, munge for authentication), the job on 2 "nodes" of 1 CPU worker each, a tiny model.
#
#   sudo apt-get install slurm-wlm      # once (Debian 12: Slurm 22.05)
#   bash scripts/slurm_tryout.sh        # as root: it starts munged, slurmctld and two slurmd, and stops them after
#
# For a throwaway machine: the first node is named as this machine (so that, as on a real cluster, torchrun's agent
# there finds the rendezvous host to be itself and hosts the store: an agent on a node named otherwise would only
# ever connect), the second gets a loopback address of its own in /etc/hosts; Slurm's state stays under $WORK.
# Both agents run on this machine, so both find the host to be themselves: the first to bind the port hosts the
# store and the other connects (torch's c10d backend retries as a client). make test does not need any of it.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=${WORK:-/tmp/slurm-tryout}
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
NODE1=$(hostname)
NODE2=$NODE1-n2
rm -rf "$WORK" && mkdir -p "$WORK/state" "$WORK/run" "$WORK/spool-$NODE1" "$WORK/spool-$NODE2"
grep -q " $NODE2\$" /etc/hosts || echo "127.0.0.3 $NODE2" >> /etc/hosts

cat > "$WORK/slurm.conf" <<EOF
ClusterName=tryout
SlurmctldHost=localhost
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=$WORK/state
SlurmdSpoolDir=$WORK/spool-%n
SlurmctldPidFile=$WORK/slurmctld.pid
SlurmdPidFile=$WORK/slurmd-%n.pid
SlurmctldLogFile=$WORK/slurmctld.log
SlurmdLogFile=$WORK/slurmd-%n.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmctldPort=16817
NodeName=$NODE1 NodeAddr=127.0.0.1 Port=16818 CPUs=1 RealMemory=4000 State=UNKNOWN
NodeName=$NODE2 NodeAddr=127.0.0.3 Port=16819 CPUs=1 RealMemory=4000 State=UNKNOWN
PartitionName=cpu Nodes=$NODE1,$NODE2 Default=YES MaxTime=30 State=UP
EOF
export SLURM_CONF=$WORK/slurm.conf

pids=()
stop() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; }
trap stop EXIT
mkdir -p /run/munge && chown munge:munge /run/munge 2>/dev/null || true
if ! pgrep -x munged >/dev/null; then munged --force; fi  # its own pid file: stopped by the OS with the machine
slurmctld -D -f "$SLURM_CONF" & pids+=($!)
for node in "$NODE1" "$NODE2"; do slurmd -D -f "$SLURM_CONF" -N "$node" & pids+=($!); done
for _ in $(seq 30); do sinfo -h -o "%T" 2>/dev/null | grep -q idle && break; sleep 1; done
sinfo

# The sbatch file as a user submits it; only the GPU request is replaced (these nodes have none: one gloo worker
# each), and the model is tiny. --wait returns the job's exit status.
export REPO PYTHON RUN_DIR=$WORK/run CACHE_DIR=$WORK/cache GPUS_PER_NODE=1 PORT=${PORT:-29731}
export SET="model.d_model=64 model.n_layers=2 model.n_heads=4 model.seq_len=64 model.ffn_hidden=128 \
moe.num_experts=4 moe.expert_hidden=64 train.global_batch_size=8 train.steps=4 logging.wandb=disabled \
logging.progress=lines logging.log_interval=1 parallel.dp_shard=2 parallel.ep=2"
cd "$WORK"
status=0
sbatch --wait --gpus-per-node=0 --output="$WORK/job-train.out" "$REPO/scripts/launch/slurm.sbatch" || status=$?
echo "sbatch --wait exit status: $status (0 expected)"
cat "$WORK/job-train.out"
ls "$WORK/run/checkpoints"
# a user error on every node: launch.py keeps train.py's status 2, and Slurm reports it as the job's
bad=0
SET="$SET moe.top_k=9" RUN_DIR=$WORK/bad sbatch --wait --gpus-per-node=0 --output="$WORK/job-bad.out" \
    "$REPO/scripts/launch/slurm.sbatch" || bad=$?
echo "sbatch --wait exit status: $bad (2 expected)"
grep -v "^srun: " "$WORK/job-bad.out" | sort | uniq -c
scontrol show job -o | grep -o "JobId=[0-9]* JobName=[^ ]*\|JobState=[A-Z]*\|ExitCode=[0-9:]*"
[ "$status" = 0 ] && [ "$bad" = 2 ]
