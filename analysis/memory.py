"""Per-rank memory of a training layout, predicted from the config alone, and its measured counterpart.

    python -m analysis.memory --config moe-8x [--set parallel.tp=2 ...] [--world-size N] [--precision bf16]
    python -m analysis.memory --config mixtral-8x7b --world-size 64 --set parallel.ep=8 --sweep-experts 8,16,32,64

What one rank holds during a step (``estimate``):

- **model states** (``model_states``): fp32 master weights (bf16 comes from autocast only), fp32 gradients and
  AdamW's two fp32 moments, 16 bytes per parameter (ZeRO, Rajbhandari et al. 2020 sec. 3.1; REFERENCES.md
  sec. 3.1), divided per tensor as ``parallel/`` divides it: tp splits attention by heads and the dense FFN and
  shared experts on their hidden dim (router, norms, embedding and head stay whole unless vocab_parallel);
  routed experts are E/ep per rank with their hidden dim over etp, then FSDP-sharded over edp (HSDP keeps
  one copy per dp_replicate group); dense weights are FSDP-sharded over dp_shard. A shard is the first chunk
  of ``torch.chunk`` on the sharded dim (the largest; FSDP2 pads every rank's storage to it).
- **gathered weights** (``gathered_bytes``): FSDP all-gathers a block's tp-local weights, fp32, before it runs.
  Assumed peak: the root unit (embedding, final norm, head: never resharded) plus, in backward, the current
  and the prefetched block's weights and the current block's unsharded gradients before their reduce-scatter;
  with ``reshard_after_forward=false`` every local block stays gathered from forward to backward instead.
- **activations** (``micro_batch_activations``): what autograd saves for backward in one micro-batch's
  forward, tensor by tensor as the modules of ``moe/`` save it (listed in each function), times the
  micro-batches in flight (``in_flight``). Under bf16 autocast the cast copies of the weights that the
  matmuls save count here too: they live as long as the micro-batch's graph. Plus, on the last stage, one
  transient [tokens, V] fp32 buffer (the logits in forward, their gradient in backward).

Routing is assumed balanced: an MoE layer keeps ``min(T·k, C·E)`` assignments (capacity ``C`` from
``moe.dispatch.expert_capacity``), or ``T·k`` when dropless; imbalance moves rows between experts and
ranks, so a skewed router can need more on the busiest rank. The grouped GEMM is torch's ``grouped_mm``
(16-byte aligned dims; the padded-bmm fallback saves other tensors). Left out: the AdamW step counters
(one scalar per tensor), communication buffers, allocator fragmentation, and the CUDA context.

Against the published formula (Korthikanti et al. 2022, Eq. 1; REFERENCES.md sec. 2.1), ``sbh(34 + 5as/h)``
bytes per layer in 16-bit: that counts LayerNorm, a 4h GeLU MLP, dropout masks and the s×s attention
scores. Here the norms are RMSNorm (fp32: input, normalised and a [T] rstd), the MLP is SwiGLU (four
[T, F] tensors), there is no dropout, and SDPA keeps q, k, v, its output and a [b, heads, s] logsumexp
instead of the s×s matrix, so the ``5as/h`` term is absent; the formula is cited, not matched.

``saved_activation_bytes`` measures what the model predicts: the bytes autograd keeps after one forward.
"""

from __future__ import annotations

import argparse
import math
import sys
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor

from moe.accounting import parameter_counts
from moe.config import ConfigError, ModelConfig, MoEConfig
from moe.dispatch import expert_capacity
from parallel.groups import Layout, validate_for_model
from parallel.pipeline import check_pipeline, stage_layers
from parallel.tensor import check_tensor_parallel, loss_context
from training.config import RunConfig, load_config
from training.loop import lm_loss, micro_batching

FP32 = 4
INDEX = 8  # int64 ids and indices
OFFSET = 4  # the grouped GEMM's int32 group offsets
ADAM_MOMENTS = 2  # exp_avg and exp_avg_sq, fp32 like the parameter
COMPUTE_BYTES = {"fp32": 4, "bf16": 2}
GIB, MIB = 2**30, 2**20


