"""Model states of one rank: each parameter tensor of the model, divided as ``parallel/`` divides it.

Parameters are fp32 master weights (under bf16 FSDP gathers bf16 copies to compute with), gradients fp32,
and AdamW keeps two fp32 moments: 16 bytes per parameter (ZeRO, Rajbhandari et al. 2020 sec. 3.1;
REFERENCES.md sec. 3.1).
tp splits attention by heads and the dense FFN and shared experts on their hidden dim; router, norms,
embedding and head stay whole unless ``parallel.vocab_parallel`` (``parallel/tensor.py``). Routed experts
are E/ep per rank with their hidden dim over etp, then FSDP-sharded over edp (HSDP keeps one copy per
dp_replicate group); dense weights are FSDP-sharded over dp_shard × cp (``parallel/sharding.py``: context-parallel
ranks hold other tokens of the same sequences, so for the weights they are data-parallel ranks; edp = dp_shard·cp·
tp/(ep·etp) folds cp in for the experts). A shard is the
first chunk of ``torch.chunk`` on the sharded dim, the largest: FSDP2 pads every rank's storage to it.
Under pipeline parallelism a rank holds its stages' blocks (``parallel.pipeline.stage_layers``), the
embedding on the first stage, the final norm and head on the last.

Gradient accumulation under ``parallel.grad_reduce=step`` (``parallel.set_gradient_sync``): FSDP2 does not
reduce before the last micro-batch, so each unit keeps the fp32 ``.grad`` of its unsharded (tp-local)
parameters from the first micro-batch's backward to its reduce-scatter in the last one, and has no sharded
gradient meanwhile (``accumulated_grad_bytes``). Under ``microbatch`` the reduce-scatter runs every
micro-batch and only the sharded gradient is held (HSDP sums the shards in a buffer of the same size until
the step's all-reduce).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from config.model import LayerSpec, ModelConfig, MoEConfig
from config.run import RunConfig
from moe.accounting import block_tensors, per_model
from moe.hyper_connections import HyperHead
from moe.mtp import prediction_module
from moe.param_tensors import ParamTensor
from parallel.layout import Layout
from parallel.pipeline import stage_layers
from parallel.sharding import expert_fsdp_dim, experts_replicated, experts_spread

FP32 = 4
ADAM_MOMENTS = 2  # exp_avg and exp_avg_sq, fp32 like the parameter


def parameter_tensors(model: ModelConfig, moe: MoEConfig) -> tuple[ParamTensor, ...]:
    """Every parameter of ``moe.transformer.MoETransformer`` with its global shape (a tied head shares the table).

    Remembered per model (``moe.accounting.per_model``: the planner asks for the same model's tensors for every
    candidate)."""
    return per_model(_TENSORS, model, moe, lambda: tuple(_parameter_tensors(model, moe)))


def tensors_by_layer(model: ModelConfig, moe: MoEConfig) -> dict[int | None, tuple[ParamTensor, ...]]:
    """``parameter_tensors`` grouped by block (None: the embedding, final norm and head), remembered likewise."""

    def build() -> dict[int | None, tuple[ParamTensor, ...]]:
        groups: dict[int | None, list[ParamTensor]] = {}
        for param in parameter_tensors(model, moe):
            groups.setdefault(param.layer, []).append(param)
        return {layer: tuple(params) for layer, params in groups.items()}

    return per_model(_BY_LAYER, model, moe, build)


@dataclass(frozen=True, eq=False)
class Block:
    """The tensors of one kind of block, its index dropped. Blocks of one kind in one model share one Block (equal
    and hashed by identity), so per-block figures are remembered once per kind, not per layer."""

    params: tuple[ParamTensor, ...]
    layer: LayerSpec  # its place in the layer pattern: attention kind and window, feed-forward kind

    @property
    def is_moe(self) -> bool:
        return self.layer.is_moe


def rank_blocks(model: ModelConfig, moe: MoEConfig, layers: list[int]) -> list[tuple[Block, int]]:
    """The kinds of block among ``layers`` and how many of each (remembered per model and list of layers)."""
    def build() -> dict[int, Block]:
        kinds: dict[tuple, Block] = {}
        of_layer = {}
        for layer, params in tensors_by_layer(model, moe).items():
            if layer is not None:
                canonical = tuple(dataclasses.replace(p, layer=None) for p in params)
                spec = model.layer(layer)
                of_layer[layer] = kinds.setdefault((canonical, spec), Block(canonical, spec))
        return of_layer

    of_layer, known = per_model(_BLOCKS, model, moe, lambda: (build(), {}))
    key = tuple(layers)
    if key not in known:
        counts: dict[Block, int] = {}
        for i in layers:
            counts[of_layer[i]] = counts.get(of_layer[i], 0) + 1
        known[key] = list(counts.items())
    return known[key]


def root_tensors(model: ModelConfig, moe: MoEConfig, first: bool, last: bool) -> list[ParamTensor]:
    """The embedding (first stage), final norm and head (last stage) a pipeline rank holds (remembered). With
    multi-token prediction the last stage holds a copy of the embedding too (``parallel/pipeline.py``): its
    weights, gradient and optimizer state are a second table's, counted on that rank."""
    known = per_model(_ROOTS, model, moe, dict)
    if (first, last) not in known:
        embedding = first or (last and model.mtp_depth > 0)
        known[first, last] = [p for p in tensors_by_layer(model, moe)[None] if on_rank(p, [], embedding, last)]
    return known[first, last]


