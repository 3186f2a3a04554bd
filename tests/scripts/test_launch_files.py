"""The cluster launch files: ``scripts/launch/slurm.sbatch`` run as Slurm would run it (``srun`` and ``scontrol``
stand-ins on PATH), once to read the command it builds, checked by torchrun's own parser and train.py's checks,
and once for real on this machine (one node, one CPU rank, a tiny model) through launch.py, leaving a checkpoint;
``scripts/launch/multinode.sh``'s arguments and refusals. A real Slurm is not needed (docs/journeys.md)."""

import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import yaml
from torch.distributed.run import get_args_parser

import train
from parallel.checkpoint import published_checkpoints

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "scripts" / "launch" / "slurm.sbatch"
MULTINODE = ROOT / "scripts" / "launch" / "multinode.sh"
TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.seq_len=32", "model.ffn_hidden=64",
        "moe.num_experts=4", "moe.expert_hidden=32", "train.global_batch_size=4", "train.warmup_steps=0",
        "train.precision=fp32", "train.eval_interval=0", "train.eval_batches=1", "logging.wandb=disabled",
        "logging.progress=lines", "train.steps=2", "data.val_fraction=0.2"]


def stand_ins(folder: Path, srun_body: str) -> dict[str, str]:
    """A PATH whose ``scontrol`` lists the allocation's hosts and whose ``srun`` runs ``srun_body``."""
    folder.mkdir()
    # the second host comes a moment after the first, as from a real scontrol with a long host list: a script that
    # stops reading after the first line (| head -n 1) then fails with SIGPIPE under pipefail, every time
    (folder / "scontrol").write_text('#!/bin/bash\n[[ "$1 $2" == "show hostnames" ]] && echo node-a && sleep 0.3 '
                                     '&& echo node-b\n')
    (folder / "srun").write_text("#!/bin/bash\n" + srun_body)
    for tool in ("scontrol", "srun"):
        (folder / tool).chmod(0o755)
    return {"PATH": f"{folder}:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp")}


def test_the_sbatch_file_asks_for_one_task_per_node_and_builds_a_command_torchrun_and_train_py_accept(tmp_path):
    text = SBATCH.read_text()
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", text, flags=re.M))
    assert directives["ntasks-per-node"] == "1" and directives["nodes"] == "2"
    record = tmp_path / "srun.args"
    env = stand_ins(tmp_path / "bin", f'printf "%s\\n" "$@" > {record}\n')
    env.update(SLURM_JOB_NODELIST="node-[a-b]", SLURM_NNODES="2", SLURM_JOB_ID="42", SLURM_GPUS_ON_NODE="8",
               REPO=str(ROOT), PYTHON="python3", SET="parallel.ep=8 train.steps=10")
    done = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    words = record.read_text().splitlines()
    assert words[:3] == ["--kill-on-bad-exit=1", "python3", "launch.py"]
    launcher = get_args_parser().parse_args(words[3:])  # torchrun's own parser, as launch.py uses it
    assert (launcher.nnodes, launcher.nproc_per_node, launcher.rdzv_backend, launcher.rdzv_endpoint,
            launcher.rdzv_id, launcher.training_script) == ("2", "8", "c10d", "node-a:29500", "42", "train.py")
    args = train.parse_args(launcher.training_script_args)
    assert args.config == "moe-8x" and args.run_dir == ROOT / "runs" / "moe-8x"
    assert args.overrides == [f"data.cache_dir={ROOT}/.cache/data", "parallel.ep=8", "train.steps=10"]
    config, resolved = train.check(args, world_size=16)
    assert resolved.layout.world_size == 16 and resolved.layout.ep == 8 and config.train.steps == 10


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_sbatch_file_trains_and_checkpoints_on_one_node(tmp_path):
    """The script end to end as Slurm would start it on a one-node allocation (srun runs its command here)."""
    text = tmp_path / "corpus.txt"
    text.write_text("def f(x):\n    return x + 1\n\n" * 200)
    env = stand_ins(tmp_path / "bin", 'while [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    (tmp_path / "bin" / "scontrol").write_text("#!/bin/bash\necho localhost\n")
    settings = [*TINY, f"data.source={text}"]
    env.update(SLURM_JOB_NODELIST="localhost", SLURM_NNODES="1", SLURM_JOB_ID="7", GPUS_PER_NODE="1",
               REPO=str(ROOT), PYTHON=sys.executable, RUN_DIR=str(tmp_path / "run"), CACHE_DIR=str(tmp_path / "c"),
               PORT=str(free_port()), SET=shlex.join(settings), OMP_NUM_THREADS="1")
    done = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert [step for step, _ in published_checkpoints(tmp_path / "run" / "checkpoints")] == [2, 1]
    env["SET"] = shlex.join([*settings, "train.lr=-1"])  # a user error keeps train.py's status through launch.py
    done = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "train.lr must be positive" in done.stderr and "Traceback" not in done.stderr


def test_the_multinode_script_passes_its_arguments_and_refuses_bad_ones(tmp_path):
    recorder = tmp_path / "python"
    recorder.write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {tmp_path / "args"}\n')
    recorder.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(recorder), "GPUS_PER_NODE": "8"}
    run = lambda *args, **extra: subprocess.run(["bash", str(MULTINODE), *args], env={**env, **extra},  # noqa: E731
                                                capture_output=True, text=True, timeout=60)
    assert run("2", "10.0.0.1", "--config", "moe-8x", "--set", "parallel.ep=8").returncode == 0
    words = (tmp_path / "args").read_text().splitlines()
    launcher = get_args_parser().parse_args(words[1:])
    assert words[0] == "launch.py" and (launcher.nnodes, launcher.nproc_per_node, launcher.rdzv_endpoint) == (
        "2", "8", "10.0.0.1:29500")
    assert launcher.training_script_args == ["--config", "moe-8x", "--set", "parallel.ep=8"]
    assert "HEAD_ADDRESS" in run("--help").stdout
    usage = run("2")
    assert usage.returncode == 2 and "HEAD_ADDRESS" in usage.stdout
    bad = run("two", "h")
    assert bad.returncode == 2 and "NNODES must be a positive number of nodes, got 'two'" in bad.stderr
    no_gpu = subprocess.run(["bash", str(MULTINODE), "1", "h"], env={"PATH": "/usr/bin:/bin", "PYTHON": str(recorder)},
                            capture_output=True, text=True, timeout=60)
    assert no_gpu.returncode == 2 and "no GPU found by nvidia-smi; set GPUS_PER_NODE" in no_gpu.stderr


