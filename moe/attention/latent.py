"""Multi-head latent attention (MLA; DeepSeek-V2 sec. 2.1, DeepSeek-V3 sec. 2.1.1), and what it costs.

Shapes: B sequences, S positions, D = d_model, nh heads, c = kv_lora_rank, c' = q_lora_rank,
n = qk_nope_head_dim, r = qk_rope_head_dim, v = v_head_dim.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from config.model import LayerSpec, ModelConfig
from moe.attention.base import AttentionKind
from moe.attention.kernel import CHUNKS, GATHERED, attend, kernel_saved_bytes, training_kernel
from moe.documents import Documents
from moe.kv_cache import LayerCache
from moe.norm import RMSNorm
from moe.param_tensors import ParamTensor
from moe.rope import apply_rope, yarn_mscale
from moe.saved_activations import FP32, MicroBatch, linear_input_bytes, norm_bytes

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


class LatentAttention(AttentionKind):
    """Causal MLA on the kernel core.

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

    Under context parallelism the ranks exchange what a cache would keep, the normalised latent and the rotated
    shared key (c + r numbers per token, 576 at DeepSeek-V3's size against 2·nh·hd = 40,960 for the up-projected
    keys and values); each rank then up-projects every position's keys and values for its queries, which repeats
    the up-projection cp times over for 1/cp of the traffic.
    """

    def __init__(self, config: ModelConfig, layer: LayerSpec):
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
        self.softmax_scale = latent_softmax_scale(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: LayerCache | None = None,
                documents: Documents | None = None) -> Tensor:
        """x: [B, S, D]; cos, sin: rotary tables [>= S, r/2] (the interface of ``AttentionKind``) -> [B, S, D]."""
        start, cos, sin = self.positions(x, cos, sin, cache, documents)
        _, q = self.queries(x, cos, sin)
        latent, k_rope, _ = self.latents(x, cos, sin, documents)
        k, v = self.keys_values(latent, k_rope, q.shape[1])
        self.track(q, k, self.softmax_scale, cache, documents)
        k, v, cache_mask = (k, v, None) if cache is None else cache.extend(k, v)
        out = attend(q, k, v, self.softmax_scale, start, cache_mask=cache_mask, documents=documents)  # [B, nh, S, v]
        return self.output(out)

    def queries(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor | None, Tensor]:
        """x [B, S, D] -> the normalised query latent [B, S, c'] (None without a bottleneck) and the queries
        [B, nh, S, n + r], their last r channels rotated."""
        batch, seq, _ = x.shape
        query_latent = None if self.wq is not None else self.q_latent_norm(self.wq_a(x))
        q = self.wq(x) if self.wq is not None else self.wq_b(query_latent)
        q = q.view(batch, seq, -1, self.nope_dim + self.rope_dim).transpose(1, 2)  # [B, nh, S, n + r]
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        return query_latent, torch.cat((q_nope, apply_rope(q_rope, cos, sin)), dim=-1)

    def latents(self, x: Tensor, cos: Tensor, sin: Tensor, documents: Documents | None,
                extra: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
        """x [B, S, D] -> the normalised latent [B, K, c] and the rotated shared key [B, 1, K, r] of every key
        position: under context parallelism every rank's, gathered in one exchange together with ``extra``
        ([B, S, e], what a kind built on this one needs of every position too), K = S otherwise."""
        latent, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope_dim], dim=-1)  # [B, S, c], [B, S, r]
        latent = self.kv_latent_norm(latent)
        k_rope = self.shared_rope_key(apply_rope(k_rope.unsqueeze(1), cos, sin))  # [B, 1, S, r]
        if documents is not None and documents.sharded:  # every context-parallel rank's latents and rotary keys
            parts = (latent, k_rope.squeeze(1).to(latent.dtype), *(() if extra is None else (extra.to(latent.dtype),)))
            gathered = self.gather_sequence(torch.cat(parts, dim=-1)).split([part.shape[-1] for part in parts], -1)
            latent, k_rope = gathered[0], gathered[1].unsqueeze(1).to(k_rope.dtype)
            extra = None if extra is None else gathered[2].to(extra.dtype)
        return latent, k_rope, extra

    def keys_values(self, latent: Tensor, k_rope: Tensor, heads: int) -> tuple[Tensor, Tensor]:
        """The latent [B, K, c] up-projected to every head's keys [B, nh, K, n + r] (the shared rotary key
        [B, 1, K, r] in each head's last r channels) and values [B, nh, K, v]."""
        kv = self.wkv_b(latent).view(latent.shape[0], latent.shape[1], -1, self.nope_dim + self.v_dim)
        k_nope, v = kv.transpose(1, 2).split([self.nope_dim, self.v_dim], dim=-1)  # [B, nh, K, n], [B, nh, K, v]
        return torch.cat((k_nope, k_rope.expand(-1, heads, -1, -1)), dim=-1), v  # one rotary key, every head

    def output(self, out: Tensor) -> Tensor:
        """The heads' outputs [B, nh, S, v] -> [B, S, D]."""
        return self.wo(out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1))

    def heads_to_clip(self) -> list[tuple[Tensor, Tensor]]:
        """QK-clip's tensors, the head-specific parts alone (as Kimi K2 does for its MLA): the query's nope rows by
        gamma^0.5 and rope rows by gamma, ``wkv_b``'s key rows by gamma^0.5 and value rows not at all; the shared
        rotary key is left alone."""
        nope, rope, v = self.nope_dim, self.rope_dim, self.v_dim
        query = self.wq if self.wq is not None else self.wq_b
        return [(query.weight, torch.tensor([0.5] * nope + [1.0] * rope)),
                (self.wkv_b.weight, torch.tensor([0.5] * nope + [0.0] * v))]

    # What this kind costs, stated beside its forward and summed over the layer pattern by ``analysis/`` and
    # ``moe/accounting.py`` (``tests/moe/test_accounting.py`` and ``tests/analysis/`` hold them to the module).

    @staticmethod
    def parameter_tensors(model: ModelConfig, i: int | None) -> list[ParamTensor]:
        """Layer i's weights and how tp cuts them (``parallel/tensor.py``): the per-head projections column- (wq
        or wq_b, wkv_b) and row-parallel (wo); the latent projections and their norms whole on every rank."""
        d, heads = model.d_model, model.n_heads
        qk, rank, latent = model.qk_nope_head_dim + model.qk_rope_head_dim, model.q_lora_rank, model.kv_lora_rank
        query = [ParamTensor("attention", i, (heads * qk, d), 0)] if rank is None else [
            ParamTensor("attention", i, (rank, d)), ParamTensor("norm", i, (rank,)),
            ParamTensor("attention", i, (heads * qk, rank), 0)]
        return [*query, ParamTensor("attention", i, (latent + model.qk_rope_head_dim, d)),
                ParamTensor("norm", i, (latent,)),
                ParamTensor("attention", i, (heads * (model.qk_nope_head_dim + model.v_head_dim), latent), 0),
                ParamTensor("attention", i, (d, heads * model.v_head_dim), 1)]

    @staticmethod
    def score_width(model: ModelConfig) -> int:
        """The channels of one head's q·k plus its value: n + r and v."""
        return model.qk_nope_head_dim + model.qk_rope_head_dim + model.v_head_dim

    @staticmethod
    def projection_gemms(model: ModelConfig, tp: int, tokens: int) -> list[tuple[float, int, int, int]]:
        """The projections' matmuls on one rank, (count, M, K, N): the per-head ones split by heads, the latent
        projections (``wq_a``, ``wkv_a``) whole."""
        d, heads = model.d_model, model.n_heads // tp
        qk, rank, latent = model.qk_nope_head_dim + model.qk_rope_head_dim, model.q_lora_rank, model.kv_lora_rank
        query = [(1, tokens, d, heads * qk)] if rank is None else [(1, tokens, d, rank), (1, tokens, rank, heads * qk)]
        return [*query, (1, tokens, d, latent + model.qk_rope_head_dim),
                (1, tokens, latent, heads * (model.qk_nope_head_dim + model.v_head_dim)),
                (1, tokens, heads * model.v_head_dim, d)]

    @staticmethod
    def sequence_gather_width(model: ModelConfig, tp: int) -> int:
        """Elements per position that context parallelism gathers in one layer: the normalised latent and the
        rotated shared key (whole on every tp rank)."""
        return model.kv_lora_rank + model.qk_rope_head_dim

    @staticmethod
    def input_gradient_sums(model: ModelConfig) -> tuple[tuple[str, int], ...] | None:
        """Under tp the block input's gradient is whole on every rank (``parallel/tensor.py``); the inputs each
        rank's heads use in part have theirs summed instead, (name, width) each: the query's (the latent [T, c'],
        or the block input [T, D] without a bottleneck), the key/value latent's [T, c] and the shared rotary
        key's [T, r]."""
        return (("query latent", model.q_lora_rank or model.d_model), ("key/value latent", model.kv_lora_rank),
                ("shared rotary key", model.qk_rope_head_dim))

    @staticmethod
    def saved_bytes(model: ModelConfig, layer: LayerSpec, tp: int, mb: MicroBatch) -> int:
        """On this rank's nh/tp heads: the block's input (read by ``wq`` or ``wq_a``, and ``wkv_a``); with a query
        bottleneck its norm's input and rstd and ``wq_b``'s input; in fp32 ``wkv_a``'s whole [T, c + r] output,
        which the latent norm saves (its input is a view of it), with rstd (under bf16 autocast the norm's fp32
        upcast and output instead); ``wkv_b``'s input; what the kernel saves (``kernel_saved_bytes``), heads
        w = max(n + r, v) wide (the narrower side zero-padded), where v is a view of ``wkv_b``'s [T, nh·(n + v)]
        output, whose storage it keeps, unless padded or put in position order by chunks (a new tensor);
        ``wo``'s input (a copy, but of one unpadded head).

        Under context parallelism the keys and values are the whole sequence's, K = cp·T positions: ``wkv_b``'s
        input is then a copy of the gathered [B, S, c + r] tensor's latent columns (K·c; the gathered tensor itself
        is not saved), and k and v are K positions long.
        """
        return latent_saved_bytes(model, tp, mb, training_kernel(model, mb))


