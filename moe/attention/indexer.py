"""The lightning indexer's scores and its top-k selection, shared by the indexers that differ in their keys.

DeepSeek Sparse Attention's indexer (DeepSeek-V3.2 technical report, sec. 2, eq. 1) and DeepSeek-V4's (its report,
sec. 2.3.1) score a query t against a key s the same way: I(t, s) = sum_j w(t, j) · ReLU(q(t, j) · k(s)) over the
indexer's few heads j, the query heads q(t, j) projected from the attention's query latent (``wq``), one key k(s)
shared by the heads, a weight w(t, j) per head projected from the block input (``head_weights``), q·k scaled by
1/sqrt(index_head_dim) and w by 1/sqrt(index heads), in fp32. They differ in their keys: V3.2's is one per position
(``sparse_latent.LightningIndexer``), V4's one per compressed entry (``compressed.CompressedIndexer``), and in how
RoPE turns queries and keys. Each indexer makes ``wq``, ``head_weights`` and its keys; this base scores and selects.

Both are trained the same way (DeepSeek-V3.2 report, sec. 2.1.1; V4's report describes no other recipe for its
indexer, so V4's follows it over the compressed entries): ``indexer_loss`` is the KL between the main attention's
distribution, summed over its heads, and the indexer's, over the keys a query attends to, and a kind with an indexer
(``IndexedAttention``) attaches it to its output with the indexer's inputs detached, so that loss trains the indexer
alone. ``training/indexer_stages.py`` runs the dense warm-up and the sparse stage on every such kind.

Shapes: B sequences, Sq queries, K keys, D = d_model, hi/di the indexer's heads and width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe.losses import attach_loss


class IndexScoring(nn.Module):
    """The scoring (``weigh``) and selection (``select``) of an indexer that has ``wq`` (query latent -> hi·di),
    ``head_weights`` (D -> hi), ``heads``, ``head_dim`` and ``topk``."""

    wq: nn.Linear
    head_weights: nn.Linear
    heads: int
    head_dim: int
    topk: int

    def weigh(self, x: Tensor, q: Tensor, keys: Tensor) -> Tensor:
        """I(t, s) for queries q [B, Sq, hi, di] (rotated; x [B, Sq, D] their block input) against ``keys``
        [B, K, di] -> [B, Sq, K] fp32, before any mask. The heads ride beside the queries ([B, Sq·hi, di] against
        the one key per position, then [B, Sq, 1, hi] weights against [B, Sq, hi, K]): two batched matmuls that
        copy nothing."""
        batch, seq = q.shape[:2]
        q = q.float().reshape(batch, seq * self.heads, self.head_dim)
        logits = F.relu(q @ keys.float().transpose(1, 2) * self.head_dim ** -0.5)  # [B, Sq·hi, K]
        weights = self.head_weights(x).float() * self.heads ** -0.5  # [B, Sq, hi]
        return (weights.unsqueeze(-2) @ logits.view(batch, seq, self.heads, -1)).squeeze(-2)

    @torch.no_grad()
    def top_keys(self, scores: Tensor, visible: Tensor) -> tuple[Tensor, Tensor]:
        """The top-k keys by ``scores`` [B, Sq, K] among the ``visible`` ones ([Sq, K] or [B, 1, Sq, K] bool) ->
        their indices [B, Sq, k] int64 and which of them are visible [B, Sq, k] bool. A query that sees k keys or
        fewer keeps them all (the top k then include invisible ones, marked so)."""
        visible = visible.reshape(-1, *visible.shape[-2:]).expand_as(scores)  # [B, Sq, K]
        ranked = scores.masked_fill(~visible, float("-inf")).topk(min(self.topk, scores.shape[-1]), dim=-1).indices
        return ranked, visible.gather(-1, ranked)

    @torch.no_grad()
    def select(self, scores: Tensor, visible: Tensor) -> Tensor:
        """``top_keys`` as a mask [B, 1, Sq, K] bool (the invisible ones among them left for the kernel's mask of
        visible keys to drop)."""
        ranked, _ = self.top_keys(scores, visible)
        return selection_mask(ranked, scores.shape[-1])


def selection_mask(indices: Tensor, keys: int) -> Tensor:
    """The keys ``indices`` [B, Sq, k] picks, as a mask [B, 1, Sq, keys] bool."""
    chosen = torch.zeros(*indices.shape[:-1], keys, dtype=torch.bool, device=indices.device)
    return chosen.scatter_(-1, indices, True).unsqueeze(1)


def indexer_loss(scores: Tensor, attention: Tensor, keys: Tensor) -> Tensor:
    """The indexer's KL loss (DeepSeek-V3.2 report, eqs. 3 and 4): the mean over queries of
    KL(p(t, ·) || softmax(I(t, ·))) over each query's ``keys`` ([.., Sq, K] bool: every visible key in the dense
    warm-up, the selected ones in the sparse stage), where p is the main attention's probabilities ``attention``
    [B, Sq, K] summed over its heads and L1-normalised over the same keys (no gradient); a query with none of them
    (a V4 query before the first whole entry) adds 0. ``scores`` [B, Sq, K], taken to fp32: a bf16 log-softmax (CPU
    autocast keeps its input's dtype) rounds each log-probability by about 0.4%, more than the KL itself once the
    indexer is close (a logged loss below zero)."""
    scores = scores.float()
    hidden = ~keys.reshape(-1, *keys.shape[-2:])
    tiny = torch.finfo(torch.float32).tiny
    target = attention.masked_fill(hidden, 0.0)
    target = target / target.sum(dim=-1, keepdim=True).clamp_min(tiny)
    log_predicted = torch.log_softmax(scores.masked_fill(hidden, float("-inf")), dim=-1).masked_fill(hidden, 0.0)
    return (target * (target.clamp_min(tiny).log() - log_predicted)).sum(dim=-1).mean()


class IndexedAttention:
    """An attention kind whose ``indexer`` (None in a layer that shares another's selection) the trainer trains
    (``training.indexer_stages``): DeepSeek-V3.2's sparse latent attention, DeepSeek-V4's compressed sparse
    attention. The trainer sets ``dense_warmup`` (attention over every visible key while only the indexers learn)
    and ``indexer_loss_scale`` (its 1 / micro-batches, as the balancing losses'); a training forward records its
    indexer loss in ``last_indexer_loss`` and attaches it to the layer's output (``learn``)."""

    indexer: IndexScoring | None
    dense_warmup: bool = False
    indexer_loss_scale: float = 1.0
    last_indexer_loss: Tensor | None = None

    def learn(self, out: Tensor, loss: Tensor) -> Tensor:
        """The indexer's ``loss`` recorded and attached to ``out``, to reach backward (``moe.losses.attach_loss``)."""
        self.last_indexer_loss = loss.detach()
        return attach_loss(out, loss, self.indexer_loss_scale)
