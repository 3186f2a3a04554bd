"""Building a token cache safely among many processes: one builder per cache folder, the others wait; progress.

Every rank of a job (and every node, on a shared file system) asks for the same cache at start. The first to take
``build_lock`` (an exclusive ``flock`` on the cache folder itself, so no lock file is left behind, and a builder
that dies releases it with its process) tokenises; the others wait, then find the finished cache and map it,
so the work is done once and nobody races on a half-written file. A waiter says what it waits for, and after
``WAIT_SECONDS`` gives up with a message naming the folder. A file system without locks (some network mounts)
gets no exclusion: each process then builds into its own temporary file, as before, and the atomic rename keeps
the result whole.

``Progress`` prints what a long build has done, and its ETA from the bytes read, every ``REPORT_SECONDS``.
"""

from __future__ import annotations

import errno
import fcntl
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

WAIT_SECONDS = 6 * 3600.0  # how long a process waits for another's build before giving up
POLL_SECONDS = 0.5
REPORT_SECONDS = 10.0


@contextmanager
def build_lock(cache_dir: Path, what: str) -> Iterator[bool]:
    """Hold the cache folder's build lock; yields True, or False where the file system has no locks."""
    fd = os.open(cache_dir, os.O_RDONLY)
    try:
        waited_since, told = time.monotonic(), False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
                break
            except BlockingIOError:
                waited = time.monotonic() - waited_since
                if not told:
                    print(f"waiting for another process to finish building a token cache in {cache_dir} "
                          f"(needed: {what})", file=sys.stderr)
                    told = True
                if waited > WAIT_SECONDS:
                    raise ValueError(
                        f"data.cache_dir={str(cache_dir)!r}: waited {waited:.0f} s for another process to finish "
                        f"building a token cache there (needed: {what}); if no process is building one, something "
                        "holds the folder's lock: stop it, or prepare the cache ahead with `python -m data.prepare "
                        "--config NAME`") from None
                time.sleep(POLL_SECONDS)
            except OSError as error:
                if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
                held = False
                break
        yield held
    finally:
        os.close(fd)  # releases the lock


class Progress:
    """Reports a build's progress on stderr every ``REPORT_SECONDS``: files, bytes, tokens, and an ETA."""

    def __init__(self, what: str, files: int, total_bytes: int, done_bytes: int = 0):
        self.what, self.files, self.total_bytes = what, files, max(total_bytes, 1)
        self.start_bytes = done_bytes
        self.started = self.last = time.monotonic()

    def update(self, files_done: int, bytes_done: int, tokens: int) -> None:
        now = time.monotonic()
        if now - self.last < REPORT_SECONDS:
            return
        self.last = now
        rate = (bytes_done - self.start_bytes) / max(now - self.started, 1e-9)
        eta = (self.total_bytes - bytes_done) / rate if rate > 0 else float("inf")
        print(f"tokenising {self.what}: {files_done}/{self.files} files, {bytes_done / 2**20:,.0f} of "
              f"{self.total_bytes / 2**20:,.0f} MiB ({100 * bytes_done / self.total_bytes:.0f}%), {tokens:,} tokens, "
              f"{rate / 2**20:.1f} MiB/s, ETA {eta:,.0f} s", file=sys.stderr)
