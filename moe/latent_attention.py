"""Multi-head latent attention (MLA; DeepSeek-V2 sec. 2.1, DeepSeek-V3 sec. 2.1.1).

Shapes: B sequences, S positions, D = d_model, nh heads, c = kv_lora_rank, c' = q_lora_rank,
n = qk_nope_head_dim, r = qk_rope_head_dim, v = v_head_dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from config.model import ModelConfig
from moe.documents import Documents, rotary_tables
from moe.kv_cache import LayerCache
from moe.max_logits import LogitTracker, max_attention_logits
from moe.norm import RMSNorm
from moe.rope import apply_rope, yarn_mscale
from moe.sequence_shards import SequenceShards

# The latent norms' epsilon: DeepSeek's reference code and its released checkpoints build them with their
# default 1e-6 whatever the model's norm epsilon, so a checkpoint's numbers depend on this value, not on ours.
LATENT_NORM_EPS = 1e-6


def latent_softmax_scale(config: ModelConfig) -> float:
    """1/sqrt(n + r), times mscale(s, yarn_mscale_all_dim)² under YaRN with ``yarn_mscale_all_dim`` set.

    DeepSeek-V3 puts YaRN's temperature (Peng et al. 2023, eq. 22) on the softmax rather than the rotary
    tables: on every channel of q·k, not only the rotated ones.
    """
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    if config.rope_scaling == "yarn" and config.yarn_mscale_all_dim:
        scale *= yarn_mscale(config.rope_factor, config.yarn_mscale_all_dim) ** 2
    return scale


class LatentAttention(nn.Module):
    """Causal MLA on SDPA.

    Keys and values of all heads are up-projected (``wkv_b``) from one RMS-normalised latent of c channels per
    token (``wkv_a`` makes it, beside the r-channel rotary key): what an inference cache keeps is c + r numbers
    per token instead of 2·nh·hd. Queries go through a c'-rank bottleneck with its own norm when ``q_lora_rank``
    is set (``wq_a``, ``q_latent_norm``, ``wq_b``), else one projection (``wq``). Position is decoupled: RoPE
    rotates only the r-channel part of each query and the one r-channel key the heads share (a rotation between
    the latent and the up-projection would stop the up-projection from being absorbed into the query at
    inference); the n other channels of each head carry content alone. Values are v wide.

    Under tensor parallelism the per-head projections (``wq``/``wq_b``, ``wkv_b``, ``wo``) split by heads; the
    latent projections and norms are small and every head needs their whole output, so they stay replicated.
    The head count is read from the projections' width, so the same code runs on a rank's heads. The one
    rotary key is shared by all heads, so a rank's heads give only part of its gradient: ``shared_rope_key``
    (an identity here) is where ``parallel/tensor.py`` sums that gradient over the tensor-parallel ranks.

    Under context parallelism (``documents.sharded``: ``moe/sequence_shards.py``) the ranks exchange what a cache
    would keep, the normalised latent and the rotated shared key (c + r numbers per token, 576 at DeepSeek-V3's
    size against 2·nh·hd = 40,960 for the up-projected keys and values), through ``gather_sequence`` (an identity
    here, an all-gather over the cp ranks from ``parallel/context.py``); each rank then up-projects every position's
    keys and values for its queries, which repeats the up-projection cp times over for 1/cp of the traffic.

    With a ``logit_tracker`` (QK-clip, as in ``Attention``) each training forward records every head's largest
    logit, q·k over the nope and rotary channels together times the softmax scale.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        d, heads = config.d_model, config.n_heads
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_rank = config.kv_lora_rank
        qk_dim = self.nope_dim + self.rope_dim
        rank = config.q_lora_rank
        self.wq = nn.Linear(d, heads * qk_dim, bias=False) if rank is None else None
        self.wq_a = nn.Linear(d, rank, bias=False) if rank else None
        self.q_latent_norm = RMSNorm(rank, eps=LATENT_NORM_EPS) if rank else None
        self.wq_b = nn.Linear(rank, heads * qk_dim, bias=False) if rank else None
        self.wkv_a = nn.Linear(d, self.kv_rank + self.rope_dim, bias=False)
        self.kv_latent_norm = RMSNorm(self.kv_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(self.kv_rank, heads * (self.nope_dim + self.v_dim), bias=False)
        self.wo = nn.Linear(heads * self.v_dim, d, bias=False)
        self.shared_rope_key = nn.Identity()
        self.gather_sequence = nn.Identity()
        self.softmax_scale = latent_softmax_scale(config)
        self.logit_tracker: LogitTracker | None = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: LayerCache | None = None,
                documents: Documents | None = None) -> Tensor:
        """x: [B, S, D]; cos, sin: rotary tables [>= S, r/2], of which the first S are used -> [B, S, D].

        With ``cache`` (generation) x holds the S positions after the cached ones, and with ``documents`` (packed
        documents masked from each other) the tables and the mask are theirs, as in ``Attention``."""
        batch, seq, _ = x.shape
        start = 0 if cache is None else cache.length
        cos, sin = rotary_tables(cos, sin, start, seq, documents)
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_latent_norm(self.wq_a(x)))
        q = q.view(batch, seq, -1, self.nope_dim + self.rope_dim).transpose(1, 2)  # [B, nh, S, n + r]
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope_dim], dim=-1)  # [B, S, c], [B, S, r]
        latent = self.kv_latent_norm(latent)
        k_rope = self.shared_rope_key(apply_rope(k_rope.unsqueeze(1), cos, sin))  # [B, 1, S, r]
        if documents is not None and documents.sharded:  # every context-parallel rank's latents and rotary keys
            both = self.gather_sequence(torch.cat((latent, k_rope.squeeze(1).to(latent.dtype)), dim=-1))
            latent, gathered_rope = both.split([self.kv_rank, self.rope_dim], dim=-1)
            k_rope = gathered_rope.unsqueeze(1).to(k_rope.dtype)
        kv = self.wkv_b(latent).view(batch, latent.shape[1], -1, self.nope_dim + self.v_dim)
        k_nope, v = kv.transpose(1, 2).split([self.nope_dim, self.v_dim], dim=-1)  # [B, nh, S, n], [B, nh, S, v]
        heads = q.shape[1]
        q = torch.cat((q_nope, apply_rope(q_rope, cos, sin)), dim=-1)
        k_rope = k_rope.expand(-1, heads, -1, -1)  # one rotary key, every head
        k = torch.cat((k_nope, k_rope), dim=-1)
        if self.logit_tracker is not None and self.training and cache is None:
            self.logit_tracker.record(max_attention_logits(q, k, self.softmax_scale, documents=documents))
        k, v, mask = (k, v, None) if cache is None else cache.extend(k, v)
        shards = None  # under context parallelism, shards of whole sequences: the causal attention of the shards
        if documents is not None:
            mask, shards = documents.mask, documents.shards if documents.mask is None else None
        out = _attend(q, k, v, self.softmax_scale, mask, causal=mask is None and start == 0,
                      shards=shards)  # [B, nh, S, v]
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


