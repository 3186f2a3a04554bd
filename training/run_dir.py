"""A run directory belongs to one run: the lock that holds it while the run lives, and what a new run finds there.

While a run lives, rank 0 holds an exclusive ``flock`` on ``<run_dir>/run.lock``, with its host, pid and start
time written in the file. The operating system drops the lock when the process ends, however it ends (kill -9
included), so a crashed run never leaves its directory blocked; a second run in the same directory is refused,
naming the holder. Every rank learns rank 0's verdict (one broadcast), so under torchrun all of them stop with
exit status 2 and rank 0 alone says why.

A run directory that already holds a run's files (``config.yaml``, ``metrics.jsonl``, ...) is continued only
from its own checkpoints (``--resume auto``): the checkpoint rewinds the logs to its step, so the files read as
one run. Without a checkpoint there is nothing to continue from and a new run would mix its records with the
old ones: ``--resume auto`` (or a checkpoint of another run) is refused, and ``--resume none`` moves the old run's
files aside into ``<run_dir>/replaced/<time>/`` (nothing is deleted) and starts fresh.

A ``checkpoint.dir`` outside the run directory (an absolute path, say a shared disk) belongs to one run too: it
is locked with the run (its own ``run.lock``) and names its run directory in ``owner.txt``. A run whose directory
is not the one named there is refused, whatever ``--resume`` says: else two experiments given one
``checkpoint.dir`` would continue each other's checkpoints (the second resuming the first's last step, training
nothing, and reporting its validation loss as its own).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import torch
import torch.distributed as dist

from config.errors import ConfigError
from parallel.checkpoint import published_checkpoints
from parallel.runtime import Runtime
from storage.files import open_own_file, write_text_atomic

LOCK = "run.lock"
OWNER = "owner.txt"  # in a checkpoint.dir outside its run directory: that run directory's resolved path
# What a run writes into its directory besides its checkpoints (training/loop.py, metrics.py, routing_stats.py).
RUN_FILES = ("config.yaml", "metrics.jsonl", "summary.json", "resume_changes.yaml", "routing", "wandb", "tensorboard",
             "plots")
REPLACED = "replaced"


class RunDirError(ConfigError):
    """The run directory is held by another run, or holds a run this one must not mix with.

    ``quiet``: raised on a rank other than 0 after rank 0 refused and said why; nothing more to print.
    """

    def __init__(self, message: str, quiet: bool = False):
        super().__init__(message)
        self.quiet = quiet


@contextlib.contextmanager
def hold_run_dir(run_dir: Path, runtime: Runtime, checkpoint_root: Path, resume: str,
                 saves: bool = False) -> Iterator[None]:
    """Hold ``run_dir`` for the run inside the ``with`` (a collective: every rank enters it).

    Rank 0 creates the directory, takes its lock and readies it for this run (``claim_run_dir``), and checks
    that ``checkpoint_root`` takes files when the run ``saves`` checkpoints (not at the first save); a refusal
    raises ``RunDirError`` on every rank. The lock is released when the block ends, or by the OS if the process dies.
    """
    run_dir = Path(run_dir)
    locks, error = [], None
    if runtime.is_main:
        try:
            locks.append(_lock(run_dir, f"--run-dir {run_dir}"))
            claim_run_dir(run_dir, checkpoint_root, resume)
            if saves:
                _check_writable(checkpoint_root)
            if not checkpoint_root.resolve().is_relative_to(run_dir.resolve()) and checkpoint_root.is_dir():
                locks.append(_lock(checkpoint_root, f"checkpoint.dir {checkpoint_root}"))
                claim_checkpoint_dir(checkpoint_root, run_dir, saves)
        except (RunDirError, OSError) as exc:  # every rank waits for the verdict: never leave without one
            error = str(exc) if isinstance(exc, RunDirError) else f"--run-dir {run_dir}: {exc}"
            for lock in locks:
                _release(lock)
            locks = []
    rank0_verdict(runtime, None if error is None else RunDirError(error))
    try:
        yield
    finally:
        for lock in locks:
            _release(lock)


def rank0_verdict(runtime: Runtime, error: ConfigError | None) -> None:
    """Every rank learns whether rank 0 failed at something only it does (one small broadcast; a collective):
    rank 0 raises its ``error``, the others a quiet ``RunDirError`` (rank 0's message is the one printed)."""
    failed = error is not None
    if runtime.distributed:
        flag = torch.tensor([int(failed)], device=runtime.device)  # NCCL: device tensors
        dist.broadcast(flag, src=0)
        failed = bool(flag.item())
    if not failed:
        return
    if error is None:
        raise RunDirError("rank 0 stopped the run (see its message)", quiet=True)
    raise error


def first_failure_verdict(runtime: Runtime, error: Exception | None) -> None:
    """Every rank learns whether any rank failed at something every rank does (one small all-reduce; a collective):
    the lowest failed rank raises its ``error``, the others a quiet ``RunDirError``, so one message is printed for
    a failure every rank meets (bad data, say) and none waits for peers that stopped."""
    first = runtime.rank if error is not None else runtime.world_size
    if runtime.distributed:
        flag = torch.tensor([first], device=runtime.device)  # NCCL: device tensors
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        first = int(flag.item())
    if first == runtime.world_size:
        return
    if first != runtime.rank:
        raise RunDirError(f"rank {first} stopped the run (see its message)", quiet=True)
    raise error


def _lock(folder: Path, named: str) -> IO[str] | None:
    """Create ``folder`` (the run directory, or a checkpoint.dir outside it, as the user ``named`` it) and take its
    lock; the open lock file (None where the filesystem has no locks)."""
    option = named.split()[0]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle = open_own_file(folder / LOCK, "a+", encoding="utf-8", errors="replace")  # held until _release
    except OSError as exc:
        raise RunDirError(f"{named}: cannot create {folder / LOCK} ({exc.strerror}); use a writable {option}, or "
                          "remove what stands there") from exc
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "a process that has not written its name yet"
        handle.close()
        raise RunDirError(f"{named} is in use by another run ({holder}); wait for it to end or stop it, or use "
                          f"another {option}") from None
    except OSError as exc:  # a filesystem without locks (some network mounts): run, but say what is not guarded
        handle.close()
        print(f"warning: cannot lock {folder / LOCK} ({exc.strerror}): a second run using {named} at the same "
              "time would not be refused", file=sys.stderr)
        return None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on host {socket.gethostname()}, since "
                 f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n")
    handle.flush()
    return handle


def _check_writable(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as exc:
        raise RunDirError(f"checkpoint.dir: cannot write checkpoints to {folder} ({exc.strerror}); make it "
                          "writable, or set checkpoint.dir to a writable folder") from exc


def _release(handle: IO[str] | None) -> None:
    if handle is not None:
        with contextlib.suppress(OSError):
            handle.truncate(0)  # a reader finds no stale holder while the next run starts
        handle.close()  # drops the flock


def claim_run_dir(run_dir: Path, checkpoint_root: Path, resume: str) -> None:
    """Make ``run_dir`` ready for a run resumed as ``resume`` says, or refuse; see the module docstring."""
    found = [name for name in RUN_FILES if (run_dir / name).exists()]
    own = published_checkpoints(checkpoint_root)
    if not found and not own:  # a new run directory
        return
    if resume == "auto":
        if own or not found:  # continues from its own checkpoint, which rewinds the logs to it
            return
        raise RunDirError(f"--run-dir {run_dir} holds a run ({', '.join(found)}) without a checkpoint to continue "
                          f"from; use another --run-dir, or --resume none to start over there (the old run's files "
                          f"are moved to {run_dir / REPLACED}/)")
    if resume == "none":
        if not own:  # (with checkpoints the Checkpointer refuses, naming them)
            _move_aside(run_dir, found)
        return
    if Path(resume).resolve().is_relative_to(checkpoint_root.resolve()):  # back to one of this run's checkpoints
        return
    if own:
        raise RunDirError(f"--resume {resume}: --run-dir {run_dir} has checkpoints of its own (newest "
                          f"{own[0][1].name}); continue them with --resume auto, or start from {resume} in a new "
                          "--run-dir")
    raise RunDirError(f"--resume {resume}: --run-dir {run_dir} holds another run ({', '.join(found)}); start from "
                      f"{resume} in a new --run-dir")


def claim_checkpoint_dir(checkpoint_root: Path, run_dir: Path, saves: bool) -> None:
    """Refuse a ``checkpoint.dir`` outside ``run_dir`` that belongs to another run; record this run as its owner
    where none is recorded, it holds no checkpoints and this run ``saves`` there (see the module docstring)."""
    owner_file, mine = checkpoint_root / OWNER, str(run_dir.resolve())
    recorded = owner_file.read_text(encoding="utf-8", errors="replace").strip() if owner_file.is_file() else None
    if recorded == mine:
        return
    if recorded is not None:
        raise RunDirError(f"checkpoint.dir {checkpoint_root} belongs to the run in {recorded} (its {OWNER}); give "
                          f"this run a checkpoint.dir of its own, or continue that run with --run-dir {recorded}")
    if published := published_checkpoints(checkpoint_root):
        raise RunDirError(f"checkpoint.dir {checkpoint_root} holds checkpoints (newest {published[0][1].name}) of a "
                          f"run that named no owner; give this run a checkpoint.dir of its own, or, if they are this "
                          f"run's, write its directory ({mine}) into {owner_file}")
    if saves:
        write_text_atomic(owner_file, mine + "\n")


def _move_aside(run_dir: Path, names: list[str]) -> None:
    """Move the run files ``names`` into a new ``run_dir/replaced/<time>/``: a fresh run must not append to them."""
    aside = run_dir / REPLACED / time.strftime("%Y%m%d-%H%M%S")
    while aside.exists():
        aside = aside.with_name(aside.name + "+")
    aside.mkdir(parents=True)
    for name in names:
        (run_dir / name).rename(aside / name)
    print(f"--resume none: moved the previous run's {', '.join(names)} from {run_dir} to {aside}", file=sys.stderr)
