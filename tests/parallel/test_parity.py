"""Parity, the proof of a parallel layout: same initial weights and data, same numbers as one process.

Each layout trains 5 optimizer steps; every step's loss, aux loss and gradient norm (the clipping
input) must match the single-process reference to 1e-4 relative, and so must every final parameter.
Every layer's routing figures are compared too (under pipeline parallelism some come from other stages
than rank 0's), and the final validation loss (the same fixed sequences under every layout).
The reference runs the global batch of 8 as the same micro-batches that each data-parallel rank sees,
so capacity-limited routing groups tokens the same way in both. A micro-batch is 8 / (data-parallel
ranks × pipeline stages) sequences: each pipeline then runs pp micro-batches, as 1F1B needs. Layout
settings outside ``parallel.*`` (a deeper model for interleaving, a smaller micro-batch for gradient
accumulation under both ``parallel.grad_reduce`` settings) apply to the reference too.
"""

import pytest
import torch

from config.parallel import DEGREES
from parallel.layout import Layout
from tests.parallel.parity import DOCUMENT_MASK, GPT_OSS, run
from training.metrics import read_metrics

STEPS = 5
# DeepSeek-V3's architecture at toy size: latent attention with a query bottleneck behind a dense first layer, then
# sigmoid scores routed within the best 1 of 2 groups (each token's 2 experts come from one group), scaled by 2.5,
# a shared expert, and the correction bias trained by aux-loss-free balancing (the load summed over ranks)
DEEPSEEK_V3 = ["model.kv_lora_rank=16", "model.q_lora_rank=12", "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=4",
               "model.v_head_dim=8", "model.first_moe_layer=1", "moe.score_func=sigmoid", "moe.n_group=2",
               "moe.topk_group=1", "moe.routed_scaling_factor=2.5", "moe.num_shared_experts=1",
               "moe.bias_update_rate=0.01"]
# with one multi-token-prediction module (a MoE block: layer 2's kind) after the head
DEEPSEEK_V3_MTP = [*DEEPSEEK_V3, "model.mtp_depth=1"]
# DeepSeek-V3.2's: the same with sparse attention, each query attending to the top 8 of up to 32 keys. 16 indexer
# heads: with 4, a key's score is exactly 0 wherever all 4 ReLUs are (1 in 16), and such near-ties at the top-k's
# edge were seen to flip under a layout's other summation order (one row or another off by ~1e-4 from step 2 on)
DEEPSEEK_V32 = [*DEEPSEEK_V3, "model.index_topk=8", "model.index_n_heads=16", "model.index_head_dim=8"]
# the top 2 of 32: the kernel that gathers each query's keys (moe/attention/gathered.py), the top 8 the masked one
DEEPSEEK_V32_GATHERED = [*DEEPSEEK_V32, "model.index_topk=2"]
# DeepSeek-V4's attention at toy size on today's residual stream: a sliding layer, a heavily compressed one (8
# entries of 4 positions) and a compressed sparse one (16 entries of 2, the top 4 kept; 16 indexer heads against
# ties, as DeepSeek-V3.2's), 4 heads in 2 output groups
DEEPSEEK_V4_ATTENTION = [
    "model.n_layers=3", "model.n_kv_heads=null", "model.head_dim=8", "model.rotary_dim=4", "model.q_lora_rank=12",
    "model.sliding_window=8", "model.layer_types=[sliding_attention,heavily_compressed_attention,"
    "compressed_sparse_attention]", "model.index_topk=4", "model.index_n_heads=16", "model.index_head_dim=8",
    "model.compressed_attention.csa_rate=2", "model.compressed_attention.hca_rate=4",
    "model.compressed_attention.o_groups=2", "model.compressed_attention.o_lora_rank=8"]
# Muon (training/muon.py), on rows whose layouts cover its cases: matrices gathered from FSDP's dp_shard (the dense
# weights of the ep=2 row), from tp (with sequence parallelism), from etp, and from dp_shard and tp together (the
# QK-clip row); experts whole under ep; pp's stages
# each with their own head. Newton-Schulz in fp32, so the layout's reductions are the only difference (in bf16 its
# roundings turn a 1e-7 difference of a gradient into ~1e-3 of the weights: training/muon.py, newton_schulz); the
# bf16 row below keeps Muon's default bf16 iteration under bf16 tolerances.
MUON = ["train.optimizer=muon", "train.muon_ns_dtype=fp32"]
# Qwen3-Next's architecture at toy size: a Gated DeltaNet layer (2 key heads serving 4 value heads, the delta rule
# by 4 chunks of 8), then gated attention with q/k norms and half of each head rotated; a gated shared expert
QWEN3_NEXT = ["model.layer_types=[linear_attention, full_attention]", "model.linear_key_heads=2",
              "model.linear_value_heads=4", "model.linear_key_head_dim=8", "model.linear_value_head_dim=8",
              "model.linear_chunk_size=8", "model.attn_output_gate=true", "model.qk_norm=true", "model.rotary_dim=4",
              "moe.num_shared_experts=1", "moe.shared_expert_gate=true"]
