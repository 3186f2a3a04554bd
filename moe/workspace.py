"""Large CPU buffers kept between uses: the MoE layer's own caching allocator on a CPU.

On a GPU, PyTorch's caching allocator keeps freed blocks for the next allocation of their size. A CPU has no such
allocator: each storage comes from glibc's malloc, which serves anything of 32 MiB or more (and, until its
thresholds adapt, far smaller sizes) with a fresh ``mmap`` and returns it at free, and trims the top of its heap
once that is free. So a layer that allocates the same large temporaries at every step (the experts' hidden
activations and their gradients: [rows, hidden], 32 MiB in fp32 for the standard layer of
``benchmarks/moe_layer_library.py``) has every page of them faulted in and zeroed anew at every step: in that
layer, 277 MiB of pages per step in fp32 and 78 MiB in bf16 (``resource.getrusage``'s minor faults). A training
process can tell glibc to keep freed memory (``parallel.hardware.keep_freed_memory``, what ``train.py`` does), but
a user who imports the layer into their own trainer gets glibc's defaults; the layer then ran 0.76 of its floor's
speed in fp32 instead of 0.86 (docs/performance.md, issue 43).

Here a storage of 1 MiB or more (``MIN_BYTES``) is kept once allocated, and handed out again when nothing else
refers to it: ``torch._C._storage_Use_Count`` counts the tensors over a storage (every view, every tensor autograd
saved, every ``.grad`` holding it), so a buffer is reused only once the last of them is gone, whatever happened to
it in between (a backward run or not, a graph kept with ``retain_graph``, activation checkpointing, gradient
accumulation). A kept storage serves a request up to ``SLACK`` smaller than itself (the experts' rows vary from
step to step where groups are padded), so a tensor may sit on a storage slightly larger than its own bytes: what
memory measurement reads, and what the process holds. Idle storages are never more than those in use: when a
request finds none to reuse, the least recently used idle ones are released until that holds, and
``release_workspace()`` releases every idle one. Only CPU tensors are kept (``empty`` on other devices is
``torch.empty``): a GPU's caching allocator already does this. Measurements of memory read the allocator's
events, which a kept storage handed out again does not make: they run ``bypassed()``, and count what is in use,
as a GPU's allocated bytes do.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Iterator

import torch
from torch import Tensor

MIN_BYTES = 1 << 20  # smaller storages come from glibc's heap without faulting: not kept
SLACK = 1 / 16  # a kept storage serves requests down to this fraction smaller than itself


def _users(storage: torch.UntypedStorage) -> int:
    """How many tensors (and storage objects) refer to ``storage`` besides the workspace's own reference."""
    return torch._C._storage_Use_Count(storage._cdata) - 1


class Workspace:
    """Kept CPU storages, least recently handed out first."""

    def __init__(self):
        self._kept: deque[torch.UntypedStorage] = deque()
        self._lock = threading.Lock()  # threads-as-ranks tests and pipeline threads share the workspace

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """An uninitialised CPU tensor of ``shape`` and ``dtype``, on a kept storage when one is idle and fits."""
        size = torch.Size(shape)
        nbytes = size.numel() * dtype.itemsize
        if nbytes < MIN_BYTES:
            return torch.empty(size, dtype=dtype)
        with self._lock:
            storage = self._take(nbytes)
        return torch.empty(0, dtype=dtype).set_(storage, 0, size)

    def _take(self, nbytes: int) -> torch.UntypedStorage:
        for _ in range(len(self._kept)):
            storage = self._kept.popleft()
            self._kept.append(storage)  # most recently handed out (or found busy) last
            if nbytes <= storage.nbytes() <= nbytes * (1 + SLACK) and _users(storage) == 0:
                return storage
        self._trim(nbytes)
        storage = torch.UntypedStorage(nbytes)
        self._kept.append(storage)
        return storage

    def _trim(self, wanted: int) -> None:
        """Release the least recently used idle storages while they hold more bytes than the busy ones and the
        ``wanted`` bytes about to be handed out."""
        idle = [storage for storage in self._kept if _users(storage) == 0]
        idle_bytes = sum(storage.nbytes() for storage in idle)
        busy_bytes = sum(storage.nbytes() for storage in self._kept) - idle_bytes + wanted
        for storage in idle:  # least recently used first
            if idle_bytes <= busy_bytes:
                break
            self._kept.remove(storage)
            idle_bytes -= storage.nbytes()

    def release(self) -> None:
        """Release every idle storage (the busy ones stay kept, to be reused once their tensors are gone)."""
        with self._lock:
            self._kept = deque(storage for storage in self._kept if _users(storage) > 0)

    def storages(self) -> list[torch.UntypedStorage]:
        """Every storage kept now, idle or busy."""
        return list(self._kept)


_CPU_WORKSPACE = Workspace()
_bypassed = 0  # how many ``bypassed()`` contexts are open


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """``torch.empty(shape, dtype=dtype, device=device)``, from the workspace on a CPU."""
    if device.type != "cpu" or _bypassed or torch.compiler.is_compiling():  # compiled graphs plan their own buffers
        return torch.empty(shape, dtype=dtype, device=device)
    return _CPU_WORKSPACE.empty(shape, dtype)


def gather_rows(rows: Tensor, index: Tensor) -> Tensor:
    """``rows.index_select(0, index)``, on a kept buffer where autograd is not recording it (inside an autograd
    node's forward or backward: ``out=`` has no gradient)."""
    if torch.is_grad_enabled() and rows.requires_grad:
        return rows.index_select(0, index)
    out = empty((index.numel(), *rows.shape[1:]), rows.dtype, rows.device)
    return torch.index_select(rows, 0, index, out=out)


@contextlib.contextmanager
def bypassed() -> Iterator[None]:
    """Every buffer from the allocator while open: what a measurement of allocated memory must see
    (``training.live_memory`` reads the allocator's events; a kept storage handed out makes none)."""
    global _bypassed
    _bypassed += 1
    try:
        yield
    finally:
        _bypassed -= 1


def release_workspace() -> None:
    """Hand every idle kept storage back to the allocator (e.g. after training, before other work)."""
    _CPU_WORKSPACE.release()
