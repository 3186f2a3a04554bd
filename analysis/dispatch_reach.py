"""How many ranks and nodes one token's routed copies can reach: group-limited routing as a placement bound.

DeepSeek-V3 (arXiv:2412.19437, sec. 2.1.2 "node-limited routing" and sec. 3.2.2) keeps each token's experts on at
most M = 4 nodes by ranking expert groups that coincide with nodes and picking its k experts from the best M. Here
the same rule is ``moe.n_group``/``moe.topk_group`` (``moe/router.py``), and the placement is
``parallel/expert.py``'s: ep coordinate r holds experts [r·E/ep, (r+1)·E/ep). Group g holds experts
[g·E/G, (g+1)·E/G), so it lies on ``ranks(g)`` ep ranks (one whenever ep divides G) and their nodes.

A token chooses ``topk_group`` groups and k experts inside them, each expert on one rank; so the ranks it reaches
are at most min(k, ep, the sum of the ``topk_group`` largest |ranks(g)|), and likewise for nodes. With ep
dividing ``n_group`` the bound is min(k, ``topk_group``): the communication lever the DeepSeek-V3 report pulls.

What the bound does to bytes: under pure expert parallelism with k > 1, ``parallel/expert_dispatch.py`` sends a
token once per destination rank (a (token, rank) *pair*) and combines its experts' outputs there, so dispatch and
combine move one row per pair, at most ``ranks`` per token instead of k. ``exchange_counts`` gives the pairs and
assignments a rank sends to each destination, from a routing (what the counted tests compare) or, for the
communication model, from the balanced routing it assumes: the round robin itself under ``moe.force_balance``,
otherwise every token reaching the bound (the most the placement allows; DeepSeek-V3's 8 of 256 experts within 4
groups on ep=64 reach 8 ranks, a token of a real router almost always all of them), spread evenly over the ranks.
Where the ep group spans nodes with several of its ranks in each, the exchange goes in two hops
(``parallel/node_dispatch.py``): once per (token, node) across the network, then per rank inside the node; so the
network carries at most ``nodes`` rows per token (``node_exchange_counts``). Under tensor parallelism, or with
k = 1, the exchange stays one row per kept assignment.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from config.model import MoEConfig
from moe.dispatch import count_per_expert, expert_capacity, plan_dispatch
from parallel.layout import Layout
from parallel.ranks import axis_view, groups_for


@dataclass(frozen=True)
class DispatchReach:
    """The most ep ranks and nodes one token's routed copies reach, and what they would be without the limit."""

    ranks: int
    nodes: int
    ranks_unlimited: int  # the same bound with topk_group = n_group (plain top-k)
    nodes_unlimited: int


