"""Warmup + cosine schedule and the AdamW parameter groups."""

import math

import pytest

from config.model import ModelConfig, MoEConfig
from config.run import TrainConfig
from moe.transformer import MoETransformer
from training.optim import build_optimizer, learning_rate, restretch_note, warmup_note


def test_warmup_then_cosine_to_the_floor():
    config = TrainConfig(steps=110, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert learning_rate(1, config) == pytest.approx(0.1)
    assert learning_rate(10, config) == pytest.approx(1.0)
    assert learning_rate(60, config) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert learning_rate(110, config) == pytest.approx(0.1)


def test_a_run_shorter_than_its_warmup_warms_up_throughout():
    config = TrainConfig(steps=5, lr=2.0, warmup_steps=30)
    assert [learning_rate(s, config) for s in range(1, 6)] == pytest.approx([0.4, 0.8, 1.2, 1.6, 2.0])


def test_only_matrices_are_decayed():
    model = MoETransformer(ModelConfig(d_model=16, n_layers=1, n_heads=2, seq_len=8, ffn_hidden=8),
                           MoEConfig(num_experts=2, top_k=1, expert_hidden=8))
    optimizer = build_optimizer(model, TrainConfig(weight_decay=0.1))
    decayed, plain = optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decayed["params"]) and all(p.dim() == 1 for p in plain["params"])
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))


def test_a_warmup_longer_than_the_run_is_said_with_its_curve():
    assert warmup_note(TrainConfig(steps=100, warmup_steps=30)) is None
    note = warmup_note(TrainConfig(steps=20, warmup_steps=30, lr=1e-3))
    # the whole run warms up over its 20 steps: 1e-3 / 20 at step 1
    assert note == ("schedule: train.warmup_steps=30 is longer than train.steps=20, so the whole run warms up: lr "
                    "5e-05 at step 1 rising to 0.001 at step 20, with no decay; set train.warmup_steps below 20 for a "
                    "cosine decay")


def test_a_schedule_changed_at_resume_is_said_with_the_old_and_new_key_points():
    config = TrainConfig(steps=200, warmup_steps=10, lr=1.0, min_lr_ratio=0.0)
    saved = {"steps": 100, "warmup_steps": 10, "lr": 1.0, "min_lr_ratio": 0.0, "seed": 5}
    assert restretch_note({**saved, "steps": 200}, config, 50) is None
    note = restretch_note(saved, config, 50)
    # by hand: cosine from the end of warmup (step 10) to the last step, at step 51
    old, new = 0.5 * (1 + math.cos(math.pi * 41 / 90)), 0.5 * (1 + math.cos(math.pi * 41 / 190))
    assert note == (f"schedule redrawn at resume (train.steps 100 -> 200): was lr {old:.3g} at step 51, warmup "
                    f"ending at step 10, decay ending at step 100 at lr 0; now lr {new:.3g} at step 51, warmup ending "
                    "at step 10, decay ending at step 200 at lr 0")
