"""Grouped-query attention with rotary positions (Mixtral, Qwen3-MoE, GLM-4.5, GPT-OSS, the dense families), and
what it costs.

Shapes: B sequences, S positions, D = d_model, nh / nkv query / key-value heads, hd = head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from config.model import LayerSpec, ModelConfig
from moe.attention.base import AttentionKind
from moe.attention.kernel import BLOCKED_WINDOW, attend, kernel_saved_bytes, training_kernel
from moe.documents import Documents
from moe.kv_cache import LayerCache
from moe.norm import RMSNorm
from moe.param_tensors import ParamTensor
from moe.rope import apply_partial_rope
from moe.saved_activations import MicroBatch, head_norm_bytes, linear_input_bytes


class GroupedQueryAttention(AttentionKind):
    """Causal multi-head (or grouped-query) attention with rotary positions, on the kernel core.

    With ``qkv_bias`` the query, key and value projections add biases (GLM-4.5); with ``rotary_dim`` RoPE turns
    only the first channels of each head and the others carry content alone (GLM's partial rotary).
    With ``qk_norm`` each query and key head is RMS-normalised over its hd channels (one weight [hd] shared
    by the heads) before RoPE, as Qwen3 does: it keeps the attention logits from growing without bound
    ("QK normalization", Dehghani et al. 2023, "Scaling Vision Transformers to 22 Billion Parameters",
    sec. 3). Per head, so it runs unchanged on the heads a tensor-parallel rank holds. With ``qk_norm_type``
    "per_layer" (MiniMax-M2) one norm spans all heads' queries (weight [nh·hd]) and one all keys ([nkv·hd]), before
    the heads are split: under tp it would span ranks (refused there, ``parallel/layout.py``).

    GPT-OSS's options: ``attn_output_bias`` (a bias on ``wo`` too), ``attention_sinks`` (``sinks`` [nh], one
    logit per head in every softmax's denominator with no value: ``softmax_j(l_j)`` becomes
    ``exp(l_j) / (exp(s_h) + sum_i exp(l_i))``) and the layer's ``window`` (a query sees itself and the window - 1
    positions before it); the kernel core (``moe/attention/kernel.py``) serves both.
    With ``attn_output_gate`` each output channel is scaled by sigmoid of ``wg`` x before ``wo`` (Qwen3-Next's
    gated attention; Qiu et al. 2025, "Gated Attention for Large Language Models": a per-head, input-dependent
    gate that keeps a head from having to attend somewhere when it has nothing to add).

    With ``documents`` RoPE takes each position's place in its document and the kernel the documents' mask: SDPA
    computes every score of the mask, so it costs what a full (non-causal) attention costs (``docs/data.md`` has
    the measurements). Under context parallelism the keys and values this rank computed are joined by every
    other rank's in one tensor, so that a layer makes one exchange; gathering the key/value heads, not the query
    heads, is what grouped-query attention saves here too.
    """

    def __init__(self, config: ModelConfig, layer: LayerSpec):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.kv_heads, config.head_size
        self.rotary_dim = config.rope_dim
        self.window = layer.window
        self.wq = nn.Linear(config.d_model, self.n_heads * self.head_dim, bias=config.qkv_bias)
        self.wk = nn.Linear(config.d_model, self.n_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.wv = nn.Linear(config.d_model, self.n_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.wo = nn.Linear(self.n_heads * self.head_dim, config.d_model, bias=config.attn_output_bias)
        gated = config.attn_output_gate
        self.wg = nn.Linear(config.d_model, self.n_heads * self.head_dim, bias=False) if gated else None
        self.sinks = nn.Parameter(torch.empty(self.n_heads)) if config.attention_sinks else None
        self.norm_per_layer = config.qk_norm_type == "per_layer"  # the norms over all heads' channels at once
        q_width, k_width = (self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim) if self.norm_per_layer \
            else (self.head_dim, self.head_dim)
        self.q_norm = RMSNorm(q_width, eps=config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(k_width, eps=config.norm_eps) if config.qk_norm else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: LayerCache | None = None,
                documents: Documents | None = None) -> Tensor:
        """x: [B, S, D]; cos, sin: the rotary tables of at least S positions (the interface of ``AttentionKind``)."""
        batch, seq, _ = x.shape
        start, cos, sin = self.positions(x, cos, sin, cache, documents)
        q, k = self.wq(x), self.wk(x)
        if self.q_norm is not None and self.norm_per_layer:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(batch, seq, -1, self.head_dim)  # [B, S, nh, hd]
        k = k.view(batch, seq, -1, self.head_dim)  # [B, S, nkv, hd]
        if self.q_norm is not None and not self.norm_per_layer:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, heads, S, hd]
        v = self.wv(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        q = apply_partial_rope(q, cos, sin, self.rotary_dim)  # partial rotary (GLM): the first rotary_dim channels
        k = apply_partial_rope(k, cos, sin, self.rotary_dim)
        k, v, cache_mask = (k, v, None) if cache is None else cache.extend(k, v)
        if documents is not None and documents.sharded:  # every context-parallel rank's k and v, in one exchange
            k, v = self.gather_sequence(torch.cat((k, v), dim=-1)).chunk(2, dim=-1)
        scale = self.head_dim ** -0.5
        self.track(q, k, scale, cache, documents, self.window)
        out = attend(q, k, v, scale, start, self.window, self.sinks, cache_mask, documents)
        out = out.transpose(1, 2).reshape(batch, seq, -1)
        if self.wg is not None:
            out = out * torch.sigmoid(self.wg(x))
        return self.wo(out)

    def heads_to_clip(self) -> list[tuple[Tensor, Tensor]]:
        """QK-clip's tensors: with as many key heads as query heads, wq's and wk's rows (and biases) by gamma^0.5
        each; under grouped-query attention a key head serves several query heads, so wq's alone by gamma."""
        projections = [(self.wq, 0.5), (self.wk, 0.5)] if self.n_kv_heads == self.n_heads else [(self.wq, 1.0)]
        return [(tensor, torch.full((self.head_dim,), exponent)) for linear, exponent in projections
                for tensor in (linear.weight, linear.bias) if tensor is not None]

    # What this kind costs, stated beside its forward and summed over the layer pattern by ``analysis/`` and
    # ``moe/accounting.py`` (``tests/moe/test_accounting.py`` and ``tests/analysis/`` hold them to the module).

    @staticmethod
    def parameter_tensors(model: ModelConfig, i: int | None) -> list[ParamTensor]:
        """Layer i's weights and how tp cuts them (``parallel/tensor.py``): wq, wk, wv (and their biases)
        column-parallel, wo row-parallel; wo's bias added after the row-parallel sum (whole on every rank); one sink
        per query head, split with the heads; the per-head q/k norms whole on every rank."""
        d, heads, kv_heads, hd = model.d_model, model.n_heads, model.kv_heads, model.head_size
        out = [ParamTensor("attention", i, (heads * hd, d), 0), ParamTensor("attention", i, (kv_heads * hd, d), 0),
               ParamTensor("attention", i, (kv_heads * hd, d), 0), ParamTensor("attention", i, (d, heads * hd), 1)]
        if model.qkv_bias:
            out += [ParamTensor("attention", i, (heads * hd,), 0), ParamTensor("attention", i, (kv_heads * hd,), 0),
                    ParamTensor("attention", i, (kv_heads * hd,), 0)]
        if model.attn_output_bias:
            out.append(ParamTensor("attention", i, (d,)))
        if model.attention_sinks:
            out.append(ParamTensor("attention", i, (heads,), 0))
        if model.qk_norm and model.qk_norm_type == "per_layer":
            out += [ParamTensor("norm", i, (heads * hd,)), ParamTensor("norm", i, (kv_heads * hd,))]
        elif model.qk_norm:
            out += [ParamTensor("norm", i, (hd,)), ParamTensor("norm", i, (hd,))]
        if model.attn_output_gate:
            out.append(ParamTensor("attention", i, (heads * hd, d), 0))
        return out

    @staticmethod
    def score_width(model: ModelConfig) -> int:
        """The channels of one head's q·k plus its value: 2·hd (PaLM's attention FLOPs count them)."""
        return 2 * model.head_size

    @staticmethod
    def projection_gemms(model: ModelConfig, tp: int, tokens: int) -> list[tuple[float, int, int, int]]:
        """The projections' matmuls on one rank, (count, M, K, N): wq (and the gate's wg), wk, wv split by heads,
        wo by its input."""
        d, heads, hd = model.d_model, model.n_heads // tp, model.head_size
        return [(1 + model.attn_output_gate, tokens, d, heads * hd), (2, tokens, d, model.kv_heads * hd // tp),
                (1, tokens, heads * hd, d)]

    @staticmethod
    def sequence_gather_width(model: ModelConfig, tp: int) -> int:
        """Elements per position that context parallelism gathers in one layer: k and v of this tp rank's
        key/value heads, on the channel dim."""
        return model.kv_heads // tp * 2 * model.head_size

    @staticmethod
    def input_gradient_sums(model: ModelConfig) -> tuple[tuple[str, int], ...] | None:
        """Under tp the block input's gradient is reduced as any column-parallel input's (None: nothing of its
        own)."""
        return None

    @staticmethod
    def saved_bytes(model: ModelConfig, layer: LayerSpec, tp: int, mb: MicroBatch) -> int:
        """wq/wk/wv's input; what the kernel saves (``kernel_saved_bytes``: q and k after RoPE, v, the output and
        the log-sum-exp, on this rank's nh/tp heads, and the kernel's mask); wo's input, the output made contiguous,
        a copy unless one head per rank makes it a view; with ``qk_norm`` the per-head norms of q and k (each of
        the T·heads rows of hd, as an RMSNorm saves them; per layer, T rows of heads·hd); with
        ``attn_output_gate`` wg's input too, and the gate's sigmoid and the gated output, which wo reads. Under
        context parallelism k and v are views of the gathered [b, kv_heads, S, 2·hd] tensor, or, by chunks, copies
        in position order of the same bytes."""
        heads, kv_heads, hd = model.n_heads // tp, model.kv_heads // tp, model.head_size
        sink = model.attention_sinks
        kernel = training_kernel(model, mb, layer.window, sink)
        total = linear_input_bytes(mb, model.d_model, 3 + model.attn_output_gate)
        total += kernel_saved_bytes(kernel, mb, heads, kv_heads, hd, window=layer.window, sink=sink)
        contiguous_view = heads == 1 and not (sink or kernel == BLOCKED_WINDOW)
        total += 0 if contiguous_view else mb.tokens * heads * hd * mb.compute
        if model.qk_norm and model.qk_norm_type == "per_layer":  # one row per token, all its heads' channels
            total += head_norm_bytes(mb, mb.tokens, heads * hd, tp) + head_norm_bytes(mb, mb.tokens, kv_heads * hd, tp)
        elif model.qk_norm:
            total += head_norm_bytes(mb, mb.tokens * heads, hd, tp) + head_norm_bytes(mb, mb.tokens * kv_heads, hd, tp)
        if model.attn_output_gate:  # the gate's sigmoid and the gated output (wo's input)
            total += 2 * mb.tokens * heads * hd * mb.compute
        return total
