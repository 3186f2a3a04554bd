"""The lightning indexer's scores and its top-k selection, shared by the indexers that differ in their keys.

DeepSeek Sparse Attention's indexer (DeepSeek-V3.2 technical report, sec. 2, eq. 1) and DeepSeek-V4's (its report,
sec. 2.3.1) score a query t against a key s the same way: I(t, s) = sum_j w(t, j) · ReLU(q(t, j) · k(s)) over the
indexer's few heads j, the query heads q(t, j) projected from the attention's query latent (``wq``), one key k(s)
shared by the heads, a weight w(t, j) per head projected from the block input (``head_weights``), q·k scaled by
1/sqrt(index_head_dim) and w by 1/sqrt(index heads), in fp32. They differ in their keys: V3.2's is one per position
(``sparse_latent.LightningIndexer``), V4's one per compressed entry (``compressed.CompressedIndexer``), and in how
RoPE turns queries and keys. Each indexer makes ``wq``, ``head_weights`` and its keys; this base scores and selects.

Shapes: B sequences, Sq queries, K keys, D = d_model, hi/di the indexer's heads and width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


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
        return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, ranked, True).unsqueeze(1)