def latent_saved_bytes(model: ModelConfig, tp: int, mb: MicroBatch, kernel: str) -> int:
    """``LatentAttention.saved_bytes`` on the kernel ``kernel``: the kinds built on latent attention
    (``sparse_latent.py``) choose theirs."""
    heads, nope, rope, v = model.n_heads // tp, model.qk_nope_head_dim, model.qk_rope_head_dim, model.v_head_dim
    t, latent, a = mb.tokens, model.kv_lora_rank, mb.compute
    width = max(nope + rope, v)
    total = linear_input_bytes(mb, model.d_model, 2)
    if model.q_lora_rank is not None:
        rank = model.q_lora_rank
        total += norm_bytes(t, rank, fused=not mb.bf16) + t * rank * a
    if mb.bf16:  # the norm's bf16 input upcast: saved as a new fp32 tensor, with the normalised one (decomposed)
        total += norm_bytes(t, latent, fused=False)
    else:  # fused: its input, a view of wkv_a's fp32 [T, c + r] output, keeps that storage; rstd
        total += t * (latent + rope) * FP32 + t * FP32
    if kernel != GATHERED:  # keys and values up-projected; the gathered kernel reads the latents (sparse_latent.py)
        total += t * mb.cp * latent * a  # wkv_b's input
        values = width if v < width or kernel == CHUNKS else nope + v
        total += kernel_saved_bytes(kernel, mb, heads, heads, width, value_width=values)
    return total + (0 if heads == 1 and v == width else t * heads * v * a)  # wo's input
