"""Activations of one rank: what autograd saves for backward in one micro-batch's forward, by part.

Each function lists the tensors the modules of ``moe/`` save (found with ``saved_activation_bytes`` and
checked byte for byte by ``tests/analysis/test_memory.py``), on this rank's share of the work: its heads
and hidden slices under tp, its share of the routed rows under tp / ep / etp, the S/tp slice of the
residual stream under sequence parallelism, its S/cp positions of each sequence under context parallelism.
Routing is assumed balanced.

What context parallelism adds (``parallel/context.py``): every attention layer attends from this rank's S/cp
queries to all S keys, so the keys and values it saves for backward are the whole sequence's (the all-gathered
tensor itself, which k and v are views of; for latent attention the gathered latent and rotary key, and the
up-projected keys and values of all S positions), and it attends under a boolean [1, 1, S/cp, S] mask (its
queries are not one run of positions), which SDPA saves as an additive mask in the compute dtype, one per layer;
whole sequences in a model without windows or sinks attend by chunks instead, each chunk's keys up to its end,
with no whole-sequence mask (``_causal_shard_extras``).
The forward also gathers its queries' rows of the rotary tables once ([1, 1, S/cp, r/2], cos and sin, fp32),
which every layer's RoPE saves.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from analysis.dispatch_reach import exchange_counts, node_exchange_counts
from analysis.memory_states import (
    FP32,
    Block,
    in_fsdp_unit,
    largest_chunk,
    local_layers,
    rank_blocks,
    root_tensors,
    tp_local_shape,
)
from config.model import ModelConfig, MoEConfig
from config.run import RunConfig
from moe.dispatch import expert_capacity
from moe.experts import padded_rows, row_multiple_on
from moe.norm import uses_fused_backward
from moe.sequence_shards import attends_by_chunks
from moe.transformer import SINK_CHANNELS, blocked_window
from parallel.expert import exchanges_by_node, exchanges_pairs
from parallel.layout import Layout
from parallel.ranks import ExpertNodes, expert_nodes

INDEX = 8  # int64 ids and indices
OFFSET = 4  # the grouped GEMM's int32 group offsets
COMPUTE_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch on one rank: T = b·s tokens (s = S/cp under context parallelism), ``stream`` of them in
    the residual stream (T/tp under SP); attention's keys are cp times its queries."""

    tokens: int
    stream: int
    sequences: int
    compute: int  # bytes of the compute dtype
    bf16: bool
    bf16_weights: bool = False  # dense weights in FSDP units gathering bf16 (``parallel.sharding.mixed_precision``)
    group_rows: int = 1  # experts' groups padded to a multiple of this many rows (``moe.experts.row_multiple_on``)
    cp: int = 1  # context-parallel ranks: the keys of a sequence are cp times this rank's positions of it
    cp_rank: int | None = None  # which context-parallel rank (None: the one that saves the most)
    cpu: bool = False  # on a CPU a cp rank's chunks attend without masks (``moe.sequence_shards._ChunkAttention``)


def _norm(rows: int, d: int, fused: bool) -> int:
    """RMSNorm over ``rows`` rows of ``d``, all saved in fp32: the input and the [rows] rstd where its backward
    is fused (``moe.norm.uses_fused_backward``: an fp32 plain-tensor input); the normalised input too where
    autograd differentiates the decomposed ops (DTensor inputs under tensor parallelism; bf16 inputs, q/k under
    autocast and the residual stream under FSDP's bf16 weights, whose fp32 upcast is what it saves)."""
    return rows * ((1 if fused else 2) * d + 1) * FP32


def _linear_inputs(mb: MicroBatch, d: int, consumers: int, saved_in_fp32: bool = True) -> int:
    """The [T, d] input of ``consumers`` column-parallel projections: one fp32 tensor, or one bf16 cast each
    (autocast casting it per matmul), or one bf16 cast they share when their weights are gathered in bf16
    (measured: ``tests/analysis/test_memory.py``'s bf16 FSDP layouts)."""
    if mb.bf16 and mb.bf16_weights:
        return mb.tokens * d * mb.compute
    if mb.bf16:
        return consumers * mb.tokens * d * mb.compute
    return mb.tokens * d * FP32 if saved_in_fp32 else 0


