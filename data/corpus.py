"""A text corpus: which documents ``data.source`` names, in an order every machine agrees on.

``"stdlib"`` is the running Python's standard-library ``.py`` sources; a folder is every non-hidden regular
file under it; a file is itself. Each file is read in the format its name says (``data/formats.py``: text, jsonl,
json, parquet, arrow, each optionally gzip or zstd); one in no format taken is an error unless ``data.skip``
names it. The listing carries what identifies it (the root and every file's relative
path and stat signature), which ``data/cache.py`` hashes into the name of the token cache. Both the token
cache and the tokenizer trainer (``data/tokenizer.py``) read the documents from here, so they see the
same text in the same order.
"""

from __future__ import annotations

import codecs
import fnmatch
import os
import re
import stat
import sys
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from data.formats import FORMATS_TAKEN, format_of, read_documents, sniff_text

VALID_SOURCES = "use 'stdlib', a file or folder of text, jsonl, json, parquet or arrow files, or a .bin file"
# A folder ``save_to_disk`` wrote holds these beside its .arrow files: the dataset's metadata, not documents.
DATASETS_METADATA = ("state.json", "dataset_info.json")
# Listed at most this many names in one message; the count says how many more.
NAMES_SHOWN = 10


class Document(NamedTuple):
    """One corpus file: its relative posix path, absolute path, stat when listed, format and compression."""

    rel: str
    path: Path
    stat: os.stat_result
    kind: str = "text"  # data/formats.py: text, jsonl, json, parquet, arrow
    compression: str | None = None


@dataclass(frozen=True)
class Corpus:
    """The documents of a text source, sorted by relative path, and what identifies the listing."""

    documents: list[Document]
    label: str  # a readable prefix for cache file names
    key: list  # JSON-serialisable: the root and every document's (path, size, mtime, ctime), how records are read
    text_key: str = "text"  # the field or column records give their text from
    skipped: tuple[str, ...] = ()  # relative paths data.skip left out


def list_corpus(source: str, text_key: str = "text", skip: Sequence[str] = ()) -> Corpus:
    """The documents of ``source`` ("stdlib", a file or a folder); a ValueError naming it otherwise.

    Each file's format comes from its name (``data/formats.py``). A file that is in no format taken here, or
    that is named as text but holds binary data, is an error naming it (every such file, up to ten, and the
    count), unless it matches one of the ``skip`` glob patterns (``data.skip``, matched against the relative
    path and the file name), which lists it in ``Corpus.skipped`` instead.
    """
    if source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        # Third-party packages installed into the interpreter are not the standard library, and
        # would make the corpus differ between machines.
        docs = _walk(
            root,
            keep=lambda name: name.endswith(".py"),
            prune=lambda name: name in ("site-packages", "dist-packages"),
        )
        key = [sys.version, str(root), [(doc.rel, *signature(doc.stat)) for doc in docs]]
        return Corpus(docs, "stdlib", key)
    path = Path(source).resolve()
    if path.is_dir():
        _refuse_dataset_dict(path, source)
        # Hidden entries (.git, .cache, editor files) are not corpus text; skipping them also keeps
        # a cache_dir inside the folder from changing the folder's own hash on every call.
        found = _walk(path, keep=lambda name: not _is_hidden(name), prune=_is_hidden)
    elif path.is_file():
        found = [Document(path.name, path, path.stat())]
    else:
        raise ValueError(f"data.source={source!r}: no such file or folder; {VALID_SOURCES}")
    docs, skipped, refused = [], [], []
    for doc in found:
        if any(fnmatch.fnmatch(doc.rel, pattern) or fnmatch.fnmatch(doc.path.name, pattern) for pattern in skip):
            skipped.append(doc.rel)
            continue
        if doc.path.name in DATASETS_METADATA and (doc.path.parent / "state.json").is_file():
            continue
        kind, compression = format_of(doc.path.name)
        try:
            binary = kind == "text" and not sniff_text(doc.path, compression)
        except OSError as error:
            raise unreadable(doc.path, error) from error
        if kind in ("unsupported", "bin") or binary:
            refused.append(doc.rel + (" (a pre-tokenised .bin is a source of its own)" if kind == "bin" else ""))
            continue
        docs.append(doc._replace(kind=kind, compression=compression))
    if refused:
        shown = "; ".join(refused[:NAMES_SHOWN]) + (f"; and {len(refused) - NAMES_SHOWN} more"
                                                     if len(refused) > NAMES_SHOWN else "")
        raise ValueError(f"data.source={source!r}: {len(refused)} file(s) in no format taken here: {shown}. "
                         f"Formats taken: {FORMATS_TAKEN}. Convert or move them, or leave them out with data.skip "
                         "(glob patterns, e.g. ['*.png'])")
    key: list = [str(path), [(doc.rel, *signature(doc.stat)) for doc in docs]]
    if any(doc.kind != "text" or doc.compression for doc in docs):
        key.append(["formats-v1", text_key])  # plain-text corpora keep the caches they have always had
    label = "text-" + re.sub(r"[^A-Za-z0-9_.-]", "_", path.name)[:40]
    return Corpus(docs, label, key, text_key, tuple(skipped))


def skipped_message(source: str, corpus: Corpus) -> str | None:
    """The line a run prints at start when ``data.skip`` left files out, or None."""
    if not corpus.skipped:
        return None
    shown = ", ".join(corpus.skipped[:NAMES_SHOWN]) + (", ..." if len(corpus.skipped) > NAMES_SHOWN else "")
    return f"data.skip: left out {len(corpus.skipped)} file(s) of {source}: {shown}"


def document_texts(corpus: Corpus) -> Iterator[str]:
    """Each document's content as ``str`` (UTF-8, undecodable bytes of text files replaced), in corpus order, read
    in chunks. For the tokenizer trainer; the token cache reads the files itself (``data/cache.py``), checking
    each against its listed signature."""
    for doc in corpus.documents:
        try:
            for chunks in read_documents(doc.path, doc.kind, doc.compression, corpus.text_key):
                decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
                for chunk in chunks:
                    yield decoder.decode(chunk)
                yield decoder.decode(b"", final=True)
        except OSError as error:
            raise unreadable(doc.path, error) from error


def signature(st: os.stat_result) -> tuple[int, int, int]:
    """What changes whenever a file's content does: size, modification and status-change time (ns)."""
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns


def unreadable(path: Path | str, error: OSError) -> ValueError:
    return ValueError(f"data.source: cannot read {path} ({error.strerror or error}); make it readable, or move it "
                      "out of the corpus")


def _is_hidden(name: str) -> bool:
    return name.startswith(".")


def _refuse_dataset_dict(path: Path, source: str) -> None:
    """A ``DatasetDict`` folder holds several splits (train, test...): training on all of them at once would train
    on the test split, so one must be named."""
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
        raise ValueError(f"data.source={source!r}: a datasets DatasetDict with splits {', '.join(splits) or 'none'}; "
                         f"name one split's folder, e.g. data.source={str(path / (splits[0] if splits else 'train'))}")


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
                found.append(Document(path.relative_to(root).as_posix(), path, st))
    return sorted(found, key=lambda doc: doc.rel)
