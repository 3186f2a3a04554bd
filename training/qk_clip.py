"""QK-clip (Kimi K2's MuonClip): after an optimizer step, shrink the query and key weights of every attention head
whose largest logit went past a threshold.

Kimi K2 technical report (2025, sec. 2.1, "MuonClip"): Muon let attention logits grow until training diverged;
after each step, for each head h whose largest pre-softmax logit of the step ``S_max^h`` exceeds ``tau``, the head's
query and key weights are scaled so that the same inputs give ``S_max^h = tau``: ``gamma = tau / S_max^h``,
``W_q^h *= sqrt(gamma)``, ``W_k^h *= sqrt(gamma)``. It is a weight operation after the step, independent of how the
step was computed, so it applies under AdamW as under Muon (``train.qk_clip_threshold``, either optimizer): Kimi K2
needed it with Muon, but AdamW's logits can grow too, and the clip costs nothing where no head fires.

What is scaled, per attention kind (each kind states its tensors: ``AttentionKind.heads_to_clip``; each scaling
multiplies the head's logits by exactly gamma, so its largest logit on the step's inputs becomes tau; every other
head's weights stay bit for bit):
- multi-head attention (a key head per query head): the head's rows of ``wq`` and ``wk`` (and their biases,
  ``model.qkv_bias``: q = W x + b, so scaling both scales q) by sqrt(gamma), Kimi K2's split.
- grouped-query attention (a key head shared by g query heads): the query head's rows of ``wq`` by gamma, the shared
  key left alone. Scaling the key by the group's smallest sqrt(gamma) would shrink the logits of the group's other
  heads, clipped or not; scaling it by anything else leaves some query head needing a factor above 1. Query-only
  is the one split that brings every head to exactly tau and leaves the unclipped heads as they were.
- latent attention (``moe/attention/latent.py``), as Kimi K2 does for its MLA: the head-specific parts alone. The
  nope query and key channels (``wq``/``wq_b``'s and ``wkv_b``'s first n rows of the head) by sqrt(gamma), the
  head's rotary query channels by gamma, and the rotary key, one for all heads, left alone.
With ``model.qk_norm`` the per-head RMSNorm undoes any scaling of the weights, so the config refuses the two
together (``config/run.py``).

Under the parallel layouts. The largest logit of a head is max-reduced over the data-parallel ranks (FSDP's and
the replicas': they see other sequences), one all-reduce of every layer's heads per step, so every replica computes
the same gammas and applies the same scaling. Expert parallelism folds over those ranks and adds none. Under tensor
parallelism a rank records and scales its own heads (attention sees the whole sequence, with sequence parallelism
too), and a pipeline stage its own layers: no communication of weights. A weight may be a DTensor shard (tp's rows,
FSDP's rows of them): each rank scales its local rows by the gammas of the heads they belong to
(``parallel.materialize.locate`` gives the rows' place in the whole weight).

Cost: on a step of a run with the clip on, each attention forward computes its logits again under no gradient
(``moe/max_logits.py``: the [B, h, S, S] products, a chunk of queries at a time, which SDPA's fused kernels never
materialise), and one all-reduce of n_layers · heads floats follows the step; the query and key rows are then
multiplied, by exactly 1 for the heads that did not fire (one pass over those weights, and no host synchronisation
to learn which heads fired).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe.attention import AttentionKind
from moe.max_logits import LogitTracker
from parallel.groups import ParallelGroups
from parallel.materialize import locate


def head_rows(tensor: Tensor, exponents: Tensor, tp_rank: int, tp: int) -> tuple[Tensor, Tensor]:
    """For each row this rank holds of ``tensor`` (a weight or bias, possibly a DTensor shard: tp's rows, FSDP's
    rows of them): the index of its head among this rank's heads (the tp_rank-th 1/tp of them, as tensor
    parallelism splits every attention projection by heads) and its exponent of gamma, on the tensor's device."""
    place = locate(tensor)
    rows_per_head = len(exponents)
    heads_here = place.global_shape[0] // rows_per_head // tp
    rows = torch.arange(place.offset[0], place.offset[0] + place.local.shape[0])
    head = rows // rows_per_head - tp_rank * heads_here
    return head.to(place.local.device), exponents[rows % rows_per_head].to(place.local.device)


