"""The weights of a Hugging Face folder as written: one ``model.safetensors``, or shards and their index.

``transformers`` reads either: shards are named ``model-00001-of-0000N.safetensors`` and
``model.safetensors.index.json`` maps each tensor to its file (``weight_map``) with the bytes of all of them
(``metadata.total_size``), as its own ``save_pretrained`` writes them. Shards are cut in tensor order once
the next tensor would take a shard past ``max_shard_size``; a tensor larger than that is a shard of its own
(it is not split, as ``save_pretrained`` does not either). Each file streams, one tensor at a time
(``interop.export.write_safetensors_streaming``).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import torch

from config.errors import ConfigError
from interop.export import write_safetensors_streaming
from storage.files import write_text_atomic

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """Bytes of a size such as ``5GB`` (decimal units, as ``save_pretrained``), ``500MiB`` or ``1000000``."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if not match or (unit and unit not in _UNITS):
        raise ConfigError(f"--max-shard-size {text!r}: give a size such as 5GB, 500MB or 2GiB (or bytes)")
    size = int(float(match.group(1)) * _UNITS[unit or "B"])
    if size < 1:
        raise ConfigError(f"--max-shard-size {text!r} must be at least 1 byte")
    return size


def shard_groups(entries: dict[str, tuple[torch.Size, torch.dtype]], max_bytes: int | None) -> list[list[str]]:
    """Tensor names per file, in order: each file at most ``max_bytes`` but for a tensor larger on its own."""
    groups: list[list[str]] = [[]]
    used = 0
    for name, (shape, dtype) in entries.items():
        size = math.prod(shape) * dtype.itemsize
        if max_bytes is not None and groups[-1] and used + size > max_bytes:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += size
    return groups


def file_names(count: int) -> list[str]:
    """``model.safetensors`` for one file; ``model-0000i-of-0000N.safetensors`` for shards."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def write_weights(out: Path, entries: dict[str, tuple[torch.Size, torch.dtype]],
                  tensor: Callable[[str], torch.Tensor], max_bytes: int | None = None) -> list[str]:
    """Write ``entries`` (name: shape, dtype; each value from ``tensor(name)``) into the new, empty folder ``out``
    (``export_folder`` publishes it whole, so no earlier export's shards can mix in) as one file or shards with an
    index; returns the files written."""
    groups = shard_groups(entries, max_bytes)
    names = file_names(len(groups))
    for name, group in zip(names, groups, strict=True):
        write_safetensors_streaming(out / name, {key: entries[key] for key in group}, tensor, {"format": "pt"})
    if len(names) > 1:
        total = sum(math.prod(shape) * dtype.itemsize for shape, dtype in entries.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {key: name for name, group in zip(names, groups, strict=True) for key in group}}
        write_text_atomic(out / INDEX_FILE, json.dumps(index, indent=2) + "\n")  # after every shard it names
    return names