# DeepSeek-V4's residual and routing at toy size (its attention kinds aside): 4 hyper-connected streams, a learned MoE
# layer then a hash-routed one (its experts picked by the token id; V4 has them first, but second it needs the ids on
# the second pipeline stage), sqrt-softplus scores scaled by 1.5, the limited SwiGLU (limit 1: it clamps) in the
# routed and the shared expert
DEEPSEEK_V4_RESIDUAL = ["model.hc_mult=4", "model.mlp_layer_types=[moe, hash_moe]", "moe.score_func=sqrtsoftplus",
                        "moe.routed_scaling_factor=1.5", "moe.activation=limited_swiglu", "moe.swiglu_limit=1.0",
                        "moe.num_shared_experts=1"]
# the whole DeepSeek-V4: the same with its attention, a compressed sparse layer (the indexer's top 2 of up to 8
# entries) then a heavily compressed one, 2 output groups, one key/value head, windows of 8
DEEPSEEK_V4 = [*DEEPSEEK_V4_RESIDUAL, "model.n_kv_heads=null", "model.head_dim=16", "model.rotary_dim=8",
               "model.q_lora_rank=12", "model.sliding_window=8",
               "model.layer_types=[compressed_sparse_attention, heavily_compressed_attention]", "model.index_topk=2",
               "model.index_n_heads=2", "model.index_head_dim=8", "model.compressed_attention.csa_rate=4",
               "model.compressed_attention.hca_rate=8", "model.compressed_attention.o_groups=2",
               "model.compressed_attention.o_lora_rank=8"]
# MiniMax-M2's at toy size: one RMSNorm over all heads' queries and one over all keys, partial rotary, sigmoid
# routing by the correction bias (trained by aux-loss-free balancing), every layer MoE
MINIMAX_M2 = ["model.qk_norm=true", "model.qk_norm_type=per_layer", "model.n_kv_heads=2", "model.rotary_dim=4",
              "moe.score_func=sigmoid", "moe.bias_update_rate=0.01"]
