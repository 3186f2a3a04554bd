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
dense cost, where V4's own kernels read the window and the selected entries alone.

The selection passes no gradient, so CSA's indexer learns from a loss of its own, as DeepSeek-V3.2's
(``indexer.indexer_loss``; V4's report gives no other recipe): the KL between the main attention's distribution over
the compressed entries and the indexer's. The target is each head's probabilities of the entries in the layer's one
softmax (window, entries and sink), summed over the heads and L1-normalised over the entries the loss covers: every
visible one in the dense warm-up (``dense_warmup``: attention over every visible entry, as HCA), the selected ones
in the sparse stage. The indexer reads detached inputs (block input, query latent), so its loss trains it alone,
its own compressor included, and the language-model loss the rest (``training/indexer_stages.py``).

Shapes: B sequences, S positions, D = d_model, nh heads, hd = head_dim, n entries, c' = q_lora_rank, hi/di the
indexer's heads and width, r rotary channels.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from config.model import LayerSpec, ModelConfig
from moe.attention.compressor import Compressor, compressor_saved_bytes, compressor_tensors, visible_entries
from moe.attention.indexer import IndexedAttention, IndexScoring, indexer_loss
from moe.attention.kernel import attend_under_mask, kernel_saved_bytes, training_kernel
from moe.attention.shared_kv import SharedKVAttention, at_positions, shared_kv_saved_bytes, window_keys
from moe.attention.trailing_rope import compressed_rope_tables, rotate_trailing
from moe.documents import Documents
from moe.kv_cache import CompressorCache, LayerCache
from moe.param_tensors import ParamTensor
from moe.saved_activations import FP32, MicroBatch


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
        cos, sin = self.compressed_tables(device)  # views of the tables where no gather is needed: nothing saved anew
        query_tables = at_positions(cos, sin, seq, None if documents is None else documents.query_pos)
        return self.attend_positions(x, keys_x, query_latent, q, kv, query_pos, key_pos, None, query_tables)

    def attend_positions(self, x: Tensor, keys_x: Tensor, query_latent: Tensor, q: Tensor, kv: Tensor,
                         query_pos: Tensor, key_pos: Tensor, cache: LayerCache | None,
                         query_tables: tuple[Tensor, Tensor]) -> Tensor:
        """q at ``query_pos`` against the window's keys kv at ``key_pos`` and the entries the compressor makes of
        ``keys_x`` (every position in order; in generation the new ones, the rest in the ``cache``), in one
        softmax -> [B, nh, Sq, hd]."""
        cos, sin = self.compressed_tables(x.device)
        entries = self.compressor(keys_x, cos, sin, None if cache is None else cache.compressor("attention"))
        visible = visible_entries(query_pos, entries.shape[1], self.compressor.rate)  # [Sq, n]
        # the entries each query attends to ([Sq, n], or [B, 1, Sq, n] where an indexer picks), its scores to learn
        seen, scores = self.entry_mask(x, keys_x, query_latent, visible, query_tables, cache)
        window = window_keys(query_pos, key_pos, self.window).expand(*seen.shape[:-1], key_pos.shape[0])
        allowed = torch.cat((window, seen), -1)
        keys = torch.cat((self.shared_keys(kv), self.shared_keys(entries.unsqueeze(1))), dim=2)  # [B, 1, S + n, hd]
        out = attend_under_mask(q, keys, keys, self.head_dim ** -0.5, allowed, self.sinks)
        if scores is not None:  # an indexer that learns (CSA's, ``IndexedAttention``), from the entries' target
            out = self.learn(out, indexer_loss(scores, self.entry_probabilities(q, keys, allowed, scores.shape[-1]),
                                               seen))
        return out

    def entry_mask(self, x: Tensor, keys_x: Tensor, query_latent: Tensor, visible: Tensor,
                   query_tables: tuple[Tensor, Tensor], cache: LayerCache | None) -> tuple[Tensor, Tensor | None]:
        """The entries each query attends to among the ``visible`` ones [Sq, n] (all of them), and the scores of an
        indexer that learns from this forward (none here)."""
        return visible, None

    @torch.no_grad()
    def entry_probabilities(self, q: Tensor, keys: Tensor, allowed: Tensor, entries: int) -> Tensor:
        """The attention's probabilities of the last ``entries`` keys (the compressed entries) in each head's softmax
        over the ``allowed`` keys and its sink, summed over the heads: q [B, nh, Sq, hd], keys [B, 1, S + n, hd] ->
        [B, Sq, n] fp32, the indexer's target before normalising. One head at a time, so one [B, Sq, S + n] score
        tensor is alive; under tensor parallelism this rank's heads, summed over the ranks at ``head_sum``."""
        sinks = self.sinks.to_local() if isinstance(self.sinks, DTensor) else self.sinks
        hidden = ~allowed.reshape(-1, *allowed.shape[-2:])
        keys_t = keys[:, 0].float().transpose(-1, -2)  # [B, hd, S + n]
        total = torch.zeros(q.shape[0], q.shape[2], entries, dtype=torch.float32, device=q.device)
        for head in range(q.shape[1]):
            logits = (q[:, head].float() @ keys_t * self.head_dim ** -0.5).masked_fill(hidden, float("-inf"))
            sink = sinks[head].float().expand(*logits.shape[:-1], 1)
            total += torch.softmax(torch.cat((sink, logits), dim=-1), dim=-1)[..., -entries:]
        return self.head_sum(total)

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
        sequences, or per sequence where the indexer selects), and the compressor's (``compressor_saved_bytes``);
        CSA's indexer's too (``indexer_saved_bytes``)."""
        rate = getattr(model.compressed_attention, cls.rate_key)
        kernel = training_kernel(model, mb, layer.window, sinks=True,
                                 selected=model.index_topk if cls.selects else None, appended=True)
        kernel_bytes = kernel_saved_bytes(kernel, mb, model.n_heads // tp, 1, model.head_dim, sink=True,
                                          appended=mb.positions * mb.cp // rate)
        total = shared_kv_saved_bytes(model, tp, mb, kernel_bytes, compressed=True)
        total += indexer_saved_bytes(model, mb) if cls.selects else 0
        return total + compressor_saved_bytes(mb, model.head_dim, rate, cls.overlap, model.rotary_dim)


def indexer_saved_bytes(model: ModelConfig, mb: MicroBatch) -> int:
    """What CSA's indexer saves in a training forward of the sparse stage (which the memory model plans for), with
    n = cp·s / rate entries per sequence (none: nothing): its compressor's (``compressor_saved_bytes``, di wide); its
    scores' (``IndexScoring.weigh``): the rotated queries [T·hi, di] and keys [B, n, di] their matmul reads, the
    ReLU's output [T·hi, n] and the head weights [T, hi] that weigh it, all in the compute dtype (under autocast the
    matmuls' bf16 copies); its loss's: the hidden entries' mask (bool [B, s, n], the selection's), the
    log-softmax's output and the target ([T, n] each, fp32) and the loss itself. Its inputs are detached views of
    the block input and the query latent, saved already, but under bf16 autocast (fp32 weights) its compressor's
    two projections save their own casts of the keys' block input [cp·T, D] and ``head_weights`` one of the
    queries' [T, D]; under context parallelism its queries turn by tables at their positions (copies, cos and sin
    [s, r/2], fp32). The main attention's probabilities, its target, are made without gradient: saved by nothing."""
    rate, rotary = model.compressed_attention.csa_rate, model.rotary_dim
    t, entries, heads, width = mb.tokens, mb.positions * mb.cp // rate, model.index_n_heads, model.index_head_dim
    if entries == 0:
        return 0
    total = compressor_saved_bytes(mb, width, rate, True, rotary)
    total += (t * heads * width + mb.sequences * entries * width + t * heads * entries + t * heads) * mb.compute
    total += t * entries + t * entries * 2 * FP32 + FP32
    if mb.bf16 and not mb.bf16_weights:
        total += (2 * mb.cp + 1) * t * model.d_model * mb.compute
    return total + (mb.positions * rotary * FP32 if mb.cp > 1 else 0)


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

    def scores(self, x: Tensor, keys_x: Tensor, query_latent: Tensor, query_tables: tuple[Tensor, Tensor],
               cos: Tensor, sin: Tensor, cache: CompressorCache | None = None) -> Tensor | None:
        """I(t, s) of each query of x [B, Sq, D] (its query latent [B, Sq, c'], its RoPE ``query_tables`` [Sq, r/2])
        against the entries
        of ``keys_x`` [B, S, D] (every position, in order; in generation the new ones, the rest in its compressor's
        ``cache``, which takes them in even while no entry is made) -> [B, Sq, n] fp32, before any mask
        (``IndexScoring.weigh``); None while there is no entry."""
        batch, seq, _ = x.shape
        keys = self.compressor(keys_x, cos, sin, cache)  # [B, n, di]
        if keys.shape[1] == 0:
            return None
        q = self.wq(query_latent).view(batch, seq, self.heads, self.head_dim)
        q_cos, q_sin = query_tables
        q = rotate_trailing(q, q_cos.unsqueeze(-2), q_sin.unsqueeze(-2))
        return self.weigh(x, q, keys)


