"""One training run: data, model, optimizer, the step loop, validation, metrics and progress.

``train(config, run_dir)`` is what ``train.py`` calls. Per optimizer step it takes one
global batch (``train.global_batch_size`` sequences), runs it as micro-batches with
gradient accumulation, clips the global gradient norm, steps AdamW, and nudges the
aux-loss-free balancing biases. Metrics are averaged over each logging interval.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

from moe.accounting import parameter_counts, training_flops_per_token
from moe.config import ConfigError
from moe.transformer import MoETransformer
from parallel.runtime import Runtime
from training.config import RunConfig
from training.data import TokenSampler, eval_batches, load_tokens, split_tokens
from training.hardware import choose_precision
from training.metrics import MetricsLogger
from training.optim import build_optimizer, learning_rate
from training.progress import Progress


class NonFiniteLossError(RuntimeError):
    """The loss or gradient norm became NaN/inf; training stops rather than corrupt the weights."""


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: logits [B, S, V], targets [B, S]."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@dataclass
class IntervalStats:
    """Sums over the steps since the last log line; reset after each log."""

    steps: int = 0
    tokens: int = 0
    lm_loss: float = 0.0
    aux_loss: float = 0.0
    z_loss: float = 0.0
    started: float = field(default_factory=time.perf_counter)
    load: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> assignments per expert
    dropped: dict[int, float] = field(default_factory=dict)
    assignments: dict[int, int] = field(default_factory=dict)
    entropy: dict[int, float] = field(default_factory=dict)
    micro_batches: int = 0

    def add_routing(self, model: MoETransformer) -> None:
        """Accumulate the routing statistics of the micro-batch that just ran."""
        stats = model.routing_stats()
        for i, s in stats.items():
            self.load[i] = self.load.get(i, 0) + s.tokens_per_expert.cpu()
            self.dropped[i] = self.dropped.get(i, 0.0) + float(s.num_dropped)
            self.assignments[i] = self.assignments.get(i, 0) + s.num_assignments
            self.entropy[i] = self.entropy.get(i, 0.0) + float(s.entropy)
        if stats:
            self.aux_loss += sum(float(s.aux_loss) for s in stats.values()) / len(stats)
            self.z_loss += sum(float(s.z_loss) for s in stats.values()) / len(stats)
        self.micro_batches += 1

    def record(self) -> dict[str, float | list[float]]:
        """Interval means: losses per step, routing per micro-batch, router load as fractions."""
        elapsed = time.perf_counter() - self.started
        out: dict[str, float | list[float]] = {
            "train/loss": self.lm_loss / self.steps,
            "train/lm_loss": self.lm_loss / self.steps,
            "train/aux_loss": self.aux_loss / max(1, self.micro_batches),
            "train/z_loss": self.z_loss / max(1, self.micro_batches),
            "perf/tokens_per_s": self.tokens / elapsed,
        }
        if self.load:
            out["train/dropped_frac"] = sum(self.dropped.values()) / sum(self.assignments.values())
        for i, load in self.load.items():
            fraction = load.double() / load.sum()
            out[f"router/layer{i}/load"] = fraction.tolist()
            out[f"router/layer{i}/imbalance"] = float(fraction.max() / fraction.mean())
            out[f"router/layer{i}/dropped"] = self.dropped[i] / self.assignments[i]
            out[f"router/layer{i}/entropy"] = self.entropy[i] / self.micro_batches
        return out


def micro_batching(config: RunConfig, dp_size: int) -> tuple[int, int]:
    """(micro-batch size, micro-batches per step) on one rank for the global batch."""
    global_batch = config.train.global_batch_size
    if global_batch % dp_size:
        raise ConfigError(f"train.global_batch_size={global_batch} must be divisible by the {dp_size} "
                          "data-parallel ranks")
    per_rank = global_batch // dp_size
    micro = config.train.micro_batch_size or per_rank
    if per_rank % micro:
        raise ConfigError(f"train.micro_batch_size={micro} must divide the per-rank batch {per_rank} "
                          f"(global {global_batch} / {dp_size} ranks)")
    return micro, per_rank // micro


@torch.no_grad()
def evaluate(model: MoETransformer, val_tokens, config: RunConfig, micro: int, autocast) -> float:
    """Mean LM loss over the fixed validation batches."""
    model.eval()
    losses = []
    for inputs, targets in eval_batches(val_tokens, config.model.seq_len, micro, config.train.eval_batches):
        with autocast():
            losses.append(lm_loss(model(inputs.to(next(model.parameters()).device)),
                                  targets.to(next(model.parameters()).device)).item())
    model.train()
    return sum(losses) / len(losses)


def train_step(model: MoETransformer, optimizer: torch.optim.Optimizer, inputs: torch.Tensor, targets: torch.Tensor,
               micro: int, grad_clip: float, autocast, interval: IntervalStats) -> tuple[float, float]:
    """One optimizer step over this rank's batch in micro-batches; returns (mean LM loss, gradient norm).

    The step is skipped (no update) when the loss or gradient norm is not finite, so
    bad values never reach the weights; the caller decides what to do about it.
    """
    device = next(model.parameters()).device
    accumulation = inputs.shape[0] // micro
    step_loss, step_load = 0.0, {}
    for m in range(accumulation):
        x = inputs[m * micro:(m + 1) * micro].to(device)
        y = targets[m * micro:(m + 1) * micro].to(device)
        with autocast():
            loss = lm_loss(model(x), y)
        (loss / accumulation).backward()
        step_loss += loss.item() / accumulation
        interval.add_routing(model)
        for i, stats in model.routing_stats().items():
            step_load[i] = step_load.get(i, 0) + stats.tokens_per_expert
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else math.inf))
    if math.isfinite(step_loss) and math.isfinite(grad_norm):
        optimizer.step()
        for i, layer in model.moe_layers().items():
            layer.router.update_bias(step_load[i])  # aux-loss-free balancing, from the whole step's load
    optimizer.zero_grad(set_to_none=True)
    return step_loss, grad_norm


def train(config: RunConfig, run_dir: Path, runtime: Runtime) -> dict[str, float]:
    """Train ``config`` in ``run_dir``; returns the final summary."""
    if runtime.world_size > 1:
        raise ConfigError(f"this version trains in one process; got a world of {runtime.world_size} ranks. "
                          "Run `python train.py` or `torchrun --nproc-per-node 1 train.py`")
    device = runtime.device
    micro, accumulation = micro_batching(config, dp_size=1)
    torch.manual_seed(config.train.seed)
    precision = choose_precision(config.train.precision, device)
    autocast = lambda: (torch.autocast(device.type, dtype=torch.bfloat16)  # noqa: E731
                        if precision.precision == "bf16" else contextlib.nullcontext())

    tokens = load_tokens(config.data.source, config.data.cache_dir)
    train_tokens, val_tokens = split_tokens(tokens, config.data.val_fraction)
    sampler = TokenSampler(train_tokens, config.model.seq_len, config.train.seed)

    model = MoETransformer(config.model, config.moe).to(device)
    model.set_aux_loss_scale(1.0 / accumulation)
    optimizer = build_optimizer(model, config.train)
    counts = parameter_counts(config.model, config.moe)
    flops_per_token = training_flops_per_token(config.model, config.moe)
    tokens_per_step = config.train.global_batch_size * config.model.seq_len

    run_dir.mkdir(parents=True, exist_ok=True)
    resolved = config.to_dict()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
    logger = MetricsLogger(run_dir, resolved, config.name, config.logging.wandb, config.logging.wandb_project,
                           enabled=runtime.is_main)
    say = (lambda text: print(text, file=sys.stderr)) if runtime.is_main else (lambda text: None)
    say(f"run '{config.name}' in {run_dir}: {counts.total / 1e6:.2f}M parameters, {counts.active / 1e6:.2f}M active; "
        f"{config.model.n_moe_layers} MoE layers of {config.moe.num_experts} experts, top-{config.moe.top_k}")
    say(f"data: {config.data.source} ({len(train_tokens):,} train / {len(val_tokens):,} val tokens); "
        f"batch {config.train.global_batch_size} x {config.model.seq_len} tokens, {accumulation} micro-batch(es)")
    say(f"precision: {precision.precision} on {device} ({precision.reason})")

    progress = Progress(config.train.steps, config.logging.progress)
    interval, start, total_tokens = IntervalStats(), time.perf_counter(), 0
    summary: dict[str, float] = {}
    for step in range(1, config.train.steps + 1):
        lr = learning_rate(step, config.train)
        for group in optimizer.param_groups:
            group["lr"] = lr
        inputs, targets = sampler.next_batch(config.train.global_batch_size)
        step_loss, grad_norm = train_step(model, optimizer, inputs, targets, micro, config.train.grad_clip,
                                          autocast, interval)
        if not (math.isfinite(step_loss) and math.isfinite(grad_norm)):
            logger.close()
            raise NonFiniteLossError(f"step {step}: loss {step_loss}, gradient norm {grad_norm}; stopping. "
                                     f"Try a lower train.lr (now {config.train.lr}) or train.grad_clip")

        interval.steps += 1
        interval.tokens += tokens_per_step
        interval.lm_loss += step_loss
        total_tokens += tokens_per_step
        progress.tick(step)
        if step % config.logging.log_interval == 0 or step == config.train.steps:
            record = interval.record()
            record.update({"train/lr": lr, "train/grad_norm": grad_norm,
                           "perf/mfu": record["perf/tokens_per_s"] * flops_per_token / precision.peak_flops})
            logger.log(step, record)
            progress.update(step, record)
            summary["train/loss"] = record["train/loss"]
            interval = IntervalStats()
        if config.train.eval_interval and step % config.train.eval_interval == 0 and step != config.train.steps:
            val = evaluate(model, val_tokens, config, micro, autocast)
            logger.log(step, {"val/loss": val})
            progress.message(f"step {step}: val loss {val:.4f}")

    val = evaluate(model, val_tokens, config, micro, autocast)
    logger.log(config.train.steps, {"val/loss": val})
    elapsed = time.perf_counter() - start
    summary.update({"val/loss": val, "perf/tokens_per_s": total_tokens / elapsed, "time_s": elapsed,
                    "steps": config.train.steps, "precision": precision.precision})
    logger.summary(summary)
    logger.close()
    progress.close(summary)
    return summary
