"""The memory model against the real model: parameter counts, and predicted against measured bytes.

Single process (fp32, and bf16 autocast): the activation bytes ``micro_batch_activations`` predicts must
equal what autograd keeps after one forward (``saved_activation_bytes``), to the byte, for dense, capacity,
dropless, shared-expert, top-1, GELU, sigmoid and recomputed models. Routing is forced balanced
(``moe.force_balance``) wherever the model's balanced-routing assumption must hold exactly. Spawned on 2
gloo ranks: the same per rank under tp, tp with sequence and vocabulary parallelism, ep (with FSDP over
dp_shard), bf16 under FSDP and context parallelism (each rank its positions of the sequences, FSDP over cp), the
model-state bytes against the rank's parameter storages, and the gradient bytes held between and after 2
micro-batches under both ``parallel.grad_reduce`` settings.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

import train
from analysis import memory
from analysis.memory_activations import (
    compute_copy_bytes,
    in_flight,
    micro_batch_activations,
    replica_slot_bytes,
)
from analysis.memory_states import (
    accumulated_grad_bytes,
    gathered_bytes,
    local_layers,
    model_states,
    parameter_tensors,
)
from config.run import load_config
from moe.accounting import parameter_counts
from moe.transformer import MoETransformer
from parallel import parallelize, set_gradient_sync
from parallel.activation_checkpoint import apply_activation_checkpointing
from parallel.groups import ParallelGroups
from parallel.layout import Layout
from parallel.replication import weight_moves
from parallel.resolve import resolve_layout
from parallel.tensor import lm_loss
from tests.spawn import spawn

TINY = ["model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.n_layers=2", "model.seq_len=16",
        "model.ffn_hidden=48", "moe.num_experts=4", "moe.expert_hidden=24", "train.global_batch_size=2"]


MLA = ["model.n_kv_heads=null", "model.kv_lora_rank=12", "model.qk_nope_head_dim=6", "model.qk_rope_head_dim=4",
       "model.v_head_dim=5"]


DSA = [*MLA, "model.q_lora_rank=10", "model.index_n_heads=4", "model.index_head_dim=8", "moe.force_balance=true"]
HYBRID = ["model.layer_types=[linear_attention,full_attention]", "model.linear_key_heads=2",
          "model.linear_value_heads=4", "model.linear_key_head_dim=6", "model.linear_value_head_dim=5",
          "model.linear_chunk_size=4"]  # Qwen3-Next's: Gated DeltaNet linear attention beside full attention
QWEN3_NEXT = ["model.attn_output_gate=true", "model.qk_norm=true", "model.rotary_dim=4",
              "moe.num_shared_experts=1", "moe.shared_expert_gate=true"]
# DeepSeek-V4's residual and feed-forward (its attention aside): 4 hyper-connected streams (20 Sinkhorn iterations), a
# hash-routed layer then a learned one, sqrt-softplus scores, the limited SwiGLU in the routed and shared experts
DEEPSEEK_V4_RESIDUAL = ["model.hc_mult=4", "model.mlp_layer_types=[hash_moe, moe]", "moe.score_func=sqrtsoftplus",
                        "moe.activation=limited_swiglu", "moe.num_shared_experts=1", "moe.force_balance=true"]
GPT_OSS_MOE = ["moe.activation=clamped_swiglu", "moe.router_bias=true", "moe.expert_proj_bias=true"]
# DeepSeek-V4's attention: shared key/value, grouped output; 16 positions make 8 CSA entries (top 3 kept) and 4 HCA
V4_ATTENTION = ["model.n_kv_heads=null", "model.head_dim=8", "model.rotary_dim=4", "model.q_lora_rank=10",
                "model.sliding_window=4", "model.index_topk=3", "model.index_n_heads=2", "model.index_head_dim=6",
                "model.compressed_attention.csa_rate=2", "model.compressed_attention.hca_rate=4",
                "model.compressed_attention.o_groups=2", "model.compressed_attention.o_lora_rank=6",
                "moe.force_balance=true"]
GPT_OSS_ATTENTION = ["model.qkv_bias=true", "model.attn_output_bias=true", "model.attention_sinks=true",
                     "model.layer_types=[sliding_attention,full_attention]"]


def _tiny(*overrides: str):
    return load_config("moe-8x", [*TINY, *overrides])


def _shard(model, tokens: torch.Tensor) -> torch.Tensor:
    """A context-parallel rank's positions of ``tokens`` [B, S] (all of them without context parallelism)."""
    return tokens if model.sequence_shards is None else model.sequence_shards.shard(tokens)


def _measure(config, layout: Layout, micro: int, precision: str, model, seed: int = 1):
    tokens = torch.randint(0, config.model.vocab_size, (micro, config.model.seq_len + 1),
                           generator=torch.Generator().manual_seed(seed))
    # copies: the embedding saves its input, which as a view would keep the whole [micro, S + 1] storage
    inputs, targets = _shard(model, tokens[:, :-1].clone()), _shard(model, tokens[:, 1:].clone())
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        measured = memory.saved_activation_bytes(model, inputs, targets, config.parallel.vocab_parallel)
    with memory.loss_context(config.parallel.vocab_parallel):
        measured.loss.backward()  # the measurement leaves a loss to train on
    shards = getattr(model, "sequence_shards", None)  # under cp the first rank saves one chunk's mask less
    predicted = (sum(micro_batch_activations(config, layout, micro, precision, device_type="cpu",
                                             cp_rank=None if shards is None else shards.rank).values())
                 + compute_copy_bytes(config, layout, precision))
    return predicted, measured.saved_bytes


