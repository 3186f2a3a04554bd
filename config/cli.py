"""The command-line contract every command of the toolkit follows, in one place.

Each command (``train.py``, ``launch.py``, the planning, interop, data and router tools; all listed as console
scripts in ``pyproject.toml``, and each still runs as ``python -m ...``) takes its config the same way
(``--config NAME|PATH``, ``--set KEY=VALUE ...``, ``--world-size N``: ``add_config_arguments``,
``add_world_size``, ``load_config_from``) and ends the same way (``run_command``): success is exit status 0;
every error the project names, and bad input met in a file, is one line on stderr (``error: ...``) and the
status ``config/errors.py`` gives it (2 a user error, 3 a diverged run, 130 interrupted); a bug keeps its
traceback. A command that writes files checks them first (``add_overwrite``, ``check_outputs``): an existing
output is replaced only with ``--overwrite``, and never one of the command's own inputs.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from config.errors import INTERRUPTED, ConfigError, describe, exit_status
from config.run import RunConfig, load_config


def command_parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    """A command's parser, described by the first line of its module's docstring ``doc``."""
    return argparse.ArgumentParser(prog=prog, description=(doc or "").strip().split("\n")[0])


def add_config_arguments(parser: argparse.ArgumentParser, default: str | None = "moe-8x",
                         set_help: str = "override config keys, e.g. --set train.steps=50 parallel.ep=2",
                         config_help: str = "config name in configs/ or a YAML path") -> None:
    """``--config`` (a name from ``configs/`` or a YAML path) and ``--set`` (repeatable; several may follow one)."""
    parser.add_argument("--config", default=default, help=config_help)
    parser.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help=set_help)


def add_world_size(parser: argparse.ArgumentParser, default: int | None = None, required: bool = False,
                   help: str = "number of ranks (GPUs) to plan for") -> None:
    """``--world-size N``; ``world_size_of`` checks it."""
    parser.add_argument("--world-size", type=int, default=default, required=required, metavar="N", help=help)


def world_size_of(args: argparse.Namespace) -> int:
    """``--world-size``, refused below 1."""
    if args.world_size < 1:
        raise ConfigError(f"--world-size must be at least 1, got {args.world_size}")
    return args.world_size


def add_overwrite(parser: argparse.ArgumentParser) -> None:
    """``--overwrite``: a command replaces an existing output only when asked; ``check_outputs`` applies it."""
    parser.add_argument("--overwrite", action="store_true",
                        help="replace outputs that already exist (never the command's own inputs)")


def check_outputs(outputs: list[Path], inputs: list[Path], overwrite: bool) -> None:
    """Refuse, before any work, an output that would replace a file the command reads (one of ``inputs``, or a
    file inside an input folder: even with ``--overwrite``, as the output is written while the input is read), or
    one that exists when ``overwrite`` is off. An existing folder counts as existing only when it holds files."""
    for out in outputs:
        target = out.resolve()
        for source in inputs:
            source = source.resolve()
            if target == source or (source.is_dir() and target.is_relative_to(source) and out.exists()):
                raise ConfigError(f"{out} would replace {'a file of ' if target != source else ''}the input "
                                  f"{source}, which this command reads; write it elsewhere")
        if not overwrite and out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ConfigError(f"{out} exists; pass --overwrite to replace it, or write elsewhere")


def load_config_from(args: argparse.Namespace, extra: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """The config ``--config`` names, with ``--set``'s overrides (then ``extra``) applied, validated."""
    return load_config(args.config, [*args.overrides, *extra])


def print_error(error: BaseException, status: int) -> None:
    """The one line a command prints for an error (nothing for one marked ``quiet``: another rank said it)."""
    if status == INTERRUPTED:
        print("interrupted", file=sys.stderr)
    elif not getattr(error, "quiet", False):
        print(f"error: {describe(error)}", file=sys.stderr)


def run_command(body: Callable[[], int | None],
                report: Callable[[BaseException, int], None] = print_error) -> int:
    """Run a command's ``body``; its exit status: ``body``'s own (None is 0), or the status of the error it raised,
    reported by ``report`` (one line on stderr by default). An error ``config/errors.py`` does not name is raised
    on, traceback and all: it is a bug to report."""
    try:
        return body() or 0
    except BaseException as error:  # KeyboardInterrupt too: it has a status of its own
        status = exit_status(error)
        if status is None:
            raise
        report(error, status)
        return status


def shell_command(script: str, module: str) -> str:
    """How to start one of the toolkit's commands in a new shell, as a run prints it for the person to paste.

    The console script's bare name only when a new shell finds that very script (on ``PATH``, and not because a
    virtual environment is activated in this shell only); else its path beside this Python (``make train`` runs
    ``.venv/bin/python``, and a new shell has no ``.venv/bin`` on ``PATH``); else this Python with ``-m MODULE``
    (the project run from a checkout, not installed). A path inside the working directory is shown relative to it.
    """
    beside = Path(sys.executable).parent / script
    if not beside.exists():
        return f"{_shown_path(Path(sys.executable))} -m {module}"
    found = shutil.which(script)
    activated = os.environ.get("VIRTUAL_ENV")
    if found and Path(found).resolve() == beside.resolve() and not (
            activated and beside.parent.resolve() == (Path(activated) / "bin").resolve()):
        return script
    return _shown_path(beside)


def _shown_path(path: Path) -> str:
    """``path`` relative to the working directory when inside it (``.venv/bin/moe-generate``), else absolute."""
    absolute = Path(os.path.abspath(path))
    cwd = Path.cwd()
    shown = str(absolute.relative_to(cwd)) if absolute.is_relative_to(cwd) else str(absolute)
    return shlex.quote(shown)
