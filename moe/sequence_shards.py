"""Which positions of a sequence a context-parallel rank holds: the load-balanced cut of causal attention.

Under context parallelism (``parallel.cp``, ``parallel/context.py``) each of cp ranks holds 1/cp of every sequence.
Cut into cp contiguous slices, causal attention would give the last rank cp times the scores of the first (a query
sees the keys before it). Cut into 2·cp chunks, rank r holding chunk r and chunk 2·cp - 1 - r, every rank holds
one early and one late chunk and computes the same number of scores: the load balancing of Megatron-Core's
context parallelism and of torchtitan's. With cp = 2 and 8 positions: rank 0 holds 0 1 6 7, rank 1 holds 2 3 4 5.

Keys and values reach every rank by an all-gather over the cp ranks (``parallel.context.SequenceGather``), which
concatenates the ranks' slices in rank order: the gathered keys' positions are ``key_positions``. Attention needs
no other reordering: the mask is built from the positions themselves (``moe.documents.documents_of``).

Plain PyTorch, no process groups: the one rule both the model and the training loop cut by.
Shapes: B sequences, S positions of the whole sequence, S / cp on a rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
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

    def _positions(self, rank: int, seq: int, device) -> Tensor:
        if seq % (2 * self.cp):
            raise ValueError(f"a sequence of {seq} positions does not split into 2 x cp = {2 * self.cp} equal chunks")
        chunk = seq // (2 * self.cp)
        front = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
        back = torch.arange((2 * self.cp - 1 - rank) * chunk, (2 * self.cp - rank) * chunk, device=device)
        return torch.cat((front, back))
