"""Sharded data parallelism with FSDP2 (``fully_shard``) over the data-parallel ranks.

Each transformer block is its own FSDP unit (its parameters are all-gathered just
before it runs and freed after), and the root wraps what is left: embedding, final
norm and head. With ``dp_replicate > 1`` the mesh is 2-D and FSDP2 runs HSDP:
shards within a replica group, gradients all-reduced across replicas.

Parameters stay fp32 (the master weights); bf16 compute comes from autocast in the
training loop, which keeps the router in fp32 as ``moe/router.py`` requires.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from moe.transformer import MoETransformer


def apply_fsdp(model: MoETransformer, mesh: DeviceMesh, reshard_after_forward: bool = True) -> None:
    """Shard ``model`` in place over ``mesh`` (1-D: FSDP; 2-D (replicate, shard): HSDP).

    Gradients are averaged over the mesh, which with every rank's loss a mean over its
    own equal share of the global batch gives the gradient of the global mean loss.
    """
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    # the root's parameters (embedding, norm, head) are needed again right after forward: keep them
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
