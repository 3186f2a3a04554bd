"""Distributed checkpoints: sharded save and load of model and optimizer, atomic publication, verification.

Each rank writes the shards it holds with ``torch.distributed.checkpoint`` (DCP); no rank gathers the
model. State dicts come from ``torch.distributed.checkpoint.state_dict``, whose keys are the single-process
model's parameter names whatever the layout (FSDP2 shards, the ep-sharded experts of ``parallel/expert.py``
and any DTensor-sharded parameter keep their names), so a checkpoint saved under one layout loads under
another: DCP reads from each saved chunk what overlaps the shard the loading rank holds.

A checkpoint becomes visible only when complete (``publish``): it is written into a temporary folder,
every rank finishes, rank 0 writes ``manifest.json`` (size and SHA-256 of every file, and a digest of the
manifest itself) and renames the folder to its final name. A crash at any point before the rename leaves
only a temporary folder, never a damaged checkpoint; ``verify`` re-hashes the files before a load.

Loading executes no code from the files: DCP's ``.metadata`` pickle is read by an unpickler that accepts
only DCP's own metadata classes, torch dtypes and sizes; tensors are read with ``weights_only`` loading;
and only tensors are saved through DCP (non-tensor values would be unpickled freely by DCP's planner).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from config.errors import UserError
from storage.files import fsync_dir, sha256_file

# DCP warns on every call without a process group that it assumes a single process: here that is the intent.
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)

MANIFEST = "manifest.json"

# A folder of checkpoints (a run's ``checkpoints/``): ``step_NNNNNNN`` folders, each published whole, a
# ``.tmp_`` folder while one is written, ``latest`` naming the newest; each holds the resolved config it was
# trained with. The training run writes them (``training/checkpointing.py``); export and analysis read them.
STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp_"
LATEST = "latest"
CONFIG_FILE = "config.yaml"
TRAINER_STATE = "trainer_state.json"  # the step, sampler and tokenizer fingerprint (training/checkpointing.py)


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:07d}"


def published_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every published checkpoint under ``root``, newest first (temporary folders excluded)."""
    found = []
    if root.is_dir():
        for path in root.iterdir():
            digits = path.name[len(STEP_PREFIX):]
            if path.is_dir() and path.name.startswith(STEP_PREFIX) and digits.isdigit():
                found.append((int(digits), path))
    return sorted(found, reverse=True)


class CheckpointCorruptError(UserError, RuntimeError):
    """A checkpoint file is missing, truncated or altered; the message names the file."""


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Wait for every rank (no-op in a single process)."""
    if _dist():
        dist.barrier(group=group)


# --- state dicts -------------------------------------------------------------------------------------


def stateful_module(model) -> nn.Module:
    """The module whose state this rank checkpoints: the model, or under pipeline parallelism its stage(s).

    A pipeline stage keeps the full model's parameter names (``parallel/pipeline.py``), so the stages'
    shards land under the same keys as any other layout's and a checkpoint reshards across pp too.
    Several stages per rank (the interleaved schedule) are seen through one ``StagesView``.
    """
    stages = getattr(model, "stages", None)
    if stages is None:
        return model
    return stages[0] if len(stages) == 1 else StagesView(stages)


class StagesView(nn.Module):
    """A rank's pipeline stages as one module under the full model's names, for state dicts.

    torch's state-dict helpers take one module, and one optimizer over all of its parameters; the
    interleaved schedule gives a rank several stage modules and one optimizer. This view registers the
    stages' own blocks (``layers``, keyed by layer index, disjoint across stages) and whichever stage holds
    the embedding, the final norm, the head and the multi-token-prediction modules, so ``named_parameters``
    yields exactly the names the single-process model has for them. It owns nothing and runs nothing: the stages
    stay as they are.
    """

    def __init__(self, stages: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleDict({name: block for stage in stages for name, block in stage.layers.items()})
        for part in ("tok_embeddings", "norm", "output", "mtp"):
            held = [getattr(stage, part) for stage in stages
                    if not isinstance(getattr(stage, part), nn.Identity | None)]
            if held:
                setattr(self, part, held[0])


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"model": ..., "optim": {"state": ...}}``: every tensor as this rank holds it, keyed by parameter name.

    Only the optimizer's per-parameter state (Adam's ``step``, ``exp_avg``, ``exp_avg_sq``) is kept: its
    hyperparameters (lr, betas, weight decay) come from the run's config on resume, so they may change.
    The tensors alias the live ones; a synchronous save reads them before training goes on.
    """
    options = StateDictOptions(full_state_dict=False)
    model = stateful_module(model)
    model_state = get_model_state_dict(model, options=options)
    optim_state = get_optimizer_state_dict(model, optimizer, options=options)  # creates empty Adam state if needed
    return {"model": model_state, "optim": {"state": optim_state["state"]}}


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer | None, directory: Path) -> None:
    """Load ``directory`` into ``model`` (and ``optimizer``) as they are sharded now, whatever the saved layout.

    The target state dicts are built from the live objects (so DCP knows each rank's shard), filled in
    place by ``dcp.load``, then set back. Missing or extra keys are errors: a checkpoint from another
    model must not half-load.
    """
    options = StateDictOptions(full_state_dict=False, strict=True)
    model = stateful_module(model)
    model_state = get_model_state_dict(model, options=options)
    target: dict[str, Any] = {"model": model_state}
    optim_state = None
    if optimizer is not None:
        optim_state = get_optimizer_state_dict(model, optimizer, options=options)
        target["optim"] = {"state": optim_state["state"]}
    dcp.load(target, storage_reader=SafeFileSystemReader(directory), planner=TensorsOnlyLoadPlanner())
    set_model_state_dict(model, model_state, options=options)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, optim_state, options=options)