@pytest.mark.parametrize("name", ["moe-8x", "dense", "dropless", "switch-top1", "mixtral-8x7b", "deepseek-v3-shape",
                                  "qwen3-30b-a3b", "deepseek-v3", "kimi-k2", "glm-4.5", "gpt-oss-20b",
                                  "gpt-oss-120b", "minimax-m2"])
@pytest.mark.parametrize("tie", [False, True])
def test_parameter_tensors_add_up_to_the_accounting(name, tie):
    config = load_config(name, [f"model.tie_embeddings={str(tie).lower()}"])
    tensors = parameter_tensors(config.model, config.moe)
    counts = parameter_counts(config.model, config.moe)
    assert sum(torch.Size(p.shape).numel() for p in tensors) == counts.total
    assert sum(torch.Size(p.shape).numel() for p in tensors if p.expert) == counts.routed_experts


@pytest.mark.parametrize("overrides", [["moe.activation=clamped_swiglu", "moe.router_bias=true",
                                        "moe.expert_proj_bias=true"],
                                       ["moe.activation=gelu", "moe.expert_proj_bias=true"],
                                       ["model.qkv_bias=true", "model.attn_output_bias=true",
                                        "model.attention_sinks=true"]])
def test_parameter_tensors_count_router_and_expert_biases(overrides):
    """GPT-OSS's biases (router logits, experts' projections, attention output) and sinks are in the memory
    model's tensors, as many as the
    accounting (itself checked against built models) counts, the experts' among the routed experts."""
    config = load_config("moe-8x", overrides)
    tensors = parameter_tensors(config.model, config.moe)
    counts = parameter_counts(config.model, config.moe)
    assert sum(torch.Size(p.shape).numel() for p in tensors) == counts.total
    assert sum(torch.Size(p.shape).numel() for p in tensors if p.expert) == counts.routed_experts


@pytest.mark.parametrize("overrides", [
    [], ["moe.activation=gelu", "moe.num_shared_experts=2", "model.first_moe_layer=1"],
    ["model.tie_embeddings=true", "model.moe_every=0"], ["model.qk_norm=true", "model.head_dim=12"],
    ["model.qkv_bias=true", "model.rotary_dim=4", "model.qk_norm=true"],
    ["model.n_kv_heads=null", "model.kv_lora_rank=12", "model.qk_nope_head_dim=6", "model.qk_rope_head_dim=4",
     "model.v_head_dim=5"],
    ["model.n_kv_heads=null", "model.q_lora_rank=10", "model.kv_lora_rank=12", "model.qk_nope_head_dim=6",
     "model.qk_rope_head_dim=4", "model.v_head_dim=5"],
    ["model.mtp_depth=2", "model.first_moe_layer=1", "model.moe_every=2"],  # a dense and an MoE module
    HYBRID, [*HYBRID, *QWEN3_NEXT], DEEPSEEK_V4_RESIDUAL, [*DEEPSEEK_V4_RESIDUAL, "model.mtp_depth=2"]])
def test_parameter_tensors_are_the_real_models(overrides):
    config = _tiny(*overrides)
    real = sorted(tuple(p.shape) for p in MoETransformer(config.model, config.moe).parameters())
    assert sorted(p.shape for p in parameter_tensors(config.model, config.moe)) == real


def test_mixtral_has_its_published_size_and_one_rank_holds_a_64th_of_it():
    config = load_config("mixtral-8x7b", ["parallel.ep=8"])
    counts = parameter_counts(config.model, config.moe)
    assert counts.total == pytest.approx(46.7e9, rel=2e-3) and counts.active == pytest.approx(12.9e9, rel=1e-2)
    states = model_states(config, Layout.resolve(64, ep=8))
    # ep=8 × edp=8 shards the experts 64 ways and FSDP the dense weights 64 ways: 16 bytes / 64 per parameter,
    # but for the [8, 4096] router gates: FSDP2 pads them to one row on every rank
    routers = 32 * 8 * 4096
    assert states.total == 16 * (counts.total - routers) // 64 + 16 * routers // 8
    assert states.weights_experts == pytest.approx(4 * counts.routed_experts / 64, rel=1e-6)


