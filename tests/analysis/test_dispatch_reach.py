"""The bound on the ranks one token's dispatch reaches (``analysis/dispatch_reach.py``), and the bytes the
deduplicated exchange (``parallel/expert_dispatch.py``) moves, against counted collectives.

``check_counted_reach`` runs inside ``tests/parallel/test_expert.py``'s spawned pair of gloo ranks (spawning is
the slow part): ep=2 with a group of experts per rank (``moe.n_group`` = ep = 2, DeepSeek-V3's node-limited
placement in small). For plain top-2 and for ``topk_group=1``:

- peers: the layer routes tokens one at a time, so each dispatch carries one token's rows; the ranks its nonzero
  send splits name are the ranks that token reaches. The most any token reaches must equal the bound (attained,
  never exceeded): 2, then 1.
- bytes: a forward and backward of all the rank's tokens under ``CollectiveCounter``; every all-to-all's calls and
  bytes must equal ``analysis.traffic_activations.pair_exchange_traffic`` on both ranks' routings (``routing_pairs``:
  one row per (token, rank) pair). The row exchange would send a row per assignment, which that count tells apart
  (asserted: pairs < assignments), and the bytes must fall with ``topk_group``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from analysis.collective_count import CollectiveCounter
from analysis.dispatch_reach import dispatch_reach, exchange_counts, routing_pairs
from analysis.traffic_activations import pair_exchange_traffic
from analysis.traffic_items import totals
from config.model import MoEConfig
from config.run import load_config
from moe.init import initialize
from moe.layer import MoELayer
from parallel.expert import ExpertParallelExperts
from parallel.groups import ParallelGroups
from parallel.layout import Layout

D, TOKENS = 16, 8  # tokens per rank
SETTINGS = {"plain top-2": 2, "topk_group=1 of 2": 1}  # 8 experts in 2 groups of 4, a group per ep rank


def _moe(topk_group: int) -> MoEConfig:
    return MoEConfig(num_experts=8, top_k=2, expert_hidden=8, score_func="sigmoid", n_group=2, topk_group=topk_group,
                     capacity_factor=None)


def _layer(groups: ParallelGroups, topk_group: int) -> MoELayer:
    torch.manual_seed(0)  # the same weights on both ranks
    layer = MoELayer(D, _moe(topk_group))
    initialize(layer, 0, 0.5, 0.5)
    layer.experts = ExpertParallelExperts(layer.experts, groups.mesh("ep"))
    return layer


def _peers_per_token(layer: MoELayer, tokens: torch.Tensor) -> list[int]:
    """The ranks each token's dispatch sends a row to, one token per forward (the first all-to-all of rows)."""
    reached: list[int] = []
    original = funcol.all_to_all_single

    def counting(x, output_split_sizes, input_split_sizes, group, tag=""):
        if x.dim() == 2 and len(reached) < calls[0]:  # the forward's first row exchange: the dispatch
            reached.append(sum(1 for rows in input_split_sizes if rows))
        return original(x, output_split_sizes, input_split_sizes, group, tag)

    calls = [0]
    funcol.all_to_all_single = counting
    try:
        with torch.no_grad():
            for token in tokens:
                calls[0] += 1
                layer(token.view(1, 1, D))
    finally:
        funcol.all_to_all_single = original
    return reached


def check_counted_reach(rank: int, groups: ParallelGroups) -> None:
    """On each rank of an ep=2 pair: peers per token and all-to-all bytes, as ``topk_group`` falls from 2 to 1."""
    most, sent = {}, {}
    group = tuple(dist.get_process_group_ranks(groups.mesh("ep").get_group()))
    for name, topk_group in SETTINGS.items():
        layer = _layer(groups, topk_group)
        tokens = torch.randn(TOKENS, D, generator=torch.Generator().manual_seed(10 + rank))
        reach = [0, 0]
        dist.all_gather_object(reach, max(_peers_per_token(layer, tokens)))
        bound = dispatch_reach(_moe(topk_group), groups.layout, gpus_per_node=1)
        assert max(reach) == bound.ranks == bound.nodes, (name, reach, bound)  # attained and never exceeded
        most[name] = max(reach)

        with torch.no_grad():
            ids = layer.router(tokens).expert_ids
        routing = [None, None]  # every rank's (pairs, assignments) per destination: dropless, all kept
        dist.all_gather_object(routing, routing_pairs(ids, torch.ones_like(ids, dtype=torch.bool), 8, 2))
        assert sum(routing[rank][0]) < sum(routing[rank][1]) == 2 * TOKENS  # some token's two experts share a rank
        counter = CollectiveCounter()
        x = tokens.view(1, TOKENS, D).clone().requires_grad_()
        with counter:
            layer(x).square().sum().backward()
        model = totals(pair_exchange_traffic(*routing[rank], rank, group, D * 4, 1, 1, 8, routing))
        assert counter.totals() == model, (name, counter.totals(), model)
        sent[name] = sum(bytes_ for _, bytes_ in model.values())
    assert most == {"plain top-2": 2, "topk_group=1 of 2": 1}
    assert sent["topk_group=1 of 2"] < sent["plain top-2"], sent


def test_balanced_exchange_counts():
    """The communication model's pairs per destination: the round robin's under ``moe.force_balance`` (4 experts,
    top-2, ep=2: a token's experts 2t, 2t + 1 share a rank, one pair per token), else the reach bound per token."""
    balanced = MoEConfig(num_experts=4, top_k=2, expert_hidden=8, force_balance=True)
    assert exchange_counts(balanced, 10, 2) == ([5, 5], [10, 10])
    routed = MoEConfig(num_experts=4, top_k=2, expert_hidden=8)
    assert exchange_counts(routed, 10, 2) == ([10, 10], [10, 10])  # plain top-2 over 2 ranks: each token both
    limited = MoEConfig(num_experts=8, top_k=2, expert_hidden=8, score_func="sigmoid", n_group=2, topk_group=1)
    assert exchange_counts(limited, 8, 2) == ([4, 4], [8, 8])  # a group per rank: one rank per token


def test_deepseek_v3_on_its_published_layout_reaches_four_nodes():
    """DeepSeek-V3 (sec. 2.1.2): 8 groups of 32 experts over ep=64 on 8-GPU nodes, each group one node's 8 ranks;
    a token's top-8 within the best 4 groups reaches at most 4 nodes (8 ranks), without the limit 8 nodes."""
    config = load_config("deepseek-v3", [])
    layout = Layout.resolve(2048, pp=16, dp_shard=128, ep=64)
    reach = dispatch_reach(config.moe, layout, gpus_per_node=8, rank=2047)
    assert (reach.ranks, reach.nodes, reach.ranks_unlimited, reach.nodes_unlimited) == (8, 4, 8, 8)


def test_groups_split_over_ranks_widen_the_bound():
    """Groups that straddle ranks (ep = 4 over 2 groups of 4 experts) reach two ranks per group chosen."""
    moe = MoEConfig(num_experts=8, top_k=4, expert_hidden=8, n_group=2, topk_group=1)
    reach = dispatch_reach(moe, Layout.resolve(4, dp_shard=4, ep=4), gpus_per_node=2)
    assert (reach.ranks, reach.nodes, reach.ranks_unlimited, reach.nodes_unlimited) == (2, 1, 4, 2)
