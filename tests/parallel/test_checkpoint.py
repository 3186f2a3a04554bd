"""Checkpoints across processes: exact resume under expert parallelism, and resharding into other layouts.

The source run trains 6 steps under ep=2 (2 gloo processes), saving after steps 3 and 6, and gathers its
final weights and Adam state (``full_tensor`` of each shard, no checkpoint code). Then:

- ep=2 again, resumed from step 3: steps 4-6 and the final weights equal the source bit for bit;
- other layouts (one process, dp_shard=2, ep=4, dp_replicate=2 x dp_shard=2) load the step-6 checkpoint,
  and every tensor, each expert's weights and Adam moments included, equals the gathered one exactly;
  resumed from step 3 they continue the source's losses within fp32 tolerance (dropless routing, so the
  batch split across ranks does not change which tokens an expert keeps).

And a Muon run under ep=2: its checkpoint, momentum buffers included, loads into one process exactly and resumes
there; and a pp=2 run with multi-token prediction, whose last stage holds a copy of the embedding, loads into one
process exactly.
"""

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from config.run import load_config
from moe.transformer import MoETransformer
from parallel import parallelize
from parallel.checkpoint import load_sharded, stateful_module
from parallel.groups import ParallelGroups
from parallel.layout import Layout
from parallel.runtime import Runtime, init_runtime
from tests.parallel.parity import TINY, full_state
from tests.spawn import spawn
from training.loop import train
from training.metrics import read_metrics
from training.optim import build_optimizer

SETTINGS = [*TINY, "train.steps=6", "checkpoint.interval=3", "moe.capacity_factor=null",
            "moe.bias_update_rate=0.01", "train.micro_batch_size=2"]  # same micro-batches on 1, 2 or 4 ranks
EP2 = ["parallel.dp_shard=2", "parallel.ep=2"]


def gathered(model, optimizer) -> dict[str, torch.Tensor]:
    """Every model tensor and every Adam state tensor, full, keyed ``model/<name>`` and ``optim/<name>/<key>``."""
    out = {f"model/{name}": value for name, value in full_state(model).items()}
    for name, state in get_optimizer_state_dict(stateful_module(model), optimizer)["state"].items():
        for key, value in state.items():
            out[f"optim/{name}/{key}"] = (value.full_tensor() if isinstance(value, DTensor) else value).clone()
    return out


def _job(rank: int, world_size: int, overrides: list[str], job: dict) -> None:
    """In one process of the layout: optionally load a checkpoint and gather it, optionally train."""
    config = load_config("moe-8x", [*SETTINGS, *overrides])
    runtime = init_runtime() if world_size > 1 else Runtime(0, 1, 0, torch.device("cpu"))
    groups = ParallelGroups.build(Layout.resolve(world_size, **config.parallel.degrees()), "cpu")
    if "load" in job:
        # weights unlike the checkpoint's, so a tensor not loaded would show
        model = parallelize(MoETransformer(config.model, config.moe, seed=123), groups)
        optimizer = build_optimizer(model, config.train)
        load_sharded(model, optimizer, Path(job["load"]))
        state = gathered(model, optimizer)
        if rank == 0:
            torch.save(state, job["load_out"])
    if "run_dir" in job:
        result = train(config, Path(job["run_dir"]), runtime, groups)
        if "final_out" in job:  # under pp each rank holds its stages' part: merged on rank 0
            state = gathered(result.model, result.optimizer)
            parts = [None] * world_size if rank == 0 and world_size > 1 else None
            if world_size > 1:
                dist.gather_object(state, parts, dst=0)
                state = {name: value for part in parts or [] for name, value in part.items()}
            if rank == 0:
                torch.save(state, job["final_out"])


def launch(overrides: list[str], world_size: int, job: dict) -> None:
    if world_size == 1:
        _job(0, 1, overrides, job)
    else:
        spawn(_job, world_size, world_size, overrides, job)


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in r}


