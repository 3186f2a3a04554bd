"""``train.py --dry-run``: every rank's model built on meta at full size, its shards against the memory model.

The built side counts the elements of each rank's local parameter shards after the real construction
(``parallel.build.build_model``: pipeline cut, tp, ep/etp, FSDP2); the predicted side is the memory model's
arithmetic (``analysis.memory_states``), written separately. They must agree exactly for each stage's
largest rank, and every rank's shards must sum to the whole model as many times as the layout replicates it.
"""

from __future__ import annotations

import math

import pytest
import torch

import train
from analysis.dry_run import RankStates, built_states, dry_run, extreme_ranks
from analysis.memory import GIB
from analysis.memory_states import parameter_tensors, tp_local_shape
from analysis.planner import plan
from config.errors import ConfigError
from config.run import load_config
from parallel.resolve import resolve_layout

MODEL = ["model.d_model=96", "model.n_layers=4", "model.n_heads=6", "model.n_kv_heads=2", "model.seq_len=64",
         "model.ffn_hidden=160", "model.vocab_size=1000", "moe.num_experts=6", "moe.expert_hidden=80",
         "moe.num_shared_experts=1", "train.global_batch_size=24", "model.tie_embeddings=false"]
LAYOUTS = [  # 12 ranks: uneven FSDP shards (96 / 12, 1000 / 6, 6 experts over 4 replicas...) on purpose
    ["parallel.dp_shard=12"],
    ["parallel.dp_shard=6", "parallel.tp=2", "parallel.ep=3"],
    ["parallel.pp=2", "parallel.dp_shard=3", "parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=true"],
    ["parallel.dp_replicate=2", "parallel.dp_shard=3", "parallel.tp=2", "parallel.ep=6", "parallel.etp=1"],
    ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2",
     "parallel.dp_shard=6", "parallel.microbatches=2", "train.micro_batch_size=null"],
    # Muon's one momentum buffer for the matrices it updates (not the experts' [E, width] biases), AdamW's two
    # moments for the rest
    ["parallel.pp=2", "parallel.dp_shard=6", "parallel.ep=2", "train.optimizer=muon", "moe.expert_proj_bias=true"],
    # context parallelism: FSDP over dp_replicate × (dp_shard × cp), the experts folded over dp_shard × cp × tp
    ["parallel.dp_replicate=3", "parallel.cp=2", "parallel.tp=2", "parallel.ep=2", "parallel.dp_shard=1",
     "moe.capacity_factor=null"],
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: "x".join(o.split(".")[1] for o in layout[:4]))
def test_each_stages_largest_rank_is_the_memory_models_prediction(layout):
    config = load_config("moe-8x", [*MODEL, *layout, "train.precision=fp32"])
    built, estimates = dry_run(config, resolve_layout(config, 12), "fp32", every_rank=True)
    assert [s.rank for s in built] == list(range(12))
    for pp_rank, predicted in enumerate(estimates):
        stage = [s for s in built if s.pp_rank == pp_rank]
        assert max(s.total for s in stage) == predicted.states.total
        # the first and last rank of a stage bound the others (what the default dry run builds)
        assert {min(s.total for s in stage), max(s.total for s in stage)} == {
            s.total for s in stage if s.rank in extreme_ranks(resolve_layout(config, 12)[0])}
    # all ranks' shards together hold each parameter as often as the layout replicates it: once per
    # dp_replicate group, and once per tp rank if tp does not split it (norms, router, unsplit embedding)
    lay = resolve_layout(config, 12)[0]
    params = parameter_tensors(config.model, config.moe)
    dense = sum(math.prod(tp_local_shape(p, lay, config.parallel.vocab_parallel)) * lay.tp
                for p in params if not p.expert)
    experts = sum(math.prod(p.shape) for p in params if p.expert)  # ep · etp · edp = dp_shard · tp: one copy
    assert sum(s.weights_dense for s in built) == 4 * dense * lay.dp_replicate
    assert sum(s.weights_experts for s in built) == 4 * experts * lay.dp_replicate


def test_nothing_is_allocated_and_an_impossible_layout_fails_as_a_real_run_does(capsys):
    config = load_config("moe-8x", [*MODEL, "parallel.dp_shard=4", "parallel.ep=2"])
    layout, micro, microbatches = resolve_layout(config, 4)
    states = built_states(config, layout, 3, micro, microbatches)
    assert isinstance(states, RankStates) and states.weights > 0
    assert not torch.distributed.is_initialized()  # the fake group is gone again
    bad = [*MODEL, "parallel.tp=4"]  # 6 heads do not split over 4 ranks
    assert train.main(["--dry-run", "--world-size", "8", "--set", *bad]) == 2
    dry = capsys.readouterr().err
    with pytest.raises(ConfigError) as real:
        resolve_layout(load_config("moe-8x", bad), 8)
    assert dry.strip() == f"error: {real.value}"
    assert train.main(["--world-size", "8", "--set", *MODEL]) == 2  # --world-size plans dry runs only
    assert "--world-size plans a --dry-run" in capsys.readouterr().err


