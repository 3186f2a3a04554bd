"""Two nodes on loopback: two torchrun invocations meeting through the c10d rendezvous, as on a cluster.

Each "node" is its own ``torchrun --nnodes 2 --nproc-per-node 1`` process tree, exactly the command
docs/parallelism.md gives for two machines, with 127.0.0.1 as the rendezvous host. The job trains with expert
parallelism across the two nodes and must match the single-process run's numbers.
"""

import subprocess
import sys
from pathlib import Path

import pytest

import train
from parallel.runtime import free_port
from training.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.seq_len=64", "model.ffn_hidden=128",
            "moe.num_experts=4", "moe.expert_hidden=64", "train.global_batch_size=8", "train.warmup_steps=2",
            "train.precision=fp32", "logging.wandb=disabled", "logging.log_interval=1", "train.steps=3",
            "train.eval_interval=0", "train.eval_batches=2"]


def test_two_nodes_on_loopback_match_one_process(tmp_path):
    port = free_port()
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
             "--node-rank", str(rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
             "--rdzv-id", "loopback", "train.py", "--run-dir", str(tmp_path / "two-nodes"),
             "--set", *SETTINGS, "parallel.dp_shard=2", "parallel.ep=2"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in (0, 1)
    ]
    outputs = []
    for node in nodes:
        try:
            outputs.append(node.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for other in nodes:
                other.kill()
            pytest.fail("the two-node run did not finish in 240 s")
    for node, output in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, output[-2000:]
    # global rank 0 (on whichever node the c10d rendezvous put it) printed the layout: ep spans both nodes
    assert "parallel layout of 2 ranks" in "".join(outputs)
    assert any(line.split() == ["ep", "2", "[0,", "1]"] for out in outputs for line in out.splitlines())

    # the reference: one process running the same micro-batches (4 sequences, one rank's share)
    assert train.main(["--run-dir", str(tmp_path / "one"), "--set", *SETTINGS, "train.micro_batch_size=4"]) == 0
    two = [r for r in read_metrics(tmp_path / "two-nodes" / "metrics.jsonl") if "train/loss" in r]
    one = [r for r in read_metrics(tmp_path / "one" / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in two] == [1, 2, 3]
    for a, b in zip(two, one, strict=True):
        for key in ("train/loss", "train/aux_loss", "train/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4), (a["step"], key)
