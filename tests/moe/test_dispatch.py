"""Capacity and drop policies on constructed cases; permutation round trips."""

import pytest
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


def test_probability_order_is_expert_major_then_weight_then_position():
    """The one-sort key against Python's sort on (expert, -weight, position), with ties, zeros and -0.0."""
    torch.manual_seed(2)
    num_tokens, top_k, num_experts = 300, 2, 7
    ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k).mul(8).round().div(8)  # few distinct values: many ties, zeros
    weights[0, 0], weights[1, 1] = -0.0, 1e-40  # a negative zero and a subnormal
    plan = plan_dispatch(ids, weights, num_experts, capacity=num_tokens * top_k, drop_policy="probability")
    flat_ids, flat_w = ids.reshape(-1).tolist(), weights.reshape(-1).tolist()
    expected = sorted(range(num_tokens * top_k), key=lambda a: (flat_ids[a], -flat_w[a], a))
    assert plan.order.tolist() == expected


@pytest.mark.parametrize("policy", ["position", "probability"])
def test_combine_gradients_with_dropped_assignments_match_a_naive_sum(policy):
    """The hand-written backward of the combine against autograd through a per-token loop, with drops."""
    torch.manual_seed(1)
    num_tokens, top_k, num_experts, dim = 9, 2, 3, 5
    ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, dtype=torch.float64, requires_grad=True)
    plan = plan_dispatch(ids, weights.detach(), num_experts=num_experts, capacity=3, drop_policy=policy)
    assert int(plan.num_dropped) > 0  # the case has drops, or it proves nothing about them
    rows = torch.randn(int(plan.tokens_per_expert.sum()), dim, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(num_tokens, dim, dtype=torch.float64)

    out = unpermute_and_combine(rows, plan, weights)
    got = torch.autograd.grad(out, (rows, weights), grad_out)

    row_of = {int(a): r for r, a in enumerate(plan.order)}  # assignment id -> grouped row; absent = dropped
    naive = torch.stack([
        sum((weights[t, j] * rows[row_of[t * top_k + j]] for j in range(top_k) if t * top_k + j in row_of),
            torch.zeros(dim, dtype=torch.float64))
        for t in range(num_tokens)
    ])
    expected = torch.autograd.grad(naive, (rows, weights), grad_out)
    torch.testing.assert_close(out, naive)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)
    dropped = [a for a in range(num_tokens * top_k) if a not in row_of]
    assert torch.all(got[1].reshape(-1)[dropped] == 0)  # a dropped assignment's weight gets no gradient
    torch.autograd.gradcheck(lambda r, w: unpermute_and_combine(r, plan, w), (rows, weights))


@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("capacity", [None, 2])
def test_permute_gradient_is_the_sum_over_a_tokens_kept_rows(top_k, capacity):
    """The gathering backward equals autograd's own through index_select, with and without drops."""
    generator = torch.Generator().manual_seed(top_k)
    num_tokens, num_experts, dim = 7, 4, 5
    ids = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=generator)
    plan = plan_dispatch(ids, weights, num_experts, capacity)
    assert capacity is None or int(plan.num_dropped) > 0  # the drop case really drops
    x = torch.randn(num_tokens, dim, generator=generator, requires_grad=True)
    grad = torch.randn(plan.order.numel(), dim, generator=generator)
    (ours,) = torch.autograd.grad(permute(x, plan), x, grad)
    (reference,) = torch.autograd.grad(x.index_select(0, plan.token_index), x, grad)
    torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-6)
    assert torch.equal(permute(x, plan), x[plan.token_index])
