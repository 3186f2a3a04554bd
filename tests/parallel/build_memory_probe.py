"""Build one rank's part of a model under a fake process group and print its memory as JSON (a test's probe).

    python tests/parallel/build_memory_probe.py WORLD_SIZE RANK KEY=VALUE...

Run in a fresh process so its peak resident memory (Linux's VmHWM, reset just before building) is the
build's own. Prints {"peak_bytes", "shard_bytes", "model_bytes"}: the rise of the peak over the resident
memory before building, the bytes of this rank's local parameter tensors, and of the whole model.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from config.run import load_config  # noqa: E402
from parallel.build import build_model  # noqa: E402
from parallel.groups import ParallelGroups  # noqa: E402
from parallel.resolve import resolve_layout  # noqa: E402


def resident(key: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(key))


def main(world_size: int, rank: int, overrides: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    config = load_config("moe-8x", [*overrides, "train.precision=fp32", "logging.wandb=disabled"])
    layout, micro, microbatches = resolve_layout(config, world_size)
    groups = ParallelGroups.build(layout, "cpu")
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # reset the peak (VmHWM) to the current resident memory
    before = resident("VmRSS:")
    model = build_model(config, groups, torch.device("cpu"), micro, microbatches, contextlib.nullcontext)
    peak = resident("VmHWM:") - before
    params = list(model.parameters())
    shard = sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in params)
    print(json.dumps({"peak_bytes": peak, "shard_bytes": shard, "model_bytes": sum(p.nbytes for p in params)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
