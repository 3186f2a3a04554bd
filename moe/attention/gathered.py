"""Attention over each query's own few keys, gathered: what sparse attention costs O(Sq·k) for, not O(Sq·K).

Sparse attention (``sparse_latent.py``) keeps k of the K keys each query may see. A dense kernel under a mask of
the kept keys still computes all K scores of every query; this one gathers each query's k keys and scores those
alone, one block of queries at a time, so time grows with Sq·k and memory with the block (``block_queries``):
the block's gathered keys [B, b, k, d] and scores [B, h, b, k], however long the sequence.

The keys are one head shared by every query head (multi-query attention), and the values are the keys' first dv
channels: multi-head latent attention in its absorbed form (DeepSeek-V2 sec. 2.1.3), where the keys are the
normalised latent and the shared rotary key, c + r channels, and the values the latent, c; DeepSeek's FlashMLA
sparse kernels take the same (one 576-channel key per position, its first 512 the value). Gathering one shared
head is nh times less than gathering every head's keys and values.

Backward is written out (``GatheredAttention``) as flash attention's is (Dao et al. 2022, FlashAttention, sec. 3.1:
recomputation): forward saves
the queries, keys, indices, output and each row's log-sum-exp, and backward recomputes each block's scores from
them, so no [Sq, k] probabilities outlive their block; the keys' gradient is scattered back by index.

Shapes: B sequences, h query heads, Sq queries, K keys, k keys per query (``indices``), d channels of the queries
and keys, dv of the values.
"""

from __future__ import annotations

import torch
from torch import Tensor

# the most elements of one block's gathered keys and scores together (32 MiB in fp32): the block of queries is cut
# to fit, so memory stays bounded whatever the sequence's length
BLOCK_ELEMENTS = 1 << 23