# ---------------------------------------------------------------------------
# Model states: each parameter tensor, divided as parallel/ divides it
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamTensor:
    """One parameter tensor of the model and how tensor / expert parallelism cut it."""

    kind: str  # norm, attention, ffn (dense or shared experts), router, experts, embedding, head
    layer: int | None  # block index; None for the embedding, final norm and head
    shape: tuple[int, ...]
    tp_dim: int | None = None  # dim split over tp (column-parallel: 0 of [out, in]; row-parallel: 1)
    expert_hidden_dim: int | None = None  # routed-expert stacks [E, ...]: dim 0 over ep, this dim over etp

    @property
    def expert(self) -> bool:
        return self.kind == "experts"

    @property
    def autocast_copy(self) -> bool:
        """Whether bf16 autocast casts it for a matmul that saves the copy (not the fp32 router, norms, lookup)."""
        return self.kind in ("attention", "ffn", "experts", "head")


def parameter_tensors(model: ModelConfig, moe: MoEConfig) -> list[ParamTensor]:
    """Every parameter of ``moe.transformer.MoETransformer`` with its global shape (a tied head shares the table)."""
    d, hd, out = model.d_model, model.head_dim, []
    for i in range(model.n_layers):
        out += [ParamTensor("norm", i, (d,)), ParamTensor("norm", i, (d,)),
                ParamTensor("attention", i, (model.n_heads * hd, d), 0),
                ParamTensor("attention", i, (model.kv_heads * hd, d), 0),
                ParamTensor("attention", i, (model.kv_heads * hd, d), 0),
                ParamTensor("attention", i, (d, model.n_heads * hd), 1)]
        hidden = model.ffn_hidden
        if model.is_moe_layer(i):
            e, h = moe.num_experts, moe.expert_hidden
            out += [ParamTensor("router", i, (e, d)),
                    ParamTensor("experts", i, (e, d, h), expert_hidden_dim=2),
                    ParamTensor("experts", i, (e, h, d), expert_hidden_dim=1)]
            if moe.activation == "swiglu":
                out.append(ParamTensor("experts", i, (e, d, h), expert_hidden_dim=2))
            hidden = moe.shared_hidden if moe.num_shared_experts else 0
        if hidden:
            out += [ParamTensor("ffn", i, (hidden, d), 0), ParamTensor("ffn", i, (hidden, d), 0),
                    ParamTensor("ffn", i, (d, hidden), 1)]
    out += [ParamTensor("embedding", None, (model.vocab_size, d)), ParamTensor("norm", None, (d,))]
    if not model.tie_embeddings:
        out.append(ParamTensor("head", None, (model.vocab_size, d)))
    return out


def _on_rank(param: ParamTensor, layers: list[int], first: bool, last: bool) -> bool:
    """Whether a pipeline rank with these blocks (and embedding if ``first``, norm and head if ``last``) holds it."""
    if param.layer is not None:
        return param.layer in layers
    return first if param.kind == "embedding" else last


def _chunk(size: int, parts: int) -> int:
    """The first (largest) chunk of ``torch.chunk(size, parts)``: what FSDP keeps on a rank, padded on the others."""
    return math.ceil(size / parts)


def tp_local_shape(param: ParamTensor, layout: Layout, vocab_parallel: bool) -> list[int]:
    """The tensor on one rank after tensor and expert parallelism (before FSDP)."""
    shape = list(param.shape)
    if param.expert:
        shape[0] //= layout.ep
        shape[param.expert_hidden_dim] //= layout.etp
    elif param.tp_dim is not None:
        shape[param.tp_dim] //= layout.tp
    elif param.kind in ("embedding", "head") and vocab_parallel:
        shape[0] = _chunk(shape[0], layout.tp)
    return shape


def _experts_own_unit(layout: Layout, model: ModelConfig) -> bool:
    """Whether the routed experts are their own FSDP unit over edp (``parallel/__init__.py``: ep, etp or tp > 1)."""
    return model.n_moe_layers > 0 and (layout.ep > 1 or layout.etp > 1 or layout.tp > 1)


