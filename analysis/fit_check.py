"""Refuse, before any work, a layout whose ranks the memory model says will not fit this machine.

``train.py`` calls ``check_fits`` after the layout is validated and before any process group or tensor
exists. The need is the memory model's (``analysis.memory.estimate``: model states, FSDP's gathered
weights, activations, logits) for each pipeline rank; what a rank has is the free memory of its GPU
(``torch.cuda.mem_get_info``) or, on a CPU, the machine's available memory (``MemAvailable``) shared by the
ranks ``torchrun`` starts on it (``LOCAL_WORLD_SIZE``). A layout that needs more is an error that names the
pipeline rank, the bytes needed and available, and the fastest layouts of the same world size that fit
(``analysis.planner``). The check covers what the model predicts; the interpreter, CUDA context and
allocator slack come on top, so passing it is necessary, not sufficient.
"""

from __future__ import annotations

import torch

from analysis.memory import GIB, estimate
from analysis.planner import plan
from config.errors import ConfigError
from config.run import RunConfig
from parallel.resolve import ResolvedLayout
from parallel.runtime import launch_environment


def available_bytes_per_rank(device_type: str) -> int | None:
    """Memory one rank of this machine can use now, or None where it cannot be read."""
    if device_type == "cuda":
        local = launch_environment().local_rank % torch.cuda.device_count()
        return torch.cuda.mem_get_info(local)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            kib = next(int(line.split()[1]) for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None
    return kib * 1024 // launch_environment().local_world_size


def predicted_bytes(config: RunConfig, resolved: ResolvedLayout, precision: str, device_type: str = "cuda"
                    ) -> list[int]:
    """The memory model's peak for one rank of each pipeline stage of ``resolved`` (``resolve_layout``'s)."""
    world_size = resolved.layout.world_size
    return [estimate(config, world_size, precision, pp_rank, resolved, device_type).total
            for pp_rank in range(resolved.layout.pp)]


def check_fits(config: RunConfig, resolved: ResolvedLayout, available: int | None, precision: str,
               device_type: str = "cuda") -> list[int]:
    """Each pipeline stage's predicted bytes per rank; ConfigError when one exceeds ``available`` (None: no check)."""
    needs = predicted_bytes(config, resolved, precision, device_type)
    worst = max(range(len(needs)), key=lambda pp_rank: needs[pp_rank])
    if available is None or needs[worst] <= available:
        return needs
    layout = resolved.layout
    world_size = layout.world_size
    stage = f"the ranks of pipeline stage {worst}" if len(needs) > 1 else "every rank"
    fitting = plan(config, world_size, available, top=3)[0]
    advice = ("; layouts of this world size that fit, fastest first: "
              + " | ".join(f"{p.describe()} ({p.memory / GIB:.2f} GiB)" for p in fitting) if fitting else
              f"; no layout of {world_size} rank(s) fits: use more ranks, a smaller train.micro_batch_size, "
              "or a smaller model")
    raise ConfigError(f"not enough memory: {stage} of {layout.degrees()} need(s) {needs[worst] / GIB:.2f} GiB "
                      f"(the memory model: python -m analysis.memory --config {config.name} --world-size "
                      f"{world_size}), but a rank here has {available / GIB:.2f} GiB available{advice}")