SINGLE = {
    "dense": ("fp32", ["model.moe_every=0"]),
    "capacity drops": ("fp32", ["moe.capacity_factor=0.5", "moe.force_balance=true"]),
    "dropless, top-1, shared": ("fp32", ["moe.capacity_factor=null", "moe.top_k=1", "moe.num_shared_experts=1",
                                         "moe.force_balance=true"]),
    "dense then MoE, no z-loss": ("fp32", ["model.first_moe_layer=1", "moe.z_loss_coef=0", "moe.force_balance=true"]),
    "no balancing losses": ("fp32", ["moe.z_loss_coef=0", "moe.aux_loss_coef=0", "moe.force_balance=true"]),
    "sigmoid, sequence aux": ("fp32", ["moe.score_func=sigmoid", "moe.aux_loss_scope=sequence",
                                       "moe.force_balance=true"]),
    "gelu, jitter, no aux": ("fp32", ["moe.activation=gelu", "moe.renormalize=false", "moe.jitter_eps=0.1",
                                      "moe.aux_loss_coef=0", "moe.force_balance=true"]),
    "recompute full": ("fp32", ["parallel.activation_checkpointing=full", "moe.force_balance=true"]),
    "recompute moe": ("fp32", ["parallel.activation_checkpointing=moe", "moe.num_shared_experts=1",
                               "model.first_moe_layer=1", "moe.force_balance=true"]),
    "bf16": ("bf16", ["moe.num_shared_experts=1", "model.first_moe_layer=1", "moe.force_balance=true"]),
    "bf16, tied embeddings": ("bf16", ["model.tie_embeddings=true", "moe.force_balance=true"]),
    # 64 rows over 3 experts: groups of 21 or 22 rows, padded to 32 each on CPU (``moe.experts.row_multiple_on``)
    "bf16, padded groups": ("bf16", ["moe.num_experts=3", "moe.force_balance=true"]),
    "Qwen3 attention: q/k norms, wide heads": ("fp32", ["model.qk_norm=true", "model.head_dim=16",
                                                        "moe.renormalize=false", "moe.force_balance=true"]),
    "bf16, Qwen3 attention": ("bf16", ["model.qk_norm=true", "model.head_dim=16", "moe.force_balance=true"]),
    # MiniMax-M2's: one q norm over every head's channels, one k norm likewise, partial rotary
    "MiniMax-M2 attention: q/k norms per layer": ("fp32", ["model.qk_norm=true", "model.qk_norm_type=per_layer",
                                                           "model.n_kv_heads=2", "model.rotary_dim=4",
                                                           "moe.force_balance=true"]),
    "bf16, MiniMax-M2 attention": ("bf16", ["model.qk_norm=true", "model.qk_norm_type=per_layer",
                                            "model.n_kv_heads=2", "moe.force_balance=true"]),
    "bf16, recompute moe": ("bf16", ["parallel.activation_checkpointing=moe", "moe.num_shared_experts=1",
                                     "moe.force_balance=true"]),
    "latent attention": ("fp32", [*MLA, "moe.force_balance=true"]),
    "latent attention, query bottleneck, dense first": ("fp32", [*MLA, "model.q_lora_rank=10",
                                                                 "model.first_moe_layer=1", "moe.force_balance=true"]),
    "latent attention, values wider than keys": ("fp32", [*MLA, "model.v_head_dim=14", "moe.force_balance=true"]),
    "bf16, latent attention, query bottleneck": ("bf16", [*MLA, "model.q_lora_rank=10", "moe.force_balance=true"]),
    # multi-token prediction: module k on S - k positions; under bf16 its stream is the projection's bf16 output
    "multi-token prediction, 2 modules": ("fp32", [*MLA, "model.q_lora_rank=10", "model.first_moe_layer=1",
                                                   "model.mtp_depth=2", "moe.force_balance=true"]),
    "bf16, multi-token prediction, 2 modules": ("bf16", [*MLA, "model.mtp_depth=2", "moe.force_balance=true"]),
    "bf16, multi-token prediction, recompute full": ("bf16", ["model.mtp_depth=2", "moe.force_balance=true",
                                                              "parallel.activation_checkpointing=full"]),
    "bf16, multi-token prediction, recompute moe": ("bf16", ["model.mtp_depth=1", "moe.force_balance=true",
                                                             "parallel.activation_checkpointing=moe"]),
    "GLM attention: biases, half rotary, q/k norms": ("fp32", ["model.qkv_bias=true", "model.rotary_dim=4",
                                                               "model.qk_norm=true", "moe.force_balance=true"]),
    "GPT-OSS MoE: clamped SwiGLU, router and expert biases": ("fp32", [*GPT_OSS_MOE, "moe.force_balance=true"]),
    "bf16, GPT-OSS MoE": ("bf16", [*GPT_OSS_MOE, "moe.force_balance=true"]),
    # a sliding layer then a full one, both with sinks: window 5 of 16 is the masked path, 4 the blocked one
    "GPT-OSS attention: biases, sinks, masked window": ("fp32", [*GPT_OSS_ATTENTION, "model.sliding_window=5",
                                                                 "moe.force_balance=true"]),
    "bf16, GPT-OSS attention, blocked window": ("bf16", [*GPT_OSS_ATTENTION, "model.sliding_window=4",
                                                         "moe.force_balance=true"]),
    # sparse attention: the top 6 of 16 keys (the sparse kernel and its mask per sequence), and of 16 the top 32
    "sparse attention (DSA), top-k binding": ("fp32", [*DSA, "model.index_topk=6"]),
    "sparse attention (DSA), every key selected": ("fp32", [*DSA, "model.index_topk=32"]),
    "bf16, sparse attention (DSA), top-k binding": ("bf16", [*DSA, "model.index_topk=6"]),
    "DeepSeek-V4 attention: CSA then HCA": ("fp32", [*V4_ATTENTION, "model.layer_types=[compressed_sparse_attention,"
                                                                    "heavily_compressed_attention]"]),
    "bf16, DeepSeek-V4 attention: sliding then CSA": ("bf16", [*V4_ATTENTION, "model.layer_types=[sliding_attention,"
                                                                            "compressed_sparse_attention]"]),
    # the top 2 of 32 keys: each query's keys gathered (the gathered kernel, latent attention absorbed)
    "sparse attention (DSA), gathered keys": ("fp32", [*DSA, "model.index_topk=2", "model.seq_len=32"]),
    "bf16, sparse attention (DSA), gathered keys": ("bf16", [*DSA, "model.index_topk=2", "model.seq_len=32"]),
    # GLM-5's second layer sharing the first's selection (no indexer), on either kernel
    "GLM-5 shared selection, masked": ("fp32", [*DSA, "model.index_topk=6", "model.indexer_types=[full,shared]"]),
    "GLM-5 shared selection, gathered": ("fp32", [*DSA, "model.index_topk=2", "model.seq_len=32",
                                                  "model.indexer_types=[full,shared]"]),
    "Gated DeltaNet linear attention beside full attention": ("fp32", [*HYBRID, "moe.force_balance=true"]),
    "bf16, Gated DeltaNet linear attention": ("bf16", [*HYBRID, "moe.force_balance=true"]),
    # Qwen3-Next's other parts: gated attention, partial rotary, q/k norms, a gated shared expert
    "Qwen3-Next: gated attention, gated shared expert": ("fp32", [*HYBRID, *QWEN3_NEXT, "moe.force_balance=true"]),
    "bf16, Qwen3-Next": ("bf16", [*HYBRID, *QWEN3_NEXT, "moe.force_balance=true"]),
    "Qwen3-Next, recompute full": ("fp32", [*HYBRID, *QWEN3_NEXT, "parallel.activation_checkpointing=full",
                                            "moe.force_balance=true"]),
    "DeepSeek-V4 residual: hyper-connections, hash routing, limited SwiGLU": ("fp32", DEEPSEEK_V4_RESIDUAL),
    "bf16, DeepSeek-V4 residual, no z-loss": ("bf16", [*DEEPSEEK_V4_RESIDUAL, "moe.z_loss_coef=0"]),
    "DeepSeek-V4 residual, recompute full": ("fp32", [*DEEPSEEK_V4_RESIDUAL, "parallel.activation_checkpointing=full"]),
    # DeepSeek-V4's multi-token prediction over the streams: its input norms, two projections, collapse
    "DeepSeek-V4 multi-token prediction, 2 modules": ("fp32", [*DEEPSEEK_V4_RESIDUAL, "model.mtp_depth=2"]),
    "bf16, DeepSeek-V4 multi-token prediction, 2 modules": ("bf16", [*DEEPSEEK_V4_RESIDUAL, "model.mtp_depth=2"]),
    "bf16, DeepSeek-V4 multi-token prediction, recompute moe": ("bf16", [*DEEPSEEK_V4_RESIDUAL, "model.mtp_depth=1",
                                                                         "parallel.activation_checkpointing=moe"]),
}


