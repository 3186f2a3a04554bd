"""Meta-device construction: each rank allocates only its shards, and they hold the single-process weights.

- ``moe.init``'s chunked draws: any box of a parameter, drawn alone, equals that box of the whole draw,
  and the chunks cover every element once (single process, against a naive whole-tensor fill).
- Layout independence, bit for bit: the initial weights that ``parallel.build.build_model`` gives each rank
  of several layouts (tp with its options, ep, etp, HSDP, pipeline stages, uneven FSDP shards, tied
  embeddings), gathered, equal the single-process model's, with chunks small enough that every
  parameter spans many of them.
- Memory: building one rank's part of a model ~30x its shard, under a fake process group of 8 ranks,
  raises the process's peak resident memory by at most its shards plus a bounded buffer.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import moe.init
from config.run import load_config
from moe.init import Slice, _chunks, fill_normal_
from moe.transformer import MoETransformer
from parallel.build import build_model
from parallel.groups import ParallelGroups
from parallel.resolve import resolve_layout
from tests.parallel.parity import TINY, full_state
from tests.spawn import spawn

SMALL_CHUNK = 40  # elements: every weight of the tiny model spans many chunks, cut along every dim


@pytest.mark.parametrize("shape, chunk", [((7, 5), 10), ((3, 4, 6), 5), ((3, 4, 6), 30), ((50,), 8), ((2, 3), 100)])
def test_any_box_drawn_alone_equals_that_box_of_the_whole(shape, chunk, monkeypatch):
    monkeypatch.setattr(moe.init, "CHUNK_ELEMENTS", chunk)
    whole = torch.empty(shape)
    fill_normal_(Slice(whole, shape, (0,) * len(shape)), "w", seed=3, std=0.5)
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        lo = [int(torch.randint(0, n, (), generator=generator)) for n in shape]
        size = tuple(int(torch.randint(1, n - a + 1, (), generator=generator)) for a, n in zip(lo, shape, strict=True))
        part = torch.full(size, float("nan"))
        fill_normal_(Slice(part, shape, tuple(lo)), "w", seed=3, std=0.5)
        box = tuple(slice(a, a + n) for a, n in zip(lo, size, strict=True))
        assert torch.equal(part, whole[box])
    # the chunks of the whole tensor cover each element exactly once
    covered = torch.zeros(shape, dtype=torch.int64)
    for _, slices, chunk_shape in _chunks(shape, (0,) * len(shape), shape):
        covered[slices] += 1
        assert tuple(covered[slices].shape) == chunk_shape
        assert covered[slices].numel() <= max(chunk, shape[-1])
    assert bool((covered == 1).all())
    # another seed or name draws other numbers; the std scales them
    other = torch.empty(shape)
    fill_normal_(Slice(other, shape, (0,) * len(shape)), "w2", seed=3, std=0.5)
    assert not torch.equal(other, whole)
    assert 0.3 < float(whole.std()) < 0.7


LAYOUTS = {  # name: overrides (all on 4 ranks)
    "dp_shard=2xtp=2xep=2-sequence+vocab": ["parallel.dp_shard=2", "parallel.tp=2", "parallel.ep=2",
                                            "parallel.sequence_parallel=true", "parallel.vocab_parallel=true"],
    "dp_replicate=2xtp=2xep=2": ["parallel.dp_replicate=2", "parallel.tp=2", "parallel.ep=2"],
    "tp=4xep=2xetp=2": ["parallel.tp=4", "parallel.ep=2", "parallel.etp=2"],
    "dp_shard=4xep=2-tied": ["parallel.dp_shard=4", "parallel.ep=2", "model.tie_embeddings=true"],
    "tp=2xdp_shard=2-tied-qwen3_attention": ["parallel.tp=2", "parallel.dp_shard=2", "model.tie_embeddings=true",
                                             "model.qk_norm=true", "model.head_dim=12"],
    "pp=2xdp_shard=2xep=2": ["parallel.pp=2", "parallel.dp_shard=2", "parallel.ep=2", "model.tie_embeddings=false"],
}
UNEVEN = ["parallel.dp_shard=3", "train.global_batch_size=6", "model.vocab_size=257", "model.n_heads=2",
          "moe.num_experts=5", "moe.expert_hidden=20"]  # dim 0 of most weights does not split in 3


def _initial_weights(overrides: list[str], world_size: int) -> dict[str, torch.Tensor]:
    config = load_config("moe-8x", [*TINY, *overrides])
    layout, micro, microbatches = resolve_layout(config, world_size)
    model = build_model(config, ParallelGroups.build(layout, "cpu"), torch.device("cpu"), micro, microbatches,
                        contextlib.nullcontext)
    if config.model.tie_embeddings:
        assert model.output.weight is model.tok_embeddings.weight
    return full_state(model)


def _gather_layouts(rank: int, world_size: int, layouts: dict[str, list[str]], out: str) -> None:
    moe.init.CHUNK_ELEMENTS = SMALL_CHUNK
    result = {}
    for name, overrides in layouts.items():
        parts = [None] * world_size if rank == 0 else None
        dist.gather_object(_initial_weights(overrides, world_size), parts, dst=0)
        if rank == 0:
            result[name] = {key: value for part in parts for key, value in part.items()}
    if rank == 0:
        torch.save(result, out)


@pytest.mark.parametrize("world_size, layouts", [(4, LAYOUTS), (3, {"dp_shard=3-uneven": UNEVEN})], ids=["4", "3"])
def test_every_layout_starts_from_the_single_process_weights(world_size, layouts, tmp_path, monkeypatch):
    out = tmp_path / "weights.pt"
    spawn(_gather_layouts, world_size, world_size, layouts, str(out))
    gathered = torch.load(out, weights_only=True)
    monkeypatch.setattr(moe.init, "CHUNK_ELEMENTS", SMALL_CHUNK)
    for name, overrides in layouts.items():
        config = load_config("moe-8x", [*TINY, *overrides])
        reference = MoETransformer(config.model, config.moe, seed=config.train.seed).state_dict()
        assert gathered[name].keys() == reference.keys(), name
        for key, value in reference.items():
            assert torch.equal(gathered[name][key], value), f"{name}: {key}"


MEMORY_MODEL = ["model.d_model=512", "model.n_layers=4", "model.n_heads=8", "model.ffn_hidden=1024",
                "moe.num_experts=8", "moe.expert_hidden=1024", "parallel.dp_shard=8", "parallel.ep=4"]
PROBE = Path(__file__).with_name("build_memory_probe.py")


def test_building_a_rank_costs_its_shards_not_the_model():
    """Peak resident memory of building rank 5 of 8 (fp32; 209 MiB model, 26 MiB shards), in a fresh process."""
    done = subprocess.run([sys.executable, str(PROBE), "8", "5", *MEMORY_MODEL], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    buffer = 2 * moe.init.CHUNK_ELEMENTS * 4 + (16 << 20)  # a chunk and its copy, and allocator slack
    assert figures["model_bytes"] > 6 * figures["shard_bytes"]  # the check below can tell the two apart
    assert figures["shard_bytes"] <= figures["peak_bytes"] <= figures["shard_bytes"] + buffer, figures


@pytest.mark.parametrize("damage, message", [
    (lambda t: t.fill_(float("nan")), r"tensor '{name}' holds {count} NaN or infinite value\(s\)"),
    (lambda t: t.view(-1).__setitem__(0, float("inf")), r"tensor '{name}' holds 1 NaN or infinite value\(s\)"),
    (lambda t: t.round().to(torch.int32), r"tensor '{name}' holds torch.int32 values; a weight must be"),
])
def test_weights_that_cannot_be_right_are_refused_on_load_naming_the_tensor(damage, message, tmp_path):
    from safetensors.torch import save_file

    from config.errors import ConfigError
    from parallel.materialize import load_weights_file

    config = load_config("moe-8x", TINY)
    model = MoETransformer(config.model, config.moe)
    state = {key: value.clone().contiguous() for key, value in model.state_dict().items()}
    name = next(iter(state))
    damaged = damage(state[name])
    state[name] = damaged if damaged is not None else state[name]
    save_file(state, tmp_path / "weights.safetensors")
    expected = message.format(name=name.replace(".", r"\."), count=f"{state[name].numel():,}")
    with pytest.raises(ConfigError, match=expected):
        load_weights_file(MoETransformer(config.model, config.moe), tmp_path / "weights.safetensors")
