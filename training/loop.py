"""One training run: data, model, optimizer, the step loop, validation, metrics and progress.

``train(config, run_dir)`` is what ``train.py`` calls. Per optimizer step it takes one
global batch (``train.global_batch_size`` sequences), runs it as micro-batches with
gradient accumulation, clips the global gradient norm, steps the optimizer (AdamW or Muon),
nudges the aux-loss-free balancing biases and, with ``train.qk_clip_threshold``, applies
QK-clip. ``train_step`` takes what the steps share as one ``StepContext``. Metrics are
averaged over each logging interval.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import yaml
from torch.distributed.tensor import DTensor

from config.errors import ConfigError, DivergedError
from config.run import RunConfig
from data.cache import load_tokens
from data.sampler import TokenSampler, eval_batches, split_tokens
from data.tokenizer import document_end_token
from moe.accounting import parameter_counts, training_flops_per_token
from moe.documents import document_ids
from moe.layer import RoutingStats
from moe.sequence_shards import SequenceShards
from moe.transformer import MoETransformer
from parallel import clip_grad_norm_, set_gradient_sync
from parallel.build import build_model
from parallel.context import sequence_shards
from parallel.groups import ParallelGroups
from parallel.hardware import PrecisionChoice, choose_precision, memory_per_rank
from parallel.materialize import InitialWeights
from parallel.pipeline import PipelineModel
from parallel.resolve import ResolvedLayout, micro_batching
from parallel.runtime import Runtime
from parallel.tensor import lm_loss, loss_context
from storage.files import write_text_atomic
from training.banner import describe_sources, finished_run_note, plan_lines
from training.checkpointing import Checkpointer
from training.metrics import MetricsLogger
from training.optim import build_optimizer, learning_rate
from training.progress import Progress
from training.qk_clip import QKClip
from training.resume import checkpoint_root
from training.routing_log import RoutingLog
from training.routing_stats import IntervalRouting, RoutingAccumulator, balancing_biases, routing_metrics
from training.run_dir import first_failure_verdict, hold_run_dir, rank0_verdict
from training.run_plots import write_run_plots


class NonFiniteLossError(DivergedError):
    """The loss or gradient norm became NaN/inf; training stops rather than corrupt the weights."""


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
    started: float = field(default_factory=time.perf_counter)
    routing: RoutingAccumulator = field(default_factory=RoutingAccumulator)
    routing_result: IntervalRouting | None = None  # set by record(): the interval's routing, for RoutingLog
    # a mixture's per-source LM loss: source -> (sum of its rows' mean losses, rows), on the device until record()
    source_loss: dict[int, list] = field(default_factory=dict)

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
        return {
            "train/loss": self.lm_loss / self.steps,
            "train/lm_loss": self.lm_loss / self.steps,
            **mtp,
            "perf/tokens_per_s": self.tokens / elapsed,
            **routing_metrics(self.routing_result),
            **self._source_losses(source_names, dp_group),
        }

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


def train_step(context: StepContext, inputs: torch.Tensor, targets: torch.Tensor, interval: IntervalStats,
               sources: np.ndarray | None = None) -> tuple[float, float]:
    """One optimizer step over this rank's batch in micro-batches; returns (global mean LM loss, gradient norm).

    The step is skipped (no update) when the loss or gradient norm is not finite, so
    bad values never reach the weights; every rank sees the same reduced values and so
    takes the same decision. The caller decides what to do about it. QK-clip (``context.qk_clip``) then clips
    the heads that fired if the step was taken, and forgets the step's logits either way.

    ``sources`` (a mixture's source of each row, from ``TokenSampler.last_sources``): each source's loss over its
    rows is added to ``interval`` too, computed again from the same logits with no gradient (plain logits only: a
    vocabulary- or sequence-sharded DTensor, and the pipeline schedule, report the overall loss alone).
    """
    model, dp_group = context.model, context.dp_group
    step_loss, routing, step_mtp = _forward_backward(context, inputs, targets, interval, sources)
    step_load = {}
    for stats in routing:
        interval.add_routing(stats)
        for i, layer_stats in stats.items():
            step_load[i] = step_load.get(i, 0) + layer_stats.tokens_per_expert
    copies = model.copies() if isinstance(model, PipelineModel) else []
    grad_norm = clip_grad_norm_(model.parameters(), context.grad_clip if context.grad_clip > 0 else math.inf,
                                pp_group=context.pp_group, copies=copies)
    dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
    step_loss = float(all_reduce(step_loss, dp_group)) / dp_size
    if step_mtp is not None:  # over the data-parallel ranks, as the LM loss
        step_mtp = all_reduce(step_mtp, dp_group) / dp_size
        interval.mtp_loss = step_mtp if interval.mtp_loss is None else interval.mtp_loss + step_mtp
    grad_norm = float(grad_norm)
    stepped = math.isfinite(step_loss) and math.isfinite(grad_norm)
    if stepped:
        context.optimizer.step()
        # aux-loss-free balancing from the whole step's load over all data-parallel ranks: one all-reduce,
        # and none when no layer uses it
        biased = {i: layer for i, layer in model.moe_layers().items() if layer.router.bias_update_rate > 0}
        if biased:
            loads = all_reduce(torch.stack([step_load[i] for i in biased]), dp_group)
            for load, layer in zip(loads, biased.values(), strict=True):
                layer.router.update_bias(load)
    if context.qk_clip is not None:
        context.qk_clip.after_step(stepped)
    context.optimizer.zero_grad(set_to_none=True)
    return step_loss, grad_norm


def _forward_backward(context: StepContext, inputs: torch.Tensor, targets: torch.Tensor, interval: IntervalStats,
                      sources: np.ndarray | None) -> tuple[torch.Tensor, list, torch.Tensor | None]:
    """Forward and backward of this rank's batch, gradients accumulated: (its mean LM loss, each micro-batch's
    routing statistics, multi-token prediction's mean module loss or None), before any reduction over ranks."""
    model, micro, end_id, shards = context.model, context.micro, context.end_id, context.shards
    device = next(model.parameters()).device
    accumulation = inputs.shape[0] // micro
    step_loss, routing = torch.zeros((), dtype=torch.float64), []
    step_mtp = None  # multi-token prediction's mean module loss over this rank's micro-batches
    if isinstance(model, PipelineModel):  # the schedule runs the micro-batches; loss from the last stage
        x, y, documents = shard_batch(inputs.to(device), targets.to(device), end_id, shards)
        step_loss, routing = model.step(x, y, context.grad_reduce, documents)
        return step_loss, routing, model.last_mtp_loss
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
        if model.last_mtp_losses is not None:  # logged apart from the LM loss
            mtp = model.last_mtp_losses.mean().detach().double() / accumulation
            step_mtp = mtp if step_mtp is None else step_mtp + mtp
    return step_loss, routing, step_mtp


@torch.no_grad()
def _add_source_losses(interval: IntervalStats, logits: torch.Tensor, targets: torch.Tensor,
                       sources: np.ndarray) -> None:
    """Each source's summed row losses of one micro-batch (every row has seq_len tokens, so row means weigh
    alike), kept on the device: no host sync until the interval is recorded."""
    for source in np.unique(sources):
        rows = torch.from_numpy(np.flatnonzero(sources == source)).to(logits.device)
        loss = lm_loss(logits.index_select(0, rows), targets.index_select(0, rows))
        interval.add_source_loss(int(source), loss.detach().double() * len(rows), len(rows))


@dataclass
class RunResult:
    summary: dict[str, float]
    model: MoETransformer | PipelineModel  # the trained model, parallelized as it was trained (this rank's stages)
    optimizer: torch.optim.Optimizer | None = None  # its optimizer, with the state a checkpoint would hold


def train(config: RunConfig, run_dir: Path, runtime: Runtime, groups: ParallelGroups, resume: str = "auto",
          init_weights: InitialWeights | None = None, resolved: ResolvedLayout | None = None,
          precision: PrecisionChoice | None = None, memory_predicted: list[int] | None = None) -> RunResult:
    """Train ``config`` in ``run_dir`` under ``groups``' layout, resuming as ``resume`` says (``Checkpointer``)
    or starting from ``init_weights``. ``memory_predicted``: the memory model's bytes per rank of each pipeline
    stage, reported beside the measured peak. The run holds ``run_dir`` while it lives (``training/run_dir.py``: a
    second run there is refused, and a new run never mixes with an old one).

    ``resolved`` (the layout with its batch split) and ``precision`` are what ``train.py`` resolved once at
    start and checked the memory with; a caller without them (the tests, with groups of any layout) has them
    resolved here by the same rules, for ``groups``' layout.
    """
    layout = groups.layout
    resolved = resolved or ResolvedLayout(layout, *micro_batching(config, layout.dp, layout.pp))
    precision = precision or choose_precision(config.train.precision, runtime.device)
    with hold_run_dir(run_dir, runtime, checkpoint_root(config, run_dir), resume, config.checkpoint.enabled):
        return _train(config, run_dir, runtime, groups, resume, init_weights, resolved, precision, memory_predicted)


def _train(config: RunConfig, run_dir: Path, runtime: Runtime, groups: ParallelGroups, resume: str,
           init_weights: InitialWeights | None, resolved: ResolvedLayout, precision: PrecisionChoice,
           memory_predicted: list[int] | None) -> RunResult:
    """The run ``train`` holds ``run_dir`` for, in order:

    - set-up: the data is read and checked before the model exists (``_load_data``: one rank's message for a fault
      every rank meets); the model is built and parallelized with its optimizer and QK-clip (``_step_context``).
      ``train.optimizer`` is AdamW (decoupled weight decay on matrices only) or Muon (``training/muon.py``:
      momentum orthogonalised by a Newton–Schulz iteration for the hidden matrices, each routed expert's one
      expert at a time, a sharded matrix gathered whole for it once per step; AdamW for the embeddings, output
      head, router, norms and biases, in the same optimizer, so a checkpoint holds all its state).
      ``train.qk_clip_threshold`` adds QK-clip (``training/qk_clip.py``, Kimi K2's MuonClip): the attention
      modules record each head's largest logit in training forwards, under either optimizer.
    - resume: ``Checkpointer.restore`` loads the latest checkpoint (model, optimizer, sampler) or the initial
      weights; a run already finished says what would go on and returns at once.
    - the logs: rank 0 writes the resolved config and opens the metrics (``_open_logger``); the banner says what runs.
    - each step (``_Run.step``): the learning rate of the warmup + cosine schedule on every parameter group
      (Muon's and AdamW's alike), one global batch through ``train_step`` (micro-batches with gradient
      accumulation, the global gradient norm clipped, the optimizer step, the aux-loss-free balancing biases
      nudged, then QK-clip: the heads whose largest logit of the step, max-reduced over the data-parallel ranks,
      exceeded the threshold have their query and key weights scaled down to it, if the step was taken); a
      non-finite step is skipped and too many in a row stop the run (``NonFiniteLossError``); interval means are
      logged (with QK-clip's heads clipped and largest logit), validation runs every ``train.eval_interval``
      steps, and the checkpoint policy saves.
    - the end (``_Run.finish``): the final validation, the final save (only if its loss is finite), the summary,
      plots and the progress's last lines.
    """
    dp_rank, dp_size = groups.coords()["dp"], groups.layout.dp  # the sampler's: ranks drawing other sequences
    data = _load_data(config, runtime, dp_rank, dp_size)
    torch.manual_seed(config.train.seed)  # the generator that router jitter draws from
    before_model = memory_per_rank(runtime.device, peak=False)  # the process without the model: interpreter, data
    context = _step_context(config, groups, runtime.device, resolved, precision, data.end_id)
    checkpoints = Checkpointer(config, run_dir, runtime, groups, resume, init_weights)
    first_step = checkpoints.restore(context.model, context.optimizer, data.sampler) + 1
    if first_step > config.train.steps:  # the same command again after the run finished: say what would go on
        checkpoints.say(finished_run_note(config, run_dir, checkpoints.root, first_step - 1))
        return RunResult({"steps": first_step - 1, "trained_steps": 0}, context.model, context.optimizer)
    logger = _open_logger(config, run_dir, runtime, first_step)
    run = _Run(config, run_dir, runtime, precision, context, data, checkpoints, logger, dp_rank, dp_size)
    run.announce(resolved, first_step)
    run.loop(first_step)
    return run.finish(before_model, memory_predicted)


@dataclass
class _RunData:
    """The run's data, read and checked before the model exists."""

    sampler: TokenSampler
    val_tokens: np.ndarray | list[np.ndarray]  # the split's tail, or each source's of a mixture
    named_val: dict[str, np.ndarray]  # data.validation: whole corpora, evaluated beside the split as val/<name>
    end_id: int | None  # the token ending each document under data.document_mask, else None


def _load_data(config: RunConfig, runtime: Runtime, dp_rank: int, dp_size: int) -> _RunData:
    """Read the data and check it: token ids against the vocabulary, both splits against seq_len (the validation
    split would otherwise fail only at the first evaluation). Every rank meets the same data: one says what is
    wrong with it (``first_failure_verdict``, a collective)."""
    data, failure = None, None
    try:
        data = _read_data(config, dp_rank, dp_size)
    except ValueError as exc:
        failure = exc
    first_failure_verdict(runtime, failure)
    return data


def _read_data(config: RunConfig, dp_rank: int, dp_size: int) -> _RunData:
    corpora = config.data.corpora()
    end_id = (document_end_token(config.data.tokenizer, config.data.document_end, config.model.vocab_size)
              if config.data.document_mask else None)
    splits = [split_tokens(load_tokens(c.path, config.data.cache_dir, config.model.vocab_size,
                                       config.data.tokenizer, c.text_key, config.data.skip, c.token_dtype,
                                       config.data.document_end, config.data.workers),
                           config.data.val_fraction, config.model.seq_len) for c in corpora]
    if config.data.sources:  # a mixture: each source's own split, drawn by weight
        train_tokens, val_tokens = [train for train, _ in splits], [val for _, val in splits]
        sampler = TokenSampler(train_tokens, config.model.seq_len, config.train.seed, dp_rank, dp_size,
                               weights=[c.weight for c in corpora], names=[c.name for c in corpora])
    else:
        train_tokens, val_tokens = splits[0]
        sampler = TokenSampler(train_tokens, config.model.seq_len, config.train.seed, dp_rank, dp_size)
    named_val = {}
    for v in config.data.validation_sets():
        named_val[v.name] = load_tokens(v.path, config.data.cache_dir, config.model.vocab_size,
                                        config.data.tokenizer, v.text_key, config.data.skip, v.token_dtype,
                                        config.data.document_end, config.data.workers)
        eval_batches(named_val[v.name], config.model.seq_len, config.train.global_batch_size,
                     config.train.eval_batches, dp_rank, dp_size)  # its size checked now, not at the first eval
    return _RunData(sampler, val_tokens, named_val, end_id)


def _step_context(config: RunConfig, groups: ParallelGroups, device: torch.device, resolved: ResolvedLayout,
                  precision: PrecisionChoice, end_id: int | None) -> StepContext:
    """Build the model (parallelized, this rank's part), its optimizer and QK-clip: what every step shares."""
    # the ranks holding other tokens of a step (dp × cp), over which the losses and the routing are reduced
    dp_group = groups.group("dp_cp") if groups.layout.dp_cp > 1 else None
    shards = sequence_shards(groups.layout.cp, groups.coords()["cp"])
    pp_group = groups.group("pp") if groups.layout.pp > 1 else None
    micro, accumulation = resolved.micro_batch_size, resolved.microbatches
    autocast = lambda: (torch.autocast(device.type, dtype=torch.bfloat16)  # noqa: E731
                        if precision.precision == "bf16" else contextlib.nullcontext())
    model = build_model(config, groups, device, micro, accumulation, autocast,
                        param_dtype=torch.bfloat16 if precision.precision == "bf16" else None)
    model.set_aux_loss_scale(1.0 / accumulation)
    optimizer = build_optimizer(model, config.train)
    qk_clip = None if config.train.qk_clip_threshold is None else QKClip(model, config.train.qk_clip_threshold, groups)
    return StepContext(model, optimizer, micro, config.train.grad_clip, autocast, dp_group, pp_group,
                       config.parallel.vocab_parallel, config.parallel.grad_reduce, end_id, shards, qk_clip)


def _open_logger(config: RunConfig, run_dir: Path, runtime: Runtime, first_step: int) -> MetricsLogger:
    """Rank 0 writes the run's files (``hold_run_dir`` made ``run_dir``): the resolved config and the metrics'
    destinations; the others learn if it failed (``rank0_verdict``) and log nowhere."""
    resolved = config.to_dict()
    logger, error = None, None
    if runtime.is_main:
        try:
            write_text_atomic(run_dir / "config.yaml", yaml.safe_dump(resolved, sort_keys=False))
            logger = MetricsLogger(run_dir, resolved, config.name, config.logging.wandb,
                                   config.logging.wandb_project, tensorboard=config.logging.tensorboard,
                                   purge_step=first_step if first_step > 1 else None)
        except ConfigError as exc:  # wandb could not start
            error = exc
    rank0_verdict(runtime, error)
    return logger or MetricsLogger(run_dir, resolved, config.name, config.logging.wandb,
                                   config.logging.wandb_project, enabled=False)


class _Run:
    """A run's step loop and its end, once the model is built and restored and the logs are open."""

    def __init__(self, config: RunConfig, run_dir: Path, runtime: Runtime, precision: PrecisionChoice,
                 context: StepContext, data: _RunData, checkpoints: Checkpointer, logger: MetricsLogger,
                 dp_rank: int, dp_size: int):
        self.config, self.run_dir, self.runtime, self.precision = config, run_dir, runtime, precision
        self.context, self.data, self.checkpoints, self.logger = context, data, checkpoints, logger
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.routing_log = RoutingLog(run_dir, logger, config.logging.router_charts_every)
        checkpoints.log_metrics = logger.log
        self.say = (lambda text: print(text, file=sys.stderr)) if runtime.is_main else (lambda text: None)
        self.flops_per_token = training_flops_per_token(config.model, config.moe)
        self.tokens_per_step = config.train.global_batch_size * config.model.seq_len
        self.summary: dict[str, float] = {}
        self.total_tokens = 0

    def announce(self, resolved: ResolvedLayout, first_step: int) -> None:
        """The start-up banner: the model, the data and batch, the precision, the plan (rank 0's stderr)."""
        config, say, sampler, model = self.config, self.say, self.data.sampler, self.context.model
        counts = parameter_counts(config.model, config.moe)
        say(f"run '{config.name}' in {self.run_dir}: {counts.total / 1e6:.2f}M parameters, "
            f"{counts.active / 1e6:.2f}M active; {config.model.n_moe_layers} MoE layers of "
            f"{config.moe.num_experts} experts, top-{config.moe.top_k}")
        val_sizes = [len(v) for v in (self.data.val_tokens if sampler.mixture else [self.data.val_tokens])]
        say(f"data: {describe_sources(config, sampler)}, tokenizer {config.data.tokenizer} "
            f"({sum(map(len, sampler.sources)):,} train / {sum(val_sizes):,} val tokens); "
            f"batch {config.train.global_batch_size} x {config.model.seq_len} tokens = {self.dp_size} rank(s) x "
            f"{resolved.microbatches} micro-batch(es) of {resolved.micro_batch_size}")
        say(f"precision: {self.precision.precision} on {self.runtime.device} ({self.precision.reason})")
        for line in plan_lines(config, self.run_dir, first_step, self.checkpoints.plan(), self.logger.destinations):
            say(line)
        if isinstance(model, PipelineModel):
            say(model.describe())

    def loop(self, first_step: int) -> None:
        """Steps ``first_step`` to ``train.steps``, with the progress line and the clock of the run's throughput."""
        self.progress = Progress(self.config.train.steps, self.config.logging.progress, start_step=first_step - 1,
                                 stream=sys.stderr if self.runtime.is_main else open(os.devnull, "w"))  # noqa: SIM115
        self.interval, self.started = IntervalStats(), time.perf_counter()
        for step in range(first_step, self.config.train.steps + 1):
            self.step(step)

    def step(self, step: int) -> None:
        """One optimizer step, then what follows it: its interval's log, validation, the checkpoint policy."""
        config, context, sampler = self.config, self.context, self.data.sampler
        lr = learning_rate(step, config.train)
        for group in context.optimizer.param_groups:
            group["lr"] = lr
        inputs, targets = sampler.next_batch(config.train.global_batch_size)
        step_loss, grad_norm = train_step(context, inputs, targets, self.interval, sampler.last_sources)
        self._stop_if(self.checkpoints.check_finite(step, step_loss, grad_norm, context.model, context.optimizer,
                                                    sampler))
        self.interval.steps += 1
        self.interval.tokens += self.tokens_per_step
        self.interval.lm_loss += step_loss
        self.total_tokens += self.tokens_per_step
        self.progress.tick(step)
        if step % config.logging.log_interval == 0 or step == config.train.steps:
            self._log_interval(step, lr, grad_norm)
        if config.train.eval_interval and step % config.train.eval_interval == 0 and step != config.train.steps:
            val, named = self.validate()
            self.logger.log(step, {"val/loss": val, **named})
            self.progress.message(f"step {step}: val loss {val:.4f}"
                                  + "".join(f", {key[4:]} {value:.4f}" for key, value in named.items()))
        self.checkpoints.after_step(step, context.model, context.optimizer, sampler)

    def _log_interval(self, step: int, lr: float, grad_norm: float) -> None:
        """The interval's means (a collective), logged and shown; a new interval starts."""
        context, sampler = self.context, self.data.sampler
        record = self.interval.record(context.dp_group, context.pp_group, balancing_biases(context.model),
                                      sampler.names if sampler.mixture else None)
        record.update({"train/lr": lr, "train/grad_norm": grad_norm,
                       "perf/mfu": record["perf/tokens_per_s"] * self.flops_per_token / self.precision.peak_flops,
                       "perf/memory_peak_gib": max(memory_per_rank(self.runtime.device)) / 2**30,
                       **(context.qk_clip.metrics() if context.qk_clip is not None else {})})
        if sampler.mixture:  # the realised mixture: each source's share of the samples drawn so far
            record.update({f"data/share/{name}": count / sampler.samples_seen
                           for name, count in sampler.source_counts().items()})
        self.logger.log(step, record)
        self.routing_log.append(step, self.interval.routing_result, last=step == self.config.train.steps)
        self.progress.update(step, record)
        self.summary["train/loss"] = record["train/loss"]
        self.interval = IntervalStats()

    def validate(self) -> tuple[float, dict[str, float]]:
        """The validation loss of the split, and ``val/<name>`` of each named validation set."""
        val = self._evaluate(self.data.val_tokens)
        return val, {f"val/{name}": self._evaluate(tokens, mixture=False)
                     for name, tokens in self.data.named_val.items()}

    def _evaluate(self, tokens, mixture: bool = True) -> float:
        context = self.context
        return evaluate(context.model, tokens, self.config, context.micro, context.autocast, self.dp_rank,
                        self.dp_size, context.dp_group, mixture=mixture, end_id=context.end_id, shards=context.shards)

    def _stop_if(self, stop: str | None) -> None:
        """End the run on the checkpoint policy's verdict (its message), the logs closed first."""
        if stop:
            self.logger.close()
            raise NonFiniteLossError(stop)

    def finish(self, before_model: list[int], memory_predicted: list[int] | None) -> RunResult:
        """The final validation and save, the summary (logged and shown), the plots; the trained model."""
        config, context, logger = self.config, self.context, self.logger
        val, named = self.validate()
        logger.log(config.train.steps, {"val/loss": val, **named})
        self._stop_if(self.checkpoints.finish(config.train.steps, context.model, context.optimizer,
                                              self.data.sampler, val))  # saved only if val is finite
        elapsed = time.perf_counter() - self.started
        peaks = [peak / 2**30 for peak in memory_per_rank(self.runtime.device)]
        summary = self.summary
        summary.update({"val/loss": val, **named, "perf/tokens_per_s": self.total_tokens / elapsed, "time_s": elapsed,
                        "steps": config.train.steps, "precision": self.precision.precision,
                        "perf/memory_peak_gib": max(peaks), "perf/memory_peak_gib_per_rank": peaks,
                        "perf/memory_before_model_gib_per_rank": [held / 2**30 for held in before_model]})
        if memory_predicted:
            summary["perf/memory_predicted_gib"] = max(memory_predicted) / 2**30
        logger.summary(summary)
        files: dict[str, Path] = {**logger.destinations, **({"checkpoints": self.checkpoints.root}
                                                             if self.checkpoints.policy.enabled else {})}
        logger.close()
        if self.runtime.is_main and config.logging.plots:
            plots = write_run_plots(self.run_dir, config.name)
            if isinstance(plots, str):
                self.say(plots)
            else:
                files["plots"] = self.run_dir / "plots"
        self.progress.close(summary, files, self.run_dir)
        return RunResult(summary, context.model, context.optimizer)
