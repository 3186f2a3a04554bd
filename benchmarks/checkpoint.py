"""Checkpoint throughput: save and load speed next to this machine's raw sequential write speed.

What is measured, in one process, on the model of ``--config`` (default moe-8x) with its AdamW state (one
optimizer step taken so the moments exist), in the folder ``--dir``:

- ``raw write``: the checkpoint's byte count written sequentially to one file in 8 MiB blocks and fsynced:
  what the disk gives a plain writer, the ceiling for a save;
- ``save``: ``training.checkpointing.Checkpointer.save`` as training runs it: state dicts, DCP files
  (fsynced), RNG and trainer state, SHA-256 manifest, rename, ``latest``;
- ``async save``: the same with ``checkpoint.async_save``: ``blocked`` is how long training waits (staging
  the tensors to memory), ``total`` until the checkpoint is published;
- ``verify``: re-hashing every file against the manifest (SHA-256), as a resume does first;
- ``load``: ``parallel.checkpoint.load_sharded`` into a fresh model and optimizer. The files were just
  written, so they are likely in the page cache: this is the software's cost more than the disk's.

Each figure is the median of ``--repeats`` runs; throughput is checkpoint bytes / seconds, and ``vs raw`` the
ratio to the raw write speed measured in the same run. A measurement, never a pass/fail test.

    python benchmarks/checkpoint.py [--config moe-8x] [--set key=value ...] [--repeats 3] [--dir PATH] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from config.run import load_config  # noqa: E402
from data.sampler import TokenSampler  # noqa: E402
from moe.transformer import MoETransformer  # noqa: E402
from parallel.checkpoint import load_sharded, published_checkpoints, verify  # noqa: E402
from parallel.groups import ParallelGroups  # noqa: E402
from parallel.layout import Layout  # noqa: E402
from parallel.runtime import Runtime  # noqa: E402
from training.checkpointing import Checkpointer  # noqa: E402
from training.optim import build_optimizer  # noqa: E402

BLOCK = 8 << 20


def raw_write_seconds(path: Path, size: int) -> float:
    """Seconds to write ``size`` bytes sequentially to ``path`` and fsync them."""
    block = np.random.default_rng(0).integers(0, 256, BLOCK, dtype=np.uint8).tobytes()
    started = time.perf_counter()
    with open(path, "wb") as handle:
        for offset in range(0, size, BLOCK):
            handle.write(block[:min(BLOCK, size - offset)])
        handle.flush()
        os.fsync(handle.fileno())
    seconds = time.perf_counter() - started
    path.unlink()
    return seconds


def trained_model(config_name: str, overrides: list[str]):
    """The config's model and an AdamW whose moments exist (one step on random gradients)."""
    config = load_config(config_name, overrides)
    model = MoETransformer(config.model, config.moe)
    optimizer = build_optimizer(model, config.train)
    for param in model.parameters():
        param.grad = torch.randn_like(param) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return config, model, optimizer


def measure(config_name: str, overrides: list[str], folder: Path, repeats: int) -> dict[str, dict[str, float]]:
    runtime = Runtime(0, 1, 0, torch.device("cpu"))
    groups = ParallelGroups.build(Layout.resolve(1), "cpu")
    sampler = TokenSampler(np.zeros(4096, dtype=np.uint16), 8, 0)
    times: dict[str, list[float]] = {"raw write": [], "save": [], "async save (total)": [],
                                     "async save (blocked)": [], "verify": [], "load": []}
    size = 0
    for repeat in range(repeats):
        for mode in ("false", "true"):
            config, model, optimizer = trained_model(config_name, [*overrides, f"checkpoint.async_save={mode}",
                                                      f"checkpoint.dir={folder}", "checkpoint.keep=1"])
            checkpointer = Checkpointer(config, folder, runtime, groups, resume="auto")
            checkpointer.save(repeat * 2 + (mode == "true") + 1, model, optimizer, sampler)
            # publishes it (a finite loss stands for the state's own: this state is not trained) after the write
            checkpointer.finish(checkpointer.last_saved_step, model, optimizer, sampler, val_loss=0.0)
            save = checkpointer.saves[-1]
            size = save["bytes"]
            if mode == "true":
                times["async save (total)"].append(save["seconds"])
                times["async save (blocked)"].append(save["blocked_s"])
            else:
                times["save"].append(save["seconds"])
        path = published_checkpoints(folder)[0][1]
        _, model, optimizer = trained_model(config_name, overrides)
        started = time.perf_counter()
        verify(path)
        times["verify"].append(time.perf_counter() - started)
        started = time.perf_counter()
        load_sharded(model, optimizer, path)
        times["load"].append(time.perf_counter() - started)
        times["raw write"].append(raw_write_seconds(folder / "raw.bin", size))
    raw_speed = size / statistics.median(times["raw write"])
    results = {}
    for name, values in times.items():
        seconds = statistics.median(values)
        speed = size / seconds
        results[name] = {"bytes": size, "seconds": seconds, "bytes_per_s": speed, "vs_raw": speed / raw_speed}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="moe-8x")
    parser.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[], metavar="KEY=VALUE")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary folder "
                        "under runs/, the disk checkpoints go to)")
    parser.add_argument("--json", type=Path, default=None, help="also write the settings and results here")
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    if args.dir is None:
        (ROOT / "runs").mkdir(exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix=".bench-checkpoint-", dir=ROOT / "runs"))
    else:
        folder = args.dir
        folder.mkdir(parents=True, exist_ok=True)
    try:
        results = measure(args.config, ["logging.wandb=disabled", *args.overrides], folder, args.repeats)
    finally:
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    size = next(iter(results.values()))["bytes"]
    print(f"checkpoint of --config {args.config}: {size / 1e6:.1f} MB (model + AdamW moments), "
          f"median of {args.repeats}, in {folder}")
    print(f"{'':22} {'seconds':>9} {'MB/s':>9} {'vs raw':>7}")
    for name, row in results.items():
        print(f"{name:22} {row['seconds']:9.3f} {row['bytes_per_s'] / 1e6:9.1f} {row['vs_raw']:7.2f}")
    print("(blocked: time training waits; for it, MB/s is the checkpoint size over the wait)")
    if args.json is not None:
        settings = {"config": args.config, "overrides": args.overrides, "repeats": args.repeats, "dir": str(folder)}
        args.json.write_text(json.dumps({"settings": settings, "results": results}, indent=2))


if __name__ == "__main__":
    main()