@pytest.mark.parametrize("case", SINGLE)
def test_predicted_activations_are_the_measured_ones(case):
    precision, overrides = SINGLE[case]
    config = _tiny(*overrides)
    layout, micro, _ = resolve_layout(config, 1)
    torch.manual_seed(0)
    model = MoETransformer(config.model, config.moe)
    apply_activation_checkpointing(model, config.parallel.activation_checkpointing)
    predicted, measured = _measure(config, layout, micro, precision, model)
    assert predicted == measured


def test_skewed_routing_keeps_fewer_rows_than_the_balanced_bound():
    """Unforced routing of an untrained router overflows some experts: what is kept is at most the estimate."""
    config = _tiny("moe.capacity_factor=1.0")
    layout, micro, _ = resolve_layout(config, 1)
    torch.manual_seed(0)
    predicted, measured = _measure(config, layout, micro, "fp32", MoETransformer(config.model, config.moe))
    assert measured < predicted


def test_pipeline_stages_split_the_activations_and_the_schedules_stash_micro_batches():
    config = _tiny("model.n_layers=4", "parallel.pp=2", "train.global_batch_size=8", "parallel.microbatches=4")
    layout, micro, microbatches = resolve_layout(config, 2)
    whole = _tiny("model.n_layers=4", "train.global_batch_size=8", "parallel.microbatches=4")
    one = sum(micro_batch_activations(whole, resolve_layout(whole, 1)[0], micro, "fp32").values())
    stages = [sum(micro_batch_activations(config, layout, micro, "fp32", r).values()) for r in range(2)]
    assert sum(stages) == one  # every block, the embedding and the head on exactly one stage
    assert [in_flight(config, layout, microbatches, r) for r in range(2)] == [2, 1]  # 1F1B: pp - r
    gpipe = _tiny("model.n_layers=4", "parallel.pp=2", "train.global_batch_size=8", "parallel.microbatches=4",
                  "parallel.pp_schedule=gpipe")
    assert in_flight(gpipe, layout, microbatches, 0) == 4
    interleaved = _tiny("model.n_layers=4", "parallel.pp=2", "train.global_batch_size=8", "parallel.microbatches=4",
                        "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2")
    assert in_flight(interleaved, layout, microbatches, 0) == 2 * (1 + 1 / 4)  # Korthikanti: 1 + (p-1)/(pv)


