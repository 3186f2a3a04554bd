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

from config.model import LayerSpec, ModelConfig
from moe.attention.indexer import IndexScoring
from moe.attention.kernel import attend, training_kernel, visible_keys
from moe.attention.latent import LatentAttention, latent_saved_bytes
from moe.documents import Documents
from moe.kv_cache import LayerCache
from moe.losses import attach_loss
from moe.param_tensors import ParamTensor
from moe.rope import apply_rope
from moe.saved_activations import FP32, MicroBatch, linear_input_bytes

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
        return self._rotate(self.k_norm(self.wk(x)).unsqueeze(1), cos, sin).squeeze(1)

    def scores(self, x: Tensor, query_latent: Tensor, cos: Tensor, sin: Tensor, keys: Tensor) -> Tensor:
        """I(t, s) for x's queries [B, Sq, D] (their query latent [B, Sq, c']) against ``keys`` [B, K, di] ->
        [B, Sq, K] fp32, before any mask (``IndexScoring.weigh``)."""
        batch, seq, _ = x.shape
        q = self.wq(query_latent).view(batch, seq, self.heads, self.head_dim)
        cos, sin = (table.transpose(-3, -2) if table.dim() == 4 else table.unsqueeze(-2) for table in (cos, sin))
        return self.weigh(x, self._rotate(q, cos, sin), keys)

    def _rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """RoPE on the first r channels of x [.., di] (cos and sin broadcast against its [.., r/2]), the rest as
        they are."""
        return torch.cat((apply_rope(x[..., :self.rope_dim], cos, sin), x[..., self.rope_dim:]), dim=-1)


def indexer_loss(scores: Tensor, attention: Tensor, keys: Tensor) -> Tensor:
    """The indexer's KL loss (DeepSeek-V3.2 report, eqs. 3 and 4): the mean over queries of
    KL(p(t, ·) || softmax(I(t, ·))) over each query's ``keys`` ([.., Sq, K] bool: every visible key in the dense
    warm-up, the selected ones in the sparse stage), where p is the main attention's probabilities ``attention``
    [B, Sq, K] summed over its heads and L1-normalised over the same keys (no gradient). ``scores`` [B, Sq, K]."""
    hidden = ~keys.reshape(-1, *keys.shape[-2:])
    target = attention.masked_fill(hidden, 0.0)
    target = target / target.sum(dim=-1, keepdim=True)
    log_predicted = torch.log_softmax(scores.masked_fill(hidden, float("-inf")), dim=-1).masked_fill(hidden, 0.0)
    return (target * (target.clamp_min(torch.finfo(target.dtype).tiny).log() - log_predicted)).sum(dim=-1).mean()


