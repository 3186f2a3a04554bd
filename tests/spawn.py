"""Run a test's body on N processes of this machine joined in one gloo job, as ``torchrun`` would start them."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.multiprocessing as mp

from parallel.runtime import exit_process, free_port, init_runtime, shutdown_runtime


def spawn(body: Callable[..., None], world_size: int, *args) -> None:
    """Run ``body(rank, *args)`` in ``world_size`` spawned processes; an exception in any fails the caller.

    ``body`` must be a module-level function (it is pickled); it may call ``init_runtime()`` for its Runtime.
    """
    mp.spawn(_run, args=(world_size, free_port(), body, args), nprocs=world_size)


def _run(rank: int, world_size: int, port: int, body: Callable[..., None], args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    init_runtime()
    try:
        body(rank, *args)
    finally:
        shutdown_runtime()
    exit_process(0)  # skip the interpreter's shutdown: parallel/runtime.py says why
