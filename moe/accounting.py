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


def attention_parameters(model: ModelConfig) -> int:
    """One block's attention weights, its norms included (``moe/transformer.py``, ``moe/latent_attention.py``).

    Grouped-query: wq, wo (nh·hd wide), wk, wv (nkv·hd), their biases with ``qkv_bias``, wo's with
    ``attn_output_bias``, one sink per head with ``attention_sinks``, and hd-wide q/k norms with ``qk_norm``. Latent:
    the query projection (full, or c' -rank with its norm), wkv_a into c + r, the c-wide latent norm, wkv_b out
    to nh·(n + v), and wo from nh·v.
    """
    d, heads = model.d_model, model.n_heads
    if not model.latent_attention:
        hd = model.head_size
        biases = (heads + 2 * model.kv_heads) * hd if model.qkv_bias else 0
        biases += d if model.attn_output_bias else 0
        sinks = heads if model.attention_sinks else 0
        return d * heads * hd * 2 + d * model.kv_heads * hd * 2 + (2 * hd if model.qk_norm else 0) + biases + sinks
    qk, rank = model.qk_nope_head_dim + model.qk_rope_head_dim, model.q_lora_rank
    query = d * heads * qk if rank is None else d * rank + rank + rank * heads * qk
    latent = d * (model.kv_lora_rank + model.qk_rope_head_dim) + model.kv_lora_rank
    return query + latent + model.kv_lora_rank * heads * (model.qk_nope_head_dim + model.v_head_dim) \
        + heads * model.v_head_dim * d


def attention_flops_per_token(model: ModelConfig) -> float:
    """Training FLOPs of one token's attention scores and weighted values in one block (the projections are
    counted with the parameters): 6 · S · nh · (qk width + v width), which is PaLM's 12 · S · nh · hd
    (Chowdhery et al. 2022, appendix B) when queries, keys and values are hd wide. Latent attention's are
    n + r and v."""
    if model.latent_attention:
        width = model.qk_nope_head_dim + model.qk_rope_head_dim + model.v_head_dim
    else:
        width = 2 * model.head_size
    return 6.0 * model.n_heads * width * model.seq_len


def expert_parameters(d_model: int, moe: MoEConfig) -> int:
    """One routed expert's weights: gate (gated activations only), up and down; with ``moe.expert_proj_bias`` a
    bias per hidden unit of gate and up and per output of down."""
    matrices = 3 if moe.gated else 2
    biases = (matrices - 1) * moe.expert_hidden + d_model if moe.expert_proj_bias else 0
    return matrices * d_model * moe.expert_hidden + biases


def router_parameters(d_model: int, moe: MoEConfig) -> int:
    """The router's gate [E, D] and, with ``moe.router_bias``, its logit bias [E]."""
    return (d_model + (1 if moe.router_bias else 0)) * moe.num_experts


def parameter_counts(model: ModelConfig, moe: MoEConfig) -> ParameterCounts:
    d = model.d_model
    attention = attention_parameters(model)
    norms = 2 * d
    dense_ffn = 3 * d * model.ffn_hidden
    one_expert = expert_parameters(d, moe)
    shared = 3 * d * moe.shared_hidden if moe.num_shared_experts else 0
    router = router_parameters(d, moe)

    # multi-token prediction: each module a block (of the kind layer n_layers + k would be), the 2d -> d projection
    # and three norms (``moe/mtp.py``); the embedding and head are the main model's
    mtp_moe = sum(model.is_moe_layer(model.n_layers + k) for k in range(model.mtp_depth))
    n_moe = model.n_moe_layers + mtp_moe
    n_blocks = model.n_layers + model.mtp_depth
    n_dense = n_blocks - n_moe
    embedding = model.vocab_size * d
    head = 0 if model.tie_embeddings else model.vocab_size * d
    common = embedding + head + d + n_blocks * (attention + norms) + n_dense * dense_ffn
    common += model.mtp_depth * (2 * d * d + 3 * d)
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
    embedding lookup does none; a tied head still does), plus ``attention_flops_per_token`` per layer
    for attention scores and values; multi-token prediction's modules count as blocks, with the shared head once
    more each (their shorter sequences, S - k, are not discounted).
    """
    counts = parameter_counts(model, moe)
    matmul_params = counts.active - counts.embedding
    if model.tie_embeddings:
        matmul_params += model.vocab_size * model.d_model
    matmul_params += model.mtp_depth * model.vocab_size * model.d_model  # the shared head, once per MTP module
    return 6.0 * matmul_params + (model.n_layers + model.mtp_depth) * attention_flops_per_token(model)


def block_flops_per_token(model: ModelConfig, moe: MoEConfig, is_moe: bool) -> float:
    """Training FLOPs of one token through one transformer block, on the terms of ``training_flops_per_token``.

    ``6 *`` the block's active matmul parameters (attention, its two norms, and the dense FFN or
    the router, shared experts and top_k routed experts) ``+ attention_flops_per_token``.
    A MoE block with top_k experts of the dense FFN's size costs more than a dense block; the
    pipeline split (``parallel/pipeline.py``) balances stages by these numbers.
    """
    d = model.d_model
    params = attention_parameters(model) + 2 * d
    if is_moe:
        params += router_parameters(d, moe) + moe.top_k * expert_parameters(d, moe)
        params += 3 * d * moe.shared_hidden if moe.num_shared_experts else 0
    else:
        params += 3 * d * model.ffn_hidden
    return 6.0 * params + attention_flops_per_token(model)


def head_flops_per_token(model: ModelConfig) -> float:
    """Training FLOPs of one token through the final norm and the LM head (the embedding lookup has none)."""
    return 6.0 * (model.vocab_size * model.d_model + model.d_model)


def mtp_flops_per_token(model: ModelConfig, moe: MoEConfig) -> float:
    """Training FLOPs of one token through the multi-token-prediction modules (``moe/mtp.py``), on the terms of
    ``training_flops_per_token``: each module a block of its kind (``ModelConfig.is_moe_layer(n_layers + k)``), its
    2d -> d projection and three norms, and the shared head once more. They run beside the head, on the last
    pipeline stage, which the stage split weighs with them (``parallel/pipeline.py``)."""
    d = model.d_model
    return sum(block_flops_per_token(model, moe, model.is_moe_layer(model.n_layers + k))
               + 6.0 * (2 * d * d + 3 * d + model.vocab_size * d) for k in range(model.mtp_depth))
