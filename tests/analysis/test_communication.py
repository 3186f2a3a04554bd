"""The communication model against counted bytes: tiny layouts trained on gloo ranks, one step counted.

Each layout trains two steps with ``training.loop.train`` (the code train.py runs) under exactly balanced
routing (``moe.force_balance``); ``CollectiveCounter`` records every collective of the second step on every
rank, and its bus bytes per (collective, group) must equal ``predict``'s for that rank exactly. Collectives
after the forward and backward (gradient norm, loss, optimizer) are counted apart: the model leaves them
out, and they must stay under 2 % of the step's bytes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

import training.loop as loop
import training.step as step
from analysis.collective_count import CollectiveCounter
from analysis.communication import main
from analysis.traffic import predict
from analysis.traffic_activations import kept_per_expert
from analysis.traffic_items import bus_bytes, totals
from config.errors import ConfigError
from config.run import load_config
from moe.accounting import parameter_counts
from parallel.groups import ParallelGroups
from parallel.hardware import PrecisionChoice
from parallel.layout import Layout
from parallel.ranks import axis_view, groups_for
from parallel.resolve import resolve_layout
from parallel.runtime import init_runtime
from tests.parallel.parity import TINY
from tests.spawn import spawn
from training.muon import Muon

BALANCED = [*TINY, "train.steps=2", "moe.force_balance=true"]
DENSE_FIRST = ["model.first_moe_layer=1", "moe.num_shared_experts=1"]  # a dense block, then an MoE block
LATENT = ["model.kv_lora_rank=16", "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=4", "model.v_head_dim=8"]
SPARSE = [*LATENT, "model.q_lora_rank=12", "model.index_topk=8", "model.index_n_heads=4", "model.index_head_dim=8"]
QWEN3_NEXT = ["model.layer_types=[linear_attention,full_attention]", "model.linear_key_heads=2",
              "model.linear_value_heads=4", "model.linear_key_head_dim=8", "model.linear_value_head_dim=8",
              "model.attn_output_gate=true", "model.qk_norm=true", "moe.num_shared_experts=1",
              "moe.shared_expert_gate=true"]
V4_ATTENTION = ["model.n_layers=3", "model.n_kv_heads=null", "model.head_dim=8", "model.rotary_dim=4",
                "model.q_lora_rank=12", "model.sliding_window=8", "model.index_topk=4", "model.index_n_heads=4",
                "model.index_head_dim=8", "model.layer_types=[sliding_attention,heavily_compressed_attention,"
                "compressed_sparse_attention]", "model.compressed_attention.csa_rate=2",
                "model.compressed_attention.hca_rate=4", "model.compressed_attention.o_groups=2",
                "model.compressed_attention.o_lora_rank=8"]
# DeepSeek-V4's residual: 4 hyper-connected streams, a hash-routed layer first
V4_RESIDUAL = ["model.hc_mult=4", "model.mlp_layer_types=[hash_moe,moe,moe]", "moe.score_func=sqrtsoftplus",
               "moe.num_shared_experts=1"]
CASES_2 = {  # name -> overrides, on 2 ranks
    "fsdp, 2 micro-batches": ["parallel.dp_shard=2", "train.micro_batch_size=2"],
    "fsdp, 2 micro-batches, reduce-scatter per micro-batch": ["parallel.dp_shard=2", "train.micro_batch_size=2",
                                                              "parallel.grad_reduce=microbatch"],
    "fsdp, kept gathered after forward": ["parallel.dp_shard=2", "train.micro_batch_size=2",
                                          "parallel.reshard_after_forward=false"],
    "ep=2 over dp_shard=2, bf16": ["parallel.dp_shard=2", "parallel.ep=2", "train.precision=bf16"],
    "tp=2, vocab parallel, full recompute": ["parallel.dp_shard=1", "parallel.tp=2", "parallel.vocab_parallel=true",
                                             "parallel.activation_checkpointing=full", *DENSE_FIRST],
    "tp=2, sequence + vocab parallel": ["parallel.dp_shard=1", "parallel.tp=2", "parallel.sequence_parallel=true",
                                        "parallel.vocab_parallel=true", *DENSE_FIRST],
    "tp=2, sequence parallel, bf16, moe recompute, drops": [
        "parallel.dp_shard=1", "parallel.tp=2", "parallel.sequence_parallel=true", "train.precision=bf16",
        "train.global_batch_size=2",
        "parallel.activation_checkpointing=moe", "moe.capacity_factor=0.5", "moe.num_shared_experts=1"],
    "ep=2 over tp=2": ["parallel.dp_shard=1", "parallel.tp=2", "parallel.ep=2"],
    # replica slots: the counts all-gathered for the plan, the row exchange; balanced routing fills no slot (the
    # copies under skewed routing: tests/parallel/test_expert.py)
    "ep=2 over dp_shard=2, replicas=1": ["parallel.dp_shard=2", "parallel.ep=2", "parallel.ep_replicas=1"],
    "pp=2, 1f1b": ["parallel.dp_shard=1", "parallel.pp=2"],
    "tp=2, 3 experts over edp=2 (FSDP shards dim 1)": ["parallel.dp_shard=1", "parallel.tp=2", "moe.num_experts=3"],
    # latent attention: three small gradient all-reduces in place of the block input's
    "tp=2, latent attention, sequence parallel, bf16": [
        "parallel.dp_shard=1", "parallel.tp=2", "parallel.sequence_parallel=true", "train.precision=bf16",
        *LATENT, "model.q_lora_rank=12", *DENSE_FIRST],
    "tp=2, latent attention, full query, full recompute": [
        "parallel.dp_shard=1", "parallel.tp=2", "parallel.activation_checkpointing=full", *LATENT],
    # sparse attention: the indexer's target summed over tp (again in the recompute), on the gathered kernel (the
    # top 2 of 32 keys: the target over the 2, the latent's gradient summed); under cp its keys gathered
    "tp=2, sparse attention, full recompute": [
        "parallel.dp_shard=1", "parallel.tp=2", "parallel.activation_checkpointing=full", *SPARSE,
        "model.index_topk=2"],
    "cp=2, sparse attention": ["parallel.dp_shard=1", "parallel.cp=2", "moe.capacity_factor=null", *SPARSE],
    # DeepSeek-V4's attention: the query latent's, the shared key/value's and the entries' gradients summed over tp
    "tp=2, DeepSeek-V4 attention, sequence parallel, bf16": [
        "parallel.dp_shard=1", "parallel.tp=2", "parallel.sequence_parallel=true", "train.precision=bf16",
        *V4_ATTENTION],
    # and its CSA indexer trained: its gradients reduce-scattered with the rest under FSDP; under cp the block input
    # gathered per layer (the indexer's keys made from it too)
    "fsdp, DeepSeek-V4 attention": ["parallel.dp_shard=2", *V4_ATTENTION],
    # the whole V4 with sequence parallelism: the hyper-connections on each rank's slice of the streams (their weights'
    # partial gradients made whole with the norms', one all-reduce per step), the MTP module's inputs gathered
    "tp=2, DeepSeek-V4, sequence parallel, MTP, bf16": [
        "parallel.dp_shard=1", "parallel.tp=2", "parallel.sequence_parallel=true", "train.precision=bf16",
        *V4_ATTENTION, *V4_RESIDUAL, "model.mtp_depth=1"],
    "cp=2, DeepSeek-V4 attention": ["parallel.dp_shard=1", "parallel.cp=2", "moe.capacity_factor=null", *V4_ATTENTION],
    # Muon's gathers of the sharded matrices (the optimizer's own section)
    "muon, fsdp with ep=2 (experts whole)": ["parallel.dp_shard=2", "parallel.ep=2", "train.optimizer=muon",
                                             *DENSE_FIRST],
    "muon, tp=2 x etp=2, sequence parallel": ["parallel.dp_shard=1", "parallel.tp=2", "parallel.etp=2",
                                              "parallel.sequence_parallel=true", "train.optimizer=muon"],
    "muon, tp=2, 3 experts over edp=2 (FSDP shards a matrix dim)": [
        "parallel.dp_shard=1", "parallel.tp=2", "moe.num_experts=3", "train.optimizer=muon"],
    # multi-token prediction: its module's block on S - 1 positions (FSDP unit, experts under ep; on the whole
    # sequence under sequence parallelism, its inputs gathered); under pp on the last stage, its embedding copy's
    # gradient summed with the first stage's
    "MTP, ep=2 over dp_shard=2": ["parallel.dp_shard=2", "parallel.ep=2", "model.mtp_depth=1"],
    "MTP, ep=2 over tp=2, sequence parallel": ["parallel.dp_shard=1", "parallel.tp=2", "parallel.ep=2",
                                               "parallel.sequence_parallel=true", "model.mtp_depth=1"],
    "MTP, pp=2": ["parallel.dp_shard=1", "parallel.pp=2", "model.mtp_depth=1"],
    # under vocabulary parallelism each module's head input gradient and loss reduce over tp as the main head's;
    # beside them the main head takes the whole sequence (its input gradient all-reduced, not reduce-scattered)
    "MTP, tp=2, vocab parallel": ["parallel.dp_shard=1", "parallel.tp=2", "parallel.vocab_parallel=true",
                                  "model.mtp_depth=1"],
    "MTP, tp=2, sequence and vocab parallel": ["parallel.dp_shard=1", "parallel.tp=2", "parallel.vocab_parallel=true",
                                               "parallel.sequence_parallel=true", "model.mtp_depth=1"],
    # context parallelism: keys and values gathered per attention layer (again in full recompute), their gradients
    # reduce-scattered, the balancing counts summed per MoE layer, FSDP over dp_shard × cp
    "cp=2, 2 micro-batches, full recompute": ["parallel.dp_shard=1", "parallel.cp=2", "moe.capacity_factor=null",
                                              "train.micro_batch_size=1", "parallel.activation_checkpointing=full"],
    "cp=2, latent attention, bf16, balancing per sequence": [
        "parallel.dp_shard=1", "parallel.cp=2", "moe.capacity_factor=null", *LATENT, "train.precision=bf16",
        "moe.aux_loss_scope=sequence", *DENSE_FIRST],
    # Qwen3-Next's hybrid: Gated DeltaNet split by key heads (its input gradient reduced as any column-parallel
    # input's), gated attention, a gated shared expert; FSDP traffic of the convolution and decay parameters
    "tp=2 x ep=2, sequence parallel, Qwen3-Next": ["parallel.dp_shard=1", "parallel.tp=2", "parallel.ep=2",
                                                   "parallel.sequence_parallel=true", *QWEN3_NEXT],
    "fsdp, Qwen3-Next": ["parallel.dp_shard=2", *QWEN3_NEXT],
    # under cp each linear layer gathers every chunk's state map and last convolution inputs (their gradients
    # reduce-scattered); again in full recompute, the inputs in bf16 and the maps in fp32
    "cp=2, Qwen3-Next": ["parallel.dp_shard=1", "parallel.cp=2", "moe.capacity_factor=null", *QWEN3_NEXT],
    "cp=2, Qwen3-Next, bf16, full recompute": ["parallel.dp_shard=1", "parallel.cp=2", "moe.capacity_factor=null",
                                               "train.precision=bf16", "parallel.activation_checkpointing=full",
                                               *QWEN3_NEXT],
}
HSDP_2MB = ["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.ep=2", "train.micro_batch_size=1"]
EDP_2MB = ["parallel.dp_shard=4", "parallel.ep=2", "train.micro_batch_size=1"]
CP_LATENT = "cp=2 x dp_shard=2, latent attention"  # the cp group apart from FSDP's dp_shard × cp
NODES = "ep=4 over dp_shard=4, 2 nodes of 2, top-3"
CASES_4 = {  # on 4 ranks: groups that differ from one another
    "HSDP 2 x 2, ep=2": ["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.ep=2"],
    # gradient accumulation: 2 micro-batches per rank under both parallel.grad_reduce settings
    "HSDP 2 x 2, ep=2, 2 micro-batches, reduced per step": [*HSDP_2MB, "parallel.grad_reduce=step"],
    "HSDP 2 x 2, ep=2, 2 micro-batches, reduce-scattered per micro-batch": [*HSDP_2MB,
                                                                           "parallel.grad_reduce=microbatch"],
    "ep=2 x edp=2, 2 micro-batches, reduced per step": [*EDP_2MB, "parallel.grad_reduce=step"],
    "ep=2 x edp=2, 2 micro-batches, reduce-scattered per micro-batch": [*EDP_2MB, "parallel.grad_reduce=microbatch"],
    "pp=2 x dp_shard=2, reduce-scattered per micro-batch": ["parallel.dp_shard=2", "parallel.pp=2",
                                                            "parallel.grad_reduce=microbatch"],
    "tp=2, ep=4 over dp_shard=2 x tp, 2 micro-batches": ["parallel.dp_shard=2", "parallel.tp=2", "parallel.ep=4",
                                                         "parallel.sequence_parallel=true", "train.micro_batch_size=2"],
    "pp=2 x dp_shard=2": ["parallel.dp_shard=2", "parallel.pp=2"],
    "pp=2 interleaved, 2 stages per rank, x dp_shard=2": [
        "parallel.dp_shard=2", "parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2",
        "model.n_layers=4", "train.global_batch_size=16", "parallel.microbatches=4"],
    "ep=2 x etp=2 over tp=2 x dp_shard=2, sequence parallel": [
        "parallel.dp_shard=2", "parallel.tp=2", "parallel.etp=2", "parallel.ep=2", "moe.capacity_factor=null",
        "parallel.sequence_parallel=true", "moe.num_shared_experts=1"],
    # FSDP's gradient reduction making each hyper-connection weight's partial gradient whole over tp, one by one
    "tp=2 x dp_shard=2, sequence parallel, DeepSeek-V4's residual": ["parallel.dp_shard=2", "parallel.tp=2",
                                                                     "parallel.sequence_parallel=true", *V4_RESIDUAL,
                                                                     "model.mlp_layer_types=[hash_moe,moe]"],
    "tp=2 x dp_shard=2, Qwen3's query/key norms": ["parallel.dp_shard=2", "parallel.tp=2", "model.qk_norm=true",
                                                    "model.head_dim=16"],
    "etp=2 in tp=2, dp_shard=2, 3 experts": ["parallel.dp_shard=2", "parallel.tp=2", "parallel.etp=2",
                                             "moe.num_experts=3"],
    # Muon's matrices cut by two axes, gathered one after the other: dense ones by dp_shard and tp (column-parallel:
    # FSDP's strided rows; row-parallel: two dims), expert stacks by etp and FSDP over edp (a matrix dim)
    # the last stage's embedding copy looks up on its vocabulary slice; its (split) gradient summed with the first's
    "MTP, pp=2 x tp=2, sequence and vocab parallel": ["parallel.dp_shard=1", "parallel.pp=2", "parallel.tp=2",
                                                      "parallel.vocab_parallel=true", "parallel.sequence_parallel=true",
                                                      "model.mtp_depth=1"],
    "muon, tp=2 x dp_shard=2, etp=2, 3 experts": ["parallel.dp_shard=2", "parallel.tp=2", "parallel.etp=2",
                                                  "moe.num_experts=3", "train.optimizer=muon"],
    # and over FSDP's flattened dp_shard x cp (cp=2, dp_shard=1): the strided rows gathered over cp's ranks first
    "muon, cp=2 x tp=2": ["parallel.dp_shard=1", "parallel.cp=2", "parallel.tp=2", "moe.capacity_factor=null",
                          "train.optimizer=muon"],
    # each tp rank gathers its own key/value heads over cp; ep folds over cp × tp
    CP_LATENT: ["parallel.dp_shard=2", "parallel.cp=2", "moe.capacity_factor=null", *LATENT],
    # the experts' exchange in two hops on 2 simulated nodes of 2: (token, node) rows over {0, 2} and {1, 3}, then
    # (row, rank) rows inside {0, 1} and {2, 3}; top-3 of 4 reaches both nodes and both ranks of one
    NODES: ["parallel.dp_shard=4", "parallel.ep=4", "parallel.ranks_per_node=2", "moe.top_k=3"],
    "cp=2 x tp=2, sequence parallel, ep=2": ["parallel.dp_shard=1", "parallel.cp=2", "parallel.tp=2", "parallel.ep=2",
                                            "parallel.sequence_parallel=true", "moe.capacity_factor=null"],
}


def _key(key: tuple[str, tuple[int, ...]]) -> str:
    return f"{key[0]} over {list(key[1])}"


def _worker(rank: int, world_size: int, cases: dict[str, list[str]], out: str) -> None:
    runtime = init_runtime()
    counters: list[CollectiveCounter] = []
    original_step, original_clip = loop.train_step, step.clip_grad_norm_

    def counted_step(*args, **kwargs):
        counters.append(CollectiveCounter())
        with counters[-1]:
            return original_step(*args, **kwargs)

    def counted_clip(*args, **kwargs):  # from here on: gradient norm, loss and optimizer ("small")
        counters[-1].current = "small"
        return original_clip(*args, **kwargs)

    original_muon_step = Muon._muon

    def counted_muon_step(self, *args, **kwargs):  # Muon's gathers (not its AdamW groups'): a section of their own
        with counters[-1].section("muon"):
            return original_muon_step(self, *args, **kwargs)

    original_precision = loop.choose_precision
    loop.train_step, step.clip_grad_norm_, Muon._muon = counted_step, counted_clip, counted_muon_step
    # train.precision=bf16 on a CPU measures a bf16 matmul for the MFU peak (seconds where bf16 is emulated)
    loop.choose_precision = lambda requested, device: PrecisionChoice(requested, "test", 1.0, "test")
    results = {}
    try:
        for index, (name, overrides) in enumerate(cases.items()):
            config = load_config("moe-8x", [*BALANCED, *overrides])
            layout = Layout.resolve(world_size, **config.parallel.degrees())
            groups = ParallelGroups.build(layout, "cpu")
            started = time.perf_counter()
            loop.train(config, Path(out) / f"run{index}", runtime, groups)
            predicted = predict(config, layout, rank)
            results[name] = {"predicted": {_key(k): v for k, v in totals(
                                 t for t in predicted if t.dimension != "muon").items()},
                             "counted": {_key(k): v for k, v in counters[-1].totals("step").items()},
                             "muon predicted": {_key(k): v for k, v in totals(
                                 t for t in predicted if t.dimension == "muon").items()},
                             "muon counted": {_key(k): v for k, v in counters[-1].totals("muon").items()},
                             "small": sum(sent for _, sent in counters[-1].totals("small").values()),
                             "seconds": time.perf_counter() - started}
    finally:
        loop.train_step, step.clip_grad_norm_, loop.choose_precision = original_step, original_clip, original_precision
        Muon._muon = original_muon_step
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


def _spawn(world_size: int, cases: dict[str, list[str]], tmp_path: Path) -> list[dict]:
    spawn(_worker, world_size, world_size, cases, str(tmp_path))
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(world_size)]


def test_predicted_bytes_equal_counted_bytes_on_two_ranks(tmp_path):
    _check(_spawn(2, CASES_2, tmp_path))


def _check(results: list[dict]) -> None:
    """Every rank's prediction equals its count, per (collective, group); the left-out part is small."""
    wrong = []
    for rank, per_case in enumerate(results):
        for name, result in per_case.items():
            predicted, counted = result["predicted"], result["counted"]
            assert counted, f"{name}: nothing counted on rank {rank}"
            differ = {k: (predicted.get(k), counted.get(k)) for k in predicted.keys() | counted.keys()
                      if predicted.get(k) != counted.get(k)}
            if differ:
                wrong.append(f"{name}, rank {rank}: (predicted, counted) {differ}")
            if result["muon predicted"] != result["muon counted"]:
                wrong.append(f"{name}, rank {rank}: Muon's gathers predicted {result['muon predicted']}, "
                             f"counted {result['muon counted']}")
            if "muon" in name:  # the case exercises the gathers: something to count
                assert result["muon counted"], f"{name}: no Muon gather counted on rank {rank}"
            assert result["small"] < 0.02 * sum(sent for _, sent in counted.values()), f"{name}, rank {rank}"
    assert not wrong, "\n".join(wrong)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> list[dict]:
    """CASES_4 counted on 4 gloo ranks, once for the tests that read them."""
    return _spawn(4, CASES_4, tmp_path_factory.mktemp("four_ranks"))


