"""Train an MoE language model.

    python train.py --config moe-8x
    torchrun --nproc-per-node 1 train.py --config moe-8x --set train.steps=100 moe.top_k=1

Started again with the same run directory it continues from the newest complete checkpoint
(``--resume none`` starts fresh, ``--resume PATH`` takes a given checkpoint); a run directory holds one
run at a time, and never mixes two (``training/run_dir.py``).
``--config`` takes a name from ``configs/`` or a YAML path; ``--set section.key=value``
overrides any key (repeatable, and several may follow one ``--set``); ``--run-dir``
defaults to ``runs/<config name>``. Exit status 0 on success; on any error the
message goes to stderr and the status is non-zero (2 for a user error, 3 for a diverged run: ``config/cli.py``).
``python launch.py [torchrun options] train.py ...`` is torchrun that keeps those statuses and messages.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from analysis import fit_check
from analysis.dry_run import dry_run, format_dry_run
from analysis.gpu_presets import HARDWARE, Hardware, hardware_with
from analysis.memory import DEFAULT_HEADROOM, usable_bytes
from config.cli import add_config_arguments, add_world_size, command_parser, load_config_from, print_error, run_command
from config.errors import USER_ERROR, ConfigError
from config.run import RunConfig
from data.cache import check_source
from data.tokenizer import document_end_token
from interop.hf import FAMILIES, hf_run_config, split_init_from
from interop.hf_tokenizer import check_vocabularies
from interop.weights import check_file_tokenizer, initial_weights
from parallel.groups import ParallelGroups
from parallel.hardware import (
    check_hardware,
    choose_precision,
    keep_freed_memory,
    planned_precision,
)
from parallel.resolve import ResolvedLayout, resolve_layout
from parallel.runtime import exit_process, init_runtime, launch_environment, local_device, shutdown_runtime
from training.loop import train
from training.metrics import check_loggers
from training.resume import recorded_config
from training.run_plots import check_plots_folder

# How long a worker other than its node's first waits before exiting with an error that every rank found before the
# job was joined (see main's report); torchrun ends it sooner, when the first rank has exited.
QUIET_RANK_GRACE_S = 10.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = command_parser("moe-train", __doc__)
    add_config_arguments(parser)
    parser.add_argument("--run-dir", type=Path, default=None, help="output directory (default runs/<config name>)")
    parser.add_argument("--resume", default="auto", metavar="auto|none|PATH",
                        help="auto: continue from the newest complete checkpoint in the run directory (default); "
                             "none: start fresh; PATH: a checkpoint folder, or a folder of them")
    parser.add_argument("--init-from", default=None, metavar="FILE|hf:DIR",
                        help="start from the weights in a safetensors file (python -m interop.export writes one), "
                             "or hf:DIR, a Hugging Face folder of one of the families "
                             f"{', '.join(FAMILIES)} (Kimi K2's as DeepSeek-V3's), whose config.json also sets the "
                             "model shape")
    parser.add_argument("--dry-run", action="store_true",
                        help="build every rank's model on the meta device under a fake process group, print each "
                             "rank's model-state bytes beside the memory model's prediction and a verdict on "
                             "whether the busiest rank fits --gpu's memory less --headroom, and exit: no training, "
                             "nothing allocated, any world size on one machine")
    add_world_size(parser, help="with --dry-run: the number of ranks to plan for (default: WORLD_SIZE, or 1)")
    parser.add_argument("--gpu", default=None, choices=list(HARDWARE),
                        help="with --dry-run: the GPU whose memory the verdict is against (default h100)")
    parser.add_argument("--device-memory", type=float, default=None, metavar="GiB",
                        help="with --dry-run: GiB per GPU for the verdict (default: the --gpu preset's)")
    parser.add_argument("--headroom", type=float, default=None,
                        help=f"with --dry-run: the fraction of that memory kept free (default {DEFAULT_HEADROOM}: "
                             "CUDA context, NCCL, allocator fragmentation)")
    return parser.parse_args(argv)


def planned_world_size(args: argparse.Namespace) -> int:
    """``--world-size`` (a --dry-run's), else torchrun's WORLD_SIZE, else 1."""
    return args.world_size if args.world_size is not None else launch_environment().world_size


def run_dir_of(args: argparse.Namespace, config: RunConfig) -> Path:
    """``--run-dir``, by default ``runs/<config name>``."""
    return args.run_dir or Path("runs") / config.name


def verdict_gpu(args: argparse.Namespace) -> Hardware:
    """The GPU a --dry-run's verdict is against: ``--gpu`` (default H100), with ``--device-memory`` if given."""
    return hardware_with(args.gpu or "h100", memory_gib=args.device_memory)


def verdict_headroom(args: argparse.Namespace) -> float:
    return DEFAULT_HEADROOM if args.headroom is None else args.headroom


# above this, a learning rate is a pre-training one: fine-tuning a trained model takes about 1e-6 to 5e-5 (Llama 2's
# supervised fine-tuning 2e-5, Touvron et al. 2023 sec. 3.1); DeepSeek-V3 pre-trained at 2.2e-4
FINE_TUNING_LR_LIMIT = 1e-4


def fine_tuning_lr_warning(config: RunConfig) -> str | None:
    """The warning for a run that starts from a published model (``--init-from hf:DIR``) at a pre-training rate,
    which can undo in a few hundred steps what the model learnt; None for a fine-tuning rate."""
    lr = config.train.lr
    if lr <= FINE_TUNING_LR_LIMIT:
        return None
    return (f"warning: --init-from hf: fine-tunes a trained model at train.lr={lr:g}, a pre-training rate (above "
            f"{FINE_TUNING_LR_LIMIT:g}) that can wreck its weights in the first steps; fine-tuning takes about "
            "1e-5 to 5e-5 (--set train.lr=2e-5)")


def check(args: argparse.Namespace, world_size: int | None = None) -> tuple[RunConfig, ResolvedLayout]:
    """The config and its layout on ``world_size`` ranks (default: ``--world-size``, WORLD_SIZE, or 1), after every
    check that needs no process; a ConfigError (or ValueError) otherwise. The layout is resolved here once and
    passed on whole. ``launch.py`` calls this before starting any worker."""
    launch_environment()  # torchrun's variables, when set, are well formed
    if args.resume not in ("auto", "none") and not Path(args.resume).exists():
        raise ConfigError(f"--resume {args.resume}: no such folder (a step_NNNNNNN checkpoint folder or a folder of "
                          "them; or auto, none)")
    config = load_config_from(args)
    hf_folder = split_init_from(args.init_from)
    if hf_folder is not None:  # the folder's config.json sets the model and router; the run records them
        config = hf_run_config(config, hf_folder)  # and the folder's tokenizer.json for the data
        check_vocabularies(config, hf_folder)
        if (warning := fine_tuning_lr_warning(config)) and os.environ.get("RANK", "0") == "0":
            print(warning, file=sys.stderr)
    elif args.init_from is not None and not Path(args.init_from).is_file():
        raise ConfigError(f"--init-from {args.init_from}: no such file (a .safetensors file, as python -m "
                          "interop.export writes, or hf:DIR for a Hugging Face folder)")
    elif args.init_from is not None:
        check_file_tokenizer(Path(args.init_from), config)
    if not args.dry_run:  # a resumed run goes on with its own settings, changed only where --set says
        config = recorded_config(config, args.overrides, run_dir_of(args, config), args.resume)
    if args.world_size is not None and not args.dry_run:
        raise ConfigError("--world-size plans a --dry-run; a real run takes its world size from torchrun")
    for flag, value in (("--gpu", args.gpu), ("--device-memory", args.device_memory), ("--headroom", args.headroom)):
        if value is not None and not args.dry_run:
            raise ConfigError(f"{flag} sets the --dry-run's memory verdict; a real run checks its own device's memory")
    if args.dry_run:  # the verdict's figures, checked with the rest
        usable_bytes(verdict_gpu(args).memory_gib, verdict_headroom(args))
    world_size = world_size or planned_world_size(args)
    if world_size < 1:
        raise ConfigError(f"--world-size must be at least 1, got {world_size}")
    resolved = resolve_layout(config, world_size)
    if not args.dry_run:  # a dry run reads no data and plans for any hardware
        check_loggers(config.logging.tensorboard)
        resolved_end = config.data.document_end  # "auto" resolved against the tokenizer (a .bin has none)
        for corpus in config.data.corpora() + config.data.validation_sets():
            skipped, end = check_source(corpus.path, config.data.tokenizer, config.model.vocab_size,
                                        corpus.text_key, config.data.skip, config.data.document_end)
            resolved_end = resolved_end if corpus.path.endswith(".bin") else end
            if skipped and os.environ.get("RANK", "0") == "0":
                print(skipped, file=sys.stderr)
        config.data.document_end = resolved_end
        if config.data.document_mask:  # the one token that ends each document, or a ConfigError saying what would
            document_end_token(config.data.tokenizer, resolved_end, config.model.vocab_size)
        check_hardware(config, local_device().type)
    return config, resolved


def memory_banner(needs: list[int], precision: str, device_type: str) -> str:
    """The start-up line that predicts the peak the run will log as perf/memory_peak_gib, and says which quantity
    both are: live tensor bytes. A GPU run logs CUDA's peak allocated bytes (not the caching allocator's reserve);
    a CPU run measures the live tensor peak of some of its steps (``training.live_memory``), since its resident set
    also holds what glibc keeps of freed memory and oneDNN's caches (logged apart, docs/planning-validation.md)."""
    stages = " per rank of each pipeline stage" if len(needs) > 1 else " per rank"
    text = ("memory model: " + ", ".join(f"{need / 2**30:.2f} GiB" for need in needs)
            + f" of live tensors{stages} ({precision}; ")
    if device_type == "cpu":
        return text + ("the run measures the live tensor peak of its steps 1, 2, 4, 8, ... as perf/memory_peak_gib "
                       "to compare; the resident set, which also holds freed memory glibc keeps and oneDNN's caches, "
                       "is logged apart as perf/memory_resident_peak_gib)")
    return text + "allocated, not reserved: the run logs perf/memory_peak_gib to compare)"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    joined = False  # whether this process joined the job: before that every rank finds the same errors

    def report(error: BaseException, status: int) -> None:
        """Before the job is joined every rank of a node finds the same user error in the same inputs, and its
        first rank alone says it; the others wait a moment before exiting, because torchrun stops every worker as
        soon as one exits, and the first rank could be stopped unheard."""
        node_peer = os.environ.get("LOCAL_WORLD_SIZE", "1") != "1" and os.environ.get("LOCAL_RANK", "0") != "0"
        if status == USER_ERROR and not joined and node_peer:
            time.sleep(QUIET_RANK_GRACE_S)
        else:
            print_error(error, status)

    def body() -> int:
        nonlocal joined
        # everything is validated before any process group or tensor exists; the layout and the precision are
        # resolved once here, and the memory check and the run take them as they are
        config, resolved = check(args)
        if args.dry_run:
            gpu, headroom = verdict_gpu(args), verdict_headroom(args)
            built, estimates = dry_run(config, resolved, planned_precision(config.train.precision))
            print(format_dry_run(config, built, estimates, gpu.memory_gib, headroom,
                                 gpu.name if args.device_memory is None else ""))
            return 0
        device = local_device()
        keep_freed_memory(device.type)
        precision = choose_precision(config.train.precision, device)
        needs = fit_check.check_fits(config, resolved, fit_check.available_bytes_per_rank(device.type),
                                     precision.precision, device.type)
        init_weights = initial_weights(args.init_from, config) if args.init_from else None
        run_dir = run_dir_of(args, config)
        if config.logging.plots:  # written at the end: a path that cannot take them is refused now
            check_plots_folder(run_dir)
        runtime = init_runtime()
        joined = True
        try:
            groups = ParallelGroups.build(resolved.layout, runtime.device.type)
            if runtime.is_main and resolved.layout.world_size > 1:
                print(groups.describe(), file=sys.stderr)
            if runtime.is_main:
                print(memory_banner(needs, precision.precision, device.type), file=sys.stderr)
            train(config, run_dir, runtime, groups, resume=args.resume, init_weights=init_weights,
                  resolved=resolved, precision=precision, memory_predicted=needs)
        finally:
            shutdown_runtime()
        return 0

    return run_command(body, report)


def cli() -> None:
    """The ``moe-train`` console script: ``main``, ended as ``exit_process`` ends it (see parallel/runtime.py)."""
    exit_process(main())


if __name__ == "__main__":
    cli()
