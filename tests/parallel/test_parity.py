"""Parity, the proof of a parallel layout: same initial weights and data, same numbers as one process.

Each layout trains 5 optimizer steps; every step's loss, aux loss and gradient norm (the clipping
input) must match the single-process reference to 1e-4 relative, and so must every final parameter.
The reference runs the global batch of 8 as the same micro-batches that each data-parallel rank sees
(8 / data-parallel ranks sequences), so capacity-limited routing groups tokens the same way in both.
"""

import pytest
import torch

from parallel.groups import Layout
from tests.parallel.parity import run
from training.config import load_config

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
    # tensor parallelism: heads and FFN hidden split, router replicated; one data-parallel rank
    pytest.param(["parallel.tp=2"], 2, "null", id="tp=2-dropless"),
    pytest.param(["parallel.tp=2"], 2, "1.25", id="tp=2-capacity"),
    # ep=2 folded over the tp group: each tp rank sends its half of the rows to the experts
    pytest.param(["parallel.tp=2", "parallel.ep=2"], 2, "1.25", id="tp=2xep=2"),
    pytest.param(["parallel.dp_shard=2", "parallel.tp=2", "parallel.ep=2"], 4, "null", id="dp_shard=2xtp=2xep=2"),
    # HSDP of tensor-parallel shards: a 3-D (dp_replicate, dp_shard, tp) layout of the dense weights
    pytest.param(["parallel.dp_replicate=2", "parallel.tp=2", "parallel.ep=2"], 4, "1.25",
                 id="dp_replicate=2xtp=2xep=2"),
    # more expert replicas (edp=2) than data-parallel ranks (1): their gradients are summed, not averaged
    pytest.param(["parallel.tp=4", "parallel.ep=2"], 4, "null", id="tp=4xep=2"),
    # expert tensor parallelism: each expert's hidden dim split over etp ranks inside the tp group
    pytest.param(["parallel.tp=2", "parallel.etp=2"], 2, "1.25", id="tp=2xetp=2"),
    pytest.param(["parallel.dp_shard=2", "parallel.tp=2", "parallel.etp=2"], 4, "null", id="dp_shard=2xtp=2xetp=2"),
    pytest.param(["parallel.tp=4", "parallel.ep=2", "parallel.etp=2"], 4, "1.25", id="tp=4xep=2xetp=2"),
]


def _dp_size(layout: list[str], world_size: int) -> int:
    """Data-parallel ranks of a layout: each sees its own micro-batches (tensor-parallel ranks share theirs)."""
    return Layout.resolve(world_size, **load_config("moe-8x", layout).parallel.degrees()).dp


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
    micro_batch = 8 // _dp_size(layout, world_size)
    settings = [f"train.steps={STEPS}", f"moe.capacity_factor={capacity}", f"train.micro_batch_size={micro_batch}"]
    ref_records, ref_state = references(settings)
    records, state = run([*settings, *layout], world_size, tmp_path)

    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for ref, got in zip(ref_records, records, strict=True):
        for key in ("train/loss", "train/aux_loss", "train/z_loss", "train/grad_norm", "train/dropped_frac"):
            assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-7), (got["step"], key)
        assert got["router/layer0/load"] == pytest.approx(ref["router/layer0/load"], rel=1e-6)
    assert ref_records[-1]["train/loss"] < ref_records[0]["train/loss"]  # it trained: the check has teeth
    assert state.keys() == ref_state.keys()
    for name in ref_state:
        torch.testing.assert_close(state[name], ref_state[name], rtol=1e-4, atol=1e-5, msg=name)
