"""Expert parallelism: the reorder, the support check, and EP against one process on 2 gloo ranks.

The spawned test runs every check in one pair of processes (spawning is the slow part): for each
case the EP MoELayer must give each rank the output and gradients the single-process MoELayer gives
for that rank's tokens (experts' gradients: the sum over both ranks' tokens, gathered into the full
[E, ...] order), and the token all-to-all must carry one row per (token, destination rank) pair of the
kept assignments (``parallel/expert_dispatch.py``), with a code and a weight per kept assignment. The
same pair counts the ranks one token's dispatch reaches under group-limited routing, and the bytes it
moves (``tests/analysis/test_dispatch_reach.py``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor

from analysis.collective_count import CollectiveCounter
from analysis.traffic_activations import replicated_exchange_traffic
from analysis.traffic_items import totals
from config.model import MoEConfig
from moe.dispatch import expert_capacity, plan_dispatch
from moe.init import initialize
from moe.layer import MoELayer
from parallel.expert import ExpertParallelExperts, expert_major_index
from parallel.groups import ParallelGroups
from parallel.layout import Layout
from parallel.sharding import clip_grad_norm_
from tests.analysis.test_dispatch_reach import check_counted_reach
from tests.spawn import spawn


@pytest.mark.parametrize("counts, expected", [
    # ep=2, L=2. Received rank-major: r0l0 [0] | r0l1 [1 2] | r1l0 [3 4 5] | r1l1 [6].
    # Expert-major: l0 <- r0 [0], r1 [3 4 5]; l1 <- r0 [1 2], r1 [6].
    ([[1, 2], [3, 1]], [0, 3, 4, 5, 1, 2, 6]),
    # ep=3, L=2, with empty blocks. Rank-major: r0l1 [0 1] | r1l0 [2] | r2l0 [3 4] | r2l1 [5].
    # Expert-major: l0 <- r1 [2], r2 [3 4]; l1 <- r0 [0 1], r2 [5].
    ([[0, 2], [1, 0], [2, 1]], [2, 3, 4, 0, 1, 5]),
    ([[0, 0], [0, 0]], []),  # nothing received
])
def test_expert_major_index(counts, expected):
    counts = torch.tensor(counts)
    for num_rows in (None, len(expected)):
        index = expert_major_index(counts, num_rows)
        assert index.tolist() == expected
    received = torch.arange(len(expected) * 3, dtype=torch.float32).view(-1, 3)
    grouped = received.index_select(0, index)
    assert torch.equal(grouped.new_empty(grouped.shape).index_copy(0, index, grouped), received)  # inverse


# ---------------------------------------------------------------------------
# Two ranks: EP MoELayer against the single-process MoELayer
# ---------------------------------------------------------------------------

D, HIDDEN, WORLD = 16, 24, 2
CASES = [  # (capacity factor, autocast dtype, GPT-OSS's MoE); capacity 1.0 drops some assignments
    (None, None, False),
    (1.0, None, False),
    (None, torch.bfloat16, False),
    (1.0, None, True),  # biased router and experts (the biases sharded with their experts), clamped SwiGLU
]


def _layer(capacity_factor: float | None, gpt_oss: bool = False) -> MoELayer:
    gpt_oss_options = dict(activation="clamped_swiglu", swiglu_limit=0.1, router_bias=True, expert_proj_bias=True)
    config = MoEConfig(num_experts=4, top_k=2, expert_hidden=HIDDEN, capacity_factor=capacity_factor,
                       num_shared_experts=1, aux_loss_coef=0.01, z_loss_coef=0.001,
                       **(gpt_oss_options if gpt_oss else {}))
    torch.manual_seed(0)  # every rank builds the same weights
    layer = MoELayer(D, config)
    initialize(layer, 0, 0.1, 0.05)
    with torch.no_grad():  # biases start at zero: draw them (same seed on every rank) so each one counts
        for name, param in layer.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
    return layer


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens [2, 8, D] and the projection that turns the output into a loss."""
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randn(2, 8, D, generator=generator), torch.randn(2, 8, D, generator=generator)


