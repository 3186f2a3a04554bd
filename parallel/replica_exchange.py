"""The experts' row exchange with replicated hot experts (``parallel.ep_replicas``): the plan of
``parallel/replication.py`` run on tensors.

In each forward, after routing, the ep ranks share their per-expert counts (one all-gather of [E] int64; its
read on the host is the exchange's one device-to-host sync, as the counts' all-to-all is without replicas) and
each computes the same plan. Then:

    1. rows:    this rank's rows, grouped by global expert, are regrouped by copy ("virtual expert": rank r's
                L own experts and R slots are r · (L + R) + 0 .. L + R - 1), so that the row exchange of
                ``parallel/expert.py`` runs unchanged over ep · (L + R) copies
    2. weights: each filled slot's weights come from the expert's owner by one uneven all-to-all (in the compute
                dtype, an expert's stacked weights side by side); a rank runs one grouped GEMM on its own
                experts, as without replicas, and one on its filled slots (its own weights are not copied)
    3. back:    the outputs return by the reverse exchange and are put back in the dispatch's order

Backward is autograd's: the weights' all-to-all returns each replica's gradient to its owner, where it adds to
the owner's own (the local stack feeds both the GEMM and the copy), before FSDP reduces it and the optimizer,
whose state lives with the owner alone, steps. Every row meets the same weights as without replicas and the
combine at home is unchanged, so the model computes the same function: only which rank computes a row moves.

Weights move per micro-batch, from the loads that micro-batch routed: the plan needs no history, and a placement
kept from the previous micro-batch balances less (``benchmarks/ep_replication.py`` measures both: 1.10-1.28 against
1.01-1.10 at ep=64). The price is the copies every micro-batch, which across nodes cost most of what they save
(``analysis/replica_time.py``; docs/parallelism.md has the figures).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from parallel.expert_dispatch import all_to_all_rows
from parallel.replication import ReplicaPlan, copy_rows, plan_replicas, weight_moves


@dataclass
class ReplicaRouting:
    """One forward's replicated exchange: the plan, and this rank's rows in the copies' order."""

    plan: ReplicaPlan
    order: Tensor  # [N] this rank's rows (grouped by expert) in copy order
    restore: Tensor  # [N] its inverse
    send_splits: list[int]  # [ep] rows this rank sends each rank's copies
    recv_splits: list[int]  # [ep] rows each rank sends this rank's copies
    recv_counts: Tensor  # [ep, L + R] rows each rank sends each of this rank's copies
    own_rows: int  # rows this rank computes on its own experts (the rest on its slots)
    filled: int  # this rank's filled slots (the first ones)


def share_counts(tokens_per_expert: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Every ep rank's per-expert counts [ep, E] on the host, the same table on every rank of ``group``."""
    mine = tokens_per_expert.to(torch.int64).contiguous()
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    # NOTE: the exchange's one device-to-host sync: the plan and the collectives' splits are host integers
    return torch.stack(gathered).cpu()


def route_replicas(tokens_per_expert: Tensor, group: dist.ProcessGroup, replicas: int) -> ReplicaRouting:
    """Share the counts, plan, and say where each of this rank's rows goes. tokens_per_expert: [E]."""
    counts = share_counts(tokens_per_expert, group)
    plan = plan_replicas(counts.tolist(), replicas)
    rank, width, ep = dist.get_rank(group), plan.copies_per_rank, plan.ep
    rows, virtual = copy_rows(plan, counts)  # [ep, E, K] rows of each rank to each expert's copies, [E, K] copies
    sent = torch.zeros(ep, ep * width, dtype=torch.int64).scatter_add_(
        1, virtual.reshape(1, -1).expand(ep, -1), rows.reshape(ep, -1)).view(ep, ep, width)  # [source, rank, copy]
    device = tokens_per_expert.device
    copy_of_row = torch.repeat_interleave(virtual.reshape(-1), rows[rank].reshape(-1)).to(device)
    order = torch.sort(copy_of_row, stable=True).indices
    restore = torch.empty_like(order)
    restore[order] = torch.arange(order.numel(), device=device)
    return ReplicaRouting(plan=plan, order=order, restore=restore, send_splits=sent[rank].sum(1).tolist(),
                          recv_splits=sent[:, rank].sum(1).tolist(), recv_counts=sent[:, rank].to(device),
                          own_rows=int(sent[:, rank, :plan.num_local].sum()),
                          filled=sum(e >= 0 for e in plan.slots[rank]))


def fetch_replicas(stacks: dict[str, Tensor], plan: ReplicaPlan, group: dist.ProcessGroup) -> dict[str, Tensor]:
    """This rank's stacks by name, each [L, ...] -> its filled slots' experts, each [n, ...], from their owners: one
    uneven all-to-all of each expert's tensors side by side. Every rank of ``group`` calls it, also those that fill
    no slot. Differentiable: a slot's gradients return to the owner's stacks by the reverse all-to-all, which
    every rank joins too (``join_backward``)."""
    moves = weight_moves(plan, dist.get_rank(group))
    first = next(iter(stacks.values()))
    index = torch.tensor(moves.send_local, dtype=torch.int64, device=first.device)
    widths = [stack[0].numel() for stack in stacks.values()]
    sent = torch.cat([stack.index_select(0, index).reshape(len(index), width)
                      for stack, width in zip(stacks.values(), widths, strict=True)], 1)
    arrived = all_to_all_rows(sent, moves.send_splits, moves.recv_splits, group)
    # arrival is by sending rank; the slots were filled in order 0, 1, ..: put each where its slot is
    position = sorted(range(len(moves.recv_slots)), key=moves.recv_slots.__getitem__)
    arrived = arrived.index_select(0, torch.tensor(position, dtype=torch.int64, device=first.device))
    return {name: part.reshape(len(position), *stack.shape[1:])
            for (name, stack), part in zip(stacks.items(), arrived.split(widths, 1), strict=True)}


class _JoinBackward(torch.autograd.Function):
    """Identity on ``out``; a zero gradient for ``fetched``, so that its all-to-all's backward runs."""

    @staticmethod
    def forward(ctx, out: Tensor, fetched: Tensor) -> Tensor:
        ctx.fetched = (fetched.shape, fetched.dtype)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor):
        shape, dtype = ctx.fetched
        return grad, grad.new_zeros(shape, dtype=dtype)


def join_backward(out: Tensor, fetched: dict[str, Tensor]) -> Tensor:
    """``out``, tied in autograd to slot weights that computed nothing here (a rank that fills no slot): the
    gradients' return is a collective, so every rank must reach it in backward, with nothing to send back."""
    return _JoinBackward.apply(out, next(iter(fetched.values())))