class SparseLatentAttention(LatentAttention):
    """Latent attention over the keys its ``indexer`` selects.

    ``dense_warmup`` (set by the trainer: ``training.indexer_stages.set_indexer_stage``) keeps attention dense;
    the training forward records the indexer's loss in ``last_indexer_loss`` and weighs its gradient by
    ``indexer_loss_scale`` (the trainer's 1 / micro-batches, as the balancing losses). Under context parallelism
    the indexer's keys join the latents' one exchange, so each rank's queries select among the whole sequence's
    keys. Under tensor parallelism the indexer is whole on every rank and its target, the attention probabilities
    summed over the heads, is summed over the ranks' heads at ``head_sum`` (an identity here).
    """

    def __init__(self, config: ModelConfig, layer: LayerSpec):
        super().__init__(config, layer)
        self.indexer = LightningIndexer(config)
        self.head_sum = nn.Identity()  # where tensor parallelism sums the target over every rank's heads
        self.dense_warmup = False
        self.indexer_loss_scale = 1.0
        self.last_indexer_loss: Tensor | None = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: LayerCache | None = None,
                documents: Documents | None = None) -> Tensor:
        """x: [B, S, D]; cos, sin: rotary tables [>= S, r/2] (the interface of ``AttentionKind``) -> [B, S, D]."""
        start, cos, sin = self.positions(x, cos, sin, cache, documents)
        query_latent, q = self.queries(x, cos, sin)
        index_input, index_latent = x.detach(), query_latent.detach()
        index_keys = self.indexer.keys(index_input, cos, sin)  # [B, S, di]
        latent, k_rope, index_keys = self.latents(x, cos, sin, documents, index_keys)
        if cache is not None:
            index_keys = cache.extend_index(index_keys)
        k, v = self.keys_values(latent, k_rope, q.shape[1])
        self.track(q, k, self.softmax_scale, cache, documents)
        k, v, cache_mask = (k, v, None) if cache is None else cache.extend(k, v)
        learns = self.training and cache is None
        selects = not self.dense_warmup and k.shape[2] > self.indexer.topk
        scores = visible = selected = None
        if learns or selects:
            scores = self.indexer.scores(index_input, index_latent, cos, sin, index_keys)  # [B, Sq, K]
            visible = visible_keys(q.shape[2], k.shape[2], start, documents, x.device)
        if selects:
            selected = self.indexer.select(scores, visible)
        out = attend(q, k, v, self.softmax_scale, start, cache_mask=cache_mask, documents=documents,
                     selected=selected)
        out = self.output(out)
        if learns:
            keys = visible if selected is None else visible & selected
            loss = indexer_loss(scores, self.attention_probabilities(q, k, keys), keys)
            self.last_indexer_loss = loss.detach()
            out = attach_loss(out, loss, self.indexer_loss_scale)
        return out

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
        """Training FLOPs of one token's scores and values: latent attention's over min(k, S) keys (the selected
        ones), and the indexer's q·k over all S keys in each of its heads (forward and backward: its loss
        trains it)."""
        keys = min(model.index_topk, model.seq_len)
        main = 6.0 * model.n_heads * LatentAttention.score_width(model) * keys
        return main + 6.0 * model.index_n_heads * model.index_head_dim * model.seq_len

    @staticmethod
    def forward_sums(model: ModelConfig) -> tuple[tuple[str, int], ...]:
        """Under tp, the indexer's target over every key, summed over the ranks' heads (``head_sum``)."""
        return (("indexer target", model.seq_len),)

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
        output [T, K] (compute dtype), the target [T, K] (fp32) and the loss itself. The indexer's inputs are the
        block input and the query latent, saved already, but under bf16 autocast (fp32 weights) ``wk`` and
        ``head_weights`` each save their own cast of the block input [T, D] (measured); under FSDP's bf16 weights
        the LayerNorm's mean and rstd are bf16. The main attention's probabilities are made without gradient, and
        saved by nothing."""
        t, keys, heads, width = mb.tokens, mb.positions * mb.cp, model.index_n_heads, model.index_head_dim
        selects = keys > model.index_topk
        total = latent_saved_bytes(model, tp, mb, training_kernel(model, mb, selected=selects))
        statistics = mb.compute if mb.bf16_weights else FP32  # k_norm's mean and rstd: its weights' dtype
        total += (t * width + t * heads * width) * mb.compute + 2 * t * statistics
        if mb.cp > 1 and not mb.bf16:  # the keys, a view of the gathered latents, keep that whole storage
            total += mb.sequences * keys * (model.kv_lora_rank + model.qk_rope_head_dim + width) * FP32
        else:  # the keys, or their bf16 copy for the matmul
            total += mb.sequences * keys * width * mb.compute
        total += (t * heads * keys + t * heads) * mb.compute
        total += (mb.sequences if selects else 1) * mb.positions * keys
        if mb.bf16 and not mb.bf16_weights:  # autocast's casts of the block input for wk and head_weights
            total += linear_input_bytes(mb, model.d_model, 2)
        return total + t * keys * (mb.compute + FP32) + FP32
