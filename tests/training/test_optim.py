"""Warmup + cosine schedule and the AdamW parameter groups."""

import math

import pytest

from config.model import ModelConfig, MoEConfig
from config.run import TrainConfig
from moe.transformer import MoETransformer
from training.optim import build_optimizer, learning_rate


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
