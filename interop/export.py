"""Export a sharded checkpoint to one consolidated safetensors file.

    python -m interop.export runs/moe-8x/checkpoints/step_0000300 model.safetensors
    python train.py --init-from model.safetensors ...

The export runs in one process whatever layout saved the checkpoint, and streams: the file's header is
written from the checkpoint's metadata (every tensor's name, shape and dtype), then DCP reassembles one
tensor at a time (each expert of an ep-sharded stack in order) and its bytes are appended. Peak memory is
one tensor, not the model. The file holds the model's parameters and buffers (the balancing biases
included) under the single-process names, and the resolved config as metadata, so it is usable for
inference and analysis without this toolkit. safetensors is a plain tensor format: reading it executes
nothing; ``train.py --init-from`` reads each rank's shards of it (``parallel.materialize``).
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import yaml
from safetensors import SafetensorError, safe_open
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from config.cli import add_overwrite, check_outputs, command_parser, run_command
from config.errors import ConfigError, UserError
from config.run import RunConfig, config_from_dict
from config.tokenizer_identity import FINGERPRINT_METADATA_KEY
from moe.transformer import MoETransformer
from parallel.checkpoint import (
    CONFIG_FILE,
    TRAINER_STATE,
    CheckpointCorruptError,
    SafeFileSystemReader,
    TensorsOnlyLoadPlanner,
    load_sharded,
    published_checkpoints,
    verify,
)
from parallel.materialize import checked_weight
from storage.files import atomic_output

CONFIG_METADATA_KEY = "config.yaml"


def verified_checkpoint(checkpoint: Path) -> tuple[Path, str, RunConfig]:
    """(folder, resolved config YAML, its config) of a verified checkpoint: ``checkpoint`` is a ``step_NNNNNNN``
    folder, or a folder of them (a run's ``checkpoints/``: its newest)."""
    found = published_checkpoints(checkpoint)
    if found:
        checkpoint = found[0][1]
    verify(checkpoint)
    config_text = (checkpoint / CONFIG_FILE).read_text(encoding="utf-8")
    return checkpoint, config_text, config_from_dict(yaml.safe_load(config_text))


def consolidated_state(checkpoint: Path) -> tuple[dict[str, torch.Tensor], str, Path]:
    """(full model state dict, resolved config YAML, checkpoint folder) of a verified checkpoint, in one process.

    The whole model in memory, for analysis of models that fit one process (``analysis/router.py``);
    ``export_checkpoint`` streams instead.
    """
    checkpoint, config_text, config = verified_checkpoint(checkpoint)
    model = MoETransformer(config.model, config.moe)
    load_sharded(model, None, checkpoint)
    return {name: tensor.contiguous() for name, tensor in model.state_dict().items()}, config_text, checkpoint


SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
                      torch.int64: "I64", torch.int32: "I32"}


class ExportWriteError(ValueError):
    """The export file could not be written."""


def write_safetensors_streaming(out: Path, entries: dict[str, tuple[torch.Size, torch.dtype]],
                                tensor: Callable[[str], torch.Tensor], metadata: dict[str, str]) -> None:
    """Write a safetensors file tensor by tensor: ``entries`` (name: shape, dtype) first, each ``tensor(name)`` after.

    The format (huggingface/safetensors' README) is an 8-byte little-endian header length, a JSON header
    of every tensor's dtype, shape and byte range, then the raw bytes: the header needs only shapes, so
    it is written first and each tensor is asked for, written and dropped in turn. The safetensors
    package's own writer takes every tensor at once, which for a model is the whole model in memory.
    """
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, (shape, dtype) in entries.items():
        if dtype not in SAFETENSORS_DTYPES:
            raise ConfigError(f"tensor '{name}' has dtype {dtype}, which the export does not write")
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    try:  # a reader, or a second export to the same path, never sees a half-written or mixed file
        with atomic_output(out) as handle:
            handle.write(struct.pack("<Q", len(encoded)))
            handle.write(encoded)
            for name, (shape, dtype) in entries.items():
                value = tensor(name)
                if dtype.is_floating_point:  # integer entries (a step count) are not weights
                    checked_weight(value, name, f"writing {out}")
                if value.shape != shape or value.dtype != dtype:
                    raise ConfigError(f"tensor '{name}' read as {tuple(value.shape)} {value.dtype}, the checkpoint's "
                                      f"metadata says {tuple(shape)} {dtype}")
                handle.write(value.contiguous().view(torch.uint8).numpy())  # its buffer, not a second copy
    except OSError as exc:  # a folder that takes no files, a full disk: nothing half-written is left behind
        raise ExportWriteError(f"cannot write {out} ({exc.strerror or exc}); give a writable path with room for "
                               f"{(8 + len(encoded) + offset) / 1e6:.2f} MB") from exc