def resumable(source: Path, step: int, run_dir: Path) -> Path:
    """A fresh run directory holding only ``source``'s checkpoint of ``step``."""
    name = f"step_{step:07d}"
    shutil.copytree(source / "checkpoints" / name, run_dir / "checkpoints" / name)
    return run_dir


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The ep=2 run: its directory and its gathered final state."""
    run_dir = tmp_path_factory.mktemp("ep2")
    launch(EP2, 2, {"run_dir": str(run_dir), "final_out": str(run_dir / "final.pt")})
    return run_dir, torch.load(run_dir / "final.pt", weights_only=True)


def test_resume_under_expert_parallelism_is_bit_identical(source, tmp_path):
    source_dir, source_state = source
    run_dir = resumable(source_dir, 3, tmp_path)
    launch(EP2, 2, {"run_dir": str(run_dir), "final_out": str(tmp_path / "final.pt")})
    want = train_losses(source_dir)
    assert train_losses(run_dir) == {step: want[step] for step in (4, 5, 6)}
    state = torch.load(tmp_path / "final.pt", weights_only=True)
    assert state.keys() == source_state.keys()
    for name, value in source_state.items():
        assert torch.equal(state[name], value), name


@pytest.mark.parametrize("layout, world_size, resume", [
    pytest.param([], 1, True, id="one-process"),
    # FSDP over cp=2 (the source's dp_shard=2 shards, now by sequence halves), resumed under context parallelism
    pytest.param(["parallel.cp=2"], 2, True, id="cp=2"),
    pytest.param(["parallel.dp_shard=4", "parallel.ep=4"], 4, True, id="ep=4"),
    pytest.param(["parallel.tp=2", "parallel.ep=2"], 2, True, id="tp=2xep=2"),
    # the norms replicated DTensors, the embedding and head split over the vocabulary
    pytest.param(["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.vocab_parallel=true"], 2, True,
                 id="tp=2-sequence+vocab_parallel"),
    # load only: four more processes training would add time, not coverage
    # (HSDP over the flattened dp_shard × cp: its shards are the source's dp_shard=2 shards)
    pytest.param(["parallel.dp_replicate=2", "parallel.cp=2"], 4, False, id="dp_replicate=2xcp=2"),
])
def test_checkpoint_reshards_into_another_layout(source, layout, world_size, resume, tmp_path):
    source_dir, source_state = source
    run_dir = resumable(source_dir, 3, tmp_path / "run")
    job = {"load": str(source_dir / "checkpoints" / "step_0000006"), "load_out": str(tmp_path / "loaded.pt")}
    if resume:
        job.update(run_dir=str(run_dir), final_out=str(tmp_path / "final.pt"))
    launch(layout, world_size, job)
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=True)
    assert loaded.keys() == source_state.keys()
    assert any(".experts." in name and name.endswith("exp_avg_sq") for name in loaded)
    for name, value in source_state.items():  # every expert, every moment: exactly what was saved
        assert torch.equal(loaded[name], value), name
    if not resume:
        return
    want, got = train_losses(source_dir), train_losses(run_dir)
    assert sorted(got) == [4, 5, 6]
    for step in got:  # another layout sums in another order: the parity matrix's tolerance
        assert got[step] == pytest.approx(want[step], rel=1e-4), step
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    for name, value in source_state.items():
        torch.testing.assert_close(final[name], value, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_pipeline_resumes_an_ep_checkpoint_and_saves_one_that_loads_anywhere(source, tmp_path):
    """pp=2 resumes the ep=2 run's step-3 checkpoint (each stage loads its blocks) and saves step 6 from both
    stages; that checkpoint, loaded into one process, holds every tensor of the source's step 6."""
    source_dir, source_state = source
    run_dir = resumable(source_dir, 3, tmp_path / "run")
    launch(["parallel.pp=2"], 2, {"run_dir": str(run_dir)})
    want, got = train_losses(source_dir), train_losses(run_dir)
    assert sorted(got) == [4, 5, 6]
    for step in got:  # another layout sums in another order: the parity matrix's tolerance
        assert got[step] == pytest.approx(want[step], rel=1e-4), step
    launch([], 1, {"load": str(run_dir / "checkpoints" / "step_0000006"), "load_out": str(tmp_path / "loaded.pt")})
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=True)
    assert loaded.keys() == source_state.keys()
    for name, value in source_state.items():  # the same training, in another layout: fp32 tolerance
        torch.testing.assert_close(loaded[name], value, rtol=1e-4, atol=1e-4, msg=name)


INTERLEAVED = ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2",
               "model.n_layers=4", "model.tie_embeddings=false"]


