"""The group manager: the only code that turns ranks into device meshes and process groups.

``ParallelGroups.build`` makes every group of both views of a ``Layout`` (``parallel/layout.py``) and the two view
meshes from them, with the ranks ``parallel/ranks.py`` computes, so the groups, the meshes and the pure arithmetic
cannot disagree. Built once in ``train.py`` and passed explicitly; there is no module state.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from parallel.layout import AXES, DENSE, FLATTENED, VIEWS, Layout
from parallel.ranks import axis_view, coordinates, describe_layout, expert_nodes, groups_for, pipeline_ends, rank_grid


def _new_groups(partition: list[list[int]], rank: int, desc: str) -> dist.ProcessGroup:
    """One process group per part of ``partition`` (same call order on every rank); returns this rank's."""
    if len(partition) == 1:  # the whole world: the default group already is this group
        return dist.group.WORLD
    bound = getattr(dist.group.WORLD, "bound_device_id", None)
    if bound is not None and bound.type != "cpu":
        # An eagerly initialised NCCL world splits all groups of an axis in one collective call, as
        # DeviceMesh itself does; new_group per group would be one ncclCommSplit per group.
        return dist.split_group(split_ranks=partition, group_desc=f"groups_{desc}")
    mine = None
    for ranks in partition:
        group = dist.new_group(ranks, group_desc=f"groups_{desc}")
        if rank in ranks:
            mine = group
    return mine


