"""Pricing replicas (``analysis/replica_time.py``): hand-computed times, and R = 0 where the copies cost more than
the straggler time they save."""

import pytest

from analysis.replica_time import ReplicaOption, choose_replicas, expert_seconds, layer_seconds
from config.model import MoEConfig


def test_expert_seconds_counts_each_weight_six_times_per_row():
    moe = MoEConfig(num_experts=8, top_k=2, expert_hidden=4, activation="swiglu")
    # 10 tokens x 2 choices = 20 rows, 3 matrices of 3 x 4 = 36 elements, 6 FLOPs each per row: 4,320 FLOPs
    assert expert_seconds(moe, 3, 10, 2160.0) == pytest.approx(2.0)


def test_choose_replicas_prices_copies_against_the_straggler():
    options = [ReplicaOption(1, 1.10, 1.0), ReplicaOption(2, 1.02, 2.0)]
    # 1 s of balanced expert time, 1.5x imbalance; an expert of 100 bytes at 1,000 B/s: 0.2 s a copy both ways
    assert layer_seconds(options[0], 1.0, 100, 1000.0) == pytest.approx(1.10 + 0.2)
    assert choose_replicas(1.5, options, 1.0, 100, 1000.0) == 1  # 1.30 against 1.42 (R=2) and 1.5 (none)
    assert choose_replicas(1.5, options, 1.0, 10, 1000.0) == 2  # cheap copies: 1.06 against 1.12
    assert choose_replicas(1.5, options, 1.0, 10_000, 1000.0) == 0  # a copy costs 20 s: never pays
    assert choose_replicas(1.0, options, 1.0, 1, 1e12) == 0  # balanced already: nothing to save