def test_gathered_weights_only_under_fsdp_and_more_without_resharding():
    config = _tiny()
    assert gathered_bytes(config, Layout.resolve(1)) == 0
    assert gathered_bytes(config, Layout.resolve(2, ep=2, dp_shard=1, tp=2)) == 0  # ep spans the fold
    resharded = gathered_bytes(config, Layout.resolve(4))
    kept = gathered_bytes(_tiny("model.n_layers=4", "parallel.reshard_after_forward=false"), Layout.resolve(4))
    block = 4 * (2 * 32 + 4 * 8 * 32 * 2 + 2 * 8 * 32 * 2 + 4 * 32 + 3 * 4 * 32 * 24)  # tp-local fp32 of one block
    root = 4 * (2 * 256 * 32 + 32)
    assert resharded == root + 3 * block  # this block and the next one's weights, this block's gradients
    assert kept == root + 5 * block  # all four blocks' weights, one block's gradients
    # pipelining with grad_reduce=step keeps the stage gathered between micro-batches (as torch's PipelineStage)
    staged = ["model.n_layers=8", "parallel.pp=2", "train.global_batch_size=4", "parallel.microbatches=2"]
    layout = Layout.resolve(4, pp=2)  # dp_shard=2
    blocks = len(local_layers(_tiny(*staged), layout, 0)[0])
    assert blocks >= 3
    assert gathered_bytes(_tiny(*staged), layout, 0, 2) == 4 * 256 * 32 + (blocks + 1) * block
    assert gathered_bytes(_tiny(*staged), layout, 0, 1) == 4 * 256 * 32 + 3 * block  # one micro-batch: resharded
    assert gathered_bytes(_tiny(*staged, "parallel.grad_reduce=microbatch"), layout, 0, 2) == 4 * 256 * 32 + 3 * block


def test_pipeline_stages_hold_the_bytes_of_their_cut_with_the_embedding_copy_under_mtp():
    """Each pipeline rank's model-state weights are its cut stage's parameters: under multi-token prediction the
    last stage's MTP module and its copy of the embedding, a whole second table, are counted there."""
    from parallel.pipeline import cut_stage, stage_layers

    layout, last = Layout.resolve(2, pp=2), {}
    for depth in (0, 1):
        config = _tiny("parallel.pp=2", f"model.mtp_depth={depth}")
        model = MoETransformer(config.model, config.moe)
        for pp_rank, layers in enumerate(stage_layers(config.model, config.moe, 2)):
            stage = cut_stage(model, layers, pp_rank == 0, pp_rank == 1)
            assert model_states(config, layout, pp_rank).weights == 4 * sum(p.numel() for p in stage.parameters())
        last[depth] = model_states(config, layout, 1).weights
    module = 4 * sum(p.numel() for p in model.mtp.parameters())
    assert last[1] - last[0] == module + 4 * config.model.vocab_size * config.model.d_model  # the module, the copy


def test_unsharded_gradients_are_held_only_when_reduced_once_per_step():
    layout = Layout.resolve(4)  # dp_shard=4: every tensor's gradient is held whole instead of a quarter
    step, microbatch = _tiny(), _tiny("parallel.grad_reduce=microbatch")
    grads = model_states(step, layout).grads
    assert accumulated_grad_bytes(step, layout, 1) == accumulated_grad_bytes(microbatch, layout, 4) == 0
    whole = 4 * sum(torch.Size(p.shape).numel() for p in parameter_tensors(step.model, step.moe))
    assert grads + accumulated_grad_bytes(step, layout, 4) == whole


@pytest.mark.parametrize("overrides, world, reason", [
    (["parallel.tp=4"], 4, "parallel.tp=4 does not divide model.n_heads=6"),  # validate_for_model
    (["parallel.pp=2", "parallel.microbatches=1"], 2, "1f1b needs at least parallel.pp=2 micro-batches"),
    (["parallel.tp=2", "parallel.sequence_parallel=true", "model.seq_len=15"], 2, "model.seq_len=15 over"),
])
def test_impossible_layouts_fail_as_train_py_fails_them(overrides, world, reason, capsys, monkeypatch):
    assert memory.main(["--config", "moe-8x", "--world-size", str(world), "--set", *overrides]) == 2
    ours = capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", str(world))
    assert train.main(["--config", "moe-8x", "--set", *overrides]) == 2  # refused before any process group
    assert ours == capsys.readouterr().err and reason in ours