def _attend(q: Tensor, k: Tensor, v: Tensor, scale: float, mask: Tensor | None = None,
            causal: bool = True, shards: SequenceShards | None = None) -> Tensor:
    """SDPA (causal, or with generation's ``mask`` from ``LayerCache.extend``) whose keys and values differ in width
    (n + r against v): the narrower side is padded with zeros to the wider, which changes no score (a zero channel
    adds nothing to q·k) and no output channel that is kept (a zero value channel averages to zero, and is cut off).
    SDPA's flash kernels need one head width for q, k and v; without them it falls back to the math path, which
    keeps the [S, S] attention weights of every head for backward (measured on CPU: 8 KiB per head per 16-token
    sequence, 8.6 GB per 4,096-token sequence and layer at DeepSeek-V3's 128 heads). With ``shards`` (a
    context-parallel rank's queries of whole sequences) the causal attention of the shards, by chunks."""
    qk_dim, v_dim = q.shape[-1], v.shape[-1]
    if v_dim < qk_dim:
        v = F.pad(v, (0, qk_dim - v_dim))
    elif qk_dim < v_dim:
        q, k = F.pad(q, (0, v_dim - qk_dim)), F.pad(k, (0, v_dim - qk_dim))
    if shards is not None:
        return shards.causal_attention(q, k, v, scale)[..., :v_dim]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)[..., :v_dim]