def test_predicted_bytes_equal_counted_bytes_on_four_ranks(four_ranks):
    _check(four_ranks)


def test_keys_and_values_exchanged_per_layer_are_the_models(four_ranks):
    """Issue 27's counted exchange, against the tensor's own size: on the cp group, which dp_shard=2 keeps apart
    from FSDP's groups, each latent-attention layer all-gathers [micro, S, c + r] fp32 once per micro-batch forward
    and reduce-scatters it once in backward; and the model's cp items are exactly that."""
    config = load_config("moe-8x", [*BALANCED, *CASES_4[CP_LATENT]])
    layout, micro, microbatches = resolve_layout(config, 4)
    model = config.model
    gathered = micro * model.seq_len * (model.kv_lora_rank + model.qk_rope_head_dim) * 4
    calls = model.n_layers * microbatches
    expected = [calls, calls * bus_bytes("all_gather", gathered, layout.cp)]
    for rank, per_case in enumerate(four_ranks):
        cp_group = next(g for g in groups_for(layout, *axis_view("cp")) if rank in g)
        counted = per_case[CP_LATENT]["counted"]
        assert counted[f"all_gather over {cp_group}"] == expected, rank
        assert counted[f"reduce_scatter over {cp_group}"] == expected, rank
        modelled = [t for t in predict(config, layout, rank) if t.dimension == "cp" and t.collective != "all_reduce"]
        assert [[t.calls, t.bus_bytes] for t in modelled] == [expected, expected]


