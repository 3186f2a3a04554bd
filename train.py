"""Train an MoE language model.

    python train.py --config moe-8x
    torchrun --nproc-per-node 1 train.py --config moe-8x --set train.steps=100 moe.top_k=1

Started again with the same run directory it continues from the newest complete checkpoint
(``--resume none`` starts fresh, ``--resume PATH`` takes a given checkpoint); a run directory holds one
run at a time, and never mixes two (``training/run_dir.py``).
``--config`` takes a name from ``configs/`` or a YAML path; ``--set section.key=value``
overrides any key (repeatable, and several may follow one ``--set``); ``--run-dir``
defaults to ``runs/<config name>``. Exit status 0 on success; on any error the
message goes to stderr and the status is non-zero (2 for a user error, 3 for a diverged run: README).
``python launch.py [torchrun options] train.py ...`` is torchrun that keeps those statuses and messages.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from analysis import fit_check
from analysis.dry_run import dry_run, format_dry_run
from analysis.memory import planned_precision
from moe.config import ConfigError
from parallel.checkpoint import CheckpointCorruptError
from parallel.groups import Layout, ParallelGroups
from parallel.runtime import exit_process, init_runtime, shutdown_runtime
from training.config import RunConfig, load_config
from training.data import check_tokenizer
from training.hardware import check_hardware, keep_freed_memory
from training.hf import hf_run_config, split_init_from
from training.layout import resolve_layout
from training.loop import NonFiniteLossError, train

# How long a worker other than its node's first waits before exiting with an error that every rank found before the
# job was joined (see main); torchrun ends it sooner, when the first rank has exited.
QUIET_RANK_GRACE_S = 10.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="moe-8x", help="config name in configs/ or a YAML path")
    parser.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="override config keys, e.g. --set train.steps=50 moe.capacity_factor=null")
    parser.add_argument("--run-dir", type=Path, default=None, help="output directory (default runs/<config name>)")
    parser.add_argument("--resume", default="auto", metavar="auto|none|PATH",
                        help="auto: continue from the newest complete checkpoint in the run directory (default); "
                             "none: start fresh; PATH: a checkpoint folder, or a folder of them")
    parser.add_argument("--init-from", default=None, metavar="FILE|hf:DIR",
                        help="start from the weights in a safetensors file (python -m training.export writes one), "
                             "or hf:DIR, a Hugging Face Mixtral or Qwen3-MoE folder whose config.json also sets "
                             "the model shape")
    parser.add_argument("--dry-run", action="store_true",
                        help="build every rank's model on the meta device under a fake process group, print each "
                             "rank's model-state bytes beside the memory model's prediction, and exit: no training, "
                             "nothing allocated, any world size on one machine")
    parser.add_argument("--world-size", type=int, default=None, metavar="N",
                        help="with --dry-run: the number of ranks to plan for (default: WORLD_SIZE, or 1)")
    return parser.parse_args(argv)


def planned_world_size(args: argparse.Namespace) -> int:
    """``--world-size`` (a --dry-run's), else torchrun's WORLD_SIZE, else 1."""
    return args.world_size if args.world_size is not None else int(os.environ.get("WORLD_SIZE", 1))


def check(args: argparse.Namespace, world_size: int | None = None) -> tuple[RunConfig, Layout | None]:
    """The config, after every check that needs no process: the config itself and, for a run, its layout on
    ``world_size`` ranks (default: WORLD_SIZE, or 1), returned beside it (None for a dry run); a ConfigError
    (or ValueError) otherwise. ``launch.py`` calls it before starting any worker."""
    config = load_config(args.config, args.overrides)
    hf_folder = split_init_from(args.init_from)
    if hf_folder is not None:  # the folder's config.json sets the model and router; the run records them
        config = hf_run_config(config, hf_folder)
    elif args.init_from is not None and not Path(args.init_from).is_file():
        raise ConfigError(f"--init-from {args.init_from}: no such file (a .safetensors file, as python -m "
                          "training.export writes, or hf:DIR for a Hugging Face folder)")
    if args.world_size is not None and not args.dry_run:
        raise ConfigError("--world-size plans a --dry-run; a real run takes its world size from torchrun")
    world_size = world_size or planned_world_size(args)
    if world_size < 1:
        raise ConfigError(f"--world-size must be at least 1, got {world_size}")
    layout = None if args.dry_run else resolve_layout(config, world_size)[0]
    if not args.dry_run:  # a dry run reads no data and plans for any hardware
        check_tokenizer(config.data.source, config.data.tokenizer, config.model.vocab_size)
        check_hardware(config, "cuda" if torch.cuda.is_available() else "cpu")
    if args.resume not in ("auto", "none") and not Path(args.resume).exists():
        raise ConfigError(f"--resume {args.resume}: no such folder (a step_NNNNNNN checkpoint folder or a folder of "
                          "them; or auto, none)")
    return config, layout


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = False  # whether this process joined the job: before that every rank finds the same errors
    try:
        # everything is validated before any process group or tensor exists
        config, layout = check(args)
        world_size = planned_world_size(args)
        if args.dry_run:
            built, estimates = dry_run(config, world_size, planned_precision(config.train.precision))
            print(format_dry_run(config, built, estimates, None))
            return 0
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        keep_freed_memory(device_type)
        compute = planned_precision(config.train.precision, device_type)
        needs = fit_check.check_fits(config, world_size, fit_check.available_bytes_per_rank(device_type), compute,
                                       device_type)
        run_dir = args.run_dir or Path("runs") / config.name
        runtime = init_runtime()
        started = True
        try:
            groups = ParallelGroups.build(layout, runtime.device.type)
            if runtime.is_main and layout.world_size > 1:
                print(groups.describe(), file=sys.stderr)
            if runtime.is_main:
                print("memory model: " + ", ".join(f"{need / 2**30:.2f} GiB" for need in needs)
                      + (" per rank of each pipeline stage" if len(needs) > 1 else " per rank")
                      + f" ({compute}; the run logs perf/memory_peak_gib to compare)", file=sys.stderr)
            train(config, run_dir, runtime, groups, resume=args.resume, init_from=args.init_from)
        finally:
            shutdown_runtime()
    except (ConfigError, ValueError, FileNotFoundError, CheckpointCorruptError) as exc:
        # quiet: another rank already said it (RunDirError). Before the job is joined every rank of a node finds the
        # same error in the same inputs, and its first rank alone says it; the others wait a moment before exiting,
        # because torchrun stops every worker as soon as one exits, and the first rank could be stopped unheard.
        if started or int(os.environ.get("LOCAL_RANK", 0)) == 0:
            if not getattr(exc, "quiet", False):
                print(f"error: {exc}", file=sys.stderr)
        else:
            time.sleep(QUIET_RANK_GRACE_S)
        return 2
    except NonFiniteLossError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    exit_process(main())  # not sys.exit: see parallel/runtime.py
