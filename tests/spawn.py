"""Run a test's body on N processes of this machine joined in one gloo job, as ``torchrun`` would start them.

The processes are forked from a server process that has already imported torch and the toolkit
(``forkserver`` with a preload), not started fresh: a fresh interpreter spends seconds of CPU importing torch,
and the suite starts a few hundred of them, two to four at a time on two cores. A parity row's spawned run
took 7.9 s that way and 2.8 s forked from the server. The server starts once per test session, so each child
is given the caller's environment as it is at the call (a test may have set variables since), and imports
anything else it needs as a spawned child would.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.multiprocessing as mp

from parallel.runtime import exit_process, free_port, init_runtime, shutdown_runtime

# what every spawned body imports anyway; importing more here would only slow the server's start
PRELOAD = ["torch", "torch.distributed.tensor", "config.run", "parallel.groups", "training.loop", "tests.spawn"]


def spawn(body: Callable[..., None], world_size: int, *args) -> None:
    """Run ``body(rank, *args)`` in ``world_size`` processes; an exception in any fails the caller.

    ``body`` must be a module-level function (it is pickled); it may call ``init_runtime()`` for its Runtime.
    """
    mp.get_context("forkserver").set_forkserver_preload(PRELOAD)  # read when the server starts, once
    mp.start_processes(_run, args=(world_size, free_port(), dict(os.environ), body, args), nprocs=world_size,
                       start_method="forkserver")


def _run(rank: int, world_size: int, port: int, environment: dict[str, str], body: Callable[..., None],
         args: tuple) -> None:
    os.environ.clear()
    os.environ.update(environment, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    init_runtime()
    try:
        body(rank, *args)
    finally:
        shutdown_runtime()
    exit_process(0)  # skip the interpreter's shutdown: parallel/runtime.py says why
