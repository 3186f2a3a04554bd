"""Which positions of a sequence a context-parallel rank holds: the load-balanced cut of causal attention.

Under context parallelism (``parallel.cp``, ``parallel/context.py``) each of cp ranks holds 1/cp of every sequence.
Cut into cp contiguous slices, causal attention would give the last rank cp times the scores of the first (a query
sees the keys before it). Cut into 2·cp chunks, rank r holding chunk r and chunk 2·cp - 1 - r, every rank holds
one early and one late chunk and computes the same number of scores: the load balancing of Megatron-Core's
context parallelism and of torchtitan's. With cp = 2 and 8 positions: rank 0 holds 0 1 6 7, rank 1 holds 2 3 4 5.

Keys and values reach every rank by an all-gather over the cp ranks (``parallel.context.SequenceGather``), which
concatenates the ranks' slices in rank order: the gathered keys' positions are ``key_positions``. Where a mask is
needed (packed documents, sliding windows, attention sinks) it is built from the positions themselves
(``moe.documents.documents_of``); whole sequences under the plain causal mask take ``causal_attention``, which
needs none.

Plain PyTorch, no process groups: the one rule both the model and the training loop cut by.
Shapes: B sequences, S positions of the whole sequence, S / cp on a rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class SequenceShards:
    """Rank ``rank`` of ``cp`` context-parallel ranks: its positions of a sequence, and its slice of a batch."""

    cp: int
    rank: int

    def positions(self, seq: int, device: torch.device | str | None = None) -> Tensor:
        """The positions this rank holds of a sequence of ``seq`` (the whole sequence), ascending: [S / cp]."""
        return self._positions(self.rank, seq, device)

    def key_positions(self, seq: int, device: torch.device | str | None = None) -> Tensor:
        """The positions of the keys gathered from every rank, in the gather's rank order: [S]."""
        return torch.cat([self._positions(rank, seq, device) for rank in range(self.cp)])

    def shard(self, batch: Tensor) -> Tensor:
        """This rank's positions of a batch [B, S, ...] -> [B, S / cp, ...] (tokens, targets, document ids)."""
        return batch.index_select(1, self.positions(batch.shape[1], batch.device))

    def causal_attention(self, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """Causal attention of this rank's queries over every rank's keys, without a mask over the whole sequence.

        q [B, h, S / cp, d]: this rank's two chunks; k and v [B, hkv, S, d] as gathered (rank order). The keys are
        put in position order, and each chunk of queries attends to the keys up to its own end under the lower-right
        corner of a causal mask, where a chunk's last query sees every key: a [C, end] mask for that call alone
        (C = S / (2·cp)), not a [S / cp, S] one that every layer keeps. So a rank computes each chunk's visible
        scores and its own chunk's triangle, about half what a whole-sequence mask makes SDPA compute (with cp = 4,
        (2·cp + 1) / (4·cp) = 56%). The first rank's front chunk is the square causal case, with no mask at all.
        (``torch.nn.attention.bias.causal_lower_right`` would let a GPU's flash kernel skip the mask too, but it
        cannot be made inside activation checkpointing's recomputation on torch 2.13.) Rows of a chunk are whole
        rows of one process's attention, so the result is one process's, to rounding.
        """
        seq = k.shape[-2]
        chunk = seq // (2 * self.cp)
        order = torch.argsort(self.key_positions(seq, k.device))
        k, v = k.index_select(-2, order), v.index_select(-2, order)
        outs = []
        for index, start in enumerate((self.rank * chunk, (2 * self.cp - 1 - self.rank) * chunk)):
            end = start + chunk
            mask = None if end == chunk else torch.ones(chunk, end, dtype=torch.bool, device=q.device).tril(start)
            outs.append(F.scaled_dot_product_attention(
                q[..., index * chunk:(index + 1) * chunk, :], k[..., :end, :], v[..., :end, :], attn_mask=mask,
                is_causal=mask is None, scale=scale, enable_gqa=q.shape[1] != k.shape[1]))
        return torch.cat(outs, dim=-2)

    def _positions(self, rank: int, seq: int, device) -> Tensor:
        if seq % (2 * self.cp):
            raise ValueError(f"a sequence of {seq} positions does not split into 2 x cp = {2 * self.cp} equal chunks")
        chunk = seq // (2 * self.cp)
        front = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
        back = torch.arange((2 * self.cp - 1 - rank) * chunk, (2 * self.cp - rank) * chunk, device=device)
        return torch.cat((front, back))
