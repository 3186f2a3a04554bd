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

from moe.config import ConfigError
from parallel.checkpoint import CheckpointCorruptError
from parallel.groups import ParallelGroups
from parallel.runtime import exit_process, init_runtime, shutdown_runtime
from training.config import load_config
from training.loop import NonFiniteLossError, resolve_layout, train


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="moe-8x", help="config name in configs/ or a YAML path")
    parser.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="override config keys, e.g. --set train.steps=50 moe.capacity_factor=null")
    parser.add_argument("--run-dir", type=Path, default=None, help="output directory (default runs/<config name>)")
    parser.add_argument("--resume", default="auto", metavar="auto|none|PATH",
                        help="auto: continue from the newest complete checkpoint in the run directory (default); "
                             "none: start fresh; PATH: a checkpoint folder, or a folder of them")
    parser.add_argument("--init-from", default=None, metavar="FILE",
                        help="start from the weights in a safetensors file (python -m training.export writes one)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        # everything is validated before any process group or tensor exists
        config = load_config(args.config, args.overrides)
        layout, _, _ = resolve_layout(config, int(os.environ.get("WORLD_SIZE", 1)))
        run_dir = args.run_dir or Path("runs") / config.name
        runtime = init_runtime()
        try:
            groups = ParallelGroups.build(layout, runtime.device.type)
            if runtime.is_main and layout.world_size > 1:
                print(groups.describe(), file=sys.stderr)
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
