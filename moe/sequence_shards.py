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
needs none (``moe.attention.kernel.choose_kernel``).

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

    def chunks(self) -> tuple[int, int]:
        """The indices of this rank's two chunks among the sequence's 2·cp: its front one, then its back one."""
        return self.rank, 2 * self.cp - 1 - self.rank

    def sequence_order(self) -> list[int]:
        """For each of the sequence's 2·cp chunks in order, where it lies among the pieces an all-gather of every
        rank's two chunks delivers (rank r's front chunk is piece 2r, its back chunk 2r + 1)."""
        return [2 * j for j in range(self.cp)] + [2 * (2 * self.cp - 1 - j) + 1 for j in range(self.cp, 2 * self.cp)]

    def shard(self, batch: Tensor) -> Tensor:
        """This rank's positions of a batch [B, S, ...] -> [B, S / cp, ...] (tokens, targets, document ids)."""
        return batch.index_select(1, self.positions(batch.shape[1], batch.device))

    def causal_attention(self, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """Causal attention of this rank's queries over every rank's keys, without a mask over the whole sequence.

        q [B, h, S / cp, d]: this rank's two chunks; k and v [B, hkv, S, d] as gathered (rank order). The keys are
        put in position order, and each chunk of queries (C = S / (2·cp) of them, from position ``start``) attends
        to the keys up to its own end: every key before the chunk, and the chunk's own keys causally. On CPU the two
        parts are two flash-attention calls merged by their log-sum-exps (``_ChunkAttention``): exactly the scores
        the causal mask keeps, and no mask at all. Elsewhere (no such kernel is exposed with its log-sum-exp for
        the GPU's flash attention here) one SDPA call per chunk under the lower-right corner of a causal mask, a
        [C, end] mask for that call alone. The first rank's front chunk is the square causal case either way. Rows
        of a chunk are whole rows of one process's attention, so the result is one process's, to rounding.
        """
        seq = k.shape[-2]
        chunk = seq // (2 * self.cp)
        order = torch.argsort(self.key_positions(seq, k.device))
        k, v = k.index_select(-2, order), v.index_select(-2, order)
        outs = []
        for index, start in enumerate((self.rank * chunk, (2 * self.cp - 1 - self.rank) * chunk)):
            end, queries = start + chunk, q[..., index * chunk:(index + 1) * chunk, :]
            if q.device.type == "cpu":
                outs.append(_ChunkAttention.apply(queries, k[..., :end, :], v[..., :end, :], start, scale))
                continue
            mask = None if start == 0 else torch.ones(chunk, end, dtype=torch.bool, device=q.device).tril(start)
            outs.append(F.scaled_dot_product_attention(queries, k[..., :end, :], v[..., :end, :], attn_mask=mask,
                                                       is_causal=mask is None, scale=scale,
                                                       enable_gqa=q.shape[1] != k.shape[1]))
        return torch.cat(outs, dim=-2)

    def _positions(self, rank: int, seq: int, device) -> Tensor:
        if seq % (2 * self.cp):
            raise ValueError(f"a sequence of {seq} positions does not split into 2 x cp = {2 * self.cp} equal chunks")
        chunk = seq // (2 * self.cp)
        front = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
        back = torch.arange((2 * self.cp - 1 - rank) * chunk, (2 * self.cp - rank) * chunk, device=device)
        return torch.cat((front, back))


_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _ChunkAttention(torch.autograd.Function):
    """A chunk of C queries at positions start .. start + C - 1 over the keys 0 .. start + C - 1, causally, as two
    flash-attention calls (CPU): the keys before the chunk, all visible, and the chunk's own, causal (a square).

    The two outputs are merged by their log-sum-exps l1, l2 [B, h, C]: l = log(e^l1 + e^l2), out = o1·e^(l1 - l) +
    o2·e^(l2 - l), which is the softmax over all the keys (Milakov and Gimelshein 2018, "Online normalizer
    calculation for softmax"; the merge of ring attention). Backward calls each part's flash backward with the
    merged output and log-sum-exp: a part's probabilities are then exp(score - l), the true ones, and the
    softmax's correction term rowsum(dO·O) is the merged output's, so each part's gradients are exactly its share
    (the ring-attention backward). Saved: q, k, v, the output and l, as SDPA saves them; no mask.
    q [B, h, C, d]; k, v [B, hkv, start + C, d] (grouped-query heads as they are: the kernel takes them).
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, start: int, scale: float) -> Tensor:
        if start == 0:
            out, lse = _flash(q, k, v, 0.0, True, scale=scale)
        else:
            before, before_lse = _flash(q, k[..., :start, :], v[..., :start, :], 0.0, False, scale=scale)
            own, own_lse = _flash(q, k[..., start:, :], v[..., start:, :], 0.0, True, scale=scale)
            lse = torch.logaddexp(before_lse, own_lse)
            out = (before.float() * (before_lse - lse).exp().unsqueeze(-1)
                   + own.float() * (own_lse - lse).exp().unsqueeze(-1)).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.start, ctx.scale = start, scale
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        start, scale, grad = ctx.start, ctx.scale, grad.contiguous()
        if start == 0:
            return (*_flash_backward(grad, q, k, v, out, lse, 0.0, True, scale=scale), None, None)
        dq, dk_before, dv_before = _flash_backward(grad, q, k[..., :start, :], v[..., :start, :], out, lse, 0.0,
                                                   False, scale=scale)
        dq_own, dk_own, dv_own = _flash_backward(grad, q, k[..., start:, :], v[..., start:, :], out, lse, 0.0, True,
                                                 scale=scale)
        return (dq + dq_own, torch.cat((dk_before, dk_own), dim=-2), torch.cat((dv_before, dv_own), dim=-2),
                None, None)
