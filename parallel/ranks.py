"""Pure rank arithmetic: which ranks form each group of a ``Layout``, with no processes.

Both views are row-major over ``arange(world_size)`` (last axis fastest):

    dense  (pp, dp_replicate, dp_shard, cp, tp)   attention, dense FFNs, embeddings
    expert (pp, dp_replicate, edp, ep, etp)       routed experts

pp is outermost and dp_replicate the outer replica axis in both views, so pipeline and HSDP replica groups
are the same ranks in both; tp, ep and etp are innermost, i.e. contiguous ranks within a node, and cp next
to tp, since its ranks exchange keys and values in every attention layer.

Here: ``axis_view``, ``rank_grid``, ``groups_for``, ``coordinates``, ``pipeline_ends``, ``expert_nodes`` and
``describe_layout``; ``parallel/groups.py`` makes the process groups and meshes from them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from parallel.layout import AXES, DENSE, EXPERT, FLATTENED, VIEWS, Layout, view_axes


def axis_view(*axes: str) -> tuple[str, tuple[str, ...]]:
    """Which view holds these axes, and the axes with a flattened name expanded: ("dp",) -> dense, (dp_r, dp_s).

    pp and dp_replicate are in both views with the same groups; they are answered from the dense view.
    """
    if not axes:
        raise ValueError(f"name at least one axis; valid axes: {', '.join((*AXES, *FLATTENED))}")
    for axis in axes:
        if axis not in AXES and axis not in FLATTENED:
            raise ValueError(f"unknown parallel axis '{axis}'; valid axes: {', '.join((*AXES, *FLATTENED))}")
    if len(set(axes)) != len(axes):
        raise ValueError(f"axes {', '.join(axes)} repeat an axis")
    if any(axis in FLATTENED for axis in axes):
        if len(axes) > 1:
            raise ValueError(f"the flattened axis {', '.join(a for a in axes if a in FLATTENED)} must be asked alone")
        return "dense", FLATTENED[axes[0]]
    for view, names in VIEWS.items():
        if all(axis in names for axis in axes):
            if list(axes) != sorted(axes, key=names.index):
                raise ValueError(f"axes {', '.join(axes)} must be given in {view} view order ({', '.join(names)})")
            return view, tuple(axes)
    raise ValueError(f"axes {', '.join(axes)} do not lie in one view: dense is ({', '.join(DENSE)}), "
                     f"expert is ({', '.join(EXPERT)})")


def rank_grid(layout: Layout, view: str) -> torch.Tensor:
    """The view's mesh tensor: ``arange(world_size)`` reshaped to the view's shape, last axis fastest."""
    return torch.arange(layout.world_size, dtype=torch.int).reshape(layout.shape(view))


def groups_for(layout: Layout, view: str, axes: tuple[str, ...]) -> list[list[int]]:
    """All groups along ``axes`` of ``view`` (several axes: flattened, first axis slowest), each rank in one.

    Groups are ordered by the other axes' coordinates, ranks within a group ascending, so a rank's index in
    its group is its coordinate along ``axes``. ``[n_groups, group_size]`` as lists.
    """
    names = view_axes(view)
    if list(axes) != sorted(axes, key=names.index) or not set(axes) <= set(names) or len(set(axes)) != len(axes):
        raise ValueError(f"axes {', '.join(axes)} are not distinct axes of the {view} view in order "
                         f"({', '.join(names)})")
    keep = [names.index(axis) for axis in axes]
    other = [i for i in range(len(names)) if i not in keep]
    grid = rank_grid(layout, view)
    size = math.prod(grid.shape[i] for i in keep)
    return grid.permute(*other, *keep).reshape(-1, size).tolist()


def pipeline_ends(layout: Layout) -> list[list[int]]:
    """Per pipeline, its first and last stage's ranks (pp > 1): where the embedding and the last stage's copy of
    it live under multi-token prediction (``parallel/pipeline.py``). Ordered as ``groups_for`` orders the pp
    groups."""
    if layout.pp == 1:
        raise ValueError("parallel.pp=1 has one stage: it has no pipeline ends to join")
    return [[group[0], group[-1]] for group in groups_for(layout, "dense", ("pp",))]


@dataclass(frozen=True)
class ExpertNodes:
    """How the ep groups sit on nodes, when each spans several nodes with several of its ranks in each: every ep
    group cut into ``nodes`` blocks of ``per_node`` consecutive ep coordinates, one block per node. ``intra``: the
    ep ranks of one node (the in-node hop, NVLink); ``inter``: the ep ranks with one in-node position, one in each
    node (the hop across the network). Both ordered as ``groups_for`` orders groups, ranks ascending."""

    nodes: int
    per_node: int
    intra: tuple[tuple[int, ...], ...]
    inter: tuple[tuple[int, ...], ...]


@functools.lru_cache(maxsize=256)
def expert_nodes(layout: Layout, ranks_per_node: int) -> ExpertNodes | None:
    """The ep groups cut by nodes of ``ranks_per_node`` consecutive ranks (torchrun's numbering), or None where
    there is nothing for a second hop to save: an ep group inside one node, one ep rank per node, or nodes holding
    unequal or interleaved shares of a group (then no in-node position pairs the nodes up). Remembered: the
    planner asks for every candidate layout's."""
    intra: list[tuple[int, ...]] = []
    blocks_per_group, ranks_per_block = set(), set()
    for group in groups_for(layout, *axis_view("ep")):
        node_of = [rank // ranks_per_node for rank in group]
        blocks = [tuple(group[start:end]) for start, end in _runs(node_of)]
        if len(set(node_of)) != len(blocks):  # a node's share cut by another's
            return None
        blocks_per_group.add(len(blocks))
        ranks_per_block.update(len(block) for block in blocks)
        intra += blocks
    if len(blocks_per_group) != 1 or len(ranks_per_block) != 1:
        return None
    (nodes,), (per_node,) = blocks_per_group, ranks_per_block
    if nodes < 2 or per_node < 2:
        return None
    inter = tuple(ranks for start in range(0, len(intra), nodes)
                  for ranks in zip(*intra[start:start + nodes], strict=True))
    return ExpertNodes(nodes, per_node, tuple(intra), inter)


def _runs(values: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of equal neighbours in ``values``."""
    cuts = [i for i in range(1, len(values)) if values[i] != values[i - 1]]
    return list(zip([0, *cuts], [*cuts, len(values)], strict=True))


def coordinates(layout: Layout, rank: int) -> dict[str, int]:
    """A rank's coordinate on every axis of both views, and on the flattened "dp" (its data-parallel rank)."""
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank {rank} is outside the world of {layout.world_size} ranks")
    coords: dict[str, int] = {}
    for view, names in VIEWS.items():
        index = rank
        for axis, size in reversed(list(zip(names, layout.shape(view), strict=True))):  # last axis fastest
            index, coords[axis] = divmod(index, size)
    coords["dp"] = coords["dp_replicate"] * layout.dp_shard + coords["dp_shard"]
    coords["dp_shard_cp"] = coords["dp_shard"] * layout.cp + coords["cp"]
    coords["dp_cp"] = coords["dp_replicate"] * layout.dp_shard_cp + coords["dp_shard_cp"]
    return {axis: coords[axis] for axis in (*AXES, *FLATTENED)}


def _format_group(ranks: list[int]) -> str:
    # Groups along one axis are arithmetic progressions, so the first three and the last say it all.
    shown = ranks if len(ranks) <= 4 else [*ranks[:3], "...", ranks[-1]]
    return "[" + ", ".join(map(str, shown)) + "]"


def describe_layout(layout: Layout, max_groups: int = 4) -> str:
    """Each axis, its size and its groups' ranks (at most ``max_groups`` shown); rank 0 prints it at start-up."""
    lines = [f"parallel layout of {layout.world_size} ranks: {layout.degrees()}"]
    for view, names in VIEWS.items():
        lines.append(f"  {view:<6} view ({', '.join(names)}) = ({', '.join(map(str, layout.shape(view)))})")
    lines.append(f"  {'axis':<13} {'size':>4}  groups")
    # without context parallelism its axis and the flattenings it adds to are the ones without it: not repeated
    for axis in (a for a in (*AXES, *FLATTENED) if layout.cp > 1 or a not in ("cp", "dp_cp", "dp_shard_cp")):
        if layout.degree(axis) == 1:
            groups = "off (one rank each)"
        else:
            found = groups_for(layout, *axis_view(axis))
            shown = found if len(found) <= max_groups else found[: max_groups - 1]
            groups = " ".join(_format_group(g) for g in shown)
            if len(shown) < len(found):
                groups += f" ... (+{len(found) - len(shown)} more)"
        lines.append(f"  {axis:<13} {layout.degree(axis):>4}  {groups}")
    return "\n".join(lines)

