"""Context parallelism: each of cp ranks holds 1/cp of every sequence, and attention gathers the keys and values.

Long sequences make attention's activations, and the activations of every layer, grow with the sequence on each
rank. Under ``parallel.cp`` the training loop hands each rank its positions of every sequence
(``moe.sequence_shards.SequenceShards.shard``: two chunks, one from each end, so that causal attention's work is
even), and the model computes everything per token on those alone: embeddings, norms, projections, experts, head
and loss. Attention is the one place where tokens meet. Of the published ways to let a rank's queries see the
whole sequence's keys, this module takes the all-gather of keys and values (Llama 3's context parallelism, Dubey et
al. 2024, arXiv:2407.21783, sec. 3.3.2): every rank gathers the keys and values of all cp ranks, in one
collective per layer, and attends: whole sequences chunk by chunk over the keys up to each chunk's end
(``SequenceShards.causal_attention``, about half the scores of a mask over the whole sequence), packed documents,
windows and sinks under a mask built from positions.

Why the all-gather rather than a ring or Ulysses' all-to-all over heads: with grouped-query attention the gathered
key/value heads are a fraction of the query heads (what would cross a ring is the same bytes in cp - 1 steps, with
an online softmax to merge); with latent attention it gathers the compressed latent and the shared rotary key,
c + r numbers per token (``moe/attention/latent.py``), far fewer than any scheme that moves per-head keys; document
masks, sliding windows and attention sinks need nothing beyond the mask each rank already builds; and Ulysses needs
the heads to divide by cp (times tp), which GQA's few key/value heads and an attention sink's per-head logit
often do not. The price is memory: one layer's whole-sequence keys and values live on each rank while the layer
runs (and for backward, unless recomputed), which is small beside the activations cp divides.

Everything else stays what one process computes: the positions give RoPE its angles and the mask its rows; each
rank's loss is the mean over its tokens, and FSDP averages gradients over dp_shard × cp (all slices hold the same
number of tokens, so the mean of their means is the sequence's mean); the balancing loss counts each expert's
assignments over the whole sequence (``reduce_counts``: a sum over the cp ranks before the loss, so the sequence-
wise loss of DeepSeek-V3 stays per sequence); routing statistics are summed over dp × cp.

Not served yet, and refused before any work (``check_context_parallel``): capacity-limited routing (the capacity
and the drop order are a whole micro-batch's), multi-token prediction (its modules shift the sequence), and
generation (one process). QK-clip takes each head's largest logit over the rank's queries and every rank's
gathered keys, at their positions (``moe.max_logits``), then the maximum over dp × cp.
"""

from __future__ import annotations

import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn

from config.errors import ConfigError
from config.run import RunConfig
from moe.sequence_shards import SequenceShards
from moe.transformer import MoETransformer


class SequenceGather(nn.Module):
    """All-gather over the context-parallel ranks along the sequence dim (-2): [..., S / cp, C] -> [..., S, C].

    The ranks' slices come in rank order (``SequenceShards.key_positions``). Its backward sums each gathered
    position's gradient from every rank and hands each rank its own slice's: a reduce-scatter, by autograd
    (torch's functional collective).
    """

    def __init__(self, group: dist.ProcessGroup):
        super().__init__()
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        gathered = funcol.all_gather_single_autograd(x.movedim(-2, 0).contiguous(), 0, self.group)
        return gathered.movedim(0, -2)


def apply_context_parallel(model: MoETransformer, group: dist.ProcessGroup, rank: int, cp: int) -> None:
    """Make ``model`` (or a pipeline stage of it) a context-parallel rank's: it takes that rank's positions of
    each sequence, gathers keys and values over ``group`` in every attention layer, and counts the balancing loss's
    assignments over the whole sequence."""
    model.sequence_shards = SequenceShards(cp, rank)
    for block in model.blocks():
        block.attn.gather_sequence = SequenceGather(group)
    for layer in model.moe_layers().values():
        layer.reduce_counts = lambda counts, group=group: _sum_over(counts, group)


def _sum_over(counts: Tensor, group: dist.ProcessGroup) -> Tensor:
    """The assignment counts of the whole sequence: this rank's plus the other cp ranks' (counts carry no
    gradient: they are a scatter of ones)."""
    total = counts.clone()
    dist.all_reduce(total, group=group)
    return total


def sequence_shards(cp: int, rank: int) -> SequenceShards | None:
    """This rank's cut of each sequence (its coordinate on the cp axis), or None without context parallelism."""
    return SequenceShards(cp, rank) if cp > 1 else None


def check_context_parallel(config: RunConfig, cp: int) -> None:
    """Refuse, before any work, what context parallelism does not serve yet (``parallel.cp`` > 1)."""
    if cp == 1:
        return
    refused = []
    if config.moe.capacity_factor is not None and config.model.n_moe_layers:
        refused.append((f"moe.capacity_factor={config.moe.capacity_factor}", "the capacity and the order of drops are "
                        "a whole micro-batch's, which no rank holds; set moe.capacity_factor=null (dropless)"))
    if config.model.mtp_depth:
        refused.append((f"model.mtp_depth={config.model.mtp_depth}", "the prediction modules shift the whole "
                        "sequence; set model.mtp_depth=0"))
    if refused:
        raise ConfigError(f"parallel.cp={cp} with " + "; and with ".join(f"{key}: {why}" for key, why in refused))

