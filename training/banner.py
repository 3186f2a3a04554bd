"""What a run says about itself at its start (and when started again after it finished): the data it reads, the
steps, tokens and learning-rate schedule ahead, when it checkpoints and where its logs go. Said before the first
step so that a mistake in any of them costs seconds, not the run."""

from __future__ import annotations

import shlex
from pathlib import Path

from config.cli import shell_command
from config.run import RunConfig
from data.sampler import TokenSampler
from parallel.layout import Layout
from training.optim import schedule_summary, warmup_note
from training.run_plots import PLOTS_DIR


def describe_sources(config: RunConfig, sampler: TokenSampler) -> str:
    """The source, or each source of a mixture with its weight and the share the schedule realises for it."""
    if not sampler.mixture:
        return config.data.source
    total = sum(sampler.weights)
    return "mixture of " + ", ".join(
        f"{name} (weight {weight / total:.4f}, realised {share:.4f})"
        for name, weight, share in zip(sampler.names, sampler.weights, sampler.schedule.proportions, strict=True))


def layout_text(layout: Layout) -> str:
    """``1 rank``, or ``2 ranks: pp=1 dp_replicate=1 dp_shard=1 cp=2 tp=1 ep=1 etp=1``: every rank the run has
    (under context or tensor parallelism more than its data-parallel ranks) and the degrees that spread it."""
    return "1 rank" if layout.world_size == 1 else f"{layout.world_size} ranks: {layout.degrees()}"


def finished_run_note(config: RunConfig, run_dir: Path, checkpoint_folder: Path, step: int) -> str:
    """What a run started again after it finished says instead of training: nothing is left to do, so it is not
    an error (``make train`` twice succeeds), but the person learns how to train on, start over, or use the model."""
    return (f"run '{config.name}' in {run_dir} is complete: its checkpoint in {checkpoint_folder} is at step {step} "
            f"of train.steps={config.train.steps}, so there is nothing to train. To train on, run the same command "
            f"with --set train.steps=N (N > {step}; the learning-rate schedule is stretched to N); to start over, "
            f"use another --run-dir (or move {checkpoint_folder} away).\n"
            + "\n".join(next_steps(config, run_dir, checkpoint_folder)))


def next_steps(config: RunConfig, run_dir: Path, checkpoint_folder: Path) -> list[str]:
    """What to do with the trained model, as commands that run as printed in a new shell from this folder
    (``shell_command``: ``.venv/bin/moe-generate`` after ``make train``); FILE is the one word to replace. The
    sample asks for as many new tokens as the context holds after its prompt (at most 200)."""
    new_tokens = max(1, min(200, config.model.seq_len - 8))  # "def " is at most 4 tokens of any tokenizer
    run, checkpoints = shlex.quote(str(run_dir)), shlex.quote(str(checkpoint_folder))
    export = shlex.quote(str(run_dir / "model.safetensors"))
    return ["next steps (each runs as printed from this folder; FILE: a text file of your own):",
            f"  {shell_command('moe-generate', 'inference.generate')} {run} --prompt 'def ' --greedy "
            f"--max-new-tokens {new_tokens}",
            f"  {shell_command('moe-evaluate', 'inference.evaluate')} {run} --text FILE",
            f"  {shell_command('moe-export', 'interop.export')} {checkpoints} {export}"]


def plan_lines(config: RunConfig, run_dir: Path, first_step: int, checkpoint_plan: str,
               destinations: dict[str, Path]) -> list[str]:
    """The banner's plan: steps and tokens of this session, the schedule (and a warmup longer than the run),
    the checkpoint plan (``Checkpointer.plan``) and where logs go (``MetricsLogger.destinations``, the plots)."""
    steps, per_step = config.train.steps, config.train.global_batch_size * config.model.seq_len
    left = steps - first_step + 1
    lines = [f"plan: steps {first_step}-{steps} of {steps}, {left:,} x {per_step:,} = {left * per_step:,} tokens; "
             f"{schedule_summary(config.train)}"]
    if (note := warmup_note(config.train)) is not None:
        lines.append(note)
    lines.append(checkpoint_plan)
    logs = [f"{name} {path}" for name, path in destinations.items()]
    if config.logging.plots:
        logs.append(f"plots at the end in {run_dir / PLOTS_DIR}")
    lines.append("logs: " + ", ".join(logs))
    return lines
