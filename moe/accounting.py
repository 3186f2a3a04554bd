"""Parameter and FLOP counts from a config alone, without building the model: the module kinds' own statements
(``moe/attention/``, ``moe/feed_forward.py``, ``moe/layer.py``) summed over the layer pattern.

Used for MFU in training logs and by the memory model and planner in ``analysis/``, so they must agree exactly with
the modules in ``moe/`` (a test checks the totals against a built model).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from config.model import LayerSpec, ModelConfig, MoEConfig
from moe.attention import attention_kind
from moe.block import feed_forward_kind
from moe.hyper_connections import HyperConnection, HyperHead
from moe.mtp import prediction_module
from moe.param_tensors import ParamTensor

T = TypeVar("T")


def per_model(store: dict, model: ModelConfig, moe: MoEConfig, build: Callable[[], T]) -> T:
    """``build()`` remembered in ``store`` for this model's shape: found by the config objects' identity and
    confirmed by equality with a copy kept of each (so a changed or new object with other values is built
    again). Cheaper than hashing the values, which the planner would do for every candidate it weighs."""
    entry = store.get((id(model), id(moe)))
    if entry is None or entry[0] != model or entry[1] != moe:
        if len(store) > 256:
            store.clear()
        entry = store[id(model), id(moe)] = (copy.copy(model), copy.copy(moe), build())
    return entry[2]


@dataclass(frozen=True)
class ParameterCounts:
    total: int  # every parameter
    active: int  # parameters one token uses: shared weights + top_k routed experts per MoE layer
    embedding: int  # the token-embedding table (a lookup: no matmul FLOPs)
    routed_experts: int  # all routed-expert weights (what expert parallelism shards)

    @property
    def dense(self) -> int:
        """Everything but the routed experts (what tensor/data parallelism handle)."""
        return self.total - self.routed_experts


def block_tensors(model: ModelConfig, moe: MoEConfig, layer: LayerSpec, i: int | None) -> list[ParamTensor]:
    """The tensors of block i, of ``layer``'s kinds (``moe/block.py``): its two norms, then what its attention and
    feed-forward kinds state, then its two hyper-connections' with ``model.hc_mult`` > 1 (i None: a block of these
    kinds wherever it is; the shapes do not depend on it)."""
    d = model.d_model
    hyper = HyperConnection.parameter_tensors(model, i) * 2 if model.hc_mult > 1 else []
    return [ParamTensor("norm", i, (d,)), ParamTensor("norm", i, (d,)),
            *attention_kind(layer).parameter_tensors(model, i),
            *feed_forward_kind(layer).parameter_tensors(model, moe, i), *hyper]


def _block_parameters(model: ModelConfig, moe: MoEConfig, layer: LayerSpec) -> tuple[int, int, int]:
    """(all, active, routed-expert) parameters of one block of ``layer``'s kinds: the routed experts' stacks [E, ...]
    count top_k of E experts as active."""
    total = active = routed = 0
    for param in block_tensors(model, moe, layer, None):
        total += param.numel
        routed += param.numel if param.expert else 0
        active += param.numel * moe.top_k // moe.num_experts if param.expert else param.numel
    return total, active, routed


def parameter_counts(model: ModelConfig, moe: MoEConfig) -> ParameterCounts:
    """Every block's kinds' parameters, the multi-token-prediction modules' projection and norms
    (``moe/mtp.py``: their embedding and head are the main model's), the embedding, final norm and head (and the
    hyper-connections' final collapse)."""
    return per_model(_COUNTS, model, moe, lambda: _parameter_counts(model, moe))


def _parameter_counts(model: ModelConfig, moe: MoEConfig) -> ParameterCounts:
    d = model.d_model
    embedding = model.vocab_size * d
    head = 0 if model.tie_embeddings else model.vocab_size * d
    mtp = sum(_mtp_extra_parameters(model, model.n_layers + k) for k in range(model.mtp_depth))
    total = embedding + d + head + mtp  # the final norm; the MTP modules' projections and norms (and collapses)
    total += sum(param.numel for param in HyperHead.parameter_tensors(model)) if model.hc_mult > 1 else 0
    active, routed = total, 0
    for layer in model.layer_pattern:
        block_total, block_active, block_routed = _block_kind_parameters(model, moe, layer)
        total, active, routed = total + block_total, active + block_active, routed + block_routed
    return ParameterCounts(total=total, active=active, embedding=embedding, routed_experts=routed)


def _block_kind_parameters(model: ModelConfig, moe: MoEConfig, layer: LayerSpec) -> tuple[int, int, int]:
    """``_block_parameters`` remembered per kind of block."""
    known = per_model(_KIND_PARAMETERS, model, moe, dict)
    if layer not in known:
        known[layer] = _block_parameters(model, moe, layer)
    return known[layer]


_COUNTS: dict = {}  # per_model stores
_KIND_PARAMETERS: dict = {}


def attention_flops_per_token(model: ModelConfig, layer: LayerSpec) -> float:
    """Training FLOPs of one token's attention scores and weighted values in one block of ``layer``'s kind, as the
    kind states them (``AttentionKind.flops_per_token``; the projections are counted with the parameters)."""
    return attention_kind(layer).flops_per_token(model)


def training_flops_per_token(model: ModelConfig, moe: MoEConfig) -> float:
    """Model FLOPs of one training token (forward + backward), without recomputation.

    ``6 * N_active`` for the weight matmuls (2 forward, 4 backward per parameter;
    Kaplan et al. 2020 sec. 2.1) over the active parameters that do matmuls (the
    embedding lookup does none; a tied head still does), plus ``attention_flops_per_token`` per layer
    for attention scores and values; multi-token prediction's modules count as blocks, with the shared head once
    more each (their shorter sequences, S - k, are not discounted). With hyper-connections, each block's and
    collapse's products of the streams (``hyper_flops_per_token``).
    """
    counts = parameter_counts(model, moe)
    matmul_params = counts.active - counts.embedding
    if model.tie_embeddings:
        matmul_params += model.vocab_size * model.d_model
    matmul_params += model.mtp_depth * model.vocab_size * model.d_model  # the shared head, once per MTP module
    hyper = (len(model.layer_pattern) * hyper_flops_per_token(model)  # every block, main and MTP
             + (1 + model.mtp_depth) * hyper_head_flops_per_token(model))  # the model's collapse and each module's
    return 6.0 * matmul_params + sum(attention_flops_per_token(model, layer) for layer in model.layer_pattern) + hyper


def hyper_flops_per_token(model: ModelConfig) -> float:
    """Training FLOPs of one token's stream products in one block's two hyper-connections beyond their projections
    (``HyperConnection.flops_per_token``); none without hyper-connections."""
    return 2 * HyperConnection.flops_per_token(model) if model.hc_mult > 1 else 0.0


def hyper_head_flops_per_token(model: ModelConfig) -> float:
    """The same of one final collapse of the streams (``HyperHead``: the model's, and each MTP module's)."""
    return HyperHead.flops_per_token(model) if model.hc_mult > 1 else 0.0


def block_flops_per_token(model: ModelConfig, moe: MoEConfig, layer: LayerSpec) -> float:
    """Training FLOPs of one token through one transformer block of ``layer``'s kinds, on the terms of
    ``training_flops_per_token``: ``6 *`` the block's active matmul parameters (attention, its two norms, and the
    dense FFN or the router, shared experts and top_k routed experts, and its hyper-connections')
    ``+ attention_flops_per_token`` (``+ hyper_flops_per_token``). A MoE block with top_k experts of the dense FFN's
    size costs more than a dense block; the pipeline split (``parallel/pipeline.py``) balances stages by these
    numbers.
    """
    return (6.0 * _block_kind_parameters(model, moe, layer)[1] + attention_flops_per_token(model, layer)
            + hyper_flops_per_token(model))


def head_flops_per_token(model: ModelConfig) -> float:
    """Training FLOPs of one token through the final norm and the LM head (the embedding lookup has none), and the
    streams' collapse before them with hyper-connections."""
    hyper = 0.0
    if model.hc_mult > 1:
        weights = sum(param.numel for param in HyperHead.parameter_tensors(model))
        hyper = 6.0 * weights + hyper_head_flops_per_token(model)
    return 6.0 * (model.vocab_size * model.d_model + model.d_model) + hyper


def mtp_flops_per_token(model: ModelConfig, moe: MoEConfig) -> float:
    """Training FLOPs of one token through the multi-token-prediction modules (``moe/mtp.py``), on the terms of
    ``training_flops_per_token``: each module a block of its kind (``ModelConfig.layer(n_layers + k)``), its
    projections and norms (and collapse: ``_mtp_extra_parameters``), and the shared head once more. They run beside
    the head, on the last pipeline stage, which the stage split weighs with them (``parallel/pipeline.py``)."""
    return sum(block_flops_per_token(model, moe, model.layer(i))
               + 6.0 * (_mtp_extra_parameters(model, i) + model.vocab_size * model.d_model)
               + hyper_head_flops_per_token(model) for i in range(model.n_layers, model.n_layers + model.mtp_depth))


def _mtp_extra_parameters(model: ModelConfig, i: int) -> int:
    """A multi-token-prediction module's parameters besides its block (layer i): its projections and norms, and
    with hyper-connections its collapse of the streams (``moe/mtp.py``)."""
    return sum(param.numel for param in prediction_module(model).parameter_tensors(model, i))
