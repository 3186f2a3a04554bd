"""How the model is spread over ranks: applied from outside to an unchanged ``moe`` model.

``parallelize`` is the one entry point. It applies, in a fixed order, the techniques the
layout enables: expert parallelism (ep, folded over dp_shard; ``parallel/expert.py``),
then FSDP2 over the expert-data-parallel mesh for the routed experts and over the dense
data-parallel mesh for everything else (HSDP with dp_replicate; ``parallel/sharding.py``).
Activation checkpointing (``parallel/activation_checkpoint.py``) goes on between the two.
Pipeline parallelism (``parallel/pipeline.py``) cuts the model into stages first and calls
``parallelize`` on each. Tensor and expert-tensor parallelism are refused by ``check_supported``
before any process group exists.
"""

from __future__ import annotations

from moe.config import ConfigError
from moe.transformer import MoETransformer
from parallel.activation_checkpoint import apply_activation_checkpointing
from parallel.expert import apply_expert_parallel
from parallel.groups import Layout, ParallelGroups
from parallel.sharding import apply_fsdp, clip_grad_norm_, shard_experts

SUPPORTED = ("pp", "dp_replicate", "dp_shard", "ep")

__all__ = ["check_supported", "clip_grad_norm_", "parallelize"]


def check_supported(layout: Layout) -> None:
    """Refuse, with the reason, the degrees this version cannot run yet."""
    if layout.etp > 1:
        raise ConfigError(f"parallel.etp={layout.etp}: expert tensor parallelism is not supported yet; experts are "
                          "split across ranks whole (parallel.ep) and parallel.etp must be 1")
    for key in ("tp",):
        if layout.degree(key) > 1:
            raise ConfigError(f"parallel.{key}={layout.degree(key)}: this version supports data, expert and "
                              f"pipeline parallelism only ({', '.join('parallel.' + k for k in SUPPORTED)}); "
                              f"set parallel.{key}=1")


def parallelize(model: MoETransformer, groups: ParallelGroups,
                activation_checkpointing: str = "none") -> MoETransformer:
    """Apply the layout's data, expert and activation-checkpoint settings to ``model`` in place and return it.

    Under pipeline parallelism ``model`` is one stage (``parallel.pipeline.cut_stage``).

    Every rank passes the same fully initialised model (same seed): expert parallelism keeps this
    rank's experts and FSDP this rank's shards of them, so the weights do not depend on the layout.
    """
    check_supported(groups.layout)
    layout = groups.layout
    unmanaged: set = set()
    if layout.ep > 1:
        apply_expert_parallel(model, groups.mesh("ep"))
        expert_axes = ("dp_replicate", "edp") if layout.dp_replicate > 1 else ("edp",)
        expert_dp_mesh = groups.mesh(*expert_axes) if layout.dp_replicate * layout.edp > 1 else None
        unmanaged = shard_experts(model, expert_dp_mesh, layout.dp)
    apply_activation_checkpointing(model, activation_checkpointing)  # before FSDP (see its module)
    if layout.dp > 1:
        axes = ("dp_replicate", "dp_shard") if layout.dp_replicate > 1 else ("dp_shard",)
        apply_fsdp(model, groups.mesh(*axes), ignored_params=unmanaged or None)
    return model
