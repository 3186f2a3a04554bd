"""One optimizer step: its micro-batches' forward and backward under one ``StepContext``, the interval's sums
(``IntervalStats``), and evaluation on the validation batches.

``train_step`` runs one global batch's share on this rank as micro-batches with gradient accumulation, clips the
global gradient norm and steps the optimizer (its callers: ``training/loop.py``, the benchmarks, the tests that
time or count a step). What every step shares (model, optimizer, groups, precision context, QK-clip) is one
``StepContext``, built once per run.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from config.run import RunConfig
from data.sampler import eval_batches
from moe.documents import document_ids
from moe.layer import RoutingStats
from moe.sequence_shards import SequenceShards
from moe.transformer import MoETransformer
from parallel import clip_grad_norm_, set_gradient_sync, sum_partial_gradients
from parallel.pipeline import PipelineModel
from parallel.replication import imbalance
from parallel.tensor import lm_loss, loss_context
from training.indexer_stages import drop_frozen_gradients, indexer_loss
from training.qk_clip import QKClip
from training.routing_stats import IntervalRouting, RoutingAccumulator, routing_metrics


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce over ``group``; the identity when there is no group (one data-parallel rank)."""
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


@dataclass
class IntervalStats:
    """Sums over the steps since the last log line; reset after each log."""

    steps: int = 0
    tokens: int = 0
    lm_loss: float = 0.0
    mtp_loss: torch.Tensor | None = None  # multi-token prediction's mean module loss, summed over the steps
    indexer_loss: torch.Tensor | None = None  # sparse attention's mean indexer loss, summed over the steps
    started: float = field(default_factory=time.perf_counter)
    routing: RoutingAccumulator = field(default_factory=RoutingAccumulator)
    routing_result: IntervalRouting | None = None  # set by record(): the interval's routing, for RoutingLog
    # a mixture's per-source LM loss: source -> (sum of its rows' mean losses, rows), on the device until record()
    source_loss: dict[int, list] = field(default_factory=dict)
    # under ``parallel.ep_replicas``: each MoE layer's and micro-batch's rows per ep rank (this rank's ep group and
    # pipeline stage; under pp each step's last micro-batch), without and with the replicas, host integers
    ep_loads: list[tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)

    def add_source_loss(self, source: int, row_loss_sum: torch.Tensor, rows: int) -> None:
        entry = self.source_loss.setdefault(source, [0.0, 0])
        entry[0] = entry[0] + row_loss_sum
        entry[1] += rows

    def add_routing(self, stats: dict[int, RoutingStats]) -> None:
        """Accumulate one micro-batch's routing statistics (``model.routing_stats()`` after it ran; no host sync)."""
        self.routing.add(stats)

    def record(self, dp_group: dist.ProcessGroup | None = None, pp_group: dist.ProcessGroup | None = None,
               biases: dict[int, torch.Tensor] | None = None,
               source_names: list[str] | None = None) -> dict[str, float | list[float]]:
        """Interval means: losses per step, routing over the interval's tokens, router load as fractions.

        Routing figures are gathered over the pipeline stages (each holds some layers) and summed
        over the data-parallel ranks, so they describe the whole model on the global batch (a
        collective: every rank must call this).
        """
        elapsed = time.perf_counter() - self.started
        self.routing_result = self.routing.reduce(dp_group, pp_group, biases)
        mtp = {} if self.mtp_loss is None else {"train/mtp_loss": float(self.mtp_loss) / self.steps}
        indexer = {} if self.indexer_loss is None else {"train/indexer_loss": float(self.indexer_loss) / self.steps}
        return {
            "train/loss": self.lm_loss / self.steps,
            "train/lm_loss": self.lm_loss / self.steps,
            **mtp,
            **indexer,
            "perf/tokens_per_s": self.tokens / elapsed,
            **routing_metrics(self.routing_result),
            **self._source_losses(source_names, dp_group),
            **self._ep_imbalance(),
        }

    def _ep_imbalance(self) -> dict[str, float]:
        """``ep/imbalance_before`` and ``_after``: the busiest ep rank's rows over the mean, without and with the
        replicas, averaged over the interval's layers and micro-batches (this rank's ep group)."""
        if not self.ep_loads:
            return {}
        before, after = (sum(imbalance(loads[n]) for loads in self.ep_loads) / len(self.ep_loads) for n in (0, 1))
        return {"ep/imbalance_before": before, "ep/imbalance_after": after}

    def _source_losses(self, names: list[str] | None, dp_group: dist.ProcessGroup | None) -> dict[str, float]:
        """``train/loss/<source>``: each source's mean LM loss over its rows of the interval, all ranks' rows."""
        if not names:
            return {}
        totals = torch.zeros(2, len(names), dtype=torch.float64)
        for source, (loss_sum, rows) in self.source_loss.items():
            totals[0, source] += float(loss_sum)
            totals[1, source] += rows
        all_reduce(totals, dp_group)
        return {f"train/loss/{name}": float(totals[0, i] / totals[1, i])
                for i, name in enumerate(names) if totals[1, i] > 0}