def sharded_numel(param: ParamTensor, layout: Layout, model: ModelConfig, vocab_parallel: bool) -> int:
    """Elements of ``param`` one rank stores: its tp/ep slice, then its FSDP shard (``parallel/sharding.py``)."""
    shape = tp_local_shape(param, layout, vocab_parallel)
    if param.expert and _experts_own_unit(layout, model):
        if layout.dp_replicate * layout.edp > 1:  # else unmanaged: ep (× etp) spans all dp_shard × tp ranks
            # the experts dim when it splits evenly, else the first dim etp leaves whole (``_free_dim``)
            dim = 0 if shape[0] % layout.edp == 0 else 2 if layout.etp > 1 and param.expert_hidden_dim == 1 else 1
            shape[dim] = _chunk(shape[dim], layout.edp)
    elif layout.dp > 1:  # FSDP2 over dp_shard (HSDP replicates over dp_replicate), dim 0
        shape[0] = _chunk(shape[0], layout.dp_shard)
    return math.prod(shape)


@dataclass(frozen=True)
class ModelStates:
    """Bytes one rank keeps for the whole run: fp32 weights, fp32 gradients, AdamW moments; dense and experts."""

    weights_dense: int
    weights_experts: int

    @property
    def weights(self) -> int:
        return self.weights_dense + self.weights_experts

    @property
    def grads(self) -> int:
        return self.weights  # fp32 gradients, sharded as the weights

    @property
    def optimizer(self) -> int:
        return ADAM_MOMENTS * self.weights

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer


def _local_layers(config: RunConfig, layout: Layout, pp_rank: int) -> tuple[list[int], bool, bool]:
    """The blocks on pipeline rank ``pp_rank`` (its stages s ≡ pp_rank mod pp) and whether it is first / last."""
    stages = layout.pp * config.parallel.pp_virtual_stages
    ranges = stage_layers(config.model, config.moe, stages)
    layers = [i for s in range(pp_rank, stages, layout.pp) for i in ranges[s]]
    return layers, pp_rank == 0, pp_rank == (stages - 1) % layout.pp


def model_states(config: RunConfig, layout: Layout, pp_rank: int = 0) -> ModelStates:
    """Model-state bytes of one rank of pipeline rank ``pp_rank``: fp32 weights, gradients, two Adam moments."""
    model, vp = config.model, config.parallel.vocab_parallel
    layers, first, last = _local_layers(config, layout, pp_rank)
    dense = experts = 0
    for param in parameter_tensors(model, config.moe):
        if not _on_rank(param, layers, first, last):
            continue
        numel = sharded_numel(param, layout, model, vp)
        if param.expert:
            experts += numel * FP32
        else:
            dense += numel * FP32
    return ModelStates(dense, experts)


def _block_gathered(config: RunConfig, layout: Layout, layer: int) -> int:
    """fp32 bytes FSDP all-gathers to run block ``layer``: its tp-local weights in the units that are sharded."""
    model, total = config.model, 0
    for param in parameter_tensors(model, config.moe):
        if param.layer != layer:
            continue
        if param.expert and _experts_own_unit(layout, model):
            sharded = layout.edp > 1
        else:
            sharded = layout.dp > 1 and layout.dp_shard > 1
        if sharded:
            total += math.prod(tp_local_shape(param, layout, config.parallel.vocab_parallel)) * FP32
    return total


def gathered_bytes(config: RunConfig, layout: Layout, pp_rank: int = 0) -> int:
    """Peak bytes of FSDP's all-gathered (unsharded, tp-local, fp32) weights and unsharded gradients on one rank.

    The root unit (embedding, final norm, head) is never resharded (``parallel/sharding.py``). Blocks: in
    backward the current block's weights, the next block's (prefetched) and the current block's unsharded
    gradients before their reduce-scatter; with ``reshard_after_forward=false`` all local blocks stay
    gathered from forward to backward, plus one block's gradients.
    """
    if layout.dp_shard * layout.edp == 1:
        return 0
    layers, first, last = _local_layers(config, layout, pp_rank)
    blocks = [_block_gathered(config, layout, i) for i in layers]
    root = 0
    if layout.dp > 1 and layout.dp_shard > 1:
        root = sum(math.prod(tp_local_shape(p, layout, config.parallel.vocab_parallel))
                   for p in parameter_tensors(config.model, config.moe)
                   if p.layer is None and _on_rank(p, layers, first, last)) * FP32
    largest = max(blocks, default=0)
    if config.parallel.reshard_after_forward:
        return root + 3 * largest
    return root + sum(blocks) + largest


