"""Give a meta-built, parallelized model memory: this rank's shards only, initialised as one process would.

The model is constructed on the meta device (no storage), cut into pipeline stages and parallelized
there (tensor, expert and sharded data parallelism turn its parameters into DTensors whose local tensors
are this rank's slices, still on meta). ``materialize`` then allocates the local tensors on the device
(``nn.Module.to_empty``; FSDP2 re-pads its shards there) and fills each with its slice of the
single-process weights (``moe/init.py``): no rank ever allocates a whole parameter it does not hold, and
the weights do not depend on the layout. Peak memory is the rank's shards plus one init chunk (and, for a
FSDP-sharded parameter whose dim 0 does not split evenly, FSDP's padded copy of that one shard).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from config.errors import ConfigError
from moe.init import Slice, whole
from moe.transformer import MoETransformer


def locate(param: Tensor) -> Slice:
    """Where this rank's local tensor of ``param`` sits in the global parameter.

    DTensor placements (tp's Shard, FSDP2's Shard and _StridedShard over a tp-sharded dim, ep's Shard(0))
    all keep a contiguous box of the global tensor on each rank; torch computes its offset the way
    distributed checkpointing does.
    """
    if not isinstance(param, DTensor):
        return whole(param)
    local = param.to_local()
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if tuple(shape) != tuple(local.shape):
        raise AssertionError(f"local tensor {tuple(local.shape)} is not the computed shard {tuple(shape)}")
    return Slice(local, tuple(param.shape), tuple(offset))


@torch.no_grad()
def materialize(model: MoETransformer, device: torch.device, seed: int) -> None:
    """Allocate ``model``'s meta tensors on ``device`` (this rank's shards) and initialise them, in place.

    The parameters stay the same objects (their data is swapped in, ``torch.utils.swap_tensors``), so
    what refers to them holds: FSDP's ignored-parameter sets and the tie of the embedding and the LM head;
    ``to_empty`` alone would make new parameters. Hooks registered on a parameter do not survive the swap
    (they move with its data), which is why the experts' gradient division lives in their module
    (``ExpertParallelExperts.grad_scale``).
    """
    allocate(model, device)
    model.init_weights(seed, locate)


def allocate(model: nn.Module, device: torch.device | str) -> None:
    """Give ``model``'s meta tensors uninitialised storage on ``device``, keeping the parameter objects (and so
    the embedding's tie to the LM head: see ``materialize``). For a caller that fills every tensor itself
    (loading a trained model), which then skips the initialisation ``materialize`` would waste."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)


@dataclass(frozen=True)
class InitialWeights:
    """Weights a run starts from instead of its seed's initialisation (``train.py --init-from``).

    ``load`` fills a module's tensors (this rank's shards, as ``load_weights`` does) and returns how many it read;
    ``label`` names the source in messages. The checkpoint policy is handed one and calls it, so it needs to know
    nothing of file formats (``interop/weights.py`` makes them).
    """

    label: str
    load: Callable[[nn.Module], int]


class WeightSource(Protocol):
    """Tensors under the single-process model's names, read a box at a time (a file, or a converting reader)."""

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The global shape of ``name``, or None when the source has no such tensor."""

    def read(self, name: str, box: tuple[slice, ...]) -> Tensor:
        """The ``box`` (one slice per dim) of tensor ``name``."""


class SafetensorsWeights:
    """A safetensors file of our names (``interop/export.py`` writes one); slices are read in place (mmap)."""

    def __init__(self, handle):
        self.handle = handle
        self.names = set(handle.keys())

    def shape(self, name: str) -> tuple[int, ...] | None:
        return tuple(self.handle.get_slice(name).get_shape()) if name in self.names else None

    def read(self, name: str, box: tuple[slice, ...]) -> Tensor:
        source = self.handle.get_slice(name)
        return source[box] if box else source[:]


@torch.no_grad()
def load_weights(module: nn.Module, source: WeightSource, where: str) -> int:
    """Fill ``module``'s tensors (this rank's shards) from ``source``, reading only this rank's box of each.

    Every parameter and persistent buffer of ``module`` must be in the source with the single-process
    shape: the first that is missing or differs is named, with ``where`` (the file or folder). A pipeline
    stage reads only its own blocks' tensors. Returns the number of tensors read.
    """
    targets = dict(module.state_dict())
    for name, value in targets.items():
        shape = source.shape(name)
        if shape is None:
            raise ConfigError(f"{where}: has no tensor '{name}' that this model needs")
        target = locate(value)
        if shape != target.global_shape:
            raise ConfigError(f"{where}: tensor '{name}' has shape {shape}, this model needs "
                              f"{target.global_shape}; the file is of another model shape")
        box = tuple(slice(lo, lo + n) for lo, n in zip(target.offset, target.local.shape, strict=True))
        value = source.read(name, box)
        if target.local.is_floating_point():
            value = checked_weight(value, name, where)
        elif value.is_floating_point() or value.dtype == torch.bool:  # an integer table (hash routing's tid2eid)
            raise ConfigError(f"{where}: tensor '{name}' holds {value.dtype} values; this model's is an integer "
                              "table (the file is damaged or of another model)")
        target.local.copy_(value)
    return len(targets)


def checked_weight(value: Tensor, name: str, where: str) -> Tensor:
    """``value``, refused (naming the tensor and ``where`` it came from) when it cannot be a weight: integers where a
    float is wanted (the copy would cast them silently) or NaN/infinite entries (training would then stop at its
    first step with advice about the learning rate that cannot help)."""
    if not value.is_floating_point():
        raise ConfigError(f"{where}: tensor '{name}' holds {value.dtype} values; a weight must be a floating-point "
                          "tensor (the file is damaged or not a model's weights)")
    if not torch.isfinite(value).all():
        bad = int((~torch.isfinite(value)).sum())
        raise ConfigError(f"{where}: tensor '{name}' holds {bad:,} NaN or infinite value(s); a model's weights must "
                          "be finite (the file is damaged, or was saved from a diverged run)")
    return value


def load_weights_file(module: nn.Module, path: Path | str) -> int:
    """Fill ``module``'s tensors (this rank's shards) from a safetensors file of the single-process model.

    Streams tensor by tensor and reads from each only this rank's slice (safetensors maps the file and
    slices it in place), so peak memory is one shard, never a whole tensor or the model.
    """
    try:
        with safe_open(str(path), framework="pt") as handle:
            return load_weights(module, SafetensorsWeights(handle), str(path))
    except (OSError, SafetensorError) as exc:
        raise ConfigError(f"{path}: not a readable safetensors file ({exc})") from exc
