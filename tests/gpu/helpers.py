"""Shared pieces of the GPU tests: the moe-8x model on a device, and a host-sync counter."""

from __future__ import annotations

import threading
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from config.run import load_config
from moe.transformer import MoETransformer

ROOT = Path(__file__).resolve().parents[2]
# what c10's sync check warns on each synchronising call; setting the mode also warns once per process that the
# debug mode "does not yet detect all synchronizing operations", which a looser match counted as a sync (the first
# GPU run, docs/gpu.md)
SYNC_WARNING = "called a synchronizing CUDA operation"


def moe_8x(device: str, *overrides: str) -> tuple[MoETransformer, object]:
    """``configs/moe-8x.yaml``'s model (with ``overrides``), initialised from seed 0, on ``device``; and its config."""
    config = load_config("moe-8x", list(overrides))
    torch.manual_seed(0)
    model = MoETransformer(config.model, config.moe, seed=0).to(device)
    return model, config


def batch(config, device: str, sequences: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random byte tokens [sequences, seq_len] and their next-token targets."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.model.vocab_size, (sequences, config.model.seq_len + 1), generator=generator)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def host_syncs(fn: Callable[[], object]) -> list[str]:
    """Run ``fn`` and return where it synchronised the host with the GPU, one entry per sync: the innermost
    frame of this project's code and the innermost frame of all, with the thread (a backward runs kernels from
    autograd's own thread, whose warnings reach Python later, in whatever call comes next).

    ``torch.cuda.set_sync_debug_mode("warn")`` makes every synchronising CUDA call (a device-to-host copy, an
    ``.item()``, a ``nonzero``, a stream sync) warn; the warnings are counted with their stacks, not printed.
    """
    found = []

    def record(message, category, filename, lineno, file=None, line=None):
        if SYNC_WARNING not in str(message):  # not the once-per-process note that the debug mode is a prototype
            return
        stack = traceback.extract_stack()[:-1]
        ours = [frame for frame in stack if frame.filename.startswith(str(ROOT)) and "/tests/" not in frame.filename]
        where = f"{ours[-1].filename.removeprefix(str(ROOT) + '/')}:{ours[-1].lineno}" if ours else "-"
        found.append(f"{where} <- {filename}:{lineno} [{threading.current_thread().name}]")

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return found
