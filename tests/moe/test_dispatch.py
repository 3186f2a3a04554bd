"""Capacity and drop policies on constructed cases; permutation round trips."""

import torch

from moe.dispatch import expert_capacity, permute, plan_dispatch, unpermute_and_combine


def kept_assignments(plan) -> set[int]:
    return set(plan.order.tolist())


def test_capacity_formula():
    assert expert_capacity(num_tokens=10, top_k=2, num_experts=8, capacity_factor=1.25) == 4  # ceil(3.125)
    assert expert_capacity(4096, 2, 8, 1.0) == 1024


# 6 tokens, top-1, 2 experts. Tokens 0,1,2,4 choose expert 0; tokens 3,5 choose expert 1.
IDS = torch.tensor([[0], [0], [0], [1], [0], [1]])
WEIGHTS = torch.tensor([[0.5], [0.9], [0.6], [0.7], [0.8], [0.4]])


def test_position_policy_keeps_the_earliest_tokens():
    plan = plan_dispatch(IDS, WEIGHTS, num_experts=2, capacity=2, drop_policy="position")
    assert plan.order.tolist() == [0, 1, 3, 5]  # expert 0: tokens 0,1 kept; 2,4 dropped
    assert plan.tokens_per_expert.tolist() == [2, 2]
    assert plan.selected_per_expert.tolist() == [4, 2]
    assert int(plan.num_dropped) == 2


def test_probability_policy_keeps_the_highest_weights():
    plan = plan_dispatch(IDS, WEIGHTS, num_experts=2, capacity=2, drop_policy="probability")
    # expert 0 candidates by weight: token 1 (0.9), 4 (0.8), 2 (0.6), 0 (0.5) -> keep 1 and 4
    assert kept_assignments(plan) == {1, 4, 3, 5}
    assert plan.order[:2].tolist() == [1, 4]  # expert-major, best first
    assert int(plan.num_dropped) == 2


def test_top2_assignment_ids_and_token_index():
    ids = torch.tensor([[0, 1], [1, 0], [1, 2]])
    weights = torch.tensor([[0.6, 0.4], [0.9, 0.1], [0.7, 0.3]])
    plan = plan_dispatch(ids, weights, num_experts=3, capacity=1, drop_policy="probability")
    # expert 0: assignments 0 (t0, w .6) and 3 (t1, w .1) -> keep 0
    # expert 1: assignments 1 (t0, w .4), 2 (t1, w .9), 4 (t2, w .7) -> keep 2
    # expert 2: assignment 5 (t2, w .3) -> keep
    assert plan.order.tolist() == [0, 2, 5]
    assert plan.token_index.tolist() == [0, 1, 2]
    assert int(plan.num_dropped) == 3


def test_dropless_keeps_everything_grouped_by_expert():
    ids = torch.randint(0, 5, (50, 2))
    plan = plan_dispatch(ids, torch.rand(50, 2), num_experts=5, capacity=None)
    assert sorted(plan.order.tolist()) == list(range(100))
    assert torch.equal(ids.reshape(-1)[plan.order], ids.reshape(-1).sort().values)
    assert int(plan.num_dropped) == 0 and plan.tokens_per_expert.sum() == 100


def test_permute_then_combine_with_identity_experts_sums_kept_weights():
    torch.manual_seed(0)
    x = torch.randn(7, 4)
    ids = torch.randint(0, 3, (7, 1)).repeat(1, 2) + torch.tensor([0, 3])  # two distinct experts of 6
    weights = torch.rand(7, 2)
    plan = plan_dispatch(ids, weights, num_experts=6, capacity=2, drop_policy="position")
    out = unpermute_and_combine(permute(x, plan), plan, weights)
    kept = torch.zeros(14)
    kept[plan.order] = 1.0
    expected = x * (weights * kept.view(7, 2)).sum(-1, keepdim=True)
    torch.testing.assert_close(out, expected)