@pytest.mark.parametrize("argv", [
    ["--config", "moe-8x"],
    ["--config", "mixtral-8x7b", "--world-size", "64", "--set", "parallel.ep=8", "train.micro_batch_size=1"],
    ["--config", "deepseek-v3-shape", "--world-size", "256", "--set", "parallel.ep=32", "parallel.pp=8",
     "parallel.tp=4", "parallel.sequence_parallel=true", "parallel.activation_checkpointing=full",
     "train.micro_batch_size=1"],
])
def test_cli_prints_a_table_with_a_verdict(argv, capsys):
    assert memory.main(argv) == 0
    out = capsys.readouterr().out
    assert "weights: routed experts" in out and "\ntotal" in out and "in 80 GiB" in out


def test_expert_sweep_shifts_the_footprint_from_activations_to_weights(capsys, tmp_path):
    plot = tmp_path / "sweep.png"
    argv = ["--config", "moe-8x", "--precision", "fp32", "--sweep-experts", "8,32,128", "--plot", str(plot)]
    assert memory.main(argv) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.split()[0].isdigit()]
    assert [row[0] for row in rows] == ["8", "32", "128"]
    shares = [float(row[-2].rstrip("%")) for row in rows]
    assert shares[0] > shares[1] > shares[2]
    from PIL import Image
    with Image.open(plot) as image:
        image.verify()
        assert image.format == "PNG"
    assert memory.main(argv) == 2 and "pass --overwrite" in capsys.readouterr().err  # never replaced unasked
    assert memory.main([*argv[:-2], "--plot", str(tmp_path / "sweep.jpg")]) == 2
    # the figure's stacked bars are the table's components, and they add up to each rank's total
    from analysis.memory_plot import sweep_figure
    sweep = memory.sweep_experts("moe-8x", [], 1, "fp32", [8, 32])
    fig = sweep_figure([(experts, memory.sweep_components(e)) for experts, e in sweep], 80.0, "t")
    bars = fig.axes[0].patches  # component by component, each over the expert counts
    for i, (_, e) in enumerate(sweep):
        heights = [bar.get_height() for bar in bars[i::len(sweep)]]
        assert heights == pytest.approx([part / 2**30 for part in memory.sweep_components(e).values()])
        assert sum(heights) == pytest.approx(e.total / 2**30)


# ---------------------------------------------------------------------------
# 2 gloo ranks: per-rank activations and model states against the real parallelized model
# ---------------------------------------------------------------------------

