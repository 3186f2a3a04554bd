"""The process's place in the job: rank, world size, device, and the default process group.

``torchrun`` sets RANK / WORLD_SIZE / LOCAL_RANK; a plain ``python train.py`` runs as
a world of one without any process group. The backend follows the device: NCCL on
GPUs, gloo on CPUs. Every other group is built from this one by ``parallel/groups.py``.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from config.errors import ConfigError


@dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Rank 0 writes logs, metrics and files for the whole job."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on now: the rendezvous of processes spawned on this machine
    (the tests' gloo jobs, the benchmarks')."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class LaunchEnvironment:
    """The process's place in the job as torchrun's environment variables give it (a world of one without them)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    launched: bool  # started by torchrun (RANK is set): the job's process group is to be joined


def _environment_integer(name: str, default: int, least: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < least:
        raise ConfigError(f"environment variable {name}={raw!r} must be an integer >= {least} (torchrun sets it; "
                          "unset it to run one process)")
    return value


def launch_environment() -> LaunchEnvironment:
    """torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), checked
    before any work: a ConfigError naming the variable when one is malformed or they disagree (a stray LOCAL_RANK
    or RANK in a shell would otherwise fail deep inside torch.distributed)."""
    world_size = _environment_integer("WORLD_SIZE", 1, 1)
    rank = _environment_integer("RANK", 0, 0)
    local_rank = _environment_integer("LOCAL_RANK", 0, 0)
    local_world_size = _environment_integer("LOCAL_WORLD_SIZE", 1, 1)
    if rank >= world_size:
        raise ConfigError(f"environment variable RANK={rank} is not below WORLD_SIZE={world_size}")
    launched = "RANK" in os.environ
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if launched and missing:
        raise ConfigError(f"environment variable RANK is set but {' and '.join(missing)} not: start the job with "
                          "torchrun (or python launch.py), which sets them all, or unset RANK to run one process")
    return LaunchEnvironment(rank, world_size, local_rank, local_world_size, launched)


def local_device() -> torch.device:
    """The device this process computes on: its node's GPU number LOCAL_RANK when torch sees GPUs, else the CPU
    (known before the job is joined, so ``train.py`` checks the config against it first)."""
    if torch.cuda.is_available():
        return torch.device("cuda", launch_environment().local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def requested_device(spec: str | torch.device) -> torch.device:
    """The device a single-process command was asked to use (``--device``), refused before any work where it
    cannot be: a malformed name, CUDA where torch sees no GPU, a GPU number beyond those present."""
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(f"--device {spec!r}: not a device name (give cpu, cuda or cuda:N)") from exc
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"--device {spec}: torch sees no CUDA GPU here ({torch.__version__}); use --device cpu")
        if device.index is not None and device.index >= count:
            raise ConfigError(f"--device {spec}: this machine has {count} GPU(s), numbered 0 to {count - 1}")
    elif device.type != "cpu":
        raise ConfigError(f"--device {spec}: only cpu and cuda are supported")
    return device


def init_runtime() -> Runtime:
    """Join the job torchrun started (if any) and pick this process's device."""
    env = launch_environment()
    rank, world_size, local_rank = env.rank, env.world_size, env.local_rank
    device = local_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if env.launched and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size, device_id=device
                                if device.type == "cuda" else None)
    return Runtime(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def shutdown_runtime() -> None:
    """Leave the job cleanly (also after an error, so peers are not left hanging)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End this process with ``code`` now, without the interpreter's shutdown.

    A gloo process group keeps its worker threads until the group object is freed, and torch's DTensor
    caches keep the groups referenced to the very end, so ``destroy_process_group`` does not stop them.
    A worker thread that lets go of its last collective's tensors while the interpreter is shutting
    down needs the GIL it can no longer take, and the process aborts ("terminate called without an
    active exception", SIGABRT; the cause is described in pytorch/pytorch#179291). On a loaded 2-core
    machine this ended a few finished runs in ten. By the time a process ends, the run has closed its
    files, so only the standard streams need flushing.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