# --- writing -----------------------------------------------------------------------------------------


def save_sharded(state: dict[str, Any], directory: Path) -> None:
    """Write this rank's shards of ``state`` into ``directory`` (a collective; rank 0 writes DCP's metadata)."""
    dcp.save(state, storage_writer=FileSystemWriter(directory, single_file_per_rank=True, sync_files=True))


def async_save_sharded(state: dict[str, Any], directory: Path, process_group: dist.ProcessGroup | None):
    """Stage ``state`` to memory now and write it in a background thread; returns the future of the write.

    ``process_group`` must be a group used by nothing else while the write runs: the background
    thread's collectives would otherwise interleave with training's on the same group.
    """
    writer = FileSystemWriter(directory, single_file_per_rank=True, sync_files=True)
    return dcp.async_save(state, storage_writer=writer, process_group=process_group)


def _manifest_digest(files: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def write_manifest(directory: Path, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Hash every file under ``directory`` into ``manifest.json`` (fsynced); called by rank 0 once all ranks wrote."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        with open(path, "rb") as handle:  # data must be on disk before the manifest vouches for it
            os.fsync(handle.fileno())
        files[path.relative_to(directory).as_posix()] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    manifest = {"files": files, "digest": _manifest_digest(files), **(extra or {})}
    with open(directory / MANIFEST, "w", encoding="utf-8") as handle:
        json.dump(manifest, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    return manifest


def publish(tmp_dir: Path, final_dir: Path) -> None:
    """Make a fully written checkpoint visible under its final name in one rename (rank 0 only)."""
    if final_dir.exists():  # an older save of the same step (e.g. before a crash and replay): replaced whole
        shutil.rmtree(final_dir)
    os.replace(tmp_dir, final_dir)
    fsync_dir(final_dir.parent)


# --- verifying and reading ---------------------------------------------------------------------------


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of a published checkpoint, checked against its own digest."""
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointCorruptError(f"{path}: missing or unreadable manifest ({exc})") from exc
    if manifest.get("digest") != _manifest_digest(files):
        raise CheckpointCorruptError(f"{path}: manifest does not match its own digest (edited or damaged)")
    return manifest


def verify(directory: Path, rank: int = 0, world_size: int = 1) -> dict[str, Any]:
    """Check this rank's share of the files against the manifest (sizes, then SHA-256); returns the manifest.

    Rank r hashes files r, r + world_size, ...: the job reads every byte once between them. Raises
    ``CheckpointCorruptError`` naming the first bad file.
    """
    manifest = read_manifest(directory)
    for name, entry in sorted(manifest["files"].items())[rank::world_size]:
        path = directory / name
        if not path.is_file():
            raise CheckpointCorruptError(f"{path}: listed in the manifest but missing")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointCorruptError(f"{path}: {size} bytes, the manifest says {entry['bytes']} (truncated?)")
        if sha256_file(path) != entry["sha256"]:
            raise CheckpointCorruptError(f"{path}: SHA-256 differs from the manifest (corrupted)")
    return manifest


_METADATA_MODULES = ("torch.distributed.checkpoint.metadata",)
_METADATA_GLOBALS = {
    ("torch", "Size"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` but refuses any global that is not plain metadata (no code runs)."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = (module in _METADATA_MODULES or (module, name) in _METADATA_GLOBALS
                   or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype | torch.memory_format)))
        if not allowed:
            raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")
        return super().find_class(module, name)


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with the metadata read by ``_MetadataUnpickler`` instead of ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class TensorsOnlyLoadPlanner(DefaultLoadPlanner):
    """Refuses non-tensor entries, which DCP's default planner would unpickle with ``weights_only=False``."""

    def load_bytes(self, read_item, value) -> None:
        raise CheckpointCorruptError(f"checkpoint entry '{read_item.dest_index.fqn}' is pickled bytes, not a "
                                     "tensor; refusing to unpickle it")
