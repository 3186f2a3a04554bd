"""How the model is spread over ranks: applied from outside to an unchanged ``moe`` model.

``parallelize`` is the one entry point for a model or, under pipeline parallelism, for one stage
of it (``parallel/pipeline.py`` cuts the stages first and calls ``parallelize`` on each). It
applies, in a fixed order, the techniques the layout enables: context parallelism (cp: this rank's positions of
each sequence, keys and values gathered in attention; ``parallel/context.py``), tensor parallelism (tp, with its
sequence- and vocabulary-parallel options; ``parallel/tensor.py``), expert and expert-tensor
parallelism (ep × etp, folded over dp_shard × tp; ``parallel/expert.py``; with tp alone too, so
that each tp rank computes a share of the routed rows; across nodes in two hops, ``parallel/node_dispatch.py``),
activation checkpointing (``parallel/activation_checkpoint.py``) or offloading (``parallel/activation_offload.py``),
``torch.compile`` of each block when asked (``parallel/compile.py``), then FSDP2 over the
expert-data-parallel mesh for the routed experts and over the dense data-parallel mesh (dp_shard × cp) for
everything else (HSDP with dp_replicate; ``parallel/sharding.py``), 2-D with the tp shards.
"""

from __future__ import annotations

import torch

from config.parallel import ParallelConfig
from moe.transformer import MoETransformer
from parallel.activation_checkpoint import apply_activation_checkpointing
from parallel.activation_offload import apply_activation_offload
from parallel.compile import apply_compile
from parallel.context import apply_context_parallel
from parallel.expert import apply_expert_parallel, exchanges_by_node
from parallel.groups import ParallelGroups
from parallel.node_dispatch import node_size
from parallel.sharding import (
    apply_fsdp,
    clip_grad_norm_,
    experts_replicated,
    experts_spread,
    set_gradient_sync,
    shard_experts,
    sum_partial_gradients,
)
from parallel.tensor import apply_tensor_parallel

__all__ = ["clip_grad_norm_", "parallelize", "set_gradient_sync", "sum_partial_gradients"]


def parallelize(model: MoETransformer, groups: ParallelGroups, parallel: ParallelConfig | None = None,
                param_dtype: torch.dtype | None = None, compile_blocks: bool = False) -> MoETransformer:
    """Apply the layout's parallelism and ``parallel``'s options (default: none) to ``model`` in place; return it.

    ``model`` is built on the meta device (``parallel.build.build_model``; ``parallel.materialize`` then
    allocates this rank's shards) or, the same on every rank, already initialised: tensor and expert
    parallelism keep this rank's slices and FSDP this rank's shards of them, so the weights do not depend
    on the layout. The options used here: ``activation_checkpointing``, ``activation_offload``;
    ``reshard_after_forward=False`` keeps each block's gathered weights from forward to backward (one
    all-gather fewer per block and step, for the memory of the unsharded blocks); ``sequence_parallel`` and
    ``vocab_parallel``, tensor parallelism's options (``parallel/tensor.py``). ``param_dtype`` (bf16) makes
    every FSDP unit gather and compute its weights in it, over fp32 master weights and with fp32 gradient
    reduction (``parallel.sharding.mixed_precision``); parameters outside FSDP stay fp32 for autocast to cast.
    ``compile_blocks`` (``train.compile``) compiles each block (``parallel/compile.py``).
    """
    parallel = parallel or ParallelConfig()
    layout = groups.layout
    unmanaged: set = set()
    if layout.cp > 1:
        apply_context_parallel(model, groups.group("cp"), groups.coords()["cp"], layout.cp)
    tp_mesh = groups.mesh("tp") if layout.tp > 1 else None
    if tp_mesh is not None:
        apply_tensor_parallel(model, tp_mesh, parallel.sequence_parallel, parallel.vocab_parallel)
    if experts_spread(layout, bool(model.moe_layers())):
        top_k = next(iter(model.moe_layers().values())).config.top_k
        ranks_per_node = node_size(parallel.ranks_per_node)
        replicas = parallel.ep_replicas if layout.ep > 1 else 0
        node_groups = groups.expert_node_groups(ranks_per_node) \
            if exchanges_by_node(layout, top_k, ranks_per_node, replicas) else None
        apply_expert_parallel(model, groups.mesh("ep", "etp") if layout.etp > 1 else groups.mesh("ep"), tp_mesh,
                              node_groups, replicas)
        expert_axes = ("dp_replicate", "edp") if layout.dp_replicate > 1 else ("edp",)
        expert_dp_mesh = groups.mesh(*expert_axes) if experts_replicated(layout) else None
        unmanaged = shard_experts(model, expert_dp_mesh, layout.dp_cp, parallel.reshard_after_forward, param_dtype)
    apply_activation_checkpointing(model, parallel.activation_checkpointing)  # before FSDP (see its module)
    apply_activation_offload(model, parallel.activation_offload)
    if compile_blocks:
        apply_compile(model)
    if layout.dp_cp > 1:
        apply_fsdp(model, groups.data_parallel_mesh(), parallel.reshard_after_forward, ignored_params=unmanaged or None,
                   param_dtype=param_dtype)
    return model
