"""The two-hop expert exchange (``parallel/node_dispatch.py``) on 4 gloo ranks as 2 simulated nodes of 2.

One spawned group runs every check (spawning is the slow part). For each routing, the same MoE layer runs with the
one-hop pair exchange and with the two-hop one: both must give each rank the output and gradients (tokens, router,
experts) one process gives for its tokens, and the two-hop exchange must send fewer bytes to the other node than
the one-hop one. Then the memory model's saved bytes for the two-hop path equal what autograd keeps, to the byte.
The counted bytes per group against the communication model: ``tests/analysis/test_communication.py`` (a case on 4
ranks as 2 nodes).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.multiprocessing as mp

from analysis.collective_count import CollectiveCounter
from config.errors import ConfigError
from config.model import MoEConfig
from config.run import load_config
from moe.init import initialize
from moe.layer import MoELayer
from moe.transformer import MoETransformer
from parallel import parallelize
from parallel.expert import ExpertParallelExperts
from parallel.groups import ParallelGroups
from parallel.layout import Layout
from parallel.ranks import expert_nodes
from parallel.resolve import resolve_layout
from tests.analysis.test_memory import SPAWNED_MODEL, _measure, _tiny
from tests.parallel.test_expert import _full_grads, _run, reference_results
from tests.spawn import spawn

WORLD, RANKS_PER_NODE, D = 4, 2, 16
ROUTINGS = {  # 8 experts over ep=4: 2 per rank, 4 per node; a group per node under n_group=2
    "top-2, plain": dict(top_k=2),
    "top-3, one node per token (node-limited)": dict(top_k=3, score_func="sigmoid", n_group=2, topk_group=1),
    "top-2, capacity drops": dict(top_k=2, capacity_factor=1.0),
}


@pytest.mark.parametrize("world, ep, ranks_per_node, expected", [
    (4, 4, 2, ([[0, 1], [2, 3]], [[0, 2], [1, 3]])),
    (8, 4, 2, ([[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2], [1, 3], [4, 6], [5, 7]])),
    (4, 4, 4, None),  # one node: the one-hop exchange
    (4, 4, 1, None),  # one ep rank per node: one hop already crosses once per node
    (12, 4, 6, None),  # a node holds one group whole and half of another: no in-node position pairs them up
])
def test_ep_groups_are_cut_by_node(world, ep, ranks_per_node, expected):
    nodes = expert_nodes(Layout.resolve(world, ep=ep), ranks_per_node)
    assert (nodes and ([list(g) for g in nodes.intra], [list(g) for g in nodes.inter])) == expected


@pytest.mark.parametrize("ranks_per_node, message", [(3, "does not divide the world of 4 ranks"),
                                                      (0, "must be >= 1 or null")])
def test_a_node_size_that_does_not_cut_the_world_is_refused(ranks_per_node, message):
    with pytest.raises(ConfigError, match=message):
        resolve_layout(load_config("moe-8x", [f"parallel.ranks_per_node={ranks_per_node}"]), 4)


def _layer(routing: dict) -> MoELayer:
    options = {"capacity_factor": None, **routing}
    torch.manual_seed(0)  # every rank builds the same weights
    layer = MoELayer(D, MoEConfig(num_experts=8, expert_hidden=24, num_shared_experts=1, aux_loss_coef=0.01,
                                  **options))
    initialize(layer, 0, 0.1, 0.05)
    return layer


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randn(2, 16, D, generator=generator), torch.randn(2, 16, D, generator=generator)


def _check_routing(rank: int, groups: ParallelGroups, routing: dict) -> None:
    reference = _layer(routing)
    ref_out, ref_x_grad, ref_grads = reference_results(copy.deepcopy(reference), rank, WORLD, _inputs, None)
    results = {}
    for hops, node_groups in (("one", None), ("two", groups.expert_node_groups(RANKS_PER_NODE))):
        layer = copy.deepcopy(reference)
        layer.experts = ExpertParallelExperts(layer.experts, groups.mesh("ep"), node_groups=node_groups)
        counter = CollectiveCounter()
        with counter:
            out, x_grad = _run(layer, *_inputs(rank), None)
        results[hops] = out, x_grad, _full_grads(layer), counter.all_to_all_bytes_across_nodes(RANKS_PER_NODE)
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x_grad, ref_x_grad, rtol=1e-5, atol=1e-5)
        for name, grad in results[hops][2].items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-5, msg=f"{hops} hop(s): {name}")
    (one_out, one_x_grad, one_grads, one_across), (two_out, two_x_grad, two_grads, two_across) = results.values()
    torch.testing.assert_close(two_out, one_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(two_x_grad, one_x_grad, rtol=1e-6, atol=1e-6)
    for name, grad in two_grads.items():
        torch.testing.assert_close(grad, one_grads[name], rtol=1e-6, atol=1e-6, msg=name)
    assert 0 < two_across < one_across, (routing, two_across, one_across)


def _check_memory(rank: int, results: dict) -> None:
    """The two-hop path's saved bytes (``analysis.memory_activations._node_combine``) against autograd's."""
    config = _tiny(*SPAWNED_MODEL, "parallel.ep=4", f"parallel.ranks_per_node={RANKS_PER_NODE}")
    layout, micro, _ = resolve_layout(config, WORLD)
    groups = ParallelGroups.build(layout, "cpu")
    torch.manual_seed(0)
    model = parallelize(MoETransformer(config.model, config.moe), groups, config.parallel)
    assert model.moe_layers() and all(layer.experts.node_groups is not None for layer in model.moe_layers().values())
    results[rank] = _measure(config, layout, micro, "fp32", model, seed=1 + groups.coords()["dp_shard"])


def _worker(rank: int, results: dict) -> None:
    groups = ParallelGroups.build(Layout(WORLD, dp_shard=WORLD, ep=WORLD), "cpu")
    for routing in ROUTINGS.values():
        _check_routing(rank, groups, routing)
    _check_memory(rank, results)


def test_two_hops_match_one_hop_and_one_process_and_cross_nodes_less():
    with mp.Manager() as manager:
        results = manager.dict()
        spawn(_worker, WORLD, results)
        results = dict(results)
    for rank in range(WORLD):
        predicted, measured = results[rank]
        assert predicted == measured, (rank, predicted - measured)