# ---------------------------------------------------------------------------
# Activations: what autograd saves in one micro-batch's forward, per rank
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch on one rank: T = b·s tokens, ``stream`` of them in the residual stream (T/tp under SP)."""

    tokens: int
    stream: int
    sequences: int
    compute: int  # bytes of the compute dtype
    bf16: bool


def _norm(stream: int, d: int) -> int:
    """RMSNorm (fp32, the residual stream's dtype): its input, the normalised input and the [T] rsqrt."""
    return stream * (2 * d + 1) * FP32


def _linear_inputs(mb: MicroBatch, d: int, consumers: int, saved_in_fp32: bool = True) -> int:
    """The [T, d] input of ``consumers`` column-parallel projections: one fp32 tensor, or one bf16 cast each."""
    if mb.bf16:
        return consumers * mb.tokens * d * mb.compute
    return mb.tokens * d * FP32 if saved_in_fp32 else 0


def _attention(model: ModelConfig, tp: int, mb: MicroBatch) -> int:
    """wq/wk/wv input; SDPA's q, k (after RoPE), v, output and [b, heads, s] logsumexp; wo's input.

    wo's input is the output made contiguous, a copy unless one head per rank makes it a view.
    """
    heads, kv_heads, hd = model.n_heads // tp, model.kv_heads // tp, model.head_dim
    qkvo = mb.tokens * hd * (2 * heads + 2 * kv_heads) * mb.compute
    wo_input = 0 if heads == 1 else mb.tokens * heads * hd * mb.compute
    return _linear_inputs(mb, model.d_model, 3) + qkvo + wo_input + mb.tokens * heads * FP32


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
    # the z-loss's logits and logsumexp: measured to stay saved even when z_loss_coef = 0 (the loss then
    # reaches no backward, yet its graph is not freed); the loss itself only when attached
    total += t * e * FP32 + t * FP32 + (FP32 if moe.z_loss_coef > 0 else 0)
    return total


def _moe(model: ModelConfig, moe: MoEConfig, layout: Layout, mb: MicroBatch) -> dict[str, int]:
    """One MoE layer: router, permuted tokens and experts (this rank's share of the rows), combine, shared experts.

    Under tp each tp rank computes 1/(tp/etp) of the grouped rows; under ep those rows travel to the
    experts' ranks and (balanced) as many arrive; etp splits the hidden dim. Without ep the experts read
    a view of the whole grouped tensor, which so stays alive in full.
    """
    d, a = model.d_model, mb.compute
    kept = kept_assignments(mb.tokens, moe)
    rows = _chunk(kept, layout.tp // layout.etp)  # this rank's share (the largest)
    hidden = moe.expert_hidden // layout.etp
    swiglu = moe.activation == "swiglu"
    experts = kept * INDEX  # permute's token index
    if layout.ep > 1:  # received rows' reorder index, the local grouped rows, index_copy's saved source
        experts += rows * INDEX + 2 * rows * d * a
    else:
        experts += kept * d * a
    experts += (4 if swiglu else 2) * rows * hidden * a + (3 if swiglu else 2) * (moe.num_experts // layout.ep) * OFFSET
    parts = {"MoE router": _router(moe, d, mb), "MoE experts": experts,
             "MoE combine": kept * d * a + kept * a + kept * INDEX}  # expert outputs, their weights, order
    if moe.num_shared_experts:
        parts["shared experts"] = _feed_forward(mb, d, moe.shared_hidden // layout.tp, moe.jitter_eps > 0)
    return parts


def _weight_copies(config: RunConfig, layout: Layout, layers: list[int], first: bool, last: bool) -> int:
    """bf16 autocast copies of this rank's tp-local weights that the matmuls save (``ParamTensor.autocast_copy``).

    Recomputed modules cast again in backward and keep none: every block under ``full`` checkpointing,
    the MoE layers' experts and shared experts under ``moe``.
    """
    recompute = config.parallel.activation_checkpointing

    def kept(param: ParamTensor) -> bool:
        if not param.autocast_copy or not _on_rank(param, layers, first, last):
            return False
        if param.layer is None:
            return True
        moe_layer = config.model.is_moe_layer(param.layer)
        return recompute == "none" or (recompute == "moe" and not (moe_layer and param.kind in ("experts", "ffn")))

    return 2 * sum(math.prod(tp_local_shape(p, layout, config.parallel.vocab_parallel))
                   for p in parameter_tensors(config.model, config.moe) if kept(p))


def micro_batch_activations(config: RunConfig, layout: Layout, micro_batch_size: int, precision: str,
                            pp_rank: int = 0) -> dict[str, int]:
    """Bytes autograd saves in one micro-batch's forward on one rank of pipeline rank ``pp_rank``, by part.

    ``parallel.activation_checkpointing``: ``full`` keeps each block's input only, ``moe`` the MoE layers'
    inputs only (``parallel/activation_checkpoint.py``). Sequence parallelism puts the norms and the
    residual stream on S/tp; attention, the dense FFN and the MoE layer work on the gathered sequence.
    """
    model, moe, par = config.model, config.moe, config.parallel
    layers, first, last = _local_layers(config, layout, pp_rank)
    tokens = micro_batch_size * model.seq_len
    stream = tokens // layout.tp if par.sequence_parallel else tokens
    mb = MicroBatch(tokens, stream, micro_batch_size, COMPUTE_BYTES[precision], precision == "bf16")
    d, parts = model.d_model, {}

    def add(name: str, nbytes: int) -> None:
        parts[name] = parts.get(name, 0) + nbytes

    for i in layers:
        if par.activation_checkpointing == "full":
            add("block inputs (recompute)", stream * d * FP32)
            continue
        add("norms", 2 * _norm(stream, d))
        add("attention", _attention(model, layout.tp, mb))
        if not model.is_moe_layer(i):
            add("dense FFN", _feed_forward(mb, d, model.ffn_hidden // layout.tp))
        elif par.activation_checkpointing == "moe":
            add("MoE inputs (recompute)", tokens * d * FP32)
        else:
            for name, nbytes in _moe(model, moe, layout, mb).items():
                add(name, nbytes)
    if first:
        add("embedding", tokens * INDEX)  # the token ids
    if last:
        vocab = _chunk(model.vocab_size, layout.tp) if par.vocab_parallel else model.vocab_size
        # final norm, the head's input, log-softmax output (fp32), targets and nll's total weight
        add("head + loss", _norm(stream, d) + _linear_inputs(mb, d, 1) + tokens * vocab * FP32
            + tokens * INDEX + FP32)
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


# ---------------------------------------------------------------------------
# The estimate, and the layout check it starts with
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryEstimate:
    """One rank's memory in bytes: model states, FSDP's gathered buffers, activations (× in flight), logits."""

    pp_rank: int
    states: ModelStates
    gathered: int
    activations: dict[str, int]  # by part, already × in_flight
    logits_buffer: int  # last stage: one [tokens, V] fp32 buffer (logits in forward, their gradient in backward)
    micro_batch_size: int
    microbatches: int
    in_flight: float
    parameters: int  # whole-model parameter count

    @property
    def activation_total(self) -> int:
        return sum(self.activations.values())

    @property
    def total(self) -> int:
        return self.states.total + self.gathered + self.activation_total + self.logits_buffer


def check_layout(config: RunConfig, world_size: int) -> tuple[Layout, int, int]:
    """The layout, micro-batch size and count, refused exactly as ``train.py`` refuses them (ConfigError)."""
    layout = Layout.resolve(world_size, **config.parallel.degrees())
    validate_for_model(layout, config.model, config.moe)
    micro, microbatches = micro_batching(config, layout.dp, layout.pp)
    check_pipeline(layout.pp, config.model, config.parallel.pp_schedule, config.parallel.pp_virtual_stages,
                   microbatches)
    check_tensor_parallel(layout.tp, config.model, config.parallel.sequence_parallel, config.parallel.vocab_parallel)
    return layout, micro, microbatches


def estimate(config: RunConfig, world_size: int, precision: str, pp_rank: int = 0) -> MemoryEstimate:
    """The memory of one rank of pipeline rank ``pp_rank`` training ``config`` on ``world_size`` ranks."""
    layout, micro, microbatches = check_layout(config, world_size)
    held = in_flight(config, layout, microbatches, pp_rank)
    activations = {name: round(nbytes * held)
                   for name, nbytes in micro_batch_activations(config, layout, micro, precision, pp_rank).items()}
    last = _local_layers(config, layout, pp_rank)[2]
    vocab = _chunk(config.model.vocab_size, layout.tp) if config.parallel.vocab_parallel else config.model.vocab_size
    logits = micro * config.model.seq_len * vocab * FP32 if last else 0
    return MemoryEstimate(pp_rank, model_states(config, layout, pp_rank), gathered_bytes(config, layout, pp_rank),
                          activations, logits, micro, microbatches, held,
                          parameter_counts(config.model, config.moe).total)


# ---------------------------------------------------------------------------
# The measured counterpart
# ---------------------------------------------------------------------------


def _local(tensor: Tensor) -> Tensor:
    """The plain tensor holding the data: a DTensor's local shard; an in-flight collective's result buffer."""
    if isinstance(tensor, DTensor):
        tensor = tensor._local_tensor
    return tensor.elem if isinstance(tensor, AsyncCollectiveTensor) else tensor


@dataclass(frozen=True)
class SavedActivations:
    saved_bytes: int  # bytes autograd holds for backward after the forward (parameters and buffers excluded)
    logits_bytes: int  # this rank's logits (its vocabulary slice under vocab_parallel)
    loss: Tensor  # the forward's loss, to run backward on


def saved_activation_bytes(model: torch.nn.Module, inputs: Tensor, targets: Tensor,
                           vocab_parallel: bool = False) -> SavedActivations:
    """Run one forward and the LM loss; count the bytes autograd keeps for backward on this rank.

    Every tensor a ``saved_tensors_hooks`` pack hook sees counts if it is still alive at the end of the forward
    (held by weak reference: a dropped branch of the graph frees its tensors, whose addresses may be reused),
    once per storage, at the storage's size then (FSDP frees resharded weights by shrinking their storage to
    nothing). The model's parameters and buffers, taken after the forward (FSDP's gathered root stays
    gathered), are model state and left out. Autocast, if wanted, is the caller's context.
    """
    packed = []

    def pack(tensor: Tensor) -> Tensor:
        packed.append(weakref.ref(tensor))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), loss_context(vocab_parallel):
        logits = model(inputs)
        loss = lm_loss(logits, targets)
    state = {_local(t).untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    storages = {}
    for ref in packed:
        if (tensor := ref()) is not None:
            storage = _local(tensor).untyped_storage()
            if storage.data_ptr() not in state:
                storages[storage.data_ptr()] = storage.nbytes()
    return SavedActivations(sum(storages.values()), _local(logits).nbytes, loss)


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / MIB:.1f} MiB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def format_estimates(config: RunConfig, layout: Layout, precision: str, estimates: list[MemoryEstimate],
                     device_gib: float) -> str:
    """A table, one column per pipeline rank: model states, gathered weights, activations by part, total, fit."""
    first = estimates[0]
    seq = config.model.seq_len
    lines = [f"{config.name}: {layout.world_size} ranks, {layout.degrees()} (edp={layout.edp}); {precision} compute; "
             f"micro-batch {first.micro_batch_size} × {seq} tokens, {first.microbatches} per step",
             f"model: {_count(first.parameters)} parameters; per rank, fp32 master weights + fp32 gradients "
             f"+ AdamW moments (16 bytes/parameter)"]
    header = [f"pp rank {e.pp_rank}" for e in estimates] if layout.pp > 1 else ["per rank"]
    rows: list[tuple[str, list[int]]] = [
        ("weights: dense", [e.states.weights_dense for e in estimates]),
        ("weights: routed experts", [e.states.weights_experts for e in estimates]),
        ("gradients", [e.states.grads for e in estimates]),
        ("AdamW moments", [e.states.optimizer for e in estimates]),
        ("FSDP gathered weights", [e.gathered for e in estimates]),
    ]
    parts = list(dict.fromkeys(name for e in estimates for name in e.activations))
    rows += [(f"activations: {name}", [e.activations.get(name, 0) for e in estimates]) for name in parts]
    rows += [("logits buffer", [e.logits_buffer for e in estimates])]
    width = max(len(name) for name, _ in rows) + 2
    lines.append(" " * width + "".join(f"{h:>14}" for h in header))
    for name, values in rows:
        lines.append(f"{name:<{width}}" + "".join(f"{_size(v):>14}" for v in values))
    lines.append(f"{'  micro-batches held':<{width}}" + "".join(f"{e.in_flight:>14g}" for e in estimates))
    lines.append(f"{'total':<{width}}" + "".join(f"{_size(e.total):>14}" for e in estimates))
    worst = max(e.total for e in estimates)
    verdict = "fits" if worst <= device_gib * GIB else "does NOT fit"
    lines.append(f"largest rank {_size(worst)}: {verdict} in {device_gib:g} GiB "
                 f"({100 * worst / (device_gib * GIB):.0f}% of it)")
    return "\n".join(lines)


def sweep_experts(config_name: str, overrides: list[str], world_size: int, precision: str,
                  expert_counts: list[int]) -> list[tuple[int, MemoryEstimate]]:
    """The largest pipeline rank's estimate as ``moe.num_experts`` grows, everything else (layout included) fixed.

    With top_k and expert_hidden fixed, each token's compute and the activations stay put (only the
    router's [T, E] scores grow) while the expert weights, gradients and moments grow with E / ep.
    """
    out = []
    for experts in expert_counts:
        config = load_config(config_name, [*overrides, f"moe.num_experts={experts}"])
        pp = Layout.resolve(world_size, **config.parallel.degrees()).pp
        worst = max((estimate(config, world_size, precision, r) for r in range(pp)), key=lambda e: e.total)
        out.append((experts, worst))
    return out


def format_sweep(rows: list[tuple[int, MemoryEstimate]], device_gib: float) -> str:
    """One line per expert count; bf16 weight copies are weights in size but held per micro-batch like activations."""
    lines = ["experts  parameters  model states  FSDP gathered  bf16 weight  activations        total  activ.  fits",
             "           (model)     (per rank)     (per rank)       copies  (+ logits)   (per rank)   share"]
    for experts, e in rows:
        copies = e.activations.get("bf16 weight copies", 0)
        activations = e.activation_total - copies + e.logits_buffer
        fits = "yes" if e.total <= device_gib * GIB else "no"
        lines.append(f"{experts:>7}  {_count(e.parameters):>10}  {_size(e.states.total):>12}  {_size(e.gathered):>13}  "
                     f"{_size(copies):>11}  {_size(activations):>11}  {_size(e.total):>11}  "
                     f"{100 * activations / e.total:>5.0f}%  {fits:>4}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Per-rank training memory of a config and layout.")
    parser.add_argument("--config", default="moe-8x", help="config name in configs/ or a YAML path")
    parser.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="override config keys, e.g. --set parallel.tp=2 parallel.ep=4")
    parser.add_argument("--world-size", type=int, default=1, help="ranks in the job (default 1)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default=None,
                        help="compute precision (default: train.precision; auto means bf16, as on a GPU)")
    parser.add_argument("--device-memory", type=float, default=80.0, metavar="GIB",
                        help="memory of one device, GiB (default 80)")
    parser.add_argument("--sweep-experts", default=None, metavar="E1,E2,...",
                        help="print how the footprint shifts from activations to weights as moe.num_experts grows")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        precision = args.precision or ("fp32" if config.train.precision == "fp32" else "bf16")
        if args.sweep_experts:
            counts = [int(e) for e in args.sweep_experts.split(",")]
            rows = sweep_experts(args.config, args.overrides, args.world_size, precision, counts)
            layout = Layout.resolve(args.world_size, **config.parallel.degrees())
            print(f"{config.name}: {args.world_size} ranks, {layout.degrees()}; {precision}; the largest "
                  f"pipeline rank as moe.num_experts grows (layout, top_k and expert_hidden fixed)")
            print(format_sweep(rows, args.device_memory))
            return 0
        layout = check_layout(config, args.world_size)[0]
        estimates = [estimate(config, args.world_size, precision, r) for r in range(layout.pp)]
        print(format_estimates(config, layout, precision, estimates, args.device_memory))
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