def block_queries(batch: int, heads: int, keys_per_query: int, width: int) -> int:
    """Queries per block: as many as keep the block's gathered keys [B, b, k, d] and scores [B, h, b, k] within
    ``BLOCK_ELEMENTS`` (at least one)."""
    return max(1, BLOCK_ELEMENTS // (batch * keys_per_query * (width + heads)))


def gathered_attention(q: Tensor, keys: Tensor, value_width: int, scale: float, indices: Tensor,
                       valid: Tensor) -> tuple[Tensor, Tensor]:
    """softmax(scale · q·kᵀ)·v over each query's gathered keys: q [B, h, Sq, d], ``keys`` [B, K, d] (one head for
    every query head; the values are their first ``value_width`` channels), ``indices`` [B, Sq, k] int64 (the keys
    of each query), ``valid`` [B, Sq, k] bool (those it may see; at least one per query) -> the output
    [B, h, Sq, dv] and, without gradient, the attention probabilities summed over the heads [B, Sq, k] fp32
    (sparse attention's indexer learns from them)."""
    return GatheredAttention.apply(q, keys, value_width, scale, indices, valid)


def _rows(indices: Tensor, keys: int) -> Tensor:
    """Each query's keys [B, Sq, k] as rows of the keys flattened to [B·K, d]."""
    return indices + torch.arange(indices.shape[0], device=indices.device)[:, None, None] * keys


def _gather(keys: Tensor, rows: Tensor) -> Tensor:
    """keys [B·K, d], rows [B, b, k] (``_rows``) -> the indexed keys [B, b, k, d] (``index_select``: whole rows
    copied, faster on CPU than ``gather``'s element by element)."""
    return keys.index_select(0, rows.reshape(-1)).view(*rows.shape, keys.shape[-1])


def _scores(q: Tensor, gathered: Tensor, valid: Tensor) -> Tensor:
    """A block's N = B·b queries [N, h, d] (scaled already) against their gathered keys [N, k, d]: the scores
    [N, h, k] in fp32, the invisible keys' -inf (a pass skipped where every key is visible, as past the first k
    queries of a causal sequence)."""
    scores = torch.bmm(q, gathered.transpose(1, 2)).float()
    if not bool(valid.all()):
        scores.masked_fill_(~valid.view(valid.shape[0], 1, -1), float("-inf"))
    return scores


class GatheredAttention(torch.autograd.Function):
    """``gathered_attention``'s forward and its hand-written backward, both block by block of queries. Inside,
    the queries come first ([B, Sq, h, ..]): each query's heads against its k keys is one small matmul of a
    batched one, and the scores [N, h, k] are contiguous for the softmax. Element-wise passes over the [N, h, k]
    scores cost as much as the matmuls on a CPU, so they are few: the scale rides on the queries, the softmax's
    normalisation on the output [N, h, dv], and the in-place ops reuse the scores' storage."""

    @staticmethod
    def forward(ctx, q: Tensor, keys: Tensor, value_width: int, scale: float, indices: Tensor,
                valid: Tensor) -> tuple[Tensor, Tensor]:
        batch, heads, seq, width = q.shape
        count = indices.shape[-1]
        ctx.keys_dtype, keys = keys.dtype, keys.to(q.dtype)
        by_query = q.transpose(1, 2)  # [B, Sq, h, d]
        out = q.new_empty(batch, seq, heads, value_width)
        lse = torch.empty(batch, seq, heads, dtype=torch.float32, device=q.device)
        summed = torch.empty(batch, seq, count, dtype=torch.float32, device=q.device)
        step = block_queries(batch, heads, count, width)
        flat, rows = keys.reshape(-1, width), _rows(indices, keys.shape[1])
        for lo in range(0, seq, step):
            block = slice(lo, lo + step)
            gathered = _gather(flat, rows[:, block]).view(-1, count, width)  # [N, k, d]
            queries = by_query[:, block].reshape(-1, heads, width) * scale  # [N, h, d]
            scores = _scores(queries, gathered, valid[:, block].reshape(-1, count))
            peak = scores.amax(dim=-1, keepdim=True)  # [N, h, 1]
            weights = scores.sub_(peak).exp_()  # unnormalised probabilities
            total = weights.sum(dim=-1, keepdim=True)  # [N, h, 1]
            lse[:, block] = (peak + total.log()).view(batch, -1, heads)
            normaliser = total.reciprocal()
            summed[:, block] = torch.bmm(normaliser.transpose(1, 2), weights).view(batch, -1, count)
            values = torch.bmm(weights.to(q.dtype), gathered[..., :value_width]) * normaliser.to(q.dtype)
            out[:, block] = values.view(batch, -1, heads, value_width)
        ctx.save_for_backward(q, keys, indices, valid, out, lse)
        ctx.scale, ctx.step = scale, step
        ctx.mark_non_differentiable(summed)
        return out.transpose(1, 2), summed

    @staticmethod
    def backward(ctx, grad_out: Tensor, _grad_summed: Tensor) -> tuple[Tensor | None, ...]:
        q, keys, indices, valid, out, lse = ctx.saved_tensors
        value_width, scale, step = out.shape[-1], ctx.scale, ctx.step
        batch, key_count, width = keys.shape
        heads, count = q.shape[1], indices.shape[-1]
        by_query, grad_by_query = q.transpose(1, 2), grad_out.to(q.dtype).transpose(1, 2)
        grad_q = q.new_empty(batch, q.shape[2], heads, width)
        grad_keys = torch.zeros(batch * key_count, width, dtype=torch.float32, device=q.device)
        flat, rows = keys.reshape(-1, width), _rows(indices, key_count)
        for lo in range(0, q.shape[2], step):
            block = slice(lo, lo + step)
            gathered = _gather(flat, rows[:, block]).view(-1, count, width)  # [N, k, d]
            queries = by_query[:, block].reshape(-1, heads, width) * scale  # [N, h, d]
            grad_block = grad_by_query[:, block].reshape(-1, heads, value_width)  # [N, h, dv]
            scores = _scores(queries, gathered, valid[:, block].reshape(-1, count))
            probabilities = scores.sub_(lse[:, block].reshape(-1, heads, 1)).exp_()  # [N, h, k]
            grad_p = torch.bmm(grad_block, gathered[..., :value_width].transpose(1, 2)).float()
            row_sums = (grad_block.float() * out[:, block].reshape(-1, heads, value_width).float()).sum(-1, True)
            grad_scores = grad_p.sub_(row_sums).mul_(probabilities).to(q.dtype)  # [N, h, k], before the scale
            grad_q[:, block] = (torch.bmm(grad_scores, gathered) * scale).view(batch, -1, heads, width)
            grad_gathered = torch.bmm(grad_scores.transpose(1, 2), queries).float()  # [N, k, d]
            grad_gathered[..., :value_width] += torch.bmm(probabilities.to(q.dtype).transpose(1, 2), grad_block)
            # summed into each key's row (index_put_'s accumulate: a third of index_add_'s time on CPU, measured)
            grad_keys.index_put_((rows[:, block].reshape(-1),), grad_gathered.view(-1, width), accumulate=True)
        return (grad_q.transpose(1, 2), grad_keys.view(batch, key_count, width).to(ctx.keys_dtype),
                None, None, None, None)
