"""The bound on the ranks one token's dispatch reaches (``analysis/dispatch_reach.py``), against counted sends.

``check_counted_reach`` runs inside ``tests/parallel/test_expert.py``'s spawned pair of gloo ranks (spawning is
the slow part): there (ep=2, one rank per "node") an expert-parallel MoE layer routes tokens one at a time, so
each dispatch all-to-all carries exactly one token's rows: the ranks its nonzero send splits name are the ranks
that token reaches. Under group-limited routing with ep dividing ``n_group`` the most any token reaches must equal
the bound (attained, and never exceeded), falling from 2 ranks to 1 as ``topk_group`` falls; the rows a token
sends stay k (one per assignment), which is why the bound does not lower the bytes here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from analysis.dispatch_reach import dispatch_reach
from config.model import MoEConfig
from config.run import load_config
from moe.init import initialize
from moe.layer import MoELayer
from parallel.expert import ExpertParallelExperts
from parallel.groups import Layout, ParallelGroups

D, TOKENS = 16, 8  # tokens per rank
SETTINGS = {"plain top-2": None, "topk_group=2 of 4": 2, "topk_group=1 of 4": 1}  # 8 experts in 4 groups of 2


def _moe(topk_group: int | None) -> MoEConfig:
    return MoEConfig(num_experts=8, top_k=2, expert_hidden=8, score_func="sigmoid", n_group=4, topk_group=topk_group)


def _dispatch_splits(rank: int, groups: ParallelGroups, topk_group: int | None) -> list[list[int]]:
    """The send splits of each dispatch, one token per forward, through an ep=2 layer of ``_moe(topk_group)``."""
    torch.manual_seed(0)  # the same weights on both ranks
    layer = MoELayer(D, _moe(topk_group))
    initialize(layer, 0, 0.5, 0.5)
    layer.experts = ExpertParallelExperts(layer.experts, groups.mesh("ep"))
    splits: list[list[int]] = []
    original = funcol.all_to_all_single

    def counting(x, output_split_sizes, input_split_sizes, group, tag=""):
        splits.append(list(input_split_sizes))
        return original(x, output_split_sizes, input_split_sizes, group, tag)

    funcol.all_to_all_single = counting
    try:
        tokens = torch.randn(TOKENS, 1, 1, D, generator=torch.Generator().manual_seed(10 + rank))
        with torch.no_grad():
            for token in tokens:  # one token per forward: each dispatch is that token's sends
                layer(token)
    finally:
        funcol.all_to_all_single = original
    return splits[0::2]  # each forward: the dispatch, then the combine


def check_counted_reach(rank: int, groups: ParallelGroups) -> None:
    """On each rank of an ep=2 pair: every setting's counted reach against the bound, over both ranks' tokens."""
    most = {}
    for name, topk_group in SETTINGS.items():
        dispatches = _dispatch_splits(rank, groups, topk_group)
        assert all(sum(s) == 2 for s in dispatches), name  # k rows per token, whatever the limit
        reach = [0, 0]
        dist.all_gather_object(reach, max(sum(1 for rows in s if rows) for s in dispatches))
        bound = dispatch_reach(_moe(topk_group), groups.layout, gpus_per_node=1)
        assert max(reach) == bound.ranks == bound.nodes, (name, reach, bound)  # attained and never exceeded
        most[name] = max(reach)
    assert most == {"plain top-2": 2, "topk_group=2 of 4": 2, "topk_group=1 of 4": 1}


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