def _attention(model: ModelConfig, tp: int, mb: MicroBatch, window: int | None = None) -> int:
    """wq/wk/wv input; SDPA's q, k (after RoPE), v, output and [b, heads, s] logsumexp; wo's input; with
    ``qk_norm`` the per-head norms of q and k (each of the T·heads rows of hd, as an RMSNorm saves them).

    GPT-OSS's options (``moe/transformer.py``): a layer with a ``window`` or ``attention_sinks`` attends under a
    boolean mask, which SDPA saves as an additive mask in the compute dtype: [S, K] shared by heads and
    sequences, or per block of a blocked window, whose b·nb blocks of W queries each see 2W keys (their k and v
    saved per block). The sink adds one key and ``SINK_CHANNELS`` channels to q, k, v and the output.
    wo's input is the output made contiguous, a copy unless one head per rank makes it a view.
    Under context parallelism the S/cp queries attend to all S keys: k and v are views of the gathered
    [b, kv_heads, S, 2·hd] tensor, or, by chunks (``_causal_shard_extras``), copies in position order of the same
    bytes; either way k and v count those bytes.
    """
    heads, kv_heads, hd = model.n_heads // tp, model.kv_heads // tp, model.head_size
    sink = 1 if model.attention_sinks else 0
    seq = mb.tokens // mb.sequences  # positions per sequence: S (S/cp), or S - k in multi-token prediction's module k
    blocked = blocked_window(seq, window) and mb.cp == 1  # a cp rank's queries take the masked path
    if blocked:
        batches, queries, keys = mb.sequences * -(-seq // window), window, 2 * window
    else:
        batches, queries, keys = mb.sequences, seq, seq * mb.cp
    keys, width = keys + sink, hd + sink * SINK_CHANNELS
    sdpa = batches * width * (queries * 2 * heads + keys * 2 * kv_heads) * mb.compute  # q and output, k and v
    logsumexp = batches * queries * heads * FP32
    chunked = _causal_shards(model, mb)
    masked = sink or window is not None or (mb.cp > 1 and not chunked)
    mask = (batches if blocked else 1) * queries * keys * mb.compute if masked else 0
    mask += _causal_shard_extras(mb) if chunked else 0
    wo_input = 0 if heads == 1 and not (sink or blocked) else mb.tokens * heads * hd * mb.compute
    fused = uses_fused_backward(torch.bfloat16 if mb.bf16 else torch.float32, distributed=tp > 1)
    qk_norms = _norm(mb.tokens * heads, hd, fused) + _norm(mb.tokens * kv_heads, hd, fused) if model.qk_norm else 0
    return _linear_inputs(mb, model.d_model, 3) + sdpa + logsumexp + mask + wo_input + qk_norms


def _causal_shards(model: ModelConfig, mb: MicroBatch) -> bool:
    """Whether a context-parallel rank attends by chunks without a whole-sequence mask
    (``moe.sequence_shards.SequenceShards.causal_attention``): whole sequences (document masks are not modelled
    here) in a model with no window and no sinks, whose layers would need the mask (``MoETransformer.forward``)."""
    return mb.cp > 1 and attends_by_chunks(model)


def _causal_shard_extras(mb: MicroBatch) -> int:
    """What attending by chunks saves beyond q, k, v, the outputs and their log-sum-exps, per layer: the keys'
    order (S int64, one index for k and v) and, but on a CPU (two flash calls merged, no mask), each chunk's
    additive [C, end] mask in the compute dtype (C = S/(2·cp) queries, the keys up to the chunk's end), but for the
    first rank's front chunk, the square causal case with no mask."""
    chunk, cp = mb.tokens // mb.sequences // 2, mb.cp
    if mb.cpu:
        return 2 * cp * chunk * INDEX

    def masks(rank: int) -> int:
        ends = ((rank + 1) * chunk, (2 * cp - rank) * chunk)
        return sum(chunk * end for end in ends if end != chunk) * mb.compute

    ranks = range(cp) if mb.cp_rank is None else [mb.cp_rank]
    return 2 * cp * chunk * INDEX + max(masks(rank) for rank in ranks)


def _latent_attention(model: ModelConfig, tp: int, mb: MicroBatch) -> int:
    """Latent attention (``moe/latent_attention.py``) on this rank's nh/tp heads.

    Saved: the block's input (read by ``wq`` or ``wq_a``, and ``wkv_a``); with a query bottleneck its norm's input
    and rstd and ``wq_b``'s input; in fp32 ``wkv_a``'s whole [T, c + r] output, which the latent norm saves (its
    input is a view of it), with rstd (under bf16 autocast the norm's fp32 upcast and output instead); ``wkv_b``'s
    input; SDPA's q, k, v, output and logsumexp, heads w = max(n + r, v) wide (the narrower side zero-padded), where
    v is a view of ``wkv_b``'s [T, nh·(n + v)] output, whose storage it keeps, unless padded (a new tensor);
    ``wo``'s input (a copy, but of one unpadded head).

    Under context parallelism the keys and values are the whole sequence's, K = cp·T positions: ``wkv_b``'s input
    is then a copy of the gathered [B, S, c + r] tensor's latent columns (K·c; the gathered tensor itself is not
    saved), k and v are K positions long, and SDPA saves its additive [S/cp, S] mask.
    """
    heads, nope, rope, v = model.n_heads // tp, model.qk_nope_head_dim, model.qk_rope_head_dim, model.v_head_dim
    t, latent, a = mb.tokens, model.kv_lora_rank, mb.compute
    keys = t * mb.cp
    width = max(nope + rope, v)
    total = _linear_inputs(mb, model.d_model, 2)
    if model.q_lora_rank is not None:
        rank = model.q_lora_rank
        total += _norm(t, rank, fused=not mb.bf16) + t * rank * a
    if mb.bf16:  # the norm's bf16 input upcast: saved as a new fp32 tensor, with the normalised one (decomposed)
        total += _norm(t, latent, fused=False)
    else:  # fused: its input, a view of wkv_a's fp32 [T, c + r] output, keeps that storage; rstd
        total += t * (latent + rope) * FP32 + t * FP32
    total += keys * latent * a  # wkv_b's input
    chunked = _causal_shards(model, mb)
    # padded, or the up-projection's output it is a view of; by chunks a copy in position order, w wide
    values = width if v < width or chunked else nope + v
    total += (2 * t + keys) * heads * width * a + keys * heads * values * a  # q, out; k; v
    total += t * heads * FP32  # logsumexp
    if chunked:
        total += _causal_shard_extras(mb)
    elif mb.cp > 1:  # the additive mask of this rank's queries over every key
        total += (t // mb.sequences) * (keys // mb.sequences) * a
    wo_input = 0 if heads == 1 and v == width else t * heads * v * a
    return total + wo_input


def _feed_forward(mb: MicroBatch, d: int, hidden: int, input_saved: bool = True) -> int:
    """SwiGLU: its input, then the gate pre-activation, silu(gate), the up projection and their product."""
    return _linear_inputs(mb, d, 2, input_saved) + 4 * mb.tokens * hidden * mb.compute


def kept_assignments(tokens: int, moe: MoEConfig) -> int:
    """Assignments an MoE layer computes under balanced routing: T·k, at most C·E with a capacity."""
    if moe.capacity_factor is None:
        return tokens * moe.top_k
    capacity = expert_capacity(tokens, moe.top_k, moe.num_experts, moe.capacity_factor)
    return min(tokens * moe.top_k, capacity * moe.num_experts)


def _router(moe: MoEConfig, d: int, mb: MicroBatch) -> int:
    """fp32 always (``moe/router.py``): the input (and jitter noise), scores, ids, renormalisation, aux terms."""
    t, e, k = mb.tokens, moe.num_experts, moe.top_k
    total = t * d * FP32 * (2 if moe.jitter_eps > 0 else 1) + t * e * FP32 + t * k * INDEX  # softmax/sigmoid out
    if moe.renormalize:
        total += t * k * FP32 + t * FP32  # the selected weights and their sum
    if moe.aux_loss_coef > 0:
        sequences = mb.sequences if moe.aux_loss_scope == "sequence" else 1
        total += sequences * e * FP32 + FP32  # f_i per sequence, the loss kept by attach_loss
        if moe.score_func == "sigmoid":
            total += t * FP32  # probs = scores / their sum: the sum
    if moe.z_loss_coef > 0:
        total += t * e * FP32 + t * FP32 + FP32  # logits and logsumexp for the z-loss; the loss
    return total


def _moe(model: ModelConfig, moe: MoEConfig, layout: Layout, mb: MicroBatch,
         ranks_per_node: int | None = None) -> dict[str, int]:
    """One MoE layer: router, permuted tokens and experts (this rank's share of the rows), combine, shared experts.

    Under tp each tp rank computes 1/(tp/etp) of the grouped rows (a copy of its share); under ep those
    rows travel to the experts' ranks and (balanced) as many arrive; etp splits the hidden dim.
    """
    d, a = model.d_model, mb.compute
    kept = kept_assignments(mb.tokens, moe)
    rows = largest_chunk(kept, layout.tp // layout.etp)  # this rank's share (the largest)
    hidden = moe.expert_hidden // layout.etp
    swiglu = moe.gated
    local_experts = moe.num_experts // layout.ep
    pairs = exchanges_pairs(layout.ep, layout.tp, moe.top_k)
    if pairs:  # the exchange by (token, rank) pairs keeps its own indices, counted with the combine
        experts = 0
    else:
        experts = mb.tokens * moe.top_k * INDEX  # the assignments' grouped rows, for permute's backward
    if layout.ep > 1 and not pairs:  # received rows' reorder index and its inverse
        experts += 2 * rows * INDEX
    # Groups padded (CPU bf16): balanced, their sizes differ by one at most; plus each row's padded place and the
    # padding rows' own index (``moe.experts.GroupPadding``). Exact
    # without tp; under tp a share is contiguous rows whose groups differ from these: within 15 rows per expert.
    if mb.group_rows > 1:
        sizes = [rows // local_experts + (e < rows % local_experts) for e in range(local_experts)]
        rows = padded_rows(sizes, mb.group_rows)
        experts += rows * INDEX  # each row's padded place, and the padding rows (zeroed in the gradient's padding)
    # the grouped rows (this tp rank's share), the hidden activations, the group offsets. SwiGLU keeps the gate,
    # silu(gate), up and their product (w_out's input); the clamped SwiGLU (``moe.experts.clamped_swiglu``) the gate
    # and up before their clamps, the clamped gate, its sigmoid, g·sigmoid, clamped up + 1 and the product
    activations = {"swiglu": 4, "clamped_swiglu": 7}.get(moe.activation, 2)
    experts += rows * d * a + activations * rows * hidden * a + (3 if swiglu else 2) * local_experts * OFFSET
    if moe.expert_proj_bias:  # each row's expert, by which the bias adds gather (one index for the three)
        experts += rows * INDEX
    parts = {"MoE router": _router(moe, d, mb), "MoE experts": experts,
             # expert outputs, their weights, the order and the token index
             "MoE combine": kept * d * a + kept * a + 2 * kept * INDEX}
    if ranks_per_node and exchanges_by_node(layout, moe.top_k, ranks_per_node):
        parts["MoE combine"] = _node_combine(moe, expert_nodes(layout, ranks_per_node), mb, d)
    elif pairs:
        parts["MoE combine"] = _pair_combine(moe, layout, mb, d)
    if moe.num_shared_experts:
        parts["shared experts"] = _feed_forward(mb, d, moe.shared_hidden // layout.tp, moe.jitter_eps > 0)
    return parts


def _pair_combine(moe: MoEConfig, layout: Layout, mb: MicroBatch, d: int) -> int:
    """The exchange by (token, rank) pairs (``parallel/expert_dispatch.py``), on the busiest ep rank under balanced
    routing (``analysis.dispatch_reach.exchange_counts``, as the communication model counts it): the received
    assignments' expert outputs and weights (compute dtype) kept for the weighting; as int64 indices, the sent pairs'
    tokens and the sent assignments, the received assignments' pair and order (two), each received pair's slots
    (one per local choice, min(k, L)) and each home token's pairs (min(k, ep))."""
    ep, local = layout.ep, moe.num_experts // layout.ep
    sent_pairs, sent = exchange_counts(moe, mb.tokens, ep)
    received_pairs, received = max((ep * sent_pairs[r], ep * sent[r]) for r in range(ep))  # every rank sends alike
    indices = (sum(sent_pairs) + sum(sent) + 2 * received + received_pairs * min(moe.top_k, local)
               + mb.tokens * min(moe.top_k, ep))
    return received * (d + 1) * mb.compute + indices * INDEX


def _node_combine(moe: MoEConfig, nodes: ExpertNodes, mb: MicroBatch, d: int) -> int:
    """The two-hop exchange (``parallel/node_dispatch.py``) on the busiest rank under balanced routing
    (``analysis.dispatch_reach.node_exchange_counts``, as the communication model counts it). At home, as int64
    indices: the (token, node) pairs' tokens and the sent assignments, each token's node rows (min(k, nodes)). As
    forwarder: the forwarded pairs' rows and the forwarded assignments (all it received), each received row's
    in-node rows (min(k, per_node)). As the experts' rank, what ``_pair_combine`` keeps there: the received
    assignments' outputs and weights (compute dtype), their pair and order, each pair's slots (min(k, L))."""
    local = moe.num_experts // (nodes.nodes * nodes.per_node)

    def rank_bytes(node: int, position: int) -> int:
        (sent_pairs, sent), (forwarded_pairs, forwarded) = node_exchange_counts(moe, mb.tokens, nodes.nodes,
                                                                                nodes.per_node, node)
        received_rows = nodes.nodes * sent_pairs[node]  # every rank of the across-node group sends alike
        received_pairs, received = nodes.per_node * forwarded_pairs[position], nodes.per_node * forwarded[position]
        indices = (sum(sent_pairs) + sum(sent) + mb.tokens * min(moe.top_k, nodes.nodes)
                   + sum(forwarded_pairs) + nodes.nodes * sent[node] + received_rows * min(moe.top_k, nodes.per_node)
                   + 2 * received + received_pairs * min(moe.top_k, local))
        return received * (d + 1) * mb.compute + indices * INDEX

    return max(rank_bytes(node, position) for node in range(nodes.nodes) for position in range(nodes.per_node))


def _mtp_extras(model: ModelConfig, mb: MicroBatch, sequences: int, k: int, fused: bool, stream_bf16: bool,
                vocab: int) -> int:
    """Module k besides its block, on its T' = b·(S − k) positions (``moe/mtp.py``): its two input norms, the
    [T', 2d] input of the projection, the final norm (input and rstd), the head's input (the normed slice of the
    b·(S − k − 1) scored positions, copied as the head flattens it), then the loss over those positions:
    log-softmax output (fp32, of ``vocab`` columns: this rank's slice under vocabulary parallelism, as the main
    head's), the targets (a copy of a strided slice) and nll's total weight.

    An input norm's input is a view of the embedding's or the previous hidden states, saved already, so it adds
    its rstd alone where fp32 (fused); a bf16 input (``stream_bf16``: the main stream under FSDP's bf16 weights;
    from module 2 on under bf16 autocast, the previous module's output) makes it save the fp32 upcast and the
    normalised input too (the decomposed path)."""
    d, scored = model.d_model, sequences * (model.seq_len - k - 1)
    upcasts = int(stream_bf16) + int(stream_bf16 or (mb.bf16 and k > 1))  # of the embedding, of the hidden states
    return (2 * mb.tokens * FP32 + upcasts * 2 * mb.tokens * d * FP32 + _linear_inputs(mb, 2 * d, 1)
            + _norm(mb.tokens, d, fused) + scored * d * mb.compute + scored * vocab * FP32
            + scored * INDEX + FP32)


def _weight_copies(config: RunConfig, layout: Layout, layers: list[int], first: bool, last: bool) -> int:
    """bf16 autocast copies of this rank's tp-local weights that the matmuls save (``ParamTensor.autocast_copy``).

    Only of weights outside FSDP: FSDP's mixed precision gathers its units' weights in bf16, so autocast has
    nothing to cast (``parallel.sharding.mixed_precision``; bf16 training passes it whenever FSDP runs). Not
    of the routed experts: their copies are kept once per step, not per micro-batch (``compute_copy_bytes``).

    Recomputed modules cast again in backward and keep none: every block under ``full`` checkpointing,
    the MoE layers' experts and shared experts under ``moe``. Offloaded modules' copies go to the host with
    their other saved tensors (counted in the offloaded part).
    """
    model, vp = config.model, config.parallel.vocab_parallel
    recompute = config.parallel.activation_checkpointing
    root = 0
    for param in root_tensors(model, config.moe, first, last):
        if in_fsdp_unit(param, layout, model):
            continue  # gathered in bf16 already (``parallel.sharding.mixed_precision``): nothing to cast
        if (param.kind == "embedding" and model.tie_embeddings and last) or (
                param.kind != "embedding" and param.autocast_copy):
            root += 2 * math.prod(tp_local_shape(param, layout, vp))  # a tied head casts the table
    return root + sum(count * _block_copies(block, layout, vp, recompute, config.parallel.activation_offload)
                      for block, count in rank_blocks(model, config.moe, layers))


@functools.lru_cache(maxsize=65536)
def _block_copies(block: Block, layout: Layout, vp: bool, recompute: str, offload: str) -> int:
    """``_weight_copies`` of one block (a multi-token-prediction module's projection runs outside its block: never
    recomputed or offloaded with it)."""
    block_away = recompute == "full" or offload == "blocks"
    ffn_away = block.is_moe and "moe" in (recompute, offload)  # recomputed, or offloaded with the MoE layer
    total = 0
    for param in block.params:
        # the experts compute with copies kept for the step (``compute_copy_bytes``); the rest, in FSDP units
        # when dp × cp > 1, is gathered in bf16 (``in_fsdp_unit``)
        if param.expert or layout.dp_cp > 1 or not param.autocast_copy:
            continue
        if (block_away and param.kind != "projection") or (ffn_away and param.kind in ("experts", "ffn")):
            continue
        total += 2 * math.prod(tp_local_shape(param, layout, vp))
    return total


def compute_copy_bytes(config: RunConfig, layout: Layout, precision: str, pp_rank: int = 0) -> int:
    """The routed experts' bf16 copies on this rank (``moe.experts.ComputeCopies``): made by a step's first
    forward and dropped before its optimizer step, so held once however many micro-batches are in flight,
    recomputed or not; none in fp32, or where FSDP gathers the experts in bf16 itself."""
    if precision != "bf16":
        return 0
    total = 0
    for block, count in rank_blocks(config.model, config.moe, local_layers(config, layout, pp_rank)[0]):
        experts = [param for param in block.params if param.expert]
        if experts and not in_fsdp_unit(experts[0], layout, config.model):
            total += count * sum(2 * math.prod(tp_local_shape(param, layout, False)) for param in experts)
    return total


def micro_batch_activations(config: RunConfig, layout: Layout, micro_batch_size: int, precision: str,
                            pp_rank: int = 0, device_type: str = "cuda", cp_rank: int | None = None) -> dict[str, int]:
    """Bytes autograd saves in one micro-batch's forward on one rank of pipeline rank ``pp_rank``, by part,
    on a ``device_type`` device (a CPU pads the experts' bf16 groups: ``moe.experts.row_multiple_on``), on
    context-parallel rank ``cp_rank`` (None: the one that saves the most; the first saves one chunk's mask less).

    ``parallel.activation_checkpointing``: ``full`` keeps each block's input only, ``moe`` the MoE layers'
    inputs only (``parallel/activation_checkpoint.py``). ``parallel.activation_offload`` (blocks or MoE layers)
    keeps two such modules' saved bytes on the device, the largest, for the one whose copies are in flight beside
    the one computing: an estimate of its design (``parallel/activation_offload.py``), not yet measured on a GPU.
    Sequence parallelism puts the norms and the residual stream on S/tp; attention, the dense FFN and the MoE
    layer work on the gathered sequence. Context parallelism gives every part S/cp positions of each sequence, and
    attention the whole sequence's keys (the module docstring).
    """
    model, moe, par = config.model, config.moe, config.parallel
    layers, first, last = local_layers(config, layout, pp_rank)
    tokens = micro_batch_size * model.seq_len // layout.cp
    stream = tokens // layout.tp if par.sequence_parallel else tokens
    dtype = COMPUTE_DTYPE[precision]
    mb = MicroBatch(tokens, stream, micro_batch_size, dtype.itemsize, precision == "bf16",
                    precision == "bf16" and layout.dp_cp > 1, row_multiple_on(device_type, dtype), layout.cp, cp_rank,
                    device_type == "cpu")
    d, parts = model.d_model, {}
    stream_dtype = torch.bfloat16 if mb.bf16_weights else torch.float32  # the embedding's output: FSDP gathers it bf16
    fused_norms = uses_fused_backward(stream_dtype, distributed=par.sequence_parallel and layout.tp > 1)

    def add(name: str, nbytes: int) -> None:
        parts[name] = parts.get(name, 0) + nbytes

    offloaded = []  # (one offloaded module's saved bytes, how many such modules) (``parallel/activation_offload.py``)

    def add_blocks(is_moe: bool, count: int, mb: MicroBatch, fused_norms: bool, stream_bytes: int = FP32,
                   prefix: str = "", window: int | None = None) -> None:
        """``count`` blocks of one kind (each saves the same) on ``mb``'s tokens, their residual stream in elements
        of ``stream_bytes`` (fp32; a multi-token-prediction module's is its projection's output, bf16 under bf16
        autocast), attending within ``window`` (GPT-OSS's sliding layers) or causally."""
        if par.activation_checkpointing == "full":
            add(f"{prefix}block inputs (recompute)", count * mb.stream * d * stream_bytes)
            return
        attention = _latent_attention(model, layout.tp, mb) if model.latent_attention else \
            _attention(model, layout.tp, mb, window)
        block = {"norms": 2 * _norm(mb.stream, d, fused_norms), "attention": attention}
        if not is_moe:
            block["dense FFN"] = _feed_forward(mb, d, model.ffn_hidden // layout.tp)
        elif par.activation_checkpointing == "moe":
            block["MoE inputs (recompute)"] = mb.tokens * d * stream_bytes
        else:
            moe_parts = _moe(model, moe, layout, mb, par.ranks_per_node)
            if par.activation_offload == "moe":
                offloaded.append((sum(moe_parts.values()), count))
            else:
                block.update(moe_parts)
        if par.activation_offload == "blocks":
            offloaded.append((sum(block.values()), count))
            return
        for name, nbytes in block.items():
            add(prefix + name, count * nbytes)

    # MoE or dense, and the attention's window: how many of this rank's blocks (each kind saves the same)
    kinds: dict[tuple[bool, int | None], int] = {}
    for block, count in rank_blocks(model, moe, [i for i in layers if i < model.n_layers]):
        kinds[block.is_moe, block.window] = kinds.get((block.is_moe, block.window), 0) + count
    for (is_moe, window), count in kinds.items():
        add_blocks(is_moe, count, mb, fused_norms, window=window)
    # the multi-token-prediction modules (``moe/mtp.py``), module k on S - k positions, always on the whole sequence
    # (``parallel.tensor._ends_plan``): their norms' inputs are plain tensors under sequence parallelism too
    mtp_fused_norms = uses_fused_backward(stream_dtype, distributed=False)
    mtp = any(i >= model.n_layers for i in layers)
    vocab = largest_chunk(model.vocab_size, layout.tp) if par.vocab_parallel else model.vocab_size  # a rank's logits
    if mtp and par.sequence_parallel and layout.tp > 1:
        # their one call gathers the last hidden states and Emb(t), saved by the input norms; outside sequence
        # parallelism those are the final norm's and the first block's inputs, saved already
        add("MTP gathered inputs", 2 * tokens * d * stream_dtype.itemsize)
    if mtp and not first:  # the last pipeline stage looks the tokens up in its copy of the embedding
        add("MTP embedding copy", tokens * INDEX + tokens * d * stream_dtype.itemsize)
    for i in layers:
        if i >= model.n_layers:
            k = i - model.n_layers + 1
            positions = micro_batch_size * (model.seq_len - k)
            # under bf16 autocast the module's stream is the projection's bf16 output: its norms are decomposed and
            # return bf16, which the projections after them share uncast (as under FSDP's bf16 weights)
            mb_k = dataclasses.replace(mb, tokens=positions, stream=positions, bf16_weights=mb.bf16)
            mtp_fused = mtp_fused_norms and not mb.bf16
            add_blocks(model.is_moe_layer(i), 1, mb_k, mtp_fused, mb.compute if mb.bf16 else FP32, prefix="MTP ")
            add("MTP projection, norms, head + loss", _mtp_extras(model, mb_k, micro_batch_size, k, mtp_fused,
                                                                    mb.bf16_weights, vocab)
                + (FP32 if k == 1 else 0))  # the modules' mean loss, which ``attach_loss`` keeps
    if offloaded:  # about two modules' at a time: one arriving (or leaving) while the next computes
        modules = sum(count for _, count in offloaded)
        add(f"offloaded {par.activation_offload} in flight", min(2, modules) * max(nbytes for nbytes, _ in offloaded))
    if layout.cp > 1 and any(i < model.n_layers for i in layers):  # the cos and sin rows of this rank's positions
        add("rotary tables (cp positions)", 2 * (tokens // micro_batch_size) * (model.rope_dim // 2) * FP32)
    if first:
        add("embedding", tokens * INDEX)  # the token ids
    if last:
        # final norm (on the gathered whole sequence beside multi-token prediction's modules, which share the head),
        # the head's input, log-softmax output (fp32), targets and nll's total weight
        norm = _norm(tokens, d, mtp_fused_norms) if mtp else _norm(stream, d, fused_norms)
        add("head + loss", norm + _linear_inputs(mb, d, 1) + tokens * vocab * FP32 + tokens * INDEX + FP32)
    if mb.bf16:
        add("bf16 weight copies", _weight_copies(config, layout, layers, first, last))
    return parts


def in_flight(config: RunConfig, layout: Layout, microbatches: int, pp_rank: int = 0) -> float:
    """Micro-batches whose activations one rank holds at its peak.

    Without pipelining each micro-batch's backward runs before the next forward: one. GPipe runs every
    forward first: all. 1F1B: pipeline rank r holds at most pp − r (Narayanan et al. 2021 sec. 2.2.1);
    interleaved 1F1B times ``1 + (p−1)/(p·v)`` (Korthikanti et al. 2022 Eq. 5 and after; REFERENCES.md
    sec. 2.2, stated there for the first stage and applied here to every rank).
    """
    pp, schedule = layout.pp, config.parallel.pp_schedule
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(microbatches)
    held = min(pp - pp_rank, microbatches)
    if schedule == "interleaved_1f1b":
        v = config.parallel.pp_virtual_stages
        return held * (1 + (pp - 1) / (pp * v))
    return float(held)
