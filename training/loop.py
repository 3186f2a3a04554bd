"""One training run: data, model, optimizer, the step loop, validation, metrics and progress.

``train(config, run_dir)`` is what ``train.py`` calls. Per optimizer step it takes one
global batch (``train.global_batch_size`` sequences), runs it as micro-batches with
gradient accumulation, clips the global gradient norm, steps the optimizer (AdamW or Muon),
nudges the aux-loss-free balancing biases and, with ``train.qk_clip_threshold``, applies
QK-clip (the step itself: ``training/step.py``). Metrics are averaged over each logging interval.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml

from config.errors import ConfigError, DivergedError
from config.run import RunConfig
from data.cache import load_tokens
from data.sampler import TokenSampler, eval_batches, split_tokens
from data.tokenizer import document_end_token
from moe.accounting import parameter_counts, training_flops_per_token
from moe.transformer import MoETransformer
from parallel.build import build_model
from parallel.context import sequence_shards
from parallel.groups import ParallelGroups
from parallel.hardware import PrecisionChoice, choose_precision, model_flops_utilization
from parallel.layout import Layout
from parallel.materialize import InitialWeights
from parallel.pipeline import PipelineModel
from parallel.resolve import ResolvedLayout, micro_batching
from parallel.runtime import Runtime
from storage.files import write_text_atomic
from training.banner import describe_sources, finished_run_note, layout_text, next_steps, plan_lines
from training.checkpointing import Checkpointer
from training.indexer_stages import (
    in_dense_warmup,
    set_indexer_stage,
    sparse_attention_layers,
    start_optimizer_state,
)
from training.live_memory import LiveTensorPeak, held_before_model
from training.metrics import MetricsLogger
from training.optim import build_optimizer, learning_rate
from training.progress import Progress
from training.qk_clip import QKClip
from training.resume import checkpoint_root
from training.routing_log import RoutingLog
from training.routing_stats import balancing_biases
from training.run_dir import first_failure_verdict, hold_run_dir, rank0_verdict
from training.run_plots import run_label, write_run_plots
from training.step import IntervalStats, StepContext, evaluate, train_step


class NonFiniteLossError(DivergedError):
    """The loss or gradient norm became NaN/inf; training stops rather than corrupt the weights."""


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
    # the process without the model: its data
    before_model = held_before_model(runtime.device, config.logging.memory_peak)
    context = _step_context(config, groups, runtime.device, resolved, precision, data.end_id)
    checkpoints = Checkpointer(config, run_dir, runtime, groups, resume, init_weights)
    first_step = checkpoints.restore(context.model, context.optimizer, data.sampler) + 1
    if first_step > config.train.steps:  # the same command again after the run finished: say what would go on
        checkpoints.say(finished_run_note(config, run_dir, checkpoints.root, first_step - 1))
        return RunResult({"steps": first_step - 1, "trained_steps": 0}, context.model, context.optimizer)
    logger = _open_logger(config, run_dir, runtime, first_step)
    run = _Run(config, run_dir, runtime, precision, context, data, checkpoints, logger, groups.layout, dp_rank)
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
                           config.data.val_fraction, config.model.seq_len,
                           f"data.sources[{c.name}] ({c.path})" if config.data.sources else None) for c in corpora]
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
        if len(named_val[v.name]) < config.model.seq_len + 1:  # used whole: no fraction to change
            raise ValueError(f"data.validation[{v.name}] ({v.path}) has {len(named_val[v.name]):,} tokens, fewer "
                             f"than model.seq_len + 1 = {config.model.seq_len + 1:,}; give a longer validation text, "
                             "or a smaller model.seq_len")
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
    if config.train.indexer_warmup_steps:  # every parameter's state in the checkpoints, the frozen ones' too
        start_optimizer_state(optimizer)
    qk_clip = None if config.train.qk_clip_threshold is None else QKClip(model, config.train.qk_clip_threshold, groups)
    return StepContext(model, optimizer, micro, config.train.grad_clip, autocast, dp_group, pp_group,
                       config.parallel.vocab_parallel, config.parallel.grad_reduce, end_id, shards, qk_clip,
                       sparse_attention_layers(model))


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
                 layout: Layout, dp_rank: int):
        self.config, self.run_dir, self.runtime, self.precision = config, run_dir, runtime, precision
        self.context, self.data, self.checkpoints, self.logger = context, data, checkpoints, logger
        self.layout, self.dp_rank, self.dp_size = layout, dp_rank, layout.dp
        self.routing_log = RoutingLog(run_dir, logger, config.logging.router_charts_every)
        checkpoints.log_metrics = logger.log
        self.say = (lambda text: print(text, file=sys.stderr)) if runtime.is_main else (lambda text: None)
        self.flops_per_token = training_flops_per_token(config.model, config.moe)
        self.tokens_per_step = config.train.global_batch_size * config.model.seq_len
        self.summary: dict[str, float] = {}
        self.total_tokens = 0
        # on a CPU, the live tensor peak of steps 1, 2, 4, 8, ... (unless logging.memory_peak is false)
        self.memory = LiveTensorPeak(runtime.device, config.logging.memory_peak)

    def announce(self, resolved: ResolvedLayout, first_step: int) -> None:
        """The start-up banner: the model, the data and batch, the precision, the plan (rank 0's stderr)."""
        config, say, sampler, model = self.config, self.say, self.data.sampler, self.context.model
        counts = parameter_counts(config.model, config.moe)
        say(f"run '{config.name}' in {self.run_dir}: {counts.total / 1e6:.2f}M parameters, "
            f"{counts.active / 1e6:.2f}M active; {config.model.n_moe_layers} MoE layers of "
            f"{config.moe.num_experts} experts, top-{config.moe.top_k}; optimizer {config.train.optimizer}")
        val_sizes = [len(v) for v in (self.data.val_tokens if sampler.mixture else [self.data.val_tokens])]
        say(f"data: {describe_sources(config, sampler)}, tokenizer {config.data.tokenizer} "
            f"({sum(map(len, sampler.sources)):,} train / {sum(val_sizes):,} val tokens); "
            f"batch {config.train.global_batch_size} x {config.model.seq_len} tokens = {self.dp_size} data-parallel "
            f"rank(s) x {resolved.microbatches} micro-batch(es) of {resolved.micro_batch_size}; "
            f"{layout_text(self.layout)}")
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
        warmup = in_dense_warmup(step, config.train.indexer_warmup_steps)
        set_indexer_stage(context.sparse_layers, warmup)
        with self.memory.measure():
            step_loss, grad_norm = train_step(context, inputs, targets, self.interval, sampler.last_sources, warmup)
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
                       "perf/mfu": model_flops_utilization(record["perf/tokens_per_s"], self.flops_per_token,
                                                           self.precision.peak_flops, self.runtime.world_size),
                       **self.memory.metrics(),
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
        summary = self.summary
        summary.update({"run": self.run_dir.name, "config": config.name, "optimizer": config.train.optimizer,
                        "layout": layout_text(self.layout), "val/loss": val, **named,
                        "perf/tokens_per_s": self.total_tokens / elapsed, "time_s": elapsed,
                        "steps": config.train.steps, "precision": self.precision.precision,
                        **self.memory.metrics(per_rank=True),
                        "perf/memory_before_model_gib_per_rank": [held / 2**30 for held in before_model]})
        if memory_predicted:
            summary["perf/memory_predicted_gib"] = max(memory_predicted) / 2**30
        logger.summary(summary)
        files: dict[str, Path] = {**logger.destinations, **({"checkpoints": self.checkpoints.root}
                                                             if self.checkpoints.policy.enabled else {})}
        logger.close()
        if self.runtime.is_main and config.logging.plots:
            plots = write_run_plots(self.run_dir, run_label(self.run_dir))
            if isinstance(plots, str):
                self.say(plots)
            else:
                files["plots"] = self.run_dir / "plots"
        self.progress.close(summary, files, self.run_dir)
        if self.checkpoints.policy.enabled:
            self.say("\n".join(next_steps(self.config, self.run_dir, self.checkpoints.root)))
        return RunResult(summary, context.model, context.optimizer)
