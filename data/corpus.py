"""A text corpus: which documents ``data.source`` names, in an order every machine agrees on.

``"stdlib"`` is the running Python's standard-library ``.py`` sources; a folder is every non-hidden regular
file under it; a file is itself. The listing carries what identifies it (the root and every file's relative
path and stat signature), which ``data/cache.py`` hashes into the name of the token cache. Both the token
cache and the tokenizer trainer (``data/tokenizer.py``) read the documents from here, so they see the
same text in the same order.
"""

from __future__ import annotations

import codecs
import os
import re
import stat
import sys
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

# A file with a NUL byte this early is almost surely not text (the heuristic git and grep use).
BINARY_SNIFF_BYTES = 8192
CHUNK_BYTES = 1 << 24

VALID_SOURCES = "use 'stdlib', a text file or folder, or a uint16 .bin file"

# (relative posix path, absolute path, stat) of one corpus document.
Document = tuple[str, Path, os.stat_result]


@dataclass(frozen=True)
class Corpus:
    """The documents of a text source, sorted by relative path, and what identifies the listing."""

    documents: list[Document]
    label: str  # a readable prefix for cache file names
    key: list  # JSON-serialisable: the root and every document's (path, size, mtime, ctime)
    skip_binary: bool  # whether files that look binary are left out (a folder may hold images; stdlib has none)


def list_corpus(source: str) -> Corpus:
    """The documents of ``source`` ("stdlib", a text file or a folder); a ValueError naming it otherwise."""
    if source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        # Third-party packages installed into the interpreter are not the standard library, and
        # would make the corpus differ between machines.
        docs = _walk(
            root,
            keep=lambda name: name.endswith(".py"),
            prune=lambda name: name in ("site-packages", "dist-packages"),
        )
        key = [sys.version, str(root), [(rel, *signature(st)) for rel, _, st in docs]]
        return Corpus(docs, "stdlib", key, skip_binary=False)
    path = Path(source).resolve()
    if path.is_dir():
        # Hidden entries (.git, .cache, editor files) are not corpus text; skipping them also keeps
        # a cache_dir inside the folder from changing the folder's own hash on every call.
        docs = _walk(path, keep=lambda name: not _is_hidden(name), prune=_is_hidden)
    elif path.is_file():
        docs = [(path.name, path, path.stat())]
    else:
        raise ValueError(f"data.source={source!r}: no such file or folder; {VALID_SOURCES}")
    key = [str(path), [(rel, *signature(st)) for rel, _, st in docs]]
    label = "text-" + re.sub(r"[^A-Za-z0-9_.-]", "_", path.name)[:40]
    return Corpus(docs, label, key, skip_binary=True)


def looks_binary(first_chunk: bytes) -> bool:
    """A NUL byte in the first ``BINARY_SNIFF_BYTES``: almost surely not text."""
    return b"\0" in first_chunk[:BINARY_SNIFF_BYTES]


def document_texts(corpus: Corpus) -> Iterator[str]:
    """Each text document's content as ``str`` (UTF-8, undecodable bytes replaced), in corpus order, read in
    chunks; binary files are skipped where the corpus says so. For the tokenizer trainer; the token cache
    reads the files itself (``data/cache.py``), checking each against its listed signature."""
    for _, path, _ in corpus.documents:
        try:
            with open(path, "rb") as doc:
                chunk = doc.read(CHUNK_BYTES)
                if corpus.skip_binary and looks_binary(chunk):
                    continue
                decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
                while chunk:
                    yield decoder.decode(chunk)
                    chunk = doc.read(CHUNK_BYTES)
                yield decoder.decode(b"", final=True)
        except OSError as error:
            raise unreadable(path, error) from error


def signature(st: os.stat_result) -> tuple[int, int, int]:
    """What changes whenever a file's content does: size, modification and status-change time (ns)."""
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns


def unreadable(path: Path | str, error: OSError) -> ValueError:
    return ValueError(f"data.source: cannot read {path} ({error.strerror or error}); make it readable, or move it "
                      "out of the corpus")


def _is_hidden(name: str) -> bool:
    return name.startswith(".")


def _walk(root: Path, keep: Callable[[str], bool], prune: Callable[[str], bool]) -> list[Document]:
    """Regular files under ``root`` whose name passes ``keep``, sorted by relative posix path.

    Sorting by the relative path string (not walk order, which depends on the file system) makes
    the corpus, and so the token stream, identical on every machine with the same files. A folder
    or file that cannot be listed or looked at is an error: the corpus would silently lack it.
    """

    def refuse(error: OSError) -> None:
        raise unreadable(error.filename, error)

    found = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=refuse):
        dirnames[:] = [name for name in dirnames if not prune(name)]
        for name in filenames:
            if not keep(name):
                continue
            path = Path(dirpath, name)
            try:
                st = path.stat()
            except OSError as error:
                raise unreadable(path, error) from error
            if stat.S_ISREG(st.st_mode):
                found.append((path.relative_to(root).as_posix(), path, st))
    return sorted(found, key=lambda doc: doc[0])
