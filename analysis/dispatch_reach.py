"""How many ranks and nodes one token's routed copies can reach: group-limited routing as a placement bound.

DeepSeek-V3 (arXiv:2412.19437, sec. 2.1.2 "node-limited routing" and sec. 3.2.2) keeps each token's experts on at
most M = 4 nodes by ranking expert groups that coincide with nodes and picking its k experts from the best M. Here
the same rule is ``moe.n_group``/``moe.topk_group`` (``moe/router.py``), and the placement is
``parallel/expert.py``'s: ep coordinate r holds experts [r·E/ep, (r+1)·E/ep). Group g holds experts
[g·E/G, (g+1)·E/G), so it lies on ``ranks(g)`` ep ranks (one whenever ep divides G) and their nodes.

A token chooses ``topk_group`` groups and k experts inside them, each expert on one rank; so the ranks it reaches
are at most min(k, ep, the sum of the ``topk_group`` largest |ranks(g)|), and likewise for nodes. With ep
dividing ``n_group`` the bound is min(k, ``topk_group``): the communication lever the DeepSeek-V3 report pulls.

What the bound does to bytes here: nothing yet. ``parallel/expert.py`` sends one row per kept (token, expert)
assignment, so a token costs k rows whether its experts share one rank or not; the bytes fall only with a
dispatch that sends a token once per destination rank (or node) and fans it out there (DeepSeek's DeepEP
does so over InfiniBand, then NVLink), which this toolkit does not have. The bound is what such a dispatch
would send per token, and how many peers one token's dispatch waits on.
"""

from __future__ import annotations

from dataclasses import dataclass

from config.model import MoEConfig
from parallel.groups import Layout, axis_view, groups_for


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


def describe(moe: MoEConfig, layout: Layout, gpus_per_node: int, rank: int = 0) -> str:
    """One line for the communication table: the bound, beside plain top-k's."""
    reach = dispatch_reach(moe, layout, gpus_per_node, rank)
    limit = (f"group-limited routing (moe.topk_group={moe.groups_per_token} of moe.n_group={moe.n_group})"
             if moe.group_limited else "plain top-k")
    return (f"one token's dispatch reaches at most {reach.ranks} of ep={layout.ep} ranks on {reach.nodes} node(s) "
            f"under {limit} (without the limit: {reach.ranks_unlimited} ranks, {reach.nodes_unlimited} node(s)); "
            f"bytes are k={moe.top_k} rows per token either way (one row per kept assignment)")
