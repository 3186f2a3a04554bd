"""``benchmarks/layout_ranking.py``'s plumbing (not its timings): Spearman's rho against hand computations, the
latency fit, and the preset built from collective times and fed to the planner's own estimate."""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import layout_ranking as benchmark  # noqa: E402

from analysis import link_time, traffic_items  # noqa: E402


def test_spearman_matches_the_textbook_formula_and_averages_ties():
    # no ties: 1 - 6 sum(d^2) / (n (n^2 - 1)); ranks of the second list 1, 3, 2, 5, 4: sum d^2 = 4
    assert benchmark.spearman([1.0, 2.0, 3.0, 4.0, 5.0], [10.0, 30.0, 20.0, 50.0, 40.0]) == pytest.approx(
        1 - 6 * 4 / (5 * 24))
    assert benchmark.spearman([3.0, 2.0, 1.0], [1.0, 2.0, 3.0]) == pytest.approx(-1.0)
    # ties: ranks (1.5, 1.5, 3) against (1, 2, 3): Pearson of the ranks by hand
    rx, ry = [1.5, 1.5, 3.0], [1.0, 2.0, 3.0]
    mx, my = sum(rx) / 3, sum(ry) / 3
    expected = (sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True)) /
                math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)))
    assert benchmark.spearman([7.0, 7.0, 9.0], [1.0, 2.0, 3.0]) == pytest.approx(expected)


def test_latency_fit_recovers_a_call_and_step_cost():
    points = [(steps, 2e-3 + steps * 5e-4) for steps in (1, 3, 6, 7, 14)]
    fitted = benchmark.fit_latency(points)
    assert fitted.call == pytest.approx(2e-3) and fitted.intra_step == pytest.approx(5e-4) == fitted.inter_step


def test_preset_takes_the_median_collective_rate_and_the_planner_prices_a_layout_on_it():
    """Collective times made from a known rate and latency: the preset recovers them, and a layout's estimate on it
    is the planner's compute plus the traffic at those figures."""
    world, rate, call, step = 4, 2e9, 1e-3, 2e-4
    times = {}
    for name in benchmark.COLLECTIVES:
        members = (0, 1) if name == "send" else tuple(range(world))
        calls = 2 if name == "send" else 1
        item = traffic_items.Traffic("", name, "", 1, 0, members)
        steps = link_time.ring_steps(item, world)[0]
        for nbytes in (benchmark.SMALL, benchmark.LARGE):
            buffer = max(nbytes // 4 // world * world, world) * 4
            times[name, nbytes] = calls * (call + steps * step + traffic_items.bus_bytes(name, buffer,
                                                                                        len(members)) / rate)
    hardware, rates = benchmark.preset(world, 5e10, times)
    assert all(r == pytest.approx(rate) for r in rates.values())
    assert hardware.intra_node == pytest.approx(rate) and hardware.gpus_per_node == world
    assert hardware.latency.call == pytest.approx(call, rel=1e-3)
    assert hardware.latency.intra_step == pytest.approx(step, rel=1e-3)
    assert hardware.precision == "fp32" and hardware.memory_bandwidth == math.inf
    overrides = [*benchmark.BASE, "model.n_layers=2", "parallel.dp_shard=4"]
    plan = benchmark.predicted("moe-8x", overrides, world, hardware, efficiency=0.5)
    assert plan.compute > 0 and plan.bubble == 0
    assert plan.step == pytest.approx(plan.compute + sum(plan.exposed.values()))
