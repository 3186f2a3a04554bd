"""Sparse latent attention: DeepSeek Sparse Attention (DSA; DeepSeek-V3.2 technical report, sec. 2) over multi-head
latent attention, as DeepSeek-V3.2 and GLM-5 have it, and what it costs.

Latent attention (``latent.py``: its projections, latents and costs are reused as they are) where each query attends
only to the ``index_topk`` keys the lightning indexer ranks highest among those it may see; a query that sees no
more than k keys sees them all, so on sequences of at most k positions the layer is dense latent attention exactly
(and runs its kernel).

The indexer (the report's eq. 1): for query t and an earlier key s the index score is
I(t, s) = sum_j w(t, j) · ReLU(q(t, j) · k(s)) over the indexer's few heads j, each query head q(t, j) made from
the query latent of latent attention, one key k(s) per position shared by the heads, and a weight w(t, j) per head
made from the token itself. As released (DeepSeek's inference code, ``transformers``' ``deepseek_v32``): the key is
LayerNorm-ed (with bias, epsilon 1e-6), the first r channels of queries and key are rotary (RoPE on pairs
(i, i + r/2); GLM-5's interleaved pairs are a permutation of rows the Hugging Face import applies), q·k is scaled by
1/sqrt(index_head_dim) and w by 1/sqrt(index heads), scores in fp32. DeepSeek's Hadamard rotation of q and k and
their FP8 scoring leave q·k as it is (an orthogonal rotation) up to precision, and are not built.

Training as published (the report's sec. 2.1.1): in the dense warm-up (``dense_warmup``; the rest of the model
frozen by the trainer) attention stays dense and the indexer learns to match the main attention's distribution
over every visible key; in the sparse stage attention runs over the selected keys and the indexer matches the
distribution over those. Either way its loss (``indexer_loss``) reaches backward by itself from the layer's output
(``moe.losses.attach_loss``), and the indexer's inputs are detached: its loss trains it alone, the language-model
loss the rest.

Shapes: B sequences, S (Sq) positions (queries), K keys, D = d_model, nh heads, c' = q_lora_rank, hi/di the
indexer's heads and width, r rotary channels.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from config.model import LayerSpec, ModelConfig
from moe.attention.gathered import gathered_attention
from moe.attention.indexer import IndexedAttention, IndexScoring, indexer_loss, selection_mask
from moe.attention.kernel import GATHERED, SPARSE, attend, choose_kernel, training_kernel, visible_keys
from moe.attention.latent import LatentAttention, latent_saved_bytes
from moe.documents import Documents
from moe.kv_cache import LayerCache
from moe.param_tensors import ParamTensor
from moe.rope import apply_partial_rope
from moe.saved_activations import FP32, INDEX, MicroBatch, linear_input_bytes

INDEX_NORM_EPS = 1e-6  # the key's LayerNorm epsilon in DeepSeek-V3.2's and GLM-5's code and checkpoints


class LightningIndexer(IndexScoring):
    """The indexer's projections (``wq`` from the query latent, ``wk`` and its LayerNorm ``k_norm`` from the block
    input, ``head_weights`` from the block input), its keys (one per position) and its scores (``IndexScoring``).

    It learns by its own loss alone (``indexer_loss``): the attention hands it detached inputs, and the top-k
    selection passes no gradient, so the language-model loss never reaches it nor it the model.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.heads, self.head_dim, self.rope_dim = config.index_n_heads, config.index_head_dim, config.qk_rope_head_dim
        self.topk = config.index_topk
        self.wq = nn.Linear(config.q_lora_rank, self.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.d_model, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=INDEX_NORM_EPS)
        self.head_weights = nn.Linear(config.d_model, self.heads, bias=False)

    def keys(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [B, S, D] -> each position's key [B, S, di], normalised and rotated."""
        return apply_partial_rope(self.k_norm(self.wk(x)).unsqueeze(1), cos, sin, self.rope_dim).squeeze(1)

    def scores(self, x: Tensor, query_latent: Tensor, cos: Tensor, sin: Tensor, keys: Tensor) -> Tensor:
        """I(t, s) for x's queries [B, Sq, D] (their query latent [B, Sq, c']) against ``keys`` [B, K, di] ->
        [B, Sq, K] fp32, before any mask (``IndexScoring.weigh``)."""
        batch, seq, _ = x.shape
        q = self.wq(query_latent).view(batch, seq, self.heads, self.head_dim)
        cos, sin = (table.transpose(-3, -2) if table.dim() == 4 else table.unsqueeze(-2) for table in (cos, sin))
        return self.weigh(x, apply_partial_rope(q, cos, sin, self.rope_dim), keys)


class SelectionRelay:
    """The keys a layer with its own indexer selected in its latest forward, ``indices`` and ``valid`` [B, Sq, k]
    (``LightningIndexer.select``), or None where it selected none (dense attention): what the shared-selection
    layers after it attend to (GLM-5's cross-layer sharing, ``share_selections``)."""

    def __init__(self) -> None:
        self.latest: tuple[Tensor, Tensor] | None = None


class SparseLatentAttention(LatentAttention, IndexedAttention):
    """Latent attention over the keys its ``indexer`` selects.

    ``dense_warmup`` (set by the trainer: ``training.indexer_stages.set_indexer_stage``) keeps attention dense;
    the training forward records the indexer's loss and attaches it (``IndexedAttention.learn``). Under context
    parallelism the indexer's keys join the latents' one exchange, so each rank's queries select among the whole
    sequence's keys. Under tensor parallelism the indexer is whole on every rank and its target, the attention
    probabilities summed over the heads, is summed over the ranks' heads at ``head_sum`` (an identity here); on the
    gathered kernel the latent's gradient from this rank's heads is summed at ``shared_latent`` (``wkv_b``'s split input
    does it on the others). Its selection is left in ``relay`` for the shared-selection layers after it.
    """

    def __init__(self, config: ModelConfig, layer: LayerSpec):
        super().__init__(config, layer)
        self.topk = config.index_topk
        self.indexer = self.make_indexer(config)
        self.relay = SelectionRelay()
        self.head_sum = nn.Identity()  # where tensor parallelism sums the target over every rank's heads
        self.shared_latent = nn.Identity()  # where it sums the gathered kernel's latent gradient over the heads

    @staticmethod
    def make_indexer(config: ModelConfig) -> LightningIndexer | None:
        """This kind's own indexer (none in ``SharedSelectionAttention``)."""
        return LightningIndexer(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: LayerCache | None = None,
                documents: Documents | None = None) -> Tensor:
        """x: [B, S, D]; cos, sin: rotary tables [>= S, r/2] (the interface of ``AttentionKind``) -> [B, S, D]."""
        start, cos, sin = self.positions(x, cos, sin, cache, documents)
        query_latent, q = self.queries(x, cos, sin)
        own = self.indexer is not None
        index_input, index_latent = x.detach(), query_latent.detach()
        index_keys = self.indexer.keys(index_input, cos, sin) if own else None  # [B, S, di]
        latent, k_rope, index_keys = self.latents(x, cos, sin, documents, index_keys)
        if cache is not None and own:
            index_keys = cache.extend_index(index_keys)
        keys = start + latent.shape[1]  # every rank's under context parallelism, the cached ones in generation
        kernel = choose_kernel(q.shape[2], selected=None if self.dense_warmup else self.topk, keys=keys,
                               cached=cache is not None)
        learns = self.training and cache is None and own
        scores = visible = indices = valid = selected = None
        if learns or kernel in (SPARSE, GATHERED):
            visible = visible_keys(q.shape[2], keys, start, documents, x.device)
            if own:
                scores = self.indexer.scores(index_input, index_latent, cos, sin, index_keys)  # [B, Sq, K]
        if kernel in (SPARSE, GATHERED):
            indices, valid = self.indexer.top_keys(scores, visible) if own else self.shared_selection(q.shape[2])
        if own:
            self.relay.latest = None if indices is None else (indices, valid)
        if kernel == GATHERED:
            out, summed = self._attend_gathered(q, latent, k_rope, indices, valid, documents)
            if learns:
                out = self.learn(out, indexer_loss(scores.gather(-1, indices), self.head_sum(summed), valid))
            return out
        k, v = self.keys_values(latent, k_rope, q.shape[1])
        self.track(q, k, self.softmax_scale, cache, documents)
        k, v, cache_mask = (k, v, None) if cache is None else cache.extend(k, v)
        if kernel == SPARSE:  # the selected keys among the visible, the one mask of the kernel and the loss
            selected = visible & selection_mask(indices, keys)
        out = attend(q, k, v, self.softmax_scale, start, cache_mask=cache_mask, documents=documents,
                     selected=selected)
        out = self.output(out)
        if learns:
            mask = visible if selected is None else selected
            out = self.learn(out, indexer_loss(scores, self.attention_probabilities(q, k, mask), mask))
        return out

    def shared_selection(self, queries: int) -> tuple[Tensor, Tensor]:
        """The selection this layer shares (``relay``): a layer with its own indexer before it must have made
        one for these queries in this forward."""
        latest = self.relay.latest
        if latest is None or latest[0].shape[1] != queries:
            raise RuntimeError("a shared-selection layer attends to the keys of the indexer layer before it, which "
                               "selected none for these queries (its forward must run first, in the same pass)")
        return latest

    def _attend_gathered(self, q: Tensor, latent: Tensor, k_rope: Tensor, indices: Tensor, valid: Tensor,
                         documents: Documents | None) -> tuple[Tensor, Tensor]:
        """The sparse stage on the ``gathered`` kernel: latent attention absorbed (DeepSeek-V2 sec. 2.1.3), each
        head's query times its key up-projection against the one shared key of c + r channels per position (the
        latent and the rotary key), and its output, a mix of latents, up-projected to its value. q [B, nh, Sq, n + r],
        latent [B, K, c], k_rope [B, 1, K, r], each query's keys ``indices`` and their visibility ``valid``
        [B, Sq, k] -> the output [B, Sq, D] and the probabilities summed over this rank's heads [B, Sq, k] (the
        indexer's target, on the selected keys alone)."""
        if self.logit_tracker is not None and self.training:  # QK-clip's logits: every head's keys, no gradient
            with torch.no_grad():
                self.track(q, self.keys_values(latent, k_rope, q.shape[1])[0], self.softmax_scale, None, documents)
        up = self.wkv_b.weight.to_local() if isinstance(self.wkv_b.weight, DTensor) else self.wkv_b.weight
        up = up.view(-1, self.nope_dim + self.v_dim, self.kv_rank)  # [nh, n + v, c]: this rank's heads
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        absorbed = torch.cat((torch.einsum("bhsn,hnc->bhsc", q_nope, up[:, :self.nope_dim]), q_rope), dim=-1)
        keys = torch.cat((self.shared_latent(latent), k_rope.squeeze(1).to(latent.dtype)), dim=-1)  # [B, K, c + r]
        out, summed = gathered_attention(absorbed, keys, self.kv_rank, self.softmax_scale, indices, valid)
        return self.output(torch.einsum("bhsc,hvc->bhsv", out, up[:, self.nope_dim:])), summed

    @torch.no_grad()
    def attention_probabilities(self, q: Tensor, k: Tensor, keys: Tensor) -> Tensor:
        """The main attention's probabilities over ``keys`` ([.., Sq, K] bool), summed over the heads: q
        [B, nh, Sq, n + r], k [B, nh, K, n + r] -> [B, Sq, K] fp32, the indexer's target before normalising.
        One head at a time, so only one [B, Sq, K] score tensor is alive."""
        total = torch.zeros(q.shape[0], q.shape[2], k.shape[2], dtype=torch.float32, device=q.device)
        hidden = ~keys.reshape(-1, *keys.shape[-2:])
        for head in range(q.shape[1]):
            logits = (q[:, head].float() @ k[:, head].float().transpose(-1, -2)) * self.softmax_scale
            total += torch.softmax(logits.masked_fill(hidden, float("-inf")), dim=-1)
        return self.head_sum(total)

    # What this kind costs: latent attention's (``latent.py``) and the indexer's.

    @staticmethod
    def parameter_tensors(model: ModelConfig, i: int | None) -> list[ParamTensor]:
        """Latent attention's tensors, then the indexer's, whole on every tp rank: ``wq`` [hi·di, c'], ``wk``
        [di, D], the key's LayerNorm weight and bias [di], ``head_weights`` [hi, D]; their inputs are detached,
        so no autocast copy of them is saved."""
        heads, width = model.index_n_heads, model.index_head_dim
        return [*LatentAttention.parameter_tensors(model, i),
                ParamTensor("attention", i, (heads * width, model.q_lora_rank), input_grad=False),
                ParamTensor("attention", i, (width, model.d_model), input_grad=False),
                ParamTensor("norm", i, (width,)), ParamTensor("norm", i, (width,)),
                ParamTensor("attention", i, (heads, model.d_model), input_grad=False)]

    @staticmethod
    def projection_gemms(model: ModelConfig, tp: int, tokens: int) -> list[tuple[float, int, int, int]]:
        """Latent attention's projections, then the indexer's three (whole on every rank)."""
        heads, width = model.index_n_heads, model.index_head_dim
        return [*LatentAttention.projection_gemms(model, tp, tokens), (1, tokens, model.q_lora_rank, heads * width),
                (1, tokens, model.d_model, width), (1, tokens, model.d_model, heads)]

    @staticmethod
    def flops_per_token(model: ModelConfig) -> float:
        """Training FLOPs of one token's scores and values (``selected_attention_flops``) and of the indexer's
        q·k over all S keys in each of its heads (forward and backward: its loss trains it)."""
        return selected_attention_flops(model) + 6.0 * model.index_n_heads * model.index_head_dim * model.seq_len

    @staticmethod
    def forward_sums(model: ModelConfig) -> tuple[tuple[str, int], ...]:
        """Under tp, the indexer's target summed over the ranks' heads (``head_sum``): over every key, or on the
        ``gathered`` kernel over each query's k selected ones."""
        kernel = choose_kernel(model.seq_len, selected=model.index_topk, keys=model.seq_len)
        return (("indexer target", model.index_topk if kernel == GATHERED else model.seq_len),)

    @staticmethod
    def sequence_gather_width(model: ModelConfig, tp: int) -> int:
        """Latent attention's normalised latent and rotated shared key, and the indexer's key, per position."""
        return LatentAttention.sequence_gather_width(model, tp) + model.index_head_dim

    @staticmethod
    def saved_bytes(model: ModelConfig, layer: LayerSpec, tp: int, mb: MicroBatch) -> int:
        """Latent attention's bytes on its kernel (``sparse`` where the K = cp·s keys outnumber k; the sparse
        stage's, which the memory model plans for), and the indexer's in a training forward: ``k_norm``'s input
        [T, di] (``wk``'s output) with its mean and rstd (fp32 [T] each), the rotated keys [B, K, di] (under
        context parallelism in fp32 a view of the gathered [B, K, c + r + di], which it keeps whole) and queries
        [T·hi, di] its scores' matmul reads, the ReLU's output [T·hi, K] and the head weights [T, hi] that weigh
        it, all in the compute dtype (under autocast the matmuls' bf16 copies); its loss's: the hidden keys' mask
        (bool, [s, K] shared by the sequences where every visible key counts, else [b, s, K]), the log-softmax's
        output and the target, [T, K] each (fp32), and the loss itself. The indexer's inputs are the
        block input and the query latent, saved already, but under bf16 autocast (fp32 weights) ``wk`` and
        ``head_weights`` each save their own cast of the block input [T, D] (measured); under FSDP's bf16 weights
        the LayerNorm's mean and rstd are bf16. The main attention's probabilities are made without gradient, and
        saved by nothing."""
        t, keys, heads, width = mb.tokens, mb.positions * mb.cp, model.index_n_heads, model.index_head_dim
        kernel = training_kernel(model, mb, selected=model.index_topk)
        total = latent_saved_bytes(model, tp, mb, kernel)
        statistics = mb.compute if mb.bf16_weights else FP32  # k_norm's mean and rstd: its weights' dtype
        total += (t * width + t * heads * width) * mb.compute + 2 * t * statistics
        if mb.cp > 1 and not mb.bf16:  # the keys, a view of the gathered latents, keep that whole storage
            total += mb.sequences * keys * (model.kv_lora_rank + model.qk_rope_head_dim + width) * FP32
        else:  # the keys, or their bf16 copy for the matmul
            total += mb.sequences * keys * width * mb.compute
        total += (t * heads * keys + t * heads) * mb.compute
        if mb.bf16 and not mb.bf16_weights:  # autocast's casts of the block input for wk and head_weights
            total += linear_input_bytes(mb, model.d_model, 2)
        if kernel == GATHERED:
            return total + gathered_saved_bytes(model, tp, mb)
        total += (mb.sequences if kernel == SPARSE else 1) * mb.positions * keys
        return total + t * keys * 2 * FP32 + FP32


def selected_attention_flops(model: ModelConfig) -> float:
    """Training FLOPs of one token's scores and values, by the sparse stage's kernel: on the ``gathered`` one over
    the k selected keys, each score c + r wide and each value c (latent attention absorbed: the absorption's
    matmuls are ``wkv_b``'s multiply-adds, counted with the parameters); on the masked one every key's score is
    computed (latent attention's widths over S keys, as dense)."""
    if choose_kernel(model.seq_len, selected=model.index_topk, keys=model.seq_len) == GATHERED:
        return 6.0 * model.n_heads * (2 * model.kv_lora_rank + model.qk_rope_head_dim) * model.index_topk
    return 6.0 * model.n_heads * LatentAttention.score_width(model) * model.seq_len


def gathered_kernel_bytes(model: ModelConfig, tp: int, mb: MicroBatch, selection: bool = True) -> int:
    """What the ``gathered`` kernel saves beyond latent attention's projections, on this rank's nh/tp heads, with
    k = ``index_topk`` keys per query of K = cp·s: the absorption's copy of the queries' n content channels
    [T·nh, n]; the kernel's absorbed queries [T·nh, c + r], keys [b, K, c + r], indices (int64) and their
    visibility (bool) [T, k], output [T·nh, c] (query-major, which the up-projection's matmul reads as it is) and
    its log-sum-exp (fp32 [T·nh]). A layer sharing another's ``selection`` saves that layer's indices again, no
    new bytes."""
    t, heads, a = mb.tokens, model.n_heads // tp, mb.compute
    latent, rope = model.kv_lora_rank, model.qk_rope_head_dim
    total = t * heads * (model.qk_nope_head_dim + latent + rope + latent) * a + t * heads * FP32
    total += mb.sequences * mb.positions * mb.cp * (latent + rope) * a
    return total + (t * model.index_topk * (INDEX + 1) if selection else 0)


def gathered_saved_bytes(model: ModelConfig, tp: int, mb: MicroBatch) -> int:
    """What the sparse stage saves on the ``gathered`` kernel beyond latent attention's projections and the
    indexer's scores: the kernel's (``gathered_kernel_bytes``) and the indexer's loss over the k keys: its scores
    [T, K] (compute dtype: the gather's backward keeps its input), the hidden keys' mask (bool), the log-softmax's
    output and the target (fp32), [T, k] each, and the loss itself."""
    t, a = mb.tokens, mb.compute
    total = gathered_kernel_bytes(model, tp, mb) + t * mb.positions * mb.cp * a
    return total + t * model.index_topk * (1 + 2 * FP32) + FP32


class SharedSelectionAttention(SparseLatentAttention):
    """Sparse latent attention with no indexer of its own: it attends to the keys the layer before it with one
    selected (GLM-5's ``indexer_types`` "shared": Hugging Face's ``GlmMoeDsaAttention`` reuses the previous full
    layer's top-k indices). The model links it to that layer's ``relay`` (``share_selections``); it has no
    indexer loss, and in the dense warm-up nothing of it learns."""

    @staticmethod
    def make_indexer(config: ModelConfig) -> None:
        return None

    @staticmethod
    def parameter_tensors(model: ModelConfig, i: int | None) -> list[ParamTensor]:
        """Latent attention's tensors alone."""
        return LatentAttention.parameter_tensors(model, i)

    @staticmethod
    def projection_gemms(model: ModelConfig, tp: int, tokens: int) -> list[tuple[float, int, int, int]]:
        """Latent attention's projections alone."""
        return LatentAttention.projection_gemms(model, tp, tokens)

    @staticmethod
    def flops_per_token(model: ModelConfig) -> float:
        """The attention over the shared selection (``selected_attention_flops``), no indexer."""
        return selected_attention_flops(model)

    @staticmethod
    def forward_sums(model: ModelConfig) -> tuple[tuple[str, int], ...]:
        """No indexer target to sum."""
        return ()

    @staticmethod
    def sequence_gather_width(model: ModelConfig, tp: int) -> int:
        """Latent attention's normalised latent and rotated shared key per position (no indexer key)."""
        return LatentAttention.sequence_gather_width(model, tp)

    @staticmethod
    def saved_bytes(model: ModelConfig, layer: LayerSpec, tp: int, mb: MicroBatch) -> int:
        """Latent attention's bytes on the sparse stage's kernel, and the gathered kernel's own there (the
        selection itself is the full layer's, counted there)."""
        kernel = training_kernel(model, mb, selected=model.index_topk)
        total = latent_saved_bytes(model, tp, mb, kernel)
        return total + (gathered_kernel_bytes(model, tp, mb, selection=False) if kernel == GATHERED else 0)


def share_selections(attentions: list[nn.Module]) -> None:
    """Link each ``SharedSelectionAttention`` of ``attentions`` (the model's layers in order) to the relay of the
    last sparse layer with its own indexer before it."""
    relay = None
    for attention in attentions:
        if isinstance(attention, SharedSelectionAttention):
            if relay is None:
                raise ValueError("a shared-selection layer needs a layer with its own indexer before it")
            attention.relay = relay
        elif isinstance(attention, SparseLatentAttention):
            relay = attention.relay
