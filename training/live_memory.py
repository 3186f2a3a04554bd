"""The peak of live tensor bytes on a CPU, measured on some of a session's training steps: the quantity the memory
model predicts, and a GPU run logs as CUDA's peak allocated bytes.

A CPU has no ``max_memory_allocated``. Its resident set counts far more than tensors: the interpreter and torch's
libraries, freed memory glibc keeps for reuse (``parallel.hardware.keep_freed_memory`` asks it to) and oneDNN's
caches, growing with the steps (docs/planning-validation.md). So the run measures the tensors themselves: torch's
profiler with ``profile_memory`` reports every allocation and free of c10's CPU allocator, the one that every CPU
tensor's storage comes from (the temporaries inside an operator too), and the running sum of those events,
added to the bytes of the storages alive when the step starts, is the live tensor bytes at each moment; its
maximum is the step's peak.

Measuring costs time, mostly around the step: a ``moe-8x`` step (one thread) takes as long profiled as not, then
stopping the profiler and reading its 22,000 events back take 0.16 s and the scan of 300,000 Python objects for
the storages alive at the start (``gc.get_objects``) 0.21 s, against the step's 0.8 s (docs/planning-validation.md).
So a session measures its 1st, 2nd, 4th, 8th, ... steps (``measured_step``):
log2(N) + 1 of N steps, a few in a thousand, yet spread over the whole run. Both ends matter: the first step
starts without AdamW's moments (its update creates them) and the second holds them from its start; later, a
capacity-limited router that dropped a third of its tokens in the first steps (``moe-8x``) drops a few percent,
and the experts' activations grow with the rows they keep, towards the balanced routing the memory model assumes.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
from collections.abc import Iterator

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from moe import workspace
from parallel.hardware import gather_per_rank, peak_memory_bytes

GIB = 2**30
MEMORY_EVENT = "[memory]"  # the profiler's name for an allocator's allocation or free


def live_storages() -> dict[int, torch.UntypedStorage]:
    """Every CPU tensor storage reachable from Python now, by address (a storage shared by views once): what the
    process's tensors hold. A tensor subclass that wraps others (a DTensor) has no storage of its own and is
    counted through the tensors it wraps, which are Python objects too."""
    storages = {}
    for obj in gc.get_objects():
        # type(), not isinstance: the latter reads ``__class__``, which some module-level objects warn on
        if issubclass(type(obj), torch.Tensor) and obj.device.type == "cpu" and obj.layout == torch.strided:
            try:
                storage = obj.untyped_storage()
                address = storage.data_ptr()
            except (RuntimeError, NotImplementedError):  # a wrapper subclass (its inner tensors are counted), or
                continue  # a storage already released (an "invalid python storage" under FSDP's and DTensor's reuse)
            if address:
                storages[address] = storage
    return storages


def live_tensor_bytes() -> int:
    """The bytes of every CPU tensor storage reachable from Python now."""
    return sum(storage.nbytes() for storage in live_storages().values())


def held_before_model(device: torch.device, measured: bool = True) -> list[int]:
    """Each rank's memory before its model is built, in the quantity its peak is logged in: live tensor bytes on a
    CPU (0 where the peak is not ``measured``: ``logging.memory_peak``), CUDA's allocated bytes on a GPU (a
    collective over the default group)."""
    if device.type == "cpu":
        mine = live_tensor_bytes() if measured else 0
    else:
        mine = torch.cuda.memory_allocated(device)
    return [values[0] for values in gather_per_rank([mine], device)]


def measured_step(count: int) -> bool:
    """Whether a session's ``count``-th step (from 1) is measured: the powers of two."""
    return count >= 1 and count & (count - 1) == 0


class LiveTensorPeak:
    """The largest live tensor bytes seen in the measured steps (``measure``) on a CPU, and the memory figures a run
    logs (``metrics``)."""

    def __init__(self, device: torch.device, measured: bool = True):
        self.device = device
        self.measured = measured or device.type != "cpu"  # ``logging.memory_peak``: a CPU's costs time
        self.steps = 0  # of this session, measured or not
        self.peak = 0

    def metrics(self, per_rank: bool = False) -> dict[str, float | list[float]]:
        """``perf/memory_peak_gib``: the largest rank's peak, CUDA's peak allocated bytes on a GPU, the live tensor
        peak of the measured steps on a CPU (0 before the first); each rank's too with ``per_rank``. On a CPU also
        ``perf/memory_resident_peak_gib``, the largest rank's resident peak (the process's memory, tensors or
        not). One collective over the default group. A CPU run that does not measure (``logging.memory_peak:
        false``) logs the resident peak alone."""
        cpu = self.device.type == "cpu"
        mine = [self.peak, peak_memory_bytes(self.device)] if cpu else [peak_memory_bytes(self.device)]
        rows = gather_per_rank(mine, self.device)
        peaks = [row[0] / GIB for row in rows]
        metrics: dict[str, float | list[float]] = {}
        if self.measured:
            metrics["perf/memory_peak_gib"] = max(peaks)
            if per_rank:
                metrics["perf/memory_peak_gib_per_rank"] = peaks
        if cpu:
            metrics["perf/memory_resident_peak_gib"] = max(row[1] for row in rows) / GIB
        return metrics

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        """One step: measured if it is a measured step of the session (``measured_step``) on a CPU, else run as
        it is."""
        self.steps += 1
        if self.device.type != "cpu" or not self.measured or not measured_step(self.steps):
            yield
            return
        # kineto announces each profile on stderr at its USDT level, above ERROR: its own setting, unless set
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        # the storages alive now are kept alive while measured: the allocator reports no free of a block allocated
        # before the profile (c10 prints a warning instead), so such a block counts to the step's end either way
        held = live_storages()
        start = sum(storage.nbytes() for storage in held.values())
        # the layers' kept buffers (``moe.workspace``) bypassed: each tensor on one would be no allocator event
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, workspace.bypassed():
            yield
        events = sorted((event for event in prof.profiler.kineto_results.events()
                         if event.name() == MEMORY_EVENT and event.device_type() == DeviceType.CPU),
                        key=lambda event: event.start_ns())  # stable: events of one moment keep their order
        del held
        highest = max(itertools.accumulate((event.nbytes() for event in events), initial=0))  # the running sum's
        self.peak = max(self.peak, start + highest)