def _run(layer: MoELayer, x: torch.Tensor, projection: torch.Tensor, dtype: torch.dtype | None):
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
        out = layer(x)
    (out.float() * projection).sum().backward()
    return out.detach().float(), x.grad


def _full_grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            for name, p in module.named_parameters()}


def reference_results(layer: MoELayer, rank: int, world: int, inputs: Callable[[int], tuple[torch.Tensor, ...]],
                      dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """One process, each of ``world`` ranks' ``inputs`` through ``layer``: ``rank``'s output and input gradient, and
    every parameter's gradient, the experts' summed over all ranks' tokens (as expert parallelism sums them)."""
    expert_grads = {name: torch.zeros_like(p) for name, p in layer.experts.named_parameters()}
    for source in range(world):
        layer.zero_grad()
        out, x_grad = _run(layer, *inputs(source), dtype)
        for name, p in layer.experts.named_parameters():
            expert_grads[name] += p.grad
        if source == rank:
            mine = out, x_grad, {name: p.grad.clone() for name, p in layer.named_parameters()}
    mine[2].update({f"experts.{name}": grad for name, grad in expert_grads.items()})
    return mine


def _check_case(rank: int, groups: ParallelGroups, capacity_factor: float | None, dtype: torch.dtype | None,
                gpt_oss: bool):
    reference = _layer(capacity_factor, gpt_oss)
    ep_layer = copy.deepcopy(reference)
    ep_layer.experts = ExpertParallelExperts(ep_layer.experts, groups.mesh("ep"))
    assert ep_layer.experts.state_dict().keys() == reference.experts.state_dict().keys()
    for name, value in ep_layer.experts.state_dict().items():  # same names, full [E, ...] stacks
        assert torch.equal(value.full_tensor(), reference.experts.state_dict()[name])

    ref_out, ref_x_grad, ref_grads = reference_results(reference, rank, WORLD, _inputs, dtype)
    with torch.no_grad():  # what this rank's routing keeps, for the traffic check
        routed = reference.router(_inputs(rank)[0].reshape(-1, D))
    capacity = None if capacity_factor is None else expert_capacity(16, 2, 4, capacity_factor)
    plan = plan_dispatch(routed.expert_ids, routed.weights, 4, capacity)

    sent = []  # (input rows, input splits, bytes per row, dtype) of each all-to-all this rank starts

    def counting_all_to_all(x, output_split_sizes, input_split_sizes, group, tag=""):
        sent.append((x.shape[0], list(input_split_sizes), x[:1].numel() * x.element_size(), x.dtype))
        return original(x, output_split_sizes, input_split_sizes, group, tag)

    original, funcol.all_to_all_single = funcol.all_to_all_single, counting_all_to_all
    try:
        out, x_grad = _run(ep_layer, *_inputs(rank), dtype)
    finally:
        funcol.all_to_all_single = original

    tol = dict(rtol=1e-5, atol=1e-5) if dtype is None else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(x_grad, ref_x_grad, **tol)
    grads = _full_grads(ep_layer)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], **tol, msg=name)

    # Traffic: forward = dispatch (rows, codes, weights) + combine (backward's exchanges are autograd's, not counted
    # here). A row per (token, destination rank) pair of the kept assignments, counted from one process's plan.
    (rows, splits, row_bytes, sent_dtype), (codes, code_splits, _, _), (weights, _, weight_bytes, _), \
        (back_rows, back_splits, _, _) = sent
    kept = plan.assignment_row < int(plan.tokens_per_expert.sum())  # [T*k]
    pairs = {(a // 2, int(routed.expert_ids.view(-1)[a]) // 2) for a in range(kept.numel()) if kept[a]}
    element_size = torch.tensor([], dtype=dtype or torch.float32).element_size()
    assert sent_dtype == (dtype or torch.float32) and row_bytes == D * element_size
    assert rows == len(pairs) and splits == [sum(1 for _, r in pairs if r == dest) for dest in range(WORLD)]
    assert rows < int(kept.sum())  # some token's two experts share a rank: it travels there once
    assert codes == int(kept.sum()) == int(plan.tokens_per_expert.sum()) and weight_bytes == 4
    assert code_splits == [int(plan.tokens_per_expert[2 * dest:2 * dest + 2].sum()) for dest in range(WORLD)]
    if capacity_factor is not None:
        assert int(plan.num_dropped) > 0 and codes < int(plan.selected_per_expert.sum())  # dropped before sending
    peers = [0] * WORLD  # one row per pair the other rank sent me comes back to it, no more
    dist.all_gather_object(peers, splits)
    assert back_rows == sum(p[rank] for p in peers) and back_splits == [p[rank] for p in peers]

    # The global gradient norm counts each expert once (DTensors on the ep mesh) next to plain tensors.
    expected = torch.linalg.vector_norm(torch.stack([g.norm() for g in ref_grads.values()]))
    params = list(ep_layer.parameters())
    norm = clip_grad_norm_(params, max_norm=float(expected) / 2)
    torch.testing.assert_close(norm, expected, **tol)
    for name, grad in _full_grads(ep_layer).items():
        torch.testing.assert_close(grad, ref_grads[name] * 0.5, **tol, msg=name)


def _check_replicas(rank: int, groups: ParallelGroups, dtype: torch.dtype | None, gpt_oss: bool) -> None:
    """``parallel.ep_replicas=1``: the same outputs and gradients as one process, with rows moved to the other rank's
    slot, and the counted bytes (the counts' all-gather, the slot's weights and their gradients, the rows) equal to
    ``analysis.traffic_activations.replicated_exchange_traffic`` of the plan."""
    reference = _layer(None, gpt_oss)
    ep_layer = copy.deepcopy(reference)
    ep_layer.experts = ExpertParallelExperts(ep_layer.experts, groups.mesh("ep"), replicas=1)
    ref_out, ref_x_grad, ref_grads = reference_results(reference, rank, WORLD, _inputs, dtype)
    counter = CollectiveCounter()
    with counter:
        out, x_grad = _run(ep_layer, *_inputs(rank), dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype is None else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(x_grad, ref_x_grad, **tol)
    for name, grad in _full_grads(ep_layer).items():
        torch.testing.assert_close(grad, ref_grads[name], **tol, msg=name)

    plan = ep_layer.experts.last_plan
    assert plan.imbalance_after < plan.imbalance_before and max(plan.loads_after) - min(plan.loads_after) <= 1
    with torch.no_grad():  # every rank's kept rows per expert, as one process routes them
        routed = [reference.router(_inputs(r)[0].reshape(-1, D)) for r in range(WORLD)]
        counts = [plan_dispatch(o.expert_ids, o.weights, 4, None).tokens_per_expert for o in routed]
    element = torch.tensor([], dtype=dtype or torch.float32).element_size()
    expert_bytes = sum(p.to_local()[0].numel() * element for p in ep_layer.experts.parameters())
    group = tuple(dist.get_process_group_ranks(groups.mesh("ep").get_group()))
    predicted = replicated_exchange_traffic(plan, [c.tolist() for c in counts], rank, group, D * element, expert_bytes)
    assert totals(predicted) == counter.totals()


def _worker(rank: int) -> None:
    groups = ParallelGroups.build(Layout(WORLD, dp_shard=WORLD, ep=WORLD), "cpu")
    for capacity_factor, dtype, gpt_oss in CASES:
        _check_case(rank, groups, capacity_factor, dtype, gpt_oss)
    _check_replicas(rank, groups, None, False)
    _check_replicas(rank, groups, torch.bfloat16, True)
    check_counted_reach(rank, groups)  # the node-limited routing bound, counted on the same pair


def test_expert_parallel_layer_matches_single_process():
    spawn(_worker, WORLD)