SPAWNED = [
    ("fp32", ["parallel.tp=2", "parallel.dp_shard=1"]),
    ("fp32", ["parallel.tp=2", "parallel.dp_shard=1", "parallel.sequence_parallel=true"]),
    ("fp32", ["parallel.tp=2", "parallel.dp_shard=1", "parallel.vocab_parallel=true",
              "parallel.sequence_parallel=true", "parallel.activation_checkpointing=full"]),
    ("fp32", ["parallel.ep=2"]),  # dp_shard=2: FSDP shards the dense weights, ep the experts
    ("bf16", ["parallel.dp_shard=2"]),  # FSDP's mixed precision: weights gathered in bf16, no autocast copies
    ("bf16", ["parallel.ep=2"]),  # the experts outside FSDP: autocast casts (and keeps copies of) theirs alone
    # Qwen3's attention: q/k norms whole on each tp rank, on its heads; under FSDP's bf16 weights
    ("fp32", ["parallel.tp=2", "parallel.dp_shard=1", "model.qk_norm=true", "model.head_dim=16"]),
    ("bf16", ["parallel.dp_shard=2", "model.qk_norm=true", "model.head_dim=16"]),
    # latent attention: per-head projections split over tp, the latent ones and their norms whole; under FSDP's bf16
    ("fp32", ["parallel.tp=2", "parallel.dp_shard=1", "parallel.sequence_parallel=true", *MLA, "model.q_lora_rank=10"]),
    ("bf16", ["parallel.dp_shard=2", *MLA]),
    # multi-token prediction: the module an FSDP unit (bf16 weights), its experts under ep, its block split over tp
    ("bf16", ["parallel.dp_shard=2", "model.mtp_depth=1"]),
    ("fp32", ["parallel.ep=2", "model.mtp_depth=2", *MLA]),
    ("fp32", ["parallel.tp=2", "parallel.dp_shard=1", "model.mtp_depth=1", *MLA, "model.q_lora_rank=10"]),
    # and on the whole sequence under sequence parallelism: its inputs gathered, the final norm on the whole too
    ("fp32", ["parallel.tp=2", "parallel.dp_shard=1", "parallel.sequence_parallel=true", "model.mtp_depth=1"]),
    # and with the head split over the vocabulary: each module's logits and loss on this rank's vocabulary slice
    ("fp32", ["parallel.tp=2", "parallel.dp_shard=1", "parallel.vocab_parallel=true", "model.mtp_depth=1"]),
    ("fp32", ["parallel.tp=2", "parallel.dp_shard=1", "parallel.sequence_parallel=true", "parallel.vocab_parallel=true",
              "model.mtp_depth=1"]),
    # context parallelism: S/cp queries over the gathered S keys and values (the latent, for latent attention), a
    # mask per layer, the weights sharded by FSDP over cp; GPT-OSS's sinks and windows take the masked path
    ("fp32", ["parallel.cp=2", "parallel.dp_shard=1", "moe.capacity_factor=null"]),
    ("bf16", ["parallel.cp=2", "parallel.dp_shard=1", "moe.capacity_factor=null", *MLA]),
    ("fp32", ["parallel.cp=2", "parallel.dp_shard=1", "moe.capacity_factor=null", *GPT_OSS_ATTENTION,
              "model.sliding_window=4"]),
    # sparse attention: the indexer whole on each tp rank; its keys gathered under cp; under FSDP's bf16 weights
    ("fp32", ["parallel.tp=2", "parallel.dp_shard=1", *DSA, "model.index_topk=6"]),
    ("fp32", ["parallel.cp=2", "parallel.dp_shard=1", "moe.capacity_factor=null", *DSA, "model.index_topk=6"]),
    ("bf16", ["parallel.dp_shard=2", *DSA, "model.index_topk=6"]),
    ("bf16", ["parallel.cp=2", "parallel.dp_shard=1", "moe.capacity_factor=null", *DSA, "model.index_topk=6"]),
    # DeepSeek-V4's attention split by whole output groups over tp, with sequence parallelism, and in bf16; over cp,
    # the block input gathered (and put in position order for the compressors)
    ("fp32", ["parallel.tp=2", "parallel.dp_shard=1", "parallel.sequence_parallel=true", *V4_ATTENTION,
              "model.layer_types=[compressed_sparse_attention,heavily_compressed_attention]"]),
    ("bf16", ["parallel.tp=2", "parallel.dp_shard=1", *V4_ATTENTION,
              "model.layer_types=[sliding_attention,compressed_sparse_attention]"]),
    ("fp32", ["parallel.cp=2", "parallel.dp_shard=1", "moe.capacity_factor=null", *V4_ATTENTION,
              "model.layer_types=[compressed_sparse_attention,heavily_compressed_attention]"]),
    ("bf16", ["parallel.cp=2", "parallel.dp_shard=1", "moe.capacity_factor=null", *V4_ATTENTION,
              "model.layer_types=[sliding_attention,compressed_sparse_attention]"]),
    # the whole of V4 with sequence parallelism: the hyper-connections on each rank's slice of the streams, the MTP
    # module on the whole sequence (its inputs, the last block's streams among them, gathered)
    ("bf16", ["parallel.tp=2", "parallel.dp_shard=1", "parallel.sequence_parallel=true", *DEEPSEEK_V4_RESIDUAL,
              "model.first_moe_layer=0", *V4_ATTENTION,
              "model.layer_types=[compressed_sparse_attention,heavily_compressed_attention]", "model.mtp_depth=1"]),
    # Qwen3-Next: the linear heads split over tp (the gated norm on each rank's heads, a DTensor); under FSDP's bf16
    ("fp32", ["parallel.tp=2", "parallel.dp_shard=1", *HYBRID, *QWEN3_NEXT]),
    ("bf16", ["parallel.dp_shard=2", *HYBRID, *QWEN3_NEXT]),
    # and under cp: each linear layer on its rank's positions, the chunks' state maps gathered and composed
    # (moe/attention/delta_rule_shards.py); a model of linear layers alone takes no rotary tables
    ("fp32", ["parallel.cp=2", "parallel.dp_shard=1", "moe.capacity_factor=null", *HYBRID, *QWEN3_NEXT]),
    ("fp32", ["parallel.cp=2", "parallel.dp_shard=1", "moe.capacity_factor=null", *HYBRID, *QWEN3_NEXT,
              "model.layer_types=[linear_attention,linear_attention]"]),
    # the state maps composed in fp32 under bf16 autocast
    ("bf16", ["parallel.cp=2", "parallel.dp_shard=1", "moe.capacity_factor=null", *HYBRID, *QWEN3_NEXT]),
]
SPAWNED_MODEL = ["model.first_moe_layer=1", "moe.num_shared_experts=1", "moe.shared_expert_hidden=32",
                 "moe.force_balance=true", "train.global_batch_size=4"]


# gradient accumulation, 2 micro-batches per rank: the gradient bytes held after the first (under step: every
# unit's unsharded gradients; under microbatch: the shards) and after the last (the shards), both settings
ACCUMULATING = [
    ["parallel.dp_shard=2", "parallel.grad_reduce=step"],
    ["parallel.dp_shard=2", "parallel.grad_reduce=microbatch"],
    ["parallel.ep=2", "parallel.grad_reduce=step"],  # ep spans dp_shard: the experts stay out of FSDP
    ["parallel.dp_replicate=2", "parallel.dp_shard=1", "parallel.grad_reduce=microbatch"],  # HSDP's summed shards
    ["parallel.dp_shard=1", "parallel.tp=2", "moe.num_experts=3", "parallel.grad_reduce=step"],  # experts over edp
    ["parallel.dp_shard=1", "parallel.cp=2", "moe.capacity_factor=null", "parallel.grad_reduce=step"],  # FSDP over cp
]


