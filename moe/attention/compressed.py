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
from moe.attention.shared_kv import SharedKVAttention, shared_kv_saved_bytes, window_keys
from moe.attention.trailing_rope import compressed_rope_tables, rotate_trailing
from moe.documents import Documents
from moe.kv_cache import CompressorCache, LayerCache
from moe.param_tensors import ParamTensor
from moe.saved_activations import MicroBatch


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

    def attend(self, x: Tensor, keys_x: Tensor, query_latent: Tensor, q: Tensor, kv: Tensor,
               documents: Documents | None) -> Tensor:
        """q [B, nh, Sq, hd] against the window's kv [B, 1, S, hd] and the entries [B, 1, n, hd] -> [B, nh, Sq, hd].
        Under context parallelism the compressor reads every position's block input in order (``keys_x`` sorted
        from the gather's order), and positions, not indices, say what a query sees."""
        seq, keys, device = x.shape[1], keys_x.shape[1], x.device
        query_pos, key_pos = torch.arange(seq, device=device), torch.arange(keys, device=device)
        if documents is not None:
            query_pos, key_pos = documents.query_pos, documents.key_pos
            keys_x = keys_x[:, key_pos.argsort()]
        return self.attend_positions(x, keys_x, query_latent, q, kv, query_pos, key_pos, None)

    def attend_positions(self, x: Tensor, keys_x: Tensor, query_latent: Tensor, q: Tensor, kv: Tensor,
                         query_pos: Tensor, key_pos: Tensor, cache: LayerCache | None) -> Tensor:
        """q at ``query_pos`` against the window's keys kv at ``key_pos`` and the entries the compressor makes of
        ``keys_x`` (every position in order; in generation the new ones, the rest in the ``cache``), in one
        softmax -> [B, nh, Sq, hd]."""
        cos, sin = self.compressed_tables(x.device)
        entries = self.compressor(keys_x, cos, sin, None if cache is None else cache.compressor("attention"))
        visible = visible_entries(query_pos, entries.shape[1], self.compressor.rate)  # [Sq, n]
        seen = self.entry_mask(x, keys_x, query_latent, visible, query_pos, cache)  # [Sq, n] or [B, 1, Sq, n]
        window = window_keys(query_pos, key_pos, self.window).expand(*seen.shape[:-1], key_pos.shape[0])
        keys = torch.cat((self.shared_keys(kv), self.shared_keys(entries.unsqueeze(1))), dim=2)  # [B, 1, S + n, hd]
        return attend_under_mask(q, keys, keys, self.head_dim ** -0.5, torch.cat((window, seen), -1), self.sinks)

    def entry_mask(self, x: Tensor, keys_x: Tensor, query_latent: Tensor, visible: Tensor,
                   query_pos: Tensor, cache: LayerCache | None) -> Tensor:
        """The entries each query attends to among the ``visible`` ones [Sq, n]: all of them."""
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
        """A sliding layer's bytes (``shared_kv_saved_bytes``, ``compressed``: the compressor reads the block input
        too, and the compressed RoPE tables are this layer's own) on the kernel of ``appended`` keys
        (``training_kernel``: a mask over the window's keys and the n entries of the whole sequence, shared by the
        sequences, or per sequence where the indexer selects), and the compressor's (``compressor_saved_bytes``).
        The indexer runs without gradient: it saves nothing."""
        rate = getattr(model.compressed_attention, cls.rate_key)
        kernel = training_kernel(model, mb, layer.window, sinks=True,
                                 selected=model.index_topk if cls.selects else None, appended=True)
        kernel_bytes = kernel_saved_bytes(kernel, mb, model.n_heads // tp, 1, model.head_dim, sink=True,
                                          appended=mb.positions * mb.cp // rate)
        total = shared_kv_saved_bytes(model, tp, mb, kernel_bytes, compressed=True)
        return total + compressor_saved_bytes(mb, model.head_dim, rate, cls.overlap, model.rotary_dim)


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
    def choose(self, x: Tensor, keys_x: Tensor, query_latent: Tensor, visible: Tensor, query_pos: Tensor,
               cos: Tensor, sin: Tensor, cache: CompressorCache | None = None) -> Tensor:
        """The top-k ``visible`` entries ([Sq, n]) of each query of x [B, Sq, D] at ``query_pos``, among the
        entries of ``keys_x`` [B, S, D] (every position, in order; in generation the new ones, the rest in its
        compressor's ``cache``, which takes them in even while no entry is visible) -> [B, 1, Sq, n] bool (or
        ``visible`` itself where it is empty)."""
        batch, seq, _ = x.shape
        keys = self.compressor(keys_x, cos, sin, cache)  # [B, n, di]
        if visible.shape[-1] == 0:
            return visible
        q = self.wq(query_latent).view(batch, seq, self.heads, self.head_dim)
        q = rotate_trailing(q, cos[query_pos, None], sin[query_pos, None])
        return visible & self.select(self.weigh(x, q, keys), visible)


class CompressedSparseAttention(CompressedAttention):
    """CSA: the ``index_topk`` entries its indexer picks among the visible ones, of overlapping windows of
    2 · ``csa_rate`` positions."""

    rate_key, overlap, selects = "csa_rate", True, True

    def __init__(self, config: ModelConfig, layer: LayerSpec):
        super().__init__(config, layer)
        rate = config.compressed_attention.csa_rate
        self.compressor = Compressor(config.d_model, config.head_dim, rate, overlap=True, eps=config.norm_eps)
        self.indexer = CompressedIndexer(config)

    def entry_mask(self, x: Tensor, keys_x: Tensor, query_latent: Tensor, visible: Tensor,
                   query_pos: Tensor, cache: LayerCache | None) -> Tensor:
        """The visible entries [Sq, n] the indexer picks for each query -> [B, 1, Sq, n]. In generation the
        indexer's compressor keeps its own state in the layer's ``cache``, as the attention's does."""
        cos, sin = self.compressed_tables(x.device)
        state = None if cache is None else cache.compressor("indexer")
        return self.indexer.choose(x, keys_x, query_latent, visible, query_pos, cos, sin, state)

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
