"""Shared pieces of the GPU tests: the moe-8x model on a device, and a host-sync counter."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from config.run import load_config
from moe.transformer import MoETransformer


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
    """Run ``fn`` and return where it synchronised the host with the GPU ("file:line" per sync).

    ``torch.cuda.set_sync_debug_mode("warn")`` makes every synchronising CUDA call (a device-to-host copy, an
    ``.item()``, a ``nonzero``, a stream sync) warn; the warnings are counted, not printed.
    """
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
