"""The layout planner: its step-time terms against hand arithmetic, and its plans against the memory model."""

from __future__ import annotations

import dataclasses
import shlex

import pytest

import train
from analysis import (
    gpu_presets,
    layout_search,
    link_time,
    memory,
    planner,
    replica_time,
    step_time,
    traffic,
    traffic_items,
)
from config.errors import ConfigError
from config.run import load_config
from moe.accounting import (
    block_flops_per_token,
    head_flops_per_token,
    mtp_flops_per_token,
    training_flops_per_token,
)
from parallel.layout import Layout
from parallel.pipeline import stage_layers
from parallel.resolve import resolve_layout

H100 = gpu_presets.HARDWARE["h100"]
SMALL = ["model.d_model=64", "model.n_layers=4", "model.n_heads=4", "model.seq_len=64", "model.ffn_hidden=128",
         "moe.num_experts=4", "moe.expert_hidden=64", "train.global_batch_size=16", "train.precision=bf16"]


def _bandwidth_only(hardware: gpu_presets.Hardware) -> gpu_presets.Hardware:
    """The preset without latency: its traffic's time is then its bytes over the links' bandwidth."""
    return dataclasses.replace(hardware, latency=gpu_presets.Latency(0.0, 0.0, 0.0))


def _config(layout: Layout, recompute: str = "none", overrides: list[str] = SMALL):
    return layout_search.with_layout(load_config("moe-8x", overrides), layout, recompute)


@pytest.mark.parametrize("degrees", [dict(dp_shard=8), dict(dp_shard=4, tp=2), dict(dp_shard=2, tp=4, ep=4),
                                     dict(dp_replicate=2, dp_shard=2, tp=2, ep=2), dict(dp_shard=4, cp=2),
                                     dict(dp_shard=1, cp=4, tp=2, ep=2)])
def test_compute_without_pipeline_is_the_models_flops_spread_over_every_rank(degrees):
    layout = Layout.resolve(8, **degrees)
    config = _config(layout)
    tokens = config.train.global_batch_size * config.model.seq_len
    total = training_flops_per_token(config.model, config.moe) * tokens
    assert step_time.compute_seconds(config, layout, peak=1.0) * layout.world_size == pytest.approx(total, rel=1e-12)


def test_recompute_adds_the_forward_of_the_recomputed_blocks():
    layout = Layout.resolve(1)
    model, moe = _config(layout).model, _config(layout).moe
    blocks = [block_flops_per_token(model, moe, model.layer(i)) for i in range(model.n_layers)]
    head = head_flops_per_token(model)
    assert step_time.stage_flops_per_token(_config(layout), layout) == [pytest.approx(sum(blocks) + head)]
    full = step_time.stage_flops_per_token(_config(layout, "full"), layout)
    assert full == [pytest.approx(sum(blocks) * 4 / 3 + head)]
    moe_only = step_time.stage_flops_per_token(_config(layout, "moe"), layout)
    moe_blocks = sum(b for i, b in enumerate(blocks) if model.is_moe_layer(i))
    assert moe_only == [pytest.approx(sum(blocks) + moe_blocks / 3 + head)]


def test_pipeline_compute_is_the_busiest_stage_and_the_bubble_is_p_minus_1_over_m():
    layout = Layout.resolve(8, pp=2, dp_shard=4)
    config = _config(layout)
    stages = step_time.stage_flops_per_token(config, layout)
    assert len(stages) == 2 and sum(stages) == pytest.approx(training_flops_per_token(config.model, config.moe))
    tokens = config.train.global_batch_size * config.model.seq_len / layout.dp
    compute = step_time.compute_seconds(config, layout, peak=1.0)
    assert compute == pytest.approx(max(stages) * tokens)
    assert step_time.bubble_seconds(compute, layout, microbatches=4) == pytest.approx(compute * 1 / 4)


def test_multi_token_prediction_weighs_on_the_last_stage_and_its_embedding_copy_on_the_pipeline():
    """The MTP module (a block, its projection and the head again) is computed on the last stage, which the split
    gives fewer blocks for it; the whole pipeline still computes the model's training FLOPs. Its embedding copy's
    gradient all-reduce over the pipeline's ends adds to the exposed pp time, and the planner ranks such a model
    instead of refusing it."""
    layout = Layout.resolve(8, pp=2, dp_shard=4)
    plain, mtp = _config(layout), _config(layout, overrides=[*SMALL, "model.mtp_depth=1"])
    model, moe = mtp.model, mtp.moe
    last = stage_layers(model, moe, 2)[1]
    assert len(last) < len(stage_layers(plain.model, plain.moe, 2)[1])
    with_mtp = step_time.stage_flops_per_token(mtp, layout)
    assert sum(with_mtp) == pytest.approx(training_flops_per_token(model, moe))
    blocks = sum(block_flops_per_token(model, moe, model.layer(i)) for i in last)
    assert with_mtp[1] == pytest.approx(blocks + head_flops_per_token(model) + mtp_flops_per_token(model, moe))
    pp_time = [step_time.exposed_communication(config, layout, 0.0, _bandwidth_only(H100), gpus_per_node=8)["pp"]
               for config in (plain, mtp)]
    assert pp_time[1] > pp_time[0]
    found = layout_search.search(load_config("moe-8x", [*SMALL, "model.mtp_depth=1"]), 8, 80 * planner.GIB, top=1)
    assert found.plans


