"""Train an MoE language model.

    python train.py --config moe-8x
    torchrun --nproc-per-node 1 train.py --config moe-8x --set train.steps=100 moe.top_k=1

Started again with the same run directory it continues from the newest complete checkpoint
(``--resume none`` starts fresh, ``--resume PATH`` takes a given checkpoint); a run directory holds one
run at a time, and never mixes two (``training/run_dir.py``).
``--config`` takes a name from ``configs/`` or a YAML path; ``--set section.key=value``
overrides any key (repeatable, and several may follow one ``--set``); ``--run-dir``
defaults to ``runs/<config name>``. Exit status 0 on success; on any error the
message goes to stderr and the status is non-zero.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from moe.config import ConfigError
from parallel.checkpoint import CheckpointCorruptError
from parallel.groups import ParallelGroups
from parallel.runtime import exit_process, init_runtime, shutdown_runtime
from training.config import load_config
from training.hf import hf_run_config, split_init_from
from training.layout import resolve_layout
from training.loop import NonFiniteLossError, train


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
                             "or hf:DIR, a Hugging Face Mixtral folder whose config.json also sets the model shape")
    parser.add_argument("--dry-run", action="store_true",
                        help="build every rank's model on the meta device under a fake process group, print each "
                             "rank's model-state bytes beside the memory model's prediction, and exit: no training, "
                             "nothing allocated, any world size on one machine")
    parser.add_argument("--world-size", type=int, default=None, metavar="N",
                        help="with --dry-run: the number of ranks to plan for (default: WORLD_SIZE, or 1)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        # everything is validated before any process group or tensor exists
        config = load_config(args.config, args.overrides)
        hf_folder = split_init_from(args.init_from)
        if hf_folder is not None:  # the folder's config.json sets the model and router; the run records them
            config = hf_run_config(config, hf_folder)
        if args.world_size is not None and not args.dry_run:
            raise ConfigError("--world-size plans a --dry-run; a real run takes its world size from torchrun")
        world_size = args.world_size or int(os.environ.get("WORLD_SIZE", 1))
        if world_size < 1:
            raise ConfigError(f"--world-size must be at least 1, got {world_size}")
        if args.dry_run:
            from analysis.dry_run import dry_run, format_dry_run  # the CLI's one use of analysis/

            built, estimates = dry_run(config, world_size, "fp32" if config.train.precision == "fp32" else "bf16")
            print(format_dry_run(config, built, estimates, None))
            return 0
        layout, _, _ = resolve_layout(config, world_size)
        from analysis.fit_check import available_bytes_per_rank, check_fits  # the memory model, before any work

        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        compute = "bf16" if config.train.precision == "bf16" or (config.train.precision == "auto"
                                                                 and device_type == "cuda") else "fp32"
        needs = check_fits(config, world_size, available_bytes_per_rank(device_type), compute)
        run_dir = args.run_dir or Path("runs") / config.name
        runtime = init_runtime()
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
        if not getattr(exc, "quiet", False):  # quiet: another rank already said it (RunDirError)
            print(f"error: {exc}", file=sys.stderr)
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