def test_two_hops_move_fewer_bytes_across_nodes_than_one(four_ranks):
    """On 2 nodes of 2 the counted across-node all-to-alls (equal to the model's, above) carry fewer bytes than the
    one-hop exchange over the whole ep group, all of whose all-to-alls the model prices on the network."""
    config = load_config("moe-8x", [*BALANCED, *CASES_4[NODES]])
    layout = resolve_layout(config, 4).layout
    one_hop = load_config("moe-8x", [*BALANCED, *[o for o in CASES_4[NODES] if "ranks_per_node" not in o]])
    for rank, per_case in enumerate(four_ranks):
        inter = [1, 3] if rank % 2 else [0, 2]
        across = per_case[NODES]["counted"][f"all_to_all over {inter}"][1]
        whole = sum(t.bus_bytes for t in predict(one_hop, layout, rank) if t.collective == "all_to_all")
        assert 0 < across < 0.7 * whole, (rank, across, whole)


@pytest.mark.parametrize("case, layout, micro_batch_reduces", [
    ("HSDP 2 x 2, ep=2, 2 micro-batches, reduced per step", Layout.resolve(4, dp_replicate=2, dp_shard=2, ep=2), 1),
    ("HSDP 2 x 2, ep=2, 2 micro-batches, reduce-scattered per micro-batch",
     Layout.resolve(4, dp_replicate=2, dp_shard=2, ep=2), 2),
    ("ep=2 x edp=2, 2 micro-batches, reduced per step", Layout.resolve(4, dp_shard=4, ep=2), 1),
    ("ep=2 x edp=2, 2 micro-batches, reduce-scattered per micro-batch", Layout.resolve(4, dp_shard=4, ep=2), 2),
])
def test_gradients_are_reduced_once_per_optimizer_step(four_ranks, case, layout, micro_batch_reduces):
    """Counted, not predicted: with 2 micro-batches per rank, each FSDP unit reduce-scatters its gradients once
    per step under grad_reduce=step (twice under microbatch), and under HSDP all-reduces them over the replicas
    once under both. The tiny model's units: root and 2 blocks over dp_shard, and the routed experts of its 2
    MoE layers over edp (edp=1 under HSDP here: their reduce-scatter moves nothing and is not counted)."""
    dense_units, expert_units = 3, 2

    def calls(rank: int, collective: str, axis: str) -> int:
        group = next(g for g in groups_for(layout, *axis_view(axis)) if rank in g)
        return four_ranks[rank][case]["counted"].get(_key((collective, tuple(group))), (0, 0))[0]

    for rank in range(4):
        assert calls(rank, "reduce_scatter", "dp_shard") == dense_units * micro_batch_reduces, (case, rank)
        if layout.dp_replicate > 1:
            assert calls(rank, "all_reduce", "dp_replicate") == dense_units + expert_units, (case, rank)
        else:
            assert calls(rank, "reduce_scatter", "edp") == expert_units * micro_batch_reduces, (case, rank)


