"""Atomic writes and file digests, shared by the checkpoints (``parallel/checkpoint.py``), the token cache
(``data/cache.py``), exports and the run directory.

A reader of a path written here sees its old content or its new content, never a mix: the new content goes to a
temporary file (or folder) of its own beside the path and is renamed over it once written. Digests are SHA-256
in hex, read in chunks so memory stays bounded whatever the file's size (the checkpoints' manifests and the token
cache's racy-file records hold them, so the algorithm and format are part of those files' meaning).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import IO

HASH_CHUNK = 1 << 22  # bytes read at a time while hashing; the digest does not depend on it
# open()'s modes for the files a run writes in place (its lock, its appended logs), as os.open flags
_OWN_FILE_FLAGS = {"a": os.O_WRONLY | os.O_CREAT | os.O_APPEND, "a+": os.O_RDWR | os.O_CREAT | os.O_APPEND,
                   "r+b": os.O_RDWR}


def sha256_file(path: Path | str) -> str:
    """The SHA-256 of the file at ``path``, in hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_dir(path: Path) -> None:
    """Sync the folder ``path`` itself: the entries renamed or created in it reach the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_output(path: Path, mode: str = "wb", encoding: str | None = None, *, permissions: int | None = None,
                  durable: bool = True, suffix: str = "partial") -> Iterator[IO]:
    """A file to write ``path``'s new content into, published whole when the block ends without an error.

    The content goes to a temporary file of its own beside ``path`` (``.<name>.<pid>.<random>.<suffix>``, a
    unique name: two writers of one path at once never write into the same file) and is renamed over ``path``
    once written, so a reader sees the old or the new content, never a mix, and of two concurrent writers the
    last to finish wins whole. On an error (a full disk, an interrupt) the temporary file is removed and ``path``
    is left as it was.

    ``durable``: the file is synced before the rename and the folder after it, so the new content survives a
    power loss once the block has ended. ``permissions``: the file's mode whatever the umask (a shared cache's
    files must be readable by every user); by default the umask applies, as to any new file.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.{suffix}")
    descriptor = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(descriptor, mode, encoding=encoding) as handle:
            if permissions is not None:
                os.fchmod(handle.fileno(), permissions)
            yield handle
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_folder(path: Path) -> Iterator[Path]:
    """A folder to write ``path``'s new content into, published whole when the block ends without an error: the
    folder ``atomic_output`` is for a file. An existing ``path`` is renamed aside, the new folder renamed into
    place, then the old one removed: a reader finds the old folder, the new one or (for that instant) none, never
    a mix of two exports; of two concurrent writers the last to publish wins whole. On an error (a full disk, an
    interrupt) the new folder is removed and ``path`` is left as it was."""
    tag = f"{os.getpid()}.{secrets.token_hex(4)}"
    tmp, old = path.with_name(f".{path.name}.{tag}.partial"), path.with_name(f".{path.name}.{tag}.replaced")
    tmp.mkdir()
    try:
        yield tmp
        fsync_dir(tmp)
        if path.exists():
            os.replace(path, old)
        try:
            os.replace(tmp, path)
        except BaseException:
            if old.exists():
                os.replace(old, path)
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    fsync_dir(path.parent)


def open_own_file(path: Path, mode: str, encoding: str | None = None, errors: str | None = None) -> IO:
    """Open ``path``, a file its caller owns and writes in place (a run's lock, its appended logs), without
    following a symbolic link there: a link in a run directory must not make a run empty or extend a file
    elsewhere (its target may be anything the user can write). A link is refused with an ``OSError`` that names
    the path and says what to do. ``mode``: "a", "a+" (text) or "r+b"."""
    try:
        descriptor = os.open(path, _OWN_FILE_FLAGS[mode] | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "is a symbolic link; a run writes only files of its own and does not follow "
                          "links there: remove the link (its target is left as it is)", str(path)) from None
        raise
    return os.fdopen(descriptor, mode, encoding=encoding, errors=errors)


def remove_tree(path: Path) -> None:
    """Remove the folder ``path`` that its caller owns (a temporary folder it is about to write again), or a
    symbolic link standing in its place: the link alone, never what it points to (``shutil.rmtree`` refuses a
    link, and writing into the path afterwards would follow it). Whatever cannot be removed is left."""
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` (UTF-8, durable) so a reader sees the old or the new content, never a mix."""
    with atomic_output(path, "w", encoding="utf-8") as handle:
        handle.write(text)
