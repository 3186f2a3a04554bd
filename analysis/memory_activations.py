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
with no whole-sequence mask (``moe.attention.kernel.kernel_saved_bytes``). Each attention kind states its own
bytes (``saved_bytes`` beside its forward, ``moe/attention/``), and the kernel core what its kernel saves.
The forward also gathers its queries' rows of the rotary tables once ([1, 1, S/cp, r/2], cos and sin, fp32),
which every layer's RoPE saves.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from analysis.dispatch_reach import exchange_counts, node_exchange_counts
from analysis.memory_states import (
    Block,
    in_fsdp_unit,
    largest_chunk,
    local_layers,
    rank_blocks,
    root_tensors,
    tp_local_shape,
)
from config.model import LayerSpec, ModelConfig, MoEConfig
from config.run import RunConfig
from moe.attention import attention_kind
from moe.dispatch import expert_capacity
from moe.experts import padded_rows, row_multiple_on
from moe.feed_forward import FeedForward
from moe.hyper_connections import HyperConnection, HyperHead
from moe.norm import uses_fused_backward
from moe.saved_activations import FP32, INDEX, MicroBatch, linear_input_bytes, norm_bytes
from moe.swiglu_experts import runs_fused
from parallel.expert import exchanges_by_node, exchanges_pairs
from parallel.layout import Layout
from parallel.ranks import ExpertNodes, expert_nodes

OFFSET = 4  # the grouped GEMM's int32 group offsets
COMPUTE_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}


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
        if moe.score_func != "softmax":
            total += t * FP32  # probs = scores / their sum: the sum
    if moe.z_loss_coef > 0 or moe.score_func == "sqrtsoftplus":  # the logits: the z-loss's or softplus' input
        total += t * e * FP32
    if moe.z_loss_coef > 0:
        total += t * FP32 + FP32  # logsumexp for the z-loss; the loss
    return total


