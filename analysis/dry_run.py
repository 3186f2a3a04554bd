"""``train.py --dry-run``: build every rank's part of a model at full size, on a laptop, without allocating it.

For each rank of the job, in this one process, a fake process group (torch's ``fake`` backend: collectives
return at once) stands in for the job's, and ``parallel.build.build_model`` runs the real construction on
the meta device: the pipeline cut, tensor, expert and sharded data parallelism, all as a real run would
apply them. Nothing is materialised. The parameters' local shards then give this rank's model-state bytes
exactly (fp32 weights, fp32 gradients, AdamW's two fp32 moments: 16 bytes per held element), printed beside
the memory model's prediction (``analysis.memory``), whose whole-step estimate (gathered weights and
activations as well) is printed too. Megatron-LM's ``--fake-init-process-group`` and torchtitan's dry run
do the same.

The layout is validated first exactly as ``train.py`` validates it (``parallel.resolve.resolve_layout``), so
a layout a real run would refuse fails here with the same message.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from analysis.memory import DEFAULT_HEADROOM, GIB, MemoryEstimate, estimate, usable_bytes
from analysis.memory_states import ModelStates
from config.run import RunConfig
from moe.hidden_matrices import outside_hidden_matrices
from parallel.build import build_model
from parallel.groups import ParallelGroups
from parallel.layout import Layout
from parallel.ranks import coordinates
from parallel.resolve import ResolvedLayout


@dataclass(frozen=True)
class RankStates:
    """One rank's model states as built: bytes of its local parameter shards (fp32), dense and routed experts."""

    rank: int
    pp_rank: int
    weights_dense: int
    weights_experts: int
    muon_weights: int  # of those, the bytes Muon updates (under train.optimizer=muon; 0 under AdamW)

    @property
    def weights(self) -> int:
        return self.weights_dense + self.weights_experts

    @property
    def total(self) -> int:
        """Weights, gradients and the optimizer's state, counted as the memory model counts them."""
        return ModelStates(self.weights_dense, self.weights_experts, self.muon_weights).total


def built_states(config: RunConfig, layout: Layout, rank: int, micro: int, microbatches: int) -> RankStates:
    """Build rank ``rank``'s model on meta under a fake process group and measure its local shards."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
    try:
        groups = ParallelGroups.build(layout, "cpu")
        model = build_model(config, groups, torch.device("cpu"), micro, microbatches, contextlib.nullcontext,
                            allocate=False)
        for_adamw = outside_hidden_matrices(model) if config.train.optimizer == "muon" else None
        dense = experts = muon = 0
        for name, param in model.named_parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            nbytes = local.numel() * 4  # fp32 master weights
            if ".experts." in name:
                experts += nbytes
            else:
                dense += nbytes
            if for_adamw is not None and id(param) not in for_adamw:
                muon += nbytes
        return RankStates(rank, groups.coords()["pp"], dense, experts, muon)
    finally:
        dist.destroy_process_group()


def extreme_ranks(layout: Layout) -> list[int]:
    """The first and the last rank of each pipeline stage: between them lie every other rank's shard sizes.

    Within a stage, tensor and expert parallelism split evenly (the layout check requires it), and FSDP2
    gives dim 0's chunks in rank order, larger first (``torch.chunk``): the stage's first rank (every other
    coordinate 0) holds the largest shards, its last rank (every coordinate at its maximum) the smallest.
    """
    stages: dict[int, list[int]] = {}
    for rank in range(layout.world_size):
        stages.setdefault(coordinates(layout, rank)["pp"], []).append(rank)
    return sorted({rank for ranks in stages.values() for rank in (ranks[0], ranks[-1])})


def dry_run(config: RunConfig, resolved: ResolvedLayout, precision: str,
            every_rank: bool = False) -> tuple[list[RankStates], list[MemoryEstimate]]:
    """Built model states of each stage's first and last rank (or of every rank), and the memory model's estimate
    for each pipeline rank, of ``config`` laid out as ``resolved`` (``resolve_layout``'s)."""
    layout, micro, microbatches = resolved
    world_size = layout.world_size
    ranks = range(world_size) if every_rank else extreme_ranks(layout)
    built = [built_states(config, layout, rank, micro, microbatches) for rank in ranks]
    estimates = [estimate(config, world_size, precision, pp_rank, resolved) for pp_rank in range(layout.pp)]
    return built, estimates


def format_dry_run(config: RunConfig, built: list[RankStates], estimates: list[MemoryEstimate],
                   device_gib: float | None, headroom: float = DEFAULT_HEADROOM, device: str = "") -> str:
    """One line per group of ranks with the same figures: built model states beside the prediction; with
    ``device_gib`` (the GPU's memory; ``device`` names it) a verdict on whether the busiest rank fits in it less
    ``headroom`` (``analysis.memory.DEFAULT_HEADROOM``), and where to look when it does not."""
    lines = [f"dry run of '{config.name}': the model of ranks {_ranks([s.rank for s in built])} built on the meta "
             "device under a fake process group, nothing allocated (each stage's first and last rank bound the "
             "others' shards)",
             f"{'ranks':<24}{'pp':>4}{'dense':>12}{'experts':>12}{'model states':>14}{'predicted':>12}"
             f"{'step total':>12}  (GiB; model states = fp32 weights + gradients + "
             f"{'AdamW moments' if config.train.optimizer == 'adamw' else 'the optimizer state'})"]
    groups: dict[tuple, list[int]] = {}
    for states in built:
        groups.setdefault((states.pp_rank, states.weights_dense, states.weights_experts, states.muon_weights),
                          []).append(states.rank)
    for (pp_rank, dense, experts, muon), ranks in groups.items():
        states = RankStates(ranks[0], pp_rank, dense, experts, muon)
        predicted = estimates[pp_rank]
        lines.append(f"{_ranks(ranks):<24}{pp_rank:>4}{dense / GIB:>12.3f}{experts / GIB:>12.3f}"
                     f"{states.total / GIB:>14.3f}{predicted.states.total / GIB:>12.3f}{predicted.total / GIB:>12.2f}")
    largest = {pp: max(s.total for s in built if s.pp_rank == pp) for pp in range(len(estimates))}
    exact = all(largest[pp] == e.states.total for pp, e in enumerate(estimates))
    lines.append("model states: each stage's largest rank equals the memory model's prediction" if exact else
                 "model states: the memory model's prediction differs from the largest built rank (a bug: report it)")
    if device_gib is not None:
        worst = max(e.total for e in estimates)
        usable = usable_bytes(device_gib * GIB, headroom)
        where = (f"the {usable / GIB:.1f} GiB usable of {device_gib:g} GiB{' (' + device + ')' if device else ''}, "
                 f"{headroom:.0%} kept free for the CUDA context, NCCL and allocator fragmentation")
        world_size = max(s.rank for s in built) + 1  # the last stage's last rank is always built
        lines.append(f"verdict: the busiest rank's predicted step total, {worst / GIB:.2f} GiB, "
                     + (f"fits in {where}" if worst <= usable else
                        f"does NOT fit in {where}; python -m analysis.planner --config {config.name} --world-size "
                        f"{world_size} lists the layouts that do"))
    return "\n".join(lines)


def _ranks(ranks: list[int]) -> str:
    """'0-7' for a run of consecutive ranks, else a short list."""
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    text = ",".join(map(str, ranks))
    return text if len(text) <= 22 else f"{text[:18]}...({len(ranks)})"
