"""The measured side of ``analysis/traffic.py``: every collective a rank really runs, in its terms.

``CollectiveCounter`` is active around a training step on each rank of a real (gloo) run; its
``totals`` are compared with ``analysis.traffic.predict``'s in ``tests/analysis/test_communication.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from analysis.traffic_items import Traffic, bus_bytes, totals


@dataclass(frozen=True)
class CountedCollective:
    """One collective this rank ran, in ``Traffic``'s terms."""

    collective: str
    group: tuple[int, ...]  # for a send: (this rank, the receiver)
    bus_bytes: int
    section: str  # which part of the step (``CollectiveCounter.section``)


def _ranks(group) -> tuple[int, ...]:
    """Ranks of a process group as an op receives it: a group name (functional ops) or a boxed ProcessGroup."""
    if isinstance(group, str):
        group = torch._C._distributed_c10d._resolve_process_group(group)
    elif isinstance(group, torch.ScriptObject):
        group = torch._C._distributed_c10d.ProcessGroup.unbox(group)
    return tuple(dist.get_process_group_ranks(group))


def _nbytes(tensors) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


# op name -> (collective, index of the group argument, the full buffer's bytes from the arguments)
_OPS = {
    "_c10d_functional.all_reduce": ("all_reduce", 2, lambda a: _nbytes(a[0])),
    "_c10d_functional.all_gather_into_tensor": ("all_gather", 2, lambda a: _nbytes(a[0]) * a[1]),
    "_c10d_functional.reduce_scatter_tensor": ("reduce_scatter", 3, lambda a: _nbytes(a[0])),
    "_c10d_functional.broadcast": ("broadcast", 2, lambda a: _nbytes(a[0])),
    "c10d.allreduce_": ("all_reduce", 1, lambda a: _nbytes(a[0])),
    "c10d._allgather_base_": ("all_gather", 2, lambda a: _nbytes(a[0])),
    "c10d.allgather_": ("all_gather", 2, lambda a: _nbytes(a[0])),
    "c10d._reduce_scatter_base_": ("reduce_scatter", 2, lambda a: _nbytes(a[1])),
    "c10d.broadcast_": ("broadcast", 1, lambda a: _nbytes(a[0])),
}
_IGNORED = {"_c10d_functional.wait_tensor", "_c10d_functional._wrap_tensor_autograd", "c10d.recv_",
            "c10d.barrier", "c10d.monitored_barrier_"}


class CollectiveCounter(TorchDispatchMode):
    """Records, on this rank, every collective and send that runs while it is active, as bus bytes.

    All of the toolkit's traffic meets one door: ``torch.distributed``'s functions (FSDP2's
    all-gather and reduce-scatter, ``gather_rows``, the expert counts, pipelining's sends) call the
    ProcessGroup, which dispatches the ``c10d.*`` ops; DTensor and the expert all-to-all use the
    functional ``_c10d_functional.*`` ops. A dispatch mode sees both (``CommDebugMode`` does the same);
    it lets DTensor run first so that it sees the plain collectives DTensor turns into. An op it does not
    know raises, so nothing is silently missed. A collective over a group of one moves nothing and is
    not recorded.
    """

    def __init__(self):
        super().__init__()
        self.records: list[CountedCollective] = []
        self.current = "step"
        self.all_to_all_sent: dict[int, int] = {}  # bytes of uneven all-to-alls by the global rank they went to

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Label what runs inside with ``name`` (e.g. the gradient norm, to tell it from forward and backward)."""
        previous, self.current = self.current, name
        try:
            yield
        finally:
            self.current = previous

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor first: it turns the op into plain ops and collectives
        out = func(*args, **(kwargs or {}))
        if func.namespace in ("c10d", "_c10d_functional", "_c10d_functional_autograd"):
            self._record(f"{func.namespace}.{func.__name__.split('.')[0]}", args)
        return out

    def _record(self, name: str, args) -> None:
        if name in _IGNORED:
            return
        if name == "c10d.send":
            ranks = _ranks(args[1])
            record = ("send", (dist.get_rank(), ranks[args[2]]), _nbytes(args[0]))
        elif name in ("_c10d_functional.all_to_all_single", "c10d.alltoall_base_"):
            tensor, splits, ranks = (args[0], args[2], _ranks(args[3])) if name.startswith("_") else \
                (args[1], args[4], _ranks(args[2]))
            me = ranks.index(dist.get_rank())
            if splits:  # uneven: the rows that leave for other ranks
                record = ("all_to_all", ranks, (sum(splits) - splits[me]) * _nbytes(tensor) // max(sum(splits), 1))
                self._record_destinations(ranks, splits, _nbytes(tensor) // max(sum(splits), 1))
            else:
                record = ("all_to_all", ranks, bus_bytes("all_to_all", _nbytes(tensor), len(ranks)))
        elif name in _OPS:
            collective, where, size = _OPS[name]
            ranks = _ranks(args[where])
            record = (collective, ranks, bus_bytes(collective, size(args), len(ranks)))
        else:
            raise NotImplementedError(f"CollectiveCounter does not know the collective {name}; add it to _OPS")
        if len(record[1]) > 1:
            self.records.append(CountedCollective(*record, self.current))

    def _record_destinations(self, ranks: tuple[int, ...], splits: list[int], row_bytes: int) -> None:
        for rank, rows in zip(ranks, splits, strict=True):
            if rank != dist.get_rank():
                self.all_to_all_sent[rank] = self.all_to_all_sent.get(rank, 0) + rows * row_bytes

    def all_to_all_bytes_across_nodes(self, ranks_per_node: int) -> int:
        """Bytes the uneven all-to-alls (the experts' exchanges) sent to ranks of other nodes (``ranks_per_node``
        consecutive ranks each): what would cross the network, where their groups' bus bytes count every peer."""
        node = dist.get_rank() // ranks_per_node
        return sum(sent for rank, sent in self.all_to_all_sent.items() if rank // ranks_per_node != node)

    def totals(self, section: str = "step") -> dict[tuple[str, tuple[int, ...]], tuple[int, int]]:
        """(calls, bus bytes) by (collective, group) over one section, as ``totals`` sums a prediction."""
        return totals(Traffic("", r.collective, r.section, 1, r.bus_bytes, r.group)
                      for r in self.records if r.section == section)


