"""DeepSeek-V4's compressed layers: shared-key/value attention over the sliding window and compressed entries.

A compressed layer (DeepSeek-V4 report, sec. 2.3; ``transformers``' ``DeepseekV4Attention`` with a compressor) is
the sliding layer of ``shared_kv.py`` whose queries also see entries that each stand for ``rate`` positions
(``compressor.py``): its keys are the window's positions then the entries, one softmax over both with the sinks.
Its RoPE, the entries' and its queries', is the compressed one (``model.compressed_attention.rope_theta`` and YaRN).

- Heavily compressed attention (HCA; ``heavily_compressed_attention`` layers): one entry per ``hca_rate``
  positions (V4: 128), and a query sees every entry made of positions at or before it.
- Compressed sparse attention (CSA; ``compressed_sparse_attention`` layers): one entry per ``csa_rate`` positions
  (V4: 4) pooled over overlapping windows of 2 · rate, of which each query sees the ``index_topk`` its lightning
  indexer (``CompressedIndexer``) scores highest among those it may see (all of them when they are fewer).

The kernel computes every score of the [S, S + n] keys and masks what a query may not see (``attend_under_mask``):
dense cost, where V4's own kernels read the window and the selected entries alone. As in ``transformers``, the
indexer takes no gradient (the selection passes none and nothing else reads it): it is not trained here.

Shapes: B sequences, S positions, D = d_model, nh heads, hd = head_dim, n entries, c' = q_lora_rank, hi/di the
indexer's heads and width, r rotary channels.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from config.model import LayerSpec, ModelConfig
from moe.attention.compressor import Compressor, compressor_saved_bytes, compressor_tensors, visible_entries
from moe.attention.indexer import IndexScoring
from moe.attention.kernel import attend_under_mask, kernel_saved_bytes, training_kernel
from moe.attention.shared_kv import SharedKVAttention, shared_kv_saved_bytes
from moe.attention.trailing_rope import compressed_rope_tables, rotate_trailing
from moe.param_tensors import ParamTensor
from moe.saved_activations import FP32, MicroBatch


def window_keys(seq: int, window: int, device: torch.device) -> Tensor:
    """[S, S] bool: query t sees the positions t - window + 1 .. t."""
    distance = torch.arange(seq, device=device)[:, None] - torch.arange(seq, device=device)[None, :]
    return (distance >= 0) & (distance < window)


class CompressedAttention(SharedKVAttention):
    """The compressed layers' common part: the compressed RoPE, the entries beside the window and their mask.
    A subclass makes ``compressor`` (entries hd wide, every ``rate`` positions) and says which visible entries
    each query attends to (``entry_mask``)."""

    compressor: Compressor

    def __init__(self, config: ModelConfig, layer: LayerSpec):
        super().__init__(config, layer)
        self.config = config
        self._tables: tuple[Tensor, Tensor] | None = None  # made on first use, on the device used

    def rotary_tables(self, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """The tables this layer turns by: the compressed RoPE's (``compressed_tables``), not the model's."""
        return self.compressed_tables(cos.device)

    def compressed_tables(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """The compressed RoPE's cos and sin [seq_len, r/2], made once per device."""
        if self._tables is None or self._tables[0].device != device:
            self._tables = tuple(table.to(device) for table in compressed_rope_tables(self.config))
        return self._tables

    def attend(self, x: Tensor, query_latent: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        """q [B, nh, S, hd] against the window's kv [B, 1, S, hd] and the entries [B, 1, n, hd] -> [B, nh, S, hd]."""
        seq, device = x.shape[1], x.device
        cos, sin = self.compressed_tables(device)
        entries = self.compressor(x, cos, sin)  # [B, n, hd]
        visible = visible_entries(seq, entries.shape[1], self.compressor.rate, device)  # [S, n]
        seen = self.entry_mask(x, query_latent, visible, cos, sin)  # [S, n] or [B, 1, S, n]
        allowed = torch.cat((window_keys(seq, self.window, device).expand(*seen.shape[:-1], seq), seen), dim=-1)
        keys = torch.cat((self.shared_keys(kv), self.shared_keys(entries.unsqueeze(1))), dim=2)  # [B, 1, S + n, hd]
        return attend_under_mask(q, keys, keys, self.head_dim ** -0.5, allowed, self.sinks)

    def entry_mask(self, x: Tensor, query_latent: Tensor, visible: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """The entries each query attends to among the ``visible`` ones [S, n]: all of them."""
        return visible

    # What a compressed layer costs beyond a sliding one (``SharedKVAttention``'s statements): its compressor
    # (``rate`` positions per entry, ``overlap`` or not), and for CSA its indexer. Subclasses name them.
    rate_key: str
    overlap: bool
    selects: bool = False

    @classmethod
    def parameter_tensors(cls, model: ModelConfig, i: int | None) -> list[ParamTensor]:
        """A sliding layer's weights, then its compressor's (``compressor_tensors``)."""
        rate = getattr(model.compressed_attention, cls.rate_key)
        return [*SharedKVAttention.parameter_tensors(model, i),
                *compressor_tensors(model.d_model, model.head_dim, rate, cls.overlap, i)]

    @classmethod
    def flops_per_token(cls, model: ModelConfig) -> float:
        """Training FLOPs of one token's scores and values over the keys it sees: the window's and, at the end of
        the sequence, every entry (HCA) or the top k of them (CSA). The kernel here computes the scores of every
        position and entry and masks the rest: more than this."""
        entries = model.seq_len // getattr(model.compressed_attention, cls.rate_key)
        keys = min(model.sliding_window, model.seq_len) + (min(model.index_topk, entries) if cls.selects else entries)
        return 6.0 * model.n_heads * cls.score_width(model) * keys

    @classmethod
    def input_gradient_sums(cls, model: ModelConfig) -> tuple[tuple[str, float], ...] | None:
        """A sliding layer's, and the compressed entries' [B, n, hd] gradient: hd / rate per position."""
        rate = getattr(model.compressed_attention, cls.rate_key)
        return (*SharedKVAttention.input_gradient_sums(model), ("compressed entries", model.head_dim / rate))

    @classmethod
    def projection_gemms(cls, model: ModelConfig, tp: int, tokens: int) -> list[tuple[float, int, int, int]]:
        """A sliding layer's, then the compressor's two projections (2·hd wide with ``overlap``), whole."""
        width = (2 if cls.overlap else 1) * model.head_dim
        return [*SharedKVAttention.projection_gemms(model, tp, tokens), (2, tokens, model.d_model, width)]

    @classmethod
    def saved_bytes(cls, model: ModelConfig, layer: LayerSpec, tp: int, mb: MicroBatch) -> int:
        """A sliding layer's bytes (``shared_kv_saved_bytes``; the block input read by four projections, the
        compressor's two among them) on the kernel of ``appended`` keys (``training_kernel``: a mask over the
        window's positions and the n entries, shared by the sequences, or per sequence where the indexer
        selects), the compressor's (``compressor_saved_bytes``), and this layer's own compressed RoPE tables, cos
        and sin [seq_len, r/2] in fp32, which its rotations save. The indexer runs without gradient: it saves
        nothing."""
        rate = getattr(model.compressed_attention, cls.rate_key)
        kernel = training_kernel(model, mb, layer.window, sinks=True, selected=cls.selects, appended=True)
        kernel_bytes = kernel_saved_bytes(kernel, mb, model.n_heads // tp, 1, model.head_dim, sink=True,
                                          appended=mb.positions // rate)
        total = shared_kv_saved_bytes(model, tp, mb, kernel_bytes, consumers=4)
        total += compressor_saved_bytes(mb, model.head_dim, rate, cls.overlap, model.rotary_dim)
        return total + model.seq_len * model.rotary_dim * FP32


class HeavilyCompressedAttention(CompressedAttention):
    """HCA: every visible entry of windows of ``hca_rate`` positions."""

    rate_key, overlap = "hca_rate", False

    def __init__(self, config: ModelConfig, layer: LayerSpec):
        super().__init__(config, layer)
        rate = config.compressed_attention.hca_rate
        self.compressor = Compressor(config.d_model, config.head_dim, rate, overlap=False, eps=config.norm_eps)


class CompressedIndexer(IndexScoring):
    """CSA's lightning indexer: its own compressor (the same windows as the layer's, ``index_head_dim`` wide) makes
    its keys, ``wq`` its queries from the layer's query latent, ``head_weights`` its head weights from the block
    input; queries and keys turn by the compressed RoPE (trailing channels, interleaved)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.heads, self.head_dim, self.topk = config.index_n_heads, config.index_head_dim, config.index_topk
        rate = config.compressed_attention.csa_rate
        self.compressor = Compressor(config.d_model, self.head_dim, rate, overlap=True, eps=config.norm_eps)
        self.wq = nn.Linear(config.q_lora_rank, self.heads * self.head_dim, bias=False)
        self.head_weights = nn.Linear(config.d_model, self.heads, bias=False)

    @torch.no_grad()
    def choose(self, x: Tensor, query_latent: Tensor, visible: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """The top-k ``visible`` entries ([S, n]) of each query of x [B, S, D] -> [B, 1, S, n] bool."""
        batch, seq, _ = x.shape
        keys = self.compressor(x, cos, sin)  # [B, n, di]
        q = self.wq(query_latent).view(batch, seq, self.heads, self.head_dim)
        q = rotate_trailing(q, cos[:seq, None], sin[:seq, None])
        return self.select(self.weigh(x, q, keys), visible)


class CompressedSparseAttention(CompressedAttention):
    """CSA: the ``index_topk`` entries its indexer picks among the visible ones, of overlapping windows of
    2 · ``csa_rate`` positions."""

    rate_key, overlap, selects = "csa_rate", True, True

    def __init__(self, config: ModelConfig, layer: LayerSpec):
        super().__init__(config, layer)
        rate = config.compressed_attention.csa_rate
        self.compressor = Compressor(config.d_model, config.head_dim, rate, overlap=True, eps=config.norm_eps)
        self.indexer = CompressedIndexer(config)

    def entry_mask(self, x: Tensor, query_latent: Tensor, visible: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """The visible entries [S, n] the indexer picks for each query -> [B, 1, S, n]."""
        if visible.shape[-1] == 0:
            return visible
        return visible & self.indexer.choose(x, query_latent, visible, cos, sin)

    @classmethod
    def parameter_tensors(cls, model: ModelConfig, i: int | None) -> list[ParamTensor]:
        """A compressed layer's, then the indexer's: its compressor (``index_head_dim`` wide, overlapping), ``wq``
        [hi·di, c'], ``head_weights`` [hi, D], all whole on every rank and none trained (no autocast copies)."""
        heads, width, rate = model.index_n_heads, model.index_head_dim, model.compressed_attention.csa_rate
        return [*super().parameter_tensors(model, i),
                *compressor_tensors(model.d_model, width, rate, True, i, trained=False),
                ParamTensor("attention", i, (heads * width, model.q_lora_rank), input_grad=False),
                ParamTensor("attention", i, (heads, model.d_model), input_grad=False)]

    @classmethod
    def flops_per_token(cls, model: ModelConfig) -> float:
        """The attention's (``CompressedAttention.flops_per_token``) and the indexer's q·k over every entry in
        each of its heads, forward only (it takes no gradient)."""
        entries = model.seq_len // model.compressed_attention.csa_rate
        return super().flops_per_token(model) + 2.0 * model.index_n_heads * model.index_head_dim * entries

    @classmethod
    def projection_gemms(cls, model: ModelConfig, tp: int, tokens: int) -> list[tuple[float, int, int, int]]:
        """A compressed layer's, then the indexer's: its compressor's two, ``wq``, ``head_weights``."""
        heads, width = model.index_n_heads, model.index_head_dim
        return [*super().projection_gemms(model, tp, tokens), (2, tokens, model.d_model, 2 * width),
                (1, tokens, model.q_lora_rank, heads * width), (1, tokens, model.d_model, heads)]


# Where ``transformers``' ``DeepseekV4Attention`` (a layer's ``self_attn``) keeps what this package's V4 kinds call
# otherwise: the indexer, which it nests in the compressor. Every other parameter has the same name in both.
HF_RENAMED_PREFIXES = {"indexer.compressor.": "compressor.indexer.", "indexer.wq.": "compressor.indexer.q_b_proj.",
                       "indexer.head_weights.": "compressor.indexer.scorer.weights_proj."}


def hf_attention_name(name: str) -> str:
    """The ``transformers`` name (within a layer's ``self_attn``) of parameter ``name`` of a V4 attention kind
    (``SharedKVAttention``, ``HeavilyCompressedAttention``, ``CompressedSparseAttention``)."""
    for ours, theirs in HF_RENAMED_PREFIXES.items():
        if name.startswith(ours):
            return theirs + name[len(ours):]
    return name
