"""``benchmarks/ep_replication.py``'s plumbing (not its figures' goals): the previous step's counts a placement moved
once per step is planned from, and the planner's replica assumption (``analysis.replica_time``) reproduced from the
benchmark row it names."""

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import ep_replication as benchmark  # noqa: E402

from analysis import replica_time  # noqa: E402


def test_a_placement_moved_per_step_is_planned_from_the_previous_steps_counts_summed_within_a_layer():
    # two layers (runs of 4 micro-batches each), 2 ranks, 2 experts; sample i holds [[i, 0], [0, 10 * i]]
    steps = [[[i, 0], [0, 10 * i]] for i in range(8)]
    per_micro_batch = benchmark.previous_step_counts(steps, series=4, step=1)
    assert sorted(per_micro_batch) == [1, 2, 3, 5, 6, 7]  # a layer's first micro-batch has none before it
    assert per_micro_batch[6] == steps[5]
    per_step = benchmark.previous_step_counts(steps, series=4, step=2)
    assert sorted(per_step) == [2, 3, 6, 7]  # the second step of each layer: its first step's two summed
    assert per_step[2] == per_step[3] == [[0 + 1, 0], [0, 0 + 10]]
    assert per_step[7] == [[4 + 5, 0], [0, 40 + 50]]


def test_the_planners_replica_assumption_is_the_skewed_row_at_ep_8():
    """``EXCESS_LEFT``: the share of the excess over balanced each R leaves, and ``EXPERTS_SENT``: the experts the
    busiest sender copies, are the docs table's skewed ep=8 row (``--tokens 4096 --micro-batches 4``), rounded."""
    row = benchmark.measure("skewed", 4096, 4, ep_degrees=(8,))[0]
    before = statistics.mean(row["before"])
    assert round(before, 1) == replica_time.IMBALANCE
    for replicas, left in replica_time.EXCESS_LEFT.items():
        assert round((statistics.mean(row[f"R={replicas}"]) - 1) / (before - 1), 2) == left
        assert row[f"R={replicas} sent"] == replica_time.EXPERTS_SENT[replicas]
