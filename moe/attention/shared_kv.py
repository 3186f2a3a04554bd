"""Shared-key/value attention within a sliding window: DeepSeek-V4's attention in its sliding layers, and the base
of its compressed layers (``moe/attention/compressed.py``).

DeepSeek-V4 (its technical report, sec. 2.3; ``transformers``' ``deepseek_v4``) attends with multi-query attention
whose one key/value head is one tensor read as both the key and the value: ``kv_proj`` then RMSNorm (``kv_norm``)
per position. Queries come through a low-rank bottleneck (``q_a_proj``, RMSNorm ``q_a_norm``, ``q_b_proj``), then
each head is RMS-normalised without a weight. RoPE turns the trailing r channels of each query head and of the
key (interleaved pairs, ``trailing_rope.py``); since the values are those rotated keys, the output's trailing
channels are turned back at the query's position, which leaves each key's contribution a function of the distance
alone. Each head has a learned sink logit in its softmax's denominator (as GPT-OSS). The output projection is
grouped: the heads form ``o_groups`` groups, each projected on its own to ``o_lora_rank`` (``o_a_proj``, one
block-diagonal matrix), and one matrix mixes the groups to d_model (``o_b_proj``). The parameters keep
``transformers``' names.

A query sees itself and the ``sliding_window`` - 1 positions before it; the kernel core runs it
(``moe/attention/kernel.py``: blocked by windows when the sequence is long enough). Generation keeps the last
window - 1 positions' key/value head (``LayerCache.slide``), all a new query reaches back to. Under tensor
parallelism each rank holds whole output groups of heads and the rest whole (``parallel/tensor.py``'s
``_shared_kv_plan``); ``shared_keys`` (an identity here) is where the shared key/value head's gradient, which each
rank's heads give only part of, is summed over the ranks. Under context parallelism every rank gathers the block
input of every position once per layer and makes all the keys (and the compressed entries) from it: D numbers per
position where the keys alone would be hd (and the compressors' projections), for one exchange and the key-making
repeated on every rank. Packed documents and QK-clip are refused by the config (``config/run.py``) until built.

Shapes: B sequences, S positions, D = d_model, nh heads, hd = head_dim, c' = q_lora_rank, r = rotary_dim,
g = o_groups, o = o_lora_rank.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from config.model import LayerSpec, ModelConfig
from moe.attention.base import AttentionKind
from moe.attention.kernel import attend, attend_under_mask, kernel_saved_bytes, training_kernel
from moe.attention.trailing_rope import rotate_trailing
from moe.documents import Documents
from moe.kv_cache import LayerCache
from moe.norm import RMSNorm
from moe.param_tensors import ParamTensor
from moe.saved_activations import FP32, INDEX, MicroBatch, linear_input_bytes, norm_bytes


class GroupedLinear(nn.Module):
    """A block-diagonal projection: x [.., g, i] -> [.., g, o/g], group j by its own [o/g, i] block of ``weight``
    [o, i] (rows in group order; ``transformers``' ``DeepseekV4GroupedLinear`` stores it so). Under tensor
    parallelism ``weight`` is split by rows (``Shard(0)``), whole groups per rank, and x holds this rank's groups."""

    def __init__(self, in_per_group: int, out_features: int, groups: int):
        super().__init__()
        self.out_per_group = out_features // groups
        self.weight = nn.Parameter(torch.empty(out_features, in_per_group))

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        blocks = weight.view(-1, self.out_per_group, weight.shape[-1])  # [g, o/g, i]
        return torch.einsum("...gi,goi->...go", x, blocks)


def at_positions(cos: Tensor, sin: Tensor, seq: int, positions: Tensor | None,
                 start: int = 0) -> tuple[Tensor, Tensor]:
    """The tables [L, r/2] at positions start .. start + seq - 1 (views), or at ``positions`` [seq] (context
    parallelism)."""
    if positions is None:
        return cos[start:start + seq], sin[start:start + seq]
    return cos[positions], sin[positions]


def window_keys(query_pos: Tensor, key_pos: Tensor, window: int) -> Tensor:
    """[Sq, S] bool: the query at position t sees the keys at positions t - window + 1 .. t."""
    distance = query_pos[:, None] - key_pos[None, :]
    return (distance >= 0) & (distance < window)


class SharedKVAttention(AttentionKind):
    """DeepSeek-V4's attention in a sliding layer (module docstring); ``attend`` and ``attend_positions`` are where
    the compressed layers add their entries."""

    reads_document_tables = False  # it indexes its own tables at the queries' and keys' positions

    def __init__(self, config: ModelConfig, layer: LayerSpec):
        super().__init__()
        section = config.compressed_attention
        self.n_heads, self.head_dim, self.window = config.n_heads, config.head_dim, layer.window
        self.o_groups = section.o_groups
        self.group_width = self.n_heads * self.head_dim // self.o_groups
        eps = config.norm_eps
        self.q_a_proj = nn.Linear(config.d_model, config.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(config.q_lora_rank, eps=eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.q_b_norm = RMSNorm(self.head_dim, eps=eps, elementwise_affine=False)
        self.kv_proj = nn.Linear(config.d_model, self.head_dim, bias=False)
        self.kv_norm = RMSNorm(self.head_dim, eps=eps)
        self.o_a_proj = GroupedLinear(self.group_width, self.o_groups * section.o_lora_rank, self.o_groups)
        self.o_b_proj = nn.Linear(self.o_groups * section.o_lora_rank, config.d_model, bias=False)
        self.sinks = nn.Parameter(torch.empty(self.n_heads))
        self.shared_keys = nn.Identity()  # where tensor parallelism sums the shared keys' gradient over the ranks

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: LayerCache | None = None,
                documents: Documents | None = None) -> Tensor:
        """x: [B, S, D]; cos, sin: the model's rotary tables [>= S, r/2] (``AttentionKind``'s interface).

        Under context parallelism (``documents.sharded``) x is this rank's positions, and the keys are made from
        every rank's, gathered once (``gather_sequence``: the block input, which the compressors need too).
        In generation x is the new positions, after the ``cache``'s (``moe/kv_cache.py``): their queries see the
        window's keys kept there and their own (``attend_cached``)."""
        if documents is not None and not documents.sharded:
            raise ValueError("DeepSeek-V4's attention (model.compressed_attention) takes whole sequences: packed "
                             "documents are not built for it")
        if cache is None:
            return self.layer(x, x if documents is None else self.gather_sequence(x), cos, sin, documents)
        return self.layer(x, x, cos, sin, cache=cache)

    def layer(self, x: Tensor, keys_x: Tensor, cos: Tensor, sin: Tensor, documents: Documents | None = None,
              cache: LayerCache | None = None) -> Tensor:
        """The layer on x [B, Sq, D] (its queries' block input) against keys made of ``keys_x`` [B, S, D] (x, or
        every context-parallel rank's positions in ``documents.key_pos``' order, or with a ``cache`` the new
        positions after its ``length``) -> [B, Sq, D]."""
        batch, seq, _ = x.shape
        start = 0 if cache is None else cache.length
        cos, sin = self.rotary_tables(cos, sin)
        q_cos, q_sin = at_positions(cos, sin, seq, None if documents is None else documents.query_pos, start)
        k_cos, k_sin = at_positions(cos, sin, keys_x.shape[1], None if documents is None else documents.key_pos,
                                    start)
        query_latent = self.q_a_norm(self.q_a_proj(x))  # [B, Sq, c']
        q = self.q_b_norm(self.q_b_proj(query_latent).view(batch, seq, -1, self.head_dim)).transpose(1, 2)
        q = rotate_trailing(q, q_cos, q_sin)  # [B, nh, Sq, hd]
        kv = rotate_trailing(self.kv_norm(self.kv_proj(keys_x)).unsqueeze(1), k_cos, k_sin)  # [B, 1, S, hd]
        if cache is None:
            out = self.attend(x, keys_x, query_latent, q, kv, documents)
        else:
            out = self.attend_cached(x, query_latent, q, kv, start, cache, (q_cos, q_sin))
        out = rotate_trailing(out, q_cos, q_sin, inverse=True).transpose(1, 2)  # [B, Sq, nh, hd]
        grouped = self.o_a_proj(out.reshape(batch, seq, -1, self.group_width))  # [B, Sq, g, o]
        return self.o_b_proj(grouped.flatten(2))

    def rotary_tables(self, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """The tables this layer turns by: the model's (the sliding layers' RoPE)."""
        return cos, sin

    def attend(self, x: Tensor, keys_x: Tensor, query_latent: Tensor, q: Tensor, kv: Tensor,
               documents: Documents | None) -> Tensor:
        """The kernel over the window: q [B, nh, Sq, hd] against the one head kv [B, 1, S, hd] -> [B, nh, Sq, hd]."""
        kv = self.shared_keys(kv)
        return attend(q, kv, kv, self.head_dim ** -0.5, window=self.window, sinks=self.sinks, documents=documents)

    def attend_cached(self, x: Tensor, query_latent: Tensor, q: Tensor, kv: Tensor, start: int,
                      cache: LayerCache, query_tables: tuple[Tensor, Tensor]) -> Tensor:
        """Generation: q [B, nh, Sq, hd] at positions start.. (this layer's RoPE ``query_tables`` there) against the
        window's keys the cache keeps and the new ones kv [B, 1, Sq, hd] (``LayerCache.slide``) -> [B, nh, Sq, hd]."""
        keys = cache.slide(kv, self.window)
        end = start + q.shape[2]
        query_pos = torch.arange(start, end, device=q.device)
        key_pos = torch.arange(end - keys.shape[2], end, device=q.device)
        return self.attend_positions(x, x, query_latent, q, keys, query_pos, key_pos, cache, query_tables)

    def attend_positions(self, x: Tensor, keys_x: Tensor, query_latent: Tensor, q: Tensor, kv: Tensor,
                         query_pos: Tensor, key_pos: Tensor, cache: LayerCache | None,
                         query_tables: tuple[Tensor, Tensor]) -> Tensor:
        """q [B, nh, Sq, hd] at ``query_pos`` against the keys kv [B, 1, K, hd] at ``key_pos`` that lie within its
        window -> [B, nh, Sq, hd]: generation's, and the compressed layers', which add their entries (and turn
        their indexer's queries by ``query_tables``, this layer's RoPE at ``query_pos``)."""
        kv = self.shared_keys(kv)
        allowed = window_keys(query_pos, key_pos, self.window)
        return attend_under_mask(q, kv, kv, self.head_dim ** -0.5, allowed, self.sinks)

    def heads_to_clip(self) -> list[tuple[Tensor, Tensor]]:
        """None: each query head and the key are RMS-normalised after their projections, which undoes any scale
        QK-clip would put on them (``config/run.py`` refuses QK-clip for this kind)."""
        raise NotImplementedError("DeepSeek-V4's attention normalises its query heads and key: QK-clip cannot "
                                  "scale them")

    # What this kind costs, stated beside its forward and summed over the layer pattern by ``analysis/`` and
    # ``moe/accounting.py``.

    @staticmethod
    def parameter_tensors(model: ModelConfig, i: int | None) -> list[ParamTensor]:
        """Layer i's weights and how tp cuts them (``parallel/tensor.py``): ``q_a_proj`` [c', D] and ``q_a_norm``
        [c'] whole, ``q_b_proj`` [nh·hd, c'] column-parallel, ``kv_proj`` [hd, D] and ``kv_norm`` [hd] whole,
        ``o_a_proj`` [g·o, nh·hd/g] by rows with its groups, ``o_b_proj`` [D, g·o] row-parallel, ``sinks`` [nh]
        with the heads."""
        d, heads, hd, rank = model.d_model, model.n_heads, model.head_dim, model.q_lora_rank
        groups, grouped = model.compressed_attention.o_groups, model.compressed_attention.o_lora_rank
        return [ParamTensor("attention", i, (rank, d)), ParamTensor("norm", i, (rank,)),
                ParamTensor("attention", i, (heads * hd, rank), 0), ParamTensor("attention", i, (hd, d)),
                ParamTensor("norm", i, (hd,)),
                ParamTensor("attention", i, (groups * grouped, heads * hd // groups), 0),
                ParamTensor("attention", i, (d, groups * grouped), 1), ParamTensor("attention", i, (heads,), 0)]

    @staticmethod
    def score_width(model: ModelConfig) -> int:
        """The channels of one head's q·k plus its value: 2·hd (the value is the key)."""
        return 2 * model.head_dim

    @classmethod
    def flops_per_token(cls, model: ModelConfig) -> float:
        """Training FLOPs of one token's scores and values over the keys it sees: the window's."""
        return 6.0 * model.n_heads * cls.score_width(model) * min(model.sliding_window, model.seq_len)

    @staticmethod
    def projection_gemms(model: ModelConfig, tp: int, tokens: int) -> list[tuple[float, int, int, int]]:
        """The projections' matmuls on one rank, (count, M, K, N): ``q_a_proj`` and ``kv_proj`` whole, ``q_b_proj``
        on this rank's heads, ``o_a_proj``'s blocks of this rank's groups, ``o_b_proj`` on their outputs."""
        d, heads, hd, rank = model.d_model, model.n_heads, model.head_dim, model.q_lora_rank
        groups, grouped = model.compressed_attention.o_groups, model.compressed_attention.o_lora_rank
        return [(1, tokens, d, rank), (1, tokens, rank, heads // tp * hd), (1, tokens, d, hd),
                (groups // tp, tokens, heads * hd // groups, grouped), (1, tokens, groups // tp * grouped, d)]

    @staticmethod
    def sequence_gather_width(model: ModelConfig, tp: int) -> int:
        """Elements per position that context parallelism gathers in one layer: the block input, whole on every tp
        rank (the key/value head and the compressors are made from it)."""
        return model.d_model

    @staticmethod
    def input_gradient_sums(model: ModelConfig) -> tuple[tuple[str, float], ...] | None:
        """Under tp the block input's gradient is whole on every rank (``parallel/tensor.py``); the inputs each
        rank's heads use in part have theirs summed instead, (name, width per position) each: the query latent's
        [T, c'] and the shared key/value's [T, hd]."""
        return (("query latent", model.q_lora_rank), ("shared key/value", model.head_dim))

    @staticmethod
    def saved_bytes(model: ModelConfig, layer: LayerSpec, tp: int, mb: MicroBatch) -> int:
        """``shared_kv_saved_bytes`` on the window's kernel (``training_kernel``: masked, or blocked by windows)."""
        kernel = training_kernel(model, mb, layer.window, sinks=True)
        kernel_bytes = kernel_saved_bytes(kernel, mb, model.n_heads // tp, 1, model.head_dim, window=layer.window,
                                          sink=True)
        return shared_kv_saved_bytes(model, tp, mb, kernel_bytes, compressed=False)


def shared_kv_saved_bytes(model: ModelConfig, tp: int, mb: MicroBatch, kernel_bytes: int, compressed: bool) -> int:
    """What a V4 layer saves on a tp rank besides its compressors, with what its kernel saves (``kernel_bytes``),
    on this rank's nh/tp heads and g/tp groups: the block input, read by two projections (four with the
    ``compressed`` layers' compressor) as ``linear_input_bytes`` says; ``q_a_norm``'s (its input and rstd, or under
    bf16 its fp32 upcast and output too) and ``q_b_proj``'s input; the per-head norm's input (``q_b_proj``'s output;
    its fp32 upcast under bf16) and its rstd per head, in fp32; ``kv_norm``'s on every key, as ``q_a_norm``'s;
    ``o_a_proj``'s input as its batched matmul keeps it ([g, T, nh·hd/g], a copy) and ``o_b_proj``'s [T, g·o]; the
    rotary tables the rotations save: the compressed layers' own [seq_len, r/2] cos and sin, fp32 (the sliding
    layers' are the model's buffers).

    Under context parallelism the keys are the K = cp·T gathered positions: ``kv_proj`` reads the gathered block
    input [K, D], the compressors a copy of it in position order (with the order, K int64), each
    ``linear_input_bytes``' way; the rotations save the tables at the queries' and the keys' positions (copies,
    cos and sin, fp32) instead."""
    t, heads, hd, rank, a = mb.tokens, model.n_heads // tp, model.head_dim, model.q_lora_rank, mb.compute
    grouped = model.compressed_attention.o_groups // tp * model.compressed_attention.o_lora_rank
    keys, d, rotary = t * mb.cp, model.d_model, model.rotary_dim
    if mb.cp == 1:
        total = linear_input_bytes(mb, d, 4 if compressed else 2)
        total += model.seq_len * rotary * FP32 if compressed else 0
    else:
        total = linear_input_bytes(mb, d, 1) + linear_input_bytes(mb, d, 1, rows=keys)
        total += (linear_input_bytes(mb, d, 2, rows=keys) + mb.positions * mb.cp * INDEX) if compressed else 0
        total += (mb.positions + mb.positions * mb.cp) * rotary * FP32
    total += norm_bytes(t, rank, fused=not mb.bf16) + t * rank * a
    total += t * heads * (hd + 1) * FP32
    total += norm_bytes(keys, hd, fused=not mb.bf16)
    return total + kernel_bytes + t * heads * hd * a + t * grouped * a

