"""A tiny trained run shared by the inference tests (trained once per session: a few seconds on 2 cores)."""

from pathlib import Path

import pytest

import train

TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.seq_len=32", "model.ffn_hidden=64",
        "moe.num_experts=4", "moe.expert_hidden=32", "train.global_batch_size=4", "train.warmup_steps=0",
        "train.precision=fp32", "train.eval_interval=0", "train.eval_batches=1", "logging.wandb=disabled",
        "logging.log_interval=1", "logging.progress=lines", "train.steps=3", "train.lr=1e-2",
        "logging.plots=false"]


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> Path:
    """A run directory whose default checkpoints (after step 1 and the final step 3) hold a trained tiny MoE."""
    run_dir = tmp_path_factory.mktemp("inference") / "run"
    assert train.main(["--run-dir", str(run_dir), "--set", *TINY]) == 0
    return run_dir