def test_tensor_parallel_across_nodes_waits_for_the_network():
    """The same tp=4 layout, its tp group inside one node of 8 or spread over nodes of 2: its rings (all-gathers,
    reduce-scatters, all-reduces) then run over each rank's own adapter, (0.8 · 450) / (0.92 · 50) GB/s slower
    (bandwidth alone: the latency term is tested on its own below)."""
    layout = Layout.resolve(8, dp_shard=2, tp=4)
    config = _config(layout)
    inside = step_time.exposed_communication(config, layout, 0.0, _bandwidth_only(H100), gpus_per_node=8)
    across = step_time.exposed_communication(config, layout, 0.0, _bandwidth_only(H100), gpus_per_node=2)
    assert inside["tp"] > 0
    assert across["tp"] == pytest.approx(inside["tp"] * (0.8 * 450) / (0.92 * 50))


def test_link_bandwidth_is_nccls_share_of_nvlink_or_of_the_ranks_own_adapter():
    """80% of NVLink's line rate (NCCL's protocol overhead); across nodes every collective, rings with several
    ranks per node included, gets 92% of the rank's own adapter (calibrated from Narayanan et al. 2021 Table 2)."""
    def item(collective, group):
        return traffic_items.Traffic("dp", collective, "", 1, 10**9, tuple(group))
    assert link_time.bandwidth(item("all_reduce", range(8)), H100, 8) == pytest.approx(0.8 * 450e9)
    for collective, group in (("all_reduce", range(0, 64, 8)), ("all_gather", range(0, 64, 2)),
                              ("reduce_scatter", range(64)), ("all_to_all", range(64))):
        assert link_time.bandwidth(item(collective, group), H100, 8) == pytest.approx(0.92 * 50e9)
    a100 = gpu_presets.HARDWARE["a100-80gb"]
    assert link_time.bandwidth(item("all_gather", range(64)), a100, 8) == pytest.approx(0.92 * 25e9)
    # a send across nodes: one call and one network step of NCCL's latency, then its bytes
    assert link_time.seconds(item("send", (0, 8)), H100, 8) == pytest.approx(8.4e-6 + 9.6e-6 + 1e9 / (0.92 * 50e9))


def test_the_presets_precision_sets_the_bytes_its_traffic_carries():
    """A preset that trains in fp32 (the CPU's) prices the traffic ``traffic.predict`` counts in fp32."""
    layout = Layout.resolve(8, dp_shard=4, tp=2)
    config = _config(layout)
    fp32 = dataclasses.replace(_bandwidth_only(H100), precision="fp32")
    for hardware in (_bandwidth_only(H100), fp32):
        items = traffic.predict(config, layout, 0, hardware.precision)
        tp = sum(i.bus_bytes for i in items if i.dimension == "tp") / (0.8 * H100.intra_node)
        assert step_time.exposed_communication(config, layout, 0.0, hardware, 8)["tp"] == pytest.approx(tp)
    assert (step_time.exposed_communication(config, layout, 0.0, fp32, 8)["tp"]
            > step_time.exposed_communication(config, layout, 0.0, _bandwidth_only(H100), 8)["tp"])


def test_collective_latency_is_nccls_ring_model_per_call():
    """NCCL's tuning model (Ring, Simple): 8.4 us per call, 3.4 us per ring step on NVLink, 9.6 us per step that
    crosses nodes; an all-reduce of n ranks on k nodes runs 2(n − 1) steps, 2(k − 1) of them across; an
    all-to-all's exchanges with its peers are posted together (one step)."""
    def item(collective, group, calls=3):
        return traffic_items.Traffic("dp", collective, "", calls, 0, tuple(group))
    us = 1e-6
    assert link_time.startup(item("all_reduce", range(16)), H100, 8) == pytest.approx(
        3 * (8.4 + 28 * 3.4 + 2 * 9.6) * us)
    assert link_time.startup(item("all_gather", range(8)), H100, 8) == pytest.approx(3 * (8.4 + 7 * 3.4) * us)
    assert link_time.startup(item("reduce_scatter", range(0, 32, 8)), H100, 8) == pytest.approx(
        3 * (8.4 + 3 * 9.6) * us)
    # an all-to-all waits for its 7 peers together: one step, across nodes when some peer is in another node
    assert link_time.startup(item("all_to_all", range(8)), H100, 4) == pytest.approx(3 * (8.4 + 9.6) * us)
    assert link_time.startup(item("all_to_all", range(8)), H100, 8) == pytest.approx(3 * (8.4 + 3.4) * us)
    assert link_time.startup(item("send", (0, 1), calls=1), H100, 8) == pytest.approx((8.4 + 3.4) * us)


def _fsdp_item(collective, calls, what=""):
    return traffic_items.Traffic("fsdp", collective, what, calls, 0, tuple(range(8)))


def test_sharding_time_splits_the_ends_the_last_backward_and_the_rest_by_hand():
    """The first gather and the last reduction (one call each of the largest) never overlap; under
    ``grad_reduce=step`` every reduce-scatter and HSDP all-reduce is in the last backward; under ``microbatch``
    1 of m rounds; the gathers are the rest."""
    timed = [(_fsdp_item("all_gather", 8), 8.0), (_fsdp_item("all_gather", 2), 1.0),  # 1 s and 0.5 s per call
             (_fsdp_item("reduce_scatter", 4), 6.0), (_fsdp_item("all_reduce", 2), 1.0)]  # 1.5 s and 0.5 s
    step = step_time.sharding_time(timed, "step", 2)
    assert (step.ends, step.last, step.rest) == pytest.approx((1.0 + 1.5 + 0.5, 6.0 + 1.0 - 2.0, 9.0 - 1.0))
    microbatch = step_time.sharding_time(timed, "microbatch", 2)
    assert (microbatch.ends, microbatch.last, microbatch.rest) == pytest.approx((3.0, 3.0 + 1.0 - 2.0, 16 - 4 - 1))


