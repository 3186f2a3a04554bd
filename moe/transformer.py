"""The decoder-only MoE language model: RMSNorm, RoPE attention (or latent attention), dense and MoE blocks.

Shapes: B sequences, S positions, D = d_model, nh / nkv query / key-value heads, hd = head dim, V vocab.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from config.model import ModelConfig, MoEConfig
from moe.documents import Documents, documents_of, rotary_tables
from moe.experts import FeedForward
from moe.init import Slice, initialize, whole
from moe.kv_cache import KVCache, LayerCache
from moe.latent_attention import LatentAttention
from moe.layer import MoELayer, RoutingStats
from moe.losses import attach_loss
from moe.max_logits import LogitTracker, max_attention_logits
from moe.mtp import PredictionModule, PredictionModules
from moe.norm import RMSNorm
from moe.rope import apply_rope, rope_tables
from moe.sequence_shards import SequenceShards, attends_by_chunks

SINK_CHANNELS = 8  # channels added to queries, keys and values to carry the attention sink (``_fold_in_sink``)


def blocked_window(seq: int, window: int | None) -> bool:
    """Whether a whole sequence of ``seq`` positions attends through ``Attention._blocked_window_attention``: at
    least four windows long (shorter, the blocks' doubled keys would cost about what they save)."""
    return window is not None and seq >= 4 * window


class Attention(nn.Module):
    """Causal multi-head (or grouped-query) attention with rotary positions, on SDPA.

    With ``qkv_bias`` the query, key and value projections add biases (GLM-4.5); with ``rotary_dim`` RoPE turns
    only the first channels of each head and the others carry content alone (GLM's partial rotary).
    With ``qk_norm`` each query and key head is RMS-normalised over its hd channels (one weight [hd] shared
    by the heads) before RoPE, as Qwen3 does: it keeps the attention logits from growing without bound
    ("QK normalization", Dehghani et al. 2023, "Scaling Vision Transformers to 22 Billion Parameters",
    sec. 3). Per head, so it runs unchanged on the heads a tensor-parallel rank holds.

    GPT-OSS's options: ``attn_output_bias`` (a bias on ``wo`` too), ``attention_sinks`` (``sinks`` [nh], one
    logit per head in every softmax's denominator with no value: ``softmax_j(l_j)`` becomes
    ``exp(l_j) / (exp(s_h) + sum_i exp(l_i))``) and ``window`` (this layer's sliding window: a query sees itself
    and the window - 1 positions before it). Both run on SDPA (``_masked_attention``); a whole sequence at
    least four windows long computes only the scores inside the window (``_blocked_window_attention``).

    With a ``logit_tracker`` (``moe/max_logits.py``; QK-clip, ``training/qk_clip.py``) each training forward also
    records every head's largest logit over the keys it may see.

    With ``documents`` (``moe/documents.py``: packed documents masked from each other) RoPE takes each position's
    place in its document, and the one [B, 1, S, S] mask the model made for them all is SDPA's ``attn_mask``: a
    block-diagonal causal mask on the same kernels, composing with the window and the sinks (the blocked window
    path masks its blocks by document too). SDPA computes every score of the mask, so it costs what a full
    (non-causal) attention costs; ``docs/data.md`` has the measurements.

    Under context parallelism the same ``documents`` hold this rank's query positions and the mask's rows for them
    (``moe/sequence_shards.py``): the keys and values this rank computed are joined by every other rank's through
    ``gather_sequence`` (an identity here; ``parallel/context.py`` makes it an all-gather over the cp ranks, whose
    backward sums each key's gradient from every rank's queries), in one tensor so that a layer makes one exchange.
    Gathering the key/value heads, not the query heads, is what grouped-query attention saves here too.
    """

    def __init__(self, config: ModelConfig, window: int | None = None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.kv_heads, config.head_size
        self.rotary_dim = config.rope_dim
        self.window = window
        self.wq = nn.Linear(config.d_model, self.n_heads * self.head_dim, bias=config.qkv_bias)
        self.wk = nn.Linear(config.d_model, self.n_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.wv = nn.Linear(config.d_model, self.n_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.wo = nn.Linear(self.n_heads * self.head_dim, config.d_model, bias=config.attn_output_bias)
        self.sinks = nn.Parameter(torch.empty(self.n_heads)) if config.attention_sinks else None
        self.q_norm = RMSNorm(self.head_dim, eps=config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps=config.norm_eps) if config.qk_norm else None
        self.gather_sequence = nn.Identity()
        self.logit_tracker: LogitTracker | None = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: LayerCache | None = None,
                documents: Documents | None = None) -> Tensor:
        """x: [B, S, D]; cos, sin: the rotary tables of at least S positions, of which the first S are used.

        With ``cache`` (generation) x holds the S positions after the cached ones: they take the rotary angles of
        their own positions, and attend to the cached keys and to themselves causally. With ``documents`` the
        tables and the mask are theirs.
        """
        batch, seq, _ = x.shape
        start = 0 if cache is None else cache.length
        cos, sin = rotary_tables(cos, sin, start, seq, documents)
        q = self.wq(x).view(batch, seq, -1, self.head_dim)  # [B, S, nh, hd]
        k = self.wk(x).view(batch, seq, -1, self.head_dim)  # [B, S, nkv, hd]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, heads, S, hd]
        v = self.wv(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        k, v, mask = (k, v, None) if cache is None else cache.extend(k, v)
        if documents is not None:
            mask = documents.mask
            if documents.sharded:  # every context-parallel rank's keys and values, k and v in one exchange
                k, v = self.gather_sequence(torch.cat((k, v), dim=-1)).chunk(2, dim=-1)
        if self.logit_tracker is not None and self.training and cache is None:  # over every key a query may see
            self.logit_tracker.record(max_attention_logits(q, k, self.head_dim ** -0.5, self.window, documents))
        if self.sinks is not None or self.window is not None:
            out = self._masked_attention(q, k, v, start, documents)
        elif documents is not None and documents.mask is None:  # whole sequences under cp
            out = documents.shards.causal_attention(q, k, v, self.head_dim ** -0.5)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and start == 0,
                                                 enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    def _masked_attention(self, q: Tensor, k: Tensor, v: Tensor, start: int,
                          documents: Documents | None = None) -> Tensor:
        """Causal attention with this layer's window and sinks: q [B, nh, S, hd] at positions start.., k and v
        [B, nkv, start + S, hd] (the cache's and the new ones) -> [B, nh, S, hd].

        A whole sequence much longer than its window goes through ``_blocked_window_attention``, which
        computes only the scores near the diagonal. Otherwise one SDPA with a boolean mask over (query, key)
        positions (causal, and the window; within a document given ``documents``), shared by heads (and by
        sequences without documents); the sink as in ``_fold_in_sink``. A context-parallel rank's queries are not
        one run of positions, so it takes the masked path, with the positions ``documents`` holds.
        """
        seq, keys = q.shape[2], k.shape[2]
        sharded = documents is not None and documents.sharded
        if start == 0 and blocked_window(seq, self.window) and not sharded:
            return self._blocked_window_attention(q, k, v, None if documents is None else documents.ids)
        if documents is None:
            query_pos = torch.arange(start, start + seq, device=q.device)[:, None]
            key_pos = torch.arange(keys, device=q.device)[None, :]
        else:
            query_pos, key_pos = documents.query_pos[:, None], documents.key_pos[None, :]
        allowed = key_pos <= query_pos if documents is None else documents.mask  # [S, K] or [B, 1, Sq, S]
        if self.window is not None:  # a new tensor: the documents' mask is every layer's
            allowed = allowed & (key_pos > query_pos - self.window)
        return self._attend(q, k, v, allowed)

    def _blocked_window_attention(self, q: Tensor, k: Tensor, v: Tensor, ids: Tensor | None = None) -> Tensor:
        """Sliding-window attention that costs O(S · 2W) scores, not the O(S²/2) of a masked causal SDPA.

        The queries are cut into blocks of W (the window); the keys any query of block b can see lie in the
        2W positions [(b - 1)W, (b + 1)W), so each block attends to those alone, all blocks in one SDPA call
        with the blocks folded into the batch. One [W, 2W] mask pattern serves every block but the first,
        whose first W keys lie before position 0 (zero padding, masked). The sequence is padded to whole
        blocks; padded queries are dropped, and no real query sees a padded key (they come after it).
        With document ``ids`` [B, S] a query also sees only the keys of its own document: the ids are cut into the
        same blocks as the queries and keys. Padding takes id -1, never a real document's, and a padded query keeps
        itself in view, so no row of the mask is empty (SDPA would give NaN there, and NaN times a zero gradient
        still reaches the values' gradient).
        q [B, nh, S, hd], k and v [B, nkv, S, hd] -> [B, nh, S, hd].
        """
        batch, heads, seq, hd = q.shape
        kv_heads, window = k.shape[1], self.window
        blocks = -(-seq // window)
        pad = blocks * window - seq

        def key_blocks(x: Tensor) -> Tensor:  # [B, nkv, S, hd] -> [B·nb, nkv, 2W, hd]
            padded = F.pad(x, (0, 0, window, pad))  # W zero positions before, the tail to whole blocks after
            windows = padded.unfold(2, 2 * window, window)  # [B, nkv, nb, hd, 2W]
            return windows.permute(0, 2, 1, 4, 3).reshape(batch * blocks, kv_heads, 2 * window, hd)

        q_blocks = F.pad(q, (0, 0, 0, pad)).view(batch, heads, blocks, window, hd).transpose(1, 2)
        q_blocks = q_blocks.reshape(batch * blocks, heads, window, hd)
        i = torch.arange(window, device=q.device)[:, None]  # query i of a block: position b·W + i
        j = torch.arange(2 * window, device=q.device)[None, :]  # key j of its block: position (b - 1)·W + j
        pattern = (j <= i + window) & (j > i)  # causal and within the window: 0 <= query - key < W
        first = pattern & (j >= window)  # block 0: keys j < W are the padding before position 0
        allowed = torch.stack([first] + [pattern] * (blocks - 1)).repeat(batch, 1, 1)[:, None]  # [B·nb, 1, W, 2W]
        if ids is not None:
            query_ids = F.pad(ids, (0, pad), value=-1).view(batch * blocks, 1, window, 1)
            key_ids = F.pad(ids, (window, pad), value=-1).unfold(1, 2 * window, window)  # [B, nb, 2W]
            allowed = allowed & (query_ids == key_ids.reshape(batch * blocks, 1, 1, 2 * window))
        out = self._attend(q_blocks, key_blocks(k), key_blocks(v), allowed)
        out = out.reshape(batch, blocks, heads, window, hd).transpose(1, 2).reshape(batch, heads, blocks * window, hd)
        return out[:, :, :seq]

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> Tensor:
        """One SDPA under the boolean mask ``allowed``, with this layer's sink folded in: q [..., h, Sq, hd], k and
        v [..., hkv, K, hd] -> [..., h, Sq, hd]."""
        q, k, v, allowed = self._fold_in_sink(q, k, v, allowed)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.head_dim ** -0.5,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out[..., :self.head_dim]

    def _fold_in_sink(self, q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The attention sink as one more key with a zero value, seen by every query: q [..., h, Sq, hd], k and
        v [..., hkv, K, hd], ``allowed`` [..., Sq, K] -> the same with hd + ``SINK_CHANNELS`` wide queries, keys and
        values and K + 1 keys (the sink first). Unchanged without sinks.

        The sink's logit must be s_h for every query of head h. Each query head gets ``SINK_CHANNELS`` extra
        channels holding (s_h · sqrt(hd), 0, ...); the sink key has (1, 0, ...) there and the real keys zeros,
        which leaves their logits as they were. With SDPA's scale fixed at 1/sqrt(hd) the sink's logit is
        exactly s_h and its gradient reaches ``sinks`` through the query channel: one extra key and a few
        channels, and no additive [nh, S, K] mask per head. A multiple of 8 channels keeps the head width
        aligned for the fused kernels. The values are padded with zero channels to the same width (``_attend``
        drops them from the output): with a value narrower than the query, SDPA has no fused kernel on CPU and
        falls back to its math path, which keeps the whole [h, Sq, K] attention matrix in fp32 for backward (at
        sequence 512 and 8 heads, 11.8 MB against 4.0 MB). Heads are counted from the tensors: a tp rank holds
        only its share.
        """
        if self.sinks is None:
            return q, k, v, allowed
        sinks = self.sinks.to_local() if isinstance(self.sinks, DTensor) else self.sinks  # [h] here
        sink_query = q.new_zeros(*q.shape[:-1], SINK_CHANNELS)
        sink_query[..., 0] = (sinks * self.head_dim ** 0.5).to(q.dtype)[:, None]
        q = torch.cat((q, sink_query), dim=-1)
        sink_key = k.new_zeros(*k.shape[:-2], 1, self.head_dim + SINK_CHANNELS)
        sink_key[..., self.head_dim] = 1.0
        k = torch.cat((sink_key, F.pad(k, (0, SINK_CHANNELS))), dim=-2)
        v = F.pad(torch.cat((v.new_zeros(*v.shape[:-2], 1, self.head_dim), v), dim=-2), (0, SINK_CHANNELS))
        allowed = torch.cat((allowed.new_ones(*allowed.shape[:-1], 1), allowed), dim=-1)
        return q, k, v, allowed

    def _rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """RoPE on the first ``rotary_dim`` channels of each head, the rest as they are (partial rotary, GLM)."""
        if self.rotary_dim == self.head_dim:
            return apply_rope(x, cos, sin)
        rotated, kept = x.split([self.rotary_dim, self.head_dim - self.rotary_dim], dim=-1)
        return torch.cat((apply_rope(rotated, cos, sin), kept), dim=-1)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + ffn(norm(x)); ffn dense or MoE."""

    def __init__(self, config: ModelConfig, moe_config: MoEConfig, is_moe: bool, window: int | None = None):
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.attn = LatentAttention(config) if config.latent_attention else Attention(config, window)
        self.ffn_norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.moe = MoELayer(config.d_model, moe_config) if is_moe else None
        self.ffn = None if is_moe else FeedForward(config.d_model, config.ffn_hidden)

    @property
    def feed_forward(self) -> nn.Module:
        return self.moe if self.moe is not None else self.ffn

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: LayerCache | None = None,
                documents: Documents | None = None) -> Tensor:
        normed = self.attn_norm(x)
        # the cache is passed only when there is one, the documents by name: tensor parallelism's input hooks
        # count the positional arguments
        x = _residual(x, self.attn(normed, cos, sin, documents=documents) if cache is None
                      else self.attn(normed, cos, sin, cache))
        return _residual(x, self.feed_forward(self.ffn_norm(x)))


def _residual(stream: Tensor, branch: Tensor) -> Tensor:
    """``stream + branch``. A bf16 branch (autocast) is cast into a new fp32 tensor that the stream is then
    added into: on CPU ``stream + branch`` makes the same cast as a temporary and then a third tensor."""
    if branch.dtype == stream.dtype or isinstance(branch, DTensor) or isinstance(stream, DTensor):
        return stream + branch
    return branch.to(stream.dtype).add_(stream)


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
        self.layers = nn.ModuleDict(
            {str(i): Block(config, moe_config, config.is_moe_layer(i), config.attention_window(i))
             for i in range(config.n_layers)}
        )
        self.norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.output = nn.Linear(config.d_model, config.vocab_size, bias=False)
        # multi-token prediction: its blocks are of the kind the layers after the last would be
        self.mtp = PredictionModules(
            PredictionModule(config, moe_config, Block(config, moe_config, config.is_moe_layer(config.n_layers + k)))
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
        """The rotary tables and the routers' balancing biases (zero), on the buffers' own device.

        Needed after ``to_empty`` (materialising a meta model), which leaves buffers uninitialised.
        """
        cos, sin = rope_tables(self.config)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        for layer in self.moe_layers().values():
            layer.router.expert_bias.zero_()

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
        (``parallel/pipeline.py``).
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
        for name, block in self.layers.items():
            x = (block(x, self.rope_cos, self.rope_sin, documents=docs) if cache is None
                 else block(x, self.rope_cos, self.rope_sin, cache.layer(name)))
        logits = self.output(self.norm(x)).float()
        if self.mtp is not None and self.training and cache is None:
            # the modules' mean loss, weighted, reaches backward through the logits (as the balancing losses do)
            if ids is not None:
                tokens, embedded = ids, self.tok_embeddings(ids)
            losses = self.mtp(x, embedded, tokens, self.output, self.rope_cos, self.rope_sin)
            self.last_mtp_losses = losses.detach()
            logits = attach_loss(logits, losses.mean(), self.config.mtp_loss_weight * self.aux_loss_scale)
        return logits

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
        """Weight of the injected losses (balancing, multi-token prediction) relative to the LM loss
        (1 / micro-batches): each micro-batch's LM loss is divided by the micro-batches before its backward, and so
        must they be."""
        self.aux_loss_scale = scale
        for layer in self.moe_layers().values():
            layer.aux_loss_scale = scale
