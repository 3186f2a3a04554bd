"""Hot experts replicated across expert-parallel ranks: the plan, pure arithmetic on token counts.

Under expert parallelism an ep rank computes every row routed to its E / ep experts, so the rank holding the
hottest experts sets the step time while the others wait. With ``parallel.ep_replicas: R`` every rank has R
replica slots besides its own experts: after routing, the ranks share their per-expert counts, and each computes the
same plan from them (``plan_replicas``: integers in, integers out, no randomness, no measurement), which says
which hot experts are copied into which under-loaded ranks' slots and how many of each hot expert's rows each
copy computes, so that every rank computes close to the mean load. ``parallel/expert.py`` runs it.

The plan, greedy: while the most loaded rank is above the target (the mean, rounded up), move rows of its
hottest expert still computed at home to the least loaded rank with a free slot (one not already holding that
expert), as many as bring the first down to the target or the second up to it. Each move fills one slot and never
lifts a rank above the target, so the maximum load never rises and there are at most ep · R moves.

Which rows: an expert's rows are ordered by sending rank, then as each rank's dispatch orders them (the order of
one process's grouping); the owner computes the first ones, then each replica a contiguous run in slot order.
So every rank can say, for each of its rows, which copy computes it (``rows_to_copies``; ``copy_rows`` is the same
as tensors, for the run), without sending more than the counts.

Copies are numbered as the grouped GEMM of each rank sees them ("virtual experts"): rank r's L own experts are
r · (L + R) + l, its slots r · (L + R) + L + s.

Shapes: ep ranks, E experts, L = E / ep own experts per rank, R slots per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class ReplicaPlan:
    """One micro-batch's replication: where copies sit and how many rows each computes."""

    ep: int
    num_local: int  # L
    replicas: int  # R
    slots: tuple[tuple[int, ...], ...]  # [ep][R] the expert in each rank's slots, -1 where empty
    shares: tuple[tuple[tuple[int, int], ...], ...]  # [E] (virtual expert, rows) of each copy, the owner first
    loads_before: tuple[int, ...]  # [ep] rows each rank would compute without replicas
    loads_after: tuple[int, ...]  # [ep] rows each rank computes under the plan

    @property
    def copies_per_rank(self) -> int:
        """L + R: the experts a rank's grouped GEMM runs."""
        return self.num_local + self.replicas

    def owner(self, expert: int) -> int:
        return expert // self.num_local

    @property
    def imbalance_before(self) -> float:
        return imbalance(self.loads_before)

    @property
    def imbalance_after(self) -> float:
        return imbalance(self.loads_after)


def imbalance(loads: tuple[int, ...] | list[int]) -> float:
    """Max over ranks of rows computed / mean (1.0 balanced, and where nothing is computed)."""
    total = sum(loads)
    return max(loads) * len(loads) / total if total else 1.0


