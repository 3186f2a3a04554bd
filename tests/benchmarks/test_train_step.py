"""``benchmarks/train_step.py``'s attribution of profiled operators to categories (not its timings): on a tiny
model, each backward operator lands in its forward module's category, and every category is seen."""

import contextlib
import sys
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import train_step as benchmark  # noqa: E402

from config.run import load_config  # noqa: E402
from tests.training.test_data_loss import TINY  # noqa: E402
from training.step import IntervalStats, StepContext, train_step  # noqa: E402


def test_backward_operators_take_their_forward_modules_category():
    config = load_config("moe-8x", TINY)
    model, optimizer = benchmark.build(config, torch.device("cpu"))
    benchmark.label_modules(model)
    benchmark.label_optimizer(optimizer)
    tokens = torch.randint(0, 256, (2, config.model.seq_len + 1), generator=torch.Generator().manual_seed(0))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_step(StepContext(model, optimizer, 2, 1.0, contextlib.nullcontext), tokens[:, :-1], tokens[:, 1:],
                   IntervalStats())
    found = {}
    for event, part in benchmark.categorized(prof):
        if event.name.startswith("autograd::engine::evaluate_function: "):
            found.setdefault(event.name.split(": ", 1)[1], set()).add(part)
    assert found["SwiGLUExpertsBackward"] == {"expert GEMMs"}  # the experts' node on a CPU (moe.swiglu_experts)
    assert found["_WeightedCombineBackward"] == {"routing and permutation"}
    assert any(name.startswith("ScaledDotProduct") and parts == {"attention"} for name, parts in found.items())
    assert found["NllLossBackward0"] == {None}  # the loss is outside every module: "the rest"
    totals, rest = benchmark.breakdown(prof, "cpu")
    assert all(totals[part] > 0 for part in benchmark.CATEGORIES), totals
    assert sum(rest.values()) == pytest.approx(totals["the rest"])  # the rest, operator by operator
    assert any("nll_loss" in name for name in rest), rest