def test_overlapped_traffic_shows_beyond_the_compute_or_as_the_compute_it_slows():
    """Traffic O beside compute C that runs σ slower meanwhile: max(O, C + σ·O) in all, plus the ends, plus what
    of the last backward's reductions the last micro-batch's backward (2/3 of C/m) does not hide."""
    parts = step_time.ShardingTime(ends=1.0, last=2.0, rest=6.0)
    # compute-bound: C = 30 over 2 micro-batches; the last backward (10 s) hides all 2 s; O = 8
    assert parts.exposed(30.0, 2, 0.25) == pytest.approx(1.0 + 0.25 * 8)
    assert parts.exposed(30.0, 2, 0.0) == pytest.approx(1.0)
    # traffic-bound: C = 6, the last backward hides 2 of 2 s, O = 8 > C: O − C shows (above σ·O = 2)
    assert parts.exposed(6.0, 1, 0.25) == pytest.approx(1.0 + 8 - 6)
    # C = 1.5: the last backward hides 1 of its 2 s, 1 s follows the compute; O = 7
    assert parts.exposed(1.5, 1, 0.25) == pytest.approx(1.0 + 1.0 + 7 - 1.5)
    # the transition: O − C = 1 below σ·O = 2
    assert parts.exposed(7.0, 1, 0.25) == pytest.approx(1.0 + 0.25 * 8)
    assert parts.exposed(0.0, 1, 0.25) == pytest.approx(9.0)  # no compute: all of it


def test_fsdp_traffic_shows_only_beyond_the_compute_it_overlaps():
    layout = Layout.resolve(8, dp_shard=8)
    config = _config(layout)
    timed = [(item, link_time.seconds(item, H100, 8)) for item in traffic.predict(config, layout, 0, "bf16")
             if item.dimension == "fsdp"]
    fsdp = sum(seconds for _, seconds in timed)
    parts = step_time.sharding_time(timed, "step", 1)
    assert fsdp > 0 and parts.ends > 0 and parts.ends + parts.last + parts.rest == pytest.approx(fsdp)
    assert step_time.exposed_communication(config, layout, 0.0, H100, 8)["fsdp"] == pytest.approx(fsdp)
    hidden = parts.last + parts.rest
    assert step_time.exposed_communication(config, layout, 100 * fsdp, H100, 8)["fsdp"] == pytest.approx(
        parts.ends + 0.28 * hidden)
    no_slowdown = dataclasses.replace(H100, overlap_slowdown=0.0)
    assert step_time.exposed_communication(config, layout, 100 * fsdp, no_slowdown, 8)["fsdp"] == pytest.approx(
        parts.ends)
    # ranks sharing CPU cores: no idle core to overlap on, all of it shows
    shared = dataclasses.replace(H100, sharing=2.0)
    assert step_time.exposed_communication(config, layout, 2 * fsdp, shared, 8)["fsdp"] == pytest.approx(fsdp)


def test_the_last_micro_batchs_gradient_reductions_hide_only_behind_its_backward():
    """dp_shard=8 with 2 micro-batches: under grad_reduce=step the one reduce-scatter per unit runs in the last
    micro-batch's backward (2/3 of half the compute); under microbatch only the last of its two rounds does.
    Without slowdown: the ends, what of the last backward's reductions it does not hide, and the rest beyond
    the compute left."""
    layout = Layout.resolve(8, dp_shard=8)
    hardware = dataclasses.replace(H100, overlap_slowdown=0.0)
    for grad_reduce in ("step", "microbatch"):
        config = _config(layout, overrides=[*SMALL, "train.micro_batch_size=1"])
        config = layout_search.with_layout(config, layout, "none", grad_reduce)
        timed = [(i, link_time.seconds(i, H100, 8)) for i in traffic.predict(config, layout, 0, "bf16")
                 if i.dimension == "fsdp"]
        reduces = [(i, s) for i, s in timed if i.collective == "reduce_scatter"]
        gathers = [(i, s) for i, s in timed if i.collective == "all_gather"]
        ends = max(s / i.calls for i, s in gathers) + max(s / i.calls for i, s in reduces)
        last = sum(s for _, s in reduces) / (1 if grad_reduce == "step" else 2) - ends + max(
            s / i.calls for i, s in gathers)
        rest = sum(s for _, s in timed) - ends - last
        compute = 3 * last  # the last backward, compute / 2 * 2 / 3, hides exactly its reductions
        exposed = step_time.exposed_communication(config, layout, compute, hardware, 8, microbatches=2)["fsdp"]
        assert exposed == pytest.approx(ends + max(0.0, rest - (compute - last)))
        exposed = step_time.exposed_communication(config, layout, 1.5 * last, hardware, 8, microbatches=2)["fsdp"]
        assert exposed == pytest.approx(ends + last / 2 + max(0.0, rest - last), rel=1e-9, abs=1e-12)


def test_both_gradient_reduction_settings_are_planned_and_step_trades_memory_for_traffic():
    config = load_config("moe-8x", [*SMALL, "train.micro_batch_size=1"])
    plans, _ = planner.plan(config, 8, device_memory=80 * planner.GIB)
    by_setting = {}
    for p in plans:
        by_setting.setdefault((p.describe().replace(" rs/mb", ""), p.config.parallel.grad_reduce), p)
    pairs = [(step, by_setting[name, "microbatch"]) for (name, reduce), step in by_setting.items()
             if reduce == "step" and (name, "microbatch") in by_setting]
    assert any(step.layout.dp_shard > 1 and step.layout.pp == 1 for step, _ in pairs)
    for step, microbatch in pairs:
        assert step.step <= microbatch.step + 1e-12  # never more traffic in the last backward, m - 1 fewer rounds
        if step.layout.dp_shard > 1 and step.layout.pp == 1:  # (a stage's gathered blocks differ too)
            assert step.memory > microbatch.memory  # unsharded gradients held between micro-batches