def group_ranks(moe: MoEConfig, ep: int) -> list[set[int]]:
    """The ep coordinates holding each expert group's experts (``parallel/expert.py``'s contiguous placement)."""
    per_rank, per_group = moe.num_experts // ep, moe.num_experts // moe.n_group
    return [{e // per_rank for e in range(g * per_group, (g + 1) * per_group)} for g in range(moe.n_group)]


def _bound(spans: list[int], groups_chosen: int, top_k: int, total: int) -> int:
    return min(top_k, total, sum(sorted(spans, reverse=True)[:groups_chosen]))


def dispatch_reach(moe: MoEConfig, layout: Layout, gpus_per_node: int, rank: int = 0) -> DispatchReach:
    """The bound for ``rank``'s ep group (its global ranks decide the nodes: ``gpus_per_node`` consecutive ranks)."""
    ep_group = next(g for g in groups_for(layout, *axis_view("ep")) if rank in g)
    node_of = [r // gpus_per_node for r in ep_group]  # by ep coordinate
    ranks = group_ranks(moe, layout.ep)
    nodes = [{node_of[r] for r in held} for held in ranks]
    total_nodes = len(set(node_of))
    rank_spans, node_spans = [len(s) for s in ranks], [len(s) for s in nodes]
    return DispatchReach(
        ranks=_bound(rank_spans, moe.groups_per_token, moe.top_k, layout.ep),
        nodes=_bound(node_spans, moe.groups_per_token, moe.top_k, total_nodes),
        ranks_unlimited=_bound(rank_spans, moe.n_group, moe.top_k, layout.ep),
        nodes_unlimited=_bound(node_spans, moe.n_group, moe.top_k, total_nodes))


def routing_pairs(expert_ids: torch.Tensor, kept: torch.Tensor, num_experts: int,
                  ep: int) -> tuple[list[int], list[int]]:
    """(pairs, kept assignments) one rank's routing sends to each ep coordinate in the deduplicated exchange.

    expert_ids [T, k], kept [T, k] bool (what the capacity left). A pair is a token and a rank holding at least one
    of its kept experts (``parallel/expert.py``'s contiguous placement).
    """
    tokens = torch.arange(expert_ids.shape[0]).unsqueeze(1).expand_as(expert_ids)
    destination = expert_ids // (num_experts // ep)
    pairs = torch.unique(tokens[kept] * ep + destination[kept])
    return count_per_expert(pairs % ep, ep).tolist(), count_per_expert(destination[kept], ep).tolist()


def exchange_counts(moe: MoEConfig, tokens: int, ep: int) -> tuple[list[int], list[int]]:
    """(pairs, kept assignments) a rank of ``tokens`` tokens sends to each ep coordinate under balanced routing.

    ``moe.force_balance``: the router's round robin (assignment t·k + j to expert (t·k + j) mod E), drops by
    position beyond the capacity (exact for ``moe.drop_policy=position``; under ``probability`` which of an
    expert's assignments drop follows the weights, and a token loses a pair only when all of its assignments
    there drop). Otherwise every expert keeps its balanced share (T·k/E to within one, capped at the capacity)
    and ``tokens`` × the reach bound pairs (no more than the assignments) spread evenly: integer arithmetic only,
    as the planner asks for every candidate layout.
    """
    capacity = None if moe.capacity_factor is None else \
        expert_capacity(tokens, moe.top_k, moe.num_experts, moe.capacity_factor)
    if moe.force_balance:
        ids = (torch.arange(tokens * moe.top_k) % moe.num_experts).view(tokens, moe.top_k)
        plan = plan_dispatch(ids, torch.ones(ids.shape), moe.num_experts, capacity, "position")
        kept = (plan.assignment_row < plan.order.numel()).view(tokens, moe.top_k)
        return routing_pairs(ids, kept, moe.num_experts, ep)
    share, extra = divmod(tokens * moe.top_k, moe.num_experts)
    cap = tokens if capacity is None else capacity
    kept_per_expert = [min(share + (e < extra), cap) for e in range(moe.num_experts)]
    local = moe.num_experts // ep
    assignments = [sum(kept_per_expert[r * local:(r + 1) * local]) for r in range(ep)]
    reach = _bound([len(s) for s in group_ranks(moe, ep)], moe.groups_per_token, moe.top_k, ep)
    even, extra = divmod(tokens * reach, ep)
    return [min(even + (r < extra), assignments[r]) for r in range(ep)], assignments


def node_exchange_counts(moe: MoEConfig, tokens: int, nodes: int, per_node: int,
                         node: int) -> tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]:
    """The two-hop exchange's counts (``parallel/node_dispatch.py``) for a rank in node ``node`` of an ep group of
    ``nodes`` × ``per_node`` ranks, under ``exchange_counts``' balanced routing, every rank routing alike:

    - across nodes: the (token, node) pairs and assignments it sends to each node: ``exchange_counts`` with a node
      as the destination (the reach bound over nodes, DeepSeek-V3's M)
    - inside its node: the rows it forwards to each rank of the node: its ``nodes`` senders' (one per node, this
      one included) pairs and assignments bound for that rank, each as one rank sends them in one hop
    """
    pairs, assignments = exchange_counts(moe, tokens, nodes * per_node)
    mine = slice(node * per_node, (node + 1) * per_node)
    forwarded = [nodes * p for p in pairs[mine]], [nodes * a for a in assignments[mine]]
    return exchange_counts(moe, tokens, nodes), forwarded


def describe(moe: MoEConfig, layout: Layout, gpus_per_node: int, rank: int = 0) -> str:
    """One line for the communication table: the bound, beside plain top-k's."""
    reach = dispatch_reach(moe, layout, gpus_per_node, rank)
    limit = (f"group-limited routing (moe.topk_group={moe.groups_per_token} of moe.n_group={moe.n_group})"
             if moe.group_limited else "plain top-k")
    return (f"one token's dispatch reaches at most {reach.ranks} of ep={layout.ep} ranks on {reach.nodes} node(s) "
            f"under {limit} (without the limit: {reach.ranks_unlimited} ranks, {reach.nodes_unlimited} node(s)); "
            f"without tensor parallelism a token's dispatch and combine move one row per rank reached, "
            f"not k={moe.top_k} (across nodes with several ep ranks each: one row per node reached, then per rank "
            f"inside the node)")
