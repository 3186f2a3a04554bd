"""The published-layout table's machinery: a row's rank is its place in the planner's own ranking; Eq. 3."""

from __future__ import annotations

import pytest

from analysis import planner, published_layouts
from analysis.published_layouts import A100, TABLE1, Published, gpt_config, is_published, paper_flops
from parallel.groups import Layout


def test_a_rows_rank_is_its_place_in_the_full_ranking_the_cli_prints():
    """A small row (tp=2, pp=2 on 8 GPUs): the bounded search's rank equals the position of the published layout's
    fastest setting among every plan that fits, found without bounds."""
    row = Published("tiny", 4, 256, 4, 2, 2, 8, 16, 100.0)
    result = published_layouts.published_row(row)
    full = planner.search(gpt_config(row), 8, 80 * planner.GIB, 8, A100)
    assert full.complete and len(full.plans) > 20
    position = next(i for i, p in enumerate(full.plans, 1) if is_published(p, row))
    assert result.best.step == full.plans[position - 1].step
    assert result.rank == 1 + sum(p.step < result.best.step for p in full.plans) <= position
    assert result.rank_without_fsdp == 1 + sum(p.step < result.best.step and p.layout.dp_shard == 1
                                               for p in full.plans)
    assert result.paper_setting.config.parallel.activation_checkpointing == "full"
    assert result.first.step == full.plans[0].step


@pytest.mark.parametrize("row", [TABLE1[0], TABLE1[3], TABLE1[6]], ids=lambda r: r.name)
def test_eq3_agrees_with_the_toolkits_flop_count_under_full_recompute(row):
    """The paper's Eq. 3 (GeLU FFN of 4h) against this toolkit's count of the row's model (SwiGLU of 8h/3, rounded)
    with every block recomputed: within 0.5%."""
    config = planner.with_layout(gpt_config(row), Layout.resolve(1), "full")
    ours = sum(planner.stage_flops_per_token(config, Layout.resolve(1))) * row.batch * 2048
    assert ours == pytest.approx(paper_flops(row), rel=5e-3)