def test_cli_prints_the_table_and_refuses_impossible_layouts(capsys):
    assert main(["--world-size", "16", "--set", "parallel.tp=2", "parallel.ep=8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = [line.split() for line in lines if line.startswith(("tp ", "ep ", "fsdp "))]
    assert {row[0] for row in table} == {"tp", "ep", "fsdp"}
    # tp (2 ranks) and ep (8 consecutive ranks) stay in a node of 8; FSDP's groups stride over both nodes
    assert all(row[3] == ("inter" if row[0] == "fsdp" else "intra") for row in table), table
    assert main(["--world-size", "6", "--set", "parallel.ep=4"]) == 2
    assert "parallel.ep=4 × parallel.etp=1 does not divide" in capsys.readouterr().err


def test_fsdp_traffic_of_a_real_config_follows_the_parameter_count():
    """moe-8x on 8 FSDP ranks: every shape divides by 8, so per step (one micro-batch) each rank gathers every
    block twice and the root once, and reduce-scatters every gradient once: (n-1)/n of the parameters, in fp32;
    under bf16 the gathers move 2 bytes a parameter but the routers' (fp32 units of their own), the
    reduce-scatters still 4."""
    config = load_config("moe-8x", ["parallel.dp_shard=8", "train.global_batch_size=8"])
    counts = parameter_counts(config.model, config.moe)
    root = 2 * config.model.vocab_size * config.model.d_model + config.model.d_model  # embedding, head, norm
    routers = config.model.n_moe_layers * config.moe.num_experts * config.model.d_model
    for precision, gathered_bytes in (("fp32", 4 * (2 * (counts.total - root) + root)),
                                      ("bf16", 2 * (2 * (counts.total - root - routers) + root) + 4 * 2 * routers)):
        items = [i for i in predict(config, Layout.resolve(8, dp_shard=8), precision=precision)
                 if i.dimension == "fsdp"]
        assert sum(i.bus_bytes for i in items if i.collective == "all_gather") == gathered_bytes * 7 // 8
        assert sum(i.bus_bytes for i in items if i.collective == "reduce_scatter") == 4 * counts.total * 7 // 8
    assert {i.collective for i in predict(config, Layout.resolve(8, dp_shard=8))} == {"all_gather", "reduce_scatter"}


def test_bus_bytes_follow_the_ring_convention():
    assert bus_bytes("all_reduce", 800, 4) == 1200  # 2 (n-1)/n
    assert bus_bytes("all_gather", 800, 4) == bus_bytes("reduce_scatter", 800, 4) == 600  # (n-1)/n
    assert bus_bytes("send", 800, 4) == bus_bytes("broadcast", 800, 4) == 800
    assert bus_bytes("all_reduce", 800, 1) == 0


def test_balanced_routing_keeps_what_capacity_allows():
    config = load_config("moe-8x", [*TINY, "moe.capacity_factor=0.5"])  # 4 experts, top-2
    assert kept_per_expert(config, 10) == [3, 3, 3, 3]  # 5 each routed, capacity ceil(0.5 * 2 * 10 / 4) = 3
    config = load_config("moe-8x", [*TINY, "moe.capacity_factor=null"])
    assert kept_per_expert(config, 10) == [5, 5, 5, 5]
    assert kept_per_expert(config, 11) == [6, 6, 5, 5]  # 22 assignments round robin


@pytest.mark.parametrize("world_size, overrides, message", [
    (6, ["parallel.tp=3"], r"parallel.tp=3 does not divide model.n_heads=4"),
    (6, ["parallel.ep=3"], r"parallel.ep=3 does not divide moe.num_experts=4"),
    (4, ["parallel.tp=2", "parallel.sequence_parallel=true", "model.seq_len=33"],
     r"model.seq_len=33 over parallel.tp=2 ranks, which does not divide it"),
    (4, ["parallel.pp=2", "parallel.microbatches=1"], r"1f1b needs at least parallel.pp=2 micro-batches"),
    (4, ["parallel.tp=2", "parallel.dp_shard=3"], r"do not match the world of 4 ranks"),
])
def test_impossible_layouts_fail_as_train_py_fails(world_size, overrides, message):
    config = load_config("moe-8x", [*TINY, "parallel.dp_shard=-1", *overrides])
    with pytest.raises(ConfigError, match=message):
        resolve_layout(config, world_size)
