"""Fault cases where a run could lose or mix what it published: the NaN guard, run directories, the corpus cache.

Each drives ``train.py`` (in this process through ``train.main``, or as a subprocess where two processes are the
point) with a tiny model for a few steps, and checks the exit status, that no traceback is printed, and that
nothing published was lost or mixed.
"""

import json

import torch

import train
import training.loop
from tests.training.test_checkpointing import load_checkpoint
from training.checkpointing import published_checkpoints

TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.seq_len=32", "model.ffn_hidden=64",
        "moe.num_experts=4", "moe.expert_hidden=32", "train.global_batch_size=4", "train.warmup_steps=0",
        "train.precision=fp32", "train.eval_interval=0", "train.eval_batches=1", "logging.wandb=disabled",
        "logging.log_interval=1", "logging.progress=lines"]


def main(run_dir, *settings, resume=None):
    return train.main(["--run-dir", str(run_dir), *(["--resume", resume] if resume else []),
                       "--set", *TINY, *settings])


def steps(run_dir):
    return [step for step, _ in published_checkpoints(run_dir / "checkpoints")]


def manifests(run_dir):
    found = published_checkpoints(run_dir / "checkpoints")
    return {path.name: (path / "manifest.json").read_text() for _, path in found}


# --- the NaN guard ---------------------------------------------------------------------------------------------


def test_a_divergence_keeps_the_good_checkpoints_and_the_advised_resume_works(tmp_path, capsys):
    assert main(tmp_path, "train.steps=4", "checkpoint.interval=1") == 0
    assert steps(tmp_path) == [4, 3, 2]
    good = manifests(tmp_path)
    capsys.readouterr()

    # lr=1e9: step 5's update (finite loss and gradient) writes weights of ~1e9 that give NaN from step 6 on
    assert main(tmp_path, "train.steps=40", "checkpoint.interval=1", "train.lr=1e9") == 3
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "checkpoint step_0000005 discarded" in err
    assert f"The last good state is {tmp_path}/checkpoints/step_0000004" in err and "lower train.lr" in err
    assert manifests(tmp_path) == good  # nothing published was lost or replaced, nothing bad was published
    assert not list((tmp_path / "checkpoints").glob(".tmp_*"))
    for name in good:
        model, _ = load_checkpoint(tmp_path / "checkpoints" / name, [*TINY, "train.steps=4"])
        assert all(torch.isfinite(p).all() and p.abs().max() < 100 for p in model.parameters()), name

    # the advice: the same command with a lower lr resumes the last good state and finishes
    assert main(tmp_path, "train.steps=6", "checkpoint.interval=1", "train.lr=1e-3") == 0
    err = capsys.readouterr().err
    assert f"resumed from {tmp_path}/checkpoints/step_0000004 at step 4" in err
    assert steps(tmp_path) == [6, 5, 4]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics if "train/loss" in r] == [1, 2, 3, 4, 5, 6]  # the bad steps rewound


def test_an_update_that_writes_non_finite_weights_stops_at_once(tmp_path, monkeypatch, capsys):
    real_step = torch.optim.AdamW.step

    def overflowing(self, *args, **kwargs):  # the third update overflows one weight (its loss and gradient were fine)
        result = real_step(self, *args, **kwargs)
        if self.state[self.param_groups[0]["params"][0]]["step"] == 3:
            with torch.no_grad():
                self.param_groups[0]["params"][0].view(-1)[0] = float("inf")
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", overflowing)
    assert main(tmp_path, "train.steps=10", "checkpoint.interval=1") == 3
    err = capsys.readouterr().err
    assert "step 3: the update gave non-finite weights" in err and "Traceback" not in err
    assert f"The last good state is {tmp_path}/checkpoints/step_0000002" in err
    assert steps(tmp_path) == [2, 1] and not list((tmp_path / "checkpoints").glob(".tmp_*"))


def test_a_final_state_with_non_finite_validation_loss_is_not_saved(tmp_path, monkeypatch, capsys):
    real = training.loop.evaluate
    calls = {"n": 0}

    def evaluate(*args, **kwargs):  # the first run's final validation is fine, the second's NaN
        calls["n"] += 1
        return real(*args, **kwargs) * (float("nan") if calls["n"] > 1 else 1.0)

    monkeypatch.setattr(training.loop, "evaluate", evaluate)
    assert main(tmp_path, "train.steps=2", "checkpoint.interval=1") == 0
    assert main(tmp_path, "train.steps=4", "checkpoint.interval=1") == 3
    err = capsys.readouterr().err
    assert "the final weights give a non-finite validation loss" in err and "Traceback" not in err
    assert steps(tmp_path) == [3, 2, 1]  # step 3 was confirmed by step 4's finite loss; step 4 not saved
