"""One kind of collective traffic of one rank (``Traffic``), its bus bytes, and the rank's step that the per-dimension
counts of ``analysis.traffic`` read (``_Step``): what the prediction and ``analysis.collective_count``'s counting of a
real run share.

Byte convention (both sides): **bus bytes**, the data one rank puts on its link under the bandwidth-optimal
(ring) algorithms, as nccl-tests defines bus bandwidth (NVIDIA nccl-tests, doc/PERFORMANCE.md): for a group
of n ranks and a buffer of S bytes (the full, unsharded buffer) all-reduce moves 2(n−1)/n·S, all-gather and
reduce-scatter (n−1)/n·S, broadcast S; an all-to-all moves exactly the rows that leave the rank for other
ranks; a point-to-point send its tensor. Time on a link is then bus bytes / the bandwidth NCCL gets of it
(``analysis.link_time.bandwidth``: NVLink inside a node, the rank's network adapter across nodes).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

from config.run import RunConfig
from parallel.layout import Layout
from parallel.ranks import axis_view, groups_for
from parallel.ranks import coordinates as _coordinates


@dataclass(frozen=True)
class Traffic:
    """One kind of collective traffic of one rank in one optimizer step."""

    dimension: str  # tp, ep, fsdp, pp
    collective: str  # all_reduce, all_gather, reduce_scatter, all_to_all, send, broadcast
    what: str  # where in the step, e.g. "attention wo output (forward)"
    calls: int  # per optimizer step
    bus_bytes: int  # per optimizer step, all calls (module docstring: the convention)
    group: tuple[int, ...]  # ranks of the group; for a send (this rank, the receiver)

    def link(self, gpus_per_node: int) -> str:
        """``intra`` when every rank of the group sits in one node (NVLink), else ``inter`` (the network)."""
        return "intra" if nodes_spanned(self.group, gpus_per_node) == 1 else "inter"


@functools.lru_cache(maxsize=65536)
def nodes_spanned(group: tuple[int, ...], gpus_per_node: int) -> int:
    """How many nodes of ``gpus_per_node`` ranks the group's ranks sit in (remembered: groups recur)."""
    return len({r // gpus_per_node for r in group})


def bus_bytes(collective: str, buffer_bytes: int, group_size: int) -> int:
    """Bus bytes of one collective on a ``buffer_bytes`` buffer (the full one) over ``group_size`` ranks."""
    n = group_size
    factor = {"all_reduce": (2 * (n - 1), n), "all_gather": (n - 1, n), "reduce_scatter": (n - 1, n),
              "all_to_all": (n - 1, n), "broadcast": (1, 1), "send": (1, 1)}[collective]
    return buffer_bytes * factor[0] // factor[1]


def totals(items: Iterable[Traffic]) -> dict[tuple[str, tuple[int, ...]], tuple[int, int]]:
    """(calls, bus bytes) summed by (collective, group): what a counted run can be compared on."""
    out: dict[tuple[str, tuple[int, ...]], tuple[int, int]] = {}
    for item in items:
        calls, sent = out.get((item.collective, item.group), (0, 0))
        out[item.collective, item.group] = (calls + item.calls, sent + item.bus_bytes)
    return out


@dataclass(frozen=True)
class _Step:
    """What one rank runs in one step: its layout coordinates, micro-batches, stages and element sizes."""

    config: RunConfig
    layout: Layout
    rank: int
    micro: int  # sequences per micro-batch
    microbatches: int
    layers: tuple[int, ...]  # the blocks this rank holds (all of its pipeline stages)
    first: bool  # holds the embedding
    last: bool  # holds the final norm, the head and the loss
    act: int  # bytes of an activation in compute precision (bf16 projections' outputs, routed rows)
    mtp: tuple[int, ...] = ()  # the multi-token-prediction modules it runs, as layers n_layers + k (the last stage)
    ranks_per_node: int | None = None  # where the experts' exchange crosses nodes (None: the world is one node)

    def group(self, *axes: str) -> tuple[int, ...]:
        return _group_of(self.layout, self.rank, axes)

    @property
    def tokens(self) -> int:
        """This rank's tokens of one micro-batch: its S/cp positions of each sequence."""
        return self.micro * self.config.model.seq_len // self.layout.cp


@functools.lru_cache(maxsize=65536)
def coordinates(layout: Layout, rank: int) -> dict[str, int]:
    """``parallel.groups.coordinates``, remembered (read, never changed, here)."""
    return _coordinates(layout, rank)


@functools.lru_cache(maxsize=65536)
def _group_of(layout: Layout, rank: int, axes: tuple[str, ...]) -> tuple[int, ...]:
    """The ranks of ``rank``'s group along ``axes`` (remembered: the planner asks for the same groups often)."""
    return tuple(next(g for g in groups_for(layout, *axis_view(*axes)) if rank in g))


def _add(out: list[Traffic], dimension: str, collective: str, what: str, calls: int, buffer: int,
         group: tuple[int, ...]) -> None:
    if calls and len(group) > 1:
        out.append(Traffic(dimension, collective, what, calls, calls * bus_bytes(collective, buffer, len(group)),
                           group))


def _gradient_syncs(step: _Step) -> int:
    """Gradient reductions (reduce-scatters) of one FSDP unit per step: one under ``parallel.grad_reduce=step``
    (on the last micro-batch), one per micro-batch under ``microbatch``; with or without pipelining."""
    return 1 if step.config.parallel.grad_reduce == "step" else step.microbatches