def test_plans_fit_are_sorted_and_carry_the_memory_models_figure():
    config = load_config("moe-8x", [*SMALL, "train.micro_batch_size=2"])
    plans, considered = planner.plan(config, 8, device_memory=80 * planner.GIB)
    assert considered >= len(plans) > 10
    assert [p.step for p in plans] == sorted(p.step for p in plans)
    for p in plans[:5]:
        want = max(memory.estimate(p.config, 8, "bf16", r).total for r in range(p.layout.pp))
        assert p.memory == want <= 80 * planner.GIB
    # a device just under the best plan's need leaves that plan out
    tight, _ = planner.plan(config, 8, device_memory=plans[0].memory - 1)
    assert all(p.memory < plans[0].memory for p in tight)


def test_context_parallel_exchange_waits_in_full_and_the_search_weighs_cp_where_train_py_accepts_it():
    """The cp group's key/value gathers, their gradients' reduce-scatters and the balancing counts' all-reduces
    are on the critical path whole (attention waits for its keys, the layer below for their gradients); the search
    plans cp layouts for a dropless model, and none for a capacity-limited one, which train.py refuses with cp."""
    dropless = [*SMALL, "moe.capacity_factor=null"]
    layout = Layout.resolve(8, dp_shard=2, cp=2, tp=2)
    config = _config(layout, overrides=dropless)
    items = [i for i in traffic.predict(config, layout, 0, "bf16") if i.dimension == "cp"]
    assert {i.collective for i in items} == {"all_gather", "reduce_scatter", "all_reduce"}
    exposed = step_time.exposed_communication(config, layout, 0.0, _bandwidth_only(H100), 8)
    assert exposed["cp"] == pytest.approx(sum(i.bus_bytes for i in items) / (0.8 * H100.intra_node))
    plans, _ = planner.plan(load_config("moe-8x", dropless), 8, device_memory=80 * planner.GIB)
    assert any(p.layout.cp > 1 for p in plans)
    capped, _ = planner.plan(load_config("moe-8x", SMALL), 8, device_memory=80 * planner.GIB)
    assert capped and all(p.layout.cp == 1 for p in capped)


def test_mixtral_does_not_fit_on_eight_80_gib_gpus():
    """46.7B parameters × 16 bytes of model state / 8 GPUs = 93 GB > 80 GiB (86 GB), whatever the layout."""
    config = load_config("mixtral-8x7b", ["train.micro_batch_size=1"])
    found = layout_search.search(config, 8, device_memory=80 * planner.GIB)
    assert found.considered > 0 and found.plans == [] and found.complete
    # the closest miss is the least memory of all candidates, as the memory model counts it
    candidate, need = found.closest
    assert need == min(layout_search.memory_bytes(c.config, c.layout)[0]
                       for c in layout_search.candidates(config, 8, H100, step_time.EFFICIENCY))
    assert need > 46.7e9 * 16 / 8
    text = planner.format_plans(config, found, 8, 80 * planner.GIB, H100, 0.5, 10)
    described = layout_search.evaluate(candidate.config, candidate.layout, H100, 8, 0.5, need).describe()
    assert f"none fits: the closest, {described}, " in text
    assert f"needs {need / planner.GIB:.1f} GiB per GPU, {need / planner.GIB - 80:.1f} GiB more than 80 GiB" in text


