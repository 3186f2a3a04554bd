"""Run the same training under a parallel layout and under one process, and collect what to compare.

A layout run spawns ``world_size`` gloo processes on this CPU; rank 0 writes the metrics and the
gathered final parameters. The reference runs in this process. Both use ``training.loop.train``,
the code ``train.py`` runs.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import string
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from config.run import load_config
from parallel.groups import ParallelGroups
from parallel.layout import Layout
from parallel.runtime import Runtime, init_runtime
from tests.spawn import spawn
from training.loop import train
from training.metrics import read_metrics

# A tiny MoE (fp32, 2 MoE layers, 4 experts top-2) whose steps take milliseconds.
TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.seq_len=32", "model.ffn_hidden=64",
        "moe.num_experts=4", "moe.expert_hidden=32", "train.global_batch_size=8",
        "train.warmup_steps=2", "train.lr=1e-2", "train.precision=fp32", "train.eval_interval=0",
        "train.eval_batches=2", "logging.wandb=disabled", "logging.log_interval=1", "logging.progress=lines",
        "logging.plots=false", "logging.memory_peak=false"]


def documents_corpus() -> Path:
    """A jsonl corpus of short documents (3 to 30 characters: about two end in each 32-token window), the same
    file on every call; written once, atomically, so concurrent test runs share it."""
    path = Path(tempfile.gettempdir()) / "moe-parity-documents-v1.jsonl"
    if not path.exists():
        words = random.Random(0)
        lines = [json.dumps({"text": "".join(words.choices(string.ascii_lowercase + " .", k=words.randint(3, 30)))})
                 for _ in range(1500)]
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        partial.write_text("\n".join(lines) + "\n", encoding="utf-8")
        os.replace(partial, path)
    return path


# Packed documents masked from each other, each ended by one byte (data.document_end) that no document holds.
DOCUMENT_MASK = ["data.document_mask=true", 'data.document_end="\\x1e"', f"data.source={documents_corpus()}"]


# GPT-OSS's architecture at toy size: q/k/v/o biases, attention sinks, a sliding window of 4 on the first layer
# (the blocked path: 32 positions), a biased router and biased experts with the clamped SwiGLU
GPT_OSS = ["model.qkv_bias=true", "model.attn_output_bias=true", "model.attention_sinks=true",
           "model.sliding_window=4", "model.layer_types=[sliding_attention, full_attention]",
           "moe.activation=clamped_swiglu", "moe.swiglu_limit=0.5", "moe.router_bias=true",
           "moe.expert_proj_bias=true"]


def full_state(model) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` (this rank's pipeline stages) as full tensors (a collective)."""
    return {name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
            for name, value in model.state_dict().items()}


def _worker(rank: int, world_size: int, overrides: list[str], run_dir: str, out: str) -> None:
    config = load_config("moe-8x", overrides)
    groups = ParallelGroups.build(Layout.resolve(world_size, **config.parallel.degrees()), "cpu")
    result = train(config, Path(run_dir), init_runtime(), groups)
    # each pipeline stage holds part of the model: gather every rank's full tensors on rank 0
    parts = [None] * world_size if rank == 0 else None
    dist.gather_object((groups.coords()["pp"], full_state(result.model)), parts, dst=0)
    if rank == 0:
        merged, stage_of = {}, {}
        for stage, part in parts:
            for name, value in part.items():
                # a name on two pipeline stages is a copy (the embedding the last stage holds for multi-token
                # prediction): it must have stayed the same bits as the original
                if stage_of.setdefault(name, stage) != stage:
                    assert torch.equal(value, merged[name]), f"{name} differs between pipeline stages"
                merged[name] = value
        torch.save(merged, out)


def run(overrides: list[str], world_size: int, run_dir: Path) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Train with ``overrides`` on ``world_size`` processes (1: in this process); (metric records, final state)."""
    overrides = [*TINY, *overrides]
    if world_size == 1:
        config = load_config("moe-8x", overrides)
        groups = ParallelGroups.build(Layout.resolve(1, **config.parallel.degrees()), "cpu")
        result = train(config, run_dir, Runtime(0, 1, 0, torch.device("cpu")), groups)
        state = full_state(result.model)
    else:
        out = run_dir / "final_state.pt"
        _spawn_run(overrides, world_size, run_dir, out)
        state = torch.load(out, weights_only=True)
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in r]
    return records, state


def _spawn_run(overrides: list[str], world_size: int, run_dir: Path, out: Path) -> None:
    """Train the layout on ``world_size`` spawned processes into ``run_dir``; a world that a native crash
    ended is run again once, from an empty ``run_dir``.

    A process that dies by a signal did not fail a Python check: the parity rows' code is Python over torch
    and gloo, and a signal is a crash inside them (seen once on the CI machine: ``malloc(): unaligned tcache
    chunk detected``, SIGABRT, in a cp=2 row that passed in each of 16 reruns here, alone and beside its cp
    rows). One rerun keeps such a crash from failing an unrelated change; a second crash fails the row, and
    any Python exception (a wrong number, a refused layout) fails it the first time.
    """
    try:
        spawn(_worker, world_size, world_size, overrides, str(run_dir), str(out))
    except mp.ProcessExitedException as crash:
        if crash.signal_name is None:
            raise
        print(f"parity: process {crash.error_index} died by {crash.signal_name} (a native crash, no Python "
              "error): running the layout once more from an empty run directory", file=sys.stderr)
        shutil.rmtree(run_dir)
        run_dir.mkdir()
        spawn(_worker, world_size, world_size, overrides, str(run_dir), str(out))