class CompressedSparseAttention(CompressedAttention, IndexedAttention):
    """CSA: the ``index_topk`` entries its indexer picks among the visible ones, of overlapping windows of
    2 · ``csa_rate`` positions; every visible one in the dense warm-up (``dense_warmup``). A training forward
    trains the indexer (module docstring). Under tensor parallelism the indexer is whole on every rank, on whole
    inputs, and its target, summed over the heads, is summed over the ranks' heads at ``head_sum`` (an identity
    here)."""

    rate_key, overlap, selects = "csa_rate", True, True

    def __init__(self, config: ModelConfig, layer: LayerSpec):
        super().__init__(config, layer)
        rate = config.compressed_attention.csa_rate
        self.compressor = Compressor(config.d_model, config.head_dim, rate, overlap=True, eps=config.norm_eps)
        self.indexer = CompressedIndexer(config)
        self.head_sum = nn.Identity()  # where tensor parallelism sums the indexer's target over every rank's heads

    def entry_mask(self, x: Tensor, keys_x: Tensor, query_latent: Tensor, visible: Tensor,
                   query_tables: tuple[Tensor, Tensor], cache: LayerCache | None) -> tuple[Tensor, Tensor | None]:
        """The visible entries [Sq, n] the indexer picks for each query -> [B, 1, Sq, n] (in the dense warm-up all
        of them, [Sq, n]), and in training the indexer's scores [B, Sq, n] of detached inputs, to learn from. In
        generation the indexer's compressor keeps its own state in the layer's ``cache``, as the attention's does."""
        cos, sin = self.compressed_tables(x.device)
        state = None if cache is None else cache.compressor("indexer")
        scores = self.indexer.scores(x.detach(), keys_x.detach(), query_latent.detach(), query_tables, cos, sin,
                                     state)
        if scores is None or visible.shape[-1] == 0:
            return visible, None
        seen = visible if self.dense_warmup else visible & self.indexer.select(scores, visible)
        return seen, scores if self.training else None

    @classmethod
    def parameter_tensors(cls, model: ModelConfig, i: int | None) -> list[ParamTensor]:
        """A compressed layer's, then the indexer's: its compressor (``index_head_dim`` wide, overlapping), ``wq``
        [hi·di, c'], ``head_weights`` [hi, D], all whole on every rank; their inputs are detached, so no autocast
        copy of them is saved."""
        heads, width, rate = model.index_n_heads, model.index_head_dim, model.compressed_attention.csa_rate
        return [*super().parameter_tensors(model, i),
                *compressor_tensors(model.d_model, width, rate, True, i, input_grad=False),
                ParamTensor("attention", i, (heads * width, model.q_lora_rank), input_grad=False),
                ParamTensor("attention", i, (heads, model.d_model), input_grad=False)]

    @classmethod
    def flops_per_token(cls, model: ModelConfig) -> float:
        """The attention's (``CompressedAttention.flops_per_token``) and the indexer's q·k over every entry in
        each of its heads (forward and backward: its loss trains it)."""
        entries = model.seq_len // model.compressed_attention.csa_rate
        return super().flops_per_token(model) + 6.0 * model.index_n_heads * model.index_head_dim * entries

    @staticmethod
    def forward_sums(model: ModelConfig) -> tuple[tuple[str, int], ...]:
        """Under tp, the indexer's target summed over the ranks' heads (``head_sum``): over every entry."""
        return (("indexer target", model.seq_len // model.compressed_attention.csa_rate),)

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
