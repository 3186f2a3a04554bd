"""The decoder-only MoE language model: token embedding, the blocks of the layer pattern (``moe/block.py``), the
final norm and the LM head.

Shapes: B sequences, S positions, D = d_model, V vocab.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from config.model import ModelConfig, MoEConfig
from moe.attention.indexer import IndexedAttention
from moe.attention.kernel import attends_by_chunks
from moe.attention.sparse_latent import share_selections
from moe.block import Block
from moe.documents import documents_of
from moe.hyper_connections import HyperHead, widen
from moe.init import Slice, initialize, whole
from moe.kv_cache import KVCache
from moe.layer import MoELayer, RoutingStats
from moe.losses import attach_loss
from moe.mtp import PredictionModules, prediction_module
from moe.norm import RMSNorm
from moe.rope import rope_tables
from moe.router import HashRouter
from moe.sequence_shards import SequenceShards


class MoETransformer(nn.Module):
    """Token embedding -> blocks -> RMSNorm -> LM head; returns logits [B, S, V].

    ``layers`` is a ModuleDict keyed by the layer index as a string, so parameter
    names stay the same when pipeline parallelism keeps only some of the layers.
    With ``model.mtp_depth`` the multi-token-prediction modules (``moe/mtp.py``) run in training after the
    head, and their weighted loss is attached to the logits; ``last_mtp_losses`` holds each module's loss.

    Initialisation (``init_weights``) follows ``moe/init.py``: each element is drawn from a generator
    seeded by (seed, parameter name, chunk), so a rank that holds a slice of a parameter can draw just
    that slice and get the single-process numbers. Built on the meta device (``with torch.device("meta")``)
    the model holds no memory and nothing is initialised: ``parallel.materialize`` allocates this rank's
    shards after the layout is applied and initialises them with the same rules.
    """

    def __init__(self, config: ModelConfig, moe_config: MoEConfig, seed: int = 0):
        super().__init__()
        self.config = config
        # this rank's positions of each sequence under context parallelism (set by ``parallel/context.py``): the
        # model then takes tokens [B, S / cp] and attends over the whole sequence's keys
        self.sequence_shards: SequenceShards | None = None
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.d_model)
        pattern = config.layer_pattern  # each block's attention and feed-forward kinds
        self.layers = nn.ModuleDict({str(i): Block(config, moe_config, pattern[i]) for i in range(config.n_layers)})
        # with hyper-connections (``model.hc_mult`` > 1) the streams' final collapse, before the norm
        self.hc_head = HyperHead(config) if config.hc_mult > 1 else None
        share_selections([block.attn for block in self.layers.values()])  # GLM-5's layers sharing a selection
        self.norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.output = nn.Linear(config.d_model, config.vocab_size, bias=False)
        # multi-token prediction: its blocks are of the kind the layers after the last would be (hyper-connected
        # modules with hyper-connections)
        module = prediction_module(config)
        self.mtp = PredictionModules(
            module(config, moe_config, Block(config, moe_config, pattern[config.n_layers + k]))
            for k in range(config.mtp_depth)) if config.mtp_depth else None
        self.last_mtp_losses: Tensor | None = None
        self.aux_loss_scale = 1.0  # the trainer's loss scale (``set_aux_loss_scale``), for the MTP loss too
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if self.tok_embeddings.weight.device.type != "meta":
            self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int, locate: Callable[[Tensor], Slice] = whole) -> None:
        """Initialise every parameter (``moe/init.py``'s rules) and buffer; ``locate`` finds a shard's place."""
        std = self.config.init_std
        initialize(self, seed, std, std / math.sqrt(2 * self.config.n_layers), locate)
        self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """The rotary tables, the routers' balancing biases (zero) and the hash routers' tables (``HashRouter``'s
        draw), on the buffers' own device.

        Needed after ``to_empty`` (materialising a meta model), which leaves buffers uninitialised.
        """
        cos, sin = rope_tables(self.config)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        for i, layer in self.moe_layers().items():
            layer.router.expert_bias.zero_()
            if isinstance(layer.router, HashRouter):
                layer.router.reset_table(f"layers.{i}.moe.router.tid2eid")

    def forward(self, tokens: Tensor, cache: KVCache | None = None, documents: Tensor | None = None,
                ids: Tensor | None = None) -> Tensor:
        """tokens: [B, S] int64 -> logits [B, S, V] (fp32 under autocast too).

        With ``cache`` (generation: ``inference/generate.py``) the tokens continue the cached positions, and their
        keys and values are added to it; the logits are those of the new positions only.
        With ``documents`` ([B, S] document ids, ``moe.documents.document_ids``) each packed document is computed
        as if alone: attention stays within it and positions restart at its start (``moe/documents.py``). A
        pipeline stage after the first gets hidden states as ``tokens`` and the whole sequence's ids. Under context
        parallelism (``sequence_shards``) ``tokens`` are this rank's positions of each sequence [B, S / cp]
        (``SequenceShards.shard``), the logits theirs, and ``documents`` the whole sequences' ids.
        The last pipeline stage, when it runs the multi-token-prediction modules, also gets the token ids ([B, S])
        as ``ids``: the modules embed the next tokens, with that stage's copy of the embedding
        (``parallel/pipeline.py``); so does every stage after the first that holds a hash-routed MoE layer.
        With hyper-connections the stream between blocks (and between pipeline stages) is [B, S, n, D].
        """
        shards = self.sequence_shards
        seq = tokens.shape[1] * (1 if shards is None else shards.cp) + (0 if cache is None else cache.length)
        if seq > self.rope_cos.shape[0]:
            raise ValueError(f"sequence length {seq} exceeds model.seq_len={self.rope_cos.shape[0]}")
        if (documents is not None or shards is not None) and (cache is not None or (self.mtp is not None
                                                                                     and self.training)):
            raise ValueError("document masking and context parallelism apply to training and evaluation windows; "
                             "not to generation with a cache, nor to multi-token prediction (model.mtp_depth > 0)")
        # under context parallelism whole sequences are one document each, and need a mask only where a layer has
        # a window or sinks (``SequenceShards.causal_attention`` serves the rest)
        masked = documents is not None or not attends_by_chunks(self.config)
        if shards is not None and documents is None:
            documents = torch.zeros(1, seq, dtype=torch.long, device=self.rope_cos.device)
        docs = None if documents is None else documents_of(documents, self.rope_cos, self.rope_sin, shards, masked)
        # attention takes the positions it needs from the full tables: under sequence parallelism the blocks
        # pass sequence shards between them and attention alone sees the whole sequence
        # Emb(t), the first block's input, where token ids come in; a later stage's hidden states pass as they are
        embedded = x = self.tok_embeddings(tokens) if ids is None else tokens
        if self.config.hc_mult > 1 and not tokens.is_floating_point():  # token ids came in, not a stage's streams
            x = widen(x, self.config.hc_mult)  # the first block's n streams
        hashed = {"token_ids": tokens if ids is None else ids} if self.hashed else {}  # hash routing's input
        for name, block in self.layers.items():
            x = (block(x, self.rope_cos, self.rope_sin, documents=docs, **hashed) if cache is None
                 else block(x, self.rope_cos, self.rope_sin, cache.layer(name), **hashed))
        streams = x  # with hyper-connections the last block's output streams, hyper-connected MTP's h^0
        if self.hc_head is not None:  # (None on a pipeline stage before the last: the streams go out)
            x = self.hc_head(x)
        normed = self.norm(x)
        logits = self.output(normed).float()
        if self.mtp is not None and self.training and cache is None:
            # the modules' mean loss, weighted, reaches backward through the logits (as the balancing losses do)
            if ids is not None:
                tokens, embedded = ids, self.tok_embeddings(ids)
            hidden = streams if self.hc_head is not None else normed
            losses = self.mtp(hidden, embedded, tokens, self.output, self.rope_cos, self.rope_sin)
            self.last_mtp_losses = losses.detach()
            logits = attach_loss(logits, losses.mean(), self.config.mtp_loss_weight * self.aux_loss_scale)
        return logits

    @property
    def hashed(self) -> bool:
        """Whether a block here routes by token id (``hash_moe``): the forward then passes the ids to the blocks."""
        return any(block.hashed for block in self.layers.values())

    def blocks(self) -> list[Block]:
        """Every transformer block: ``layers``' and then the multi-token-prediction modules'. The parallel plans
        (tp, activation checkpointing, compile) apply to each alike, so the modules are spread as the layers are."""
        return [*self.layers.values(), *(module.block for module in self.mtp or [])]

    def moe_layers(self) -> dict[int, MoELayer]:
        """The MoE layers by layer index; the multi-token-prediction modules' follow, as layers n_layers + k."""
        layers = {int(i): block.moe for i, block in self.layers.items() if block.moe is not None}
        for k, module in enumerate(self.mtp or []):
            if module.block.moe is not None:
                layers[self.config.n_layers + k] = module.block.moe
        return layers

    def routing_stats(self) -> dict[int, RoutingStats]:
        """Each MoE layer's statistics from the latest forward pass."""
        return {i: layer.last_stats for i, layer in self.moe_layers().items() if layer.last_stats is not None}

    def set_aux_loss_scale(self, scale: float) -> None:
        """Weight of the injected losses (balancing, multi-token prediction, indexer) relative to the LM loss
        (1 / micro-batches): each micro-batch's LM loss is divided by the micro-batches before its backward, and so
        must they be."""
        self.aux_loss_scale = scale
        for layer in self.moe_layers().values():
            layer.aux_loss_scale = scale
        for block in self.blocks():  # an indexer's loss (``moe/attention/indexer.py``)
            if isinstance(block.attn, IndexedAttention):
                block.attn.indexer_loss_scale = scale
