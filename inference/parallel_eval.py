"""``moe-evaluate`` under a parallel layout: a model too large for one device is evaluated as it was trained.

    torchrun --nproc-per-node 8 -m inference.evaluate runs/big --source val.bin --set parallel.ep=4

Each rank builds only its part of the model (``parallel.build.build_model``: the meta model parallelized, then
this rank's shards allocated) and reads only its box of every tensor from the checkpoint, the export or the
Hugging Face folder (``inference.load.weights_of``). The windows are those of one process; each batch's windows
are dealt out over the data-parallel ranks and the summed losses and counts added up over them, so the figure is
the single process's, whatever the layout (``tests/inference/test_evaluate.py`` holds it to that).

Under context parallelism each cp rank takes its positions of every window (``moe/sequence_shards.py``), a
shorter last window padded to whole chunks with its padding's targets ignored. Not yet: pipeline stages (their
schedule needs equal micro-batches; the last window may be shorter) and sequence parallelism (a window's length
must then divide over tp), refused by name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from config.errors import ConfigError
from config.run import RunConfig, config_from_dict
from config.schema import apply_override
from parallel.build import build_model
from parallel.groups import ParallelGroups
from parallel.resolve import ResolvedLayout, resolve_layout
from parallel.runtime import init_runtime, shutdown_runtime


def layout_config(config: RunConfig, overrides: list[str], world_size: int) -> tuple[RunConfig, ResolvedLayout]:
    """The model's config (already made for inference) with ``overrides`` (``parallel.*`` keys only: the model
    is the checkpoint's) on ``world_size`` ranks, checked as ``train.py`` checks a layout; a ConfigError before
    any process group exists otherwise."""
    tree = config.to_dict()
    for assignment in overrides:
        if not assignment.split("=", 1)[0].strip().startswith("parallel."):
            raise ConfigError(f"--set {assignment}: moe-evaluate takes parallel.* keys only (the layout to "
                              "evaluate under); the model and its settings are the checkpoint's")
        apply_override(tree, assignment)
    # the training batch's split is checked by resolve_layout; evaluation batches by --batch-size instead
    tree["train"].update(global_batch_size=world_size, micro_batch_size=None)
    tree["parallel"]["microbatches"] = None
    config = config_from_dict(tree)
    resolved = resolve_layout(config, world_size)
    layout, par = resolved.layout, config.parallel
    if layout.pp > 1:
        raise ConfigError(f"moe-evaluate under pipeline parallelism (parallel.pp={layout.pp}) is not supported "
                          "yet: evaluate under a layout without pp (e.g. more parallel.ep or parallel.tp)")
    if par.sequence_parallel:
        raise ConfigError("moe-evaluate under parallel.sequence_parallel=true (the sequence cut over tp) is not "
                          "supported yet: the last window may be shorter than a whole cut; set it false")
    return config, resolved


def evaluate_under_layout(config: RunConfig, resolved: ResolvedLayout, fill: Callable[[torch.nn.Module], None],
                          evaluate: Callable[..., object]) -> object | None:
    """Join the job, build this rank's part of the model, fill it, and run ``evaluate(model, dp_rank, dp_size,
    dp_group, vocab_parallel)``; its result on rank 0, None on the others."""
    joined_here = not (dist.is_available() and dist.is_initialized())  # a caller already in a job keeps it
    runtime = init_runtime()
    try:
        groups = ParallelGroups.build(resolved.layout, runtime.device.type)
        model = build_model(config, groups, runtime.device, resolved.micro_batch_size, 1, contextlib.nullcontext)
        fill(model)
        model.eval()
        layout = resolved.layout
        # the windows are dealt over dp; their sums are added over dp × cp (a cp rank holds part of each window)
        sum_group = groups.group("dp_cp") if layout.dp_cp > 1 else None
        result = evaluate(model, groups.coords()["dp"], layout.dp, sum_group, config.parallel.vocab_parallel)
        return result if runtime.is_main else None
    finally:
        if joined_here:
            shutdown_runtime()


def dealt_rows(rows: list[tuple[int, int]], dp_rank: int, dp_size: int) -> tuple[list[tuple[int, int]], bool]:
    """This data-parallel rank's share of a batch's windows, and whether they count. Every rank runs a forward
    for every batch (FSDP's and expert parallelism's collectives need them all): a rank dealt none runs the
    batch's first window and counts nothing."""
    mine = rows[dp_rank::dp_size]
    return (mine, True) if mine else (rows[:1], False)


def batch_tensor(tokens: np.ndarray, rows: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    return torch.as_tensor(np.stack([tokens[s:e] for s, e in rows]).astype(np.int64), device=device)
