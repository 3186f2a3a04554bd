"""How a run's batch and model split over a world size: every check ``train.py`` makes before any process exists.

One door for the run, the dry run, the memory check, the planner and the benchmarks: each asks the same
questions of a config here, and ``train.py`` resolves once per start and passes the ``ResolvedLayout`` on whole.
"""

from __future__ import annotations

from typing import NamedTuple

from config.errors import ConfigError
from config.run import RunConfig
from parallel.context import check_context_parallel
from parallel.layout import Layout, validate_for_model
from parallel.node_dispatch import check_ranks_per_node
from parallel.pipeline import check_pipeline
from parallel.tensor import check_tensor_parallel


class ResolvedLayout(NamedTuple):
    """A config's layout on a world size and how each rank cuts its share of the global batch."""

    layout: Layout
    micro_batch_size: int  # sequences per forward pass on one rank
    microbatches: int  # micro-batches per optimizer step on one pipeline (gradient accumulation)


def micro_batching(config: RunConfig, dp_size: int, pp: int = 1) -> tuple[int, int]:
    """(micro-batch size, micro-batches per step) on one rank for the global batch.

    The global batch is fixed by config; the layout only changes how it is cut: per-rank batch =
    global / data-parallel ranks, then ``parallel.microbatches`` pieces or pieces of
    ``train.micro_batch_size`` sequences (either, or both if they agree; neither = one piece, or
    ``pp`` pieces under pipeline parallelism so that every stage has a micro-batch to work on).
    ``train.py`` calls this before any process group exists, so a bad split fails early.
    """
    global_batch = config.train.global_batch_size
    if global_batch % dp_size:
        raise ConfigError(f"train.global_batch_size={global_batch} must be divisible by the {dp_size} "
                          "data-parallel ranks")
    per_rank = global_batch // dp_size
    count, micro = config.parallel.microbatches, config.train.micro_batch_size
    if count is not None:
        if per_rank % count:
            raise ConfigError(f"parallel.microbatches={count} must divide the per-rank batch {per_rank} "
                              f"(train.global_batch_size={global_batch} / {dp_size} data-parallel ranks)")
        if micro is not None and micro * count != per_rank:
            raise ConfigError(f"train.micro_batch_size={micro} and parallel.microbatches={count} disagree: "
                              f"the per-rank batch is {per_rank}; set only one of them")
        return per_rank // count, count
    if micro is None and pp > 1 and per_rank % pp == 0:
        micro = per_rank // pp
    micro = micro or per_rank
    if per_rank % micro:
        raise ConfigError(f"train.micro_batch_size={micro} must divide the per-rank batch {per_rank} "
                          f"(train.global_batch_size={global_batch} / {dp_size} data-parallel ranks)")
    return micro, per_rank // micro


def resolve_layout(config: RunConfig, world_size: int) -> ResolvedLayout:
    """The layout of ``config`` on ``world_size`` ranks and its (micro-batch size, micro-batches per step).

    Every check ``train.py`` makes before any process group exists, in one place (the analysis CLIs and the
    planner refuse a layout with the same ConfigError): the degrees against the world size and the model's
    shapes, the node size, the batch split, the pipeline schedule's rules, and tensor parallelism's options.
    """
    def rest(layout: Layout) -> tuple[int, int]:
        micro, microbatches = micro_batching(config, layout.dp, layout.pp)
        check_pipeline(layout.pp, config.model, config.parallel.pp_schedule, config.parallel.pp_virtual_stages,
                       microbatches)
        check_tensor_parallel(layout.tp, config.model, config.parallel.sequence_parallel,
                              config.parallel.vocab_parallel)
        check_context_parallel(config, layout.cp)
        return micro, microbatches

    def refusal(layout: Layout) -> str | None:  # a layout a refusal suggests must pass every check here
        try:
            rest(layout)
        except ConfigError as exc:
            return str(exc)
        return None

    check_ranks_per_node(config.parallel.ranks_per_node, world_size)
    layout = Layout.resolve(world_size, **config.parallel.degrees(), model=config.model, moe=config.moe,
                            accept=refusal)
    validate_for_model(layout, config.model, config.moe, accept=refusal)
    return ResolvedLayout(layout, *rest(layout))
