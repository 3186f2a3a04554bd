"""The replication plan (``parallel/replication.py``) on token counts: balance reached, rows conserved, the same
plan for the same counts, and the identity without slots."""

import random

import pytest
import torch

from parallel.replication import copy_rows, imbalance, plan_replicas, rows_to_copies, weight_moves


def skewed_counts(ep: int, num_experts: int, tokens_per_rank: int, exponent: float, seed: int) -> list[list[int]]:
    """Each rank's rows per expert drawn from one Zipf-like popularity (the hot experts are hot on every rank),
    the hot experts placed at random."""
    rng = random.Random(seed)
    popularity = [1 / (i + 1) ** exponent for i in range(num_experts)]
    rng.shuffle(popularity)
    return [[c for c in _multinomial(rng, tokens_per_rank, popularity)] for _ in range(ep)]


def _multinomial(rng: random.Random, n: int, weights: list[float]) -> list[int]:
    counts = [0] * len(weights)
    for e in rng.choices(range(len(weights)), weights, k=n):
        counts[e] += 1
    return counts


def check_consistent(plan, counts):
    """Rows conserved: every expert's copies compute its rows, each rank's runs add up to what it sends, and the
    loads after are the copies' shares summed per rank."""
    ep, copies = plan.ep, plan.copies_per_rank
    for e, shares in enumerate(plan.shares):
        assert sum(rows for _, rows in shares) == sum(row[e] for row in counts)
        assert shares[0][0] == plan.owner(e) * copies + e % plan.num_local
        for virtual, rows in shares[1:]:
            assert rows > 0 and plan.slots[virtual // copies][virtual % copies - plan.num_local] == e
    per_copy = [0] * (ep * copies)
    for r, runs in enumerate(rows_to_copies(plan, counts)):
        assert sum(n for _, n in runs) == sum(counts[r])
        for virtual, n in runs:
            per_copy[virtual] += n
    for shares in plan.shares:
        for virtual, rows in shares:
            assert per_copy[virtual] == rows
    assert [sum(per_copy[r * copies:(r + 1) * copies]) for r in range(ep)] == list(plan.loads_after)
    assert sum(plan.loads_after) == sum(plan.loads_before)
    assert max(plan.loads_after) <= max(plan.loads_before)
    assert all(sum(e >= 0 for e in slots) <= plan.replicas for slots in plan.slots)


# one slot cannot always do: at ep=8 here half the ranks are above the mean and one of them by more than any
# other rank is below it, while each under-loaded rank takes one expert
@pytest.mark.parametrize("ep,replicas,goal", [(8, 1, 1.15), (8, 2, 1.05), (16, 2, 1.05), (64, 2, 1.05)])
def test_skewed_routing_is_balanced(ep, replicas, goal):
    counts = skewed_counts(ep, 256, 4096, exponent=1.0, seed=ep)
    plan = plan_replicas(counts, replicas)
    check_consistent(plan, counts)
    assert plan.imbalance_before > 1.7  # skewed indeed
    assert plan.imbalance_after <= goal


@pytest.mark.parametrize("ep,experts,replicas", [(4, 16, 2), (8, 64, 1), (16, 32, 3)])
def test_copy_rows_are_the_runs(ep, experts, replicas):
    """The tensor form the run uses against the loop over experts and ranks."""
    counts = skewed_counts(ep, experts, 300, exponent=1.3, seed=experts)
    plan = plan_replicas(counts, replicas)
    rows, virtual = copy_rows(plan, torch.tensor(counts))
    for rank, runs in enumerate(rows_to_copies(plan, counts)):
        mine = rows[rank].reshape(-1)
        assert [(int(v), int(n)) for v, n in zip(virtual.reshape(-1)[mine > 0], mine[mine > 0], strict=True)] == runs


def test_deterministic():
    counts = skewed_counts(8, 32, 512, exponent=1.2, seed=1)
    assert plan_replicas(counts, 2) == plan_replicas([list(row) for row in counts], 2)


def test_no_slots_is_the_identity():
    counts = skewed_counts(4, 8, 100, exponent=1.5, seed=2)
    plan = plan_replicas(counts, 0)
    assert plan.loads_after == plan.loads_before
    assert all(len(shares) == 1 for shares in plan.shares)
    assert rows_to_copies(plan, counts)[1] == [(e, counts[1][e]) for e in range(8) if counts[1][e]]


def test_balanced_routing_moves_nothing():
    counts = [[5] * 8 for _ in range(4)]
    plan = plan_replicas(counts, 2)
    assert plan.slots == ((-1, -1),) * 4 and plan.loads_after == (40,) * 4
    assert weight_moves(plan, 0).send_local == []


def test_one_expert_takes_everything():
    counts = [[0, 0, 0, 12, 0, 0, 0, 0] for _ in range(4)]  # expert 3 (rank 1's) gets all 48 rows
    plan = plan_replicas(counts, 1)
    check_consistent(plan, counts)
    assert plan.loads_before == (0, 48, 0, 0) and plan.loads_after == (12, 12, 12, 12)
    assert plan.slots == ((3,), (-1,), (3,), (3,))
    # rank 0's 12 rows all fall in the owner's share (the first 12 of the expert's 48)
    assert rows_to_copies(plan, counts)[0] == [(1 * 3 + 1, 12)]


def test_more_hot_experts_than_slots():
    # rank 0 owns two hot experts, rank 1 has one slot: the plan does what one slot can
    counts = [[30, 30, 1, 1], [30, 30, 1, 1]]
    plan = plan_replicas(counts, 1)
    check_consistent(plan, counts)
    assert plan.loads_before == (120, 4) and plan.loads_after == (62, 62)
    counts = [[60, 60, 60, 1, 1, 1]] * 2  # three hot experts, one slot per rank: still a rank above the mean
    plan = plan_replicas(counts, 1)
    check_consistent(plan, counts)
    assert plan.loads_after == (240, 126) and imbalance(plan.loads_after) < plan.imbalance_before


def test_a_rank_never_takes_an_expert_it_holds_already():
    # one expert per rank, two slots: rank 0 takes rows of expert 4; later rank 4 is the busiest again and rank 0,
    # a slot to spare, among the least loaded: it is passed over, holding rank 4's only expert (this raised before)
    counts = [[0, 5, 0, 5, 9], *[[0] * 5 for _ in range(4)]]
    plan = plan_replicas(counts, 2)
    check_consistent(plan, counts)
    assert plan.slots == ((4, -1), (-1, -1), (1, 3), (-1, -1), (-1, -1)) and plan.loads_after == (4, 4, 2, 4, 5)


def test_weight_moves_match():
    counts = skewed_counts(4, 16, 400, exponent=1.5, seed=3)
    plan = plan_replicas(counts, 2)
    moves = [weight_moves(plan, r) for r in range(4)]
    for r in range(4):
        for d in range(4):
            assert moves[r].send_splits[d] == moves[d].recv_splits[r]
        sent = [source * 4 + local for source in range(4) for local in moves[source].send_local[
            sum(moves[source].send_splits[:r]):sum(moves[source].send_splits[:r + 1])]]
        assert [plan.slots[r][s] for s in moves[r].recv_slots] == sent


@pytest.mark.parametrize("counts,replicas,message", [
    ([[1, 2, 3]], -1, "replicas=-1"), ([[1, 2, 3], [1, 2, 3]], 1, "does not divide"),
    ([[1, 2], [1, 2]], 2, "at most the 1"), ([[1, -2], [1, 2]], 1, ">= 0")])
def test_bad_input(counts, replicas, message):
    with pytest.raises(ValueError, match=message):
        plan_replicas(counts, replicas)


@pytest.mark.parametrize("overrides,message", [
    (["parallel.ep_replicas=-1"], "must be >= 0"),
    (["parallel.ep_replicas=1"], "needs expert parallelism"),
    (["parallel.ep=2", "moe.num_experts=4", "parallel.ep_replicas=3"], "more slots than the 2 experts")])
def test_bad_config(overrides, message):
    from config.errors import ConfigError
    from config.run import load_config

    with pytest.raises(ConfigError, match=message):
        load_config("moe-8x", overrides)
