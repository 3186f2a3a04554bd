"""The published-layout table's machinery: a row's rank is its place in the planner's own ranking; Eq. 3."""

from __future__ import annotations

import dataclasses

import pytest

from analysis import gpu_presets, layout_search, planner, published_layouts, step_time, traffic
from analysis.published_layouts import A100, TABLE1, Published, gpt_config, is_published, paper_flops
from moe.accounting import parameter_counts
from parallel.layout import Layout


def test_a_rows_rank_is_its_place_in_the_full_ranking_the_cli_prints():
    """A small row (tp=2, pp=2 on 8 GPUs): the bounded search's rank equals the position of the published layout's
    fastest setting among every plan that fits, found without bounds."""
    row = Published("tiny", 4, 256, 4, 2, 2, 8, 16, 100.0)
    result = published_layouts.published_row(row)
    full = layout_search.search(gpt_config(row), 8, 80 * planner.GIB, 8, A100)
    assert full.complete and len(full.plans) > 20
    position = next(i for i, p in enumerate(full.plans, 1) if is_published(p, row))
    assert result.best.step == full.plans[position - 1].step
    assert result.setting_rank == 1 + sum(p.step < result.best.step for p in full.plans) <= position
    # each layout once: the distinct (degrees, schedule, v) among the faster plans, counted by hand
    faster = {(p.layout, p.config.parallel.pp_schedule, p.config.parallel.pp_virtual_stages) for p in full.plans
              if p.step < result.best.step}
    assert result.rank == 1 + len(faster) < result.setting_rank
    assert result.rank_without_fsdp == 1 + len({f for f in faster if f[0].dp_shard == 1})
    assert result.paper_setting.config.parallel.activation_checkpointing == "full"
    assert result.first.step == full.plans[0].step


@pytest.mark.parametrize("row", [TABLE1[0], TABLE1[3], TABLE1[6]], ids=lambda r: r.name)
def test_eq3_agrees_with_the_toolkits_flop_count_under_full_recompute(row):
    """The paper's Eq. 3 (GeLU FFN of 4h) against this toolkit's count of the row's model (SwiGLU of 8h/3, rounded)
    with every block recomputed: within 0.5%."""
    config = layout_search.with_layout(gpt_config(row), Layout.resolve(1), "full")
    ours = sum(step_time.stage_flops_per_token(config, Layout.resolve(1))) * row.batch * 2048
    assert ours == pytest.approx(paper_flops(row), rel=5e-3)


def test_rank_among_the_published_data_parallel_degree_counts_only_its_tp_pp_splits():
    row = Published("tiny", 4, 256, 4, 2, 2, 8, 16, 100.0)
    result = published_layouts.published_row(row)
    full = layout_search.search(gpt_config(row), 8, 80 * planner.GIB, 8, A100)
    faster = {(p.layout, p.config.parallel.pp_schedule, p.config.parallel.pp_virtual_stages) for p in full.plans
              if p.step < result.best.step and (p.layout.dp_shard, p.layout.dp_replicate) == (1, 2)}
    assert result.rank_same_dp == 1 + len(faster)


def test_a_published_moe_mappings_rank_is_its_place_in_the_full_ranking():
    small = ("model.d_model=64", "model.n_layers=4", "model.n_heads=4", "model.seq_len=64", "model.ffn_hidden=128",
             "moe.num_experts=4", "moe.expert_hidden=64", "train.precision=bf16")
    row = published_layouts.PublishedMoE("tiny", "moe-8x", small, "h100", 8, 16, 1, 2, 2, 1, 2, "a test")
    result = published_layouts.published_moe_row(row)
    config = published_layouts.load_config("moe-8x", [*small, "train.global_batch_size=16"])
    full = layout_search.search(config, 8, 80 * planner.GIB, 8, gpu_presets.HARDWARE["h100"])
    mine = [p for p in full.plans if (p.layout.tp, p.layout.pp, p.layout.ep, p.layout.etp,
                                      p.config.parallel.pp_virtual_stages) == (1, 2, 2, 1, 2)]
    assert result.best.step == mine[0].step
    assert result.setting_rank == 1 + sum(p.step < mine[0].step for p in full.plans)
    assert result.rank == 1 + len({(p.layout, p.config.parallel.pp_schedule, p.config.parallel.pp_virtual_stages)
                                   for p in full.plans if p.step < mine[0].step})


def test_zero3_rows_move_8_bytes_per_parameter_per_step():
    """FSDP over every GPU with one micro-batch: bf16 gathers in forward and again in backward (2 + 2 bytes) and
    the fp32 gradient reduce-scatter (4), each (n − 1)/n of the model (FSDP's padding of shards within 1%) --
    what DeepSpeed's ZeRO-3 moves with recompute too (3 fp16 gathers, one fp16 reduce-scatter)."""
    row = published_layouts.TABLE2[0]
    plan = published_layouts.zero3_plan(row)
    items = [i for i in traffic.predict(plan.config, plan.layout, 0, "bf16")
             if i.dimension == "fsdp"]
    params = parameter_counts(plan.config.model, plan.config.moe).total
    assert sum(i.bus_bytes for i in items) == pytest.approx(8 * params * (row.gpus - 1) / row.gpus, rel=1e-2)
    assert {i.collective for i in items} == {"all_gather", "reduce_scatter"}


def test_the_network_and_overlap_figures_are_table_2s_calibration():
    """The constants the estimate uses are what the calibration from the published rows gives (to 2 digits)."""
    assert round(published_layouts.calibrated_network_efficiency(), 2) == gpu_presets.NETWORK_EFFICIENCY
    assert round(published_layouts.calibrated_overlap_slowdown(), 2) == gpu_presets.OVERLAP_SLOWDOWN


def test_zero3_estimates_follow_table_2_within_15_percent_and_the_traffic_bound_rows_do_not_speed_up():
    """A fit of 2 figures to 6 rows: each estimate within 15%, and, as measured, the step no shorter at twice
    the GPUs once traffic bounds it (the compute halves, the traffic per GPU stays)."""
    plans = {(r.name, r.gpus): published_layouts.zero3_plan(r) for r in published_layouts.TABLE2}
    for row in published_layouts.TABLE2:
        estimate = paper_flops(row) / (plans[row.name, row.gpus].step * row.gpus) / 1e12
        assert estimate == pytest.approx(row.tflops, rel=0.15)
    assert plans["175", 1536].step >= plans["175", 768].step
    assert plans["530", 2240].step >= plans["530", 1120].step
    assert plans["175", 768].compute == pytest.approx(plans["175", 1536].compute * 2, rel=1e-3)


@pytest.mark.parametrize("held_out", ["175", "530"])
def test_calibrated_on_one_models_rows_the_estimate_predicts_the_others_within_16_percent(held_out):
    """Out of sample: both figures calibrated from one model's three rows of Table 2 alone, the other model's
    three estimates are within 16% of their published TFLOP/s (measured: 175B from 530B's rows −4%, +15%, +12%;
    530B from 175B's +4%, −11%, −13%)."""
    seen = [r for r in published_layouts.TABLE2 if r.name != held_out]
    network = dataclasses.replace(A100, network_efficiency=published_layouts.calibrated_network_efficiency(seen))
    hardware = dataclasses.replace(network, overlap_slowdown=published_layouts.calibrated_overlap_slowdown(
        seen, network))
    for row in published_layouts.TABLE2:
        if row.name == held_out:
            estimate = paper_flops(row) / (published_layouts.zero3_plan(row, hardware).step * row.gpus) / 1e12
            assert estimate == pytest.approx(row.tflops, rel=0.16)