_TENSORS: dict = {}  # per_model stores
_BY_LAYER: dict = {}
_BLOCKS: dict = {}
_ROOTS: dict = {}


def _parameter_tensors(model: ModelConfig, moe: MoEConfig) -> list[ParamTensor]:
    d, out = model.d_model, []
    for i in range(model.n_layers):
        out += block_tensors(model, moe, model.layer(i), i)
    for i in mtp_layers(model):  # each module: its block, then its projections and norms (``moe/mtp.py``)
        out += [*block_tensors(model, moe, model.layer(i), i), *prediction_module(model).parameter_tensors(model, i)]
    out += [ParamTensor("embedding", None, (model.vocab_size, d)), ParamTensor("norm", None, (d,))]
    if not model.tie_embeddings:
        out.append(ParamTensor("head", None, (model.vocab_size, d)))
    if model.hc_mult > 1:  # the hyper-connections' final collapse, on the last stage beside the norm
        out += HyperHead.parameter_tensors(model)
    return out


def mtp_layers(model: ModelConfig) -> range:
    """The multi-token-prediction modules as layer indices n_layers + k (``MoETransformer.moe_layers`` numbers
    their MoE layers so): each one block of that layer's kind, plus its projection and norms."""
    return range(model.n_layers, model.n_layers + model.mtp_depth)


def on_rank(param: ParamTensor, layers: list[int], embedding: bool, last: bool) -> bool:
    """Whether a pipeline rank with these blocks (and the embedding if ``embedding``, norm and head if ``last``)
    holds it."""
    if param.layer is not None:
        return param.layer in layers
    return embedding if param.kind == "embedding" else last


def largest_chunk(size: int, parts: int) -> int:
    """The first (largest) chunk of ``torch.chunk(size, parts)``: what FSDP keeps on a rank, padded on the others."""
    return math.ceil(size / parts)


def tp_local_shape(param: ParamTensor, layout: Layout, vocab_parallel: bool) -> list[int]:
    """The tensor on one rank after tensor and expert parallelism (before FSDP)."""
    shape = list(param.shape)
    if param.expert:
        shape[0] //= layout.ep
        if param.expert_hidden_dim is not None:  # not the experts' output biases [E, d_model], whole under etp
            shape[param.expert_hidden_dim] //= layout.etp
    elif param.tp_dim is not None:
        shape[param.tp_dim] //= layout.tp
    elif param.kind in ("embedding", "head") and vocab_parallel:
        shape[0] = largest_chunk(shape[0], layout.tp)
    return shape


def experts_own_unit(layout: Layout, model: ModelConfig) -> bool:
    """Whether the routed experts are their own FSDP unit over edp (``parallel.sharding.experts_spread``)."""
    return experts_spread(layout, model.n_moe_layers > 0)


def in_fsdp_unit(param: ParamTensor, layout: Layout, model: ModelConfig) -> bool:
    """Whether an FSDP unit holds ``param`` (``parallel/__init__.py``): the routed experts in their own unit when
    they have several replicas (dp_replicate × edp > 1; else they stay out of FSDP), the rest with dp × cp > 1."""
    if param.expert and experts_own_unit(layout, model):
        return experts_replicated(layout)
    return layout.dp_cp > 1


def sharded_numel(param: ParamTensor, layout: Layout, model: ModelConfig, vocab_parallel: bool) -> int:
    """Elements of ``param`` one rank stores: its tp/ep slice, then its FSDP shard (``parallel/sharding.py``).

    Remembered by the tensor's shape and cut (not its block: every block of a kind gives the same figure)."""
    return sharded_numel_of(param, layout, model.n_moe_layers > 0, vocab_parallel)


def sharded_numel_of(param: ParamTensor, layout: Layout, has_moe: bool, vocab_parallel: bool) -> int:
    """``sharded_numel`` given whether the model has MoE layers instead of the model."""
    return _sharded_numel(param.kind, param.shape, param.tp_dim, param.expert_hidden_dim, layout, has_moe,
                          vocab_parallel)