LAYOUTS = [  # (overrides, world size, capacity factor)
    pytest.param(["parallel.dp_shard=2"], 2, "null", id="dp_shard=2-dropless"),
    # weights kept gathered from forward to backward (one all-gather fewer per block)
    pytest.param(["parallel.dp_shard=2", "parallel.reshard_after_forward=false"], 2, "1.25", id="dp_shard=2-capacity"),
    pytest.param(["parallel.dp_replicate=2", "parallel.dp_shard=2"], 4, "1.25", id="dp_replicate=2xdp_shard=2"),
    # expert parallelism folded over dp_shard: edp = dp_shard / ep replicas of each expert
    pytest.param(["parallel.dp_shard=2", "parallel.ep=2"], 2, "null", id="ep=2-dropless"),
    pytest.param(["parallel.dp_shard=2", "parallel.ep=2"], 2, "1.25", id="ep=2-capacity"),
    pytest.param(["parallel.dp_shard=4", "parallel.ep=4"], 4, "1.25", id="ep=4"),
    # the exchange in two hops on 2 simulated nodes of 2 (parallel/node_dispatch.py), a group of experts per node
    pytest.param(["parallel.dp_shard=4", "parallel.ep=4", "parallel.ranks_per_node=2", *DEEPSEEK_V3], 4, "1.25",
                 id="ep=4-2-nodes-deepseek-v3"),
    pytest.param(["parallel.dp_shard=4", "parallel.ep=2"], 4, "null", id="ep=2xedp=2-dropless"),
    # HSDP experts: one shard per replica group (edp=1), all-reduced over dp_replicate
    pytest.param(["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.ep=2"], 4, "1.25",
                 id="dp_replicate=2xep=2"),
    # activation checkpointing under FSDP: the recompute gathers the block's shards (and redoes the all-to-alls)
    pytest.param(["parallel.dp_shard=2", "parallel.activation_checkpointing=full"], 2, "1.25",
                 id="dp_shard=2-recompute"),
    pytest.param(["parallel.dp_shard=2", "parallel.ep=2", "parallel.activation_checkpointing=moe"], 2, "null",
                 id="ep=2-recompute-moe"),
    # tensor parallelism: heads and FFN hidden split, router replicated; one data-parallel rank
    pytest.param(["parallel.tp=2"], 2, "null", id="tp=2-dropless"),
    pytest.param(["parallel.tp=2"], 2, "1.25", id="tp=2-capacity"),
    # ep=2 folded over the tp group: each tp rank sends its half of the rows to the experts
    pytest.param(["parallel.tp=2", "parallel.ep=2"], 2, "1.25", id="tp=2xep=2"),
    pytest.param(["parallel.dp_shard=2", "parallel.tp=2", "parallel.ep=2"], 4, "null", id="dp_shard=2xtp=2xep=2"),
    # HSDP of tensor-parallel shards: a 3-D (dp_replicate, dp_shard, tp) layout of the dense weights
    pytest.param(["parallel.dp_replicate=2", "parallel.tp=2", "parallel.ep=2"], 4, "1.25",
                 id="dp_replicate=2xtp=2xep=2"),
    # more expert replicas (edp=2) than data-parallel ranks (1): their gradients are summed, not averaged
    pytest.param(["parallel.tp=4", "parallel.ep=2"], 4, "null", id="tp=4xep=2"),
    # tensor parallelism's options: norms and residual stream on sequence slices (the MoE layer routes the
    # whole sequence); embedding, head and loss split over the vocabulary
    pytest.param(["parallel.tp=2", "parallel.sequence_parallel=true", *MUON], 2, "1.25",
                 id="tp=2-sequence_parallel-muon"),
    pytest.param(["parallel.tp=2", "parallel.vocab_parallel=true"], 2, "null", id="tp=2-vocab_parallel"),
    pytest.param(["parallel.dp_shard=2", "parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=true",
                  "parallel.vocab_parallel=true"], 4, "1.25", id="dp_shard=2xtp=2xep=2-sequence+vocab_parallel"),
    # Qwen3-MoE's shape: per-head q/k norms on each tp rank's heads (their gradients summed over tp), wide heads,
    # a dense first layer, top-k weights not renormalised
    pytest.param(["parallel.dp_shard=2", "parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=true",
                  "model.qk_norm=true", "model.head_dim=16", "model.first_moe_layer=1", "moe.renormalize=false"],
                 4, "null", id="dp_shard=2xtp=2xep=2-qwen3"),
    # group-limited routing with the experts of a group on one ep rank (2 groups, ep=2), latent attention replicated
    # over data parallelism, the MTP module an FSDP unit with its experts under ep; and the same model without MTP
    # in two pipeline stages (the dense block, then the MoE block)
    pytest.param(["parallel.dp_shard=2", "parallel.ep=2", *DEEPSEEK_V3_MTP], 2, "null", id="ep=2-deepseek-v3-mtp"),
    pytest.param(["parallel.pp=2", *DEEPSEEK_V3], 2, "1.25", id="pp=2-deepseek-v3"),
    # the whole V4 with its MTP module: the widened stream [micro, S, 4, D] between the stages, the token ids to the
    # second stage's hash layer, the hyper-connected MTP module there with the embedding copy; the same model under
    # FSDP and ep, the hash layer's tokens exchanged to the experts its table picks, the MTP module an FSDP unit
    pytest.param(["parallel.pp=2", *DEEPSEEK_V4, "model.mtp_depth=1"], 2, "null", id="pp=2-deepseek-v4-mtp"),
    pytest.param(["parallel.dp_shard=2", "parallel.ep=2", *DEEPSEEK_V4, "model.mtp_depth=1"], 2, "null",
                 id="ep=2-deepseek-v4-mtp"),
    # each tp rank the whole streams (replicated), each cp rank its positions' streams and ids
    pytest.param(["parallel.tp=2", "parallel.cp=2", *DEEPSEEK_V4_RESIDUAL], 4, "null",
                 id="tp=2xcp=2-deepseek-v4-residual"),
    # the MTP module on the last stage with a copy of the embedding, their gradients summed over the two stages
    # (the same micro-batches and model as the ep row: its reference run serves both)
    pytest.param(["parallel.pp=2", *DEEPSEEK_V3_MTP], 2, "null", id="pp=2-deepseek-v3-mtp"),
    # latent attention split by heads (the latent projections whole, the shared rotary key's gradient summed over
    # tp), with a full query projection; and with the query bottleneck under sequence parallelism, folded with ep
    pytest.param(["parallel.tp=2", *DEEPSEEK_V3_MTP, "model.q_lora_rank=null"], 2, "null", id="tp=2-deepseek-v3-mtp"),
    pytest.param(["parallel.dp_shard=2", "parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=true",
                  *DEEPSEEK_V3], 4, "1.25", id="dp_shard=2xtp=2xep=2-sequence_parallel-deepseek-v3"),
    # the MTP module on the whole sequence under sequence parallelism, its inputs gathered for it (the tp row's
    # model and micro-batches: its reference run serves both)
    pytest.param(["parallel.tp=2", "parallel.sequence_parallel=true", *DEEPSEEK_V3_MTP, "model.q_lora_rank=null"], 2,
                 "null", id="tp=2-sequence_parallel-deepseek-v3-mtp"),
    # and with the head split over the vocabulary: each module's cross-entropy on vocabulary-sharded logits
    pytest.param(["parallel.tp=2", "parallel.vocab_parallel=true", *DEEPSEEK_V3_MTP, "model.q_lora_rank=null"], 2,
                 "null", id="tp=2-vocab_parallel-deepseek-v3-mtp"),
    pytest.param(["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.vocab_parallel=true",
                  *DEEPSEEK_V3_MTP, "model.q_lora_rank=null"], 2, "null",
                 id="tp=2-sequence+vocab_parallel-deepseek-v3-mtp"),
    pytest.param(["parallel.pp=2", "parallel.tp=2", "parallel.vocab_parallel=true", *DEEPSEEK_V3_MTP,
                  "model.q_lora_rank=null"], 4, "null", id="pp=2xtp=2-vocab_parallel-deepseek-v3-mtp"),
    # GLM-4.5's attention split by heads: q/k/v biases split with their projections, RoPE on half of each head,
    # q/k norms on each rank's heads; its sigmoid routing with a shared expert behind a dense first layer
    pytest.param(["parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=true", "model.qkv_bias=true",
                  "model.rotary_dim=4", "model.qk_norm=true", "model.first_moe_layer=1", "moe.score_func=sigmoid",
                  "moe.num_shared_experts=1", "moe.routed_scaling_factor=2.5"], 2, "1.25", id="tp=2xep=2-glm-4.5"),
    # GPT-OSS: the biases and sinks FSDP-sharded, the experts' biases with their experts under ep; and in two
    # pipeline stages (a sliding layer, then a full one)
    pytest.param(["parallel.dp_shard=2", "parallel.ep=2", *GPT_OSS, *MUON], 2, "1.25", id="ep=2-gpt-oss-muon"),
    pytest.param(["parallel.pp=2", *GPT_OSS, *MUON], 2, "null", id="pp=2-gpt-oss-muon"),
    # Qwen3-Next: FSDP-sharded linear attention (its per-channel convolution and per-head decay too) with the experts
    # under ep; and in two pipeline stages (the linear layer, then the full one)
    pytest.param(["parallel.dp_shard=2", "parallel.ep=2", *QWEN3_NEXT], 2, "null", id="ep=2-qwen3-next"),
    pytest.param(["parallel.pp=2", *QWEN3_NEXT], 2, "null", id="pp=2-qwen3-next"),
    # its linear attention split by key heads (each with its value heads, convolution channels and decay), the
    # gated norm on each rank's heads, under sequence parallelism and folded with ep
    pytest.param(["parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=true", *QWEN3_NEXT], 2, "null",
                 id="tp=2xep=2-sequence_parallel-qwen3-next"),
    # context parallelism: each linear layer on its rank's positions, the recurrence's state and the convolution's
    # last inputs handed on in sequence order (every chunk's state map gathered and composed); the full layer
    # attends as before; at cp=4 in chunks of 4 positions (rule chunks of 8), the last one from 7 maps composed
    pytest.param(["parallel.cp=2", "parallel.dp_shard=1", *QWEN3_NEXT], 2, "null", id="cp=2-qwen3-next"),
    pytest.param(["parallel.cp=4", "parallel.dp_shard=1", *QWEN3_NEXT], 4, "null", id="cp=4-qwen3-next"),
    # MiniMax-M2: its per-layer q/k norms FSDP-sharded, the experts under ep
    pytest.param(["parallel.dp_shard=2", "parallel.ep=2", *MINIMAX_M2], 2, "null", id="ep=2-minimax-m2"),
    # packed documents masked from each other (data.document_mask): GPT-OSS's sinks split by heads and its blocked
    # window masked by document, on sequence slices; and latent attention in two pipeline stages, each given the
    # batch's document ids by the schedule
    pytest.param(["parallel.tp=2", "parallel.sequence_parallel=true", *GPT_OSS, *DOCUMENT_MASK], 2, "1.25",
                 id="tp=2-sequence_parallel-gpt-oss-document_mask"),
    pytest.param(["parallel.pp=2", *DEEPSEEK_V3, *DOCUMENT_MASK], 2, "null", id="pp=2-deepseek-v3-document_mask"),
    # expert tensor parallelism: each expert's hidden dim split over etp ranks inside the tp group
    pytest.param(["parallel.tp=2", "parallel.etp=2", *MUON], 2, "1.25", id="tp=2xetp=2-muon"),
    pytest.param(["parallel.dp_shard=2", "parallel.tp=2", "parallel.etp=2"], 4, "null", id="dp_shard=2xtp=2xetp=2"),
    pytest.param(["parallel.tp=4", "parallel.ep=2", "parallel.etp=2"], 4, "1.25", id="tp=4xep=2xetp=2"),
    # pipeline parallelism: one block per stage, the embedding on the first, head and loss on the last
    pytest.param(["parallel.pp=2"], 2, "null", id="pp=2-1f1b-dropless"),
    pytest.param(["parallel.pp=2"], 2, "1.25", id="pp=2-1f1b-capacity"),
    # recomputing blocks must not count their routing statistics twice
    pytest.param(["parallel.pp=2", "parallel.pp_schedule=gpipe", "parallel.activation_checkpointing=full"], 2,
                 "1.25", id="pp=2-gpipe-recompute"),
    pytest.param(["model.n_layers=4", "parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b",
                  "parallel.pp_virtual_stages=2"], 2, "null", id="pp=2-interleaved-v=2"),
    pytest.param(["parallel.pp=2", "parallel.dp_shard=2", "parallel.ep=2"], 4, "1.25", id="pp=2xdp_shard=2xep=2"),
    # all four at once on 8 ranks: 2 stages, each tp=2 × dp_shard=2 with ep=2 folded over dp_shard × tp
    pytest.param(["parallel.pp=2", "parallel.tp=2", "parallel.dp_shard=2", "parallel.ep=2"], 8, "null",
                 id="pp=2xtp=2xdp_shard=2xep=2"),
    # stages passing sequence slices; the last stage's loss from vocabulary-sharded logits
    pytest.param(["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                  "parallel.vocab_parallel=true"], 4, "1.25", id="pp=2xtp=2-sequence+vocab_parallel"),
    # context parallelism: each rank two chunks of every sequence (one from each end), keys and values gathered
    pytest.param(["parallel.cp=2"], 2, "null", id="cp=2"),
    pytest.param(["parallel.cp=4"], 4, "null", id="cp=4"),
    # with tp and sequence parallelism: each cp rank's positions cut again over tp between the blocks
    pytest.param(["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"], 4, "null",
                 id="cp=2xtp=2-sequence_parallel"),
    # expert parallelism folded over cp: each rank sends its positions' rows to the experts
    pytest.param(["parallel.cp=2", "parallel.ep=2"], 2, "null", id="cp=2xep=2"),
    pytest.param(["parallel.cp=2", "parallel.pp=2"], 4, "null", id="cp=2xpp=2"),
    # latent attention gathers its latent and rotary key; GPT-OSS's window and sinks on a rank's positions, masked
    # by document
    pytest.param(["parallel.cp=2", "parallel.dp_shard=2", "parallel.ep=2", *DEEPSEEK_V3], 4, "null",
                 id="cp=2xdp_shard=2xep=2-deepseek-v3"),
    pytest.param(["parallel.cp=2", *GPT_OSS, *DOCUMENT_MASK], 2, "null", id="cp=2-gpt-oss-document_mask"),
    # sparse attention (DeepSeek-V3.2): the indexers sharded over data parallelism with group-limited routing
    # under ep; in two stages through the dense warm-up (indexers alone learning) into the sparse stage; and under
    # cp, each rank's queries selecting among the whole sequence's keys (the indexer's keys gathered with the latents)
    pytest.param(["parallel.dp_shard=2", "parallel.ep=2", *DEEPSEEK_V32], 2, "null", id="ep=2-deepseek-v3.2"),
    pytest.param(["parallel.pp=2", *DEEPSEEK_V32, "train.indexer_warmup_steps=2"], 2, "null",
                 id="pp=2-deepseek-v3.2-warmup"),
    pytest.param(["parallel.cp=2", *DEEPSEEK_V32_GATHERED], 2, "null", id="cp=2-deepseek-v3.2"),
    # GLM-5's second layer attending to the first's selection, under cp (each rank's queries, the whole sequence)
    pytest.param(["parallel.cp=2", *DEEPSEEK_V32_GATHERED, "model.indexer_types=[full,shared]"], 2, "null",
                 id="cp=2-glm-5-shared-selection"),
    # and split by heads: the indexer whole on every tp rank, its target summed over the ranks' heads
    pytest.param(["parallel.tp=2", *DEEPSEEK_V32_GATHERED], 2, "null", id="tp=2-deepseek-v3.2"),
    # DeepSeek-V4's attention split by heads (one output group per rank), its key/value head, compressors and
    # indexer whole on every rank, with sequence parallelism; and the whole of V4 (the hyper-connected streams, a
    # hash-routed layer) under tp
    pytest.param(["parallel.tp=2", "parallel.sequence_parallel=true", *DEEPSEEK_V4_ATTENTION], 2, "null",
                 id="tp=2-sp-deepseek-v4-attention"),
    pytest.param(["parallel.tp=2", *DEEPSEEK_V4_ATTENTION, *DEEPSEEK_V4_RESIDUAL,
                  "model.mlp_layer_types=[hash_moe, moe, moe]"], 2, "null", id="tp=2-deepseek-v4"),
    # and with sequence parallelism: the streams [B, S / tp, 4, D] between the blocks, the hyper-connections on each
    # rank's slice (their weights' gradients summed over tp), the hash layer's ids whole (the reference above's)
    pytest.param(["parallel.tp=2", "parallel.sequence_parallel=true", *DEEPSEEK_V4_ATTENTION, *DEEPSEEK_V4_RESIDUAL,
                  "model.mlp_layer_types=[hash_moe, moe, moe]"], 2, "null", id="tp=2-sp-deepseek-v4"),
    pytest.param(["parallel.cp=2", *DEEPSEEK_V4_ATTENTION], 2, "null", id="cp=2-deepseek-v4-attention"),
    # gradient accumulation, 2 micro-batches per rank, both parallel.grad_reduce settings: reduced once per
    # step (unsharded gradients accumulated), or reduce-scattered per micro-batch with HSDP's all-reduce once
    pytest.param(["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.grad_reduce=step",
                  "train.micro_batch_size=1"], 4, "1.25", id="dp_replicate=2xdp_shard=2-2mb-step"),
    pytest.param(["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.ep=2", "parallel.grad_reduce=microbatch",
                  "train.micro_batch_size=1"], 4, "1.25", id="dp_replicate=2xep=2-2mb-microbatch"),
    # experts FSDP-sharded over edp=2 (their own units), and outside FSDP (ep=2 spans dp_shard: only divided)
    pytest.param(["parallel.dp_shard=4", "parallel.ep=2", "parallel.grad_reduce=step", "train.micro_batch_size=1"],
                 4, "null", id="ep=2xedp=2-2mb-step"),
    pytest.param(["parallel.dp_shard=4", "parallel.ep=2", "parallel.grad_reduce=microbatch",
                  "train.micro_batch_size=1"], 4, "null", id="ep=2xedp=2-2mb-microbatch"),
    pytest.param(["parallel.dp_shard=2", "parallel.ep=2", "parallel.grad_reduce=step", "train.micro_batch_size=2"],
                 2, "1.25", id="ep=2-2mb-step"),
    pytest.param(["parallel.pp=2", "parallel.dp_shard=2", "parallel.ep=2", "parallel.grad_reduce=microbatch"],
                 4, "1.25", id="pp=2xdp_shard=2xep=2-microbatch"),
    # QK-clip (training/qk_clip.py) under Muon (MuonClip) at thresholds that some of the toy heads' logits (0.02-0.06)
    # cross: the heads' maxima max-reduced over dp_shard, each tp rank scaling its own heads' rows, FSDP's shards of
    # tp's rows (and of the q/k biases) scaled in place, Muon gathering those strided shards (dp_shard and tp both cut
    # a matrix); and latent attention's nope and rotary query rows under tp
    pytest.param(["parallel.dp_shard=2", "parallel.tp=2", "parallel.ep=2", "model.qkv_bias=true", *MUON,
                  "train.qk_clip_threshold=0.05"], 4, "null", id="dp_shard=2xtp=2xep=2-muon-qk_clip"),
    pytest.param(["parallel.tp=2", *DEEPSEEK_V3, *MUON, "train.qk_clip_threshold=0.025"], 2, "null",
                 id="tp=2-deepseek-v3-muon-qk_clip"),
    # and under context parallelism: each rank's queries against every rank's gathered keys at their positions, the
    # maxima max-reduced over dp x cp (the same models and micro-batches as the two rows above: their references)
    pytest.param(["parallel.cp=2", "parallel.dp_shard=2", "parallel.ep=2", "model.qkv_bias=true", *MUON,
                  "train.qk_clip_threshold=0.05"], 4, "null", id="cp=2xdp_shard=2xep=2-muon-qk_clip"),
    pytest.param(["parallel.cp=2", *DEEPSEEK_V3, *MUON, "train.qk_clip_threshold=0.025"], 2, "null",
                 id="cp=2-deepseek-v3-muon-qk_clip"),
    # Muon under cp x tp: FSDP's strided shards of tp's rows over the flattened dp_shard x cp mesh (also run, not kept:
    # dp_shard=2 x cp=2 x tp=2 x ep=2 on 8 ranks)
    pytest.param(["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true", *MUON], 4, "null",
                 id="cp=2xtp=2-sequence_parallel-muon"),
    # hot experts replicated into other ep ranks' slots (parallel/replica_exchange.py): rows computed elsewhere, the
    # slots' gradients returned to the owners (the MoE layers recomputed in backward, copies and all); with the
    # experts FSDP-sharded over edp=2 and their rows split over tp
    pytest.param(["parallel.dp_shard=2", "parallel.ep=2", "parallel.ep_replicas=1",
                  "parallel.activation_checkpointing=moe"], 2, "null", id="ep=2-replicas=1-dropless-recompute-moe"),
    pytest.param(["parallel.dp_shard=4", "parallel.ep=4", "parallel.ep_replicas=2"], 4, "1.25",
                 id="ep=4-replicas=2-capacity"),
    pytest.param(["parallel.dp_shard=8", "parallel.ep=8", "parallel.ep_replicas=2", "moe.num_experts=8"], 8, "null",
                 id="ep=8-replicas=2-dropless"),
    pytest.param(["parallel.dp_shard=2", "parallel.tp=2", "parallel.ep=2", "parallel.ep_replicas=1"], 4, "null",
                 id="dp_shard=2xtp=2xep=2-replicas=1"),
    pytest.param(["parallel.pp=2", "parallel.dp_shard=2", "parallel.ep=2", "parallel.ep_replicas=1"], 4, "1.25",
                 id="pp=2xdp_shard=2xep=2-replicas=1"),
    # each etp rank fetches its hidden-dim slice of the slots' experts
    pytest.param(["parallel.tp=4", "parallel.ep=2", "parallel.etp=2", "parallel.ep_replicas=1"], 4, "1.25",
                 id="tp=4xep=2xetp=2-replicas=1"),
]


def final_val_loss(run_dir) -> float:
    return [r["val/loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "val/loss" in r][-1]


def resolve(layout: list[str], world_size: int) -> Layout:
    degrees = {key: int(value) for key, value in (o.removeprefix("parallel.").split("=") for o in layout
                                                  if o.startswith("parallel.")) if key in DEGREES}
    return Layout.resolve(world_size, **degrees)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Single-process runs, one per capacity setting, computed once."""
    cache = {}

    def get(settings: list[str]):
        key = tuple(settings)
        if key not in cache:
            run_dir = tmp_path_factory.mktemp("reference")
            cache[key] = (*run(settings, 1, run_dir), final_val_loss(run_dir))
        return cache[key]

    return get


@pytest.mark.parametrize("layout, world_size, capacity", LAYOUTS)
def test_layout_matches_single_process(layout, world_size, capacity, references, tmp_path):
    degrees = resolve(layout, world_size)
    # sequences per micro-batch: the global 8 over the data-parallel ranks and the pipeline stages
    # capacity drops the lowest-weighted assignments by default; two near-equal weights at an expert's
    # cut-off (seen: within 1e-7) are ordered by the fp32 noise of the layout's reduction order, so one
    # different token is dropped and the runs part by ~1e-5 per step. Dropping by position keeps the check
    # about the layout (the probability policy is ``moe/dispatch.py``'s own, local to a micro-batch).
    policy = [] if capacity == "null" else ["moe.drop_policy=position"]
    settings = [f"train.steps={STEPS}", f"moe.capacity_factor={capacity}", *policy,
                f"train.micro_batch_size={8 // (degrees.dp * degrees.pp)}",
                *[o for o in layout if not o.startswith("parallel.")]]
    ref_records, ref_state, ref_val = references(settings)
    records, state = run([*settings, *[o for o in layout if o.startswith("parallel.")]], world_size, tmp_path)

    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for ref, got in zip(ref_records, records, strict=True):
        mtp = ["train/mtp_loss"] if "model.mtp_depth=1" in layout else []
        qk_clip = ["qk_clip/heads_clipped", "qk_clip/max_logit"] if "qk_clip/max_logit" in ref else []
        indexer = ["train/indexer_loss"] if "train/indexer_loss" in ref else []
        for key in ("train/loss", "train/aux_loss", "train/z_loss", "train/grad_norm", "train/dropped_frac", *mtp,
                    *qk_clip, *indexer):
            assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-7), (got["step"], key)
        # every layer's routing figures reach rank 0's log (under pp also those of the other stages)
        router_keys = [key for key in ref if key.startswith("router/")]
        assert "router/layer1/load" in router_keys
        for key in router_keys:  # loads are ratios of token counts: equal routing gives equal values
            rel = 1e-6 if key.endswith("/load") else 1e-4
            assert got[key] == pytest.approx(ref[key], rel=rel, abs=1e-7), (got["step"], key)
    assert ref_records[-1]["train/loss"] < ref_records[0]["train/loss"]  # it trained: the check has teeth
    if any(o.startswith("parallel.ep_replicas") for o in layout):  # the replicas computed rows: the check has teeth
        assert all(r["ep/imbalance_after"] <= r["ep/imbalance_before"] for r in records)
        assert any(r["ep/imbalance_after"] < r["ep/imbalance_before"] - 0.05 for r in records)
    if any(o.startswith("train.qk_clip_threshold") for o in layout):  # the clip fired, so the rows test it
        assert sum(r["qk_clip/heads_clipped"] for r in ref_records) > 0
    assert final_val_loss(tmp_path) == pytest.approx(ref_val, rel=1e-4)
    assert state.keys() == ref_state.keys()
    for name in ref_state:
        assert_parameter_close(state[name], ref_state[name], name)


def test_group_limited_routing_of_the_parity_rows_excludes_experts(references):
    """The ep=2 DeepSeek-V3 row checks group-limited routing only if the limit changes choices: with the
    reference's final weights, some tokens' plain top-2 of the biased scores would span both groups, while every
    routed token's two experts lie in one group (so each token reaches one ep rank)."""
    from config.run import load_config
    from moe.transformer import MoETransformer
    from tests.parallel.parity import TINY

    settings = [f"train.steps={STEPS}", "moe.capacity_factor=null", "train.micro_batch_size=4", *DEEPSEEK_V3_MTP]
    _, ref_state, _ = references(settings)
    config = load_config("moe-8x", [*TINY, *settings])
    model = MoETransformer(config.model, config.moe)
    model.load_state_dict(ref_state)
    router = model.moe_layers()[1].router
    assert router.expert_bias.abs().sum() > 0  # the bias was trained, and steers the choice
    seen = []
    router.register_forward_hook(lambda module, args, out: seen.append((args[0], out)))
    with torch.no_grad():
        model(torch.randint(0, config.model.vocab_size, (4, config.model.seq_len),
                            generator=torch.Generator().manual_seed(0)))
    tokens, routed = seen[0]
    groups = routed.expert_ids // 2  # experts 0, 1 form group 0; 2, 3 group 1
    assert (groups[:, 0] == groups[:, 1]).all()  # one group per token
    biased = torch.sigmoid(tokens.float() @ router.gate.t()) + router.expert_bias
    plain_groups = biased.topk(2, dim=-1).indices // 2
    assert (plain_groups[:, 0] != plain_groups[:, 1]).any()  # the limit excluded experts plain top-k would take


def assert_parameter_close(got: torch.Tensor, ref: torch.Tensor, name: str) -> None:
    """Final weights agree to 1e-4 (relative and absolute), but for at most 0.1% of a tensor's elements.

    Adam divides each update by the running magnitude of the element's own gradient, so where a gradient is
    near zero the fp32 noise of a different reduction order is amplified up to ~lr per step (seen: 1.1e-4 on
    1 element of 1,024 on 8 ranks). Those few may differ by up to 1e-3. A real error (an expert's gradient
    lost, doubled or sent to the wrong expert; a slice of a matrix mixed up) moves whole rows or slices by
    ~lr = 1e-2 or by the weights' own scale, far beyond both limits.
    """
    assert got.shape == ref.shape, name
    close = torch.isclose(got, ref, rtol=1e-4, atol=1e-4)
    outliers = (~close).sum().item()
    assert outliers <= ref.numel() // 1000, f"{name}: {outliers} of {ref.numel()} elements differ by more than 1e-4"
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-3, msg=lambda m: f"{name}: {m}")


# FSDP2 mixed precision: the FSDP units gather and compute bf16 weights (fp32 masters, fp32 reductions, the
# routers fp32 units of their own) against one process computing under bf16 autocast from fp32 weights.
BF16_LAYOUTS = [
    pytest.param(["parallel.dp_shard=2"], 2, id="dp_shard=2-bf16"),
    # the DeepSeek-V3 family with its MTP module (the routers of its MoE block and of the module fp32 units of their
    # own, the module a bf16 unit), trained by Muon in its default bf16 iteration; it replaces the plain model's row
    # on the same layout
    pytest.param(["parallel.dp_shard=2", "parallel.ep=2", *DEEPSEEK_V3_MTP, "train.optimizer=muon"], 2,
                 id="ep=2-deepseek-v3-mtp-bf16-muon"),
    pytest.param(["parallel.dp_shard=4", "parallel.ep=2", "parallel.grad_reduce=step", "train.micro_batch_size=1"],
                 4, id="ep=2xedp=2-2mb-step-bf16"),
    pytest.param(["parallel.pp=2", "parallel.dp_shard=2"], 4, id="pp=2xdp_shard=2-bf16"),
    # FSDP over dp_shard × cp, bf16 units: each rank's positions of its sequences
    pytest.param(["parallel.cp=2", "parallel.dp_shard=2"], 4, id="cp=2xdp_shard=2-bf16"),
    # hot experts' replicas fetched in bf16 from the owners' gathered weights (the edp=2 row's reference)
    pytest.param(["parallel.dp_shard=4", "parallel.ep=2", "parallel.ep_replicas=1", "parallel.grad_reduce=step",
                  "train.micro_batch_size=1"], 4, id="ep=2xedp=2-replicas=1-bf16"),
]


@pytest.mark.parametrize("layout, world_size", BF16_LAYOUTS)
def test_fsdp_bf16_matches_one_process_in_bf16(layout, world_size, references, tmp_path):
    """bf16 tolerances. Both runs round to bf16 (8 significant bits, relative steps of 2^-8), but not the same
    tensors: autocast casts each fp32 weight and input per matmul, FSDP gathers weights already in bf16 and keeps
    the embedding's output in it. Seen over 5 steps: losses within 1.5e-4 of each other, gradient norms 1.3e-3.
    An error of the layout (a gradient reduced twice or not at all, a shard of the wrong rows) moves them by
    tens of percent. Routing figures are not compared: a bf16 difference flips near-tied top-k choices, and
    a counted load moves by whole tokens. ``tests/parallel/test_mixed_precision.py`` checks the policy itself."""
    degrees = resolve(layout, world_size)
    settings = [f"train.steps={STEPS}", "moe.capacity_factor=null", "train.precision=bf16",
                f"train.micro_batch_size={8 // (degrees.dp * degrees.pp)}",
                *[o for o in layout if not o.startswith("parallel.")]]
    ref_records, ref_state, ref_val = references(settings)
    records, state = run([*settings, *[o for o in layout if o.startswith("parallel.")]], world_size, tmp_path)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    mtp = ["train/mtp_loss"] if "model.mtp_depth=1" in layout else []
    for ref, got in zip(ref_records, records, strict=True):
        for key in ("train/loss", *mtp):
            assert got[key] == pytest.approx(ref[key], rel=1e-3), (got["step"], key)
        assert got["train/aux_loss"] == pytest.approx(ref["train/aux_loss"], rel=1e-2), got["step"]
        assert got["train/grad_norm"] == pytest.approx(ref["train/grad_norm"], rel=1e-2), got["step"]
    assert ref_records[-1]["train/loss"] < ref_records[0]["train/loss"]
    assert final_val_loss(tmp_path) == pytest.approx(ref_val, rel=1e-3)
    assert state.keys() == ref_state.keys()
    # the master weights stay fp32. They are not compared element by element: Adam moves every element by about
    # lr a step whatever its gradient's size, so where bf16 rounding flips the sign of a near-zero gradient the
    # two runs part by up to 2·lr a step (seen: 18% of a tiny expert stack's norm after 5 steps at lr 1e-2)
    # while the function they compute stays the same (the losses and the validation loss above)
    assert all(value.dtype == torch.float32 for value in state.values())