def test_interleaved_pipeline_resumes_bit_identical_and_its_checkpoint_loads_in_one_process(tmp_path):
    """Two stages per rank (blocks 0 and 2 on rank 0, 1 and 3 on rank 1): resumed from step 3 the run
    repeats the uninterrupted steps 4-6 exactly, and its step-6 checkpoint, loaded into one process, is
    every tensor of the uninterrupted run's final state."""
    source_dir, resumed_dir = tmp_path / "source", tmp_path / "resumed"
    launch(INTERLEAVED, 2, {"run_dir": str(source_dir), "final_out": str(tmp_path / "source.pt")})
    launch(INTERLEAVED, 2, {"run_dir": str(resumable(source_dir, 3, resumed_dir)),
                            "final_out": str(tmp_path / "resumed.pt")})
    want = train_losses(source_dir)
    assert train_losses(resumed_dir) == {step: want[step] for step in (4, 5, 6)}
    source_state = torch.load(tmp_path / "source.pt", weights_only=True)
    resumed_state = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert resumed_state.keys() == source_state.keys()
    assert any(name.startswith("optim/layers.3.") for name in source_state)
    for name, value in source_state.items():
        assert torch.equal(resumed_state[name], value), name
    launch(INTERLEAVED[3:], 1, {"load": str(resumed_dir / "checkpoints" / "step_0000006"),
                                "load_out": str(tmp_path / "loaded.pt")})
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=True)
    assert loaded.keys() == source_state.keys()
    for name, value in source_state.items():
        assert torch.equal(loaded[name], value), name


MUON = ["train.optimizer=muon", "train.muon_ns_dtype=fp32"]


def test_a_muon_checkpoint_reshards_into_one_process(tmp_path):
    """Muon's momentum buffers (sharded like the gradients: FSDP's dense shards, the experts by ep) are saved and
    resharded like Adam's moments: the ep=2 Muon run's step-6 checkpoint loads into one process exactly, and its
    step-3 checkpoint, resumed in one process, continues the run's losses (Newton–Schulz in fp32, so the parity
    rows' tolerance holds: ``tests/parallel/test_parity.py``)."""
    source_dir = tmp_path / "source"
    launch([*EP2, *MUON], 2, {"run_dir": str(source_dir), "final_out": str(source_dir / "final.pt")})
    source_state = torch.load(source_dir / "final.pt", weights_only=True)
    assert any(".experts." in name and name.endswith("momentum_buffer") for name in source_state)
    run_dir = resumable(source_dir, 3, tmp_path / "run")
    launch(MUON, 1, {"load": str(source_dir / "checkpoints" / "step_0000006"), "load_out": str(tmp_path / "loaded.pt"),
                     "run_dir": str(run_dir), "final_out": str(tmp_path / "final.pt")})
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=True)
    assert loaded.keys() == source_state.keys()
    for name, value in source_state.items():  # every weight, momentum buffer and Adam moment as it was saved
        assert torch.equal(loaded[name], value), name
    want, got = train_losses(source_dir), train_losses(run_dir)
    assert sorted(got) == [4, 5, 6]
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-4), step
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    for name, value in source_state.items():
        torch.testing.assert_close(final[name], value, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


MTP_PIPELINE = ["train.steps=2", "checkpoint.interval=2", "model.mtp_depth=1", "parallel.pp=2"]


def test_a_pipeline_checkpoint_with_the_mtp_embedding_copy_loads_into_one_process(tmp_path):
    """Under pp=2 with multi-token prediction the last stage holds a copy of the embedding under the embedding's
    name (``parallel/pipeline.py``): the checkpoint keeps one table (and one pair of Adam moments), equal to both
    stages' (``tests/parallel/parity.py`` holds them equal), which loads into one process exactly, the MTP
    module's weights and moments with it."""
    source_dir = tmp_path / "source"
    launch(MTP_PIPELINE, 2, {"run_dir": str(source_dir), "final_out": str(source_dir / "final.pt")})
    source_state = torch.load(source_dir / "final.pt", weights_only=True)
    assert "optim/mtp.0.proj.weight/exp_avg" in source_state
    launch(MTP_PIPELINE[:3], 1, {"load": str(source_dir / "checkpoints" / "step_0000002"),
                                 "load_out": str(tmp_path / "loaded.pt")})
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=True)
    assert loaded.keys() == source_state.keys()
    for name, value in source_state.items():
        assert torch.equal(loaded[name], value), name
