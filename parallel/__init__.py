"""How the model is spread over ranks: applied from outside to an unchanged ``moe`` model.

``parallelize`` is the one entry point. It applies, in a fixed order, the techniques the
layout enables: tensor parallelism (tp; ``parallel/tensor.py``), expert and expert-tensor
parallelism (ep × etp, folded over dp_shard × tp; ``parallel/expert.py``), then FSDP2 over
the expert-data-parallel mesh for the routed experts and over the dense data-parallel mesh
for everything else (HSDP with dp_replicate; ``parallel/sharding.py``), 2-D with the tp
shards. Activation checkpointing (``parallel/activation_checkpoint.py``) goes on before
FSDP. Pipeline parallelism is refused by ``check_supported`` before any process group exists.
"""

from __future__ import annotations

from moe.config import ConfigError
from moe.transformer import MoETransformer
from parallel.activation_checkpoint import apply_activation_checkpointing
from parallel.expert import apply_expert_parallel
from parallel.groups import Layout, ParallelGroups
from parallel.sharding import apply_fsdp, clip_grad_norm_, shard_experts
from parallel.tensor import apply_tensor_parallel

SUPPORTED = ("dp_replicate", "dp_shard", "tp", "ep", "etp")

__all__ = ["check_supported", "clip_grad_norm_", "parallelize"]


def check_supported(layout: Layout) -> None:
    """Refuse, with the reason, the degrees this version cannot run yet."""
    for key in ("pp",):
        if layout.degree(key) > 1:
            raise ConfigError(f"parallel.{key}={layout.degree(key)}: this version supports data, tensor and "
                              f"expert parallelism only ({', '.join('parallel.' + k for k in SUPPORTED)}); "
                              f"set parallel.{key}=1")


def parallelize(model: MoETransformer, groups: ParallelGroups,
                activation_checkpointing: str = "none") -> MoETransformer:
    """Apply the layout's parallelism and activation checkpointing to ``model`` in place and return it.

    Every rank passes the same fully initialised model (same seed): expert parallelism keeps this
    rank's experts and FSDP this rank's shards of them, so the weights do not depend on the layout.
    """
    check_supported(groups.layout)
    layout = groups.layout
    unmanaged: set = set()
    tp_mesh = groups.mesh("tp") if layout.tp > 1 else None
    if tp_mesh is not None:
        apply_tensor_parallel(model, tp_mesh)
    if layout.ep > 1 or layout.etp > 1:
        apply_expert_parallel(model, groups.mesh("ep", "etp") if layout.etp > 1 else groups.mesh("ep"), tp_mesh)
        expert_axes = ("dp_replicate", "edp") if layout.dp_replicate > 1 else ("edp",)
        expert_dp_mesh = groups.mesh(*expert_axes) if layout.dp_replicate * layout.edp > 1 else None
        unmanaged = shard_experts(model, expert_dp_mesh, layout.dp)
    apply_activation_checkpointing(model, activation_checkpointing)  # before FSDP (see its module)
    if layout.dp > 1:
        axes = ("dp_replicate", "dp_shard") if layout.dp_replicate > 1 else ("dp_shard",)
        apply_fsdp(model, groups.mesh(*axes), ignored_params=unmanaged or None)
    return model