def test_cli_prints_the_ranking_and_refuses_bad_arguments(capsys):
    assert planner.main(["--config", "moe-8x", "--world-size", "4", "--top", "3", "--set", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "candidate settings" in out and out.count("\n") >= 6
    assert planner.main(["--world-size", "4", "--efficiency", "0"]) == 2
    assert "--efficiency must be in (0, 1]" in capsys.readouterr().err
    assert planner.main(["--world-size", "4", "--imbalance", "0.9"]) == 2
    assert "--imbalance must be at least 1" in capsys.readouterr().err


def test_hardware_presets_and_overrides_reach_the_estimate():
    """Each preset names its source; H800's NVLink (200 GB/s a direction against H100's 450) stretches the same
    tp traffic by 450/200; B200's peak shortens compute by 2250/989; overrides replace one figure, bad ones refused."""
    assert set(gpu_presets.HARDWARE) == {"a100-40gb", "a100-80gb", "h100", "h800", "h200", "b200"}
    assert all(h.source and h.memory_gib > 0 and h.gpus_per_node == 8 for h in gpu_presets.HARDWARE.values())
    layout = Layout.resolve(8, dp_shard=2, tp=4)
    config = _config(layout)
    h800 = _bandwidth_only(gpu_presets.HARDWARE["h800"])
    on_h100 = step_time.exposed_communication(config, layout, 0.0, _bandwidth_only(H100), gpus_per_node=8)["tp"]
    on_h800 = step_time.exposed_communication(config, layout, 0.0, h800, gpus_per_node=8)["tp"]
    assert on_h800 == pytest.approx(on_h100 * 450 / 200)
    b200 = gpu_presets.HARDWARE["b200"]
    assert (step_time.compute_seconds(config, layout, H100.bf16_flops)
            == pytest.approx(step_time.compute_seconds(config, layout, b200.bf16_flops) * 2250 / 989))
    custom = gpu_presets.hardware_with("h100", nvlink_gbps=100, memory_gib=40)
    assert (custom.intra_node, custom.memory_gib, custom.inter_node) == (100e9, 40, H100.inter_node)
    with pytest.raises(ConfigError, match="--gpu 'v100' is not a preset"):
        gpu_presets.hardware_with("v100")
    with pytest.raises(ConfigError, match="--peak-tflops must be a positive number of TFLOP/s, got -1"):
        gpu_presets.hardware_with("h100", peak_tflops=-1)


def test_the_cli_plans_for_a_preset_and_its_memory(capsys):
    args = ["--config", "moe-8x", "--world-size", "8", "--set", *SMALL, "--top", "1"]
    assert planner.main([*args, "--gpu", "a100-40gb"]) == 0
    assert "8 × A100 SXM4 40GB, NVLink 3, HDR InfiniBand, 40 GiB each" in capsys.readouterr().out
    assert planner.main([*args, "--gpu", "h200", "--device-memory", "100"]) == 0
    assert "H200 SXM, NVLink 4, NDR InfiniBand, 100 GiB each" in capsys.readouterr().out
    assert planner.main([*args, "--network-gbps", "nan"]) == 2
    assert "--network-gbps must be a positive number of GB/s, got nan" in capsys.readouterr().err


def test_ranks_sharing_cores_fill_the_bubble_until_the_critical_path_at_the_unshared_rate_is_longer():
    """pp=4, 8 micro-batches: bubble 3/8 of the compute. Ranks at half their rate alone (sharing 2) finish the
    critical path, 1.375 × compute / 2, within the shared compute: no bubble; at sharing 1.25 it is 1.1 × compute,
    0.1 × compute longer."""
    layout = Layout.resolve(8, pp=4, dp_shard=2)
    assert step_time.bubble_seconds(8.0, layout, microbatches=8) == pytest.approx(3.0)
    assert step_time.bubble_seconds(8.0, layout, microbatches=8, sharing=2.0) == 0.0
    assert step_time.bubble_seconds(8.0, layout, microbatches=8, sharing=1.25) == pytest.approx(0.8)


def test_ranks_sharing_cores_take_the_mean_stage_s_work_not_the_busiest_s():
    """moe-8x on pp=4: one block per rank, the head on the last. Sharing cores, the ranks finish their total
    work at the shared rate: the mean rank's time, (3 blocks + (block + head)) / 4 of the busiest's. Not on GPUs,
    and not without pipelining. The bubble's critical path is still the busiest rank's at the unshared rate."""
    layout = Layout.resolve(4, pp=4)
    config = layout_search.with_layout(load_config("moe-8x", ["train.precision=fp32"]), layout, "none",
                                       schedule=("gpipe", 1), micro_batch_size=4)
    block = block_flops_per_token(config.model, config.moe, config.model.layer(0))
    head = head_flops_per_token(config.model)
    balance = (4 * block + head) / 4 / (block + head)
    assert step_time.shared_balance(config, layout, sharing=2.0) == pytest.approx(balance)
    assert step_time.shared_balance(config, layout, sharing=1.0) == 1.0
    assert step_time.shared_balance(_config(Layout.resolve(4, dp_shard=4)), Layout.resolve(4, dp_shard=4), 2.0) == 1.0
    cpu = dataclasses.replace(_bandwidth_only(H100), sharing=2.0)
    plan = layout_search.evaluate(config, layout, cpu, 8, efficiency=0.5, memory_total=0)
    busiest = step_time.compute_seconds(config, layout, cpu.bf16_flops * 0.5, cpu.memory_bandwidth)
    assert plan.compute == pytest.approx(busiest * balance)
    # 8 micro-batches, bubble 3/8: the critical path 1.375 × busiest / 2 is within the mean's time: no bubble
    assert plan.bubble == 0.0
    assert step_time.bubble_seconds(busiest * balance, layout, 8, sharing=1.25, balance=balance) == pytest.approx(
        max(0.0, busiest * 1.375 / 1.25 - busiest * balance))


def test_interleaving_divides_the_bubble_by_v_and_each_rank_sums_its_stages():
    """Narayanan et al. 2021 sec. 2.2.2: (p − 1)/(v·m). With pp=2 and v=2 over 4 blocks, rank 0 runs stages 0 and
    2, rank 1 stages 1 and 3 and the head; together every block once."""
    layout = Layout.resolve(8, pp=2, dp_shard=4)
    assert step_time.bubble_seconds(8.0, layout, microbatches=4, virtual_stages=2) == pytest.approx(8.0 / 8)
    config = layout_search.with_layout(load_config("moe-8x", SMALL), layout, "none", schedule=("interleaved_1f1b", 2))
    model, moe = config.model, config.moe
    blocks = [block_flops_per_token(model, moe, model.layer(i)) for i in range(model.n_layers)]
    ranges = stage_layers(model, moe, 4)
    per_rank = step_time.stage_flops_per_token(config, layout)
    assert per_rank[0] == pytest.approx(sum(blocks[i] for s in (0, 2) for i in ranges[s]))
    assert sum(per_rank) == pytest.approx(sum(blocks) + head_flops_per_token(model))


def test_pipelines_are_planned_with_every_schedule_and_dense_models_without_moe_recompute():
    config = load_config("moe-8x", [*SMALL, "train.global_batch_size=32", "train.micro_batch_size=1"])
    plans, _ = planner.plan(config, 8, 80 * 2**30)
    tried = {(p.config.parallel.pp_schedule, p.config.parallel.pp_virtual_stages) for p in plans if p.layout.pp > 1}
    assert {("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2)} <= tried
    assert any("interleaved v=2" in p.describe() for p in plans)
    dense, _ = planner.plan(load_config("dense", [*SMALL[:5], "train.global_batch_size=16"]), 4, 80 * 2**30)
    assert dense and all(p.config.parallel.activation_checkpointing != "moe" for p in dense)


def test_micro_batch_size_is_searched_unless_fixed_and_every_plan_passes_train_pys_checks():
    """Global batch 16 on 8 GPUs: micro-batches of 1 and 2 for dp=8, up to 8 for dp=2; each ranked plan is a
    config ``parallel.resolve.resolve_layout`` accepts with its micro-batch size set. A --set size is kept."""
    config = load_config("moe-8x", SMALL)
    plans, _ = planner.plan(config, 8, 80 * planner.GIB, top=400)
    sizes = {(p.layout.dp, p.config.train.micro_batch_size) for p in plans}
    assert {(8, 1), (8, 2), (2, 8)} <= sizes
    for p in plans:
        layout, micro, _ = resolve_layout(p.config, 8)
        assert layout == p.layout and micro == p.config.train.micro_batch_size
    fixed, _ = planner.plan(load_config("moe-8x", [*SMALL, "train.micro_batch_size=1"]), 8, 80 * planner.GIB, top=50)
    assert {p.config.train.micro_batch_size for p in fixed} == {1}


def test_the_bounded_search_returns_the_same_first_plans_as_the_full_one():
    """Without latency the tiny model's steps are mostly compute, with NCCL's latency mostly latency; either way
    the bound with the traffic floors prunes, and the answer is the full search's, plan for plan, among settings
    with context parallelism (a dropless model: train.py accepts cp)."""
    config = load_config("moe-8x", [*SMALL, "moe.capacity_factor=null"])
    for hardware in (_bandwidth_only(H100), H100):
        full = layout_search.search(config, 8, 80 * planner.GIB, hardware=hardware)
        bounded = layout_search.search(config, 8, 80 * planner.GIB, hardware=hardware, top=5)
        assert full.complete and any(p.layout.cp > 1 for p in full.plans)
        assert not bounded.complete and bounded.evaluated < full.evaluated / 10
        assert [(p.describe(), p.step, p.memory) for p in bounded.plans] == \
            [(p.describe(), p.step, p.memory) for p in full.plans[:5]]


def test_traffic_floors_are_below_the_exposed_traffic_of_every_setting_they_stand_for():
    """``traffic_floor`` under recompute none and ``grad_reduce=step`` is at most the exposed traffic of every
    recompute, reduction and schedule of its layout, micro-batch size and v; at the largest micro-batch size with
    ``every_micro_batch_size``, at most that of every size. Nodes of 4 GPUs put some groups across the network."""
    config = load_config("moe-8x", [*SMALL, "moe.capacity_factor=null", "train.global_batch_size=8"])
    floors, checked = {}, 0
    for c in layout_search.candidates(config, 8, H100, step_time.EFFICIENCY):
        try:
            resolve_layout(c.config, 8)
        except ConfigError:
            continue
        exposed = sum(layout_search.evaluate(c.config, c.layout, H100, 4, step_time.EFFICIENCY, 0).exposed.values())
        for every_size, micro in ((False, c.micro_batch_size), (True, 8 // c.layout.dp)):
            key = (every_size, c.layout, micro, c.schedule[1])
            if key not in floors:
                least = layout_search.with_layout(config, c.layout, "none", "step", c.schedule, micro)
                floors[key] = layout_search.traffic_floor(least, c.layout, H100, 4, every_size)
            assert floors[key] <= exposed * (1 + layout_search.ROUNDING), (c.setting, every_size)
        checked += c.layout.cp > 1 and c.layout.pp > 1
    assert checked > 100


def test_the_micro_batch_of_one_bounds_the_memory_of_larger_ones_where_the_planner_prunes_by_it():
    """What ``smallest_micro_batch`` prunes by, on every setting of 8 GPUs it applies to: the memory model's total
    with micro-batches of one is at most that of the larger size (GPipe, where it fails, is left out)."""
    config = load_config("moe-8x", [*SMALL, "train.global_batch_size=32"])
    pairs = 0
    for c in layout_search.candidates(config, 8, H100, step_time.EFFICIENCY):
        smallest = layout_search.smallest_micro_batch(c)
        if smallest is None:
            continue
        try:
            needs = [layout_search.memory_bytes(x.config, x.layout, resolve_layout(x.config, 8))[0]
                     for x in (smallest, c)]
        except ConfigError:
            continue
        assert needs[0] <= needs[1], c.setting
        pairs += 1
    assert pairs > 100


def test_exposed_communication_is_the_busiest_stages_traffic_though_alike_stages_are_priced_once():
    """pp=4 over nodes of 2 GPUs (every stage's groups sit alike on the nodes): with no compute to hide behind,
    the exposed traffic is the largest per-stage sum of every item's seconds, each stage's first rank counted."""
    config = load_config("moe-8x", [*SMALL, "model.n_layers=8", "train.micro_batch_size=1"])
    for schedule in (("1f1b", 1), ("interleaved_1f1b", 2)):
        layout = Layout.resolve(8, pp=4, dp_shard=2)
        planned = layout_search.with_layout(config, layout, "none", schedule=schedule)
        totals = []
        for stage in range(4):
            items = traffic.predict(planned, layout, stage * 2, "bf16")
            totals.append(sum(link_time.seconds(i, H100, 2) for i in items))
        exposed = step_time.exposed_communication(planned, layout, 0.0, H100, 2, microbatches=8)
        assert sum(exposed.values()) == pytest.approx(max(totals), rel=1e-12)


@pytest.mark.parametrize("query_rank", [None, 10])
def test_latent_attention_gemms_are_its_projections(query_rank):
    """A block's attention matmuls do 2·T FLOPs per weight of its projections (the accounting's count, less the
    latent norms); under tp=2 the per-head projections halve and the latent ones stay whole on each rank."""
    from analysis.step_time import block_gemms
    from moe.attention import LatentAttention

    config = load_config("moe-8x", ["model.d_model=32", "model.n_heads=4", "model.n_kv_heads=null",
                                    f"model.q_lora_rank={query_rank or 'null'}", "model.kv_lora_rank=12",
                                    "model.qk_nope_head_dim=6", "model.qk_rope_head_dim=4", "model.v_head_dim=5",
                                    "model.moe_every=0", "model.ffn_hidden=48"])
    tokens, model = 64, config.model
    layer = model.layer(0)
    attention = block_gemms(config, Layout.resolve(1), tokens, layer)[:-2]  # the dense FFN's two entries last
    weights = sum(p.numel for p in LatentAttention.parameter_tensors(model, 0)) - (query_rank or 0) - model.kv_lora_rank
    assert sum(c * 2 * m * k * n for c, m, k, n in attention) == 2 * tokens * weights
    split = block_gemms(config, Layout.resolve(2, tp=2), tokens, layer)[:-2]
    latent = 32 * (query_rank or 0) + 32 * 16
    per_head = weights - latent
    assert sum(c * 2 * m * k * n for c, m, k, n in split) == 2 * tokens * (latent + per_head // 2)


def test_each_printed_command_dry_runs_unchanged_to_its_plans_layout_and_memory(capsys):
    """The planner's commands are the plans: train.py's part of each, given to --dry-run as printed, resolves the
    plan's layout and predicts the plan's memory; every plan leaves the default 10% of the GPU free."""
    args = ["--config", "moe-8x", "--world-size", "8", "--top", "4", "--set", *SMALL, "train.seed=3"]
    assert planner.main(args) == 0
    out = capsys.readouterr().out
    assert "80 GiB each (72.0 usable: 10% headroom" in out
    config = load_config("moe-8x", [*SMALL, "train.seed=3"])
    found = layout_search.search(config, 8, 0.9 * 80 * planner.GIB, top=4)
    lines = out.splitlines()
    start = lines.index("to run a plan (add --dry-run --world-size N to train.py's part to check it first):") + 1
    commands = [line.split(maxsplit=1)[1] for line in lines[start:start + 4]]
    assert len(found.plans) == 4 and all(p.memory <= 0.9 * 80 * planner.GIB for p in found.plans)
    for plan, command in zip(found.plans, commands, strict=True):
        assert command == planner.launch_command(plan, config, "moe-8x", [*SMALL, "train.seed=3"], 8)
        words = shlex.split(command)
        assert words[:3] == ["torchrun", "--standalone", "--nproc-per-node=8"] and "train.seed=3" in words
        assert train.main([*words[words.index("train.py") + 1:], "--dry-run", "--world-size", "8"]) == 0
        dry = capsys.readouterr().out
        assert f"predicted step total, {plan.memory / planner.GIB:.2f} GiB, fits in the 72.0 GiB usable" in dry
        resolved = resolve_layout(load_config("moe-8x", words[words.index("--set") + 1:]), 8)
        assert resolved.layout == plan.layout


def test_overrides_name_only_what_the_plan_changed_and_nodes_split_the_world():
    config = load_config("moe-8x", SMALL)
    layout = Layout.resolve(8, pp=2, dp_shard=2, tp=2, ep=2)
    plan = layout_search.evaluate(layout_search.with_layout(config, layout, "moe", "microbatch",
                                                            ("interleaved_1f1b", 2), 2),
                                  layout, H100, 8)
    assert planner.plan_overrides(plan, config) == [
        "parallel.pp=2", "parallel.dp_shard=2", "parallel.tp=2", "parallel.ep=2",
        "parallel.activation_checkpointing=moe", "parallel.sequence_parallel=true", "parallel.grad_reduce=microbatch",
        "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2", "train.micro_batch_size=2"]
    assert [step_time.node_shape(w, 8) for w in (8, 64, 4, 12, 7)] == [(1, 8), (8, 8), (1, 4), (2, 6), (1, 7)]


def test_headroom_is_applied_shown_and_checked(capsys):
    args = ["--config", "moe-8x", "--world-size", "8", "--set", *SMALL, "--top", "1"]
    assert planner.main([*args, "--headroom", "0.5"]) == 0
    assert "80 GiB each (40.0 usable: 50% headroom" in capsys.readouterr().out
    assert planner.main([*args, "--headroom", "1"]) == 2
    assert "--headroom must be a fraction in [0, 1), got 1.0" in capsys.readouterr().err
    mixtral = load_config("mixtral-8x7b", ["train.micro_batch_size=1"])
    found = layout_search.search(mixtral, 8, 0.9 * 80 * planner.GIB)
    text = planner.format_plans(mixtral, found, 8, 80 * planner.GIB, H100, 0.5, 10, usable=0.9 * 80 * planner.GIB)
    _, need = found.closest
    assert f"{need / planner.GIB - 72:.1f} GiB more than the 72.0 GiB usable of 80 GiB" in text


def test_muons_gathers_wait_in_full_and_the_search_runs_with_muon():
    """Muon's gathers of the sharded matrices run in the optimizer step, with nothing to hide behind: the planner
    charges their seconds whole (it failed on them before: no "muon" entry), and plans under Muon."""
    layout = Layout.resolve(8, dp_shard=4, tp=2)
    config = _config(layout, overrides=[*SMALL, "train.optimizer=muon"])
    items = [i for i in traffic.predict(config, layout, 0, "bf16") if i.dimension == "muon"]
    assert {i.collective for i in items} == {"all_gather", "reduce_scatter"}
    exposed = step_time.exposed_communication(config, layout, 0.0, _bandwidth_only(H100), 8)
    assert exposed["muon"] == pytest.approx(sum(i.bus_bytes for i in items) / (0.8 * H100.intra_node))
    plans, _ = planner.plan(load_config("moe-8x", [*SMALL, "train.optimizer=muon"]), 8, device_memory=80 * planner.GIB)
    assert plans and any(p.exposed["muon"] > 0 for p in plans)


def test_the_plans_show_their_pipeline_split_and_the_commands_say_what_they_leave_to_fill_in(capsys):
    """Each pipelined plan's layers per stage beside it (the split train.py makes: ``stage_layers``); the
    commands' notes: HOST on several nodes, and the data and --init-from for fine-tuning."""
    args = ["--config", "moe-8x", "--world-size", "16", "--top", "10", "--set", *SMALL, "model.n_layers=6",
            "parallel.pp=4"]
    assert planner.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    config = load_config("moe-8x", [*SMALL, "model.n_layers=6"])
    splits = [line for line in lines if line.split()[1:3] == ["4", "stages:"]]
    assert len(splits) == 10
    assert {tuple(map(int, line.split()[3:])) for line in splits} == {
        tuple(len(r) for r in stage_layers(config.model, config.moe, 4))}
    assert any(line.startswith("HOST: the first node's address") for line in lines)
    assert any(line.startswith("data: these train on data.source=stdlib") and "--init-from hf:DIR" in line
               for line in lines)


def test_equal_steps_go_to_the_more_even_pipeline_split():
    """Two plans of the same estimated step: the one whose stages hold equal numbers of layers ranks first, even
    where it needs more memory and came later in the pool."""
    config = load_config("moe-8x", [*SMALL, "model.n_layers=6"])
    uneven, even = (layout_search.evaluate(layout_search.with_layout(config, Layout.resolve(8, pp=pp), "none"),
                                           Layout.resolve(8, pp=pp), H100, 8) for pp in (4, 2))
    assert layout_search.pipeline_split(even) == [3, 3] and layout_search.split_spread(even) == 0
    assert layout_search.split_spread(uneven) == max(layout_search.pipeline_split(uneven)) - 1 > 0
    tied = dataclasses.replace(even, compute=uneven.compute, bubble=uneven.bubble, exposed=dict(uneven.exposed),
                               memory=uneven.memory + 1)
    assert tied.step == uneven.step
    assert sorted([(uneven, 0), (tied, 1)], key=lambda found: layout_search.ranking(*found))[0][0] is tied


def test_the_planner_chooses_replica_slots_where_their_copies_pay():
    """Under an assumed imbalance (1.3) the planner prices R in {0, 1, 2} (``replica_time.straggler_wait``): over
    NVLink the small experts' copies cost less than the straggler time they save (R=2, in the command, its slots'
    memory counted); on a 1 GB/s link they do not (R=0, the step waits 0.3 of the routed experts' time of every
    MoE layer and micro-batch); balanced routing waits nothing."""
    config = load_config("moe-8x", [*SMALL, "model.seq_len=4096"])
    moe, model = config.moe, config.model

    def first(hardware, imbalance):
        return layout_search.search(config, 4, 80 * planner.GIB, 8, hardware, top=1, fixed={"ep": 4},
                                    imbalance=imbalance).plans[0]

    fast, slow = first(H100, 1.3), first(dataclasses.replace(H100, intra_node=1e9), 1.3)
    assert fast.config.parallel.ep_replicas == 2 and "parallel.ep_replicas=2" in planner.launch_command(
        fast, config, "moe-8x", [], 8)
    assert fast.memory == layout_search.memory_bytes(fast.config, fast.layout)[0] > slow.memory
    assert slow.config.parallel.ep_replicas == 0
    tokens = slow.config.train.micro_batch_size * model.seq_len  # a rank's, per micro-batch (tp = cp = 1)
    expert_s = 6 * 3 * model.d_model * moe.expert_hidden * moe.top_k * tokens / (H100.bf16_flops * step_time.EFFICIENCY)
    microbatches = config.train.global_batch_size // 4 // slow.config.train.micro_batch_size
    assert slow.exposed["imbalance"] == pytest.approx(model.n_moe_layers * microbatches * 0.3 * expert_s)
    assert first(H100, 1.0).exposed["imbalance"] == 0.0


def test_where_the_best_replica_slots_do_not_fit_the_planner_takes_the_best_that_do():
    """R=2 pays best over NVLink (the test above); with memory for R=1's slots but not R=2's the planner falls back
    to R=1, which still pays, rather than to none; with memory for neither, to R=0."""
    config = load_config("moe-8x", [*SMALL, "model.seq_len=4096"])
    layout = Layout(world_size=4, dp_shard=4, ep=4)
    planned = layout_search.with_layout(config, layout, "none")

    def need(replicas):
        slots = dataclasses.replace(planned.parallel, ep_replicas=replicas)
        return layout_search.memory_bytes(dataclasses.replace(planned, parallel=slots), layout)[0]

    def chosen(device_memory, replicas=replica_time.REPLICA_CHOICES):
        return layout_search.evaluate(planned, layout, H100, 8, imbalance=1.3, device_memory=device_memory,
                                      replicas=replicas).config.parallel.ep_replicas

    assert need(0) < need(1) < need(2)
    assert [chosen(None), chosen(need(2)), chosen(need(1)), chosen(need(2) - 1), chosen(need(0))] == [2, 2, 1, 1, 0]
    # --set parallel.ep_replicas=R prices that R alone, 0 included (the figure without replicas)
    assert planner.fixed_replicas(["parallel.ep_replicas=0"]) == (0,) and planner.fixed_replicas([]) == (0, 1, 2)
    assert [chosen(None, (0,)), chosen(None, (1,))] == [0, 1]
