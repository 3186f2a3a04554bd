"""Parameter and FLOP counts from a config alone, without building the model.

Used for MFU in training logs and by the memory model and planner in ``analysis/``,
so they must agree exactly with the modules in ``moe/`` (a test checks the totals
against a built model).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from config.model import ModelConfig, MoEConfig

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


def parameter_counts(model: ModelConfig, moe: MoEConfig) -> ParameterCounts:
    d, hd = model.d_model, model.head_size
    attention = d * model.n_heads * hd * 2 + d * model.kv_heads * hd * 2  # wq, wo, wk, wv
    norms = 2 * d + (2 * hd if model.qk_norm else 0)
    dense_ffn = 3 * d * model.ffn_hidden
    matrices_per_expert = 3 if moe.activation == "swiglu" else 2
    one_expert = matrices_per_expert * d * moe.expert_hidden
    shared = 3 * d * moe.shared_hidden if moe.num_shared_experts else 0
    router = d * moe.num_experts

    n_moe = model.n_moe_layers
    n_dense = model.n_layers - n_moe
    embedding = model.vocab_size * d
    head = 0 if model.tie_embeddings else model.vocab_size * d
    common = embedding + head + d + model.n_layers * (attention + norms) + n_dense * dense_ffn
    common += n_moe * (router + shared)
    routed_total = n_moe * moe.num_experts * one_expert
    routed_active = n_moe * moe.top_k * one_expert
    return ParameterCounts(
        total=common + routed_total,
        active=common + routed_active,
        embedding=embedding,
        routed_experts=routed_total,
    )


def training_flops_per_token(model: ModelConfig, moe: MoEConfig) -> float:
    """Model FLOPs of one training token (forward + backward), without recomputation.

    ``6 * N_active`` for the weight matmuls (2 forward, 4 backward per parameter;
    Kaplan et al. 2020 sec. 2.1) over the active parameters that do matmuls (the
    embedding lookup does none; a tied head still does), plus ``12 * L * n_heads * hd * S``
    for attention scores and values (PaLM, Chowdhery et al. 2022, appendix B, where n_heads · hd = d_model;
    Qwen3's explicit ``head_dim`` makes it wider).
    """
    counts = parameter_counts(model, moe)
    matmul_params = counts.active - counts.embedding
    if model.tie_embeddings:
        matmul_params += model.vocab_size * model.d_model
    return 6.0 * matmul_params + 12.0 * model.n_layers * model.attention_width * model.seq_len


def block_flops_per_token(model: ModelConfig, moe: MoEConfig, is_moe: bool) -> float:
    """Training FLOPs of one token through one transformer block, on the terms of ``training_flops_per_token``.

    ``6 *`` the block's active matmul parameters (attention, its two norms, and the dense FFN or
    the router, shared experts and top_k routed experts) ``+ 12 * n_heads * hd * S`` for attention.
    A MoE block with top_k experts of the dense FFN's size costs more than a dense block; the
    pipeline split (``parallel/pipeline.py``) balances stages by these numbers.
    """
    d, hd = model.d_model, model.head_size
    params = d * model.n_heads * hd * 2 + d * model.kv_heads * hd * 2 + 2 * d + (2 * hd if model.qk_norm else 0)
    if is_moe:
        matrices_per_expert = 3 if moe.activation == "swiglu" else 2
        params += d * moe.num_experts + moe.top_k * matrices_per_expert * d * moe.expert_hidden
        params += 3 * d * moe.shared_hidden if moe.num_shared_experts else 0
    else:
        params += 3 * d * model.ffn_hidden
    return 6.0 * params + 12.0 * model.attention_width * model.seq_len


def head_flops_per_token(model: ModelConfig) -> float:
    """Training FLOPs of one token through the final norm and the LM head (the embedding lookup has none)."""
    return 6.0 * (model.vocab_size * model.d_model + model.d_model)