def batch_documents(tokens: torch.Tensor, end_id: int | None) -> torch.Tensor | None:
    """The document ids of a batch [B, S] under ``data.document_mask`` (``end_id``: the token ending each
    document, ``data.tokenizer.document_end_token``); None without it."""
    return None if end_id is None else document_ids(tokens, end_id)


def shard_batch(inputs: torch.Tensor, targets: torch.Tensor, end_id: int | None,
                shards: SequenceShards | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(inputs, targets, document ids) as this rank's model takes them: under context parallelism its positions of
    each sequence, with the whole sequences' document ids (attention masks every position's keys by them)."""
    documents = batch_documents(inputs, end_id)
    if shards is None:
        return inputs, targets, documents
    return shards.shard(inputs), shards.shard(targets), documents


@torch.no_grad()
def evaluate(model: MoETransformer | PipelineModel, val_tokens, config: RunConfig, micro: int, autocast,
             dp_rank: int = 0, dp_size: int = 1, dp_group: dist.ProcessGroup | None = None,
             mixture: bool = True, end_id: int | None = None, shards: SequenceShards | None = None) -> float:
    """Mean LM loss over the fixed validation set: ``train.eval_batches`` global batches.

    Each global batch (``train.global_batch_size`` sequences) is split over the data-parallel ranks
    and run in micro-batches, as in training, so every layout evaluates the same sequences. ``val_tokens`` is the
    split's tail, each source's of a mixture (drawn by weight), or a named validation set (``mixture=False``).
    ``end_id``: documents masked as in training. ``dp_group``: every rank holding other tokens (dp × cp); under
    context parallelism (``shards``) each evaluates its positions, and the mean of their means is the sequences'.
    """
    model.eval()
    device = next(model.parameters()).device
    micro_batches = ((inputs[m:m + micro].to(device), targets[m:m + micro].to(device))
                     for inputs, targets in eval_batches(val_tokens, config.model.seq_len,
                                                         config.train.global_batch_size, config.train.eval_batches,
                                                         dp_rank, dp_size, [c.weight for c in config.data.corpora()]
                                                         if config.data.sources and mixture else None)
                     for m in range(0, inputs.shape[0], micro))
    chunks = [shard_batch(x, y, end_id, shards) for x, y in micro_batches]
    if isinstance(model, PipelineModel):  # forward only, through the pipeline schedule
        total = model.eval_losses(chunks).sum()
    else:
        total = torch.zeros((), dtype=torch.float64)
        for inputs, targets, documents in chunks:
            with autocast(), loss_context(config.parallel.vocab_parallel):
                total += lm_loss(model(inputs, documents=documents), targets).double().cpu()
    model.train()
    ranks = dist.get_world_size(dp_group) if dp_group is not None else 1
    return float(all_reduce(total, dp_group)) / (len(chunks) * ranks)


@dataclass(frozen=True)
class StepContext:
    """What stays the same across a run's optimizer steps, for ``train_step`` (beside each step's batch).

    ``micro``: sequences per micro-batch. ``grad_clip``: the bound on the global gradient norm (0: none).
    ``autocast``: the forward's precision context (``torch.autocast`` to bf16, or a null context).
    ``dp_group``: every rank holding other tokens of the step (dp × cp, as the gradients' reduction), over which the
    losses and the balancing load are reduced; ``pp_group``: the pipeline stages, for the gradient norm.
    ``vocab_parallel``: the model's logits are sharded over the vocabulary (``parallel/tensor.py``).
    ``grad_reduce``: gradients reduced over the data-parallel ranks once per step (``step``: on the last
    micro-batch) or per micro-batch (``microbatch``); ``parallel.set_gradient_sync`` sets FSDP for each.
    ``end_id``: the token ending each document, when ``data.document_mask`` masks them from each other.
    ``shards``: this rank's positions of each sequence under context parallelism.
    ``qk_clip``: QK-clip after the optimizer step (``train.qk_clip_threshold``).
    ``sparse_layers``: the model's layers with an indexer (this rank's), found once: their stage and indexer loss.
    """

    model: MoETransformer | PipelineModel
    optimizer: torch.optim.Optimizer
    micro: int
    grad_clip: float
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    dp_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None
    vocab_parallel: bool = False
    grad_reduce: str = "step"
    end_id: int | None = None
    shards: SequenceShards | None = None
    qk_clip: QKClip | None = None
    sparse_layers: list = field(default_factory=list)


def train_step(context: StepContext, inputs: torch.Tensor, targets: torch.Tensor, interval: IntervalStats,
               sources: np.ndarray | None = None, indexer_warmup: bool = False) -> tuple[float, float]:
    """One optimizer step over this rank's batch in micro-batches; returns (global mean LM loss, gradient norm).

    The step is skipped (no update) when the loss or gradient norm is not finite, so
    bad values never reach the weights; every rank sees the same reduced values and so
    takes the same decision. The caller decides what to do about it. QK-clip (``context.qk_clip``) then clips
    the heads that fired if the step was taken, and forgets the step's logits either way.

    ``sources`` (a mixture's source of each row, from ``TokenSampler.last_sources``): each source's loss over its
    rows is added to ``interval`` too, computed again from the same logits with no gradient (plain logits only: a
    vocabulary- or sequence-sharded DTensor, and the pipeline schedule, report the overall loss alone).

    ``indexer_warmup``: the step is sparse attention's dense warm-up (``training/indexer_stages.py``): only the
    indexers learn, so no balancing-bias update and no QK-clip either.
    """
    model, dp_group = context.model, context.dp_group
    step_loss, routing, step_mtp, step_indexer = _forward_backward(context, inputs, targets, interval, sources)
    if indexer_warmup:
        drop_frozen_gradients(model, context.sparse_layers)
    step_load = {}
    for stats in routing:
        interval.add_routing(stats)
        for i, layer_stats in stats.items():
            step_load[i] = step_load.get(i, 0) + layer_stats.tokens_per_expert
    sum_partial_gradients(model.parameters())  # once, before the norm and the optimizer read them
    copies = model.copies() if isinstance(model, PipelineModel) else []
    grad_norm = clip_grad_norm_(model.parameters(), context.grad_clip if context.grad_clip > 0 else math.inf,
                                pp_group=context.pp_group, copies=copies)
    dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
    step_loss = float(all_reduce(step_loss, dp_group)) / dp_size
    if step_mtp is not None:  # over the data-parallel ranks, as the LM loss
        step_mtp = all_reduce(step_mtp, dp_group) / dp_size
        interval.mtp_loss = step_mtp if interval.mtp_loss is None else interval.mtp_loss + step_mtp
    if step_indexer is not None:
        step_indexer = all_reduce(step_indexer, dp_group) / dp_size
        interval.indexer_loss = step_indexer if interval.indexer_loss is None else interval.indexer_loss + step_indexer
    grad_norm = float(grad_norm)
    stepped = math.isfinite(step_loss) and math.isfinite(grad_norm)
    if stepped:
        context.optimizer.step()
        # aux-loss-free balancing from the whole step's load over all data-parallel ranks: one all-reduce,
        # and none when no layer uses it
        biased = {i: layer for i, layer in model.moe_layers().items()
                  if layer.router.bias_update_rate > 0 and not indexer_warmup}
        if biased:
            loads = all_reduce(torch.stack([step_load[i] for i in biased]), dp_group)
            for load, layer in zip(loads, biased.values(), strict=True):
                layer.router.update_bias(load)
    if context.qk_clip is not None:
        context.qk_clip.after_step(stepped and not indexer_warmup)
    context.optimizer.zero_grad(set_to_none=True)
    return step_loss, grad_norm


def _forward_backward(context: StepContext, inputs: torch.Tensor, targets: torch.Tensor, interval: IntervalStats,
                      sources: np.ndarray | None) -> tuple[torch.Tensor, list, torch.Tensor | None,
                                                           torch.Tensor | None]:
    """Forward and backward of this rank's batch, gradients accumulated: (its mean LM loss, each micro-batch's
    routing statistics, multi-token prediction's mean module loss or None, sparse attention's mean indexer loss or
    None), before any reduction over ranks."""
    model, micro, end_id, shards = context.model, context.micro, context.end_id, context.shards
    device = next(model.parameters()).device
    accumulation = inputs.shape[0] // micro
    step_loss, routing = torch.zeros((), dtype=torch.float64), []
    step_mtp = step_indexer = None  # multi-token prediction's, the indexers' mean losses over the micro-batches
    if isinstance(model, PipelineModel):  # the schedule runs the micro-batches; loss from the last stage
        x, y, documents = shard_batch(inputs.to(device), targets.to(device), end_id, shards)
        step_loss, routing = model.step(x, y, context.grad_reduce, documents)
        interval.ep_loads += _ep_loads(model)  # the schedule's last micro-batch's: each layer keeps its latest plan
        return step_loss, routing, model.last_mtp_loss, model.last_indexer_loss
    for m in range(accumulation):
        x, y, documents = shard_batch(inputs[m * micro:(m + 1) * micro].to(device),
                                      targets[m * micro:(m + 1) * micro].to(device), end_id, shards)
        set_gradient_sync(model, context.grad_reduce, last=m == accumulation - 1)
        with loss_context(context.vocab_parallel):
            with context.autocast():
                logits = model(x, documents=documents)
                loss = lm_loss(logits, y)
                if sources is not None and not isinstance(logits, DTensor):
                    _add_source_losses(interval, logits, y, sources[m * micro:(m + 1) * micro])
            (loss / accumulation).backward()
        step_loss += loss.detach().double().cpu() / accumulation
        routing.append(model.routing_stats())
        interval.ep_loads += _ep_loads(model)
        if model.last_mtp_losses is not None:  # logged apart from the LM loss
            mtp = model.last_mtp_losses.mean().detach().double() / accumulation
            step_mtp = mtp if step_mtp is None else step_mtp + mtp
        if (layers_loss := indexer_loss(context.sparse_layers)) is not None:
            layers_loss = layers_loss.double() / accumulation
            step_indexer = layers_loss if step_indexer is None else step_indexer + layers_loss
    return step_loss, routing, step_mtp, step_indexer


def _ep_loads(model) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Under ``parallel.ep_replicas``: each of this rank's MoE layers' rows per ep rank in its latest forward, without
    and with the replicas (``ExpertParallelExperts.last_plan``)."""
    return [(plan.loads_before, plan.loads_after) for layer in model.moe_layers().values()
            if (plan := getattr(layer.experts, "last_plan", None)) is not None]


@torch.no_grad()
def _add_source_losses(interval: IntervalStats, logits: torch.Tensor, targets: torch.Tensor,
                       sources: np.ndarray) -> None:
    """Each source's summed row losses of one micro-batch (every row has seq_len tokens, so row means weigh
    alike), kept on the device: no host sync until the interval is recorded."""
    for source in np.unique(sources):
        rows = torch.from_numpy(np.flatnonzero(sources == source)).to(logits.device)
        loss = lm_loss(logits.index_select(0, rows), targets.index_select(0, rows))
        interval.add_source_loss(int(source), loss.detach().double() * len(rows), len(rows))