class ParallelGroups:
    """This rank's meshes and process groups for both views; build once with ``ParallelGroups.build``.

    A single process without ``torch.distributed`` (``python train.py``) gets no process group at all:
    ``distributed`` is False, ``maybe_mesh`` answers None (every degree is 1), ``mesh`` and ``group``
    raise, and coordinates and stage queries answer as rank 0 of one.
    """

    def __init__(self, layout: Layout, rank: int, device_type: str, groups: dict[str, dist.ProcessGroup],
                 meshes: dict[tuple[str, ...], DeviceMesh]):
        self.layout, self.rank, self.device_type = layout, rank, device_type
        self._groups, self._meshes = groups, meshes
        self._node_groups: dict[int, tuple[dist.ProcessGroup, dist.ProcessGroup] | None] = {}

    @classmethod
    def build(cls, layout: Layout, device_type: str | torch.device = "cpu") -> ParallelGroups:
        """Create every group of every axis, then the two view meshes from them (collective: all ranks call).

        Groups are made once per distinct partition of the ranks: all degree-1 axes share one singleton
        group per rank, axes with the same ranks (pp and dp_replicate in both views, tp and ep when they
        coincide) share one group, and an axis spanning the world is the default group. NCCL creates a
        communicator only when a collective first runs on it (unless the world was bound to a device, where
        ``split_group`` makes them), so unused singleton groups cost no communicator, and a collective on a
        degree-1 group is correct (an identity), unlike torchtitan's "fake" backend for disabled axes.
        The meshes come from ``DeviceMesh.from_group`` with the mesh tensor ``rank_grid`` gives, so the
        meshes, the groups and the pure arithmetic cannot disagree; ``build`` also checks each group's ranks.
        """
        device_type = device_type.type if isinstance(device_type, torch.device) else device_type
        if not (dist.is_available() and dist.is_initialized()):
            if layout.world_size != 1:
                raise RuntimeError(f"a layout of {layout.world_size} ranks needs torch.distributed initialised "
                                   "(start with torchrun; parallel.runtime.init_runtime joins the job)")
            return cls(layout, 0, device_type, {}, {})
        if dist.get_world_size() != layout.world_size:
            raise ValueError(f"the layout is for {layout.world_size} ranks but the job has {dist.get_world_size()}")
        rank = dist.get_rank()
        groups: dict[str, dist.ProcessGroup] = {}
        made: dict[tuple, dist.ProcessGroup] = {}
        for axis in (*AXES, *FLATTENED):  # the same order on every rank: group creation is collective
            partition = groups_for(layout, *axis_view(axis))
            key = tuple(map(tuple, partition))
            if key not in made:
                made[key] = _new_groups(partition, rank, axis)
            groups[axis] = made[key]
            mine = next(g for g in partition if rank in g)
            if dist.get_process_group_ranks(groups[axis]) != mine:
                raise AssertionError(f"rank {rank}: the {axis} group holds ranks "
                                     f"{dist.get_process_group_ranks(groups[axis])}, the layout says {mine}")
        meshes = {names: DeviceMesh.from_group([groups[a] for a in names], device_type,
                                               mesh=rank_grid(layout, view), mesh_dim_names=names)
                  for view, names in VIEWS.items()}
        for flat, names in FLATTENED.items():
            mine = next(g for g in groups_for(layout, "dense", names) if rank in g)
            meshes[(flat,)] = DeviceMesh.from_group(groups[flat], device_type, mesh=mine, mesh_dim_names=(flat,))
        if layout.cp > 1:
            # FSDP shards over dp_shard × cp beside tp's DTensors, which needs one root mesh for both: the dense
            # mesh's own flattening (a collective; it makes its group as DeviceMesh does)
            meshes[("dp_shard_cp",)] = meshes[DENSE]["dp_shard", "cp"]._flatten("dp_shard_cp")
        return cls(layout, rank, device_type, groups, meshes)

    @property
    def distributed(self) -> bool:
        """True when this object holds process groups (False only for a single process without them)."""
        return bool(self._groups)

    def _require_distributed(self, what: str) -> None:
        if not self.distributed:
            raise RuntimeError(f"{what}: a single process without torch.distributed has no meshes or groups; "
                               "use maybe_mesh(), which answers None here")

    def mesh(self, *axes: str) -> DeviceMesh:
        """The mesh over ``axes`` of one view, e.g. mesh("dp_replicate", "dp_shard") for HSDP, mesh("ep").

        Several axes give the N-D sub-mesh (public DeviceMesh slicing, in view order); a flattened name
        ("dp") gives its 1-D mesh. Raises on an unknown axis, naming the valid ones.
        """
        view, names = axis_view(*axes)
        self._require_distributed(f"mesh({', '.join(map(repr, axes))})")
        key = tuple(axes) if axes[0] in FLATTENED else names
        if key not in self._meshes:
            self._meshes[key] = self._meshes[VIEWS[view]][names]
        return self._meshes[key]

    def data_parallel_mesh(self) -> DeviceMesh:
        """FSDP's mesh for the dense weights: (dp_replicate, dp_shard × cp), without dp_replicate when it is 1 (then
        plain FSDP rather than HSDP), dp_shard alone when cp is 1. A sub-mesh of the dense view, as FSDP needs
        when it shards tensor-parallel DTensors too."""
        self._require_distributed("data_parallel_mesh()")
        shard = "dp_shard_cp" if self.layout.cp > 1 else "dp_shard"  # flattened on the dense mesh by ``build``
        axes = ("dp_replicate", shard) if self.layout.dp_replicate > 1 else (shard,)
        return self._meshes[DENSE][axes]

    def maybe_mesh(self, *axes: str) -> DeviceMesh | None:
        """Like ``mesh``, but None when every one of ``axes`` has degree 1 (the parallelism is off)."""
        if all(self.layout.degree(axis) == 1 for axis in axis_view(*axes)[1]):
            return None
        return self.mesh(*axes)

    def group(self, axis: str) -> dist.ProcessGroup:
        """This rank's process group along one axis or flattened axis, for hand-written collectives."""
        axis_view(axis)
        self._require_distributed(f"group({axis!r})")
        return self._groups[axis]

    def background_group(self) -> dist.ProcessGroup | None:
        """A new gloo group over all ranks for collectives run off the training thread (asynchronous checkpoint
        writes): sharing a group with training's collectives would interleave the two streams. Collective:
        every rank calls it, in the same order. None in a single process without torch.distributed."""
        if not self.distributed:
            return None
        return dist.new_group(backend="gloo", group_desc="background")

    def pipeline_ends_group(self) -> dist.ProcessGroup | None:
        """This rank's group of its pipeline's first and last stage (``pipeline_ends``); None on a stage between.

        Made on the first call, not by ``build``: only multi-token prediction under pipeline parallelism needs it.
        Collective the first time: every rank calls it, in the same order as its other group creations. With
        pp = 2 it is the pp group itself."""
        if "pipeline_ends" not in self._groups:
            self._require_distributed("pipeline_ends_group()")
            ends = pipeline_ends(self.layout)
            mine = self.group("pp") if self.layout.pp == 2 else None
            if mine is None:  # every rank creates every group (collective), and keeps its own
                for ranks in ends:
                    group = dist.new_group(ranks, group_desc="groups_pipeline_ends")
                    mine = group if self.rank in ranks else mine
            self._groups["pipeline_ends"] = mine
        return self._groups["pipeline_ends"]

    def expert_node_groups(self, ranks_per_node: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup] | None:
        """This rank's (in-node, across-node) ep groups for the two-hop exchange (``expert_nodes``), or None where
        the layout has no second hop on nodes of ``ranks_per_node``.

        Made on the first call for a node size, not by ``build``: only that exchange needs them. Collective the
        first time: every rank calls it, in the same order as its other group creations."""
        if ranks_per_node not in self._node_groups:
            self._require_distributed("expert_node_groups()")
            nodes = expert_nodes(self.layout, ranks_per_node)
            self._node_groups[ranks_per_node] = None if nodes is None else (
                _new_groups(list(map(list, nodes.intra)), self.rank, "ep_intra_node"),
                _new_groups(list(map(list, nodes.inter)), self.rank, "ep_inter_node"))
        return self._node_groups[ranks_per_node]

    def coords(self) -> dict[str, int]:
        """This rank's coordinate on every axis of both views (pp and dp_replicate coincide) and on "dp"."""
        return coordinates(self.layout, self.rank)

    @property
    def is_first_stage(self) -> bool:
        return self.coords()["pp"] == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords()["pp"] == self.layout.pp - 1

    def describe(self) -> str:
        return describe_layout(self.layout)

    def __repr__(self) -> str:
        return f"ParallelGroups(rank={self.rank}, {self.layout.degrees()}, world_size={self.layout.world_size})"