@functools.lru_cache(maxsize=65536)
def _sharded_numel(kind: str, shape: tuple[int, ...], tp_dim: int | None, expert_hidden_dim: int | None,
                   layout: Layout, has_moe: bool, vocab_parallel: bool) -> int:
    param = ParamTensor(kind, None, shape, tp_dim, expert_hidden_dim)
    shape = tp_local_shape(param, layout, vocab_parallel)
    if param.expert and experts_spread(layout, has_moe):  # the experts' own unit (``in_fsdp_unit``)
        if experts_replicated(layout):
            dim = expert_fsdp_dim(shape[0], layout.edp, param.expert_hidden_dim if layout.etp > 1 else None)
            shape[dim] = largest_chunk(shape[dim], layout.edp)
    elif layout.dp_cp > 1:  # FSDP2 over dp_shard × cp (HSDP replicates over dp_replicate), dim 0
        shape[0] = largest_chunk(shape[0], layout.dp_shard_cp)
    return math.prod(shape)


@dataclass(frozen=True)
class ModelStates:
    """Bytes one rank keeps for the whole run: fp32 weights, fp32 gradients, the optimizer's state; dense and
    experts. ``muon_weights``: the bytes of the weights Muon updates (``train.optimizer=muon``), whose state is
    one momentum buffer instead of AdamW's two moments."""

    weights_dense: int
    weights_experts: int
    muon_weights: int = 0

    @property
    def weights(self) -> int:
        return self.weights_dense + self.weights_experts

    @property
    def grads(self) -> int:
        return self.weights  # fp32 gradients, sharded as the weights

    @property
    def optimizer(self) -> int:
        return ADAM_MOMENTS * (self.weights - self.muon_weights) + self.muon_weights

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer


def local_layers(config: RunConfig, layout: Layout, pp_rank: int) -> tuple[list[int], bool, bool]:
    """The blocks on pipeline rank ``pp_rank`` (its stages s ≡ pp_rank mod pp; the multi-token-prediction modules,
    layers n_layers + k, with the head on the last) and whether it is first / last."""
    stages = layout.pp * config.parallel.pp_virtual_stages
    ranges = stage_layers(config.model, config.moe, stages)
    layers = [i for s in range(pp_rank, stages, layout.pp) for i in ranges[s]]
    last = pp_rank == (stages - 1) % layout.pp
    return [*layers, *(mtp_layers(config.model) if last else [])], pp_rank == 0, last


def model_states(config: RunConfig, layout: Layout, pp_rank: int = 0) -> ModelStates:
    """Model-state bytes of one rank of pipeline rank ``pp_rank``: fp32 weights, gradients and the optimizer's
    state (two Adam moments, or Muon's one buffer for the matrices it updates)."""
    model, vp = config.model, config.parallel.vocab_parallel
    layers, first, last = local_layers(config, layout, pp_rank)
    has_moe = model.n_moe_layers > 0
    dense, experts, muon = _states(tuple(root_tensors(model, config.moe, first, last)), layout, has_moe, vp)
    for block, count in rank_blocks(model, config.moe, layers):
        figures = _states(block.params, layout, has_moe, vp)
        dense, experts, muon = dense + count * figures[0], experts + count * figures[1], muon + count * figures[2]
    return ModelStates(dense, experts, muon if config.train.optimizer == "muon" else 0)


def muon_updates(param: ParamTensor) -> bool:
    """Whether Muon updates ``param``: the hidden matrices (``moe.hidden_matrices``), i.e. the attention and dense
    or shared-expert FFN matrices, multi-token prediction's projections and the routed experts' ``[E, ., .]``
    stacks; not the embedding, head, router, norms or biases (the experts' ``[E, width]`` biases are 2-D)."""
    return (param.kind in ("attention", "ffn", "projection") and len(param.shape) == 2) or \
        (param.kind == "experts" and len(param.shape) == 3)


@functools.lru_cache(maxsize=65536)
def _states(params: tuple[ParamTensor, ...], layout: Layout, has_moe: bool, vp: bool) -> tuple[int, int, int]:
    """fp32 bytes of ``params`` on one rank: dense, routed experts, and of those the ones Muon would update."""
    dense = experts = muon = 0
    for param in params:
        nbytes = sharded_numel_of(param, layout, has_moe, vp) * FP32
        if param.expert:
            experts += nbytes
        else:
            dense += nbytes
        if muon_updates(param):
            muon += nbytes
    return dense, experts, muon


