"""The project's error types, and the exit status each one means on the command line.

Every command maps what it raises to an exit status here, in one place (``config/cli.py``), so a script or a
scheduler can tell the cases apart: something the person can fix (a bad config, an impossible layout, a
missing, unreadable or damaged file) is 2, a run that diverged is 3, an interrupt is 130. Anything else is a
bug and keeps its traceback.
"""

from __future__ import annotations

USER_ERROR = 2
DIVERGED = 3
INTERRUPTED = 130


class UserError(Exception):
    """Something the person running the command can fix: the message says what and how. Exit status 2."""


class ConfigError(UserError, ValueError):
    """A configuration value is unknown, mistyped or impossible."""


class DivergedError(RuntimeError):
    """Training stopped because its loss or gradient norm stopped being finite. Exit status 3."""


def exit_status(error: BaseException) -> int | None:
    """The exit status ``error`` means, or None for a bug (it should reach the user with its traceback).

    ``ValueError`` and ``OSError`` count as the user's: torch, numpy, safetensors and the file system raise them
    for bad input (a malformed file, a missing folder, a full disk) before any of our checks could.
    """
    if isinstance(error, KeyboardInterrupt):
        return INTERRUPTED
    if isinstance(error, DivergedError):
        return DIVERGED
    if isinstance(error, UserError | ValueError | OSError):
        return USER_ERROR
    return None


def describe(error: BaseException) -> str:
    """The one line a command prints for ``error``: an OS error names its file and cause, without errno."""
    if isinstance(error, OSError) and error.strerror:
        return f"{error.filename}: {error.strerror}" if error.filename else error.strerror
    return str(error)
