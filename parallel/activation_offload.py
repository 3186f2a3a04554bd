"""Activation offloading: what forward saves for backward waits in pinned host memory instead of the GPU.

``parallel.activation_offload`` picks whose saved tensors move (as SageMaker's model-parallel library and
Megatron-Core offer):

- ``none``: everything stays on the device.
- ``blocks``: every transformer block's saved activations.
- ``moe``: only the MoE layers' (router, permutation, experts, combine): the part that grows with top-k and
  expert width.

How: each offloaded module's forward runs under ``torch.autograd.graph.saved_tensors_hooks``. Packing a saved
tensor starts its copy to pinned host memory on a side stream (after the compute stream has produced it) and
keeps only the host copy, so the device memory is freed once the copy is done (``record_stream`` tells the
caching allocator). In backward, when the first tensor of module i is unpacked, the copies back of module i-1's
tensors start on the side stream: they overlap module i's backward, and each unpack waits only for its own
copy. So the device holds about two modules' saved activations at a time (the memory model counts two;
``analysis/memory_activations.py``), and the host holds one micro-batch's. Weights are never offloaded: they
live on anyway, whether parameters (FSDP's gathered ones too) or the experts' bf16 compute copies kept for
the step (``moe.experts.ComputeCopies``).

GPU only (on a CPU activations are in host memory already: ``parallel.hardware.check_hardware`` refuses it),
one micro-batch in flight at a time (no pipeline parallelism), and not combined with activation checkpointing
(which keeps less, by recomputing) or ``train.compile``: ``RunConfig.validate`` refuses those. Its behaviour on
a GPU (memory saved, time lost, overlap) is unmeasured so far (docs/gpu.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor, nn

from moe.experts import ComputeCopies
from moe.transformer import MoETransformer

MODES = ("none", "blocks", "moe")


@dataclass
class _Saved:
    """One offloaded tensor: its host copy, where it came from, and its copy back once started."""

    host: Tensor
    device: torch.device
    restored: Tensor | None = None
    ready: torch.cuda.Event | None = None


class ActivationOffloader:
    """The saved-tensor hooks of a model's offloaded modules, numbered in forward order (0, 1, ...)."""

    def __init__(self) -> None:
        self.saved: dict[int, list[_Saved]] = {}
        self.unpacked: set[int] = set()  # modules whose backward has begun (their predecessor is prefetched)
        self.weight_copies: dict[int, list[ComputeCopies]] = {}  # each module's kept weight copies: not offloaded
        self._stream: torch.cuda.Stream | None = None

    def wrap(self, module: nn.Module, index: int) -> None:
        """Run ``module``'s forward under this offloader's hooks, as module ``index`` (in place, names unchanged)."""
        module.forward = partial(self._forward, module.forward, index)
        self.weight_copies[index] = [copies for m in module.modules()
                                     if isinstance(copies := getattr(m, "compute_copies", None), ComputeCopies)]

    def _forward(self, forward, index: int, *args, **kwargs):
        self.saved[index] = []  # a new forward: the previous micro-batch's copies are spent
        self.unpacked.discard(index)
        with torch.autograd.graph.saved_tensors_hooks(partial(self._pack, index), partial(self._unpack, index)):
            return forward(*args, **kwargs)

    def _pack(self, index: int, tensor: Tensor):
        if not self._offloads(tensor) or self._is_weight_copy(index, tensor):
            return tensor
        saved = _Saved(self._to_host(tensor), tensor.device)
        self.saved[index].append(saved)
        return saved

    def _is_weight_copy(self, index: int, tensor: Tensor) -> bool:
        storage = tensor.untyped_storage().data_ptr()
        return any(copy.untyped_storage().data_ptr() == storage
                   for copies in self.weight_copies[index] for copy in copies.tensors())

    def _unpack(self, index: int, saved):
        if isinstance(saved, Tensor):
            return saved
        if index not in self.unpacked:  # module ``index``'s backward begins: bring back its predecessor's
            self.unpacked.add(index)
            for earlier in self.saved.get(index - 1, []):
                self._start_restore(earlier)
        if saved.restored is None:
            self._start_restore(saved)
        tensor, saved.restored = self._wait(saved), None  # autograd holds it now; a second unpack copies again
        return tensor

    # -- the copies: a side stream, pinned host memory ---------------------------------------------------------

    def _offloads(self, tensor: Tensor) -> bool:
        """Device activations only: parameters (FSDP's gathered ones too) are saved by reference and live on."""
        return tensor.device.type == "cuda" and not isinstance(tensor, nn.Parameter)

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _to_host(self, tensor: Tensor) -> Tensor:
        """A pinned host copy of ``tensor``, started on the side stream once the compute stream has made it."""
        stream = self._side_stream(tensor.device)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        host = torch.empty_like(tensor, device="cpu", pin_memory=True)
        with torch.cuda.stream(stream):
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(stream)  # the allocator reuses its memory only after the copy
        return host

    def _start_restore(self, saved: _Saved) -> None:
        if saved.restored is not None:
            return
        stream = self._side_stream(saved.device)
        with torch.cuda.stream(stream):
            saved.restored = saved.host.to(saved.device, non_blocking=True)
            saved.ready = stream.record_event()

    def _wait(self, saved: _Saved) -> Tensor:
        current = torch.cuda.current_stream(saved.device)
        current.wait_event(saved.ready)
        saved.restored.record_stream(current)
        return saved.restored


def apply_activation_offload(model: MoETransformer, mode: str) -> ActivationOffloader | None:
    """Offload the saved activations of ``model``'s blocks (``blocks``) or MoE layers (``moe``), in place."""
    if mode not in MODES:
        raise ValueError(f"activation offload mode '{mode}' is not one of {', '.join(MODES)}")
    if mode == "none":
        return None
    modules = model.blocks() if mode == "blocks" else list(model.moe_layers().values())
    offloader = ActivationOffloader()
    for index, module in enumerate(modules):
        offloader.wrap(module, index)
    return offloader