def _check_counts(counts: list[list[int]], replicas: int) -> tuple[int, int]:
    ep = len(counts)
    if ep < 1 or any(len(row) != len(counts[0]) for row in counts):
        raise ValueError(f"counts must be [ep][E] with ep >= 1 rows of equal length, got {counts!r}")
    num_experts = len(counts[0])
    if num_experts % ep:
        raise ValueError(f"ep={ep} does not divide the {num_experts} experts")
    if replicas < 0 or (ep > 1 and replicas > num_experts - num_experts // ep):
        raise ValueError(f"replicas={replicas} must be >= 0 and at most the {num_experts - num_experts // ep} "
                         f"experts other ranks own (E={num_experts}, ep={ep})")
    if any(c < 0 for row in counts for c in row):
        raise ValueError("counts must be >= 0")
    return ep, num_experts // ep


def plan_replicas(counts: list[list[int]], replicas: int) -> ReplicaPlan:
    """counts[r][e]: rows rank r sends expert e this micro-batch (every rank holds the same table) -> the plan.

    Deterministic: ties go to the lowest rank and expert index, so every rank computes the same plan.
    ``replicas`` = 0 is the identity: every expert's rows all go to its owner.
    """
    ep, num_local = _check_counts(counts, replicas)
    num_experts = ep * num_local
    expert_load = [sum(row[e] for row in counts) for e in range(num_experts)]
    at_owner = list(expert_load)  # rows each expert's owner still computes
    loads = [sum(expert_load[r * num_local:(r + 1) * num_local]) for r in range(ep)]
    before = tuple(loads)
    target = -(-sum(loads) // ep)  # the mean, rounded up
    slots: list[list[int]] = [[] for _ in range(ep)]
    moved: list[list[tuple[int, int]]] = [[] for _ in range(num_experts)]  # (rank, slot) of each replica
    replica_rows: dict[tuple[int, int], int] = {}
    while True:
        source = max(range(ep), key=lambda r: (loads[r], -r))
        mine = range(source * num_local, (source + 1) * num_local)
        # a rank with a free slot that does not hold every one of the source's experts already
        free = [r for r in range(ep) if r != source and len(slots[r]) < replicas
                and any(e not in slots[r] for e in mine)]
        if loads[source] <= target or not free:
            break
        dest = min(free, key=lambda r: (loads[r], r))
        own = [e for e in mine if e not in slots[dest]]
        expert = max(own, key=lambda e: (at_owner[e], -e))
        rows = min(loads[source] - target, target - loads[dest], at_owner[expert])
        if rows <= 0:
            break
        at_owner[expert] -= rows
        loads[source] -= rows
        loads[dest] += rows
        moved[expert].append((dest, len(slots[dest])))
        replica_rows[dest, len(slots[dest])] = rows
        slots[dest].append(expert)
    copies = num_local + replicas  # a rank's virtual experts
    shares = tuple(
        (((e // num_local) * copies + e % num_local, at_owner[e]),
         *((d * copies + num_local + s, replica_rows[d, s]) for d, s in moved[e]))
        for e in range(num_experts))
    return ReplicaPlan(ep=ep, num_local=num_local, replicas=replicas,
                       slots=tuple(tuple(s + [-1] * (replicas - len(s))) for s in slots), shares=shares,
                       loads_before=before, loads_after=tuple(loads))


def rows_to_copies(plan: ReplicaPlan, counts: list[list[int]]) -> list[list[tuple[int, int]]]:
    """Every rank's rows, grouped by expert as its dispatch sends them, cut into runs: [ep][(virtual expert, rows)]
    in that order. An expert's rows are its copies' shares taken in turn, over the sending ranks in rank order."""
    runs: list[list[tuple[int, int]]] = [[] for _ in range(plan.ep)]
    for expert, shares in enumerate(plan.shares):
        start = 0  # the sending rank's rows' place in the expert's order
        for rank in range(plan.ep):
            end = start + counts[rank][expert]
            offset = 0
            for virtual, rows in shares:
                overlap = min(end, offset + rows) - max(start, offset)
                if overlap > 0:
                    runs[rank].append((virtual, overlap))
                offset += rows
            start = end
    return runs


def copy_rows(plan: ReplicaPlan, counts: Tensor) -> tuple[Tensor, Tensor]:
    """``rows_to_copies`` as tensors, without a Python loop over experts and ranks (the run does it every layer and
    micro-batch): counts [ep, E] int64 -> (rows [ep, E, K]: how many of rank r's rows of expert e its k-th copy
    computes, virtual [E, K]: that copy's virtual expert), K the most copies of one expert (0 rows where it has
    fewer). Rank r's runs are ``virtual`` and ``rows[r]`` read expert by expert, copy by copy."""
    width = max(len(shares) for shares in plan.shares)
    padded = [[*shares, *[(0, 0)] * (width - len(shares))] for shares in plan.shares]
    virtual, sizes = torch.tensor(padded, dtype=torch.int64).unbind(2)  # [E, K] each
    bounds = torch.cat([sizes.new_zeros(len(plan.shares), 1), torch.cumsum(sizes, 1)], 1)  # [E, K + 1]
    counts = counts.to(torch.int64).cpu()
    end = torch.cumsum(counts, 0)  # each rank's rows' place in its expert's order: [start, end)
    start = end - counts
    rows = (torch.minimum(end[:, :, None], bounds[None, :, 1:])
            - torch.maximum(start[:, :, None], bounds[None, :, :-1])).clamp_min(0)
    return rows, virtual


@dataclass(frozen=True)
class WeightMoves:
    """The replicas' weight copies for one rank: what it sends its slots' peers and where what arrives goes."""

    send_local: list[int]  # own experts (local index) to send, grouped by destination rank then slot
    send_splits: list[int]  # [ep] experts sent to each rank
    recv_splits: list[int]  # [ep] experts received from each rank
    recv_slots: list[int]  # the slot each received expert fills, in arrival order (by sending rank, then slot)


def weight_moves(plan: ReplicaPlan, rank: int) -> WeightMoves:
    """Each filled slot's expert comes from its owner; their gradients go back the same way, reversed."""
    send_local, send_splits = [], []
    for dest in range(plan.ep):
        mine = [e % plan.num_local for e in plan.slots[dest] if e >= 0 and plan.owner(e) == rank]
        send_local += mine
        send_splits.append(len(mine))
    recv_slots, recv_splits = [], []
    for source in range(plan.ep):
        theirs = [s for s, e in enumerate(plan.slots[rank]) if e >= 0 and plan.owner(e) == source]
        recv_slots += theirs
        recv_splits.append(len(theirs))
    return WeightMoves(send_local=send_local, send_splits=send_splits, recv_splits=recv_splits, recv_slots=recv_slots)