class QKClip:
    """QK-clip of every attention module of ``model`` (this rank's pipeline stages), at ``threshold``.

    Built once the model is parallelized: it gives each attention module a ``LogitTracker``, so training forwards
    record their heads' largest logits. ``after_step`` (every rank, after each step, taken or skipped) clips; the
    interval's figures are ``metrics``' (a collective at each log step).
    """

    def __init__(self, model: nn.Module, threshold: float, groups: ParallelGroups):
        self.threshold = threshold
        self.attentions = [m for m in model.modules() if isinstance(m, AttentionKind)]
        for attention in self.attentions:
            attention.logit_tracker = LogitTracker()
        # the ranks holding other queries of the same model: data-parallel replicas, and under context parallelism
        # the ranks holding the other positions of the same sequences
        self.dp_group = groups.group("dp_cp") if groups.layout.dp_cp > 1 else None
        self.dp_size = groups.layout.dp_cp
        tp_rank, tp = groups.coords()["tp"], groups.layout.tp
        # per attention module: each tensor to scale, its rows' heads and exponents (computed once)
        self.rows = [[(tensor, *head_rows(tensor, exponents, tp_rank, tp))
                      for tensor, exponents in attention.heads_to_clip()] for attention in self.attentions]
        device = next(model.parameters()).device
        self.clipped = torch.zeros((), dtype=torch.int64, device=device)  # head clips since the last metrics
        self.max_logit = torch.tensor(-math.inf, dtype=torch.float64, device=device)  # the largest S_max since then

    @torch.no_grad()
    def after_step(self, stepped: bool) -> None:
        """Clip the heads whose logits of this step exceeded the threshold, if the optimizer stepped; forget the
        step's logits either way (a skipped step's may be non-finite).

        No host synchronisation: every head's rows are multiplied, by exactly 1 where the head did not fire (which
        leaves them bit for bit), rather than asking the device which heads fired; the figures for ``metrics``
        stay on the device until a log step reads them. One pass over the query and key weights a step.
        """
        maxima = [attention.logit_tracker.take() for attention in self.attentions]
        if not stepped or not self.attentions:
            return
        if any(m is None for m in maxima):
            raise RuntimeError("QK-clip: an attention module recorded no logits this step (no training forward ran "
                               "through it)")
        flat = torch.cat(maxima)
        if self.dp_group is not None:  # every replica must scale alike: the max over all the step's queries
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=self.dp_group)
        fired = flat > self.threshold
        self.max_logit = torch.maximum(self.max_logit, flat.max().double())
        self.clipped = self.clipped + fired.sum()
        gammas = torch.where(fired, self.threshold / flat, 1.0)
        for rows, gamma in zip(self.rows, gammas.split([len(m) for m in maxima]), strict=True):
            for tensor, head, exponent in rows:
                local = locate(tensor).local
                local.mul_((gamma[head] ** exponent).to(local.dtype).view(-1, *[1] * (local.dim() - 1)))

    def metrics(self) -> dict[str, float]:
        """``qk_clip/heads_clipped`` (head clips over the interval's steps, all layers and heads) and
        ``qk_clip/max_logit`` (the largest logit seen before clipping; left out when no step was taken), over the
        whole model: the tp ranks' heads and the pipeline stages' layers (the data-parallel replicas agree
        already). Resets them."""
        counts, largest = self.clipped.double().reshape(1), self.max_logit.reshape(1).clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts)
            dist.all_reduce(largest, op=dist.ReduceOp.MAX)
            counts /= self.dp_size
        self.clipped, self.max_logit = torch.zeros_like(self.clipped), torch.full_like(self.max_logit, -math.inf)
        largest = {"qk_clip/max_logit": float(largest)} if math.isfinite(largest) else {}
        return {"qk_clip/heads_clipped": float(counts), **largest}