def _held_gradients(rank: int, results: dict) -> None:
    for index, overrides in enumerate(ACCUMULATING):
        config = _tiny(*SPAWNED_MODEL, "train.micro_batch_size=1", *overrides)
        layout, micro, microbatches = resolve_layout(config, 2)
        groups = ParallelGroups.build(layout, "cpu")
        torch.manual_seed(0)
        model = parallelize(MoETransformer(config.model, config.moe), groups)
        tokens = torch.randint(0, config.model.vocab_size, (microbatches, micro, config.model.seq_len + 1),
                               generator=torch.Generator().manual_seed(1 + groups.coords()["dp"]))
        held = []
        for m in range(microbatches):
            set_gradient_sync(model, config.parallel.grad_reduce, last=m == microbatches - 1)
            lm_loss(model(_shard(model, tokens[m, :, :-1])), _shard(model, tokens[m, :, 1:])).backward()
            held.append(memory.held_gradient_bytes(model))
        states = model_states(config, layout)
        between = states.grads + accumulated_grad_bytes(config, layout, microbatches)
        results[("held", index, rank)] = (held, [between] * (microbatches - 1) + [states.grads])


# replica slots filled: routing left to the untrained router (skewed), dropless so a rank's rows are its plan's
SKEWED_REPLICAS = ["parallel.ep=2", "parallel.ep_replicas=1", "moe.force_balance=false", "moe.capacity_factor=null"]


def _filled_slots(rank: int, results: dict) -> None:
    """The model counts the balanced rows and every slot filled; measured on skewed routing, the bytes equal it
    once each layer's rows and filled slots are the ones its plan gave this rank (``last_plan``)."""
    config = _tiny(*SPAWNED_MODEL, *SKEWED_REPLICAS)
    layout, micro, _ = resolve_layout(config, 2)
    groups = ParallelGroups.build(layout, "cpu")
    torch.manual_seed(0)
    model = parallelize(MoETransformer(config.model, config.moe), groups, config.parallel)
    predicted, measured = _measure(config, layout, micro, "fp32", model, 1 + groups.coords()["dp_shard"])
    model_, moe, fp32 = config.model, config.moe, 4
    balanced = micro * model_.seq_len * moe.top_k  # the rows the model gives this rank (tp=1, dropless)
    # a computed row keeps its place in the copies' order and back (two int64), itself, SwiGLU's four hidden
    per_row = 2 * 8 + model_.d_model * fp32 + 4 * moe.expert_hidden * fp32
    plans = [m.last_plan for m in model.modules() if getattr(m, "last_plan", None) is not None]
    ep_rank = groups.coords()["ep"]
    for plan in plans:
        moves = weight_moves(plan, ep_rank)
        filled = replica_slot_bytes(model_, moe, layout, fp32, len(moves.recv_slots), len(moves.send_local), cpu=True)
        predicted += (plan.loads_after[ep_rank] - balanced) * per_row + filled - replica_slot_bytes(
            model_, moe, layout, fp32, 1, 1, cpu=True)
    results[("filled", rank)] = (predicted, measured, [plan.slots for plan in plans])


def _worker(rank: int, results: dict) -> None:
    _held_gradients(rank, results)
    _filled_slots(rank, results)
    for index, (precision, overrides) in enumerate(SPAWNED):
        config = _tiny(*SPAWNED_MODEL, *overrides)
        layout, micro, _ = resolve_layout(config, 2)
        groups = ParallelGroups.build(layout, "cpu")
        torch.manual_seed(0)
        param_dtype = torch.bfloat16 if precision == "bf16" else None  # as parallel.build.build_model gives it
        model = parallelize(MoETransformer(config.model, config.moe), groups, config.parallel, param_dtype)
        storages = {s.data_ptr(): s.nbytes()
                    for s in (memory.local_tensor(p).untyped_storage() for p in model.parameters())}
        seed = 1 + groups.coords()["dp_shard"]  # each data-parallel rank its own micro-batch
        predicted, measured = _measure(config, layout, micro, precision, model, seed)
        results[(index, rank)] = (predicted, measured, model_states(config, layout).weights,
                                  sum(storages.values()))


def test_per_rank_bytes_match_the_parallelized_model():
    with mp.Manager() as manager:
        results = manager.dict()
        spawn(_worker, 2, results)
        results = dict(results)
    for index, (_, overrides) in enumerate(SPAWNED):
        for rank in range(2):
            predicted, measured, weights, stored = results[(index, rank)]
            assert (predicted, weights) == (measured, stored), (overrides, rank, predicted - measured)
    for rank in range(2):  # skewed routing: slots filled in every MoE layer, the bytes those plans give
        predicted, measured, slots = results[("filled", rank)]
        assert slots and all(any(e >= 0 for rank_slots in layer for e in rank_slots) for layer in slots), slots
        assert predicted == measured, (rank, predicted - measured)
    for index, overrides in enumerate(ACCUMULATING):
        for rank in range(2):
            measured, predicted = results[("held", index, rank)]
            assert measured == predicted, (overrides, rank)
        if "parallel.grad_reduce=step" in overrides and "parallel.ep=2" not in overrides:
            assert measured[0] > measured[-1], overrides  # the unsharded gradients are larger than their shards
