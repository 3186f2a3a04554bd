"""torchrun, with the training CLI's exit statuses and messages kept.

    python launch.py --standalone --nproc-per-node 2 train.py --set parallel.ep=2
    python launch.py --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 train.py ...

It takes exactly torchrun's options (``torch.distributed.run``'s own parser) and runs its launcher in this
process. Why: torchrun's elastic agent turns any worker's non-zero exit into its own ``ChildFailedError``
traceback and exit status 1, so a user error that ``train.py`` reports with one message and exit 2 reaches the
shell as a torchrun traceback. No worker can change that: the error-file mechanism
(``torch.distributed.elastic.multiprocessing.errors.record``) only puts a worker's message inside the same report,
and a worker exiting 0 to avoid it would report a failed run as a success. So this launcher

- refuses process and node counts torchrun would stop on with an ``AssertionError`` traceback (``--nproc-per-node
  0``, ``--nnodes 0``, ``--nnodes 2:1``), naming the option;
- checks ``train.py``'s config and layout before any worker starts (one message, exit 2, no worker started),
  when the world size is fixed (``--nnodes N`` and a number for ``--nproc-per-node``; the config alone otherwise);
- exits with the first failed worker's status when it is one of the CLI's own (2 a user error, 3 a diverged run,
  130 interrupted): the worker has printed the message, and the agent's report and traceback are left out;
- for any other failure (a crash, a signal) prints torchrun's failure report, without its traceback, and exits 1.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, parse_min_max_nnodes, run

from config.cli import run_command
from config.errors import DIVERGED, INTERRUPTED, USER_ERROR, ConfigError, describe, exit_status

# train.py's own exit statuses: the worker said what happened
CLI_STATUSES = {USER_ERROR, DIVERGED, INTERRUPTED}
# the elastic agent logs every worker failure at ERROR before anyone can tell a user error from a crash; a crash's
# details are printed below from the same failure record
AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"


# what torchrun takes for --nproc-per-node besides a number: one process per device of that kind
NPROC_NAMES = ("auto", "cpu", "gpu", "xpu")


def check_counts(nnodes: str, nproc_per_node: str) -> None:
    """Refuse a count of nodes or processes per node below one, or not a count, by its option (torchrun's own
    checks end in an ``AssertionError`` traceback far from the option's name)."""
    if nproc_per_node not in NPROC_NAMES:
        try:
            count = int(nproc_per_node)
        except ValueError:
            count = None
        if count is None or count < 1:
            raise ConfigError(f"--nproc-per-node {nproc_per_node}: give the processes to start on each node, at "
                              f"least 1 (or one of {', '.join(NPROC_NAMES)}: one per device of that kind)")
    try:
        low, high = parse_min_max_nnodes(nnodes)
    except (ValueError, RuntimeError):
        low = high = None
    if low is None or not 1 <= low <= high:
        raise ConfigError(f"--nnodes {nnodes}: give the number of nodes, at least 1, or a range MIN:MAX with "
                          "1 <= MIN <= MAX")


def fixed_world_size(nnodes: str, nproc_per_node: str) -> int | None:
    """The job's world size when the command fixes it, else None (an elastic range, or ``auto``/``gpu``)."""
    try:
        low, high = parse_min_max_nnodes(nnodes)
        return low * int(nproc_per_node) if low == high else None
    except (ValueError, RuntimeError):
        return None


def precheck(args) -> str | None:
    """``train.py``'s checks that need no process, for the world size of the command; the message, or None."""
    if args.module or args.no_python or Path(args.training_script).name != "train.py":
        return None
    import train  # the training CLI's own parser and checks; only for train.py
    try:
        train.check(train.parse_args(args.training_script_args), fixed_world_size(args.nnodes, args.nproc_per_node))
    except SystemExit as exc:  # argparse refused the arguments and printed why
        return "" if exc.code else None
    except Exception as exc:
        if exit_status(exc) != USER_ERROR:
            raise
        return describe(exc)
    return None


def launch(args) -> int:
    """Check, then run torchrun's launcher; the exit status."""
    check_counts(args.nnodes, args.nproc_per_node)
    sys.path.insert(0, str(Path(args.training_script).resolve().parent))
    message = precheck(args)
    if message is not None:
        if message:
            print(f"error: {message}", file=sys.stderr)
        return USER_ERROR
    logging.getLogger(AGENT_LOGGER).setLevel(logging.CRITICAL)
    try:
        run(args)
    except ChildFailedError as exc:
        _, failure = exc.get_first_failure()
        if failure.exitcode in CLI_STATUSES:
            return failure.exitcode
        print(f"error: a worker failed (exit status {failure.exitcode}); torchrun's report:\n{exc.format_msg()}",
              file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    return run_command(lambda: launch(args))


if __name__ == "__main__":
    sys.exit(main())