def checkpoint_tensors(checkpoint: Path) -> tuple[dict[str, tuple[torch.Size, torch.dtype]],
                                                 Callable[[str], torch.Tensor], str]:
    """(each model tensor's shape and dtype, a reader of one whole tensor, the resolved config YAML) of a
    verified checkpoint: a ``step_NNNNNNN`` folder, or a folder of them (a run's ``checkpoints/``: its newest).

    Reading assembles one tensor from the checkpoint's shards (DCP), whatever layout saved it.
    """
    checkpoint, config_text, _ = verified_checkpoint(checkpoint)  # a checkpoint of this toolkit's model
    reader = SafeFileSystemReader(checkpoint)
    prefix = "model."
    entries = {key[len(prefix):]: (meta.size, meta.properties.dtype)
               for key, meta in reader.read_metadata().state_dict_metadata.items()
               if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}

    def read(name: str) -> torch.Tensor:
        shape, dtype = entries[name]
        value = torch.empty(shape, dtype=dtype)
        try:
            dcp.load({"model": {name: value}}, storage_reader=SafeFileSystemReader(checkpoint),
                     planner=TensorsOnlyLoadPlanner(allow_partial_load=True))
        except CheckpointException as exc:  # a BaseException: nothing else would stop its traceback
            if not checkpoint.is_dir():
                raise UserError(f"{checkpoint} disappeared while it was read (a running job's checkpoint.keep "
                                "pruned it?); export again (its newest checkpoint is then a later one), or copy the "
                                "checkpoint out of the job's folder first") from None
            raise CheckpointCorruptError(f"{checkpoint}: tensor '{name}' cannot be read "
                                         f"({str(exc).splitlines()[0][:200]})") from None
        return value

    return entries, read, config_text


def model_tensors(source: Path) -> tuple[dict[str, tuple[torch.Size, torch.dtype]], Callable[[str], torch.Tensor],
                                        RunConfig]:
    """(each tensor's shape and dtype, a reader of one whole tensor, the config) of our weights, one tensor at a
    time: a checkpoint (a ``step_NNNNNNN`` folder, or a folder of them) or a safetensors file of this toolkit's
    (``export_checkpoint``'s, ``interop.hf import``'s, ``interop.upcycle``'s: the config is its metadata)."""
    if source.is_dir():
        entries, read, config_text = checkpoint_tensors(source)
        return entries, read, config_from_dict(yaml.safe_load(config_text))
    try:
        handle = safe_open(str(source), framework="pt")
    except (OSError, SafetensorError) as exc:
        raise ConfigError(f"{source}: not a checkpoint folder or a readable safetensors file ({exc})") from exc
    metadata = handle.metadata() or {}
    if CONFIG_METADATA_KEY not in metadata:
        raise ConfigError(f"{source}: no '{CONFIG_METADATA_KEY}' metadata (not written by this toolkit)")
    dtypes = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}
    entries = {}
    for name in handle.keys():
        tensor = handle.get_slice(name)
        if tensor.get_dtype() not in dtypes:
            raise ConfigError(f"{source}: tensor '{name}' has dtype {tensor.get_dtype()}, not supported")
        entries[name] = (torch.Size(tensor.get_shape()), dtypes[tensor.get_dtype()])
    return entries, handle.get_tensor, config_from_dict(yaml.safe_load(metadata[CONFIG_METADATA_KEY]))


def weights_tokenizer(source: Path) -> str | None:
    """The fingerprint of the tokenizer the weights at ``source`` were trained with (``config.tokenizer_identity``):
    a checkpoint's ``trainer_state.json`` records it, a safetensors file of ours its metadata; None for weights
    saved before fingerprints were recorded."""
    if source.is_dir():
        found = published_checkpoints(source)
        state = (found[0][1] if found else source) / TRAINER_STATE
        try:
            return json.loads(state.read_text(encoding="utf-8")).get(FINGERPRINT_METADATA_KEY)
        except (OSError, ValueError, AttributeError):
            return None  # reading the weights themselves says what is wrong with the checkpoint
    try:
        with safe_open(str(source), framework="pt") as handle:
            return (handle.metadata() or {}).get(FINGERPRINT_METADATA_KEY)
    except (OSError, SafetensorError):
        return None


def export_checkpoint(checkpoint: Path, out: Path) -> int:
    """Write ``checkpoint``'s model to ``out`` (safetensors), one tensor in memory at a time; returns the count.

    ``checkpoint`` is a ``step_NNNNNNN`` folder, or a folder of them (a run's ``checkpoints/``): its newest.
    """
    found = published_checkpoints(checkpoint)
    if found:
        checkpoint = found[0][1]
    entries, read, config_text = checkpoint_tensors(checkpoint)
    metadata = {CONFIG_METADATA_KEY: config_text, "checkpoint": str(checkpoint)}
    trained_with = weights_tokenizer(checkpoint)
    if trained_with is not None:
        metadata[FINGERPRINT_METADATA_KEY] = trained_with
    write_safetensors_streaming(out, entries, read, metadata)
    return len(entries)


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("moe-export", __doc__)
    parser.add_argument("checkpoint", type=Path, help="a step_NNNNNNN checkpoint folder, or a folder of them")
    parser.add_argument("out", type=Path, help="the .safetensors file to write")
    add_overwrite(parser)
    args = parser.parse_args(argv)

    def export() -> None:
        if args.out.is_dir():
            raise ConfigError(f"{args.out} is a folder; give the path of the .safetensors file to write")
        check_outputs([args.out], [args.checkpoint], args.overwrite)
        if not args.out.parent.is_dir():
            raise ConfigError(f"cannot write {args.out}: its folder {args.out.parent} does not exist")
        if not os.access(args.out.parent, os.W_OK | os.X_OK):
            raise ConfigError(f"cannot write {args.out}: its folder {args.out.parent} is not writable")
        try:
            count = export_checkpoint(args.checkpoint, args.out)
        except CheckpointCorruptError:
            raise
        except RuntimeError as exc:  # DCP's reader on a shard it cannot read
            raise CheckpointCorruptError(str(exc)) from exc
        print(f"wrote {count} tensors to {args.out} ({args.out.stat().st_size / 1e6:.2f} MB)", file=sys.stderr)

    return run_command(export)


if __name__ == "__main__":
    sys.exit(main())