def test_the_cli_prints_built_beside_predicted(capsys):
    assert train.main(["--dry-run", "--world-size", "8", "--set", *MODEL, "parallel.dp_shard=4",
                       "parallel.ep=2", "parallel.pp=2"]) == 0
    out = capsys.readouterr().out
    assert "ranks 0,3,4,7 built on the meta device" in out
    assert "each stage's largest rank equals the memory model's prediction" in out


def test_the_planners_top_layouts_build_and_match_the_memory_model():
    """Every layout the planner ranks is one train.py accepts; its first ones build, shard for shard as predicted."""
    config = load_config("moe-8x", [*MODEL, "train.precision=bf16", "train.global_batch_size=16"])
    plans, _ = plan(config, 8, 80 * GIB)
    assert len(plans) >= 5
    for candidate in plans[:5]:
        built, estimates = dry_run(candidate.config, resolve_layout(candidate.config, 8), "bf16")
        for predicted in estimates:
            assert max(s.total for s in built if s.pp_rank == predicted.pp_rank) == predicted.states.total


def test_the_dry_run_ends_with_a_verdict_against_a_gpu_and_its_headroom(capsys):
    layout = [*MODEL, "parallel.dp_shard=4", "parallel.ep=2"]
    assert train.main(["--dry-run", "--world-size", "4", "--set", *layout]) == 0
    out = capsys.readouterr().out
    worst = max(e.total for e in dry_run(load_config("moe-8x", layout), resolve_layout(load_config("moe-8x", layout),
                                                                                     4), "bf16")[1])
    assert (f"verdict: the busiest rank's predicted step total, {worst / GIB:.2f} GiB, fits in the 72.0 GiB usable "
            "of 80 GiB (H100 SXM5") in out
    tiny = 0.9 * worst / GIB  # fits the device, not the device less 10%
    assert train.main(["--dry-run", "--world-size", "4", "--device-memory", str(tiny), "--set", *layout]) == 0
    out = capsys.readouterr().out
    assert "does NOT fit in the" in out and "python -m analysis.planner --config moe-8x --world-size 4" in out
    assert train.main(["--dry-run", "--world-size", "4", "--gpu", "a100-40gb", "--set", *layout]) == 0
    assert "36.0 GiB usable of 40 GiB (A100 SXM4 40GB" in capsys.readouterr().out
    for argv, message in [(["--gpu", "h100"], "--gpu sets the --dry-run's memory verdict"),
                          (["--dry-run", "--world-size", "4", "--headroom", "-0.1"],
                           "--headroom must be a fraction in [0, 1)"),
                          (["--dry-run", "--world-size", "4", "--device-memory", "0"],
                           "--device-memory must be a positive number")]:
        assert train.main([*argv, "--set", *layout]) == 2
        assert message in capsys.readouterr().err


GPT_OSS = ["model.qkv_bias=true", "model.attn_output_bias=true", "model.attention_sinks=true",
           "model.sliding_window=16", "moe.activation=clamped_swiglu", "moe.router_bias=true",
           "moe.expert_proj_bias=true", "moe.num_shared_experts=0"]


def test_gpt_oss_options_are_the_memory_models_prediction():
    """GPT-OSS's biases and sinks built under tp=2 × ep=3 (the sinks and q/k/v biases split with their heads, wo's
    whole, the experts' sharded with them): each stage's largest rank holds what the memory model predicts (the
    down projection's bias, which has no hidden dim, once crashed it); etp=2 with expert biases is refused
    when the layout is resolved, before any work, naming the key."""
    config = load_config("moe-8x", [*MODEL, *GPT_OSS, "parallel.dp_shard=6", "parallel.tp=2", "parallel.ep=3",
                                    "train.precision=fp32"])
    built, estimates = dry_run(config, resolve_layout(config, 12), "fp32")
    assert max(s.total for s in built) == estimates[0].states.total
    config = load_config("moe-8x", [*MODEL, *GPT_OSS, "parallel.dp_shard=6", "parallel.tp=2", "parallel.ep=2",
                                    "parallel.etp=2"])
    with pytest.raises(ConfigError, match="parallel.etp=2 with moe.expert_proj_bias"):
        resolve_layout(config, 12)


HYBRID = ["model.layer_types=[linear_attention,linear_attention,linear_attention,full_attention]",
          "model.linear_key_heads=2", "model.linear_value_heads=4", "model.linear_key_head_dim=8",
          "model.linear_value_head_dim=8", "model.attn_output_gate=true", "model.qk_norm=true",
          "moe.shared_expert_gate=true"]


def test_hybrid_linear_attention_is_the_memory_models_prediction():
    """Qwen3-Next's shape (Gated DeltaNet layers, gated attention, a gated shared expert) built under pp=2 ×
    FSDP 3 × tp=2 × ep=2 (the convolution and decay split with the linear heads): each stage's largest rank holds
    what the memory model predicts."""
    config = load_config("moe-8x", [*MODEL, *HYBRID, "parallel.pp=2", "parallel.dp_shard=3", "parallel.tp=2",
                                    "parallel.ep=2", "train.precision=fp32"])
    built, estimates = dry_run(config, resolve_layout(config, 12), "fp32")
    for pp_rank, predicted in enumerate(estimates):
        assert max(s.total for s in built if s.pp_rank == pp_rank) == predicted.states.total