def test_the_pytorchjob_runs_launch_py_with_the_operators_variables_and_a_shared_run_directory(monkeypatch):
    job = yaml.safe_load((ROOT / "scripts" / "launch" / "pytorchjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    specs = job["spec"]["pytorchReplicaSpecs"]
    nodes = sum(spec["replicas"] for spec in specs.values())
    per_node = job["spec"]["nprocPerNode"]
    for spec in specs.values():
        [container] = spec["template"]["spec"]["containers"]
        assert container["name"] == "pytorch" and container["resources"]["limits"]["nvidia.com/gpu"] == int(per_node)
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        command = container["command"]
        assert command[:2] == ["python", "launch.py"]
        # what the operator sets in each pod; torchrun's parser (launch.py's) reads its options from them
        for name, value in dict(PET_NNODES=str(nodes), PET_NPROC_PER_NODE=per_node, PET_NODE_RANK="1",
                                PET_MASTER_ADDR="moe-train-master-0", PET_MASTER_PORT="23456").items():
            monkeypatch.setenv(name, value)
        launcher = get_args_parser().parse_args(command[2:])
        assert (launcher.nnodes, launcher.nproc_per_node, launcher.node_rank) == (str(nodes), per_node, 1)
        args = train.parse_args(launcher.training_script_args)
        cache = next(o.split("=", 1)[1] for o in args.overrides if o.startswith("data.cache_dir="))
        assert str(args.run_dir).startswith(mounts["shared"]) and cache.startswith(mounts["shared"])
        _, resolved = train.check(args, world_size=nodes * int(per_node))
        assert resolved.layout.world_size == 16


def test_zero_counts_and_a_run_outside_slurm_are_refused_with_one_message(capsys):
    import launch

    for argv, option in ((["--nproc-per-node", "0"], "--nproc-per-node 0"), (["--nnodes", "0"], "--nnodes 0"),
                         (["--nnodes", "2:1"], "--nnodes 2:1"), (["--nproc-per-node", "two"], "--nproc-per-node two")):
        assert launch.main(["--standalone", *argv, "train.py"]) == 2
        err = capsys.readouterr().err
        assert f"error: {option}: give the" in err and "Traceback" not in err, err
    assert launch.check_counts("1:2", "auto") is None  # torchrun's other forms pass
    base = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "REPO": str(ROOT), "PYTHON": "false"}
    outside = subprocess.run(["bash", str(SBATCH)], env=base, capture_output=True, text=True, timeout=60)
    assert outside.returncode == 2 and "SLURM_JOB_ID is not set: this file runs inside a Slurm job" in outside.stderr
    assert "unbound variable" not in outside.stderr
    slurm = dict(SLURM_JOB_NODELIST="n1", SLURM_NNODES="1", SLURM_JOB_ID="7", GPUS_PER_NODE="0")
    zero = subprocess.run(["bash", str(SBATCH)], env={**base, **slurm}, capture_output=True, text=True, timeout=60)
    assert zero.returncode == 2 and "GPUS_PER_NODE must be a positive number of processes per node, got '0'" in (
        zero.stderr)
    zero = subprocess.run(["bash", str(MULTINODE), "1", "h"], env={**base, "GPUS_PER_NODE": "0"},
                          capture_output=True, text=True, timeout=60)
    assert zero.returncode == 2 and "GPUS_PER_NODE must be a positive number" in zero.stderr
