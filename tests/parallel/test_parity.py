"""Parity, the proof of a parallel layout: same initial weights and data, same numbers as one process.

Each layout trains 5 optimizer steps; every step's loss, aux loss and gradient norm (the clipping
input) must match the single-process reference to 1e-4 relative, and so must every final parameter.
The reference runs the global batch of 8 as the same micro-batches that each data-parallel rank sees
(8 / data-parallel ranks sequences), so capacity-limited routing groups tokens the same way in both.
"""

import pytest
import torch

from tests.parallel.parity import run

STEPS = 5
LAYOUTS = [  # (overrides, world size, capacity factor)
    pytest.param(["parallel.dp_shard=2"], 2, "null", id="dp_shard=2-dropless"),
    pytest.param(["parallel.dp_shard=2"], 2, "1.25", id="dp_shard=2-capacity"),
    pytest.param(["parallel.dp_replicate=2", "parallel.dp_shard=2"], 4, "1.25", id="dp_replicate=2xdp_shard=2"),
    # expert parallelism folded over dp_shard: edp = dp_shard / ep replicas of each expert
    pytest.param(["parallel.dp_shard=2", "parallel.ep=2"], 2, "null", id="ep=2-dropless"),
    pytest.param(["parallel.dp_shard=2", "parallel.ep=2"], 2, "1.25", id="ep=2-capacity"),
    pytest.param(["parallel.dp_shard=4", "parallel.ep=4"], 4, "1.25", id="ep=4"),
    pytest.param(["parallel.dp_shard=4", "parallel.ep=2"], 4, "null", id="ep=2xedp=2-dropless"),
    # HSDP experts: one shard per replica group (edp=1), all-reduced over dp_replicate
    pytest.param(["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.ep=2"], 4, "1.25",
                 id="dp_replicate=2xep=2"),
    # activation checkpointing under FSDP: the recompute gathers the block's shards (and redoes the all-to-alls)
    pytest.param(["parallel.dp_shard=2", "parallel.activation_checkpointing=full"], 2, "1.25",
                 id="dp_shard=2-recompute"),
    pytest.param(["parallel.dp_shard=2", "parallel.ep=2", "parallel.activation_checkpointing=moe"], 2, "null",
                 id="ep=2-recompute-moe"),
]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Single-process runs, one per capacity setting, computed once."""
    cache = {}

    def get(settings: list[str]):
        key = tuple(settings)
        if key not in cache:
            cache[key] = run(settings, 1, tmp_path_factory.mktemp("reference"))
        return cache[key]

    return get


@pytest.mark.parametrize("layout, world_size, capacity", LAYOUTS)
def test_layout_matches_single_process(layout, world_size, capacity, references, tmp_path):
    settings = [f"train.steps={STEPS}", f"moe.capacity_factor={capacity}", f"train.micro_batch_size={8 // world_size}"]
    ref_records, ref_state = references(settings)
    records, state = run([*settings, *layout], world_size, tmp_path)

    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for ref, got in zip(ref_records, records, strict=True):
        for key in ("train/loss", "train/aux_loss", "train/z_loss", "train/grad_norm", "train/dropped_frac",
                    "router/layer0/entropy", "router/layer0/top1_prob", "router/layer0/maxvio"):
            assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-7), (got["step"], key)
        assert got["router/layer0/load"] == pytest.approx(ref["router/layer0/load"], rel=1e-6)
    assert ref_records[-1]["train/loss"] < ref_records[0]["train/loss"]  # it trained: the check has teeth
    assert state.keys() == ref_state.keys()
    for name in ref_state:
        torch.testing.assert_close(state[name], ref_state[name], rtol=1e-4, atol=1e-5, msg=name)