def _moe(model: ModelConfig, moe: MoEConfig, layout: Layout, mb: MicroBatch,
         ranks_per_node: int | None = None, replicas: int = 0) -> dict[str, int]:
    """One MoE layer: router, permuted tokens and experts (this rank's share of the rows), combine, shared experts.

    Under tp each tp rank computes 1/(tp/etp) of the grouped rows (a copy of its share); under ep those
    rows travel to the experts' ranks and (balanced) as many arrive; etp splits the hidden dim.
    """
    d, a = model.d_model, mb.compute
    kept = kept_assignments(mb.tokens, moe)
    rows = largest_chunk(kept, layout.tp // layout.etp)  # this rank's share (the largest)
    hidden = moe.expert_hidden // layout.etp
    local_experts = moe.num_experts // layout.ep
    pairs = exchanges_pairs(layout.ep, layout.tp, moe.top_k, replicas)
    if pairs:  # the exchange by (token, rank) pairs keeps its own indices, counted with the combine
        experts = 0
    else:
        experts = mb.tokens * moe.top_k * INDEX  # the assignments' grouped rows, for permute's backward
    if layout.ep > 1 and not pairs:  # received rows' reorder index and its inverse
        experts += 2 * rows * INDEX
    if layout.ep > 1 and replicas:  # the sent rows' order by copy and its inverse
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
    # and up before their clamps, the clamped gate, its sigmoid, g·sigmoid, clamped up + 1 and the product; the
    # limited SwiGLU (``moe.experts.limited_swiglu``) SwiGLU's four and the gate and up before their clamps
    activations = {"swiglu": 4, "clamped_swiglu": 7, "limited_swiglu": 6}.get(moe.activation, 2)
    experts += rows * d * a + activations * rows * hidden * a + expert_offsets(moe, mb.cpu) * local_experts * OFFSET
    if moe.expert_proj_bias:  # each row's expert, by which the bias adds gather (one index for the three)
        experts += rows * INDEX
    parts = {"MoE router": _router(moe, d, mb), "MoE experts": experts,
             **({"MoE replica slots": replica_slot_bytes(model, moe, layout, mb.compute, replicas,
                                                             (layout.ep - 1) * replicas, mb.cpu)}
                if layout.ep > 1 and replicas else {}),
             # expert outputs, their weights, the order and the token index
             "MoE combine": kept * d * a + kept * a + 2 * kept * INDEX}
    if ranks_per_node and exchanges_by_node(layout, moe.top_k, ranks_per_node, replicas):
        parts["MoE combine"] = _node_combine(moe, expert_nodes(layout, ranks_per_node), mb, d)
    elif pairs:
        parts["MoE combine"] = _pair_combine(moe, layout, mb, d)
    if moe.num_shared_experts:
        parts["shared experts"] = FeedForward.saved_bytes(mb, d, moe.shared_hidden // layout.tp, moe.jitter_eps > 0,
                                                          limited=moe.activation == "limited_swiglu")
    if moe.shared_expert_gate:  # its input (under autocast a cast of its own), its sigmoid [T, 1], the shared output
        own_cast = 0 if mb.bf16_weights else linear_input_bytes(mb, d, 1, saved_in_fp32=False)
        parts["shared experts"] += own_cast + mb.tokens * (d + 1) * a
    return parts


def expert_weight_elements(model: ModelConfig, moe: MoEConfig, etp: int) -> int:
    """One routed expert's weight and bias elements on an etp rank (its hidden split over etp, ``out_bias`` whole)."""
    d, hidden = model.d_model, moe.expert_hidden // etp
    matrices = 3 if moe.gated else 2
    biases = (2 * hidden if moe.gated else hidden) + d if moe.expert_proj_bias else 0
    return matrices * d * hidden + biases


def expert_offsets(moe: MoEConfig, cpu: bool) -> int:
    """The int32 group-offset tensors of [experts] one call of the routed experts saves: none where they run as one
    node holding the group sizes on the host (``moe.swiglu_experts.runs_fused``), else one per grouped GEMM."""
    if runs_fused("cpu" if cpu else "cuda", moe.activation, moe.expert_proj_bias):
        return 0
    return 3 if moe.gated else 2


def replica_slot_bytes(model: ModelConfig, moe: MoEConfig, layout: Layout, compute: int, filled: int,
                       sent: int, cpu: bool) -> int:
    """What ``filled`` replica slots of one MoE layer add to a rank's saved tensors (``parallel.ep_replicas``,
    ``parallel/replica_exchange.py``), when it sends ``sent`` of its experts to other ranks' slots: the slots'
    weights fetched from their owners in the compute dtype (one tensor, which the slots' grouped GEMM saves),
    that GEMM's group offsets (one per slot and matrix), and the weights' two index_select indices (the experts
    sent, the arrivals' order), which return the gradients.

    The model counts the most a plan can give a rank: every slot filled (``filled`` = R) and every other rank's
    slots filled from this rank (``sent`` = (ep - 1) · R); an upper bound, exact for the plan's own figures.
    The rows the slots compute are counted with the rank's other rows ("MoE experts"), which the model takes as
    the balanced share: a rank that receives replicas computes at most the plan's target (the mean load,
    rounded up), so its rows are the balanced share within one row per slot; a hot rank the slots cannot
    relieve computes more, as it would without replicas. ``tests/analysis/test_memory.py`` holds it exact on
    skewed routing, with the rows and slots each rank's plan gave it."""
    weights = expert_weight_elements(model, moe, layout.etp) * compute
    return filled * (weights + expert_offsets(moe, cpu) * OFFSET) + (filled + sent) * INDEX


def replica_slot_gradient_bytes(config: RunConfig, layout: Layout, precision: str) -> int:
    """The filled slots' weight gradients of one MoE layer in backward (compute dtype) before their all-to-all
    returns them to the owners, where they add to the owner's own gradients: a transient, one layer at a time;
    every slot filled (an upper bound, as ``replica_slot_bytes``). Zero without replicas."""
    replicas = config.parallel.ep_replicas
    if layout.ep == 1 or not replicas or config.model.n_moe_layers == 0:
        return 0
    compute = COMPUTE_DTYPE[precision].itemsize
    return replicas * expert_weight_elements(config.model, config.moe, layout.etp) * compute


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
    head_and_loss = norm_bytes(mb.tokens, d, fused) + scored * d * mb.compute + scored * vocab * FP32 + scored * INDEX
    if model.hc_mult > 1:
        # DeepSeek-V4's (``HyperPredictionModule``): the hidden norm's rstd per stream (its input, the streams, is
        # saved by the collapse that made them), the two projections' inputs ([T', D] and [T', n, D]), and the
        # module's own collapse of its block's output streams
        n = model.hc_mult
        return ((1 + n) * mb.tokens * FP32 + linear_input_bytes(mb, d, 1) + linear_input_bytes(mb, n * d, 1)
                + HyperHead.saved_bytes(model, mb) + head_and_loss + FP32)
    return (2 * mb.tokens * FP32 + upcasts * 2 * mb.tokens * d * FP32 + linear_input_bytes(mb, 2 * d, 1)
            + head_and_loss + FP32)


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
    model, par = config.model, config.parallel
    layers, first, last = local_layers(config, layout, pp_rank)
    tokens = micro_batch_size * model.seq_len // layout.cp
    stream = tokens // layout.tp if par.sequence_parallel else tokens
    dtype = COMPUTE_DTYPE[precision]
    mb = MicroBatch(tokens, stream, micro_batch_size, dtype.itemsize, precision == "bf16",
                    precision == "bf16" and layout.dp_cp > 1, row_multiple_on(device_type, dtype), layout.cp, cp_rank,
                    device_type == "cpu")
    parts = _Parts(config, layout)
    stream_dtype = torch.bfloat16 if mb.bf16_weights else torch.float32  # the embedding's output: FSDP gathers it bf16
    fused_norms = uses_fused_backward(stream_dtype, distributed=par.sequence_parallel and layout.tp > 1)
    # each kind of block on this rank (its layer pattern's attention, window and feed-forward) saves the same
    for block, count in rank_blocks(model, config.moe, [i for i in layers if i < model.n_layers]):
        parts.add_blocks(block.layer, count, mb, fused_norms)
    mtp = any(i >= model.n_layers for i in layers)
    vocab = largest_chunk(model.vocab_size, layout.tp) if par.vocab_parallel else model.vocab_size  # a rank's logits
    if mtp:
        _add_mtp(parts, mb, layers, micro_batch_size, first, stream_dtype, vocab)
    parts.add_offloaded()
    rotary = [i for i in layers if i < model.n_layers and attention_kind(model.layer(i)).reads_document_tables]
    if layout.cp > 1 and rotary:  # the cos and sin rows of this rank's positions
        parts.add("rotary tables (cp positions)", 2 * (tokens // micro_batch_size) * (model.rope_dim // 2) * FP32)
    if first:
        parts.add("embedding", tokens * INDEX)  # the token ids
    if last:
        # final norm (on the gathered whole sequence beside multi-token prediction's modules, which share the head),
        # the head's input, log-softmax output (fp32), targets and nll's total weight
        mtp_fused_norms = uses_fused_backward(stream_dtype, distributed=False)
        norm = norm_bytes(tokens, model.d_model, mtp_fused_norms) if mtp else norm_bytes(stream, model.d_model,
                                                                                         fused_norms)
        if model.hc_mult > 1:
            parts.add("hyper-connections' head", HyperHead.saved_bytes(model, mb))
        parts.add("head + loss", norm + linear_input_bytes(mb, model.d_model, 1) + tokens * vocab * FP32
                  + tokens * INDEX + FP32)
    if mb.bf16:
        parts.add("bf16 weight copies", _weight_copies(config, layout, layers, first, last))
    return parts.bytes


class _Parts:
    """The saved bytes of one micro-batch on one rank, by part, as ``micro_batch_activations`` adds them up."""

    def __init__(self, config: RunConfig, layout: Layout):
        self.config, self.layout = config, layout
        self.bytes: dict[str, int] = {}
        # (one offloaded module's saved bytes, how many such modules) (``parallel/activation_offload.py``)
        self.offloaded: list[tuple[int, int]] = []

    def add(self, name: str, nbytes: int) -> None:
        self.bytes[name] = self.bytes.get(name, 0) + nbytes

    def add_blocks(self, layer: LayerSpec, count: int, mb: MicroBatch, fused_norms: bool, stream_bytes: int = FP32,
                   prefix: str = "") -> None:
        """``count`` blocks of ``layer``'s kinds (each saves the same) on ``mb``'s tokens, their residual stream in
        elements of ``stream_bytes`` (fp32; a multi-token-prediction module's is its projection's output, bf16
        under bf16 autocast): the norms, what the attention kind states (``moe/attention/``), and the
        feed-forward's."""
        model, par, layout, d = self.config.model, self.config.parallel, self.layout, self.config.model.d_model
        if par.activation_checkpointing == "full":  # (with hyper-connections, its n streams)
            self.add(f"{prefix}block inputs (recompute)", count * mb.stream * model.hc_mult * d * stream_bytes)
            return
        block = {"norms": 2 * norm_bytes(mb.stream, d, fused_norms),
                 "attention": attention_kind(layer).saved_bytes(model, layer, layout.tp, mb)}
        if model.hc_mult > 1:
            block["hyper-connections"] = 2 * HyperConnection.saved_bytes(model, mb)
        if not layer.is_moe:
            block["dense FFN"] = FeedForward.saved_bytes(mb, d, model.ffn_hidden // layout.tp)
        elif par.activation_checkpointing == "moe":  # (with hyper-connections, the streams' fp32 collapse, normed)
            block["MoE inputs (recompute)"] = mb.tokens * d * (FP32 if model.hc_mult > 1 else stream_bytes)
        else:
            moe_parts = _moe(model, self.config.moe, layout, mb, par.ranks_per_node, par.ep_replicas)
            if par.activation_offload == "moe":
                self.offloaded.append((sum(moe_parts.values()), count))
            else:
                block.update(moe_parts)
        if par.activation_offload == "blocks":
            self.offloaded.append((sum(block.values()), count))
            return
        for name, nbytes in block.items():
            self.add(prefix + name, count * nbytes)

    def add_offloaded(self) -> None:
        """About two offloaded modules' at a time: one arriving (or leaving) while the next computes."""
        if self.offloaded:
            modules = sum(count for _, count in self.offloaded)
            self.add(f"offloaded {self.config.parallel.activation_offload} in flight",
                     min(2, modules) * max(nbytes for nbytes, _ in self.offloaded))


def _add_mtp(parts: _Parts, mb: MicroBatch, layers: list[int], micro_batch_size: int, first: bool,
             stream_dtype: torch.dtype, vocab: int) -> None:
    """The multi-token-prediction modules (``moe/mtp.py``) among ``layers``, module k on S - k positions, always on
    the whole sequence (``parallel.tensor._ends_plan``): their norms' inputs are plain tensors under sequence
    parallelism too."""
    model, par, layout, d = parts.config.model, parts.config.parallel, parts.layout, parts.config.model.d_model
    tokens, hyper = mb.tokens, model.hc_mult > 1
    gathered = par.sequence_parallel and layout.tp > 1
    if gathered:
        # their one call gathers Emb(t), saved by the embedding norm; outside sequence parallelism it is the first
        # block's input, saved already (the hidden states come whole from the final norm, which gathered its input;
        # with hyper-connections they are the last block's fp32 streams, gathered too and saved by the hidden norm)
        parts.add("MTP gathered inputs", tokens * d * stream_dtype.itemsize + hyper * tokens * model.hc_mult * d * FP32)
    if mb.bf16 and not mb.bf16_weights and model.hc_mult == 1:
        # module 1's hidden input is the final norm's fp32 output, which the head keeps only as its bf16 copy: the
        # hidden norm saves it (in fp32, and with bf16 weights, the head saves that tensor itself)
        parts.add("MTP normed hidden states", tokens * d * FP32)
    if not first:  # the last pipeline stage looks the tokens up in its copy of the embedding
        parts.add("MTP embedding copy", tokens * INDEX + tokens * d * stream_dtype.itemsize)
    elif hyper and not gathered:  # Emb(t), which the widened streams copied and no block saves, the embedding norm's
        parts.add("MTP embeddings", tokens * d * stream_dtype.itemsize)  # input
    mtp_fused = uses_fused_backward(stream_dtype, distributed=False) and (hyper or not mb.bf16)
    for i in layers:
        if i >= model.n_layers:
            k = i - model.n_layers + 1
            positions = micro_batch_size * (model.seq_len - k)
            # under bf16 autocast the module's stream is the projection's bf16 output: its norms are decomposed and
            # return bf16, which the projections after them share uncast (as under FSDP's bf16 weights); with
            # hyper-connections the branches' inputs are the streams' fp32 collapse, as in the main blocks, and the
            # first merge makes an fp32 copy of the bf16 streams
            mb_k = dataclasses.replace(mb, tokens=positions, stream=positions,
                                       bf16_weights=mb.bf16_weights if hyper else mb.bf16)
            parts.add_blocks(model.layer(i), 1, mb_k, mtp_fused, mb.compute if mb.bf16 else FP32, prefix="MTP ")
            if hyper and mb.bf16 and not mb.bf16_weights and par.activation_checkpointing != "full":
                parts.add("MTP streams' fp32 copy", positions * model.hc_mult * d * FP32)
            parts.add("MTP projection, norms, head + loss", _mtp_extras(model, mb_k, micro_batch_size, k, mtp_fused,
                                                                          mb.bf16_weights, vocab)
                      + (FP32 if k == 1 else 0))  # the modules' mean loss, which ``attach_loss`` keeps


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