def accumulated_grad_bytes(config: RunConfig, layout: Layout, microbatches: int, pp_rank: int = 0) -> int:
    """Bytes of gradients one rank holds between micro-batches beyond its sharded gradients (``ModelStates.grads``).

    Under ``parallel.grad_reduce=step`` with several micro-batches every FSDP unit holds its tp-local
    unsharded fp32 gradients instead of their shards until the last micro-batch's reduce-scatter: the
    difference, summed over this rank's parameters (none for a parameter FSDP does not shard). Zero under
    ``microbatch`` or with one micro-batch, where gradients are reduce-scattered as they are produced.
    """
    if config.parallel.grad_reduce != "step" or microbatches == 1:
        return 0
    model, vp = config.model, config.parallel.vocab_parallel
    layers, first, last = local_layers(config, layout, pp_rank)
    has_moe = model.n_moe_layers > 0
    total = _unsharded_extra(tuple(root_tensors(model, config.moe, first, last)), layout, has_moe, vp)
    return total + sum(count * _unsharded_extra(block.params, layout, has_moe, vp)
                       for block, count in rank_blocks(model, config.moe, layers))


@functools.lru_cache(maxsize=65536)
def _unsharded_extra(params: tuple[ParamTensor, ...], layout: Layout, has_moe: bool, vp: bool) -> int:
    """fp32 bytes of ``params``' tp-local gradients beyond their FSDP shards."""
    return FP32 * sum(math.prod(tp_local_shape(p, layout, vp)) - sharded_numel_of(p, layout, has_moe, vp)
                      for p in params)


def _block_gathered(params: tuple[ParamTensor, ...], config: RunConfig, layout: Layout,
                    weight_bytes: int = FP32) -> int:
    """Bytes FSDP all-gathers to run one block (``params``): its tp-local weights in the units that are sharded,
    ``weight_bytes`` an element (2 under bf16 mixed precision, but the routers' own units stay fp32)."""
    return _gathered(params, layout, config.model.n_moe_layers > 0, config.parallel.vocab_parallel, weight_bytes)


@functools.lru_cache(maxsize=65536)
def _gathered(params: tuple[ParamTensor, ...], layout: Layout, has_moe: bool, vp: bool, weight_bytes: int) -> int:
    total = 0
    for param in params:
        if param.expert and experts_spread(layout, has_moe):  # the experts' own unit
            sharded = layout.edp > 1
        else:
            sharded = layout.dp_shard_cp > 1
        if sharded:
            size = FP32 if param.kind == "router" else weight_bytes
            total += math.prod(tp_local_shape(param, layout, vp)) * size
    return total


def gathered_bytes(config: RunConfig, layout: Layout, pp_rank: int = 0, microbatches: int = 1,
                   precision: str = "fp32") -> int:
    """Peak bytes of FSDP's all-gathered (unsharded, tp-local) weights and unsharded gradients on one rank.

    Weights are gathered in fp32, or in bf16 under bf16 training (FSDP's mixed precision; the routers' units in
    fp32); the unsharded gradients FSDP reduces are fp32 (its reduce dtype). The root unit (embedding, final
    norm, head) is never resharded after forward (``parallel/sharding.py``).
    Blocks: in backward the current block's weights, the next block's (prefetched) and the current block's
    fresh unsharded gradients (before their reduce-scatter, or before they are added to the held ones under
    ``grad_reduce=step``: ``accumulated_grad_bytes`` counts those); with ``reshard_after_forward=false`` all
    local blocks stay gathered from forward to backward, plus one block's gradients. So they do under
    pipelining with ``grad_reduce=step`` and several micro-batches: the stage keeps its blocks gathered from
    one backward to the next (``parallel/pipeline.py``, as torch's ``PipelineStage``).
    """
    layers, first, last = local_layers(config, layout, pp_rank)
    weight_bytes = 2 if precision == "bf16" else FP32
    blocks = rank_blocks(config.model, config.moe, layers)
    weights = [(_block_gathered(block.params, config, layout, weight_bytes), count) for block, count in blocks]
    grads = [_block_gathered(block.params, config, layout) for block, _ in blocks]
    root = 0
    if layout.dp_shard_cp > 1:
        root = sum(math.prod(tp_local_shape(p, layout, config.parallel.vocab_parallel))
                   for p in root_tensors(config.model, config.moe, first, last)) * weight_bytes
    kept_by_pipeline = layout.pp > 1 and config.parallel.grad_reduce == "step" and microbatches > 1
    if config.parallel.reshard_after_forward and not kept_by_pipeline:
        return root + 2 * max((w for w, _ in weights), default=0) + max(grads, default=0)
    return root + sum(w * count for w, count in weights) + max(grads, default=0)
